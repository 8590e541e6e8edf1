//! The virtio-gpu device (id 16) whose queues the mediator's device worker
//! serves over vhost-user: the VMM owns only the PCI transport and the
//! device config; commands never pass through it.
//!
//! Guest notifications reach the backend directly (the transport's
//! ioeventfds are the vring kick fds), and so do its interrupts: with
//! MSI-X on, each queue's call fd is its vector's KVM irqfd. A small
//! thread forwards calls only for queues without a vector, and watches the
//! connection.
//! If the backend goes away, the device reports NEEDS_RESET and raises its
//! config interrupt; the VM keeps running.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_gpu_compute::virtio_gpu::{config_space, F_CONTEXT_INIT, F_RESOURCE_BLOB, F_VIRGL};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};

const QUEUES: usize = 2;
const QUEUE_SIZE: u16 = 256;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

#[derive(Debug, thiserror::Error)]
pub enum VhostGpuError {
    #[error("connecting to the vGPU backend {path}: {err}")]
    Connect { path: String, err: String },
    #[error("vGPU backend {0}")]
    Protocol(String),
}

fn proto(what: &'static str) -> impl Fn(vhost::Error) -> String {
    move |e| format!("{what}: {e}")
}

pub struct VhostGpu {
    frontend: Frontend,
    /// A clone of the connection, watched for the backend hanging up.
    watch: UnixStream,
    path: PathBuf,
    offered: u64,
    acked: u64,
    protocol: VhostUserProtocolFeatures,
    num_scanouts: u32,
    stop: Option<EventFd>,
    forwarder: Option<JoinHandle<()>>,
}

impl VhostGpu {
    /// Connects to the backend and negotiates what can be before the guest
    /// driver starts. `headless` reports no scanout (Linux 6.4 and later).
    pub fn connect(path: &Path, headless: bool) -> Result<VhostGpu, VhostGpuError> {
        let cerr = |err: String| VhostGpuError::Connect { path: path.display().to_string(), err };
        let sock = UnixStream::connect(path).map_err(|e| cerr(e.to_string()))?;
        let watch = sock.try_clone().map_err(|e| cerr(e.to_string()))?;
        let mut frontend = Frontend::from_stream(sock, QUEUES as u64);
        frontend.set_owner().map_err(|e| cerr(e.to_string()))?;
        let backend = frontend.get_features().map_err(|e| cerr(e.to_string()))?;
        let needed = VIRTIO_F_VERSION_1 | F_VIRGL | F_RESOURCE_BLOB | F_CONTEXT_INIT;
        let want = needed | VIRTIO_RING_F_EVENT_IDX;
        if backend & needed != needed {
            return Err(cerr(format!("backend features {backend:#x} lack the compute device's {needed:#x}")));
        }
        let mut protocol = VhostUserProtocolFeatures::empty();
        if backend & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            // PROTOCOL_FEATURES must be acked before GET_PROTOCOL_FEATURES.
            frontend.set_features(VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()).map_err(|e| cerr(e.to_string()))?;
            let offered = frontend.get_protocol_features().map_err(|e| cerr(e.to_string()))?;
            protocol = offered & (VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ);
            frontend.set_protocol_features(protocol).map_err(|e| cerr(e.to_string()))?;
        }
        Ok(VhostGpu { frontend, watch, path: path.to_path_buf(), offered: backend & want, acked: 0, protocol, num_scanouts: if headless { 0 } else { 1 }, stop: None, forwarder: None })
    }

    fn setup(&mut self, mem: &GuestMemoryMmap, queues: &[Queue], kicks: &[EventFd], calls: &[EventFd]) -> Result<(), String> {
        let f = &mut self.frontend;
        let mut features = self.acked & self.offered;
        if !self.protocol.is_empty() {
            features |= VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        }
        f.set_features(features).map_err(proto("SET_FEATURES"))?;
        // Guest RAM, as the memfd regions the guest's memory is built from.
        let mut regions = Vec::new();
        for r in mem.iter() {
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
        let host = |gpa: u64| mem.get_host_address(GuestAddress(gpa)).map(|p| p as u64).map_err(|e| format!("ring at {gpa:#x}: {e}"));
        for (i, q) in queues.iter().enumerate() {
            f.set_vring_num(i, q.size()).map_err(proto("SET_VRING_NUM"))?;
            let addrs = VringConfigData {
                queue_max_size: QUEUE_SIZE,
                queue_size: q.size(),
                flags: 0,
                desc_table_addr: host(q.desc_table())?,
                used_ring_addr: host(q.used_ring())?,
                avail_ring_addr: host(q.avail_ring())?,
                log_addr: None,
            };
            f.set_vring_addr(i, &addrs).map_err(proto("SET_VRING_ADDR"))?;
            f.set_vring_base(i, 0).map_err(proto("SET_VRING_BASE"))?;
            f.set_vring_call(i, &calls[i]).map_err(proto("SET_VRING_CALL"))?;
            f.set_vring_kick(i, &kicks[i]).map_err(proto("SET_VRING_KICK"))?;
            if !self.protocol.is_empty() {
                f.set_vring_enable(i, true).map_err(proto("SET_VRING_ENABLE"))?;
            }
        }
        Ok(())
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
        self.acked = features;
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
        self.setup(&mem, &queues, &kicks, &calls).map_err(|e| format!("vGPU backend {}: {e}", self.path.display()))?;
        tracing::debug!(direct = QUEUES - forwarded.len(), forwarded = forwarded.len(), "vGPU queue interrupts");
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())?;
        let stop2 = stop.try_clone().map_err(|e| e.to_string())?;
        let watch = self.watch.try_clone().map_err(|e| e.to_string())?;
        let path = self.path.clone();
        let h = std::thread::Builder::new().name("vgpu-irq".into()).spawn(move || forward(forwarded, stop2, watch, irq, path)).map_err(|e| e.to_string())?;
        self.stop = Some(stop);
        self.forwarder = Some(h);
        Ok(())
    }

    fn reset(&mut self) {
        self.stop_forwarder();
        // GET_VRING_BASE stops each ring on the backend.
        for i in 0..QUEUES {
            let _ = self.frontend.get_vring_base(i);
        }
    }
}

impl VhostGpu {
    fn stop_forwarder(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.write(1);
        }
        if let Some(h) = self.forwarder.take() {
            let _ = h.join();
        }
    }
}

impl Drop for VhostGpu {
    fn drop(&mut self) {
        self.stop_forwarder();
    }
}

/// Turns the backend's used-buffer calls that do not go straight to KVM
/// into guest interrupts until told to stop, and reports the device broken
/// if the backend hangs up.
fn forward(calls: Vec<(usize, EventFd)>, stop: EventFd, watch: UnixStream, irq: Arc<dyn Interrupt>, path: PathBuf) {
    let ep = match Epoll::new() {
        Ok(e) => e,
        Err(e) => return tracing::error!("vgpu interrupt forwarding: {e}"),
    };
    let stop_tok = calls.len() as u64;
    let hup_tok = stop_tok + 1;
    let mut ok = true;
    for (i, (_, c)) in calls.iter().enumerate() {
        ok &= ep.ctl(ControlOperation::Add, c.as_raw_fd(), EpollEvent::new(EventSet::IN, i as u64)).is_ok();
    }
    ok &= ep.ctl(ControlOperation::Add, stop.as_raw_fd(), EpollEvent::new(EventSet::IN, stop_tok)).is_ok();
    ok &= ep.ctl(ControlOperation::Add, watch.as_raw_fd(), EpollEvent::new(EventSet::READ_HANG_UP | EventSet::HANG_UP, hup_tok)).is_ok();
    if !ok {
        return tracing::error!("vgpu interrupt forwarding: epoll setup failed");
    }
    if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Device) {
        return tracing::error!("vgpu interrupt forwarding: {e}; interrupts without a vector stop");
    }
    let mut events = vec![EpollEvent::default(); calls.len() + 2];
    loop {
        let n = match ep.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return tracing::error!("vgpu interrupt forwarding: {e}"),
        };
        for ev in &events[..n] {
            match ev.data() {
                t if t == stop_tok => return,
                t if t == hup_tok => {
                    tracing::error!(backend = %path.display(), "the vGPU backend hung up; the guest sees a device error");
                    irq.device_broken();
                    return;
                }
                i => {
                    let (q, fd) = &calls[i as usize];
                    let _ = fd.read();
                    irq.signal_queue(*q);
                }
            }
        }
    }
}
