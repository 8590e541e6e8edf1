//! A VM's files behind symbolic links: the VMM opens its kernel,
//! initramfs, disks and serial log without following a link in any
//! component of their paths, at every start (so also when a managed VM
//! reboots); the mediator refuses a managed VM whose description names such
//! a path. The attack: a user who owns the directory of a VM's disk plants
//! `disk.img -> /a/root-only/file`, before the create or after it, and the
//! guest reads and writes that file through the VMM (root when unjailed).

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use vgpu_tests::vmm_harness::{kvm_available, test_guest, vmm_run};
use vgpu_tests::Mediator;

const SECRET: &[u8] = b"ROOT-ONLY SECRET, NOT A DISK";

/// A scratch tree: `vmlinux` and `real/kernel`, junk a kernel check
/// passes; `real/` with an initramfs and a disk image; `secret/target`,
/// mode 0600, standing in for a root-only file; links `kernel`, `initrd`,
/// `disk.img` (to the secret) and `via` (to `real/`).
struct Tree {
    dir: PathBuf,
}

impl Tree {
    fn new(tag: &str) -> Tree {
        let dir = std::env::temp_dir().join(format!("vgpu-links-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["real", "secret"] {
            std::fs::create_dir_all(dir.join(d)).expect("scratch dir");
        }
        std::fs::write(dir.join("vmlinux"), vec![0x90u8; 4096]).expect("kernel");
        std::fs::write(dir.join("real/kernel"), vec![0x90u8; 4096]).expect("kernel");
        std::fs::write(dir.join("real/initrd"), vec![0u8; 4096]).expect("initrd");
        std::fs::write(dir.join("real/disk.img"), vec![0u8; 64 << 10]).expect("disk");
        std::fs::write(dir.join("secret/target"), SECRET).expect("secret");
        std::fs::set_permissions(dir.join("secret/target"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
        std::os::unix::fs::symlink(dir.join("real/kernel"), dir.join("kernel")).expect("link");
        std::os::unix::fs::symlink(dir.join("real/initrd"), dir.join("initrd")).expect("link");
        std::os::unix::fs::symlink(dir.join("secret/target"), dir.join("disk.img")).expect("link");
        std::os::unix::fs::symlink(dir.join("real"), dir.join("via")).expect("link");
        Tree { dir }
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    fn s(&self, rel: &str) -> String {
        self.p(rel).display().to_string()
    }

    /// The error for `what` at `rel`: the path itself a link, or (`via`)
    /// its directory.
    fn says(&self, what: &str, rel: &str) -> String {
        match rel.strip_prefix("via/") {
            Some(_) => format!("{what} {}: {} is a symbolic link; give the real path", self.s(rel), self.s("via")),
            None => format!("{what} {} is a symbolic link; give the real path", self.s(rel)),
        }
    }

    fn secret_untouched(&self) {
        assert_eq!(std::fs::read(self.p("secret/target")).expect("secret"), SECRET, "the root-only file was written");
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn refused(args: &[&str], says: &str) {
    let o = vmm_run(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{args:?} was not refused:\n{err}");
    assert!(err.contains(says), "{args:?}: the error does not say {says:?}:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Refused before KVM is touched: no /dev/kvm needed.
#[test]
fn the_vmm_refuses_a_kernel_initramfs_or_disk_behind_a_symbolic_link() {
    let t = Tree::new("vmm");
    let kernel = t.s("real/kernel");
    for rel in ["kernel", "via/kernel"] {
        refused(&["--kernel", &t.s(rel), "--memory", "16"], &t.says("kernel", rel));
    }
    for rel in ["initrd", "via/initrd"] {
        refused(&["--kernel", &kernel, "--memory", "16", "--initramfs", &t.s(rel)], &t.says("initramfs", rel));
    }
    for rel in ["disk.img", "via/disk.img"] {
        refused(&["--kernel", &kernel, "--memory", "16", "--disk", &format!("path={}", t.s(rel))], &t.says("disk", rel));
    }
    t.secret_untouched();
}

/// The serial log is created without following a link (a dangling one
/// would otherwise create the file it names) and must be a regular file.
#[test]
fn the_vmm_refuses_a_serial_log_behind_a_symbolic_link() {
    if !kvm_available("the_vmm_refuses_a_serial_log_behind_a_symbolic_link") {
        return;
    }
    let t = Tree::new("serial");
    std::os::unix::fs::symlink(t.p("secret/made-by-the-vmm"), t.p("dangling.log")).expect("link");
    let g = test_guest().to_str().expect("guest path").to_string();
    for (rel, says) in [("disk.img", t.says("serial output", "disk.img")), ("dangling.log", t.says("serial output", "dangling.log")), ("via/serial.log", t.says("serial output", "via/serial.log"))] {
        refused(&["--kernel", &g, "--memory", "16", "--cmdline", "test=rng", "--serial", &t.s(rel)], &says);
    }
    assert!(!t.p("secret/made-by-the-vmm").exists(), "the VMM created a file through a dangling link");
    assert!(!t.p("real/serial.log").exists());
    t.secret_untouched();
}

/// The reboot case at the VMM: the same description starts the VM, then,
/// once its disk is swapped for a link to a root-only file, is refused
/// (every start opens the files again, so a check at create time is not
/// what protects them).
#[test]
fn a_disk_swapped_for_a_symbolic_link_after_a_good_start_is_refused_at_the_next_start() {
    let t = Tree::new("swap");
    let kvm = kvm_available("a_disk_swapped_for_a_symbolic_link_after_a_good_start_is_refused_at_the_next_start (the good start)");
    let kernel = if kvm { test_guest().to_path_buf() } else { t.p("vmlinux") };
    let cfg = t.p("vm.json");
    let vm = json!({ "kernel": kernel, "cmdline": "test=blk", "memory_mib": 16, "serial": t.p("serial.log"), "disks": [{ "path": t.p("real/disk.img") }] });
    std::fs::write(&cfg, vm.to_string()).expect("vm.json");
    let cfg = cfg.to_str().expect("utf8");
    if kvm {
        let o = vmm_run(&["--config", cfg]);
        assert_eq!(o.status.code(), Some(0), "the good start failed:\n{}", String::from_utf8_lossy(&o.stderr));
        let disk = std::fs::read(t.p("real/disk.img")).expect("disk");
        assert_eq!(&disk[512..512 + 17], b"MARKER-FROM-GUEST", "the guest wrote its disk");
    }
    std::fs::remove_file(t.p("real/disk.img")).expect("rm");
    std::os::unix::fs::symlink(t.p("secret/target"), t.p("real/disk.img")).expect("link");
    refused(&["--config", cfg], &t.says("disk", "real/disk.img"));
    // A directory on the way swapped for a link to another directory.
    std::fs::remove_file(t.p("real/disk.img")).expect("rm");
    std::fs::rename(t.p("real"), t.p("moved")).expect("mv");
    std::os::unix::fs::symlink(t.p("secret"), t.p("real")).expect("link");
    std::fs::write(t.p("secret/disk.img"), vec![0u8; 64 << 10]).expect("disk");
    refused(&["--config", cfg], &format!("disk {}: {} is a symbolic link; give the real path", t.s("real/disk.img"), t.s("real")));
    t.secret_untouched();
}

fn post_vm(m: &Mediator, name: &str, spec: Value) -> (u16, Value) {
    let mut b = json!({ "name": name, "memory": "16MiB", "cmdline": "test=count" });
    for (k, v) in spec.as_object().expect("object") {
        b[k] = v.clone();
    }
    m.api("POST", "/vms", Some(b))
}

/// `POST /vms` refuses each file behind a link with 400, naming the link,
/// and makes nothing (the description is checked before anything).
#[test]
fn a_managed_vm_whose_disk_kernel_or_initramfs_is_behind_a_symbolic_link_is_refused_with_400() {
    let t = Tree::new("mediator");
    let m = Mediator::start(&["--device-memory", "64MiB"]);
    let kernel = t.s("real/kernel");
    let cases = [
        ("k1", json!({ "kernel": t.s("kernel") }), t.says("kernel", "kernel")),
        ("k2", json!({ "kernel": t.s("via/kernel") }), t.says("kernel", "via/kernel")),
        ("i1", json!({ "kernel": kernel, "initramfs": t.s("initrd") }), t.says("initramfs", "initrd")),
        ("i2", json!({ "kernel": kernel, "initramfs": t.s("via/initrd") }), t.says("initramfs", "via/initrd")),
        ("d1", json!({ "kernel": kernel, "disks": [{ "path": t.s("disk.img") }] }), t.says("disk", "disk.img")),
        ("d2", json!({ "kernel": kernel, "disks": [{ "path": t.s("via/disk.img") }] }), t.says("disk", "via/disk.img")),
        ("d3", json!({ "kernel": kernel, "disks": [{ "path": t.s("real/disk.img"), "read_only": true }, { "path": t.s("disk.img"), "read_only": true }] }), t.says("disk", "disk.img")),
    ];
    for (name, spec, says) in cases {
        let (st, v) = post_vm(&m, name, spec);
        assert_eq!(st, 400, "{name}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| e.contains(&says)), "{name}: the error does not say {says:?}: {v}");
    }
    assert_eq!(m.api("GET", "/vms", None).1, json!([]), "a refused VM was kept");
    t.secret_untouched();
}

/// The reboot case end to end: a managed VM created on a good disk; the
/// disk swapped for a link to a root-only file; `POST /vms/NAME/reboot`
/// re-spawns the VMM, which refuses the link; the VM is failed with that
/// error and the root-only file is untouched.
#[test]
fn a_managed_vms_disk_swapped_for_a_symbolic_link_is_refused_when_the_vm_reboots() {
    const TEST: &str = "a_managed_vms_disk_swapped_for_a_symbolic_link_is_refused_when_the_vm_reboots";
    if !kvm_available(TEST) {
        return;
    }
    let t = Tree::new("reboot");
    // Writable by whichever uid the daemon jails its VMMs as.
    std::fs::set_permissions(t.p("real/disk.img"), std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let m = Mediator::start(&["--device-memory", "64MiB"]);
    let g = test_guest().to_str().expect("guest path").to_string();
    // restart=never: the failed start leaves it stopped, its error shown.
    let (st, v) = post_vm(&m, "swapped", json!({ "kernel": g, "restart": "never", "disks": [{ "path": t.s("real/disk.img") }] }));
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    std::fs::remove_file(t.p("real/disk.img")).expect("rm");
    std::os::unix::fs::symlink(t.p("secret/target"), t.p("real/disk.img")).expect("link");
    let says = t.says("disk", "real/disk.img");
    let (st, v) = m.api("POST", "/vms/swapped/reboot", None);
    assert!(st >= 400, "the reboot was answered {st}: {v}");
    assert!(v["error"].as_str().is_some_and(|e| e.contains(&says)), "the reboot's error does not say {says:?}: {v}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let v = loop {
        let (_, v) = m.api("GET", "/vms/swapped", None);
        if v["state"] == "stopped" || std::time::Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!((v["state"].as_str(), v["pid"].as_u64()), (Some("stopped"), Some(0)), "{v}");
    assert!(v["error"].as_str().is_some_and(|e| e.contains(&says)), "{v}");
    t.secret_untouched();
    let (st, _) = m.api("DELETE", "/vms/swapped", None);
    assert!(st == 200 || st == 202 || st == 204, "{st}");
    t.secret_untouched();
}
