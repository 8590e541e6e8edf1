//! A host PCI function passed through with VFIO, as a device on the
//! guest's root complex.
//!
//! Config space: read from the real device through the VFIO config region,
//! except what is emulated here: the command register (memory decoding,
//! bus mastering and INTx disable are passed on), the BARs (the guest sees
//! the addresses our root assigned and sizes from the VFIO region info;
//! the real BARs are never written), the expansion ROM (absent), the
//! interrupt pin (none: no INTx), the capability pointers (MSI is hidden
//! when there is MSI-X), MSI-X's enable and function-mask bits, and the
//! whole MSI capability of a device without MSI-X. Other writes go to
//! vfio-pci, which filters what a user may change.
//!
//! BARs: the mmap-able parts of a memory BAR become KVM memory slots at the
//! BAR's guest address, except the pages holding the MSI-X table and PBA;
//! everything else (those pages, parts VFIO will not map, BARs under a
//! page) traps to the MMIO bus and goes through VFIO region reads and
//! writes, with the table and PBA emulated. A guest that moves a BAR or
//! turns decoding off has its slots removed, and re-added where it points.
//!
//! Interrupts: MSI-X, or MSI on a device without MSI-X; no INTx. Each
//! vector has an eventfd that VFIO signals (VFIO_DEVICE_SET_IRQS,
//! ACTION_TRIGGER) and that is also the KVM irqfd of the vector's GSI,
//! whose route is the vector's (address, data); see [`super::msix`] and
//! [`super::msi`]. A device that raises no interrupt at all passes too.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use kvm_bindings::{kvm_create_device, kvm_device_type_KVM_DEV_TYPE_VFIO, kvm_userspace_memory_region};
use kvm_ioctls::VmFd;
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioDeviceFd, VfioOps, VfioRegionInfoCap};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::msi::{Msi, MsiSink};
use super::msix::{MsixTable, VectorSink, VectorWires, CTL_ENABLE, CTL_MASK_ALL, MAX_VECTORS};
use super::{PciAddress, VfioError};
use crate::devices::pci::{ConfigSpace, IrqRouting, PciDevice};
use crate::memory::SlotAllocator;

const PAGE: u64 = 4096;
const NUM_BARS: usize = 6;
const CAP_MSI: u8 = 0x05;
const CAP_MSIX: u8 = 0x11;
const COMMAND: usize = 0x04;
/// Command bits the guest controls on the real device: memory space,
/// bus master, INTx disable.
const COMMAND_PASSED: u16 = 0x0002 | 0x0004 | 0x0400;
const COMMAND_MEMORY: u16 = 0x0002;

/// One VFIO container for the VM: every passthrough device's group joins
/// it, and guest RAM is DMA-mapped in it once (IOVA = guest physical).
pub struct VfioContext {
    container: Arc<VfioContainer>,
    mem: GuestMemoryMmap,
    ram_mapped: bool,
    slots: Arc<SlotAllocator>,
}

impl VfioContext {
    /// Opens /dev/vfio/vfio and KVM's VFIO pseudo-device (which tells KVM
    /// about non-coherent DMA; a host without it goes on without).
    pub fn new(vm: &VmFd, mem: GuestMemoryMmap, slots: Arc<SlotAllocator>) -> Result<VfioContext, String> {
        let mut cd = kvm_create_device { type_: kvm_device_type_KVM_DEV_TYPE_VFIO, fd: 0, flags: 0 };
        let kvm_dev = match vm.create_device(&mut cd) {
            Ok(fd) => Some(Arc::new(VfioDeviceFd::new_from_kvm(fd))),
            Err(e) => {
                tracing::warn!("KVM's VFIO device is not available ({e}); going on without it");
                None
            }
        };
        let container = VfioContainer::new(kvm_dev).map_err(|e| format!("{e} (are the vfio and vfio_iommu_type1 modules loaded?)"))?;
        Ok(VfioContext { container: Arc::new(container), mem, ram_mapped: false, slots })
    }
}

/// A part of a BAR mapped from the device into this process, and its KVM
/// slot while the BAR is placed.
struct Area {
    /// Offset in the BAR, page-aligned.
    off: u64,
    len: u64,
    /// Host address of the mapping (an mmap of the VFIO device fd).
    host: usize,
    slot: Option<u32>,
}

struct Bar {
    /// VFIO region size (the real BAR's size).
    region_size: u64,
    areas: Vec<Area>,
    /// The guest address the slots are at.
    placed: Option<u64>,
}

/// The MSI-X capability and where its table and PBA live.
struct MsixPlace {
    cap: usize,
    table_bar: usize,
    table_off: u64,
    pba_bar: usize,
    pba_off: u64,
}

/// Where a device without MSI-X has its table: past config space and past
/// the last BAR, so no config or BAR access ever reaches it.
const NO_MSIX: MsixPlace = MsixPlace { cap: 0x1000, table_bar: NUM_BARS, table_off: 0, pba_bar: NUM_BARS, pba_off: 0 };

/// What the MSI-X table drives: VFIO's trigger eventfds, KVM's routes and irqfds.
struct Wiring<'a> {
    addr: PciAddress,
    dev: &'a VfioDevice,
    routing: &'a IrqRouting,
    fds: &'a [EventFd],
    gsis: &'a [u32],
}

/// Failures a guest can cause again and again are logged rate-limited.
static WIRING_ERRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn log_wiring() -> bool {
    crate::bus::worth_logging(WIRING_ERRORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

impl MsiSink for Wiring<'_> {
    fn enable(&mut self, n: usize) -> bool {
        let r = if n > 0 { self.dev.enable_msi(self.fds.iter().take(n).collect()) } else { self.dev.disable_msi() };
        if n == 0 {
            // Counts left in the eventfds would fire at the next enable.
            for fd in self.fds {
                let _ = fd.read();
            }
        }
        match r {
            Ok(()) => true,
            Err(e) => {
                if log_wiring() {
                    tracing::warn!(device = %self.addr, "VFIO MSI {}: {e}", if n > 0 { "enable" } else { "disable" });
                }
                false
            }
        }
    }
}

impl VectorSink for Wiring<'_> {
    fn set_enabled(&mut self, on: bool) {
        let r = if on { self.dev.enable_msix(self.fds.iter().collect()) } else { self.dev.disable_msix() };
        if let Err(e) = r {
            if log_wiring() {
                tracing::warn!(device = %self.addr, "VFIO MSI-X {}: {e}", if on { "enable" } else { "disable" });
            }
        }
    }
}

impl VectorWires for Wiring<'_> {
    fn route(&mut self, v: usize, address: u64, data: u32) {
        if let Err(e) = self.routing.set_msi(self.gsis[v], Some((address, data))) {
            if log_wiring() {
                tracing::warn!(device = %self.addr, "MSI vector {v}: {e}");
            }
        }
    }

    fn deliver(&mut self, v: usize, on: bool) {
        let vm = self.routing.vm();
        let r = if on { vm.register_irqfd(&self.fds[v], self.gsis[v]) } else { vm.unregister_irqfd(&self.fds[v], self.gsis[v]) };
        if let Err(e) = r {
            if log_wiring() {
                tracing::warn!(device = %self.addr, "MSI vector {v}: KVM_IRQFD: {e}");
            }
        }
    }
}

pub struct VfioPci {
    addr: PciAddress,
    /// The guest's view of the emulated registers (command, BARs, line).
    cfg: ConfigSpace,
    /// Capability pointer (0x34) as the guest reads it.
    first_cap: u8,
    /// (offset of a kept capability's "next" byte, value the guest reads).
    next_ptr: Vec<(usize, u8)>,
    /// Config bytes whose writes are dropped (hidden capabilities).
    hidden: Vec<(usize, usize)>,
    bars: [Option<Bar>; NUM_BARS],
    msix: MsixTable,
    place: MsixPlace,
    /// A device without MSI-X but with MSI: its capability's offset and
    /// the emulated registers.
    msi: Option<(usize, Msi)>,
    fds: Vec<EventFd>,
    gsis: Vec<u32>,
    routing: Arc<IrqRouting>,
    vm: Arc<VmFd>,
    slots: Arc<SlotAllocator>,
    /// Declared last: closed after the rest is torn down.
    dev: VfioDevice,
}

fn vfio_err(addr: PciAddress, what: &'static str) -> impl Fn(vfio_ioctls::VfioError) -> VfioError {
    move |e| VfioError::Vfio { addr, what, err: e.to_string() }
}

/// `[start, end)` minus each range of `holes`, in order.
fn subtract(start: u64, end: u64, holes: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = vec![(start, end)];
    for &(hs, he) in holes {
        out = out.into_iter().flat_map(|(s, e)| if he <= s || hs >= e { vec![(s, e)] } else { [(s, hs.max(s)), (he.min(e), e)].into_iter().filter(|(a, b)| a < b).collect() }).collect();
    }
    out
}

impl VfioPci {
    /// Opens the device at `addr` (checked beforehand by
    /// [`super::check_host_device`]) in the VM's container, DMA-maps guest
    /// RAM if this is the first device, resets it, and builds the guest's
    /// view of it.
    pub fn new(addr: PciAddress, ctx: &mut VfioContext, sysfs: &std::path::Path, vm: Arc<VmFd>, routing: Arc<IrqRouting>) -> Result<VfioPci, VfioError> {
        let path = sysfs.join("bus/pci/devices").join(addr.to_string());
        let ops: Arc<dyn VfioOps> = ctx.container.clone();
        let dev = VfioDevice::new(&path, ops, false).map_err(vfio_err(addr, "opening the device (its IOMMU group in the VM's VFIO container)"))?;
        if !ctx.ram_mapped {
            // SAFETY: guest RAM is only touched through vm-memory's volatile
            // accessors (and by KVM), never through Rust references, so the
            // device's DMA into it breaks no aliasing rule. The mappings live
            // as long as the VM: the Vm drops its devices (and with them the
            // container) before the RAM, and an unmapped range is allowed by
            // vfio_dma_map's contract.
            unsafe { ctx.container.vfio_map_guest_memory(&ctx.mem) }.map_err(|e| VfioError::Vfio {
                addr,
                what: "DMA-mapping guest RAM",
                err: format!("{e} (pinned pages count against RLIMIT_MEMLOCK without CAP_IPC_LOCK)"),
            })?;
            ctx.ram_mapped = true;
        }
        // VM start: the device comes to the guest from reset.
        dev.reset();

        let mut real = [0xffu8; 256];
        dev.region_read(VFIO_PCI_CONFIG_REGION_INDEX, &mut real, 0);
        let unsupported = |msg: String| VfioError::Unsupported { addr, msg };
        if real[0] == 0xff && real[1] == 0xff {
            return Err(unsupported("its config space reads all ones through VFIO".into()));
        }
        if real[0x0e] & 0x7f != 0 {
            return Err(unsupported(format!("header type {:#x}: only endpoints (type 0) can be passed through, not bridges", real[0x0e] & 0x7f)));
        }

        // Capabilities: keep all but MSI (we offer MSI-X only).
        let mut caps = Vec::new();
        if real[6] & 0x10 != 0 {
            let mut p = (real[0x34] & 0xfc) as usize;
            while p >= 0x40 && caps.len() < 48 {
                caps.push((real[p], p));
                p = (real[p + 1] & 0xfc) as usize;
            }
        }
        let msix_cap = caps.iter().find(|(id, _)| *id == CAP_MSIX).map(|(_, o)| *o);
        let msi_cap = caps.iter().find(|(id, _)| *id == CAP_MSI).map(|(_, o)| *o).filter(|_| msix_cap.is_none());
        // MSI, emulated, when there is no MSI-X.
        let msi = match msi_cap {
            Some(c) if c + 4 <= 256 => {
                let offered = dev.get_irq_info(VFIO_PCI_MSI_IRQ_INDEX).map_or(0, |i| i.count as usize);
                if offered == 0 {
                    return Err(unsupported("VFIO offers no MSI vectors for it".into()));
                }
                let m = Msi::new(u16::from_le_bytes([real[c + 2], real[c + 3]]), offered);
                if c + m.len() > 256 {
                    return Err(unsupported(format!("its MSI capability at {c:#x} runs past the config space")));
                }
                Some((c, m))
            }
            Some(c) => return Err(unsupported(format!("its MSI capability at {c:#x} runs past the config space"))),
            None => None,
        };
        // A device that raises no interrupt at all (no MSI-X, no MSI, no
        // INTx pin: shared memory, say) is passed through as it is.
        let no_msix = msix_cap.is_none() && (msi.is_some() || real[0x3d] == 0);
        let msix_cap = match msix_cap {
            Some(c) => c,
            None if no_msix => NO_MSIX.cap,
            None => return Err(unsupported("the device raises INTx only: MSI-X and MSI are supported, INTx is not".into())),
        };
        if !no_msix && msix_cap + 12 > 256 {
            return Err(unsupported(format!("its MSI-X capability at {msix_cap:#x} runs past the config space")));
        }
        let mut hidden = Vec::new();
        for &(id, off) in &caps {
            if id == CAP_MSI && msi.is_none() {
                let ctl = u16::from_le_bytes([real[off + 2], real[(off + 3) & 0xff]]);
                let len = 10 + if ctl & 0x80 != 0 { 4 } else { 0 } + if ctl & 0x100 != 0 { 10 } else { 0 };
                hidden.push((off, (off + len).min(256)));
            }
        }
        let kept: Vec<usize> = caps.iter().filter(|(id, _)| *id != CAP_MSI || msi.is_some()).map(|(_, o)| *o).collect();
        let first_cap = kept.first().map_or(0, |&o| o as u8);
        let next_ptr = kept.iter().enumerate().map(|(i, &o)| (o + 1, kept.get(i + 1).map_or(0, |&n| n as u8))).collect();

        let dword = |o: usize| u32::from_le_bytes([real[o], real[o + 1], real[o + 2], real[o + 3]]);
        let (place, nvec) = if no_msix {
            (NO_MSIX, msi.as_ref().map_or(0, |(_, m)| m.max_vectors()))
        } else {
            let table = dword(msix_cap + 4);
            let pba = dword(msix_cap + 8);
            let place = MsixPlace { cap: msix_cap, table_bar: (table & 7) as usize, table_off: (table & !7) as u64, pba_bar: (pba & 7) as usize, pba_off: (pba & !7) as u64 };
            let declared = (u16::from_le_bytes([real[msix_cap + 2], real[msix_cap + 3]]) & 0x7ff) as usize + 1;
            let offered = dev.get_irq_info(VFIO_PCI_MSIX_IRQ_INDEX).map_or(0, |i| i.count as usize);
            let nvec = declared.min(offered).min(MAX_VECTORS);
            if nvec == 0 {
                return Err(unsupported("VFIO offers no MSI-X vectors for it".into()));
            }
            (place, nvec)
        };
        // (A no_msix device gets a table no access reaches.)
        let msix = MsixTable::new(nvec);

        // The guest's config space: the real header with the BARs, ROM and
        // command emulated.
        let mut cfg = ConfigSpace::new(0, 0, 0, 0, 0, 0);
        cfg.bytes = real;
        cfg.bytes[0x10..0x28].fill(0);
        cfg.bytes[0x30..0x34].fill(0);
        cfg.set16(COMMAND, 0);
        cfg.bytes[0x3c] = 0;
        cfg.set_wmask(COMMAND, COMMAND_PASSED as u8);
        cfg.set_wmask(COMMAND + 1, (COMMAND_PASSED >> 8) as u8);

        let mut bars: [Option<Bar>; NUM_BARS] = Default::default();
        let mut i = 0;
        while i < NUM_BARS {
            let raw = dword(0x10 + i * 4);
            let size = dev.get_region_size(i as u32);
            let is64 = raw & 0b111 == 0b100;
            let step = if is64 { 2 } else { 1 };
            if size == 0 {
                i += step;
                continue;
            }
            if raw & 1 != 0 {
                tracing::warn!(device = %addr, bar = i, "I/O port BAR not supported; the guest does not see it");
                i += 1;
                continue;
            }
            let guest_size = size.next_power_of_two().max(16);
            if !is64 && guest_size > 1 << 31 {
                return Err(unsupported(format!("BAR {i} of {size:#x} bytes is too large for a 32-bit BAR")));
            }
            cfg.add_mem_bar_typed(i, guest_size, is64, raw & 0b1000 != 0);
            let areas = map_areas(&dev, &addr, i, size, &place, &msix)?;
            bars[i] = Some(Bar { region_size: size, areas, placed: None });
            i += step;
        }
        for (bar, what) in [(place.table_bar, "table"), (place.pba_bar, "PBA")].into_iter().filter(|_| !no_msix) {
            let (off, len) = if what == "table" { (place.table_off, msix.table_bytes()) } else { (place.pba_off, msix.pba_bytes()) };
            let fits = bars.get(bar).and_then(|b| b.as_ref()).is_some_and(|b| off.checked_add(len).is_some_and(|e| e <= b.region_size));
            if !fits {
                return Err(unsupported(format!("its MSI-X {what} (BAR {bar}, offset {off:#x}) is not inside a memory BAR")));
            }
        }

        let mut fds = Vec::with_capacity(nvec);
        let mut gsis = Vec::with_capacity(nvec);
        for _ in 0..nvec {
            fds.push(EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VfioError::Vfio { addr, what: "eventfd", err: e.to_string() })?);
            gsis.push(routing.allocate_gsi());
        }
        tracing::info!(device = %addr, vectors = nvec, interrupts = if msi.is_some() { "msi" } else if no_msix { "none" } else { "msi-x" }, "VFIO device ready");
        Ok(VfioPci { addr, cfg, first_cap, next_ptr, hidden, bars, msix, place, msi, fds, gsis, routing, vm, slots: ctx.slots.clone(), dev })
    }

    pub fn address(&self) -> PciAddress {
        self.addr
    }

    fn wiring(&self) -> Wiring<'_> {
        Wiring { addr: self.addr, dev: &self.dev, routing: &self.routing, fds: &self.fds, gsis: &self.gsis }
    }

    /// Byte `o` of config space as the guest reads it, `real` being the device's.
    fn overlay(&self, o: usize, real: u8) -> u8 {
        match o {
            0x04 | 0x05 | 0x10..=0x27 | 0x3c => self.cfg.bytes[o],
            0x0e => real & 0x7f,
            0x30..=0x33 | 0x3d => 0,
            0x34 => self.first_cap,
            _ => {
                if let Some(&(_, v)) = self.next_ptr.iter().find(|(p, _)| *p == o) {
                    v
                } else if let Some((c, m)) = self.msi.as_ref().filter(|(c, m)| (c + 2..c + m.len()).contains(&o)) {
                    m.read(o - c)
                } else if o == self.place.cap + 3 {
                    (real & 0x3f) | (self.msix.control_bits() >> 8) as u8
                } else {
                    real
                }
            }
        }
    }

    /// Whether a guest write to config byte `o` is dropped.
    fn read_only(&self, o: usize) -> bool {
        matches!(o, 0x0e | 0x30..=0x34 | 0x3d) || o == self.place.cap + 2 || self.next_ptr.iter().any(|(p, _)| *p == o) || self.hidden.iter().any(|&(s, e)| (s..e).contains(&o))
    }

    fn write_command(&mut self, was: u16) {
        let guest = self.cfg.get16(COMMAND);
        if was & COMMAND_MEMORY != 0 && guest & COMMAND_MEMORY == 0 {
            // Decoding off: no slot may point at BARs vfio-pci stops serving.
            for bar in 0..NUM_BARS {
                self.unmap_bar(bar);
            }
        }
        let mut real = [0u8; 2];
        self.dev.region_read(VFIO_PCI_CONFIG_REGION_INDEX, &mut real, COMMAND as u64);
        let v = (u16::from_le_bytes(real) & !COMMAND_PASSED) | (guest & COMMAND_PASSED);
        self.dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, &v.to_le_bytes(), COMMAND as u64);
    }

    fn set_slot(&self, slot: u32, gpa: u64, len: u64, host: usize) -> Result<(), kvm_ioctls::Error> {
        let region = kvm_userspace_memory_region { slot, guest_phys_addr: gpa, memory_size: len, userspace_addr: host as u64, flags: 0 };
        // SAFETY: `host` is a live mapping of `len` bytes of the device,
        // owned by this device; every slot pointing at it is removed (this
        // call with `len` 0) before the mapping is unmapped in Drop.
        unsafe { self.vm.set_user_memory_region(region) }
    }

    fn unmap_bar(&mut self, bar: usize) {
        let Some(b) = self.bars.get_mut(bar).and_then(|b| b.take()) else { return };
        let mut b = b;
        for a in &mut b.areas {
            if let Some(slot) = a.slot.take() {
                if let Err(e) = self.set_slot(slot, 0, 0, a.host) {
                    if log_wiring() {
                        tracing::warn!(device = %self.addr, bar, slot, "removing a BAR's memory slot: {e}");
                    }
                }
                self.slots.release(slot);
            }
        }
        b.placed = None;
        self.bars[bar] = Some(b);
    }

    fn map_bar(&mut self, bar: usize, gpa: u64) {
        let Some(mut b) = self.bars.get_mut(bar).and_then(|b| b.take()) else { return };
        for a in &mut b.areas {
            let Some(slot) = self.slots.allocate() else {
                if log_wiring() {
                    tracing::warn!(device = %self.addr, bar, "no free KVM memory slot: this part of the BAR traps instead");
                }
                continue;
            };
            match gpa.checked_add(a.off).map(|g| self.set_slot(slot, g, a.len, a.host)) {
                Some(Ok(())) => a.slot = Some(slot),
                other => {
                    if log_wiring() {
                        tracing::warn!(device = %self.addr, bar, "mapping a BAR part as a memory slot failed ({other:?}): it traps instead");
                    }
                    self.slots.release(slot);
                }
            }
        }
        b.placed = Some(gpa);
        let (slots, traps) = b.areas.iter().fold((0u64, b.region_size), |(s, t), a| if a.slot.is_some() { (s + a.len, t - a.len) } else { (s, t) });
        tracing::info!(device = %self.addr, bar, gpa = format_args!("{gpa:#x}"), slot_bytes = slots, trapped_bytes = traps, "BAR placed");
        self.bars[bar] = Some(b);
    }

    /// Where an access of `len` bytes at `off` of `bar` falls.
    fn classify(&self, bar: usize, off: u64, len: u64) -> Access {
        let end = off.saturating_add(len);
        let inside = |b: usize, s: u64, n: u64| b == bar && off >= s && end <= s.saturating_add(n);
        let touches = |b: usize, s: u64, n: u64| b == bar && off < s.saturating_add(n) && end > s;
        let p = &self.place;
        if inside(p.table_bar, p.table_off, self.msix.table_bytes()) {
            Access::Table(off - p.table_off)
        } else if inside(p.pba_bar, p.pba_off, self.msix.pba_bytes()) {
            Access::Pba
        } else if touches(p.table_bar, p.table_off, self.msix.table_bytes()) || touches(p.pba_bar, p.pba_off, self.msix.pba_bytes()) {
            Access::Ignored
        } else if self.bars.get(bar).and_then(|b| b.as_ref()).is_some_and(|b| end <= b.region_size) {
            Access::Region
        } else {
            Access::Ignored
        }
    }
}

enum Access {
    Table(u64),
    Pba,
    Region,
    Ignored,
}

/// Maps the mmap-able parts of BAR `bar` (VFIO's sparse areas, or all of
/// it) into this process, leaving out the pages of the MSI-X table and PBA.
fn map_areas(dev: &VfioDevice, addr: &PciAddress, bar: usize, size: u64, place: &MsixPlace, msix: &MsixTable) -> Result<Vec<Area>, VfioError> {
    let index = bar as u32;
    let flags = dev.get_region_flags(index);
    if flags & VFIO_REGION_INFO_FLAG_MMAP == 0 || size < PAGE {
        return Ok(Vec::new());
    }
    let mut candidates = Vec::new();
    let mut sparse = false;
    for cap in dev.get_region_caps(index) {
        if let VfioRegionInfoCap::SparseMmap(s) = cap {
            sparse = true;
            candidates.extend(s.areas.iter().map(|a| (a.offset, a.offset.saturating_add(a.size))));
        }
    }
    if !sparse {
        candidates.push((0, size));
    }
    let mut holes = Vec::new();
    for (b, off, len) in [(place.table_bar, place.table_off, msix.table_bytes()), (place.pba_bar, place.pba_off, msix.pba_bytes())] {
        if b == bar {
            let start = off & !(PAGE - 1);
            holes.push((start, off.saturating_add(len).saturating_add(PAGE - 1) & !(PAGE - 1)));
        }
    }
    let mut prot = 0;
    if flags & VFIO_REGION_INFO_FLAG_READ != 0 {
        prot |= libc::PROT_READ;
    }
    if flags & VFIO_REGION_INFO_FLAG_WRITE != 0 {
        prot |= libc::PROT_WRITE;
    }
    let mut areas = Vec::new();
    for (s, e) in candidates {
        for (s, e) in subtract(s, e.min(size), &holes) {
            if s % PAGE != 0 || (e - s) % PAGE != 0 {
                continue;
            }
            let len = e - s;
            // SAFETY: a fresh shared mapping of the device fd at the
            // region's offset (the kernel checks it against the region);
            // nothing else is at the address it returns. It is unmapped in
            // Drop, after its KVM slot is removed.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, prot, libc::MAP_SHARED, dev.as_raw_fd(), (dev.get_region_offset(index) + s) as libc::off_t) };
            if p == libc::MAP_FAILED {
                let e = std::io::Error::last_os_error();
                tracing::warn!(device = %addr, bar, offset = s, len, "mmap of a BAR part failed ({e}): it traps instead");
                continue;
            }
            areas.push(Area { off: s, len, host: p as usize, slot: None });
        }
    }
    Ok(areas)
}

impl PciDevice for VfioPci {
    fn config(&mut self) -> &mut ConfigSpace {
        &mut self.cfg
    }

    fn config_read(&mut self, off: usize, data: &mut [u8]) {
        let n = data.len().min(4);
        let mut real = [0xffu8; 4];
        if off + n <= 256 {
            self.dev.region_read(VFIO_PCI_CONFIG_REGION_INDEX, &mut real[..n], off as u64);
        }
        for (i, d) in data.iter_mut().enumerate() {
            *d = if off + i < 256 { self.overlay(off + i, real.get(i).copied().unwrap_or(0xff)) } else { 0xff };
        }
    }

    fn config_write(&mut self, off: usize, data: &[u8]) {
        let was = self.cfg.get16(COMMAND);
        let mut command = false;
        let mut control = None;
        let mut msi_touched = false;
        // Runs of bytes that go to the device as they are.
        let mut run: Option<(usize, Vec<u8>)> = None;
        let mut runs = Vec::new();
        for (i, &b) in data.iter().enumerate() {
            let o = off + i;
            if o >= 256 {
                break;
            }
            let passed = match o {
                0x04 | 0x05 => {
                    self.cfg.write(o, &[b]);
                    command = true;
                    false
                }
                0x10..=0x27 | 0x3c => {
                    self.cfg.write(o, &[b]);
                    false
                }
                _ if o == self.place.cap + 3 => {
                    control = Some(((b as u16) << 8) & (CTL_ENABLE | CTL_MASK_ALL));
                    false
                }
                _ if self.msi.as_ref().is_some_and(|(c, m)| (c + 2..c + m.len()).contains(&o)) => {
                    if let Some((c, m)) = self.msi.as_mut() {
                        msi_touched |= m.write(o - *c, b);
                    }
                    false
                }
                _ => !self.read_only(o),
            };
            match (passed, run.as_mut()) {
                (true, Some((start, bytes))) if *start + bytes.len() == o => bytes.push(b),
                (true, _) => {
                    if let Some(r) = run.take() {
                        runs.push(r);
                    }
                    run = Some((o, vec![b]));
                }
                (false, _) => {
                    if let Some(r) = run.take() {
                        runs.push(r);
                    }
                }
            }
        }
        runs.extend(run);
        for (start, bytes) in runs {
            self.dev.region_write(VFIO_PCI_CONFIG_REGION_INDEX, &bytes, start as u64);
        }
        if command {
            self.write_command(was);
        }
        if let Some(ctl) = control {
            let (fds, gsis, routing) = (&self.fds, &self.gsis, &self.routing);
            let mut w = Wiring { addr: self.addr, dev: &self.dev, routing, fds, gsis };
            self.msix.write_control(ctl, &mut w);
        }
        if msi_touched {
            let (fds, gsis, routing) = (&self.fds, &self.gsis, &self.routing);
            let mut w = Wiring { addr: self.addr, dev: &self.dev, routing, fds, gsis };
            if let Some((_, m)) = self.msi.as_mut() {
                m.sync(&mut w);
            }
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        match self.classify(bar, offset, data.len() as u64) {
            Access::Table(o) => self.msix.read(o, data),
            // Pending bits live in the eventfds of masked vectors, which
            // KVM delivers on unmask; none is reported here.
            Access::Pba => data.fill(0),
            Access::Region => self.dev.region_read(bar as u32, data, offset),
            Access::Ignored => {}
        }
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        match self.classify(bar, offset, data.len() as u64) {
            Access::Table(o) => {
                let (fds, gsis, routing) = (&self.fds, &self.gsis, &self.routing);
                let mut w = Wiring { addr: self.addr, dev: &self.dev, routing, fds, gsis };
                self.msix.write(o, data, &mut w);
            }
            Access::Region => self.dev.region_write(bar as u32, data, offset),
            Access::Pba | Access::Ignored => {}
        }
    }

    fn bar_placed(&mut self, bar: usize, addr: u64) {
        if self.bars.get(bar).and_then(|b| b.as_ref()).is_some_and(|b| b.placed == Some(addr)) {
            return;
        }
        self.unmap_bar(bar);
        self.map_bar(bar, addr);
    }

    fn bar_unmapped(&mut self, bar: usize) {
        self.unmap_bar(bar);
    }
}

impl Drop for VfioPci {
    /// VM stop: interrupts off, slots removed, BAR mappings unmapped, the
    /// device reset; then the device fd closes and its group leaves the
    /// container.
    fn drop(&mut self) {
        let mut msix = std::mem::replace(&mut self.msix, MsixTable::new(1));
        msix.reset(&mut self.wiring());
        if let Some((_, mut m)) = self.msi.take() {
            m.reset(&mut self.wiring());
        }
        for bar in 0..NUM_BARS {
            self.unmap_bar(bar);
            if let Some(b) = self.bars[bar].take() {
                for a in b.areas {
                    // SAFETY: `a.host` is this device's own mapping of
                    // `a.len` bytes, no KVM slot points at it any more
                    // (unmap_bar above), and nothing else refers to it.
                    unsafe { libc::munmap(a.host as *mut libc::c_void, a.len as usize) };
                }
            }
        }
        self.dev.reset();
        tracing::info!(device = %self.addr, "VFIO device reset and released");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msix_pages_are_cut_out_of_mappable_ranges() {
        assert_eq!(subtract(0, 0x4000, &[(0x2000, 0x3000)]), vec![(0, 0x2000), (0x3000, 0x4000)]);
        assert_eq!(subtract(0, 0x4000, &[(0, 0x1000), (0x3000, 0x4000)]), vec![(0x1000, 0x3000)]);
        assert_eq!(subtract(0, 0x1000, &[(0, 0x1000)]), vec![]);
        assert_eq!(subtract(0x1000, 0x2000, &[(0x4000, 0x5000)]), vec![(0x1000, 0x2000)]);
    }
}
