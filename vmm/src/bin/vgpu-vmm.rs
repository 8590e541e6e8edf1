//! `vgpu-vmm`: runs one VM until the guest resets, powers off, faults, or
//! is killed through the API. Exit status: 0 guest reset/power-off,
//! 1 error, 2 bad command line, 3 triple fault, 4 killed. Every thread runs
//! under its kind's seccomp allow-list unless `--no-seccomp` is given; a
//! forbidden syscall kills the VMM with SIGSYS.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use vgpu_api::size::Size;
use vmm::config::{Hugepages, MemMiB, SerialOut, Validate, VmConfig};
use vmm::seccomp::ThreadKind;
use vmm::vm::Vm;

#[derive(Parser)]
#[command(name = "vgpu-vmm", version, about = "vGPU VMM: one KVM virtual machine per process")]
struct Cli {
    /// Kernel: an ELF vmlinux or a bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    #[arg(long)]
    initramfs: Option<PathBuf>,
    #[arg(long)]
    cmdline: Option<String>,
    #[arg(long)]
    vcpus: Option<u32>,
    /// Guest memory: MiB when a plain number, or a size such as 2GiB.
    #[arg(long)]
    memory: Option<MemMiB>,
    /// none, 2M or 1G.
    #[arg(long)]
    hugepages: Option<Hugepages>,
    /// Bind guest memory to this NUMA node and pin vCPUs to its CPUs.
    #[arg(long)]
    numa_node: Option<u32>,
    /// stdout or a file path.
    #[arg(long)]
    serial: Option<SerialOut>,
    #[arg(long)]
    api_socket: Option<PathBuf>,
    /// A JSON VM description (the API's schema); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Do not offer the virtio-rng device.
    #[arg(long)]
    no_rng: bool,
    /// A virtio-gpu compute device: socket=PATH[,headless], PATH being the
    /// VM tenant's vhost-user socket from `vgpuctl tenant create NAME --vm`.
    #[arg(long)]
    vgpu: Option<vmm::config::VgpuConfig>,
    /// A virtio-blk disk: [path=]PATH[,ro][,direct][,id=ID][,bw=SIZE/MS][,ops=N/MS]
    /// (repeatable; the guest sees vda, vdb, ... in this order). bw and ops
    /// are token buckets: that many bytes (or requests) per that many ms.
    #[arg(long = "disk")]
    disks: Vec<vmm::config::DiskSpec>,
    /// A virtio-net interface over a tap:
    /// tap=NAME[,mac=52:54:00:xx:xx:xx][,rx_bw=SIZE/MS][,rx_ops=N/MS][,tx_bw=SIZE/MS][,tx_ops=N/MS]
    /// (repeatable, at most 8). An existing tap owned by this uid needs no
    /// privilege; a missing one is created (CAP_NET_ADMIN) and goes away
    /// with the VMM. The MAC defaults to 52:54:00 and three bytes derived
    /// from the tap's name and position; rx_* and tx_* are token buckets
    /// on bytes and frames towards and from the guest.
    #[arg(long = "net")]
    nets: Vec<vmm::config::NetConfig>,
    /// Pass a host PCI function through whole with VFIO: DDDD:BB:DD.F
    /// (repeatable, at most 8). It must be bound to vfio-pci and in an
    /// IOMMU group whose other devices are bound to vfio-pci or to none.
    /// MSI-X or MSI interrupts (no INTx). With --jail, the device's own
    /// sysfs entries and VFIO nodes are exposed in the jail.
    #[arg(long = "vfio", value_name = "PCI_ADDRESS")]
    vfio: Vec<vmm::config::PciAddress>,
    /// Run without the seccomp filters. By default every thread (main,
    /// vCPUs, devices, API) runs under its own allow-list, and a syscall off
    /// it kills the VMM with SIGSYS.
    #[arg(long)]
    no_seccomp: bool,
    /// Jail the VMM (as Firecracker's jailer does): new PID, mount and network
    /// namespaces, a read-only tmpfs root mounted on DIR holding only
    /// /dev/kvm and the files the VM uses, and the uid and gid given, with no
    /// groups, no capabilities and no_new_privs. Needs root.
    #[arg(long, value_name = "DIR", requires_all = ["jail_uid", "jail_gid"])]
    jail: Option<PathBuf>,
    /// The jailed VMM's uid (not 0).
    #[arg(long, value_name = "UID", requires = "jail")]
    jail_uid: Option<u32>,
    /// The jailed VMM's gid (not 0).
    #[arg(long, value_name = "GID", requires = "jail")]
    jail_gid: Option<u32>,
    /// cgroup v2 memory.max for the jailed VMM (bytes, or a size such as
    /// 1GiB); needs cgroup v2 at /sys/fs/cgroup, else the VMM refuses to start.
    #[arg(long, value_name = "BYTES", requires = "jail")]
    jail_memory: Option<Size>,
    /// cgroup v2 pids.max for the jailed VMM; needs cgroup v2 at
    /// /sys/fs/cgroup, else the VMM refuses to start.
    #[arg(long, value_name = "N", requires = "jail")]
    jail_pids: Option<u64>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Self-test of the seccomp filters: installs the filters a thread of
    /// KIND runs under (a device thread's stacked on a vCPU's, as it
    /// inherits them), then makes one syscall. A forbidden one kills the
    /// process with SIGSYS.
    #[command(hide = true)]
    SeccompCheck {
        /// main, vcpu, api or device.
        #[arg(long)]
        thread: String,
        /// One of vmm::seccomp::CHECK_SYSCALLS (getpid, execve, socket-inet, ...).
        #[arg(long)]
        syscall: String,
    },
}

fn jail_config(cli: &Cli) -> Option<vmm::jail::JailConfig> {
    let root = cli.jail.clone()?;
    Some(vmm::jail::JailConfig {
        root,
        // clap makes --jail require both ids.
        uid: cli.jail_uid.unwrap_or(0),
        gid: cli.jail_gid.unwrap_or(0),
        memory_max: cli.jail_memory.map(|s| s.0),
        pids_max: cli.jail_pids,
    })
}

fn seccomp_check(thread: &str, syscall: &str) -> anyhow::Result<i32> {
    let kind: ThreadKind = thread.parse()?;
    vmm::seccomp::init(true)?;
    // The VMM starts its first thread before any filter (glibc sets up a
    // signal handler then): do the same here.
    std::thread::spawn(|| ()).join().map_err(|_| anyhow::anyhow!("a warm-up thread panicked"))?;
    if kind == ThreadKind::Device {
        vmm::seccomp::confine(ThreadKind::Vcpu)?;
    }
    vmm::seccomp::confine(kind)?;
    let rc = vmm::seccomp::make_syscall(syscall).map_err(anyhow::Error::msg)?;
    println!("{syscall} returned {rc}");
    Ok(0)
}

fn build_config(cli: Cli) -> anyhow::Result<VmConfig> {
    let mut cfg = match (&cli.config, &cli.kernel) {
        (Some(p), _) => vmm::config::from_json_file(p)?,
        (None, Some(k)) => VmConfig::new(k.clone()),
        (None, None) => anyhow::bail!("--kernel (or --config with a kernel) is required"),
    };
    if let Some(k) = cli.kernel {
        cfg.kernel = k;
    }
    if cli.initramfs.is_some() {
        cfg.initramfs = cli.initramfs;
    }
    if let Some(c) = cli.cmdline {
        cfg.cmdline = c;
    }
    if let Some(v) = cli.vcpus {
        cfg.vcpus = v;
    }
    if let Some(m) = cli.memory {
        cfg.memory_mib = m;
    }
    if let Some(h) = cli.hugepages {
        cfg.hugepages = h;
    }
    if cli.numa_node.is_some() {
        cfg.numa_node = cli.numa_node;
    }
    if let Some(s) = cli.serial {
        cfg.serial = s;
    }
    if cli.api_socket.is_some() {
        cfg.api_socket = cli.api_socket;
    }
    if cli.no_rng {
        cfg.rng = false;
    }
    if cli.vgpu.is_some() {
        cfg.vgpu = cli.vgpu;
    }
    if !cli.disks.is_empty() {
        cfg.disks = cli.disks;
    }
    if !cli.nets.is_empty() {
        cfg.nets = cli.nets;
    }
    if !cli.vfio.is_empty() {
        cfg.vfio = cli.vfio;
    }
    Ok(cfg)
}

fn main() {
    // virtio-queue logs every bad descriptor a guest writes, unbounded;
    // the devices report bad queues themselves, rate-limited.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("VGPU_LOG").unwrap_or_else(|_| "warn,virtio_queue=off".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let code = match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vgpu-vmm: error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run() -> anyhow::Result<i32> {
    let cli = Cli::parse();
    let jail = jail_config(&cli);
    if let Some(Cmd::SeccompCheck { thread, syscall }) = &cli.cmd {
        // With --jail, the check runs as the jail's PID 1, as a jailed VMM does.
        if let Some(j) = &jail {
            if let Some(supervisor) = vmm::jail::enter(j, None)? {
                vmm::jail::exit_like(supervisor.wait());
            }
        }
        return seccomp_check(thread, syscall);
    }
    let seccomp = !cli.no_seccomp;
    let mut cfg = build_config(cli)?;
    let api = cfg.api_socket.clone();
    let mut listener = None;
    let mut taps = None;
    if let Some(j) = &jail {
        cfg.validate()?;
        vmm::jail::absolute_paths(&mut cfg)?;
        // Bound here, on the host; the jailed VMM gets the descriptor.
        if let Some(p) = &api {
            listener = Some(vmm::api::bind(p)?);
        }
        // Opened here, in the host's network namespace (the jail gets an
        // empty one of its own); the jailed VMM keeps the descriptors.
        taps = Some(vmm::vm::open_taps(&cfg)?);
        if let Some(supervisor) = vmm::jail::enter(j, Some(&cfg))? {
            drop(listener);
            drop(taps);
            let end = supervisor.wait();
            if let Some(p) = &api {
                let _ = std::fs::remove_file(p);
            }
            vmm::jail::exit_like(end);
        }
    }
    vmm::seccomp::init(seccomp)?;
    let vm = Vm::start_with_taps(cfg, taps)?;
    let first = vm.first_entry.clone();
    let t0 = vm.start;
    if let Some(p) = &api {
        let l = match listener.take() {
            Some(l) => l,
            None => vmm::api::bind(p)?,
        };
        vmm::api::serve(l, vmm::api::ApiState { control: vm.control.clone(), info: vm.info.clone(), keyboard: vm.keyboard.clone() })?;
    }
    // Everything is started: from here the main thread only waits.
    vmm::seccomp::confine(ThreadKind::Main)?;
    let reason = vm.wait();
    if let Some(t) = *first.lock().unwrap_or_else(|e| e.into_inner()) {
        tracing::info!(startup_us = (t - t0).as_micros() as u64, "time from start to the first guest entry");
    }
    if let Some(p) = &api {
        let _ = std::fs::remove_file(p);
    }
    eprintln!("vgpu-vmm: {reason}");
    Ok(reason.exit_code())
}
