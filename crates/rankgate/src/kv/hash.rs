//! rankgate's own names for KV blocks: a 64-bit hash chained over the token ids of every block
//! from the prompt's start, so a name stands for a whole prefix, never for a block that merely
//! has the same tokens somewhere else. Engines hash blocks their own way (vLLM: sha256 or a
//! builtin hash, seeded per process unless `PYTHONHASHSEED` is set), so rankgate names both the
//! blocks in the engines' events and the blocks of a prompt with this one function: equal
//! names need equal token prefixes, whatever the engines' hash settings, and every rankgate
//! replica (of any build) names them alike. It is written out here, not taken from std's
//! `Hasher`s, whose output may change between Rust releases.

/// The name of the empty prefix: the parent of a sequence's first block.
const ROOT: u64 = 0x243f_6a88_85a3_08d3;

/// The name of `block` following the prefix named `parent` (`None`: the block starts the
/// sequence).
pub fn chain(parent: Option<u64>, block: &[u32]) -> u64 {
    let mut h = parent.unwrap_or(ROOT) ^ (block.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // Two tokens a step: each multiply spreads them over the whole word before the next mix.
    let mut pairs = block.chunks_exact(2);
    for p in &mut pairs {
        let w = u64::from(p[0]) | (u64::from(p[1]) << 32);
        h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(31);
    }
    if let [last] = pairs.remainder() {
        h = (h ^ u64::from(*last))
            .wrapping_mul(0xff51_afd7_ed55_8ccd)
            .rotate_left(31);
    }
    fmix(h)
}

/// The names of `tokens`' full blocks of `block_size` tokens, each chained over all before it;
/// a partial last block has none (engines cache full blocks only).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            let h = chain(parent, b);
            parent = Some(h);
            h
        })
        .collect()
}

/// Murmur3's finalizer: every input bit moves every output bit.
fn fmix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_are_fixed_across_builds() {
        // Written down once: a change here would make replicas of two builds disagree.
        assert_eq!(chain(None, &[1, 2, 3]), 0xeea8_f107_eb6b_ef3e);
        assert_eq!(
            block_hashes(&[1, 2, 3, 4, 5], 2),
            [0x73f5_2ad1_250e_78ac, 0xf1df_7ec9_64a6_ccb1]
        );
        assert_eq!(block_hashes(&[1, 2, 3, 4, 5], 0), Vec::<u64>::new());
    }

    proptest! {
        /// A block's name depends on everything before it: two prompts share the names of
        /// exactly their common leading full blocks.
        #[test]
        fn shared_names_are_exactly_the_shared_full_blocks(
            common in proptest::collection::vec(0u32..50_000, 0..40),
            a in proptest::collection::vec(0u32..50_000, 0..40),
            b in proptest::collection::vec(0u32..50_000, 0..40),
            bs in 1usize..9,
        ) {
            let x: Vec<u32> = common.iter().chain(&a).copied().collect();
            let y: Vec<u32> = common.iter().chain(&b).copied().collect();
            let (hx, hy) = (block_hashes(&x, bs), block_hashes(&y, bs));
            let same_tokens = x.chunks_exact(bs).zip(y.chunks_exact(bs)).take_while(|(p, q)| p == q).count();
            let same_names = hx.iter().zip(&hy).take_while(|(p, q)| p == q).count();
            prop_assert_eq!(same_names, same_tokens);
            prop_assert_eq!(hx.len(), x.len() / bs);
        }

        /// The names of a longer prompt start with the names of its prefix.
        #[test]
        fn a_prefix_names_its_blocks_alike(t in proptest::collection::vec(any::<u32>(), 0..64), cut in 0usize..64, bs in 1usize..9) {
            let cut = cut.min(t.len());
            let whole = block_hashes(&t, bs);
            let part = block_hashes(&t[..cut], bs);
            prop_assert_eq!(&whole[..part.len()], &part[..]);
        }
    }
}
