//! Lanes granted across processes. A device's arbiter holds its scheduler
//! ([`crate::sched`]) and no tenant data; each tenant's executor holds the
//! tenant's state and asks the arbiter for a lane before it runs work on
//! the device. The two ends speak over one `SOCK_SEQPACKET` pair per
//! executor, in fixed 16-byte messages:
//!
//! | from | kind | id | value |
//! |---|---|---|---|
//! | executor | `WANT` | work id | - |
//! | executor | `PAUSED` | work id | - (stopped at a checkpoint, after `YIELD`) |
//! | executor | `DONE` | work id | - (the lane is free) |
//! | arbiter | `GRANT` | work id | lane (first grant, or resumed after a pause) |
//! | arbiter | `YIELD` | work id | - (stop at the next checkpoint) |
//! | arbiter | `CROWD` | work id | 1 while other work holds lanes too, 0 when it is alone |
//! | arbiter | `CHARGED` | 0 | lane ns charged to the tenant so far, on every executor it had |
//!
//! The arbiter holds each granted lane in [`Scheduler::run_for`] on the
//! executor's behalf: the lane time it charges the tenant is the time the
//! lane was held, measured where the executor cannot change it. When the
//! policy puts other work first, the arbiter sends `YIELD` and waits for
//! `PAUSED` before it gives the lane away. `CROWD` tells running work
//! whether it is alone on the device, as a worker's own lanes know it:
//! a launch's helper threads keep to its lane's core while other work
//! runs ([`crate::placement`]), and run anywhere while it is alone.
//! `CHARGED` tells the executor what its tenant's meter reads (when the
//! channel opens, every [`TELL_CHARGED`] of lane time and when a lane goes
//! back), so the device time a tenant is told is the time it is billed.
//! An executor that breaks the
//! protocol (an id it did not ask for, more work in flight than allowed, a
//! malformed message) loses its channel: its work stops, and the control
//! plane replaces it.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::sched::{PauseHook, Scheduler};

pub const WANT: u32 = 1;
pub const PAUSED: u32 = 2;
pub const DONE: u32 = 3;
pub const GRANT: u32 = 16;
pub const YIELD: u32 = 17;
pub const CROWD: u32 = 18;
pub const CHARGED: u32 = 19;

/// Work of one executor that may wait for or hold lanes at once: more is a
/// protocol violation (an executor's own threads bound what it asks for).
pub const MAX_IN_FLIGHT: usize = 256;
/// How often the arbiter looks at the scheduler for work it holds a lane
/// for (charging, preemption).
const TICK: Duration = Duration::from_micros(500);
/// How long a granted lane stays with an executor after its work ends, for
/// its next piece of work to take without asking (a lease; the tenant is
/// charged for it). Short work (a launch of a few µs, a small copy) then
/// pays no round trip to the arbiter while it runs back to back, and a
/// `YIELD` takes an idle lease back at once.
const LINGER: Duration = Duration::from_micros(500);
/// How long the arbiter waits for an executor to stop after `YIELD`: a
/// launch stops at its next checkpoint, in well under a millisecond, and
/// the longest copy (which has no checkpoint) in about a second. An
/// executor that has not stopped by then loses its channel: its work
/// stops, and the control plane replaces it.
const PAUSE_WAIT: Duration = Duration::from_secs(5);
/// The wait after `YIELD` on this arbiter: [`PAUSE_WAIT`], or longer where
/// work has no checkpoint and a launch may run up to its timeout (a GPU
/// kernel), so that the launch timeout, not the yield, is what ends it.
static PAUSE_WAIT_MS: AtomicU64 = AtomicU64::new(PAUSE_WAIT.as_millis() as u64);

/// Lets work run up to `launch_timeout` (plus a second) after a `YIELD`
/// before its executor loses its channel; never less than [`PAUSE_WAIT`].
pub fn allow_unpausable(launch_timeout: Duration) {
    let ms = (launch_timeout + Duration::from_secs(1)).max(PAUSE_WAIT).as_millis();
    PAUSE_WAIT_MS.store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Relaxed);
}

fn pause_wait() -> Duration {
    Duration::from_millis(PAUSE_WAIT_MS.load(Ordering::Relaxed))
}
/// How much lane time a piece of work may be charged before its executor
/// hears of it (`CHARGED`), besides when its lane goes back.
const TELL_CHARGED: Duration = Duration::from_millis(10);
/// Messages a piece of an executor's work may have waiting for the
/// arbiter's proxy: the executor never needs more than one (a PAUSED or a
/// DONE), and the scheduler adds at most one poke; more is a flood from
/// the executor, and a protocol violation.
const HEARD_DEPTH: usize = 4;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Msg {
    pub kind: u32,
    pub id: u32,
    pub value: u64,
}

impl Msg {
    fn encode(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..16].copy_from_slice(&self.value.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Msg> {
        if b.len() != 16 {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut v = [0u8; 8];
        v.copy_from_slice(&b[8..16]);
        Some(Msg { kind: u32_at(0), id: u32_at(4), value: u64::from_le_bytes(v) })
    }
}

/// One end of a grant channel.
pub struct Channel(OwnedFd);

impl Channel {
    /// A connected pair: (arbiter's end, executor's end).
    pub fn pair() -> std::io::Result<(Channel, Channel)> {
        let mut fds = [0i32; 2];
        // SAFETY: socketpair writes two descriptors into `fds` on success.
        if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned by nobody else.
        Ok(unsafe { (Channel(std::os::fd::FromRawFd::from_raw_fd(fds[0])), Channel(std::os::fd::FromRawFd::from_raw_fd(fds[1]))) })
    }

    pub fn from_fd(fd: OwnedFd) -> Channel {
        Channel(fd)
    }

    pub fn into_fd(self) -> OwnedFd {
        self.0
    }

    pub fn send(&self, m: Msg) -> std::io::Result<()> {
        self.send_flags(m, libc::MSG_NOSIGNAL)
    }

    /// Sends without waiting for room: the arbiter never blocks on an
    /// executor that stopped reading (EAGAIN then).
    pub fn send_now(&self, m: Msg) -> std::io::Result<()> {
        self.send_flags(m, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
    }

    fn send_flags(&self, m: Msg, flags: i32) -> std::io::Result<()> {
        let b = m.encode();
        loop {
            // SAFETY: sends 16 bytes from a live buffer on a descriptor we own.
            let n = unsafe { libc::send(self.0.as_raw_fd(), b.as_ptr().cast(), b.len(), flags) };
            if n == b.len() as isize {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if n < 0 && e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(if n < 0 { e } else { std::io::ErrorKind::WriteZero.into() });
        }
    }

    /// The next message; Ok(None) when the other end closed; an error for a
    /// message of the wrong size.
    pub fn recv(&self) -> std::io::Result<Option<Msg>> {
        let mut b = [0u8; 17];
        loop {
            // SAFETY: receives at most 17 bytes into a live buffer of 17.
            let n = unsafe { libc::recv(self.0.as_raw_fd(), b.as_mut_ptr().cast(), b.len(), libc::MSG_TRUNC) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Ok(None);
            }
            return Msg::decode(&b[..(n as usize).min(17)]).map(Some).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a grant message of {n} bytes")));
        }
    }

    /// Shuts both directions down: the other end reads EOF, and a thread of
    /// ours blocked in `recv` returns.
    pub fn shutdown(&self) {
        // SAFETY: shutdown on a descriptor we own.
        unsafe { libc::shutdown(self.0.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

// ---------------------------------------------------------------- arbiter

/// What the arbiter's proxy for one piece of work hears from the executor.
enum Heard {
    Paused,
    Done,
    /// The scheduler has new work queued ([`PauseHook::poke`]).
    Poke,
}

/// An executor's spare lane threads (their inboxes); None once it went.
type Spare = Mutex<Option<Vec<mpsc::Sender<Arc<Proxy>>>>>;
/// Each piece of an executor's work's queue of what the executor said.
type Inbox = Arc<Mutex<HashMap<u32, mpsc::SyncSender<Heard>>>>;

/// The arbiter's proxy for one piece of an executor's work.
struct Proxy {
    id: u32,
    chan: Arc<Channel>,
    rx: Mutex<mpsc::Receiver<Heard>>,
    done: AtomicBool,
    /// Where the executor's messages for this work are queued (the
    /// sender of `rx`, looked up by id: gone once the executor is).
    inbox: Inbox,
    /// A poke waits in `rx` (at most one does).
    poked: AtomicBool,
}

impl Proxy {
    /// Sends to the executor without waiting; one that does not read its
    /// channel loses it.
    fn tell(&self, m: Msg) -> bool {
        match self.chan.send_now(m) {
            Ok(()) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => warn!(id = self.id, "the executor does not read its grant channel; it loses it"),
            // An executor that ended (a restart replaced it) closed its end.
            Err(e) => debug!(id = self.id, error = %e, "the executor's grant channel is closed"),
        }
        self.chan.shutdown();
        false
    }
}

impl PauseHook for Proxy {
    fn pause(&self) -> bool {
        if self.done.load(Ordering::Acquire) || !self.tell(Msg { kind: YIELD, id: self.id, value: 0 }) {
            return false;
        }
        let wait = pause_wait();
        let until = Instant::now() + wait;
        let heard = loop {
            match lock(&self.rx).recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(Heard::Poke) => self.poked.store(false, Ordering::Release),
                other => break other,
            }
        };
        match heard {
            Ok(Heard::Paused) => true,
            // Skipped above; were one here, the work would keep its lane.
            Ok(Heard::Poke) => false,
            Ok(Heard::Done) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.done.store(true, Ordering::Release);
                false
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // Its lane is not given up at its word: the channel goes,
                // the executor with it, and the lane with the proxy.
                warn!(id = self.id, "executor work did not stop within {wait:?} of a yield; it loses its grant channel");
                self.chan.shutdown();
                self.done.store(true, Ordering::Release);
                false
            }
        }
    }

    fn resume(&self, lane: usize) {
        self.tell(Msg { kind: GRANT, id: self.id, value: lane as u64 });
    }

    fn poke(&self) {
        if self.poked.swap(true, Ordering::AcqRel) {
            return;
        }
        let sent = lock(&self.inbox).get(&self.id).is_some_and(|tx| tx.try_send(Heard::Poke).is_ok());
        if !sent {
            self.poked.store(false, Ordering::Release);
        }
    }
}

/// The arbiter's side of one executor's channel: what the executor's work
/// was charged, for the arbiter's statistics.
#[derive(Default)]
pub struct Served {
    pub lane_ns: AtomicU64,
    pub grants: AtomicU64,
}

/// Serves one executor's grant channel on the calling thread until the
/// executor closes it, breaks the protocol, or `stop` is shut down.
/// Returns why it ended.
pub fn serve(sched: &Scheduler, tenant: &str, chan: Channel, served: &Arc<Served>) -> String {
    let chan = Arc::new(chan);
    let waiting: Inbox = Arc::default();
    // Threads that held a lane and wait for the next: one per piece of
    // work in flight at most, kept until the executor goes (a thread per
    // request would cost its start on every grant).
    // None once the executor is gone: threads then end instead of waiting.
    let spare: Arc<Spare> = Arc::new(Mutex::new(Some(Vec::new())));
    // A tenant's new executor starts from what its meter reads.
    let _ = chan.send_now(Msg { kind: CHARGED, id: 0, value: served.lane_ns.load(Ordering::Relaxed) });
    let why = loop {
        let m = match chan.recv() {
            Ok(Some(m)) => m,
            Ok(None) => break "the executor closed its channel".to_string(),
            Err(e) => break format!("reading the grant channel: {e}"),
        };
        match m.kind {
            WANT => {
                let mut w = lock(&waiting);
                if w.len() >= MAX_IN_FLIGHT {
                    break format!("more than {MAX_IN_FLIGHT} pieces of work in flight");
                }
                if w.contains_key(&m.id) {
                    break format!("work id {} asked for twice", m.id);
                }
                let (tx, rx) = mpsc::sync_channel(HEARD_DEPTH);
                w.insert(m.id, tx);
                drop(w);
                let proxy = Arc::new(Proxy { id: m.id, chan: chan.clone(), rx: Mutex::new(rx), done: AtomicBool::new(false), inbox: waiting.clone(), poked: AtomicBool::new(false) });
                let proxy = match lock(&spare).as_mut().and_then(Vec::pop) {
                    Some(tx) => match tx.send(proxy) {
                        Ok(()) => continue,
                        Err(mpsc::SendError(p)) => p,
                    },
                    None => proxy,
                };
                let (s2, t2, w2, sv, sp) = (sched.clone(), tenant.to_string(), waiting.clone(), served.clone(), spare.clone());
                let started = std::thread::Builder::new().name(format!("grant-{tenant}")).spawn(move || {
                    let mut next = Some(proxy);
                    while let Some(proxy) = next.take() {
                        let p2 = proxy.clone();
                        let mut counted = 0;
                        let dt = s2.run_for(&t2, proxy, |lane| counted = hold(&p2, lane, &sv));
                        // What the last charge added after `hold` counted.
                        let rest = (dt.as_nanos() as u64).saturating_sub(counted);
                        let total = sv.lane_ns.fetch_add(rest, Ordering::Relaxed) + rest;
                        sv.grants.fetch_add(1, Ordering::Relaxed);
                        p2.tell(Msg { kind: CHARGED, id: 0, value: total });
                        lock(&w2).remove(&p2.id);
                        drop(p2);
                        // Spare until the next request, or until the
                        // executor goes and the spare senders are dropped
                        // (this thread keeps none of its own); once it
                        // went, end.
                        let (tx, rx) = mpsc::channel::<Arc<Proxy>>();
                        match lock(&sp).as_mut() {
                            Some(v) => v.push(tx),
                            None => break,
                        }
                        next = rx.recv().ok();
                    }
                });
                if let Err(e) = started {
                    break format!("no thread to hold a lane: {e}");
                }
            }
            PAUSED | DONE => {
                let tx = lock(&waiting).get(&m.id).cloned();
                let Some(tx) = tx else {
                    break format!("message {} for work id {} that holds no lane", m.kind, m.id);
                };
                if let Err(mpsc::TrySendError::Full(_)) = tx.try_send(if m.kind == DONE { Heard::Done } else { Heard::Paused }) {
                    break format!("a flood of messages for work id {}", m.id);
                }
            }
            k => break format!("unknown grant message kind {k}"),
        }
    };
    // The executor's work stops: every proxy hears its channel close, and
    // spare threads end.
    chan.shutdown();
    lock(&waiting).clear();
    lock(&spare).take();
    why
}

/// Holds the lane for the proxy's work until it is done, looking at the
/// scheduler every tick, and adding the lane time charged to `served` as
/// it goes (a lease may last long). Returns the lane time it added.
fn hold(p: &Proxy, lane: usize, served: &Served) -> u64 {
    let mut counted = 0u64;
    // What the work was last told of the device's crowding (it starts
    // out believing itself alone).
    let mut told = false;
    let tell_crowd = |told: &mut bool| {
        let crowded = crate::sched::with_current(|r| r.is_some_and(|r| r.crowded()));
        if crowded == *told {
            return true;
        }
        *told = crowded;
        p.tell(Msg { kind: CROWD, id: p.id, value: crowded as u64 })
    };
    // Lane time the executor was last told of (`CHARGED`).
    let mut reported = 0u64;
    let mut count = || {
        let ran = crate::sched::with_current(|r| r.map(|r| r.ran().as_nanos() as u64)).unwrap_or(counted);
        let added = ran.saturating_sub(counted);
        let total = served.lane_ns.fetch_add(added, Ordering::Relaxed) + added;
        counted = counted.max(ran);
        if counted - reported < TELL_CHARGED.as_nanos() as u64 {
            return true;
        }
        reported = counted;
        p.tell(Msg { kind: CHARGED, id: 0, value: total })
    };
    if !tell_crowd(&mut told) || !p.tell(Msg { kind: GRANT, id: p.id, value: lane as u64 }) {
        return counted;
    }
    while !p.done.load(Ordering::Acquire) {
        if !count() || !tell_crowd(&mut told) {
            break;
        }
        let heard = lock(&p.rx).recv_timeout(TICK);
        match heard {
            Ok(Heard::Done) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Ok(Heard::Poke) => {
                p.poked.store(false, Ordering::Release);
                crate::sched::with_current(|r| {
                    if let Some(r) = r {
                        r.checkpoint();
                    }
                })
            }
            // Stopped after a yield the arbiter stopped waiting for: it
            // still holds its lane, so it goes on at once.
            Ok(Heard::Paused) => {
                let lane = crate::sched::with_current(|r| r.map(|r| r.lane())).unwrap_or(lane);
                if !p.tell(Msg { kind: GRANT, id: p.id, value: lane as u64 }) {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => crate::sched::with_current(|r| {
                if let Some(r) = r {
                    r.checkpoint();
                }
            }),
        }
    }
    count();
    counted
}

// --------------------------------------------------------------- executor

struct Slot {
    lane: Mutex<Lane>,
    granted: Condvar,
    /// YIELDs the arbiter sent for this work, and how many of them a
    /// PAUSED (or the lane's release) answered: while they differ, the
    /// work's threads stop at their next checkpoint. Counts, not a flag,
    /// so a YIELD that arrives as the work resumes from the last one is
    /// not lost.
    yields: AtomicU64,
    answered: AtomicU64,
    /// The work stopped for a YIELD and has no lane yet (`Lane::stopped`
    /// is set), readable without the lock: every thread of the work waits
    /// at its next checkpoint.
    paused: AtomicBool,
    paused_ns: AtomicU64,
    /// Other work holds lanes of the device too (the arbiter's `CROWD`).
    crowded: AtomicBool,
}

/// A slot's lane, under one lock with the pause it ends.
#[derive(Default)]
struct Lane {
    /// The lane granted (None while waiting for it).
    at: Option<usize>,
    /// When the work stopped for a `YIELD`, until the next `GRANT`.
    stopped: Option<Instant>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            lane: Mutex::default(),
            granted: Condvar::new(),
            yields: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            paused_ns: AtomicU64::new(0),
            crowded: AtomicBool::new(false),
        }
    }

    /// Ends a pause that began at `stopped`: counted before any thread of
    /// the work goes on, so each one's launch deadline (which moves by the
    /// time paused) sees it.
    fn resume(&self, lane: &mut Lane) {
        if let Some(t) = lane.stopped.take() {
            self.paused_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        self.paused.store(false, Ordering::Release);
    }

    /// A thread of the work must look under the lock: a YIELD is not
    /// answered yet, or the work is stopped.
    fn stop_here(&self) -> bool {
        self.asked() || self.paused.load(Ordering::Acquire)
    }

    /// The arbiter asked for the lane back and has no answer yet.
    fn asked(&self) -> bool {
        self.yields.load(Ordering::Acquire) != self.answered.load(Ordering::Acquire)
    }
}

/// A lane the executor holds while no work of its runs on it.
struct Idle {
    id: u32,
    slot: Arc<Slot>,
    since: Instant,
}

pub struct Grants {
    chan: Channel,
    /// Work the arbiter knows of: running, waiting, or an idle lease.
    slots: Mutex<HashMap<u32, Arc<Slot>>>,
    /// Idle leases, the newest last.
    idle: Mutex<Vec<Idle>>,
    idle_cv: Condvar,
    /// The lease thread waits for the oldest idle lease to expire (read
    /// and written under `idle`): a lease given back later expires later,
    /// so it needs no wake-up.
    expiry_armed: AtomicBool,
    next: AtomicU64,
    /// The arbiter is gone: no work may run.
    closed: AtomicBool,
    lanes: usize,
    busy_ns: AtomicU64,
    /// What the tenant's meter read when the arbiter last said (`CHARGED`).
    charged_ns: AtomicU64,
}

/// Why work could not run.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("the device's arbiter is gone")]
    ArbiterGone,
    #[error("asking the arbiter for a lane: {0}")]
    Send(#[source] std::io::Error),
}

impl Grants {
    /// Starts the thread that reads the arbiter's answers.
    pub fn start(chan: Channel, lanes: usize) -> std::io::Result<Arc<Grants>> {
        let g = Arc::new(Grants {
            chan,
            slots: Mutex::new(HashMap::new()),
            idle: Mutex::new(Vec::new()),
            idle_cv: Condvar::new(),
            expiry_armed: AtomicBool::new(false),
            next: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            lanes: lanes.max(1),
            busy_ns: AtomicU64::new(0),
            charged_ns: AtomicU64::new(0),
        });
        let g2 = g.clone();
        std::thread::Builder::new().name("grants".into()).spawn(move || g2.read())?;
        let g3 = g.clone();
        std::thread::Builder::new().name("leases".into()).spawn(move || g3.expire())?;
        Ok(g)
    }

    /// Gives work `id`'s lane back to the arbiter.
    fn release(&self, id: u32) {
        lock(&self.slots).remove(&id);
        if crate::fatal::marked() {
            // A GPU kernel may still run until this process ends: the lane
            // stays held, and goes back when the channel closes with it.
            return;
        }
        let _ = self.chan.send(Msg { kind: DONE, id, value: 0 });
    }

    /// Gives idle leases back once they lingered [`LINGER`].
    fn expire(&self) {
        let mut idle = lock(&self.idle);
        while !self.is_closed() {
            let now = Instant::now();
            let (old, keep): (Vec<Idle>, Vec<Idle>) = std::mem::take(&mut *idle).into_iter().partition(|l| now.duration_since(l.since) >= LINGER);
            *idle = keep;
            if !old.is_empty() {
                drop(idle);
                for l in old {
                    self.release(l.id);
                }
                idle = lock(&self.idle);
                continue;
            }
            let wait = idle.iter().map(|l| (l.since + LINGER).saturating_duration_since(now)).min().unwrap_or(Duration::from_secs(1));
            self.expiry_armed.store(!idle.is_empty(), Ordering::Relaxed);
            idle = self.idle_cv.wait_timeout(idle, wait).unwrap_or_else(|e| e.into_inner()).0;
            self.expiry_armed.store(false, Ordering::Relaxed);
        }
    }

    fn read(&self) {
        loop {
            let m = match self.chan.recv() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    warn!("the grant channel failed: {e}");
                    break;
                }
            };
            if m.kind == CHARGED {
                self.charged_ns.fetch_max(m.value, Ordering::Relaxed);
                continue;
            }
            let slot = lock(&self.slots).get(&m.id).cloned();
            let Some(slot) = slot else { continue };
            match m.kind {
                GRANT => {
                    let mut lane = lock(&slot.lane);
                    slot.resume(&mut lane);
                    lane.at = Some(m.value as usize);
                    drop(lane);
                    slot.granted.notify_all();
                }
                YIELD => {
                    // An idle lease goes back at once; running work stops
                    // at its next checkpoint (or gives the lane back when
                    // it ends first: it looks under the same lock).
                    let mut idle = lock(&self.idle);
                    match idle.iter().position(|l| l.id == m.id) {
                        Some(i) => {
                            idle.remove(i);
                            drop(idle);
                            self.release(m.id);
                        }
                        None => {
                            slot.yields.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                }
                CROWD => slot.crowded.store(m.value != 0, Ordering::Release),
                k => warn!("unknown grant message kind {k} from the arbiter"),
            }
        }
        self.closed.store(true, Ordering::Release);
        for s in lock(&self.slots).values() {
            // Under the lane's lock: a waiter between its look at `closed`
            // and its wait hears it.
            let _lane = lock(&s.lane);
            s.granted.notify_all();
        }
        self.idle_cv.notify_all();
    }

    pub fn lanes(&self) -> usize {
        self.lanes
    }

    /// Lane time the tenant was charged, as the arbiter last said: on every
    /// executor the tenant had, up to [`TELL_CHARGED`] behind.
    pub fn charged(&self) -> Duration {
        Duration::from_nanos(self.charged_ns.load(Ordering::Relaxed))
    }

    /// Lane time this executor's work used.
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed))
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Runs `f` once the arbiter grants a lane; returns its result and the
    /// lane time it used (time spent paused excluded).
    pub fn run<T>(self: &Arc<Self>, f: impl FnOnce() -> T) -> Result<(T, Duration), GrantError> {
        if self.is_closed() {
            return Err(GrantError::ArbiterGone);
        }
        // An idle lease first (the newest: its lane's caches are warm).
        let lease = lock(&self.idle).pop();
        let (id, slot, lane) = match lease {
            Some(l) => {
                let lane = lock(&l.slot.lane).at;
                match lane {
                    Some(lane) => (l.id, l.slot, lane),
                    None => {
                        // Not granted after all (cannot happen): ask anew.
                        self.release(l.id);
                        self.want()?
                    }
                }
            }
            None => self.want()?,
        };
        // Given back if `f` unwinds: a lane is never left held.
        let mut held = Held(self, Some(id));
        let w = Working { g: self.clone(), id, slot: slot.clone(), lane: std::sync::atomic::AtomicUsize::new(lane) };
        let (t0, paused0) = (Instant::now(), slot.paused_ns.load(Ordering::Relaxed));
        let out = {
            let _cur = CurrentWork::set(&w);
            // As on a local lane (crate::sched::Scheduler::run).
            let _work = crate::placement::LaneWork::begin();
            f()
        };
        let paused = slot.paused_ns.load(Ordering::Relaxed) - paused0;
        let dt = t0.elapsed().saturating_sub(Duration::from_nanos(paused));
        self.busy_ns.fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
        held.1 = None;
        // The lane stays a while, unless the arbiter asked for it back.
        let mut idle = lock(&self.idle);
        if slot.asked() || self.is_closed() {
            drop(idle);
            self.release(id);
        } else {
            idle.push(Idle { id, slot, since: Instant::now() });
            // Work that runs back to back takes and returns its lease
            // every few µs: the lease thread is woken only when it has no
            // expiry to wait for.
            if !self.expiry_armed.load(Ordering::Relaxed) {
                self.idle_cv.notify_one();
            }
        }
        Ok((out, dt))
    }

    /// Asks the arbiter for a lane for new work and waits for it.
    fn want(&self) -> Result<(u32, Arc<Slot>, usize), GrantError> {
        let slot = Arc::new(Slot::new());
        let id = {
            let mut slots = lock(&self.slots);
            // Ids wrap after 2^32; one still in use is skipped.
            let id = loop {
                let id = (self.next.fetch_add(1, Ordering::Relaxed) & u64::from(u32::MAX)) as u32;
                if !slots.contains_key(&id) {
                    break id;
                }
            };
            slots.insert(id, slot.clone());
            id
        };
        let asked = self.chan.send(Msg { kind: WANT, id, value: 0 }).map_err(GrantError::Send).and_then(|()| self.wait_grant(&slot).1);
        match asked {
            Ok(lane) => Ok((id, slot, lane)),
            Err(e) => {
                lock(&self.slots).remove(&id);
                Err(e)
            }
        }
    }

    /// Waits for the slot's lane; returns it with the slot's lock still
    /// held.
    fn wait_grant<'s>(&self, slot: &'s Slot) -> (MutexGuard<'s, Lane>, Result<usize, GrantError>) {
        let mut lane = lock(&slot.lane);
        loop {
            if let Some(l) = lane.at {
                return (lane, Ok(l));
            }
            if self.is_closed() {
                return (lane, Err(GrantError::ArbiterGone));
            }
            lane = slot.granted.wait_timeout(lane, Duration::from_millis(100)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

struct Held<'a>(&'a Grants, Option<u32>);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.1.take() {
            self.0.release(id);
        }
    }
}

/// Work of this executor holding a lane: what its checkpoints look at.
pub struct Working {
    g: Arc<Grants>,
    id: u32,
    slot: Arc<Slot>,
    lane: std::sync::atomic::AtomicUsize,
}

impl Working {
    /// Stops here if the arbiter asked for the lane back, until it grants
    /// one again. Costs one atomic load otherwise.
    pub fn checkpoint(&self) {
        let lane = self.lane.load(Ordering::Relaxed);
        // As on a worker's own lane (crate::sched::Running::checkpoint).
        crate::placement::follow(lane, self.slot.crowded.load(Ordering::Acquire));
        crate::placement::settle(lane, None);
        if !self.slot.stop_here() {
            return;
        }
        let _raised = crate::nice::Raised::new();
        let mut lane = lock(&self.slot.lane);
        match lane.at {
            // Another thread of this work stopped already: wait with it.
            None => {}
            Some(_) if !self.slot.asked() => return,
            Some(held) => {
                // The first thread to stop answers for the work. Stopped
                // before answered: a thread that sees the answer sees the
                // stop too, and waits.
                self.slot.paused.store(true, Ordering::Release);
                self.slot.answered.store(self.slot.yields.load(Ordering::Acquire), Ordering::Release);
                lane.at = None;
                // The work stops here: what follows (the message, and a
                // thread the message's wake-up of the arbiter may push off
                // its core) is no device time of the tenant's. The GRANT
                // that ends the pause counts it (Slot::resume).
                lane.stopped = Some(Instant::now());
                if self.g.chan.send(Msg { kind: PAUSED, id: self.id, value: 0 }).is_err() {
                    // The arbiter is gone: go on, the executor is ending.
                    lane.at = Some(held);
                    lane.stopped = None;
                    self.slot.paused.store(false, Ordering::Release);
                    return;
                }
            }
        }
        drop(lane);
        // Without a grant (the arbiter gone) the work goes on: the
        // executor is ending anyway, and the launch must not hang.
        let (mut held, granted) = self.g.wait_grant(&self.slot);
        let l = match granted {
            Ok(l) => l,
            Err(_) => {
                self.slot.resume(&mut held);
                self.lane.load(Ordering::Relaxed)
            }
        };
        // Under the slot's lock: a thread slow to get here after an
        // earlier grant never stores its lane over a later one.
        self.lane.store(l, Ordering::Relaxed);
        drop(held);
        crate::placement::resumed(l);
    }

    pub fn paused(&self) -> Duration {
        Duration::from_nanos(self.slot.paused_ns.load(Ordering::Relaxed))
    }

    /// Other work holds lanes of the device too, as the arbiter last said.
    pub fn crowded(&self) -> bool {
        self.slot.crowded.load(Ordering::Acquire)
    }
}

impl vgpu_ptx::Preempt for Working {
    fn checkpoint(&self) {
        Working::checkpoint(self)
    }

    fn paused(&self) -> Duration {
        Working::paused(self)
    }

    fn helper(&self, on: bool) {
        crate::placement::helping(on)
    }
}

thread_local! {
    static CURRENT: std::cell::Cell<*const Working> = const { std::cell::Cell::new(std::ptr::null()) };
}

struct CurrentWork(*const Working);

impl CurrentWork {
    fn set(w: &Working) -> CurrentWork {
        CurrentWork(CURRENT.with(|c| c.replace(w)))
    }
}

impl Drop for CurrentWork {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

/// Calls `f` with the granted work the calling thread runs, if any.
pub fn with_current<R>(f: impl FnOnce(Option<&Working>) -> R) -> R {
    let p = CURRENT.with(|c| c.get());
    // SAFETY: CURRENT is non-null only while `Grants::run` executes its
    // closure on this thread, and the `Working` it points to lives on that
    // call's stack until the closure returns and CURRENT is restored.
    f(unsafe { p.as_ref() })
}

/// Whether the arbiter asked for the lane that the calling thread's work
/// holds (false for a thread that runs no granted work): work that cannot
/// stop midway (a GPU's queued kernels) takes no more, and ends.
pub fn yield_asked() -> bool {
    with_current(|w| w.is_some_and(|w| w.slot.asked()))
}

/// Calls `f` with whatever the calling thread's work stops at to be
/// preempted: a lane of this process's scheduler, or one granted by the
/// device's arbiter.
pub fn with_preempt<R>(f: impl FnOnce(Option<&dyn vgpu_ptx::Preempt>) -> R) -> R {
    crate::sched::with_current(|r| match r {
        Some(r) => f(Some(r)),
        None => with_current(|w| f(w.map(|w| w as &dyn vgpu_ptx::Preempt))),
    })
}

/// Where a device service gets its lanes: its own scheduler (every tenant
/// in one process: tests and tools), or the device's arbiter (a tenant's
/// executor).
pub enum Lanes {
    Local(Scheduler),
    Granted(Arc<Grants>),
}

impl Lanes {
    /// Runs `f` on a granted lane; returns its result and the lane time it
    /// used.
    pub fn run<T>(&self, tenant: &str, f: impl FnOnce() -> T) -> Result<(T, Duration), GrantError> {
        match self {
            Lanes::Local(s) => Ok(s.run(tenant, f)),
            Lanes::Granted(g) => g.run(f),
        }
    }

    /// A tenant's share (the arbiter keeps the shares of executors' tenants).
    pub fn configure(&self, tenant: &str, share: crate::sched::Share) {
        if let Lanes::Local(s) = self {
            s.configure(tenant, share);
        }
    }

    pub fn forget(&self, tenant: &str) {
        if let Lanes::Local(s) = self {
            s.forget(tenant);
        }
    }

    /// The tenant's device time: with a local scheduler, as charged (so it
    /// adds up with `busy` at any instant); with grants, as the arbiter
    /// charged it (what the tenant's meter reads), or `ran` (its own
    /// work's, summed as each piece ended) where that is more: before the
    /// arbiter's word on the latest work arrives.
    pub fn device_time(&self, tenant: &str, ran: Duration) -> Duration {
        match self {
            Lanes::Local(s) => s.used(tenant),
            Lanes::Granted(g) => g.charged().max(ran),
        }
    }

    pub fn busy(&self) -> Duration {
        match self {
            Lanes::Local(s) => s.busy(),
            Lanes::Granted(g) => g.busy(),
        }
    }

    pub fn lanes(&self) -> usize {
        match self {
            Lanes::Local(s) => s.lanes(),
            Lanes::Granted(g) => g.lanes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{Priority, Share, WeightedFair};

    /// An arbiter with `lanes` lanes serving one executor per share; the
    /// executors' ends.
    fn arbiter(lanes: usize, shares: &[Share]) -> (Scheduler, Vec<Arc<Grants>>) {
        arbiter_served(lanes, shares).0
    }

    /// A scheduler and one executor end per tenant.
    type Arbiter = (Scheduler, Vec<Arc<Grants>>);

    fn arbiter_served(lanes: usize, shares: &[Share]) -> (Arbiter, Vec<Arc<Served>>) {
        let s = Scheduler::new(lanes, Arc::new(WeightedFair::new(lanes)));
        let mut ends = Vec::new();
        let mut served = Vec::new();
        for (i, sh) in shares.iter().enumerate() {
            let name = format!("t{i}");
            s.configure(&name, *sh);
            let (a, e) = Channel::pair().unwrap();
            let s2 = s.clone();
            let sv: Arc<Served> = Arc::default();
            served.push(sv.clone());
            std::thread::spawn(move || serve(&s2, &name, a, &sv));
            ends.push(Grants::start(e, lanes).unwrap());
        }
        ((s, ends), served)
    }

    /// Work that computes for `d`, stopping at a checkpoint every 50 µs as
    /// a launch on the CPU device does.
    fn compute(d: Duration) {
        compute_every(d, Duration::from_micros(50))
    }

    /// Work that computes for `d` with a checkpoint every `every`.
    fn compute_every(d: Duration, every: Duration) {
        let mut left = d;
        while !left.is_zero() {
            let t = Instant::now();
            while t.elapsed() < every {
                std::hint::spin_loop();
            }
            left = left.saturating_sub(t.elapsed());
            with_current(|w| w.expect("inside Grants::run").checkpoint());
        }
    }

    fn shares_of(ends: &[Arc<Grants>], run: Duration, each: Duration) -> Vec<f64> {
        let stop = Instant::now() + run;
        let hs: Vec<_> = ends
            .iter()
            .flat_map(|g| std::iter::repeat_n(g.clone(), 2))
            .map(|g| {
                std::thread::spawn(move || {
                    while Instant::now() < stop {
                        g.run(|| compute(each)).unwrap();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let used: Vec<f64> = ends.iter().map(|g| g.busy().as_secs_f64()).collect();
        let total: f64 = used.iter().sum();
        used.into_iter().map(|u| u / total).collect()
    }

    fn w(weight: u32) -> Share {
        Share { weight, ..Share::default() }
    }

    #[test]
    fn weights_hold_across_executors() {
        // Work of 5 ms that the arbiter must preempt to keep the shares:
        // a 1 ms quantum, so the weights come from yields, not from the
        // order whole pieces of work start in. Tolerances are wide for a
        // loaded machine; share-bench measures the real error.
        let ((_s, ends), served) = arbiter_served(1, &[w(1), w(3)]);
        let got = shares_of(&ends, Duration::from_millis(900), Duration::from_millis(5));
        let charged: Vec<f64> = served.iter().map(|s| s.lane_ns.load(Ordering::Relaxed) as f64).collect();
        let charged: Vec<f64> = charged.iter().map(|c| c / charged.iter().sum::<f64>()).collect();
        // The arbiter's accounting (lane held) is what it enforces; the
        // executors' (work ran) also loses each hand-over's wake-ups, which
        // a machine this test shares with others stretches.
        assert!((charged[0] - 0.25).abs() < 0.08 && (charged[1] - 0.75).abs() < 0.08, "1:3 was charged {charged:?}");
        assert!((got[0] - 0.25).abs() < 0.15 && (got[1] - 0.75).abs() < 0.15, "1:3 ran {got:?} (charged {charged:?})");
    }

    #[test]
    fn a_capped_executor_stays_under_its_cap_when_it_is_slow_to_stop() {
        // Checkpoints 2 ms apart: every time its bucket runs dry the work
        // goes on up to 2 ms after the arbiter asks for the lane. That time
        // is charged too, or the tenant would run it free at every pause
        // (here: far over its cap).
        let ((_s, ends), served) = arbiter_served(1, &[Share { cap: Some(25), ..w(1) }]);
        let t = Instant::now();
        let (_, ran) = ends[0].run(|| compute_every(Duration::from_millis(250), Duration::from_millis(2))).unwrap();
        let wall = t.elapsed();
        assert!(ran.as_secs_f64() / wall.as_secs_f64() <= 0.27, "capped at 25%, ran {ran:?} in {wall:?}, charged {:?}", Duration::from_nanos(served[0].lane_ns.load(Ordering::Relaxed)));
        // What the executor tells its tenant is what the arbiter charged
        // (once the lease has gone back and the arbiter said so).
        let t = Instant::now();
        let settled = || served[0].grants.load(Ordering::Relaxed) == 1 && ends[0].charged() >= Duration::from_nanos(served[0].lane_ns.load(Ordering::Relaxed));
        while !settled() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let charged = served[0].lane_ns.load(Ordering::Relaxed);
        assert_eq!(ends[0].charged(), Duration::from_nanos(charged), "the executor's word of its tenant's meter");
        assert!(ends[0].charged() >= ran, "charged {:?} for {ran:?} of work", ends[0].charged());
    }

    #[test]
    fn running_work_hears_whether_other_work_holds_lanes() {
        // What keeps a launch's helper threads to its lane's core while
        // another executor's work runs on the other lane.
        let (_s, ends) = arbiter(2, &[w(1), w(1)]);
        let crowded_within = |g: &Arc<Grants>, want: bool| {
            g.run(|| {
                let t = Instant::now();
                while with_current(|w| w.expect("granted").crowded()) != want && t.elapsed() < Duration::from_secs(5) {
                    compute(Duration::from_micros(200));
                }
                with_current(|w| w.expect("granted").crowded())
            })
            .unwrap()
            .0
        };
        assert!(!crowded_within(&ends[0], false), "alone on the device");
        let other = ends[1].clone();
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let h = std::thread::spawn(move || {
            other
                .run(|| {
                    while !s2.load(Ordering::Relaxed) {
                        compute(Duration::from_micros(200))
                    }
                })
                .unwrap()
        });
        assert!(crowded_within(&ends[0], true), "beside the other executor's work");
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
    }

    #[test]
    fn a_latency_tenant_takes_the_lane_from_long_work_at_its_next_checkpoint() {
        let (_s, ends) = arbiter(1, &[Share { priority: Priority::Batch, ..w(1) }, Share { priority: Priority::Latency, ..w(1) }]);
        let batch = ends[0].clone();
        let long = std::thread::spawn(move || batch.run(|| compute(Duration::from_millis(400))).unwrap().1);
        std::thread::sleep(Duration::from_millis(50));
        let mut waits = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            ends[1].run(|| compute(Duration::from_micros(200))).unwrap();
            waits.push(t.elapsed());
            std::thread::sleep(Duration::from_millis(2));
        }
        let ran = long.join().unwrap();
        waits.sort();
        // The batch work was stopped, not left to finish its 400 ms first.
        assert!(waits[10] < Duration::from_millis(60), "median wait {:?} beside 400 ms of batch work", waits[10]);
        assert!(ran >= Duration::from_millis(380), "the batch work's own lane time {ran:?} lost its pauses' accounting");
        assert!(ends[0].busy() >= Duration::from_millis(380));
    }

    #[test]
    fn an_executor_that_breaks_the_protocol_loses_its_channel_and_others_go_on() {
        let s = Scheduler::new(1, Arc::new(WeightedFair::new(1)));
        let (a, bad) = Channel::pair().unwrap();
        let s2 = s.clone();
        let h = std::thread::spawn(move || serve(&s2, "bad", a, &Arc::default()));
        // DONE for work it never asked a lane for.
        bad.send(Msg { kind: DONE, id: 7, value: 0 }).unwrap();
        let why = h.join().unwrap();
        assert!(why.contains("holds no lane"), "{why}");
        assert_eq!(bad.recv().unwrap(), Some(Msg { kind: CHARGED, id: 0, value: 0 }), "a new executor hears its tenant's meter first");
        assert_eq!(bad.recv().unwrap(), None, "the channel stays open");
        // Too much work in flight at once.
        let (a, bad) = Channel::pair().unwrap();
        let s2 = s.clone();
        let h = std::thread::spawn(move || serve(&s2, "greedy", a, &Arc::default()));
        // One lane, held by a well-behaved neighbour meanwhile.
        let (a2, good) = Channel::pair().unwrap();
        let s3 = s.clone();
        std::thread::spawn(move || serve(&s3, "good", a2, &Arc::default()));
        let good = Grants::start(good, 1).unwrap();
        for id in 0..=MAX_IN_FLIGHT as u32 {
            if bad.send(Msg { kind: WANT, id, value: 0 }).is_err() {
                break;
            }
        }
        let why = h.join().unwrap();
        assert!(why.contains("in flight"), "{why}");
        // A malformed message.
        let (a, bad) = Channel::pair().unwrap();
        let s2 = s.clone();
        let h = std::thread::spawn(move || serve(&s2, "odd", a, &Arc::default()));
        // SAFETY: sends 3 bytes from a live buffer on a descriptor we own.
        unsafe { libc::send(bad.0.as_raw_fd(), b"abc".as_ptr().cast(), 3, 0) };
        assert!(h.join().unwrap().contains("3 bytes"));
        // The neighbour is served throughout, and after.
        let (n, _) = good.run(|| 42).unwrap();
        assert_eq!(n, 42);
    }

    #[test]
    fn every_thread_of_paused_work_counts_the_pause_as_it_goes_on() {
        // A launch's threads compare its deadline with the time paused
        // (vgpu_ptx's Meter::clock): a thread that went on from a pause
        // before the pause was counted would see a long pause as a
        // runaway launch, and one that did not stop would run on a lane
        // given away. The test plays the arbiter.
        const PAUSE: Duration = Duration::from_millis(300);
        let (a, e) = Channel::pair().unwrap();
        let g = Grants::start(e, 1).unwrap();
        // The work stopped (PAUSED heard), and the GRANT that ends it.
        let (stopped, granting) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (st, gr) = (stopped.clone(), granting.clone());
        let arbiter = std::thread::spawn(move || {
            let heard = |kind| loop {
                match a.recv().unwrap() {
                    Some(m) if m.kind == kind => break m.id,
                    Some(_) => continue,
                    None => panic!("the executor closed its channel"),
                }
            };
            let id = heard(WANT);
            a.send(Msg { kind: GRANT, id, value: 0 }).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            a.send(Msg { kind: YIELD, id, value: 0 }).unwrap();
            heard(PAUSED);
            st.store(true, Ordering::Release);
            std::thread::sleep(PAUSE);
            gr.store(true, Ordering::Release);
            a.send(Msg { kind: GRANT, id, value: 0 }).unwrap();
            a
        });
        // What a thread sees as it goes on: the GRANT sent, the pause counted.
        let went_on = |w: &Working| {
            assert!(granting.load(Ordering::Acquire), "a thread went on through the pause");
            let seen = w.paused();
            assert!(seen >= PAUSE, "a thread went on from a pause of {PAUSE:?} having counted {seen:?} of it");
        };
        let ((), _) = g
            .run(|| {
                with_current(|w| {
                    let w = w.expect("inside Grants::run");
                    let went_on = &went_on;
                    let (stopped, granting) = (&stopped, &granting);
                    std::thread::scope(|s| {
                        // The thread that stops first and answers.
                        s.spawn(move || {
                            let start = Instant::now();
                            loop {
                                w.checkpoint();
                                if stopped.load(Ordering::Acquire) {
                                    break went_on(w);
                                }
                                assert!(start.elapsed() < Duration::from_secs(10), "the YIELD never came");
                                std::hint::spin_loop();
                            }
                        });
                        // The others reach a checkpoint once it stopped.
                        for _ in 0..3 {
                            s.spawn(move || {
                                while !stopped.load(Ordering::Acquire) && !granting.load(Ordering::Acquire) {
                                    std::hint::spin_loop();
                                }
                                w.checkpoint();
                                went_on(w);
                            });
                        }
                    })
                })
            })
            .unwrap();
        drop(arbiter.join().unwrap());
    }

    #[test]
    fn work_ends_with_an_error_when_the_arbiter_is_gone() {
        let (a, e) = Channel::pair().unwrap();
        let g = Grants::start(e, 1).unwrap();
        drop(a);
        let t = Instant::now();
        while !g.is_closed() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(matches!(g.run(|| ()), Err(GrantError::ArbiterGone)));
    }
}
