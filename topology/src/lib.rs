//! Host NUMA topology, read from sysfs under a configurable root so tests
//! can present a fake multi-node host, and the placement it implies: which
//! CPUs a VM's vCPU threads (or a device worker) are pinned to, and the
//! `mbind` of a VM's memory. Also [`safe_open`]: how the VMM and the
//! mediator open (or check) the files a VM's description names without
//! following symbolic links, and [`cgroup`]: the cgroup v2 groups that
//! bound a jailed VMM's or a tenant executor's memory and tasks.

pub mod cgroup;
pub mod pci;
pub mod safe_open;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Environment variable naming the sysfs root (default `/sys`).
pub const SYSFS_ROOT_ENV: &str = "VGPU_SYSFS_ROOT";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NumaError {
    #[error("reading NUMA topology under {0}: {1}")]
    Read(String, String),
    #[error("NUMA node {node} does not exist on this host (nodes: {have})")]
    NoSuchNode { node: u32, have: String },
    #[error("NUMA node {0} has no CPUs to run on")]
    NoCpus(u32),
    #[error("invalid cpulist '{0}'")]
    BadCpuList(String),
    #[error("mbind to node {node} failed: {err}")]
    Mbind { node: u32, err: String },
    #[error("pinning a thread to node {node}'s CPUs failed: {err}")]
    Affinity { node: u32, err: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Node id to its CPUs.
    pub nodes: BTreeMap<u32, Vec<usize>>,
}

pub fn sysfs_root() -> PathBuf {
    std::env::var_os(SYSFS_ROOT_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/sys"))
}

/// Parses a kernel cpulist such as `0-3,8,10-11`.
pub fn parse_cpulist(s: &str) -> Result<Vec<usize>, NumaError> {
    let bad = || NumaError::BadCpuList(s.trim().to_string());
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().map_err(|_| bad())?, b.parse::<usize>().map_err(|_| bad())?),
            None => {
                let v = part.parse::<usize>().map_err(|_| bad())?;
                (v, v)
            }
        };
        if a > b || b >= 1 << 16 {
            return Err(bad());
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

impl Topology {
    /// Reads `ROOT/devices/system/node/nodeN/cpulist`. A host without that
    /// directory (no NUMA support) is one node 0 holding every online CPU.
    pub fn read(root: &Path) -> Result<Topology, NumaError> {
        let dir = root.join("devices/system/node");
        let err = |e: std::io::Error| NumaError::Read(dir.display().to_string(), e.to_string());
        let mut nodes = BTreeMap::new();
        match std::fs::read_dir(&dir) {
            Ok(entries) => {
                for e in entries {
                    let e = e.map_err(err)?;
                    let name = e.file_name().to_string_lossy().into_owned();
                    let Some(id) = name.strip_prefix("node").and_then(|n| n.parse::<u32>().ok()) else { continue };
                    let list = std::fs::read_to_string(e.path().join("cpulist")).map_err(err)?;
                    nodes.insert(id, parse_cpulist(&list)?);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let online = std::fs::read_to_string(root.join("devices/system/cpu/online")).map_err(err)?;
                nodes.insert(0, parse_cpulist(&online)?);
            }
            Err(e) => return Err(err(e)),
        }
        if nodes.is_empty() {
            return Err(NumaError::Read(dir.display().to_string(), "no nodes found".into()));
        }
        Ok(Topology { nodes })
    }

    /// The CPUs of `node`: where a VM placed there runs its vCPUs and a
    /// device worker its threads.
    pub fn cpus_for(&self, node: u32) -> Result<&[usize], NumaError> {
        let cpus = self.nodes.get(&node).ok_or_else(|| NumaError::NoSuchNode { node, have: self.nodes.keys().map(|n| n.to_string()).collect::<Vec<_>>().join(", ") })?;
        if cpus.is_empty() {
            return Err(NumaError::NoCpus(node));
        }
        Ok(cpus)
    }
}

/// Binds `len` bytes at `addr` (not yet touched) to `node`, strictly.
// The pointer is never dereferenced: the kernel checks the range and only
// the memory policy of this process's own mapping changes.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn mbind(addr: *mut libc::c_void, len: usize, node: u32) -> Result<(), NumaError> {
    const MPOL_BIND: libc::c_long = 2;
    const MPOL_MF_STRICT: libc::c_ulong = 1;
    const MPOL_MF_MOVE: libc::c_ulong = 2;
    if node >= 1024 {
        return Err(NumaError::Mbind { node, err: "node id out of range".into() });
    }
    let mut mask = [0u64; 16];
    mask[(node / 64) as usize] |= 1u64 << (node % 64);
    // SAFETY: mbind only changes the memory policy of [addr, addr+len), a
    // mapping this process owns; the mask buffer outlives the call and
    // maxnode (1024 bits) matches its size.
    let r = unsafe { libc::syscall(libc::SYS_mbind, addr, len, MPOL_BIND, mask.as_ptr(), 1024usize, MPOL_MF_STRICT | MPOL_MF_MOVE) };
    if r != 0 {
        return Err(NumaError::Mbind { node, err: std::io::Error::last_os_error().to_string() });
    }
    Ok(())
}

/// Pins the calling thread to `cpus`.
pub fn pin_current_thread(cpus: &[usize], node: u32) -> Result<(), NumaError> {
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c < libc::CPU_SETSIZE as usize {
            // SAFETY: c is below CPU_SETSIZE, so it indexes inside `set`.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(NumaError::Affinity { node, err: std::io::Error::last_os_error().to_string() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_host(nodes: &[(u32, &str)]) -> PathBuf {
        let root = std::env::temp_dir().join(format!("vgpu-numa-{}-{}", std::process::id(), nodes.len()));
        let _ = std::fs::remove_dir_all(&root);
        for (id, list) in nodes {
            let d = root.join(format!("devices/system/node/node{id}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{list}\n")).unwrap();
        }
        std::fs::create_dir_all(root.join("devices/system/node/power")).unwrap();
        root
    }

    #[test]
    fn cpulists_parse_ranges_and_singles() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n").unwrap(), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist("").unwrap(), Vec::<usize>::new());
        assert!(parse_cpulist("3-1").is_err());
        assert!(parse_cpulist("a").is_err());
    }

    #[test]
    fn two_node_host_places_vcpus_on_the_chosen_nodes_cpus() {
        let root = fake_host(&[(0, "0-7,16-23"), (1, "8-15,24-31")]);
        let t = Topology::read(&root).unwrap();
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.cpus_for(1).unwrap(), (8..16).chain(24..32).collect::<Vec<_>>().as_slice());
        assert_eq!(t.cpus_for(0).unwrap()[..3], [0, 1, 2]);
        match t.cpus_for(2) {
            Err(NumaError::NoSuchNode { node: 2, have }) => assert_eq!(have, "0, 1"),
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn memory_only_node_cannot_host_vcpus() {
        let root = fake_host(&[(0, "0-1"), (1, ""), (3, "2-3")]);
        let t = Topology::read(&root).unwrap();
        assert_eq!(t.cpus_for(1), Err(NumaError::NoCpus(1)));
        assert_eq!(t.cpus_for(3).unwrap(), &[2, 3]);
        std::fs::remove_dir_all(root).unwrap();
    }
}
