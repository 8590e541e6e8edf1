//! The control plane: starts one worker process per device, restarts a
//! worker that dies (re-creating its tenants), places tenants and keeps the
//! registry the REST API serves.

pub mod api;
pub mod executors;
pub mod logrelay;
pub mod meter;
pub mod mps;
pub mod passthrough;
pub mod pool;

pub mod rundir;
pub mod store;
pub mod tap;
pub mod vms;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{error, info, warn};

use crate::config::{Owner, TenantSpec};
use crate::ipc::{CmdLine, DeviceStats, MsgLine, TenantCmd, WorkerCmd, WorkerMsg};
use crate::size::Size;

/// How long the control plane waits for a worker's answer. No lock of the
/// registry is held meanwhile, so a slow worker delays only its own call.
pub const STATS_TIMEOUT: Duration = Duration::from_secs(2);
/// Lines a worker's or executor's messages may put in the log at once,
/// and a second after that; the longest message logged.
const REPLY_LOG_BURST: f64 = 20.0;
const REPLY_LOG_PER_SEC: f64 = 1.0;
const REPLY_LOG_MAX: usize = 1024;
/// How long statistics are waited for from an executor whose last answer
/// was late: one stalled executor does not hold up every view of its
/// device (a healthy one answers in well under a millisecond).
pub const SLOW_STATS_WAIT: Duration = Duration::from_millis(100);
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(15);
/// How long `DELETE /tenants/NAME` waits for the teardown before it
/// answers 202 (still releasing) instead of 204.
pub const DELETE_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    InsufficientMemory(String),
    #[error("device worker {0} is unavailable (restarting)")]
    WorkerDown(String),
    #[error("device worker {0} did not answer within {1:?}")]
    Timeout(String, Duration),
    #[error("device worker error: {0}")]
    Worker(String),
    /// A failure of the host's (sysfs, the state directory), not the caller's.
    #[error("{0}")]
    Internal(String),
    /// The state directory could not record a change.
    #[error("saving to the state directory: {0}")]
    Store(#[from] store::StoreError),
    /// The state directory could not record a change to a live tenant: it
    /// was taken back (`live` false), or could not be and runs until a
    /// restart of the daemon undoes it.
    #[error("{}: {source}", if *live { "the change is live but could not be saved, so a restart of the daemon undoes it" } else { "nothing changed: the change could not be saved" })]
    NotSaved {
        live: bool,
        #[source]
        source: store::StoreError,
    },
    /// No executor uid could be given out for `who`.
    #[error("no executor uid for {who}: {err}")]
    Uid {
        who: String,
        #[source]
        err: executors::UidError,
    },
}

pub struct DeviceSpec {
    pub name: String,
    pub ordinal: u32,
    /// Memory tenants may be placed into.
    pub memory: u64,
    pub budget: u64,
    pub lanes: u32,
    /// Wall-clock limit of one kernel launch (milliseconds).
    pub launch_timeout_ms: u64,
    /// Compute capability a CPU device reports (GPUs report their own).
    pub cc: (u32, u32),
    /// The worker installs its seccomp allow-lists.
    pub seccomp: bool,
    /// Executor threads the worker serves tenant sockets with.
    pub connection_threads: u32,
    /// Set for an NVIDIA GPU or MIG instance; None for a CPU device.
    pub cuda: Option<CudaSpec>,
    /// The host NUMA node the device is attached to (-1: unknown).
    pub numa_node: i32,
    /// Host RAM the device's allocations may spill to once its memory is
    /// full (overcommit).
    pub spill: u64,
    /// The nice value the worker runs kernels at (0: off).
    pub compute_nice: i32,
    /// Whether the worker pins each lane to a core (CPU devices).
    pub pin_lanes: bool,
    /// Each tenant on the device gets an executor process of its own, and
    /// the device's worker becomes its arbiter (control/executors.rs).
    pub executors: bool,
}

/// How a `cuda` worker finds its device.
#[derive(Debug, Clone)]
pub struct CudaSpec {
    /// `CUDA_VISIBLE_DEVICES` for the worker: the GPU or MIG UUID.
    pub visible_devices: String,
    pub numa_node: i32,
}

impl DeviceSpec {
    pub fn kind(&self) -> &'static str {
        if self.cuda.is_some() {
            "cuda"
        } else {
            "cpu"
        }
    }
}

/// The pipe to one running worker: commands go out tagged with an id, a
/// reader thread hands each reply to the call waiting for that id and
/// each event (id 0) to the control plane.
struct WorkerLink {
    /// None once closed: the process reads EOF and ends.
    stdin: Mutex<Option<ChildStdin>>,
    pending: Mutex<HashMap<u64, mpsc::Sender<WorkerMsg>>>,
    next: AtomicU64,
    /// Replies that came after their caller had stopped waiting: the
    /// process is slow, not stalled. Counted only for commands given up
    /// on (`abandoned`, the latest [`MAX_ABANDONED`]), so that a process
    /// cannot count made-up answers.
    late: AtomicU64,
    abandoned: Mutex<std::collections::VecDeque<u64>>,
}

/// Commands given up on that a process's late answers are matched to.
const MAX_ABANDONED: usize = 64;

impl WorkerLink {
    fn new(stdin: ChildStdin) -> WorkerLink {
        WorkerLink { stdin: Mutex::new(Some(stdin)), pending: Mutex::new(HashMap::new()), next: AtomicU64::new(0), late: AtomicU64::new(0), abandoned: Mutex::new(std::collections::VecDeque::new()) }
    }

    /// Closes the process's stdin: it finishes what it does and ends.
    fn close(&self) {
        self.stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

pub struct DeviceSlot {
    pub spec: DeviceSpec,
    /// The device's worker, or with executors its arbiter.
    link: Mutex<Option<Arc<WorkerLink>>>,
    /// With executors: the arbiter's intake for grant channels.
    intake: Mutex<Option<std::os::unix::net::UnixDatagram>>,
    /// With executors: each tenant's executor.
    execs: Mutex<HashMap<String, Arc<executors::Exec>>>,
    /// With executors: the address windows live executors hold.
    windows: Mutex<std::collections::BTreeSet<u64>>,
    /// With executors: held while one is started.
    starting: Mutex<()>,
    /// With executors: each tenant's listening socket, kept across its
    /// executors, so a client that connects while one is replaced waits in
    /// the backlog for the next instead of being refused.
    sockets: Mutex<HashMap<String, std::os::unix::net::UnixListener>>,
    /// With executors: per tenant, how many of its executors in a row
    /// ended soon after they started (the restart backoff's exponent).
    quick_ends: Mutex<HashMap<String, u32>>,
    pub pid: AtomicU32,
    pub restarts: AtomicU64,
    /// Bumped at every worker start: a tenant added to an older worker
    /// must be added again.
    generation: AtomicU64,
    /// The MPS control daemon, while the device is in a pool whose
    /// sharing is `mps` and has had an executor (control/mps.rs).
    mps: Mutex<Option<Arc<mps::MpsDaemon>>>,
    /// The uid its MPS daemon and clients run as, once one was taken from
    /// the executor range: kept for the mediator's life.
    mps_uid: Mutex<Option<u32>>,
    /// When an MPS client's unexplained end last ended its co-clients.
    mps_cascade_at: Mutex<Option<std::time::Instant>>,
    /// Its MPS rebalancer (control/mps.rs `request_rebalance`).
    mps_rebalance: Mutex<Rebalancer>,
    /// Tenants whose executors are being asked for a new share of the
    /// SMs, each with whether a pass skipped it meanwhile.
    mps_asking: Mutex<HashMap<String, bool>>,
    /// Held while one of its executors is retired and replaced for a new
    /// share of the SMs.
    mps_turn: Mutex<()>,
    /// Set while its arbiter is restarted on purpose (its pool's sharing
    /// changed its lanes): not a crash.
    relaunching: AtomicBool,
}

/// A GPU's MPS rebalancer: whether its thread runs, and whether another
/// pass is wanted.
#[derive(Default)]
struct Rebalancer {
    running: bool,
    again: bool,
}

impl DeviceSlot {
    fn call(&self, cmd: WorkerCmd, timeout: Duration) -> Result<WorkerMsg, ControlError> {
        let link = self.link.lock().unwrap_or_else(|e| e.into_inner()).clone();
        call_link(link.as_deref(), &self.spec.name, cmd, timeout)
    }
}

/// Sends `cmd` to a worker, arbiter or executor (`who`, for errors) and
/// waits up to `timeout` for its reply.
fn call_link(link: Option<&WorkerLink>, who: &str, cmd: WorkerCmd, timeout: Duration) -> Result<WorkerMsg, ControlError> {
    let link = link.ok_or_else(|| ControlError::WorkerDown(who.to_string()))?;
    let deadline = Instant::now() + timeout;
    let sent = send_link(link, who, cmd, deadline, timeout)?;
    wait_link(link, who, sent, deadline, timeout)
}

/// A command written to a process, its reply to come.
struct Sent {
    id: u64,
    rx: mpsc::Receiver<WorkerMsg>,
}

/// Writes `cmd` to the process by `deadline` (`timeout` names it in the
/// error); [`wait_link`] takes its reply.
fn send_link(link: &WorkerLink, who: &str, cmd: WorkerCmd, deadline: Instant, timeout: Duration) -> Result<Sent, ControlError> {
    let id = link.next.fetch_add(1, Ordering::Relaxed) + 1;
    let (tx, rx) = mpsc::channel();
    link.pending.lock().unwrap_or_else(|e| e.into_inner()).insert(id, tx);
    let forget = || {
        link.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    };
    let line = match serde_json::to_string(&CmdLine { id, cmd }) {
        Ok(l) => l + "\n",
        Err(e) => {
            forget();
            return Err(ControlError::Internal(e.to_string()));
        }
    };
    let mut wrote = 0;
    let sent = {
        let mut w = link.stdin.lock().unwrap_or_else(|e| e.into_inner());
        let sent = match w.as_ref() {
            Some(p) => write_before(p, line.as_bytes(), deadline, &mut wrote),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        if sent.is_err() && wrote > 0 {
            // Part of a command is in the pipe: the next would be read
            // glued to it. The process's input ends here instead (it
            // then ends, and is started again).
            warn!(process = who, "a command could be written only in part before its deadline: the process's input is closed");
            *w = None;
        }
        sent
    };
    if let Err(e) = sent {
        forget();
        return Err(match e.kind() {
            std::io::ErrorKind::TimedOut if wrote == 0 => ControlError::Timeout(who.to_string(), timeout),
            _ => ControlError::WorkerDown(who.to_string()),
        });
    }
    Ok(Sent { id, rx })
}

/// The reply to a command [`send_link`] wrote, if it comes by `deadline`
/// (`timeout` names it in the error); a reply later than that is dropped.
fn wait_link(link: &WorkerLink, who: &str, sent: Sent, deadline: Instant, timeout: Duration) -> Result<WorkerMsg, ControlError> {
    match sent.rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(m) => Ok(m),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            link.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&sent.id);
            let mut given_up = link.abandoned.lock().unwrap_or_else(|e| e.into_inner());
            if given_up.len() >= MAX_ABANDONED {
                given_up.pop_front();
            }
            given_up.push_back(sent.id);
            Err(ControlError::Timeout(who.to_string(), timeout))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(ControlError::WorkerDown(who.to_string())),
    }
}

impl DeviceSlot {
    /// Gives the tenant `to`'s share on the device, and its quota where it
    /// differs from `was`: through its executor, or the device's worker.
    fn set_share(&self, to: &TenantRecord, was: u64) -> Result<WorkerMsg, ControlError> {
        let share = crate::sched::Share { weight: to.weight, cap: to.cap, priority: to.priority };
        let quota = (to.memory != was).then_some(to.memory);
        if self.spec.executors {
            self.set_on_executor(to, share, quota)
        } else {
            self.call(WorkerCmd::SetTenant { name: to.name.clone(), share: Some(share), quota }, COMMAND_TIMEOUT)
        }
    }

    pub fn is_up(&self) -> bool {
        self.link.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// The worker's statistics, or None if it is down or slow to answer.
    /// With executors: the arbiter's, with each executor's tenant.
    pub fn stats(&self) -> Option<DeviceStats> {
        self.sourced_stats().map(|(s, _)| s)
    }

    /// The worker's statistics, and for each tenant whose executor
    /// answered, that executor's pid (whose counts its kernels and bytes
    /// are).
    pub fn sourced_stats(&self) -> Option<(DeviceStats, HashMap<String, u32>)> {
        let s = match self.call(WorkerCmd::Stats, STATS_TIMEOUT) {
            Ok(WorkerMsg::Stats(s)) => s,
            _ => return None,
        };
        Some(if self.spec.executors { self.with_executors(s) } else { (s, HashMap::new()) })
    }
}

/// Where a tenant is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TenantPhase {
    /// Placed (its memory is reserved); the worker is setting it up.
    Creating,
    Ready,
    /// Revoked; the worker is releasing its memory. Its quota stays
    /// reserved until that is done.
    Deleting,
}

/// A tenant, as the API reports it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = Tenant)]
pub struct TenantRecord {
    pub name: String,
    #[schema(value_type = crate::config::TenantKind)]
    pub kind: &'static str,
    /// Memory quota, bytes.
    pub memory: u64,
    pub weight: u32,
    /// Hard cap, percent of the device's time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cap: Option<u32>,
    pub priority: crate::sched::Priority,
    pub device: String,
    /// The pool the tenant was placed in.
    pub pool: String,
    /// The NUMA node of the tenant's device (-1: unknown).
    pub numa_node: i32,
    /// Path of the tenant socket, or the VM tenant's vhost-user socket.
    #[schema(value_type = String)]
    pub socket: PathBuf,
    pub state: TenantPhase,
    /// Owner of the tenant's socket; root when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    /// Mode of the tenant's socket, octal.
    pub mode: String,
    /// Host memory the tenant's objects may keep in its worker, bytes.
    pub host_memory: u64,
    /// Most client connections the tenant may hold at once.
    pub max_connections: u32,
    /// Its socket lies in `RUN_DIR/hidden/`, reached only through a
    /// bind mount.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub hidden: bool,
    /// Settings unmodified CUDA software needs in its environment on this
    /// tenant's device, besides `VGPU_SOCKET` (none on a GPU). On a CPU
    /// reference device: `CUPY_COMPILE_WITH_PTX=1`, since CuPy otherwise
    /// compiles its kernels to machine code the device cannot run.
    /// `vgpuctl tenant env` prints them with the socket; the Kubernetes
    /// node component puts them in the tenant's CDI spec.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// The environment programs need on a device of this kind (see
/// [`TenantRecord::env`]).
fn program_env(device: &DeviceSpec) -> BTreeMap<String, String> {
    virtio_gpu_compute::msg::program_env(device.cuda.is_none()).iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

impl TenantRecord {
    fn cmd(&self) -> TenantCmd {
        TenantCmd {
            name: self.name.clone(),
            quota: self.memory,
            weight: self.weight,
            cap: self.cap,
            priority: self.priority,
            socket: self.socket.clone(),
            vm: self.kind == "vm",
            host_limit: self.host_memory,
            max_connections: self.max_connections,
        }
    }

    fn mode_bits(&self) -> u32 {
        u32::from_str_radix(&self.mode, 8).unwrap_or(0o600)
    }

    /// The request that makes this tenant again, where it is now.
    pub fn spec(&self) -> TenantSpec {
        TenantSpec {
            name: self.name.clone(),
            memory: Size(self.memory),
            weight: self.weight,
            cap: self.cap,
            priority: self.priority,
            device: Some(self.device.clone()),
            pool: Some(self.pool.clone()),
            numa_node: None,
            kind: if self.kind == "vm" { crate::config::TenantKind::Vm } else { crate::config::TenantKind::Process },
            owner: self.owner,
            mode: Some(self.mode.clone()),
            host_memory: Some(Size(self.host_memory)),
            max_connections: Some(self.max_connections),
            hidden: self.hidden,
        }
    }
}

pub use vgpu_api::tenant::TenantChange;

/// Per-tenant limits applied where a tenant's description leaves them out.
#[derive(Debug, Clone, Copy)]
pub struct TenantDefaults {
    pub host_memory: u64,
    pub max_connections: u32,
    /// Most tenants held at once (`devices.max_tenants`).
    pub max_tenants: usize,
}

pub struct Control {
    /// Itself, for threads that outlive a call.
    me: std::sync::Weak<Control>,
    pub run_dir: PathBuf,
    exe: PathBuf,
    pub devices: Vec<Arc<DeviceSlot>>,
    tenants: Mutex<BTreeMap<String, TenantRecord>>,
    /// Signalled whenever a tenant's teardown completes.
    removed: Condvar,
    stopping: AtomicBool,
    defaults: TenantDefaults,
    /// Credentials the workers drop to (None: they keep ours).
    worker_user: Option<Owner>,
    /// The uids tenant executors run as, one each (when the daemon is root).
    exec_uids: Option<executors::UidRange>,
    /// Numbers executors' cgroups, so a tenant's next executor never joins
    /// the group of the one it replaces.
    exec_seq: std::sync::atomic::AtomicU64,
    /// Usage metering, once the daemon set it up.
    pub meter: std::sync::OnceLock<Arc<meter::Meter>>,
    /// Held by `set_tenant`.
    setting: Mutex<()>,
    /// Named pools; every device in none of them is in the default pool.
    /// Locked before the tenant registry when both are held.
    pools: Mutex<BTreeMap<String, pool::PoolSpec>>,
    /// The default pool's overcommit ratio.
    default_overcommit: f64,
    /// Managed VMs, once the daemon set them up.
    pub vms: std::sync::OnceLock<vms::Vms>,
    /// Devices lent whole to VMs, once the daemon set them up.
    pub passthrough: std::sync::OnceLock<Arc<passthrough::Passthrough>>,
    /// Where tenants and pools are saved, once the daemon set it up.
    pub store: std::sync::OnceLock<store::Store>,
    /// NVIDIA's MPS control daemon command (`devices.mps_control`).
    pub mps_control: std::sync::OnceLock<String>,
    /// The most tenants a GPU of an MPS pool serves (`devices.mps_max_clients`).
    pub mps_max_clients: std::sync::OnceLock<u32>,
}

impl Control {
    pub fn new(
        run_dir: &Path,
        exe: PathBuf,
        devices: Vec<DeviceSpec>,
        defaults: TenantDefaults,
        worker_user: Option<Owner>,
        default_overcommit: f64,
        exec_uids: Option<executors::UidRange>,
    ) -> Arc<Control> {
        Arc::new_cyclic(|me| Control {
            me: me.clone(),
            run_dir: run_dir.to_path_buf(),
            exe,
            devices: devices
                .into_iter()
                .map(|spec| {
                    Arc::new(DeviceSlot {
                        spec,
                        link: Mutex::new(None),
                        intake: Mutex::new(None),
                        execs: Mutex::new(HashMap::new()),
                        windows: Mutex::new(std::collections::BTreeSet::new()),
                        starting: Mutex::new(()),
                        sockets: Mutex::new(HashMap::new()),
                        quick_ends: Mutex::new(HashMap::new()),
                        pid: AtomicU32::new(0),
                        restarts: AtomicU64::new(0),
                        generation: AtomicU64::new(0),
                        mps: Mutex::new(None),
                        mps_uid: Mutex::new(None),
                        mps_cascade_at: Mutex::new(None),
                        mps_rebalance: Mutex::new(Rebalancer::default()),
                        mps_asking: Mutex::new(HashMap::new()),
                        mps_turn: Mutex::new(()),
                        relaunching: AtomicBool::new(false),
                    })
                })
                .collect(),
            tenants: Mutex::new(BTreeMap::new()),
            removed: Condvar::new(),
            stopping: AtomicBool::new(false),
            defaults,
            worker_user,
            exec_uids,
            exec_seq: std::sync::atomic::AtomicU64::new(0),
            meter: std::sync::OnceLock::new(),
            setting: Mutex::new(()),
            pools: Mutex::new(BTreeMap::new()),
            default_overcommit,
            vms: std::sync::OnceLock::new(),
            passthrough: std::sync::OnceLock::new(),
            store: std::sync::OnceLock::new(),
            mps_control: std::sync::OnceLock::new(),
            mps_max_clients: std::sync::OnceLock::new(),
        })
    }

    fn pool_map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, pool::PoolSpec>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every device: those workers serve, then those lent whole to VMs.
    fn device_names(&self) -> impl Iterator<Item = String> + '_ {
        let pass = self.passthrough.get().into_iter().flat_map(|p| p.devices.iter().map(|d| d.name.clone()));
        self.devices.iter().map(|d| d.spec.name.clone()).chain(pass)
    }

    /// The passthrough device named `name`.
    pub fn pass_device(&self, name: &str) -> Option<&Arc<passthrough::PassDevice>> {
        self.passthrough.get().and_then(|p| p.get(name))
    }

    /// The default pool: every device no named pool lists.
    fn default_pool(&self, named: &BTreeMap<String, pool::PoolSpec>) -> pool::PoolSpec {
        pool::PoolSpec {
            name: pool::DEFAULT_POOL.into(),
            devices: self.device_names().filter(|d| !named.values().any(|p| p.devices.contains(d))).collect(),
            access: pool::Access::Public,
            allow: Vec::new(),
            placement: pool::Placement::Spread,
            overcommit: self.default_overcommit,
            sharing: pool::Sharing::TimeSliced,
        }
    }

    fn find_pool(&self, named: &BTreeMap<String, pool::PoolSpec>, name: &str) -> Option<pool::PoolSpec> {
        if name == pool::DEFAULT_POOL {
            Some(self.default_pool(named))
        } else {
            named.get(name).cloned()
        }
    }

    /// The pool `device` is in.
    fn pool_of(&self, named: &BTreeMap<String, pool::PoolSpec>, device: &str) -> pool::PoolSpec {
        named.values().find(|p| p.devices.iter().any(|d| d == device)).cloned().unwrap_or_else(|| self.default_pool(named))
    }

    /// Every pool, the default one first.
    pub fn pools(&self) -> Vec<pool::PoolSpec> {
        let named = self.pool_map();
        std::iter::once(self.default_pool(&named)).chain(named.values().cloned()).collect()
    }

    pub fn pool(&self, name: &str) -> Option<pool::PoolSpec> {
        self.find_pool(&self.pool_map(), name)
    }

    /// Creates a pool of devices that are in the default pool and hold no
    /// tenants.
    pub fn create_pool(&self, spec: &pool::PoolSpec) -> Result<pool::PoolSpec, ControlError> {
        spec.validate().map_err(ControlError::BadRequest)?;
        self.overcommit_allowed(spec)?;
        if spec.sharing == pool::Sharing::Mps {
            self.mps_allowed(spec)?;
        }
        let mut named = self.pool_map();
        if spec.name == pool::DEFAULT_POOL || named.contains_key(&spec.name) {
            return Err(ControlError::Conflict(format!("pool {} already exists", spec.name)));
        }
        let tenants = self.registry();
        for d in &spec.devices {
            if self.slot(d).is_none() && self.pass_device(d).is_none() {
                return Err(ControlError::BadRequest(format!("pool {}: no device named {d}", spec.name)));
            }
            if let Some(p) = named.values().find(|p| p.devices.contains(d)) {
                return Err(ControlError::Conflict(format!("device {d} is already in pool {}", p.name)));
            }
            let on: Vec<&str> = tenants.values().filter(|t| &t.device == d).map(|t| t.name.as_str()).collect();
            if !on.is_empty() {
                return Err(ControlError::Conflict(format!("device {d} holds tenants ({}); a device joins a pool while it holds none", on.join(", "))));
            }
        }
        drop(tenants);
        named.insert(spec.name.clone(), spec.clone());
        if let Err(e) = self.save_pools(&named) {
            named.remove(&spec.name);
            return Err(e);
        }
        drop(named);
        info!(pool = %spec.name, devices = ?spec.devices, access = ?spec.access, placement = ?spec.placement, overcommit = spec.overcommit, sharing = ?spec.sharing, "pool created");
        if spec.sharing == pool::Sharing::Mps {
            // Their arbiters let every executor run at once from now on.
            self.relaunch_arbiters(&spec.devices);
        }
        Ok(spec.clone())
    }

    /// Changes a pool's access, allow-list, placement or overcommit. A
    /// lower overcommit must still cover the quotas placed on each device.
    /// Tenants already placed keep their device whatever the allow-list says.
    pub fn set_pool(&self, name: &str, change: &pool::PoolChange) -> Result<pool::PoolSpec, ControlError> {
        let mut named = self.pool_map();
        if name == pool::DEFAULT_POOL {
            return Err(ControlError::BadRequest("the default pool is public and spreads; its overcommit is devices.overcommit".into()));
        }
        let mut next = named.get(name).cloned().ok_or_else(|| ControlError::NotFound(format!("no pool {name}")))?;
        if let Some(a) = change.access {
            next.access = a;
            if a == pool::Access::Public && change.allow.is_none() {
                next.allow.clear();
            }
        }
        if let Some(a) = &change.allow {
            next.allow = a.clone();
        }
        if let Some(p) = change.placement {
            next.placement = p;
        }
        if let Some(o) = change.overcommit {
            next.overcommit = o;
        }
        next.validate().map_err(ControlError::BadRequest)?;
        self.overcommit_allowed(&next)?;
        let tenants = self.registry();
        for d in &next.devices {
            let (memory, reserved) = (self.slot(d).map(|s| s.spec.memory).unwrap_or(0), Self::reserved(&tenants, d));
            if reserved > next.capacity(memory) {
                return Err(ControlError::Conflict(format!("device {d} has {} of quotas placed; overcommit {} would allow only {}", Size(reserved), next.overcommit, Size(next.capacity(memory)))));
            }
        }
        drop(tenants);
        let before = named.insert(name.to_string(), next.clone());
        if let Err(e) = self.save_pools(&named) {
            named.extend(before.map(|b| (name.to_string(), b)));
            return Err(e);
        }
        info!(pool = %name, access = ?next.access, placement = ?next.placement, overcommit = next.overcommit, "pool changed");
        Ok(next)
    }

    /// Deletes a pool whose devices hold no tenants; they return to the
    /// default pool.
    pub fn delete_pool(&self, name: &str) -> Result<(), ControlError> {
        let mut named = self.pool_map();
        if name == pool::DEFAULT_POOL {
            return Err(ControlError::BadRequest("the default pool cannot be deleted".into()));
        }
        let p = named.get(name).ok_or_else(|| ControlError::NotFound(format!("no pool {name}")))?;
        let in_use: Vec<String> = self.registry().values().filter(|t| p.devices.contains(&t.device)).map(|t| t.name.clone()).collect();
        if !in_use.is_empty() {
            return Err(ControlError::Conflict(format!("pool {name} still has tenants: {}", in_use.join(", "))));
        }
        let gone = named.remove(name);
        if let Err(e) = self.save_pools(&named) {
            named.extend(gone.map(|p| (name.to_string(), p)));
            return Err(e);
        }
        drop(named);
        info!(pool = %name, "pool deleted");
        if let Some(p) = gone.filter(|p| p.sharing == pool::Sharing::Mps) {
            for slot in p.devices.iter().filter_map(|d| self.slot(d)) {
                self.stop_mps(slot);
            }
            // Back to one executor on the GPU at a time.
            self.relaunch_arbiters(&p.devices);
        }
        Ok(())
    }

    fn save_pools(&self, named: &BTreeMap<String, pool::PoolSpec>) -> Result<(), ControlError> {
        match self.store.get() {
            Some(s) => Ok(s.save_pools(named.values())?),
            None => Ok(()),
        }
    }

    /// Brings back the pools an earlier run saved (after the config
    /// file's). A saved pool the config file now declares is the config
    /// file's.
    pub fn restore_pools(&self, saved: &[pool::PoolSpec]) -> Result<(), String> {
        for p in saved {
            if self.store.get().is_some_and(|s| s.is_declared_pool(&p.name)) {
                warn!(pool = %p.name, "a saved pool has the name of one in the config file; the config file's stands and the saved one is forgotten");
                continue;
            }
            self.create_pool(p).map_err(|e| {
                format!(
                    "restoring pool {} saved in {}: {e}; change the config so it fits, or remove it from that file",
                    p.name,
                    self.store.get().map(|s| s.dir().join("pools.json").display().to_string()).unwrap_or_default()
                )
            })?;
        }
        // Saved again without the pools the config file now declares.
        let named = self.pool_map();
        self.save_pools(&named).map_err(|e| e.to_string())
    }

    /// Brings back the tenants an earlier run saved, on the devices and
    /// pools they were placed on, with the same sockets.
    pub fn restore_tenants(&self, saved: &[(TenantSpec, PathBuf)]) -> Result<(), String> {
        for (spec, path) in saved {
            if let Some(s) = self.store.get().filter(|s| s.is_declared_tenant(&spec.name)) {
                // The config file's stands, now and after it drops the name.
                warn!(tenant = %spec.name, "a saved tenant has the name of one in the config file; the config file's stands and the saved one is forgotten");
                if let Err(e) = s.remove_tenant(&spec.name) {
                    warn!(tenant = %spec.name, "{e}");
                }
                continue;
            }
            if self.tenant(&spec.name).is_some() {
                continue;
            }
            // Tenants already made come back even past devices.max_tenants
            // (lowered since): only new ones are refused.
            self.create_tenant_within(spec, usize::MAX).map_err(|e| format!("restoring tenant {} from {}: {e}; fix the cause, or move the file away to drop the tenant", spec.name, path.display()))?;
            info!(tenant = %spec.name, device = ?spec.device, "tenant restored from the state directory");
        }
        Ok(())
    }

    /// Overcommit needs the device-wide memory that process isolation does
    /// not broker yet.
    fn overcommit_allowed(&self, spec: &pool::PoolSpec) -> Result<(), ControlError> {
        match spec.devices.iter().find(|d| spec.overcommit > 1.0 && self.slot(d).is_some_and(|s| s.spec.executors)) {
            Some(d) => Err(ControlError::BadRequest(format!("pool {}: device {d} isolates tenants in processes, which does not support overcommit yet", spec.name))),
            None => Ok(()),
        }
    }

    /// How placement sees `device` in `pool`.
    fn candidate(&self, tenants: &BTreeMap<String, TenantRecord>, pool: &pool::PoolSpec, slot: &DeviceSlot) -> pool::Candidate {
        let name = &slot.spec.name;
        pool::Candidate {
            name: name.clone(),
            ordinal: slot.spec.ordinal,
            numa_node: slot.spec.numa_node,
            capacity: pool.capacity(slot.spec.memory),
            reserved: Self::reserved(tenants, name),
            holds: slot.spec.memory.saturating_add(slot.spec.spill),
            tenants: tenants.values().filter(|t| &t.device == name).count(),
        }
    }

    /// At start, once every tenant is back: the meter forgets the usage
    /// totals of tenants the daemon no longer has.
    pub fn prune_usage(&self) {
        if let Some(m) = self.meter.get() {
            let live: std::collections::HashSet<String> = self.registry().keys().cloned().collect();
            m.retain_tenants(&live);
        }
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, TenantRecord>> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts every worker and a supervisor thread for each; returns once
    /// all workers are up (or failed their first start).
    pub fn start(self: &Arc<Self>) -> Result<(), String> {
        for slot in &self.devices {
            let child = self.launch(slot).map_err(|e| format!("starting worker for {}: {e}", slot.spec.name))?;
            let (me, slot) = (self.clone(), slot.clone());
            std::thread::Builder::new().name(format!("supervise-{}", slot.spec.name)).spawn(move || me.supervise(slot, child)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Starts `slot`'s worker and the thread that reads its replies.
    fn launch(self: &Arc<Self>, slot: &Arc<DeviceSlot>) -> std::io::Result<Child> {
        let role = if slot.spec.executors {
            let (ours, theirs) = std::os::unix::net::UnixDatagram::pair()?;
            *slot.intake.lock().unwrap_or_else(|e| e.into_inner()) = Some(ours);
            // Under MPS every executor of the GPU runs at once.
            let lanes = if self.sharing_of(&slot.spec.name) == pool::Sharing::Mps { self.mps_clients() } else { slot.spec.lanes };
            Role::Arbiter(theirs.into(), lanes)
        } else {
            Role::Worker
        };
        let (child, stdin, stdout, pid) = spawn_worker(&self.exe, &slot.spec, self.worker_user, role)?;
        let link = Arc::new(WorkerLink::new(stdin));
        let (me, l2, name) = (self.clone(), link.clone(), slot.spec.name.clone());
        std::thread::Builder::new().name(format!("replies-{name}")).spawn(move || me.read_replies(&name, stdout, &l2))?;
        slot.generation.fetch_add(1, Ordering::AcqRel);
        *slot.link.lock().unwrap_or_else(|e| e.into_inner()) = Some(link);
        slot.pid.store(pid, Ordering::Relaxed);
        Ok(child)
    }

    fn read_replies(&self, device: &str, stdout: BufReader<ChildStdout>, link: &WorkerLink) {
        self.read_replies_then(device, stdout, link, None, |_| {}, |_| {})
    }

    /// As `read_replies`, calling `removed` after a tenant's removal and
    /// `fatal` when the process says it ends on an unrecoverable error.
    /// With `only` (an executor), events about any other tenant are
    /// ignored.
    fn read_replies_then(&self, device: &str, mut stdout: BufReader<ChildStdout>, link: &WorkerLink, only: Option<&str>, removed: impl Fn(&str), fatal: impl Fn(&str)) {
        // What the process says that reaches the log, bounded: an executor
        // may be a tenant's (hijacked) process.
        let mut budget = logrelay::Bucket::new(REPLY_LOG_BURST, REPLY_LOG_PER_SEC, Instant::now());
        let mut dropped = 0u64;
        let mut fatal_seen = false;
        let mut note = |what: std::fmt::Arguments<'_>| {
            if !budget.try_take(Instant::now()) {
                dropped += 1;
                return;
            }
            if dropped > 0 {
                warn!(device, dropped, "{what} ({dropped} more such lines were not logged)");
                dropped = 0;
            } else {
                warn!(device, "{what}");
            }
        };
        loop {
            let line = match read_line_bounded(&mut stdout, MAX_REPLY_LINE) {
                Ok(Some(l)) => l,
                Ok(None) => break,
                Err(e) => {
                    warn!(device, "reading the worker's replies: {e}; it is no longer listened to");
                    break;
                }
            };
            let m = match serde_json::from_str::<MsgLine>(&line) {
                Ok(m) => m,
                Err(e) => {
                    note(format_args!("unreadable worker message: {e}"));
                    continue;
                }
            };
            if m.id != 0 {
                match link.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&m.id) {
                    Some(tx) => {
                        let _ = tx.send(m.msg);
                    }
                    None => {
                        let mut given_up = link.abandoned.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(i) = given_up.iter().position(|id| *id == m.id) {
                            given_up.remove(i);
                            link.late.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                continue;
            }
            match m.msg {
                WorkerMsg::Removed { name } if only.is_none_or(|t| t == name) => {
                    self.finish_delete(&name);
                    removed(&name);
                }
                WorkerMsg::Removed { name } => note(format_args!("an executor reported another tenant ({}) removed; ignored", logrelay::fit_for_log(&name, 256))),
                // Acted on once; a process that keeps saying it is only
                // logged, within the budget.
                WorkerMsg::Fatal { why } if !fatal_seen => {
                    fatal_seen = true;
                    fatal(&logrelay::fit_for_log(&why, REPLY_LOG_MAX))
                }
                WorkerMsg::Fatal { why } => note(format_args!("fatal again: {}", logrelay::fit_for_log(&why, REPLY_LOG_MAX))),
                WorkerMsg::Err(e) => note(format_args!("worker: {}", logrelay::fit_for_log(&e, REPLY_LOG_MAX))),
                other => note(format_args!("unexpected worker event {}", logrelay::fit_for_log(&format!("{other:?}"), REPLY_LOG_MAX))),
            }
        }
        // Callers still waiting see the worker as down.
        link.pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    fn supervise(self: Arc<Self>, slot: Arc<DeviceSlot>, mut child: Child) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let status = child.wait();
            *slot.link.lock().unwrap_or_else(|e| e.into_inner()) = None;
            slot.pid.store(0, Ordering::Relaxed);
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            if slot.relaunching.swap(false, Ordering::AcqRel) {
                info!(device = %slot.spec.name, "device arbiter restarting for its pool's sharing");
            } else {
                warn!(device = %slot.spec.name, ?status, "device worker exited; its tenants lost their connections; restarting");
                slot.restarts.fetch_add(1, Ordering::Relaxed);
            }
            // A tenant that was being deleted is gone with the process.
            let gone: Vec<String> = self.registry().values().filter(|t| t.device == slot.spec.name && t.state == TenantPhase::Deleting).map(|t| t.name.clone()).collect();
            for name in gone {
                self.finish_delete(&name);
            }
            loop {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
                match self.launch(&slot) {
                    Ok(c) => {
                        child = c;
                        // Re-populated without holding the registry: each
                        // tenant is added, then given its socket's owner.
                        let again: Vec<TenantRecord> = self.registry().values().filter(|t| t.device == slot.spec.name && t.state == TenantPhase::Ready).cloned().collect();
                        for t in &again {
                            if let Err(e) = self.add_on_worker(&slot, t) {
                                error!(device = %slot.spec.name, tenant = %t.name, "re-creating tenant after restart failed: {e}");
                                if slot.spec.executors {
                                    // Its executor is started again, with backoff.
                                    self.clone().keep_starting(slot.clone(), t.name.clone());
                                }
                            }
                        }
                        info!(device = %slot.spec.name, pid = slot.pid.load(Ordering::Relaxed), "device worker restarted");
                        backoff = Duration::from_millis(50);
                        break;
                    }
                    Err(e) => error!(device = %slot.spec.name, "restarting worker failed: {e}"),
                }
            }
        }
    }

    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        if let Some(v) = self.vms.get() {
            v.shutdown();
        }
        for slot in &self.devices {
            let pid = slot.pid.load(Ordering::Relaxed);
            if pid != 0 {
                // SAFETY: kill only sends a signal to our own child process.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
            self.stop_mps(slot);
        }
        for t in self.registry().values() {
            let _ = std::fs::remove_file(&t.socket);
        }
    }

    pub fn tenants(&self) -> Vec<TenantRecord> {
        self.registry().values().cloned().collect()
    }

    pub fn tenant(&self, name: &str) -> Option<TenantRecord> {
        self.registry().get(name).cloned()
    }

    pub fn slot(&self, name: &str) -> Option<&Arc<DeviceSlot>> {
        self.devices.iter().find(|d| d.spec.name == name)
    }

    /// Memory reserved on `device`: every tenant placed there, including
    /// those still being created or torn down.
    fn reserved(tenants: &BTreeMap<String, TenantRecord>, device: &str) -> u64 {
        tenants.values().filter(|t| t.device == device).map(|t| t.memory).sum()
    }

    /// The tenant's socket path. Process sockets end in `.sock` and VM
    /// sockets in `.vhost`, so no two tenants' paths can be the same; a
    /// hidden one lies in `hidden/` (see [`rundir`]).
    pub fn socket_for(&self, name: &str, vm: bool, hidden: bool) -> PathBuf {
        let dir = if hidden { rundir::hidden_dir(&self.run_dir) } else { self.run_dir.join("tenants") };
        if vm {
            crate::gpu::vhost::socket_path(&dir, name)
        } else {
            dir.join(format!("{name}.sock"))
        }
    }

    /// Creates a tenant: validates, places it (quotas never exceed device
    /// memory), and has the device worker open its socket. The registry is
    /// not held while the worker works.
    pub fn create_tenant(&self, spec: &TenantSpec) -> Result<TenantRecord, ControlError> {
        self.create_tenant_within(spec, self.defaults.max_tenants)
    }

    /// [`Control::create_tenant`], refused where `most` tenants are held.
    fn create_tenant_within(&self, spec: &TenantSpec, most: usize) -> Result<TenantRecord, ControlError> {
        spec.validate().map_err(ControlError::BadRequest)?;
        let vm = spec.kind == crate::config::TenantKind::Vm;
        let socket = self.socket_for(&spec.name, vm, spec.hidden);
        if socket.as_os_str().len() >= 108 {
            return Err(ControlError::BadRequest(format!("socket path {} is too long for a unix socket; use a shorter run dir or name", socket.display())));
        }
        if let Some(d) = spec.device.as_deref().filter(|d| self.pass_device(d).is_some()) {
            return Err(ControlError::BadRequest(format!("device {d} is a passthrough device: it is lent whole to a VM, not shared by tenants")));
        }
        let (slot, rec) = {
            let named = self.pool_map();
            let mut tenants = self.registry();
            if let Some(t) = tenants.get(&spec.name) {
                let why = if t.state == TenantPhase::Deleting { "is still being deleted" } else { "already exists" };
                return Err(ControlError::Conflict(format!("tenant {} {why}", spec.name)));
            }
            let pool = match (&spec.pool, &spec.device) {
                (Some(p), _) => self.find_pool(&named, p).ok_or_else(|| ControlError::NotFound(format!("no pool named {p}")))?,
                (None, Some(d)) => self.pool_of(&named, d),
                (None, None) => self.default_pool(&named),
            };
            if !pool.admits(&spec.name) {
                return Err(ControlError::Forbidden(format!("pool {} is private and tenant {} is not on its allow-list", pool.name, spec.name)));
            }
            let slots: Vec<&Arc<DeviceSlot>> = match &spec.device {
                Some(d) => {
                    let s = self.slot(d).ok_or_else(|| ControlError::NotFound(format!("no device named {d}")))?;
                    if !pool.devices.contains(d) {
                        return Err(ControlError::BadRequest(format!("device {d} is not in pool {}", pool.name)));
                    }
                    vec![s]
                }
                None => pool.devices.iter().filter_map(|d| self.slot(d)).collect(),
            };
            // A GPU shared under MPS serves at most so many clients.
            let slots = if pool.sharing == pool::Sharing::Mps {
                let most = self.mps_clients() as usize;
                let open: Vec<&Arc<DeviceSlot>> = slots.into_iter().filter(|s| tenants.values().filter(|t| t.device == s.spec.name).count() < most).collect();
                if open.is_empty() {
                    return Err(ControlError::Conflict(format!(
                        "pool {}: every GPU it could use already serves {most} tenants, the most one GPU shared under MPS serves here (devices.mps_max_clients)",
                        pool.name
                    )));
                }
                open
            } else {
                slots
            };
            let cands: Vec<pool::Candidate> = slots.iter().map(|s| self.candidate(&tenants, &pool, s)).collect();
            let i = pool::choose(&pool.name, &cands, spec.memory.0, spec.numa_node, pool.placement).map_err(|e| ControlError::InsufficientMemory(e.to_string()))?;
            let slot = slots[i].clone();
            let rec = TenantRecord {
                name: spec.name.clone(),
                kind: if vm { "vm" } else { "process" },
                memory: spec.memory.0,
                weight: spec.weight,
                cap: spec.cap.filter(|c| *c < 100),
                priority: spec.priority,
                device: slot.spec.name.clone(),
                pool: pool.name.clone(),
                numa_node: slot.spec.numa_node,
                socket,
                state: TenantPhase::Creating,
                owner: spec.owner,
                mode: format!("{:04o}", spec.mode_bits()),
                host_memory: spec.host_memory.map(|s| s.0).unwrap_or(self.defaults.host_memory),
                max_connections: spec.max_connections.unwrap_or(self.defaults.max_connections),
                hidden: spec.hidden,
                env: program_env(&slot.spec),
            };
            if tenants.len() >= most {
                return Err(ControlError::Conflict(format!("the daemon holds its most tenants, {} (devices.max_tenants); delete one first", self.defaults.max_tenants)));
            }
            tenants.insert(rec.name.clone(), rec.clone());
            (slot, rec)
        };
        let generation = slot.generation.load(Ordering::Acquire);
        if let Err(e) = self.add_on_worker(&slot, &rec) {
            // The worker may have set it up after all (a late answer).
            // Undone before the name is free again, so that a create that
            // takes it next is not undone with it.
            Self::undo_create(&slot, &rec);
            self.registry().remove(&rec.name);
            return Err(e);
        }
        // A worker restart in between re-added only ready tenants.
        if slot.generation.load(Ordering::Acquire) != generation {
            let _ = self.add_on_worker(&slot, &rec);
        }
        let mut tenants = self.registry();
        if !tenants.contains_key(&rec.name) {
            return Err(ControlError::Conflict(format!("tenant {} was deleted while it was being created", rec.name)));
        }
        // Saved while it is still being created (no delete can run then),
        // so a tenant is kept only if it would come back after a restart.
        if let Err(e) = self.save_tenant(&rec) {
            drop(tenants);
            Self::undo_create(&slot, &rec);
            self.registry().remove(&rec.name);
            return Err(e);
        }
        let Some(r) = tenants.get_mut(&rec.name) else {
            return Err(ControlError::Conflict(format!("tenant {} was deleted while it was being created", rec.name)));
        };
        r.state = TenantPhase::Ready;
        let rec = r.clone();
        drop(tenants);
        info!(tenant = %rec.name, device = %rec.device, quota = rec.memory, "tenant created");
        Ok(rec)
    }

    /// Takes back what a create that failed set up on the device: the
    /// tenant on its worker or executor, and its socket.
    fn undo_create(slot: &DeviceSlot, rec: &TenantRecord) {
        if slot.spec.executors {
            let _ = slot.remove_on_executor(&rec.name);
        } else {
            let _ = slot.call(WorkerCmd::RemoveTenant { name: rec.name.clone() }, STATS_TIMEOUT);
        }
        slot.forget_socket(&rec.name);
        let _ = std::fs::remove_file(&rec.socket);
    }

    /// Changes a tenant's weight, cap, class or memory quota live. A larger
    /// quota must fit the device's unreserved capacity; a smaller one must
    /// still cover what the tenant has allocated (the worker checks that),
    /// so a quota given back is really free.
    pub fn set_tenant(&self, name: &str, change: &TenantChange) -> Result<TenantRecord, ControlError> {
        // Changes are applied one at a time, so the worker ends with the
        // values the registry records.
        let _one = self.setting.lock().unwrap_or_else(|e| e.into_inner());
        let (slot, before, after) = {
            let named = self.pool_map();
            let mut tenants = self.registry();
            let rec = tenants.get(name).ok_or_else(|| ControlError::NotFound(format!("no tenant {name}")))?;
            if rec.state != TenantPhase::Ready {
                return Err(ControlError::Conflict(format!("tenant {name} is {}", if rec.state == TenantPhase::Creating { "still being created" } else { "being deleted" })));
            }
            let mut next = rec.clone();
            if let Some(w) = change.weight {
                next.weight = w;
            }
            if let Some(c) = change.cap {
                next.cap = (c < 100).then_some(c);
            }
            if let Some(p) = change.priority {
                next.priority = p;
            }
            if let Some(m) = change.memory {
                next.memory = m.0;
            }
            crate::config::check_share(name, next.weight, change.cap.or(next.cap)).map_err(ControlError::BadRequest)?;
            if next.memory == 0 {
                return Err(ControlError::BadRequest(format!("tenant {name}: memory quota must be positive")));
            }
            let slot = self.slot(&rec.device).cloned().ok_or_else(|| ControlError::NotFound(format!("no device {}", rec.device)))?;
            if next.memory > rec.memory {
                let pool = self.pool_of(&named, &rec.device);
                if !pool.admits(name) {
                    return Err(ControlError::Forbidden(format!("pool {} is private and tenant {name} is no longer on its allow-list: it keeps its quota but cannot grow it", pool.name)));
                }
                let holds = slot.spec.memory.saturating_add(slot.spec.spill);
                if next.memory > holds {
                    return Err(ControlError::InsufficientMemory(format!("device {} holds at most {} (memory and host spill); {name} cannot grow to {}", rec.device, Size(holds), Size(next.memory))));
                }
                let free = pool.capacity(slot.spec.memory).saturating_sub(Self::reserved(&tenants, &rec.device));
                if next.memory - rec.memory > free {
                    return Err(ControlError::InsufficientMemory(format!(
                        "device {} has {} unreserved; growing {name} to {} needs {}",
                        rec.device,
                        Size(free),
                        Size(next.memory),
                        Size(next.memory - rec.memory)
                    )));
                }
            }
            let before = rec.clone();
            // While the worker is asked, the larger of the two quotas stays
            // reserved: a grown one counts at once, and a shrunk one frees
            // nothing until the worker has agreed.
            let interim = TenantRecord { memory: rec.memory.max(next.memory), ..next.clone() };
            tenants.insert(name.to_string(), interim.clone());
            (slot, before, (interim, next))
        };
        let (interim, after) = after;
        match slot.set_share(&after, before.memory) {
            Ok(WorkerMsg::Ok) => self.replace_if(name, &interim, &after),
            // A worker that is down gets the new values when it re-adds
            // the tenant.
            Err(ControlError::WorkerDown(_)) => self.replace_if(name, &interim, &after),
            // The worker refused (a quota below what is allocated) and
            // changed nothing.
            Ok(WorkerMsg::Err(e)) => {
                self.replace_if(name, &interim, &before);
                return Err(ControlError::Conflict(e));
            }
            Ok(other) => {
                self.replace_if(name, &interim, &before);
                return Err(ControlError::Worker(format!("unexpected reply {other:?}")));
            }
            // The worker may still apply it: the larger quota stays
            // reserved, the rest goes back.
            Err(e) => {
                self.replace_if(name, &interim, &TenantRecord { memory: interim.memory, ..before.clone() });
                return Err(e);
            }
        }
        info!(tenant = %name, weight = after.weight, cap = ?after.cap, priority = after.priority.as_str(), memory = after.memory, "tenant changed");
        if (after.weight, after.cap) != (before.weight, before.cap) && self.sharing_of(&slot.spec.name) == pool::Sharing::Mps {
            // Under MPS the shares of the SMs follow the weights.
            if let Some(me) = self.me.upgrade() {
                me.request_rebalance(&slot);
            }
        }
        // The change is live; said plainly when a restart would undo it.
        // Saved under the registry's lock, only while the tenant is still
        // there: a delete that ran meanwhile is not undone.
        let tenants = self.registry();
        let saved = if tenants.get(name).is_some_and(|t| t.state == TenantPhase::Ready) { self.save_tenant(&after) } else { Ok(()) };
        drop(tenants);
        match saved {
            Ok(()) => Ok(after),
            // A smaller quota freed capacity that another tenant may
            // have taken since: it is not grown back unchecked.
            Err(ControlError::Store(source)) if after.memory < before.memory => {
                warn!(tenant = name, "a change could not be saved: {source}");
                Err(ControlError::NotSaved { live: true, source })
            }
            Err(ControlError::Store(source)) => {
                // Taken back where the device agrees, so that what runs is
                // what a restart brings back.
                let undone = matches!(slot.set_share(&before, after.memory), Ok(WorkerMsg::Ok));
                if undone {
                    self.replace_if(name, &after, &before);
                }
                warn!(tenant = name, undone, "a change could not be saved: {source}");
                Err(ControlError::NotSaved { live: !undone, source })
            }
            Err(e) => Err(e),
        }
    }

    /// Sets a tenant's share and quota to `to`'s, only if the record is
    /// still `expect` (not deleted or re-created since).
    fn replace_if(&self, name: &str, expect: &TenantRecord, to: &TenantRecord) {
        if let Some(r) = self.registry().get_mut(name) {
            let same = r.state == TenantPhase::Ready
                && r.device == expect.device
                && r.socket == expect.socket
                && r.memory == expect.memory
                && r.weight == expect.weight
                && r.cap == expect.cap
                && r.priority == expect.priority;
            if same {
                r.memory = to.memory;
                r.weight = to.weight;
                r.cap = to.cap;
                r.priority = to.priority;
            }
        }
    }

    fn save_tenant(&self, rec: &TenantRecord) -> Result<(), ControlError> {
        match self.store.get() {
            Some(s) => Ok(s.save_tenant(&rec.spec())?),
            None => Ok(()),
        }
    }

    /// Revokes a tenant at once, then waits (up to [`DELETE_WAIT`], holding
    /// no lock) for its worker to release its memory. Returns true once the
    /// tenant is gone and its quota free, false while the teardown is
    /// still running (the record stays, `deleting`, until it is done).
    pub fn delete_tenant(&self, name: &str) -> Result<bool, ControlError> {
        let slot = {
            let mut tenants = self.registry();
            let rec = tenants.get_mut(name).ok_or_else(|| ControlError::NotFound(format!("no tenant {name}")))?;
            match rec.state {
                TenantPhase::Creating => return Err(ControlError::Conflict(format!("tenant {name} is still being created"))),
                TenantPhase::Deleting => None,
                TenantPhase::Ready => {
                    // A delete once accepted does not come undone by a
                    // restart: its saved file goes first, or nothing does.
                    if let Some(Err(source)) = self.store.get().map(|s| s.remove_tenant(name)) {
                        return Err(ControlError::NotSaved { live: false, source });
                    }
                    rec.state = TenantPhase::Deleting;
                    Some(self.slot(&rec.device).cloned())
                }
            }
        };
        if let Some(slot) = slot {
            match slot.map(|s| if s.spec.executors { s.remove_on_executor(name) } else { s.call(WorkerCmd::RemoveTenant { name: name.to_string() }, COMMAND_TIMEOUT) }) {
                Some(Ok(WorkerMsg::Ok)) | Some(Err(ControlError::Timeout(..))) => {}
                // A worker that is down, or never had it, holds nothing.
                _ => self.finish_delete(name),
            }
        }
        let deadline = Instant::now() + DELETE_WAIT;
        let mut tenants = self.registry();
        while tenants.contains_key(name) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            tenants = self.removed.wait_timeout(tenants, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        Ok(true)
    }

    /// The worker released a deleted tenant: its record and quota go.
    fn finish_delete(&self, name: &str) {
        let mut tenants = self.registry();
        let mut left = None;
        if tenants.get(name).is_some_and(|t| t.state == TenantPhase::Deleting) {
            if let Some(t) = tenants.remove(name) {
                if let Some(slot) = self.slot(&t.device) {
                    slot.forget_socket(name);
                    left = Some(slot.clone());
                }
                let _ = std::fs::remove_file(&t.socket);
            }
            info!(tenant = name, "tenant deleted; its memory is released");
            if let Some(m) = self.meter.get() {
                m.tenant_deleted(name);
            }
        }
        drop(tenants);
        self.removed.notify_all();
        if let (Some(slot), Some(me)) = (left, self.me.upgrade()) {
            // Under MPS the others' shares of the SMs grow.
            me.request_rebalance(&slot);
        }
    }

    fn add_on_worker(&self, slot: &Arc<DeviceSlot>, t: &TenantRecord) -> Result<(), ControlError> {
        if slot.spec.executors {
            let me = self.me.upgrade().ok_or_else(|| ControlError::WorkerDown(slot.spec.name.clone()))?;
            return me.start_executor(slot, t);
        }
        match slot.call(WorkerCmd::AddTenant(t.cmd()), COMMAND_TIMEOUT)? {
            WorkerMsg::Ok => {}
            WorkerMsg::Err(e) => return Err(ControlError::Worker(e)),
            other => return Err(ControlError::Worker(format!("unexpected reply {other:?}"))),
        }
        let owner = t.owner.unwrap_or(Owner { uid: 0, gid: 0 });
        rundir::set_socket_owner(&t.socket, owner, t.mode_bits()).map_err(|e| ControlError::Internal(format!("setting the owner of {}: {e}", t.socket.display())))
    }
}

/// The longest reply line a worker may send: a shared worker's statistics
/// for many tenants fit many times over.
const MAX_REPLY_LINE: usize = 16 << 20;

/// One line of `r` without its newline, at most `max` bytes; None at EOF.
/// A longer line is an error: a worker cannot make the control plane
/// buffer without bound.
fn read_line_bounded(r: &mut impl BufRead, max: usize) -> std::io::Result<Option<String>> {
    read_line_within(r, max, "a reply line", Err)
}

/// As [`read_line_bounded`], for a reader that may have nothing yet:
/// `wait` is called with each WouldBlock, and either waits for more (Ok)
/// or gives up (its error).
fn read_line_within(r: &mut impl BufRead, max: usize, what: &str, mut wait: impl FnMut(std::io::Error) -> std::io::Result<()>) -> std::io::Result<Option<String>> {
    let mut line = Vec::new();
    loop {
        let (take, end) = match r.fill_buf() {
            Ok([]) => return Ok((!line.is_empty()).then(|| String::from_utf8_lossy(&line).into_owned())),
            Ok(buf) => match buf.iter().position(|b| *b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            },
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait(e)?;
                continue;
            }
            Err(e) => return Err(e),
        };
        if line.len() + take > max + 1 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{what} longer than {max} bytes")));
        }
        line.extend_from_slice(&r.fill_buf()?[..take]);
        r.consume(take);
        if end {
            line.pop();
            return Ok(Some(String::from_utf8_lossy(&line).into_owned()));
        }
    }
}

/// How long a new worker or executor may take to say it is ready (a GPU
/// driver's start included): one that takes longer is ended, and the
/// starts of its device waiting behind it go on.
const READY_WAIT: Duration = Duration::from_secs(60);

/// The first line a new worker writes, at most 64 KiB, within `within`;
/// an empty string at EOF. The pipe is read without blocking meanwhile,
/// so a process that never writes its line (or stops half-way) cannot hold
/// its device's starts.
fn read_ready_line(r: &mut BufReader<ChildStdout>, within: Duration) -> std::io::Result<String> {
    use std::os::fd::AsRawFd;
    const MAX: usize = 64 << 10;
    let fd = r.get_ref().as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on the pipe we own; only O_NONBLOCK changes.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
    let deadline = Instant::now() + within;
    let res = read_line_within(r, MAX, "a ready line", |_| {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no ready line within {within:?}")));
        }
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd, ours, for the pipe we own.
        unsafe { libc::poll(&mut p, 1, left.as_millis().clamp(1, i32::MAX as u128) as i32) };
        Ok(())
    });
    // SAFETY: as above: the reply reader that follows blocks.
    unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
    res.map(Option::unwrap_or_default)
}

/// Writes all of `buf` to the worker's (non-blocking) stdin, waiting for
/// room no later than `deadline`: a worker that stops reading its commands
/// cannot hold the caller, or the registry, forever.
fn write_before(w: &ChildStdin, mut buf: &[u8], deadline: Instant, wrote: &mut usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    while !buf.is_empty() {
        match (&*w).write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                *wrote += n;
                buf = &buf[n..];
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                let mut p = libc::pollfd { fd: w.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                // SAFETY: one valid pollfd for the call.
                unsafe { libc::poll(&mut p, 1, left.as_millis().min(1000) as i32 + 1) };
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What a process started by [`spawn_worker`] is to be.
enum Role {
    /// Every tenant of the device in one process.
    Worker,
    /// The device's arbiter, taking grant channels on this datagram socket,
    /// with this many lanes.
    Arbiter(std::os::fd::OwnedFd, u32),
    /// One tenant's executor: its grant channel, its listening socket, its
    /// address window, what the kernel bounds it to, what it adds to its
    /// environment (an MPS client's settings), and how the daemon names it
    /// when it relays its log ([`logrelay`]).
    Executor { grant: std::os::fd::OwnedFd, listen: std::os::fd::OwnedFd, window: u64, bounds: executors::SpawnBounds, env: Vec<(&'static str, String)>, log_as: String },
}

/// Applies an executor's bounds between fork and exec: it joins its
/// cgroup (before it runs a single instruction of its own) and gets its
/// rlimits, soft and hard alike, so it cannot raise them.
fn bound_child(cmd: &mut Command, b: executors::SpawnBounds) {
    use std::os::unix::process::CommandExt;
    let procs = b.cgroup_procs;
    let (fds, nproc) = (b.fds, b.nproc);
    // SAFETY: between fork and exec the closure only calls write and
    // setrlimit, which are async-signal-safe, and allocates nothing; the
    // cgroup.procs descriptor is owned by the closure, alive until exec.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(fd) = &procs {
                vgpu_topology::cgroup::join_self(fd)?;
            }
            let set = |what, n: u64| {
                let rl = libc::rlimit { rlim_cur: n, rlim_max: n };
                if libc::setrlimit(what, &rl) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            set(libc::RLIMIT_NOFILE, fds)?;
            if let Some(n) = nproc {
                set(libc::RLIMIT_NPROC, n)?;
            }
            Ok(())
        })
    };
}

fn spawn_worker(exe: &Path, spec: &DeviceSpec, user: Option<Owner>, role: Role) -> std::io::Result<(Child, ChildStdin, BufReader<ChildStdout>, u32)> {
    let mut cmd = Command::new(exe);
    let lanes = match &role {
        Role::Arbiter(_, lanes) => *lanes,
        _ => spec.lanes,
    };
    cmd.arg("worker")
        .arg("--ordinal")
        .arg(spec.ordinal.to_string())
        .arg("--memory")
        .arg(spec.memory.to_string())
        .arg("--budget")
        .arg(spec.budget.to_string())
        .arg("--lanes")
        .arg(lanes.to_string())
        .arg("--launch-timeout-ms")
        .arg(spec.launch_timeout_ms.to_string());
    cmd.args(["--numa-node", &spec.numa_node.to_string()]);
    if spec.cuda.is_some() {
        cmd.args(["--backend", "cuda"]);
    } else {
        cmd.arg("--compute-capability").arg(format!("{}.{}", spec.cc.0, spec.cc.1)).arg("--spill").arg(spec.spill.to_string());
    }
    if let Some(u) = user {
        cmd.arg("--user").arg(u.to_string());
    }
    if spec.seccomp {
        cmd.arg("--seccomp");
    }
    if spec.connection_threads > 0 {
        cmd.arg("--connection-threads").arg(spec.connection_threads.to_string());
    }
    if spec.compute_nice > 0 {
        cmd.arg("--compute-nice").arg(spec.compute_nice.to_string());
    }
    if spec.pin_lanes {
        cmd.arg("--pin-lanes");
    }
    // Descriptors the child gets at fixed numbers (3, and 4), duplicated
    // between fork and exec; ours stay close-on-exec.
    let mut bounded = None;
    // An executor's stderr goes through the log relay; a worker's and an
    // arbiter's (which serve every tenant of the device) are the daemon's.
    let mut relayed = None;
    // An MPS client only where its GPU is shared under MPS (an executor's
    // `env`), never through settings the daemon's own environment carries.
    for v in ["CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] {
        cmd.env_remove(v);
    }
    let pass: Vec<std::os::fd::OwnedFd> = match role {
        Role::Worker => Vec::new(),
        Role::Arbiter(intake, _) => {
            cmd.arg("--arbiter");
            vec![intake]
        }
        Role::Executor { grant, listen, window, bounds, env, log_as } => {
            relayed = Some(log_as);
            cmd.args(["--grant-fd", "3", "--listen-fd", "4", "--window", &window.to_string()]);
            cmd.envs(env);
            bounded = Some(bounds);
            vec![grant, listen]
        }
    };
    if !pass.is_empty() {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let raw: Vec<i32> = pass.iter().map(|f| f.as_raw_fd()).collect();
        // SAFETY: between fork and exec the closure only calls fcntl and
        // dup2, which are async-signal-safe, on descriptors this process
        // owns (kept alive by `pass` until spawn returns).
        unsafe {
            cmd.pre_exec(move || {
                // First out of the way of the targets, then into place.
                // No allocation here: a fixed array (at most two).
                let mut moved = [-1i32; 2];
                for (i, &fd) in raw.iter().enumerate().take(2) {
                    let m = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 16);
                    if m < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    moved[i] = m;
                }
                for (i, &m) in moved.iter().take(raw.len()).enumerate() {
                    if libc::dup2(m, 3 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    // After the descriptors are in place: the bounds lower RLIMIT_NOFILE
    // below the numbers the daemon's own descriptors may have.
    if let Some(b) = bounded {
        bound_child(&mut cmd, b);
    }
    let mut child = cmd
        // A GPU worker sees exactly its GPU or MIG instance, as device 0,
        // from before cuInit; a CPU worker sees none.
        .env("CUDA_VISIBLE_DEVICES", spec.cuda.as_ref().map(|c| c.visible_devices.as_str()).unwrap_or(""))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(if relayed.is_some() { Stdio::piped() } else { Stdio::inherit() })
        .spawn()?;
    if let (Some(who), Some(err)) = (relayed, child.stderr.take()) {
        logrelay::relay(err, who);
    }
    let stdin = child.stdin.take().ok_or_else(|| std::io::Error::other("no worker stdin"))?;
    {
        use std::os::fd::AsRawFd;
        let fd = stdin.as_raw_fd();
        // SAFETY: F_GETFL/F_SETFL on the pipe we own; only O_NONBLOCK changes.
        unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
    }
    let mut stdout = BufReader::new(child.stdout.take().ok_or_else(|| std::io::Error::other("no worker stdout"))?);
    let line = match read_ready_line(&mut stdout, READY_WAIT) {
        Ok(l) => l,
        Err(e) => {
            // Not left running as a uid that is given back.
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    match serde_json::from_str::<MsgLine>(&line) {
        Ok(MsgLine { msg: WorkerMsg::Ready { pid }, .. }) => Ok((child, stdin, stdout, pid)),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            Err(std::io::Error::other(format!("worker did not report ready (got {line:?})")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_line_is_bounded_and_a_last_one_without_newline_is_kept() {
        let mut r = std::io::Cursor::new(b"short\n12345678\n123456789\n".to_vec());
        assert_eq!(read_line_bounded(&mut r, 8).unwrap().as_deref(), Some("short"));
        assert_eq!(read_line_bounded(&mut r, 8).unwrap().as_deref(), Some("12345678"));
        let e = read_line_bounded(&mut r, 8).unwrap_err();
        assert!(e.to_string().contains("a reply line longer than 8 bytes"), "{e}");
        let mut r = std::io::Cursor::new(b"tail".to_vec());
        assert_eq!(read_line_bounded(&mut r, 8).unwrap().as_deref(), Some("tail"));
        assert_eq!(read_line_bounded(&mut r, 8).unwrap(), None);
    }

    fn reader(script: &str) -> (Child, BufReader<ChildStdout>) {
        let mut c = Command::new("sh").args(["-c", script]).stdout(Stdio::piped()).spawn().expect("sh");
        let out = BufReader::new(c.stdout.take().expect("stdout"));
        (c, out)
    }

    #[test]
    fn a_ready_line_is_read_and_a_silent_or_half_written_one_times_out() {
        let (mut c, mut r) = reader("printf 'one\\ntwo\\n'");
        assert_eq!(read_ready_line(&mut r, Duration::from_secs(10)).unwrap(), "one");
        // The rest is left for the reply reader, which blocks again.
        let mut rest = String::new();
        r.read_line(&mut rest).unwrap();
        assert_eq!(rest, "two\n");
        c.wait().unwrap();
        for script in ["sleep 30", "printf 'half'; sleep 30"] {
            let (mut c, mut r) = reader(script);
            let t = Instant::now();
            let e = read_ready_line(&mut r, Duration::from_millis(300)).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{script}: {e}");
            assert!(t.elapsed() < Duration::from_secs(10), "{script}: {:?}", t.elapsed());
            let _ = c.kill();
            let _ = c.wait();
        }
        let (mut c, mut r) = reader("exit 0");
        assert_eq!(read_ready_line(&mut r, Duration::from_secs(10)).unwrap(), "");
        c.wait().unwrap();
        let (mut c, mut r) = reader("head -c 70000 /dev/zero; sleep 30");
        assert_eq!(read_ready_line(&mut r, Duration::from_secs(10)).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
        let _ = c.kill();
        let _ = c.wait();
    }
}
