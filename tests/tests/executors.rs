//! Tenant executors (`--isolation process`): each tenant's state lives in
//! a process of its own, under a uid of its own, confined by seccomp and
//! no_new_privs, holding nothing of any other tenant's; the device's
//! worker is its arbiter and shares its lanes between the executors by
//! weight; killing one executor leaves every other tenant's running work
//! correct, and gets its tenant a fresh one.

use std::time::{Duration, Instant};

use vgpu_tests::*;

fn process_mediator() -> Mediator {
    Mediator::start(&["--isolation", "process", "--device-memory", "256MiB"])
}

/// The executors the device view lists: (tenant, pid, uid).
fn executors(m: &Mediator) -> Vec<(String, u32, Option<u64>)> {
    let d = m.device("cpu0");
    assert_eq!(d["isolation"], "process", "{d}");
    d["executors"].as_array().map(|v| v.iter().map(|e| (e["tenant"].as_str().unwrap().to_string(), e["pid"].as_u64().unwrap() as u32, e["uid"].as_u64())).collect()).unwrap_or_default()
}

fn executor_of(m: &Mediator, tenant: &str) -> u32 {
    executors(m).into_iter().find(|e| e.0 == tenant).unwrap_or_else(|| panic!("no executor for {tenant}: {:?}", executors(m))).1
}

#[test]
fn each_tenant_has_an_executor_of_its_own_confined_and_holding_nothing_of_another() {
    let m = process_mediator();
    let a = m.tenant("a", "32MiB");
    let b = m.tenant("b", "32MiB");
    let (_ha, _hb) = (Holder::new(&a), Holder::new(&b));
    let ex = executors(&m);
    assert_eq!(ex.len(), 2, "{ex:?}");
    let arbiter = m.worker_pid("cpu0");
    let (pa, pb) = (executor_of(&m, "a"), executor_of(&m, "b"));
    assert!(pa != pb && pa != arbiter && pb != arbiter, "a {pa}, b {pb}, arbiter {arbiter}");
    for pid in [pa, pb, arbiter] {
        let s = proc_stats(pid);
        assert_eq!((s.seccomp, s.no_new_privs), (2, 1), "process {pid}: {s:?}");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let (ua, ub, uw) = (proc_stats(pa).uid, proc_stats(pb).uid, proc_stats(arbiter).uid);
        assert!(ua != ub && ua != uw && ub != uw && ua != 0 && ub != 0, "uids: a {ua}, b {ub}, arbiter {uw}");
        for (t, pid, uid) in &ex {
            assert_eq!(*uid, Some(u64::from(proc_stats(*pid).uid)), "the view's uid of {t}'s executor");
        }
        // No network: a namespace of its own, loopback only.
        let dev = std::fs::read_to_string(format!("/proc/{pa}/net/dev")).expect("net/dev");
        let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
        assert_eq!(ifaces, ["lo"], "{dev}");
    } else {
        report_skip("executors: distinct uids and no network", "the test is not root: executors keep the test's uid and cannot leave the network namespace");
    }
    // Each holds its own tenant's socket, rings and buffers, and nothing
    // the other holds.
    let (ha, hb) = (held(pa), held(pb));
    assert!(!ha.is_empty() && !hb.is_empty(), "a holds {ha:?}, b holds {hb:?}");
    let shared: Vec<&String> = ha.intersection(&hb).collect();
    assert!(shared.is_empty(), "both executors hold {shared:?}");
    // The arbiter holds no tenant memory at all.
    let arb = held(arbiter);
    assert!(!arb.iter().any(|h| h.contains("memfd")), "the arbiter maps {arb:?}");
    // Both tenants compute, each in its own process.
    assert!(run_ok(sample("vectorAdd", &a)).contains("PASSED"));
    assert!(run_ok(sample("vectorAdd", &b)).contains("PASSED"));
}

#[test]
fn killing_an_executor_leaves_the_other_tenants_running_work_correct() {
    let m = process_mediator();
    let a = m.tenant("victim", "32MiB");
    let b = m.tenant("bystander", "32MiB");
    let pa = executor_of(&m, "victim");
    // A process of the victim's, with a context open when its executor dies.
    let relive = Relive::start(&a);
    // The bystander's samples run while the victim's executor is killed.
    let b2 = b.clone();
    let work = std::thread::spawn(move || checks::samples_concurrently(&[&b2], "200000", "96"));
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill sends SIGKILL to a process the test's daemon started.
    assert_eq!(unsafe { libc::kill(pa as i32, libc::SIGKILL) }, 0);
    work.join().expect("the bystander's samples failed beside the killed executor");
    // The victim gets a fresh executor, and computes again.
    let deadline = Instant::now() + Duration::from_secs(20);
    let fresh = loop {
        if let Some(p) = executors(&m).into_iter().find(|e| e.0 == "victim").map(|e| e.1).filter(|p| *p != pa) {
            break p;
        }
        assert!(Instant::now() < deadline, "no new executor for the victim: {:?}", executors(&m));
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_ne!(fresh, pa);
    assert!(run_ok(sample("vectorAdd", &a)).contains("PASSED"));
    // The process that outlived its executor: its old context reports the
    // loss, and a context it creates after destroying that one is served
    // by the fresh executor.
    relive.finish();
    assert_eq!(m.device("cpu0")["state"], "running");
}

/// An executor and the arbiter, stopped and continued (a debugger, `kill
/// -STOP`, a freezer) go on serving: the kernel resumes their interrupted
/// sleeps and waits with `restart_syscall`, which their seccomp lists
/// allow. The client's context and memory are still there afterwards.
#[test]
fn a_stopped_and_continued_executor_goes_on_serving() {
    use std::io::{BufRead, Write};
    let m = process_mediator();
    let a = m.tenant("paused", "32MiB");
    let mut holder = sample("tenant_probe", &a);
    holder.args(["hold", "4096"]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    let mut child = holder.spawn().expect("spawn tenant_probe hold");
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("ptr line");
    assert!(line.starts_with("ptr="), "{line}");
    let (exec, arbiter) = (executor_of(&m, "paused"), m.worker_pid("cpu0"));
    let restarts = m.device("cpu0")["restarts"].clone();
    for _ in 0..3 {
        for pid in [exec, arbiter] {
            // SAFETY: signals processes the test's daemon started.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
        }
        std::thread::sleep(Duration::from_millis(300));
        for pid in [exec, arbiter] {
            // SAFETY: as above.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGCONT) }, 0);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    child.stdin.take().expect("stdin").write_all(b"go\n").expect("go");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).expect("the holder's result");
    assert!(child.wait().expect("wait").success(), "{rest}");
    assert_eq!(rest.trim(), "intact=4096", "the held context and memory work on after the stops");
    assert_eq!((executor_of(&m, "paused"), m.worker_pid("cpu0")), (exec, arbiter), "the same processes serve");
    assert_eq!(m.device("cpu0")["restarts"], restarts);
    assert!(run_ok(sample("vectorAdd", &a)).contains("PASSED"));
}

#[test]
fn executors_are_bounded_by_the_kernel() {
    let test = "executors_are_bounded_by_the_kernel";
    let m = process_mediator();
    let a = m.tenant("a", "32MiB");
    let _ha = Holder::new(&a);
    let d = m.device("cpu0");
    let view = d["executors"].as_array().and_then(|v| v.iter().find(|e| e["tenant"] == "a")).cloned().unwrap_or_else(|| panic!("{d}"));
    let pid = view["pid"].as_u64().unwrap() as u32;
    let bounds = &view["bounds"];
    // /proc/PID/limits: "Max open files   SOFT   HARD   files".
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let limit = |name: &str| -> Vec<String> { limits.lines().find(|l| l.starts_with(name)).map(|l| l[name.len()..].split_whitespace().take(2).map(str::to_string).collect()).unwrap_or_default() };
    let fds = bounds["fds"].as_u64().unwrap_or_else(|| panic!("{view}"));
    assert!(fds >= 256, "{view}");
    assert_eq!(limit("Max open files"), [fds.to_string(), fds.to_string()], "soft and hard, so it cannot raise them:\n{limits}");
    let cgroup2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").is_ok();
    match bounds["cgroup"].as_str() {
        Some(dir) => {
            // Its cgroup holds it, with the limits the view reports.
            let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
            let rel = own.lines().find_map(|l| l.strip_prefix("0::")).expect("cgroup v2 line");
            assert_eq!(format!("/sys/fs/cgroup{rel}"), dir, "{own}");
            assert!(rel.starts_with("/vgpu-mediatord/cpu0.a."), "{rel}");
            let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).expect(f).trim().to_string();
            let memory = bounds["memory"].as_u64().expect("memory with a cgroup");
            assert!(memory >= (32 << 20) + (256 << 20), "device memory and the base: {view}");
            assert_eq!(read("memory.max"), memory.to_string());
            assert_eq!(read("pids.max"), bounds["tasks"].as_u64().expect("tasks").to_string());
            // A grown quota raises the running executor's bound.
            let (st, v) = m.api("PATCH", "/tenants/a", Some(serde_json::json!({ "memory": "64MiB" })));
            assert!(st < 300, "{st} {v}");
            assert_eq!(read("memory.max"), (memory + (32 << 20)).to_string(), "memory.max after the quota grew");
            drop(_ha);
            let (st, v) = m.api("DELETE", "/tenants/a", None);
            assert!(st < 300, "{st} {v}");
            let gone = (0..200).any(|_| {
                std::thread::sleep(Duration::from_millis(25));
                !std::path::Path::new(dir).exists()
            });
            assert!(gone, "{dir} outlived its executor");
        }
        None => {
            assert!(bounds["memory"].is_null(), "no memory bound without a cgroup: {view}");
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } == 0 {
                let tasks = bounds["tasks"].as_u64().unwrap_or_else(|| panic!("an executor with a uid of its own has RLIMIT_NPROC: {view}"));
                assert_eq!(limit("Max processes"), [tasks.to_string(), tasks.to_string()], "{limits}");
            }
            if cgroup2 {
                panic!("cgroup v2 is mounted at /sys/fs/cgroup, but the executor has no cgroup: {view}");
            }
            report_skip(test, "/sys/fs/cgroup is not cgroup v2 here: the memory and tasks cgroup is checked in the nested test host (nested_jail)");
        }
    }
}

#[test]
fn the_arbiter_shares_lanes_between_executors_by_weight() {
    // The tolerance of scheduling.rs; share-bench measures the real error
    // (docs/perf.md: up to 7 points across executors so far).
    shares::assert_weights_hold(&process_mediator(), 0.08);
}

#[test]
fn a_foreign_pointer_faults_in_the_thief_only() {
    let m = process_mediator();
    let owner = m.tenant("owner", "32MiB");
    let thief = m.tenant("thief", "32MiB");
    // The owner's data is intact and nothing of it reached the thief
    // (checked inside); the thief's kernel faulted.
    let got = checks::steal_from(&owner, &thief);
    assert!(got.contains("kernel=CUDA_ERROR_ILLEGAL_ADDRESS"), "{got}");
    // The owner computes on; the thief's executor is the one poisoned.
    assert!(run_ok(sample("vectorAdd", &owner)).contains("PASSED"));
}

#[test]
fn deleting_a_tenant_ends_its_executor_and_frees_its_uid() {
    let m = process_mediator();
    m.tenant("gone", "16MiB");
    let p = executor_of(&m, "gone");
    let (st, _) = m.api("DELETE", "/tenants/gone", None);
    assert!(st == 204 || st == 202, "{st}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{p}")).exists() && std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| !s.contains("State:\tZ")) {
        assert!(Instant::now() < deadline, "executor {p} still runs after its tenant was deleted");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Reaped and forgotten.
    while !executors(&m).is_empty() {
        assert!(Instant::now() < deadline, "the device still lists {:?}", executors(&m));
        std::thread::sleep(Duration::from_millis(20));
    }
    // The uid went back: a new tenant may get it (never two live ones).
    m.tenant("next", "16MiB");
    assert_eq!(executors(&m).len(), 1);
}

/// Two mediators on one host with the same executor uid range (the
/// default) never run two executors as one uid: each uid is claimed
/// host-wide while it is in use, and a mediator that is killed leaves no
/// claim behind.
#[test]
fn two_mediators_on_one_host_never_share_an_executor_uid() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return report_skip("two_mediators_on_one_host_never_share_an_executor_uid", "the test is not root: executors keep the test's uid");
    }
    let uids = |m: &Mediator| -> Vec<u64> { executors(m).iter().map(|e| e.2.expect("an executor uid")).collect() };
    let first = process_mediator();
    first.tenant("a1", "16MiB");
    first.tenant("a2", "16MiB");
    let mut second = process_mediator();
    second.tenant("b1", "16MiB");
    second.tenant("b2", "16MiB");
    let (ua, ub) = (uids(&first), uids(&second));
    assert_eq!((ua.len(), ub.len()), (2, 2), "{ua:?} {ub:?}");
    assert!(ua.iter().all(|u| !ub.contains(u)), "two mediators gave out one uid: first {ua:?}, second {ub:?}");
    for u in ua.iter().chain(&ub) {
        // Held: a third claimer's lock would block.
        let claim = std::path::Path::new("/run/vgpu-executor-uids").join(u.to_string());
        let f = std::fs::File::open(&claim).unwrap_or_else(|e| panic!("no claim {} for a live executor's uid: {e}", claim.display()));
        assert!(matches!(f.try_lock_shared(), Err(std::fs::TryLockError::WouldBlock)), "the claim {} of a live executor's uid is not held", claim.display());
    }
    // Killed, the second mediator's claims go with it; a mediator started
    // after it gives out neither the first's uids nor any its own
    // executors may still run as.
    second.kill_and_restart(&["--isolation", "process", "--device-memory", "256MiB"]);
    second.tenant("c", "16MiB");
    let uc = uids(&second);
    assert!(!uc.is_empty() && uc.iter().all(|u| !ua.contains(u)), "the restarted mediator took a uid the first still uses: first {ua:?}, restarted {uc:?}");
}

#[test]
fn process_isolation_refuses_overcommit_it_cannot_honour() {
    let out = std::process::Command::new(bin("vgpu-mediatord"))
        .args(["--run-dir", &format!("/tmp/vgpu-exec-oc-{}", std::process::id()), "--cuda", "off", "--isolation", "process", "--spill", "16MiB"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not support memory overcommit"), "{out:?}");
}

/// Stalled executors (stopped, or a hijacked one that stays silent) do
/// not hold up the views of their device: their statistics are asked for
/// together and, once late, waited for briefly; once they answer again,
/// they are counted again.
#[test]
fn stalled_executors_do_not_hold_up_the_api() {
    let m = process_mediator();
    m.tenant("healthy", "16MiB");
    let stalled: Vec<u32> = (0..3)
        .map(|i| {
            let name = format!("stalled{i}");
            m.tenant(&name, "16MiB");
            executor_of(&m, &name)
        })
        .collect();
    for pid in &stalled {
        // SAFETY: signals processes the test's daemon started.
        assert_eq!(unsafe { libc::kill(*pid as i32, libc::SIGSTOP) }, 0);
    }
    let timed = || {
        let t = Instant::now();
        let (st, v) = m.api("GET", "/tenants/healthy", None);
        assert_eq!(st, 200, "{v}");
        t.elapsed()
    };
    // One wait for all three (2 s), not one each (6 s); then none, even
    // after more requests than their input pipes hold.
    let first = timed();
    for _ in 0..3000 {
        assert_eq!(m.api("GET", "/tenants/healthy", None).0, 200);
    }
    let second = timed();
    for pid in &stalled {
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(*pid as i32, libc::SIGCONT) }, 0);
    }
    assert!(first < Duration::from_millis(4500), "the first view took {first:?}");
    assert!(second < Duration::from_millis(1500), "the next view took {second:?}");
    // Continued, they answer (late at first) and are counted again.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, v) = m.api("GET", "/tenants/stalled0", None);
        if !v["usage"].is_null() {
            break;
        }
        assert!(Instant::now() < deadline, "a continued executor's statistics did not come back: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The pipe an executor answers the daemon on: a descriptor of the
/// executor's that the daemon reads, other than its stderr (`fd 2`).
fn reply_pipe(exec: u32, daemon: u32) -> std::path::PathBuf {
    let link = |p: &std::path::Path| std::fs::read_link(p).ok().map(|l| l.to_string_lossy().into_owned());
    let daemon_pipes: Vec<String> = std::fs::read_dir(format!("/proc/{daemon}/fd")).expect("daemon fds").flatten().filter_map(|e| link(&e.path())).collect();
    let skip = [link(std::path::Path::new(&format!("/proc/{exec}/fd/0"))), link(std::path::Path::new(&format!("/proc/{exec}/fd/2")))];
    std::fs::read_dir(format!("/proc/{exec}/fd"))
        .expect("executor fds")
        .flatten()
        .find(|e| {
            let l = link(&e.path());
            l.as_deref().is_some_and(|l| l.starts_with("pipe:") && daemon_pipes.iter().any(|d| d == l)) && !skip.contains(&l)
        })
        .map(|e| e.path())
        .expect("the executor's reply pipe")
}

/// What an executor sends the daemon reaches its log bounded: a flood of
/// unreadable lines is a few lines, and a message cannot forge a line.
#[test]
fn an_executors_messages_cannot_flood_or_forge_the_daemons_log() {
    use std::io::Write;
    let log = std::env::temp_dir().join(format!("vgpu-exec-flood-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let m = Mediator::start_logging(&["--isolation", "process", "--device-memory", "256MiB"], &log);
    m.tenant("loud", "16MiB");
    let exec = executor_of(&m, "loud");
    let mut pipe = std::fs::OpenOptions::new().write(true).open(reply_pipe(exec, m.pid())).expect("open the reply pipe");
    let forged = "INFO vgpu_mediatord: forged-line tenant deleted";
    let err = serde_json::json!({"id": 0, "msg": {"Err": format!("oops\n{forged}\n{}", "x".repeat(100_000))}});
    pipe.write_all(format!("{err}\n").as_bytes()).expect("write");
    for _ in 0..20_000 {
        pipe.write_all(b"junk\n").expect("write");
    }
    drop(pipe);
    std::thread::sleep(Duration::from_millis(1500));
    let text = std::fs::read_to_string(&log).expect("log");
    let junk = text.lines().filter(|l| l.contains("unreadable worker message")).count();
    assert!((1..=40).contains(&junk), "{junk} lines of junk logged");
    assert!(!text.lines().any(|l| l.starts_with(forged) || l.contains(&"x".repeat(2000))), "a forged or unbounded line");
    assert!(text.contains("oops\\n"), "the message, escaped: {text}");
    let _ = std::fs::remove_file(&log);
}
