//! Deleting a tenant revokes it everywhere at once, releases its memory,
//! and only then frees its quota; a busy tenant never blocks the admin
//! API; tenant socket names cannot collide.

use std::time::{Duration, Instant};

use serde_json::json;
use vgpu_tests::*;
use virtio_gpu_compute::*;

#[test]
fn deleting_a_tenant_revokes_its_connections_then_frees_its_quota() {
    let m = Mediator::start(&["--device-memory", "128MiB"]);
    let sock = m.tenant("gone", "96MiB");
    let mut r = Raw::connect(&sock);
    let ctx = r.ctx();
    assert!(matches!(r.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 64 << 20 })), Reply::Ptr(_)));
    // Its quota is reserved: no room for another 96 MiB tenant.
    let (st, _) = m.api("POST", "/tenants", Some(json!({ "name": "next", "memory": "96MiB" })));
    assert_eq!(st, 507);
    let (st, _) = m.api("DELETE", "/tenants/gone", None);
    assert_eq!(st, 204, "an idle tenant is released within the wait");
    // The live connection is closed, and the socket is gone.
    r.seq_bump();
    let _ = r.send_bytes(&Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 1 << 20 }).encode(99));
    match r.read_reply() {
        None => {}
        Some((_, Reply::Error(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, _))) => {}
        other => panic!("a deleted tenant's connection was still served: {other:?}"),
    }
    assert!(std::os::unix::net::UnixStream::connect(&sock).is_err());
    let d = m.device("cpu0");
    assert_eq!((d["memory_reserved"].as_u64(), d["memory_allocated"].as_u64()), (Some(0), Some(0)));
    // Now the quota is free for others.
    m.tenant("next", "96MiB");
}

#[test]
fn a_busy_tenant_never_blocks_the_admin_api() {
    // A kernel that spins until the 6 s launch limit holds its tenant.
    let m = Mediator::start(&["--instruction-budget", "0", "--launch-timeout-ms", "6000"]);
    let busy = m.tenant("busy", "16MiB");
    m.tenant("other", "16MiB");
    let spinner = std::thread::spawn(move || {
        let mut r = Raw::connect(&busy);
        let ctx = r.ctx();
        let module = Raw::handle(r.load(ctx, &faults_ptx()));
        let Reply::Function(f, _) = r.function(ctx, module, "spin") else { panic!("no spin") };
        r.seq_bump();
        let req = LaunchReq { ctx, func: f.func, stream: 0, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 0, reserved: 0 };
        let _ = r.send_bytes(&Request::LaunchKernel(req, Vec::new()).encode(77));
        r.read_reply()
    });
    std::thread::sleep(Duration::from_millis(700));
    let api = m.api_path();
    let deleter = std::thread::spawn(move || {
        let t = Instant::now();
        let r = vgpu_api::http::request(&api, "DELETE", "/tenants/busy", None).expect("delete");
        (r.status, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    // While the deletion waits on the busy tenant, every other call answers.
    for (method, path, body) in
        [("GET", "/devices", None), ("GET", "/tenants", None), ("GET", "/metrics", None), ("GET", "/tenants/other", None), ("POST", "/tenants", Some(json!({ "name": "third", "memory": "16MiB" })))]
    {
        let t = Instant::now();
        let (st, v) = m.api(method, path, body);
        assert!(st < 300, "{method} {path}: {st} {v}");
        assert!(t.elapsed() < Duration::from_secs(3), "{method} {path} took {:?} while a tenant was being deleted", t.elapsed());
    }
    // The busy tenant is already revoked: listed as deleting.
    let (_, v) = m.api("GET", "/tenants/busy", None);
    assert_eq!(v["state"], "deleting", "{v}");
    let (status, took) = deleter.join().expect("deleter");
    assert!(status == 204 || status == 202, "{status}");
    let launched = spinner.join().expect("spinner");
    assert!(matches!(launched, None | Some((_, Reply::Error(CuResult::CUDA_ERROR_LAUNCH_TIMEOUT | CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, _)))), "{launched:?}");
    // Once the launch stopped, the teardown finished and the record went.
    let deadline = Instant::now() + Duration::from_secs(15);
    while m.api("GET", "/tenants/busy", None).0 != 404 {
        assert!(Instant::now() < deadline, "tenant busy never finished deleting (DELETE took {took:?})");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(m.device("cpu0")["worker_restarts"], 0);
}

#[test]
fn process_and_vm_tenant_sockets_cannot_collide() {
    let m = Mediator::start(&[]);
    let (st, vm) = m.api("POST", "/tenants", Some(json!({ "name": "x", "memory": "16MiB", "kind": "vm" })));
    assert_eq!(st, 201, "{vm}");
    let (st, p) = m.api("POST", "/tenants", Some(json!({ "name": "x.vhost", "memory": "16MiB" })));
    assert_eq!(st, 201, "{p}");
    assert_ne!(vm["socket"], p["socket"]);
    assert!(Raw::connect(std::path::Path::new(p["socket"].as_str().expect("socket"))).ping());
    assert!(std::path::Path::new(vm["socket"].as_str().expect("socket")).exists(), "the VM socket is still there");
}

#[test]
fn a_vm_tenant_socket_keeps_its_owner_across_vmm_connections_and_its_threads_end_on_deletion() {
    use std::os::unix::fs::MetadataExt;
    // Shared isolation: the tenant's threads live in the device's worker,
    // which stays; under process isolation the executor goes whole
    // (executors.rs).
    let m = Mediator::start(&["--isolation", "shared"]);
    let pid = m.worker_pid("cpu0");
    let base = proc_stats(pid).threads;
    let (st, v) = m.api("POST", "/tenants", Some(json!({ "name": "vm1", "memory": "16MiB", "kind": "vm", "owner": "4242:4242" })));
    assert_eq!(st, 201, "{v}");
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    let ino = std::fs::metadata(&sock).expect("socket").ino();
    // Three VMM connections come and go (a VMM that dies or restarts).
    for _ in 0..3 {
        let c = std::os::unix::net::UnixStream::connect(&sock).expect("connect");
        std::thread::sleep(Duration::from_millis(100));
        drop(c);
        std::thread::sleep(Duration::from_millis(100));
    }
    let meta = std::fs::metadata(&sock).expect("socket");
    assert_eq!((meta.ino(), meta.uid(), meta.gid(), meta.mode() & 0o777), (ino, 4242, 4242, 0o600), "the socket was replaced or lost its owner");
    // Deleting the idle VM tenant ends its threads, not only its socket.
    let (st, _) = m.api("DELETE", "/tenants/vm1", None);
    assert_eq!(st, 204);
    let deadline = Instant::now() + Duration::from_secs(5);
    while proc_stats(pid).threads > base {
        assert!(Instant::now() < deadline, "{} threads left after deleting the VM tenant (base {base})", proc_stats(pid).threads);
        std::thread::sleep(Duration::from_millis(50));
    }
}
