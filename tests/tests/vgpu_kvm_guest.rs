//! KVM tier for the virtio-gpu compute device: the bare-metal test guest,
//! under vgpu-vmm on this machine's /dev/kvm, finds the device on PCI,
//! probes the capset, creates a compute context and GUEST blobs, and runs
//! vectorAdd through SUBMIT_3D on the mediator's CPU device over
//! vhost-user. Also: malformed commands from the guest, a host tenant on
//! the same device meanwhile, the backend dying under a running VM (the
//! VMM reconnects to the one the daemon starts again), a device reset
//! (the backend forgets the guest's contexts, resources and memory), and
//! the same guest on the `cuda` backend (a GPU, or the test double of
//! NVIDIA's driver), its vhost-user backend in its tenant's executor.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use vgpu_tests::vmm_harness::*;
use vgpu_tests::*;

fn vm_tenant(m: &Mediator, name: &str, memory: &str) -> PathBuf {
    let (code, v) = m.api("POST", "/tenants", Some(json!({ "name": name, "memory": memory, "kind": "vm" })));
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["kind"], "vm");
    PathBuf::from(v["socket"].as_str().expect("socket"))
}

/// Waits for a VM tenant's device memory on cpu0 to be freed (its VM is
/// gone, and its contexts and memory with its connection).
fn memory_freed(m: &Mediator, tenant: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while m.metric("vgpu_tenant_memory_used_bytes", &format!("tenant=\"{tenant}\",device=\"cpu0\"")) != Some(0.0) {
        assert!(std::time::Instant::now() < deadline, "VM tenant {tenant}'s memory not freed after the VM exited");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn vgpu_arg(sock: &std::path::Path) -> String {
    format!("socket={}", sock.display())
}

#[test]
fn guest_runs_vector_add_through_the_virtio_gpu_compute_context() {
    if !kvm_available("guest_runs_vector_add_through_the_virtio_gpu_compute_context") {
        return;
    }
    let m = Mediator::start(&[]);
    let sock = vm_tenant(&m, "vm1", "64MiB");
    let arg = vgpu_arg(&sock);
    let g = Guest::start("vgpu", &["--vgpu", &arg]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(120));
    assert_eq!(st.code(), Some(0), "{err}\n{out}");
    assert!(out.contains("virtio-gpu at slot"), "{out}");
    assert!(out.contains("capset id 24"), "{out}");
    // 3 × 1023 = 3069.0f = 0x453fd000, checked bit-exactly by the guest.
    assert!(out.contains("VGPU vectorAdd PASSED n=1024 c[1023]=453fd000"), "{out}");
    assert_eq!(m.metric("vgpu_tenant_kernels_total", "tenant=\"vm1\",device=\"cpu0\""), Some(1.0));
    // The VM is gone: its contexts and memory went with its connection.
    memory_freed(&m, "vm1");
    // The same tenant serves the next VM.
    let g = Guest::start("vgpu", &["--vgpu", &arg]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(120));
    assert_eq!(st.code(), Some(0), "{err}\n{out}");
    assert!(out.contains("TEST PASSED vgpu"), "{out}");
}

#[test]
fn a_device_reset_frees_what_the_guest_had_and_its_ids() {
    if !kvm_available("a_device_reset_frees_what_the_guest_had_and_its_ids") {
        return;
    }
    let m = Mediator::start(&[]);
    let sock = vm_tenant(&m, "vm1", "64MiB");
    // Three rounds, each after a device reset, each reusing the context
    // and resource ids of the one before and leaving 40 MiB allocated:
    // the second fails unless the reset gave back the first's contexts,
    // resources and memory.
    let g = Guest::start("vgpu-reset", &["--vgpu", &vgpu_arg(&sock)]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(180));
    assert_eq!(st.code(), Some(0), "{err}\n{out}");
    for round in 1..=3 {
        assert!(out.contains(&format!("reset round {round} PASSED")), "round {round}:\n{out}");
    }
    assert!(out.contains("TEST PASSED vgpu-reset"), "{out}");
    assert!(!err.contains("RESET_DEVICE"), "{err}");
    assert_eq!(m.device("cpu0")["worker_restarts"], 0, "the worker must not have crashed");
    memory_freed(&m, "vm1");
}

#[test]
fn hostile_guest_commands_get_errors_while_a_host_tenant_runs_on_the_device() {
    if !kvm_available("hostile_guest_commands_get_errors_while_a_host_tenant_runs_on_the_device") {
        return;
    }
    let m = Mediator::start(&[]);
    let sock = vm_tenant(&m, "evil", "32MiB");
    let host = m.tenant("host", "64MiB");
    let victim = std::thread::spawn(move || {
        for _ in 0..2 {
            assert!(run_ok(sample("reduction", &host)).contains("PASSED"));
        }
    });
    let arg = vgpu_arg(&sock);
    let g = Guest::start("vgpu-hostile", &["--vgpu", &arg]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(120));
    assert_eq!(st.code(), Some(0), "{err}\n{out}");
    for (what, code) in [
        ("unknown command type", "1200"),
        ("truncated header", "1200"),
        ("submit larger than its descriptor", "1200"),
        ("absurd blob entry count", "1200"),
        ("blob outside guest RAM", "1205"),
        ("absurd blob length", "1205"),
        ("foreign capset in CTX_CREATE", "1205"),
        ("ring_idx 64", "1205"),
    ] {
        assert!(out.contains(&format!("{what}: {code}")), "{what} should get {code}:\n{out}");
    }
    assert!(out.contains("VGPU vectorAdd PASSED"), "the device kept serving the guest:\n{out}");
    victim.join().expect("the host tenant kept working");
    assert_eq!(m.device("cpu0")["worker_restarts"], 0, "the worker must not have crashed");
}

#[test]
fn a_vm_reconnects_to_its_restarted_backend_and_computes_again() {
    if !kvm_available("a_vm_reconnects_to_its_restarted_backend_and_computes_again") {
        return;
    }
    let m = Mediator::start(&[]);
    let sock = vm_tenant(&m, "vm1", "64MiB");
    let g = Guest::start("vgpu-again", &["--vgpu", &vgpu_arg(&sock)]);
    let pid = m.worker_pid("cpu0");
    let (_, out) = g.outlives_its_backend(|| {
        // SAFETY: sends SIGKILL to the mediator's device worker, a child of
        // the mediator this test started.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    });
    assert!(!out.contains("NEEDS RESET"), "{out}");
    assert_ne!(m.worker_pid("cpu0"), pid, "the worker was not started again");
}

#[test]
fn a_backend_that_does_not_come_back_is_a_device_error_and_the_vm_keeps_running() {
    if !kvm_available("a_backend_that_does_not_come_back_is_a_device_error_and_the_vm_keeps_running") {
        return;
    }
    let m = Mediator::start(&[]);
    let sock = vm_tenant(&m, "vm1", "64MiB");
    let arg = format!("{},reconnect=2", vgpu_arg(&sock));
    let mut g = Guest::start("vgpu-watch", &["--vgpu", &arg]);
    g.wait_for("tick 2", Duration::from_secs(120));
    // The whole daemon goes, and nothing serves the socket again.
    let t0 = std::time::Instant::now();
    drop(m);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert!(err.contains("backend hung up") && err.contains("did not come back within 2 s"), "{err}");
    assert!(out.contains("DEVICE NEEDS RESET seen; the guest is still running"), "{out}");
    assert!(t0.elapsed() >= Duration::from_secs(2), "the device error came before the reconnection window ended");
    assert_eq!(st.code(), Some(0), "{err}");
}

#[test]
fn a_guest_on_the_cuda_backend_is_served_by_its_tenants_executor_alone() {
    let test = "a_guest_on_the_cuda_backend_is_served_by_its_tenants_executor_alone";
    if !kvm_available(test) {
        return;
    }
    let Some((m, gpu)) = gpu_mediator(test, &[]) else { return };
    let (code, v) = m.api("POST", "/tenants", Some(json!({ "name": "vm1", "memory": "64MiB", "kind": "vm", "device": gpu })));
    assert_eq!(code, 201, "{v}");
    let arg = vgpu_arg(&PathBuf::from(v["socket"].as_str().expect("socket")));
    let mut g = Guest::start("vgpu-again", &["--vgpu", &arg]);
    g.wait_for("round 1 PASSED", Duration::from_secs(120));
    // vectorAdd ran on the GPU (or the double).
    let (exec, arbiter) = (m.serving_pid(&gpu, "vm1"), m.worker_pid(&gpu));
    assert!(exec != arbiter && exec != m.pid(), "executor {exec}, arbiter {arbiter}");
    // The guest's RAM is mapped by the tenant's executor (its vhost-user
    // backend) and by no other process of the daemon's.
    let ram = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps").lines().filter(|l| l.contains("vgpu-guest-ram")).count();
    assert!(ram(exec) > 0, "the executor does not map the guest's RAM");
    assert_eq!((ram(arbiter), ram(m.pid())), (0, 0), "the arbiter or the daemon maps the guest's RAM");
    let st = proc_stats(exec);
    assert_eq!((st.seccomp, st.no_new_privs), (2, 1), "the executor's confinement");
    // Its executor's end is neither the VM's end nor its device's: the VMM
    // reconnects to the executor the daemon starts again.
    let (_, out) = g.outlives_its_backend(|| {
        // SAFETY: SIGKILL to a process of the daemon this test started.
        assert_eq!(unsafe { libc::kill(exec as i32, libc::SIGKILL) }, 0);
    });
    assert!(out.contains("VGPU vectorAdd PASSED n=1024 c[1023]=453fd000"), "{out}");
    assert!(!out.contains("NEEDS RESET"), "{out}");
    assert_ne!(m.serving_pid(&gpu, "vm1"), exec, "the executor was not started again");
}
