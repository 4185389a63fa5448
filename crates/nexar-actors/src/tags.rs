//! Point-to-point message counts per `(rank, tag)`, kept small for tags used once.
//!
//! Messages between a pair under one tag are numbered from 0, on both sides, so that they
//! are received in the order sent. The count of a tag must be kept for as long as the
//! communicator lives: a tag used again continues from it. Programs that take a fresh tag
//! per message (a tag per training step, per request) would otherwise leave a counter
//! behind for every message. Here a tag counted once takes a place in an ordered set of
//! such tags per peer (about 20 bytes), or, where 32 or more of them share an aligned
//! block of 65,536 tags (16 once another block of their range of 2^32 tags has moved),
//! a bit to 9 bytes in a compressed bitmap (roaring): consecutive tags, a tag per step
//! and kind of message. Counters took about 33 bytes per tag on the sending side and 97
//! on the receiving side. (Measured with a counting allocator, 100,000 tags; the tests
//! weigh the same way.)

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use roaring::RoaringTreemap;

/// How many messages each `(rank, tag)` has counted; 0 for those never seen.
#[derive(Debug, Default)]
pub(crate) struct TagCounts {
    /// Counts of 2 and more.
    many: HashMap<(usize, u64), u64>,
    /// Per rank, the tags counted exactly once.
    once: HashMap<usize, Once>,
}

/// A block of this many consecutive tags (aligned: `tag >> 16`) is where the bitmap keeps
/// its tags together: one container per block, an array of 2 bytes per tag up to 4,096
/// of them, else 8 KiB of bits.
const BLOCK_SHIFT: u32 = 16;

/// The bitmap keeps the blocks of each aligned range of 2^32 tags (`tag >> 32`) in a
/// bitmap of their own.
const RANGE_SHIFT: u32 = 32;

/// A block moves into the bitmap once it has this many tags in the set, where its range
/// has a bitmap already: its container (some 60 bytes with its bookkeeping) then costs
/// less than their places in the set.
const DENSE_BLOCK_TAGS: usize = 16;

/// The same for a block whose range has no bitmap yet: the range's bitmap and its
/// bookkeeping take some 200 bytes more.
const DENSE_RANGE_TAGS: usize = 32;

/// One rank's tags counted exactly once.
#[derive(Debug, Default)]
struct Once {
    /// Tags of blocks with few others here, in order, so that a block's tags are found
    /// together.
    sparse: BTreeSet<u64>,
    /// Tags of the blocks in `dense_blocks`.
    dense: RoaringTreemap,
    /// The blocks (`tag >> BLOCK_SHIFT`) whose tags go into `dense`.
    dense_blocks: HashSet<u64>,
    /// The ranges (`tag >> RANGE_SHIFT`) of the blocks in `dense_blocks`.
    dense_ranges: HashSet<u64>,
}

impl Once {
    fn contains(&self, tag: u64) -> bool {
        self.sparse.contains(&tag) || self.dense.contains(tag)
    }

    /// Adds `tag`: to the bitmap if its block is there, else to the set, from which its
    /// block moves into the bitmap once it has enough tags there. A call looks at no more
    /// than a block's worth of the set ([`DENSE_RANGE_TAGS`]): no pause to sort the whole
    /// set, whatever its size.
    fn insert(&mut self, tag: u64) {
        let block = tag >> BLOCK_SHIFT;
        if self.dense_blocks.contains(&block) {
            self.dense.insert(tag);
            return;
        }
        self.sparse.insert(tag);
        let needed = if self.dense_ranges.contains(&(tag >> RANGE_SHIFT)) {
            DENSE_BLOCK_TAGS
        } else {
            DENSE_RANGE_TAGS
        };
        let first = block << BLOCK_SHIFT;
        let last = first | ((1 << BLOCK_SHIFT) - 1);
        if self.sparse.range(first..=last).nth(needed - 1).is_none() {
            return;
        }
        // In order: the block's container is made once, and filled at its end.
        let moving: Vec<u64> = self.sparse.range(first..=last).copied().collect();
        for t in moving {
            self.sparse.remove(&t);
            self.dense.insert(t);
        }
        self.dense_blocks.insert(block);
        self.dense_ranges.insert(tag >> RANGE_SHIFT);
    }

    fn remove(&mut self, tag: u64) {
        if !self.sparse.remove(&tag) {
            self.dense.remove(tag);
        }
    }

    fn is_empty(&self) -> bool {
        self.sparse.is_empty() && self.dense.is_empty()
    }
}

impl TagCounts {
    /// The count of `(rank, tag)`.
    pub(crate) fn get(&self, rank: usize, tag: u64) -> u64 {
        match self.many.get(&(rank, tag)) {
            Some(&n) => n,
            None => self.once_count(rank, tag),
        }
    }

    /// The count of a `(rank, tag)` that has no counter of its own: 1 if it is among the
    /// tags counted once, else 0.
    fn once_count(&self, rank: usize, tag: u64) -> u64 {
        u64::from(self.once.get(&rank).is_some_and(|o| o.contains(tag)))
    }

    /// Sets the count of `(rank, tag)` to `n`.
    pub(crate) fn set(&mut self, rank: usize, tag: u64, n: u64) {
        let was = self.get(rank, tag);
        self.change(rank, tag, was, n);
    }

    /// Moves the count of `(rank, tag)` from `was` (what [`get`](Self::get) gives now)
    /// to `n`, without looking it up again.
    fn change(&mut self, rank: usize, tag: u64, was: u64, n: u64) {
        match was {
            0 => {}
            1 => {
                if let Some(once) = self.once.get_mut(&rank) {
                    once.remove(tag);
                    if once.is_empty() {
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
        // No counter of its own (just looked): counted once or never.
        let n = self.once_count(rank, tag);
        self.change(rank, tag, n, n + 1);
        n
    }

    /// The count of `(rank, tag)`, which is then forgotten (0).
    pub(crate) fn take_out(&mut self, rank: usize, tag: u64) -> u64 {
        let n = self.get(rank, tag);
        self.change(rank, tag, n, 0);
        n
    }

    /// How many tags have a counter of their own (counted more than once).
    #[cfg(test)]
    pub(crate) fn counters(&self) -> usize {
        self.many.len()
    }

    /// The tags counted once: how many in the sets, how many in the bitmaps.
    #[cfg(test)]
    pub(crate) fn once_kept(&self) -> (usize, u64) {
        let sparse = self.once.values().map(|o| o.sparse.len()).sum();
        (sparse, self.once.values().map(|o| o.dense.len()).sum())
    }
}

/// A `(rank, tag)`'s receive count while receives use it: each takes the lock in turn.
type Turn = Arc<TurnState>;

#[derive(Debug)]
struct TurnState {
    count: tokio::sync::Mutex<u64>,
    /// Set (under [`RecvCounts`]' lock) once the count is past one: it then stays in use
    /// for good, so a receive that leaves need not take that lock.
    kept: AtomicBool,
}

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
    /// dropped, a count of one goes back among the tags counted once, and a count of none
    /// leaves no entry.
    pub(crate) fn join(&self, rank: usize, tag: u64) -> RecvTurn<'_> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let (count, users) = inner.active.entry((rank, tag)).or_insert_with(|| {
            // The count moves out of the tags counted once while receives use it.
            let n = inner.settled.take_out(rank, tag);
            let state = TurnState {
                count: tokio::sync::Mutex::new(n),
                kept: AtomicBool::new(false),
            };
            (Arc::new(state), 0)
        });
        *users += 1;
        RecvTurn {
            counts: self,
            key: (rank, tag),
            count: count.clone(),
        }
    }

    /// How many tags have a count of their own (in use, or counted more than once), and
    /// how the tags counted once are kept ([`TagCounts::once_kept`]).
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> (usize, (usize, u64)) {
        let inner = self.lock();
        (inner.active.len(), inner.settled.once_kept())
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
        &self.count.count
    }
}

impl Drop for RecvTurn<'_> {
    fn drop(&mut self) {
        // A count kept for good: its place-in-line tally no longer matters.
        if self.count.kept.load(Ordering::Relaxed) {
            return;
        }
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
        let Ok(n) = self.count.count.try_lock().map(|n| *n) else {
            return;
        };
        if n > 1 {
            self.count.kept.store(true, Ordering::Relaxed);
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
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    /// The system allocator, counting the bytes each thread holds, so that a test can
    /// weigh what it builds on its own thread.
    struct Counting;

    thread_local! {
        static HELD: Cell<isize> = const { Cell::new(0) };
    }

    fn count(delta: isize) {
        let _ = HELD.try_with(|h| h.set(h.get() + delta));
    }

    // SAFETY: every call goes to the system allocator unchanged; the counting touches a
    // thread-local cell that needs no allocation.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            count(layout.size() as isize);
            // SAFETY: the caller's layout, passed on.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            count(-(layout.size() as isize));
            // SAFETY: allocated by `alloc` above with this layout.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            count(layout.size() as isize);
            // SAFETY: the caller's layout, passed on.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            count(new_size as isize - layout.size() as isize);
            // SAFETY: the caller's block and layout, passed on.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    /// The bytes this thread holds now.
    fn held() -> isize {
        HELD.with(Cell::get)
    }

    /// Bytes per tag that the counts take for `tags`, each counted once from ranks 1 and
    /// 2, and the counts.
    fn bytes_per_tag(tags: impl Iterator<Item = u64>) -> (f64, TagCounts) {
        let before = held();
        let mut c = TagCounts::default();
        let mut n = 0u32;
        for tag in tags {
            assert_eq!(c.take(1, tag), 0);
            assert_eq!(c.take(2, tag), 0);
            n += 2;
        }
        ((held() - before) as f64 / f64::from(n), c)
    }

    /// What a plain map of counters took per tag, at the least: its key and count, and a
    /// control byte.
    const MAP_BYTES: f64 = 25.0;

    /// A pattern of tags: its name, and the `i`th tag.
    type Pattern = (&'static str, fn(u64) -> u64);

    #[test]
    fn tags_counted_once_take_less_than_counters() {
        let n = 50_000u64;
        // Consecutive, strided, and a tag per step and kind of message (40 kinds in each
        // step's block): in the bitmap.
        let per_step = |i: u64| ((i / 40) << 16) | (i % 40);
        let dense: [(Pattern, f64); 4] = [
            (("consecutive", |i| i), 1.0),
            (("stride 2", |i| 2 * i), 1.0),
            (("stride 5", |i| 5 * i), 2.0),
            (("per step", per_step), 7.0),
        ];
        for ((name, tag), at_most) in dense {
            let (per_tag, c) = bytes_per_tag((0..n).map(tag));
            assert!(per_tag < at_most, "{name}: {per_tag:.2} bytes per tag");
            assert_eq!(c.once_kept(), (0, 2 * n), "{name}");
            assert_eq!(c.counters(), 0);
            assert_eq!(c.get(1, tag(n - 1)), 1);
            assert_eq!(c.get(2, tag(n)), 0);
            assert_eq!(c.get(3, tag(0)), 0);
        }
        // Far apart (a tag per step in the high bits, hashed request ids, 16 in a
        // block): in the sets, still less than a map of counters took.
        let sparse: [Pattern; 3] = [
            ("spread", |i| (i << 32) | 7),
            ("hashed", |i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            ("stride 4,000", |i| 4_000 * i),
        ];
        for (name, tag) in sparse {
            let (per_tag, c) = bytes_per_tag((0..n).map(tag));
            assert!(per_tag < MAP_BYTES, "{name}: {per_tag:.2} bytes per tag");
            assert_eq!(c.once_kept(), (2 * n as usize, 0), "{name}");
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

    /// Tags in a bitmap count on as those in a set do; a block moves there once it has
    /// 32 tags, or 16 where its range of 2^32 tags has a bitmap already, and takes its
    /// later tags there.
    #[test]
    fn blocks_move_into_the_bitmap_and_keep_their_counts() {
        let mut c = TagCounts::default();
        for tag in 0..31 {
            c.take(0, tag);
        }
        assert_eq!(c.once_kept(), (31, 0));
        c.take(0, 31);
        assert_eq!(c.once_kept(), (0, 32));
        // Its later tags go there too.
        c.take(0, 1000);
        assert_eq!(c.once_kept(), (0, 33));
        // Another block of the same range: at 16.
        let block = 7 << 16;
        for i in 0..15 {
            c.take(0, block + i);
        }
        assert_eq!(c.once_kept(), (15, 33));
        c.take(0, block + 15);
        assert_eq!(c.once_kept(), (0, 49));
        // A block of another range: 16 are not enough.
        let far = 3 << 32;
        for i in 0..16 {
            c.take(0, far + i);
        }
        assert_eq!(c.once_kept(), (16, 49));
        // Used again, from either place.
        assert_eq!(c.take(0, 5), 1);
        assert_eq!(c.take(0, 5), 2);
        assert_eq!(c.take(0, far + 3), 1);
        assert_eq!(c.once_kept(), (15, 48));
        assert_eq!(c.get(0, 31), 1);
        assert_eq!(c.get(0, 32), 0);
        assert_eq!(c.get(0, far + 3), 2);
        assert_eq!(c.counters(), 2);
        // Another rank keeps its own.
        assert_eq!(c.take(1, 5), 0);
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

    /// Applies `ops` (a `take`, or a `set` to a count) to counts and to a plain map, and
    /// checks every answer and count against the map.
    fn against_a_map(ops: &[(usize, u64, Option<u64>)]) -> Result<(), TestCaseError> {
        let mut c = TagCounts::default();
        let mut model: HashMap<(usize, u64), u64> = HashMap::new();
        for &(rank, tag, set) in ops {
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
        }
        for (&(r, t), &n) in &model {
            prop_assert_eq!(c.get(r, t), n);
        }
        prop_assert_eq!(c.counters(), model.values().filter(|&&n| n > 1).count());
        let (sparse, dense) = c.once_kept();
        let once = model.values().filter(|&&n| n == 1).count();
        prop_assert_eq!(sparse + dense as usize, once);
        Ok(())
    }

    proptest! {
        #[test]
        fn counts_match_a_plain_map(ops in proptest::collection::vec(
            (0usize..3,
             prop_oneof![0u64..40, (0u64..4).prop_map(|b| b << 16), any::<u64>()],
             proptest::option::of(0u64..4)),
            0..800)
        ) {
            against_a_map(&ops)?;
        }

        /// Many tags in a few blocks, so that the sets are sorted into the bitmaps.
        #[test]
        fn counts_match_a_plain_map_across_blocks(ops in proptest::collection::vec(
            (0usize..2, 0u64..3, 0u64..400, proptest::option::of(0u64..3)), 0..3000)
        ) {
            let ops: Vec<_> = ops
                .into_iter()
                .map(|(rank, block, low, set)| (rank, (block << 16) | low, set))
                .collect();
            against_a_map(&ops)?;
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
        // 1000 tags received from once: counted once, no lock kept.
        let (locks, (sparse, dense)) = counts.footprint();
        assert_eq!((locks, sparse + dense as usize), (0, 1000));
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
        assert_eq!(counts.footprint(), (0, (0, 0)));
        assert!(counts.lock().settled.once.is_empty());
    }
}
