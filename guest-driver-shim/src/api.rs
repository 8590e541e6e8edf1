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
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_gpu_compute::fatbin;
use virtio_gpu_compute::*;

use crate::client::{CallError, CallResult, Client};

mod ctx;
mod export;
mod graph;
mod library;
mod mem;
mod pool;
mod unsupported;

pub type CUresult = c_uint;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
type H = *mut c_void;

/// Driver API version reported by `cuDriverGetVersion` (13.0).
pub const DRIVER_VERSION: c_int = 13000;

/// [`DRIVER_VERSION`] as tools print it ("13.0").
pub fn driver_version_text() -> String {
    format!("{}.{}", DRIVER_VERSION / 1000, DRIVER_VERSION % 1000 / 10)
}

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
    if v >> 40 == tag && v & 0xFF_0000_0000 == 0 && v as u32 != 0 {
        Some(v as u32)
    } else {
        None
    }
}

struct Func {
    ctx: u32,
    module: u32,
    name: std::ffi::CString,
    params: Vec<ParamDesc>,
    size: u32,
    /// Settable attributes: max dynamic shared memory, carveout, cache
    /// configuration.
    conf: Mutex<library::FuncConf>,
    /// Its module's code architecture (0: the device's).
    arch: u32,
}

/// A loaded module: its context and its kernels' names.
struct ModInfo {
    ctx: u32,
    entries: Arc<Vec<String>>,
    /// The architecture its code was built for (the PTX's `.target`, or
    /// the fatbin entry's), which CU_FUNC_ATTRIBUTE_PTX_VERSION reports:
    /// libraries pick host-side tuning to match the code they run.
    arch: u32,
}

/// A stream as the shim tracks it: its context, whether it synchronises
/// with the legacy default stream (created without
/// CU_STREAM_NON_BLOCKING), and the newest ring entry queued on it.
struct StreamInfo {
    ctx: u32,
    blocking: bool,
    last: u64,
    flags: c_uint,
    priority: c_int,
}

/// An event and the ring entry of its newest record, if any.
struct EventInfo {
    ctx: u32,
    recorded: Option<u64>,
}

#[derive(Default)]
struct State {
    /// The device's primary context, while it exists.
    primary: Option<u32>,
    /// References to the primary context (cuDevicePrimaryCtxRetain less
    /// Release); a reset destroys the context but keeps them, as on CUDA.
    primary_refs: u32,
    ctxs: Vec<u32>,
    modules: HashMap<u32, ModInfo>,
    funcs: HashMap<u32, Arc<Func>>,
    streams: HashMap<u32, StreamInfo>,
    events: HashMap<u32, EventInfo>,
    /// Newest ring entry on each context's legacy default stream.
    legacy: HashMap<u32, u64>,
    /// Newest entry of each context's destroyed streams: their work still
    /// runs, and context-wide synchronisation still covers it.
    orphans: HashMap<u32, u64>,
    /// Each context's settings (flags, limits, cache configuration).
    conf: HashMap<u32, ctx::CtxConf>,
    /// Flags the next primary context is made with.
    primary_flags: c_uint,
    /// Device memory this process allocated: base address to size.
    allocs: std::collections::BTreeMap<u64, Alloc>,
}

/// A device allocation as the shim tracks it (for pointer queries and
/// unified-address copies).
#[derive(Clone, Copy)]
struct Alloc {
    size: u64,
    ctx: u32,
    /// The module whose variable this is (0: an allocation).
    module: u32,
    /// The address range is reserved in this process, so no host mapping
    /// can ever alias it.
    reserved: bool,
}

struct Shim {
    /// The connection to the device. Replaced only when it was lost and
    /// the process holds no context (its executor ended: a kernel fault
    /// or a runaway, and a fresh executor serves the next context).
    conn: std::sync::RwLock<Arc<Client>>,
    info: DeviceInfo,
    /// `CUdevice_attribute` values by number, from the worker (the GPU's
    /// own on the cuda backend), or the reference table of an older one.
    attrs: Vec<i32>,
    /// Handle tables; held only while they are read or changed, never
    /// across a call to the device.
    st: Mutex<State>,
    /// Held from choosing a submission's stream waits to recording it, so
    /// two threads' submissions order the same way on every stream.
    order: Mutex<()>,
}

static SHIM: Mutex<Option<Arc<Shim>>> = Mutex::new(None);
/// The shim once cuInit succeeded: calls read it without a lock.
static READY: std::sync::OnceLock<Arc<Shim>> = std::sync::OnceLock::new();
static LAST_ERROR: Mutex<String> = Mutex::new(String::new());

// Thread-locals with destructors are reached with `try_with`: runtimes
// call the driver from their own thread-exit destructors, after ours ran.
thread_local! {
    static CURRENT: Cell<u32> = const { Cell::new(0) };
    /// This thread's per-thread default stream in each context.
    static PER_THREAD: std::cell::RefCell<HashMap<u32, u32>> = std::cell::RefCell::new(HashMap::new());
}

fn log_enabled() -> bool {
    std::env::var_os("VGPU_LOG").is_some()
}

/// `VGPU_TRACE=1`: log every symbol lookup (what a runtime asks of us).
fn trace_enabled() -> bool {
    static T: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *T.get_or_init(|| std::env::var_os("VGPU_TRACE").is_some())
}

/// `VGPU_TRACE=calls`: also log every driver call made, by name, as it
/// is entered (which call a library gave up after, when it reports no
/// error of ours).
pub(crate) fn trace_calls_enabled() -> bool {
    static T: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *T.get_or_init(|| std::env::var_os("VGPU_TRACE").is_some_and(|v| v == "calls"))
}

fn fail(api: &str, e: CallError) -> CUresult {
    // A fault is sticky for the process on CUDA; where the device's side
    // ended for it, later calls report the fault, not the lost connection.
    let e = match READY.get() {
        Some(s) => s.client().fatal(e),
        None => e,
    };
    if log_enabled() {
        eprintln!("libcuda(vgpu): {api}: {}", e);
    }
    *LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = format!("{api}: {}", e);
    e.code as CUresult
}

fn bad(msg: &str) -> CallError {
    CallError::new(CuResult::CUDA_ERROR_INVALID_VALUE, msg)
}

fn invalid_handle(what: &str) -> CallError {
    CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("invalid {what}"))
}

/// Runs `f` against the initialised shim, mapping errors to `CUresult`.
/// Threads run their calls concurrently: no lock is held across `f`.
fn with(api: &str, f: impl FnOnce(&Shim) -> CallResult<()>) -> CUresult {
    if trace_calls_enabled() {
        eprintln!("libcuda(vgpu): call {api}");
    }
    let Some(s) = READY.get() else {
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

/// Which default stream a NULL stream handle means for this call.
#[derive(Clone, Copy, PartialEq)]
enum Default {
    Legacy,
    PerThread,
}

/// A resolved stream: its context and id (DEFAULT_STREAM for legacy).
#[derive(Clone, Copy)]
struct Target {
    ctx: u32,
    stream: u32,
}

impl Shim {
    fn client(&self) -> Arc<Client> {
        self.conn.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A new connection in place of `lost`, for a process that holds no
    /// context any more: its next context is served afresh. One thread
    /// reconnects; others that saw the same loss use its connection.
    fn reconnect(&self, lost: &Arc<Client>) -> CallResult<()> {
        static ONE: Mutex<()> = Mutex::new(());
        let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&self.client(), lost) {
            return Ok(());
        }
        let fresh = Client::from_env()?;
        *self.conn.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
        if log_enabled() {
            eprintln!("libcuda(vgpu): the connection to the vGPU was lost; reconnected for a new context");
        }
        Ok(())
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn current(&self) -> CallResult<u32> {
        let c = CURRENT.with(|c| c.get());
        if c == 0 || !self.st().ctxs.contains(&c) {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "no current context"));
        }
        Ok(c)
    }

    /// A `CUdevice_attribute` value, if the device has one.
    fn attribute(&self, attr: c_int) -> Option<c_int> {
        usize::try_from(attr).ok().and_then(|a| self.attrs.get(a)).copied().filter(|v| *v != virtio_gpu_compute::attrs::UNSUPPORTED)
    }

    fn device(&self, dev: CUdevice) -> CallResult<()> {
        if dev != 0 {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_DEVICE, format!("device {dev} does not exist (this vGPU has device 0 only)")));
        }
        Ok(())
    }

    /// Resolves a stream handle: NULL (as `default` says), CU_STREAM_LEGACY
    /// (0x1), CU_STREAM_PER_THREAD (0x2) or a created stream.
    fn target(&self, h: H, default: Default) -> CallResult<Target> {
        let v = h as usize;
        if v == 1 || (v == 0 && default == Default::Legacy) {
            return Ok(Target { ctx: self.current()?, stream: DEFAULT_STREAM });
        }
        if v <= 2 {
            let ctx = self.current()?;
            return Ok(Target { ctx, stream: self.per_thread(ctx)? });
        }
        let id = dec(TAG_STREAM, h).ok_or_else(|| invalid_handle("stream"))?;
        let ctx = self.st().streams.get(&id).map(|s| s.ctx).ok_or_else(|| invalid_handle("stream"))?;
        Ok(Target { ctx, stream: id })
    }

    /// This thread's per-thread default stream in `ctx`, made on first use.
    fn per_thread(&self, ctx: u32) -> CallResult<u32> {
        if let Some(id) = PER_THREAD.try_with(|m| m.borrow().get(&ctx).copied()).ok().flatten().filter(|id| self.st().streams.contains_key(id)) {
            return Ok(id);
        }
        let id = self.client().handle(Request::StreamCreate(ObjCreateReq { ctx, flags: 0 }))?;
        self.st().streams.insert(id, StreamInfo { ctx, blocking: true, last: 0, flags: 0, priority: 0 });
        // A thread being torn down keeps no per-thread stream.
        let _ = PER_THREAD.try_with(|m| m.borrow_mut().insert(ctx, id));
        Ok(id)
    }

    fn event(&self, h: H) -> CallResult<(u32, u32)> {
        let e = dec(TAG_EVENT, h).ok_or_else(|| invalid_handle("event"))?;
        let c = self.st().events.get(&e).map(|e| e.ctx).ok_or_else(|| invalid_handle("event"))?;
        Ok((c, e))
    }

    /// Enqueues stream work on `t`, first making it wait for what CUDA's
    /// legacy default stream semantics order it after: work on the legacy
    /// stream waits for earlier work on every blocking stream of the
    /// context, and work on a blocking stream waits for earlier legacy work.
    fn enqueue(&self, t: Target, req: Request) -> CallResult<u64> {
        let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        self.enqueue_waits(t)?;
        let seq = self.client().enqueue(req)?;
        self.note(t, seq);
        Ok(seq)
    }

    /// Queues on `t` the stream waits the legacy stream's semantics need
    /// before new work there.
    fn enqueue_waits(&self, t: Target) -> CallResult<()> {
        if self.client().ring().is_none() {
            return Ok(());
        }
        let waits: Vec<(u32, u64)> = {
            let st = self.st();
            let legacy = st.legacy.get(&t.ctx).copied().unwrap_or(0);
            if t.stream == DEFAULT_STREAM {
                let orphan = st.orphans.get(&t.ctx).copied().unwrap_or(0);
                let blocking = st.streams.values().filter(|s| s.ctx == t.ctx && s.blocking).map(|s| s.last);
                blocking.chain([orphan]).filter(|l| *l > 0 && !self.client().is_done(*l)).map(|l| (DEFAULT_STREAM, l)).collect()
            } else if st.streams.get(&t.stream).is_some_and(|s| s.blocking) && legacy > 0 && !self.client().is_done(legacy) {
                vec![(t.stream, legacy)]
            } else {
                Vec::new()
            }
        };
        for (stream, seq) in waits {
            self.client().enqueue(Request::StreamWait(StreamWaitReq { ctx: t.ctx, stream, seq }))?;
        }
        Ok(())
    }

    /// Records `seq` as the newest entry on `t`.
    fn note(&self, t: Target, seq: u64) {
        let mut st = self.st();
        if t.stream == DEFAULT_STREAM {
            let l = st.legacy.entry(t.ctx).or_insert(0);
            *l = (*l).max(seq);
        } else if let Some(s) = st.streams.get_mut(&t.stream) {
            s.last = s.last.max(seq);
        }
    }

    /// The entries a synchronisation of `t` waits for: the stream's newest,
    /// and for the legacy stream every blocking stream's too.
    fn sync_points(&self, t: Target) -> Vec<u64> {
        let st = self.st();
        if t.stream == DEFAULT_STREAM {
            let mut v: Vec<u64> = st.streams.values().filter(|s| s.ctx == t.ctx && s.blocking).map(|s| s.last).collect();
            v.push(st.legacy.get(&t.ctx).copied().unwrap_or(0));
            v.push(st.orphans.get(&t.ctx).copied().unwrap_or(0));
            v
        } else {
            st.streams.get(&t.stream).map(|s| vec![s.last]).unwrap_or_default()
        }
    }

    /// Waits for all of `points`, then reports any asynchronous error, or
    /// context `ctx`'s sticky one.
    fn wait_all(&self, ctx: u32, points: &[u64]) -> CallResult<()> {
        let mut first = None;
        for &p in points {
            if p > 0 {
                if let Err(e) = self.client().wait(p) {
                    first.get_or_insert(e);
                }
            }
        }
        match first {
            Some(e) => Err(e),
            None => self.client().check_async().and_then(|_| self.client().sticky(ctx)),
        }
    }

    /// Waits for every stream of context `ctx`.
    fn sync_ctx(&self, ctx: u32) -> CallResult<()> {
        let points: Vec<u64> = {
            let st = self.st();
            st.streams.values().filter(|s| s.ctx == ctx).map(|s| s.last).chain(st.legacy.get(&ctx).copied()).chain(st.orphans.get(&ctx).copied()).collect()
        };
        self.wait_all(ctx, &points)
    }

    /// Waits for every context's queued work (before host memory that
    /// copies may still use goes away).
    fn sync_all(&self) -> CallResult<()> {
        let ctxs = self.st().ctxs.clone();
        for c in ctxs {
            self.sync_ctx(c)?;
        }
        Ok(())
    }

    fn create_ctx(&self, flags: c_uint, dev: CUdevice) -> CallResult<u32> {
        self.device(dev)?;
        let req = || Request::CtxCreate(CtxCreateReq { flags, pid: std::process::id() });
        let idle = || self.st().ctxs.is_empty();
        let client = self.client();
        if client.is_lost() && idle() {
            self.reconnect(&client)?;
        }
        let client = self.client();
        let c = match client.handle(req()) {
            // Lost since, or ending after a fault (its device side cannot
            // make contexts any more): with no context left there is
            // nothing to keep, and the tenant's next executor serves this.
            Err(e) if (e.code == CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE || e.code.is_sticky()) && idle() => {
                if e.code.is_sticky() {
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
                    // (A call finds a lost connection where no ring shows it.)
                    while !client.is_lost() && client.device_info().is_ok() {
                        if std::time::Instant::now() > deadline {
                            return Err(e);
                        }
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                }
                self.reconnect(&client)?;
                self.client().handle(req())?
            }
            r => r?,
        };
        let mut st = self.st();
        st.ctxs.push(c);
        st.conf.insert(c, ctx::CtxConf::new(flags));
        Ok(c)
    }

    /// Forgets an unloaded module: its functions and its variables' ranges.
    fn forget_module(&self, id: u32) {
        let gone: Vec<(u64, Alloc)> = {
            let mut st = self.st();
            st.modules.remove(&id);
            st.funcs.retain(|_, f| f.module != id);
            let bases: Vec<u64> = st.allocs.iter().filter(|(_, a)| a.module == id).map(|(b, _)| *b).collect();
            bases.into_iter().filter_map(|b| st.allocs.remove(&b).map(|a| (b, a))).collect()
        };
        for (base, a) in gone {
            mem::unreserve(base, a);
        }
    }

    /// The device's primary context, made (unreferenced) if there is none.
    fn primary_ctx(&self, dev: CUdevice) -> CallResult<u32> {
        self.device(dev)?;
        if let Some(c) = self.st().primary {
            return Ok(c);
        }
        let flags = self.st().primary_flags;
        let c = self.create_ctx(flags, dev)?;
        let mut st = self.st();
        match st.primary {
            // Another thread made one meanwhile: use it, drop ours.
            Some(p) => {
                drop(st);
                let _ = self.destroy_ctx(c);
                Ok(p)
            }
            None => {
                st.primary = Some(c);
                Ok(c)
            }
        }
    }

    fn destroy_ctx(&self, c: u32) -> CallResult<()> {
        if !self.st().ctxs.contains(&c) {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "invalid context"));
        }
        // What the runtime stored in the context is destroyed with it
        // (while the context is still usable), and work queued in it
        // finishes first, as on CUDA.
        export::context_destroyed(c);
        let _ = self.sync_ctx(c);
        // Its memory is forgotten before the worker frees it (another
        // thread may be handed the same addresses at once).
        let gone: Vec<(u64, Alloc)> = {
            let mut st = self.st();
            let bases: Vec<u64> = st.allocs.iter().filter(|(_, a)| a.ctx == c).map(|(b, _)| *b).collect();
            bases.into_iter().filter_map(|b| st.allocs.remove(&b).map(|a| (b, a))).collect()
        };
        let r = self.client().empty(Request::CtxDestroy(CtxReq { ctx: c, reserved: 0 }));
        for (base, a) in gone {
            mem::unreserve(base, a);
        }
        let mut st = self.st();
        st.ctxs.retain(|x| *x != c);
        st.modules.retain(|_, m| m.ctx != c);
        st.funcs.retain(|_, f| f.ctx != c);
        st.streams.retain(|_, x| x.ctx != c);
        st.events.retain(|_, x| x.ctx != c);
        st.legacy.remove(&c);
        st.orphans.remove(&c);
        st.conf.remove(&c);
        ctx::forget_on_thread(c);
        self.client().forget(c);
        if st.primary == Some(c) {
            st.primary = None;
        }
        // Destroying the current context pops it, as on CUDA.
        if CURRENT.with(|cur| cur.get()) == c {
            ctx::pop_current();
        }
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
    let r = Client::from_env().and_then(|client| {
        let info = client.device_info()?;
        let attrs = client.device_attributes().unwrap_or_else(|_| virtio_gpu_compute::attrs::reference_table(&info));
        Ok(Shim { conn: std::sync::RwLock::new(Arc::new(client)), info, attrs, st: Mutex::new(State::default()), order: Mutex::new(()) })
    });
    match r {
        Ok(s) => {
            let s = Arc::new(s);
            let _ = READY.set(s.clone());
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

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: CUdevice) -> CUresult {
    with("cuDeviceGetAttribute", |s| {
        s.device(dev)?;
        let a = s.attribute(attr).ok_or_else(|| bad(&format!("unsupported device attribute {attr}")))?;
        if trace_calls_enabled() {
            eprintln!("libcuda(vgpu): attribute {attr} = {a}");
        }
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
        // The new context is pushed: cuCtxPopCurrent restores the last one.
        ctx::push_current(c)?;
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
        let live = c != 0 && s.st().ctxs.contains(&c);
        out(pctx, if live { enc(TAG_CTX, c) } else { std::ptr::null_mut() })
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: H) -> CUresult {
    with("cuCtxSetCurrent", |s| {
        // NULL pops the stack (a no-op on an empty one), as on CUDA.
        if ctx.is_null() {
            ctx::pop_current();
            return Ok(());
        }
        let c = dec(TAG_CTX, ctx).filter(|c| s.st().ctxs.contains(c)).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "invalid context"))?;
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

/// Waits for every stream of the current context; reports the first
/// asynchronous error since the last synchronising call.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    with("cuCtxSynchronize", |s| {
        let c = s.current()?;
        if s.client().ring().is_none() {
            return s.client().empty(Request::CtxSynchronize(CtxReq { ctx: c, reserved: 0 }));
        }
        s.sync_ctx(c)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut H, dev: CUdevice) -> CUresult {
    with("cuDevicePrimaryCtxRetain", |s| {
        if pctx.is_null() {
            return Err(bad("null context pointer"));
        }
        let c = s.primary_ctx(dev)?;
        s.st().primary_refs += 1;
        out(pctx, enc(TAG_CTX, c))
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    with("cuDevicePrimaryCtxRelease", |s| {
        s.device(dev)?;
        // The count and the decision to destroy change under one lock: a
        // retain racing with the last release gets a fresh context.
        let last = {
            let mut st = s.st();
            if st.primary_refs == 0 {
                return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "primary context is not retained"));
            }
            st.primary_refs -= 1;
            if st.primary_refs == 0 {
                st.primary.take()
            } else {
                None
            }
        };
        match last {
            Some(c) => s.destroy_ctx(c),
            None => Ok(()),
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
        out(dptr, alloc_device(s, ctx, size as u64)?)
    })
}

/// Allocates `size` bytes of device memory in `ctx`, charged to the quota.
fn alloc_device(s: &Shim, ctx: u32, size: u64) -> CallResult<u64> {
    match s.client().call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size }))? {
        Reply::Ptr(p) => {
            s.track(p, size, ctx, 0);
            Ok(p)
        }
        r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
    }
}

/// Frees device memory once the context's queued work is done, as CUDA's
/// cuMemFree synchronises.
#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    with("cuMemFree", |s| {
        // Freeing NULL is a no-op, as on CUDA.
        if dptr == 0 {
            return Ok(());
        }
        let ctx = s.current()?;
        free_device(s, ctx, dptr)
    })
}

/// Frees device memory of `ctx` once the context's queued work is done.
fn free_device(s: &Shim, ctx: u32, dptr: CUdeviceptr) -> CallResult<()> {
    s.sync_ctx(ctx)?;
    // Forgotten before the worker frees it: once freed, another thread
    // may be handed the same address.
    let gone = s.st().allocs.remove(&dptr);
    match s.client().empty(Request::MemFree(MemFreeReq { ctx, reserved: 0, dptr })) {
        Ok(()) => {
            if let Some(a) = gone {
                mem::unreserve(dptr, a);
            }
            pool::forget(dptr);
            Ok(())
        }
        Err(e) => {
            if let Some(a) = gone {
                s.st().allocs.insert(dptr, a);
            }
            Err(e)
        }
    }
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
        match s.client().call(Request::MemGetInfo)? {
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

/// Pinned host memory, shared with the device worker: copies from and to
/// it are one copy by the worker, and asynchronous ones return at once.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) -> CUresult {
    with("cuMemAllocHost", |s| {
        if pp.is_null() {
            return Err(bad("null pointer"));
        }
        if size == 0 {
            return Err(bad("size is 0"));
        }
        s.current()?;
        out(pp, s.client().alloc_pinned(size)?.cast())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost(pp: *mut *mut c_void, size: c_uint) -> CUresult {
    // SAFETY: same contract as cuMemAllocHost_v2.
    unsafe { cuMemAllocHost_v2(pp, size as usize) }
}

const CU_MEMHOSTALLOC_KNOWN: c_uint = 0x1 | 0x2 | 0x4;

/// Flags PORTABLE (1) and WRITECOMBINED (4) change nothing here; DEVICEMAP
/// (2) is refused: kernels cannot reach host memory on this device.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) -> CUresult {
    if flags & !CU_MEMHOSTALLOC_KNOWN != 0 {
        return fail("cuMemHostAlloc", bad("unknown flags"));
    }
    if flags & 0x2 != 0 {
        return fail("cuMemHostAlloc", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "mapped pinned memory (CU_MEMHOSTALLOC_DEVICEMAP) is unsupported on this device"));
    }
    // SAFETY: same contract as cuMemAllocHost_v2.
    unsafe { cuMemAllocHost_v2(pp, size) }
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    with("cuMemFreeHost", |s| {
        s.sync_all()?;
        if !s.client().free_pinned(p.cast())? {
            return Err(bad("not a pointer returned by cuMemAllocHost or cuMemHostAlloc"));
        }
        Ok(())
    })
}

const CU_MEMHOSTREGISTER_KNOWN: c_uint = 0x1 | 0x2 | 0x4 | 0x8;

/// Page-locks a range of the process's memory: here, its pages are
/// re-backed in place by memory shared with the device worker (the
/// contents and addresses stay), so copies from and to it are one copy by
/// the worker. DEVICEMAP and IOMEMORY are refused. The range must not be
/// used by other threads while it is being registered or unregistered.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, flags: c_uint) -> CUresult {
    with("cuMemHostRegister", |s| {
        if p.is_null() || bytes == 0 || flags & !CU_MEMHOSTREGISTER_KNOWN != 0 {
            return Err(bad("null pointer, zero size or unknown flags"));
        }
        if flags & (0x2 | 0x4) != 0 {
            return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "mapped and I/O registrations are unsupported on this device"));
        }
        s.current()?;
        s.client().register_host(p.cast(), bytes)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister(p: *mut c_void, bytes: usize, flags: c_uint) -> CUresult {
    // SAFETY: same contract as cuMemHostRegister_v2.
    unsafe { cuMemHostRegister_v2(p, bytes, flags) }
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    with("cuMemHostUnregister", |s| {
        s.sync_all()?;
        s.client().unregister_host(p.cast())
    })
}

/// A copy between host memory and the device. Asynchronous forms return
/// once the work is queued (from pageable memory, once it is staged); a
/// device-to-pageable copy always completes first, as on CUDA.
#[allow(clippy::too_many_arguments)]
fn host_copy(api: &str, to_device: bool, dev: CUdeviceptr, host: *mut c_void, n: usize, stream: H, sync: bool, default: Default) -> CUresult {
    with(api, |s| {
        let t = s.target(stream, default)?;
        if n == 0 {
            return Ok(());
        }
        if host.is_null() {
            return Err(bad("null host pointer"));
        }
        let node = || if to_device { graph::Node::HtoD { dst: dev, host: host as usize, n } } else { graph::Node::DtoH { host: host as usize, src: dev, n } };
        if graph::record(t, node)? {
            return Ok(());
        }
        s.client().check_async()?;
        s.client().sticky(t.ctx)?;
        // Ordered after what CUDA's stream semantics order it after.
        let _order = s.order.lock().unwrap_or_else(|e| e.into_inner());
        s.enqueue_waits(t)?;
        let last = if to_device {
            // SAFETY: the caller provides `n` readable bytes at `host`.
            let data = unsafe { std::slice::from_raw_parts(host.cast::<u8>(), n) };
            s.client().htod(t.ctx, t.stream, dev, data)?
        } else {
            // SAFETY: the caller provides `n` writable bytes at `host`.
            let data = unsafe { std::slice::from_raw_parts_mut(host.cast::<u8>(), n) };
            s.client().dtoh(t.ctx, t.stream, data, dev)?
        };
        s.note(t, last);
        if sync {
            s.client().wait(last)
        } else {
            Ok(())
        }
    })
}

fn dtod(api: &str, dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: H, sync: bool, default: Default) -> CUresult {
    with(api, |s| {
        let t = s.target(stream, default)?;
        if graph::record(t, || graph::Node::DtoD { dst, src, n })? {
            return Ok(());
        }
        let seq = s.enqueue(t, Request::MemcpyDtoD(MemcpyDtoDReq { ctx: t.ctx, stream: t.stream, dst, src, size: n as u64 }))?;
        if sync {
            s.client().wait(seq)
        } else {
            Ok(())
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    host_copy("cuMemcpyHtoD", true, dst, src.cast_mut(), n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    host_copy("cuMemcpyHtoD", true, dst, src.cast_mut(), n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, stream: H) -> CUresult {
    host_copy("cuMemcpyHtoDAsync", true, dst, src.cast_mut(), n, stream, false, Default::Legacy)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, stream: H) -> CUresult {
    host_copy("cuMemcpyHtoDAsync", true, dst, src.cast_mut(), n, stream, false, Default::PerThread)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    host_copy("cuMemcpyDtoH", false, src, dst, n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    host_copy("cuMemcpyDtoH", false, src, dst, n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    host_copy("cuMemcpyDtoHAsync", false, src, dst, n, stream, false, Default::Legacy)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    host_copy("cuMemcpyDtoHAsync", false, src, dst, n, stream, false, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    dtod("cuMemcpyDtoD", dst, src, n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    dtod("cuMemcpyDtoD", dst, src, n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    dtod("cuMemcpyDtoDAsync", dst, src, n, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    dtod("cuMemcpyDtoDAsync", dst, src, n, stream, false, Default::PerThread)
}

/// A memset: synchronous forms wait for it (CUDA's are asynchronous with
/// respect to the host for device memory; waiting is also allowed).
#[allow(clippy::too_many_arguments)]
fn memset(api: &str, dst: CUdeviceptr, value: u32, elem: u32, count: usize, stream: H, sync: bool, default: Default) -> CUresult {
    with(api, |s| {
        let t = s.target(stream, default)?;
        if count == 0 {
            return Ok(());
        }
        if graph::record(t, || graph::Node::Memset { dptr: dst, value, elem, count })? {
            return Ok(());
        }
        let seq = s.enqueue(t, Request::Memset(MemsetReq { ctx: t.ctx, stream: t.stream, dptr: dst, value, elem_size: elem, count: count as u64 }))?;
        if sync {
            s.client().wait(seq)
        } else {
            Ok(())
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    memset("cuMemsetD8", dst, v as u32, 1, n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    memset("cuMemsetD8", dst, v as u32, 1, n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, v: c_uint, n: usize) -> CUresult {
    memset("cuMemsetD32", dst, v, 4, n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: c_uint, n: usize) -> CUresult {
    memset("cuMemsetD32", dst, v, 4, n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD8Async", dst, v as u32, 1, n, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD8Async", dst, v as u32, 1, n, stream, false, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemsetD32Async(dst: CUdeviceptr, v: c_uint, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD32Async", dst, v, 4, n, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: c_uint, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD32Async", dst, v, 4, n, stream, false, Default::PerThread)
}

// ---- modules and launches ---------------------------------------------------

/// Finds the length of a module image given only its start, as the driver
/// does: PTX is NUL-terminated text, a cubin is an ELF file whose tables
/// bound it, a fatbin states its size in its header.
/// The largest image accepted from the application; fatbins are trimmed
/// to the device's entries before they travel (within MAX_IMAGE).
const MAX_FATBIN: u64 = 1 << 30;

unsafe fn image_bytes<'a>(image: *const c_void) -> CallResult<&'a [u8]> {
    if image.is_null() {
        return Err(bad("null module image"));
    }
    let mut p = image.cast::<u8>();
    // SAFETY: every image format starts with at least 16 readable bytes
    // except PTX text, which is NUL-terminated; we only read 4 to classify.
    let mut head = unsafe { std::slice::from_raw_parts(p, 4) };
    if u32::from_le_bytes([head[0], head[1], head[2], head[3]]) == fatbin::WRAPPER_MAGIC {
        // The `fatbinc` wrapper a host program embeds: { magic, version,
        // pointer to the fatbin, ... }.
        // SAFETY: the wrapper is 24 bytes; its data pointer is at 8.
        let data = unsafe { p.add(8).cast::<*const u8>().read_unaligned() };
        if data.is_null() {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, "fatbin wrapper without data"));
        }
        p = data;
        // SAFETY: as above, for the wrapped image.
        head = unsafe { std::slice::from_raw_parts(p, 4) };
    }
    let len = if head == b"\x7fELF" {
        // SAFETY: an ELF64 header is 64 bytes.
        let h = unsafe { std::slice::from_raw_parts(p, 64) };
        let u64at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or([0; 8]));
        let u16at = |o: usize| u16::from_le_bytes([h[o], h[o + 1]]) as u64;
        let sh_end = u64at(0x28).saturating_add(u16at(0x3A) * u16at(0x3C));
        let ph_end = u64at(0x20).saturating_add(u16at(0x36) * u16at(0x38));
        let n = sh_end.max(ph_end).max(64);
        // Only fatbins may exceed the message limit (they are trimmed).
        if n > MAX_IMAGE {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, format!("cubin of {n} bytes exceeds {MAX_IMAGE}")));
        }
        n
    } else if u32::from_le_bytes([head[0], head[1], head[2], head[3]]) == fatbin::FATBIN_MAGIC {
        // SAFETY: a fatbin header is 16 bytes: magic, version, header size, body size.
        let h = unsafe { std::slice::from_raw_parts(p, 16) };
        fatbin::total_len(h).map_err(|e| CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, e.to_string()))?
    } else {
        // SAFETY: PTX images are NUL-terminated strings.
        let n = unsafe { CStr::from_ptr(p.cast()) }.to_bytes().len() as u64;
        if n > MAX_IMAGE {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, format!("PTX of {n} bytes exceeds {MAX_IMAGE}")));
        }
        n
    };
    if len == 0 || len > MAX_FATBIN {
        return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, format!("module image of {len} bytes")));
    }
    // SAFETY: the image format bounds the image to `len` readable bytes.
    Ok(unsafe { std::slice::from_raw_parts(p, len as usize) })
}

/// Loads a module image into context `ctx`; returns the module's id.
fn load_image(s: &Shim, ctx: u32, bytes: &[u8]) -> CallResult<u32> {
    // A fatbin travels as only what this device can use (runtimes embed
    // fatbins of tens of MiB with code for every architecture).
    let selected;
    let bytes = if ImageFormat::sniff(bytes) == ImageFormat::Fatbin {
        selected = select_for(s, bytes)?;
        &selected[..]
    } else {
        bytes
    };
    let format = ImageFormat::sniff(bytes);
    let entries = Arc::new(entry_names(bytes));
    let id = s.client().handle(Request::ModuleLoad(ModuleLoadReq { ctx, format: format as u32, image_len: bytes.len() as u64 }, bytes.to_vec()))?;
    let arch = code_arch(bytes).unwrap_or(s.info.cc_major * 10 + s.info.cc_minor);
    s.st().modules.insert(id, ModInfo { ctx, entries, arch });
    Ok(id)
}

/// A fatbin trimmed to what this device can use (its cubins for the exact
/// architecture and its best PTX); an error if nothing suits it.
fn select_for(s: &Shim, bytes: &[u8]) -> CallResult<Vec<u8>> {
    let arch = s.info.cc_major * 10 + s.info.cc_minor;
    let sel = fatbin::select(bytes, arch).map_err(|e| CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, e.to_string()))?;
    sel.ok_or_else(|| {
        let archs = fatbin::ptx_archs(bytes).unwrap_or_default();
        CallError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, format!("the fatbin has no code for sm_{arch} (PTX for {archs:?})"))
    })
}

/// The architecture an image's code targets: a PTX's `.target sm_XY`, a
/// fatbin's PTX entry (as the device would choose it), a cubin's none.
fn code_arch(bytes: &[u8]) -> Option<u32> {
    match ImageFormat::sniff(bytes) {
        ImageFormat::Ptx => {
            let head = &bytes[..bytes.len().min(64 << 10)];
            let text = String::from_utf8_lossy(head);
            let line = text.lines().find(|l| l.trim_start().starts_with(".target"))?;
            Some(crate::ptxlink::target_arch(line)).filter(|a| *a > 0)
        }
        ImageFormat::Fatbin => fatbin::entries(bytes).ok()?.iter().filter(|e| e.kind == fatbin::Kind::Ptx).map(|e| e.arch).max(),
        ImageFormat::Cubin => None,
    }
}

/// The kernels (`.entry` names) of an image: of its PTX, or of the PTX a
/// fatbin carries.
fn entry_names(bytes: &[u8]) -> Vec<String> {
    let text: std::borrow::Cow<'_, [u8]> = match ImageFormat::sniff(bytes) {
        ImageFormat::Ptx => bytes.into(),
        ImageFormat::Fatbin => match fatbin::best_ptx(bytes, u32::MAX) {
            Ok(Some(p)) => p.into(),
            _ => return Vec::new(),
        },
        ImageFormat::Cubin => return Vec::new(),
    };
    let text = String::from_utf8_lossy(&text);
    let mut names = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace().skip_while(|w| *w != ".entry");
        if words.next().is_some() {
            if let Some(w) = words.next() {
                let name: String = w.chars().take_while(|c| c.is_alphanumeric() || matches!(c, '_' | '$' | '.')).collect();
                if !name.is_empty() {
                    names.push(name);
                }
            }
        }
    }
    names
}

fn load_module(s: &Shim, m: *mut H, image: *const c_void) -> CallResult<()> {
    if m.is_null() {
        return Err(bad("null module pointer"));
    }
    let ctx = s.current()?;
    // SAFETY: per the API contract `image` points at a module image.
    let bytes = unsafe { image_bytes(image)? };
    let id = load_image(s, ctx, bytes)?;
    out(m, enc(TAG_MOD, id))
}

/// Looks up kernel `name` in module `module` of context `ctx`.
fn get_function(s: &Shim, ctx: u32, module: u32, name: &str) -> CallResult<u32> {
    let req = Request::ModuleGetFunction(GetFunctionReq { ctx, module, name_len: name.len() as u32, reserved: 0 }, name.to_string());
    match s.client().call(req)? {
        Reply::Function(fr, params) => {
            let conf = Mutex::new(library::FuncConf::new(&s.info));
            let arch = s.st().modules.get(&module).map_or(0, |m| m.arch);
            let name = std::ffi::CString::new(name).map_err(|_| bad("function name contains NUL"))?;
            s.st().funcs.insert(fr.func, Arc::new(Func { ctx, module, name, params, size: fr.params_size, conf, arch }));
            Ok(fr.func)
        }
        r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
    }
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
        let id = dec(TAG_MOD, m).ok_or_else(|| invalid_handle("module"))?;
        let ctx = s.st().modules.get(&id).map(|m| m.ctx).ok_or_else(|| invalid_handle("module"))?;
        // Launches queued from it run first.
        s.sync_ctx(ctx)?;
        s.client().empty(Request::ModuleUnload(ModuleReq { ctx, module: id }))?;
        s.forget_module(id);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut H, m: H, name: *const c_char) -> CUresult {
    with("cuModuleGetFunction", |s| {
        if f.is_null() || name.is_null() {
            return Err(bad("null pointer"));
        }
        let id = dec(TAG_MOD, m).ok_or_else(|| invalid_handle("module"))?;
        let ctx = s.st().modules.get(&id).map(|m| m.ctx).ok_or_else(|| invalid_handle("module"))?;
        // SAFETY: per the API contract `name` is a NUL-terminated string.
        let n = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| bad("function name is not UTF-8"))?;
        let func = get_function(s, ctx, id, n)?;
        out(f, enc(TAG_FUNC, func))
    })
}

/// A module variable's device address and size; either output may be null.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetGlobal_v2(dptr: *mut u64, bytes: *mut usize, m: H, name: *const c_char) -> CUresult {
    with("cuModuleGetGlobal", |s| {
        if name.is_null() {
            return Err(bad("null name"));
        }
        let id = dec(TAG_MOD, m).ok_or_else(|| invalid_handle("module"))?;
        let ctx = s.st().modules.get(&id).map(|m| m.ctx).ok_or_else(|| invalid_handle("module"))?;
        // SAFETY: per the API contract `name` is a NUL-terminated string.
        let n = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| bad("variable name is not UTF-8"))?;
        let (addr, size) = get_global(s, ctx, id, n)?;
        if !dptr.is_null() {
            out(dptr, addr)?;
        }
        if !bytes.is_null() {
            out(bytes, size as usize)?;
        }
        Ok(())
    })
}

/// A module variable's device address and size.
fn get_global(s: &Shim, ctx: u32, module: u32, name: &str) -> CallResult<(u64, u64)> {
    let req = Request::ModuleGetGlobal(GetFunctionReq { ctx, module, name_len: name.len() as u32, reserved: 0 }, name.to_string());
    match s.client().call(req)? {
        Reply::Global(addr, size) => {
            // Device memory like any other, for unified-address copies.
            if size > 0 && !s.is_tracked(addr) {
                s.track(addr, size, ctx, module);
            }
            Ok((addr, size))
        }
        r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
    }
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

/// Enqueues a launch and returns: the kernel runs on its stream, in order,
/// and its errors surface at the next synchronising call.
#[allow(clippy::too_many_arguments)]
unsafe fn launch(f: H, grid: [c_uint; 3], block: [c_uint; 3], shared: c_uint, stream: H, params: *mut *mut c_void, extra: *mut *mut c_void, default: Default) -> CUresult {
    with("cuLaunchKernel", |s| {
        let fid = s.func_id(f)?;
        let func = s.st().funcs.get(&fid).cloned().ok_or_else(|| invalid_handle("function"))?;
        let ctx = s.current()?;
        if ctx != func.ctx {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "function belongs to another context"));
        }
        if grid.contains(&0) || block.contains(&0) {
            return Err(bad("grid and block dimensions must be non-zero"));
        }
        let t = s.target(stream, default)?;
        if t.ctx != ctx {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "stream belongs to another context"));
        }
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
        let req = LaunchReq { ctx, func: fid, stream: t.stream, shared_bytes: shared, grid, block, params_len: buf.len() as u32, reserved: 0 };
        if graph::record(t, || graph::Node::Launch { req, params: buf.clone() })? {
            return Ok(());
        }
        s.enqueue(t, Request::LaunchKernel(req, buf)).map(|_| ())
    })
}

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
    // SAFETY: the caller's arguments follow cuLaunchKernel's contract.
    unsafe { launch(f, [gx, gy, gz], [bx, by, bz], shared, stream, params, extra, Default::Legacy) }
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
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
    // SAFETY: the caller's arguments follow cuLaunchKernel's contract.
    unsafe { launch(f, [gx, gy, gz], [bx, by, bz], shared, stream, params, extra, Default::PerThread) }
}

// ---- streams and events -----------------------------------------------------

const CU_STREAM_NON_BLOCKING: c_uint = 1;

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(p: *mut H, flags: c_uint) -> CUresult {
    with("cuStreamCreate", |s| create_stream(s, p, flags, 0))
}

fn create_stream(s: &Shim, p: *mut H, flags: c_uint, priority: c_int) -> CallResult<()> {
    if p.is_null() || flags > 1 {
        return Err(bad("null pointer or unknown stream flags"));
    }
    let ctx = s.current()?;
    let id = s.client().handle(Request::StreamCreate(ObjCreateReq { ctx, flags }))?;
    // Out-of-range priorities are clamped, as on CUDA.
    let priority = priority.clamp(ctx::PRIORITY_GREATEST, ctx::PRIORITY_LEAST);
    s.st().streams.insert(id, StreamInfo { ctx, blocking: flags & CU_STREAM_NON_BLOCKING == 0, last: 0, flags, priority });
    out(p, enc(TAG_STREAM, id))
}

/// Priorities are recorded and reported back; the device does not yet
/// schedule by them (every stream of a tenant is served alike).
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(p: *mut H, flags: c_uint, priority: c_int) -> CUresult {
    with("cuStreamCreateWithPriority", |s| create_stream(s, p, flags, priority))
}

/// Returns at once; work queued on the stream still runs (as on CUDA).
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(h: H) -> CUresult {
    with("cuStreamDestroy", |s| {
        let id = dec(TAG_STREAM, h).ok_or_else(|| invalid_handle("stream"))?;
        let ctx = s.st().streams.get(&id).map(|x| x.ctx).ok_or_else(|| invalid_handle("stream"))?;
        s.client().empty(Request::StreamDestroy(HandleReq { ctx, handle: id }))?;
        let mut st = s.st();
        if let Some(gone) = st.streams.remove(&id) {
            let o = st.orphans.entry(ctx).or_insert(0);
            *o = (*o).max(gone.last);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy(h: H) -> CUresult {
    cuStreamDestroy_v2(h)
}

fn stream_sync(h: H, default: Default) -> CUresult {
    with("cuStreamSynchronize", |s| {
        let t = s.target(h, default)?;
        graph::refuse_if_capturing(t)?;
        if s.client().ring().is_none() {
            return s.client().empty(Request::StreamSynchronize(HandleReq { ctx: t.ctx, handle: t.stream }));
        }
        let points = s.sync_points(t);
        s.wait_all(t.ctx, &points)
    })
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(h: H) -> CUresult {
    stream_sync(h, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize_ptsz(h: H) -> CUresult {
    stream_sync(h, Default::PerThread)
}

fn stream_query(h: H, default: Default) -> CUresult {
    with("cuStreamQuery", |s| {
        let t = s.target(h, default)?;
        graph::refuse_if_capturing(t)?;
        if s.sync_points(t).iter().all(|p| s.client().is_done(*p)) {
            s.client().check_async()
        } else {
            Err(CallError::new(CuResult::CUDA_ERROR_NOT_READY, "work is still queued on the stream"))
        }
    })
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(h: H) -> CUresult {
    stream_query(h, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuStreamQuery_ptsz(h: H) -> CUresult {
    stream_query(h, Default::PerThread)
}

/// Work queued on `h` after this waits for the event's newest record.
fn stream_wait_event(h: H, e: H, flags: c_uint, default: Default) -> CUresult {
    with("cuStreamWaitEvent", |s| {
        if flags & !1 != 0 {
            return Err(bad("unknown flags"));
        }
        let t = s.target(h, default)?;
        let (_, ev) = s.event(e)?;
        // A capturing stream's work is a chain: nothing to wait for in it.
        if graph::capturing(t) {
            return Ok(());
        }
        let Some(seq) = s.st().events.get(&ev).and_then(|e| e.recorded) else { return Ok(()) };
        if s.client().is_done(seq) {
            return Ok(());
        }
        if s.client().ring().is_none() {
            return Ok(());
        }
        let _order = s.order.lock().unwrap_or_else(|e| e.into_inner());
        let w = s.client().enqueue(Request::StreamWait(StreamWaitReq { ctx: t.ctx, stream: t.stream, seq }))?;
        s.note(t, w);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(h: H, e: H, flags: c_uint) -> CUresult {
    stream_wait_event(h, e, flags, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent_ptsz(h: H, e: H, flags: c_uint) -> CUresult {
    stream_wait_event(h, e, flags, Default::PerThread)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(p: *mut H, flags: c_uint) -> CUresult {
    with("cuEventCreate", |s| {
        if p.is_null() || flags > 0xF {
            return Err(bad("null pointer or unknown event flags"));
        }
        let ctx = s.current()?;
        let id = s.client().handle(Request::EventCreate(ObjCreateReq { ctx, flags }))?;
        s.st().events.insert(id, EventInfo { ctx, recorded: None });
        out(p, enc(TAG_EVENT, id))
    })
}

fn event_record(e: H, stream: H, default: Default) -> CUresult {
    with("cuEventRecord", |s| {
        let (ctx, ev) = s.event(e)?;
        let t = s.target(stream, default)?;
        if t.ctx != ctx {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "event and stream belong to different contexts"));
        }
        if graph::record(t, || graph::Node::Record { event: e })? {
            return Ok(());
        }
        let seq = s.enqueue(t, Request::EventRecord(EventRecordReq { ctx, event: ev, stream: t.stream, reserved: 0 }))?;
        if let Some(x) = s.st().events.get_mut(&ev) {
            x.recorded = Some(seq);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecord(e: H, stream: H) -> CUresult {
    event_record(e, stream, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuEventRecord_ptsz(e: H, stream: H) -> CUresult {
    event_record(e, stream, Default::PerThread)
}

#[no_mangle]
pub extern "C" fn cuEventQuery(e: H) -> CUresult {
    with("cuEventQuery", |s| {
        let (_, ev) = s.event(e)?;
        match s.st().events.get(&ev).and_then(|e| e.recorded) {
            Some(seq) if !s.client().is_done(seq) => Err(CallError::new(CuResult::CUDA_ERROR_NOT_READY, "the event's work is not done")),
            _ => Ok(()),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(e: H) -> CUresult {
    with("cuEventSynchronize", |s| {
        let (ctx, ev) = s.event(e)?;
        if s.client().ring().is_none() {
            return s.client().empty(Request::EventSynchronize(HandleReq { ctx, handle: ev }));
        }
        let seq = s.st().events.get(&ev).and_then(|e| e.recorded).unwrap_or(0);
        s.wait_all(ctx, &[seq])
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: H, end: H) -> CUresult {
    with("cuEventElapsedTime", |s| {
        let (ctx, a) = s.event(start)?;
        let (_, b) = s.event(end)?;
        for ev in [a, b] {
            match s.st().events.get(&ev).and_then(|e| e.recorded) {
                None => return Err(invalid_handle("event: it was never recorded")),
                Some(seq) if !s.client().is_done(seq) => return Err(CallError::new(CuResult::CUDA_ERROR_NOT_READY, "an event's work is not done")),
                _ => {}
            }
        }
        match s.client().call(Request::EventElapsedTime(EventElapsedReq { ctx, start: a, end: b, reserved: 0 }))? {
            Reply::Elapsed(v) => out(ms, v),
            r => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(e: H) -> CUresult {
    with("cuEventDestroy", |s| {
        let (ctx, ev) = s.event(e)?;
        s.client().empty(Request::EventDestroy(HandleReq { ctx, handle: ev }))?;
        s.st().events.remove(&ev);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy(e: H) -> CUresult {
    cuEventDestroy_v2(e)
}

/// Extension (not CUDA): what this process's connection cost the transport
/// so far: messages (socket messages or virtio-gpu SUBMIT_3D commands, as
/// the device counted them), ring entries the device consumed, and wake-ups.
#[no_mangle]
pub unsafe extern "C" fn vgpuGetConnectionStats(messages: *mut u64, ring_entries: *mut u64, kicks: *mut u64) -> CUresult {
    with("vgpuGetConnectionStats", |s| {
        let c = s.client().conn_stats()?;
        out(messages, c.messages)?;
        out(ring_entries, c.ring_entries)?;
        out(kicks, c.kicks)
    })
}

// ---- cuGetProcAddress -------------------------------------------------------

/// The exported function for a base name at a given API version, as the
/// driver's own table resolves them.
pub fn proc_address(symbol: &str, version: c_int, per_thread: bool) -> Option<*mut c_void> {
    macro_rules! f {
        ($f:expr) => {
            Some($f as *const () as *mut c_void)
        };
    }
    // The per-thread default stream variants, asked for by name or by
    // CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM.
    let pt = per_thread || symbol.ends_with("_ptsz") || symbol.ends_with("_ptds");
    let base = symbol.trim_end_matches("_ptsz").trim_end_matches("_ptds");
    let v2 = version >= 3020;
    if pt {
        let found = match base {
            "cuMemcpyHtoD" if v2 => f!(cuMemcpyHtoD_v2_ptds),
            "cuMemcpyDtoH" if v2 => f!(cuMemcpyDtoH_v2_ptds),
            "cuMemcpyDtoD" if v2 => f!(cuMemcpyDtoD_v2_ptds),
            "cuMemcpyHtoDAsync" if v2 => f!(cuMemcpyHtoDAsync_v2_ptsz),
            "cuMemcpyDtoHAsync" if v2 => f!(cuMemcpyDtoHAsync_v2_ptsz),
            "cuMemcpyDtoDAsync" if v2 => f!(cuMemcpyDtoDAsync_v2_ptsz),
            "cuMemsetD8" if v2 => f!(cuMemsetD8_v2_ptds),
            "cuMemsetD32" if v2 => f!(cuMemsetD32_v2_ptds),
            "cuMemsetD8Async" => f!(cuMemsetD8Async_ptsz),
            "cuMemsetD32Async" => f!(cuMemsetD32Async_ptsz),
            "cuLaunchKernel" => f!(cuLaunchKernel_ptsz),
            "cuStreamSynchronize" => f!(cuStreamSynchronize_ptsz),
            "cuStreamQuery" => f!(cuStreamQuery_ptsz),
            "cuStreamWaitEvent" => f!(cuStreamWaitEvent_ptsz),
            "cuEventRecord" => f!(cuEventRecord_ptsz),
            "cuMemcpy" => f!(mem::cuMemcpy_ptds),
            "cuMemcpyAsync" => f!(mem::cuMemcpyAsync_ptsz),
            "cuMemcpyPeer" => f!(mem::cuMemcpyPeer_ptds),
            "cuMemcpyPeerAsync" => f!(mem::cuMemcpyPeerAsync_ptsz),
            "cuMemcpy2D" if v2 => f!(mem::cuMemcpy2D_v2_ptds),
            "cuMemcpy2DUnaligned" if v2 => f!(mem::cuMemcpy2DUnaligned_v2_ptds),
            "cuMemcpy2DAsync" if v2 => f!(mem::cuMemcpy2DAsync_v2_ptsz),
            "cuMemcpy3D" if v2 => f!(mem::cuMemcpy3D_v2_ptds),
            "cuMemcpy3DAsync" if v2 => f!(mem::cuMemcpy3DAsync_v2_ptsz),
            "cuMemsetD16" if v2 => f!(mem::cuMemsetD16_v2_ptds),
            "cuMemsetD16Async" => f!(mem::cuMemsetD16Async_ptsz),
            "cuMemsetD2D8" if v2 => f!(mem::cuMemsetD2D8_v2_ptds),
            "cuMemsetD2D16" if v2 => f!(mem::cuMemsetD2D16_v2_ptds),
            "cuMemsetD2D32" if v2 => f!(mem::cuMemsetD2D32_v2_ptds),
            "cuMemsetD2D8Async" => f!(mem::cuMemsetD2D8Async_ptsz),
            "cuMemsetD2D16Async" => f!(mem::cuMemsetD2D16Async_ptsz),
            "cuMemsetD2D32Async" => f!(mem::cuMemsetD2D32Async_ptsz),
            "cuLaunchKernelEx" => f!(library::cuLaunchKernelEx_ptsz),
            "cuLaunchCooperativeKernel" => f!(library::cuLaunchCooperativeKernel_ptsz),
            "cuLaunchHostFunc" => f!(library::cuLaunchHostFunc_ptsz),
            "cuStreamAddCallback" => f!(library::cuStreamAddCallback_ptsz),
            "cuStreamGetFlags" => f!(library::cuStreamGetFlags_ptsz),
            "cuStreamGetPriority" => f!(library::cuStreamGetPriority_ptsz),
            "cuStreamGetCtx" if version >= 12050 => f!(library::cuStreamGetCtx_v2_ptsz),
            "cuStreamGetCtx" => f!(library::cuStreamGetCtx_ptsz),
            "cuStreamGetId" => f!(library::cuStreamGetId_ptsz),
            "cuStreamGetDevice" => f!(library::cuStreamGetDevice_ptsz),
            "cuStreamIsCapturing" => f!(library::cuStreamIsCapturing_ptsz),
            "cuStreamGetCaptureInfo" if version >= 12030 => f!(library::cuStreamGetCaptureInfo_v3_ptsz),
            "cuStreamGetCaptureInfo" if version >= 11030 => f!(library::cuStreamGetCaptureInfo_v2_ptsz),
            "cuStreamGetCaptureInfo" => f!(library::cuStreamGetCaptureInfo_ptsz),
            "cuStreamBeginCapture" => f!(graph::cuStreamBeginCapture_v2_ptsz),
            "cuStreamEndCapture" => f!(graph::cuStreamEndCapture_ptsz),
            "cuGraphLaunch" => f!(graph::cuGraphLaunch_ptsz),
            "cuGraphUpload" => f!(graph::cuGraphUpload_ptsz),
            "cuEventRecordWithFlags" => f!(library::cuEventRecordWithFlags_ptsz),
            "cuMemAllocAsync" => f!(pool::cuMemAllocAsync_ptsz),
            "cuMemAllocFromPoolAsync" => f!(pool::cuMemAllocFromPoolAsync_ptsz),
            "cuMemFreeAsync" => f!(pool::cuMemFreeAsync_ptsz),
            _ => None,
        };
        if found.is_some() {
            return found;
        }
    }
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
        "cuDeviceTotalMem" => {
            if v2 {
                f!(cuDeviceTotalMem_v2)
            } else {
                f!(cuDeviceTotalMem)
            }
        }
        "cuDeviceGetUuid" => {
            if version >= 11040 {
                f!(cuDeviceGetUuid_v2)
            } else {
                f!(cuDeviceGetUuid)
            }
        }
        "cuCtxCreate" => {
            if version >= 13000 {
                f!(cuCtxCreate_v4)
            } else if version >= 11040 {
                f!(cuCtxCreate_v3)
            } else {
                f!(cuCtxCreate_v2)
            }
        }
        "cuCtxDestroy" => {
            if v4000 {
                f!(cuCtxDestroy_v2)
            } else {
                f!(cuCtxDestroy)
            }
        }
        "cuCtxGetCurrent" => f!(cuCtxGetCurrent),
        "cuCtxSetCurrent" => f!(cuCtxSetCurrent),
        "cuCtxGetDevice" => f!(cuCtxGetDevice),
        "cuCtxSynchronize" => f!(cuCtxSynchronize),
        "cuDevicePrimaryCtxRetain" => f!(cuDevicePrimaryCtxRetain),
        "cuDevicePrimaryCtxRelease" => {
            if version >= 11000 {
                f!(cuDevicePrimaryCtxRelease_v2)
            } else {
                f!(cuDevicePrimaryCtxRelease)
            }
        }
        "cuMemAlloc" => {
            if v2 {
                f!(cuMemAlloc_v2)
            } else {
                f!(cuMemAlloc)
            }
        }
        "cuMemFree" => {
            if v2 {
                f!(cuMemFree_v2)
            } else {
                f!(cuMemFree)
            }
        }
        "cuMemGetInfo" => {
            if v2 {
                f!(cuMemGetInfo_v2)
            } else {
                f!(cuMemGetInfo)
            }
        }
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
        "cuModuleGetGlobal" => {
            if v2 {
                f!(cuModuleGetGlobal_v2)
            } else {
                f!(cuModuleGetGlobal)
            }
        }
        "cuModuleUnload" => f!(cuModuleUnload),
        "cuLaunchKernel" => f!(cuLaunchKernel),
        "cuStreamCreate" => f!(cuStreamCreate),
        "cuStreamDestroy" => {
            if v4000 {
                f!(cuStreamDestroy_v2)
            } else {
                f!(cuStreamDestroy)
            }
        }
        "cuStreamSynchronize" => f!(cuStreamSynchronize),
        "cuStreamQuery" => f!(cuStreamQuery),
        "cuStreamWaitEvent" => f!(cuStreamWaitEvent),
        "cuStreamCreateWithPriority" => f!(cuStreamCreateWithPriority),
        "cuEventQuery" => f!(cuEventQuery),
        "cuMemAllocHost" => {
            if v2 {
                f!(cuMemAllocHost_v2)
            } else {
                f!(cuMemAllocHost)
            }
        }
        "cuMemHostAlloc" => f!(cuMemHostAlloc),
        "cuMemFreeHost" => f!(cuMemFreeHost),
        "cuMemHostRegister" => {
            if version >= 6050 {
                f!(cuMemHostRegister_v2)
            } else {
                f!(cuMemHostRegister)
            }
        }
        "cuMemHostUnregister" => f!(cuMemHostUnregister),
        "cuEventCreate" => f!(cuEventCreate),
        "cuEventRecord" => f!(cuEventRecord),
        "cuEventSynchronize" => f!(cuEventSynchronize),
        "cuEventElapsedTime" => f!(cuEventElapsedTime),
        "cuEventDestroy" => {
            if v4000 {
                f!(cuEventDestroy_v2)
            } else {
                f!(cuEventDestroy)
            }
        }
        "cuGetExportTable" => f!(export::cuGetExportTable),
        // contexts and devices
        "cuCtxPushCurrent" => f!(ctx::cuCtxPushCurrent_v2),
        "cuCtxPopCurrent" => f!(ctx::cuCtxPopCurrent_v2),
        "cuCtxGetFlags" => f!(ctx::cuCtxGetFlags),
        "cuCtxSetFlags" => f!(ctx::cuCtxSetFlags),
        "cuCtxGetApiVersion" => f!(ctx::cuCtxGetApiVersion),
        "cuCtxGetId" => f!(ctx::cuCtxGetId),
        "cuCtxGetLimit" => f!(ctx::cuCtxGetLimit),
        "cuCtxSetLimit" => f!(ctx::cuCtxSetLimit),
        "cuCtxGetCacheConfig" => f!(ctx::cuCtxGetCacheConfig),
        "cuCtxSetCacheConfig" => f!(ctx::cuCtxSetCacheConfig),
        "cuCtxGetSharedMemConfig" => f!(ctx::cuCtxGetSharedMemConfig),
        "cuCtxSetSharedMemConfig" => f!(ctx::cuCtxSetSharedMemConfig),
        "cuCtxGetStreamPriorityRange" => f!(ctx::cuCtxGetStreamPriorityRange),
        "cuCtxResetPersistingL2Cache" => f!(ctx::cuCtxResetPersistingL2Cache),
        "cuDevicePrimaryCtxGetState" => f!(ctx::cuDevicePrimaryCtxGetState),
        "cuDevicePrimaryCtxSetFlags" => f!(ctx::cuDevicePrimaryCtxSetFlags_v2),
        "cuDevicePrimaryCtxReset" => f!(ctx::cuDevicePrimaryCtxReset_v2),
        "cuDeviceGetPCIBusId" => f!(ctx::cuDeviceGetPCIBusId),
        "cuDeviceGetByPCIBusId" => f!(ctx::cuDeviceGetByPCIBusId),
        "cuDeviceCanAccessPeer" => f!(ctx::cuDeviceCanAccessPeer),
        "cuDeviceGetP2PAttribute" => f!(ctx::cuDeviceGetP2PAttribute),
        "cuDeviceGetProperties" => f!(ctx::cuDeviceGetProperties),
        // memory
        "cuMemAllocPitch" if v2 => f!(mem::cuMemAllocPitch_v2),
        "cuMemGetAddressRange" if v2 => f!(mem::cuMemGetAddressRange_v2),
        "cuMemHostGetDevicePointer" if v2 => f!(mem::cuMemHostGetDevicePointer_v2),
        "cuMemHostGetFlags" => f!(mem::cuMemHostGetFlags),
        "cuPointerGetAttribute" => f!(mem::cuPointerGetAttribute),
        "cuPointerGetAttributes" => f!(mem::cuPointerGetAttributes),
        "cuPointerSetAttribute" => f!(mem::cuPointerSetAttribute),
        "cuMemcpy" => f!(mem::cuMemcpy),
        "cuMemcpyAsync" => f!(mem::cuMemcpyAsync),
        "cuMemcpyPeer" => f!(mem::cuMemcpyPeer),
        "cuMemcpyPeerAsync" => f!(mem::cuMemcpyPeerAsync),
        "cuMemcpy2D" if v2 => f!(mem::cuMemcpy2D_v2),
        "cuMemcpy2DUnaligned" if v2 => f!(mem::cuMemcpy2DUnaligned_v2),
        "cuMemcpy2DAsync" if v2 => f!(mem::cuMemcpy2DAsync_v2),
        "cuMemcpy3D" if v2 => f!(mem::cuMemcpy3D_v2),
        "cuMemcpy3DAsync" if v2 => f!(mem::cuMemcpy3DAsync_v2),
        "cuMemsetD16" if v2 => f!(mem::cuMemsetD16_v2),
        "cuMemsetD16Async" => f!(mem::cuMemsetD16Async),
        "cuMemsetD2D8" if v2 => f!(mem::cuMemsetD2D8_v2),
        "cuMemsetD2D16" if v2 => f!(mem::cuMemsetD2D16_v2),
        "cuMemsetD2D32" if v2 => f!(mem::cuMemsetD2D32_v2),
        "cuMemsetD2D8Async" => f!(mem::cuMemsetD2D8Async),
        "cuMemsetD2D16Async" => f!(mem::cuMemsetD2D16Async),
        "cuMemsetD2D32Async" => f!(mem::cuMemsetD2D32Async),
        // modules, libraries, kernels, functions
        "cuModuleLoad" => f!(library::cuModuleLoad),
        "cuModuleLoadFatBinary" => f!(library::cuModuleLoadFatBinary),
        "cuModuleGetLoadingMode" => f!(library::cuModuleGetLoadingMode),
        "cuModuleGetFunctionCount" => f!(library::cuModuleGetFunctionCount),
        "cuModuleEnumerateFunctions" => f!(library::cuModuleEnumerateFunctions),
        "cuLibraryLoadData" => f!(library::cuLibraryLoadData),
        "cuLibraryLoadFromFile" => f!(library::cuLibraryLoadFromFile),
        "cuLibraryUnload" => f!(library::cuLibraryUnload),
        "cuLibraryGetKernel" => f!(library::cuLibraryGetKernel),
        "cuLibraryGetModule" => f!(library::cuLibraryGetModule),
        "cuLibraryGetGlobal" => f!(library::cuLibraryGetGlobal),
        "cuLibraryGetKernelCount" => f!(library::cuLibraryGetKernelCount),
        "cuLibraryEnumerateKernels" => f!(library::cuLibraryEnumerateKernels),
        "cuKernelGetFunction" => f!(library::cuKernelGetFunction),
        "cuKernelGetLibrary" => f!(library::cuKernelGetLibrary),
        "cuKernelGetName" => f!(library::cuKernelGetName),
        "cuKernelGetAttribute" => f!(library::cuKernelGetAttribute),
        "cuKernelSetAttribute" => f!(library::cuKernelSetAttribute),
        "cuKernelSetCacheConfig" => f!(library::cuKernelSetCacheConfig),
        "cuKernelGetParamInfo" => f!(library::cuKernelGetParamInfo),
        "cuFuncGetAttribute" => f!(library::cuFuncGetAttribute),
        "cuFuncSetAttribute" => f!(library::cuFuncSetAttribute),
        "cuFuncSetCacheConfig" => f!(library::cuFuncSetCacheConfig),
        "cuFuncSetSharedMemConfig" => f!(library::cuFuncSetSharedMemConfig),
        "cuFuncGetName" => f!(library::cuFuncGetName),
        "cuFuncGetParamInfo" => f!(library::cuFuncGetParamInfo),
        "cuFuncGetModule" => f!(library::cuFuncGetModule),
        "cuFuncIsLoaded" => f!(library::cuFuncIsLoaded),
        "cuFuncLoad" => f!(library::cuFuncLoad),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor" => f!(library::cuOccupancyMaxActiveBlocksPerMultiprocessor),
        "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags" => f!(library::cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags),
        "cuOccupancyMaxPotentialBlockSize" => f!(library::cuOccupancyMaxPotentialBlockSize),
        "cuOccupancyMaxPotentialBlockSizeWithFlags" => f!(library::cuOccupancyMaxPotentialBlockSizeWithFlags),
        "cuOccupancyAvailableDynamicSMemPerBlock" => f!(library::cuOccupancyAvailableDynamicSMemPerBlock),
        "cuLinkCreate" => f!(library::cuLinkCreate_v2),
        "cuLinkAddData" => f!(library::cuLinkAddData_v2),
        "cuLinkAddFile" => f!(library::cuLinkAddFile_v2),
        "cuLinkComplete" => f!(library::cuLinkComplete),
        "cuLinkDestroy" => f!(library::cuLinkDestroy),
        // launches, streams, events
        "cuLaunchKernelEx" => f!(library::cuLaunchKernelEx),
        "cuLaunchCooperativeKernel" => f!(library::cuLaunchCooperativeKernel),
        "cuLaunchHostFunc" => f!(library::cuLaunchHostFunc),
        "cuStreamAddCallback" => f!(library::cuStreamAddCallback),
        "cuStreamGetFlags" => f!(library::cuStreamGetFlags),
        "cuStreamGetPriority" => f!(library::cuStreamGetPriority),
        "cuStreamGetCtx" if version >= 12050 => f!(library::cuStreamGetCtx_v2),
        "cuStreamGetCtx" => f!(library::cuStreamGetCtx),
        "cuStreamGetId" => f!(library::cuStreamGetId),
        "cuStreamGetDevice" => f!(library::cuStreamGetDevice),
        "cuStreamIsCapturing" => f!(library::cuStreamIsCapturing),
        "cuStreamGetCaptureInfo" if version >= 12030 => f!(library::cuStreamGetCaptureInfo_v3),
        "cuStreamGetCaptureInfo" if version >= 11030 => f!(library::cuStreamGetCaptureInfo_v2),
        "cuStreamGetCaptureInfo" => f!(library::cuStreamGetCaptureInfo),
        "cuStreamBeginCapture" => f!(graph::cuStreamBeginCapture_v2),
        "cuStreamEndCapture" => f!(graph::cuStreamEndCapture),
        "cuGraphCreate" => f!(graph::cuGraphCreate),
        "cuGraphDestroy" => f!(graph::cuGraphDestroy),
        "cuGraphGetNodes" => f!(graph::cuGraphGetNodes),
        "cuGraphInstantiate" if version >= 12000 => f!(graph::cuGraphInstantiateWithFlags),
        "cuGraphInstantiate" => f!(graph::cuGraphInstantiate_v2),
        "cuGraphInstantiateWithFlags" => f!(graph::cuGraphInstantiateWithFlags),
        "cuGraphInstantiateWithParams" => f!(graph::cuGraphInstantiateWithParams),
        "cuGraphExecDestroy" => f!(graph::cuGraphExecDestroy),
        "cuGraphExecGetFlags" => f!(graph::cuGraphExecGetFlags),
        "cuGraphUpload" => f!(graph::cuGraphUpload),
        "cuGraphLaunch" => f!(graph::cuGraphLaunch),
        "cuThreadExchangeStreamCaptureMode" => f!(library::cuThreadExchangeStreamCaptureMode),
        "cuEventRecordWithFlags" => f!(library::cuEventRecordWithFlags),
        "cuProfilerStart" => f!(library::cuProfilerStart),
        "cuProfilerStop" => f!(library::cuProfilerStop),
        "cuProfilerInitialize" => f!(library::cuProfilerInitialize),
        "cuMemAllocAsync" => f!(pool::cuMemAllocAsync),
        "cuMemAllocFromPoolAsync" => f!(pool::cuMemAllocFromPoolAsync),
        "cuMemFreeAsync" => f!(pool::cuMemFreeAsync),
        "cuDeviceGetDefaultMemPool" => f!(pool::cuDeviceGetDefaultMemPool),
        "cuDeviceGetMemPool" => f!(pool::cuDeviceGetMemPool),
        "cuDeviceSetMemPool" => f!(pool::cuDeviceSetMemPool),
        "cuMemGetDefaultMemPool" => f!(pool::cuMemGetDefaultMemPool),
        "cuMemGetMemPool" => f!(pool::cuMemGetMemPool),
        "cuMemSetMemPool" => f!(pool::cuMemSetMemPool),
        "cuMemPoolCreate" => f!(pool::cuMemPoolCreate),
        "cuMemPoolDestroy" => f!(pool::cuMemPoolDestroy),
        "cuMemPoolGetAttribute" => f!(pool::cuMemPoolGetAttribute),
        "cuMemPoolSetAttribute" => f!(pool::cuMemPoolSetAttribute),
        "cuMemPoolTrimTo" => f!(pool::cuMemPoolTrimTo),
        "cuMemPoolSetAccess" => f!(pool::cuMemPoolSetAccess),
        "cuMemPoolGetAccess" => f!(pool::cuMemPoolGetAccess),
        "cuGetProcAddress" => {
            if version >= 12000 {
                f!(cuGetProcAddress_v2)
            } else {
                f!(cuGetProcAddress)
            }
        }
        _ => unsupported::lookup(base),
    }
}

const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int) -> CUresult {
    if symbol.is_null() || pfn.is_null() {
        return fail("cuGetProcAddress", bad("null pointer"));
    }
    // SAFETY: per the API contract `symbol` is a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(symbol) }.to_str().unwrap_or("");
    let found = proc_address(name, version, flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0);
    if found.is_none() && log_enabled() || trace_enabled() {
        eprintln!("libcuda(vgpu): cuGetProcAddress: {} {name} (version {version}, flags {flags:#x})", if found.is_some() { "found" } else { "no" });
    }
    // SAFETY: `pfn` is non-null (checked); `status` is optional.
    unsafe {
        *pfn = found.unwrap_or(std::ptr::null_mut());
        if !status.is_null() {
            *status = if found.is_some() { 0 } else { 1 };
        }
    }
    if found.is_some() {
        0
    } else {
        CuResult::CUDA_ERROR_NOT_FOUND as CUresult
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) -> CUresult {
    // SAFETY: same contract as cuGetProcAddress_v2, with no status pointer.
    unsafe { cuGetProcAddress_v2(symbol, pfn, version, flags, std::ptr::null_mut()) }
}

#[cfg(test)]
mod handle_tests {
    use super::*;

    /// A handle of one kind must never decode as another: every kind has
    /// a tag of its own.
    #[test]
    fn handle_tags_are_distinct() {
        let tags = [TAG_CTX, TAG_MOD, TAG_FUNC, TAG_STREAM, TAG_EVENT, library::TAG_LIB, library::TAG_KERNEL, library::TAG_LINK, graph::TAG_GRAPH, graph::TAG_EXEC, pool::TAG_POOL];
        let mut seen = std::collections::HashSet::new();
        for t in tags {
            assert!(seen.insert(t), "tag {t:#x} is used by two kinds of handle");
        }
        let exec = enc(graph::TAG_EXEC, 7);
        assert_eq!(dec(pool::TAG_POOL, exec), None, "a graph exec decoded as a memory pool");
    }
}
