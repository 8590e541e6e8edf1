//! Nested tier: MSI through VFIO. QEMU gives L1 an AHCI controller (MSI,
//! no MSI-X) with a disk over an image this test wrote; L1 binds it to
//! vfio-pci and `vgpu-vmm --vfio` passes it to Debian's stock kernel
//! (images/nested/scenarios/vfio-msi.sh), whose ahci driver reads the
//! test's marker and writes its own on MSI interrupts, through the VMM's
//! emulated MSI capability. The test finds the guest's marker in the image.

use vgpu_tests::nested;

const HOST_MARKER: &str = "MARKER-FROM-HOST-AHCI-TEST";
const GUEST_MARKER: &str = "MARKER-FROM-GUEST-L2-AHCI";

fn interrupts(out: &str, prefix: &str) -> u64 {
    out.lines().filter_map(|l| l.trim_end_matches('\r').strip_prefix(prefix)).map(|l| l.split_whitespace().skip(1).map_while(|f| f.parse::<u64>().ok()).sum::<u64>()).sum()
}

#[test]
fn a_device_with_msi_and_no_msix_works_in_the_guest_on_msi() {
    if !nested::qemu_available("a_device_with_msi_and_no_msix_works_in_the_guest_on_msi") {
        return;
    }
    let disk = std::env::temp_dir().join(format!("vgpu-nested-ahci-{}.img", std::process::id()));
    let mut bytes = vec![0u8; 16 << 20];
    bytes[..HOST_MARKER.len()].copy_from_slice(HOST_MARKER.as_bytes());
    std::fs::write(&disk, &bytes).expect("write the AHCI disk image");
    let out = nested::run_vfio("vfio-msi", &[("VFIO_AHCI", &disk)], "MSI-DONE");
    let after = std::fs::read(&disk).expect("read the AHCI image back");
    let _ = std::fs::remove_file(&disk);
    assert_eq!(nested::value(&out, "AHCI-DRIVER"), Some("vfio-pci"), "{out}");
    assert_eq!(nested::value(&out, "VMM-EXIT"), Some("0"), "{out}");
    assert!(out.contains("interrupts=\"msi\""), "the VMM did not set the device up for MSI:\n{out}");
    assert_eq!(nested::value(&out, "CONSOLE: L2-AHCI-READ"), Some(HOST_MARKER), "{out}");
    assert_eq!(nested::value(&out, "CONSOLE: L2-AHCI-READBACK"), Some(GUEST_MARKER), "{out}");
    assert_eq!(nested::value(&out, "CONSOLE: L2-AHCI-IRQ-MODE").map(str::trim), Some("msi"), "the ahci driver is not on MSI:\n{out}");
    let (b, a) = (interrupts(&out, "CONSOLE: L2-IRQ-BEFORE: "), interrupts(&out, "CONSOLE: L2-IRQ-AFTER: "));
    assert!(b > 0 && a > b, "ahci MSI interrupts did not rise over the read and write: {b} then {a}\n{out}");
    assert_eq!(&after[512..512 + GUEST_MARKER.len()], GUEST_MARKER.as_bytes(), "the guest's marker is not in the image's sector 1");
    println!("nested: the guest's ahci MSI interrupts went from {b} to {a}");
}
