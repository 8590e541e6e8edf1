//! KVM tier: virtio-net over a tap. The test makes a persistent tap with
//! ip(8) and watches it through an AF_PACKET socket; the bare-metal test
//! guest drives `vgpu-vmm --net tap=NAME` through the modern virtio-pci
//! transport: it prints the MAC from the config space, sends a broadcast
//! frame that the test sees with that MAC as its source, and receives the
//! test's reply, after an oversize frame that fits none of its buffers and
//! that the device drops without using one up. The same exchange runs
//! with the VMM jailed (the tap opened before the jail's empty network
//! namespace). Bad `--net` values are refused before the VM starts.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use vgpu_tests::report_skip;
use vgpu_tests::vmm_harness::*;

const ETHERTYPE: [u8; 2] = [0x88, 0xb5];

/// Root, /dev/kvm and /dev/net/tun; otherwise says loudly why not.
fn net_possible(test: &str) -> bool {
    if !kvm_available(test) {
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        report_skip(test, "making a tap and a packet socket needs root");
        return false;
    }
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun") {
        report_skip(test, &format!("/dev/net/tun is not usable here ({e})"));
        return false;
    }
    true
}

/// A persistent tap made with `ip tuntap add`, up, with IPv6 off (no
/// router solicitations in the guest's way) and an MTU of 2000; deleted
/// when dropped, whether the test passed or not.
struct TapGuard {
    name: String,
}

impl TapGuard {
    /// `None` (with a loud skip) when ip(8) cannot make taps here.
    fn create(test: &str, tag: &str) -> Option<TapGuard> {
        // "vgn" + pid (at most 7 digits) + tag: under 16 bytes.
        let name = format!("vgn{}{tag}", std::process::id());
        assert!(name.len() < 16, "{name}");
        let _ = Command::new("ip").args(["tuntap", "del", "dev", &name, "mode", "tap"]).output();
        match Command::new("ip").args(["tuntap", "add", "dev", &name, "mode", "tap"]).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                report_skip(test, &format!("ip tuntap add failed here: {}", String::from_utf8_lossy(&o.stderr).trim()));
                return None;
            }
            Err(e) => {
                report_skip(test, &format!("ip(8) could not run: {e}"));
                return None;
            }
        }
        let g = TapGuard { name };
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", g.name), "1");
        let o = Command::new("ip").args(["link", "set", "dev", &g.name, "mtu", "2000", "up"]).output().expect("ip link set");
        assert!(o.status.success(), "ip link set {} up: {}", g.name, String::from_utf8_lossy(&o.stderr));
        Some(g)
    }
}

impl Drop for TapGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["tuntap", "del", "dev", &self.name, "mode", "tap"]).output();
    }
}

/// An AF_PACKET socket bound to one interface: every frame it carries.
struct PacketSocket(OwnedFd);

impl PacketSocket {
    fn bind(ifname: &str) -> PacketSocket {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: socket(2) with integer arguments.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto as i32) };
        assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let c = CString::new(ifname).expect("interface name");
        // SAFETY: c is a NUL-terminated string.
        let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
        assert_ne!(index, 0, "no interface {ifname}");
        // SAFETY: an all-zero sockaddr_ll is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = index as i32;
        // SAFETY: sll is a sockaddr_ll, passed with its own size.
        let rc = unsafe { libc::bind(fd.as_raw_fd(), (&sll as *const libc::sockaddr_ll).cast(), std::mem::size_of::<libc::sockaddr_ll>() as u32) };
        assert_eq!(rc, 0, "binding the packet socket to {ifname}: {}", std::io::Error::last_os_error());
        let tv = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
        // SAFETY: SO_RCVTIMEO reads one timeval, passed with its size.
        let rc = unsafe { libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), std::mem::size_of::<libc::timeval>() as u32) };
        assert_eq!(rc, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        PacketSocket(fd)
    }

    /// One frame, or `None` after 100 ms without one.
    fn recv(&self, buf: &mut [u8]) -> Option<usize> {
        // SAFETY: writes at most buf.len() bytes into buf.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        (n >= 0).then_some(n as usize)
    }

    fn send(&self, frame: &[u8]) {
        // SAFETY: reads frame.len() bytes from frame.
        let n = unsafe { libc::send(self.0.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        assert_eq!(n, frame.len() as isize, "sending a frame of {} bytes: {}", frame.len(), std::io::Error::last_os_error());
    }
}

/// An Ethernet frame of ethertype 0x88B5, padded to 60 bytes.
fn frame(dst: [u8; 6], src: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE);
    f.extend_from_slice(payload);
    f.resize(f.len().max(60), 0);
    f
}

fn parse_mac(s: &str) -> [u8; 6] {
    let v: Vec<u8> = s.split(':').map(|b| u8::from_str_radix(b, 16).expect("hex byte")).collect();
    v.try_into().expect("six bytes")
}

/// What one run showed: the MAC the guest printed, and the time from the
/// host's first frame to the VMM's exit.
struct Seen {
    mac: [u8; 6],
    rx_time: Duration,
}

/// Runs the guest with `--net tap=NAME{net_opts}` and `extra` VMM
/// arguments: takes its frame, then sends it a frame of another ethertype
/// (which it skips), one bigger than its buffers (which the device drops),
/// and the reply it waits for.
fn exchange(tap: &TapGuard, net_opts: &str, extra: &[&str]) -> Seen {
    // Bound before the VMM starts, so the guest's frame cannot be missed.
    let sock = PacketSocket::bind(&tap.name);
    let net = format!("tap={}{net_opts}", tap.name);
    let mut args = vec!["--net", net.as_str()];
    args.extend_from_slice(extra);
    let mut g = Guest::start("net", &args);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = vec![0u8; 4096];
    let seen = loop {
        if let Some(n) = sock.recv(&mut buf) {
            let f = &buf[..n];
            if n >= 30 && f[12..14] == ETHERTYPE && f[14..].starts_with(b"FRAME-FROM-GUEST") {
                break f.to_vec();
            }
        }
        if let Ok(Some(st)) = g.child.try_wait() {
            panic!("the VMM exited ({st}) before the guest's frame reached the tap; serial:\n{}", g.serial_text());
        }
        assert!(Instant::now() < deadline, "no frame from the guest on {} within 60 s; serial:\n{}", tap.name, g.serial_text());
    };
    let out = g.wait_for("NET-TX sent", Duration::from_secs(30));
    let line = out.lines().find(|l| l.starts_with("NET mac ")).expect("the guest prints its MAC");
    let printed = line.split_whitespace().nth(2).expect("a MAC after 'NET mac'");
    assert!(line.ends_with("status 1 mtu 1500"), "link up, MTU 1500: {line}");
    let mac = parse_mac(printed);
    assert_eq!(seen[..6], [0xff; 6], "broadcast destination");
    assert_eq!(seen[6..12], mac, "the frame's source is the MAC the guest read from the config space");
    assert_eq!(seen.len(), 60, "the frame as the guest wrote it, without the virtio header");
    // GET /vm shows the address the guest got.
    g.wait_api();
    let (code, body) = g.api_call("GET", "/vm");
    assert_eq!(code, 200, "{body}");
    let info: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(info["config"]["nets"][0]["mac"], printed, "{body}");
    assert_eq!(info["config"]["nets"][0]["tap"], tap.name.as_str(), "{body}");
    let host = [0x02, 0, 0, 0, 0, 0x01];
    let t0 = Instant::now();
    let mut decoy = frame(mac, host, b"NOT-FOR-THE-TEST");
    decoy[12..14].copy_from_slice(&[0x88, 0xb6]);
    sock.send(&decoy);
    // Bigger than every RX buffer of the guest (1518 bytes after the
    // header; the tap's MTU is 2000): dropped, its buffer kept for the
    // next frame.
    let mut big = frame(mac, host, b"TOO-BIG-FOR-THE-GUEST");
    big.resize(1600, 0x55);
    sock.send(&big);
    sock.send(&frame(mac, host, b"FRAME-FROM-HOST"));
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    let rx_time = t0.elapsed();
    assert_eq!(st.code(), Some(0), "stderr:\n{err}\nserial:\n{out}");
    assert!(out.contains("NET-RX skipped a frame of ethertype 88b6"), "{out}");
    assert!(out.contains("NET-RX len 72 num_buffers 1 payload FRAME-FROM-HOST"), "the reply, whole, after its 12-byte header: {out}");
    assert!(!out.contains("TOO-BIG"), "{out}");
    assert!(out.contains("TEST PASSED net"), "{out}");
    assert!(!err.contains("panicked"), "{err}");
    Seen { mac, rx_time }
}

#[test]
fn a_guest_sends_and_receives_ethernet_frames_through_virtio_net_over_a_tap() {
    let test = "a_guest_sends_and_receives_ethernet_frames_through_virtio_net_over_a_tap";
    if !net_possible(test) {
        return;
    }
    let Some(tap) = TapGuard::create(test, "a") else { return };
    let mac = exchange(&tap, "", &[]).mac;
    assert_eq!(mac[..3], [0x52, 0x54, 0x00], "the default MAC is 52:54:00 and three derived bytes");
    // The same tap in the same position gets the same address next time.
    assert_eq!(exchange(&tap, "", &[]).mac, mac);
}

#[test]
fn a_given_mac_is_used_and_an_rx_frame_limit_holds_frames_back() {
    let test = "a_given_mac_is_used_and_an_rx_frame_limit_holds_frames_back";
    if !net_possible(test) {
        return;
    }
    let Some(tap) = TapGuard::create(test, "m") else { return };
    // One frame per 1.5 s towards the guest: the decoy goes at once, the
    // reply waits for the bucket. The other buckets are loose.
    let s = exchange(&tap, ",mac=02:12:34:56:78:9a,rx_ops=1/1500,rx_bw=1MiB/100,tx_bw=1MiB/100,tx_ops=100/100", &[]);
    assert_eq!(s.mac, [0x02, 0x12, 0x34, 0x56, 0x78, 0x9a]);
    assert!(s.rx_time >= Duration::from_millis(1400), "the reply was not held back: {:?}", s.rx_time);
}

#[test]
fn a_jailed_vmm_uses_a_tap_opened_before_its_empty_network_namespace() {
    let test = "a_jailed_vmm_uses_a_tap_opened_before_its_empty_network_namespace";
    if !net_possible(test) {
        return;
    }
    match Command::new("unshare").args(["--mount", "--pid", "--net", "--fork", "true"]).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => return report_skip(test, &format!("this machine cannot create mount, PID and network namespaces: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => return report_skip(test, &format!("unshare(1) could not run to probe namespaces: {e}")),
    }
    let Some(tap) = TapGuard::create(test, "j") else { return };
    let dir = std::env::temp_dir().join(format!("vgpu-jail-{}-net", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.display().to_string();
    exchange(&tap, "", &["--jail", &d, "--jail-uid", "40124", "--jail-gid", "40124"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_net_arguments_are_refused_before_the_vm_starts() {
    let mut cases = vec![
        ("tap=a-name-of-16-chr", "at most 15 bytes"),
        ("tap=tap/0", "printable ASCII"),
        ("tap=tap 0", "printable ASCII"),
        ("mac=52:54:00:00:00:01", "needs tap=NAME"),
        ("tap=vt0,mac=52:54:00:00:01", "invalid MAC address"),
        ("tap=vt0,mac=01:00:5e:00:00:01", "not a unicast address"),
        ("tap=vt0,rx_bw=10MiB", "AMOUNT/MILLISECONDS"),
        ("tap=vt0,tx_ops=0/100", "AMOUNT/MILLISECONDS"),
        ("tap=vt0,queues=2", "invalid --net part"),
    ];
    // Refused when the tap is opened, which needs the VM (KVM), root and
    // /dev/net/tun.
    if net_possible("bad_net_arguments_are_refused_before_the_vm_starts (an interface that is not a tap)") {
        cases.push(("tap=lo", "is not a single-queue tap"));
    }
    for (arg, says) in cases {
        let o = std::process::Command::new(vgpu_tests::bin("vgpu-vmm")).arg("--kernel").arg(test_guest()).args(["--memory", "16", "--net", arg]).output().expect("vgpu-vmm");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "--net {arg} was accepted");
        assert!(err.contains(says), "--net {arg}: the error does not say {says:?}:\n{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // One tap per interface, and at most 8 interfaces.
    let mut args = vec!["--net".to_string(), "tap=vt0".to_string(), "--net".to_string(), "tap=vt0".to_string()];
    let o = std::process::Command::new(vgpu_tests::bin("vgpu-vmm")).arg("--kernel").arg(test_guest()).args(["--memory", "16"]).args(&args).output().expect("vgpu-vmm");
    assert!(String::from_utf8_lossy(&o.stderr).contains("named twice"), "{}", String::from_utf8_lossy(&o.stderr));
    args = (0..9).flat_map(|i| ["--net".to_string(), format!("tap=vt{i}")]).collect();
    let o = std::process::Command::new(vgpu_tests::bin("vgpu-vmm")).arg("--kernel").arg(test_guest()).args(["--memory", "16"]).args(&args).output().expect("vgpu-vmm");
    assert!(String::from_utf8_lossy(&o.stderr).contains("the limit is 8"), "{}", String::from_utf8_lossy(&o.stderr));
}
