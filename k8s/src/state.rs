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

impl State {
    /// The state in `path`; none yet is an empty one.
    pub fn load(path: &Path) -> Result<State, StateError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(State { version: VERSION, ..State::default() }),
            Err(err) => return Err(StateError::Read { path: path.display().to_string(), err }),
        };
        let s: State = serde_json::from_str(&text).map_err(|e| StateError::Corrupt { path: path.display().to_string(), err: e.to_string() })?;
        if s.version != VERSION {
            return Err(StateError::Corrupt { path: path.display().to_string(), err: format!("format version {}, not {VERSION}", s.version) });
        }
        Ok(s)
    }

    /// Writes it so that a crash leaves the old file or the new one.
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let err = |err| StateError::Write { path: path.display().to_string(), err };
        let text = serde_json::to_vec_pretty(self).map_err(|e| err(std::io::Error::other(e)))?;
        vgpu_topology::safe_open::write_atomically(path, &text).map_err(err)
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
        s.allocations
            .insert("k8s-2".into(), Allocation { resource: "vgpu.dev/s".into(), device: "cpu0".into(), ids: vec!["cpu0-s0".into()], memory: 1 << 20, socket: "/run/t.sock".into(), created: 1 });
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
