//! A tenant cannot make its worker hold unbounded host resources: fds sent
//! with messages are closed, accept errors back off instead of spinning,
//! connections are capped, and the host memory of its objects (modules,
//! function handles, events, payloads) is charged to a per-tenant budget
//! that `tenant show` and the metrics report.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use serde_json::json;
use vgpu_tests::*;
use virtio_gpu_compute::*;

#[test]
fn fds_attached_to_messages_are_closed_not_leaked() {
    let m = Mediator::start(&[]);
    let sock = m.tenant("fds", "16MiB");
    let pid = m.serving_pid("cpu0", "fds");
    let mut r = Raw::connect(&sock);
    assert!(r.ping());
    let before = proc_stats(pid).fds;
    let null = std::fs::File::open("/dev/null").expect("/dev/null");
    let fd = null.as_raw_fd();
    // Two fds on every message: the receive path used to install both and
    // keep one, leaking the other (1000 messages, 1000 fds).
    for seq in 1..=1000u32 {
        send_with_fds(&r.s, &Request::Ping.encode(seq), &[fd, fd]).expect("send");
        assert!(matches!(r.read_reply(), Some((_, Reply::Empty))));
    }
    // A shared buffer must come alone, and be a sealed memfd.
    let reg = Request::RegisterShm(RegisterShmReq { size: 4096, id: 0, flags: 0 }).encode(2000);
    send_with_fds(&r.s, &reg, &[fd, fd]).expect("send");
    match r.read_reply() {
        Some((_, Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, msg))) => assert!(msg.contains("exactly one"), "{msg}"),
        other => panic!("{other:?}"),
    }
    let reg = Request::RegisterShm(RegisterShmReq { size: 4096, id: 0, flags: 0 }).encode(2001);
    send_with_fds(&r.s, &reg, &[fd]).expect("send");
    match r.read_reply() {
        Some((_, Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, msg))) => assert!(msg.contains("sealed"), "{msg}"),
        other => panic!("{other:?}"),
    }
    // Up to 253 fds on one message: all taken and closed by the worker,
    // none left to the kernel to close on the poller.
    let many: Vec<i32> = vec![fd; 200];
    send_with_fds(&r.s, &Request::Ping.encode(2002), &many).expect("send");
    assert!(r.read_reply().is_none(), "more than 8 fds on one message drop the connection");
    std::thread::sleep(Duration::from_millis(300));
    let after = proc_stats(pid).fds;
    assert!(after <= before + 2, "worker fds grew from {before} to {after}");
}

#[test]
fn accept_errors_back_off_instead_of_spinning_and_service_resumes() {
    // Workers inherit the daemon's descriptor limit: a low one lets a
    // tenant exhaust it with a few dozen connections.
    let m = Mediator::start_limited(&[], 48);
    let evil = m.tenant_with(json!({ "name": "evil", "memory": "16MiB", "max_connections": 1000, "host_memory": "1GiB" }));
    let good = m.tenant("good", "16MiB");
    let pid = m.serving_pid("cpu0", "evil");
    let sock = std::path::PathBuf::from(evil["socket"].as_str().expect("socket"));
    let mut held = Vec::new();
    for _ in 0..60 {
        held.push(std::os::unix::net::UnixStream::connect(&sock).expect("connect"));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(proc_stats(pid).fds >= 40, "the worker did not run out of descriptors: {:?}", proc_stats(pid));
    // With connections waiting that cannot be accepted (EMFILE), the accept
    // loop used to retry at once, burning a whole core.
    let t0 = proc_stats(pid).cpu_ticks;
    std::thread::sleep(Duration::from_secs(2));
    let used = proc_stats(pid).cpu_ticks - t0;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    assert!(used < hz / 2, "worker used {used} ticks of CPU in 2 s while out of descriptors");
    drop(held);
    // Once descriptors are free again, the other tenant is served.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut r = Raw::connect(&good);
        if r.ping() {
            break;
        }
        assert!(Instant::now() < deadline, "the other tenant was not served again");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(m.device("cpu0")["worker_restarts"], 0);
}

#[test]
fn connections_beyond_the_tenants_limit_are_refused() {
    let m = Mediator::start(&[]);
    let v = m.tenant_with(json!({ "name": "few", "memory": "16MiB", "max_connections": 4 }));
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    let mut open: Vec<Raw> = (0..4).map(|_| Raw::connect(&sock)).collect();
    for r in &mut open {
        assert!(r.ping());
    }
    let mut fifth = Raw::connect(&sock);
    match fifth.read_reply() {
        Some((_, Reply::Error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, msg))) => assert!(msg.contains("connections"), "{msg}"),
        other => panic!("the fifth connection was not refused: {other:?}"),
    }
    assert!(fifth.read_reply().is_none());
    // Closing one makes room again.
    drop(open.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !Raw::connect(&sock).ping() {
        assert!(Instant::now() < deadline, "no room after a connection closed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn host_used(m: &Mediator, name: &str) -> u64 {
    let (_, v) = m.api("GET", &format!("/tenants/{name}"), None);
    v["usage"]["host_used"].as_u64().expect("host_used")
}

#[test]
fn modules_and_events_are_charged_to_the_host_budget() {
    let log = vgpu_tests::per_process("hoarder.log");
    let m = Mediator::start_logging(&[], &log);
    let v = m.tenant_with(json!({ "name": "hoarder", "memory": "16MiB", "host_memory": "4MiB" }));
    assert_eq!(v["host_memory"], 4 << 20);
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    let mut r = Raw::connect(&sock);
    let ctx = r.ctx();
    let base = host_used(&m, "hoarder");
    assert!(base > 0, "a connection and a context are charged");
    // A module of 4000 instructions: its parse needs ~1 MiB for a moment
    // and keeps a few hundred KiB. Loading it again and again must stop at
    // the budget, not grow the worker.
    let body = "\tadd.u32 %r1, %r1, 1;\n".repeat(4_000);
    let ptx = format!(".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry big() {{\n .reg .b32 %r<2>;\n{body} ret;\n}}\n");
    let mut modules = Vec::new();
    let refusal = loop {
        match r.load(ctx, &ptx) {
            Reply::Handle(h) => modules.push(h),
            Reply::Error(code, msg) => break (code, msg),
            other => panic!("{other:?}"),
        }
        assert!(modules.len() < 64, "64 modules loaded under a 4 MiB host budget");
    };
    assert_eq!(refusal.0, CuResult::CUDA_ERROR_OUT_OF_MEMORY, "{}", refusal.1);
    assert!(refusal.1.contains("host"), "{}", refusal.1);
    let full = host_used(&m, "hoarder");
    assert!(full <= 4 << 20 && full > base + (1 << 20), "host_used {full}");
    let metric = m.metric("vgpu_tenant_host_memory_bytes", "tenant=\"hoarder\",device=\"cpu0\"").expect("metric");
    assert_eq!(metric as u64, full);
    // The refusal is counted and logged, so an operator can tell it from
    // a fault (a library may drop the error it got).
    let refusals = || m.metric("vgpu_tenant_host_memory_refusals_total", "tenant=\"hoarder\",device=\"cpu0\"").expect("refusals metric") as u64;
    assert_eq!(refusals(), 1);
    let show = String::from_utf8(m.vgpuctl().args(["tenant", "show", "hoarder"]).output().expect("vgpuctl").stdout).unwrap();
    assert!(show.contains("(1 requests refused)"), "{show}");
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(logged.contains("hoarder") && logged.contains("host budget (4194304 bytes, its host_memory) refused a request"), "{logged}");
    // One function handle per kernel, however often it is looked up.
    let first = r.function(ctx, modules[0], "big");
    let Reply::Function(f, _) = first else { panic!("{first:?}") };
    let with_one = host_used(&m, "hoarder");
    for _ in 0..2000 {
        match r.function(ctx, modules[0], "big") {
            Reply::Function(g, _) => assert_eq!(g.func, f.func),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(host_used(&m, "hoarder"), with_one);
    // Unloading gives the budget back.
    for h in modules {
        assert!(matches!(r.call(Request::ModuleUnload(ModuleReq { ctx, module: h })), Reply::Empty));
    }
    assert!(host_used(&m, "hoarder") < base + 4096);
    // Events stop at the budget long before the per-context table limit.
    let mut events = 0;
    loop {
        match r.event(ctx) {
            Reply::Handle(_) => events += 1,
            Reply::Error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, msg) => {
                assert!(msg.contains("host budget"), "{msg}");
                break;
            }
            other => panic!("{other:?}"),
        }
        assert!(events < 65536, "events were never charged");
    }
    assert_eq!(refusals(), 2);
    assert!(host_used(&m, "hoarder") <= 4 << 20);
    // The connection closing releases everything its contexts held.
    drop(r);
    let deadline = Instant::now() + Duration::from_secs(5);
    while host_used(&m, "hoarder") != 0 {
        assert!(Instant::now() < deadline, "host budget not released: {}", host_used(&m, "hoarder"));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_payload_larger_than_the_host_budget_is_refused_before_it_is_read() {
    let m = Mediator::start(&[]);
    let v = m.tenant_with(json!({ "name": "bulk", "memory": "64MiB", "host_memory": "8MiB" }));
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    let mut r = Raw::connect(&sock);
    let mut h = Vec::new();
    MsgHeader { magic: MAGIC, version: VERSION, opcode: Opcode::MemcpyHtoD as u16, seq: 9, status: 0, payload_len: 16 << 20, reserved: 0 }.put(&mut h);
    r.send_bytes(&h).expect("send");
    match r.read_reply() {
        Some((hdr, Reply::Error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, msg))) => {
            assert_eq!(hdr.seq, 9);
            assert!(msg.contains("host budget"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    assert!(r.read_reply().is_none(), "the connection closes: its framing is lost");
    assert!(Raw::connect(&sock).ping(), "the tenant is still served");
}

/// A sealed memfd of `size` bytes, as the shim makes for its shared buffer.
fn sealed_memfd(size: u64) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create with a static name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: fd is the fresh memfd; ftruncate and fcntl only size and seal it.
    unsafe {
        assert_eq!(libc::ftruncate(fd, size as i64), 0);
        assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
        std::os::fd::OwnedFd::from_raw_fd(fd)
    }
}

#[test]
fn a_shared_buffer_is_charged_while_it_is_registered() {
    let m = Mediator::start(&[]);
    let v = m.tenant_with(json!({ "name": "shm", "memory": "16MiB", "host_memory": "8MiB" }));
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    let mut r = Raw::connect(&sock);
    let register = |r: &mut Raw, size: u64, seq: u32| {
        let fd = sealed_memfd(size);
        send_with_fds(&r.s, &Request::RegisterShm(RegisterShmReq { size, id: 0, flags: 0 }).encode(seq), &[fd.as_raw_fd()]).expect("send");
        r.read_reply().expect("reply").1
    };
    // Larger than the whole budget: refused, nothing mapped.
    match register(&mut r, 16 << 20, 1) {
        Reply::Error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, msg) => assert!(msg.contains("shared buffer"), "{msg}"),
        other => panic!("{other:?}"),
    }
    let before = host_used(&m, "shm");
    assert!(matches!(register(&mut r, 4 << 20, 2), Reply::Empty));
    assert_eq!(host_used(&m, "shm"), before + (4 << 20));
    // Replacing it releases the old charge.
    assert!(matches!(register(&mut r, 2 << 20, 3), Reply::Empty));
    assert_eq!(host_used(&m, "shm"), before + (2 << 20));
}

#[test]
fn connections_cost_no_threads_and_a_stalled_reader_does_not_block_others() {
    let m = Mediator::start(&[]);
    let v = m.tenant_with(json!({ "name": "many", "memory": "64MiB", "max_connections": 200 }));
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    let good = m.tenant("other", "16MiB");
    let pid = m.serving_pid("cpu0", "many");
    let base = proc_stats(pid).threads;
    let mut open: Vec<Raw> = (0..150).map(|_| Raw::connect(&sock)).collect();
    for r in open.iter_mut() {
        assert!(r.ping());
    }
    // A fixed pool serves them all: one thread per connection used to
    // make 150 threads here.
    assert!(proc_stats(pid).threads <= base + 1, "{} threads for 150 connections (base {base})", proc_stats(pid).threads);
    // Clients of more tenants than there are executors (4) ask for 4 MiB
    // replies and never read them: no executor waits on them (the poller
    // writes replies as sockets drain), so the other tenant is answered
    // at once.
    let mut stalled = Vec::new();
    for k in 0..6 {
        let v = m.tenant_with(json!({ "name": format!("stall{k}"), "memory": "8MiB" }));
        let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
        let mut r = Raw::connect(&sock);
        let ctx = r.ctx();
        let Reply::Ptr(p) = r.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4 << 20 })) else { panic!("alloc") };
        for _ in 0..3 {
            let mut s = Raw::connect(&sock);
            let c = s.ctx();
            let req = MemcpyDtoHReq { ctx: c, stream: 0, src: p, size: 4 << 20, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 };
            s.seq_bump();
            s.send_bytes(&Request::MemcpyDtoH(req).encode(50)).expect("send");
            stalled.push(s);
        }
        stalled.push(r);
    }
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..5 {
        let t = Instant::now();
        assert!(Raw::connect(&good).ping());
        assert!(t.elapsed() < Duration::from_secs(2), "the other tenant waited {:?}", t.elapsed());
    }
    drop(stalled);
    drop(open);
}
