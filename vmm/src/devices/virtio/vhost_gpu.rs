//! The virtio-gpu device (id 16) whose queues the mediator's device worker
//! serves over vhost-user: the VMM owns only the PCI transport and the
//! device config; commands never pass through it.
//!
//! Guest notifications reach the backend directly (the transport's
//! ioeventfds are the vring kick fds), and so do its interrupts: with
//! MSI-X on, each queue's call fd is its vector's KVM irqfd. A small
//! thread forwards calls only for queues without a vector.
//!
//! The backend is a tenant's executor, which the daemon starts again when
//! it ends (a fault, a runaway kernel, a kill). The link thread watches the
//! connection; when the backend hangs up it connects to the same socket
//! again and hands the new backend the guest's RAM and rings, each ring
//! starting at the used index the guest last saw, then kicks every queue:
//! requests the old backend took but never answered are answered by the
//! new one (contexts the guest made before are unknown to it, so their
//! commands get errors and new contexts work). The guest's driver never
//! stops. Only when no backend comes back within `reconnect` seconds does
//! the device report NEEDS_RESET and raise its config interrupt; the VM
//! keeps running either way.
//!
//! A guest's device reset (its driver unloaded, a kexec) is passed on as
//! VHOST_USER_RESET_DEVICE: the backend forgets the guest's contexts and
//! blobs, so the next driver finds the device new.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_gpu_compute::virtio_gpu::{config_space, F_CONTEXT_INIT, F_RESOURCE_BLOB, F_VIRGL};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::{DeviceThread, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};

const QUEUES: usize = 2;
const QUEUE_SIZE: u16 = 256;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
/// The first wait between reconnection attempts, doubled up to the last.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);
/// A link that lasted this long resets the wait between reconnections.
const LINK_LASTED: Duration = Duration::from_secs(10);
/// The longest one attempt waits for a backend that accepted to answer.
const ATTEMPT_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum VhostGpuError {
    #[error("connecting to the vGPU backend {path}: {err}")]
    Connect { path: String, err: String },
    #[error("vGPU backend {0}")]
    Protocol(String),
    #[error("starting the vGPU link thread: {0}")]
    Thread(#[source] std::io::Error),
}

fn proto(what: &'static str) -> impl Fn(vhost::Error) -> String {
    move |e| format!("{what}: {e}")
}

/// A negotiated connection to the backend, and a clone of its socket
/// watched for the backend hanging up.
struct Link {
    frontend: Frontend,
    watch: UnixStream,
    offered: u64,
    protocol: VhostUserProtocolFeatures,
}

/// Connects to the backend at `path` and negotiates what can be before the
/// guest driver starts. With `patience`, a backend that accepted but does
/// not answer within it fails the attempt (the socket may be held by the
/// daemon while no executor serves it); the caller lifts the limit with
/// [`Link::settle`] once the backend is set up.
fn handshake(path: &Path, patience: Option<Duration>) -> Result<Link, String> {
    let sock = UnixStream::connect(path).map_err(|e| e.to_string())?;
    sock.set_read_timeout(patience).map_err(|e| e.to_string())?;
    let watch = sock.try_clone().map_err(|e| e.to_string())?;
    let mut frontend = Frontend::from_stream(sock, QUEUES as u64);
    frontend.set_owner().map_err(|e| e.to_string())?;
    let backend = frontend.get_features().map_err(|e| e.to_string())?;
    let needed = VIRTIO_F_VERSION_1 | F_VIRGL | F_RESOURCE_BLOB | F_CONTEXT_INIT;
    let want = needed | VIRTIO_RING_F_EVENT_IDX;
    if backend & needed != needed {
        return Err(format!("backend features {backend:#x} lack the compute device's {needed:#x}"));
    }
    let mut protocol = VhostUserProtocolFeatures::empty();
    if backend & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
        // PROTOCOL_FEATURES must be acked before GET_PROTOCOL_FEATURES.
        frontend.set_features(VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()).map_err(|e| e.to_string())?;
        let offered = frontend.get_protocol_features().map_err(|e| e.to_string())?;
        protocol = offered & (VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::RESET_DEVICE);
        frontend.set_protocol_features(protocol).map_err(|e| e.to_string())?;
    }
    Ok(Link { frontend, watch, offered: backend & want, protocol })
}

impl Link {
    /// Lifts the handshake's time limit: later messages (a reset from a
    /// vCPU) wait for the backend as the first connection's do.
    fn settle(&self) -> Result<(), String> {
        self.watch.set_read_timeout(None).map_err(|e| e.to_string())
    }
}

/// One queue's rings, as the guest placed them.
#[derive(Clone, Copy)]
struct RingAddrs {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
}

/// What activation handed the backend, kept to hand a new backend.
struct Active {
    mem: GuestMemoryMmap,
    rings: Vec<RingAddrs>,
    kicks: Vec<EventFd>,
    calls: Vec<EventFd>,
    irq: Arc<dyn Interrupt>,
}

impl Active {
    /// Gives `link`'s backend the guest's RAM and rings; each ring starts
    /// at `base(queue)`.
    fn hand_to(&self, link: &mut Link, acked: u64, base: impl Fn(usize, &RingAddrs) -> u16) -> Result<(), String> {
        let f = &mut link.frontend;
        let mut features = acked & link.offered;
        if !link.protocol.is_empty() {
            features |= VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        }
        f.set_features(features).map_err(proto("SET_FEATURES"))?;
        // Guest RAM, as the memfd regions the guest's memory is built from.
        let mut regions = Vec::new();
        for r in self.mem.iter() {
            let fo = r.file_offset().ok_or("guest RAM is not file-backed")?;
            regions.push(VhostUserMemoryRegionInfo {
                guest_phys_addr: r.start_addr().0,
                memory_size: r.len(),
                userspace_addr: r.as_ptr() as u64,
                mmap_offset: fo.start(),
                mmap_handle: fo.file().as_raw_fd(),
            });
        }
        f.set_mem_table(&regions).map_err(proto("SET_MEM_TABLE"))?;
        let host = |gpa: u64| self.mem.get_host_address(GuestAddress(gpa)).map(|p| p as u64).map_err(|e| format!("ring at {gpa:#x}: {e}"));
        for (i, q) in self.rings.iter().enumerate() {
            f.set_vring_num(i, q.size).map_err(proto("SET_VRING_NUM"))?;
            let addrs = VringConfigData {
                queue_max_size: QUEUE_SIZE,
                queue_size: q.size,
                flags: 0,
                desc_table_addr: host(q.desc)?,
                used_ring_addr: host(q.used)?,
                avail_ring_addr: host(q.avail)?,
                log_addr: None,
            };
            f.set_vring_addr(i, &addrs).map_err(proto("SET_VRING_ADDR"))?;
            f.set_vring_base(i, base(i, q)).map_err(proto("SET_VRING_BASE"))?;
            f.set_vring_call(i, &self.calls[i]).map_err(proto("SET_VRING_CALL"))?;
            f.set_vring_kick(i, &self.kicks[i]).map_err(proto("SET_VRING_KICK"))?;
            if !link.protocol.is_empty() {
                f.set_vring_enable(i, true).map_err(proto("SET_VRING_ENABLE"))?;
            }
        }
        Ok(())
    }
}

/// The connection and the rings, shared by the vCPU that activates or
/// resets the device and the link thread that reconnects it.
struct State {
    link: Option<Link>,
    active: Option<Active>,
    acked: u64,
}

struct Shared {
    state: Mutex<State>,
    path: PathBuf,
    reconnect: Duration,
    stopping: AtomicBool,
}

pub struct VhostGpu {
    shared: Arc<Shared>,
    /// The features of the first backend; a later one must offer them too.
    offered: u64,
    num_scanouts: u32,
    /// Wakes the link thread (to stop, or when a connection is replaced).
    link_ctl: EventFd,
    link_thread: Option<std::thread::JoinHandle<()>>,
    forwarder: Option<DeviceThread>,
    reset_warned: bool,
}

impl VhostGpu {
    /// Connects to the backend and negotiates what can be before the guest
    /// driver starts. `headless` reports no scanout (Linux 6.4 and later);
    /// a backend that hangs up is reconnected for up to `reconnect`.
    pub fn connect(path: &Path, headless: bool, reconnect: Duration) -> Result<VhostGpu, VhostGpuError> {
        let link = handshake(path, None).map_err(|err| VhostGpuError::Connect { path: path.display().to_string(), err })?;
        let offered = link.offered;
        let watch = link.watch.try_clone().map_err(|e| VhostGpuError::Connect { path: path.display().to_string(), err: e.to_string() })?;
        let shared = Arc::new(Shared { state: Mutex::new(State { link: Some(link), active: None, acked: 0 }), path: path.to_path_buf(), reconnect, stopping: AtomicBool::new(false) });
        let link_ctl = EventFd::new(libc::EFD_NONBLOCK).map_err(VhostGpuError::Thread)?;
        let ctl = link_ctl.try_clone().map_err(VhostGpuError::Thread)?;
        let s = shared.clone();
        let link_thread = std::thread::Builder::new().name("vgpu-link".into()).spawn(move || keep_linked(s, ctl, watch, offered)).map_err(VhostGpuError::Thread)?;
        Ok(VhostGpu { shared, offered, num_scanouts: if headless { 0 } else { 1 }, link_ctl, link_thread: Some(link_thread), forwarder: None, reset_warned: false })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl VirtioDevice for VhostGpu {
    fn device_type(&self) -> u16 {
        16
    }

    fn features(&self) -> u64 {
        self.offered
    }

    fn ack_features(&mut self, features: u64) {
        self.state().acked = features;
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; QUEUES]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = config_space(self.num_scanouts);
        for (i, d) in data.iter_mut().enumerate() {
            *d = c.get(offset as usize + i).copied().unwrap_or(0);
        }
    }

    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, kicks: Vec<EventFd>, irq: Arc<dyn Interrupt>) -> Result<(), String> {
        if queues.len() != QUEUES {
            return Err(format!("virtio-gpu needs its {QUEUES} queues enabled"));
        }
        // With MSI-X on, the backend signals each queue's vector irqfd
        // itself; otherwise its calls are forwarded by the thread below.
        let direct: Vec<Option<EventFd>> = (0..QUEUES).map(|q| irq.queue_irqfd(q)).collect();
        let mut calls = Vec::new();
        let mut forwarded = Vec::new();
        for (q, d) in direct.into_iter().enumerate() {
            match d {
                Some(fd) => calls.push(fd),
                None => {
                    let fd = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())?;
                    forwarded.push((q, fd.try_clone().map_err(|e| e.to_string())?));
                    calls.push(fd);
                }
            }
        }
        let rings = queues.iter().map(|q| RingAddrs { size: q.size(), desc: q.desc_table(), avail: q.avail_ring(), used: q.used_ring() }).collect();
        let active = Active { mem, rings, kicks, calls, irq: irq.clone() };
        {
            let path = self.shared.path.display().to_string();
            let mut st = self.state();
            let acked = st.acked;
            let link = st.link.as_mut().ok_or_else(|| format!("vGPU backend {path}: not connected"))?;
            // A new device starts every ring at 0.
            active.hand_to(link, acked, |_, _| 0).map_err(|e| format!("vGPU backend {path}: {e}"))?;
            st.active = Some(active);
        }
        tracing::debug!(direct = QUEUES - forwarded.len(), forwarded = forwarded.len(), "vGPU queue interrupts");
        if !forwarded.is_empty() {
            let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())?;
            let stop2 = stop.try_clone().map_err(|e| e.to_string())?;
            let h = std::thread::Builder::new().name("vgpu-irq".into()).spawn(move || forward(forwarded, stop2, irq)).map_err(|e| e.to_string())?;
            self.forwarder = Some(DeviceThread::new(stop, h));
        }
        Ok(())
    }

    fn reset(&mut self) {
        self.forwarder = None;
        let failed = {
            let mut st = self.state();
            st.active = None;
            // GET_VRING_BASE stops each ring on the backend; RESET_DEVICE
            // makes it forget the guest's contexts and resources (and free
            // their device memory), so a driver that starts again (a module
            // reload, a kexec) finds the device as new: its context and
            // resource ids free, its quota whole.
            match st.link.as_mut() {
                None => None,
                Some(l) => {
                    for i in 0..QUEUES {
                        let _ = l.frontend.get_vring_base(i);
                    }
                    if l.protocol.contains(VhostUserProtocolFeatures::RESET_DEVICE) {
                        l.frontend.reset_device().err().map(|e| format!("RESET_DEVICE failed ({e}); the guest's earlier contexts stay until the backend reconnects"))
                    } else {
                        Some("the backend does not offer RESET_DEVICE: the guest's earlier contexts and resources outlive the reset".to_string())
                    }
                }
            }
        };
        // The guest resets at will: one warning per device, not a flood.
        if let Some(why) = failed {
            if !std::mem::replace(&mut self.reset_warned, true) {
                tracing::warn!("vGPU device reset: {why}");
            }
        }
    }
}

impl Drop for VhostGpu {
    fn drop(&mut self) {
        self.forwarder = None;
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.link_ctl.write(1);
        if let Some(h) = self.link_thread.take() {
            let _ = h.join();
        }
    }
}

/// Turns the backend's used-buffer calls that do not go straight to KVM
/// into guest interrupts until told to stop.
fn forward(calls: Vec<(usize, EventFd)>, stop: EventFd, irq: Arc<dyn Interrupt>) {
    let ep = match Epoll::new() {
        Ok(e) => e,
        Err(e) => return tracing::error!("vgpu interrupt forwarding: {e}"),
    };
    let stop_tok = calls.len() as u64;
    let mut ok = true;
    for (i, (_, c)) in calls.iter().enumerate() {
        ok &= ep.ctl(ControlOperation::Add, c.as_raw_fd(), EpollEvent::new(EventSet::IN, i as u64)).is_ok();
    }
    ok &= ep.ctl(ControlOperation::Add, stop.as_raw_fd(), EpollEvent::new(EventSet::IN, stop_tok)).is_ok();
    if !ok {
        return tracing::error!("vgpu interrupt forwarding: epoll setup failed");
    }
    if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Device) {
        return tracing::error!("vgpu interrupt forwarding: {e}; interrupts without a vector stop");
    }
    let mut events = vec![EpollEvent::default(); calls.len() + 1];
    loop {
        let n = match ep.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return tracing::error!("vgpu interrupt forwarding: {e}"),
        };
        for ev in &events[..n] {
            match ev.data() {
                t if t == stop_tok => return,
                i => {
                    let (q, fd) = &calls[i as usize];
                    let _ = fd.read();
                    irq.signal_queue(*q);
                }
            }
        }
    }
}

const CTL: u64 = 0;
const HUP: u64 = 1;

/// The link thread: waits for the backend to hang up, then reconnects
/// (see the module's comment), until the device is dropped.
fn keep_linked(shared: Arc<Shared>, ctl: EventFd, mut watch: UnixStream, offered: u64) {
    let ep = match Epoll::new() {
        Ok(e) => e,
        Err(e) => return tracing::error!("vgpu link: {e}; a backend that hangs up is not reconnected"),
    };
    let hup = EventSet::READ_HANG_UP | EventSet::HANG_UP;
    if ep.ctl(ControlOperation::Add, ctl.as_raw_fd(), EpollEvent::new(EventSet::IN, CTL)).is_err() || ep.ctl(ControlOperation::Add, watch.as_raw_fd(), EpollEvent::new(hup, HUP)).is_err() {
        return tracing::error!("vgpu link: epoll setup failed; a backend that hangs up is not reconnected");
    }
    if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Link) {
        return tracing::error!("vgpu link: {e}; a backend that hangs up is not reconnected");
    }
    let stopping = || shared.stopping.load(Ordering::Acquire);
    let path = shared.path.display().to_string();
    let mut up_since = Instant::now();
    let mut short_links = 0u32;
    let mut delay = RETRY_FIRST;
    let mut events = [EpollEvent::default(); 2];
    // Waits for a stop, up to `t`; false when stopping.
    let nap = |t: Duration| -> bool {
        let mut ev = [EpollEvent::default(); 2];
        let _ = ep.wait(t.as_millis().clamp(1, i32::MAX as u128) as i32, &mut ev);
        !stopping()
    };
    loop {
        let n = match ep.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return tracing::error!("vgpu link: {e}"),
        };
        if stopping() {
            return;
        }
        if !events[..n].iter().any(|e| e.data() == HUP) {
            let _ = ctl.read();
            continue;
        }
        let _ = ep.ctl(ControlOperation::Delete, watch.as_raw_fd(), EpollEvent::default());
        let lost = Instant::now();
        let old = shared.state.lock().unwrap_or_else(|e| e.into_inner()).link.take();
        drop(old);
        // A backend that hangs up soon after each connection (it accepts,
        // then ends) is not reconnected at full speed: the wait grows from
        // one short link to the next, and starts afresh only after a link
        // that lasted.
        let short = up_since.elapsed() < LINK_LASTED;
        if short {
            short_links = short_links.saturating_add(1);
        } else {
            short_links = 0;
            delay = RETRY_FIRST;
        }
        if short_links <= 3 || short_links.is_power_of_two() {
            tracing::warn!(backend = %path, reconnect_s = shared.reconnect.as_secs(), short_links, "the vGPU backend hung up; reconnecting");
        }
        if short_links > 0 && !nap(delay) {
            return;
        }
        let mut last_err = String::from("no attempt allowed");
        let relinked = loop {
            if lost.elapsed() >= shared.reconnect {
                break None;
            }
            let patience = shared.reconnect.saturating_sub(lost.elapsed()).clamp(Duration::from_millis(100), ATTEMPT_MAX);
            match relink(&shared, offered, patience) {
                Ok(w) => break Some(w),
                Err(e) => last_err = e,
            }
            if !nap(delay) {
                return;
            }
            delay = (delay * 2).min(RETRY_MAX);
        };
        match relinked {
            Some(w) => {
                up_since = Instant::now();
                watch = w;
                if ep.ctl(ControlOperation::Add, watch.as_raw_fd(), EpollEvent::new(hup, HUP)).is_err() {
                    return tracing::error!("vgpu link: watching the new connection failed; a later hang-up is not reconnected");
                }
                tracing::warn!(backend = %path, after_ms = lost.elapsed().as_millis() as u64, "reconnected to the vGPU backend; the guest's earlier contexts are gone, new ones work");
            }
            None => {
                tracing::error!(backend = %path, "the vGPU backend hung up and did not come back within {} s ({last_err}); the guest sees a device error", shared.reconnect.as_secs());
                if let Some(a) = shared.state.lock().unwrap_or_else(|e| e.into_inner()).active.as_ref() {
                    a.irq.device_broken();
                }
                return;
            }
        }
    }
}

/// One reconnection attempt: a new backend, given the rings of an active
/// device where they stopped, each queue kicked and its interrupt raised
/// once (a request or an answer in flight when the old one died is not
/// left waiting). Returns the new connection's watch.
fn relink(shared: &Shared, offered: u64, patience: Duration) -> Result<UnixStream, String> {
    let mut link = handshake(&shared.path, Some(patience))?;
    if link.offered & offered != offered {
        return Err(format!("the new backend offers features {:#x}, the first offered {offered:#x}", link.offered));
    }
    let watch = link.watch.try_clone().map_err(|e| e.to_string())?;
    let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
    let acked = st.acked;
    if let Some(a) = st.active.as_ref() {
        // Every request before the used index was answered; the rest are
        // the new backend's.
        a.hand_to(&mut link, acked, |i, q| {
            a.mem.read_obj::<u16>(GuestAddress(q.used.wrapping_add(2))).unwrap_or_else(|_| {
                tracing::warn!(queue = i, "the used ring left guest RAM; restarting the queue at 0");
                0
            })
        })?;
        for k in &a.kicks {
            let _ = k.write(1);
        }
        for q in 0..a.rings.len() {
            a.irq.signal_queue(q);
        }
    }
    link.settle()?;
    st.link = Some(link);
    Ok(watch)
}
