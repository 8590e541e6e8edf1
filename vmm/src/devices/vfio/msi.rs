//! The MSI capability of a passed-through function that has no MSI-X,
//! emulated: the guest's control, address, data and mask registers live
//! here (the real ones are vfio-pci's), and enabling MSI hands VFIO one
//! eventfd per vector enabled, each the KVM irqfd of a GSI routed to the
//! vector's message. Vector `i` of `n` sends the data with its low
//! log2(`n`) bits replaced by `i`, as the PCI spec has it.
//!
//! Layout (offsets in the capability): 2 message control; 4 address (low);
//! then, 64-bit capable, 8 address (high), 0xc data, 0x10 mask, 0x14
//! pending; else 8 data, 0xc mask, 0x10 pending. Mask and pending exist
//! only with per-vector masking.

/// The most vectors MSI can have.
pub const MSI_MAX: usize = 32;

const CTL_ENABLE: u16 = 0x0001;
const CTL_MME: u16 = 0x0070;
const CTL_64BIT: u16 = 0x0080;
const CTL_PVM: u16 = 0x0100;

use super::msix::{sync_vector, VectorWires};

/// What the capability drives: VFIO's MSI eventfds, and each vector's KVM
/// route and irqfd.
pub trait MsiSink: VectorWires {
    /// VFIO: MSI on with `n` vectors (their eventfds), or off (`n` = 0).
    /// False if VFIO refused.
    fn enable(&mut self, n: usize) -> bool;
}

#[derive(Debug)]
pub struct Msi {
    /// The device's read-only control bits (capabilities).
    caps: u16,
    /// Vectors the device and VFIO can both give, a power of two.
    max: usize,
    /// What the guest wrote: enable and multiple message enable.
    ctl: u16,
    address: u64,
    data: u16,
    mask: u32,
    /// Vectors VFIO has on (0: MSI off).
    on: usize,
    live: [bool; MSI_MAX],
    routed: [Option<(u64, u32)>; MSI_MAX],
}

impl Msi {
    /// The capability as the device's message control word `ctl` describes
    /// it, with `offered` vectors from VFIO.
    pub fn new(ctl: u16, offered: usize) -> Msi {
        let capable = 1usize << ((ctl >> 1) & 7).min(5);
        let max = capable.min(offered.max(1)).min(MSI_MAX);
        // A power of two no larger than both.
        let max = 1usize << max.ilog2();
        // Multiple Message Capable says what we can give, not the device.
        let mmc = (max.ilog2() as u16) << 1;
        Msi { caps: (ctl & (CTL_64BIT | CTL_PVM)) | mmc, max, ctl: 0, address: 0, data: 0, mask: 0, on: 0, live: [false; MSI_MAX], routed: [None; MSI_MAX] }
    }

    /// Vectors the guest may enable at most.
    pub fn max_vectors(&self) -> usize {
        self.max
    }

    fn is64(&self) -> bool {
        self.caps & CTL_64BIT != 0
    }

    fn masking(&self) -> bool {
        self.caps & CTL_PVM != 0
    }

    /// Bytes of the capability, header included.
    pub fn len(&self) -> usize {
        10 + if self.is64() { 4 } else { 0 } + if self.masking() { 10 } else { 0 }
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    fn data_off(&self) -> usize {
        if self.is64() {
            0xc
        } else {
            8
        }
    }

    /// The 32-bit register at `off` (dword-aligned) as the guest reads it.
    fn dword(&self, off: usize) -> u32 {
        let d = self.data_off();
        match off {
            0 => (((self.ctl & (CTL_ENABLE | CTL_MME)) | self.caps) as u32) << 16,
            4 => self.address as u32,
            8 if self.is64() => (self.address >> 32) as u32,
            o if o == d => self.data as u32,
            o if o == d + 4 && self.masking() => self.mask,
            // Pending bits stay in the eventfds of masked vectors; none is
            // reported.
            _ => 0,
        }
    }

    /// Byte `off` of the capability (from its id byte) as the guest reads
    /// it; 0 and 1 (id, next) are the caller's.
    pub fn read(&self, off: usize) -> u8 {
        (self.dword(off & !3) >> ((off & 3) * 8)) as u8
    }

    /// The guest writes byte `off` of the capability. Returns whether the
    /// vectors must be brought in line ([`Self::sync`]).
    pub fn write(&mut self, off: usize, b: u8) -> bool {
        let shift = (off & 3) * 8;
        let set32 = |v: u32| (v & !(0xff << shift)) | (b as u32) << shift;
        let d = self.data_off();
        match off & !3 {
            0 if off >= 2 => {
                let ctl = set32((self.ctl as u32) << 16) >> 16;
                self.ctl = ctl as u16 & (CTL_ENABLE | CTL_MME);
            }
            4 => self.address = (self.address & !0xffff_ffff) | set32(self.address as u32) as u64 & 0xffff_fffc,
            8 if self.is64() => self.address = (self.address & 0xffff_ffff) | (set32((self.address >> 32) as u32) as u64) << 32,
            o if o == d && off < d + 2 => self.data = set32(self.data as u32) as u16,
            o if o == d + 4 && self.masking() => self.mask = set32(self.mask),
            _ => return false,
        }
        true
    }

    /// Vectors the guest has enabled now (0: MSI off).
    fn wanted(&self) -> usize {
        if self.ctl & CTL_ENABLE == 0 {
            return 0;
        }
        (1usize << ((self.ctl & CTL_MME) >> 4).min(5)).min(self.max)
    }

    /// Brings VFIO and KVM in line with the registers.
    pub fn sync(&mut self, sink: &mut dyn MsiSink) {
        let n = self.wanted();
        if n != self.on {
            self.off(sink);
            if n > 0 {
                if !sink.enable(n) {
                    // VFIO refused: MSI stays off, and the guest reads it so.
                    self.ctl &= !CTL_ENABLE;
                    return;
                }
                self.on = n;
            }
        }
        for v in 0..self.on {
            let data = (self.data as u32 & !(self.on as u32 - 1)) | v as u32;
            let want = self.mask & (1 << v) == 0;
            sync_vector(sink, v, want, (self.address, data), &mut self.live[v], &mut self.routed[v]);
        }
    }

    fn off(&mut self, sink: &mut dyn MsiSink) {
        for v in 0..MSI_MAX {
            if self.live[v] {
                sink.deliver(v, false);
                self.live[v] = false;
            }
        }
        if self.on > 0 {
            sink.enable(0);
            self.on = 0;
        }
        self.routed = [None; MSI_MAX];
    }

    /// Everything off (VM end).
    pub fn reset(&mut self, sink: &mut dyn MsiSink) {
        self.off(sink);
        self.ctl = 0;
        self.address = 0;
        self.data = 0;
        self.mask = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::devices::vfio::msix::tests::Log;

    impl MsiSink for Log {
        fn enable(&mut self, n: usize) -> bool {
            self.0.push(format!("enable {n}"));
            n != 3 && !self.0.iter().any(|l| l == "refuse")
        }
    }

    /// A guest access of `bytes` at `off`, then what the device does after it.
    fn write_bytes(m: &mut Msi, off: usize, bytes: &[u8], log: &mut Log) {
        let mut touched = false;
        for (i, b) in bytes.iter().enumerate() {
            touched |= m.write(off + i, *b);
        }
        if touched {
            m.sync(log);
        }
    }

    fn write32(m: &mut Msi, off: usize, v: u32, log: &mut Log) {
        write_bytes(m, off, &v.to_le_bytes(), log)
    }

    fn read32(m: &Msi, off: usize) -> u32 {
        u32::from_le_bytes([m.read(off), m.read(off + 1), m.read(off + 2), m.read(off + 3)])
    }

    #[test]
    fn one_vector_32_bit_enables_routes_and_disables() {
        let mut log = Log::default();
        let mut m = Msi::new(0x0000, 1);
        assert_eq!((m.len(), m.max_vectors()), (10, 1));
        write32(&mut m, 4, 0xfee0_0000, &mut log);
        write32(&mut m, 8, 0x4041, &mut log);
        assert!(log.0.is_empty(), "nothing until enabled: {:?}", log.0);
        assert_eq!((read32(&m, 4), read32(&m, 8) & 0xffff), (0xfee0_0000, 0x4041));
        // Enable: the control word is the high half of the first dword.
        write32(&mut m, 0, 1 << 16, &mut log);
        assert_eq!(log.0, ["enable 1", "route 0 0xfee00000 0x4041", "irqfd 0 true"]);
        assert_eq!(read32(&m, 0) >> 16 & 1, 1);
        // A new data value while on: routed again, the irqfd stays.
        log.0.clear();
        write32(&mut m, 8, 0x4051, &mut log);
        assert_eq!(log.0, ["route 0 0xfee00000 0x4051"]);
        log.0.clear();
        write32(&mut m, 0, 0, &mut log);
        assert_eq!(log.0, ["irqfd 0 false", "enable 0"]);
    }

    #[test]
    fn multiple_messages_with_per_vector_masks_on_64_bit() {
        let mut log = Log::default();
        // 64-bit, per-vector masking, capable of 8 (MMC 3); VFIO offers 4.
        let mut m = Msi::new(CTL_64BIT | CTL_PVM | 3 << 1, 4);
        assert_eq!((m.len(), m.max_vectors()), (24, 4));
        assert_eq!(read32(&m, 0) >> 16, (CTL_64BIT | CTL_PVM | 2 << 1) as u32, "the capability bits read back, MMC saying the 4 we can give");
        write32(&mut m, 4, 0xfee0_1000, &mut log);
        write32(&mut m, 8, 0x1, &mut log);
        write32(&mut m, 0xc, 0x4060, &mut log);
        write32(&mut m, 0x10, 0b0010, &mut log);
        // MME 3 (8 vectors) asked; 4 is what there is.
        write32(&mut m, 0, (1 | 3 << 4) << 16, &mut log);
        assert_eq!(
            log.0,
            ["enable 4", "route 0 0x1fee01000 0x4060", "irqfd 0 true", "route 2 0x1fee01000 0x4062", "irqfd 2 true", "route 3 0x1fee01000 0x4063", "irqfd 3 true"],
            "vector 1 is masked; data's low two bits carry the vector"
        );
        assert_eq!(read32(&m, 0) >> 16 & 0x70, 3 << 4, "MME reads back as written");
        log.0.clear();
        write32(&mut m, 0x10, 0b1000, &mut log);
        assert_eq!(log.0, ["route 1 0x1fee01000 0x4061", "irqfd 1 true", "irqfd 3 false"]);
        // Fewer vectors: everything off, then on again with two.
        log.0.clear();
        write32(&mut m, 0, (1 | 1 << 4) << 16, &mut log);
        assert_eq!(log.0[..4], ["irqfd 0 false", "irqfd 1 false", "irqfd 2 false", "enable 0"]);
        assert_eq!(log.0[4..], ["enable 2", "route 0 0x1fee01000 0x4060", "irqfd 0 true", "route 1 0x1fee01000 0x4061", "irqfd 1 true"]);
        log.0.clear();
        m.reset(&mut log);
        assert_eq!(log.0, ["irqfd 0 false", "irqfd 1 false", "enable 0"]);
        // Read-only and out-of-range bytes are ignored.
        assert!(!m.write(0x14, 0xff), "pending is read-only");
        assert!(!m.write(1, 0xff), "the next pointer is not ours");
        assert!(!m.write(0x30, 0xff));
    }

    fn write16(m: &mut Msi, off: usize, v: u16, log: &mut Log) {
        write_bytes(m, off, &v.to_le_bytes(), log)
    }

    #[test]
    fn both_layouts_lengths_and_register_masks() {
        let mut log = Log::default();
        // 32-bit with per-vector masking: data at 8, mask at 0xc.
        let mut m = Msi::new(CTL_PVM, 1);
        assert_eq!(m.len(), 20);
        write32(&mut m, 4, 0xfee0_0003, &mut log);
        assert_eq!(read32(&m, 4), 0xfee0_0000, "address bits 1:0 are reserved");
        write32(&mut m, 8, 0xabcd_4041, &mut log);
        assert_eq!(read32(&m, 8), 0x4041, "data is 16 bits");
        write32(&mut m, 0xc, 1, &mut log);
        assert_eq!(read32(&m, 0xc), 1, "the mask register of the 32-bit layout");
        assert_eq!(read32(&m, 0x10), 0, "pending reads 0");
        // Linux writes the control word with a 16-bit access.
        write16(&mut m, 2, 1, &mut log);
        assert_eq!(log.0, ["enable 1"], "vector 0 is masked: on, no irqfd");
        // 64-bit without masking: 14 bytes, no mask register.
        let m = Msi::new(CTL_64BIT, 1);
        assert_eq!(m.len(), 14);
        assert_eq!(read32(&m, 0x10), 0);
    }

    #[test]
    fn a_count_vfio_cannot_give_is_rounded_down_and_a_refused_enable_reads_off() {
        let mut log = Log::default();
        // Capable of 32; VFIO offers 3: 2 can be had, and MMC says so.
        let mut m = Msi::new(5 << 1, 3);
        assert_eq!(m.max_vectors(), 2);
        assert_eq!((read32(&m, 0) >> 17) & 7, 1, "MMC is log2 of what we give");
        write32(&mut m, 4, 0xfee0_0000, &mut log);
        log.0.push("refuse".into());
        write32(&mut m, 0, (1 | 1 << 4) << 16, &mut log);
        assert_eq!(log.0[1..], ["enable 2"]);
        assert_eq!((read32(&m, 0) >> 16) & 1, 0, "the guest reads MSI off after VFIO refused it");
    }
}
