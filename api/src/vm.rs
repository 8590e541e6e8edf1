//! The managed VM resource of the mediator's API (`/vms`): one description
//! that the API body, the state file the daemon keeps and `vgpuctl vm
//! create`'s flags are all made from (the flags are derived from these
//! types by clap, the JSON by serde).

use std::path::PathBuf;

use crate::size::Size;
use serde::{Deserialize, Serialize};

/// Guest memory backing page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub enum Hugepages {
    #[default]
    #[serde(rename = "none")]
    None,
    #[serde(rename = "2M")]
    TwoMiB,
    #[serde(rename = "1G")]
    OneGiB,
}

impl Hugepages {
    /// Page size in bytes (4 KiB pages for `None`).
    pub fn page_size(self) -> u64 {
        match self {
            Hugepages::None => 4096,
            Hugepages::TwoMiB => 2 << 20,
            Hugepages::OneGiB => 1 << 30,
        }
    }

    /// The name sysfs gives the pool of this size (`hugepages-2048kB`).
    pub fn sysfs_name(self) -> Option<&'static str> {
        match self {
            Hugepages::None => None,
            Hugepages::TwoMiB => Some("hugepages-2048kB"),
            Hugepages::OneGiB => Some("hugepages-1048576kB"),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Hugepages::None => "none",
            Hugepages::TwoMiB => "2M",
            Hugepages::OneGiB => "1G",
        }
    }
}

impl std::str::FromStr for Hugepages {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Hugepages::None),
            "2M" | "2MiB" => Ok(Hugepages::TwoMiB),
            "1G" | "1GiB" => Ok(Hugepages::OneGiB),
            _ => Err(format!("invalid hugepages '{s}': use none, 2M or 1G")),
        }
    }
}

/// What the daemon does when a VM's VMM exits without being asked to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RestartPolicy {
    /// Start it again, whatever ended it (a guest power-off or reboot too).
    Always,
    /// Start it again unless the guest powered off or rebooted (VMM exit 0).
    #[default]
    OnFailure,
    /// Leave it stopped.
    Never,
}

/// A rate limit, `SIZE/MS` on the command line: a token bucket
/// (Firecracker's model) of `size` bytes or operations, refilled
/// completely every `refill_ms` milliseconds; one operation bigger than the
/// bucket goes when it is full and leaves it in debt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Rate)]
pub struct RateSpec {
    pub size: Size,
    #[schema(minimum = 1, maximum = 3600000)]
    pub refill_ms: u64,
}

impl RateSpec {
    pub fn check(&self) -> Result<(), String> {
        if self.size.0 == 0 || self.refill_ms == 0 || self.refill_ms > 3_600_000 {
            return Err(format!("invalid rate limit {self}: the amount must be positive and the refill 1 to 3600000 ms (AMOUNT/MILLISECONDS, e.g. 50MiB/1000)"));
        }
        Ok(())
    }
}

impl std::fmt::Display for RateSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.size.0, self.refill_ms)
    }
}

impl std::str::FromStr for RateSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid rate limit '{s}': use AMOUNT/MILLISECONDS, e.g. 50MiB/1000");
        let (a, ms) = s.split_once('/').ok_or_else(bad)?;
        let r = RateSpec { size: a.parse().map_err(|_| bad())?, refill_ms: ms.parse().map_err(|_| bad())? };
        r.check()?;
        Ok(r)
    }
}

/// A virtio-blk disk: a raw image (a regular file or a block device),
/// read-only or not, opened with O_DIRECT or not, with optional rate
/// limits on bytes and requests. On the command line (`vgpuctl vm create
/// --disk`, `vgpu-vmm --disk`): `[path=]PATH[,ro][,direct][,id=ID]
/// [,bw=SIZE/MS][,ops=N/MS]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    /// A raw image: a regular file or a block device.
    #[schema(value_type = String)]
    pub path: PathBuf,
    #[serde(default)]
    #[schema(default = false)]
    pub read_only: bool,
    /// Open the image with O_DIRECT (no host page cache).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[schema(default = false)]
    pub direct: bool,
    /// What the guest reads as the disk's serial (at most 20 ASCII bytes;
    /// default vgpu-diskN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 20)]
    pub id: Option<String>,
    /// Bytes per time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<RateSpec>,
    /// Requests per time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<RateSpec>,
}

/// The command-line grammar of a disk.
pub const DISK_GRAMMAR: &str = "[path=]PATH[,ro][,direct][,id=ID (20 ASCII bytes at most)][,bw=SIZE/MS][,ops=N/MS]";

impl DiskSpec {
    /// A disk at `path`, writable, with no limits.
    pub fn new(path: PathBuf) -> DiskSpec {
        DiskSpec { path, read_only: false, direct: false, id: None, bandwidth: None, ops: None }
    }
}

impl std::str::FromStr for DiskSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut d = DiskSpec::new(PathBuf::new());
        for (i, part) in s.split(',').enumerate() {
            match part.split_once('=') {
                Some(("path", p)) if !p.is_empty() => d.path = PathBuf::from(p),
                Some(("id", v)) if !v.is_empty() && v.len() <= 20 && v.is_ascii() => d.id = Some(v.into()),
                Some(("bw", r)) => d.bandwidth = Some(r.parse()?),
                Some(("ops", r)) => d.ops = Some(r.parse()?),
                None if part == "ro" => d.read_only = true,
                None if part == "direct" => d.direct = true,
                // The first part may be the path itself.
                None if i == 0 && !part.is_empty() => d.path = PathBuf::from(part),
                _ => return Err(format!("invalid --disk part '{part}': use {DISK_GRAMMAR}")),
            }
        }
        if d.path.as_os_str().is_empty() {
            return Err(format!("invalid disk '{s}': a disk needs path=PATH (or PATH first): use {DISK_GRAMMAR}"));
        }
        Ok(d)
    }
}

/// A network interface: `tap=NAME` (the admin's own tap) or `bridge=NAME`
/// (a tap the daemon makes in that bridge), exactly one of them, with an
/// optional MAC address and rate limits per direction; a request with
/// both or neither is refused. On the command line:
/// `tap=NAME|bridge=NAME[,mac=MAC][,rx_bw=SIZE/MS][,rx_ops=N/MS]
/// [,tx_bw=SIZE/MS][,tx_ops=N/MS]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// A unicast MAC address, such as 52:54:00:12:34:56 (default: a random
    /// 52:54:00 one the daemon assigns at create, unlike every other VM's,
    /// and keeps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}$")]
    pub mac: Option<String>,
    /// Towards the guest: bytes per time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_bandwidth: Option<RateSpec>,
    /// Towards the guest: frames per time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_ops: Option<RateSpec>,
    /// From the guest: bytes per time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_bandwidth: Option<RateSpec>,
    /// From the guest: frames per time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_ops: Option<RateSpec>,
}

/// Where an interface attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetAttach<'a> {
    Tap(&'a str),
    Bridge(&'a str),
}

impl NetSpec {
    /// Its tap or its bridge; an interface with both or neither is refused.
    pub fn attach(&self) -> Result<NetAttach<'_>, String> {
        match (&self.tap, &self.bridge) {
            (Some(t), None) => Ok(NetAttach::Tap(t)),
            (None, Some(b)) => Ok(NetAttach::Bridge(b)),
            _ => Err("a network interface names a tap or a bridge, exactly one of them".into()),
        }
    }

    /// The MAC, checked: six hex bytes, unicast.
    pub fn check_mac(&self) -> Result<(), String> {
        let Some(m) = &self.mac else { return Ok(()) };
        let bytes: Vec<&str> = m.split(':').collect();
        let hex = bytes.len() == 6 && bytes.iter().all(|b| b.len() == 2 && b.bytes().all(|c| c.is_ascii_hexdigit()));
        let unicast = hex && u8::from_str_radix(bytes[0], 16).is_ok_and(|b| b & 1 == 0);
        if !unicast {
            return Err(format!("invalid MAC address '{m}': six hex bytes (52:54:00:12:34:56), unicast"));
        }
        Ok(())
    }
}

impl std::str::FromStr for NetSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut n = NetSpec::default();
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("tap", v)) if !v.is_empty() => n.tap = Some(v.into()),
                Some(("bridge", v)) if !v.is_empty() => n.bridge = Some(v.into()),
                Some(("mac", v)) => n.mac = Some(v.into()),
                Some(("rx_bw", r)) => n.rx_bandwidth = Some(r.parse()?),
                Some(("rx_ops", r)) => n.rx_ops = Some(r.parse()?),
                Some(("tx_bw", r)) => n.tx_bandwidth = Some(r.parse()?),
                Some(("tx_ops", r)) => n.tx_ops = Some(r.parse()?),
                _ => return Err(format!("invalid network interface part '{part}': use tap=NAME or bridge=NAME, then mac=, rx_bw=, rx_ops=, tx_bw=, tx_ops=")),
            }
        }
        n.attach()?;
        n.check_mac()?;
        Ok(n)
    }
}

/// The VM's vGPU: a VM tenant created with it and deleted with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, clap::Args, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VgpuSpec {
    /// vGPU memory quota (a size such as 256MiB); without it the VM has no
    /// vGPU.
    #[arg(id = "vgpu_memory", long = "vgpu-memory", value_name = "SIZE", required = false)]
    pub memory: Size,
    /// Compute share weight (1..=10000; default 1). (A default only with
    /// --vgpu-memory, so that no vGPU flag at all means no vGPU.)
    #[arg(long, required = false, requires = "vgpu_memory", default_value_if("vgpu_memory", clap::builder::ArgPredicate::IsPresent, Some("1")))]
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 10000, default = 1)]
    pub weight: u32,
    /// Hard cap: percent of the device's time (1..=100; default none).
    #[arg(long, requires = "vgpu_memory")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 100)]
    pub cap: Option<u32>,
    /// The pool whose placement policy picks the device (default: `default`).
    #[arg(long, requires = "vgpu_memory")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

fn one() -> u32 {
    1
}

/// A managed VM: its shape, what it boots, and its vGPU. Give a kernel
/// (with an optional initramfs and cmdline). Without `vgpu` the VM has no
/// vGPU. A `boot_disk` is refused (vgpu-vmm has no firmware: give the root
/// disk in `disks` and `root=/dev/vda` in `cmdline`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, clap::Args, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[command(group(clap::ArgGroup::new("boot").required(true).args(["kernel", "boot_disk"])))]
pub struct VmSpec {
    /// The VM's name (its vGPU tenant has the same name).
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$", example = "vm1")]
    pub name: String,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1)]
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 64, default = 1)]
    pub vcpus: u32,
    /// Guest memory (a size such as 512MiB).
    #[arg(long, value_name = "SIZE")]
    pub memory: Size,
    /// Back guest memory with hugepages of this size (none, 2M or 1G),
    /// reserved on the vGPU's NUMA node.
    #[arg(long, value_name = "SIZE")]
    #[serde(default, skip_serializing_if = "is_none")]
    pub hugepages: Option<Hugepages>,
    /// Kernel to boot: an ELF vmlinux or a bzImage (an absolute path).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub kernel: Option<PathBuf>,
    /// An initramfs for the kernel.
    #[arg(long, requires = "kernel")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub initramfs: Option<PathBuf>,
    /// The kernel's command line.
    #[arg(long, requires = "kernel")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 2048)]
    pub cmdline: Option<String>,
    /// A bootable disk image instead of a kernel.
    #[arg(long, value_name = "IMAGE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub boot_disk: Option<PathBuf>,
    /// A disk ([path=]PATH[,ro][,direct][,id=ID][,bw=SIZE/MS][,ops=N/MS]);
    /// repeat for more.
    #[arg(long = "disk", value_name = "PATH[,ro][,direct][,id=ID][,bw=SIZE/MS][,ops=N/MS]")]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(max_items = 16)]
    pub disks: Vec<DiskSpec>,
    /// A network interface (tap=NAME or bridge=NAME, then optionally
    /// mac=MAC, rx_bw=SIZE/MS, rx_ops=N/MS, tx_bw=SIZE/MS, tx_ops=N/MS);
    /// repeat for more.
    #[arg(long = "net", value_name = "tap=NAME|bridge=NAME[,mac=..][,rx_bw=..]..")]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(max_items = 8)]
    pub nets: Vec<NetSpec>,
    /// The VM's vGPU (none: a VM with only passthrough devices, or none).
    #[command(flatten)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<VgpuSpec>,
    /// Lend the VM a whole device from this passthrough pool (a GPU, given
    /// to it alone with VFIO and scrubbed when it comes back); repeat for
    /// more.
    #[arg(long = "passthrough", value_name = "POOL")]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(max_items = 8)]
    pub passthrough: Vec<String>,
    /// What to do when the VM's VMM exits without being asked to.
    #[arg(long, value_enum, default_value_t)]
    #[serde(default)]
    #[schema(default = "on-failure")]
    pub restart: RestartPolicy,
}

fn is_none(h: &Option<Hugepages>) -> bool {
    matches!(h, None | Some(Hugepages::None))
}

/// A passthrough device lent to a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Lease {
    pub device: String,
    /// PCI address, DDDD:BB:DD.F.
    pub address: String,
    pub numa_node: i32,
}

/// Where a VM is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum VmState {
    /// Its VMM is being started.
    Starting,
    Running,
    /// Asked to stop; its VMM is ending.
    Stopping,
    Stopped,
    /// Its VMM ended on its own and the restart policy brings it back after
    /// a back-off.
    Restarting,
    /// Could not be started (its error says why); retried with back-off.
    Failed,
}

/// A VM as the API reports it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = Vm)]
pub struct VmView {
    pub name: String,
    pub state: VmState,
    /// Whether the VM should be `running`, `stopped` or is being `deleted`
    /// (kept across daemon restarts).
    pub desired: String,
    pub spec: VmSpec,
    /// The device its vGPU is on.
    #[serde(default)]
    pub device: String,
    /// That device's pool.
    #[serde(default)]
    pub pool: String,
    /// The vGPU's device's NUMA node (else its first passthrough device's),
    /// where the VM runs (-1: unknown).
    pub numa_node: i32,
    /// The passthrough devices lent to it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passthrough: Vec<Lease>,
    /// The VMM's process id (0 while none runs).
    pub pid: u32,
    /// Times the daemon started the VMM again after it ended on its own.
    pub restarts: u64,
    /// How the last VMM ended (`exit 0`, `signal 9`), if one has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<String>,
    /// Why the last start failed, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The VMM's own API (docs/api/vmm.yaml; `vgpuctl vmm --socket`).
    #[schema(value_type = String)]
    pub api_socket: PathBuf,
    /// The file the guest's serial console goes to.
    #[schema(value_type = String)]
    pub console_log: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_description_round_trips_and_unknown_fields_are_refused() {
        let v: VmSpec = serde_json::from_str(r#"{"name":"a","memory":"512MiB","kernel":"/k","vgpu":{"memory":"64MiB"},"disks":[{"path":"/d","read_only":true}],"nets":[{"tap":"tap0"}]}"#).unwrap();
        assert_eq!(v.vcpus, 1);
        assert_eq!(v.vgpu.as_ref().map(|g| g.weight), Some(1));
        assert!(v.passthrough.is_empty());
        assert_eq!(v.restart, RestartPolicy::OnFailure);
        assert_eq!(v.nets, vec![NetSpec { tap: Some("tap0".into()), ..NetSpec::default() }]);
        let back: VmSpec = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
        assert_eq!(back, v);
        let e = serde_json::from_str::<VmSpec>(r#"{"name":"a","memory":"1MiB","kernel":"/k","vgpu":{"memory":"1MiB"},"gpu":1}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `gpu`"), "{e}");
    }

    #[test]
    fn command_line_forms_parse_and_bad_ones_say_what_to_use() {
        assert_eq!("/img,ro".parse::<DiskSpec>().unwrap(), DiskSpec { read_only: true, ..DiskSpec::new("/img".into()) });
        assert_eq!("/img".parse::<DiskSpec>().unwrap(), DiskSpec::new("/img".into()));
        // The VMM's form is the same disk.
        assert_eq!("path=/img,ro,direct,id=root".parse::<DiskSpec>().unwrap(), DiskSpec { read_only: true, direct: true, id: Some("root".into()), ..DiskSpec::new("/img".into()) });
        assert!("ro".parse::<DiskSpec>().unwrap_err().contains("needs path=PATH"));
        assert!("/img,id=twenty-one-bytes-long".parse::<DiskSpec>().unwrap_err().contains("20 ASCII bytes"));
        let d = "/img,bw=10MiB/1000,ops=500/100".parse::<DiskSpec>().unwrap();
        assert_eq!((d.bandwidth.map(|r| r.to_string()), d.ops.map(|r| r.to_string())), (Some("10485760/1000".into()), Some("500/100".into())));
        assert!(",ro".parse::<DiskSpec>().unwrap_err().contains("PATH[,ro]"));
        assert!("/img,fast".parse::<DiskSpec>().unwrap_err().contains("invalid --disk part 'fast'"));
        assert!("/img,bw=0/1000".parse::<DiskSpec>().unwrap_err().contains("positive"));
        assert!("/img,bw=1MiB".parse::<DiskSpec>().unwrap_err().contains("AMOUNT/MILLISECONDS"));
        assert_eq!("bridge=br0".parse::<NetSpec>().unwrap(), NetSpec { bridge: Some("br0".into()), ..NetSpec::default() });
        let n = "tap=t0,mac=52:54:00:aa:bb:cc,rx_bw=1MiB/100,tx_ops=100/1000".parse::<NetSpec>().unwrap();
        assert_eq!((n.attach(), n.mac.as_deref()), (Ok(NetAttach::Tap("t0")), Some("52:54:00:aa:bb:cc")));
        assert!(n.rx_bandwidth.is_some() && n.tx_ops.is_some() && n.rx_ops.is_none());
        assert!("tap=".parse::<NetSpec>().unwrap_err().contains("tap=NAME"));
        assert!("eth0".parse::<NetSpec>().is_err());
        assert!("tap=a,bridge=b".parse::<NetSpec>().unwrap_err().contains("exactly one"));
        assert!("tap=a,mac=01:00:5e:00:00:01".parse::<NetSpec>().unwrap_err().contains("unicast"));
        assert!("tap=a,mac=52:54:00:aa:bb".parse::<NetSpec>().unwrap_err().contains("six hex bytes"));
        assert_eq!("2M".parse::<Hugepages>().unwrap(), Hugepages::TwoMiB);
        assert!("3M".parse::<Hugepages>().is_err());
    }
}

#[cfg(test)]
mod cli_tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        vm: VmSpec,
    }

    fn parse(args: &[&str]) -> Result<VmSpec, String> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|c| c.vm).map_err(|e| e.to_string())
    }

    #[test]
    fn the_vgpu_is_there_when_its_flags_are_and_passthrough_pools_repeat() {
        let v = parse(&["a", "--memory", "64MiB", "--kernel", "/k", "--vgpu-memory", "32MiB"]).unwrap();
        assert_eq!(v.vgpu, Some(VgpuSpec { memory: Size(32 << 20), weight: 1, cap: None, pool: None }));
        let v = parse(&["a", "--memory", "64MiB", "--kernel", "/k", "--passthrough", "whole", "--passthrough", "more"]).unwrap();
        assert_eq!((v.vgpu, v.passthrough), (None, vec!["whole".to_string(), "more".to_string()]));
        let e = parse(&["a", "--memory", "64MiB", "--kernel", "/k", "--weight", "3"]).unwrap_err();
        assert!(e.contains("--vgpu-memory"), "{e}");
    }
}
