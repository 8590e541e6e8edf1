//! `vgpu-vmm --jail`: the VMM runs as an unprivileged uid with no
//! capabilities, as PID 1 of its own PID namespace, in its own mount and
//! network namespaces, on a read-only root holding only /dev/kvm and the
//! files its VM uses, and still boots the test guest, serves its API and
//! reaches its vGPU. cgroup v2 limits apply where the host has cgroup v2,
//! and are refused clearly where it has not.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use vgpu_tests::vmm_harness::*;
use vgpu_tests::*;

const UID: &str = "40123";

/// Whether this machine can jail: root, /dev/kvm, and new mount, PID and
/// network namespaces. Says loudly why not.
fn jail_possible(test: &str) -> bool {
    if !kvm_available(test) {
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        report_skip(test, "the jail needs root (namespaces, mounts, changing uid)");
        return false;
    }
    let o = Command::new("unshare").args(["--mount", "--pid", "--net", "--fork", "true"]).output();
    match o {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            report_skip(test, &format!("this machine cannot create mount, PID and network namespaces: {}", String::from_utf8_lossy(&o.stderr).trim()));
            false
        }
        Err(e) => {
            report_skip(test, &format!("unshare(1) could not run to probe namespaces: {e}"));
            false
        }
    }
}

fn jail_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vgpu-jail-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn jail_args(dir: &Path) -> Vec<String> {
    vec!["--jail".into(), dir.display().to_string(), "--jail-uid".into(), UID.into(), "--jail-gid".into(), UID.into()]
}

/// The jailed VMM: the supervisor's only child.
fn jailed_pid(supervisor: u32) -> u32 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match children(supervisor).as_slice() {
            [c] => return *c,
            other => assert!(std::time::Instant::now() < deadline, "the supervisor has children {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every non-directory entry under the jailed process's root.
fn jail_files(pid: u32) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).expect("read jail dir") {
            let p = e.expect("entry").path();
            if std::fs::symlink_metadata(&p).expect("metadata").is_dir() {
                walk(base, &p, out);
            } else {
                out.push(format!("/{}", p.strip_prefix(base).expect("under root").display()));
            }
        }
    }
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let mut out = Vec::new();
    walk(&root, &root, &mut out);
    out.sort();
    out
}

#[test]
fn jailed_vmm_runs_unprivileged_in_its_own_namespaces_and_boots_the_guest() {
    let test = "jailed_vmm_runs_unprivileged_in_its_own_namespaces_and_boots_the_guest";
    if !jail_possible(test) {
        return;
    }
    let dir = jail_dir("boot");
    let args = jail_args(&dir);
    let mut extra: Vec<&str> = args.iter().map(String::as_str).collect();
    extra.extend(["--vcpus", "2"]);
    let mut g = Guest::start("count", &extra);
    g.wait_api();
    g.wait_for("tick 2", Duration::from_secs(60));
    let pid = jailed_pid(g.child.id());
    let tasks = tasks(pid);
    let main = tasks.iter().find(|t| t.tid == pid).expect("main thread");
    for id in ["Uid", "Gid"] {
        let ids: Vec<&str> = main.field(id).expect(id).split_whitespace().collect();
        assert_eq!(ids, [UID; 4], "{id}");
    }
    assert_eq!(main.field("Groups"), Some(""), "supplementary groups remain");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(main.field(cap).expect(cap).trim_start_matches('0').is_empty(), "{cap}: {:?}", main.field(cap));
    }
    // PID 1 in its own PID namespace.
    let nspid: Vec<&str> = main.field("NSpid").expect("NSpid").split_whitespace().collect();
    assert_eq!(nspid, [pid.to_string().as_str(), "1"]);
    for ns in ["mnt", "pid", "net"] {
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).expect("ns link");
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).expect("ns link");
        assert_ne!(theirs, ours, "the jailed VMM shares our {ns} namespace");
    }
    for t in tasks.iter().filter(|t| !is_kvm_kernel_worker(t)) {
        assert_eq!(t.field("Seccomp"), Some("2"), "thread {} is not under seccomp", t.comm);
        assert_eq!(t.field("NoNewPrivs"), Some("1"), "thread {}", t.comm);
    }
    // Its root holds /dev/kvm, the kernel and the serial file: nothing else.
    let guest = std::fs::canonicalize(test_guest()).expect("guest path");
    let serial = std::fs::canonicalize(&g.serial).expect("serial path");
    let mut want = vec!["/dev/kvm".to_string(), guest.display().to_string(), serial.display().to_string()];
    want.sort();
    assert_eq!(jail_files(pid), want);
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root = mounts.lines().find(|l| l.split_whitespace().nth(4) == Some("/")).expect("root mount");
    assert!(root.contains(" ro,") && root.contains("tmpfs"), "the jail's root is not a read-only tmpfs: {root}");
    // Its network namespace has a loopback device only.
    let net = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).expect("net/dev");
    let devs: Vec<&str> = net.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(devs, ["lo"]);
    // Nothing was written to the host's side of the jail directory.
    assert_eq!(std::fs::read_dir(&dir).expect("jail dir").count(), 0);
    // The API answers through the socket bound before the jail.
    let (code, body) = g.api_call("GET", "/vm");
    assert_eq!(code, 200, "{body}");
    let info: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(info["pid"], 1, "{body}");
    assert_eq!(g.api_call("PUT", "/vm/shutdown").0, 202);
    let api = g.api.clone();
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "{err}");
    assert!(out.contains("TEST PASSED count"), "{out}");
    assert!(!api.exists(), "the supervisor left the API socket behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn jailed_vmm_reaches_a_vgpu_socket_its_uid_owns_and_no_other() {
    let test = "jailed_vmm_reaches_a_vgpu_socket_its_uid_owns_and_no_other";
    if !jail_possible(test) {
        return;
    }
    let m = Mediator::start(&[]);
    let tenant = |name: &str, owner: Option<&str>| -> String {
        let mut spec = json!({ "name": name, "memory": "64MiB", "kind": "vm" });
        if let Some(o) = owner {
            spec["owner"] = json!(o);
        }
        let (code, v) = m.api("POST", "/tenants", Some(spec));
        assert_eq!(code, 201, "{v}");
        format!("socket={}", v["socket"].as_str().expect("socket"))
    };
    let dir = jail_dir("vgpu");
    let args = jail_args(&dir);
    let owned = tenant("jailed", Some(&format!("{UID}:{UID}")));
    let mut extra: Vec<&str> = args.iter().map(String::as_str).collect();
    extra.extend(["--vgpu", &owned]);
    let g = Guest::start("vgpu", &extra);
    let (st, err, out) = g.wait_exit(Duration::from_secs(120));
    assert_eq!(st.code(), Some(0), "{err}\n{out}");
    assert!(out.contains("VGPU vectorAdd PASSED n=1024 c[1023]=453fd000"), "{out}");
    // A tenant socket the jail's uid may not connect to is refused up front.
    let foreign = tenant("rootonly", None);
    let mut extra: Vec<&str> = args.iter().map(String::as_str).collect();
    extra.extend(["--vgpu", &foreign]);
    let g = Guest::start("vgpu", &extra);
    let (st, err, _) = g.wait_exit(Duration::from_secs(30));
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("is not writable by the jail's uid"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn cgroup2_at_sys_fs_cgroup() -> bool {
    // SAFETY: a zeroed statfs is valid and statfs only writes into it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    unsafe { libc::statfs(c"/sys/fs/cgroup".as_ptr(), &mut st) == 0 && st.f_type as i64 == 0x6367_7270 }
}

#[test]
fn cgroup_limits_apply_under_cgroup_v2_and_are_refused_clearly_without_it() {
    let test = "cgroup_limits_apply_under_cgroup_v2_and_are_refused_clearly_without_it";
    if !jail_possible(test) {
        return;
    }
    let dir = jail_dir("cgroup");
    let args = jail_args(&dir);
    let mut extra: Vec<&str> = args.iter().map(String::as_str).collect();
    extra.extend(["--jail-memory", "512MiB", "--jail-pids", "64"]);
    let mut g = Guest::start("count", &extra);
    if !cgroup2_at_sys_fs_cgroup() {
        let serial = g.serial.clone();
        let (st, err, _) = g.wait_exit(Duration::from_secs(30));
        assert_eq!(st.code(), Some(1), "{err}");
        assert!(err.contains("need a writable cgroup v2 hierarchy at /sys/fs/cgroup") && err.contains("no limit was applied"), "{err}");
        assert!(!serial.exists(), "a refused jail still created the serial file");
        report_skip(test, "/sys/fs/cgroup is not cgroup v2 here: only the refusal was tested; the nested test host applies the limits");
        return;
    }
    g.wait_api();
    g.wait_for("tick 1", Duration::from_secs(60));
    let pid = jailed_pid(g.child.id());
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let path = cg.lines().find_map(|l| l.strip_prefix("0::")).expect("cgroup v2 line").to_string();
    assert!(path.starts_with("/vgpu-vmm/vm-"), "{path}");
    let group = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    assert_eq!(std::fs::read_to_string(group.join("memory.max")).expect("memory.max").trim(), (512u64 << 20).to_string());
    assert_eq!(std::fs::read_to_string(group.join("pids.max")).expect("pids.max").trim(), "64");
    assert_eq!(g.api_call("PUT", "/vm/shutdown").0, 202);
    let (st, err, _) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "{err}");
    assert!(!group.exists(), "the supervisor left {} behind", group.display());
}

#[test]
fn a_forbidden_syscall_kills_a_jailed_vmm_although_it_is_a_namespace_init() {
    let test = "a_forbidden_syscall_kills_a_jailed_vmm_although_it_is_a_namespace_init";
    if !jail_possible(test) {
        return;
    }
    let dir = jail_dir("kill");
    let run = |syscall: &str| {
        let mut c = Command::new(bin("vgpu-vmm"));
        c.args(jail_args(&dir)).args(["seccomp-check", "--thread", "vcpu", "--syscall", syscall]);
        c.output().expect("run vgpu-vmm")
    };
    // PID 1 of a namespace ignores its own default-action signals; the
    // handler still gets it killed by SIGSYS, and the supervisor dies the same way.
    let o = run("execve");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.signal(), Some(libc::SIGSYS), "{:?} {err}", o.status);
    assert!(err.contains(&format!("forbidden syscall {}", libc::SYS_execve)), "{err}");
    let o = run("getpid");
    assert!(o.status.success(), "{:?} {}", o.status, String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "getpid returned 1");
    let _ = std::fs::remove_dir_all(&dir);
}
