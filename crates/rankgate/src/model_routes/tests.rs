use proptest::prelude::*;
// Named: proptest's prelude has an `Rng` of its own rand.
use rand::{Rng, SeedableRng};

use super::*;

fn route(weights: &[u32]) -> Route {
    let targets = (weights.iter().enumerate())
        .map(|(i, &w)| (format!("model-{i}"), w))
        .collect();
    Route::new("chat", targets, None)
}

/// The share of `n` draws (or keys) that land on each target.
fn shares(n: u32, mut pick: impl FnMut(u32) -> usize, targets: usize) -> Vec<f64> {
    let mut counts = vec![0u32; targets];
    for i in 0..n {
        counts[pick(i)] += 1;
    }
    counts
        .iter()
        .map(|&c| f64::from(c) / f64::from(n))
        .collect()
}

#[test]
fn draws_split_by_weight() {
    let r = route(&[90, 10]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let s = shares(10_000, |_| r.by_draw(rng_draw(&mut rng, 100)), 2);
    assert!((0.08..0.12).contains(&s[1]), "{s:?}");
    // Every draw has its target: 0..89 the first, 90..99 the second.
    assert_eq!(
        (r.by_draw(0), r.by_draw(89), r.by_draw(90), r.by_draw(99)),
        (0, 0, 1, 1)
    );
}

fn rng_draw(rng: &mut rand::rngs::StdRng, total: u64) -> u64 {
    rng.random_range(0..total)
}

#[test]
fn keys_split_by_weight_too() {
    let r = route(&[90, 10]);
    let s = shares(20_000, |i| r.by_key(format!("tenant-{i}").as_bytes()), 2);
    assert!((0.08..0.12).contains(&s[1]), "{s:?}");
    let r = route(&[1, 1, 2]);
    let s = shares(20_000, |i| r.by_key(format!("t{i}").as_bytes()), 3);
    assert!(
        (0.22..0.28).contains(&s[0]) && (0.46..0.54).contains(&s[2]),
        "{s:?}"
    );
}

#[test]
fn choose_counts_what_it_chose_and_a_reload_carries_the_count() {
    let r = Routes::new(vec![route(&[0, 5])]);
    let chat = r.get("chat").unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for _ in 0..3 {
        assert_eq!(&*chat.choose(None, &mut rng).model, "model-1");
    }
    assert_eq!(&*chat.choose(Some(b"tenant"), &mut rng).model, "model-1");
    assert_eq!((chat.targets[0].served(), chat.targets[1].served()), (0, 4));
    // A reload moving weight keeps the counters of the targets that stay.
    let next = Routes::new(vec![route(&[5, 5, 1])]).carry(&r);
    assert_ne!(next, r, "the weights changed");
    let chat = next.get("chat").unwrap();
    let served: Vec<u64> = chat.targets.iter().map(Target::served).collect();
    assert_eq!(served, [0, 4, 0]);
    assert!(next.get("other").is_none() && !next.is_empty());
    assert_eq!(
        chat.entry()["targets"][2],
        json!({"model": "model-2", "weight": 1})
    );
    assert_eq!(chat.entry()["owned_by"], "rankgate");
}

/// The hash is fixed (no per-process seed): these keys go where they went when this was written,
/// on every replica and after every restart.
#[test]
fn the_sticky_hash_is_the_same_in_every_process() {
    let r = route(&[1, 1, 1, 1]);
    let got: Vec<usize> = ["a", "b", "c", "tenant-42", ""]
        .iter()
        .map(|k| r.by_key(k.as_bytes()))
        .collect();
    assert_eq!(got, FIXED);
}

/// What [`the_sticky_hash_is_the_same_in_every_process`] found when it was written.
const FIXED: [usize; 5] = [1, 2, 2, 0, 1];

fn weights() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(prop_oneof![Just(0u32), 1u32..1_000], 1..8)
        .prop_filter("some weight above 0", |w| w.iter().any(|&w| w > 0))
}

proptest! {
    #[test]
    fn a_weight_0_target_is_never_chosen(w in weights(), draw in any::<u64>(), key in any::<Vec<u8>>()) {
        let r = route(&w);
        let total: u64 = w.iter().map(|&w| u64::from(w)).sum();
        prop_assert!(w[r.by_draw(draw % total)] > 0);
        prop_assert!(w[r.by_key(&key)] > 0);
    }

    #[test]
    fn a_sticky_key_stays_where_it_is(w in weights(), key in any::<Vec<u8>>()) {
        // The same key, the same table built again (a reload that changed nothing): the same target.
        let first = route(&w).by_key(&key);
        prop_assert_eq!(route(&w).by_key(&key), first);
    }

    #[test]
    fn raising_one_weight_moves_keys_only_to_it(
        w in weights(), which in any::<prop::sample::Index>(), more in 1u32..1_000, keys in prop::collection::vec(any::<u64>(), 1..64),
    ) {
        let j = which.index(w.len());
        let mut raised = w.clone();
        raised[j] += more;
        let (before, after) = (route(&w), route(&raised));
        for k in keys {
            let (a, b) = (before.by_key(&k.to_le_bytes()), after.by_key(&k.to_le_bytes()));
            // Rendezvous hashing: a key moves only to the target whose weight rose.
            prop_assert!(a == b || b == j, "key {k} moved from {a} to {b}, not to {j}");
        }
    }
}
