//! Nested tier: a jailed vgpu-vmm (`--jail` with cgroup v2 limits) boots
//! Debian's stock kernel inside L1, whose cgroup v2 hierarchy offers the
//! memory and pids controllers. The VMM runs as uid 40123, PID 1 of its
//! own namespace, with no capabilities and every thread under seccomp, in
//! a cgroup with the limits asked for; the API shuts the guest down and
//! the supervisor cleans up the cgroup and the socket. Then, on the same
//! cgroup v2 hierarchy, tenant executors each run in a cgroup of their
//! own with the bounds the device view reports. One run of the `jail`
//! scenario; each test checks one part of its output.

use std::sync::OnceLock;

use vgpu_tests::nested;

fn output(test: &str) -> Option<&'static str> {
    static OUT: OnceLock<Option<String>> = OnceLock::new();
    if !nested::qemu_available(test) {
        return None;
    }
    OUT.get_or_init(|| Some(nested::run("jail", 900))).as_deref()
}

#[test]
fn jailed_vmm_with_cgroup_limits_boots_a_linux_guest() {
    let Some(out) = output("jailed_vmm_with_cgroup_limits_boots_a_linux_guest") else { return };
    assert!(out.contains("CGROUP2=mounted"), "L1 could not mount cgroup v2:\n{out}");
    let controllers = nested::value(out, "CGROUP-CONTROLLERS").unwrap_or_default();
    assert!(controllers.contains("memory") && controllers.contains("pids"), "{out}");
    assert!(out.contains("SAW-L2-IDLE"), "the jailed guest did not reach its idle loop:\n{out}");
    assert_eq!(nested::value(out, "JAIL-UID"), Some("40123401234012340123"), "{out}");
    assert_eq!(nested::value(out, "JAIL-NSPID"), Some("1"), "{out}");
    assert_eq!(nested::value(out, "JAIL-CAPEFF"), Some("0000000000000000"), "{out}");
    assert!(out.contains("JAIL-OWN-MNT-NS=yes") && out.contains("JAIL-OWN-NET-NS=yes"), "{out}");
    // The root holds /dev/kvm, the kernel, the initramfs and the serial file.
    assert_eq!(nested::value(out, "JAIL-ROOT").map(str::trim), Some("./dev/kvm ./l2/initrd ./l2/vmlinuz ./tmp/l2-serial.log"), "{out}");
    assert!(nested::value(out, "JAIL-CGROUP").unwrap_or_default().starts_with("/vgpu-vmm/vm-"), "{out}");
    assert_eq!(nested::value(out, "JAIL-MEMORY-MAX"), Some((512u64 << 20).to_string().as_str()), "{out}");
    assert_eq!(nested::value(out, "JAIL-PIDS-MAX"), Some("64"), "{out}");
    // The guest's RAM is charged to the jail's cgroup.
    let charged: u64 = nested::value(out, "JAIL-MEMORY-CURRENT").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(charged > 32 << 20, "memory.current {charged}:\n{out}");
    let threads: u32 = nested::value(out, "JAIL-THREADS").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(threads >= 4, "{out}");
    assert_eq!(nested::value(out, "JAIL-SECCOMP-THREADS"), Some(threads.to_string().as_str()), "a jailed thread runs without seccomp:\n{out}");
    assert!(out.contains("shutdown requested"), "{out}");
    assert!(out.contains("reboot: Restarting system"), "the guest did not restart:\n{out}");
    assert_eq!(nested::value(out, "VMM-EXIT"), Some("0"), "{out}");
    assert_eq!(nested::value(out, "CGROUPS-LEFT"), Some("0"), "{out}");
    assert!(out.contains("API-SOCKET-REMOVED"), "{out}");
    assert!(!out.contains("forbidden syscall"), "{out}");
}

#[test]
fn tenant_executors_run_in_cgroups_of_their_own_with_the_bounds_the_view_reports() {
    let Some(out) = output("tenant_executors_run_in_cgroups_of_their_own_with_the_bounds_the_view_reports") else { return };
    assert!(out.contains("JAIL-DONE"), "the scenario did not finish:\n{out}");
    assert!(out.lines().any(|l| l.starts_with("EXEC-SAMPLE: vectorAdd: PASSED")), "{out}");
    let view: serde_json::Value = serde_json::from_str(nested::value(out, "EXEC-VIEW").unwrap_or("null")).unwrap_or_else(|e| panic!("EXEC-VIEW: {e}\n{out}"));
    let view = view.as_array().unwrap_or_else(|| panic!("{out}"));
    assert_eq!(view.len(), 2, "{view:?}");
    let bound_lines: Vec<&str> = out.lines().filter_map(|l| l.trim_end_matches('\r').strip_prefix("EXEC-BOUND=")).collect();
    assert_eq!(bound_lines.len(), 2, "one line per executor process:\n{out}");
    let mut memory = std::collections::BTreeMap::new();
    for l in bound_lines {
        // PID CGROUP MEMORY.MAX PIDS.MAX SOFT/HARD-FDS
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(f.len(), 5, "{l}");
        let e = view.iter().find(|e| e["pid"].as_u64().map(|p| p.to_string()).as_deref() == Some(f[0])).unwrap_or_else(|| panic!("pid {} is not in the view {view:?}", f[0]));
        let (tenant, b) = (e["tenant"].as_str().unwrap_or_default(), &e["bounds"]);
        assert!(f[1].starts_with(&format!("/vgpu-mediatord/cpu0.{tenant}.")), "{l}");
        assert_eq!(b["cgroup"].as_str(), Some(format!("/sys/fs/cgroup{}", f[1]).as_str()), "{e}");
        assert_eq!(b["memory"].as_u64().map(|m| m.to_string()).as_deref(), Some(f[2]), "memory.max: {e}");
        assert_eq!(b["tasks"].as_u64().map(|m| m.to_string()).as_deref(), Some(f[3]), "pids.max: {e}");
        let fds = b["fds"].as_u64().unwrap_or(0);
        assert_eq!(f[4], format!("{fds}/{fds}"), "RLIMIT_NOFILE, soft and hard: {e}");
        memory.insert(tenant.to_string(), b["memory"].as_u64().unwrap_or(0));
    }
    // A CPU device's memory is host memory: tb's 64 MiB quota shows in its
    // bound, 32 MiB above ta's.
    assert_eq!(memory.get("tb").zip(memory.get("ta")).map(|(b, a)| b - a), Some(32 << 20), "{memory:?}");
    assert!(memory["ta"] >= (32 << 20) + (256 << 20), "{memory:?}");
    // tb's quota grown by 32 MiB: its running executor's bound with it, in
    // its cgroup and in the view.
    let grown = memory["tb"] + (32 << 20);
    assert_eq!(nested::value(out, "EXEC-GROWN"), Some(grown.to_string().as_str()), "memory.max after the quota grew:\n{out}");
    let view: serde_json::Value = serde_json::from_str(nested::value(out, "EXEC-GROWN-VIEW").unwrap_or("null")).unwrap_or_else(|e| panic!("EXEC-GROWN-VIEW: {e}\n{out}"));
    let tb = view.as_array().and_then(|v| v.iter().find(|e| e["tenant"] == "tb")).unwrap_or_else(|| panic!("{view}"));
    assert_eq!(tb["bounds"]["memory"].as_u64(), Some(grown), "{tb}");
    let left = nested::value(out, "EXEC-CGROUPS-LEFT").unwrap_or_default();
    assert!(!left.contains("cpu0.ta.") && left.contains("cpu0.tb."), "the deleted tenant's cgroup goes with its executor: {left:?}");
}
