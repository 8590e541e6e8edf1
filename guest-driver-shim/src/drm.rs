//! The guest transport: the stock Linux virtio-gpu driver's render node,
//! with our compute context type (DESIGN §4). The sequence is fixed:
//! open `renderD*`; GETPARAM CONTEXT_INIT and RESOURCE_BLOB; GET_CAPS for
//! our capset and check its magic; CONTEXT_INIT (the first ioctl that
//! touches a context, or the kernel would create a default one); GUEST
//! blobs, mapped; then each call is an EXECBUFFER on ring 0 with a fence,
//! followed by a WAIT on the reply blob.
//!
//! Two blobs serve the connection: the data blob is the shared buffer that
//! copies name (location Blob), and the reply blob is where the device
//! writes each reply before it signals the fence.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use virtio_gpu_compute::capset::{CapsetInfo, DEFAULT_CAPSET_ID, MAX_CAPSET_ID};
use virtio_gpu_compute::virtio_gpu::{SubmitHeader, SUBMIT_MAGIC};
use virtio_gpu_compute::*;

use crate::transport::{Transport, TransportError};

const fn iowr(nr: u32, size: usize) -> libc::c_ulong {
    ((3u32 << 30) | ((size as u32) << 16) | ((b'd' as u32) << 8) | (0x40 + nr)) as libc::c_ulong
}
const fn iow_core(nr: u32, size: usize) -> libc::c_ulong {
    ((1u32 << 30) | ((size as u32) << 16) | ((b'd' as u32) << 8) | nr) as libc::c_ulong
}

#[repr(C)]
#[derive(Default)]
struct GetParam {
    param: u64,
    value: u64,
}
#[repr(C)]
#[derive(Default)]
struct GetCaps {
    cap_set_id: u32,
    cap_set_ver: u32,
    addr: u64,
    size: u32,
    pad: u32,
}
#[repr(C)]
struct SetParam {
    param: u64,
    value: u64,
}
#[repr(C)]
struct ContextInit {
    num_params: u32,
    pad: u32,
    ctx_set_params: u64,
}
#[repr(C)]
#[derive(Default)]
struct CreateBlob {
    blob_mem: u32,
    blob_flags: u32,
    bo_handle: u32,
    res_handle: u32,
    size: u64,
    pad: u32,
    cmd_size: u32,
    cmd: u64,
    blob_id: u64,
}
#[repr(C)]
#[derive(Default)]
struct Map {
    offset: u64,
    handle: u32,
    pad: u32,
}
#[repr(C)]
#[derive(Default)]
struct ExecBuffer {
    flags: u32,
    size: u32,
    command: u64,
    bo_handles: u64,
    num_bo_handles: u32,
    fence_fd: i32,
    ring_idx: u32,
    pad: u32,
}
#[repr(C)]
struct Wait {
    handle: u32,
    flags: u32,
}
#[repr(C)]
struct GemClose {
    handle: u32,
    pad: u32,
}

const IOCTL_MAP: libc::c_ulong = iowr(0x01, std::mem::size_of::<Map>());
const IOCTL_EXECBUFFER: libc::c_ulong = iowr(0x02, std::mem::size_of::<ExecBuffer>());
const IOCTL_GETPARAM: libc::c_ulong = iowr(0x03, std::mem::size_of::<GetParam>());
const IOCTL_WAIT: libc::c_ulong = iowr(0x08, std::mem::size_of::<Wait>());
const IOCTL_GET_CAPS: libc::c_ulong = iowr(0x09, std::mem::size_of::<GetCaps>());
const IOCTL_CREATE_BLOB: libc::c_ulong = iowr(0x0a, std::mem::size_of::<CreateBlob>());
const IOCTL_CONTEXT_INIT: libc::c_ulong = iowr(0x0b, std::mem::size_of::<ContextInit>());
const IOCTL_GEM_CLOSE: libc::c_ulong = iow_core(0x09, std::mem::size_of::<GemClose>());

const PARAM_RESOURCE_BLOB: u64 = 3;
const PARAM_CONTEXT_INIT: u64 = 6;
const PARAM_SUPPORTED_CAPSET_IDS: u64 = 7;
const CONTEXT_PARAM_CAPSET_ID: u64 = 1;
const CONTEXT_PARAM_NUM_RINGS: u64 = 2;
const BLOB_MEM_GUEST: u32 = 1;
const BLOB_FLAG_USE_MAPPABLE: u32 = 1;
const EXECBUF_RING_IDX: u32 = 0x04;
const REPLY_BLOB_SIZE: usize = 64 << 10;

/// Issues `req` on `fd`; the struct is the ioctl's argument.
fn ioctl<T>(fd: &File, req: libc::c_ulong, arg: &mut T, what: &str) -> Result<(), TransportError> {
    loop {
        // SAFETY: `arg` is a #[repr(C)] struct of exactly the size encoded
        // in `req`; every pointer inside it refers to memory that outlives
        // the call.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), req, arg as *mut T) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) {
            continue;
        }
        return Err(TransportError::Io(std::io::Error::new(e.kind(), format!("{what}: {e}"))));
    }
}

struct Bo {
    handle: u32,
    res: u32,
    ptr: *mut u8,
    len: usize,
}

/// An attached ring: its mapping, its length and the kick that wakes it.
pub type RingMapping = (*mut u8, usize, DrmKick);

pub struct DrmTransport {
    fd: File,
    data: Bo,
    reply: Bo,
    ring: Option<Bo>,
    /// Pinned host memory: blobs by resource id.
    pinned: std::collections::HashMap<u32, Bo>,
    pub node: String,
    pub capset: CapsetInfo,
}

/// Wakes the device's ring consumer: an EXECBUFFER carrying a RingKick,
/// not waited for. It answers into a small blob of its own.
pub struct DrmKick {
    fd: File,
    reply: Bo,
    reply_handles: [u32; 1],
    /// When the device last showed it still serves this context.
    checked: std::sync::Mutex<std::time::Instant>,
}

/// How often a thread waiting on the ring asks whether the device still
/// knows this context.
const ALIVE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

// SAFETY: the kick's reply mapping is only written by the device.
unsafe impl Send for DrmKick {}
// SAFETY: as above; `kick` only issues an ioctl with local arguments.
unsafe impl Sync for DrmKick {}

impl crate::ring::Kick for DrmKick {
    fn kick(&self) -> crate::client::CallResult<()> {
        let mut cmd = Vec::new();
        SubmitHeader { magic: SUBMIT_MAGIC, reply_blob: self.reply.res, reply_offset: 0, reply_capacity: self.reply.len as u32, reserved: 0 }.put(&mut cmd);
        cmd.extend_from_slice(&Request::RingKick.encode(0));
        let mut eb = ExecBuffer {
            flags: EXECBUF_RING_IDX,
            size: cmd.len() as u32,
            command: cmd.as_ptr() as u64,
            bo_handles: self.reply_handles.as_ptr() as u64,
            num_bo_handles: 1,
            fence_fd: -1,
            ring_idx: 0,
            pad: 0,
        };
        ioctl(&self.fd, IOCTL_EXECBUFFER, &mut eb, "EXECBUFFER").map_err(|e| crate::client::CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("waking the device failed: {e}")))
    }
    fn futex(&self) -> bool {
        false
    }
    /// At most once a second: a kick waited for, whose answer must reach
    /// the kick's reply blob. A device that no longer knows this context
    /// (its backend was started again: the VMM reconnects, and contexts
    /// made before are gone) answers the command with an error and writes
    /// nothing, so a thread waiting on the ring fails instead of waiting
    /// for ever.
    fn alive(&self) -> bool {
        let mut last = self.checked.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < ALIVE_EVERY {
            return true;
        }
        // SAFETY: the reply blob is our mapping of `reply.len` bytes, at
        // least a header; a zeroed header marks "no answer yet". The device
        // writes it only while answering a kick.
        unsafe { std::ptr::write_bytes(self.reply.ptr, 0, MsgHeader::SIZE.min(self.reply.len)) };
        if self.kick().is_err() {
            return false;
        }
        let mut w = Wait { handle: self.reply.handle, flags: 0 };
        if ioctl(&self.fd, IOCTL_WAIT, &mut w, "WAIT").is_err() {
            return false;
        }
        let mut hdr = [0u8; MsgHeader::SIZE];
        for (i, b) in hdr.iter_mut().enumerate().take(self.reply.len) {
            // SAFETY: byte i < reply.len of our own mapping of the reply
            // blob, read volatile since the device writes it.
            *b = unsafe { std::ptr::read_volatile(self.reply.ptr.add(i)) };
        }
        let answered = hdr.iter().any(|&b| b != 0);
        *last = std::time::Instant::now();
        answered
    }
}

impl Drop for DrmKick {
    fn drop(&mut self) {
        close_bo(&self.fd, &self.reply);
    }
}

fn close_bo(fd: &File, bo: &Bo) {
    // SAFETY: unmapping our own mapping once.
    unsafe { libc::munmap(bo.ptr.cast(), bo.len) };
    let mut c = GemClose { handle: bo.handle, pad: 0 };
    let _ = ioctl(fd, IOCTL_GEM_CLOSE, &mut c, "GEM_CLOSE");
}

// SAFETY: the mappings are owned by the transport and only reached through
// `&mut self`.
unsafe impl Send for DrmTransport {}

fn getparam(fd: &File, param: u64) -> Result<u64, TransportError> {
    let mut v: u64 = 0;
    let mut p = GetParam { param, value: &mut v as *mut u64 as u64 };
    ioctl(fd, IOCTL_GETPARAM, &mut p, "GETPARAM")?;
    Ok(v)
}

fn create_blob(fd: &File, size: usize) -> Result<Bo, TransportError> {
    let mut b = CreateBlob { blob_mem: BLOB_MEM_GUEST, blob_flags: BLOB_FLAG_USE_MAPPABLE, size: size as u64, ..Default::default() };
    ioctl(fd, IOCTL_CREATE_BLOB, &mut b, "RESOURCE_CREATE_BLOB")?;
    let mut m = Map { handle: b.bo_handle, ..Default::default() };
    ioctl(fd, IOCTL_MAP, &mut m, "MAP")?;
    // SAFETY: maps the blob the kernel just created at the offset it gave.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), m.offset as libc::off_t) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(Bo { handle: b.bo_handle, res: b.res_handle, ptr: p.cast(), len: size })
}

impl DrmTransport {
    /// Finds a render node that offers our capset and sets up the context.
    pub fn open(shared_size: usize) -> Result<DrmTransport, TransportError> {
        let capset_id = std::env::var("VGPU_CAPSET_ID").ok().and_then(|v| v.parse().ok()).filter(|&v| v <= MAX_CAPSET_ID).unwrap_or(DEFAULT_CAPSET_ID);
        let nodes: Vec<String> = match std::env::var("VGPU_DRM_DEVICE") {
            Ok(p) => vec![p],
            Err(_) => (128..192).map(|n| format!("/dev/dri/renderD{n}")).collect(),
        };
        let mut last = None;
        for node in nodes {
            let Ok(fd) = OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(&node) else { continue };
            match Self::setup(fd, &node, capset_id, shared_size) {
                Ok(t) => return Ok(t),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| TransportError::Io(std::io::Error::new(std::io::ErrorKind::NotFound, "no virtio-gpu render node (/dev/dri/renderD*)"))))
    }

    fn setup(fd: File, node: &str, capset_id: u32, shared_size: usize) -> Result<DrmTransport, TransportError> {
        let no = |what: &str| TransportError::Io(std::io::Error::new(std::io::ErrorKind::Unsupported, format!("{node}: {what}")));
        if getparam(&fd, PARAM_CONTEXT_INIT)? == 0 || getparam(&fd, PARAM_RESOURCE_BLOB)? == 0 {
            return Err(no("the device lacks CONTEXT_INIT or RESOURCE_BLOB"));
        }
        if getparam(&fd, PARAM_SUPPORTED_CAPSET_IDS)? & (1u64 << capset_id) == 0 {
            return Err(no(&format!("capset {capset_id} is not offered")));
        }
        let mut buf = [0u8; CapsetInfo::SIZE];
        let mut caps = GetCaps { cap_set_id: capset_id, cap_set_ver: VERSION as u32, addr: buf.as_mut_ptr() as u64, size: buf.len() as u32, pad: 0 };
        ioctl(&fd, IOCTL_GET_CAPS, &mut caps, "GET_CAPS")?;
        let capset = CapsetInfo::decode(&buf).map_err(TransportError::Wire)?;
        // CONTEXT_INIT must come before anything that touches a context.
        let mut params = [SetParam { param: CONTEXT_PARAM_CAPSET_ID, value: capset_id as u64 }, SetParam { param: CONTEXT_PARAM_NUM_RINGS, value: 1 }];
        let mut init = ContextInit { num_params: params.len() as u32, pad: 0, ctx_set_params: params.as_mut_ptr() as u64 };
        ioctl(&fd, IOCTL_CONTEXT_INIT, &mut init, "CONTEXT_INIT")?;
        let data = create_blob(&fd, shared_size.max(4096))?;
        let reply = create_blob(&fd, REPLY_BLOB_SIZE)?;
        Ok(DrmTransport { fd, data, reply, ring: None, pinned: std::collections::HashMap::new(), node: node.to_string(), capset })
    }

    /// Creates the command ring in a blob and attaches it. On success, the
    /// ring's mapping and the kick that wakes its consumer.
    pub fn attach_ring(&mut self, sq_size: u32, seq: u32) -> Result<(Reply, Option<RingMapping>), TransportError> {
        let bo = create_blob(&self.fd, virtio_gpu_compute::ring::region_size(sq_size))?;
        let reply = self.call(&Request::AttachRing(AttachRingReq { sq_size, flags: 0, blob: bo.res, reserved: 0 }), seq)?;
        if reply != Reply::Empty {
            close_bo(&self.fd, &bo);
            return Ok((reply, None));
        }
        let kreply = create_blob(&self.fd, 4096)?;
        let kick = DrmKick { fd: self.fd.try_clone()?, reply_handles: [kreply.handle], reply: kreply, checked: std::sync::Mutex::new(std::time::Instant::now()) };
        let (p, n) = (bo.ptr, bo.len);
        self.ring = Some(bo);
        Ok((reply, Some((p, n, kick))))
    }
}

impl Transport for DrmTransport {
    fn call(&mut self, req: &Request, seq: u32) -> Result<Reply, TransportError> {
        let mut cmd = Vec::new();
        SubmitHeader { magic: SUBMIT_MAGIC, reply_blob: self.reply.res, reply_offset: 0, reply_capacity: self.reply.len as u32, reserved: 0 }.put(&mut cmd);
        cmd.extend_from_slice(&req.encode(seq));
        // SAFETY: the reply blob is our mapping of `reply.len` bytes; a
        // zeroed header marks "no reply yet".
        unsafe { std::ptr::write_bytes(self.reply.ptr, 0, MsgHeader::SIZE) };
        let handles = [self.reply.handle, self.data.handle];
        let mut eb = ExecBuffer {
            flags: EXECBUF_RING_IDX,
            size: cmd.len() as u32,
            command: cmd.as_ptr() as u64,
            bo_handles: handles.as_ptr() as u64,
            num_bo_handles: handles.len() as u32,
            fence_fd: -1,
            ring_idx: 0,
            pad: 0,
        };
        ioctl(&self.fd, IOCTL_EXECBUFFER, &mut eb, "EXECBUFFER")?;
        // The fence of this submission is on the reply blob: once it is
        // idle, the device has written the reply.
        let mut w = Wait { handle: self.reply.handle, flags: 0 };
        ioctl(&self.fd, IOCTL_WAIT, &mut w, "WAIT")?;
        // SAFETY: reading our own mapping of the reply blob.
        let reply = unsafe { std::slice::from_raw_parts(self.reply.ptr, self.reply.len) };
        let h = MsgHeader::decode(&reply[..MsgHeader::SIZE])?;
        let end = MsgHeader::SIZE + h.payload_len as usize;
        if end > reply.len() || h.seq != seq || (h.opcode() != req.opcode() && h.status == 0) {
            return Err(TransportError::Mismatch);
        }
        Ok(Reply::decode_payload(req.opcode(), h.status, &reply[MsgHeader::SIZE..end])?)
    }

    fn shared(&mut self) -> Option<&mut [u8]> {
        // SAFETY: the data blob mapping lives as long as self and is only
        // reached through this &mut borrow.
        Some(unsafe { std::slice::from_raw_parts_mut(self.data.ptr, self.data.len) })
    }

    fn shared_loc(&self) -> (DataLoc, u32) {
        (DataLoc::Blob, self.data.res)
    }

    fn alloc_pinned(&mut self, size: usize, seq: u32) -> crate::client::CallResult<(*mut u8, DataLoc, u32)> {
        let bo = create_blob(&self.fd, size.max(1).next_multiple_of(4096))
            .map_err(|e| crate::client::CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("pinned host memory of {size} bytes: {e}")))?;
        // The kernel attaches the new blob to our context with a command it
        // queues and does not wait for, while the command ring is served
        // beside the control queue: a copy through the blob could reach the
        // device first and find the blob not attached. A call on the
        // control queue is handled after that attach, so once it answers
        // the ring may use the blob.
        if let Err(e) = self.call(&Request::Ping, seq) {
            close_bo(&self.fd, &bo);
            return Err(crate::client::CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("pinned host memory of {size} bytes: {e}")));
        }
        let (p, res) = (bo.ptr, bo.res);
        self.pinned.insert(res, bo);
        Ok((p, DataLoc::Blob, res))
    }

    fn free_pinned(&mut self, _p: *mut u8, _len: usize, id: u32, _seq: u32) -> crate::client::CallResult<()> {
        if let Some(bo) = self.pinned.remove(&id) {
            close_bo(&self.fd, &bo);
        }
        Ok(())
    }
}

impl Drop for DrmTransport {
    fn drop(&mut self) {
        for bo in [&self.data, &self.reply].into_iter().chain(self.ring.as_ref()).chain(self.pinned.values()) {
            close_bo(&self.fd, bo);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_uapi() {
        // Values of DRM_IOCTL_VIRTGPU_* as the 6.1 UAPI header defines them.
        assert_eq!(IOCTL_MAP, 0xc010_6441);
        assert_eq!(IOCTL_EXECBUFFER, 0xc028_6442);
        assert_eq!(IOCTL_GETPARAM, 0xc010_6443);
        assert_eq!(IOCTL_WAIT, 0xc008_6448);
        assert_eq!(IOCTL_GET_CAPS, 0xc018_6449);
        assert_eq!(IOCTL_CREATE_BLOB, 0xc030_644a);
        assert_eq!(IOCTL_CONTEXT_INIT, 0xc010_644b);
        assert_eq!(IOCTL_GEM_CLOSE, 0x4008_6409);
    }
}
