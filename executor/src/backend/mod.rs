//! The backend seam: one backend instance serves one device worker.
//!
//! Backends own device memory and execution. Everything tenant-shaped
//! (quotas, handles, pointer ownership, contexts) lives above this trait in
//! the worker, so every backend enforces the same rules.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod discover;
pub mod placed;

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

use virtio_gpu_compute::{CuResult, ImageFormat, ParamDesc};
/// Host memory a copy reads from or writes to. A tenant (through its
/// shared buffers) or a VM guest (its RAM) may change that memory while a
/// copy runs, so it is never borrowed as a Rust slice: backends move its
/// bytes with `copy_to`/`copy_from` or hand its address to the device.
pub use vm_memory::VolatileSlice;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct BackendError {
    pub code: CuResult,
    pub msg: String,
    /// The tenant's host budget refused it (`CUDA_ERROR_OUT_OF_MEMORY`
    /// that is not the device's or the quota's).
    pub host_budget: bool,
}

impl BackendError {
    pub fn new(code: CuResult, msg: impl Into<String>) -> Self {
        BackendError { code, msg: msg.into(), host_budget: false }
    }

    /// `CUDA_ERROR_OUT_OF_MEMORY` from the tenant's host budget.
    pub fn over_host_budget(msg: impl Into<String>) -> Self {
        BackendError { code: CuResult::CUDA_ERROR_OUT_OF_MEMORY, msg: msg.into(), host_budget: true }
    }

    /// A module's PTX that did not parse, or did not fit the host budget.
    pub fn ptx(e: vgpu_ptx::PtxError) -> Self {
        if e.budget {
            Self::over_host_budget(e.to_string())
        } else {
            Self::new(CuResult::CUDA_ERROR_INVALID_PTX, e.to_string())
        }
    }

    /// A fatbin that is malformed, or whose entry decompresses past the
    /// host budget (`CUDA_ERROR_OUT_OF_MEMORY`; past the fixed cap on any
    /// entry, whatever the budget, it is not the budget's refusal).
    pub fn fatbin(e: virtio_gpu_compute::fatbin::FatbinError) -> Self {
        use virtio_gpu_compute::fatbin::{FatbinError, MAX_UNCOMPRESSED};
        match e {
            FatbinError::TooLarge { size, .. } if size <= MAX_UNCOMPRESSED => Self::over_host_budget(format!("fatbin: {e}")),
            FatbinError::TooLarge { .. } => Self::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("fatbin: {e}")),
            _ => Self::new(CuResult::CUDA_ERROR_INVALID_IMAGE, format!("fatbin: {e}")),
        }
    }
}

/// Copies and memsets stop to be preempted after this many bytes, as
/// kernels do at their checkpoints: on the CPU device a memset of a whole
/// quota holds a lane for a few milliseconds at a time, not for seconds.
/// One of at most this many bytes never stops.
pub const CHECKPOINT_BYTES: u64 = 4 << 20;

/// Where a long copy or memset may give its lane up (when the scheduler
/// or the device's arbiter asked for it) until it is granted one again.
/// Nothing happens off a lane.
pub fn preempt_point() {
    vgpu_arbiter::grant::with_preempt(|p| {
        if let Some(p) = p {
            p.checkpoint();
        }
    });
}

/// Bytes `[at, at+n)` of `s`: a copy's piece.
pub fn piece<'a>(s: &VolatileSlice<'a>, at: usize, n: usize) -> Result<VolatileSlice<'a>, BackendError> {
    s.subslice(at, n).map_err(|e| BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, format!("host range {at}+{n}: {e}")))
}

/// What a device offers; reported to tenants and the control plane.
#[derive(Debug, Clone)]
pub struct DeviceDesc {
    pub kind: &'static str,
    pub name: String,
    pub uuid: [u8; 16],
    pub memory: u64,
    pub cc: (u32, u32),
    pub sm_count: u32,
    pub max_threads_per_block: u32,
    pub max_shared_per_block: u32,
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
    pub instruction_budget: u64,
    pub numa_node: i32,
    /// The hardware's own `CUdevice_attribute` values by number (a GPU);
    /// `None` for the CPU device, which answers the reference table.
    pub attributes: Option<Vec<i32>>,
}

impl DeviceDesc {
    /// Whether the device runs PTX on the interpreter (the CPU reference
    /// device) rather than machine code on a GPU.
    pub fn interprets_ptx(&self) -> bool {
        self.kind == "cpu"
    }
}

/// One tenant's live allocations: start address -> length. Kernel and copy
/// accesses must fall entirely inside one of them. The second map holds the
/// allocations kernels may read but not write (modules' `.const` segments).
#[derive(Debug, Default, Clone)]
pub struct AllocTable(pub BTreeMap<u64, u64>, pub BTreeMap<u64, u64>);

impl AllocTable {
    /// The allocation `[start, start+len)` that wholly contains `[addr, addr+n)`.
    pub fn find(&self, addr: u64, n: u64) -> Option<(u64, u64)> {
        let (start, len) = self.0.range(..=addr).next_back()?;
        let end = addr.checked_add(n)?;
        if end <= start + len {
            Some((*start, *len))
        } else {
            None
        }
    }

    /// Whether `[addr, addr+n)` overlaps a read-only allocation.
    pub fn read_only(&self, addr: u64, n: u64) -> bool {
        match self.1.range(..addr.saturating_add(n)).next_back() {
            Some((start, len)) => start + len > addr,
            None => false,
        }
    }
}

/// Device memory for a module's variables, taken from the loading tenant's
/// quota: `(size, read_only)` to the device address of a zeroed range.
pub type ModuleDataAlloc<'a> = dyn FnMut(u64, bool) -> Result<u64, BackendError> + 'a;

#[derive(Debug, Clone)]
pub struct FunctionDesc {
    pub index: usize,
    pub params: Vec<ParamDesc>,
    pub params_size: u32,
    /// Device memory the driver takes for the kernel's local memory when
    /// it is launched: its bytes a thread for every thread the device can
    /// hold at once (a GPU driver keeps the most any launch needed until
    /// the context goes). Charged to the tenant's quota before the
    /// launch. 0 where the backend's local memory is its own host memory
    /// (the CPU device charges it to the host budget as it runs).
    pub local_reserve: u64,
}

/// A module loaded on a device.
pub trait DeviceModule: Send + Sync {
    fn function(&self, name: &str) -> Option<FunctionDesc>;
    /// Host memory the loaded module keeps in the worker, charged to its
    /// tenant's host budget while the module is loaded.
    fn host_bytes(&self) -> u64;
    /// A module variable's device address and size (`cuModuleGetGlobal`).
    fn global(&self, _name: &str) -> Option<(u64, u64)> {
        None
    }
    fn as_any(&self) -> &dyn Any;
}

/// Waiting for the device: spinning briefly (short work is the common
/// case), then sleeping, each nap twice the last, up to `max`.
pub struct Backoff {
    from: std::time::Instant,
    nap: std::time::Duration,
    max: std::time::Duration,
}

impl Backoff {
    /// How long a wait spins before it sleeps.
    const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

    pub fn new(max: std::time::Duration) -> Backoff {
        Backoff { from: std::time::Instant::now(), nap: std::time::Duration::from_micros(20), max }
    }

    /// One pause between two looks at the device.
    pub fn pause(&mut self) {
        if self.from.elapsed() < Self::SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(self.nap);
            self.nap = (self.nap * 2).min(self.max);
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

/// One piece of a graph's work, in the order the graph runs it; memory
/// ranges were checked against the tenant's allocations.
pub enum GraphOp<'a> {
    Kernel { module: &'a dyn DeviceModule, func: usize, launch: Launch, params: &'a [u8] },
    Fill { dptr: u64, count: u64, elem: &'a [u8] },
    Copy { dst: u64, src: u64, len: u64 },
}

/// A tenant as a backend knows it: the key of its backend-side state (its
/// own CUDA context on a GPU). Backends without per-tenant state use 0.
pub type TenantSlot = u64;

pub trait Backend: Send + Sync {
    fn desc(&self) -> &DeviceDesc;
    /// Called once before the worker's seccomp lists go on, after which no
    /// file can be opened: loads whatever the backend would otherwise open
    /// on first use.
    fn before_confinement(&self) {}
    /// Sets up the backend-side state of a new tenant.
    fn open_tenant(&self, _name: &str) -> Result<TenantSlot, BackendError> {
        Ok(0)
    }
    /// Drops a tenant's backend-side state; the service has freed all of its
    /// allocations and dropped its modules first.
    fn close_tenant(&self, _slot: TenantSlot) {}
    /// Called once a tenant whose kernel faulted holds no contexts any more.
    /// A backend whose faults poison the tenant's device context (CUDA's
    /// sticky errors) rebuilds it here so the tenant can start afresh.
    fn recover_tenant(&self, _slot: TenantSlot) -> Result<(), BackendError> {
        Ok(())
    }
    /// Set when a scrub could not be verified: the device hands out nothing.
    fn quarantined(&self) -> bool;
    /// Reserves at least `size` bytes, zeroed before this returns. Returns
    /// the device address and the reserved length.
    fn alloc(&self, slot: TenantSlot, size: u64) -> Result<(u64, u64), BackendError>;
    fn free(&self, slot: TenantSlot, addr: u64, len: u64);
    /// Allocations are rounded up to a multiple of this.
    fn granule(&self) -> u64 {
        1
    }
    /// Bytes the device could still place now (device memory and spill
    /// budget), whatever the quotas say.
    fn available(&self) -> u64 {
        u64::MAX
    }
    /// Bytes of the tenant's allocations spilled to host RAM now.
    fn spilled(&self, _slot: TenantSlot) -> u64 {
        0
    }
    /// Bytes spilled to host RAM now, and the device's spill budget.
    fn spill_usage(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Bytes zeroed on hand-out so far.
    fn bytes_scrubbed(&self) -> u64;
    /// The memory operations below trust that the caller checked the range
    /// against its tenant's [`AllocTable`]; backends check it against the
    /// device as a second line of defence.
    fn write(&self, slot: TenantSlot, addr: u64, data: VolatileSlice<'_>) -> Result<(), BackendError>;
    fn read(&self, slot: TenantSlot, addr: u64, out: VolatileSlice<'_>) -> Result<(), BackendError>;
    fn fill(&self, slot: TenantSlot, addr: u64, count: u64, elem: &[u8]) -> Result<(), BackendError>;
    fn copy(&self, slot: TenantSlot, dst: u64, src: u64, len: u64) -> Result<(), BackendError>;
    /// Loads a module whose host-side form (parsed or kept by the driver)
    /// takes at most `host_limit` bytes, the rest of the tenant's host
    /// budget; a larger one fails with CUDA_ERROR_OUT_OF_MEMORY before the
    /// memory is taken. Device memory for the module's variables comes from
    /// `data`, charged to the tenant (backends whose driver places module
    /// variables itself do not call it).
    fn load_module(&self, slot: TenantSlot, image: &[u8], format: ImageFormat, host_limit: u64, data: &mut ModuleDataAlloc<'_>) -> Result<Arc<dyn DeviceModule>, BackendError>;
    /// Device memory the driver itself will place for the variables of
    /// the module `image` (its `.global` and `.const` data), charged to the
    /// tenant's quota before it is loaded, within `host_limit` bytes of the
    /// tenant's host budget to work it out. None by default: a backend
    /// that places variables itself charges them through `data`.
    fn placed_bytes(&self, _image: &[u8], _format: ImageFormat, _host_limit: u64) -> Result<u64, BackendError> {
        Ok(0)
    }
    /// Runs a kernel to completion; on the CPU device every access is
    /// checked against `owned`, on a GPU the tenant's own context confines
    /// it. Returns instructions executed (0 where the backend cannot count).
    fn launch(&self, slot: TenantSlot, module: &dyn DeviceModule, func: usize, l: &Launch, params: &[u8], owned: &AllocTable) -> Result<u64, BackendError>;
    /// The longest a launch may run before it fails with
    /// CUDA_ERROR_LAUNCH_TIMEOUT, if the backend stops them. A graph run
    /// node by node is held to it as a whole, as one launch would be.
    fn launch_timeout(&self) -> Option<std::time::Duration> {
        None
    }
    /// Whether [`Backend::launch_queued`] queues kernels without waiting
    /// for them (a GPU): the executor then keeps several in flight
    /// (`worker::pipeline`).
    fn queues_launches(&self) -> bool {
        false
    }
    /// Queues a kernel on the tenant's stream and returns without waiting
    /// for it: `Some(ticket)`, to be followed with
    /// [`Backend::launch_finished`] until it ends; `None`: it ran to
    /// completion, as [`Backend::launch`] runs it (the default).
    fn launch_queued(&self, slot: TenantSlot, module: &dyn DeviceModule, func: usize, l: &Launch, params: &[u8], owned: &AllocTable) -> Result<Option<u64>, BackendError> {
        self.launch(slot, module, func, l, params, owned).map(|_| None)
    }
    /// Whether the kernel of `ticket` ended: `Ok(false)` while it runs. An
    /// error (its fault, an earlier kernel's, or its launch timeout, which
    /// counts from `since`) ends the ticket too.
    fn launch_finished(&self, _slot: TenantSlot, _ticket: u64, _since: std::time::Instant) -> Result<bool, BackendError> {
        Ok(true)
    }
    /// Builds an executable graph of `ops` (run in order) on the tenant's
    /// device context, for [`Backend::graph_launch_queued`]: `Some(id)`.
    /// `None` (the default): this backend has no graphs of its own, and
    /// the executor runs a graph's work piece by piece.
    fn graph_create(&self, _slot: TenantSlot, _ops: &[GraphOp<'_>]) -> Result<Option<u64>, BackendError> {
        Ok(None)
    }
    /// Queues graph `graph` on the tenant's stream as one unit of work, as
    /// [`Backend::launch_queued`] queues a kernel (its ticket is followed
    /// with [`Backend::launch_finished`]; the launch timeout covers the
    /// whole graph); `None`: it ran to completion.
    fn graph_launch_queued(&self, _slot: TenantSlot, _graph: u64) -> Result<Option<u64>, BackendError> {
        Err(BackendError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "this device builds no graphs"))
    }
    /// Runs graph `graph` to completion.
    fn graph_launch(&self, slot: TenantSlot, graph: u64, since: std::time::Instant) -> Result<(), BackendError> {
        let Some(ticket) = self.graph_launch_queued(slot, graph)? else { return Ok(()) };
        let mut b = Backoff::new(std::time::Duration::from_millis(1));
        while !self.launch_finished(slot, ticket, since)? {
            b.pause();
        }
        Ok(())
    }
    /// Frees graph `graph` (unknown ids, as after the tenant's context was
    /// rebuilt, are ignored).
    fn graph_destroy(&self, _slot: TenantSlot, _graph: u64) {}
    /// Host memory that copies will come from again and again (a tenant's
    /// shared buffer, a VM's RAM). A GPU backend page-locks it so the copy
    /// engines reach it directly; the default does nothing.
    fn register_host(&self, _ptr: *mut u8, _len: usize) -> Result<(), BackendError> {
        Ok(())
    }
    /// Undoes [`Backend::register_host`] before the memory is unmapped.
    fn unregister_host(&self, _ptr: *mut u8) {}
}
