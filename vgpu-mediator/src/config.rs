//! The mediator's configuration: a TOML file whose tenant entries have the
//! same schema as `POST /tenants`, overridden by command-line flags.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::size::Size;

pub const DEFAULT_DEVICE_MEMORY: u64 = 512 << 20;
/// Most connections one tenant may be allowed.
pub const MAX_CONNECTIONS: u32 = 1024;

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
    /// Where VM descriptions and their console and VMM logs are kept
    /// (default: /var/lib/vgpu when the run directory is under /run, a
    /// tmpfs; RUN_DIR/state otherwise).
    #[serde(default)]
    pub state_dir: Option<PathBuf>,
    /// Seconds a stop waits for the guest to end before its VMM is killed
    /// (default 10).
    #[serde(default)]
    pub stop_timeout_s: Option<u64>,
    /// Run every VMM in `vgpu-vmm`'s jail as this `UID:GID` (not 0): its
    /// own PID, mount and network namespaces, no capabilities. The VM's
    /// kernel, initramfs and disks must be readable (disks writable) by it;
    /// the VM's vGPU socket is made its. Default: no jail.
    #[serde(default)]
    pub jail: Option<Owner>,
}

/// Usage records and the Prometheus listener.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MeteringConfig {
    /// Seconds each usage record covers (default 60).
    #[serde(default)]
    pub interval_s: Option<u64>,
    /// The usage file (JSON lines). Default: /var/lib/vgpu/usage.jsonl when
    /// the run directory is under /run (a tmpfs), RUN_DIR/usage.jsonl
    /// otherwise.
    #[serde(default)]
    pub usage_file: Option<PathBuf>,
    /// Also serve GET /metrics on this TCP address (e.g. 127.0.0.1:9400);
    /// off unless set.
    #[serde(default)]
    pub metrics_listen: Option<std::net::SocketAddr>,
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
    /// A GPU kernel running longer than this is stopped by destroying its
    /// tenant's context (milliseconds).
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
    /// The unprivileged user device workers run as once their device is
    /// open: a user name or `UID:GID`. Used when the mediator runs as root.
    #[serde(default = "default_worker_user")]
    pub worker_user: String,
    /// CPU device workers run under their seccomp allow-lists.
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
    /// PCI devices (GPUs above all) lent whole to managed VMs from their
    /// pools and scrubbed on return (docs/passthrough.md). A GPU listed
    /// here gets no worker.
    #[serde(default)]
    pub passthrough: Vec<crate::control::passthrough::PassthroughConfig>,
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

/// A socket owner or process identity: `UID:GID`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl std::str::FromStr for Owner {
    type Err = String;
    fn from_str(s: &str) -> Result<Owner, String> {
        let (u, g) = s.split_once(':').ok_or_else(|| format!("owner {s:?} is not UID:GID"))?;
        let num = |v: &str| v.parse::<u32>().ok().filter(|n| *n != u32::MAX).ok_or_else(|| format!("owner {s:?}: {v:?} is not a numeric id"));
        Ok(Owner { uid: num(u)?, gid: num(g)? })
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.uid, self.gid)
    }
}

impl Serialize for Owner {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Owner {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Owner, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
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

/// A compute capability "MAJOR.MINOR" a CPU device can report: 7.0 to 12.1.
pub fn parse_compute_capability(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("compute capability must be MAJOR.MINOR from 7.0 to 12.1 (e.g. 8.0), not '{s}'");
    let (a, b) = s.split_once('.').ok_or_else(bad)?;
    let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    // NVIDIA's architectures: 7.x, 8.x, 9.0, 10.x, 11.0, 12.x.
    if !(7..=12).contains(&a) || b > 9 || (a == 9 && b != 0) || (a == 11 && b != 0) || (a == 12 && b > 1) {
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
            worker_user: default_worker_user(),
            seccomp: true,
            connection_threads: default_connection_threads(),
            overcommit: 1.0,
            spill: Size(0),
            compute_nice: default_compute_nice(),
            pin_lanes: true,
            passthrough: Vec::new(),
        }
    }
}

/// A tenant, as `POST /tenants` takes it and the config file lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub name: String,
    /// Memory quota.
    pub memory: Size,
    #[serde(default = "weight_one")]
    pub weight: u32,
    /// Hard cap: the percentage (1..=100) of the device's time the tenant
    /// never exceeds, even alone on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<u32>,
    /// `latency` (goes first within its share), `normal` or `batch`.
    #[serde(default)]
    pub priority: crate::sched::Priority,
    /// Device name (e.g. `cpu0`); placed by its pool's policy when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The pool to place the tenant in (default: the device's pool, or the
    /// pool `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The NUMA node the tenant's VM or process runs on: placement prefers
    /// a device attached to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// `process` (a host process or container, through a tenant socket) or
    /// `vm` (a VM's virtio-gpu device, through a vhost-user socket).
    #[serde(default)]
    pub kind: TenantKind,
    /// Owner of the tenant's socket, `UID:GID` (default root): the user or
    /// container that may be this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    /// Mode of the tenant's socket, octal (default `0600`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Host memory the tenant's objects may keep in its worker (default
    /// `devices.tenant_host_memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<Size>,
    /// Client connections the tenant may hold at once (default
    /// `devices.tenant_connections`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantKind {
    #[default]
    Process,
    Vm,
}

fn weight_one() -> u32 {
    1
}

/// Checks a tenant's weight and cap.
pub fn check_share(name: &str, weight: u32, cap: Option<u32>) -> Result<(), String> {
    if weight == 0 || weight > 10_000 {
        return Err(format!("tenant {name}: weight must be 1..=10000, not {weight}"));
    }
    if let Some(c) = cap {
        if c == 0 || c > 100 {
            return Err(format!("tenant {name}: cap must be a percentage of the device, 1..=100, not {c}"));
        }
    }
    Ok(())
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
        Ok(())
    }
}

impl TenantSpec {
    pub fn validate(&self) -> Result<(), String> {
        validate_name(&self.name)?;
        if self.memory.0 == 0 {
            return Err(format!("tenant {}: memory quota must be positive", self.name));
        }
        check_share(&self.name, self.weight, self.cap)?;
        if let Some(n) = self.numa_node {
            if n >= 1024 {
                return Err(format!("tenant {}: numa_node must be below 1024, not {n}", self.name));
            }
        }
        if let Some(p) = &self.pool {
            validate_name(p).map_err(|e| format!("tenant {}: pool: {e}", self.name))?;
        }
        if let Some(m) = &self.mode {
            match u32::from_str_radix(m, 8) {
                Ok(v) if v & !0o777 == 0 && v & 0o600 == 0o600 => {}
                _ => return Err(format!("tenant {}: mode {m:?} must be octal permission bits (at most 0777) that include 0600", self.name)),
            }
        }
        if let Some(h) = self.host_memory {
            if h.0 < 1 << 20 {
                return Err(format!("tenant {}: host_memory must be at least 1MiB, not {h}", self.name));
            }
        }
        if let Some(c) = self.max_connections {
            if c == 0 || c > MAX_CONNECTIONS {
                return Err(format!("tenant {}: max_connections must be 1..={MAX_CONNECTIONS}, not {c}", self.name));
            }
        }
        Ok(())
    }

    /// The socket's permission bits.
    pub fn mode_bits(&self) -> u32 {
        self.mode.as_deref().and_then(|m| u32::from_str_radix(m, 8).ok()).unwrap_or(0o600)
    }
}

/// Tenant names become socket file names: keep them short and plain.
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty() && name.len() <= 48 && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(format!("invalid tenant name {name:?}: use 1-48 letters, digits, '-', '_' or '.', starting with a letter or digit"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                max_connections: None
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
        let c: Config = toml::from_str("[devices]\novercommit = 0.5\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("devices.overcommit"));
        assert!(toml::from_str::<Config>("[[pools]]\nname = \"x\"\ndevices = [\"cpu0\"]\nplacement = \"random\"\n").is_err());
        let c: Config = toml::from_str("[devices]\ncpu = 0\ncuda = \"required\"\ncuda_reserve = \"1GiB\"\n").unwrap();
        c.validate().unwrap();
        assert_eq!(c.devices.cuda_reserve.0, 1 << 30);
    }
}
