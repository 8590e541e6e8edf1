//! The CPU reference device: device memory is an anonymous host mapping of
//! the configured size; kernels are PTX, run by the interpreter.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_gpu_compute::{CuResult, ImageFormat, ParamDesc};

use super::{AllocTable, Backend, BackendError, DeviceDesc, DeviceModule, FunctionDesc, Launch, ModuleDataAlloc, TenantSlot};
use crate::ptx::{self, ExecError, GlobalMem, Module};

/// Allocation granule and alignment, as CUDA guarantees 256-byte alignment.
pub const GRANULE: u64 = 256;
/// Device addresses of CPU device N start at `DEVICE_VA_BASE + N * DEVICE_VA_STRIDE`.
pub const DEVICE_VA_BASE: u64 = 0x7000_0000_0000;
pub const DEVICE_VA_STRIDE: u64 = 1 << 40;
/// Default per-launch instruction budget: a few seconds of interpretation.
pub const DEFAULT_BUDGET: u64 = 2_000_000_000;

/// Host memory standing in for device memory.
struct Arena {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the arena is a plain memory mapping owned for the life of the
// backend; concurrent access is coordinated by the worker (each byte range
// belongs to one live allocation of one tenant, whose operations are
// serialised by that tenant's lock).
unsafe impl Send for Arena {}
// SAFETY: as above; all access goes through raw-pointer copies on ranges
// checked to lie inside the mapping.
unsafe impl Sync for Arena {}

impl Arena {
    fn new(len: usize) -> std::io::Result<Arena> {
        // SAFETY: anonymous private mapping with no address hint; the
        // result is checked for MAP_FAILED before use.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arena { ptr: ptr.cast(), len })
    }

    fn check(&self, off: u64, n: u64) -> Result<usize, BackendError> {
        match off.checked_add(n) {
            Some(end) if end <= self.len as u64 => Ok(off as usize),
            _ => Err(BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, format!("range {off:#x}+{n} outside device memory"))),
        }
    }

    fn write(&self, off: u64, data: &[u8]) -> Result<(), BackendError> {
        let o = self.check(off, data.len() as u64)?;
        // SAFETY: [o, o+len) is inside the mapping (checked above) and the
        // source is a distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(o), data.len()) };
        Ok(())
    }

    fn read(&self, off: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let o = self.check(off, out.len() as u64)?;
        // SAFETY: [o, o+len) is inside the mapping (checked above) and the
        // destination is a distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(o), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, n: u64) -> Result<(), BackendError> {
        let d = self.check(dst, n)?;
        let s = self.check(src, n)?;
        // SAFETY: both ranges are inside the mapping; `copy` allows overlap.
        unsafe { std::ptr::copy(self.ptr.add(s), self.ptr.add(d), n as usize) };
        Ok(())
    }

    fn fill(&self, off: u64, count: u64, elem: &[u8]) -> Result<(), BackendError> {
        let n = count.checked_mul(elem.len() as u64).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "memset size overflows"))?;
        let o = self.check(off, n)?;
        if elem.iter().all(|b| *b == elem[0]) {
            // SAFETY: [o, o+n) is inside the mapping (checked above).
            unsafe { std::ptr::write_bytes(self.ptr.add(o), elem[0], n as usize) };
        } else {
            for i in 0..count {
                // SAFETY: element i lies inside [o, o+n), checked above.
                unsafe { std::ptr::copy_nonoverlapping(elem.as_ptr(), self.ptr.add(o + (i as usize) * elem.len()), elem.len()) };
            }
        }
        Ok(())
    }

    /// The atomic cell of type `T` (an `AtomicU8`..`AtomicU64`, `size`
    /// bytes wide) at offset `o`, if `[o, o+size)` is inside the mapping and
    /// `o` is aligned to `size`.
    fn cell<T>(&self, o: usize, size: usize, from_ptr: unsafe fn(*mut u8) -> &'static T) -> Option<&T> {
        if !o.is_multiple_of(size) || o.checked_add(size)? > self.len {
            return None;
        }
        // SAFETY: `[o, o+size)` lies inside the mapping (checked above),
        // which lives as long as `self` (the returned borrow is tied to it);
        // `o` is aligned to the cell's size; every concurrent access to
        // device memory from kernels goes through such atomic cells, and
        // host copies of a tenant's memory never overlap its running kernels.
        Some(unsafe { from_ptr(self.ptr.add(o)) })
    }

    fn u8_at(&self, o: usize) -> Option<&AtomicU8> {
        // SAFETY: `cell` passes a pointer inside the mapping (any alignment).
        self.cell(o, 1, |p| unsafe { AtomicU8::from_ptr(p) })
    }

    fn u16_at(&self, o: usize) -> Option<&AtomicU16> {
        // SAFETY: `cell` passes a pointer inside the mapping, 2-aligned.
        self.cell(o, 2, |p| unsafe { AtomicU16::from_ptr(p.cast()) })
    }

    fn u32_at(&self, o: usize) -> Option<&AtomicU32> {
        // SAFETY: `cell` passes a pointer inside the mapping, 4-aligned.
        self.cell(o, 4, |p| unsafe { AtomicU32::from_ptr(p.cast()) })
    }

    fn u64_at(&self, o: usize) -> Option<&AtomicU64> {
        // SAFETY: `cell` passes a pointer inside the mapping, 8-aligned.
        self.cell(o, 8, |p| unsafe { AtomicU64::from_ptr(p.cast()) })
    }

    /// A kernel's load: blocks of one launch may run on several host
    /// threads, so each naturally aligned 2-, 4- or 8-byte element is read
    /// with one relaxed atomic load (other sizes byte by byte).
    fn load_shared(&self, off: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let o = self.check(off, out.len() as u64)?;
        let bytes = match out.len() {
            8 => self.u64_at(o).map(|c| c.load(Ordering::Relaxed).to_le_bytes()),
            4 => self.u32_at(o).map(|c| (c.load(Ordering::Relaxed) as u64).to_le_bytes()),
            2 => self.u16_at(o).map(|c| (c.load(Ordering::Relaxed) as u64).to_le_bytes()),
            _ => None,
        };
        match bytes {
            Some(b) => out.copy_from_slice(&b[..out.len()]),
            None => {
                for (i, b) in out.iter_mut().enumerate() {
                    *b = self.u8_at(o + i).map(|c| c.load(Ordering::Relaxed)).unwrap_or(0);
                }
            }
        }
        Ok(())
    }

    /// A kernel's store, element-wise atomic like [`Arena::load_shared`].
    fn store_shared(&self, off: u64, data: &[u8]) -> Result<(), BackendError> {
        let o = self.check(off, data.len() as u64)?;
        let mut w = [0u8; 8];
        w[..data.len().min(8)].copy_from_slice(&data[..data.len().min(8)]);
        let w = u64::from_le_bytes(w);
        let done = match data.len() {
            8 => self.u64_at(o).map(|c| c.store(w, Ordering::Relaxed)),
            4 => self.u32_at(o).map(|c| c.store(w as u32, Ordering::Relaxed)),
            2 => self.u16_at(o).map(|c| c.store(w as u16, Ordering::Relaxed)),
            _ => None,
        };
        if done.is_none() {
            for (i, b) in data.iter().enumerate() {
                if let Some(c) = self.u8_at(o + i) {
                    c.store(*b, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// An atomic read-modify-write of an aligned 2-, 4- or 8-byte element.
    fn rmw(&self, off: u64, n: usize, f: &mut dyn FnMut(u64) -> u64) -> Result<u64, BackendError> {
        let o = self.check(off, n as u64)?;
        let (acq, rel) = (Ordering::Acquire, Ordering::AcqRel);
        let old = match n {
            8 => self.u64_at(o).map(|c| c.fetch_update(rel, acq, |v| Some(f(v))).unwrap_or_else(|v| v)),
            4 => self.u32_at(o).map(|c| c.fetch_update(rel, acq, |v| Some(f(v as u64) as u32)).unwrap_or_else(|v| v) as u64),
            2 => self.u16_at(o).map(|c| c.fetch_update(rel, acq, |v| Some(f(v as u64) as u16)).unwrap_or_else(|v| v) as u64),
            _ => None,
        };
        old.ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_MISALIGNED_ADDRESS, format!("atomic of {n} bytes at offset {o:#x}")))
    }

    /// Zeroes `[off, off+n)` here and now, with stores: the cost shows in
    /// the scrub (and its figure), not later in the next owner's page
    /// faults, as it would with MADV_DONTNEED. Freed device memory stays
    /// resident, as a GPU's does.
    fn scrub(&self, off: u64, n: u64) -> Result<(), BackendError> {
        self.fill(off, n, &[0])
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe the mapping made in `new`; nothing
        // borrows it once the backend is dropped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// First-fit range allocator over the arena; frees coalesce.
#[derive(Debug, Default)]
struct RangeAlloc {
    free: BTreeMap<u64, u64>,
}

impl RangeAlloc {
    fn new(size: u64) -> Self {
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        RangeAlloc { free }
    }

    fn alloc(&mut self, n: u64) -> Option<u64> {
        let (&off, &len) = self.free.iter().find(|(_, l)| **l >= n)?;
        self.free.remove(&off);
        if len > n {
            self.free.insert(off + n, len - n);
        }
        Some(off)
    }

    fn free(&mut self, off: u64, n: u64) {
        let mut start = off;
        let mut len = n;
        if let Some((&p, &pl)) = self.free.range(..off).next_back() {
            if p + pl == off {
                self.free.remove(&p);
                start = p;
                len += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(off + n)) {
            self.free.remove(&(off + n));
            len += nl;
        }
        self.free.insert(start, len);
    }
}

/// Where the device's allocations are: in device memory (`memory` bytes)
/// or spilled to the host spill budget once device memory is full.
#[derive(Debug, Default)]
struct Placement {
    ranges: RangeAlloc,
    /// Bytes of allocations held in device memory.
    resident: u64,
    /// Spilled allocations by age: sequence number to (offset, length, tenant).
    spilled: BTreeMap<u64, (u64, u64, TenantSlot)>,
    /// Offset of a spilled allocation to its sequence number.
    spilled_at: BTreeMap<u64, u64>,
    spilled_bytes: u64,
    by_tenant: BTreeMap<TenantSlot, u64>,
    next_seq: u64,
}

impl Placement {
    fn unspill(&mut self, seq: u64) -> Option<(u64, u64, TenantSlot)> {
        let (off, len, slot) = self.spilled.remove(&seq)?;
        self.spilled_at.remove(&off);
        self.spilled_bytes -= len;
        if let Some(b) = self.by_tenant.get_mut(&slot) {
            *b -= len;
            if *b == 0 {
                self.by_tenant.remove(&slot);
            }
        }
        Some((off, len, slot))
    }

    /// Brings spilled allocations back into device memory while it has
    /// room, in the order they spilled: a later one waits for an earlier
    /// one that does not fit yet.
    fn return_spilled(&mut self, memory: u64) {
        while let Some((&seq, &(_, len, _))) = self.spilled.first_key_value() {
            if self.resident + len > memory {
                break;
            }
            self.unspill(seq);
            self.resident += len;
        }
    }
}

pub struct CpuBackend {
    desc: DeviceDesc,
    va_base: u64,
    arena: Arena,
    place: Mutex<Placement>,
    /// Host RAM allocations may spill to once device memory is full.
    spill: u64,
    /// Slots handed to tenants, so spilled bytes are told per tenant.
    next_slot: AtomicU64,
    scrubbed: AtomicU64,
    quarantined: AtomicBool,
    /// Wall-clock limit of one launch.
    launch_timeout: Option<Duration>,
    /// Host threads one launch's blocks run on.
    launch_threads: usize,
}

struct CpuModule(Module);

impl DeviceModule for CpuModule {
    fn function(&self, name: &str) -> Option<FunctionDesc> {
        let index = self.0.kernels.iter().position(|k| k.name == name)?;
        let k = &self.0.kernels[index];
        Some(FunctionDesc { index, params: k.params.iter().map(|p| ParamDesc { offset: p.offset, size: p.size }).collect(), params_size: k.params_size })
    }
    fn host_bytes(&self) -> u64 {
        self.0.host_bytes()
    }
    fn global(&self, name: &str) -> Option<(u64, u64)> {
        self.0.symbol(name)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Global memory as one tenant's kernel sees it.
struct TenantView<'a> {
    backend: &'a CpuBackend,
    owned: &'a AllocTable,
    hit: (u64, u64),
}

impl TenantView<'_> {
    fn check(&mut self, addr: u64, n: usize) -> Result<u64, ExecError> {
        let n64 = n as u64;
        let (s, l) = self.hit;
        if addr >= s && addr.wrapping_add(n64) <= s + l && addr.checked_add(n64).is_some() {
            return Ok(addr - self.backend.va_base);
        }
        match self.owned.find(addr, n64) {
            Some(hit) => {
                self.hit = hit;
                Ok(addr - self.backend.va_base)
            }
            None => Err(ExecError::IllegalAddress { kind: "global", addr, len: n, line: 0 }),
        }
    }
}

impl GlobalMem for TenantView<'_> {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let off = self.check(addr, out.len())?;
        self.backend.arena.load_shared(off, out).map_err(|_| ExecError::IllegalAddress { kind: "global", addr, len: out.len(), line: 0 })
    }
    fn atomic(&mut self, addr: u64, n: usize, f: &mut dyn FnMut(u64) -> u64) -> Result<u64, ExecError> {
        let off = self.check(addr, n)?;
        if !self.owned.1.is_empty() && self.owned.read_only(addr, n as u64) {
            return Err(ExecError::IllegalAddress { kind: "constant (atomic)", addr, len: n, line: 0 });
        }
        self.backend.arena.rmw(off, n, f).map_err(|_| ExecError::Misaligned { addr, len: n, line: 0 })
    }
    fn fork(&self) -> Option<Box<dyn GlobalMem + Send + '_>> {
        Some(Box::new(TenantView { backend: self.backend, owned: self.owned, hit: (0, 0) }))
    }
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        let off = self.check(addr, data.len())?;
        if !self.owned.1.is_empty() && self.owned.read_only(addr, data.len() as u64) {
            return Err(ExecError::IllegalAddress { kind: "constant (store)", addr, len: data.len(), line: 0 });
        }
        self.backend.arena.store_shared(off, data).map_err(|_| ExecError::IllegalAddress { kind: "global", addr, len: data.len(), line: 0 })
    }
}

impl CpuBackend {
    pub fn new(ordinal: u32, memory: u64, budget: u64) -> std::io::Result<CpuBackend> {
        let memory = memory / GRANULE * GRANULE;
        let mut uuid = [0u8; 16];
        uuid[..8].copy_from_slice(b"vgpu-cpu");
        uuid[8..12].copy_from_slice(&ordinal.to_be_bytes());
        Ok(CpuBackend {
            desc: DeviceDesc {
                kind: "cpu",
                name: format!("vGPU CPU reference device {ordinal}"),
                uuid,
                memory,
                cc: (8, 0),
                sm_count: 1,
                max_threads_per_block: 1024,
                max_shared_per_block: 48 * 1024,
                max_block: [1024, 1024, 64],
                max_grid: [i32::MAX as u32, 65535, 65535],
                instruction_budget: budget,
                numa_node: -1,
                attributes: None,
            },
            va_base: DEVICE_VA_BASE + ordinal as u64 * DEVICE_VA_STRIDE,
            arena: Arena::new(memory.max(GRANULE) as usize)?,
            place: Mutex::new(Placement { ranges: RangeAlloc::new(memory), ..Default::default() }),
            spill: 0,
            next_slot: AtomicU64::new(1),
            scrubbed: AtomicU64::new(0),
            quarantined: AtomicBool::new(false),
            launch_timeout: None,
            launch_threads: 1,
        })
    }

    /// Lets allocations spill to `spill` bytes of host RAM once device
    /// memory is full. On this device both are host RAM, so a spilled
    /// allocation is placed and accounted as spilled; its bytes do not
    /// move when it returns (docs/overcommit.md).
    pub fn with_spill(mut self, spill: u64) -> std::io::Result<CpuBackend> {
        let spill = spill / GRANULE * GRANULE;
        let total = self.desc.memory.checked_add(spill).ok_or_else(|| std::io::Error::other("device memory and spill overflow"))?;
        self.arena = Arena::new(total.max(GRANULE) as usize)?;
        self.place = Mutex::new(Placement { ranges: RangeAlloc::new(total), ..Default::default() });
        self.spill = spill;
        Ok(self)
    }

    fn placement(&self) -> std::sync::MutexGuard<'_, Placement> {
        self.place.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs each launch's blocks on up to `n` host threads (rayon's pool).
    pub fn with_launch_threads(mut self, n: usize) -> CpuBackend {
        self.launch_threads = n.max(1);
        self
    }

    /// The compute capability the device reports and accepts PTX for.
    pub fn with_compute_capability(mut self, cc: (u32, u32)) -> CpuBackend {
        self.desc.cc = cc;
        self
    }

    /// Stops any launch that runs longer than `t` with CUDA_ERROR_LAUNCH_TIMEOUT.
    pub fn with_launch_timeout(mut self, t: Duration) -> CpuBackend {
        self.launch_timeout = Some(t);
        self
    }

    fn off(&self, addr: u64) -> Result<u64, BackendError> {
        addr.checked_sub(self.va_base).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, format!("{addr:#x} is not a device address")))
    }

    /// Reads back a few words of a scrubbed range; any non-zero byte means
    /// the scrub cannot be trusted.
    fn verify_scrub(&self, off: u64, n: u64) -> bool {
        let mut word = [0u8; 8];
        let samples = [off, off + n / 2, off + n.saturating_sub(8)];
        samples.iter().all(|&o| {
            let len = 8.min(off + n - o.min(off + n)) as usize;
            self.arena.read(o, &mut word[..len]).is_ok() && word[..len].iter().all(|b| *b == 0)
        })
    }
}

impl Backend for CpuBackend {
    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn alloc(&self, slot: TenantSlot, size: u64) -> Result<(u64, u64), BackendError> {
        if self.quarantined.load(Ordering::Relaxed) {
            return Err(BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "device quarantined after a failed scrub"));
        }
        let n = size.checked_next_multiple_of(GRANULE).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "size overflows"))?;
        let off = {
            let mut p = self.placement();
            let memory = self.desc.memory;
            let spills = p.resident + n > memory;
            if spills && p.spilled_bytes + n > self.spill {
                let why = if self.spill == 0 {
                    format!("device memory is full ({} of {memory} bytes allocated) and the device has no host spill budget", p.resident)
                } else {
                    format!("device memory is full ({} of {memory} bytes allocated) and its host spill budget has {} of {} bytes left", p.resident, self.spill - p.spilled_bytes, self.spill)
                };
                return Err(BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("cannot place {n} bytes: {why}")));
            }
            let off = p.ranges.alloc(n).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("device has no free range of {n} bytes")))?;
            if spills {
                let seq = p.next_seq;
                p.next_seq += 1;
                p.spilled.insert(seq, (off, n, slot));
                p.spilled_at.insert(off, seq);
                p.spilled_bytes += n;
                *p.by_tenant.entry(slot).or_default() += n;
            } else {
                p.resident += n;
            }
            off
        };
        // Scrub before hand-out: nobody sees the previous owner's bytes.
        // A range that fails it is given back, not handed out.
        if let Err(e) = self.arena.scrub(off, n) {
            self.free(slot, self.va_base + off, n);
            return Err(e);
        }
        if !self.verify_scrub(off, n) {
            self.quarantined.store(true, Ordering::Relaxed);
            self.free(slot, self.va_base + off, n);
            return Err(BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "scrub verification failed; device quarantined"));
        }
        self.scrubbed.fetch_add(n, Ordering::Relaxed);
        Ok((self.va_base + off, n))
    }

    fn free(&self, _slot: TenantSlot, addr: u64, len: u64) {
        if let Ok(off) = self.off(addr) {
            let mut p = self.placement();
            match p.spilled_at.get(&off).copied() {
                Some(seq) => {
                    p.unspill(seq);
                }
                None => p.resident = p.resident.saturating_sub(len),
            }
            p.ranges.free(off, len);
            p.return_spilled(self.desc.memory);
        }
    }

    fn open_tenant(&self, _name: &str) -> Result<TenantSlot, BackendError> {
        Ok(self.next_slot.fetch_add(1, Ordering::Relaxed))
    }

    fn spilled(&self, slot: TenantSlot) -> u64 {
        self.placement().by_tenant.get(&slot).copied().unwrap_or(0)
    }

    fn granule(&self) -> u64 {
        GRANULE
    }

    fn available(&self) -> u64 {
        let p = self.placement();
        self.desc.memory.saturating_sub(p.resident) + self.spill.saturating_sub(p.spilled_bytes)
    }

    fn spill_usage(&self) -> (u64, u64) {
        (self.placement().spilled_bytes, self.spill)
    }

    fn bytes_scrubbed(&self) -> u64 {
        self.scrubbed.load(Ordering::Relaxed)
    }

    fn quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    fn write(&self, _slot: TenantSlot, addr: u64, data: &[u8]) -> Result<(), BackendError> {
        self.arena.write(self.off(addr)?, data)
    }

    fn read(&self, _slot: TenantSlot, addr: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.arena.read(self.off(addr)?, out)
    }

    fn fill(&self, _slot: TenantSlot, addr: u64, count: u64, elem: &[u8]) -> Result<(), BackendError> {
        self.arena.fill(self.off(addr)?, count, elem)
    }

    fn copy(&self, _slot: TenantSlot, dst: u64, src: u64, len: u64) -> Result<(), BackendError> {
        self.arena.copy(self.off(dst)?, self.off(src)?, len)
    }

    fn load_module(&self, _slot: TenantSlot, image: &[u8], format: ImageFormat, host_limit: u64, data: &mut ModuleDataAlloc<'_>) -> Result<Arc<dyn DeviceModule>, BackendError> {
        let (major, minor) = self.desc.cc;
        let arch = major * 10 + minor;
        // A fatbin runs here through the best PTX it carries (or, if all of
        // it is newer than the device, the oldest: the interpreter does not
        // depend on the architecture a PTX names); a cubin (machine code
        // for a real GPU) cannot run at all.
        let ptx;
        let mut newer = false;
        let image = match format {
            ImageFormat::Ptx => image,
            ImageFormat::Cubin => {
                return Err(BackendError::new(
                    CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU,
                    "cubin images are machine code for a real GPU; the CPU reference device runs PTX only (compile to PTX, e.g. nvrtc -arch=compute_XX)",
                ));
            }
            ImageFormat::Fatbin => {
                let bad = |e: virtio_gpu_compute::fatbin::FatbinError| {
                    let code = if matches!(e, virtio_gpu_compute::fatbin::FatbinError::TooLarge { .. }) { CuResult::CUDA_ERROR_OUT_OF_MEMORY } else { CuResult::CUDA_ERROR_INVALID_IMAGE };
                    BackendError::new(code, e.to_string())
                };
                // The decompressed text counts against the tenant's host
                // memory budget, like the module parsed from it.
                let (text, is_newer) = virtio_gpu_compute::fatbin::ptx_for_interpreter(image, arch, host_limit)
                    .map_err(bad)?
                    .ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, "the fatbin carries no PTX (its cubins cannot run on the CPU reference device)"))?;
                (ptx, newer) = (text, is_newer);
                &ptx[..]
            }
        };
        let text = std::str::from_utf8(image.strip_suffix(&[0]).unwrap_or(image)).map_err(|_| BackendError::new(CuResult::CUDA_ERROR_INVALID_PTX, "PTX image is not valid UTF-8 text"))?;
        let mut m = Module::parse_within(text, host_limit).map_err(|e| {
            let code = if e.budget { CuResult::CUDA_ERROR_OUT_OF_MEMORY } else { CuResult::CUDA_ERROR_INVALID_PTX };
            BackendError::new(code, e.to_string())
        })?;
        if m.target > arch && !newer {
            return Err(BackendError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, format!("the module targets sm_{}, newer than this device's compute capability {major}.{minor}", m.target)));
        }
        let g = if m.global_size > 0 { data(m.global_size, false)? } else { 0 };
        let c = if m.const_size > 0 { data(m.const_size, true)? } else { 0 };
        for (addr, bytes) in m.link(g, c) {
            self.arena.write(self.off(addr)?, &bytes)?;
        }
        Ok(Arc::new(CpuModule(m)))
    }

    fn launch(&self, _slot: TenantSlot, module: &dyn DeviceModule, func: usize, l: &Launch, params: &[u8], owned: &AllocTable) -> Result<u64, BackendError> {
        let m = module.as_any().downcast_ref::<CpuModule>().ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "module belongs to another backend"))?;
        let k = m.0.kernels.get(func).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "no such function"))?;
        let mut view = TenantView { backend: self, owned, hit: (0, 0) };
        let limits = ptx::Limits {
            max_threads_per_block: self.desc.max_threads_per_block,
            max_block: self.desc.max_block,
            max_grid: self.desc.max_grid,
            max_shared: self.desc.max_shared_per_block,
            budget: self.desc.instruction_budget,
            timeout: self.launch_timeout,
            sm_count: self.desc.sm_count,
            threads: self.launch_threads,
            preempt: None,
        };
        let cfg = ptx::LaunchConfig { grid: l.grid, block: l.block, dynamic_shared: l.shared_bytes };
        // Under the device scheduler, the launch may be stopped between its
        // slices for other tenants' work.
        let run = crate::sched::with_current(|cur| ptx::launch(k, &cfg, params, &mut view, &ptx::Limits { preempt: cur.map(|r| r as &dyn ptx::Preempt), ..limits }));
        match run {
            Ok(stats) => Ok(stats.instructions),
            Err(e) => {
                let code = match &e {
                    ExecError::IllegalAddress { .. } => CuResult::CUDA_ERROR_ILLEGAL_ADDRESS,
                    ExecError::Misaligned { .. } => CuResult::CUDA_ERROR_MISALIGNED_ADDRESS,
                    ExecError::Budget(_) | ExecError::Timeout(_) => CuResult::CUDA_ERROR_LAUNCH_TIMEOUT,
                    ExecError::OutOfResources(_) => CuResult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                    ExecError::BadLaunch(_) => CuResult::CUDA_ERROR_INVALID_VALUE,
                    ExecError::Deadlock(_) | ExecError::Failed(_) => CuResult::CUDA_ERROR_LAUNCH_FAILED,
                    ExecError::Trap(_) => CuResult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
                    ExecError::Assert(_) => CuResult::CUDA_ERROR_ASSERT,
                };
                Err(BackendError::new(code, format!("kernel '{}': {e}", k.name)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_range_is_reused_and_handed_out_zeroed() {
        let b = CpuBackend::new(0, 1 << 20, 0).unwrap();
        let (a, n) = b.alloc(0, 100_000).unwrap();
        b.fill(0, a, n, &[0xAB]).unwrap();
        b.free(0, a, n);
        let (a2, n2) = b.alloc(0, 100_000).unwrap();
        assert_eq!((a, n), (a2, n2), "first fit reuses the range");
        let mut buf = vec![1u8; n2 as usize];
        b.read(0, a2, &mut buf).unwrap();
        assert!(buf.iter().all(|x| *x == 0));
        assert_eq!(b.bytes_scrubbed(), 2 * n);
    }

    #[test]
    fn allocator_coalesces_and_reports_exhaustion() {
        let b = CpuBackend::new(1, 4 * GRANULE, 0).unwrap();
        let x = b.alloc(0, GRANULE).unwrap();
        let y = b.alloc(0, GRANULE).unwrap();
        let z = b.alloc(0, 2 * GRANULE).unwrap();
        assert_eq!(b.alloc(0, 1).unwrap_err().code, CuResult::CUDA_ERROR_OUT_OF_MEMORY);
        b.free(0, x.0, x.1);
        b.free(0, y.0, y.1);
        assert_eq!(b.alloc(0, 2 * GRANULE).unwrap().0, x.0, "neighbouring frees merge");
        b.free(0, z.0, z.1);
    }

    #[test]
    fn full_device_memory_spills_to_the_budget_and_frees_bring_spills_back_in_order() {
        let k = 64 * GRANULE;
        let b = CpuBackend::new(0, 4 * k, 0).unwrap().with_spill(3 * k).unwrap();
        let (alice, bob) = (b.open_tenant("alice").unwrap(), b.open_tenant("bob").unwrap());
        let a = b.alloc(alice, 3 * k).unwrap();
        let b1 = b.alloc(bob, 2 * k).unwrap();
        assert_eq!((b.spilled(alice), b.spilled(bob)), (0, 2 * k), "the allocation that does not fit spills, whole");
        b.fill(bob, b1.0, b1.1, &[0x5A]).unwrap();
        let b2 = b.alloc(bob, k).unwrap();
        assert_eq!(b.spilled(bob), 2 * k, "what still fits in device memory does not spill");
        let b3 = b.alloc(bob, k).unwrap();
        assert_eq!(b.spill_usage(), (3 * k, 3 * k));
        let e = b.alloc(alice, 1).unwrap_err();
        assert_eq!(e.code, CuResult::CUDA_ERROR_OUT_OF_MEMORY);
        assert!(e.msg.contains("spill budget has 0 of"), "{}", e.msg);
        // Freeing 3k of device memory: the oldest spill (2k) returns, then
        // the next (1k) fits as well.
        b.free(alice, a.0, a.1);
        assert_eq!(b.spill_usage().0, 0);
        assert_eq!(b.spilled(bob), 0);
        let mut out = vec![0u8; b1.1 as usize];
        b.read(bob, b1.0, &mut out).unwrap();
        assert!(out.iter().all(|x| *x == 0x5A), "data is intact after spill and return");
        b.free(bob, b1.0, b1.1);
        b.free(bob, b2.0, b2.1);
        b.free(bob, b3.0, b3.1);
        assert_eq!(b.placement().resident, 0);
        // Without a budget, a full device refuses.
        let plain = CpuBackend::new(0, 2 * k, 0).unwrap();
        plain.alloc(1, 2 * k).unwrap();
        assert!(plain.alloc(1, GRANULE).unwrap_err().msg.contains("no host spill budget"));
    }

    #[test]
    fn a_spill_that_does_not_fit_holds_back_later_ones() {
        let k = 64 * GRANULE;
        let b = CpuBackend::new(0, 4 * k, 0).unwrap().with_spill(8 * k).unwrap();
        let resident = [b.alloc(1, 2 * k).unwrap(), b.alloc(1, 2 * k).unwrap()];
        let big = b.alloc(2, 3 * k).unwrap();
        let small = b.alloc(3, k).unwrap();
        assert_eq!(b.spill_usage().0, 4 * k);
        b.free(1, resident[0].0, resident[0].1);
        // 2k free: the 3k spill, first in line, does not fit; the 1k one waits behind it.
        assert_eq!((b.spilled(2), b.spilled(3)), (3 * k, k));
        b.free(1, resident[1].0, resident[1].1);
        assert_eq!((b.spilled(2), b.spilled(3)), (0, 0));
        b.free(2, big.0, big.1);
        b.free(3, small.0, small.1);
    }

    #[test]
    fn cubins_have_no_binary_for_this_device() {
        let b = CpuBackend::new(0, 1 << 16, 0).unwrap();
        let e = b.load_module(0, b"\x7fELF\x02\x01\x01", ImageFormat::Cubin, u64::MAX, &mut |_, _| unreachable!()).err().unwrap();
        assert_eq!(e.code, CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU);
        assert!(e.msg.contains("PTX only"));
    }

    const CONST_PTX: &str = ".version 8.0\n.target sm_80\n.address_size 64\n.visible .const .align 4 .u32 c[4] = {1, 2, 3, 4};\n.visible .global .align 4 .u32 g;\n.visible .entry k() {\n .reg .b64 %rd<3>;\n .reg .b32 %r<3>;\n mov.u64 %rd1, c;\n cvta.const.u64 %rd2, %rd1;\n ld.u32 %r1, [%rd2+8];\n st.global.u32 [g], %r1;\n st.u32 [%rd2], %r1;\n ret;\n}\n";

    #[test]
    fn modules_newer_than_the_device_are_refused_as_on_a_real_driver() {
        let b = CpuBackend::new(0, 1 << 20, 0).unwrap().with_compute_capability((7, 5));
        let e = b.load_module(0, CONST_PTX.as_bytes(), ImageFormat::Ptx, u64::MAX, &mut |_, _| unreachable!()).err().unwrap();
        assert_eq!(e.code, CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU);
        assert!(e.msg.contains("sm_80"), "{}", e.msg);
    }

    #[test]
    fn constant_memory_is_initialised_readable_and_not_writable_by_kernels() {
        let b = CpuBackend::new(0, 1 << 20, 0).unwrap().with_compute_capability((8, 0));
        let mut owned = AllocTable::default();
        let m = b
            .load_module(0, CONST_PTX.as_bytes(), ImageFormat::Ptx, u64::MAX, &mut |size, ro| {
                let (a, n) = b.alloc(0, size)?;
                owned.0.insert(a, n);
                if ro {
                    owned.1.insert(a, n);
                }
                Ok(a)
            })
            .unwrap();
        let (c, csize) = m.global("c").unwrap();
        let (g, gsize) = m.global("g").unwrap();
        assert_eq!((csize, gsize), (16, 4));
        let mut buf = [0u8; 16];
        b.read(0, c, &mut buf).unwrap();
        assert_eq!(buf, [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]);
        let l = Launch { grid: [1, 1, 1], block: [1, 1, 1], shared_bytes: 0 };
        let e = b.launch(0, &*m, 0, &l, &[], &owned).unwrap_err();
        assert_eq!(e.code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, "{}", e.msg);
        assert!(e.msg.contains("constant"), "{}", e.msg);
        // The load before the faulting store went through.
        let mut word = [0u8; 4];
        b.read(0, g, &mut word).unwrap();
        assert_eq!(u32::from_le_bytes(word), 3);
        // The host writes constant memory through the module's symbol.
        b.write(0, c, &[9; 16]).unwrap();
    }

    #[test]
    fn blocks_on_several_host_threads_keep_atomics_exact() {
        let ptx = ".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry k(.param .u64 p) {\n .reg .b64 %rd<4>;\n .reg .b32 %r<4>;\n .reg .f32 %f<2>;\n ld.param.u64 %rd1, [p];\n atom.global.add.u32 %r1, [%rd1], 1;\n red.global.add.f32 [%rd1+4], 0f3F800000;\n mov.u32 %r2, %ctaid.x;\n mul.wide.u32 %rd2, %r2, 4;\n add.s64 %rd3, %rd1, %rd2;\n st.global.u32 [%rd3+8], %r2;\n ret;\n}\n";
        let b = CpuBackend::new(0, 1 << 20, 0).unwrap().with_launch_threads(4);
        let m = b.load_module(0, ptx.as_bytes(), ImageFormat::Ptx, u64::MAX, &mut |_, _| unreachable!()).unwrap();
        let (a, n) = b.alloc(0, 4096).unwrap();
        let mut owned = AllocTable::default();
        owned.0.insert(a, n);
        let l = Launch { grid: [512, 1, 1], block: [64, 1, 1], shared_bytes: 0 };
        for _ in 0..3 {
            b.fill(0, a, n, &[0]).unwrap();
            b.launch(0, &*m, 0, &l, &a.to_le_bytes(), &owned).unwrap();
            let mut buf = vec![0u8; 8 + 512 * 4];
            b.read(0, a, &mut buf).unwrap();
            assert_eq!(u32::from_le_bytes(buf[0..4].try_into().unwrap()), 512 * 64);
            assert_eq!(f32::from_le_bytes(buf[4..8].try_into().unwrap()), (512 * 64) as f32);
            for blk in 0..512usize {
                assert_eq!(u32::from_le_bytes(buf[8 + blk * 4..12 + blk * 4].try_into().unwrap()), blk as u32);
            }
        }
        // A fault in one block stops the launch with that block's error.
        let l = Launch { grid: [4096, 1, 1], block: [64, 1, 1], shared_bytes: 0 };
        let e = b.launch(0, &*m, 0, &l, &a.to_le_bytes(), &owned).unwrap_err();
        assert_eq!(e.code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, "{}", e.msg);
    }
}
