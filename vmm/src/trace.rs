//! The last exits of one vCPU, kept so that a guest that dies (a triple
//! fault, an entry failure, an internal error) can be read from the log
//! rather than guessed at.
//!
//! KVM copies the guest's registers into the shared `kvm_run` page at
//! every exit when asked to (`KVM_CAP_SYNC_REGS`), so keeping them costs no
//! ioctl. On AMD, KVM re-initialises a vCPU that shut down before it
//! returns KVM_EXIT_SHUTDOWN (the VMCB is undefined after a shutdown), so
//! the registers read after a triple fault are the INIT state: the exits
//! before it are what tells where the guest was.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_regs, kvm_sregs};

/// Exits kept per vCPU.
pub const KEPT: usize = 32;

/// One exit: what it was and where the guest stood.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exit {
    pub at: Duration,
    pub what: &'static str,
    /// The port or guest-physical address, where the exit has one.
    pub addr: u64,
    pub rip: u64,
    pub rsp: u64,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
}

/// A ring of the last [`KEPT`] exits.
pub struct ExitTrace {
    start: Instant,
    ring: [Exit; KEPT],
    next: usize,
    total: u64,
}

impl Default for ExitTrace {
    fn default() -> Self {
        ExitTrace { start: Instant::now(), ring: [Exit::default(); KEPT], next: 0, total: 0 }
    }
}

impl ExitTrace {
    /// Records an exit with the registers KVM synced into `kvm_run`
    /// (`regs` is None where the host has no KVM_CAP_SYNC_REGS).
    pub fn record(&mut self, what: &'static str, addr: u64, regs: Option<(&kvm_regs, &kvm_sregs)>) {
        let mut e = Exit { at: self.start.elapsed(), what, addr, ..Default::default() };
        if let Some((r, s)) = regs {
            (e.rip, e.rsp) = (r.rip, r.rsp);
            (e.cr0, e.cr2, e.cr3, e.cr4, e.efer) = (s.cr0, s.cr2, s.cr3, s.cr4, s.efer);
        }
        self.ring[self.next] = e;
        self.next = (self.next + 1) % KEPT;
        self.total += 1;
    }

    /// The kept exits, oldest first.
    pub fn exits(&self) -> Vec<Exit> {
        let kept = (self.total as usize).min(KEPT);
        (0..kept).map(|i| self.ring[(self.next + KEPT - kept + i) % KEPT]).collect()
    }

    /// A report for the log: the registers now, and the kept exits.
    pub fn report(&self, vcpu: usize, why: &str, regs: Option<&kvm_regs>, sregs: Option<&kvm_sregs>, events: Option<&kvm_bindings::kvm_vcpu_events>, synced: bool) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "vCPU {vcpu}: {why}, after {} exits in {:.3} s", self.total, self.start.elapsed().as_secs_f64());
        if let Some(r) = regs {
            let _ = writeln!(
                out,
                "  regs now: rip={:#x} rsp={:#x} rflags={:#x} rax={:#x} rbx={:#x} rcx={:#x} rdx={:#x} rsi={:#x} rdi={:#x} rbp={:#x}",
                r.rip, r.rsp, r.rflags, r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.rbp
            );
            if r.rip == 0xfff0 {
                let _ = writeln!(out, "  (rip 0xfff0 is the INIT state: KVM on AMD resets a vCPU that shut down; the exits below show where it was)");
            }
        }
        if let Some(s) = sregs {
            let _ = writeln!(
                out,
                "  sregs now: cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x} cs={:#x}@{:#x} idt={:#x}/{:#x} gdt={:#x}/{:#x} apic_base={:#x}",
                s.cr0, s.cr2, s.cr3, s.cr4, s.efer, s.cs.selector, s.cs.base, s.idt.base, s.idt.limit, s.gdt.base, s.gdt.limit, s.apic_base
            );
        }
        if let Some(e) = events {
            let _ = writeln!(
                out,
                "  events: exception injected={} nr={} error_code={:#x} pending={}; interrupt injected={} nr={}; nmi injected={} pending={}",
                e.exception.injected, e.exception.nr, e.exception.error_code, e.exception.pending, e.interrupt.injected, e.interrupt.nr, e.nmi.injected, e.nmi.pending
            );
        }
        if !synced {
            let _ = writeln!(out, "  (this host's KVM has no KVM_CAP_SYNC_REGS: the exits below carry no registers)");
        }
        let _ = writeln!(out, "  last {} exits, oldest first:", self.exits().len());
        for e in self.exits() {
            let _ = writeln!(
                out,
                "    {:>10.6}s {:<9} addr={:#x} rip={:#x} rsp={:#x} cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x}",
                e.at.as_secs_f64(),
                e.what,
                e.addr,
                e.rip,
                e.rsp,
                e.cr0,
                e.cr2,
                e.cr3,
                e.cr4,
                e.efer
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_exits_oldest_first() {
        let mut t = ExitTrace::default();
        for i in 0..(KEPT as u64 + 5) {
            let r = kvm_regs { rip: i, ..Default::default() };
            t.record("io-out", i, Some((&r, &kvm_sregs::default())));
        }
        let e = t.exits();
        assert_eq!(e.len(), KEPT);
        assert_eq!(e[0].rip, 5);
        assert_eq!(e[KEPT - 1].rip, KEPT as u64 + 4);
        let report = t.report(0, "guest triple fault", Some(&kvm_regs { rip: 0xfff0, ..Default::default() }), None, None, true);
        assert!(report.contains("INIT state"), "{report}");
        assert!(report.contains(&format!("rip={:#x}", KEPT as u64 + 4)), "{report}");
        assert_eq!(report.lines().filter(|l| l.contains("io-out")).count(), KEPT);
    }

    #[test]
    fn a_short_trace_lists_only_what_happened() {
        let mut t = ExitTrace::default();
        t.record("hlt", 0, None);
        t.record("mmio-read", 0xfee0_0000, None);
        let e = t.exits();
        assert_eq!(e.iter().map(|e| e.what).collect::<Vec<_>>(), ["hlt", "mmio-read"]);
        let report = t.report(1, "guest triple fault", None, None, None, false);
        assert!(report.contains("no KVM_CAP_SYNC_REGS"), "{report}");
        assert!(report.contains("addr=0xfee00000"), "{report}");
    }
}
