//! The stream engine: command rings in, device work out, with no round
//! trip per call.
//!
//! A connection (a host process's socket, or a VM's compute context) may
//! attach a command ring (`virtio_gpu_compute::ring`): memory it shares
//! with the worker. A fixed set of engine threads, made when the worker
//! starts, does two kinds of jobs:
//!
//! - **Ring jobs** consume a ring: each entry is copied out of shared
//!   memory, decoded and checked against the tenant's state like a socket
//!   message. Immediate calls (allocations, queries, handles) run at once
//!   and answer in the entry's reply slot; stream-ordered work (launches,
//!   memsets, copies, event records, stream waits) is queued on its
//!   stream. After the ring runs dry the job keeps polling for a short
//!   spin, while no other job waits, then marks the ring SLEEPING; the
//!   tenant wakes it again (an eventfd for host processes, a SUBMIT_3D for
//!   VMs) only when it finds it asleep.
//! - **Stream jobs** run a stream's queued work in order, one item per
//!   turn, so streams of every tenant take turns and different streams
//!   overlap on different threads. A stream wait parks its stream until
//!   the entry it waits for completes.
//!
//! Completions are published as sequence numbers in the ring's DONE array,
//! which the tenant reads without a syscall; a failed entry also lands in
//! the ring's error block, which the shim reports at its next
//! synchronising call. The worker keeps its own head, sequence and
//! completion record: what the tenant writes into its ring can break only
//! that ring (it is marked BROKEN and no longer served).
#![allow(clippy::result_large_err, reason = "the error is the reply sent back to the tenant, made once per failed call; boxing it would add an allocation to every failure for no gain")]

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_gpu_compute::ring::{self, EntryHeader};
use virtio_gpu_compute::*;

use super::service::{host_cost, Charge as HostCharge, Conn, DeviceService, Prepared, Tenant, Work, WorkGuard, WorkKind};
use crate::backend::BackendError;

/// How long a ring job keeps spinning on an empty ring, while no other job
/// waits for an engine thread.
pub const SPIN: Duration = Duration::from_micros(200);
/// After the spin, it looks again every NAP until the ring has been empty
/// for its idle time (IDLE at first), then sleeps until the tenant kicks
/// it: a tenant submitting now and then (a guest under emulation, a
/// framework between batches) costs no kick per call and no busy core.
pub const NAP: Duration = Duration::from_micros(100);
pub const IDLE: Duration = Duration::from_millis(5);
/// The most a ring's idle time grows to. Like KVM's halt polling, each
/// ring adapts: a kick that comes soon after the ring went to sleep (a
/// guest vCPU descheduled for a few milliseconds in the middle of a burst)
/// doubles its idle time, so the next such gap costs no kick; a long
/// sleep halves it again. Napping holds an engine thread only while no
/// other job waits for one.
pub const MAX_IDLE: Duration = Duration::from_millis(40);

/// A ring's next idle time, given its current one and how long it slept
/// before the tenant kicked it.
pub fn next_idle(idle: Duration, slept: Duration) -> Duration {
    if slept <= MAX_IDLE {
        (idle * 2).min(MAX_IDLE)
    } else {
        (idle / 2).max(IDLE)
    }
}
/// Entries one ring job consumes before it lets waiting jobs go first.
const ENTRIES_PER_TURN: usize = 256;
/// Distinct streams one ring may have queues for.
const MAX_STREAMS: usize = 4096;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Shared memory of one ring, as runs of host memory (one run for a
/// memfd; a guest blob's pages otherwise). Every access is bounds-checked
/// and goes through atomics or volatile copies: the tenant writes this
/// memory concurrently.
///
/// The memory stays the tenant's: a guest frees a blob's pages as soon as
/// the device answers RESOURCE_UNREF, and may put page tables or kernel
/// data in them the next instant. So every access happens inside
/// [`RingMem::with`], and [`RingMem::revoke`] ends access for good: it
/// returns only once no access is in progress, and every later one is
/// skipped.
pub struct RingMem {
    /// (offset in the ring, host address, length), in order.
    runs: Vec<(usize, *mut u8, usize)>,
    len: usize,
    /// Accesses in progress.
    active: AtomicU32,
    /// Set once by revoke(); no access starts after it.
    revoked: AtomicBool,
    /// Keeps the mapping alive.
    _keep: Box<dyn Send + Sync>,
}

// SAFETY: the runs point into a mapping that `_keep` keeps alive for the
// life of this value; all access is through atomics and volatile copies.
unsafe impl Send for RingMem {}
// SAFETY: as above.
unsafe impl Sync for RingMem {}

impl RingMem {
    /// Ring memory made of `runs`, kept mapped by `keep`. Each run must
    /// start 64-byte aligned and be a multiple of 64 bytes long, so no
    /// control word straddles two runs.
    pub fn new(runs: Vec<(*mut u8, usize)>, keep: Box<dyn Send + Sync>) -> Result<RingMem, String> {
        let mut out = Vec::with_capacity(runs.len());
        let mut at = 0usize;
        for (p, n) in runs {
            if !(p as usize).is_multiple_of(64) || !n.is_multiple_of(64) || n == 0 {
                return Err(format!("ring memory run of {n} bytes at {:#x} is not 64-byte aligned", p as usize % 4096));
            }
            out.push((at, p, n));
            at += n;
        }
        Ok(RingMem { runs: out, len: at, active: AtomicU32::new(0), revoked: AtomicBool::new(false), _keep: keep })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Runs `f` on the memory unless it was revoked (None then). `f` must
    /// be short: revoke() waits for it.
    fn with<R>(&self, f: impl FnOnce(&Self) -> R) -> Option<R> {
        // SeqCst on both sides (here: count, then look; revoke: mark, then
        // look at the count): either revoke() sees this access counted and
        // waits for it, or this access sees the mark and skips.
        self.active.fetch_add(1, Ordering::SeqCst);
        let r = if self.revoked.load(Ordering::SeqCst) { None } else { Some(f(self)) };
        self.active.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// Ends host access to the memory: returns once no access is in
    /// progress; every access after it is skipped.
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
        while self.active.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }

    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    fn load64(&self, off: usize) -> u64 {
        self.with(|m| m.u64_at(off).load(Ordering::Acquire)).unwrap_or(0)
    }

    fn store64(&self, off: usize, v: u64) {
        self.with(|m| m.u64_at(off).store(v, Ordering::Release));
    }

    fn store32(&self, off: usize, v: u32) {
        self.with(|m| m.u32_at(off).store(v, Ordering::SeqCst));
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address of `[off, off+n)` if it lies inside one run.
    fn at(&self, off: usize, n: usize) -> Option<*mut u8> {
        let i = self.runs.partition_point(|r| r.0 <= off).checked_sub(1)?;
        let (start, p, len) = self.runs[i];
        let end = off.checked_add(n)?;
        if end <= start + len {
            // SAFETY: off - start < len: the result stays inside the run.
            Some(unsafe { p.add(off - start) })
        } else {
            None
        }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        let p = self.at(off, 8).filter(|p| (*p as usize).is_multiple_of(8)).expect("ring control words lie inside the checked layout");
        // SAFETY: 8 aligned bytes inside the mapping, which lives as long
        // as `self`; shared memory is only ever reached through atomics
        // and volatile copies.
        unsafe { AtomicU64::from_ptr(p.cast()) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        let p = self.at(off, 4).filter(|p| (*p as usize).is_multiple_of(4)).expect("ring control words lie inside the checked layout");
        // SAFETY: as for u64_at, with 4 aligned bytes.
        unsafe { AtomicU32::from_ptr(p.cast()) }
    }

    /// Calls `f(slice, done)` for consecutive volatile slices covering
    /// `[off, off+len)` across runs (`done`: bytes before this slice);
    /// false if the range leaves the ring.
    fn each_run(&self, mut off: usize, len: usize, mut f: impl FnMut(vm_memory::VolatileSlice<'_>, usize)) -> bool {
        let mut done = 0;
        while done < len {
            let Some(i) = self.runs.partition_point(|r| r.0 <= off).checked_sub(1) else { return false };
            let (start, p, rlen) = self.runs[i];
            if off >= start + rlen {
                return false;
            }
            let n = (start + rlen - off).min(len - done);
            // SAFETY: [off, off+n) lies inside run i of the live mapping.
            f(unsafe { vm_memory::VolatileSlice::new(p.add(off - start), n) }, done);
            done += n;
            off += n;
        }
        true
    }

    /// Copies `[off, off+out.len())` out of shared memory, across runs.
    /// False if the range leaves the ring or the memory was revoked.
    fn read(&self, off: usize, out: &mut [u8]) -> bool {
        self.with(|m| {
            m.each_run(off, out.len(), |v, done| {
                v.copy_to(&mut out[done..done + v.len()]);
            })
        })
        .unwrap_or(false)
    }

    fn write(&self, off: usize, data: &[u8]) -> bool {
        self.with(|m| m.each_run(off, data.len(), |v, done| v.copy_from(&data[done..done + v.len()]))).unwrap_or(false)
    }
}

/// One queued piece of stream work and the ring entry it completes.
struct Item {
    seq: u64,
    work: Work,
    _inflight: WorkGuard,
    /// Its host budget, held while it is queued (none when it ran at once).
    _charge: Option<HostCharge>,
}

impl AsRef<Work> for Item {
    fn as_ref(&self) -> &Work {
        &self.work
    }
}

/// Host bytes one queued item costs besides its message.
const QUEUED_ITEM_BYTES: u64 = 256;

#[derive(Default)]
struct StreamQ {
    items: VecDeque<Item>,
    /// In the ready queue, running, or parked on a wait.
    scheduled: bool,
}

/// Queue capacity an idle stream keeps; a burst's larger one is given
/// back when the stream runs dry.
const IDLE_QUEUE: usize = 16;

pub struct Stream {
    q: Mutex<StreamQ>,
    /// The stream's entry in its ring's map, charged while it is there.
    _charge: HostCharge,
}

impl StreamQ {
    /// The stream ran dry: idle, with its queue's memory back to
    /// [`IDLE_QUEUE`] items.
    fn idle(&mut self) {
        self.scheduled = false;
        if self.items.capacity() > 4 * IDLE_QUEUE {
            self.items.shrink_to(IDLE_QUEUE);
        }
    }
}

/// Copies and memsets up to this size count as short work.
const SHORT_BYTES: u64 = 4 << 20;

/// Whether work is bounded: an event record, a wait, or a copy or memset
/// of at most SHORT_BYTES.
fn work_is_short(k: &WorkKind) -> bool {
    match k {
        WorkKind::Record { .. } | WorkKind::Wait { .. } => true,
        WorkKind::Fill { count, elem, .. } => count.saturating_mul(elem.len() as u64) <= SHORT_BYTES,
        WorkKind::HtoD { size, .. } | WorkKind::DtoH { size, .. } | WorkKind::DtoD { size, .. } => *size <= SHORT_BYTES,
        WorkKind::Launch { .. } | WorkKind::Graph { .. } => false,
    }
}

impl Stream {
    /// Whether the next item is bounded work (see [`work_is_short`]).
    fn is_short(&self) -> bool {
        lock(&self.q).items.front().is_none_or(|i| work_is_short(&i.work.kind))
    }
}

struct Done {
    /// The newest completed sequence number per completion slot.
    slots: Vec<u64>,
    /// Streams parked on a wait: (entry awaited, stream).
    parked: Vec<(u64, Arc<Stream>)>,
    /// Entries consumed and not yet complete.
    pending: u64,
}

impl Done {
    fn is_done(&self, seq: u64) -> bool {
        self.slots[(seq % ring::ENTRY_SLOTS) as usize] >= seq
    }
}

struct Cursor {
    head: u64,
    seq: u64,
}

/// Why a ring stopped being served.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct RingBroken(String);

/// One attached command ring.
pub struct Ring {
    svc: Arc<DeviceService>,
    pub tenant: Arc<Tenant>,
    conn: Arc<Mutex<Conn>>,
    mem: RingMem,
    sq_size: u64,
    cur: Mutex<Cursor>,
    done: Mutex<Done>,
    streams: Mutex<HashMap<(u32, u32), Arc<Stream>>>,
    polling: AtomicBool,
    broken: AtomicBool,
    closed: AtomicBool,
    /// The host tenant's kick eventfd, watched by the connection poller.
    pub kick_fd: Option<OwnedFd>,
    pub entries: AtomicU64,
    pub kicks: AtomicU64,
    /// How long the ring may stay empty before its poller sleeps
    /// (`next_idle`), and when it last went to sleep.
    idle: Mutex<(Duration, Option<Instant>)>,
    /// One error-block writer at a time, and the count it last wrote (the
    /// shared word is the tenant's to scribble on).
    err_lock: Mutex<()>,
    err_count: AtomicU32,
}

impl Ring {
    /// Sets up a ring over `mem` (already mapped) with an `sq_size`-byte
    /// queue. The worker writes the initial DONE slots; the tenant owns the
    /// rest of the memory.
    pub fn new(svc: Arc<DeviceService>, tenant: Arc<Tenant>, conn: Arc<Mutex<Conn>>, mem: RingMem, sq_size: u32, kick_fd: Option<OwnedFd>) -> Result<Arc<Ring>, String> {
        if !ring::sq_size_ok(sq_size) {
            return Err(format!("ring queue of {sq_size} bytes (a power of two from {} to {})", ring::MIN_SQ, ring::MAX_SQ));
        }
        if mem.len() < ring::region_size(sq_size) {
            return Err(format!("ring memory of {} bytes; a {sq_size}-byte queue needs {}", mem.len(), ring::region_size(sq_size)));
        }
        let r = Ring {
            svc,
            tenant,
            conn,
            mem,
            sq_size: sq_size as u64,
            cur: Mutex::new(Cursor { head: 0, seq: ring::FIRST_SEQ }),
            done: Mutex::new(Done { slots: (0..ring::ENTRY_SLOTS).collect(), parked: Vec::new(), pending: 0 }),
            streams: Mutex::new(HashMap::new()),
            polling: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            kick_fd,
            entries: AtomicU64::new(0),
            kicks: AtomicU64::new(0),
            idle: Mutex::new((IDLE, None)),
            err_lock: Mutex::new(()),
            err_count: AtomicU32::new(0),
        };
        for k in 0..ring::ENTRY_SLOTS {
            r.mem.store64(ring::done_offset(k), k);
        }
        for w in [ring::SQ_HEAD, ring::SQ_TAIL] {
            r.mem.store64(w, 0);
        }
        for w in [ring::BROKEN, ring::ERR_COUNT, ring::WAITERS] {
            r.mem.store32(w, 0);
        }
        // No job polls it yet: the first entry must wake it.
        r.mem.store32(ring::STATE, ring::STATE_SLEEPING);
        Ok(Arc::new(r))
    }

    /// A connection's transport figures: its `messages`, and the entries
    /// and kicks of its ring if it has one.
    pub fn stats(ring: Option<&Ring>, messages: u64) -> ConnStats {
        let (ring_entries, kicks) = ring.map(|r| (r.entries.load(Ordering::Relaxed), r.kicks.load(Ordering::Relaxed))).unwrap_or((0, 0));
        ConnStats { messages, ring_entries, kicks }
    }

    /// The tenant found the ring asleep and woke it.
    pub fn kick(self: &Arc<Self>, engine: &Engine) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
        {
            let mut idle = lock(&self.idle);
            if let Some(at) = idle.1.take() {
                idle.0 = next_idle(idle.0, at.elapsed());
            }
        }
        self.wake(engine);
    }

    fn wake(self: &Arc<Self>, engine: &Engine) {
        if self.requeue(engine) {
            engine.cv.notify_one();
        }
    }

    /// Queues a job to poll the ring unless one polls it already (or it
    /// closed); whether it did. Nobody is woken for it.
    fn requeue(self: &Arc<Self>, engine: &Engine) -> bool {
        let queued = !self.closed.load(Ordering::Acquire) && !self.polling.swap(true, Ordering::SeqCst);
        if queued {
            // Rings go first: their consumers keep every tenant's calls
            // moving, and each takes a thread only while there is work.
            engine.push_front_quiet(Job::Ring(self.clone()));
        }
        queued
    }

    /// Stops serving the ring (the connection is gone, or the guest let go
    /// of the ring's memory) and ends every access to its memory before it
    /// returns; queued work still completes or fails on its own, without
    /// touching the ring.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.mem.revoke();
        lock(&self.streams).clear();
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn tail(&self) -> u64 {
        self.mem.load64(ring::SQ_TAIL)
    }

    /// A ring job: consume, spin a little while idle, then sleep.
    fn poll(self: &Arc<Self>, engine: &Engine) {
        let state = |v: u32| self.mem.store32(ring::STATE, v);
        state(ring::STATE_AWAKE);
        let idle_for = lock(&self.idle).0;
        let mut last = Instant::now();
        // Entries consumed this turn, over every drain: a tenant that keeps
        // a few entries queued at a time still gives its thread up.
        let mut taken = 0usize;
        loop {
            if self.closed.load(Ordering::Acquire) || self.is_broken() {
                break;
            }
            let drained = self.drain(engine);
            if let Ok(n) = drained {
                taken = taken.saturating_add(n);
            }
            match drained {
                // A ring closed meanwhile reads as empty memory: not the
                // tenant's fault, and nothing to report.
                Err(_) if self.closed.load(Ordering::Acquire) => break,
                Err(e) => {
                    self.break_ring(&e);
                    break;
                }
                Ok(n) if n > 0 && taken >= ENTRIES_PER_TURN && engine.others_waiting() => {
                    // Busy: go to the back of the queue, still awake.
                    engine.push(Job::Ring(self.clone()));
                    return;
                }
                Ok(0) => {
                    // The ring is empty: run the work it queued on this
                    // thread, which is running already, and hand the ring
                    // to an idle thread (the work may be long). Waking a
                    // thread for the work instead would put a sleeping
                    // thread's wake-up on the work's path.
                    if let Some((job, short)) = engine.steal_stream_job() {
                        if short {
                            // Bounded (a small copy or memset, an event):
                            // this thread stays the ring's poller.
                            engine.run_job(job);
                            last = Instant::now();
                            continue;
                        }
                        self.polling.store(false, Ordering::SeqCst);
                        // One wake-up per queued job: the ring's and any
                        // others'.
                        self.requeue(engine);
                        engine.notify_queued(0);
                        engine.run_long(job);
                        return;
                    }
                }
                Ok(_) => {
                    last = Instant::now();
                    if self.tail() != lock(&self.cur).head {
                        // More is coming: let idle threads start the work.
                        engine.notify_queued(0);
                    }
                    continue;
                }
            }
            let idle = last.elapsed();
            if idle < idle_for && !engine.others_waiting() {
                if idle < SPIN {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(NAP);
                }
                continue;
            }
            lock(&self.idle).1 = Some(Instant::now());
            state(ring::STATE_SLEEPING);
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.tail() != lock(&self.cur).head && !self.closed.load(Ordering::Acquire) {
                state(ring::STATE_AWAKE);
                continue;
            }
            break;
        }
        self.polling.store(false, Ordering::SeqCst);
        // A kick that came while this job was ending found it still
        // polling and was dropped: look once more.
        if !self.is_broken() && !self.closed.load(Ordering::Acquire) && self.tail() != lock(&self.cur).head {
            self.wake(engine);
        }
        // Work the ring queued without waking anyone (it ran dry, broke or
        // closed mid-drain) goes to idle threads too, not only to this
        // thread, which takes the first.
        engine.notify_queued(1);
    }

    fn break_ring(&self, e: &RingBroken) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            // A tenant may break ring after ring: few are logged.
            static LOG: std::sync::LazyLock<crate::worker::conn::LogLimiter> = std::sync::LazyLock::new(|| crate::worker::conn::LogLimiter::new(20, std::time::Duration::from_secs(10)));
            if let Some(dropped) = LOG.allow() {
                tracing::warn!(tenant = %self.tenant.name, suppressed = dropped, "command ring no longer served: {e}");
            }
            self.report(0, 0, CuResult::CUDA_ERROR_ILLEGAL_STATE, &format!("command ring broken: {e}"));
            self.mem.store32(ring::BROKEN, CuResult::CUDA_ERROR_ILLEGAL_STATE as u32);
            self.wake_waiters();
        }
    }

    /// Consumes the entries written so far (up to a turn's worth).
    fn drain(self: &Arc<Self>, engine: &Engine) -> Result<usize, RingBroken> {
        let tail = self.tail();
        let mut n = 0;
        while n < ENTRIES_PER_TURN {
            let (head, seq) = {
                let c = lock(&self.cur);
                (c.head, c.seq)
            };
            if head == tail {
                break;
            }
            let avail = tail.wrapping_sub(head);
            if avail > self.sq_size {
                return Err(RingBroken(format!("tail {tail} is not within {} bytes after head {head}", self.sq_size)));
            }
            let pos = (head % self.sq_size) as usize;
            let mut hb = [0u8; EntryHeader::SIZE];
            if avail < EntryHeader::SIZE as u64 || !self.mem.read(ring::SQ + pos, &mut hb) {
                return Err(RingBroken(format!("partial entry header at {head}")));
            }
            let h = EntryHeader::get(&mut Reader::new(&hb)).map_err(|e| RingBroken(e.to_string()))?;
            let len = h.len as usize;
            if len < EntryHeader::SIZE || !len.is_multiple_of(ring::ENTRY_ALIGN) || pos + len > self.sq_size as usize || len as u64 > avail {
                return Err(RingBroken(format!("entry of {len} bytes at {head}")));
            }
            if h.flags == ring::ENTRY_PAD {
                if pos + len != self.sq_size as usize {
                    return Err(RingBroken(format!("padding entry at {head} does not end the queue")));
                }
            } else {
                if h.flags != 0 || len > ring::MAX_ENTRY {
                    return Err(RingBroken(format!("entry of {len} bytes with flags {:#x}", h.flags)));
                }
                if h.seq != seq {
                    return Err(RingBroken(format!("entry sequence {} where {seq} was next", h.seq)));
                }
                if h.reply != ring::NO_REPLY && h.reply >= ring::REPLY_SLOTS {
                    return Err(RingBroken(format!("reply slot {}", h.reply)));
                }
                {
                    let mut d = lock(&self.done);
                    // Its completion slot is entry seq - ENTRY_SLOTS's:
                    // taken before that one is complete, the slot would
                    // say the older one is done while it still runs.
                    if d.pending >= ring::ENTRY_SLOTS || !d.is_done(seq - ring::ENTRY_SLOTS) {
                        return Err(RingBroken(format!("entry {seq} before entry {} completed (more than {} entries in flight)", seq - ring::ENTRY_SLOTS, ring::ENTRY_SLOTS)));
                    }
                    d.pending += 1;
                }
                let mut msg = vec![0u8; len - EntryHeader::SIZE];
                if !self.mem.read(ring::SQ + pos + EntryHeader::SIZE, &mut msg) {
                    return Err(RingBroken(format!("entry at {head} outside the ring")));
                }
                // The message is as long as its header says; the rest of
                // the entry is padding.
                let used = MsgHeader::decode(&msg).map(|m| MsgHeader::SIZE + m.payload_len as usize).unwrap_or(msg.len()).min(msg.len());
                if ring::entry_len(used) != len {
                    self.finish(engine, seq, h.reply, Err(Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, format!("ring entry of {len} bytes holds a message of {used}"))), Opcode::Ping);
                } else {
                    msg.truncate(used);
                    self.entries.fetch_add(1, Ordering::Relaxed);
                    self.process(engine, seq, h.reply, &msg);
                }
                lock(&self.cur).seq = seq + 1;
            }
            {
                let mut c = lock(&self.cur);
                c.head = head + len as u64;
                self.mem.store64(ring::SQ_HEAD, c.head);
            }
            n += 1;
        }
        Ok(n)
    }

    fn process(self: &Arc<Self>, engine: &Engine, seq: u64, reply: u16, msg: &[u8]) {
        let (h, req) = match Request::decode(msg) {
            Ok(x) => x,
            Err(e) => {
                let op = MsgHeader::decode(msg).map(|h| h.opcode()).unwrap_or(Opcode::Ping);
                return self.finish(engine, seq, reply, Err(Reply::error(e.cuda(), format!("bad {op:?} message in the ring: {e}"))), op);
            }
        };
        let op = h.opcode();
        let refuse = |why: &str| Err(Reply::error(CuResult::CUDA_ERROR_NOT_SUPPORTED, why.to_string()));
        let prepared = match req {
            Request::RegisterShm(_) | Request::AttachRing(_) => refuse("this request carries descriptors: send it on the socket"),
            Request::ModuleLoad(..) => refuse("module images go on the socket"),
            Request::MemcpyHtoD(b, _) if b.loc == DataLoc::Inline as u32 => refuse("ring copies go through shared regions"),
            Request::MemcpyDtoH(b) if b.loc == DataLoc::Inline as u32 => refuse("ring copies go through shared regions"),
            Request::GetConnStats => Ok(Prepared::Done(Reply::ConnStats(Ring::stats(Some(self), 0)))),
            Request::UnregisterShm(_) => refuse("unregistering a shared region goes on the socket"),
            // Only an entry written before can be waited for: waits never
            // form a cycle and every wait ends.
            Request::StreamWait(b) if b.seq >= seq => Err(Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, format!("a stream wait for entry {} at entry {seq}", b.seq))),
            req => {
                let mut conn = lock(&self.conn);
                self.svc.prepare(&self.tenant, &mut conn, req)
            }
        };
        match prepared {
            Err(r) => self.finish(engine, seq, reply, Err(r), op),
            Ok(Prepared::Done(r)) => {
                let res = if matches!(r, Reply::Error(..)) { Err(r) } else { Ok(r) };
                self.finish(engine, seq, reply, res, op)
            }
            Ok(Prepared::Work(mut w)) => {
                if let WorkKind::Record { order, .. } = &mut w.kind {
                    *order = seq;
                }
                self.enqueue(engine, seq, reply, op, w, QUEUED_ITEM_BYTES + msg.len() as u64)
            }
        }
    }

    /// Completes an entry that ran at once: its reply into its slot (an
    /// error without a slot goes to the error block).
    fn finish(self: &Arc<Self>, engine: &Engine, seq: u64, reply: u16, res: Result<Reply, Reply>, op: Opcode) {
        let r = match res {
            Ok(r) | Err(r) => r,
        };
        if reply != ring::NO_REPLY {
            let mut bytes = r.encode(op, seq as u32);
            if bytes.len() > ring::REPLY_SLOT_SIZE {
                bytes = Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, "reply larger than a reply slot").encode(op, seq as u32);
            }
            self.mem.write(ring::reply_offset(reply), &bytes);
        } else if let Reply::Error(code, msg) = &r {
            self.report(seq, 0, *code, msg);
        }
        self.complete(engine, seq);
        if let Reply::Error(code, _) = &r {
            vgpu_arbiter::fatal::replied(*code as u32);
        }
    }

    /// Runs `work` now if its stream is idle and the work bounded, or
    /// queues it on its stream, charged (`cost` host bytes) until it ran.
    fn enqueue(self: &Arc<Self>, engine: &Engine, seq: u64, reply: u16, op: Opcode, work: Work, cost: u64) {
        let key = (work.ctx, work.stream);
        let stream = {
            let mut m = lock(&self.streams);
            if m.len() >= MAX_STREAMS && !m.contains_key(&key) {
                m.retain(|_, s| lock(&s.q).scheduled);
            }
            if m.len() >= MAX_STREAMS && !m.contains_key(&key) {
                drop(m);
                return self.finish(engine, seq, ring::NO_REPLY, Err(Reply::error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("more than {MAX_STREAMS} streams with work queued"))), Opcode::Ping);
            }
            match m.get(&key) {
                Some(s) => s.clone(),
                None => match HostCharge::take(&self.tenant.host, host_cost::RING_STREAM, "a stream's queue") {
                    Ok(charge) => m.entry(key).or_insert_with(|| Arc::new(Stream { q: Mutex::new(StreamQ::default()), _charge: charge })).clone(),
                    Err(r) => {
                        drop(m);
                        return self.finish(engine, seq, reply, Err(r), op);
                    }
                },
            }
        };
        let short = work_is_short(&work.kind) && !matches!(work.kind, WorkKind::Wait { .. });
        let inflight = self.tenant.begin_work();
        let mut q = lock(&stream.q);
        if short && !q.scheduled {
            let item = Item { seq, work, _inflight: inflight, _charge: None };
            // The stream is idle and the work bounded: run it now, on the
            // polling thread, the cheapest way to the device (stream order
            // holds: nothing of this stream is queued or running).
            q.scheduled = true;
            drop(q);
            self.run_item(engine, item);
            return self.reschedule(engine, stream, false);
        }
        // Queued work is charged to the tenant's host budget until it ran.
        let charge = match HostCharge::take(&self.tenant.host, cost, "queued stream work") {
            Ok(c) => c,
            Err(r) => {
                drop(q);
                // Not in flight once the tenant sees the entry done.
                drop(inflight);
                drop(work);
                return self.finish(engine, seq, reply, Err(r), op);
            }
        };
        let item = Item { seq, work, _inflight: inflight, _charge: Some(charge) };
        q.items.push_back(item);
        if !q.scheduled {
            q.scheduled = true;
            drop(q);
            // Nobody is woken yet: the polling thread runs it when the ring
            // runs dry, or wakes others if more entries keep coming.
            engine.push_quiet(Job::Stream(self.clone(), stream));
        }
    }

    /// A stream job: runs the stream's next item.
    fn run_stream(self: &Arc<Self>, engine: &Engine, stream: Arc<Stream>) {
        let item = {
            let mut q = lock(&stream.q);
            let wait = match q.items.front() {
                None => {
                    q.idle();
                    return;
                }
                Some(Item { work: Work { kind: WorkKind::Wait { seq }, .. }, .. }) => Some(*seq),
                Some(_) => None,
            };
            if let Some(x) = wait {
                let mut d = lock(&self.done);
                if !d.is_done(x) {
                    // Woken by the completion of entry x.
                    d.parked.push((x, stream.clone()));
                    return;
                }
            }
            q.items.pop_front()
        };
        let Some(item) = item else { return };
        if matches!(item.work.kind, WorkKind::Launch { .. } | WorkKind::Graph { .. }) && self.svc.pipelines() {
            self.run_launches(engine, &stream, item);
        } else {
            self.run_item(engine, item);
        }
        self.reschedule(engine, stream, true);
    }

    /// Runs `first` and the launches queued behind it on its stream as
    /// one batch on a device that runs kernels on its own
    /// (`super::pipeline`): each is queued while the last runs, and each
    /// entry completes when its kernel ended.
    fn run_launches(self: &Arc<Self>, engine: &Engine, stream: &Arc<Stream>, first: Item) {
        // As for one item: waiting work is woken once completions are out.
        let _wake_later = vgpu_arbiter::sched::WakeLater::new();
        let next = |fits: &dyn Fn(&Item) -> bool| {
            let mut q = lock(&stream.q);
            if q.items.front().is_some_and(|i| matches!(i.work.kind, WorkKind::Launch { .. } | WorkKind::Graph { .. }) && fits(i)) {
                q.items.pop_front()
            } else {
                None
            }
        };
        self.svc.launch_batch(&self.tenant, first, next, |item, res| self.finish_item(engine, item, res));
    }

    /// After an item of a scheduled stream ran: queue the stream again if
    /// it has more (waking a thread for it if `wake`), or mark it idle.
    fn reschedule(self: &Arc<Self>, engine: &Engine, stream: Arc<Stream>, wake: bool) {
        let mut q = lock(&stream.q);
        if q.items.is_empty() {
            q.idle();
            return;
        }
        drop(q);
        let job = Job::Stream(self.clone(), stream);
        if wake {
            engine.push(job)
        } else {
            engine.push_quiet(job)
        }
    }

    /// Runs one item and completes its entry (a bug in the work fails
    /// that entry, and the entry still completes).
    fn run_item(self: &Arc<Self>, engine: &Engine, item: Item) {
        // Work waiting for the lane this item gives back is woken once the
        // item's completion is out: the tenant waiting for it goes first.
        let _wake_later = vgpu_arbiter::sched::WakeLater::new();
        let res = match &item.work.kind {
            WorkKind::Wait { .. } => Ok(()),
            _ => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.svc.execute(&self.tenant, &item.work).map(|_| ())))
                .unwrap_or_else(|_| Err(BackendError::new(CuResult::CUDA_ERROR_UNKNOWN, "internal error"))),
        };
        self.finish_item(engine, item, res);
    }

    /// Reports how an item ended and completes its entry.
    fn finish_item(self: &Arc<Self>, engine: &Engine, item: Item, res: Result<(), BackendError>) {
        let Item { seq, work, _inflight: inflight, _charge: charge } = item;
        if let Err(e) = &res {
            self.report_backend(seq, work.ctx, e);
        }
        // The work is over before the tenant can see it complete: memory
        // it freed meanwhile is back in its quota (and its host charge
        // released) by the time a synchronize returns, so a cuMemGetInfo
        // or cuMemAlloc right after sees it, as on CUDA.
        drop(work);
        drop(inflight);
        drop(charge);
        self.complete(engine, seq);
        if let Err(e) = &res {
            vgpu_arbiter::fatal::replied(e.code as u32);
        }
    }

    fn report_backend(&self, seq: u64, ctx: u32, e: &BackendError) {
        self.report(seq, ctx, e.code, &e.msg);
    }

    /// Records an asynchronous error in the ring's error block (a
    /// sequence lock: one writer at a time, the count odd while it writes).
    fn report(&self, seq: u64, ctx: u32, code: CuResult, msg: &str) {
        let text = &msg.as_bytes()[..msg.len().min(ring::ERR_TEXT_MAX)];
        let _g = lock(&self.err_lock);
        let c = self.err_count.load(Ordering::Relaxed);
        self.mem.with(|m| {
            let count = m.u32_at(ring::ERR_COUNT);
            count.store(c.wrapping_add(1), Ordering::Release);
            std::sync::atomic::fence(Ordering::Release);
            m.u32_at(ring::ERR_CODE).store(code as u32, Ordering::Relaxed);
            m.u64_at(ring::ERR_SEQ).store(seq, Ordering::Relaxed);
            m.u32_at(ring::ERR_LEN).store(text.len() as u32, Ordering::Relaxed);
            m.u32_at(ring::ERR_CTX).store(ctx, Ordering::Relaxed);
            m.each_run(ring::ERR_TEXT, text.len(), |v, done| v.copy_from(&text[done..done + v.len()]));
            count.store(c.wrapping_add(2), Ordering::Release);
        });
        self.err_count.store(c.wrapping_add(2), Ordering::Relaxed);
    }

    /// Marks entry `seq` complete, wakes the streams parked on it and any
    /// tenant thread sleeping on the ring.
    fn complete(self: &Arc<Self>, engine: &Engine, seq: u64) {
        let ready: Vec<Arc<Stream>> = {
            let mut d = lock(&self.done);
            let k = (seq % ring::ENTRY_SLOTS) as usize;
            d.slots[k] = d.slots[k].max(seq);
            d.pending = d.pending.saturating_sub(1);
            self.mem.store64(ring::done_offset(seq), d.slots[k]);
            let mut ready = Vec::new();
            let mut i = 0;
            while i < d.parked.len() {
                if d.is_done(d.parked[i].0) {
                    ready.push(d.parked.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
            ready
        };
        for s in ready {
            engine.push(Job::Stream(self.clone(), s));
        }
        self.wake_waiters();
    }

    fn wake_waiters(&self) {
        self.mem.with(|m| {
            if m.u32_at(ring::WAITERS).load(Ordering::SeqCst) != 0 {
                let w = m.u32_at(ring::WAKE);
                w.fetch_add(1, Ordering::SeqCst);
                // SAFETY: FUTEX_WAKE on an aligned u32 of the live shared
                // mapping; it reads nothing else and wakes only the tenant's
                // own threads waiting on that word.
                unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE, i32::MAX, std::ptr::null::<libc::timespec>(), std::ptr::null::<u32>(), 0) };
            }
        });
    }
}

/// What an engine thread does next.
pub enum Job {
    Ring(Arc<Ring>),
    Stream(Arc<Ring>, Arc<Stream>),
}

#[derive(Default)]
struct ReadyQ {
    jobs: VecDeque<Job>,
    idle: usize,
    /// Stream jobs of unbounded length (launches, big copies) running.
    long: usize,
    /// The same, per tenant.
    long_of: HashMap<String, usize>,
}

impl ReadyQ {
    fn take_long(&mut self, tenant: &str) {
        self.long += 1;
        *self.long_of.entry(tenant.to_string()).or_default() += 1;
    }

    fn give_long(&mut self, tenant: &str) {
        self.long -= 1;
        if let Some(n) = self.long_of.get_mut(tenant) {
            *n -= 1;
            if *n == 0 {
                self.long_of.remove(tenant);
            }
        }
    }

    fn long_room(&self, cap: usize, per_tenant: usize, tenant: &str) -> bool {
        self.long < cap && self.long_of.get(tenant).copied().unwrap_or(0) < per_tenant
    }
}

/// The engine's fixed thread pool and its ready queue.
///
/// At most `long_cap` threads run work of unbounded length at once, so one
/// thread is always left for rings and bounded work: no tenant's kernels
/// can stop another tenant's calls from being consumed. One tenant's long
/// work takes at most `per_tenant` of those (the device's lanes), so
/// several tenants' launches wait at the device scheduler together, where
/// fair share, priority and preemption decide between them.
pub struct Engine {
    q: Mutex<ReadyQ>,
    cv: Condvar,
    long_cap: usize,
    per_tenant: usize,
    /// Orders long stream work between tenants by weighted fair share
    /// (the scheduler's passes); `None`: oldest first.
    fair: Option<Arc<vgpu_arbiter::sched::WeightedFair>>,
}

impl Engine {
    /// Starts the engine threads for a device of `lanes` lanes: enough for
    /// four tenants' long work at the scheduler at once, and one more. With
    /// `seccomp`, each narrows its filter like a connection thread: it
    /// decodes tenant bytes.
    pub fn start(lanes: usize, seccomp: bool, fair: Option<Arc<vgpu_arbiter::sched::WeightedFair>>) -> std::io::Result<Arc<Engine>> {
        let lanes = lanes.max(1);
        let threads = 4 * lanes + 1;
        let e = Arc::new(Engine { q: Mutex::new(ReadyQ::default()), cv: Condvar::new(), long_cap: threads - 1, per_tenant: lanes, fair });
        for i in 0..threads {
            let e2 = e.clone();
            std::thread::Builder::new().name(format!("vgpu-engine-{i}")).spawn(move || {
                if seccomp && super::seccomp::confine_connection_thread().is_err() {
                    tracing::error!("an engine thread could not narrow its seccomp filter; the worker exits");
                    std::process::exit(70);
                }
                e2.run()
            })?;
        }
        Ok(e)
    }

    fn push(&self, job: Job) {
        lock(&self.q).jobs.push_back(job);
        self.cv.notify_one();
    }

    fn push_quiet(&self, job: Job) {
        lock(&self.q).jobs.push_back(job);
    }

    fn push_front_quiet(&self, job: Job) {
        lock(&self.q).jobs.push_front(job);
    }

    /// Runs a job of unbounded length counted in `long` (taken by the
    /// caller), then gives its slot back.
    fn run_long(&self, job: Job) {
        let tenant = Self::tenant_of(&job).to_string();
        self.run_job(job);
        let mut q = lock(&self.q);
        q.give_long(&tenant);
        // The slot given back admits at most one more long job: one idle
        // thread is woken for it, if one waits. Waking every idle thread
        // (they would all race for that one job) put a dozen context
        // switches behind each launch on a small machine. The one is woken
        // even where this thread, looking at the queue next, could take
        // the job itself: without it a launch + synchronize loop through
        // the ring measured slower on two cores, in six of seven runs (the job is
        // often the ring, handed on by the launch, and this thread may
        // lose its core before it gets there).
        let wake = q.idle > 0 && q.jobs.iter().any(|j| self.admissible(&q, j).is_some());
        drop(q);
        if wake {
            self.cv.notify_one();
        }
    }

    /// Whether `job` may start now: Some(long) if so.
    fn admissible(&self, q: &ReadyQ, job: &Job) -> Option<bool> {
        match job {
            Job::Ring(_) => Some(false),
            Job::Stream(_, s) if s.is_short() => Some(false),
            Job::Stream(r, _) if q.long_room(self.long_cap, self.per_tenant, &r.tenant.name) => Some(true),
            Job::Stream(..) => None,
        }
    }

    /// Wakes idle threads for the queued jobs that may start, besides
    /// `taking` of them that the calling thread takes itself next.
    fn notify_queued(&self, taking: usize) {
        let q = lock(&self.q);
        let n = q.jobs.iter().filter(|j| self.admissible(&q, j).is_some()).count().saturating_sub(taking).min(q.idle);
        drop(q);
        for _ in 0..n {
            self.cv.notify_one();
        }
    }

    /// The oldest queued stream job and whether its next item is short
    /// (bounded by a few MiB of copying). A long one is taken only if a
    /// thread is idle to take over the ring its caller polls.
    fn steal_stream_job(&self) -> Option<(Job, bool)> {
        let mut q = lock(&self.q);
        let idle = q.idle > 0;
        let i = q.jobs.iter().position(|j| matches!(j, Job::Stream(r, s) if s.is_short() || (idle && q.long_room(self.long_cap, self.per_tenant, &r.tenant.name))))?;
        let job = q.jobs.remove(i)?;
        let short = matches!(&job, Job::Stream(_, s) if s.is_short());
        if !short {
            q.take_long(Self::tenant_of(&job));
        }
        Some((job, short))
    }

    fn run_job(&self, job: Job) {
        let ring = match &job {
            Job::Ring(r) | Job::Stream(r, _) => r.clone(),
        };
        // A bug must cost the job, never the engine thread; the ring it
        // came from stops being served (its waiters see BROKEN).
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match job {
            Job::Ring(r) => r.poll(self),
            Job::Stream(r, s) => r.run_stream(self, s),
        }));
        if r.is_err() {
            tracing::error!(tenant = %ring.tenant.name, "an engine job panicked; its ring is no longer served, the worker goes on");
            ring.break_ring(&RingBroken("internal error".into()));
            ring.polling.store(false, Ordering::SeqCst);
        }
    }

    fn tenant_of(job: &Job) -> &str {
        match job {
            Job::Ring(r) | Job::Stream(r, _) => &r.tenant.name,
        }
    }

    /// Whether jobs wait and no thread is idle to take them.
    fn others_waiting(&self) -> bool {
        let q = lock(&self.q);
        !q.jobs.is_empty() && q.idle == 0
    }

    fn run(self: Arc<Self>) {
        loop {
            let (job, long) = {
                let mut q = lock(&self.q);
                loop {
                    // The oldest job that may start: long work waits while
                    // every long slot is taken.
                    let found = (0..q.jobs.len()).find_map(|i| self.admissible(&q, &q.jobs[i]).map(|long| (i, long)));
                    // Long work (launches, big copies) goes by fair share:
                    // of the admissible long stream jobs, the one whose
                    // tenant comes first by the scheduler's key.
                    let found = match (found, &self.fair) {
                        (Some((i, true)), Some(fair)) => {
                            let mut best = (i, fair.key_of(Self::tenant_of(&q.jobs[i])));
                            for k in i + 1..q.jobs.len() {
                                if self.admissible(&q, &q.jobs[k]) == Some(true) {
                                    let key = fair.key_of(Self::tenant_of(&q.jobs[k]));
                                    if key < best.1 {
                                        best = (k, key);
                                    }
                                }
                            }
                            Some((best.0, true))
                        }
                        (f, _) => f,
                    };
                    if let Some((i, long)) = found {
                        if let Some(j) = q.jobs.remove(i) {
                            if long {
                                q.take_long(Self::tenant_of(&j));
                            }
                            break (j, long);
                        }
                    }
                    q.idle += 1;
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                    q.idle -= 1;
                }
            };
            if long {
                self.run_long(job);
            } else {
                self.run_job(job);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_time_grows_on_quick_kicks_and_shrinks_on_long_sleeps() {
        let ms = Duration::from_millis;
        // A kick 3 ms into the sleep: the ring would have caught it by
        // polling longer, so it does next time.
        assert_eq!(next_idle(IDLE, ms(3)), IDLE * 2);
        assert_eq!(next_idle(IDLE * 2, ms(1)), IDLE * 4);
        assert_eq!(next_idle(MAX_IDLE, ms(1)), MAX_IDLE, "bounded");
        // A tenant that went quiet for a second: back towards IDLE.
        assert_eq!(next_idle(MAX_IDLE, ms(1000)), MAX_IDLE / 2);
        assert_eq!(next_idle(IDLE, ms(1000)), IDLE, "never below IDLE");
        let mut idle = MAX_IDLE;
        for _ in 0..8 {
            idle = next_idle(idle, ms(500));
        }
        assert_eq!(idle, IDLE);
    }
}
