//! Must-show 3: tenant A fills memory with a pattern, frees it and exits;
//! every fresh allocation by tenant B reads back as zeros, including when B
//! gets exactly A's range. Each tenant allocates in its own address window,
//! so that is shown by capacity: A's allocation takes all of the device's
//! memory, and B's, as large, can only take the same bytes.

use vgpu_tests::*;

fn ptr_of(out: &str) -> String {
    out.lines().find_map(|l| l.strip_prefix("ptr=")).expect("ptr line").to_string()
}

#[test]
fn fresh_allocation_never_shows_another_tenants_bytes() {
    let m = Mediator::start(&["--isolation", "shared", "--device-memory", "8MiB", "--overcommit", "2"]);
    let a = m.tenant("writer", "8MiB");
    let b = m.tenant("reader", "8MiB");
    let size = (8u64 << 20).to_string();
    let mut c = sample("tenant_probe", &a);
    c.args(["fill", &size]);
    let a_ptr = ptr_of(&run_ok(c));
    let scrubbed_before = m.metric("vgpu_device_scrubbed_bytes_total", "device=\"cpu0\"").expect("metric");
    let mut c = sample("tenant_probe", &b);
    c.args(["check", &size]);
    let out = run_ok(c);
    assert_ne!(ptr_of(&out), a_ptr, "B allocates in its own address window, on the bytes A freed");
    assert!(out.contains(&format!("clean={size}")), "{out}");
    let scrubbed_after = m.metric("vgpu_device_scrubbed_bytes_total", "device=\"cpu0\"").expect("metric");
    assert!(scrubbed_after - scrubbed_before >= (8u64 << 20) as f64, "scrub was not counted");
}

#[test]
fn memory_left_allocated_at_exit_is_reclaimed_and_scrubbed() {
    let m = Mediator::start(&["--isolation", "shared", "--device-memory", "1MiB", "--overcommit", "2"]);
    let a = m.tenant("leaky", "1MiB");
    let b = m.tenant("next", "1MiB");
    // "hold" exits without freeing once stdin closes: the worker reclaims.
    let mut c = sample("tenant_probe", &a);
    c.args(["hold", "1048576"]).stdin(std::process::Stdio::null());
    let o = c.output().expect("run");
    let a_ptr = ptr_of(&String::from_utf8_lossy(&o.stdout));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while m.metric("vgpu_tenant_memory_used_bytes", "tenant=\"leaky\",device=\"cpu0\"") != Some(0.0) {
        assert!(std::time::Instant::now() < deadline, "memory of the exited client was not reclaimed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut c = sample("tenant_probe", &b);
    c.args(["check", "1048576"]);
    let out = run_ok(c);
    assert_ne!(ptr_of(&out), a_ptr, "B allocates in its own address window, on the bytes A left");
    assert!(out.contains("clean=1048576"), "{out}");
}
