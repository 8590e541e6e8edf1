//! The modern virtio-pci transport (virtio 1.x, 4.1): common, notify, ISR
//! and device-config capabilities in BAR0, MSI-X vectors delivered through
//! KVM irqfds and GSI routes, and queue notifications through ioeventfds.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, NoDatamatch};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::devices::pci::{ConfigSpace, IrqRouting, PciDevice};

pub const BAR_SIZE: u64 = 0x4000;
const COMMON: u64 = 0x0000;
const COMMON_LEN: u64 = 0x38;
const ISR: u64 = 0x1000;
const DEVICE_CFG: u64 = 0x2000;
const DEVICE_CFG_LEN: u64 = 0x1000;
const NOTIFY: u64 = 0x3000;
const NOTIFY_MULT: u64 = 4;
const MSIX_TABLE: u64 = 0x3800;
const MSIX_PBA: u64 = 0x3c00;
pub const NO_VECTOR: u16 = 0xffff;

const STATUS_DRIVER_OK: u8 = 4;
const STATUS_FEATURES_OK: u8 = 8;
const STATUS_NEEDS_RESET: u8 = 0x40;
const STATUS_FAILED: u8 = 0x80;

#[derive(Clone, Copy, Default)]
struct QueueRegs {
    size: u16,
    vector: u16,
    enable: bool,
    desc: u64,
    avail: u64,
    used: u64,
}

/// MSI-X state shared with the device's worker threads.
struct Vectors {
    /// One irqfd per vector; vector i uses gsis[i].
    fds: Vec<EventFd>,
    gsis: Vec<u32>,
    table: Mutex<Vec<[u32; 4]>>,
    enabled: AtomicBool,
    masked_all: AtomicBool,
    queue_vector: Mutex<Vec<u16>>,
    isr: AtomicU8,
    config_vector: AtomicU16,
    broken: AtomicBool,
}

impl Interrupt for Vectors {
    fn signal_queue(&self, queue: usize) {
        self.isr.fetch_or(1, Ordering::AcqRel);
        if !self.enabled.load(Ordering::Acquire) {
            return;
        }
        let v = self.queue_vector.lock().unwrap_or_else(|e| e.into_inner()).get(queue).copied().unwrap_or(NO_VECTOR);
        if let Some(fd) = self.fds.get(v as usize) {
            let _ = fd.write(1);
        }
    }

    fn queue_irqfd(&self, queue: usize) -> Option<EventFd> {
        if !self.enabled.load(Ordering::Acquire) {
            return None;
        }
        let v = self.queue_vector.lock().unwrap_or_else(|e| e.into_inner()).get(queue).copied().unwrap_or(NO_VECTOR);
        self.fds.get(v as usize).and_then(|fd| fd.try_clone().ok())
    }

    fn device_broken(&self) {
        self.broken.store(true, Ordering::Release);
        self.isr.fetch_or(2, Ordering::AcqRel);
        if self.enabled.load(Ordering::Acquire) {
            if let Some(fd) = self.fds.get(self.config_vector.load(Ordering::Acquire) as usize) {
                let _ = fd.write(1);
            }
        }
    }
}

pub struct VirtioPci {
    cfg: ConfigSpace,
    dev: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    routing: Arc<IrqRouting>,
    msix_cap: usize,
    vectors: Arc<Vectors>,
    kicks: Vec<EventFd>,
    /// Where the notify ioeventfds are registered now.
    notify_base: Option<u64>,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    msix_config: u16,
    status: u8,
    generation: u8,
    queue_select: u16,
    queues: Vec<QueueRegs>,
    max_sizes: Vec<u16>,
    active: bool,
}

fn cap_body(cfg_type: u8, offset: u64, length: u64, extra: Option<u32>) -> Vec<u8> {
    let cap_len = if extra.is_some() { 20u8 } else { 16u8 };
    let mut b = vec![cap_len, cfg_type, 0, 0, 0, 0];
    b.extend_from_slice(&(offset as u32).to_le_bytes());
    b.extend_from_slice(&(length as u32).to_le_bytes());
    if let Some(x) = extra {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b
}

impl VirtioPci {
    pub fn new(dev: Box<dyn VirtioDevice>, mem: GuestMemoryMmap, routing: Arc<IrqRouting>) -> Result<VirtioPci, String> {
        let ty = dev.device_type();
        let max_sizes = dev.queue_max_sizes();
        let nq = max_sizes.len();
        let mut cfg = ConfigSpace::new(0x1af4, 0x1040 + ty, 0xff, 0, 0, 1);
        cfg.set_subsystem(0x1af4, 0x40);
        cfg.add_mem_bar(0, BAR_SIZE);
        cfg.add_cap(0x09, &cap_body(1, COMMON, COMMON_LEN, None), &[]);
        cfg.add_cap(0x09, &cap_body(2, NOTIFY, nq as u64 * NOTIFY_MULT, Some(NOTIFY_MULT as u32)), &[]);
        cfg.add_cap(0x09, &cap_body(3, ISR, 1, None), &[]);
        cfg.add_cap(0x09, &cap_body(4, DEVICE_CFG, DEVICE_CFG_LEN, None), &[]);
        let nvec = nq + 1;
        let mut msix = Vec::new();
        msix.extend_from_slice(&((nvec - 1) as u16).to_le_bytes());
        msix.extend_from_slice(&(MSIX_TABLE as u32).to_le_bytes());
        msix.extend_from_slice(&(MSIX_PBA as u32).to_le_bytes());
        // Enable and function-mask bits of message control are writable.
        let msix_cap = cfg.add_cap(0x11, &msix, &[(1, 0xc0)]);

        let mut fds = Vec::new();
        let mut gsis = Vec::new();
        for _ in 0..nvec {
            let fd = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())?;
            let gsi = routing.allocate_gsi();
            routing.vm().register_irqfd(&fd, gsi).map_err(|e| format!("KVM_IRQFD: {e}"))?;
            fds.push(fd);
            gsis.push(gsi);
        }
        let kicks = (0..nq).map(|_| EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
        let vectors = Arc::new(Vectors {
            fds,
            gsis,
            // Every entry starts masked (vector control bit 0).
            table: Mutex::new(vec![[0, 0, 0, 1]; nvec]),
            enabled: AtomicBool::new(false),
            masked_all: AtomicBool::new(false),
            queue_vector: Mutex::new(vec![NO_VECTOR; nq]),
            isr: AtomicU8::new(0),
            config_vector: AtomicU16::new(NO_VECTOR),
            broken: AtomicBool::new(false),
        });
        let queues = max_sizes.iter().map(|&m| QueueRegs { size: m, vector: NO_VECTOR, ..Default::default() }).collect();
        Ok(VirtioPci {
            cfg,
            dev,
            mem,
            routing,
            msix_cap,
            vectors,
            kicks,
            notify_base: None,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            msix_config: NO_VECTOR,
            status: 0,
            generation: 0,
            queue_select: 0,
            queues,
            max_sizes,
            active: false,
        })
    }

    fn update_route(&self, v: usize) {
        let table = self.vectors.table.lock().unwrap_or_else(|e| e.into_inner());
        let Some(e) = table.get(v) else { return };
        let live = self.vectors.enabled.load(Ordering::Acquire) && !self.vectors.masked_all.load(Ordering::Acquire) && e[3] & 1 == 0;
        let msg = live.then(|| ((e[1] as u64) << 32 | e[0] as u64, e[2]));
        if let Err(err) = self.routing.set_msi(self.vectors.gsis[v], msg) {
            tracing::warn!("MSI-X vector {v}: {err}");
        }
    }

    fn reset(&mut self) {
        if self.active {
            self.dev.reset();
            self.active = false;
        }
        self.status = 0;
        self.driver_features = 0;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.queue_select = 0;
        self.msix_config = NO_VECTOR;
        for (q, &m) in self.queues.iter_mut().zip(&self.max_sizes) {
            *q = QueueRegs { size: m, vector: NO_VECTOR, ..Default::default() };
        }
        self.vectors.queue_vector.lock().unwrap_or_else(|e| e.into_inner()).fill(NO_VECTOR);
        self.vectors.isr.store(0, Ordering::Release);
    }

    fn activate(&mut self) {
        let mut queues = Vec::new();
        let mut kicks = Vec::new();
        for (i, r) in self.queues.iter().enumerate() {
            if !r.enable {
                continue;
            }
            let mut q = match Queue::new(self.max_sizes[i]) {
                Ok(q) => q,
                Err(_) => return self.needs_reset("queue creation failed"),
            };
            // As the driver wrote them: a size or a ring address the queue
            // refuses is the driver's error, never replaced by a default.
            let set = q
                .try_set_size(r.size)
                .and_then(|()| q.try_set_desc_table_address(GuestAddress(r.desc)))
                .and_then(|()| q.try_set_avail_ring_address(GuestAddress(r.avail)))
                .and_then(|()| q.try_set_used_ring_address(GuestAddress(r.used)));
            if let Err(e) = set {
                return self.needs_reset(&format!("queue {i}: {e}"));
            }
            q.set_ready(true);
            if !q.is_valid(&self.mem) {
                return self.needs_reset("a queue's size or rings are invalid or outside guest memory");
            }
            match self.kicks[i].try_clone() {
                Ok(k) => kicks.push(k),
                Err(_) => return self.needs_reset("cloning a queue eventfd failed"),
            }
            queues.push(q);
        }
        *self.vectors.queue_vector.lock().unwrap_or_else(|e| e.into_inner()) = self.queues.iter().map(|q| q.vector).collect();
        if self.vectors.broken.load(Ordering::Acquire) {
            return self.needs_reset("its backend is gone");
        }
        self.dev.ack_features(self.driver_features);
        let irq: Arc<dyn Interrupt> = self.vectors.clone();
        match self.dev.activate(self.mem.clone(), queues, kicks, irq) {
            Ok(()) => self.active = true,
            Err(e) => self.needs_reset(&e),
        }
    }

    fn needs_reset(&mut self, why: &str) {
        // The guest decides how often: few are logged.
        static SAID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if super::worth_logging(super::bump(&SAID)) {
            tracing::warn!(device = self.dev.device_type(), "virtio device cannot start: {why}");
        }
        self.status |= STATUS_NEEDS_RESET;
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            return self.reset();
        }
        let mut v = v;
        if v & STATUS_FEATURES_OK != 0 && self.status & STATUS_FEATURES_OK == 0 {
            let offered = self.dev.features();
            let ok = self.driver_features & !offered == 0 && self.driver_features & VIRTIO_F_VERSION_1 != 0;
            if !ok {
                // Not accepted: the driver reads FEATURES_OK back as clear.
                v &= !STATUS_FEATURES_OK;
            }
        }
        let was_ok = self.status & STATUS_DRIVER_OK != 0;
        self.status = v | (self.status & STATUS_NEEDS_RESET);
        // Once per reset: a driver that clears DRIVER_OK and sets it again
        // (only a reset may clear it) does not start the device twice.
        if !was_ok && !self.active && v & STATUS_DRIVER_OK != 0 && v & STATUS_FEATURES_OK != 0 && v & STATUS_FAILED == 0 {
            self.activate();
        }
    }

    fn common_read(&mut self, off: u64, data: &mut [u8]) {
        let q = self.queues.get(self.queue_select as usize).copied();
        let v: u64 = match (off, data.len()) {
            (0x00, 4) => self.device_feature_select as u64,
            (0x04, 4) => match self.device_feature_select {
                0 => self.dev.features() & 0xffff_ffff,
                1 => self.dev.features() >> 32,
                _ => 0,
            },
            (0x08, 4) => self.driver_feature_select as u64,
            (0x0c, 4) => match self.driver_feature_select {
                0 => self.driver_features & 0xffff_ffff,
                1 => self.driver_features >> 32,
                _ => 0,
            },
            (0x10, 2) => self.msix_config as u64,
            (0x12, 2) => self.queues.len() as u64,
            (0x14, 1) => {
                let broken = self.vectors.broken.load(Ordering::Acquire);
                (self.status | if broken { STATUS_NEEDS_RESET } else { 0 }) as u64
            }
            (0x15, 1) => self.generation as u64,
            (0x16, 2) => self.queue_select as u64,
            (0x18, 2) => q.map_or(0, |q| q.size as u64),
            (0x1a, 2) => q.map_or(NO_VECTOR as u64, |q| q.vector as u64),
            (0x1c, 2) => q.map_or(0, |q| q.enable as u64),
            (0x1e, 2) => self.queue_select as u64, // notify offset = queue index
            (0x20, 4) => q.map_or(0, |q| q.desc & 0xffff_ffff),
            (0x24, 4) => q.map_or(0, |q| q.desc >> 32),
            (0x28, 4) => q.map_or(0, |q| q.avail & 0xffff_ffff),
            (0x2c, 4) => q.map_or(0, |q| q.avail >> 32),
            (0x30, 4) => q.map_or(0, |q| q.used & 0xffff_ffff),
            (0x34, 4) => q.map_or(0, |q| q.used >> 32),
            (0x20 | 0x28 | 0x30, 8) => q.map_or(0, |q| [q.desc, q.avail, q.used][(off as usize - 0x20) / 8]),
            _ => 0,
        };
        data.copy_from_slice(&v.to_le_bytes()[..data.len()]);
    }

    fn common_write(&mut self, off: u64, data: &[u8]) {
        let mut b = [0u8; 8];
        b[..data.len()].copy_from_slice(data);
        let v = u64::from_le_bytes(b);
        // Queue registers are frozen once the driver is running, and while
        // the device runs on them (until a reset).
        let running = self.status & STATUS_DRIVER_OK != 0 || self.active;
        let sel = self.queue_select as usize;
        let nvec = self.vectors.fds.len() as u64;
        match (off, data.len()) {
            (0x00, 4) => self.device_feature_select = v as u32,
            (0x08, 4) => self.driver_feature_select = v as u32,
            (0x0c, 4) if self.status & STATUS_FEATURES_OK == 0 => match self.driver_feature_select {
                0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (v << 32),
                _ => {}
            },
            (0x10, 2) => {
                self.msix_config = if v < nvec { v as u16 } else { NO_VECTOR };
                self.vectors.config_vector.store(self.msix_config, Ordering::Release);
            }
            (0x14, 1) => self.write_status(v as u8),
            (0x16, 2) => self.queue_select = v as u16,
            _ if running => {}
            (0x18, 2) => {
                if let (Some(q), Some(&max)) = (self.queues.get_mut(sel), self.max_sizes.get(sel)) {
                    // A size that is not a power of two up to the maximum is
                    // kept as written; the queue is refused at DRIVER_OK.
                    q.size = (v as u16).min(max.max(1).saturating_mul(2));
                }
            }
            (0x1a, 2) => {
                if let Some(q) = self.queues.get_mut(sel) {
                    q.vector = if v < nvec { v as u16 } else { NO_VECTOR };
                }
            }
            (0x1c, 2) => {
                if let Some(q) = self.queues.get_mut(sel) {
                    q.enable = v == 1;
                }
            }
            (0x20..=0x37, 4) | (0x20 | 0x28 | 0x30, 8) => {
                if let Some(q) = self.queues.get_mut(sel) {
                    let field = match (off - 0x20) / 8 {
                        0 => &mut q.desc,
                        1 => &mut q.avail,
                        _ => &mut q.used,
                    };
                    if data.len() == 8 {
                        *field = v;
                    } else if off.is_multiple_of(8) {
                        *field = (*field & !0xffff_ffff) | v;
                    } else {
                        *field = (*field & 0xffff_ffff) | (v << 32);
                    }
                }
            }
            _ => {}
        }
    }

    fn msix_write(&mut self, off: u64, data: &[u8]) {
        if data.len() != 4 || !off.is_multiple_of(4) {
            return;
        }
        let (v, word) = ((off / 16) as usize, ((off % 16) / 4) as usize);
        {
            let mut t = self.vectors.table.lock().unwrap_or_else(|e| e.into_inner());
            let Some(e) = t.get_mut(v) else { return };
            e[word] = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        }
        self.update_route(v);
    }

    fn msix_read(&self, off: u64, data: &mut [u8]) {
        data.fill(0);
        if data.len() != 4 || !off.is_multiple_of(4) {
            return;
        }
        let t = self.vectors.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = t.get((off / 16) as usize) {
            data.copy_from_slice(&e[((off % 16) / 4) as usize].to_le_bytes());
        }
    }

    /// Registers each queue's notify address as an ioeventfd.
    fn place_notify(&mut self, bar_addr: u64) {
        let vm = self.routing.vm();
        if let Some(old) = self.notify_base.take() {
            for (i, k) in self.kicks.iter().enumerate() {
                let _ = vm.unregister_ioevent(k, &IoEventAddress::Mmio(old + NOTIFY + i as u64 * NOTIFY_MULT), NoDatamatch);
            }
        }
        for (i, k) in self.kicks.iter().enumerate() {
            if let Err(e) = vm.register_ioevent(k, &IoEventAddress::Mmio(bar_addr + NOTIFY + i as u64 * NOTIFY_MULT), NoDatamatch) {
                // Notifications still work through MMIO exits (bar_write).
                // The guest places the BAR as often as it likes: few are
                // logged.
                static SAID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                if super::worth_logging(super::bump(&SAID)) {
                    tracing::warn!("ioeventfd for queue {i}: {e}");
                }
            }
        }
        self.notify_base = Some(bar_addr);
    }
}

impl PciDevice for VirtioPci {
    fn config(&mut self) -> &mut ConfigSpace {
        &mut self.cfg
    }

    fn config_written(&mut self, off: usize, len: usize) {
        let ctl = self.msix_cap + 3;
        if (off..off + len).contains(&ctl) {
            let b = self.cfg.bytes[ctl];
            self.vectors.enabled.store(b & 0x80 != 0, Ordering::Release);
            self.vectors.masked_all.store(b & 0x40 != 0, Ordering::Release);
            for v in 0..self.vectors.fds.len() {
                self.update_route(v);
            }
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != 0 {
            return;
        }
        match offset {
            o if o < COMMON + COMMON_LEN => self.common_read(o - COMMON, data),
            ISR => {
                // Reading the ISR acknowledges it.
                if let Some(d) = data.first_mut() {
                    *d = self.vectors.isr.swap(0, Ordering::AcqRel);
                }
            }
            o if (DEVICE_CFG..DEVICE_CFG + DEVICE_CFG_LEN).contains(&o) => self.dev.read_config(o - DEVICE_CFG, data),
            o if (MSIX_TABLE..MSIX_PBA).contains(&o) => self.msix_read(o - MSIX_TABLE, data),
            _ => {}
        }
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar != 0 {
            return;
        }
        match offset {
            o if o < COMMON + COMMON_LEN => self.common_write(o - COMMON, data),
            o if (DEVICE_CFG..DEVICE_CFG + DEVICE_CFG_LEN).contains(&o) => self.dev.write_config(o - DEVICE_CFG, data),
            o if (NOTIFY..MSIX_TABLE).contains(&o) => {
                if let Some(k) = self.kicks.get(((o - NOTIFY) / NOTIFY_MULT) as usize) {
                    let _ = k.write(1);
                }
            }
            o if (MSIX_TABLE..MSIX_PBA).contains(&o) => self.msix_write(o - MSIX_TABLE, data),
            _ => {}
        }
    }

    fn bar_placed(&mut self, bar: usize, addr: u64) {
        if bar == 0 {
            self.place_notify(addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A device that counts its activations.
    struct Counting(Arc<AtomicUsize>);

    impl VirtioDevice for Counting {
        fn device_type(&self) -> u16 {
            4
        }
        fn features(&self) -> u64 {
            VIRTIO_F_VERSION_1
        }
        fn queue_max_sizes(&self) -> Vec<u16> {
            vec![16]
        }
        fn activate(&mut self, _mem: GuestMemoryMmap, _queues: Vec<Queue>, _kicks: Vec<EventFd>, _irq: Arc<dyn Interrupt>) -> Result<(), String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn reset(&mut self) {}
    }

    /// A transport over a counting device in a fresh VM, or None (said)
    /// where this host has no KVM.
    fn transport() -> Option<(VirtioPci, Arc<AtomicUsize>)> {
        let vm = match kvm_ioctls::Kvm::new().and_then(|k| k.create_vm()) {
            Ok(vm) => vm,
            Err(e) => {
                eprintln!("SKIPPED: the virtio PCI transport tests need /dev/kvm: {e}");
                return None;
            }
        };
        if let Err(e) = vm.create_irq_chip() {
            eprintln!("SKIPPED: the virtio PCI transport tests need an in-kernel irqchip: {e}");
            return None;
        }
        let routing = Arc::new(IrqRouting::new(Arc::new(vm)));
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        Some((VirtioPci::new(Box::new(Counting(n.clone())), mem, routing).unwrap(), n))
    }

    /// Negotiates VERSION_1 and sets queue 0 up with `size` entries at
    /// aligned addresses.
    fn set_up(p: &mut VirtioPci, size: u16) {
        p.common_write(0x14, &[1 | 2]);
        p.common_write(0x08, &1u32.to_le_bytes());
        p.common_write(0x0c, &1u32.to_le_bytes());
        p.common_write(0x14, &[1 | 2 | STATUS_FEATURES_OK]);
        p.common_write(0x16, &0u16.to_le_bytes());
        p.common_write(0x18, &size.to_le_bytes());
        p.common_write(0x20, &0x1000u64.to_le_bytes());
        p.common_write(0x28, &0x2000u64.to_le_bytes());
        p.common_write(0x30, &0x3000u64.to_le_bytes());
        p.common_write(0x1c, &1u16.to_le_bytes());
    }

    #[test]
    fn a_device_starts_once_per_reset_however_the_driver_toggles_driver_ok() {
        let Some((mut p, n)) = transport() else { return };
        set_up(&mut p, 16);
        p.common_write(0x14, &[1 | 2 | STATUS_FEATURES_OK | STATUS_DRIVER_OK]);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        // DRIVER_OK cleared without a reset, then set again: not restarted.
        p.common_write(0x14, &[1 | 2 | STATUS_FEATURES_OK]);
        p.common_write(0x14, &[1 | 2 | STATUS_FEATURES_OK | STATUS_DRIVER_OK]);
        assert_eq!(n.load(Ordering::SeqCst), 1, "started twice without a reset");
        // After a reset it starts again.
        p.common_write(0x14, &[0]);
        set_up(&mut p, 16);
        p.common_write(0x14, &[1 | 2 | STATUS_FEATURES_OK | STATUS_DRIVER_OK]);
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_queue_size_the_queue_refuses_is_the_drivers_error_not_replaced() {
        let Some((mut p, n)) = transport() else { return };
        set_up(&mut p, 12);
        p.common_write(0x14, &[1 | 2 | STATUS_FEATURES_OK | STATUS_DRIVER_OK]);
        assert_eq!(n.load(Ordering::SeqCst), 0, "a 12-entry queue was started");
        let mut status = [0u8];
        p.common_read(0x14, &mut status);
        assert_ne!(status[0] & STATUS_NEEDS_RESET, 0, "status {:#x}", status[0]);
        // A misaligned ring is refused too.
        p.common_write(0x14, &[0]);
        set_up(&mut p, 16);
        p.common_write(0x20, &0x1001u64.to_le_bytes());
        p.common_write(0x14, &[1 | 2 | STATUS_FEATURES_OK | STATUS_DRIVER_OK]);
        assert_eq!(n.load(Ordering::SeqCst), 0, "a misaligned descriptor table was used");
    }
}
