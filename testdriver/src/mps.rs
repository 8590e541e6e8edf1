//! The double's model of an MPS client (NVIDIA's Multi-Process Service),
//! after NVIDIA's MPS documentation:
//! - a process whose `CUDA_MPS_PIPE_DIRECTORY` names the pipe directory
//!   of a running control daemon becomes that server's client at `cuInit`;
//!   with no daemon there it runs as a plain process;
//! - while the server recovers from a client's fatal fault, a new client's
//!   `cuInit` fails with `CUDA_ERROR_MPS_SERVER_NOT_READY`;
//! - a fatal fault in one client reaches every client of the server: each
//!   one's contexts fail with the fault's error from then on, and the
//!   server takes new clients again only once every client it had at the
//!   fault has exited.
//!
//! The server's side is `vgpu-testdriver-mps` (src/bin/mps_control.rs),
//! which plays `nvidia-cuda-mps-control`. The two speak lines over the
//! unix socket `control` in the pipe directory: a client sends
//! `client PID` and gets `ok` or `not-ready`, keeps the connection open
//! while it lives, sends `fault CODE` when one of its kernels faults, and
//! is sent `fault CODE` when another client's did.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Mutex;

use virtio_gpu_compute::CuResult as E;

use crate::Driver;

/// The variable that makes a process an MPS client (NVIDIA's name).
pub const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// The control socket's name in the pipe directory.
pub const CONTROL: &str = "control";

/// This process's connection to its server, once it joined.
static JOINED: Mutex<Option<UnixStream>> = Mutex::new(None);

/// The control socket named by the environment, if any.
fn control_socket() -> Option<PathBuf> {
    std::env::var_os(PIPE_ENV).filter(|v| !v.is_empty()).map(|d| PathBuf::from(d).join(CONTROL))
}

/// Joins the MPS server at `cuInit`, where the environment names a
/// running one; a no-op for a plain process or one that already joined.
pub(crate) fn join(d: &'static Driver) -> Result<(), E> {
    let mut joined = JOINED.lock().unwrap_or_else(|e| e.into_inner());
    if joined.is_some() {
        return Ok(());
    }
    let Some(path) = control_socket() else { return Ok(()) };
    let Ok(mut s) = UnixStream::connect(&path) else {
        // No daemon: the process runs without MPS, as with NVIDIA's driver.
        return Ok(());
    };
    writeln!(s, "client {}", std::process::id()).map_err(|_| E::CUDA_ERROR_MPS_CONNECTION_FAILED)?;
    let mut r = BufReader::new(s.try_clone().map_err(|_| E::CUDA_ERROR_MPS_CONNECTION_FAILED)?);
    let mut line = String::new();
    r.read_line(&mut line).map_err(|_| E::CUDA_ERROR_MPS_CONNECTION_FAILED)?;
    match line.trim() {
        "ok" => {}
        "not-ready" => return Err(E::CUDA_ERROR_MPS_SERVER_NOT_READY),
        _ => return Err(E::CUDA_ERROR_MPS_CONNECTION_FAILED),
    }
    // Another client's fault reaches this one through the server.
    std::thread::Builder::new()
        .name("mps-client".into())
        .spawn(move || {
            let mut line = String::new();
            while matches!(r.read_line(&mut line), Ok(n) if n > 0) {
                if let Some(code) = line.trim().strip_prefix("fault ").and_then(|c| c.parse::<u32>().ok()) {
                    d.poison(code);
                }
                line.clear();
            }
        })
        .map_err(|_| E::CUDA_ERROR_MPS_CONNECTION_FAILED)?;
    *joined = Some(s);
    Ok(())
}

/// Tells the server this process faulted (every other client gets it).
pub fn report_fault(code: u32) {
    let joined = JOINED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(mut s) = joined.as_ref() {
        let _ = writeln!(s, "fault {code}");
    }
}
