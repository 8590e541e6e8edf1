//! Port-I/O and MMIO buses: address ranges mapped to devices. Accesses to
//! unmapped addresses are logged (rate-limited) and ignored; reads of them
//! return all ones, as on a real bus.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Whether the `n`th (from 0) of a guest-caused event is logged: the first
/// few, then every 1024th, so a guest cannot flood the host's log.
pub fn worth_logging(n: u64) -> bool {
    n < 16 || n.is_multiple_of(1024)
}

pub trait BusDevice: Send {
    /// `offset` is relative to the range's base.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{kind} range {base:#x}+{len:#x} overlaps an existing device")]
pub struct Overlap {
    pub kind: &'static str,
    pub base: u64,
    pub len: u64,
}

pub struct Bus {
    kind: &'static str,
    ranges: RwLock<BTreeMap<u64, (u64, SharedDevice)>>,
    unmapped: AtomicU64,
}

impl Bus {
    pub fn new(kind: &'static str) -> Bus {
        Bus { kind, ranges: RwLock::new(BTreeMap::new()), unmapped: AtomicU64::new(0) }
    }

    pub fn insert(&self, base: u64, len: u64, dev: SharedDevice) -> Result<(), Overlap> {
        let mut r = self.ranges.write().unwrap_or_else(|e| e.into_inner());
        let end = base.checked_add(len).ok_or(Overlap { kind: self.kind, base, len })?;
        let clash = len == 0 || r.range(..end).next_back().is_some_and(|(b, (l, _))| b + l > base);
        if clash {
            return Err(Overlap { kind: self.kind, base, len });
        }
        r.insert(base, (len, dev));
        Ok(())
    }

    pub fn remove(&self, base: u64) -> Option<SharedDevice> {
        self.ranges.write().unwrap_or_else(|e| e.into_inner()).remove(&base).map(|(_, d)| d)
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, SharedDevice)> {
        let r = self.ranges.read().unwrap_or_else(|e| e.into_inner());
        let (base, (len, dev)) = r.range(..=addr).next_back()?;
        let end = addr.checked_add(size as u64)?;
        (end <= base + len).then(|| (addr - base, dev.clone()))
    }

    /// Accesses that reached no device so far.
    pub fn unmapped_accesses(&self) -> u64 {
        self.unmapped.load(Ordering::Relaxed)
    }

    fn miss(&self, what: &str, addr: u64, len: usize) {
        let n = self.unmapped.fetch_add(1, Ordering::Relaxed);
        if worth_logging(n) {
            tracing::warn!(bus = self.kind, addr = format_args!("{addr:#x}"), len, "guest {what} of an unmapped address ignored ({} so far)", n + 1);
        }
    }

    pub fn read(&self, addr: u64, data: &mut [u8]) {
        match self.find(addr, data.len()) {
            Some((off, dev)) => dev.lock().unwrap_or_else(|e| e.into_inner()).read(off, data),
            None => {
                data.fill(0xff);
                self.miss("read", addr, data.len());
            }
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) {
        match self.find(addr, data.len()) {
            Some((off, dev)) => dev.lock().unwrap_or_else(|e| e.into_inner()).write(off, data),
            None => self.miss("write", addr, data.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl BusDevice for Reg {
        fn read(&mut self, _: u64, d: &mut [u8]) {
            d.fill(self.0);
        }
        fn write(&mut self, _: u64, d: &[u8]) {
            self.0 = d[0];
        }
    }

    #[test]
    fn ranges_route_refuse_overlap_and_unmapped_reads_float_high() {
        let b = Bus::new("pio");
        b.insert(0x10, 8, Arc::new(Mutex::new(Reg(1)))).unwrap();
        assert!(b.insert(0x14, 8, Arc::new(Mutex::new(Reg(2)))).is_err());
        assert!(b.insert(0x8, 9, Arc::new(Mutex::new(Reg(2)))).is_err());
        b.insert(0x18, 8, Arc::new(Mutex::new(Reg(2)))).unwrap();
        b.write(0x11, &[7]);
        let mut d = [0u8; 2];
        b.read(0x16, &mut d);
        assert_eq!(d, [7, 7]);
        b.read(0x17, &mut d); // straddles two devices: unmapped
        assert_eq!(d, [0xff, 0xff]);
        b.read(0x100, &mut d);
        assert_eq!(b.unmapped_accesses(), 2);
        assert!(b.remove(0x18).is_some());
    }
}
