//! Pinned staging: the per-call resources of [`CudaAdapter`](super::CudaAdapter) (a stream,
//! two page-locked host buffers, device scratch) and the pool that reuses them.
//!
//! Transfers are cut into [`CHUNK`]-byte pieces and double-buffered: while the DMA engine
//! moves one chunk between the device and one pinned buffer, the CPU copies the previous
//! chunk between the other pinned buffer and the caller's (pageable) slice. Allocating
//! pinned memory is slow (it maps and locks pages), so buffers are kept in a small pool
//! instead of being allocated per call.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};

use super::{driver_error, DevPtr};
use crate::DeviceError;

/// Bytes per staged chunk. A multiple of every element size, so a chunk boundary never
/// splits an element; large enough that per-copy overhead is small next to the transfer.
pub(crate) const CHUNK: usize = 8 << 20;

/// At most this many idle slots are kept; more concurrent callers get temporary ones.
const MAX_IDLE_SLOTS: usize = 4;

/// Threads per block of every kernel launch.
const BLOCK: u32 = 256;

/// Upper bound on blocks per launch; the kernels loop over the rest (grid-stride).
const MAX_BLOCKS: u64 = 1 << 16;

/// A launch configuration covering `n` elements with the grid-stride kernels.
pub(crate) fn launch_config(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS);
    LaunchConfig {
        // `blocks <= MAX_BLOCKS` fits in u32.
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What one call needs to move and reduce data: owned by one call at a time.
pub(crate) struct Slot {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Two page-locked buffers of [`CHUNK`] bytes each.
    host: [PinnedHostSlice<u8>; 2],
    /// `done[k]` is recorded after the last DMA that touches `host[k]`; the CPU waits on it
    /// before it reads or overwrites `host[k]`.
    done: [CudaEvent; 2],
    /// `2 * CHUNK` bytes: received chunks land here before a reduce kernel reads them.
    _scratch: CudaSlice<u8>,
    scratch: DevPtr,
    /// [`CHUNK`] bytes, aligned: where an unaligned destination chunk is reduced.
    _acc: CudaSlice<u8>,
    acc: DevPtr,
}

impl Slot {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, DeviceError> {
        let stream = ctx.new_stream().map_err(driver_error("create stream"))?;
        // Flags 0: plain page-locked memory. `alloc_pinned` would ask for write-combined
        // memory, which is fast for the GPU to read but very slow for the CPU to read back.
        let pinned = || {
            // SAFETY: the buffer is uninitialized, but only ever written (by the CPU or by
            // DMA) before it is read, and u8 has no invalid bit patterns.
            unsafe { ctx.alloc_pinned_with_flags::<u8>(CHUNK, 0) }
                .map_err(driver_error("allocate pinned host memory"))
        };
        let host = [pinned()?, pinned()?];
        let event = || ctx.new_event(None).map_err(driver_error("create event"));
        let done = [event()?, event()?];
        // SAFETY: scratch is uninitialized device memory; it is always written before read.
        let scratch = unsafe { stream.alloc::<u8>(2 * CHUNK) }
            .map_err(driver_error("allocate device scratch"))?;
        // SAFETY: as above.
        let acc = unsafe { stream.alloc::<u8>(CHUNK) }
            .map_err(driver_error("allocate device scratch"))?;
        let scratch_ptr = DevPtr(scratch.device_ptr(&stream).0);
        let acc_ptr = DevPtr(acc.device_ptr(&stream).0);
        // Stream-ordered allocations must be complete before other streams may see them.
        stream.synchronize().map_err(driver_error("synchronize"))?;
        Ok(Slot {
            ctx: ctx.clone(),
            stream,
            host,
            done,
            _scratch: scratch,
            scratch: scratch_ptr,
            _acc: acc,
            acc: acc_ptr,
        })
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst`.
    ///
    /// # Safety
    ///
    /// `src` must be a device address in this slot's context, valid for reads of
    /// `dst.len()` bytes, with no pending writes on other streams.
    pub(crate) unsafe fn download(
        &mut self,
        src: DevPtr,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.bind()?;
        let chunks = dst.len().div_ceil(CHUNK);
        if chunks > 0 {
            // SAFETY: forwarded from the caller's contract.
            unsafe { self.enqueue_download(0, src, dst.len()) }?;
        }
        for i in 0..chunks {
            if i + 1 < chunks {
                // The CPU finished reading buffer (i + 1) % 2 in the previous iteration.
                // SAFETY: forwarded from the caller's contract.
                unsafe { self.enqueue_download(i + 1, src, dst.len()) }?;
            }
            let k = i % 2;
            self.done[k]
                .synchronize()
                .map_err(driver_error("device to host copy"))?;
            let (off, n) = chunk_range(i, dst.len());
            let host = self.host[k]
                .as_slice()
                .map_err(driver_error("pinned buffer"))?;
            dst[off..off + n].copy_from_slice(&host[..n]);
        }
        Ok(())
    }

    /// Starts the copy of chunk `i` of `len` bytes at `src` into `host[i % 2]`.
    ///
    /// # Safety
    ///
    /// As [`download`](Self::download); `host[i % 2]` must not be read until `done[i % 2]`
    /// completes.
    unsafe fn enqueue_download(
        &mut self,
        i: usize,
        src: DevPtr,
        len: usize,
    ) -> Result<(), DeviceError> {
        let k = i % 2;
        let (off, n) = chunk_range(i, len);
        let host = self.host[k]
            .as_mut_slice()
            .map_err(driver_error("pinned buffer"))?;
        // SAFETY: `host[..n]` is page-locked and stays alive (owned by this slot) until
        // `done[k]` is waited on; the source range is valid per the caller's contract.
        unsafe {
            result::memcpy_dtoh_async(&mut host[..n], src.0 + off as u64, self.stream.cu_stream())
        }
        .map_err(driver_error("device to host copy"))?;
        self.done[k]
            .record(&self.stream)
            .map_err(driver_error("record event"))
    }

    /// Copies `src` to device address `dst`, chunk by chunk, and waits for the copies.
    ///
    /// # Safety
    ///
    /// `dst` must be a device address in this slot's context, valid for writes of
    /// `src.len()` bytes, and not accessed by anything else meanwhile.
    pub(crate) unsafe fn upload(&mut self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.bind()?;
        for i in 0..src.len().div_ceil(CHUNK) {
            let (off, n) = chunk_range(i, src.len());
            // SAFETY: forwarded from the caller's contract.
            unsafe { self.enqueue_upload(i, dst.offset(off), &src[off..off + n]) }?;
        }
        self.sync()
    }

    /// Fills `host[i % 2]` with `src` (at most [`CHUNK`] bytes) once its last DMA is done,
    /// and starts copying it to `dst`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `src.len()` bytes in this slot's context.
    unsafe fn enqueue_upload(
        &mut self,
        i: usize,
        dst: DevPtr,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        let k = i % 2;
        self.done[k]
            .synchronize()
            .map_err(driver_error("host to device copy"))?;
        let host = self.host[k]
            .as_mut_slice()
            .map_err(driver_error("pinned buffer"))?;
        let host = &mut host[..src.len()];
        host.copy_from_slice(src);
        // SAFETY: `host` is page-locked and owned by the slot; it is not written again
        // before `done[k]` completes. The destination is valid per the caller's contract.
        unsafe { result::memcpy_htod_async(dst.0, host, self.stream.cu_stream()) }
            .map_err(driver_error("host to device copy"))?;
        self.done[k]
            .record(&self.stream)
            .map_err(driver_error("record event"))
    }

    /// `dst = f(dst, src)` where `f` is the reduce kernel `func` over elements of
    /// `elem_size` bytes: `src` is staged chunk by chunk into device scratch, and the kernel
    /// runs on each chunk. Waits for completion.
    ///
    /// # Safety
    ///
    /// `dst` must be a device address in this slot's context, valid for reads and writes of
    /// `src.len()` bytes, and not accessed by anything else meanwhile. `func` must be a
    /// reduce kernel for elements of `elem_size` bytes, and `src.len()` a multiple of it.
    pub(crate) unsafe fn reduce(
        &mut self,
        dst: DevPtr,
        src: &[u8],
        elem_size: usize,
        func: &CudaFunction,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        let aligned = dst.0 % elem_size as u64 == 0;
        for i in 0..src.len().div_ceil(CHUNK) {
            let (off, n) = chunk_range(i, src.len());
            let scratch = self.scratch.offset((i % 2) * CHUNK);
            // Scratch half `i % 2` was last read by the kernel of chunk `i - 2`, which runs
            // earlier on this same stream, so the copy cannot overtake it.
            // SAFETY: `scratch` has CHUNK bytes at this offset, owned by the slot.
            unsafe { self.enqueue_upload(i, scratch, &src[off..off + n]) }?;
            let target = dst.offset(off);
            // SAFETY: `target` is valid for `n` bytes (caller's contract), `scratch` and
            // `acc` are slot-owned with at least `n` bytes, and the kernel reads and writes
            // exactly `n / elem_size` elements of each.
            unsafe {
                if aligned {
                    self.launch_reduce(func, target, scratch, n / elem_size)?;
                } else {
                    // A kernel cannot load misaligned elements, so reduce an aligned copy.
                    self.copy_dtod(self.acc, target, n)?;
                    self.launch_reduce(func, self.acc, scratch, n / elem_size)?;
                    self.copy_dtod(target, self.acc, n)?;
                }
            }
        }
        self.sync()
    }

    /// `dst = f(dst, src)` over `n` elements, both aligned device buffers; waits.
    ///
    /// # Safety
    ///
    /// `dst` and `src` must be valid, non-overlapping, aligned device ranges of `n`
    /// elements of the kernel's type in this slot's context, with no pending work on other
    /// streams, and nothing else may access them meanwhile.
    pub(crate) unsafe fn reduce_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        n: usize,
        func: &CudaFunction,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.launch_reduce(func, dst, src, n) }?;
        self.sync()
    }

    /// Runs the divide kernel `func` over `len` bytes at `buf` (elements of `elem_size`
    /// bytes) with `divisor` (an `f32` or `f64`, matching the kernel); waits.
    ///
    /// # Safety
    ///
    /// `buf` must be valid for reads and writes of `len` bytes in this slot's context and
    /// not accessed by anything else meanwhile; `func` must be the divide kernel for
    /// `elem_size`-byte elements taking a `D` divisor; `len` a multiple of `elem_size`.
    pub(crate) unsafe fn divide<D: cudarc::driver::DeviceRepr>(
        &mut self,
        buf: DevPtr,
        len: usize,
        elem_size: usize,
        func: &CudaFunction,
        divisor: D,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        let launch = |slot: &Self, ptr: DevPtr, n: usize| {
            let n = n as u64;
            let mut args = slot.stream.launch_builder(func);
            args.arg(&ptr.0).arg(&n).arg(&divisor);
            // SAFETY: the kernel touches `n` elements at `ptr`, valid per the contract.
            unsafe { args.launch(launch_config(n)) }.map_err(driver_error("launch kernel"))
        };
        if buf.0 % elem_size as u64 == 0 {
            launch(self, buf, len / elem_size)?;
        } else {
            for i in 0..len.div_ceil(CHUNK) {
                let (off, n) = chunk_range(i, len);
                // SAFETY: `acc` holds CHUNK bytes; `buf + off` is valid for `n` bytes.
                unsafe { self.copy_dtod(self.acc, buf.offset(off), n) }?;
                launch(self, self.acc, n / elem_size)?;
                // SAFETY: as above.
                unsafe { self.copy_dtod(buf.offset(off), self.acc, n) }?;
            }
        }
        self.sync()
    }

    /// Launches the reduce kernel `func` on `n` elements; does not wait.
    ///
    /// # Safety
    ///
    /// See [`reduce_device`](Self::reduce_device).
    unsafe fn launch_reduce(
        &self,
        func: &CudaFunction,
        dst: DevPtr,
        src: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        let n = n as u64;
        let mut args = self.stream.launch_builder(func);
        args.arg(&dst.0).arg(&src.0).arg(&n);
        // SAFETY: forwarded from the caller's contract; the kernel signature is
        // (T*, const T*, unsigned long long) and the arguments are two device addresses
        // and a u64.
        unsafe { args.launch(launch_config(n)) }.map_err(driver_error("launch kernel"))?;
        Ok(())
    }

    /// Enqueues a device-to-device copy of `n` bytes.
    ///
    /// # Safety
    ///
    /// Both ranges must be valid device memory of this context and not overlap.
    unsafe fn copy_dtod(&self, dst: DevPtr, src: DevPtr, n: usize) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { result::memcpy_dtod_async(dst.0, src.0, n, self.stream.cu_stream()) }
            .map_err(driver_error("device to device copy"))
    }

    /// Makes this slot's context current on the calling thread (raw driver calls need it).
    fn bind(&self) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_error("bind context"))
    }

    fn sync(&self) -> Result<(), DeviceError> {
        self.stream
            .synchronize()
            .map_err(driver_error("synchronize"))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // A failed call can leave copies in flight; the pinned buffers must outlive them.
        // Nothing useful can be done with an error here: the buffers are freed either way.
        let _ = self.stream.synchronize();
    }
}

/// Offset and length of chunk `i` of a `len`-byte transfer.
fn chunk_range(i: usize, len: usize) -> (usize, usize) {
    let off = i * CHUNK;
    (off, CHUNK.min(len - off))
}

/// Idle [`Slot`]s of one context, reused across calls.
pub(crate) struct Pool {
    idle: Mutex<Vec<Slot>>,
}

impl Pool {
    pub(crate) fn new() -> Self {
        Pool {
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` with a slot: an idle one if there is one, else a new one. The slot goes
    /// back to the pool afterwards unless `f` failed (a failed slot may have a broken
    /// stream, so it is dropped instead, after waiting for its stream).
    pub(crate) fn with_slot<R>(
        &self,
        ctx: &Arc<CudaContext>,
        f: impl FnOnce(&mut Slot) -> Result<R, DeviceError>,
    ) -> Result<R, DeviceError> {
        let idle = self.lock().pop();
        let mut slot = match idle {
            Some(slot) => slot,
            None => Slot::new(ctx)?,
        };
        let out = f(&mut slot);
        if out.is_ok() {
            let mut idle = self.lock();
            if idle.len() < MAX_IDLE_SLOTS {
                idle.push(slot);
            }
        }
        out
    }

    /// Number of idle slots (for tests and diagnostics).
    pub(crate) fn idle(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        // A panic while holding the lock cannot leave the Vec inconsistent.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
