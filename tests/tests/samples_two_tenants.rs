//! Must-show 1: unmodified Driver API programs (vectorAdd, tiled matrixMul
//! 256x256, reduction) run correctly through libcuda.so.1 for two tenants
//! at once, and the metrics show both tenants' work.

use vgpu_tests::*;

#[test]
fn samples_run_concurrently_for_two_tenants_with_different_quotas() {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let a = m.tenant("alpha", "256MiB");
    let b = m.tenant("beta", "64MiB");
    checks::samples_concurrently(&[&a, &b], "100000", "256");
    for t in ["alpha", "beta"] {
        let labels = format!("tenant=\"{t}\",device=\"cpu0\"");
        // A sample's last launch may still run after its process exits.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut kernels = 0.0;
        while kernels < 4.0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
            kernels = m.metric("vgpu_tenant_kernels_total", &labels).expect("kernels metric");
        }
        assert!(kernels >= 4.0, "{t} ran {kernels} kernels");
        assert!(m.metric("vgpu_tenant_device_seconds_total", &labels).expect("device seconds") > 0.0);
        assert!(m.metric("vgpu_tenant_scrubbed_bytes_total", &labels).expect("scrubbed") > 0.0);
    }
    assert_eq!(m.metric("vgpu_tenant_memory_quota_bytes", "tenant=\"beta\",device=\"cpu0\""), Some((64u64 << 20) as f64));
    assert!(m.metric("vgpu_device_utilization", "device=\"cpu0\"").expect("utilization") > 0.0);
}

#[test]
fn vgpu_smi_shows_quota_and_usage() {
    let m = Mediator::start(&[]);
    let a = m.tenant("smi", "96MiB");
    run_ok(sample("vectorAdd", &a));
    let mut c = std::process::Command::new(bin("vgpu-smi"));
    c.env("VGPU_SOCKET", &a);
    let out = run_ok(c);
    assert!(out.contains("Tenant     smi"), "{out}");
    assert!(out.contains("96.0 MiB quota"), "{out}");
    assert!(out.contains("Kernels    1 "), "{out}");
    let mut c = std::process::Command::new(bin("vgpu-smi"));
    c.args(["-o", "json", "--socket"]).arg(&a);
    let v: serde_json::Value = serde_json::from_str(&run_ok(c)).expect("json");
    assert_eq!(v["tenant"]["quota"], 96u64 << 20);
    assert_eq!(v["tenant"]["kernels"], 1);
}
