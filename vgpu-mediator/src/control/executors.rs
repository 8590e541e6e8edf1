//! Tenant executors: on a device that has them, each tenant's state lives
//! in a process of its own, and the device's worker is its arbiter.
//!
//! For each tenant the control plane binds the tenant's socket, makes a
//! grant channel, starts an executor (`vgpu-mediatord worker --grant-fd 3
//! --listen-fd 4`) under a uid of its own, and hands the channel's other
//! end to the arbiter. The executor serves that one tenant, and runs work
//! only on lanes the arbiter grants. An executor that dies takes only its
//! tenant's state with it: the tenant gets a fresh executor (its clients
//! reconnect), every other tenant carries on. The arbiter's death ends its
//! executors (their grant channels close); the device's supervisor starts
//! a new arbiter and new executors.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{debug, info, warn};

use super::{
    call_link, rundir, send_link, spawn_worker, wait_link, Control, ControlError, DeviceSlot, DeviceSpec, Role, TenantPhase, TenantRecord, WorkerLink, COMMAND_TIMEOUT, SLOW_STATS_WAIT, STATS_TIMEOUT,
};
use crate::config::Owner;
use crate::ipc::{DeviceStats, WorkerCmd, WorkerMsg};

/// Host memory an executor needs beyond its tenant's objects (the
/// tenant's `host_memory`) and, on a CPU device, its device memory: the
/// binary and its threads' stacks; for the `cuda` backend also NVIDIA's
/// driver, its JIT and its context's host-side state.
const EXEC_BASE_MEMORY_CPU: u64 = 256 << 20;
const EXEC_BASE_MEMORY_CUDA: u64 = 4 << 30;
/// The cgroup v2 group every executor's group is made under.
const CGROUP_BASE: &str = "vgpu-mediatord";

/// What the kernel bounds an executor to, so that no bug in it lets a
/// tenant grow host resources without end (the executor's own accounting
/// comes first: quotas, `host_memory`, `max_connections`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct ExecBounds {
    /// Open descriptors (RLIMIT_NOFILE): its sockets, rings and buffers.
    pub fds: u64,
    /// Processes and threads: cgroup `pids.max`, or without cgroup v2
    /// RLIMIT_NPROC of its own uid (none when it has no uid of its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tasks: Option<u64>,
    /// cgroup `memory.max` (none without cgroup v2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Its cgroup, under the cgroup v2 root (none without cgroup v2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// On a GPU shared under MPS: the share of the GPU's SMs its kernels
    /// may use (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), from its weight.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm_percent: Option<u32>,
}

/// The bounds of `t`'s executor on a device like `spec`, on a host with
/// `cpus` CPUs: descriptors for each connection it may hold (socket, kick,
/// ring, staging buffers and what a message carries), tasks for the
/// threads it starts, memory for what it holds.
pub fn exec_bounds(spec: &DeviceSpec, t: &TenantRecord, cpus: u64) -> (u64, u64, u64) {
    let fds = 256 + 16 * u64::from(t.max_connections);
    let lanes = if spec.lanes == 0 { cpus } else { u64::from(spec.lanes) };
    // Its fixed threads and a driver's; the pool that runs a launch's
    // blocks, one per CPU; the engine's, four per lane and one (engine.rs
    // `Engine::start`); its connection threads.
    let tasks = 256 + cpus + 4 * lanes + 1 + u64::from(spec.connection_threads);
    let memory = match spec.cuda {
        Some(_) => EXEC_BASE_MEMORY_CUDA.saturating_add(t.host_memory),
        None => EXEC_BASE_MEMORY_CPU.saturating_add(t.host_memory).saturating_add(t.memory),
    };
    (fds, tasks, memory)
}

/// The daemon's own hard limit on open descriptors.
fn own_hard_nofile() -> u64 {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the live struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return u64::MAX;
    }
    rl.rlim_max
}

/// How the executor being spawned is bounded: applied between fork and
/// exec (control/mod.rs `spawn_worker`).
pub(super) struct SpawnBounds {
    pub fds: u64,
    /// RLIMIT_NPROC (its own uid, without a cgroup).
    pub nproc: Option<u64>,
    /// Its cgroup's `cgroup.procs`, which it joins before exec.
    pub cgroup_procs: Option<std::os::fd::OwnedFd>,
}

/// Said once per daemon: executors are not in cgroups here.
static NO_CGROUP_SAID: AtomicBool = AtomicBool::new(false);

/// One tenant's executor process.
pub struct Exec {
    pub tenant: String,
    pub pid: u32,
    /// The uid it runs as (None: it kept the daemon's).
    pub uid: Option<u32>,
    /// That uid is its GPU's MPS uid, shared by the GPU's executors (not
    /// its own, so not given back when it ends).
    shared_uid: bool,
    /// Its tenant's address window on the device: no other live
    /// executor of the device has it.
    window: u64,
    link: Arc<WorkerLink>,
    /// Set once it was reaped: its pid may not be signalled any more.
    reaped: Mutex<bool>,
    /// When it was started (restart backoff).
    started: std::time::Instant,
    /// The generation of the device's arbiter it was handed to (its grant
    /// channel dies with that arbiter).
    generation: u64,
    /// Replaced or retired on purpose: its exit is not a crash.
    retired: AtomicBool,
    /// Its last statistics came late (or not at all): they are waited for
    /// [`SLOW_STATS_WAIT`] only, until it answers in time again or a late
    /// answer shows it slow rather than stalled. Holds its link's count of
    /// late answers when it was marked; `u64::MAX`: not marked.
    slow: AtomicU64,
    /// Its end was already passed on to the other clients of its MPS
    /// server (or it was ended as one of them): its exit fails no one else.
    pub(super) peers_ended: AtomicBool,
    /// What the kernel bounds it to, and its cgroup (removed once it is
    /// reaped). Its memory bound as it is now: [`Exec::bounds`].
    pub(super) bounds: ExecBounds,
    /// Its cgroup's `memory.max` now (0: none): raised when its tenant's
    /// quota grows.
    memory_max: AtomicU64,
    cgroup: Option<vgpu_topology::cgroup::Cgroup>,
}

impl Exec {
    pub(super) fn call(&self, cmd: WorkerCmd, timeout: Duration) -> Result<WorkerMsg, ControlError> {
        call_link(Some(&self.link), &format!("executor of {}", self.tenant), cmd, timeout)
    }

    /// Ends the executor now, on purpose (SIGKILL: a kernel it runs cannot
    /// hold it); it is not restarted.
    pub fn kill(&self) {
        self.retired.store(true, Ordering::Release);
        self.signal_kill();
    }

    /// Whether its process has ended (and was reaped).
    fn is_reaped(&self) -> bool {
        *self.reaped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SIGKILL, as a crash would: the tenant gets a new executor.
    pub(super) fn signal_kill(&self) {
        let reaped = self.reaped.lock().unwrap_or_else(|e| e.into_inner());
        if !*reaped {
            // SAFETY: kill sends a signal to our own child, which has not
            // been reaped: the reaper sets `reaped` under this lock before
            // it reaps (it waits with WNOWAIT first), so the pid cannot
            // have been reused.
            unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
        }
    }

    /// What the kernel bounds it to now.
    pub fn bounds(&self) -> ExecBounds {
        let memory = Some(self.memory_max.load(Ordering::Acquire)).filter(|m| *m != 0);
        ExecBounds { memory, ..self.bounds.clone() }
    }

    /// Raises its cgroup's memory bound to `bytes`, if it has a cgroup and
    /// a lower bound. Never lowered while it runs: memory it freed may
    /// still be in its heap, and a bound below what it holds would have
    /// the kernel kill it; its next start takes the lower one.
    fn raise_memory_max(&self, bytes: u64) -> Result<(), vgpu_topology::cgroup::CgroupError> {
        let Some(cg) = &self.cgroup else { return Ok(()) };
        if self.memory_max.load(Ordering::Acquire) >= bytes {
            return Ok(());
        }
        cg.set_memory_max(bytes)?;
        self.memory_max.fetch_max(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Lets the executor end on its own: its stdin closes once the last
    /// caller is done with its link.
    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.link.close();
    }
}

/// Blocks until child `pid` has exited, leaving it to be reaped.
fn wait_exited(pid: u32) {
    loop {
        // SAFETY: an all-zero siginfo_t is a valid out-parameter.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with WNOWAIT only reports its
        // state; `info` is a valid out-parameter.
        let rc = unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// How long a deleted tenant's executor has to release its memory and end
/// before it is killed.
const REMOVE_GRACE: Duration = Duration::from_secs(15);

/// An executor that ends sooner than this after its start counts towards
/// its tenant's restart backoff; one that lived longer resets it.
const QUICK_END: Duration = Duration::from_secs(60);
/// The first restart's delay, doubled for each quick end in a row.
const RESTART_FIRST: Duration = Duration::from_millis(50);
/// The longest delay between a tenant's executor ending and the next
/// start: a tenant that faults in a loop (each fault ends its executor on
/// a GPU) costs the host a process and a device open at most this often.
const RESTART_MAX: Duration = Duration::from_secs(5);

/// The delay before the next start after `quick` quick ends in a row.
fn restart_delay(quick: u32) -> Duration {
    RESTART_FIRST.saturating_mul(1u32 << quick.min(16)).min(RESTART_MAX)
}

/// The uids executors run as: a range of the host's that no user owns,
/// given one per live executor. With a claims directory, each uid given
/// out is also claimed host-wide (see [`HOST_CLAIMS`]).
pub struct UidRange {
    first: u32,
    count: u32,
    /// The uids given out, each with its claim (its lock file, held).
    used: Mutex<BTreeMap<u32, Option<std::fs::File>>>,
    claims: Option<PathBuf>,
}

/// The default executor uid range (`devices.executor_uids`): above the
/// ranges distributions give users and their subordinate ids by default,
/// and below 2^31, which some tools print as negative.
pub const DEFAULT_UIDS: (u32, u32) = (1_900_000_000, 65_536);

/// Where a mediator running as root claims the executor uids it gives
/// out: one file per uid, locked (`flock`) while the uid is in use, so two
/// mediators on one host, whatever their ranges, never give one uid to
/// two live executors. The lock goes with the mediator's descriptor, so a
/// mediator that dies leaves no stale claim; a uid a process still runs
/// as (an executor of that mediator, not yet gone) is skipped as well. In
/// `/run`, where only root creates files.
pub const HOST_CLAIMS: &str = "/run/vgpu-executor-uids";

/// Why no executor uid could be given out.
#[derive(Debug, thiserror::Error)]
pub enum UidError {
    #[error("every uid of devices.executor_uids ({first}-{last}) is in use, by this mediator or another on this host")]
    Exhausted { first: u32, last: u32 },
    #[error("claiming executor uid {uid} in {dir}")]
    Claim {
        uid: u32,
        dir: String,
        #[source]
        err: std::io::Error,
    },
}

impl UidRange {
    /// A range whose uids this process alone gives out.
    pub fn new(first: u32, count: u32) -> UidRange {
        UidRange { first, count, used: Mutex::new(BTreeMap::new()), claims: None }
    }

    /// A range whose uids are also claimed host-wide in `dir` (created,
    /// or checked to be ours and private).
    pub fn claimed_in(first: u32, count: u32, dir: &Path) -> Result<UidRange, super::rundir::RunDirError> {
        super::rundir::private_dir_in_place(dir)?;
        Ok(UidRange { claims: Some(dir.to_path_buf()), ..UidRange::new(first, count) })
    }

    pub(super) fn take(&self) -> Result<u32, UidError> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        // A uid some process still runs as (an executor of a mediator that
        // was killed, not yet gone) is not free either.
        let running = match &self.claims {
            Some(dir) => uids_running(self.first, self.count).map_err(|err| UidError::Claim { uid: self.first, dir: dir.display().to_string(), err })?,
            None => BTreeSet::new(),
        };
        for uid in self.first..self.first.saturating_add(self.count) {
            if used.contains_key(&uid) || running.contains(&uid) {
                continue;
            }
            let claim = match &self.claims {
                None => None,
                Some(dir) => match claim(dir, uid) {
                    Ok(Some(f)) => Some(f),
                    // Another mediator's executor runs as it.
                    Ok(None) => continue,
                    Err(err) => return Err(UidError::Claim { uid, dir: dir.display().to_string(), err }),
                },
            };
            used.insert(uid, claim);
            return Ok(uid);
        }
        Err(UidError::Exhausted { first: self.first, last: self.first.saturating_add(self.count.saturating_sub(1)) })
    }

    /// Gives `uid` back (its claim, if any, is released).
    pub(super) fn put(&self, uid: u32) {
        self.used.lock().unwrap_or_else(|e| e.into_inner()).remove(&uid);
    }
}

/// Why the executor uid range cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UidRangeError {
    #[error("reading {path}")]
    Read {
        path: String,
        #[source]
        err: std::io::Error,
    },
    #[error(
        "devices.executor_uids {first}-{last} overlaps ids this host already gives out: {}. Executors run as these uids (and gids); a process with one of them could signal or trace a tenant's executor. Choose a range no user, group or subordinate id range in /etc uses",
        .conflicts.join("; ")
    )]
    Taken { first: u32, last: u32, conflicts: Vec<String> },
}

/// Checks that no user or group in `etc`'s passwd and group files, and
/// no subordinate id range in its subuid and subgid files (rootless
/// containers run as those), has an id in `first..first+count`: executors
/// run as those uids, with the same gids. A file that is missing is
/// empty; one that cannot be read fails the check. Users from other
/// sources (LDAP, say) are not listed here: the range must stay clear of
/// them by choice.
pub fn check_uid_range(etc: &Path, first: u32, count: u32) -> Result<(), UidRangeError> {
    let end = u64::from(first) + u64::from(count);
    let inside = |id: u64| (u64::from(first)..end).contains(&id);
    let mut conflicts = Vec::new();
    for (file, what) in [("passwd", "user"), ("group", "group"), ("subuid", "subordinate uids"), ("subgid", "subordinate gids")] {
        let path = etc.join(file);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(err) => return Err(UidRangeError::Read { path: path.display().to_string(), err }),
        };
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            let f: Vec<&str> = line.split(':').collect();
            let name = f.first().copied().unwrap_or("");
            if file.starts_with("sub") {
                // NAME:START:COUNT
                let (Some(Ok(start)), Some(Ok(n))) = (f.get(1).map(|x| x.trim().parse::<u64>()), f.get(2).map(|x| x.trim().parse::<u64>())) else { continue };
                if n > 0 && start < end && u64::from(first) < start.saturating_add(n) {
                    conflicts.push(format!("{what} {start}-{} of {name} in {}", start.saturating_add(n) - 1, path.display()));
                }
            } else {
                // NAME:PASSWORD:ID:... (and a user's primary gid next).
                if let Some(Ok(id)) = f.get(2).map(|x| x.trim().parse::<u64>()) {
                    if inside(id) {
                        conflicts.push(format!("{what} {name} ({id}) in {}", path.display()));
                    }
                }
                if file == "passwd" {
                    if let Some(Ok(gid)) = f.get(3).map(|x| x.trim().parse::<u64>()) {
                        if inside(gid) {
                            conflicts.push(format!("primary gid {gid} of user {name} in {}", path.display()));
                        }
                    }
                }
            }
        }
    }
    if conflicts.is_empty() {
        return Ok(());
    }
    conflicts.truncate(8);
    Err(UidRangeError::Taken { first, last: first.saturating_add(count.saturating_sub(1)), conflicts })
}

/// The uids of `first..first+count` any process on the host runs as
/// (real, effective, saved or filesystem uid), read from /proc. Fails
/// when /proc cannot be read: a free uid is never guessed.
pub(super) fn uids_running(first: u32, count: u32) -> std::io::Result<BTreeSet<u32>> {
    let range = first..first.saturating_add(count);
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir("/proc")? {
        let e = e?;
        if !e.file_name().as_encoded_bytes().iter().all(u8::is_ascii_digit) {
            continue;
        }
        // A process that ended meanwhile has no status any more.
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else { continue };
        out.extend(status_uids(&status).into_iter().filter(|u| range.contains(u)));
    }
    Ok(out)
}

/// The uids on the `Uid:` line of a /proc/PID/status text.
fn status_uids(status: &str) -> Vec<u32> {
    status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap_or("").split_whitespace().filter_map(|u| u.parse().ok()).collect()
}

/// Claims `uid` in `dir`: its lock file, locked without waiting. None when
/// another process holds it. The file is never removed (removing a locked
/// file would let a second claimer lock a new file of the same name).
fn claim(dir: &Path, uid: u32) -> std::io::Result<Option<std::fs::File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(dir.join(uid.to_string()))?;
    match f.try_lock() {
        Ok(()) => Ok(Some(f)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

impl DeviceSlot {
    pub(super) fn exec(&self, tenant: &str) -> Option<Arc<Exec>> {
        self.execs.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).cloned()
    }

    /// Every executor, by tenant name.
    pub fn executors(&self) -> Vec<Arc<Exec>> {
        let mut v: Vec<_> = self.execs.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        v.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        v
    }

    /// A tenant's new share goes to the arbiter, its quota (and share, for
    /// its statistics) to its executor, whose answer is the change's.
    /// A grown quota raises the executor's cgroup memory bound first, on
    /// a device whose memory is host RAM (`after` is the tenant's new
    /// record).
    pub(super) fn set_on_executor(&self, after: &TenantRecord, share: crate::sched::Share, quota: Option<u64>) -> Result<WorkerMsg, ControlError> {
        let name = after.name.as_str();
        let exec = self.exec(name).ok_or_else(|| ControlError::WorkerDown(format!("executor of {name}")))?;
        if quota.is_some() {
            let (_, _, memory) = exec_bounds(&self.spec, after, 1);
            exec.raise_memory_max(memory).map_err(|e| ControlError::Internal(format!("raising the memory bound of {name}'s executor for its new quota: {}", super::passthrough::chain(&e))))?;
        }
        match exec.call(WorkerCmd::SetTenant { name: name.to_string(), share: Some(share), quota }, COMMAND_TIMEOUT)? {
            WorkerMsg::Ok => {}
            other => return Ok(other),
        }
        self.call(WorkerCmd::SetTenant { name: name.to_string(), share: Some(share), quota: None }, COMMAND_TIMEOUT)
    }

    /// The tenant's listening socket: the one its earlier executors
    /// served, if its file is still that socket, or a new one. Bound here,
    /// so the executor needs no write access anywhere.
    fn socket_for(&self, t: &TenantRecord) -> Result<UnixListener, (String, std::io::Error)> {
        let mut sockets = self.sockets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = sockets.get(&t.name) {
            // Its file is in the run directory, which only the daemon writes.
            let bound = l.local_addr().ok().and_then(|a| a.as_pathname().map(std::path::Path::to_path_buf));
            if bound.as_deref() == Some(t.socket.as_path()) && t.socket.exists() {
                return l.try_clone().map_err(|e| ("cloning the listening socket".to_string(), e));
            }
        }
        // A stale socket of an earlier run is replaced.
        let _ = std::fs::remove_file(&t.socket);
        let listener = UnixListener::bind(&t.socket).map_err(|e| (format!("binding {}", t.socket.display()), e))?;
        // Nobody but root may connect before its owner is set.
        std::fs::set_permissions(&t.socket, std::os::unix::fs::PermissionsExt::from_mode(0o600)).map_err(|e| ("chmod".to_string(), e))?;
        let handed = listener.try_clone().map_err(|e| ("cloning the listening socket".to_string(), e))?;
        sockets.insert(t.name.clone(), listener);
        Ok(handed)
    }

    /// Closes the tenant's listening socket: nobody connects any more.
    pub(super) fn forget_socket(&self, name: &str) {
        self.sockets.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        self.quick_ends.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
    }

    /// Revokes the tenant in its executor; the executor reports `Removed`
    /// once its memory is released, and then ends.
    pub(super) fn remove_on_executor(&self, name: &str) -> Result<WorkerMsg, ControlError> {
        self.forget_socket(name);
        let _ = self.call(WorkerCmd::RemoveTenant { name: name.to_string() }, STATS_TIMEOUT);
        let exec = self.exec(name).ok_or_else(|| ControlError::WorkerDown(format!("executor of {name}")))?;
        let r = exec.call(WorkerCmd::RemoveTenant { name: name.to_string() }, COMMAND_TIMEOUT);
        if !matches!(r, Ok(WorkerMsg::Ok)) {
            // It did not take the removal: its end releases everything.
            exec.kill();
            return r;
        }
        // It ends by itself once it reported the release; if it does not
        // within the grace, it is ended.
        let e2 = exec.clone();
        let _ = std::thread::Builder::new().name(format!("reap-{name}")).spawn(move || {
            std::thread::sleep(REMOVE_GRACE);
            e2.kill();
        });
        r
    }

    /// The arbiter's statistics with each executor's tenant: the tenants'
    /// memory, copies and scrubs come from their executors, whose pids
    /// come with them.
    pub(super) fn with_executors(&self, mut s: DeviceStats) -> (DeviceStats, HashMap<String, u32>) {
        let mut sources = HashMap::new();
        let execs: Vec<Arc<Exec>> = self.execs.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        let arbiter = std::mem::take(&mut s.tenants);
        // Asked all at once, then waited for together: executors that do
        // not answer cost one wait, not one each.
        let now = std::time::Instant::now();
        let asked: Vec<_> = execs
            .into_iter()
            .filter_map(|e| {
                let late = e.link.late.load(Ordering::Relaxed);
                // Marked, and no answer has come since, late or not: it is
                // not asked again (its input would fill with requests it
                // does not read) until it answers one it was asked.
                let marked = e.slow.load(Ordering::Relaxed);
                if marked != u64::MAX && marked >= late {
                    return None;
                }
                let who = format!("executor of {}", e.tenant);
                let sent = send_link(&e.link, &who, WorkerCmd::Stats, now + STATS_TIMEOUT, STATS_TIMEOUT);
                // Answered late before: a short wait, until it answers
                // in time again.
                let wait = if marked != u64::MAX { SLOW_STATS_WAIT } else { STATS_TIMEOUT };
                Some((e, who, sent, late, wait))
            })
            .collect();
        for (e, who, sent, late, wait) in asked {
            let Ok(sent) = sent else { continue };
            let x = match wait_link(&e.link, &who, sent, now + wait, wait) {
                Ok(WorkerMsg::Stats(x)) => {
                    e.slow.store(u64::MAX, Ordering::Relaxed);
                    x
                }
                Err(ControlError::Timeout(..)) => {
                    e.slow.store(late, Ordering::Relaxed);
                    continue;
                }
                _ => continue,
            };
            // A scrub that failed its check in any executor marks the
            // device: its memory cannot be trusted for anyone.
            s.quarantined |= x.quarantined;
            // An executor speaks for its own tenant only, and its device
            // time is what the arbiter's clock charged it, not its word.
            let Some(mut t) = x.tenants.into_iter().find(|t| t.name == e.tenant) else { continue };
            if let Some(a) = arbiter.iter().find(|a| a.name == t.name) {
                (t.weight, t.cap, t.priority, t.device_ns) = (a.weight, a.cap, a.priority, a.device_ns);
            }
            s.allocated = s.allocated.saturating_add(t.used);
            s.spilled = s.spilled.saturating_add(t.spilled);
            s.bytes_scrubbed = s.bytes_scrubbed.saturating_add(t.bytes_scrubbed);
            sources.insert(t.name.clone(), e.pid);
            s.tenants.push(t);
        }
        (s, sources)
    }
}

/// What a start of a tenant's executor does with one already running.
#[derive(Clone)]
pub(super) enum Start {
    /// Keeps one handed to the device's current arbiter; replaces older.
    KeepCurrent,
    /// Replaces this one, retired for a new share of an MPS server's SMs,
    /// without rebalancing the others again; does nothing if another has
    /// replaced it meanwhile (which may serve clients already).
    Rebalancing(Arc<Exec>),
}

impl Control {
    /// Has `t` served by an executor on `slot`: one already handed to the
    /// device's current arbiter is kept (after a worker restart, the
    /// re-population and a crashed executor's restart both get here, and
    /// the second finds the first's), any other is replaced.
    pub(super) fn start_executor(self: &Arc<Self>, slot: &Arc<DeviceSlot>, t: &TenantRecord) -> Result<(), ControlError> {
        self.start_executor_with(slot, t, Start::KeepCurrent).map(|_| ())
    }

    /// Starts `t`'s executor on `slot` and has it serve the tenant's
    /// socket, as `how` says; on a GPU shared under MPS the other
    /// executors' shares of the SMs are then brought in step, in the
    /// background (control/mps.rs `request_rebalance`), unless it is that
    /// rebalancing which asks. True if
    /// it started one (false: the one there was kept, as `how` says).
    pub(super) fn start_executor_with(self: &Arc<Self>, slot: &Arc<DeviceSlot>, t: &TenantRecord, how: Start) -> Result<bool, ControlError> {
        // One start at a time on the device: two for one tenant (a crash's
        // restart beside the supervisor's) would leave one orphaned.
        let _one = slot.starting.lock().unwrap_or_else(|e| e.into_inner());
        match self.registry().get(&t.name).map(|r| r.state) {
            Some(TenantPhase::Creating | TenantPhase::Ready) => {}
            _ => return Err(ControlError::Conflict(format!("tenant {} is gone or being deleted", t.name))),
        }
        // The arbiter this start hands the executor to: read before the
        // worker is asked, so a restart in between tags it as older (and
        // the re-population replaces it) rather than newer.
        let generation = slot.generation.load(Ordering::Acquire);
        let old = {
            let mut execs = slot.execs.lock().unwrap_or_else(|e| e.into_inner());
            let cur = execs.get(&t.name);
            match &how {
                Start::KeepCurrent if cur.is_some_and(|x| x.generation == generation && !x.is_reaped()) => {
                    debug!(tenant = %t.name, device = %slot.spec.name, "the tenant's executor already serves the current arbiter");
                    return Ok(false);
                }
                Start::Rebalancing(retired) if !cur.is_some_and(|x| Arc::ptr_eq(x, retired)) => {
                    debug!(tenant = %t.name, device = %slot.spec.name, "the retired executor was replaced meanwhile");
                    return Ok(false);
                }
                _ => {}
            }
            execs.remove(&t.name)
        };
        if let Some(old) = old {
            old.kill();
        }
        match slot.call(WorkerCmd::AddTenant(t.cmd()), COMMAND_TIMEOUT)? {
            WorkerMsg::Ok => {}
            WorkerMsg::Err(e) => return Err(ControlError::Worker(e)),
            other => return Err(ControlError::Worker(format!("unexpected reply {other:?}"))),
        }
        let fail = |what: &str, e: std::io::Error| ControlError::Internal(format!("starting the executor of {}: {what}: {e}", t.name));
        let (arbiter_end, executor_end) = crate::grant::Channel::pair().map_err(|e| fail("grant channel", e))?;
        let listener = slot.socket_for(t).map_err(|(what, e)| fail(&what, e))?;
        // On a GPU shared under MPS the executor is a client of the GPU's
        // MPS server: it runs as the server's uid, with its share of the SMs.
        let mps = match self.sharing_of(&slot.spec.name) {
            super::pool::Sharing::Mps => {
                let d = self.mps_daemon(slot)?;
                let total: u64 = self
                    .registry()
                    .values()
                    .filter(|x| x.device == slot.spec.name && x.name != t.name && matches!(x.state, TenantPhase::Creating | TenantPhase::Ready))
                    .map(|x| u64::from(x.weight))
                    .sum();
                let percent = super::mps::thread_percent(t.weight, total + u64::from(t.weight), t.cap);
                Some((d, percent))
            }
            super::pool::Sharing::TimeSliced => None,
        };
        let uid = match (&mps, &self.exec_uids, self.worker_user) {
            (Some((d, _)), _, _) => d.owner.filter(|_| d.ranged).map(|o| o.uid),
            (None, Some(r), Some(_)) => Some(r.take().map_err(|err| ControlError::Uid { who: t.name.clone(), err })?),
            _ => None,
        };
        let shared_uid = mps.is_some() && uid.is_some();
        let user = match uid {
            Some(u) => Some(Owner { uid: u, gid: u }),
            None => self.worker_user,
        };
        let give_back = || {
            if let (Some(u), Some(r), false) = (uid, &self.exec_uids, shared_uid) {
                r.put(u);
            }
        };
        let window = {
            let mut used = slot.windows.lock().unwrap_or_else(|e| e.into_inner());
            let w = (0u64..).find(|w| !used.contains(w)).unwrap_or(0);
            used.insert(w);
            w
        };
        let put_window = || {
            slot.windows.lock().unwrap_or_else(|e| e.into_inner()).remove(&window);
        };
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        let (fds, tasks, memory) = exec_bounds(&slot.spec, t, cpus);
        // Never above the daemon's own hard limit: raising it takes
        // CAP_SYS_RESOURCE, and an operator who bounded the daemon bounded
        // its executors too.
        let fds = fds.min(own_hard_nofile());
        let seq = self.exec_seq.fetch_add(1, Ordering::Relaxed);
        let limits = vgpu_topology::cgroup::Limits { memory_max: Some(memory), pids_max: Some(tasks) };
        let cgroup = match vgpu_topology::cgroup::Cgroup::create(
            std::path::Path::new(vgpu_topology::cgroup::CGROUP_ROOT),
            CGROUP_BASE,
            &format!("{}.{}.{seq}.{}", slot.spec.name, t.name, std::process::id()),
            &limits,
        )
        .and_then(|cg| match cg.procs_fd() {
            Ok(fd) => Ok((cg, fd)),
            Err(e) => {
                // Made but not joinable: it goes now, not later.
                cg.remove();
                Err(e)
            }
        }) {
            Ok(c) => Some(c),
            Err(e) => {
                if !NO_CGROUP_SAID.swap(true, Ordering::Relaxed) {
                    warn!(error = %super::passthrough::chain(&e), "tenant executors run without a cgroup: their descriptors are bounded by RLIMIT_NOFILE and their tasks by RLIMIT_NPROC of their own uids, their host memory only by the tenants' host_memory accounting");
                }
                None
            }
        };
        // Without a cgroup, RLIMIT_NPROC bounds tasks, and it counts every
        // process of the uid: a shared MPS uid has room for every client
        // the GPU's server takes.
        let uid_tasks = if shared_uid { tasks.saturating_mul(u64::from(self.mps_clients())) } else { tasks };
        let bounds = ExecBounds {
            fds,
            tasks: if cgroup.is_some() { Some(tasks) } else { uid.map(|_| uid_tasks) },
            memory: cgroup.as_ref().map(|_| memory),
            cgroup: cgroup.as_ref().map(|(cg, _)| cg.dir().display().to_string()),
            sm_percent: mps.as_ref().map(|(_, p)| *p),
        };
        let (cgroup, procs) = match cgroup {
            Some((cg, fd)) => (Some(cg), Some(fd)),
            None => (None, None),
        };
        let nproc = if procs.is_none() { uid.map(|_| uid_tasks) } else { None };
        let spawn_bounds = SpawnBounds { fds, nproc, cgroup_procs: procs };
        let env = mps.as_ref().map(|(d, p)| d.client_env(*p).to_vec()).unwrap_or_default();
        let log_as = format!("tenant {} on {}", t.name, slot.spec.name);
        let role = Role::Executor { grant: executor_end.into_fd(), listen: listener.into(), window, bounds: spawn_bounds, env, log_as };
        let (mut child, stdin, stdout, _) = match spawn_worker(&self.exe, &slot.spec, user, role) {
            Ok(c) => c,
            Err(e) => {
                give_back();
                put_window();
                if let Some(cg) = &cgroup {
                    cg.remove();
                }
                return Err(fail("spawning", e));
            }
        };
        let intake = slot.intake.lock().unwrap_or_else(|e| e.into_inner());
        let handed = intake.as_ref().map(|i| crate::arbiter::hand_over(i, &t.name, &arbiter_end.into_fd()));
        drop(intake);
        if !matches!(handed, Some(Ok(()))) {
            let _ = child.kill();
            let _ = child.wait();
            give_back();
            put_window();
            if let Some(cg) = &cgroup {
                cg.remove();
            }
            return Err(ControlError::WorkerDown(format!("{} (its arbiter took no grant channel: {handed:?})", slot.spec.name)));
        }
        // Our child's pid (not what it says it is).
        let pid = child.id();
        let link = Arc::new(WorkerLink::new(stdin));
        let exec = Arc::new(Exec {
            tenant: t.name.clone(),
            pid,
            uid,
            shared_uid,
            window,
            link: link.clone(),
            reaped: Mutex::new(false),
            started: std::time::Instant::now(),
            generation,
            retired: AtomicBool::new(false),
            slow: AtomicU64::new(u64::MAX),
            peers_ended: AtomicBool::new(false),
            memory_max: AtomicU64::new(bounds.memory.unwrap_or(0)),
            bounds,
            cgroup,
        });
        slot.execs.lock().unwrap_or_else(|e| e.into_inner()).insert(t.name.clone(), exec.clone());
        let who = format!("{}/{}", slot.spec.name, t.name);
        let (me, e2, s2) = (self.clone(), exec.clone(), slot.clone());
        let reader = std::thread::Builder::new().name(format!("replies-{}", t.name)).spawn(move || {
            me.read_replies_then(
                &who,
                stdout,
                &e2.link,
                Some(&e2.tenant),
                |_| {
                    // Released: the executor has nothing left to serve.
                    e2.retire();
                },
                |why| me.executor_fatal(&s2, &e2, why),
            );
            // Its output ended (or broke the rules): it is not listened to
            // any more, so it goes (and, unless retired, is replaced).
            e2.signal_kill();
        });
        let (me, s2, e2) = (self.clone(), slot.clone(), exec.clone());
        let reaper = std::thread::Builder::new().name(format!("exec-{}", t.name)).spawn(move || {
            // Waited for without reaping first, so `kill` (which looks at
            // `reaped` under its lock) never signals a pid reused after it.
            wait_exited(e2.pid);
            *e2.reaped.lock().unwrap_or_else(|e| e.into_inner()) = true;
            let status = child.wait();
            if let (Some(u), Some(r), false) = (e2.uid, &me.exec_uids, e2.shared_uid) {
                r.put(u);
            }
            s2.windows.lock().unwrap_or_else(|e| e.into_inner()).remove(&e2.window);
            if let Some(cg) = &e2.cgroup {
                cg.remove();
            }
            me.executor_ended(&s2, &e2, status);
        });
        let started = reader.and(reaper).map_err(|e| fail("starting its threads", e)).and_then(|_| match exec.call(WorkerCmd::AddTenant(t.cmd()), COMMAND_TIMEOUT) {
            Ok(WorkerMsg::Ok) => {
                let owner = t.owner.unwrap_or(Owner { uid: 0, gid: 0 });
                rundir::set_socket_owner(&t.socket, owner, t.mode_bits()).map_err(|e| ControlError::Internal(format!("setting the owner of {}: {e}", t.socket.display())))
            }
            Ok(WorkerMsg::Err(e)) => Err(ControlError::Worker(e)),
            Ok(other) => Err(ControlError::Worker(format!("unexpected reply {other:?}"))),
            Err(e) => Err(e),
        });
        if let Err(e) = started {
            // Not serving: it goes, and is not restarted.
            exec.kill();
            if self.registry().get(&t.name).map(|r| r.state) != Some(TenantPhase::Ready) {
                // A tenant whose creation fails keeps no socket.
                slot.forget_socket(&t.name);
            }
            let mut execs = slot.execs.lock().unwrap_or_else(|x| x.into_inner());
            if execs.get(&t.name).is_some_and(|x| Arc::ptr_eq(x, &exec)) {
                execs.remove(&t.name);
            }
            return Err(e);
        }
        if !matches!(self.registry().get(&t.name).map(|r| r.state), Some(TenantPhase::Creating | TenantPhase::Ready)) {
            // Deleted while it started: it goes, with the socket it serves.
            exec.kill();
            slot.forget_socket(&t.name);
            return Err(ControlError::Conflict(format!("tenant {} was deleted while its executor started", t.name)));
        }
        info!(tenant = %t.name, device = %slot.spec.name, pid, uid, sm_percent = ?exec.bounds.sm_percent, "tenant executor started");
        drop(_one);
        if matches!(how, Start::KeepCurrent) && exec.bounds.sm_percent.is_some() {
            self.request_rebalance(slot);
        }
        Ok(true)
    }

    /// An executor's process ended: a crash gets the tenant a new one; a
    /// tenant being deleted is released with it.
    fn executor_ended(self: &Arc<Self>, slot: &Arc<DeviceSlot>, e: &Arc<Exec>, status: std::io::Result<std::process::ExitStatus>) {
        let current = {
            let mut execs = slot.execs.lock().unwrap_or_else(|x| x.into_inner());
            let cur = execs.get(&e.tenant).is_some_and(|x| Arc::ptr_eq(x, e));
            if cur {
                execs.remove(&e.tenant);
            }
            cur
        };
        e.link.close();
        let phase = self.registry().get(&e.tenant).map(|t| t.state);
        if phase == Some(TenantPhase::Deleting) {
            // Its memory went with the process.
            self.finish_delete(&e.tenant);
            return;
        }
        if !current || e.retired.load(Ordering::Acquire) || self.stopping.load(Ordering::Acquire) || phase != Some(TenantPhase::Ready) {
            return;
        }
        let quick = {
            let mut q = slot.quick_ends.lock().unwrap_or_else(|x| x.into_inner());
            let n = q.entry(e.tenant.clone()).or_insert(0);
            *n = if e.started.elapsed() < QUICK_END { n.saturating_add(1) } else { 0 };
            *n
        };
        let delay = restart_delay(quick.saturating_sub(1));
        warn!(tenant = %e.tenant, device = %slot.spec.name, ?status, ?delay, "tenant executor exited; the tenant lost its connections; starting a new one");
        // An MPS client killed by a signal without saying why (a crash in
        // the driver, an OOM kill) may have left its server failed for
        // every client, as a fatal fault does. At most once a GPU per
        // MPS_CASCADE_EVERY: a tenant whose executor keeps crashing does
        // not end its co-clients' work again and again (if the server did
        // fail, their next call fails and they say so).
        let signalled = status.as_ref().ok().and_then(std::os::unix::process::ExitStatusExt::signal);
        // (One whose end was already passed on, or that was ended as a
        // co-client, counts for nothing here.)
        let handled = e.peers_ended.load(Ordering::Acquire);
        if let (Some(sig), super::pool::Sharing::Mps, false) = (signalled, self.sharing_of(&slot.spec.name), handled) {
            let due = {
                let mut at = slot.mps_cascade_at.lock().unwrap_or_else(|x| x.into_inner());
                let due = at.is_none_or(|t| t.elapsed() >= super::mps::MPS_CASCADE_EVERY);
                if due {
                    *at = Some(std::time::Instant::now());
                }
                due
            };
            if due {
                self.end_mps_peers(slot, e, &format!("its executor was killed by signal {sig}"));
            } else {
                warn!(tenant = %e.tenant, device = %slot.spec.name, signal = sig, "an MPS client was killed again within {:?} of the last one that ended its co-clients: they are left running", super::mps::MPS_CASCADE_EVERY);
            }
        }
        self.starting_until_up(slot, &e.tenant, delay);
    }

    /// Starts `tenant` an executor on a thread of its own, again and again
    /// with backoff, until one runs (a start that failed must not leave a
    /// Ready tenant without one).
    pub(super) fn keep_starting(self: Arc<Self>, slot: Arc<DeviceSlot>, tenant: String) {
        let spawned = std::thread::Builder::new().name(format!("restart-{tenant}")).spawn(move || self.starting_until_up(&slot, &tenant, RESTART_FIRST));
        if let Err(e) = spawned {
            warn!("no thread to restart an executor: {e}");
        }
    }

    /// Until one starts (clients wait in the socket's backlog meanwhile)
    /// or the tenant or its device goes.
    fn starting_until_up(self: &Arc<Self>, slot: &Arc<DeviceSlot>, tenant: &str, mut delay: Duration) {
        loop {
            std::thread::sleep(delay);
            let rec = match self.registry().get(tenant) {
                Some(r) if r.state == TenantPhase::Ready => r.clone(),
                _ => return,
            };
            if !slot.is_up() || self.stopping.load(Ordering::Acquire) || slot.exec(tenant).is_some() {
                // The device's supervisor re-creates it with the arbiter,
                // or another start got there first.
                return;
            }
            match self.start_executor(slot, &rec) {
                Ok(()) => return,
                Err(err) => warn!(tenant, "a new executor failed to start: {err}; trying again"),
            }
            delay = (delay * 2).min(RESTART_MAX);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_executor_uid_range_that_meets_host_ids_is_refused() {
        let etc = std::env::temp_dir().join(format!("vgpu-etc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&etc);
        std::fs::create_dir_all(&etc).unwrap();
        let (first, count) = (2_000_000, 65_536);
        // Nothing there, or ids around the range but not in it: allowed.
        check_uid_range(&etc, first, count).unwrap();
        std::fs::write(etc.join("passwd"), "root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/:/usr/sbin/nologin\n# a comment\nbad line\n").unwrap();
        std::fs::write(etc.join("subuid"), "alice:1934464:65536\nbob:2065536:65536\n").unwrap();
        check_uid_range(&etc, first, count).unwrap();
        // A user, a group and a subordinate range inside it: each named.
        std::fs::write(etc.join("passwd"), "ldapish:x:2000005:100::/home/l:/bin/sh\nsvc:x:900:2000007::/:/bin/sh\n").unwrap();
        std::fs::write(etc.join("group"), "g:x:2065535:\n").unwrap();
        std::fs::write(etc.join("subgid"), "carol:1999000:2000\n").unwrap();
        let e = check_uid_range(&etc, first, count).unwrap_err().to_string();
        for want in ["2000000-2065535", "user ldapish (2000005)", "primary gid 2000007 of user svc", "group g (2065535)", "subordinate gids 1999000-2000999 of carol"] {
            assert!(e.contains(want), "{want}: {e}");
        }
        assert!(!e.contains("alice") && !e.contains("bob"), "{e}");
        // An unreadable file fails the check rather than passing it.
        std::fs::remove_file(etc.join("group")).unwrap();
        std::fs::create_dir(etc.join("group")).unwrap();
        assert!(matches!(check_uid_range(&etc, 5_000_000, 10), Err(UidRangeError::Read { .. })));
        let _ = std::fs::remove_dir_all(&etc);
    }

    use super::*;

    #[test]
    fn a_status_text_gives_its_four_uids() {
        let text = "Name:\tvgpu-mediatord\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t1900000003\t1900000004\t1900000005\t1900000006\nGid:\t7\t7\t7\t7\n";
        assert_eq!(status_uids(text), [1_900_000_003, 1_900_000_004, 1_900_000_005, 1_900_000_006]);
        assert!(status_uids("Name:\tx\n").is_empty());
    }

    /// Two ranges claiming in one directory (two mediators) never give out
    /// one uid twice; a uid given back may be taken by the other.
    #[test]
    fn uids_claimed_in_one_directory_are_never_given_twice() {
        let dir = std::env::temp_dir().join(format!("vgpu-uid-claims-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (a, b) = (UidRange::claimed_in(4_000_000_000, 3, &dir).expect("claims"), UidRange::claimed_in(4_000_000_000, 3, &dir).expect("claims"));
        let (a1, b1, a2) = (a.take().expect("a uid"), b.take().expect("a uid"), a.take().expect("a uid"));
        assert_eq!([a1, b1, a2], [4_000_000_000, 4_000_000_001, 4_000_000_002]);
        assert!(matches!(b.take(), Err(UidError::Exhausted { first: 4_000_000_000, last: 4_000_000_002 })));
        a.put(a1);
        assert_eq!(b.take().expect("the uid a gave back"), a1);
        // A link planted in place of the directory is refused.
        let link = std::env::temp_dir().join(format!("vgpu-uid-claims-link-{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link).expect("symlink");
        assert!(UidRange::claimed_in(4_000_000_000, 3, &link).is_err());
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn restarts_back_off_from_50_ms_to_5_s() {
        assert_eq!(restart_delay(0), Duration::from_millis(50));
        assert_eq!(restart_delay(1), Duration::from_millis(100));
        assert_eq!(restart_delay(6), Duration::from_millis(3200));
        assert_eq!(restart_delay(7), RESTART_MAX);
        assert_eq!(restart_delay(u32::MAX), RESTART_MAX);
    }
}
