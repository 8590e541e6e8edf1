//! While one tenant runs every known attack in a loop for 30 s, another
//! tenant's samples pass every time, the worker never restarts, and the
//! worker's threads, descriptors and RSS stay under the bound
//! docs/threat-model.md states: one that depends on the tenants' limits,
//! never on how many objects they create. `VGPU_SOAK_SECS` changes the
//! duration.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use vgpu_tests::*;
use virtio_gpu_compute::*;

const EVIL_CONNECTIONS: u64 = 16;
/// Fds a tenant may have waiting to be closed, and most one message
/// carries (executor/src/worker/conn.rs, docs/threat-model.md).
const MAX_JUNK_FDS: u64 = 64;
const MAX_MESSAGE_FDS: u64 = 8;
const EVIL_HOST: u64 = 64 << 20;
const EVIL_QUOTA: u64 = 32 << 20;
const GOOD_QUOTA: u64 = 64 << 20;
/// Register file of one launch in flight (ptx::MAX_REGISTER_FILE), per lane.
const REGISTER_FILE: u64 = 64 << 20;

const HEAD: &str = ".version 7.0\n.target sm_70\n.address_size 64\n";

fn attacks(sock: &Path, round: u64) {
    let faults = faults_ptx();
    // Garbage: an error, then the connection closes.
    let mut r = Raw::connect(sock);
    let _ = r.send_bytes(&[0xde; 64]);
    let _ = r.read_reply();
    // A module nested thousands deep.
    let mut r = Raw::connect(sock);
    let ctx = r.ctx();
    let deep = format!("{HEAD}.visible .entry k() {{\n .reg .b32 %r<2>;\n mov.u32 %r1, {}%r1;\n ret;\n}}\n", "!".repeat(5000));
    assert!(matches!(r.load(ctx, &deep), Reply::Error(CuResult::CUDA_ERROR_INVALID_PTX, _)));
    // Two fds on every message.
    let null = std::fs::File::open("/dev/null").expect("/dev/null");
    for seq in 0..50u32 {
        send_with_fds(&r.s, &Request::Ping.encode(1000 + seq), &[std::os::fd::AsRawFd::as_raw_fd(&null); 2]).expect("send");
        assert!(r.read_reply().is_some());
    }
    // A register file of 1024 threads × 60000 registers.
    let huge = format!("{HEAD}.visible .entry k() {{\n .reg .b64 %rd<60000>;\n ret;\n}}\n");
    let m = Raw::handle(r.load(ctx, &huge));
    let Reply::Function(f, _) = r.function(ctx, m, "k") else { panic!("no function") };
    assert!(matches!(r.launch(ctx, f.func, [1, 1, 1], [1024, 1, 1], &[]), Reply::Error(CuResult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, _)));
    // A million one-thread blocks, and a kernel that never ends: both
    // stopped by the launch's cost budget or time limit.
    let fm = Raw::handle(r.load(ctx, &faults));
    let Reply::Function(spin, _) = r.function(ctx, fm, "spin") else { panic!("no spin") };
    if round.is_multiple_of(3) {
        assert!(matches!(r.launch(ctx, spin.func, [1_000_000, 1, 1], [1, 1, 1], &[]), Reply::Error(CuResult::CUDA_ERROR_LAUNCH_TIMEOUT, _)));
    }
    drop(r);
    // Modules until the host budget says no.
    let mut r = Raw::connect(sock);
    let ctx = r.ctx();
    let big = format!("{HEAD}.visible .entry k() {{\n .reg .b32 %r<2>;\n{} ret;\n}}\n", "\tadd.u32 %r1, %r1, 1;\n".repeat(4000));
    let mut n = 0;
    while let Reply::Handle(_) = r.load(ctx, &big) {
        n += 1;
        assert!(n < 1000, "modules were never refused");
    }
    // Events until the host budget says no.
    let mut n = 0;
    while let Reply::Handle(_) = r.event(ctx) {
        n += 1;
        assert!(n < 1 << 20, "events were never refused");
    }
    drop(r);
    // More connections than allowed, all at once.
    let flood: Vec<Raw> = (0..EVIL_CONNECTIONS + 4).map(|_| Raw::connect(sock)).collect();
    drop(flood);
    // Their threads wind down; until then new connections are refused.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !Raw::connect(sock).ping() {
        assert!(Instant::now() < deadline, "the tenant's connections were never released");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A payload as large as the protocol allows.
    let mut r = Raw::connect(sock);
    let mut h = Vec::new();
    MsgHeader { magic: MAGIC, version: VERSION, opcode: Opcode::ModuleLoad as u16, seq: 1, status: 0, payload_len: MAX_PAYLOAD, reserved: 0 }.put(&mut h);
    let _ = r.send_bytes(&h);
    let _ = r.read_reply();
    // Many module-scope variables shared by many entries.
    let mut src = String::from(HEAD);
    for i in 0..1500 {
        src.push_str(&format!(".shared .align 4 .b8 s{i}[4];\n"));
    }
    for i in 0..1500 {
        src.push_str(&format!(".visible .entry e{i}() {{ ret; }}\n"));
    }
    let mut r = Raw::connect(sock);
    let ctx = r.ctx();
    let _ = r.load(ctx, &src);
}

#[test]
fn attacks_in_a_loop_never_disturb_another_tenant_or_grow_the_worker() {
    let secs = std::env::var("VGPU_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let m = Mediator::start(&["--device-memory", "256MiB", "--launch-timeout-ms", "2000"]);
    let evil = m.tenant_with(json!({ "name": "evil", "memory": "32MiB", "host_memory": "64MiB", "max_connections": EVIL_CONNECTIONS }));
    let evil = std::path::PathBuf::from(evil["socket"].as_str().expect("socket"));
    let good = m.tenant("good", "64MiB");
    samples();
    // The attacked process: the attacker's executor (the worker under
    // shared isolation).
    let pid = m.serving_pid("cpu0", "evil");
    let good_pid = m.serving_pid("cpu0", "good");
    // The steady state of the victim is part of the baseline.
    assert!(run_ok(sample("reduction", &good)).contains("PASSED"));
    let base = proc_stats(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let (rounds, passes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let attacker = std::thread::spawn({
        let (stop, rounds, evil) = (stop.clone(), rounds.clone(), evil.clone());
        move || {
            while !stop.load(Ordering::Relaxed) {
                attacks(&evil, rounds.fetch_add(1, Ordering::Relaxed));
            }
        }
    });
    let victim = std::thread::spawn({
        let (stop, passes, good) = (stop.clone(), passes.clone(), good.clone());
        move || {
            while !stop.load(Ordering::Relaxed) {
                for (prog, args) in [("vectorAdd", vec!["50000"]), ("reduction", vec![]), ("matrixMul", vec!["64"])] {
                    let mut c = sample(prog, &good);
                    c.args(&args);
                    let out = run_ok(c);
                    assert!(out.contains(&format!("{prog}: PASSED")), "{out}");
                    passes.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    let mut peak = base;
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end && !attacker.is_finished() && !victim.is_finished() {
        let s = proc_stats(pid);
        peak.rss_kib = peak.rss_kib.max(s.rss_kib);
        peak.fds = peak.fds.max(s.fds);
        peak.threads = peak.threads.max(s.threads);
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    attacker.join().expect("an attack did not get the answer it should");
    victim.join().expect("the victim's samples failed during the attacks");
    let d = m.device("cpu0");
    assert_eq!(d["worker_restarts"], 0, "the worker restarted");
    assert_eq!(m.serving_pid("cpu0", "evil"), pid, "the attacker's executor was replaced");
    assert_eq!(m.serving_pid("cpu0", "good"), good_pid, "the victim's executor was replaced");
    let (rounds, passes) = (rounds.load(Ordering::Relaxed), passes.load(Ordering::Relaxed));
    assert!(rounds >= 1 && passes >= 3, "{rounds} attack rounds, {passes} victim passes");
    // The bound: no thread at all per connection (a fixed pool serves
    // them), at most two teardown threads; one descriptor per connection
    // (the evil tenant's and the victim's), plus the fds the tenant sent
    // that wait for the closer thread (past MAX_JUNK_FDS its connections
    // are not read, and each connection has at most one message of at
    // most MAX_MESSAGE_FDS in hand; an executor's closer thread competes
    // with its lanes for the cores, so the queue does fill under attack);
    // RSS grows by at most both
    // tenants' device memory, the attacker's host budget and one register
    // file per lane.
    let max_threads = base.threads + 2;
    let max_fds = base.fds as u64 + EVIL_CONNECTIONS + 2 + 8 + MAX_JUNK_FDS + MAX_MESSAGE_FDS * EVIL_CONNECTIONS;
    // The worker runs one lane per CPU it may use, as this test sees them.
    let lanes = std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1);
    let max_rss = base.rss_kib + (EVIL_HOST + EVIL_QUOTA + GOOD_QUOTA + lanes * REGISTER_FILE) / 1024 + 32 * 1024;
    eprintln!("soak: {rounds} attack rounds, {passes} victim passes; base {base:?}; peak rss {} KiB, fds {}, threads {}", peak.rss_kib, peak.fds, peak.threads);
    assert!(peak.threads <= max_threads, "threads {} > bound {max_threads}", peak.threads);
    assert!(peak.fds as u64 <= max_fds, "fds {} > bound {max_fds}", peak.fds);
    assert!(peak.rss_kib <= max_rss, "RSS {} KiB > bound {max_rss} KiB", peak.rss_kib);
}
