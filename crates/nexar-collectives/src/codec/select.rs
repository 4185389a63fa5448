//! Choosing which entries a codec keeps: exact top-k by magnitude in linear time, and a
//! seeded uniform random k-subset.

use std::cmp::Ordering;

use super::element::WideFloat;

/// Positions of the `k` largest of `mags` (magnitudes, under `total_cmp`), ascending.
///
/// Ties at the threshold go to the lowest positions, so the result is a function of the
/// input alone. Expected O(n): one `select_nth_unstable_by` to find the k-th largest
/// magnitude, then a scan. `mags` is iterated twice and must yield the same items both
/// times; the caller has checked that its length fits in `u32`.
pub(super) fn top_k<W, I>(mags: I, k: usize) -> Vec<u32>
where
    W: WideFloat,
    I: Iterator<Item = W> + Clone,
{
    let mut work: Vec<W> = mags.clone().collect();
    let n = work.len();
    if k == 0 {
        return Vec::new();
    }
    if k >= n {
        return (0..n as u32).collect();
    }
    // Descending: the k - 1 entries before the pivot are all at least as large as it.
    let (larger, pivot, _) = work.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let pivot = *pivot;
    let greater = larger
        .iter()
        .filter(|m| m.total_cmp(&pivot) == Ordering::Greater)
        .count();
    drop(work);
    let mut ties = k - greater;
    let mut out = Vec::with_capacity(k);
    for (i, m) in mags.enumerate() {
        let take = match m.total_cmp(&pivot) {
            Ordering::Greater => true,
            Ordering::Equal if ties > 0 => {
                ties -= 1;
                true
            }
            _ => false,
        };
        if take {
            out.push(i as u32);
        }
    }
    out
}

/// `k` distinct positions out of `n`, ascending, uniform over all k-subsets, determined
/// by `(seed, step)` alone.
///
/// Selection sampling (Knuth's Algorithm S): position `i` is taken with probability
/// (still needed) / (still left). O(n) time, no memory beyond the output. The caller has
/// checked that `n` fits in `u32` and `k <= n`.
pub(super) fn random_k(seed: u64, step: u64, n: usize, k: usize) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed, step);
    let mut out = Vec::with_capacity(k);
    let mut need = k as u64;
    let n = n as u64;
    for i in 0..n {
        if need == 0 {
            break;
        }
        if rng.below(n - i) < need {
            out.push(i as u32);
            need -= 1;
        }
    }
    out
}

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast, and fixed here so that the choice
/// of indices does not change with a dependency's version.
struct SplitMix64 {
    state: u64,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    fn new(seed: u64, step: u64) -> Self {
        // Mix both so that nearby (seed, step) pairs start far apart.
        Self {
            state: mix(seed) ^ mix(step.wrapping_add(GOLDEN).rotate_left(17)),
        }
    }

    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix(self.state)
    }

    /// Uniform in `0..range` (Lemire's multiply-and-reject); `range` must be non-zero.
    fn below(&mut self, range: u64) -> u64 {
        let mut m = u128::from(self.next()) * u128::from(range);
        if (m as u64) < range {
            let threshold = range.wrapping_neg() % range;
            while (m as u64) < threshold {
                m = u128::from(self.next()) * u128::from(range);
            }
        }
        (m >> 64) as u64
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
