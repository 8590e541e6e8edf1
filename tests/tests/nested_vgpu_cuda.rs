//! Nested tier for the virtio-gpu compute device: a stock Debian kernel
//! under vgpu-vmm, with no module other than Debian's virtio-gpu, runs the
//! repo's CUDA samples through libcuda.so.1 and /dev/dri on the mediator's
//! CPU device, while a host-socket tenant runs on the same device. One run
//! of the `cuda` scenario; each test checks one promise in its output.

use std::sync::OnceLock;

use vgpu_tests::nested;

fn output(test: &str) -> Option<&'static str> {
    static OUT: OnceLock<Option<String>> = OnceLock::new();
    if !nested::qemu_available(test) {
        return None;
    }
    OUT.get_or_init(|| Some(nested::run("cuda", 900))).as_deref()
}

fn lines<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines().filter_map(|l| l.trim_end_matches('\r').strip_prefix(prefix)).collect()
}

#[test]
fn guest_runs_the_cuda_samples_through_dev_dri() {
    let Some(out) = output("guest_runs_the_cuda_samples_through_dev_dri") else { return };
    assert!(out.contains("L2-CUDA-DONE"), "the guest did not finish:\n{out}");
    let samples = lines(out, "L2-SAMPLE: ");
    for s in ["vectorAdd: PASSED", "matrixMul: PASSED", "reduction: PASSED"] {
        assert!(samples.iter().any(|l| l.starts_with(s)), "{s} missing in the guest:\n{}", samples.join("\n"));
    }
    let smi = lines(out, "L2-SMI: ").join("\n");
    assert!(smi.contains("Tenant     vm1") && smi.contains("32.0 MiB quota"), "vgpu-smi in the guest:\n{smi}");
    // The guest learns from its device the settings its CUDA software
    // needs there (for a profile: eval "$(vgpu-smi --env)").
    assert_eq!(lines(out, "L2-ENV: "), ["export CUPY_COMPILE_WITH_PTX=1"], "vgpu-smi --env in the guest:\n{out}");
    assert_eq!(nested::value(out, "VMM-EXIT"), Some("0"), "{out}");
}

#[test]
fn host_tenant_shares_the_device_and_metrics_show_both() {
    let Some(out) = output("host_tenant_shares_the_device_and_metrics_show_both") else { return };
    let host = lines(out, "HOST-SAMPLE: ");
    assert!(host.iter().any(|l| l.starts_with("vectorAdd: PASSED")) && host.iter().any(|l| l.starts_with("reduction: PASSED")), "{out}");
    let metrics = lines(out, "METRIC: ").join("\n");
    let metric = |tenant: &str| vgpu_tests::metric_in(&metrics, "vgpu_tenant_kernels_total", &format!("tenant=\"{tenant}\",device=\"cpu0\"")).unwrap_or(0.0);
    assert!(metric("vm1") >= 3.0, "VM tenant kernels:\n{out}");
    assert!(metric("host1") >= 2.0, "host tenant kernels:\n{out}");
}

#[test]
fn vm_tenant_quota_and_scrub_hold_in_the_guest() {
    let Some(out) = output("vm_tenant_quota_and_scrub_hold_in_the_guest") else { return };
    let quota = lines(out, "L2-QUOTA: ");
    assert!(quota.contains(&"over_quota=CUDA_ERROR_OUT_OF_MEMORY"), "{quota:?}");
    assert!(quota.contains(&"free_after=0 total=33554432"), "cuMemGetInfo reports the quota: {quota:?}");
    // The host tenant filled 16 MiB with 0xA5 and freed it; the guest's
    // fresh allocation of the same size reads back as zeros. Each tenant
    // has its own address window now, so the addresses differ even where
    // the bytes are the same; tests/tests/scrub.rs forces the reuse with a
    // device of exactly the allocation's size.
    let filled = lines(out, "HOST-FILL: ");
    let scrub = lines(out, "L2-SCRUB: ");
    assert!(filled.iter().any(|l| l.starts_with("ptr=")), "the host tenant filled its memory: {filled:?}");
    assert!(scrub.contains(&"clean=16777216"), "{scrub:?}");
}

#[test]
fn a_guest_launches_ten_thousand_kernels_with_under_a_hundred_execbuffers() {
    let Some(out) = output("a_guest_launches_ten_thousand_kernels_with_under_a_hundred_execbuffers") else { return };
    let storm = lines(out, "L2-STORM: ").join("\n");
    eprintln!("guest launch storm: {storm}");
    let field = |k: &str| storm.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}="))).and_then(|v| v.parse::<u64>().ok());
    assert_eq!(field("launches"), Some(10_000), "{storm}");
    assert_eq!(field("counter"), Some(10_000), "every launch ran, in order, exactly once: {storm}");
    // Messages are SUBMIT_3D commands as the device counted them, one per
    // guest EXECBUFFER ioctl, from before the first launch to after the sync.
    let submits = field("messages").unwrap_or(u64::MAX);
    assert!(submits < 100, "{submits} EXECBUFFERs for 10 000 launches: {storm}");
    assert!(field("ring_entries").unwrap_or(0) >= 10_000, "the launches went through the ring: {storm}");
}

#[test]
fn capset_probe_succeeds_and_a_foreign_context_type_is_refused() {
    let Some(out) = output("capset_probe_succeeds_and_a_foreign_context_type_is_refused") else { return };
    let dmesg = lines(out, "L2-DMESG: ").join("\n");
    assert!(dmesg.contains("features: +context_init"), "{dmesg}");
    assert!(dmesg.contains("number of cap sets: 1") && dmesg.contains("cap set 0: id 24"), "{dmesg}");
    assert!(!dmesg.contains("timed out") && !dmesg.contains("ERROR"), "the probe must be clean:\n{dmesg}");
    let probe = lines(out, "L2-PROBE: ");
    assert!(probe.contains(&"capsets=0x1000000"), "{probe:?}");
    assert!(probe.contains(&"context_init capset=24: ok"), "{probe:?}");
    assert!(probe.contains(&"context_init capset=4: EINVAL"), "{probe:?}");
    assert!(lines(out, "L2-FOREIGN: ").iter().any(|l| l.contains("CUDA_ERROR_NO_DEVICE")), "the shim refuses a foreign capset cleanly");
}

#[test]
fn a_cuda_runtime_program_runs_in_the_guest() {
    let Some(out) = output("cuda") else { return };
    let rt = lines(out, "L2-RUNTIME: ").join("\n");
    assert!(rt.contains("runtime probe: all passed"), "the CUDA runtime program in the guest:\n{rt}");
    for check in ["ok axpy through cudaLaunchKernel", "ok shared-memory block sums on a stream", "ok memory info is the quota", "ok allocation past the quota fails"] {
        assert!(rt.contains(check), "missing '{check}':\n{rt}");
    }
    assert!(rt.contains("quota: total 33554432 bytes"), "the guest sees its vGPU's quota:\n{rt}");
}

#[test]
fn a_guest_outlives_its_backend_and_only_its_old_contexts_fail() {
    let Some(out) = output("a_guest_outlives_its_backend_and_only_its_old_contexts_fail") else { return };
    assert!(out.contains("KILLED-WORKER="), "the scenario did not kill the device's worker:\n{out}");
    // The context made before the backend ended fails instead of waiting
    // for ever; a new one, and the next program, work.
    let relive = lines(out, "L2-RELIVE: ").join("\n");
    assert!(relive.contains("old=CUDA_ERROR_"), "the old context must fail:\n{relive}");
    assert!(relive.contains("made=CUDA_SUCCESS fresh=CUDA_SUCCESS value=0x3c"), "a new context must work:\n{relive}");
    let after = lines(out, "L2-AFTER: ").join("\n");
    assert!(after.contains("PASSED"), "the next program after the backend came back:\n{after}");
    let link = lines(out, "VMM-LINK: ").join("\n");
    assert!(link.contains("hung up") && link.contains("reconnected to the vGPU backend"), "{link}");
    assert!(!out.contains("NEEDS RESET") && !link.contains("device error"), "{link}");
}
