//! Tenant executors' standard error, passed on to the daemon's own with
//! bounds. An executor serves one tenant; were its stderr the daemon's, a
//! flood from it (a tenant that found a way to make its executor log, or
//! a hijacked one) would reach the journal as the daemon's, whose per-unit
//! rate limit would then drop every other tenant's lines and the daemon's
//! own. Here each executor gets a budget of lines (a burst, then a steady
//! rate), and all executors together one more ([`BURST_ALL`],
//! [`PER_SEC_ALL`]: under journald's default of 10 000 lines in 30 s, so
//! executors that keep crashing, each new one with a fresh budget, or many
//! tenants at once, still leave room for the daemon's own lines); lines
//! past a budget are read and dropped, and counted in one line of the
//! daemon's when the budget allows again. Lines longer than [`LINE_MAX`]
//! are cut. One small runtime thread reads every executor's pipe, so an
//! executor never waits on a full pipe.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::process::ChildStderr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// The longest line passed on; the rest of a longer one is dropped.
pub const LINE_MAX: usize = 4096;
/// Lines an executor may write at once.
pub const BURST: f64 = 200.0;
/// Lines a second it may write after that.
pub const PER_SEC: f64 = 20.0;
/// Lines all executors together may write at once, and a second after.
pub const BURST_ALL: f64 = 1000.0;
pub const PER_SEC_ALL: f64 = 200.0;

/// A token bucket: `burst` lines at once, `rate` a second after that.
pub struct Bucket {
    tokens: f64,
    last: Instant,
    burst: f64,
    rate: f64,
}

impl Bucket {
    pub fn new(burst: f64, rate: f64, now: Instant) -> Bucket {
        Bucket { tokens: burst, last: now, burst, rate }
    }

    fn refill(&mut self, now: Instant) {
        self.tokens = (self.tokens + now.saturating_duration_since(self.last).as_secs_f64() * self.rate).min(self.burst);
        self.last = now;
    }

    /// Takes one line's token at `now`, if there is one.
    pub fn try_take(&mut self, now: Instant) -> bool {
        self.refill(now);
        let ok = self.tokens >= 1.0;
        if ok {
            self.tokens -= 1.0;
        }
        ok
    }
}

/// Text a process sent, made fit for one log line: at most `max` bytes
/// (cut at a character), control characters escaped, so that it can
/// neither flood the log nor forge a line of its own.
pub fn fit_for_log(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out: String = text[..end].chars().flat_map(char::escape_default).collect();
    if end < text.len() {
        out += &format!("... ({} more bytes)", text.len() - end);
    }
    out
}

/// The budget every executor's lines share.
fn all_executors() -> Arc<Mutex<Bucket>> {
    static ALL: OnceLock<Arc<Mutex<Bucket>>> = OnceLock::new();
    ALL.get_or_init(|| Arc::new(Mutex::new(Bucket::new(BURST_ALL, PER_SEC_ALL, Instant::now())))).clone()
}

/// Splits an executor's output into lines and applies its budget and the
/// one all executors share.
pub struct Limiter {
    who: String,
    own: Bucket,
    all: Arc<Mutex<Bucket>>,
    dropped: u64,
    /// The line being read, up to [`LINE_MAX`] bytes.
    line: Vec<u8>,
    /// Bytes of the current line past [`LINE_MAX`].
    cut: u64,
}

impl Limiter {
    pub fn new(who: String, now: Instant, all: Arc<Mutex<Bucket>>) -> Limiter {
        Limiter { who, own: Bucket::new(BURST, PER_SEC, now), all, dropped: 0, line: Vec::new(), cut: 0 }
    }

    /// Takes bytes the executor wrote at `now`; writes the lines its
    /// budget allows to `out`.
    pub fn feed(&mut self, bytes: &[u8], now: Instant, out: &mut impl Write) {
        let mut rest = bytes;
        while !rest.is_empty() {
            match rest.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    self.take(&rest[..i]);
                    rest = &rest[i + 1..];
                    self.end_line(now, out);
                }
                None => {
                    self.take(rest);
                    rest = &[];
                }
            }
        }
    }

    /// The executor closed its end: a last unfinished line, and what was
    /// dropped, are written.
    pub fn finish(&mut self, now: Instant, out: &mut impl Write) {
        if !self.line.is_empty() || self.cut > 0 {
            self.end_line(now, out);
        }
        if self.dropped > 0 {
            let _ = writeln!(out, "vgpu-mediatord: the executor of {} ended; {} more of its log lines were dropped (over its budget or all executors')", self.who, self.dropped);
            self.dropped = 0;
        }
        let _ = out.flush();
    }

    fn take(&mut self, part: &[u8]) {
        let room = LINE_MAX.saturating_sub(self.line.len());
        let n = part.len().min(room);
        self.line.extend_from_slice(&part[..n]);
        self.cut += (part.len() - n) as u64;
    }

    fn end_line(&mut self, now: Instant, out: &mut impl Write) {
        let line = std::mem::take(&mut self.line);
        let cut = std::mem::take(&mut self.cut);
        self.own.refill(now);
        let passes = self.own.tokens >= 1.0 && {
            let mut all = self.all.lock().unwrap_or_else(|e| e.into_inner());
            all.refill(now);
            // The count of dropped lines goes out with the line, on the
            // same token.
            let ok = all.tokens >= 1.0;
            if ok {
                all.tokens -= 1.0;
            }
            ok
        };
        if !passes {
            self.dropped += 1;
            return;
        }
        self.own.tokens -= 1.0;
        if self.dropped > 0 {
            let _ = writeln!(
                out,
                "vgpu-mediatord: {} log lines of the executor of {} were dropped (over {BURST} at once or {PER_SEC} a second, or all executors' {BURST_ALL} and {PER_SEC_ALL})",
                self.dropped, self.who
            );
            self.dropped = 0;
        }
        let _ = out.write_all(&line);
        if cut > 0 {
            let _ = write!(out, " [{cut} more bytes of this line dropped]");
        }
        let _ = out.write_all(b"\n");
        let _ = out.flush();
    }
}

fn runtime() -> Option<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    RT.get_or_init(|| match tokio::runtime::Builder::new_multi_thread().worker_threads(1).thread_name("log-relay").enable_io().build() {
        Ok(rt) => Some(rt),
        Err(e) => {
            tracing::error!("starting the executor log relay: {e}; executors' own log lines are dropped");
            None
        }
    })
    .as_ref()
}

/// Passes `stderr`, an executor's, on to the daemon's standard error
/// under its budget until the executor closes it. `who` names it in the
/// daemon's own lines ("tenant alice on gpu0").
pub fn relay(stderr: ChildStderr, who: String) {
    let Some(rt) = runtime() else {
        // Without the runtime, a thread of its own reads it.
        let spawned = std::thread::Builder::new().name("log-relay".into()).spawn(move || {
            let mut stderr = stderr;
            let mut lim = Limiter::new(who, Instant::now(), all_executors());
            let mut buf = vec![0u8; 16 << 10];
            loop {
                match std::io::Read::read(&mut stderr, &mut buf) {
                    Ok(0) => break,
                    Ok(n) => lim.feed(&buf[..n], Instant::now(), &mut std::io::stderr().lock()),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
            lim.finish(Instant::now(), &mut std::io::stderr().lock());
        });
        if let Err(e) = spawned {
            tracing::error!("relaying an executor's log: {e}; its lines are dropped");
        }
        return;
    };
    let _in_runtime = rt.enter();
    let pipe = match tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(stderr)) {
        Ok(p) => p,
        Err(e) => return tracing::error!("relaying the log of the executor of {who}: {e}; its lines are dropped"),
    };
    rt.spawn(async move {
        let mut lim = Limiter::new(who, Instant::now(), all_executors());
        let mut buf = vec![0u8; 16 << 10];
        loop {
            if pipe.readable().await.is_err() {
                break;
            }
            match pipe.try_read(&mut buf) {
                Ok(0) => break,
                Ok(n) => lim.feed(&buf[..n], Instant::now(), &mut std::io::stderr().lock()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        lim.finish(Instant::now(), &mut std::io::stderr().lock());
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A budget for all executors of this test alone.
    fn own_all(now: Instant) -> Arc<Mutex<Bucket>> {
        Arc::new(Mutex::new(Bucket::new(BURST_ALL, PER_SEC_ALL, now)))
    }

    /// Many executors at once, each within its own budget, are held to
    /// the budget they share.
    #[test]
    fn all_executors_together_are_held_to_one_budget() {
        let t0 = Instant::now();
        let all = own_all(t0);
        let mut out = Vec::new();
        let mut each: Vec<Limiter> = (0..20).map(|i| Limiter::new(format!("tenant {i}"), t0, all.clone())).collect();
        for l in &mut each {
            l.feed(&b"x\n".repeat(100), t0, &mut out);
        }
        assert_eq!(lines(&out).len(), BURST_ALL as usize, "20 executors x 100 lines at once");
        // Ten seconds later: 200 a second for all of them together.
        out.clear();
        for s in 1..=10u64 {
            for l in &mut each {
                l.feed(&b"y\n".repeat(20), t0 + std::time::Duration::from_secs(s), &mut out);
            }
        }
        let n = lines(&out).iter().filter(|l| *l == "y").count();
        assert!(n <= 10 * PER_SEC_ALL as usize && n >= 9 * PER_SEC_ALL as usize, "{n} lines in 10 s");
    }

    fn lines(out: &[u8]) -> Vec<String> {
        String::from_utf8_lossy(out).lines().map(String::from).collect()
    }

    #[test]
    fn a_flood_is_cut_to_its_budget_and_counted() {
        let t0 = Instant::now();
        let mut lim = Limiter::new("tenant a on cpu0".into(), t0, own_all(t0));
        let mut out = Vec::new();
        // 10 000 lines at once: the burst passes, the rest is counted.
        let flood: Vec<u8> = (0..10_000).flat_map(|i| format!("line {i}\n").into_bytes()).collect();
        lim.feed(&flood, t0, &mut out);
        let got = lines(&out);
        assert_eq!(got.len(), BURST as usize);
        assert_eq!((got[0].as_str(), got[199].as_str()), ("line 0", "line 199"));
        // A second later there is room for 20 more: the count comes first.
        out.clear();
        let t1 = t0 + Duration::from_secs(1);
        lim.feed(b"after\n", t1, &mut out);
        let got = lines(&out);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].contains("9800 log lines of the executor of tenant a on cpu0 were dropped"), "{got:?}");
        assert_eq!(got[1], "after");
        // A steady 20 a second all pass.
        out.clear();
        for s in 2..12u64 {
            for _ in 0..20 {
                lim.feed(b"steady\n", t0 + Duration::from_secs(s), &mut out);
            }
        }
        assert_eq!(lines(&out).len(), 200);
        assert!(lines(&out).iter().all(|l| l == "steady"));
    }

    #[test]
    fn long_lines_are_cut_and_split_writes_are_joined() {
        let t0 = Instant::now();
        let mut lim = Limiter::new("tenant b".into(), t0, own_all(t0));
        let mut out = Vec::new();
        let long = vec![b'x'; 3 * LINE_MAX];
        lim.feed(&long[..5000], t0, &mut out);
        lim.feed(&long[5000..], t0, &mut out);
        lim.feed(b"\nhal", t0, &mut out);
        lim.feed(b"f\nno newline", t0, &mut out);
        lim.finish(t0, &mut out);
        let got = lines(&out);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got[0].starts_with(&"x".repeat(LINE_MAX)) && got[0].ends_with(&format!(" [{} more bytes of this line dropped]", 2 * LINE_MAX)), "{}", &got[0][LINE_MAX..]);
        assert_eq!((got[1].as_str(), got[2].as_str()), ("half", "no newline"));
    }

    #[test]
    fn what_an_ended_executor_had_dropped_is_said() {
        let t0 = Instant::now();
        let mut lim = Limiter::new("tenant c".into(), t0, own_all(t0));
        let mut out = Vec::new();
        lim.feed(&b"x\n".repeat(250), t0, &mut out);
        lim.finish(t0, &mut out);
        let got = lines(&out);
        assert_eq!(got.len(), 201);
        assert!(got[200].contains("ended; 50 more of its log lines were dropped"), "{}", got[200]);
    }

    /// Through a real pipe: an executor writing far past its budget never
    /// blocks on the pipe (the relay reads and drops what is over).
    #[test]
    fn a_writer_never_waits_on_the_relay() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 200000 ]; do echo flood-line-$i; i=$((i+1)); done >&2; echo done"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("sh");
        relay(child.stderr.take().expect("stderr"), "tenant d".into());
        // 3.6 MB through a 64 KiB pipe: it ends only if the relay drains it.
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().expect("try_wait").is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the writer was still blocked after 60 s: the relay does not drain its pipe");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut said = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().expect("stdout"), &mut said).expect("stdout");
        assert_eq!(said.trim(), "done");
    }
}
