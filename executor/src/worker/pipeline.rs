//! Launches queued back to back on a device that runs them on its own (a
//! GPU): the executor puts the next kernel on the tenant's stream while the
//! last one runs, and completes each launch's ring entry when the device
//! says it ended, so no launch waits for a round trip through the
//! executor's threads.
//!
//! A batch runs under one lane. It takes launches from the front of one of
//! the tenant's streams while they keep coming, and stops taking (then
//! waits for what it queued) when:
//! - the lane is asked back, or the batch has run for [`SLICE`];
//! - the next piece of work is not a launch (copies and records keep
//!   their order behind the launches, and run as before);
//! - the stream is empty.
//!
//! What a device runs cannot be taken back once queued: only the end of
//! the executor stops it. So the batch keeps little ahead of the kernel
//! that runs: about [`AHEAD`] of device time, judged from how long the
//! tenant's recent kernels took, and nothing behind a kernel that has run
//! for longer than that. A lane asked back is free after the running
//! kernel and at most that much more; until the first kernel's time is
//! known, one launch is queued at a time. Each kernel's launch timeout
//! counts from when the kernel before it ended.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::backend::{BackendError, Backoff};

/// A batch takes no more launches after running this long: the lane goes
/// back to the scheduler, which may give it straight back.
pub const SLICE: Duration = Duration::from_millis(4);
/// Device time the batch keeps queued behind the running kernel, at most.
pub const AHEAD: Duration = Duration::from_millis(1);
/// Launches in flight in one batch, at most.
pub const MAX_DEPTH: usize = 32;
/// The longest nap between two looks at an unfinished kernel.
const LAST_NAP: Duration = Duration::from_millis(1);
/// A kernel seen to end after the batch was held up this long (between
/// two looks, or in one) is not timed: the time is not the kernel's.
const STALL: Duration = Duration::from_millis(3);

/// The device side of a batch.
pub trait Queue<I> {
    /// Queues the launch `item` carries. `Ok(Some(ticket))`: queued, to be
    /// followed with [`Queue::finished`]; `Ok(None)`: it ran to completion.
    fn queue(&mut self, item: &I) -> Result<Option<u64>, BackendError>;
    /// Whether the launch of `ticket` ended: `Ok(false)` while it runs.
    /// An error (its fault, an earlier one's, or its launch timeout counted
    /// from `since`) ends the ticket too.
    fn finished(&mut self, item: &I, ticket: u64, since: Instant) -> Result<bool, BackendError>;
    /// Whether another launch may be taken (false once the lane is asked
    /// back).
    fn may_take(&self) -> bool;
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub launches: u64,
    /// The most launches the batch had in flight at once.
    pub deepest: usize,
}

/// How many launches may be in flight when the tenant's kernels take
/// `est_ns` each (0: not known yet).
pub fn depth(est_ns: u64) -> usize {
    if est_ns == 0 {
        return 1;
    }
    ((AHEAD.as_nanos() as u64 / est_ns) as usize).clamp(1, MAX_DEPTH)
}

/// The estimate after a kernel that took `took_ns`: up at once to a
/// longer kernel, down by an eighth of the gap per shorter one, so a
/// tenant whose kernels grow queues fewer at once, and one whose kernels
/// shrink queues more only as they keep being short.
pub fn next_estimate(old_ns: u64, took_ns: u64) -> u64 {
    let took = took_ns.max(1);
    if took >= old_ns {
        took
    } else {
        old_ns - (old_ns - took) / 8
    }
}

/// Runs `first` and the launches `next` hands out, in order, reporting
/// each to `done` once it ended. `est` carries the tenant's recent kernel
/// time (ns) from batch to batch.
pub fn run<I>(q: &mut impl Queue<I>, first: I, mut next: impl FnMut() -> Option<I>, mut done: impl FnMut(I, Result<(), BackendError>), est: &AtomicU64) -> Batch {
    let began = Instant::now();
    let mut stats = Batch::default();
    let mut flight: VecDeque<(I, u64, Instant)> = VecDeque::new();
    let mut first = Some(first);
    // A launch that ran to completion or was refused, reported once all
    // before it are: the tenant sees its entries end in order.
    let mut held: Option<(I, Result<(), BackendError>)> = None;
    // When the kernel at the head could start: when the one before ended.
    let mut head_since = began;
    let mut wait: Option<Backoff> = None;
    // When the batch last looked at a kernel.
    let mut looked = began;
    loop {
        while held.is_none() && flight.len() < depth(est.load(Ordering::Relaxed)) {
            // Nothing goes behind a kernel that has run long.
            if !flight.is_empty() && head_since.elapsed() > AHEAD {
                break;
            }
            let item = match first.take() {
                Some(i) => i,
                None if began.elapsed() < SLICE && q.may_take() => match next() {
                    Some(i) => i,
                    None => break,
                },
                None => break,
            };
            stats.launches += 1;
            match q.queue(&item) {
                Ok(Some(ticket)) => {
                    let now = Instant::now();
                    if flight.is_empty() {
                        head_since = now;
                    }
                    flight.push_back((item, ticket, now));
                    stats.deepest = stats.deepest.max(flight.len());
                }
                Ok(None) => held = Some((item, Ok(()))),
                Err(e) => held = Some((item, Err(e))),
            }
        }
        let Some((item, ticket, queued)) = flight.front() else {
            if let Some((item, r)) = held.take() {
                head_since = Instant::now();
                done(item, r);
                continue;
            }
            break;
        };
        let since = head_since.max(*queued);
        let asked = Instant::now();
        let r = q.finished(item, *ticket, since);
        let stalled = asked.duration_since(looked) > STALL || asked.elapsed() > STALL;
        looked = Instant::now();
        match r {
            Ok(false) => wait.get_or_insert_with(|| Backoff::new(LAST_NAP)).pause(),
            r => {
                let now = Instant::now();
                wait = None;
                if r.is_ok() && !stalled {
                    let took = now.duration_since(since).as_nanos() as u64;
                    est.store(next_estimate(est.load(Ordering::Relaxed), took), Ordering::Relaxed);
                }
                head_since = now;
                if let Some((item, _, _)) = flight.pop_front() {
                    done(item, r.map(|_| ()));
                }
            }
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use virtio_gpu_compute::CuResult;

    /// A device that runs queued kernels one after another in simulated
    /// time: kernel `i` takes `len(i)`; a fault in one ends every later
    /// query with it (CUDA's sticky errors).
    struct Sim {
        /// ticket -> (item, when it ends)
        ends: HashMap<u64, (u32, Instant)>,
        last_end: Instant,
        len: fn(u32) -> Duration,
        fault_at: Option<u32>,
        faulted: bool,
        sync_at: Option<u32>,
        refuse: Option<u32>,
        tickets: u64,
        take: bool,
    }

    impl Sim {
        fn new(len: fn(u32) -> Duration) -> Sim {
            let now = Instant::now();
            Sim { ends: HashMap::new(), last_end: now, len, fault_at: None, faulted: false, sync_at: None, refuse: None, tickets: 0, take: true }
        }
    }

    impl Queue<u32> for Sim {
        fn queue(&mut self, item: &u32) -> Result<Option<u64>, BackendError> {
            if self.refuse == Some(*item) {
                return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "refused"));
            }
            let end = self.last_end.max(Instant::now()) + (self.len)(*item);
            self.last_end = end;
            if self.sync_at == Some(*item) {
                std::thread::sleep(end.saturating_duration_since(Instant::now()));
                return Ok(None);
            }
            self.tickets += 1;
            self.ends.insert(self.tickets, (*item, end));
            Ok(Some(self.tickets))
        }

        fn finished(&mut self, _item: &u32, ticket: u64, _since: Instant) -> Result<bool, BackendError> {
            let (item, end) = self.ends[&ticket];
            if Instant::now() < end {
                return Ok(false);
            }
            self.ends.remove(&ticket);
            if self.fault_at == Some(item) {
                self.faulted = true;
            }
            if self.faulted {
                return Err(BackendError::new(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, "fault"));
            }
            Ok(true)
        }

        fn may_take(&self) -> bool {
            self.take
        }
    }

    fn batch(sim: &mut Sim, n: u32, est: &AtomicU64) -> (Batch, Vec<(u32, Option<CuResult>)>, u32) {
        let mut next = 1u32;
        let mut out = Vec::new();
        let b = run(
            sim,
            0,
            || {
                (next < n).then(|| {
                    next += 1;
                    next - 1
                })
            },
            |i, r| out.push((i, r.err().map(|e| e.code))),
            est,
        );
        (b, out, next)
    }

    #[test]
    fn short_kernels_are_queued_ahead_and_end_in_order() {
        let mut sim = Sim::new(|_| Duration::from_micros(20));
        let est = AtomicU64::new(0);
        let (b, out, _) = batch(&mut sim, 100, &est);
        assert_eq!(out, (0..100).map(|i| (i, None)).collect::<Vec<_>>());
        assert_eq!(b.launches, 100);
        // 20 µs kernels, 1 ms ahead: the batch keeps many in flight.
        assert!(b.deepest > 8, "{b:?}");
        let e = est.load(Ordering::Relaxed);
        // Each is timed from when the last was seen to end, a little
        // after it did.
        assert!((15_000..1_000_000).contains(&e), "estimate {e} ns for 20 µs kernels");
    }

    #[test]
    fn one_launch_at_a_time_until_a_kernel_time_is_known_and_for_long_kernels() {
        let mut sim = Sim::new(|_| Duration::from_millis(2));
        let est = AtomicU64::new(0);
        let (b, out, _) = batch(&mut sim, 3, &est);
        // Two fit in the slice.
        assert_eq!(out.len() as u64, b.launches);
        assert!(b.launches >= 2, "{b:?}");
        assert_eq!(b.deepest, 1, "{b:?}");
        assert_eq!(depth(0), 1);
        assert_eq!(depth(2_000_000), 1);
        assert_eq!(depth(1), MAX_DEPTH);
    }

    #[test]
    fn nothing_is_queued_behind_a_kernel_that_runs_long() {
        // The estimate says 200 µs (5 in flight), and falls as the 10 µs
        // kernels end, making room; kernel 3 takes 30 ms.
        let mut sim = Sim::new(|i| if i == 3 { Duration::from_millis(30) } else { Duration::from_micros(10) });
        let est = AtomicU64::new(200_000);
        let mut next = 1u32;
        let mut queued_while_long = 0;
        let long_start = std::cell::Cell::new(None::<Instant>);
        let b = run(
            &mut sim,
            0,
            || {
                if let Some(t) = long_start.get() {
                    if t.elapsed() > Duration::from_millis(2) {
                        queued_while_long += 1;
                    }
                }
                if next == 3 {
                    long_start.set(Some(Instant::now()));
                }
                (next < 60).then(|| {
                    next += 1;
                    next - 1
                })
            },
            |_, r| assert!(r.is_ok()),
            &est,
        );
        // Launches queued before kernel 3 started may sit behind it; none
        // is taken while it has run for long (and the slice is over by the
        // time it ends).
        assert!(b.deepest <= MAX_DEPTH);
        assert_eq!(queued_while_long, 0, "launches taken while a long kernel ran");
    }

    #[test]
    fn the_estimate_rises_at_once_and_falls_slowly() {
        assert_eq!(next_estimate(0, 5_000), 5_000);
        assert_eq!(next_estimate(10_000, 2_000_000), 2_000_000);
        assert_eq!(next_estimate(2_000_000, 10_000), 2_000_000 - 1_990_000 / 8);
        let mut e = 2_000_000;
        for _ in 0..10 {
            e = next_estimate(e, 10_000);
        }
        // Ten short kernels later, still more than half way up.
        assert!(e > 500_000 && depth(e) <= 2, "{e}");
        assert_eq!(next_estimate(7, 0), 7);
    }

    #[test]
    fn a_fault_ends_the_faulting_launch_and_every_one_after_it() {
        let mut sim = Sim::new(|_| Duration::from_micros(50));
        sim.fault_at = Some(5);
        let est = AtomicU64::new(50_000);
        let (_, out, _) = batch(&mut sim, 10, &est);
        let codes: Vec<_> = out.iter().map(|(_, c)| *c).collect();
        assert_eq!(out.iter().map(|(i, _)| *i).collect::<Vec<_>>(), (0..out.len() as u32).collect::<Vec<_>>());
        assert!(codes[..5].iter().all(Option::is_none), "{out:?}");
        assert!(codes[5..].iter().all(|c| *c == Some(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS)), "{out:?}");
    }

    #[test]
    fn a_refused_or_synchronous_launch_is_reported_after_the_ones_before_it() {
        let mut sim = Sim::new(|_| Duration::from_micros(100));
        sim.refuse = Some(4);
        sim.sync_at = Some(7);
        let est = AtomicU64::new(50_000);
        let (_, out, _) = batch(&mut sim, 12, &est);
        assert_eq!(out.iter().map(|(i, _)| *i).collect::<Vec<_>>(), (0..12).collect::<Vec<_>>());
        assert_eq!(out[4].1, Some(CuResult::CUDA_ERROR_INVALID_VALUE));
        assert!(out.iter().filter(|(i, _)| *i != 4).all(|(_, c)| c.is_none()), "{out:?}");
    }

    #[test]
    fn a_lane_asked_back_takes_nothing_more() {
        let mut sim = Sim::new(|_| Duration::from_micros(10));
        sim.take = false;
        let est = AtomicU64::new(10_000);
        let (b, out, next) = batch(&mut sim, 50, &est);
        assert_eq!((b.launches, out.len(), next), (1, 1, 1));
    }

    #[test]
    fn a_batch_ends_after_its_slice() {
        let mut sim = Sim::new(|_| Duration::from_micros(100));
        let est = AtomicU64::new(100_000);
        let (b, out, _) = batch(&mut sim, 100_000, &est);
        assert_eq!(out.len() as u64, b.launches);
        // 100 µs kernels, queued back to back: what fits in the slice, and
        // at most a full queue ahead when it ended.
        let most = (SLICE.as_micros() / 100) as u64 + depth(100_000) as u64 + 1;
        assert!(b.launches <= most, "{} launches in one slice (at most {most})", b.launches);
    }
}
