//! Choosing among equals: uniformly at random among the candidates at or near the best, in
//! one pass with no allocation (reservoir sampling), so that several rankgates seeing the same
//! numbers do not all send to the same rank.

use rand::Rng;

/// A rank chosen uniformly among `scores` at most `limit` (one pass, reservoir sampling).
pub(super) fn random_at_most<W: Copy>(
    scores: &[(W, f64)],
    limit: f64,
    rng: &mut impl Rng,
) -> Option<W> {
    let mut chosen = None;
    let mut seen = 0u32;
    for &(w, s) in scores {
        if s <= limit {
            seen += 1;
            if rng.random_range(0..seen) == 0 {
                chosen = Some(w);
            }
        }
    }
    chosen
}

/// The candidate with the lowest key; keys within `tie` of the lowest share the pick uniformly at
/// random (reservoir sampling over the tied, so one pass and no allocation).
pub(super) fn min_with_random_ties<W: Copy>(
    cands: impl Iterator<Item = (W, f64)>,
    tie: f64,
    rng: &mut impl Rng,
) -> Option<W> {
    let mut best: Option<(W, f64)> = None;
    let mut ties = 0u32;
    for (w, key) in cands {
        match best {
            Some((_, b)) if key > b + tie => {}
            Some((_, b)) if key >= b - tie => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((w, b));
                }
            }
            _ => {
                best = Some((w, key));
                ties = 1;
            }
        }
    }
    best.map(|(w, _)| w)
}
