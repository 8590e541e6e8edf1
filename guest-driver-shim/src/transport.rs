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
        match reply {
            Ok(Reply::Empty) => {
                self.pinned.insert(id, (p, size.max(1)));
                Ok((p, DataLoc::Shared, id))
            }
            other => {
                // SAFETY: unmapping the mapping made above, which nothing else uses.
                unsafe { libc::munmap(p.cast(), size.max(1)) };
                Err(match other {
                    Ok(Reply::Error(code, msg)) => CallError::new(code, msg),
                    Ok(r) => CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}")),
                    Err(e) => CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, e.to_string()),
                })
            }
        }
    }

    fn free_pinned(&mut self, _p: *mut u8, _len: usize, id: u32, seq: u32) -> CallResult<()> {
        let r = self.call(&Request::UnregisterShm(ShmIdReq { id, reserved: 0 }), seq);
        if let Some((p, n)) = self.pinned.remove(&id) {
            // SAFETY: the mapping made in alloc_pinned, unmapped once; the
            // caller no longer uses it.
            unsafe { libc::munmap(p.cast(), n) };
        }
        match r {
            Ok(Reply::Empty) => Ok(()),
            Ok(Reply::Error(code, msg)) => Err(CallError::new(code, msg)),
            Ok(r) => Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))),
            Err(e) => Err(CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, e.to_string())),
        }
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
