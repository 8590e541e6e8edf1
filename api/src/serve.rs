//! Serving a router so that clients cannot exhaust the daemon: what both
//! `vgpu-mediatord` (its API socket and metrics listener) and `vgpu-vmm`
//! (its API socket) serve their axum routers with, in place of
//! `axum::serve`, which takes every connection and keeps it for as long as
//! the client likes (docs/threat-model.md, "idle HTTP connections").
//!
//! Per listener:
//!
//! - at most [`Limits::max_connections`] connections are served at once;
//!   one over that is accepted and closed at once, unanswered, so the
//!   descriptors a listener holds stay bounded and the kernel's backlog
//!   never fills with connections waiting for a slot;
//! - a request's head must arrive within [`Limits::header_timeout`] of the
//!   connection opening or of the previous response (hyper's header read
//!   timeout), which closes silent, trickling and idle keep-alive
//!   connections;
//! - a connection that moves no byte either way for
//!   [`Limits::idle_timeout`] while the server waits on its client (no
//!   request being handled, or a handler waiting for request body bytes)
//!   is closed: a half-sent body, a response the client does not read. A
//!   handler that is working is never cut off.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::serve::Listener;
use axum::Router;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

/// Default [`Limits::header_timeout`]: a request head is a few hundred
/// bytes, which any live client sends in well under this.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Default [`Limits::idle_timeout`]: longer than the header timeout, so a
/// slow but moving transfer (a large `/metrics` or `/usage` answer) is not
/// cut, yet a stalled one lets its slot go within half a minute.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The share of the process's descriptor limit one listener may hold at
/// most: [`Limits::within_fd_limit`] keeps `max_connections` at or under
/// the limit divided by this, so two listeners together take at most a
/// quarter and the rest is left to what else the daemon holds.
pub const FD_LIMIT_SHARE: u64 = 8;

/// How often an over-the-cap refusal is logged at most.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// What one listener allows its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (at least 1); more are closed at accept.
    pub max_connections: usize,
    /// The time a request's head may take to arrive, counted from the
    /// connection's start or from the previous response.
    pub header_timeout: Duration,
    /// The time a connection may move no byte while the server waits on it.
    pub idle_timeout: Duration,
}

impl Limits {
    /// `max_connections` connections with the default timeouts.
    pub const fn with_connections(max_connections: usize) -> Limits {
        Limits { max_connections, header_timeout: HEADER_TIMEOUT, idle_timeout: IDLE_TIMEOUT }
    }

    /// These limits with `max_connections` held at or under `nofile` /
    /// [`FD_LIMIT_SHARE`] (and at least 1), for a process whose descriptor
    /// limit is `nofile`.
    pub fn within_fd_limit(self, nofile: u64) -> Limits {
        let share = usize::try_from(nofile / FD_LIMIT_SHARE).unwrap_or(usize::MAX);
        Limits { max_connections: self.max_connections.min(share).max(1), ..self }
    }
}

/// This process's soft descriptor limit (`RLIMIT_NOFILE`).
pub fn fd_limit() -> io::Result<u64> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the valid rlimit it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rl.rlim_cur)
}

/// Raises this process's soft descriptor limit to its hard limit (a
/// service manager's default soft limit is often 1024); returns the soft
/// limit in effect afterwards.
pub fn raise_fd_limit() -> io::Result<u64> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the valid rlimit it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if rl.rlim_cur < rl.rlim_max {
        let raised = libc::rlimit { rlim_cur: rl.rlim_max, rlim_max: rl.rlim_max };
        // SAFETY: setrlimit only reads the valid rlimit it is given, and
        // raising a soft limit up to the hard one is always allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(io::Error::last_os_error());
        }
        rl = raised;
    }
    Ok(rl.rlim_cur)
}

/// Serves `router` on `listener` within `limits` until `shutdown`
/// resolves; then accepts no more connections, lets each finish the
/// request it is handling (idle ones close at once), and returns when all
/// have ended. Accept errors (`EMFILE` above all) are logged and retried
/// after a pause by `listener` (axum's listeners sleep a second).
pub async fn serve<L: Listener>(mut listener: L, router: Router, limits: Limits, shutdown: impl Future<Output = ()>) {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
    let slots = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut refused = 0u64;
    let mut last_log: Option<Instant> = None;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let io = tokio::select! {
            (io, _) = listener.accept() => io,
            () = &mut shutdown => break,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            // Closed unanswered: writing even a 503 could wait on the
            // client, and a refusal must cost nothing past this moment.
            drop(io);
            refused += 1;
            if last_log.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL) {
                tracing::warn!(max_connections = max, refused, "connections over the cap closed at accept");
                last_log = Some(Instant::now());
                refused = 0;
            }
            continue;
        };
        let router = router.clone();
        let stop = stop_rx.clone();
        tokio::spawn(async move {
            serve_connection(io, router, limits, stop).await;
            drop(permit);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection holds a slot until it ends.
    let _ = slots.acquire_many(max as u32).await;
}

async fn serve_connection<Io>(io: Io, router: Router, limits: Limits, mut stop: watch::Receiver<bool>)
where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked { io, activity: activity.clone() });
    let svc = TowerToHyperService::new(router);
    let handler_activity = activity.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let working = Working::start(&handler_activity);
        let req = req.map(|body| TrackedBody { body, activity: handler_activity.clone(), waiting: false });
        let fut = hyper::service::Service::call(&svc, req);
        async move {
            let r = fut.await;
            drop(working);
            r
        }
    });
    let conn = hyper::server::conn::http1::Builder::new().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).serve_connection(io, svc);
    let mut conn = std::pin::pin!(conn);
    let idle = idle_watch(&activity, limits.idle_timeout);
    let mut idle = std::pin::pin!(idle);
    let mut stopping = *stop.borrow();
    if stopping {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("HTTP connection ended: {e}");
                }
                return;
            }
            () = &mut idle => {
                tracing::debug!(timeout = ?limits.idle_timeout, "closing an HTTP connection that moved no byte while it was waited on");
                return;
            }
            changed = stop.changed(), if !stopping => {
                stopping = true;
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Resolves once `a` has moved no byte for `idle` while the server waits
/// on the client.
async fn idle_watch(a: &Activity, idle: Duration) {
    loop {
        let due = a.last_progress() + idle;
        let now = Instant::now();
        if due > now {
            tokio::time::sleep_until(due).await;
        } else if a.waits_on_client() {
            return;
        } else {
            // A handler is working: look again later, not in a loop.
            tokio::time::sleep(idle.max(Duration::from_millis(10))).await;
        }
    }
}

/// What the idle watch of one connection knows.
struct Activity {
    start: Instant,
    /// Milliseconds from `start` to the last byte read or written.
    last_ms: AtomicU64,
    /// Request handlers running (one at most: HTTP/1.1 answers in order).
    working: AtomicUsize,
    /// Request bodies a handler waits on for bytes.
    body_waits: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity { start: Instant::now(), last_ms: AtomicU64::new(0), working: AtomicUsize::new(0), body_waits: AtomicUsize::new(0) }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn last_progress(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// No handler runs, or the one running waits for body bytes.
    fn waits_on_client(&self) -> bool {
        self.working.load(Ordering::Relaxed) == 0 || self.body_waits.load(Ordering::Relaxed) > 0
    }
}

/// Counts a request handler as working from its start to its end (or
/// until hyper drops it).
struct Working(Arc<Activity>);

impl Working {
    fn start(a: &Arc<Activity>) -> Working {
        a.working.fetch_add(1, Ordering::Relaxed);
        Working(a.clone())
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        self.0.working.fetch_sub(1, Ordering::Relaxed);
        // The response is ready: its first byte is progress to come, and
        // the idle time counts from here, not from the request.
        self.0.touch();
    }
}

/// A connection's stream, noting when bytes move.
struct Tracked<Io> {
    io: Io,
    activity: Arc<Activity>,
}

impl<Io: AsyncRead + Unpin> AsyncRead for Tracked<Io> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Tracked<Io> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A request body, noting while its handler waits for bytes of it.
struct TrackedBody<B> {
    body: B,
    activity: Arc<Activity>,
    waiting: bool,
}

impl<B> TrackedBody<B> {
    fn set_waiting(&mut self, waiting: bool) {
        if waiting != self.waiting {
            self.waiting = waiting;
            if waiting {
                self.activity.body_waits.fetch_add(1, Ordering::Relaxed);
            } else {
                self.activity.body_waits.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl<B: Body + Unpin> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.body).poll_frame(cx);
        self.set_waiting(r.is_pending());
        r
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for TrackedBody<B> {
    fn drop(&mut self) {
        self.set_waiting(false);
    }
}

#[cfg(test)]
mod tests;
