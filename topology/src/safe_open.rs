//! Opening the files a VM's description names (kernel, initramfs, disks,
//! serial log) without following a symbolic link in any component of the
//! path, and checking what was opened on the descriptor itself.
//!
//! The VMM opens these files every time it starts, as root unless it is
//! jailed, on behalf of whoever described the VM; the mediator checks a
//! managed VM's description with the same rules before it takes it. A user
//! who owns a directory on the way must not be able to point either at a
//! file of someone else's (`disk.img -> /etc/shadow`), at create time or by
//! swapping the file later, so:
//!
//! - Symbolic links: refused in every component of the path. The open is
//!   `openat2(2)` with `RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`; on a
//!   kernel without openat2 (before Linux 5.6, ENOSYS) the path is walked
//!   one component at a time from `/` (or the working directory) with
//!   `O_NOFOLLOW`, each directory checked on its descriptor. The error
//!   names the link: "... is a symbolic link; give the real path".
//! - Types: checked with fstat on the opened descriptor, never on the
//!   path: a regular file, or for a disk also a block device. Files are
//!   opened with `O_NONBLOCK` (cleared once the type is right), so a FIFO
//!   planted in place of a file cannot hang the open.
//! - Hard links: a regular file or block device with more than one link
//!   (`st_nlink > 1`) is accepted only where the kernel restricts who may
//!   make links (`fs.protected_hardlinks = 1`, the default under systemd
//!   and in Debian's kernels): a link to a file can then only be made by
//!   its owner or by someone who may already read and write it, so the
//!   link gives whoever planted it nothing they did not have. Where the
//!   setting is 0 (or cannot be read), any user could link any file on the
//!   same filesystem into a directory of theirs, and such a file is
//!   refused. The setting is read once per process (before a jail, whose
//!   root has no /proc).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

/// What a file named by a VM's description must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file: a kernel, an initramfs, a serial log.
    File,
    /// A regular file or a block device: a disk.
    FileOrBlockDevice,
    /// A unix socket: a vGPU's vhost-user socket (jail exposure).
    Socket,
    /// A directory (jail exposure of sysfs parts).
    Directory,
}

impl Kind {
    fn wanted(self) -> &'static str {
        match self {
            Kind::File => "a regular file",
            Kind::FileOrBlockDevice => "a regular file or a block device",
            Kind::Socket => "a unix socket",
            Kind::Directory => "a directory",
        }
    }

    fn admits(self, t: std::fs::FileType) -> bool {
        match self {
            Kind::File => t.is_file(),
            Kind::FileOrBlockDevice => t.is_file() || t.is_block_device(),
            Kind::Socket => t.is_socket(),
            Kind::Directory => t.is_dir(),
        }
    }

    /// Whether a second name of such a file could hand someone else's
    /// data to the guest (directories always have several links).
    fn link_checked(self) -> bool {
        matches!(self, Kind::File | Kind::FileOrBlockDevice)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SafeOpenError {
    #[error("{what} {path} contains a NUL byte")]
    Nul { what: String, path: String },
    #[error("{what} {path} is a symbolic link; give the real path")]
    Symlink { what: String, path: String },
    #[error("{what} {path}: {link} is a symbolic link; give the real path")]
    SymlinkInPath { what: String, path: String, link: String },
    #[error("{what} {path} is not {wanted}")]
    WrongType { what: String, path: String, wanted: &'static str },
    #[error(
        "{what} {path} has {links} hard links, and this host lets any user make a hard link to any file (fs.protected_hardlinks is not 1), so another of its names may have been planted; give a file with one link, or set fs.protected_hardlinks = 1"
    )]
    HardLinks { what: String, path: String, links: u64 },
    #[error("{what} {path}")]
    Io {
        what: String,
        path: String,
        #[source]
        err: io::Error,
    },
}

impl SafeOpenError {
    /// The kind of the underlying I/O error, for an open that failed as
    /// one (e.g. `AlreadyExists` for `O_EXCL`).
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            SafeOpenError::Io { err, .. } => Some(err.kind()),
            _ => None,
        }
    }
}

/// Whether the kernel restricts hard links (`fs.protected_hardlinks` is
/// 1), read once per process.
pub fn hardlinks_protected() -> bool {
    static PROTECTED: OnceLock<bool> = OnceLock::new();
    *PROTECTED.get_or_init(|| std::fs::read_to_string("/proc/sys/fs/protected_hardlinks").is_ok_and(|s| s.trim() == "1"))
}

/// The hard-link policy (module docs) for a file of `kind` with `links`
/// names, on a host whose links are `protected` or not.
fn check_links(what: &str, path: &Path, kind: Kind, links: u64, protected: bool) -> Result<(), SafeOpenError> {
    if kind.link_checked() && links > 1 && !protected {
        return Err(SafeOpenError::HardLinks { what: what.into(), path: path.display().to_string(), links });
    }
    Ok(())
}

/// Why a resolution failed.
enum Failure {
    /// A symbolic link was met; the walk knows which one.
    Link(Option<PathBuf>),
    Io(io::Error),
}

/// `openat2(AT_FDCWD, path, flags, mode)` refusing every symbolic link.
fn openat2(path: &CString, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: open_how is three integers; all zeros is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u32 as u64;
    how.mode = if flags & libc::O_CREAT != 0 { u64::from(mode) } else { 0 };
    how.resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: path is NUL-terminated and how a valid open_how whose size
    // is passed; both outlive the call.
    let fd = unsafe { libc::syscall(libc::SYS_openat2, libc::AT_FDCWD, path.as_ptr(), &how as *const libc::open_how, std::mem::size_of::<libc::open_how>()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative result is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn openat(dir: RawFd, name: &CString, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: name is NUL-terminated; dir is a descriptor the caller holds
    // open; the mode is only read with O_CREAT.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags, mode as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative result is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn cname(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// The fallback for kernels without openat2: from `/` (or the working
/// directory) one component at a time, each directory opened `O_PATH |
/// O_NOFOLLOW` and checked on its descriptor, the last one opened with
/// `flags | O_NOFOLLOW`.
fn walk(path: &Path, flags: libc::c_int, mode: u32) -> Result<OwnedFd, Failure> {
    let start: &[u8] = if path.is_absolute() { b"/" } else { b"." };
    let mut dir = openat(libc::AT_FDCWD, &cname(start).map_err(Failure::Io)?, libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC, 0).map_err(Failure::Io)?;
    let parts: Vec<Component<'_>> = path.components().filter(|c| matches!(c, Component::Normal(_) | Component::ParentDir)).collect();
    let mut so_far = PathBuf::from(if path.is_absolute() { "/" } else { "" });
    let name_of = |c: &Component<'_>| cname(c.as_os_str().as_bytes());
    let Some((last, dirs)) = parts.split_last() else {
        // `/` or `.`: the start itself.
        return openat(dir.as_raw_fd(), &cname(b".").map_err(Failure::Io)?, flags | libc::O_NOFOLLOW, mode).map_err(Failure::Io);
    };
    for c in dirs {
        so_far.push(c.as_os_str());
        let next = File::from(openat(dir.as_raw_fd(), &name_of(c).map_err(Failure::Io)?, libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0).map_err(Failure::Io)?);
        let t = next.metadata().map_err(Failure::Io)?.file_type();
        if t.is_symlink() {
            return Err(Failure::Link(Some(so_far)));
        }
        if !t.is_dir() {
            return Err(Failure::Io(io::Error::from_raw_os_error(libc::ENOTDIR)));
        }
        dir = OwnedFd::from(next);
    }
    so_far.push(last.as_os_str());
    match openat(dir.as_raw_fd(), &name_of(last).map_err(Failure::Io)?, flags | libc::O_NOFOLLOW, mode) {
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(Failure::Link(Some(so_far))),
        r => r.map_err(Failure::Io),
    }
}

/// Opens `path` refusing symbolic links: openat2 where the kernel has it,
/// the walk otherwise.
fn resolve(path: &Path, flags: libc::c_int, mode: u32) -> Result<OwnedFd, Failure> {
    static NO_OPENAT2: OnceLock<()> = OnceLock::new();
    if NO_OPENAT2.get().is_none() {
        let c = cname(path.as_os_str().as_bytes()).map_err(Failure::Io)?;
        match openat2(&c, flags, mode) {
            Ok(fd) => return Ok(fd),
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                let _ = NO_OPENAT2.set(());
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(Failure::Link(None)),
            Err(e) => return Err(Failure::Io(e)),
        }
    }
    walk(path, flags, mode)
}

/// The first component of `path` (itself included) that is a symbolic
/// link now, to name in the error.
fn first_symlink(path: &Path) -> Option<PathBuf> {
    let mut cur = PathBuf::new();
    for c in path.components() {
        cur.push(c.as_os_str());
        if matches!(c, Component::Normal(_)) && std::fs::symlink_metadata(&cur).is_ok_and(|m| m.file_type().is_symlink()) {
            return Some(cur);
        }
    }
    None
}

fn link_error(what: &str, path: &Path, link: Option<PathBuf>) -> SafeOpenError {
    let p = path.display().to_string();
    match link.or_else(|| first_symlink(path)) {
        Some(l) if l.as_path() != path => SafeOpenError::SymlinkInPath { what: what.into(), path: p, link: l.display().to_string() },
        // The path itself, or a link gone since (a race): the path.
        _ => SafeOpenError::Symlink { what: what.into(), path: p },
    }
}

/// Opens `path`, refusing symbolic links anywhere in it, and checks the
/// descriptor: its type is `kind` and the hard-link policy holds.
fn open_checked(what: &str, path: &Path, kind: Kind, flags: libc::c_int, mode: u32) -> Result<(OwnedFd, std::fs::Metadata), SafeOpenError> {
    let io_err = |err: io::Error| SafeOpenError::Io { what: what.into(), path: path.display().to_string(), err };
    if path.as_os_str().as_bytes().contains(&0) {
        return Err(SafeOpenError::Nul { what: what.into(), path: path.display().to_string() });
    }
    let fd = resolve(path, flags, mode).map_err(|f| match f {
        Failure::Link(l) => link_error(what, path, l),
        Failure::Io(e) => io_err(e),
    })?;
    let file = File::from(fd);
    let meta = file.metadata().map_err(io_err)?;
    if meta.file_type().is_symlink() {
        // An O_PATH walk's last component: the link itself was opened.
        return Err(link_error(what, path, Some(path.to_path_buf())));
    }
    if !kind.admits(meta.file_type()) {
        return Err(SafeOpenError::WrongType { what: what.into(), path: path.display().to_string(), wanted: kind.wanted() });
    }
    if meta.nlink() > 1 {
        check_links(what, path, kind, meta.nlink(), hardlinks_protected())?;
    }
    Ok((OwnedFd::from(file), meta))
}

/// Opens `path` for I/O without following a symbolic link in any
/// component, and checks on the descriptor that it is `kind` and passes
/// the hard-link policy (module docs). `flags` holds the access mode and
/// any of O_APPEND, O_CREAT, O_EXCL, O_DIRECT; O_CLOEXEC and O_NOCTTY are
/// added, and O_NONBLOCK until the type is checked. `mode` is for O_CREAT.
pub fn open(what: &str, path: &Path, kind: Kind, flags: libc::c_int, mode: u32) -> Result<File, SafeOpenError> {
    let (fd, _) = open_checked(what, path, kind, flags | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK, mode)?;
    if flags & libc::O_NONBLOCK == 0 {
        // SAFETY: fcntl on a descriptor we own, with integer arguments.
        let rc = unsafe {
            let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            if fl < 0 {
                fl
            } else {
                libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            return Err(SafeOpenError::Io { what: what.into(), path: path.display().to_string(), err: io::Error::last_os_error() });
        }
    }
    Ok(File::from(fd))
}

/// Checks `path` as [`open`] does without opening it for I/O (an
/// `O_PATH` descriptor: no side effect of opening a device, no access
/// needed to the file itself). Returns the descriptor, which pins the
/// file that was checked (a jail binds it through /proc/self/fd), and its
/// metadata.
pub fn inspect(what: &str, path: &Path, kind: Kind) -> Result<(OwnedFd, std::fs::Metadata), SafeOpenError> {
    open_checked(what, path, kind, libc::O_PATH | libc::O_CLOEXEC, 0)
}

/// Writes `bytes` to `path` so that a crash leaves the old file or the new
/// one: a temporary file beside it (made afresh, never through a link
/// planted at its name), synced, renamed over it, and the directory
/// synced. The file gets mode 0600.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).mode(0o600).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vgpu-safe-open-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn symlinks_anywhere_in_the_path_are_refused_with_the_link_named() {
        let d = scratch("links");
        let real = d.join("real");
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(real.join("disk.img"), [0u8; 512]).unwrap();
        std::os::unix::fs::symlink(real.join("disk.img"), d.join("disk.img")).unwrap();
        std::os::unix::fs::symlink(&real, d.join("linked")).unwrap();
        std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling")).unwrap();
        // The real path opens, for I/O and O_PATH alike.
        open("disk", &real.join("disk.img"), Kind::FileOrBlockDevice, libc::O_RDWR, 0).unwrap();
        inspect("disk", &real.join("disk.img"), Kind::FileOrBlockDevice).unwrap();
        // The last component a link.
        let e = open("disk", &d.join("disk.img"), Kind::FileOrBlockDevice, libc::O_RDWR, 0).unwrap_err();
        assert!(matches!(e, SafeOpenError::Symlink { .. }), "{e:?}");
        assert_eq!(e.to_string(), format!("disk {} is a symbolic link; give the real path", d.join("disk.img").display()));
        let e = inspect("disk", &d.join("disk.img"), Kind::FileOrBlockDevice).unwrap_err();
        assert!(matches!(e, SafeOpenError::Symlink { .. }), "{e:?}");
        // A directory on the way a link.
        let via = d.join("linked/disk.img");
        let e = open("kernel", &via, Kind::File, libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.to_string(), format!("kernel {}: {} is a symbolic link; give the real path", via.display(), d.join("linked").display()));
        assert!(matches!(inspect("kernel", &via, Kind::File).unwrap_err(), SafeOpenError::SymlinkInPath { .. }));
        // Creating through a dangling link is refused, and makes nothing.
        let e = open("serial output", &d.join("dangling"), Kind::File, libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT, 0o600).unwrap_err();
        assert!(matches!(e, SafeOpenError::Symlink { .. }), "{e:?}");
        assert!(!d.join("nowhere").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_walk_without_openat2_refuses_the_same_links() {
        let d = scratch("walk");
        let real = d.join("real");
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(real.join("f"), b"x").unwrap();
        std::os::unix::fs::symlink(real.join("f"), d.join("l")).unwrap();
        std::os::unix::fs::symlink(&real, d.join("dl")).unwrap();
        assert!(walk(&real.join("f"), libc::O_RDONLY | libc::O_CLOEXEC, 0).is_ok());
        assert!(walk(&real.join("../real/f"), libc::O_RDONLY | libc::O_CLOEXEC, 0).is_ok());
        assert!(matches!(walk(&d.join("l"), libc::O_RDONLY | libc::O_CLOEXEC, 0), Err(Failure::Link(Some(p))) if p == d.join("l")));
        assert!(matches!(walk(&d.join("dl/f"), libc::O_RDONLY | libc::O_CLOEXEC, 0), Err(Failure::Link(Some(p))) if p == d.join("dl")));
        // O_PATH opens the link itself; the type check on it refuses it.
        let fd = walk(&d.join("l"), libc::O_PATH | libc::O_CLOEXEC, 0).ok().unwrap();
        assert!(File::from(fd).metadata().unwrap().file_type().is_symlink());
        assert!(matches!(walk(&real.join("f/x"), libc::O_RDONLY | libc::O_CLOEXEC, 0), Err(Failure::Io(e)) if e.raw_os_error() == Some(libc::ENOTDIR)));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn types_are_checked_on_the_descriptor() {
        let d = scratch("types");
        let e = inspect("kernel", &d, Kind::File).unwrap_err();
        assert_eq!(e.to_string(), format!("kernel {} is not a regular file", d.display()));
        let e = inspect("disk", Path::new("/dev/null"), Kind::FileOrBlockDevice).unwrap_err();
        assert_eq!(e.to_string(), "disk /dev/null is not a regular file or a block device");
        // A FIFO in place of a disk neither hangs the open nor passes.
        let fifo = d.join("fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path in our scratch directory.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open("disk", &fifo, Kind::FileOrBlockDevice, libc::O_RDONLY, 0).unwrap_err();
        assert!(matches!(e, SafeOpenError::WrongType { .. }), "{e:?}");
        let e = open("disk", &d.join("missing"), Kind::FileOrBlockDevice, libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.io_kind(), Some(io::ErrorKind::NotFound));
        assert_eq!(e.to_string(), format!("disk {}", d.join("missing").display()));
        // A file opened for I/O is left blocking.
        let f = open("serial output", &d.join("log"), Kind::File, libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT, 0o600).unwrap();
        // SAFETY: F_GETFL on a descriptor we hold.
        assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) } & libc::O_NONBLOCK, 0);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn hard_links_pass_only_where_the_kernel_restricts_them() {
        let p = Path::new("/x/disk.img");
        assert!(check_links("disk", p, Kind::FileOrBlockDevice, 1, false).is_ok());
        assert!(check_links("disk", p, Kind::FileOrBlockDevice, 2, true).is_ok());
        let e = check_links("disk", p, Kind::FileOrBlockDevice, 2, false).unwrap_err();
        assert!(e.to_string().starts_with("disk /x/disk.img has 2 hard links"), "{e}");
        assert!(check_links("kernel", p, Kind::File, 3, false).is_err());
        assert!(check_links("sysfs", p, Kind::Directory, 5, false).is_ok(), "directories always have several links");
    }
}
