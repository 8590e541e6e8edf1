//! Lending and returning against a fake sysfs whose writer plays the
//! kernel: unbind drops the driver link, drivers_probe binds the override
//! (or the device's own driver), reset succeeds unless told to fail.

use super::*;
use std::os::unix::fs::symlink;
use std::sync::atomic::{AtomicU32, Ordering};

struct Fake {
    root: PathBuf,
    state: PathBuf,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl Fake {
    fn new() -> Fake {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let base = std::env::temp_dir().join(format!("vgpu-pt-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("sys");
        for d in ["bus/pci/devices", "bus/pci/drivers/nvme", "bus/pci/drivers/nvidia", "bus/pci/drivers/vfio-pci", "kernel/iommu_groups"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::write(root.join("bus/pci/drivers_probe"), "").unwrap();
        Fake { root, state: base.join("state") }
    }

    fn dev(&self, addr: &str) -> PathBuf {
        self.root.join("bus/pci/devices").join(addr)
    }

    /// A function on `driver` (its own driver too), in `group`.
    fn device(&self, addr: &str, vendor: &str, class: &str, driver: Option<&str>, group: Option<u32>) {
        let d = self.dev(addr);
        std::fs::create_dir_all(&d).unwrap();
        for (f, v) in [("vendor", vendor), ("class", class), ("numa_node", "0"), ("driver_override", "(null)"), ("reset", ""), (".home", driver.unwrap_or(""))] {
            std::fs::write(d.join(f), v).unwrap();
        }
        if let Some(drv) = driver {
            symlink(self.root.join("bus/pci/drivers").join(drv), d.join("driver")).unwrap();
        }
        if let Some(g) = group {
            let gd = self.root.join("kernel/iommu_groups").join(g.to_string()).join("devices");
            std::fs::create_dir_all(&gd).unwrap();
            symlink(&d, gd.join(addr)).unwrap();
            symlink(gd.parent().unwrap(), d.join("iommu_group")).unwrap();
        }
    }

    fn driver(&self, addr: &str) -> Option<String> {
        addr.parse::<PciAddress>().unwrap().driver(&self.root)
    }

    /// The writer: the kernel's side of each attribute.
    fn writer(&self) -> SysWriter {
        let root = self.root.clone();
        Arc::new(move |path: &Path, value: &str| {
            let s = path.to_string_lossy().into_owned();
            let dev = |a: &str| root.join("bus/pci/devices").join(a.trim());
            if s.ends_with("/driver/unbind") {
                if dev(value).join(".unbind_hangs").exists() {
                    std::thread::sleep(Duration::from_secs(2));
                }
                std::fs::remove_file(dev(value).join("driver"))
            } else if s.ends_with("/driver_override") {
                std::fs::write(path, value.trim())
            } else if s.ends_with("/reset") {
                if path.parent().unwrap().join(".reset_fails").exists() {
                    return Err(io::Error::from_raw_os_error(libc::ENOTTY));
                }
                Ok(())
            } else if path == root.join("bus/pci/drivers_probe") {
                let d = dev(value);
                let over = std::fs::read_to_string(d.join("driver_override")).unwrap_or_default();
                let want = if over.is_empty() || over == "(null)" { std::fs::read_to_string(d.join(".home")).unwrap_or_default() } else { over };
                let target = root.join("bus/pci/drivers").join(&want);
                if want.is_empty() || !target.exists() || (want == "vfio-pci" && d.join(".refuse").exists()) {
                    return Err(io::Error::from_raw_os_error(libc::ENODEV));
                }
                symlink(target, d.join("driver"))
            } else {
                Err(io::Error::from_raw_os_error(libc::EACCES))
            }
        })
    }

    fn pass(&self, cfg: &[PassthroughConfig], gpu: GpuScrubber) -> Arc<Passthrough> {
        let mut p = Passthrough::new(cfg, self.root.clone(), &self.state, self.writer(), gpu).unwrap();
        p.write_limit = Duration::from_millis(500);
        Arc::new(p)
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.root.parent().unwrap());
    }
}

fn cfg(name: &str, addr: &str) -> PassthroughConfig {
    PassthroughConfig { name: name.into(), address: addr.parse().unwrap(), host_driver: None }
}

fn no_gpu() -> GpuScrubber {
    Box::new(|_| Err("no GPU scrub in this test".into()))
}

const NVME: (&str, &str) = ("0x1b36", "0x010802");
const GPU: (&str, &str) = ("0x10de", "0x030200");

#[test]
fn a_device_is_lent_bound_to_vfio_and_returned_to_its_driver_with_a_record() {
    let f = Fake::new();
    f.device("0000:00:04.0", NVME.0, NVME.1, Some("nvme"), Some(3));
    let p = f.pass(&[cfg("nvme0", "0000:00:04.0")], no_gpu());
    let d = p.lend_from("whole", &["nvme0".into()], "vm1", None).unwrap();
    assert_eq!(f.driver("0000:00:04.0").as_deref(), Some("vfio-pci"));
    assert_eq!(d.state(), PassState::Lent { vm: "vm1".into() });
    assert_eq!(p.lent_to("vm1").len(), 1);
    // A second VM finds the pool empty, and says why.
    let e = p.lend_from("whole", &["nvme0".into()], "vm2", None).unwrap_err().to_string();
    assert!(e.contains("no free passthrough device in pool whole") && e.contains("nvme0 is lent"), "{e}");
    // The state survives a daemon restart: a new registry sees it lent.
    let again = f.pass(&[cfg("nvme0", "0000:00:04.0")], no_gpu());
    assert_eq!(again.get("nvme0").unwrap().state(), PassState::Lent { vm: "vm1".into() });
    assert_eq!(again.get("nvme0").unwrap().lock().host_driver.as_deref(), Some("nvme"));

    let rec = p.give_back(&d, "vm1").expect("lent to vm1");
    assert!(rec.ok, "{rec:?}");
    assert_eq!((rec.method, rec.verified, rec.previous_vm.as_str(), rec.device.as_str()), (ScrubMethod::FunctionReset, false, "vm1", "nvme0"));
    assert_eq!(f.driver("0000:00:04.0").as_deref(), Some("nvme"));
    assert_eq!(std::fs::read_to_string(f.dev("0000:00:04.0").join("driver_override")).unwrap(), "");
    assert_eq!(d.state(), PassState::Free);
    let v = p.view(&d, "p");
    assert_eq!((v.state.as_str(), v.scrubs.len(), v.driver.as_deref()), ("free", 1, Some("nvme")));
    // The record is kept across restarts.
    assert_eq!(f.pass(&[cfg("nvme0", "0000:00:04.0")], no_gpu()).view(&d, "p").scrubs, v.scrubs);
}

#[test]
fn bad_hosts_are_refused_and_leave_every_driver_as_it_was() {
    let f = Fake::new();
    f.device("0000:00:04.0", NVME.0, NVME.1, Some("nvme"), None);
    f.device("0000:00:05.0", NVME.0, NVME.1, Some("nvme"), Some(5));
    f.device("0000:00:05.1", "0x8086", "0x040300", Some("snd_hda_intel"), Some(5));
    f.device("0000:00:06.0", NVME.0, NVME.1, Some("nvme"), Some(6));
    std::fs::write(f.dev("0000:00:06.0").join(".refuse"), "").unwrap();
    let p = f.pass(&[cfg("noiommu", "0000:00:04.0"), cfg("shared", "0000:00:05.0"), cfg("gone", "0000:00:1e.0"), cfg("refused", "0000:00:06.0")], no_gpu());
    let lend = |n: &str| p.lend_from("p", &[n.into()], "vm", None).unwrap_err().to_string();
    assert!(lend("noiommu").contains("has no IOMMU group: this host has no IOMMU"), "{}", lend("noiommu"));
    assert!(lend("shared").contains("shares IOMMU group 5 with 0000:00:05.1 (snd_hda_intel)"), "{}", lend("shared"));
    assert!(lend("gone").contains("no PCI device 0000:00:1e.0"), "{}", lend("gone"));
    // vfio-pci would not take it: back on nvme, free.
    let e = lend("refused");
    assert!(e.contains("is bound to no driver after binding, not to vfio-pci"), "{e}");
    for a in ["0000:00:04.0", "0000:00:05.0", "0000:00:06.0"] {
        assert_eq!(f.driver(a).as_deref(), Some("nvme"), "{a}");
    }
    assert_eq!(f.driver("0000:00:05.1").as_deref(), Some("snd_hda_intel"));
    assert!(p.devices.iter().all(|d| d.state() == PassState::Free));
    // No vfio-pci driver at all.
    std::fs::remove_dir(f.root.join("bus/pci/drivers/vfio-pci")).unwrap();
    f.device("0000:00:07.0", NVME.0, NVME.1, Some("nvme"), Some(7));
    let p = f.pass(&[cfg("novfio", "0000:00:07.0")], no_gpu());
    assert!(p.lend_from("p", &["novfio".into()], "vm", None).unwrap_err().to_string().contains("vfio-pci driver is not loaded"));
    assert_eq!(f.driver("0000:00:07.0").as_deref(), Some("nvme"));
    // The config names each device once.
    let e = Passthrough::new(&[cfg("a", "0000:00:07.0"), cfg("b", "0000:00:07.0")], f.root.clone(), &f.state, f.writer(), no_gpu()).err().unwrap();
    assert!(e.contains("listed twice"), "{e}");
}

#[test]
fn a_failed_scrub_quarantines_until_an_admin_scrub_passes() {
    let f = Fake::new();
    f.device("0000:00:04.0", NVME.0, NVME.1, Some("nvme"), Some(3));
    let p = f.pass(&[cfg("nvme0", "0000:00:04.0")], no_gpu());
    let d = p.lend_from("p", &["nvme0".into()], "vm1", None).unwrap();
    std::fs::write(f.dev("0000:00:04.0").join(".reset_fails"), "").unwrap();
    let rec = p.give_back(&d, "vm1").expect("lent to vm1");
    assert!(!rec.ok);
    assert!(rec.error.as_deref().unwrap().contains("resetting the function"), "{rec:?}");
    assert!(matches!(d.state(), PassState::Quarantined { .. }));
    let e = p.lend_from("p", &["nvme0".into()], "vm2", None).unwrap_err().to_string();
    assert!(e.contains("nvme0 is quarantined"), "{e}");
    // Quarantine survives a restart.
    assert!(matches!(f.pass(&[cfg("nvme0", "0000:00:04.0")], no_gpu()).get("nvme0").unwrap().state(), PassState::Quarantined { .. }));
    // Still failing: still quarantined, with a second record.
    assert!(!p.rescrub("nvme0").unwrap().ok);
    std::fs::remove_file(f.dev("0000:00:04.0").join(".reset_fails")).unwrap();
    let rec = p.rescrub("nvme0").unwrap();
    assert!(rec.ok && rec.previous_vm.is_empty(), "{rec:?}");
    assert_eq!(d.state(), PassState::Free);
    assert_eq!(p.view(&d, "p").scrubs.len(), 3);
    assert_eq!(f.driver("0000:00:04.0").as_deref(), Some("nvme"));
    // A lent device cannot be scrubbed under its VM.
    p.lend_from("p", &["nvme0".into()], "vm3", None).unwrap();
    assert!(p.rescrub("nvme0").unwrap_err().to_string().contains("lent to VM vm3"));
    assert!(p.rescrub("nope").is_err());
}

#[test]
fn a_gpu_is_zeroed_through_its_driver_and_a_failed_check_quarantines_it() {
    let f = Fake::new();
    f.device("0000:3b:00.0", GPU.0, GPU.1, Some("nvidia"), Some(40));
    f.device("0000:3c:00.0", GPU.0, GPU.1, Some("nvidia"), Some(41));
    let scrubber: GpuScrubber = Box::new(|a: &PciAddress| if a.bus == 0x3b { Ok(GpuScrub { bytes: 79 << 30, device_memory: 80 << 30 }) } else { Err("read back a non-zero byte at 0x7f0000".into()) });
    let p = f.pass(&[cfg("gpu0", "0000:3b:00.0"), cfg("gpu1", "0000:3c:00.0")], scrubber);
    let names: Vec<String> = vec!["gpu0".into(), "gpu1".into()];
    let a = p.lend_from("whole", &names, "vm1", None).unwrap();
    let b = p.lend_from("whole", &names, "vm2", None).unwrap();
    assert_eq!((a.name.as_str(), b.name.as_str(), a.is_gpu()), ("gpu0", "gpu1", true));
    let ra = p.give_back(&a, "vm1").expect("lent");
    assert!(ra.ok && ra.verified && ra.method == ScrubMethod::ZeroAndVerify && ra.bytes == 79 << 30 && ra.device_memory == 80 << 30, "{ra:?}");
    let rb = p.give_back(&b, "vm2").expect("lent");
    assert!(!rb.ok && !rb.verified && rb.error.as_deref().unwrap().contains("non-zero byte"), "{rb:?}");
    assert!(matches!(b.state(), PassState::Quarantined { reason } if reason.contains("non-zero")));
    // Back on nvidia either way: the driver is needed to scrub it again.
    assert_eq!(f.driver("0000:3c:00.0").as_deref(), Some("nvidia"));
}

#[test]
fn the_daemon_returns_devices_lent_to_vms_it_no_longer_has() {
    let f = Fake::new();
    f.device("0000:00:04.0", NVME.0, NVME.1, Some("nvme"), Some(3));
    f.device("0000:00:05.0", NVME.0, NVME.1, Some("nvme"), Some(4));
    let list = [cfg("a", "0000:00:04.0"), cfg("b", "0000:00:05.0")];
    let p = f.pass(&list, no_gpu());
    p.lend_from("p", &["a".into()], "kept", None).unwrap();
    p.lend_from("p", &["b".into()], "gone", None).unwrap();
    drop(p);
    let p = f.pass(&list, no_gpu());
    p.recover(|vm| vm == "kept");
    let b = p.get("b").unwrap().clone();
    let until = Instant::now() + Duration::from_secs(10);
    while b.state() != PassState::Free && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(b.state(), PassState::Free);
    assert_eq!(b.last_scrub().unwrap().previous_vm, "gone");
    assert_eq!(f.driver("0000:00:05.0").as_deref(), Some("nvme"));
    assert_eq!(p.get("a").unwrap().state(), PassState::Lent { vm: "kept".into() });
    assert_eq!(f.driver("0000:00:04.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn a_return_is_only_for_the_vm_the_device_is_lent_to() {
    let f = Fake::new();
    f.device("0000:00:04.0", NVME.0, NVME.1, Some("nvme"), Some(3));
    let p = f.pass(&[cfg("nvme0", "0000:00:04.0")], no_gpu());
    let d = p.lend_from("p", &["nvme0".into()], "vm1", None).unwrap();
    assert!(p.give_back(&d, "vm2").is_none(), "another VM's delete returns nothing");
    assert_eq!(d.state(), PassState::Lent { vm: "vm1".into() });
    assert_eq!(f.driver("0000:00:04.0").as_deref(), Some("vfio-pci"));
    assert!(p.give_back(&d, "vm1").is_some());
    assert!(p.give_back(&d, "vm1").is_none(), "a second return does nothing");
    assert_eq!(p.view(&d, "p").scrubs.len(), 1);
    // A VMM that did not end: its devices are quarantined, not returned.
    p.lend_from("p", &["nvme0".into()], "vm3", None).unwrap();
    p.quarantine_lent("vm3", "its VMM did not end");
    assert!(matches!(d.state(), PassState::Quarantined { reason } if reason.contains("did not end")));
    assert_eq!(f.driver("0000:00:04.0").as_deref(), Some("vfio-pci"), "a quarantined device stays away from the host");
}

#[test]
fn untrusted_records_and_unrecorded_vfio_devices_are_scrubbed_before_use() {
    let f = Fake::new();
    f.device("0000:00:04.0", NVME.0, NVME.1, Some("nvme"), Some(3));
    f.device("0000:00:05.0", NVME.0, NVME.1, Some("vfio-pci"), Some(4));
    std::fs::write(f.dev("0000:00:05.0").join(".home"), "nvme").unwrap();
    let p = f.pass(&[cfg("a", "0000:00:04.0"), cfg("b", "0000:00:05.0")], no_gpu());
    // b sits on vfio-pci with no record of a lend: returned first.
    assert_eq!(p.get("b").unwrap().state(), PassState::Returning { vm: String::new() });
    p.lend_from("p", &["a".into()], "vm1", None).unwrap();
    drop(p);
    // The config now gives a's name another address: a's record (lent to
    // vm1) is not trusted, and the device at that address, on vfio-pci,
    // is returned before anyone gets it.
    f.device("0000:00:06.0", NVME.0, NVME.1, Some("vfio-pci"), Some(5));
    std::fs::write(f.dev("0000:00:06.0").join(".home"), "nvme").unwrap();
    let p = f.pass(&[cfg("a", "0000:00:06.0"), cfg("b", "0000:00:05.0")], no_gpu());
    let a = p.get("a").unwrap().clone();
    assert_eq!(a.state(), PassState::Returning { vm: String::new() });
    p.recover(|_| true);
    let until = Instant::now() + Duration::from_secs(10);
    while p.devices.iter().any(|d| d.state() != PassState::Free) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(p.devices.iter().all(|d| d.state() == PassState::Free), "{:?}", p.devices.iter().map(|d| d.state()).collect::<Vec<_>>());
    // With no host driver on record, they are left without a driver.
    assert_eq!((f.driver("0000:00:05.0"), f.driver("0000:00:06.0")), (None, None));
    assert!(a.last_scrub().unwrap().ok);
}

#[test]
fn a_driver_that_will_not_let_go_quarantines_the_device_without_hanging() {
    let f = Fake::new();
    f.device("0000:3b:00.0", GPU.0, GPU.1, Some("nvidia"), Some(40));
    std::fs::write(f.dev("0000:3b:00.0").join(".unbind_hangs"), "").unwrap();
    let p = f.pass(&[cfg("gpu0", "0000:3b:00.0")], no_gpu());
    let t0 = Instant::now();
    let e = p.lend_from("whole", &["gpu0".into()], "vm1", None).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2), "the lend waited for the stuck write");
    assert!(matches!(e, PassError::NoneFree { internal: true, .. }), "{e:?}");
    assert!(chain(&e).contains("did not finish in time: something still has the device open"), "{}", chain(&e));
    assert!(matches!(p.get("gpu0").unwrap().state(), PassState::Quarantined { .. }));
}
