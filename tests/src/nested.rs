//! Harness for the nested tier: builds the L1/L2 images (images/nested)
//! from the current workspace build, boots L1 under QEMU TCG with emulated
//! SVM, runs a scenario in it and returns the console text.

use std::process::Command;
use std::sync::OnceLock;

use crate::workspace;

/// True when QEMU is installed; otherwise says loudly why the test skips.
pub fn qemu_available(test: &str) -> bool {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => {
            crate::report_skip(test, "qemu-system-x86_64 is not installed; run images/nested/packages.sh (scripts/test.sh does)");
            false
        }
    }
}

/// Builds target/nested once per test binary, from the current binaries.
pub fn build() {
    static B: OnceLock<()> = OnceLock::new();
    B.get_or_init(|| {
        let o = Command::new("bash").arg(workspace().join("images/nested/build.sh")).output().expect("run images/nested/build.sh");
        assert!(o.status.success(), "building the nested images failed:\n{}", String::from_utf8_lossy(&o.stderr));
    });
}

/// Runs `scenario` in L1; returns everything the consoles printed.
pub fn run(scenario: &str, timeout_s: u32) -> String {
    build();
    let o = Command::new("bash").arg(workspace().join("images/nested/run.sh")).arg(scenario).arg(timeout_s.to_string()).output().expect("run images/nested/run.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "QEMU failed or timed out ({}):\n{text}", o.status);
    text
}

/// The value after `KEY=` on its own line.
pub fn value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.trim_end_matches('\r').strip_prefix(key)?.strip_prefix('='))
}

/// Runs `scenario` under images/nested/run-vfio.sh (the emulated Intel
/// IOMMU) with `env` set (VFIO_IVSHMEM, VFIO_AHCI: the extra devices), and
/// a blank image for the NVMe device it always attaches; returns the
/// console text once the scenario printed `done`.
pub fn run_vfio(scenario: &str, env: &[(&str, &std::path::Path)], done: &str) -> String {
    build();
    let img = std::env::temp_dir().join(format!("vgpu-nested-{scenario}-nvme-{}.img", std::process::id()));
    std::fs::write(&img, vec![0u8; 1 << 20]).expect("write the NVMe image");
    let mut cmd = Command::new("bash");
    cmd.arg(workspace().join("images/nested/run-vfio.sh")).arg(scenario).arg(&img).arg("600");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("run images/nested/run-vfio.sh");
    let _ = std::fs::remove_file(&img);
    let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && out.contains(done), "QEMU failed or the scenario did not finish ({}):\n{out}", o.status);
    out
}
