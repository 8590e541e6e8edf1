//! Harness for the KVM tier: builds the bare-metal test guest once (and
//! proves it has no SSE), runs `vgpu-vmm` on it with the serial console in
//! a file, and talks to the VM's API socket.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::{bin, workspace};

/// True when this host lets us create VMs; otherwise prints why the test
/// is skipped (loudly: it shows in the test output).
pub fn kvm_available(test: &str) -> bool {
    match std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        Ok(_) => true,
        Err(e) => {
            crate::report_skip(test, &format!("/dev/kvm is not usable here ({e}); the KVM tier needs it"));
            false
        }
    }
}

/// Builds images/test-guest (release) once per test binary and checks with
/// objdump that no SSE/MMX/AVX register appears in it.
pub fn test_guest() -> &'static Path {
    static G: OnceLock<PathBuf> = OnceLock::new();
    G.get_or_init(|| {
        let dir = workspace().join("images/test-guest");
        // rustc warns that the x86-64 ABI wants SSE2; the guest has no
        // floating point, and the objdump check below is the real guard.
        let o = Command::new(env!("CARGO")).args(["build", "--release", "--quiet"]).current_dir(&dir).output().expect("running cargo for the test guest");
        assert!(o.status.success(), "building images/test-guest failed:\n{}", String::from_utf8_lossy(&o.stderr));
        let g = dir.join("target/x86_64-unknown-linux-gnu/release/vgpu-test-guest");
        let dis = Command::new("objdump").arg("-d").arg(&g).output().expect("objdump (binutils) is needed to check the test guest");
        let text = String::from_utf8_lossy(&dis.stdout);
        assert!(dis.status.success() && text.contains("<_start>"), "objdump could not read the test guest");
        let bad: Vec<&str> = text.lines().filter(|l| l.contains("%xmm") || l.contains("%ymm") || l.contains("%mm")).collect();
        assert!(bad.is_empty(), "the test guest uses SSE/MMX registers:\n{}", bad.join("\n"));
        g
    })
}

pub struct Guest {
    pub child: Child,
    pub serial: PathBuf,
    pub api: PathBuf,
    dir: PathBuf,
}

fn scratch_dir() -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!("vgpu-vm-{}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

impl Guest {
    /// Starts the test guest with `test=MODE` and extra VMM flags.
    pub fn start(mode: &str, extra: &[&str]) -> Guest {
        let dir = scratch_dir();
        let serial = dir.join("serial.log");
        let api = dir.join("api.sock");
        let child = Command::new(bin("vgpu-vmm"))
            .arg("--kernel")
            .arg(test_guest())
            .args(if extra.contains(&"--memory") { &[][..] } else { &["--memory", "16"][..] })
            .args(["--cmdline", &format!("test={mode}")])
            .arg("--serial")
            .arg(&serial)
            .arg("--api-socket")
            .arg(&api)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start vgpu-vmm");
        Guest { child, serial, api, dir }
    }

    pub fn serial_text(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    /// Waits until the serial console shows `needle`.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let t = self.serial_text();
            if t.contains(needle) {
                return t;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("the VMM exited ({st}) before printing {needle:?}; serial:\n{t}");
            }
            assert!(Instant::now() < deadline, "no {needle:?} on the serial console within {timeout:?}; serial:\n{t}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn wait_api(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&self.api).is_err() {
            assert!(Instant::now() < deadline, "VMM API did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn api_call(&self, method: &str, path: &str) -> (u16, String) {
        let r = vgpu_api::http::request(&self.api, method, path, None).expect("VMM API request");
        (r.status, r.text())
    }

    /// Waits for the VMM to exit; returns its status, stderr and the
    /// serial console's text (the scratch directory goes with `self`).
    pub fn wait_exit(mut self, timeout: Duration) -> (ExitStatus, String, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                return (st, err, self.serial_text());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the VMM did not exit within {timeout:?}; serial:\n{}", self.serial_text());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Guest {
    /// Kills the VMM; returns its stderr and the serial console's text.
    pub fn stop(mut self) -> (String, String) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        (err, self.serial_text())
    }

    /// The `vgpu-again` guest's last round, passed or failed (0 before the first).
    pub fn last_round(&self) -> u32 {
        self.serial_text().lines().filter_map(|l| l.strip_prefix("round ")?.split(' ').next()?.parse().ok()).max().unwrap_or(0)
    }

    /// Ends the `vgpu-again` guest's backend with `end` after its second
    /// round, then waits for a round that began after the end to pass: the
    /// VMM reconnected to the backend the daemon started again, and the
    /// guest's device never reported an error. Returns the VMM's stderr
    /// and the serial text.
    pub fn outlives_its_backend(mut self, end: impl FnOnce()) -> (String, String) {
        self.wait_for("round 2 PASSED", Duration::from_secs(120));
        end();
        let after = format!("round {} PASSED", self.last_round() + 2);
        self.wait_for(&after, Duration::from_secs(90));
        let (err, out) = self.stop();
        assert!(err.contains("backend hung up") && err.contains("reconnected to the vGPU backend"), "{err}");
        assert!(!err.contains("device error") && !err.contains("forbidden syscall"), "{err}");
        (err, out)
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `vgpu-vmm` with `args` to completion.
pub fn vmm_run(args: &[&str]) -> std::process::Output {
    Command::new(bin("vgpu-vmm")).args(args).stdin(Stdio::null()).output().expect("run vgpu-vmm")
}

/// One thread of a process: its name and /proc status text.
pub struct TaskStatus {
    pub tid: u32,
    pub comm: String,
    pub status: String,
}

impl TaskStatus {
    /// A `Name:\tvalue` field of the status text.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).map(str::trim)
    }
}

/// Every thread of `pid` (threads that exit meanwhile are left out).
pub fn tasks(pid: u32) -> Vec<TaskStatus> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc/PID/task") {
        let t = t.expect("task entry").path();
        let (Ok(comm), Ok(status)) = (std::fs::read_to_string(t.join("comm")), std::fs::read_to_string(t.join("status"))) else { continue };
        let tid = t.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse().ok()).unwrap_or(0);
        out.push(TaskStatus { tid, comm: comm.trim().to_string(), status });
    }
    out
}

/// True for the kernel's own workers that KVM attaches to a VM's process
/// (the NX huge page recovery thread): they never run user code, so no
/// seccomp filter applies to them.
pub fn is_kvm_kernel_worker(t: &TaskStatus) -> bool {
    t.comm.starts_with("kvm-nx-lpage")
}

/// The children of `pid`'s main thread.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default().split_whitespace().filter_map(|p| p.parse().ok()).collect()
}
