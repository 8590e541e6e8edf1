//! Nested tier: vgpu-vmm, inside an L1 Linux whose kvm_amd runs on QEMU's
//! emulated SVM, boots Debian's stock linux-image-amd64 to userspace with
//! 2 vCPUs. The guest sees both CPUs, reads /dev/hwrng through our
//! virtio-rng, prints its marker on our serial console and reboots; the
//! VMM exits 0.

use vgpu_tests::nested;

#[test]
fn stock_debian_kernel_boots_with_two_vcpus_and_reads_hwrng() {
    if !nested::qemu_available("stock_debian_kernel_boots_with_two_vcpus_and_reads_hwrng") {
        return;
    }
    let out = nested::run("boot", 900);
    assert!(out.contains("L1: up, running scenario boot"), "L1 did not come up:\n{out}");
    assert!(!out.contains("/dev/kvm is missing"), "kvm_amd did not load in L1:\n{out}");
    assert!(out.contains("L2: init reached"), "L2 did not reach userspace:\n{out}");
    assert_eq!(nested::value(&out, "L2-CPUS"), Some("2"), "{out}");
    assert_eq!(nested::value(&out, "L2-HWRNG-CURRENT"), Some("virtio_rng.0"), "{out}");
    let rng = nested::value(&out, "L2-HWRNG").unwrap_or_default();
    assert_eq!(rng.len(), 32, "16 bytes from /dev/hwrng:\n{out}");
    assert!(rng.chars().all(|c| c.is_ascii_hexdigit()) && rng != "0".repeat(32), "{rng}");
    assert!(out.contains("L2-MARKER-OK"), "{out}");
    assert_eq!(nested::value(&out, "VMM-EXIT"), Some("0"), "the VMM ends cleanly when the guest reboots:\n{out}");
    assert!(out.contains("guest reset"), "{out}");
}
