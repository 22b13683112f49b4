//! The admission tables' choices, on paused time.

use super::*;
use std::time::Duration;

fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

/// A connection the door has not given a slot yet (it waits in an accept loop, one of
/// several with thread-per-core) is never the one a full door closes: closing it frees no
/// slot, and the accept loops all waited for one that never came.
#[tokio::test(start_paused = true)]
async fn a_full_door_closes_only_connections_holding_a_slot() {
    let adm = Admission::new(2, 2, 64);
    let (a, b) = (Arc::new(Activity::new()), Arc::new(Activity::new()));
    assert!(matches!(adm.admit(ip(2), &a), Place::Now));
    assert!(matches!(adm.admit(ip(3), &b), Place::Now));
    adm.holds_slot(&b);
    tokio::time::advance(REPLACEABLE_AFTER).await;
    // `a`, older, still waits for its slot: `b` goes.
    assert!(matches!(adm.replace_oldest(), Replace::Done));
    assert!(a.waiting() && !b.waiting());
    // Nothing else holds a slot.
    assert!(matches!(adm.replace_oldest(), Replace::AllServing));
    assert!(a.waiting());
}

/// A queued connection that took a place has left the queue: a newcomer replacing the
/// queue's oldest passes it over. Replaced as if queued, it handed its place to a newcomer
/// that only queued, and the place was never given back.
#[tokio::test(start_paused = true)]
async fn a_connection_that_took_a_place_is_not_replaced_as_queued() {
    let adm = Arc::new(Admission::new(16, 2, 64));
    let mut tickets = Vec::new();
    let conn = |tickets: &mut Vec<Ticket>, expect: fn(&Place) -> bool| {
        let a = Arc::new(Activity::new());
        let place = adm.admit(ip(2), &a);
        assert!(expect(&place));
        if !matches!(place, Place::Refused) {
            tickets.push(Ticket::new(&adm, ip(2), &a));
        }
        a
    };
    let now = |p: &Place| matches!(p, Place::Now);
    let wait = |p: &Place| matches!(p, Place::Wait(_));
    let (b1, b2) = (conn(&mut tickets, now), conn(&mut tickets, now));
    let (g1, g2) = (b1.begin(), b2.begin());
    let q1 = conn(&mut tickets, wait);
    tokio::time::advance(REPLACEABLE_AFTER * 2).await;
    // b1 ends: a newcomer takes its place before q1 looks.
    drop(g1);
    drop(tickets.remove(0));
    let x = conn(&mut tickets, now);
    // b2 ends: q1 takes its place.
    drop(g2);
    drop(tickets.remove(0));
    assert!(adm.take_place(ip(2), &q1));
    // Two newcomers queue (x is too young to replace), a third finds the queue full and
    // takes the spot of its oldest still queued, n1, passing over q1, no longer queued.
    let (n1, n2) = (conn(&mut tickets, wait), conn(&mut tickets, wait));
    let _n3 = conn(&mut tickets, wait);
    assert!(q1.waiting() && !n1.waiting() && n2.waiting() && x.waiting());
    drop(tickets);
    // Every place given back: the address holds none.
    assert_eq!(adm.clients(), 0);
}

/// A connection that served a request and then idles, with `ip`'s place.
fn served(adm: &Arc<Admission>, ip: IpAddr) -> (Arc<Activity>, Ticket) {
    let a = Arc::new(Activity::new());
    assert!(matches!(adm.admit(ip, &a), Place::Now));
    adm.holds_slot(&a);
    drop(a.begin());
    let t = Ticket::new(adm, ip, &a);
    (a, t)
}

/// An address at its limit whose connections all idle between requests: a newcomer takes the
/// place of the one idle the longest, never of one with a request in progress.
#[tokio::test(start_paused = true)]
async fn an_address_at_its_limit_reclaims_its_longest_idle_connection() {
    let adm = Arc::new(Admission::new(16, 3, 64));
    let (old, _t1) = served(&adm, ip(2));
    tokio::time::advance(Duration::from_secs(1)).await;
    let (busy, _t2) = served(&adm, ip(2));
    let in_progress = busy.begin();
    tokio::time::advance(Duration::from_secs(1)).await;
    let (young, _t3) = served(&adm, ip(2));
    // `busy` went idle first of all but is in a request now: `old` goes.
    let n = Arc::new(Activity::new());
    assert!(matches!(adm.admit(ip(2), &n), Place::Now));
    assert!(old.told_to_close() && !busy.told_to_close() && !young.told_to_close());
    assert_eq!(adm.reclaimed.load(Relaxed), 1);
    // The newcomer has not begun a request: still too young to replace; `young` is next.
    let m = Arc::new(Activity::new());
    assert!(matches!(adm.admit(ip(2), &m), Place::Now));
    assert!(young.told_to_close() && !busy.told_to_close());
    // Nothing idle left but the two newcomers, too young: the next one waits.
    assert!(matches!(
        adm.admit(ip(2), &Arc::new(Activity::new())),
        Place::Wait(_)
    ));
    drop(in_progress);
}

/// A full door closes an idle connection of the address holding the most places, and never
/// one in a request.
#[tokio::test(start_paused = true)]
async fn a_full_door_reclaims_from_the_address_holding_the_most() {
    let adm = Arc::new(Admission::new(4, 4, 64));
    let (small, _t1) = served(&adm, ip(2));
    tokio::time::advance(Duration::from_secs(1)).await;
    let (big1, _t2) = served(&adm, ip(3));
    let (big2, _t3) = served(&adm, ip(3));
    let (big3, _t4) = served(&adm, ip(3));
    let g1 = big1.begin();
    // `small` idled longest, but 127.0.0.3 holds three places: its idle ones go first.
    assert!(matches!(adm.replace_oldest(), Replace::Done));
    assert!(big2.told_to_close() && !small.told_to_close() && !big1.told_to_close());
    assert!(matches!(adm.replace_oldest(), Replace::Done));
    assert!(big3.told_to_close());
    // 127.0.0.3's last is busy: 127.0.0.2's idle one goes, then nothing is left.
    assert!(matches!(adm.replace_oldest(), Replace::Done));
    assert!(small.told_to_close() && !big1.told_to_close());
    assert!(matches!(adm.replace_oldest(), Replace::AllServing));
    drop(g1);
}

/// IPv6 clients of one /64 share one count; another /64 is another client.
#[tokio::test(start_paused = true)]
async fn ipv6_clients_of_one_prefix_share_their_places() {
    let adm = Admission::new(16, 2, 64);
    let key = |s: &str| adm.key(s.parse().unwrap());
    for host in ["2001:db8::1", "2001:db8::2"] {
        assert!(matches!(
            adm.admit(key(host), &Arc::new(Activity::new())),
            Place::Now
        ));
    }
    assert!(matches!(
        adm.admit(key("2001:db8::ffff"), &Arc::new(Activity::new())),
        Place::Wait(_)
    ));
    assert!(matches!(
        adm.admit(key("2001:db8:0:1::1"), &Arc::new(Activity::new())),
        Place::Now
    ));
}

/// A queued connection that has sent its request takes the place of its address's oldest
/// connection that has said nothing, however young; one that spoke is never the one taken
/// over, nor replaced in the queue by a newcomer.
#[tokio::test(start_paused = true)]
async fn a_queued_connection_that_spoke_takes_over_a_silent_one() {
    let adm = Arc::new(Admission::new(16, 2, 64));
    let (talker, silent) = (Arc::new(Activity::new()), Arc::new(Activity::new()));
    assert!(matches!(adm.admit(ip(2), &talker), Place::Now));
    talker.spoke();
    assert!(matches!(adm.admit(ip(2), &silent), Place::Now));
    // Both young: the newcomer queues.
    let q = Arc::new(Activity::new());
    assert!(matches!(adm.admit(ip(2), &q), Place::Wait(_)));
    let _tq = Ticket::new(&adm, ip(2), &q);
    // It speaks: it takes `silent`'s place, not `talker`'s.
    q.spoke();
    assert!(adm.take_over(ip(2), &q));
    assert!(!silent.waiting() && talker.waiting() && q.is_placed());
    // A second one that speaks finds no silent connection left: it waits, and newcomers
    // that fill the queue never replace it.
    let q2 = Arc::new(Activity::new());
    assert!(matches!(adm.admit(ip(2), &q2), Place::Wait(_)));
    q2.spoke();
    assert!(!adm.take_over(ip(2), &q2));
    let q3 = Arc::new(Activity::new());
    assert!(matches!(adm.admit(ip(2), &q3), Place::Wait(_)));
    assert!(matches!(
        adm.admit(ip(2), &Arc::new(Activity::new())),
        Place::Wait(_)
    ));
    assert!(q2.waiting() && !q3.waiting());
}
