//! Device workers run confined: an unprivileged uid, no capabilities,
//! no_new_privs, and a seccomp allow-list on every thread; a syscall off
//! the list kills the worker, and the lists allow everything the normal
//! paths need (every other test runs its workers under them).

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use vgpu_tests::*;

#[test]
fn a_running_worker_is_unprivileged_and_every_thread_is_under_seccomp() {
    let m = Mediator::start(&[]);
    let sock = m.tenant("conf", "16MiB");
    // A live connection, so its thread (with its own, narrower list) exists.
    let mut r = Raw::connect(&sock);
    assert!(r.ping());
    let pid = m.worker_pid("cpu0");
    let st = proc_stats(pid);
    assert_ne!(st.uid, 0, "the worker runs as root");
    assert_eq!(st.seccomp, 2, "the worker is not under a seccomp filter");
    assert_eq!(st.no_new_privs, 1);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let caps = status.lines().find_map(|l| l.strip_prefix("CapEff:")).expect("CapEff").trim().to_string();
    assert!(caps.trim_start_matches('0').is_empty(), "the worker keeps capabilities {caps}");
    let mut threads = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let t = task.expect("task").path();
        let s = std::fs::read_to_string(t.join("status")).expect("task status");
        assert!(s.lines().any(|l| l == "Seccomp:\t2"), "thread {} is not under seccomp", t.display());
        threads += 1;
    }
    assert!(threads >= 3, "{threads} threads");
    // The worker's mount namespace is its own.
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).expect("mnt ns");
    assert_ne!(ns(&pid.to_string()), ns("self"));
}

fn check(syscall: &str, connection: bool) -> std::process::Output {
    let mut c = Command::new(bin("vgpu-mediatord"));
    c.args(["seccomp-check", "--syscall", syscall]);
    if connection {
        c.arg("--connection");
    }
    c.output().expect("run seccomp-check")
}

#[test]
fn a_forbidden_syscall_kills_the_process_and_allowed_ones_run() {
    for (syscall, connection) in [("socket-inet", false), ("execve", false), ("ptrace", false), ("socket-unix", true)] {
        let o = check(syscall, connection);
        assert_eq!(o.status.signal(), Some(libc::SIGSYS), "{syscall} (connection thread: {connection}) was not killed: {:?} {}", o.status, String::from_utf8_lossy(&o.stdout));
        assert!(String::from_utf8_lossy(&o.stderr).contains("forbidden syscall"), "{}", String::from_utf8_lossy(&o.stderr));
    }
    for (syscall, connection) in [("getpid", false), ("socket-unix", false), ("getpid", true)] {
        let o = check(syscall, connection);
        assert!(o.status.success(), "{syscall} (connection thread: {connection}): {:?} {}", o.status, String::from_utf8_lossy(&o.stderr));
    }
    // Files cannot be opened at all, but asking does not kill.
    let o = check("openat", false);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("returned -13"), "{}", String::from_utf8_lossy(&o.stdout));
}
