//! The CPU reference device: device memory is an anonymous host mapping of
//! the configured size; kernels are PTX, run by the interpreter.
//!
//! Each tenant allocates in its own window of device addresses; an
//! allocation's bytes take any free granules of the arena (one run when one
//! fits, else several), so no tenant's allocations can fragment the device
//! into refusing another's (docs/overcommit.md).

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_gpu_compute::{CuResult, ImageFormat, ParamDesc};

use super::{piece, preempt_point, AllocTable, Backend, BackendError, DeviceDesc, DeviceModule, FunctionDesc, Launch, ModuleDataAlloc, TenantSlot, VolatileSlice, CHECKPOINT_BYTES};
use vgpu_ptx::{self as ptx, ExecError, GlobalMem, Module};

/// Allocation granule and alignment, as CUDA guarantees 256-byte alignment.
pub const GRANULE: u64 = 256;
/// Device addresses of CPU device N lie in the `DEVICE_VA_STRIDE` bytes from
/// `DEVICE_VA_BASE + N * DEVICE_VA_STRIDE` on, cut into its tenants' address
/// windows (`Windows`).
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

    fn read(&self, off: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let o = self.check(off, out.len() as u64)?;
        // SAFETY: [o, o+len) is inside the mapping (checked above) and the
        // destination is a distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(o), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Bytes `[off, off+n)` of the arena, checked to lie inside it.
    fn volatile(&self, off: u64, n: usize) -> Result<VolatileSlice<'_>, BackendError> {
        let o = self.check(off, n as u64)?;
        // SAFETY: [o, o+n) is inside the mapping (checked above), which
        // lives as long as `self`; copies reach the arena only through raw
        // or volatile accesses, and kernels only through raw pointers and
        // atomics (`cell`), never a plain Rust slice.
        Ok(unsafe { VolatileSlice::new(self.ptr.add(o), n) })
    }

    fn copy(&self, dst: u64, src: u64, n: u64) -> Result<(), BackendError> {
        let d = self.check(dst, n)?;
        let s = self.check(src, n)?;
        // SAFETY: both ranges are inside the mapping; `copy` allows overlap.
        unsafe { std::ptr::copy(self.ptr.add(s), self.ptr.add(d), n as usize) };
        Ok(())
    }

    /// Writes `n` bytes at `off`, byte `i` being `elem[(phase + i) % elem.len()]`:
    /// a memset of `elem`s resumed `phase` bytes into an element.
    fn fill_from(&self, off: u64, n: u64, elem: &[u8], phase: usize) -> Result<(), BackendError> {
        let Some(&first) = elem.first() else {
            return if n == 0 { Ok(()) } else { Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "memset of empty elements")) };
        };
        let o = self.check(off, n)?;
        let n = n as usize;
        if elem.iter().all(|b| *b == first) {
            // SAFETY: [o, o+n) is inside the mapping (checked above).
            unsafe { std::ptr::write_bytes(self.ptr.add(o), first, n) };
            return Ok(());
        }
        let k = elem.len();
        let mut i = 0;
        while i < n {
            let p = (phase + i) % k;
            let c = (k - p).min(n - i);
            // SAFETY: [o+i, o+i+c) lies inside [o, o+n), checked above; the
            // source is the caller's element, a distinct host buffer.
            unsafe { std::ptr::copy_nonoverlapping(elem[p..].as_ptr(), self.ptr.add(o + i), c) };
            i += c;
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
        self.fill_from(off, n, &[0], 0)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe the mapping made in `new`; nothing
        // borrows it once the backend is dropped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// First-fit range allocator (over the arena, or over a tenant's address
/// window); frees coalesce.
#[derive(Debug, Default)]
struct RangeAlloc {
    free: BTreeMap<u64, u64>,
    /// Bytes in `free`, all runs together.
    free_bytes: u64,
}

impl RangeAlloc {
    fn new(size: u64) -> Self {
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        RangeAlloc { free, free_bytes: size }
    }

    /// One run of `n` bytes, the first that fits.
    fn alloc(&mut self, n: u64) -> Option<u64> {
        let (&off, &len) = self.free.iter().find(|(_, l)| **l >= n)?;
        self.free.remove(&off);
        if len > n {
            self.free.insert(off + n, len - n);
        }
        self.free_bytes -= n;
        Some(off)
    }

    /// `n` bytes as `(offset, length)` runs: one run when one fits (first
    /// fit), else the largest free runs, longest first (ties: lowest
    /// offset), until they hold `n`, so the list is as short as it can be.
    /// `None` only when fewer than `n` bytes are free in all.
    fn alloc_runs(&mut self, n: u64) -> Option<Vec<(u64, u64)>> {
        if n > self.free_bytes {
            return None;
        }
        if let Some(off) = self.alloc(n) {
            return Some(vec![(off, n)]);
        }
        let mut runs: Vec<(u64, u64)> = self.free.iter().map(|(&o, &l)| (o, l)).collect();
        runs.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut got = Vec::new();
        let mut need = n;
        for (off, len) in runs {
            if need == 0 {
                break;
            }
            let take = len.min(need);
            self.free.remove(&off);
            if len > take {
                self.free.insert(off + take, len - take);
            }
            got.push((off, take));
            need -= take;
        }
        self.free_bytes -= n;
        Some(got)
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
        self.free_bytes += n;
    }
}

/// Where one allocation's bytes lie in the arena: runs of whole granules,
/// in address order. Extent `i` holds bytes `[ext[i].at, ext[i+1].at)` of
/// the allocation (the last one up to `len`) from arena offset
/// `ext[i].off` on. Extent boundaries are multiples of [`GRANULE`] from the
/// allocation's start, so a naturally aligned access of up to 16 bytes lies
/// in one extent.
///
/// Host memory: at most one extent (16 bytes) per granule of the
/// allocation, and, since extents never share a granule, at most one per
/// granule of the arena over all allocations together (arena / 16 bytes).
#[derive(Debug)]
struct Mapping {
    len: u64,
    ext: Box<[Extent]>,
}

#[derive(Debug, Clone, Copy)]
struct Extent {
    /// Offset of the extent's first byte in the allocation.
    at: u64,
    /// Its arena offset.
    off: u64,
}

impl Mapping {
    fn from_runs(runs: &[(u64, u64)]) -> Mapping {
        let mut at = 0;
        let ext = runs
            .iter()
            .map(|&(off, len)| {
                let e = Extent { at, off };
                at += len;
                e
            })
            .collect();
        Mapping { len: at, ext }
    }

    /// The extent holding byte `rel`: its start and end in the allocation,
    /// and its arena offset.
    fn extent(&self, rel: u64) -> Option<(u64, u64, u64)> {
        if rel >= self.len {
            return None;
        }
        let i = self.ext.partition_point(|e| e.at <= rel).checked_sub(1)?;
        let e = self.ext.get(i)?;
        let end = self.ext.get(i + 1).map_or(self.len, |n| n.at);
        Some((e.at, end, e.off))
    }

    /// The arena offset of byte `rel`, and how many bytes from it on lie in
    /// the same extent.
    fn piece(&self, rel: u64) -> Option<(u64, u64)> {
        let (start, end, off) = self.extent(rel)?;
        Some((off + (rel - start), end - rel))
    }

    /// The arena offset just past byte `end - 1`, and how many bytes before
    /// it lie in the same extent.
    fn piece_before(&self, end: u64) -> Option<(u64, u64)> {
        let (start, _, off) = self.extent(end.checked_sub(1)?)?;
        Some((off + (end - start), end - start))
    }

    /// The arena runs, as `(offset, length)`.
    fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ext.iter().enumerate().map(|(i, e)| (e.off, self.ext.get(i + 1).map_or(self.len, |n| n.at) - e.at))
    }
}

/// Calls `f(arena offset, range of the operation)` for each piece of the
/// `n` bytes from byte `rel` of an allocation, pieces split where extents
/// end. The caller checked that `[rel, rel+n)` lies in the allocation.
fn each_piece(m: &Mapping, rel: u64, n: u64, mut f: impl FnMut(u64, std::ops::Range<usize>) -> Result<(), BackendError>) -> Result<(), BackendError> {
    let mut pos = 0;
    while pos < n {
        let (off, avail) = m.piece(rel + pos).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, format!("byte {} is outside its allocation", rel + pos)))?;
        let c = avail.min(n - pos);
        f(off, pos as usize..(pos + c) as usize)?;
        pos += c;
    }
    Ok(())
}

/// [`each_piece`] for a copy or memset: in pieces of at most
/// [`CHECKPOINT_BYTES`], stopping between them where the lane is asked
/// back once that many bytes were done since the last stop. (A kernel's
/// own accesses use `each_piece`: they never stop midway; nor does a copy
/// of at most `CHECKPOINT_BYTES`.)
fn each_piece_preemptible(m: &Mapping, rel: u64, n: u64, mut f: impl FnMut(u64, std::ops::Range<usize>) -> Result<(), BackendError>) -> Result<(), BackendError> {
    let (mut pos, mut since) = (0, 0);
    while pos < n {
        if since >= CHECKPOINT_BYTES {
            preempt_point();
            since = 0;
        }
        let (off, avail) = m.piece(rel + pos).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, format!("byte {} is outside its allocation", rel + pos)))?;
        let c = avail.min(n - pos).min(CHECKPOINT_BYTES - since);
        f(off, pos as usize..(pos + c) as usize)?;
        pos += c;
        since += c;
    }
    Ok(())
}

/// Device addresses of a window are aligned to this.
const WINDOW_ALIGN: u64 = 2 << 20;

/// One tenant's own range of device addresses, as big as the arena: its
/// allocations take addresses here, and only its own allocations can
/// fragment it. Their bytes take any free granules of the arena.
///
/// The window is the tenant's device address space. In the executor model
/// (each tenant's device memory held by its own executor process) it is
/// that executor's address space, and the granules it maps are what the
/// device lends it; nothing of another tenant is ever mapped into it.
#[derive(Debug)]
struct Window {
    slot: TenantSlot,
    /// Closed by `close_tenant`; back to the pool once its last allocation
    /// is freed.
    closed: bool,
    /// Free addresses, as offsets from the window's base.
    va: RangeAlloc,
    /// Live allocations by device address. Launches hold a snapshot and
    /// read it without the lock; a change while one does copies the map.
    maps: Arc<BTreeMap<u64, Arc<Mapping>>>,
}

/// The device's address windows: window `i` spans
/// `[base + i * size, base + (i+1) * size)`, all inside the device's
/// [`DEVICE_VA_STRIDE`], so windows of different devices never meet.
#[derive(Debug)]
struct Windows {
    base: u64,
    size: u64,
    /// How many windows fit in the device's address range.
    count: u64,
    /// Windows in use (open, or closed but still holding allocations).
    live: BTreeMap<u64, Window>,
    /// Open tenant slots to their windows.
    by_slot: BTreeMap<TenantSlot, u64>,
    /// Windows handed back, below `next`.
    free: BTreeSet<u64>,
    /// Windows from here on were never used.
    next: u64,
}

impl Windows {
    fn new(base: u64, arena: u64) -> std::io::Result<Windows> {
        let size = arena.max(GRANULE).checked_next_multiple_of(WINDOW_ALIGN).unwrap_or(u64::MAX);
        let count = DEVICE_VA_STRIDE / size;
        if count == 0 {
            return Err(std::io::Error::other(format!("device memory and spill budget ({arena} bytes) exceed the device's address range ({DEVICE_VA_STRIDE} bytes)")));
        }
        Ok(Windows { base, size, count, live: BTreeMap::new(), by_slot: BTreeMap::new(), free: BTreeSet::new(), next: 0 })
    }

    /// Gives `slot` a window: the lowest one free.
    fn open(&mut self, slot: TenantSlot) -> Option<u64> {
        let idx = match self.free.pop_first() {
            Some(i) => i,
            None if self.next < self.count => {
                self.next += 1;
                self.next - 1
            }
            None => return None,
        };
        self.live.insert(idx, Window { slot, closed: false, va: RangeAlloc::new(self.size), maps: Arc::default() });
        self.by_slot.insert(slot, idx);
        Some(idx)
    }

    /// The next tenant to arrive gets window `first` (modulo the count):
    /// tenants in different processes (executors) get different addresses,
    /// so a pointer of one is no address of another's.
    fn start_at(&mut self, first: u64) -> std::io::Result<()> {
        if first >= self.count {
            return Err(std::io::Error::other(format!("address window {first} is beyond the device's {} (its memory and spill are too large for more tenants apart)", self.count)));
        }
        if self.live.is_empty() {
            self.next = first;
        }
        Ok(())
    }

    fn close(&mut self, slot: TenantSlot) {
        if let Some(idx) = self.by_slot.remove(&slot) {
            if let Some(w) = self.live.get_mut(&idx) {
                w.closed = true;
            }
            self.recycle_if_done(idx);
        }
    }

    fn recycle_if_done(&mut self, idx: u64) {
        if self.live.get(&idx).is_some_and(|w| w.closed && w.maps.is_empty()) {
            self.live.remove(&idx);
            self.free.insert(idx);
        }
    }

    /// The window `addr` lies in, if any.
    fn index_of(&self, addr: u64) -> Option<u64> {
        let i = addr.checked_sub(self.base)? / self.size;
        (i < self.count).then_some(i)
    }

    fn base_of(&self, idx: u64) -> u64 {
        self.base + idx * self.size
    }

    /// The live allocations of `slot`'s window (none if it has no window).
    fn maps_of(&self, slot: TenantSlot) -> Arc<BTreeMap<u64, Arc<Mapping>>> {
        self.by_slot.get(&slot).and_then(|i| self.live.get(i)).map(|w| w.maps.clone()).unwrap_or_default()
    }
}

/// Where the device's allocations are: in device memory (`memory` bytes)
/// or spilled to the host spill budget once device memory is full. The
/// budgets count bytes: where in the arena an allocation's granules lie
/// does not matter to them.
#[derive(Debug)]
struct Placement {
    /// Free granules of the arena.
    ranges: RangeAlloc,
    /// The tenants' address windows and their allocations.
    windows: Windows,
    /// Bytes of allocations held in device memory.
    resident: u64,
    /// Spilled allocations by age: sequence number to (address, length, tenant).
    spilled: BTreeMap<u64, (u64, u64, TenantSlot)>,
    /// Address of a spilled allocation to its sequence number.
    spilled_at: BTreeMap<u64, u64>,
    spilled_bytes: u64,
    by_tenant: BTreeMap<TenantSlot, u64>,
    next_seq: u64,
}

impl Placement {
    fn new(va_base: u64, arena: u64) -> std::io::Result<Placement> {
        Ok(Placement {
            ranges: RangeAlloc::new(arena),
            windows: Windows::new(va_base, arena)?,
            resident: 0,
            spilled: BTreeMap::new(),
            spilled_at: BTreeMap::new(),
            spilled_bytes: 0,
            by_tenant: BTreeMap::new(),
            next_seq: 0,
        })
    }

    fn unspill(&mut self, seq: u64) -> Option<(u64, u64, TenantSlot)> {
        let (addr, len, slot) = self.spilled.remove(&seq)?;
        self.spilled_at.remove(&addr);
        self.spilled_bytes -= len;
        if let Some(b) = self.by_tenant.get_mut(&slot) {
            *b -= len;
            if *b == 0 {
                self.by_tenant.remove(&slot);
            }
        }
        Some((addr, len, slot))
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
        Some(FunctionDesc { index, params: k.params.iter().map(|p| ParamDesc { offset: p.offset, size: p.size }).collect(), params_size: k.params_size, local_reserve: 0 })
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

/// Global memory as one tenant's kernel sees it: the allocations of its
/// table (`owned`), translated through its window's mappings (`maps`, a
/// snapshot taken at launch).
struct TenantView<'a> {
    backend: &'a CpuBackend,
    owned: &'a AllocTable,
    maps: &'a BTreeMap<u64, Arc<Mapping>>,
    /// The extent of the last access: device addresses `[start, end)` from
    /// arena offset `off` on.
    hit: (u64, u64, u64),
}

fn illegal(addr: u64, len: usize) -> ExecError {
    ExecError::IllegalAddress { kind: "global", addr, len, line: 0 }
}

/// The allocation of the tenant's table holding `[addr, addr+n)`, with its
/// start address, if its window maps it.
fn owned_mapping<'m>(owned: &AllocTable, maps: &'m BTreeMap<u64, Arc<Mapping>>, addr: u64, n: usize) -> Result<(u64, &'m Mapping), ExecError> {
    let (start, len) = owned.find(addr, n as u64).ok_or_else(|| illegal(addr, n))?;
    match maps.get(&start) {
        Some(m) if m.len >= len => Ok((start, m)),
        _ => Err(illegal(addr, n)),
    }
}

impl TenantView<'_> {
    /// The arena offset of `[addr, addr+n)` if the tenant owns it: `Some`
    /// when it lies in one extent (always, for a naturally aligned access),
    /// `None` when it crosses from one extent into the next.
    #[inline]
    fn check(&mut self, addr: u64, n: usize) -> Result<Option<u64>, ExecError> {
        let n64 = n as u64;
        let (s, e, off) = self.hit;
        if addr >= s && addr.wrapping_add(n64) <= e && addr.checked_add(n64).is_some() {
            return Ok(Some(addr - s + off));
        }
        self.miss(addr, n)
    }

    fn miss(&mut self, addr: u64, n: usize) -> Result<Option<u64>, ExecError> {
        let (start, m) = owned_mapping(self.owned, self.maps, addr, n)?;
        let rel = addr - start;
        let (es, ee, off) = m.extent(rel).ok_or_else(|| illegal(addr, n))?;
        if rel + n as u64 <= ee {
            self.hit = (start + es, start + ee, off);
            Ok(Some(off + (rel - es)))
        } else {
            Ok(None)
        }
    }

    /// Calls `f` for each piece of an access that crosses extents.
    fn split(&self, addr: u64, n: usize, f: impl FnMut(u64, std::ops::Range<usize>) -> Result<(), BackendError>) -> Result<(), ExecError> {
        let (start, m) = owned_mapping(self.owned, self.maps, addr, n)?;
        each_piece(m, addr - start, n as u64, f).map_err(|_| illegal(addr, n))
    }
}

impl GlobalMem for TenantView<'_> {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let arena = &self.backend.arena;
        match self.check(addr, out.len())? {
            Some(off) => arena.load_shared(off, out).map_err(|_| illegal(addr, out.len())),
            None => {
                let n = out.len();
                self.split(addr, n, |off, r| arena.load_shared(off, &mut out[r]))
            }
        }
    }
    fn atomic(&mut self, addr: u64, n: usize, f: &mut dyn FnMut(u64) -> u64) -> Result<u64, ExecError> {
        let off = self.check(addr, n)?;
        if !self.owned.1.is_empty() && self.owned.read_only(addr, n as u64) {
            return Err(ExecError::IllegalAddress { kind: "constant (atomic)", addr, len: n, line: 0 });
        }
        // An element across an extent boundary is not aligned to its size.
        let off = off.ok_or(ExecError::Misaligned { addr, len: n, line: 0 })?;
        self.backend.arena.rmw(off, n, f).map_err(|_| ExecError::Misaligned { addr, len: n, line: 0 })
    }
    fn fork(&self) -> Option<Box<dyn GlobalMem + Send + '_>> {
        Some(Box::new(TenantView { backend: self.backend, owned: self.owned, maps: self.maps, hit: (0, 0, 0) }))
    }
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        let off = self.check(addr, data.len())?;
        if !self.owned.1.is_empty() && self.owned.read_only(addr, data.len() as u64) {
            return Err(ExecError::IllegalAddress { kind: "constant (store)", addr, len: data.len(), line: 0 });
        }
        let arena = &self.backend.arena;
        match off {
            Some(off) => arena.store_shared(off, data).map_err(|_| illegal(addr, data.len())),
            None => self.split(addr, data.len(), |off, r| arena.store_shared(off, &data[r])),
        }
    }
}

impl CpuBackend {
    pub fn new(ordinal: u32, memory: u64, budget: u64) -> std::io::Result<CpuBackend> {
        let memory = memory / GRANULE * GRANULE;
        let va_base = DEVICE_VA_BASE + ordinal as u64 * DEVICE_VA_STRIDE;
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
            va_base,
            arena: Arena::new(memory.max(GRANULE) as usize)?,
            place: Mutex::new(Placement::new(va_base, memory)?),
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
        self.place = Mutex::new(Placement::new(self.va_base, total)?);
        self.arena = Arena::new(total.max(GRANULE) as usize)?;
        self.spill = spill;
        Ok(self)
    }

    fn placement(&self) -> std::sync::MutexGuard<'_, Placement> {
        self.place.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first tenant's address window (a tenant's executor is told a
    /// window no other live tenant of the device has).
    pub fn with_first_window(self, first: u64) -> std::io::Result<CpuBackend> {
        self.placement().windows.start_at(first)?;
        Ok(self)
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

    /// The allocation of tenant `slot` holding `[addr, addr+n)`, and the
    /// offset of `addr` in it. Another tenant's window, and any address of
    /// the tenant's own window outside its allocations, is an illegal
    /// address. The caller has checked the range against the tenant's
    /// table too; the allocation stays live while the operation runs (the
    /// worker holds back frees while the tenant has work in flight).
    fn resolve(&self, slot: TenantSlot, addr: u64, n: u64) -> Result<(Arc<Mapping>, u64), BackendError> {
        let illegal = |why: &str| BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, format!("{addr:#x}+{n} {why}"));
        let p = self.placement();
        let w = p.windows.index_of(addr).and_then(|i| p.windows.live.get(&i)).filter(|w| w.slot == slot).ok_or_else(|| illegal("is not in the tenant's address window"))?;
        let (start, m) = w.maps.range(..=addr).next_back().ok_or_else(|| illegal("is in none of the tenant's allocations"))?;
        let rel = addr - start;
        match rel.checked_add(n) {
            Some(end) if end <= m.len => Ok((m.clone(), rel)),
            _ => Err(illegal("is in none of the tenant's allocations")),
        }
    }

    /// Where the allocation at `addr` lies in the arena: `(offset, length)` runs.
    #[cfg(test)]
    fn runs_of(&self, slot: TenantSlot, addr: u64) -> Vec<(u64, u64)> {
        self.resolve(slot, addr, 1).map(|(m, _)| m.runs().collect()).unwrap_or_default()
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
    fn launch_timeout(&self) -> Option<Duration> {
        self.launch_timeout
    }

    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn alloc(&self, slot: TenantSlot, size: u64) -> Result<(u64, u64), BackendError> {
        if self.quarantined.load(Ordering::Relaxed) {
            return Err(BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "device quarantined after a failed scrub"));
        }
        // Even a zero-byte allocation takes a granule: every allocation has
        // an address of its own.
        let n = size.max(1).checked_next_multiple_of(GRANULE).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "size overflows"))?;
        let (addr, m) = {
            let mut p = self.placement();
            let memory = self.desc.memory;
            let spills = p.resident.saturating_add(n) > memory;
            if spills && p.spilled_bytes.saturating_add(n) > self.spill {
                let why = if self.spill == 0 {
                    format!("device memory is full ({} of {memory} bytes allocated) and the device has no host spill budget", p.resident)
                } else {
                    format!("device memory is full ({} of {memory} bytes allocated) and its host spill budget has {} of {} bytes left", p.resident, self.spill - p.spilled_bytes, self.spill)
                };
                return Err(BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("cannot place {n} bytes: {why}")));
            }
            let Placement { ranges, windows, .. } = &mut *p;
            // Slot 0 (a backend used without tenants) gets its window on
            // first use; tenants get theirs from `open_tenant`.
            let idx = match windows.by_slot.get(&slot) {
                Some(&i) => i,
                None if slot == 0 => windows.open(0).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "the device has no address window left"))?,
                None => return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("tenant slot {slot} is not open on this device"))),
            };
            let base = windows.base_of(idx);
            let w = windows.live.get_mut(&idx).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, format!("tenant slot {slot} has lost its address window")))?;
            let at =
                w.va.alloc(n).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("the tenant's own allocations leave no free range of {n} bytes in its address window")))?;
            // The budgets above leave at least `n` bytes free in the arena,
            // in one run or several.
            let Some(runs) = ranges.alloc_runs(n) else {
                w.va.free(at, n);
                return Err(BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("device has {} bytes free, fewer than {n}", ranges.free_bytes)));
            };
            let addr = base + at;
            let m = Arc::new(Mapping::from_runs(&runs));
            Arc::make_mut(&mut w.maps).insert(addr, m.clone());
            if spills {
                let seq = p.next_seq;
                p.next_seq += 1;
                p.spilled.insert(seq, (addr, n, slot));
                p.spilled_at.insert(addr, seq);
                p.spilled_bytes += n;
                *p.by_tenant.entry(slot).or_default() += n;
            } else {
                p.resident += n;
            }
            (addr, m)
        };
        // Scrub before hand-out: nobody sees the previous owner's bytes.
        // A range that fails it is given back, not handed out.
        for (off, len) in m.runs() {
            if let Err(e) = self.arena.scrub(off, len) {
                self.free(slot, addr, n);
                return Err(e);
            }
        }
        if !m.runs().all(|(off, len)| self.verify_scrub(off, len)) {
            self.quarantined.store(true, Ordering::Relaxed);
            self.free(slot, addr, n);
            return Err(BackendError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "scrub verification failed; device quarantined"));
        }
        self.scrubbed.fetch_add(n, Ordering::Relaxed);
        Ok((addr, n))
    }

    /// Frees the allocation at `addr` of tenant `slot`, whole (its own
    /// length is used); anything else is ignored.
    fn free(&self, slot: TenantSlot, addr: u64, _len: u64) {
        let mut p = self.placement();
        let Placement { ranges, windows, .. } = &mut *p;
        let Some(idx) = windows.index_of(addr) else { return };
        let base = windows.base_of(idx);
        let Some(w) = windows.live.get_mut(&idx).filter(|w| w.slot == slot) else { return };
        let Some(m) = Arc::make_mut(&mut w.maps).remove(&addr) else { return };
        w.va.free(addr - base, m.len);
        for (off, len) in m.runs() {
            ranges.free(off, len);
        }
        windows.recycle_if_done(idx);
        match p.spilled_at.get(&addr).copied() {
            Some(seq) => {
                p.unspill(seq);
            }
            None => p.resident = p.resident.saturating_sub(m.len),
        }
        p.return_spilled(self.desc.memory);
    }

    /// A tenant gets a slot and its own address window; it fails when every
    /// window of the device is taken (the device's address range holds
    /// `DEVICE_VA_STRIDE / window size` of them).
    fn open_tenant(&self, name: &str) -> Result<TenantSlot, BackendError> {
        let slot = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let mut p = self.placement();
        match p.windows.open(slot) {
            Some(_) => Ok(slot),
            None => Err(BackendError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("all {} address windows of the device are taken; none is left for tenant {name}", p.windows.count))),
        }
    }

    /// The tenant's window goes back to the pool once its allocations are
    /// freed (at once, normally: the service frees them first).
    fn close_tenant(&self, slot: TenantSlot) {
        self.placement().windows.close(slot);
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

    fn write(&self, slot: TenantSlot, addr: u64, data: VolatileSlice<'_>) -> Result<(), BackendError> {
        if data.is_empty() {
            return Ok(());
        }
        let (m, rel) = self.resolve(slot, addr, data.len() as u64)?;
        each_piece_preemptible(&m, rel, data.len() as u64, |off, r| {
            piece(&data, r.start, r.len())?.copy_to_volatile_slice(self.arena.volatile(off, r.len())?);
            Ok(())
        })
    }

    fn read(&self, slot: TenantSlot, addr: u64, out: VolatileSlice<'_>) -> Result<(), BackendError> {
        if out.is_empty() {
            return Ok(());
        }
        let (m, rel) = self.resolve(slot, addr, out.len() as u64)?;
        each_piece_preemptible(&m, rel, out.len() as u64, |off, r| {
            self.arena.volatile(off, r.len())?.copy_to_volatile_slice(piece(&out, r.start, r.len())?);
            Ok(())
        })
    }

    fn fill(&self, slot: TenantSlot, addr: u64, count: u64, elem: &[u8]) -> Result<(), BackendError> {
        let n = count.checked_mul(elem.len() as u64).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "memset size overflows"))?;
        if n == 0 {
            return Ok(());
        }
        let (m, rel) = self.resolve(slot, addr, n)?;
        each_piece_preemptible(&m, rel, n, |off, r| self.arena.fill_from(off, r.len() as u64, elem, r.start % elem.len()))
    }

    fn copy(&self, slot: TenantSlot, dst: u64, src: u64, len: u64) -> Result<(), BackendError> {
        if len == 0 {
            return Ok(());
        }
        let (dm, drel) = self.resolve(slot, dst, len)?;
        let (sm, srel) = self.resolve(slot, src, len)?;
        let outside = || BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, format!("copy {src:#x} -> {dst:#x} of {len} bytes left its allocation"));
        // Piece by piece, split where either side's extent ends. Within one
        // allocation the same address is the same arena byte, so a copy
        // onto its own later bytes runs back to front, as memmove does.
        // Bytes copied since the copy last stopped to be preempted.
        let mut since = 0;
        let mut stop = |c: u64| {
            since += c;
            if since >= CHECKPOINT_BYTES {
                preempt_point();
                since = 0;
            }
        };
        if Arc::ptr_eq(&dm, &sm) && drel > srel && drel < srel + len {
            let mut end = len;
            while end > 0 {
                let (d, da) = dm.piece_before(drel + end).ok_or_else(outside)?;
                let (s, sa) = sm.piece_before(srel + end).ok_or_else(outside)?;
                let c = da.min(sa).min(end).min(CHECKPOINT_BYTES);
                self.arena.copy(d - c, s - c, c)?;
                end -= c;
                if end > 0 {
                    stop(c);
                }
            }
        } else {
            let mut pos = 0;
            while pos < len {
                let (d, da) = dm.piece(drel + pos).ok_or_else(outside)?;
                let (s, sa) = sm.piece(srel + pos).ok_or_else(outside)?;
                let c = da.min(sa).min(len - pos).min(CHECKPOINT_BYTES);
                self.arena.copy(d, s, c)?;
                pos += c;
                if pos < len {
                    stop(c);
                }
            }
        }
        Ok(())
    }

    fn load_module(&self, slot: TenantSlot, image: &[u8], format: ImageFormat, host_limit: u64, data: &mut ModuleDataAlloc<'_>) -> Result<Arc<dyn DeviceModule>, BackendError> {
        let (major, minor) = self.desc.cc;
        let arch = major * 10 + minor;
        // A fatbin runs here through the best PTX it carries (or, if all of
        // it is newer than the device, the oldest: the interpreter does not
        // depend on the architecture a PTX names); a cubin (machine code
        // for a real GPU) cannot run at all.
        let ptx;
        let mut newer = false;
        // Bytes of text decompressed from a fatbin, held while it is parsed.
        let mut decompressed = 0u64;
        let image = match format {
            ImageFormat::Ptx => image,
            ImageFormat::Cubin => {
                return Err(BackendError::new(
                    CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU,
                    "cubin images are machine code for a real GPU; the CPU reference device runs PTX only (compile to PTX, e.g. nvrtc -arch=compute_XX)",
                ));
            }
            ImageFormat::Fatbin => {
                // The decompressed text counts against the tenant's host
                // memory budget, like the module parsed from it.
                let (text, is_newer) = virtio_gpu_compute::fatbin::ptx_for_interpreter(image, arch, host_limit)
                    .map_err(BackendError::fatbin)?
                    .ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, "the fatbin carries no PTX (its cubins cannot run on the CPU reference device)"))?;
                (ptx, newer) = (text, is_newer);
                decompressed = ptx.capacity() as u64;
                &ptx[..]
            }
        };
        let text = std::str::from_utf8(image.strip_suffix(&[0]).unwrap_or(image)).map_err(|_| BackendError::new(CuResult::CUDA_ERROR_INVALID_PTX, "PTX image is not valid UTF-8 text"))?;
        // The parse gets what the decompressed text leaves of the budget.
        let mut m = Module::parse_within(text, host_limit.saturating_sub(decompressed)).map_err(BackendError::ptx)?;
        if m.target > arch && !newer {
            return Err(BackendError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, format!("the module targets sm_{}, newer than this device's compute capability {major}.{minor}", m.target)));
        }
        let g = if m.global_size > 0 { data(m.global_size, false)? } else { 0 };
        let c = if m.const_size > 0 { data(m.const_size, true)? } else { 0 };
        for (addr, mut bytes) in m.link(g, c) {
            self.write(slot, addr, VolatileSlice::from(&mut bytes[..]))?;
        }
        Ok(Arc::new(CpuModule(m)))
    }

    fn launch(&self, slot: TenantSlot, module: &dyn DeviceModule, func: usize, l: &Launch, params: &[u8], owned: &AllocTable) -> Result<u64, BackendError> {
        let m = module.as_any().downcast_ref::<CpuModule>().ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "module belongs to another backend"))?;
        let k = m.0.kernels.get(func).ok_or_else(|| BackendError::new(CuResult::CUDA_ERROR_INVALID_HANDLE, "no such function"))?;
        // Only the tenant's own window translates: a table naming another
        // tenant's address still faults.
        let maps = self.placement().windows.maps_of(slot);
        let mut view = TenantView { backend: self, owned, maps: &maps, hit: (0, 0, 0) };
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
        let run = vgpu_arbiter::grant::with_preempt(|cur| ptx::launch(k, &cfg, params, &mut view, &ptx::Limits { preempt: cur, ..limits }));
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

    /// Copies to and from plain buffers, as the worker's copies do
    /// through volatile views.
    trait Bytes {
        fn rd(&self, slot: TenantSlot, addr: u64, out: &mut [u8]) -> Result<(), BackendError>;
        fn wr(&self, slot: TenantSlot, addr: u64, data: &[u8]) -> Result<(), BackendError>;
    }

    impl<B: Backend + ?Sized> Bytes for B {
        fn rd(&self, slot: TenantSlot, addr: u64, out: &mut [u8]) -> Result<(), BackendError> {
            self.read(slot, addr, VolatileSlice::from(out))
        }

        fn wr(&self, slot: TenantSlot, addr: u64, data: &[u8]) -> Result<(), BackendError> {
            self.write(slot, addr, VolatileSlice::from(&mut data.to_vec()[..]))
        }
    }

    #[test]
    fn freed_range_is_reused_and_handed_out_zeroed() {
        let b = CpuBackend::new(0, 1 << 20, 0).unwrap();
        let (a, n) = b.alloc(0, 100_000).unwrap();
        b.fill(0, a, n, &[0xAB]).unwrap();
        b.free(0, a, n);
        let (a2, n2) = b.alloc(0, 100_000).unwrap();
        assert_eq!((a, n), (a2, n2), "first fit reuses the range");
        let mut buf = vec![1u8; n2 as usize];
        b.rd(0, a2, &mut buf).unwrap();
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
        b.rd(bob, b1.0, &mut out).unwrap();
        assert!(out.iter().all(|x| *x == 0x5A), "data is intact after spill and return");
        b.free(bob, b1.0, b1.1);
        b.free(bob, b2.0, b2.1);
        b.free(bob, b3.0, b3.1);
        assert_eq!(b.placement().resident, 0);
        // Without a budget, a full device refuses.
        let plain = CpuBackend::new(0, 2 * k, 0).unwrap();
        let t = plain.open_tenant("t").unwrap();
        plain.alloc(t, 2 * k).unwrap();
        assert!(plain.alloc(t, GRANULE).unwrap_err().msg.contains("no host spill budget"));
    }

    #[test]
    fn a_spill_that_does_not_fit_holds_back_later_ones() {
        let k = 64 * GRANULE;
        let b = CpuBackend::new(0, 4 * k, 0).unwrap().with_spill(8 * k).unwrap();
        let [t1, t2, t3] = ["t1", "t2", "t3"].map(|n| b.open_tenant(n).unwrap());
        let resident = [b.alloc(t1, 2 * k).unwrap(), b.alloc(t1, 2 * k).unwrap()];
        let big = b.alloc(t2, 3 * k).unwrap();
        let small = b.alloc(t3, k).unwrap();
        assert_eq!(b.spill_usage().0, 4 * k);
        b.free(t1, resident[0].0, resident[0].1);
        // 2k free: the 3k spill, first in line, does not fit; the 1k one waits behind it.
        assert_eq!((b.spilled(t2), b.spilled(t3)), (3 * k, k));
        b.free(t1, resident[1].0, resident[1].1);
        assert_eq!((b.spilled(t2), b.spilled(t3)), (0, 0));
        b.free(t2, big.0, big.1);
        b.free(t3, small.0, small.1);
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
        b.rd(0, c, &mut buf).unwrap();
        assert_eq!(buf, [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]);
        let l = Launch { grid: [1, 1, 1], block: [1, 1, 1], shared_bytes: 0 };
        let e = b.launch(0, &*m, 0, &l, &[], &owned).unwrap_err();
        assert_eq!(e.code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, "{}", e.msg);
        assert!(e.msg.contains("constant"), "{}", e.msg);
        // The load before the faulting store went through.
        let mut word = [0u8; 4];
        b.rd(0, g, &mut word).unwrap();
        assert_eq!(u32::from_le_bytes(word), 3);
        // The host writes constant memory through the module's symbol.
        b.wr(0, c, &[9; 16]).unwrap();
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
            b.rd(0, a, &mut buf).unwrap();
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

    const INC_PTX: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry inc(.param .u64 p, .param .u32 n) {\n .reg .pred %p1;\n .reg .b32 %r<7>;\n .reg .b64 %rd<4>;\n ld.param.u64 %rd1, [p];\n ld.param.u32 %r6, [n];\n mov.u32 %r2, %ctaid.x;\n mov.u32 %r3, %ntid.x;\n mov.u32 %r4, %tid.x;\n mad.lo.s32 %r2, %r2, %r3, %r4;\n setp.ge.u32 %p1, %r2, %r6;\n @%p1 bra DONE;\n mul.wide.u32 %rd2, %r2, 4;\n add.s64 %rd3, %rd1, %rd2;\n ld.global.u32 %r5, [%rd3];\n add.s32 %r5, %r5, 1;\n st.global.u32 [%rd3], %r5;\n atom.global.add.u32 %r5, [%rd3], 1;\nDONE:\n ret;\n}\n";

    /// The text a fatbin's PTX decompresses to is held while it is
    /// parsed: the two share the load's host budget, never getting it
    /// twice over.
    #[test]
    fn a_fatbins_ptx_text_and_its_parse_share_one_host_budget() {
        use virtio_gpu_compute::fatbin::{build, KIND_PTX};
        let b = CpuBackend::new(0, 1 << 20, 0).unwrap();
        let text = INC_PTX.as_bytes();
        let load = |image: &[u8], format, limit| b.load_module(0, image, format, limit, &mut |_, _| unreachable!());
        // The least budget the PTX parses within on its own.
        let (mut lo, mut hi) = (0u64, 1 << 24);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if load(text, ImageFormat::Ptx, mid).is_ok() {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let (parse, t) = (lo, text.len() as u64);
        assert!(parse > 0);
        let fat = build::image(&[build::entry(KIND_PTX, 70, 0x11, text, 0)]);
        // Enough for the text, and enough for the parse, but not for both.
        let e = load(&fat, ImageFormat::Fatbin, parse.max(t)).err().expect("a load within the larger of the two");
        assert_eq!(e.code, CuResult::CUDA_ERROR_OUT_OF_MEMORY, "{}", e.msg);
        assert!(load(&fat, ImageFormat::Fatbin, parse + t + 16).is_ok());
    }

    fn inc(b: &CpuBackend, slot: TenantSlot, owned: &AllocTable, p: u64, words: u32) -> Result<u64, BackendError> {
        let m = b.load_module(slot, INC_PTX.as_bytes(), ImageFormat::Ptx, u64::MAX, &mut |_, _| unreachable!()).unwrap();
        let mut params = p.to_le_bytes().to_vec();
        params.extend_from_slice(&words.to_le_bytes());
        let l = Launch { grid: [words.div_ceil(256), 1, 1], block: [256, 1, 1], shared_bytes: 0 };
        b.launch(slot, &*m, 0, &l, &params, owned)
    }

    /// The security finding: a 512-byte allocation of one tenant, placed
    /// mid-arena, denied another tenant (holding nothing) its whole quota
    /// in one piece in a fully backed pool ("device has no free range").
    #[test]
    fn a_small_allocation_mid_arena_does_not_deny_another_tenant_its_whole_quota() {
        const MIB: u64 = 1 << 20;
        let b = CpuBackend::new(0, 64 * MIB, 0).unwrap().with_spill(64 * MIB).unwrap();
        let (ta, tb) = (b.open_tenant("a").unwrap(), b.open_tenant("b").unwrap());
        // B fills device memory but one granule, A's 512 bytes follow, B
        // lets go: two free runs of 64 MiB - 256 bytes, A in between.
        let lower = b.alloc(tb, 64 * MIB - GRANULE).unwrap();
        let small = b.alloc(ta, 512).unwrap();
        b.wr(ta, small.0, &[0xA5; 512]).unwrap();
        b.free(tb, lower.0, lower.1);
        let big = b.alloc(tb, 64 * MIB).expect("a fully backed quota is allocatable in one piece");
        assert_eq!(big.1, 64 * MIB);
        assert_eq!((b.spilled(ta), b.spilled(tb)), (0, 64 * MIB), "spill counts bytes, not places");
        assert_eq!(b.available(), 64 * MIB - 512);
        // Every byte of it holds what B writes.
        let whole: Vec<u8> = (0..big.1).map(|i| (i / 4096) as u8 ^ i as u8).collect();
        b.wr(tb, big.0, &whole).unwrap();
        let mut back = vec![0u8; whole.len()];
        b.rd(tb, big.0, &mut back).unwrap();
        assert!(back == whole);
        // Two runs: all of the lower one, then a granule past A's bytes.
        assert_eq!(b.runs_of(tb, big.0), vec![(0, 64 * MIB - GRANULE), (64 * MIB + GRANULE, GRANULE)]);
        // Copies, fills and kernels over its last 4 KiB, across the seam.
        let tail = big.0 + big.1 - 4096;
        let mut model = whole[whole.len() - 4096..].to_vec();
        b.copy(tb, tail + 1, tail, 3000).unwrap();
        model.copy_within(0..3000, 1);
        b.copy(tb, tail, tail + 7, 4000).unwrap();
        model.copy_within(7..4007, 0);
        let mut got = vec![0u8; 4096];
        b.rd(tb, tail, &mut got).unwrap();
        assert_eq!(got, model, "overlapping copies are memmoves");
        b.copy(tb, big.0, tail, 4096).unwrap();
        b.copy(tb, tail, big.0 + 8192, 4096).unwrap();
        b.rd(tb, big.0, &mut got).unwrap();
        assert_eq!(got, model);
        // Odd start: the seam falls mid-element.
        b.fill(tb, tail + 1, 2047, &[0x34, 0x12]).unwrap();
        b.rd(tb, tail, &mut got).unwrap();
        assert_eq!((got[0], got[4095]), (whole[8192], whole[8192 + 4095]));
        assert!(got[1..4095].chunks(2).all(|c| c == [0x34, 0x12]), "a two-byte fill keeps its phase across the seam");
        let mut owned = AllocTable::default();
        owned.0.insert(big.0, big.1);
        b.fill(tb, tail, 1024, &7u32.to_le_bytes()).unwrap();
        inc(&b, tb, &owned, tail, 1024).unwrap();
        b.rd(tb, tail, &mut got).unwrap();
        assert!(got.chunks(4).all(|w| u32::from_le_bytes(w.try_into().unwrap()) == 9), "kernel loads, stores and atomics");
        // Kernel accesses that straddle the seam are split; an atomic there
        // is misaligned; addresses outside the table's allocations fault.
        let seam = big.0 + big.1 - GRANULE;
        let maps = b.placement().windows.maps_of(tb);
        let mut view = TenantView { backend: &b, owned: &owned, maps: &maps, hit: (0, 0, 0) };
        view.store(seam - 3, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        let mut word = [0u8; 8];
        view.load(seam - 3, &mut word).unwrap();
        assert_eq!(word, [1, 2, 3, 4, 5, 6, 7, 8]);
        word = [0; 8];
        b.rd(tb, seam - 3, &mut word).unwrap();
        assert_eq!(word, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert!(matches!(view.atomic(seam - 2, 4, &mut |v| v + 1), Err(ExecError::Misaligned { .. })));
        assert_eq!(view.atomic(seam, 4, &mut |v| v + 1).unwrap(), 0x0706_0504);
        for (addr, n) in [(small.0, 4), (big.0 + big.1 - 4, 8), (big.0 + big.1, 1), (big.0 - 4, 4)] {
            assert!(matches!(view.load(addr, &mut word[..n]), Err(ExecError::IllegalAddress { .. })), "{addr:#x}");
            assert!(matches!(view.store(addr, &word[..n]), Err(ExecError::IllegalAddress { .. })), "{addr:#x}");
        }
        // A's bytes are untouched, and not B's to reach.
        let mut mine = [0u8; 512];
        b.rd(ta, small.0, &mut mine).unwrap();
        assert_eq!(mine, [0xA5; 512]);
        assert_eq!(b.rd(tb, small.0, &mut mine).unwrap_err().code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(b.wr(tb, small.0, &mine).unwrap_err().code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(b.rd(tb, big.0 + big.1, &mut mine[..1]).unwrap_err().code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS);
        let mut stolen = owned.clone();
        stolen.0.insert(small.0, small.1);
        assert_eq!(inc(&b, tb, &owned, small.0, 4).unwrap_err().code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(inc(&b, tb, &stolen, small.0, 4).unwrap_err().code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, "a forged table does not reach another window");
        b.rd(ta, small.0, &mut mine).unwrap();
        assert_eq!(mine, [0xA5; 512]);
        b.free(tb, big.0, big.1);
        b.free(ta, small.0, small.1);
        assert_eq!(b.available(), 128 * MIB);
    }

    #[test]
    fn tenant_windows_are_disjoint_bounded_and_reused_after_close() {
        let win = 1u64 << 36;
        let b = CpuBackend::new(3, win, 0).unwrap();
        let base = DEVICE_VA_BASE + 3 * DEVICE_VA_STRIDE;
        let slots: Vec<TenantSlot> = (0..DEVICE_VA_STRIDE / win).map(|i| b.open_tenant(&format!("t{i}")).unwrap()).collect();
        assert_eq!(slots.len(), 16);
        let e = b.open_tenant("late").unwrap_err();
        assert_eq!(e.code, CuResult::CUDA_ERROR_OUT_OF_MEMORY);
        assert!(e.msg.contains("all 16 address windows"), "{}", e.msg);
        // Each tenant's first allocation opens its own window.
        let firsts: Vec<(u64, u64)> = slots.iter().map(|&t| b.alloc(t, 100).unwrap()).collect();
        for (i, (a, n)) in firsts.iter().enumerate() {
            assert_eq!((*a, *n), (base + i as u64 * win, GRANULE));
        }
        assert_eq!(b.rd(slots[1], firsts[0].0, &mut [0; 4]).unwrap_err().code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS);
        // A closed window holding an allocation is not handed out; once
        // freed, it is, with nothing of the old tenant in it.
        b.close_tenant(slots[2]);
        assert!(b.open_tenant("late").is_err());
        b.free(slots[2], firsts[2].0, firsts[2].1);
        let again = b.open_tenant("again").unwrap();
        assert_eq!(b.rd(again, firsts[2].0, &mut [0; 4]).unwrap_err().code, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(b.alloc(again, 1).unwrap().0, firsts[2].0);
        // Slots never opened have no window.
        assert_eq!(b.alloc(999, 1).unwrap_err().code, CuResult::CUDA_ERROR_INVALID_CONTEXT);
        // Another tenant's freed granules come back scrubbed, at an address
        // of the new owner's window.
        let d = CpuBackend::new(0, 1 << 20, 0).unwrap();
        let (p, q) = (d.open_tenant("p").unwrap(), d.open_tenant("q").unwrap());
        let x = d.alloc(p, 8192).unwrap();
        d.fill(p, x.0, x.1, &[0xEE]).unwrap();
        let runs = d.runs_of(p, x.0);
        d.free(p, x.0, x.1);
        let y = d.alloc(q, 8192).unwrap();
        assert_ne!(y.0, x.0);
        assert_eq!(d.runs_of(q, y.0), runs, "the same granules");
        let mut buf = vec![1u8; 8192];
        d.rd(q, y.0, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0));
        // An arena larger than the device's address range is refused.
        assert!(CpuBackend::new(0, 1 << 39, 0).unwrap().with_spill(1 << 40).is_err());
    }
}
