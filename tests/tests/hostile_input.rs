//! Must-show 5: garbage, truncated messages, huge lengths and bad handles on
//! one tenant's socket get error replies or a disconnect of that client;
//! the daemon keeps serving the other tenant throughout.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use vgpu_tests::*;
use virtio_gpu_compute::*;
use vmm_sys_util_shim::send_with_fd;

mod vmm_sys_util_shim {
    use std::os::unix::net::UnixStream;
    /// Sends `buf` with one fd attached (SCM_RIGHTS).
    pub fn send_with_fd(s: &UnixStream, buf: &[u8], fd: i32) {
        use std::os::fd::AsRawFd;
        let mut iov = libc::iovec { iov_base: buf.as_ptr() as *mut _, iov_len: buf.len() };
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(4) } as usize;
        let mut cbuf = vec![0u8; space];
        // SAFETY: zeroed msghdr is a valid initial value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg points at a control buffer large enough for one fd.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), fd);
            assert!(libc::sendmsg(s.as_raw_fd(), &msg, 0) >= 0);
        }
    }
}

fn expect_error(r: Reply, code: CuResult) {
    match r {
        Reply::Error(c, _) => assert_eq!(c, code),
        other => panic!("expected {code}, got {other:?}"),
    }
}

#[test]
fn hostile_client_gets_errors_while_the_other_tenant_is_served() {
    let m = Mediator::start(&[]);
    let evil = m.tenant("evil", "16MiB");
    let good = m.tenant("good", "64MiB");
    let victim = std::thread::spawn({
        let good = good.clone();
        move || {
            for _ in 0..3 {
                assert!(run_ok(sample("reduction", &good)).contains("PASSED"));
            }
        }
    });

    // Garbage: an error reply for the header, then a disconnect.
    let mut r = Raw::connect(&evil);
    r.send_bytes(&[0xde; 100]).expect("send");
    match r.read_reply() {
        Some((_, Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, msg))) => assert!(msg.contains("magic"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert!(r.read_reply().is_none(), "connection should close after a bad header");

    // Huge stated length: refused from the header alone.
    let mut r = Raw::connect(&evil);
    let mut h = Vec::new();
    MsgHeader { magic: MAGIC, version: VERSION, opcode: Opcode::ModuleLoad as u16, seq: 1, status: 0, payload_len: u32::MAX, reserved: 0 }.put(&mut h);
    r.send_bytes(&h).expect("send");
    assert!(matches!(r.read_reply(), Some((_, Reply::Error(..)))));
    assert!(r.read_reply().is_none());

    // Truncated: a header promising more than arrives, then EOF.
    let mut r = Raw::connect(&evil);
    let msg = Request::MemAlloc(MemAllocReq { ctx: 1, reserved: 0, size: 64 }).encode(1);
    r.send_bytes(&msg[..msg.len() - 3]).expect("send");
    r.s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    assert!(r.read_reply().is_none());

    // Well-framed but invalid bodies: error replies, and the connection lives on.
    let mut r = Raw::connect(&evil);
    let mut bad_body = Request::LaunchKernel(LaunchReq { ctx: 1, func: 1, stream: 0, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 0, reserved: 0 }, vec![]).encode(2);
    bad_body[MsgHeader::SIZE + 16] = 0; // grid.x = 0
    r.send_bytes(&bad_body).expect("send");
    assert!(matches!(r.read_reply(), Some((_, Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, _)))));
    assert!(r.ping());

    // Bad handles of every kind.
    expect_error(r.call(Request::MemFree(MemFreeReq { ctx: 77, reserved: 0, dptr: 0x7000_0000_0000 })), CuResult::CUDA_ERROR_INVALID_CONTEXT);
    let ctx = match r.call(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })) {
        Reply::Handle(h) => h,
        o => panic!("{o:?}"),
    };
    expect_error(r.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: u64::MAX })), CuResult::CUDA_ERROR_OUT_OF_MEMORY);
    expect_error(r.call(Request::MemFree(MemFreeReq { ctx, reserved: 0, dptr: 0xdead_beef })), CuResult::CUDA_ERROR_INVALID_VALUE);
    expect_error(r.call(Request::ModuleUnload(ModuleReq { ctx, module: 999 })), CuResult::CUDA_ERROR_INVALID_HANDLE);
    let n = "x".to_string();
    expect_error(r.call(Request::ModuleGetFunction(GetFunctionReq { ctx, module: 5, name_len: 1, reserved: 0 }, n)), CuResult::CUDA_ERROR_INVALID_HANDLE);
    let l = LaunchReq { ctx, func: 12345, stream: 0, shared_bytes: 0, grid: [1; 3], block: [1; 3], params_len: 0, reserved: 0 };
    expect_error(r.call(Request::LaunchKernel(l, vec![])), CuResult::CUDA_ERROR_INVALID_HANDLE);
    expect_error(r.call(Request::StreamDestroy(HandleReq { ctx, handle: 4242 })), CuResult::CUDA_ERROR_INVALID_HANDLE);
    expect_error(r.call(Request::EventElapsedTime(EventElapsedReq { ctx, start: 1, end: 2, reserved: 0 })), CuResult::CUDA_ERROR_INVALID_HANDLE);
    let dtoh = MemcpyDtoHReq { ctx, stream: 0, src: 0x7000_0000_0000, size: 1 << 30, loc: DataLoc::Shared as u32, blob: 0, shm_offset: 0 };
    expect_error(r.call(Request::MemcpyDtoH(dtoh)), CuResult::CUDA_ERROR_INVALID_VALUE);
    expect_error(r.call(Request::RegisterShm(RegisterShmReq { size: 4096, id: 0, flags: 0 })), CuResult::CUDA_ERROR_INVALID_VALUE);

    // A shared buffer that could shrink under the worker is refused.
    // SAFETY: memfd_create with a static name; the fd is owned below.
    let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0);
    // SAFETY: fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: resizing our own memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 20) }, 0);
    send_with_fd(&r.s, &Request::RegisterShm(RegisterShmReq { size: 1 << 20, id: 0, flags: 0 }).encode(50), fd.as_raw_fd());
    match r.read_reply() {
        Some((_, Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, msg))) => assert!(msg.contains("F_SEAL_SHRINK"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert!(r.ping());

    // So is a sealed hugetlbfs memfd: a hole punched in it would fault the
    // worker once huge pages run out.
    // SAFETY: memfd_create with a static name; the fd is owned below.
    let raw = unsafe { libc::memfd_create(c"huge".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        report_skip("hostile_input: a hugetlbfs memfd", &format!("this kernel makes none: {}", std::io::Error::last_os_error()));
    } else {
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // A size of whole huge pages (the default size need not be 2 MiB).
        // SAFETY: an all-zero statfs is a valid value for fstatfs to fill.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: fstatfs writes only into `st`.
        assert_eq!(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) }, 0);
        let huge = (st.f_bsize as i64).max(1 << 21);
        // SAFETY: resizing and sealing our own memfd.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), huge), 0, "{}", std::io::Error::last_os_error());
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
        }
        send_with_fd(&r.s, &Request::RegisterShm(RegisterShmReq { size: huge as u64, id: 0, flags: 0 }).encode(51), fd.as_raw_fd());
        match r.read_reply() {
            Some((_, Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, msg))) => assert!(msg.contains("MFD_HUGETLB"), "{msg}"),
            other => panic!("{other:?}"),
        }
        assert!(r.ping());
    }

    // Random well-framed messages: every one answered, nothing dies.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..3000u32 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let op = (seed % 28) as u16;
        let len = ((seed >> 8) % 96) as usize;
        let mut msg = Vec::new();
        MsgHeader { magic: MAGIC, version: VERSION, opcode: op, seq: i, status: 0, payload_len: len as u32, reserved: 0 }.put(&mut msg);
        msg.extend((0..len).map(|k| (seed >> (k % 56)) as u8));
        if r.send_bytes(&msg).is_err() || r.read_reply().is_none() {
            // Unknown opcodes break framing: the client is dropped; reconnect.
            r = Raw::connect(&evil);
        }
    }
    assert!(r.ping());

    victim.join().expect("the good tenant kept working");
    assert_eq!(m.device("cpu0")["worker_restarts"], 0, "the worker must not have crashed");
}

#[test]
fn a_tenant_cannot_flood_the_log() {
    // One warning per malformed connection used to reach the log, with no
    // limit: a tenant could fill the host's disk or drown other events.
    let log = std::env::temp_dir().join(format!("vgpu-flood-{}.log", std::process::id()));
    let m = Mediator::start_logging(&[], &log);
    let evil = m.tenant("flood", "16MiB");
    for _ in 0..1000 {
        let mut r = Raw::connect(&evil);
        r.send_bytes(&[0xde; 32]).expect("send");
        let _ = r.read_reply();
    }
    let good = m.tenant("calm", "16MiB");
    assert!(Raw::connect(&good).ping());
    drop(m);
    let text = std::fs::read_to_string(&log).expect("log");
    let _ = std::fs::remove_file(&log);
    let bad = text.lines().filter(|l| l.contains("bad header")).count();
    // 20 per 10 s window; the loop above takes well under a minute.
    assert!(bad > 0 && bad <= 20 * 7, "{bad} warnings for 1000 bad connections");
}
