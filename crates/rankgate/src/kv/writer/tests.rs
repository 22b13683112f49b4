use super::super::event::Batch;
use super::super::hash::block_hashes;
use super::*;

fn msg(seq: u64, events: Vec<Event>) -> Message {
    Message {
        topic: b"kv".to_vec(),
        seq,
        batch: Batch {
            ts: 0.0,
            events,
            dp_rank: Some(0),
        },
    }
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Event {
    Event::Stored {
        hashes: hashes.to_vec(),
        parent,
        tokens: tokens.to_vec(),
        block_size: 2,
        special: false,
    }
}

fn writer() -> Writer {
    Writer::new(Arc::new(RankIndex::default()))
}

#[test]
fn stores_chain_removals_follow_engine_hashes() {
    let mut w = writer();
    w.apply(&msg(0, vec![stored(&[100, 101], None, &[1, 2, 3, 4])]));
    w.apply(&msg(1, vec![stored(&[102], Some(101), &[5, 6])]));
    let i = w.index().clone();
    let names = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 2);
    assert_eq!(i.block_size(), Some(2));
    assert_eq!(i.matched_blocks(&names), 3);
    w.apply(&msg(
        2,
        vec![Event::Removed {
            hashes: vec![101],
            other_medium: false,
        }],
    ));
    assert_eq!(
        i.matched_blocks(&names),
        1,
        "a prefix stops at the removed block"
    );
    assert_eq!(
        i.state(),
        KvState::Available {
            blocks: 2,
            block_size: 2
        }
    );
}

#[test]
fn a_gap_clears_and_rebuilds_a_restart_starts_exact() {
    let mut w = writer();
    w.set_capacity_tokens(6);
    w.apply(&msg(0, vec![stored(&[100], None, &[1, 2])]));
    w.set_capacity_tokens(6); // block size now known: 3 blocks
    w.apply(&msg(5, vec![stored(&[200], None, &[9, 9])]));
    let i = w.index().clone();
    assert_eq!(i.block_size(), None);
    assert!(
        matches!(i.state(), KvState::Unavailable { reason } if reason.contains("missed events 1..4"))
    );
    assert_eq!(i.matched_blocks(&block_hashes(&[1, 2], 2)), 0, "cleared");
    w.apply(&msg(6, vec![stored(&[201, 202], None, &[7, 7, 8, 8])]));
    assert_eq!(
        i.block_size(),
        Some(2),
        "a whole capacity stored since: rebuilt"
    );
    w.apply(&msg(0, vec![stored(&[300], None, &[4, 4])]));
    assert_eq!(
        i.block_size(),
        Some(2),
        "a restart: exact from its first message"
    );
    assert_eq!(i.matched_blocks(&block_hashes(&[9, 9], 2)), 0);
    assert_eq!(i.matched_blocks(&block_hashes(&[4, 4], 2)), 1);
}

#[test]
fn a_lost_publisher_pauses_and_its_next_message_decides() {
    let mut w = writer();
    w.apply(&msg(0, vec![stored(&[100], None, &[1, 2])]));
    w.lost("publisher gone");
    let i = w.index().clone();
    assert_eq!(i.block_size(), None);
    w.apply(&msg(1, vec![]));
    assert_eq!(i.block_size(), Some(2), "nothing missed: kept");
    assert_eq!(i.matched_blocks(&block_hashes(&[1, 2], 2)), 1);
}

#[test]
fn special_blocks_and_unknown_parents_are_left_out() {
    let mut w = writer();
    let mut lora = stored(&[100], None, &[1, 2]);
    if let Event::Stored { special, .. } = &mut lora {
        *special = true;
    }
    w.apply(&msg(0, vec![lora, stored(&[101], Some(99), &[3, 4])]));
    assert_eq!(w.index().counts.skipped.load(Relaxed), 2);
    assert_eq!(w.index().matched_blocks(&block_hashes(&[1, 2], 2)), 0);
}

#[test]
fn an_endless_store_stream_stays_within_the_ranks_capacity() {
    let mut w = writer();
    w.apply(&msg(0, vec![stored(&[1], None, &[0, 0])]));
    // 1,000 tokens of KV in blocks of 2: 500 blocks, 625 with the slack.
    w.set_capacity_tokens(1000);
    assert_eq!(w.max_blocks(), 625);
    let mut peak = 0;
    let mut resets = 0;
    for seq in 1..=100u64 {
        // 100 new blocks a message, never removed: an engine (or an impostor) claiming
        // 10,000 blocks of a 500-block cache.
        let hashes: Vec<u64> = (seq * 1000..seq * 1000 + 100).collect();
        let tokens: Vec<u32> = (0..200).map(|t| (seq * 1000) as u32 + t).collect();
        w.apply(&msg(seq, vec![stored(&hashes, None, &tokens)]));
        peak = peak.max(w.index().blocks());
        resets = w.index().counts.resets.load(Relaxed);
    }
    assert!(peak <= 625, "held {peak} blocks, over the bound");
    assert!(
        resets >= 10,
        "dropped each time it passed the bound: {resets}"
    );
    assert!(
        w.index().memory_bytes() < 625 * 200,
        "{} bytes",
        w.index().memory_bytes()
    );
}

#[test]
fn without_a_known_capacity_the_index_is_bounded_far_below_the_hard_cap() {
    let mut w = writer();
    let n = UNKNOWN_CAPACITY_MAX_BLOCKS + 1;
    let tokens: Vec<u32> = (0..n as u32 * 2).collect();
    let hashes: Vec<u64> = (10..10 + n as u64).collect();
    w.apply(&msg(0, vec![stored(&hashes, None, &tokens)]));
    assert!(w.index().blocks() <= UNKNOWN_CAPACITY_MAX_BLOCKS);
    assert!(
        matches!(w.index().state(), KvState::Unavailable { reason } if reason.contains("claims more than 262144 blocks")),
        "{:?}",
        w.index().state()
    );
    const { assert!(UNKNOWN_CAPACITY_MAX_BLOCKS * 16 <= MAX_BLOCKS) };
}

#[test]
fn the_table_grows_past_its_first_size() {
    let mut w = writer();
    let tokens: Vec<u32> = (0..20_000).collect();
    let hashes: Vec<u64> = (1000..11_000).collect();
    w.apply(&msg(0, vec![stored(&hashes, None, &tokens)]));
    let names = block_hashes(&tokens, 2);
    assert_eq!(w.index().matched_blocks(&names), 10_000);
    assert!(w.index().memory_bytes() > 10_000 * 16);
}
