//! `vgpu-testdriver-mps`: the test double's stand-in for NVIDIA's MPS
//! control daemon (`nvidia-cuda-mps-control`), for CI machines without a
//! GPU. Built for the project's tests only, never installed: a mediator
//! uses it only where its configuration names it (`devices.mps_control`).
//!
//! It is driven as NVIDIA's is: `-d` starts the daemon in the background
//! (the command returns once it listens), with its pipe and log
//! directories from `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY`;
//! without `-d` it sends each line of its standard input to the running
//! daemon as a command and prints the answer (`quit` ends the daemon).
//! Its server side follows NVIDIA's documentation of MPS error
//! containment (see `vgpu_testdriver::mps`): a client's fatal fault is
//! sent to every client, and no new client is taken until every client
//! the server had then has exited.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vgpu_testdriver::mps::{CONTROL, PIPE_ENV};

const LOG_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
/// The longest command line a connection may send.
const MAX_LINE: u64 = 256;

#[derive(Default)]
struct Server {
    next: u64,
    clients: HashMap<u64, UnixStream>,
    /// Clients the server had at a fault that have not exited yet: while
    /// any is left, new clients are refused.
    recovering: HashSet<u64>,
}

fn dir_of(var: &str) -> Result<PathBuf, String> {
    let d = std::env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from).ok_or_else(|| format!("{var} is not set"))?;
    if !d.is_dir() {
        return Err(format!("{var}: {} is not a directory", d.display()));
    }
    Ok(d)
}

fn log(dir: &Path, what: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("control.log")) {
        let _ = writeln!(f, "[{}] {what}", std::process::id());
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["-d"] => start(),
        ["--serve"] => serve(),
        [] => commands(),
        _ => Err("usage: vgpu-testdriver-mps [-d]   (commands on standard input without -d)".into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpu-testdriver-mps: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `-d`: starts the daemon in a session of its own and returns once its
/// control socket takes connections.
fn start() -> Result<(), String> {
    let pipe = dir_of(PIPE_ENV)?;
    dir_of(LOG_ENV)?;
    let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--serve").stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: setsid is async-signal-safe and touches only the child.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
    }
    let mut child = cmd.spawn().map_err(|e| format!("starting the daemon: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if UnixStream::connect(pipe.join(CONTROL)).is_ok() {
            return Ok(());
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!("the daemon ended at its start ({st})"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    Err("the daemon did not listen within 10 s".into())
}

fn serve() -> Result<(), String> {
    let (pipe, logs) = (dir_of(PIPE_ENV)?, dir_of(LOG_ENV)?);
    let path = pipe.join(CONTROL);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| format!("binding {}: {e}", path.display()))?;
    log(&logs, "control daemon started");
    let server = Arc::new(Mutex::new(Server::default()));
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let (server, logs, path) = (server.clone(), logs.clone(), path.clone());
        let _ = std::thread::Builder::new().name("mps-conn".into()).spawn(move || connection(conn, &server, &logs, &path));
    }
    Ok(())
}

fn connection(conn: UnixStream, server: &Mutex<Server>, logs: &Path, path: &Path) {
    let lock = || server.lock().unwrap_or_else(|e| e.into_inner());
    let Ok(read) = conn.try_clone() else { return };
    let mut r = BufReader::new(read);
    // One line, at most MAX_LINE bytes of it.
    let mut next = |line: &mut String| {
        line.clear();
        matches!(std::io::Read::take(&mut r, MAX_LINE).read_line(line), Ok(n) if n > 0)
    };
    let mut line = String::new();
    if !next(&mut line) {
        return;
    }
    let mut w = &conn;
    let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    match words.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["client", pid] => {
            let id = {
                let mut s = lock();
                if !s.recovering.is_empty() {
                    log(logs, &format!("client {pid} refused: the server is recovering from a fault"));
                    let _ = writeln!(w, "not-ready");
                    return;
                }
                let Ok(c) = conn.try_clone() else { return };
                s.next += 1;
                let id = s.next;
                s.clients.insert(id, c);
                id
            };
            log(logs, &format!("client {pid} joined"));
            let _ = writeln!(w, "ok");
            // From here on the client sends only its faults.
            while next(&mut line) {
                let Some(code) = line.trim().strip_prefix("fault ").and_then(|c| c.parse::<u32>().ok()) else { continue };
                let mut s = lock();
                log(logs, &format!("client {pid} faulted ({code}): every client gets the fault; no new client until all have exited"));
                let all: Vec<u64> = s.clients.keys().copied().collect();
                s.recovering.extend(all);
                for (_, mut c) in s.clients.iter().filter(|(k, _)| **k != id) {
                    let _ = writeln!(c, "fault {code}");
                }
            }
            let mut s = lock();
            s.clients.remove(&id);
            s.recovering.remove(&id);
            log(logs, &format!("client {pid} exited"));
        }
        ["get_server_list"] => {
            // One server, this process, once it has a client.
            let any = !lock().clients.is_empty();
            let _ = writeln!(w, "{}", if any { std::process::id().to_string() } else { String::new() });
        }
        ["quit"] => {
            log(logs, "quit");
            let _ = writeln!(w, "ok");
            let _ = std::fs::remove_file(path);
            std::process::exit(0);
        }
        _ => {
            let _ = writeln!(w, "unknown command: {}", line.trim());
        }
    }
}

/// Without `-d`: each line of standard input is a command to the daemon.
fn commands() -> Result<(), String> {
    let pipe = dir_of(PIPE_ENV)?;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("reading commands: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let mut s = UnixStream::connect(pipe.join(CONTROL)).map_err(|e| format!("no control daemon in {}: {e}", pipe.display()))?;
        writeln!(s, "{}", line.trim()).map_err(|e| format!("sending {line:?}: {e}"))?;
        let mut answer = String::new();
        BufReader::new(&s).read_line(&mut answer).map_err(|e| format!("reading the answer: {e}"))?;
        print!("{answer}");
    }
    Ok(())
}
