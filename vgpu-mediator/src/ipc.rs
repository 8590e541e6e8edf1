//! Messages between the control plane and a device worker: one JSON object
//! per line over the worker's stdin (commands) and stdout (replies).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WorkerCmd {
    AddTenant {
        name: String,
        quota: u64,
        weight: u32,
        socket: PathBuf,
        /// Serve the socket as a VM's vhost-user virtio-gpu backend.
        #[serde(default)]
        vm: bool,
    },
    RemoveTenant { name: String },
    Stats,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WorkerMsg {
    Ready { pid: u32 },
    Ok,
    Err(String),
    Stats(DeviceStats),
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeviceStats {
    pub kind: String,
    pub name: String,
    pub memory: u64,
    pub allocated: u64,
    pub bytes_scrubbed: u64,
    /// A scrub failed verification: the device hands out no memory.
    #[serde(default)]
    pub quarantined: bool,
    pub busy_ns: u64,
    pub uptime_ns: u64,
    pub lanes: u32,
    pub tenants: Vec<TenantStats>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TenantStats {
    pub name: String,
    pub quota: u64,
    pub used: u64,
    pub kernels: u64,
    pub device_ns: u64,
    pub bytes_scrubbed: u64,
    pub weight: u32,
    pub connections: u32,
}
