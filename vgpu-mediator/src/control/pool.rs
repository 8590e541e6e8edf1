//! Device pools: which tenants may use a group of devices, how a tenant is
//! placed among them, and how far their memory may be overcommitted.
//!
//! Every device is in exactly one pool. Devices no configured pool names
//! form the public pool `default`. Placement is a pure function of the
//! pool's devices and what is reserved on them ([`choose`]), so it is
//! tested on its own, fake NUMA topologies included.

/// The pool of every device no other pool lists.
pub const DEFAULT_POOL: &str = "default";
pub use vgpu_api::pool::MAX_OVERCOMMIT;

pub use vgpu_api::pool::{check_overcommit, Access, Placement, PoolChange, PoolSpec, Sharing};

/// One device of a pool as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub name: String,
    pub ordinal: u32,
    /// The device's NUMA node (-1: unknown).
    pub numa_node: i32,
    /// Quotas the device may hold (memory × overcommit).
    pub capacity: u64,
    /// Quotas placed on it now.
    pub reserved: u64,
    /// The most one tenant can ever use there: device memory plus the
    /// host spill budget.
    pub holds: u64,
    pub tenants: usize,
}

impl Candidate {
    fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.reserved)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error("pool {pool} has no devices")]
    Empty { pool: String },
    #[error("a {asked}-byte quota is more than any device in pool {pool} can hold (the largest holds {largest} bytes of device memory and host spill)")]
    TooLarge { pool: String, asked: u64, largest: u64 },
    #[error("no device in pool {pool} has {asked} bytes of quota unreserved (the most any has is {most})")]
    Full { pool: String, asked: u64, most: u64 },
}

/// Picks the device for a quota of `asked` bytes among `devs`, by
/// `policy`, preferring devices on `numa` when one is asked for and any
/// there fits. Ties go to the lower ordinal.
pub fn choose(pool: &str, devs: &[Candidate], asked: u64, numa: Option<u32>, policy: Placement) -> Result<usize, PlaceError> {
    if devs.is_empty() {
        return Err(PlaceError::Empty { pool: pool.into() });
    }
    let largest = devs.iter().map(|d| d.holds.min(d.capacity)).max().unwrap_or(0);
    if asked > largest {
        return Err(PlaceError::TooLarge { pool: pool.into(), asked, largest });
    }
    let fits: Vec<usize> = (0..devs.len()).filter(|&i| devs[i].free() >= asked && devs[i].holds >= asked).collect();
    if fits.is_empty() {
        return Err(PlaceError::Full { pool: pool.into(), asked, most: devs.iter().map(Candidate::free).max().unwrap_or(0) });
    }
    let near: Vec<usize> = match numa {
        Some(n) => fits.iter().copied().filter(|&i| devs[i].numa_node == n as i32).collect(),
        None => Vec::new(),
    };
    let among = if near.is_empty() { &fits } else { &near };
    let key = |&i: &usize| {
        let d = &devs[i];
        match policy {
            // Least free first: the fullest device that fits.
            Placement::Pack => (d.free(), d.tenants, d.ordinal),
            // Most free first, then fewest tenants.
            Placement::Spread => (u64::MAX - d.free(), d.tenants, d.ordinal),
        }
    };
    Ok(among.iter().copied().min_by_key(key).unwrap_or(among[0]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn dev(i: u32, node: i32, reserved: u64) -> Candidate {
        Candidate { name: format!("cpu{i}"), ordinal: i, numa_node: node, capacity: 4 * G, reserved, holds: 4 * G, tenants: (reserved / G) as usize }
    }

    #[test]
    fn spread_takes_the_freest_device_and_pack_the_fullest_that_fits() {
        let devs = [dev(0, 0, 3 * G), dev(1, 0, G), dev(2, 0, 2 * G)];
        assert_eq!(choose("p", &devs, G, None, Placement::Spread), Ok(1));
        assert_eq!(choose("p", &devs, G, None, Placement::Pack), Ok(0));
        // 2 GiB fits only on cpu1 and cpu2: pack takes cpu2, the fuller one.
        assert_eq!(choose("p", &devs, 2 * G, None, Placement::Pack), Ok(2));
        // Equal devices: the lower ordinal.
        let even = [dev(0, 0, 0), dev(1, 0, 0)];
        assert_eq!(choose("p", &even, G, None, Placement::Spread), Ok(0));
        assert_eq!(choose("p", &even, G, None, Placement::Pack), Ok(0));
    }

    #[test]
    fn a_numa_node_is_preferred_when_a_device_there_fits() {
        // Fake two-node host: cpu0 and cpu2 on node 0, cpu1 and cpu3 on node 1.
        let devs = [dev(0, 0, 0), dev(1, 1, 2 * G), dev(2, 0, G), dev(3, 1, 3 * G)];
        // Spread on node 1 picks node 1's freer device, though node 0's
        // are freer still.
        assert_eq!(choose("p", &devs, G, Some(1), Placement::Spread), Ok(1));
        assert_eq!(choose("p", &devs, G, Some(1), Placement::Pack), Ok(3));
        assert_eq!(choose("p", &devs, G, Some(0), Placement::Pack), Ok(2));
        // Nothing on node 1 fits 3 GiB: another node's device rather than a refusal.
        assert_eq!(choose("p", &devs, 3 * G, Some(1), Placement::Spread), Ok(0));
        assert_eq!(choose("p", &devs, 3 * G, Some(1), Placement::Pack), Ok(2));
        // A node with no devices at all: as if none was asked for.
        assert_eq!(choose("p", &devs, G, Some(7), Placement::Spread), Ok(0));
    }

    #[test]
    fn refusals_say_whether_the_quota_can_ever_fit() {
        let devs = [dev(0, 0, 4 * G), dev(1, 0, 3 * G)];
        assert_eq!(choose("p", &devs, 5 * G, None, Placement::Spread), Err(PlaceError::TooLarge { pool: "p".into(), asked: 5 * G, largest: 4 * G }));
        assert_eq!(choose("p", &devs, 2 * G, None, Placement::Spread), Err(PlaceError::Full { pool: "p".into(), asked: 2 * G, most: G }));
        assert_eq!(choose("p", &[], 1, None, Placement::Spread), Err(PlaceError::Empty { pool: "p".into() }));
        // Overcommitted capacity above what one device can hold: one
        // tenant still cannot have more than memory plus spill.
        let big = Candidate { capacity: 8 * G, holds: 5 * G, ..dev(0, 0, 0) };
        assert!(matches!(choose("p", &[big], 6 * G, None, Placement::Spread), Err(PlaceError::TooLarge { largest, .. }) if largest == 5 * G));
    }

    #[test]
    fn pool_descriptions_are_checked() {
        let p = |access, allow: &[&str], over| PoolSpec {
            name: "gold".into(),
            devices: vec!["cpu0".into()],
            access,
            allow: allow.iter().map(|s| s.to_string()).collect(),
            placement: Placement::Pack,
            overcommit: over,
            sharing: Default::default(),
        };
        p(Access::Private, &["alice"], 2.0).validate().unwrap();
        assert!(p(Access::Public, &["alice"], 1.0).validate().unwrap_err().contains("only applies to a private pool"));
        assert!(p(Access::Private, &["../x"], 1.0).validate().is_err());
        assert!(p(Access::Public, &[], 0.5).validate().unwrap_err().contains("overcommit"));
        assert!(p(Access::Public, &[], f64::NAN).validate().is_err());
        let mut twice = p(Access::Public, &[], 1.0);
        twice.devices.push("cpu0".into());
        assert!(twice.validate().unwrap_err().contains("twice"));
        assert!(p(Access::Private, &["alice"], 1.0).admits("alice"));
        assert!(!p(Access::Private, &["alice"], 1.0).admits("bob"));
        assert!(p(Access::Public, &[], 1.0).admits("bob"));
        assert_eq!(p(Access::Public, &[], 2.0).capacity(G), 2 * G);
        let toml_pool: PoolSpec = toml::from_str("name = \"gold\"\ndevices = [\"cpu0\"]\naccess = \"private\"\nallow = [\"alice\"]\nplacement = \"pack\"\novercommit = 2.0\n").unwrap();
        assert_eq!(toml_pool, p(Access::Private, &["alice"], 2.0));
    }
}
