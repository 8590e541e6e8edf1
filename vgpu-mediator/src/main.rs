//! `vgpu-mediatord`: serves vGPU tenants on CPU reference devices.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use vgpu_mediator::config::{Config, DEFAULT_DEVICE_MEMORY};
use vgpu_mediator::control::{api, Control, DeviceSpec};
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
    /// Memory of each CPU device (bytes, or with a KiB/MiB/GiB suffix).
    #[arg(long)]
    device_memory: Option<Size>,
    /// Instructions one kernel launch may execute on a CPU device.
    #[arg(long)]
    instruction_budget: Option<u64>,
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
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("VGPU_LOG").unwrap_or_else(|_| "info".into()))
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
    if let Some(Cmd::Worker { ordinal, memory, budget, lanes }) = cli.cmd {
        let lanes = if lanes == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { lanes as usize };
        return worker::run(worker::WorkerOptions { ordinal, memory, budget, lanes });
    }
    let mut cfg = match &cli.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(n) = cli.cpu_devices {
        cfg.devices.cpu = n;
    }
    cfg.devices.memory = cli.device_memory.unwrap_or(cfg.devices.memory);
    if cfg.devices.memory.0 == 0 {
        cfg.devices.memory = Size(DEFAULT_DEVICE_MEMORY);
    }
    if let Some(b) = cli.instruction_budget {
        cfg.devices.instruction_budget = b;
    }
    cfg.validate()?;
    let run_dir = cli.run_dir.or(cfg.run_dir.clone()).context("--run-dir (or run_dir in the config file) is required")?;
    std::fs::create_dir_all(run_dir.join("tenants")).with_context(|| format!("creating {}", run_dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(run_dir.join("tenants"), std::fs::Permissions::from_mode(0o700))?;
    }
    let api_path = run_dir.join("api.sock");
    if api_path.exists() {
        if std::os::unix::net::UnixStream::connect(&api_path).is_ok() {
            anyhow::bail!("another mediator is serving {}", api_path.display());
        }
        std::fs::remove_file(&api_path)?;
    }
    let devices = (0..cfg.devices.cpu)
        .map(|i| DeviceSpec { name: format!("cpu{i}"), ordinal: i, memory: cfg.devices.memory.0, budget: cfg.devices.instruction_budget, lanes: cfg.devices.lanes })
        .collect();
    let exe = std::env::current_exe().context("locating own executable")?;
    let control = Control::new(&run_dir, exe, devices);
    control.start().map_err(anyhow::Error::msg)?;
    for t in &cfg.tenants {
        control.create_tenant(t).with_context(|| format!("creating tenant {} from the config file", t.name))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = rt.block_on(serve(control.clone(), api_path.clone()));
    control.shutdown();
    let _ = std::fs::remove_file(&api_path);
    result
}

async fn serve(control: Arc<Control>, api_path: PathBuf) -> anyhow::Result<()> {
    let listener = tokio::net::UnixListener::bind(&api_path).with_context(|| format!("binding {}", api_path.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&api_path, std::fs::Permissions::from_mode(0o600))?;
    }
    tracing::info!(api = %api_path.display(), devices = control.devices.len(), "vgpu-mediatord serving");
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
        }
        tracing::info!("shutting down");
    };
    axum::serve(listener, api::router(control)).with_graceful_shutdown(shutdown).await?;
    Ok(())
}
