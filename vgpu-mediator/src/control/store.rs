//! Durable tenants and pools: what `POST /tenants` and `POST /pools` made
//! (and later changes) survive a restart, a `kill -9` or a reboot.
//!
//! Layout under the state directory (owner root, 0700):
//! - `tenants/NAME.json`: one tenant, as `POST /tenants` takes it, with the
//!   device and pool it was placed on, so it comes back where it was, with
//!   the same socket, owner and mode;
//! - `pools.json`: every named pool.
//!
//! Each file is written whole to a temporary name, synced and renamed over
//! the old one, so a crash leaves the old or the new file, never half of
//! one. Files carry a format name and version; one that does not parse, or
//! is not ours, stops the daemon at start with the file's path and the
//! reason, rather than being half-read or dropped in silence.
//!
//! Tenants and pools the config file lists are made from it at every start
//! and are not saved here: the config file stays their only source.

use std::collections::BTreeSet;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::pool::PoolSpec;
use crate::config::TenantSpec;

const TENANT_FORMAT: &str = "vgpu-mediatord tenant";
const POOLS_FORMAT: &str = "vgpu-mediatord pools";
const VERSION: u32 = 1;
/// No state file of ours comes near this.
const MAX_FILE: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {err}")]
    Io {
        path: String,
        #[source]
        err: std::io::Error,
    },
    #[error("{path} is not a state file this daemon can read ({why}); move it away to start without it")]
    Unreadable { path: String, why: String },
    #[error("{path}: {why}; refusing to use it")]
    Unsafe { path: String, why: String },
}

fn io(path: &Path, err: std::io::Error) -> StoreError {
    StoreError::Io { path: path.display().to_string(), err }
}

fn unreadable(path: &Path, why: impl Into<String>) -> StoreError {
    StoreError::Unreadable { path: path.display().to_string(), why: why.into() }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedTenant {
    format: String,
    version: u32,
    tenant: TenantSpec,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedPools {
    format: String,
    version: u32,
    pools: Vec<PoolSpec>,
}

pub use vgpu_topology::safe_open::write_atomically;

/// Reads a state file we wrote: a regular file (not a link), not huge.
fn read_state_file(path: &Path) -> Result<Vec<u8>, StoreError> {
    let m = std::fs::symlink_metadata(path).map_err(|e| io(path, e))?;
    if !m.file_type().is_file() {
        return Err(unreadable(path, "not a regular file"));
    }
    if m.len() > MAX_FILE {
        return Err(unreadable(path, format!("{} bytes, more than any state file", m.len())));
    }
    std::fs::read(path).map_err(|e| io(path, e))
}

/// What an earlier run saved.
#[derive(Debug, Default)]
pub struct Saved {
    pub pools: Vec<PoolSpec>,
    /// Each tenant with the file it came from.
    pub tenants: Vec<(TenantSpec, PathBuf)>,
}

pub struct Store {
    dir: PathBuf,
    /// Tenant and pool names the config file declares: never saved.
    declared_tenants: Mutex<BTreeSet<String>>,
    declared_pools: Mutex<BTreeSet<String>>,
    /// Serialises writes of pools.json.
    pools_lock: Mutex<()>,
}

impl Store {
    /// The store under `state_dir`, its `tenants/` made (0700) if missing.
    /// A `tenants/` that is a link, is not ours, or that others may write
    /// is refused: what is in it decides who owns which socket.
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        let tenants = state_dir.join("tenants");
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&tenants).map_err(|e| io(&tenants, e))?;
        let m = std::fs::symlink_metadata(&tenants).map_err(|e| io(&tenants, e))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !m.is_dir() || m.uid() != me || m.mode() & 0o022 != 0 {
            return Err(StoreError::Unsafe {
                path: tenants.display().to_string(),
                why: format!("a directory of uid {me} that only it may write is needed, not mode {:o} of uid {}", m.mode() & 0o7777, m.uid()),
            });
        }
        Ok(Store { dir: state_dir.to_path_buf(), declared_tenants: Mutex::default(), declared_pools: Mutex::default(), pools_lock: Mutex::default() })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Marks tenants and pools as the config file's: they are not saved.
    pub fn declare(&self, tenants: impl IntoIterator<Item = String>, pools: impl IntoIterator<Item = String>) {
        self.declared_tenants.lock().unwrap_or_else(|e| e.into_inner()).extend(tenants);
        self.declared_pools.lock().unwrap_or_else(|e| e.into_inner()).extend(pools);
    }

    pub fn is_declared_tenant(&self, name: &str) -> bool {
        self.declared_tenants.lock().unwrap_or_else(|e| e.into_inner()).contains(name)
    }

    pub fn is_declared_pool(&self, name: &str) -> bool {
        self.declared_pools.lock().unwrap_or_else(|e| e.into_inner()).contains(name)
    }

    fn tenant_path(&self, name: &str) -> PathBuf {
        self.dir.join("tenants").join(format!("{name}.json"))
    }

    /// Saves a tenant (unless the config file declares it).
    pub fn save_tenant(&self, spec: &TenantSpec) -> Result<(), StoreError> {
        if self.is_declared_tenant(&spec.name) {
            return Ok(());
        }
        let path = self.tenant_path(&spec.name);
        let saved = SavedTenant { format: TENANT_FORMAT.into(), version: VERSION, tenant: spec.clone() };
        let bytes = serde_json::to_vec_pretty(&saved).map_err(|e| unreadable(&path, e.to_string()))?;
        write_atomically(&path, &bytes).map_err(|e| io(&path, e))
    }

    /// Forgets a tenant; a missing file is fine.
    pub fn remove_tenant(&self, name: &str) -> Result<(), StoreError> {
        let path = self.tenant_path(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&path, e)),
            _ => Ok(()),
        }
    }

    /// Saves every named pool the config file does not declare.
    pub fn save_pools<'a>(&self, pools: impl IntoIterator<Item = &'a PoolSpec>) -> Result<(), StoreError> {
        let _one = self.pools_lock.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.dir.join("pools.json");
        let pools: Vec<PoolSpec> = pools.into_iter().filter(|p| !self.is_declared_pool(&p.name)).cloned().collect();
        let saved = SavedPools { format: POOLS_FORMAT.into(), version: VERSION, pools };
        let bytes = serde_json::to_vec_pretty(&saved).map_err(|e| unreadable(&path, e.to_string()))?;
        write_atomically(&path, &bytes).map_err(|e| io(&path, e))
    }

    /// Everything an earlier run saved, or the first file that cannot be
    /// read whole.
    pub fn load(&self) -> Result<Saved, StoreError> {
        let mut out = Saved::default();
        let pools = self.dir.join("pools.json");
        if pools.exists() {
            let bytes = read_state_file(&pools)?;
            let p: SavedPools = serde_json::from_slice(&bytes).map_err(|e| unreadable(&pools, e.to_string()))?;
            if p.format != POOLS_FORMAT || p.version != VERSION {
                return Err(unreadable(&pools, format!("format {:?} version {}, not {POOLS_FORMAT:?} version {VERSION}", p.format, p.version)));
            }
            out.pools = p.pools;
        }
        let dir = self.dir.join("tenants");
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir).map_err(|e| io(&dir, e))?.map(|e| e.map(|e| e.path()).map_err(|e| io(&dir, e))).collect::<Result<_, _>>()?;
        entries.sort();
        for path in entries {
            let Some(file) = path.file_name().and_then(|n| n.to_str()) else {
                return Err(unreadable(&path, "its name is not UTF-8"));
            };
            if file.ends_with(".json.tmp") {
                // A write the daemon did not finish: the old file stands.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(stem) = file.strip_suffix(".json") else {
                return Err(unreadable(&path, "only NAME.json files belong in the tenants directory"));
            };
            let bytes = read_state_file(&path)?;
            let t: SavedTenant = serde_json::from_slice(&bytes).map_err(|e| unreadable(&path, e.to_string()))?;
            if t.format != TENANT_FORMAT || t.version != VERSION {
                return Err(unreadable(&path, format!("format {:?} version {}, not {TENANT_FORMAT:?} version {VERSION}", t.format, t.version)));
            }
            if t.tenant.name != stem {
                return Err(unreadable(&path, format!("it describes tenant {:?}, not {stem:?}", t.tenant.name)));
            }
            out.tenants.push((t.tenant, path));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str) -> TenantSpec {
        serde_json::from_value(
            serde_json::json!({ "name": name, "memory": "64MiB", "weight": 3, "cap": 50, "device": "cpu0", "pool": "default", "owner": "1000:1000", "mode": "0660", "host_memory": "128MiB" }),
        )
        .expect("spec")
    }

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vgpu-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn tenants_and_pools_come_back_as_saved_and_declared_ones_are_not_saved() {
        let d = dir("roundtrip");
        let s = Store::open(&d).expect("open");
        s.declare(["fromconfig".to_string()], ["cfgpool".to_string()]);
        s.save_tenant(&spec("t1")).expect("save");
        s.save_tenant(&spec("fromconfig")).expect("save");
        let pool: PoolSpec = serde_json::from_value(serde_json::json!({ "name": "p1", "devices": ["cpu1"], "access": "private", "allow": ["t1"] })).expect("pool");
        let cfg: PoolSpec = serde_json::from_value(serde_json::json!({ "name": "cfgpool", "devices": ["cpu2"] })).expect("pool");
        s.save_pools([&pool, &cfg]).expect("pools");
        let back = Store::open(&d).expect("open").load().expect("load");
        assert_eq!(back.tenants.len(), 1);
        assert_eq!(back.tenants[0].0, spec("t1"));
        assert_eq!(back.pools, vec![pool]);
        s.remove_tenant("t1").expect("remove");
        s.remove_tenant("t1").expect("removing twice is fine");
        assert!(s.load().expect("load").tenants.is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_tenants_directory_others_may_write_is_refused_and_a_planted_link_is_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir("unsafe");
        let s = Store::open(&d).expect("open");
        // A link planted at the temporary name is replaced, not written through.
        let victim = d.join("victim");
        std::fs::write(&victim, "keep").expect("victim");
        std::os::unix::fs::symlink(&victim, d.join("tenants/t1.json.tmp")).expect("link");
        s.save_tenant(&spec("t1")).expect("save");
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "keep");
        std::fs::set_permissions(d.join("tenants"), std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = Store::open(&d).err().expect("a world-writable tenants dir").to_string();
        assert!(e.contains("tenants") && e.contains("refusing"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn corrupt_foreign_and_misnamed_files_are_refused_with_their_path() {
        let d = dir("refuse");
        let s = Store::open(&d).expect("open");
        s.save_tenant(&spec("good")).expect("save");
        let good = std::fs::read_to_string(d.join("tenants/good.json")).expect("read");
        let cases = [
            ("half.json", good[..good.len() / 2].to_string(), "EOF"),
            ("other.json", good.clone(), "describes tenant \"good\""),
            ("future.json", good.replace("\"version\": 1", "\"version\": 9").replace("\"good\"", "\"future\""), "version 9"),
            ("notes.txt", "hello".into(), "only NAME.json"),
        ];
        for (file, text, why) in cases {
            let p = d.join("tenants").join(file);
            std::fs::write(&p, text).expect("write");
            let e = s.load().expect_err(file).to_string();
            assert!(e.contains(file) && e.contains(why) && e.contains("move it away"), "{file}: {e}");
            std::fs::remove_file(&p).expect("remove");
        }
        std::fs::write(d.join("pools.json"), "{\"format\": \"something else\", \"version\": 1, \"pools\": []}").expect("write");
        let e = s.load().expect_err("pools").to_string();
        assert!(e.contains("pools.json") && e.contains("something else"), "{e}");
        // A write that never finished leaves the old file standing.
        std::fs::remove_file(d.join("pools.json")).expect("remove");
        std::fs::write(d.join("tenants/good.json.tmp"), "{").expect("write");
        assert_eq!(s.load().expect("load").tenants.len(), 1);
        assert!(!d.join("tenants/good.json.tmp").exists());
        let _ = std::fs::remove_dir_all(&d);
    }
}
