//! vgpu-k8s: the vGPU stack's Kubernetes node component (docs/kubernetes.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use vgpu_k8s::claims::{ClaimLimits, Sharing};
use vgpu_k8s::dra::{self, DraConfig};
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
    /// Publish the node's devices to Kubernetes' dynamic resource
    /// allocation (resource.k8s.io/v1, Kubernetes 1.34+) and prepare the
    /// ResourceClaims allocated to them: each allocated device is a tenant
    /// of the local vgpu-mediatord, handed to the pod through CDI.
    DraDriver(DraArgs),
}

/// Where the node component finds the mediator, the driver libraries and
/// its own record, and where it writes CDI specs.
#[derive(clap::Args)]
struct HostArgs {
    /// Where CDI specs go, one per tenant.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// vgpu-mediatord's run directory (its api.sock).
    #[arg(long, default_value = "/run/vgpu")]
    run_dir: PathBuf,
    /// Where the component keeps its record of the tenants it made
    /// (state.json for the device plugin, dra-DRIVER.json for the DRA driver).
    #[arg(long, default_value = "/var/lib/vgpu-k8s")]
    state_dir: PathBuf,
    /// The directory of the vGPU's libcuda.so.1 (and libnvidia-ml.so.1)
    /// that containers get.
    #[arg(long, default_value = "/usr/lib/vgpu")]
    lib_dir: PathBuf,
    /// Where those libraries go in a container.
    #[arg(long, default_value = "/usr/lib/x86_64-linux-gnu")]
    container_lib_dir: PathBuf,
}

impl HostArgs {
    /// The host's side, with the libraries found in --lib-dir.
    fn resolve(self) -> Result<plugin::Host, String> {
        let libs = plugin::driver_libs(&self.lib_dir)?;
        Ok(plugin::Host { cdi_dir: self.cdi_dir, run_dir: self.run_dir, state_dir: self.state_dir, libs, container_lib_dir: self.container_lib_dir })
    }
}

#[derive(clap::Args)]
struct DraArgs {
    /// The driver's name: the DeviceClass's and the ResourceSlices'.
    #[arg(long, default_value = "vgpu.dev")]
    driver_name: String,
    /// This node's name (in a DaemonSet, from the pod's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Let claims share a device, each taking the memory it requests from
    /// the device's `memory` capacity (needs the cluster's
    /// DRAConsumableCapacity feature); otherwise each device goes whole to
    /// one claim.
    #[arg(long)]
    shared: bool,
    /// With --shared: the memory a request that names none takes.
    #[arg(long, default_value = "1GiB")]
    default_share: vgpu_api::Size,
    /// With --shared: the least memory a request may take (which bounds
    /// the tenants one device can have); requests go in 1MiB steps above.
    #[arg(long, default_value = "256MiB")]
    min_share: vgpu_api::Size,
    /// The most compute weight a claim's own configuration may ask (a
    /// DeviceClass's configuration, which the admin writes, may give more).
    #[arg(long, default_value_t = 100)]
    claim_max_weight: u32,
    /// Let a claim's own configuration ask for the latency priority class
    /// (a DeviceClass's configuration may give it either way).
    #[arg(long)]
    claim_latency: bool,
    /// A kubeconfig to reach the API server with; by default the pod's
    /// service account (or $KUBECONFIG).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The kubelet's directory (its plugins_registry/ and plugins/).
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    #[command(flatten)]
    host: HostArgs,
    /// The prefix of the names of the tenants the driver makes (the driver
    /// deletes only tenants it recorded making, whatever their names).
    #[arg(long, default_value = "dra-")]
    tenant_prefix: String,
    /// Seconds between looks at the devices and the driver's sockets.
    #[arg(long, default_value_t = 5)]
    poll_s: u64,
    /// Seconds between lookups of the prepared claims in the API server.
    #[arg(long, default_value_t = 60)]
    reconcile_s: u64,
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
    #[command(flatten)]
    host: HostArgs,
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

/// Checks a tenant name prefix: a name's start, at most 12 characters (a
/// made name adds the count, a tag and a secret, 26 characters or more,
/// and tenant names have at most 48).
fn check_prefix(prefix: &str) -> Result<(), String> {
    vgpu_api::tenant::validate_name(prefix.trim_end_matches(['-', '_', '.'])).and_then(|()| if prefix.len() > 12 { Err("at most 12 characters".into()) } else { Ok(()) })
}

/// A DRA driver's name: a DNS subdomain of at most 63 characters.
fn check_driver_name(name: &str) -> Result<(), String> {
    if name.contains('.') && vgpu_k8s::slices::is_dns_subdomain(name, 63) {
        Ok(())
    } else {
        Err(format!("{name:?} is not a driver name: a DNS subdomain of lower-case labels, at most 63 characters, such as vgpu.dev"))
    }
}

/// A node's name: a DNS subdomain of at most 253 characters.
fn check_node_name(name: &str) -> Result<(), String> {
    if vgpu_k8s::slices::is_dns_subdomain(name, 253) {
        Ok(())
    } else {
        Err(format!("{name:?} is not a node name (a DNS subdomain)"))
    }
}

/// Runs `fut` on a runtime of its own until it ends or SIGTERM/SIGINT:
/// what the component made stays recorded for its next start.
fn run_until_stopped(fut: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vgpu-k8s: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(|e| format!("SIGTERM: {e}"))?;
        tokio::select! {
            r = fut => r,
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

fn usage(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("vgpu-k8s: {e}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_env("VGPU_LOG").unwrap_or_else(|_| "info".into())).with_writer(std::io::stderr).init();
    match Cli::parse().cmd {
        Cmd::DevicePlugin(a) => device_plugin(a),
        Cmd::DraDriver(a) => dra_driver(a),
    }
}

fn device_plugin(a: PluginArgs) -> ExitCode {
    if let Err(e) = check_prefix(&a.tenant_prefix) {
        return usage(format!("--tenant-prefix: {e}"));
    }
    if a.poll_s == 0 || a.reconcile_s == 0 {
        return usage("--poll-s and --reconcile-s must be at least 1");
    }
    let host = match a.host.resolve() {
        Ok(h) => h,
        Err(e) => return usage(e),
    };
    let cfg = Config {
        kubelet_dir: a.kubelet_dir,
        host,
        resources: a.resources,
        cdi: !a.no_cdi,
        tenant_prefix: a.tenant_prefix,
        poll: Duration::from_secs(a.poll_s),
        reconcile: Duration::from_secs(a.reconcile_s),
        grace: Duration::from_secs(a.grace_s),
    };
    run_until_stopped(async { plugin::run(cfg).await.map_err(|e| e.to_string()) })
}

fn dra_driver(a: DraArgs) -> ExitCode {
    if let Err(e) = check_prefix(&a.tenant_prefix) {
        return usage(format!("--tenant-prefix: {e}"));
    }
    if let Err(e) = check_driver_name(&a.driver_name) {
        return usage(format!("--driver-name: {e}"));
    }
    if let Err(e) = check_node_name(&a.node_name) {
        return usage(format!("--node-name: {e}"));
    }
    if a.poll_s == 0 || a.reconcile_s == 0 {
        return usage("--poll-s and --reconcile-s must be at least 1");
    }
    if a.claim_max_weight == 0 || a.claim_max_weight > 10_000 {
        return usage("--claim-max-weight: 1 to 10000");
    }
    if a.min_share.0 < vgpu_k8s::claims::SHARE_STEP || !a.min_share.0.is_multiple_of(vgpu_k8s::claims::SHARE_STEP) {
        return usage("--min-share: a whole number of MiB, at least 1MiB");
    }
    if a.default_share.0 < a.min_share.0 {
        return usage("--default-share: at least --min-share");
    }
    let host = match a.host.resolve() {
        Ok(h) => h,
        Err(e) => return usage(e),
    };
    let cfg = DraConfig {
        driver: a.driver_name,
        node: a.node_name,
        kubelet_dir: a.kubelet_dir,
        host,
        tenant_prefix: a.tenant_prefix,
        sharing: if a.shared { Sharing::Shared { default: a.default_share.0, min: a.min_share.0 } } else { Sharing::Exclusive },
        limits: ClaimLimits { max_weight: a.claim_max_weight, latency: a.claim_latency },
        kubeconfig: a.kubeconfig,
        poll: Duration::from_secs(a.poll_s),
        reconcile: Duration::from_secs(a.reconcile_s),
    };
    run_until_stopped(async { dra::run(cfg).await.map_err(|e| e.to_string()) })
}
