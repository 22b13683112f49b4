//! The rank's LoRA rule, tested alone: a request without a slot is set aside, not blocking;
//! a batch runs at most `max_loras` adapters; a slot load stalls the rank once.

use std::time::Duration;

use super::*;

const LOAD: Duration = Duration::from_millis(25);

/// vLLM's queue (in order, 8 running at most) with `max_loras` slots.
fn lora_rank(max_loras: u32) -> Rank {
    Rank::new(0, 10_000, 0.0)
        .with_queueing(Queueing {
            max_running: 8,
            in_order: true,
        })
        .with_lora(max_loras, LOAD)
}

async fn poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
    tokio::select! {
        biased;
        out = f => Some(out),
        _ = std::future::ready(()) => None,
    }
}

fn ask(rank: &Rank, adapter: Option<u32>) -> impl std::future::Future<Output = Admission<'_>> {
    rank.admit_adapter(10, None, 10, 0, adapter)
}

#[tokio::test]
async fn a_request_without_a_slot_is_set_aside_and_those_behind_it_start() {
    let rank = lora_rank(1);
    let a = ask(&rank, Some(1)).await;
    let mut b = Box::pin(ask(&rank, Some(2)));
    assert!(poll_once(b.as_mut()).await.is_none(), "the one slot runs 1");
    // Behind b in arrival order, and not held back by it: vLLM skips b and goes on.
    let same = poll_once(Box::pin(ask(&rank, Some(1)))).await;
    let base = poll_once(Box::pin(ask(&rank, None))).await;
    assert!(same.is_some() && base.is_some());
    let c = rank.counts();
    assert_eq!((c.running, c.waiting), (3, 1));
    assert_eq!((c.lora.deferred, c.lora.waits), (1, 1));
    drop((a, same));
    // A base-model request does not take a slot: with adapter 1 gone, b starts.
    let b = b.await;
    assert_eq!(rank.lora_batch(), [2]);
    let c = rank.counts();
    assert_eq!((c.waiting, c.lora.deferred, c.lora.waits), (0, 0, 1));
    drop((b, base));
    assert!(rank.lora_batch().is_empty());
}

#[tokio::test]
async fn a_batch_runs_at_most_max_loras_adapters() {
    let rank = lora_rank(2);
    let one = ask(&rank, Some(1)).await;
    let two = ask(&rank, Some(2)).await;
    let mut three = Box::pin(ask(&rank, Some(3)));
    let mut four = Box::pin(ask(&rank, Some(4)));
    assert!(poll_once(three.as_mut()).await.is_none());
    assert!(poll_once(four.as_mut()).await.is_none());
    assert_eq!(rank.lora_batch(), [1, 2]);
    assert_eq!(rank.counts().lora.deferred, 2);
    drop(one);
    // One slot frees: the first set aside takes it, the other stays aside.
    let three = three.await;
    assert!(poll_once(four.as_mut()).await.is_none());
    assert_eq!(rank.lora_batch(), [2, 3]);
    drop((two, three));
    let four = four.await;
    assert_eq!(rank.lora_batch(), [4]);
    assert_eq!(rank.counts().lora.waits, 2);
    drop(four);
}

#[tokio::test]
async fn a_request_that_does_not_fit_still_holds_back_those_behind_it() {
    let rank = Rank::new(0, 100, 0.0)
        .with_queueing(Queueing {
            max_running: 8,
            in_order: true,
        })
        .with_lora(1, LOAD);
    let running = rank.admit_adapter(30, None, 30, 0, Some(1)).await;
    let mut aside = Box::pin(rank.admit_adapter(5, None, 5, 0, Some(2)));
    assert!(poll_once(aside.as_mut()).await.is_none());
    // Its adapter is in the batch, but 60 + 60 > 100: the walk stops at it.
    let mut big = Box::pin(rank.admit_adapter(30, None, 30, 0, Some(1)));
    assert!(poll_once(big.as_mut()).await.is_none());
    let mut small = Box::pin(rank.admit_adapter(5, None, 5, 0, None));
    assert!(
        poll_once(small.as_mut()).await.is_none(),
        "it fits, but the large one came first and is not set aside"
    );
    drop(running);
    // The walk now reaches the set-aside request first: its adapter takes the free slot, the
    // large one is set aside in turn, and the small one starts.
    let aside = aside.await;
    let small = small.await;
    assert!(poll_once(big.as_mut()).await.is_none());
    assert_eq!(rank.lora_batch(), [2]);
    drop(aside);
    drop((big.await, small));
}

#[tokio::test(start_paused = true)]
async fn a_slot_load_stalls_the_rank_once_per_load() {
    let rank = lora_rank(1);
    let start = tokio::time::Instant::now();
    let a = ask(&rank, Some(1)).await;
    assert!(a.lora_load);
    assert_eq!(rank.lora_stall_until(), Some(start + LOAD));
    let again = ask(&rank, Some(1)).await;
    assert!(!again.lora_load, "still loaded");
    assert_eq!(rank.lora_stall_until(), Some(start + LOAD), "no new stall");
    drop((a, again));
    tokio::time::advance(Duration::from_secs(1)).await;
    let b = ask(&rank, Some(2)).await;
    assert!(b.lora_load, "the one slot held 1");
    drop(b);
    let a = ask(&rank, Some(1)).await;
    assert!(a.lora_load, "2 evicted it");
    drop(a);
    assert_eq!(rank.counts().lora.loads, 3);

    // Two loads at once stall the steps for both.
    let two = lora_rank(2);
    let now = tokio::time::Instant::now();
    let (x, y) = (ask(&two, Some(1)).await, ask(&two, Some(2)).await);
    assert!(x.lora_load && y.lora_load);
    assert_eq!(two.lora_stall_until(), Some(now + 2 * LOAD));
    drop((x, y));
    // Both still loaded: no load, whichever comes first.
    let (y, x) = (ask(&two, Some(2)).await, ask(&two, Some(1)).await);
    assert!(!x.lora_load && !y.lora_load);
    assert_eq!(two.counts().lora.loads, 2);
}

#[tokio::test]
async fn a_restarted_rank_loads_its_adapters_again() {
    let rank = lora_rank(2);
    drop(ask(&rank, Some(1)).await);
    rank.restart();
    assert!(ask(&rank, Some(1)).await.lora_load);
    assert_eq!(rank.counts().lora.loads, 2);
}

#[tokio::test]
async fn without_adapters_nothing_is_set_aside() {
    let rank = Rank::new(0, 1000, 0.0);
    let a = ask(&rank, Some(1)).await;
    let b = ask(&rank, Some(2)).await;
    assert!(!a.lora_load && !b.lora_load);
    let c = rank.counts();
    assert_eq!((c.running, c.lora.deferred, c.lora.loads), (2, 0, 0));
}
