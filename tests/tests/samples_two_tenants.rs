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

    // nvidia-smi's forms, with the UUID the metrics carry.
    let metrics = m.metrics();
    let uuid =
        metrics.lines().find_map(|l| l.strip_prefix("vgpu_device_busy_seconds_total{device=\"cpu0\",uuid=\"")).and_then(|r| r.split('"').next()).expect("the device's uuid in the metrics").to_string();
    let smi = |args: &[&str]| {
        let mut c = std::process::Command::new(bin("vgpu-smi"));
        c.args(args).arg("--socket").arg(&a);
        c.output().expect("vgpu-smi")
    };
    let text = |o: &std::process::Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let o = smi(&["-L"]);
    assert!(o.status.success() && text(&o).starts_with("GPU 0: ") && text(&o).trim_end().ends_with(&format!("(UUID: {uuid})")), "{}", text(&o));
    let o = smi(&["--query-gpu=name,uuid,memory.total,memory.used,utilization.gpu", "--format=csv,noheader,nounits"]);
    let out = text(&o);
    let vals: Vec<&str> = out.trim().split(", ").collect();
    assert!(o.status.success() && vals.len() == 5, "{out}");
    assert_eq!((vals[1], vals[2]), (uuid.as_str(), "96"), "{out}");
    assert!(vals[3].parse::<u64>().is_ok() && vals[4].parse::<u64>().is_ok_and(|u| u <= 100), "{out}");
    let o = smi(&["--query-gpu=memory.total,utilization.gpu", "--format=csv"]);
    let out = text(&o);
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("memory.total [MiB], utilization.gpu [%]"), "{out}");
    assert!(lines.next().is_some_and(|l| l.starts_with("96 MiB, ") && l.ends_with(" %")), "{out}");
    let o = smi(&["-q"]);
    assert!(o.status.success() && text(&o).contains(&format!("GPU UUID                      : {uuid}")) && text(&o).contains("Total                     : 96 MiB"), "{}", text(&o));
    let o = smi(&["--version"]);
    assert!(o.status.success() && text(&o).starts_with("vgpu-smi "), "{}", text(&o));
    // The settings CUDA software needs on this device, for a profile: on
    // the CPU device, CuPy's PTX setting (what the daemon hands host
    // tenants; a VM's guest asks its device this way).
    let o = smi(&["--env"]);
    assert!(o.status.success() && o.stdout == b"export CUPY_COMPILE_WITH_PTX=1\n", "{}", text(&o));
    assert_eq!(v["device"]["interprets_ptx"], true, "{v}");
    assert_eq!(v["env"], serde_json::json!({ "CUPY_COMPILE_WITH_PTX": "1" }), "{v}");
    // What it cannot answer is refused as a usage error, never a table.
    for bad in [&["-o", "xml"][..], &["--query-gpu=temperature.gpu", "--format=csv"], &["--query-gpu=name"], &["--query-gpu=name", "--format=xml"], &["-i", "1"], &["--env", "-L"]] {
        let o = smi(bad);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", text(&o));
        assert!(o.stdout.is_empty(), "{bad:?}: {}", text(&o));
    }
}
