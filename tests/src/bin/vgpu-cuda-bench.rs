//! vgpu-cuda-bench: the `cuda` backend against native CUDA, in one run.
//!
//! The same measuring code runs twice, in two child processes: once on the
//! machine's own libcuda.so.1 (native) and once on the shim's, as a tenant
//! of a mediator serving this GPU (mediated). Every figure is printed as
//! both and their ratio:
//!
//!   kernel launch latency (launch + synchronize, median) and launch
//!   throughput (back-to-back launches, one synchronize)
//!   HtoD / DtoH bandwidth at 1 MiB and 256 MiB (native: pinned buffers;
//!   mediated: the guest program's ordinary buffers)
//!   scrub rate: device memset GB/s against device-to-device copy GB/s
//!   (native), and a mediated 1 GiB allocation, scrub included
//!   matrixMul end to end: the C sample, run to completion both ways
//!
//! Usage: vgpu-cuda-bench [--quick] [--isolation process|shared] (process
//! by default). Without a GPU it says why and exits 0.

use std::ffi::{c_void, CString};
use std::process::Command;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use serde_json::{json, Value};
use vgpu_tests::*;

fn ck(r: cu::CUresult, what: &str) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{what} failed: {r:?}");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

const NULL_PTX: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry nothing()\n{\n\tret;\n}\n\0";

/// One role's figures, measured with whatever libcuda this process loaded.
fn measure(native: bool, quick: bool) -> Value {
    let reps = if quick { 200 } else { 2000 };
    // SAFETY: for the whole block, driver API calls with valid out-pointers and
    // buffers that outlive each call; the context is current throughout.
    unsafe {
        ck(cu::cuInit(0), "cuInit");
        let mut dev = 0;
        ck(cu::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        let mut ctx = std::ptr::null_mut();
        ck(cu::cuCtxCreate_v2(&mut ctx, 0, dev), "cuCtxCreate");
        let mut module = std::ptr::null_mut();
        ck(cu::cuModuleLoadData(&mut module, NULL_PTX.as_ptr().cast()), "cuModuleLoadData");
        let mut f = std::ptr::null_mut();
        let name = CString::new("nothing").expect("name");
        ck(cu::cuModuleGetFunction(&mut f, module, name.as_ptr()), "cuModuleGetFunction");
        let launch = || ck(cu::cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()), "cuLaunchKernel");
        for _ in 0..50 {
            launch();
        }
        ck(cu::cuCtxSynchronize(), "sync");
        let lat: Vec<f64> = (0..reps)
            .map(|_| {
                let t = Instant::now();
                launch();
                ck(cu::cuCtxSynchronize(), "sync");
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        let t = Instant::now();
        for _ in 0..reps {
            launch();
        }
        ck(cu::cuCtxSynchronize(), "sync");
        let launches_per_s = reps as f64 / t.elapsed().as_secs_f64();

        let mut bw = serde_json::Map::new();
        for (label, size) in [("1MiB", 1usize << 20), ("256MiB", 256usize << 20)] {
            let n = if size > 1 << 20 {
                if quick {
                    3
                } else {
                    10
                }
            } else if quick {
                50
            } else {
                500
            };
            let mut d = 0;
            ck(cu::cuMemAlloc_v2(&mut d, size), "cuMemAlloc");
            let mut pinned: *mut c_void = std::ptr::null_mut();
            let mut pageable = Vec::new();
            let host: *mut c_void = if native {
                ck(cu::cuMemAllocHost_v2(&mut pinned, size), "cuMemAllocHost");
                pinned
            } else {
                pageable = vec![1u8; size];
                pageable.as_mut_ptr().cast()
            };
            let time = |dir: &dyn Fn()| {
                dir();
                let t = Instant::now();
                for _ in 0..n {
                    dir();
                }
                (size * n) as f64 / t.elapsed().as_secs_f64() / 1e9
            };
            let htod = time(&|| ck(cu::cuMemcpyHtoD_v2(d, host, size), "HtoD"));
            let dtoh = time(&|| ck(cu::cuMemcpyDtoH_v2(host, d, size), "DtoH"));
            bw.insert(label.into(), json!({ "htod_gbs": htod, "dtoh_gbs": dtoh }));
            if native {
                cu::cuMemFreeHost(pinned);
            }
            drop(pageable);
            ck(cu::cuMemFree_v2(d), "cuMemFree");
        }

        // Scrub rate against copy bandwidth on the device, and the cost of
        // a mediated allocation (cuMemAlloc + scrub + read-back + RPC).
        let big = 1usize << 30;
        let t = Instant::now();
        let (mut a, mut b) = (0, 0);
        ck(cu::cuMemAlloc_v2(&mut a, big), "cuMemAlloc 1GiB");
        let alloc_gbs = big as f64 / t.elapsed().as_secs_f64() / 1e9;
        ck(cu::cuMemAlloc_v2(&mut b, big), "cuMemAlloc 1GiB");
        let rounds = if quick { 3 } else { 10 };
        ck(cu::cuMemsetD8_v2(a, 0, big), "memset");
        ck(cu::cuCtxSynchronize(), "sync");
        let t = Instant::now();
        for _ in 0..rounds {
            ck(cu::cuMemsetD8_v2(a, 0, big), "memset");
        }
        ck(cu::cuCtxSynchronize(), "sync");
        let memset_gbs = (big * rounds) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        for _ in 0..rounds {
            ck(cu::cuMemcpyDtoD_v2(b, a, big), "DtoD");
        }
        ck(cu::cuCtxSynchronize(), "sync");
        // A copy reads and writes each byte: count both, as bandwidth tools do.
        let dtod_gbs = (2 * big * rounds) as f64 / t.elapsed().as_secs_f64() / 1e9;
        ck(cu::cuMemFree_v2(a), "free");
        ck(cu::cuMemFree_v2(b), "free");
        cu::cuCtxDestroy_v2(ctx);
        json!({
            "launch_latency_us": median(lat),
            "launches_per_s": launches_per_s,
            "bandwidth": bw,
            "alloc_1gib_gbs": alloc_gbs,
            "memset_gbs": memset_gbs,
            "dtod_gbs": dtod_gbs,
        })
    }
}

fn run_role(role: &str, quick: bool, socket: Option<&std::path::Path>) -> Value {
    let mut c = Command::new(std::env::current_exe().expect("exe"));
    c.arg("--role").arg(role);
    if quick {
        c.arg("--quick");
    }
    match socket {
        Some(s) => {
            c.env("VGPU_SOCKET", s).env("LD_LIBRARY_PATH", lib_dir());
        }
        None => {
            c.env_remove("LD_LIBRARY_PATH");
        }
    }
    let out = c.output().expect("run role");
    assert!(out.status.success(), "{role} role failed:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{role} role printed bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Wall time of the matrixMul sample, median of `n` runs.
fn matrix_mul(socket: Option<&std::path::Path>, n: usize, dim: &str) -> Duration {
    let times = (0..n)
        .map(|_| {
            let mut c = match socket {
                Some(s) => sample("matrixMul", s),
                None => {
                    let mut c = Command::new(samples().join("matrixMul"));
                    c.env_remove("LD_LIBRARY_PATH");
                    c
                }
            };
            c.arg(dim);
            let t = Instant::now();
            let out = run_ok(c);
            assert!(out.contains("PASSED"), "{out}");
            t.elapsed().as_secs_f64()
        })
        .collect();
    Duration::from_secs_f64(median(times))
}

fn row(what: &str, native: f64, mediated: f64, unit: &str) {
    println!("{what:<44} native {native:>12.2} {unit:<9} mediated {mediated:>12.2} {unit:<9} mediated/native {:>7.3}", mediated / native);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(i) = args.iter().position(|a| a == "--role") {
        let native = args.get(i + 1).map(String::as_str) == Some("native");
        println!("{}", measure(native, quick));
        return;
    }
    let info = match discover_gpus() {
        Ok(v) => v,
        Err(why) => {
            println!("vgpu-cuda-bench: SKIPPED: no NVIDIA GPU on this machine ({why}). Run it on a GPU machine.");
            return;
        }
    };
    let gpu = info["devices"][0]["name"].as_str().expect("device").to_string();
    println!("device {} ({}), driver {}, CUDA {}", gpu, info["devices"][0]["model"], info["driver_version"], info["cuda_driver_version"]);
    let native = run_role("native", quick, None);
    // --isolation process (the default here: a tenant's executor of its
    // own, as on every GPU a tenant shares) or shared.
    let isolation = args.iter().skip_while(|a| *a != "--isolation").nth(1).cloned().unwrap_or_else(|| "process".into());
    println!("isolation={isolation}");
    let m = Mediator::start_with(&["--cuda", "required", "--cpu-devices", "0", "--isolation", &isolation]);
    let sock = m.tenant_on("bench", "8GiB", &gpu);
    let mediated = run_role("mediated", quick, Some(&sock));
    let f = |v: &Value, k: &str| v[k].as_f64().expect(k);
    row("kernel launch + sync latency (median)", f(&native, "launch_latency_us"), f(&mediated, "launch_latency_us"), "us");
    row("launch throughput (back to back)", f(&native, "launches_per_s"), f(&mediated, "launches_per_s"), "launch/s");
    for size in ["1MiB", "256MiB"] {
        for dir in ["htod_gbs", "dtoh_gbs"] {
            let label = format!("{} {size} (native pinned)", if dir == "htod_gbs" { "HtoD" } else { "DtoH" });
            row(&label, native["bandwidth"][size][dir].as_f64().expect("bw"), mediated["bandwidth"][size][dir].as_f64().expect("bw"), "GB/s");
        }
    }
    println!(
        "{:<44} memset {:>10.1} GB/s   device copy {:>10.1} GB/s   memset/copy {:>6.3}",
        "scrub rate on the device (native)",
        f(&native, "memset_gbs"),
        f(&native, "dtod_gbs"),
        f(&native, "memset_gbs") / f(&native, "dtod_gbs")
    );
    row("1 GiB allocation (mediated: scrubbed, checked)", f(&native, "alloc_1gib_gbs"), f(&mediated, "alloc_1gib_gbs"), "GB/s");
    let runs = if quick { 1 } else { 3 };
    let (n, md) = (matrix_mul(None, runs, "1024"), matrix_mul(Some(&sock), runs, "1024"));
    row("matrixMul 1024 end to end (process)", n.as_secs_f64() * 1e3, md.as_secs_f64() * 1e3, "ms");
}
