//! Nested tier: passthrough from a pool through the lifecycle CLI
//! (images/nested/scenarios/vfio-pool.sh under run-vfio.sh's emulated
//! Intel IOMMU). The NVMe device starts on L1's nvme driver as passthrough
//! device `nvme0` of pool `whole`; `vgpuctl vm create --passthrough whole`
//! lends it to a stock Debian L2 that reads the test's marker and writes
//! its own; a second VM is refused; `vgpuctl vm delete` returns it (reset,
//! back on nvme, scrub record), and L1 reads the guest's marker through its
//! own driver. One run; each test checks one promise.

use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;
use vgpu_tests::{nested, workspace};

const HOST_MARKER: &str = "MARKER-FROM-HOST-VFIO-TEST";
const GUEST_MARKER: &str = "MARKER-FROM-GUEST-L2-NVME";

fn output(test: &str) -> Option<&'static String> {
    static OUT: OnceLock<String> = OnceLock::new();
    if !nested::qemu_available(test) {
        return None;
    }
    Some(OUT.get_or_init(|| {
        nested::build();
        let img = std::env::temp_dir().join(format!("vgpu-nested-vfio-pool-{}.img", std::process::id()));
        // An attempt the emulator broke is run once more, from a fresh image.
        let console = nested::retrying_emulator_faults("vfio-pool", || {
            let mut bytes = vec![0u8; 16 << 20];
            bytes[..HOST_MARKER.len()].copy_from_slice(HOST_MARKER.as_bytes());
            std::fs::write(&img, &bytes).expect("write the NVMe image");
            let mut cmd = Command::new("bash");
            cmd.arg(workspace().join("images/nested/run-vfio.sh")).arg("vfio-pool").arg(&img).arg("900");
            let (o, console) = nested::run_qemu("vfio-pool", &mut cmd);
            (o.status.success(), console)
        });
        let _ = std::fs::remove_file(&img);
        assert!(console.contains("VFIO-POOL-DONE"), "the scenario did not finish:\n{console}");
        console
    }))
}

/// The JSON the scenario printed between `BEGIN` and `END` markers.
fn json_between(out: &str, begin: &str, end: &str) -> Value {
    let body: String = out.lines().map(|l| l.trim_end_matches('\r')).skip_while(|l| *l != begin).skip(1).take_while(|l| *l != end).collect::<Vec<_>>().join("\n");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("no JSON between {begin} and {end} ({e}):\n{out}"))
}

#[test]
fn a_vm_created_from_a_passthrough_pool_gets_the_device() {
    let Some(out) = output("a_vm_created_from_a_passthrough_pool_gets_the_device") else { return };
    let nvme = nested::value(out, "NVME-ADDR").expect("the NVMe device's address");
    assert_eq!(nested::value(out, "NVME-DRIVER-BEFORE"), Some("nvme"), "L1's nvme driver did not take the device:\n{out}");
    assert_eq!(nested::value(out, "L1-READ-BEFORE"), Some(HOST_MARKER), "{out}");
    assert_eq!(nested::value(out, "CREATE-EXIT"), Some("0"), "{out}");
    assert_eq!(nested::value(out, "NVME-DRIVER-LENT"), Some("vfio-pci"), "{out}");
    assert_eq!(nested::value(out, "LENT-STATE"), Some("lent"), "{out}");
    let vm = json_between(out, "VMSHOW-BEGIN", "VMSHOW-END");
    assert_eq!(vm["passthrough"][0]["device"], "nvme0", "{vm}");
    assert_eq!(vm["passthrough"][0]["address"], nvme, "{vm}");
    assert!(vm["spec"].get("vgpu").is_none(), "a passthrough-only VM has no vGPU: {vm}");
    // The guest's stock nvme driver used it.
    assert_eq!(nested::value(out, "CONSOLE: L2-NVME-READ"), Some(HOST_MARKER), "{out}");
    assert_eq!(nested::value(out, "CONSOLE: L2-NVME-READBACK"), Some(GUEST_MARKER), "{out}");
}

#[test]
fn a_device_already_lent_is_refused_to_the_next_vm() {
    let Some(out) = output("a_device_already_lent_is_refused_to_the_next_vm") else { return };
    assert_eq!(nested::value(out, "SECOND-EXIT"), Some("1"), "{out}");
    let err: String = out.lines().filter_map(|l| l.trim_end_matches('\r').strip_prefix("SECOND-ERR: ")).collect();
    assert!(err.contains("no free passthrough device in pool whole (nvme0 is lent)") && err.contains("HTTP 409"), "{err}");
    assert_eq!(nested::value(out, "VMS-AFTER-SECOND"), Some("1"), "the refused VM was left behind:\n{out}");
}

#[test]
fn on_delete_the_device_returns_to_its_driver_and_the_pool_with_a_scrub_record() {
    let Some(out) = output("on_delete_the_device_returns_to_its_driver_and_the_pool_with_a_scrub_record") else { return };
    let nvme = nested::value(out, "NVME-ADDR").expect("the NVMe device's address");
    assert_eq!(nested::value(out, "DELETE-EXIT"), Some("0"), "{out}");
    assert_eq!(nested::value(out, "NVME-DRIVER-AFTER"), Some("nvme"), "the device did not go back to L1's driver:\n{out}");
    assert_eq!(nested::value(out, "NVME-OVERRIDE-AFTER"), Some("(null)"), "driver_override was left set:\n{out}");
    let dev = json_between(out, "DEVSHOW-BEGIN", "DEVSHOW-END");
    assert_eq!((dev["state"].as_str(), dev["kind"].as_str(), dev["pool"].as_str()), (Some("free"), Some("passthrough"), Some("whole")), "{dev}");
    let rec = &dev["scrubs"][0];
    assert_eq!((rec["device"].as_str(), rec["address"].as_str(), rec["previous_vm"].as_str()), (Some("nvme0"), Some(nvme), Some("pt1")), "{rec}");
    assert_eq!((rec["method"].as_str(), rec["ok"].as_bool()), (Some("function-reset"), Some(true)), "{rec}");
    assert!(rec["started"].as_u64().is_some_and(|s| s > 0), "{rec}");
    assert!(out.contains("0 failed") && out.contains("ok (function-reset)"), "vgpuctl device show lacks the record:\n{out}");
    let metric = |name: &str| out.lines().find_map(|l| l.trim_end_matches('\r').strip_prefix("METRIC: ").filter(|m| m.starts_with(name)).map(str::to_string));
    assert!(metric("vgpu_passthrough_scrubs_total{device=\"nvme0\"").is_some_and(|m| m.contains("result=\"ok\"} 1")), "{out}");
    // The host's own driver reads what the guest wrote.
    assert_eq!(nested::value(out, "L1-READ-GUEST"), Some(GUEST_MARKER), "{out}");
    let secs: f64 = nested::value(out, "DELETE-SECONDS").and_then(|v| v.parse().ok()).unwrap_or(-1.0);
    println!("nested: deleting the passthrough VM until its device was free again (reset, rebind, scrub) took {secs:.2} s");
}

#[test]
fn a_jailed_vmm_of_the_daemon_gets_the_device_too() {
    let Some(out) = output("a_jailed_vmm_of_the_daemon_gets_the_device_too") else { return };
    assert_eq!(nested::value(out, "JAILED-CREATE-EXIT"), Some("0"), "{out}");
    assert_eq!(nested::value(out, "JAILED-VMM-UID"), Some("1000"), "the VMM is not the jail's uid:\n{out}");
    // Its cgroup: 256 MiB of guest RAM and 256 MiB for the VMM; 1 vCPU + 32.
    assert_eq!(nested::value(out, "JAILED-MEMORY-MAX"), Some("536870912"), "{out}");
    assert_eq!(nested::value(out, "JAILED-PIDS-MAX"), Some("33"), "{out}");
    assert_eq!(nested::value(out, "JAILED-CONSOLE: L2-NVME-READ"), Some(HOST_MARKER), "{out}");
    assert_eq!(nested::value(out, "JAILED-CONSOLE: L2-NVME-READBACK"), Some(GUEST_MARKER), "{out}");
    assert_eq!(nested::value(out, "JAILED-AFTER-STATE"), Some("free"), "{out}");
    assert_eq!(nested::value(out, "JAILED-AFTER-DRIVER"), Some("nvme"), "{out}");
}
