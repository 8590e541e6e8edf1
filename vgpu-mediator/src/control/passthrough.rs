//! Passthrough devices (docs/passthrough.md): PCI functions, GPUs above
//! all, that the daemon lends whole to one managed VM at a time and
//! scrubs when they come back.
//!
//! - **Lend** (a VM is created with `passthrough = [POOL]`): the device must
//!   exist, sit alone in its IOMMU group and be free. Its host driver is
//!   noted, it is unbound and bound to `vfio-pci` (`driver_override`, then
//!   `drivers_probe`), and the VM's VMM gets `--vfio ADDRESS`.
//! - **Return** (the VM is deleted, or the daemon finds a device that was
//!   lent to no VM it knows, or one on vfio-pci that its record calls
//!   free): the function is reset, bound back to its
//!   host driver, and scrubbed before anyone else may have it. A GPU on
//!   the `nvidia` driver is scrubbed by a child process that zeroes every
//!   byte of device memory it can allocate and reads all of them back
//!   (`vgpu-mediatord scrub-gpu`); any other device gets a function reset,
//!   which the record says is all it got. The record (device, previous VM,
//!   method, bytes, time, verification) is kept with the device's state;
//!   a device whose reset, rebind or scrub fails is quarantined until an
//!   admin scrubs it again successfully (`POST /devices/NAME/scrub`).
//!
//! The state of each device (`STATE_DIR/passthrough/NAME.json`) is written
//! before the device is bound to vfio-pci, so a daemon that dies mid-way
//! finds the device marked as lent and returns it when it starts again.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tracing::{error, info, warn};
use vgpu_topology::pci::{PciAddress, VFIO_DRIVER};

/// Scrub records kept per device, newest last.
pub const MAX_RECORDS: usize = 32;
/// How long a bind may take to show in sysfs (a write to drivers_probe
/// returns once the probe has run, so this is a margin).
const BIND_WAIT: Duration = Duration::from_secs(5);
/// How long one sysfs write may block (an unbind waits for the driver's
/// users to close the device) before the device is given up on.
pub const WRITE_LIMIT: Duration = Duration::from_secs(30);
/// How long a GPU scrub may run.
const GPU_SCRUB_LIMIT: Duration = Duration::from_secs(900);
const NVIDIA_VENDOR: u32 = 0x10de;

/// A passthrough device in the config file (`[[devices.passthrough]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassthroughConfig {
    /// The name pools and `vgpuctl device` use.
    pub name: String,
    /// Its PCI address, `DDDD:BB:DD.F`.
    pub address: PciAddress,
    /// The driver it is bound back to on return (default: the one it has
    /// when the daemon first sees it, unless that is vfio-pci).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_driver: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("no passthrough device named {0}")]
    Unknown(String),
    #[error("passthrough device {name}: no PCI device {addr} on this host")]
    Missing { name: String, addr: PciAddress },
    #[error("passthrough device {name} ({addr}) has no IOMMU group: this host has no IOMMU or it is off (boot with intel_iommu=on or amd_iommu=on)")]
    NoIommu { name: String, addr: PciAddress },
    #[error("passthrough device {name} ({addr}) shares IOMMU group {group} with {peers}: only a device alone in its group can be lent")]
    SharedGroup { name: String, addr: PciAddress, group: u32, peers: String },
    #[error("passthrough device {name} is {state}")]
    Busy { name: String, state: String },
    #[error("no free passthrough device in pool {pool} ({why})")]
    NoneFree {
        pool: String,
        why: String,
        /// A device failed for a reason of the host's (sysfs, the state
        /// directory), not because it was taken or unusable.
        internal: bool,
    },
    #[error("{what} ({path}) did not finish in time: something still has the device open (for a GPU: nvidia-persistenced, DCGM, a display server or a CUDA process)")]
    Stuck { what: String, path: PathBuf },
    #[error("the vfio-pci driver is not loaded (modprobe vfio-pci)")]
    NoVfioDriver,
    #[error("{what} ({path})")]
    Sysfs {
        what: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{addr} is bound to {found} after {what}, not to {want}")]
    WrongDriver { addr: PciAddress, what: &'static str, want: String, found: String },
    #[error("saving the state of passthrough device {name} ({path})")]
    Save {
        name: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// How a returned device was scrubbed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[derive(utoipa::ToSchema)]
pub enum ScrubMethod {
    /// Every allocatable byte of GPU memory zeroed and read back.
    ZeroAndVerify,
    /// A PCI function reset only: nothing on the device was read back.
    FunctionReset,
}

/// What one return did, as `vgpuctl device show` and the metrics report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScrubRecord {
    pub device: String,
    pub address: String,
    /// The VM the device was lent to ("" when the daemon found it bound to
    /// vfio-pci with no record of whom to).
    pub previous_vm: String,
    pub method: ScrubMethod,
    /// Bytes of device memory zeroed and read back as zero.
    pub bytes: u64,
    /// The device's memory as its driver reports it (0: not a GPU). What
    /// lies between `bytes` and this is the driver's own reservation, which
    /// no context can allocate.
    pub device_memory: u64,
    /// Seconds since the epoch when the return began, and how long it took.
    pub started: u64,
    pub duration_ms: u64,
    /// Whether the device's memory was read back and found zero.
    pub verified: bool,
    /// Whether the device passed: reset, rebound and (GPU) verified.
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Where a passthrough device is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "state")]
pub enum PassState {
    Free,
    Lent {
        vm: String,
    },
    /// Being reset, rebound and scrubbed.
    Returning {
        vm: String,
    },
    Quarantined {
        reason: String,
    },
}

impl PassState {
    pub fn name(&self) -> &'static str {
        match self {
            PassState::Free => "free",
            PassState::Lent { .. } => "lent",
            PassState::Returning { .. } => "returning",
            PassState::Quarantined { .. } => "quarantined",
        }
    }

    fn describe(&self) -> String {
        match self {
            PassState::Free => "free".into(),
            PassState::Lent { vm } => format!("lent to VM {vm}"),
            PassState::Returning { vm } => format!("being returned from VM {vm} and scrubbed"),
            PassState::Quarantined { reason } => format!("quarantined ({reason}); scrub it again once fixed: vgpuctl device scrub NAME"),
        }
    }
}

/// What `STATE_DIR/passthrough/NAME.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Saved {
    #[serde(flatten)]
    state: PassState,
    /// The address the record is for: a record for another address (the
    /// config changed) is not trusted.
    #[serde(default)]
    address: Option<String>,
    /// An NVIDIA GPU, as sysfs said at start or at a lend; once set it
    /// stays, so a GPU that was unreadable once is still scrubbed as one.
    #[serde(default)]
    gpu: bool,
    /// The driver the device is bound back to.
    host_driver: Option<String>,
    scrubs: VecDeque<ScrubRecord>,
    /// Returns that passed and failed, ever.
    #[serde(default)]
    scrubs_ok: u64,
    #[serde(default)]
    scrubs_failed: u64,
}

/// What a GPU scrub reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuScrub {
    pub bytes: u64,
    pub device_memory: u64,
}

/// Writes one sysfs attribute (the kernel acts on it).
pub type SysWriter = Arc<dyn Fn(&Path, &str) -> io::Result<()> + Send + Sync>;
/// Zeroes and reads back a GPU's memory.
pub type GpuScrubber = Box<dyn Fn(&PciAddress) -> Result<GpuScrub, String> + Send + Sync>;

#[derive(Debug)]
pub struct PassDevice {
    pub name: String,
    pub address: PciAddress,
    pub numa_node: i32,
    inner: Mutex<Saved>,
}

/// The states a passthrough device may be in, as the API names them (its
/// schema; `PassState::name`).
#[derive(utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum PassStateName {
    Free,
    Lent,
    Returning,
    Quarantined,
}

/// A device lent whole to VMs, as the API reports it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = PassthroughDevice)]
pub struct PassView {
    pub name: String,
    /// `passthrough`.
    pub kind: String,
    pub address: String,
    pub gpu: bool,
    pub numa_node: i32,
    #[schema(value_type = PassStateName)]
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lent_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_driver: Option<String>,
    /// The driver sysfs shows now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// The pool the device is in.
    pub pool: String,
    /// Returns that passed and failed, ever.
    pub scrubs_ok: u64,
    pub scrubs_failed: u64,
    /// The latest records, oldest first (at most 32).
    pub scrubs: Vec<ScrubRecord>,
}

pub struct Passthrough {
    sysfs: PathBuf,
    dir: PathBuf,
    write: SysWriter,
    scrub_gpu: GpuScrubber,
    pub devices: Vec<Arc<PassDevice>>,
    /// Held while a device is chosen and lent.
    choosing: Mutex<()>,
    /// [`WRITE_LIMIT`] (shorter in tests).
    write_limit: Duration,
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn driver_text(d: &Option<String>) -> String {
    d.clone().unwrap_or_else(|| "no driver".into())
}

/// Whether sysfs shows an NVIDIA GPU (vendor 0x10de, display class) there.
fn looks_like_gpu(addr: &PciAddress, sysfs: &Path) -> bool {
    addr.hex_attr(sysfs, "vendor") == Some(NVIDIA_VENDOR) && addr.hex_attr(sysfs, "class").is_some_and(|c| c >> 16 == 0x03)
}

/// The real writer: one `write(2)` of the value, as `echo` does.
pub fn sysfs_write(path: &Path, value: &str) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.write_all(value.as_bytes())
}

impl PassDevice {
    fn lock(&self) -> MutexGuard<'_, Saved> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn state(&self) -> PassState {
        self.lock().state.clone()
    }

    pub fn is_gpu(&self) -> bool {
        self.lock().gpu
    }

    pub fn last_scrub(&self) -> Option<ScrubRecord> {
        self.lock().scrubs.back().cloned()
    }
}

impl Passthrough {
    /// The devices of `cfg`, with the state an earlier daemon saved under
    /// `state_dir`. A device missing from the host is kept (its lend will
    /// fail with the reason), so pools naming it stay valid. A device on
    /// vfio-pci that no record says is lent is marked for a return: whose
    /// data it holds is unknown.
    pub fn new(cfg: &[PassthroughConfig], sysfs: PathBuf, state_dir: &Path, write: SysWriter, scrub_gpu: GpuScrubber) -> Result<Passthrough, String> {
        let dir = state_dir.join("passthrough");
        std::fs::create_dir_all(&dir).map_err(|e| format!("making {}: {e}", dir.display()))?;
        let mut devices = Vec::new();
        for c in cfg {
            crate::config::validate_name(&c.name).map_err(|e| format!("passthrough device: {e}"))?;
            if devices.iter().any(|d: &Arc<PassDevice>| d.name == c.name || d.address == c.address) {
                return Err(format!("passthrough device {} ({}) is listed twice", c.name, c.address));
            }
            let path = dir.join(format!("{}.json", c.name));
            let addr = c.address.to_string();
            let saved = match std::fs::read(&path) {
                Ok(b) => Some(serde_json::from_slice::<Saved>(&b).map_err(|e| format!("{}: {e}", path.display()))?),
                Err(_) => None,
            };
            let saved = saved.filter(|s| {
                let same = s.address.as_deref() == Some(addr.as_str());
                if !same {
                    warn!(device = %c.name, address = %addr, "the saved state is for another address; not trusted");
                }
                same
            });
            let driver = c.address.driver(&sysfs);
            let mut saved = saved.unwrap_or_else(|| Saved {
                state: PassState::Free,
                address: Some(addr.clone()),
                gpu: false,
                host_driver: c.host_driver.clone().or(driver.clone().filter(|d| d != VFIO_DRIVER)),
                scrubs: VecDeque::new(),
                scrubs_ok: 0,
                scrubs_failed: 0,
            });
            if c.host_driver.is_some() {
                saved.host_driver = c.host_driver.clone();
            }
            saved.gpu |= looks_like_gpu(&c.address, &sysfs);
            if saved.state == PassState::Free && driver.as_deref() == Some(VFIO_DRIVER) {
                warn!(device = %c.name, address = %addr, "on vfio-pci with no record of a lend; it is returned and scrubbed before anyone gets it");
                saved.state = PassState::Returning { vm: String::new() };
            }
            devices.push(Arc::new(PassDevice { name: c.name.clone(), address: c.address, numa_node: c.address.numa_node(&sysfs), inner: Mutex::new(saved) }));
        }
        let p = Passthrough { sysfs, dir, write, scrub_gpu, devices, choosing: Mutex::new(()), write_limit: WRITE_LIMIT };
        for d in &p.devices {
            let s = d.lock().clone();
            p.save(d, &s).map_err(|e| chain(&e))?;
        }
        Ok(p)
    }

    pub fn get(&self, name: &str) -> Option<&Arc<PassDevice>> {
        self.devices.iter().find(|d| d.name == name)
    }

    /// Whether `address` is a passthrough device (a GPU there gets no
    /// worker).
    pub fn has_address(&self, address: &PciAddress) -> bool {
        self.devices.iter().any(|d| d.address == *address)
    }

    /// Writes the device's state durably: a temporary file, synced, renamed
    /// over the old one, and the directory synced.
    fn save(&self, d: &PassDevice, s: &Saved) -> Result<(), PassError> {
        let path = self.dir.join(format!("{}.json", d.name));
        let write = || -> io::Result<()> {
            let body = serde_json::to_vec_pretty(s).map_err(io::Error::other)?;
            super::store::write_atomically(&path, &body)
        };
        write().map_err(|source| PassError::Save { name: d.name.clone(), path, source })
    }

    /// Moves `d` from a state `from` accepts to `to`, saved; Ok(false) if
    /// its state is another.
    fn change(&self, d: &PassDevice, from: impl Fn(&PassState) -> bool, to: PassState) -> Result<bool, PassError> {
        let mut s = d.lock();
        if !from(&s.state) {
            return Ok(false);
        }
        let before = std::mem::replace(&mut s.state, to);
        if let Err(e) = self.save(d, &s) {
            s.state = before;
            return Err(e);
        }
        Ok(true)
    }

    /// Sets `d`'s state whatever it was (after a lend that failed, or at the
    /// end of a return), saved; a failed save is logged.
    fn force(&self, d: &PassDevice, to: PassState) {
        if let Err(e) = self.change(d, |_| true, to) {
            error!(device = %d.name, "{}", chain(&e));
        }
    }

    /// One sysfs write, on a thread of its own: a write the kernel blocks
    /// on (an unbind waiting for the driver's users) is given up on after
    /// [`WRITE_LIMIT`] with [`PassError::Stuck`], so no lock is held for
    /// ever.
    fn write_attr(&self, path: PathBuf, value: &str, what: impl Into<String>) -> Result<(), PassError> {
        let what = what.into();
        let (tx, rx) = std::sync::mpsc::channel();
        let (w, p, v) = (self.write.clone(), path.clone(), value.to_string());
        let spawned = std::thread::Builder::new().name("sysfs-write".into()).spawn(move || {
            let _ = tx.send(w(&p, &v));
        });
        if let Err(source) = spawned {
            return Err(PassError::Sysfs { what, path, source });
        }
        match rx.recv_timeout(self.write_limit) {
            Ok(r) => r.map_err(|source| PassError::Sysfs { what, path, source }),
            Err(_) => Err(PassError::Stuck { what, path }),
        }
    }

    /// Asks the kernel to probe drivers for `d`. The write fails when no
    /// driver takes it; what sysfs shows afterwards is the answer.
    fn probe(&self, d: &PassDevice) -> Result<(), PassError> {
        match self.write_attr(self.sysfs.join("bus/pci/drivers_probe"), &d.address.to_string(), "probing drivers") {
            Err(e @ PassError::Stuck { .. }) => Err(e),
            _ => Ok(()),
        }
    }

    /// Checks that `d` can be lent: on the host, with an IOMMU group of its
    /// own.
    pub fn check_host(&self, d: &PassDevice) -> Result<(), PassError> {
        let (name, addr) = (d.name.clone(), d.address);
        if !addr.exists(&self.sysfs) {
            return Err(PassError::Missing { name, addr });
        }
        let group = addr.iommu_group(&self.sysfs).ok_or_else(|| PassError::NoIommu { name: name.clone(), addr })?;
        let peers = addr.group_peers(&self.sysfs).map_err(|source| PassError::Sysfs { what: "listing its IOMMU group".into(), path: addr.dir(&self.sysfs).join("iommu_group/devices"), source })?;
        if !peers.is_empty() {
            let peers = peers.iter().map(|(p, drv)| format!("{p} ({})", driver_text(drv))).collect::<Vec<_>>().join(", ");
            return Err(PassError::SharedGroup { name, addr, group, peers });
        }
        Ok(())
    }

    /// Lends one free device among `names` (a pool's passthrough devices)
    /// to `vm`, preferring one on NUMA node `numa`, and binds it to
    /// vfio-pci. A device that cannot be lent is skipped for the next; if
    /// none can, the error names why.
    pub fn lend_from(&self, pool: &str, names: &[String], vm: &str, numa: Option<i32>) -> Result<Arc<PassDevice>, PassError> {
        let _g = self.choosing.lock().unwrap_or_else(|e| e.into_inner());
        let mut cands: Vec<&Arc<PassDevice>> = self.devices.iter().filter(|d| names.contains(&d.name)).collect();
        if cands.is_empty() {
            return Err(PassError::NoneFree { pool: pool.into(), why: "it has no passthrough devices".into(), internal: false });
        }
        cands.sort_by_key(|d| (numa.is_some_and(|n| n >= 0 && d.numa_node != n), d.name.clone()));
        let mut why = Vec::new();
        let mut internal = false;
        for d in cands {
            let st = d.state();
            if st != PassState::Free {
                why.push(format!("{} is {}", d.name, st.name()));
                continue;
            }
            match self.lend(d, vm) {
                Ok(()) => return Ok(d.clone()),
                Err(e) => {
                    warn!(device = %d.name, vm, "not lent: {}", chain(&e));
                    internal |= matches!(e, PassError::Sysfs { .. } | PassError::Save { .. } | PassError::WrongDriver { .. } | PassError::Stuck { .. });
                    why.push(chain(&e));
                }
            }
        }
        Err(PassError::NoneFree { pool: pool.into(), why: why.join("; "), internal })
    }

    /// Binds `d` to vfio-pci for `vm`. On failure the device is back on
    /// its host driver and free, or quarantined if that cannot be known.
    fn lend(&self, d: &PassDevice, vm: &str) -> Result<(), PassError> {
        self.check_host(d)?;
        if !self.sysfs.join("bus/pci/drivers").join(VFIO_DRIVER).exists() && self.sysfs == Path::new("/sys") {
            let _ = std::process::Command::new("modprobe").arg(VFIO_DRIVER).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status();
        }
        if !self.sysfs.join("bus/pci/drivers").join(VFIO_DRIVER).exists() {
            return Err(PassError::NoVfioDriver);
        }
        {
            // What it is now decides how it is scrubbed; the driver it has
            // now is the one it goes back to, unless the config names one.
            let mut s = d.lock();
            s.gpu |= looks_like_gpu(&d.address, &self.sysfs);
            if let Some(now) = d.address.driver(&self.sysfs).filter(|x| x != VFIO_DRIVER) {
                if s.host_driver.is_none() {
                    s.host_driver = Some(now);
                }
            }
        }
        // Saved before the device leaves the host: a daemon that dies from
        // here on returns it when it starts again.
        if !self.change(d, |s| *s == PassState::Free, PassState::Lent { vm: vm.into() })? {
            return Err(PassError::Busy { name: d.name.clone(), state: d.state().describe() });
        }
        match self.bind_vfio(d) {
            Ok(()) => {
                info!(device = %d.name, address = %d.address, vm, "passthrough device lent");
                Ok(())
            }
            Err(e @ PassError::Stuck { .. }) => {
                // A write still pending in the kernel: where the device
                // ends up is unknown.
                self.force(d, PassState::Quarantined { reason: format!("a lend did not finish: {}", chain(&e)) });
                Err(e)
            }
            Err(e) => {
                // Nobody had it: back to the host driver, no scrub needed.
                let host = d.lock().host_driver.clone();
                match self.unbind_vfio(d, host.as_deref()) {
                    Ok(()) => self.force(d, PassState::Free),
                    Err(e2) => {
                        error!(device = %d.name, "undoing a failed lend: {}", chain(&e2));
                        self.force(d, PassState::Quarantined { reason: format!("a failed lend could not be undone: {}", chain(&e2)) });
                    }
                }
                Err(e)
            }
        }
    }

    /// Before `vm`'s VMM starts: each device lent to it that is not on
    /// vfio-pci (the host rebooted, or an admin rebound it) is bound again.
    pub fn rebind_lent(&self, vm: &str) -> Result<(), PassError> {
        for d in self.lent_to(vm) {
            if d.address.driver(&self.sysfs).as_deref() != Some(VFIO_DRIVER) {
                warn!(device = %d.name, vm, "lent but not on vfio-pci; binding it again");
                self.check_host(&d)?;
                self.bind_vfio(&d)?;
            }
        }
        Ok(())
    }

    fn dev_attr(&self, d: &PassDevice, attr: &str) -> PathBuf {
        d.address.dir(&self.sysfs).join(attr)
    }

    /// Waits until sysfs shows `d` bound to `want` (None: no driver).
    fn wait_driver(&self, d: &PassDevice, want: Option<&str>, what: &'static str) -> Result<(), PassError> {
        let until = Instant::now() + BIND_WAIT;
        loop {
            let found = d.address.driver(&self.sysfs);
            if found.as_deref() == want {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(PassError::WrongDriver { addr: d.address, what, want: driver_text(&want.map(str::to_string)), found: driver_text(&found) });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Unbinds `d`'s driver, if it has one.
    fn unbind(&self, d: &PassDevice) -> Result<(), PassError> {
        if let Some(drv) = d.address.driver(&self.sysfs) {
            let a = d.address.to_string();
            self.write_attr(self.dev_attr(d, "driver/unbind"), &a, format!("unbinding {a} from {drv}"))?;
            self.wait_driver(d, None, "unbinding")?;
        }
        Ok(())
    }

    fn bind_vfio(&self, d: &PassDevice) -> Result<(), PassError> {
        if d.address.driver(&self.sysfs).as_deref() == Some(VFIO_DRIVER) {
            return Ok(());
        }
        // The override first, so no other driver takes the device between
        // the unbind and the probe.
        let a = d.address.to_string();
        self.write_attr(self.dev_attr(d, "driver_override"), VFIO_DRIVER, format!("setting {a}'s driver_override"))?;
        self.unbind(d)?;
        self.probe(d)?;
        self.wait_driver(d, Some(VFIO_DRIVER), "binding")
    }

    /// Takes `d` off vfio-pci (or any driver) and binds it to `host`
    /// (None: leaves it without a driver): the override names the host
    /// driver for the probe, so no other driver that matches the device
    /// (nouveau, say) takes it, and is cleared afterwards.
    fn unbind_vfio(&self, d: &PassDevice, host: Option<&str>) -> Result<(), PassError> {
        let a = d.address.to_string();
        let over = self.dev_attr(d, "driver_override");
        self.write_attr(over.clone(), host.unwrap_or("\n"), format!("setting {a}'s driver_override"))?;
        if d.address.driver(&self.sysfs).as_deref() != host {
            self.unbind(d)?;
            if host.is_some() {
                self.probe(d)?;
            }
        }
        self.write_attr(over, "\n", format!("clearing {a}'s driver_override"))?;
        if let Some(h) = host {
            self.wait_driver(d, Some(h), "rebinding to its host driver")?;
        }
        Ok(())
    }

    /// Starts a return of `d` from `vm`: Lent{vm} becomes Returning{vm}.
    /// False if it is not lent to `vm` (then nothing is done).
    fn begin_return(&self, d: &PassDevice, vm: &str) -> bool {
        match self.change(d, |s| matches!(s, PassState::Lent { vm: v } if v == vm), PassState::Returning { vm: vm.into() }) {
            Ok(b) => b,
            Err(e) => {
                // Returned all the same: the scrub must not wait on a disk.
                error!(device = %d.name, "{}", chain(&e));
                d.lock().state = PassState::Returning { vm: vm.into() };
                true
            }
        }
    }

    /// Takes `d` back from `vm` now: reset, rebind, scrub. The device is
    /// free again if all of that passed, quarantined otherwise; the record
    /// says which. None if it was not lent to `vm`.
    pub fn give_back(&self, d: &PassDevice, vm: &str) -> Option<ScrubRecord> {
        self.begin_return(d, vm).then(|| self.finish_return(d, vm))
    }

    /// As [`Self::give_back`], with the scrub on a thread of its own (a
    /// GPU's takes seconds to minutes); the device shows `returning` until
    /// it ends.
    pub fn give_back_later(self: &Arc<Self>, d: Arc<PassDevice>, vm: String) {
        if self.begin_return(&d, &vm) {
            self.finish_later(d, vm);
        }
    }

    fn finish_later(self: &Arc<Self>, d: Arc<PassDevice>, vm: String) {
        let me = self.clone();
        let name = format!("return-{}", d.name);
        let spawned = std::thread::Builder::new().name(name).spawn({
            let (d, vm) = (d.clone(), vm.clone());
            move || {
                me.finish_return(&d, &vm);
            }
        });
        if let Err(e) = spawned {
            error!(device = %d.name, "starting its return: {e}; returning it here");
            self.finish_return(&d, &vm);
        }
    }

    /// Ends a return begun with `begin_return` (or found at start).
    fn finish_return(&self, d: &PassDevice, vm: &str) -> ScrubRecord {
        let rec = self.scrub(d, vm);
        let next = if rec.ok { PassState::Free } else { PassState::Quarantined { reason: rec.error.clone().unwrap_or_else(|| "scrub failed".into()) } };
        {
            let mut s = d.lock();
            if rec.ok {
                s.scrubs_ok += 1;
            } else {
                s.scrubs_failed += 1;
            }
            s.scrubs.push_back(rec.clone());
            while s.scrubs.len() > MAX_RECORDS {
                s.scrubs.pop_front();
            }
        }
        self.force(d, next);
        if rec.ok {
            info!(device = %d.name, vm, method = ?rec.method, bytes = rec.bytes, ms = rec.duration_ms, "passthrough device returned and scrubbed");
        } else {
            error!(device = %d.name, vm, error = rec.error.as_deref().unwrap_or(""), "passthrough device quarantined: its return or scrub failed");
        }
        rec
    }

    /// The devices lent to `vm` are quarantined, not returned: its VMM
    /// did not end, so the guest may still be using them.
    pub fn quarantine_lent(&self, vm: &str, reason: &str) {
        for d in self.lent_to(vm) {
            error!(device = %d.name, vm, "quarantined: {reason}");
            self.force(&d, PassState::Quarantined { reason: reason.into() });
        }
    }

    /// Resets, rebinds and scrubs `d`; the record of it.
    fn scrub(&self, d: &PassDevice, vm: &str) -> ScrubRecord {
        let started = now_s();
        let t0 = Instant::now();
        let (host, gpu) = {
            let s = d.lock();
            (s.host_driver.clone(), s.gpu)
        };
        let mut rec = ScrubRecord {
            device: d.name.clone(),
            address: d.address.to_string(),
            previous_vm: vm.into(),
            method: if gpu { ScrubMethod::ZeroAndVerify } else { ScrubMethod::FunctionReset },
            bytes: 0,
            device_memory: 0,
            started,
            duration_ms: 0,
            verified: false,
            ok: false,
            error: None,
        };
        let result = (|| -> Result<(), String> {
            if !d.address.exists(&self.sysfs) {
                return Err(format!("{} is no longer on the host", d.address));
            }
            // The reset runs with vfio-pci still bound after a VM (its
            // VMM has closed the device), or with no driver after an
            // admin's scrub of a device on its host driver, which lets go
            // first.
            if d.address.driver(&self.sysfs).is_some_and(|x| x != VFIO_DRIVER) {
                self.unbind(d).map_err(|e| chain(&e))?;
            }
            let reset = self.dev_attr(d, "reset");
            if !reset.exists() {
                return Err(format!("{} has no reset method; it cannot be scrubbed", d.address));
            }
            self.write_attr(reset, "1", "resetting the function").map_err(|e| chain(&e))?;
            self.unbind_vfio(d, host.as_deref()).map_err(|e| chain(&e))?;
            if gpu {
                if host.as_deref() != Some("nvidia") {
                    return Err(format!("a GPU is scrubbed through the nvidia driver, and its host driver is {}", driver_text(&host)));
                }
                let g = (self.scrub_gpu)(&d.address)?;
                rec.bytes = g.bytes;
                rec.device_memory = g.device_memory;
                rec.verified = true;
            }
            Ok(())
        })();
        rec.duration_ms = t0.elapsed().as_millis() as u64;
        match result {
            Ok(()) => rec.ok = true,
            Err(e) => rec.error = Some(e),
        }
        rec
    }

    /// An admin's scrub of a device that is not lent (a quarantined one
    /// after its cause is fixed): the same reset, rebind and scrub as a
    /// return.
    pub fn rescrub(&self, name: &str) -> Result<ScrubRecord, PassError> {
        let d = self.get(name).ok_or_else(|| PassError::Unknown(name.into()))?.clone();
        if !self.change(&d, |s| matches!(s, PassState::Free | PassState::Quarantined { .. }), PassState::Returning { vm: String::new() })? {
            return Err(PassError::Busy { name: name.into(), state: d.state().describe() });
        }
        Ok(self.finish_return(&d, ""))
    }

    /// At daemon start: every device saved as lent to a VM that `known`
    /// does not name, or caught mid-return, or found on vfio-pci with no
    /// lend, is returned now, each on a thread of its own.
    pub fn recover(self: &Arc<Self>, known: impl Fn(&str) -> bool) {
        for d in &self.devices {
            match d.state() {
                PassState::Lent { vm } if !known(&vm) => {
                    warn!(device = %d.name, vm = %vm, "passthrough device was lent to a VM that is gone; returning and scrubbing it");
                    self.give_back_later(d.clone(), vm);
                }
                PassState::Returning { vm } => {
                    warn!(device = %d.name, vm = %vm, "passthrough device was being returned; returning and scrubbing it");
                    self.finish_later(d.clone(), vm);
                }
                _ => {}
            }
        }
    }

    /// The devices lent to `vm`.
    pub fn lent_to(&self, vm: &str) -> Vec<Arc<PassDevice>> {
        self.devices.iter().filter(|d| matches!(d.state(), PassState::Lent { vm: v } if v == vm)).cloned().collect()
    }

    pub fn view(&self, d: &PassDevice, pool: &str) -> PassView {
        let s = d.lock().clone();
        PassView {
            name: d.name.clone(),
            kind: "passthrough".into(),
            pool: pool.into(),
            scrubs_ok: s.scrubs_ok,
            scrubs_failed: s.scrubs_failed,
            address: d.address.to_string(),
            gpu: s.gpu,
            numa_node: d.numa_node,
            state: s.state.name().into(),
            lent_to: match &s.state {
                PassState::Lent { vm } | PassState::Returning { vm } if !vm.is_empty() => Some(vm.clone()),
                _ => None,
            },
            quarantine_reason: match &s.state {
                PassState::Quarantined { reason } => Some(reason.clone()),
                _ => None,
            },
            host_driver: s.host_driver.clone(),
            driver: d.address.driver(&self.sysfs),
            scrubs: s.scrubs.iter().cloned().collect(),
        }
    }
}

/// An error with its sources, `a: b: c`, for records and API answers.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out += &format!(": {s}");
        cur = s.source();
    }
    out
}

/// The real GPU scrubber: `EXE scrub-gpu --address ADDR`, a child process
/// so a driver fault cannot take the daemon with it, and its one JSON line.
pub fn gpu_scrubber(exe: PathBuf) -> GpuScrubber {
    Box::new(move |addr: &PciAddress| {
        let mut child = std::process::Command::new(&exe)
            .arg("scrub-gpu")
            .arg("--address")
            .arg(addr.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the GPU scrub: {e}"))?;
        // Both pipes are read while it runs, so a chatty child cannot block.
        let read = |r: Option<Box<dyn io::Read + Send>>| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut r) = r {
                    let _ = io::Read::read_to_end(&mut io::Read::take(&mut r, 1 << 20), &mut buf);
                    let _ = io::copy(&mut r, &mut io::sink());
                }
                buf
            })
        };
        let out_t = read(child.stdout.take().map(|o| Box::new(o) as Box<dyn io::Read + Send>));
        let err_t = read(child.stderr.take().map(|o| Box::new(o) as Box<dyn io::Read + Send>));
        let deadline = Instant::now() + GPU_SCRUB_LIMIT;
        let status = loop {
            match child.try_wait() {
                Ok(Some(st)) => break st,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("the GPU scrub did not finish within {GPU_SCRUB_LIMIT:?}"));
                }
            }
        };
        let stdout = out_t.join().unwrap_or_default();
        let stderr = err_t.join().unwrap_or_default();
        if !status.success() {
            let err = String::from_utf8_lossy(&stderr);
            return Err(format!("the GPU scrub failed ({status}): {}", err.trim().lines().last().unwrap_or("")));
        }
        serde_json::from_slice::<GpuScrub>(&stdout).map_err(|e| format!("the GPU scrub's answer: {e}"))
    })
}

#[cfg(test)]
mod tests;
