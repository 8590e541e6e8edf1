//! The end of an executor whose device state is beyond repair.
//!
//! On NVIDIA's driver a kernel fault is sticky for the whole process (no
//! context in it works again, and none can be made), and the only way to
//! stop a kernel that runs past its timeout without hanging in
//! `cuCtxDestroy` is to end the process: the driver then tears down its
//! channels. So a tenant's executor on a GPU, once such an error is seen,
//! answers the call that met it and ends itself with SIGKILL (no exit
//! handlers: the driver's would destroy contexts, and block on a running
//! kernel). The control plane starts the tenant a fresh executor; every
//! other tenant's executor is another process and carries on.
//!
//! Off (the default), [`mark`] does nothing: a shared worker must never
//! end on one tenant's fault.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use virtio_gpu_compute::CuResult;

static ENABLED: AtomicBool = AtomicBool::new(false);
static MARKED: AtomicBool = AtomicBool::new(false);

/// How long a marked executor lives at most: time for the reply that
/// carries the error to go out when no reply path reports it.
pub const GRACE: Duration = Duration::from_millis(500);

/// Makes sticky errors end this process (a tenant's executor).
pub fn enable() {
    ENABLED.store(true, Ordering::Release);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Acquire)
}

/// Whether this process met an error it ends on.
pub fn marked() -> bool {
    MARKED.load(Ordering::Acquire)
}

/// Records an error this process cannot recover from. Returns whether the
/// process ends for it (only where [`enable`]d): it does as soon as the
/// error's reply is out ([`replied`]), and at the latest after [`GRACE`].
pub fn mark(why: &str) -> bool {
    if !enabled() {
        return false;
    }
    if !MARKED.swap(true, Ordering::AcqRel) {
        tracing::error!("{why}: this executor's device state cannot be recovered; it ends once the tenant has the error, and the tenant gets a new executor");
        tell(why);
        let spawned = std::thread::Builder::new().name("fatal".into()).spawn(|| {
            std::thread::sleep(GRACE);
            end();
        });
        if spawned.is_err() {
            end();
        }
    }
    true
}

/// Tells the control plane, on the executor's stdout, before the end: on
/// a GPU shared under MPS the fault reaches every executor of the GPU,
/// which the control plane then ends too (vgpu-mediator control/mps.rs).
fn tell(why: &str) {
    // One write under the channel's lock, as every reply is written.
    let _ = crate::ipc::send(0, crate::ipc::WorkerMsg::Fatal { why: why.to_string() });
}

/// A reply with status `code` was handed to the tenant: if it carries the
/// error this process ends on, the process ends now.
pub fn replied(code: u32) {
    if marked() && CuResult::from_u32(code).is_sticky() {
        end();
    }
}

fn end() -> ! {
    // SAFETY: raising SIGKILL on ourselves has no memory preconditions;
    // it does not return.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    // SAFETY: as above; reached only if the signal was somehow not taken.
    unsafe { libc::_exit(70) }
}
