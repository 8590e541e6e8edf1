//! Managed VMs (`/vms`, `vgpuctl vm`) on the KVM tier: the bare-metal test
//! guest counting on its console stands in for a Linux guest (which this
//! host's KVM cannot run; the nested tier boots those).

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vgpu_tests::vmm_harness::{kvm_available, test_guest};
use vgpu_tests::Mediator;

fn ok(o: Output) -> String {
    assert!(o.status.success(), "vgpuctl failed ({:?}):\n{}{}", o.status, String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn ctl(m: &Mediator, args: &[&str]) -> Output {
    m.vgpuctl().args(args).output().expect("run vgpuctl")
}

fn json_of(m: &Mediator, args: &[&str]) -> Value {
    let mut all = vec!["-o", "json"];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(ctl(m, &all))).expect("vgpuctl -o json prints JSON")
}

fn guest() -> String {
    test_guest().to_str().expect("guest path").to_string()
}

fn alive(pid: u64) -> bool {
    // A zombie is not alive: it has ended, only its parent did not reap it.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

fn show(m: &Mediator, name: &str) -> Value {
    json_of(m, &["vm", "show", name])
}

fn create_counting(m: &Mediator, name: &str, extra: &[&str]) -> Value {
    let g = guest();
    let mut args = vec!["-o", "json", "vm", "create", name, "--memory", "16MiB", "--kernel", &g, "--cmdline", "test=count", "--vgpu-memory", "32MiB"];
    args.extend_from_slice(extra);
    serde_json::from_str(&ok(ctl(m, &args))).expect("JSON")
}

/// Nothing of VM `name` is left: no tenant, no VMM process, no API socket,
/// no state directory.
fn assert_nothing_left(m: &Mediator, name: &str, pids: &[u64]) {
    let (_, tenants) = m.api("GET", "/tenants", None);
    assert!(tenants.as_array().expect("list").iter().all(|t| t["name"] != name), "tenant {name} left behind: {tenants}");
    let (_, vms) = m.api("GET", "/vms", None);
    assert!(vms.as_array().expect("list").iter().all(|v| v["name"] != name), "VM {name} left behind: {vms}");
    assert!(!m.run_dir.join("vms").join(format!("{name}.sock")).exists(), "API socket left behind");
    assert!(!m.run_dir.join("state/vms").join(name).exists(), "state directory left behind");
    for p in pids {
        assert!(wait_until(Duration::from_secs(5), || !alive(*p)), "VMM {p} still runs");
    }
    let vmms = std::process::Command::new("pgrep").args(["-f", &format!("{}/vms/{name}.sock", m.run_dir.display())]).output().expect("pgrep");
    assert!(String::from_utf8_lossy(&vmms.stdout).trim().is_empty(), "a VMM for {name} runs: {}", String::from_utf8_lossy(&vmms.stdout));
}

#[test]
fn a_vm_is_created_with_its_vgpu_listed_stopped_started_and_deleted() {
    if !kvm_available("a_vm_is_created_with_its_vgpu_listed_stopped_started_and_deleted") {
        return;
    }
    let m = Mediator::start(&["--device-memory", "128MiB"]);
    let disk = m.run_dir.join("web-root.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).expect("disk image");
    let disk_arg = format!("{},ro,bw=10MiB/1000", disk.display());
    // An interface with its MAC and a rate limit (the VMM makes the tap,
    // which needs root).
    let net_arg = format!("tap=vgtw{},mac=52:54:00:aa:bb:cc,tx_bw=1MiB/100", std::process::id() % 100_000);
    let mut extra = vec!["--vcpus", "1", "--disk", &disk_arg];
    if is_root() {
        extra.extend(["--net", &net_arg]);
    }
    let v = create_counting(&m, "web", &extra);
    assert_eq!(v["state"], "running", "{v}");
    let pid = v["pid"].as_u64().expect("pid");
    assert!(alive(pid));
    // The VMM runs the description the daemon wrote for it (one JSON
    // config, the VMM's own schema), and its API reports that config.
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let cmd: Vec<String> = cmd.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let at = cmd.iter().position(|a| a == "--config").unwrap_or_else(|| panic!("the VMM was not given a config file: {cmd:?}"));
    let written: Value = serde_json::from_slice(&std::fs::read(&cmd[at + 1]).expect("the VMM's config file")).expect("JSON");
    let api = v["api_socket"].as_str().expect("api_socket");
    let running: Value =
        serde_json::from_str(&ok(std::process::Command::new(vgpu_tests::bin("vgpuctl")).args(["-o", "json", "vmm", "--socket", api, "info"]).output().expect("vgpuctl"))).expect("JSON");
    assert_eq!(running["config"], written, "the VMM runs what the daemon wrote");
    // Its disk, read-only and rate-limited as asked; its vGPU; its node.
    assert_eq!(written["disks"], json!([{ "path": disk, "read_only": true, "bandwidth": { "size": 10 << 20, "refill_ms": 1000 } }]), "{written}");
    assert_eq!(written["vgpu"]["socket"], m.api("GET", "/tenants/web", None).1["socket"], "{written}");
    if is_root() {
        let tap = net_arg.split(',').next().and_then(|t| t.strip_prefix("tap=")).unwrap_or("");
        assert_eq!(written["nets"], json!([{ "tap": tap, "mac": "52:54:00:aa:bb:cc", "tx_bandwidth": { "size": 1 << 20, "refill_ms": 100 } }]), "{written}");
    }
    if let Some(node) = m.device("cpu0")["numa_node"].as_i64().filter(|n| *n >= 0) {
        assert_eq!(written["numa_node"], node, "the VMM runs on its vGPU's node: {written}");
    }
    // Listed with its device and that device's NUMA node.
    let list = json_of(&m, &["vm", "list"]);
    let row = &list.as_array().expect("list")[0];
    assert_eq!((row["name"].as_str(), row["state"].as_str(), row["device"].as_str()), (Some("web"), Some("running"), Some("cpu0")), "{list}");
    assert_eq!(row["numa_node"], m.device("cpu0")["numa_node"], "the VM's node is its vGPU's device's");
    // Its vGPU is a VM tenant of its name, which cannot be deleted alone.
    let (_, t) = m.api("GET", "/tenants/web", None);
    assert_eq!((t["kind"].as_str(), t["memory"].as_u64()), (Some("vm"), Some(32 << 20)), "{t}");
    let (code, e) = m.api("DELETE", "/tenants/web", None);
    assert_eq!(code, 409, "{e}");
    // The guest's console.
    assert!(wait_until(Duration::from_secs(20), || String::from_utf8_lossy(&ctl(&m, &["vm", "console", "web"]).stdout).contains("tick 3")), "no console output");
    // Stop: the guest is asked (Ctrl-Alt-Del; it resets), the VMM ends.
    // With --wait, the VM's state is printed on stderr while the daemon
    // works (here: stopping, until the guest has reset).
    let o = ctl(&m, &["-o", "json", "vm", "stop", "web", "--wait"]);
    let progress = String::from_utf8_lossy(&o.stderr).into_owned();
    let s: Value = serde_json::from_str(&ok(o)).expect("JSON");
    assert_eq!((s["state"].as_str(), s["desired"].as_str(), s["pid"].as_u64()), (Some("stopped"), Some("stopped"), Some(0)), "{s}");
    assert!(progress.lines().next().is_some_and(|l| l.starts_with("vgpuctl: VM web: ") && l.ends_with(" s)")), "no progress on stderr: {progress:?}");
    assert!(wait_until(Duration::from_secs(5), || !alive(pid)), "the VMM did not end");
    assert_eq!(m.api("GET", "/tenants/web", None).0, 200, "a stopped VM keeps its vGPU");
    // Start again, then a reboot gives a new VMM.
    let s = json_of(&m, &["vm", "start", "web"]);
    assert_eq!(s["state"], "running", "{s}");
    let again = s["pid"].as_u64().expect("pid");
    // Starting a running VM changes nothing (and answers at once).
    let s = json_of(&m, &["vm", "start", "web"]);
    assert_eq!((s["state"].as_str(), s["pid"].as_u64()), (Some("running"), Some(again)), "{s}");
    let r = json_of(&m, &["vm", "reboot", "web"]);
    assert_eq!(r["state"], "running", "{r}");
    assert_ne!(r["pid"].as_u64(), Some(again), "reboot starts a new VMM");
    let last = r["pid"].as_u64().expect("pid");
    assert!(!ok(ctl(&m, &["vm", "logs", "web"])).contains("panicked"));
    // Delete: everything goes, the vGPU's memory released.
    // --wait waits for the vGPU's memory to be released, saying so.
    let o = ctl(&m, &["-o", "json", "vm", "delete", "web", "--wait"]);
    let progress = String::from_utf8_lossy(&o.stderr).into_owned();
    let d: Value = serde_json::from_str(&ok(o)).expect("JSON");
    assert_eq!(d["released"], true, "{d}");
    assert!(progress.contains("vgpuctl: VM web: "), "no progress on stderr: {progress:?}");
    assert_eq!(m.api("GET", "/tenants/web", None).0, 404, "released means its vGPU tenant is gone");
    assert_nothing_left(&m, "web", &[pid, again, last]);
    assert_eq!(m.device("cpu0")["memory_reserved"], 0);
}

#[test]
fn a_vmm_that_dies_is_restarted_by_its_policy() {
    if !kvm_available("a_vmm_that_dies_is_restarted_by_its_policy") {
        return;
    }
    let m = Mediator::start(&["--device-memory", "128MiB"]);
    let v = create_counting(&m, "keep", &[]);
    let pid = v["pid"].as_u64().expect("pid");
    // SAFETY: kill sends a signal to a VMM process this test's daemon runs.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert!(
        wait_until(Duration::from_secs(15), || {
            let s = show(&m, "keep");
            s["state"] == "running" && s["restarts"] == 1 && s["pid"].as_u64().is_some_and(|p| p != pid && p != 0)
        }),
        "on-failure did not restart a killed VMM: {}",
        show(&m, "keep")
    );
    assert_eq!(show(&m, "keep")["last_exit"], "signal 9");
    // With restart=never, it stays stopped.
    let once = create_counting(&m, "once", &["--restart", "never"]);
    let p = once["pid"].as_u64().expect("pid");
    // SAFETY: as above.
    unsafe { libc::kill(p as i32, libc::SIGKILL) };
    assert!(wait_until(Duration::from_secs(10), || show(&m, "once")["state"] == "stopped"), "{}", show(&m, "once"));
    std::thread::sleep(Duration::from_secs(2));
    let s = show(&m, "once");
    assert_eq!((s["state"].as_str(), s["desired"].as_str(), s["restarts"].as_u64()), (Some("stopped"), Some("stopped"), Some(0)), "{s}");
}

#[test]
fn the_daemon_brings_its_vms_back_after_it_is_killed() {
    if !kvm_available("the_daemon_brings_its_vms_back_after_it_is_killed") {
        return;
    }
    let args = ["--device-memory", "128MiB"];
    let mut m = Mediator::start(&args);
    let v = create_counting(&m, "back", &[]);
    let pid = v["pid"].as_u64().expect("pid");
    create_counting(&m, "resting", &[]);
    ok(ctl(&m, &["vm", "stop", "resting", "--timeout", "0"]));
    assert_eq!(m.api("GET", "/tenants/resting", None).0, 200, "a stopped VM keeps its vGPU's reservation");
    m.kill_and_restart(&args);
    // The VMM died with the daemon; the new daemon starts it again, and
    // leaves the stopped one stopped.
    assert!(wait_until(Duration::from_secs(5), || !alive(pid)), "the VMM outlived its daemon");
    assert!(wait_until(Duration::from_secs(20), || show(&m, "back")["state"] == "running"), "{}", show(&m, "back"));
    let s = show(&m, "back");
    assert_eq!(s["spec"]["vgpu"]["memory"], 32 << 20, "{s}");
    assert_ne!(s["pid"].as_u64(), Some(pid));
    assert_eq!(m.api("GET", "/tenants/back", None).0, 200, "its vGPU was made again");
    assert_eq!(show(&m, "resting")["state"], "stopped");
    assert_eq!(m.api("GET", "/tenants/resting", None).0, 200, "the stopped VM's vGPU (a saved tenant) came back with the daemon");
    let s = json_of(&m, &["vm", "start", "resting"]);
    assert_eq!(s["state"], "running", "{s}");
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write");
    p
}

#[test]
fn bad_vm_requests_get_clear_errors_and_leave_nothing_behind() {
    if !kvm_available("bad_vm_requests_get_clear_errors_and_leave_nothing_behind") {
        return;
    }
    let m = Mediator::start(&["--device-memory", "128MiB"]);
    let dir = m.run_dir.join("inputs");
    std::fs::create_dir_all(&dir).expect("dir");
    let junk = write(&dir, "junk-kernel", b"this is not a kernel");
    let g = guest();
    let body = |name: &str, extra: Value| {
        let mut b = json!({ "name": name, "memory": "16MiB", "kernel": g, "cmdline": "test=count", "vgpu": { "memory": "32MiB" } });
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    m.tenant("taken", "16MiB");
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("nopool", json!({ "vgpu": { "memory": "32MiB", "pool": "nosuch" } }), 404, "nosuch"),
        ("nokernel", json!({ "kernel": "/nonexistent/vmlinux" }), 400, "/nonexistent/vmlinux"),
        ("relkernel", json!({ "kernel": "vmlinux" }), 400, "absolute"),
        ("junk", json!({ "kernel": junk }), 400, "vgpu-vmm ended as it started"),
        ("taken", json!({}), 409, "tenant named taken"),
        ("toobig", json!({ "vgpu": { "memory": "1GiB" } }), 507, ""),
        ("tiny", json!({ "memory": "1MiB" }), 400, "memory"),
        ("huge", json!({ "hugepages": "1G", "memory": "512GiB" }), 507, "hugepages"),
        ("disk", json!({ "disks": [{ "path": "/dev/null" }] }), 400, "not a regular file or a block device"),
        ("nodisk", json!({ "disks": [{ "path": "/nonexistent/disk.img" }] }), 400, "/nonexistent/disk.img"),
        ("bootdisk", json!({ "kernel": null, "boot_disk": "/dev/null" }), 400, "no firmware"),
        ("net", json!({ "nets": [{ "tap": "a tap name far too long" }] }), 400, "invalid interface name"),
        ("nobridge", json!({ "nets": [{ "bridge": "vgpunosuchbr" }] }), 400, "no bridge named vgpunosuchbr"),
        ("both", json!({ "nets": [{ "tap": "t0", "bridge": "b0" }] }), 400, "exactly one of them"),
        ("neither", json!({ "nets": [{ "mac": "52:54:00:00:00:01" }] }), 400, "exactly one of them"),
        ("multicast", json!({ "nets": [{ "tap": "t0", "mac": "01:00:5e:00:00:01" }] }), 400, "unicast"),
        ("norate", json!({ "disks": [{ "path": "/dev/null", "bandwidth": { "size": 0, "refill_ms": 1000 } }] }), 400, ""),
        ("slowrate", json!({ "nets": [{ "tap": "t0", "rx_ops": { "size": 10, "refill_ms": 0 } }] }), 400, "refill"),
        ("bad name!", json!({}), 400, "VM name"),
        ("fields", json!({ "gpus": 1 }), 400, "unknown field"),
    ];
    for (name, extra, code, says) in cases {
        let (st, v) = m.api("POST", "/vms", Some(body(name, extra)));
        assert_eq!(st, code, "{name}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| e.contains(says)), "{name}: the error does not say {says:?}: {v}");
        if name != "taken" {
            assert_nothing_left(&m, name, &[]);
        }
    }
    // A name taken by another VM, and a tap another VM uses.
    // (The VMM makes the tap, which needs root.)
    let tap = format!("vgt{}", std::process::id() % 100_000);
    let net = format!("tap={tap}");
    let with_tap = ["--net", net.as_str()];
    let dup = create_counting(&m, "dup", if is_root() { &with_tap } else { &[] });
    if is_root() {
        // No MAC was given: the daemon chose one, kept in the description
        // and handed to the VMM.
        let mac = dup["spec"]["nets"][0]["mac"].as_str().unwrap_or_else(|| panic!("no MAC assigned: {dup}")).to_string();
        assert!(mac.starts_with("52:54:00:") && mac.len() == 17, "{mac}");
        let config: Value = serde_json::from_slice(&std::fs::read(Path::new(dup["console_log"].as_str().expect("console_log")).with_file_name("vmm.json")).expect("the VMM's config")).expect("JSON");
        assert_eq!(config["nets"], json!([{ "tap": tap, "mac": mac }]), "{config}");
        let (st, v) = m.api("POST", "/vms", Some(body("dup2", json!({ "nets": [{ "tap": tap }] }))));
        assert_eq!(st, 409, "{v}");
        assert!(v["error"].as_str().is_some_and(|e| e.contains("VM dup uses tap")), "{v}");
    }
    let (st, v) = m.api("POST", "/vms", Some(body("dup", json!({}))));
    assert_eq!(st, 409, "{v}");
    assert_eq!(json_of(&m, &["vm", "list"]).as_array().map(Vec::len), Some(1));
    // Verbs on a VM that does not exist; a usage error exits 2, a failure 1.
    let o = ctl(&m, &["vm", "show", "ghost"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no VM ghost"), "{o:?}");
    let o = ctl(&m, &["vm", "create", "x", "--memory", "16MiB", "--vgpu-memory", "8MiB"]);
    assert_eq!(o.status.code(), Some(2), "no kernel nor boot disk is a usage error: {o:?}");
    // --run-dir works after the subcommand too.
    let o = std::process::Command::new(vgpu_tests::bin("vgpuctl")).args(["vm", "list", "--run-dir"]).arg(&m.run_dir).output().expect("vgpuctl");
    assert!(String::from_utf8_lossy(&o.stdout).contains("dup"), "{o:?}");
}

/// Creates VMs `names` at once (one vgpuctl each, started together) in
/// `pool`; returns the device each landed on, in order.
fn create_at_once(m: &Mediator, pool: &str, names: &[&str]) -> Vec<String> {
    let g = guest();
    let barrier = std::sync::Barrier::new(names.len());
    std::thread::scope(|s| {
        let runs: Vec<_> = names
            .iter()
            .map(|n| {
                let (g, barrier) = (&g, &barrier);
                s.spawn(move || {
                    let mut c = m.vgpuctl();
                    c.args(["-o", "json", "vm", "create", n, "--memory", "16MiB", "--kernel", g, "--cmdline", "test=count", "--vgpu-memory", "32MiB", "--pool", pool]);
                    barrier.wait();
                    let v: Value = serde_json::from_str(&ok(c.output().expect("vgpuctl"))).expect("JSON");
                    assert_eq!(v["state"], "running", "{v}");
                    v["device"].as_str().expect("device").to_string()
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().expect("create thread")).collect()
    })
}

#[test]
fn vms_created_at_once_on_a_pool_of_two_devices_land_where_its_policy_says() {
    if !kvm_available("vms_created_at_once_on_a_pool_of_two_devices_land_where_its_policy_says") {
        return;
    }
    let m = Mediator::start(&["--cpu-devices", "4", "--device-memory", "64MiB", "--lanes", "1"]);
    for (pool, devs, placement) in [("wide", ["cpu0", "cpu1"], "spread"), ("tight", ["cpu2", "cpu3"], "pack")] {
        ok(m.vgpuctl().args(["pool", "create", pool, "--device", devs[0], "--device", devs[1], "--placement", placement]).output().expect("vgpuctl"));
    }
    // spread: two 32 MiB vGPUs created at the same moment take one device each.
    let mut wide = create_at_once(&m, "wide", &["w1", "w2"]);
    wide.sort();
    assert_eq!(wide, ["cpu0", "cpu1"], "spread put both VMs on one device");
    // pack: both fit on one 64 MiB device, so they share it (the lower ordinal on a tie).
    let tight = create_at_once(&m, "tight", &["t1", "t2"]);
    assert_eq!(tight, ["cpu2", "cpu2"], "pack spread the VMs");
    // A third is too much for cpu2 and goes to cpu3.
    assert_eq!(create_at_once(&m, "tight", &["t3"]), ["cpu3"]);
    // The listing shows each VM's device and its NUMA node, which is the device's.
    let list = json_of(&m, &["vm", "list"]);
    for row in list.as_array().expect("list") {
        let dev = row["device"].as_str().expect("device");
        assert_eq!(row["numa_node"], m.device(dev)["numa_node"], "{row}");
        assert_eq!(row["state"], "running", "{row}");
    }
    for n in ["w1", "w2", "t1", "t2", "t3"] {
        ok(ctl(&m, &["vm", "delete", n]));
    }
}

const NR_2M: &str = "/sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages";

fn nr_2m() -> u64 {
    std::fs::read_to_string(NR_2M).expect("nr_hugepages").trim().parse().expect("a number")
}

#[test]
fn a_vms_hugepages_are_reserved_on_its_node_until_it_is_deleted() {
    if !kvm_available("a_vms_hugepages_are_reserved_on_its_node_until_it_is_deleted") {
        return;
    }
    // The pool must be growable here (root, and the kernel finds the pages).
    let before = match std::fs::metadata(NR_2M) {
        Ok(_) if is_root() => nr_2m(),
        _ => {
            vgpu_tests::report_skip("a_vms_hugepages_are_reserved_on_its_node_until_it_is_deleted", "needs root and node 0's 2 MiB hugepage pool");
            return;
        }
    };
    // Put back whatever a failure leaves reserved.
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = std::fs::write(NR_2M, self.0.to_string());
        }
    }
    let _restore = Restore(before);
    let m = Mediator::start(&["--device-memory", "128MiB"]);
    if m.device("cpu0")["numa_node"] != 0 {
        vgpu_tests::report_skip("a_vms_hugepages_are_reserved_on_its_node_until_it_is_deleted", "the CPU device is not on NUMA node 0");
        return;
    }
    // 16 MiB of guest memory in 2 MiB pages: the node's pool grows by 8
    // for the VM, which its VMM then uses.
    let v = create_counting(&m, "huge", &["--hugepages", "2M"]);
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(nr_2m(), before + 8, "the create did not reserve 8 pages");
    let saved = std::fs::read_to_string(m.run_dir.join("state/vms/huge/vm.json")).expect("vm.json");
    assert!(saved.contains("hugepages_reserved"), "{saved}");
    // Stopped, the VM keeps its pages.
    ok(ctl(&m, &["vm", "stop", "huge", "--timeout", "0"]));
    assert_eq!(nr_2m(), before + 8, "a stopped VM lost its reservation");
    // A request that fails after the reservation (a kernel the VMM cannot
    // load) leaves the pool as it was.
    let dir = m.run_dir.join("inputs");
    std::fs::create_dir_all(&dir).expect("dir");
    let junk = write(&dir, "junk", b"not a kernel");
    let body = json!({ "name": "junk", "memory": "16MiB", "hugepages": "2M", "kernel": junk, "vgpu": { "memory": "16MiB" } });
    let (code, e) = m.api("POST", "/vms", Some(body));
    assert_eq!(code, 400, "{e}");
    assert_eq!(nr_2m(), before + 8, "a failed create left hugepages reserved");
    assert_nothing_left(&m, "junk", &[]);
    // Deleted: the pages go back.
    ok(ctl(&m, &["vm", "delete", "huge"]));
    assert_eq!(nr_2m(), before, "the delete did not give the pages back");
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn a_managed_vm_can_run_in_the_vmm_jail_as_an_unprivileged_uid() {
    const TEST: &str = "a_managed_vm_can_run_in_the_vmm_jail_as_an_unprivileged_uid";
    if !kvm_available(TEST) {
        return;
    }
    if !is_root() {
        vgpu_tests::report_skip(TEST, "the jail needs root (namespaces, mounts, changing uid)");
        return;
    }
    if !std::process::Command::new("unshare").args(["--mount", "--pid", "--net", "--fork", "true"]).status().is_ok_and(|s| s.success()) {
        vgpu_tests::report_skip(TEST, "this machine cannot create mount, PID and network namespaces");
        return;
    }
    let m = Mediator::start(&["--device-memory", "128MiB", "--vm-jail", "40124:40124"]);
    let v = create_counting(&m, "cell", &[]);
    assert_eq!(v["state"], "running", "{v}");
    // The daemon's child is the jail's supervisor; the VMM is its only child.
    let sup = v["pid"].as_u64().expect("pid") as u32;
    let mut kids = Vec::new();
    assert!(wait_until(Duration::from_secs(10), || {
        kids = vgpu_tests::vmm_harness::children(sup);
        kids.len() == 1
    }));
    // It drops to the jail's uid once its root is built.
    let read = || std::fs::read_to_string(format!("/proc/{}/status", kids[0])).unwrap_or_default();
    let field = |status: &str, k: &str| status.lines().find_map(|l| l.strip_prefix(k)).unwrap_or("").split_whitespace().map(str::to_string).collect::<Vec<_>>();
    assert!(wait_until(Duration::from_secs(10), || field(&read(), "Uid:") == ["40124"; 4]), "{}", read());
    let status = read();
    let field = |k: &str| field(&status, k);
    assert_eq!(field("CapEff:"), ["0000000000000000"], "{status}");
    assert_eq!(field("NSpid:").last().map(String::as_str), Some("1"), "the VMM is PID 1 of its own namespace: {status}");
    // Its vGPU socket is the jail uid's, and the guest runs.
    let (_, t) = m.api("GET", "/tenants/cell", None);
    let sock = t["socket"].as_str().expect("socket");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(sock).expect("socket")), 40124);
    assert!(wait_until(Duration::from_secs(20), || String::from_utf8_lossy(&ctl(&m, &["vm", "console", "cell"]).stdout).contains("tick 3")), "no console output");
    ok(ctl(&m, &["vm", "delete", "cell"]));
    assert_nothing_left(&m, "cell", &[sup as u64, kids[0] as u64]);
}

/// `vgpuctl apply -f` makes a pool, a tenant and a VM from one YAML file,
/// then brings them to an edited file: the tenant's weight, the pool's
/// placement and the VM's state change in place; a field the API cannot
/// change on a live VM is refused by name, and nothing else is touched.
#[test]
fn apply_makes_a_pool_a_tenant_and_a_vm_and_then_updates_them() {
    if !kvm_available("apply_makes_a_pool_a_tenant_and_a_vm_and_then_updates_them") {
        return;
    }
    let m = Mediator::start(&["--cpu-devices", "2", "--device-memory", "128MiB"]);
    let file = m.run_dir.join("site.yaml");
    let describe = |weight: u32, placement: &str, state: &str, vcpus: u32| {
        let text = format!(
            "kind: pool\nname: batch\ndevices: [cpu1]\nplacement: {placement}\n---\n\
             kind: tenant\nname: etl\nmemory: 32MiB\nweight: {weight}\npool: batch\n---\n\
             kind: vm\nname: web\nvcpus: {vcpus}\nmemory: 16MiB\nkernel: {}\ncmdline: test=count\nvgpu: {{ memory: 32MiB }}\nstate: {state}\n",
            guest()
        );
        std::fs::write(&file, text).expect("write the file");
    };
    let apply = |m: &Mediator| ctl(m, &["apply", "-f", file.to_str().expect("path")]);
    describe(2, "spread", "running", 1);
    let text = ok(apply(&m));
    assert_eq!(text.lines().collect::<Vec<_>>(), ["pool/batch created", "tenant/etl created", "vm/web created"], "{text}");
    assert_eq!((show(&m, "web")["state"].as_str(), m.api("GET", "/tenants/etl", None).1["weight"].as_u64()), (Some("running"), Some(2)));
    // The same file again changes nothing.
    let text = ok(apply(&m));
    assert!(text.lines().all(|l| l.ends_with(" unchanged")), "{text}");
    // Edited: weight, placement and the VM's state change in place.
    describe(5, "pack", "stopped", 1);
    let text = ok(apply(&m));
    assert_eq!(text.lines().collect::<Vec<_>>(), ["pool/batch configured (placement)", "tenant/etl configured (weight)", "vm/web configured (state)"], "{text}");
    assert_eq!(m.api("GET", "/tenants/etl", None).1["weight"].as_u64(), Some(5));
    assert_eq!(m.api("GET", "/pools/batch", None).1["placement"], "pack");
    assert_eq!(show(&m, "web")["state"], "stopped");
    // A live VM's vCPUs cannot change: refused by name, exit 1, and the
    // objects before it in the file are still applied.
    describe(6, "pack", "stopped", 2);
    let o = apply(&m);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("vm/web: vcpus cannot change on a live vm"), "{err}");
    assert_eq!(m.api("GET", "/tenants/etl", None).1["weight"].as_u64(), Some(6));
    assert_eq!(show(&m, "web")["spec"]["vcpus"], 1);
    // A file that is not a description is a usage error, before any request.
    std::fs::write(&file, "kind: printer\nname: p\n").expect("write");
    assert_eq!(apply(&m).status.code(), Some(2));
    ok(ctl(&m, &["vm", "delete", "web"]));
}
