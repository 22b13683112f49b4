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

async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
    tokio::select! {
        biased;
        out = f => Some(out),
        _ = std::future::ready(()) => None,
    }
}
