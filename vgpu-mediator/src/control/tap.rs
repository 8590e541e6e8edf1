//! Tap devices for managed VMs' `bridge=NAME` interfaces: the daemon makes
//! a persistent tap, puts it in the bridge and brings it up before the VMM
//! starts (which attaches to it by name), and removes it when the VM is
//! deleted. `tap=NAME` interfaces are the admin's own taps: the daemon only
//! passes their names on.
//!
//! Everything here is ioctls on `/dev/net/tun` and an AF_INET datagram
//! socket, the calls `ip tuntap` and `ip link set master` make; it needs
//! CAP_NET_ADMIN, as the daemon has when it runs as root.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// Linux's `IFNAMSIZ`: names are at most 15 bytes and a NUL.
const IFNAMSIZ: usize = 16;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// `_IOW('T', 202, int)`
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
/// `_IOW('T', 203, int)`
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
/// `_IOW('T', 204, int)`
const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;
const SIOCBRADDIF: libc::c_ulong = 0x89a2;

/// `struct ifreq` with the union as the flags or the index (both fit in
/// its first bytes; the rest pads it to the kernel's 40 bytes).
#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> io::Result<IfReq> {
        check_name(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mut r = IfReq { name: [0; IFNAMSIZ], data: [0; 24] };
        r.name[..name.len()].copy_from_slice(name.as_bytes());
        Ok(r)
    }

    fn set_short(&mut self, v: libc::c_short) {
        self.data[..2].copy_from_slice(&v.to_ne_bytes());
    }

    fn short(&self) -> libc::c_short {
        libc::c_short::from_ne_bytes([self.data[0], self.data[1]])
    }

    fn set_int(&mut self, v: libc::c_int) {
        self.data[..4].copy_from_slice(&v.to_ne_bytes());
    }

    fn int(&self) -> libc::c_int {
        libc::c_int::from_ne_bytes([self.data[0], self.data[1], self.data[2], self.data[3]])
    }
}

/// An interface name the kernel takes: 1 to 15 bytes of letters, digits,
/// `-`, `_` and `.`, not `.` or `..`.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok_chars = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if name.is_empty() || name.len() >= IFNAMSIZ || !ok_chars || name == "." || name == ".." {
        return Err(format!("invalid interface name '{name}': 1 to 15 letters, digits, '-', '_' or '.'"));
    }
    Ok(())
}

/// The tap the daemon makes for interface `index` of VM `vm`: the same
/// name every time (so a restarted daemon finds it), short enough for
/// IFNAMSIZ whatever the VM's name.
pub fn bridged_tap_name(vm: &str, index: usize) -> String {
    // FNV-1a over the VM's name.
    let h = vm.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3));
    format!("vgt{:08x}n{index}", (h ^ (h >> 32)) as u32)
}

/// Whether `name` is a bridge on this host.
pub fn is_bridge(sys: &Path, name: &str) -> bool {
    check_name(name).is_ok() && sys.join("class/net").join(name).join("bridge").is_dir()
}

fn ioctl(fd: &impl AsRawFd, req: libc::c_ulong, r: &mut IfReq) -> io::Result<()> {
    // SAFETY: every request used here reads or writes one `struct ifreq`,
    // which `IfReq` lays out in full (40 bytes); `r` outlives the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, r as *mut IfReq) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A tun ioctl whose argument is a value, not a pointer (TUNSETPERSIST,
/// TUNSETOWNER).
fn set_value(f: &File, req: libc::c_ulong, value: libc::c_ulong) -> io::Result<()> {
    // SAFETY: these requests read no memory: their argument is the value.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), req as _, value) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_persist(f: &File, on: bool) -> io::Result<()> {
    set_value(f, TUNSETPERSIST, libc::c_ulong::from(on))
}

fn inet_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments returns a new fd or -1.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_tap(name: &str) -> io::Result<File> {
    let f = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun")?;
    let mut r = IfReq::new(name)?;
    r.set_short(IFF_TAP | IFF_NO_PI | IFF_VNET_HDR);
    ioctl(&f, TUNSETIFF, &mut r)?;
    Ok(f)
}

/// Makes tap `tap` (persistent; kept if it exists), owned by `owner` (no
/// other user without CAP_NET_ADMIN can attach to it while its VMM does
/// not hold it), puts it in bridge `bridge` unless it is there already,
/// and brings it up.
pub fn make_bridged(sys: &Path, tap: &str, bridge: &str, owner: u32) -> io::Result<()> {
    let f = open_tap(tap)?;
    set_value(&f, TUNSETOWNER, libc::c_ulong::from(owner))?;
    set_persist(&f, true)?;
    drop(f);
    let s = inet_socket()?;
    let mut r = IfReq::new(tap)?;
    ioctl(&s, libc::SIOCGIFINDEX, &mut r)?;
    let index = r.int();
    let master = std::fs::read_link(sys.join("class/net").join(tap).join("master")).ok();
    if master.as_ref().and_then(|m| m.file_name()).is_none_or(|m| m != bridge) {
        let mut b = IfReq::new(bridge)?;
        b.set_int(index);
        ioctl(&s, SIOCBRADDIF, &mut b).map_err(|e| io::Error::new(e.kind(), format!("adding {tap} to bridge {bridge}: {e}")))?;
    }
    let mut r = IfReq::new(tap)?;
    ioctl(&s, libc::SIOCGIFFLAGS, &mut r)?;
    let flags = r.short() | libc::IFF_UP as libc::c_short;
    r.set_short(flags);
    ioctl(&s, libc::SIOCSIFFLAGS, &mut r)
}

/// Removes a tap [`make_bridged`] made (leaving the bridge goes with it).
/// A tap that is gone already is fine.
pub fn remove(sys: &Path, tap: &str) -> io::Result<()> {
    if !sys.join("class/net").join(tap).exists() {
        return Ok(());
    }
    let f = open_tap(tap)?;
    set_persist(&f, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_follow_the_kernel_rules() {
        assert!(check_name("tap0").is_ok());
        assert!(check_name("a.b-c_d").is_ok());
        assert!(check_name("123456789012345").is_ok());
        for bad in ["", "1234567890123456", "a/b", "a b", ".", "..", "tap:0", "é"] {
            assert!(check_name(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn a_vms_tap_names_are_stable_distinct_and_short() {
        let a = bridged_tap_name("web", 0);
        assert_eq!(a, bridged_tap_name("web", 0));
        assert_ne!(a, bridged_tap_name("web", 1));
        assert_ne!(a, bridged_tap_name("web2", 0));
        let long = bridged_tap_name(&"x".repeat(200), 7);
        assert!(check_name(&long).is_ok(), "{long}");
        assert!(check_name(&bridged_tap_name("web", 15)).is_ok());
    }

    #[test]
    fn an_ifreq_is_the_kernels_size() {
        assert_eq!(std::mem::size_of::<IfReq>(), 40);
    }
}

#[cfg(test)]
mod host_tests {
    use super::*;

    fn ip(args: &[&str]) -> bool {
        std::process::Command::new("ip").args(args).status().is_ok_and(|s| s.success())
    }

    /// Removes the test's bridge whatever happens.
    struct Bridge(String);
    impl Drop for Bridge {
        fn drop(&mut self) {
            ip(&["link", "del", &self.0]);
        }
    }

    #[test]
    fn a_bridged_tap_is_made_in_its_bridge_up_and_removed() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let br = format!("vgtbr{}", std::process::id() % 100_000);
        if !root || !Path::new("/dev/net/tun").exists() || !ip(&["link", "add", &br, "type", "bridge"]) {
            eprintln!("SKIPPED a_bridged_tap_is_made_in_its_bridge_up_and_removed: needs root, /dev/net/tun and ip(8) with bridges");
            return;
        }
        let _guard = Bridge(br.clone());
        let sys = Path::new("/sys");
        assert!(is_bridge(sys, &br));
        assert!(!is_bridge(sys, "lo"));
        let tap = bridged_tap_name(&br, 0);
        make_bridged(sys, &tap, &br, 0).expect("make the tap");
        assert_eq!(std::fs::read_to_string(sys.join("class/net").join(&tap).join("owner")).expect("owner").trim(), "0", "the tap is root's");
        let dir = sys.join("class/net").join(&tap);
        let master = std::fs::read_link(dir.join("master")).expect("the tap has a master");
        assert_eq!(master.file_name().and_then(|m| m.to_str()), Some(br.as_str()));
        let flags = std::fs::read_to_string(dir.join("flags")).expect("flags");
        assert_ne!(u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).expect("hex") & libc::IFF_UP as u32, 0, "the tap is not up");
        // Again (a VMM restart): it is kept, still in the bridge.
        make_bridged(sys, &tap, &br, 0).expect("make it again");
        assert!(sys.join("class/net").join(&br).join("brif").join(&tap).exists());
        // A VMM attached to it holds it; once that one is gone, it is removed.
        let held = open_tap(&tap).expect("attach as a VMM would");
        assert!(remove(sys, &tap).is_err(), "a tap in use cannot be removed");
        drop(held);
        remove(sys, &tap).expect("remove the tap");
        assert!(!dir.exists(), "the tap is still there");
        remove(sys, &tap).expect("removing a tap that is gone is fine");
    }
}
