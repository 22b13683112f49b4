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
            block_size: 2,
            partial: None,
        }
    );
}

#[test]
fn a_gap_clears_to_a_lower_bound_a_restart_starts_exact() {
    let mut w = writer();
    w.set_capacity_tokens(6);
    w.apply(&msg(0, vec![stored(&[100], None, &[1, 2])]));
    w.set_capacity_tokens(6); // block size now known: 3 blocks
    w.apply(&msg(5, vec![stored(&[200], None, &[9, 9])]));
    let i = w.index().clone();
    assert_eq!(i.block_size(), Some(2), "a lower bound, used at once");
    let state = i.state();
    assert!(
        matches!(&state, KvState::Available { partial: Some(p), .. } if p.since == 5 && p.why.contains("missed events 1..4")),
        "{state:?}"
    );
    assert!(state.coverage().unwrap().starts_with("partial since 5"));
    assert_eq!(i.matched_blocks(&block_hashes(&[1, 2], 2)), 0, "cleared");
    assert_eq!(i.matched_blocks(&block_hashes(&[9, 9], 2)), 1, "seen since");
    w.apply(&msg(6, vec![stored(&[201, 202], None, &[7, 7, 8, 8])]));
    assert!(
        matches!(i.state(), KvState::Available { partial: None, .. }),
        "a whole capacity stored since: complete"
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
        matches!(w.index().state(), KvState::Available { partial: Some(p), .. } if p.why.contains("claims more than 262144 blocks")),
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

#[test]
fn a_replay_is_asked_for_a_gap_or_a_late_join_and_not_again_soon_after_failing() {
    let mut w = writer();
    assert_eq!(w.replay_for(5), None, "no replay socket");
    w.set_replay(Some("127.0.0.1:9".into()));
    assert_eq!(w.replay_for(0), None, "the first message: nothing missed");
    assert_eq!(
        w.replay_for(5),
        Some(("127.0.0.1:9".into(), 0)),
        "joined late"
    );
    w.apply(&msg(0, vec![stored(&[100], None, &[1, 2])]));
    assert_eq!(w.replay_for(1), None);
    assert_eq!(w.replay_for(7), Some(("127.0.0.1:9".into(), 1)));
    // The replay filled 1..6: the message that showed the gap then follows on.
    for seq in 1..7 {
        w.apply(&msg(seq, vec![]));
    }
    w.replay_done(Ok(6));
    w.apply(&msg(7, vec![]));
    assert!(matches!(
        w.index().state(),
        KvState::Available { partial: None, .. }
    ));
    assert_eq!(w.index().counts.replayed.load(Relaxed), 6);
    w.replay_done(Err("refused".into()));
    assert_eq!(w.replay_for(20), None, "backing off after a failure");
}
