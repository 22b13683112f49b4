//! Saturation per rank (`[flow]`): how many more requests a rank takes before it is saturated,
//! judged from the telemetry rankgate already has. Flow control holds a request while every
//! rank it may use has no room, and the pick prefers a rank with room.
//!
//! A rank is saturated when
//! - its engine's waiting queue, at the last poll, was longer than `flow.max_waiting` (the
//!   engine queues: whatever rankgate sent now would wait there, where it can neither move to
//!   a rank that frees first nor be overtaken by more urgent work); with `flow.max_running`
//!   set, only when its running and waiting requests together pass the seats too (a real vLLM
//!   shows a request it has just been given as waiting until its next step);
//! - its KV usage, with the requests rankgate sent it since that poll and less those that ended
//!   since, reaches `flow.max_kv` (vLLM queues once its KV is full);
//! - or this router has `flow.max_running` requests in flight on it (the engine's
//!   `--max-num-seqs`, when it is the rank's only client: known at once, no poll behind).
//!
//! A rank without fresh telemetry has no room to judge: it is not counted (unknown is never
//! idle). When none of a request's ranks has fresh telemetry, the pick falls back to the
//! reachable rank with the fewest requests in flight (`routing.no_telemetry =
//! "least_in_flight"`; the telemetry-blind policies always use the reachable ranks), and the
//! room is then judged by what it knows: `flow.max_running` less this
//! router's requests on each reachable rank. Without `max_running`, or where the pick would
//! refuse, such a request is not held (the pick decides). A loaded engine's `/metrics` can be
//! slow for seconds; letting everything through then would fill its queue in a burst.

use tokio::time::Instant;

use super::affinity::Holdings;
use super::avoid::{eligible, Avoid};
use super::dispatch::Selector;
use crate::config::{NoTelemetry, Policy, Saturation};
use crate::prompt::Prompt;
use crate::table::{Fresh, RankView, Table, FRESH_TRICKLE, UNIT_WEIGHT};
use crate::worker::Member;

/// Added to a saturated rank's score: it is picked only when every rank is saturated (a
/// request the queue let through as the last room was taken by another).
pub(super) const SATURATED: f64 = 1.0e6;

/// The requests `member`'s rank takes before it is saturated; `None`: its telemetry is not
/// fresh.
#[inline]
pub(super) fn room_of(
    table: &Table,
    view: &RankView,
    member: &Member,
    now: Instant,
    sat: &Saturation,
) -> Option<u64> {
    let load = view.telemetry.fresh(now, table.stale_after)?;
    let live = &member.live;
    let in_flight = live.in_flight();
    if load.fresh == Some(Fresh::Unproven) {
        // A rank with no gauges yet takes a trickle until they appear.
        return Some(FRESH_TRICKLE.saturating_sub(in_flight));
    }
    // A request the engine has just been given waits there until its next step: with seats
    // known, only waiting that the free seats do not explain is a queue.
    let waiting = load.waiting.unwrap_or(0);
    let queueing = waiting > sat.max_waiting
        && sat.max_running.is_none_or(|max| {
            load.running.unwrap_or(0).saturating_add(waiting) > max.saturating_add(sat.max_waiting)
        });
    if queueing {
        return Some(0);
    }
    // The KV its requests took or freed since its numbers came in: each sent since takes one
    // request's, each ended since frees one's (a request sent and ended since does neither).
    let change = live.in_flight_weight() as f64 - view.in_flight_at_report as f64;
    let kv = load.kv_usage + change / UNIT_WEIGHT as f64 * view.kv_per_request;
    let mut room = match view.kv_per_request > 0.0 {
        // Rounded up (a rank below the limit takes one more), past the floats' noise.
        true => ((sat.max_kv - kv) / view.kv_per_request - 1e-9)
            .ceil()
            .max(0.0) as u64,
        false if kv < sat.max_kv => u64::MAX,
        false => 0,
    };
    if let Some(max) = sat.max_running {
        room = room.min((max as u64).saturating_sub(in_flight));
    }
    Some(room)
}

/// The sum of `rooms`, stopping once it reaches `enough`; `None` when there are none.
fn sum_until(rooms: impl Iterator<Item = u64>, enough: u64) -> Option<u64> {
    let mut total = None;
    for r in rooms {
        let t = total.unwrap_or(0u64).saturating_add(r);
        total = Some(t);
        if t >= enough {
            break;
        }
    }
    total
}

impl Selector {
    /// The room (see [`room_of`]) of every rank `avoid` allows, summed; `None` when none of
    /// them has fresh telemetry, or saturation is not judged (`[flow]` off). The queue asks
    /// [`Selector::room_above`], which stops counting once it knows.
    #[cfg(test)]
    pub fn room(&self, table: &Table, avoid: &Avoid) -> Option<u64> {
        self.room_until(table, avoid, u64::MAX)
    }

    /// Whether the ranks `avoid` allows have more room than `taken` (requests on their way to
    /// them, and the room kept for higher priorities); `None` as for [`Selector::room`]. Stops
    /// at the first ranks that have.
    pub fn room_above(&self, table: &Table, avoid: &Avoid, taken: u64) -> Option<bool> {
        self.room_until(table, avoid, taken.saturating_add(1))
            .map(|r| r > taken)
    }

    /// [`Selector::room`], counted only until it reaches `enough`.
    fn room_until(&self, table: &Table, avoid: &Avoid, enough: u64) -> Option<u64> {
        let sat = self.saturation.as_ref()?;
        let snap = table.snapshot.load();
        let now = Instant::now();
        let fleet = &snap.fleet;
        let ranks = || {
            (fleet.workers.iter().zip(snap.ranks.iter()))
                .filter(|(seat, _)| eligible(fleet, seat, avoid))
        };
        let judged =
            ranks().filter_map(|(seat, view)| room_of(table, view, &seat.member, now, sat));
        if let Some(room) = sum_until(judged, enough) {
            return Some(room);
        }
        // No fresh telemetry: judged as the pick's fallback chooses, by this router's own
        // requests on the reachable ranks, when the seats are known.
        let blind = !(self.policy == Policy::LeastKv && self.no_telemetry == NoTelemetry::Reject);
        let max = sat.max_running.filter(|_| blind)?;
        let seats = (ranks().filter(|(_, view)| view.reachable))
            .map(|(seat, _)| (max as u64).saturating_sub(seat.member.live.in_flight()));
        sum_until(seats, enough)
    }

    /// Whether the rank holding the longest prefix of `prompt`, among those `avoid` allows with
    /// fresh telemetry, has room now; `None` when none holds any of it, or affinity or flow
    /// control is off (the queue then prefers no request to another for where it would go).
    pub fn cached_has_room(&self, table: &Table, avoid: &Avoid, prompt: &Prompt) -> Option<bool> {
        let sat = self.saturation.as_ref()?;
        if self.affinity.is_none() || prompt.is_empty() {
            return None;
        }
        let snap = table.snapshot.load();
        let now = Instant::now();
        let fleet = &snap.fleet;
        let mut holdings = Holdings::new(prompt);
        let mut best: Option<(u64, bool)> = None;
        for (seat, view) in fleet.workers.iter().zip(snap.ranks.iter()) {
            if !eligible(fleet, seat, avoid) {
                continue;
            }
            let Some(room) = room_of(table, view, &seat.member, now, sat) else {
                continue;
            };
            let held = holdings.of(&seat.member).tokens;
            if held > 0 && best.is_none_or(|(most, _)| held > most) {
                best = Some((held, room > 0));
            }
        }
        best.map(|(_, room)| room)
    }
}

#[cfg(test)]
mod tests {
    use tokio::time::Instant;

    use super::super::tests::{available, member, routing, set, table};
    use super::*;
    use crate::config::{NoTelemetry, Policy};
    use crate::table::{RankTelemetry, RankView};

    const LIMITS: Saturation = Saturation {
        max_waiting: 0,
        max_kv: 0.9,
        max_running: None,
    };

    fn judging(sat: Saturation) -> Selector {
        Selector::new(&routing(Policy::LeastKv, NoTelemetry::Reject)).judging(Some(sat))
    }

    fn waiting(kv: f64, waiting: u32, now: Instant) -> RankView {
        let mut v = available(kv, now);
        if let RankTelemetry::Available(l) = &mut v.telemetry {
            l.waiting = Some(waiting);
        }
        v
    }

    #[test]
    fn room_is_kv_headroom_in_requests_less_the_unreported_work() {
        let t = table(2);
        let now = Instant::now();
        // 0.5 below a 0.9 limit at 0.02 a request: 20 more; a queueing rank has none.
        set(&t, vec![available(0.5, now), waiting(0.1, 3, now)]);
        let s = judging(LIMITS);
        assert_eq!(s.room(&t, &Avoid::default()), Some(20));
        // Ten sent since the poll take ten of it (credited at the rank's KV per request).
        let guards: Vec<_> = (0..10)
            .map(|_| s.pick(&t, None, &Avoid::default()).unwrap())
            .collect();
        assert!(guards.iter().all(|p| p.guard.worker() == 0));
        assert_eq!(s.room(&t, &Avoid::default()), Some(10));
        drop(guards);
        assert_eq!(s.room(&t, &Avoid::default()), Some(20));
        // Unknown is never idle: a rank without fresh telemetry has no room to count, and a
        // fleet with none to judge says so.
        set(&t, vec![RankView::initial(), RankView::initial()]);
        assert_eq!(s.room(&t, &Avoid::default()), None);
        // Off: nothing is judged.
        let off = Selector::new(&routing(Policy::LeastKv, NoTelemetry::Reject));
        assert_eq!(off.room(&t, &Avoid::default()), None);
    }

    #[test]
    fn max_running_counts_this_routers_requests_at_once() {
        let t = table(1);
        set(&t, vec![available(0.0, Instant::now())]);
        let s = judging(Saturation {
            max_running: Some(2),
            ..LIMITS
        });
        let a = s.pick(&t, None, &Avoid::default()).unwrap();
        assert_eq!(s.room(&t, &Avoid::default()), Some(1));
        // One on its way (or kept for a higher priority) takes it.
        assert_eq!(s.room_above(&t, &Avoid::default(), 0), Some(true));
        assert_eq!(s.room_above(&t, &Avoid::default(), 1), Some(false));
        let _b = s.pick(&t, None, &Avoid::default()).unwrap();
        assert_eq!(s.room(&t, &Avoid::default()), Some(0));
        drop(a);
        assert_eq!(s.room(&t, &Avoid::default()), Some(1));
    }

    #[test]
    fn with_seats_known_a_request_waiting_for_its_first_step_is_no_queue() {
        let t = table(1);
        let now = Instant::now();
        let mut v = waiting(0.1, 1, now);
        if let RankTelemetry::Available(l) = &mut v.telemetry {
            l.running = Some(2);
        }
        set(&t, vec![v.clone()]);
        let seats = |n| {
            judging(Saturation {
                max_running: Some(n),
                ..LIMITS
            })
        };
        // 2 running + 1 waiting within 4 seats: room (4 seats less nothing in flight here).
        assert_eq!(seats(4).room(&t, &Avoid::default()), Some(4));
        // Past the seats, the engine queues: none.
        assert_eq!(seats(2).room(&t, &Avoid::default()), Some(0));
        // Seats unknown: any waiting is a queue.
        assert_eq!(judging(LIMITS).room(&t, &Avoid::default()), Some(0));
    }

    #[test]
    fn without_fresh_telemetry_the_seats_are_judged_as_the_fallback_picks() {
        let t = table(2);
        // Rank 0 answers its polls but its numbers are stale (a loaded engine's slow
        // `/metrics`); rank 1 does not answer at all.
        let mut stale = RankView::initial();
        stale.reachable = true;
        set(&t, vec![stale, RankView::initial()]);
        let seats = |policy, no_telemetry| {
            Selector::new(&routing(policy, no_telemetry)).judging(Some(Saturation {
                max_running: Some(2),
                ..LIMITS
            }))
        };
        let s = seats(Policy::LeastKv, NoTelemetry::LeastInFlight);
        // The fallback would use the reachable rank only: its two seats, less this router's own.
        assert_eq!(s.room(&t, &Avoid::default()), Some(2));
        let a = s.pick(&t, None, &Avoid::default()).unwrap();
        assert_eq!(a.guard.worker(), 0);
        let _b = s.pick(&t, None, &Avoid::default()).unwrap();
        assert_eq!(s.room(&t, &Avoid::default()), Some(0));
        assert_eq!(s.room_above(&t, &Avoid::default(), 0), Some(false));
        drop(a);
        assert_eq!(s.room(&t, &Avoid::default()), Some(1));
        // The telemetry-blind policies use the reachable ranks too.
        assert_eq!(
            seats(Policy::RoundRobin, NoTelemetry::Reject).room(&t, &Avoid::default()),
            Some(1)
        );
        // Where the pick would refuse, or the seats are unknown, nothing is judged.
        let refuses = seats(Policy::LeastKv, NoTelemetry::Reject);
        assert_eq!(refuses.room(&t, &Avoid::default()), None);
        let unknown = Selector::new(&routing(Policy::LeastKv, NoTelemetry::LeastInFlight))
            .judging(Some(LIMITS));
        assert_eq!(unknown.room(&t, &Avoid::default()), None);
    }

    #[test]
    fn the_pick_passes_over_a_saturated_rank_while_another_has_room() {
        let t = table(2);
        let now = Instant::now();
        // Rank 0 scores better (less KV) but its engine queues.
        set(&t, vec![waiting(0.1, 1, now), available(0.6, now)]);
        let s = judging(LIMITS);
        for _ in 0..20 {
            assert_eq!(
                s.pick(&t, None, &Avoid::default()).unwrap().guard.worker(),
                1
            );
        }
        // Both saturated: the best of them all the same (the request was let through).
        set(&t, vec![waiting(0.1, 1, now), waiting(0.6, 1, now)]);
        assert_eq!(
            s.pick(&t, None, &Avoid::default()).unwrap().guard.worker(),
            0
        );
        assert_eq!(member(&t, 0).live.in_flight(), 0);
    }
}
