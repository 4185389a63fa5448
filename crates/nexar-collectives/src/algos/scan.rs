//! Inclusive and exclusive scan (prefix reduction) in place on `Data`.

use super::Geom;
use crate::dag::{DagBuilder, DagSchedule};
use crate::layout::Chunking;
use crate::BufRange;

/// Recursive doubling (Hillis-Steele). In round `k` (distance `d = 2^k`) rank `r` sends its
/// partial (the reduction over ranks `r - 2d + 1 ..= r` so far, clipped at 0) to `r + d`
/// and reduces the partial of `r - d` into its own.
///
/// Inclusive: the partial is `Data` itself; a received partial lands in scratch first,
/// because the rank's own send may still be reading `Data`.
///
/// Exclusive: the partial lives in scratch (`P`, a copy of `Data`) and `Data` collects
/// only what was received: the first message (always from `r - 1`) is received straight
/// into `Data`, later ones through a scratch slot `T`. Rank 0 receives nothing and fills
/// `Data` with the op's identity.
///
/// Every message is cut by `ch`, one phase a round.
pub(crate) fn recursive_doubling(
    g: Geom,
    ch: Chunking,
    exclusive: bool,
    window: usize,
) -> DagSchedule {
    let mut b = DagBuilder::new();
    let (n, r, len) = (g.world, g.rank, g.bytes());
    let data = BufRange::data(0..len);
    if !exclusive {
        let tmp = BufRange::scratch(0..len);
        let mut d = 1;
        let mut k = 0;
        while d < n {
            if r + d < n {
                b.send_cut(&ch, r + d, k, data.clone());
            }
            if r >= d {
                b.recv_cut(&ch, r - d, k, tmp.clone(), false);
                b.reduce(tmp.clone(), data.clone());
            }
            d <<= 1;
            k += 1;
        }
        return b.build("rd", window);
    }
    let partial = BufRange::scratch(0..len);
    let tmp = BufRange::scratch(len..2 * len);
    if n > 1 {
        b.copy(data.clone(), partial.clone());
    }
    if r == 0 {
        b.fill_identity(data.clone());
    }
    let mut d = 1;
    let mut k = 0;
    while d < n {
        if r + d < n {
            b.send_cut(&ch, r + d, k, partial.clone());
        }
        // The partial is only worth updating if a later round sends it.
        let sends_later = r + 2 * d < n;
        if r >= d {
            if k == 0 {
                b.recv_cut(&ch, r - d, k, data.clone(), false);
                if sends_later {
                    b.reduce(data.clone(), partial.clone());
                }
            } else {
                b.recv_cut(&ch, r - d, k, tmp.clone(), false);
                if sends_later {
                    b.reduce(tmp.clone(), partial.clone());
                }
                b.reduce(tmp.clone(), data.clone());
            }
        }
        d <<= 1;
        k += 1;
    }
    b.build("rd", window)
}
