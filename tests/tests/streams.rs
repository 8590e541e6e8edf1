//! CUDA stream semantics through the command ring, in process through
//! libcuda's exported functions: launches return at once and run in order
//! on their stream; different streams run at the same time; events order
//! work across streams; errors surface at the next synchronising call; a
//! tenant that corrupts its own ring breaks only that ring.

use std::ffi::c_void;

use ::cuda::api as cu;
use vgpu_tests::*;
use virtio_gpu_compute::ring;
use virtio_gpu_compute::*;

const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry step(.param .u64 p, .param .u32 k)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<4>;
    ld.param.u64 %rd0, [p];
    ld.param.u32 %r0, [k];
    ld.global.u32 %r1, [%rd0];
    mul.lo.u32 %r2, %r1, 31;
    add.u32 %r3, %r2, %r0;
    st.global.u32 [%rd0], %r3;
    ret;
}

.visible .entry spin(.param .u64 flag, .param .u64 out)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<3>;
    .reg .pred %p<3>;
    ld.param.u64 %rd0, [flag];
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, 0;
LOOP:
    ld.volatile.global.u32 %r0, [%rd0];
    add.u32 %r1, %r1, 1;
    setp.eq.u32 %p0, %r0, 0;
    setp.lt.u32 %p1, %r1, 20000000;
    and.pred %p2, %p0, %p1;
    @%p2 bra LOOP;
    st.global.u32 [%rd1], %r0;
    ret;
}

.visible .entry set(.param .u64 flag, .param .u32 v)
{
    .reg .u64 %rd<1>;
    .reg .u32 %r<1>;
    ld.param.u64 %rd0, [flag];
    ld.param.u32 %r0, [v];
    st.volatile.global.u32 [%rd0], %r0;
    ret;
}

.visible .entry slow_write(.param .u64 p, .param .u32 v, .param .u32 n)
{
    .reg .u64 %rd<1>;
    .reg .u32 %r<3>;
    .reg .pred %p<1>;
    ld.param.u64 %rd0, [p];
    ld.param.u32 %r0, [v];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, 0;
AGAIN:
    add.u32 %r2, %r2, 1;
    setp.lt.u32 %p0, %r2, %r1;
    @%p0 bra AGAIN;
    st.global.u32 [%rd0], %r0;
    ret;
}

.visible .entry copy1(.param .u64 dst, .param .u64 src)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<1>;
    ld.param.u64 %rd0, [dst];
    ld.param.u64 %rd1, [src];
    ld.global.u32 %r0, [%rd1];
    st.global.u32 [%rd0], %r0;
    ret;
}

.visible .entry poke(.param .u64 p)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<1>;
    ld.param.u64 %rd0, [p];
    add.u64 %rd1, %rd0, 1099511627776;
    mov.u32 %r0, 7;
    st.global.u32 [%rd1], %r0;
    ret;
}
"#;

type H = *mut c_void;

/// The driver-API checks share one process-wide shim, bound at cuInit to
/// one tenant, so they run in one test, in order, against one mediator
/// (dropped, and so stopped, at the end).
#[test]
fn stream_semantics_through_the_driver_api() {
    let m = Mediator::start(&["--device-memory", "256MiB"]);
    let sock = m.tenant("streams", "128MiB");
    std::env::set_var("VGPU_SOCKET", &sock);
    assert_eq!(cu::cuInit(0), 0);
    work_on_one_stream_runs_in_order_and_launches_do_not_wait();
    different_streams_run_at_the_same_time();
    events_order_work_across_streams();
    errors_surface_at_the_next_synchronising_call();
    pinned_memory_copies_and_pageable_copies_agree();
    per_thread_default_streams_are_separate_streams();
    registered_host_memory_is_shared_in_place();
    drop(m);
}

fn ok(r: cu::CUresult, what: &str) {
    assert_eq!(r, 0, "{what} returned {r}");
}

struct Ctx {
    ctx: H,
    module: H,
}

impl Ctx {
    fn new() -> Ctx {
        let mut ctx = std::ptr::null_mut();
        let mut module = std::ptr::null_mut();
        let ptx = std::ffi::CString::new(PTX).expect("ptx");
        // SAFETY: valid out-pointers and a NUL-terminated image.
        unsafe {
            ok(cu::cuCtxCreate_v2(&mut ctx, 0, 0), "cuCtxCreate");
            ok(cu::cuModuleLoadData(&mut module, ptx.as_ptr().cast()), "cuModuleLoadData");
        }
        Ctx { ctx, module }
    }

    fn func(&self, name: &str) -> H {
        let mut f = std::ptr::null_mut();
        let n = std::ffi::CString::new(name).expect("name");
        // SAFETY: valid out-pointer, live module, NUL-terminated name.
        ok(unsafe { cu::cuModuleGetFunction(&mut f, self.module, n.as_ptr()) }, "cuModuleGetFunction");
        f
    }

    fn alloc(&self, n: usize) -> u64 {
        let mut p = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { cu::cuMemAlloc_v2(&mut p, n) }, "cuMemAlloc");
        ok(cu::cuMemsetD8_v2(p, 0, n), "cuMemsetD8");
        p
    }

    fn stream(&self, flags: u32) -> H {
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { cu::cuStreamCreate(&mut s, flags) }, "cuStreamCreate");
        s
    }

    fn read32(&self, p: u64) -> u32 {
        let mut v = 0u32;
        // SAFETY: 4 writable bytes at &v.
        ok(unsafe { cu::cuMemcpyDtoH_v2((&mut v as *mut u32).cast(), p, 4) }, "cuMemcpyDtoH");
        v
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        cu::cuCtxDestroy_v2(self.ctx);
    }
}

/// Launches `f` on one thread with `args` (pointers to each argument).
fn launch(f: H, stream: H, args: &mut [*mut c_void]) -> cu::CUresult {
    // SAFETY: `args` holds one pointer per kernel parameter, each to a
    // live value of that parameter's size.
    unsafe { cu::cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, args.as_mut_ptr(), std::ptr::null_mut()) }
}

fn work_on_one_stream_runs_in_order_and_launches_do_not_wait() {
    let c = Ctx::new();
    let step = c.func("step");
    let p = c.alloc(4);
    let s = c.stream(0);
    let mut expect = 0u32;
    for k in 1..=2000u32 {
        let (mut pp, mut kk) = (p, k);
        ok(launch(step, s, &mut [(&mut pp as *mut u64).cast(), (&mut kk as *mut u32).cast()]), "launch");
        expect = expect.wrapping_mul(31).wrapping_add(k);
        if k == 1000 {
            // A memset and a copy queue between launches, in order too.
            ok(cu::cuMemsetD32Async(p, 5, 1, s), "memset");
            expect = 5;
        }
    }
    let mut host = 0u32;
    // SAFETY: 4 writable bytes; synchronised before they are read.
    ok(unsafe { cu::cuMemcpyDtoHAsync_v2((&mut host as *mut u32).cast(), p, 4, s) }, "copy");
    ok(cu::cuStreamSynchronize(s), "sync");
    assert_eq!(host, expect, "the stream ran its 2000 launches, memset and copy in order");
    // The legacy default stream waits for a blocking stream's work.
    let (mut pp, mut kk) = (p, 9u32);
    ok(launch(step, s, &mut [(&mut pp as *mut u64).cast(), (&mut kk as *mut u32).cast()]), "launch");
    assert_eq!(c.read32(p), expect.wrapping_mul(31).wrapping_add(9), "a synchronous copy on the legacy stream sees the blocking stream's work");
    ok(cu::cuStreamDestroy_v2(s), "destroy");
}

fn different_streams_run_at_the_same_time() {
    let c = Ctx::new();
    let (spin, set) = (c.func("spin"), c.func("set"));
    let flag = c.alloc(4);
    let out = c.alloc(4);
    let (a, b) = (c.stream(1), c.stream(1));
    // `spin` waits for the flag that `set`, queued after it on another
    // stream, raises: it ends only if the two streams overlap (otherwise
    // it gives up after 20 M iterations and writes 0).
    let (mut f1, mut o1) = (flag, out);
    ok(launch(spin, a, &mut [(&mut f1 as *mut u64).cast(), (&mut o1 as *mut u64).cast()]), "spin");
    std::thread::sleep(std::time::Duration::from_millis(50));
    let (mut f2, mut v) = (flag, 42u32);
    ok(launch(set, b, &mut [(&mut f2 as *mut u64).cast(), (&mut v as *mut u32).cast()]), "set");
    ok(cu::cuStreamSynchronize(a), "sync a");
    ok(cu::cuStreamSynchronize(b), "sync b");
    assert_eq!(c.read32(out), 42, "the spinning kernel saw the flag set by the other stream");
}

fn events_order_work_across_streams() {
    let c = Ctx::new();
    let (slow, copy) = (c.func("slow_write"), c.func("copy1"));
    let src = c.alloc(4);
    let dst = c.alloc(4);
    let (a, b) = (c.stream(1), c.stream(1));
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut ev, 0) }, "event");
    for round in 1..=3u32 {
        let (mut p, mut v, mut n) = (src, 1000 + round, 300_000u32);
        ok(launch(slow, a, &mut [(&mut p as *mut u64).cast(), (&mut v as *mut u32).cast(), (&mut n as *mut u32).cast()]), "slow write");
        ok(cu::cuEventRecord(ev, a), "record");
        ok(cu::cuStreamWaitEvent(b, ev, 0), "wait event");
        let (mut d, mut s) = (dst, src);
        ok(launch(copy, b, &mut [(&mut d as *mut u64).cast(), (&mut s as *mut u64).cast()]), "copy");
        let early = cu::cuEventQuery(ev);
        assert!(early == 0 || early == CuResult::CUDA_ERROR_NOT_READY as u32, "cuEventQuery: {early}");
        ok(cu::cuStreamSynchronize(b), "sync b");
        assert_eq!(cu::cuEventQuery(ev), 0, "the event completed before the work that waited for it");
        assert_eq!(c.read32(dst), 1000 + round, "the copy on stream b ran after the write on stream a");
    }
    ok(cu::cuEventDestroy_v2(ev), "event destroy");
}

fn errors_surface_at_the_next_synchronising_call() {
    let c = Ctx::new();
    let poke = c.func("poke");
    let p = c.alloc(4);
    let s = c.stream(0);
    // A memset outside every allocation is refused asynchronously...
    ok(cu::cuMemsetD32Async(p + (64 << 20), 1, 1, s), "the bad memset is only queued");
    assert_eq!(cu::cuStreamSynchronize(s), CuResult::CUDA_ERROR_INVALID_VALUE as u32, "reported at the sync");
    ok(cu::cuStreamSynchronize(s), "reported once: it is not sticky");
    // ...and a kernel fault is sticky for the context.
    let mut pp = p;
    ok(launch(poke, s, &mut [(&mut pp as *mut u64).cast()]), "the faulting launch returns at once");
    assert_eq!(cu::cuStreamSynchronize(s), CuResult::CUDA_ERROR_ILLEGAL_ADDRESS as u32);
    let mut q = 0u64;
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { cu::cuMemAlloc_v2(&mut q, 16) }, CuResult::CUDA_ERROR_ILLEGAL_ADDRESS as u32, "the context stays unusable");
    drop(c);
    let fresh = Ctx::new();
    let q = fresh.alloc(4);
    assert_eq!(fresh.read32(q), 0, "a new context works");
}

fn pinned_memory_copies_and_pageable_copies_agree() {
    let c = Ctx::new();
    let n = 3 << 20;
    let d = c.alloc(n);
    let mut pinned: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocHost_v2(&mut pinned, n) }, "cuMemAllocHost");
    // SAFETY: cuMemAllocHost returned `n` writable bytes.
    let host = unsafe { std::slice::from_raw_parts_mut(pinned.cast::<u8>(), n) };
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    let s = c.stream(0);
    // SAFETY: pinned source of `n` bytes, live until the sync below.
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(d, pinned, n, s) }, "pinned HtoD");
    ok(cu::cuStreamSynchronize(s), "sync");
    let mut back = vec![0u8; n];
    // SAFETY: `n` writable bytes; pageable, so the copy completes first.
    ok(unsafe { cu::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, n) }, "pageable DtoH");
    assert!(back == host, "pinned upload, pageable download");
    let pattern: Vec<u8> = (0..n).map(|i| (i % 13) as u8).collect();
    // SAFETY: `n` readable bytes.
    ok(unsafe { cu::cuMemcpyHtoD_v2(d, pattern.as_ptr().cast(), n) }, "pageable HtoD");
    // SAFETY: pinned destination of `n` bytes.
    ok(unsafe { cu::cuMemcpyDtoHAsync_v2(pinned, d, n, s) }, "pinned DtoH");
    ok(cu::cuStreamSynchronize(s), "sync");
    assert!(host[..] == pattern[..], "pageable upload, pinned download");
    ok(cu::cuMemFreeHost(pinned), "cuMemFreeHost");
    assert_ne!(cu::cuMemFreeHost(pinned), 0, "a second free is refused");
}

fn registered_host_memory_is_shared_in_place() {
    let c = Ctx::new();
    let n = 3 << 20;
    let d = c.alloc(n);
    let mut host: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let p = host.as_mut_ptr();
    // SAFETY: `host` holds `n` bytes and outlives the registration.
    ok(unsafe { cu::cuMemHostRegister_v2(p.cast(), n, 0) }, "cuMemHostRegister");
    assert_eq!(host.as_ptr(), p as *const u8, "the buffer keeps its address");
    assert!(host.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "and its contents");
    // SAFETY: the same range again.
    let again = unsafe { cu::cuMemHostRegister_v2(p.cast(), n, 0) };
    assert_eq!(again, CuResult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED as u32);
    let s = c.stream(0);
    let entries = || {
        let (mut m, mut e, mut k) = (0u64, 0u64, 0u64);
        // SAFETY: valid out-pointers.
        ok(unsafe { cu::vgpuGetConnectionStats(&mut m, &mut e, &mut k) }, "stats");
        e
    };
    let before = entries();
    // SAFETY: registered source of `n` bytes, live until the sync.
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(d, p.cast(), n, s) }, "HtoD from registered memory");
    ok(cu::cuStreamSynchronize(s), "sync");
    // One entry for the whole 3 MiB (staged, it would be 12 chunks), and
    // one for the statistics call.
    assert!(entries() - before <= 3, "the registered range was copied in place");
    host.iter_mut().for_each(|b| *b = 0);
    // SAFETY: registered destination of `n` bytes.
    ok(unsafe { cu::cuMemcpyDtoHAsync_v2(p.cast(), d, n, s) }, "DtoH into registered memory");
    ok(cu::cuStreamSynchronize(s), "sync");
    assert!(host.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "the round trip through registered memory");
    ok(cu::cuMemHostUnregister(p.cast()), "cuMemHostUnregister");
    assert_eq!(cu::cuMemHostUnregister(p.cast()), CuResult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED as u32);
    host[0] = 7;
    assert!(host[0] == 7 && host[1] == 1, "the buffer is ordinary memory again, contents kept");
}

fn per_thread_default_streams_are_separate_streams() {
    let c = Ctx::new();
    let step = c.func("step");
    let p = c.alloc(4);
    let per_thread = 2usize as H; // CU_STREAM_PER_THREAD
    let (mut pp, mut k) = (p, 3u32);
    ok(launch(step, per_thread, &mut [(&mut pp as *mut u64).cast(), (&mut k as *mut u32).cast()]), "launch");
    ok(cu::cuStreamSynchronize(per_thread), "sync");
    assert_eq!(c.read32(p), 3);
    let ctx = c.ctx as usize;
    let step = step as usize;
    // Another thread's per-thread stream is its own.
    std::thread::spawn(move || {
        let per_thread = 2usize as H;
        ok(cu::cuCtxSetCurrent(ctx as H), "set current");
        let (mut pp, mut k) = (p, 4u32);
        ok(launch(step as H, per_thread, &mut [(&mut pp as *mut u64).cast(), (&mut k as *mut u32).cast()]), "launch");
        ok(cu::cuStreamSynchronize(per_thread), "sync");
    })
    .join()
    .expect("thread");
    assert_eq!(c.read32(p), 3 * 31 + 4);
}

/// A raw connection with a ring whose memory the test writes by hand.
struct RawRing {
    t: ::cuda::transport::UnixTransport,
    base: *mut u8,
    _kick: std::os::fd::OwnedFd,
}

impl RawRing {
    fn attach(sock: &std::path::Path) -> RawRing {
        Self::attach_sized(sock, ring::MIN_SQ)
    }

    fn attach_sized(sock: &std::path::Path, sq: u32) -> RawRing {
        let mut t = ::cuda::transport::UnixTransport::connect(sock.to_str().expect("utf8")).expect("connect");
        // SAFETY: eventfd takes no memory arguments.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(efd >= 0);
        // SAFETY: a fresh descriptor we own.
        let kick = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(efd) };
        let (r, map) = t.attach_ring(sq, &kick, 1).expect("attach");
        assert_eq!(r, Reply::Empty);
        let (base, _) = map.expect("mapping");
        RawRing { t, base, _kick: kick }
    }

    fn u64(&self, off: usize) -> &std::sync::atomic::AtomicU64 {
        // SAFETY: aligned offsets inside the live ring mapping.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.base.add(off).cast()) }
    }

    fn u32(&self, off: usize) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: aligned offsets inside the live ring mapping.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.base.add(off).cast()) }
    }

    fn write(&self, off: usize, b: &[u8]) {
        // SAFETY: inside the mapping (the queue starts at SQ and is at least MIN_SQ long).
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.base.add(off), b.len()) };
    }

    /// Publishes `tail` and wakes the worker the way the shim does.
    fn publish(&self, tail: u64) {
        self.u64(ring::SQ_TAIL).store(tail, std::sync::atomic::Ordering::SeqCst);
        use std::os::fd::AsRawFd;
        let one = 1u64.to_ne_bytes();
        // SAFETY: 8 bytes from a local to our eventfd.
        unsafe { libc::write(self._kick.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Waits until the ring says entry `seq` is complete, failing with
    /// `what` after `within`.
    fn wait_done(&self, seq: u64, within: std::time::Duration, what: &str) {
        let t = std::time::Instant::now();
        while self.u64(ring::done_offset(seq)).load(std::sync::atomic::Ordering::Acquire) < seq {
            assert!(t.elapsed() < within, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn wait_broken(&self) -> bool {
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_secs(10) {
            if self.u32(ring::BROKEN).load(std::sync::atomic::Ordering::Acquire) != 0 {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        false
    }
}

fn entry(seq: u64, reply: u16, req: &Request) -> Vec<u8> {
    let msg = req.encode(seq as u32);
    let len = ring::entry_len(msg.len());
    let mut e = Vec::new();
    ring::EntryHeader { len: len as u32, flags: 0, reply, seq }.put(&mut e);
    e.extend_from_slice(&msg);
    e.resize(len, 0);
    e
}

#[test]
fn a_tenant_that_corrupts_its_ring_breaks_only_that_ring() {
    let m = Mediator::start(&[]);
    let sock = m.tenant("scribbler", "16MiB");
    let other = m.tenant("bystander", "16MiB");
    type Corruption = (&'static str, Box<dyn Fn(&RawRing)>);
    let cases: Vec<Corruption> = vec![
        ("a tail far past the head", Box::new(|r: &RawRing| r.publish(1 << 40))),
        (
            "an entry length that is not aligned",
            Box::new(|r: &RawRing| {
                let mut e = entry(ring::FIRST_SEQ, ring::NO_REPLY, &Request::Ping);
                e[0] = 17;
                r.write(ring::SQ, &e);
                r.publish(e.len() as u64);
            }),
        ),
        (
            "an entry longer than the queue",
            Box::new(|r: &RawRing| {
                let mut e = entry(ring::FIRST_SEQ, ring::NO_REPLY, &Request::Ping);
                e[..4].copy_from_slice(&(ring::MIN_SQ * 2).to_le_bytes());
                r.write(ring::SQ, &e);
                r.publish(e.len() as u64);
            }),
        ),
        (
            "a sequence number out of order",
            Box::new(|r: &RawRing| {
                let e = entry(ring::FIRST_SEQ + 7, ring::NO_REPLY, &Request::Ping);
                r.write(ring::SQ, &e);
                r.publish(e.len() as u64);
            }),
        ),
        (
            "a reply slot that does not exist",
            Box::new(|r: &RawRing| {
                let e = entry(ring::FIRST_SEQ, 999, &Request::Ping);
                r.write(ring::SQ, &e);
                r.publish(e.len() as u64);
            }),
        ),
        (
            "a padding entry in the middle of the queue",
            Box::new(|r: &RawRing| {
                let mut e = entry(ring::FIRST_SEQ, ring::NO_REPLY, &Request::Ping);
                e[4..6].copy_from_slice(&ring::ENTRY_PAD.to_le_bytes());
                r.write(ring::SQ, &e);
                r.publish(e.len() as u64);
            }),
        ),
    ];
    for (what, corrupt) in cases {
        let mut r = RawRing::attach(&sock);
        // A good entry first: answered in its reply slot.
        let e = entry(ring::FIRST_SEQ, 0, &Request::GetDeviceInfo);
        r.write(ring::SQ, &e);
        r.publish(e.len() as u64);
        r.wait_done(ring::FIRST_SEQ, std::time::Duration::from_secs(10), &format!("{what}: the good entry was never completed"));
        // Then the ring is corrupted from a fresh start (as a new ring).
        drop(r);
        r = RawRing::attach(&sock);
        corrupt(&r);
        assert!(r.wait_broken(), "{what}: the worker did not mark the ring broken");
        assert!(r.u32(ring::ERR_COUNT).load(std::sync::atomic::Ordering::Acquire) > 0, "{what}: no error reported");
        // The connection's socket still answers, and other tenants and a
        // new connection of this tenant are served.
        assert!(matches!(r.t_call(Request::Ping), Ok(Reply::Empty)), "{what}: the socket stopped answering");
        assert!(run_ok(sample("vectorAdd", &other)).contains("PASSED"), "{what}");
        assert!(run_ok(sample("vectorAdd", &sock)).contains("PASSED"), "{what}");
    }
    // A bad message in a well-formed entry fails that entry only.
    let r = RawRing::attach(&sock);
    let mut e = entry(ring::FIRST_SEQ, 1, &Request::Ping);
    e[16 + 6] = 0xEE; // opcode
    r.write(ring::SQ, &e);
    let e2 = entry(ring::FIRST_SEQ + 1, 2, &Request::GetDeviceInfo);
    r.write(ring::SQ + e.len(), &e2);
    r.publish((e.len() + e2.len()) as u64);
    r.wait_done(ring::FIRST_SEQ + 1, std::time::Duration::from_secs(10), "the entry after a bad message was not served");
    assert_eq!(r.u32(ring::BROKEN).load(std::sync::atomic::Ordering::Acquire), 0, "a bad message does not break the ring");
    // A stream wait for an entry not yet written is refused, not parked
    // forever (waits never form a cycle).
    let before = r.u32(ring::ERR_COUNT).load(std::sync::atomic::Ordering::Acquire);
    let w = entry(ring::FIRST_SEQ + 2, ring::NO_REPLY, &Request::StreamWait(StreamWaitReq { ctx: 1, stream: 0, seq: ring::FIRST_SEQ + 1000 }));
    let at = (e.len() + e2.len()) as u64;
    r.write(ring::SQ + at as usize, &w);
    r.publish(at + w.len() as u64);
    r.wait_done(ring::FIRST_SEQ + 2, std::time::Duration::from_secs(10), "the forward wait was never completed");
    assert!(r.u32(ring::ERR_COUNT).load(std::sync::atomic::Ordering::Acquire) > before, "the forward wait was reported as an error");
    let mut status = [0u8; 4];
    // SAFETY: inside the reply area of the mapping.
    unsafe { std::ptr::copy_nonoverlapping(r.base.add(ring::reply_offset(1) + 12), status.as_mut_ptr(), 4) };
    assert_eq!(u32::from_le_bytes(status), CuResult::CUDA_ERROR_INVALID_VALUE as u32, "the bad message got an error reply");
}

/// A tenant that makes its ring's kick blocking and empties it itself
/// (the eventfd's open file is the worker's too) stalls no other client of
/// a shared worker: the worker never reads it. A kick that is not an
/// eventfd is refused.
#[test]
fn a_tenant_that_drains_its_own_kick_stalls_no_other_client() {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    let m = Mediator::start(&["--isolation", "shared"]);
    let sock = m.tenant("drainer", "16MiB");
    let other = m.tenant("bystander", "16MiB");
    let r = RawRing::attach(&sock);
    let kick = r._kick.try_clone().expect("dup");
    // SAFETY: F_SETFL on our own eventfd: blocking again, for the worker too.
    assert_eq!(unsafe { libc::fcntl(kick.as_raw_fd(), libc::F_SETFL, 0) }, 0);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let kicks = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    // The tenant kicks and empties the eventfd itself, and ends on a read
    // of its own: before the fix, the worker's read that lost the race
    // then waited for a write that never came. Its own read that loses
    // is let go by a second writer. Neither thread is joined.
    let (k, s2, d2, n2) = (kick.try_clone().expect("dup"), stop.clone(), done.clone(), kicks.clone());
    std::thread::spawn(move || {
        let one = 1u64.to_ne_bytes();
        let mut b = [0u8; 8];
        loop {
            // SAFETY: 8 bytes between locals and our own eventfd.
            unsafe {
                libc::write(k.as_raw_fd(), one.as_ptr().cast(), 8);
                libc::read(k.as_raw_fd(), b.as_mut_ptr().cast(), 8);
            }
            n2.fetch_add(1, Ordering::Relaxed);
            if s2.load(Ordering::Relaxed) {
                break;
            }
        }
        d2.store(true, Ordering::Release);
    });
    let n3 = kicks.clone();
    let d3 = done.clone();
    std::thread::spawn(move || {
        let one = 1u64.to_ne_bytes();
        let mut last = u64::MAX;
        while !d3.load(Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let now = n3.load(Ordering::Relaxed);
            if now == last {
                // SAFETY: 8 bytes from a local to our own eventfd.
                unsafe { libc::write(kick.as_raw_fd(), one.as_ptr().cast(), 8) };
            }
            last = now;
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let t0 = std::time::Instant::now();
    while !done.load(Ordering::Acquire) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the tenant's kicking thread ended");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(kicks.load(Ordering::Relaxed) > 100, "the tenant kicked {} times", kicks.load(Ordering::Relaxed));
    // Bounded: a stalled worker would leave them waiting for ever.
    let within = |c: std::process::Command| {
        let mut t = std::process::Command::new("timeout");
        t.arg("60").arg(c.get_program()).args(c.get_args());
        for (k, v) in c.get_envs() {
            if let Some(v) = v {
                t.env(k, v);
            }
        }
        t
    };
    assert!(run_ok(within(sample("vectorAdd", &other))).contains("PASSED"), "the bystander is served after the tenant drained its kick");
    assert!(run_ok(within(sample("vectorAdd", &sock))).contains("PASSED"), "the tenant's own new connections are served");
    // A pipe is not an eventfd.
    let mut fds = [0; 2];
    // SAFETY: pipe writes two descriptors into the local array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fresh descriptors we own.
    let (rd, _wr) = unsafe { (<std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[0]), <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[1])) };
    let mut t = ::cuda::transport::UnixTransport::connect(sock.to_str().expect("utf8")).expect("connect");
    let (reply, map) = t.attach_ring(ring::MIN_SQ, &rd, 1).expect("attach");
    assert!(matches!(&reply, Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, why) if why.contains("eventfd")), "{reply:?}");
    assert!(map.is_none());
}

impl RawRing {
    fn t_call(&mut self, req: Request) -> Result<Reply, ::cuda::transport::TransportError> {
        use ::cuda::transport::Transport;
        self.t.call(&req, 77)
    }

    /// A context and the `busy` kernel ([`BUSY`]) loaded in it.
    fn busy(&mut self) -> (u32, u32) {
        let handle = |rep: Result<Reply, ::cuda::transport::TransportError>| match rep {
            Ok(Reply::Handle(h)) => h,
            other => panic!("{other:?}"),
        };
        let ctx = handle(self.t_call(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
        let img = BUSY.as_bytes().to_vec();
        let module = handle(self.t_call(Request::ModuleLoad(ModuleLoadReq { ctx, format: 0, image_len: img.len() as u64 }, img)));
        match self.t_call(Request::ModuleGetFunction(GetFunctionReq { ctx, module, name_len: 4, reserved: 0 }, "busy".into())) {
            Ok(Reply::Function(f, _)) => (ctx, f.func),
            other => panic!("{other:?}"),
        }
    }
}

const BUSY: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry busy(.param .u32 n)\n{\n    .reg .u32 %r<2>;\n    .reg .pred %p<1>;\n    ld.param.u32 %r0, [n];\n    mov.u32 %r1, 0;\nL:\n    add.u32 %r1, %r1, 1;\n    setp.lt.u32 %p0, %r1, %r0;\n    @%p0 bra L;\n    ret;\n}\n";

/// One tenant queues long kernels on more streams than the device has
/// lanes; another tenant's calls through its ring are still served while
/// they run (the engine keeps a thread for rings and bounded work).
#[test]
fn a_tenants_long_kernels_do_not_stop_another_tenants_ring() {
    use ::cuda::client::Client;
    let m = Mediator::start(&[]);
    let a_sock = m.tenant("flooder", "16MiB");
    let b_sock = m.tenant("neighbour", "16MiB");
    let a = Client::connect_unix(a_sock.to_str().expect("utf8")).expect("connect");
    assert!(a.ring().is_some());
    let ctx = a.handle(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })).expect("ctx");
    let img = BUSY.as_bytes().to_vec();
    let module = a.handle(Request::ModuleLoad(ModuleLoadReq { ctx, format: 0, image_len: img.len() as u64 }, img)).expect("module");
    let func = match a.call(Request::ModuleGetFunction(GetFunctionReq { ctx, module, name_len: 4, reserved: 0 }, "busy".into())).expect("function") {
        Reply::Function(f, _) => f.func,
        r => panic!("{r:?}"),
    };
    let lanes = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut last = Vec::new();
    for _ in 0..lanes + 2 {
        let stream = a.handle(Request::StreamCreate(ObjCreateReq { ctx, flags: 1 })).expect("stream");
        let launch = LaunchReq { ctx, func, stream, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 4, reserved: 0 };
        last.push(a.enqueue(Request::LaunchKernel(launch, 60_000_000u32.to_le_bytes().to_vec())).expect("launch"));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    let b = Client::connect_unix(b_sock.to_str().expect("utf8")).expect("connect");
    for _ in 0..100 {
        assert_eq!(b.call(Request::Ping).expect("ping"), Reply::Empty);
    }
    let bctx = b.handle(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })).expect("ctx");
    assert!(matches!(b.call(Request::MemAlloc(MemAllocReq { ctx: bctx, reserved: 0, size: 4096 })), Ok(Reply::Ptr(_))));
    assert!(last.iter().all(|s| !a.is_done(*s)), "the neighbour was served before any of the flooder's kernels ended");
    for s in last {
        a.wait(s).expect("the flooder's kernels finish");
    }
}

/// Entry s reuses the completion slot of entry s - ENTRY_SLOTS, so a
/// tenant may write it only once that one is complete (the shim waits for
/// it). A ring that runs ahead is broken, and the slot of the entry still
/// running never says it is done.
#[test]
fn an_entry_that_would_take_a_running_entrys_completion_slot_breaks_the_ring() {
    let m = Mediator::start(&["--instruction-budget", "0"]);
    let sock = m.tenant("lapper", "16MiB");
    let mut r = RawRing::attach_sized(&sock, ring::DEFAULT_SQ);
    let (ctx, func) = r.busy();
    // A long kernel, then ENTRY_SLOTS pings: the last one's slot is the
    // kernel's.
    let launch = LaunchReq { ctx, func, stream: 0, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 4, reserved: 0 };
    let mut q = entry(ring::FIRST_SEQ, ring::NO_REPLY, &Request::LaunchKernel(launch, 60_000_000u32.to_le_bytes().to_vec()));
    for i in 1..=ring::ENTRY_SLOTS {
        q.extend_from_slice(&entry(ring::FIRST_SEQ + i, ring::NO_REPLY, &Request::Ping));
    }
    assert!(q.len() <= ring::DEFAULT_SQ as usize);
    r.write(ring::SQ, &q);
    r.publish(q.len() as u64);
    assert!(r.wait_broken(), "the entry that ran a whole lap ahead was taken");
    let slot = r.u64(ring::done_offset(ring::FIRST_SEQ)).load(std::sync::atomic::Ordering::Acquire);
    assert!(slot <= ring::FIRST_SEQ, "the running kernel's completion slot says {slot}");
    assert!(matches!(r.t_call(Request::Ping), Ok(Reply::Empty)), "the socket still answers");
}

/// A long kernel sent on a connection's socket runs without holding the
/// connection: the connection's own ring is served meanwhile (in a shared
/// worker, every ring so held would also hold an engine thread that other
/// tenants' rings need).
#[test]
fn a_long_kernel_on_the_socket_does_not_hold_up_the_connections_ring() {
    use std::io::{Read, Write};
    let m = Mediator::start(&["--instruction-budget", "0"]);
    let sock = m.tenant("both", "16MiB");
    let mut r = RawRing::attach(&sock);
    let (ctx, func) = r.busy();
    let mut s = std::os::unix::net::UnixStream::from(r.t.socket_clone().expect("the connection's socket"));
    let launch = LaunchReq { ctx, func, stream: 0, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 4, reserved: 0 };
    s.write_all(&Request::LaunchKernel(launch, 150_000_000u32.to_le_bytes().to_vec()).encode(90)).expect("send the launch");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let e = entry(ring::FIRST_SEQ, 0, &Request::GetDeviceInfo);
    r.write(ring::SQ, &e);
    r.publish(e.len() as u64);
    r.wait_done(ring::FIRST_SEQ, std::time::Duration::from_secs(60), "the ring entry was never served");
    let mut b = [0u8; 1];
    // SAFETY: a non-blocking peek into a local byte.
    let waiting = unsafe { libc::recv(std::os::fd::AsRawFd::as_raw_fd(&s), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    assert!(waiting < 0, "the ring entry was served only once the socket's kernel had ended");
    // The kernel's reply comes in the end.
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).expect("timeout");
    s.read_exact(&mut b).expect("the launch's reply");
}
