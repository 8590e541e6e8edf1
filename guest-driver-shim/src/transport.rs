//! How the shim reaches its vGPU. The unix-socket transport serves host
//! processes and containers (`VGPU_SOCKET`); the virtio-gpu DRM transport
//! (`drm.rs`) serves guests.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use virtio_gpu_compute::*;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::client::{CallError, CallResult};

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("connection to the vGPU failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed reply: {0}")]
    Wire(#[from] WireError),
    #[error("reply does not match the request")]
    Mismatch,
}

/// A round-trip message channel plus an optional shared bulk buffer.
pub trait Transport: Send {
    /// Sends one request and returns its decoded reply.
    fn call(&mut self, req: &Request, seq: u32) -> Result<Reply, TransportError>;
    /// The shared bulk-data (staging) buffer, if this transport has one.
    fn shared(&mut self) -> Option<&mut [u8]>;
    /// How copies name the staging buffer: the tenant's registered memfd
    /// (region 0), or (in a guest) a blob resource.
    fn shared_loc(&self) -> (DataLoc, u32) {
        (DataLoc::Shared, 0)
    }
    /// Pinned host memory the worker copies from directly: its address and
    /// how copies name it.
    fn alloc_pinned(&mut self, _size: usize, _seq: u32) -> CallResult<(*mut u8, DataLoc, u32)> {
        Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "this transport has no pinned memory"))
    }
    fn free_pinned(&mut self, _p: *mut u8, _len: usize, _id: u32, _seq: u32) -> CallResult<()> {
        Ok(())
    }
    /// Makes the page-aligned range `[p, p+len)` of the process's own
    /// memory shared with the worker, in place: how copies name it, or None
    /// where this transport cannot (copies from it are then staged).
    fn register_host(&mut self, _p: *mut u8, _len: usize, _seq: u32) -> CallResult<Option<(DataLoc, u32)>> {
        Ok(None)
    }
    /// Undoes [`Transport::register_host`]: the range is private memory
    /// again, with the same contents.
    fn unregister_host(&mut self, _p: *mut u8, _len: usize, _id: u32, _seq: u32) -> CallResult<()> {
        Ok(())
    }
}

/// A call that answers nothing on success, as a CallResult.
fn empty_reply(r: Result<Reply, TransportError>) -> CallResult<()> {
    match r {
        Ok(Reply::Empty) => Ok(()),
        Ok(Reply::Error(code, msg)) => Err(CallError::new(code, msg)),
        Ok(r) => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
        Err(e) => Err(CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, e.to_string())),
    }
}

/// Whether `[p, p+len)` lies in private, writable, anonymous mappings of
/// this process (heap or anonymous mmap): the only memory registration
/// re-backs in place.
fn private_anonymous(p: usize, len: usize) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return false };
    let mut covered = p;
    let end = p + len;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        let path = f.nth(3).unwrap_or("");
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else { continue };
        if b <= covered || a > covered {
            continue;
        }
        if !perms.starts_with("rw") || !perms.ends_with('p') || !(path.is_empty() || path == "[heap]") {
            return false;
        }
        covered = b;
        if covered >= end {
            return true;
        }
    }
    false
}

/// Replaces `[p, p+len)` with `len` bytes of `fd` (shared) or, with no fd,
/// private anonymous memory, keeping its contents.
fn remap_in_place(p: *mut u8, len: usize, fd: Option<i32>) -> std::io::Result<()> {
    // SAFETY: a fresh private anonymous mapping for the copy; checked.
    let tmp = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    if tmp == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `p` is `len` bytes of this process's memory (checked by the
    // caller against /proc/self/maps) and `tmp` a fresh mapping of `len`.
    unsafe { std::ptr::copy_nonoverlapping(p, tmp.cast::<u8>(), len) };
    let (flags, fd) = match fd {
        Some(fd) => (libc::MAP_SHARED | libc::MAP_FIXED, fd),
        None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED, -1),
    };
    // SAFETY: replaces exactly the caller's page-aligned range, which it
    // owns; MAP_FIXED over our own pages, checked below.
    let q = unsafe { libc::mmap(p.cast(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
    let r = if q == p.cast() {
        // SAFETY: both mappings are `len` bytes and distinct.
        unsafe { std::ptr::copy_nonoverlapping(tmp.cast::<u8>(), p, len) };
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    };
    // SAFETY: unmapping the temporary mapping made above.
    unsafe { libc::munmap(tmp, len) };
    r
}

/// The worker's answer to AttachRing and, on success, the ring's mapping.
pub type AttachedRing = (Reply, Option<(*mut u8, usize)>);

pub struct UnixTransport {
    s: UnixStream,
    shm: Option<(*mut u8, usize)>,
    ring: Option<(*mut u8, usize)>,
    /// Pinned regions: id -> mapping.
    pinned: std::collections::HashMap<u32, (*mut u8, usize)>,
    next_region: u32,
}

/// A sealed memfd of `size` bytes, mapped shared (and populated, so the
/// page faults are paid here, at allocation).
fn shared_memfd(size: usize, populate: bool) -> Result<(OwnedFd, *mut u8), TransportError> {
    // SAFETY: memfd_create with a static NUL-terminated name; the
    // result is checked before use and owned by OwnedFd.
    let raw = unsafe { libc::memfd_create(c"vgpu-shm".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `raw` is a fresh fd we own exclusively.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain fcntl/ftruncate calls on an fd we own.
    let ok = unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) == 0 && libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) == 0 };
    if !ok {
        return Err(std::io::Error::last_os_error().into());
    }
    let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
    // SAFETY: maps `size` bytes of the sealed memfd; checked for MAP_FAILED.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, flags, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok((fd, p.cast()))
}

// SAFETY: the shared mapping is owned by the transport and only reached
// through `&mut self`.
unsafe impl Send for UnixTransport {}

impl UnixTransport {
    pub fn connect(path: &str) -> Result<UnixTransport, TransportError> {
        Ok(UnixTransport { s: UnixStream::connect(path)?, shm: None, ring: None, pinned: std::collections::HashMap::new(), next_region: 1 })
    }

    /// A duplicate of the socket, to watch it for hang-up.
    pub fn socket_clone(&self) -> Result<OwnedFd, TransportError> {
        Ok(OwnedFd::from(self.s.try_clone()?))
    }

    fn send_fds(&mut self, req: &Request, seq: u32, fds: &[i32]) -> Result<Reply, TransportError> {
        let msg = req.encode(seq);
        self.s.send_with_fds(&[&msg[..]], fds).map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        self.read_reply(req.opcode(), seq)
    }

    /// Creates a sealed memfd of `size` bytes, maps it, and registers it
    /// with the worker as shared region `id` (0: the staging buffer).
    pub fn register_shared(&mut self, id: u32, size: usize, seq: u32) -> Result<Reply, TransportError> {
        let (fd, p) = shared_memfd(size, false)?;
        let reply = self.send_fds(&Request::RegisterShm(RegisterShmReq { size: size as u64, id, flags: 0 }), seq, &[fd.as_raw_fd()])?;
        if reply == Reply::Empty && id == 0 {
            self.shm = Some((p, size));
        } else {
            // SAFETY: unmapping the mapping made above, which nothing else uses.
            unsafe { libc::munmap(p.cast(), size) };
        }
        Ok(reply)
    }

    /// Creates the command ring's memory and attaches it, with `kick` as the
    /// eventfd the worker watches. On success, the ring's mapping.
    pub fn attach_ring(&mut self, sq_size: u32, kick: &OwnedFd, seq: u32) -> Result<AttachedRing, TransportError> {
        let size = virtio_gpu_compute::ring::region_size(sq_size);
        let (fd, p) = shared_memfd(size, true)?;
        let reply = self.send_fds(&Request::AttachRing(AttachRingReq { sq_size, flags: 0, blob: 0, reserved: 0 }), seq, &[fd.as_raw_fd(), kick.as_raw_fd()])?;
        if reply == Reply::Empty {
            self.ring = Some((p, size));
            Ok((reply, Some((p, size))))
        } else {
            // SAFETY: unmapping the mapping made above, which nothing else uses.
            unsafe { libc::munmap(p.cast(), size) };
            Ok((reply, None))
        }
    }

    fn read_reply(&mut self, op: Opcode, seq: u32) -> Result<Reply, TransportError> {
        let mut hdr = [0u8; MsgHeader::SIZE];
        self.s.read_exact(&mut hdr)?;
        let h = MsgHeader::decode(&hdr)?;
        let mut payload = vec![0u8; h.payload_len as usize];
        self.s.read_exact(&mut payload)?;
        if h.seq != seq || (h.opcode() != op && h.status == 0) {
            return Err(TransportError::Mismatch);
        }
        Ok(Reply::decode_payload(op, h.status, &payload)?)
    }
}

impl Transport for UnixTransport {
    fn call(&mut self, req: &Request, seq: u32) -> Result<Reply, TransportError> {
        self.s.write_all(&req.encode(seq))?;
        self.read_reply(req.opcode(), seq)
    }

    fn shared(&mut self) -> Option<&mut [u8]> {
        // SAFETY: the mapping lives as long as self and is only reached
        // through this &mut borrow.
        self.shm.map(|(p, n)| unsafe { std::slice::from_raw_parts_mut(p, n) })
    }

    fn alloc_pinned(&mut self, size: usize, seq: u32) -> CallResult<(*mut u8, DataLoc, u32)> {
        let io = |e: TransportError| CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("pinned host memory of {size} bytes: {e}"));
        let (fd, p) = shared_memfd(size.max(1), true).map_err(io)?;
        let id = self.next_region;
        self.next_region = self.next_region.wrapping_add(1).max(1);
        let reply = self.send_fds(&Request::RegisterShm(RegisterShmReq { size: size.max(1) as u64, id, flags: 0 }), seq, &[fd.as_raw_fd()]);
        if let Err(e) = empty_reply(reply) {
            // SAFETY: unmapping the mapping made above, which nothing else uses.
            unsafe { libc::munmap(p.cast(), size.max(1)) };
            return Err(e);
        }
        self.pinned.insert(id, (p, size.max(1)));
        Ok((p, DataLoc::Shared, id))
    }

    fn register_host(&mut self, p: *mut u8, len: usize, seq: u32) -> CallResult<Option<(DataLoc, u32)>> {
        if !private_anonymous(p as usize, len) {
            return Ok(None);
        }
        let io = |e: TransportError| CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("registering {len} bytes: {e}"));
        let (fd, q) = shared_memfd(len, false).map_err(io)?;
        // SAFETY: the memfd mapping made above is not used any more.
        unsafe { libc::munmap(q.cast(), len) };
        let id = self.next_region;
        self.next_region = self.next_region.wrapping_add(1).max(1);
        empty_reply(self.send_fds(&Request::RegisterShm(RegisterShmReq { size: len as u64, id, flags: 0 }), seq, &[fd.as_raw_fd()]))?;
        if let Err(e) = remap_in_place(p, len, Some(fd.as_raw_fd())) {
            let _ = self.call(&Request::UnregisterShm(ShmIdReq { id, reserved: 0 }), seq);
            return Err(CallError::new(CuResult::CUDA_ERROR_OPERATING_SYSTEM, format!("re-backing the range with shared memory: {e}")));
        }
        Ok(Some((DataLoc::Shared, id)))
    }

    fn unregister_host(&mut self, p: *mut u8, len: usize, id: u32, seq: u32) -> CallResult<()> {
        let r = self.call(&Request::UnregisterShm(ShmIdReq { id, reserved: 0 }), seq);
        remap_in_place(p, len, None).map_err(|e| CallError::new(CuResult::CUDA_ERROR_OPERATING_SYSTEM, format!("making the range private again: {e}")))?;
        empty_reply(r)
    }

    fn free_pinned(&mut self, _p: *mut u8, _len: usize, id: u32, seq: u32) -> CallResult<()> {
        let r = self.call(&Request::UnregisterShm(ShmIdReq { id, reserved: 0 }), seq);
        if let Some((p, n)) = self.pinned.remove(&id) {
            // SAFETY: the mapping made in alloc_pinned, unmapped once; the
            // caller no longer uses it.
            unsafe { libc::munmap(p.cast(), n) };
        }
        empty_reply(r)
    }
}

impl Drop for UnixTransport {
    fn drop(&mut self) {
        let maps = self.shm.take().into_iter().chain(self.ring.take()).chain(self.pinned.drain().map(|(_, m)| m));
        for (p, n) in maps.collect::<Vec<_>>() {
            // SAFETY: unmapping our own mappings once, at drop.
            unsafe { libc::munmap(p.cast(), n) };
        }
    }
}
