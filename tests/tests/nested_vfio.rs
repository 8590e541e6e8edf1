//! Nested tier: whole-device passthrough with VFIO. This test writes a raw
//! image with a marker in sector 0; QEMU gives L1 an emulated Intel IOMMU
//! and an NVMe device over that image (images/nested/run-vfio.sh). Inside
//! L1 (the `vfio` scenario), bad `--vfio` input is refused first; then the
//! device is bound to vfio-pci and `vgpu-vmm --vfio` passes it to Debian's
//! stock kernel, whose nvme driver reads the marker and writes its own in
//! sector 1 with MSI-X interrupts. After QEMU exits the test finds the
//! guest's marker in the image. One run; each test checks one promise.

use std::process::Command;
use std::sync::OnceLock;

use vgpu_tests::{nested, workspace};

const HOST_MARKER: &str = "MARKER-FROM-HOST-VFIO-TEST";
const GUEST_MARKER: &str = "MARKER-FROM-GUEST-L2-NVME";

struct Run {
    console: String,
    /// The image's first two sectors after QEMU exited.
    sectors: Vec<u8>,
    seconds: f64,
}

fn output(test: &str) -> Option<&'static Run> {
    static OUT: OnceLock<Run> = OnceLock::new();
    if !nested::qemu_available(test) {
        return None;
    }
    Some(OUT.get_or_init(|| {
        nested::build();
        let img = std::env::temp_dir().join(format!("vgpu-nested-vfio-{}.img", std::process::id()));
        let (mut sectors, mut seconds) = (Vec::new(), 0.0);
        // An attempt the emulator broke is run once more, from a fresh image.
        let console = nested::retrying_emulator_faults("vfio", || {
            let mut bytes = vec![0u8; 16 << 20];
            bytes[..HOST_MARKER.len()].copy_from_slice(HOST_MARKER.as_bytes());
            std::fs::write(&img, &bytes).expect("write the NVMe image");
            let t0 = std::time::Instant::now();
            let mut cmd = Command::new("bash");
            cmd.arg(workspace().join("images/nested/run-vfio.sh")).arg("vfio").arg(&img).arg("900");
            let (o, console) = nested::run_qemu("vfio", &mut cmd);
            seconds = t0.elapsed().as_secs_f64();
            sectors = std::fs::read(&img).expect("read the NVMe image back")[..1024].to_vec();
            (o.status.success(), console)
        });
        let _ = std::fs::remove_file(&img);
        Run { console, sectors, seconds }
    }))
}

fn lines<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines().filter_map(|l| l.trim_end_matches('\r').strip_prefix(prefix)).collect()
}

/// Total interrupts of /proc/interrupts lines (`N: count ... name`).
fn interrupts(lines: &[&str]) -> u64 {
    lines.iter().map(|l| l.split_whitespace().skip(1).map_while(|f| f.parse::<u64>().ok()).sum::<u64>()).sum()
}

#[test]
fn the_guest_nvme_driver_reads_the_hosts_marker_and_the_host_finds_the_guests() {
    let Some(run) = output("the_guest_nvme_driver_reads_the_hosts_marker_and_the_host_finds_the_guests") else { return };
    let out = &run.console;
    assert!(out.contains("VFIO-DONE"), "the scenario did not finish:\n{out}");
    assert_eq!(nested::value(out, "NVME-DRIVER-BOUND"), Some("vfio-pci"), "{out}");
    assert_eq!(nested::value(out, "VMM-EXIT"), Some("0"), "the VMM did not end with the guest's reboot:\n{out}");
    assert!(nested::value(out, "CONSOLE: L2-NVME-DEVICES").is_some_and(|d| d.contains("nvme0n1")), "no NVMe disk in the guest:\n{out}");
    assert_eq!(nested::value(out, "CONSOLE: L2-NVME-READ"), Some(HOST_MARKER), "the guest did not read the host's marker:\n{out}");
    assert_eq!(nested::value(out, "CONSOLE: L2-NVME-READBACK"), Some(GUEST_MARKER), "{out}");
    assert_eq!(&run.sectors[..HOST_MARKER.len()], HOST_MARKER.as_bytes(), "sector 0 changed");
    assert_eq!(&run.sectors[512..512 + GUEST_MARKER.len()], GUEST_MARKER.as_bytes(), "the guest's marker is not in the image's sector 1:\n{out}");
    assert!(run.sectors[512 + GUEST_MARKER.len()..].iter().all(|&b| b == 0), "sector 1 holds more than the marker");
}

#[test]
fn the_guests_nvme_interrupts_are_msix_and_their_counts_rise() {
    let Some(run) = output("the_guests_nvme_interrupts_are_msix_and_their_counts_rise") else { return };
    let out = &run.console;
    let (before, after) = (lines(out, "CONSOLE: L2-IRQ-BEFORE: "), lines(out, "CONSOLE: L2-IRQ-AFTER: "));
    assert!(!before.is_empty() && before.iter().any(|l| l.contains("nvme0q")), "no nvme interrupt in the guest:\n{out}");
    // Linux 6.1 names MSI and MSI-X alike (PCI-MSI); its sysfs says which.
    assert!(before.iter().all(|l| l.contains("PCI-MSI")), "{before:?}");
    assert_eq!(nested::value(out, "CONSOLE: L2-NVME-IRQ-MODE").map(str::trim), Some("msix"), "the nvme driver is not on MSI-X:\n{out}");
    let (b, a) = (interrupts(&before), interrupts(&after));
    assert!(a > b, "nvme interrupts did not rise over the guest's read and write: {b} then {a}\n{out}");
    println!("nested: the guest's nvme MSI-X interrupts went from {b} to {a}");
}

#[test]
fn bad_vfio_input_is_refused_and_leaves_every_driver_as_it_was() {
    let Some(run) = output("bad_vfio_input_is_refused_and_leaves_every_driver_as_it_was") else { return };
    let out = &run.console;
    let nvme = nested::value(out, "NVME-ADDR").expect("the NVMe device's address");
    assert_eq!(nested::value(out, "NVME-DRIVER-BEFORE"), Some("none"), "L1 bound the NVMe device to a driver:\n{out}");
    assert_eq!(nested::value(out, "NVME-GROUP-DEVICES").map(str::trim), Some(nvme), "the NVMe device is not alone in its IOMMU group:\n{out}");
    let cases = [
        ("UNBOUND", "1", format!("{nvme} is not bound to vfio-pci (it has no driver)")),
        ("HOSTBRIDGE", "1", "0000:00:00.0 is not bound to vfio-pci".to_string()),
        ("GARBAGE", "2", "invalid PCI address 'not-a-pci-address': use DDDD:BB:DD.F".to_string()),
        ("MISSING", "1", "no PCI device 0000:00:1e.7".to_string()),
    ];
    for (name, status, says) in cases {
        assert_eq!(nested::value(out, &format!("BAD-{name}-EXIT")), Some(status), "{name}:\n{out}");
        let err = lines(out, &format!("BAD-{name}-ERR: ")).join("\n");
        assert!(err.contains(&says), "{name}: expected {says:?} in {err:?}");
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
    // Refusals leave nothing bound and open no group.
    assert_eq!(nested::value(out, "NVME-DRIVER-AFTER-BAD"), Some("none"), "{out}");
    assert_eq!(nested::value(out, "HOSTBRIDGE-DRIVER-AFTER-BAD"), Some("none"), "{out}");
    assert_eq!(nested::value(out, "VFIO-NODES-AFTER-BAD").map(str::trim), Some("vfio"), "{out}");
    // The VMM never rebinds: the device stays with vfio-pci after the VM.
    assert_eq!(nested::value(out, "NVME-DRIVER-AFTER"), Some("vfio-pci"), "{out}");
}

#[test]
fn a_jailed_vmm_passes_the_device_through_too() {
    let Some(run) = output("a_jailed_vmm_passes_the_device_through_too") else { return };
    let out = &run.console;
    assert_eq!(nested::value(out, "JAILED-VMM-EXIT"), Some("0"), "the jailed VMM failed:\n{out}");
    assert_eq!(nested::value(out, "JAILED-CONSOLE: L2-NVME-READ"), Some(HOST_MARKER), "the guest of the jailed VMM did not read the marker:\n{out}");
    assert_eq!(nested::value(out, "JAILED-CONSOLE: L2-NVME-READBACK"), Some(GUEST_MARKER), "{out}");
    assert_eq!(nested::value(out, "JAILED-CONSOLE: L2-NVME-IRQ-MODE").map(str::trim), Some("msix"), "{out}");
}

#[test]
fn passthrough_run_is_timed() {
    let Some(run) = output("passthrough_run_is_timed") else { return };
    let vmm: f64 = nested::value(&run.console, "VMM-SECONDS").and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("VMM-SECONDS missing:\n{}", run.console));
    assert!(vmm > 0.0);
    println!("nested: the passthrough VM ran {vmm:.2} s from VMM start to exit; the whole QEMU run took {:.1} s", run.seconds);
}
