//! Nested tier: a jailed vgpu-vmm (`--jail` with cgroup v2 limits) boots
//! Debian's stock kernel inside L1, whose cgroup v2 hierarchy offers the
//! memory and pids controllers. The VMM runs as uid 40123, PID 1 of its
//! own namespace, with no capabilities and every thread under seccomp, in
//! a cgroup with the limits asked for; the API shuts the guest down and
//! the supervisor cleans up the cgroup and the socket.

use vgpu_tests::nested;

#[test]
fn jailed_vmm_with_cgroup_limits_boots_a_linux_guest() {
    if !nested::qemu_available("jailed_vmm_with_cgroup_limits_boots_a_linux_guest") {
        return;
    }
    let out = nested::run("jail", 900);
    assert!(out.contains("CGROUP2=mounted"), "L1 could not mount cgroup v2:\n{out}");
    let controllers = nested::value(&out, "CGROUP-CONTROLLERS").unwrap_or_default();
    assert!(controllers.contains("memory") && controllers.contains("pids"), "{out}");
    assert!(out.contains("SAW-L2-IDLE"), "the jailed guest did not reach its idle loop:\n{out}");
    assert_eq!(nested::value(&out, "JAIL-UID"), Some("40123401234012340123"), "{out}");
    assert_eq!(nested::value(&out, "JAIL-NSPID"), Some("1"), "{out}");
    assert_eq!(nested::value(&out, "JAIL-CAPEFF"), Some("0000000000000000"), "{out}");
    assert!(out.contains("JAIL-OWN-MNT-NS=yes") && out.contains("JAIL-OWN-NET-NS=yes"), "{out}");
    // The root holds /dev/kvm, the kernel, the initramfs and the serial file.
    assert_eq!(nested::value(&out, "JAIL-ROOT").map(str::trim), Some("./dev/kvm ./l2/initrd ./l2/vmlinuz ./tmp/l2-serial.log"), "{out}");
    assert!(nested::value(&out, "JAIL-CGROUP").unwrap_or_default().starts_with("/vgpu-vmm/vm-"), "{out}");
    assert_eq!(nested::value(&out, "JAIL-MEMORY-MAX"), Some((512u64 << 20).to_string().as_str()), "{out}");
    assert_eq!(nested::value(&out, "JAIL-PIDS-MAX"), Some("64"), "{out}");
    // The guest's RAM is charged to the jail's cgroup.
    let charged: u64 = nested::value(&out, "JAIL-MEMORY-CURRENT").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(charged > 32 << 20, "memory.current {charged}:\n{out}");
    let threads: u32 = nested::value(&out, "JAIL-THREADS").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(threads >= 4, "{out}");
    assert_eq!(nested::value(&out, "JAIL-SECCOMP-THREADS"), Some(threads.to_string().as_str()), "a jailed thread runs without seccomp:\n{out}");
    assert!(out.contains("shutdown requested"), "{out}");
    assert!(out.contains("reboot: Restarting system"), "the guest did not restart:\n{out}");
    assert_eq!(nested::value(&out, "VMM-EXIT"), Some("0"), "{out}");
    assert_eq!(nested::value(&out, "CGROUPS-LEFT"), Some("0"), "{out}");
    assert!(out.contains("API-SOCKET-REMOVED"), "{out}");
    assert!(!out.contains("forbidden syscall"), "{out}");
}
