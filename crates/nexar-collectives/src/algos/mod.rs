//! The algorithms. Each function lists one rank's actions in program order through a
//! [`DagBuilder`](crate::dag::DagBuilder), which derives the data dependencies.

pub(crate) mod all_gather;
pub(crate) mod all_reduce;
pub(crate) mod all_to_all;
pub(crate) mod barrier;
pub(crate) mod broadcast;
pub(crate) mod gather;
pub(crate) mod reduce;
pub(crate) mod reduce_scatter;
pub(crate) mod scan;

use crate::dag::InPlace;

/// Where one rank sits and what it works on. `count` is elements (per rank for the
/// collectives with per-rank blocks); the size in bytes is validated not to overflow.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geom {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// Bytes per element.
    pub(crate) esz: usize,
    pub(crate) count: usize,
    /// Set when the collective runs in place on one buffer (all-gather and
    /// reduce-scatter): where its `Input` and `Data` lie in it.
    pub(crate) in_place: Option<InPlace>,
}

impl Geom {
    /// Bytes of `count` elements.
    pub(crate) fn bytes(&self) -> usize {
        self.count * self.esz
    }

    /// The next rank on the ring.
    pub(crate) fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    /// The previous rank on the ring.
    pub(crate) fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }
}

/// Folding a world that is not a power of two onto `p = 2^k` ranks: the first `2 * rem`
/// ranks pair up, the even one of each pair hands its data to the odd one and sits out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fold {
    /// Largest power of two not above the world size.
    pub(crate) p: usize,
    /// `world - p`.
    pub(crate) rem: usize,
    /// log2(p).
    pub(crate) k: usize,
}

/// A rank's part in a [`Fold`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum FoldRole {
    /// Sits out: sends its data to `partner` first and receives the result at the end.
    Extra { partner: usize },
    /// Takes part with this rank among the `p`; `extra` is the partner that sat out.
    Member {
        new_rank: usize,
        extra: Option<usize>,
    },
}

impl Fold {
    pub(crate) fn new(world: usize) -> Self {
        let p = crate::layout::pow2_floor(world);
        Self {
            p,
            rem: world - p,
            k: p.trailing_zeros() as usize,
        }
    }

    pub(crate) fn role(&self, rank: usize) -> FoldRole {
        if rank < 2 * self.rem {
            if rank % 2 == 0 {
                FoldRole::Extra { partner: rank + 1 }
            } else {
                FoldRole::Member {
                    new_rank: rank / 2,
                    extra: Some(rank - 1),
                }
            }
        } else {
            FoldRole::Member {
                new_rank: rank - self.rem,
                extra: None,
            }
        }
    }

    /// The real rank of member `new_rank`.
    pub(crate) fn real(&self, new_rank: usize) -> usize {
        if new_rank < self.rem {
            2 * new_rank + 1
        } else {
            new_rank + self.rem
        }
    }
}
