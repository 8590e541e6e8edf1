//! virtio-blk (block device, id 2) over a raw image file: reads, writes,
//! flushes and the device id, with an optional read-only mode, O_DIRECT,
//! and Firecracker-style rate limits (token buckets on bytes and on
//! requests).
//!
//! Every request is checked against the image's size before any byte
//! moves; data goes through a bounce buffer of at most [`CHUNK`] bytes, so
//! a guest can neither make the device hold more memory than that nor
//! reach past its image. Guest memory is read and written with vm-memory's
//! volatile copies.

use std::fs::File;
use std::io::Seek;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::rate_limit::{Limiter, RateLimit};
use super::{bump, worth_logging, DeviceThread, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};

const QUEUE_SIZE: u16 = 256;
pub const SECTOR: u64 = 512;
/// The bounce buffer: data moves in pieces of at most this many bytes.
const CHUNK: usize = 128 << 10;
const SIZE_MAX: u32 = 1 << 20;
const SEG_MAX: u32 = 128;
/// Most data one request may move: what `size_max` and `seg_max` tell the
/// driver (the bounce buffer bounds the memory it takes, not this).
const MAX_REQUEST: u64 = SIZE_MAX as u64 * SEG_MAX as u64;
/// Most requests served in one turn before the thread looks at its stop
/// event again, so a guest that keeps the ring full cannot hold it.
const BUDGET: usize = QUEUE_SIZE as usize;

const F_SIZE_MAX: u64 = 1 << 1;
const F_SEG_MAX: u64 = 1 << 2;
const F_RO: u64 = 1 << 5;
const F_BLK_SIZE: u64 = 1 << 6;
const F_FLUSH: u64 = 1 << 9;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;

const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;

/// The device's counters (metrics and tests).
#[derive(Default)]
pub struct BlockStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub errors: AtomicU64,
    /// Times a request waited for the rate limiter.
    pub throttled: AtomicU64,
}

pub struct Block {
    file: Arc<File>,
    sectors: u64,
    read_only: bool,
    /// The device id GET_ID returns (at most 20 bytes).
    id: [u8; 20],
    limit: RateLimit,
    pub stats: Arc<BlockStats>,
    thread: Option<DeviceThread>,
}

impl Block {
    /// A device over `file`, opened by the caller (read-only or not, with
    /// O_DIRECT or not). The image must be a whole number of sectors.
    pub fn new(file: File, read_only: bool, id: &str, limit: RateLimit) -> Result<Block, String> {
        // The end of the file, which for a block device is its size too
        // (st_size is 0 there).
        let len = (&file).seek(std::io::SeekFrom::End(0)).map_err(|e| format!("disk image: {e}"))?;
        // One writer or any number of readers per image, across VMs: a
        // second VM (or a second --disk) writing the same image would
        // corrupt it. The lock goes with the file.
        let how = if read_only { libc::LOCK_SH } else { libc::LOCK_EX };
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(if e.kind() == std::io::ErrorKind::WouldBlock { "disk image is in use by another VM (or given twice) read-write".to_string() } else { format!("locking the disk image: {e}") });
        }
        if len == 0 || len % SECTOR != 0 {
            return Err(format!("disk image of {len} bytes is not a positive whole number of 512-byte sectors"));
        }
        let mut idb = [0u8; 20];
        let n = id.len().min(20);
        idb[..n].copy_from_slice(&id.as_bytes()[..n]);
        Ok(Block { file: Arc::new(file), sectors: len / SECTOR, read_only, id: idb, limit, stats: Arc::default(), thread: None })
    }
}

/// A request's parts: the header's fields, the data descriptors and the
/// status byte's address.
struct Request {
    ty: u32,
    sector: u64,
    data: Vec<(GuestAddress, u32)>,
    status: GuestAddress,
    data_len: u64,
}

fn parse(chain: DescriptorChain<&GuestMemoryMmap>, mem: &GuestMemoryMmap) -> Option<Request> {
    let descs: Vec<_> = chain.collect();
    let (first, rest) = descs.split_first()?;
    let (last, data) = rest.split_last()?;
    if first.is_write_only() || first.len() < 16 || !last.is_write_only() || last.len() < 1 || data.len() > SEG_MAX as usize {
        return None;
    }
    let mut hdr = [0u8; 16];
    mem.read_slice(&mut hdr, first.addr()).ok()?;
    let ty = u32::from_le_bytes(hdr[0..4].try_into().ok()?);
    let sector = u64::from_le_bytes(hdr[8..16].try_into().ok()?);
    let want_write = ty == T_IN || ty == T_GET_ID;
    let mut out = Vec::with_capacity(data.len());
    let mut total = 0u64;
    for d in data {
        // Reads fill device-writable buffers; writes take device-readable ones.
        if d.is_write_only() != want_write && (ty == T_IN || ty == T_OUT || ty == T_GET_ID) {
            return None;
        }
        total += d.len() as u64;
        out.push((d.addr(), d.len()));
    }
    Some(Request { ty, sector, data: out, status: last.addr(), data_len: total })
}

/// What a worker needs to serve requests.
struct Disk {
    file: Arc<File>,
    sectors: u64,
    read_only: bool,
    id: [u8; 20],
    stats: Arc<BlockStats>,
}

/// A buffer aligned for O_DIRECT (4 KiB), of [`CHUNK`] bytes.
struct Bounce {
    v: Vec<u8>,
    off: usize,
}

impl Bounce {
    fn new() -> Bounce {
        let v = vec![0u8; CHUNK + 4096];
        let off = v.as_ptr().align_offset(4096);
        Bounce { v, off }
    }

    fn get(&mut self, n: usize) -> &mut [u8] {
        &mut self.v[self.off..self.off + n]
    }
}

impl Disk {
    /// Runs one request; returns the status and the bytes written into
    /// guest memory.
    fn run(&self, r: &Request, mem: &GuestMemoryMmap, bounce: &mut Bounce) -> (u8, u32) {
        match r.ty {
            T_IN | T_OUT => {
                if r.ty == T_OUT && self.read_only {
                    return (S_IOERR, 0);
                }
                let end = r.sector.checked_mul(SECTOR).and_then(|s| s.checked_add(r.data_len));
                if !r.data_len.is_multiple_of(SECTOR) || r.data_len > MAX_REQUEST || end.is_none_or(|e| e > self.sectors * SECTOR) {
                    return (S_IOERR, 0);
                }
                let mut pos = r.sector * SECTOR;
                let mut moved = 0u32;
                for &(addr, len) in &r.data {
                    let mut done = 0u64;
                    while done < len as u64 {
                        let n = (len as u64 - done).min(CHUNK as u64) as usize;
                        // With O_DIRECT, a descriptor that is not whole
                        // sectors fails here (EINVAL): an I/O error.
                        let buf = bounce.get(n);
                        let Some(at) = addr.checked_add(done) else {
                            self.stats.errors.fetch_add(1, Ordering::Relaxed);
                            return (S_IOERR, moved);
                        };
                        let ok = if r.ty == T_IN {
                            self.file.read_exact_at(buf, pos).is_ok() && mem.write_slice(buf, at).is_ok()
                        } else {
                            mem.read_slice(buf, at).is_ok() && self.file.write_all_at(buf, pos).is_ok()
                        };
                        if !ok {
                            self.stats.errors.fetch_add(1, Ordering::Relaxed);
                            return (S_IOERR, moved);
                        }
                        pos += n as u64;
                        done += n as u64;
                        if r.ty == T_IN {
                            moved += n as u32;
                        }
                    }
                }
                if r.ty == T_IN {
                    self.stats.reads.fetch_add(1, Ordering::Relaxed);
                    self.stats.bytes_read.fetch_add(r.data_len, Ordering::Relaxed);
                } else {
                    self.stats.writes.fetch_add(1, Ordering::Relaxed);
                    self.stats.bytes_written.fetch_add(r.data_len, Ordering::Relaxed);
                }
                (S_OK, moved)
            }
            T_FLUSH => {
                self.stats.flushes.fetch_add(1, Ordering::Relaxed);
                if self.read_only || self.file.sync_data().is_ok() {
                    (S_OK, 0)
                } else {
                    (S_IOERR, 0)
                }
            }
            T_GET_ID => {
                let Some(&(addr, len)) = r.data.first() else { return (S_IOERR, 0) };
                let n = (len as usize).min(20);
                if mem.write_slice(&self.id[..n], addr).is_err() {
                    return (S_IOERR, 0);
                }
                (S_OK, n as u32)
            }
            _ => (S_UNSUPP, 0),
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u16 {
        2
    }

    fn features(&self) -> u64 {
        let ro = if self.read_only { F_RO } else { 0 };
        VIRTIO_F_VERSION_1 | F_SIZE_MAX | F_SEG_MAX | F_BLK_SIZE | F_FLUSH | ro
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // capacity (u64), size_max (u32), seg_max (u32), geometry (u32),
        // blk_size (u32); the rest reads as zero.
        let mut cfg = [0u8; 24];
        cfg[0..8].copy_from_slice(&self.sectors.to_le_bytes());
        cfg[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        cfg[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        cfg[20..24].copy_from_slice(&(SECTOR as u32).to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset.checked_add(i as u64).and_then(|o| cfg.get(o as usize)).copied().unwrap_or(0);
        }
    }

    fn activate(&mut self, mem: GuestMemoryMmap, mut queues: Vec<Queue>, kicks: Vec<EventFd>, irq: Arc<dyn Interrupt>) -> Result<(), String> {
        let (Some(mut q), Some(kick)) = (queues.pop(), kicks.into_iter().next()) else { return Err("virtio-blk needs one queue".into()) };
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| e.to_string())?;
        let stop2 = stop.try_clone().map_err(|e| e.to_string())?;
        let disk = Disk { file: self.file.clone(), sectors: self.sectors, read_only: self.read_only, id: self.id, stats: self.stats.clone() };
        let limit = self.limit;
        let worker = std::thread::Builder::new()
            .name("virtio-blk".into())
            .spawn(move || {
                let ep = match Epoll::new() {
                    Ok(e) => e,
                    Err(e) => return tracing::error!("virtio-blk: epoll: {e}"),
                };
                for (fd, tok) in [(kick.as_raw_fd(), 0u64), (stop2.as_raw_fd(), 1u64)] {
                    if let Err(e) = ep.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, tok)) {
                        return tracing::error!("virtio-blk: epoll add: {e}");
                    }
                }
                if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Device) {
                    return tracing::error!("virtio-blk: {e}; the device stops serving");
                }
                let mut limiter = Limiter::new(limit, Instant::now());
                let mut bounce = Bounce::new();
                // A request the limiter held back, served first next time.
                let mut held: Option<(u16, Option<Request>)> = None;
                let mut events = vec![EpollEvent::default(); 2];
                loop {
                    let wait = serve(&mut q, &mem, &disk, &mut limiter, &mut bounce, &mut held, irq.as_ref());
                    let timeout = wait.map_or(-1, |d| if d.is_zero() { 0 } else { d.as_millis().clamp(1, i32::MAX as u128) as i32 });
                    let n = match ep.wait(timeout, &mut events) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => return tracing::error!("virtio-blk: epoll wait: {e}"),
                    };
                    for ev in &events[..n] {
                        if ev.data() == 1 {
                            return;
                        }
                        let _ = kick.read();
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

/// Serves available requests until the queue is empty or the rate limiter
/// says wait (returned).
fn serve(q: &mut Queue, mem: &GuestMemoryMmap, disk: &Disk, limiter: &mut Limiter, bounce: &mut Bounce, held: &mut Option<(u16, Option<Request>)>, irq: &dyn Interrupt) -> Option<Duration> {
    let mut used = false;
    let mut wait = None;
    let mut budget = BUDGET;
    loop {
        if budget == 0 {
            // Come back at once, after a look at the stop event.
            wait = Some(Duration::ZERO);
            break;
        }
        budget -= 1;
        let (head, req) = match held.take() {
            Some(h) => h,
            None => {
                let chain = match q.iter(mem) {
                    Ok(mut it) => it.next(),
                    Err(e) => {
                        if worth_logging(bump(&disk.stats.errors)) {
                            tracing::warn!("virtio-blk: bad available ring: {e}");
                        }
                        None
                    }
                };
                let Some(chain) = chain else { break };
                (chain.head_index(), parse(chain, mem))
            }
        };
        let Some(req) = req else {
            // A malformed chain: returned with nothing written.
            disk.stats.errors.fetch_add(1, Ordering::Relaxed);
            used |= q.add_used(mem, head, 0).is_ok();
            continue;
        };
        let bytes = if req.ty == T_IN || req.ty == T_OUT { req.data_len } else { 0 };
        if let Err(d) = limiter.admit(bytes, Instant::now()) {
            disk.stats.throttled.fetch_add(1, Ordering::Relaxed);
            *held = Some((head, Some(req)));
            wait = Some(d);
            break;
        }
        let (status, written) = disk.run(&req, mem, bounce);
        let ok = mem.write_obj(status, req.status).is_ok();
        used |= q.add_used(mem, head, if ok { written + 1 } else { written }).is_ok();
    }
    if used && q.needs_notification(mem).unwrap_or(true) {
        irq.signal_queue(0);
    }
    wait
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_must_be_whole_sectors() {
        let dir = std::env::temp_dir().join(format!("vgpu-blk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("odd.img");
        std::fs::write(&p, [0u8; 700]).unwrap();
        let e = Block::new(File::open(&p).unwrap(), true, "x", RateLimit::default()).err().unwrap();
        assert!(e.contains("512-byte sectors"), "{e}");
        std::fs::write(&p, [0u8; 1024]).unwrap();
        let b = Block::new(File::open(&p).unwrap(), true, "x", RateLimit::default()).unwrap();
        assert_eq!(b.sectors, 2);
        let mut cap = [0u8; 8];
        b.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 2);
        assert_ne!(b.features() & F_RO, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
