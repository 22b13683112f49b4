//! Prompt text for generated workloads, shaped for prefix caches: every request's own text is
//! unique (seeded words), so two requests share a prefix only when the workload means them to (a
//! hot shared prefix, a trace's prefix id, a session's system prompt and history).
//!
//! A word is [`WORD`] bytes, three hex digits and a space: one token at the four characters per
//! token the simulated engine counts by, so a request asking for N prompt tokens carries about N.

use rand::{Rng, SeedableRng};

/// Bytes per word (and per simulated token).
pub const WORD: usize = 4;

/// `tokens` words drawn from `seed`: the same seed gives the same text.
pub fn words(seed: u64, tokens: u64) -> String {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut s = String::with_capacity(tokens as usize * WORD);
    for _ in 0..tokens {
        let w: u16 = rng.random_range(0..0x1000);
        // Three hex digits and a space: exactly `WORD` bytes.
        s.push_str(&format!("{w:03x} "));
    }
    s
}

/// A prefix shared by every request naming `id`: `tokens` words, the same for every run with
/// the same seed.
pub fn shared_prefix(seed: u64, id: u64, tokens: u64) -> String {
    words(mix(seed, 0x5eed_0000 ^ id), tokens)
}

/// A seed derived from two numbers (SplitMix64's finalizer), so that neighbouring ids give
/// unrelated texts.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(b)
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The text the simulated engine answers `n` tokens with (`t0 t1 ... t9 t0 ...`): what a session
/// sends back as the assistant's turn, so that against the simulator the history is what the
/// engine really said.
pub fn answer(n: u64) -> String {
    (0..n).map(|i| format!("t{} ", i % 10)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_tokens_long_and_seeded() {
        assert_eq!(words(1, 50).len(), 50 * WORD);
        assert_eq!(words(1, 50), words(1, 50));
        assert_ne!(words(1, 50), words(2, 50));
        assert!(
            words(1, 80).starts_with(&words(1, 50)),
            "a longer draw extends a shorter one"
        );
        assert_ne!(shared_prefix(7, 0, 20), shared_prefix(7, 1, 20));
        assert_eq!(answer(3), "t0 t1 t2 ");
    }
}
