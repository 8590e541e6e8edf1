//! `vgpu-vmm`: runs one VM until the guest resets, powers off, faults, or
//! is killed through the API. Exit status: 0 guest reset/power-off,
//! 1 error, 2 bad command line, 3 triple fault, 4 killed.

use std::path::PathBuf;

use clap::Parser;
use vmm::config::{Hugepages, MemMiB, SerialOut, VmConfig};
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
}

fn build_config(cli: Cli) -> anyhow::Result<VmConfig> {
    let mut cfg = match (&cli.config, &cli.kernel) {
        (Some(p), _) => VmConfig::from_json_file(p)?,
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
    Ok(cfg)
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("VGPU_LOG").unwrap_or_else(|_| "warn".into()))
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
    let cfg = build_config(Cli::parse())?;
    let api = cfg.api_socket.clone();
    let vm = Vm::start(cfg)?;
    let first = vm.first_entry.clone();
    let t0 = vm.start;
    if let Some(p) = &api {
        vmm::api::spawn(p, vmm::api::ApiState { control: vm.control.clone(), info: vm.info.clone(), keyboard: vm.keyboard.clone() })?;
    }
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
