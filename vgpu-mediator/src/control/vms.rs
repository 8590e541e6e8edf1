//! Managed VMs (`/vms`, docs/vms.md): a VM and its vGPU made in one call.
//!
//! Creating a VM creates its vGPU tenant (kind `vm`, same name), which its
//! pool's policy places on a device; the VM's NUMA node is that device's.
//! Each VM has a supervisor thread that starts `vgpu-vmm` on that node
//! with the tenant's vhost-user socket, waits for it, and applies the
//! restart policy when it ends on its own. The description and whether the
//! VM should run are kept in `STATE_DIR/vms/NAME/vm.json`, so the daemon
//! brings its VMs back when it starts again. A VMM dies with its daemon
//! (`PR_SET_PDEATHSIG`): its vGPU's worker does too.
//!
//! The guest's console and the VMM's own log go through pipes to files the
//! daemon caps (`console.log`, `vmm.log`, 1 MiB each plus one older
//! file), so a guest cannot fill the host's disk.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use vgpu_api::vm::{Hugepages, NetAttach, RestartPolicy, VmSpec, VmState, VmView};
use vgpu_topology::safe_open;

use super::{Control, ControlError, TenantRecord};

/// Where the VM manager finds `vgpu-vmm` and keeps its state.
#[derive(Debug, Clone)]
pub struct VmsConfig {
    pub vmm: PathBuf,
    pub state_dir: PathBuf,
    /// How long a stop waits for the guest to end before the VMM is killed.
    pub stop_timeout: Duration,
    /// Jail each VMM as this uid and gid (`vgpu-vmm --jail`).
    pub jail: Option<crate::config::Owner>,
}

/// Each log file's cap; one older file is kept beside it.
pub const LOG_CAP: u64 = 1 << 20;
/// How long a start waits for the VMM's API socket before it reports the
/// VM running anyway (the VMM is alive).
const READY_WAIT: Duration = Duration::from_secs(10);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Most VMs one daemon manages.
pub const MAX_VMS: usize = 1024;
/// Most network interfaces of one VM (vgpu-vmm's limit).
pub const MAX_NETS: usize = 8;
/// Most passthrough devices of one VM.
pub const MAX_PASSTHROUGH: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Desired {
    Running,
    Stopped,
    /// Being deleted: the supervisor ends.
    Deleted,
}

impl Desired {
    fn as_str(self) -> &'static str {
        match self {
            Desired::Running => "running",
            Desired::Stopped => "stopped",
            Desired::Deleted => "deleted",
        }
    }
}

/// What `vm.json` holds.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    spec: VmSpec,
    desired: Desired,
    /// The hugepages set aside for the VM (kept across daemon restarts so
    /// that a delete gives back what a create took).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hugepages_reserved: Option<HugeReservation>,
}

/// Hugepages a VM has from its create to its delete: the daemon grew the
/// node's pool of the VM's page size by `pages` for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HugeReservation {
    node: i32,
    pages: u64,
    /// The host boot they were reserved in: a reboot gives them back.
    #[serde(default)]
    boot: String,
}

struct Run {
    desired: Desired,
    state: VmState,
    pid: u32,
    /// The running VMM's pidfd: signals reach that process and no other,
    /// even once its pid is reused.
    pidfd: Option<Arc<OwnedFd>>,
    restarts: u64,
    last_exit: Option<String>,
    error: Option<String>,
    /// Starts so far (a start waits for the next one to settle).
    starts: u64,
    /// Set by an API start: no back-off before it.
    kick: bool,
    /// The supervisor has ended.
    ended: bool,
    huge: Option<HugeReservation>,
}

pub struct Vm {
    spec: VmSpec,
    dir: PathBuf,
    api_socket: PathBuf,
    run: Mutex<Run>,
    cv: Condvar,
    /// Held while `vm.json` is written.
    saving: Mutex<()>,
}

impl Vm {
    fn lock(&self) -> MutexGuard<'_, Run> {
        self.run.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// Writes `vm.json` from the VM's state now (what it should be doing
    /// and its hugepages). Saves are serialised, so the file always holds
    /// the latest state whoever saved last.
    fn save(&self) -> Result<(), ControlError> {
        let _g = self.saving.lock().unwrap_or_else(|e| e.into_inner());
        let (desired, huge) = {
            let r = self.lock();
            (r.desired, r.huge.clone())
        };
        let s = Saved { spec: self.spec.clone(), desired, hugepages_reserved: huge };
        let text = serde_json::to_vec_pretty(&s).map_err(|e| ControlError::Internal(e.to_string()))?;
        let io = |e: std::io::Error| ControlError::Internal(format!("saving {}: {e}", self.dir.join("vm.json").display()));
        super::store::write_atomically(&self.dir.join("vm.json"), &text).map_err(io)
    }

    /// Waits until `done` holds or `limit` passes; returns whether it held.
    fn wait_for(&self, limit: Duration, done: impl Fn(&Run) -> bool) -> bool {
        let deadline = Instant::now() + limit.min(Duration::from_secs(3600));
        let mut r = self.lock();
        while !done(&r) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            r = self.cv.wait_timeout(r, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    /// Ends the VMM: SIGTERM first, which a jail's supervisor turns into
    /// a SIGKILL of the jailed VMM that it waits for, so the VMM's
    /// descriptors (its taps) are closed when the supervisor ends; SIGKILL
    /// after `grace` if it has not. A SIGKILLed supervisor ends before its
    /// jailed VMM is reaped, and a restart then found the tap still busy.
    fn terminate(&self, grace: Duration) {
        self.signal(libc::SIGTERM);
        if !self.wait_for(grace, |r| r.pid == 0) {
            self.signal(libc::SIGKILL);
        }
    }

    fn signal(&self, sig: i32) {
        let fd = self.lock().pidfd.clone();
        if let Some(fd) = fd {
            // SAFETY: pidfd_send_signal on a pidfd we own, no siginfo.
            unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), sig, std::ptr::null::<libc::siginfo_t>(), 0) };
        }
    }
}

pub struct Vms {
    cfg: VmsConfig,
    map: Mutex<BTreeMap<String, Arc<Vm>>>,
    /// Held while a VM is created or deleted, so two calls for one name
    /// cannot interleave.
    changing: Mutex<()>,
}

/// Gives each interface of `spec` without a MAC a random locally managed
/// one in QEMU's 52:54:00 block, none of them in `taken` or the spec.
fn assign_macs(spec: &mut VmSpec, taken: &[String]) {
    let mut used: Vec<String> = taken.iter().map(|m| m.to_ascii_lowercase()).collect();
    used.extend(spec.nets.iter().filter_map(|n| n.mac.as_ref().map(|m| m.to_ascii_lowercase())));
    for n in spec.nets.iter_mut().filter(|n| n.mac.is_none()) {
        let mac = loop {
            let mut b = [0u8; 3];
            // SAFETY: getrandom writes at most b.len() bytes into b.
            let got = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
            if got != b.len() as isize {
                // No entropy source: the clock's nanoseconds will do.
                let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0) ^ std::process::id();
                b = [(t >> 16) as u8, (t >> 8) as u8, t as u8];
            }
            let m = format!("52:54:00:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2]);
            if !used.contains(&m) {
                break m;
            }
        };
        used.push(mac.clone());
        n.mac = Some(mac);
    }
}

/// Where the host's cgroup v2 hierarchy is mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The VMM's own memory beyond guest RAM that its cgroup allows.
const VMM_MEMORY_OVERHEAD: u64 = 256 << 20;

/// The cgroup limits of a jailed VMM (`--jail-memory`, `--jail-pids`),
/// when `root` is a cgroup v2 hierarchy offering the memory and pids
/// controllers; None otherwise (the jail then sets none). Memory: guest
/// RAM (not with hugepages, which the memory controller does not count)
/// and 256 MiB for the VMM itself. Tasks: a thread per vCPU, disk and
/// interface, and 32 for the rest.
fn jail_limits(spec: &VmSpec, root: &Path) -> Option<(u64, u64)> {
    let have = std::fs::read_to_string(root.join("cgroup.controllers")).ok()?;
    if !["memory", "pids"].iter().all(|w| have.split_whitespace().any(|c| c == *w)) {
        return None;
    }
    let ram = if spec.hugepages.is_some_and(|h| h != Hugepages::None) { 0 } else { spec.memory.0 };
    let pids = spec.vcpus as u64 + spec.disks.len() as u64 + spec.nets.len() as u64 + 32;
    Some((ram.saturating_add(VMM_MEMORY_OVERHEAD), pids))
}

/// A start, stop or reboot that comes during a delete: a VM being deleted
/// never runs again.
fn being_deleted(name: &str) -> ControlError {
    ControlError::Conflict(format!("VM {name} is being deleted"))
}

fn bad(msg: impl Into<String>) -> ControlError {
    ControlError::BadRequest(msg.into())
}

fn describe(status: std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit {c}"),
            (None, Some(sig)) => format!("signal {sig}"),
            _ => "ended".into(),
        },
        Err(e) => format!("unknown ({e})"),
    }
}

/// A file that holds at most [`LOG_CAP`] bytes; the one before it is
/// kept as `PATH.1`.
struct CappedLog {
    path: PathBuf,
    file: Option<File>,
    len: u64,
}

impl CappedLog {
    fn open(path: PathBuf) -> CappedLog {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path).ok();
        let len = file.as_ref().and_then(|f| f.metadata().ok()).map_or(0, |m| m.len());
        CappedLog { path, file, len }
    }

    fn write(&mut self, mut buf: &[u8]) {
        while !buf.is_empty() {
            if self.len >= LOG_CAP {
                let mut old = self.path.clone().into_os_string();
                old.push(".1");
                let _ = std::fs::rename(&self.path, &old);
                self.file = File::create(&self.path).ok();
                self.len = 0;
            }
            let n = buf.len().min((LOG_CAP - self.len) as usize);
            if let Some(f) = &mut self.file {
                let _ = f.write_all(&buf[..n]);
            }
            self.len += n as u64;
            buf = &buf[n..];
        }
    }
}

/// Copies a pipe into a capped log until the writer closes it; the
/// copying thread's handle, when it could be started.
fn pump(mut from: impl Read + Send + 'static, to: PathBuf, name: String) -> Option<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            let mut log = CappedLog::open(to);
            let mut buf = [0u8; 16 << 10];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => log.write(&buf[..n]),
                }
            }
        })
        .ok()
}

/// The last `max` bytes of a capped log (reaching into its older file).
pub fn tail(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let read_tail = |p: &Path, n: u64| -> std::io::Result<Vec<u8>> {
        let mut f = match File::open(p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(n)))?;
        let mut v = Vec::new();
        f.take(n).read_to_end(&mut v)?;
        Ok(v)
    };
    let mut out = read_tail(path, max)?;
    if (out.len() as u64) < max {
        let mut old = path.as_os_str().to_owned();
        old.push(".1");
        let mut before = read_tail(Path::new(&old), max - out.len() as u64)?;
        before.append(&mut out);
        out = before;
    }
    Ok(out)
}

/// The pool size file of hugepages of `size` on `node` (or the whole
/// host when the node is unknown).
fn nr_hugepages_path(size: Hugepages, node: i32) -> Option<PathBuf> {
    let name = size.sysfs_name()?;
    let root = vgpu_topology::sysfs_root();
    Some(if node >= 0 { root.join(format!("devices/system/node/node{node}/hugepages/{name}/nr_hugepages")) } else { root.join(format!("kernel/mm/hugepages/{name}/nr_hugepages")) })
}

/// Serialises this daemon's changes to hugepage pools (each is a read,
/// a write and a read back).
static HUGEPAGE_POOLS: Mutex<()> = Mutex::new(());

/// Grows (or shrinks) a hugepage pool by `delta` pages. Growing fails,
/// and leaves the pool as it was, when the kernel cannot find that many
/// pages on the node.
fn adjust_hugepages(size: Hugepages, node: i32, delta: i64) -> Result<(), String> {
    let Some(path) = nr_hugepages_path(size, node) else { return Ok(()) };
    let _g = HUGEPAGE_POOLS.lock().unwrap_or_else(|e| e.into_inner());
    let read = || -> Result<u64, String> { std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?.trim().parse().map_err(|e| format!("{}: {e}", path.display())) };
    let write = |n: u64| std::fs::write(&path, n.to_string()).map_err(|e| format!("writing {}: {e}", path.display()));
    let before = read()?;
    let want = before.saturating_add_signed(delta);
    write(want)?;
    let got = read()?;
    if delta > 0 && got < want {
        let _ = write(before);
        return Err(format!("the kernel found only {} of {delta} more", got.saturating_sub(before)));
    }
    Ok(())
}

/// Free memory of `node` in bytes (of the host when the node is unknown).
fn free_memory(node: i32) -> Option<u64> {
    let root = vgpu_topology::sysfs_root();
    let (path, key) = if node >= 0 { (root.join(format!("devices/system/node/node{node}/meminfo")), "MemFree:") } else { (PathBuf::from("/proc/meminfo"), "MemAvailable:") };
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.contains(key))?;
    let kib: u64 = line.split(key).nth(1)?.split_whitespace().next()?.parse().ok()?;
    Some(kib << 10)
}

/// Sets aside the hugepages VM `vm` needs on `node` (its vGPU's): the
/// node's pool grows by that many pages, which stay the VM's until it is
/// deleted, so two VMs never count the same free pages. A VM whose vGPU
/// moved to another node gives back the old node's pages first.
fn reserve_hugepages(vm: &Vm, node: i32) -> Result<(), ControlError> {
    let size = vm.spec.hugepages.unwrap_or_default();
    if size == Hugepages::None {
        return Ok(());
    }
    let have = vm.lock().huge.clone();
    match have {
        // Pages reserved before the host rebooted went with the reboot.
        Some(h) if h.boot != boot_id() => vm.lock().huge = None,
        Some(h) if h.node == node => return Ok(()),
        Some(_) => release_hugepages(vm),
        None => {}
    }
    let pages = vm.spec.memory.0 / size.page_size();
    let at = if node >= 0 { format!("NUMA node {node}") } else { "this host".into() };
    // Never ask the kernel for more than the node has free: it would
    // reclaim and compact memory for pages it cannot all find.
    if let Some(free) = free_memory(node).filter(|f| *f < vm.spec.memory.0) {
        return Err(ControlError::InsufficientMemory(format!("VM {} needs {pages} {} hugepages on {at} (its vGPU's node), which has {} MiB free", vm.spec.name, size.as_str(), free >> 20)));
    }
    adjust_hugepages(size, node, pages as i64)
        .map_err(|e| ControlError::InsufficientMemory(format!("VM {} needs {pages} {} hugepages on {at} (its vGPU's node): {e}", vm.spec.name, size.as_str())))?;
    vm.lock().huge = Some(HugeReservation { node, pages, boot: boot_id() });
    save_if_made(vm);
    info!(vm = %vm.spec.name, pages, node, size = size.as_str(), "hugepages reserved");
    Ok(())
}

/// Gives back the hugepages reserved for VM `vm`, if any (not those of a
/// boot before this one: the reboot took them).
fn release_hugepages(vm: &Vm) {
    let Some(h) = vm.lock().huge.take() else { return };
    let size = vm.spec.hugepages.unwrap_or_default();
    if h.boot == boot_id() {
        if let Err(e) = adjust_hugepages(size, h.node, -(h.pages as i64)) {
            warn!(vm = %vm.spec.name, "giving back {} hugepages: {e}", h.pages);
        }
    }
    save_if_made(vm);
}

/// Saves the VM's state if its directory exists (a VM being created
/// saves once its directory is made).
fn save_if_made(vm: &Vm) {
    if vm.dir.exists() {
        if let Err(e) = vm.save() {
            warn!(vm = %vm.spec.name, "{e}");
        }
    }
}

/// This boot of the host (`/proc/sys/kernel/random/boot_id`).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Checks a file of the description as the VMM will open it: without
/// following a symbolic link in any component of its path, its type and
/// hard links checked on the descriptor (vgpu_topology::safe_open). The
/// VMM checks again each time it starts, so a file swapped after the
/// create is refused then.
fn check_path(what: &str, p: &Path, kind: safe_open::Kind) -> Result<(), ControlError> {
    safe_open::inspect(what, p, kind).map(|_| ()).map_err(|e| bad(super::passthrough::chain(&e)))
}

fn check_file(what: &str, p: &Path) -> Result<(), ControlError> {
    if !p.is_absolute() {
        return Err(bad(format!("{what} {} must be an absolute path", p.display())));
    }
    check_path(what, p, safe_open::Kind::File)
}

fn check_disk(p: &Path) -> Result<(), ControlError> {
    if !p.is_absolute() {
        return Err(bad(format!("disk {} must be an absolute path", p.display())));
    }
    if p.as_os_str().as_encoded_bytes().contains(&b',') {
        return Err(bad(format!("disk {}: a path with a comma cannot be passed to vgpu-vmm --disk", p.display())));
    }
    check_path("disk", p, safe_open::Kind::FileOrBlockDevice)
}

/// Checks a description before anything is made for it.
pub fn validate(spec: &VmSpec) -> Result<(), ControlError> {
    crate::config::validate_name(&spec.name).map_err(|e| bad(e.replace("tenant name", "VM name")))?;
    if !(1..=64).contains(&spec.vcpus) {
        return Err(bad(format!("vcpus must be 1 to 64, not {}", spec.vcpus)));
    }
    let mem = spec.memory.0;
    if mem < 8 << 20 || !mem.is_multiple_of(1 << 20) || mem > 1 << 40 {
        return Err(bad(format!("memory must be a whole number of MiB from 8MiB to 1TiB, not {}", spec.memory)));
    }
    let page = spec.hugepages.unwrap_or_default().page_size();
    if !mem.is_multiple_of(page) {
        return Err(bad(format!("memory of {} is not a whole number of {} hugepages", spec.memory, spec.hugepages.unwrap_or_default().as_str())));
    }
    match (&spec.kernel, &spec.boot_disk) {
        (Some(k), None) => check_file("kernel", k)?,
        (None, Some(_)) => return Err(bad("vgpu-vmm boots a kernel directly (it has no firmware): give --kernel, and the root disk with --disk and root=/dev/vda in --cmdline")),
        (Some(_), Some(_)) => return Err(bad("give a kernel or a boot disk, not both")),
        (None, None) => return Err(bad("give a kernel (and optionally an initramfs and command line) or a boot disk")),
    }
    if let Some(i) = &spec.initramfs {
        check_file("initramfs", i)?;
    }
    if spec.cmdline.as_ref().is_some_and(|c| c.len() > 2048 || c.contains('\0')) {
        return Err(bad("cmdline must be at most 2048 bytes, without NUL"));
    }
    if spec.disks.len() > 16 {
        return Err(bad(format!("{} disks; the limit is 16", spec.disks.len())));
    }
    for d in &spec.disks {
        check_disk(&d.path)?;
        for r in [d.bandwidth, d.ops].into_iter().flatten() {
            r.check().map_err(|e| bad(format!("disk {}: {e}", d.path.display())))?;
        }
    }
    if spec.nets.len() > MAX_NETS {
        return Err(bad(format!("{} network interfaces; the limit is {MAX_NETS}", spec.nets.len())));
    }
    for n in &spec.nets {
        n.check_mac().map_err(bad)?;
        for r in [n.rx_bandwidth, n.rx_ops, n.tx_bandwidth, n.tx_ops].into_iter().flatten() {
            r.check().map_err(bad)?;
        }
        match n.attach().map_err(bad)? {
            NetAttach::Tap(t) => super::tap::check_name(t).map_err(|e| bad(format!("tap: {e}")))?,
            NetAttach::Bridge(b) => {
                super::tap::check_name(b).map_err(|e| bad(format!("bridge: {e}")))?;
                if !super::tap::is_bridge(Path::new("/sys"), b) {
                    return Err(bad(format!("there is no bridge named {b} on this host")));
                }
            }
        }
    }
    if spec.vgpu.as_ref().is_some_and(|g| g.memory.0 == 0) {
        return Err(bad("the vGPU's memory must be positive"));
    }
    if spec.passthrough.len() > MAX_PASSTHROUGH {
        return Err(bad(format!("{} passthrough devices; the limit is {MAX_PASSTHROUGH}", spec.passthrough.len())));
    }
    for p in &spec.passthrough {
        crate::config::validate_name(p).map_err(|e| bad(format!("passthrough pool: {}", e.replace("tenant name", "pool name"))))?;
    }
    Ok(())
}

impl Vms {
    pub fn new(cfg: VmsConfig) -> Vms {
        Vms { cfg, map: Mutex::new(BTreeMap::new()), changing: Mutex::new(()) }
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Vm>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, name: &str) -> Result<Arc<Vm>, ControlError> {
        self.map().get(name).cloned().ok_or_else(|| ControlError::NotFound(format!("no VM {name}")))
    }

    /// Whether `tenant` is a managed VM's vGPU.
    pub fn owns_tenant(&self, tenant: &str) -> bool {
        self.map().contains_key(tenant)
    }

    fn vms_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("vms")
    }

    fn make(&self, c: &Control, spec: VmSpec, desired: Desired, huge: Option<HugeReservation>) -> Arc<Vm> {
        let dir = self.vms_dir().join(&spec.name);
        let api_socket = c.run_dir.join("vms").join(format!("{}.sock", spec.name));
        Arc::new(Vm {
            spec,
            dir,
            api_socket,
            run: Mutex::new(Run { desired, state: VmState::Stopped, pid: 0, pidfd: None, restarts: 0, last_exit: None, error: None, starts: 0, kick: true, ended: false, huge }),
            cv: Condvar::new(),
            saving: Mutex::new(()),
        })
    }

    fn spawn_supervisor(&self, c: &Arc<Control>, vm: &Arc<Vm>) -> Result<(), ControlError> {
        let (c, vm2, cfg) = (c.clone(), vm.clone(), self.cfg.clone());
        std::thread::Builder::new()
            .name(format!("vm-{}", vm.spec.name))
            .spawn(move || supervise(&c, &vm2, &cfg))
            .map(|_| ())
            .map_err(|e| ControlError::Internal(format!("starting the VM's supervisor: {e}")))
    }

    /// Brings back the VMs saved in the state directory (at daemon start).
    pub fn load(&self, c: &Arc<Control>) {
        let Ok(entries) = std::fs::read_dir(self.vms_dir()) else { return };
        for e in entries.flatten() {
            let path = e.path().join("vm.json");
            let saved = match std::fs::read(&path).map_err(|e| e.to_string()).and_then(|b| serde_json::from_slice::<Saved>(&b).map_err(|e| e.to_string())) {
                Ok(s) => s,
                Err(err) => {
                    warn!(path = %path.display(), "not loading a saved VM: {err}");
                    continue;
                }
            };
            if e.file_name().to_str() != Some(saved.spec.name.as_str()) {
                warn!(path = %path.display(), "not loading a saved VM whose directory does not match its name");
                continue;
            }
            let vm = self.make(c, saved.spec, saved.desired, saved.hugepages_reserved);
            if saved.desired == Desired::Deleted {
                // A delete the daemon did not finish before it ended.
                match finish_delete(c, &vm) {
                    Ok(_) => info!(vm = %vm.spec.name, "finished deleting the VM"),
                    Err(e) => warn!(vm = %vm.spec.name, "finishing the VM's delete: {e}"),
                }
                continue;
            }
            self.map().insert(vm.spec.name.clone(), vm.clone());
            match self.spawn_supervisor(c, &vm) {
                Ok(()) => info!(vm = %vm.spec.name, desired = saved.desired.as_str(), "VM loaded from the state directory"),
                Err(e) => warn!(vm = %vm.spec.name, "{e}"),
            }
        }
    }

    pub fn list(&self, c: &Control) -> Vec<VmView> {
        let vms: Vec<Arc<Vm>> = self.map().values().cloned().collect();
        vms.iter().map(|vm| view(c, vm)).collect()
    }

    pub fn show(&self, c: &Control, name: &str) -> Result<VmView, ControlError> {
        let vm = self.get(name)?;
        Ok(view(c, &vm))
    }

    /// Creates a VM and its vGPU and starts it; on any failure nothing of it
    /// is left (no tenant, VMM, socket or state file).
    pub fn create(&self, c: &Arc<Control>, spec: VmSpec) -> Result<VmView, ControlError> {
        validate(&spec)?;
        let mut spec = spec;
        let _g = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        if self.map().contains_key(&spec.name) {
            return Err(ControlError::Conflict(format!("a VM named {} exists", spec.name)));
        }
        if self.map().len() >= MAX_VMS {
            return Err(ControlError::Conflict(format!("this daemon manages {MAX_VMS} VMs already")));
        }
        if c.tenant(&spec.name).is_some() {
            return Err(ControlError::Conflict(format!("a tenant named {} exists; a VM's vGPU takes the VM's name", spec.name)));
        }
        // Two VMs must not share a tap: the admin's own, or (however
        // unlikely) one the daemon names from a VM's name.
        let taps = tap_names(&spec);
        if let Some((other, tap)) = self.map().values().find_map(|v| tap_names(&v.spec).into_iter().find(|t| taps.contains(t)).map(|t| (v.spec.name.clone(), t))) {
            return Err(ControlError::Conflict(format!("VM {other} uses tap {tap} already")));
        }
        // Interfaces without a MAC get one now, random and unlike any other
        // VM's; it is saved with the description, so it stays the VM's.
        let taken: Vec<String> = self.map().values().flat_map(|v| v.spec.nets.iter().filter_map(|n| n.mac.clone())).collect();
        assign_macs(&mut spec, &taken);
        let rec = ensure_tenant(c, &spec, self.cfg.jail)?;
        let vm = self.make(c, spec, Desired::Running, None);
        let undo = |vm: &Arc<Vm>| {
            release_hugepages(vm);
            remove_taps(&vm.spec);
            release_devices(c, vm);
            let _ = c.delete_tenant(&vm.spec.name);
            let _ = std::fs::remove_dir_all(&vm.dir);
            let _ = std::fs::remove_file(&vm.api_socket);
        };
        if let Err(e) = lend_devices(c, &vm.spec, rec.as_ref().map(|t| t.numa_node)) {
            undo(&vm);
            return Err(e);
        }
        let node = vm_node(c, &vm.spec.name, rec.as_ref());
        if let Err(e) = reserve_hugepages(&vm, node) {
            undo(&vm);
            return Err(e);
        }
        let made = std::fs::create_dir_all(&vm.dir).and_then(|()| std::fs::create_dir_all(vm.api_socket.parent().unwrap_or(Path::new("/"))));
        if let Err(e) = made.map_err(|e| ControlError::Internal(format!("making {}: {e}", vm.dir.display()))).and_then(|()| vm.save()) {
            undo(&vm);
            return Err(e);
        }
        self.map().insert(vm.spec.name.clone(), vm.clone());
        if let Err(e) = self.spawn_supervisor(c, &vm) {
            self.map().remove(&vm.spec.name);
            undo(&vm);
            return Err(e);
        }
        // The first start decides: a VMM that cannot start leaves nothing.
        vm.wait_for(READY_WAIT + Duration::from_secs(5), |r| r.starts > 0 && r.state != VmState::Starting);
        let failed = {
            let r = vm.lock();
            (r.state != VmState::Running).then(|| r.error.clone().unwrap_or_else(|| format!("the VM did not start ({})", r.last_exit.clone().unwrap_or_default())))
        };
        if let Some(err) = failed {
            self.end(&vm);
            self.map().remove(&vm.spec.name);
            undo(&vm);
            return Err(bad(err));
        }
        info!(vm = %vm.spec.name, device = rec.as_ref().map_or("", |t| t.device.as_str()), passthrough = ?c.passthrough.get().map(|p| p.lent_to(&vm.spec.name).iter().map(|d| d.name.clone()).collect::<Vec<_>>()), numa_node = node, "VM created");
        Ok(view(c, &vm))
    }

    /// Stops the supervisor and its VMM and waits for both.
    fn end(&self, vm: &Vm) {
        vm.lock().desired = Desired::Deleted;
        vm.cv.notify_all();
        vm.terminate(Duration::from_secs(5));
        vm.wait_for(Duration::from_secs(30), |r| r.ended);
    }

    /// Stops the VM: the guest is asked to shut down, and the VMM killed if
    /// it has not ended within `timeout`. It stays stopped (across daemon
    /// restarts too) until started.
    pub fn stop(&self, c: &Control, name: &str, timeout: Option<Duration>) -> Result<VmView, ControlError> {
        let vm = self.get(name)?;
        {
            let mut r = vm.lock();
            if r.desired == Desired::Deleted {
                return Err(being_deleted(name));
            }
            r.desired = Desired::Stopped;
        }
        vm.cv.notify_all();
        vm.save()?;
        stop_vmm(&vm, timeout.unwrap_or(self.cfg.stop_timeout));
        Ok(view(c, &vm))
    }

    pub fn start(&self, c: &Control, name: &str) -> Result<VmView, ControlError> {
        let vm = self.get(name)?;
        let before = {
            let mut r = vm.lock();
            if r.desired == Desired::Deleted {
                return Err(being_deleted(name));
            }
            if r.desired == Desired::Running && r.pid != 0 {
                // Running already (view takes the lock again).
                drop(r);
                return Ok(view(c, &vm));
            }
            r.desired = Desired::Running;
            r.kick = true;
            r.starts
        };
        vm.save()?;
        vm.cv.notify_all();
        vm.wait_for(READY_WAIT + Duration::from_secs(5), |r| r.starts > before && r.state != VmState::Starting);
        let v = view(c, &vm);
        if v.state != VmState::Running {
            return Err(ControlError::Internal(format!("VM {name} did not start: {}", v.error.clone().or(v.last_exit.clone()).unwrap_or_default())));
        }
        Ok(v)
    }

    /// A hard reset: the VMM is killed and started again.
    pub fn reboot(&self, c: &Control, name: &str) -> Result<VmView, ControlError> {
        let vm = self.get(name)?;
        match vm.lock().desired {
            Desired::Running => {}
            Desired::Deleted => return Err(being_deleted(name)),
            Desired::Stopped => return Err(ControlError::Conflict(format!("VM {name} is stopped; start it"))),
        }
        self.stop(c, name, Some(Duration::ZERO))?;
        self.start(c, name)
    }

    /// Deletes the VM: its VMM ends, its vGPU tenant is deleted (its memory
    /// scrubbed by the worker), and its state, logs and socket go.
    /// Returns whether the vGPU's memory was released already.
    pub fn delete(&self, c: &Control, name: &str) -> Result<bool, ControlError> {
        let _g = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let vm = self.get(name)?;
        vm.lock().desired = Desired::Deleted;
        // A daemon that dies from here on finishes the delete when it
        // starts again (load).
        let _ = vm.save();
        self.end(&vm);
        self.map().remove(name);
        let released = finish_delete(c, &vm)?;
        info!(vm = name, "VM deleted");
        Ok(released)
    }

    pub fn console(&self, name: &str, bytes: u64) -> Result<Vec<u8>, ControlError> {
        let vm = self.get(name)?;
        tail(&vm.console_log(), bytes.min(2 * LOG_CAP)).map_err(|e| ControlError::Internal(format!("reading the console log: {e}")))
    }

    pub fn logs(&self, name: &str, bytes: u64) -> Result<Vec<u8>, ControlError> {
        let vm = self.get(name)?;
        tail(&vm.dir.join("vmm.log"), bytes.min(2 * LOG_CAP)).map_err(|e| ControlError::Internal(format!("reading the VMM log: {e}")))
    }

    /// Daemon shutdown: VMMs end with it (their vGPUs do).
    pub fn shutdown(&self) {
        for vm in self.map().values() {
            vm.signal(libc::SIGKILL);
        }
    }
}

/// What a delete does once the VM's VMM has ended: its taps and hugepages
/// go back, its vGPU tenant is deleted (the worker scrubs its memory), and
/// its state directory and API socket are removed. Returns whether the
/// vGPU's memory was released already. The state directory stays (with
/// `deleted` in it) if the tenant cannot be deleted, so a restarted daemon
/// tries again.
fn finish_delete(c: &Control, vm: &Vm) -> Result<bool, ControlError> {
    remove_taps(&vm.spec);
    release_hugepages(vm);
    release_devices(c, vm);
    let released = match c.delete_tenant(&vm.spec.name) {
        Ok(done) => done,
        Err(ControlError::NotFound(_)) => true,
        Err(e) => return Err(e),
    };
    let _ = std::fs::remove_dir_all(&vm.dir);
    let _ = std::fs::remove_file(&vm.api_socket);
    Ok(released)
}

fn view(c: &Control, vm: &Vm) -> VmView {
    let t: Option<TenantRecord> = c.tenant(&vm.spec.name);
    let passthrough = leases(c, &vm.spec.name);
    let numa_node = vm_node(c, &vm.spec.name, t.as_ref());
    let r = vm.lock();
    VmView {
        name: vm.spec.name.clone(),
        state: r.state,
        desired: r.desired.as_str().into(),
        spec: vm.spec.clone(),
        device: t.as_ref().map(|t| t.device.clone()).unwrap_or_default(),
        pool: t.as_ref().map(|t| t.pool.clone()).unwrap_or_default(),
        numa_node,
        passthrough,
        pid: r.pid,
        restarts: r.restarts,
        last_exit: r.last_exit.clone(),
        error: r.error.clone(),
        api_socket: vm.api_socket.clone(),
        console_log: vm.console_log(),
    }
}

/// The VM's vGPU tenant: the existing one, or made now (at creation, or
/// after a daemon restart, which forgets tenants).
fn ensure_tenant(c: &Control, spec: &VmSpec, jail: Option<crate::config::Owner>) -> Result<Option<TenantRecord>, ControlError> {
    let Some(vgpu) = &spec.vgpu else { return Ok(None) };
    if let Some(t) = c.tenant(&spec.name) {
        if t.kind == "vm" {
            return Ok(Some(t));
        }
        return Err(ControlError::Conflict(format!("tenant {} exists and is not a VM's", spec.name)));
    }
    let mut t = serde_json::json!({ "name": spec.name, "memory": vgpu.memory, "weight": vgpu.weight, "kind": "vm" });
    if let Some(cap) = vgpu.cap {
        t["cap"] = cap.into();
    }
    if let Some(p) = &vgpu.pool {
        t["pool"] = p.clone().into();
    }
    if let Some(j) = jail {
        // A jailed VMM connects to the vGPU's socket as the jail's uid.
        t["owner"] = j.to_string().into();
    }
    let ts: crate::config::TenantSpec = serde_json::from_value(t).map_err(|e| bad(format!("the VM's vGPU: {e}")))?;
    c.create_tenant(&ts).map(Some)
}

/// The VM's NUMA node: its vGPU's device's, else its first passthrough
/// device's (-1: unknown).
fn vm_node(c: &Control, vm: &str, t: Option<&TenantRecord>) -> i32 {
    match t {
        Some(t) => t.numa_node,
        None => c.passthrough.get().and_then(|p| p.lent_to(vm).first().map(|d| d.numa_node)).unwrap_or(-1),
    }
}

/// Lends the VM one device from each of its passthrough pools, preferring
/// its vGPU's NUMA node. On failure what was lent goes back.
fn lend_devices(c: &Control, spec: &VmSpec, numa: Option<i32>) -> Result<(), ControlError> {
    if spec.passthrough.is_empty() {
        return Ok(());
    }
    let Some(pass) = c.passthrough.get() else {
        return Err(bad("this daemon has no passthrough devices (devices.passthrough in its config)"));
    };
    let mut numa = numa;
    for name in &spec.passthrough {
        let res = (|| {
            let pool = c.pool(name).ok_or_else(|| ControlError::NotFound(format!("no pool named {name}")))?;
            if !pool.admits(&spec.name) {
                return Err(ControlError::Forbidden(format!("pool {name} is private and VM {} is not on its allow-list", spec.name)));
            }
            let d = pass.lend_from(name, &pool.devices, &spec.name, numa).map_err(pass_error)?;
            Ok(d.numa_node)
        })();
        match res {
            Ok(n) => numa = numa.or(Some(n)),
            Err(e) => {
                return_devices(c, &spec.name);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// A passthrough error as the API answers it.
pub fn pass_error(e: super::passthrough::PassError) -> ControlError {
    use super::passthrough::PassError as P;
    let text = super::passthrough::chain(&e);
    match e {
        P::Unknown(_) => ControlError::NotFound(text),
        P::NoneFree { internal: true, .. } => ControlError::Internal(text),
        P::Busy { .. } | P::NoneFree { .. } => ControlError::Conflict(text),
        P::Missing { .. } | P::NoIommu { .. } | P::SharedGroup { .. } | P::NoVfioDriver => ControlError::BadRequest(text),
        P::Sysfs { .. } | P::WrongDriver { .. } | P::Save { .. } | P::Stuck { .. } => ControlError::Internal(text),
    }
}

/// Returns (resets, rebinds, scrubs) every device lent to `vm`, each on a
/// thread of its own (a GPU's scrub takes a while): the devices show
/// `returning` until their scrub ends. Only once `vm`'s VMM has ended:
/// call it with the VM's pid at 0.
fn return_devices(c: &Control, vm: &str) {
    if let Some(pass) = c.passthrough.get() {
        for d in pass.lent_to(vm) {
            pass.give_back_later(d, vm.to_string());
        }
    }
}

/// Returns the VM's devices if its VMM has ended; quarantines them if it
/// has not (the guest may still drive them).
fn release_devices(c: &Control, vm: &Vm) {
    let pid = vm.lock().pid;
    if pid == 0 {
        return_devices(c, &vm.spec.name);
    } else if let Some(pass) = c.passthrough.get() {
        pass.quarantine_lent(&vm.spec.name, &format!("VM {}'s VMM (pid {pid}) did not end when it was deleted", vm.spec.name));
    }
}

/// The devices lent to `vm`, as its view lists them.
fn leases(c: &Control, vm: &str) -> Vec<vgpu_api::vm::Lease> {
    c.passthrough.get().map(|p| p.lent_to(vm).iter().map(|d| vgpu_api::vm::Lease { device: d.name.clone(), address: d.address.to_string(), numa_node: d.numa_node }).collect()).unwrap_or_default()
}

/// Asks the guest to shut down, then kills the VMM after `timeout`.
fn stop_vmm(vm: &Vm, timeout: Duration) {
    if vm.lock().pid == 0 {
        return;
    }
    if !timeout.is_zero() {
        let _ = vgpu_api::http::request(&vm.api_socket, "PUT", "/vm/shutdown", None);
        if vm.wait_for(timeout, |r| r.pid == 0) {
            return;
        }
    }
    vm.terminate(Duration::from_secs(5));
    vm.wait_for(Duration::from_secs(10), |r| r.pid == 0);
}

/// The tap each interface attaches to, in order: the admin's own for
/// `tap=`, the one the daemon makes for `bridge=`.
fn tap_names(spec: &VmSpec) -> Vec<String> {
    spec.nets
        .iter()
        .enumerate()
        .map(|(i, n)| match (&n.tap, &n.bridge) {
            (Some(t), _) => t.clone(),
            _ => super::tap::bridged_tap_name(&spec.name, i),
        })
        .collect()
}

/// Makes (or finds) the taps of the VM's `bridge=` interfaces, in their
/// bridges and up.
fn make_taps(spec: &VmSpec, jail: Option<crate::config::Owner>) -> Result<(), ControlError> {
    // The VMM opens them as root before any jail; the owner keeps other
    // users off them.
    let owner = jail.map_or(0, |j| j.uid);
    for (n, tap) in spec.nets.iter().zip(tap_names(spec)) {
        if let Ok(NetAttach::Bridge(b)) = n.attach() {
            super::tap::make_bridged(Path::new("/sys"), &tap, b, owner).map_err(|e| ControlError::Internal(format!("tap {tap} for bridge {b}: {e}")))?;
        }
    }
    Ok(())
}

/// Removes the taps the daemon made for the VM.
fn remove_taps(spec: &VmSpec) {
    for (n, tap) in spec.nets.iter().zip(tap_names(spec)) {
        if matches!(n.attach(), Ok(NetAttach::Bridge(_))) {
            if let Err(e) = super::tap::remove(Path::new("/sys"), &tap) {
                warn!(vm = %spec.name, "removing tap {tap}: {e}");
            }
        }
    }
}

/// What the VMM runs: the VM's description as `vgpu-vmm --config` takes it
/// (one type, `vgpu_api::vmm::VmConfig`, for the file, the VMM's API and
/// its flags).
fn vmm_config(s: &VmSpec, api_socket: &Path, t: Option<&TenantRecord>, node: i32, vfio: &[String]) -> Result<vgpu_api::vmm::VmConfig, String> {
    use vgpu_api::vmm::{MemMiB, NetConfig, VgpuConfig, VmConfig};
    let mut c = VmConfig::new(s.kernel.clone().ok_or("the VM has no kernel to boot")?);
    c.initramfs = s.initramfs.clone();
    c.cmdline = s.cmdline.clone().unwrap_or_default();
    c.vcpus = s.vcpus;
    c.memory_mib = MemMiB(s.memory.0 >> 20);
    c.hugepages = s.hugepages.unwrap_or_default();
    c.numa_node = u32::try_from(node).ok();
    c.api_socket = Some(api_socket.to_path_buf());
    c.vgpu = t.map(|t| VgpuConfig { socket: t.socket.clone(), headless: false, reconnect_s: vgpu_api::vmm::VGPU_RECONNECT_DEFAULT_S });
    // The guest sees the disks as vda, vdb, ... in this order.
    c.disks = s.disks.clone();
    c.nets = s
        .nets
        .iter()
        .zip(tap_names(s))
        .map(|(n, tap)| {
            let mac = n.mac.as_deref().map(str::parse).transpose()?;
            Ok(NetConfig { tap, mac, rx_bandwidth: n.rx_bandwidth, rx_ops: n.rx_ops, tx_bandwidth: n.tx_bandwidth, tx_ops: n.tx_ops })
        })
        .collect::<Result<_, String>>()?;
    c.vfio = vfio.iter().map(|a| a.parse().map_err(|e| format!("passthrough device {a}: {e}"))).collect::<Result<_, String>>()?;
    Ok(c)
}

fn spawn_vmm(cfg: &VmsConfig, vm: &Vm, t: Option<&TenantRecord>, node: i32, vfio: &[String]) -> std::io::Result<Child> {
    let s = &vm.spec;
    let _ = std::fs::remove_file(&vm.api_socket);
    let config = vmm_config(s, &vm.api_socket, t, node, vfio).map_err(std::io::Error::other)?;
    let path = vm.dir.join("vmm.json");
    let json = serde_json::to_vec_pretty(&config).map_err(std::io::Error::other)?;
    super::store::write_atomically(&path, &json)?;
    let mut cmd = Command::new(&cfg.vmm);
    cmd.arg("--config").arg(&path);
    if let Some(j) = cfg.jail {
        // The jail's root is a tmpfs mounted over this empty directory in
        // the VMM's own mount namespace.
        let dir = vm.dir.join("jail");
        std::fs::create_dir_all(&dir)?;
        cmd.arg("--jail").arg(dir).arg("--jail-uid").arg(j.uid.to_string()).arg("--jail-gid").arg(j.gid.to_string());
        if let Some((memory, pids)) = jail_limits(s, Path::new(CGROUP_ROOT)) {
            cmd.arg("--jail-memory").arg(memory.to_string()).arg("--jail-pids").arg(pids.to_string());
        }
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: the closure only calls prctl, which is async-signal-safe,
    // between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            // The VMM ends with the thread that started it (its
            // supervisor, which lives as long as the VM) and the daemon.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    cmd.spawn()
}

/// Whether a starting VMM's API answers. A jailed VMM's socket is bound,
/// and accepts connections, before its VM is built (the listener is handed
/// into the jail), so a connection proves nothing: one request, sent once,
/// answered does. A VMM that dies before it answers closes the connection.
#[derive(Default)]
struct ApiProbe {
    conn: Option<std::os::unix::net::UnixStream>,
}

impl ApiProbe {
    fn answered(&mut self, socket: &Path) -> bool {
        if self.conn.is_none() {
            let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) else { return false };
            if s.set_read_timeout(Some(Duration::from_millis(20))).is_err() || s.write_all(b"GET /vm HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").is_err() {
                return false;
            }
            self.conn = Some(s);
        }
        let mut b = [0u8; 1];
        match self.conn.as_mut().map(|c| c.read(&mut b)) {
            Some(Ok(n)) if n > 0 => true,
            Some(Err(e)) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted) => false,
            // Closed unanswered: connect again next time.
            _ => {
                self.conn = None;
                false
            }
        }
    }
}

fn pidfd_of(pid: u32) -> Option<Arc<OwnedFd>> {
    // SAFETY: pidfd_open with a pid and no flags returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a non-negative result is a new fd that nothing else owns.
    (fd >= 0).then(|| Arc::new(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

/// The VM's supervisor: starts its VMM whenever it should run, and applies
/// the restart policy when it ends on its own.
fn supervise(c: &Arc<Control>, vm: &Arc<Vm>, cfg: &VmsConfig) {
    let mut backoff = Duration::from_secs(1);
    let name = vm.spec.name.clone();
    loop {
        {
            let mut r = vm.lock();
            loop {
                match r.desired {
                    Desired::Deleted => {
                        r.state = VmState::Stopped;
                        r.ended = true;
                        vm.cv.notify_all();
                        return;
                    }
                    Desired::Stopped => {
                        r.state = VmState::Stopped;
                        vm.cv.notify_all();
                        r = vm.cv.wait(r).unwrap_or_else(|e| e.into_inner());
                    }
                    Desired::Running => break,
                }
            }
            if r.kick {
                r.kick = false;
                backoff = Duration::from_secs(1);
            }
            r.state = VmState::Starting;
            r.error = None;
            vm.cv.notify_all();
        }
        let started = ensure_tenant(c, &vm.spec, cfg.jail).and_then(|t| {
            let node = vm_node(c, &name, t.as_ref());
            reserve_hugepages(vm, node)?;
            make_taps(&vm.spec, cfg.jail)?;
            if let Some(p) = c.passthrough.get() {
                p.rebind_lent(&name).map_err(|e| ControlError::Internal(super::passthrough::chain(&e)))?;
            }
            let vfio: Vec<String> = leases(c, &name).into_iter().map(|l| l.address).collect();
            if vfio.len() != vm.spec.passthrough.len() {
                return Err(ControlError::Conflict(format!("the VM has {} of its {} passthrough devices (one was returned); delete it and create it again", vfio.len(), vm.spec.passthrough.len())));
            }
            spawn_vmm(cfg, vm, t.as_ref(), node, &vfio).map_err(|e| ControlError::Internal(format!("starting {}: {e}", cfg.vmm.display())))
        });
        let mut child = match started {
            Ok(child) => child,
            Err(e) => {
                warn!(vm = %name, "VM could not start: {e}");
                let mut r = vm.lock();
                r.state = VmState::Failed;
                r.error = Some(e.to_string());
                r.starts += 1;
                vm.cv.notify_all();
                let _ = vm.cv.wait_timeout_while(r, backoff, |r| r.desired == Desired::Running && !r.kick);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        if let Some(out) = child.stdout.take() {
            pump(out, vm.console_log(), format!("console-{name}"));
        }
        let vmm_log = child.stderr.take().and_then(|err| pump(err, vm.dir.join("vmm.log"), format!("vmmlog-{name}")));
        {
            let mut r = vm.lock();
            r.pid = child.id();
            r.pidfd = pidfd_of(child.id());
            if r.desired != Desired::Running {
                // A stop or delete came while this VMM was being started,
                // before it could be signalled: it ends now.
                let _ = child.kill();
            }
        }
        let ran_from = Instant::now();
        // Running once its API answers (or it has lived READY_WAIT).
        let deadline = Instant::now() + READY_WAIT;
        let mut probe = ApiProbe::default();
        let early = loop {
            if let Ok(Some(s)) = child.try_wait() {
                break Some(s);
            }
            if vm.lock().desired != Desired::Running {
                let _ = child.kill();
                break None;
            }
            if probe.answered(&vm.api_socket) || Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let status = match early {
            Some(s) => Ok(s),
            None => {
                {
                    let mut r = vm.lock();
                    r.state = VmState::Running;
                    r.starts += 1;
                    vm.cv.notify_all();
                }
                info!(vm = %name, pid = child.id(), "VM running");
                child.wait()
            }
        };
        let clean = matches!(&status, Ok(s) if s.success());
        let exit = describe(status);
        if ran_from.elapsed() >= MAX_BACKOFF {
            // It ran a good while: the next restart comes soon again.
            backoff = Duration::from_secs(1);
        }
        if early.is_some() {
            // A failed start: its last words (why) are in its log once the
            // pipe is drained, which the error below quotes.
            let drained = Instant::now() + Duration::from_secs(2);
            while vmm_log.as_ref().is_some_and(|h| !h.is_finished()) && Instant::now() < drained {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let mut r = vm.lock();
        r.pid = 0;
        r.pidfd = None;
        r.last_exit = Some(exit.clone());
        if early.is_some() {
            // It ended before it was up: a failed start.
            let log = tail(&vm.dir.join("vmm.log"), 2048).unwrap_or_default();
            r.error = Some(format!("vgpu-vmm ended as it started ({exit}): {}", String::from_utf8_lossy(&log).trim()));
            r.state = VmState::Failed;
            r.starts += 1;
        }
        let asked = r.desired != Desired::Running;
        let again = !asked
            && match vm.spec.restart {
                RestartPolicy::Always => true,
                RestartPolicy::OnFailure => !clean,
                RestartPolicy::Never => false,
            };
        if asked {
            info!(vm = %name, "VM stopped ({exit})");
            continue;
        }
        if !again {
            info!(vm = %name, "VM ended ({exit}); its restart policy leaves it stopped");
            r.desired = Desired::Stopped;
            drop(r);
            if let Err(e) = vm.save() {
                warn!(vm = %name, "{e}");
            }
            continue;
        }
        warn!(vm = %name, "VM ended on its own ({exit}); restarting in {backoff:?}");
        r.restarts += 1;
        if r.state != VmState::Failed {
            r.state = VmState::Restarting;
        }
        vm.cv.notify_all();
        let _ = vm.cv.wait_timeout_while(r, backoff, |r| r.desired == Desired::Running && !r.kick);
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vmm_gets_the_vm_as_its_own_config_type() {
        let spec: VmSpec = serde_json::from_str(
            r#"{"name":"a","memory":"512MiB","vcpus":2,"kernel":"/k","cmdline":"console=ttyS0","hugepages":"2M",
                "disks":[{"path":"/d","read_only":true,"bandwidth":{"size":"10MiB","refill_ms":1000}}],
                "nets":[{"tap":"t0","mac":"52:54:00:aa:bb:cc","rx_ops":{"size":100,"refill_ms":10}},{"bridge":"br0"}]}"#,
        )
        .unwrap();
        let c = vmm_config(&spec, Path::new("/run/a.sock"), None, 1, &["0000:01:00.0".into()]).unwrap();
        // What the VMM reads back is what was meant, in its own terms.
        let back: vgpu_api::vmm::VmConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert_eq!((c.vcpus, c.memory_mib.0, c.hugepages, c.numa_node, c.cmdline.as_str()), (2, 512, Hugepages::TwoMiB, Some(1), "console=ttyS0"));
        assert_eq!(c.disks, spec.disks, "the disks are the same type");
        assert_eq!((c.nets[0].tap.as_str(), c.nets[0].mac.map(|m| m.to_string()), c.nets[0].rx_ops.map(|b| b.size.0)), ("t0", Some("52:54:00:aa:bb:cc".into()), Some(100)));
        assert_eq!(c.nets[1].tap, tap_names(&spec)[1], "a bridge= interface gets the tap the daemon makes");
        assert_eq!((c.vgpu, c.vfio.len(), c.api_socket.as_deref()), (None, 1, Some(Path::new("/run/a.sock"))));
        assert!(vmm_config(&spec, Path::new("/s"), None, -1, &[]).unwrap().numa_node.is_none(), "no node when it is unknown");
        let e = vmm_config(&spec, Path::new("/s"), None, -1, &["nonsense".into()]).unwrap_err();
        assert!(e.contains("passthrough device nonsense"), "{e}");
    }

    #[test]
    fn jailed_vmms_get_cgroup_limits_only_where_cgroup_v2_offers_them() {
        let root = std::env::temp_dir().join(format!("vgpu-cg-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let mut spec: VmSpec = serde_json::from_str(r#"{"name":"a","memory":"512MiB","vcpus":2,"kernel":"/k","disks":[{"path":"/d"}]}"#).unwrap();
        // No cgroup.controllers: a cgroup v1 layout.
        assert_eq!(jail_limits(&spec, &root), None);
        std::fs::write(root.join("cgroup.controllers"), "cpuset cpu io memory\n").unwrap();
        assert_eq!(jail_limits(&spec, &root), None, "no pids controller");
        std::fs::write(root.join("cgroup.controllers"), "cpuset cpu io memory hugetlb pids\n").unwrap();
        assert_eq!(jail_limits(&spec, &root), Some(((512 << 20) + VMM_MEMORY_OVERHEAD, 2 + 1 + 32)));
        spec.hugepages = Some(Hugepages::TwoMiB);
        assert_eq!(jail_limits(&spec, &root), Some((VMM_MEMORY_OVERHEAD, 35)), "hugepages are not the memory controller's");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
