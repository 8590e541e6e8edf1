//! The emulated MSI-X table of a passthrough device. The guest programs
//! this copy; the real table is programmed by the host kernel (vfio-pci)
//! with the host's vectors, whose eventfds are KVM irqfds here.
//!
//! A vector is live when MSI-X is enabled, the function is not masked and
//! the vector is not masked. Going live: its GSI's route is set to the
//! entry's (address, data), then its irqfd is registered. Leaving: the
//! irqfd is removed, so interrupts the device raises meanwhile stay
//! counted in the eventfd, and KVM delivers them when the irqfd comes back
//! (the pending bit, in effect).

/// Bytes per table entry: address low, address high, data, vector control.
pub const ENTRY_SIZE: u64 = 16;
/// Most vectors the MSI-X capability can declare.
pub const MAX_VECTORS: usize = 2048;

/// Message control bits (the capability's word at +2).
pub const CTL_ENABLE: u16 = 1 << 15;
pub const CTL_MASK_ALL: u16 = 1 << 14;

/// One vector's wiring, for MSI-X and MSI alike: KVM's route and irqfd,
/// or a recorder in tests.
pub trait VectorWires {
    /// Points vector `v`'s GSI at the MSI (address, data).
    fn route(&mut self, v: usize, address: u64, data: u32);
    /// Registers (or removes) vector `v`'s irqfd.
    fn deliver(&mut self, v: usize, on: bool);
}

/// Where MSI-X interrupts go: VFIO and KVM, or a recorder in tests.
pub trait VectorSink: VectorWires {
    /// MSI-X on (every vector's eventfd handed to VFIO) or off.
    fn set_enabled(&mut self, on: bool);
}

/// Brings vector `v` in line with `want`: live (its GSI routed to `msg`,
/// then its irqfd registered) or not (its irqfd removed). `live` and
/// `routed` are what was last done for it.
pub fn sync_vector(sink: &mut dyn VectorWires, v: usize, want: bool, msg: (u64, u32), live: &mut bool, routed: &mut Option<(u64, u32)>) {
    if want {
        if *routed != Some(msg) {
            sink.route(v, msg.0, msg.1);
            *routed = Some(msg);
        }
        if !*live {
            sink.deliver(v, true);
            *live = true;
        }
    } else if *live {
        sink.deliver(v, false);
        *live = false;
    }
}

#[derive(Debug)]
pub struct MsixTable {
    entries: Vec<[u8; ENTRY_SIZE as usize]>,
    enabled: bool,
    masked_all: bool,
    live: Vec<bool>,
    routed: Vec<Option<(u64, u32)>>,
}

impl MsixTable {
    /// `n` vectors (1 to [`MAX_VECTORS`]), all masked, MSI-X off.
    pub fn new(n: usize) -> MsixTable {
        let n = n.clamp(1, MAX_VECTORS);
        let mut masked = [0u8; ENTRY_SIZE as usize];
        masked[12] = 1;
        MsixTable { entries: vec![masked; n], enabled: false, masked_all: false, live: vec![false; n], routed: vec![None; n] }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Size of the table in bytes.
    pub fn table_bytes(&self) -> u64 {
        self.entries.len() as u64 * ENTRY_SIZE
    }

    /// Size of the pending-bit array in bytes (a bit per vector, in qwords).
    pub fn pba_bytes(&self) -> u64 {
        self.entries.len().div_ceil(64) as u64 * 8
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The enable and function-mask bits, as the guest last wrote them.
    pub fn control_bits(&self) -> u16 {
        (if self.enabled { CTL_ENABLE } else { 0 }) | if self.masked_all { CTL_MASK_ALL } else { 0 }
    }

    /// Reads table bytes at `off`; bytes past the table read as zero.
    pub fn read(&self, off: u64, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            let o = off.saturating_add(i as u64);
            *d = self.entries.get((o / ENTRY_SIZE) as usize).map_or(0, |e| e[(o % ENTRY_SIZE) as usize]);
        }
    }

    /// Writes table bytes at `off` (any size, any alignment; bytes past
    /// the table are dropped), then brings the touched vectors in line.
    pub fn write(&mut self, off: u64, data: &[u8], sink: &mut dyn VectorSink) {
        let mut touched = Vec::new();
        for (i, b) in data.iter().enumerate() {
            let o = off.saturating_add(i as u64);
            let v = (o / ENTRY_SIZE) as usize;
            let Some(e) = self.entries.get_mut(v) else { continue };
            e[(o % ENTRY_SIZE) as usize] = *b;
            if !touched.contains(&v) {
                touched.push(v);
            }
        }
        for v in touched {
            self.sync(v, sink);
        }
    }

    /// The guest wrote the enable and function-mask bits of message control.
    pub fn write_control(&mut self, ctl: u16, sink: &mut dyn VectorSink) {
        let (enable, mask) = (ctl & CTL_ENABLE != 0, ctl & CTL_MASK_ALL != 0);
        if enable && !self.enabled {
            sink.set_enabled(true);
        }
        let disabling = !enable && self.enabled;
        self.enabled = enable;
        self.masked_all = mask;
        for v in 0..self.entries.len() {
            self.sync(v, sink);
        }
        if disabling {
            sink.set_enabled(false);
        }
    }

    /// Turns everything off (device reset, VM end).
    pub fn reset(&mut self, sink: &mut dyn VectorSink) {
        self.write_control(0, sink);
        *self = MsixTable::new(self.entries.len());
    }

    fn message(&self, v: usize) -> (u64, u32, bool) {
        let e = &self.entries[v];
        let w = |i: usize| u32::from_le_bytes([e[i], e[i + 1], e[i + 2], e[i + 3]]);
        ((w(4) as u64) << 32 | w(0) as u64, w(8), w(12) & 1 != 0)
    }

    fn sync(&mut self, v: usize, sink: &mut dyn VectorSink) {
        let (address, data, masked) = self.message(v);
        let want = self.enabled && !self.masked_all && !masked;
        sync_vector(sink, v, want, (address, data), &mut self.live[v], &mut self.routed[v]);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// What the emulation asked of its wires, in order (shared with the
    /// MSI tests).
    #[derive(Default)]
    pub(in crate::devices::vfio) struct Log(pub Vec<String>);

    impl VectorWires for Log {
        fn route(&mut self, v: usize, a: u64, d: u32) {
            self.0.push(format!("route {v} {a:#x} {d:#x}"));
        }
        fn deliver(&mut self, v: usize, on: bool) {
            self.0.push(format!("irqfd {v} {on}"));
        }
    }

    impl VectorSink for Log {
        fn set_enabled(&mut self, on: bool) {
            self.0.push(format!("enable {on}"));
        }
    }

    fn entry(t: &mut MsixTable, v: u64, addr: u32, data: u32, ctl: u32, log: &mut Log) {
        for (i, w) in [addr, 0, data, ctl].into_iter().enumerate() {
            t.write(v * 16 + i as u64 * 4, &w.to_le_bytes(), log);
        }
    }

    #[test]
    fn linux_enable_sequence_routes_then_registers_and_masking_removes_the_irqfd() {
        let mut t = MsixTable::new(3);
        let mut log = Log::default();
        // Linux: enable with the function masked, program, unmask.
        t.write_control(CTL_ENABLE | CTL_MASK_ALL, &mut log);
        entry(&mut t, 0, 0xfee0_0000, 0x41, 0, &mut log);
        entry(&mut t, 1, 0xfee0_1000, 0x42, 1, &mut log);
        assert_eq!(log.0, ["enable true"]);
        t.write_control(CTL_ENABLE, &mut log);
        assert_eq!(log.0[1..], ["route 0 0xfee00000 0x41", "irqfd 0 true"]);
        log.0.clear();
        // Mask and unmask vector 0: the irqfd goes and comes back, the route stays.
        t.write(12, &1u32.to_le_bytes(), &mut log);
        t.write(12, &0u32.to_le_bytes(), &mut log);
        assert_eq!(log.0, ["irqfd 0 false", "irqfd 0 true"]);
        log.0.clear();
        // A new message while live: rerouted, irqfd kept.
        t.write(8, &0x51u32.to_le_bytes(), &mut log);
        assert_eq!(log.0, ["route 0 0xfee00000 0x51"]);
        log.0.clear();
        t.write_control(0, &mut log);
        assert_eq!(log.0, ["irqfd 0 false", "enable false"]);
        assert_eq!(t.control_bits(), 0);
    }

    #[test]
    fn table_accesses_of_any_size_and_offset_never_panic_and_read_back() {
        let mut t = MsixTable::new(2);
        let mut log = Log::default();
        t.write(0, &0x1122_3344_5566_7788u64.to_le_bytes(), &mut log);
        let mut q = [0u8; 8];
        t.read(0, &mut q);
        assert_eq!(u64::from_le_bytes(q), 0x1122_3344_5566_7788);
        // Straddling the end, past the end, at u64::MAX: dropped or zero.
        t.write(28, &[0xff; 8], &mut log);
        t.write(u64::MAX - 2, &[1; 8], &mut log);
        t.read(u64::MAX - 2, &mut q);
        assert_eq!(q, [0; 8]);
        t.read(30, &mut q);
        assert_eq!(q[..2], [0xff, 0xff]);
        assert_eq!(q[2..], [0; 6]);
        for off in 0..40u64 {
            for len in [1usize, 2, 3, 4, 8] {
                t.write(off, &vec![off as u8; len], &mut log);
                let mut d = vec![0u8; len];
                t.read(off, &mut d);
            }
        }
        // Nothing is live while MSI-X is off.
        assert!(log.0.is_empty(), "{:?}", log.0);
        assert_eq!((t.len(), t.table_bytes(), t.pba_bytes()), (2, 32, 8));
        assert_eq!(MsixTable::new(65).pba_bytes(), 16);
    }

    #[test]
    fn function_mask_silences_every_vector_and_reset_turns_msix_off() {
        let mut t = MsixTable::new(2);
        let mut log = Log::default();
        entry(&mut t, 0, 0xfee0_0000, 0x41, 0, &mut log);
        entry(&mut t, 1, 0xfee0_0000, 0x42, 0, &mut log);
        t.write_control(CTL_ENABLE, &mut log);
        log.0.clear();
        t.write_control(CTL_ENABLE | CTL_MASK_ALL, &mut log);
        assert_eq!(log.0, ["irqfd 0 false", "irqfd 1 false"]);
        log.0.clear();
        t.write_control(CTL_ENABLE, &mut log);
        assert_eq!(log.0, ["irqfd 0 true", "irqfd 1 true"], "routes unchanged: not set again");
        log.0.clear();
        t.reset(&mut log);
        assert_eq!(log.0, ["irqfd 0 false", "irqfd 1 false", "enable false"]);
        let mut d = [0u8; 4];
        t.read(12, &mut d);
        assert_eq!(u32::from_le_bytes(d), 1, "entries masked again after reset");
    }
}
