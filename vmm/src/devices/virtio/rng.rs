//! virtio-rng (entropy device, id 4): fills every device-writable buffer
//! the driver offers with bytes from the host's getrandom.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::{DeviceThread, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};

const QUEUE_SIZE: u16 = 256;
/// Most bytes handed out per buffer; larger buffers get this much.
const MAX_CHUNK: u32 = 64 << 10;

#[derive(Default)]
pub struct Rng {
    thread: Option<DeviceThread>,
    pub bytes_served: Arc<AtomicU64>,
    running: Arc<AtomicBool>,
}

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes at most buf.len() - done bytes into buf[done..].
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

/// The guest's bad buffers and rings, counted so that few are logged.
static BAD: AtomicU64 = AtomicU64::new(0);

/// Serves every available chain; returns whether any was used.
fn serve(q: &mut Queue, mem: &GuestMemoryMmap, served: &AtomicU64) -> bool {
    let mut used_any = false;
    let mut buf = vec![0u8; MAX_CHUNK as usize];
    let mut chains = Vec::new();
    match q.iter(mem) {
        Ok(iter) => {
            for chain in iter {
                let head = chain.head_index();
                let mut written = 0u32;
                for d in chain {
                    if !d.is_write_only() {
                        continue;
                    }
                    let len = d.len().min(MAX_CHUNK - written);
                    if len == 0 {
                        break;
                    }
                    let part = &mut buf[..len as usize];
                    if getrandom(part).is_err() || mem.write_slice(part, d.addr()).is_err() {
                        if super::worth_logging(super::bump(&BAD)) {
                            tracing::warn!("virtio-rng: a buffer outside guest memory; returning it empty");
                        }
                        break;
                    }
                    written += len;
                }
                chains.push((head, written));
            }
        }
        Err(e) => {
            if super::worth_logging(super::bump(&BAD)) {
                tracing::warn!("virtio-rng: bad available ring: {e}");
            }
        }
    }
    for (head, written) in chains {
        if q.add_used(mem, head, written).is_ok() {
            served.fetch_add(written as u64, Ordering::Relaxed);
            used_any = true;
        }
    }
    used_any
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u16 {
        4
    }
    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }
    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }

    fn activate(&mut self, mem: GuestMemoryMmap, mut queues: Vec<Queue>, kicks: Vec<EventFd>, irq: Arc<dyn Interrupt>) -> Result<(), String> {
        let (Some(mut q), Some(kick)) = (queues.pop(), kicks.into_iter().next()) else { return Err("virtio-rng needs one queue".into()) };
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())?;
        let stop2 = stop.try_clone().map_err(|e| e.to_string())?;
        let served = self.bytes_served.clone();
        let running = self.running.clone();
        running.store(true, Ordering::Release);
        let worker = std::thread::Builder::new()
            .name("virtio-rng".into())
            .spawn(move || {
                let ep = match Epoll::new() {
                    Ok(e) => e,
                    Err(e) => return tracing::error!("virtio-rng: epoll: {e}"),
                };
                for (fd, tok) in [(&kick, 0u64), (&stop2, 1u64)] {
                    if let Err(e) = ep.ctl(ControlOperation::Add, std::os::fd::AsRawFd::as_raw_fd(fd), EpollEvent::new(EventSet::IN, tok)) {
                        return tracing::error!("virtio-rng: epoll add: {e}");
                    }
                }
                if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Device) {
                    return tracing::error!("virtio-rng: {e}; the device stops serving");
                }
                // Buffers posted before the first kick are served too.
                if serve(&mut q, &mem, &served) {
                    irq.signal_queue(0);
                }
                let mut events = vec![EpollEvent::default(); 2];
                loop {
                    let n = match ep.wait(-1, &mut events) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => return tracing::error!("virtio-rng: epoll wait: {e}"),
                    };
                    for ev in &events[..n] {
                        if ev.data() == 1 {
                            running.store(false, Ordering::Release);
                            return;
                        }
                        let _ = kick.read();
                        if serve(&mut q, &mem, &served) && q.needs_notification(&mem).unwrap_or(true) {
                            irq.signal_queue(0);
                        }
                    }
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
