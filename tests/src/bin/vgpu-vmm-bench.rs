//! VMM figures, printed from one run: time from process start to the first
//! guest entry (as the VMM logs it), wall time of a whole test-guest run,
//! the VMM's resident memory excluding guest RAM, and (when QEMU is
//! installed) the nested tier's time from VMM start to a stock Linux
//! guest's userspace marker. Usage:
//! `vgpu-vmm-bench [RUNS]` after `cargo build --release --workspace`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::vmm_harness::{test_guest, Guest};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    vmm::config::meminfo_field(&s, field).unwrap_or(0)
}

fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20);
    let vmm = vgpu_tests::bin("vgpu-vmm");
    let guest = test_guest();
    let mut entry_ms = Vec::new();
    let mut total_ms = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let o = Command::new(&vmm)
            .arg("--kernel")
            .arg(guest)
            .args(["--memory", "16", "--cmdline", "test=rng", "--serial", "/dev/null"])
            .env("VGPU_LOG", "vgpu_vmm=info")
            .stdin(Stdio::null())
            .output()
            .expect("run vgpu-vmm");
        total_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "vgpu-vmm failed:\n{err}");
        let us: f64 =
            err.split("startup_us=").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|v| v.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok()).expect("startup_us in the VMM log");
        entry_ms.push(us / 1e3);
    }
    println!("vmm_start_to_first_guest_entry_ms  median={:.2} min={:.2} (n={runs})", median(&mut entry_ms.clone()), entry_ms.iter().cloned().fold(f64::MAX, f64::min));
    println!("vmm_whole_run_rng_guest_ms         median={:.2} (process start to exit, guest reads virtio-rng and resets)", median(&mut total_ms));

    // Resident memory of a running VM: anonymous + file-backed pages are the
    // VMM's own; shared memory is guest RAM (the memfd).
    let mut g = Guest::start("count", &["--memory", "256"]);
    g.wait_for("tick 1", Duration::from_secs(60));
    let pid = g.child.id();
    let (anon, file, shmem) = (status_kib(pid, "RssAnon"), status_kib(pid, "RssFile"), status_kib(pid, "RssShmem"));
    println!("vmm_rss_overhead_kib               anon={anon} file={file} total={} (guest RAM touched: shmem={shmem} KiB of 256 MiB)", anon + file);
    let _ = g.api_call("PUT", "/vm/kill");
    drop(g);

    // Nested tier: a stock Debian kernel under vgpu-vmm inside QEMU TCG.
    if vgpu_tests::nested::qemu_available("the nested-tier figure") {
        let out = vgpu_tests::nested::run("boot", 900);
        let secs = vgpu_tests::nested::value(&out, "VMM-TO-MARKER-SECONDS").unwrap_or("?");
        let kernel = out.lines().find(|l| l.contains("reboot: Restarting system")).unwrap_or("").trim().to_string();
        println!("nested_vmm_start_to_linux_marker_s {secs} (2 vCPUs, 256 MiB, Debian linux-image-amd64, L1 on QEMU TCG; last guest line: {kernel})");
    }
}
