//! The run directory and the tenants' sockets: created by the daemon with
//! the modes it needs, or verified (owner, modes, no symlinks) when they
//! already exist, so another local user cannot plant or swap a socket.
//!
//! Layout: `RUN_DIR` (owner us, 0711), `RUN_DIR/api.sock` (0600),
//! `RUN_DIR/tenants` (owner us, 0711: tenants reach their own socket by
//! its name but cannot list or change the directory), `RUN_DIR/hidden`
//! (owner us, 0700: nobody else may enter it, so its sockets are reached
//! only through bind mounts, as containers reach theirs). The daemon binds
//! executors' sockets itself; only where a shared worker (isolation
//! "shared") binds its tenants' sockets does the workers' group get write
//! access, `tenants` 0731 and `hidden` 0730 (`hidden` beside `tenants`,
//! not in it, where the workers could rename it).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::config::Owner;

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("{path}: {err}")]
    Io {
        path: String,
        #[source]
        err: std::io::Error,
    },
    #[error("{path} is a symbolic link; refusing to follow it")]
    Symlink { path: String },
    #[error("{path} is not a directory")]
    NotDir { path: String },
    #[error("{path} is owned by uid {uid}, not by this daemon (uid {me}); refusing to use it")]
    Owner { path: String, uid: u32, me: u32 },
    #[error("{path} is writable by group or others (mode {mode:04o}); refusing to use it")]
    Writable { path: String, mode: u32 },
    #[error("{path} is not a socket")]
    NotSocket { path: String },
    #[error("{path} is not a regular file of this daemon's own with a single link; refusing to use it as a lock")]
    LockFile { path: String },
    #[error("another mediator{} holds {path}: two daemons cannot share a run or state directory; stop it, or give this one directories of its own", .pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Held { path: String, pid: Option<u32> },
}

fn io(path: &Path, err: std::io::Error) -> RunDirError {
    RunDirError::Io { path: path.display().to_string(), err }
}

/// Creates `dir` (mode 0700), or checks that the existing one is a real
/// directory we own that nobody else can write; then sets its group and
/// its mode, where given. Never follows a symlink at `dir` itself.
fn own_dir(dir: &Path, mode: Option<u32>, gid: Option<u32>) -> Result<(), RunDirError> {
    let p = dir.display().to_string();
    let found = match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => None,
            // Made by another process meanwhile: checked as found.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Some(std::fs::symlink_metadata(dir).map_err(|e| io(dir, e))?),
            Err(e) => return Err(io(dir, e)),
        },
        Err(e) => return Err(io(dir, e)),
        Ok(m) => Some(m),
    };
    match found {
        None => {}
        Some(m) => {
            if m.file_type().is_symlink() {
                return Err(RunDirError::Symlink { path: p });
            }
            if !m.is_dir() {
                return Err(RunDirError::NotDir { path: p });
            }
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            if m.uid() != me {
                return Err(RunDirError::Owner { path: p, uid: m.uid(), me });
            }
            // Group write is only ours to grant (to the workers' group).
            let foreign_gid = gid.is_none_or(|g| g != m.gid());
            if m.mode() & 0o002 != 0 || (m.mode() & 0o020 != 0 && foreign_gid) {
                return Err(RunDirError::Writable { path: p, mode: m.mode() & 0o7777 });
            }
        }
    }
    // The directory is ours now; open it without following links and fix
    // group and mode through the descriptor.
    let fd = open_nofollow(dir, libc::O_DIRECTORY)?;
    if let Some(g) = gid {
        // SAFETY: fd is an open directory we own; -1 keeps the owner.
        if unsafe { libc::fchown(fd.as_raw_fd(), u32::MAX, g) } != 0 {
            return Err(io(dir, std::io::Error::last_os_error()));
        }
    }
    if let Some(mode) = mode {
        // SAFETY: fd is an open directory we own.
        if unsafe { libc::fchmod(fd.as_raw_fd(), mode) } != 0 {
            return Err(io(dir, std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Creates `dir`'s parent directories where they are missing.
fn parents(dir: &Path) -> Result<(), RunDirError> {
    match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => std::fs::create_dir_all(parent).map_err(|e| io(parent, e)),
        None => Ok(()),
    }
}

fn open_nofollow(path: &Path, flags: i32) -> Result<OwnedFd, RunDirError> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| io(path, std::io::ErrorKind::InvalidInput.into()))?;
    // SAFETY: a NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ELOOP) { RunDirError::Symlink { path: path.display().to_string() } } else { io(path, e) });
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Prepares `run_dir` and `run_dir/tenants` (see the module doc) and
/// holds `run_dir` for this daemon ([`hold`]) before it changes anything
/// inside: a second daemon on the directory stops there. With `workers`
/// set and `shared_workers` (some device's worker binds its tenants'
/// sockets), the workers' group may create sockets in `tenants` and
/// `hidden`; otherwise only the daemon may (a group write an earlier run
/// gave the workers is taken back).
pub fn prepare(run_dir: &Path, workers: Option<Owner>, shared_workers: bool) -> Result<Held, RunDirError> {
    parents(run_dir)?;
    own_dir(run_dir, Some(0o711), None)?;
    let held = hold(run_dir)?;
    let tenants = run_dir.join("tenants");
    let hidden = hidden_dir(run_dir);
    let (t, h) = if workers.is_some() && shared_workers { (0o731, 0o730) } else { (0o711, 0o700) };
    let gid = workers.map(|w| w.gid);
    own_dir(&tenants, Some(t), gid)?;
    own_dir(&hidden, Some(h), gid)?;
    Ok(held)
}

/// Where hidden tenants' sockets lie (`TenantSpec::hidden`).
pub fn hidden_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("hidden")
}

/// Prepares the state directory `dir`: created (0700; its parents as
/// needed), or checked to be a real directory this daemon owns and nobody
/// else can write (its mode otherwise left as the operator set it); then
/// held for this daemon ([`hold`]) unless it is the run directory `run`
/// already holds (`None` then).
pub fn prepare_state(dir: &Path, run: &Held) -> Result<Option<Held>, RunDirError> {
    parents(dir)?;
    own_dir(dir, None, None)?;
    let m = std::fs::metadata(dir).map_err(|e| io(dir, e))?;
    if (m.dev(), m.ino()) == run.dir {
        return Ok(None);
    }
    hold(dir).map(Some)
}

/// Creates `dir` (mode 0700; its parents as needed), or checks that the
/// existing one is a real directory this daemon owns and nobody else can
/// write.
pub fn private_dir_in_place(dir: &Path) -> Result<(), RunDirError> {
    parents(dir)?;
    own_dir(dir, Some(0o700), None)
}

/// The lock file a running mediator holds in its run and state
/// directories.
pub const LOCK_FILE: &str = "mediator.lock";

/// A directory held by this daemon while it runs (see [`hold`]).
#[derive(Debug)]
pub struct Held {
    _file: std::fs::File,
    /// The held directory's device and inode.
    dir: (u64, u64),
}

/// Holds `dir` (which must exist) for this daemon: `dir/mediator.lock`,
/// created if need be (never through a symlink), locked with `flock`
/// without waiting, with this process's pid written in it for whoever
/// is refused. The lock lives as long as the returned value, and at most
/// as long as this process: the kernel drops it when the daemon dies,
/// however it dies, and its children never inherit it (close-on-exec),
/// so no stale lock outlives a killed daemon. A lock file that is not a
/// regular file of this daemon's uid with one link (a FIFO, a hard link to
/// some other file) is refused before it is read or written.
pub fn hold(dir: &Path) -> Result<Held, RunDirError> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(LOCK_FILE);
    // O_NONBLOCK: opening a planted FIFO never waits for a writer.
    let mut f = match std::fs::OpenOptions::new().read(true).write(true).create(true).mode(0o600).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(&path) {
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(RunDirError::Symlink { path: path.display().to_string() }),
        r => r.map_err(|e| io(&path, e))?,
    };
    let m = f.metadata().map_err(|e| io(&path, e))?;
    // SAFETY: geteuid has no preconditions.
    if !m.is_file() || m.uid() != unsafe { libc::geteuid() } || m.nlink() != 1 {
        return Err(RunDirError::LockFile { path: path.display().to_string() });
    }
    let d = std::fs::metadata(dir).map_err(|e| io(dir, e))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            // The holder writes its pid once it has the lock: an empty or
            // partial file only loses the pid from the message.
            let mut text = String::new();
            let pid = f.read_to_string(&mut text).ok().and_then(|_| text.trim().parse().ok());
            return Err(RunDirError::Held { path: path.display().to_string(), pid });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(&path, e)),
    }
    f.set_len(0).and_then(|()| f.rewind()).and_then(|()| writeln!(f, "{}", std::process::id())).map_err(|e| io(&path, e))?;
    Ok(Held { _file: f, dir: (d.dev(), d.ino()) })
}

/// Gives the socket at `path` its tenant's owner and mode. The path is
/// opened without following links and checked to be a socket, so a
/// planted symlink cannot redirect the change.
pub fn set_socket_owner(path: &Path, owner: Owner, mode: u32) -> Result<(), RunDirError> {
    let fd = open_nofollow(path, libc::O_PATH)?;
    // SAFETY: fd is a valid O_PATH descriptor; st is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io(path, std::io::Error::last_os_error()));
    }
    // O_PATH | O_NOFOLLOW opens a symlink itself rather than failing.
    if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
        return Err(RunDirError::Symlink { path: path.display().to_string() });
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(RunDirError::NotSocket { path: path.display().to_string() });
    }
    let empty = c"";
    // SAFETY: AT_EMPTY_PATH applies the change to the inode fd refers to.
    if unsafe { libc::fchownat(fd.as_raw_fd(), empty.as_ptr(), owner.uid, owner.gid, libc::AT_EMPTY_PATH) } != 0 {
        return Err(io(path, std::io::Error::last_os_error()));
    }
    // chmod through the descriptor's /proc link reaches the same inode.
    let proc = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::set_permissions(&proc, std::fs::Permissions::from_mode(mode)).map_err(|e| io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("vgpu-rundir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn run_dir_is_created_with_restrictive_modes() {
        let d = tmp("fresh");
        drop(prepare(&d, None, false).unwrap());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&d), 0o711);
        assert_eq!(mode(&d.join("tenants")), 0o711);
        assert_eq!(mode(&hidden_dir(&d)), 0o700);
        // Workers that bind sockets get the group's write; without them,
        // an earlier run's grant is taken back.
        // SAFETY: getegid has no preconditions.
        let w = Owner { uid: 4242, gid: unsafe { libc::getegid() } };
        drop(prepare(&d, Some(w), true).unwrap());
        assert_eq!((mode(&d.join("tenants")), mode(&hidden_dir(&d))), (0o731, 0o730));
        drop(prepare(&d, Some(w), false).unwrap());
        assert_eq!((mode(&d.join("tenants")), mode(&hidden_dir(&d))), (0o711, 0o700));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn world_writable_or_symlinked_tenants_dir_is_refused() {
        let d = tmp("planted");
        std::fs::create_dir_all(d.join("tenants")).unwrap();
        std::fs::set_permissions(d.join("tenants"), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(prepare(&d, None, false), Err(RunDirError::Writable { .. })), "a world-writable tenants dir must be refused");
        std::fs::remove_dir(d.join("tenants")).unwrap();
        std::os::unix::fs::symlink("/tmp", d.join("tenants")).unwrap();
        assert!(matches!(prepare(&d, None, false), Err(RunDirError::Symlink { .. })), "a symlinked tenants dir must be refused");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_held_directory_refuses_a_second_holder_until_the_first_lets_go() {
        let d = tmp("held");
        let first = prepare(&d, None, false).unwrap();
        assert_eq!(std::fs::read_to_string(d.join(LOCK_FILE)).unwrap().trim(), std::process::id().to_string());
        let group = |d: &Path| std::fs::metadata(d.join("tenants")).unwrap().gid();
        let before = group(&d);
        // flock conflicts between two open files, even in one process. A
        // second daemon whose workers have another group stops before it
        // gives them the first one's tenants directory.
        match prepare(&d, Some(Owner { uid: 4242, gid: before + 4343 }), true) {
            Err(e @ RunDirError::Held { pid: Some(p), .. }) if p == std::process::id() => assert!(e.to_string().contains(&format!("another mediator (pid {p}) holds")), "{e}"),
            other => panic!("a second holder got {other:?}"),
        }
        assert_eq!(group(&d), before);
        // The state directory: held apart from the run directory, unless
        // it is the run directory itself, which is held already.
        let state = d.join("state");
        let held_state = prepare_state(&state, &first).unwrap();
        assert!(held_state.is_some());
        assert!(matches!(hold(&state), Err(RunDirError::Held { .. })));
        assert!(prepare_state(&d, &first).unwrap().is_none());
        drop(held_state);
        drop(first);
        let again = hold(&d).unwrap();
        drop(again);
        // A planted symlink is not followed.
        std::fs::remove_file(d.join(LOCK_FILE)).unwrap();
        std::os::unix::fs::symlink(d.join("elsewhere"), d.join(LOCK_FILE)).unwrap();
        assert!(matches!(hold(&d), Err(RunDirError::Symlink { .. })));
        assert!(!d.join("elsewhere").exists());
        // Nor is a FIFO (read, it would block for ever) or a second link
        // to another file (truncated, it would lose that file).
        std::fs::remove_file(d.join(LOCK_FILE)).unwrap();
        let fifo = std::ffi::CString::new(d.join(LOCK_FILE).as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(matches!(hold(&d), Err(RunDirError::LockFile { .. })));
        std::fs::remove_file(d.join(LOCK_FILE)).unwrap();
        std::fs::write(d.join("precious"), b"keep me").unwrap();
        std::fs::hard_link(d.join("precious"), d.join(LOCK_FILE)).unwrap();
        assert!(matches!(hold(&d), Err(RunDirError::LockFile { .. })));
        assert_eq!(std::fs::read(d.join("precious")).unwrap(), b"keep me");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn socket_owner_is_not_applied_through_a_symlink() {
        let d = tmp("link");
        std::fs::create_dir_all(&d).unwrap();
        let target = d.join("target");
        std::fs::write(&target, b"x").unwrap();
        std::os::unix::fs::symlink(&target, d.join("t.sock")).unwrap();
        assert!(matches!(set_socket_owner(&d.join("t.sock"), Owner { uid: 1, gid: 1 }, 0o666), Err(RunDirError::Symlink { .. })));
        assert!(matches!(set_socket_owner(&target, Owner { uid: 1, gid: 1 }, 0o666), Err(RunDirError::NotSocket { .. })));
        let l = std::os::unix::net::UnixListener::bind(d.join("real.sock")).unwrap();
        set_socket_owner(&d.join("real.sock"), Owner { uid: 4242, gid: 4343 }, 0o660).unwrap();
        let m = std::fs::metadata(d.join("real.sock")).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o777), (4242, 4343, 0o660));
        drop(l);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
