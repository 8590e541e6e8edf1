//! The CUDA Driver API, exported with CUDA's names, numbers and ABI.
//!
//! Opaque handles (`CUcontext`, `CUmodule`, ...) are tagged integers, never
//! pointers into our memory: a stale or forged handle is looked up and
//! rejected, never dereferenced. Execution is synchronous, so the stream
//! forms complete before they return (a valid CUDA behaviour).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Mutex;

use virtio_gpu_compute::*;

use crate::client::{CallError, CallResult, Client};

pub type CUresult = c_uint;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
type H = *mut c_void;

/// Driver API version reported by `cuDriverGetVersion` (13.0).
pub const DRIVER_VERSION: c_int = 13000;

const TAG_CTX: usize = 0xC1;
const TAG_MOD: usize = 0xC2;
const TAG_FUNC: usize = 0xC3;
const TAG_STREAM: usize = 0xC4;
const TAG_EVENT: usize = 0xC5;

fn enc(tag: usize, id: u32) -> H {
    ((tag << 40) | id as usize) as H
}

fn dec(tag: usize, h: H) -> Option<u32> {
    let v = h as usize;
    if v >> 40 == tag && v & 0xFF_0000_0000 == 0 && v as u32 != 0 { Some(v as u32) } else { None }
}

struct Func {
    ctx: u32,
    params: Vec<ParamDesc>,
    size: u32,
}

struct Shim {
    client: Client,
    info: DeviceInfo,
    primary: Option<(u32, u32)>,
    ctxs: Vec<u32>,
    modules: HashMap<u32, u32>,
    funcs: HashMap<u32, Func>,
    streams: HashMap<u32, u32>,
    events: HashMap<u32, u32>,
}

static SHIM: Mutex<Option<Shim>> = Mutex::new(None);
static LAST_ERROR: Mutex<String> = Mutex::new(String::new());

thread_local! {
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

fn log_enabled() -> bool {
    std::env::var_os("VGPU_LOG").is_some()
}

fn fail(api: &str, e: CallError) -> CUresult {
    if log_enabled() {
        eprintln!("libcuda(vgpu): {api}: {}", e);
    }
    *LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = format!("{api}: {}", e);
    e.code as CUresult
}

fn bad(msg: &str) -> CallError {
    CallError::new(CuResult::CUDA_ERROR_INVALID_VALUE, msg)
}

/// Runs `f` against the initialised shim, mapping errors to `CUresult`.
fn with(api: &str, f: impl FnOnce(&mut Shim) -> CallResult<()>) -> CUresult {
    let mut g = SHIM.lock().unwrap_or_else(|p| p.into_inner());
    let Some(s) = g.as_mut() else {
        return fail(api, CallError::new(CuResult::CUDA_ERROR_NOT_INITIALIZED, "cuInit has not been called"));
    };
    match f(s) {
        Ok(()) => 0,
        Err(e) => fail(api, e),
    }
}

/// Writes through an out-pointer supplied by the caller.
fn out<T>(p: *mut T, v: T) -> CallResult<()> {
    if p.is_null() {
        return Err(bad("null output pointer"));
    }
    // SAFETY: non-null, and the CUDA API contract makes it valid for a T.
    unsafe { p.write(v) };
    Ok(())
}

impl Shim {
    fn current(&self) -> CallResult<u32> {
        let c = CURRENT.with(|c| c.get());
        if c == 0 || !self.ctxs.contains(&c) {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "no current context"));
        }
        Ok(c)
    }

    fn device(&self, dev: CUdevice) -> CallResult<()> {
        if dev != 0 {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_DEVICE, format!("device {dev} does not exist (this vGPU has device 0 only)")));
        }
        Ok(())
    }

    fn stream(&self, h: H) -> CallResult<u32> {
        // NULL, CU_STREAM_LEGACY (0x1) and CU_STREAM_PER_THREAD (0x2) all
        // name the default stream.
        if (h as usize) <= 2 {
            return Ok(DEFAULT_STREAM);
        }
        dec(TAG_STREAM, h).filter(|s| self.streams.contains_key(s)).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid stream"))
    }

    fn event(&self, h: H) -> CallResult<(u32, u32)> {
        let e = dec(TAG_EVENT, h).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid event"))?;
        let c = *self.events.get(&e).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid event"))?;
        Ok((c, e))
    }

    fn create_ctx(&mut self, flags: c_uint, dev: CUdevice) -> CallResult<u32> {
        self.device(dev)?;
        let c = self.client.handle(Request::CtxCreate(CtxCreateReq { flags, reserved: 0 }))?;
        self.ctxs.push(c);
        Ok(c)
    }

    fn destroy_ctx(&mut self, c: u32) -> CallResult<()> {
        if !self.ctxs.contains(&c) {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "invalid context"));
        }
        let r = self.client.empty(Request::CtxDestroy(CtxReq { ctx: c, reserved: 0 }));
        self.ctxs.retain(|x| *x != c);
        self.modules.retain(|_, x| *x != c);
        self.funcs.retain(|_, f| f.ctx != c);
        self.streams.retain(|_, x| *x != c);
        self.events.retain(|_, x| *x != c);
        if self.primary.is_some_and(|(p, _)| p == c) {
            self.primary = None;
        }
        CURRENT.with(|cur| {
            if cur.get() == c {
                cur.set(0)
            }
        });
        r
    }
}

// ---- initialisation, version, errors -------------------------------------

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return fail("cuInit", bad("flags must be 0"));
    }
    let mut g = SHIM.lock().unwrap_or_else(|p| p.into_inner());
    if g.is_some() {
        return 0;
    }
    let r = Client::from_env().and_then(|mut client| {
        let info = client.device_info()?;
        Ok(Shim { client, info, primary: None, ctxs: Vec::new(), modules: HashMap::new(), funcs: HashMap::new(), streams: HashMap::new(), events: HashMap::new() })
    });
    match r {
        Ok(s) => {
            *g = Some(s);
            0
        }
        Err(e) => fail("cuInit", e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    match out(v, DRIVER_VERSION) {
        Ok(()) => 0,
        Err(e) => fail("cuDriverGetVersion", e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, s: *mut *const c_char) -> CUresult {
    if s.is_null() || !CuResult::is_known(code) {
        if !s.is_null() {
            // SAFETY: non-null out-pointer per the API contract.
            unsafe { *s = std::ptr::null() };
        }
        return CuResult::CUDA_ERROR_INVALID_VALUE as CUresult;
    }
    // SAFETY: non-null out-pointer; the string is static and NUL-terminated.
    unsafe { *s = CuResult::from_u32(code).name_c().as_ptr().cast() };
    0
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, s: *mut *const c_char) -> CUresult {
    if s.is_null() || !CuResult::is_known(code) {
        if !s.is_null() {
            // SAFETY: non-null out-pointer per the API contract.
            unsafe { *s = std::ptr::null() };
        }
        return CuResult::CUDA_ERROR_INVALID_VALUE as CUresult;
    }
    // SAFETY: non-null out-pointer; the string is static and NUL-terminated.
    unsafe { *s = CuResult::from_u32(code).description_c().as_ptr().cast() };
    0
}

/// Extension (not CUDA): copies the last failing call's explanation, as
/// the device gave it, into `buf` (NUL-terminated). Returns its full length.
#[no_mangle]
pub unsafe extern "C" fn vgpuGetLastErrorMessage(buf: *mut c_char, len: usize) -> usize {
    let msg = LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if !buf.is_null() && len > 0 {
        let n = msg.len().min(len - 1);
        // SAFETY: caller provides `len` writable bytes at `buf`.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.cast(), n);
            *buf.add(n) = 0;
        }
    }
    msg.len()
}

// ---- devices ----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    with("cuDeviceGetCount", |_| out(n, 1))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut CUdevice, ordinal: c_int) -> CUresult {
    with("cuDeviceGet", |s| {
        s.device(ordinal)?;
        out(d, 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    with("cuDeviceGetName", |s| {
        s.device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(bad("null or empty name buffer"));
        }
        let n = name_str(&s.info.name);
        let k = n.len().min(len as usize - 1);
        // SAFETY: caller provides `len` writable bytes at `name`; k < len.
        unsafe {
            std::ptr::copy_nonoverlapping(n.as_ptr(), name.cast(), k);
            *name.add(k) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    with("cuDeviceGetUuid", |s| {
        s.device(dev)?;
        out(uuid, s.info.uuid)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    // SAFETY: same contract as cuDeviceGetUuid.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    with("cuDeviceTotalMem_v2", |s| {
        s.device(dev)?;
        out(bytes, s.info.total_mem as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) -> CUresult {
    with("cuDeviceTotalMem", |s| {
        s.device(dev)?;
        out(bytes, s.info.total_mem.min(u32::MAX as u64) as c_uint)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) -> CUresult {
    with("cuDeviceComputeCapability", |s| {
        s.device(dev)?;
        out(major, s.info.cc_major as c_int)?;
        out(minor, s.info.cc_minor as c_int)
    })
}

/// `CUdevice_attribute` values this device answers.
pub fn attribute(info: &DeviceInfo, attr: c_int) -> Option<c_int> {
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    Some(match attr {
        1 => i(info.max_threads_per_block),
        2..=4 => i(info.max_block[(attr - 2) as usize]),
        5..=7 => i(info.max_grid[(attr - 5) as usize]),
        8 | 81 | 97 => i(info.max_shared_per_block),
        9 => 65536,
        10 => i(info.warp_size),
        11 => i32::MAX,
        12 | 82 => 65536,
        13 | 36 => 1_000_000,
        14 => 512,
        15 | 18 | 19 | 20 | 31 | 32 | 33 | 35 | 38 | 40 | 41 | 50 | 83 | 84 => 0,
        16 => i(info.sm_count),
        17 => (info.instruction_budget != 0) as c_int,
        34 => i(info.ordinal),
        37 => 64,
        39 => 2048,
        75 => i(info.cc_major),
        76 => i(info.cc_minor),
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: CUdevice) -> CUresult {
    with("cuDeviceGetAttribute", |s| {
        s.device(dev)?;
        let a = attribute(&s.info, attr).ok_or_else(|| bad(&format!("unsupported device attribute {attr}")))?;
        out(v, a)
    })
}

// ---- contexts ---------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut H, flags: c_uint, dev: CUdevice) -> CUresult {
    with("cuCtxCreate", |s| {
        if pctx.is_null() {
            return Err(bad("null context pointer"));
        }
        let c = s.create_ctx(flags, dev)?;
        CURRENT.with(|cur| cur.set(c));
        out(pctx, enc(TAG_CTX, c))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate(pctx: *mut H, flags: c_uint, dev: CUdevice) -> CUresult {
    // SAFETY: same contract as cuCtxCreate_v2.
    unsafe { cuCtxCreate_v2(pctx, flags, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(pctx: *mut H, params: *mut c_void, num_params: c_int, flags: c_uint, dev: CUdevice) -> CUresult {
    if !params.is_null() && num_params > 0 {
        return fail("cuCtxCreate_v3", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "execution affinity is unsupported on this device"));
    }
    // SAFETY: same contract as cuCtxCreate_v2.
    unsafe { cuCtxCreate_v2(pctx, flags, dev) }
}

/// `CUctxCreateParams` (CUDA 12.5+).
#[repr(C)]
pub struct CtxCreateParams {
    pub exec_affinity: *mut c_void,
    pub num_exec_affinity: c_int,
    pub cig: *mut c_void,
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(pctx: *mut H, params: *const CtxCreateParams, flags: c_uint, dev: CUdevice) -> CUresult {
    if !params.is_null() {
        // SAFETY: non-null, and the API contract makes it a CUctxCreateParams.
        let p = unsafe { &*params };
        if (!p.exec_affinity.is_null() && p.num_exec_affinity > 0) || !p.cig.is_null() {
            return fail("cuCtxCreate_v4", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "execution affinity and CIG are unsupported on this device"));
        }
    }
    // SAFETY: same contract as cuCtxCreate_v2.
    unsafe { cuCtxCreate_v2(pctx, flags, dev) }
}

#[no_mangle]
pub extern "C" fn cuCtxDestroy_v2(ctx: H) -> CUresult {
    with("cuCtxDestroy", |s| {
        let c = dec(TAG_CTX, ctx).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "invalid context"))?;
        s.destroy_ctx(c)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxDestroy(ctx: H) -> CUresult {
    cuCtxDestroy_v2(ctx)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut H) -> CUresult {
    with("cuCtxGetCurrent", |s| {
        let c = CURRENT.with(|c| c.get());
        out(pctx, if c != 0 && s.ctxs.contains(&c) { enc(TAG_CTX, c) } else { std::ptr::null_mut() })
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: H) -> CUresult {
    with("cuCtxSetCurrent", |s| {
        if ctx.is_null() {
            CURRENT.with(|c| c.set(0));
            return Ok(());
        }
        let c = dec(TAG_CTX, ctx).filter(|c| s.ctxs.contains(c)).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "invalid context"))?;
        CURRENT.with(|cur| cur.set(c));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    with("cuCtxGetDevice", |s| {
        s.current()?;
        out(dev, 0)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    with("cuCtxSynchronize", |s| {
        let c = s.current()?;
        s.client.empty(Request::CtxSynchronize(CtxReq { ctx: c, reserved: 0 }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut H, dev: CUdevice) -> CUresult {
    with("cuDevicePrimaryCtxRetain", |s| {
        if pctx.is_null() {
            return Err(bad("null context pointer"));
        }
        let c = match s.primary {
            Some((c, n)) => {
                s.primary = Some((c, n + 1));
                c
            }
            None => {
                let c = s.create_ctx(0, dev)?;
                s.primary = Some((c, 1));
                c
            }
        };
        out(pctx, enc(TAG_CTX, c))
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    with("cuDevicePrimaryCtxRelease", |s| {
        s.device(dev)?;
        match s.primary {
            Some((c, 1)) => s.destroy_ctx(c),
            Some((c, n)) => {
                s.primary = Some((c, n - 1));
                Ok(())
            }
            None => Err(CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "primary context is not retained")),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    cuDevicePrimaryCtxRelease_v2(dev)
}

// ---- memory -----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    with("cuMemAlloc", |s| {
        if dptr.is_null() {
            return Err(bad("null pointer"));
        }
        if size == 0 {
            return Err(bad("size is 0"));
        }
        let ctx = s.current()?;
        match s.client.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: size as u64 }))? {
            Reply::Ptr(p) => out(dptr, p),
            r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    with("cuMemFree", |s| {
        let ctx = s.current()?;
        s.client.empty(Request::MemFree(MemFreeReq { ctx, reserved: 0, dptr }))
    })
}

/// Legacy 32-bit form: fails cleanly when the address needs 64 bits.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut c_uint, size: c_uint) -> CUresult {
    let mut p: CUdeviceptr = 0;
    // SAFETY: `p` is a valid local out-pointer.
    let r = unsafe { cuMemAlloc_v2(&mut p, size as usize) };
    if r != 0 {
        return r;
    }
    match u32::try_from(p) {
        Ok(v) => with("cuMemAlloc", |_| out(dptr, v)),
        Err(_) => {
            cuMemFree_v2(p);
            fail("cuMemAlloc", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "32-bit device pointers are unsupported; use cuMemAlloc_v2"))
        }
    }
}

#[no_mangle]
pub extern "C" fn cuMemFree(dptr: c_uint) -> CUresult {
    cuMemFree_v2(dptr as CUdeviceptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    with("cuMemGetInfo", |s| {
        s.current()?;
        match s.client.call(Request::MemGetInfo)? {
            Reply::MemInfo(m) => {
                out(free, m.free as usize)?;
                out(total, m.total as usize)
            }
            r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: valid local out-pointers.
    let r = unsafe { cuMemGetInfo_v2(&mut f, &mut t) };
    if r != 0 {
        return r;
    }
    with("cuMemGetInfo", |_| {
        out(free, f.min(u32::MAX as usize) as c_uint)?;
        out(total, t.min(u32::MAX as usize) as c_uint)
    })
}

fn htod(api: &str, dst: CUdeviceptr, src: *const c_void, n: usize, stream: H) -> CUresult {
    with(api, |s| {
        let ctx = s.current()?;
        let st = s.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(bad("null source"));
        }
        // SAFETY: the caller provides `n` readable bytes at `src`.
        let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) };
        s.client.htod(ctx, st, dst, data)
    })
}

fn dtoh(api: &str, dst: *mut c_void, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    with(api, |s| {
        let ctx = s.current()?;
        let st = s.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(bad("null destination"));
        }
        // SAFETY: the caller provides `n` writable bytes at `dst`.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
        s.client.dtoh(ctx, st, out, src)
    })
}

fn dtod(api: &str, dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    with(api, |s| {
        let ctx = s.current()?;
        let st = s.stream(stream)?;
        s.client.empty(Request::MemcpyDtoD(MemcpyDtoDReq { ctx, stream: st, dst, src, size: n as u64 }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    htod("cuMemcpyHtoD", dst, src, n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, stream: H) -> CUresult {
    htod("cuMemcpyHtoDAsync", dst, src, n, stream)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    dtoh("cuMemcpyDtoH", dst, src, n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    dtoh("cuMemcpyDtoHAsync", dst, src, n, stream)
}
#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    dtod("cuMemcpyDtoD", dst, src, n, std::ptr::null_mut())
}
#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    dtod("cuMemcpyDtoDAsync", dst, src, n, stream)
}

fn memset(api: &str, dst: CUdeviceptr, value: u32, elem: u32, count: usize, stream: H) -> CUresult {
    with(api, |s| {
        let ctx = s.current()?;
        let st = s.stream(stream)?;
        if count == 0 {
            return Ok(());
        }
        s.client.empty(Request::Memset(MemsetReq { ctx, stream: st, dptr: dst, value, elem_size: elem, count: count as u64 }))
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    memset("cuMemsetD8", dst, v as u32, 1, n, std::ptr::null_mut())
}
#[no_mangle]
pub extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, v: c_uint, n: usize) -> CUresult {
    memset("cuMemsetD32", dst, v, 4, n, std::ptr::null_mut())
}
#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD8Async", dst, v as u32, 1, n, stream)
}
#[no_mangle]
pub extern "C" fn cuMemsetD32Async(dst: CUdeviceptr, v: c_uint, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD32Async", dst, v, 4, n, stream)
}

// ---- modules and launches ---------------------------------------------------

/// Finds the length of a module image given only its start, as the driver
/// does: PTX is NUL-terminated text, a cubin is an ELF file whose tables
/// bound it, a fatbin states its size in its header.
unsafe fn image_bytes<'a>(image: *const c_void) -> CallResult<&'a [u8]> {
    if image.is_null() {
        return Err(bad("null module image"));
    }
    let p = image.cast::<u8>();
    // SAFETY: every image format starts with at least 16 readable bytes
    // except PTX text, which is NUL-terminated; we only read 4 to classify.
    let head = unsafe { std::slice::from_raw_parts(p, 4) };
    let len = if head == b"\x7fELF" {
        // SAFETY: an ELF64 header is 64 bytes.
        let h = unsafe { std::slice::from_raw_parts(p, 64) };
        let u64at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or([0; 8]));
        let u16at = |o: usize| u16::from_le_bytes([h[o], h[o + 1]]) as u64;
        let sh_end = u64at(0x28) + u16at(0x3A) * u16at(0x3C);
        let ph_end = u64at(0x20) + u16at(0x36) * u16at(0x38);
        sh_end.max(ph_end).max(64)
    } else if u32::from_le_bytes([head[0], head[1], head[2], head[3]]) == 0xBA55_ED50 {
        // SAFETY: a fatbin header is 16 bytes: magic, version, header size, body size.
        let h = unsafe { std::slice::from_raw_parts(p, 16) };
        u16::from_le_bytes([h[6], h[7]]) as u64 + u64::from_le_bytes(h[8..16].try_into().unwrap_or([0; 8]))
    } else {
        // SAFETY: PTX images are NUL-terminated strings.
        unsafe { CStr::from_ptr(p.cast()) }.to_bytes().len() as u64
    };
    if len == 0 || len > MAX_IMAGE {
        return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, format!("module image of {len} bytes")));
    }
    // SAFETY: the image format bounds the image to `len` readable bytes.
    Ok(unsafe { std::slice::from_raw_parts(p, len as usize) })
}

fn load_module(s: &mut Shim, m: *mut H, image: *const c_void) -> CallResult<()> {
    if m.is_null() {
        return Err(bad("null module pointer"));
    }
    let ctx = s.current()?;
    // SAFETY: per the API contract `image` points at a module image.
    let bytes = unsafe { image_bytes(image)? };
    let format = ImageFormat::sniff(bytes);
    let id = s.client.handle(Request::ModuleLoad(ModuleLoadReq { ctx, format: format as u32, image_len: bytes.len() as u64 }, bytes.to_vec()))?;
    s.modules.insert(id, ctx);
    out(m, enc(TAG_MOD, id))
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut H, image: *const c_void) -> CUresult {
    with("cuModuleLoadData", |s| load_module(s, m, image))
}

const CU_JIT_ERROR_LOG_BUFFER: c_int = 5;
const CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(m: *mut H, image: *const c_void, n: c_uint, opts: *const c_int, vals: *mut *mut c_void) -> CUresult {
    let r = with("cuModuleLoadDataEx", |s| load_module(s, m, image));
    if r != 0 && n > 0 && !opts.is_null() && !vals.is_null() && n < 64 {
        // Put the loader's message in the JIT error log, as nvrtc/ptxas would.
        // SAFETY: the caller passes `n` options and `n` values.
        let (o, v) = unsafe { (std::slice::from_raw_parts(opts, n as usize), std::slice::from_raw_parts(vals, n as usize)) };
        let buf = o.iter().position(|x| *x == CU_JIT_ERROR_LOG_BUFFER).map(|i| v[i]);
        let size = o.iter().position(|x| *x == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES).map(|i| v[i] as usize);
        if let (Some(buf), Some(size)) = (buf, size) {
            if !buf.is_null() && size > 0 {
                // SAFETY: the caller provided `size` writable bytes at `buf`.
                unsafe { vgpuGetLastErrorMessage(buf.cast(), size) };
            }
        }
    }
    r
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(m: H) -> CUresult {
    with("cuModuleUnload", |s| {
        let id = dec(TAG_MOD, m).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid module"))?;
        let ctx = *s.modules.get(&id).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid module"))?;
        s.client.empty(Request::ModuleUnload(ModuleReq { ctx, module: id }))?;
        s.modules.remove(&id);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut H, m: H, name: *const c_char) -> CUresult {
    with("cuModuleGetFunction", |s| {
        if f.is_null() || name.is_null() {
            return Err(bad("null pointer"));
        }
        let id = dec(TAG_MOD, m).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid module"))?;
        let ctx = *s.modules.get(&id).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid module"))?;
        // SAFETY: per the API contract `name` is a NUL-terminated string.
        let n = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| bad("function name is not UTF-8"))?.to_string();
        let req = Request::ModuleGetFunction(GetFunctionReq { ctx, module: id, name_len: n.len() as u32, reserved: 0 }, n);
        match s.client.call(req)? {
            Reply::Function(fr, params) => {
                s.funcs.insert(fr.func, Func { ctx, params, size: fr.params_size });
                out(f, enc(TAG_FUNC, fr.func))
            }
            r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
        }
    })
}

/// A module variable's device address and size; either output may be null.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetGlobal_v2(dptr: *mut u64, bytes: *mut usize, m: H, name: *const c_char) -> CUresult {
    with("cuModuleGetGlobal", |s| {
        if name.is_null() {
            return Err(bad("null name"));
        }
        let id = dec(TAG_MOD, m).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid module"))?;
        let ctx = *s.modules.get(&id).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid module"))?;
        // SAFETY: per the API contract `name` is a NUL-terminated string.
        let n = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| bad("variable name is not UTF-8"))?.to_string();
        let req = Request::ModuleGetGlobal(GetFunctionReq { ctx, module: id, name_len: n.len() as u32, reserved: 0 }, n);
        match s.client.call(req)? {
            Reply::Global(addr, size) => {
                if !dptr.is_null() {
                    out(dptr, addr)?;
                }
                if !bytes.is_null() {
                    out(bytes, size as usize)?;
                }
                Ok(())
            }
            r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
        }
    })
}

/// The CUDA 3.x entry point: a 32-bit size.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetGlobal(dptr: *mut u64, bytes: *mut u32, m: H, name: *const c_char) -> CUresult {
    let mut size = 0usize;
    // SAFETY: forwards the caller's pointers; `size` is a local.
    let r = unsafe { cuModuleGetGlobal_v2(dptr, &mut size, m, name) };
    if r == 0 && !bytes.is_null() {
        // SAFETY: non-null, and the API contract makes it valid for a u32.
        unsafe { bytes.write(size as u32) };
    }
    r
}

const CU_LAUNCH_PARAM_END: usize = 0;
const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: H,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: H,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    with("cuLaunchKernel", |s| {
        let fid = dec(TAG_FUNC, f).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid function"))?;
        let func = s.funcs.get(&fid).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid function"))?;
        let ctx = s.current()?;
        if ctx != func.ctx {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "function belongs to another context"));
        }
        if [gx, gy, gz, bx, by, bz].contains(&0) {
            return Err(bad("grid and block dimensions must be non-zero"));
        }
        let st = s.stream(stream)?;
        let mut buf = vec![0u8; func.size as usize];
        if !params.is_null() {
            for (i, p) in func.params.iter().enumerate() {
                // SAFETY: per the API contract `params` has one pointer per
                // kernel parameter, each to a value of that parameter's size.
                let arg = unsafe { *params.add(i) };
                if arg.is_null() {
                    return Err(bad(&format!("kernel parameter {i} is null")));
                }
                // SAFETY: as above; the size comes from the kernel's signature.
                let src = unsafe { std::slice::from_raw_parts(arg.cast::<u8>(), p.size as usize) };
                buf[p.offset as usize..(p.offset + p.size) as usize].copy_from_slice(src);
            }
        } else if !extra.is_null() {
            let (mut ptr, mut size): (*const u8, Option<usize>) = (std::ptr::null(), None);
            for i in (0..64).step_by(2) {
                // SAFETY: `extra` is a key/value list ended by CU_LAUNCH_PARAM_END.
                let key = unsafe { *extra.add(i) } as usize;
                if key == CU_LAUNCH_PARAM_END {
                    break;
                }
                // SAFETY: every key but END is followed by its value.
                let val = unsafe { *extra.add(i + 1) };
                match key {
                    CU_LAUNCH_PARAM_BUFFER_POINTER => ptr = val.cast(),
                    CU_LAUNCH_PARAM_BUFFER_SIZE if !val.is_null() => {
                        // SAFETY: the BUFFER_SIZE value points at a size_t.
                        size = Some(unsafe { *val.cast::<usize>() })
                    }
                    _ => return Err(bad(&format!("unknown launch parameter key {key:#x}"))),
                }
            }
            let size = size.ok_or_else(|| bad("extra lacks CU_LAUNCH_PARAM_BUFFER_SIZE"))?;
            if ptr.is_null() || size < func.size as usize {
                return Err(bad(&format!("parameter buffer of {size} bytes; the kernel takes {}", func.size)));
            }
            // SAFETY: the caller's buffer holds `size` >= func.size bytes.
            buf.copy_from_slice(unsafe { std::slice::from_raw_parts(ptr, func.size as usize) });
        } else if !func.params.is_empty() {
            return Err(bad("kernel takes parameters but neither kernelParams nor extra was given"));
        }
        let req = LaunchReq { ctx, func: fid, stream: st, shared_bytes: shared, grid: [gx, gy, gz], block: [bx, by, bz], params_len: buf.len() as u32, reserved: 0 };
        s.client.empty(Request::LaunchKernel(req, buf))
    })
}

// ---- streams and events -----------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(p: *mut H, flags: c_uint) -> CUresult {
    with("cuStreamCreate", |s| {
        if p.is_null() || flags > 1 {
            return Err(bad("null pointer or unknown stream flags"));
        }
        let ctx = s.current()?;
        let id = s.client.handle(Request::StreamCreate(ObjCreateReq { ctx, flags }))?;
        s.streams.insert(id, ctx);
        out(p, enc(TAG_STREAM, id))
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(h: H) -> CUresult {
    with("cuStreamDestroy", |s| {
        let id = dec(TAG_STREAM, h).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid stream"))?;
        let ctx = *s.streams.get(&id).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "invalid stream"))?;
        s.client.empty(Request::StreamDestroy(HandleReq { ctx, handle: id }))?;
        s.streams.remove(&id);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy(h: H) -> CUresult {
    cuStreamDestroy_v2(h)
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(h: H) -> CUresult {
    with("cuStreamSynchronize", |s| {
        let st = s.stream(h)?;
        let ctx = if st == DEFAULT_STREAM { s.current()? } else { s.streams[&st] };
        s.client.empty(Request::StreamSynchronize(HandleReq { ctx, handle: st }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(p: *mut H, flags: c_uint) -> CUresult {
    with("cuEventCreate", |s| {
        if p.is_null() || flags > 0xF {
            return Err(bad("null pointer or unknown event flags"));
        }
        let ctx = s.current()?;
        let id = s.client.handle(Request::EventCreate(ObjCreateReq { ctx, flags }))?;
        s.events.insert(id, ctx);
        out(p, enc(TAG_EVENT, id))
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecord(e: H, stream: H) -> CUresult {
    with("cuEventRecord", |s| {
        let (ctx, ev) = s.event(e)?;
        let st = s.stream(stream)?;
        s.client.empty(Request::EventRecord(EventRecordReq { ctx, event: ev, stream: st, reserved: 0 }))
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(e: H) -> CUresult {
    with("cuEventSynchronize", |s| {
        let (ctx, ev) = s.event(e)?;
        s.client.empty(Request::EventSynchronize(HandleReq { ctx, handle: ev }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: H, end: H) -> CUresult {
    with("cuEventElapsedTime", |s| {
        let (ctx, a) = s.event(start)?;
        let (_, b) = s.event(end)?;
        match s.client.call(Request::EventElapsedTime(EventElapsedReq { ctx, start: a, end: b, reserved: 0 }))? {
            Reply::Elapsed(v) => out(ms, v),
            r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(e: H) -> CUresult {
    with("cuEventDestroy", |s| {
        let (ctx, ev) = s.event(e)?;
        s.client.empty(Request::EventDestroy(HandleReq { ctx, handle: ev }))?;
        s.events.remove(&ev);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy(e: H) -> CUresult {
    cuEventDestroy_v2(e)
}

// ---- cuGetProcAddress -------------------------------------------------------

/// The exported function for a base name at a given API version, as the
/// driver's own table resolves them.
pub fn proc_address(symbol: &str, version: c_int) -> Option<*mut c_void> {
    macro_rules! f {
        ($f:expr) => {
            Some($f as *const () as *mut c_void)
        };
    }
    // Per-thread-default-stream variants resolve to the same functions:
    // execution is synchronous, so both stream semantics coincide.
    let base = symbol.trim_end_matches("_ptsz").trim_end_matches("_ptds");
    let v2 = version >= 3020;
    let v4000 = version >= 4000;
    match base {
        "cuInit" => f!(cuInit),
        "cuDriverGetVersion" => f!(cuDriverGetVersion),
        "cuGetErrorName" => f!(cuGetErrorName),
        "cuGetErrorString" => f!(cuGetErrorString),
        "cuDeviceGetCount" => f!(cuDeviceGetCount),
        "cuDeviceGet" => f!(cuDeviceGet),
        "cuDeviceGetName" => f!(cuDeviceGetName),
        "cuDeviceGetAttribute" => f!(cuDeviceGetAttribute),
        "cuDeviceComputeCapability" => f!(cuDeviceComputeCapability),
        "cuDeviceTotalMem" => if v2 { f!(cuDeviceTotalMem_v2) } else { f!(cuDeviceTotalMem) },
        "cuDeviceGetUuid" => if version >= 11040 { f!(cuDeviceGetUuid_v2) } else { f!(cuDeviceGetUuid) },
        "cuCtxCreate" => if version >= 13000 { f!(cuCtxCreate_v4) } else if version >= 11040 { f!(cuCtxCreate_v3) } else { f!(cuCtxCreate_v2) },
        "cuCtxDestroy" => if v4000 { f!(cuCtxDestroy_v2) } else { f!(cuCtxDestroy) },
        "cuCtxGetCurrent" => f!(cuCtxGetCurrent),
        "cuCtxSetCurrent" => f!(cuCtxSetCurrent),
        "cuCtxGetDevice" => f!(cuCtxGetDevice),
        "cuCtxSynchronize" => f!(cuCtxSynchronize),
        "cuDevicePrimaryCtxRetain" => f!(cuDevicePrimaryCtxRetain),
        "cuDevicePrimaryCtxRelease" => if version >= 11000 { f!(cuDevicePrimaryCtxRelease_v2) } else { f!(cuDevicePrimaryCtxRelease) },
        "cuMemAlloc" => if v2 { f!(cuMemAlloc_v2) } else { f!(cuMemAlloc) },
        "cuMemFree" => if v2 { f!(cuMemFree_v2) } else { f!(cuMemFree) },
        "cuMemGetInfo" => if v2 { f!(cuMemGetInfo_v2) } else { f!(cuMemGetInfo) },
        "cuMemcpyHtoD" if v2 => f!(cuMemcpyHtoD_v2),
        "cuMemcpyDtoH" if v2 => f!(cuMemcpyDtoH_v2),
        "cuMemcpyDtoD" if v2 => f!(cuMemcpyDtoD_v2),
        "cuMemcpyHtoDAsync" if v2 => f!(cuMemcpyHtoDAsync_v2),
        "cuMemcpyDtoHAsync" if v2 => f!(cuMemcpyDtoHAsync_v2),
        "cuMemcpyDtoDAsync" if v2 => f!(cuMemcpyDtoDAsync_v2),
        "cuMemsetD8" if v2 => f!(cuMemsetD8_v2),
        "cuMemsetD32" if v2 => f!(cuMemsetD32_v2),
        "cuMemsetD8Async" => f!(cuMemsetD8Async),
        "cuMemsetD32Async" => f!(cuMemsetD32Async),
        "cuModuleLoadData" => f!(cuModuleLoadData),
        "cuModuleLoadDataEx" => f!(cuModuleLoadDataEx),
        "cuModuleGetFunction" => f!(cuModuleGetFunction),
        "cuModuleGetGlobal" => if v2 { f!(cuModuleGetGlobal_v2) } else { f!(cuModuleGetGlobal) },
        "cuModuleUnload" => f!(cuModuleUnload),
        "cuLaunchKernel" => f!(cuLaunchKernel),
        "cuStreamCreate" => f!(cuStreamCreate),
        "cuStreamDestroy" => if v4000 { f!(cuStreamDestroy_v2) } else { f!(cuStreamDestroy) },
        "cuStreamSynchronize" => f!(cuStreamSynchronize),
        "cuEventCreate" => f!(cuEventCreate),
        "cuEventRecord" => f!(cuEventRecord),
        "cuEventSynchronize" => f!(cuEventSynchronize),
        "cuEventElapsedTime" => f!(cuEventElapsedTime),
        "cuEventDestroy" => if v4000 { f!(cuEventDestroy_v2) } else { f!(cuEventDestroy) },
        "cuGetProcAddress" => if version >= 12000 { f!(cuGetProcAddress_v2) } else { f!(cuGetProcAddress) },
        _ => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, _flags: u64, status: *mut c_int) -> CUresult {
    if symbol.is_null() || pfn.is_null() {
        return fail("cuGetProcAddress", bad("null pointer"));
    }
    // SAFETY: per the API contract `symbol` is a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(symbol) }.to_str().unwrap_or("");
    let found = proc_address(name, version);
    // SAFETY: `pfn` is non-null (checked); `status` is optional.
    unsafe {
        *pfn = found.unwrap_or(std::ptr::null_mut());
        if !status.is_null() {
            *status = if found.is_some() { 0 } else { 1 };
        }
    }
    if found.is_some() { 0 } else { CuResult::CUDA_ERROR_NOT_FOUND as CUresult }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) -> CUresult {
    // SAFETY: same contract as cuGetProcAddress_v2, with no status pointer.
    unsafe { cuGetProcAddress_v2(symbol, pfn, version, flags, std::ptr::null_mut()) }
}
