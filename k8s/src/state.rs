//! What the plugin remembers across its own restarts and the daemon's:
//! each allocation (the tenant it made, for which slices), in one JSON
//! file written atomically. A file that does not parse is refused, never
//! half-read: the plugin will not guess which tenants are its own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The file's format version.
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("reading {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("{path} is not this plugin's state ({err}); move it aside to start afresh, and delete the tenants it named by hand")]
    Corrupt { path: String, err: String },
    #[error("writing {path}: {err}")]
    Write { path: String, err: std::io::Error },
}

/// One allocation: a tenant made for one container's slices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    /// The resource (`vgpu.dev/slice-16g`).
    pub resource: String,
    pub device: String,
    /// The slice ids the kubelet allocated.
    pub ids: Vec<String>,
    /// The tenant's quota: the slices' sum.
    pub memory: u64,
    pub socket: PathBuf,
    /// What the tenant's programs need in their environment on its
    /// device (the daemon's answer when the tenant was made).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// UNIX seconds.
    pub created: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    pub version: u32,
    /// The number the next tenant's name takes.
    pub next: u64,
    /// By tenant name.
    pub allocations: BTreeMap<String, Allocation>,
}

/// Reads a state file of format [`VERSION`]: `empty` where there is none
/// yet; a file that does not parse, or of another version, is refused.
fn load<T: serde::de::DeserializeOwned>(path: &Path, empty: T, version: impl Fn(&T) -> u32) -> Result<T, StateError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(empty),
        Err(err) => return Err(StateError::Read { path: path.display().to_string(), err }),
    };
    let s: T = serde_json::from_str(&text).map_err(|e| StateError::Corrupt { path: path.display().to_string(), err: e.to_string() })?;
    if version(&s) != VERSION {
        return Err(StateError::Corrupt { path: path.display().to_string(), err: format!("format version {}, not {VERSION}", version(&s)) });
    }
    Ok(s)
}

/// Writes a state file so that a crash leaves the old file or the new one.
fn save<T: Serialize>(path: &Path, value: &T) -> Result<(), StateError> {
    let err = |err| StateError::Write { path: path.display().to_string(), err };
    let text = serde_json::to_vec_pretty(value).map_err(|e| err(std::io::Error::other(e)))?;
    vgpu_topology::safe_open::write_atomically(path, &text).map_err(err)
}

/// One tenant a prepared claim holds: one device of its allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimTenant {
    pub tenant: String,
    /// The claim's request it answers (`gpu`, `gpu/small`).
    pub request: String,
    /// The mediator's device, and its name in the ResourceSlice.
    pub device: String,
    pub device_label: String,
    pub memory: u64,
    pub socket: PathBuf,
    pub share_id: Option<String>,
    /// As [`Allocation::env`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// A ResourceClaim prepared on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    pub tenants: Vec<ClaimTenant>,
    /// UNIX seconds.
    pub created: u64,
}

/// What the DRA driver remembers across its restarts and the daemon's:
/// the claims it prepared (by uid) and the tenants each holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimState {
    pub version: u32,
    /// The number the next tenant's name takes.
    pub next: u64,
    /// The ResourceSlices' pool generation last published.
    pub generation: i64,
    pub claims: BTreeMap<String, PreparedClaim>,
    /// Every tenant name the driver issued and has not seen deleted,
    /// recorded before the tenant is made: those no claim holds are the
    /// driver's orphans. A tenant the driver never issued is never its to
    /// delete, whatever its name (another driver's, an admin's).
    #[serde(default)]
    pub issued: BTreeSet<String>,
}

impl ClaimState {
    /// The state in `path`; none yet is an empty one.
    pub fn load(path: &Path) -> Result<ClaimState, StateError> {
        load(path, ClaimState { version: VERSION, ..ClaimState::default() }, |s| s.version)
    }

    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        save(path, self)
    }

    /// Every tenant the claims hold.
    pub fn tenants(&self) -> impl Iterator<Item = &ClaimTenant> {
        self.claims.values().flat_map(|c| c.tenants.iter())
    }

    /// The quotas the claims hold on each device.
    pub fn reserved_by_device(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for t in self.tenants() {
            *m.entry(t.device.clone()).or_insert(0) += t.memory;
        }
        m
    }
}

impl State {
    /// The state in `path`; none yet is an empty one.
    pub fn load(path: &Path) -> Result<State, StateError> {
        load(path, State { version: VERSION, ..State::default() }, |s| s.version)
    }

    /// Writes it so that a crash leaves the old file or the new one.
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        save(path, self)
    }

    /// The slice ids allocated for `resource`.
    pub fn allocated(&self, resource: &str) -> BTreeSet<String> {
        self.allocations.values().filter(|a| a.resource == resource).flat_map(|a| a.ids.iter().cloned()).collect()
    }

    /// The quotas this node's allocations hold on each device.
    pub fn reserved_by_device(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for a in self.allocations.values() {
            *m.entry(a.device.clone()).or_insert(0) += a.memory;
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_survives_a_round_trip_and_a_corrupt_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("vgpu-k8s-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.json");
        let mut s = State::load(&path).unwrap();
        assert!(s.allocations.is_empty());
        s.next = 3;
        s.allocations.insert(
            "k8s-2".into(),
            Allocation {
                resource: "vgpu.dev/s".into(),
                device: "cpu0".into(),
                ids: vec!["cpu0-s0".into()],
                memory: 1 << 20,
                socket: "/run/t.sock".into(),
                env: BTreeMap::from([("CUPY_COMPILE_WITH_PTX".into(), "1".into())]),
                created: 1,
            },
        );
        s.save(&path).unwrap();
        assert_eq!(State::load(&path).unwrap(), s);
        assert_eq!(s.allocated("vgpu.dev/s"), BTreeSet::from(["cpu0-s0".to_string()]));
        std::fs::write(&path, "{\"version\":1,\"next\":").unwrap();
        assert!(matches!(State::load(&path), Err(StateError::Corrupt { .. })));
        std::fs::write(&path, "{\"version\":7,\"next\":0,\"allocations\":{}}").unwrap();
        assert!(State::load(&path).unwrap_err().to_string().contains("format version 7"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
