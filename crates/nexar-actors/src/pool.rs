//! Reused working buffers, so collectives in steady state allocate nothing fresh (touching
//! fresh pages costs ~2.2 µs per 4 KiB on this kind of machine: a 64 MiB buffer per call
//! was 16K+ page faults).

use std::sync::Mutex;

/// A small pool of byte buffers, bounded in count and total bytes.
#[derive(Debug)]
pub(crate) struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    max_buffers: usize,
    max_bytes: usize,
}

impl BufferPool {
    pub(crate) fn new(max_buffers: usize, max_bytes: usize) -> BufferPool {
        BufferPool {
            free: Mutex::new(Vec::new()),
            max_buffers,
            max_bytes,
        }
    }

    /// An empty buffer with capacity for at least `len` bytes (the smallest that fits).
    fn take(&self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        let mut free = self
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let mut b = free.swap_remove(i);
                b.clear();
                b
            }
            None => Vec::with_capacity(len),
        }
    }

    /// A copy of `src` in a pooled buffer.
    pub(crate) fn copy_of(&self, src: &[u8]) -> Vec<u8> {
        let mut b = self.take(src.len());
        b.extend_from_slice(src);
        b
    }

    /// `len` zero bytes in a pooled buffer.
    pub(crate) fn zeroed(&self, len: usize) -> Vec<u8> {
        let mut b = self.take(len);
        b.resize(len, 0);
        b
    }

    /// Returns a buffer for reuse (dropped if the pool is full).
    pub(crate) fn put(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > self.max_bytes {
            return;
        }
        let mut free = self
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        free.push(buf);
        // Keep the largest buffers within the bounds; drop the rest.
        free.sort_unstable_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut total = 0usize;
        let max_bytes = self.max_bytes;
        let mut kept = 0usize;
        free.retain(|b| {
            total += b.capacity();
            kept += 1;
            kept <= self.max_buffers && total <= max_bytes
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_bounded() {
        let pool = BufferPool::new(2, 1 << 20);
        let a = pool.zeroed(1000);
        let ptr = a.as_ptr();
        pool.put(a);
        let b = pool.copy_of(&[7u8; 500]);
        assert_eq!(b.as_ptr(), ptr, "the pooled allocation is reused");
        assert_eq!(b, vec![7u8; 500]);
        pool.put(b);
        pool.put(vec![0u8; 10]);
        pool.put(vec![0u8; 20]);
        assert!(pool.free.lock().map(|f| f.len()).unwrap_or(0) <= 2);
        pool.put(vec![0u8; 2 << 20]);
        assert!(pool
            .free
            .lock()
            .map(|f| f.iter().all(|b| b.capacity() <= 1 << 20))
            .unwrap_or(false));
    }
}
