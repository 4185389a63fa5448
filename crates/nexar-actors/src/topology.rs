//! Which ranks connect directly, and how a message reaches a rank that is not a neighbour.

use std::collections::{BTreeSet, VecDeque};

/// Who dials whom when the mesh forms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Topology {
    /// Every rank connects to every other (N-1 peers). The default.
    #[default]
    FullMesh,
    /// A ring lattice: each rank connects to the `k / 2` ranks on each side in rank order
    /// (plus the opposite rank when `k` is odd and the world even), so ring algorithms run
    /// over direct links. `k` is clamped to `world - 1`; a node refuses to start with `k`
    /// under 2, which leaves ranks (all of them, in an odd world) that reach no other.
    KRegular {
        /// Peers per rank.
        k: usize,
    },
    /// A hypercube over the next power of two; a partner past the end of the world is
    /// replaced by the rank half a cube lower, so any world size works with O(log N) peers.
    Hypercube,
}

impl Topology {
    /// The neighbours of `rank` in a world of `world` ranks (symmetric: if b is a
    /// neighbour of a, a is a neighbour of b).
    pub fn neighbors(self, rank: usize, world: usize) -> BTreeSet<usize> {
        let mut out = BTreeSet::new();
        for other in 0..world {
            if other != rank && self.linked(rank, other, world) {
                out.insert(other);
            }
        }
        out
    }

    fn one_way(self, a: usize, b: usize, world: usize) -> bool {
        match self {
            Topology::FullMesh => true,
            Topology::KRegular { k } => {
                let k = k.min(world.saturating_sub(1)).max(1);
                let d = (b + world - a) % world;
                let d = d.min(world - d);
                d <= k / 2 || (k % 2 == 1 && world % 2 == 0 && d == world / 2)
            }
            Topology::Hypercube => {
                let cube = world.next_power_of_two();
                let mut bit = 1;
                while bit < cube {
                    let p = a ^ bit;
                    let p = if p >= world { p - cube / 2 } else { p };
                    if p == b {
                        return true;
                    }
                    bit <<= 1;
                }
                false
            }
        }
    }

    fn linked(self, a: usize, b: usize, world: usize) -> bool {
        self.one_way(a, b, world) || self.one_way(b, a, world)
    }

    /// For every destination, the neighbour to send through on a shortest path from `from`
    /// that avoids the ranks in `avoid` (`None`: unreachable; `Some(dest)` for neighbours).
    /// Deterministic: ties go to the lowest rank.
    pub fn next_hops(
        self,
        from: usize,
        world: usize,
        avoid: &BTreeSet<usize>,
    ) -> Vec<Option<usize>> {
        let mut first = vec![None; world];
        if from >= world {
            return first;
        }
        let mut seen = vec![false; world];
        seen[from] = true;
        let mut queue = VecDeque::new();
        for n in self.neighbors(from, world) {
            if !avoid.contains(&n) {
                seen[n] = true;
                first[n] = Some(n);
                queue.push_back(n);
            }
        }
        while let Some(v) = queue.pop_front() {
            for n in self.neighbors(v, world) {
                if !seen[n] && !avoid.contains(&n) {
                    seen[n] = true;
                    first[n] = first[v];
                    queue.push_back(n);
                }
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connected(t: Topology, world: usize) -> bool {
        let hops = t.next_hops(0, world, &BTreeSet::new());
        (1..world).all(|d| hops[d].is_some())
    }

    #[test]
    fn degrees_are_bounded_and_links_symmetric() {
        for world in 1..=33 {
            for t in [
                Topology::FullMesh,
                Topology::KRegular { k: 2 },
                Topology::KRegular { k: 3 },
                Topology::Hypercube,
            ] {
                for r in 0..world {
                    for n in t.neighbors(r, world) {
                        assert!(
                            t.neighbors(n, world).contains(&r),
                            "{t:?} world {world}: {r}-{n} not symmetric"
                        );
                    }
                }
                assert!(connected(t, world), "{t:?} world {world} not connected");
            }
            let log = world.next_power_of_two().trailing_zeros() as usize;
            for r in 0..world {
                assert!(Topology::KRegular { k: 2 }.neighbors(r, world).len() <= 2);
                // Folding missing partners in can at most double a rank's degree.
                assert!(Topology::Hypercube.neighbors(r, world).len() <= 2 * log.max(1));
            }
        }
        assert_eq!(
            Topology::Hypercube.neighbors(5, 16),
            [1, 4, 7, 13].into_iter().collect()
        );
        assert_eq!(
            Topology::KRegular { k: 2 }.neighbors(0, 8),
            [1, 7].into_iter().collect()
        );
    }

    /// Why a node refuses `k` under 2: one link per rank splits an even world into pairs
    /// and leaves an odd one with no links at all.
    #[test]
    fn one_link_per_rank_leaves_ranks_apart() {
        let one = Topology::KRegular { k: 1 };
        assert!(one.neighbors(0, 5).is_empty());
        assert!(!connected(one, 4));
        assert!((2..=9).all(|w| connected(Topology::KRegular { k: 2 }, w)));
    }

    #[test]
    fn routes_avoid_dead_ranks_when_possible() {
        let t = Topology::KRegular { k: 2 };
        let hops = t.next_hops(0, 6, &BTreeSet::new());
        assert_eq!(hops[2], Some(1));
        assert_eq!(hops[4], Some(5));
        let hops = t.next_hops(0, 6, &[1].into_iter().collect());
        assert_eq!(hops[2], Some(5), "around the dead rank 1");
        let hops = t.next_hops(0, 6, &[1, 5].into_iter().collect());
        assert_eq!(hops[3], None, "no path left");
    }
}
