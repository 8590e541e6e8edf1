//! The control plane: starts one worker process per device, restarts a
//! worker that dies (re-creating its tenants), places tenants and keeps the
//! registry the REST API serves.

pub mod api;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tracing::{error, info, warn};

use crate::config::TenantSpec;
use crate::ipc::{DeviceStats, WorkerCmd, WorkerMsg};
use crate::size::Size;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    InsufficientMemory(String),
    #[error("device worker {0} is unavailable (restarting)")]
    WorkerDown(String),
    #[error("device worker error: {0}")]
    Worker(String),
}

pub struct DeviceSpec {
    pub name: String,
    pub ordinal: u32,
    /// Memory tenants may be placed into.
    pub memory: u64,
    pub budget: u64,
    pub lanes: u32,
    /// Set for an NVIDIA GPU or MIG instance; None for a CPU device.
    pub cuda: Option<CudaSpec>,
}

/// How a `cuda` worker finds its device.
#[derive(Debug, Clone)]
pub struct CudaSpec {
    /// `CUDA_VISIBLE_DEVICES` for the worker: the GPU or MIG UUID.
    pub visible_devices: String,
    pub numa_node: i32,
    pub launch_timeout_ms: u64,
}

impl DeviceSpec {
    pub fn kind(&self) -> &'static str {
        if self.cuda.is_some() { "cuda" } else { "cpu" }
    }
}

struct WorkerConn {
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

pub struct DeviceSlot {
    pub spec: DeviceSpec,
    conn: Mutex<Option<WorkerConn>>,
    pub pid: AtomicU32,
    pub restarts: AtomicU64,
}

impl DeviceSlot {
    fn call(&self, cmd: &WorkerCmd) -> Result<WorkerMsg, ControlError> {
        let mut g = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let c = g.as_mut().ok_or_else(|| ControlError::WorkerDown(self.spec.name.clone()))?;
        let mut line = serde_json::to_string(cmd).map_err(|e| ControlError::Worker(e.to_string()))?;
        line.push('\n');
        let mut reply = String::new();
        let io = c.stdin.write_all(line.as_bytes()).and_then(|_| c.stdin.flush()).and_then(|_| c.stdout.read_line(&mut reply));
        match io {
            Ok(n) if n > 0 => serde_json::from_str(&reply).map_err(|e| ControlError::Worker(format!("bad reply: {e}"))),
            _ => {
                *g = None;
                Err(ControlError::WorkerDown(self.spec.name.clone()))
            }
        }
    }

    pub fn is_up(&self) -> bool {
        self.conn.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    pub fn stats(&self) -> Option<DeviceStats> {
        match self.call(&WorkerCmd::Stats) {
            Ok(WorkerMsg::Stats(s)) => Some(s),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TenantRecord {
    pub name: String,
    pub kind: &'static str,
    pub memory: u64,
    pub weight: u32,
    pub device: String,
    pub socket: PathBuf,
}

pub struct Control {
    pub run_dir: PathBuf,
    exe: PathBuf,
    pub devices: Vec<Arc<DeviceSlot>>,
    tenants: Mutex<BTreeMap<String, TenantRecord>>,
    stopping: AtomicBool,
}

impl Control {
    pub fn new(run_dir: &Path, exe: PathBuf, devices: Vec<DeviceSpec>) -> Arc<Control> {
        Arc::new(Control {
            run_dir: run_dir.to_path_buf(),
            exe,
            devices: devices.into_iter().map(|spec| Arc::new(DeviceSlot { spec, conn: Mutex::new(None), pid: AtomicU32::new(0), restarts: AtomicU64::new(0) })).collect(),
            tenants: Mutex::new(BTreeMap::new()),
            stopping: AtomicBool::new(false),
        })
    }

    /// Starts every worker and a supervisor thread for each; returns once
    /// all workers are up (or failed their first start).
    pub fn start(self: &Arc<Self>) -> Result<(), String> {
        for slot in &self.devices {
            let (child, conn, pid) = spawn_worker(&self.exe, &slot.spec).map_err(|e| format!("starting worker for {}: {e}", slot.spec.name))?;
            *slot.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
            slot.pid.store(pid, Ordering::Relaxed);
            let (me, slot) = (self.clone(), slot.clone());
            std::thread::Builder::new().name(format!("supervise-{}", slot.spec.name)).spawn(move || me.supervise(slot, child)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn supervise(self: Arc<Self>, slot: Arc<DeviceSlot>, mut child: Child) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let status = child.wait();
            *slot.conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
            slot.pid.store(0, Ordering::Relaxed);
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            warn!(device = %slot.spec.name, ?status, "device worker exited; its tenants lost their connections; restarting");
            slot.restarts.fetch_add(1, Ordering::Relaxed);
            loop {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
                match spawn_worker(&self.exe, &slot.spec) {
                    Ok((c, conn, pid)) => {
                        child = c;
                        // Hold the registry while the worker is re-populated
                        // so a concurrent create or delete cannot interleave.
                        let tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
                        *slot.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
                        slot.pid.store(pid, Ordering::Relaxed);
                        for t in tenants.values().filter(|t| t.device == slot.spec.name) {
                            if let Err(e) = add_on_worker(&slot, t) {
                                error!(device = %slot.spec.name, tenant = %t.name, "re-creating tenant after restart failed: {e}");
                            }
                        }
                        info!(device = %slot.spec.name, pid, "device worker restarted");
                        backoff = Duration::from_millis(50);
                        break;
                    }
                    Err(e) => error!(device = %slot.spec.name, "restarting worker failed: {e}"),
                }
            }
        }
    }

    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        for slot in &self.devices {
            let pid = slot.pid.load(Ordering::Relaxed);
            if pid != 0 {
                // SAFETY: kill only sends a signal to our own child process.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
        }
        for t in self.tenants.lock().unwrap_or_else(|e| e.into_inner()).values() {
            let _ = std::fs::remove_file(&t.socket);
        }
    }

    pub fn tenants(&self) -> Vec<TenantRecord> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    pub fn tenant(&self, name: &str) -> Option<TenantRecord> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    pub fn slot(&self, name: &str) -> Option<&Arc<DeviceSlot>> {
        self.devices.iter().find(|d| d.spec.name == name)
    }

    fn reserved(tenants: &BTreeMap<String, TenantRecord>, device: &str) -> u64 {
        tenants.values().filter(|t| t.device == device).map(|t| t.memory).sum()
    }

    /// Creates a tenant: validates, places it (quotas never exceed device
    /// memory), and has the device worker open its socket.
    pub fn create_tenant(&self, spec: &TenantSpec) -> Result<TenantRecord, ControlError> {
        spec.validate().map_err(ControlError::BadRequest)?;
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if tenants.contains_key(&spec.name) {
            return Err(ControlError::Conflict(format!("tenant {} already exists", spec.name)));
        }
        let slot = match &spec.device {
            Some(d) => {
                let s = self.slot(d).ok_or_else(|| ControlError::BadRequest(format!("no device named {d}")))?;
                let free = s.spec.memory - Self::reserved(&tenants, d).min(s.spec.memory);
                if spec.memory.0 > free {
                    return Err(ControlError::InsufficientMemory(format!("device {d} has {} unreserved; {} requested", Size(free), spec.memory)));
                }
                s
            }
            None => self
                .devices
                .iter()
                .map(|s| (s, s.spec.memory.saturating_sub(Self::reserved(&tenants, &s.spec.name))))
                .filter(|(_, free)| *free >= spec.memory.0)
                .max_by_key(|(s, free)| (*free, std::cmp::Reverse(s.spec.ordinal)))
                .map(|(s, _)| s)
                .ok_or_else(|| ControlError::InsufficientMemory(format!("no device has {} of unreserved memory", spec.memory)))?,
        };
        let vm = spec.kind == crate::config::TenantKind::Vm;
        let socket = match vm {
            true => crate::gpu::vhost::socket_path(&self.run_dir.join("tenants"), &spec.name),
            false => self.run_dir.join("tenants").join(format!("{}.sock", spec.name)),
        };
        if socket.as_os_str().len() >= 108 {
            return Err(ControlError::BadRequest(format!("socket path {} is too long for a unix socket; use a shorter run dir or name", socket.display())));
        }
        let rec = TenantRecord { name: spec.name.clone(), kind: if vm { "vm" } else { "process" }, memory: spec.memory.0, weight: spec.weight, device: slot.spec.name.clone(), socket };
        add_on_worker(slot, &rec)?;
        tenants.insert(rec.name.clone(), rec.clone());
        info!(tenant = %rec.name, device = %rec.device, quota = rec.memory, "tenant created");
        Ok(rec)
    }

    pub fn delete_tenant(&self, name: &str) -> Result<(), ControlError> {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let rec = tenants.get(name).ok_or_else(|| ControlError::NotFound(format!("no tenant {name}")))?;
        if let Some(slot) = self.slot(&rec.device) {
            match slot.call(&WorkerCmd::RemoveTenant { name: name.to_string() }) {
                // A worker that is down holds nothing; the record can go.
                Ok(_) | Err(ControlError::WorkerDown(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let _ = std::fs::remove_file(&rec.socket);
        tenants.remove(name);
        info!(tenant = name, "tenant deleted");
        Ok(())
    }
}

fn add_on_worker(slot: &DeviceSlot, t: &TenantRecord) -> Result<(), ControlError> {
    let vm = t.kind == "vm";
    match slot.call(&WorkerCmd::AddTenant { name: t.name.clone(), quota: t.memory, weight: t.weight, socket: t.socket.clone(), vm })? {
        WorkerMsg::Ok => Ok(()),
        WorkerMsg::Err(e) => Err(ControlError::Worker(e)),
        other => Err(ControlError::Worker(format!("unexpected reply {other:?}"))),
    }
}

fn spawn_worker(exe: &Path, spec: &DeviceSpec) -> std::io::Result<(Child, WorkerConn, u32)> {
    let mut child = Command::new(exe)
        .arg("worker")
        .arg("--ordinal")
        .arg(spec.ordinal.to_string())
        .arg("--memory")
        .arg(spec.memory.to_string())
        .arg("--budget")
        .arg(spec.budget.to_string())
        .arg("--lanes")
        .arg(spec.lanes.to_string())
        .args(match &spec.cuda {
            Some(c) => vec!["--backend".to_string(), "cuda".into(), "--numa-node".into(), c.numa_node.to_string(), "--launch-timeout-ms".into(), c.launch_timeout_ms.to_string()],
            None => Vec::new(),
        })
        // A GPU worker sees exactly its GPU or MIG instance, as device 0,
        // from before cuInit; a CPU worker sees none.
        .env("CUDA_VISIBLE_DEVICES", spec.cuda.as_ref().map(|c| c.visible_devices.as_str()).unwrap_or(""))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdin = child.stdin.take().ok_or_else(|| std::io::Error::other("no worker stdin"))?;
    let mut stdout = BufReader::new(child.stdout.take().ok_or_else(|| std::io::Error::other("no worker stdout"))?);
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    match serde_json::from_str::<WorkerMsg>(&line) {
        Ok(WorkerMsg::Ready { pid }) => Ok((child, WorkerConn { stdin, stdout }, pid)),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            Err(std::io::Error::other(format!("worker did not report ready (got {line:?})")))
        }
    }
}
