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
    /// Computed from the rank's own links (O(k) or O(log world), not a scan of the
    /// world), since routing walks every rank's neighbours.
    pub fn neighbors(self, rank: usize, world: usize) -> BTreeSet<usize> {
        let mut out = BTreeSet::new();
        if rank >= world {
            return out;
        }
        match self {
            Topology::FullMesh => out.extend((0..world).filter(|o| *o != rank)),
            Topology::KRegular { k } => {
                // `one_way` is symmetric here: it depends only on the ring distance.
                let k = k.min(world.saturating_sub(1)).max(1);
                for d in 1..=(k / 2).min(world / 2) {
                    out.insert((rank + d) % world);
                    out.insert((rank + world - d) % world);
                }
                if k % 2 == 1 && world % 2 == 0 {
                    out.insert((rank + world / 2) % world);
                }
                out.remove(&rank);
            }
            Topology::Hypercube => {
                let cube = world.next_power_of_two();
                let mut bit = 1;
                while bit < cube {
                    // This rank's partner, folded half a cube down when past the end ...
                    let p = rank ^ bit;
                    out.insert(if p >= world { p - cube / 2 } else { p });
                    // ... and the ranks whose partner folds onto this one.
                    let q = (rank + cube / 2) ^ bit;
                    if rank + cube / 2 >= world && q < world {
                        out.insert(q);
                    }
                    bit <<= 1;
                }
                out.remove(&rank);
            }
        }
        out
    }

    /// Whether `a` links to `b` by its own rule: the definition [`neighbors`](Self::neighbors)
    /// computes directly, kept as the tests' reference.
    #[cfg(test)]
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

    #[cfg(test)]
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

    /// The neighbours computed from a rank's own links are exactly the ranks `linked` to
    /// it, found by a scan of the world.
    #[test]
    fn neighbours_are_the_linked_ranks() {
        for world in 1..=70 {
            for t in [
                Topology::FullMesh,
                Topology::KRegular { k: 1 },
                Topology::KRegular { k: 2 },
                Topology::KRegular { k: 3 },
                Topology::KRegular { k: 6 },
                Topology::KRegular { k: 99 },
                Topology::Hypercube,
            ] {
                for r in 0..world {
                    let scan: BTreeSet<usize> = (0..world)
                        .filter(|o| *o != r && t.linked(r, *o, world))
                        .collect();
                    assert_eq!(t.neighbors(r, world), scan, "{t:?} world {world} rank {r}");
                }
            }
        }
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
