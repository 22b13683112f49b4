//! The rank's admission, prefix cache and KV accounting, tested alone.

use super::super::kv::event::KvEvent;
use super::*;

#[tokio::test]
async fn queues_when_full_and_resumes_on_release() {
    let rank = Rank::new(0, 100, 0.5);
    let mut a = rank.admit(20, 20).await;
    a.grow();
    assert_eq!(rank.counts().used, 21);
    assert!((rank.kv_usage() - 0.71).abs() < 1e-9);
    let second = rank.admit(20, 20);
    tokio::pin!(second);
    // 40 + 40 > 50 free: the second request must wait.
    assert!(futures_poll_once(second.as_mut()).await.is_none());
    assert_eq!(rank.counts().waiting, 1);
    drop(a);
    let b = second.await;
    assert_eq!(rank.counts().waiting, 0);
    assert_eq!(rank.counts().running, 1);
    drop(b);
    assert_eq!(rank.counts().reserved, 0);
}

#[tokio::test]
async fn a_request_dropped_in_the_queue_stops_waiting() {
    let rank = Rank::new(0, 100, 0.0);
    let held = rank.admit(50, 50).await;
    let mut queued = Box::pin(rank.admit(10, 10));
    assert!(futures_poll_once(queued.as_mut()).await.is_none());
    assert_eq!(rank.counts().waiting, 1);
    // Its client left: the future is dropped while queued.
    drop(queued);
    assert_eq!(rank.counts().waiting, 0);
    drop(held);
}

/// 4 blocks of 16 tokens, then a 6-token tail.
const IDS: [u64; 4] = [11, 12, 13, 14];

#[tokio::test]
async fn cached_prefix_is_shared_counted_once_and_kept_idle() {
    let rank = Rank::new(0, 1000, 0.0);
    let a = rank.admit_blocks(70, Some(&IDS), 10).await;
    assert_eq!(a.cached_tokens, 0);
    assert_eq!(rank.counts().used, 70);
    // Same 3 leading blocks, then its own.
    let b = rank.admit_blocks(70, Some(&[11, 12, 13, 99]), 10).await;
    assert_eq!(b.cached_tokens, 48);
    let c = rank.counts();
    assert_eq!(c.used, 5 * 16 + 2 * 6, "shared blocks once, tails each");
    assert_eq!((c.prefix_queries, c.prefix_hits), (140, 48));
    drop(a);
    drop(b);
    let c = rank.counts();
    assert_eq!((c.used, c.reserved, c.idle_blocks), (0, 0, 5));
    assert_eq!(rank.kv_usage(), 0.0, "idle cached blocks count as free");
    // A whole cached prompt still recomputes its last token.
    let again = rank.admit_blocks(64, Some(&IDS), 1).await;
    assert_eq!(again.cached_tokens, 63);
}

#[tokio::test]
async fn idle_blocks_are_evicted_lru_within_capacity_and_never_block() {
    // Room for 6 blocks.
    let rank = Rank::new(0, 96, 0.0);
    drop(rank.admit_blocks(64, Some(&IDS), 0).await);
    drop(rank.admit_blocks(32, Some(&[21, 22]), 0).await);
    assert_eq!(rank.counts().idle_blocks, 6);
    // 3 new blocks need 3 idle ones evicted: IDS's tail goes first (released before 21, 22).
    let hold = rank.admit_blocks(48, Some(&[31, 32, 33]), 0).await;
    assert_eq!(rank.counts().idle_blocks, 3);
    assert!(rank.counts().reserved + 3 * 16 <= 96);
    let probe = rank.admit_blocks(32, Some(&[11, 12]), 0).await;
    assert_eq!(probe.cached_tokens, 16, "11 kept, 12 evicted");
    drop(probe);
    drop(hold);
    let c = rank.counts();
    assert!(c.idle_blocks * 16 <= 96, "{c:?}");
}

#[tokio::test]
async fn a_finished_answer_stays_cached_within_capacity() {
    let rank = Rank::new(0, 96, 0.0);
    let mut a = rank.admit_blocks(32, Some(&[1, 2]), 40).await;
    a.keep(vec![1, 2, 3, 4]);
    drop(a);
    assert_eq!(rank.counts().idle_blocks, 4);
    let next = rank.admit_blocks(80, Some(&[1, 2, 3, 4, 5]), 0).await;
    assert_eq!(next.cached_tokens, 64);
    drop(next);
    // Nothing kept past capacity (6 blocks).
    let mut big = rank.admit_blocks(16, Some(&[9]), 0).await;
    big.keep((10..20).collect());
    drop(big);
    assert!(rank.counts().idle_blocks <= 6);
}

#[tokio::test]
async fn events_reach_the_journal_in_order_and_a_restart_starts_it_again() {
    let events = Arc::new(RankEvents::default());
    let rank = Rank::new(0, 96, 0.0).with_events(events.clone());
    let prompt = Blocks::of_tokens(&(0..40).collect::<Vec<u32>>());
    let mut a = rank.admit_prompt(40, Some(&prompt), 8).await;
    let mut kept = prompt.clone();
    kept.ids.push(77);
    kept.tokens.extend(100..116);
    a.keep_blocks(kept);
    drop(a);
    let p = events.take();
    assert_eq!(p.events.len(), 2, "{:?}", p.events);
    assert!(
        matches!(&p.events[1], KvEvent::BlockStored { block_hashes, parent_block_hash, .. }
        if block_hashes == &[77] && *parent_block_hash == Some(prompt.ids[1]))
    );
    assert_eq!(rank.cached_ids().len(), 3);
    // A request in flight across a restart finishes and frees its KV, uncached.
    let held = rank.admit_prompt(40, Some(&prompt), 8).await;
    assert_eq!(held.cached_tokens, 32);
    rank.restart();
    let p = events.take();
    assert!(p.restarted);
    assert_eq!(p.events, vec![KvEvent::AllBlocksCleared]);
    assert!(rank.cached_ids().is_empty());
    let again = rank.admit_prompt(40, Some(&prompt), 8).await;
    assert_eq!(again.cached_tokens, 0, "the restarted cache is empty");
    drop(held);
    drop(again);
    let c = rank.counts();
    assert_eq!((c.used, c.reserved, c.running), (0, 0, 0));
    assert_eq!(
        c.idle_blocks, 2,
        "only the new admission's blocks are cached"
    );
}

/// vLLM's queue: in order, at most `max_running` running.
fn vllm_queue(max_running: u32) -> Queueing {
    Queueing {
        max_running,
        in_order: true,
    }
}

#[tokio::test]
async fn in_order_a_small_request_waits_behind_a_large_one_that_does_not_fit() {
    for in_order in [true, false] {
        let q = Queueing {
            in_order,
            ..vllm_queue(8)
        };
        let rank = Rank::new(0, 100, 0.0).with_queueing(q);
        let running = rank.admit(30, 30).await;
        let mut big = Box::pin(rank.admit(30, 30));
        assert!(
            futures_poll_once(big.as_mut()).await.is_none(),
            "60 + 60 > 100"
        );
        let mut small = Box::pin(rank.admit(5, 5));
        let small_now = futures_poll_once(small.as_mut()).await;
        if !in_order {
            // The SGLang flavor's looser queue: what fits starts.
            assert!(small_now.is_some());
            continue;
        }
        assert!(small_now.is_none(), "it fits, but the large one came first");
        assert_eq!((rank.counts().running, rank.counts().waiting), (1, 2));
        drop(running);
        // The small one is woken too, and still waits until the large one has started.
        assert!(futures_poll_once(small.as_mut()).await.is_none());
        let big = big.await;
        let small = small.await;
        assert_eq!((rank.counts().running, rank.counts().waiting), (2, 0));
        drop((big, small));
    }
}

#[tokio::test]
async fn max_running_caps_the_running_requests_and_the_rest_wait() {
    let rank = Rank::new(0, 1000, 0.0).with_queueing(vllm_queue(2));
    let a = rank.admit(10, 10).await;
    let b = rank.admit(10, 10).await;
    let mut c = Box::pin(rank.admit(10, 10));
    let mut d = Box::pin(rank.admit(10, 10));
    assert!(
        futures_poll_once(c.as_mut()).await.is_none(),
        "KV is plenty"
    );
    assert!(futures_poll_once(d.as_mut()).await.is_none());
    assert_eq!((rank.counts().running, rank.counts().waiting), (2, 2));
    drop(a);
    let c = c.await;
    assert!(futures_poll_once(d.as_mut()).await.is_none());
    assert_eq!((rank.counts().running, rank.counts().waiting), (2, 1));
    drop(b);
    let d = d.await;
    drop((c, d));
    assert_eq!(rank.counts().running, 0);
    // A cap of 0 is taken as 1: a rank always runs something.
    let one = Rank::new(0, 1000, 0.0).with_queueing(vllm_queue(0));
    let _a = one.admit(1, 1).await;
    assert!(futures_poll_once(Box::pin(one.admit(1, 1))).await.is_none());
}

#[tokio::test]
async fn priority_orders_the_queue_lower_first_then_by_arrival() {
    let rank = Rank::new(0, 1000, 0.0).with_queueing(vllm_queue(1));
    let mut current = rank.admit(10, 10).await;
    let mut queued: Vec<_> = [5, 0, 0, -1]
        .into_iter()
        .map(|p| Box::pin(rank.admit_ranked(10, None, 10, p)))
        .collect();
    for q in &mut queued {
        assert!(futures_poll_once(q.as_mut()).await.is_none());
    }
    assert_eq!(rank.counts().waiting, 4);
    let mut started = Vec::new();
    for _ in 0..4 {
        drop(current);
        let mut ready = Vec::new();
        for (i, q) in queued.iter_mut().enumerate() {
            if !started.contains(&i) {
                if let Some(a) = futures_poll_once(q.as_mut()).await {
                    ready.push((i, a));
                }
            }
        }
        assert_eq!(ready.len(), 1, "one at a time: {started:?}");
        let (i, a) = ready.pop().expect("one started");
        started.push(i);
        current = a;
    }
    assert_eq!(started, [3, 1, 2, 0]);
    drop(current);
    assert_eq!(rank.counts().waiting, 0);
}

#[tokio::test]
async fn a_head_of_line_request_that_leaves_lets_the_next_one_start() {
    let rank = Rank::new(0, 100, 0.0).with_queueing(vllm_queue(8));
    let _running = rank.admit(30, 30).await;
    let mut big = Box::pin(rank.admit(30, 30));
    assert!(futures_poll_once(big.as_mut()).await.is_none());
    let mut small = Box::pin(rank.admit(5, 5));
    assert!(futures_poll_once(small.as_mut()).await.is_none());
    // The large one's client left.
    drop(big);
    assert!(futures_poll_once(small.as_mut()).await.is_some());
    assert_eq!(rank.counts().waiting, 0);
}

async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
    tokio::select! {
        biased;
        out = f => Some(out),
        _ = std::future::ready(()) => None,
    }
}
