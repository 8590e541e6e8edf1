//! vgpu-bench: prints the host-spine figures recorded in docs/perf.md.
//! Every comparison is a ratio taken within this one run.
//!
//!   null-call round trip over the tenant socket (median, p99)
//!   HtoD / DtoH bandwidth through libcuda's exported functions vs memcpy
//!   interpreter throughput (instructions/s) on the tiled matrixMul kernel
//!   end-to-end kernel launch round trip (tiny kernel)
//!
//! Usage: vgpu-bench [--quick]

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cuda::api as cu;
use cuda::client::Client;
use vgpu_ptx::{self as ptx, ExecError, GlobalMem, Module};
use vgpu_tests::{workspace, Mediator};
use virtio_gpu_compute::{Reply, Request};

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

struct Flat {
    base: u64,
    mem: Vec<u8>,
}

impl GlobalMem for Flat {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let o = (addr - self.base) as usize;
        out.copy_from_slice(self.mem.get(o..o + out.len()).ok_or(ExecError::IllegalAddress { kind: "global", addr, len: out.len(), line: 0 })?);
        Ok(())
    }
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        let o = (addr - self.base) as usize;
        self.mem.get_mut(o..o + data.len()).ok_or(ExecError::IllegalAddress { kind: "global", addr, len: data.len(), line: 0 })?.copy_from_slice(data);
        Ok(())
    }
}

fn check(r: cu::CUresult, what: &str) {
    assert_eq!(r, 0, "{what} failed with CUresult {r}");
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let m = Mediator::start(&["--device-memory", "1GiB"]);
    let sock = m.tenant("bench", "768MiB");

    // 1. Null call round trip.
    let c = Client::connect_unix(sock.to_str().expect("utf8")).expect("connect");
    let n = if quick { 2_000 } else { 20_000 };
    for _ in 0..500 {
        c.call(Request::Ping).expect("ping");
    }
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            let r = c.call(Request::Ping).expect("ping");
            assert_eq!(r, Reply::Empty);
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    println!("null_call_rtt_us      median={:.1} p99={:.1} (n={n})", pct(&mut t, 0.5), pct(&mut t, 0.99));
    drop(c);

    // 2. Copies through the shim's C API.
    std::env::set_var("VGPU_SOCKET", &sock);
    // SAFETY: for all calls below, arguments follow the CUDA API contract;
    // out-pointers are valid locals and host buffers are sized to the copy.
    unsafe {
        check(cu::cuInit(0), "cuInit");
        let mut ctx = std::ptr::null_mut();
        check(cu::cuCtxCreate_v2(&mut ctx, 0, 0), "cuCtxCreate");
        for size in [1usize << 20, 256 << 20] {
            let iters = if quick {
                3
            } else if size < (8 << 20) {
                200
            } else {
                5
            };
            let mut d = 0u64;
            check(cu::cuMemAlloc_v2(&mut d, size), "cuMemAlloc");
            let host: Vec<u8> = (0..size).map(|i| i as u8).collect();
            let mut back = vec![0u8; size];
            let time = |f: &mut dyn FnMut()| {
                f();
                let s = Instant::now();
                for _ in 0..iters {
                    f();
                }
                s.elapsed() / iters as u32
            };
            let htod = time(&mut || check(cu::cuMemcpyHtoD_v2(d, host.as_ptr() as *const c_void, size), "HtoD"));
            let dtoh = time(&mut || check(cu::cuMemcpyDtoH_v2(back.as_mut_ptr() as *mut c_void, d, size), "DtoH"));
            assert!(back == host, "round trip corrupted data");
            let mut dst = vec![0u8; size];
            let memcpy = time(&mut || {
                dst.copy_from_slice(std::hint::black_box(&host));
                std::hint::black_box(&dst);
            });
            let gbs = |t: Duration| size as f64 / t.as_secs_f64() / 1e9;
            println!(
                "copy_{:>4}MiB           htod={:.2} GB/s dtoh={:.2} GB/s memcpy={:.2} GB/s  htod/memcpy={:.2} dtoh/memcpy={:.2}",
                size >> 20,
                gbs(htod),
                gbs(dtoh),
                gbs(memcpy),
                gbs(htod) / gbs(memcpy),
                gbs(dtoh) / gbs(memcpy)
            );
            check(cu::cuMemFree_v2(d), "cuMemFree");
        }

        // 3. Launch round trip of a tiny kernel through the whole stack.
        let ptx = std::fs::read(workspace().join("samples/kernels/vectorAdd.ptx")).expect("ptx");
        let mut ptxz = ptx.clone();
        ptxz.push(0);
        let mut module = std::ptr::null_mut();
        check(cu::cuModuleLoadData(&mut module, ptxz.as_ptr() as *const c_void), "cuModuleLoadData");
        let mut f = std::ptr::null_mut();
        check(cu::cuModuleGetFunction(&mut f, module, c"vectorAdd".as_ptr()), "cuModuleGetFunction");
        let mut buf = 0u64;
        check(cu::cuMemAlloc_v2(&mut buf, 4096), "cuMemAlloc");
        let mut nel: i32 = 32;
        let mut args: [*mut c_void; 4] = [&mut buf as *mut u64 as _, &mut buf as *mut u64 as _, &mut buf as *mut u64 as _, &mut nel as *mut i32 as _];
        let launches = if quick { 500 } else { 5_000 };
        let mut t: Vec<f64> = (0..launches)
            .map(|_| {
                let s = Instant::now();
                check(cu::cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, std::ptr::null_mut(), args.as_mut_ptr(), std::ptr::null_mut()), "launch");
                s.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        println!("launch_rtt_us          median={:.1} p99={:.1} (32 threads, n={launches})", pct(&mut t, 0.5), pct(&mut t, 0.99));
    }

    // 4. Interpreter throughput, in-process.
    let src = std::fs::read_to_string(workspace().join("samples/kernels/matrixMul.ptx")).expect("ptx");
    let module = Module::parse(&src).expect("parse");
    let k = module.kernel("matrixMul").expect("kernel");
    let dim = if quick { 64u32 } else { 256 };
    let words = (dim * dim) as usize;
    let base = 0x7000_0000_0000u64;
    let mut mem = Flat { base, mem: vec![0u8; 3 * words * 4] };
    for (i, w) in mem.mem.chunks_mut(4).enumerate() {
        w.copy_from_slice(&(((i % 7) as f32) * 0.5).to_le_bytes());
    }
    let mut params = Vec::new();
    params.extend_from_slice(&(base + 2 * words as u64 * 4).to_le_bytes());
    params.extend_from_slice(&base.to_le_bytes());
    params.extend_from_slice(&(base + words as u64 * 4).to_le_bytes());
    params.extend_from_slice(&dim.to_le_bytes());
    params.extend_from_slice(&dim.to_le_bytes());
    let cfg = ptx::LaunchConfig { grid: [dim / 16, dim / 16, 1], block: [16, 16, 1], dynamic_shared: 0 };
    let s = Instant::now();
    let stats = ptx::launch(k, &cfg, &params, &mut mem, &ptx::Limits::default()).expect("launch");
    let dt = s.elapsed();
    println!(
        "interpreter            {:.1} M instructions/s ({} instructions, matrixMul {dim}x{dim} in {:.3} s)",
        stats.instructions as f64 / dt.as_secs_f64() / 1e6,
        stats.instructions,
        dt.as_secs_f64()
    );
}
