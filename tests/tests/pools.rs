//! Pools (private allow-lists, pack and spread placement, NUMA preference
//! on a fake two-node host) and memory overcommit with its host spill.

use serde_json::{json, Value};
use vgpu_tests::*;
use virtio_gpu_compute::{CuResult, DataLoc, MemAllocReq, MemFreeReq, MemcpyDtoDReq, MemcpyDtoHReq, MemcpyHtoDReq, MemsetReq, Reply, Request};

const MIB: u64 = 1 << 20;

fn placed(m: &Mediator, spec: Value) -> String {
    let (st, v) = m.api("POST", "/tenants", Some(spec.clone()));
    assert_eq!(st, 201, "{spec} -> {v}");
    v["device"].as_str().expect("device").to_string()
}

fn refused(m: &Mediator, spec: Value, status: u16, why: &str) {
    let (st, v) = m.api("POST", "/tenants", Some(spec.clone()));
    assert_eq!(st, status, "{spec} -> {v}");
    let msg = v["error"].as_str().unwrap_or("");
    assert!(msg.contains(why), "{spec}: wanted {why:?} in {msg:?}");
}

#[test]
fn pools_admit_by_allow_list_place_by_policy_and_prefer_the_tenants_numa_node() {
    let root = std::env::temp_dir().join(format!("vgpu-fake-numa-{}", std::process::id()));
    fake_numa_host(&root, 2);
    let config = root.join("pools.toml");
    std::fs::write(&config, "[[pools]]\nname = \"gold\"\ndevices = [\"cpu0\", \"cpu1\"]\naccess = \"private\"\nallow = [\"alice\", \"alice2\", \"carol\"]\nplacement = \"pack\"\n").unwrap();
    let m = Mediator::start_on_topology(&["--isolation", "shared", "--cpu-devices", "5", "--device-memory", "64MiB", "--lanes", "1", "--spill", "64MiB", "--config", config.to_str().unwrap()], &root);

    // CPU devices alternate between the two fake nodes.
    let (_, devs) = m.api("GET", "/devices", None);
    let node: Vec<i64> = devs.as_array().unwrap().iter().map(|d| d["numa_node"].as_i64().unwrap()).collect();
    assert_eq!(node, [0, 1, 0, 1, 0], "{devs}");
    let pool_of: Vec<&str> = devs.as_array().unwrap().iter().map(|d| d["pool"].as_str().unwrap()).collect();
    assert_eq!(pool_of, ["gold", "gold", "default", "default", "default"]);

    // A private pool refuses a tenant not on its list, by pool or by
    // naming one of its devices, and through vgpuctl with the reason.
    refused(&m, json!({"name": "bob", "memory": "1MiB", "pool": "gold"}), 403, "not on its allow-list");
    refused(&m, json!({"name": "bob", "memory": "1MiB", "device": "cpu1"}), 403, "not on its allow-list");
    let out = m.vgpuctl().args(["tenant", "create", "bob", "--memory", "1MiB", "--pool", "gold"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pool gold is private and tenant bob is not on its allow-list"), "{out:?}");
    refused(&m, json!({"name": "bob", "memory": "1MiB", "pool": "platinum"}), 404, "no pool named platinum");
    refused(&m, json!({"name": "bob", "memory": "1MiB", "pool": "gold", "device": "cpu2"}), 403, "allow-list");
    refused(&m, json!({"name": "alice", "memory": "1MiB", "pool": "gold", "device": "cpu2"}), 400, "device cpu2 is not in pool gold");

    // Pack: alice and alice2 share cpu0; carol does not fit beside them.
    assert_eq!(placed(&m, json!({"name": "alice", "memory": "16MiB", "pool": "gold"})), "cpu0");
    assert_eq!(placed(&m, json!({"name": "alice2", "memory": "16MiB", "pool": "gold"})), "cpu0");
    assert_eq!(placed(&m, json!({"name": "carol", "memory": "48MiB", "pool": "gold"})), "cpu1");

    // A pool made live, public, spreading and overcommitted.
    let out = m.vgpuctl().args(["pool", "create", "silver", "--device", "cpu2", "--device", "cpu3", "--placement", "spread", "--overcommit", "2"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    // Spread on node 1: its one device, though cpu2 on node 0 is as free.
    assert_eq!(placed(&m, json!({"name": "n1a", "memory": "40MiB", "pool": "silver", "numa_node": 1})), "cpu3");
    assert_eq!(placed(&m, json!({"name": "n1b", "memory": "40MiB", "pool": "silver", "numa_node": 1})), "cpu3");
    // Without a node, spread takes the freer device.
    assert_eq!(placed(&m, json!({"name": "any", "memory": "8MiB", "pool": "silver"})), "cpu2");
    // Node 1 is now short of room (128 MiB capacity, 80 placed): node 0 then.
    assert_eq!(placed(&m, json!({"name": "n1c", "memory": "64MiB", "pool": "silver", "numa_node": 1})), "cpu2");
    // Overcommit lets quotas exceed the device's 64 MiB, never what one
    // device holds (memory and spill) for a single tenant.
    refused(&m, json!({"name": "huge", "memory": "200MiB", "pool": "silver"}), 507, "more than any device in pool silver can hold");
    refused(&m, json!({"name": "late", "memory": "64MiB", "pool": "silver"}), 507, "no device in pool silver has");

    // Tenants without a pool go to the default one, spread.
    assert_eq!(placed(&m, json!({"name": "d1", "memory": "32MiB"})), "cpu4");

    // Pool changes and their refusals.
    let (st, v) = m.api("PATCH", "/pools/gold", Some(json!({"allow": ["alice", "alice2", "carol", "bob"]})));
    assert_eq!(st, 200, "{v}");
    assert_eq!(placed(&m, json!({"name": "bob", "memory": "1MiB", "pool": "gold"})), "cpu1", "pack: the fuller device");
    // Dropped from the list, bob keeps its place but cannot grow there.
    let (st, v) = m.api("PATCH", "/pools/gold", Some(json!({"allow": ["alice", "alice2", "carol"]})));
    assert_eq!(st, 200, "{v}");
    let (st, v) = m.api("PATCH", "/tenants/bob", Some(json!({"memory": "2MiB"})));
    assert_eq!(st, 403, "{v}");
    assert_eq!(m.api("PATCH", "/tenants/bob", Some(json!({"weight": 2}))).0, 200, "other changes still work");
    let (st, v) = m.api("PATCH", "/pools/silver", Some(json!({"overcommit": 1.0})));
    assert_eq!(st, 409, "quotas placed exceed the lower capacity: {v}");
    let (st, v) = m.api("POST", "/pools", Some(json!({"name": "x", "devices": ["cpu4"]})));
    assert_eq!(st, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("holds tenants (d1)"), "{v}");
    let (st, v) = m.api("POST", "/pools", Some(json!({"name": "x", "devices": ["cpu1"]})));
    assert_eq!(st, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("already in pool gold"), "{v}");
    let (st, v) = m.api("POST", "/pools", Some(json!({"name": "x", "devices": ["gpu7"]})));
    assert_eq!(st, 400, "{v}");
    let (st, v) = m.api("POST", "/pools", Some(json!({"name": "x", "devices": ["cpu4"], "allow": ["a"]})));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("only applies to a private pool"), "{v}");
    let (st, _) = m.api("DELETE", "/pools/silver", None);
    assert_eq!(st, 409, "a pool with tenants stays");

    // vgpuctl shows the pools.
    let out = m.vgpuctl().args(["pool", "show", "gold"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("private") && text.contains("pack") && text.contains("alice, alice2") && text.contains("cpu0, cpu1"), "{text}");
    let out = m.vgpuctl().args(["pool", "list"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("silver") && text.contains("spread") && text.contains("default"), "{text}");

    // Emptied, silver goes and its devices rejoin the default pool.
    for t in ["n1a", "n1b", "any", "n1c"] {
        assert_eq!(m.api("DELETE", &format!("/tenants/{t}"), None).0, 204);
    }
    let out = m.vgpuctl().args(["pool", "delete", "silver"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(m.device("cpu3")["pool"], "default");
    let (st, _) = m.api("DELETE", "/pools/default", None);
    assert_eq!(st, 400);
    // MPS is NVIDIA's: a pool of CPU devices cannot share by it.
    let (st, v) = m.api("POST", "/pools", Some(serde_json::json!({ "name": "mps", "devices": ["cpu3"], "sharing": "mps" })));
    assert_eq!(st, 400, "{v}");
    assert!(v.to_string().contains("cpu3 is a CPU device"), "{v}");
    let out = m.vgpuctl().args(["pool", "create", "spatial", "--device", "cpu3", "--sharing", "mps"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("CPU device"), "{out:?}");
    let out = m.vgpuctl().args(["pool", "show", "default"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("sharing:    time-sliced"), "{out:?}");
    let _ = std::fs::remove_dir_all(&root);
}

/// Adds one to each of the first 1024 words at the pointer.
const INC_PTX: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry inc(.param .u64 p) {\n .reg .pred %p1;\n .reg .b32 %r<6>;\n .reg .b64 %rd<4>;\n ld.param.u64 %rd1, [p];\n mov.u32 %r2, %ctaid.x;\n mov.u32 %r3, %ntid.x;\n mov.u32 %r4, %tid.x;\n mad.lo.s32 %r2, %r2, %r3, %r4;\n setp.ge.u32 %p1, %r2, 1024;\n @%p1 bra DONE;\n mul.wide.u32 %rd2, %r2, 4;\n add.s64 %rd3, %rd1, %rd2;\n ld.global.u32 %r5, [%rd3];\n add.s32 %r5, %r5, 1;\n st.global.u32 [%rd3], %r5;\nDONE:\n ret;\n}\n";

struct Client {
    r: Raw,
    ctx: u32,
}

impl Client {
    fn new(socket: &std::path::Path) -> Client {
        let mut r = Raw::connect(socket);
        let ctx = r.ctx();
        Client { r, ctx }
    }
    fn alloc(&mut self, size: u64) -> Reply {
        self.r.call(Request::MemAlloc(MemAllocReq { ctx: self.ctx, reserved: 0, size }))
    }
    fn ptr(&mut self, size: u64) -> u64 {
        match self.alloc(size) {
            Reply::Ptr(p) => p,
            other => panic!("allocating {size}: {other:?}"),
        }
    }
    fn free(&mut self, dptr: u64) {
        assert!(matches!(self.r.call(Request::MemFree(MemFreeReq { ctx: self.ctx, reserved: 0, dptr })), Reply::Empty));
    }
    fn write(&mut self, dst: u64, data: &[u8]) {
        let req = MemcpyHtoDReq { ctx: self.ctx, stream: 0, dst, size: data.len() as u64, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 };
        assert!(matches!(self.r.call(Request::MemcpyHtoD(req, data.to_vec())), Reply::Empty));
    }
    fn read(&mut self, src: u64, size: u64) -> Vec<u8> {
        let req = MemcpyDtoHReq { ctx: self.ctx, stream: 0, src, size, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 };
        match self.r.call(Request::MemcpyDtoH(req)) {
            Reply::Data(d) => d,
            other => panic!("reading: {other:?}"),
        }
    }
    fn inc(&mut self, p: u64) {
        let module = Raw::handle(self.r.load(self.ctx, INC_PTX));
        let func = match self.r.function(self.ctx, module, "inc") {
            Reply::Function(f, _) => f.func,
            other => panic!("{other:?}"),
        };
        assert!(matches!(self.r.launch(self.ctx, func, [4, 1, 1], [256, 1, 1], &p.to_le_bytes()), Reply::Empty));
    }
}

fn pattern(seed: u32) -> Vec<u8> {
    (0..1024u32).flat_map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).to_le_bytes()).collect()
}

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn overcommitted_tenants_spill_to_host_ram_get_their_data_back_and_see_oom_past_the_budget() {
    let m = Mediator::start(&["--isolation", "shared", "--cpu-devices", "1", "--device-memory", "64MiB", "--spill", "32MiB", "--overcommit", "2", "--lanes", "1"]);
    // Quotas add up to twice the device's memory.
    let (sa, sb) = (m.tenant("a", "64MiB"), m.tenant("b", "64MiB"));
    refused(&m, json!({"name": "c", "memory": "1MiB"}), 507, "no device in pool default has");
    let (mut a, mut b) = (Client::new(&sa), Client::new(&sb));
    let a1 = a.ptr(40 * MIB);
    let b1 = b.ptr(24 * MIB);
    // Device memory is full: the next allocations land in host RAM.
    let b2 = b.ptr(16 * MIB);
    let a2 = a.ptr(16 * MIB);
    let spilled = |m: &Mediator, t: &str| m.metric("vgpu_tenant_memory_spilled_bytes", &format!("tenant=\"{t}\""));
    assert_eq!((spilled(&m, "a"), spilled(&m, "b")), (Some((16 * MIB) as f64), Some((16 * MIB) as f64)));
    assert_eq!(m.metric("vgpu_device_spilled_bytes", "device=\"cpu0\""), Some((32 * MIB) as f64));
    assert_eq!(m.device("cpu0")["memory_spilled"], 32 * MIB);
    // Both budgets are spent: the tenant that asks gets OUT_OF_MEMORY,
    // though it is under its quota, and nobody loses anything.
    match a.alloc(MIB) {
        Reply::Error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, msg) => assert!(msg.contains("spill budget has 0 of"), "{msg}"),
        other => panic!("expected OUT_OF_MEMORY, got {other:?}"),
    }
    // cuMemGetInfo tells it so: nothing free, though its quota has 8 MiB left.
    match a.r.call(Request::MemGetInfo) {
        Reply::MemInfo(i) => assert_eq!((i.free, i.total), (0, 64 * MIB)),
        other => panic!("{other:?}"),
    }
    // A quota shrinks only down to what is allocated, so what it gives
    // back is really free.
    let (st, v) = m.api("PATCH", "/tenants/b", Some(json!({"memory": "8MiB", "weight": 8})));
    assert_eq!(st, 409, "{v}");
    assert!(v["error"].as_str().unwrap_or("").contains("must free below"), "{v}");
    // A refused change changes nothing, in the registry or the worker.
    let (_, v) = m.api("GET", "/tenants/b", None);
    assert_eq!((v["weight"].as_u64(), v["usage"]["weight"].as_u64(), v["memory"].as_u64()), (Some(1), Some(1), Some(64 * MIB)), "{v}");
    let (st, v) = m.api("PATCH", "/tenants/b", Some(json!({"memory": "48MiB"})));
    assert_eq!(st, 200, "{v}");
    assert!(matches!(b.alloc(16 * MIB), Reply::Error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, _)));
    // Spilled memory works like any other: copies and kernels.
    b.write(b2, &pattern(1));
    a.write(a2, &pattern(2));
    b.write(b2 + 8 * MIB, &pattern(3));
    a.write(a1, &pattern(4));
    b.inc(b2);
    let want_b2: Vec<u32> = words(&pattern(1)).iter().map(|w| w.wrapping_add(1)).collect();
    assert_eq!(words(&b.read(b2, 4096)), want_b2);
    let out = m.vgpuctl().args(["tenant", "show", "b"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("16MiB spilled to host RAM"), "{out:?}");

    // Held spilled for a while, so the meter integrates it.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(spilled(&m, "b").is_some_and(|v| v > 0.0));

    // a frees device memory: the spills come back, oldest first, data intact.
    a.free(a1);
    assert_eq!((spilled(&m, "a"), spilled(&m, "b")), (Some(0.0), Some(0.0)));
    assert_eq!(m.metric("vgpu_device_spilled_bytes", "device=\"cpu0\""), Some(0.0));
    assert_eq!(words(&b.read(b2, 4096)), want_b2);
    assert_eq!(b.read(b2 + 8 * MIB, 4096), pattern(3));
    assert_eq!(a.read(a2, 4096), pattern(2));
    a.inc(a2);
    assert_eq!(words(&a.read(a2, 4096)), words(&pattern(2)).iter().map(|w| w.wrapping_add(1)).collect::<Vec<_>>());
    let _ = b1;
    // The usage records carry spilled byte-seconds.
    assert!(m.metric("vgpu_tenant_spilled_byte_seconds_total", "tenant=\"b\"").is_some_and(|v| v > 0.0));
}

/// Security finding: in a fully backed pool, one tenant's 512 bytes placed
/// mid-arena used to deny another tenant, holding nothing, its whole quota
/// in one allocation ("device has no free range" with 128 MiB free). Each
/// tenant now has its own address window, mapped onto any free granules.
#[test]
fn a_neighbours_small_allocation_cannot_fragment_a_fully_backed_quota_away() {
    let m = Mediator::start(&["--isolation", "shared", "--cpu-devices", "1", "--device-memory", "64MiB", "--spill", "64MiB", "--overcommit", "2", "--lanes", "1"]);
    let (sa, sb) = (m.tenant("a", "64MiB"), m.tenant("b", "64MiB"));
    let (mut a, mut b) = (Client::new(&sa), Client::new(&sb));
    // b fills device memory but one granule; a's 512 bytes go right after,
    // in the middle of the 128 MiB arena; b lets go of everything.
    let lower = b.ptr(64 * MIB - 256);
    let small = a.ptr(512);
    a.write(small, &[0xA5; 512]);
    b.free(lower);
    // Every free run is now 64 MiB - 256 bytes: b's whole quota, in one piece.
    let big = b.ptr(64 * MIB);
    assert_eq!(m.metric("vgpu_tenant_memory_spilled_bytes", "tenant=\"b\""), Some((64 * MIB) as f64), "it spills, counted in bytes");
    // Its bytes lie in two runs of the arena, the seam 256 bytes before its
    // end: copies, memsets and kernels on its last 4 KiB cross it.
    let at = big + 64 * MIB - 4096;
    b.write(at, &pattern(7));
    assert_eq!(b.read(at, 4096), pattern(7));
    b.inc(at);
    let want: Vec<u32> = words(&pattern(7)).iter().map(|w| w.wrapping_add(1)).collect();
    assert_eq!(words(&b.read(at, 4096)), want);
    let copy = MemcpyDtoDReq { ctx: b.ctx, stream: 0, dst: big, src: at, size: 4096 };
    assert!(matches!(b.r.call(Request::MemcpyDtoD(copy)), Reply::Empty));
    assert_eq!(words(&b.read(big, 4096)), want);
    let copy = MemcpyDtoDReq { ctx: b.ctx, stream: 0, dst: at, src: big + 8192, size: 4096 };
    assert!(matches!(b.r.call(Request::MemcpyDtoD(copy)), Reply::Empty));
    assert_eq!(b.read(at, 4096), vec![0; 4096], "fresh memory is zeroed");
    let set = MemsetReq { ctx: b.ctx, stream: 0, dptr: at, value: 0x1234_5678, elem_size: 4, count: 1024 };
    assert!(matches!(b.r.call(Request::Memset(set)), Reply::Empty));
    assert_eq!(words(&b.read(at, 4096)), vec![0x1234_5678; 1024]);
    // The whole allocation holds what b writes, and a's bytes are untouched.
    let whole: Vec<u8> = (0..64 * MIB).map(|i| (i / 4096) as u8 ^ (i as u8)).collect();
    for (i, chunk) in whole.chunks(4 * MIB as usize).enumerate() {
        b.write(big + i as u64 * 4 * MIB, chunk);
    }
    for (i, chunk) in whole.chunks(4 * MIB as usize).enumerate() {
        assert!(b.read(big + i as u64 * 4 * MIB, 4 * MIB) == chunk, "chunk {i}");
    }
    assert_eq!(a.read(small, 512), vec![0xA5; 512]);
    // Isolation: a's allocation, in a's window, is not b's to touch.
    assert!(matches!(b.r.call(Request::MemcpyDtoH(MemcpyDtoHReq { ctx: b.ctx, stream: 0, src: small, size: 4, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 })), Reply::Error(..)));
    let module = Raw::handle(b.r.load(b.ctx, INC_PTX));
    let func = match b.r.function(b.ctx, module, "inc") {
        Reply::Function(f, _) => f.func,
        other => panic!("{other:?}"),
    };
    match b.r.launch(b.ctx, func, [4, 1, 1], [256, 1, 1], &small.to_le_bytes()) {
        Reply::Error(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, _) => {}
        other => panic!("expected ILLEGAL_ADDRESS, got {other:?}"),
    }
    assert_eq!(a.read(small, 512), vec![0xA5; 512]);
}
