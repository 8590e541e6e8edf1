//! How the shim reaches its vGPU. The unix-socket transport serves host
//! processes and containers (`VGPU_SOCKET`); the virtio-gpu DRM transport
//! (`drm.rs`) serves guests.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use virtio_gpu_compute::*;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

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
    /// The shared bulk-data buffer, if this transport has one.
    fn shared(&mut self) -> Option<&mut [u8]>;
    /// How copies name the shared buffer: the tenant's registered memfd,
    /// or (in a guest) a blob resource.
    fn shared_loc(&self) -> (DataLoc, u32) {
        (DataLoc::Shared, 0)
    }
}

pub struct UnixTransport {
    s: UnixStream,
    shm: Option<(*mut u8, usize)>,
}

// SAFETY: the shared mapping is owned by the transport and only reached
// through `&mut self`.
unsafe impl Send for UnixTransport {}

impl UnixTransport {
    pub fn connect(path: &str) -> Result<UnixTransport, TransportError> {
        Ok(UnixTransport { s: UnixStream::connect(path)?, shm: None })
    }

    /// Creates a sealed memfd of `size` bytes, maps it, and hands it to the
    /// worker, so bulk copies skip the socket.
    pub fn register_shared(&mut self, size: usize, seq: u32) -> Result<Reply, TransportError> {
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
        // SAFETY: maps `size` bytes of the sealed memfd; checked for MAP_FAILED.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        let msg = Request::RegisterShm(RegisterShmReq { size: size as u64 }).encode(seq);
        self.s.send_with_fd(&msg[..], fd.as_raw_fd()).map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        let reply = self.read_reply(Opcode::RegisterShm, seq)?;
        if reply == Reply::Empty {
            self.shm = Some((p.cast(), size));
        } else {
            // SAFETY: unmapping the mapping made above, which nothing else uses.
            unsafe { libc::munmap(p, size) };
        }
        Ok(reply)
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
}

impl Drop for UnixTransport {
    fn drop(&mut self) {
        if let Some((p, n)) = self.shm.take() {
            // SAFETY: unmapping our own mapping once, at drop.
            unsafe { libc::munmap(p.cast(), n) };
        }
    }
}
