//! The shim's side of the command ring (`virtio_gpu_compute::ring`):
//! entries are written into memory shared with the device worker and
//! completions read back from it, without a system call unless the worker
//! sleeps (then one kick) or a thread waits long (then a futex sleep).
//!
//! Threads submit under one short lock (the write of an entry); nobody
//! holds it while waiting for a completion.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_gpu_compute::ring::{self, EntryHeader};
use virtio_gpu_compute::*;

use crate::client::{CallError, CallResult};

/// How the worker is woken when the ring says it sleeps.
pub trait Kick: Send + Sync {
    fn kick(&self) -> CallResult<()>;
    /// Whether a waiting thread may sleep on the ring's WAKE word (host
    /// processes: the worker shares the futex); guests poll instead.
    fn futex(&self) -> bool;
    /// Whether the worker is still there (a host tenant's socket is open);
    /// a thread waiting on the ring checks it now and then.
    fn alive(&self) -> bool {
        true
    }
}

struct Sub {
    tail: u64,
    seq: u64,
    /// Bit i set: reply slot i is free.
    free_replies: u32,
}

pub struct RingClient {
    base: *mut u8,
    len: usize,
    sq_size: u64,
    sub: Mutex<Sub>,
    kick: Box<dyn Kick>,
    err_seen: AtomicU32,
    /// Kicks this process sent (for tests and benchmarks).
    pub kicks: AtomicU64,
}

// SAFETY: the mapping lives as long as the client; all access to it is
// through atomics and raw-pointer copies of bounded, checked ranges.
unsafe impl Send for RingClient {}
// SAFETY: as above; submission state is behind a mutex.
unsafe impl Sync for RingClient {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn broken(msg: String) -> CallError {
    CallError::new(CuResult::CUDA_ERROR_ILLEGAL_STATE, msg)
}

impl RingClient {
    /// A ring over `len` bytes of shared memory at `base`, which the worker
    /// has initialised (AttachRing succeeded).
    ///
    /// # Safety
    /// `base` must be a live mapping of `len` bytes, 64-byte aligned, that
    /// outlives the client.
    pub unsafe fn new(base: *mut u8, len: usize, sq_size: u32, kick: Box<dyn Kick>) -> RingClient {
        let r = RingClient {
            base,
            len,
            sq_size: sq_size as u64,
            sub: Mutex::new(Sub { tail: 0, seq: ring::FIRST_SEQ, free_replies: if ring::REPLY_SLOTS >= 32 { u32::MAX } else { (1u32 << ring::REPLY_SLOTS) - 1 } }),
            kick,
            err_seen: AtomicU32::new(0),
            kicks: AtomicU64::new(0),
        };
        r.err_seen.store(r.u32_at(ring::ERR_COUNT).load(Ordering::Acquire), Ordering::Relaxed);
        r
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= self.len && off.is_multiple_of(8));
        // SAFETY: aligned, inside the live mapping (asserted).
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast()) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= self.len && off.is_multiple_of(4));
        // SAFETY: aligned, inside the live mapping (asserted).
        unsafe { AtomicU32::from_ptr(self.base.add(off).cast()) }
    }

    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: inside the live mapping (asserted); the worker only reads
        // an entry once the tail covers it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(off), data.len()) };
    }

    fn read(&self, off: usize, out: &mut [u8]) {
        assert!(off + out.len() <= self.len);
        // SAFETY: inside the live mapping (asserted).
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off), out.as_mut_ptr(), out.len()) };
    }

    /// Whether the device's side of the ring is still there.
    pub fn alive(&self) -> bool {
        self.kick.alive()
    }

    pub fn is_done(&self, seq: u64) -> bool {
        seq < ring::FIRST_SEQ || self.u64_at(ring::done_offset(seq)).load(Ordering::Acquire) >= seq
    }

    fn check_broken(&self) -> CallResult<()> {
        match self.u32_at(ring::BROKEN).load(Ordering::Acquire) {
            0 => Ok(()),
            _ => Err(broken("the device stopped serving this process's command ring (its contents were corrupted)".into())),
        }
    }

    /// The newest asynchronous error the worker reported since the last
    /// call to this, if any, and the context of the work that failed (0 if
    /// the worker did not name one). The block is a sequence lock: read
    /// again while the worker is writing it.
    pub fn take_error(&self) -> Option<(CallError, u32)> {
        let count = self.u32_at(ring::ERR_COUNT);
        for _ in 0..1000 {
            let c = count.load(Ordering::Acquire);
            if c % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            if self.err_seen.load(Ordering::Acquire) == c {
                return None;
            }
            let code = CuResult::from_u32(self.u32_at(ring::ERR_CODE).load(Ordering::Relaxed));
            let ctx = self.u32_at(ring::ERR_CTX).load(Ordering::Relaxed);
            let n = (self.u32_at(ring::ERR_LEN).load(Ordering::Relaxed) as usize).min(ring::ERR_TEXT_MAX);
            let mut text = vec![0u8; n];
            self.read(ring::ERR_TEXT, &mut text);
            fence(Ordering::Acquire);
            if count.load(Ordering::Relaxed) != c || self.err_seen.swap(c, Ordering::AcqRel) == c {
                continue;
            }
            let code = if code.is_ok() { CuResult::CUDA_ERROR_UNKNOWN } else { code };
            return Some((CallError::new(code, String::from_utf8_lossy(&text).into_owned()), ctx));
        }
        None
    }

    /// Waits until `cond` holds: spins briefly, then sleeps on the ring's
    /// WAKE futex (host) or yields and naps (guest).
    fn wait_until(&self, mut cond: impl FnMut() -> bool) -> CallResult<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if cond() {
                return Ok(());
            }
            self.check_broken()?;
            spins += 1;
            if spins < 4000 {
                std::hint::spin_loop();
                continue;
            }
            if !self.kick.alive() {
                return Err(CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "connection to the vGPU was lost"));
            }
            if self.kick.futex() {
                let waiters = self.u32_at(ring::WAITERS);
                let wake = self.u32_at(ring::WAKE);
                waiters.fetch_add(1, Ordering::SeqCst);
                let w = wake.load(Ordering::SeqCst);
                if !cond() {
                    let ts = libc::timespec { tv_sec: 0, tv_nsec: 10_000_000 };
                    // SAFETY: FUTEX_WAIT on an aligned u32 of the live
                    // shared mapping with a valid timeout.
                    unsafe { libc::syscall(libc::SYS_futex, wake.as_ptr(), libc::FUTEX_WAIT, w, &ts as *const libc::timespec, std::ptr::null::<u32>(), 0) };
                }
                waiters.fetch_sub(1, Ordering::SeqCst);
            } else if start.elapsed() < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Waits for entry `seq` to complete.
    pub fn wait(&self, seq: u64) -> CallResult<()> {
        self.wait_until(|| self.is_done(seq))
    }

    /// Waits until the worker has consumed every entry written so far
    /// (before a call that goes on the socket, so it sees them).
    pub fn wait_consumed(&self) -> CallResult<()> {
        let tail = lock(&self.sub).tail;
        self.wait_until(|| self.u64_at(ring::SQ_HEAD).load(Ordering::Acquire) >= tail)
    }

    /// Waits until every entry written so far has completed.
    pub fn wait_all_done(&self) -> CallResult<()> {
        let next = self.next_seq();
        for seq in next.saturating_sub(ring::ENTRY_SLOTS).max(ring::FIRST_SEQ)..next {
            self.wait(seq)?;
        }
        Ok(())
    }

    /// Whether a message of `n` bytes fits in one entry.
    pub fn fits(n: usize) -> bool {
        ring::entry_len(n) <= ring::MAX_ENTRY
    }

    /// Writes `msg` (encoded with sequence 0: the entry carries the real
    /// one) as one entry; returns its sequence number and reply slot.
    pub fn submit(&self, req: &Request, want_reply: bool) -> CallResult<(u64, u16)> {
        let mut s = lock(&self.sub);
        let seq = s.seq;
        let msg = req.encode(seq as u32);
        let len = ring::entry_len(msg.len());
        if len > ring::MAX_ENTRY {
            return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_VALUE, format!("a message of {} bytes does not fit a ring entry", msg.len())));
        }
        let reply = if want_reply {
            while s.free_replies == 0 {
                drop(s);
                std::thread::yield_now();
                s = lock(&self.sub);
            }
            let i = s.free_replies.trailing_zeros() as u16;
            s.free_replies &= !(1 << i);
            i
        } else {
            ring::NO_REPLY
        };
        let seq = s.seq;
        let msg = if seq as u32 == msg_seq(&msg) { msg } else { req.encode(seq as u32) };
        // Entry seq - ENTRY_SLOTS must be complete: its slot is reused.
        let r = self.wait_until(|| self.is_done(seq - ring::ENTRY_SLOTS));
        if let Err(e) = r {
            if reply != ring::NO_REPLY {
                s.free_replies |= 1 << reply;
            }
            return Err(e);
        }
        let pos = s.tail % self.sq_size;
        let pad = if pos + len as u64 > self.sq_size { self.sq_size - pos } else { 0 };
        let need = pad + len as u64;
        let tail = s.tail;
        let room = self.wait_until(|| tail + need - self.u64_at(ring::SQ_HEAD).load(Ordering::Acquire).min(tail) <= self.sq_size);
        if let Err(e) = room {
            if reply != ring::NO_REPLY {
                s.free_replies |= 1 << reply;
            }
            return Err(e);
        }
        let mut hdr = Vec::with_capacity(EntryHeader::SIZE);
        if pad > 0 {
            EntryHeader { len: pad as u32, flags: ring::ENTRY_PAD, reply: ring::NO_REPLY, seq: 0 }.put(&mut hdr);
            self.write(ring::SQ + pos as usize, &hdr);
            s.tail += pad;
            hdr.clear();
        }
        // Header, message and padding straight into the queue.
        let at = ring::SQ + (s.tail % self.sq_size) as usize;
        EntryHeader { len: len as u32, flags: 0, reply, seq }.put(&mut hdr);
        self.write(at, &hdr);
        self.write(at + EntryHeader::SIZE, &msg);
        self.write(at + EntryHeader::SIZE + msg.len(), &[0u8; ring::ENTRY_ALIGN][..len - EntryHeader::SIZE - msg.len()]);
        s.tail += len as u64;
        s.seq += 1;
        self.u64_at(ring::SQ_TAIL).store(s.tail, Ordering::Release);
        fence(Ordering::SeqCst);
        let state = self.u32_at(ring::STATE);
        if state.load(Ordering::SeqCst) == ring::STATE_SLEEPING && state.compare_exchange(ring::STATE_SLEEPING, ring::STATE_KICKED, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            self.kicks.fetch_add(1, Ordering::Relaxed);
            drop(s);
            self.kick.kick()?;
        }
        Ok((seq, reply))
    }

    /// Reads the reply to `seq` from its slot (the entry is complete) and
    /// frees the slot.
    pub fn reply(&self, op: Opcode, seq: u64, slot: u16) -> CallResult<Reply> {
        let off = ring::reply_offset(slot);
        let mut hdr = [0u8; MsgHeader::SIZE];
        self.read(off, &mut hdr);
        let r = (|| {
            let h = MsgHeader::decode(&hdr).map_err(|e| broken(format!("bad reply header in the ring: {e}")))?;
            let n = h.payload_len as usize;
            if MsgHeader::SIZE + n > ring::REPLY_SLOT_SIZE || h.seq != seq as u32 {
                return Err(broken(format!("reply to entry {seq} does not match it")));
            }
            let mut payload = vec![0u8; n];
            self.read(off + MsgHeader::SIZE, &mut payload);
            Reply::decode_payload(op, h.status, &payload).map_err(|e| broken(format!("bad reply in the ring: {e}")))
        })();
        lock(&self.sub).free_replies |= 1 << slot;
        r
    }

    /// A call that waits for its reply.
    pub fn call(&self, req: &Request) -> CallResult<Reply> {
        let (seq, slot) = self.submit(req, true)?;
        let waited = self.wait(seq);
        if let Err(e) = waited {
            lock(&self.sub).free_replies |= 1 << slot;
            return Err(e);
        }
        self.reply(req.opcode(), seq, slot)
    }

    /// The next sequence number (entries below it were submitted).
    pub fn next_seq(&self) -> u64 {
        lock(&self.sub).seq
    }
}

fn msg_seq(msg: &[u8]) -> u32 {
    u32::from_le_bytes([msg[8], msg[9], msg[10], msg[11]])
}
