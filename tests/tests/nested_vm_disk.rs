//! Nested tier: a managed VM as a provider launches it. Inside L1,
//! `vgpuctl vm create` boots Debian's stock kernel from an ext4 root disk
//! image (virtio-blk) with an interface on a bridge (virtio-net on the tap
//! the daemon makes) and a vGPU. The guest and L1 ping each other, the
//! guest runs the CUDA samples installed on its disk, and the VM is listed,
//! stopped, started, brought back after the daemon is killed and deleted.
//! One run of the `vmdisk` scenario; each test checks one promise in it.

use std::sync::OnceLock;

use serde_json::Value;
use vgpu_tests::nested;

fn output(test: &str) -> Option<&'static str> {
    static OUT: OnceLock<Option<String>> = OnceLock::new();
    if !nested::qemu_available(test) {
        return None;
    }
    OUT.get_or_init(|| Some(nested::run("vmdisk", 1200))).as_deref()
}

fn lines<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines().filter_map(|l| l.trim_end_matches('\r').strip_prefix(prefix)).collect()
}

/// Ping's summary has `N packets transmitted, N packets received`.
fn pinged(summary: &[&str]) -> bool {
    summary.iter().any(|l| l.contains("3 packets transmitted, 3 packets received"))
}

#[test]
fn a_vm_created_with_vgpuctl_boots_from_its_root_disk_and_runs_cuda_from_it() {
    let Some(out) = output("a_vm_created_with_vgpuctl_boots_from_its_root_disk_and_runs_cuda_from_it") else { return };
    assert!(out.contains("VMDISK-DONE"), "the scenario did not finish:\n{out}");
    assert_eq!(nested::value(out, "CONSOLE: L2-ROOT"), Some("/dev/vda,ext4"), "the guest's root is not its disk:\n{out}");
    let samples = lines(out, "CONSOLE: L2-SAMPLE: ");
    for s in ["vectorAdd: PASSED", "matrixMul: PASSED", "reduction: PASSED"] {
        assert!(samples.iter().any(|l| l.starts_with(s)), "{s} missing in the guest:\n{out}");
    }
    assert!(lines(out, "CONSOLE: L2-RUNTIME: ").iter().any(|l| l.contains("all passed")), "the CUDA runtime program:\n{out}");
    let smi = lines(out, "CONSOLE: L2-SMI: ").join("\n");
    assert!(smi.contains("Tenant     web") && smi.contains("64.0 MiB quota"), "vgpu-smi in the guest:\n{smi}");
}

#[test]
fn the_guest_reaches_the_host_over_its_bridged_tap_and_back() {
    let Some(out) = output("the_guest_reaches_the_host_over_its_bridged_tap_and_back") else { return };
    let bridged = nested::value(out, "TAP-IN-BRIDGE").unwrap_or("");
    assert!(bridged.trim().starts_with("vgt"), "the daemon's tap is not in the bridge: {bridged:?}\n{out}");
    assert!(pinged(&lines(out, "CONSOLE: L2-PING: ")), "the guest's ping of the host side:\n{out}");
    assert!(pinged(&lines(out, "L1-PING: ")), "the host's ping of the guest:\n{out}");
    let mac = nested::value(out, "CONSOLE: L2-MAC").unwrap_or("");
    assert!(mac.len() == 17 && !mac.starts_with("00:00:00"), "the guest's MAC: {mac:?}");
}

#[test]
fn vm_list_shows_the_vm_running_on_its_device_and_node() {
    let Some(out) = output("vm_list_shows_the_vm_running_on_its_device_and_node") else { return };
    let json = out.split("VMLIST-BEGIN").nth(1).and_then(|s| s.split("VMLIST-END").next()).expect("vm list output");
    let list: Value = serde_json::from_str(&json.replace('\r', "")).expect("vm list -o json is JSON");
    let vm = &list.as_array().expect("a list")[0];
    assert_eq!((vm["name"].as_str(), vm["state"].as_str(), vm["device"].as_str()), (Some("web"), Some("running"), Some("cpu0")), "{vm}");
    assert!(vm["numa_node"].as_i64().is_some_and(|n| n >= 0), "{vm}");
    assert_eq!(vm["spec"]["disks"][0]["path"], "/l2/root.img", "{vm}");
    assert_eq!(vm["spec"]["nets"][0]["bridge"], "br0", "{vm}");
}

#[test]
fn the_vm_stops_starts_and_comes_back_after_the_daemon_is_killed_with_its_disk_intact() {
    let Some(out) = output("the_vm_stops_starts_and_comes_back_after_the_daemon_is_killed_with_its_disk_intact") else { return };
    assert_eq!(nested::value(out, "STOPPED-STATE"), Some("stopped"), "{out}");
    assert_eq!(nested::value(out, "STARTED-STATE"), Some("running"), "{out}");
    assert_eq!(nested::value(out, "VMM-AFTER-KILL"), Some("gone"), "the VMM outlived its daemon:\n{out}");
    assert_eq!(nested::value(out, "RESTORED-STATE"), Some("running"), "{out}");
    // Each boot counts itself on the disk: the second and third boots
    // found what the ones before wrote.
    let boots: Vec<&str> = lines(out, "CONSOLE: L2-BOOTS-BEFORE=");
    assert_eq!(boots, ["0", "1", "2"], "the root disk did not keep its writes across boots:\n{}", boot_facts(out));
    // The network came up on every boot (the daemon's tap outlives a VMM).
    assert_eq!(lines(out, "CONSOLE: L2-NET-UP").len(), 3, "{}", boot_facts(out));
}

/// What a failed boot count is read from, short enough to survive a CI
/// log's truncation: the scenario's waits that gave up, the restarts and
/// the VMM's warnings, then the end of the guest's console.
fn boot_facts(out: &str) -> String {
    let keep =
        |l: &&str| ["WAIT-TIMEOUT", "VM-RESTARTS", "VMM-LOG", "STOPPED-STATE", "STARTED-STATE", "RESTORED-STATE", "CONSOLE: L2-BOOTS", "CONSOLE: L2-DISK-READY"].iter().any(|k| l.starts_with(k));
    let facts: Vec<&str> = out.lines().filter(keep).collect();
    let console: Vec<&str> = out.lines().filter(|l| l.starts_with("CONSOLE: ")).collect();
    let tail = &console[console.len().saturating_sub(40)..];
    format!("{}\n-- the console's last {} lines --\n{}", facts.join("\n"), tail.len(), tail.join("\n"))
}

/// The daemon, root in L1 with the user vgpu in its /etc/passwd, jails the
/// VMM as that user by default (no --vm-jail given).
#[test]
fn the_vmm_runs_in_the_default_jail_as_the_user_vgpu() {
    let Some(out) = output("the_vmm_runs_in_the_default_jail_as_the_user_vgpu") else { return };
    assert_eq!(nested::value(out, "VMM-JAIL-UID"), Some("999"), "the VMM did not run jailed as vgpu:\n{out}");
}

#[test]
fn deleting_the_vm_removes_its_tenant_and_tap_and_the_next_tenant_reads_zeros() {
    let Some(out) = output("deleting_the_vm_removes_its_tenant_and_tap_and_the_next_tenant_reads_zeros") else { return };
    assert_eq!(nested::value(out, "TENANTS-AFTER-DELETE"), Some("0"), "{out}");
    assert_eq!(nested::value(out, "VMS-AFTER-DELETE"), Some("0"), "{out}");
    assert_eq!(nested::value(out, "TAPS-AFTER-DELETE"), Some("0"), "{out}");
    // The guest held 16 MiB filled with 0x5A when it was deleted; the next
    // tenant's allocation of the whole device reads zeros.
    assert!(lines(out, "NEXT-TENANT: ").contains(&"clean=134217728"), "{out}");
    let scrubbed: u64 = nested::value(out, "SCRUBBED-FOR-NEXT").and_then(|v| v.parse().ok()).expect("scrub figure");
    assert!(scrubbed >= 128 << 20, "scrubbed {scrubbed} bytes for the next tenant");
}

#[test]
fn create_to_first_guest_userspace_line_is_timed() {
    let Some(out) = output("create_to_first_guest_userspace_line_is_timed") else { return };
    let t = |k: &str| nested::value(out, k).and_then(|v| v.parse::<f64>().ok()).unwrap_or_else(|| panic!("{k} missing:\n{out}"));
    let (create, first) = (t("VM-CREATE-RETURNED-S"), t("VM-FIRST-USERSPACE-S"));
    assert!(create > 0.0 && first >= create, "create returned after {create} s, first userspace line after {first} s");
    println!("nested: vgpuctl vm create returned after {create:.2} s; the guest's first userspace line after {first:.2} s");
}
