//! Direct 64-bit boot: load a bzImage or ELF kernel and an initramfs, write
//! the zero page (boot params, e820, command line), identity page tables, a
//! GDT and an MP table, and put the boot vCPU in long mode at the entry.
//!
//! SMP discovery uses an MP table (Intel MultiProcessor Specification 1.4)
//! rather than ACPI: Linux falls back to it when no RSDP exists, and it is
//! a few hundred bytes with nothing to interpret.

use std::fs::File;

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs, CpuId};
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{BzImage, Elf, KernelLoader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::memory::{ram_ranges, MMIO_HOLE_START};

pub const CMDLINE_MAX: usize = 4096;

const GDT_ADDR: u64 = 0x500;
const IDT_ADDR: u64 = 0x520;
const ZERO_PAGE: u64 = 0x7000;
const BOOT_STACK: u64 = 0x8ff0;
const PML4: u64 = 0x9000;
const PDPT: u64 = 0xa000;
/// Four page directories mapping the first 4 GiB with 2 MiB pages.
const PD: u64 = 0xb000;
const CMDLINE_ADDR: u64 = 0x2_0000;
/// The MP floating pointer and table live in the last KiB of base memory,
/// where Linux looks for them; e820 leaves it out of usable RAM.
const EBDA_START: u64 = 0x9_fc00;
const HIMEM_START: u64 = 0x10_0000;
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const LAPIC_ADDR: u32 = 0xfee0_0000;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Opening the kernel or initramfs: missing, of the wrong type, a
    /// symbolic link or behind one (vgpu_topology::safe_open).
    #[error(transparent)]
    Open(#[from] crate::safe_open::SafeOpenError),
    #[error("{path} is neither an x86-64 ELF kernel nor a bzImage (ELF: {elf}; bzImage: {bz})")]
    NotAKernel { path: String, elf: String, bz: String },
    #[error("reading initramfs {path}: {err}")]
    Initramfs { path: String, err: std::io::Error },
    #[error("initramfs of {size} bytes does not fit in guest memory below {max:#x}")]
    InitramfsTooBig { size: u64, max: u64 },
    #[error("guest memory is too small for the kernel and boot structures")]
    TooSmall,
    #[error("writing boot structures: {0}")]
    Write(String),
}

/// What the boot vCPU needs to start.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub rip: u64,
}

fn write<T: vm_memory::ByteValued>(mem: &GuestMemoryMmap, v: T, at: u64) -> Result<(), BootError> {
    mem.write_obj(v, GuestAddress(at)).map_err(|e| BootError::Write(format!("at {at:#x}: {e}")))
}

/// Opens the kernel or initramfs read-only without following a symbolic
/// link in any component of its path; it must be a regular file.
fn open_read_only(what: &str, p: &std::path::Path) -> Result<File, BootError> {
    Ok(crate::safe_open::open(what, p, crate::safe_open::Kind::File, libc::O_RDONLY, 0)?)
}

/// Loads kernel, initramfs and command line, and writes every boot table.
pub fn load(mem: &GuestMemoryMmap, cfg: &crate::config::VmConfig) -> Result<Entry, BootError> {
    let path = cfg.kernel.display().to_string();
    let mut f = open_read_only("kernel", &cfg.kernel)?;
    let high = Some(GuestAddress(HIMEM_START));
    let (res, rip) = match Elf::load(mem, None, &mut f, high) {
        Ok(r) => {
            let rip = r.kernel_load.0;
            (r, rip)
        }
        Err(elf) => match BzImage::load(mem, None, &mut f, high) {
            // The 64-bit entry sits 0x200 past the protected-mode code.
            Ok(r) => {
                let rip = r.kernel_load.0 + 0x200;
                (r, rip)
            }
            Err(bz) => return Err(BootError::NotAKernel { path, elf: elf.to_string(), bz: bz.to_string() }),
        },
    };

    let mut params = boot_params::default();
    if let Some(h) = res.setup_header {
        params.hdr = h;
    } else {
        params.hdr.boot_flag = 0xaa55;
        params.hdr.header = 0x5372_6448; // "HdrS"
        params.hdr.kernel_alignment = 0x100_0000;
    }
    params.hdr.type_of_loader = 0xff;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    params.hdr.cmdline_size = cfg.cmdline.len() as u32 + 1;
    let mut cmdline = cfg.cmdline.as_bytes().to_vec();
    cmdline.push(0);
    mem.write_slice(&cmdline, GuestAddress(CMDLINE_ADDR)).map_err(|e| BootError::Write(e.to_string()))?;

    let mem_end = mem.last_addr().0 + 1;
    let low_end = mem_end.min(MMIO_HOLE_START);
    if let Some(initrd) = &cfg.initramfs {
        let ipath = initrd.display().to_string();
        let mut file = open_read_only("initramfs", initrd)?;
        let size = file.metadata().map_err(|err| BootError::Initramfs { path: ipath.clone(), err })?.len();
        let max = match params.hdr.initrd_addr_max {
            0 => 0x37ff_ffff,
            m => m as u64,
        }
        .min(low_end - 1);
        let top = (max + 1) & !0xfff;
        let start = top.checked_sub(size).map(|s| s & !0xfff).filter(|s| *s >= res.kernel_end.max(HIMEM_START));
        let start = start.ok_or(BootError::InitramfsTooBig { size, max })?;
        mem.read_exact_volatile_from(GuestAddress(start), &mut file, size as usize).map_err(|e| BootError::Initramfs { path: ipath, err: std::io::Error::other(e.to_string()) })?;
        params.hdr.ramdisk_image = start as u32;
        params.hdr.ramdisk_size = size as u32;
    }

    // e820: base memory below the EBDA, then RAM from 1 MiB (and above 4 GiB).
    let mut e820 = vec![(0u64, EBDA_START, E820_RAM), (EBDA_START, 0x10_0000 - EBDA_START, E820_RESERVED)];
    for (gpa, len, _) in ram_ranges(mem_end_total(mem)) {
        let start = gpa.max(HIMEM_START);
        if gpa + len > start {
            e820.push((start, gpa + len - start, E820_RAM));
        }
    }
    for (i, (addr, size, ty)) in e820.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry { addr: *addr, size: *size, r#type: *ty };
    }
    params.e820_entries = e820.len() as u8;
    LinuxBootConfigurator::write_bootparams(&BootParams::new(&params, GuestAddress(ZERO_PAGE)), mem).map_err(|e| BootError::Write(e.to_string()))?;

    write_page_tables(mem)?;
    write_gdt(mem)?;
    write_mptable(mem, cfg.vcpus)?;
    if rip >= mem_end {
        return Err(BootError::TooSmall);
    }
    Ok(Entry { rip })
}

/// Total RAM bytes (the sum of the regions).
fn mem_end_total(mem: &GuestMemoryMmap) -> u64 {
    mem.iter().map(vm_memory::GuestMemoryRegion::len).sum()
}

fn write_page_tables(mem: &GuestMemoryMmap) -> Result<(), BootError> {
    write(mem, PDPT | 0x3, PML4)?;
    for i in 0..4u64 {
        write(mem, (PD + i * 0x1000) | 0x3, PDPT + i * 8)?;
    }
    // 2048 entries of 2 MiB: present, writable, page size.
    for i in 0..2048u64 {
        write(mem, (i << 21) | 0x83, PD + i * 8)?;
    }
    Ok(())
}

/// GDT entry from flags, base and limit (Intel SDM vol. 3, 3.4.5).
fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32) | ((base as u64 & 0x00ff_ffff) << 16) | (limit as u64 & 0xffff) | ((limit as u64 & 0xf_0000) << 32) | ((flags as u64 & 0xf0ff) << 40)
}

/// Selectors follow Linux's boot protocol: code at 0x10, data at 0x18.
const GDT: [u64; 5] = [0, 0, 0, 0, 0];
const CODE_SEL: u16 = 0x10;
const DATA_SEL: u16 = 0x18;
const TSS_SEL: u16 = 0x20;

fn gdt() -> [u64; 5] {
    let mut g = GDT;
    g[2] = gdt_entry(0xa09b, 0, 0xfffff); // 64-bit code, present, DPL 0
    g[3] = gdt_entry(0xc093, 0, 0xfffff); // data, read/write
    g[4] = gdt_entry(0x808b, 0, 0xfffff); // busy 64-bit TSS
    g
}

fn write_gdt(mem: &GuestMemoryMmap) -> Result<(), BootError> {
    for (i, e) in gdt().iter().enumerate() {
        write(mem, *e, GDT_ADDR + i as u64 * 8)?;
    }
    write(mem, 0u64, IDT_ADDR)
}

fn segment(sel: u16, entry: u64) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: sel,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// Long mode with paging, the boot GDT and the identity map.
pub fn setup_sregs(s: &mut kvm_sregs) {
    let g = gdt();
    s.gdt.base = GDT_ADDR;
    s.gdt.limit = (g.len() * 8 - 1) as u16;
    s.idt.base = IDT_ADDR;
    s.idt.limit = 7;
    let code = segment(CODE_SEL, g[2]);
    let data = segment(DATA_SEL, g[3]);
    s.cs = code;
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = data;
    s.ss = data;
    s.tr = segment(TSS_SEL, g[4]);
    const CR0_PE: u64 = 1;
    const CR0_ET: u64 = 1 << 4;
    const CR0_PG: u64 = 1 << 31;
    const CR4_PAE: u64 = 1 << 5;
    const EFER_LME: u64 = 1 << 8;
    const EFER_LMA: u64 = 1 << 10;
    s.cr3 = PML4;
    s.cr4 |= CR4_PAE;
    s.cr0 |= CR0_PE | CR0_ET | CR0_PG;
    s.efer |= EFER_LME | EFER_LMA;
}

pub fn boot_regs(entry: Entry) -> kvm_regs {
    kvm_regs { rip: entry.rip, rsp: BOOT_STACK, rbp: BOOT_STACK, rsi: ZERO_PAGE, rflags: 0x2, ..Default::default() }
}

pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() }
}

/// Adjusts KVM's supported CPUID for vCPU `id` of `count`: APIC ids,
/// logical processor count, and the hypervisor bit.
pub fn adjust_cpuid(cpuid: &mut CpuId, id: u8, count: u8) {
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | ((id as u32) << 24) | ((count as u32) << 16);
                e.ecx |= 1 << 31; // running under a hypervisor
                if count > 1 {
                    e.edx |= 1 << 28; // HTT: the logical count field is valid
                }
            }
            // Extended topology: x2APIC id in EDX of every subleaf.
            0xb | 0x1f => e.edx = id as u32,
            // Deterministic cache parameters: cores per package.
            4 => e.eax = (e.eax & 0x03ff_ffff) | (((count as u32).saturating_sub(1) & 0x3f) << 26),
            _ => {}
        }
    }
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the MP floating pointer and configuration table for `cpus`
/// processors, one IOAPIC with the 16 ISA interrupts wired 1:1, ExtINT on
/// LINT0 and NMI on LINT1. Returns the bytes to place at `at`.
pub fn mptable_bytes(at: u64, cpus: u32) -> Vec<u8> {
    let table_at = at + 16;
    let mut t: Vec<u8> = Vec::new();
    // Header (44 bytes), filled in once the entries are known.
    t.extend_from_slice(b"PCMP");
    t.extend_from_slice(&[0; 2]); // base table length
    t.push(4); // spec revision 1.4
    t.push(0); // checksum
    t.extend_from_slice(b"VGPU    "); // OEM id
    t.extend_from_slice(b"VGPU-VMM    "); // product id
    t.extend_from_slice(&[0; 4]); // OEM table pointer
    t.extend_from_slice(&[0; 2]); // OEM table size
    t.extend_from_slice(&[0; 2]); // entry count
    t.extend_from_slice(&LAPIC_ADDR.to_le_bytes());
    t.extend_from_slice(&[0; 4]); // extended length, checksum, reserved
    let mut entries = 0u16;
    for id in 0..cpus {
        let flags = if id == 0 { 0x3 } else { 0x1 }; // enabled, bootstrap
        t.extend_from_slice(&[0, id as u8, 0x14, flags]);
        t.extend_from_slice(&0x600u32.to_le_bytes()); // CPU signature: family 6
        t.extend_from_slice(&0x201u32.to_le_bytes()); // features: FPU, APIC
        t.extend_from_slice(&[0; 8]);
        entries += 1;
    }
    const BUS_ISA: u8 = 0;
    t.extend_from_slice(&[1, BUS_ISA]);
    t.extend_from_slice(b"ISA   ");
    entries += 1;
    let ioapic_id = cpus as u8;
    t.extend_from_slice(&[2, ioapic_id, 0x11, 1]);
    t.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    entries += 1;
    for irq in 0..16u8 {
        // I/O interrupt: INT, polarity/trigger conforming, ISA bus.
        t.extend_from_slice(&[3, 0, 0, 0, BUS_ISA, irq, ioapic_id, irq]);
        entries += 1;
    }
    // Local interrupts to every LAPIC: ExtINT on LINT0, NMI on LINT1.
    t.extend_from_slice(&[4, 3, 0, 0, BUS_ISA, 0, 0xff, 0]);
    t.extend_from_slice(&[4, 1, 0, 0, BUS_ISA, 0, 0xff, 1]);
    entries += 2;
    let len = t.len() as u16;
    t[4..6].copy_from_slice(&len.to_le_bytes());
    t[34..36].copy_from_slice(&entries.to_le_bytes());
    t[7] = checksum(&t);

    let mut fp = Vec::with_capacity(16);
    fp.extend_from_slice(b"_MP_");
    fp.extend_from_slice(&(table_at as u32).to_le_bytes());
    fp.push(1); // length in 16-byte units
    fp.push(4); // spec revision
    fp.push(0); // checksum
    fp.extend_from_slice(&[0; 5]); // feature bytes: a configuration table is present
    fp[10] = checksum(&fp);
    fp.extend_from_slice(&t);
    fp
}

fn write_mptable(mem: &GuestMemoryMmap, cpus: u32) -> Result<(), BootError> {
    let b = mptable_bytes(EBDA_START, cpus);
    if b.len() as u64 > 0x10_0000 - EBDA_START {
        return Err(BootError::Write("MP table does not fit below 1 MiB".into()));
    }
    mem.write_slice(&b, GuestAddress(EBDA_START)).map_err(|e| BootError::Write(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mp_table_checksums_and_counts_entries() {
        let b = mptable_bytes(EBDA_START, 4);
        assert_eq!(&b[0..4], b"_MP_");
        assert_eq!(b[..16].iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0, "floating pointer checksum");
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()) as u64, EBDA_START + 16);
        let t = &b[16..];
        let len = u16::from_le_bytes([t[4], t[5]]) as usize;
        assert_eq!(len, t.len());
        assert_eq!(t.iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0, "table checksum");
        // 4 processors + bus + IOAPIC + 16 interrupts + 2 local interrupts.
        assert_eq!(u16::from_le_bytes([t[34], t[35]]), 4 + 1 + 1 + 16 + 2);
        // The first processor is the bootstrap one; the others are not.
        assert_eq!(t[44 + 3], 0x3);
        assert_eq!(t[64 + 3], 0x1);
    }

    #[test]
    fn gdt_entries_decode_to_long_mode_segments() {
        let g = gdt();
        let cs = segment(CODE_SEL, g[2]);
        assert_eq!((cs.l, cs.db, cs.present, cs.s, cs.type_), (1, 0, 1, 1, 0xb));
        let ds = segment(DATA_SEL, g[3]);
        assert_eq!((ds.l, ds.db, ds.type_), (0, 1, 0x3));
    }
}
