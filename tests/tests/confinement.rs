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
    // The process holding the tenant's state (its executor), and the
    // device's arbiter, are each confined the same way.
    for pid in [m.serving_pid("cpu0", "conf"), m.worker_pid("cpu0")] {
        confined(pid);
    }
}

fn confined(pid: u32) {
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
    check_with(syscall, connection, false)
}

fn check_with(syscall: &str, connection: bool, keep_nice: bool) -> std::process::Output {
    let mut c = Command::new(bin("vgpu-mediatord"));
    c.args(["seccomp-check", "--syscall", syscall]);
    if connection {
        c.arg("--connection");
    }
    if keep_nice {
        c.arg("--keep-nice");
    }
    c.output().expect("run seccomp-check")
}

#[test]
fn a_forbidden_syscall_kills_the_process_and_allowed_ones_run() {
    for (syscall, connection, keep_nice) in [
        ("socket-inet", false, false),
        ("execve", false, false),
        ("ptrace", false, false),
        ("socket-unix", true, false),
        ("nice-other", false, false),
        ("nice-other", true, false),
        ("nice-raise", false, false),
        ("nice-raise", true, false),
        ("slice-other", false, false),
        ("slice-other", true, false),
        ("affinity-other", false, false),
        ("affinity-other", true, false),
        // A worker keeping CAP_SYS_NICE could ask sched_setattr for a
        // real-time policy: its lists leave the call out.
        ("slice-self", false, true),
        ("slice-self", true, true),
    ] {
        let o = check_with(syscall, connection, keep_nice);
        assert_eq!(o.status.signal(), Some(libc::SIGSYS), "{syscall} (connection thread: {connection}) was not killed: {:?} {}", o.status, String::from_utf8_lossy(&o.stdout));
        assert!(String::from_utf8_lossy(&o.stderr).contains("forbidden syscall"), "{}", String::from_utf8_lossy(&o.stderr));
    }
    for (syscall, connection) in [
        ("getpid", false),
        ("socket-unix", false),
        ("getpid", true),
        ("nice-self", false),
        ("nice-self", true),
        ("slice-self", false),
        ("slice-self", true),
        ("affinity-self", false),
        ("affinity-self", true),
    ] {
        let o = check(syscall, connection);
        assert!(o.status.success(), "{syscall} (connection thread: {connection}): {:?} {}", o.status, String::from_utf8_lossy(&o.stderr));
    }
    // Files cannot be opened at all, but asking does not kill.
    let o = check("openat", false);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("returned -13"), "{}", String::from_utf8_lossy(&o.stdout));
}

/// A line of a file of thread `tid` of `pid` (`status`, `sched`): the
/// text after `key` and its separator.
fn task_field(pid: u32, tid: &str, file: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{file}")).ok()?;
    text.lines().find_map(|l| l.strip_prefix(key)).map(|v| v.trim_start_matches([' ', ':', '\t']).trim().to_string())
}

/// Thread ids of `pid` whose name does not start with `not` and whose
/// nice value is `nice`.
fn threads_at(pid: u32, not: &str, nice: i64) -> Vec<String> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let t = task.expect("task").path();
        let (Ok(stat), Ok(comm)) = (std::fs::read_to_string(t.join("stat")), std::fs::read_to_string(t.join("comm"))) else { continue };
        let rest = &stat[stat.rfind(')').expect("stat name") + 2..];
        if !comm.starts_with(not) && rest.split(' ').nth(16).and_then(|n| n.parse::<i64>().ok()) == Some(nice) {
            out.push(t.file_name().expect("tid").to_string_lossy().into_owned());
        }
    }
    out
}

/// Whether a thread here can set its own time slice (sched_setattr's
/// sched_runtime for SCHED_OTHER, Linux 6.12+), as the worker's lane
/// threads do: tried on a scratch thread.
fn kernel_takes_slices() -> bool {
    std::thread::spawn(|| {
        // struct sched_attr, first version: SCHED_OTHER, nice 0, 100 µs.
        let mut attr = [0u64; 6];
        attr[0] = 48;
        attr[3] = 100_000;
        // SAFETY: sched_setattr on the calling thread reads the 48-byte
        // struct above.
        let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, attr.as_ptr(), 0) };
        rc == 0 && std::fs::read_to_string("/proc/thread-self/sched").is_ok_and(|t| t.lines().any(|l| l.starts_with("se.slice") && l.trim_end().ends_with(" 100000")))
    })
    .join()
    .unwrap_or(false)
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
    let pid = m.serving_pid("cpu0", "nice");
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
    let own_cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    while !running.is_finished() && std::time::Instant::now() < deadline {
        let t = thread_nices(pid);
        if t.iter().any(|(name, n)| !name.starts_with("vgpu-blocks") && *n == 12) {
            seen = true;
            // The threads that take work and answer stay at 0 meanwhile.
            assert!(t.iter().any(|(name, n)| name.starts_with("tenant-poll") && *n == 0), "{t:?}");
            // The thread running the kernel.
            let lane = threads_at(pid, "vgpu-blocks", 12);
            if let Some(tid) = lane.first() {
                // Its lane's core alone (pinning is on by default), where
                // the worker may use more than one.
                let cores = task_field(pid, tid, "status", "Cpus_allowed_list:").expect("Cpus_allowed_list");
                if own_cores > 1 {
                    assert!(cores.parse::<usize>().is_ok(), "the lane thread may run on cores {cores:?}, not one");
                }
                // The short slice, where the kernel has per-thread slices
                // and the worker holds no CAP_SYS_NICE (kept where the host
                // denies raising RLIMIT_NICE: sched_setattr is then off
                // its seccomp list).
                let cap_eff = task_field(pid, tid, "status", "CapEff:").and_then(|v| u64::from_str_radix(&v, 16).ok()).expect("CapEff");
                // Sampled a few times: each checkpoint that looks at the
                // queue runs for a moment at nice 0 and the default slice.
                let slices: Vec<Option<String>> = (0..20).map(|_| task_field(pid, tid, "sched", "se.slice")).collect();
                if cap_eff & (1 << 23) != 0 {
                    eprintln!("note: the worker keeps CAP_SYS_NICE on this host, so its lane work has the default slice ({:?} ns)", slices[0]);
                } else if kernel_takes_slices() {
                    assert!(slices.iter().any(|s| s.as_deref() == Some("100000")), "the lane thread's slice: {slices:?}");
                } else {
                    eprintln!("note: this kernel has no per-thread time slices (Linux 6.12+): checked nice and pinning only");
                }
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let took = running.join().expect("launch");
    // Whatever the daemon inherited, no thread of the worker may ask for a
    // real-time policy or for a priority above nice 0.
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let limit = |name: &str| -> Vec<u64> {
        let line = limits.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {limits}"));
        line[name.len()..].split_whitespace().take(2).map(|v| v.parse().unwrap_or(u64::MAX)).collect()
    };
    assert_eq!(limit("Max realtime priority"), vec![0, 0], "{limits}");
    assert!(limit("Max nice priority").iter().all(|&v| v <= 20), "{limits}");
    assert!(seen, "no worker thread ran the {took:?} launch at nice 12: {:?}", thread_nices(pid));
    // Once it ended, every thread but the block pool's is back at 0.
    let t = thread_nices(pid);
    assert!(t.iter().all(|(name, n)| name.starts_with("vgpu-blocks") || *n == 0), "a thread stayed lowered: {t:?}");
    // And no thread but the block pool's stayed pinned.
    for tid in threads_at(pid, "vgpu-blocks", 0) {
        let cores = task_field(pid, &tid, "status", "Cpus_allowed_list:").expect("Cpus_allowed_list");
        assert!(own_cores == 1 || cores.parse::<usize>().is_err(), "engine thread {tid} stayed on core {cores}");
    }
    assert!(t.iter().filter(|(name, _)| name.starts_with("vgpu-blocks")).all(|(_, n)| *n == 12), "{t:?}");
}
