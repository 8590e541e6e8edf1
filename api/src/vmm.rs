//! One VM as `vgpu-vmm` runs it: what `vgpu-vmm --config FILE.json`
//! holds (the mediator writes one for each managed VM), what `GET /vm`
//! returns under `config`, and what the VMM's command-line flags fill in.
//! The checks that need the host (files, memory, devices) are the VMM's.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

use crate::size::{number_or_text, Size};

/// Most vCPUs one VM may have (the MP table and the APIC ids fit in 8 bits).
pub const MAX_VCPUS: u32 = 64;
/// Smallest guest: enough for the boot structures and a tiny kernel.
pub const MIN_MEMORY_MIB: u64 = 8;

/// Guest memory backing page size.
pub use crate::vm::Hugepages;

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
        let b: Size = t.parse().map_err(|e: crate::size::SizeError| e.to_string())?;
        if !b.0.is_multiple_of(1 << 20) {
            return Err(format!("memory size '{s}' is not a whole number of MiB"));
        }
        Ok(MemMiB(b.0 >> 20))
    }
}

/// Its OpenAPI schema: MiB as a number, or a size string.
impl utoipa::PartialSchema for MemMiB {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        crate::size::number_or_text_schema(MIN_MEMORY_MIB, "2GiB", "MiB as a number, or a size string such as \"2GiB\"")
    }
}

impl utoipa::ToSchema for MemMiB {}

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

/// One VM: also the schema of `vgpu-vmm --config FILE.json`. Unknown
/// fields are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// ELF vmlinux or bzImage.
    #[schema(value_type = String)]
    pub kernel: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub initramfs: Option<PathBuf>,
    /// The kernel's command line.
    #[serde(default)]
    #[schema(default = "")]
    pub cmdline: String,
    #[serde(default = "default_vcpus")]
    #[schema(minimum = 1, maximum = 64, default = 1)]
    pub vcpus: u32,
    /// Guest memory: MiB as a number, or a size string such as "2GiB".
    #[serde(default = "default_memory")]
    #[schema(default = 256)]
    pub memory_mib: MemMiB,
    #[serde(default)]
    #[schema(default = "none")]
    pub hugepages: Hugepages,
    /// The host NUMA node whose CPUs run the vCPUs and whose memory backs
    /// the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Where the serial console goes: `stdout` or a file path.
    #[serde(default)]
    #[schema(value_type = String, default = "stdout")]
    pub serial: SerialOut,
    /// The VMM's API socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub api_socket: Option<PathBuf>,
    /// Offer a virtio-rng device backed by the host's getrandom.
    #[serde(default = "yes")]
    #[schema(default = true)]
    pub rng: bool,
    /// A virtio-gpu compute device served by the mediator over vhost-user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<VgpuConfig>,
    /// virtio-blk disks, in PCI slot order (the guest's vda, vdb, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(max_items = 16)]
    pub disks: Vec<DiskSpec>,
    /// virtio-net interfaces over taps, in PCI slot order (after the disks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(max_items = 8)]
    pub nets: Vec<NetConfig>,
    /// Host PCI functions passed through whole with VFIO (`DDDD:BB:DD.F`),
    /// in PCI slot order after every virtio device. Each must be bound to
    /// vfio-pci, in an IOMMU group whose other devices are bound to
    /// vfio-pci or to none, and have MSI-X.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<String>, max_items = 8)]
    pub vfio: Vec<PciAddress>,
}

pub use vgpu_topology::pci::PciAddress;

/// Most passthrough devices one VM may have.
pub const MAX_VFIO: usize = 8;

/// Most disks one VM may have.
pub const MAX_DISKS: usize = 16;

/// Rate limits and disks are the managed VM's types: one grammar and one
/// schema for the mediator's API, `vgpuctl vm create` and `vgpu-vmm`.
pub use crate::vm::{DiskSpec, RateSpec};

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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// The tap's name (printable ASCII without '/', ':' or '%'; not "." or
    /// ".."). An existing tap owned by the VMM's uid needs no privilege; a
    /// missing one is created (CAP_NET_ADMIN) and goes away with the VMM.
    #[schema(pattern = "^[!-~]{1,15}$")]
    pub tap: String,
    /// A unicast address. Default: 52:54:00 and three bytes derived from
    /// the tap's name and position; GET /vm shows the address in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, pattern = "^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")]
    pub mac: Option<MacAddr>,
    /// Frames to the guest: bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_bandwidth: Option<RateSpec>,
    /// Frames to the guest: count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_ops: Option<RateSpec>,
    /// Frames from the guest: bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_bandwidth: Option<RateSpec>,
    /// Frames from the guest: count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_ops: Option<RateSpec>,
}

impl NetConfig {
    /// The MAC address given, or the one derived for interface `index`.
    pub fn mac_or_derived(&self, index: usize) -> MacAddr {
        self.mac.unwrap_or_else(|| MacAddr::derived(&self.tap, index))
    }
}

/// Longest interface name Linux takes (IFNAMSIZ less its NUL).
pub const MAX_TAP_NAME: usize = 15;

/// What is wrong with a tap name, as the kernel will take it and as the VMM
/// allows: 1 to 15 bytes, printable ASCII without '/', ':', '%' or spaces,
/// and not "." or "..". ('%' would let the kernel pick the name.)
pub fn tap_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("is empty");
    }
    if name.len() > MAX_TAP_NAME {
        return Some("is too long: an interface name has at most 15 bytes");
    }
    if name == "." || name == ".." {
        return Some("is not an interface name");
    }
    if !name.bytes().all(|b| b.is_ascii_graphic() && !matches!(b, b'/' | b':' | b'%')) {
        return Some("may hold only printable ASCII without '/', ':', '%' or whitespace");
    }
    None
}

impl std::str::FromStr for NetConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut n = NetConfig { tap: String::new(), mac: None, rx_bandwidth: None, rx_ops: None, tx_bandwidth: None, tx_ops: None };
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("tap", t)) => {
                    if let Some(why) = tap_name_problem(t) {
                        return Err(format!("tap name {t:?} {why}"));
                    }
                    n.tap = t.to_string();
                }
                Some(("mac", m)) => n.mac = Some(m.parse()?),
                Some(("rx_bw", b)) => n.rx_bandwidth = Some(b.parse()?),
                Some(("rx_ops", o)) => n.rx_ops = Some(o.parse()?),
                Some(("tx_bw", b)) => n.tx_bandwidth = Some(b.parse()?),
                Some(("tx_ops", o)) => n.tx_ops = Some(o.parse()?),
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VgpuConfig {
    /// The VM tenant's vhost-user socket (`vgpuctl tenant create NAME --vm`).
    #[schema(value_type = String)]
    pub socket: PathBuf,
    /// Report no scanout (guests with Linux 6.4 or later accept that).
    #[serde(default)]
    #[schema(default = false)]
    pub headless: bool,
    /// How long to keep reconnecting when the backend hangs up (its
    /// executor ended and the daemon starts another) before the guest
    /// sees a device error; 0 reports the error at once.
    #[serde(default = "default_reconnect_s")]
    #[schema(maximum = 3600, default = 30)]
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

    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib.0 << 20
    }
}
