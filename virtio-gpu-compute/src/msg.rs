//! Compute messages. A message is a [`MsgHeader`] followed by
//! `payload_len` bytes: the opcode's fixed body, then a variable trailer
//! whose length the body states exactly.

use crate::cuda::CuResult;
use crate::wire::{wire_struct, Reader, Wire};
use crate::WireError;

/// "VGPC" read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"VGPC");
/// Protocol version; bumped on any incompatible change.
pub const VERSION: u16 = 2;
/// Largest payload either side accepts (module images are the biggest).
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Largest inline copy; bigger copies go through the shared buffer.
pub const MAX_INLINE_DATA: u64 = 4 << 20;
/// Largest module image.
pub const MAX_IMAGE: u64 = 16 << 20;
/// Longest function name.
pub const MAX_NAME: u32 = 1024;
/// Largest kernel parameter buffer (CUDA's own limit is 4 KiB for most targets).
pub const MAX_PARAM_BYTES: u32 = 4096;
/// Most kernel parameters in one function.
pub const MAX_PARAMS: u32 = 512;
/// Longest error text in a reply.
pub const MAX_ERROR_TEXT: usize = 1024;
/// Most contexts one tenant holds on a device (the executor refuses more),
/// so most processes a `GetProcesses` reply lists.
pub const MAX_CONTEXTS: usize = 256;
/// Most nodes one graph holds.
pub const MAX_GRAPH_NODES: u32 = 1 << 16;
/// The default (legacy) stream handle.
pub const DEFAULT_STREAM: u32 = 0;

wire_struct! {
    /// Leads every request and reply.
    pub struct MsgHeader {
        pub magic: u32,
        pub version: u16,
        pub opcode: u16,
        /// Chosen by the requester, echoed in the reply.
        pub seq: u32,
        /// 0 in requests; a `CUresult` in replies.
        pub status: u32,
        pub payload_len: u32,
        /// Must be zero.
        pub reserved: u32,
    }
}

impl MsgHeader {
    pub fn new(opcode: Opcode, seq: u32, status: u32, payload_len: u32) -> Self {
        MsgHeader { magic: MAGIC, version: VERSION, opcode: opcode as u16, seq, status, payload_len, reserved: 0 }
    }

    /// Decodes and validates a header: magic, version, reserved field,
    /// opcode and payload bound. Callers can trust `payload_len` afterwards.
    pub fn decode(bytes: &[u8]) -> Result<MsgHeader, WireError> {
        let h = MsgHeader::get(&mut Reader::new(bytes))?;
        if h.magic != MAGIC {
            return Err(WireError::BadMagic(h.magic));
        }
        if h.version != VERSION {
            return Err(WireError::BadVersion(h.version));
        }
        if h.reserved != 0 {
            return Err(WireError::NonZeroReserved("header"));
        }
        Opcode::from_u16(h.opcode)?;
        if h.payload_len > MAX_PAYLOAD {
            return Err(WireError::TooLarge { what: "payload", len: h.payload_len as u64, max: MAX_PAYLOAD as u64 });
        }
        Ok(h)
    }

    pub fn opcode(&self) -> Opcode {
        // decode() validated it; an unvalidated header maps to Ping.
        Opcode::from_u16(self.opcode).unwrap_or(Opcode::Ping)
    }
}

macro_rules! opcodes {
    ($($name:ident = $v:expr),* $(,)?) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum Opcode { $($name = $v),* }
        impl Opcode {
            pub fn from_u16(v: u16) -> Result<Opcode, WireError> {
                match v { $($v => Ok(Opcode::$name),)* _ => Err(WireError::BadOpcode(v)) }
            }
            pub const ALL: &'static [Opcode] = &[$(Opcode::$name),*];
        }
    };
}

opcodes! {
    Ping = 1,
    GetDeviceInfo = 2,
    GetTenantInfo = 3,
    CtxCreate = 4,
    CtxDestroy = 5,
    CtxSynchronize = 6,
    MemAlloc = 7,
    MemFree = 8,
    MemGetInfo = 9,
    Memset = 10,
    MemcpyHtoD = 11,
    MemcpyDtoH = 12,
    MemcpyDtoD = 13,
    ModuleLoad = 14,
    ModuleUnload = 15,
    ModuleGetFunction = 16,
    LaunchKernel = 17,
    StreamCreate = 18,
    StreamDestroy = 19,
    StreamSynchronize = 20,
    EventCreate = 21,
    EventRecord = 22,
    EventSynchronize = 23,
    EventElapsedTime = 24,
    EventDestroy = 25,
    RegisterShm = 26,
    ModuleGetGlobal = 27,
    AttachRing = 28,
    UnregisterShm = 29,
    StreamWait = 30,
    GetConnStats = 31,
    RingKick = 32,
    GetDeviceAttributes = 33,
    GetProcesses = 34,
    GraphCreate = 35,
    GraphLaunch = 36,
    GraphDestroy = 37,
}

/// Where a copy's host-side bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum DataLoc {
    /// In the message trailer (HtoD) or reply trailer (DtoH).
    Inline = 0,
    /// In one of the connection's registered shared regions (`blob` names
    /// it: 0 is the staging buffer, others pinned host allocations), at
    /// `shm_offset`.
    Shared = 1,
    /// In a guest blob resource (`blob`), at `shm_offset` bytes into it:
    /// VM tenants' data, used in place in guest memory.
    Blob = 2,
}

/// Module image formats. Only PTX runs on the CPU reference device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ImageFormat {
    Ptx = 0,
    Cubin = 1,
    Fatbin = 2,
}

impl ImageFormat {
    /// Classifies an image the way the driver does: by its leading bytes.
    pub fn sniff(image: &[u8]) -> ImageFormat {
        if image.starts_with(b"\x7fELF") {
            ImageFormat::Cubin
        } else if image.len() >= 4 && u32::from_le_bytes([image[0], image[1], image[2], image[3]]) == 0xBA55_ED50 {
            ImageFormat::Fatbin
        } else {
            ImageFormat::Ptx
        }
    }
}

wire_struct! {
    /// `pid` is the creating process's id as it knows itself (in its own
    /// PID namespace: the guest's, the container's), 0 when not given;
    /// the device only reports it back, in `GetProcesses`.
    pub struct CtxCreateReq { pub flags: u32, pub pid: u32 }
}
wire_struct! { pub struct CtxReq { pub ctx: u32, pub reserved: u32 } }
wire_struct! {
    /// Creates a stream or event in a context.
    pub struct ObjCreateReq { pub ctx: u32, pub flags: u32 }
}
wire_struct! { pub struct MemAllocReq { pub ctx: u32, pub reserved: u32, pub size: u64 } }
wire_struct! { pub struct MemFreeReq { pub ctx: u32, pub reserved: u32, pub dptr: u64 } }
wire_struct! {
    pub struct MemsetReq {
        pub ctx: u32, pub stream: u32, pub dptr: u64,
        pub value: u32,
        /// 1, 2 or 4.
        pub elem_size: u32,
        pub count: u64,
    }
}
wire_struct! {
    pub struct MemcpyHtoDReq {
        pub ctx: u32, pub stream: u32, pub dst: u64, pub size: u64,
        /// A [`DataLoc`].
        pub loc: u32,
        /// The blob resource when `loc` is Blob; 0 otherwise.
        pub blob: u32,
        /// Offset in the shared buffer or the blob.
        pub shm_offset: u64,
    }
}
wire_struct! {
    pub struct MemcpyDtoHReq {
        pub ctx: u32, pub stream: u32, pub src: u64, pub size: u64,
        /// A [`DataLoc`]; `blob` and `shm_offset` as in [`MemcpyHtoDReq`].
        pub loc: u32, pub blob: u32, pub shm_offset: u64,
    }
}
wire_struct! { pub struct MemcpyDtoDReq { pub ctx: u32, pub stream: u32, pub dst: u64, pub src: u64, pub size: u64 } }
wire_struct! { pub struct ModuleLoadReq { pub ctx: u32, pub format: u32, pub image_len: u64 } }
wire_struct! { pub struct ModuleReq { pub ctx: u32, pub module: u32 } }
wire_struct! { pub struct GetFunctionReq { pub ctx: u32, pub module: u32, pub name_len: u32, pub reserved: u32 } }
wire_struct! {
    pub struct LaunchReq {
        pub ctx: u32, pub func: u32, pub stream: u32, pub shared_bytes: u32,
        pub grid: [u32; 3], pub block: [u32; 3],
        pub params_len: u32, pub reserved: u32,
    }
}
wire_struct! { pub struct HandleReq { pub ctx: u32, pub handle: u32 } }
wire_struct! {
    /// Builds an executable graph in `ctx` from `count` nodes, which
    /// follow in `nodes_len` bytes: each a [`GraphNodeHdr`] and its body.
    /// The work runs in node order when the graph is launched.
    pub struct GraphCreateReq { pub ctx: u32, pub count: u32, pub nodes_len: u32, pub reserved: u32 }
}
wire_struct! {
    /// `kind`: [`GRAPH_KERNEL`] (a [`GraphKernel`] and its parameter
    /// bytes), [`GRAPH_MEMSET`] (a [`GraphMemset`]) or [`GRAPH_COPY`] (a
    /// [`GraphCopy`], device to device).
    pub struct GraphNodeHdr { pub kind: u32, pub reserved: u32 }
}
wire_struct! {
    pub struct GraphKernel {
        pub func: u32, pub shared_bytes: u32,
        pub grid: [u32; 3], pub block: [u32; 3],
        pub params_len: u32, pub reserved: u32,
    }
}
wire_struct! {
    /// As [`MemsetReq`], without context and stream.
    pub struct GraphMemset { pub dptr: u64, pub value: u32, pub elem_size: u32, pub count: u64 }
}
wire_struct! { pub struct GraphCopy { pub dst: u64, pub src: u64, pub size: u64 } }
wire_struct! {
    /// Stream-ordered: runs graph `graph` of `ctx` on `stream`.
    pub struct GraphLaunchReq { pub ctx: u32, pub stream: u32, pub graph: u32, pub reserved: u32 }
}

/// [`GraphNodeHdr::kind`] of a kernel launch.
pub const GRAPH_KERNEL: u32 = 1;
/// [`GraphNodeHdr::kind`] of a memset.
pub const GRAPH_MEMSET: u32 = 2;
/// [`GraphNodeHdr::kind`] of a device-to-device copy.
pub const GRAPH_COPY: u32 = 3;

/// One node of a graph, decoded and checked as its own request would be.
#[derive(Debug, Clone, PartialEq)]
pub enum GraphNode {
    Kernel(GraphKernel, Vec<u8>),
    Memset(GraphMemset),
    Copy(GraphCopy),
}

impl GraphNode {
    fn put(&self, p: &mut Vec<u8>) {
        let kind = match self {
            GraphNode::Kernel(..) => GRAPH_KERNEL,
            GraphNode::Memset(_) => GRAPH_MEMSET,
            GraphNode::Copy(_) => GRAPH_COPY,
        };
        GraphNodeHdr { kind, reserved: 0 }.put(p);
        match self {
            GraphNode::Kernel(k, params) => {
                k.put(p);
                p.extend_from_slice(params);
            }
            GraphNode::Memset(m) => m.put(p),
            GraphNode::Copy(c) => c.put(p),
        }
    }

    fn get(r: &mut Reader<'_>) -> Result<GraphNode, WireError> {
        let h = GraphNodeHdr::get(r)?;
        zero(h.reserved, "graph node.reserved")?;
        Ok(match h.kind {
            GRAPH_KERNEL => {
                let k = GraphKernel::get(r)?;
                zero(k.reserved, "graph kernel.reserved")?;
                dims(&k.grid, &k.block)?;
                bounded("kernel parameters", k.params_len as u64, MAX_PARAM_BYTES as u64)?;
                let params = r.take(k.params_len as usize)?.to_vec();
                GraphNode::Kernel(k, params)
            }
            GRAPH_MEMSET => {
                let m = GraphMemset::get(r)?;
                memset_fields(m.value, m.elem_size, m.count)?;
                GraphNode::Memset(m)
            }
            GRAPH_COPY => GraphNode::Copy(GraphCopy::get(r)?),
            k => return Err(WireError::BadField { what: "graph node kind", value: k as u64 }),
        })
    }
}
wire_struct! { pub struct EventRecordReq { pub ctx: u32, pub event: u32, pub stream: u32, pub reserved: u32 } }
wire_struct! { pub struct EventElapsedReq { pub ctx: u32, pub start: u32, pub end: u32, pub reserved: u32 } }
wire_struct! {
    /// Registers a shared region (a sealed memfd, passed with the message):
    /// id 0 is the staging buffer, other ids pinned host memory.
    pub struct RegisterShmReq { pub size: u64, pub id: u32, pub flags: u32 }
}
wire_struct! { pub struct ShmIdReq { pub id: u32, pub reserved: u32 } }
wire_struct! {
    /// Attaches the connection's command ring (see [`crate::ring`]): a
    /// memfd (host tenants, with an eventfd for kicks) or, in a VM, the
    /// blob resource `blob`.
    pub struct AttachRingReq { pub sq_size: u32, pub flags: u32, pub blob: u32, pub reserved: u32 }
}
wire_struct! {
    /// Stream-ordered: work queued on `stream` after this waits until the
    /// ring entry `seq` has completed (events and stream waits).
    pub struct StreamWaitReq { pub ctx: u32, pub stream: u32, pub seq: u64 }
}
wire_struct! {
    /// What this connection cost the transport: messages (socket messages
    /// or SUBMIT_3D commands), ring entries consumed and wake-ups.
    pub struct ConnStats { pub messages: u64, pub ring_entries: u64, pub kicks: u64 }
}

wire_struct! {
    /// Device and tenant limits, as the tenant sees them.
    pub struct DeviceInfo {
        pub name: [u8; 64],
        pub uuid: [u8; 16],
        /// The tenant's quota: what `cuMemGetInfo` reports as total.
        pub total_mem: u64,
        pub free_mem: u64,
        pub cc_major: u32, pub cc_minor: u32,
        pub sm_count: u32, pub warp_size: u32,
        pub max_threads_per_block: u32, pub max_shared_per_block: u32,
        pub max_block: [u32; 3], pub max_grid: [u32; 3],
        pub numa_node: i32, pub ordinal: u32,
        /// Instructions one launch may execute before it is stopped (0: unlimited).
        pub instruction_budget: u64,
    }
}

wire_struct! {
    /// The tenant's own usage, for `vgpu-smi`.
    pub struct TenantInfo {
        pub name: [u8; 64],
        pub quota: u64, pub used: u64,
        pub kernels: u64, pub device_ns: u64,
        pub bytes_scrubbed: u64,
        pub weight: u32,
        /// `TENANT_*` bits about the device; 0 from hosts that predate
        /// them (no [`TENANT_FLAGS_SET`]).
        pub flags: u32,
    }
}

/// [`TenantInfo::flags`]: the device runs PTX on an interpreter (a CPU
/// reference device), not machine code for a real GPU.
pub const TENANT_INTERPRETS_PTX: u32 = 1;
/// [`TenantInfo::flags`]: set by every host that fills the flags, so a
/// client tells "a GPU" from "a host too old to say".
pub const TENANT_FLAGS_SET: u32 = 1 << 31;

impl TenantInfo {
    /// Whether the tenant's device interprets PTX ([`TENANT_INTERPRETS_PTX`]);
    /// `None` from a host too old to say.
    pub fn interprets_ptx(&self) -> Option<bool> {
        (self.flags & TENANT_FLAGS_SET != 0).then_some(self.flags & TENANT_INTERPRETS_PTX != 0)
    }
}

/// The settings unmodified CUDA software needs in its environment on a
/// device, besides how it reaches the device: none on a GPU; on a device
/// that interprets PTX, `CUPY_COMPILE_WITH_PTX=1`, since CuPy otherwise
/// compiles its kernels to machine code for a real GPU (a cubin), which no
/// interpreter runs, and reads only that variable, at import, to choose
/// PTX. The daemon hands these out with host tenants; `vgpu-smi --env`
/// prints them inside a VM.
pub fn program_env(interprets_ptx: bool) -> &'static [(&'static str, &'static str)] {
    if interprets_ptx {
        &[("CUPY_COMPILE_WITH_PTX", "1")]
    } else {
        &[]
    }
}

wire_struct! {
    /// One process of the tenant that holds contexts on the device: what
    /// NVML's running-process lists report.
    pub struct ProcessInfo {
        pub pid: u32,
        pub contexts: u32,
        /// Device memory its contexts' allocations hold.
        pub used: u64,
    }
}

wire_struct! { pub struct HandleReply { pub handle: u32, pub reserved: u32 } }
wire_struct! { pub struct PtrReply { pub dptr: u64 } }
wire_struct! { pub struct MemInfoReply { pub free: u64, pub total: u64 } }
wire_struct! { pub struct GlobalReply { pub dptr: u64, pub size: u64 } }
wire_struct! { pub struct ElapsedReply { pub ms_bits: u32, pub reserved: u32 } }
wire_struct! { pub struct FunctionReply { pub func: u32, pub num_params: u32, pub params_size: u32, pub reserved: u32 } }
wire_struct! {
    /// One kernel parameter: where its bytes go in the parameter buffer.
    pub struct ParamDesc { pub offset: u32, pub size: u32 }
}

/// A decoded request.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Ping,
    GetDeviceInfo,
    GetTenantInfo,
    CtxCreate(CtxCreateReq),
    CtxDestroy(CtxReq),
    CtxSynchronize(CtxReq),
    MemAlloc(MemAllocReq),
    MemFree(MemFreeReq),
    MemGetInfo,
    Memset(MemsetReq),
    MemcpyHtoD(MemcpyHtoDReq, Vec<u8>),
    MemcpyDtoH(MemcpyDtoHReq),
    MemcpyDtoD(MemcpyDtoDReq),
    ModuleLoad(ModuleLoadReq, Vec<u8>),
    ModuleUnload(ModuleReq),
    ModuleGetFunction(GetFunctionReq, String),
    /// A module variable's address and size (`cuModuleGetGlobal`); same
    /// body as ModuleGetFunction.
    ModuleGetGlobal(GetFunctionReq, String),
    LaunchKernel(LaunchReq, Vec<u8>),
    StreamCreate(ObjCreateReq),
    StreamDestroy(HandleReq),
    StreamSynchronize(HandleReq),
    EventCreate(ObjCreateReq),
    EventRecord(EventRecordReq),
    EventSynchronize(HandleReq),
    EventElapsedTime(EventElapsedReq),
    EventDestroy(HandleReq),
    RegisterShm(RegisterShmReq),
    AttachRing(AttachRingReq),
    UnregisterShm(ShmIdReq),
    StreamWait(StreamWaitReq),
    GetConnStats,
    RingKick,
    /// Every `CUdevice_attribute` value of the device, as the tenant sees it.
    GetDeviceAttributes,
    /// The tenant's processes holding contexts on the device.
    GetProcesses,
    GraphCreate(GraphCreateReq, Vec<GraphNode>),
    GraphLaunch(GraphLaunchReq),
    /// `handle` is the graph.
    GraphDestroy(HandleReq),
}

fn zero(v: u32, what: &'static str) -> Result<(), WireError> {
    if v != 0 {
        return Err(WireError::NonZeroReserved(what));
    }
    Ok(())
}

fn bounded(what: &'static str, len: u64, max: u64) -> Result<(), WireError> {
    if len > max {
        return Err(WireError::TooLarge { what, len, max });
    }
    Ok(())
}

fn data_loc(v: u32) -> Result<DataLoc, WireError> {
    match v {
        0 => Ok(DataLoc::Inline),
        1 => Ok(DataLoc::Shared),
        2 => Ok(DataLoc::Blob),
        _ => Err(WireError::BadField { what: "data location", value: v as u64 }),
    }
}

fn image_format(v: u32) -> Result<ImageFormat, WireError> {
    match v {
        0 => Ok(ImageFormat::Ptx),
        1 => Ok(ImageFormat::Cubin),
        2 => Ok(ImageFormat::Fatbin),
        _ => Err(WireError::BadField { what: "image format", value: v as u64 }),
    }
}

/// Validates a copy's location fields: the blob id only with Blob, and an
/// offset range that does not overflow.
fn copy_loc(loc: u32, blob: u32, offset: u64, size: u64) -> Result<DataLoc, WireError> {
    let loc = data_loc(loc)?;
    match loc {
        DataLoc::Blob if blob == 0 => return Err(WireError::BadField { what: "blob resource id", value: 0 }),
        DataLoc::Inline if blob != 0 => return Err(WireError::NonZeroReserved("blob of an inline copy")),
        _ => {}
    }
    offset.checked_add(size).ok_or(WireError::BadField { what: "copy range", value: offset })?;
    Ok(loc)
}

fn trailer(r: &mut Reader<'_>, len: u64, what: &'static str) -> Result<Vec<u8>, WireError> {
    if r.remaining() as u64 != len {
        return Err(WireError::LengthMismatch { what, stated: len, actual: r.remaining() as u64 });
    }
    Ok(r.rest().to_vec())
}

/// A memset's element size (1, 2 or 4), a value that fits it, and a
/// byte count that does not overflow.
fn memset_fields(value: u32, elem_size: u32, count: u64) -> Result<(), WireError> {
    if !matches!(elem_size, 1 | 2 | 4) {
        return Err(WireError::BadField { what: "memset element size", value: elem_size as u64 });
    }
    if elem_size < 4 && value >> (8 * elem_size) != 0 {
        return Err(WireError::BadField { what: "memset value", value: value as u64 });
    }
    count.checked_mul(elem_size as u64).ok_or(WireError::BadField { what: "memset count", value: count })?;
    Ok(())
}

/// A launch's grid and block dimensions: none zero.
fn dims(grid: &[u32; 3], block: &[u32; 3]) -> Result<(), WireError> {
    for (i, d) in grid.iter().chain(block.iter()).enumerate() {
        if *d == 0 {
            let what = if i < 3 { "grid dimension" } else { "block dimension" };
            return Err(WireError::BadField { what, value: 0 });
        }
    }
    Ok(())
}

fn end(r: &Reader<'_>) -> Result<(), WireError> {
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes(r.remaining()));
    }
    Ok(())
}

impl Request {
    pub fn opcode(&self) -> Opcode {
        match self {
            Request::Ping => Opcode::Ping,
            Request::GetDeviceInfo => Opcode::GetDeviceInfo,
            Request::GetTenantInfo => Opcode::GetTenantInfo,
            Request::CtxCreate(_) => Opcode::CtxCreate,
            Request::CtxDestroy(_) => Opcode::CtxDestroy,
            Request::CtxSynchronize(_) => Opcode::CtxSynchronize,
            Request::MemAlloc(_) => Opcode::MemAlloc,
            Request::MemFree(_) => Opcode::MemFree,
            Request::MemGetInfo => Opcode::MemGetInfo,
            Request::Memset(_) => Opcode::Memset,
            Request::MemcpyHtoD(..) => Opcode::MemcpyHtoD,
            Request::MemcpyDtoH(_) => Opcode::MemcpyDtoH,
            Request::MemcpyDtoD(_) => Opcode::MemcpyDtoD,
            Request::ModuleLoad(..) => Opcode::ModuleLoad,
            Request::ModuleUnload(_) => Opcode::ModuleUnload,
            Request::ModuleGetFunction(..) => Opcode::ModuleGetFunction,
            Request::ModuleGetGlobal(..) => Opcode::ModuleGetGlobal,
            Request::LaunchKernel(..) => Opcode::LaunchKernel,
            Request::StreamCreate(_) => Opcode::StreamCreate,
            Request::StreamDestroy(_) => Opcode::StreamDestroy,
            Request::StreamSynchronize(_) => Opcode::StreamSynchronize,
            Request::EventCreate(_) => Opcode::EventCreate,
            Request::EventRecord(_) => Opcode::EventRecord,
            Request::EventSynchronize(_) => Opcode::EventSynchronize,
            Request::EventElapsedTime(_) => Opcode::EventElapsedTime,
            Request::EventDestroy(_) => Opcode::EventDestroy,
            Request::RegisterShm(_) => Opcode::RegisterShm,
            Request::AttachRing(_) => Opcode::AttachRing,
            Request::UnregisterShm(_) => Opcode::UnregisterShm,
            Request::StreamWait(_) => Opcode::StreamWait,
            Request::GetConnStats => Opcode::GetConnStats,
            Request::RingKick => Opcode::RingKick,
            Request::GetDeviceAttributes => Opcode::GetDeviceAttributes,
            Request::GetProcesses => Opcode::GetProcesses,
            Request::GraphCreate(..) => Opcode::GraphCreate,
            Request::GraphLaunch(_) => Opcode::GraphLaunch,
            Request::GraphDestroy(_) => Opcode::GraphDestroy,
        }
    }

    /// Whether the request is work on a stream, run in that stream's
    /// order (launches, memsets, copies, event records, stream waits and
    /// graph launches), rather than answered at once.
    pub fn is_stream_ordered(&self) -> bool {
        matches!(
            self,
            Request::Memset(_)
                | Request::MemcpyHtoD(..)
                | Request::MemcpyDtoH(_)
                | Request::MemcpyDtoD(_)
                | Request::LaunchKernel(..)
                | Request::EventRecord(_)
                | Request::StreamWait(_)
                | Request::GraphLaunch(_)
        )
    }

    /// Encodes header + payload.
    pub fn encode(&self, seq: u32) -> Vec<u8> {
        let mut p = Vec::new();
        match self {
            Request::Ping
            | Request::GetDeviceInfo
            | Request::GetTenantInfo
            | Request::MemGetInfo
            | Request::GetConnStats
            | Request::RingKick
            | Request::GetDeviceAttributes
            | Request::GetProcesses => {}
            Request::CtxCreate(b) => b.put(&mut p),
            Request::StreamCreate(b) | Request::EventCreate(b) => b.put(&mut p),
            Request::CtxDestroy(b) | Request::CtxSynchronize(b) => b.put(&mut p),
            Request::MemAlloc(b) => b.put(&mut p),
            Request::MemFree(b) => b.put(&mut p),
            Request::Memset(b) => b.put(&mut p),
            Request::MemcpyHtoD(b, d) => {
                b.put(&mut p);
                p.extend_from_slice(d);
            }
            Request::MemcpyDtoH(b) => b.put(&mut p),
            Request::MemcpyDtoD(b) => b.put(&mut p),
            Request::ModuleLoad(b, img) => {
                b.put(&mut p);
                p.extend_from_slice(img);
            }
            Request::ModuleUnload(b) => b.put(&mut p),
            Request::ModuleGetFunction(b, name) | Request::ModuleGetGlobal(b, name) => {
                b.put(&mut p);
                p.extend_from_slice(name.as_bytes());
            }
            Request::LaunchKernel(b, params) => {
                b.put(&mut p);
                p.extend_from_slice(params);
            }
            Request::StreamDestroy(b) | Request::StreamSynchronize(b) | Request::EventSynchronize(b) | Request::EventDestroy(b) => b.put(&mut p),
            Request::EventRecord(b) => b.put(&mut p),
            Request::EventElapsedTime(b) => b.put(&mut p),
            Request::RegisterShm(b) => b.put(&mut p),
            Request::AttachRing(b) => b.put(&mut p),
            Request::UnregisterShm(b) => b.put(&mut p),
            Request::StreamWait(b) => b.put(&mut p),
            Request::GraphCreate(b, nodes) => {
                let mut body = Vec::new();
                for n in nodes {
                    n.put(&mut body);
                }
                GraphCreateReq { count: nodes.len() as u32, nodes_len: body.len() as u32, ..*b }.put(&mut p);
                p.extend_from_slice(&body);
            }
            Request::GraphLaunch(b) => b.put(&mut p),
            Request::GraphDestroy(b) => b.put(&mut p),
        }
        let mut out = Vec::with_capacity(MsgHeader::SIZE + p.len());
        MsgHeader::new(self.opcode(), seq, 0, p.len() as u32).put(&mut out);
        out.extend_from_slice(&p);
        out
    }

    /// Decodes a whole message (header + payload) and validates every field.
    pub fn decode(msg: &[u8]) -> Result<(MsgHeader, Request), WireError> {
        let mut r = Reader::new(msg);
        let h = MsgHeader::decode(r.take(MsgHeader::SIZE)?)?;
        if h.status != 0 {
            return Err(WireError::BadField { what: "request status", value: h.status as u64 });
        }
        if r.remaining() as u64 != h.payload_len as u64 {
            return Err(WireError::LengthMismatch { what: "payload", stated: h.payload_len as u64, actual: r.remaining() as u64 });
        }
        let req = Request::decode_payload(h.opcode(), &mut r)?;
        end(&r)?;
        Ok((h, req))
    }

    /// Decodes the payload of a request whose header was already validated.
    pub fn decode_payload(op: Opcode, r: &mut Reader<'_>) -> Result<Request, WireError> {
        Ok(match op {
            Opcode::Ping => Request::Ping,
            Opcode::GetDeviceInfo => Request::GetDeviceInfo,
            Opcode::GetTenantInfo => Request::GetTenantInfo,
            Opcode::MemGetInfo => Request::MemGetInfo,
            Opcode::GetConnStats => Request::GetConnStats,
            Opcode::RingKick => Request::RingKick,
            Opcode::GetDeviceAttributes => Request::GetDeviceAttributes,
            Opcode::GetProcesses => Request::GetProcesses,
            Opcode::AttachRing => {
                let b = AttachRingReq::get(r)?;
                zero(b.flags, "ring.flags")?;
                zero(b.reserved, "ring.reserved")?;
                if !crate::ring::sq_size_ok(b.sq_size) {
                    return Err(WireError::BadField { what: "ring size", value: b.sq_size as u64 });
                }
                Request::AttachRing(b)
            }
            Opcode::UnregisterShm => {
                let b = ShmIdReq::get(r)?;
                zero(b.reserved, "shm.reserved")?;
                Request::UnregisterShm(b)
            }
            Opcode::StreamWait => Request::StreamWait(StreamWaitReq::get(r)?),
            Opcode::CtxCreate => Request::CtxCreate(CtxCreateReq::get(r)?),
            Opcode::StreamCreate => Request::StreamCreate(ObjCreateReq::get(r)?),
            Opcode::EventCreate => Request::EventCreate(ObjCreateReq::get(r)?),
            Opcode::CtxDestroy | Opcode::CtxSynchronize => {
                let b = CtxReq::get(r)?;
                zero(b.reserved, "ctx.reserved")?;
                if op == Opcode::CtxDestroy {
                    Request::CtxDestroy(b)
                } else {
                    Request::CtxSynchronize(b)
                }
            }
            Opcode::MemAlloc => {
                let b = MemAllocReq::get(r)?;
                zero(b.reserved, "alloc.reserved")?;
                if b.size == 0 {
                    return Err(WireError::BadField { what: "alloc size", value: 0 });
                }
                Request::MemAlloc(b)
            }
            Opcode::MemFree => {
                let b = MemFreeReq::get(r)?;
                zero(b.reserved, "free.reserved")?;
                Request::MemFree(b)
            }
            Opcode::Memset => {
                let b = MemsetReq::get(r)?;
                memset_fields(b.value, b.elem_size, b.count)?;
                Request::Memset(b)
            }
            Opcode::MemcpyHtoD => {
                let b = MemcpyHtoDReq::get(r)?;
                let data = match copy_loc(b.loc, b.blob, b.shm_offset, b.size)? {
                    DataLoc::Inline => {
                        bounded("inline copy", b.size, MAX_INLINE_DATA)?;
                        if b.shm_offset != 0 {
                            return Err(WireError::BadField { what: "shm offset of inline copy", value: b.shm_offset });
                        }
                        trailer(r, b.size, "inline data")?
                    }
                    DataLoc::Shared | DataLoc::Blob => Vec::new(),
                };
                Request::MemcpyHtoD(b, data)
            }
            Opcode::MemcpyDtoH => {
                let b = MemcpyDtoHReq::get(r)?;
                match copy_loc(b.loc, b.blob, b.shm_offset, b.size)? {
                    DataLoc::Inline => {
                        bounded("inline copy", b.size, MAX_INLINE_DATA)?;
                        if b.shm_offset != 0 {
                            return Err(WireError::BadField { what: "shm offset of inline copy", value: b.shm_offset });
                        }
                    }
                    DataLoc::Shared | DataLoc::Blob => {}
                }
                Request::MemcpyDtoH(b)
            }
            Opcode::MemcpyDtoD => Request::MemcpyDtoD(MemcpyDtoDReq::get(r)?),
            Opcode::ModuleLoad => {
                let b = ModuleLoadReq::get(r)?;
                image_format(b.format)?;
                bounded("module image", b.image_len, MAX_IMAGE)?;
                if b.image_len == 0 {
                    return Err(WireError::BadField { what: "module image length", value: 0 });
                }
                let img = trailer(r, b.image_len, "module image")?;
                Request::ModuleLoad(b, img)
            }
            Opcode::ModuleUnload => Request::ModuleUnload(ModuleReq::get(r)?),
            Opcode::ModuleGetFunction | Opcode::ModuleGetGlobal => {
                let b = GetFunctionReq::get(r)?;
                zero(b.reserved, "getfunction.reserved")?;
                bounded("function name", b.name_len as u64, MAX_NAME as u64)?;
                let raw = trailer(r, b.name_len as u64, "function name")?;
                let name = String::from_utf8(raw).map_err(|_| WireError::BadUtf8("function name"))?;
                if name.is_empty() || name.contains('\0') {
                    return Err(WireError::BadField { what: "function name length", value: name.len() as u64 });
                }
                if op == Opcode::ModuleGetGlobal {
                    Request::ModuleGetGlobal(b, name)
                } else {
                    Request::ModuleGetFunction(b, name)
                }
            }
            Opcode::LaunchKernel => {
                let b = LaunchReq::get(r)?;
                zero(b.reserved, "launch.reserved")?;
                dims(&b.grid, &b.block)?;
                bounded("kernel parameters", b.params_len as u64, MAX_PARAM_BYTES as u64)?;
                let params = trailer(r, b.params_len as u64, "kernel parameters")?;
                Request::LaunchKernel(b, params)
            }
            Opcode::StreamDestroy | Opcode::StreamSynchronize | Opcode::EventSynchronize | Opcode::EventDestroy => {
                let b = HandleReq::get(r)?;
                match op {
                    Opcode::StreamDestroy => Request::StreamDestroy(b),
                    Opcode::StreamSynchronize => Request::StreamSynchronize(b),
                    Opcode::EventSynchronize => Request::EventSynchronize(b),
                    _ => Request::EventDestroy(b),
                }
            }
            Opcode::EventRecord => {
                let b = EventRecordReq::get(r)?;
                zero(b.reserved, "record.reserved")?;
                Request::EventRecord(b)
            }
            Opcode::EventElapsedTime => {
                let b = EventElapsedReq::get(r)?;
                zero(b.reserved, "elapsed.reserved")?;
                Request::EventElapsedTime(b)
            }
            Opcode::GraphCreate => {
                let b = GraphCreateReq::get(r)?;
                zero(b.reserved, "graph.reserved")?;
                if b.count == 0 {
                    return Err(WireError::BadField { what: "graph node count", value: 0 });
                }
                bounded("graph nodes", b.count as u64, MAX_GRAPH_NODES as u64)?;
                let body = trailer(r, b.nodes_len as u64, "graph nodes")?;
                let mut nr = Reader::new(&body);
                // No more room than the bytes can hold (a copy is the
                // smallest node), whatever the count claims.
                let mut nodes = Vec::with_capacity((b.count as usize).min(body.len() / (GraphNodeHdr::SIZE + GraphCopy::SIZE)));
                for _ in 0..b.count {
                    nodes.push(GraphNode::get(&mut nr)?);
                }
                end(&nr)?;
                Request::GraphCreate(b, nodes)
            }
            Opcode::GraphLaunch => {
                let b = GraphLaunchReq::get(r)?;
                zero(b.reserved, "graph launch.reserved")?;
                Request::GraphLaunch(b)
            }
            Opcode::GraphDestroy => Request::GraphDestroy(HandleReq::get(r)?),
            Opcode::RegisterShm => {
                let b = RegisterShmReq::get(r)?;
                zero(b.flags, "shm.flags")?;
                if b.size == 0 || b.size > (1 << 32) {
                    return Err(WireError::BadField { what: "shared buffer size", value: b.size });
                }
                Request::RegisterShm(b)
            }
        })
    }
}

/// A decoded reply body. Which variant a success carries depends on the
/// request's opcode; errors carry text.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Empty,
    DeviceInfo(DeviceInfo),
    TenantInfo(TenantInfo),
    Handle(u32),
    Ptr(u64),
    MemInfo(MemInfoReply),
    Function(FunctionReply, Vec<ParamDesc>),
    /// A module variable: device address and size.
    Global(u64, u64),
    Elapsed(f32),
    Data(Vec<u8>),
    ConnStats(ConnStats),
    /// `CUdevice_attribute` values by attribute number
    /// ([`crate::attrs::UNSUPPORTED`] where the device has none).
    Attributes(Vec<i32>),
    /// At most [`MAX_CONTEXTS`] entries.
    Processes(Vec<ProcessInfo>),
    Error(CuResult, String),
}

impl Reply {
    pub fn error(code: CuResult, msg: impl Into<String>) -> Reply {
        Reply::Error(code, msg.into())
    }

    /// Encodes header + payload for a reply to `op`.
    pub fn encode(&self, op: Opcode, seq: u32) -> Vec<u8> {
        let mut p = Vec::new();
        let mut status = 0u32;
        match self {
            Reply::Empty => {}
            Reply::DeviceInfo(d) => d.put(&mut p),
            Reply::TenantInfo(t) => t.put(&mut p),
            Reply::Handle(h) => HandleReply { handle: *h, reserved: 0 }.put(&mut p),
            Reply::Ptr(d) => PtrReply { dptr: *d }.put(&mut p),
            Reply::MemInfo(m) => m.put(&mut p),
            Reply::Function(f, params) => {
                f.put(&mut p);
                for d in params {
                    d.put(&mut p);
                }
            }
            Reply::Global(dptr, size) => GlobalReply { dptr: *dptr, size: *size }.put(&mut p),
            Reply::Elapsed(ms) => ElapsedReply { ms_bits: ms.to_bits(), reserved: 0 }.put(&mut p),
            Reply::Data(d) => p.extend_from_slice(d),
            Reply::ConnStats(c) => c.put(&mut p),
            Reply::Attributes(v) => {
                for a in v.iter().take(crate::attrs::COUNT) {
                    p.extend_from_slice(&a.to_le_bytes());
                }
            }
            Reply::Processes(v) => {
                debug_assert!(v.len() <= MAX_CONTEXTS, "more processes than contexts");
                for e in v.iter().take(MAX_CONTEXTS) {
                    e.put(&mut p);
                }
            }
            Reply::Error(code, msg) => {
                status = if code.is_ok() { CuResult::CUDA_ERROR_UNKNOWN as u32 } else { *code as u32 };
                let mut end = msg.len().min(MAX_ERROR_TEXT);
                while !msg.is_char_boundary(end) {
                    end -= 1;
                }
                p.extend_from_slice(&msg.as_bytes()[..end]);
            }
        }
        let mut out = Vec::with_capacity(MsgHeader::SIZE + p.len());
        MsgHeader::new(op, seq, status, p.len() as u32).put(&mut out);
        out.extend_from_slice(&p);
        out
    }

    /// Decodes a reply payload to a request with opcode `op`.
    pub fn decode_payload(op: Opcode, status: u32, payload: &[u8]) -> Result<Reply, WireError> {
        let mut r = Reader::new(payload);
        if status != 0 {
            if !CuResult::is_known(status) {
                return Err(WireError::BadField { what: "reply status", value: status as u64 });
            }
            bounded("error text", payload.len() as u64, MAX_ERROR_TEXT as u64)?;
            let text = String::from_utf8_lossy(payload).into_owned();
            return Ok(Reply::Error(CuResult::from_u32(status), text));
        }
        let reply = match op {
            Opcode::GetDeviceInfo => Reply::DeviceInfo(DeviceInfo::get(&mut r)?),
            Opcode::GetTenantInfo => Reply::TenantInfo(TenantInfo::get(&mut r)?),
            Opcode::CtxCreate | Opcode::StreamCreate | Opcode::EventCreate | Opcode::ModuleLoad | Opcode::GraphCreate => {
                let h = HandleReply::get(&mut r)?;
                zero(h.reserved, "handle.reserved")?;
                Reply::Handle(h.handle)
            }
            Opcode::MemAlloc => Reply::Ptr(PtrReply::get(&mut r)?.dptr),
            Opcode::MemGetInfo => Reply::MemInfo(MemInfoReply::get(&mut r)?),
            Opcode::ModuleGetGlobal => {
                let g = GlobalReply::get(&mut r)?;
                Reply::Global(g.dptr, g.size)
            }
            Opcode::ModuleGetFunction => {
                let f = FunctionReply::get(&mut r)?;
                zero(f.reserved, "function.reserved")?;
                bounded("parameter count", f.num_params as u64, MAX_PARAMS as u64)?;
                bounded("parameter bytes", f.params_size as u64, MAX_PARAM_BYTES as u64)?;
                let mut params = Vec::with_capacity(f.num_params as usize);
                for _ in 0..f.num_params {
                    let d = ParamDesc::get(&mut r)?;
                    let end = d.offset.checked_add(d.size).ok_or(WireError::BadField { what: "param offset", value: d.offset as u64 })?;
                    if end > f.params_size || d.size == 0 {
                        return Err(WireError::BadField { what: "param layout", value: end as u64 });
                    }
                    params.push(d);
                }
                Reply::Function(f, params)
            }
            Opcode::EventElapsedTime => {
                let e = ElapsedReply::get(&mut r)?;
                zero(e.reserved, "elapsed.reserved")?;
                Reply::Elapsed(f32::from_bits(e.ms_bits))
            }
            Opcode::MemcpyDtoH => Reply::Data(r.rest().to_vec()),
            Opcode::GetConnStats => Reply::ConnStats(ConnStats::get(&mut r)?),
            Opcode::GetDeviceAttributes => {
                let rest = r.rest();
                bounded("device attributes", rest.len() as u64, (crate::attrs::COUNT * 4) as u64)?;
                if !rest.len().is_multiple_of(4) {
                    return Err(WireError::BadField { what: "device attributes length", value: rest.len() as u64 });
                }
                Reply::Attributes(rest.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            Opcode::GetProcesses => {
                let n = r.remaining() / ProcessInfo::SIZE;
                bounded("processes", n as u64, MAX_CONTEXTS as u64)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(ProcessInfo::get(&mut r)?);
                }
                Reply::Processes(v)
            }
            _ => Reply::Empty,
        };
        end(&r)?;
        Ok(reply)
    }
}

/// Copies a name into a fixed NUL-padded field, truncating on a char boundary.
pub fn fixed_name<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let mut end = s.len().min(N - 1);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out[..end].copy_from_slice(&s.as_bytes()[..end]);
    out
}

/// A device UUID as NVIDIA's tools print it: `GPU-` and 8-4-4-4-12 hex.
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// Reads a NUL-padded fixed name field.
pub fn name_str(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}
