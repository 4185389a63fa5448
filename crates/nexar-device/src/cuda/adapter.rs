//! [`CudaAdapter`]: the [`DeviceAdapter`] for memory on one CUDA device.

use std::collections::HashMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

use super::source::{self, div_kernel_name, kernel_op, reduce_kernel_name, KERNEL_OPS};
use super::staging::Pool;
use super::{driver_error, DevPtr, DeviceBuffer, NAME};
use crate::{check_op, DataType, DeviceAdapter, DeviceError, Element, ReduceOp};

/// A [`DeviceAdapter`] for memory on one CUDA device: pointers handed to it are device
/// addresses in the device's primary context.
///
/// Staging goes through pinned host buffers that the adapter pools and reuses, and
/// reductions run as NVRTC-compiled kernels on the device. Share it by wrapping it in an
/// `Arc` and use it from any thread; concurrent calls use separate streams and buffers.
///
/// # Building
///
/// The `cuda` feature pulls in [`cudarc`] with *dynamic loading*: `libcuda` (the driver) and
/// `libnvrtc` (the run-time compiler) are opened with `dlopen` when first needed, so
/// building needs neither a GPU nor a CUDA toolkit, and a binary built with the feature
/// still runs on a machine without them. [`Self::new`] then fails with
/// [`DeviceError::Unavailable`](crate::DeviceError::Unavailable) instead of panicking.
/// The bindings target the CUDA 12.4 API, which newer drivers (12.x and 13.x) also serve;
/// `libnvrtc.so.12` (or an unversioned `libnvrtc.so`) must be on the loader path for
/// reductions. Setting `CUDARC_CUDA_VERSION` (for example `13000`) at build time picks other
/// bindings and library names.
///
/// # Design
///
/// Only the wire sees host memory. A send stages device memory to the host
/// ([`DeviceAdapter::stage_to_host`](crate::DeviceAdapter::stage_to_host)); a receive writes
/// host bytes to the device or reduces them into it. Copies go through page-locked (pinned)
/// host buffers with asynchronous copies on a stream, in 8 MiB chunks, double-buffered so
/// that the DMA engine and the CPU-side `memcpy` into the caller's slice overlap. The
/// pinned buffers, their stream and some device scratch live in a small pool inside the
/// adapter and are reused across calls, since pinning memory is expensive; concurrent
/// callers each take their own set. Every call synchronizes before it returns, as the
/// [`DeviceAdapter`](crate::DeviceAdapter) contract requires.
///
/// Reductions run on the GPU: received bytes are staged into device scratch, then a small
/// kernel computes `dst = op(dst, scratch)`. There is one kernel per (data type, op), with
/// the CPU kernels' semantics: integers wrap, float `min`/`max` ignore a NaN operand,
/// `f16`/`bf16` are computed in `f32` and rounded to nearest, ties to even, and `Avg` sums
/// (divide once at the end with [`Self::finalize_buffer`] or
/// [`Self::finalize_raw`]; in `f16` the collectives divide each contribution with them
/// before the sum instead). One difference: a GPU's float arithmetic gives its own NaN
/// whatever the operands' (see [`ReduceOp`](crate::ReduceOp) on NaN payloads). The kernels' CUDA C source is generated in this crate
/// and compiled with NVRTC the first time a reduction needs it (or eagerly with
/// [`Self::prepare_kernels`]).
///
/// Device memory must have no pending work on other streams when it is handed to the
/// adapter: synchronize your own streams first. [`DeviceBuffer`] methods synchronize before
/// they return, so buffers made with them are always ready.
///
/// # Testing
///
/// ```text
/// cargo test -p nexar-device --features cuda
/// ```
///
/// runs the CPU-side tests everywhere (kernel source generation, the typed error without a
/// driver) and the GPU tests when `CudaAdapter::new(0)` succeeds; without a device each GPU
/// test prints `skipping: no CUDA device: <reason>` and passes. `gpu-check.sh` in the crate
/// directory builds in release mode, runs the tests and the `cuda_staging` bandwidth
/// example in one go.
pub struct CudaAdapter {
    ctx: Arc<CudaContext>,
    /// The stream [`DeviceBuffer`]s are allocated, filled and freed on.
    stream: Arc<CudaStream>,
    pool: Pool,
    /// Compiled on first use, so that copies work even where NVRTC is missing.
    kernels: Mutex<Option<Arc<Kernels>>>,
}

/// The loaded kernel module and its functions.
struct Kernels {
    reduce: HashMap<(DataType, ReduceOp), CudaFunction>,
    divide: HashMap<DataType, CudaFunction>,
    _module: Arc<CudaModule>,
}

impl CudaAdapter {
    /// Opens CUDA device `device_ordinal` (0-based, in the driver's order).
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unavailable`] when the CUDA driver library cannot be loaded, the
    /// driver fails to initialize, or there is no device with that ordinal: the errors that
    /// mean "no usable GPU here". [`DeviceError::Adapter`] when the device exists but
    /// setting it up fails. Never panics, even with no driver installed.
    pub fn new(device_ordinal: usize) -> Result<Self, DeviceError> {
        // SAFETY: only tries to `dlopen` the driver library by its usual names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(DeviceError::Unavailable(
                "the CUDA driver library (libcuda) could not be loaded".to_owned(),
            ));
        }
        // cudarc panics when a driver symbol it needs is missing (a driver older than the
        // bindings); report that as unavailable rather than unwinding into the caller.
        catch_unwind(AssertUnwindSafe(|| Self::open(device_ordinal))).unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(DeviceError::Unavailable(format!(
                "the CUDA driver could not be used: {what}"
            )))
        })
    }

    fn open(ordinal: usize) -> Result<Self, DeviceError> {
        cudarc::driver::result::init()
            .map_err(|e| DeviceError::Unavailable(format!("cuInit failed: {e}")))?;
        let count = CudaContext::device_count()
            .map_err(|e| DeviceError::Unavailable(format!("cannot count CUDA devices: {e}")))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(DeviceError::Unavailable(format!(
                "no CUDA device {ordinal}: {count} device(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_error("open device"))?;
        let stream = ctx.new_stream().map_err(driver_error("create stream"))?;
        Ok(CudaAdapter {
            ctx,
            stream,
            pool: Pool::new(),
            kernels: Mutex::new(None),
        })
    }

    /// The device ordinal this adapter was opened with.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name as the driver reports it, e.g. `"NVIDIA H200"`.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Adapter`] if the driver call fails.
    pub fn device_name(&self) -> Result<String, DeviceError> {
        self.ctx.name().map_err(driver_error("device name"))
    }

    /// Compiles and loads the reduction kernels now rather than on the first reduction
    /// (which otherwise pays NVRTC's compile time, typically well under a second, inside
    /// a collective, blocking the thread that runs it, and within the call's deadline).
    /// The device's copies and waits block the calling thread too: a collective on device
    /// buffers holds its runtime thread while they run.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unavailable`] if NVRTC cannot be loaded, [`DeviceError::Adapter`] if
    /// compiling or loading fails.
    pub fn prepare_kernels(&self) -> Result<(), DeviceError> {
        self.kernels().map(drop)
    }

    /// Number of idle pinned staging sets kept for reuse (at most a few).
    pub fn idle_staging_buffers(&self) -> usize {
        self.pool.idle()
    }

    pub(super) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn kernels(&self) -> Result<Arc<Kernels>, DeviceError> {
        // Holding the lock while compiling makes concurrent first callers wait for one
        // compile instead of each running their own.
        let mut slot = self.kernels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let k = Arc::new(self.compile()?);
        *slot = Some(k.clone());
        Ok(k)
    }

    fn compile(&self) -> Result<Kernels, DeviceError> {
        // SAFETY: only tries to `dlopen` the NVRTC library by its usual names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(DeviceError::Unavailable(
                "the NVRTC library (libnvrtc) could not be loaded; it is needed to compile \
                 the reduction kernels"
                    .to_owned(),
            ));
        }
        let src = source::kernel_source();
        let ptx = catch_unwind(|| cudarc::nvrtc::compile_ptx(&src))
            .map_err(|_| DeviceError::Unavailable("NVRTC could not be used".to_owned()))?
            .map_err(|e| DeviceError::Adapter {
                adapter: NAME,
                message: format!("compile reduction kernels: {e}"),
            })?;
        let module = self
            .ctx
            .load_module(ptx)
            .map_err(driver_error("load reduction kernels"))?;
        let mut reduce = HashMap::new();
        let mut divide = HashMap::new();
        for dtype in DataType::ALL {
            for op in KERNEL_OPS {
                let f = module
                    .load_function(&reduce_kernel_name(dtype, op))
                    .map_err(driver_error("load reduction kernel"))?;
                reduce.insert((dtype, op), f);
            }
            if let Some(name) = div_kernel_name(dtype) {
                let f = module
                    .load_function(&name)
                    .map_err(driver_error("load divide kernel"))?;
                divide.insert(dtype, f);
            }
        }
        Ok(Kernels {
            reduce,
            divide,
            _module: module,
        })
    }

    /// The reduce kernel for `(dtype, op)`; `op` was checked with [`check_op`].
    fn reduce_kernel(&self, dtype: DataType, op: ReduceOp) -> Result<CudaFunction, DeviceError> {
        let kernels = self.kernels()?;
        kernels
            .reduce
            .get(&(dtype, kernel_op(op)))
            .cloned()
            .ok_or(DeviceError::UnsupportedOp { op, dtype })
    }

    /// Fails with [`DeviceError::WrongDevice`] unless `buf` lives in this adapter's context.
    pub(super) fn check_buffer<T: Element>(
        &self,
        buf: &DeviceBuffer<T>,
    ) -> Result<(), DeviceError> {
        if **buf.context() != *self.ctx {
            return Err(DeviceError::WrongDevice {
                adapter: self.ordinal(),
                buffer: buf.ordinal(),
            });
        }
        Ok(())
    }

    /// Copies all of `buf` into `dst` (bytes, as the wire sends them) through pinned staging.
    ///
    /// # Errors
    ///
    /// [`DeviceError::WrongDevice`] if `buf` belongs to another device or context,
    /// [`DeviceError::LengthMismatch`] unless `dst.len() == buf.byte_len()`, and
    /// [`DeviceError::Adapter`] if a copy fails.
    pub fn stage_buffer<T: Element>(
        &self,
        buf: &DeviceBuffer<T>,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.check_buffer(buf)?;
        check_len(dst.len(), buf.byte_len())?;
        // SAFETY: the buffer owns `byte_len` bytes in this context (checked above), has no
        // pending work (its methods synchronize), and is borrowed for the whole call.
        unsafe { self.stage_to_host(buf.device_ptr(), dst) }
    }

    /// Overwrites all of `buf` with the bytes `src` through pinned staging.
    ///
    /// # Errors
    ///
    /// As [`stage_buffer`](Self::stage_buffer), and [`DeviceError::BadLength`] when `src`
    /// is not a whole number of `T`.
    pub fn write_buffer<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        self.check_buffer(buf)?;
        T::DTYPE.element_count(src.len())?;
        check_len(buf.byte_len(), src.len())?;
        // SAFETY: as in `stage_buffer`; `buf` is borrowed mutably, so nothing else uses it.
        unsafe { self.write_from_host(buf.device_ptr_mut(), src) }
    }

    /// Reduces received bytes `src` into `buf` on the device: `buf = op(buf, src)`, with
    /// the semantics of [`reduce_bytes`](crate::reduce_bytes) (so `Avg` sums).
    ///
    /// # Errors
    ///
    /// As [`write_buffer`](Self::write_buffer), plus [`DeviceError::UnsupportedOp`] for
    /// `Avg` on an integer type and the errors of [`prepare_kernels`](Self::prepare_kernels).
    pub fn reduce_into_buffer<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        src: &[u8],
        op: ReduceOp,
    ) -> Result<(), DeviceError> {
        check_op(T::DTYPE, op)?;
        self.check_buffer(buf)?;
        T::DTYPE.element_count(src.len())?;
        check_len(buf.byte_len(), src.len())?;
        // SAFETY: as in `write_buffer`.
        unsafe { self.reduce_from_host(buf.device_ptr_mut(), src, T::DTYPE, op) }
    }

    /// Reduces one device buffer into another without touching the host:
    /// `dst = op(dst, src)`, e.g. to combine local GPU buffers before a collective.
    ///
    /// # Errors
    ///
    /// [`DeviceError::WrongDevice`] if either buffer belongs to another device,
    /// [`DeviceError::LengthMismatch`] (in bytes) if their lengths differ, and as
    /// [`reduce_into_buffer`](Self::reduce_into_buffer).
    pub fn reduce_device<T: Element>(
        &self,
        dst: &mut DeviceBuffer<T>,
        src: &DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<(), DeviceError> {
        check_op(T::DTYPE, op)?;
        self.check_buffer(dst)?;
        self.check_buffer(src)?;
        check_len(dst.byte_len(), src.byte_len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let func = self.reduce_kernel(T::DTYPE, op)?;
        let (d, s) = (
            DevPtr(dst.device_ptr_mut() as u64),
            DevPtr(src.device_ptr() as u64),
        );
        self.pool.with_slot(&self.ctx, |slot| {
            // SAFETY: two distinct, live, aligned allocations of `len` elements of `T` in
            // this context (checked above), with no pending work; `dst` is borrowed
            // mutably and `src` shared, so they cannot be the same buffer.
            unsafe { slot.reduce_device(d, s, dst.len(), &func) }
        })
    }

    /// The final step of an `Avg` on the device: divides every element of `buf` by
    /// `divisor` (a no-op for other ops), with the semantics of
    /// [`finalize_bytes`](crate::finalize_bytes).
    ///
    /// # Errors
    ///
    /// [`DeviceError::WrongDevice`], [`DeviceError::UnsupportedOp`] for `Avg` on an
    /// integer type, [`DeviceError::ZeroDivisor`], and the errors of
    /// [`prepare_kernels`](Self::prepare_kernels).
    pub fn finalize_buffer<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        op: ReduceOp,
        divisor: usize,
    ) -> Result<(), DeviceError> {
        self.check_buffer(buf)?;
        let len = buf.byte_len();
        // SAFETY: `buf` owns `len` bytes in this context and is borrowed mutably.
        unsafe { self.finalize_raw(buf.device_ptr_mut(), len, T::DTYPE, op, divisor) }
    }

    /// Raw form of [`finalize_buffer`](Self::finalize_buffer), for device memory handed to
    /// the runtime as a pointer: divides the `len` bytes of `dtype` elements at `buf` by
    /// `divisor` when `op` is `Avg`.
    ///
    /// # Errors
    ///
    /// As [`finalize_bytes`](crate::finalize_bytes), plus [`DeviceError::Adapter`] when a
    /// device call fails. On error the device bytes may have been partly divided.
    ///
    /// # Safety
    ///
    /// `buf` must be a device address in this adapter's context, valid for reads and writes
    /// of `len` bytes, with no pending work on other streams, and nothing else may access
    /// that memory meanwhile. If `len` is 0, `buf` may be any pointer. `buf` need not be
    /// aligned for `dtype`.
    pub unsafe fn finalize_raw(
        &self,
        buf: *mut u8,
        len: usize,
        dtype: DataType,
        op: ReduceOp,
        divisor: usize,
    ) -> Result<(), DeviceError> {
        // Validation and the no-op cases in the same order as `finalize_bytes`.
        check_op(dtype, op)?;
        dtype.element_count(len)?;
        if op != ReduceOp::Avg {
            return Ok(());
        }
        if divisor == 0 {
            return Err(DeviceError::ZeroDivisor);
        }
        if divisor == 1 || len == 0 {
            return Ok(());
        }
        let kernels = self.kernels()?;
        let func = kernels
            .divide
            .get(&dtype)
            .ok_or(DeviceError::UnsupportedOp { op, dtype })?;
        let ptr = DevPtr(buf as u64);
        self.pool.with_slot(&self.ctx, |slot| {
            // SAFETY: forwarded from the caller's contract; `func` is the divide kernel for
            // `dtype`, whose divisor is a double for f64 and a float otherwise (the same
            // conversions as the CPU kernels).
            unsafe {
                if dtype == DataType::F64 {
                    slot.divide(ptr, len, dtype.size(), func, divisor as f64)
                } else {
                    slot.divide(ptr, len, dtype.size(), func, divisor as f32)
                }
            }
        })
    }
}

/// [`DeviceError::LengthMismatch`] unless the byte lengths agree.
fn check_len(dst: usize, src: usize) -> Result<(), DeviceError> {
    if dst == src {
        Ok(())
    } else {
        Err(DeviceError::LengthMismatch { dst, src })
    }
}

impl fmt::Debug for CudaAdapter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAdapter")
            .field("ordinal", &self.ordinal())
            .field("idle_staging_buffers", &self.pool.idle())
            .finish_non_exhaustive()
    }
}

/// Pointers are device addresses (`CUdeviceptr`) in the adapter's context, passed as
/// `*const u8`/`*mut u8`. Beyond the trait's contract, the memory must have no pending work
/// on other streams when a call starts. Every call synchronizes before returning.
impl DeviceAdapter for CudaAdapter {
    fn name(&self) -> &'static str {
        NAME
    }

    unsafe fn stage_to_host(&self, src: *const u8, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.is_empty() {
            return Ok(());
        }
        let src = DevPtr(src as u64);
        self.pool.with_slot(&self.ctx, |slot| {
            // SAFETY: the caller guarantees `src` is a readable device range of
            // `dst.len()` bytes for this call.
            unsafe { slot.download(src, dst) }
        })
    }

    unsafe fn write_from_host(&self, dst: *mut u8, src: &[u8]) -> Result<(), DeviceError> {
        if src.is_empty() {
            return Ok(());
        }
        let dst = DevPtr(dst as u64);
        self.pool.with_slot(&self.ctx, |slot| {
            // SAFETY: the caller guarantees `dst` is a writable, unaliased device range of
            // `src.len()` bytes for this call.
            unsafe { slot.upload(dst, src) }
        })
    }

    unsafe fn reduce_from_host(
        &self,
        dst: *mut u8,
        src: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), DeviceError> {
        check_op(dtype, op)?;
        dtype.element_count(src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let func = self.reduce_kernel(dtype, op)?;
        let dst = DevPtr(dst as u64);
        self.pool.with_slot(&self.ctx, |slot| {
            // SAFETY: the caller guarantees `dst` is a readable and writable, unaliased
            // device range of `src.len()` bytes; `func` is the kernel for `dtype`, and
            // `src.len()` is a whole number of elements (checked above).
            unsafe { slot.reduce(dst, src, dtype.size(), &func) }
        })
    }
}
