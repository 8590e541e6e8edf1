//! fastpath-bench: the command ring, asynchronous launches and zero-copy
//! copies, each against a floor measured in the same run (docs/perf.md).
//!
//!   1. null synchronous call through the ring vs a unix-socket ping-pong
//!      between two threads on different cores (and the shared-memory
//!      ping-pong floor, and the old round trip over the tenant socket)
//!   2. 100 000 empty launches and one synchronize vs the same number of
//!      synchronous round trips (over the tenant socket, and through the
//!      ring with a synchronize after each launch)
//!   3. HtoD and DtoH bandwidth from pinned and pageable memory vs memcpy
//!   4. scrub on allocation vs memset of the same size
//!   5. a tenant's second connection's null call while its first runs
//!      long kernels back to back (no process of a tenant starves another)
//!
//! Usage: fastpath-bench [--quick] [--copy-loop SECONDS]
//! (`--copy-loop` only repeats 64 KiB pinned copies, for a profiler)

use std::ffi::c_void;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ::cuda::api as cu;
use ::cuda::client::Client;
use vgpu_tests::{Mediator, Raw};
use virtio_gpu_compute::*;

const NOP: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry nop()\n{\n    ret;\n}\n";
/// A one-thread kernel that loops `n` times.
const BUSY: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry busy(.param .u32 n)\n{\n    .reg .u32 %r<2>;\n    .reg .pred %p<1>;\n    ld.param.u32 %r0, [n];\n    mov.u32 %r1, 0;\nL:\n    add.u32 %r1, %r1, 1;\n    setp.lt.u32 %p0, %r1, %r0;\n    @%p0 bra L;\n    ret;\n}\n";

/// Median and worst null call (µs) of a second connection of the tenant
/// while a first one runs synchronous launches of a kernel of several
/// milliseconds over its socket, back to back.
fn sibling_latency(sock: &str, n: usize) -> (f64, f64, f64) {
    std::env::set_var("VGPU_RING", "0");
    let a = Client::connect_unix(sock).expect("connect");
    std::env::remove_var("VGPU_RING");
    let (ctx, f) = vgpu_tests::shares::context_with_kernel(&a, BUSY, "busy");
    let req = Request::LaunchKernel(LaunchReq { ctx, func: f, stream: 0, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 4, reserved: 0 }, 300_000u32.to_le_bytes().to_vec());
    let s = Instant::now();
    a.empty(req.clone()).expect("launch");
    let kernel_ms = s.elapsed().as_secs_f64() * 1e3;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let flood = std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            a.empty(req.clone()).expect("launch");
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(20));
    let b = Client::connect_unix(sock).expect("connect");
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            b.call(Request::Ping).expect("ping");
            let dt = s.elapsed().as_secs_f64() * 1e6;
            std::thread::sleep(std::time::Duration::from_micros(200));
            dt
        })
        .collect();
    stop.store(true, Ordering::Relaxed);
    let _ = flood.join();
    let worst = t.iter().cloned().fold(0.0, f64::max);
    (kernel_ms, median(&mut t), worst)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn check(r: cu::CUresult, what: &str) {
    assert_eq!(r, 0, "{what} failed with CUresult {r}");
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it and
    // CPU_ISSET reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return vec![0];
        }
        (0..libc::CPU_SETSIZE as usize).filter(|c| libc::CPU_ISSET(*c, &set)).collect()
    }
}

/// Pins the calling thread to the `i`-th CPU it may use (modulo their
/// number); the previous mask comes back from `unpin`.
fn pin(i: usize) {
    let cpus = allowed_cpus();
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and sched_setaffinity
    // only touch that local set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus[i % cpus.len()], &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Lets the calling thread run on every CPU again.
fn unpin(cpus: &[usize]) {
    // SAFETY: as in `pin`.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in cpus {
            libc::CPU_SET(*c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Median round trip (µs) of 8-byte messages over a unix socket pair,
/// the two sides on different cores.
fn socket_pingpong(n: usize) -> f64 {
    let (mut a, mut b) = UnixStream::pair().expect("socketpair");
    let echo = std::thread::spawn(move || {
        pin(1);
        let mut buf = [0u8; 8];
        while b.read_exact(&mut buf).is_ok() {
            if b.write_all(&buf).is_err() {
                break;
            }
        }
    });
    pin(0);
    let mut buf = [0u8; 8];
    let mut t: Vec<f64> = (0..n)
        .map(|i| {
            let s = Instant::now();
            a.write_all(&(i as u64).to_le_bytes()).expect("write");
            a.read_exact(&mut buf).expect("read");
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    drop(a);
    let _ = echo.join();
    median(&mut t[n / 10..])
}

/// Median round trip (µs) through two shared words, each side spinning on
/// its own core: the floor for any shared-memory ring.
fn shm_pingpong(n: usize) -> f64 {
    let words = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let w2 = words.clone();
    let n2 = n as u64;
    let echo = std::thread::spawn(move || {
        pin(1);
        for i in 1..=n2 {
            while w2[0].load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
            w2[1].store(i, Ordering::Release);
        }
    });
    pin(0);
    let mut t: Vec<f64> = (1..=n as u64)
        .map(|i| {
            let s = Instant::now();
            words[0].store(i, Ordering::Release);
            while words[1].load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    let _ = echo.join();
    median(&mut t[n / 10..])
}

fn null_calls(c: &Client, n: usize) -> f64 {
    for _ in 0..n / 10 {
        c.call(Request::Ping).expect("ping");
    }
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            assert_eq!(c.call(Request::Ping).expect("ping"), Reply::Empty);
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    median(&mut t)
}

/// Seconds for `n` empty launches over the tenant socket, each a round
/// trip that runs the kernel before it answers.
fn socket_launches(sock: &str, n: usize) -> f64 {
    std::env::set_var("VGPU_RING", "0");
    let c = Client::connect_unix(sock).expect("connect");
    std::env::remove_var("VGPU_RING");
    assert!(c.ring().is_none());
    let ctx = c.handle(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })).expect("ctx");
    let img = NOP.as_bytes().to_vec();
    let m = c.handle(Request::ModuleLoad(ModuleLoadReq { ctx, format: 0, image_len: img.len() as u64 }, img)).expect("module");
    let f = match c.call(Request::ModuleGetFunction(GetFunctionReq { ctx, module: m, name_len: 3, reserved: 0 }, "nop".into())).expect("function") {
        Reply::Function(f, _) => f.func,
        r => panic!("{r:?}"),
    };
    let req = Request::LaunchKernel(LaunchReq { ctx, func: f, stream: 0, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 0, reserved: 0 }, Vec::new());
    let s = Instant::now();
    for _ in 0..n {
        c.empty(req.clone()).expect("launch");
    }
    s.elapsed().as_secs_f64()
}

/// Seconds one call of `f` takes.
fn time(f: impl FnOnce()) -> f64 {
    let s = Instant::now();
    f();
    s.elapsed().as_secs_f64()
}

/// Best-of bandwidth in GB/s of `f` moving `bytes` per call.
fn bandwidth(bytes: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..iters {
        let s = Instant::now();
        f();
        best = best.min(s.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// Synchronous 64 KiB copies from pinned memory for `secs` seconds.
unsafe fn copy_loop(secs: f64) {
    // SAFETY: arguments follow the CUDA API contract; out-pointers are
    // valid locals and the pinned buffer holds the copied size.
    unsafe {
        check(cu::cuInit(0), "cuInit");
        let mut ctx = std::ptr::null_mut();
        check(cu::cuCtxCreate_v2(&mut ctx, 0, 0), "cuCtxCreate");
        let size = 64 << 10;
        let mut d = 0u64;
        check(cu::cuMemAlloc_v2(&mut d, size), "alloc");
        let mut pinned: *mut c_void = std::ptr::null_mut();
        check(cu::cuMemAllocHost_v2(&mut pinned, size), "cuMemAllocHost");
        let s = Instant::now();
        let mut n = 0u64;
        while s.elapsed().as_secs_f64() < secs {
            check(cu::cuMemcpyHtoD_v2(d, pinned, size), "htod");
            n += 1;
        }
        println!("copy_loop: {n} copies of 64 KiB, {:.2} µs each", s.elapsed().as_secs_f64() / n as f64 * 1e6);
    }
}

/// Tenant creation (POST /tenants) to the first answered call on its
/// socket, `n` times (each tenant deleted after): median and worst, ms.
fn tenant_to_first_call(m: &Mediator, n: usize) -> (f64, f64) {
    let mut t: Vec<f64> = (0..n)
        .map(|i| {
            let name = format!("first{i}");
            let s = Instant::now();
            let sock = m.tenant(&name, "16MiB");
            let mut r = Raw::connect(&sock);
            assert!(r.ping(), "the new tenant's first call failed");
            let dt = s.elapsed().as_secs_f64() * 1e3;
            let (st, _) = m.api("DELETE", &format!("/tenants/{name}"), None);
            assert!(st == 204 || st == 202, "deleting {name}: {st}");
            dt
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[t.len() - 1])
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // --isolation process|shared: how the mediator keeps tenants apart.
    let isolation = std::env::args().skip_while(|a| a != "--isolation").nth(1).unwrap_or_else(|| "process".into());
    let m = Mediator::start(&["--device-memory", "1GiB", "--isolation", &isolation]);
    println!("isolation={isolation}");
    let (first_med, first_worst) = tenant_to_first_call(&m, if quick { 10 } else { 40 });
    println!("tenant_create_to_first_call_ms median={first_med:.1} worst={first_worst:.1}");
    let sock = m.tenant("bench", "768MiB");
    let sock_s = sock.to_str().expect("utf8").to_string();
    let n = if quick { 2_000 } else { 20_000 };

    // 1. Null calls.
    let cpus = allowed_cpus();
    let sp = socket_pingpong(n);
    unpin(&cpus);
    let shm = shm_pingpong(n);
    unpin(&cpus);
    let ring_client = Client::connect_unix(&sock_s).expect("connect");
    assert!(ring_client.ring().is_some(), "the worker offers a ring");
    let ring_null = null_calls(&ring_client, n);
    std::env::set_var("VGPU_RING", "0");
    let sock_client = Client::connect_unix(&sock_s).expect("connect");
    std::env::remove_var("VGPU_RING");
    let sock_null = null_calls(&sock_client, n);
    drop((ring_client, sock_client));
    let (kernel_ms, sib_med, sib_worst) = sibling_latency(&sock_s, if quick { 200 } else { 2000 });
    println!("floor_socket_pingpong_us   median={sp:.2}");
    println!("floor_shm_pingpong_us      median={shm:.3}");
    println!("null_call_ring_us          median={ring_null:.2}   ratio_to_socket_pingpong={:.3} (target <= 0.25)", ring_null / sp);
    println!("null_call_socket_us        median={sock_null:.2}   ratio_to_socket_pingpong={:.3}", sock_null / sp);
    println!("sibling_null_call_us       median={sib_med:.2} worst={sib_worst:.0}   (a second connection of the tenant while the first launches {kernel_ms:.1} ms kernels back to back)");

    // 2. Launch throughput, through the C API.
    std::env::set_var("VGPU_SOCKET", &sock);
    if let Some(secs) = std::env::args().skip_while(|a| a != "--copy-loop").nth(1).and_then(|v| v.parse::<f64>().ok()) {
        // For profiling: 64 KiB pinned host-to-device copies, nothing else.
        // SAFETY: as below.
        unsafe { copy_loop(secs) };
        return;
    }
    let launches = if quick { 10_000 } else { 100_000 };
    let sync_n = if quick { 2_000 } else { 20_000 };
    // SAFETY: for all calls below, arguments follow the CUDA API contract;
    // out-pointers are valid locals and host buffers are sized to the copy.
    unsafe {
        check(cu::cuInit(0), "cuInit");
        let mut ctx = std::ptr::null_mut();
        check(cu::cuCtxCreate_v2(&mut ctx, 0, 0), "cuCtxCreate");
        let mut module = std::ptr::null_mut();
        let img = std::ffi::CString::new(NOP).expect("ptx");
        check(cu::cuModuleLoadData(&mut module, img.as_ptr().cast()), "load");
        let mut f = std::ptr::null_mut();
        check(cu::cuModuleGetFunction(&mut f, module, c"nop".as_ptr()), "function");
        let launch = || check(cu::cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()), "launch");
        for _ in 0..1000 {
            launch();
        }
        check(cu::cuCtxSynchronize(), "sync");
        let s = Instant::now();
        for _ in 0..launches {
            launch();
        }
        let enqueue = s.elapsed().as_secs_f64();
        check(cu::cuCtxSynchronize(), "sync");
        let async_s = s.elapsed().as_secs_f64();
        let s = Instant::now();
        for _ in 0..sync_n {
            launch();
            check(cu::cuCtxSynchronize(), "sync");
        }
        let ring_sync = s.elapsed().as_secs_f64() * launches as f64 / sync_n as f64;
        let socket_sync = socket_launches(&sock_s, sync_n) * launches as f64 / sync_n as f64;
        println!("launch_async_{launches}          {async_s:.3} s   ({:.2} µs per launch to enqueue, {:.0} launches/s end to end)", enqueue / launches as f64 * 1e6, launches as f64 / async_s);
        println!("launch_sync_socket_{launches}    {socket_sync:.3} s   (extrapolated from {sync_n})   speedup_async={:.1}x (target >= 10)", socket_sync / async_s);
        println!(
            "launch_sync_ring_{launches}      {ring_sync:.3} s   (launch + cuCtxSynchronize each, from {sync_n})   speedup_async={:.1}x   ratio_to_socket={:.2} (target <= 1)",
            ring_sync / async_s,
            ring_sync / socket_sync
        );

        // 3. Copies.
        for (size, iters) in
            [(4usize << 10, if quick { 200 } else { 2000 }), (64 << 10, if quick { 200 } else { 2000 }), (1 << 20, if quick { 50 } else { 500 }), (64 << 20, if quick { 3 } else { 20 })]
        {
            let mut d = 0u64;
            check(cu::cuMemAlloc_v2(&mut d, size), "alloc");
            let mut pinned: *mut c_void = std::ptr::null_mut();
            check(cu::cuMemAllocHost_v2(&mut pinned, size), "cuMemAllocHost");
            std::ptr::write_bytes(pinned.cast::<u8>(), 0x5A, size);
            let mut pageable = vec![0x5Au8; size];
            let mut other = vec![0u8; size];
            // Rounds interleave the five measurements, so drift on a shared
            // machine hits them alike; each figure is the best round.
            let mut best = [f64::MAX; 5];
            for round in 0..=iters {
                let t: [f64; 5] = [
                    time(|| {
                        std::ptr::copy_nonoverlapping(pageable.as_ptr(), other.as_mut_ptr(), size);
                        std::hint::black_box(&mut other);
                    }),
                    time(|| check(cu::cuMemcpyHtoD_v2(d, pinned, size), "htod")),
                    time(|| check(cu::cuMemcpyDtoH_v2(pinned, d, size), "dtoh")),
                    time(|| check(cu::cuMemcpyHtoD_v2(d, pageable.as_ptr().cast(), size), "htod")),
                    time(|| check(cu::cuMemcpyDtoH_v2(pageable.as_mut_ptr().cast(), d, size), "dtoh")),
                ];
                if round > 0 {
                    for (b, t) in best.iter_mut().zip(t) {
                        *b = b.min(t);
                    }
                }
            }
            let [memcpy, p_htod, p_dtoh, g_htod, g_dtoh] = best.map(|t| size as f64 / t / 1e9);
            let kib = size >> 10;
            println!("copy_{kib}KiB  memcpy={memcpy:.2} GB/s");
            println!("copy_{kib}KiB  pinned   HtoD={p_htod:.2} GB/s ({:.2}x)  DtoH={p_dtoh:.2} GB/s ({:.2}x)", p_htod / memcpy, p_dtoh / memcpy);
            println!("copy_{kib}KiB  pageable HtoD={g_htod:.2} GB/s ({:.2}x)  DtoH={g_dtoh:.2} GB/s ({:.2}x)", g_htod / memcpy, g_dtoh / memcpy);
            check(cu::cuMemFreeHost(pinned), "free host");
            check(cu::cuMemFree_v2(d), "free");
        }

        // 4. Scrub on allocation (each cuMemAlloc zeroes its range) vs memset.
        let size = 64usize << 20;
        let iters = if quick { 3 } else { 10 };
        let mut buf = vec![1u8; size];
        let memset = bandwidth(size, iters, || {
            std::ptr::write_bytes(buf.as_mut_ptr(), 0, size);
            std::hint::black_box(&mut buf);
        });
        let scrub = bandwidth(size, iters, || {
            let mut d = 0u64;
            check(cu::cuMemAlloc_v2(&mut d, size), "alloc");
            check(cu::cuMemFree_v2(d), "free");
        });
        println!("scrub_64MiB  memset={memset:.2} GB/s  alloc+scrub={scrub:.2} GB/s ({:.2}x)", scrub / memset);
        check(cu::cuCtxDestroy_v2(ctx), "destroy");
    }
    drop(m);
}
