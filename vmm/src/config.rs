//! The VM description: what `--config FILE.json` holds, what `GET /vm`
//! returns under `config`, and what the command-line flags fill in.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};
use virtio_gpu_compute::size::{number_or_text, Size};

/// Most vCPUs one VM may have (the MP table and the APIC ids fit in 8 bits).
pub const MAX_VCPUS: u32 = 64;
/// Smallest guest: enough for the boot structures and a tiny kernel.
pub const MIN_MEMORY_MIB: u64 = 8;

/// Guest memory backing page size (the API's type).
pub use vgpu_api::vm::Hugepages;

/// Where the serial console goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SerialOut {
    #[default]
    Stdout,
    File(PathBuf),
}

impl std::str::FromStr for SerialOut {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" => Err("empty serial destination: use stdout or a file path".into()),
            "stdout" => Ok(SerialOut::Stdout),
            p => Ok(SerialOut::File(PathBuf::from(p))),
        }
    }
}

impl Serialize for SerialOut {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SerialOut::Stdout => s.serialize_str("stdout"),
            SerialOut::File(p) => s.serialize_str(&p.to_string_lossy()),
        }
    }
}

impl<'de> Deserialize<'de> for SerialOut {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Guest memory size. A plain number means MiB (as Firecracker's
/// `mem_size_mib`); a string may carry a suffix ("2GiB").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemMiB(pub u64);

impl std::str::FromStr for MemMiB {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
            return t.parse().map(MemMiB).map_err(|_| format!("invalid memory size '{s}'"));
        }
        let b: Size = t.parse().map_err(|e: virtio_gpu_compute::size::SizeError| e.to_string())?;
        if !b.0.is_multiple_of(1 << 20) {
            return Err(format!("memory size '{s}' is not a whole number of MiB"));
        }
        Ok(MemMiB(b.0 >> 20))
    }
}

impl<'de> Deserialize<'de> for MemMiB {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        number_or_text(d, "a memory size: MiB, or a string such as \"2GiB\"", |n| Ok(MemMiB(n)), str::parse)
    }
}

fn default_vcpus() -> u32 {
    1
}
fn default_memory() -> MemMiB {
    MemMiB(256)
}

/// The VM description shared by the JSON config file and the API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub kernel: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<PathBuf>,
    #[serde(default)]
    pub cmdline: String,
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    #[serde(default = "default_memory")]
    pub memory_mib: MemMiB,
    #[serde(default)]
    pub hugepages: Hugepages,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    #[serde(default)]
    pub serial: SerialOut,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_socket: Option<PathBuf>,
    /// Offer a virtio-rng device backed by the host's getrandom.
    #[serde(default = "yes")]
    pub rng: bool,
    /// A virtio-gpu compute device served by the mediator over vhost-user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<VgpuConfig>,
    /// virtio-blk disks, in PCI slot order (the guest's vda, vdb, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskConfig>,
    /// virtio-net interfaces over taps, in PCI slot order (after the disks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nets: Vec<NetConfig>,
    /// Host PCI functions passed through whole with VFIO (`DDDD:BB:DD.F`,
    /// bound to vfio-pci), in PCI slot order after every virtio device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vfio: Vec<PciAddress>,
}

pub use crate::devices::vfio::PciAddress;

/// Most passthrough devices one VM may have.
pub const MAX_VFIO: usize = 8;

/// Most disks one VM may have.
pub const MAX_DISKS: usize = 16;

/// A token bucket: `size` units, refilled completely every `refill_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketConfig {
    pub size: u64,
    pub refill_ms: u64,
}

impl BucketConfig {
    /// `SIZE/MS`, SIZE a number or a size such as 10MiB.
    fn parse(s: &str, what: &str) -> Result<BucketConfig, String> {
        let bad = || format!("invalid {what} '{s}': use AMOUNT/MILLISECONDS, e.g. 10MiB/1000");
        let (a, ms) = s.split_once('/').ok_or_else(bad)?;
        let size = a.parse::<Size>().map_err(|_| bad())?.0;
        let refill_ms = ms.parse::<u64>().map_err(|_| bad())?;
        if size == 0 || refill_ms == 0 || refill_ms > 3_600_000 {
            return Err(bad());
        }
        Ok(BucketConfig { size, refill_ms })
    }

    pub fn bucket(self) -> crate::devices::virtio::rate_limit::Bucket {
        crate::devices::virtio::rate_limit::Bucket { size: self.size, refill: std::time::Duration::from_millis(self.refill_ms) }
    }

    /// What `parse` enforces, for buckets from a config file.
    fn check(&self, what: &str) -> Result<(), String> {
        if self.size == 0 || self.refill_ms == 0 || self.refill_ms > 3_600_000 {
            return Err(format!("{what}: a bucket needs a size above 0 and a refill_ms of 1 to 3600000"));
        }
        Ok(())
    }
}

/// Both buckets of a rate limit, as the devices take them.
fn rate_limit(bandwidth: Option<BucketConfig>, ops: Option<BucketConfig>) -> crate::devices::virtio::rate_limit::RateLimit {
    crate::devices::virtio::rate_limit::RateLimit { bandwidth: bandwidth.map(|b| b.bucket()), ops: ops.map(|b| b.bucket()) }
}

/// `--disk path=PATH[,ro][,direct][,id=ID][,bw=SIZE/MS][,ops=N/MS]`: a
/// raw image (a regular file or a block device), read-only or not, opened
/// with O_DIRECT or not, with optional rate limits on bytes and requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub direct: bool,
    /// What the guest reads as the disk's serial (at most 20 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<BucketConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<BucketConfig>,
}

impl std::str::FromStr for DiskConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut d = DiskConfig { path: PathBuf::new(), read_only: false, direct: false, id: None, bandwidth: None, ops: None };
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("path", p)) if !p.is_empty() => d.path = PathBuf::from(p),
                Some(("id", i)) if !i.is_empty() && i.len() <= 20 && i.is_ascii() => d.id = Some(i.into()),
                Some(("bw", b)) => d.bandwidth = Some(BucketConfig::parse(b, "bw")?),
                Some(("ops", o)) => d.ops = Some(BucketConfig::parse(o, "ops")?),
                None if part == "ro" => d.read_only = true,
                None if part == "direct" => d.direct = true,
                _ => return Err(format!("invalid --disk part '{part}': use path=PATH[,ro][,direct][,id=ID (20 ASCII bytes at most)][,bw=SIZE/MS][,ops=N/MS]")),
            }
        }
        if d.path.as_os_str().is_empty() {
            return Err("--disk needs path=PATH".into());
        }
        Ok(d)
    }
}

impl DiskConfig {
    pub fn rate_limit(&self) -> crate::devices::virtio::rate_limit::RateLimit {
        rate_limit(self.bandwidth, self.ops)
    }
}

/// Most network interfaces one VM may have.
pub const MAX_NETS: usize = 8;

/// An Ethernet address, written `52:54:00:12:34:56`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// Bit 0 of the first byte clear: an address one NIC may own.
    pub fn is_unicast(&self) -> bool {
        self.0[0] & 1 == 0
    }

    /// The address of interface `index` over tap `tap` when none is given:
    /// 52:54:00 (locally administered, unicast) and three bytes of an
    /// FNV-1a hash of the name and the index, the same on every start.
    pub fn derived(tap: &str, index: usize) -> MacAddr {
        let h = tap.bytes().chain((index as u32).to_le_bytes()).fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193));
        let [a, b, c, _] = h.to_le_bytes();
        MacAddr([0x52, 0x54, 0x00, a, b, c])
    }
}

impl std::fmt::Display for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl std::str::FromStr for MacAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid MAC address '{s}': use six hex bytes such as 52:54:00:12:34:56");
        let mut m = [0u8; 6];
        let mut parts = s.split(':');
        for b in m.iter_mut() {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(MacAddr(m))
    }
}

impl Serialize for MacAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// `--net tap=NAME[,mac=MAC][,rx_bw=SIZE/MS][,rx_ops=N/MS][,tx_bw=SIZE/MS][,tx_ops=N/MS]`:
/// a virtio-net interface over the tap NAME (opened when the VM starts,
/// created if missing and the VMM may), with its MAC address (default
/// [`MacAddr::derived`]) and optional rate limits per direction on bytes
/// and frames.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    pub tap: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<MacAddr>,
    /// Frames to the guest: bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_bandwidth: Option<BucketConfig>,
    /// Frames to the guest: count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_ops: Option<BucketConfig>,
    /// Frames from the guest: bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_bandwidth: Option<BucketConfig>,
    /// Frames from the guest: count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_ops: Option<BucketConfig>,
}

impl NetConfig {
    /// The MAC address given, or the one derived for interface `index`.
    pub fn mac_or_derived(&self, index: usize) -> MacAddr {
        self.mac.unwrap_or_else(|| MacAddr::derived(&self.tap, index))
    }

    pub fn rx_limit(&self) -> crate::devices::virtio::rate_limit::RateLimit {
        rate_limit(self.rx_bandwidth, self.rx_ops)
    }

    pub fn tx_limit(&self) -> crate::devices::virtio::rate_limit::RateLimit {
        rate_limit(self.tx_bandwidth, self.tx_ops)
    }
}

impl std::str::FromStr for NetConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut n = NetConfig { tap: String::new(), mac: None, rx_bandwidth: None, rx_ops: None, tx_bandwidth: None, tx_ops: None };
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("tap", t)) => {
                    crate::devices::virtio::net::check_tap_name(t).map_err(|e| e.to_string())?;
                    n.tap = t.to_string();
                }
                Some(("mac", m)) => n.mac = Some(m.parse()?),
                Some(("rx_bw", b)) => n.rx_bandwidth = Some(BucketConfig::parse(b, "rx_bw")?),
                Some(("rx_ops", o)) => n.rx_ops = Some(BucketConfig::parse(o, "rx_ops")?),
                Some(("tx_bw", b)) => n.tx_bandwidth = Some(BucketConfig::parse(b, "tx_bw")?),
                Some(("tx_ops", o)) => n.tx_ops = Some(BucketConfig::parse(o, "tx_ops")?),
                _ => return Err(format!("invalid --net part '{part}': use tap=NAME[,mac=52:54:00:xx:xx:xx][,rx_bw=SIZE/MS][,rx_ops=N/MS][,tx_bw=SIZE/MS][,tx_ops=N/MS]")),
            }
        }
        if n.tap.is_empty() {
            return Err("--net needs tap=NAME".into());
        }
        Ok(n)
    }
}

/// `--vgpu socket=PATH[,headless][,reconnect=SECONDS]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VgpuConfig {
    /// The VM tenant's vhost-user socket (`vgpuctl tenant create NAME --vm`).
    pub socket: PathBuf,
    /// Report no scanout (guests with Linux 6.4 or later accept that).
    #[serde(default)]
    pub headless: bool,
    /// How long to keep reconnecting when the backend hangs up (its
    /// executor ended and the daemon starts another) before the guest
    /// sees a device error; 0 reports the error at once.
    #[serde(default = "default_reconnect_s")]
    pub reconnect_s: u32,
}

/// Seconds a VMM keeps reconnecting to a vGPU backend that hung up: longer
/// than the daemon's longest restart delay (5 s) several times over.
pub const VGPU_RECONNECT_DEFAULT_S: u32 = 30;
/// The longest reconnection window accepted.
pub const VGPU_RECONNECT_MAX_S: u32 = 3600;

fn default_reconnect_s() -> u32 {
    VGPU_RECONNECT_DEFAULT_S
}

impl std::str::FromStr for VgpuConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut socket = None;
        let mut headless = false;
        let mut reconnect_s = VGPU_RECONNECT_DEFAULT_S;
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("socket", p)) if !p.is_empty() => socket = Some(PathBuf::from(p)),
                Some(("reconnect", n)) => {
                    reconnect_s = n.parse().ok().filter(|&n| n <= VGPU_RECONNECT_MAX_S).ok_or_else(|| format!("invalid --vgpu reconnect={n}: give whole seconds, 0 to {VGPU_RECONNECT_MAX_S}"))?;
                }
                None if part == "headless" => headless = true,
                _ => return Err(format!("invalid --vgpu part '{part}': use socket=PATH[,headless][,reconnect=SECONDS]")),
            }
        }
        Ok(VgpuConfig { socket: socket.ok_or("--vgpu needs socket=PATH")?, headless, reconnect_s })
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("{path}: invalid VM config: {err}")]
    Parse { path: String, err: String },
    #[error("{0}")]
    Invalid(String),
    /// A file the description names: missing, of the wrong type, a
    /// symbolic link or behind one, or with hard links this host does not
    /// restrict (vgpu_topology::safe_open).
    #[error(transparent)]
    File(#[from] crate::safe_open::SafeOpenError),
}

impl VmConfig {
    pub fn new(kernel: PathBuf) -> VmConfig {
        VmConfig {
            kernel,
            initramfs: None,
            cmdline: String::new(),
            vcpus: default_vcpus(),
            memory_mib: default_memory(),
            hugepages: Hugepages::None,
            numa_node: None,
            serial: SerialOut::Stdout,
            api_socket: None,
            rng: true,
            vgpu: None,
            disks: Vec::new(),
            nets: Vec::new(),
            vfio: Vec::new(),
        }
    }

    pub fn from_json_file(path: &std::path::Path) -> Result<VmConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read { path: path.display().to_string(), err })?;
        serde_json::from_str(&text).map_err(|e| ConfigError::Parse { path: path.display().to_string(), err: e.to_string() })
    }

    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib.0 << 20
    }

    /// Checks everything that can be checked before touching KVM: counts,
    /// sizes against the host, files that must exist.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return bad(format!("vcpus must be 1..={MAX_VCPUS}, not {}", self.vcpus));
        }
        if let Some(v) = &self.vgpu {
            if v.reconnect_s > VGPU_RECONNECT_MAX_S {
                return bad(format!("vgpu reconnect_s {} is more than {VGPU_RECONNECT_MAX_S}", v.reconnect_s));
            }
        }
        if self.memory_mib.0 < MIN_MEMORY_MIB {
            return bad(format!("memory must be at least {MIN_MEMORY_MIB} MiB, not {} MiB", self.memory_mib.0));
        }
        let host = host_memory_bytes();
        if let Some(host) = host {
            if self.memory_mib.0.checked_mul(1 << 20).is_none_or(|b| b > host) {
                return bad(format!("memory of {} MiB is larger than the host's {} MiB", self.memory_mib.0, host >> 20));
            }
        }
        let page = self.hugepages.page_size();
        if !self.memory_bytes().is_multiple_of(page) {
            return bad(format!("memory of {} MiB is not a multiple of the {} hugepage size", self.memory_mib.0, Size(page)));
        }
        check_file("kernel", &self.kernel)?;
        if let Some(i) = &self.initramfs {
            check_file("initramfs", i)?;
        }
        if self.cmdline.len() >= crate::boot::CMDLINE_MAX {
            return bad(format!("kernel command line is {} bytes; the limit is {}", self.cmdline.len(), crate::boot::CMDLINE_MAX - 1));
        }
        if self.cmdline.bytes().any(|b| b == 0) {
            return bad("kernel command line contains a NUL byte".into());
        }
        if self.disks.len() > MAX_DISKS {
            return bad(format!("{} disks; the limit is {MAX_DISKS}", self.disks.len()));
        }
        for d in &self.disks {
            // Without following symbolic links, as the VM opens it.
            crate::safe_open::inspect("disk", &d.path, crate::safe_open::Kind::FileOrBlockDevice)?;
            if d.id.as_ref().is_some_and(|i| i.len() > 20 || !i.is_ascii()) {
                return bad(format!("disk {}: id must be at most 20 ASCII bytes", d.path.display()));
            }
            for (b, what) in [(d.bandwidth, "bandwidth"), (d.ops, "ops")] {
                b.map_or(Ok(()), |b| b.check(&format!("disk {} {what}", d.path.display()))).map_err(ConfigError::Invalid)?;
            }
        }
        if self.nets.len() > MAX_NETS {
            return bad(format!("{} network interfaces; the limit is {MAX_NETS}", self.nets.len()));
        }
        for (i, n) in self.nets.iter().enumerate() {
            crate::devices::virtio::net::check_tap_name(&n.tap).map_err(|e| ConfigError::Invalid(format!("net {i}: {e}")))?;
            if self.nets[..i].iter().any(|o| o.tap == n.tap) {
                return bad(format!("net {i}: tap {} is named twice; a tap serves one interface", n.tap));
            }
            if let Some(m) = n.mac {
                if !m.is_unicast() || m.0 == [0; 6] {
                    return bad(format!("net {i}: mac {m} is not a unicast address (bit 0 of the first byte must be clear, and not all zeros)"));
                }
            }
            for (b, what) in [(n.rx_bandwidth, "rx_bandwidth"), (n.rx_ops, "rx_ops"), (n.tx_bandwidth, "tx_bandwidth"), (n.tx_ops, "tx_ops")] {
                b.map_or(Ok(()), |b| b.check(&format!("net {i} {what}"))).map_err(ConfigError::Invalid)?;
            }
        }
        if self.vfio.len() > MAX_VFIO {
            return bad(format!("{} passthrough devices; the limit is {MAX_VFIO}", self.vfio.len()));
        }
        let sysfs = crate::numa::sysfs_root();
        for (i, a) in self.vfio.iter().enumerate() {
            if self.vfio[..i].contains(a) {
                return bad(crate::devices::vfio::VfioError::Duplicate(*a).to_string());
            }
            crate::devices::vfio::check_host_device(a, &sysfs).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        Ok(())
    }
}

/// A regular file, reached without a symbolic link in any component of
/// its path (as boot::load opens it).
fn check_file(what: &str, p: &std::path::Path) -> Result<(), ConfigError> {
    crate::safe_open::inspect(what, p, crate::safe_open::Kind::File)?;
    Ok(())
}

/// MemTotal from /proc/meminfo.
fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_field(&text, "MemTotal").map(|kib| kib * 1024)
}

/// A `Name:   N kB` (or plain count) field of /proc/meminfo.
pub fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_mib_when_plain_and_accepts_suffixes() {
        assert_eq!("512".parse::<MemMiB>().unwrap(), MemMiB(512));
        assert_eq!("2GiB".parse::<MemMiB>().unwrap(), MemMiB(2048));
        assert_eq!("64MiB".parse::<MemMiB>().unwrap(), MemMiB(64));
        assert!("1000KiB".parse::<MemMiB>().is_err());
        assert!("lots".parse::<MemMiB>().is_err());
        let c: VmConfig = serde_json::from_str(r#"{"kernel":"/k","memory_mib":"1GiB","hugepages":"2M"}"#).unwrap();
        assert_eq!(c.memory_mib, MemMiB(1024));
        assert_eq!(c.hugepages, Hugepages::TwoMiB);
        let c: VmConfig = serde_json::from_str(r#"{"kernel":"/k","memory_mib":128}"#).unwrap();
        assert_eq!(c.memory_mib, MemMiB(128));
    }

    #[test]
    fn bad_configs_are_refused_with_reasons() {
        assert!(serde_json::from_str::<VmConfig>(r#"{"kernel":"/k","vcpu":2}"#).unwrap_err().to_string().contains("unknown field"));
        assert!(serde_json::from_str::<VmConfig>(r#"{"kernel":"/k","hugepages":"3M"}"#).is_err());
        let exe = std::env::current_exe().unwrap();
        let mut c = VmConfig::new(exe.clone());
        c.vcpus = 0;
        assert!(c.validate().unwrap_err().to_string().contains("vcpus"));
        c.vcpus = 1;
        c.memory_mib = MemMiB(1 << 40);
        assert!(c.validate().unwrap_err().to_string().contains("larger than the host"));
        c.memory_mib = MemMiB(3);
        assert!(c.validate().unwrap_err().to_string().contains("at least"));
        c.memory_mib = MemMiB(3 * 1024 + 2);
        c.hugepages = Hugepages::OneGiB;
        assert!(c.validate().unwrap_err().to_string().contains("multiple"));
        let mut c = VmConfig::new("/nonexistent/kernel".into());
        assert!(c.validate().unwrap_err().to_string().contains("/nonexistent/kernel"));
        c.kernel = "/".into();
        assert!(c.validate().unwrap_err().to_string().contains("not a regular file"));
        assert_eq!(meminfo_field("MemTotal:  1024 kB\nHugePages_Free:  7\n", "HugePages_Free"), Some(7));
    }

    /// The VMM refuses a kernel, initramfs or disk that is a symbolic
    /// link, or whose path passes through one, before it touches KVM: at
    /// every start, so a file swapped for a link after a managed VM was
    /// created is refused when the VM reboots.
    #[test]
    fn files_behind_symbolic_links_are_refused_with_the_link_named() {
        let dir = std::env::temp_dir().join(format!("vgpu-cfg-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let real = dir.join("real");
        std::fs::create_dir_all(&real).unwrap();
        for f in ["kernel", "initrd", "disk.img"] {
            std::fs::write(real.join(f), [0u8; 512]).unwrap();
            std::os::unix::fs::symlink(real.join(f), dir.join(f)).unwrap();
        }
        std::os::unix::fs::symlink(&real, dir.join("via")).unwrap();
        let disk = |p: PathBuf| DiskConfig { path: p, read_only: false, direct: false, id: None, bandwidth: None, ops: None };
        let good = || {
            let mut c = VmConfig::new(real.join("kernel"));
            c.memory_mib = MemMiB(16);
            c.initramfs = Some(real.join("initrd"));
            c.disks = vec![disk(real.join("disk.img"))];
            c
        };
        good().validate().unwrap();
        let link = |what: &str, p: &str| format!("{what} {} is a symbolic link; give the real path", dir.join(p).display());
        let through = |what: &str, p: &str| format!("{what} {}: {} is a symbolic link; give the real path", dir.join(p).display(), dir.join("via").display());
        let cases: Vec<(VmConfig, String)> = vec![
            (VmConfig { kernel: dir.join("kernel"), ..good() }, link("kernel", "kernel")),
            (VmConfig { kernel: dir.join("via/kernel"), ..good() }, through("kernel", "via/kernel")),
            (VmConfig { initramfs: Some(dir.join("initrd")), ..good() }, link("initramfs", "initrd")),
            (VmConfig { initramfs: Some(dir.join("via/initrd")), ..good() }, through("initramfs", "via/initrd")),
            (VmConfig { disks: vec![disk(dir.join("disk.img"))], ..good() }, link("disk", "disk.img")),
            (VmConfig { disks: vec![disk(dir.join("via/disk.img"))], ..good() }, through("disk", "via/disk.img")),
        ];
        for (c, says) in cases {
            let e = c.validate().unwrap_err();
            assert!(matches!(e, ConfigError::File(_)), "{e:?}");
            assert_eq!(e.to_string(), says);
        }
        // Swapped for a link after a good start: the next start refuses it.
        std::fs::remove_file(real.join("disk.img")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", real.join("disk.img")).unwrap();
        assert_eq!(good().validate().unwrap_err().to_string(), format!("disk {} is a symbolic link; give the real path", real.join("disk.img").display()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn vgpu_arguments_parse_and_bad_ones_say_why() {
        let v: VgpuConfig = "socket=/run/t.vhost".parse().unwrap();
        assert_eq!((v.headless, v.reconnect_s), (false, VGPU_RECONNECT_DEFAULT_S));
        let v: VgpuConfig = "socket=/run/t.vhost,headless,reconnect=0".parse().unwrap();
        assert_eq!((v.socket.to_str(), v.headless, v.reconnect_s), (Some("/run/t.vhost"), true, 0));
        for bad in ["socket=/s,reconnect=3601", "socket=/s,reconnect=-1", "socket=/s,reconnect=", "socket=/s,reconnect=1.5"] {
            let e = bad.parse::<VgpuConfig>().unwrap_err();
            assert!(e.contains("reconnect") && e.contains("0 to 3600"), "{bad}: {e}");
        }
        assert!("headless".parse::<VgpuConfig>().unwrap_err().contains("socket=PATH"));
        // The same bound holds for a JSON description.
        let mut cfg = VmConfig::new("/k".into());
        cfg.vgpu = Some(VgpuConfig { socket: "/s".into(), headless: false, reconnect_s: 3601 });
        assert!(cfg.validate().unwrap_err().to_string().contains("reconnect_s 3601"));
    }

    #[test]
    fn net_arguments_parse_and_bad_ones_say_why() {
        let n: NetConfig = "tap=vt0,mac=52:54:00:0a:0B:0c,rx_bw=10MiB/1000,tx_ops=100/10".parse().unwrap();
        assert_eq!(n.tap, "vt0");
        assert_eq!(n.mac, Some(MacAddr([0x52, 0x54, 0, 0x0a, 0x0b, 0x0c])));
        assert_eq!(n.rx_bandwidth, Some(BucketConfig { size: 10 << 20, refill_ms: 1000 }));
        assert_eq!(n.tx_ops, Some(BucketConfig { size: 100, refill_ms: 10 }));
        assert_eq!((n.rx_ops, n.tx_bandwidth), (None, None));
        for (arg, says) in [
            ("mac=52:54:00:00:00:01", "needs tap=NAME"),
            ("tap=a-name-of-16-chr", "at most 15 bytes"),
            ("tap=tap/0", "printable ASCII"),
            ("tap=t0,mac=52:54:00:00:01", "invalid MAC address"),
            ("tap=t0,mac=52:54:00:00:01:xy", "invalid MAC address"),
            ("tap=t0,rx_bw=fast", "AMOUNT/MILLISECONDS"),
            ("tap=t0,speed=1", "invalid --net part"),
        ] {
            let e = arg.parse::<NetConfig>().unwrap_err();
            assert!(e.contains(says), "{arg}: {e}");
        }
        // The config file's form, and back.
        let c: VmConfig = serde_json::from_str(r#"{"kernel":"/k","nets":[{"tap":"vt0","mac":"52:54:00:aa:bb:cc","tx_bandwidth":{"size":1000,"refill_ms":10}}]}"#).unwrap();
        assert_eq!(c.nets[0].mac, Some(MacAddr([0x52, 0x54, 0, 0xaa, 0xbb, 0xcc])));
        let back: VmConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(serde_json::from_str::<VmConfig>(r#"{"kernel":"/k","nets":[{"tap":"vt0","mac":"nope"}]}"#).is_err());
    }

    #[test]
    fn nets_are_validated_and_derived_macs_are_local_unicast_and_stable() {
        let exe = std::env::current_exe().unwrap();
        let mut c = VmConfig::new(exe);
        c.memory_mib = MemMiB(16);
        let net = |tap: &str, mac: Option<&str>| NetConfig { tap: tap.into(), mac: mac.map(|m| m.parse().unwrap()), rx_bandwidth: None, rx_ops: None, tx_bandwidth: None, tx_ops: None };
        c.nets = vec![net("vt0", None), net("vt1", Some("02:00:00:00:00:01"))];
        c.validate().unwrap();
        c.nets[1].mac = Some("01:00:5e:00:00:01".parse().unwrap());
        assert!(c.validate().unwrap_err().to_string().contains("not a unicast address"));
        c.nets[1].mac = Some(MacAddr([0; 6]));
        assert!(c.validate().unwrap_err().to_string().contains("not a unicast address"));
        c.nets[1] = net("vt0", None);
        assert!(c.validate().unwrap_err().to_string().contains("named twice"));
        c.nets[1] = net("bad name", None);
        assert!(c.validate().unwrap_err().to_string().contains("printable ASCII"));
        c.nets = (0..9).map(|i| net(&format!("vt{i}"), None)).collect();
        assert!(c.validate().unwrap_err().to_string().contains("the limit is 8"));
        c.nets = vec![net("vt0", None)];
        c.nets[0].rx_ops = Some(BucketConfig { size: 0, refill_ms: 10 });
        assert!(c.validate().unwrap_err().to_string().contains("size above 0"));
        let m = MacAddr::derived("vt0", 0);
        assert_eq!(m, MacAddr::derived("vt0", 0), "the same on every start");
        assert_ne!(m, MacAddr::derived("vt0", 1));
        assert_ne!(m, MacAddr::derived("vt1", 0));
        assert_eq!(&m.0[..3], &[0x52, 0x54, 0x00]);
        assert!(m.is_unicast() && m.0[0] & 2 != 0, "locally administered unicast");
        assert_eq!(net("vt0", None).mac_or_derived(0), m);
        assert_eq!(m.to_string().parse::<MacAddr>().unwrap(), m);
    }
}
