//! Test harness shared by the end-to-end tests and the benchmark: starts a
//! mediator in a private run directory, talks to its API, builds the C
//! sample programs with `cc` once, and runs them as tenants.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;
use virtio_gpu_compute::{MsgHeader, Opcode, Reply, Request, Wire};

/// Directory holding the workspace's built binaries (target/release or
/// target/debug, whichever built this test).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut d = exe.parent().expect("exe dir").to_path_buf();
    if d.ends_with("deps") {
        d.pop();
    }
    d
}

/// `bin_dir()/NAME-PID`: a file or directory of this test process's own
/// (a compiled probe, a CuPy cache). Those that processes now gone left
/// under the same name are removed first, so repeated runs do not pile
/// them up in target/release.
pub fn per_process(name: &str) -> PathBuf {
    let dir = bin_dir();
    let me = std::process::id();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let file = e.file_name();
            let Some(pid) = file.to_str().and_then(|f| f.strip_prefix(name)).and_then(|r| r.strip_prefix('-')).and_then(|p| p.parse::<u32>().ok()) else { continue };
            if pid != me && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let p = e.path();
                let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            }
        }
    }
    dir.join(format!("{name}-{me}"))
}

pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace").to_path_buf()
}

pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(p.exists(), "{} is missing: build the workspace first (cargo build --release --workspace)", p.display());
    p
}

/// The shim's directory, with the `libcuda.so.1` and `libnvidia-ml.so.1`
/// names programs load (one shared object answers both).
pub fn lib_dir() -> PathBuf {
    let d = bin_dir();
    let so = d.join("libcuda.so");
    assert!(so.exists(), "{} is missing: build the workspace first", so.display());
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        if !d.join(name).exists() {
            let _ = std::os::unix::fs::symlink("libcuda.so", d.join(name));
        }
    }
    d
}

/// Compiles the C programs in samples/ once per test binary, into one
/// directory all test binaries share: each program is built under a name
/// of this process's and renamed over the last build, so a test binary
/// never runs another's half-written file and no directory is left per run.
pub fn samples() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = bin_dir().join("samples");
        std::fs::create_dir_all(&out).expect("samples dir");
        let tmp = |p: &str| out.join(format!(".{p}.{}", std::process::id()));
        let ws = workspace();
        let lib = lib_dir();
        for p in ["vectorAdd", "matrixMul", "reduction", "tenant_probe"] {
            let st = Command::new("cc")
                .args(["-O2", "-Wall", "-Werror", "-I"])
                .arg(ws.join("guest-driver-shim/include"))
                .arg(format!("-DKERNEL_DIR=\"{}\"", ws.join("samples/kernels").display()))
                .arg("-o")
                .arg(tmp(p))
                .arg(ws.join(format!("samples/{p}.c")))
                .arg("-L")
                .arg(&lib)
                .args(["-lcuda", "-lm"])
                .status()
                .expect("running cc (install gcc)");
            assert!(st.success(), "compiling samples/{p}.c failed");
            std::fs::rename(tmp(p), out.join(p)).expect("placing a compiled sample");
        }
        out
    })
}

/// A tenant program (`tenant_probe relive`) holding a context open while
/// the test ends the process that serves it; [`Relive::finish`] then has
/// it try the old context and a new one, and checks that the old one
/// reports the loss and the new one is served afresh.
pub struct Relive {
    child: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Relive {
    pub fn start(socket: &Path) -> Relive {
        use std::io::BufRead;
        let mut c = sample("tenant_probe", socket);
        c.args(["relive", "4096"]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
        let mut child = c.spawn().expect("spawn tenant_probe relive");
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("ready line");
        assert_eq!(line.trim(), "ready");
        Relive { child, out }
    }

    pub fn finish(mut self) {
        use std::io::BufRead;
        self.child.stdin.take().expect("stdin").write_all(b"go\n").expect("go");
        let mut line = String::new();
        self.out.read_line(&mut line).expect("relive result");
        assert!(self.child.wait().expect("wait").success(), "{line}");
        assert!(line.contains("old=CUDA_ERROR_DEVICE_UNAVAILABLE"), "{line}");
        assert!(line.contains("made=CUDA_SUCCESS fresh=CUDA_SUCCESS value=0x3c"), "the next context is served afresh: {line}");
    }
}

/// What a process holds that another process could share with it: the
/// files behind its descriptors and its mappings (sockets, memfds, other
/// files), by inode.
pub fn held(pid: u32) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fd dir").flatten() {
        if let Ok(t) = std::fs::read_link(e.path()) {
            let t = t.to_string_lossy().to_string();
            // The standard streams and the binary are every worker's.
            if t.starts_with("socket:") || t.starts_with("/memfd:") || t.contains("(deleted)") {
                let ino = std::fs::metadata(e.path()).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap_or(0);
                out.insert(format!("{t}#{ino}"));
            }
        }
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    for l in maps.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() >= 6 && (f[5].starts_with("/memfd:") || f[5].starts_with("/dev/shm")) {
            let kind = if f[5].starts_with("/memfd:") { "memfd" } else { "shm" };
            out.insert(format!("{kind} map {} {}", f[3], f[4]));
        }
    }
    out
}

/// A tenant_probe holding 4096 bytes of the tenant's device memory (and
/// its connection, ring and shared buffers) until dropped.
pub struct Holder(std::process::Child);

impl Holder {
    pub fn new(socket: &std::path::Path) -> Holder {
        let mut c = sample("tenant_probe", socket);
        c.args(["hold", "4096"]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
        let mut child = c.spawn().expect("spawn holder");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.as_mut().expect("stdout")), &mut line).expect("ptr line");
        assert!(line.starts_with("ptr="), "{line}");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(mut i) = self.0.stdin.take() {
            let _ = std::io::Write::write_all(&mut i, b"go\n");
        }
        let _ = self.0.wait();
    }
}

/// A program from samples/ run as the tenant behind `socket`.
pub fn sample(name: &str, socket: &Path) -> Command {
    let mut c = Command::new(samples().join(name));
    c.env("VGPU_SOCKET", socket).env("LD_LIBRARY_PATH", lib_dir()).env("VGPU_LOG", "1");
    c
}

pub fn run_ok(mut c: impl std::borrow::BorrowMut<Command>) -> String {
    let c = c.borrow_mut();
    let o: Output = c.output().expect("spawn");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{c:?} failed ({}):\n{text}", o.status);
    text
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// How a test mediator is started, beyond its flags.
#[derive(Default)]
struct Spawn<'a> {
    /// Its open-descriptor limit.
    nofile: Option<u64>,
    /// Where its log goes (default: the test's stderr).
    log: Option<&'a Path>,
    /// The fake sysfs tree it reads the NUMA topology from.
    sysfs_root: Option<&'a Path>,
    /// Extra environment (the test double of NVIDIA's driver).
    env: Vec<(&'static str, std::ffi::OsString)>,
}

pub struct Mediator {
    child: Child,
    pub run_dir: PathBuf,
    /// Its `cuda` devices are the test double of NVIDIA's driver.
    pub on_test_driver: bool,
}

impl Mediator {
    /// A mediator on CPU reference devices only, whatever GPUs the machine
    /// has, so these tests mean the same everywhere.
    pub fn start(args: &[&str]) -> Mediator {
        let mut all = vec!["--cuda", "off"];
        all.extend_from_slice(args);
        Self::start_with(&all)
    }

    /// A CPU-device mediator (and so its workers) limited to `nofile`
    /// open descriptors.
    pub fn start_limited(args: &[&str], nofile: u64) -> Mediator {
        let mut all = vec!["--cuda", "off"];
        all.extend_from_slice(args);
        Self::spawn(&all, Spawn { nofile: Some(nofile), ..Spawn::default() })
    }

    /// A mediator with exactly the given flags (GPU tests pass `--cuda`).
    pub fn start_with(args: &[&str]) -> Mediator {
        Self::spawn(args, Spawn::default())
    }

    /// A mediator with exactly the given flags and extra environment (the
    /// test double of NVIDIA's driver: [`test_driver_env`]).
    pub fn start_with_env(args: &[&str], env: Vec<(&'static str, std::ffi::OsString)>) -> Mediator {
        let on_test_driver = !env.is_empty();
        let mut m = Self::spawn(args, Spawn { env, ..Spawn::default() });
        m.on_test_driver = on_test_driver;
        m
    }

    /// A CPU-device mediator whose log (stderr, at `warn`) goes to `log`.
    pub fn start_logging(args: &[&str], log: &Path) -> Mediator {
        Self::start_logging_at(args, log, "warn")
    }

    /// As [`Mediator::start_logging`], logging at `level` (`VGPU_LOG`).
    pub fn start_logging_at(args: &[&str], log: &Path, level: &str) -> Mediator {
        let mut all = vec!["--cuda", "off"];
        all.extend_from_slice(args);
        Self::spawn(&all, Spawn { log: Some(log), env: vec![("VGPU_LOG", level.into())], ..Spawn::default() })
    }

    /// A CPU-device mediator that reads its NUMA topology from the fake
    /// sysfs tree at `root` (see [`fake_numa_host`]).
    pub fn start_on_topology(args: &[&str], root: &Path) -> Mediator {
        let mut all = vec!["--cuda", "off"];
        all.extend_from_slice(args);
        Self::spawn(&all, Spawn { sysfs_root: Some(root), ..Spawn::default() })
    }

    fn spawn(args: &[&str], how: Spawn<'_>) -> Mediator {
        let run_dir = PathBuf::from(format!("/tmp/vgpu-t{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&run_dir);
        Self::spawn_in(run_dir, args, how)
    }

    /// A CPU-device mediator on a run directory the caller made (and the
    /// returned handle removes).
    pub fn start_in(run_dir: PathBuf, args: &[&str]) -> Mediator {
        let mut all = vec!["--cuda", "off"];
        all.extend_from_slice(args);
        Self::spawn_in(run_dir, &all, Spawn::default())
    }

    /// Kills the daemon with SIGKILL (no cleanup of any kind) and starts a
    /// new one on the same run directory, with `args` (CPU devices only).
    pub fn kill_and_restart(&mut self, args: &[&str]) {
        self.restart_after(libc::SIGKILL, args);
    }

    /// Stops the daemon with `signal` (SIGTERM: a clean shutdown; SIGKILL:
    /// none), waits for it to end, and starts a new one on the same run
    /// directory with `args` (CPU devices only).
    pub fn restart_after(&mut self, signal: i32, args: &[&str]) {
        self.stop_with(signal);
        let _ = std::fs::remove_file(self.api_path());
        let mut all = vec!["--cuda", "off"];
        all.extend_from_slice(args);
        let fresh = Self::spawn_in(self.run_dir.clone(), &all, Spawn::default());
        // The old handle must not clean the run directory up.
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old);
    }

    /// Stops the daemon with `signal` and waits for it to end (SIGKILL
    /// after 10 s). The run directory stays.
    pub fn stop_with(&mut self, signal: i32) {
        // SAFETY: signals our own child process.
        unsafe { libc::kill(self.child.id() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !matches!(self.child.try_wait(), Ok(Some(_))) {
            if Instant::now() > deadline {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn spawn_in(run_dir: PathBuf, args: &[&str], how: Spawn<'_>) -> Mediator {
        let mut cmd = Command::new(bin("vgpu-mediatord"));
        cmd.arg("--run-dir").arg(&run_dir).args(args).env("VGPU_LOG", "warn").stdin(Stdio::null());
        if let Some(path) = how.log {
            cmd.stderr(std::fs::File::create(path).expect("log file"));
        }
        if let Some(root) = how.sysfs_root {
            cmd.env("VGPU_SYSFS_ROOT", root);
        }
        cmd.envs(how.env.iter().map(|(k, v)| (k, v)));
        if let Some(n) = how.nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: the closure only calls setrlimit, which is
            // async-signal-safe, between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let rl = libc::rlimit { rlim_cur: n, rlim_max: n };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &rl) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                })
            };
        }
        let child = cmd.spawn().expect("start vgpu-mediatord");
        let m = Mediator { child, run_dir, on_test_driver: false };
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(m.api_path()).is_err() {
            assert!(Instant::now() < deadline, "mediator API did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    pub fn api_path(&self) -> PathBuf {
        self.run_dir.join("api.sock")
    }

    /// Calls the REST API; returns status and parsed JSON (or the raw text).
    pub fn api(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let b = body.map(|b| b.to_string());
        let r = vgpu_api::http::request(&self.api_path(), method, path, b.as_deref().map(str::as_bytes)).expect("api request");
        let v = serde_json::from_slice(&r.body).unwrap_or(Value::String(r.text()));
        (r.status, v)
    }

    pub fn tenant(&self, name: &str, memory: &str) -> PathBuf {
        let (st, v) = self.api("POST", "/tenants", Some(serde_json::json!({ "name": name, "memory": memory })));
        assert_eq!(st, 201, "creating {name}: {v}");
        PathBuf::from(v["socket"].as_str().expect("socket"))
    }

    pub fn metrics(&self) -> String {
        vgpu_api::http::request(&self.api_path(), "GET", "/metrics", None).expect("metrics").text()
    }

    /// A metric's value for the series whose labels start with `labels`,
    /// e.g. `tenant="a",device="cpu0"` (the device's uuid and model follow).
    pub fn metric(&self, name: &str, labels: &str) -> Option<f64> {
        metric_in(&self.metrics(), name, labels)
    }

    pub fn device(&self, name: &str) -> Value {
        let (_, v) = self.api("GET", "/devices", None);
        v.as_array().and_then(|a| a.iter().find(|d| d["name"] == name).cloned()).expect("device")
    }

    pub fn vgpuctl(&self) -> Command {
        let mut c = Command::new(bin("vgpuctl"));
        c.arg("--run-dir").arg(&self.run_dir);
        c
    }
}

impl Drop for Mediator {
    fn drop(&mut self) {
        // SAFETY: signals our own child process.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

/// A raw protocol connection, for driving the wire format directly.
pub struct Raw {
    pub s: UnixStream,
    seq: u32,
}

impl Raw {
    pub fn connect(socket: &Path) -> Raw {
        let s = UnixStream::connect(socket).expect("connect tenant socket");
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        Raw { s, seq: 0 }
    }

    pub fn send_bytes(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.s.write_all(b)
    }

    /// Reads one reply: None when the peer closed the connection.
    pub fn read_reply(&mut self) -> Option<(MsgHeader, Reply)> {
        let mut h = [0u8; MsgHeader::SIZE];
        self.s.read_exact(&mut h).ok()?;
        let hdr = MsgHeader::decode(&h).expect("daemon sent a bad header");
        let mut p = vec![0u8; hdr.payload_len as usize];
        self.s.read_exact(&mut p).ok()?;
        let r = Reply::decode_payload(hdr.opcode(), hdr.status, &p).expect("daemon sent a bad reply");
        Some((hdr, r))
    }

    pub fn call(&mut self, req: Request) -> Reply {
        self.seq += 1;
        self.send_bytes(&req.encode(self.seq)).expect("send");
        let (h, r) = self.read_reply().expect("reply");
        assert_eq!(h.seq, self.seq);
        r
    }

    /// Advances the sequence number for a message sent by hand.
    pub fn seq_bump(&mut self) {
        self.seq += 1;
    }

    pub fn ping(&mut self) -> bool {
        self.seq += 1;
        self.send_bytes(&Request::Ping.encode(self.seq)).is_ok() && matches!(self.read_reply(), Some((h, Reply::Empty)) if h.opcode() == Opcode::Ping)
    }
}
/// A fake sysfs tree of a host with `nodes` NUMA nodes, under `root`.
/// Every node lists CPU 0, which exists everywhere, so workers pinned to
/// any node still run.
pub fn fake_numa_host(root: &Path, nodes: u32) {
    let _ = std::fs::remove_dir_all(root);
    for n in 0..nodes {
        let dir = root.join(format!("devices/system/node/node{n}"));
        std::fs::create_dir_all(&dir).expect("fake node dir");
        std::fs::write(dir.join("cpulist"), "0\n").expect("fake cpulist");
    }
}

pub mod k8s;
pub mod nested;
pub mod vmm_harness;

/// What `vgpu-mediatord discover` reports, or why there is no GPU here.
pub fn discover_gpus() -> Result<Value, String> {
    discover_with(&[])
}

/// What `vgpu-mediatord discover` reports with `env` set (the test
/// double of NVIDIA's driver), or why there is no GPU.
pub fn discover_with(env: &[(&'static str, std::ffi::OsString)]) -> Result<Value, String> {
    let mut c = Command::new(bin("vgpu-mediatord"));
    c.arg("discover").envs(env.iter().map(|(k, v)| (k, v)));
    let out = c.output().map_err(|e| format!("running vgpu-mediatord discover: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.trim().trim_start_matches("vgpu-mediatord: error: ").to_string());
    }
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("discover printed bad JSON: {e}"))?;
    if v["devices"].as_array().is_none_or(|d| d.is_empty()) {
        return Err(format!("NVML lists no servable GPU or MIG instance: {}", v["skipped"]));
    }
    Ok(v)
}

/// The GPUs the test double plays: one whole GPU of 8 GiB.
pub const TEST_DRIVER_GPUS: &str = "8GiB";

/// A folder holding `libcuda.so.1` and `libnvidia-ml.so.1` as the test
/// double of NVIDIA's driver (the `vgpu-testdriver` crate, built with the
/// workspace), for `LD_LIBRARY_PATH`; None where it was not built.
pub fn test_driver_dir() -> Option<PathBuf> {
    let so = bin_dir().join("libvgpu_testdriver.so");
    if !so.exists() {
        return None;
    }
    let dir = bin_dir().join("testdriver");
    std::fs::create_dir_all(&dir).ok()?;
    for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"] {
        let link = dir.join(name);
        if link.exists() {
            continue;
        }
        // Tests race to make the links: one that lost finds them made.
        if let Err(e) = std::os::unix::fs::symlink(&so, &link) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return None;
            }
        }
    }
    Some(dir)
}

/// The environment that makes a process load the test double.
pub fn test_driver_env(dir: &Path) -> Vec<(&'static str, std::ffi::OsString)> {
    vec![("LD_LIBRARY_PATH", dir.as_os_str().to_owned()), ("VGPU_TESTDRIVER_GPUS", TEST_DRIVER_GPUS.into())]
}

/// A mediator serving only this machine's NVIDIA GPUs, and the name of
/// the first one. On a machine without one, the same mediator over the
/// test double of NVIDIA's driver (`vgpu-testdriver`: the driver's
/// per-process semantics as measured on an H100, kernels on the PTX
/// interpreter), said loudly; None, after saying so, where that is not
/// built either.
pub fn gpu_mediator(test: &str, extra: &[&str]) -> Option<(Mediator, String)> {
    let (v, env) = match discover_gpus() {
        Ok(v) => (v, Vec::new()),
        Err(why) => {
            let Some(dir) = test_driver_dir() else {
                report_skip(test, &format!("no NVIDIA GPU on this machine ({why}) and no test driver built; run it on a GPU machine: cargo test --release -p vgpu-tests --test gpu_cuda"));
                return None;
            };
            let env = test_driver_env(&dir);
            match discover_with(&env) {
                Ok(v) => {
                    eprintln!("\n*** {test}: no NVIDIA GPU here ({why}): running on the test double of NVIDIA's driver ({})\n", dir.display());
                    (v, env)
                }
                Err(e) => panic!("the test double of NVIDIA's driver in {} does not answer discovery: {e}", dir.display()),
            }
        }
    };
    let name = v["devices"][0]["name"].as_str().expect("device name").to_string();
    Some((Mediator::start_with_env(&gpu_args(extra), env), name))
}

/// A [`gpu_mediator`]'s flags. Every tenant in an executor of its own: on
/// NVIDIA's driver the process is what isolates address spaces and faults.
fn gpu_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--cuda", "required", "--cpu-devices", "0", "--isolation", "process"];
    args.extend_from_slice(extra);
    args
}

impl Mediator {
    /// Kills a [`gpu_mediator`] (SIGKILL: no clean shutdown) and starts a
    /// new one on its run directory, with `extra` flags, on the same GPUs
    /// or test double.
    pub fn kill_and_restart_gpu(&mut self, extra: &[&str]) {
        let env = if self.on_test_driver { test_driver_dir().map(|d| test_driver_env(&d)).unwrap_or_default() } else { Vec::new() };
        self.stop_with(libc::SIGKILL);
        let _ = std::fs::remove_file(self.api_path());
        let on_test_driver = self.on_test_driver;
        let mut fresh = Self::spawn_in(self.run_dir.clone(), &gpu_args(extra), Spawn { env, ..Spawn::default() });
        fresh.on_test_driver = on_test_driver;
        // The old handle must not clean the run directory up.
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old);
    }
}

/// The value of the series `name` whose labels start with `labels` in a
/// Prometheus text exposition.
pub fn metric_in(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = format!("{name}{{{labels}");
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(&key)?;
        let rest = if let Some(r) = rest.strip_prefix('}') { r } else { rest.strip_prefix(',')?.split_once("} ")?.1 };
        rest.trim().parse().ok()
    })
}

impl Mediator {
    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Creates a tenant on a named device.
    pub fn tenant_on(&self, name: &str, memory: &str, device: &str) -> PathBuf {
        let (st, v) = self.api("POST", "/tenants", Some(serde_json::json!({ "name": name, "memory": memory, "device": device })));
        assert_eq!(st, 201, "creating {name} on {device}: {v}");
        PathBuf::from(v["socket"].as_str().expect("socket"))
    }
}

/// Says loudly that a test skipped and why: on stderr, and in
/// `target/<profile>/skipped-tests.txt`, which scripts/test.sh prints after
/// the run (libtest shows a passing test's stderr only with --nocapture).
pub fn report_skip(test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {why}");
    eprintln!("\n*** {line}\n");
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(bin_dir().join("skipped-tests.txt")) {
        // One write per line: O_APPEND keeps concurrent tests' lines whole.
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

/// Checks the CPU-device and GPU tests share, so both devices pass the same ones.
pub mod checks {
    use std::io::{BufRead, BufReader, Write};
    use std::path::Path;
    use std::process::Stdio;

    use super::{run_ok, sample};

    /// vectorAdd, matrixMul and reduction with the given arguments, all at
    /// once for every tenant; each must report PASSED.
    pub fn samples_concurrently(sockets: &[&Path], vector_n: &str, matrix_n: &str) {
        let mut jobs = Vec::new();
        for sock in sockets {
            for (prog, args) in [("vectorAdd", vec![vector_n]), ("matrixMul", vec![matrix_n]), ("reduction", vec![])] {
                let mut c = sample(prog, sock);
                c.args(&args);
                jobs.push((prog, std::thread::spawn(move || run_ok(c))));
            }
        }
        for (prog, j) in jobs {
            let out = j.join().expect("job thread");
            assert!(out.contains(&format!("{prog}: PASSED")), "{prog}: {out}");
        }
    }

    /// The owner holds a pattern; the thief uses the owner's pointer in
    /// copies, a memset and a kernel. Returns the thief's report after
    /// checking that the owner's data is intact and nothing leaked.
    pub fn steal_from(owner: &Path, thief: &Path) -> String {
        let mut holder = sample("tenant_probe", owner);
        holder.args(["hold", "4096"]).stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = holder.spawn().expect("spawn holder");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("ptr line");
        let ptr = line.trim().strip_prefix("ptr=").expect("ptr").to_string();
        let mut c = sample("tenant_probe", thief);
        c.args(["steal", &ptr]);
        let got = run_ok(c);
        assert!(got.contains("leaked=0"), "{got}");
        child.stdin.take().expect("stdin").write_all(b"go\n").expect("release holder");
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).expect("holder output");
        assert!(child.wait().expect("wait").success(), "{rest}");
        assert!(rest.contains("intact=4096"), "the owner's data changed: {rest}");
        got
    }
}

/// What /proc says of a process: the figures the tenant-proofing bounds
/// are stated in.
#[derive(Debug, Clone, Copy)]
pub struct ProcStats {
    pub rss_kib: u64,
    pub threads: u64,
    pub fds: usize,
    pub uid: u32,
    /// 2 under a seccomp filter.
    pub seccomp: u32,
    pub no_new_privs: u32,
    /// User plus system CPU time, in clock ticks.
    pub cpu_ticks: u64,
}

pub fn proc_stats(pid: u32) -> ProcStats {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let field = |name: &str| -> u64 { status.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse().ok()).unwrap_or(0) };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let tick = |i: usize| rest.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    ProcStats {
        rss_kib: field("VmRSS:"),
        threads: field("Threads:"),
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0),
        uid: field("Uid:") as u32,
        seccomp: field("Seccomp:") as u32,
        no_new_privs: field("NoNewPrivs:") as u32,
        cpu_ticks: tick(11) + tick(12),
    }
}

impl Mediator {
    /// The pid of the worker serving `device`.
    pub fn worker_pid(&self, device: &str) -> u32 {
        let pid = self.device(device)["worker_pid"].as_u64().expect("worker_pid") as u32;
        assert_ne!(pid, 0, "worker of {device} is not running");
        pid
    }

    /// The process that holds `tenant`'s state on `device`: its executor
    /// under process isolation, else the device's worker.
    pub fn serving_pid(&self, device: &str, tenant: &str) -> u32 {
        let d = self.device(device);
        if d["isolation"] != "process" {
            return self.worker_pid(device);
        }
        let pid = d["executors"].as_array().and_then(|v| v.iter().find(|e| e["tenant"] == tenant)).and_then(|e| e["pid"].as_u64());
        pid.unwrap_or_else(|| panic!("no executor for tenant {tenant} on {device}: {d}")) as u32
    }

    /// Creates a tenant from a full description; returns its record.
    pub fn tenant_with(&self, spec: Value) -> Value {
        let (st, v) = self.api("POST", "/tenants", Some(spec.clone()));
        assert_eq!(st, 201, "creating {spec}: {v}");
        v
    }
}

/// Sends `buf` with `fds` attached (SCM_RIGHTS).
pub fn send_with_fds(s: &UnixStream, buf: &[u8], fds: &[i32]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut iov = libc::iovec { iov_base: buf.as_ptr() as *mut _, iov_len: buf.len() };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is a valid initial value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one cmsghdr with room for `fds`;
    // the iovec covers `buf`.
    let rc = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<i32>(), fds.len());
        libc::sendmsg(s.as_raw_fd(), &msg, 0)
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Calls that drive the compute protocol directly, for hostile tests.
impl Raw {
    pub fn handle(r: Reply) -> u32 {
        match r {
            Reply::Handle(h) => h,
            other => panic!("expected a handle, got {other:?}"),
        }
    }

    pub fn ctx(&mut self) -> u32 {
        Self::handle(self.call(Request::CtxCreate(virtio_gpu_compute::CtxCreateReq { flags: 0, pid: 0 })))
    }

    pub fn load(&mut self, ctx: u32, ptx: &str) -> Reply {
        let img = ptx.as_bytes().to_vec();
        self.call(Request::ModuleLoad(virtio_gpu_compute::ModuleLoadReq { ctx, format: 0, image_len: img.len() as u64 }, img))
    }

    pub fn function(&mut self, ctx: u32, module: u32, name: &str) -> Reply {
        self.call(Request::ModuleGetFunction(virtio_gpu_compute::GetFunctionReq { ctx, module, name_len: name.len() as u32, reserved: 0 }, name.to_string()))
    }

    pub fn launch(&mut self, ctx: u32, func: u32, grid: [u32; 3], block: [u32; 3], params: &[u8]) -> Reply {
        let req = virtio_gpu_compute::LaunchReq { ctx, func, stream: 0, shared_bytes: 0, grid, block, params_len: params.len() as u32, reserved: 0 };
        self.call(Request::LaunchKernel(req, params.to_vec()))
    }

    pub fn event(&mut self, ctx: u32) -> Reply {
        self.call(Request::EventCreate(virtio_gpu_compute::ObjCreateReq { ctx, flags: 0 }))
    }
}

/// A PTX entry `name(.param .u64 out)` whose threads each use `bytes`
/// (at least 256) of local memory: an array indexed by thread id, each
/// thread storing one slot and reading another, so a GPU's compiler keeps
/// it in local memory. Without the module header.
pub fn local_memory_kernel(name: &str, bytes: u32) -> String {
    format!(
        ".visible .entry {name}(.param .u64 out)\n{{\n .local .align 8 .b8 buf[{bytes}];\n .reg .b64 %rd<6>;\n .reg .b32 %r<3>;\n mov.u32 %r1, %tid.x;\n and.b32 %r1, %r1, 31;\n xor.b32 %r2, %r1, 1;\n mov.u64 %rd1, buf;\n mul.wide.u32 %rd2, %r1, 8;\n add.u64 %rd2, %rd1, %rd2;\n cvt.u64.u32 %rd3, %r1;\n st.local.u64 [%rd2], %rd3;\n mul.wide.u32 %rd4, %r2, 8;\n add.u64 %rd4, %rd1, %rd4;\n ld.local.u64 %rd5, [%rd4];\n ld.param.u64 %rd1, [out];\n st.global.u64 [%rd1], %rd5;\n ret;\n}}\n"
    )
}

/// The misbehaving kernels of samples/kernels/faults.ptx.
pub fn faults_ptx() -> String {
    std::fs::read_to_string(workspace().join("samples/kernels/faults.ptx")).expect("faults.ptx")
}

/// Saturating tenants with weights on one device, for the fair-share
/// benchmark (share-bench) and tests/tests/scheduling.rs.
pub mod shares {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use ::cuda::client::Client;
    use serde_json::{json, Value};
    use virtio_gpu_compute::*;

    use crate::Mediator;

    const SPIN: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry spin(.param .u32 n)\n{\n .reg .b32 %r<4>;\n .reg .pred %p<2>;\n ld.param.u32 %r1, [n];\n mov.u32 %r2, 0;\nLOOP:\n add.u32 %r2, %r2, 1;\n setp.lt.u32 %p1, %r2, %r1;\n @%p1 bra LOOP;\n ret;\n}\n\0";

    fn tenant_ns(c: &Client) -> u64 {
        match c.call(Request::GetTenantInfo).expect("tenant info") {
            Reply::TenantInfo(t) => t.device_ns,
            r => panic!("{r:?}"),
        }
    }

    /// A connection with the spin kernel loaded: launches of `iters` loop
    /// turns over `grid` blocks of 32 threads.
    pub struct Spinner {
        pub c: Client,
        req: LaunchReq,
    }

    impl Spinner {
        /// The context the kernel was loaded in.
        pub fn ctx(&self) -> u32 {
            self.req.ctx
        }

        pub fn new(sock: &str, grid: u32) -> Spinner {
            let c = Client::connect_unix(sock).expect("connect");
            let (ctx, f) = context_with_kernel(&c, SPIN, "spin");
            let req = LaunchReq { ctx, func: f, stream: 0, shared_bytes: 0, grid: [grid, 1, 1], block: [32, 1, 1], params_len: 4, reserved: 0 };
            Spinner { c, req }
        }

        pub fn launch(&self, iters: u32) -> u64 {
            self.c.enqueue(Request::LaunchKernel(self.req, iters.to_le_bytes().to_vec())).expect("launch")
        }

        /// One launch, waited for: its latency from submission to completion.
        pub fn timed(&self, iters: u32) -> Duration {
            let t = Instant::now();
            let seq = self.launch(iters);
            self.c.wait(seq).expect("sync");
            t.elapsed()
        }
    }

    /// Like [`saturate`], but ends quietly when the device goes away (a
    /// worker killed under load).
    pub fn saturate_until_lost(sock: &str, iters: u32, stop: Arc<AtomicBool>) {
        let Ok(c) = std::panic::catch_unwind(|| Spinner::new(sock, 1)) else { return };
        while !stop.load(Ordering::Relaxed) {
            let seq = c.launch(iters);
            if c.c.wait(seq).is_err() {
                return;
            }
        }
    }

    /// One thread's loop until `stop`: launches of `iters` loop turns over
    /// `grid` blocks, four always queued (as asynchronous cuLaunchKernel
    /// calls leave them), the oldest waited for before the next is queued.
    pub fn saturate(sock: &str, iters: u32, grid: u32, stop: Arc<AtomicBool>) {
        let s = Spinner::new(sock, grid);
        let mut queued: std::collections::VecDeque<u64> = (0..4).map(|_| s.launch(iters)).collect();
        while !stop.load(Ordering::Relaxed) {
            if let Some(oldest) = queued.pop_front() {
                s.c.wait(oldest).expect("sync");
            }
            queued.push_back(s.launch(iters));
        }
        for seq in queued {
            s.c.wait(seq).expect("sync");
        }
    }

    /// What tenants used in a measurement window.
    pub struct Window {
        /// Device time each tenant used, in ns.
        pub used: Vec<f64>,
        pub wall: Duration,
        /// The device's lanes: its capacity is `lanes × wall`.
        pub lanes: usize,
    }

    impl Window {
        /// Each tenant's share of the device time used.
        pub fn shares(&self) -> Vec<f64> {
            let total: f64 = self.used.iter().sum();
            self.used.iter().map(|u| u / total).collect()
        }

        /// Each tenant's share of the device's capacity in the window.
        pub fn of_capacity(&self) -> Vec<f64> {
            let cap = self.wall.as_nanos() as f64 * self.lanes as f64;
            self.used.iter().map(|u| u / cap).collect()
        }
    }

    /// Lanes of the mediator's first device.
    /// A new context on `c` with `ptx` loaded, and the handle of its
    /// kernel `name`.
    pub fn context_with_kernel(c: &Client, ptx: &str, name: &str) -> (u32, u32) {
        let ctx = c.handle(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })).expect("ctx");
        let img = ptx.as_bytes().to_vec();
        let m = c.handle(Request::ModuleLoad(ModuleLoadReq { ctx, format: 0, image_len: img.len() as u64 }, img)).expect("load");
        match c.call(Request::ModuleGetFunction(GetFunctionReq { ctx, module: m, name_len: name.len() as u32, reserved: 0 }, name.into())).expect("function") {
            Reply::Function(f, _) => (ctx, f.func),
            r => panic!("{r:?}"),
        }
    }

    pub fn lanes(m: &Mediator) -> usize {
        let (_, v) = m.api("GET", "/devices", None);
        v[0]["lanes"].as_u64().expect("lanes") as usize
    }

    /// Creates the tenants `specs` (POST /tenants bodies), saturates each
    /// from two threads, and measures a window of `secs` after half a
    /// second of warm-up.
    pub fn measure_specs(m: &Mediator, specs: &[Value], secs: f64, iters: u32) -> Window {
        let socks: Vec<String> = specs.iter().map(|sp| m.tenant_with(sp.clone())["socket"].as_str().expect("socket").to_string()).collect();
        Window { lanes: lanes(m), ..measure_sockets(&socks, secs, iters) }
    }

    /// Saturates the tenants at `socks` from two threads each and measures
    /// what each used in a window of `secs` after half a second of warm-up
    /// (`lanes` left 0: the caller knows the device).
    pub fn measure_sockets(socks: &[String], secs: f64, iters: u32) -> Window {
        let probes: Vec<Client> = socks.iter().map(|s| Client::connect_unix(s).expect("connect")).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = socks
            .iter()
            .flat_map(|s| [s.clone(), s.clone()])
            .map(|s| {
                let stop = stop.clone();
                std::thread::spawn(move || saturate(&s, iters, 1, stop))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let before: Vec<u64> = probes.iter().map(tenant_ns).collect();
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        let after: Vec<u64> = probes.iter().map(tenant_ns).collect();
        let wall = t0.elapsed();
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().expect("thread");
        }
        Window { used: before.iter().zip(&after).map(|(b, a)| (a - b) as f64).collect(), wall, lanes: 0 }
    }

    /// Weights 1:3, then 1:1:2:4, saturating `m`'s device: each share
    /// within `tol` of its weight's.
    pub fn assert_weights_hold(m: &Mediator, tol: f64) {
        let (got, _) = measure(m, "w", &[1, 3], 1.5, 20_000);
        assert!((got[0] - 0.25).abs() < tol && (got[1] - 0.75).abs() < tol, "1:3 gave {got:?}");
        let (got, _) = measure(m, "v", &[1, 1, 2, 4], 1.5, 20_000);
        for (g, want) in got.iter().zip([0.125, 0.125, 0.25, 0.5]) {
            assert!((g - want).abs() < tol, "1:1:2:4 gave {got:?}");
        }
    }

    /// Tenants `TAG0..` with `weights`: each one's share of the device time
    /// used in the window, and that device time.
    pub fn measure(m: &Mediator, tag: &str, weights: &[u32], secs: f64, iters: u32) -> (Vec<f64>, Duration) {
        let specs: Vec<Value> = weights.iter().enumerate().map(|(i, w)| json!({"name": format!("{tag}{i}"), "memory": "16MiB", "weight": w})).collect();
        let w = measure_specs(m, &specs, secs, iters);
        (w.shares(), Duration::from_nanos(w.used.iter().sum::<f64>() as u64))
    }

    /// The percentile `p` (0..=100) of `v`.
    pub fn percentile(v: &[Duration], p: f64) -> Duration {
        let mut s = v.to_vec();
        s.sort();
        s[((s.len() - 1) as f64 * p / 100.0).round() as usize]
    }

    /// Latencies of `n` short launches (`iters` turns, one block) by the
    /// tenant at `victim`, one at a time; with `aggressor`, while that
    /// tenant floods launches of `long_iters` turns over `grid` blocks
    /// from two threads.
    pub fn victim_latencies(victim: &str, n: usize, iters: u32, aggressor: Option<(&str, u32, u32)>) -> Vec<Duration> {
        let stop = Arc::new(AtomicBool::new(false));
        let flood: Vec<_> = aggressor
            .into_iter()
            .flat_map(|(sock, long, grid)| [(sock.to_string(), long, grid), (sock.to_string(), long, grid)])
            .map(|(sock, long, grid)| {
                let stop = stop.clone();
                std::thread::spawn(move || saturate(&sock, long, grid, stop))
            })
            .collect();
        let v = Spinner::new(victim, 1);
        // Warm-up, and for the flood to be under way.
        for _ in 0..20 {
            v.timed(iters);
        }
        let got: Vec<Duration> = (0..n).map(|_| v.timed(iters)).collect();
        stop.store(true, Ordering::Relaxed);
        for t in flood {
            t.join().expect("aggressor thread");
        }
        got
    }
}
