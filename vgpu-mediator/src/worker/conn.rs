//! A process tenant's socket: the accept loop and one connection's
//! message loop. Every fd a client attaches is owned (and so closed) here,
//! connections are capped per tenant and charged to its host budget, and
//! payloads are charged while they are held.

use std::collections::HashMap;
use std::io::Write;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use virtio_gpu_compute::*;

use super::service::{Conn, DeviceService, Tenant};
use super::shm::Shm;

/// Stack of one connection thread; its cost is charged to the tenant.
pub const CONN_STACK: usize = 256 << 10;
/// Host bytes one connection costs its tenant: its thread's stack and its
/// header and reply buffers.
pub const CONN_HOST_BYTES: u64 = CONN_STACK as u64 + (16 << 10);
/// Most fds one receive takes; more are closed by the kernel (MSG_CTRUNC).
const MAX_FDS: usize = 8;

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


/// One `recvmsg`: bytes into `buf`, every attached fd into `fds` (owned,
/// close-on-exec). Returns the byte count.
fn recv_owning_fds(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    // u64 storage keeps the control buffer aligned for cmsghdr.
    const SPACE: usize = 128;
    let mut cbuf = [0u64; SPACE / 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let need = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<i32>()) as u32) } as usize;
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

/// Reads exactly `buf.len()` bytes, keeping every fd that arrives with
/// them in `fds`. Returns false on a clean EOF before the first byte.
fn read_full(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let n = match recv_owning_fds(s, &mut buf[got..], fds) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if fds.len() > MAX_FDS {
            return Err(std::io::Error::other(format!("more than {MAX_FDS} file descriptors attached to one message")));
        }
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// A tenant's listening socket, as the worker serves it.
pub struct Listener {
    /// The worker runs under seccomp: connection threads narrow it further.
    pub seccomp: bool,
    pub max_connections: u32,
    pub stop: Arc<AtomicBool>,
    /// Live client connections, kept so removal can drop them; each entry
    /// is removed again when its connection ends.
    pub streams: Arc<Mutex<HashMap<u64, UnixStream>>>,
    pub log: Arc<LogLimiter>,
}

/// Refuses a client before its first request.
fn refuse(s: &UnixStream, code: CuResult, why: String) {
    let mut s = s;
    let _ = s.write_all(&Reply::error(code, why).encode(Opcode::Ping, 0));
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// Accepts clients until `stop` is set. Accept errors (EMFILE, ENFILE, ...)
/// back off instead of spinning.
pub fn accept_loop(l: &Listener, listener: UnixListener, svc: Arc<DeviceService>, t: Arc<Tenant>) {
    let mut next_id = 0u64;
    let mut backoff = Duration::from_millis(5);
    for s in listener.incoming() {
        if l.stop.load(Ordering::Acquire) {
            break;
        }
        let s = match s {
            Ok(s) => {
                backoff = Duration::from_millis(5);
                s
            }
            Err(e) => {
                tenant_warn!(l.log, t.name, "accepting a client failed, backing off {backoff:?}: {e}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        // Counted here, before the thread exists, so the cap cannot be raced.
        let live = t.connections.fetch_add(1, Ordering::AcqRel);
        if live >= l.max_connections {
            t.connections.fetch_sub(1, Ordering::AcqRel);
            tenant_warn!(l.log, t.name, "refusing a client: the tenant has {live} connections, its limit");
            refuse(&s, CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("the tenant already has {live} connections, its limit"));
            continue;
        }
        if let Err(Reply::Error(code, why)) = t.host.reserve(CONN_HOST_BYTES, "a connection") {
            t.connections.fetch_sub(1, Ordering::AcqRel);
            tenant_warn!(l.log, t.name, "refusing a client: {why}");
            refuse(&s, code, why);
            continue;
        }
        next_id += 1;
        let id = next_id;
        if let Ok(c) = s.try_clone() {
            l.streams.lock().unwrap_or_else(|e| e.into_inner()).insert(id, c);
        }
        let (svc, t2, reg, log, seccomp) = (svc.clone(), t.clone(), l.streams.clone(), l.log.clone(), l.seccomp);
        let spawned = std::thread::Builder::new().name(format!("tenant-{}", t.name)).stack_size(CONN_STACK).spawn(move || {
            // This thread parses the tenant's bytes: it may not create
            // sockets, threads or files, whatever a bug would do.
            match (seccomp, seccomp && super::seccomp::confine_connection_thread().is_err()) {
                (true, true) => tracing::error!(tenant = %t2.name, "cannot narrow the connection thread's seccomp filter; refusing the client"),
                _ => serve(&svc, &t2, &s, &log),
            }
            // The registry holds a clone of this socket: close it
            // explicitly so the client sees EOF, and forget it.
            let _ = s.shutdown(std::net::Shutdown::Both);
            reg.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            t2.host.release(CONN_HOST_BYTES);
            t2.connections.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            tenant_warn!(l.log, t.name, "cannot start a connection thread; refusing the client");
            if let Some(c) = l.streams.lock().unwrap_or_else(|e| e.into_inner()).remove(&id) {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
            t.host.release(CONN_HOST_BYTES);
            t.connections.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Holds `n` bytes of the tenant's host budget until dropped.
struct Held<'a>(&'a Tenant, u64);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.host.release(self.1);
    }
}

/// Serves one client connection until it closes or breaks framing.
fn serve(svc: &DeviceService, t: &Tenant, s: &UnixStream, log: &LogLimiter) {
    let mut s = s;
    let mut conn = Conn::default();
    let mut hdr = [0u8; MsgHeader::SIZE];
    // The mapped shared buffer is charged while it is registered.
    let mut shm_held = 0u64;
    loop {
        let mut fds = Vec::new();
        match read_full(s, &mut hdr, &mut fds) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                tenant_warn!(log, t.name, "connection read failed: {e}");
                break;
            }
        }
        let h = match MsgHeader::decode(&hdr) {
            Ok(h) => h,
            Err(e) => {
                // Framing cannot be trusted past a bad header: answer, then drop.
                tenant_warn!(log, t.name, "bad header, disconnecting: {e}");
                let seq = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]);
                let _ = s.write_all(&Reply::error(e.cuda(), format!("bad message header: {e}")).encode(Opcode::Ping, seq));
                break;
            }
        };
        // The message and its decoded copy are charged while they are held.
        let held = 2 * (MsgHeader::SIZE as u64 + h.payload_len as u64);
        if let Err(r) = t.host.reserve(held, "this message") {
            let _ = s.write_all(&r.encode(h.opcode(), h.seq));
            break;
        }
        let _held = Held(t, held);
        let mut msg = vec![0u8; MsgHeader::SIZE + h.payload_len as usize];
        msg[..MsgHeader::SIZE].copy_from_slice(&hdr);
        match read_full(s, &mut msg[MsgHeader::SIZE..], &mut fds) {
            Ok(true) => {}
            _ => break,
        }
        let decoded = Request::decode(&msg);
        drop(msg);
        // An inline device-to-host copy's reply (and its encoding) is
        // charged until it is written.
        let reply_bytes = match &decoded {
            Ok((_, Request::MemcpyDtoH(b))) if b.loc == DataLoc::Inline as u32 => 2 * b.size,
            _ => 0,
        };
        if let Err(r) = t.host.reserve(reply_bytes, "this reply") {
            if s.write_all(&r.encode(h.opcode(), h.seq)).is_err() {
                break;
            }
            continue;
        }
        let _reply_held = Held(t, reply_bytes);
        let reply = match decoded {
            Err(e) => Reply::error(e.cuda(), format!("bad {:?} message: {e}", h.opcode())),
            Ok((_, Request::RegisterShm(b))) => match (fds.pop(), fds.is_empty()) {
                (None, _) => Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, "RegisterShm arrived without a file descriptor"),
                (Some(_), false) => Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, "RegisterShm carries exactly one file descriptor"),
                (Some(f), true) => {
                    // The old buffer's charge goes with it.
                    svc.set_shm(&mut conn, None);
                    t.host.release(std::mem::take(&mut shm_held));
                    match t.host.reserve(b.size, "the shared buffer") {
                        Err(r) => r,
                        Ok(()) => match Shm::map(f.into(), b.size) {
                            Ok(m) => {
                                shm_held = b.size;
                                svc.set_shm(&mut conn, Some(m));
                                Reply::Empty
                            }
                            Err(e) => {
                                t.host.release(b.size);
                                Reply::error(CuResult::CUDA_ERROR_INVALID_VALUE, e.to_string())
                            }
                        },
                    }
                }
            },
            Ok((_, req)) => {
                // Fds on any other message are closed here, unused.
                fds.clear();
                // Defence in depth: a bug must cost this request, not the worker.
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| svc.handle(t, &mut conn, req))) {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::error!(tenant = %t.name, "request handler panicked; disconnecting the client");
                        let _ = s.write_all(&Reply::error(CuResult::CUDA_ERROR_UNKNOWN, "internal error").encode(h.opcode(), h.seq));
                        break;
                    }
                }
            }
        };
        if s.write_all(&reply.encode(h.opcode(), h.seq)).is_err() {
            break;
        }
    }
    svc.disconnect(t, &mut conn);
    t.host.release(shm_held);
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
