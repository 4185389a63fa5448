//! Point-to-point message counts per `(rank, tag)`, kept small for tags used once.
//!
//! Messages between a pair under one tag are numbered from 0, on both sides, so that they
//! are received in the order sent. The count of a tag must be kept for as long as the
//! communicator lives: a tag used again continues from it. Programs that take a fresh tag
//! per message (a tag per training step, per request) would otherwise leave a counter
//! behind for every message; here the tags counted once are kept in a compressed bitmap
//! per peer (roaring): tags that lie close together, consecutive or strided (a tag per
//! step and kind of message), take from a bit to two bytes each. Tags far apart (more
//! than 65,536 from any other) take about as much as a counter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use roaring::RoaringTreemap;

/// How many messages each `(rank, tag)` has counted; 0 for those never seen.
#[derive(Debug, Default)]
pub(crate) struct TagCounts {
    /// Counts of 2 and more.
    many: HashMap<(usize, u64), u64>,
    /// Per rank, the tags counted exactly once.
    once: HashMap<usize, RoaringTreemap>,
}

impl TagCounts {
    /// The count of `(rank, tag)`.
    pub(crate) fn get(&self, rank: usize, tag: u64) -> u64 {
        if let Some(&n) = self.many.get(&(rank, tag)) {
            return n;
        }
        u64::from(self.once.get(&rank).is_some_and(|s| s.contains(tag)))
    }

    /// Sets the count of `(rank, tag)` to `n`.
    pub(crate) fn set(&mut self, rank: usize, tag: u64, n: u64) {
        match self.get(rank, tag) {
            0 => {}
            1 => {
                if let Some(set) = self.once.get_mut(&rank) {
                    set.remove(tag);
                    if set.is_empty() {
                        self.once.remove(&rank);
                    }
                }
            }
            _ => {
                self.many.remove(&(rank, tag));
            }
        }
        match n {
            0 => {}
            1 => {
                self.once.entry(rank).or_default().insert(tag);
            }
            _ => {
                self.many.insert((rank, tag), n);
            }
        }
    }

    /// The count of `(rank, tag)`, which then counts one more.
    pub(crate) fn take(&mut self, rank: usize, tag: u64) -> u64 {
        // A tag in steady use: one lookup.
        if let Some(n) = self.many.get_mut(&(rank, tag)) {
            let was = *n;
            *n = n.saturating_add(1);
            return was;
        }
        let n = self.get(rank, tag);
        self.set(rank, tag, n.saturating_add(1));
        n
    }

    /// How many tags have a counter of their own (counted more than once).
    #[cfg(test)]
    pub(crate) fn counters(&self) -> usize {
        self.many.len()
    }

    /// About how many bytes the tags counted once take (their bitmaps, serialized).
    #[cfg(test)]
    pub(crate) fn once_bytes(&self) -> usize {
        self.once.values().map(|s| s.serialized_size()).sum()
    }
}

/// A `(rank, tag)`'s receive count while receives use it: each takes the lock in turn.
type Turn = Arc<tokio::sync::Mutex<u64>>;

/// The receive side: each `(rank, tag)` that receives use, or that counted more than one
/// message, has its count behind a lock that orders its receives; the tags counted once
/// are kept in a [`TagCounts`] while no receive uses them.
#[derive(Debug, Default)]
pub(crate) struct RecvCounts {
    inner: Mutex<RecvInner>,
}

#[derive(Debug, Default)]
struct RecvInner {
    /// The pairs that receives are using (waiting for their turn, or receiving), and
    /// those that counted more than one message: the count, and how many places in line
    /// ([`RecvTurn`]) share it. A tag used again and again keeps its lock, so its
    /// receives allocate nothing.
    active: HashMap<(usize, u64), (Turn, usize)>,
    /// The tags counted once that no receive uses (nothing else: a count is in one of
    /// the two maps).
    settled: TagCounts,
}

impl RecvCounts {
    fn lock(&self) -> MutexGuard<'_, RecvInner> {
        // The state stays consistent across a panic: each critical section below makes
        // its changes with nothing in between that can panic.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place in line for the receives of `(rank, tag)`: lock its
    /// [`count`](RecvTurn::count) to take the turn. When the last place in line for it is
    /// dropped, a count of one goes into the bitmap, and a count of none leaves no entry.
    pub(crate) fn join(&self, rank: usize, tag: u64) -> RecvTurn<'_> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let (count, users) = inner.active.entry((rank, tag)).or_insert_with(|| {
            // The count moves out of the bitmap while receives use it.
            let n = inner.settled.get(rank, tag);
            inner.settled.set(rank, tag, 0);
            (Arc::new(tokio::sync::Mutex::new(n)), 0)
        });
        *users += 1;
        RecvTurn {
            counts: self,
            key: (rank, tag),
            count: count.clone(),
        }
    }

    /// How many tags have a count of their own (in use, or counted more than once), and
    /// about how many bytes the others take.
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.active.len(), inner.settled.once_bytes())
    }
}

/// A receive's place in line for its `(rank, tag)` ([`RecvCounts::join`]).
#[derive(Debug)]
pub(crate) struct RecvTurn<'a> {
    counts: &'a RecvCounts,
    key: (usize, u64),
    count: Turn,
}

impl RecvTurn<'_> {
    /// The pair's count: lock it to take this receive's turn, and hold the guard until
    /// the receive has counted its message (or given up without one).
    pub(crate) fn count(&self) -> &tokio::sync::Mutex<u64> {
        &self.count
    }
}

impl Drop for RecvTurn<'_> {
    fn drop(&mut self) {
        let mut inner = self.counts.lock();
        let inner = &mut *inner;
        let Some((_, users)) = inner.active.get_mut(&self.key) else {
            return;
        };
        *users = users.saturating_sub(1);
        if *users > 0 {
            return;
        }
        // No other place in line, so no other guard; this one's guard, which borrows it,
        // is gone. Were it held after all, the count stays in use (a later place in line
        // shares it, and settles it when it leaves).
        let Ok(n) = self.count.try_lock().map(|n| *n) else {
            return;
        };
        if n > 1 {
            return;
        }
        inner.active.remove(&self.key);
        let (rank, tag) = self.key;
        inner.settled.set(rank, tag, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fresh_tags_take_a_bit_or_so_each() {
        // Consecutive, and strided (a tag per step and kind of message).
        for (stride, at_most) in [(1u64, 1), (2, 1), (5, 2)] {
            let mut c = TagCounts::default();
            for i in 0..100_000u64 {
                assert_eq!(c.take(1, i * stride), 0);
                assert_eq!(c.take(2, i * stride + 1), 0);
            }
            assert_eq!(c.counters(), 0);
            // Bytes per tag, where a map of counters would take 24 at the least.
            let per_tag = c.once_bytes() / 200_000;
            assert!(
                per_tag < at_most,
                "stride {stride}: {} bytes",
                c.once_bytes()
            );
            assert_eq!(c.get(1, 99_999 * stride), 1);
            assert_eq!(c.get(1, 100_000 * stride), 0);
            assert_eq!(c.get(3, 0), 0);
        }
    }

    #[test]
    fn a_tag_used_again_continues_from_its_count() {
        let mut c = TagCounts::default();
        for tag in 10..20 {
            c.take(0, tag);
        }
        assert_eq!(c.take(0, 15), 1);
        assert_eq!(c.take(0, 15), 2);
        assert_eq!(c.get(0, 15), 3);
        assert_eq!(c.get(0, 14), 1);
        assert_eq!(c.get(0, 16), 1);
        assert_eq!(c.counters(), 1);
        c.set(0, 15, 1);
        assert_eq!(c.counters(), 0);
        assert_eq!(c.get(0, 15), 1);
        c.set(0, 15, 0);
        assert_eq!(c.get(0, 15), 0);
        for tag in 10..20 {
            c.set(0, tag, 0);
        }
        assert!(c.once.is_empty());
        assert_eq!(c.counters(), 0);
    }

    #[test]
    fn the_extreme_tags_count() {
        let mut c = TagCounts::default();
        assert_eq!(c.take(0, u64::MAX), 0);
        assert_eq!(c.take(0, u64::MAX - 1), 0);
        assert_eq!(c.take(0, 0), 0);
        assert_eq!(c.take(0, u64::MAX), 1);
        assert_eq!(c.get(0, u64::MAX - 1), 1);
        assert_eq!(c.get(0, u64::MAX), 2);
        assert_eq!(c.get(0, 0), 1);
        assert_eq!(c.counters(), 1);
    }

    proptest! {
        #[test]
        fn counts_match_a_plain_map(ops in proptest::collection::vec(
            (0usize..3, 0u64..40, proptest::option::of(0u64..4)), 0..400)
        ) {
            let mut c = TagCounts::default();
            let mut model: HashMap<(usize, u64), u64> = HashMap::new();
            for (rank, tag, set) in ops {
                match set {
                    Some(n) => {
                        c.set(rank, tag, n);
                        model.insert((rank, tag), n);
                    }
                    None => {
                        let m = model.entry((rank, tag)).or_insert(0);
                        prop_assert_eq!(c.take(rank, tag), *m);
                        *m += 1;
                    }
                }
                for (&(r, t), &n) in &model {
                    prop_assert_eq!(c.get(r, t), n);
                }
            }
            prop_assert_eq!(c.counters(), model.values().filter(|&&n| n > 1).count());
            let once: u64 = c.once.values().map(RoaringTreemap::len).sum();
            prop_assert_eq!(once as usize, model.values().filter(|&&n| n == 1).count());
        }
    }

    #[tokio::test]
    async fn a_count_settles_when_its_last_receive_leaves() {
        let counts = RecvCounts::default();
        for tag in 0..1000 {
            let turn = counts.join(4, tag);
            let mut n = turn.count().lock().await;
            assert_eq!(*n, 0);
            *n += 1;
        }
        // 1000 tags received from once: in the bitmap (about 2 bytes each, as few as
        // these are), no lock kept.
        let (locks, bytes) = counts.footprint();
        assert_eq!(locks, 0);
        assert!(bytes < 3 * 1000, "{bytes}");
        // A tag used again continues where it was, and keeps its lock from then on.
        let turn = counts.join(4, 7);
        let mut n = turn.count().lock().await;
        assert_eq!(*n, 1);
        *n += 1;
        drop(n);
        drop(turn);
        assert_eq!(counts.footprint().0, 1);
        let turn = counts.join(4, 7);
        assert_eq!(*turn.count().lock().await, 2);
        drop(turn);
        assert_eq!(counts.footprint().0, 1);
        let turn = counts.join(4, 8);
        assert_eq!(*turn.count().lock().await, 1);
    }

    #[tokio::test]
    async fn receives_in_line_share_one_count() {
        let counts = RecvCounts::default();
        let first = counts.join(1, 9);
        let second = counts.join(1, 9);
        let mut n = first.count().lock().await;
        assert!(second.count().try_lock().is_err());
        *n += 1;
        drop(n);
        // The first leaves while the second still waits: the count stays in use.
        drop(first);
        assert_eq!(counts.footprint().0, 1);
        let third = counts.join(1, 9);
        {
            let mut n = second.count().lock().await;
            assert_eq!(*n, 1);
            *n += 1;
        }
        drop(second);
        assert_eq!(*third.count().lock().await, 2);
    }

    #[tokio::test]
    async fn a_receive_that_counts_nothing_leaves_no_entry() {
        let counts = RecvCounts::default();
        drop(counts.join(0, 3));
        assert_eq!(counts.footprint(), (0, 0));
        assert!(counts.lock().settled.once.is_empty());
    }
}
