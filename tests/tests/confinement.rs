//! Device workers run confined: an unprivileged uid, no capabilities
//! (but CAP_SYS_NICE where the host denies raising RLIMIT_NICE, usable
//! under seccomp only to set the calling thread's nice to 0..=19),
//! no_new_privs, and a seccomp allow-list on every thread; a syscall off
//! the list kills the worker, and the lists allow everything the normal
//! paths need (every other test runs its workers under them). Kernels run
//! below the worker's other threads (compute nice).

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
    for set in ["CapEff:", "CapPrm:", "CapInh:"] {
        let caps = status.lines().find_map(|l| l.strip_prefix(set)).expect("capability set").trim().to_string();
        let caps = u64::from_str_radix(&caps, 16).expect("hex capability set");
        // CAP_SYS_NICE (bit 23) at most, for compute nice's way back.
        assert_eq!(caps & !(1 << 23), 0, "the worker keeps capabilities {caps:#x} in {set}");
    }
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
    for (syscall, connection) in
        [("socket-inet", false), ("execve", false), ("ptrace", false), ("socket-unix", true), ("nice-other", false), ("nice-other", true), ("nice-raise", false), ("nice-raise", true)]
    {
        let o = check(syscall, connection);
        assert_eq!(o.status.signal(), Some(libc::SIGSYS), "{syscall} (connection thread: {connection}) was not killed: {:?} {}", o.status, String::from_utf8_lossy(&o.stdout));
        assert!(String::from_utf8_lossy(&o.stderr).contains("forbidden syscall"), "{}", String::from_utf8_lossy(&o.stderr));
    }
    for (syscall, connection) in [("getpid", false), ("socket-unix", false), ("getpid", true), ("nice-self", false), ("nice-self", true)] {
        let o = check(syscall, connection);
        assert!(o.status.success(), "{syscall} (connection thread: {connection}): {:?} {}", o.status, String::from_utf8_lossy(&o.stderr));
    }
    // Files cannot be opened at all, but asking does not kill.
    let o = check("openat", false);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("returned -13"), "{}", String::from_utf8_lossy(&o.stdout));
}

/// Nice value and name of each thread of `pid`.
fn thread_nices(pid: u32) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let t = task.expect("task").path();
        let (Ok(stat), Ok(comm)) = (std::fs::read_to_string(t.join("stat")), std::fs::read_to_string(t.join("comm"))) else { continue };
        // Fields after the parenthesised name: state is field 3, nice 19.
        let rest = &stat[stat.rfind(')').expect("stat name") + 2..];
        let nice: i64 = rest.split(' ').nth(16).expect("nice field").parse().expect("nice");
        out.push((comm.trim().to_string(), nice));
    }
    out
}

#[test]
fn kernels_run_below_the_worker_s_control_threads_which_stay_at_nice_0() {
    let log_path = std::env::temp_dir().join(format!("vgpu-nice-{}.log", std::process::id()));
    let m = Mediator::start_logging(&["--compute-nice", "12"], &log_path);
    let sock = m.tenant("nice", "16MiB");
    let pid = m.worker_pid("cpu0");
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    if log.contains("kernels run at the control threads' priority") {
        eprintln!("SKIP: this host lets no worker thread return to nice 0 (no CAP_SYS_RESOURCE to raise RLIMIT_NICE, no CAP_SYS_NICE to keep); compute nice is off here: {log}");
        return;
    }
    let spin = shares::Spinner::new(sock.to_str().expect("socket path"), 1);
    // One launch long enough to be seen running.
    let running = std::thread::spawn(move || spin.timed(400_000));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut seen = false;
    while !running.is_finished() && std::time::Instant::now() < deadline {
        let t = thread_nices(pid);
        if t.iter().any(|(name, n)| !name.starts_with("vgpu-blocks") && *n == 12) {
            seen = true;
            // The threads that take work and answer stay at 0 meanwhile.
            assert!(t.iter().any(|(name, n)| name.starts_with("tenant-poll") && *n == 0), "{t:?}");
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let took = running.join().expect("launch");
    assert!(seen, "no worker thread ran the {took:?} launch at nice 12: {:?}", thread_nices(pid));
    // Once it ended, every thread but the block pool's is back at 0.
    let t = thread_nices(pid);
    assert!(t.iter().all(|(name, n)| name.starts_with("vgpu-blocks") || *n == 0), "a thread stayed lowered: {t:?}");
    assert!(t.iter().filter(|(name, _)| name.starts_with("vgpu-blocks")).all(|(_, n)| *n == 12), "{t:?}");
}
