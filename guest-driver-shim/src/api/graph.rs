//! CUDA graphs as CuPy and PyTorch make them: by capturing a stream.
//! While a stream captures, the work submitted to it (launches, memsets,
//! copies, host functions, event records) is recorded instead of run; the
//! capture ends in a graph, an instantiated graph replays its work in
//! order on any stream of its context, as one stream's work would run.
//! At instantiation each run of two or more pieces of device-only work
//! (kernels, memsets, device-to-device copies) becomes a graph held by the
//! vGPU (`GraphCreate`), which a launch runs with one request
//! (`GraphLaunch`); on a GPU the executor makes it a CUDA graph of its
//! own. Copies with host memory, host functions and event records run
//! from here, in order between those parts. A vGPU that refuses a graph
//! (one that predates them) gets that run's pieces one by one, as before.
//! Graphs built node by node (`cuGraphAdd*Node`) and captures that fork
//! into other streams are not supported yet.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_gpu_compute::*;

use crate::client::{CallError, CallResult};

use super::{bad, dec, enc, invalid_handle, out, with, CUdeviceptr, CUresult, Default, Shim, Target, H};

pub(super) const TAG_GRAPH: usize = 0xC9;
pub(super) const TAG_EXEC: usize = 0xCA;

/// The most work one graph may record.
const MAX_NODES: usize = 1 << 20;
/// The most graphs and instantiated graphs a process may hold at once.
const MAX_GRAPHS: usize = 1 << 16;

/// One recorded piece of stream work.
#[derive(Clone)]
pub(super) enum Node {
    Launch {
        req: LaunchReq,
        params: Vec<u8>,
    },
    Memset {
        dptr: CUdeviceptr,
        value: u32,
        elem: u32,
        count: usize,
    },
    DtoD {
        dst: CUdeviceptr,
        src: CUdeviceptr,
        n: usize,
    },
    /// A copy from host memory, read when the graph runs (as on CUDA).
    HtoD {
        dst: CUdeviceptr,
        host: usize,
        n: usize,
    },
    DtoH {
        host: usize,
        src: CUdeviceptr,
        n: usize,
    },
    Host {
        f: unsafe extern "C" fn(*mut c_void),
        data: usize,
    },
    Record {
        event: H,
    },
}

// SAFETY: nodes hold addresses and function pointers as the application
// gave them; they are only used on the application's behalf, from any of
// its threads, as CUDA uses them.
unsafe impl Send for Node {}
// SAFETY: a node is never changed once recorded; threads sharing an
// instantiated graph only read the addresses and handles it holds.
unsafe impl Sync for Node {}

struct GraphDef {
    ctx: u32,
    nodes: Vec<Node>,
}

/// A piece of an instantiated graph.
enum Part {
    /// A run of device work the vGPU holds as graph `handle`; `nodes` are
    /// that work, recorded instead when the graph is launched into a
    /// capturing stream.
    Remote {
        handle: u32,
        nodes: Vec<Node>,
    },
    Local(Node),
}

struct ExecDef {
    ctx: u32,
    parts: Vec<Part>,
    /// The connection that holds the remote parts.
    client: std::sync::Weak<crate::client::Client>,
}

struct Capture {
    graph: u32,
    id: u64,
}

#[derive(Default)]
struct Graphs {
    next: u32,
    next_capture: u64,
    /// Capturing streams.
    captures: HashMap<u32, Capture>,
    graphs: HashMap<u32, GraphDef>,
    execs: HashMap<u32, Arc<ExecDef>>,
}

static GRAPHS: Mutex<Option<Graphs>> = Mutex::new(None);

fn graphs() -> MutexGuard<'static, Option<Graphs>> {
    GRAPHS.lock().unwrap_or_else(|e| e.into_inner())
}

fn with_graphs<R>(f: impl FnOnce(&mut Graphs) -> R) -> R {
    f(graphs().get_or_insert_with(Graphs::default))
}

/// Whether `t` is capturing.
pub(super) fn capturing(t: Target) -> bool {
    t.stream != DEFAULT_STREAM && with_graphs(|g| g.captures.contains_key(&t.stream))
}

/// Records `node` if `t` is capturing: true if it was recorded (and must
/// not run now).
pub(super) fn record(t: Target, node: impl FnOnce() -> Node) -> CallResult<bool> {
    if t.stream == DEFAULT_STREAM {
        return Ok(false);
    }
    with_graphs(|g| {
        let Some(c) = g.captures.get(&t.stream) else { return Ok(false) };
        let graph = g.graphs.get_mut(&c.graph).ok_or_else(|| invalid_handle("graph"))?;
        if graph.nodes.len() >= MAX_NODES {
            return Err(CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "the graph holds too much work"));
        }
        graph.nodes.push(node());
        Ok(true)
    })
}

/// Synchronising with a capturing stream is not allowed, as on CUDA.
pub(super) fn refuse_if_capturing(t: Target) -> CallResult<()> {
    if capturing(t) {
        return Err(CallError::new(CuResult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the stream is capturing"));
    }
    Ok(())
}

fn new_id(g: &mut Graphs) -> CallResult<u32> {
    if g.graphs.len() + g.execs.len() >= MAX_GRAPHS {
        return Err(CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many graphs"));
    }
    g.next += 1;
    Ok(g.next)
}

// ---- capture ----------------------------------------------------------------

fn begin_capture(h: H, default: Default) -> CUresult {
    with("cuStreamBeginCapture", |s| {
        let t = s.target(h, default)?;
        if t.stream == DEFAULT_STREAM {
            return Err(CallError::new(CuResult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the legacy default stream cannot capture"));
        }
        with_graphs(|g| {
            if g.captures.contains_key(&t.stream) {
                return Err(CallError::new(CuResult::CUDA_ERROR_ILLEGAL_STATE, "the stream is already capturing"));
            }
            let id = new_id(g)?;
            g.graphs.insert(id, GraphDef { ctx: t.ctx, nodes: Vec::new() });
            g.next_capture += 1;
            let capture = g.next_capture;
            g.captures.insert(t.stream, Capture { graph: id, id: capture });
            Ok(())
        })
    })
}

#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(h: H, _mode: c_int) -> CUresult {
    begin_capture(h, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2_ptsz(h: H, _mode: c_int) -> CUresult {
    begin_capture(h, Default::PerThread)
}

fn end_capture(h: H, graph: *mut H, default: Default) -> CUresult {
    with("cuStreamEndCapture", |s| {
        if graph.is_null() {
            return Err(bad("null graph pointer"));
        }
        let t = s.target(h, default)?;
        let c = with_graphs(|g| g.captures.remove(&t.stream)).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_ILLEGAL_STATE, "the stream is not capturing"))?;
        out(graph, enc(TAG_GRAPH, c.graph))
    })
}

#[no_mangle]
pub extern "C" fn cuStreamEndCapture(h: H, graph: *mut H) -> CUresult {
    end_capture(h, graph, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuStreamEndCapture_ptsz(h: H, graph: *mut H) -> CUresult {
    end_capture(h, graph, Default::PerThread)
}

/// CU_STREAM_CAPTURE_STATUS_NONE (0) or ACTIVE (1), the capture's id and
/// graph.
pub(super) fn capture_status(s: &Shim, h: H, default: Default) -> CallResult<(c_int, u64, u32)> {
    let t = s.target(h, default)?;
    Ok(with_graphs(|g| g.captures.get(&t.stream).map_or((0, 0, 0), |c| (1, c.id, c.graph))))
}

// ---- graphs -----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuGraphCreate(graph: *mut H, flags: c_uint) -> CUresult {
    with("cuGraphCreate", |s| {
        if flags != 0 {
            return Err(bad("flags must be 0"));
        }
        let ctx = s.current()?;
        let id = with_graphs(|g| {
            let id = new_id(g)?;
            g.graphs.insert(id, GraphDef { ctx, nodes: Vec::new() });
            Ok::<_, CallError>(id)
        })?;
        out(graph, enc(TAG_GRAPH, id))
    })
}

#[no_mangle]
pub extern "C" fn cuGraphDestroy(graph: H) -> CUresult {
    with("cuGraphDestroy", |_| {
        let id = dec(TAG_GRAPH, graph).ok_or_else(|| invalid_handle("graph"))?;
        with_graphs(|g| {
            if g.captures.values().any(|c| c.graph == id) {
                return Err(CallError::new(CuResult::CUDA_ERROR_ILLEGAL_STATE, "the graph is being captured"));
            }
            g.graphs.remove(&id).map(|_| ()).ok_or_else(|| invalid_handle("graph"))
        })
    })
}

/// The number of nodes (a captured graph is a chain); node handles
/// themselves are not offered yet.
#[no_mangle]
pub unsafe extern "C" fn cuGraphGetNodes(graph: H, nodes: *mut H, count: *mut usize) -> CUresult {
    with("cuGraphGetNodes", |_| {
        let id = dec(TAG_GRAPH, graph).ok_or_else(|| invalid_handle("graph"))?;
        let n = with_graphs(|g| g.graphs.get(&id).map(|x| x.nodes.len())).ok_or_else(|| invalid_handle("graph"))?;
        if !nodes.is_null() {
            return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "graph node handles are not supported yet"));
        }
        out(count, n)
    })
}

/// The node as the vGPU's graph holds it, if it is device-only work.
fn remote_node(n: &Node) -> Option<GraphNode> {
    Some(match n {
        Node::Launch { req, params } => {
            GraphNode::Kernel(GraphKernel { func: req.func, shared_bytes: req.shared_bytes, grid: req.grid, block: req.block, params_len: params.len() as u32, reserved: 0 }, params.clone())
        }
        Node::Memset { dptr, value, elem, count } => GraphNode::Memset(GraphMemset { dptr: *dptr, value: *value, elem_size: *elem, count: *count as u64 }),
        Node::DtoD { dst, src, n } => GraphNode::Copy(GraphCopy { dst: *dst, src: *src, size: *n as u64 }),
        _ => return None,
    })
}

/// Splits a graph's nodes into parts: each run of two or more
/// device-only nodes (up to MAX_RUN nodes, MAX_GRAPH_BYTES) becomes a graph the vGPU
/// holds, where it takes one; every other node stays local.
fn parts(client: &crate::client::Client, ctx: u32, nodes: Vec<Node>) -> Vec<Part> {
    let mut parts = Vec::new();
    let mut run: Vec<(Node, GraphNode)> = Vec::new();
    let flush = |run: &mut Vec<(Node, GraphNode)>, parts: &mut Vec<Part>| {
        if run.len() >= 2 {
            let wire: Vec<GraphNode> = run.iter().map(|(_, w)| w.clone()).collect();
            if let Ok(Reply::Handle(handle)) = client.call(Request::GraphCreate(GraphCreateReq { ctx, count: 0, nodes_len: 0, reserved: 0 }, wire)) {
                parts.push(Part::Remote { handle, nodes: run.drain(..).map(|(n, _)| n).collect() });
                return;
            }
        }
        parts.extend(run.drain(..).map(|(n, _)| Part::Local(n)));
    };
    let mut bytes = 0;
    for n in nodes {
        match remote_node(&n) {
            Some(w) => {
                bytes += 64 + if let GraphNode::Kernel(_, p) = &w { p.len() } else { 0 };
                run.push((n, w));
                if run.len() == MAX_RUN || bytes >= MAX_GRAPH_BYTES {
                    flush(&mut run, &mut parts);
                    bytes = 0;
                }
            }
            None => {
                flush(&mut run, &mut parts);
                bytes = 0;
                parts.push(Part::Local(n));
            }
        }
    }
    flush(&mut run, &mut parts);
    parts
}

/// The most nodes one `GraphCreate` carries. The vGPU runs a graph as one
/// piece of work, under one launch timeout and without giving the device
/// back in between, so a long run is cut into graphs of this many.
const MAX_RUN: usize = 256;

/// The most bytes of nodes one `GraphCreate` carries: well inside what a
/// VM's submit takes (8 MiB), so a long run becomes several graphs.
const MAX_GRAPH_BYTES: usize = 4 << 20;

/// Frees the vGPU's graphs of an instantiated graph.
fn release(e: &ExecDef) {
    let Some(client) = e.client.upgrade() else { return };
    for p in &e.parts {
        if let Part::Remote { handle, .. } = p {
            // A graph the vGPU no longer knows (its context is gone) is
            // nothing to free.
            let _ = client.call(Request::GraphDestroy(HandleReq { ctx: e.ctx, handle: *handle }));
        }
    }
}

fn instantiate(s: &Shim, exec: *mut H, graph: H) -> CallResult<()> {
    let id = dec(TAG_GRAPH, graph).ok_or_else(|| invalid_handle("graph"))?;
    let (ctx, nodes) = with_graphs(|g| g.graphs.get(&id).map(|d| (d.ctx, d.nodes.clone()))).ok_or_else(|| invalid_handle("graph"))?;
    if exec.is_null() {
        return Err(bad("null graph exec pointer"));
    }
    let client = s.client();
    let def = Arc::new(ExecDef { ctx, parts: parts(&client, ctx, nodes), client: Arc::downgrade(&client) });
    let e = with_graphs(|g| {
        let e = new_id(g)?;
        g.execs.insert(e, def.clone());
        Ok::<_, CallError>(e)
    });
    match e {
        Ok(e) => out(exec, enc(TAG_EXEC, e)),
        Err(err) => {
            release(&def);
            Err(err)
        }
    }
}

#[no_mangle]
pub extern "C" fn cuGraphInstantiateWithFlags(exec: *mut H, graph: H, _flags: u64) -> CUresult {
    with("cuGraphInstantiate", |s| instantiate(s, exec, graph))
}

/// The CUDA 11 form, with an error node and log it never needs to fill.
#[no_mangle]
pub extern "C" fn cuGraphInstantiate_v2(exec: *mut H, graph: H, _err_node: *mut H, _log: *mut c_char, _size: usize) -> CUresult {
    with("cuGraphInstantiate", |s| instantiate(s, exec, graph))
}

/// The unversioned name, which the driver still exports for libraries
/// that look their entry points up by name (cuBLASLt `dlsym`s it and
/// refuses to start without it). Callers built for CUDA 11 pass five
/// arguments and those built for CUDA 12 and later three (`flags` last);
/// both begin with the exec out-pointer and the graph, the only two read
/// here, so either call is served (the System V caller owns its argument
/// registers and stack).
#[no_mangle]
pub extern "C" fn cuGraphInstantiate(exec: *mut H, graph: H) -> CUresult {
    with("cuGraphInstantiate", |s| instantiate(s, exec, graph))
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS`.
#[repr(C)]
pub struct InstantiateParams {
    flags: u64,
    upload_stream: H,
    err_node: H,
    result: c_int,
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithParams(exec: *mut H, graph: H, params: *mut InstantiateParams) -> CUresult {
    let r = with("cuGraphInstantiate", |s| instantiate(s, exec, graph));
    if !params.is_null() {
        // SAFETY: non-null, and the API contract makes it the parameters.
        unsafe { (*params).result = if r == 0 { 0 } else { 1 } };
    }
    r
}

#[no_mangle]
pub extern "C" fn cuGraphExecDestroy(exec: H) -> CUresult {
    with("cuGraphExecDestroy", |_| {
        let id = dec(TAG_EXEC, exec).ok_or_else(|| invalid_handle("graph exec"))?;
        let e = with_graphs(|g| g.execs.remove(&id)).ok_or_else(|| invalid_handle("graph exec"))?;
        release(&e);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecGetFlags(exec: H, flags: *mut u64) -> CUresult {
    with("cuGraphExecGetFlags", |_| {
        let id = dec(TAG_EXEC, exec).ok_or_else(|| invalid_handle("graph exec"))?;
        if !with_graphs(|g| g.execs.contains_key(&id)) {
            return Err(invalid_handle("graph exec"));
        }
        out(flags, 0)
    })
}

/// Nothing to upload ahead: the device has the graph's code already.
#[no_mangle]
pub extern "C" fn cuGraphUpload(exec: H, _stream: H) -> CUresult {
    with("cuGraphUpload", |_| {
        let id = dec(TAG_EXEC, exec).ok_or_else(|| invalid_handle("graph exec"))?;
        if with_graphs(|g| g.execs.contains_key(&id)) {
            Ok(())
        } else {
            Err(invalid_handle("graph exec"))
        }
    })
}
#[no_mangle]
pub extern "C" fn cuGraphUpload_ptsz(exec: H, stream: H) -> CUresult {
    cuGraphUpload(exec, stream)
}

/// Runs an instantiated graph's work on `stream`, in order; returns once
/// it is queued (a recorded copy to pageable host memory or a host
/// function completes first, as those do outside graphs).
fn launch_graph(exec: H, stream: H, default: Default) -> CUresult {
    let mut plan = None;
    let r = with("cuGraphLaunch", |s| {
        let id = dec(TAG_EXEC, exec).ok_or_else(|| invalid_handle("graph exec"))?;
        let e = with_graphs(|g| g.execs.get(&id).cloned()).ok_or_else(|| invalid_handle("graph exec"))?;
        let t = s.target(stream, default)?;
        if t.ctx != e.ctx {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_CONTEXT, "the graph belongs to another context"));
        }
        plan = Some(e);
        Ok(())
    });
    let Some(e) = plan else { return r };
    for p in &e.parts {
        let r = match p {
            // Launched into a capture: its work is recorded there.
            Part::Remote { nodes, .. } if with_target(stream, default).is_some_and(capturing) => nodes.iter().map(|n| launch_node(n.clone(), stream, default)).find(|r| *r != 0).unwrap_or(0),
            Part::Remote { handle, .. } => with("cuGraphLaunch", |s| {
                let t = s.target(stream, default)?;
                // Its vGPU graph lives on the connection that made it.
                if !e.client.upgrade().is_some_and(|c| Arc::ptr_eq(&c, &s.client())) {
                    return Err(CallError::new(CuResult::CUDA_ERROR_CONTEXT_IS_DESTROYED, "the graph was made on a connection to the vGPU that was lost"));
                }
                s.enqueue(t, Request::GraphLaunch(GraphLaunchReq { ctx: t.ctx, stream: t.stream, graph: *handle, reserved: 0 })).map(|_| ())
            }),
            Part::Local(n) => launch_node(n.clone(), stream, default),
        };
        if r != 0 {
            return r;
        }
    }
    0
}

/// The target `stream` names, if any.
fn with_target(stream: H, default: Default) -> Option<Target> {
    let mut t = None;
    with("cuGraphLaunch", |s| {
        t = Some(s.target(stream, default)?);
        Ok(())
    });
    t
}

/// Runs one node of a graph on `stream`, as its own call would.
fn launch_node(n: Node, stream: H, default: Default) -> CUresult {
    match n {
        Node::Launch { req, params } => with("cuGraphLaunch", |s| {
            let t = s.target(stream, default)?;
            let req = LaunchReq { stream: t.stream, ..req };
            // Into a capturing stream: recorded, as every other node is.
            if record(t, || Node::Launch { req, params: params.clone() })? {
                return Ok(());
            }
            s.enqueue(t, Request::LaunchKernel(req, params)).map(|_| ())
        }),
        Node::Memset { dptr, value, elem, count } => super::memset("cuGraphLaunch", dptr, value, elem, count, stream, false, default),
        Node::DtoD { dst, src, n } => super::dtod("cuGraphLaunch", dst, src, n, stream, false, default),
        Node::HtoD { dst, host, n } => super::host_copy("cuGraphLaunch", true, dst, host as *mut c_void, n, stream, false, default),
        Node::DtoH { host, src, n } => super::host_copy("cuGraphLaunch", false, src, host as *mut c_void, n, stream, false, default),
        // SAFETY: the application's host function takes its user data.
        Node::Host { f, data } => super::library::host_func("cuGraphLaunch", stream, default, |_| unsafe { f(data as *mut c_void) }),
        Node::Record { event } => super::event_record(event, stream, default),
    }
}

#[no_mangle]
pub extern "C" fn cuGraphLaunch(exec: H, stream: H) -> CUresult {
    launch_graph(exec, stream, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuGraphLaunch_ptsz(exec: H, stream: H) -> CUresult {
    launch_graph(exec, stream, Default::PerThread)
}
