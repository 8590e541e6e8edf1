//! `vgpu-mediatord`: serves vGPU tenants on NVIDIA GPUs, MIG instances and
//! CPU reference devices.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use vgpu_api::serve::Limits;
use vgpu_mediator::backend::discover;
use vgpu_mediator::config::{self, Config, CudaMode, Owner};
use vgpu_mediator::control::meter::Meter;
use vgpu_mediator::control::passthrough::{self, Passthrough};
use vgpu_mediator::control::store::Store;
use vgpu_mediator::control::{api, rundir, Control, CudaSpec, DeviceSpec, TenantDefaults};
use vgpu_mediator::size::Size;
use vgpu_mediator::worker;

#[derive(Parser)]
#[command(name = "vgpu-mediatord", version, about = "vGPU mediator: devices, tenants, quotas and scrubbing behind a REST API")]
struct Cli {
    /// Directory for api.sock and tenants/NAME.sock.
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Number of CPU reference devices.
    #[arg(long)]
    cpu_devices: Option<u32>,
    /// Memory of each CPU device (bytes, or a number with a unit: KiB, MiB,
    /// GiB, TiB; KB, MB, GB, TB; such as 1.5GiB).
    #[arg(long)]
    device_memory: Option<Size>,
    /// Cost units (about one per instruction) one kernel launch may spend
    /// on a CPU device; 0 for no budget (the time limit still applies).
    #[arg(long)]
    instruction_budget: Option<u64>,
    /// Wall-clock limit of one kernel launch on a CPU device, milliseconds.
    #[arg(long)]
    launch_timeout_ms: Option<u64>,
    /// Execution lanes of each CPU device: launches and copies running at
    /// once (default: one per host core).
    #[arg(long)]
    lanes: Option<u32>,
    /// The default pool's overcommit ratio: quotas on a device may add up
    /// to this times its memory (overrides devices.overcommit).
    #[arg(long)]
    overcommit: Option<f64>,
    /// Host RAM each CPU device may spill allocations to once its memory
    /// is full (overrides devices.spill).
    #[arg(long)]
    spill: Option<Size>,
    /// Nice value CPU devices run kernels at, below the workers' control
    /// threads (0 to 19, 0: off; overrides devices.compute_nice).
    #[arg(long)]
    compute_nice: Option<i32>,
    /// Pin each CPU device lane to a core of its own: true or false
    /// (overrides devices.pin_lanes).
    #[arg(long)]
    pin_lanes: Option<bool>,
    /// How tenants of a device are kept apart: process (an executor
    /// process per tenant; the default) or shared (one worker per CPU
    /// device; what overcommit and spill need). Overrides
    /// devices.isolation.
    #[arg(long, value_enum)]
    isolation: Option<vgpu_mediator::config::Isolation>,
    /// Compute capability the CPU devices report and accept PTX for
    /// (7.0 to 12.1, or 13.0 to 99.9 for an architecture no library ships
    /// machine code for; default 8.0).
    #[arg(long)]
    compute_capability: Option<String>,
    /// NVIDIA GPUs and MIG instances: auto, off or required.
    #[arg(long, value_enum)]
    cuda: Option<CudaMode>,
    /// Seconds each usage record covers (default 60).
    #[arg(long)]
    usage_interval: Option<u64>,
    /// The usage records file, JSON lines (default STATE_DIR/usage.jsonl,
    /// /var/lib/vgpu/usage.jsonl unless the state directory is moved, when
    /// the run directory is under /run, a tmpfs; RUN_DIR/usage.jsonl
    /// otherwise).
    #[arg(long)]
    usage_file: Option<PathBuf>,
    /// Also serve GET /metrics for Prometheus on this TCP address (off
    /// unless given), e.g. 127.0.0.1:9400.
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Where tenants, pools and managed VMs' descriptions and logs are kept (overrides
    /// vms.state_dir; default /var/lib/vgpu when the run directory is under
    /// /run, RUN_DIR/state otherwise).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The vgpu-vmm binary managed VMs run on (overrides vms.vmm; default:
    /// the one beside this program).
    #[arg(long)]
    vmm: Option<PathBuf>,
    /// Jail managed VMs' VMMs as UID:GID (overrides vms.jail; docs/vms.md).
    /// Default, when this daemon runs as root: jailed as the device
    /// workers' user (devices.worker_user, vgpu) and its group.
    #[arg(long, value_name = "UID:GID", conflicts_with = "no_vm_jail")]
    vm_jail: Option<vgpu_mediator::config::Owner>,
    /// Run managed VMs' VMMs unjailed (overrides vms.jail; the same as
    /// vms.jail = "off"). Without the jail a VMM started as root stays root.
    #[arg(long)]
    no_vm_jail: bool,
    /// TOML configuration file (same tenant schema as POST /tenants).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Internal: a device worker process, started by the control plane.
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        ordinal: u32,
        #[arg(long)]
        memory: u64,
        #[arg(long)]
        budget: u64,
        #[arg(long, default_value_t = 0)]
        lanes: u32,
        #[arg(long, value_enum, default_value_t = worker::BackendKind::Cpu)]
        backend: worker::BackendKind,
        #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
        numa_node: i32,
        #[arg(long, default_value_t = 0)]
        spill: u64,
        #[arg(long, default_value_t = 30_000)]
        launch_timeout_ms: u64,
        #[arg(long, default_value = "8.0")]
        compute_capability: String,
        /// Drop to this UID:GID once the device is open.
        #[arg(long)]
        user: Option<Owner>,
        /// Install the seccomp allow-lists (CPU devices).
        #[arg(long)]
        seccomp: bool,
        /// Executor threads serving tenant sockets.
        #[arg(long, default_value_t = 4)]
        connection_threads: usize,
        /// Run kernels at this nice value, back to 0 between them (0: off).
        #[arg(long, default_value_t = 0)]
        compute_nice: i32,
        /// Pin each lane's kernels to a core of its own.
        #[arg(long)]
        pin_lanes: bool,
        /// Be the device's arbiter: its scheduler, no tenant's state.
        #[arg(long)]
        arbiter: bool,
        /// Be a tenant's executor, granted lanes over this descriptor.
        #[arg(long)]
        grant_fd: Option<i32>,
        /// The executor's tenant socket, bound by the control plane.
        #[arg(long, requires = "grant_fd")]
        listen_fd: Option<i32>,
        /// The executor's tenant's address window on a CPU device.
        #[arg(long, default_value_t = 0)]
        window: u64,
    },
    /// Internal: installs a device worker's seccomp allow-list, then makes
    /// the named syscall (`getpid`, allowed, or `socket-inet`, `execve`,
    /// `ptrace`, forbidden). A forbidden one kills the process with SIGSYS.
    #[command(hide = true)]
    SeccompCheck {
        #[arg(long)]
        syscall: String,
        /// Use the narrower list of a tenant connection thread.
        #[arg(long)]
        connection: bool,
        /// Build the lists as for a worker that keeps CAP_SYS_NICE (no
        /// sched_setattr).
        #[arg(long)]
        keep_nice: bool,
    },
    /// Internal: checks that the CUDA driver is usable (in a process of its
    /// own, so the daemon never holds the GPUs open).
    #[command(hide = true)]
    ProbeCuda,
    /// Internal: zeroes every byte of the GPU at a PCI address that a CUDA
    /// context can allocate, reads all of it back, and prints
    /// {"bytes":..,"device_memory":..}; fails if a byte is not zero.
    #[command(hide = true)]
    ScrubGpu {
        #[arg(long)]
        address: vgpu_topology::pci::PciAddress,
    },
    /// Lists the GPUs and MIG instances NVML reports and the devices the
    /// mediator would serve on them, as JSON.
    Discover {
        /// Write NVML's raw answers to this file instead, in the format the
        /// discovery tests read (vgpu-mediator/tests/nvml/).
        #[arg(long)]
        record: Option<PathBuf>,
    },
}

fn main() {
    // virtio-queue logs every bad descriptor a guest writes, unbounded;
    // the devices report bad queues themselves, rate-limited.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("VGPU_LOG").unwrap_or_else(|_| "info,virtio_queue=off".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run() {
        eprintln!("vgpu-mediatord: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::Worker {
            ordinal,
            memory,
            budget,
            lanes,
            backend,
            numa_node,
            spill,
            launch_timeout_ms,
            compute_capability,
            user,
            seccomp,
            connection_threads,
            compute_nice,
            pin_lanes,
            arbiter,
            grant_fd,
            listen_fd,
            window,
        }) => {
            let cc = config::parse_compute_capability(&compute_capability).map_err(anyhow::Error::msg)?;
            let lanes = if lanes == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { lanes as usize };
            return worker::run(worker::WorkerOptions {
                ordinal,
                memory,
                budget,
                lanes,
                backend,
                numa_node,
                spill,
                launch_timeout_ms,
                cc,
                user,
                seccomp,
                connection_threads,
                compute_nice,
                pin_lanes,
                arbiter,
                grant_fd,
                listen_fd,
                window,
            });
        }
        Some(Cmd::SeccompCheck { syscall, connection, keep_nice }) => {
            worker::confine::no_new_privs()?;
            worker::seccomp::confine_worker(!keep_nice, false)?;
            if connection {
                worker::seccomp::confine_connection_thread()?;
            }
            let rc = worker::seccomp::make_syscall(&syscall).map_err(anyhow::Error::msg)?;
            println!("{syscall} returned {rc}");
            return Ok(());
        }
        Some(Cmd::Discover { record }) => return discover_cmd(record),
        Some(Cmd::ScrubGpu { address }) => return scrub_gpu_cmd(&address),
        Some(Cmd::ProbeCuda) => {
            #[cfg(feature = "cuda")]
            {
                let v = vgpu_mediator::backend::cuda::probe().map_err(anyhow::Error::msg)?;
                println!("{}", vgpu_mediator::backend::cuda::version_text(v));
                return Ok(());
            }
            #[cfg(not(feature = "cuda"))]
            anyhow::bail!("this build has no cuda backend");
        }
        None => {}
    }
    let mut cfg = match &cli.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(n) = cli.cpu_devices {
        cfg.devices.cpu = n;
    }
    if let Some(m) = cli.device_memory {
        // As the config file's devices.memory, in the flag's own words.
        if !(1 << 20..=1 << 40).contains(&m.0) {
            anyhow::bail!("--device-memory must be between 1MiB and 1TiB, not {m}");
        }
        cfg.devices.memory = m;
    }
    if let Some(b) = cli.instruction_budget {
        cfg.devices.instruction_budget = b;
    }
    if let Some(t) = cli.launch_timeout_ms {
        cfg.devices.launch_timeout_ms = t;
    }
    if let Some(l) = cli.lanes {
        cfg.devices.lanes = l;
    }
    if let Some(o) = cli.overcommit {
        cfg.devices.overcommit = o;
    }
    if let Some(sp) = cli.spill {
        cfg.devices.spill = sp;
    }
    if let Some(i) = cli.isolation {
        cfg.devices.isolation = Some(i);
    }
    if let Some(p) = cli.pin_lanes {
        cfg.devices.pin_lanes = p;
    }
    if let Some(n) = cli.compute_nice {
        cfg.devices.compute_nice = n;
    }
    if cli.usage_interval.is_some() {
        cfg.metering.interval_s = cli.usage_interval;
    }
    if cli.usage_file.is_some() {
        cfg.metering.usage_file = cli.usage_file.clone();
    }
    if cli.metrics_listen.is_some() {
        cfg.metering.metrics_listen = cli.metrics_listen;
    }
    if let Some(cc) = cli.compute_capability {
        cfg.devices.compute_capability = cc;
    }
    if let Some(c) = cli.cuda {
        cfg.devices.cuda = c;
    }
    cfg.validate()?;
    let run_dir = cli.run_dir.or(cfg.run_dir.clone()).context("--run-dir (or run_dir in the config file) is required")?;
    // Sockets and files this daemon makes are private from the start.
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe { libc::umask(0o077) };
    // Room for the API's and the metrics' connections beside the workers'
    // channels and the VMs; each listener keeps to a share of whatever the
    // limit is, so neither can take the descriptors the other needs.
    let nofile = match vgpu_api::serve::raise_fd_limit() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!("cannot raise the descriptor limit: {e}");
            vgpu_api::serve::fd_limit().unwrap_or(1024)
        }
    };
    let api_limits = Limits::with_connections(config::API_MAX_CONNECTIONS).within_fd_limit(nofile);
    let metrics = cfg.metering.metrics_listen.map(|addr| (addr, cfg.metering.metrics_limits().within_fd_limit(nofile)));
    // SAFETY: geteuid has no preconditions.
    let worker_user = if unsafe { libc::geteuid() } == 0 {
        let u = config::resolve_user(&cfg.devices.worker_user).map_err(|e| anyhow::anyhow!("devices.worker_user: {e}"))?;
        anyhow::ensure!(u.uid != 0, "devices.worker_user must not be root");
        Some(u)
    } else {
        tracing::info!("not running as root: device workers keep this user's identity");
        None
    };
    // Held until this process ends: a second mediator on this run
    // directory stops here, before it touches a directory, a socket, a
    // device or an MPS daemon of this one.
    // Only a shared worker binds its tenants' sockets itself; executors'
    // are bound by the daemon.
    let shared_workers = (cfg.devices.cpu > 0 && cfg.devices.cpu_isolation() == config::Isolation::Shared) || cfg.devices.gpu_isolation() == config::Isolation::Shared;
    let run_dir_held = rundir::prepare(&run_dir, worker_user, shared_workers).context("preparing the run directory")?;
    let api_path = run_dir.join("api.sock");
    if api_path.exists() {
        if std::os::unix::net::UnixStream::connect(&api_path).is_ok() {
            anyhow::bail!("another mediator is serving {}", api_path.display());
        }
        std::fs::remove_file(&api_path)?;
    }
    // CPU devices are spread over the host's NUMA nodes in turn, as a
    // host's GPUs are over its sockets.
    let nodes: Vec<i32> = match vgpu_topology::Topology::read(&vgpu_topology::sysfs_root()) {
        Ok(t) => t.nodes.keys().map(|n| *n as i32).collect(),
        Err(e) => {
            tracing::warn!("CPU devices get no NUMA node: {e}");
            vec![-1]
        }
    };
    let mut devices: Vec<DeviceSpec> = (0..cfg.devices.cpu)
        .map(|i| DeviceSpec {
            numa_node: nodes[i as usize % nodes.len()],
            spill: cfg.devices.spill.0,
            compute_nice: 0,
            pin_lanes: false,
            executors: cfg.devices.cpu_isolation() == vgpu_mediator::config::Isolation::Process,
            name: format!("cpu{i}"),
            ordinal: i,
            memory: cfg.devices.memory.0,
            budget: cfg.devices.instruction_budget,
            lanes: cfg.devices.lanes,
            launch_timeout_ms: cfg.devices.launch_timeout_ms,
            cc: config::parse_compute_capability(&cfg.devices.compute_capability).unwrap_or((8, 0)),
            seccomp: false,
            connection_threads: 0,
            cuda: None,
        })
        .collect();
    devices.extend(gpu_devices(&cfg)?);
    anyhow::ensure!(!devices.is_empty(), "no devices to serve: no GPU was found and devices.cpu is 0");
    let exe = std::env::current_exe().context("locating own executable")?;
    for d in devices.iter_mut() {
        d.seccomp = cfg.devices.seccomp;
        d.connection_threads = cfg.devices.connection_threads;
        d.compute_nice = if d.cuda.is_none() { cfg.devices.compute_nice } else { 0 };
        d.pin_lanes = d.cuda.is_none() && cfg.devices.pin_lanes;
    }
    let defaults = TenantDefaults { host_memory: cfg.devices.tenant_host_memory.0, max_connections: cfg.devices.tenant_connections, max_tenants: cfg.devices.max_tenants as usize };
    if cfg.devices.cpu_isolation() == config::Isolation::Process && cfg.devices.cpu > 0 {
        // Device memory is brokered between executors only per tenant so
        // far: no device-wide backing to overcommit or spill from.
        anyhow::ensure!(
            cfg.devices.spill.0 == 0 && cfg.devices.overcommit <= 1.0,
            "devices.isolation = \"process\" does not support memory overcommit or spill yet (devices.overcommit {}, devices.spill {}); use isolation \"shared\" for those",
            cfg.devices.overcommit,
            cfg.devices.spill
        );
    }
    if cfg.devices.isolation.is_none() && cfg.devices.needs_shared_memory() && cfg.devices.cpu > 0 {
        tracing::warn!(
            overcommit = cfg.devices.overcommit,
            spill = cfg.devices.spill.0,
            "CPU devices serve all their tenants in one worker process (isolation \"shared\"): memory overcommit and spill need it; tenants get no executor of their own there"
        );
    }
    let exec_uids = config::parse_uid_range(&cfg.devices.executor_uids).map_err(|e| anyhow::anyhow!("devices.executor_uids: {e}"))?;
    // Run as root, executors get uids of their own, claimed host-wide so a
    // second mediator on this host never gives out the same ones.
    let exec_uids = match worker_user {
        Some(_) => {
            vgpu_mediator::control::executors::check_uid_range(std::path::Path::new("/etc"), exec_uids.0, exec_uids.1)?;
            let dir = std::path::Path::new(vgpu_mediator::control::executors::HOST_CLAIMS);
            vgpu_mediator::control::executors::UidRange::claimed_in(exec_uids.0, exec_uids.1, dir).context("preparing the host-wide executor uid claims")?
        }
        None => vgpu_mediator::control::executors::UidRange::new(exec_uids.0, exec_uids.1),
    };
    let control = Control::new(&run_dir, exe.clone(), devices, defaults, worker_user, cfg.devices.overcommit, Some(exec_uids));
    let _ = control.mps_control.set(cfg.devices.mps_control.clone());
    let _ = control.mps_max_clients.set(cfg.devices.mps_max_clients);
    control.stop_stale_mps();
    let state_dir = cli.state_dir.or(cfg.vms.state_dir.clone()).unwrap_or_else(|| if run_dir.starts_with("/run") { PathBuf::from("/var/lib/vgpu") } else { run_dir.join("state") });
    // Two mediators on one state directory would overwrite each other's
    // saved tenants, pools, VMs and (by default) usage records.
    let _state_dir_held = rundir::prepare_state(&state_dir, &run_dir_held).context("preparing the state directory")?;
    let pass =
        Passthrough::new(&cfg.devices.passthrough, vgpu_topology::sysfs_root(), &state_dir, Arc::new(passthrough::sysfs_write), passthrough::gpu_scrubber(exe.clone())).map_err(anyhow::Error::msg)?;
    if let Some(d) = pass.devices.iter().find(|d| control.slot(&d.name).is_some()) {
        anyhow::bail!("passthrough device {} has the name of a shared device; give it another", d.name);
    }
    let _ = control.passthrough.set(Arc::new(pass));
    // Tenants and pools an earlier run made through the API come back; a
    // state file that cannot be read whole stops the start, by name.
    let store = Store::open(&state_dir)?;
    store.declare(cfg.tenants.iter().map(|t| t.name.clone()), cfg.pools.iter().map(|p| p.name.clone()));
    let saved = store.load()?;
    let _ = control.store.set(store);
    for p in &cfg.pools {
        control.create_pool(p).with_context(|| format!("creating pool {} from the config file", p.name))?;
    }
    control.restore_pools(&saved.pools).map_err(anyhow::Error::msg)?;
    // By default in a directory this daemon holds: the state directory
    // when the run directory is a tmpfs, else the run directory.
    let usage_file = cfg.metering.usage_file.clone().unwrap_or_else(|| if run_dir.starts_with("/run") { state_dir.join("usage.jsonl") } else { run_dir.join("usage.jsonl") });
    let meter = Meter::open(&usage_file, std::time::Duration::from_secs(cfg.metering.interval_s.unwrap_or(60)))?;
    let _ = control.meter.set(meter.clone());
    control.start().map_err(anyhow::Error::msg)?;
    {
        let c = control.clone();
        std::thread::Builder::new().name("meter".into()).spawn(move || meter.run(c))?;
    }
    for t in &cfg.tenants {
        control.create_tenant(t).with_context(|| format!("creating tenant {} from the config file", t.name))?;
    }
    control.restore_tenants(&saved.tenants).map_err(anyhow::Error::msg)?;
    // Managed VMs: those saved by an earlier run come back.
    let vmm = cli.vmm.or(cfg.vms.vmm.clone()).unwrap_or_else(|| exe.with_file_name("vgpu-vmm"));
    std::fs::create_dir_all(state_dir.join("vms")).with_context(|| format!("making {}", state_dir.join("vms").display()))?;
    let stop_timeout = std::time::Duration::from_secs(cfg.vms.stop_timeout_s.unwrap_or(10));
    let explicit = if cli.no_vm_jail { Some(config::VmJail::Off) } else { cli.vm_jail.map(config::VmJail::As).or(cfg.vms.jail) };
    if matches!(explicit, Some(config::VmJail::As(j)) if j.uid == 0 || j.gid == 0) {
        anyhow::bail!("the VM jail's uid and gid must not be 0");
    }
    // SAFETY: geteuid has no preconditions.
    let choice = config::resolve_vm_jail(explicit, unsafe { libc::geteuid() }, &cfg.devices.worker_user, config::resolve_user);
    if let Some(why) = &choice.warning {
        tracing::warn!("{why}");
    }
    let jail = choice.jail;
    match jail {
        Some(j) => tracing::info!(jail = %j, "managed VMs' VMMs run jailed (vgpu-vmm --jail) as this uid:gid"),
        None if explicit == Some(config::VmJail::Off) => tracing::info!("managed VMs' VMMs run unjailed (--no-vm-jail or vms.jail = \"off\")"),
        None => {}
    }
    let _ = control.vms.set(vgpu_mediator::control::vms::Vms::new(vgpu_mediator::control::vms::VmsConfig { vmm, state_dir, stop_timeout, jail }));
    if let Some(v) = control.vms.get() {
        v.load(&control);
        // Devices lent to VMs that did not come back are returned and
        // scrubbed.
        if let Some(p) = control.passthrough.get() {
            p.recover(|vm| v.owns_tenant(vm));
        }
    }
    control.prune_usage();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = rt.block_on(serve(control.clone(), api_path.clone(), api_limits, metrics));
    if let Some(m) = control.meter.get() {
        // What the last interval measured is written before exiting.
        m.sample(&control);
        if let Err(e) = m.flush() {
            tracing::warn!("{e}");
        }
    }
    control.shutdown();
    let _ = std::fs::remove_file(&api_path);
    result
}

/// The GPUs and MIG instances to serve, per `devices.cuda`. In `auto`
/// mode a machine without a usable driver serves CPU devices only, and the
/// log says why.
fn gpu_devices(cfg: &Config) -> anyhow::Result<Vec<DeviceSpec>> {
    let d = &cfg.devices;
    if d.cuda == CudaMode::Off {
        return Ok(Vec::new());
    }
    let none = |why: String| -> anyhow::Result<Vec<DeviceSpec>> {
        if d.cuda == CudaMode::Required {
            anyhow::bail!("devices.cuda is `required`, but {why}");
        }
        tracing::info!("serving CPU devices only: {why}");
        Ok(Vec::new())
    };
    let answers = match discover::query_nvml() {
        Ok(a) => a,
        Err(e) => return none(e),
    };
    // The driver is tried in a child process: cuInit here would keep every
    // GPU open in the daemon for good, and a passthrough GPU's driver
    // cannot let go of a device that is open.
    #[cfg(feature = "cuda")]
    if let Err(e) = probe_cuda_in_child() {
        return none(e);
    }
    let (planned, skipped) = discover::plan(&answers, &vgpu_topology::sysfs_root());
    for s in &skipped {
        tracing::warn!(gpu = %s.gpu, "not served: {}", s.reason);
    }
    let mut out = Vec::new();
    for (i, g) in planned.into_iter().enumerate() {
        let passed = discover::sysfs_bus_id(&g.pci_bus_id).and_then(|b| b.parse::<vgpu_topology::pci::PciAddress>().ok()).is_some_and(|a| d.passthrough.iter().any(|p| p.address == a));
        if passed {
            tracing::info!(device = %g.name, bus_id = %g.pci_bus_id, "not served by a worker: it is a passthrough device");
            continue;
        }
        let Some(memory) = g.memory.checked_sub(d.cuda_reserve.0).filter(|m| *m >= 1 << 20) else {
            tracing::warn!(device = %g.name, memory = g.memory, reserve = d.cuda_reserve.0, "not served: devices.cuda_reserve leaves no memory for tenants");
            continue;
        };
        tracing::info!(device = %g.name, model = %g.model, uuid = %g.uuid, numa_node = g.numa_node, memory, "serving GPU device");
        let executors = d.gpu_isolation() == config::Isolation::Process;
        out.push(DeviceSpec {
            name: g.name,
            ordinal: d.cpu + i as u32,
            memory,
            budget: 0,
            // Two processes' kernels never run on a GPU at once (without
            // MPS): its arbiter grants one executor at a time, so the
            // tenants' weights, not the GPU's equal time slices, decide.
            lanes: if executors { 1 } else { d.lanes },
            launch_timeout_ms: d.cuda_launch_timeout_ms,
            cc: (0, 0),
            seccomp: false,
            connection_threads: 0,
            cuda: Some(CudaSpec { visible_devices: g.visible_devices, numa_node: g.numa_node }),
            numa_node: g.numa_node,
            // Spilling is built for CPU devices only (docs/overcommit.md).
            spill: 0,
            compute_nice: 0,
            pin_lanes: false,
            executors,
        });
    }
    if out.is_empty() {
        return none(format!("NVML (driver {}) lists no servable GPU or MIG instance", answers.driver_version));
    }
    Ok(out)
}

/// Runs `vgpu-mediatord probe-cuda`; its error line if the driver is not
/// usable.
#[cfg(feature = "cuda")]
fn probe_cuda_in_child() -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("locating own executable: {e}"))?;
    let o = std::process::Command::new(exe).arg("probe-cuda").stdin(std::process::Stdio::null()).output().map_err(|e| format!("probing the CUDA driver: {e}"))?;
    if o.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&o.stderr);
    Err(err.trim().lines().last().unwrap_or("the CUDA driver probe failed").trim_start_matches("vgpu-mediatord: error: ").to_string())
}

fn scrub_gpu_cmd(address: &vgpu_topology::pci::PciAddress) -> anyhow::Result<()> {
    #[cfg(feature = "cuda")]
    {
        let r = vgpu_mediator::backend::cuda::scrub_whole_gpu(address).map_err(anyhow::Error::msg)?;
        println!("{}", serde_json::to_string(&r)?);
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    anyhow::bail!("{address}: this build has no cuda backend to scrub a GPU with")
}

fn discover_cmd(record: Option<PathBuf>) -> anyhow::Result<()> {
    let answers = discover::query_nvml().map_err(anyhow::Error::msg)?;
    if let Some(path) = record {
        std::fs::write(&path, serde_json::to_string_pretty(&answers)? + "\n").with_context(|| format!("writing {}", path.display()))?;
        println!("recorded {} GPU(s) to {}", answers.gpus.len(), path.display());
        return Ok(());
    }
    let (devices, skipped) = discover::plan(&answers, &vgpu_topology::sysfs_root());
    let out = serde_json::json!({
        "driver_version": answers.driver_version,
        "cuda_driver_version": answers.cuda_driver_version,
        "devices": devices,
        "skipped": skipped,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

async fn serve(control: Arc<Control>, api_path: PathBuf, api_limits: Limits, metrics: Option<(std::net::SocketAddr, Limits)>) -> anyhow::Result<()> {
    if let Some((addr, limits)) = metrics {
        // Only the metrics, read-only: the management API stays on the
        // unix socket.
        let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the metrics listener {addr}"))?;
        tracing::info!(%addr, max_connections = limits.max_connections, "serving GET /metrics over TCP");
        let router = api::metrics_router(control.clone());
        tokio::spawn(vgpu_api::serve::serve(tcp, router, limits, std::future::pending()));
    }
    let listener = tokio::net::UnixListener::bind(&api_path).with_context(|| format!("binding {}", api_path.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&api_path, std::fs::Permissions::from_mode(0o600))?;
    }
    tracing::info!(api = %api_path.display(), devices = control.devices.len(), max_connections = api_limits.max_connections, "vgpu-mediatord serving");
    // Under systemd (Type=notify) the unit is started once the API
    // answers. Children inherit NOTIFY_SOCKET, but the unit takes
    // notifications from this process only (NotifyAccess=main).
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!("telling systemd the daemon is ready: {e}");
    }
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
        }
        tracing::info!("shutting down");
    };
    vgpu_api::serve::serve(listener, api::router(control), api_limits, shutdown).await;
    Ok(())
}
