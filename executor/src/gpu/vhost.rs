//! The vhost-user backend of a VM tenant's virtio-gpu device, served by the
//! device worker that hosts the tenant: the VMM shares guest memory
//! (SET_MEM_TABLE) and the two virtqueues (control, cursor); commands are
//! read from guest memory, run by [`GpuDevice`], and answered in place.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackendMut, VhostUserDaemon, VringRwLock, VringT};
use virtio_queue::QueueOwnedT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use super::{GpuConfig, GpuDevice};
use crate::worker::engine::Engine;
use crate::worker::service::{DeviceService, Tenant};

/// Warnings about guests' unusable queues, at most 20 per 10 s in all.
static BAD_QUEUE_LOG: std::sync::LazyLock<crate::worker::conn::LogLimiter> = std::sync::LazyLock::new(|| crate::worker::conn::LogLimiter::new(20, std::time::Duration::from_secs(10)));

const QUEUE_SIZE: usize = 256;
const VIRTIO_F_VERSION_1: u64 = 1 << 32;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
/// Largest command the device reads from a chain: a full SUBMIT_3D or a
/// blob with the most entries, plus headers.
const MAX_COMMAND: usize = virtio_gpu_compute::virtio_gpu::MAX_SUBMIT as usize + 4096;

pub struct GpuBackend {
    cfg: GpuConfig,
    svc: Arc<DeviceService>,
    /// The stream engine that serves the contexts' command rings (none: no
    /// rings).
    engine: Option<Arc<Engine>>,
    tenant: Arc<Tenant>,
    mem: Option<GuestMemoryAtomic<GuestMemoryMmap>>,
    device: Option<GpuDevice>,
    event_idx: bool,
    /// Stops the framework's queue thread when the connection ends.
    exit: Option<(EventConsumer, EventNotifier)>,
    /// Commands answered, for tests and metrics.
    pub commands: u64,
    /// Guest RAM regions registered with the device backend (host
    /// addresses), so copies DMA straight from guest pages.
    registered: Vec<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    #[error("vhost-user daemon for {tenant}: {err}")]
    Daemon { tenant: String, err: String },
}

impl GpuBackend {
    pub fn new(cfg: GpuConfig, svc: Arc<DeviceService>, engine: Option<Arc<Engine>>, tenant: Arc<Tenant>) -> GpuBackend {
        let exit = new_event_consumer_and_notifier(EventFlag::NONBLOCK).map_err(|e| tracing::error!("vhost exit event: {e}")).ok();
        GpuBackend { cfg, svc, engine, tenant, mem: None, device: None, event_idx: false, exit, commands: 0, registered: Vec::new() }
    }

    fn unregister_guest_ram(&mut self) {
        for p in self.registered.drain(..) {
            self.svc.backend.unregister_host(p as *mut u8);
        }
    }

    /// Serves every available chain of one queue.
    fn serve_queue(&mut self, vring: &VringRwLock) -> std::io::Result<()> {
        let (Some(atomic), Some(dev)) = (self.mem.as_ref(), self.device.as_mut()) else { return Ok(()) };
        let mem = atomic.memory();
        loop {
            let chains: Vec<_> = match vring.get_mut().get_queue_mut().iter(mem.clone()) {
                Ok(it) => it.collect(),
                Err(e) => {
                    // The guest decides how often: few are logged.
                    if let Some(dropped) = BAD_QUEUE_LOG.allow() {
                        tracing::warn!(tenant = %self.tenant.name, suppressed = dropped, "virtio-gpu queue unusable: {e}");
                    }
                    return Ok(());
                }
            };
            let done = chains.is_empty();
            for chain in chains {
                let head = chain.head_index();
                let written = serve_chain(dev, chain, &mem);
                self.commands += 1;
                if let Err(e) = vring.add_used(head, written) {
                    if let Some(dropped) = BAD_QUEUE_LOG.allow() {
                        tracing::warn!(tenant = %self.tenant.name, suppressed = dropped, "virtio-gpu used ring: {e}");
                    }
                }
            }
            // With EVENT_IDX, re-arming notifications reports buffers that
            // arrived meanwhile; otherwise drain until the ring is empty.
            if self.event_idx && vring.enable_notification().unwrap_or(false) {
                continue;
            }
            if done {
                break;
            }
        }
        if vring.needs_notification().unwrap_or(true) {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}

/// Runs the command one descriptor chain carries and writes the response
/// into the chain's writable part; returns the bytes written (the used
/// length). Every chain gets a response, unreadable or oversized ones an
/// error; nothing in the chain can make this panic.
pub fn serve_chain<M>(dev: &mut GpuDevice, chain: virtio_queue::DescriptorChain<M>, mem: &GuestMemoryMmap) -> u32
where
    M: std::ops::Deref<Target = GuestMemoryMmap> + Clone,
{
    let mut cmd = Vec::new();
    let response = match chain.clone().reader(mem) {
        Ok(mut r) if r.available_bytes() <= MAX_COMMAND => match std::io::Read::read_to_end(&mut r, &mut cmd) {
            Ok(_) => dev.process(&cmd),
            Err(_) => dev.process(&[]),
        },
        // Unreadable or oversized chains still get a response.
        _ => dev.process(&[]),
    };
    match chain.writer(mem) {
        Ok(mut w) => {
            let n = response.len().min(w.available_bytes());
            match std::io::Write::write_all(&mut w, &response[..n]) {
                Ok(()) => n as u32,
                Err(_) => 0,
            }
        }
        Err(_) => 0,
    }
}

impl VhostUserBackendMut for GpuBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        2
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | GpuDevice::features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // RESET_DEVICE: a guest that resets the device (its driver
        // unloaded, a kexec) starts again with no contexts or resources.
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::RESET_DEVICE
    }

    fn set_event_idx(&mut self, enabled: bool) {
        self.event_idx = enabled;
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = virtio_gpu_compute::virtio_gpu::config_space(self.cfg.num_scanouts);
        let (o, n) = (offset as usize, size as usize);
        match o.checked_add(n) {
            Some(end) if end <= space.len() => space[o..end].to_vec(),
            _ => Vec::new(),
        }
    }

    fn update_memory(&mut self, atomic: GuestMemoryAtomic<GuestMemoryMmap>) -> std::io::Result<()> {
        let snapshot: GuestMemoryMmap = (*atomic.memory()).clone();
        self.unregister_guest_ram();
        for r in snapshot.iter() {
            let Ok(p) = r.get_host_address(MemoryRegionAddress(0)) else { continue };
            match self.svc.backend.register_host(p, r.len() as usize) {
                Ok(()) => self.registered.push(p as usize),
                Err(e) => tracing::warn!(tenant = %self.tenant.name, "guest RAM region stays unregistered; its copies are staged: {}", e.msg),
            }
        }
        match self.device.as_mut() {
            Some(d) => d.set_memory(snapshot),
            None => self.device = Some(GpuDevice::new(self.cfg.clone(), snapshot, self.svc.clone(), self.engine.clone(), self.tenant.clone())),
        }
        self.mem = Some(atomic);
        Ok(())
    }

    fn reset_device(&mut self) {
        // A reset device forgets every context and resource (freeing the
        // tenant's device memory), as the driver expects.
        if let Some(d) = self.device.take() {
            let mem = d.memory();
            drop(d);
            self.device = Some(GpuDevice::new(self.cfg.clone(), mem, self.svc.clone(), self.engine.clone(), self.tenant.clone()));
        }
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (c, n) = self.exit.as_ref()?;
        Some((c.try_clone().ok()?, n.try_clone().ok()?))
    }

    fn handle_event(&mut self, device_event: u16, evset: EventSet, vrings: &[VringRwLock], _thread_id: usize) -> std::io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        match vrings.get(device_event as usize) {
            Some(v) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve_queue(v)));
                r.unwrap_or_else(|_| {
                    tracing::error!(tenant = %self.tenant.name, "virtio-gpu queue handler panicked");
                    Ok(())
                })
            }
            None => Ok(()),
        }
    }
}

impl Drop for GpuBackend {
    fn drop(&mut self) {
        // The device (and every copy through guest RAM) goes first.
        self.device = None;
        self.unregister_guest_ram();
    }
}

/// Serves one VM tenant's listening socket until `stop` is set: one VMM
/// connection at a time; when it ends the device state goes with it and a
/// new connection (a restarted VMM) gets a fresh device. The socket stays
/// the same between connections, so the owner and mode the control plane
/// gave it stay too; shutting the listener down ends the loop.
pub fn serve(listener: std::os::unix::net::UnixListener, cfg: GpuConfig, svc: Arc<DeviceService>, engine: Option<Arc<Engine>>, tenant: Arc<Tenant>, stop: Arc<std::sync::atomic::AtomicBool>) {
    let stopped = || stop.load(std::sync::atomic::Ordering::Acquire);
    let mut listener = vhost::vhost_user::Listener::from(listener);
    while !stopped() {
        let backend = Arc::new(RwLock::new(GpuBackend::new(cfg.clone(), svc.clone(), engine.clone(), tenant.clone())));
        let daemon = VhostUserDaemon::new(format!("vgpu-{}", tenant.name), backend.clone(), GuestMemoryAtomic::new(GuestMemoryMmap::new()));
        let mut daemon = match daemon {
            Ok(d) => d,
            Err(e) => return tracing::error!("{}", VhostError::Daemon { tenant: tenant.name.clone(), err: e.to_string() }),
        };
        match daemon.start(&mut listener) {
            Ok(()) => {
                if let Err(e) = daemon.wait() {
                    tracing::warn!(tenant = %tenant.name, "vhost-user connection ended: {e}");
                }
            }
            Err(e) if !stopped() => {
                tracing::warn!(tenant = %tenant.name, "accepting a VMM failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(_) => {}
        }
        // The connection's queue thread ends with it.
        let g = backend.read().unwrap_or_else(|e| e.into_inner());
        if let Some((_, n)) = g.exit.as_ref() {
            let _ = n.notify();
        }
    }
}

/// The vhost-user socket path of a VM tenant in `dir`. Process tenants' sockets
/// end in `.sock`, so the two kinds can never share a path.
pub fn socket_path(dir: &Path, tenant: &str) -> PathBuf {
    dir.join(format!("{tenant}.vhost"))
}
