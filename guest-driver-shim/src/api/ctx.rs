//! The context stack, per-context settings, the primary context's state,
//! and device queries beyond the basics (PCI ids, peers, properties).

use std::ffi::{c_char, c_int, c_uint, CStr};

use virtio_gpu_compute::CuResult;

use crate::client::{CallError, CallResult};

use super::{bad, dec, enc, out, with, CUdevice, CUresult, Shim, CURRENT, H, TAG_CTX};

thread_local! {
    /// The contexts below the current one on this thread's stack.
    static STACK: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `CUlimit` values and their defaults on this device.
const LIMIT_DEFAULTS: [u64; 10] = [
    1024,    // CU_LIMIT_STACK_SIZE
    1 << 20, // CU_LIMIT_PRINTF_FIFO_SIZE
    8 << 20, // CU_LIMIT_MALLOC_HEAP_SIZE
    2,       // CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH
    2048,    // CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT
    64,      // CU_LIMIT_MAX_L2_FETCH_GRANULARITY
    0,       // CU_LIMIT_PERSISTING_L2_CACHE_SIZE
    0,       // CU_LIMIT_SHMEM_SIZE
    0,       // CU_LIMIT_CIG_ENABLED
    0,       // CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED
];

/// A context's settings, as the application set them. The CPU device has
/// no caches or banks to configure: the values are kept and reported back.
#[derive(Clone)]
pub(super) struct CtxConf {
    pub flags: c_uint,
    pub limits: [u64; 10],
    pub cache: c_uint,
    pub shmem: c_uint,
}

impl CtxConf {
    pub fn new(flags: c_uint) -> CtxConf {
        CtxConf { flags, limits: LIMIT_DEFAULTS, cache: 0, shmem: 0 }
    }
}

/// Stream priorities a context offers: CUDA's convention, lower is more
/// urgent; 0 is the default.
pub const PRIORITY_LEAST: c_int = 0;
pub const PRIORITY_GREATEST: c_int = -5;

fn invalid_ctx() -> CallError {
    CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "invalid context")
}

impl Shim {
    fn conf<R>(&self, f: impl FnOnce(&mut CtxConf) -> R) -> CallResult<R> {
        let c = self.current()?;
        let mut st = self.st();
        let conf = st.conf.entry(c).or_insert_with(|| CtxConf::new(0));
        Ok(f(conf))
    }

    fn live_ctx(&self, h: H) -> CallResult<u32> {
        dec(TAG_CTX, h).filter(|c| self.st().ctxs.contains(c)).ok_or_else(invalid_ctx)
    }
}

/// Pops the current context of the thread that is destroying `c`, and
/// removes `c` from every level of its stack.
pub(super) fn forget_on_thread(c: u32) {
    let _ = STACK.try_with(|s| s.borrow_mut().retain(|x| *x != c));
}

/// Makes `c` current, keeping the previous current context below it.
pub(super) fn push_current(c: u32) -> CallResult<()> {
    let prev = CURRENT.with(|cur| cur.replace(c));
    if prev != 0 {
        STACK.try_with(|st| st.borrow_mut().push(prev)).map_err(|_| CallError::new(CuResult::CUDA_ERROR_DEINITIALIZED, "the thread is exiting"))?;
    }
    Ok(())
}

/// Pops the current context: the one below becomes current (or none).
pub(super) fn pop_current() {
    let below = STACK.try_with(|st| st.borrow_mut().pop()).ok().flatten().unwrap_or(0);
    CURRENT.with(|cur| cur.set(below));
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: H) -> CUresult {
    with("cuCtxPushCurrent", |s| push_current(s.live_ctx(ctx)?))
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent(ctx: H) -> CUresult {
    cuCtxPushCurrent_v2(ctx)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut H) -> CUresult {
    with("cuCtxPopCurrent", |s| {
        let c = s.current()?;
        pop_current();
        if !pctx.is_null() {
            out(pctx, enc(TAG_CTX, c))?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent(pctx: *mut H) -> CUresult {
    // SAFETY: same contract as cuCtxPopCurrent_v2.
    unsafe { cuCtxPopCurrent_v2(pctx) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut c_uint) -> CUresult {
    with("cuCtxGetFlags", |s| {
        let f = s.conf(|c| c.flags)?;
        out(flags, f)
    })
}

/// Scheduling flags only (CU_CTX_SCHED_*, BLOCKING_SYNC, 0x0f); the
/// others are fixed at creation, as on CUDA.
#[no_mangle]
pub extern "C" fn cuCtxSetFlags(flags: c_uint) -> CUresult {
    with("cuCtxSetFlags", |s| {
        if flags & !0x0f != 0 {
            return Err(bad("only the scheduling flags can change after creation"));
        }
        s.conf(|c| c.flags = (c.flags & !0x0f) | flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: H, version: *mut c_uint) -> CUresult {
    with("cuCtxGetApiVersion", |s| {
        if !ctx.is_null() {
            s.live_ctx(ctx)?;
        } else {
            s.current()?;
        }
        out(version, 3020)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetId(ctx: H, id: *mut u64) -> CUresult {
    with("cuCtxGetId", |s| {
        let c = if ctx.is_null() { s.current()? } else { s.live_ctx(ctx)? };
        out(id, c as u64)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetLimit(v: *mut usize, limit: c_int) -> CUresult {
    with("cuCtxGetLimit", |s| {
        let i = usize::try_from(limit).ok().filter(|i| *i < LIMIT_DEFAULTS.len()).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_UNSUPPORTED_LIMIT, format!("limit {limit}")))?;
        let x = s.conf(|c| c.limits[i])?;
        out(v, x as usize)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetLimit(limit: c_int, v: usize) -> CUresult {
    with("cuCtxSetLimit", |s| {
        let i = usize::try_from(limit).ok().filter(|i| *i < LIMIT_DEFAULTS.len()).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_UNSUPPORTED_LIMIT, format!("limit {limit}")))?;
        // Limits that would reserve device memory stay within the quota's
        // reach: the device never grows a tenant's footprint for them.
        if i <= 2 && v as u64 > s.info.total_mem {
            return Err(CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("limit {limit} of {v} bytes exceeds the vGPU's memory")));
        }
        s.conf(|c| c.limits[i] = v as u64)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCacheConfig(cfg: *mut c_uint) -> CUresult {
    with("cuCtxGetCacheConfig", |s| {
        let v = s.conf(|c| c.cache)?;
        out(cfg, v)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCacheConfig(cfg: c_uint) -> CUresult {
    with("cuCtxSetCacheConfig", |s| {
        if cfg > 4 {
            return Err(bad("unknown cache configuration"));
        }
        s.conf(|c| c.cache = cfg)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetSharedMemConfig(cfg: *mut c_uint) -> CUresult {
    with("cuCtxGetSharedMemConfig", |s| {
        let v = s.conf(|c| c.shmem)?;
        out(cfg, v)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetSharedMemConfig(cfg: c_uint) -> CUresult {
    with("cuCtxSetSharedMemConfig", |s| {
        if cfg > 2 {
            return Err(bad("unknown shared memory configuration"));
        }
        s.conf(|c| c.shmem = cfg)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) -> CUresult {
    with("cuCtxGetStreamPriorityRange", |s| {
        s.current()?;
        if !least.is_null() {
            out(least, PRIORITY_LEAST)?;
        }
        if !greatest.is_null() {
            out(greatest, PRIORITY_GREATEST)?;
        }
        Ok(())
    })
}

/// Nothing persists in an L2 cache on this device.
#[no_mangle]
pub extern "C" fn cuCtxResetPersistingL2Cache() -> CUresult {
    with("cuCtxResetPersistingL2Cache", |s| s.current().map(|_| ()))
}

// ---- the primary context ----------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    with("cuDevicePrimaryCtxGetState", |s| {
        s.device(dev)?;
        let st = s.st();
        let f = st.primary.and_then(|c| st.conf.get(&c).map(|c| c.flags)).unwrap_or(st.primary_flags);
        let a = (st.primary.is_some() && st.primary_refs > 0) as c_int;
        drop(st);
        out(flags, f)?;
        out(active, a)
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) -> CUresult {
    with("cuDevicePrimaryCtxSetFlags", |s| {
        s.device(dev)?;
        if flags & !0x1f != 0 {
            return Err(bad("unknown primary context flags"));
        }
        let mut st = s.st();
        st.primary_flags = flags;
        if let Some(c) = st.primary {
            st.conf.entry(c).or_insert_with(|| CtxConf::new(0)).flags = flags;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) -> CUresult {
    cuDevicePrimaryCtxSetFlags_v2(dev, flags)
}

/// Destroys the primary context and everything in it (its memory is
/// freed, and scrubbed by the device before anyone else gets it). Its
/// references stay: holders may still release them, and the next use
/// makes a fresh context, as on CUDA.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    with("cuDevicePrimaryCtxReset", |s| {
        s.device(dev)?;
        let held = s.st().primary.take();
        match held {
            Some(c) => s.destroy_ctx(c),
            None => Ok(()),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    cuDevicePrimaryCtxReset_v2(dev)
}

// ---- devices ----------------------------------------------------------------

fn pci_bus_id(s: &Shim) -> String {
    format!("0000:00:{:02x}.0", s.info.ordinal & 0x1f)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(buf: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    with("cuDeviceGetPCIBusId", |s| {
        s.device(dev)?;
        if buf.is_null() || len <= 0 {
            return Err(bad("null or empty buffer"));
        }
        let id = pci_bus_id(s);
        let k = id.len().min(len as usize - 1);
        // SAFETY: the caller provides `len` writable bytes; k < len.
        unsafe {
            std::ptr::copy_nonoverlapping(id.as_ptr(), buf.cast(), k);
            *buf.add(k) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, id: *const c_char) -> CUresult {
    with("cuDeviceGetByPCIBusId", |s| {
        if id.is_null() {
            return Err(bad("null bus id"));
        }
        // SAFETY: per the API contract `id` is a NUL-terminated string.
        let want = unsafe { CStr::from_ptr(id) }.to_string_lossy().to_ascii_lowercase();
        let ours = pci_bus_id(s);
        // "bus:device.function" may omit the domain.
        if want == ours || format!("0000:{want}") == ours {
            out(dev, 0)
        } else {
            Err(CallError::new(CuResult::CUDA_ERROR_INVALID_DEVICE, format!("no device at PCI bus id {want}")))
        }
    })
}

/// This vGPU is the process's only device: it has no peers.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) -> CUresult {
    with("cuDeviceCanAccessPeer", |s| {
        s.device(dev)?;
        s.device(peer)?;
        out(can, 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetP2PAttribute(v: *mut c_int, _attr: c_int, src: CUdevice, dst: CUdevice) -> CUresult {
    with("cuDeviceGetP2PAttribute", |s| {
        s.device(src)?;
        s.device(dst)?;
        let _ = v;
        Err(CallError::new(CuResult::CUDA_ERROR_INVALID_DEVICE, "a device is not its own peer"))
    })
}

/// `CUdevprop` (deprecated, still resolved by runtimes).
#[repr(C)]
pub struct DevProp {
    max_threads_per_block: c_int,
    max_threads_dim: [c_int; 3],
    max_grid_size: [c_int; 3],
    shared_mem_per_block: c_int,
    total_constant_memory: c_int,
    simd_width: c_int,
    mem_pitch: c_int,
    regs_per_block: c_int,
    clock_rate: c_int,
    texture_align: c_int,
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetProperties(p: *mut DevProp, dev: CUdevice) -> CUresult {
    with("cuDeviceGetProperties", |s| {
        s.device(dev)?;
        let a = |n| s.attribute(n).unwrap_or(0);
        out(
            p,
            DevProp {
                max_threads_per_block: a(1),
                max_threads_dim: [a(2), a(3), a(4)],
                max_grid_size: [a(5), a(6), a(7)],
                shared_mem_per_block: a(8),
                total_constant_memory: a(9),
                simd_width: a(10),
                mem_pitch: a(11),
                regs_per_block: a(12),
                clock_rate: a(13),
                texture_align: a(14),
            },
        )
    })
}
