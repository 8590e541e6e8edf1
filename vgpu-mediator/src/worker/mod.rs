//! A device worker process: owns one device, listens on its tenants'
//! sockets and serves their compute messages. The control plane drives it
//! over stdin/stdout ([`crate::ipc`]); when stdin closes, the worker exits.

pub mod service;
pub mod shm;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tracing::{info, warn};
use virtio_gpu_compute::*;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::ipc::{WorkerCmd, WorkerMsg};
use crate::sched::{Fifo, Scheduler};
use service::{Conn, DeviceService, Tenant};
use shm::Shm;

pub struct WorkerOptions {
    pub ordinal: u32,
    pub memory: u64,
    pub budget: u64,
    pub lanes: usize,
    pub backend: BackendKind,
    /// The device's NUMA node: the worker's threads run on its CPUs.
    pub numa_node: i32,
    pub launch_timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

fn open_backend(opts: &WorkerOptions) -> anyhow::Result<Arc<dyn Backend>> {
    match opts.backend {
        BackendKind::Cpu => Ok(Arc::new(CpuBackend::new(opts.ordinal, opts.memory, opts.budget)?)),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let b = crate::backend::cuda::CudaBackend::new(opts.numa_node, std::time::Duration::from_millis(opts.launch_timeout_ms)).map_err(anyhow::Error::msg)?;
            if !b.has_param_info() {
                warn!("the driver has no cuFuncGetParamInfo: kernel parameters come from PTX declarations; cubin and fatbin images are refused");
            }
            Ok(Arc::new(b))
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => anyhow::bail!("this vgpu-mediatord was built without the `cuda` feature"),
    }
}

/// Runs the calling thread, and every thread it starts later, on `node`'s CPUs.
fn pin_to_node(node: i32) {
    let Ok(node) = u32::try_from(node) else { return };
    let pinned = vgpu_topology::Topology::read(&vgpu_topology::sysfs_root()).and_then(|t| t.cpus_for(node).map(<[usize]>::to_vec)).and_then(|cpus| vgpu_topology::pin_current_thread(&cpus, node));
    match pinned {
        Ok(()) => info!(node, "device worker pinned to its device's NUMA node"),
        Err(e) => warn!("device worker left unpinned: {e}"),
    }
}

struct Listening {
    tenant: Arc<Tenant>,
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    /// Live client connections, kept so removal can drop them; each entry
    /// is removed again when its connection ends.
    streams: Arc<Mutex<HashMap<u64, UnixStream>>>,
}

/// Runs the worker until the control plane closes its stdin.
pub fn run(opts: WorkerOptions) -> anyhow::Result<()> {
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe { libc::umask(0o077) };
    pin_to_node(opts.numa_node);
    let backend = open_backend(&opts)?;
    let svc = Arc::new(DeviceService::new(opts.ordinal, backend, Scheduler::new(opts.lanes, Box::new(Fifo))));
    let mut listening: HashMap<String, Listening> = HashMap::new();
    let stdout = std::io::stdout();
    let send = |m: &WorkerMsg| -> std::io::Result<()> {
        let mut o = stdout.lock();
        serde_json::to_writer(&mut o, m)?;
        o.write_all(b"\n")?;
        o.flush()
    };
    send(&WorkerMsg::Ready { pid: std::process::id() })?;
    info!(ordinal = opts.ordinal, memory = opts.memory, "device worker ready");
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let reply = match serde_json::from_str::<WorkerCmd>(&line) {
            Err(e) => WorkerMsg::Err(format!("bad command: {e}")),
            Ok(WorkerCmd::Stats) => WorkerMsg::Stats(svc.stats()),
            Ok(WorkerCmd::AddTenant { name, quota, weight, socket, vm }) => match if vm { add_vm_tenant(&svc, &name, quota, weight, &socket) } else { add_tenant(&svc, &name, quota, weight, &socket) } {
                Ok(l) => {
                    listening.insert(name, l);
                    WorkerMsg::Ok
                }
                Err(e) => WorkerMsg::Err(e),
            },
            Ok(WorkerCmd::RemoveTenant { name }) => match listening.remove(&name) {
                Some(l) => {
                    stop_listening(&l);
                    svc.remove_tenant(&name);
                    WorkerMsg::Ok
                }
                None => WorkerMsg::Err(format!("no tenant {name}")),
            },
        };
        send(&reply)?;
    }
    for l in listening.values() {
        stop_listening(l);
    }
    Ok(())
}

fn add_tenant(svc: &Arc<DeviceService>, name: &str, quota: u64, weight: u32, socket: &Path) -> Result<Listening, String> {
    // A stale socket from a previous worker of this device is replaced.
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(|e| format!("binding {}: {e}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(|e| format!("chmod {}: {e}", socket.display()))?;
    let tenant = svc.add_tenant(name, quota, weight)?;
    let stop = Arc::new(AtomicBool::new(false));
    let streams = Arc::new(Mutex::new(HashMap::new()));
    let (svc2, t2, stop2, streams2) = (svc.clone(), tenant.clone(), stop.clone(), streams.clone());
    std::thread::Builder::new()
        .name(format!("accept-{name}"))
        .spawn(move || {
            let mut next_id = 0u64;
            for s in listener.incoming() {
                if stop2.load(Ordering::Acquire) {
                    break;
                }
                let Ok(s) = s else { continue };
                next_id += 1;
                let id = next_id;
                if let Ok(c) = s.try_clone() {
                    streams2.lock().unwrap_or_else(|e| e.into_inner()).insert(id, c);
                }
                let (svc, t, reg) = (svc2.clone(), t2.clone(), streams2.clone());
                let spawned = std::thread::Builder::new().name(format!("tenant-{}", t.name)).spawn(move || {
                    serve(svc, t, &s);
                    // The registry holds a clone of this socket: close it
                    // explicitly so the client sees EOF, and forget it.
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    reg.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                });
                if spawned.is_err() {
                    warn!(tenant = %t2.name, "cannot start a connection thread; refusing the client");
                    if let Some(c) = streams2.lock().unwrap_or_else(|e| e.into_inner()).remove(&id) {
                        let _ = c.shutdown(std::net::Shutdown::Both);
                    }
                }
            }
        })
        .map_err(|e| e.to_string())?;
    info!(tenant = name, quota, socket = %socket.display(), "tenant added");
    Ok(Listening { tenant, socket: socket.to_path_buf(), stop, streams })
}

/// A VM tenant: its vhost-user virtio-gpu backend serves `socket`.
fn add_vm_tenant(svc: &Arc<DeviceService>, name: &str, quota: u64, weight: u32, socket: &Path) -> Result<Listening, String> {
    let _ = std::fs::remove_file(socket);
    let tenant = svc.add_tenant(name, quota, weight)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (svc2, t2, stop2, path) = (svc.clone(), tenant.clone(), stop.clone(), socket.to_path_buf());
    std::thread::Builder::new()
        .name(format!("vhost-{name}"))
        .spawn(move || crate::gpu::vhost::serve(path, crate::gpu::GpuConfig::default(), svc2, t2, stop2))
        .map_err(|e| e.to_string())?;
    // Answer only once the socket exists, so a VMM started right after
    // `tenant create` can connect.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !socket.exists() {
        if std::time::Instant::now() > deadline {
            stop.store(true, Ordering::Release);
            svc.remove_tenant(name);
            return Err(format!("the vhost-user socket {} did not appear", socket.display()));
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    info!(tenant = name, quota, socket = %socket.display(), "VM tenant added (vhost-user)");
    Ok(Listening { tenant, socket: socket.to_path_buf(), stop, streams: Arc::new(Mutex::new(HashMap::new())) })
}

fn stop_listening(l: &Listening) {
    l.stop.store(true, Ordering::Release);
    // Wake the accept loop so it sees the flag, then drop every client.
    let _ = UnixStream::connect(&l.socket);
    let _ = std::fs::remove_file(&l.socket);
    for (_, s) in l.streams.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    info!(tenant = %l.tenant.name, "tenant removed");
}

/// Reads exactly `buf.len()` bytes, keeping any fd that arrives with them.
/// Returns false on a clean EOF before the first byte.
fn read_full(s: &UnixStream, buf: &mut [u8], fd: &mut Option<File>) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let (n, f) = s.recv_with_fd(&mut buf[got..]).map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        if f.is_some() {
            *fd = f;
        }
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// Serves one client connection until it closes or breaks framing.
fn serve(svc: Arc<DeviceService>, t: Arc<Tenant>, s: &UnixStream) {
    let mut s = s;
    t.connections.fetch_add(1, Ordering::Relaxed);
    let mut conn = Conn::default();
    let mut hdr = [0u8; MsgHeader::SIZE];
    loop {
        let mut fd = None;
        match read_full(s, &mut hdr, &mut fd) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                warn!(tenant = %t.name, "connection read failed: {e}");
                break;
            }
        }
        let h = match MsgHeader::decode(&hdr) {
            Ok(h) => h,
            Err(e) => {
                // Framing cannot be trusted past a bad header: answer, then drop.
                warn!(tenant = %t.name, "bad header, disconnecting: {e}");
                let seq = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]);
                let _ = s.write_all(&Reply::error(e.cuda(), format!("bad message header: {e}")).encode(Opcode::Ping, seq));
                break;
            }
        };
        let mut msg = vec![0u8; MsgHeader::SIZE + h.payload_len as usize];
        msg[..MsgHeader::SIZE].copy_from_slice(&hdr);
        if h.payload_len > 0 && s.read_exact(&mut msg[MsgHeader::SIZE..]).is_err() {
            break;
        }
        let reply = match Request::decode(&msg) {
            Err(e) => Reply::error(e.cuda(), format!("bad {:?} message: {e}", h.opcode())),
            Ok((_, Request::RegisterShm(b))) => match fd.take() {
                None => Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, "RegisterShm arrived without a file descriptor"),
                Some(f) => match Shm::map(f, b.size) {
                    Ok(m) => {
                        svc.set_shm(&mut conn, Some(m));
                        Reply::Empty
                    }
                    Err(e) => Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, e.to_string()),
                },
            },
            Ok((_, req)) => {
                // Defence in depth: a bug must cost this request, not the worker.
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| svc.handle(&t, &mut conn, req))) {
                    Ok(r) => r,
                    Err(_) => {
                        warn!(tenant = %t.name, "request handler panicked; disconnecting the client");
                        let _ = s.write_all(&Reply::error(CuResult::CUDA_ERROR_UNKNOWN, "internal error").encode(h.opcode(), h.seq));
                        break;
                    }
                }
            }
        };
        if s.write_all(&reply.encode(h.opcode(), h.seq)).is_err() {
            break;
        }
    }
    svc.disconnect(&t, &mut conn);
    t.connections.fetch_sub(1, Ordering::Relaxed);
}
