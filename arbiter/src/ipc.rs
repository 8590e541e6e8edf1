//! Messages between the control plane and a device worker: one JSON object
//! per line over the worker's stdin (commands) and stdout (replies).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::sched::{Priority, Share};

/// A command line: `id` pairs it with its reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CmdLine {
    pub id: u64,
    pub cmd: WorkerCmd,
}

/// A reply line (the `id` of its command) or an event (`id` 0).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MsgLine {
    pub id: u64,
    pub msg: WorkerMsg,
}

/// A tenant as the worker serves it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantCmd {
    pub name: String,
    pub quota: u64,
    pub weight: u32,
    /// Hard cap, percent of the device's lane time.
    #[serde(default)]
    pub cap: Option<u32>,
    #[serde(default)]
    pub priority: Priority,
    pub socket: PathBuf,
    /// Serve the socket as a VM's vhost-user virtio-gpu backend.
    #[serde(default)]
    pub vm: bool,
    /// Host memory the tenant's objects may keep in the worker.
    pub host_limit: u64,
    /// Most client connections the tenant may hold open at once.
    pub max_connections: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WorkerCmd {
    AddTenant(TenantCmd),
    /// Revokes the tenant at once and replies; its teardown finishes in the
    /// background and is reported with a `Removed` event.
    RemoveTenant {
        name: String,
    },
    /// Changes a tenant's scheduling parameters and quota live.
    SetTenant {
        name: String,
        share: Option<Share>,
        quota: Option<u64>,
    },
    Stats,
    /// An executor stops accepting its tenant's clients if it serves none:
    /// `Ok` once it accepts no more (new clients wait in the socket's
    /// backlog for the process that replaces it), `Err` if it serves some
    /// (it keeps accepting). Atomic with its accepts: no client is taken
    /// between the look and the stop.
    RetireIfIdle {
        name: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WorkerMsg {
    Ready {
        pid: u32,
    },
    Ok,
    Err(String),
    Stats(DeviceStats),
    /// Event: the tenant's memory is released and its quota may be reused.
    Removed {
        name: String,
    },
    /// Event: an executor met an error its device state cannot recover
    /// from and is about to end (crate::fatal).
    Fatal {
        why: String,
    },
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeviceStats {
    pub kind: String,
    pub name: String,
    /// The device's UUID (`GPU-…` form for GPUs and the CPU device alike).
    #[serde(default)]
    pub uuid: String,
    pub memory: u64,
    pub allocated: u64,
    pub bytes_scrubbed: u64,
    /// A scrub failed verification: the device hands out no memory.
    #[serde(default)]
    pub quarantined: bool,
    pub busy_ns: u64,
    pub uptime_ns: u64,
    pub lanes: u32,
    /// Bytes of allocations spilled to host RAM, and the spill budget.
    #[serde(default)]
    pub spilled: u64,
    #[serde(default)]
    pub spill_budget: u64,
    pub tenants: Vec<TenantStats>,
}

/// A tenant's live usage, as its device's worker reports it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = TenantUsage)]
pub struct TenantStats {
    pub name: String,
    /// Its memory quota, bytes.
    pub quota: u64,
    /// Device memory it has allocated, bytes.
    pub used: u64,
    pub kernels: u64,
    /// Device time its work took, nanoseconds (lane-time on a CPU device).
    pub device_ns: u64,
    pub bytes_scrubbed: u64,
    /// Bytes the tenant's copies moved.
    #[serde(default)]
    pub bytes_copied: u64,
    /// Bytes of the tenant's allocations held in host RAM instead of device
    /// memory (memory overcommit).
    #[serde(default)]
    pub spilled: u64,
    pub weight: u32,
    #[serde(default)]
    pub cap: Option<u32>,
    #[serde(default)]
    pub priority: Priority,
    pub connections: u32,
    /// Host memory the tenant's objects keep in its worker.
    #[serde(default)]
    pub host_used: u64,
    /// What `host_used` may reach.
    #[serde(default)]
    pub host_limit: u64,
    /// Requests the host budget refused (`CUDA_ERROR_OUT_OF_MEMORY`).
    #[serde(default)]
    pub host_refused: u64,
}

impl TenantCmd {
    pub fn share(&self) -> Share {
        Share { weight: self.weight, cap: self.cap, priority: self.priority }
    }
}

pub use vgpu_api::tenant::Owner;

/// Where a device process writes its replies and events. A worker or
/// executor moves the channel off descriptor 1 at its start
/// ([`take_stdout`]), so nothing else that writes to stdout in it (NVIDIA's
/// driver prints a kernel's `printf` there, and a tenant writes the
/// kernel) can pass for a message of its own.
static CHANNEL: std::sync::OnceLock<std::sync::Mutex<std::fs::File>> = std::sync::OnceLock::new();

/// Moves the control plane's channel from descriptor 1 to a descriptor of
/// its own; descriptor 1 then goes to stderr.
pub fn take_stdout() -> std::io::Result<()> {
    use std::os::fd::FromRawFd;
    // SAFETY: duplicates descriptor 1, open since the process started,
    // onto the lowest free descriptor at 3 or above, close-on-exec.
    let fd = unsafe { libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just made by fcntl and is owned by nothing else.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    // SAFETY: dup2 of two open descriptors; 1 now writes where 2 does.
    if unsafe { libc::dup2(2, 1) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    CHANNEL.set(std::sync::Mutex::new(file)).map_err(|_| std::io::Error::other("the channel was already taken"))
}

/// Writes one message to the control plane, whole, on the channel (or on
/// stdout in a process that did not take it).
pub fn send(id: u64, msg: WorkerMsg) -> std::io::Result<()> {
    use std::io::Write;
    let line = serde_json::to_string(&MsgLine { id, msg }).map_err(std::io::Error::other)? + "\n";
    match CHANNEL.get() {
        Some(f) => f.lock().unwrap_or_else(|e| e.into_inner()).write_all(line.as_bytes()),
        None => {
            let mut o = std::io::stdout().lock();
            o.write_all(line.as_bytes())?;
            o.flush()
        }
    }
}
