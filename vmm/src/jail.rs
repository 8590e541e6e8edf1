//! `--jail DIR`: confines the VMM as Firecracker's jailer does, but in
//! process (no exec): optional cgroup v2 limits, then new PID, mount and
//! network namespaces, a root of its own, and an unprivileged uid and gid
//! with no groups, no capabilities and `no_new_privs`.
//!
//! The process forks after `unshare(CLONE_NEWPID)`: the child is PID 1 of
//! the new namespace and becomes the VMM; the parent stays outside as a
//! supervisor that only waits, forwards SIGTERM/SIGINT/SIGHUP as SIGKILL,
//! cleans up (API socket, cgroup) and exits as the child did.
//!
//! The child's root is a fresh tmpfs mounted on DIR inside its private
//! mount namespace (the host's DIR stays empty), made read-only once it
//! holds exactly what the VMM opens, each at its host path (every one
//! opened `O_PATH` without following a symbolic link in any component and
//! checked on that descriptor before the fork, then opened so again in the
//! jail's mount namespace, compared (device and inode) with what was
//! checked, and bound from that descriptor through /proc/self/fd, so what
//! is bound is what was checked):
//! - `/dev/kvm`, a new node owned by the jail's uid, mode 0600;
//! - the kernel and initramfs, bind-mounted read-only;
//! - the serial output file, bind-mounted writable (created for the jail's
//!   uid when missing);
//! - the vGPU's vhost-user socket, bind-mounted (its owner must let the
//!   jail's uid connect: `vgpuctl tenant create --vm --owner UID:GID`);
//! - with `--hugepages`, /sys/kernel/mm/hugepages, and with `--numa-node`,
//!   the NUMA topology under `$VGPU_SYSFS_ROOT`, both read-only.
//!
//! The API socket is bound before the jail and handed over as a listening
//! descriptor, so no host directory needs to be writable from inside.
//!
//! The taps of `--net` are opened before the jail too, in the host's
//! network namespace (the jail's own holds no interface), and handed over
//! as open descriptors: `/dev/net/tun` is not exposed, and the jailed VMM
//! reads and writes frames without CAP_NET_ADMIN. They are opened while
//! still root, so a missing tap is created then (not persistent: it goes
//! away with the VMM); an existing tap is simply attached to.
//!
//! - with `--vfio`, each device's own sysfs directory and its IOMMU group's
//!   (read-only), and /dev/vfio/vfio and /dev/vfio/GROUP as nodes of the
//!   jail's uid; RLIMIT_MEMLOCK is raised to guest RAM and 64 MiB, since
//!   VFIO pins guest RAM and the jailed VMM has no CAP_IPC_LOCK.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

use crate::config::{Hugepages, SerialOut, VmConfig};
use crate::safe_open::Kind;

/// Where a cgroup v2 hierarchy must be mounted for `--jail-memory` and
/// `--jail-pids`.
pub use vgpu_topology::cgroup::CGROUP_ROOT;
use vgpu_topology::cgroup::{Cgroup, CgroupError, Limits};
/// RLIMIT_MEMLOCK of a jailed VMM with passthrough devices beyond its
/// guest RAM.
const MEMLOCK_MARGIN: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("jail: {what}: {err}")]
    Sys {
        what: String,
        #[source]
        err: io::Error,
    },
    #[error("jail: --jail-uid and --jail-gid must not be 0: the jailed VMM runs unprivileged")]
    RootIds,
    #[error("jail: {0}")]
    Invalid(String),
    #[error("jail: cgroup limits (--jail-memory, --jail-pids) need a writable cgroup v2 hierarchy at {CGROUP_ROOT}; no limit was applied and the VMM did not start")]
    Cgroup(#[source] CgroupError),
    #[error("jail: capabilities remain after dropping privileges (effective {0:#x}, permitted {1:#x})")]
    CapsLeft(u64, u64),
    /// A file the jail exposes: missing, of the wrong type, a symbolic
    /// link or behind one (vgpu_topology::safe_open).
    #[error(transparent)]
    File(#[from] crate::safe_open::SafeOpenError),
}

fn sys(what: impl Into<String>) -> impl FnOnce(io::Error) -> JailError {
    let what = what.into();
    move |err| JailError::Sys { what, err }
}

fn check(rc: libc::c_int, what: impl Into<String>) -> Result<(), JailError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(JailError::Sys { what: what.into(), err: io::Error::last_os_error() })
    }
}

fn cstr(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| JailError::Invalid(format!("path {} contains a NUL byte", p.display())))
}

/// `--jail DIR --jail-uid UID --jail-gid GID [--jail-memory B] [--jail-pids N]`.
#[derive(Debug, Clone)]
pub struct JailConfig {
    pub root: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// cgroup v2 `memory.max`, bytes.
    pub memory_max: Option<u64>,
    /// cgroup v2 `pids.max`.
    pub pids_max: Option<u64>,
}

/// Rewrites the VM description's host paths as absolute paths: the jail
/// shows each file at that path, and the VMM's working directory inside is
/// `/`. A path that is, or passes through, a symbolic link is refused (it
/// is never resolved to its target: the jail must not expose a file its
/// path does not name).
pub fn absolute_paths(cfg: &mut VmConfig) -> Result<(), JailError> {
    use crate::safe_open::{inspect, Kind};
    let fix = |p: &Path, what: &str, kind: Kind| -> Result<PathBuf, JailError> {
        inspect(what, p, kind)?;
        absolute(p)
    };
    cfg.kernel = fix(&cfg.kernel, "kernel", Kind::File)?;
    if let Some(i) = &cfg.initramfs {
        cfg.initramfs = Some(fix(i, "initramfs", Kind::File)?);
    }
    if let Some(v) = &mut cfg.vgpu {
        v.socket = fix(&v.socket, "vGPU socket", Kind::Socket)?;
    }
    for d in &mut cfg.disks {
        d.path = fix(&d.path, "disk", Kind::FileOrBlockDevice)?;
    }
    if let SerialOut::File(p) = &cfg.serial {
        let name = p.file_name().ok_or_else(|| JailError::Invalid(format!("serial output {} names no file", p.display())))?;
        let parent = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        cfg.serial = SerialOut::File(fix(parent, "serial output directory", Kind::Directory)?.join(name));
    }
    Ok(())
}

/// `p` made absolute against the working directory (a physical path, as
/// getcwd gives it), `.` and `..` taken out. Only for paths already
/// checked to hold no symbolic link, where the lexical parent is the real
/// one.
fn absolute(p: &Path) -> Result<PathBuf, JailError> {
    let mut out = if p.is_absolute() { PathBuf::from("/") } else { std::env::current_dir().map_err(sys("the working directory"))? };
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// A file or directory bound into the jail at its host path.
#[derive(Debug)]
struct Bind {
    path: PathBuf,
    what: String,
    kind: Kind,
    /// The file that was checked (type, access): the one bound must be it.
    dev: u64,
    ino: u64,
    is_dir: bool,
    writable: bool,
}

/// What the jail holds besides `/dev/kvm`.
#[derive(Debug, Default)]
struct Exposed {
    binds: Vec<Bind>,
    /// Character devices made in the jail for its uid: (path, rdev).
    nodes: Vec<(PathBuf, u64)>,
    /// Symbolic links made in the jail: (link, target).
    links: Vec<(PathBuf, PathBuf)>,
    /// Passthrough devices: guest RAM is pinned for DMA, so the jailed
    /// VMM's RLIMIT_MEMLOCK is raised to this (it has no CAP_IPC_LOCK).
    memlock: Option<u64>,
}

/// Whether `uid`/`gid` (no supplementary groups) may access a file with
/// this metadata for `want` (4 read, 2 write).
fn allowed(m: &std::fs::Metadata, uid: u32, gid: u32, want: u32) -> bool {
    let mode = m.mode();
    let bits = if m.uid() == uid {
        mode >> 6
    } else if m.gid() == gid {
        mode >> 3
    } else {
        mode
    };
    bits & want == want
}

fn need_access(m: &std::fs::Metadata, p: &Path, what: &str, j: &JailConfig, want: u32) -> Result<(), JailError> {
    if !allowed(m, j.uid, j.gid, want) {
        let how = if want == 4 { "readable" } else { "writable" };
        return Err(JailError::Invalid(format!("{what} {} is not {how} by the jail's uid {} / gid {} (owner {}:{}, mode {:o})", p.display(), j.uid, j.gid, m.uid(), m.gid(), m.mode() & 0o7777)));
    }
    Ok(())
}

impl Exposed {
    /// Checks on the host that the jail's uid can use every file the VM
    /// description names, and creates the serial file for it if missing.
    fn for_config(cfg: &VmConfig, j: &JailConfig) -> Result<Exposed, JailError> {
        let mut e = Exposed::default();
        for a in &cfg.vfio {
            e.expose_vfio(a)?;
        }
        if !cfg.vfio.is_empty() {
            // Guest RAM, which VFIO pins once, and a margin; not more.
            e.memlock = Some(cfg.memory_bytes().saturating_add(MEMLOCK_MARGIN));
        }
        e.expose(&cfg.kernel, "kernel", Kind::File, Some((j, 4)))?;
        if let Some(i) = &cfg.initramfs {
            e.expose(i, "initramfs", Kind::File, Some((j, 4)))?;
        }
        if let SerialOut::File(p) = &cfg.serial {
            // Made for the jail's uid when missing; never through a
            // symbolic link (O_EXCL does not follow one: it fails, and the
            // check below names it).
            match crate::safe_open::open("serial output", p, Kind::File, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600) {
                Ok(f) => std::os::unix::fs::fchown(&f, Some(j.uid), Some(j.gid)).map_err(sys(format!("giving {} to the jail's uid", p.display())))?,
                Err(err) if err.io_kind() == Some(io::ErrorKind::AlreadyExists) => {}
                Err(err) => return Err(err.into()),
            }
            e.expose(p, "serial output", Kind::File, Some((j, 2)))?;
        }
        for d in &cfg.disks {
            e.expose(&d.path, "disk", Kind::FileOrBlockDevice, Some((j, if d.read_only { 4 } else { 6 })))?;
        }
        if let Some(v) = &cfg.vgpu {
            // connect(2) on a unix socket needs write permission on it.
            e.expose(&v.socket, "vGPU socket", Kind::Socket, Some((j, 2)))?;
        }
        if cfg.hugepages != Hugepages::None {
            e.expose(Path::new("/sys/kernel/mm/hugepages"), "hugepage sysfs directory", Kind::Directory, None)?;
        }
        if cfg.numa_node.is_some() {
            let root = crate::numa::sysfs_root();
            let root = std::fs::canonicalize(&root).map_err(sys(format!("sysfs root {}", root.display())))?;
            e.expose(&root.join("devices/system/node"), "NUMA sysfs directory", Kind::Directory, None)?;
            e.expose(&root.join("devices/system/cpu/online"), "NUMA sysfs file", Kind::File, None)?;
        }
        Ok(e)
    }

    /// Opens `p` (`O_PATH`, no symbolic link in any component), checks it
    /// is `kind` and, with `access`, that the jail's uid may use it so
    /// (4 read, 2 write: writable too), and adds it to the binds. Read-only
    /// unless write access was asked for.
    fn expose(&mut self, p: &Path, what: &str, kind: Kind, access: Option<(&JailConfig, u32)>) -> Result<(), JailError> {
        let (fd, m) = crate::safe_open::inspect(what, p, kind)?;
        if let Some((j, want)) = access {
            need_access(&m, p, what, j, want)?;
        }
        drop(fd);
        self.binds.push(Bind { path: p.to_path_buf(), what: what.into(), kind, dev: m.dev(), ino: m.ino(), is_dir: m.is_dir(), writable: access.is_some_and(|(_, w)| w & 2 != 0) });
        Ok(())
    }
}

impl Exposed {
    /// What opening and releasing passthrough device `a` reads: its sysfs
    /// directory (bound at its real path, with /sys/bus/pci/devices/ADDR
    /// linking to it, so its relative `iommu_group` link resolves), its
    /// IOMMU group's directory, and /dev/vfio/vfio and /dev/vfio/GROUP as
    /// nodes of the jail's uid. Nothing else of sysfs or /dev/vfio.
    fn expose_vfio(&mut self, a: &crate::devices::vfio::PciAddress) -> Result<(), JailError> {
        // The real sysfs, whatever VGPU_SYSFS_ROOT says: the nodes made
        // below are the real /dev/vfio's.
        let sysfs = Path::new("/sys");
        let link = a.dir(sysfs);
        let real = std::fs::canonicalize(&link).map_err(sys(format!("passthrough device {}", link.display())))?;
        let group = a.iommu_group(sysfs).ok_or_else(|| JailError::Invalid(crate::devices::vfio::VfioError::NoIommuGroup(*a).to_string()))?;
        let groups = std::fs::canonicalize(sysfs.join("kernel/iommu_groups").join(group.to_string())).map_err(sys(format!("IOMMU group {group}")))?;
        self.expose(&real, "passthrough device's sysfs directory", Kind::Directory, None)?;
        self.expose(&groups, "IOMMU group's sysfs directory", Kind::Directory, None)?;
        if link != real {
            self.links.push((link, real));
        }
        for node in [PathBuf::from("/dev/vfio/vfio"), PathBuf::from(format!("/dev/vfio/{group}"))] {
            if !self.nodes.iter().any(|(p, _)| *p == node) {
                let rdev = std::fs::metadata(&node).map_err(sys(node.display().to_string()))?.rdev();
                self.nodes.push((node, rdev));
            }
        }
        Ok(())
    }
}

/// The parent side of a jail: waits for the jailed VMM.
#[derive(Debug)]
pub struct Supervisor {
    child: libc::pid_t,
    /// The write end of the start pipe, held open so the child can tell
    /// that its supervisor still lives.
    _alive: std::os::fd::OwnedFd,
    cgroup: Option<Cgroup>,
}

/// How the jailed VMM ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildEnd {
    Exited(i32),
    Signaled(i32),
}

static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward_kill(_sig: libc::c_int) {
    let pid = CHILD.load(Ordering::Relaxed);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; pid is our jailed child, which
        // as a namespace init takes only SIGKILL from here.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

impl Supervisor {
    /// The jailed VMM's PID, as the host sees it.
    pub fn child_pid(&self) -> i32 {
        self.child
    }

    /// Waits for the jailed VMM to end; SIGTERM, SIGINT and SIGHUP to the
    /// supervisor end it with SIGKILL.
    pub fn wait(self) -> ChildEnd {
        CHILD.store(self.child, Ordering::Relaxed);
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            // SAFETY: the handler only calls kill, which is async-signal-safe.
            unsafe { libc::signal(sig, forward_kill as *const () as libc::sighandler_t) };
        }
        let mut status = 0;
        let end = loop {
            // SAFETY: waits for our own child; status is a valid out-pointer.
            let r = unsafe { libc::waitpid(self.child, &mut status, 0) };
            if r == self.child {
                if libc::WIFEXITED(status) {
                    break ChildEnd::Exited(libc::WEXITSTATUS(status));
                }
                if libc::WIFSIGNALED(status) {
                    break ChildEnd::Signaled(libc::WTERMSIG(status));
                }
            } else if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break ChildEnd::Exited(1);
            }
        };
        if let Some(cg) = &self.cgroup {
            cg.remove();
        }
        end
    }
}

/// Ends the supervisor the way its jailed VMM ended: the same exit status,
/// or death by the same signal.
pub fn exit_like(end: ChildEnd) -> ! {
    match end {
        ChildEnd::Exited(code) => std::process::exit(code),
        ChildEnd::Signaled(sig) => {
            // SAFETY: restores the default action and raises the signal on
            // this (single-threaded, unjailed) process.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
            std::process::exit(128 + sig)
        }
    }
}

/// Enters the jail, exposing what `cfg` needs (nothing but /dev/kvm
/// without one). Must be called while the process has one thread.
/// Returns `Some(Supervisor)` in the parent, which must only wait, and
/// `None` in the child, which continues as the jailed VMM.
pub fn enter(j: &JailConfig, cfg: Option<&VmConfig>) -> Result<Option<Supervisor>, JailError> {
    if j.uid == 0 || j.gid == 0 {
        return Err(JailError::RootIds);
    }
    if !j.root.is_absolute() {
        return Err(JailError::Invalid(format!("--jail {} must be an absolute path", j.root.display())));
    }
    let limits = Limits { memory_max: j.memory_max, pids_max: j.pids_max };
    let limited = j.memory_max.is_some() || j.pids_max.is_some();
    if limited {
        vgpu_topology::cgroup::check(Path::new(CGROUP_ROOT), &limits).map_err(JailError::Cgroup)?;
    }
    // The jail's root has no /proc: read the hard-link setting the VMM's
    // opens consult now (vgpu_topology::safe_open).
    crate::safe_open::hardlinks_protected();
    let exposed = match cfg {
        Some(cfg) => Exposed::for_config(cfg, j)?,
        None => Exposed::default(),
    };
    if !exposed.binds.is_empty() && !Path::new("/proc/self/fd").is_dir() {
        return Err(JailError::Invalid("the VM's files are bound into the jail from their descriptors through /proc/self/fd, and /proc is not mounted".into()));
    }
    let kvm_rdev = std::fs::metadata("/dev/kvm").map_err(sys("/dev/kvm"))?.rdev();
    std::fs::create_dir_all(&j.root).map_err(sys(format!("creating {}", j.root.display())))?;
    // SAFETY: getpid has no preconditions.
    let name = format!("vm-{}", unsafe { libc::getpid() });
    let cgroup = if limited { Some(Cgroup::create(Path::new(CGROUP_ROOT), "vgpu-vmm", &name, &limits).map_err(JailError::Cgroup)?) } else { None };
    let cleanup = |cg: &Option<Cgroup>| {
        if let Some(cg) = cg {
            cg.remove();
        }
    };
    let mut fds = [0; 2];
    // SAFETY: fds is a valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        cleanup(&cgroup);
        return Err(JailError::Sys { what: "pipe2".into(), err: io::Error::last_os_error() });
    }
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    let (rd, wr) = unsafe { (<std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[0]), <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[1])) };
    // SAFETY: unshare affects only this process's future children.
    if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
        cleanup(&cgroup);
        let err = io::Error::last_os_error();
        return Err(JailError::Sys { what: "unshare(CLONE_NEWPID) (the jail needs root)".into(), err });
    }
    // SAFETY: the caller guarantees a single-threaded process, so the child
    // may go on running Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        cleanup(&cgroup);
        return Err(JailError::Sys { what: "fork".into(), err: io::Error::last_os_error() });
    }
    if pid > 0 {
        drop(rd);
        if let Some(cg) = &cgroup {
            if let Err(e) = cg.add(pid).map_err(JailError::Cgroup) {
                // SAFETY: kills and reaps our own child, which waits for us.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                cleanup(&cgroup);
                return Err(e);
            }
        }
        // SAFETY: writes one byte from a valid buffer to our pipe.
        unsafe { libc::write(std::os::fd::AsRawFd::as_raw_fd(&wr), [1u8].as_ptr().cast(), 1) };
        return Ok(Some(Supervisor { child: pid, _alive: wr, cgroup }));
    }
    drop(wr);
    // The child: PID 1 of its namespace.
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) }, "PR_SET_PDEATHSIG")?;
    let mut go = [0u8; 1];
    // SAFETY: reads one byte into a valid buffer from our pipe.
    if unsafe { libc::read(std::os::fd::AsRawFd::as_raw_fd(&rd), go.as_mut_ptr().cast(), 1) } != 1 {
        return Err(JailError::Invalid("the jail's supervisor went away before the VMM started".into()));
    }
    build_root(j, &exposed, kvm_rdev)?;
    drop_privileges(j)?;
    // Dropping the uid cleared the parent-death signal: set it again, then
    // make sure the supervisor did not die in between.
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) }, "PR_SET_PDEATHSIG")?;
    let mut p = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&rd), events: libc::POLLIN, revents: 0 };
    // SAFETY: polls one valid pollfd without waiting.
    if unsafe { libc::poll(&mut p, 1, 0) } > 0 && p.revents & libc::POLLHUP != 0 {
        return Err(JailError::Invalid("the jail's supervisor went away".into()));
    }
    Ok(None)
}

fn mount(src: Option<&Path>, target: &Path, fstype: Option<&str>, flags: libc::c_ulong, data: Option<&str>) -> Result<(), JailError> {
    let s = src.map(cstr).transpose()?;
    let t = cstr(target)?;
    let f = fstype.map(|f| CString::new(f).unwrap_or_default());
    let d = data.map(|d| CString::new(d).unwrap_or_default());
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string that
    // outlives the call.
    let rc = unsafe { libc::mount(ptr(&s), t.as_ptr(), ptr(&f), flags, ptr(&d).cast()) };
    check(rc, format!("mounting {} on {}", src.map_or("-".into(), |s| s.display().to_string()), target.display()))
}

/// Opens `b`'s path again, in the jail's own mount namespace (mount(2)
/// binds only from the caller's), without following a symbolic link in any
/// component, and checks it is still the file that was checked before the
/// fork. The bind is made from this descriptor, not from the path.
fn reopen(b: &Bind) -> Result<OwnedFd, JailError> {
    let (fd, m) = crate::safe_open::inspect(&b.what, &b.path, b.kind)?;
    if (m.dev(), m.ino()) != (b.dev, b.ino) {
        return Err(JailError::Invalid(format!("{} {} was replaced while the jail was being built", b.what, b.path.display())));
    }
    Ok(fd)
}

/// Bind-mounts what `fd` holds (`b`'s file, as [`reopen`] checked it,
/// whatever its path names now) at the same path under `root`, read-only
/// or not.
fn bind_at_same_path(root: &Path, b: &Bind, fd: &OwnedFd) -> Result<(), JailError> {
    let src = &b.path;
    let rel = src.strip_prefix("/").map_err(|_| JailError::Invalid(format!("{} is not an absolute path", src.display())))?;
    let target = root.join(rel);
    let parent = target.parent().unwrap_or(root);
    std::fs::create_dir_all(parent).map_err(sys(format!("creating {}", parent.display())))?;
    if b.is_dir {
        std::fs::create_dir_all(&target).map_err(sys(format!("creating {}", target.display())))?;
    } else if !target.exists() {
        std::fs::File::create(&target).map_err(sys(format!("creating {}", target.display())))?;
    }
    let by_fd = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    let (s, t) = (cstr(&by_fd)?, cstr(&target)?);
    // SAFETY: both are NUL-terminated paths that outlive the call; the
    // null type and data are allowed for a bind.
    let rc = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) };
    check(rc, format!("binding {} (descriptor {}) on {}", src.display(), fd.as_raw_fd(), target.display()))?;
    let mut flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    if !b.writable {
        flags |= libc::MS_RDONLY;
    }
    mount(None, &target, None, flags, None)
}

/// In new mount and network namespaces: a tmpfs root on `j.root` holding
/// `/dev/kvm` and the exposed files, entered with pivot_root and made
/// read-only.
fn build_root(j: &JailConfig, e: &Exposed, kvm_rdev: u64) -> Result<(), JailError> {
    // The directories made below lead the jail's uid to its files: they
    // must be searchable whatever mask the VMM was started with (a daemon
    // that starts VMMs may run with 077).
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe { libc::umask(0o022) };
    // SAFETY: unshare affects only this process.
    check(unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET) }, "unshare(CLONE_NEWNS | CLONE_NEWNET)")?;
    // Nothing mounted from here on propagates back to the host.
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None)?;
    // Held until the binds are made, then closed: they lead outside the
    // new root (fchdir to a host directory), and none may
    // reach the jailed VMM.
    let fds = e.binds.iter().map(reopen).collect::<Result<Vec<_>, _>>()?;
    let root = &j.root;
    mount(Some(Path::new("vgpu-jail")), root, Some("tmpfs"), libc::MS_NOSUID | libc::MS_NOEXEC, Some("mode=0755,size=1m,nr_inodes=4096"))?;
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).map_err(sys("creating the jail's /dev"))?;
    let kvm = cstr(&dev.join("kvm"))?;
    // SAFETY: kvm is a NUL-terminated path in the jail's own tmpfs.
    check(unsafe { libc::mknod(kvm.as_ptr(), libc::S_IFCHR | 0o600, kvm_rdev) }, "creating the jail's /dev/kvm")?;
    // SAFETY: as above; plain ownership change of the new node.
    check(unsafe { libc::chown(kvm.as_ptr(), j.uid, j.gid) }, "giving /dev/kvm to the jail's uid")?;
    for (b, fd) in e.binds.iter().zip(&fds) {
        bind_at_same_path(root, b, fd)?;
    }
    drop(fds);
    for (link, target) in &e.links {
        let at = root.join(link.strip_prefix("/").unwrap_or(link));
        std::fs::create_dir_all(at.parent().unwrap_or(root)).map_err(sys(format!("creating {}", at.display())))?;
        std::os::unix::fs::symlink(target, &at).map_err(sys(format!("linking {} to {}", at.display(), target.display())))?;
    }
    for (node, rdev) in &e.nodes {
        let at = root.join(node.strip_prefix("/").unwrap_or(node));
        std::fs::create_dir_all(at.parent().unwrap_or(root)).map_err(sys(format!("creating {}", at.display())))?;
        let c = cstr(&at)?;
        // SAFETY: a NUL-terminated path in the jail's own tmpfs.
        check(unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, *rdev) }, format!("creating the jail's {}", node.display()))?;
        // SAFETY: as above; plain ownership change of the new node.
        check(unsafe { libc::chown(c.as_ptr(), j.uid, j.gid) }, format!("giving {} to the jail's uid", node.display()))?;
    }
    if let Some(bytes) = e.memlock {
        let lim = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
        // SAFETY: setrlimit with a valid struct; still root here.
        check(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) }, "raising RLIMIT_MEMLOCK for VFIO's pinned guest RAM")?;
    }
    std::env::set_current_dir(root).map_err(sys(format!("entering {}", root.display())))?;
    // SAFETY: pivot_root with two NUL-terminated paths (".", ".").
    let pivoted = unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) } == 0;
    if pivoted {
        // The old root now sits on top of the new one: detach it.
        // SAFETY: unmounts "." lazily; a NUL-terminated path.
        check(unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) }, "detaching the old root")?;
    } else {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(JailError::Sys { what: "pivot_root".into(), err });
        }
        // An initramfs root cannot be pivoted away from: move the jail
        // over "/" and chroot into it, as switch_root does.
        mount(Some(Path::new(".")), Path::new("/"), None, libc::MS_MOVE, None)?;
        // SAFETY: chroot to the current directory, a NUL-terminated path.
        check(unsafe { libc::chroot(c".".as_ptr()) }, "chroot")?;
    }
    std::env::set_current_dir("/").map_err(sys("entering /"))?;
    mount(None, Path::new("/"), None, libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC, None)
}

/// Drops every capability (bounding set included), the groups, and root.
fn drop_privileges(j: &JailConfig) -> Result<(), JailError> {
    for cap in 0..64 {
        // SAFETY: prctl with integer arguments; EINVAL past the last
        // capability is expected and ignored.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
    }
    // SAFETY: an empty group list.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }, "setgroups")?;
    // SAFETY: plain id changes of this process.
    check(unsafe { libc::setresgid(j.gid, j.gid, j.gid) }, "setresgid")?;
    // SAFETY: as above; leaving uid 0 clears the permitted, effective and
    // ambient capability sets.
    check(unsafe { libc::setresuid(j.uid, j.uid, j.uid) }, "setresuid")?;
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, "PR_SET_NO_NEW_PRIVS")?;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut h = Header { version: 0x2008_0522, pid: 0 };
    let mut d = [Data::default(); 2];
    // SAFETY: capget with a version-3 header and room for its two data
    // structs.
    if unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) } != 0 {
        return Err(JailError::Sys { what: "capget".into(), err: io::Error::last_os_error() });
    }
    let eff = d[0].effective as u64 | (d[1].effective as u64) << 32;
    let prm = d[0].permitted as u64 | (d[1].permitted as u64) << 32;
    if eff != 0 || prm != 0 {
        return Err(JailError::CapsLeft(eff, prm));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_follows_owner_group_and_other_bits() {
        let dir = std::env::temp_dir().join(format!("vgpu-jail-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("f");
        std::fs::write(&f, b"x").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let m = std::fs::metadata(&f).unwrap();
        assert!(allowed(&m, m.uid(), 12345, 6));
        assert!(allowed(&m, 54321, m.gid(), 4));
        assert!(!allowed(&m, 54321, m.gid(), 2));
        assert!(!allowed(&m, 54321, 12345, 4));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn paths_become_absolute() {
        // Tests run in the package's directory, which holds Cargo.toml.
        let mut cfg = VmConfig::new(PathBuf::from("./src/../Cargo.toml"));
        cfg.serial = SerialOut::File(PathBuf::from("serial.log"));
        absolute_paths(&mut cfg).unwrap();
        assert_eq!(cfg.kernel, std::env::current_dir().unwrap().join("Cargo.toml"));
        match &cfg.serial {
            SerialOut::File(p) => assert!(p.is_absolute() && p.ends_with("serial.log")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn paths_behind_symbolic_links_are_refused_not_resolved() {
        let dir = std::env::temp_dir().join(format!("vgpu-jail-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let real = dir.join("real");
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(real.join("disk.img"), [0u8; 512]).unwrap();
        std::fs::write(real.join("kernel"), b"k").unwrap();
        std::os::unix::fs::symlink(real.join("disk.img"), dir.join("disk.img")).unwrap();
        std::os::unix::fs::symlink(&real, dir.join("via")).unwrap();
        let disk = crate::config::DiskSpec::new;
        let mut cfg = VmConfig::new(real.join("kernel"));
        cfg.disks = vec![disk(real.join("disk.img"))];
        absolute_paths(&mut cfg).unwrap();
        for (kernel, d, says) in [
            (real.join("kernel"), dir.join("disk.img"), format!("disk {} is a symbolic link; give the real path", dir.join("disk.img").display())),
            (dir.join("via/kernel"), real.join("disk.img"), format!("kernel {}: {} is a symbolic link; give the real path", dir.join("via/kernel").display(), dir.join("via").display())),
        ] {
            let mut cfg = VmConfig::new(kernel);
            cfg.disks = vec![disk(d)];
            let e = absolute_paths(&mut cfg).unwrap_err();
            assert!(matches!(e, JailError::File(_)), "{e:?}");
            assert_eq!(e.to_string(), says);
        }
        let mut cfg = VmConfig::new(real.join("kernel"));
        cfg.serial = SerialOut::File(dir.join("via/serial.log"));
        assert!(absolute_paths(&mut cfg).unwrap_err().to_string().contains("is a symbolic link; give the real path"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
