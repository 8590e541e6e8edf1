//! Nested tier: the VM API with a stock Linux guest, driven by vgpuctl
//! inside L1. Pause and resume work, and shutdown (Ctrl-Alt-Del on our
//! i8042, in the scancode set the guest's translating controller expects)
//! makes the idle guest restart itself; the VMM exits 0.

use vgpu_tests::nested;

#[test]
fn vgpuctl_pauses_resumes_and_shuts_down_a_linux_guest() {
    if !nested::qemu_available("vgpuctl_pauses_resumes_and_shuts_down_a_linux_guest") {
        return;
    }
    let out = nested::run("shutdown", 900);
    assert!(out.contains("L2-IDLE"), "L2 did not reach its idle loop:\n{out}");
    assert!(out.contains("state:     running"), "vgpuctl vmm info:\n{out}");
    assert!(out.contains("vcpus:     2"), "{out}");
    assert_eq!(nested::value(&out, "PAUSED-STATE"), Some("paused"), "{out}");
    // The API calls start only once the guest sits idle; nothing in it
    // reboots, so its restart comes from the Ctrl-Alt-Del it was sent.
    assert!(out.contains("SAW-L2-IDLE-BEFORE-API-CALLS"), "{out}");
    assert!(out.contains("shutdown requested"), "{out}");
    assert!(out.contains("reboot: Restarting system"), "the guest did not restart:\n{out}");
    assert_eq!(nested::value(&out, "VMM-EXIT"), Some("0"), "{out}");
}
