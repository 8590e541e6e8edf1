//! `vgpu-vmm --vfio` on this host, which has no IOMMU and no VFIO: every
//! bad input is refused before a VM runs, with its reason and a failure
//! status, never a panic. The checks of the device, its driver and its
//! IOMMU group run against this host's sysfs and against fake sysfs trees
//! (`VGPU_SYSFS_ROOT`). Passing a device through for real is tested in
//! the nested host (nested_vfio.rs).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use vgpu_tests::vmm_harness::*;
use vgpu_tests::*;

fn vmm(args: &[&str], sysfs: Option<&Path>) -> Output {
    let mut c = Command::new(bin("vgpu-vmm"));
    c.args(args).stdin(Stdio::null());
    if let Some(root) = sysfs {
        c.env("VGPU_SYSFS_ROOT", root);
    }
    c.output().expect("run vgpu-vmm")
}

/// Refused with `status` and `expect` in the message, no panic.
fn refused(args: &[&str], sysfs: Option<&Path>, status: i32, expect: &str) {
    let o = vmm(args, sysfs);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(status), "{args:?}: expected status {status}:\n{err}");
    assert!(err.contains(expect), "{args:?}: expected {expect:?} in:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vgpu-vmm-vfio-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// A fake sysfs tree: PCI devices with an optional driver and IOMMU group.
fn fake_device(root: &Path, addr: &str, driver: Option<&str>, group: Option<u32>) {
    let d = root.join("devices/pci0000:00").join(addr);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
    symlink(&d, root.join("bus/pci/devices").join(addr)).unwrap();
    if let Some(drv) = driver {
        let dd = root.join("bus/pci/drivers").join(drv);
        std::fs::create_dir_all(&dd).unwrap();
        symlink(&dd, d.join("driver")).unwrap();
    }
    if let Some(g) = group {
        let gd = root.join("kernel/iommu_groups").join(g.to_string());
        std::fs::create_dir_all(gd.join("devices")).unwrap();
        symlink(&gd, d.join("iommu_group")).unwrap();
        symlink(&d, gd.join("devices").join(addr)).unwrap();
    }
}

#[test]
fn malformed_addresses_are_refused_with_the_format_to_use() {
    let guest = test_guest().to_str().unwrap().to_string();
    for bad in ["garbage", "", "0000:00:20.0", "0000:00:04.8", "00:00:04.0", "0000:00:04", "0000:00:04.0,ro", "../../etc:00:04.0"] {
        refused(&["--kernel", &guest, "--vfio", bad], None, 2, "use DDDD:BB:DD.F");
    }
    // The config file's form is checked as strictly.
    let dir = scratch("json");
    let cfg = dir.join("vm.json");
    std::fs::write(&cfg, serde_json::json!({ "kernel": guest, "vfio": ["0000:00:04"] }).to_string()).unwrap();
    refused(&["--config", cfg.to_str().unwrap()], None, 1, "invalid PCI address '0000:00:04'");
    std::fs::write(&cfg, serde_json::json!({ "kernel": guest, "vfio": "0000:00:04.0" }).to_string()).unwrap();
    refused(&["--config", cfg.to_str().unwrap()], None, 1, "invalid VM config");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn devices_of_this_host_are_refused_for_their_missing_iommu_group_or_driver() {
    let guest = test_guest().to_str().unwrap().to_string();
    refused(&["--kernel", &guest, "--vfio", "0000:ff:1f.7"], None, 1, "no PCI device 0000:ff:1f.7 on this host");
    // A real device: this host has no IOMMU, so no device has a group.
    let Some(first) = std::fs::read_dir("/sys/bus/pci/devices").ok().and_then(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).min()) else {
        report_skip("devices_of_this_host_are_refused_for_their_missing_iommu_group_or_driver", "this host lists no PCI device in /sys/bus/pci/devices");
        return;
    };
    let dev = Path::new("/sys/bus/pci/devices").join(&first);
    let driver = std::fs::read_link(dev.join("driver")).ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    let expect = if !dev.join("iommu_group").exists() {
        format!("no IOMMU group for {first}: is the IOMMU on (intel_iommu=on)?")
    } else if driver.as_deref() != Some("vfio-pci") {
        format!("{first} is not bound to vfio-pci")
    } else {
        report_skip("devices_of_this_host_are_refused_for_their_missing_iommu_group_or_driver", &format!("{first} is bound to vfio-pci here"));
        return;
    };
    refused(&["--kernel", &guest, "--vfio", &first], None, 1, &expect);
    // Nothing changed hands.
    let after = std::fs::read_link(dev.join("driver")).ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    assert_eq!(after, driver, "{first}'s driver changed");
}

#[test]
fn wrong_drivers_shared_groups_and_duplicates_are_refused_by_name() {
    let guest = test_guest().to_str().unwrap().to_string();
    let root = scratch("sysfs");
    fake_device(&root, "0000:00:02.0", Some("nvme"), Some(3));
    fake_device(&root, "0000:00:03.0", None, Some(4));
    fake_device(&root, "0000:00:05.0", Some("vfio-pci"), Some(6));
    fake_device(&root, "0000:00:05.1", Some("snd_hda_intel"), Some(6));
    fake_device(&root, "0000:00:06.0", Some("vfio-pci"), Some(7));
    fake_device(&root, "0000:7e:1f.7", Some("vfio-pci"), Some(8));
    fake_device(&root, "0000:00:07.0", Some("vfio-pci"), None);
    let s = Some(root.as_path());
    let k = ["--kernel", guest.as_str(), "--memory", "16"];
    let with = |extra: &[&'static str]| k.iter().copied().chain(extra.iter().copied()).collect::<Vec<&str>>();

    refused(&with(&["--vfio", "0000:00:02.0"]), s, 1, "0000:00:02.0 is not bound to vfio-pci (its driver is nvme)");
    refused(&with(&["--vfio", "0000:00:03.0"]), s, 1, "0000:00:03.0 is not bound to vfio-pci (it has no driver)");
    refused(&with(&["--vfio", "0000:00:05.0"]), s, 1, "IOMMU group 6 of 0000:00:05.0 also holds 0000:00:05.1, bound to snd_hda_intel");
    refused(&with(&["--vfio", "0000:00:07.0"]), s, 1, "no IOMMU group for 0000:00:07.0: is the IOMMU on (intel_iommu=on)?");
    refused(&with(&["--vfio", "0000:00:06.0", "--vfio", "00:06.0"]), s, 1, "0000:00:06.0 is named twice");
    let nine = ["--vfio", "0000:00:06.0"].repeat(9);
    refused(&with(&nine), s, 1, "9 passthrough devices; the limit is 8");
    // Jailed, the device's own sysfs entries (the real ones, whatever
    // VGPU_SYSFS_ROOT says) and nodes under /dev/vfio are exposed: a device
    // this host does not have is refused before the jail is built.
    refused(&with(&["--vfio", "0000:7e:1f.7", "--jail", "/tmp/vgpu-vfio-jail", "--jail-uid", "1000", "--jail-gid", "1000"]), s, 1, "passthrough device /sys/bus/pci/devices/0000:7e:1f.7");
    // Every check passes; opening it needs VFIO, which this host lacks.
    if kvm_available("wrong_drivers_shared_groups_and_duplicates_are_refused_by_name") {
        let o = vmm(&with(&["--vfio", "0000:00:06.0"]), s);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("VFIO") && !err.contains("panicked"), "{err}");
        println!("vgpu-vmm on a host without VFIO: {}", err.trim());
    }
    std::fs::remove_dir_all(root).unwrap();
}
