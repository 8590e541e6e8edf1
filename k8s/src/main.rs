//! vgpu-k8s: the vGPU stack's Kubernetes node component (docs/kubernetes.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use vgpu_k8s::plugin::{self, Config};
use vgpu_k8s::slices::Resource;

#[derive(Parser)]
#[command(name = "vgpu-k8s", version, about = "The vGPU stack's Kubernetes node component")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Offer pools as resources of fixed-size vGPU slices through the
    /// kubelet's device plugin API; each allocation is a tenant of the
    /// local vgpu-mediatord, handed to its container through CDI.
    DevicePlugin(PluginArgs),
}

#[derive(clap::Args)]
struct PluginArgs {
    /// A resource: NAME=POOL:SIZE, slices of SIZE of the devices in POOL
    /// (vgpu.dev/slice-16g=default:16GiB); repeat for more.
    #[arg(long = "resource", required = true, value_name = "NAME=POOL:SIZE")]
    resources: Vec<Resource>,
    /// The kubelet's directory (its device-plugins/ and pod-resources/).
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    /// Where CDI specs go, one per tenant.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// vgpu-mediatord's run directory (its api.sock).
    #[arg(long, default_value = "/run/vgpu")]
    run_dir: PathBuf,
    /// Where the plugin keeps its allocations.
    #[arg(long, default_value = "/var/lib/vgpu-k8s")]
    state_dir: PathBuf,
    /// The directory of the vGPU's libcuda.so.1 (and libnvidia-ml.so.1)
    /// that containers get.
    #[arg(long, default_value = "/usr/lib/vgpu")]
    lib_dir: PathBuf,
    /// Where those libraries go in a container.
    #[arg(long, default_value = "/usr/lib/x86_64-linux-gnu")]
    container_lib_dir: PathBuf,
    /// Answer with mounts instead of CDI devices (for runtimes without
    /// CDI); the environment is given either way.
    #[arg(long)]
    no_cdi: bool,
    /// The prefix of the names of the tenants the plugin makes; tenants
    /// with it that no allocation names are deleted at start.
    #[arg(long, default_value = "k8s-")]
    tenant_prefix: String,
    /// Seconds between looks at the devices and the plugin's sockets.
    #[arg(long, default_value_t = 5)]
    poll_s: u64,
    /// Seconds between comparisons of the pods' holdings with the
    /// allocations.
    #[arg(long, default_value_t = 30)]
    reconcile_s: u64,
    /// Seconds an allocation stands before a pod must hold it.
    #[arg(long, default_value_t = 120)]
    grace_s: u64,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_env("VGPU_LOG").unwrap_or_else(|_| "info".into())).with_writer(std::io::stderr).init();
    let Cmd::DevicePlugin(a) = Cli::parse().cmd;
    if let Err(e) =
        vgpu_api::tenant::validate_name(a.tenant_prefix.trim_end_matches(['-', '_', '.'])).and_then(|()| if a.tenant_prefix.len() > 16 { Err("at most 16 characters".into()) } else { Ok(()) })
    {
        eprintln!("vgpu-k8s: --tenant-prefix: {e}");
        return ExitCode::from(2);
    }
    if a.poll_s == 0 || a.reconcile_s == 0 {
        eprintln!("vgpu-k8s: --poll-s and --reconcile-s must be at least 1");
        return ExitCode::from(2);
    }
    let libs = match plugin::driver_libs(&a.lib_dir) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("vgpu-k8s: {e}");
            return ExitCode::from(2);
        }
    };
    let cfg = Config {
        kubelet_dir: a.kubelet_dir,
        cdi_dir: a.cdi_dir,
        run_dir: a.run_dir,
        state_dir: a.state_dir,
        libs,
        container_lib_dir: a.container_lib_dir,
        resources: a.resources,
        cdi: !a.no_cdi,
        tenant_prefix: a.tenant_prefix,
        poll: Duration::from_secs(a.poll_s),
        reconcile: Duration::from_secs(a.reconcile_s),
        grace: Duration::from_secs(a.grace_s),
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vgpu-k8s: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(|e| format!("SIGTERM: {e}"))?;
        // Stopped by SIGTERM or SIGINT: allocations stay recorded for the
        // next start, and the kubelet sees the socket go.
        tokio::select! {
            r = plugin::run(cfg) => r.map_err(|e| e.to_string()),
            _ = tokio::signal::ctrl_c() => Ok(()),
            _ = term.recv() => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpu-k8s: {e}");
            ExitCode::FAILURE
        }
    }
}
