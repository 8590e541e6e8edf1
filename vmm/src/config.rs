//! The VM description: what `--config FILE.json` holds, what `GET /vm`
//! returns under `config`, and what the command-line flags fill in.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};
use virtio_gpu_compute::size::{NumberOrText, Size};

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
        match NumberOrText::deserialize(d)? {
            NumberOrText::Number(n) => Ok(MemMiB(n)),
            NumberOrText::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
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
}

/// `--vgpu socket=PATH[,headless]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VgpuConfig {
    /// The VM tenant's vhost-user socket (`vgpuctl tenant create NAME --vm`).
    pub socket: PathBuf,
    /// Report no scanout (guests with Linux 6.4 or later accept that).
    #[serde(default)]
    pub headless: bool,
}

impl std::str::FromStr for VgpuConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut socket = None;
        let mut headless = false;
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("socket", p)) if !p.is_empty() => socket = Some(PathBuf::from(p)),
                None if part == "headless" => headless = true,
                _ => return Err(format!("invalid --vgpu part '{part}': use socket=PATH[,headless]")),
            }
        }
        Ok(VgpuConfig { socket: socket.ok_or("--vgpu needs socket=PATH")?, headless })
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
        Ok(())
    }
}

fn check_file(what: &str, p: &std::path::Path) -> Result<(), ConfigError> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(ConfigError::Invalid(format!("{what} {} is not a regular file", p.display()))),
        Err(e) => Err(ConfigError::Invalid(format!("{what} {}: {e}", p.display()))),
    }
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
}
