//! Typed calls to the vGPU, safe to make from many threads at once.
//!
//! A client has a transport for setup and slow paths (the tenant socket,
//! or virtio-gpu SUBMIT_3D in a guest) and, where the worker offers it, a
//! command ring: calls then cost no system call, and stream work (launches,
//! memsets, copies, event records, stream waits) is only enqueued. Bulk
//! data moves through shared regions: the staging buffer (region 0) for
//! pageable memory, pipelined in chunks, and pinned host allocations the
//! worker copies from directly.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

use virtio_gpu_compute::*;

use crate::ring::{Kick, RingClient};
use crate::transport::{Transport, TransportError, UnixTransport};

/// Default size of the staging buffer (override with `VGPU_SHM_SIZE`).
pub const DEFAULT_SHM: usize = 8 << 20;
/// Pageable copies move through the staging buffer in pieces of this
/// size, so the shim fills one slot while the worker drains another.
pub const CHUNK: usize = 256 << 10;
/// A staging slot: a piece and the page of room `staging::place` moves it
/// in.
const SLOT: usize = CHUNK + 4096;

/// A failed call: the CUDA code and the device's explanation.
#[derive(Debug, Clone, PartialEq)]
pub struct CallError {
    pub code: CuResult,
    pub msg: String,
}

impl CallError {
    pub fn new(code: CuResult, msg: impl Into<String>) -> Self {
        CallError { code, msg: msg.into() }
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.msg)
    }
}

pub type CallResult<T> = Result<T, CallError>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The staging buffer's chunk slots and the entry that last used each.
struct Staging {
    ptr: *mut u8,
    len: usize,
    slot_seq: Vec<u64>,
    next: usize,
}

// SAFETY: the staging mapping is owned by the transport, which outlives
// the client's use of it; access is serialised by the mutex around it.
unsafe impl Send for Staging {}

/// A pinned host allocation: a shared region the worker copies from.
struct Pinned {
    len: usize,
    loc: DataLoc,
    id: u32,
}

pub struct Client {
    t: Mutex<Box<dyn Transport>>,
    seq: AtomicU32,
    broken: AtomicBool,
    ring: Option<RingClient>,
    staging: Option<Mutex<Staging>>,
    /// Pinned allocations by start address.
    pinned: Mutex<BTreeMap<usize, Pinned>>,
    /// Sticky errors of contexts whose kernels faulted.
    sticky: Mutex<std::collections::HashMap<u32, CallError>>,
    any_sticky: AtomicBool,
    /// The first sticky error this connection reported: what every call
    /// reports once the connection is lost after it (crate::api::fail).
    fatal: Mutex<Option<CallError>>,
    /// Registered host ranges by page-aligned start: length and, where the
    /// worker shares them, how copies name them.
    registered: Mutex<BTreeMap<usize, Registered>>,
}

/// A registered host range: its length and, where the worker shares it,
/// how copies name it.
type Registered = (usize, Option<(DataLoc, u32)>);

/// The host kick: one write to the eventfd the worker watches. It holds a
/// duplicate of the tenant socket to notice the worker going away.
struct EventFdKick(OwnedFd, OwnedFd);

impl Kick for EventFdKick {
    fn kick(&self) -> CallResult<()> {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a local to an eventfd we own.
        let n = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
        if n != 8 {
            return Err(CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("waking the device failed: {}", std::io::Error::last_os_error())));
        }
        Ok(())
    }
    fn futex(&self) -> bool {
        true
    }
    fn alive(&self) -> bool {
        let mut p = libc::pollfd { fd: self.1.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: polls one descriptor we own, without waiting.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n <= 0 || p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) == 0
    }
}

/// Whether to use a command ring (`VGPU_RING=0` turns it off).
fn ring_wanted() -> bool {
    std::env::var("VGPU_RING").map(|v| v != "0").unwrap_or(true)
}

/// The worker offers no ring (or refused this one): every call is then a
/// round trip, which still works.
fn no_ring(r: &Reply) {
    if std::env::var_os("VGPU_LOG").is_some() {
        eprintln!("libcuda(vgpu): no command ring ({r:?}); every call is a round trip");
    }
}

fn env_size(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Whether the ring may carry `req` (descriptors, module images and inline
/// copies go on the transport).
fn ring_eligible(req: &Request) -> bool {
    !matches!(req, Request::RegisterShm(_) | Request::AttachRing(_) | Request::ModuleLoad(..) | Request::GraphCreate(..))
        && !matches!(req, Request::MemcpyHtoD(b, _) if b.loc == DataLoc::Inline as u32)
        && !matches!(req, Request::MemcpyDtoH(b) if b.loc == DataLoc::Inline as u32)
}

impl Client {
    /// The tenant socket named by `VGPU_SOCKET`; without it, a virtio-gpu
    /// render node that offers the compute capset.
    pub fn from_env() -> CallResult<Client> {
        match std::env::var("VGPU_SOCKET") {
            Ok(path) => Client::connect_unix(&path),
            Err(_) => {
                let size = env_size("VGPU_SHM_SIZE", DEFAULT_SHM);
                let mut t = crate::drm::DrmTransport::open(size)
                    .map_err(|e| CallError::new(CuResult::CUDA_ERROR_NO_DEVICE, format!("VGPU_SOCKET is not set and no virtio-gpu compute device was usable: {e}")))?;
                let mut ring = None;
                if ring_wanted() {
                    let sq = env_size("VGPU_RING_SIZE", ring::DEFAULT_SQ as usize) as u32;
                    match t.attach_ring(sq, 1).map_err(|e| CallError::new(CuResult::CUDA_ERROR_NO_DEVICE, e.to_string()))? {
                        (Reply::Empty, Some((p, n, kick))) => {
                            // SAFETY: the transport keeps the ring blob mapped
                            // for its life, which is the client's; blob
                            // mappings are page-aligned.
                            ring = Some(unsafe { RingClient::new(p, n, sq, Box::new(kick)) });
                        }
                        (r, _) => no_ring(&r),
                    }
                }
                let mut c = Client::with_transport(Box::new(t));
                c.ring = ring;
                Ok(c)
            }
        }
    }

    /// Connects to a tenant socket: registers the staging buffer and, unless
    /// `VGPU_RING=0`, attaches a command ring.
    pub fn connect_unix(path: &str) -> CallResult<Client> {
        let mut t = UnixTransport::connect(path).map_err(|e| CallError::new(CuResult::CUDA_ERROR_NO_DEVICE, format!("{path}: {e}")))?;
        let size = env_size("VGPU_SHM_SIZE", DEFAULT_SHM);
        let lost = |e: TransportError| CallError::new(CuResult::CUDA_ERROR_NO_DEVICE, e.to_string());
        if size > 0 {
            match t.register_shared(0, size, 0).map_err(lost)? {
                Reply::Empty => {}
                Reply::Error(code, msg) => return Err(CallError::new(code, msg)),
                _ => return Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, "unexpected reply to RegisterShm")),
            }
        }
        let mut ring = None;
        // Without a staging buffer copies travel inline on the socket,
        // outside the ring's stream order: no ring then.
        if ring_wanted() && size > 0 {
            let sq = env_size("VGPU_RING_SIZE", ring::DEFAULT_SQ as usize) as u32;
            // SAFETY: eventfd with no memory arguments; checked below.
            let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if efd < 0 {
                return Err(CallError::new(CuResult::CUDA_ERROR_OPERATING_SYSTEM, format!("eventfd: {}", std::io::Error::last_os_error())));
            }
            // SAFETY: a fresh descriptor we own.
            let efd = unsafe { OwnedFd::from_raw_fd(efd) };
            match t.attach_ring(sq, &efd, 0).map_err(lost)? {
                (Reply::Empty, Some((p, n))) => {
                    // SAFETY: the transport keeps the mapping for its life,
                    // which the client's; memfd mappings are page-aligned.
                    ring = Some(unsafe { RingClient::new(p, n, sq, Box::new(EventFdKick(efd, t.socket_clone().map_err(lost)?))) });
                }
                (r, _) => no_ring(&r),
            }
        }
        let staging = t.shared().filter(|s| !s.is_empty()).map(|s| Staging { ptr: s.as_mut_ptr(), len: s.len(), slot_seq: vec![0; (s.len() / SLOT).max(1)], next: 0 });
        Ok(Client {
            t: Mutex::new(Box::new(t)),
            seq: AtomicU32::new(1),
            broken: AtomicBool::new(false),
            ring,
            staging: staging.map(Mutex::new),
            pinned: Mutex::new(BTreeMap::new()),
            sticky: Mutex::default(),
            any_sticky: AtomicBool::new(false),
            fatal: Mutex::new(None),
            registered: Mutex::default(),
        })
    }

    pub fn with_transport(mut t: Box<dyn Transport>) -> Client {
        let staging = t.shared().filter(|s| !s.is_empty()).map(|s| Staging { ptr: s.as_mut_ptr(), len: s.len(), slot_seq: vec![0; (s.len() / SLOT).max(1)], next: 0 });
        Client {
            t: Mutex::new(t),
            seq: AtomicU32::new(1),
            broken: AtomicBool::new(false),
            ring: None,
            staging: staging.map(Mutex::new),
            pinned: Mutex::new(BTreeMap::new()),
            sticky: Mutex::default(),
            any_sticky: AtomicBool::new(false),
            fatal: Mutex::new(None),
            registered: Mutex::default(),
        }
    }

    /// Whether the device's side of this connection is gone.
    pub fn is_lost(&self) -> bool {
        self.broken.load(Ordering::Acquire) || self.ring.as_ref().is_some_and(|r| !r.alive())
    }

    /// `e` as the caller sees it: a sticky error is remembered, and a lost
    /// connection after one reports that error, as CUDA reports a fault
    /// from every call of the process that met it.
    pub fn fatal(&self, e: CallError) -> CallError {
        let mut f = lock(&self.fatal);
        if e.code.is_sticky() {
            if f.is_none() {
                *f = Some(e.clone());
            }
            return e;
        }
        match &*f {
            // Only a lost connection: a device that refuses (quarantine, a
            // deleted tenant) says so itself.
            Some(first) if e.code == CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE && self.is_lost() => first.clone(),
            _ => e,
        }
    }

    pub fn ring(&self) -> Option<&RingClient> {
        self.ring.as_ref()
    }

    fn lost(&self, e: TransportError) -> CallError {
        self.broken.store(true, Ordering::Release);
        let lost = matches!(e, TransportError::Io(_));
        let msg = if lost { format!("connection to the vGPU was lost: {e}") } else { e.to_string() };
        CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, msg)
    }

    /// One call, answered. A broken connection makes this and every later
    /// call fail with CUDA_ERROR_DEVICE_UNAVAILABLE.
    pub fn call(&self, req: Request) -> CallResult<Reply> {
        if self.broken.load(Ordering::Acquire) {
            return Err(CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "connection to the vGPU was lost"));
        }
        let reply = match &self.ring {
            Some(r) if ring_eligible(&req) && RingClient::fits(MsgHeader::SIZE + 64 + payload_hint(&req)) => r.call(&req)?,
            ring => {
                if let Some(r) = ring {
                    // The worker must have seen what this process queued.
                    r.wait_consumed()?;
                }
                let seq = self.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
                let mut t = lock(&self.t);
                t.call(&req, seq).map_err(|e| self.lost(e))?
            }
        };
        match reply {
            Reply::Error(code, msg) => Err(CallError::new(code, msg)),
            r => Ok(r),
        }
    }

    /// Enqueues stream work on the ring without waiting; returns its entry.
    /// Without a ring the work runs now, as a round trip (entry 0).
    pub fn enqueue(&self, req: Request) -> CallResult<u64> {
        match &self.ring {
            Some(r) => Ok(r.submit(&req, false)?.0),
            None => self.empty(req).map(|_| 0),
        }
    }

    /// Waits for ring entry `seq`, then reports any asynchronous error.
    pub fn wait(&self, seq: u64) -> CallResult<()> {
        if let Some(r) = &self.ring {
            r.wait(seq)?;
        }
        self.check_async()
    }

    /// The asynchronous error reported since the last check, if any. A
    /// sticky one (a kernel fault) is also kept for its context, which
    /// then reports it from every synchronising call.
    pub fn check_async(&self) -> CallResult<()> {
        match self.ring.as_ref().and_then(|r| r.take_error()) {
            Some((e, ctx)) => {
                if ctx != 0 && e.code.is_sticky() {
                    lock(&self.sticky).insert(ctx, e.clone());
                    self.any_sticky.store(true, Ordering::Release);
                }
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// The sticky error of context `ctx`, if one of its kernels faulted.
    pub fn sticky(&self, ctx: u32) -> CallResult<()> {
        if !self.any_sticky.load(Ordering::Acquire) {
            return Ok(());
        }
        match lock(&self.sticky).get(&ctx) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Forgets a destroyed context's sticky error.
    pub fn forget(&self, ctx: u32) {
        lock(&self.sticky).remove(&ctx);
    }

    pub fn is_done(&self, seq: u64) -> bool {
        self.ring.as_ref().is_none_or(|r| r.is_done(seq))
    }

    pub fn handle(&self, req: Request) -> CallResult<u32> {
        match self.call(req)? {
            Reply::Handle(h) => Ok(h),
            r => Err(unexpected(r)),
        }
    }

    pub fn empty(&self, req: Request) -> CallResult<()> {
        match self.call(req)? {
            Reply::Empty => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// The pinned or registered region holding `[p, p+n)`, if any:
    /// (location, id, offset).
    fn pinned_at(&self, p: usize, n: usize) -> Option<(DataLoc, u32, u64)> {
        {
            let m = lock(&self.pinned);
            if let Some((&start, r)) = m.range(..=p).next_back() {
                if p + n <= start + r.len {
                    return Some((r.loc, r.id, (p - start) as u64));
                }
            }
        }
        let m = lock(&self.registered);
        let (&start, &(len, shared)) = m.range(..=p).next_back()?;
        let (loc, id) = shared?;
        (p + n <= start + len).then_some((loc, id, (p - start) as u64))
    }

    /// The pinned allocation or registered range holding address `p`:
    /// (start, length, whether it was registered rather than allocated).
    pub fn host_range(&self, p: usize) -> Option<(usize, usize, bool)> {
        if let Some((&start, r)) = lock(&self.pinned).range(..=p).next_back() {
            if p < start + r.len {
                return Some((start, r.len, false));
            }
        }
        let m = lock(&self.registered);
        let (&start, &(len, _)) = m.range(..=p).next_back()?;
        (p < start + len).then_some((start, len, true))
    }

    /// Registers `[p, p+n)` (cuMemHostRegister): its pages are re-backed in
    /// place by memory shared with the worker, so copies from and to it
    /// are one copy by the worker. Memory that cannot be (file mappings,
    /// a guest) stays registered as pageable: copies from it are staged.
    pub fn register_host(&self, p: *mut u8, n: usize) -> CallResult<()> {
        let page = 4096usize;
        let start = (p as usize) / page * page;
        let end = (p as usize + n).next_multiple_of(page);
        {
            let m = lock(&self.registered);
            if m.range(..end).next_back().is_some_and(|(s, (l, _))| s + l > start) {
                return Err(CallError::new(CuResult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "the range overlaps a registered one"));
            }
        }
        let shared = {
            let mut t = lock(&self.t);
            if let Some(r) = &self.ring {
                r.wait_consumed()?;
            }
            let seq = self.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            t.register_host(start as *mut u8, end - start, seq)?
        };
        lock(&self.registered).insert(start, (end - start, shared));
        Ok(())
    }

    /// Unregisters the range registered at `p` (cuMemHostUnregister).
    pub fn unregister_host(&self, p: *mut u8) -> CallResult<()> {
        let start = (p as usize) / 4096 * 4096;
        let Some((len, shared)) = lock(&self.registered).remove(&start) else {
            return Err(CallError::new(CuResult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "not the start of a registered range"));
        };
        let Some((_, id)) = shared else { return Ok(()) };
        if let Some(r) = &self.ring {
            r.wait_consumed()?;
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        lock(&self.t).unregister_host(start as *mut u8, len, id, seq)
    }

    /// Allocates `size` bytes of pinned host memory shared with the worker.
    pub fn alloc_pinned(&self, size: usize) -> CallResult<*mut u8> {
        let (p, loc, id) = {
            let mut t = lock(&self.t);
            if let Some(r) = &self.ring {
                r.wait_consumed()?;
            }
            let seq = self.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            t.alloc_pinned(size, seq)?
        };
        lock(&self.pinned).insert(p as usize, Pinned { len: size, loc, id });
        Ok(p)
    }

    /// Frees pinned memory from [`Client::alloc_pinned`]; false if `p` is
    /// not the start of one.
    pub fn free_pinned(&self, p: *mut u8) -> CallResult<bool> {
        let Some(r) = lock(&self.pinned).remove(&(p as usize)) else { return Ok(false) };
        // As CUDA's cuMemFreeHost, this synchronises: no queued copy
        // outlives the memory it reads or writes.
        if let Some(ring) = &self.ring {
            ring.wait_all_done()?;
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        lock(&self.t).free_pinned(p, r.len, r.id, seq)?;
        Ok(true)
    }

    /// Host to device: from pinned memory one entry the worker copies
    /// straight from it; from pageable memory in chunks through the staging
    /// buffer. Returns the last entry; the copy is done once it completes
    /// (the source may be reused at return for pageable memory).
    pub fn htod(&self, ctx: u32, stream: u32, dst: u64, src: &[u8]) -> CallResult<u64> {
        if let Some((loc, id, off)) = self.pinned_at(src.as_ptr() as usize, src.len()) {
            return self.enqueue(Request::MemcpyHtoD(MemcpyHtoDReq { ctx, stream, dst, size: src.len() as u64, loc: loc as u32, blob: id, shm_offset: off }, Vec::new()));
        }
        let (loc, id) = lock(&self.t).shared_loc();
        let Some(staging) = &self.staging else {
            for (i, part) in src.chunks(MAX_INLINE_DATA as usize).enumerate() {
                let at = dst + (i as u64) * MAX_INLINE_DATA;
                self.empty(Request::MemcpyHtoD(MemcpyHtoDReq { ctx, stream, dst: at, size: part.len() as u64, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 }, part.to_vec()))?;
            }
            return Ok(0);
        };
        let mut s = lock(staging);
        let chunk = if self.ring.is_some() { SLOT.min(s.len) } else { s.len };
        let (_, step) = staging::place(0, chunk);
        let mut last = 0;
        for (i, part) in src.chunks(step).enumerate() {
            let slot = if self.ring.is_some() { s.next } else { 0 };
            s.next = (s.next + 1) % s.slot_seq.len();
            if let Some(r) = &self.ring {
                r.wait(s.slot_seq[slot])?;
            }
            let off = slot * chunk + staging::place(part.as_ptr() as usize, chunk).0;
            // SAFETY: [off, off+len) lies inside the staging slot (its place
            // plus `step` bytes fit in it), which no entry in flight reads.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), s.ptr.add(off), part.len()) };
            let req = MemcpyHtoDReq { ctx, stream, dst: dst + (i * step) as u64, size: part.len() as u64, loc: loc as u32, blob: id, shm_offset: off as u64 };
            last = self.enqueue(Request::MemcpyHtoD(req, Vec::new()))?;
            s.slot_seq[slot] = last;
        }
        Ok(last)
    }

    /// Device to host into pinned memory: one entry, returned (the copy is
    /// done once it completes). Into pageable memory: pipelined through the
    /// staging buffer, done when this returns (entry 0).
    pub fn dtoh(&self, ctx: u32, stream: u32, dst: &mut [u8], src: u64) -> CallResult<u64> {
        if let Some((loc, id, off)) = self.pinned_at(dst.as_ptr() as usize, dst.len()) {
            return self.enqueue(Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream, src, size: dst.len() as u64, loc: loc as u32, blob: id, shm_offset: off }));
        }
        let (loc, id) = lock(&self.t).shared_loc();
        let Some(staging) = &self.staging else {
            for (i, part) in dst.chunks_mut(MAX_INLINE_DATA as usize).enumerate() {
                let at = src + (i as u64) * MAX_INLINE_DATA;
                match self.call(Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream, src: at, size: part.len() as u64, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 }))? {
                    Reply::Data(d) if d.len() == part.len() => part.copy_from_slice(&d),
                    r => return Err(unexpected(r)),
                }
            }
            return Ok(0);
        };
        let mut s = lock(staging);
        let Some(ring) = &self.ring else {
            // Round trips through the whole staging buffer.
            for (i, part) in dst.chunks_mut(s.len).enumerate() {
                let req = MemcpyDtoHReq { ctx, stream, src: src + (i * s.len) as u64, size: part.len() as u64, loc: loc as u32, blob: id, shm_offset: 0 };
                match self.call(Request::MemcpyDtoH(req))? {
                    Reply::Data(d) if d.is_empty() => {}
                    r => return Err(unexpected(r)),
                }
                // SAFETY: the worker wrote `part.len()` bytes at the start
                // of the staging mapping and the call is complete.
                unsafe { std::ptr::copy_nonoverlapping(s.ptr, part.as_mut_ptr(), part.len()) };
            }
            return Ok(0);
        };
        let chunk = SLOT.min(s.len);
        let (_, step) = staging::place(0, chunk);
        let slots = s.slot_seq.len();
        let n = dst.len().div_ceil(step);
        // (piece, its offset in the staging mapping, its entry)
        let mut queued: std::collections::VecDeque<(usize, usize, u64)> = std::collections::VecDeque::new();
        let mut i = 0;
        while i < n || !queued.is_empty() {
            if i < n && queued.len() < slots {
                let slot = s.next;
                s.next = (s.next + 1) % slots;
                ring.wait(s.slot_seq[slot])?;
                let len = step.min(dst.len() - i * step);
                let off = slot * chunk + staging::place(dst.as_ptr() as usize + i * step, chunk).0;
                let req = MemcpyDtoHReq { ctx, stream, src: src + (i * step) as u64, size: len as u64, loc: loc as u32, blob: id, shm_offset: off as u64 };
                let seq = self.enqueue(Request::MemcpyDtoH(req))?;
                s.slot_seq[slot] = seq;
                queued.push_back((i, off, seq));
                i += 1;
                continue;
            }
            let Some((k, off, seq)) = queued.pop_front() else { break };
            self.wait(seq)?;
            let len = step.min(dst.len() - k * step);
            // SAFETY: the worker wrote `len` bytes at `off` (inside its
            // slot) and entry `seq` completed; the slot is not reused
            // before we copy.
            unsafe { std::ptr::copy_nonoverlapping(s.ptr.add(off), dst.as_mut_ptr().add(k * step), len) };
        }
        Ok(0)
    }

    pub fn device_info(&self) -> CallResult<DeviceInfo> {
        match self.call(Request::GetDeviceInfo)? {
            Reply::DeviceInfo(d) => Ok(d),
            r => Err(unexpected(r)),
        }
    }

    /// The device's `CUdevice_attribute` table, as the worker answers it.
    pub fn device_attributes(&self) -> CallResult<Vec<i32>> {
        match self.call(Request::GetDeviceAttributes)? {
            Reply::Attributes(a) => Ok(a),
            r => Err(unexpected(r)),
        }
    }

    pub fn tenant_info(&self) -> CallResult<TenantInfo> {
        match self.call(Request::GetTenantInfo)? {
            Reply::TenantInfo(t) => Ok(t),
            r => Err(unexpected(r)),
        }
    }

    /// The tenant's processes holding contexts on the device, with the
    /// memory each holds (the pid each gave when it made its contexts).
    pub fn processes(&self) -> CallResult<Vec<ProcessInfo>> {
        match self.call(Request::GetProcesses)? {
            Reply::Processes(v) => Ok(v),
            r => Err(unexpected(r)),
        }
    }

    /// What this connection cost: transport messages, ring entries, kicks.
    pub fn conn_stats(&self) -> CallResult<ConnStats> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if let Some(r) = &self.ring {
            r.wait_consumed()?;
        }
        let mut s = match lock(&self.t).call(&Request::GetConnStats, seq).map_err(|e| self.lost(e))? {
            Reply::ConnStats(s) => s,
            Reply::Error(code, msg) => return Err(CallError::new(code, msg)),
            r => return Err(unexpected(r)),
        };
        if let Some(Reply::ConnStats(r)) = self.ring.as_ref().and_then(|r| r.call(&Request::GetConnStats).ok()) {
            s.ring_entries = s.ring_entries.max(r.ring_entries);
            s.kicks = s.kicks.max(r.kicks);
        }
        Ok(s)
    }
}

/// A request's variable payload length, to decide whether it fits a ring entry.
fn payload_hint(req: &Request) -> usize {
    match req {
        Request::LaunchKernel(_, p) => p.len(),
        Request::ModuleGetFunction(_, n) | Request::ModuleGetGlobal(_, n) => n.len(),
        _ => 0,
    }
}

fn unexpected(r: Reply) -> CallError {
    CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))
}
