//! Guest RAM: one memfd (so it can be shared with the mediator over
//! vhost-user), optionally hugetlb-backed, optionally bound to a NUMA node
//! before any page is touched.
//!
//! Layout: RAM from 0 up to the 32-bit MMIO hole, the rest above 4 GiB.

use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::config::{meminfo_field, Hugepages};

/// Start of the 32-bit MMIO hole (PCI BARs, IOAPIC, LAPIC).
pub const MMIO_HOLE_START: u64 = 0xC000_0000;
/// First address above the hole.
pub const HIGH_RAM_START: u64 = 1 << 32;
/// PCI BARs are allocated from here up to the IOAPIC.
pub const PCI_MMIO_START: u64 = MMIO_HOLE_START;
pub const PCI_MMIO_END: u64 = 0xFEC0_0000;
/// 64-bit BARs of this size or more (a GPU's frame buffer aperture) go to
/// the window above RAM; smaller ones share the 32-bit hole.
pub const HIGH_BAR_MIN: u64 = 256 << 20;
/// The most guest-physical address bits the high window uses: well inside
/// the 48 bits that 4-level EPT/NPT can map.
const MAX_PHYS_BITS: u32 = 46;

/// The window for large 64-bit BARs: from the first 1 GiB boundary above
/// the end of guest RAM to the end of the guest's physical address space
/// (`phys_bits`, CPUID 0x80000008, capped at 46). Empty when RAM reaches
/// that far.
pub fn high_mmio_window(ram_size: u64, phys_bits: u32) -> (u64, u64) {
    let ram_end = ram_ranges(ram_size).last().map_or(HIGH_RAM_START, |(base, len, _)| base + len).max(HIGH_RAM_START);
    let start = ram_end.div_ceil(1 << 30).saturating_mul(1 << 30);
    let end = 1u64 << phys_bits.clamp(36, MAX_PHYS_BITS);
    (start.min(end), end)
}

/// The guest's physical address bits from the EAX of CPUID leaf
/// 0x80000008 that KVM gives it: bits 7:0, or bits 23:16 (GuestPhysBits,
/// newer KVMs) when set and smaller; 36 when KVM reports no such leaf.
pub fn guest_phys_bits(leaf_80000008_eax: Option<u32>) -> u32 {
    let Some(eax) = leaf_80000008_eax else { return 36 };
    let phys = eax & 0xff;
    let guest = (eax >> 16) & 0xff;
    if guest != 0 {
        phys.min(guest)
    } else {
        phys
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memfd_create failed: {0}")]
    Memfd(std::io::Error),
    #[error("sizing guest memory to {size} bytes failed: {err}")]
    Truncate { size: u64, err: std::io::Error },
    #[error("not enough {size} hugepages: the guest needs {need}, the host has {free} free (reserve more in /proc/sys/vm/nr_hugepages or /sys/kernel/mm/hugepages)")]
    NotEnoughHugepages { size: &'static str, need: u64, free: u64 },
    #[error("mapping guest memory failed: {0}")]
    Map(String),
    #[error(transparent)]
    Numa(#[from] crate::numa::NumaError),
}

/// KVM memory slots: guest RAM takes one per range of [`ram_ranges`]
/// (0, and 1 above the hole); passthrough BAR windows (VFIO) take slots
/// from here up.
pub const FIRST_DEVICE_SLOT: u32 = 8;

/// Hands out KVM memory slot numbers for device memory (VFIO BARs), and
/// takes them back when a BAR is unmapped or moved.
#[derive(Debug)]
pub struct SlotAllocator {
    /// (next never-used slot, slots given back).
    state: std::sync::Mutex<(u32, Vec<u32>)>,
    limit: u32,
}

impl SlotAllocator {
    /// Slots from [`FIRST_DEVICE_SLOT`] to `limit` (KVM_CAP_NR_MEMSLOTS), exclusive.
    pub fn new(limit: u32) -> SlotAllocator {
        SlotAllocator { state: std::sync::Mutex::new((FIRST_DEVICE_SLOT, Vec::new())), limit }
    }

    pub fn allocate(&self) -> Option<u32> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = s.1.pop() {
            return Some(n);
        }
        (s.0 < self.limit).then(|| {
            s.0 += 1;
            s.0 - 1
        })
    }

    pub fn release(&self, slot: u32) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1.push(slot);
    }
}

pub struct GuestRam {
    pub mem: GuestMemoryMmap,
    /// The memfd behind every region (offset = guest address below the hole,
    /// guest address minus the hole size above it).
    pub file: File,
    pub size: u64,
    pub hugepages: Hugepages,
    pub numa_node: Option<u32>,
}

/// (guest address, length, file offset) of each RAM range for `size` bytes.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64, u64)> {
    if size <= MMIO_HOLE_START {
        vec![(0, size, 0)]
    } else {
        vec![(0, MMIO_HOLE_START, 0), (HIGH_RAM_START, size - MMIO_HOLE_START, MMIO_HOLE_START)]
    }
}

fn hugepage_label(h: Hugepages) -> &'static str {
    match h {
        Hugepages::TwoMiB => "2M",
        Hugepages::OneGiB => "1G",
        Hugepages::None => "4K",
    }
}

/// Free hugepages of the given size: sysfs per size, /proc/meminfo for the
/// default size as a fallback.
pub fn free_hugepages(h: Hugepages) -> Option<u64> {
    let kib = h.page_size() / 1024;
    let p = format!("/sys/kernel/mm/hugepages/hugepages-{kib}kB/free_hugepages");
    if let Ok(s) = std::fs::read_to_string(p) {
        return s.trim().parse().ok();
    }
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    if meminfo_field(&text, "Hugepagesize")? * 1024 == h.page_size() {
        meminfo_field(&text, "HugePages_Free")
    } else {
        Some(0)
    }
}

/// Faults in every page of a fresh mapping, for writing.
fn populate(addr: *mut u8, len: usize, page: usize) -> Result<(), MemoryError> {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: [addr, addr+len) is a mapping this process just created and
    // owns; populating it does not change its contents (all zero).
    if unsafe { libc::madvise(addr.cast(), len, MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EINVAL) {
        return Err(MemoryError::Map(format!("populating hugepages: {e}")));
    }
    // Kernels before 5.14: touch one byte per page.
    for off in (0..len).step_by(page) {
        // SAFETY: off < len, inside the mapping; the byte is zero and stays zero.
        unsafe { std::ptr::write_volatile(addr.add(off), 0) };
    }
    Ok(())
}

impl GuestRam {
    pub fn new(size: u64, hugepages: Hugepages, numa_node: Option<u32>) -> Result<GuestRam, MemoryError> {
        let mut flags = libc::MFD_CLOEXEC;
        match hugepages {
            Hugepages::None => {}
            Hugepages::TwoMiB => flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            Hugepages::OneGiB => flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_1GB,
        }
        if hugepages != Hugepages::None {
            let need = size / hugepages.page_size();
            let free = free_hugepages(hugepages).unwrap_or(0);
            if free < need {
                return Err(MemoryError::NotEnoughHugepages { size: hugepage_label(hugepages), need, free });
            }
        }
        // SAFETY: memfd_create with a static NUL-terminated name; the
        // result is checked and then owned by `file`.
        let fd = unsafe { libc::memfd_create(c"vgpu-guest-ram".as_ptr(), flags) };
        if fd < 0 {
            return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).map_err(|err| MemoryError::Truncate { size, err })?;

        let mut regions = Vec::new();
        for (gpa, len, off) in ram_ranges(size) {
            // Hugetlb mappings reserve their pages at mmap time, so a short
            // pool fails here rather than with SIGBUS inside the guest.
            let mut mflags = libc::MAP_SHARED;
            if hugepages == Hugepages::None {
                mflags |= libc::MAP_NORESERVE;
            }
            let fo = FileOffset::new(file.try_clone().map_err(|e| MemoryError::Map(e.to_string()))?, off);
            let region = MmapRegion::build(Some(fo), len as usize, libc::PROT_READ | libc::PROT_WRITE, mflags).map_err(|e| match hugepages {
                Hugepages::None => MemoryError::Map(e.to_string()),
                _ => MemoryError::Map(format!("{e} (the hugepage pool could not back {} bytes)", len)),
            })?;
            if let Some(node) = numa_node {
                crate::numa::mbind(region.as_ptr().cast(), len as usize, node)?;
            }
            if hugepages != Hugepages::None {
                // Take the pages now, on the bound node: the guest's memory
                // is then resident and can never fault for lack of pages.
                populate(region.as_ptr(), len as usize, hugepages.page_size() as usize)?;
            }
            let r = GuestRegionMmap::new(region, GuestAddress(gpa)).ok_or_else(|| MemoryError::Map(format!("region at {gpa:#x} overflows")))?;
            regions.push(r);
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Map(e.to_string()))?;
        Ok(GuestRam { mem, file, size, hugepages, numa_node })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn small_guest_is_one_range_and_large_guest_skips_the_mmio_hole() {
        assert_eq!(ram_ranges(256 << 20), vec![(0, 256 << 20, 0)]);
        let r = ram_ranges(4 << 30);
        assert_eq!(r, vec![(0, MMIO_HOLE_START, 0), (HIGH_RAM_START, (4 << 30) - MMIO_HOLE_START, MMIO_HOLE_START)]);
    }

    #[test]
    fn the_high_bar_window_starts_above_ram_on_a_gib_boundary() {
        assert_eq!(high_mmio_window(256 << 20, 46), (HIGH_RAM_START, 1 << 46));
        // 4.5 GiB of RAM: 3 GiB low, 1.5 GiB from 4 GiB, window from 6 GiB.
        assert_eq!(high_mmio_window(9 << 29, 40), (6 << 30, 1 << 40));
        assert_eq!(high_mmio_window(1 << 30, 52).1, 1 << 46, "capped at 46 bits");
        assert_eq!(high_mmio_window(1 << 30, 20).1, 1 << 36, "at least 36 bits");
        let (s, e) = high_mmio_window(1 << 40, 40);
        assert_eq!(s, e, "RAM to the end of the address space leaves no window");
        assert_eq!(guest_phys_bits(None), 36);
        assert_eq!(guest_phys_bits(Some(0x3028)), 40, "EAX[7:0]");
        assert_eq!(guest_phys_bits(Some(0x0027_3034)), 39, "GuestPhysBits when smaller");
        assert_eq!(guest_phys_bits(Some(0x0030_3028)), 40, "GuestPhysBits larger: the physical width");
    }

    #[test]
    fn guest_ram_is_a_shared_memfd() {
        let ram = GuestRam::new(16 << 20, Hugepages::None, None).unwrap();
        ram.mem.write_obj(0xdead_beefu32, GuestAddress(0x1000)).unwrap();
        let mut b = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(&ram.file, &mut b, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xdead_beef);
        assert_eq!(ram.mem.last_addr(), GuestAddress((16 << 20) - 1));
    }

    #[test]
    fn device_slots_start_above_ram_and_are_reused() {
        let a = SlotAllocator::new(FIRST_DEVICE_SLOT + 2);
        assert_eq!((a.allocate(), a.allocate(), a.allocate()), (Some(FIRST_DEVICE_SLOT), Some(FIRST_DEVICE_SLOT + 1), None));
        a.release(FIRST_DEVICE_SLOT);
        assert_eq!(a.allocate(), Some(FIRST_DEVICE_SLOT));
        assert!(ram_ranges(64 << 30).len() as u32 <= FIRST_DEVICE_SLOT);
    }

    #[test]
    fn absent_numa_node_is_refused() {
        match GuestRam::new(4 << 20, Hugepages::None, Some(1000)) {
            Err(MemoryError::Numa(_)) => {}
            other => panic!("{:?}", other.map(|r| r.size)),
        }
    }
}
