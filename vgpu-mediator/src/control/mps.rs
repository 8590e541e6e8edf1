//! NVIDIA's Multi-Process Service for the GPUs of pools whose sharing is
//! `mps`: spatial sharing for tenants that trust each other.
//!
//! Without MPS two processes' kernels never run on a GPU at once (the GPU
//! time-slices between them, at equal shares), so the arbiter grants the
//! GPU to one executor at a time. Under MPS the executors of a GPU are
//! clients of one MPS server: their kernels run at once, each on at most
//! its share of the SMs (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, from its
//! weight), and the arbiter lets them all run. What is given up, as
//! NVIDIA's MPS documentation says: a fatal fault in one client reaches
//! every client of the server, and the server takes no new client until
//! all of those have exited; and the clients share one uid (a server
//! serves one user). So when one executor of an MPS GPU meets a fatal
//! error, or ends without saying why (a crash, an OOM kill), the control
//! plane ends every executor of that GPU at once, and each tenant gets a
//! fresh one as soon as the server takes clients again.
//!
//! One control daemon (`devices.mps_control`, NVIDIA's
//! `nvidia-cuda-mps-control`) runs per GPU or MIG instance of such a pool,
//! started with the GPU's first executor, under the uid its executors
//! share, with its pipe and log directories in
//! `RUN_DIR/mps/DEVICE/{pipe,log}`; it is stopped (`quit`) when the pool
//! is deleted and when the daemon stops.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::pool::{PoolSpec, Sharing};
use super::{Control, ControlError, DeviceSlot, TenantPhase, TenantRecord, COMMAND_TIMEOUT, STATS_TIMEOUT};
use crate::config::Owner;
use crate::ipc::{WorkerCmd, WorkerMsg};

/// The most clients MPS serves on one device (Volta and later), and so
/// the most `devices.mps_max_clients` may be. The arbiter of an MPS GPU
/// has a lane per client it may serve: they all run at once.
pub const MPS_LANES: u32 = 48;
/// NVIDIA's control daemon, the default of `devices.mps_control`.
pub const DEFAULT_CONTROL: &str = "nvidia-cuda-mps-control";
/// How long the control daemon's start or stop may take.
const COMMAND_WAIT: Duration = Duration::from_secs(15);
/// The least time between two ends of a GPU's MPS clients for a client
/// killed without a word.
pub const MPS_CASCADE_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("preparing {path}")]
    Dir {
        path: String,
        #[source]
        err: std::io::Error,
    },
    #[error("running the MPS control daemon {control} (devices.mps_control)")]
    Run {
        control: String,
        #[source]
        err: std::io::Error,
    },
    #[error("the MPS control daemon {control} failed to {what} ({status}): {stderr}")]
    Failed { control: String, what: &'static str, status: String, stderr: String },
    #[error("the MPS control daemon {control} did not answer within {0:?}", COMMAND_WAIT)]
    Hung { control: String },
}

/// The MPS control daemon of one GPU or MIG instance.
#[derive(Debug)]
pub struct MpsDaemon {
    control: String,
    dir: PathBuf,
    pipe: PathBuf,
    /// Where its commands' stderr goes: beside its directory, in one only
    /// root writes, so its uid cannot plant a link there.
    errors: PathBuf,
    /// The uid it and the GPU's executors run as (None: the daemon's own).
    pub owner: Option<Owner>,
    /// That uid was taken from the executor range for the GPU (which keeps
    /// it), not the daemon's own.
    pub ranged: bool,
}

/// Creates `dir` (mode `mode`) if it is missing, owned by `owner`. Its
/// owner and mode are set through a descriptor opened without following a
/// link: the uid that owns the parent cannot redirect them.
fn make_dir(dir: &Path, mode: u32, owner: Option<Owner>) -> Result<(), MpsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |err| MpsError::Dir { path: dir.display().to_string(), err };
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err(e)),
    }
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(dir).map_err(err)?;
    if let Some(o) = owner {
        std::os::unix::fs::fchown(&f, Some(o.uid), Some(o.gid)).map_err(err)?;
    }
    f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode)).map_err(err)
}

/// Runs `cmd` to its end within [`COMMAND_WAIT`], with `input` on its
/// stdin. Its stderr goes to the file `errors` (a pipe could be held open
/// by the daemon it starts) and the first 4 KiB of it come back.
fn run(control: &str, mut cmd: Command, input: &str, errors: &Path) -> Result<(std::process::ExitStatus, String), MpsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let sink = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(errors)
        .map_err(|err| MpsError::Dir { path: errors.display().to_string(), err })?;
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::null()).stderr(sink).spawn().map_err(|err| MpsError::Run { control: control.into(), err })?;
    if let Some(mut i) = child.stdin.take() {
        let _ = i.write_all(input.as_bytes());
    }
    let deadline = Instant::now() + COMMAND_WAIT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut stderr = String::new();
                if let Ok(f) = std::fs::File::open(errors) {
                    let _ = std::io::Read::read_to_string(&mut std::io::Read::take(f, 4096), &mut stderr);
                }
                return Ok((status, stderr.trim().to_string()));
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MpsError::Hung { control: control.into() });
            }
            Err(err) => return Err(MpsError::Run { control: control.into(), err }),
        }
    }
}

impl MpsDaemon {
    /// Starts the control daemon of device `device` (`visible`: its
    /// `CUDA_VISIBLE_DEVICES`) under `owner`.
    pub fn start(control: &str, run_dir: &Path, device: &str, visible: &str, owner: Option<Owner>) -> Result<MpsDaemon, MpsError> {
        let top = run_dir.join("mps");
        make_dir(&top, 0o711, None)?;
        let dir = top.join(device);
        // Fresh directories: nothing an earlier daemon's uid left in them
        // reaches this daemon's clients.
        let _ = std::fs::remove_dir_all(&dir);
        make_dir(&dir, 0o700, owner)?;
        let left = std::fs::read_dir(&dir).map_err(|err| MpsError::Dir { path: dir.display().to_string(), err })?.count();
        if left != 0 {
            return Err(MpsError::Dir { path: dir.display().to_string(), err: std::io::Error::other("not empty after it was removed: a process of its uid still writes there") });
        }
        let (pipe, log) = (dir.join("pipe"), dir.join("log"));
        make_dir(&pipe, 0o700, owner)?;
        make_dir(&log, 0o700, owner)?;
        let errors = top.join(format!("{device}.err"));
        let d = MpsDaemon { control: control.into(), dir, pipe, errors, owner, ranged: false };
        let mut cmd = d.command();
        cmd.arg("-d").env("CUDA_VISIBLE_DEVICES", visible).env("CUDA_MPS_LOG_DIRECTORY", &log);
        let (status, stderr) = run(control, cmd, "", &d.errors)?;
        if !status.success() {
            return Err(MpsError::Failed { control: control.into(), what: "start", status: status.to_string(), stderr });
        }
        // `-d` may return before the daemon listens, and a client that
        // finds no daemon runs without MPS: wait until it answers.
        let deadline = Instant::now() + COMMAND_WAIT;
        while !d.alive() {
            if Instant::now() > deadline {
                let _ = d.stop();
                return Err(MpsError::Hung { control: control.into() });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.control);
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe);
        if let Some(o) = self.owner {
            // std drops the supplementary groups with the uid.
            cmd.uid(o.uid).gid(o.gid);
        }
        cmd
    }

    /// What a client (an executor of this GPU) needs in its environment:
    /// the server's pipe directory and its share of the SMs.
    pub fn client_env(&self, percent: u32) -> [(&'static str, String); 2] {
        [("CUDA_MPS_PIPE_DIRECTORY", self.pipe.display().to_string()), ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", percent.to_string())]
    }

    /// Whether the daemon still answers (its `get_server_list` command).
    pub fn alive(&self) -> bool {
        run(&self.control, self.command(), "get_server_list\n", &self.errors).is_ok_and(|(status, _)| status.success())
    }

    /// Stops the daemon (and with it the server) and removes its
    /// directories.
    pub fn stop(&self) -> Result<(), MpsError> {
        let r = run(&self.control, self.command(), "quit\n", &self.errors).and_then(|(status, stderr)| {
            if status.success() {
                Ok(())
            } else {
                Err(MpsError::Failed { control: self.control.clone(), what: "quit", status: status.to_string(), stderr })
            }
        });
        self.remove_dirs();
        r
    }

    /// Removes its directories and its commands' stderr file.
    fn remove_dirs(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.errors);
    }
}

/// Whether `cmd` names an executable file: a path, or a name on PATH.
fn executable(cmd: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let is_exe = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if cmd.contains('/') {
        return is_exe(Path::new(cmd));
    }
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| is_exe(&d.join(cmd))))
}

impl Control {
    /// How tenants share `device`: its pool's sharing.
    pub(super) fn sharing_of(&self, device: &str) -> Sharing {
        let named = self.pool_map();
        self.pool_of(&named, device).sharing
    }

    /// The most tenants one GPU of an MPS pool serves.
    pub(super) fn mps_clients(&self) -> u32 {
        self.mps_max_clients.get().copied().unwrap_or(MPS_LANES)
    }

    fn control_command(&self) -> String {
        self.mps_control.get().cloned().unwrap_or_else(|| DEFAULT_CONTROL.into())
    }

    /// Stops the MPS control daemons an earlier run on this run directory
    /// left behind (it was killed, so it could not): each is told to quit,
    /// as the uid that owns its directory, and its directories go. A new
    /// daemon for the GPU would otherwise meet the old one's pipe.
    pub fn stop_stale_mps(&self) {
        use std::os::unix::fs::MetadataExt;
        let top = self.run_dir.join("mps");
        let Ok(entries) = std::fs::read_dir(&top) else { return };
        for e in entries.flatten() {
            let dir = e.path();
            // Directories only (not links, not the commands' stderr files).
            let Ok(md) = std::fs::symlink_metadata(&dir) else { continue };
            if !md.is_dir() {
                continue;
            }
            let device = e.file_name().to_string_lossy().into_owned();
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            let owner = (md.uid() != me).then(|| Owner { uid: md.uid(), gid: md.gid() });
            let d = MpsDaemon { control: self.control_command(), pipe: dir.join("pipe"), dir, errors: top.join(format!("{device}.err")), owner, ranged: false };
            // A daemon of its own uid that no process runs as any more is
            // gone: only its directories are left (and no command is run
            // as that uid). Unknown (/proc unreadable): told to quit.
            let gone = owner.is_some_and(|o| super::executors::uids_running(o.uid, 1).is_ok_and(|r| r.is_empty()));
            if gone {
                d.remove_dirs();
                continue;
            }
            match d.stop() {
                Ok(()) => warn!(device = %device, uid = ?owner.map(|o| o.uid), "stopped the MPS control daemon an earlier run left behind"),
                Err(e) => {
                    warn!(device = %device, error = %super::passthrough::chain(&e), "an MPS control daemon an earlier run left behind did not quit (or none listened); its directories are removed")
                }
            }
        }
    }

    /// Whether every device of `spec` can be shared under MPS: GPUs (or
    /// MIG instances) whose tenants have executors, with NVIDIA's control
    /// daemon at hand.
    pub(super) fn mps_allowed(&self, spec: &PoolSpec) -> Result<(), ControlError> {
        let bad = |why: String| Err(ControlError::BadRequest(format!("pool {}: sharing \"mps\" {why}", spec.name)));
        for d in &spec.devices {
            match self.slot(d) {
                None if self.pass_device(d).is_some() => return bad(format!("shares GPUs between tenants; {d} is lent whole to VMs")),
                None => {}
                Some(s) if s.spec.cuda.is_none() => return bad(format!("is for GPUs and MIG instances; {d} is a CPU device")),
                Some(s) if !s.spec.executors => return bad(format!("needs an executor per tenant on {d} (devices.isolation = \"process\")")),
                Some(_) => {}
            }
        }
        let control = self.control_command();
        if !executable(&control) {
            return bad(format!("needs NVIDIA's MPS control daemon: {control} (devices.mps_control) is not an executable file{}", if control.contains('/') { "" } else { " on PATH" }));
        }
        Ok(())
    }

    /// The running MPS control daemon of `slot`, started if it is not.
    pub(super) fn mps_daemon(&self, slot: &DeviceSlot) -> Result<Arc<MpsDaemon>, ControlError> {
        let mut g = slot.mps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = g.as_ref() {
            if d.alive() {
                return Ok(d.clone());
            }
            warn!(device = %slot.spec.name, "the MPS control daemon stopped answering; starting it again");
            if let Some(d) = g.take() {
                // Told to go, in case it only answered late.
                let _ = d.stop();
            }
        }
        // The server serves one uid: every executor of the GPU runs as it.
        // The GPU keeps that uid for the mediator's life: it never goes to
        // another tenant while a process of an old daemon or of its clients
        // may still run as it.
        let (owner, ranged) = match (&self.exec_uids, self.worker_user) {
            (Some(r), Some(_)) => {
                let mut kept = slot.mps_uid.lock().unwrap_or_else(|e| e.into_inner());
                let u = match *kept {
                    Some(u) => u,
                    None => r.take().map_err(|err| ControlError::Uid { who: format!("the MPS clients of {}", slot.spec.name), err })?,
                };
                *kept = Some(u);
                (Some(Owner { uid: u, gid: u }), true)
            }
            _ => (self.worker_user, false),
        };
        let visible = slot.spec.cuda.as_ref().map(|c| c.visible_devices.clone()).unwrap_or_default();
        match MpsDaemon::start(&self.control_command(), &self.run_dir, &slot.spec.name, &visible, owner) {
            Ok(mut d) => {
                d.ranged = ranged;
                info!(device = %slot.spec.name, uid = ?owner.map(|o| o.uid), "MPS control daemon started");
                let d = Arc::new(d);
                *g = Some(d.clone());
                Ok(d)
            }
            Err(e) => Err(ControlError::Internal(format!("starting MPS on {}: {}", slot.spec.name, super::passthrough::chain(&e)))),
        }
    }

    /// Stops `slot`'s MPS control daemon, if it runs.
    pub(super) fn stop_mps(&self, slot: &DeviceSlot) {
        let d = slot.mps.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(d) = d {
            match d.stop() {
                Ok(()) => info!(device = %slot.spec.name, "MPS control daemon stopped"),
                Err(e) => warn!(device = %slot.spec.name, "stopping the MPS control daemon: {}", super::passthrough::chain(&e)),
            }
        }
    }

    /// Restarts the arbiters of `devices` (which hold no tenants), so that
    /// they take their lanes from their pool's sharing; returns once each
    /// is up again. One that does not come back is said, not returned: the
    /// pool's change is made, and an arbiter takes its lanes from it at
    /// every start.
    pub(super) fn relaunch_arbiters(&self, devices: &[String]) {
        for slot in devices.iter().filter_map(|d| self.slot(d)) {
            let pid = slot.pid.load(Ordering::Acquire);
            if pid == 0 || !slot.spec.executors {
                // Not started yet: it starts with the right lanes.
                continue;
            }
            let before = slot.generation.load(Ordering::Acquire);
            slot.relaunching.store(true, Ordering::Release);
            // SAFETY: a signal to our own child, the device's arbiter.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            let deadline = Instant::now() + COMMAND_WAIT;
            while !(slot.generation.load(Ordering::Acquire) != before && slot.is_up()) {
                if Instant::now() > deadline {
                    warn!(device = %slot.spec.name, "its arbiter did not come back within {COMMAND_WAIT:?} of a restart for its pool's sharing; its supervisor keeps trying");
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// Has `slot`'s executors' shares of the SMs brought in step with the
    /// tenants' weights (`rebalance_mps`) on a thread of its own, if the
    /// GPU is shared under MPS. Whoever asks (a tenant's creation, change
    /// or delete) never waits on an executor; requests that come while a
    /// pass runs make one more pass, so there is at most one rebalancing
    /// thread per GPU and none is lost.
    pub(super) fn request_rebalance(self: &Arc<Self>, slot: &Arc<DeviceSlot>) {
        if self.sharing_of(&slot.spec.name) != Sharing::Mps {
            return;
        }
        {
            let mut r = slot.mps_rebalance.lock().unwrap_or_else(|e| e.into_inner());
            r.again = true;
            if r.running {
                return;
            }
            r.running = true;
        }
        let (me, s2) = (self.clone(), slot.clone());
        let spawned = std::thread::Builder::new().name("mps-rebalance".into()).spawn(move || loop {
            {
                let mut r = s2.mps_rebalance.lock().unwrap_or_else(|e| e.into_inner());
                if !r.again {
                    r.running = false;
                    return;
                }
                r.again = false;
            }
            // A bug in a pass must not leave the GPU without rebalancing.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.rebalance_mps(&s2))).is_err() {
                warn!(device = %s2.spec.name, "a pass rebalancing the shares of the SMs failed; the next request makes another");
            }
        });
        if let Err(e) = spawned {
            // The shares stay as they are until the next request.
            slot.mps_rebalance.lock().unwrap_or_else(|e| e.into_inner()).running = false;
            warn!(device = %slot.spec.name, "no thread to rebalance the shares of the SMs: {e}");
        }
    }

    /// Keeps the shares of the SMs of a GPU's executors in step with the
    /// weights of the tenants on it. MPS fixes a client's share when it
    /// starts, so an executor whose share changed is replaced if it serves
    /// no connection when asked (no context or allocation is lost); one
    /// that serves connections keeps its share until its next start. Each
    /// executor is asked on a thread of its own, which the pass does not
    /// wait for: one that does not answer delays no other's new share,
    /// and a later pass leaves it to the thread still asking it (which
    /// asks for another pass when it is done).
    fn rebalance_mps(self: &Arc<Self>, slot: &Arc<DeviceSlot>) {
        if self.sharing_of(&slot.spec.name) != Sharing::Mps {
            return;
        }
        let tenants: Vec<TenantRecord> = self.registry().values().filter(|t| t.device == slot.spec.name && matches!(t.state, TenantPhase::Creating | TenantPhase::Ready)).cloned().collect();
        let total: u64 = tenants.iter().map(|t| u64::from(t.weight)).sum();
        // A VM's guest state lives in its executor whether or not a
        // process connection is counted: VM tenants keep their share.
        for t in tenants.into_iter().filter(|t| t.state == TenantPhase::Ready && t.kind != "vm") {
            let Some(e) = slot.exec(&t.name) else { continue };
            let want = thread_percent(t.weight, total, t.cap);
            if e.bounds.sm_percent == Some(want) {
                continue;
            }
            {
                // At most one thread per tenant (at most
                // devices.mps_max_clients, 48, per GPU).
                let mut asking = slot.mps_asking.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(skipped) = asking.get_mut(&t.name) {
                    *skipped = true;
                    continue;
                }
                asking.insert(t.name.clone(), false);
            }
            let (me, s2, name) = (self.clone(), slot.clone(), t.name.clone());
            let spawned = std::thread::Builder::new().name("mps-reshare".into()).spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.reshare(&s2, &t, e, want)));
                if r.is_err() {
                    warn!(tenant = %t.name, device = %s2.spec.name, "asking the executor for its new share of the SMs failed");
                }
                let skipped = s2.mps_asking.lock().unwrap_or_else(|e| e.into_inner()).remove(&t.name).unwrap_or(false);
                if skipped {
                    // A pass came while it was asked: its share may have
                    // changed again.
                    me.request_rebalance(&s2);
                }
            });
            if let Err(err) = spawned {
                slot.mps_asking.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
                warn!(tenant = %name, device = %slot.spec.name, "no thread to ask the executor for its new share of the SMs: {err}; it keeps its share until its next start");
            }
        }
    }

    /// Replaces `e`, `t`'s executor, with one that has `want` percent of
    /// the SMs, if it serves no client. The GPU's executors stop accepting
    /// one at a time, each replaced before the next is asked, so a client
    /// waits for one start at most; one slow to answer is waited for
    /// outside that turn.
    fn reshare(self: &Arc<Self>, slot: &Arc<DeviceSlot>, t: &TenantRecord, e: Arc<super::executors::Exec>, want: u32) {
        let mut turn = Some(slot.mps_turn.lock().unwrap_or_else(|e| e.into_inner()));
        // Its current record (a change may have come since), and only
        // if the executor asked is still the one serving it.
        let Some(rec) = self.registry().get(&t.name).filter(|r| r.state == TenantPhase::Ready).cloned() else { return };
        if !slot.exec(&t.name).is_some_and(|cur| Arc::ptr_eq(&cur, &e)) {
            return;
        }
        // It stops accepting only if it serves no client, in one step
        // with its accepts: a client that connects from here on waits
        // in the socket's backlog for the replacement.
        // Commands run in order: asked again after a late answer, the
        // executor answers for both (once retired, it says so again).
        let retire = |within| e.call(WorkerCmd::RetireIfIdle { name: t.name.clone() }, within);
        let answer = match retire(STATS_TIMEOUT) {
            Err(ControlError::Timeout(..)) => {
                drop(turn.take());
                let a = retire(COMMAND_TIMEOUT);
                turn = Some(slot.mps_turn.lock().unwrap_or_else(|e| e.into_inner()));
                a
            }
            other => other,
        };
        match answer {
            Ok(WorkerMsg::Ok) => {}
            Ok(WorkerMsg::Err(why)) => {
                info!(tenant = %t.name, device = %slot.spec.name, now = ?e.bounds.sm_percent, want, "the executor keeps its share of the SMs until its next start: {why}");
                return;
            }
            // Gone: its end starts the tenant a new one.
            Err(ControlError::WorkerDown(_)) => return,
            // It may have stopped accepting and no longer answers: it
            // is replaced rather than left for clients to wait on.
            other => warn!(tenant = %t.name, device = %slot.spec.name, "asking the executor to retire: {other:?}; replacing it"),
        }
        match self.start_executor_with(slot, &rec, super::executors::Start::Rebalancing(e.clone())) {
            Ok(true) => info!(tenant = %t.name, device = %slot.spec.name, sm_percent = want, "idle executor replaced for its new share of the SMs"),
            Ok(false) => {}
            Err(err) => {
                // The old one is gone: the tenant must not stay without one.
                warn!(tenant = %t.name, device = %slot.spec.name, "replacing the executor for its new share of the SMs failed: {err}; starting one again");
                self.clone().keep_starting(slot.clone(), t.name.clone());
            }
        }
        drop(turn);
    }

    /// An executor of `slot` ends on an error its device state cannot
    /// recover from. Under MPS the fault reached every client of the GPU's
    /// server, which takes no new client until all of them have exited:
    /// every executor of the GPU ends now, and each tenant gets a fresh
    /// one (restarted with backoff while the server recovers).
    pub(super) fn executor_fatal(&self, slot: &DeviceSlot, exec: &Arc<super::executors::Exec>, why: &str) {
        let tenant = exec.tenant.as_str();
        if !slot.exec(tenant).is_some_and(|cur| Arc::ptr_eq(&cur, exec)) {
            // Already replaced: its fault was acted on.
            return;
        }
        if self.sharing_of(&slot.spec.name) != Sharing::Mps {
            info!(device = %slot.spec.name, tenant, "the executor ends on an unrecoverable error ({why}); only its tenant is affected");
            return;
        }
        self.end_mps_peers(slot, exec, why);
    }

    /// `exec`, a client of the GPU's MPS server, failed (`why`): every
    /// other executor of the GPU ends now, once per failure. Those ended
    /// here pass nothing on when they exit, so one failure never ends the
    /// fresh executors started after it.
    pub(super) fn end_mps_peers(&self, slot: &DeviceSlot, exec: &super::executors::Exec, why: &str) {
        if exec.peers_ended.swap(true, Ordering::AcqRel) {
            return;
        }
        let tenant = exec.tenant.as_str();
        let others: Vec<_> = slot.executors().into_iter().filter(|e| e.tenant != tenant).collect();
        if others.is_empty() {
            return;
        }
        warn!(
            device = %slot.spec.name,
            tenant,
            others = ?others.iter().map(|e| e.tenant.as_str()).collect::<Vec<_>>(),
            "a failed client under MPS ({why}) fails every client of the GPU: ending all of its executors; each tenant gets a new one once the MPS server takes clients again"
        );
        for e in others {
            e.peers_ended.store(true, Ordering::Release);
            // As a crash would: the tenant gets a new executor.
            e.signal_kill();
        }
    }
}

/// A tenant's share of the SMs under MPS, in percent: its weight's share
/// of the weights of the tenants on the GPU (its own included), rounded
/// up, never above its cap, and at least 1.
pub fn thread_percent(weight: u32, total_weight: u64, cap: Option<u32>) -> u32 {
    let total = total_weight.max(u64::from(weight)).max(1);
    let share = (u64::from(weight) * 100).div_ceil(total).clamp(1, 100) as u32;
    cap.map_or(share, |c| share.min(c.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_of_the_sms_follow_weights_and_caps() {
        assert_eq!(thread_percent(1, 4, None), 25);
        assert_eq!(thread_percent(3, 4, None), 75);
        assert_eq!(thread_percent(1, 3, None), 34);
        assert_eq!(thread_percent(5, 5, None), 100);
        assert_eq!(thread_percent(5, 5, Some(40)), 40);
        assert_eq!(thread_percent(1, 1000, None), 1);
        // A total that somehow leaves the tenant out still counts it.
        assert_eq!(thread_percent(2, 0, None), 100);
        assert_eq!(thread_percent(2, 4, Some(0)), 1);
    }
}
