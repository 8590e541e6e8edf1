//! Passthrough pools on this host, through the daemon's API and vgpuctl:
//! the devices sit in a fake sysfs tree (this host has no IOMMU), so what
//! is checked here is everything before the kernel would act: listing,
//! refusals with their reasons, nothing left behind by a refused VM, the
//! admin's scrub and its quarantine, the metrics. The real lend, return
//! and scrub run in the nested tier (nested_vfio.rs), and in unit tests
//! against a fake kernel (vgpu-mediator control::passthrough).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::json;
use vgpu_tests::vmm_harness::{kvm_available, test_guest};
use vgpu_tests::{bin, fake_numa_host, Mediator};

fn ctl(m: &Mediator, args: &[&str]) -> Output {
    m.vgpuctl().args(args).output().expect("run vgpuctl")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A PCI function in the fake tree, bound to `driver`, in `group`.
fn device(root: &Path, addr: &str, driver: &str, group: Option<u32>) {
    let d = root.join("bus/pci/devices").join(addr);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::create_dir_all(root.join("bus/pci/drivers").join(driver)).unwrap();
    for (f, v) in [("vendor", "0x1b36"), ("class", "0x010802"), ("numa_node", "0"), ("driver_override", "(null)"), ("reset", "")] {
        std::fs::write(d.join(f), v).unwrap();
    }
    symlink(root.join("bus/pci/drivers").join(driver), d.join("driver")).unwrap();
    if let Some(g) = group {
        let gd = root.join("kernel/iommu_groups").join(g.to_string()).join("devices");
        std::fs::create_dir_all(&gd).unwrap();
        symlink(&d, gd.join(addr)).unwrap();
        symlink(gd.parent().unwrap(), d.join("iommu_group")).unwrap();
    }
}

fn driver(root: &Path, addr: &str) -> String {
    std::fs::read_link(root.join("bus/pci/devices").join(addr).join("driver")).map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).unwrap_or_default()
}

struct Host {
    root: PathBuf,
    config: PathBuf,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_file(&self.config);
    }
}

/// nvme-a has no IOMMU group, nvme-b shares its group with a sound card,
/// gone is not on the host: pool `whole`. nvme-c is fine, in the private
/// pool `mine` that admits only `other`.
fn host(tag: &str) -> Host {
    let root = std::env::temp_dir().join(format!("vgpu-pt-{tag}-{}", std::process::id()));
    fake_numa_host(&root, 1);
    device(&root, "0000:00:04.0", "nvme", None);
    device(&root, "0000:00:05.0", "nvme", Some(5));
    device(&root, "0000:00:05.1", "snd_hda_intel", Some(5));
    device(&root, "0000:00:06.0", "nvme", Some(6));
    std::fs::create_dir_all(root.join("bus/pci/drivers/vfio-pci")).unwrap();
    let config = std::env::temp_dir().join(format!("vgpu-pt-{tag}-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        r#"
[[devices.passthrough]]
name = "nvme-a"
address = "0000:00:04.0"
[[devices.passthrough]]
name = "nvme-b"
address = "0000:00:05.0"
[[devices.passthrough]]
name = "gone"
address = "0000:00:1e.0"
[[devices.passthrough]]
name = "nvme-c"
address = "0000:00:06.0"
[[pools]]
name = "whole"
devices = ["nvme-a", "nvme-b", "gone"]
[[pools]]
name = "mine"
devices = ["nvme-c"]
access = "private"
allow = ["other"]
"#,
    )
    .unwrap();
    Host { root, config }
}

fn kernel() -> String {
    // Any readable file passes the description's check; no VMM starts.
    bin("vgpu-vmm").to_string_lossy().into_owned()
}

#[test]
fn refused_passthrough_vms_say_why_and_leave_nothing_behind() {
    let h = host("refuse");
    let m = Mediator::start_on_topology(&["--config", h.config.to_str().unwrap()], &h.root);
    let k = kernel();

    // Listed beside the shared devices, free, on their drivers.
    let (st, list) = m.api("GET", "/devices", None);
    assert_eq!(st, 200, "{list}");
    let a = list.as_array().unwrap().iter().find(|d| d["name"] == "nvme-a").cloned().expect("nvme-a listed");
    assert_eq!(
        (a["kind"].as_str(), a["state"].as_str(), a["pool"].as_str(), a["address"].as_str(), a["driver"].as_str()),
        (Some("passthrough"), Some("free"), Some("whole"), Some("0000:00:04.0"), Some("nvme"))
    );
    let table = text(&ctl(&m, &["device", "list"]));
    assert!(table.contains("LAST SCRUB") && table.contains("nvme-b") && table.contains("0000:00:05.0"), "{table}");

    // Every device of the pool fails, each for its own reason.
    let o = ctl(&m, &["vm", "create", "v1", "--memory", "64MiB", "--kernel", &k, "--passthrough", "whole"]);
    assert!(!o.status.success());
    let e = text(&o);
    assert!(e.contains("no free passthrough device in pool whole") && e.contains("HTTP 409"), "{e}");
    assert!(e.contains("0000:00:04.0) has no IOMMU group: this host has no IOMMU"), "{e}");
    assert!(e.contains("shares IOMMU group 5 with 0000:00:05.1 (snd_hda_intel)"), "{e}");
    assert!(e.contains("no PCI device 0000:00:1e.0"), "{e}");
    // With a vGPU too: its tenant is gone with the refusal.
    let o = ctl(&m, &["vm", "create", "v1", "--memory", "64MiB", "--kernel", &k, "--vgpu-memory", "16MiB", "--passthrough", "whole"]);
    assert!(!o.status.success(), "{}", text(&o));
    let (_, vms) = m.api("GET", "/vms", None);
    assert_eq!(vms, json!([]));
    let (_, tenants) = m.api("GET", "/tenants", None);
    assert_eq!(tenants, json!([]));
    for (addr, drv) in [("0000:00:04.0", "nvme"), ("0000:00:05.0", "nvme"), ("0000:00:05.1", "snd_hda_intel"), ("0000:00:06.0", "nvme")] {
        assert_eq!(driver(&h.root, addr), drv, "{addr}");
        assert_eq!(std::fs::read_to_string(h.root.join("bus/pci/devices").join(addr).join("driver_override")).unwrap(), "(null)", "{addr}");
    }

    // Pools: private, missing, without passthrough devices.
    let create = |pool: &str| m.api("POST", "/vms", Some(json!({"name": "v2", "memory": "64MiB", "kernel": k, "passthrough": [pool]})));
    let (st, v) = create("mine");
    assert_eq!(st, 403, "{v}");
    assert!(v["error"].as_str().unwrap().contains("pool mine is private and VM v2 is not on its allow-list"), "{v}");
    let (st, v) = create("nosuch");
    assert_eq!(st, 404, "{v}");
    let (st, v) = create("default");
    assert_eq!(st, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("pool default (it has no passthrough devices)"), "{v}");
    let (st, v) = m.api("POST", "/vms", Some(json!({"name": "v2", "memory": "64MiB", "kernel": k, "passthrough": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]})));
    assert_eq!(st, 400, "{v}");
    let (st, v) = m.api("POST", "/vms", Some(json!({"name": "v2", "memory": "64MiB", "kernel": k, "passthrough": ["../x"]})));
    assert_eq!(st, 400, "{v}");
    // A passthrough device is not for tenants.
    let (st, v) = m.api("POST", "/tenants", Some(json!({"name": "t", "memory": "1MiB", "device": "nvme-c"})));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("is a passthrough device"), "{v}");
    // On-demand scrubs are for passthrough devices.
    let o = ctl(&m, &["device", "scrub", "cpu0"]);
    assert!(!o.status.success() && text(&o).contains("shared device"), "{}", text(&o));
    assert!(!ctl(&m, &["device", "show", "nosuch"]).status.success());
    assert_eq!(m.metric("vgpu_passthrough_state", "device=\"nvme-a\",address=\"0000:00:04.0\",state=\"free\""), Some(1.0));
    assert_eq!(m.metric("vgpu_passthrough_state", "device=\"nvme-a\",address=\"0000:00:04.0\",state=\"lent\""), Some(0.0));
}

#[test]
fn a_device_that_fails_its_scrub_is_quarantined_and_reported() {
    let h = host("quarantine");
    let m = Mediator::start_on_topology(&["--config", h.config.to_str().unwrap()], &h.root);
    // `gone` is not on the host: its scrub fails, and it is quarantined.
    let o = ctl(&m, &["device", "scrub", "gone"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("is no longer on the host") && text(&o).contains("stays quarantined"), "{}", text(&o));
    let show = text(&ctl(&m, &["device", "show", "gone"]));
    assert!(show.contains("state:     quarantined") && show.contains("0 passed, 1 failed") && show.contains("FAILED"), "{show}");
    let (_, v) = m.api("GET", "/devices/gone", None);
    assert_eq!(v["state"], "quarantined");
    assert_eq!(v["scrubs"][0]["method"], "function-reset");
    assert_eq!(v["scrubs"][0]["previous_vm"], "");
    assert_eq!(m.metric("vgpu_passthrough_scrubs_total", "device=\"gone\",address=\"0000:00:1e.0\",result=\"failed\""), Some(1.0));
    assert_eq!(m.metric("vgpu_passthrough_last_scrub_ok", "device=\"gone\""), Some(0.0));
    assert_eq!(m.metric("vgpu_passthrough_state", "device=\"gone\",address=\"0000:00:1e.0\",state=\"quarantined\""), Some(1.0));
    // The quarantine is kept across a daemon restart, and named when a VM
    // asks the pool.
    let mut m = m;
    m.kill_and_restart(&["--config", h.config.to_str().unwrap()]);
    let (_, v) = m.api("GET", "/devices/gone", None);
    assert_eq!(v["state"], "quarantined", "{v}");
    let (st, v) = m.api("POST", "/vms", Some(json!({"name": "v3", "memory": "64MiB", "kernel": kernel(), "passthrough": ["whole"]})));
    assert_eq!(st, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("gone is quarantined"), "{v}");
}

#[test]
fn a_vm_without_a_vgpu_runs_and_reports_none() {
    if !kvm_available("a_vm_without_a_vgpu_runs_and_reports_none") {
        return;
    }
    let m = Mediator::start(&[]);
    let guest = test_guest().to_string_lossy().into_owned();
    let (st, v) = m.api("POST", "/vms", Some(json!({"name": "plain", "memory": "16MiB", "kernel": guest, "cmdline": "test=count", "restart": "never"})));
    assert_eq!(st, 201, "{v}");
    assert_eq!((v["state"].as_str(), v["device"].as_str()), (Some("running"), Some("")), "{v}");
    assert!(v["spec"].get("vgpu").is_none(), "{v}");
    let (_, tenants) = m.api("GET", "/tenants", None);
    assert_eq!(tenants, json!([]), "no vGPU tenant for a VM without one");
    let show = text(&ctl(&m, &["vm", "show", "plain"]));
    assert!(show.contains("vgpu:      none"), "{show}");
    let (st, _) = m.api("DELETE", "/vms/plain", None);
    assert!(st == 204 || st == 202, "{st}");
}
