//! Tenant sockets have the owner and mode set at creation, kept across
//! worker restarts, so a non-root user (or a container's user) can be a
//! tenant and no other user can; the daemon refuses a run directory that
//! another user could tamper with.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use vgpu_tests::*;

const TENANT_UID: u32 = 4242;
const OTHER_UID: u32 = 4343;

fn vector_add_as(uid: u32, socket: &Path) -> (bool, String) {
    let mut c = sample("vectorAdd", socket);
    c.uid(uid).gid(uid).args(["4096"]);
    let o = c.output().expect("run vectorAdd");
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

#[test]
fn a_tenant_with_an_owner_is_usable_by_that_user_only_across_worker_restarts() {
    let m = Mediator::start(&[]);
    let v = m.tenant_with(json!({ "name": "u1", "memory": "64MiB", "owner": format!("{TENANT_UID}:{TENANT_UID}") }));
    assert_eq!(v["owner"], format!("{TENANT_UID}:{TENANT_UID}"));
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    samples();
    for round in ["before", "after"] {
        let meta = std::fs::metadata(&sock).expect("socket");
        assert_eq!((meta.uid(), meta.gid(), meta.permissions().mode() & 0o777), (TENANT_UID, TENANT_UID, 0o600), "{round} the restart");
        let (ok, out) = vector_add_as(TENANT_UID, &sock);
        assert!(ok && out.contains("PASSED"), "the owner cannot use its tenant {round} the restart: {out}");
        let (ok, out) = vector_add_as(OTHER_UID, &sock);
        assert!(!ok, "another user used the tenant {round} the restart: {out}");
        if round == "before" {
            let pid = m.worker_pid("cpu0");
            // SAFETY: kills our mediator's worker, as a crash would.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let d = m.device("cpu0");
                let up = d["worker_pid"].as_u64().is_some_and(|p| p != 0 && p != pid as u64);
                if up && std::fs::metadata(&sock).is_ok_and(|s| s.uid() == TENANT_UID) {
                    break;
                }
                assert!(Instant::now() < deadline, "worker not back with the tenant's socket: {d}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A hidden tenant's socket (mode 0666, as containers get theirs) lies in
/// a directory no other user may enter: knowing its path, which the
/// kernel shows every user, is not enough; a bind mount of it, as a
/// container gets through CDI, is.
#[test]
fn a_hidden_tenant_is_reached_through_a_bind_mount_only() {
    let m = Mediator::start(&[]);
    let v = m.tenant_with(json!({ "name": "boxed", "memory": "64MiB", "mode": "0666", "hidden": true }));
    assert_eq!(v["hidden"], true, "{v}");
    let sock = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    assert_eq!(sock.parent(), Some(m.run_dir.join("hidden").as_path()));
    let shown = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    assert!(shown.contains(sock.to_str().expect("utf8")), "every user can read the bound socket's path");
    let (ok, out) = vector_add_as(OTHER_UID, &sock);
    assert!(!ok, "another user reached a hidden socket by its path: {out}");
    // Through a bind mount in a mount namespace of its own, as a
    // container runtime makes one.
    let dir = std::env::temp_dir().join(format!("vgpu-hidden-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new().mode(0o755).create(&dir).expect("mkdir");
    let target = dir.join("vgpu.sock");
    std::fs::write(&target, b"").expect("mount point");
    let script =
        format!("mount --bind '{}' '{}' && exec setpriv --reuid={OTHER_UID} --regid={OTHER_UID} --clear-groups '{}' 4096", sock.display(), target.display(), samples().join("vectorAdd").display());
    let o = Command::new("unshare").args(["--mount", "sh", "-c", &script]).env("VGPU_SOCKET", &target).env("LD_LIBRARY_PATH", lib_dir()).output().expect("unshare");
    let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && out.contains("PASSED"), "the bind-mounted socket did not serve another user: {out}");
    let _ = std::fs::remove_dir_all(&dir);
    // Only process tenants can be hidden.
    let (st, v) = m.api("POST", "/tenants", Some(json!({ "name": "vmh", "memory": "64MiB", "kind": "vm", "hidden": true })));
    assert_eq!(st, 400, "{v}");
    assert!(v.to_string().contains("hidden is for process tenants"), "{v}");
}

#[test]
fn vgpuctl_sets_owner_and_mode_and_rejects_bad_ones() {
    let m = Mediator::start(&[]);
    let mut c = m.vgpuctl();
    c.args(["tenant", "create", "grp", "--memory", "16MiB", "--owner", "0:4242", "--mode", "0660"]);
    let o = c.output().expect("vgpuctl");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let meta = std::fs::metadata(String::from_utf8_lossy(&o.stdout).trim()).expect("socket");
    assert_eq!((meta.uid(), meta.gid(), meta.permissions().mode() & 0o777), (0, 4242, 0o660));
    for (owner, mode) in [("alice", "0600"), ("1:2:3", "0600"), ("0:0", "4777"), ("0:0", "0066"), ("0:0", "9"), ("0:0", "+600"), ("0:0", "00000600"), ("0:0", "60"), ("0:0", "")] {
        let (st, v) = m.api("POST", "/tenants", Some(json!({ "name": "bad", "memory": "16MiB", "owner": owner, "mode": mode })));
        assert_eq!(st, 400, "owner {owner} mode {mode}: {v}");
    }
}

fn start_expecting_failure(run_dir: &Path) -> String {
    let o = Command::new(bin("vgpu-mediatord")).args(["--cuda", "off", "--run-dir"]).arg(run_dir).stdin(Stdio::null()).output().expect("run vgpu-mediatord");
    assert!(!o.status.success(), "the mediator started on an unsafe run dir");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_run_dir_another_user_owns_or_can_write_is_refused() {
    let d = std::env::temp_dir().join(format!("vgpu-unsafe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    // A tenants dir anyone can write: a planted socket could stand in for a tenant's.
    std::fs::create_dir_all(d.join("tenants")).expect("mkdir");
    std::fs::set_permissions(d.join("tenants"), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let err = start_expecting_failure(&d);
    assert!(err.contains("writable by group or others"), "{err}");
    // A tenants dir another user owns.
    std::fs::set_permissions(d.join("tenants"), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::os::unix::fs::chown(d.join("tenants"), Some(OTHER_UID), Some(OTHER_UID)).expect("chown");
    let err = start_expecting_failure(&d);
    assert!(err.contains(&format!("owned by uid {OTHER_UID}")), "{err}");
    // A symlink in its place.
    std::fs::remove_dir(d.join("tenants")).expect("rmdir");
    std::os::unix::fs::symlink("/tmp", d.join("tenants")).expect("symlink");
    let err = start_expecting_failure(&d);
    assert!(err.contains("symbolic link"), "{err}");
    std::fs::remove_dir_all(&d).expect("cleanup");
}

/// A run directory made as `mktemp -d` makes one (0700, ours) is opened up
/// for the workers (0711): tenants are created and served, never an HTTP
/// 500 from a worker that cannot reach its socket's directory.
#[test]
fn a_private_run_dir_of_ours_is_opened_for_the_workers() {
    let d = std::env::temp_dir().join(format!("vgpu-private-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::DirBuilder::new().mode(0o700).create(&d).expect("mkdir");
    let m = Mediator::start_in(d.clone(), &[]);
    let mode = std::fs::metadata(&d).expect("run dir").permissions().mode() & 0o777;
    assert_eq!(mode, 0o711, "the run dir's mode");
    let (st, v) = m.api("POST", "/tenants", Some(json!({ "name": "t1", "memory": "64MiB" })));
    assert_eq!(st, 201, "{v}");
    assert!(run_ok(sample("vectorAdd", Path::new(v["socket"].as_str().unwrap()))).contains("PASSED"));
}
