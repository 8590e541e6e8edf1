//! Time from `vgpuctl vm create` to the guest's first line, printed from
//! one run. Two figures:
//! - host side (KVM tier): `vgpuctl vm create` with the bare-metal test
//!   guest, repeated; how long the call takes (validation, the vGPU tenant,
//!   placement, the state file, starting `vgpu-vmm` and waiting for its API
//!   socket) and how long until the guest's first console line reaches the
//!   daemon's console log, then the same for `vgpuctl vm delete`;
//! - nested (`--nested`, needs QEMU): inside L1, `vgpuctl vm create` of a
//!   VM booting Debian's kernel from a root disk with a bridged interface
//!   and a vGPU, to the first line its boot initramfs prints (the
//!   `vmdisk` scenario of images/nested).
//!
//! Usage: `vm-create-bench [RUNS] [--nested]` after
//! `cargo build --release --workspace` (scripts/setup.sh).

use std::time::{Duration, Instant};

use vgpu_tests::vmm_harness::test_guest;
use vgpu_tests::Mediator;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runs: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(10).max(1);
    let nested = args.iter().any(|a| a == "--nested");
    let m = Mediator::start(&["--device-memory", "256MiB"]);
    let guest = test_guest().to_str().expect("guest path").to_string();
    let (mut create_ms, mut first_ms, mut delete_ms) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        let name = format!("bench{i}");
        let console = m.run_dir.join("state/vms").join(&name).join("console.log");
        let t = Instant::now();
        let o = m.vgpuctl().args(["vm", "create", &name, "--memory", "16MiB", "--kernel", &guest, "--cmdline", "test=count", "--vgpu-memory", "32MiB"]).output().expect("vgpuctl");
        let created = t.elapsed();
        assert!(o.status.success(), "vm create failed: {}", String::from_utf8_lossy(&o.stderr));
        // The guest's first line, as the daemon's console log has it.
        let deadline = t + Duration::from_secs(60);
        while !std::fs::read(&console).is_ok_and(|b| b.contains(&b'\n')) {
            assert!(Instant::now() < deadline, "no console line from {name} within 60 s");
            std::thread::sleep(Duration::from_micros(500));
        }
        first_ms.push(t.elapsed().as_secs_f64() * 1e3);
        create_ms.push(created.as_secs_f64() * 1e3);
        let t = Instant::now();
        let o = m.vgpuctl().args(["vm", "delete", &name]).output().expect("vgpuctl");
        delete_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(o.status.success(), "vm delete failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    let min = |v: &[f64]| v.iter().cloned().fold(f64::MAX, f64::min);
    println!("host: vm_create_call_ms           median={:.1} min={:.1} (n={runs}; vGPU tenant, placement, state file, vgpu-vmm up)", median(&mut create_ms.clone()), min(&create_ms));
    println!("host: vm_create_to_first_line_ms  median={:.1} min={:.1} (the bare-metal test guest's first console line)", median(&mut first_ms.clone()), min(&first_ms));
    println!("host: vm_delete_call_ms           median={:.1} min={:.1} (VMM killed, vGPU tenant deleted, state removed)", median(&mut delete_ms.clone()), min(&delete_ms));
    drop(m);
    if nested && vgpu_tests::nested::qemu_available("vm-create-bench --nested") {
        let out = vgpu_tests::nested::run("vmdisk", 1200);
        let v = |k: &str| vgpu_tests::nested::value(&out, k).unwrap_or("?").to_string();
        println!(
            "nested: vm_create_call_s={} vm_create_to_first_userspace_line_s={} (Debian linux-image-amd64 from an ext4 root disk, 1 vCPU, 256 MiB, bridged virtio-net, 64 MiB vGPU; L1 on QEMU TCG)",
            v("VM-CREATE-RETURNED-S"),
            v("VM-FIRST-USERSPACE-S")
        );
    }
}
