//! KVM tier: vgpu-vmm runs the bare-metal test guest on this machine's own
//! /dev/kvm. It reads virtio-rng over virtio-pci, survives hostile accesses,
//! and reports a triple fault clearly.

use std::time::Duration;

use vgpu_tests::vmm_harness::*;

#[test]
fn test_guest_reads_virtio_rng_over_pci_and_resets_cleanly() {
    if !kvm_available("test_guest_reads_virtio_rng_over_pci_and_resets_cleanly") {
        return;
    }
    let g = Guest::start("rng", &[]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "exit status; stderr:\n{err}\nserial:\n{out}");
    assert!(out.contains("virtio-rng at slot 1"), "{out}");
    let line = out.lines().find(|l| l.starts_with("RNG ")).unwrap_or_else(|| panic!("no RNG line:\n{out}"));
    let hex = &line[4..];
    assert_eq!(hex.len(), 32, "{line}");
    assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{line}");
    assert!(out.contains("TEST PASSED rng"), "{out}");
    assert!(err.contains("guest reset"), "{err}");
}

#[test]
fn hostile_guest_accesses_are_logged_and_ignored() {
    if !kvm_available("hostile_guest_accesses_are_logged_and_ignored") {
        return;
    }
    let g = Guest::start("hostile", &[]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    // The guest checked every answer itself (all-ones reads, read-only
    // registers unchanged) and then used virtio-rng successfully.
    assert!(out.contains("hostile accesses done") && out.contains("TEST PASSED hostile"), "{out}");
    assert_eq!(st.code(), Some(0), "{err}");
    assert!(err.contains("unmapped address ignored"), "unmapped accesses are logged:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn triple_fault_ends_the_vm_with_a_clear_status() {
    if !kvm_available("triple_fault_ends_the_vm_with_a_clear_status") {
        return;
    }
    let g = Guest::start("triple", &[]);
    let (st, err, _) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(3), "{err}");
    assert!(err.contains("triple fault"), "{err}");
    // What the guest was doing is in the log: registers and the last
    // exits, here the serial writes of "triple fault next" and then the
    // shutdown itself.
    assert!(err.contains("regs now: rip="), "the vCPU's registers are logged:\n{err}");
    assert!(err.contains("exits, oldest first"), "the vCPU's last exits are logged:\n{err}");
    let exits: Vec<&str> = err.lines().skip_while(|l| !l.contains("exits, oldest first")).skip(1).take_while(|l| l.contains(" addr=")).collect();
    assert!(exits.iter().filter(|l| l.contains("io-out") && l.contains("addr=0x3f8")).count() >= 10, "serial writes among the last exits:\n{err}");
    assert!(exits.last().is_some_and(|l| l.contains("shutdown")), "the shutdown is the last exit:\n{err}");
}

#[test]
fn guest_with_two_vcpus_runs_on_the_boot_cpu() {
    if !kvm_available("guest_with_two_vcpus_runs_on_the_boot_cpu") {
        return;
    }
    let g = Guest::start("rng", &["--vcpus", "2"]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "{err}");
    assert!(out.contains("TEST PASSED rng"), "{out}");
}
