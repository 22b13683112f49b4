use super::*;

fn text(s: &str, tokens: u64) -> Vec<u64> {
    block_ids(s.as_bytes(), tokens)
}

#[test]
fn ids_are_chained_and_only_whole_blocks() {
    let a = "x".repeat(64 * 3 + 10);
    let ids = text(&a, (a.len() / TOKEN_BYTES) as u64);
    assert_eq!(ids.len(), 3, "the partial fourth block is not named");
    // The same chunk after a different prefix is a different block.
    assert_ne!(ids[1], ids[2]);
    let mut b = a.clone();
    b.replace_range(0..1, "y");
    let other = text(&b, (b.len() / TOKEN_BYTES) as u64);
    assert!(ids.iter().zip(&other).all(|(x, y)| x != y));
    // A longer prompt with the same start shares the leading ids.
    let longer = format!("{a}{}", "z".repeat(200));
    let more = text(&longer, (longer.len() / TOKEN_BYTES) as u64);
    assert_eq!(&more[..3], &ids[..]);
    assert_eq!(text(&a, 20), ids[..1], "the token count bounds the blocks");
}

#[test]
fn hit_length_is_the_leading_cached_run() {
    let mut c = PrefixCache::default();
    c.acquire(&[1, 2, 3]);
    assert_eq!(
        c.lookup(&[1, 2, 9, 3]),
        Lookup {
            hit: 2,
            new: 1,
            revived: 0
        }
    );
    assert_eq!(
        c.lookup(&[9, 1]).hit,
        0,
        "a hit must start at the first block"
    );
}

#[test]
fn shared_blocks_are_counted_once() {
    let mut c = PrefixCache::default();
    c.acquire(&[1, 2, 3]);
    c.acquire(&[1, 2, 4]);
    assert_eq!(c.in_use(), 4);
    c.release(&[1, 2, 3]);
    assert_eq!(
        (c.in_use(), c.idle()),
        (3, 1),
        "1 and 2 still held by the second"
    );
    c.release(&[1, 2, 4]);
    assert_eq!((c.in_use(), c.idle()), (0, 4));
    // Reviving idle blocks costs no new allocation.
    assert_eq!(
        c.lookup(&[1, 2, 5]),
        Lookup {
            hit: 2,
            new: 1,
            revived: 2
        }
    );
}

#[test]
fn eviction_is_least_recently_used_and_spares_blocks_in_use() {
    let mut c = PrefixCache::default();
    c.acquire(&[1, 2]);
    c.release(&[1, 2]); // idle order: 2, 1 (tail first)
    c.acquire(&[7]);
    c.release(&[7]); // then 7
    c.acquire(&[8]); // in use: never evicted
    assert_eq!(c.evict(1), 1);
    assert_eq!(c.lookup(&[1, 2]).hit, 1, "block 2 (the tail) went first");
    assert_eq!(c.evict(10), 2, "1 and 7; 8 is in use");
    assert_eq!((c.in_use(), c.idle()), (1, 0));
    assert_eq!(c.lookup(&[8]).hit, 1);
}

#[test]
fn inserted_idle_blocks_go_before_what_is_released_after_them() {
    let mut c = PrefixCache::default();
    c.acquire(&[1, 2]);
    // A finished request's answer blocks continue its prompt's chain.
    c.insert_idle(&[1, 2, 3, 4]);
    c.release(&[1, 2]);
    assert_eq!((c.in_use(), c.idle()), (0, 4));
    assert_eq!(c.evict(1), 1);
    assert_eq!(
        c.lookup(&[1, 2, 3, 4]).hit,
        3,
        "the answer's tail went first"
    );
}

fn toks(from: u32, n: usize) -> Vec<u32> {
    (from..from + n as u32).collect()
}

#[test]
fn default_token_ids_are_the_texts_bytes_and_grpc_ids_come_back() {
    assert_eq!(
        text_token_ids(b"abcdefg"),
        vec![u32::from_le_bytes(*b"abcd")]
    );
    let ids = toks(7, 40);
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let b = Blocks::of_text(&bytes, ids.len() as u64);
    assert_eq!(b.tokens, ids[..32], "two whole blocks, their own ids");
    assert_eq!(b, Blocks::of_tokens(&ids));
    assert_eq!(b.ids, block_ids(&bytes, 40));
}

#[test]
fn events_name_new_blocks_chained_to_their_parent_and_evictions() {
    let mut c = PrefixCache::default();
    c.record_events();
    let a = Blocks::of_tokens(&toks(0, 48));
    c.acquire_blocks(&a);
    assert_eq!(
        c.take_events(),
        vec![KvEvent::stored(a.ids.clone(), None, toks(0, 48), 16)]
    );
    // Shares the first two blocks, then two of its own.
    let mut t = toks(0, 32);
    t.extend(toks(900, 32));
    let b = Blocks::of_tokens(&t);
    c.acquire_blocks(&b);
    assert_eq!(
        c.take_events(),
        vec![KvEvent::stored(
            b.ids[2..].to_vec(),
            Some(b.ids[1]),
            toks(900, 32),
            16
        )]
    );
    c.release(&b.ids);
    c.release(&a.ids);
    assert_eq!(c.evict(2), 2);
    let ev = c.take_events();
    assert_eq!(
        ev.len(),
        2,
        "one BlockRemoved per block, as vLLM reports them"
    );
    assert!(ev.iter().all(
        |e| matches!(e, KvEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 1)
    ));
    // An answer kept after its prompt: only the new blocks are announced.
    c.insert_idle_blocks(&a);
    assert_eq!(c.take_events().len(), 0, "a's blocks are still cached");
    let mut quiet = PrefixCache::default();
    quiet.acquire_blocks(&a);
    assert!(
        quiet.take_events().is_empty(),
        "nothing recorded with events off"
    );
}

#[test]
fn a_restart_empties_the_cache_but_running_blocks_stay_in_use_until_released() {
    let mut c = PrefixCache::default();
    c.record_events();
    c.acquire(&[1, 2]);
    c.acquire(&[3]);
    c.release(&[3]);
    let before = c.epoch();
    c.restart();
    assert_eq!(c.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!((c.in_use(), c.idle()), (2, 0));
    assert_eq!(c.lookup(&[1, 2]).hit, 0, "nothing is found after a restart");
    // The same blocks taken again after the restart are new blocks of the new cache.
    c.acquire(&[1]);
    assert_eq!(c.in_use(), 3);
    c.release_detached(before, &[1, 2]);
    assert_eq!(c.in_use(), 1);
    c.release(&[1]);
    assert_eq!((c.in_use(), c.idle()), (0, 1));
}

#[test]
fn a_reset_clears_an_idle_cache_and_is_refused_while_blocks_are_held() {
    let mut c = PrefixCache::default();
    c.record_events();
    c.acquire(&[1, 2]);
    c.take_events();
    assert!(!c.reset(), "blocks in use");
    assert!(c.take_events().is_empty());
    c.release(&[1, 2]);
    assert!(c.reset());
    assert_eq!(c.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!((c.in_use(), c.idle(), c.lookup(&[1]).hit), (0, 0, 0));
}
