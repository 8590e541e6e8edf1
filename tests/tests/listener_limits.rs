//! The mediator's HTTP listeners cannot be used to exhaust its descriptors
//! (docs/threat-model.md, "idle HTTP connections"): idle connections to the
//! metrics listener once took every descriptor the daemon had, and its
//! admin socket stopped answering. Now the metrics listener serves a capped
//! number of connections, well under the descriptor limit, closing the
//! rest at once, and closes connections that send no request, half a
//! request, or nothing more after an answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vgpu_tests::Mediator;

/// A port nothing listens on now, on 127.0.0.1.
fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local address")
}

/// `GET /tenants` on the admin socket: the response, or why none came
/// within `within`.
fn admin_tenants(m: &Mediator, within: Duration) -> Result<String, String> {
    let mut s = UnixStream::connect(m.api_path()).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(within)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(within)).map_err(|e| e.to_string())?;
    s.write_all(b"GET /tenants HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").map_err(|e| format!("send: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| format!("no answer within {within:?}: {e}"))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Reads until the server closes `s`: how long that took and what came
/// first, or None if it is still open after `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<(Duration, Vec<u8>)> {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        let left = within.checked_sub(t0.elapsed()).filter(|d| !d.is_zero())?;
        s.set_read_timeout(Some(left)).expect("read timeout");
        match s.read(&mut buf) {
            Ok(0) => return Some((t0.elapsed(), got)),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted) => return Some((t0.elapsed(), got)),
            Err(_) => return None,
        }
    }
}

/// Whether the server has closed `s` already (EOF or reset), not waiting.
fn closed_now(s: &TcpStream) -> bool {
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

fn scrape(addr: &SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(addr, Duration::from_secs(2)).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let (_, got) = closed_within(&mut s, Duration::from_secs(5))?;
    Some(String::from_utf8_lossy(&got).into_owned())
}

/// The reported attack, scaled down: with 128 descriptors, 300 idle TCP
/// connections to the metrics port. The daemon used to take them all until
/// `accept` failed with EMFILE, and then `GET /tenants` on the admin socket
/// went unanswered.
#[test]
fn idle_metrics_connections_cannot_starve_the_admin_socket() {
    const IDLE: usize = 300;
    let addr = free_addr();
    let m = Mediator::start_limited(&["--device-memory", "64MiB", "--metrics-listen", &addr.to_string()], 128);
    m.tenant("watched", "16MiB");
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while held.len() < IDLE && Instant::now() < deadline {
        // The old daemon's backlog filled up once it could take no more.
        let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else { break };
        held.push(s);
    }
    assert!(held.len() > 200, "only {} connections could be made", held.len());
    // Time for the daemon to take what it will from the backlog.
    std::thread::sleep(Duration::from_millis(1500));
    let r = admin_tenants(&m, Duration::from_secs(5)).unwrap_or_else(|e| panic!("the admin socket did not answer GET /tenants with {} idle metrics connections open: {e}", held.len()));
    assert!(r.starts_with("HTTP/1.1 200") && r.contains("\"watched\""), "{r}");
    // The connections over the cap were closed at once, not kept.
    let open = held.iter().filter(|s| !closed_now(s)).count();
    assert!(open <= 32, "{open} of {} idle metrics connections are still open", held.len());
    // Once they go, Prometheus is served again.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if scrape(&addr).is_some_and(|r| r.starts_with("HTTP/1.1 200") && r.contains("vgpu_tenant_memory_quota_bytes{tenant=\"watched\"")) {
            break;
        }
        assert!(Instant::now() < deadline, "the metrics listener did not serve again");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A connection that sends nothing, half a request head, a head a byte at
/// a time, half a body, or nothing after its answer is closed after the
/// configured (here short) timeouts.
#[test]
fn idle_and_half_sent_metrics_connections_are_closed_after_the_timeout() {
    let addr = free_addr();
    let dir = std::env::temp_dir().join(format!("vgpu-listener-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("config dir");
    let config = dir.join("mediator.toml");
    let header = Duration::from_millis(1000);
    std::fs::write(&config, format!("[metering]\nmetrics_listen = \"{addr}\"\nmetrics_header_timeout_ms = 1000\nmetrics_idle_timeout_ms = 1000\n")).expect("config");
    let m = Mediator::start(&["--device-memory", "64MiB", "--config", config.to_str().expect("path")]);
    let connect = || {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect to the metrics listener");
        s.set_write_timeout(Some(Duration::from_secs(5))).expect("write timeout");
        s
    };
    let bound = Duration::from_secs(6);

    let mut silent = connect();
    let mut half_head = connect();
    half_head.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").expect("send");
    let mut half_body = connect();
    half_body.write_all(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789").expect("send");
    let mut keep_alive = connect();
    keep_alive.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");

    let (t, _) = closed_within(&mut silent, bound).expect("a connection that sent nothing is still open");
    assert!(t >= header / 2, "closed after {t:?}, before the timeout");
    closed_within(&mut half_head, bound).expect("a connection that sent half a request head is still open");
    closed_within(&mut half_body, bound).expect("a connection that sent half a request body is still open");
    let (_, got) = closed_within(&mut keep_alive, bound).expect("an idle keep-alive connection is still open");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200") && got.contains("vgpu_"), "{got}");

    // A head sent a byte every 100 ms: bytes keep moving, but it never ends.
    let mut trickle = connect();
    trickle.write_all(b"GET /metrics HTTP/1.1\r\n").expect("send");
    let t0 = Instant::now();
    let mut closed = false;
    while !closed && t0.elapsed() < bound {
        closed = closed_now(&trickle) || trickle.write_all(b"X").is_err();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed, "a head sent a byte at a time kept its connection for {:?}", t0.elapsed());

    // Scrapes are served as before.
    let r = scrape(&addr).expect("a scrape was not answered");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    drop(m);
    let _ = std::fs::remove_dir_all(&dir);
}
