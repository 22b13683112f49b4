use super::*;

const CAPS: Caps = Caps {
    count: 100,
    bytes: 10_000,
    tenant_count: 10,
    tenant_bytes: 1_000,
    tenants: 4,
};

fn w(cost: u64, item: &'static str) -> Waiter<&'static str> {
    Waiter {
        seq: 0,
        bytes: 10,
        cost,
        weight: 1.0,
        since: Instant::now(),
        objective: 0,
        item,
    }
}

fn drain(q: &mut Queue<&'static str>) -> Vec<&'static str> {
    let mut out = Vec::new();
    while let Some((_, w)) = q.next(&mut 100, |_| true, |_| false) {
        out.push(w.item);
    }
    out
}

#[test]
fn higher_bands_go_first_and_a_tenant_is_first_come_first_served() {
    let mut q = Queue::new(2, CAPS);
    let a = q.tenant("a");
    q.push(1, &a, w(1, "a-low-1")).unwrap();
    q.push(1, &a, w(1, "a-low-2")).unwrap();
    q.push(0, &a, w(1, "a-high")).unwrap();
    assert_eq!(q.len(), 3);
    assert_eq!(drain(&mut q), ["a-high", "a-low-1", "a-low-2"]);
    assert_eq!(q.len(), 0);
    assert_eq!(a.queued.load(Relaxed), 0);
}

#[test]
fn within_a_band_the_tenant_that_cost_least_goes_next() {
    let mut q = Queue::new(1, CAPS);
    let (heavy, light) = (q.tenant("heavy"), q.tenant("light"));
    for _ in 0..5 {
        q.push(0, &heavy, w(1000, "heavy")).unwrap();
    }
    q.push(0, &light, w(10, "light")).unwrap();
    q.push(0, &light, w(10, "light")).unwrap();
    // heavy's first costs 1000 (ties broken by position); light then goes twice before heavy.
    let order = drain(&mut q);
    let first_heavy = order.iter().position(|x| *x == "heavy").unwrap();
    let lights: Vec<_> = (order.iter().enumerate())
        .filter(|(_, x)| **x == "light")
        .map(|(i, _)| i)
        .collect();
    assert!(lights.iter().all(|&i| i <= first_heavy + 2), "{order:?}");
    assert_eq!(heavy.tokens.load(Relaxed), 5000);
    // Output tokens charged as they stream count too.
    light.charge(0, 100_000, 1.0);
    q.push(0, &heavy, w(1, "heavy")).unwrap();
    q.push(0, &light, w(1, "light")).unwrap();
    assert_eq!(drain(&mut q), ["heavy", "light"]);
}

#[test]
fn weights_scale_the_share() {
    let mut q: Queue<()> = Queue::new(1, CAPS);
    let (a, b) = (q.tenant("a"), q.tenant("b"));
    a.charge(0, 100, 4.0);
    b.charge(0, 100, 1.0);
    assert_eq!(a.vtime(0) * 4, b.vtime(0));
}

#[test]
fn a_tenant_back_from_idle_starts_level_with_the_least_served() {
    let mut q = Queue::new(1, CAPS);
    let (busy, idle) = (q.tenant("busy"), q.tenant("idle"));
    busy.charge(0, 5000, 1.0);
    q.push(0, &busy, w(1, "busy")).unwrap();
    q.push(0, &idle, w(1, "idle")).unwrap();
    assert_eq!(idle.vtime(0), busy.vtime(0));
}

#[test]
fn a_head_that_does_not_fit_passes_its_tenant_over_not_the_others() {
    let mut q = Queue::new(2, CAPS);
    let (a, b) = (q.tenant("a"), q.tenant("b"));
    q.push(0, &a, w(1, "a-blocked")).unwrap();
    q.push(0, &a, w(1, "a-behind")).unwrap();
    q.push(1, &b, w(1, "b")).unwrap();
    let got = q
        .next(&mut 100, |w| w.item != "a-blocked", |_| false)
        .map(|(_, w)| w.item);
    assert_eq!(got, Some("b"));
    assert_eq!(
        q.next(&mut 100, |w| w.item != "a-blocked", |_| false)
            .map(|x| x.1.item),
        None
    );
    // The look is bounded.
    assert!(q.next(&mut 0, |_| true, |_| false).is_none());
}

#[test]
fn caps_hold_for_all_and_per_tenant() {
    let caps = Caps {
        count: 3,
        tenant_count: 2,
        ..CAPS
    };
    let mut q = Queue::new(1, caps);
    let (a, b) = (q.tenant("a"), q.tenant("b"));
    q.push(0, &a, w(1, "1")).unwrap();
    q.push(0, &a, w(1, "2")).unwrap();
    assert_eq!(q.push(0, &a, w(1, "3")).unwrap_err().0, Full::Tenant);
    q.push(0, &b, w(1, "3")).unwrap();
    assert_eq!(q.push(0, &b, w(1, "4")).unwrap_err().0, Full::All);
    let mut big = w(1, "big");
    big.bytes = 2_000;
    let mut q2 = Queue::new(1, CAPS);
    let c = q2.tenant("c");
    assert_eq!(q2.push(0, &c, big).unwrap_err().0, Full::Tenant);
}

#[test]
fn removal_and_take_all_keep_the_counts() {
    let mut q = Queue::new(1, CAPS);
    let a = q.tenant("a");
    let s1 = q.push(0, &a, w(1, "1")).unwrap();
    q.push(0, &a, w(1, "2")).unwrap();
    assert_eq!(q.remove(0, &a, s1).map(|w| w.item), Some("1"));
    assert!(q.remove(0, &a, s1).is_none());
    assert_eq!((q.len(), q.bytes()), (1, 10));
    assert_eq!(q.take_all().len(), 1);
    assert_eq!((q.len(), q.bytes(), a.queued.load(Relaxed)), (0, 0, 0));
}

#[test]
fn the_tenant_table_is_bounded() {
    let mut q: Queue<&str> = Queue::new(1, CAPS);
    let busy: Vec<_> = (0..4).map(|i| q.tenant(&format!("t{i}"))).collect();
    for t in &busy {
        t.in_flight.fetch_add(1, Relaxed);
    }
    // Full of busy tenants: a new one shares the overflow tenant.
    assert_eq!(&*q.tenant("new").name, OVERFLOW);
    // One goes idle: it is forgotten and the newcomer gets its own.
    busy[0].in_flight.fetch_sub(1, Relaxed);
    assert_eq!(&*q.tenant("new").name, "new");
    assert_eq!(q.tenants().count(), 5);
}

#[test]
fn a_request_better_placed_goes_first_within_its_band_only() {
    let mut q = Queue::new(2, CAPS);
    let (a, b, c) = (q.tenant("a"), q.tenant("b"), q.tenant("c"));
    q.push(1, &a, w(1, "a")).unwrap();
    q.push(1, &b, w(1, "b-cached")).unwrap();
    let prefer = |w: &Waiter<&str>| w.item.ends_with("cached");
    assert_eq!(
        q.next(&mut 100, |_| true, prefer).map(|x| x.1.item),
        Some("b-cached")
    );
    // A higher band goes first whatever is better placed below it.
    q.push(0, &c, w(1, "c")).unwrap();
    q.push(1, &b, w(1, "b-cached")).unwrap();
    assert_eq!(
        q.next(&mut 100, |_| true, prefer).map(|x| x.1.item),
        Some("c")
    );
    assert_eq!(
        q.next(&mut 100, |_| true, prefer).map(|x| x.1.item),
        Some("b-cached")
    );
    assert_eq!(
        q.next(&mut 100, |_| true, prefer).map(|x| x.1.item),
        Some("a")
    );
}
