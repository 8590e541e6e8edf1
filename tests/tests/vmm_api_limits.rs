//! The VM's API socket cannot be held by idle clients (docs/threat-model.md,
//! "idle HTTP connections"): connections over its cap are closed at once,
//! silent and half-sent ones after the header timeout, and then the API
//! answers again. Runs under the VMM's seccomp lists, so the server's
//! system calls are on the API thread's.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vgpu_tests::vmm_harness::*;

/// Whether the VMM has closed `s` already (EOF or reset), not waiting.
fn closed_now(s: &UnixStream) -> bool {
    s.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 1024];
    let r = match (&mut &*s).read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    s.set_nonblocking(false).expect("blocking");
    r
}

#[test]
fn the_vm_api_socket_caps_connections_and_closes_idle_ones() {
    if !kvm_available("the_vm_api_socket_caps_connections_and_closes_idle_ones") {
        return;
    }
    let mut g = Guest::start("count", &[]);
    g.wait_api();
    g.wait_for("tick 1", Duration::from_secs(60));
    let limits = vmm::api::API_LIMITS;
    let extra = 24;
    let held: Vec<UnixStream> = (0..limits.max_connections + extra).map(|_| UnixStream::connect(&g.api).expect("connect to the VM's API socket")).collect();
    let t0 = Instant::now();
    held[0].try_clone().expect("clone").write_all(b"GET /vm HTTP/1.1\r\nHost: x\r\n").expect("send half a head");
    std::thread::sleep(Duration::from_millis(500));
    let closed = held.iter().filter(|s| closed_now(s)).count();
    assert!(closed >= extra, "only {closed} of {} connections were closed at once (cap {})", held.len(), limits.max_connections);
    // Those kept go after the header timeout, and the API answers again.
    let deadline = t0 + limits.header_timeout + Duration::from_secs(10);
    while !held.iter().all(closed_now) {
        assert!(Instant::now() < deadline, "idle API connections still open after {:?}", t0.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(t0.elapsed() >= limits.header_timeout / 2, "closed after {:?}, before the header timeout", t0.elapsed());
    let (code, body) = g.api_call("GET", "/vm");
    assert_eq!(code, 200, "{body}");
    assert_eq!(g.api_call("PUT", "/vm/kill").0, 204);
    let (st, err, _) = g.wait_exit(Duration::from_secs(10));
    assert_eq!(st.code(), Some(4), "{err}");
}
