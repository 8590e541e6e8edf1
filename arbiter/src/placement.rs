//! Which host cores a CPU device's lane work runs on.
//!
//! Each lane has a core of its own: the thread that runs a launch holding
//! lane `i` is pinned to the `i`-th core the worker may use (modulo their
//! number) for as long as it holds the lane, and goes back to all of them
//! afterwards. Without it, two kernels could share one core while the
//! other sat idle: a kernel thread that just ran is "cache hot" to the
//! host scheduler, which then does not move it to an idle core for
//! milliseconds, and a short launch beside a long one ran at half speed.
//!
//! A launch's helper threads (its blocks on rayon's pool) run anywhere
//! while the launch is alone on the device, and on their launch's core
//! while other work runs or waits: they never take another lane's core.
//!
//! Pinning follows the lane when preempted work resumes on another one.
//! It is off where the worker may use a single core, and can be turned off
//! (`devices.pin_lanes = false`) on hosts that run other work on the same
//! cores.

use std::cell::{Cell, RefCell};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The cores the worker may use, when pinning is on.
static CORES: OnceLock<Vec<usize>> = OnceLock::new();

thread_local! {
    /// The lane the calling thread is pinned for, if it is.
    static PINNED: Cell<Option<usize>> = const { Cell::new(None) };
    /// Whether the calling thread is a launch's helper right now.
    static HELPER: Cell<bool> = const { Cell::new(false) };
}

/// Turns pinning on (call once, after the worker's own CPU affinity is
/// final: its NUMA node's cores). Returns the cores lanes go to, or None
/// where there is only one.
pub fn enable() -> Option<&'static [usize]> {
    let cores = own_cores().filter(|c| c.len() > 1)?;
    Some(CORES.get_or_init(|| cores).as_slice())
}

/// The cores lanes are pinned to (empty: pinning is off).
pub fn cores() -> &'static [usize] {
    #[cfg(test)]
    if let Some(c) = TEST_CORES.with(|t| t.get()) {
        return c;
    }
    CORES.get().map(|c| c.as_slice()).unwrap_or(&[])
}

#[cfg(test)]
thread_local! {
    /// Cores for the calling test thread alone, so a test does not turn
    /// pinning on for the other tests of the process.
    static TEST_CORES: Cell<Option<&'static [usize]>> = const { Cell::new(None) };
}

fn own_cores() -> Option<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity on the calling thread writes at most the
    // given size into the live set.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return None;
    }
    // SAFETY: CPU_ISSET reads the set within CPU_SETSIZE.
    Some((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

fn set_cores(cores: &[usize]) -> bool {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cores {
        // SAFETY: every core came from sched_getaffinity, below CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: sched_setaffinity with pid 0 changes only the calling
    // thread's affinity; it reads the live set.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 }
}

/// Pins the calling thread to `lane`'s core; false if pinning is off or
/// the host refused (a core taken away by a cpuset since the start).
fn pin(lane: usize) -> bool {
    let cores = cores();
    if cores.is_empty() || !set_cores(&[cores[lane % cores.len()]]) {
        return false;
    }
    PINNED.with(|p| p.set(Some(lane)));
    true
}

fn unpin() {
    if PINNED.with(|p| p.replace(None)).is_some() {
        set_cores(cores());
    }
}

/// The thread running a launch on `lane`: pinned to the lane's core while
/// the guard lives.
pub struct LanePin(bool);

impl LanePin {
    pub fn new(lane: usize) -> LanePin {
        LanePin(pin(lane))
    }
}

impl Drop for LanePin {
    fn drop(&mut self) {
        if self.0 {
            unpin();
        }
    }
}

/// How long a lane's work runs on its own thread before that thread is
/// pinned to the lane's core and lowered to the compute nice value. Most
/// launches are shorter, and a pin and a nice change cost a system call
/// each way (with the migrations they cause, tens of µs per launch,
/// measured): work that ends sooner is not worth moving, and is gone
/// before it could hold up a control thread.
pub const SETTLE_AFTER: Duration = Duration::from_micros(200);

struct Settling {
    since: Instant,
    held: Option<(LanePin, crate::nice::Lowered)>,
}

thread_local! {
    /// The lane work the calling thread runs, while it runs it.
    static SETTLING: RefCell<Option<Settling>> = const { RefCell::new(None) };
}

/// The calling thread runs lane work while this lives: pinned to its
/// lane's core and lowered from the first checkpoint after
/// [`SETTLE_AFTER`] ([`settle`]), and back as it was when dropped.
pub struct LaneWork(());

impl LaneWork {
    pub fn begin() -> LaneWork {
        SETTLING.with(|s| *s.borrow_mut() = Some(Settling { since: Instant::now(), held: None }));
        LaneWork(())
    }
}

impl Drop for LaneWork {
    fn drop(&mut self) {
        // Taken out first: the guards' drops run outside the borrow.
        let done = SETTLING.with(|s| s.borrow_mut().take());
        drop(done);
    }
}

/// At a checkpoint of lane work on its own thread, which holds `lane` now
/// (preempted work may resume on another): once the work has run
/// [`SETTLE_AFTER`], the thread goes to that lane's core and below the
/// control threads. Costs one thread-local read before and after that;
/// nothing on other threads (a launch's helpers).
#[inline]
pub fn settle(lane: usize, now: Option<Instant>) {
    SETTLING.with(|s| {
        let mut s = s.borrow_mut();
        let Some(st) = s.as_mut().filter(|st| st.held.is_none()) else { return };
        if now.unwrap_or_else(Instant::now).duration_since(st.since) >= SETTLE_AFTER {
            st.held = Some((LanePin::new(lane), crate::nice::Lowered::new()));
        }
    })
}

/// Preempted work resumed on `lane`: a pinned thread moves there.
pub fn resumed(lane: usize) {
    if PINNED.with(|p| p.get()).is_some_and(|l| l != lane) {
        pin(lane);
    }
}

/// The calling thread starts (`true`) or stops helping a launch that runs
/// on another thread's lane.
pub fn helping(on: bool) {
    HELPER.with(|h| h.set(on));
    if !on {
        unpin();
    }
}

/// At a checkpoint of work on `lane`: a helper keeps to the lane's core
/// while the device is `crowded` (other work holds lanes) and runs
/// anywhere otherwise; the lane's own thread moves to the lane's core if
/// its work resumed on another lane while another of its threads decided.
/// Costs two thread-local reads when nothing changes.
#[inline]
pub fn follow(lane: usize, crowded: bool) {
    if !HELPER.with(|h| h.get()) {
        resumed(lane);
        return;
    }
    let want = crowded.then_some(lane);
    if PINNED.with(|p| p.get()) != want {
        match want {
            Some(l) => {
                pin(l);
            }
            None => unpin(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_threads_are_pinned_while_they_hold_a_lane_and_helpers_only_when_crowded() {
        std::thread::spawn(|| {
            let all = own_cores().expect("sched_getaffinity");
            if all.len() < 2 {
                eprintln!("SKIP: this host lets the worker use one core; lane pinning is off there");
                return;
            }
            let cores: &'static [usize] = Box::leak(all.clone().into_boxed_slice());
            TEST_CORES.with(|t| t.set(Some(cores)));
            {
                let _p = LanePin::new(1);
                assert_eq!(own_cores().unwrap(), vec![cores[1 % cores.len()]], "lane 1's thread runs on the second core");
                resumed(0);
                assert_eq!(own_cores().unwrap(), vec![cores[0]], "and moves with its lane");
            }
            assert_eq!(own_cores().unwrap(), all, "all cores again once the lane is given back");
            follow(0, true);
            assert_eq!(own_cores().unwrap(), all, "a thread that is not a helper does not follow");
            helping(true);
            follow(1, false);
            assert_eq!(own_cores().unwrap(), all, "a helper of a launch alone on the device runs anywhere");
            follow(1, true);
            assert_eq!(own_cores().unwrap(), vec![cores[1 % cores.len()]], "on its launch's core when others run");
            follow(1, false);
            assert_eq!(own_cores().unwrap(), all);
            follow(1, true);
            helping(false);
            assert_eq!(own_cores().unwrap(), all, "a helper leaves its launch's core when it stops helping");
        })
        .join()
        .unwrap();
    }
}
