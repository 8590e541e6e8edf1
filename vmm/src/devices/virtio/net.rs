//! virtio-net (network device, id 1) over a Linux tap: one RX and one TX
//! queue, no control queue, no multiqueue, no offloads; `MAC`, `STATUS`
//! (link always up) and `MTU` (1500), with Firecracker-style rate limits
//! (token buckets on bytes and on frames) per direction.
//!
//! The tap is opened with `IFF_VNET_HDR` and a vnet header of 12 bytes, the
//! size of the guest's `virtio_net_hdr_v1` under VERSION_1, so a frame moves
//! as one piece in both directions: TX gathers the guest's chain into a
//! bounce buffer and writes it to the tap with one `write`; RX reads one
//! frame from the tap into a bounce buffer and scatters it into the guest's
//! device-writable descriptors. No offload is negotiated, so the header is
//! all zeros both ways (the device clears it; `num_buffers` is 1 on RX):
//! neither the guest's nor the host kernel's GSO and checksum fields ever
//! cross. Guest memory is only touched with vm-memory's volatile copies,
//! and the device holds at most two bounce buffers of [`MAX_FRAME`] plus a
//! header whatever the guest does.
//!
//! The tap is opened once, by [`Tap::open`], before the VM runs (and before
//! a jail, whose network namespace is empty): see its documentation for
//! what that needs.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::rate_limit::{Limiter, RateLimit};
use super::{bump, worth_logging, DeviceThread, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};

const QUEUE_SIZE: u16 = 256;
/// `struct virtio_net_hdr_v1` (VERSION_1): flags, gso_type, hdr_len,
/// gso_size, csum_start, csum_offset, num_buffers.
pub const HDR_LEN: usize = 12;
/// An Ethernet header: the least a frame must carry.
pub const ETH_HLEN: usize = 14;
/// The longest frame (without the virtio header) either direction moves:
/// a tap's largest MTU (65535) plus its Ethernet header, rounded up.
pub const MAX_FRAME: usize = 65550;
/// The MTU the config space reports.
pub const MTU: u16 = 1500;
/// Longest interface name, NUL included (IFNAMSIZ).
pub const IFNAMSIZ: usize = 16;

const F_MTU: u64 = 1 << 3;
const F_MAC: u64 = 1 << 5;
const F_STATUS: u64 = 1 << 16;
const S_LINK_UP: u16 = 1;

const RX: usize = 0;
const TX: usize = 1;

const TUNTAP: u32 = 'T' as u32;
vmm_sys_util::ioctl_iow_nr!(TUNSETIFF, TUNTAP, 202, libc::c_int);
vmm_sys_util::ioctl_iow_nr!(TUNSETOFFLOAD, TUNTAP, 208, libc::c_uint);
vmm_sys_util::ioctl_iow_nr!(TUNSETVNETHDRSZ, TUNTAP, 216, libc::c_int);

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("tap name {name:?} {why}")]
    BadName { name: String, why: &'static str },
    #[error("tap {name}: opening /dev/net/tun: {err}")]
    OpenTun { name: String, err: std::io::Error },
    #[error("tap {name}: {what}: {err}{hint}")]
    Ioctl { name: String, what: &'static str, err: std::io::Error, hint: &'static str },
}

/// Checks a tap name as the kernel will take it and as this VMM allows:
/// 1 to 15 bytes, printable ASCII without '/', ':', '%' or spaces, and not
/// "." or "..". ('%' would let the kernel pick the name.)
pub fn check_tap_name(name: &str) -> Result<(), NetError> {
    const _: () = assert!(vgpu_api::vmm::MAX_TAP_NAME < IFNAMSIZ);
    match vgpu_api::vmm::tap_name_problem(name) {
        Some(why) => Err(NetError::BadName { name: name.to_string(), why }),
        None => Ok(()),
    }
}

/// `struct ifreq` as TUNSETIFF reads it: the name and the flags (the rest
/// of its 40 bytes is a union TUNSETIFF does not use).
#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: libc::c_short,
    _rest: [u8; 22],
}

const _: () = assert!(std::mem::size_of::<IfReq>() == 40);

/// An open tap queue: the descriptor the device reads and writes frames on.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

fn hint(err: &std::io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EPERM) => " (creating a tap needs CAP_NET_ADMIN; an existing tap must belong to this uid or gid: ip tuntap add dev NAME mode tap user UID)",
        Some(libc::EBUSY) => " (another process has this tap open)",
        Some(libc::EINVAL) => " (an interface of that name exists and is not a single-queue tap)",
        _ => "",
    }
}

impl Tap {
    /// Opens the tap `name` (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`),
    /// non-blocking, with a 12-byte vnet header and no offloads.
    ///
    /// An existing tap is attached to: it needs no privilege when it
    /// belongs to this process's uid or gid (`ip tuntap add dev NAME mode
    /// tap user UID`). A name that does not exist makes the kernel create
    /// a tap, which needs CAP_NET_ADMIN; that tap is not persistent and
    /// goes away with the VMM (and must still be brought up and attached
    /// to something by the host to carry traffic).
    pub fn open(name: &str) -> Result<Tap, NetError> {
        check_tap_name(name)?;
        let mut o = std::fs::OpenOptions::new();
        // O_CLOEXEC is std's default.
        std::os::unix::fs::OpenOptionsExt::custom_flags(o.read(true).write(true), libc::O_NONBLOCK);
        let file = o.open("/dev/net/tun").map_err(|err| NetError::OpenTun { name: name.to_string(), err })?;
        let ioctl_err = |what: &'static str| {
            let err = std::io::Error::last_os_error();
            NetError::Ioctl { name: name.to_string(), what, hint: hint(&err), err }
        };
        let mut req = IfReq { name: [0; IFNAMSIZ], flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short, _rest: [0; 22] };
        // check_tap_name keeps the name under IFNAMSIZ bytes: the last
        // byte stays NUL.
        for (d, s) in req.name.iter_mut().zip(name.bytes()) {
            *d = s;
        }
        // SAFETY: `file` is an open /dev/net/tun descriptor and `req` a
        // valid, NUL-terminated struct ifreq of the kernel's size, which
        // TUNSETIFF reads and may write back within those 40 bytes.
        if unsafe { vmm_sys_util::ioctl::ioctl_with_mut_ref(&file, TUNSETIFF(), &mut req) } < 0 {
            return Err(ioctl_err("TUNSETIFF"));
        }
        let hdr: libc::c_int = HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which
        // points at `hdr`, alive for the call.
        if unsafe { vmm_sys_util::ioctl::ioctl_with_ref(&file, TUNSETVNETHDRSZ(), &hdr) } < 0 {
            return Err(ioctl_err("TUNSETVNETHDRSZ"));
        }
        // SAFETY: TUNSETOFFLOAD takes its flags as the argument's value (no
        // pointer); 0 turns every offload off, so the kernel hands over only
        // whole, checksummed frames no larger than the tap's MTU.
        if unsafe { vmm_sys_util::ioctl::ioctl_with_val(&file, TUNSETOFFLOAD(), 0) } < 0 {
            return Err(ioctl_err("TUNSETOFFLOAD"));
        }
        Ok(Tap { file, name: name.to_string() })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Why a TX chain is refused (returned unused, counted as an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainError {
    /// A TX chain holds a device-writable descriptor, or an RX chain a
    /// device-readable one.
    WrongDirection,
    /// Less than a virtio header and an Ethernet header.
    TooShort(u64),
    /// More than a virtio header and [`MAX_FRAME`].
    TooLong(u64),
}

/// The length of the frame (virtio header included) a TX chain of
/// `(device_writable, len)` descriptors carries: all device-readable,
/// between `HDR_LEN + ETH_HLEN` and `HDR_LEN + MAX_FRAME` bytes.
pub fn tx_frame_len(descs: impl IntoIterator<Item = (bool, u32)>) -> Result<usize, ChainError> {
    let mut total = 0u64;
    for (writable, len) in descs {
        if writable {
            return Err(ChainError::WrongDirection);
        }
        total = total.saturating_add(len as u64);
    }
    if total < (HDR_LEN + ETH_HLEN) as u64 {
        return Err(ChainError::TooShort(total));
    }
    if total > (HDR_LEN + MAX_FRAME) as u64 {
        return Err(ChainError::TooLong(total));
    }
    Ok(total as usize)
}

/// How many bytes an RX chain of `(device_writable, len)` descriptors can
/// take: all device-writable, room at least for the virtio and Ethernet
/// headers (more than a whole frame counts as a whole frame).
pub fn rx_capacity(descs: impl IntoIterator<Item = (bool, u32)>) -> Result<usize, ChainError> {
    let mut total = 0u64;
    for (writable, len) in descs {
        if !writable {
            return Err(ChainError::WrongDirection);
        }
        total = total.saturating_add(len as u64);
    }
    if total < (HDR_LEN + ETH_HLEN) as u64 {
        return Err(ChainError::TooShort(total));
    }
    Ok(total.min((HDR_LEN + MAX_FRAME) as u64) as usize)
}

/// The device's counters (metrics and tests).
#[derive(Default, Debug)]
pub struct NetStats {
    pub rx_frames: AtomicU64,
    /// Ethernet bytes (without the virtio header) delivered to the guest.
    pub rx_bytes: AtomicU64,
    /// Frames read from the tap that fit no buffer the guest offered.
    pub rx_drops: AtomicU64,
    /// Malformed RX chains, tap read errors, buffers outside guest memory.
    pub rx_errors: AtomicU64,
    /// Times RX waited for its rate limiter.
    pub rx_throttled: AtomicU64,
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// Frames the tap would not take (full, or down).
    pub tx_drops: AtomicU64,
    /// Malformed TX chains, buffers outside guest memory, tap write errors.
    pub tx_errors: AtomicU64,
    pub tx_throttled: AtomicU64,
}

pub struct Net {
    tap: Arc<File>,
    name: String,
    mac: [u8; 6],
    rx_limit: RateLimit,
    tx_limit: RateLimit,
    pub stats: Arc<NetStats>,
    thread: Option<DeviceThread>,
}

impl Net {
    /// A device over an open tap, with the MAC address the guest reads.
    pub fn new(tap: Tap, mac: [u8; 6], rx_limit: RateLimit, tx_limit: RateLimit) -> Net {
        Net { tap: Arc::new(tap.file), name: tap.name, mac, rx_limit, tx_limit, stats: Arc::default(), thread: None }
    }

    /// The config space: mac, status, max_virtqueue_pairs, mtu.
    fn config(&self) -> [u8; 12] {
        let mut c = [0u8; 12];
        c[0..6].copy_from_slice(&self.mac);
        c[6..8].copy_from_slice(&S_LINK_UP.to_le_bytes());
        c[8..10].copy_from_slice(&1u16.to_le_bytes());
        c[10..12].copy_from_slice(&MTU.to_le_bytes());
        c
    }
}

/// Epoll tokens of the device thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    RxKick = 0,
    TxKick = 1,
    Tap = 2,
    Stop = 3,
}

impl Token {
    fn from_u64(v: u64) -> Option<Token> {
        [Token::RxKick, Token::TxKick, Token::Tap, Token::Stop].into_iter().find(|t| *t as u64 == v)
    }
}

/// An RX chain taken from the ring: where its bytes go.
struct RxBuf {
    head: u16,
    segs: Vec<(GuestAddress, u32)>,
    capacity: usize,
}

/// A TX chain taken from the ring: where its bytes come from.
struct TxFrame {
    head: u16,
    segs: Vec<(GuestAddress, u32)>,
    len: usize,
}

/// What the device thread owns.
struct Worker {
    mem: GuestMemoryMmap,
    rxq: Queue,
    txq: Queue,
    tap: Arc<File>,
    name: String,
    stats: Arc<NetStats>,
    irq: Arc<dyn Interrupt>,
    rx_limiter: Limiter,
    tx_limiter: Limiter,
    /// One frame read from the tap (header included), plus one byte to
    /// notice a frame too long for it.
    rx_bounce: Vec<u8>,
    tx_bounce: Vec<u8>,
    /// Bytes of a frame in `rx_bounce` not yet delivered (held back by
    /// the rate limiter or waiting for a buffer).
    rx_pending: Option<usize>,
    /// An RX chain taken from the ring, not yet used.
    rx_held: Option<RxBuf>,
    /// A TX chain the rate limiter held back.
    tx_held: Option<TxFrame>,
    /// The tap may have frames (edge-triggered: set by epoll, cleared by
    /// EAGAIN).
    tap_readable: bool,
}

/// Frames (or chains) one direction handles before the other gets a turn.
const BUDGET: usize = QUEUE_SIZE as usize;

/// How a direction's turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// Nothing to do until an event.
    Idle,
    /// The rate limiter holds a frame back for this long.
    Throttled(Duration),
    /// The budget ran out with work left: go again without sleeping.
    More,
}

/// A chain's head index and its descriptors: (device-writable, address,
/// length).
type Chain = (u16, Vec<(bool, GuestAddress, u32)>);

impl Worker {
    /// The next available chain of `q`; a broken available ring counts as
    /// an error in `errors` and as no chain.
    fn next_chain(q: &mut Queue, mem: &GuestMemoryMmap, dir: &str, errors: &AtomicU64) -> Option<Chain> {
        let chain = match q.iter(mem) {
            Ok(mut it) => it.next(),
            Err(e) => {
                if worth_logging(bump(errors)) {
                    tracing::warn!("virtio-net: bad {dir} available ring: {e}");
                }
                None
            }
        }?;
        let head = chain.head_index();
        // A chain has at most the queue's size of descriptors (virtio-queue
        // stops a longer or looping one).
        Some((head, chain.map(|d| (d.is_write_only(), d.addr(), d.len())).collect()))
    }

    /// Moves frames from the tap into the guest's RX buffers until either
    /// runs out, the rate limiter says wait, or the budget is spent.
    fn rx(&mut self) -> Turn {
        let mut used = false;
        let mut turn = Turn::Idle;
        let mut budget = BUDGET;
        loop {
            if budget == 0 {
                turn = Turn::More;
                break;
            }
            budget -= 1;
            let buf = match self.rx_held.take() {
                Some(b) => b,
                None => {
                    let Some((head, descs)) = Worker::next_chain(&mut self.rxq, &self.mem, "RX", &self.stats.rx_errors) else { break };
                    match rx_capacity(descs.iter().map(|&(w, _, l)| (w, l))) {
                        Ok(capacity) => RxBuf { head, segs: descs.iter().map(|&(_, a, l)| (a, l)).collect(), capacity },
                        Err(e) => {
                            if worth_logging(bump(&self.stats.rx_errors)) {
                                tracing::warn!(tap = %self.name, "virtio-net: malformed RX chain ({e:?}); returned unused");
                            }
                            used |= self.rxq.add_used(&self.mem, head, 0).is_ok();
                            continue;
                        }
                    }
                }
            };
            let n = match self.rx_pending {
                Some(n) => n,
                None => {
                    if !self.tap_readable {
                        self.rx_held = Some(buf);
                        break;
                    }
                    match (&*self.tap).read(&mut self.rx_bounce) {
                        Ok(0) => {
                            self.tap_readable = false;
                            self.rx_held = Some(buf);
                            break;
                        }
                        Ok(n) => n,
                        Err(e) if e.kind() == ErrorKind::Interrupted => {
                            self.rx_held = Some(buf);
                            continue;
                        }
                        Err(e) => {
                            if e.kind() != ErrorKind::WouldBlock && worth_logging(bump(&self.stats.rx_errors)) {
                                tracing::warn!(tap = %self.name, "virtio-net: reading the tap: {e}");
                            }
                            self.tap_readable = false;
                            self.rx_held = Some(buf);
                            break;
                        }
                    }
                }
            };
            self.rx_pending = None;
            if !(HDR_LEN + ETH_HLEN..=HDR_LEN + MAX_FRAME).contains(&n) || n > buf.capacity {
                // Too short to be a frame, truncated, or bigger than the
                // guest's buffer: dropped; the buffer waits for the next.
                bump(&self.stats.rx_drops);
                self.rx_held = Some(buf);
                continue;
            }
            if let Err(d) = self.rx_limiter.admit((n - HDR_LEN) as u64, Instant::now()) {
                bump(&self.stats.rx_throttled);
                self.rx_pending = Some(n);
                self.rx_held = Some(buf);
                turn = Turn::Throttled(d);
                break;
            }
            let written = self.deliver(&buf, n);
            used |= self.rxq.add_used(&self.mem, buf.head, written as u32).is_ok();
        }
        if used && self.rxq.needs_notification(&self.mem).unwrap_or(true) {
            self.irq.signal_queue(RX);
        }
        turn
    }

    /// Copies the `n`-byte frame in the RX bounce buffer into `buf`'s
    /// descriptors; returns the bytes written (0 when a descriptor lies
    /// outside guest memory: the frame is lost).
    fn deliver(&mut self, buf: &RxBuf, n: usize) -> usize {
        let Some(frame) = self.rx_bounce.get_mut(..n) else { return 0 };
        // No offload was negotiated: flags, GSO and checksum fields are
        // zero, and num_buffers is 1 (no MRG_RXBUF).
        if let Some(h) = frame.get_mut(..HDR_LEN) {
            h.fill(0);
            h[10] = 1;
        }
        let mut off = 0usize;
        for &(addr, len) in &buf.segs {
            if off >= n {
                break;
            }
            let k = (len as usize).min(n - off);
            let ok = frame.get(off..off + k).is_some_and(|part| self.mem.write_slice(part, addr).is_ok());
            if !ok {
                if worth_logging(bump(&self.stats.rx_errors)) {
                    tracing::warn!(tap = %self.name, "virtio-net: an RX buffer outside guest memory; frame dropped");
                }
                return 0;
            }
            off += k;
        }
        bump(&self.stats.rx_frames);
        self.stats.rx_bytes.fetch_add((n - HDR_LEN) as u64, Ordering::Relaxed);
        n
    }

    /// Sends the guest's TX chains to the tap until the ring is empty, the
    /// rate limiter says wait, or the budget is spent.
    fn tx(&mut self) -> Turn {
        let mut used = false;
        let mut turn = Turn::Idle;
        let mut budget = BUDGET;
        loop {
            if budget == 0 {
                turn = Turn::More;
                break;
            }
            budget -= 1;
            let f = match self.tx_held.take() {
                Some(f) => f,
                None => {
                    let Some((head, descs)) = Worker::next_chain(&mut self.txq, &self.mem, "TX", &self.stats.tx_errors) else { break };
                    match tx_frame_len(descs.iter().map(|&(w, _, l)| (w, l))) {
                        Ok(len) => TxFrame { head, segs: descs.iter().map(|&(_, a, l)| (a, l)).collect(), len },
                        Err(e) => {
                            if worth_logging(bump(&self.stats.tx_errors)) {
                                tracing::warn!(tap = %self.name, "virtio-net: malformed TX chain ({e:?}); frame dropped");
                            }
                            used |= self.txq.add_used(&self.mem, head, 0).is_ok();
                            continue;
                        }
                    }
                }
            };
            if let Err(d) = self.tx_limiter.admit((f.len - HDR_LEN) as u64, Instant::now()) {
                bump(&self.stats.tx_throttled);
                self.tx_held = Some(f);
                turn = Turn::Throttled(d);
                break;
            }
            self.send(&f);
            used |= self.txq.add_used(&self.mem, f.head, 0).is_ok();
        }
        if used && self.txq.needs_notification(&self.mem).unwrap_or(true) {
            self.irq.signal_queue(TX);
        }
        turn
    }

    /// Gathers one checked frame into the TX bounce buffer and writes it
    /// to the tap.
    fn send(&mut self, f: &TxFrame) {
        let mut off = 0usize;
        for &(addr, len) in &f.segs {
            let end = off + len as usize;
            let ok = self.tx_bounce.get_mut(off..end).is_some_and(|part| self.mem.read_slice(part, addr).is_ok());
            if !ok {
                if worth_logging(bump(&self.stats.tx_errors)) {
                    tracing::warn!(tap = %self.name, "virtio-net: a TX buffer outside guest memory; frame dropped");
                }
                return;
            }
            off = end;
        }
        let Some(frame) = self.tx_bounce.get_mut(..f.len) else { return };
        // No offload was negotiated: whatever the guest put in the header
        // means nothing, and the host kernel sees zeros.
        if let Some(h) = frame.get_mut(..HDR_LEN) {
            h.fill(0);
        }
        let r = loop {
            match (&*self.tap).write(frame) {
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                r => break r,
            }
        };
        match r {
            Ok(n) if n == f.len => {
                bump(&self.stats.tx_frames);
                self.stats.tx_bytes.fetch_add((f.len - HDR_LEN) as u64, Ordering::Relaxed);
            }
            // Full (non-blocking), or the tap is down (EIO): dropped, as a
            // NIC with no room drops.
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.raw_os_error() == Some(libc::EIO) => {
                bump(&self.stats.tx_drops);
            }
            r => {
                if worth_logging(bump(&self.stats.tx_errors)) {
                    tracing::warn!(tap = %self.name, "virtio-net: writing a frame of {} bytes to the tap: {r:?}", f.len);
                }
            }
        }
    }

    fn run(&mut self, ep: &Epoll, rx_kick: &EventFd, tx_kick: &EventFd) {
        let mut events = vec![EpollEvent::default(); 4];
        loop {
            let turns = [self.rx(), self.tx()];
            let wait = turns.iter().filter_map(|t| if let Turn::Throttled(d) = t { Some(*d) } else { None }).min();
            let timeout = if turns.contains(&Turn::More) { 0 } else { wait.map_or(-1, |d| d.as_millis().clamp(1, i32::MAX as u128) as i32) };
            let n = match ep.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return tracing::error!("virtio-net: epoll wait: {e}"),
            };
            for ev in events.iter().take(n) {
                match Token::from_u64(ev.data()) {
                    Some(Token::Stop) | None => return,
                    Some(Token::RxKick) => {
                        let _ = rx_kick.read();
                    }
                    Some(Token::TxKick) => {
                        let _ = tx_kick.read();
                    }
                    Some(Token::Tap) => self.tap_readable = true,
                }
            }
        }
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u16 {
        1
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | F_MAC | F_STATUS | F_MTU
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE, QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let cfg = self.config();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset.checked_add(i as u64).and_then(|o| cfg.get(o as usize)).copied().unwrap_or(0);
        }
    }

    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, kicks: Vec<EventFd>, irq: Arc<dyn Interrupt>) -> Result<(), String> {
        if queues.len() != 2 || kicks.len() != 2 {
            return Err("virtio-net needs its RX and TX queues enabled".into());
        }
        let mut qs = queues.into_iter();
        let mut ks = kicks.into_iter();
        let (Some(rxq), Some(txq), Some(rx_kick), Some(tx_kick)) = (qs.next(), qs.next(), ks.next(), ks.next()) else { return Err("virtio-net needs its RX and TX queues enabled".into()) };
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())?;
        let stop2 = stop.try_clone().map_err(|e| e.to_string())?;
        let now = Instant::now();
        let mut w = Worker {
            mem,
            rxq,
            txq,
            tap: self.tap.clone(),
            name: self.name.clone(),
            stats: self.stats.clone(),
            irq,
            rx_limiter: Limiter::new(self.rx_limit, now),
            tx_limiter: Limiter::new(self.tx_limit, now),
            rx_bounce: Vec::new(),
            tx_bounce: Vec::new(),
            rx_pending: None,
            rx_held: None,
            tx_held: None,
            // Frames may have queued before the driver started.
            tap_readable: true,
        };
        let worker = std::thread::Builder::new()
            .name("virtio-net".into())
            .spawn(move || {
                let ep = match Epoll::new() {
                    Ok(e) => e,
                    Err(e) => return tracing::error!("virtio-net: epoll: {e}"),
                };
                // The tap is edge-triggered: while the guest offers no RX
                // buffer, frames stay in the kernel's queue (which drops
                // past its length) and the thread sleeps until a new frame
                // or an RX kick, instead of waking for the same readiness.
                let fds = [
                    (rx_kick.as_raw_fd(), Token::RxKick, EventSet::IN),
                    (tx_kick.as_raw_fd(), Token::TxKick, EventSet::IN),
                    (w.tap.as_raw_fd(), Token::Tap, EventSet::IN | EventSet::EDGE_TRIGGERED),
                    (stop2.as_raw_fd(), Token::Stop, EventSet::IN),
                ];
                for (fd, tok, set) in fds {
                    if let Err(e) = ep.ctl(ControlOperation::Add, fd, EpollEvent::new(set, tok as u64)) {
                        return tracing::error!("virtio-net: epoll add: {e}");
                    }
                }
                if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Device) {
                    return tracing::error!("virtio-net: {e}; the device stops serving");
                }
                w.rx_bounce = vec![0u8; HDR_LEN + MAX_FRAME + 1];
                w.tx_bounce = vec![0u8; HDR_LEN + MAX_FRAME];
                let irq = w.irq.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.run(&ep, &rx_kick, &tx_kick)));
                if r.is_err() {
                    tracing::error!("virtio-net: the device thread panicked; the device needs a reset");
                    irq.device_broken();
                }
            })
            .map_err(|e| e.to_string())?;
        self.thread = Some(DeviceThread::new(stop, worker));
        Ok(())
    }

    fn reset(&mut self) {
        // Dropping the thread stops it and waits for it.
        self.thread = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_follow_the_kernels_rules() {
        for ok in ["tap0", "vgpu-net-1", "a", "fifteen-chars-x", "br_0.100"] {
            assert!(check_tap_name(ok).is_ok(), "{ok}");
        }
        for (bad, says) in [
            ("", "empty"),
            ("sixteen-chars-xx", "at most 15 bytes"),
            ("tap/0", "printable ASCII"),
            ("tap 0", "printable ASCII"),
            ("tap\t0", "printable ASCII"),
            ("tap:0", "printable ASCII"),
            ("tap%d", "printable ASCII"),
            ("täp", "printable ASCII"),
            ("..", "not an interface name"),
        ] {
            let e = check_tap_name(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        // Refused before /dev/net/tun is touched.
        assert!(matches!(Tap::open("no/slash"), Err(NetError::BadName { .. })));
    }

    fn device(mac: [u8; 6]) -> Net {
        // Any descriptor serves for the config space: no frame moves.
        let file = File::open("/dev/null").unwrap();
        Net::new(Tap { file, name: "test".into() }, mac, RateLimit::default(), RateLimit::default())
    }

    #[test]
    fn the_config_space_holds_the_mac_the_link_status_and_the_mtu() {
        let n = device([0x52, 0x54, 0x00, 0xab, 0xcd, 0xef]);
        let mut cfg = [0xffu8; 16];
        n.read_config(0, &mut cfg);
        assert_eq!(&cfg[0..6], &[0x52, 0x54, 0x00, 0xab, 0xcd, 0xef]);
        assert_eq!(u16::from_le_bytes([cfg[6], cfg[7]]), S_LINK_UP);
        assert_eq!(u16::from_le_bytes([cfg[8], cfg[9]]), 1, "one queue pair");
        assert_eq!(u16::from_le_bytes([cfg[10], cfg[11]]), 1500);
        assert_eq!(&cfg[12..], &[0; 4], "past the config reads zero");
        // Reads at an offset, of any width, and far away.
        let mut st = [0u8; 2];
        n.read_config(6, &mut st);
        assert_eq!(u16::from_le_bytes(st), 1);
        let mut b = [0xffu8; 1];
        n.read_config(u64::MAX, &mut b);
        assert_eq!(b, [0]);
        let f = n.features();
        assert_ne!(f & VIRTIO_F_VERSION_1, 0);
        assert_eq!(f & (F_MAC | F_STATUS | F_MTU), F_MAC | F_STATUS | F_MTU);
        assert_eq!(f & !(VIRTIO_F_VERSION_1 | F_MAC | F_STATUS | F_MTU), 0, "no offload, no control queue, no multiqueue");
        assert_eq!(n.queue_max_sizes().len(), 2);
        assert_eq!(n.device_type(), 1);
    }

    #[test]
    fn tx_chains_must_carry_a_header_and_a_frame_of_sane_length() {
        // A 12-byte header descriptor, then the frame.
        assert_eq!(tx_frame_len([(false, 12), (false, 60)]), Ok(72));
        assert_eq!(tx_frame_len([(false, 12 + 1514)]), Ok(1526));
        assert_eq!(tx_frame_len([(false, (HDR_LEN + MAX_FRAME) as u32)]), Ok(HDR_LEN + MAX_FRAME));
        assert_eq!(tx_frame_len([(false, 12)]), Err(ChainError::TooShort(12)), "a header alone is no frame");
        assert_eq!(tx_frame_len([]), Err(ChainError::TooShort(0)));
        assert_eq!(tx_frame_len([(false, 12), (false, 13)]), Err(ChainError::TooShort(25)));
        assert_eq!(tx_frame_len([(false, 12), (false, MAX_FRAME as u32 + 1)]), Err(ChainError::TooLong((HDR_LEN + MAX_FRAME + 1) as u64)));
        // Lengths that would overflow 32 bits are simply too long.
        assert!(matches!(tx_frame_len([(false, u32::MAX), (false, u32::MAX)]), Err(ChainError::TooLong(_))));
        assert_eq!(tx_frame_len([(false, 12), (true, 100)]), Err(ChainError::WrongDirection));
    }

    #[test]
    fn rx_chains_must_be_device_writable_with_room_for_the_headers() {
        assert_eq!(rx_capacity([(true, 12), (true, 1518)]), Ok(1530));
        assert_eq!(rx_capacity([(true, 1 << 20)]), Ok(HDR_LEN + MAX_FRAME), "more than a frame counts as a frame");
        assert_eq!(rx_capacity([(true, 20)]), Err(ChainError::TooShort(20)));
        assert_eq!(rx_capacity([(true, 12), (false, 1518)]), Err(ChainError::WrongDirection));
    }
}
