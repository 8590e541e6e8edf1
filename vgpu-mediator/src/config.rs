//! The mediator's configuration: a TOML file whose tenant entries have the
//! same schema as `POST /tenants`, overridden by command-line flags.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::size::Size;

pub const DEFAULT_DEVICE_MEMORY: u64 = 512 << 20;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub run_dir: Option<PathBuf>,
    #[serde(default)]
    pub devices: DevicesConfig,
    #[serde(default)]
    pub tenants: Vec<TenantSpec>,
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
    /// Device name (e.g. `cpu0`); placed automatically when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// `process` (a host process or container, through a tenant socket) or
    /// `vm` (a VM's virtio-gpu device, through a vhost-user socket).
    #[serde(default)]
    pub kind: TenantKind,
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
        if self.devices.memory.0 < 1 << 20 || self.devices.memory.0 > 1 << 40 {
            return Err(ConfigError::Invalid(format!("devices.memory must be between 1MiB and 1TiB, not {}", self.devices.memory)));
        }
        for t in &self.tenants {
            t.validate().map_err(ConfigError::Invalid)?;
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
        if self.weight == 0 || self.weight > 10_000 {
            return Err(format!("tenant {}: weight must be 1..=10000, not {}", self.name, self.weight));
        }
        Ok(())
    }
}

/// Tenant names become socket file names: keep them short and plain.
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    if ok { Ok(()) } else { Err(format!("invalid tenant name {name:?}: use 1-48 letters, digits, '-', '_' or '.', starting with a letter or digit")) }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(c.tenants[0], TenantSpec { name: "alice".into(), memory: Size(256 << 20), weight: 2, device: Some("cpu1".into()), kind: TenantKind::Process });
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
        let c: Config = toml::from_str("[devices]\ncpu = 0\ncuda = \"required\"\ncuda_reserve = \"1GiB\"\n").unwrap();
        c.validate().unwrap();
        assert_eq!(c.devices.cuda_reserve.0, 1 << 30);
    }
}
