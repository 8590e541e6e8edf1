//! cgroup v2 groups that bound one process's memory and tasks: a jailed
//! VMM's (`vgpu-vmm/vm-PID`) and a tenant executor's
//! (`vgpu-mediatord/DEVICE.TENANT`). The group is made, limited and
//! joined by its creator, and removed once its process is gone.
//!
//! Only cgroup v2 is used: a v1 or hybrid layout (whose memory controller
//! counts differently) reads as [`CgroupError::NoCgroup2`], and the caller
//! decides whether that is fatal (a VMM asked for limits) or a documented
//! fallback (executors keep their rlimits).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Where a cgroup v2 hierarchy must be mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
const TMPFS_MAGIC: i64 = 0x0102_1994;
const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No usable cgroup v2 hierarchy (the reason is in the text).
    #[error("no writable cgroup v2 hierarchy at {root}: {why}")]
    NoCgroup2 { root: String, why: String },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        err: io::Error,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CgroupError {
    let path = path.display().to_string();
    move |err| CgroupError::Io { what, path, err }
}

fn write_file(p: &Path, v: &str) -> Result<(), CgroupError> {
    std::fs::write(p, v).map_err(io_err("writing to", p))
}

/// The limits of one group; `None` leaves that controller alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// `memory.max`, bytes.
    pub memory_max: Option<u64>,
    /// `pids.max`: processes and threads.
    pub pids_max: Option<u64>,
}

impl Limits {
    /// The controllers these limits need.
    fn controllers(&self) -> Vec<&'static str> {
        let mut c = Vec::new();
        if self.memory_max.is_some() {
            c.push("memory");
        }
        if self.pids_max.is_some() {
            c.push("pids");
        }
        c
    }
}

/// One group under `root/base/name`.
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
}

/// Checks that `root` is a cgroup v2 hierarchy offering the controllers
/// `limits` need.
pub fn check(root: &Path, limits: &Limits) -> Result<(), CgroupError> {
    let no = |why: String| CgroupError::NoCgroup2 { root: root.display().to_string(), why };
    let c = CString::new(root.as_os_str().as_bytes()).map_err(|_| no("the path holds a NUL byte".into()))?;
    // SAFETY: a zeroed statfs is valid; statfs writes into it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path and st a valid out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(no(format!("it cannot be read ({})", io::Error::last_os_error())));
    }
    let kind = st.f_type as i64;
    if kind != CGROUP2_SUPER_MAGIC {
        return Err(no(match kind {
            TMPFS_MAGIC => "it is a tmpfs (a cgroup v1 or hybrid layout)".to_string(),
            CGROUP_SUPER_MAGIC => "it is a cgroup v1 hierarchy".to_string(),
            other => format!("it is a filesystem of type {other:#x}"),
        }));
    }
    let have = std::fs::read_to_string(root.join("cgroup.controllers")).map_err(|e| no(format!("its cgroup.controllers cannot be read ({e})")))?;
    for w in limits.controllers() {
        if !have.split_whitespace().any(|c| c == w) {
            return Err(no(format!("its root offers no {w} controller (it has: {})", have.trim())));
        }
    }
    Ok(())
}

impl Cgroup {
    /// Makes `root/base/name` with `limits`, enabling their controllers on
    /// `root` and `base` (which hold no process themselves). A group of
    /// that name left behind by an earlier process is reused.
    pub fn create(root: &Path, base: &str, name: &str, limits: &Limits) -> Result<Cgroup, CgroupError> {
        check(root, limits)?;
        let enable: Vec<String> = limits.controllers().iter().map(|w| format!("+{w}")).collect();
        let enable = enable.join(" ");
        let base = root.join(base);
        match std::fs::create_dir(&base) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("creating", &base)(e)),
        }
        if !enable.is_empty() {
            write_file(&root.join("cgroup.subtree_control"), &enable)?;
            write_file(&base.join("cgroup.subtree_control"), &enable)?;
        }
        let dir = base.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("creating", &dir)(e)),
        }
        let cg = Cgroup { dir };
        let set = || -> Result<(), CgroupError> {
            if let Some(m) = limits.memory_max {
                write_file(&cg.dir.join("memory.max"), &m.to_string())?;
            }
            if let Some(p) = limits.pids_max {
                write_file(&cg.dir.join("pids.max"), &p.to_string())?;
            }
            Ok(())
        };
        if let Err(e) = set() {
            cg.remove();
            return Err(e);
        }
        Ok(cg)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Sets the group's `memory.max` to `bytes`.
    pub fn set_memory_max(&self, bytes: u64) -> Result<(), CgroupError> {
        write_file(&self.dir.join("memory.max"), &bytes.to_string())
    }

    /// Moves process `pid` into the group.
    pub fn add(&self, pid: libc::pid_t) -> Result<(), CgroupError> {
        write_file(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    /// The group's `cgroup.procs`, opened for a child to join with
    /// [`join_self`] between fork and exec (so it never runs outside it).
    pub fn procs_fd(&self) -> Result<OwnedFd, CgroupError> {
        let p = self.dir.join("cgroup.procs");
        let c = CString::new(p.as_os_str().as_bytes()).map_err(|_| CgroupError::Io { what: "opening", path: p.display().to_string(), err: io::Error::from(io::ErrorKind::InvalidInput) })?;
        // SAFETY: c is a NUL-terminated path; the result is checked.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io_err("opening", &p)(io::Error::last_os_error()));
        }
        // SAFETY: open returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Removes the group once its process is gone (the kernel empties it
    /// shortly after the process is reaped); a group still busy after a
    /// second is left, and said so.
    pub fn remove(&self) {
        for _ in 0..100 {
            match std::fs::remove_dir(&self.dir) {
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => std::thread::sleep(std::time::Duration::from_millis(10)),
                _ => return,
            }
        }
        eprintln!("cgroup {} is still busy; left in place", self.dir.display());
    }
}

/// Moves the calling process into the group whose `cgroup.procs` is `fd`
/// ("0" names the writer). Only a `write`: safe between fork and exec.
pub fn join_self(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: writes one byte from a static buffer to a descriptor the
    // caller owns.
    if unsafe { libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) } == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_that_is_not_cgroup2_is_refused_with_what_it_is() {
        let dir = std::env::temp_dir().join(format!("vgpu-cgroup-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = Cgroup::create(&dir, "vgpu-test", "x", &Limits { memory_max: Some(1 << 20), pids_max: None }).unwrap_err();
        assert!(matches!(e, CgroupError::NoCgroup2 { .. }), "{e}");
        assert!(e.to_string().contains("it is a"), "{e}");
        assert!(!dir.join("vgpu-test").exists(), "nothing is made on a refused root");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn limits_name_only_the_controllers_they_use() {
        assert!(Limits::default().controllers().is_empty());
        assert_eq!(Limits { memory_max: Some(1), pids_max: Some(2) }.controllers(), ["memory", "pids"]);
        assert_eq!(Limits { memory_max: None, pids_max: Some(2) }.controllers(), ["pids"]);
    }
}
