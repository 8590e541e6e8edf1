//! PCI: configuration mechanism #1 at ports 0xCF8/0xCFC, one bus with a
//! host bridge at slot 0, memory BARs (32-bit, or 64-bit for passthrough
//! devices) allocated from the MMIO hole and moved on the MMIO bus when the
//! guest reprograms them, and the KVM interrupt routing table that MSI-X
//! vectors are added to.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kvm_bindings::{kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI};
use kvm_ioctls::VmFd;

use crate::bus::{Bus, BusDevice};
use crate::memory::{HIGH_BAR_MIN, PCI_MMIO_END, PCI_MMIO_START};

pub const CONFIG_ADDRESS_PORT: u64 = 0xcf8;
pub const MAX_SLOTS: usize = 32;
const NUM_BARS: usize = 6;
const BAR0: usize = 0x10;
pub const CAP_START: usize = 0x40;

/// The 256-byte configuration space of one function, with the mask of
/// bits the guest may write and the BARs it declares.
pub struct ConfigSpace {
    pub bytes: [u8; 256],
    wmask: [u8; 256],
    /// Size of each memory BAR (0: absent).
    pub bar_size: [u64; NUM_BARS],
    next_cap: usize,
}

impl ConfigSpace {
    pub fn new(vendor: u16, device: u16, class: u8, subclass: u8, prog_if: u8, revision: u8) -> ConfigSpace {
        let mut c = ConfigSpace { bytes: [0; 256], wmask: [0; 256], bar_size: [0; NUM_BARS], next_cap: CAP_START };
        c.set16(0, vendor);
        c.set16(2, device);
        c.bytes[8] = revision;
        c.bytes[9] = prog_if;
        c.bytes[0xa] = subclass;
        c.bytes[0xb] = class;
        // Command: I/O, memory, bus master, INTx disable are writable.
        c.wmask[4] = 0x07;
        c.wmask[5] = 0x04;
        c.bytes[0x3d] = 0; // no INTx pin
        c.wmask[0x3c] = 0xff; // interrupt line is scratch for the OS
        c
    }

    pub fn set16(&mut self, off: usize, v: u16) {
        self.bytes[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }

    pub fn set32(&mut self, off: usize, v: u32) {
        self.bytes[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }

    pub fn get16(&self, off: usize) -> u16 {
        u16::from_le_bytes([self.bytes[off], self.bytes[off + 1]])
    }

    pub fn get32(&self, off: usize) -> u32 {
        u32::from_le_bytes(self.bytes[off..off + 4].try_into().unwrap_or([0; 4]))
    }

    pub fn set_subsystem(&mut self, vendor: u16, id: u16) {
        self.set16(0x2c, vendor);
        self.set16(0x2e, id);
    }

    /// Declares a 32-bit, non-prefetchable memory BAR of `size` (a power of two).
    pub fn add_mem_bar(&mut self, bar: usize, size: u64) {
        debug_assert!(size.is_power_of_two() && size >= 16 && bar < NUM_BARS);
        self.bar_size[bar] = size;
        let off = BAR0 + bar * 4;
        let mask = !(size as u32 - 1);
        self.wmask[off..off + 4].copy_from_slice(&mask.to_le_bytes());
    }

    /// Declares a memory BAR of `size` (a power of two, at least 16) with
    /// the type bits given: 64-bit ones take registers `bar` and `bar + 1`
    /// (the high half is writable where the size allows). The type bits
    /// (3:0) stay read-only.
    pub fn add_mem_bar_typed(&mut self, bar: usize, size: u64, is64: bool, prefetchable: bool) {
        if !size.is_power_of_two() || size < 16 || bar >= NUM_BARS || (is64 && bar + 1 >= NUM_BARS) || (!is64 && size > 1 << 31) {
            return;
        }
        self.bar_size[bar] = size;
        let off = BAR0 + bar * 4;
        let mask = !(size - 1);
        let flags = if is64 { 0b100u32 } else { 0 } | if prefetchable { 0b1000 } else { 0 };
        self.set32(off, flags);
        self.wmask[off..off + 4].copy_from_slice(&((mask as u32) & !0xf).to_le_bytes());
        if is64 {
            self.bar_size[bar + 1] = 0;
            self.set32(off + 4, 0);
            self.wmask[off + 4..off + 8].copy_from_slice(&((mask >> 32) as u32).to_le_bytes());
        }
    }

    /// Whether `bar` is the low half of a 64-bit memory BAR.
    pub fn bar_is_64(&self, bar: usize) -> bool {
        bar + 1 < NUM_BARS && self.get32(BAR0 + bar * 4) & 0b111 == 0b100
    }

    /// Writes a BAR's address, keeping its type bits.
    pub fn set_bar_addr(&mut self, bar: usize, addr: u64) {
        let off = BAR0 + bar * 4;
        let flags = self.get32(off) & 0xf;
        self.set32(off, (addr as u32 & !0xf) | flags);
        if self.bar_is_64(bar) {
            self.set32(off + 4, (addr >> 32) as u32);
        }
    }

    /// Sets the mask of guest-writable bits of one byte.
    pub fn set_wmask(&mut self, off: usize, mask: u8) {
        if let Some(m) = self.wmask.get_mut(off) {
            *m = mask;
        }
    }

    /// Appends a capability whose body is `body` (without the id/next
    /// header), making `writable` bytes of the body guest-writable.
    /// Returns the capability's offset.
    pub fn add_cap(&mut self, id: u8, body: &[u8], writable: &[(usize, u8)]) -> usize {
        let off = self.next_cap;
        let len = 2 + body.len();
        assert!(off + len <= 256, "capability list overflows config space");
        self.bytes[off] = id;
        self.bytes[off + 1] = 0;
        self.bytes[off + 2..off + len].copy_from_slice(body);
        for (i, m) in writable {
            self.wmask[off + 2 + i] = *m;
        }
        if off == CAP_START {
            self.bytes[0x34] = off as u8;
            self.bytes[6] |= 0x10; // status: capability list present
        } else {
            // Link from the previous capability.
            let mut p = CAP_START;
            while self.bytes[p + 1] != 0 {
                p = self.bytes[p + 1] as usize;
            }
            self.bytes[p + 1] = off as u8;
        }
        self.next_cap = (off + len + 3) & !3;
        off
    }

    pub fn bar_addr(&self, bar: usize) -> u64 {
        let lo = (self.get32(BAR0 + bar * 4) & !0xf) as u64;
        if self.bar_is_64(bar) {
            lo | (self.get32(BAR0 + bar * 4 + 4) as u64) << 32
        } else {
            lo
        }
    }

    pub fn memory_enabled(&self) -> bool {
        self.bytes[4] & 0x2 != 0
    }

    /// Applies a guest write through the write mask.
    pub fn write(&mut self, off: usize, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            let o = off + i;
            if o < 256 {
                self.bytes[o] = (self.bytes[o] & !self.wmask[o]) | (b & self.wmask[o]);
            }
        }
    }

    pub fn read(&self, off: usize, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            *d = self.bytes.get(off + i).copied().unwrap_or(0xff);
        }
    }
}

/// A PCI function the root complex can route config and BAR accesses to.
pub trait PciDevice: Send {
    /// The config space: the BAR registers, sizes and the command register
    /// in it are what the root complex places BARs by.
    fn config(&mut self) -> &mut ConfigSpace;
    /// Config space writes that need more than the mask (e.g. MSI-X enable).
    fn config_written(&mut self, _off: usize, _len: usize) {}
    /// A guest config read of `data.len()` (1, 2 or 4) bytes at `off`,
    /// within one dword. By default, from [`PciDevice::config`].
    fn config_read(&mut self, off: usize, data: &mut [u8]) {
        self.config().read(off, data)
    }
    /// A guest config write, within one dword. By default, through the
    /// write mask of [`PciDevice::config`], then [`PciDevice::config_written`].
    fn config_write(&mut self, off: usize, data: &[u8]) {
        self.config().write(off, data);
        self.config_written(off, data.len());
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]);
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]);
    /// The BAR now decodes at `addr` (memory decoding enabled).
    fn bar_placed(&mut self, _bar: usize, _addr: u64) {}
    /// The BAR no longer decodes where it was placed (decoding disabled, or
    /// about to move).
    fn bar_unmapped(&mut self, _bar: usize) {}
}

pub type SharedPci = Arc<Mutex<dyn PciDevice>>;

/// Whether a BAR of `size` bytes may decode at `addr`: in the 32-bit hole,
/// or (a 64-bit BAR) in the window `high` above RAM.
fn in_window(addr: u64, size: u64, wide: bool, high: (u64, u64)) -> bool {
    let inside = |lo: u64, hi: u64| addr >= lo && addr.checked_add(size).is_some_and(|end| end <= hi);
    inside(PCI_MMIO_START, PCI_MMIO_END) || (wide && inside(high.0, high.1))
}

/// One BAR of one device, as an MMIO bus range.
struct BarWindow {
    dev: SharedPci,
    bar: usize,
}

impl BusDevice for BarWindow {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.dev.lock().unwrap_or_else(|e| e.into_inner()).bar_read(self.bar, offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.dev.lock().unwrap_or_else(|e| e.into_inner()).bar_write(self.bar, offset, data)
    }
}

struct HostBridge(ConfigSpace);

impl PciDevice for HostBridge {
    fn config(&mut self) -> &mut ConfigSpace {
        &mut self.0
    }
    fn bar_read(&mut self, _: usize, _: u64, data: &mut [u8]) {
        data.fill(0xff)
    }
    fn bar_write(&mut self, _: usize, _: u64, _: &[u8]) {}
}

struct Slot {
    dev: SharedPci,
    /// Where each BAR is mapped on the MMIO bus now.
    mapped: [Option<u64>; NUM_BARS],
}

/// The root complex: config mechanism #1 and BAR placement.
pub struct PciRoot {
    address: u32,
    slots: Vec<Option<Slot>>,
    mmio: Arc<Bus>,
    next_bar: u64,
    /// The window above RAM for large 64-bit BARs, and its next free
    /// address.
    high: (u64, u64),
    next_high: u64,
}

impl PciRoot {
    /// `high` is the window for large 64-bit BARs
    /// ([`crate::memory::high_mmio_window`]).
    pub fn new(mmio: Arc<Bus>, high: (u64, u64)) -> PciRoot {
        let mut slots: Vec<Option<Slot>> = (0..MAX_SLOTS).map(|_| None).collect();
        let bridge = ConfigSpace::new(0x8086, 0x0d57, 0x06, 0x00, 0, 0);
        slots[0] = Some(Slot { dev: Arc::new(Mutex::new(HostBridge(bridge))), mapped: [None; NUM_BARS] });
        PciRoot { address: 0, slots, mmio, next_bar: PCI_MMIO_START, high, next_high: high.0 }
    }

    /// A naturally aligned address for a BAR of `size` bytes: large 64-bit
    /// BARs above RAM, the rest in the 32-bit hole (a 64-bit BAR that does
    /// not fit there goes high too).
    fn place(&mut self, size: u64, wide: bool) -> Option<u64> {
        let aligned = |from: u64, end: u64| from.checked_add(size - 1).map(|a| a & !(size - 1)).filter(|a| a.checked_add(size).is_some_and(|e| e <= end));
        let low = if wide && size >= HIGH_BAR_MIN { None } else { aligned(self.next_bar, PCI_MMIO_END) };
        if let Some(a) = low {
            self.next_bar = a + size;
            return Some(a);
        }
        let a = aligned(self.next_high, self.high.1).filter(|_| wide)?;
        self.next_high = a + size;
        Some(a)
    }

    /// Adds a device at the next free slot, assigns its BARs and maps them.
    pub fn add(&mut self, dev: SharedPci) -> Result<usize, String> {
        let slot = self.slots.iter().position(|s| s.is_none()).ok_or("no free PCI slot")?;
        let mut mapped = [None; NUM_BARS];
        {
            let mut d = dev.lock().unwrap_or_else(|e| e.into_inner());
            for (bar, placed) in mapped.iter_mut().enumerate() {
                let size = d.config().bar_size[bar];
                if size == 0 {
                    continue;
                }
                let wide = d.config().bar_is_64(bar);
                let Some(addr) = self.place(size, wide) else {
                    let high = if wide { format!(" or in {:#x}..{:#x} above RAM", self.high.0, self.high.1) } else { " (a 32-bit BAR)".into() };
                    return Err(format!("PCI MMIO window exhausted: BAR {bar} of {size:#x} bytes fits neither below {PCI_MMIO_END:#x}{high}"));
                };
                d.config().set_bar_addr(bar, addr);
                self.mmio.insert(addr, size, Arc::new(Mutex::new(BarWindow { dev: dev.clone(), bar }))).map_err(|e| e.to_string())?;
                d.bar_placed(bar, addr);
                *placed = Some(addr);
            }
        }
        self.slots[slot] = Some(Slot { dev, mapped });
        Ok(slot)
    }

    /// The function the address register selects, and the register offset.
    fn target(&self) -> Option<(usize, usize)> {
        let a = self.address;
        if a & 0x8000_0000 == 0 {
            return None;
        }
        let bus = (a >> 16) & 0xff;
        let slot = ((a >> 11) & 0x1f) as usize;
        let func = (a >> 8) & 0x7;
        if bus != 0 || func != 0 {
            return None;
        }
        Some((slot, (a & 0xfc) as usize))
    }

    /// Moves BARs the guest reprogrammed (or whose decoding it toggled).
    fn remap(&mut self, slot: usize) {
        let high = self.high;
        let Some(s) = self.slots[slot].as_mut() else { return };
        let mut d = s.dev.lock().unwrap_or_else(|e| e.into_inner());
        for bar in 0..NUM_BARS {
            let size = d.config().bar_size[bar];
            if size == 0 {
                continue;
            }
            let want = d.config().memory_enabled().then(|| d.config().bar_addr(bar));
            let wide = d.config().bar_is_64(bar);
            if want == s.mapped[bar] {
                continue;
            }
            if let Some(old) = s.mapped[bar].take() {
                self.mmio.remove(old);
                d.bar_unmapped(bar);
            }
            if let Some(addr) = want {
                // A BAR placed over RAM's MMIO neighbours or another device
                // is refused; the guest sees the device not respond there.
                let ok = in_window(addr, size, wide, high);
                if ok && self.mmio.insert(addr, size, Arc::new(Mutex::new(BarWindow { dev: s.dev.clone(), bar }))).is_ok() {
                    s.mapped[bar] = Some(addr);
                    d.bar_placed(bar, addr);
                } else {
                    static REFUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                    if crate::bus::worth_logging(REFUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        tracing::warn!(slot, bar, addr = format_args!("{addr:#x}"), "guest placed a BAR outside the PCI windows or over another device; not mapped");
                    }
                }
            }
        }
    }
}

impl BusDevice for PciRoot {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => data.copy_from_slice(&self.address.to_le_bytes()),
            4..=7 => {
                let reg = offset as usize - 4;
                match self.target().and_then(|(slot, off)| self.slots[slot].as_ref().map(|s| (s.dev.clone(), off))) {
                    Some((dev, off)) if reg + data.len() <= 4 => dev.lock().unwrap_or_else(|e| e.into_inner()).config_read(off + reg, data),
                    _ => data.fill(0xff),
                }
            }
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            0 if data.len() == 4 => self.address = u32::from_le_bytes([data[0], data[1], data[2], data[3]]),
            4..=7 => {
                let reg = offset as usize - 4;
                let Some((slot, off)) = self.target() else { return };
                let Some(s) = self.slots[slot].as_ref() else { return };
                if reg + data.len() > 4 {
                    return;
                }
                s.dev.lock().unwrap_or_else(|e| e.into_inner()).config_write(off + reg, data);
                if (4..0x28).contains(&(off + reg)) {
                    self.remap(slot);
                }
            }
            _ => {}
        }
    }
}

/// The VM's GSI routing table: the default irqchip routes for GSIs 0–23
/// plus one MSI route per allocated MSI-X vector. KVM replaces the whole
/// table on every update, so it is kept here.
pub struct IrqRouting {
    vm: Arc<VmFd>,
    msi: Mutex<BTreeMap<u32, Option<(u64, u32)>>>,
    next_gsi: Mutex<u32>,
}

pub const FIRST_MSI_GSI: u32 = 24;

impl IrqRouting {
    pub fn new(vm: Arc<VmFd>) -> IrqRouting {
        IrqRouting { vm, msi: Mutex::new(BTreeMap::new()), next_gsi: Mutex::new(FIRST_MSI_GSI) }
    }

    pub fn vm(&self) -> &VmFd {
        &self.vm
    }

    pub fn allocate_gsi(&self) -> u32 {
        let mut g = self.next_gsi.lock().unwrap_or_else(|e| e.into_inner());
        let v = *g;
        *g += 1;
        v
    }

    /// Points `gsi` at an MSI (address, data), or removes its route.
    pub fn set_msi(&self, gsi: u32, msg: Option<(u64, u32)>) -> Result<(), String> {
        let mut m = self.msi.lock().unwrap_or_else(|e| e.into_inner());
        m.insert(gsi, msg);
        let table = routing_entries(&m);
        let mut r = KvmIrqRouting::new(0).map_err(|e| format!("{e:?}"))?;
        for e in table {
            r.push(e).map_err(|e| format!("{e:?}"))?;
        }
        self.vm.set_gsi_routing(&r).map_err(|e| format!("KVM_SET_GSI_ROUTING: {e}"))
    }
}

fn irqchip(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry { gsi, type_: KVM_IRQ_ROUTING_IRQCHIP, ..Default::default() };
    e.u.irqchip.irqchip = chip;
    e.u.irqchip.pin = pin;
    e
}

/// The full table KVM gets: the defaults (PIC for 0–15, IOAPIC for 0–23)
/// and every live MSI route.
pub fn routing_entries(msi: &BTreeMap<u32, Option<(u64, u32)>>) -> Vec<kvm_irq_routing_entry> {
    let mut v = Vec::new();
    for gsi in 0..24u32 {
        if gsi < 8 {
            v.push(irqchip(gsi, KVM_IRQCHIP_PIC_MASTER, gsi));
        } else if gsi < 16 {
            v.push(irqchip(gsi, KVM_IRQCHIP_PIC_SLAVE, gsi - 8));
        }
        if gsi != 2 {
            v.push(irqchip(gsi, KVM_IRQCHIP_IOAPIC, gsi));
        }
    }
    for (gsi, m) in msi {
        if let Some((addr, data)) = m {
            let mut e = kvm_irq_routing_entry { gsi: *gsi, type_: KVM_IRQ_ROUTING_MSI, ..Default::default() };
            e.u.msi.address_lo = *addr as u32;
            e.u.msi.address_hi = (*addr >> 32) as u32;
            e.u.msi.data = *data;
            v.push(e);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dummy(ConfigSpace);
    impl PciDevice for Dummy {
        fn config(&mut self) -> &mut ConfigSpace {
            &mut self.0
        }
        fn bar_read(&mut self, _: usize, off: u64, d: &mut [u8]) {
            d.fill(off as u8)
        }
        fn bar_write(&mut self, _: usize, _: u64, _: &[u8]) {}
    }

    fn cfg_read(root: &mut PciRoot, slot: u32, reg: u32) -> u32 {
        root.write(0, &(0x8000_0000 | (slot << 11) | reg).to_le_bytes());
        let mut d = [0u8; 4];
        root.read(4, &mut d);
        u32::from_le_bytes(d)
    }

    fn cfg_write(root: &mut PciRoot, slot: u32, reg: u32, v: u32) {
        root.write(0, &(0x8000_0000 | (slot << 11) | reg).to_le_bytes());
        root.write(4, &v.to_le_bytes());
    }

    #[test]
    fn bar_sizing_and_reprogramming_move_the_mmio_window() {
        let mmio = Arc::new(Bus::new("mmio"));
        let mut root = PciRoot::new(mmio.clone(), (1 << 36, 1 << 40));
        let mut c = ConfigSpace::new(0x1af4, 0x1044, 0xff, 0, 0, 1);
        c.add_mem_bar(0, 0x4000);
        let slot = root.add(Arc::new(Mutex::new(Dummy(c)))).unwrap() as u32;
        assert_eq!(slot, 1);
        assert_eq!(cfg_read(&mut root, 0, 0) & 0xffff, 0x8086, "host bridge at slot 0");
        assert_eq!(cfg_read(&mut root, 1, 0), 0x1044_1af4);
        assert_eq!(cfg_read(&mut root, 9, 0), 0xffff_ffff, "empty slot");
        let bar = cfg_read(&mut root, 1, 0x10) as u64;
        assert_eq!(bar, PCI_MMIO_START);
        let mut d = [0u8; 1];
        mmio.read(bar + 5, &mut d);
        assert_eq!(d[0], 5);
        // Sizing: all ones reads back the size mask.
        cfg_write(&mut root, 1, 0x10, 0xffff_ffff);
        assert_eq!(cfg_read(&mut root, 1, 0x10), !(0x4000u32 - 1));
        // Enable decoding at a new address: the window moves.
        cfg_write(&mut root, 1, 0x10, 0xd000_0000);
        cfg_write(&mut root, 1, 0x4, 0x2);
        mmio.read(0xd000_0007, &mut d);
        assert_eq!(d[0], 7);
        mmio.read(bar + 5, &mut d);
        assert_eq!(d[0], 0xff, "old window is gone");
        // Read-only fields stay put.
        cfg_write(&mut root, 1, 0, 0);
        assert_eq!(cfg_read(&mut root, 1, 0), 0x1044_1af4);
        // A disabled address register or another bus reads all ones.
        root.write(0, &0x0000_0800u32.to_le_bytes());
        let mut w = [0u8; 4];
        root.read(4, &mut w);
        assert_eq!(w, [0xff; 4]);
    }

    /// A device with a 64-bit BAR that counts placements and unmappings.
    struct Wide(ConfigSpace, Vec<Option<u64>>);
    impl PciDevice for Wide {
        fn config(&mut self) -> &mut ConfigSpace {
            &mut self.0
        }
        fn bar_read(&mut self, _: usize, _: u64, d: &mut [u8]) {
            d.fill(0)
        }
        fn bar_write(&mut self, _: usize, _: u64, _: &[u8]) {}
        fn bar_placed(&mut self, _: usize, addr: u64) {
            self.1.push(Some(addr));
        }
        fn bar_unmapped(&mut self, _: usize) {
            self.1.push(None);
        }
    }

    #[test]
    fn sixty_four_bit_bars_keep_their_type_size_in_two_registers_and_report_unmapping() {
        let mmio = Arc::new(Bus::new("mmio"));
        let mut root = PciRoot::new(mmio.clone(), (1 << 36, 1 << 40));
        let mut c = ConfigSpace::new(0x1b36, 0x0010, 0x01, 0x08, 0x02, 0);
        c.add_mem_bar_typed(0, 0x4000, true, false);
        let dev = Arc::new(Mutex::new(Wide(c, Vec::new())));
        let slot = root.add(dev.clone()).unwrap() as u32;
        assert_eq!(cfg_read(&mut root, slot, 0x10), PCI_MMIO_START as u32 | 0b100, "address with the 64-bit type bits");
        assert_eq!(cfg_read(&mut root, slot, 0x14), 0);
        // Sizing both halves.
        cfg_write(&mut root, slot, 0x10, 0xffff_ffff);
        cfg_write(&mut root, slot, 0x14, 0xffff_ffff);
        assert_eq!(cfg_read(&mut root, slot, 0x10), 0xffff_c004);
        assert_eq!(cfg_read(&mut root, slot, 0x14), 0xffff_ffff);
        // Decoding is off (command 0): the window went, the device was told.
        assert_eq!(dev.lock().unwrap().1, [Some(PCI_MMIO_START), None]);
        // Placed at 0xd000_0000, then decoding on: mapped there.
        cfg_write(&mut root, slot, 0x10, 0xd000_0000);
        cfg_write(&mut root, slot, 0x14, 0);
        cfg_write(&mut root, slot, 0x4, 0x2);
        assert_eq!(dev.lock().unwrap().1.last(), Some(&Some(0xd000_0000)));
        // Above 4 GiB (or wrapping past the end): refused, not mapped, no panic.
        cfg_write(&mut root, slot, 0x14, 0xffff_ffff);
        cfg_write(&mut root, slot, 0x10, 0xffff_f000);
        assert_eq!(dev.lock().unwrap().1.last(), Some(&None));
        let mut d = [0u8; 4];
        mmio.read(0xd000_0000, &mut d);
        assert_eq!(d, [0xff; 4]);
    }

    #[test]
    fn large_sixty_four_bit_bars_go_above_ram_and_may_move_only_there() {
        let mmio = Arc::new(Bus::new("mmio"));
        let high = (1u64 << 36, 1u64 << 40);
        let mut root = PciRoot::new(mmio.clone(), high);
        // A GPU-like device: a 16 MiB 32-bit register BAR, a 64 GiB and a
        // 32 MiB 64-bit BAR.
        let mut c = ConfigSpace::new(0x10de, 0x2330, 0x03, 0x02, 0, 0);
        c.add_mem_bar_typed(0, 16 << 20, false, false);
        c.add_mem_bar_typed(1, 64 << 30, true, true);
        c.add_mem_bar_typed(3, 32 << 20, true, true);
        let dev = Arc::new(Mutex::new(Wide(c, Vec::new())));
        let slot = root.add(dev.clone()).unwrap() as u32;
        let addr = |root: &mut PciRoot, bar: u32| cfg_read(root, slot, 0x10 + bar * 4) as u64 & !0xf | (cfg_read(root, slot, 0x14 + bar * 4) as u64) << 32;
        assert_eq!(cfg_read(&mut root, slot, 0x10) as u64 & !0xf, PCI_MMIO_START, "the small 32-bit BAR stays low");
        assert_eq!(addr(&mut root, 1), 1 << 36, "the 64 GiB BAR starts the high window, aligned to its size");
        assert!(addr(&mut root, 3) < PCI_MMIO_END, "a small 64-bit BAR shares the hole");
        assert!(dev.lock().unwrap().1.contains(&Some(1 << 36)), "{:x?}", dev.lock().unwrap().1);
        // The guest moves the big BAR within the window: mapped there.
        cfg_write(&mut root, slot, 0x4, 0);
        cfg_write(&mut root, slot, 0x14, 0x0);
        cfg_write(&mut root, slot, 0x18, 0x20);
        cfg_write(&mut root, slot, 0x4, 0x2);
        assert!(dev.lock().unwrap().1.ends_with(&[Some(0x20_0000_0000), Some(PCI_MMIO_START + (32 << 20))]), "{:x?}", dev.lock().unwrap().1);
        // Past the window's end: refused.
        cfg_write(&mut root, slot, 0x18, 0x1_0000);
        assert_eq!(dev.lock().unwrap().1.last(), Some(&None));
        // Over guest RAM below the window (4 GiB here): refused.
        cfg_write(&mut root, slot, 0x18, 0x1);
        assert_eq!(dev.lock().unwrap().1.last(), Some(&None));
        // A 32-bit BAR moves within the hole.
        let mut c = ConfigSpace::new(0x1af4, 0x1044, 0xff, 0, 0, 1);
        c.add_mem_bar(0, 0x4000);
        let narrow = Arc::new(Mutex::new(Wide(c, Vec::new())));
        let s2 = root.add(narrow.clone()).unwrap() as u32;
        cfg_write(&mut root, s2, 0x4, 0x2);
        cfg_write(&mut root, s2, 0x10, 0xe000_0000);
        assert_eq!(narrow.lock().unwrap().1.last(), Some(&Some(0xe000_0000)));
        // A 64-bit BAR too big for the window, and any 32-bit BAR that
        // does not fit the hole, are refused at start.
        let mut c = ConfigSpace::new(0x10de, 0x2330, 0x03, 0x02, 0, 0);
        c.add_mem_bar_typed(0, 2 << 40, true, true);
        let e = root.add(Arc::new(Mutex::new(Wide(c, Vec::new())))).err().unwrap();
        assert!(e.contains("fits neither below 0xfec00000 or in 0x1000000000..0x10000000000 above RAM"), "{e}");
    }

    #[test]
    fn routing_keeps_irqchip_defaults_and_adds_msi_routes() {
        let mut m = BTreeMap::new();
        m.insert(24, Some((0xfee0_0000, 0x41)));
        m.insert(25, None);
        let t = routing_entries(&m);
        assert_eq!(t.iter().filter(|e| e.type_ == KVM_IRQ_ROUTING_MSI).count(), 1);
        assert_eq!(t.iter().filter(|e| e.type_ == KVM_IRQ_ROUTING_IRQCHIP).count(), 16 + 23);
    }
}
