//! The limits against a live server on a unix socket, with short timeouts
//! and std clients.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use axum::extract::Query;
use axum::routing::{get, post};

use super::*;

static N: AtomicU32 = AtomicU32::new(0);

/// A server on a socket of its own, on its own thread and runtime.
struct Server {
    path: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: std::sync::mpsc::Receiver<()>,
}

#[derive(serde::Deserialize)]
struct Ms {
    ms: u64,
}

fn router() -> Router {
    Router::new()
        .route("/hello", get(|| async { "hello" }))
        .route("/echo", post(|body: String| async move { body }))
        .route(
            "/slow",
            get(|Query(q): Query<Ms>| async move {
                tokio::time::sleep(Duration::from_millis(q.ms)).await;
                "done"
            }),
        )
        .route("/big", get(|| async { vec![b'x'; 8 << 20] }))
}

impl Server {
    fn start(limits: Limits) -> Server {
        let path = std::env::temp_dir().join(format!("vgpu-api-serve-{}-{}.sock", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_file(&path);
        let l = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        l.set_nonblocking(true).expect("nonblocking");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                let l = tokio::net::UnixListener::from_std(l).expect("listener");
                serve(l, router(), limits, async {
                    let _ = stopped.await;
                })
                .await;
            });
            let _ = done_tx.send(());
        });
        Server { path, stop: Some(stop), done }
    }

    fn connect(&self) -> UnixStream {
        let s = UnixStream::connect(&self.path).expect("connect");
        s.set_write_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s
    }

    /// Asks the server to stop; whether `serve` returned within `within`.
    fn shut_down(&mut self, within: Duration) -> bool {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.done.recv_timeout(within).is_ok()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Reads until the server closes `s`: how long that took and what came
/// first, or None if it is still open after `within`.
fn closed_within(s: &mut UnixStream, within: Duration) -> Option<(Duration, Vec<u8>)> {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        let left = within.checked_sub(t0.elapsed()).filter(|d| !d.is_zero())?;
        s.set_read_timeout(Some(left)).expect("timeout");
        match s.read(&mut buf) {
            Ok(0) => return Some((t0.elapsed(), got)),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::BrokenPipe) => return Some((t0.elapsed(), got)),
            Err(_) => return None,
        }
    }
}

/// One request on a fresh connection, answered within a few seconds.
fn get_once(srv: &Server, path: &str) -> Option<String> {
    let mut s = UnixStream::connect(&srv.path).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).ok()?;
    let (_, out) = closed_within(&mut s, Duration::from_secs(5))?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

const LONG: Duration = Duration::from_secs(30);

#[test]
fn connections_over_the_cap_are_closed_at_once_and_their_slots_come_back() {
    let srv = Server::start(Limits { max_connections: 2, header_timeout: LONG, idle_timeout: LONG });
    let mut a = srv.connect();
    let mut b = srv.connect();
    // Both are served: a request on each is answered.
    for s in [&mut a, &mut b] {
        s.write_all(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
        let mut buf = [0u8; 256];
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let n = s.read(&mut buf).expect("answer");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    }
    // A third is closed at once, unanswered.
    let mut c = srv.connect();
    let (t, got) = closed_within(&mut c, Duration::from_secs(2)).expect("the connection over the cap was kept");
    assert!(got.is_empty() && t < Duration::from_secs(1), "{t:?} {got:?}");
    // A slot comes back when a connection ends.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if get_once(&srv, "/hello").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            break;
        }
        assert!(Instant::now() < deadline, "no slot came back after a connection closed");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(b);
}

#[test]
fn silent_trickling_and_idle_keep_alive_connections_close_after_the_header_timeout() {
    let header = Duration::from_millis(300);
    let srv = Server::start(Limits { max_connections: 8, header_timeout: header, idle_timeout: LONG });
    // Silent.
    let mut silent = srv.connect();
    let (t, _) = closed_within(&mut silent, Duration::from_secs(5)).expect("a silent connection was kept");
    assert!(t >= header / 2, "closed after {t:?}, before the timeout");
    // Half a head, then a byte every 50 ms: bytes move, but the head
    // never ends.
    let mut trickle = srv.connect();
    trickle.write_all(b"GET /hello HTTP/1.1\r\nHost: x\r\n").expect("send");
    trickle.set_nonblocking(true).expect("nonblocking");
    let t0 = Instant::now();
    let mut closed = false;
    while t0.elapsed() < Duration::from_secs(5) {
        let mut buf = [0u8; 512];
        match trickle.read(&mut buf) {
            Ok(0) => closed = true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => closed = true,
        }
        if closed || trickle.write(b"X").is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(closed, "a trickled head kept its connection for {:?}", t0.elapsed());
    // Keep-alive: answered, then closed once no next request comes.
    let mut ka = srv.connect();
    ka.write_all(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    let (t, got) = closed_within(&mut ka, Duration::from_secs(5)).expect("an idle keep-alive connection was kept");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200") && got.ends_with("hello"), "{got}");
    assert!(t >= header / 2, "closed after {t:?}, before the timeout");
}

#[test]
fn a_stalled_body_or_an_unread_response_closes_after_the_idle_timeout() {
    let idle = Duration::from_millis(300);
    let srv = Server::start(Limits { max_connections: 8, header_timeout: LONG, idle_timeout: idle });
    // 10 of 100 body bytes, to a handler that reads the body.
    let mut body = srv.connect();
    body.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789").expect("send");
    let (t, got) = closed_within(&mut body, Duration::from_secs(5)).expect("a half-sent body kept its connection");
    assert!(t >= idle / 2 && got.is_empty(), "{t:?} {}", String::from_utf8_lossy(&got));
    // 8 MiB the client does not read: the server gives up on it.
    let mut big = srv.connect();
    big.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    std::thread::sleep(idle * 5);
    let (_, got) = closed_within(&mut big, Duration::from_secs(10)).expect("an unread response kept its connection");
    assert!(got.len() < 8 << 20, "the whole response came: the connection was kept");
    // A complete body is answered.
    let mut ok = srv.connect();
    ok.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello").expect("send");
    let (_, got) = closed_within(&mut ok, Duration::from_secs(5)).expect("answer");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200") && got.ends_with("hello"), "{got}");
}

#[test]
fn a_working_handler_is_not_cut_off_by_the_idle_timeout() {
    let srv = Server::start(Limits { max_connections: 8, header_timeout: LONG, idle_timeout: Duration::from_millis(200) });
    let r = get_once(&srv, "/slow?ms=1200").expect("no answer");
    assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("done"), "{r}");
}

#[test]
fn shutdown_closes_idle_connections_and_lets_a_request_finish() {
    let mut srv = Server::start(Limits::with_connections(8));
    let mut idle = srv.connect();
    let mut slow = srv.connect();
    slow.write_all(b"GET /slow?ms=500 HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    std::thread::sleep(Duration::from_millis(100));
    assert!(srv.shut_down(Duration::from_secs(5)), "serve did not return");
    assert!(closed_within(&mut idle, Duration::from_secs(1)).is_some(), "the idle connection was kept");
    let (_, got) = closed_within(&mut slow, Duration::from_secs(1)).expect("the working connection was kept");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200") && got.ends_with("done"), "{got}");
    assert!(UnixStream::connect(&srv.path).is_err(), "still accepting after shutdown");
}

#[test]
fn a_listener_takes_at_most_an_eighth_of_the_descriptor_limit() {
    let l = Limits::with_connections(64);
    assert_eq!(l.within_fd_limit(1 << 20).max_connections, 64);
    assert_eq!(l.within_fd_limit(1024).max_connections, 64);
    assert_eq!(l.within_fd_limit(128).max_connections, 16);
    assert_eq!(l.within_fd_limit(4).max_connections, 1);
    assert_eq!(l.within_fd_limit(u64::MAX).max_connections, 64);
    assert_eq!(l.within_fd_limit(128).header_timeout, HEADER_TIMEOUT);
}
