//! Reading the engines' model lists again at once: a request naming a model that no list names
//! asks for a round, every poller reads its engine's `/v1/models` (a reader that cannot, its
//! engine unreachable, answers with nothing), and the request waits for the round before it is
//! answered 404. An adapter loaded at runtime on an engine then serves from its first request,
//! not a minute later when the periodic read comes round.
//!
//! Anyone who can send a request can name a model that does not exist, so rounds are bounded:
//! one at a time, and a new one only [`MIN_GAP`] after the last began. A request for an unknown
//! model that comes within that gap after a finished round is answered at once (the lists are
//! that fresh); one that comes while a round runs waits for it. A leaf: the publisher and the
//! pollers answer rounds, the proxy asks for them.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// Least time between the starts of two rounds: each costs every engine one `/v1/models`.
pub const MIN_GAP: Duration = Duration::from_secs(1);
/// Longest a request waits for a round: a round takes about two poll intervals, and an engine
/// that hangs on its list must not hold a 404 (a mistyped model) for a whole poll timeout.
pub const WAIT: Duration = Duration::from_secs(2);

/// The rounds asked and done. Round 0 is the start: nothing asked.
#[derive(Debug)]
pub struct Recheck {
    /// When the last round began.
    began: Mutex<Option<Instant>>,
    /// The newest round asked: pollers watch it.
    asked: watch::Sender<u64>,
    /// The newest round whose every answer is in the published catalog.
    done: watch::Sender<u64>,
}

impl Default for Recheck {
    fn default() -> Recheck {
        Recheck {
            began: Mutex::new(None),
            asked: watch::Sender::new(0),
            done: watch::Sender::new(0),
        }
    }
}

impl Recheck {
    /// The round a request for an unlisted model should wait for: the one running, else a new
    /// one; `None` when the last began less than [`MIN_GAP`] ago and is done (the lists are
    /// fresh: the model is not there).
    pub fn ask(&self) -> Option<u64> {
        let mut began = self.began.lock().unwrap_or_else(|p| p.into_inner());
        let (asked, done) = (*self.asked.borrow(), *self.done.borrow());
        if asked > done {
            return Some(asked);
        }
        if began.is_some_and(|b| b.elapsed() < MIN_GAP) {
            return None;
        }
        *began = Some(Instant::now());
        self.asked.send_replace(asked + 1);
        Some(asked + 1)
    }

    /// A round that begins now, whatever ran lately: for a change rankgate made itself (an
    /// adapter it loaded or unloaded, `crate::adapter_loads`), which lists read before it
    /// cannot show. Not for requests: each load or unload, bounded on its own, asks one.
    pub fn force(&self) -> u64 {
        let mut began = self.began.lock().unwrap_or_else(|p| p.into_inner());
        *began = Some(Instant::now());
        let next = *self.asked.borrow() + 1;
        self.asked.send_replace(next);
        next
    }

    /// Waits until round `round` is done, or `limit` passes (an engine that hangs on its list
    /// holds no request past it); true when it is done.
    pub async fn wait(&self, round: u64, limit: Duration) -> bool {
        let mut done = self.done.subscribe();
        tokio::time::timeout(limit, done.wait_for(|&d| d >= round))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// For a poller: the rounds asked.
    pub fn asked(&self) -> watch::Receiver<u64> {
        self.asked.subscribe()
    }

    /// The newest round asked.
    pub fn newest(&self) -> u64 {
        *self.asked.borrow()
    }

    /// For the publisher: every engine's answer to `round` is published.
    pub fn finish(&self, round: u64) {
        self.done.send_if_modified(|d| {
            let newer = round > *d;
            if newer {
                *d = round;
            }
            newer
        });
    }

    /// Whether `round` is done.
    pub fn is_done(&self, round: u64) -> bool {
        *self.done.borrow() >= round
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_round_at_a_time_and_none_within_the_gap_after_one() {
        let r = Recheck::default();
        assert_eq!(r.ask(), Some(1));
        // Running: later asks wait for the same round.
        assert_eq!(r.ask(), Some(1));
        assert!(!r.wait(1, Duration::from_millis(10)).await);
        r.finish(1);
        assert!(r.wait(1, Duration::from_millis(10)).await);
        // Done and fresh: nothing to read again.
        assert_eq!(r.ask(), None);
        tokio::time::advance(MIN_GAP).await;
        assert_eq!(r.ask(), Some(2));
        assert_eq!(r.newest(), 2);
        // An old round finished late changes nothing.
        r.finish(1);
        assert!(!r.is_done(2));
        // A forced round begins even within the gap, and while another runs.
        assert_eq!(r.force(), 3);
        r.finish(3);
        assert_eq!(r.force(), 4);
    }
}
