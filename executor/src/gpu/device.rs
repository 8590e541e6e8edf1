//! The virtio-gpu compute device model for one VM tenant: capsets, compute
//! contexts, GUEST blob resources backed by guest RAM, and SUBMIT_3D
//! carrying compute messages that the device worker's service executes.
//!
//! It works on one command at a time and returns the response bytes; the
//! vhost-user backend moves them between the virtqueues and this model.
//! Nothing a guest sends can make it panic or reach memory outside guest
//! RAM: every command is decoded with checked lengths, every blob entry is
//! checked against the guest's memory regions, and every copy through a
//! blob is limited to the blobs attached to the submitting context.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use virtio_gpu_compute::capset::CapsetInfo;
use virtio_gpu_compute::virtio_gpu::*;
use virtio_gpu_compute::{CuResult, Opcode, Reply, Request, Wire, MAX_PAYLOAD, VERSION};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::worker::conn::CONN_HOST_BYTES;
use crate::worker::engine::{Engine, Ring, RingMem};
use crate::worker::service::{host_cost, BlobAccess, Charge, Conn, DeviceService, HostBudget, Pieces, Tenant};

/// How the device presents itself.
#[derive(Debug, Clone)]
pub struct GpuConfig {
    /// Capset id of the compute context type (DESIGN §4: 24 by default, ≤ 31).
    pub capset_id: u32,
    /// 1 for guests before Linux 6.4 (which refuse 0), 0 for headless.
    pub num_scanouts: u32,
    /// Largest blob one resource may be.
    pub max_blob_bytes: u64,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig { capset_id: virtio_gpu_compute::capset::DEFAULT_CAPSET_ID, num_scanouts: 1, max_blob_bytes: 1 << 30 }
    }
}

/// Most blob resources, blob entries in all, and contexts one device keeps:
/// a guest cannot grow the worker's memory without bound.
pub const MAX_RESOURCES: usize = 16384;
pub const MAX_TOTAL_ENTRIES: usize = 1 << 20;
pub const MAX_CONTEXTS: usize = 1024;

/// A GUEST blob: runs of guest-physical memory, each inside one region.
struct Blob {
    entries: Vec<(u64, u64)>,
    size: u64,
    /// Held by every copy through the blob while it runs: RESOURCE_UNREF
    /// answers only once the last one is gone (the guest frees the pages
    /// on that answer).
    lease: Arc<()>,
    /// Its table entry and entries, on the tenant's host budget.
    _charge: Charge,
}

type Resources = Arc<RwLock<HashMap<u32, Blob>>>;

/// The blobs one context may copy through: those attached to it.
struct CtxBlobs {
    mem: RwLock<GuestMemoryMmap>,
    resources: Resources,
    attached: RwLock<HashSet<u32>>,
    /// Each attachment costs the tenant's host budget
    /// [`host_cost::ATTACHMENT`] while it lasts.
    budget: Arc<HostBudget>,
}

impl CtxBlobs {
    /// Attaches blob `res` (once: attaching it again costs nothing).
    fn attach(&self, res: u32) -> Result<(), String> {
        let mut set = self.attached.write().unwrap_or_else(|e| e.into_inner());
        if set.contains(&res) {
            return Ok(());
        }
        if let Err(Reply::Error(_, why)) = self.budget.reserve(host_cost::ATTACHMENT, "a blob attachment") {
            return Err(why);
        }
        set.insert(res);
        Ok(())
    }

    /// Detaches blob `res`, if it was attached.
    fn detach(&self, res: u32) {
        let mut set = self.attached.write().unwrap_or_else(|e| e.into_inner());
        if set.remove(&res) {
            self.budget.release(host_cost::ATTACHMENT);
            // The set's memory follows it down.
            if set.capacity() > 64 && set.len() < set.capacity() / 4 {
                set.shrink_to_fit();
            }
        }
    }
}

impl Drop for CtxBlobs {
    fn drop(&mut self) {
        let n = self.attached.get_mut().map(|s| s.len()).unwrap_or_else(|e| e.into_inner().len());
        self.budget.release(n as u64 * host_cost::ATTACHMENT);
    }
}

impl BlobAccess for CtxBlobs {
    fn pieces(&self, res: u32, off: u64, len: u64) -> Result<Pieces, String> {
        self.runs(res, off, len, true)
    }
}

impl CtxBlobs {
    /// The runs of guest memory behind `[off, off+len)` of blob `res`,
    /// holding the blob's lease while they live when `leased`.
    fn runs(&self, res: u32, off: u64, len: u64, leased: bool) -> Result<Pieces, String> {
        if !self.attached.read().unwrap_or_else(|e| e.into_inner()).contains(&res) {
            return Err(format!("blob {res} is not attached to this context"));
        }
        let table = self.resources.read().unwrap_or_else(|e| e.into_inner());
        let blob = table.get(&res).ok_or_else(|| format!("no blob {res}"))?;
        let end = off.checked_add(len).filter(|e| *e <= blob.size).ok_or_else(|| format!("range {off}+{len} exceeds blob {res} of {} bytes", blob.size))?;
        // One snapshot of guest memory for every run: its regions stay
        // mapped as long as the pieces live, whatever memory table the VMM
        // sends meanwhile.
        let mem = self.mem.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut out = Vec::new();
        let mut pos = 0u64;
        for &(gpa, n) in &blob.entries {
            let (a, b) = (pos.max(off), (pos + n).min(end));
            if a < b {
                let at = GuestAddress(gpa + (a - pos));
                let slice = mem.get_slice(at, (b - a) as usize).map_err(|e| format!("blob {res}: {e}"))?;
                out.push((slice.ptr_guard_mut().as_ptr(), (b - a) as usize));
            }
            pos += n;
            if pos >= end {
                break;
            }
        }
        let lease = leased.then(|| blob.lease.clone());
        Ok(Pieces { runs: out, _keep: Box::new((mem, lease)) })
    }
}

struct GpuCtx {
    /// False for a context without our capset (the kernel's implicit
    /// context for display clients): it may hold resources, not compute.
    compute: bool,
    conn: Arc<Mutex<Conn>>,
    /// The context's command ring, the blob it lives in, and its host
    /// charge, once attached.
    ring: Option<(u32, Arc<Ring>, Charge)>,
    /// SUBMIT_3D commands this context sent (one per guest EXECBUFFER).
    submits: u64,
    blobs: Arc<CtxBlobs>,
    /// Last fence signalled on each ring of this context.
    fences: HashMap<u8, u64>,
    /// The context on the tenant's host budget, as a connection is.
    _charge: Charge,
}

/// A rejected command: the response type and why (logged).
struct Refusal(u32, String);

type Res<T> = Result<T, Refusal>;

fn refuse<T>(ty: u32, why: impl Into<String>) -> Res<T> {
    Err(Refusal(ty, why.into()))
}

/// What an error reply says.
fn reply_text(r: Reply) -> String {
    match r {
        Reply::Error(_, why) => why,
        other => format!("{other:?}"),
    }
}

pub struct GpuDevice {
    cfg: GpuConfig,
    mem: GuestMemoryMmap,
    svc: Arc<DeviceService>,
    /// The stream engine that serves the contexts' command rings (none: no
    /// rings).
    engine: Option<Arc<Engine>>,
    tenant: Arc<Tenant>,
    resources: Resources,
    /// 2D resources of the compatibility scanout (the framebuffer console).
    display: HashSet<u32>,
    ctxs: HashMap<u32, GpuCtx>,
    /// Commands refused so far (for metrics and tests).
    pub refused: u64,
}

impl GpuDevice {
    pub fn new(cfg: GpuConfig, mem: GuestMemoryMmap, svc: Arc<DeviceService>, engine: Option<Arc<Engine>>, tenant: Arc<Tenant>) -> GpuDevice {
        GpuDevice { cfg, mem, svc, engine, tenant, resources: Arc::new(RwLock::new(HashMap::new())), display: HashSet::new(), ctxs: HashMap::new(), refused: 0 }
    }

    /// Guest memory changed (a new vhost-user memory table): blobs keep
    /// their guest addresses and resolve them in the new mapping.
    pub fn set_memory(&mut self, mem: GuestMemoryMmap) {
        for c in self.ctxs.values() {
            *c.blobs.mem.write().unwrap_or_else(|e| e.into_inner()) = mem.clone();
        }
        self.mem = mem;
    }

    /// The guest memory the device resolves blobs in.
    pub fn memory(&self) -> GuestMemoryMmap {
        self.mem.clone()
    }

    /// The device config space.
    pub fn config_space(&self) -> [u8; 16] {
        config_space(self.cfg.num_scanouts)
    }

    /// Features the device offers (besides VERSION_1).
    pub fn features() -> u64 {
        F_VIRGL | F_RESOURCE_BLOB | F_CONTEXT_INIT
    }

    /// The capset payload: magic, protocol version, the tenant's limits.
    fn capset(&self) -> Vec<u8> {
        let mut v = Vec::new();
        CapsetInfo { magic: virtio_gpu_compute::MAGIC, version: VERSION as u32, quota: self.tenant.quota(), max_payload: MAX_PAYLOAD, reserved: 0 }.put(&mut v);
        v
    }

    /// Handles one command; returns the response to write back. Every
    /// command gets one: nothing is dropped.
    pub fn process(&mut self, cmd: &[u8]) -> Vec<u8> {
        let (hdr, c) = match decode_command(cmd) {
            Ok(x) => x,
            Err(e) => {
                self.refused += 1;
                if self.log_refusal() {
                    tracing::warn!(tenant = %self.tenant.name, refused = self.refused, "bad virtio-gpu command: {e}");
                }
                // Echo what can be read of the header; the driver matches
                // responses to its buffers, not to their contents.
                let h = CtrlHdr::get(&mut virtio_gpu_compute::Reader::new(cmd)).unwrap_or(CtrlHdr { ty: 0, flags: 0, fence_id: 0, ctx_id: 0, ring_idx: 0, padding: [0; 3] });
                let mut out = Vec::new();
                h.response(ty::RESP_ERR_UNSPEC).put(&mut out);
                return out;
            }
        };
        // A deleted tenant's device answers nothing but errors, from the
        // moment it is revoked; its contexts go when the VMM disconnects.
        let r = if self.tenant.is_revoked() { refuse(ty::RESP_ERR_UNSPEC, format!("tenant {} was deleted", self.tenant.name)) } else { self.dispatch(&hdr, c) };
        match r {
            Ok(body) => body,
            Err(Refusal(t, why)) => {
                self.refused += 1;
                if self.log_refusal() {
                    tracing::warn!(tenant = %self.tenant.name, refused = self.refused, cmd = format_args!("{:#x}", hdr.ty), "virtio-gpu command refused: {why}");
                }
                let mut out = Vec::new();
                hdr.response(t).put(&mut out);
                out
            }
        }
    }

    /// The first refusals, then every 1024th: a guest cannot flood the log.
    fn log_refusal(&self) -> bool {
        self.refused <= 16 || self.refused.is_multiple_of(1024)
    }

    fn ok(hdr: &CtrlHdr) -> Vec<u8> {
        let mut out = Vec::new();
        hdr.response(ty::RESP_OK_NODATA).put(&mut out);
        out
    }

    fn dispatch(&mut self, hdr: &CtrlHdr, c: GpuCommand) -> Res<Vec<u8>> {
        match c {
            GpuCommand::GetDisplayInfo => {
                let mut out = Vec::new();
                hdr.response(ty::RESP_OK_DISPLAY_INFO).put(&mut out);
                for i in 0..MAX_SCANOUTS {
                    let on = (i as u32) < self.cfg.num_scanouts;
                    let r = if on { Rect { x: 0, y: 0, width: 1024, height: 768 } } else { Rect { x: 0, y: 0, width: 0, height: 0 } };
                    r.put(&mut out);
                    (on as u32).put(&mut out);
                    0u32.put(&mut out);
                }
                Ok(out)
            }
            GpuCommand::GetCapsetInfo(r) => {
                if r.capset_index != 0 {
                    return refuse(ty::RESP_ERR_INVALID_PARAMETER, format!("capset index {} (the device has one)", r.capset_index));
                }
                let mut out = Vec::new();
                hdr.response(ty::RESP_OK_CAPSET_INFO).put(&mut out);
                CapsetInfoResp { capset_id: self.cfg.capset_id, capset_max_version: VERSION as u32, capset_max_size: CapsetInfo::SIZE as u32, padding: 0 }.put(&mut out);
                Ok(out)
            }
            GpuCommand::GetCapset(r) => {
                if r.capset_id != self.cfg.capset_id || r.capset_version > VERSION as u32 {
                    return refuse(ty::RESP_ERR_INVALID_PARAMETER, format!("capset {} version {}", r.capset_id, r.capset_version));
                }
                let mut out = Vec::new();
                hdr.response(ty::RESP_OK_CAPSET).put(&mut out);
                out.extend_from_slice(&self.capset());
                Ok(out)
            }
            GpuCommand::CtxCreate(b) => {
                let capset = b.context_init & CTX_CAPSET_ID_MASK;
                // 0 is the kernel's default context, which it creates by
                // itself for display clients: allowed, without compute.
                // Any other foreign context type is refused.
                if capset != self.cfg.capset_id && capset != 0 {
                    return refuse(ty::RESP_ERR_INVALID_PARAMETER, format!("context type {capset} is not this device's compute capset {}", self.cfg.capset_id));
                }
                if hdr.ctx_id == 0 || self.ctxs.contains_key(&hdr.ctx_id) {
                    return refuse(ty::RESP_ERR_INVALID_CONTEXT_ID, format!("context id {} is in use or invalid", hdr.ctx_id));
                }
                if self.ctxs.len() >= MAX_CONTEXTS {
                    return refuse(ty::RESP_ERR_OUT_OF_MEMORY, format!("at most {MAX_CONTEXTS} contexts"));
                }
                let charge = match Charge::take(&self.tenant.host, CONN_HOST_BYTES, "a virtio-gpu context") {
                    Ok(c) => c,
                    Err(r) => return refuse(ty::RESP_ERR_OUT_OF_MEMORY, reply_text(r)),
                };
                let blobs = Arc::new(CtxBlobs { mem: RwLock::new(self.mem.clone()), resources: self.resources.clone(), attached: RwLock::new(HashSet::new()), budget: self.tenant.host.clone() });
                let conn = Arc::new(Mutex::new(Conn { blobs: Some(blobs.clone()), ..Default::default() }));
                self.ctxs.insert(hdr.ctx_id, GpuCtx { compute: capset != 0, conn, ring: None, submits: 0, blobs, fences: HashMap::new(), _charge: charge });
                Ok(Self::ok(hdr))
            }
            GpuCommand::CtxDestroy => {
                let Some(c) = self.ctxs.remove(&hdr.ctx_id) else { return refuse(ty::RESP_ERR_INVALID_CONTEXT_ID, format!("no context {}", hdr.ctx_id)) };
                // As a process exit: the context's device memory is freed
                // (and zeroed before anyone gets it again).
                Self::close_ctx(&self.svc, &self.tenant, c);
                Ok(Self::ok(hdr))
            }
            GpuCommand::CtxAttachResource(b) | GpuCommand::CtxDetachResource(b) => {
                let attach = hdr.ty == ty::CTX_ATTACH_RESOURCE;
                let Some(c) = self.ctxs.get_mut(&hdr.ctx_id) else { return refuse(ty::RESP_ERR_INVALID_CONTEXT_ID, format!("no context {}", hdr.ctx_id)) };
                if self.display.contains(&b.resource_id) {
                    // Display resources carry no compute data: nothing to track.
                    return Ok(Self::ok(hdr));
                }
                if !self.resources.read().unwrap_or_else(|e| e.into_inner()).contains_key(&b.resource_id) {
                    return refuse(ty::RESP_ERR_INVALID_RESOURCE_ID, format!("no resource {}", b.resource_id));
                }
                if attach {
                    if let Err(why) = c.blobs.attach(b.resource_id) {
                        return refuse(ty::RESP_ERR_OUT_OF_MEMORY, why);
                    }
                } else {
                    c.blobs.detach(b.resource_id);
                    Self::drop_ring_in(c, b.resource_id);
                }
                Ok(Self::ok(hdr))
            }
            GpuCommand::ResourceCreateBlob(b, entries) => {
                self.create_blob(&b, &entries)?;
                Ok(Self::ok(hdr))
            }
            GpuCommand::ResourceUnref(b) => {
                if self.display.remove(&b.resource_id) {
                    return Ok(Self::ok(hdr));
                }
                let removed = self.resources.write().unwrap_or_else(|e| e.into_inner()).remove(&b.resource_id);
                let Some(blob) = removed else { return refuse(ty::RESP_ERR_INVALID_RESOURCE_ID, format!("no resource {}", b.resource_id)) };
                for c in self.ctxs.values_mut() {
                    c.blobs.detach(b.resource_id);
                    Self::drop_ring_in(c, b.resource_id);
                }
                // The guest frees the pages when it reads this answer: no
                // copy may still be writing them then. No new one starts
                // (the blob is gone from the table); those running are
                // bounded copies.
                Self::wait_for_copies(b.resource_id, &blob.lease);
                Ok(Self::ok(hdr))
            }
            GpuCommand::Submit3d(payload) => {
                self.submit(hdr, &payload)?;
                Ok(Self::ok(hdr))
            }
            GpuCommand::Create2d(b) => {
                let taken = b.resource_id == 0 || self.display.contains(&b.resource_id) || self.resources.read().unwrap_or_else(|e| e.into_inner()).contains_key(&b.resource_id);
                if taken {
                    return refuse(ty::RESP_ERR_INVALID_RESOURCE_ID, format!("resource id {} is in use or invalid", b.resource_id));
                }
                if self.display.len() >= 64 {
                    return refuse(ty::RESP_ERR_OUT_OF_MEMORY, "too many display resources");
                }
                self.display.insert(b.resource_id);
                Ok(Self::ok(hdr))
            }
            GpuCommand::Display2d(_) | GpuCommand::Cursor(_) => Ok(Self::ok(hdr)),
            GpuCommand::Unsupported(t) => refuse(ty::RESP_ERR_UNSPEC, format!("unsupported command type {t:#x}")),
        }
    }

    fn create_blob(&mut self, b: &CreateBlobBody, entries: &[MemEntry]) -> Res<()> {
        let bad = |why: String| refuse(ty::RESP_ERR_INVALID_PARAMETER, why);
        if b.blob_mem != BLOB_MEM_GUEST {
            return bad(format!("blob_mem {} (only GUEST blobs exist on this device)", b.blob_mem));
        }
        if b.blob_flags & !(BLOB_FLAG_USE_MAPPABLE | BLOB_FLAG_USE_SHAREABLE | BLOB_FLAG_USE_CROSS_DEVICE) != 0 {
            return bad(format!("unknown blob flags {:#x}", b.blob_flags));
        }
        if b.resource_id == 0 || self.display.contains(&b.resource_id) || self.resources.read().unwrap_or_else(|e| e.into_inner()).contains_key(&b.resource_id) {
            return refuse(ty::RESP_ERR_INVALID_RESOURCE_ID, format!("resource id {} is in use or invalid", b.resource_id));
        }
        if b.size == 0 || b.size > self.cfg.max_blob_bytes {
            return bad(format!("blob size {} (1..={})", b.size, self.cfg.max_blob_bytes));
        }
        if entries.is_empty() {
            return bad("a GUEST blob needs at least one memory entry".into());
        }
        {
            let table = self.resources.read().unwrap_or_else(|e| e.into_inner());
            let in_use: usize = table.values().map(|b| b.entries.len()).sum();
            if table.len() >= MAX_RESOURCES || in_use + entries.len() > MAX_TOTAL_ENTRIES {
                return refuse(ty::RESP_ERR_OUT_OF_MEMORY, format!("resource limits reached ({} blobs, {in_use} entries)", table.len()));
            }
        }
        let mut total = 0u64;
        let mut runs = Vec::with_capacity(entries.len());
        for e in entries {
            let len = e.length as u64;
            // Each entry must lie inside one guest RAM region: nothing
            // outside guest memory (MMIO holes, the VMM's own memory) can
            // be named.
            let inside = len > 0
                && self.mem.find_region(GuestAddress(e.addr)).is_some_and(|r| {
                    let start = r.start_addr().0;
                    e.addr.checked_add(len).is_some_and(|end| end <= start + r.len())
                });
            if !inside {
                return bad(format!("blob entry {:#x}+{len:#x} is not inside guest RAM", e.addr));
            }
            total += len;
            runs.push((e.addr, len));
        }
        if total != b.size {
            return bad(format!("blob entries cover {total} bytes, the blob is {}", b.size));
        }
        let cost = host_cost::BLOB + host_cost::BLOB_ENTRY * runs.len() as u64;
        let charge = match Charge::take(&self.tenant.host, cost, "a blob") {
            Ok(c) => c,
            Err(r) => return refuse(ty::RESP_ERR_OUT_OF_MEMORY, reply_text(r)),
        };
        self.resources.write().unwrap_or_else(|e| e.into_inner()).insert(b.resource_id, Blob { entries: runs, size: b.size, lease: Arc::new(()), _charge: charge });
        Ok(())
    }

    fn submit(&mut self, hdr: &CtrlHdr, payload: &[u8]) -> Res<()> {
        if hdr.flags & FLAG_INFO_RING_IDX != 0 && hdr.ring_idx >= MAX_RINGS {
            return refuse(ty::RESP_ERR_INVALID_PARAMETER, format!("ring_idx {} (at most {})", hdr.ring_idx, MAX_RINGS - 1));
        }
        let Some(c) = self.ctxs.get_mut(&hdr.ctx_id) else { return refuse(ty::RESP_ERR_INVALID_CONTEXT_ID, format!("no context {}", hdr.ctx_id)) };
        if !c.compute {
            return refuse(ty::RESP_ERR_INVALID_CONTEXT_ID, format!("context {} was not created with the compute capset", hdr.ctx_id));
        }
        c.submits += 1;
        let (sh, msg) = SubmitHeader::split(payload).or_else(|e| refuse(ty::RESP_ERR_INVALID_PARAMETER, format!("submit header: {e}")))?;
        let reply_pieces = c.blobs.pieces(sh.reply_blob, sh.reply_offset, sh.reply_capacity as u64).or_else(|e| refuse(ty::RESP_ERR_INVALID_PARAMETER, format!("reply buffer: {e}")))?;
        let (reply_pieces, _reply_mem) = (reply_pieces.runs.clone(), reply_pieces);
        let (op, seq, reply) = match Request::decode(msg) {
            Err(e) => {
                let h = virtio_gpu_compute::MsgHeader::decode(msg).ok();
                (h.map(|h| h.opcode()).unwrap_or(Opcode::Ping), h.map_or(0, |h| h.seq), Reply::error(e.cuda(), format!("bad compute message: {e}")))
            }
            Ok((h, Request::RegisterShm(_))) => (h.opcode(), h.seq, Reply::error(CuResult::CUDA_ERROR_NOT_SUPPORTED, "VM contexts move data through blobs, not shared buffers")),
            Ok((h, Request::AttachRing(b))) => (h.opcode(), h.seq, Self::attach_ring(&self.svc, self.engine.is_some(), &self.tenant, c, b.sq_size, b.blob)),
            Ok((h, Request::RingKick)) => {
                if let (Some((_, r, _)), Some(e)) = (&c.ring, &self.engine) {
                    r.kick(e);
                }
                (h.opcode(), h.seq, Reply::Empty)
            }
            Ok((h, Request::GetConnStats)) => (h.opcode(), h.seq, Reply::ConnStats(Ring::stats(c.ring.as_ref().map(|r| &*r.1), c.submits))),
            Ok((h, req)) => {
                let (svc, tenant) = (self.svc.clone(), self.tenant.clone());
                let conn = c.conn.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| svc.handle(&tenant, &conn, req)));
                (h.opcode(), h.seq, r.unwrap_or_else(|_| Reply::error(CuResult::CUDA_ERROR_UNKNOWN, "internal error")))
            }
        };
        let mut bytes = reply.encode(op, seq);
        if bytes.len() > sh.reply_capacity as usize {
            bytes = Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, format!("reply of {} bytes exceeds the reply buffer's {}", bytes.len(), sh.reply_capacity)).encode(op, seq);
            if bytes.len() > sh.reply_capacity as usize {
                bytes = Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, "").encode(op, seq);
            }
            if bytes.len() > sh.reply_capacity as usize {
                return refuse(ty::RESP_ERR_INVALID_PARAMETER, format!("reply buffer of {} bytes cannot hold a reply header", sh.reply_capacity));
            }
        }
        let mut src = &bytes[..];
        for (p, n) in reply_pieces {
            let k = n.min(src.len());
            // SAFETY: `p` is a run of guest RAM inside the reply blob, which
            // pieces() checked against the blob and the guest's regions;
            // the guest may write it meanwhile, so it is written volatile.
            let run = unsafe { vm_memory::VolatileSlice::new(p, k) };
            run.copy_from(&src[..k]);
            src = &src[k..];
            if src.is_empty() {
                break;
            }
        }
        if hdr.flags & FLAG_FENCE != 0 {
            // The work ran to completion above, so its fence is signalled
            // with this response.
            let ring = if hdr.flags & FLAG_INFO_RING_IDX != 0 { hdr.ring_idx } else { 0 };
            c.fences.insert(ring, hdr.fence_id);
        }
        Ok(())
    }

    /// The last fence signalled on (ctx, ring), if any.
    pub fn last_fence(&self, ctx: u32, ring: u8) -> Option<u64> {
        self.ctxs.get(&ctx).and_then(|c| c.fences.get(&ring).copied())
    }

    /// Contexts alive now.
    pub fn contexts(&self) -> usize {
        self.ctxs.len()
    }
}

impl GpuDevice {
    /// Attaches a context's command ring: the whole of blob `res`, which
    /// must be attached to the context and lie in guest RAM.
    fn attach_ring(svc: &Arc<DeviceService>, rings: bool, tenant: &Arc<Tenant>, c: &mut GpuCtx, sq_size: u32, res: u32) -> Reply {
        let bad = |why: String| Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, why);
        if c.ring.is_some() {
            return bad("the context already has a ring".into());
        }
        if !rings {
            return Reply::error(CuResult::CUDA_ERROR_NOT_SUPPORTED, "this device serves no command rings");
        }
        let size = virtio_gpu_compute::ring::region_size(sq_size) as u64;
        // The ring holds no lease: it is closed, and its memory revoked,
        // when the guest detaches or unrefs the blob.
        let pieces = match c.blobs.runs(res, 0, size, false) {
            Ok(p) => p,
            Err(e) => return bad(format!("ring blob: {e}")),
        };
        let charge = match Charge::take(&tenant.host, host_cost::RING + host_cost::RING_RUN * pieces.runs.len() as u64, "a command ring") {
            Ok(c) => c,
            Err(r) => return r,
        };
        let mem = match RingMem::new(pieces.runs.clone(), Box::new(pieces)) {
            Ok(m) => m,
            Err(e) => return bad(format!("ring blob: {e}")),
        };
        match Ring::new(svc.clone(), tenant.clone(), c.conn.clone(), mem, sq_size, None) {
            Ok(r) => {
                c.ring = Some((res, r, charge));
                Reply::Empty
            }
            Err(e) => bad(e),
        }
    }

    /// Closes the context's ring if it lives in blob `res`: from then on
    /// nothing reads or writes that memory.
    fn drop_ring_in(c: &mut GpuCtx, res: u32) {
        if c.ring.as_ref().is_some_and(|(r, _, _)| *r == res) {
            if let Some((_, ring, _charge)) = c.ring.take() {
                ring.close();
            }
        }
    }

    /// Waits until no copy holds blob `res`'s lease. Copies are bounded, so
    /// this ends; a slow one is logged, never skipped.
    fn wait_for_copies(res: u32, lease: &Arc<()>) {
        let start = std::time::Instant::now();
        let mut warned = false;
        while Arc::strong_count(lease) > 1 {
            if !warned && start.elapsed() > std::time::Duration::from_secs(5) {
                tracing::warn!(resource = res, "RESOURCE_UNREF waits for a copy through the blob that has run for over 5 s");
                warned = true;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    fn close_ctx(svc: &DeviceService, tenant: &Tenant, c: GpuCtx) {
        if let Some((_, r, _)) = &c.ring {
            r.close();
        }
        svc.disconnect(tenant, &mut c.conn.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

impl Drop for GpuDevice {
    fn drop(&mut self) {
        for (_, c) in self.ctxs.drain() {
            Self::close_ctx(&self.svc, &self.tenant, c);
        }
        // A device reset or the VM's end: the guest may reuse every blob's
        // pages once it is over. The blobs leave the table first, so no
        // copy can reach them from here on, not even one already past its
        // context's checks and waiting for a lane (contexts' work holds
        // the table, not this device); the copies already running through
        // them end, as at RESOURCE_UNREF.
        let gone: Vec<_> = self.resources.write().unwrap_or_else(|e| e.into_inner()).drain().collect();
        for (res, blob) in &gone {
            Self::wait_for_copies(*res, &blob.lease);
        }
    }
}
