//! A device worker process: owns one device, listens on its tenants'
//! sockets and serves their compute messages. The control plane drives it
//! over stdin/stdout ([`vgpu_arbiter::ipc`]); when stdin closes, the worker exits.
//!
//! Run as a tenant's **executor** (`--grant-fd`), it serves exactly one
//! tenant: its listening socket is handed over ready (`--listen-fd`), and
//! it runs work only on lanes the device's arbiter grants
//! ([`vgpu_arbiter::grant`]). It leaves when the arbiter goes.

pub mod confine;
pub mod conn;
pub mod engine;
pub mod pipeline;
pub mod seccomp;
pub mod service;
pub mod shm;

use std::collections::HashMap;
use std::io::BufRead;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tracing::{info, warn};

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use service::{DeviceService, Tenant};
use vgpu_arbiter::ipc::{CmdLine, TenantCmd, WorkerCmd, WorkerMsg};
use vgpu_arbiter::sched::{Scheduler, WeightedFair};

pub struct WorkerOptions {
    pub ordinal: u32,
    pub memory: u64,
    pub budget: u64,
    pub lanes: usize,
    pub backend: BackendKind,
    /// The device's NUMA node: the worker's threads run on its CPUs.
    pub numa_node: i32,
    /// Host RAM a CPU device's allocations may spill to.
    pub spill: u64,
    pub launch_timeout_ms: u64,
    /// Compute capability of a CPU device.
    pub cc: (u32, u32),
    /// The unprivileged identity to drop to once the device is open.
    pub user: Option<vgpu_arbiter::ipc::Owner>,
    /// Install the seccomp allow-lists (CPU devices).
    pub seccomp: bool,
    /// Executor threads serving tenant sockets.
    pub connection_threads: usize,
    /// The nice value kernels run at (0: off).
    pub compute_nice: i32,
    /// Pin each lane to a core of its own (vgpu_arbiter::placement).
    pub pin_lanes: bool,
    /// Run as the device's arbiter ([`vgpu_arbiter::arbiter`]) instead.
    pub arbiter: bool,
    /// An executor: its grant channel to the device's arbiter.
    pub grant_fd: Option<i32>,
    /// An executor: its tenant's listening socket, bound by the control
    /// plane.
    pub listen_fd: Option<i32>,
    /// An executor: the address window its tenant gets (CPU devices).
    pub window: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

fn open_backend(opts: &WorkerOptions, launch_threads: usize) -> anyhow::Result<Arc<dyn Backend>> {
    match opts.backend {
        BackendKind::Cpu => Ok(Arc::new(
            CpuBackend::new(opts.ordinal, opts.memory, opts.budget)?
                .with_launch_timeout(std::time::Duration::from_millis(opts.launch_timeout_ms))
                .with_compute_capability(opts.cc)
                .with_launch_threads(launch_threads)
                .with_spill(opts.spill)?
                .with_first_window(opts.window)?,
        )),
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

/// Raises the soft descriptor limit to the hard one: tenants' connections
/// are capped per tenant, and a low default (often 1024) must not be what
/// stops them first.
fn raise_fd_limit() {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit on our own process with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &rl) != 0 {
                warn!("cannot raise the descriptor limit: {}", std::io::Error::last_os_error());
            }
        }
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
    /// Stops a VM tenant's vhost-user thread between connections.
    stop: Arc<AtomicBool>,
    /// A process tenant's socket in the connection pool.
    pooled: Option<u64>,
    /// A VM tenant's listening socket, shut down to end its vhost thread.
    vhost: Option<UnixListener>,
}

/// Writes replies and events to the control plane, one JSON line each,
/// whole (`vgpu_arbiter::ipc::send`, on the channel taken off stdout);
/// removal threads report through it too.
#[derive(Clone, Copy)]
struct Out;

impl Out {
    fn send(&self, id: u64, msg: WorkerMsg) -> std::io::Result<()> {
        vgpu_arbiter::ipc::send(id, msg)
    }
}

/// Runs the worker until the control plane closes its stdin.
pub fn run(opts: WorkerOptions) -> anyhow::Result<()> {
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe { libc::umask(0o077) };
    pin_to_node(opts.numa_node);
    raise_fd_limit();
    // A CPU device runs each launch's blocks on every core the worker may
    // use (its NUMA node's, once pinned).
    let launch_threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if opts.arbiter {
        return arbiter(&opts);
    }
    // Tenant code runs in this process from here on: what it (or a driver
    // on its behalf) prints must not reach the control plane's channel.
    vgpu_arbiter::ipc::take_stdout().map_err(|e| anyhow::anyhow!("moving the control plane's channel off stdout: {e}"))?;
    if opts.grant_fd.is_some() && opts.backend == BackendKind::Cuda {
        // A kernel fault or a runaway ends a GPU executor (vgpu_arbiter::fatal).
        vgpu_arbiter::fatal::enable();
    }
    // An MPS client (an executor of a GPU shared under MPS) meets the MPS
    // control daemon when the driver initialises, and the daemon serves
    // the uid it sees then: such an executor opens its device after it
    // has dropped to its uid; every other one before.
    let mps_client = opts.backend == BackendKind::Cuda && opts.grant_fd.is_some() && std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some();
    let early = if mps_client { None } else { Some(open_backend(&opts, launch_threads)?) };
    let seccomp = opts.seccomp;
    // Before privileges go: a thread's way back from a lowered nice value
    // is RLIMIT_NICE raised, which takes privilege, or else CAP_SYS_NICE
    // kept, which only the seccomp lists make narrow enough.
    let nice_limit = if opts.compute_nice > 0 { vgpu_arbiter::nice::raise_limit() } else { Ok(()) };
    if opts.backend == BackendKind::Cpu {
        anyhow::Context::context(vgpu_arbiter::nice::fence_limits(), "capping RLIMIT_RTPRIO and RLIMIT_NICE")?;
    }
    if opts.grant_fd.is_some() && opts.user.is_some() {
        // An executor has no network: a namespace of its own with only a
        // loopback device that is down.
        // SAFETY: unshare affects only this process.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            anyhow::bail!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
        }
    }
    if let Some(u) = opts.user {
        let keep_nice = nice_limit.is_err() && seccomp;
        confine::drop_privileges(u, keep_nice)?;
        let caps = if keep_nice { "CAP_SYS_NICE alone (fenced by seccomp)" } else { "no capabilities" };
        info!(uid = u.uid, gid = u.gid, "device worker confined: unprivileged, {caps}, no_new_privs, own mount namespace");
    }
    let backend = match early {
        Some(b) => b,
        None => open_backend(&opts, launch_threads)?,
    };
    // Lane threads set their own time slice with sched_setattr, which
    // with CAP_SYS_NICE could also ask for a real-time policy: only where
    // the worker does not hold it, its limits fenced (vgpu_arbiter::nice).
    let slice = opts.compute_nice > 0 && opts.backend == BackendKind::Cpu && !confine::holds_cap_sys_nice();
    if seccomp {
        // Whatever the backend would open or load later, it does now.
        backend.before_confinement();
        confine::no_new_privs()?;
        seccomp::confine_worker(slice, opts.backend == BackendKind::Cuda)?;
        info!("device worker under its seccomp allow-list");
    }
    match vgpu_arbiter::nice::enable(opts.compute_nice, slice) {
        Ok(()) if opts.compute_nice > 0 => {
            info!(
                nice = vgpu_arbiter::nice::compute(),
                slice_us = vgpu_arbiter::nice::sliced().then_some(vgpu_arbiter::nice::LANE_SLICE.as_micros() as u64),
                "kernels run below the worker's control threads"
            )
        }
        Ok(()) => {}
        Err(e) => warn!("kernels run at the control threads' priority: no thread could return to nice 0 ({e}; RLIMIT_NICE: {nice_limit:?})"),
    }
    if opts.backend == BackendKind::Cpu && opts.pin_lanes {
        match vgpu_arbiter::placement::enable() {
            Some(cores) => info!(?cores, "each lane's kernels run on a core of their own"),
            None => info!("one core: lanes are not pinned"),
        }
    }
    if opts.backend == BackendKind::Cpu && launch_threads > 1 {
        // The threads launches run blocks on, made now: tenant connection
        // threads narrow their seccomp filters and may not create threads.
        if let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(launch_threads).thread_name(|i| format!("vgpu-blocks-{i}")).start_handler(|_| vgpu_arbiter::nice::lower_for_good()).build_global() {
            warn!("the block thread pool could not be built ({e}); launches run on one thread");
        }
    }
    let fair = Arc::new(WeightedFair::new(opts.lanes));
    let lanes = match opts.grant_fd {
        Some(fd) => {
            // SAFETY: the control plane passed this descriptor to us alone;
            // nothing else in this process owns it.
            let chan = vgpu_arbiter::grant::Channel::from_fd(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) });
            let grants = vgpu_arbiter::grant::Grants::start(chan, opts.lanes)?;
            let g2 = grants.clone();
            std::thread::Builder::new().name("arbiter-watch".into()).spawn(move || {
                while !g2.is_closed() {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                warn!("the device's arbiter is gone; this executor ends");
                // No exit handlers: a GPU driver's would destroy contexts,
                // and wait on a kernel that still runs.
                // SAFETY: _exit ends the process at once; nothing in this
                // process relies on running further.
                unsafe { libc::_exit(0) };
            })?;
            vgpu_arbiter::grant::Lanes::Granted(grants)
        }
        None => vgpu_arbiter::grant::Lanes::Local(Scheduler::new(opts.lanes, fair.clone())),
    };
    let executor = opts.grant_fd.is_some();
    let svc = Arc::new(DeviceService::new(opts.ordinal, backend, lanes));
    // Rings and streams: engine threads for several tenants' launches to
    // wait at the scheduler at once, and one more so a ring is consumed
    // while every lane runs a kernel.
    let engine = engine::Engine::start(opts.lanes, seccomp, Some(fair))?;
    let pool = conn::Pool::start(svc.clone(), engine.clone(), opts.connection_threads, seccomp)?;
    let mut listening: HashMap<String, Listening> = HashMap::new();
    // SAFETY: as the grant channel: passed to this process alone.
    let mut handed: Option<UnixListener> = opts.listen_fd.map(|fd| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) });
    let out = Out;
    out.send(0, WorkerMsg::Ready { pid: std::process::id() })?;
    info!(ordinal = opts.ordinal, memory = opts.memory, "device worker ready");
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let (id, cmd) = match serde_json::from_str::<CmdLine>(&line) {
            Ok(c) => (c.id, c.cmd),
            Err(e) => {
                out.send(0, WorkerMsg::Err(format!("bad command: {e}")))?;
                continue;
            }
        };
        let reply = match cmd {
            WorkerCmd::Stats => WorkerMsg::Stats(svc.stats()),
            WorkerCmd::SetTenant { name, share, quota } => match svc.set_tenant(&name, share, quota) {
                Ok(()) => {
                    info!(tenant = %name, ?share, ?quota, "tenant changed");
                    WorkerMsg::Ok
                }
                Err(e) => WorkerMsg::Err(e),
            },
            WorkerCmd::AddTenant(spec) => {
                let r = if executor && (!listening.is_empty() || handed.is_none()) {
                    Err("an executor serves one tenant, on the socket it was started with".to_string())
                } else if spec.vm {
                    add_vm_tenant(&svc, &engine, &spec, handed.take())
                } else {
                    add_tenant(&svc, &pool, &spec, handed.take())
                };
                match r {
                    Ok(l) => {
                        listening.insert(spec.name, l);
                        WorkerMsg::Ok
                    }
                    Err(e) => WorkerMsg::Err(e),
                }
            }
            WorkerCmd::RetireIfIdle { name } if !executor => WorkerMsg::Err(format!("this worker serves every tenant of its device: it does not retire for {name}")),
            WorkerCmd::RetireIfIdle { name } => match listening.get(&name).map(|l| (l.pooled, &l.tenant)) {
                Some((Some(id), t)) => match pool.retire_if_idle(id, t) {
                    Ok(()) => {
                        info!(tenant = %name, "the tenant's executor serves no client and accepts no more: it is to be replaced");
                        WorkerMsg::Ok
                    }
                    Err(n) => WorkerMsg::Err(format!("tenant {name} has {n} connections")),
                },
                Some((None, _)) => WorkerMsg::Err(format!("tenant {name} is a VM's: its guest state lives in this process")),
                None => WorkerMsg::Err(format!("no tenant {name}")),
            },
            WorkerCmd::RemoveTenant { name } => match listening.remove(&name) {
                Some(l) => {
                    // Revoked first, on every path at once; the teardown
                    // (waiting for a running request, freeing, scrubbing)
                    // runs off this loop and reports when it is done.
                    svc.revoke(&name);
                    stop_listening(&l, &pool);
                    let (svc2, out2, n2) = (svc.clone(), out, name.clone());
                    let teardown = move || {
                        svc2.remove_tenant(&n2);
                        info!(tenant = %n2, "tenant removed; its memory is released");
                        let _ = out2.send(0, WorkerMsg::Removed { name: n2 });
                    };
                    if let Err(e) = std::thread::Builder::new().name(format!("remove-{name}")).spawn(teardown) {
                        warn!(tenant = %name, "no thread for the teardown ({e}); tearing down inline");
                        svc.remove_tenant(&name);
                        out.send(0, WorkerMsg::Removed { name })?;
                    }
                    WorkerMsg::Ok
                }
                None => WorkerMsg::Err(format!("no tenant {name}")),
            },
        };
        out.send(id, reply)?;
    }
    for l in listening.values() {
        stop_listening(l, &pool);
    }
    Ok(())
}

/// The tenant's listening socket: the one the control plane bound, or one
/// bound here. A stale socket from a previous worker of this device is
/// replaced; it is created 0600 (umask) and the control plane sets its
/// owner and mode.
fn listen(socket: &std::path::Path, handed: Option<UnixListener>) -> Result<UnixListener, String> {
    if let Some(l) = handed {
        return Ok(l);
    }
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(|e| format!("binding {}: {e}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(|e| format!("chmod {}: {e}", socket.display()))?;
    Ok(listener)
}

/// The device's arbiter: what tenants are told of the device (for its
/// statistics), then no device open, confined as a worker is.
fn arbiter(opts: &WorkerOptions) -> anyhow::Result<()> {
    let (desc, budget) = match opts.backend {
        BackendKind::Cpu => {
            let b = open_backend(opts, 1)?;
            (b.desc().clone(), b.spill_usage().1)
        }
        // No context: the arbiter holds nothing on the GPU.
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => (crate::backend::cuda::CudaBackend::describe(opts.numa_node).map_err(anyhow::Error::msg)?, 0),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => anyhow::bail!("this vgpu-mediatord was built without the `cuda` feature"),
    };
    if let Some(u) = opts.user {
        confine::drop_privileges(u, false)?;
    }
    if opts.seccomp {
        confine::no_new_privs()?;
        // On a GPU the driver is initialised here (no context): its
        // threads get the driver's lists too.
        seccomp::confine_worker(false, opts.backend == BackendKind::Cuda)?;
    }
    if opts.backend == BackendKind::Cuda {
        // A GPU kernel cannot stop at a yield: it runs to its end or to
        // its launch timeout, which ends its executor.
        vgpu_arbiter::grant::allow_unpausable(std::time::Duration::from_millis(opts.launch_timeout_ms));
    }
    info!(uid = opts.user.map(|u| u.uid), seccomp = opts.seccomp, "device arbiter confined");
    vgpu_arbiter::arbiter::run(opts.lanes, (desc.kind.to_string(), desc.name.clone(), service::uuid_text(&desc.uuid), desc.memory, budget))
}

fn add_tenant(svc: &Arc<DeviceService>, pool: &conn::Pool, spec: &TenantCmd, handed: Option<UnixListener>) -> Result<Listening, String> {
    let socket = &spec.socket;
    let listener = listen(socket, handed)?;
    let tenant = svc.add_tenant(&spec.name, spec.quota, spec.share(), spec.host_limit)?;
    let id = match pool.add_listener(tenant.clone(), listener, spec.max_connections.max(1)) {
        Ok(id) => id,
        Err(e) => {
            svc.remove_tenant(&spec.name);
            return Err(format!("serving {}: {e}", socket.display()));
        }
    };
    info!(tenant = %spec.name, quota = spec.quota, host_limit = spec.host_limit, socket = %socket.display(), "tenant added");
    Ok(Listening { tenant, socket: socket.clone(), stop: Arc::new(AtomicBool::new(false)), pooled: Some(id), vhost: None })
}

/// A VM tenant: its vhost-user virtio-gpu backend serves `socket`.
fn add_vm_tenant(svc: &Arc<DeviceService>, engine: &Arc<engine::Engine>, spec: &TenantCmd, handed: Option<UnixListener>) -> Result<Listening, String> {
    let (name, socket) = (&spec.name, &spec.socket);
    // Bound once: the socket keeps its inode (and so the owner the control
    // plane gives it) across VMM connections.
    let listener = listen(socket, handed)?;
    let handle = listener.try_clone().map_err(|e| format!("cloning the listener: {e}"))?;
    let tenant = svc.add_tenant(name, spec.quota, spec.share(), spec.host_limit)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (svc2, engine2, t2, stop2) = (svc.clone(), engine.clone(), tenant.clone(), stop.clone());
    let started = std::thread::Builder::new().name(format!("vhost-{name}")).spawn(move || crate::gpu::vhost::serve(listener, crate::gpu::GpuConfig::default(), svc2, Some(engine2), t2, stop2));
    if let Err(e) = started {
        svc.remove_tenant(name);
        return Err(format!("starting the vhost-user thread: {e}"));
    }
    info!(tenant = %name, quota = spec.quota, socket = %socket.display(), "VM tenant added (vhost-user)");
    Ok(Listening { tenant, socket: socket.clone(), stop, pooled: None, vhost: Some(handle) })
}

fn stop_listening(l: &Listening, pool: &conn::Pool) {
    l.stop.store(true, Ordering::Release);
    // The listener closes and every client of it is shut down at once.
    if let Some(id) = l.pooled {
        pool.remove_listener(id);
    }
    if let Some(v) = &l.vhost {
        // Wakes the vhost thread's accept; a connected VMM keeps its
        // connection (refused everything) until it disconnects.
        // SAFETY: shutdown on a descriptor we own.
        unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(v), libc::SHUT_RDWR) };
    }
    let _ = std::fs::remove_file(&l.socket);
    info!(tenant = %l.tenant.name, "tenant revoked: its sockets no longer serve it");
}
