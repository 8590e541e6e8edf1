//! OS priority of the threads that run device work.
//!
//! A CPU device's kernels run on host threads that share the cores with the
//! worker's own control threads: the ones that read rings and sockets,
//! hand work to the scheduler and send completions. When a long kernel
//! holds a core, a short launch of another tenant waits not only for its
//! lane (the device scheduler hands that over at the next checkpoint) but
//! also for its control threads to get a core, and the host scheduler may
//! make them wait a whole time slice behind the kernel.
//!
//! So work holding a lane runs at a lower OS priority ("compute nice")
//! than everything else in the worker, and the thread goes back to nice 0
//! when the work ends. Going back up needs `RLIMIT_NICE` of at least 20:
//! the worker raises it while it still may, before it drops privileges.
//! Where the host denies that (no CAP_SYS_RESOURCE), a CPU worker under
//! seccomp keeps CAP_SYS_NICE instead, and its filters allow nothing with
//! it but `setpriority` of the calling thread to 0..=19 (worker/confine.rs).
//! Where neither works, compute nice stays off and a warning says so.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The nice value of lane work; 0: off.
static COMPUTE: AtomicI32 = AtomicI32::new(0);
static WARNED: AtomicBool = AtomicBool::new(false);

/// The largest compute nice value (the host's lowest priority).
pub const MAX: i32 = 19;

/// The RLIMIT_NICE value that lets a thread return to nice 0.
const RESTORE_LIMIT: libc::rlim_t = 20;

/// Raises RLIMIT_NICE to 20 when it is lower and the process may (it
/// holds CAP_SYS_RESOURCE, or the hard limit allows it): with it, a thread
/// may return from a positive nice value to 0 without any capability.
/// Call before dropping privileges. Returns why not, if not.
pub fn raise_limit() -> Result<(), std::io::Error> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit on our own process with a valid, writable struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NICE, &mut rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if rl.rlim_cur >= RESTORE_LIMIT {
        return Ok(());
    }
    rl.rlim_cur = RESTORE_LIMIT;
    rl.rlim_max = rl.rlim_max.max(RESTORE_LIMIT);
    // SAFETY: setrlimit on our own process with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_NICE, &rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Turns compute nice on at `nice` (1 to [`MAX`]; 0 turns it off), once a
/// scratch thread has shown that a thread can go down to it and back to 0
/// (RLIMIT_NICE or CAP_SYS_NICE). Returns why it stays off, if it does.
pub fn enable(nice: i32) -> Result<(), std::io::Error> {
    let nice = nice.clamp(0, MAX);
    COMPUTE.store(0, Ordering::Relaxed);
    if nice == 0 {
        return Ok(());
    }
    // Nice values are per thread and inherited: probing on the caller
    // would leave every thread it starts later lowered if the way back
    // failed.
    std::thread::spawn(move || set_own(nice).and_then(|()| set_own(0))).join().map_err(|_| std::io::Error::other("the probe thread panicked"))??;
    COMPUTE.store(nice, Ordering::Relaxed);
    Ok(())
}

/// The compute nice value in force (0: off).
pub fn compute() -> i32 {
    COMPUTE.load(Ordering::Relaxed)
}

fn set_own(nice: i32) -> Result<(), std::io::Error> {
    // SAFETY: setpriority with PRIO_PROCESS and who = 0 changes only the
    // calling thread's nice value on Linux; no memory is involved.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Lowers the calling thread to the compute nice value for good: for
/// threads that only ever run lane work (the block pool's).
pub fn lower_for_good() {
    let n = compute();
    if n > 0 {
        let _ = set_own(n);
    }
}

/// Holds the calling thread at the compute nice value; back to 0 on drop.
pub struct Lowered(bool);

impl Lowered {
    pub fn new() -> Lowered {
        let n = compute();
        Lowered(n > 0 && set_own(n).is_ok())
    }
}

impl Default for Lowered {
    fn default() -> Self {
        Lowered::new()
    }
}

impl Drop for Lowered {
    fn drop(&mut self) {
        if self.0 {
            if let Err(e) = set_own(0) {
                // Should not happen (the limit was checked at start); stop
                // lowering threads so control work never stays behind.
                COMPUTE.store(0, Ordering::Relaxed);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!("a thread could not return to nice 0 ({e}); compute nice is now off");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_nice() -> i32 {
        // SAFETY: getpriority on the calling thread; errno is cleared first
        // because -1 is a valid result.
        unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, 0)
        }
    }

    #[test]
    fn lane_work_runs_lowered_and_the_thread_comes_back() {
        // On a thread of its own: nice values are per thread.
        std::thread::spawn(|| {
            let _ = raise_limit();
            if let Err(e) = enable(7) {
                eprintln!("SKIP: this host lets no thread return to nice 0 (no CAP_SYS_NICE, RLIMIT_NICE below 20: {e}); compute nice is off on such hosts");
                return;
            }
            let before = own_nice();
            assert_eq!(before, 0, "the test thread starts at nice 0");
            {
                let _l = Lowered::new();
                assert_eq!(own_nice(), 7);
            }
            assert_eq!(own_nice(), 0, "the thread returns to nice 0 when the work ends");
            enable(0).unwrap();
            let _l = Lowered::new();
            assert_eq!(own_nice(), 0, "off means off");
        })
        .join()
        .unwrap();
    }
}
