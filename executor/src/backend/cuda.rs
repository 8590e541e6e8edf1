//! The `cuda` backend: a real NVIDIA GPU or MIG instance through the CUDA
//! driver API, loaded at run time by cudarc.
//!
//! - Each tenant gets its own CUDA context, so the GPU's MMU confines its
//!   kernels to its own allocations and a fault poisons only that context.
//! - Memory is zeroed with a device memset before hand-out and again before
//!   it is returned to the driver; a sampled read-back checks every
//!   hand-out scrub, and a failed check quarantines the device.
//! - Host-to-device and device-to-host copies go through two pinned staging
//!   buffers per tenant (the CPU copy of one chunk overlaps the DMA of the
//!   other), or straight from memory registered with `cuMemHostRegister`:
//!   tenants' shared buffers and VM guest RAM.
//!
//! The worker process runs with `CUDA_VISIBLE_DEVICES` naming exactly its
//! GPU or MIG instance, so the backend always uses device 0.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use virtio_gpu_compute::{CuResult, ImageFormat, ParamDesc};

use super::{piece, AllocTable, Backend, BackendError, Backoff, DeviceDesc, DeviceModule, FunctionDesc, GraphOp, Launch, ModuleDataAlloc, TenantSlot, VolatileSlice};

/// The oldest driver this backend runs on (CUDA 12.2): the level the
/// cudarc bindings are pinned to.
pub const MIN_DRIVER_VERSION: i32 = 12020;
/// Allocation granule, as on the CPU device, so quotas round the same way.
pub const GRANULE: u64 = 256;
/// Bytes of a copy each of a tenant's two pinned staging buffers takes at
/// a time.
pub const STAGE_BYTES: usize = 4 << 20;
/// Size of each staging buffer: a piece and the page of room
/// `staging::place` moves it in.
const STAGE_BUF: usize = STAGE_BYTES + 4096;
/// Bytes read back from each sample point of a scrub check.
const SAMPLE_BYTES: usize = 256;
/// Sample points per scrubbed allocation: both ends plus random ones.
const SAMPLES: usize = 6;
/// Kernels of one tenant queued without waiting, at most (each holds an
/// event until it is seen to end).
const MAX_QUEUED: usize = 64;

/// Every driver entry point this backend calls. cudarc resolves a symbol
/// on first use and panics if it is missing, so [`probe`] checks them all
/// up front.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxCreate_v2",
    "cuCtxDestroy_v2",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuFuncGetAttribute",
    "cuLaunchKernel",
    "cuGetErrorName",
    "cuStreamQuery",
];

/// The entry points a tenant's graphs are built and run with (stream
/// capture, CUDA 10 on). Looked up once: a driver without them has each
/// graph's work run piece by piece instead.
const GRAPH_SYMBOLS: &[&str] = &["cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags", "cuGraphLaunch", "cuGraphExecDestroy", "cuGraphDestroy"];

/// Most nodes of executable graphs one tenant's device context holds at
/// once. The driver keeps each graph's launch state in device memory the
/// tenant's quota does not see: this bounds it (about 16 bytes of kernel
/// parameters and a few hundred of driver state per node, so tens of MiB
/// at most, besides the quota).
const MAX_DEVICE_GRAPH_NODES: usize = 1 << 17;

/// `cuFuncGetParamInfo` (CUDA 12.4+): looked up by name, so older drivers
/// work and fall back to the PTX `.param` declarations.
type ParamInfoFn = unsafe extern "C" fn(cu::CUfunction, usize, *mut usize, *mut usize) -> cu::CUresult;

fn code_of(r: cu::CUresult) -> u32 {
    r as u32
}

/// Raw driver codes after which CUDA refuses every further call on the
/// context, including those the protocol has no name for.
pub fn is_sticky(raw: u32) -> bool {
    matches!(raw, 700 | 702 | 710 | 714..=719)
}

fn error_name(r: cu::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves
    // it null; it has no other effect.
    let ok = unsafe { cu::cuGetErrorName(r, &mut p) } == cu::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("CUDA error {}", code_of(r))
    }
}

fn check(r: cu::CUresult, what: &str) -> Result<(), BackendError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let raw = code_of(r);
    let mut code = CuResult::from_u32(raw);
    if is_sticky(raw) && code == CuResult::CUDA_ERROR_UNKNOWN {
        // Sticky codes without a protocol name fail the context all the same.
        code = CuResult::CUDA_ERROR_LAUNCH_FAILED;
    }
    Err(BackendError::new(code, format!("{what}: {}", error_name(r))))
}

/// Checks that a usable driver is present: the library loads, every entry
/// point this backend calls exists, cuInit succeeds, the driver is new
/// enough and shows at least one device. Never panics.
pub fn probe() -> Result<i32, String> {
    // SAFETY: loading the library runs its initialisers, which is what
    // using the driver at all requires.
    if !unsafe { cu::is_culib_present() } {
        return Err("libcuda.so (the NVIDIA driver) is not installed".into());
    }
    // SAFETY: as above; the library is loaded once and kept.
    let lib = unsafe { cu::culib() };
    for name in REQUIRED {
        // SAFETY: only the symbol's presence is checked; nothing is called.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(format!("the NVIDIA driver lacks {name}; it is too old for this backend (needs CUDA {})", version_text(MIN_DRIVER_VERSION)));
        }
    }
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        check(cu::cuInit(0), "cuInit").map_err(|e| e.msg)?;
        let mut v = 0;
        check(cu::cuDriverGetVersion(&mut v), "cuDriverGetVersion").map_err(|e| e.msg)?;
        if v < MIN_DRIVER_VERSION {
            return Err(format!("the NVIDIA driver supports CUDA {}; this backend needs {}", version_text(v), version_text(MIN_DRIVER_VERSION)));
        }
        let mut n = 0;
        check(cu::cuDeviceGetCount(&mut n), "cuDeviceGetCount").map_err(|e| e.msg)?;
        if n < 1 {
            return Err("the NVIDIA driver sees no device (check CUDA_VISIBLE_DEVICES)".into());
        }
        Ok(v)
    }
}

pub fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A page-locked host buffer from `cuMemAllocHost`.
struct Pinned {
    ptr: *mut u8,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAllocHost and is freed once, with the
        // owning context current (the tenant's context outlives its buffers).
        unsafe { cu::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// One tenant's CUDA context and what hangs off it.
struct TenantCtx {
    ctx: cu::CUcontext,
    stream: cu::CUstream,
    /// Two pinned buffers and the events that say when each is free again.
    stage: Option<([Pinned; 2], [cu::CUevent; 2])>,
    /// The pinned buffer a scrub's sample reads land in, and the event
    /// recorded after them.
    check_buf: Option<(Pinned, cu::CUevent)>,
    /// The last allocation's sample reads, queued behind its scrub and not
    /// yet looked at: the allocation's address and each sample's length.
    pending_check: Option<(u64, [usize; SAMPLES])>,
    /// A kernel faulted: the context refuses every call until rebuilt.
    poisoned: bool,
    /// False once the context was destroyed (a runaway kernel, or close).
    alive: bool,
    /// Bumped when the context is rebuilt; modules of older generations
    /// died with their context.
    generation: u64,
    /// Kernels queued without waiting (`launch_queued`) and not yet seen
    /// to end: ticket -> the event recorded behind the kernel, in the
    /// order they were queued (tickets only grow, across rebuilds too),
    /// and when each was queued. An entry leaves before its event is
    /// destroyed, so every event here is live.
    queued: BTreeMap<u64, (cu::CUevent, Instant)>,
    /// When a queued kernel was last seen to end: the next one's launch
    /// timeout counts from then (or from when it was queued, if later).
    last_end: Instant,
    /// Events of ended launches, for the next ones.
    spare: Vec<cu::CUevent>,
    tickets: u64,
    /// The stream graphs are captured on (made on first use): never the
    /// tenant's own, which keeps running its work meanwhile.
    capture: cu::CUstream,
    /// The tenant's executable graphs, by the id `graph_create` gave,
    /// with their node counts; ids are never given twice (across
    /// rebuilds too).
    graphs: HashMap<u64, (cu::CUgraphExec, usize)>,
    graph_nodes: usize,
    next_graph: u64,
}

// SAFETY: CUDA handles may be used from any thread once their context is
// made current there; every use goes through the tenant's mutex and sets
// the context current first.
unsafe impl Send for TenantCtx {}

impl TenantCtx {
    fn new(dev: cu::CUdevice, generation: u64) -> Result<TenantCtx, BackendError> {
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags 0 is the default scheduling.
        check(unsafe { cu::cuCtxCreate_v2(&mut ctx, 0, dev) }, "cuCtxCreate")?;
        let mut stream: cu::CUstream = std::ptr::null_mut();
        // SAFETY: cuCtxCreate made ctx current on this thread; valid out-pointer.
        let r = unsafe { cu::cuStreamCreate(&mut stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) };
        if let Err(e) = check(r, "cuStreamCreate") {
            // SAFETY: the context was created above and holds nothing yet.
            unsafe { cu::cuCtxDestroy_v2(ctx) };
            return Err(e);
        }
        Ok(TenantCtx {
            ctx,
            stream,
            stage: None,
            check_buf: None,
            pending_check: None,
            poisoned: false,
            alive: true,
            generation,
            queued: BTreeMap::new(),
            last_end: Instant::now(),
            spare: Vec::new(),
            tickets: 0,
            capture: std::ptr::null_mut(),
            graphs: HashMap::new(),
            graph_nodes: 0,
            next_graph: 0,
        })
    }

    fn current(&self) -> Result<(), BackendError> {
        if self.poisoned || !self.alive {
            return Err(BackendError::new(
                CuResult::CUDA_ERROR_ILLEGAL_ADDRESS,
                "the tenant's device context is unusable after a kernel fault or a failed scrub check; destroy its contexts to start afresh",
            ));
        }
        // SAFETY: ctx is a live context owned by this value.
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Records a sticky error so later calls fail fast, as CUDA would.
    fn note<T>(&mut self, r: Result<T, BackendError>) -> Result<T, BackendError> {
        if let Err(e) = &r {
            if e.code.is_sticky() {
                self.poisoned = true;
                // A tenant's executor ends (vgpu_arbiter::fatal): no context in
                // this process works again on NVIDIA's driver.
                vgpu_arbiter::fatal::mark(&e.msg);
            }
        }
        r
    }

    /// Waits until every kernel queued without waiting has ended (their
    /// tickets stay, for `launch_finished` to see them end), giving each
    /// `timeout` from the end of the one before. Nothing else runs on the
    /// tenant's stream meanwhile: the caller holds the tenant's lock.
    fn wait_queued(&mut self, timeout: Duration) -> Result<(), Unsettled> {
        let events: Vec<(cu::CUevent, Instant)> = self.queued.values().copied().collect();
        for (ev, queued_at) in events {
            let since = self.last_end.max(queued_at);
            let mut wait = Backoff::new(Duration::from_millis(2));
            loop {
                // SAFETY: the event is live (every event in `queued` is:
                // entries leave before their events are destroyed, under
                // the tenant's lock, which the caller holds) and belongs
                // to the current context.
                let r = unsafe { cu::cuEventQuery(ev) };
                if r != cu::CUresult::CUDA_ERROR_NOT_READY {
                    self.note(check(r, "kernel")).map_err(Unsettled::Failed)?;
                    self.last_end = Instant::now();
                    break;
                }
                let waited = since.elapsed();
                if waited >= timeout {
                    return Err(Unsettled::TimedOut(waited));
                }
                wait.pause();
            }
        }
        Ok(())
    }

    fn sync(&mut self, what: &str) -> Result<(), BackendError> {
        // SAFETY: the stream belongs to the current context.
        let r = check(unsafe { cu::cuStreamSynchronize(self.stream) }, what);
        self.note(r)
    }

    fn staging(&mut self) -> Result<&mut ([Pinned; 2], [cu::CUevent; 2]), BackendError> {
        if self.stage.is_none() {
            let mut bufs = Vec::with_capacity(2);
            let mut evs = [std::ptr::null_mut(); 2];
            for ev in &mut evs {
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: the tenant's context is current; valid out-pointers.
                check(unsafe { cu::cuMemAllocHost_v2(&mut p, STAGE_BUF) }, "cuMemAllocHost")?;
                bufs.push(Pinned { ptr: p.cast() });
                // SAFETY: as above.
                check(unsafe { cu::cuEventCreate(ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
            }
            let b1 = bufs.pop();
            let b0 = bufs.pop();
            if let (Some(b0), Some(b1)) = (b0, b1) {
                self.stage = Some(([b0, b1], evs));
            }
        }
        self.stage.as_mut().ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "no staging buffers"))
    }

    fn check_buf(&mut self) -> Result<(*mut u8, cu::CUevent), BackendError> {
        if self.check_buf.is_none() {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: the tenant's context is current; valid out-pointer.
            check(unsafe { cu::cuMemAllocHost_v2(&mut p, SAMPLES * SAMPLE_BYTES) }, "cuMemAllocHost")?;
            let buf = Pinned { ptr: p.cast() };
            let mut ev = std::ptr::null_mut();
            // SAFETY: as above.
            check(unsafe { cu::cuEventCreate(&mut ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
            self.check_buf = Some((buf, ev));
        }
        self.check_buf.as_ref().map(|(b, e)| (b.ptr, *e)).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "no scrub check buffer"))
    }

    fn destroy(&mut self) {
        if !std::mem::replace(&mut self.alive, false) {
            return;
        }
        self.poisoned = true;
        // SAFETY: every handle below was created in this context, which is
        // made current first; after this the value is dropped.
        unsafe {
            cu::cuCtxSetCurrent(self.ctx);
            if let Some((bufs, evs)) = self.stage.take() {
                drop(bufs);
                for ev in evs {
                    if !ev.is_null() {
                        cu::cuEventDestroy_v2(ev);
                    }
                }
            }
            self.pending_check = None;
            for ev in std::mem::take(&mut self.queued).into_values().map(|(e, _)| e).chain(self.spare.drain(..)) {
                cu::cuEventDestroy_v2(ev);
            }
            if let Some((buf, ev)) = self.check_buf.take() {
                drop(buf);
                cu::cuEventDestroy_v2(ev);
            }
            for (_, (g, _)) in self.graphs.drain() {
                cu::cuGraphExecDestroy(g);
            }
            self.graph_nodes = 0;
            if !self.capture.is_null() {
                cu::cuStreamDestroy_v2(std::mem::replace(&mut self.capture, std::ptr::null_mut()));
            }
            cu::cuStreamDestroy_v2(self.stream);
            cu::cuCtxDestroy_v2(self.ctx);
        }
    }
}

/// Why kernels queued without waiting did not all end.
enum Unsettled {
    Failed(BackendError),
    /// One ran this long past the end of the one before it.
    TimedOut(Duration),
}

type TenantRef = Arc<Mutex<TenantCtx>>;

/// A module loaded into one tenant's context.
struct CudaModule {
    owner: TenantRef,
    generation: u64,
    module: cu::CUmodule,
    /// Parameter layouts from the PTX text, for drivers without
    /// cuFuncGetParamInfo.
    ptx_params: Option<HashMap<String, (Vec<ParamDesc>, u32)>>,
    param_info: Option<ParamInfoFn>,
    /// Functions handed out so far, with their parameter layouts.
    funcs: Mutex<Vec<(cu::CUfunction, Vec<ParamDesc>)>>,
    /// Host bytes charged to the tenant for this module.
    host_bytes: u64,
    /// The device's launch timeout, for the kernels it waits for before
    /// it unloads.
    launch_timeout: Duration,
    /// Threads the device holds at once (SMs × threads an SM holds): the
    /// driver keeps a kernel's local memory for each of them.
    resident_threads: u64,
}

// SAFETY: the module and function handles are only used with their
// owner's context current, under the owner's mutex.
unsafe impl Send for CudaModule {}
// SAFETY: as above; `funcs` is behind a mutex.
unsafe impl Sync for CudaModule {}

impl CudaModule {
    fn layout(&self, f: cu::CUfunction, name: &str) -> Option<(Vec<ParamDesc>, u32)> {
        if let Some(info) = self.param_info {
            let mut params = Vec::new();
            let mut size = 0u32;
            for i in 0..=virtio_gpu_compute::MAX_PARAM_BYTES as usize {
                let (mut off, mut n) = (0usize, 0usize);
                // SAFETY: f is a live function of the current context;
                // valid out-pointers. Past the last parameter it returns
                // CUDA_ERROR_INVALID_VALUE.
                if unsafe { info(f, i, &mut off, &mut n) } != cu::CUresult::CUDA_SUCCESS {
                    break;
                }
                let (off, n) = (u32::try_from(off).ok()?, u32::try_from(n).ok()?);
                size = size.max(off.checked_add(n)?);
                params.push(ParamDesc { offset: off, size: n });
            }
            return Some((params, size));
        }
        self.ptx_params.as_ref()?.get(name).cloned()
    }
}

impl DeviceModule for CudaModule {
    fn function(&self, name: &str) -> Option<FunctionDesc> {
        let cname = CString::new(name).ok()?;
        let mut owner = self.owner.lock().unwrap_or_else(|e| e.into_inner());
        // A lazily loaded kernel may make the driver wait for the context:
        // never behind queued kernels, where the launch timeout cannot
        // reach it.
        if owner.generation != self.generation || owner.current().is_err() || owner.wait_queued(self.launch_timeout).is_err() {
            return None;
        }
        let mut f: cu::CUfunction = std::ptr::null_mut();
        // SAFETY: the owning context is current and the module is live in
        // it (same generation); valid out-pointer and C string.
        if unsafe { cu::cuModuleGetFunction(&mut f, self.module, cname.as_ptr()) } != cu::CUresult::CUDA_SUCCESS {
            return None;
        }
        let (params, params_size) = self.layout(f, name)?;
        let mut local = 0i32;
        // SAFETY: f is a live function of the current context (above);
        // valid out-pointer.
        if unsafe { cu::cuFuncGetAttribute(&mut local, cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f) } != cu::CUresult::CUDA_SUCCESS {
            return None;
        }
        let local_reserve = u64::try_from(local).unwrap_or(0).saturating_mul(self.resident_threads);
        let mut funcs = self.funcs.lock().unwrap_or_else(|e| e.into_inner());
        let index = funcs.iter().position(|x| x.0 == f).unwrap_or_else(|| {
            funcs.push((f, params.clone()));
            funcs.len() - 1
        });
        Some(FunctionDesc { index, params, params_size, local_reserve })
    }

    fn host_bytes(&self) -> u64 {
        self.host_bytes
    }

    fn global(&self, name: &str) -> Option<(u64, u64)> {
        let cname = CString::new(name).ok()?;
        let mut owner = self.owner.lock().unwrap_or_else(|e| e.into_inner());
        // As for functions.
        if owner.generation != self.generation || owner.current().is_err() || owner.wait_queued(self.launch_timeout).is_err() {
            return None;
        }
        let (mut dptr, mut bytes): (cu::CUdeviceptr, usize) = (0, 0);
        // SAFETY: the owning context is current and the module is live in
        // it (same generation); valid out-pointers and C string.
        if unsafe { cu::cuModuleGetGlobal_v2(&mut dptr, &mut bytes, self.module, cname.as_ptr()) } != cu::CUresult::CUDA_SUCCESS {
            return None;
        }
        Some((dptr, bytes as u64))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaModule {
    fn drop(&mut self) {
        let mut owner = self.owner.lock().unwrap_or_else(|e| e.into_inner());
        // Never unloaded under a queued kernel: once they ended (or, if one
        // runs away, never: the executor is ending, or the context goes).
        if owner.generation == self.generation && owner.current().is_ok() && owner.wait_queued(self.launch_timeout).is_ok() {
            // SAFETY: the module is live in the current context.
            unsafe { cu::cuModuleUnload(self.module) };
        }
    }
}

pub struct CudaBackend {
    desc: DeviceDesc,
    dev: cu::CUdevice,
    /// The device's primary context: current while registering host memory.
    home: cu::CUcontext,
    tenants: Mutex<HashMap<TenantSlot, TenantRef>>,
    next_slot: AtomicU64,
    /// Host ranges registered with cuMemHostRegister: start -> length.
    registered: RwLock<BTreeMap<usize, usize>>,
    scrubbed: AtomicU64,
    quarantined: AtomicBool,
    param_info: Option<ParamInfoFn>,
    /// Whether the driver has [`GRAPH_SYMBOLS`].
    graphs: bool,
    launch_timeout: Duration,
    sample_seed: AtomicU64,
    /// Threads the device holds at once, for [`CudaModule::resident_threads`].
    resident_threads: u64,
}

// SAFETY: `home` is only used with cuCtxSetCurrent, which is thread-safe;
// all other state is behind locks or atomics.
unsafe impl Send for CudaBackend {}
// SAFETY: as above.
unsafe impl Sync for CudaBackend {}

fn attr(dev: cu::CUdevice, a: cu::CUdevice_attribute) -> Result<u32, BackendError> {
    let mut v = 0i32;
    // SAFETY: valid out-pointer and device.
    check(unsafe { cu::cuDeviceGetAttribute(&mut v, a, dev) }, "cuDeviceGetAttribute")?;
    Ok(v.max(0) as u32)
}

/// Every `CUdevice_attribute` the driver answers for `dev`, by number,
/// through the raw entry point (cudarc's enum cannot name numbers its
/// CUDA 12.2 headers lack).
fn raw_attributes(dev: cu::CUdevice) -> Vec<i32> {
    type GetAttr = unsafe extern "C" fn(*mut std::ffi::c_int, std::ffi::c_int, cu::CUdevice) -> cu::CUresult;
    // SAFETY: looks a symbol up by name; its signature is
    // cuDeviceGetAttribute's, with the attribute as a plain int.
    let Some(get) = (unsafe { cu::culib().get::<GetAttr>(b"cuDeviceGetAttribute").ok().map(|s| *s) }) else {
        return vec![virtio_gpu_compute::attrs::UNSUPPORTED; virtio_gpu_compute::attrs::COUNT];
    };
    (0..virtio_gpu_compute::attrs::COUNT as std::ffi::c_int)
        .map(|a| {
            let mut v = 0;
            // SAFETY: valid out-pointer and device; unknown numbers return
            // CUDA_ERROR_INVALID_VALUE.
            match unsafe { get(&mut v, a, dev) } {
                cu::CUresult::CUDA_SUCCESS => v,
                _ => virtio_gpu_compute::attrs::UNSUPPORTED,
            }
        })
        .collect()
}

impl CudaBackend {
    /// Opens device 0 of this process (the worker's `CUDA_VISIBLE_DEVICES`
    /// names exactly one GPU or MIG instance).
    pub fn new(numa_node: i32, launch_timeout: Duration) -> Result<CudaBackend, String> {
        probe()?;
        Self::open(numa_node, launch_timeout).map_err(|e| e.msg)
    }

    /// What device 0 of this process is, without a context on it (the
    /// device's arbiter, which holds no tenant state, says this to tenants).
    pub fn describe(numa_node: i32) -> Result<DeviceDesc, String> {
        probe()?;
        let mut dev: cu::CUdevice = 0;
        // SAFETY: valid out-pointer; cuInit ran in probe().
        check(unsafe { cu::cuDeviceGet(&mut dev, 0) }, "cuDeviceGet").map_err(|e| e.msg)?;
        Self::device_desc(dev, numa_node).map_err(|e| e.msg)
    }

    fn device_desc(dev: cu::CUdevice, numa_node: i32) -> Result<DeviceDesc, BackendError> {
        use cu::CUdevice_attribute as A;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 bytes, as stated.
        check(unsafe { cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev) }, "cuDeviceGetName")?;
        // SAFETY: the driver NUL-terminates within the buffer.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        // SAFETY: CUuuid is plain bytes; valid out-pointer.
        let mut uuid: cu::CUuuid = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer and device.
        check(unsafe { cu::cuDeviceGetUuid_v2(&mut uuid, dev) }, "cuDeviceGetUuid")?;
        let mut memory = 0usize;
        // SAFETY: valid out-pointer and device.
        check(unsafe { cu::cuDeviceTotalMem_v2(&mut memory, dev) }, "cuDeviceTotalMem")?;
        Ok(DeviceDesc {
            kind: "cuda",
            name,
            uuid: uuid.bytes.map(|b| b as u8),
            memory: memory as u64,
            cc: (attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?),
            sm_count: attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            max_threads_per_block: attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_shared_per_block: attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
            max_block: [attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?, attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?, attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?],
            max_grid: [attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?, attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?, attr(dev, A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?],
            instruction_budget: 0,
            numa_node,
            attributes: Some(raw_attributes(dev)),
        })
    }

    fn open(numa_node: i32, launch_timeout: Duration) -> Result<CudaBackend, BackendError> {
        let mut dev: cu::CUdevice = 0;
        // SAFETY: valid out-pointer; cuInit ran in probe().
        check(unsafe { cu::cuDeviceGet(&mut dev, 0) }, "cuDeviceGet")?;
        let desc = Self::device_desc(dev, numa_node)?;
        let mut home: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device; released in Drop.
        check(unsafe { cu::cuDevicePrimaryCtxRetain(&mut home, dev) }, "cuDevicePrimaryCtxRetain")?;
        // SAFETY: looks a symbol up by name; a missing one is None. The
        // signature is cuFuncGetParamInfo's, per the CUDA 12.4 headers.
        let param_info = unsafe { cu::culib().get::<ParamInfoFn>(b"cuFuncGetParamInfo").ok().map(|s| *s) };
        // SAFETY: only the symbols' presence is checked; nothing is called.
        let graphs = GRAPH_SYMBOLS.iter().all(|name| unsafe { cu::culib().get::<*const c_void>(name.as_bytes()) }.is_ok());
        let per_sm = attr(dev, cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?;
        let resident_threads = u64::from(desc.sm_count) * u64::from(per_sm);
        Ok(CudaBackend {
            desc,
            dev,
            home,
            tenants: Mutex::new(HashMap::new()),
            next_slot: AtomicU64::new(1),
            registered: RwLock::new(BTreeMap::new()),
            scrubbed: AtomicU64::new(0),
            quarantined: AtomicBool::new(false),
            param_info,
            graphs,
            launch_timeout,
            sample_seed: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            resident_threads,
        })
    }

    /// Waits for the tenant's kernel: spinning briefly (short kernels are
    /// the common case), then sleeping. A kernel still running at the
    /// deadline is stopped ([`Self::timed_out`]).
    fn wait_kernel(&self, t: &mut TenantCtx) -> Result<(), BackendError> {
        let start = Instant::now();
        let mut wait = Backoff::new(Duration::from_millis(2));
        loop {
            // SAFETY: the stream belongs to the current context.
            let r = unsafe { cu::cuStreamQuery(t.stream) };
            if r != cu::CUresult::CUDA_ERROR_NOT_READY {
                return t.note(check(r, "kernel"));
            }
            let waited = start.elapsed();
            if waited >= self.launch_timeout {
                return Err(self.timed_out(t, waited));
            }
            wait.pause();
        }
    }

    /// A kernel ran past the launch timeout: an executor ends (the driver
    /// stops the kernel with the process; it never destroys a context
    /// with a running kernel, which would wait for it); a shared worker
    /// destroys the tenant's context, and the tenant's contexts then fail
    /// until it destroys them.
    fn timed_out(&self, t: &mut TenantCtx, waited: Duration) -> BackendError {
        let err = BackendError::new(CuResult::CUDA_ERROR_LAUNCH_TIMEOUT, format!("kernel ran past the {:?} launch timeout and was stopped", self.launch_timeout));
        if vgpu_arbiter::fatal::mark(&err.msg) {
            t.poisoned = true;
            return err;
        }
        tracing::warn!(device = %self.desc.name, ?waited, "kernel exceeded the launch timeout; destroying its tenant's context");
        t.destroy();
        err
    }

    /// The module as this backend's, its function `func`, and one pointer
    /// per declared parameter into `params` (the driver reads each
    /// parameter through its own).
    fn kernel_args<'m>(module: &'m dyn DeviceModule, func: usize, params: &[u8]) -> Result<(&'m CudaModule, cu::CUfunction, Vec<*mut c_void>), BackendError> {
        let m = module.as_any().downcast_ref::<CudaModule>().ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "module belongs to another backend"))?;
        let (f, layout) = m.funcs.lock().unwrap_or_else(|e| e.into_inner()).get(func).cloned().ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "no such function"))?;
        let mut args: Vec<*mut c_void> = Vec::with_capacity(layout.len());
        for p in &layout {
            let end = p.offset as usize + p.size as usize;
            if end > params.len() {
                return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, format!("parameter at {}+{} lies past the {} bytes given", p.offset, p.size, params.len())));
            }
            // The driver only reads through these pointers.
            args.push(params[p.offset as usize..].as_ptr() as *mut c_void);
        }
        Ok((m, f, args))
    }

    /// Puts a kernel on the tenant's stream, once the last scrub was
    /// checked; returns without waiting for it.
    fn submit(&self, t: &mut TenantCtx, m: &CudaModule, f: cu::CUfunction, args: &mut [*mut c_void], l: &Launch) -> Result<(), BackendError> {
        // A kernel can copy device bytes into the tenant's registered
        // host memory: none runs before the last scrub was checked.
        self.settle_check(t)?;
        let stream = t.stream;
        Self::submit_on(t, stream, m, f, args, l)
    }

    /// Puts a kernel on `stream` of the tenant's context.
    fn submit_on(t: &mut TenantCtx, stream: cu::CUstream, m: &CudaModule, f: cu::CUfunction, args: &mut [*mut c_void], l: &Launch) -> Result<(), BackendError> {
        if t.generation != m.generation {
            return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "module belongs to a context that no longer exists"));
        }
        // SAFETY: f is live in the current context (same generation);
        // `args` holds one pointer per declared parameter, each to at
        // least its declared size of bytes inside the caller's parameter
        // block, which outlives the call (the driver copies the values).
        // The driver checks the launch dimensions.
        let r = unsafe {
            cu::cuLaunchKernel(
                f,
                l.grid[0],
                l.grid[1],
                l.grid[2],
                l.block[0],
                l.block[1],
                l.block[2],
                l.shared_bytes,
                stream,
                if args.is_empty() { std::ptr::null_mut() } else { args.as_mut_ptr() },
                std::ptr::null_mut(),
            )
        };
        t.note(check(r, "cuLaunchKernel"))
    }

    /// An event recorded on the tenant's stream now (behind the kernel
    /// just queued), or None where none can be had.
    fn mark_queued(t: &mut TenantCtx) -> Option<cu::CUevent> {
        let ev = match t.spare.pop() {
            Some(e) => e,
            None => {
                let mut e = std::ptr::null_mut();
                // SAFETY: the tenant's context is current; valid out-pointer.
                if unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) } != cu::CUresult::CUDA_SUCCESS {
                    return None;
                }
                e
            }
        };
        // SAFETY: event and stream belong to the current context.
        if unsafe { cu::cuEventRecord(ev, t.stream) } != cu::CUresult::CUDA_SUCCESS {
            t.spare.push(ev);
            return None;
        }
        Some(ev)
    }

    /// A ticket for the work just queued on the tenant's stream. At most
    /// MAX_QUEUED events per tenant: past that (or without an event) the
    /// work is waited for here, after what is before it (`None`).
    fn ticket(&self, t: &mut TenantCtx) -> Result<Option<u64>, BackendError> {
        let ev = if t.queued.len() < MAX_QUEUED { Self::mark_queued(t) } else { None };
        let Some(ev) = ev else {
            self.quiesce(t)?;
            self.wait_kernel(t)?;
            return Ok(None);
        };
        t.tickets += 1;
        t.queued.insert(t.tickets, (ev, Instant::now()));
        Ok(Some(t.tickets))
    }

    /// Captures `ops` on the tenant's capture stream into an executable
    /// graph. The capture always ends, so the stream is usable after an
    /// error.
    fn capture(t: &mut TenantCtx, ops: &[GraphOp<'_>]) -> Result<cu::CUgraphExec, BackendError> {
        if t.capture.is_null() {
            let mut s: cu::CUstream = std::ptr::null_mut();
            // SAFETY: the tenant's context is current; valid out-pointer.
            check(unsafe { cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate")?;
            t.capture = s;
        }
        let cs = t.capture;
        // Relaxed: other threads of the executor (other tenants' work in a
        // shared worker) are not held to the capture's rules.
        // SAFETY: cs is a live stream of the current context.
        check(unsafe { cu::cuStreamBeginCapture_v2(cs, cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) }, "cuStreamBeginCapture")?;
        let mut recorded = || -> Result<(), BackendError> {
            for op in ops {
                match op {
                    GraphOp::Kernel { module, func, launch, params } => {
                        // One node's argument pointers at a time: the
                        // driver copies the values as it records.
                        let (m, f, mut args) = Self::kernel_args(*module, *func, params)?;
                        Self::submit_on(t, cs, m, f, &mut args, launch)?;
                    }
                    GraphOp::Fill { dptr, count, elem } => {
                        let n = *count as usize;
                        // SAFETY: captured, not run: the range was checked
                        // against the tenant's allocations, and is checked
                        // again at each launch of the graph.
                        let r = unsafe {
                            match **elem {
                                [b] => cu::cuMemsetD8Async(*dptr, b, n, cs),
                                [a, b] => cu::cuMemsetD16Async(*dptr, u16::from_le_bytes([a, b]), n, cs),
                                [a, b, c, d] => cu::cuMemsetD32Async(*dptr, u32::from_le_bytes([a, b, c, d]), n, cs),
                                _ => return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "memset elements are 1, 2 or 4 bytes")),
                            }
                        };
                        check(r, "cuMemset (captured)")?;
                    }
                    // SAFETY: as for memsets.
                    GraphOp::Copy { dst, src, len } => check(unsafe { cu::cuMemcpyDtoDAsync_v2(*dst, *src, *len as usize, cs) }, "cuMemcpyDtoDAsync (captured)")?,
                }
            }
            Ok(())
        };
        let body = recorded();
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: the capture began above on cs; valid out-pointer.
        let ended = check(unsafe { cu::cuStreamEndCapture(cs, &mut graph) }, "cuStreamEndCapture");
        if ended.is_err() {
            // A stream whose capture did not end is not used again.
            // SAFETY: cs is a live stream of the current context, in no
            // other use (the tenant's lock is held).
            unsafe { cu::cuStreamDestroy_v2(cs) };
            t.capture = std::ptr::null_mut();
        }
        let made = body.and(ended).and_then(|()| {
            let mut exec: cu::CUgraphExec = std::ptr::null_mut();
            // SAFETY: graph is the graph the capture made; valid out-pointer.
            check(unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "cuGraphInstantiate").map(|()| exec)
        });
        if !graph.is_null() {
            // SAFETY: the executable graph (if any) is independent of it.
            unsafe { cu::cuGraphDestroy(graph) };
        }
        made
    }

    /// Whether cuFuncGetParamInfo was found in the driver.
    pub fn has_param_info(&self) -> bool {
        self.param_info.is_some()
    }

    fn tenant(&self, slot: TenantSlot) -> Result<TenantRef, BackendError> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner()).get(&slot).cloned().ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "no device context for this tenant"))
    }

    /// Runs `f` with the tenant's context current, once every kernel
    /// queued without waiting has ended: what `f` does (an allocation, a
    /// copy, a free) never runs beside a tenant's kernel, as when each
    /// launch was waited for.
    fn with<T>(&self, slot: TenantSlot, f: impl FnOnce(&mut TenantCtx) -> Result<T, BackendError>) -> Result<T, BackendError> {
        self.with_queued(slot, |t| {
            self.quiesce(t)?;
            f(t)
        })
    }

    /// As [`Self::with`], with kernels still queued: for queueing more and
    /// looking at them.
    fn with_queued<T>(&self, slot: TenantSlot, f: impl FnOnce(&mut TenantCtx) -> Result<T, BackendError>) -> Result<T, BackendError> {
        let t = self.tenant(slot)?;
        let mut g = t.lock().unwrap_or_else(|e| e.into_inner());
        g.current()?;
        f(&mut g)
    }

    /// Waits for the kernels queued without waiting ([`TenantCtx::wait_queued`]);
    /// one past the launch timeout is stopped ([`Self::timed_out`]).
    fn quiesce(&self, t: &mut TenantCtx) -> Result<(), BackendError> {
        if t.queued.is_empty() {
            return Ok(());
        }
        match t.wait_queued(self.launch_timeout) {
            Ok(()) => Ok(()),
            Err(Unsettled::Failed(e)) => Err(e),
            Err(Unsettled::TimedOut(waited)) => Err(self.timed_out(t, waited)),
        }
    }

    fn is_registered(&self, ptr: *const u8, len: usize) -> bool {
        let p = ptr as usize;
        let reg = self.registered.read().unwrap_or_else(|e| e.into_inner());
        reg.range(..=p).next_back().is_some_and(|(s, l)| p.checked_add(len).is_some_and(|end| end <= s + l))
    }

    /// Offsets to read back after zeroing `n` bytes: both ends and a few
    /// pseudo-random points in between, different on every call.
    fn sample_points(&self, n: u64) -> Vec<u64> {
        let last = n.saturating_sub(SAMPLE_BYTES as u64);
        let mut pts = vec![0, last];
        let mut x = self.sample_seed.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed) | 1;
        for _ in 2..SAMPLES {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            pts.push(if last == 0 { 0 } else { x % last / 8 * 8 });
        }
        pts
    }

    /// Zeroes `[d, d+n)` on the tenant's stream. Without `verify` it waits
    /// for the memset. With `verify` (a new allocation) nothing waits: the
    /// memset and the sample reads that check it are queued on the
    /// tenant's stream, ahead of anything the tenant does with the memory,
    /// and [`Self::settle_check`] looks at the samples later, before any
    /// kernel runs and before any copy to the tenant's host memory.
    fn scrub(&self, t: &mut TenantCtx, d: u64, n: u64, verify: bool) -> Result<(), BackendError> {
        if verify {
            // One check in flight per tenant: its buffer is reused.
            self.settle_check(t)?;
        }
        // SAFETY: [d, d+n) is an allocation of the current context.
        let r = check(unsafe { cu::cuMemsetD8Async(d, 0, n as usize, t.stream) }, "scrub memset");
        t.note(r)?;
        if !verify {
            return t.sync("scrub memset");
        }
        let r = (|| {
            let (buf, ev) = t.check_buf()?;
            // SAFETY: no copy into the buffer is in flight (settled above);
            // it holds SAMPLES * SAMPLE_BYTES bytes.
            unsafe { std::ptr::write_bytes(buf, 0xAA, SAMPLES * SAMPLE_BYTES) };
            let mut lens = [0usize; SAMPLES];
            for (i, off) in self.sample_points(n).into_iter().enumerate() {
                lens[i] = SAMPLE_BYTES.min((n - off) as usize);
                // SAFETY: the source lies inside the allocation, after its
                // memset on the same stream; the destination is slot i of
                // the pinned buffer, untouched until the event fires.
                check(unsafe { cu::cuMemcpyDtoHAsync_v2(buf.add(i * SAMPLE_BYTES).cast(), d + off, lens[i], t.stream) }, "scrub read-back")?;
            }
            // SAFETY: event and stream belong to the current context.
            check(unsafe { cu::cuEventRecord(ev, t.stream) }, "cuEventRecord")?;
            Ok(lens)
        })();
        if r.is_err() {
            // Reads queued before the failure land in the buffer: none may
            // still be in flight when it is next filled.
            // SAFETY: the stream belongs to the current context.
            unsafe { cu::cuStreamSynchronize(t.stream) };
        }
        let lens = t.note(r)?;
        t.pending_check = Some((d, lens));
        Ok(())
    }

    /// Waits for the last allocation's sample reads and looks at them; a
    /// non-zero byte quarantines the device.
    ///
    /// The check stays pending until it passes. A check that fails, or
    /// cannot be made, leaves the tenant's context unusable, so no retry
    /// reaches memory whose scrub was not verified.
    fn settle_check(&self, t: &mut TenantCtx) -> Result<(), BackendError> {
        let Some((d, lens)) = t.pending_check else { return Ok(()) };
        let unverified = |t: &mut TenantCtx, e: BackendError| {
            t.poisoned = true;
            Err(e)
        };
        let (buf, ev) = match t.check_buf() {
            Ok(b) => b,
            Err(e) => return unverified(t, e),
        };
        // SAFETY: the event was recorded after the sample reads.
        let r = check(unsafe { cu::cuEventSynchronize(ev) }, "scrub read-back");
        if let Err(e) = t.note(r) {
            return unverified(t, e);
        }
        for (i, len) in lens.into_iter().enumerate() {
            // SAFETY: the reads into the buffer are done (waited above). It
            // is this executor's pinned memory; a kernel could reach it only
            // by its address, and no kernel runs before this check passed.
            let got = unsafe { std::slice::from_raw_parts(buf.add(i * SAMPLE_BYTES), len) };
            if got.iter().any(|b| *b != 0) {
                self.quarantined.store(true, Ordering::Relaxed);
                tracing::error!(device = %self.desc.name, addr = d, "scrub verification read back non-zero bytes; device quarantined");
                return unverified(t, BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "scrub verification failed; device quarantined"));
            }
        }
        t.pending_check = None;
        Ok(())
    }

    /// Host to device through the staging buffers: the CPU fills one while
    /// the copy engine drains the other.
    fn staged_write(t: &mut TenantCtx, addr: u64, data: &VolatileSlice<'_>) -> Result<(), BackendError> {
        let stream = t.stream;
        let r = (|| {
            let (bufs, evs) = t.staging()?;
            let (_, step) = virtio_gpu_compute::staging::place(0, STAGE_BUF);
            let src = data.ptr_guard().as_ptr() as usize;
            for k in 0..data.len().div_ceil(step) {
                let off = k * step;
                let chunk = piece(data, off, step.min(data.len() - off))?;
                let b = k % 2;
                if k >= 2 {
                    // SAFETY: the event was recorded after this buffer's last copy.
                    check(unsafe { cu::cuEventSynchronize(evs[b]) }, "staging wait")?;
                }
                // Half a page from the source's offset in its page (no
                // 4 KiB aliasing in the memcpy); `at + step` fits the buffer.
                let (at, _) = virtio_gpu_compute::staging::place(src.wrapping_add(off), STAGE_BUF);
                // SAFETY: the pinned buffer holds STAGE_BUF >= at +
                // chunk.len() bytes the executor owns, and the copy engine
                // is done with it (waited above).
                let stage = unsafe { bufs[b].ptr.add(at) };
                // SAFETY: as above.
                chunk.copy_to_volatile_slice(unsafe { VolatileSlice::new(stage, chunk.len()) });
                // SAFETY: destination inside a checked allocation; source is
                // the pinned buffer, untouched until the event fires.
                check(unsafe { cu::cuMemcpyHtoDAsync_v2(addr + off as u64, stage.cast(), chunk.len(), stream) }, "cuMemcpyHtoDAsync")?;
                // SAFETY: event and stream belong to the current context.
                check(unsafe { cu::cuEventRecord(evs[b], stream) }, "cuEventRecord")?;
            }
            Ok(())
        })();
        t.note(r)?;
        t.sync("host-to-device copy")
    }

    /// Device to host through the staging buffers: chunk k+1's DMA runs
    /// while the CPU copies chunk k out.
    fn staged_read(t: &mut TenantCtx, addr: u64, out: &VolatileSlice<'_>) -> Result<(), BackendError> {
        let stream = t.stream;
        let r = (|| {
            let (bufs, evs) = t.staging()?;
            let (_, step) = virtio_gpu_compute::staging::place(0, STAGE_BUF);
            let dst = out.ptr_guard_mut().as_ptr() as usize;
            // Where piece `off` of the copy lies in a staging buffer: half
            // a page from the destination's offset in its page, so the
            // memcpy out meets no 4 KiB aliasing; `at + step` fits.
            let at = |off: usize| virtio_gpu_compute::staging::place(dst.wrapping_add(off), STAGE_BUF).0;
            let mut pending: Option<(usize, usize, usize)> = None;
            let drain = |p: (usize, usize, usize), out: &VolatileSlice<'_>| -> Result<(), BackendError> {
                let (b, off, n) = p;
                // SAFETY: the event follows this buffer's DMA.
                check(unsafe { cu::cuEventSynchronize(evs[b]) }, "staging wait")?;
                // SAFETY: the DMA into the pinned buffer (at + n <=
                // STAGE_BUF bytes the executor owns) finished, waited above.
                let staged = unsafe { VolatileSlice::new(bufs[b].ptr.add(at(off)), n) };
                staged.copy_to_volatile_slice(piece(out, off, n)?);
                Ok(())
            };
            let total = out.len();
            let mut off = 0;
            let mut k = 0;
            while off < total {
                let n = step.min(total - off);
                let b = k % 2;
                // SAFETY: source inside a checked allocation; destination is
                // a pinned buffer (at + n <= STAGE_BUF) whose previous
                // contents were drained.
                check(unsafe { cu::cuMemcpyDtoHAsync_v2(bufs[b].ptr.add(at(off)).cast(), addr + off as u64, n, stream) }, "cuMemcpyDtoHAsync")?;
                // SAFETY: event and stream belong to the current context.
                check(unsafe { cu::cuEventRecord(evs[b], stream) }, "cuEventRecord")?;
                if let Some(p) = pending.take() {
                    drain(p, out)?;
                }
                pending = Some((b, off, n));
                off += n;
                k += 1;
            }
            if let Some(p) = pending {
                drain(p, out)?;
            }
            Ok(())
        })();
        t.note(r)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if vgpu_arbiter::fatal::marked() {
            // Ending: the process's end releases everything, and a
            // destroy could wait on a running kernel.
            return;
        }
        for (_, t) in self.tenants.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            t.lock().unwrap_or_else(|e| e.into_inner()).destroy();
        }
        // SAFETY: balances the retain in `open`.
        unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// A module with one empty kernel: loading it makes the driver load its
/// PTX JIT compiler.
const WARM_PTX: &[u8] = b".version 6.0\n.target sm_50\n.address_size 64\n.visible .entry vgpu_warm() { ret; }\n\0";

impl Backend for CudaBackend {
    fn launch_timeout(&self) -> Option<Duration> {
        Some(self.launch_timeout)
    }

    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    /// The driver dlopens its PTX JIT compiler on the first PTX module and
    /// tries its JIT cache under $HOME on every one. Under the worker's
    /// seccomp lists no file opens, so the compiler is loaded now, for
    /// good (RTLD_NODELETE), and a module is loaded once; the cache stays
    /// unreachable, which the driver does without (measured on an H100).
    fn before_confinement(&self) {
        // SAFETY: dlopen with a static C string; the handle is kept (the
        // library stays loaded for the process's life).
        let jit = unsafe { libc::dlopen(c"libnvidia-ptxjitcompiler.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NODELETE) };
        if jit.is_null() {
            tracing::debug!("no libnvidia-ptxjitcompiler.so.1 to preload; the driver's first module load shows whether it needs one");
        }
        // SAFETY: the primary context is live (released in Drop); the
        // image is NUL-terminated PTX; the module is unloaded right after.
        unsafe {
            if cu::cuCtxSetCurrent(self.home) != cu::CUresult::CUDA_SUCCESS {
                return;
            }
            let mut m: cu::CUmodule = std::ptr::null_mut();
            match cu::cuModuleLoadData(&mut m, WARM_PTX.as_ptr().cast()) {
                cu::CUresult::CUDA_SUCCESS => {
                    cu::cuModuleUnload(m);
                }
                r => tracing::warn!("loading a PTX module before confinement failed ({}); tenants' PTX may not load", error_name(r)),
            }
        }
    }

    fn open_tenant(&self, _name: &str) -> Result<TenantSlot, BackendError> {
        let t = TenantCtx::new(self.dev, 0)?;
        let slot = self.next_slot.fetch_add(1, Ordering::Relaxed);
        self.tenants.lock().unwrap_or_else(|e| e.into_inner()).insert(slot, Arc::new(Mutex::new(t)));
        Ok(slot)
    }

    fn close_tenant(&self, slot: TenantSlot) {
        if let Some(t) = self.tenants.lock().unwrap_or_else(|e| e.into_inner()).remove(&slot) {
            let mut g = t.lock().unwrap_or_else(|e| e.into_inner());
            g.destroy();
            g.generation += 1;
        }
    }

    fn recover_tenant(&self, slot: TenantSlot) -> Result<(), BackendError> {
        let t = self.tenant(slot)?;
        let mut g = t.lock().unwrap_or_else(|e| e.into_inner());
        if !g.poisoned {
            return Ok(());
        }
        if vgpu_arbiter::fatal::marked() {
            // No new context can be made in this process: the tenant's
            // next one is in its next executor.
            return Err(BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, "this executor is ending after a fatal error; the tenant's next connection gets a new one"));
        }
        // Destroying the context releases whatever it still held; nobody
        // sees those bytes, because every hand-out is zeroed first.
        g.destroy();
        let next = TenantCtx::new(self.dev, g.generation + 1);
        match next {
            Ok(mut n) => {
                // Tickets and graph ids are never given twice.
                n.tickets = g.tickets;
                n.next_graph = g.next_graph;
                *g = n;
                Ok(())
            }
            Err(e) => {
                // Leave a context that refuses everything, never a dangling one.
                g.generation += 1;
                Err(e)
            }
        }
    }

    fn quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    fn alloc(&self, slot: TenantSlot, size: u64) -> Result<(u64, u64), BackendError> {
        if self.quarantined() {
            return Err(BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "device quarantined after a failed scrub"));
        }
        let n = size.max(1).checked_next_multiple_of(GRANULE).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "size overflows"))?;
        self.with(slot, |t| {
            let mut d: cu::CUdeviceptr = 0;
            // SAFETY: the tenant's context is current; valid out-pointer.
            check(unsafe { cu::cuMemAlloc_v2(&mut d, n as usize) }, "cuMemAlloc")?;
            if let Err(e) = self.scrub(t, d, n, true) {
                // SAFETY: d was allocated above in this context.
                unsafe { cu::cuMemFree_v2(d) };
                return Err(e);
            }
            self.scrubbed.fetch_add(n, Ordering::Relaxed);
            Ok((d, n))
        })
    }

    fn free(&self, slot: TenantSlot, addr: u64, len: u64) {
        let _ = self.with(slot, |t| {
            // Zero before the driver gets it back, so not even a process
            // outside the mediator can read it; allocation zeroes again.
            let scrubbed = self.scrub(t, addr, len, false);
            if scrubbed.is_ok() {
                // SAFETY: addr is a live allocation of this context (the
                // service checked ownership).
                unsafe { cu::cuMemFree_v2(addr) };
            }
            scrubbed
        });
    }

    fn bytes_scrubbed(&self) -> u64 {
        self.scrubbed.load(Ordering::Relaxed)
    }

    fn write(&self, slot: TenantSlot, addr: u64, data: VolatileSlice<'_>) -> Result<(), BackendError> {
        if data.is_empty() {
            return Ok(());
        }
        self.with(slot, |t| {
            let src = data.ptr_guard();
            if self.is_registered(src.as_ptr(), data.len()) {
                // SAFETY: the source is registered (page-locked) host memory
                // that stays mapped for the call; the destination lies in a
                // checked allocation.
                let r = check(unsafe { cu::cuMemcpyHtoDAsync_v2(addr, src.as_ptr().cast(), data.len(), t.stream) }, "cuMemcpyHtoDAsync");
                t.note(r)?;
                return t.sync("host-to-device copy");
            }
            Self::staged_write(t, addr, &data)
        })
    }

    fn read(&self, slot: TenantSlot, addr: u64, out: VolatileSlice<'_>) -> Result<(), BackendError> {
        if out.is_empty() {
            return Ok(());
        }
        self.with(slot, |t| {
            // No device byte reaches the tenant before its scrub is checked.
            self.settle_check(t)?;
            let dst = out.ptr_guard_mut();
            if self.is_registered(dst.as_ptr(), out.len()) {
                // SAFETY: as for writes, in the other direction.
                let r = check(unsafe { cu::cuMemcpyDtoHAsync_v2(dst.as_ptr().cast(), addr, out.len(), t.stream) }, "cuMemcpyDtoHAsync");
                t.note(r)?;
                return t.sync("device-to-host copy");
            }
            Self::staged_read(t, addr, &out)
        })
    }

    fn fill(&self, slot: TenantSlot, addr: u64, count: u64, elem: &[u8]) -> Result<(), BackendError> {
        self.with(slot, |t| {
            let n = count as usize;
            // SAFETY: [addr, addr + count*elem) lies in a checked allocation.
            let r = unsafe {
                match *elem {
                    [b] => cu::cuMemsetD8Async(addr, b, n, t.stream),
                    [a, b] => cu::cuMemsetD16Async(addr, u16::from_le_bytes([a, b]), n, t.stream),
                    [a, b, c, d] => cu::cuMemsetD32Async(addr, u32::from_le_bytes([a, b, c, d]), n, t.stream),
                    _ => return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "memset elements are 1, 2 or 4 bytes")),
                }
            };
            t.note(check(r, "cuMemset"))?;
            t.sync("memset")
        })
    }

    fn copy(&self, slot: TenantSlot, dst: u64, src: u64, len: u64) -> Result<(), BackendError> {
        self.with(slot, |t| {
            // SAFETY: both ranges lie in checked allocations of this context.
            let r = check(unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, len as usize, t.stream) }, "cuMemcpyDtoDAsync");
            t.note(r)?;
            t.sync("device-to-device copy")
        })
    }

    fn load_module(&self, slot: TenantSlot, image: &[u8], format: ImageFormat, host_limit: u64, _data: &mut ModuleDataAlloc<'_>) -> Result<Arc<dyn DeviceModule>, BackendError> {
        // The driver places the module's variables in the tenant's own
        // context; `_data` is for backends that place them themselves.
        let owner = self.tenant(slot)?;
        // The driver keeps (at least) a copy of the image on the host.
        let mut host_bytes = image.len() as u64;
        if host_bytes > host_limit {
            return Err(BackendError::over_host_budget(format!("a {host_bytes}-byte module exceeds the {host_limit} bytes left in the tenant's host budget")));
        }
        let ptx_params = match format {
            ImageFormat::Ptx => {
                let text = std::str::from_utf8(image.strip_suffix(&[0]).unwrap_or(image)).map_err(|_| BackendError::new(CuResult::CUDA_ERROR_INVALID_PTX, "PTX image is not valid UTF-8 text"))?;
                let sigs = vgpu_ptx::Module::signatures(text, host_limit - host_bytes).map_err(BackendError::ptx)?;
                // The layouts the module keeps, charged with it (a map
                // entry's own overhead counted as 64 bytes).
                host_bytes += sigs.iter().map(|s| 64 + s.name.len() as u64 + (s.params.len() * std::mem::size_of::<ParamDesc>()) as u64).sum::<u64>();
                Some(sigs.into_iter().map(|s| (s.name, (s.params.iter().map(|p| ParamDesc { offset: p.offset, size: p.size }).collect(), s.params_size))).collect())
            }
            _ if self.param_info.is_none() => {
                return Err(BackendError::new(
                    CuResult::CUDA_ERROR_NOT_SUPPORTED,
                    "this driver has no cuFuncGetParamInfo (CUDA 12.4+), so kernel parameters of cubin and fatbin images cannot be laid out; load PTX instead",
                ))
            }
            _ => None,
        };
        // The driver reads PTX up to a NUL; a copy guarantees one.
        let mut owned_image;
        let image = if format == ImageFormat::Ptx && image.last() != Some(&0) {
            owned_image = image.to_vec();
            owned_image.push(0);
            &owned_image[..]
        } else {
            image
        };
        let mut g = owner.lock().unwrap_or_else(|e| e.into_inner());
        g.current()?;
        self.quiesce(&mut g)?;
        let mut module: cu::CUmodule = std::ptr::null_mut();
        // SAFETY: the image is a complete PTX (NUL-terminated), cubin or
        // fatbin buffer that outlives the call; the driver validates it.
        check(unsafe { cu::cuModuleLoadData(&mut module, image.as_ptr().cast()) }, "cuModuleLoadData")?;
        let generation = g.generation;
        drop(g);
        Ok(Arc::new(CudaModule {
            owner,
            generation,
            module,
            ptx_params,
            param_info: self.param_info,
            funcs: Mutex::new(Vec::new()),
            host_bytes,
            launch_timeout: self.launch_timeout,
            resident_threads: self.resident_threads,
        }))
    }

    fn placed_bytes(&self, image: &[u8], format: ImageFormat, host_limit: u64) -> Result<u64, BackendError> {
        super::placed::placed_bytes(image, format, self.desc.cc.0 * 10 + self.desc.cc.1, host_limit)
    }

    fn launch(&self, slot: TenantSlot, module: &dyn DeviceModule, func: usize, l: &Launch, params: &[u8], _owned: &AllocTable) -> Result<u64, BackendError> {
        let (m, f, mut args) = Self::kernel_args(module, func, params)?;
        self.with(slot, |t| {
            self.submit(t, m, f, &mut args, l)?;
            self.wait_kernel(t)?;
            Ok(0)
        })
    }

    fn queues_launches(&self) -> bool {
        true
    }

    fn launch_queued(&self, slot: TenantSlot, module: &dyn DeviceModule, func: usize, l: &Launch, params: &[u8], _owned: &AllocTable) -> Result<Option<u64>, BackendError> {
        let (m, f, mut args) = Self::kernel_args(module, func, params)?;
        self.with_queued(slot, |t| {
            self.submit(t, m, f, &mut args, l)?;
            self.ticket(t)
        })
    }

    fn launch_finished(&self, slot: TenantSlot, ticket: u64, since: Instant) -> Result<bool, BackendError> {
        self.with_queued(slot, |t| {
            let Some(&(ev, _)) = t.queued.get(&ticket) else {
                return Err(BackendError::new(CuResult::CUDA_ERROR_LAUNCH_FAILED, "the kernel's context was destroyed before it ended"));
            };
            // SAFETY: the event is live (every event in `queued` is, and
            // we hold the tenant's lock) and belongs to the current context.
            let r = unsafe { cu::cuEventQuery(ev) };
            if r == cu::CUresult::CUDA_ERROR_NOT_READY {
                let waited = since.elapsed();
                if waited >= self.launch_timeout {
                    t.queued.remove(&ticket);
                    t.spare.push(ev);
                    return Err(self.timed_out(t, waited));
                }
                return Ok(false);
            }
            t.queued.remove(&ticket);
            t.last_end = Instant::now();
            if r == cu::CUresult::CUDA_SUCCESS {
                t.spare.push(ev);
            } else {
                // SAFETY: the event belongs to the current context and is
                // in no list any more.
                unsafe { cu::cuEventDestroy_v2(ev) };
            }
            t.note(check(r, "kernel")).map(|_| true)
        })
    }

    fn graph_create(&self, slot: TenantSlot, ops: &[GraphOp<'_>]) -> Result<Option<u64>, BackendError> {
        if !self.graphs {
            return Ok(None);
        }
        self.with(slot, |t| {
            if t.graph_nodes + ops.len() > MAX_DEVICE_GRAPH_NODES {
                return Err(BackendError::new(
                    CuResult::CUDA_ERROR_OUT_OF_MEMORY,
                    format!("the tenant's graphs on the device would hold more than {MAX_DEVICE_GRAPH_NODES} nodes; destroy some first"),
                ));
            }
            let exec = Self::capture(t, ops);
            let exec = t.note(exec)?;
            t.next_graph += 1;
            t.graph_nodes += ops.len();
            t.graphs.insert(t.next_graph, (exec, ops.len()));
            Ok(Some(t.next_graph))
        })
    }

    fn graph_launch_queued(&self, slot: TenantSlot, graph: u64) -> Result<Option<u64>, BackendError> {
        self.with_queued(slot, |t| {
            let (exec, _) = *t.graphs.get(&graph).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "the graph belonged to a device context that was rebuilt"))?;
            // Its kernels may copy into registered host memory, as any.
            self.settle_check(t)?;
            // SAFETY: exec is live in the current context (the map is
            // emptied when the context goes); the stream is the tenant's.
            t.note(check(unsafe { cu::cuGraphLaunch(exec, t.stream) }, "cuGraphLaunch"))?;
            self.ticket(t)
        })
    }

    fn graph_destroy(&self, slot: TenantSlot, graph: u64) {
        let Ok(t) = self.tenant(slot) else { return };
        let mut g = t.lock().unwrap_or_else(|e| e.into_inner());
        // An unusable context keeps it until the context goes (`destroy`).
        if g.current().is_err() {
            return;
        }
        if let Some((exec, nodes)) = g.graphs.remove(&graph) {
            g.graph_nodes -= nodes;
            // SAFETY: exec is live in the current context; a launch still
            // running keeps it until it ends (the driver frees it then).
            unsafe { cu::cuGraphExecDestroy(exec) };
        }
    }

    fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), BackendError> {
        // SAFETY: home is the retained primary context.
        check(unsafe { cu::cuCtxSetCurrent(self.home) }, "cuCtxSetCurrent")?;
        // SAFETY: [ptr, ptr+len) is a live mapping the caller keeps until
        // unregister_host; PORTABLE makes it usable from every context.
        check(unsafe { cu::cuMemHostRegister_v2(ptr.cast(), len, cu::CU_MEMHOSTREGISTER_PORTABLE) }, "cuMemHostRegister")?;
        self.registered.write().unwrap_or_else(|e| e.into_inner()).insert(ptr as usize, len);
        Ok(())
    }

    fn unregister_host(&self, ptr: *mut u8) {
        if self.registered.write().unwrap_or_else(|e| e.into_inner()).remove(&(ptr as usize)).is_some() {
            // SAFETY: ptr was registered by register_host and is still mapped.
            unsafe {
                cu::cuCtxSetCurrent(self.home);
                cu::cuMemHostUnregister(ptr.cast());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_says_why_there_is_no_driver_instead_of_panicking() {
        // SAFETY: only checks whether the library can be loaded.
        if unsafe { cu::is_culib_present() } {
            eprintln!("SKIPPED probe_says_why_there_is_no_driver_instead_of_panicking: this machine has an NVIDIA driver");
            return;
        }
        let e = probe().unwrap_err();
        assert!(e.contains("libcuda.so"), "{e}");
        assert!(CudaBackend::new(-1, Duration::from_secs(1)).is_err());
    }

    #[test]
    fn sticky_codes_are_the_ones_cuda_never_recovers_from() {
        for c in [700, 702, 710, 714, 715, 716, 717, 718, 719] {
            assert!(is_sticky(c), "{c}");
        }
        for c in [0, 1, 2, 201, 400, 500, 600, 701, 720, 999] {
            assert!(!is_sticky(c), "{c}");
        }
        assert_eq!(version_text(12020), "12.2");
        assert_eq!(version_text(13010), "13.1");
    }
}

/// What a whole-GPU scrub did: bytes zeroed and read back as zero, and the
/// memory the driver reports.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct WholeScrub {
    pub bytes: u64,
    pub device_memory: u64,
}

/// Chunks a whole-GPU scrub allocates, largest first.
const SCRUB_CHUNK: usize = 1 << 30;
const SCRUB_MIN_CHUNK: usize = 2 << 20;
/// The pinned buffer each chunk is read back through.
const SCRUB_READ: usize = 64 << 20;
/// Free memory a whole-GPU scrub may leave unallocated (fragments below
/// the smallest chunk, the allocator's own bookkeeping) and still pass.
const SCRUB_SLACK: usize = 64 << 20;

/// Zeroes every byte of the GPU at `address` that a context can allocate
/// and reads all of them back (`vgpu-mediatord scrub-gpu`, run on a
/// passthrough GPU returned from a VM). Fails on the first non-zero byte.
/// Runs in a process of its own: anything left allocated on an error goes
/// with the process.
pub fn scrub_whole_gpu(address: &vgpu_topology::pci::PciAddress) -> Result<WholeScrub, String> {
    probe()?;
    // SAFETY: the library was loaded by probe; only presence is checked.
    let lib = unsafe { cu::culib() };
    for name in ["cuDeviceGetByPCIBusId", "cuMemsetD8_v2", "cuMemcpyDtoH_v2", "cuMemGetInfo_v2"] {
        // SAFETY: as above.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(format!("the NVIDIA driver lacks {name}"));
        }
    }
    let bus = CString::new(address.to_string()).map_err(|e| e.to_string())?;
    let mut dev: cu::CUdevice = 0;
    // SAFETY: valid out-pointer and NUL-terminated bus id.
    check(unsafe { cu::cuDeviceGetByPCIBusId(&mut dev, bus.as_ptr()) }, "cuDeviceGetByPCIBusId").map_err(|e| e.msg)?;
    let mut total = 0usize;
    // SAFETY: valid out-pointer for a device cuDeviceGetByPCIBusId returned.
    check(unsafe { cu::cuDeviceTotalMem_v2(&mut total, dev) }, "cuDeviceTotalMem").map_err(|e| e.msg)?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context becomes current on this thread.
    check(unsafe { cu::cuCtxCreate_v2(&mut ctx, 0, dev) }, "cuCtxCreate").map_err(|e| e.msg)?;
    let (mut free, mut total_now) = (0usize, 0usize);
    // SAFETY: our context is current; valid out-pointers.
    check(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total_now) }, "cuMemGetInfo").map_err(|e| e.msg)?;
    // Take all the memory there is, in chunks that get smaller as it
    // fills. Only "out of memory" means full; any other failure fails the
    // scrub.
    let mut chunks: Vec<(cu::CUdeviceptr, usize)> = Vec::new();
    let mut size = SCRUB_CHUNK;
    while size >= SCRUB_MIN_CHUNK {
        let mut d: cu::CUdeviceptr = 0;
        // SAFETY: our context is current; valid out-pointer.
        match unsafe { cu::cuMemAlloc_v2(&mut d, size) } {
            cu::CUresult::CUDA_SUCCESS => chunks.push((d, size)),
            cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => size /= 2,
            r => return Err(check(r, "cuMemAlloc").err().map(|e| e.msg).unwrap_or_default()),
        }
    }
    let taken: usize = chunks.iter().map(|c| c.1).sum();
    if taken.saturating_add(SCRUB_SLACK) < free {
        return Err(format!("only {taken} of the {free} bytes free could be allocated and zeroed (another process holds memory on the GPU?)"));
    }
    for &(d, n) in &chunks {
        // SAFETY: d..d+n is an allocation of the current context.
        check(unsafe { cu::cuMemsetD8_v2(d, 0, n) }, "cuMemsetD8").map_err(|e| e.msg)?;
    }
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the buffer is freed with the process.
    check(unsafe { cu::cuMemAllocHost_v2(&mut host, SCRUB_READ) }, "cuMemAllocHost").map_err(|e| e.msg)?;
    let mut bytes = 0u64;
    for &(d, n) in &chunks {
        let mut off = 0usize;
        while off < n {
            let len = SCRUB_READ.min(n - off);
            // SAFETY: the source lies inside an allocation of the current
            // context and the destination is a pinned buffer of SCRUB_READ
            // bytes; the copy is synchronous.
            check(unsafe { cu::cuMemcpyDtoH_v2(host, d + off as u64, len) }, "cuMemcpyDtoH").map_err(|e| e.msg)?;
            // SAFETY: the synchronous copy has completed, so nothing writes
            // the buffer while this slice lives; len <= SCRUB_READ.
            let got = unsafe { std::slice::from_raw_parts(host.cast::<u8>(), len) };
            if let Some(i) = got.iter().position(|b| *b != 0) {
                return Err(format!("read back a non-zero byte at device address {:#x} after zeroing", d + (off + i) as u64));
            }
            off += len;
        }
        bytes += n as u64;
    }
    // SAFETY: every pointer came from this context's allocators; the
    // context is destroyed last.
    unsafe {
        for &(d, _) in &chunks {
            cu::cuMemFree_v2(d);
        }
        cu::cuMemFreeHost(host);
        cu::cuCtxDestroy_v2(ctx);
    }
    Ok(WholeScrub { bytes, device_memory: total as u64 })
}
