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

/// Runs `scenario` in L1; returns everything the consoles printed. A run
/// the emulator broke ([`emulator_fault`]) is run again, saying so.
pub fn run(scenario: &str, timeout_s: u32) -> String {
    build();
    retrying_emulator_faults(scenario, || {
        let mut cmd = Command::new("bash");
        cmd.arg(workspace().join("images/nested/run.sh")).arg(scenario).arg(timeout_s.to_string());
        let (o, text) = run_qemu(scenario, &mut cmd);
        (o.status.success(), text)
    })
}

/// Runs `cmd` (run.sh or run-vfio.sh for `scenario`) with QEMU's CPU-reset
/// log in a file of its own; returns its status and its console, with
/// [`L1_TRIPLE_FAULT`] added when that log shows L1's CPU triple-faulting.
pub fn run_qemu(scenario: &str, cmd: &mut Command) -> (std::process::Output, String) {
    let log = std::env::temp_dir().join(format!("vgpu-nested-{scenario}-{}.qemu.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let o = cmd.env("NESTED_QEMU_LOG", &log).output().expect("run QEMU for the nested test host");
    let mut text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if std::fs::read_to_string(&log).is_ok_and(|l| l.lines().any(|l| l.trim() == "Triple fault")) {
        text.push_str(&format!("\n{L1_TRIPLE_FAULT} (QEMU's CPU-reset log)\n"));
    }
    let _ = std::fs::remove_file(&log);
    (o, text)
}

/// What in a nested run's output shows the emulator under the test host
/// failed, not the code under test: L1's own kernel dying (its console
/// lines carry a bare kernel timestamp; L2 consoles are prefixed by the
/// scenarios), or an L2 guest triple-faulting. QEMU TCG's emulated SVM
/// does both now and then, with QEMU `-enable-kvm` as L1's VMM as well as
/// with ours (docs/vmm.md, "Guests that died in the nested test host").
/// No scenario triple-faults a guest on purpose. L1 itself triple-faults
/// too (QEMU's CPU-reset log shows it; `run` appends [`L1_TRIPLE_FAULT`]).
pub fn emulator_fault(text: &str) -> Option<String> {
    if let Some(l) = text.lines().find(|l| l.starts_with(L1_TRIPLE_FAULT)) {
        return Some(l.trim().to_string());
    }
    let l1_oops = |l: &str| {
        let l = l.trim_end_matches('\r');
        let Some(rest) = l.strip_prefix('[') else { return false };
        let Some((stamp, msg)) = rest.split_once(']') else { return false };
        stamp.trim().parse::<f64>().is_ok() && ["BUG: ", "Kernel panic", "general protection fault", "Oops:"].iter().any(|m| msg.trim_start().starts_with(m))
    };
    if let Some(l) = text.lines().find(|l| l1_oops(l)) {
        return Some(format!("L1's kernel died: {}", l.trim()));
    }
    // QEMU's own assertions (seen: its IOMMU translation cache under TCG,
    // `iotlb_to_section`) abort the emulator; no guest can cause one.
    if let Some(l) = text.lines().find(|l| l.starts_with("qemu-system-") && l.contains("Assertion") && l.contains("failed")) {
        return Some(format!("QEMU aborted on its own assertion: {}", l.trim()));
    }
    text.lines().find(|l| l.contains("guest triple fault")).map(|l| format!("an L2 guest triple-faulted: {}", l.trim()))
}

/// The line `run` adds to a run's output when QEMU logged a triple fault
/// of L1's CPU: the emulated machine reset, and `-no-reboot` ended it
/// without a word on the console.
pub const L1_TRIPLE_FAULT: &str = "NESTED: L1 triple-faulted";

/// How many times a nested scenario runs at most when the emulator under
/// the test host breaks it (each time said loudly): L1's kernel dying
/// (a stack guard page hit in a vCPU thread, mostly) or its CPU
/// triple-faulting comes in runs on a loaded machine, and three in a row
/// were seen in CI while another nested test ran beside the scenario.
const EMULATOR_ATTEMPTS: usize = 4;

/// Holds the nested tier's run lock (`target/nested/run.lock`) while a
/// scenario runs: shared for a first attempt, so nested tests run side by
/// side; exclusive for a run again after an emulator failure, so it has
/// the machine's cores to itself (the failures come with load). Released
/// when the file is dropped.
fn nested_run_lock(alone: bool) -> std::fs::File {
    let path = workspace().join("target/nested/run.lock");
    let _ = std::fs::create_dir_all(workspace().join("target/nested"));
    let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    if alone { f.lock() } else { f.lock_shared() }.unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
    f
}

/// Runs `attempt` (which returns whether it succeeded and its output); if
/// the emulator broke it, says so loudly and runs it again, alone on the
/// machine ([`nested_run_lock`]), up to [`EMULATOR_ATTEMPTS`] times in all.
pub fn retrying_emulator_faults(scenario: &str, mut attempt: impl FnMut() -> (bool, String)) -> String {
    let mut seen: Vec<String> = Vec::new();
    loop {
        let started = std::time::Instant::now();
        let (ok, text) = {
            let _running = nested_run_lock(!seen.is_empty());
            attempt()
        };
        match emulator_fault(&text) {
            Some(why) => {
                seen.push(why);
                if seen.len() == EMULATOR_ATTEMPTS {
                    panic!("nested scenario {scenario}: the emulator failed {EMULATOR_ATTEMPTS} times in a row ({}):\n{text}", seen.join("; then "));
                }
                // Straight to the process's stderr, not through the test
                // harness's capture: a run again is said in CI's log even
                // when the test then passes, with what the broken run cost.
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "\n*** nested scenario {scenario}: the emulated CPU under the test host failed after {:.0} s ({}); running the scenario once more, with no other nested run beside it\n",
                    started.elapsed().as_secs_f64(),
                    seen.last().map(String::as_str).unwrap_or("")
                );
            }
            None => {
                assert!(ok, "QEMU failed or timed out (after {} emulator failures):\n{text}", seen.len());
                // A scenario that gave up waiting on a guest near the
                // timeout (scenarios/lib.sh, `stalled`) printed why.
                assert!(!text.contains("SCENARIO-STALLED"), "nested scenario {scenario} stalled (after {} emulator failures):\n{text}", seen.len());
                return text;
            }
        }
    }
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
    let mut cmd = Command::new("bash");
    cmd.arg(workspace().join("images/nested/run-vfio.sh")).arg(scenario).arg(&img).arg("600");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = retrying_emulator_faults(scenario, || {
        // Blank for every run: the scenario writes the device.
        std::fs::write(&img, vec![0u8; 1 << 20]).expect("write the NVMe image");
        let (o, out) = run_qemu(scenario, &mut cmd);
        (o.status.success() && out.contains(done), out)
    });
    let _ = std::fs::remove_file(&img);
    out
}

#[cfg(test)]
mod tests {
    use super::{emulator_fault, L1_TRIPLE_FAULT};

    #[test]
    fn emulator_faults_are_told_from_guest_output() {
        let l1 = "L1: up\n[  738.684126] BUG: TASK stack guard page was hit at 000000003c24355c\n[  738.701222] Kernel panic - not syncing";
        assert!(emulator_fault(l1).is_some_and(|w| w.contains("stack guard page")));
        let l2 = "[vm-b vmm] 2026-11-27T03:00:00Z ERROR vgpu_vmm: guest triple fault: the vCPU shut down";
        assert!(emulator_fault(l2).is_some_and(|w| w.starts_with("an L2 guest")));
        let reset = format!("L1: up, running scenario cudadouble\nARBITER=117\n{L1_TRIPLE_FAULT} (QEMU's CPU-reset log)\n");
        assert!(emulator_fault(&reset).is_some_and(|w| w.starts_with(L1_TRIPLE_FAULT)));
        let qemu = "VFIO-NODES=1 vfio \nqemu-system-x86_64: system/physmem.c:2678: iotlb_to_section: Assertion `section_index < d->map.sections_nb' failed.\n";
        assert!(emulator_fault(qemu).is_some_and(|w| w.starts_with("QEMU aborted") && w.contains("iotlb_to_section")));
        // An L2 console's kernel messages are prefixed; ordinary L1 lines are not faults.
        for fine in ["CONSOLE: [    1.000000] BUG: something in L2", "[    2.5] virtio_blk virtio0: [vda] 196608 512-byte", "[vm-a] matrixMul: PASSED"] {
            assert_eq!(emulator_fault(fine), None, "{fine}");
        }
    }
}
