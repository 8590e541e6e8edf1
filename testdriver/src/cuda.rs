//! The CUDA driver API entry points (`libcuda.so.1`).
//!
//! Every entry point returns a `CUresult`; none unwinds into its caller (a
//! panic becomes `CUDA_ERROR_UNKNOWN`). Handles are numbers handed out as
//! pointers and looked up in [`State`]; a stale or foreign one is
//! `CUDA_ERROR_INVALID_HANDLE`.

// These are C entry points: their callers hold the driver API's contract
// for every pointer they pass, as with NVIDIA's library, so they are not
// `unsafe fn` to Rust; each dereference says what it relies on.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::alloc::Layout;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Arc;

use virtio_gpu_compute::CuResult as E;

use crate::stream::{Op, Stream};
use crate::{driver, Driver};

pub type CUresult = c_uint;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type Handle = *mut c_void;

/// CUDA 12.8: new enough for cuFuncGetParamInfo (12.4).
pub const DRIVER_VERSION: c_int = 12080;
const CC: (u32, u32) = (9, 0);
const MAX_THREADS: u32 = 1024;
const MAX_BLOCK: [u32; 3] = [1024, 1024, 64];
const MAX_GRID: [u32; 3] = [i32::MAX as u32, 65535, 65535];
const MAX_SHARED: u32 = 48 << 10;
/// Largest module image read through a pointer whose length the caller
/// does not give (a fatbin states its own).
const MAX_IMAGE: u64 = 1 << 30;

pub struct Ctx {
    dev: usize,
    /// The stream a null `CUstream` means, made on first use.
    null_stream: Option<Arc<Stream>>,
    /// Device memory kept for kernels' local memory ([`local_need`]).
    local: u64,
}

pub struct LoadedModule {
    pub ctx: u64,
    pub ptx: vgpu_ptx::Module,
    pub sms: u32,
    /// Allocations holding the module's .global and .const variables.
    data: Vec<u64>,
}

#[derive(Default)]
pub struct State {
    next: u64,
    ctxs: HashMap<u64, Ctx>,
    /// Device -> (its primary context, retain count).
    primary: HashMap<usize, (u64, u32)>,
    streams: HashMap<u64, Arc<Stream>>,
    /// Event -> the stream and op it was last recorded after.
    events: HashMap<u64, Option<(Arc<Stream>, u64)>>,
    modules: HashMap<u64, Arc<LoadedModule>>,
    funcs: HashMap<u64, (Arc<LoadedModule>, usize)>,
    func_ids: HashMap<(u64, usize), u64>,
    pinned: HashMap<usize, Layout>,
    registered: BTreeMap<usize, usize>,
    /// Graphs a capture made, and executable graphs: (context, the work).
    graphs: HashMap<u64, (u64, Vec<Op>)>,
    graph_execs: HashMap<u64, (u64, Vec<Op>)>,
}

impl State {
    fn id(&mut self) -> u64 {
        self.next += 0x10;
        0x1000 + self.next
    }
}

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

fn current() -> u64 {
    CURRENT.with(|c| c.get())
}

fn set_current(ctx: u64) {
    CURRENT.with(|c| c.set(ctx));
}

type Res = Result<(), E>;

/// Runs an entry point: never unwinds, maps errors to codes.
fn entry(f: impl FnOnce(&'static Driver) -> Res) -> CUresult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(driver()))) {
        Ok(Ok(())) => E::CUDA_SUCCESS as CUresult,
        Ok(Err(e)) => e as CUresult,
        Err(_) => E::CUDA_ERROR_UNKNOWN as CUresult,
    }
}

fn inited(d: &Driver) -> Res {
    if d.inited.load(std::sync::atomic::Ordering::Acquire) {
        Ok(())
    } else {
        Err(E::CUDA_ERROR_NOT_INITIALIZED)
    }
}

/// Initialised and not poisoned by a fault.
fn usable(d: &Driver) -> Res {
    inited(d)?;
    match d.sticky() {
        0 => Ok(()),
        code => Err(E::from_u32(code)),
    }
}

fn device(d: &Driver, dev: CUdevice) -> Result<&crate::Device, E> {
    let i = usize::try_from(dev).map_err(|_| E::CUDA_ERROR_INVALID_DEVICE)?;
    d.visible.get(i).map(|&x| &d.devices[x]).ok_or(E::CUDA_ERROR_INVALID_DEVICE)
}

fn out<T>(p: *mut T, v: T) -> Res {
    if p.is_null() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null out-pointer the caller passed for a T.
    unsafe { p.write(v) };
    Ok(())
}

fn h(x: u64) -> Handle {
    x as usize as Handle
}

fn k(p: Handle) -> u64 {
    p as usize as u64
}

/// The context current on this thread, which must exist.
fn ctx_now(st: &State) -> Result<u64, E> {
    let c = current();
    if st.ctxs.contains_key(&c) {
        Ok(c)
    } else {
        Err(E::CUDA_ERROR_INVALID_CONTEXT)
    }
}

/// The stream `s` names for the current context (null: its own).
fn stream_of(st: &mut State, s: Handle) -> Result<Arc<Stream>, E> {
    let c = ctx_now(st)?;
    if s.is_null() {
        let ctx = st.ctxs.get_mut(&c).ok_or(E::CUDA_ERROR_INVALID_CONTEXT)?;
        if ctx.null_stream.is_none() {
            ctx.null_stream = Some(Stream::start(c).ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?);
        }
        return ctx.null_stream.clone().ok_or(E::CUDA_ERROR_INVALID_CONTEXT);
    }
    st.streams.get(&k(s)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)
}

fn ctx_streams(st: &State, c: u64) -> Vec<Arc<Stream>> {
    let mut v: Vec<Arc<Stream>> = st.streams.values().filter(|s| s.ctx == c).cloned().collect();
    v.extend(st.ctxs.get(&c).and_then(|x| x.null_stream.clone()));
    v
}

/// Waits for every stream of the current context (copies to and from host
/// memory are ordered after the work queued before them).
fn drain_current(d: &Driver) -> Res {
    let streams = {
        let st = d.state();
        ctx_streams(&st, ctx_now(&st)?)
    };
    for s in streams {
        s.wait_idle();
    }
    Ok(())
}

fn device_info(dev: &crate::Device, ordinal: u32) -> virtio_gpu_compute::DeviceInfo {
    let mut name = [0u8; 64];
    let n = dev.name.len().min(63);
    name[..n].copy_from_slice(&dev.name.as_bytes()[..n]);
    virtio_gpu_compute::DeviceInfo {
        name,
        uuid: dev.uuid,
        total_mem: dev.memory,
        free_mem: dev.memory,
        cc_major: CC.0,
        cc_minor: CC.1,
        sm_count: dev.sms,
        warp_size: 32,
        max_threads_per_block: MAX_THREADS,
        max_shared_per_block: MAX_SHARED,
        max_block: MAX_BLOCK,
        max_grid: MAX_GRID,
        numa_node: -1,
        ordinal,
        instruction_budget: 0,
    }
}

/// Host threads a launch's blocks may use: up to 4 of this machine's
/// (asked once: the answer reads cgroup files).
fn host_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(4)))
}

/// How kernels run: the device's limits, no time limit (a GPU has none;
/// the caller's launch timeout ends the process), a few host threads.
pub fn limits<'a>(sms: u32) -> vgpu_ptx::Limits<'a> {
    vgpu_ptx::Limits {
        max_threads_per_block: MAX_THREADS,
        max_block: MAX_BLOCK,
        max_grid: MAX_GRID,
        max_shared: MAX_SHARED,
        budget: 0,
        timeout: None,
        sm_count: sms,
        threads: host_threads(),
        preempt: None,
    }
}

fn make_ctx(d: &Driver, st: &mut State, dev: CUdevice) -> Result<u64, E> {
    let x = device(d, dev)?;
    let dev = d.devices.iter().position(|y| y == x).ok_or(E::CUDA_ERROR_INVALID_DEVICE)?;
    let c = st.id();
    st.ctxs.insert(c, Ctx { dev, null_stream: None, local: 0 });
    Ok(c)
}

/// Destroys context `c`: waits for its streams first (a running kernel
/// holds this call until it ends), then frees everything it made.
fn destroy_ctx(d: &Driver, c: u64) -> Res {
    let streams = ctx_streams(&d.state(), c);
    if streams.is_empty() && !d.state().ctxs.contains_key(&c) {
        return Err(E::CUDA_ERROR_INVALID_CONTEXT);
    }
    for s in &streams {
        s.wait_idle();
    }
    let mut st = d.state();
    let Some(gone) = st.ctxs.remove(&c) else {
        return Err(E::CUDA_ERROR_INVALID_CONTEXT);
    };
    d.heap.unreserve(gone.local);
    for s in &streams {
        s.close();
    }
    st.streams.retain(|_, s| s.ctx != c);
    st.events.retain(|_, e| e.as_ref().is_none_or(|(s, _)| s.ctx != c));
    let gone: Vec<u64> = st.modules.iter().filter(|(_, m)| m.ctx == c).map(|(id, _)| *id).collect();
    for id in gone {
        st.modules.remove(&id);
    }
    st.funcs.retain(|_, (m, _)| m.ctx != c);
    let funcs = &st.funcs;
    let live: Vec<(u64, usize)> = st.func_ids.iter().filter(|(_, f)| funcs.contains_key(f)).map(|(key, _)| *key).collect();
    st.func_ids.retain(|key, _| live.contains(key));
    st.graphs.retain(|_, (gc, _)| *gc != c);
    st.graph_execs.retain(|_, (gc, _)| *gc != c);
    drop(st);
    d.heap.free_ctx(c);
    if current() == c {
        set_current(0);
    }
    Ok(())
}

// ---- initialisation and devices ----

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry(|d| {
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if d.gpus.is_err() || d.visible.is_empty() {
            return Err(E::CUDA_ERROR_NO_DEVICE);
        }
        // The driver looks for an MPS control daemon at initialisation.
        crate::mps::join(crate::driver())?;
        d.inited.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    entry(|_| out(v, DRIVER_VERSION))
}

#[no_mangle]
pub extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    entry(|d| {
        inited(d)?;
        out(n, d.visible.len() as c_int)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    entry(|d| {
        inited(d)?;
        device(d, ordinal)?;
        out(dev, ordinal)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    entry(|d| {
        inited(d)?;
        let x = device(d, dev)?;
        if name.is_null() || len <= 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let n = x.name.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds len > n bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(x.name.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    entry(|d| {
        inited(d)?;
        out(uuid, device(d, dev)?.uuid)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    cuDeviceGetUuid_v2(uuid, dev)
}

#[no_mangle]
pub extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    entry(|d| {
        inited(d)?;
        out(bytes, device(d, dev)?.memory as usize)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: CUdevice) -> CUresult {
    entry(|d| {
        inited(d)?;
        let info = device_info(device(d, dev)?, dev as u32);
        out(v, virtio_gpu_compute::attrs::reference(&info, attr).ok_or(E::CUDA_ERROR_INVALID_VALUE)?)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, bus: *const c_char) -> CUresult {
    entry(|d| {
        inited(d)?;
        if bus.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let bus = unsafe { CStr::from_ptr(bus) }.to_string_lossy().to_ascii_uppercase();
        let tail = |s: &str| s.rsplit_once(':').map(|(a, b)| (a.rsplit(':').next().unwrap_or("").to_string(), b.to_string()));
        let want = tail(&bus).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let i = d.visible.iter().position(|&x| d.devices[x].mig.is_none() && tail(&crate::Device::nvml_bus_id(d.devices[x].gpu)) == Some(want.clone())).ok_or(E::CUDA_ERROR_INVALID_DEVICE)?;
        out(dev, i as CUdevice)
    })
}

// ---- contexts ----

#[no_mangle]
pub extern "C" fn cuCtxCreate_v2(pctx: *mut Handle, _flags: c_uint, dev: CUdevice) -> CUresult {
    entry(|d| {
        usable(d)?;
        if pctx.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let c = make_ctx(d, &mut d.state(), dev)?;
        set_current(c);
        out(pctx, h(c))
    })
}

#[no_mangle]
pub extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        destroy_ctx(d, k(ctx))
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        let c = k(ctx);
        if c != 0 && !d.state().ctxs.contains_key(&c) {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        set_current(c);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxGetCurrent(pctx: *mut Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        out(pctx, h(current()))
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: CUdevice) -> CUresult {
    entry(|d| {
        usable(d)?;
        let x = device(d, dev)?;
        let di = d.devices.iter().position(|y| y == x).ok_or(E::CUDA_ERROR_INVALID_DEVICE)?;
        let mut st = d.state();
        let c = match st.primary.get(&di).copied() {
            Some((c, n)) => {
                st.primary.insert(di, (c, n + 1));
                c
            }
            None => {
                let c = make_ctx(d, &mut st, dev)?;
                st.primary.insert(di, (c, 1));
                c
            }
        };
        out(pctx, h(c))
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    entry(|d| {
        inited(d)?;
        let x = device(d, dev)?;
        let di = d.devices.iter().position(|y| y == x).ok_or(E::CUDA_ERROR_INVALID_DEVICE)?;
        let last = {
            let mut st = d.state();
            match st.primary.get(&di).copied() {
                None => return Err(E::CUDA_ERROR_INVALID_CONTEXT),
                Some((c, 1)) => {
                    st.primary.remove(&di);
                    Some(c)
                }
                Some((c, n)) => {
                    st.primary.insert(di, (c, n - 1));
                    None
                }
            }
        };
        match last {
            Some(c) => destroy_ctx(d, c),
            None => Ok(()),
        }
    })
}

// ---- streams and events ----

#[no_mangle]
pub extern "C" fn cuStreamCreate(ps: *mut Handle, _flags: c_uint) -> CUresult {
    entry(|d| {
        usable(d)?;
        let mut st = d.state();
        let c = ctx_now(&st)?;
        let s = Stream::start(c).ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?;
        let id = st.id();
        st.streams.insert(id, s);
        out(ps, h(id))
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(s: Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        // Work already queued still runs; the thread ends after it.
        let s = d.state().streams.remove(&k(s)).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        s.close();
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(s: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let s = stream_of(&mut d.state(), s)?;
        s.wait_idle();
        usable(d)
    })
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(s: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let s = stream_of(&mut d.state(), s)?;
        let idle = s.finished(s.last());
        usable(d)?;
        if idle {
            Ok(())
        } else {
            Err(E::CUDA_ERROR_NOT_READY)
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventCreate(pe: *mut Handle, _flags: c_uint) -> CUresult {
    entry(|d| {
        usable(d)?;
        let mut st = d.state();
        ctx_now(&st)?;
        let id = st.id();
        st.events.insert(id, None);
        out(pe, h(id))
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(e: Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        d.state().events.remove(&k(e)).map(|_| ()).ok_or(E::CUDA_ERROR_INVALID_HANDLE)
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecord(e: Handle, s: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let mut st = d.state();
        let s = stream_of(&mut st, s)?;
        let seq = s.last();
        let ev = st.events.get_mut(&k(e)).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        *ev = Some((s, seq));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventQuery(e: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let rec = d.state().events.get(&k(e)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        // An event never recorded counts as complete, as on CUDA.
        let ended = rec.is_none_or(|(s, seq)| s.finished(seq));
        // A fault of this process is seen on the query, before the result.
        usable(d)?;
        if ended {
            Ok(())
        } else {
            Err(E::CUDA_ERROR_NOT_READY)
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(e: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let rec = d.state().events.get(&k(e)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        if let Some((s, seq)) = rec {
            s.wait(seq);
        }
        usable(d)
    })
}

// ---- memory ----

fn device_memory(d: &Driver) -> Result<u64, E> {
    let st = d.state();
    let c = ctx_now(&st)?;
    Ok(d.devices[st.ctxs[&c].dev].memory)
}

#[no_mangle]
pub extern "C" fn cuMemAlloc_v2(p: *mut CUdeviceptr, size: usize) -> CUresult {
    entry(|d| {
        usable(d)?;
        if p.is_null() || size == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let limit = device_memory(d)?;
        let a = d.heap.alloc(current(), size as u64, limit).ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?;
        out(p, a)
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(p: CUdeviceptr) -> CUresult {
    entry(|d| {
        usable(d)?;
        if d.heap.free(p) {
            Ok(())
        } else {
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry(|d| {
        usable(d)?;
        let t = device_memory(d)?;
        out(free, t.saturating_sub(d.heap.used()) as usize)?;
        out(total, t as usize)
    })
}

#[no_mangle]
pub extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) -> CUresult {
    entry(|d| {
        usable(d)?;
        if pp.is_null() || size == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let layout = Layout::from_size_align(size, 4096).map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: the layout's size is non-zero.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
        }
        d.state().pinned.insert(p as usize, layout);
        out(pp, p.cast())
    })
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    entry(|d| {
        let layout = d.state().pinned.remove(&(p as usize)).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: p came from cuMemAllocHost_v2 with this layout and was
        // removed from the table, so it is freed once.
        unsafe { std::alloc::dealloc(p.cast(), layout) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, size: usize, _flags: c_uint) -> CUresult {
    entry(|d| {
        usable(d)?;
        if p.is_null() || size == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if fault("host-register-fails") {
            return Err(E::CUDA_ERROR_NOT_SUPPORTED);
        }
        let mut st = d.state();
        let start = p as usize;
        let end = start.checked_add(size).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let overlaps = st.registered.range(..end).next_back().is_some_and(|(s, l)| s + l > start);
        if overlaps {
            return Err(E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        st.registered.insert(start, size);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    entry(|d| d.state().registered.remove(&(p as usize)).map(|_| ()).ok_or(E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED))
}

fn fill_async(dst: CUdeviceptr, elem: Vec<u8>, count: usize, s: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let len = count.checked_mul(elem.len()).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if count > 0 && d.heap.find(dst, len).is_none() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let s = stream_of(&mut d.state(), s)?;
        s.submit(Op::Fill { dst, elem, count: count as u64 });
        Ok(())
    })
}

/// Fault injection, not modelled behaviour: `VGPU_TESTDRIVER_FAULT` names
/// faults, comma-separated:
/// - `zeroing-writes-ones`: a byte memset of zero writes 0xFF instead, so
///   tests can watch a scrub's check catch memory that was not zeroed;
/// - `host-register-fails`: `cuMemHostRegister` fails with
///   `CUDA_ERROR_NOT_SUPPORTED`, as NVIDIA's driver does where host memory
///   cannot be pinned, so tests reach the executor's staged copies;
/// - `capture-fails`: `cuStreamBeginCapture` fails with
///   `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, so tests see a tenant's
///   graphs run piece by piece where the executor cannot build them.
pub const FAULT_ENV: &str = "VGPU_TESTDRIVER_FAULT";

fn fault(name: &str) -> bool {
    static ON: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    ON.get_or_init(|| std::env::var(FAULT_ENV).map(|v| v.split(',').map(str::to_string).collect()).unwrap_or_default()).iter().any(|f| f == name)
}

fn zeroing_writes_ones() -> bool {
    fault("zeroing-writes-ones")
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: Handle) -> CUresult {
    let v = if v == 0 && zeroing_writes_ones() { 0xFF } else { v };
    fill_async(dst, vec![v], n, s)
}

#[no_mangle]
pub extern "C" fn cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, s: Handle) -> CUresult {
    fill_async(dst, v.to_le_bytes().to_vec(), n, s)
}

#[no_mangle]
pub extern "C" fn cuMemsetD32Async(dst: CUdeviceptr, v: c_uint, n: usize, s: Handle) -> CUresult {
    fill_async(dst, v.to_le_bytes().to_vec(), n, s)
}

/// A synchronous call: `queued` on the null stream, then waited for.
fn then_wait(queued: CUresult) -> CUresult {
    if queued != 0 {
        return queued;
    }
    cuStreamSynchronize(std::ptr::null_mut())
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    then_wait(cuMemsetD8Async(dst, v, n, std::ptr::null_mut()))
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        if n > 0 && (d.heap.find(dst, n).is_none() || d.heap.find(src, n).is_none()) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let s = stream_of(&mut d.state(), s)?;
        s.submit(Op::Copy { dst, src, len: n as u64 });
        Ok(())
    })
}

/// A copy between host memory and `n` bytes of the device at `dev`, in
/// stream `s`'s order: the checks, then the context's earlier work (the
/// copy is synchronous, as the real driver's is for pageable memory),
/// then `copy`, which says whether the heap took it.
fn host_copy(s: Handle, host_is_null: bool, dev: CUdeviceptr, n: usize, copy: impl FnOnce(&Driver) -> bool) -> CUresult {
    entry(|d| {
        usable(d)?;
        stream_of(&mut d.state(), s)?;
        if n == 0 {
            return Ok(());
        }
        if host_is_null || d.heap.find(dev, n).is_none() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        drain_current(d)?;
        usable(d)?;
        if copy(d) {
            Ok(())
        } else {
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: Handle) -> CUresult {
    // SAFETY: the caller's source buffer holds n readable bytes for the
    // call (it is read through volatile loads, never borrowed).
    host_copy(s, src.is_null(), dst, n, |d| unsafe { d.heap.from_host(dst, src.cast(), n) })
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    // SAFETY: the caller's destination holds n writable bytes for the
    // call (written through volatile stores, never borrowed).
    host_copy(s, dst.is_null(), src, n, |d| unsafe { d.heap.to_host(dst.cast(), src, n) })
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    cuMemcpyDtoHAsync_v2(dst, src, n, std::ptr::null_mut())
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    cuMemcpyHtoDAsync_v2(dst, src, n, std::ptr::null_mut())
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    then_wait(cuMemcpyDtoDAsync_v2(dst, src, n, std::ptr::null_mut()))
}

/// Waits for every stream of the current context.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    entry(|d| {
        usable(d)?;
        drain_current(d)?;
        usable(d)
    })
}

// ---- modules and launches ----

/// The bytes of a module image given by pointer alone: PTX up to its NUL,
/// a fatbin as long as its header says.
///
/// # Safety
/// `image` must point to a complete PTX string, fatbin or ELF image.
unsafe fn image_bytes<'a>(image: *const u8) -> Result<std::borrow::Cow<'a, [u8]>, E> {
    // SAFETY: every image is at least 4 bytes long (a PTX string that is
    // shorter ends with its NUL among them, which stops the comparison).
    let head4 = unsafe { std::slice::from_raw_parts(image, 4) };
    if head4 == b"\x7fELF" {
        return Err(E::CUDA_ERROR_NO_BINARY_FOR_GPU);
    }
    if u32::from_le_bytes([head4[0], head4[1], head4[2], head4[3]]) == 0xBA55_ED50 {
        // SAFETY: a fatbin header is 16 bytes.
        let head = unsafe { std::slice::from_raw_parts(image, 16) };
        let len = virtio_gpu_compute::fatbin::total_len(head).map_err(|_| E::CUDA_ERROR_INVALID_IMAGE)?;
        if len > MAX_IMAGE {
            return Err(E::CUDA_ERROR_INVALID_IMAGE);
        }
        // SAFETY: the caller's fatbin is as long as its header states.
        let whole = unsafe { std::slice::from_raw_parts(image, len as usize) };
        let ptx = virtio_gpu_compute::fatbin::ptx_for_interpreter(whole, CC.0 * 10 + CC.1, MAX_IMAGE).map_err(|_| E::CUDA_ERROR_INVALID_IMAGE)?.ok_or(E::CUDA_ERROR_NO_BINARY_FOR_GPU)?;
        return Ok(std::borrow::Cow::Owned(ptx.0));
    }
    // SAFETY: otherwise the image is a NUL-terminated PTX string.
    Ok(std::borrow::Cow::Borrowed(unsafe { CStr::from_ptr(image.cast()) }.to_bytes()))
}

#[no_mangle]
pub extern "C" fn cuModuleLoadData(pm: *mut Handle, image: *const c_void) -> CUresult {
    entry(|d| {
        usable(d)?;
        if pm.is_null() || image.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let c = ctx_now(&d.state())?;
        // SAFETY: the caller passes a complete image.
        let bytes = unsafe { image_bytes(image.cast()) }?;
        let text = std::str::from_utf8(bytes.strip_suffix(&[0]).unwrap_or(&bytes)).map_err(|_| E::CUDA_ERROR_INVALID_PTX)?;
        let mut ptx = vgpu_ptx::Module::parse(text).map_err(|_| E::CUDA_ERROR_INVALID_PTX)?;
        if ptx.target > CC.0 * 10 + CC.1 {
            return Err(E::CUDA_ERROR_UNSUPPORTED_PTX_VERSION);
        }
        let limit = device_memory(d)?;
        let mut data = Vec::new();
        let mut place = |size: u64| -> Result<u64, E> {
            if size == 0 {
                return Ok(0);
            }
            let a = d.heap.alloc(c, size, limit).ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?;
            data.push(a);
            Ok(a)
        };
        let placed = place(ptx.global_size).and_then(|g| Ok((g, place(ptx.const_size)?)));
        let (g, k) = match placed {
            Ok(x) => x,
            Err(e) => {
                data.iter().for_each(|a| {
                    d.heap.free(*a);
                });
                return Err(e);
            }
        };
        for (addr, init) in ptx.link(g, k) {
            d.heap.store(addr, &init);
        }
        let sms = d.devices[d.state().ctxs.get(&c).ok_or(E::CUDA_ERROR_INVALID_CONTEXT)?.dev].sms;
        let mut st = d.state();
        let id = st.id();
        st.modules.insert(id, Arc::new(LoadedModule { ctx: c, ptx, sms, data }));
        out(pm, h(id))
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(m: Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        let mut st = d.state();
        let m = st.modules.remove(&k(m)).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        st.funcs.retain(|_, (x, _)| !Arc::ptr_eq(x, &m));
        drop(st);
        // Kernels still queued hold the module; its variables go now, as
        // a GPU's would (a kernel that still reaches them faults).
        for a in &m.data {
            d.heap.free(*a);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuModuleGetFunction(pf: *mut Handle, m: Handle, name: *const c_char) -> CUresult {
    entry(|d| {
        usable(d)?;
        if name.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| E::CUDA_ERROR_NOT_FOUND)?;
        let mut st = d.state();
        let module = st.modules.get(&k(m)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        let index = module.ptx.kernels.iter().position(|x| x.name == name).ok_or(E::CUDA_ERROR_NOT_FOUND)?;
        // The same function is the same handle.
        let f = match st.func_ids.get(&(k(m), index)) {
            Some(f) => *f,
            None => {
                let f = st.id();
                st.func_ids.insert((k(m), index), f);
                st.funcs.insert(f, (module, index));
                f
            }
        };
        out(pf, h(f))
    })
}

#[no_mangle]
pub extern "C" fn cuModuleGetGlobal_v2(dptr: *mut CUdeviceptr, bytes: *mut usize, m: Handle, name: *const c_char) -> CUresult {
    entry(|d| {
        usable(d)?;
        if name.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| E::CUDA_ERROR_NOT_FOUND)?;
        let module = d.state().modules.get(&k(m)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        let (addr, size) = module.ptx.symbol(name).ok_or(E::CUDA_ERROR_NOT_FOUND)?;
        if !dptr.is_null() {
            out(dptr, addr)?;
        }
        if !bytes.is_null() {
            out(bytes, size as usize)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuFuncGetParamInfo(f: Handle, index: usize, offset: *mut usize, size: *mut usize) -> CUresult {
    entry(|d| {
        usable(d)?;
        let (m, i) = d.state().funcs.get(&k(f)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        let p = m.ptx.kernels[i].params.get(index).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        out(offset, p.offset as usize)?;
        out(size, p.size as usize)
    })
}

/// `CU_LAUNCH_PARAM_*` markers in a launch's `extra` list.
const PARAM_END: usize = 0;
const PARAM_BUFFER_POINTER: usize = 1;
const PARAM_BUFFER_SIZE: usize = 2;

/// The kernel's parameter block from `kernelParams` (one pointer per
/// parameter) or from `extra` (one buffer).
///
/// # Safety
/// The pointers must be what cuLaunchKernel's contract says they are.
unsafe fn param_block(k: &vgpu_ptx::Kernel, params: *mut *mut c_void, extra: *mut *mut c_void) -> Result<Vec<u8>, E> {
    let mut buf = vec![0u8; k.params_size as usize];
    if !params.is_null() {
        for (i, p) in k.params.iter().enumerate() {
            // SAFETY: kernelParams holds one pointer per parameter.
            let src = unsafe { *params.add(i) }.cast::<u8>().cast_const();
            if src.is_null() {
                return Err(E::CUDA_ERROR_INVALID_VALUE);
            }
            let at = p.offset as usize;
            let dst = buf.get_mut(at..at + p.size as usize).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
            // SAFETY: each parameter pointer holds p.size bytes.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        }
        return Ok(buf);
    }
    if extra.is_null() {
        return if buf.is_empty() { Ok(buf) } else { Err(E::CUDA_ERROR_INVALID_VALUE) };
    }
    let (mut data, mut len) = (std::ptr::null::<u8>(), None::<usize>);
    for i in (0..64).step_by(2) {
        // SAFETY: extra is a list of (marker, value) pairs ending at END.
        let marker = unsafe { *extra.add(i) } as usize;
        if marker == PARAM_END {
            break;
        }
        // SAFETY: as above: a value follows each marker.
        let v = unsafe { *extra.add(i + 1) };
        match marker {
            PARAM_BUFFER_POINTER => data = v.cast::<u8>().cast_const(),
            // SAFETY: the value of BUFFER_SIZE points to a size_t.
            PARAM_BUFFER_SIZE if !v.is_null() => len = Some(unsafe { *v.cast::<usize>() }),
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        }
    }
    match len {
        Some(n) if !data.is_null() && n >= buf.len() => {
            // SAFETY: the buffer holds n >= buf.len() bytes.
            unsafe { std::ptr::copy_nonoverlapping(data, buf.as_mut_ptr(), buf.len()) };
            Ok(buf)
        }
        _ => Err(E::CUDA_ERROR_INVALID_VALUE),
    }
}

/// Threads an SM holds at once (CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR).
const THREADS_PER_SM: u64 = 2048;

/// The device memory a launch of `kern` needs the context to keep for
/// local memory, modelled on the documented driver: the kernel's local
/// bytes a thread (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) for every thread the
/// device holds at once, taken at the launch, and not given back before
/// the context goes (the CU_CTX_LMEM_RESIZE_TO_MAX behaviour, the default).
fn local_need(kern: &vgpu_ptx::Kernel, sms: u32) -> u64 {
    u64::from(kern.local_size) * u64::from(sms) * THREADS_PER_SM
}

/// `cuFuncGetAttribute`, for the attributes the PTX gives: threads a block
/// (0), static shared (1), local (3) bytes, registers (4). Others are
/// refused with CUDA_ERROR_INVALID_VALUE.
#[no_mangle]
pub extern "C" fn cuFuncGetAttribute(pi: *mut c_int, attrib: c_int, f: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let st = d.state();
        let (module, index) = st.funcs.get(&k(f)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        drop(st);
        let kern = &module.ptx.kernels[index];
        let clamp = |v: u64| c_int::try_from(v).unwrap_or(c_int::MAX);
        let v = match attrib {
            0 => clamp(u64::from(MAX_THREADS)),
            1 => clamp(u64::from(kern.shared_bytes)),
            3 => clamp(u64::from(kern.local_size)),
            4 => clamp(u64::from(kern.num_regs)),
            _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
        };
        out(pi, v)
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    s: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry(|d| {
        usable(d)?;
        let mut st = d.state();
        let (module, index) = st.funcs.get(&k(f)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        if ctx_now(&st)? != module.ctx {
            return Err(E::CUDA_ERROR_INVALID_HANDLE);
        }
        let kern = &module.ptx.kernels[index];
        let (grid, block) = ([gx, gy, gz], [bx, by, bz]);
        let threads = block.iter().try_fold(1u32, |a, b| a.checked_mul(*b));
        let fits = threads.is_some_and(|t| (1..=MAX_THREADS).contains(&t))
            && block.iter().zip(MAX_BLOCK).all(|(b, m)| (1..=m).contains(b))
            && grid.iter().zip(MAX_GRID).all(|(g, m)| (1..=m).contains(g))
            && kern.shared_bytes.checked_add(shared).is_some_and(|b| b <= MAX_SHARED);
        if !fits {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller follows cuLaunchKernel's contract for both.
        let block_params = unsafe { param_block(kern, params, extra) }?;
        let stream = stream_of(&mut st, s)?;
        let need = local_need(kern, module.sms);
        let ctx = st.ctxs.get_mut(&module.ctx).ok_or(E::CUDA_ERROR_INVALID_CONTEXT)?;
        if need > ctx.local {
            if !d.heap.reserve(need - ctx.local, d.devices[ctx.dev].memory) {
                return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
            }
            ctx.local = need;
        }
        drop(st);
        stream.submit(Op::Kernel { module, index, cfg: vgpu_ptx::LaunchConfig { grid, block, dynamic_shared: shared }, params: block_params });
        Ok(())
    })
}

// ---- graphs, as stream capture makes them ----------------------------------
//
// Modelled on the documented behaviour: work submitted to a capturing
// stream is recorded, not run; a capture ends in a graph; an executable
// graph instantiated from it runs that work in order on the stream it is
// launched on, after the work queued there before, and may be launched
// again and again. The null stream cannot capture. Graphs die with their
// context.

#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(s: Handle, mode: c_int) -> CUresult {
    entry(|d| {
        usable(d)?;
        if s.is_null() || fault("capture-fails") {
            return Err(E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if !(0..=2).contains(&mode) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let stream = stream_of(&mut d.state(), s)?;
        if !stream.begin_capture() {
            return Err(E::CUDA_ERROR_ILLEGAL_STATE);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamEndCapture(s: Handle, graph: *mut Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let mut st = d.state();
        let stream = stream_of(&mut st, s)?;
        let ops = stream.end_capture().ok_or(E::CUDA_ERROR_ILLEGAL_STATE)?;
        let id = st.id();
        st.graphs.insert(id, (stream.ctx, ops));
        out(graph, h(id))
    })
}

#[no_mangle]
pub extern "C" fn cuGraphInstantiateWithFlags(exec: *mut Handle, graph: Handle, flags: u64) -> CUresult {
    entry(|d| {
        usable(d)?;
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = d.state();
        let g = st.graphs.get(&k(graph)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        let id = st.id();
        st.graph_execs.insert(id, g);
        out(exec, h(id))
    })
}

#[no_mangle]
pub extern "C" fn cuGraphLaunch(exec: Handle, s: Handle) -> CUresult {
    entry(|d| {
        usable(d)?;
        let mut st = d.state();
        let (ctx, ops) = st.graph_execs.get(&k(exec)).cloned().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        let stream = stream_of(&mut st, s)?;
        if stream.ctx != ctx {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        drop(st);
        for op in ops {
            stream.submit(op);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuGraphExecDestroy(exec: Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        // Launches already queued keep their own copy of the work.
        d.state().graph_execs.remove(&k(exec)).map(|_| ()).ok_or(E::CUDA_ERROR_INVALID_HANDLE)
    })
}

#[no_mangle]
pub extern "C" fn cuGraphDestroy(graph: Handle) -> CUresult {
    entry(|d| {
        inited(d)?;
        d.state().graphs.remove(&k(graph)).map(|_| ()).ok_or(E::CUDA_ERROR_INVALID_HANDLE)
    })
}

#[no_mangle]
pub extern "C" fn cuGetErrorName(code: CUresult, p: *mut *const c_char) -> CUresult {
    entry(|_| {
        let e = E::from_u32(code);
        if e == E::CUDA_ERROR_UNKNOWN && code != E::CUDA_ERROR_UNKNOWN as u32 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        out(p, e.name_c().as_ptr().cast())
    })
}
