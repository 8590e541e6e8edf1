//! CUDA graphs held by the vGPU (docs/cuda.md, "Graphs"): a captured
//! graph's runs of device work are built once on the device's side and
//! launched with one request each, run right, again and again, and are
//! metered kernel by kernel; bad graphs get clear errors, a graph cannot
//! reach memory freed since it was built, and a tenant cannot grow them
//! without bound. On the CPU device; tests/tests/gpu_cuda.rs runs the same
//! program on the GPU backend, where the executor makes CUDA graphs.

use serde_json::json;
use vgpu_tests::*;
use virtio_gpu_compute::*;

const BUMP: &str = ".version 7.0\n.target sm_70\n.address_size 64\n\
.visible .entry bump(.param .u64 p)\n{\n    .reg .u64 %rd<1>;\n    .reg .u32 %r<2>;\n\
    ld.param.u64 %rd0, [p];\n    ld.global.u32 %r0, [%rd0];\n    add.u32 %r1, %r0, 1;\n    st.global.u32 [%rd0], %r1;\n    ret;\n}\n";

/// A number after `key=` in `out`.
fn field(out: &str, key: &str) -> u64 {
    let at = out.find(&format!("{key}=")).unwrap_or_else(|| panic!("no {key} in {out}")) + key.len() + 1;
    out[at..].split(|c: char| !c.is_ascii_digit()).next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("bad {key} in {out}"))
}

#[test]
fn a_captured_graph_runs_right_with_one_request_per_run_of_device_work() {
    let m = Mediator::start(&[]);
    let sock = m.tenant("grapher", "16MiB");
    let (k, n) = (8, 40);
    let out = run_ok(sample("tenant_probe", &sock).args(["graph", &k.to_string(), &n.to_string()]));
    assert!(out.contains(&format!("graph kernels={} counter={} copied=7 host=7 ", 2 * k * n, 2 * k * n)), "{out}");
    // Each launch is two graphs held by the device and, between them, the
    // copy to host memory: three ring entries, where the 2*K+3 pieces
    // sent one by one would take 19. The synchronize adds a few.
    let entries = field(&out, "ring_entries");
    assert!(entries <= 3 * n + 8, "{entries} ring entries for {n} launches of a graph of {} pieces:\n{out}", 2 * k + 3);
    assert!(out.contains("after_destroy=CUDA_ERROR_INVALID_HANDLE"), "{out}");
    // Launched into a capturing stream, it is recorded there, whole.
    assert!(out.contains(&format!("captured_launch={}\n", 2 * k)), "{out}");
    // Every kernel of every launch is metered.
    let kernels = m.metric("vgpu_tenant_kernels_total", "tenant=\"grapher\",device=\"cpu0\"").expect("kernels metric");
    assert!(kernels >= (2 * k * n) as f64, "{kernels} kernels metered");
}

/// A graph's nodes: `count` bumps of the u32 at `p`.
fn bumps(func: u32, p: u64, count: usize) -> Vec<GraphNode> {
    let k = GraphKernel { func, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 8, reserved: 0 };
    (0..count).map(|_| GraphNode::Kernel(k, p.to_le_bytes().to_vec())).collect()
}

fn create(r: &mut Raw, ctx: u32, nodes: Vec<GraphNode>) -> Reply {
    r.call(Request::GraphCreate(GraphCreateReq { ctx, count: 0, nodes_len: 0, reserved: 0 }, nodes))
}

fn launch(r: &mut Raw, ctx: u32, graph: u32) -> Reply {
    r.call(Request::GraphLaunch(GraphLaunchReq { ctx, stream: DEFAULT_STREAM, graph, reserved: 0 }))
}

fn read_u32(r: &mut Raw, ctx: u32, p: u64) -> u32 {
    match r.call(Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream: 0, src: p, size: 4, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 })) {
        Reply::Data(d) => u32::from_le_bytes(d[..4].try_into().expect("4 bytes")),
        other => panic!("{other:?}"),
    }
}

fn error(r: Reply, code: CuResult, says: &str) {
    match r {
        Reply::Error(c, msg) => {
            assert_eq!(c, code, "{msg}");
            assert!(msg.contains(says), "'{msg}' does not say '{says}'");
        }
        other => panic!("expected {code} ({says}), got {other:?}"),
    }
}

#[test]
fn bad_graphs_get_clear_errors_and_cannot_reach_freed_memory_or_grow_without_bound() {
    let m = Mediator::start(&[]);
    let v = m.tenant_with(json!({ "name": "graphs", "memory": "16MiB", "host_memory": "4MiB" }));
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    let mut r = Raw::connect(&sock);
    let ctx = r.ctx();
    let module = Raw::handle(r.load(ctx, BUMP));
    let func = match r.function(ctx, module, "bump") {
        Reply::Function(f, _) => f.func,
        other => panic!("{other:?}"),
    };
    let p = match r.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4096 })) {
        Reply::Ptr(p) => p,
        other => panic!("{other:?}"),
    };

    // A good graph runs, and runs again.
    let mut nodes = bumps(func, p, 3);
    nodes.push(GraphNode::Copy(GraphCopy { dst: p + 64, src: p, size: 4 }));
    let g = Raw::handle(create(&mut r, ctx, nodes));
    assert_eq!(launch(&mut r, ctx, g), Reply::Empty);
    assert_eq!(launch(&mut r, ctx, g), Reply::Empty);
    assert_eq!(read_u32(&mut r, ctx, p), 6);
    assert_eq!(read_u32(&mut r, ctx, p + 64), 6);

    // Each node is checked as its own request would be, and named.
    error(create(&mut r, ctx, bumps(func + 1000, p, 2)), CuResult::CUDA_ERROR_INVALID_HANDLE, "graph node 0: no function");
    let mut short = bumps(func, p, 2);
    short[1] = GraphNode::Kernel(GraphKernel { func, shared_bytes: 0, grid: [1; 3], block: [1; 3], params_len: 0, reserved: 0 }, vec![]);
    error(create(&mut r, ctx, short), CuResult::CUDA_ERROR_INVALID_VALUE, "graph node 1: 0 parameter bytes");
    let far = GraphNode::Memset(GraphMemset { dptr: p + 4096, value: 0, elem_size: 1, count: 1 });
    error(create(&mut r, ctx, vec![bumps(func, p, 1).remove(0), far]), CuResult::CUDA_ERROR_INVALID_VALUE, "graph node 1: memset range");
    let steal = GraphNode::Copy(GraphCopy { dst: p, src: 0x1000, size: 4 });
    error(create(&mut r, ctx, vec![steal]), CuResult::CUDA_ERROR_INVALID_VALUE, "graph node 0: copy source");
    error(create(&mut r, ctx + 77, bumps(func, p, 1)), CuResult::CUDA_ERROR_INVALID_CONTEXT, "no context");
    error(launch(&mut r, ctx, 9999), CuResult::CUDA_ERROR_INVALID_HANDLE, "no graph 9999");

    // Memory freed after the graph was built is not touched: the launch
    // fails, and a fresh allocation at the same place keeps its bytes.
    let q = match r.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4096 })) {
        Reply::Ptr(q) => q,
        other => panic!("{other:?}"),
    };
    let fill = GraphNode::Memset(GraphMemset { dptr: q, value: 0xAB, elem_size: 1, count: 4096 });
    let stale = Raw::handle(create(&mut r, ctx, vec![fill.clone(), fill]));
    assert_eq!(r.call(Request::MemFree(MemFreeReq { ctx, reserved: 0, dptr: q })), Reply::Empty);
    error(launch(&mut r, ctx, stale), CuResult::CUDA_ERROR_INVALID_VALUE, "freed since the graph was built");
    assert!(r.ping());

    // A destroyed graph is gone.
    assert_eq!(r.call(Request::GraphDestroy(HandleReq { ctx, handle: g })), Reply::Empty);
    error(launch(&mut r, ctx, g), CuResult::CUDA_ERROR_INVALID_HANDLE, "no graph");
    error(r.call(Request::GraphDestroy(HandleReq { ctx, handle: g })), CuResult::CUDA_ERROR_INVALID_HANDLE, "no graph");

    // Graphs are charged to the tenant's host budget: a tenant that keeps
    // building big ones is refused, clearly, and its other work goes on.
    let big: Vec<GraphNode> = (0..4096).map(|_| GraphNode::Kernel(GraphKernel { func, shared_bytes: 0, grid: [1; 3], block: [1; 3], params_len: 256, reserved: 0 }, vec![0; 256])).collect();
    let mut made = 0;
    let refused = loop {
        match create(&mut r, ctx, big.clone()) {
            Reply::Handle(_) => made += 1,
            other => break other,
        }
        assert!(made < 64, "4 MiB of host budget held {made} graphs of 4096 nodes");
    };
    error(refused, CuResult::CUDA_ERROR_OUT_OF_MEMORY, "host");
    assert!(made >= 1, "one 1.4 MiB graph fits a 4 MiB budget");
    assert!(matches!(r.launch(ctx, func, [1; 3], [1; 3], &p.to_le_bytes()), Reply::Empty));
    assert_eq!(read_u32(&mut r, ctx, p), 7);
    // Destroying the context gives the budget back.
    assert_eq!(r.call(Request::CtxDestroy(CtxReq { ctx, reserved: 0 })), Reply::Empty);
    let ctx = r.ctx();
    let module = Raw::handle(r.load(ctx, BUMP));
    let func = match r.function(ctx, module, "bump") {
        Reply::Function(f, _) => f.func,
        other => panic!("{other:?}"),
    };
    let big: Vec<GraphNode> = big.into_iter().map(|n| if let GraphNode::Kernel(k, pr) = n { GraphNode::Kernel(GraphKernel { func, ..k }, pr) } else { n }).collect();
    assert!(matches!(create(&mut r, ctx, big), Reply::Handle(_)), "the budget came back with the context");

    // A module unloaded while a graph launches one of its kernels stays
    // in memory for it, and so stays charged until the graph goes: a
    // tenant cannot keep modules for the price of graphs.
    assert_eq!(r.call(Request::CtxDestroy(CtxReq { ctx, reserved: 0 })), Reply::Empty);
    let host = || m.metric("vgpu_tenant_host_memory_bytes", "tenant=\"graphs\",device=\"cpu0\"").expect("metric");
    let ctx = r.ctx();
    let idle = host();
    let module = Raw::handle(r.load(ctx, BUMP));
    let loaded = host();
    assert!(loaded > idle, "a loaded module is charged ({idle} -> {loaded})");
    let func = match r.function(ctx, module, "bump") {
        Reply::Function(f, _) => f.func,
        other => panic!("{other:?}"),
    };
    let with_func = host();
    let g = Raw::handle(create(&mut r, ctx, bumps(func, p, 1)));
    let graph = host() - with_func;
    assert_eq!(r.call(Request::ModuleUnload(ModuleReq { ctx, module })), Reply::Empty);
    assert_eq!(host(), loaded + graph, "the unloaded module stays charged while its graph lives (module {} bytes, graph {graph})", loaded - idle);
    assert_eq!(r.call(Request::GraphDestroy(HandleReq { ctx, handle: g })), Reply::Empty);
    assert_eq!(host(), idle, "destroying the graph gave the module's charge back");
    assert_eq!(m.device("cpu0")["worker_restarts"], 0);
}

const COUNT: &str = ".version 7.0\n.target sm_70\n.address_size 64\n\
.visible .entry count(.param .u32 n)\n{\n    .reg .u32 %r<1>;\n    .reg .pred %p<1>;\n\
    ld.param.u32 %r0, [n];\n$L_top:\n    setp.eq.u32 %p0, %r0, 0;\n    @%p0 bra $L_end;\n\
    sub.u32 %r0, %r0, 1;\n    bra.uni $L_top;\n$L_end:\n    ret;\n}\n";

/// One launch of a graph is held to the launch timeout as one launch is:
/// a graph of many kernels, each well within the limit, stops with
/// CUDA_ERROR_LAUNCH_TIMEOUT once they have run past it together, rather
/// than hold a lane (and its tenant's teardown) for nodes × the limit.
#[test]
fn a_graph_launch_is_held_to_one_launch_timeout() {
    let m = Mediator::start(&["--launch-timeout-ms", "3000", "--instruction-budget", "0"]);
    let sock = m.tenant("longgraph", "16MiB");
    let mut r = Raw::connect(&sock);
    let ctx = r.ctx();
    let module = Raw::handle(r.load(ctx, COUNT));
    let func = match r.function(ctx, module, "count") {
        Reply::Function(f, _) => f.func,
        other => panic!("{other:?}"),
    };
    // A count that keeps one launch busy for 100 ms to 500 ms here.
    let mut n = 1u32 << 14;
    let ran = loop {
        let t = std::time::Instant::now();
        assert_eq!(r.launch(ctx, func, [1; 3], [1; 3], &n.to_le_bytes()), Reply::Empty);
        let ran = t.elapsed();
        if ran >= std::time::Duration::from_millis(100) {
            break ran;
        }
        assert!(n < 1 << 30, "a count of {n} still runs in {ran:?}");
        n *= 2;
    };
    assert!(ran < std::time::Duration::from_millis(1500), "one launch of the calibrated count ran {ran:?}, too near the limit");
    let k = GraphKernel { func, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 4, reserved: 0 };
    let nodes = 80;
    let g = Raw::handle(create(&mut r, ctx, (0..nodes).map(|_| GraphNode::Kernel(k, n.to_le_bytes().to_vec())).collect()));
    match launch(&mut r, ctx, g) {
        Reply::Error(CuResult::CUDA_ERROR_LAUNCH_TIMEOUT, msg) => {
            assert!(msg.contains("graph ran past the 3s launch timeout"), "{msg}");
            let done: usize = msg.split("after ").nth(1).and_then(|s| s.split(' ').next()).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{msg}"));
            assert!(done < nodes, "{msg}");
        }
        other => panic!("a graph of {nodes} launches of {ran:?} each: {other:?}"),
    }
    // As after a kernel's own timeout, the context is unusable; the
    // tenant's next context works.
    error(launch(&mut r, ctx, g), CuResult::CUDA_ERROR_LAUNCH_TIMEOUT, "unusable");
    assert_eq!(r.call(Request::CtxDestroy(CtxReq { ctx, reserved: 0 })), Reply::Empty);
    let ctx = r.ctx();
    assert!(matches!(r.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4096 })), Reply::Ptr(_)));
}
