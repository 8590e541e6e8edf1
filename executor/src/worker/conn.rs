//! Process tenants' sockets, served by a fixed set of threads: one poller
//! that accepts clients and assembles their messages without blocking, and
//! a pool of executors that run complete messages. Each tenant has a FIFO
//! of jobs and at most one executor at a time, so however many connections
//! a tenant opens, and however slowly it reads its replies, it occupies one
//! executor and the others keep serving everyone else.
//!
//! Every fd a client attaches is owned (and so closed) here, connections
//! are capped per tenant and charged to its host budget, and messages,
//! replies and shared buffers are charged while they are held.
#![allow(clippy::result_large_err, reason = "the error is the reply sent back to the tenant, made once per failed call; boxing it would add an allocation to every failure for no gain")]

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_gpu_compute::*;

use super::engine::{Engine, Ring, RingMem};
use super::service::{Conn, DeviceService, Tenant, MAX_REGIONS};
use super::shm::Shm;

/// Host bytes one connection costs its tenant: its table entries, socket
/// and header buffer.
pub const CONN_HOST_BYTES: u64 = 16 << 10;
/// How long a reply may wait for its client to read it before the
/// connection is dropped (the poller writes it; no executor waits).
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most fds one message may carry; more drop the connection.
const MAX_FDS: usize = 8;
/// Most fds a tenant may have waiting for the closer thread.
const MAX_JUNK_FDS: u32 = 64;
/// Most `recvmsg` calls (and accepts) the poller makes for one event
/// before it serves the others.
const READS_PER_EVENT: usize = 64;
const ACCEPTS_PER_EVENT: usize = 16;

/// Warnings about one tenant's misbehaviour, at most `burst` per window;
/// the rest are counted and reported with the next one let through.
pub struct LogLimiter {
    window: Duration,
    burst: u32,
    state: Mutex<(Instant, u32)>,
    suppressed: AtomicU64,
}

impl LogLimiter {
    pub fn new(burst: u32, window: Duration) -> LogLimiter {
        LogLimiter { window, burst, state: Mutex::new((Instant::now(), 0)), suppressed: AtomicU64::new(0) }
    }

    /// Some(number suppressed since the last one) if this warning may be
    /// logged, None if it is to be dropped.
    pub fn allow(&self) -> Option<u64> {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if g.0.elapsed() >= self.window {
            *g = (Instant::now(), 0);
        }
        if g.1 >= self.burst {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        g.1 += 1;
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }

    pub fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

/// Logs a warning about tenant `$t` through its limiter.
macro_rules! tenant_warn {
    ($lim:expr, $t:expr, $($arg:tt)+) => {
        if let Some(dropped) = $lim.allow() {
            tracing::warn!(tenant = %$t, suppressed = dropped, $($arg)+);
        }
    };
}

/// Most fds the kernel passes with one message (SCM_MAX_FD). The control
/// buffer holds that many, so the kernel never closes surplus ones itself
/// (which would run their close, possibly slow, on the poller).
const SCM_MAX_FD: usize = 253;

/// One `recvmsg`: bytes into `buf`, every attached fd into `fds` (owned,
/// close-on-exec). Returns the byte count.
fn recv_owning_fds(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    // u64 storage keeps the control buffer aligned for cmsghdr.
    const SPACE: usize = 1040;
    let mut cbuf = [0u64; SPACE / 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let need = unsafe { libc::CMSG_SPACE((SCM_MAX_FD * size_of::<i32>()) as u32) } as usize;
    debug_assert!(need <= SPACE);
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is a valid empty header.
    let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = need.min(SPACE) as _;
    // SAFETY: iov covers `buf`, which we borrow mutably; the control buffer
    // is ours and `msg_controllen` bytes long.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel filled `msg`'s control area; CMSG_FIRSTHDR and
    // CMSG_NXTHDR stay inside `msg_controllen`, and every SCM_RIGHTS
    // payload is an array of fds that this process now owns.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<i32>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<i32>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    if fd >= 0 {
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(n as usize)
}

/// Holds `n` bytes of the tenant's host budget until dropped.
struct Held(Arc<Tenant>, u64);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.host.release(self.1);
    }
}

/// A message being assembled from a non-blocking socket.
#[derive(Default)]
struct Rx {
    hdr: [u8; MsgHeader::SIZE],
    got: usize,
    /// The whole message (header and payload) once the header is known.
    msg: Option<(MsgHeader, Vec<u8>, Held)>,
    fds: Vec<OwnedFd>,
}

enum RxStep {
    /// The socket has no more bytes for now.
    Pending,
    Message(MsgHeader, Vec<u8>, Vec<OwnedFd>, Held),
    /// Framing is lost: answer with these bytes, then close.
    Refuse(Vec<u8>),
    Closed,
}

impl Rx {
    fn step(&mut self, s: &UnixStream, t: &Arc<Tenant>, log: &LogLimiter) -> RxStep {
        for _ in 0..READS_PER_EVENT {
            let (buf, filled) = match &mut self.msg {
                None => (&mut self.hdr[self.got..], false),
                Some((_, m, _)) => {
                    let got = self.got;
                    (&mut m[got..], true)
                }
            };
            if filled && buf.is_empty() {
                let Some((h, m, held)) = self.msg.take() else { return RxStep::Closed };
                self.got = 0;
                return RxStep::Message(h, m, std::mem::take(&mut self.fds), held);
            }
            let n = match recv_owning_fds(s, buf, &mut self.fds) {
                Ok(0) => {
                    if self.got > 0 || self.msg.is_some() {
                        tenant_warn!(log, t.name, "connection closed in the middle of a message");
                    }
                    return RxStep::Closed;
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return RxStep::Pending,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tenant_warn!(log, t.name, "connection read failed: {e}");
                    return RxStep::Closed;
                }
            };
            if self.fds.len() > MAX_FDS {
                tenant_warn!(log, t.name, "more than {MAX_FDS} file descriptors attached to one message; disconnecting");
                return RxStep::Closed;
            }
            self.got += n;
            if self.msg.is_none() && self.got == MsgHeader::SIZE {
                let h = match MsgHeader::decode(&self.hdr) {
                    Ok(h) => h,
                    Err(e) => {
                        // Framing cannot be trusted past a bad header: answer, then drop.
                        tenant_warn!(log, t.name, "bad header, disconnecting: {e}");
                        let seq = u32::from_le_bytes([self.hdr[8], self.hdr[9], self.hdr[10], self.hdr[11]]);
                        return RxStep::Refuse(Reply::error(e.cuda(), format!("bad message header: {e}")).encode(Opcode::Ping, seq));
                    }
                };
                // The message and its decoded copy are charged while held.
                let held = 2 * (MsgHeader::SIZE as u64 + h.payload_len as u64);
                if let Err(r) = t.host.reserve(held, "this message") {
                    return RxStep::Refuse(r.encode(h.opcode(), h.seq));
                }
                let mut m = vec![0u8; MsgHeader::SIZE + h.payload_len as usize];
                m[..MsgHeader::SIZE].copy_from_slice(&self.hdr);
                self.msg = Some((h, m, Held(t.clone(), held)));
            }
        }
        // A trickle of bytes gets the poller in turns, not to itself.
        RxStep::Pending
    }
}

/// One client connection.
struct Client {
    tenant: Arc<Tenant>,
    listener: u64,
    sock: UnixStream,
    log: Arc<LogLimiter>,
    io: Mutex<ClientIo>,
}

#[derive(Default)]
struct ClientIo {
    rx: Rx,
    /// Shared with the connection's ring, if it has one.
    conn: Arc<Mutex<Conn>>,
    /// What each registered shared region (and the ring) is charged.
    shm_held: HashMap<u32, u64>,
    ring: Option<Arc<Ring>>,
    messages: u64,
    closed: bool,
    /// A reply the client has not taken yet: the poller writes the rest as
    /// the socket drains (the executor moved on).
    tx: Option<Tx>,
}

struct Tx {
    bytes: Vec<u8>,
    at: usize,
    /// Whether the connection stays open once it is written.
    keep: bool,
    _held: Option<Held>,
}

enum Job {
    Message(u64, MsgHeader, Vec<u8>, Vec<OwnedFd>, Held),
    Refuse(u64, Vec<u8>),
    Close(u64),
}

#[derive(Default)]
struct TenantQueue {
    jobs: VecDeque<Job>,
    /// An executor is running one of this tenant's jobs.
    busy: bool,
}

struct ListenerEntry {
    tenant: Arc<Tenant>,
    sock: Arc<UnixListener>,
    max_connections: u32,
    log: Arc<LogLimiter>,
    clients: HashSet<u64>,
    /// Accept failed (EMFILE, ...): re-armed at this time, after this wait.
    backoff: Option<(Instant, Duration)>,
}

#[derive(Default)]
struct State {
    next: u64,
    listeners: HashMap<u64, ListenerEntry>,
    clients: HashMap<u64, Arc<Client>>,
    /// Clients with a reply pending, and when they must have taken it.
    tx_deadlines: HashMap<u64, Instant>,
    /// Clients not read for now (their tenant's descriptors wait to be
    /// closed), and when to look again.
    deferred: Vec<(Instant, u64)>,
    queues: HashMap<String, TenantQueue>,
    /// Tenants with jobs and no executor, oldest first.
    ready: VecDeque<String>,
}

/// Epoll tokens: listeners have the top bit set, ring kick eventfds the
/// next one (with their client's id).
const LISTENER: u64 = 1 << 63;
const RING: u64 = 1 << 62;
/// The `shm_held` key of the ring's own memory.
const RING_REGION: u32 = u32::MAX;

/// The worker's tenant-socket service: one poller thread and `threads`
/// executors, however many tenants and connections there are.
pub struct Pool {
    epfd: OwnedFd,
    svc: Arc<DeviceService>,
    engine: Arc<Engine>,
    /// Attached rings by client id, for their kick eventfds.
    rings: Mutex<HashMap<u64, Arc<Ring>>>,
    st: Mutex<State>,
    work: Condvar,
    /// Descriptors tenants sent and the worker does not keep, closed on a
    /// thread of their own: closing one can block (FUSE, lingering sockets).
    closer: Mutex<std::sync::mpsc::Sender<(Arc<Tenant>, OwnedFd)>>,
    /// Held while clients are accepted and admitted, and while a listener
    /// is retired for being idle: no client is accepted between that
    /// look at the tenant's connections and the listener's removal.
    accepting: Mutex<()>,
}

fn epoll_ctl(epfd: &OwnedFd, op: i32, fd: i32, events: u32, token: u64) -> std::io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: epfd is our epoll instance and ev a valid event for the call.
    if unsafe { libc::epoll_ctl(epfd.as_raw_fd(), op, fd, &mut ev) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

const ONESHOT_IN: u32 = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLONESHOT) as u32;
const ONESHOT_OUT: u32 = (libc::EPOLLOUT | libc::EPOLLONESHOT) as u32;

/// Calls `Pool::done` for a job's tenant however the job ends.
struct Done<'a>(&'a Pool, &'a str);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.done(self.1);
    }
}

impl Pool {
    /// Starts the poller and `threads` executors. With `seccomp`, the
    /// executors (which decode and run tenant messages) narrow their
    /// filter to the connection list.
    pub fn start(svc: Arc<DeviceService>, engine: Arc<Engine>, threads: usize, seccomp: bool) -> std::io::Result<Arc<Pool>> {
        // SAFETY: epoll_create1 has no memory arguments; checked below.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let epfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let (tx, rx) = std::sync::mpsc::channel::<(Arc<Tenant>, OwnedFd)>();
        let pool = Arc::new(Pool { epfd, svc, engine, rings: Mutex::new(HashMap::new()), st: Mutex::new(State::default()), work: Condvar::new(), closer: Mutex::new(tx), accepting: Mutex::new(()) });
        std::thread::Builder::new().name("tenant-fd-closer".into()).spawn(move || {
            for (t, fd) in rx {
                drop(fd);
                t.junk_fds.fetch_sub(1, Ordering::AcqRel);
            }
        })?;
        let p = pool.clone();
        std::thread::Builder::new().name("tenant-poll".into()).spawn(move || p.poll_loop())?;
        for i in 0..threads.max(1) {
            let p = pool.clone();
            std::thread::Builder::new().name(format!("tenant-exec-{i}")).spawn(move || {
                if seccomp && super::seccomp::confine_connection_thread().is_err() {
                    // Serving tenant bytes unconfined is not an option.
                    tracing::error!("an executor could not narrow its seccomp filter; the worker exits");
                    std::process::exit(70);
                }
                p.exec_loop()
            })?;
        }
        Ok(pool)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands descriptors the worker does not keep to the closer thread.
    fn dispose(&self, t: &Arc<Tenant>, fds: Vec<OwnedFd>) {
        if fds.is_empty() {
            return;
        }
        let tx = self.closer.lock().unwrap_or_else(|e| e.into_inner());
        for fd in fds {
            t.junk_fds.fetch_add(1, Ordering::AcqRel);
            if let Err(std::sync::mpsc::SendError((t, fd))) = tx.send((t.clone(), fd)) {
                // No closer thread (it cannot end): close here.
                drop(fd);
                t.junk_fds.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Serves `sock` for `tenant`; returns the handle to stop it with.
    pub fn add_listener(&self, tenant: Arc<Tenant>, sock: UnixListener, max_connections: u32) -> std::io::Result<u64> {
        sock.set_nonblocking(true)?;
        let mut st = self.state();
        st.next += 1;
        let id = st.next;
        epoll_ctl(&self.epfd, libc::EPOLL_CTL_ADD, sock.as_raw_fd(), ONESHOT_IN, id | LISTENER)?;
        let log = Arc::new(LogLimiter::new(20, Duration::from_secs(10)));
        st.listeners.insert(id, ListenerEntry { tenant, sock: Arc::new(sock), max_connections, log, clients: HashSet::new(), backoff: None });
        Ok(id)
    }

    /// Stops serving a tenant's socket: the listener closes and every
    /// client of it is shut down (each is torn down as its EOF arrives).
    pub fn remove_listener(&self, id: u64) {
        let mut st = self.state();
        let Some(l) = st.listeners.remove(&id) else { return };
        let _ = epoll_ctl(&self.epfd, libc::EPOLL_CTL_DEL, l.sock.as_raw_fd(), 0, 0);
        for c in &l.clients {
            if let Some(c) = st.clients.get(c) {
                let _ = c.sock.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    fn poll_loop(self: Arc<Self>) {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // Wake for the earliest listener back-off to end.
            let now = Instant::now();
            let timeout = {
                let st = self.state();
                let backoffs = st.listeners.values().filter_map(|l| l.backoff.map(|b| b.0.saturating_duration_since(now)));
                let deferred = st.deferred.iter().map(|d| d.0.saturating_duration_since(now));
                backoffs.chain(st.tx_deadlines.values().map(|d| d.saturating_duration_since(now))).chain(deferred).min()
            };
            let ms = timeout.map(|d| d.as_millis().min(1000) as i32 + 1).unwrap_or(-1);
            // SAFETY: evs is a valid buffer of 64 events for the call.
            let n = unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), evs.as_mut_ptr(), evs.len() as i32, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("epoll_wait failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            self.rearm_backed_off();
            self.expire_replies();
            self.resume_deferred();
            for ev in &evs[..n as usize] {
                let token = ev.u64;
                if token & LISTENER != 0 {
                    self.accept_all(token & !LISTENER);
                } else if token & RING != 0 {
                    self.kicked(token & !RING);
                } else {
                    self.read_client(token);
                }
            }
        }
    }

    /// A host tenant woke its sleeping ring.
    fn kicked(&self, id: u64) {
        // The eventfd is never read: its open file is the tenant's too,
        // which may make it blocking or drain it first, and a read here
        // would then stall every client this thread serves. Watched edge
        // triggered, each write of the tenant's reports it again.
        let Some(r) = self.rings.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned() else { return };
        r.kick(&self.engine);
    }

    /// Reads again from clients whose pause is over.
    fn resume_deferred(&self) {
        let now = Instant::now();
        let due: Vec<(u64, Arc<Client>)> = {
            let mut st = self.state();
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut st.deferred).into_iter().partition(|d| d.0 <= now);
            st.deferred = later;
            due.into_iter().filter_map(|(_, id)| st.clients.get(&id).cloned().map(|c| (id, c))).collect()
        };
        for (id, c) in due {
            self.arm(&c, id, ONESHOT_IN);
        }
    }

    /// Drops clients that did not take their reply in time.
    fn expire_replies(&self) {
        let now = Instant::now();
        let late: Vec<(u64, Arc<Client>)> = {
            let mut st = self.state();
            let ids: Vec<u64> = st.tx_deadlines.iter().filter(|(_, d)| **d <= now).map(|(id, _)| *id).collect();
            ids.into_iter()
                .filter_map(|id| {
                    st.tx_deadlines.remove(&id);
                    st.clients.get(&id).cloned().map(|c| (id, c))
                })
                .collect()
        };
        for (id, c) in late {
            tenant_warn!(c.log, c.tenant.name, "dropping a client that does not take its replies");
            self.enqueue(&c.tenant.name, Job::Close(id));
        }
    }

    fn rearm_backed_off(&self) {
        let mut st = self.state();
        let now = Instant::now();
        for (id, l) in st.listeners.iter_mut() {
            if let Some((at, wait)) = l.backoff {
                if at <= now {
                    // Keep the wait for the next failure; reset on success.
                    l.backoff = Some((now + Duration::from_secs(3600), wait));
                    let _ = epoll_ctl(&self.epfd, libc::EPOLL_CTL_MOD, l.sock.as_raw_fd(), ONESHOT_IN, id | LISTENER);
                }
            }
        }
    }

    /// Stops accepting on listener `id` if tenant `t` has no connection;
    /// its socket keeps new clients in its backlog for whoever listens
    /// next. Err: the connections it has (it keeps accepting).
    pub fn retire_if_idle(&self, id: u64, t: &Tenant) -> Result<(), u32> {
        let _one = self.accepting.lock().unwrap_or_else(|e| e.into_inner());
        let n = t.connections.load(Ordering::Acquire);
        if n != 0 {
            return Err(n);
        }
        let mut st = self.state();
        if let Some(l) = st.listeners.remove(&id) {
            let _ = epoll_ctl(&self.epfd, libc::EPOLL_CTL_DEL, l.sock.as_raw_fd(), 0, 0);
        }
        Ok(())
    }

    fn accept_all(&self, id: u64) {
        let _one = self.accepting.lock().unwrap_or_else(|e| e.into_inner());
        let Some((sock, tenant, log, max)) = self.state().listeners.get(&id).map(|l| (l.sock.clone(), l.tenant.clone(), l.log.clone(), l.max_connections)) else { return };
        for _ in 0..ACCEPTS_PER_EVENT {
            match sock.accept() {
                Ok((s, _)) => {
                    if let Some(l) = self.state().listeners.get_mut(&id) {
                        l.backoff = None;
                    }
                    self.admit(id, &tenant, &log, max, s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: the pending client stays queued;
                    // try again later, not in a loop.
                    let wait = {
                        let mut st = self.state();
                        let Some(l) = st.listeners.get_mut(&id) else { return };
                        let wait = l.backoff.map(|b| (b.1 * 2).min(Duration::from_secs(1))).unwrap_or(Duration::from_millis(5));
                        l.backoff = Some((Instant::now() + wait, wait));
                        wait
                    };
                    tenant_warn!(log, tenant.name, "accepting a client failed, backing off {wait:?}: {e}");
                    return;
                }
            }
        }
        if self.state().listeners.contains_key(&id) {
            let _ = epoll_ctl(&self.epfd, libc::EPOLL_CTL_MOD, sock.as_raw_fd(), ONESHOT_IN, id | LISTENER);
        }
    }

    fn admit(&self, listener: u64, t: &Arc<Tenant>, log: &Arc<LogLimiter>, max: u32, s: UnixStream) {
        let refuse = |code: CuResult, why: String| {
            let _ = s.set_nonblocking(true);
            let _ = (&s).write_all(&Reply::error(code, why).encode(Opcode::Ping, 0));
            let _ = s.shutdown(std::net::Shutdown::Both);
        };
        if t.junk_fds.load(Ordering::Acquire) > MAX_JUNK_FDS {
            tenant_warn!(log, t.name, "refusing a client: too many of the tenant's descriptors wait to be closed");
            return refuse(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many of this tenant's descriptors wait to be closed".into());
        }
        let live = t.connections.fetch_add(1, Ordering::AcqRel);
        if live >= max {
            t.connections.fetch_sub(1, Ordering::AcqRel);
            tenant_warn!(log, t.name, "refusing a client: the tenant has {live} connections, its limit");
            return refuse(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("the tenant already has {live} connections, its limit"));
        }
        if let Err(Reply::Error(code, why)) = t.host.reserve(CONN_HOST_BYTES, "a connection") {
            t.connections.fetch_sub(1, Ordering::AcqRel);
            tenant_warn!(log, t.name, "refusing a client: {why}");
            return refuse(code, why);
        }
        let fd = s.as_raw_fd();
        let ok = s.set_nonblocking(true);
        let c = Arc::new(Client { tenant: t.clone(), listener, sock: s, log: log.clone(), io: Mutex::new(ClientIo::default()) });
        let mut st = self.state();
        st.next += 1;
        let id = st.next;
        let registered = ok.and_then(|_| epoll_ctl(&self.epfd, libc::EPOLL_CTL_ADD, fd, ONESHOT_IN, id));
        match (registered, st.listeners.get_mut(&listener)) {
            (Ok(()), Some(l)) => {
                l.clients.insert(id);
                st.clients.insert(id, c);
            }
            (r, _) => {
                drop(st);
                if let Err(e) = r {
                    tenant_warn!(log, t.name, "cannot watch a new client: {e}");
                }
                let _ = epoll_ctl(&self.epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
                let _ = c.sock.shutdown(std::net::Shutdown::Both);
                t.host.release(CONN_HOST_BYTES);
                t.connections.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Re-arms a client for `events`; one that cannot be watched is closed.
    fn arm(&self, c: &Client, id: u64, events: u32) {
        if let Err(e) = epoll_ctl(&self.epfd, libc::EPOLL_CTL_MOD, c.sock.as_raw_fd(), events, id) {
            tenant_warn!(c.log, c.tenant.name, "cannot watch a client any more ({e}); dropping it");
            self.enqueue(&c.tenant.name, Job::Close(id));
        }
    }

    fn read_client(&self, id: u64) {
        let Some(c) = self.state().clients.get(&id).cloned() else { return };
        let mut io = c.io.lock().unwrap_or_else(|e| e.into_inner());
        if io.closed {
            return;
        }
        if io.tx.is_some() {
            // The socket drained: write more of the pending reply.
            return match write_some(&c.sock, &mut io.tx) {
                Ok(true) => self.arm(&c, id, ONESHOT_OUT),
                Ok(false) => {
                    let keep = io.tx.take().is_some_and(|t| t.keep);
                    drop(io);
                    self.state().tx_deadlines.remove(&id);
                    if keep {
                        self.arm(&c, id, ONESHOT_IN)
                    } else {
                        self.enqueue(&c.tenant.name, Job::Close(id))
                    }
                }
                Err(_) => {
                    drop(io);
                    self.enqueue(&c.tenant.name, Job::Close(id));
                }
            };
        }
        if c.tenant.junk_fds.load(Ordering::Acquire) > MAX_JUNK_FDS {
            // Back-pressure: the tenant's connections are not read until
            // the closer catches up (a stuck close stalls only them).
            drop(io);
            self.state().deferred.push((Instant::now() + Duration::from_millis(20), id));
            return;
        }
        let step = io.rx.step(&c.sock, &c.tenant, &c.log);
        drop(io);
        let job = match step {
            RxStep::Pending => return self.arm(&c, id, ONESHOT_IN),
            // Not re-armed: the executor does that once it has replied.
            RxStep::Message(h, m, fds, held) => Job::Message(id, h, m, fds, held),
            RxStep::Refuse(bytes) => Job::Refuse(id, bytes),
            RxStep::Closed => Job::Close(id),
        };
        self.enqueue(&c.tenant.name, job);
    }

    fn enqueue(&self, tenant: &str, job: Job) {
        let mut st = self.state();
        let q = st.queues.entry(tenant.to_string()).or_default();
        q.jobs.push_back(job);
        if !q.busy && q.jobs.len() == 1 {
            st.ready.push_back(tenant.to_string());
        }
        drop(st);
        self.work.notify_one();
    }

    /// The next job of the tenant waiting longest with no executor.
    fn next_job(&self) -> (String, Job) {
        let mut st = self.state();
        loop {
            while let Some(name) = st.ready.pop_front() {
                let Some(q) = st.queues.get_mut(&name) else { continue };
                if q.busy {
                    continue;
                }
                let Some(job) = q.jobs.pop_front() else {
                    st.queues.remove(&name);
                    continue;
                };
                q.busy = true;
                return (name, job);
            }
            st = self.work.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn done(&self, tenant: &str) {
        let mut st = self.state();
        let requeue = match st.queues.get_mut(tenant) {
            Some(q) => {
                q.busy = false;
                !q.jobs.is_empty()
            }
            None => false,
        };
        if requeue {
            st.ready.push_back(tenant.to_string());
            drop(st);
            self.work.notify_one();
        } else {
            st.queues.remove(tenant);
        }
    }

    fn exec_loop(self: Arc<Self>) {
        loop {
            let (tenant, job) = self.next_job();
            // The tenant is released however the job ends, a bug's panic
            // included: it costs that job, never the tenant's queue.
            let _done = Done(&self, &tenant);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match job {
                Job::Message(id, h, m, fds, held) => self.run_message(id, h, m, fds, held),
                Job::Refuse(id, bytes) => {
                    // Bound first: the state lock must not be held below.
                    let client = self.state().clients.get(&id).cloned();
                    if let Some(c) = client {
                        let _ = (&c.sock).write(&bytes);
                        self.close(id);
                    }
                }
                Job::Close(id) => self.close(id),
            }));
            if r.is_err() {
                tracing::error!(tenant = %tenant, "a job of the tenant panicked; the worker goes on");
            }
        }
    }

    fn run_message(&self, id: u64, h: MsgHeader, msg: Vec<u8>, fds: Vec<OwnedFd>, held: Held) {
        let Some(c) = self.state().clients.get(&id).cloned() else { return self.dispose(&held.0.clone(), fds) };
        let mut io = c.io.lock().unwrap_or_else(|e| e.into_inner());
        if io.closed {
            drop(io);
            return self.dispose(&c.tenant, fds);
        }
        let (reply, keep, reply_held, junk) = handle_message(self, id, &c.tenant, &mut io, &h, msg, fds);
        drop(held);
        self.dispose(&c.tenant, junk);
        // Written without waiting: what the socket does not take now, the
        // poller writes as it drains, within WRITE_TIMEOUT.
        io.tx = Some(Tx { bytes: reply, at: 0, keep, _held: reply_held });
        match write_some(&c.sock, &mut io.tx) {
            Ok(true) => {
                // Recorded before the poller can see the client (the lock
                // order is io, then state), so its completion removes it.
                self.state().tx_deadlines.insert(id, Instant::now() + WRITE_TIMEOUT);
                drop(io);
                self.arm(&c, id, ONESHOT_OUT);
            }
            Ok(false) => {
                io.tx = None;
                drop(io);
                if keep {
                    self.arm(&c, id, ONESHOT_IN)
                } else {
                    self.close(id)
                }
            }
            Err(_) => {
                drop(io);
                self.close(id);
            }
        }
    }

    /// Tears a client down: its contexts and shared buffer go, its
    /// charges are released, the socket closes.
    fn close(&self, id: u64) {
        let Some(c) = self.state().clients.remove(&id) else { return };
        if let Some(l) = self.state().listeners.get_mut(&c.listener) {
            l.clients.remove(&id);
        }
        let _ = epoll_ctl(&self.epfd, libc::EPOLL_CTL_DEL, c.sock.as_raw_fd(), 0, 0);
        let _ = c.sock.shutdown(std::net::Shutdown::Both);
        self.state().tx_deadlines.remove(&id);
        let mut io = c.io.lock().unwrap_or_else(|e| e.into_inner());
        if std::mem::replace(&mut io.closed, true) {
            return;
        }
        if let Some(r) = io.ring.take() {
            r.close();
            if let Some(fd) = &r.kick_fd {
                let _ = epoll_ctl(&self.epfd, libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0);
            }
            self.rings.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        }
        self.svc.disconnect(&c.tenant, &mut io.conn.lock().unwrap_or_else(|e| e.into_inner()));
        let held: u64 = std::mem::take(&mut io.shm_held).values().sum();
        c.tenant.host.release(held + CONN_HOST_BYTES);
        c.tenant.connections.fetch_sub(1, Ordering::AcqRel);
        let rx = std::mem::take(&mut io.rx);
        io.tx = None;
        drop(io);
        self.dispose(&c.tenant, rx.fds);
    }
}

/// Writes what the non-blocking socket takes of the pending reply.
/// Ok(true): bytes remain; Ok(false): all written (or nothing pending).
fn write_some(s: &UnixStream, tx: &mut Option<Tx>) -> std::io::Result<bool> {
    let Some(t) = tx.as_mut() else { return Ok(false) };
    while t.at < t.bytes.len() {
        match (&*s).write(&t.bytes[t.at..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => t.at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) => return Err(e),
        }
    }
    // The whole reply is out: an executor ending on the error it carries
    // may go now (vgpu_arbiter::fatal).
    if vgpu_arbiter::fatal::marked() {
        if let Ok(h) = virtio_gpu_compute::MsgHeader::decode(&t.bytes) {
            vgpu_arbiter::fatal::replied(h.status);
        }
    }
    Ok(false)
}

/// What running one message gives: the reply bytes, whether the
/// connection stays open, the reply's charge (held until it is written) and
/// the descriptors the worker does not keep.
type Outcome = (Vec<u8>, bool, Option<Held>, Vec<OwnedFd>);

/// anon_inodefs, the file system of eventfds (and timerfds, signalfds,
/// epoll descriptors).
const ANON_INODE_FS_MAGIC: i64 = 0x0904_1934;

/// Whether `fd` is an anonymous inode, as an eventfd is: a ring's kick
/// may be nothing else (not a socket, whose close may linger, nor a pipe
/// or a file). Told by its file system, which every kernel reports the
/// same way (an anonymous inode's mode is not). Which anonymous kind is
/// not told apart; one that is not an eventfd never reports, and only its
/// own ring sleeps.
fn is_anon_inode(fd: &OwnedFd) -> bool {
    // SAFETY: statfs is plain data, for which all-zero bytes are valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes only into `st`; the descriptor is one we own.
    let r = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) };
    r == 0 && st.f_type as i64 == ANON_INODE_FS_MAGIC
}

/// Runs one complete message.
fn handle_message(pool: &Pool, id: u64, t: &Arc<Tenant>, io: &mut ClientIo, h: &MsgHeader, msg: Vec<u8>, mut fds: Vec<OwnedFd>) -> Outcome {
    let svc = &pool.svc;
    io.messages += 1;
    if t.is_revoked() {
        let r = Reply::error(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, format!("tenant {} was deleted", t.name));
        return (r.encode(h.opcode(), h.seq), false, None, fds);
    }
    let decoded = Request::decode(&msg);
    drop(msg);
    // An inline device-to-host copy's reply (and its encoding) is charged
    // until it is written.
    let reply_bytes = match &decoded {
        Ok((_, Request::MemcpyDtoH(b))) if b.loc == DataLoc::Inline as u32 => 2 * b.size,
        _ => 0,
    };
    if let Err(r) = t.host.reserve(reply_bytes, "this reply") {
        return (r.encode(h.opcode(), h.seq), true, None, fds);
    }
    let reply_held = Held(t.clone(), reply_bytes);
    let reply = match decoded {
        Err(e) => Reply::error(e.cuda(), format!("bad {:?} message: {e}", h.opcode())),
        Ok((_, Request::RegisterShm(b))) => match take_fds::<1>(&mut fds) {
            Err(why) => Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, format!("RegisterShm {why}")),
            Ok([f]) => register_region(svc, t, io, b.id, b.size, f).unwrap_or_else(|r| r),
        },
        Ok((_, Request::AttachRing(b))) => match take_fds::<2>(&mut fds) {
            Err(why) => Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, format!("AttachRing {why} (the ring's memfd and an eventfd)")),
            Ok([mem, kick]) => attach_ring(pool, id, t, io, b.sq_size, mem, kick).unwrap_or_else(|r| r),
        },
        Ok((_, Request::UnregisterShm(b))) => {
            let mut conn = io.conn.lock().unwrap_or_else(|e| e.into_inner());
            if b.id == RING_REGION || !conn.regions.contains_key(&b.id) {
                Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, format!("no shared region {}", b.id))
            } else {
                svc.set_shm(&mut conn, b.id, None);
                t.host.release(io.shm_held.remove(&b.id).unwrap_or(0));
                Reply::Empty
            }
        }
        Ok((_, Request::GetConnStats)) => Reply::ConnStats(Ring::stats(io.ring.as_deref(), io.messages)),
        Ok((_, req)) => {
            // Fds on any other message go to the closer, unused.
            // Defence in depth: a bug must cost this request, not the worker.
            let conn = io.conn.clone();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| svc.handle(t, &conn, req))) {
                Ok(r) => r,
                Err(_) => {
                    tracing::error!(tenant = %t.name, "request handler panicked; disconnecting the client");
                    return (Reply::error(CuResult::CUDA_ERROR_UNKNOWN, "internal error").encode(h.opcode(), h.seq), false, None, fds);
                }
            }
        }
    };
    (reply.encode(h.opcode(), h.seq), true, Some(reply_held), fds)
}

/// Takes exactly N descriptors off a message (the rest stay for the closer).
fn take_fds<const N: usize>(fds: &mut Vec<OwnedFd>) -> Result<[OwnedFd; N], String> {
    if fds.len() != N {
        let want = ["no", "one", "two"].get(N).copied().unwrap_or("more");
        return Err(format!("carries exactly {want} file descriptor{}, not {}", if N == 1 { "" } else { "s" }, fds.len()));
    }
    let v: Vec<OwnedFd> = std::mem::take(fds);
    v.try_into().map_err(|_| "lost its descriptors".to_string())
}

/// Maps a sealed memfd as shared region `rid`, charged to the tenant's
/// host budget while registered (a region re-registered under its id
/// replaces the old one).
fn register_region(svc: &DeviceService, t: &Arc<Tenant>, io: &mut ClientIo, rid: u32, size: u64, f: OwnedFd) -> Result<Reply, Reply> {
    let bad = |why: String| Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, why);
    if let Err(e) = super::shm::check_memfd(&f) {
        return Err(bad(format!("shared region: {e}")));
    }
    if rid == RING_REGION {
        return Err(bad(format!("shared region id {rid} is reserved")));
    }
    let mut conn = io.conn.lock().unwrap_or_else(|e| e.into_inner());
    if !conn.regions.contains_key(&rid) && conn.regions.len() >= MAX_REGIONS {
        return Err(Reply::error(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("a connection has at most {MAX_REGIONS} shared regions")));
    }
    // The old region's charge goes with it.
    svc.set_shm(&mut conn, rid, None);
    t.host.release(io.shm_held.remove(&rid).unwrap_or(0));
    t.host.reserve(size, if rid == 0 { "the shared buffer" } else { "the pinned host memory" })?;
    match Shm::map(f.into(), size) {
        Ok(m) => {
            io.shm_held.insert(rid, size);
            svc.set_shm(&mut conn, rid, Some(m));
            Ok(Reply::Empty)
        }
        Err(e) => {
            t.host.release(size);
            Err(bad(e.to_string()))
        }
    }
}

/// Attaches the connection's command ring: its memory and the eventfd the
/// tenant writes when it finds the ring asleep.
fn attach_ring(pool: &Pool, id: u64, t: &Arc<Tenant>, io: &mut ClientIo, sq_size: u32, mem: OwnedFd, kick: OwnedFd) -> Result<Reply, Reply> {
    let bad = |why: String| Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, why);
    if io.ring.is_some() {
        return Err(bad("the connection already has a ring".into()));
    }
    if let Err(e) = super::shm::check_memfd(&mem) {
        return Err(bad(format!("ring memory: {e}")));
    }
    if !is_anon_inode(&kick) {
        return Err(bad("the ring's kick descriptor must be an eventfd".into()));
    }
    let size = virtio_gpu_compute::ring::region_size(sq_size) as u64;
    t.host.reserve(size, "the command ring")?;
    let release = |r: Reply| {
        t.host.release(size);
        r
    };
    let shm = Arc::new(Shm::map(mem.into(), size).map_err(|e| release(bad(e.to_string())))?);
    let rm = RingMem::new(vec![(shm.as_ptr(), shm.len())], Box::new(shm.clone())).map_err(|e| release(bad(e)))?;
    let kfd = kick.as_raw_fd();
    let ring = Ring::new(pool.svc.clone(), t.clone(), io.conn.clone(), rm, sq_size, Some(kick)).map_err(|e| release(bad(e)))?;
    pool.rings.lock().unwrap_or_else(|e| e.into_inner()).insert(id, ring.clone());
    if let Err(e) = epoll_ctl(&pool.epfd, libc::EPOLL_CTL_ADD, kfd, (libc::EPOLLIN | libc::EPOLLET) as u32, id | RING) {
        pool.rings.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        return Err(release(bad(format!("the kick descriptor cannot be watched: {e}"))));
    }
    io.shm_held.insert(RING_REGION, size);
    io.ring = Some(ring);
    Ok(Reply::Empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_limiter_lets_a_burst_through_then_counts_what_it_drops() {
        let l = LogLimiter::new(3, Duration::from_millis(200));
        assert_eq!((0..3).map(|_| l.allow()).collect::<Vec<_>>(), [Some(0); 3]);
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
        assert_eq!(l.suppressed(), 2);
        std::thread::sleep(Duration::from_millis(250));
        // The next window reports how many were dropped.
        assert_eq!(l.allow(), Some(2));
        assert_eq!(l.suppressed(), 0);
    }
}
