//! Tenants as the mediator's API (`POST /tenants`, `PATCH /tenants/NAME`),
//! its config file (`[[tenants]]`) and `vgpuctl tenant` describe them, and
//! the checks of a description that need nothing but the description.

use serde::{Deserialize, Serialize};

use crate::size::Size;

/// Most connections one tenant may be allowed.
pub const MAX_CONNECTIONS: u32 = 1024;

/// A tenant's priority class: latency-sensitive work goes first within its
/// share, batch work last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Latency,
    #[default]
    Normal,
    Batch,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Latency => "latency",
            Priority::Normal => "normal",
            Priority::Batch => "batch",
        }
    }
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

/// Its OpenAPI schema: the string `UID:GID`.
impl utoipa::PartialSchema for Owner {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new().schema_type(Type::String).pattern(Some("^[0-9]+:[0-9]+$")).examples(["1000:1000"]).into()
    }
}

impl utoipa::ToSchema for Owner {}

impl<'de> Deserialize<'de> for Owner {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Owner, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A tenant, as `POST /tenants` takes it and the config file lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$", example = "web")]
    pub name: String,
    /// Memory quota.
    pub memory: Size,
    /// Compute share weight.
    #[serde(default = "weight_one")]
    #[schema(minimum = 1, maximum = 10000, default = 1)]
    pub weight: u32,
    /// Hard cap: the percentage (1..=100) of the device's time the tenant
    /// never exceeds, even alone on it (absent or 100: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 100)]
    pub cap: Option<u32>,
    /// `latency` (goes first within its share), `normal` or `batch`.
    #[serde(default)]
    #[schema(default = "normal")]
    pub priority: Priority,
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
    #[schema(maximum = 1023)]
    pub numa_node: Option<u32>,
    /// `process` (a host process or container, through the socket
    /// NAME.sock) or `vm` (a VM's virtio-gpu device, through the vhost-user
    /// socket NAME.vhost).
    #[serde(default)]
    #[schema(default = "process")]
    pub kind: TenantKind,
    /// Owner of the tenant's socket, `UID:GID` (default root): the user or
    /// container that may be this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    /// Mode of the tenant's socket, octal (default `0600`); it must include
    /// 0600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^0?[0-7]{3}$")]
    pub mode: Option<String>,
    /// Host memory the tenant's objects may keep in its worker (default
    /// `devices.tenant_host_memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<Size>,
    /// Client connections the tenant may hold at once (default
    /// `devices.tenant_connections`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1024)]
    pub max_connections: Option<u32>,
    /// Put the socket in `RUN_DIR/hidden/`, a directory only root
    /// (and the device workers) may enter, so that it is reached only where
    /// it is bind-mounted (a container, through CDI), never by its path on
    /// the host. For a socket open to users the admin does not know (mode
    /// 0666): its name is no secret, since the kernel shows the path of
    /// every bound socket to every user (`/proc/net/unix`). Process
    /// tenants only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hidden: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
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
            // As documented: three octal digits, or four starting with 0
            // (`from_str_radix` alone also takes a sign and any run of 0s).
            let digits = m.strip_prefix('0').filter(|r| r.len() == 3).unwrap_or(m);
            match u32::from_str_radix(m, 8) {
                Ok(v) if digits.len() == 3 && digits.bytes().all(|b| (b'0'..=b'7').contains(&b)) && v & 0o600 == 0o600 => {}
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
        if self.hidden && self.kind == TenantKind::Vm {
            return Err(format!("tenant {}: hidden is for process tenants (a socket bind-mounted into a container); a VM's vhost-user socket is opened by its VMM on the host", self.name));
        }
        Ok(())
    }

    /// The socket's permission bits.
    pub fn mode_bits(&self) -> u32 {
        self.mode.as_deref().and_then(|m| u32::from_str_radix(m, 8).ok()).unwrap_or(0o600)
    }
}

/// Whether `k` may name a variable in a tenant's `env` (and so in a
/// shell's `export` or a CDI spec): a letter or `_`, then letters, digits
/// and `_`.
pub fn is_env_name(k: &str) -> bool {
    k.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_') && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
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

/// What `PATCH /tenants/NAME` may change; absent fields stay as they are.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantChange {
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 10000)]
    pub weight: Option<u32>,
    /// Percent of the device; 100 removes the cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 100)]
    pub cap: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<Size>,
}
