//! The mediator's configuration: a TOML file whose tenant entries have the
//! same schema as `POST /tenants`, overridden by command-line flags.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::size::Size;
pub use vgpu_api::tenant::{check_share, validate_name, Owner, TenantKind, TenantSpec};

pub const DEFAULT_DEVICE_MEMORY: u64 = 512 << 20;
pub use vgpu_api::tenant::MAX_CONNECTIONS;
/// Connections the admin API socket (`RUN_DIR/api.sock`, root's only)
/// serves at once: `vgpuctl` and the VM manager use one per request, so
/// this is room for many at once; never more than an eighth of the
/// descriptor limit (`vgpu_api::serve::Limits::within_fd_limit`).
pub const API_MAX_CONNECTIONS: usize = 64;
/// Default `metering.metrics_max_connections`: a Prometheus server keeps
/// one connection per scrape target; this leaves room for several scrapers
/// and their retries.
pub const METRICS_MAX_CONNECTIONS: usize = 32;
/// The most `metering.metrics_max_connections` may be set to.
pub const METRICS_MAX_CONNECTIONS_LIMIT: usize = 4096;
/// Most execution lanes a CPU device may have: each takes four engine
/// threads in every process that serves the device.
pub const MAX_LANES: u32 = 1024;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub run_dir: Option<PathBuf>,
    #[serde(default)]
    pub devices: DevicesConfig,
    #[serde(default)]
    pub tenants: Vec<TenantSpec>,
    /// Device pools; devices no pool lists are in the public pool `default`.
    #[serde(default)]
    pub pools: Vec<crate::control::pool::PoolSpec>,
    #[serde(default)]
    pub metering: MeteringConfig,
    #[serde(default)]
    pub vms: VmsConfig,
}

/// Managed VMs (`/vms`, docs/vms.md).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct VmsConfig {
    /// The `vgpu-vmm` binary (default: the one beside `vgpu-mediatord`).
    #[serde(default)]
    pub vmm: Option<PathBuf>,
    /// Where tenants, pools, VM descriptions and their console and VMM logs are kept
    /// (default: /var/lib/vgpu when the run directory is under /run, a
    /// tmpfs; RUN_DIR/state otherwise).
    #[serde(default)]
    pub state_dir: Option<PathBuf>,
    /// Seconds a stop waits for the guest to end before its VMM is killed
    /// (default 10; 1 to 3600, as a stop's own `timeout`).
    #[serde(default)]
    pub stop_timeout_s: Option<u64>,
    /// Run every VMM in `vgpu-vmm`'s jail as this `UID:GID` (not 0): its
    /// own PID, mount and network namespaces, no capabilities. The VM's
    /// kernel, initramfs and disks must be readable (disks writable) by it;
    /// the VM's vGPU socket is made its. `"off"`: no jail. Default: when
    /// the daemon runs as root, the jail as the device workers' user
    /// (`devices.worker_user`, `vgpu`) and its group ([`resolve_vm_jail`]).
    #[serde(default)]
    pub jail: Option<VmJail>,
}

/// `vms.jail` (and `--vm-jail` / `--no-vm-jail`): an explicit choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmJail {
    /// VMMs run unjailed, as the daemon's user.
    Off,
    /// VMMs are jailed as these ids.
    As(Owner),
}

impl std::str::FromStr for VmJail {
    type Err = String;
    fn from_str(s: &str) -> Result<VmJail, String> {
        if s == "off" {
            return Ok(VmJail::Off);
        }
        s.parse().map(VmJail::As).map_err(|e| format!("{e}; give UID:GID, or \"off\" for no jail"))
    }
}

impl<'de> Deserialize<'de> for VmJail {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<VmJail, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// How managed VMs' VMMs run, and what the log must say about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmJailChoice {
    /// Jailed as these ids, or unjailed.
    pub jail: Option<Owner>,
    /// Why the default jail could not be used (one warning for the log).
    pub warning: Option<String>,
}

/// Decides the VM jail: an explicit choice (`--vm-jail`, `--no-vm-jail`,
/// `vms.jail`) wins; otherwise a daemon running as root (`euid` 0) jails
/// its VMMs as `user` (`devices.worker_user`, by default the system user
/// `vgpu` that scripts/setup.sh creates), resolved by `lookup` (getpwnam,
/// as for the workers) to its uid and primary group. Not root, or no such
/// user (or one with uid or gid 0): unjailed, with a warning saying why.
pub fn resolve_vm_jail(explicit: Option<VmJail>, euid: u32, user: &str, lookup: impl FnOnce(&str) -> Result<Owner, String>) -> VmJailChoice {
    let unjailed = |why: String| VmJailChoice { jail: None, warning: Some(why) };
    match explicit {
        Some(VmJail::Off) => VmJailChoice { jail: None, warning: None },
        Some(VmJail::As(o)) => VmJailChoice { jail: Some(o), warning: None },
        None if euid != 0 => unjailed(format!(
            "managed VMs run unjailed, as this daemon's user (uid {euid}): the VM jail needs root (namespaces, mounts, changing uid); --no-vm-jail (vms.jail = \"off\") says so and silences this warning"
        )),
        None => match lookup(user) {
            Ok(o) if o.uid != 0 && o.gid != 0 => VmJailChoice { jail: Some(o), warning: None },
            Ok(o) => unjailed(format!("managed VMs run unjailed, AS ROOT: the jail's user {user} is {o}, and a jail must not be uid or gid 0; give --vm-jail UID:GID, or --no-vm-jail to run them unjailed knowingly")),
            Err(e) => unjailed(format!(
                "managed VMs run unjailed, AS ROOT: their jail runs them as {user}, but {e}; create that user (scripts/setup.sh does), give --vm-jail UID:GID, or --no-vm-jail to run them unjailed knowingly"
            )),
        },
    }
}

/// Usage records and the Prometheus listener.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MeteringConfig {
    /// Seconds each usage record covers (default 60).
    #[serde(default)]
    pub interval_s: Option<u64>,
    /// The usage file (JSON lines). Default: STATE_DIR/usage.jsonl
    /// (/var/lib/vgpu/usage.jsonl unless the state directory is moved) when
    /// the run directory is under /run (a tmpfs), RUN_DIR/usage.jsonl
    /// otherwise.
    #[serde(default)]
    pub usage_file: Option<PathBuf>,
    /// Also serve GET /metrics on this TCP address (e.g. 127.0.0.1:9400);
    /// off unless set.
    #[serde(default)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Connections the metrics listener serves at once (default 32, at
    /// most an eighth of the descriptor limit); more are closed at accept.
    #[serde(default)]
    pub metrics_max_connections: Option<usize>,
    /// Milliseconds a metrics connection may take to send a request head,
    /// from its start or from the previous response (default 10000).
    #[serde(default)]
    pub metrics_header_timeout_ms: Option<u64>,
    /// Milliseconds a metrics connection may move no byte while the
    /// listener waits on it (default 30000).
    #[serde(default)]
    pub metrics_idle_timeout_ms: Option<u64>,
}

impl MeteringConfig {
    /// The metrics listener's limits, before the descriptor limit is
    /// applied.
    pub fn metrics_limits(&self) -> vgpu_api::serve::Limits {
        let ms = |v: Option<u64>, default: std::time::Duration| v.map_or(default, std::time::Duration::from_millis);
        vgpu_api::serve::Limits {
            max_connections: self.metrics_max_connections.unwrap_or(METRICS_MAX_CONNECTIONS),
            header_timeout: ms(self.metrics_header_timeout_ms, vgpu_api::serve::HEADER_TIMEOUT),
            idle_timeout: ms(self.metrics_idle_timeout_ms, vgpu_api::serve::IDLE_TIMEOUT),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicesConfig {
    /// Number of CPU reference devices.
    #[serde(default = "one")]
    pub cpu: u32,
    /// Memory of each CPU device.
    #[serde(default = "default_memory")]
    pub memory: Size,
    /// Instructions one kernel launch may execute on a CPU device.
    #[serde(default = "default_budget")]
    pub instruction_budget: u64,
    /// Execution lanes per device (0: one per host CPU).
    #[serde(default)]
    pub lanes: u32,
    /// NVIDIA GPUs: `auto` serves every GPU and MIG instance NVML lists
    /// (none on a machine without a driver), `off` none, `required` fails
    /// start-up when there is none.
    #[serde(default)]
    pub cuda: CudaMode,
    /// Device memory kept back from placement on each GPU or MIG instance,
    /// for the per-tenant CUDA contexts and the worker's own.
    #[serde(default = "default_cuda_reserve")]
    pub cuda_reserve: Size,
    /// A GPU kernel running longer than this fails with
    /// CUDA_ERROR_LAUNCH_TIMEOUT and is stopped (milliseconds): its
    /// tenant's executor ends, or in a shared worker its tenant's context
    /// is destroyed.
    #[serde(default = "default_launch_timeout")]
    pub cuda_launch_timeout_ms: u64,
    /// A kernel on a CPU device running longer than this fails with
    /// CUDA_ERROR_LAUNCH_TIMEOUT (milliseconds), whatever its budget.
    #[serde(default = "default_cpu_launch_timeout")]
    pub launch_timeout_ms: u64,
    /// The compute capability CPU devices report, "7.0" to "9.0"; modules
    /// whose `.target` is newer are refused (CUDA_ERROR_NO_BINARY_FOR_GPU).
    #[serde(default = "default_compute_capability")]
    pub compute_capability: String,
    /// Host memory each tenant's objects may keep in its worker (parsed
    /// modules, handles, connections, payloads in flight), unless the
    /// tenant's description says otherwise.
    #[serde(default = "default_tenant_host_memory")]
    pub tenant_host_memory: Size,
    /// Client connections each tenant may hold at once, unless the
    /// tenant's description says otherwise.
    #[serde(default = "default_tenant_connections")]
    pub tenant_connections: u32,
    /// Most tenants (VM tenants and managed VMs' included) the daemon
    /// holds at once: each costs an executor process, daemon threads and
    /// descriptors, and a state file.
    #[serde(default = "default_max_tenants")]
    pub max_tenants: u32,
    /// The unprivileged user device workers run as once their device is
    /// open: a user name or `UID:GID`. Used when the mediator runs as root.
    #[serde(default = "default_worker_user")]
    pub worker_user: String,
    /// Device workers (CPU devices, GPU arbiters and executors) run under
    /// their seccomp allow-lists; a GPU's add what NVIDIA's driver calls.
    #[serde(default = "yes")]
    pub seccomp: bool,
    /// Executor threads each worker serves its tenants' sockets with,
    /// however many tenants and connections it has.
    #[serde(default = "default_connection_threads")]
    pub connection_threads: u32,
    /// The default pool's overcommit ratio: quotas on each of its devices
    /// may add up to this times the device's memory (1: none).
    #[serde(default = "overcommit_one")]
    pub overcommit: f64,
    /// Host RAM each CPU device's allocations may spill to once its memory
    /// is full (0: none; an allocation that does not fit fails).
    #[serde(default)]
    pub spill: Size,
    /// The nice value CPU device threads run kernels at (0 to 19; 0: off),
    /// so the worker's control threads, which take and answer other
    /// tenants' launches, go first on a busy host (docs/scheduling.md).
    #[serde(default = "default_compute_nice")]
    pub compute_nice: i32,
    /// Pin each CPU device lane's kernels to a core of its own (the
    /// worker's cores in turn), so two kernels never share a core while
    /// another sits idle (docs/scheduling.md). Turn off on hosts whose
    /// cores also run other work.
    #[serde(default = "yes")]
    pub pin_lanes: bool,
    /// Isolation of tenants sharing a device: "process" gives each tenant
    /// an executor process of its own under a uid of its own, scheduled
    /// by the device's arbiter; "shared" serves every tenant of the device
    /// in one worker process (docs/architecture.md). Unset: "process",
    /// except on CPU devices with memory overcommit or spill configured,
    /// which need "shared".
    #[serde(default)]
    pub isolation: Option<Isolation>,
    /// The uids tenant executors run as, "FIRST-LAST", one per live
    /// executor (used when the daemon runs as root).
    #[serde(default = "default_executor_uids")]
    pub executor_uids: String,
    /// NVIDIA's MPS control daemon, started for each GPU of a pool whose
    /// sharing is "mps" (a command on PATH, or a path).
    #[serde(default = "default_mps_control")]
    pub mps_control: String,
    /// The most tenants one GPU of an "mps" pool serves (MPS clients; at
    /// most 48, what MPS takes per device from Volta on).
    #[serde(default = "default_mps_max_clients")]
    pub mps_max_clients: u32,
    /// PCI devices (GPUs above all) lent whole to managed VMs from their
    /// pools and scrubbed on return (docs/passthrough.md). A GPU listed
    /// here gets no worker.
    #[serde(default)]
    pub passthrough: Vec<crate::control::passthrough::PassthroughConfig>,
}

/// How tenants sharing a device are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// One worker process holds every tenant of the device.
    #[default]
    Shared,
    /// One executor process per tenant, and the device's arbiter.
    Process,
}

impl DevicesConfig {
    /// The isolation of CPU devices: "process" unless configured, or
    /// "shared" where memory overcommit or spill is configured and the
    /// isolation is not (device memory is not brokered between executors).
    pub fn cpu_isolation(&self) -> Isolation {
        self.isolation.unwrap_or(if self.needs_shared_memory() { Isolation::Shared } else { Isolation::Process })
    }

    /// Memory overcommit or spill is configured: both need every tenant of
    /// a CPU device in one worker process.
    pub fn needs_shared_memory(&self) -> bool {
        self.overcommit > 1.0 || self.spill.0 > 0
    }

    /// The isolation of GPUs and MIG instances: "process" unless configured.
    pub fn gpu_isolation(&self) -> Isolation {
        self.isolation.unwrap_or(Isolation::Process)
    }
}

fn default_mps_max_clients() -> u32 {
    crate::control::mps::MPS_LANES
}

fn default_mps_control() -> String {
    crate::control::mps::DEFAULT_CONTROL.into()
}

fn default_executor_uids() -> String {
    let (first, count) = crate::control::executors::DEFAULT_UIDS;
    format!("{first}-{}", first + (count - 1))
}

/// Parses "FIRST-LAST" into (first, count); no uid below 65536 (those are
/// users'), and not 2^32-1 (the "no uid" value).
pub fn parse_uid_range(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once('-').ok_or_else(|| format!("uid range {s:?}: expected FIRST-LAST"))?;
    let first: u32 = a.trim().parse().map_err(|_| format!("uid range {s:?}: {a:?} is not a uid"))?;
    let last: u32 = b.trim().parse().map_err(|_| format!("uid range {s:?}: {b:?} is not a uid"))?;
    if first < 65_536 || last < first || last == u32::MAX {
        return Err(format!("uid range {s:?}: must lie within 65536-4294967294, first before last"));
    }
    Ok((first, last - first + 1))
}

fn default_compute_nice() -> i32 {
    10
}

fn overcommit_one() -> f64 {
    1.0
}

fn default_connection_threads() -> u32 {
    4
}

fn yes() -> bool {
    true
}

/// Resolves a user name or `UID:GID` to ids.
pub fn resolve_user(s: &str) -> Result<Owner, String> {
    if let Ok(o) = s.parse::<Owner>() {
        return Ok(o);
    }
    let name = std::ffi::CString::new(s).map_err(|_| format!("bad user name {s:?}"))?;
    // SAFETY: an all-zero passwd is a valid out-parameter.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16384];
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live buffer of the stated size.
    let rc = unsafe { libc::getpwnam_r(name.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() {
        return Err(format!("no user named {s:?} (create it with `useradd --system --no-create-home --shell /usr/sbin/nologin {s}`, or set devices.worker_user to UID:GID)"));
    }
    Ok(Owner { uid: pw.pw_uid, gid: pw.pw_gid })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CudaMode {
    #[default]
    Auto,
    Off,
    Required,
}

fn default_cuda_reserve() -> Size {
    Size(2 << 30)
}
fn default_launch_timeout() -> u64 {
    30_000
}
fn default_cpu_launch_timeout() -> u64 {
    10_000
}
fn default_compute_capability() -> String {
    "8.0".to_string()
}

/// A compute capability "MAJOR.MINOR" a CPU device can report: one of
/// NVIDIA's architectures from 7.0 to 12.1, or a major from 13 to 99 (an
/// architecture no library ships machine code for, so libraries that carry
/// forward-compatible PTX, cuBLAS among them, take that path).
pub fn parse_compute_capability(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("compute capability must be MAJOR.MINOR, one of NVIDIA's architectures from 7.0 to 12.1 or a newer major from 13.0 to 99.9 (e.g. 8.0), not '{s}'");
    let (a, b) = s.split_once('.').ok_or_else(bad)?;
    let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    // NVIDIA's architectures: 7.x, 8.x, 9.0, 10.x, 11.0, 12.0 and 12.1;
    // any minor of a major above them.
    if !(7..=99).contains(&a) || b > 9 || (a == 9 && b != 0) || (a == 11 && b != 0) || (a == 12 && b > 1) {
        return Err(bad());
    }
    Ok((a, b))
}
fn default_tenant_host_memory() -> Size {
    Size(256 << 20)
}
fn default_tenant_connections() -> u32 {
    64
}
fn default_max_tenants() -> u32 {
    1024
}
/// The highest `devices.max_tenants`.
pub const MAX_TENANTS_LIMIT: u32 = 65536;
fn default_worker_user() -> String {
    "vgpu".into()
}

fn one() -> u32 {
    1
}
fn default_memory() -> Size {
    Size(DEFAULT_DEVICE_MEMORY)
}
fn default_budget() -> u64 {
    crate::backend::cpu::DEFAULT_BUDGET
}

impl Default for DevicesConfig {
    fn default() -> Self {
        DevicesConfig {
            cpu: 1,
            memory: default_memory(),
            instruction_budget: default_budget(),
            lanes: 0,
            cuda: CudaMode::Auto,
            cuda_reserve: default_cuda_reserve(),
            cuda_launch_timeout_ms: default_launch_timeout(),
            launch_timeout_ms: default_cpu_launch_timeout(),
            compute_capability: default_compute_capability(),
            tenant_host_memory: default_tenant_host_memory(),
            tenant_connections: default_tenant_connections(),
            max_tenants: default_max_tenants(),
            worker_user: default_worker_user(),
            seccomp: true,
            connection_threads: default_connection_threads(),
            overcommit: 1.0,
            spill: Size(0),
            compute_nice: default_compute_nice(),
            pin_lanes: true,
            isolation: None,
            executor_uids: default_executor_uids(),
            mps_control: default_mps_control(),
            mps_max_clients: default_mps_max_clients(),
            passthrough: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("{path}: {err}")]
    Parse { path: String, err: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read { path: path.display().to_string(), err })?;
        let c: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.display().to_string(), err: e.to_string() })?;
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.devices.cpu > 64 || (self.devices.cpu == 0 && self.devices.cuda == CudaMode::Off) {
            return Err(ConfigError::Invalid(format!("devices.cpu must be 1..=64 (0 only with GPUs), not {}", self.devices.cpu)));
        }
        if !(1..=crate::control::mps::MPS_LANES).contains(&self.devices.mps_max_clients) {
            return Err(ConfigError::Invalid(format!("devices.mps_max_clients must be 1..={}, not {}", crate::control::mps::MPS_LANES, self.devices.mps_max_clients)));
        }
        if self.devices.cuda_launch_timeout_ms == 0 || self.devices.cuda_launch_timeout_ms > 3_600_000 {
            return Err(ConfigError::Invalid(format!("devices.cuda_launch_timeout_ms must be 1..=3600000, not {}", self.devices.cuda_launch_timeout_ms)));
        }
        parse_compute_capability(&self.devices.compute_capability).map_err(|e| ConfigError::Invalid(format!("devices.compute_capability: {e}")))?;
        if self.devices.launch_timeout_ms == 0 || self.devices.launch_timeout_ms > 3_600_000 {
            return Err(ConfigError::Invalid(format!("devices.launch_timeout_ms must be 1..=3600000, not {}", self.devices.launch_timeout_ms)));
        }
        if self.devices.tenant_host_memory.0 < 1 << 20 {
            return Err(ConfigError::Invalid(format!("devices.tenant_host_memory must be at least 1MiB, not {}", self.devices.tenant_host_memory)));
        }
        if self.devices.tenant_connections == 0 || self.devices.tenant_connections > MAX_CONNECTIONS {
            return Err(ConfigError::Invalid(format!("devices.tenant_connections must be 1..={MAX_CONNECTIONS}, not {}", self.devices.tenant_connections)));
        }
        if self.devices.max_tenants == 0 || self.devices.max_tenants > MAX_TENANTS_LIMIT {
            return Err(ConfigError::Invalid(format!("devices.max_tenants must be 1..={MAX_TENANTS_LIMIT}, not {}", self.devices.max_tenants)));
        }
        if self.devices.lanes > MAX_LANES {
            return Err(ConfigError::Invalid(format!("devices.lanes must be 0 (one per host CPU) to {MAX_LANES}, not {}", self.devices.lanes)));
        }
        if self.devices.connection_threads == 0 || self.devices.connection_threads > 64 {
            return Err(ConfigError::Invalid(format!("devices.connection_threads must be 1..=64, not {}", self.devices.connection_threads)));
        }
        if self.devices.memory.0 < 1 << 20 || self.devices.memory.0 > 1 << 40 {
            return Err(ConfigError::Invalid(format!("devices.memory must be between 1MiB and 1TiB, not {}", self.devices.memory)));
        }
        for t in &self.tenants {
            t.validate().map_err(ConfigError::Invalid)?;
        }
        crate::control::pool::check_overcommit(crate::control::pool::DEFAULT_POOL, self.devices.overcommit).map_err(|e| ConfigError::Invalid(format!("devices.overcommit: {e}")))?;
        if !(0..=crate::nice::MAX).contains(&self.devices.compute_nice) {
            return Err(ConfigError::Invalid(format!("devices.compute_nice must be 0 (off) to {}, not {}", crate::nice::MAX, self.devices.compute_nice)));
        }
        if self.devices.spill.0 > 1 << 40 {
            return Err(ConfigError::Invalid(format!("devices.spill must be at most 1TiB, not {}", self.devices.spill)));
        }
        for p in &self.pools {
            p.validate().map_err(ConfigError::Invalid)?;
        }
        if let Some(i) = self.metering.interval_s {
            if i == 0 || i > 86_400 {
                return Err(ConfigError::Invalid(format!("metering.interval_s must be 1..=86400, not {i}")));
            }
        }
        if let Some(n) = self.metering.metrics_max_connections {
            if n == 0 || n > METRICS_MAX_CONNECTIONS_LIMIT {
                return Err(ConfigError::Invalid(format!("metering.metrics_max_connections must be 1..={METRICS_MAX_CONNECTIONS_LIMIT}, not {n}")));
            }
        }
        if let Some(t) = self.vms.stop_timeout_s {
            if t == 0 || t > 3600 {
                return Err(ConfigError::Invalid(format!("vms.stop_timeout_s must be 1..=3600, not {t}")));
            }
        }
        for (key, v) in [("metrics_header_timeout_ms", self.metering.metrics_header_timeout_ms), ("metrics_idle_timeout_ms", self.metering.metrics_idle_timeout_ms)] {
            if v.is_some_and(|ms| ms == 0 || ms > 3_600_000) {
                return Err(ConfigError::Invalid(format!("metering.{key} must be 1..=3600000, not {}", v.unwrap_or_default())));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn managed_vms_are_jailed_as_the_workers_user_by_default_when_root() {
        let vgpu = Owner { uid: 999, gid: 995 };
        let found = |name: &str| if name == "vgpu" { Ok(vgpu) } else { Err(format!("no user named {name:?}")) };
        // Root, the user exists: jailed as it and its group, quietly.
        assert_eq!(resolve_vm_jail(None, 0, "vgpu", found), VmJailChoice { jail: Some(vgpu), warning: None });
        // --no-vm-jail (vms.jail = "off"): none, quietly.
        assert_eq!(resolve_vm_jail(Some(VmJail::Off), 0, "vgpu", found), VmJailChoice { jail: None, warning: None });
        // An explicit UID:GID wins over the default.
        let mine = Owner { uid: 40124, gid: 40124 };
        assert_eq!(resolve_vm_jail(Some(VmJail::As(mine)), 0, "vgpu", found), VmJailChoice { jail: Some(mine), warning: None });
        // Root without the user: unjailed, and the warning says why.
        let c = resolve_vm_jail(None, 0, "nobody-here", found);
        assert_eq!(c.jail, None);
        assert!(c.warning.as_deref().is_some_and(|w| w.contains("AS ROOT") && w.contains("no user named \"nobody-here\"") && w.contains("--no-vm-jail")), "{c:?}");
        // A user that is root in disguise is not a jail.
        let c = resolve_vm_jail(None, 0, "vgpu", |_| Ok(Owner { uid: 999, gid: 0 }));
        assert!(c.jail.is_none() && c.warning.as_deref().is_some_and(|w| w.contains("gid 0")), "{c:?}");
        // Not root: unjailed (the jail needs root), with the reason; the
        // user is not even looked up.
        let c = resolve_vm_jail(None, 1000, "vgpu", |_| panic!("looked up"));
        assert_eq!(c.jail, None);
        assert!(c.warning.as_deref().is_some_and(|w| w.contains("needs root")), "{c:?}");
        // The config file's forms.
        let v: VmsConfig = toml::from_str("jail = \"off\"").unwrap();
        assert_eq!(v.jail, Some(VmJail::Off));
        let v: VmsConfig = toml::from_str("jail = \"1000:1001\"").unwrap();
        assert_eq!(v.jail, Some(VmJail::As(Owner { uid: 1000, gid: 1001 })));
        assert_eq!(toml::from_str::<VmsConfig>("").unwrap().jail, None);
        assert!(toml::from_str::<VmsConfig>("jail = \"on\"").unwrap_err().to_string().contains("\"off\" for no jail"));
    }

    #[test]
    fn the_packaged_sample_configuration_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/mediator.toml");
        let c = Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.run_dir.as_deref(), Some(Path::new("/run/vgpu")));
        assert_eq!(c.devices.compute_nice, 10);
        assert!(c.devices.pin_lanes);
        assert_eq!(c.vms.stop_timeout_s, Some(10));
    }

    #[test]
    fn config_file_uses_the_api_tenant_schema() {
        let c: Config = toml::from_str(
            r#"
run_dir = "/run/vgpu"
[devices]
cpu = 2
memory = "1GiB"
[[tenants]]
name = "alice"
memory = "256MiB"
weight = 2
device = "cpu1"
[[tenants]]
name = "bob"
memory = 1048576
"#,
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.devices.memory.0, 1 << 30);
        assert_eq!(
            c.tenants[0],
            TenantSpec {
                name: "alice".into(),
                memory: Size(256 << 20),
                weight: 2,
                cap: None,
                priority: Default::default(),
                device: Some("cpu1".into()),
                pool: None,
                numa_node: None,
                kind: TenantKind::Process,
                owner: None,
                mode: None,
                host_memory: None,
                max_connections: None,
                hidden: false
            }
        );
        assert_eq!(c.tenants[1].weight, 1);
        let api: TenantSpec = serde_json::from_str(r#"{"name":"bob","memory":"1MiB"}"#).unwrap();
        assert_eq!(api, c.tenants[1]);
    }

    #[test]
    fn bad_configs_are_rejected_with_reasons() {
        assert!(toml::from_str::<Config>("[devices]\ncpus = 2\n").is_err(), "unknown field");
        let c: Config = toml::from_str("[devices]\nmemory = \"12\"\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("devices.memory"));
        assert!(validate_name("../x").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name("tenant-1").is_ok());
        let c: Config = toml::from_str("[devices]\ncpu = 0\ncuda = \"off\"\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("0 only with GPUs"));
        assert!(toml::from_str::<Config>("[devices]\ncuda = \"sometimes\"\n").is_err());
        let c: Config = toml::from_str("[[pools]]\nname = \"x\"\ndevices = []\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("list at least one device"));
        let c: Config = toml::from_str("[devices]\nlanes = 5000\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("devices.lanes must be 0 (one per host CPU) to 1024"));
        let c: Config = toml::from_str("[devices]\novercommit = 0.5\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("devices.overcommit"));
        assert!(toml::from_str::<Config>("[[pools]]\nname = \"x\"\ndevices = [\"cpu0\"]\nplacement = \"random\"\n").is_err());
        let c: Config = toml::from_str("[devices]\ncpu = 0\ncuda = \"required\"\ncuda_reserve = \"1GiB\"\n").unwrap();
        c.validate().unwrap();
        assert_eq!(c.devices.cuda_reserve.0, 1 << 30);
    }

    #[test]
    fn metrics_listener_limits_default_and_are_checked() {
        let l = Config::default().metering.metrics_limits();
        assert_eq!(l, vgpu_api::serve::Limits::with_connections(METRICS_MAX_CONNECTIONS));
        let c: Config = toml::from_str("[metering]\nmetrics_max_connections = 4\nmetrics_header_timeout_ms = 500\nmetrics_idle_timeout_ms = 700\n").unwrap();
        c.validate().unwrap();
        let l = c.metering.metrics_limits();
        assert_eq!((l.max_connections, l.header_timeout.as_millis(), l.idle_timeout.as_millis()), (4, 500, 700));
        for bad in ["metrics_max_connections = 0", "metrics_max_connections = 5000", "metrics_header_timeout_ms = 0", "metrics_idle_timeout_ms = 3600001"] {
            let c: Config = toml::from_str(&format!("[metering]\n{bad}\n")).unwrap();
            let key = bad.split(' ').next().unwrap();
            assert!(c.validate().is_err_and(|e| e.to_string().contains(key)), "{bad}");
        }
    }

    #[test]
    fn compute_capabilities_are_nvidia_architectures_or_newer_majors() {
        for (text, want) in [("7.0", (7, 0)), ("8.9", (8, 9)), ("9.0", (9, 0)), ("12.1", (12, 1)), ("13.0", (13, 0)), ("99.9", (99, 9))] {
            assert_eq!(parse_compute_capability(text), Ok(want), "{text}");
        }
        for bad in ["6.1", "9.1", "11.2", "12.2", "100.0", "8.10", "8", "8.x", "", "-1.0"] {
            assert!(parse_compute_capability(bad).is_err_and(|e| e.contains(&format!("'{bad}'"))), "{bad}");
        }
    }
}
