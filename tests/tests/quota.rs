//! Must-show 2: an allocation beyond the quota returns
//! CUDA_ERROR_OUT_OF_MEMORY, cuMemGetInfo reports the quota as total, and
//! the other tenant is unaffected.

use vgpu_tests::*;

#[test]
fn alloc_over_quota_returns_out_of_memory_and_other_tenant_is_unaffected() {
    let m = Mediator::start(&["--device-memory", "256MiB"]);
    let small = m.tenant("small", "16MiB");
    let big = m.tenant("big", "128MiB");
    // The other tenant works while the first one sits at its limit.
    let other = std::thread::spawn({
        let big = big.clone();
        move || run_ok(sample("vectorAdd", &big))
    });
    let mut c = sample("tenant_probe", &small);
    c.args(["quota", &(16u64 << 20).to_string()]);
    let out = run_ok(c);
    assert!(out.contains("over_quota=CUDA_ERROR_OUT_OF_MEMORY"), "{out}");
    assert!(out.contains(&format!("free_after=0 total={}", 16u64 << 20)), "{out}");
    assert!(other.join().expect("thread").contains("vectorAdd: PASSED"));
    let mut c = sample("tenant_probe", &big);
    c.args(["quota", &(128u64 << 20).to_string()]);
    assert!(run_ok(c).contains("over_quota=CUDA_ERROR_OUT_OF_MEMORY"));
}

#[test]
fn quotas_are_admitted_only_within_device_memory() {
    let m = Mediator::start(&["--device-memory", "64MiB"]);
    m.tenant("a", "48MiB");
    let (st, v) = m.api("POST", "/tenants", Some(serde_json::json!({"name": "b", "memory": "32MiB"})));
    assert_eq!(st, 507, "{v}");
    assert!(v["error"].as_str().unwrap_or("").contains("unreserved"), "{v}");
    m.tenant("b", "16MiB");
}

/// Memory freed right after a synchronize is back in the quota at once:
/// the tenant's next allocation of the whole quota succeeds and
/// cuMemGetInfo reports it free, round after round (a kernel's work in
/// flight ends before its completion is visible to the tenant).
#[test]
fn memory_freed_after_a_synchronize_is_free_at_once() {
    let m = Mediator::start(&["--device-memory", "64MiB"]);
    let t = m.tenant("reuse", "8MiB");
    let mut c = sample("tenant_probe", &t);
    c.args(["reuse", "400"]);
    let out = run_ok(c);
    assert!(out.contains("reuse rounds=400 stale=0 failed=0"), "{out}");
}
