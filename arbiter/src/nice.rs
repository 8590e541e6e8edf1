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
//!
//! Three more rules keep control work from waiting behind kernels:
//! - Lane work also asks for a short time slice (100 µs, through
//!   `sched_setattr`, Linux 6.12 and later): the EEVDF scheduler lets a
//!   running thread finish its slice before a woken one preempts it, and
//!   with the default slice (1.4 ms on two cores) a woken ring poller or
//!   tenant thread would wait that long behind a kernel. A worker that
//!   keeps CAP_SYS_NICE does without it: `sched_setattr` with the
//!   capability could also ask for a real-time policy. Without it, the
//!   limits [`fence_limits`] sets keep the call to lowering the thread.
//! - The scheduler's own bookkeeping never runs lowered ([`Raised`]): a
//!   lowered thread preempted while it holds the scheduler's lock would
//!   make every thread that needs the lock wait for the kernels it runs
//!   behind (priority inversion; this was the largest part of a short
//!   launch's tail under a flood of long ones).
//! - Lanes are pinned to cores (crate::placement).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

/// The nice value of lane work; 0: off.
static COMPUTE: AtomicI32 = AtomicI32::new(0);
static WARNED: AtomicBool = AtomicBool::new(false);
/// Whether lane work also gets [`LANE_SLICE`] (`sched_setattr` works).
static SLICED: AtomicBool = AtomicBool::new(false);

/// The time slice lane work asks for: how long a woken control thread
/// may wait behind a kernel on its core (the kernel's minimum, 100 µs).
pub const LANE_SLICE: Duration = Duration::from_micros(100);

thread_local! {
    /// Whether the calling thread is at the compute nice value now.
    static LOWERED: Cell<bool> = const { Cell::new(false) };
}

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

/// Caps what a thread of this process may ask the host's scheduler for,
/// whatever the daemon inherited: no real-time priority (RLIMIT_RTPRIO 0)
/// and nothing above nice 0 (RLIMIT_NICE at most 20). With these, and no
/// CAP_SYS_NICE, `sched_setattr` on a thread's own attributes can only
/// lower it or choose its slice. Lowering limits needs no privilege, and
/// the worker's seccomp lists allow no way to raise them again.
pub fn fence_limits() -> Result<(), std::io::Error> {
    let zero = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: setrlimit on our own process with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_RTPRIO, &zero) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit on our own process with a valid, writable struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NICE, &mut rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let capped = libc::rlimit { rlim_cur: rl.rlim_cur.min(RESTORE_LIMIT), rlim_max: rl.rlim_max.min(RESTORE_LIMIT) };
    // SAFETY: setrlimit on our own process with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_NICE, &capped) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Turns compute nice on at `nice` (1 to [`MAX`]; 0 turns it off), once a
/// scratch thread has shown that a thread can go down to it and back to 0
/// (RLIMIT_NICE or CAP_SYS_NICE). With `slice` (the caller's seccomp
/// filters allow `sched_setattr` on the calling thread), lane work also
/// gets [`LANE_SLICE`] where the kernel takes it. Returns why compute nice
/// stays off, if it does.
pub fn enable(nice: i32, slice: bool) -> Result<(), std::io::Error> {
    let nice = nice.clamp(0, MAX);
    COMPUTE.store(0, Ordering::Relaxed);
    SLICED.store(false, Ordering::Relaxed);
    if nice == 0 {
        return Ok(());
    }
    // Nice values are per thread and inherited: probing on the caller
    // would leave every thread it starts later lowered if the way back
    // failed.
    let probe = |sliced: bool| {
        SLICED.store(sliced, Ordering::Relaxed);
        let r = std::thread::spawn(move || {
            set_own(nice)?;
            // A kernel before 6.12 takes the call but not the slice.
            if sliced && own_slice() != Some(LANE_SLICE.as_nanos() as u64) {
                set_own(0)?;
                return Err(std::io::Error::from(std::io::ErrorKind::Unsupported));
            }
            set_own(0)
        })
        .join()
        .map_err(|_| std::io::Error::other("the probe thread panicked"));
        let r = r.and_then(|r| r);
        if r.is_err() {
            SLICED.store(false, Ordering::Relaxed);
        }
        r
    };
    // An older kernel refuses or ignores the slice: nice alone then.
    if !(slice && probe(true).is_ok()) {
        probe(false)?;
    }
    COMPUTE.store(nice, Ordering::Relaxed);
    Ok(())
}

/// Whether lane work gets [`LANE_SLICE`] as well as compute nice.
pub fn sliced() -> bool {
    SLICED.load(Ordering::Relaxed)
}

/// The compute nice value in force (0: off).
pub fn compute() -> i32 {
    COMPUTE.load(Ordering::Relaxed)
}

/// `struct sched_attr` (include/uapi/linux/sched/types.h), its first
/// version (SCHED_ATTR_SIZE_VER0, 48 bytes): the fields this file sets.
#[repr(C)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    /// For SCHED_OTHER (Linux 6.12+): the thread's time slice in ns, 0 for
    /// the default.
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// The calling thread's time slice as `sched_getattr` reports it (ns),
/// if it reports one.
fn own_slice() -> Option<u64> {
    let mut a = SchedAttr { size: 0, policy: 0, flags: 0, nice: 0, priority: 0, runtime: 0, deadline: 0, period: 0 };
    // SAFETY: sched_getattr with pid 0 writes at most the given size (that
    // of the live struct) into it.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut a as *mut SchedAttr, std::mem::size_of::<SchedAttr>() as u32, 0) };
    (rc == 0 && a.runtime > 0).then_some(a.runtime)
}

fn set_own(nice: i32) -> Result<(), std::io::Error> {
    let rc = if SLICED.load(Ordering::Relaxed) {
        let slice = if nice > 0 { LANE_SLICE.as_nanos() as u64 } else { 0 };
        let attr = SchedAttr { size: std::mem::size_of::<SchedAttr>() as u32, policy: libc::SCHED_OTHER as u32, flags: 0, nice, priority: 0, runtime: slice, deadline: 0, period: 0 };
        // SAFETY: sched_setattr with pid 0 changes only the calling
        // thread's policy, nice value and slice; it reads `size` bytes of
        // a live, initialised struct and writes nothing.
        unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) as i32 }
    } else {
        // SAFETY: setpriority with PRIO_PROCESS and who = 0 changes only
        // the calling thread's nice value on Linux; no memory is involved.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) }
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    LOWERED.with(|l| l.set(nice > 0));
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

/// Holds a lowered thread at nice 0 (and the default slice) for as long
/// as it lives, then lowers it again: for the scheduler's bookkeeping
/// that lane work does at its checkpoints, under locks that control
/// threads wait for. Does nothing on a thread that is not lowered.
pub struct Raised(bool);

impl Raised {
    pub fn new() -> Raised {
        Raised(LOWERED.with(|l| l.get()) && set_own(0).is_ok())
    }
}

impl Default for Raised {
    fn default() -> Self {
        Raised::new()
    }
}

impl Drop for Raised {
    fn drop(&mut self) {
        let n = compute();
        if self.0 && n > 0 {
            let _ = set_own(n);
        }
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
            if let Err(e) = enable(7, true) {
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
            {
                let _l = Lowered::new();
                {
                    let _r = Raised::new();
                    assert_eq!(own_nice(), 0, "bookkeeping runs at nice 0");
                    if sliced() {
                        assert_ne!(own_slice(), Some(LANE_SLICE.as_nanos() as u64), "and with the default slice");
                    }
                }
                assert_eq!(own_nice(), 7, "lowered again after the bookkeeping");
                if sliced() {
                    assert_eq!(own_slice(), Some(LANE_SLICE.as_nanos() as u64), "lane work has the short slice");
                }
            }
            let _r = Raised::new();
            assert_eq!(own_nice(), 0, "Raised leaves a thread that is not lowered alone");
            drop(_r);
            enable(0, true).unwrap();
            let _l = Lowered::new();
            assert_eq!(own_nice(), 0, "off means off");
        })
        .join()
        .unwrap();
    }
}
