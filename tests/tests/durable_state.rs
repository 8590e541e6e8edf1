//! Tenants and pools made through the API survive the daemon: a clean
//! restart, a `kill -9`, and the run directory it finds afterwards. They
//! come back with the same sockets, owners, modes, quotas, weights and
//! pools, and usage accounting goes on. A state file that cannot be read
//! whole stops the start with its path, never half-read.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};
use vgpu_tests::*;

const ARGS: &[&str] = &["--cpu-devices", "2", "--device-memory", "256MiB", "--usage-interval", "1"];

fn tenant(m: &Mediator, name: &str) -> Value {
    let (st, v) = m.api("GET", &format!("/tenants/{name}"), None);
    assert_eq!(st, 200, "{name}: {v}");
    v
}

fn device_seconds(m: &Mediator, name: &str) -> f64 {
    let (st, recs) = m.api("GET", &format!("/usage?since=0&tenant={name}"), None);
    assert_eq!(st, 200, "{recs}");
    recs.as_array().expect("records").iter().filter(|r| r["type"] == "tenant").map(|r| r["device_seconds"].as_f64().expect("device_seconds")).sum()
}

/// Runs vectorAdd as the tenant at `sock` until the usage records show
/// device time for it beyond `above`.
fn use_until_billed(m: &Mediator, name: &str, sock: &std::path::Path, above: f64) -> f64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        assert!(run_ok(sample("vectorAdd", sock)).contains("PASSED"));
        let billed = device_seconds(m, name);
        if billed > above {
            return billed;
        }
        assert!(std::time::Instant::now() < deadline, "{name}'s usage stayed at {billed} s");
        std::thread::sleep(std::time::Duration::from_millis(1200));
    }
}

#[test]
fn tenants_and_pools_come_back_after_a_clean_restart_and_a_kill() {
    let mut m = Mediator::start(ARGS);
    let (st, v) = m.api("POST", "/pools", Some(json!({ "name": "gold", "devices": ["cpu1"], "access": "private", "allow": ["vip"] })));
    assert_eq!(st, 201, "{v}");
    let a = m.tenant_with(json!({ "name": "persist1", "memory": "64MiB", "weight": 3, "cap": 60, "owner": "1000:1001", "mode": "0660", "device": "cpu0" }));
    let b = m.tenant_with(json!({ "name": "vip", "memory": "32MiB", "pool": "gold", "priority": "latency" }));
    let (st, v) = m.api("PATCH", "/tenants/persist1", Some(json!({ "weight": 5 })));
    assert_eq!(st, 200, "{v}");
    let (sa, sb) = (PathBuf::from(a["socket"].as_str().unwrap()), PathBuf::from(b["socket"].as_str().unwrap()));
    let billed = use_until_billed(&m, "persist1", &sa, 0.0);
    // A deleted tenant stays deleted.
    m.tenant_with(json!({ "name": "gone", "memory": "16MiB" }));
    let (st, v) = m.api("DELETE", "/tenants/gone", None);
    assert!(st == 200 || st == 202 || st == 204, "{st} {v}");

    for (how, signal) in [("a clean restart", libc::SIGTERM), ("kill -9", libc::SIGKILL)] {
        m.restart_after(signal, ARGS);
        let t = tenant(&m, "persist1");
        assert_eq!(
            (t["socket"].as_str(), t["memory"].as_u64(), t["weight"].as_u64(), t["cap"].as_u64(), t["device"].as_str()),
            (a["socket"].as_str(), Some(64 << 20), Some(5), Some(60), Some("cpu0")),
            "after {how}: {t}"
        );
        assert_eq!((t["owner"].as_str(), t["mode"].as_str()), (Some("1000:1001"), Some("0660")), "after {how}: {t}");
        let meta = std::fs::metadata(&sa).expect("the socket is back");
        assert_eq!((meta.uid(), meta.gid(), meta.permissions().mode() & 0o777), (1000, 1001, 0o660), "after {how}");
        let t = tenant(&m, "vip");
        assert_eq!((t["pool"].as_str(), t["device"].as_str(), t["priority"].as_str()), (Some("gold"), Some("cpu1"), Some("latency")), "after {how}: {t}");
        let (st, p) = m.api("GET", "/pools/gold", None);
        assert_eq!(st, 200, "after {how}: {p}");
        assert_eq!((p["access"].as_str(), p["allow"].clone()), (Some("private"), json!(["vip"])), "after {how}: {p}");
        let (_, all) = m.api("GET", "/tenants", None);
        assert_eq!(all.as_array().map(Vec::len), Some(2), "after {how}, only the two live tenants: {all}");
        // The same sockets serve, and usage goes on from where it was.
        assert!(run_ok(sample("vectorAdd", &sb)).contains("PASSED"), "after {how}");
        let before = device_seconds(&m, "persist1");
        assert!(before >= billed, "after {how} the records lost usage: {billed} s then {before} s");
        use_until_billed(&m, "persist1", &sa, before);
    }
    // A tenant deleted now is not brought back by the next start.
    let (st, _) = m.api("DELETE", "/tenants/vip", None);
    assert!(st < 300, "{st}");
    m.restart_after(libc::SIGKILL, ARGS);
    let (st, _) = m.api("GET", "/tenants/vip", None);
    assert_eq!(st, 404);
    assert_eq!(tenant(&m, "persist1")["weight"], 5);
}

#[test]
fn a_state_file_that_cannot_be_read_whole_stops_the_start_by_name() {
    let mut m = Mediator::start(ARGS);
    m.tenant_with(json!({ "name": "keeper", "memory": "16MiB" }));
    let state = m.run_dir.join("state/tenants");
    let good = std::fs::read_to_string(state.join("keeper.json")).expect("the tenant is saved");
    // Stop it cleanly, then damage the store: half a file, a version
    // from elsewhere.
    m.stop_with(libc::SIGTERM);
    let run_dir = m.run_dir.clone();
    for (file, text, why) in [("keeper.json", &good[..good.len() / 2], "EOF"), ("keeper.json", &good.replace("\"version\": 1", "\"version\": 7")[..], "version 7")] {
        std::fs::write(state.join(file), text).expect("damage");
        let out = Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(&run_dir).args(["--cuda", "off"]).args(ARGS).env("VGPU_LOG", "warn").output().expect("start");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "a daemon started on a damaged store: {err}");
        assert!(err.contains(&state.join(file).display().to_string()) && err.contains(why) && err.contains("move it away"), "{err}");
    }
    // Put right, the tenant comes back.
    std::fs::write(state.join("keeper.json"), &good).expect("repair");
    m.restart_after(libc::SIGKILL, ARGS);
    assert_eq!(tenant(&m, "keeper")["memory"], 16 << 20);
}

/// The config file is the only source of what it lists: a saved tenant or
/// pool of the same name gives way to it and is forgotten, so dropping the
/// name from the config later does not bring the old one back.
#[test]
fn the_config_file_wins_over_a_saved_tenant_or_pool_of_the_same_name() {
    let mut m = Mediator::start(ARGS);
    m.tenant_with(json!({ "name": "dup", "memory": "16MiB", "weight": 7 }));
    let (st, v) = m.api("POST", "/pools", Some(json!({ "name": "pdup", "devices": ["cpu1"] })));
    assert_eq!(st, 201, "{v}");
    let cfg = m.run_dir.join("declares.toml");
    std::fs::write(&cfg, "[devices]\ncpu = 2\nmemory = \"256MiB\"\n\n[[pools]]\nname = \"pdup\"\ndevices = [\"cpu1\"]\naccess = \"private\"\n\n[[tenants]]\nname = \"dup\"\nmemory = \"32MiB\"\nweight = 2\ndevice = \"cpu0\"\n").expect("config");
    let with_config = ["--config", cfg.to_str().expect("utf-8"), "--usage-interval", "1"];
    m.restart_after(libc::SIGKILL, &with_config);
    let t = tenant(&m, "dup");
    assert_eq!((t["memory"].as_u64(), t["weight"].as_u64()), (Some(32 << 20), Some(2)), "the config file's tenant: {t}");
    let (_, p) = m.api("GET", "/pools/pdup", None);
    assert_eq!(p["access"], "private", "the config file's pool: {p}");
    // Without the config file, neither saved one comes back.
    m.restart_after(libc::SIGKILL, ARGS);
    assert_eq!(m.api("GET", "/tenants/dup", None).0, 404);
    assert_eq!(m.api("GET", "/pools/pdup", None).0, 404);
}

/// Where the state directory cannot record a change (read-only, full or
/// failing), the change is refused and taken back, so that what runs is
/// what a restart brings back: a quota or weight change, a new tenant (and
/// its socket), a delete. Needs root (a read-only bind mount).
#[test]
fn a_change_the_state_directory_cannot_record_is_taken_back() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        report_skip("a_change_the_state_directory_cannot_record_is_taken_back", "a read-only bind mount needs root");
        return;
    }
    let m = Mediator::start(&[]);
    let a = m.tenant_with(json!({ "name": "kept", "memory": "16MiB", "weight": 1 }));
    let dir = m.run_dir.join("state/tenants");
    assert!(dir.join("kept.json").exists(), "the state directory is not where this test looks");
    let c = |p: &std::path::Path| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let d = c(&dir);
    // SAFETY: NUL-terminated paths that outlive the calls; a bind mount of
    // the test's own directory over itself, made read-only.
    let ro = unsafe {
        libc::mount(d.as_ptr(), d.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) == 0
            && libc::mount(std::ptr::null(), d.as_ptr(), std::ptr::null(), libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY, std::ptr::null()) == 0
    };
    struct Unmount(std::ffi::CString);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // SAFETY: the path is NUL-terminated; our own bind mount.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let guard = Unmount(d.clone());
    if !ro {
        report_skip("a_change_the_state_directory_cannot_record_is_taken_back", &format!("cannot make a read-only bind mount here: {}", std::io::Error::last_os_error()));
        return;
    }
    let (st, v) = m.api("PATCH", "/tenants/kept", Some(json!({ "weight": 7, "memory": "32MiB" })));
    assert!(st == 500 && v["error"].as_str().is_some_and(|e| e.contains("nothing changed")), "{st} {v}");
    let t = tenant(&m, "kept");
    assert_eq!((t["weight"].as_u64(), t["memory"].as_u64()), (Some(1), Some(16 << 20)), "the change was not taken back: {t}");
    let (st, v) = m.api("POST", "/tenants", Some(json!({ "name": "unsaved", "memory": "16MiB" })));
    assert_eq!(st, 500, "{v}");
    assert_eq!(m.api("GET", "/tenants/unsaved", None).0, 404);
    assert!(!m.run_dir.join("tenants/unsaved.sock").exists(), "a failed create left its socket");
    let (st, v) = m.api("DELETE", "/tenants/kept", None);
    assert!(st == 500 && v["error"].as_str().is_some_and(|e| e.contains("nothing changed")), "{st} {v}");
    assert_eq!(tenant(&m, "kept")["state"], "ready");
    assert!(run_ok(sample("vectorAdd", std::path::Path::new(a["socket"].as_str().unwrap()))).contains("PASSED"));
    drop(guard);
    let (st, v) = m.api("DELETE", "/tenants/kept", None);
    assert!(st == 204 || st == 202, "{st} {v}");
}
