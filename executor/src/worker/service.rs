//! Tenant state and request dispatch for one device, independent of the
//! backend: quotas, handles, pointer ownership, contexts and accounting.
#![allow(clippy::result_large_err, reason = "the error is the reply sent back to the tenant, made once per failed call; boxing it would add an allocation to every failure for no gain")]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use parking_lot::FairMutex;

use virtio_gpu_compute::*;

use super::shm::Shm;
use crate::backend::{preempt_point, AllocTable, Backend, BackendError, DeviceModule, FunctionDesc, GraphOp, Launch, TenantSlot, VolatileSlice, CHECKPOINT_BYTES};
use vgpu_arbiter::ipc::{DeviceStats, TenantStats};

/// Host memory a tenant's objects keep in the worker (parsed modules,
/// function tables, contexts, streams, events, allocation records,
/// connections and in-flight payloads): charged when they are made,
/// released when they go, and never past `limit`. What it refuses is
/// counted, and logged, so an operator can tell a tenant's failures (a
/// library that drops the error among them) from a fault.
pub struct HostBudget {
    limit: u64,
    used: AtomicU64,
    tenant: String,
    refused: AtomicU64,
}

/// What each kind of object costs the host budget, in bytes: its table
/// entries and bookkeeping, rounded up.
pub mod host_cost {
    pub const CONTEXT: u64 = 4096;
    pub const STREAM: u64 = 64;
    pub const EVENT: u64 = 64;
    pub const FUNCTION: u64 = 128;
    pub const PARAM: u64 = 8;
    pub const ALLOCATION: u64 = 96;
    pub const GRAPH: u64 = 256;
    /// Per node, besides a kernel's parameter bytes.
    pub const GRAPH_NODE: u64 = 96;
    /// A stream a command ring has queued work on (its queue, kept while
    /// the ring knows the stream).
    pub const RING_STREAM: u64 = 128;
    /// A VM's GUEST blob, and each of its guest-memory entries.
    pub const BLOB: u64 = 128;
    pub const BLOB_ENTRY: u64 = 16;
    /// A blob attached to one of a VM's contexts.
    pub const ATTACHMENT: u64 = 16;
    /// A command ring in a VM's blob: its completion table and state,
    /// and each run of guest memory it spans.
    pub const RING: u64 = virtio_gpu_compute::ring::ENTRY_SLOTS * 8 + 1024;
    pub const RING_RUN: u64 = 48;
}

/// Most graphs one context holds.
pub const MAX_GRAPHS: usize = 4096;

impl HostBudget {
    pub fn new(limit: u64, tenant: &str) -> HostBudget {
        HostBudget { limit, used: AtomicU64::new(0), tenant: tenant.to_string(), refused: AtomicU64::new(0) }
    }

    /// Takes `n` bytes, or fails with CUDA_ERROR_OUT_OF_MEMORY naming `what`.
    pub fn reserve(&self, n: u64, what: &str) -> Result<(), Reply> {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let next = cur.checked_add(n).filter(|v| *v <= self.limit).ok_or_else(|| {
                let msg = format!("{what} needs {n} bytes of host memory; the tenant's host budget has {} of {} bytes left", self.limit.saturating_sub(cur), self.limit);
                self.note_refusal(&msg);
                err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, msg)
            })?;
            match self.used.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(v) => cur = v,
            }
        }
    }

    pub fn release(&self, n: u64) {
        let _ = self.used.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| Some(v.saturating_sub(n)));
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn left(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    /// Counts a request the budget refused and logs it: the 1st, 2nd,
    /// 4th, 8th, ... of them, so a tenant that keeps asking cannot fill
    /// the log.
    pub fn note_refusal(&self, msg: &str) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(tenant = %self.tenant, refusals = n, "the tenant's host budget ({} bytes, its host_memory) refused a request: {msg}", self.limit);
        }
    }

    /// Requests refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

pub struct Tenant {
    pub name: String,
    /// Device memory the tenant may allocate; resizable live.
    quota: AtomicU64,
    /// Weight, cap and class, as last configured (the scheduler has them).
    share: Mutex<vgpu_arbiter::sched::Share>,
    /// Host memory the tenant's objects may keep in the worker.
    /// Shared with what outlives its handle (a graph still queued).
    pub host: Arc<HostBudget>,
    /// Set when the tenant is deleted: every path that serves it refuses
    /// from then on, before its memory is scrubbed and released.
    revoked: AtomicBool,
    /// The backend's key for this tenant (its own CUDA context on a GPU).
    pub slot: TenantSlot,
    backend: Arc<dyn Backend>,
    /// Fair: requests of the tenant's processes and rings are served in
    /// the order they asked, so no process starves another.
    state: FairMutex<TenantState>,
    /// Device work of this tenant queued or running on its streams (and
    /// synchronous launches and copies in progress). Freed memory goes
    /// back to the device only once this is zero.
    inflight: Mutex<u64>,
    idle: Condvar,
    /// Threads waiting on `idle` (a wake-up costs a system call).
    idle_waiters: AtomicU32,
    /// `deferred` has entries (checked without the state lock).
    has_deferred: AtomicBool,
    /// A faulted tenant's device context is to be rebuilt once its work
    /// in flight is done.
    needs_recovery: AtomicBool,
    kernels: AtomicU64,
    /// Held by the tenant's batch of launches in flight, if any; holds how
    /// long its kernels took, which bounds how far ahead a batch queues
    /// (`super::pipeline`).
    batching: Mutex<super::pipeline::Estimates>,
    /// Bytes moved by the tenant's copies (either way, and on the device).
    copied: AtomicU64,
    device_ns: AtomicU64,
    scrubbed: AtomicU64,
    used: AtomicU64,
    pub connections: AtomicU32,
    /// Descriptors this tenant sent that wait for the worker's closer
    /// thread; past a cap its connections are dropped.
    pub junk_fds: AtomicU32,
}

#[derive(Default)]
struct TenantState {
    /// Shared with the work that runs on it: copied on write.
    owned: Arc<AllocTable>,
    /// Freed while the tenant had work in flight: (address, length),
    /// still charged, returned to the device once the work is done (a
    /// queued kernel may still touch it; nobody else may get it yet).
    deferred: Vec<(u64, u64)>,
    alloc_ctx: HashMap<u64, u32>,
    used: u64,
    /// Unloaded modules (or those of destroyed contexts) whose variables
    /// the driver placed, still held by a graph or queued work: (module,
    /// its context, placed bytes), charged to `used` until the last holder
    /// lets go ([`DeviceService::sweep_retired`]).
    retired: Vec<(Arc<dyn DeviceModule>, u32, u64)>,
    ctxs: HashMap<u32, Ctx>,
    next: u32,
    /// A kernel of this tenant faulted; once its last context is gone the
    /// backend rebuilds the tenant's device context.
    faulted: bool,
    /// The handle counter has wrapped: new handles are checked for reuse.
    wrapped: bool,
    /// Device memory charged (in `used`) for the local memory the driver
    /// keeps for this tenant's kernels: the most any launch needed
    /// ([`FunctionDesc::local_reserve`]), since the driver grows its
    /// reservation and does not shrink it. Given back when the tenant's
    /// device context is rebuilt.
    local: u64,
}

impl TenantState {
    /// The tenant's device context was rebuilt: the local memory the
    /// driver kept in the old one went with it.
    fn recovered(&mut self, t: &Tenant) {
        self.faulted = false;
        self.used = self.used.saturating_sub(std::mem::take(&mut self.local));
        t.used.store(self.used, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Ctx {
    modules: HashMap<u32, Arc<dyn DeviceModule>>,
    /// Each module's host charge: held by the context while the module is
    /// loaded, and by every graph that launches one of its kernels.
    module_charges: HashMap<u32, Arc<Charge>>,
    /// Device memory holding each module's variables, freed with it.
    module_data: HashMap<u32, Vec<u64>>,
    /// Device bytes the driver placed for each module's variables
    /// (`Backend::placed_bytes`), charged to the quota while it is loaded.
    module_placed: HashMap<u32, u64>,
    /// Variables a driver placed itself (GPU backends), made copyable by
    /// cuModuleGetGlobal: ranges added to the tenant's table until the
    /// module or context goes.
    driver_globals: HashMap<u32, Vec<u64>>,
    funcs: HashMap<u32, (u32, FunctionDesc)>,
    /// The handle already given for (module, kernel index): a kernel has
    /// one handle however often it is looked up, as on CUDA.
    func_ids: HashMap<(u32, usize), u32>,
    /// Host bytes charged to the tenant for this context and its objects.
    charged: u64,
    streams: HashSet<u32>,
    /// Each event's newest record: (ring entry, or u64::MAX off a ring; time).
    events: HashMap<u32, Option<(u64, Instant)>>,
    /// Instantiated graphs (`cuGraphInstantiate`), each charged as it says.
    graphs: HashMap<u32, Arc<Graph>>,
    /// Set by a kernel fault; every later call on the context returns it.
    sticky: Option<(CuResult, String)>,
    /// The process that made it, as it gave its pid (0: not given).
    pid: u32,
    /// Device memory its allocations hold.
    used: u64,
}

impl Tenant {
    pub fn quota(&self) -> u64 {
        self.quota.load(Ordering::Acquire)
    }

    pub fn share(&self) -> vgpu_arbiter::sched::Share {
        *self.share.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    /// Counts one piece of device work in flight; the guard ends it.
    pub fn begin_work(self: &Arc<Self>) -> WorkGuard {
        *self.inflight.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        WorkGuard(self.clone())
    }

    /// Waits until no work of the tenant is in flight, at most `limit`.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        self.idle_waiters.fetch_add(1, Ordering::SeqCst);
        let g = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _) = self.idle.wait_timeout_while(g, limit, |n| *n > 0).unwrap_or_else(|e| e.into_inner());
        let idle = *g == 0;
        drop(g);
        self.idle_waiters.fetch_sub(1, Ordering::SeqCst);
        idle
    }
}

/// One piece of a tenant's device work in flight (see [`Tenant::begin_work`]).
/// Dropping the last one returns the memory freed meanwhile to the device.
pub struct WorkGuard(Arc<Tenant>);

impl Drop for WorkGuard {
    fn drop(&mut self) {
        let t = &self.0;
        let mut n = t.inflight.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        if *n > 0 {
            return;
        }
        drop(n);
        if t.idle_waiters.load(Ordering::SeqCst) > 0 {
            t.idle.notify_all();
        }
        if !t.has_deferred.load(Ordering::Acquire) && !t.needs_recovery.load(Ordering::Acquire) {
            return;
        }
        let mut st = t.state.lock();
        // Checked again under the state lock: work may have started since.
        if *t.inflight.lock().unwrap_or_else(|e| e.into_inner()) == 0 {
            t.has_deferred.store(false, Ordering::Release);
            for (addr, len) in std::mem::take(&mut st.deferred) {
                return_alloc(t, &mut st, addr, len);
            }
            if t.needs_recovery.swap(false, Ordering::AcqRel) && st.faulted && st.ctxs.is_empty() {
                match t.backend.recover_tenant(t.slot) {
                    Ok(()) => st.recovered(t),
                    Err(e) => tracing::error!(tenant = %t.name, "rebuilding the tenant's device context failed: {}", e.msg),
                }
            }
        }
    }
}

impl TenantState {
    /// A handle no live context, module, function, stream or event of the
    /// tenant uses (they share one space; after the counter wraps, each
    /// candidate is checked against all of them).
    fn handle(&mut self) -> u32 {
        loop {
            self.next = self.next.wrapping_add(1);
            if self.next == 0 {
                self.wrapped = true;
                continue;
            }
            let id = self.next;
            let used = self.ctxs.contains_key(&id)
                || (self.wrapped
                    && self.ctxs.values().any(|c| c.modules.contains_key(&id) || c.funcs.contains_key(&id) || c.streams.contains(&id) || c.events.contains_key(&id) || c.graphs.contains_key(&id)));
            if !used {
                return id;
            }
        }
    }
}

/// Guest blob resources a VM tenant's copies may name. The virtio-gpu
/// device provides them, limited to the blobs attached to the context.
pub trait BlobAccess: Send + Sync {
    /// The host memory behind bytes [off, off+len) of blob `res`, as
    /// contiguous runs in order. The runs stay mapped while `self` lives.
    fn pieces(&self, res: u32, off: u64, len: u64) -> Result<Pieces, String>;
}

/// Runs of host memory behind a blob range, and what keeps them mapped.
pub struct Pieces {
    pub runs: Vec<(*mut u8, usize)>,
    pub _keep: Box<dyn Send + Sync>,
}

// SAFETY: the runs point into the guest memory mapping `_keep` holds; the
// pointers are only dereferenced by copies while the value lives.
unsafe impl Send for Pieces {}
// SAFETY: as above.
unsafe impl Sync for Pieces {}

/// Per-connection state: the contexts this client created (destroyed when
/// it disconnects, as process exit does on a GPU), its shared buffer, and
/// for a VM tenant's virtio-gpu context the blobs it may copy through.
#[derive(Default)]
pub struct Conn {
    pub ctxs: Vec<u32>,
    /// Shared regions by id: 0 the staging buffer, others pinned host
    /// memory. Queued copies hold their region until they ran.
    pub regions: HashMap<u32, Arc<Shm>>,
    pub blobs: Option<Arc<dyn BlobAccess>>,
}

/// Most shared regions one connection may register.
pub const MAX_REGIONS: usize = 256;

/// Host memory a queued copy moves bytes to or from.
pub enum HostMem {
    /// A connection's shared region, at an offset checked against it.
    Shm(Arc<Shm>, u64),
    /// A guest blob, at an offset; resolved to guest RAM when the copy runs.
    Blob(Arc<dyn BlobAccess>, u32, u64),
    /// Bytes carried in the message (socket copies only).
    Inline(Vec<u8>),
    /// Bytes returned in the reply (socket copies only).
    Reply,
}

/// A piece of device work run through a lane: a ticket, or `None` once
/// it ran ([`DeviceService::start_graph`]).
type Piece<'a> = dyn FnMut() -> Result<Option<u64>, BackendError> + 'a;

/// A tenant's graph: its work, checked when it was built (kernels hold
/// their modules), and the backend's own executable graph of it, if the
/// backend builds them. Launched as one piece of stream work.
pub struct Graph {
    nodes: Vec<GraphWork>,
    native: Option<u64>,
    kernels: u64,
    /// Bytes its device-to-device copies move.
    copied: u64,
    /// Names it for the launch-time estimates (`super::pipeline`): never
    /// reused, unlike its address.
    serial: u64,
    /// The most local memory its kernels make the driver keep
    /// ([`FunctionDesc::local_reserve`]).
    local_reserve: u64,
    /// Host bytes charged for it, released when the last holder (its
    /// context, or a launch still queued) lets go.
    _charge: Charge,
    /// The charges of the modules its kernels are in, kept while it lives
    /// (an unloaded module stays in memory for it).
    _modules: Vec<Arc<Charge>>,
    backend: Arc<dyn Backend>,
    slot: TenantSlot,
}

enum GraphWork {
    Kernel { module: Arc<dyn DeviceModule>, index: usize, launch: Launch, params: Vec<u8> },
    Fill { dptr: u64, count: u64, elem: Vec<u8> },
    Copy { dst: u64, src: u64, size: u64 },
}

impl Graph {
    fn ops(&self) -> Vec<GraphOp<'_>> {
        self.nodes
            .iter()
            .map(|n| match n {
                GraphWork::Kernel { module, index, launch, params } => GraphOp::Kernel { module: &**module, func: *index, launch: *launch, params },
                GraphWork::Fill { dptr, count, elem } => GraphOp::Fill { dptr: *dptr, count: *count, elem },
                GraphWork::Copy { dst, src, size } => GraphOp::Copy { dst: *dst, src: *src, len: *size },
            })
            .collect()
    }

    /// Its memsets and copies still reach only the tenant's allocations:
    /// memory freed since it was built fails the launch, and nobody
    /// else's memory is touched.
    fn check(&self, owned: &AllocTable) -> Result<(), BackendError> {
        let ok = |addr: u64, len: u64| len == 0 || owned.find(addr, len).is_some();
        for (i, n) in self.nodes.iter().enumerate() {
            let fine = match n {
                GraphWork::Kernel { .. } => true,
                GraphWork::Fill { dptr, count, elem } => ok(*dptr, count * elem.len() as u64),
                GraphWork::Copy { dst, src, size } => ok(*dst, *size) && ok(*src, *size),
            };
            if !fine {
                return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, format!("graph node {i} reaches memory freed since the graph was built")));
            }
        }
        Ok(())
    }
}

/// Host bytes charged to a tenant for an object, given back when it is
/// dropped: with a graph, or with the last holder of a module's (its
/// context and the graphs that launch it).
pub(crate) struct Charge {
    budget: Arc<HostBudget>,
    bytes: u64,
}

impl Charge {
    /// Takes `bytes` from `budget` until the charge is dropped, or fails
    /// with CUDA_ERROR_OUT_OF_MEMORY naming `what`.
    pub(crate) fn take(budget: &Arc<HostBudget>, bytes: u64, what: &str) -> Result<Charge, Reply> {
        budget.reserve(bytes, what)?;
        Ok(Charge { budget: budget.clone(), bytes })
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Some(id) = self.native {
            self.backend.graph_destroy(self.slot, id);
        }
    }
}

/// Stream-ordered device work, checked against the tenant's state when it
/// was submitted and run later, in its stream's order, without the
/// tenant's lock.
pub enum WorkKind {
    Launch {
        module: Arc<dyn DeviceModule>,
        index: usize,
        launch: Launch,
        params: Vec<u8>,
    },
    Fill {
        dptr: u64,
        count: u64,
        elem: Vec<u8>,
    },
    HtoD {
        dst: u64,
        size: u64,
        src: HostMem,
    },
    DtoH {
        src: u64,
        size: u64,
        dst: HostMem,
    },
    DtoD {
        dst: u64,
        src: u64,
        size: u64,
    },
    /// Records an event; `order` (the ring entry) keeps the newest record
    /// when records of one event on several streams finish out of order.
    Record {
        event: u32,
        order: u64,
    },
    /// Waits for ring entry `seq` (handled by the stream engine).
    Wait {
        seq: u64,
    },
    /// Runs a graph's work, in order.
    Graph {
        graph: Arc<Graph>,
    },
}

pub struct Work {
    pub ctx: u32,
    pub stream: u32,
    pub kind: WorkKind,
}

type R<T> = Result<T, Reply>;

/// Calls `f(device address, host run, length)` for consecutive runs of a
/// blob copy starting at device address `at`.
fn each_piece(pieces: &[(*mut u8, usize)], mut at: u64, mut f: impl FnMut(u64, *mut u8, usize) -> Result<(), BackendError>) -> Result<(), BackendError> {
    for &(p, n) in pieces {
        f(at, p, n)?;
        at += n as u64;
    }
    Ok(())
}

/// A copy between device memory at `at` and bytes `[off, off+size)` of a
/// guest's blob `res`, in windows of at most [`CHECKPOINT_BYTES`]: the
/// guest memory of each window is resolved (and its lease held) only
/// while the window is copied, which never stops midway; between windows
/// the copy may give its lane up. So a preempted copy holds no lease, and
/// the guest's RESOURCE_UNREF or a device reset never waits on it; a blob
/// gone meanwhile fails the rest of the copy.
fn blob_windows(blobs: &dyn BlobAccess, res: u32, off: u64, size: u64, at: u64, mut f: impl FnMut(u64, *mut u8, usize) -> Result<(), BackendError>) -> Result<(), BackendError> {
    let mut done = 0;
    while done < size {
        if done > 0 {
            preempt_point();
        }
        let n = (size - done).min(CHECKPOINT_BYTES);
        let pieces = blobs.pieces(res, off + done, n).map_err(|e| BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, e))?;
        each_piece(&pieces.runs, at + done, &mut f)?;
        drop(pieces);
        done += n;
    }
    Ok(())
}

/// An error reply as a backend error, its text prefixed with `what`.
fn reply_error(r: Reply, what: &str) -> BackendError {
    match r {
        Reply::Error(code, msg) => BackendError::new(code, format!("{what}: {msg}")),
        _ => BackendError::new(CuResult::CUDA_ERROR_UNKNOWN, what.to_string()),
    }
}

/// Gives a freed allocation back to the device and the tenant's quota.
fn return_alloc(t: &Tenant, st: &mut TenantState, addr: u64, len: u64) {
    t.host.release(host_cost::ALLOCATION);
    st.used -= len;
    t.used.store(st.used, Ordering::Relaxed);
    t.backend.free(t.slot, addr, len);
}

fn err(code: CuResult, msg: impl Into<String>) -> Reply {
    Reply::Error(code, msg.into())
}

impl From<BackendError> for Reply {
    fn from(e: BackendError) -> Reply {
        Reply::Error(e.code, e.msg)
    }
}

/// A checked request: its reply, or work for its stream.
pub enum Prepared {
    Done(Reply),
    Work(Work),
}

/// A batch of one tenant's launches on the device (`super::pipeline`).
struct Batch<'a> {
    svc: &'a DeviceService,
    t: &'a Tenant,
}

/// A bug in the backend costs the launch, never the executor's thread.
fn guarded<T>(f: impl FnOnce() -> Result<T, BackendError>) -> Result<T, BackendError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| Err(BackendError::new(CuResult::CUDA_ERROR_UNKNOWN, "internal error")))
}

impl<I: AsRef<Work>> super::pipeline::Queue<I> for Batch<'_> {
    fn queue(&mut self, item: &I) -> Result<Option<u64>, BackendError> {
        let w = item.as_ref();
        let owned = DeviceService::runnable(self.t, w.ctx)?;
        let r = match &w.kind {
            WorkKind::Launch { module, index, launch, params } => {
                self.t.kernels.fetch_add(1, Ordering::Relaxed);
                guarded(|| self.svc.backend.launch_queued(self.t.slot, &**module, *index, launch, params, &owned))
            }
            // The batch holds the lane: pieces run without taking it again.
            WorkKind::Graph { graph } => guarded(|| self.svc.start_graph(self.t, w.ctx, graph, &owned, true, &mut |f| f())),
            _ => Err(BackendError::new(CuResult::CUDA_ERROR_UNKNOWN, "internal error: a batch of launches was given other work")),
        };
        if let Err(e) = &r {
            DeviceService::faulted(self.t, w.ctx, e);
        }
        r
    }

    fn finished(&mut self, item: &I, ticket: u64, since: Instant) -> Result<bool, BackendError> {
        let r = guarded(|| self.svc.backend.launch_finished(self.t.slot, ticket, since));
        if let Err(e) = &r {
            DeviceService::faulted(self.t, item.as_ref().ctx, e);
        }
        r
    }

    fn may_take(&self) -> bool {
        !vgpu_arbiter::grant::yield_asked()
    }

    fn kernel(&self, item: &I) -> super::pipeline::Kernel {
        use std::hash::BuildHasher;
        let h = std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
        let (module, index, launch) = match &item.as_ref().kind {
            WorkKind::Launch { module, index, launch, .. } => (module, index, launch),
            // A graph is timed as a whole, by its address while it is held.
            WorkKind::Graph { graph } => return (h.hash_one(graph.serial), u64::MAX),
            _ => return (0, 0),
        };
        // The module's address names it while the launch holds it; a
        // later module at the same address inherits a stale estimate,
        // which its first runs correct.
        (h.hash_one((Arc::as_ptr(module) as *const () as usize, *index)), h.hash_one((launch.grid, launch.block, launch.shared_bytes)))
    }
}

pub use virtio_gpu_compute::uuid_text;

pub struct DeviceService {
    pub backend: Arc<dyn Backend>,
    pub sched: vgpu_arbiter::grant::Lanes,
    pub ordinal: u32,
    tenants: RwLock<HashMap<String, Arc<Tenant>>>,
    started: Instant,
}

impl DeviceService {
    pub fn new(ordinal: u32, backend: Arc<dyn Backend>, sched: vgpu_arbiter::grant::Lanes) -> Self {
        DeviceService { backend, sched, ordinal, tenants: RwLock::new(HashMap::new()), started: Instant::now() }
    }

    pub fn add_tenant(&self, name: &str, quota: u64, share: vgpu_arbiter::sched::Share, host_limit: u64) -> Result<Arc<Tenant>, String> {
        let mut map = self.tenants.write().unwrap_or_else(|e| e.into_inner());
        if map.contains_key(name) {
            return Err(format!("tenant {name} already exists on this device"));
        }
        let slot = self.backend.open_tenant(name).map_err(|e| format!("setting up tenant {name} on the device: {}", e.msg))?;
        let t = Arc::new(Tenant {
            name: name.to_string(),
            quota: AtomicU64::new(quota),
            share: Mutex::new(share),
            host: Arc::new(HostBudget::new(host_limit, name)),
            revoked: AtomicBool::new(false),
            slot,
            backend: self.backend.clone(),
            state: FairMutex::new(TenantState::default()),
            inflight: Mutex::new(0),
            idle: Condvar::new(),
            idle_waiters: AtomicU32::new(0),
            has_deferred: AtomicBool::new(false),
            needs_recovery: AtomicBool::new(false),
            kernels: AtomicU64::new(0),
            batching: Mutex::new(Default::default()),
            copied: AtomicU64::new(0),
            device_ns: AtomicU64::new(0),
            scrubbed: AtomicU64::new(0),
            used: AtomicU64::new(0),
            connections: AtomicU32::new(0),
            junk_fds: AtomicU32::new(0),
        });
        map.insert(name.to_string(), t.clone());
        self.sched.configure(name, share);
        Ok(t)
    }

    /// Changes a tenant's scheduling parameters and quota live. A quota
    /// below what the tenant has allocated is refused, and then nothing
    /// changes.
    pub fn set_tenant(&self, name: &str, share: Option<vgpu_arbiter::sched::Share>, quota: Option<u64>) -> Result<(), String> {
        let t = self.tenant(name).ok_or_else(|| format!("no tenant {name} on this device"))?;
        match quota {
            // Shrinking: under the state lock, which allocations hold while
            // they check the quota, so none lands between check and store.
            Some(q) if q < t.quota() => {
                let mut st = t.state.lock();
                self.sweep_retired(&t, &mut st);
                if st.used > q {
                    let local = if st.local > 0 { format!(" ({} of them the local memory the driver keeps for its kernels, until its device context is rebuilt)", st.local) } else { String::new() };
                    return Err(format!("tenant {name} has {} bytes allocated{local}; it must free below {q} bytes before its quota can shrink to that", st.used));
                }
                t.quota.store(q, Ordering::Release);
            }
            Some(q) => t.quota.store(q, Ordering::Release),
            None => {}
        }
        if let Some(sh) = share {
            *t.share.lock().unwrap_or_else(|e| e.into_inner()) = sh;
            self.sched.configure(name, sh);
        }
        Ok(())
    }

    fn tenant(&self, name: &str) -> Option<Arc<Tenant>> {
        self.tenants.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    /// Marks the tenant revoked: from now on every request of it, on any
    /// connection or VM context, fails. Returns false for an unknown name.
    pub fn revoke(&self, name: &str) -> bool {
        match self.tenants.read().unwrap_or_else(|e| e.into_inner()).get(name) {
            Some(t) => {
                t.revoked.store(true, Ordering::Release);
                true
            }
            None => false,
        }
    }

    /// Revokes the tenant, then drops it and frees everything it still
    /// holds. Waits for a request of the tenant that is running to finish
    /// (launches are bounded in time), so call it off any shared path.
    pub fn remove_tenant(&self, name: &str) -> Option<Arc<Tenant>> {
        self.revoke(name);
        let t = self.tenants.write().unwrap_or_else(|e| e.into_inner()).remove(name)?;
        self.sched.forget(name);
        // Queued work of a revoked tenant is dropped, not run; what runs
        // now is bounded by the launch timeout (on a GPU, for each kernel
        // still queued on the device, at most pipeline::MAX_DEPTH).
        if !t.wait_idle(Duration::from_secs(120)) {
            tracing::error!(tenant = %name, "work of the removed tenant is still running after 120 s; its memory is freed once it ends");
        }
        let mut st = t.state.lock();
        let ids: Vec<u32> = st.ctxs.keys().copied().collect();
        for id in ids {
            self.destroy_ctx(&t, &mut st, id);
        }
        drop(st);
        if t.wait_idle(Duration::ZERO) {
            self.backend.close_tenant(t.slot);
        }
        Some(t)
    }

    pub fn stats(&self) -> DeviceStats {
        let d = self.backend.desc();
        let tenants: Vec<TenantStats> = self
            .tenants
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|t| TenantStats {
                name: t.name.clone(),
                quota: t.quota(),
                used: t.used.load(Ordering::Relaxed),
                kernels: t.kernels.load(Ordering::Relaxed),
                device_ns: self.sched.device_time(&t.name, Duration::from_nanos(t.device_ns.load(Ordering::Relaxed))).as_nanos() as u64,
                bytes_scrubbed: t.scrubbed.load(Ordering::Relaxed),
                bytes_copied: t.copied.load(Ordering::Relaxed),
                spilled: self.backend.spilled(t.slot),
                weight: t.share().weight,
                cap: t.share().cap,
                priority: t.share().priority,
                connections: t.connections.load(Ordering::Relaxed),
                host_used: t.host.used(),
                host_limit: t.host.limit(),
                host_refused: t.host.refused(),
            })
            .collect();
        DeviceStats {
            kind: d.kind.to_string(),
            name: d.name.clone(),
            uuid: uuid_text(&d.uuid),
            memory: d.memory,
            allocated: tenants.iter().map(|t| t.used).sum(),
            bytes_scrubbed: self.backend.bytes_scrubbed(),
            quarantined: self.backend.quarantined(),
            busy_ns: self.sched.busy().as_nanos() as u64,
            uptime_ns: self.started.elapsed().as_nanos() as u64,
            lanes: self.sched.lanes() as u32,
            spilled: self.backend.spill_usage().0,
            spill_budget: self.backend.spill_usage().1,
            tenants,
        }
    }

    /// Called when a client disconnects: its contexts go away.
    pub fn disconnect(&self, t: &Tenant, conn: &mut Conn) {
        let mut st = t.state.lock();
        for id in conn.ctxs.drain(..) {
            self.destroy_ctx(t, &mut st, id);
        }
        drop(st);
        self.drop_regions(conn);
    }

    /// Installs (or, with None, drops) a connection's shared region `id`,
    /// keeping the backend's host registration in step with the mapping.
    pub fn set_shm(&self, conn: &mut Conn, id: u32, shm: Option<Shm>) {
        if let Some(old) = conn.regions.remove(&id) {
            self.backend.unregister_host(old.as_ptr());
        }
        if let Some(new) = shm {
            if let Err(e) = self.backend.register_host(new.as_ptr(), new.len()) {
                tracing::warn!("shared region stays unregistered; copies through it are staged: {}", e.msg);
            }
            conn.regions.insert(id, Arc::new(new));
        }
    }

    /// Drops every shared region of a connection.
    pub fn drop_regions(&self, conn: &mut Conn) {
        for (_, r) in conn.regions.drain() {
            self.backend.unregister_host(r.as_ptr());
        }
    }

    fn destroy_ctx(&self, t: &Tenant, st: &mut TenantState, id: u32) -> bool {
        let Some(c) = st.ctxs.remove(&id) else { return false };
        t.host.release(c.charged);
        // Driver-placed variables stay charged while anything holds their
        // module.
        for (mid, placed) in &c.module_placed {
            if let Some(m) = c.modules.get(mid) {
                st.retired.push((m.clone(), id, *placed));
            }
        }
        for a in c.driver_globals.values().flatten() {
            Arc::make_mut(&mut st.owned).0.remove(a);
        }
        drop(c);
        self.sweep_retired(t, st);
        let mine: Vec<u64> = st.alloc_ctx.iter().filter(|(_, c)| **c == id).map(|(a, _)| *a).collect();
        for a in mine {
            self.free_alloc(t, st, a);
        }
        if st.faulted && st.ctxs.is_empty() && !t.wait_idle(Duration::ZERO) {
            // Work still runs on the poisoned context: rebuilt once it ends.
            t.needs_recovery.store(true, Ordering::Release);
        } else if st.faulted && st.ctxs.is_empty() {
            // Modules and allocations of the poisoned context are gone
            // (none is still deferred: no work is in flight).
            match self.backend.recover_tenant(t.slot) {
                Ok(()) => st.recovered(t),
                Err(e) => tracing::error!(tenant = %t.name, "rebuilding the tenant's device context failed: {}", e.msg),
            }
        }
        true
    }

    /// Gives back the quota of retired modules that no graph or queued
    /// work holds any more (the driver has unloaded them).
    fn sweep_retired(&self, t: &Tenant, st: &mut TenantState) {
        let mut freed = 0;
        st.retired.retain(|(m, ctx, placed)| {
            if Arc::strong_count(m) > 1 {
                return true;
            }
            freed += placed;
            if let Some(c) = st.ctxs.get_mut(ctx) {
                c.used = c.used.saturating_sub(*placed);
            }
            false
        });
        if freed > 0 {
            st.used = st.used.saturating_sub(freed);
            t.used.store(st.used, Ordering::Relaxed);
        }
    }

    /// Takes an allocation out of the tenant's table; its memory goes back
    /// to the device now, or once the tenant's work in flight is done.
    fn free_alloc(&self, t: &Tenant, st: &mut TenantState, addr: u64) -> bool {
        let owned = Arc::make_mut(&mut st.owned);
        let Some(len) = owned.0.remove(&addr) else { return false };
        owned.1.remove(&addr);
        // (A context being destroyed is out of the map already.)
        if let Some(c) = st.alloc_ctx.remove(&addr).and_then(|ctx| st.ctxs.get_mut(&ctx)) {
            c.used = c.used.saturating_sub(len);
        }
        let busy = {
            // The flag is raised under the count's lock: the last work to
            // end takes that lock after, and so sees it.
            let n = t.inflight.lock().unwrap_or_else(|e| e.into_inner());
            if *n > 0 {
                t.has_deferred.store(true, Ordering::Release);
            }
            *n > 0
        };
        if busy {
            st.deferred.push((addr, len));
        } else {
            return_alloc(t, st, addr, len);
        }
        true
    }

    /// The processes holding the tenant's contexts, by the pid each gave,
    /// with what their contexts' allocations hold (module variables
    /// included); contexts made without a pid are left out. One pass over
    /// the contexts (at most [`MAX_CONTEXTS`]).
    fn processes(st: &TenantState) -> Vec<ProcessInfo> {
        let mut by_pid: std::collections::BTreeMap<u32, ProcessInfo> = std::collections::BTreeMap::new();
        for c in st.ctxs.values().filter(|c| c.pid != 0) {
            let p = by_pid.entry(c.pid).or_insert(ProcessInfo { pid: c.pid, contexts: 0, used: 0 });
            p.contexts += 1;
            p.used += c.used;
        }
        by_pid.into_values().collect()
    }

    /// Takes `size` bytes of device memory from the tenant's quota for
    /// context `ctx`; `read_only` ranges are readable but not writable by
    /// kernels (modules' constant memory).
    fn alloc_for(&self, t: &Tenant, st: &mut TenantState, ctx: u32, size: u64, read_only: bool) -> R<u64> {
        // Checked as the device will round it, so an allocation over the
        // quota never takes device memory, even for a moment.
        let rounded = size.checked_next_multiple_of(self.backend.granule().max(1)).unwrap_or(u64::MAX);
        if rounded > t.quota().saturating_sub(st.used) {
            self.sweep_retired(t, st);
        }
        if rounded > t.quota().saturating_sub(st.used) {
            return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("allocation of {size} bytes exceeds the quota ({} of {} bytes used)", st.used, t.quota())));
        }
        t.host.reserve(host_cost::ALLOCATION, "an allocation record")?;
        let (addr, len) = match self.backend.alloc(t.slot, size) {
            Ok(a) => a,
            Err(e) => {
                t.host.release(host_cost::ALLOCATION);
                return Err(e.into());
            }
        };
        if st.used + len > t.quota() {
            // Granule rounding pushed it over: still over quota.
            self.backend.free(t.slot, addr, len);
            t.host.release(host_cost::ALLOCATION);
            return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "allocation exceeds the quota"));
        }
        t.scrubbed.fetch_add(len, Ordering::Relaxed);
        let owned = Arc::make_mut(&mut st.owned);
        owned.0.insert(addr, len);
        if read_only {
            owned.1.insert(addr, len);
        }
        st.alloc_ctx.insert(addr, ctx);
        if let Some(c) = st.ctxs.get_mut(&ctx) {
            c.used += len;
        }
        st.used += len;
        t.used.store(st.used, Ordering::Relaxed);
        Ok(addr)
    }

    /// What `cuMemGetInfo` calls free: what the quota leaves, or less when
    /// an overcommitted device cannot place that much now.
    fn free_for(&self, t: &Tenant, used: u64) -> u64 {
        t.quota().saturating_sub(used).min(self.backend.available())
    }

    fn device_info(&self, t: &Tenant, used: u64) -> DeviceInfo {
        let d = self.backend.desc();
        DeviceInfo {
            name: fixed_name(&d.name),
            uuid: d.uuid,
            total_mem: t.quota(),
            free_mem: self.free_for(t, used),
            cc_major: d.cc.0,
            cc_minor: d.cc.1,
            sm_count: d.sm_count,
            warp_size: 32,
            max_threads_per_block: d.max_threads_per_block,
            max_shared_per_block: d.max_shared_per_block,
            max_block: d.max_block,
            max_grid: d.max_grid,
            numa_node: d.numa_node,
            ordinal: self.ordinal,
            instruction_budget: d.instruction_budget,
        }
    }

    /// Handles one request from tenant `t` to completion: stream-ordered
    /// work runs now, before the reply. Never panics on bad input: every
    /// handle, pointer and length is checked against the tenant's own state.
    pub fn handle(&self, t: &Arc<Tenant>, conn: &std::sync::Mutex<Conn>, req: Request) -> Reply {
        // The connection is held only while the request is checked: its
        // work (which holds what it needs of the connection) runs without
        // it, so the connection's command ring, polled on an engine
        // thread, is not held up by a long kernel sent on the socket.
        let prepared = self.prepare(t, &mut conn.lock().unwrap_or_else(|e| e.into_inner()), req);
        match prepared {
            Ok(Prepared::Done(r)) | Err(r) => r,
            Ok(Prepared::Work(w)) => {
                let inflight = t.begin_work();
                let r = match self.execute(t, &w) {
                    Ok(Some(data)) => Reply::Data(data),
                    Ok(None) => Reply::Empty,
                    Err(e) => e.into(),
                };
                // What the work holds goes before it stops counting as in
                // flight (a graph's backend half, say, before a rebuild).
                drop(w);
                drop(inflight);
                r
            }
        }
    }

    /// Checks one request: immediate ones run now and give their reply;
    /// stream-ordered ones (launches, memsets, copies, event records and
    /// stream waits) come back as [`Work`] for their stream to run.
    pub fn prepare(&self, t: &Tenant, conn: &mut Conn, req: Request) -> Result<Prepared, Reply> {
        match req {
            req if req.is_stream_ordered() => self.check_work(t, conn, req).map(Prepared::Work),
            other => Ok(Prepared::Done(match self.dispatch(t, conn, other) {
                Ok(r) | Err(r) => r,
            })),
        }
    }

    fn check_work(&self, t: &Tenant, conn: &Conn, req: Request) -> R<Work> {
        let mut st = t.state.lock();
        // Device memory the driver will keep for the kernels' local memory.
        let mut local = 0;
        if t.revoked.load(Ordering::Acquire) {
            return Err(err(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("tenant {} was deleted", t.name)));
        }
        let (ctx, stream, kind) = match req {
            Request::Memset(b) => {
                let (dptr, count, elem) = Self::fill(&st, b.dptr, b.value, b.elem_size, b.count)?;
                (b.ctx, b.stream, WorkKind::Fill { dptr, count, elem })
            }
            Request::MemcpyHtoD(b, data) => {
                Self::owned(&st, b.dst, b.size, "copy destination")?;
                let src = Self::host_mem(conn, b.loc, b.blob, b.shm_offset, b.size, Some(data))?;
                (b.ctx, b.stream, WorkKind::HtoD { dst: b.dst, size: b.size, src })
            }
            Request::MemcpyDtoH(b) => {
                Self::owned(&st, b.src, b.size, "copy source")?;
                let dst = Self::host_mem(conn, b.loc, b.blob, b.shm_offset, b.size, None)?;
                (b.ctx, b.stream, WorkKind::DtoH { src: b.src, size: b.size, dst })
            }
            Request::MemcpyDtoD(b) => {
                Self::owned(&st, b.src, b.size, "copy source")?;
                Self::owned(&st, b.dst, b.size, "copy destination")?;
                (b.ctx, b.stream, WorkKind::DtoD { dst: b.dst, src: b.src, size: b.size })
            }
            Request::LaunchKernel(b, params) => {
                let c = st.ctxs.get(&b.ctx).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("no context {}", b.ctx)))?;
                let (module, index, reserve) = Self::kernel(c, b.func, params.len())?;
                local = reserve;
                let launch = Launch { grid: b.grid, block: b.block, shared_bytes: b.shared_bytes };
                (b.ctx, b.stream, WorkKind::Launch { module, index, launch, params })
            }
            Request::EventRecord(b) => {
                let c = st.ctxs.get(&b.ctx).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("no context {}", b.ctx)))?;
                if !c.events.contains_key(&b.event) {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no event {}", b.event)));
                }
                (b.ctx, b.stream, WorkKind::Record { event: b.event, order: u64::MAX })
            }
            Request::StreamWait(b) => (b.ctx, b.stream, WorkKind::Wait { seq: b.seq }),
            Request::GraphLaunch(b) => {
                let c = st.ctxs.get(&b.ctx).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("no context {}", b.ctx)))?;
                let graph = c.graphs.get(&b.graph).cloned().ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no graph {}", b.graph)))?;
                local = graph.local_reserve;
                (b.ctx, b.stream, WorkKind::Graph { graph })
            }
            _ => return Err(err(CuResult::CUDA_ERROR_UNKNOWN, "not a stream-ordered request")),
        };
        let c = st.ctxs.get(&ctx).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("no context {ctx}")))?;
        if let Some((code, msg)) = &c.sticky {
            return Err(err(*code, format!("context is unusable after an earlier fault: {msg}")));
        }
        if stream != DEFAULT_STREAM && !c.streams.contains(&stream) {
            return Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no stream {stream}")));
        }
        self.reserve_local(t, &mut st, local)?;
        Ok(Work { ctx, stream, kind })
    }

    /// Runs checked work on the device, without the tenant's lock. The
    /// context must still exist and be healthy; a kernel fault makes it
    /// unusable (CUDA's sticky errors). Device-to-host copies into the
    /// reply return their bytes.
    pub fn execute(&self, t: &Tenant, w: &Work) -> Result<Option<Vec<u8>>, BackendError> {
        let owned = Self::runnable(t, w.ctx)?;
        // The ranges were checked at submission; an allocation freed since
        // is gone from the table, and its memory is not reused before this
        // work ends (the tenant has work in flight).
        let check = |addr: u64, len: u64, what: &str| -> Result<(), BackendError> {
            if len > 0 && owned.find(addr, len).is_none() {
                return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, format!("{what} range {addr:#x}+{len} was freed before the work ran")));
            }
            Ok(())
        };
        let slot = t.slot;
        let b = &self.backend;
        match &w.kind {
            WorkKind::Launch { module, index, launch, params } => {
                let res = self.timed(t, || b.launch(slot, &**module, *index, launch, params, &owned));
                t.kernels.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = &res {
                    Self::faulted(t, w.ctx, e);
                }
                res.map(|_| None)
            }
            WorkKind::Fill { dptr, count, elem } => {
                check(*dptr, count * elem.len() as u64, "memset")?;
                self.timed(t, || b.fill(slot, *dptr, *count, elem)).map(|_| None)
            }
            WorkKind::DtoD { dst, src, size } => {
                check(*src, *size, "copy source")?;
                check(*dst, *size, "copy destination")?;
                self.timed(t, || b.copy(slot, *dst, *src, *size))?;
                t.copied.fetch_add(*size, Ordering::Relaxed);
                Ok(None)
            }
            WorkKind::HtoD { dst, size, src } => {
                check(*dst, *size, "copy destination")?;
                self.timed(t, || match src {
                    // SAFETY: bytes the executor owns, live for the call;
                    // a write only reads its source, so the view's
                    // mutability is never used.
                    HostMem::Inline(data) => b.write(slot, *dst, unsafe { VolatileSlice::new(data.as_ptr().cast_mut(), data.len()) }),
                    HostMem::Shm(shm, off) => b.write(slot, *dst, shm.volatile(*off, *size)?),
                    HostMem::Blob(blobs, res, off) => blob_windows(&**blobs, *res, *off, *size, *dst, |at, p, n| {
                        // SAFETY: BlobAccess hands out runs inside guest
                        // RAM mapped while the window's pieces live; the
                        // guest may change them concurrently (only the
                        // bytes copied change, as on real DMA), which the
                        // volatile view allows.
                        b.write(slot, at, unsafe { VolatileSlice::new(p, n) })
                    }),
                    HostMem::Reply => Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "a host-to-device copy needs a source")),
                })?;
                t.copied.fetch_add(*size, Ordering::Relaxed);
                Ok(None)
            }
            WorkKind::DtoH { src, size, dst } => {
                check(*src, *size, "copy source")?;
                t.copied.fetch_add(*size, Ordering::Relaxed);
                self.timed(t, || match dst {
                    HostMem::Reply => {
                        let mut out = vec![0u8; *size as usize];
                        b.read(slot, *src, VolatileSlice::from(&mut out[..])).map(|_| Some(out))
                    }
                    HostMem::Shm(shm, off) => b.read(slot, *src, shm.volatile(*off, *size)?).map(|_| None),
                    HostMem::Blob(blobs, res, off) => blob_windows(&**blobs, *res, *off, *size, *src, |at, p, n| {
                        // SAFETY: as for HtoD; the runs are writable
                        // guest RAM, reached only through this view.
                        b.read(slot, at, unsafe { VolatileSlice::new(p, n) })
                    })
                    .map(|_| None),
                    HostMem::Inline(_) => Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "a device-to-host copy has no inline destination")),
                })
            }
            WorkKind::Record { event, order } => {
                let mut st = t.state.lock();
                if let Some(e) = st.ctxs.get_mut(&w.ctx).and_then(|c| c.events.get_mut(event)) {
                    if e.is_none_or(|(o, _)| *order == u64::MAX || *order >= o) {
                        *e = Some((*order, Instant::now()));
                    }
                }
                Ok(None)
            }
            WorkKind::Wait { .. } => Err(BackendError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "stream waits need a command ring")),
            WorkKind::Graph { graph } => {
                // Each piece takes a lane of its own, as its own request
                // would; a backend's own graph is waited for under its lane.
                let r = self.start_graph(t, w.ctx, graph, &owned, false, &mut |f| self.timed(t, &mut *f));
                if let Err(e) = &r {
                    Self::faulted(t, w.ctx, e);
                }
                r.map(|_| None)
            }
        }
    }

    /// Starts a graph's work (of context `ctx`): checks its memory ranges
    /// and counts its kernels and bytes; then the backend's own graph runs
    /// through `lane`, queued (`queue`: its ticket) or to its end, or else
    /// each piece runs through `lane` in turn (`None`: all ran). Piece by
    /// piece, the graph stops at the first piece once the tenant is
    /// deleted or the context destroyed or faulted, and once its pieces
    /// have run longer than the backend's launch timeout in all: one
    /// launch of a graph is held to the limit of one launch.
    fn start_graph(
        &self,
        t: &Tenant,
        ctx: u32,
        g: &Graph,
        owned: &AllocTable,
        queue: bool,
        lane: &mut dyn FnMut(&mut Piece<'_>) -> Result<Option<u64>, BackendError>,
    ) -> Result<Option<u64>, BackendError> {
        g.check(owned)?;
        t.kernels.fetch_add(g.kernels, Ordering::Relaxed);
        t.copied.fetch_add(g.copied, Ordering::Relaxed);
        let (b, slot) = (&self.backend, t.slot);
        if let Some(id) = g.native {
            return lane(&mut || if queue { b.graph_launch_queued(slot, id) } else { b.graph_launch(slot, id, Instant::now()).map(|_| None) });
        }
        let limit = b.launch_timeout();
        let mut ran = Duration::ZERO;
        for (i, n) in g.nodes.iter().enumerate() {
            if i > 0 {
                Self::runnable(t, ctx)?;
                if let Some(l) = limit.filter(|l| ran > *l) {
                    return Err(BackendError::new(CuResult::CUDA_ERROR_LAUNCH_TIMEOUT, format!("graph ran past the {l:?} launch timeout after {i} of its {} nodes", g.nodes.len())));
                }
            }
            lane(&mut || {
                // Time its lane was taken from it does not count, as for
                // one launch's timeout.
                let paused = || vgpu_arbiter::grant::with_preempt(|p| p.map_or(Duration::ZERO, |p| p.paused()));
                let (began, before) = (Instant::now(), paused());
                let r = match n {
                    GraphWork::Kernel { module, index, launch, params } => b.launch(slot, &**module, *index, launch, params, owned).map(|_| ()),
                    GraphWork::Fill { dptr, count, elem } => b.fill(slot, *dptr, *count, elem),
                    GraphWork::Copy { dst, src, size } => b.copy(slot, *dst, *src, *size),
                };
                ran += began.elapsed().saturating_sub(paused().saturating_sub(before));
                r.map(|_| None)
            })?;
        }
        Ok(None)
    }

    /// Whether work of context `ctx` may run now: the tenant is live and
    /// the context usable. Returns the tenant's allocations.
    fn runnable(t: &Tenant, ctx: u32) -> Result<Arc<AllocTable>, BackendError> {
        let st = t.state.lock();
        if t.revoked.load(Ordering::Acquire) {
            return Err(BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("tenant {} was deleted", t.name)));
        }
        let c = st.ctxs.get(&ctx).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("context {ctx} was destroyed")))?;
        if let Some((code, msg)) = &c.sticky {
            return Err(BackendError::new(*code, format!("context is unusable after an earlier fault: {msg}")));
        }
        Ok(st.owned.clone())
    }

    /// A launch of context `ctx` failed with `e`: a sticky error makes the
    /// context unusable, as on CUDA. The first one stays its reason.
    fn faulted(t: &Tenant, ctx: u32, e: &BackendError) {
        if e.code.is_sticky() {
            let mut st = t.state.lock();
            st.faulted = true;
            if let Some(c) = st.ctxs.get_mut(&ctx) {
                c.sticky.get_or_insert_with(|| (e.code, e.msg.clone()));
            }
        }
    }

    /// Whether launches run in batches ([`Self::launch_batch`]): on a
    /// backend that queues kernels without waiting for them, in a
    /// tenant's executor, whose arbiter can ask for its lane back at any
    /// time (`yield_asked`). A shared worker's own scheduler preempts only
    /// at checkpoints, which a GPU's kernels do not reach: there each
    /// launch is waited for, as before.
    pub fn pipelines(&self) -> bool {
        self.backend.queues_launches() && matches!(self.sched, vgpu_arbiter::grant::Lanes::Granted(_))
    }

    /// Runs the launch `first` carries and those `next` hands out behind
    /// it as one batch under one lane (`super::pipeline`), reporting each
    /// to `done` once its kernel ended. The tenant is charged the time the
    /// lane was held.
    pub fn launch_batch<I: AsRef<Work>>(&self, t: &Tenant, first: I, mut next: impl FnMut(&dyn Fn(&I) -> bool) -> Option<I>, mut done: impl FnMut(I, Result<(), BackendError>)) {
        // One batch of the tenant at a time (its streams share one queue on
        // the device): each launch's timeout then counts from the end of
        // the kernel before it. Taken before the lane, never while holding it.
        let mut est = t.batching.lock().unwrap_or_else(|e| e.into_inner());
        let mut first = Some(first);
        let ran = self.sched.run(&t.name, || {
            let Some(item) = first.take() else { return };
            let mut q = Batch { svc: self, t };
            super::pipeline::run(&mut q, item, &mut next, &mut done, &mut est);
        });
        match ran {
            Ok(((), dt)) => {
                t.device_ns.fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
            }
            Err(e) => {
                if let Some(item) = first.take() {
                    done(item, Err(BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("no lane: {e}"))));
                }
            }
        }
    }

    /// Function `func` of context `c`, given `params` parameter bytes: its
    /// module and kernel index.
    /// Charges the device memory a kernel's local memory makes the driver
    /// keep (`need`, see [`FunctionDesc::local_reserve`]) before the
    /// launch that would take it: only what it needs beyond the most a
    /// launch needed so far, refused past the quota.
    fn reserve_local(&self, t: &Tenant, st: &mut TenantState, need: u64) -> R<()> {
        if need <= st.local {
            return Ok(());
        }
        let more = need - st.local;
        if more > t.quota().saturating_sub(st.used) {
            self.sweep_retired(t, st);
        }
        if more > t.quota().saturating_sub(st.used) {
            return Err(err(
                CuResult::CUDA_ERROR_OUT_OF_MEMORY,
                format!("the kernel's local memory makes the driver keep {need} bytes of device memory (its bytes a thread for every thread the device holds at once), more than the quota leaves ({} of {} bytes used)", st.used, t.quota()),
            ));
        }
        st.local = need;
        st.used += more;
        t.used.store(st.used, Ordering::Relaxed);
        Ok(())
    }

    /// A launchable kernel of context `c`: its module, index and
    /// [`FunctionDesc::local_reserve`].
    fn kernel(c: &Ctx, func: u32, params: usize) -> R<(Arc<dyn DeviceModule>, usize, u64)> {
        let (mid, f) = c.funcs.get(&func).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no function {func}")))?;
        if (params as u32) < f.params_size {
            return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, format!("{params} parameter bytes given, the kernel takes {}", f.params_size)));
        }
        let module = c.modules.get(mid).cloned().ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_HANDLE, "module was unloaded"))?;
        Ok((module, f.index, f.local_reserve))
    }

    /// A memset of `count` elements of `elem_size` bytes (1, 2 or 4, as
    /// the decoder checked) at `dptr`, inside the tenant's allocations and
    /// aligned: the destination, count and element bytes.
    fn fill(st: &TenantState, dptr: u64, value: u32, elem_size: u32, count: u64) -> R<(u64, u64, Vec<u8>)> {
        Self::owned(st, dptr, count * elem_size as u64, "memset")?;
        if !dptr.is_multiple_of(elem_size as u64) {
            return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, "misaligned memset destination"));
        }
        Ok((dptr, count, value.to_le_bytes()[..elem_size as usize].to_vec()))
    }

    /// Checks a graph's nodes as their own requests would be checked,
    /// charges its host memory to context `ctx`, and has the backend build
    /// its own graph of it where it can.
    fn build_graph(&self, t: &Tenant, st: &mut TenantState, ctx: u32, nodes: Vec<GraphNode>) -> R<Graph> {
        if Self::ctx(st, ctx)?.graphs.len() >= MAX_GRAPHS {
            return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("a context holds at most {MAX_GRAPHS} graphs")));
        }
        let c = st.ctxs.get(&ctx).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("no context {ctx}")))?;
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let (mut nodes_out, mut kernels, mut copied, mut charged) = (Vec::with_capacity(nodes.len()), 0, 0, host_cost::GRAPH);
        let mut modules: Vec<Arc<Charge>> = Vec::new();
        let mut local_reserve = 0;
        for (i, n) in nodes.into_iter().enumerate() {
            let at = |r: Reply| match r {
                Reply::Error(code, msg) => err(code, format!("graph node {i}: {msg}")),
                other => other,
            };
            charged += host_cost::GRAPH_NODE;
            nodes_out.push(match n {
                GraphNode::Kernel(k, params) => {
                    let (module, index, reserve) = Self::kernel(c, k.func, params.len()).map_err(at)?;
                    local_reserve = local_reserve.max(reserve);
                    if let Some(held) = c.funcs.get(&k.func).and_then(|(mid, _)| c.module_charges.get(mid)) {
                        if !modules.iter().any(|m| Arc::ptr_eq(m, held)) {
                            modules.push(held.clone());
                        }
                    }
                    kernels += 1;
                    charged += params.len() as u64;
                    GraphWork::Kernel { module, index, launch: Launch { grid: k.grid, block: k.block, shared_bytes: k.shared_bytes }, params }
                }
                GraphNode::Memset(m) => {
                    let (dptr, count, elem) = Self::fill(st, m.dptr, m.value, m.elem_size, m.count).map_err(at)?;
                    GraphWork::Fill { dptr, count, elem }
                }
                GraphNode::Copy(cp) => {
                    Self::owned(st, cp.src, cp.size, "copy source").map_err(at)?;
                    Self::owned(st, cp.dst, cp.size, "copy destination").map_err(at)?;
                    copied += cp.size;
                    GraphWork::Copy { dst: cp.dst, src: cp.src, size: cp.size }
                }
            });
        }
        // Its kernels' local memory before the driver builds it (it may
        // take it then).
        self.reserve_local(t, st, local_reserve)?;
        // Charged to the tenant, not to the context: a launch still queued
        // may hold the graph past its context (`Graph::drop` releases it).
        t.host.reserve(charged, "a graph")?;
        let mut g = Graph {
            nodes: nodes_out,
            native: None,
            kernels,
            copied,
            serial,
            local_reserve,
            _charge: Charge { budget: t.host.clone(), bytes: charged },
            _modules: modules,
            backend: self.backend.clone(),
            slot: t.slot,
        };
        // (Dropped on failure: its charge goes back.)
        g.native = guarded(|| self.backend.graph_create(t.slot, &g.ops()))?;
        Ok(g)
    }

    fn ctx(st: &mut TenantState, id: u32) -> R<&mut Ctx> {
        let c = st.ctxs.get_mut(&id).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("no context {id}")))?;
        if let Some((code, msg)) = &c.sticky {
            return Err(err(*code, format!("context is unusable after an earlier fault: {msg}")));
        }
        Ok(c)
    }

    fn stream_ok(c: &Ctx, s: u32) -> R<()> {
        if s == DEFAULT_STREAM || c.streams.contains(&s) {
            Ok(())
        } else {
            Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no stream {s}")))
        }
    }

    fn owned(st: &TenantState, addr: u64, len: u64, what: &str) -> R<()> {
        if len == 0 {
            return Ok(());
        }
        if st.owned.find(addr, len).is_none() {
            return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, format!("{what} range {addr:#x}+{len} is not inside one of this tenant's allocations")));
        }
        Ok(())
    }

    /// The host side of a copy: region or blob `id` at `off`, `len` bytes.
    fn host_mem(conn: &Conn, loc: u32, id: u32, off: u64, len: u64, inline: Option<Vec<u8>>) -> R<HostMem> {
        if loc == DataLoc::Inline as u32 {
            return Ok(inline.map(HostMem::Inline).unwrap_or(HostMem::Reply));
        }
        if loc == DataLoc::Blob as u32 {
            let b = conn.blobs.as_ref().ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_VALUE, "blob copies need a virtio-gpu context"))?;
            // Checked now for the error; resolved again when the copy runs.
            b.pieces(id, off, len).map_err(|e| err(CuResult::CUDA_ERROR_INVALID_VALUE, e))?;
            return Ok(HostMem::Blob(b.clone(), id, off));
        }
        let shm = conn.regions.get(&id).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_VALUE, format!("no shared region {id} registered")))?;
        if off.checked_add(len).is_none_or(|e| e > shm.len() as u64) {
            return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, format!("shared region {id} range {off}+{len} exceeds its {} bytes", shm.len())));
        }
        Ok(HostMem::Shm(shm.clone(), off))
    }

    fn timed<T>(&self, t: &Tenant, f: impl FnOnce() -> Result<T, BackendError>) -> Result<T, BackendError> {
        let (out, dt) = self.sched.run(&t.name, f).map_err(|e| BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("no lane: {e}")))?;
        t.device_ns.fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Charges `n` host bytes to the tenant on behalf of context `c`.
    fn charge(t: &Tenant, c: &mut Ctx, n: u64, what: &str) -> R<()> {
        t.host.reserve(n, what)?;
        c.charged += n;
        Ok(())
    }

    fn uncharge(t: &Tenant, c: &mut Ctx, n: u64) {
        t.host.release(n);
        c.charged = c.charged.saturating_sub(n);
    }

    fn dispatch(&self, t: &Tenant, conn: &mut Conn, req: Request) -> R<Reply> {
        let mut st = t.state.lock();
        let st = &mut *st;
        // Checked under the state lock: removal revokes before it takes
        // the lock, so nothing is created after the tenant's teardown.
        if t.revoked.load(Ordering::Acquire) {
            return Err(err(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("tenant {} was deleted", t.name)));
        }
        Ok(match req {
            Request::Ping => Reply::Empty,
            Request::GetDeviceInfo => Reply::DeviceInfo(self.device_info(t, st.used)),
            Request::GetDeviceAttributes => {
                let mut table = match &self.backend.desc().attributes {
                    Some(hw) => hw.clone(),
                    None => virtio_gpu_compute::attrs::reference_table(&self.device_info(t, st.used)),
                };
                virtio_gpu_compute::attrs::vgpu_view(&mut table);
                Reply::Attributes(table)
            }
            Request::GetTenantInfo => Reply::TenantInfo(TenantInfo {
                name: fixed_name(&t.name),
                quota: t.quota(),
                used: st.used,
                kernels: t.kernels.load(Ordering::Relaxed),
                device_ns: self.sched.device_time(&t.name, Duration::from_nanos(t.device_ns.load(Ordering::Relaxed))).as_nanos() as u64,
                bytes_scrubbed: t.scrubbed.load(Ordering::Relaxed),
                weight: t.share().weight,
                flags: virtio_gpu_compute::msg::TENANT_FLAGS_SET | if self.backend.desc().interprets_ptx() { virtio_gpu_compute::msg::TENANT_INTERPRETS_PTX } else { 0 },
            }),
            Request::GetProcesses => Reply::Processes(Self::processes(st)),
            Request::MemGetInfo => {
                self.sweep_retired(t, st);
                Reply::MemInfo(MemInfoReply { free: self.free_for(t, st.used), total: t.quota() })
            }
            Request::RegisterShm(_) => return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, "RegisterShm must carry a memfd")),
            Request::CtxCreate(b) => {
                if b.flags & !0x1f != 0 {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, format!("unsupported context flags {:#x}", b.flags)));
                }
                if st.ctxs.len() >= MAX_CONTEXTS {
                    return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many contexts"));
                }
                if vgpu_arbiter::fatal::marked() {
                    // No context works in this process again; the
                    // tenant's next executor makes it.
                    return Err(err(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, "this executor is ending after a fault; connect again for a new context"));
                }
                t.host.reserve(host_cost::CONTEXT, "a context")?;
                let id = st.handle();
                st.ctxs.insert(id, Ctx { charged: host_cost::CONTEXT, pid: b.pid, ..Ctx::default() });
                conn.ctxs.push(id);
                Reply::Handle(id)
            }
            Request::CtxDestroy(b) => {
                if !self.destroy_ctx(t, st, b.ctx) {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("no context {}", b.ctx)));
                }
                conn.ctxs.retain(|c| *c != b.ctx);
                Reply::Empty
            }
            Request::CtxSynchronize(b) => {
                Self::ctx(st, b.ctx)?;
                Reply::Empty
            }
            Request::MemAlloc(b) => {
                Self::ctx(st, b.ctx)?;
                Reply::Ptr(self.alloc_for(t, st, b.ctx, b.size, false)?)
            }
            Request::MemFree(b) => {
                Self::ctx(st, b.ctx)?;
                if st.alloc_ctx.get(&b.dptr) != Some(&b.ctx) || st.ctxs.values().any(|c| c.module_data.values().any(|v| v.contains(&b.dptr))) {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, format!("{:#x} is not an allocation of this context", b.dptr)));
                }
                self.free_alloc(t, st, b.dptr);
                Reply::Empty
            }
            Request::AttachRing(_) | Request::GetConnStats => return Err(err(CuResult::CUDA_ERROR_NOT_SUPPORTED, "this request is answered by the connection's transport")),
            Request::RingKick => Reply::Empty,
            Request::UnregisterShm(b) => {
                if !conn.regions.contains_key(&b.id) {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_VALUE, format!("no shared region {}", b.id)));
                }
                self.set_shm(conn, b.id, None);
                Reply::Empty
            }
            // Listed, not guarded: a new request must be placed here.
            Request::Memset(_)
            | Request::MemcpyHtoD(..)
            | Request::MemcpyDtoH(_)
            | Request::MemcpyDtoD(_)
            | Request::LaunchKernel(..)
            | Request::StreamWait(_)
            | Request::EventRecord(_)
            | Request::GraphLaunch(_) => {
                return Err(err(CuResult::CUDA_ERROR_UNKNOWN, "stream-ordered request reached the immediate path"));
            }
            Request::GraphCreate(b, nodes) => {
                let graph = self.build_graph(t, st, b.ctx, nodes)?;
                let id = st.handle();
                Self::ctx(st, b.ctx)?.graphs.insert(id, Arc::new(graph));
                Reply::Handle(id)
            }
            Request::GraphDestroy(b) => {
                let c = Self::ctx(st, b.ctx)?;
                c.graphs.remove(&b.handle).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no graph {}", b.handle)))?;
                self.sweep_retired(t, st);
                // It goes, and its charge with it, once launches queued
                // with it ran.
                Reply::Empty
            }
            Request::ModuleLoad(b, image) => {
                if Self::ctx(st, b.ctx)?.modules.len() >= 1024 {
                    return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many modules"));
                }
                let format = ImageFormat::sniff(&image);
                // Variables the driver places itself count against the
                // quota before they take device memory.
                let placed = self.backend.placed_bytes(&image, format, t.host.left()).inspect_err(|e| {
                    if e.host_budget {
                        t.host.note_refusal(&e.msg);
                    }
                })?;
                if placed > 0 {
                    self.sweep_retired(t, st);
                    if placed > t.quota().saturating_sub(st.used) {
                        return Err(err(
                            CuResult::CUDA_ERROR_OUT_OF_MEMORY,
                            format!("the module's variables take {placed} bytes of device memory, more than the quota leaves ({} of {} bytes used)", st.used, t.quota()),
                        ));
                    }
                }
                let mut data = Vec::new();
                let loaded = self.backend.load_module(t.slot, &image, format, t.host.left(), &mut |size, read_only| {
                    let a = self.alloc_for(t, st, b.ctx, size, read_only).map_err(|e| reply_error(e, "the module's variables"))?;
                    data.push(a);
                    Ok(a)
                });
                if let Err(e) = &loaded {
                    if e.host_budget {
                        t.host.note_refusal(&e.msg);
                    }
                }
                // Charged to the tenant, not to the context: a graph may
                // keep the module past its unload (`Charge` releases it).
                let charged = loaded.and_then(|m| {
                    let bytes = m.host_bytes();
                    t.host.reserve(bytes, "the loaded module").map_err(|e| reply_error(e, "the module"))?;
                    Ok((m, Arc::new(Charge { budget: t.host.clone(), bytes })))
                });
                let (m, charge) = match charged {
                    Ok(m) => m,
                    Err(e) => {
                        for a in data {
                            self.free_alloc(t, st, a);
                        }
                        return Err(e.into());
                    }
                };
                let id = st.handle();
                let c = Self::ctx(st, b.ctx)?;
                c.modules.insert(id, m);
                c.module_charges.insert(id, charge);
                if !data.is_empty() {
                    c.module_data.insert(id, data);
                }
                if placed > 0 {
                    c.module_placed.insert(id, placed);
                    c.used += placed;
                    st.used += placed;
                    t.used.store(st.used, Ordering::Relaxed);
                }
                Reply::Handle(id)
            }
            Request::ModuleUnload(b) => {
                let c = Self::ctx(st, b.ctx)?;
                let Some(m) = c.modules.remove(&b.module) else {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no module {}", b.module)));
                };
                if let Some(placed) = c.module_placed.remove(&b.module) {
                    st.retired.push((m, b.ctx, placed));
                } else {
                    drop(m);
                }
                let c = Self::ctx(st, b.ctx)?;
                // Its own charge goes with its last holder.
                c.module_charges.remove(&b.module);
                let mut freed = 0;
                c.funcs.retain(|_, (mid, f)| {
                    let keep = *mid != b.module;
                    if !keep {
                        freed += host_cost::FUNCTION + f.params.len() as u64 * host_cost::PARAM;
                    }
                    keep
                });
                c.func_ids.retain(|(mid, _), _| *mid != b.module);
                Self::uncharge(t, c, freed);
                for a in c.driver_globals.remove(&b.module).unwrap_or_default() {
                    Arc::make_mut(&mut st.owned).0.remove(&a);
                }
                self.sweep_retired(t, st);
                let Some(c) = st.ctxs.get_mut(&b.ctx) else { return Ok(Reply::Empty) };
                let data = c.module_data.remove(&b.module).unwrap_or_default();
                for a in data {
                    self.free_alloc(t, st, a);
                }
                Reply::Empty
            }
            Request::ModuleGetFunction(b, name) => {
                let c = Self::ctx(st, b.ctx)?;
                let m = c.modules.get(&b.module).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no module {}", b.module)))?;
                let f = m.function(&name).ok_or_else(|| err(CuResult::CUDA_ERROR_NOT_FOUND, format!("no kernel named '{name}' in module {}", b.module)))?;
                let reply = FunctionReply { func: 0, num_params: f.params.len() as u32, params_size: f.params_size, reserved: 0 };
                if let Some(&id) = c.func_ids.get(&(b.module, f.index)) {
                    return Ok(Reply::Function(FunctionReply { func: id, ..reply }, f.params));
                }
                if c.funcs.len() >= 65536 {
                    return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many functions"));
                }
                Self::charge(t, c, host_cost::FUNCTION + f.params.len() as u64 * host_cost::PARAM, "a function handle")?;
                let params = f.params.clone();
                let id = st.handle();
                let c = Self::ctx(st, b.ctx)?;
                c.func_ids.insert((b.module, f.index), id);
                c.funcs.insert(id, (b.module, f));
                Reply::Function(FunctionReply { func: id, ..reply }, params)
            }
            Request::ModuleGetGlobal(b, name) => {
                let c = Self::ctx(st, b.ctx)?;
                let m = c.modules.get(&b.module).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no module {}", b.module)))?;
                let (addr, size) = m.global(&name).ok_or_else(|| err(CuResult::CUDA_ERROR_NOT_FOUND, format!("no variable named '{name}' in module {}", b.module)))?;
                if size > 0 && st.owned.find(addr, size).is_none() {
                    Arc::make_mut(&mut st.owned).0.insert(addr, size);
                    Self::ctx(st, b.ctx)?.driver_globals.entry(b.module).or_default().push(addr);
                }
                Reply::Global(addr, size)
            }
            Request::StreamCreate(b) => {
                let c = Self::ctx(st, b.ctx)?;
                if c.streams.len() >= 4096 {
                    return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many streams"));
                }
                Self::charge(t, c, host_cost::STREAM, "a stream")?;
                let id = st.handle();
                Self::ctx(st, b.ctx)?.streams.insert(id);
                Reply::Handle(id)
            }
            Request::EventCreate(b) => {
                let c = Self::ctx(st, b.ctx)?;
                if c.events.len() >= 65536 {
                    return Err(err(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many events"));
                }
                Self::charge(t, c, host_cost::EVENT, "an event")?;
                let id = st.handle();
                Self::ctx(st, b.ctx)?.events.insert(id, None);
                Reply::Handle(id)
            }
            Request::StreamDestroy(b) => {
                let c = Self::ctx(st, b.ctx)?;
                if !c.streams.remove(&b.handle) {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no stream {}", b.handle)));
                }
                Self::uncharge(t, c, host_cost::STREAM);
                Reply::Empty
            }
            Request::StreamSynchronize(b) => {
                // Work runs to completion in order before its reply, so a
                // synchronize only validates the handle.
                let c = Self::ctx(st, b.ctx)?;
                Self::stream_ok(c, b.handle)?;
                Reply::Empty
            }
            Request::EventSynchronize(b) => {
                let c = Self::ctx(st, b.ctx)?;
                c.events.get(&b.handle).ok_or_else(|| err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no event {}", b.handle)))?;
                Reply::Empty
            }
            Request::EventElapsedTime(b) => {
                let c = Self::ctx(st, b.ctx)?;
                let get = |h: u32| -> R<Instant> {
                    match c.events.get(&h) {
                        Some(Some((_, i))) => Ok(*i),
                        Some(None) => Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("event {h} was never recorded"))),
                        None => Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no event {h}"))),
                    }
                };
                let (s, e) = (get(b.start)?, get(b.end)?);
                let ms = if e >= s { (e - s).as_secs_f64() * 1e3 } else { -((s - e).as_secs_f64() * 1e3) };
                Reply::Elapsed(ms as f32)
            }
            Request::EventDestroy(b) => {
                let c = Self::ctx(st, b.ctx)?;
                if c.events.remove(&b.handle).is_none() {
                    return Err(err(CuResult::CUDA_ERROR_INVALID_HANDLE, format!("no event {}", b.handle)));
                }
                Self::uncharge(t, c, host_cost::EVENT);
                Reply::Empty
            }
        })
    }
}
