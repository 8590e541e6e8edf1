//! Virtio devices and their PCI transport.

pub mod block;
pub mod net;
pub mod pci_transport;
pub mod rate_limit;
pub mod rng;
pub mod vhost_gpu;

use std::sync::Arc;

use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

pub use pci_transport::VirtioPci;

pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// How a device raises its used-buffer interrupt for a queue.
pub trait Interrupt: Send + Sync {
    fn signal_queue(&self, queue: usize);
    /// The device can no longer work (its backend is gone): the driver
    /// sees DEVICE_NEEDS_RESET and a configuration-change interrupt.
    fn device_broken(&self);
    /// The eventfd that raises `queue`'s interrupt directly through KVM
    /// (its MSI-X vector's irqfd), when MSI-X is in use: a backend can
    /// signal it without passing through the VMM.
    fn queue_irqfd(&self, _queue: usize) -> Option<EventFd> {
        None
    }
}

/// Counts one event; returns the count before it.
pub(crate) fn bump(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

pub(crate) use crate::bus::worth_logging;

/// A device's worker thread and the eventfd that tells it to stop:
/// dropping it stops the thread and waits for it to end.
pub struct DeviceThread {
    stop: EventFd,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl DeviceThread {
    pub fn new(stop: EventFd, handle: std::thread::JoinHandle<()>) -> DeviceThread {
        DeviceThread { stop, handle: Some(handle) }
    }
}

impl Drop for DeviceThread {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// What a device model implements; the transport does the rest.
pub trait VirtioDevice: Send {
    /// Virtio device id (4 = entropy, 16 = GPU, ...).
    fn device_type(&self) -> u16;
    fn features(&self) -> u64;
    /// The features the driver accepted, before activation.
    fn ack_features(&mut self, _features: u64) {}
    fn queue_max_sizes(&self) -> Vec<u16>;
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let _ = offset;
    }
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// Starts serving: `kicks[i]` fires when the driver notifies queue `i`.
    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, kicks: Vec<EventFd>, irq: Arc<dyn Interrupt>) -> Result<(), String>;
    /// Stops serving and forgets the queues (device reset).
    fn reset(&mut self);
}
