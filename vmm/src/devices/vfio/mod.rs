//! Whole-device passthrough with VFIO (`--vfio DDDD:BB:DD.F`): a host PCI
//! function bound to `vfio-pci` becomes a PCI device of the guest.
//!
//! - [`check_host_device`]: what is checked on the host before anything is
//!   opened (the address, the device, its IOMMU group, the driver of every
//!   device in the group);
//! - [`device::VfioPci`]: the guest's view of the device (config space
//!   emulated where the guest must not write, BARs as KVM memory slots
//!   around the MSI-X table, MSI-X through KVM irqfds);
//! - [`msix`]: the emulated MSI-X table and its masking.
//!
//! One VFIO container per VM ([`VfioContext`]) holds every group, and all
//! guest RAM is DMA-mapped in it with IOVA = guest physical address.

pub mod device;
pub mod msi;
pub mod msix;

use std::path::Path;

pub use device::{VfioContext, VfioPci};

pub use vgpu_topology::pci::{driver_of, PciAddress, VFIO_DRIVER};

#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error(transparent)]
    BadAddress(#[from] vgpu_topology::pci::BadAddress),
    #[error("no PCI device {0} on this host ({1} does not exist)")]
    NoDevice(PciAddress, String),
    #[error("no IOMMU group for {0}: is the IOMMU on (intel_iommu=on)?")]
    NoIommuGroup(PciAddress),
    #[error(
        "{addr} is not bound to vfio-pci ({driver}): bind it first (echo vfio-pci > /sys/bus/pci/devices/{addr}/driver_override; echo {addr} > /sys/bus/pci/drivers_probe, after unbinding its driver)"
    )]
    NotVfio { addr: PciAddress, driver: String },
    #[error("IOMMU group {group} of {addr} also holds {other}, bound to {driver}: every device of the group must be bound to vfio-pci (or to no driver) to pass the group through")]
    GroupShared { addr: PciAddress, group: u32, other: String, driver: String },
    #[error("{0} is named twice: a device can be passed through once")]
    Duplicate(PciAddress),
    #[error("{addr}: {what}: {err}")]
    Vfio { addr: PciAddress, what: &'static str, err: String },
    #[error("{addr}: {msg}")]
    Unsupported { addr: PciAddress, msg: String },
}

fn describe(driver: &Option<String>) -> String {
    match driver {
        Some(d) => format!("its driver is {d}"),
        None => "it has no driver".into(),
    }
}

/// Checks, before anything is opened, that `addr` can be passed through:
/// the device exists under `sysfs`/bus/pci/devices, has an IOMMU group, is
/// bound to vfio-pci, and every other device of its group is bound to
/// vfio-pci or to no driver. Returns the group number.
pub fn check_host_device(addr: &PciAddress, sysfs: &Path) -> Result<u32, VfioError> {
    if !addr.exists(sysfs) {
        return Err(VfioError::NoDevice(*addr, addr.dir(sysfs).display().to_string()));
    }
    let group = addr.iommu_group(sysfs).ok_or(VfioError::NoIommuGroup(*addr))?;
    let driver = addr.driver(sysfs);
    if driver.as_deref() != Some(VFIO_DRIVER) {
        return Err(VfioError::NotVfio { addr: *addr, driver: describe(&driver) });
    }
    let peers = addr.group_peers(sysfs).map_err(|e| VfioError::Vfio { addr: *addr, what: "listing its IOMMU group", err: e.to_string() })?;
    for (name, driver) in peers {
        if driver.as_deref().is_some_and(|d| d != VFIO_DRIVER) {
            return Err(VfioError::GroupShared { addr: *addr, group, other: name, driver: driver.unwrap_or_default() });
        }
    }
    Ok(group)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    /// A fake sysfs: devices with an optional driver and IOMMU group.
    struct FakeSys(PathBuf);

    impl FakeSys {
        fn new(name: &str) -> FakeSys {
            let root = std::env::temp_dir().join(format!("vgpu-vfio-sysfs-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
            std::fs::create_dir_all(root.join("bus/pci/drivers")).unwrap();
            FakeSys(root)
        }

        fn device(&self, addr: &str, driver: Option<&str>, group: Option<u32>) {
            let d = self.0.join("devices/pci0000:00").join(addr);
            std::fs::create_dir_all(&d).unwrap();
            symlink(&d, self.0.join("bus/pci/devices").join(addr)).unwrap();
            if let Some(drv) = driver {
                let dd = self.0.join("bus/pci/drivers").join(drv);
                std::fs::create_dir_all(&dd).unwrap();
                symlink(&dd, d.join("driver")).unwrap();
            }
            if let Some(g) = group {
                let gd = self.0.join("kernel/iommu_groups").join(g.to_string());
                std::fs::create_dir_all(gd.join("devices")).unwrap();
                symlink(&gd, d.join("iommu_group")).unwrap();
                symlink(&d, gd.join("devices").join(addr)).unwrap();
            }
        }
    }

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn check(s: &FakeSys, addr: &str) -> Result<u32, String> {
        check_host_device(&addr.parse().unwrap(), &s.0).map_err(|e| e.to_string())
    }

    #[test]
    fn host_checks_name_the_missing_iommu_the_wrong_driver_and_the_shared_group() {
        let s = FakeSys::new("checks");
        s.device("0000:00:00.0", None, None);
        s.device("0000:00:02.0", Some("nvme"), Some(3));
        s.device("0000:00:03.0", Some("vfio-pci"), Some(4));
        s.device("0000:00:04.0", None, Some(5));
        s.device("0000:00:05.0", Some("vfio-pci"), Some(6));
        s.device("0000:00:05.1", Some("snd_hda_intel"), Some(6));
        s.device("0000:00:06.0", Some("vfio-pci"), Some(7));
        s.device("0000:00:06.1", None, Some(7));
        s.device("0000:00:06.2", Some("vfio-pci"), Some(7));

        let e = check(&s, "0000:00:09.0").unwrap_err();
        assert!(e.contains("no PCI device 0000:00:09.0"), "{e}");
        assert_eq!(check(&s, "0000:00:00.0").unwrap_err(), "no IOMMU group for 0000:00:00.0: is the IOMMU on (intel_iommu=on)?");
        let e = check(&s, "0000:00:02.0").unwrap_err();
        assert!(e.starts_with("0000:00:02.0 is not bound to vfio-pci (its driver is nvme)"), "{e}");
        let e = check(&s, "0000:00:04.0").unwrap_err();
        assert!(e.starts_with("0000:00:04.0 is not bound to vfio-pci (it has no driver)"), "{e}");
        let e = check(&s, "0000:00:05.0").unwrap_err();
        assert!(e.contains("IOMMU group 6 of 0000:00:05.0 also holds 0000:00:05.1, bound to snd_hda_intel"), "{e}");
        assert_eq!(check(&s, "0000:00:03.0"), Ok(4));
        // Unbound companions are fine: nothing else can use the group.
        assert_eq!(check(&s, "0000:00:06.0"), Ok(7));
    }
}
