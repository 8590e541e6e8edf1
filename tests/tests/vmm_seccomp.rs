//! vgpu-vmm runs every thread under its kind's seccomp allow-list (main,
//! vCPU, API, device): a syscall off a kind's list kills the VMM with
//! SIGSYS and names the syscall, and the lists allow everything the
//! normal paths need (a guest runs to the end with every thread confined,
//! and every other KVM-tier test runs with the filters on as well).

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::json;
use vgpu_tests::vmm_harness::*;
use vgpu_tests::*;

fn check(thread: &str, syscall: &str) -> Output {
    Command::new(bin("vgpu-vmm")).args(["seccomp-check", "--thread", thread, "--syscall", syscall]).output().expect("run vgpu-vmm seccomp-check")
}

/// The x86_64 number the handler must name for each forbidden call.
fn number(syscall: &str) -> i64 {
    match syscall {
        "execve" => libc::SYS_execve,
        "fork" => libc::SYS_clone,
        "ptrace" => libc::SYS_ptrace,
        "socket-inet" | "socket-unix" | "socket-unix-dgram" => libc::SYS_socket,
        "kvm-run" | "kvm-create-vm" => libc::SYS_ioctl,
        "unlink" => libc::SYS_unlink,
        "clone3" => libc::SYS_clone3,
        other => panic!("no number for {other}"),
    }
}

#[test]
fn a_forbidden_syscall_kills_each_thread_kind_with_sigsys() {
    let forbidden: &[(&str, &[&str])] = &[
        ("main", &["execve", "fork", "ptrace", "socket-inet", "socket-unix", "kvm-run", "thread"]),
        ("vcpu", &["execve", "fork", "ptrace", "socket-inet", "socket-unix", "kvm-create-vm", "unlink"]),
        ("api", &["execve", "fork", "ptrace", "socket-inet", "socket-unix", "kvm-run", "unlink"]),
        ("device", &["execve", "fork", "ptrace", "socket-inet", "socket-unix", "kvm-run", "unlink", "thread", "clone3"]),
        ("link", &["execve", "fork", "ptrace", "socket-inet", "socket-unix-dgram", "kvm-run", "unlink", "thread", "clone3"]),
    ];
    for (thread, calls) in forbidden {
        for syscall in *calls {
            let o = check(thread, syscall);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.signal(), Some(libc::SIGSYS), "{syscall} on a {thread} thread was not killed by SIGSYS: {:?} {}{err}", o.status, String::from_utf8_lossy(&o.stdout));
            // glibc blocks every signal while it creates a thread; a trap
            // then kills at once, without running the handler.
            if *syscall == "thread" {
                continue;
            }
            let want = format!("vgpu-vmm: seccomp: forbidden syscall {}\n", number(syscall));
            assert!(err.contains(&want), "{syscall} on a {thread} thread: {err:?} lacks {want:?}");
        }
    }
}

#[test]
fn what_each_thread_kind_needs_is_allowed() {
    // (thread, syscall, what it returns): reaching the kernel shows as its
    // own answer (EBADF for a KVM_RUN on no fd, ENOENT for unlink).
    let allowed: &[(&str, &str, &str)] = &[
        ("main", "getpid", ""),
        ("main", "unlink", "returned -2"),
        ("vcpu", "getpid", ""),
        ("vcpu", "kvm-run", "returned -9"),
        ("vcpu", "thread", "returned 7"),
        ("api", "getpid", ""),
        ("api", "thread", "returned 7"),
        ("device", "getpid", ""),
        ("link", "getpid", ""),
        // The vGPU link reconnects: a unix socket, and only that.
        ("link", "socket-unix", "returned "),
    ];
    for (thread, syscall, want) in allowed {
        let o = check(thread, syscall);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{syscall} on a {thread} thread: {:?} {}", o.status, String::from_utf8_lossy(&o.stderr));
        assert!(out.contains(&format!("{syscall} returned")) && out.contains(want), "{syscall} on a {thread} thread: {out}");
    }
    for thread in ["main", "vcpu", "api", "device", "link"] {
        // Opening a file fails with EACCES without killing anyone.
        let o = check(thread, "openat");
        assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("openat returned -13"), "{thread}: {:?} {}", o.status, String::from_utf8_lossy(&o.stdout));
    }
    for thread in ["vcpu", "api"] {
        // clone3 answers ENOSYS so that glibc uses clone, whose flags the
        // filter checks: threads yes, processes no.
        let o = check(thread, "clone3");
        assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("clone3 returned -38"), "{thread}: {}", String::from_utf8_lossy(&o.stdout));
    }
}

fn seccomp_mode(t: &TaskStatus) -> &str {
    t.field("Seccomp").unwrap_or("?")
}

#[test]
fn every_thread_of_a_running_vmm_is_confined_and_the_guest_completes() {
    if !kvm_available("every_thread_of_a_running_vmm_is_confined_and_the_guest_completes") {
        return;
    }
    let mut g = Guest::start("count", &["--vcpus", "2"]);
    g.wait_api();
    g.wait_for("tick 2", Duration::from_secs(60));
    // Pause and resume: the API's blocking helper thread kicks the vCPUs.
    assert_eq!(g.api_call("PUT", "/vm/pause").0, 204);
    assert_eq!(g.api_call("PUT", "/vm/resume").0, 204);
    let ticks = g.serial_text().matches("tick ").count();
    g.wait_for(&format!("tick {}", ticks + 1), Duration::from_secs(60));
    let tasks = tasks(g.child.id());
    let names: Vec<&str> = tasks.iter().map(|t| t.comm.as_str()).collect();
    for want in ["vgpu-vmm", "vcpu0", "vcpu1", "vmm-api"] {
        assert!(names.contains(&want), "no {want} thread among {names:?}");
    }
    for t in tasks.iter().filter(|t| !is_kvm_kernel_worker(t)) {
        assert_eq!(seccomp_mode(t), "2", "thread {} ({}) is not under a seccomp filter", t.comm, t.tid);
        assert_eq!(t.field("NoNewPrivs"), Some("1"), "thread {}", t.comm);
    }
    assert_eq!(g.api_call("PUT", "/vm/shutdown").0, 202);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "{err}");
    assert!(out.contains("TEST PASSED count"), "{out}");
    assert!(!err.contains("forbidden syscall"), "{err}");
}

#[test]
fn no_seccomp_runs_the_vmm_unfiltered() {
    if !kvm_available("no_seccomp_runs_the_vmm_unfiltered") {
        return;
    }
    let mut g = Guest::start("count", &["--no-seccomp"]);
    g.wait_api();
    g.wait_for("tick 1", Duration::from_secs(60));
    for t in tasks(g.child.id()).iter().filter(|t| !is_kvm_kernel_worker(t)) {
        assert_eq!(seccomp_mode(t), "0", "thread {} is filtered despite --no-seccomp", t.comm);
    }
    assert_eq!(g.api_call("PUT", "/vm/kill").0, 204);
    let (st, err, _) = g.wait_exit(Duration::from_secs(30));
    assert_eq!(st.code(), Some(4), "{err}");
}

#[test]
fn device_threads_narrow_their_filters_and_reconnect_a_backend_that_died() {
    if !kvm_available("device_threads_narrow_their_filters_and_reconnect_a_backend_that_died") {
        return;
    }
    let m = Mediator::start(&[]);
    let (code, v) = m.api("POST", "/tenants", Some(json!({ "name": "sc", "memory": "32MiB", "kind": "vm" })));
    assert_eq!(code, 201, "{v}");
    let arg = format!("socket={}", v["socket"].as_str().expect("socket"));
    let mut g = Guest::start("vgpu-again", &["--vgpu", &arg]);
    g.wait_for("round 1 PASSED", Duration::from_secs(120));
    let tasks = tasks(g.child.id());
    let filters = |name: &str| -> u32 {
        let t = tasks.iter().find(|t| t.comm == name).unwrap_or_else(|| panic!("no {name} thread among {:?}", tasks.iter().map(|t| &t.comm).collect::<Vec<_>>()));
        assert_eq!(seccomp_mode(t), "2", "{name}");
        t.field("Seccomp_filters").and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    // The interrupt forwarder was started by a vCPU and stacked its own,
    // narrower list on the vCPU's (kernels before 5.9 do not count them);
    // the link thread was started before any filter and has its own alone.
    let (dev, vcpu, link) = (filters("vgpu-irq"), filters("vcpu0"), filters("vgpu-link"));
    if vcpu > 0 {
        assert!(dev > vcpu, "the device thread has {dev} filters, its vCPU {vcpu}");
        assert!(link > 0 && link < vcpu + 3, "the link thread has {link} filters, a vCPU {vcpu}");
    }
    let pid = m.worker_pid("cpu0");
    // The hang-up is seen, and the new connection made, on the confined
    // link thread.
    g.outlives_its_backend(|| {
        // SAFETY: SIGKILL to the device worker of the mediator this test started.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    });
}
