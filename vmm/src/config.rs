//! The VM description (`vgpu_api::vmm`: what `--config FILE.json` holds,
//! what `GET /vm` returns under `config`, and what the command-line flags
//! fill in) and the checks of it that need this host: files, memory,
//! devices.

use vgpu_api::size::Size;
pub use vgpu_api::vmm::*;

/// Both buckets of a rate limit, as the devices take them.
fn rate_limit(bandwidth: Option<RateSpec>, ops: Option<RateSpec>) -> crate::devices::virtio::rate_limit::RateLimit {
    let bucket = |b: RateSpec| crate::devices::virtio::rate_limit::Bucket { size: b.size.0, refill: std::time::Duration::from_millis(b.refill_ms) };
    crate::devices::virtio::rate_limit::RateLimit { bandwidth: bandwidth.map(bucket), ops: ops.map(bucket) }
}

/// A disk's rate limits, as its device takes them.
pub fn disk_limit(d: &DiskSpec) -> crate::devices::virtio::rate_limit::RateLimit {
    rate_limit(d.bandwidth, d.ops)
}

/// A network interface's rate limits towards the guest and from it.
pub fn net_limits(n: &NetConfig) -> (crate::devices::virtio::rate_limit::RateLimit, crate::devices::virtio::rate_limit::RateLimit) {
    (rate_limit(n.rx_bandwidth, n.rx_ops), rate_limit(n.tx_bandwidth, n.tx_ops))
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

/// Reads a JSON description (`--config FILE`).
pub fn from_json_file(path: &std::path::Path) -> Result<VmConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read { path: path.display().to_string(), err })?;
    serde_json::from_str(&text).map_err(|e| ConfigError::Parse { path: path.display().to_string(), err: e.to_string() })
}

/// The checks of a description that need this host.
pub trait Validate {
    /// Checks everything that can be checked before touching KVM: counts,
    /// sizes against the host, files that must exist.
    fn validate(&self) -> Result<(), ConfigError>;
}

impl Validate for VmConfig {
    fn validate(&self) -> Result<(), ConfigError> {
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
                b.map_or(Ok(()), |b| b.check()).map_err(|e| ConfigError::Invalid(format!("disk {} {what}: {e}", d.path.display())))?;
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
                b.map_or(Ok(()), |b| b.check()).map_err(|e| ConfigError::Invalid(format!("net {i} {what}: {e}")))?;
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
        let disk = DiskSpec::new;
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
        assert_eq!(n.rx_bandwidth, Some(RateSpec { size: Size(10 << 20), refill_ms: 1000 }));
        assert_eq!(n.tx_ops, Some(RateSpec { size: Size(100), refill_ms: 10 }));
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
        c.nets[0].rx_ops = Some(RateSpec { size: Size(0), refill_ms: 10 });
        assert!(c.validate().unwrap_err().to_string().contains("amount must be positive"));
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
