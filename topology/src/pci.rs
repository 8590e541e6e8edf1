//! PCI functions as sysfs shows them: their addresses, drivers and IOMMU
//! groups. Shared by the VMM (which passes a function through) and the
//! mediator (which lends one from a pool and takes it back).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

/// The driver a passthrough device is bound to.
pub const VFIO_DRIVER: &str = "vfio-pci";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid PCI address '{0}': use DDDD:BB:DD.F, e.g. 0000:00:04.0")]
pub struct BadAddress(pub String);

/// A PCI function's address, `DDDD:BB:DD.F` (domain, bus, device,
/// function), as sysfs names it under /sys/bus/pci/devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl std::str::FromStr for PciAddress {
    type Err = BadAddress;
    /// `DDDD:BB:DD.F`, or `BB:DD.F` for domain 0; hex digits, device at
    /// most 1f, function at most 7.
    fn from_str(s: &str) -> Result<Self, BadAddress> {
        let bad = || BadAddress(s.chars().take(64).collect());
        let hex = |t: &str, min: usize, max: usize| -> Result<u32, BadAddress> {
            if t.len() < min || t.len() > max || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(t, 16).map_err(|_| bad())
        };
        let parts: Vec<&str> = s.split(':').collect();
        let (domain, bus, devfn) = match parts.as_slice() {
            [d, b, df] => (hex(d, 4, 8)?, *b, *df),
            [b, df] => (0, *b, *df),
            _ => return Err(bad()),
        };
        let bus = hex(bus, 2, 2)? as u8;
        let (dev, func) = devfn.split_once('.').ok_or_else(bad)?;
        let device = hex(dev, 2, 2)?;
        let function = hex(func, 1, 1)?;
        if device > 0x1f || function > 7 {
            return Err(bad());
        }
        Ok(PciAddress { domain, bus, device: device as u8, function: function as u8 })
    }
}

impl Serialize for PciAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

impl PciAddress {
    /// The function's directory under `sysfs` (`/sys` on a real host).
    pub fn dir(&self, sysfs: &Path) -> PathBuf {
        sysfs.join("bus/pci/devices").join(self.to_string())
    }

    /// Whether sysfs lists the function.
    pub fn exists(&self, sysfs: &Path) -> bool {
        std::fs::symlink_metadata(self.dir(sysfs)).is_ok()
    }

    /// The driver the function is bound to, if any.
    pub fn driver(&self, sysfs: &Path) -> Option<String> {
        driver_of(&self.dir(sysfs))
    }

    /// Its IOMMU group, or None on a host without an IOMMU.
    pub fn iommu_group(&self, sysfs: &Path) -> Option<u32> {
        let link = std::fs::read_link(self.dir(sysfs).join("iommu_group")).ok()?;
        link.file_name()?.to_str()?.parse().ok()
    }

    /// The other functions of its IOMMU group, sorted, with their drivers.
    pub fn group_peers(&self, sysfs: &Path) -> std::io::Result<Vec<(String, Option<String>)>> {
        let me = self.to_string();
        let mut peers: Vec<(String, Option<String>)> =
            std::fs::read_dir(self.dir(sysfs).join("iommu_group/devices"))?.flatten().map(|m| (m.file_name().to_string_lossy().into_owned(), driver_of(&m.path()))).filter(|(n, _)| *n != me).collect();
        peers.sort();
        Ok(peers)
    }

    /// A hex attribute such as `vendor` or `class`.
    pub fn hex_attr(&self, sysfs: &Path, name: &str) -> Option<u32> {
        let s = std::fs::read_to_string(self.dir(sysfs).join(name)).ok()?;
        u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
    }

    /// Its NUMA node (-1: none reported).
    pub fn numa_node(&self, sysfs: &Path) -> i32 {
        std::fs::read_to_string(self.dir(sysfs).join("numa_node")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(-1)
    }
}

/// The driver a sysfs device directory is bound to.
pub fn driver_of(dev: &Path) -> Option<String> {
    std::fs::read_link(dev.join("driver")).ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_print_and_bad_ones_say_how_to_write_them() {
        let a: PciAddress = "0000:00:04.0".parse().unwrap();
        assert_eq!(a, PciAddress { domain: 0, bus: 0, device: 4, function: 0 });
        assert_eq!("3a:1F.7".parse::<PciAddress>().unwrap().to_string(), "0000:3a:1f.7");
        assert_eq!("10000:01:00.1".parse::<PciAddress>().unwrap().to_string(), "10000:01:00.1");
        for bad in [
            "",
            "garbage",
            "0000:00:20.0",
            "0000:00:04.8",
            "0000:0:04.0",
            "00:00:04.0",
            "0000:00:04",
            "0000:00:04.0.1",
            "0000:00:04.00",
            "0000:00:g4.0",
            "+000:00:04.0",
            "0000:00:04:0",
            "0000:00:04.0 ",
        ] {
            let e = bad.parse::<PciAddress>().unwrap_err().to_string();
            assert!(e.contains("DDDD:BB:DD.F"), "{bad}: {e}");
        }
        let j: Vec<PciAddress> = serde_json::from_str(r#"["0000:00:04.0"]"#).unwrap();
        assert_eq!(serde_json::to_string(&j).unwrap(), r#"["0000:00:04.0"]"#);
        assert!(serde_json::from_str::<Vec<PciAddress>>(r#"["04.0"]"#).is_err());
    }
}
