//! Device memory: every allocation of the process in one address space,
//! as on NVIDIA's driver, where a context's MMU mappings are the process's.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use vgpu_ptx::{ExecError, GlobalMem};

/// Where device addresses start (a unified-addressing-like range).
pub const BASE: u64 = 0x7f40_0000_0000;
/// Unmapped bytes after each allocation: a kernel running off its end
/// faults instead of reaching the next one.
const GUARD: u64 = 64 << 10;
const ALIGN: u64 = 512;

/// One allocation. Its bytes are atomics: kernels on several host threads
/// and the stream threads touch them at once.
pub struct Alloc {
    pub base: u64,
    pub len: u64,
    /// The context that made it (freed with that context).
    pub ctx: u64,
    bytes: Box<[AtomicU8]>,
}

impl Alloc {
    fn new(base: u64, len: u64, ctx: u64) -> Option<Alloc> {
        let n = usize::try_from(len).ok()?;
        let layout = Layout::array::<AtomicU8>(n.max(1)).ok()?;
        // SAFETY: the layout has a non-zero size. Zeroed memory is a valid
        // AtomicU8 (same layout as u8), and a large zeroed allocation comes
        // from mmap, so untouched pages cost nothing.
        let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<AtomicU8>();
        if p.is_null() {
            return None;
        }
        // SAFETY: p points to n.max(1) initialised AtomicU8s from the global
        // allocator with exactly this layout, owned by the box from now on.
        let bytes = unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n.max(1))) };
        Some(Alloc { base, len, ctx, bytes })
    }

    fn range(&self, addr: u64, len: usize) -> Option<std::ops::Range<usize>> {
        let off = addr.checked_sub(self.base)?;
        let end = off.checked_add(len as u64)?;
        (end <= self.len).then_some(off as usize..end as usize)
    }
}

pub struct Heap {
    map: RwLock<BTreeMap<u64, Arc<Alloc>>>,
    next: Mutex<u64>,
    used: AtomicU64,
    /// Serialises atomic read-modify-writes to the same word.
    rmw: [Mutex<()>; 64],
}

impl Default for Heap {
    fn default() -> Heap {
        Heap::new()
    }
}

impl Heap {
    pub fn new() -> Heap {
        Heap { map: RwLock::new(BTreeMap::new()), next: Mutex::new(BASE), used: AtomicU64::new(0), rmw: std::array::from_fn(|_| Mutex::new(())) }
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// A zeroed allocation of `len` bytes for `ctx`, if `limit` allows.
    pub fn alloc(&self, ctx: u64, len: u64, limit: u64) -> Option<u64> {
        let len = len.max(1);
        let rounded = len.checked_next_multiple_of(ALIGN)?;
        if self.used.fetch_add(rounded, Ordering::Relaxed).saturating_add(rounded) > limit {
            self.used.fetch_sub(rounded, Ordering::Relaxed);
            return None;
        }
        let base = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let b = *next;
            *next = b.saturating_add(rounded).saturating_add(GUARD);
            b
        };
        let Some(a) = Alloc::new(base, len, ctx) else {
            self.used.fetch_sub(rounded, Ordering::Relaxed);
            return None;
        };
        self.map.write().unwrap_or_else(|e| e.into_inner()).insert(base, Arc::new(a));
        Some(base)
    }

    /// Takes `len` bytes of the device's memory that no allocation names
    /// (what the driver keeps for itself, as kernels' local memory), if
    /// `limit` allows.
    pub fn reserve(&self, len: u64, limit: u64) -> bool {
        if self.used.fetch_add(len, Ordering::Relaxed).saturating_add(len) > limit {
            self.used.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Gives back what [`Heap::reserve`] took.
    pub fn unreserve(&self, len: u64) {
        self.used.fetch_sub(len, Ordering::Relaxed);
    }

    /// Frees the allocation starting exactly at `base`.
    pub fn free(&self, base: u64) -> bool {
        let gone = self.map.write().unwrap_or_else(|e| e.into_inner()).remove(&base);
        if let Some(a) = &gone {
            self.used.fetch_sub(a.len.next_multiple_of(ALIGN), Ordering::Relaxed);
        }
        gone.is_some()
    }

    /// Frees everything `ctx` allocated.
    pub fn free_ctx(&self, ctx: u64) {
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        let gone: Vec<u64> = map.values().filter(|a| a.ctx == ctx).map(|a| a.base).collect();
        for b in gone {
            if let Some(a) = map.remove(&b) {
                self.used.fetch_sub(a.len.next_multiple_of(ALIGN), Ordering::Relaxed);
            }
        }
    }

    /// The allocation holding all of `[addr, addr+len)`, and where.
    pub fn find(&self, addr: u64, len: usize) -> Option<(Arc<Alloc>, std::ops::Range<usize>)> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        let (_, a) = map.range(..=addr).next_back()?;
        let r = a.range(addr, len)?;
        Some((a.clone(), r))
    }

    pub fn load(&self, addr: u64, out: &mut [u8]) -> bool {
        let Some((a, r)) = self.find(addr, out.len()) else { return false };
        for (o, b) in out.iter_mut().zip(&a.bytes[r]) {
            *o = b.load(Ordering::Relaxed);
        }
        true
    }

    pub fn store(&self, addr: u64, data: &[u8]) -> bool {
        let Some((a, r)) = self.find(addr, data.len()) else { return false };
        for (b, v) in a.bytes[r].iter().zip(data) {
            b.store(*v, Ordering::Relaxed);
        }
        true
    }

    /// Writes `count` copies of `elem` from `addr`.
    pub fn fill(&self, addr: u64, elem: &[u8], count: u64) -> bool {
        let Some(len) = count.checked_mul(elem.len() as u64).and_then(|n| usize::try_from(n).ok()) else { return false };
        let Some((a, r)) = self.find(addr, len) else { return false };
        for (i, b) in a.bytes[r].iter().enumerate() {
            b.store(elem[i % elem.len()], Ordering::Relaxed);
        }
        true
    }

    pub fn copy(&self, dst: u64, src: u64, len: u64) -> bool {
        let Ok(n) = usize::try_from(len) else { return false };
        let (Some((s, sr)), Some((d, dr))) = (self.find(src, n), self.find(dst, n)) else { return false };
        let tmp: Vec<u8> = s.bytes[sr].iter().map(|b| b.load(Ordering::Relaxed)).collect();
        for (b, v) in d.bytes[dr].iter().zip(tmp) {
            b.store(v, Ordering::Relaxed);
        }
        true
    }

    /// Copies `len` bytes of host memory at `src` to device memory.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes for the whole call. Others
    /// may write it meanwhile (a tenant's shared buffer, guest RAM): it is
    /// read byte by byte through volatile loads, never borrowed.
    pub unsafe fn from_host(&self, dst: u64, src: *const u8, len: usize) -> bool {
        let Some((a, r)) = self.find(dst, len) else { return false };
        for (i, b) in a.bytes[r].iter().enumerate() {
            // SAFETY: i < len and the caller guarantees src..src+len is readable.
            b.store(unsafe { src.add(i).read_volatile() }, Ordering::Relaxed);
        }
        true
    }

    /// Copies device memory to `len` bytes of host memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be writable for `len` bytes for the whole call; it is
    /// written through volatile stores, never borrowed.
    pub unsafe fn to_host(&self, dst: *mut u8, src: u64, len: usize) -> bool {
        let Some((a, r)) = self.find(src, len) else { return false };
        for (i, b) in a.bytes[r].iter().enumerate() {
            // SAFETY: i < len and the caller guarantees dst..dst+len is writable.
            unsafe { dst.add(i).write_volatile(b.load(Ordering::Relaxed)) };
        }
        true
    }
}

/// A kernel's view of device memory: every allocation of the process.
pub struct KernelMem<'a> {
    pub heap: &'a Heap,
}

fn fault(addr: u64, len: usize) -> ExecError {
    ExecError::IllegalAddress { kind: "global", addr, len, line: 0 }
}

impl GlobalMem for KernelMem<'_> {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        if self.heap.load(addr, out) {
            Ok(())
        } else {
            Err(fault(addr, out.len()))
        }
    }

    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        if self.heap.store(addr, data) {
            Ok(())
        } else {
            Err(fault(addr, data.len()))
        }
    }

    fn atomic(&mut self, addr: u64, n: usize, f: &mut dyn FnMut(u64) -> u64) -> Result<u64, ExecError> {
        if !addr.is_multiple_of(n as u64) {
            return Err(ExecError::Misaligned { addr, len: n, line: 0 });
        }
        let _g = self.heap.rmw[(addr >> 3) as usize % 64].lock().unwrap_or_else(|e| e.into_inner());
        let mut buf = [0u8; 8];
        self.load(addr, &mut buf[..n])?;
        let old = u64::from_le_bytes(buf);
        self.store(addr, &f(old).to_le_bytes()[..n])?;
        Ok(old)
    }

    fn fork(&self) -> Option<Box<dyn GlobalMem + Send + '_>> {
        Some(Box::new(KernelMem { heap: self.heap }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_zeroed_bounded_and_separated() {
        let h = Heap::new();
        let a = h.alloc(1, 100, 1 << 20).unwrap();
        let b = h.alloc(2, 100, 1 << 20).unwrap();
        assert!(b >= a + 100 + GUARD, "a guard gap between allocations");
        let mut out = [9u8; 100];
        assert!(h.load(a, &mut out));
        assert_eq!(out, [0u8; 100]);
        assert!(h.store(a + 90, &[7; 10]));
        assert!(!h.store(a + 91, &[7; 10]), "past the end");
        assert!(!h.load(a + 100, &mut [0u8; 1]));
        assert!(h.fill(b, &[1, 2], 50));
        assert!(h.copy(a, b, 4));
        let mut four = [0u8; 4];
        h.load(a, &mut four);
        assert_eq!(four, [1, 2, 1, 2]);
        // The limit counts every allocation of the process.
        assert!(h.alloc(3, 1 << 20, 1 << 20).is_none());
        h.free_ctx(1);
        assert!(!h.load(a, &mut four));
        assert!(h.free(b));
        assert!(!h.free(b));
        assert_eq!(h.used(), 0);
    }
}
