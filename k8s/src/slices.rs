//! Which slices a resource offers: a pure function of the mediator's
//! devices and this node's allocations, so that it is tested on its own.

use std::collections::{BTreeMap, BTreeSet};

use vgpu_api::Size;

/// Smallest slice: a tenant's quota below this is of no use.
pub const MIN_SLICE: u64 = 1 << 20;
/// Most slices one device offers (the kubelet lists each as a device).
pub const MAX_SLICES_PER_DEVICE: u64 = 1024;

/// One resource the plugin offers: `NAME=POOL:SIZE`, slices of SIZE of the
/// devices of pool POOL, named NAME (`vgpu.dev/slice-16g=default:16GiB`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    pub name: String,
    pub pool: String,
    pub slice: Size,
}

impl std::str::FromStr for Resource {
    type Err = String;
    fn from_str(s: &str) -> Result<Resource, String> {
        let bad = |why: &str| format!("invalid resource {s:?}: {why}; use NAME=POOL:SIZE, such as vgpu.dev/slice-16g=default:16GiB");
        let (name, rest) = s.split_once('=').ok_or_else(|| bad("no '='"))?;
        let (pool, size) = rest.split_once(':').ok_or_else(|| bad("no ':' between the pool and the slice size"))?;
        check_resource_name(name).map_err(|e| bad(&e))?;
        vgpu_api::tenant::validate_name(pool).map_err(|e| bad(&e.replace("tenant name", "pool name")))?;
        let slice: Size = size.parse().map_err(|e: vgpu_api::SizeError| bad(&e.to_string()))?;
        if slice.0 < MIN_SLICE {
            return Err(bad("a slice is at least 1MiB"));
        }
        Ok(Resource { name: name.into(), pool: pool.into(), slice })
    }
}

/// A DNS subdomain of at most `max` characters: dot-separated labels of
/// lower-case letters, digits and '-' (not at either end), each at most 63.
pub fn is_dns_subdomain(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.split('.').all(|l| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') && !l.starts_with('-') && !l.ends_with('-'))
}

/// An extended resource name as the kubelet takes it: `DOMAIN/NAME`, a
/// DNS subdomain, a slash and a name of letters, digits, '-', '_' and '.'.
fn check_resource_name(name: &str) -> Result<(), String> {
    let (domain, short) = name.split_once('/').ok_or("the name is DOMAIN/NAME (vgpu.dev/slice-16g)")?;
    if !is_dns_subdomain(domain, 253) || domain.ends_with("kubernetes.io") || domain.ends_with("k8s.io") {
        return Err(format!("{domain:?} is not a domain a device plugin may use"));
    }
    let ok = !short.is_empty()
        && short.len() <= 63
        && short.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && short.as_bytes()[0].is_ascii_alphanumeric()
        && short.as_bytes()[short.len() - 1].is_ascii_alphanumeric();
    if !ok {
        return Err(format!("{short:?} is not a resource name (letters, digits, '-', '_', '.'; at most 63)"));
    }
    Ok(())
}

impl Resource {
    /// The plugin's socket in the kubelet's device-plugins directory.
    pub fn socket_name(&self) -> String {
        let flat: String = self.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
        format!("vgpu-{flat}.sock")
    }
}

/// A shared device as the mediator reports it (`GET /v1/devices`).
#[derive(Debug, Clone, PartialEq)]
pub struct Device {
    pub name: String,
    pub pool: String,
    /// `cpu` or `cuda`.
    pub kind: String,
    /// How its tenants are kept apart (`process`: an executor each).
    pub isolation: String,
    pub numa_node: i32,
    /// Quotas it may hold (memory × its pool's overcommit).
    pub capacity: u64,
    /// Quotas placed on it, this node's allocations included.
    pub reserved: u64,
    /// Its worker serves (not restarting or quarantined).
    pub running: bool,
}

/// One slice as the kubelet sees it: a device of the device plugin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub id: String,
    pub device: String,
    pub healthy: bool,
    pub numa_node: Option<i64>,
}

/// A slice's id: its device and its number there.
pub fn slice_id(device: &str, k: u64) -> String {
    format!("{device}-s{k}")
}

/// The device a slice id is on.
pub fn device_of(id: &str) -> Option<&str> {
    let (d, k) = id.rsplit_once("-s")?;
    k.parse::<u64>().ok().map(|_| d)
}

/// The slices `r` offers: on each running device of its pool, as many as
/// fit in what is not reserved by others (quotas this node's allocations
/// hold count as free: their slices are listed, in use), and always the
/// slices allocated here, so that the kubelet never sees an allocated
/// device vanish. A device whose worker is down has its slices unhealthy.
pub fn slices(r: &Resource, devices: &[Device], allocated: &BTreeSet<String>, ours_reserved: &BTreeMap<String, u64>) -> Vec<Slice> {
    let mut out = Vec::new();
    for d in devices.iter().filter(|d| d.pool == r.pool) {
        let ours = ours_reserved.get(&d.name).copied().unwrap_or(0);
        let others = d.reserved.saturating_sub(ours);
        let count = (d.capacity.saturating_sub(others) / r.slice.0).min(MAX_SLICES_PER_DEVICE);
        let numa_node = (d.numa_node >= 0).then_some(i64::from(d.numa_node));
        let mut ids: BTreeSet<u64> = (0..count).collect();
        ids.extend(allocated.iter().filter(|id| device_of(id) == Some(d.name.as_str())).filter_map(|id| id.rsplit_once("-s")?.1.parse::<u64>().ok()));
        out.extend(ids.into_iter().map(|k| Slice { id: slice_id(&d.name, k), device: d.name.clone(), healthy: d.running, numa_node }));
    }
    out
}

/// The kubelet's GetPreferredAllocation: `n` ids from `available`, with
/// `must` among them, on as few devices as can be: one tenant lives on one
/// device, so slices of one device make one tenant of their sum.
pub fn preferred(available: &[String], must: &[String], n: usize) -> Vec<String> {
    let mut by_device: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
    for id in available {
        if !must.contains(id) {
            by_device.entry(device_of(id).unwrap_or("")).or_default().push(id);
        }
    }
    let mut chosen: Vec<String> = must.to_vec();
    // The device of the ids that must be in it first, then the devices
    // with the most free slices.
    let first = must.first().and_then(|m| device_of(m));
    let mut order: Vec<(&str, Vec<&String>)> = by_device.into_iter().collect();
    order.sort_by_key(|(d, ids)| (Some(*d) != first, std::cmp::Reverse(ids.len())));
    for (_, ids) in order {
        for id in ids {
            if chosen.len() >= n {
                return chosen;
            }
            chosen.push(id.clone());
        }
    }
    chosen.truncate(n.max(must.len()));
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, pool: &str, capacity: u64, reserved: u64) -> Device {
        Device { name: name.into(), pool: pool.into(), kind: "cpu".into(), isolation: "process".into(), numa_node: 0, capacity, reserved, running: true }
    }

    #[test]
    fn resources_parse_and_bad_ones_say_how() {
        let r: Resource = "vgpu.dev/slice-16g=default:16GiB".parse().unwrap();
        assert_eq!((r.name.as_str(), r.pool.as_str(), r.slice.0), ("vgpu.dev/slice-16g", "default", 16 << 30));
        assert_eq!(r.socket_name(), "vgpu-vgpu-dev-slice-16g.sock");
        for (bad, says) in [
            ("slice=default:1GiB", "DOMAIN/NAME"),
            ("vgpu.dev/s=default", "no ':'"),
            ("vgpu.dev/s=default:lots", "invalid size"),
            ("vgpu.dev/s=default:4KiB", "at least 1MiB"),
            ("nvidia.k8s.io/gpu=default:1GiB", "not a domain"),
            ("vgpu.dev/-x=default:1GiB", "not a resource name"),
            ("vgpu.dev/s=no/pool:1GiB", "invalid pool name"),
        ] {
            let e = bad.parse::<Resource>().unwrap_err();
            assert!(e.contains(says) && e.contains("NAME=POOL:SIZE"), "{bad}: {e}");
        }
    }

    #[test]
    fn slices_are_what_others_leave_and_allocated_ones_stay_listed() {
        let r: Resource = "vgpu.dev/s=default:16MiB".parse().unwrap();
        let devices = [dev("cpu0", "default", 64 << 20, 16 << 20), dev("cpu1", "gold", 64 << 20, 0), dev("cpu2", "default", 40 << 20, 0)];
        // Others reserve 16 MiB of cpu0: three slices there, two on cpu2.
        let s = slices(&r, &devices, &BTreeSet::new(), &BTreeMap::new());
        let ids: Vec<&str> = s.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["cpu0-s0", "cpu0-s1", "cpu0-s2", "cpu2-s0", "cpu2-s1"]);
        // Our own 32 MiB on cpu0 are free to us: still three (and the ids
        // we allocated are listed whatever happens).
        let devices = [dev("cpu0", "default", 64 << 20, 48 << 20)];
        let ours = BTreeMap::from([("cpu0".to_string(), 32 << 20)]);
        let allocated = BTreeSet::from(["cpu0-s1".to_string(), "cpu0-s7".to_string()]);
        let ids: Vec<String> = slices(&r, &devices, &allocated, &ours).into_iter().map(|s| s.id).collect();
        assert_eq!(ids, ["cpu0-s0", "cpu0-s1", "cpu0-s2", "cpu0-s7"]);
        // A device whose worker is down: its slices are unhealthy.
        let down = [Device { running: false, numa_node: -1, ..dev("cpu0", "default", 32 << 20, 0) }];
        assert!(slices(&r, &down, &BTreeSet::new(), &BTreeMap::new()).iter().all(|s| !s.healthy && s.numa_node.is_none()));
        assert_eq!(device_of("gpu-a-s12"), Some("gpu-a"));
        assert_eq!(device_of("gpu-a"), None);
    }

    #[test]
    fn preferred_allocations_keep_to_one_device() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let avail = ids(&["cpu0-s0", "cpu1-s0", "cpu1-s1", "cpu1-s2", "cpu2-s0", "cpu2-s1"]);
        assert_eq!(preferred(&avail, &[], 3), ids(&["cpu1-s0", "cpu1-s1", "cpu1-s2"]));
        assert_eq!(preferred(&avail, &ids(&["cpu2-s0"]), 2), ids(&["cpu2-s0", "cpu2-s1"]));
        assert_eq!(preferred(&avail, &[], 1).len(), 1);
    }
}
