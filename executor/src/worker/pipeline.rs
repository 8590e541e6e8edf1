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
//! that runs: about [`AHEAD`] of device time, judged from how long each
//! kernel took the last times it ran with the same launch shape (a
//! tenant's short element-wise kernels and its long matrix products are
//! judged apart), or, in a shape not seen yet, the longest the function
//! recently took in any; and nothing behind a kernel that has run for
//! longer than that. A function not timed yet is queued only when
//! nothing else is in flight. A lane asked back is free after the running kernel and at
//! most that much more. Each kernel's launch timeout counts from when the
//! kernel before it ended.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::backend::{BackendError, Backoff};

/// A batch takes no more launches after running this long: the lane goes
/// back to the scheduler, which may give it straight back.
pub const SLICE: Duration = Duration::from_millis(4);
/// Device time the batch keeps queued behind the running kernel, at most.
pub const AHEAD: Duration = Duration::from_millis(1);
/// Launches in flight in one batch, at most.
pub const MAX_DEPTH: usize = 32;
/// Kernels (by launch shape) a tenant's estimates remember, at most; as
/// many functions.
pub const MAX_KERNELS: usize = 4096;
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
    /// Which kernel `item` launches: the key of its time estimate.
    fn kernel(&self, item: &I) -> Kernel;
}

/// A kernel as its estimates know it: (its function, its launch shape:
/// grid, block and shared memory), each hashed.
pub type Kernel = (u64, u64);

/// How long a tenant's kernels took (ns), kept from batch to batch: by
/// function and launch shape, and by function alone for shapes not seen
/// yet. Bounded: past [`MAX_KERNELS`] keys, one is forgotten for each new
/// one (a forgotten function is queued alone again, once).
#[derive(Debug, Default)]
pub struct Estimates {
    by_shape: HashMap<Kernel, u64>,
    by_function: HashMap<u64, u64>,
}

/// Notes `took_ns` for `key` in `map`, forgetting another key if the map
/// is full.
fn note_in<K: std::hash::Hash + Eq + Copy>(map: &mut HashMap<K, u64>, key: K, took_ns: u64) {
    if !map.contains_key(&key) && map.len() >= MAX_KERNELS {
        if let Some(&k) = map.keys().next() {
            map.remove(&k);
        }
    }
    let e = map.entry(key).or_insert(0);
    *e = next_estimate(*e, took_ns);
}

impl Estimates {
    /// The estimate for `kernel` (0: not known).
    pub fn get(&self, kernel: Kernel) -> u64 {
        self.by_shape.get(&kernel).or_else(|| self.by_function.get(&kernel.0)).copied().unwrap_or(0)
    }

    /// Notes that `kernel` took `took_ns` ([`next_estimate`]).
    pub fn note(&mut self, kernel: Kernel, took_ns: u64) {
        note_in(&mut self.by_shape, kernel, took_ns);
        note_in(&mut self.by_function, kernel.0, took_ns);
    }

    /// Launch shapes remembered.
    pub fn len(&self) -> usize {
        self.by_shape.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_shape.is_empty()
    }
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub launches: u64,
    /// The most launches the batch had in flight at once.
    pub deepest: usize,
}

/// Whether a launch of a kernel estimated at `est_ns` (0: not known) may
/// go behind launches estimated at `ahead_ns` in all, `in_flight` of them.
pub fn fits(est_ns: u64, ahead_ns: u64, in_flight: usize) -> bool {
    in_flight == 0 || (in_flight < MAX_DEPTH && est_ns != 0 && ahead_ns.saturating_add(est_ns) <= AHEAD.as_nanos() as u64)
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
/// each to `done` once it ended. `next` takes the front launch only if
/// the test it is given holds for it (it fits behind those in flight).
/// `est` carries the tenant's kernel times from batch to batch.
pub fn run<I>(q: &mut impl Queue<I>, first: I, mut next: impl FnMut(&dyn Fn(&I) -> bool) -> Option<I>, mut done: impl FnMut(I, Result<(), BackendError>), est: &mut Estimates) -> Batch {
    let began = Instant::now();
    let mut stats = Batch::default();
    // (launch, ticket, when queued, kernel, its estimate)
    let mut flight: VecDeque<(I, u64, Instant, Kernel, u64)> = VecDeque::new();
    // The estimates of the launches in flight, added up.
    let mut ahead = 0u64;
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
        while held.is_none() && flight.len() < MAX_DEPTH {
            // Nothing goes behind a kernel that has run long.
            if !flight.is_empty() && head_since.elapsed() > AHEAD {
                break;
            }
            let item = match first.take() {
                Some(i) => i,
                None if began.elapsed() < SLICE && q.may_take() => {
                    let (queue, table, n) = (&*q, &*est, flight.len());
                    let fit = |i: &I| fits(table.get(queue.kernel(i)), ahead, n);
                    match next(&fit) {
                        Some(i) => i,
                        None => break,
                    }
                }
                None => break,
            };
            stats.launches += 1;
            let kernel = q.kernel(&item);
            match q.queue(&item) {
                Ok(Some(ticket)) => {
                    let now = Instant::now();
                    if flight.is_empty() {
                        head_since = now;
                    }
                    let e = est.get(kernel);
                    ahead = ahead.saturating_add(e);
                    flight.push_back((item, ticket, now, kernel, e));
                    stats.deepest = stats.deepest.max(flight.len());
                }
                Ok(None) => held = Some((item, Ok(()))),
                Err(e) => held = Some((item, Err(e))),
            }
        }
        let Some((item, ticket, queued, _, _)) = flight.front() else {
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
                head_since = now;
                if let Some((item, _, _, kernel, e)) = flight.pop_front() {
                    ahead = ahead.saturating_sub(e);
                    if r.is_ok() && !stalled {
                        est.note(kernel, now.duration_since(since).as_nanos() as u64);
                    }
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
        kernel: fn(u32) -> u64,
        /// Each launch queued, with how many were in flight before it.
        queued_behind: Vec<(u32, usize)>,
    }

    impl Sim {
        fn new(len: fn(u32) -> Duration) -> Sim {
            let now = Instant::now();
            Sim { ends: HashMap::new(), last_end: now, len, fault_at: None, faulted: false, sync_at: None, refuse: None, tickets: 0, take: true, kernel: |_| 0, queued_behind: Vec::new() }
        }
    }

    impl Queue<u32> for Sim {
        fn queue(&mut self, item: &u32) -> Result<Option<u64>, BackendError> {
            if self.refuse == Some(*item) {
                return Err(BackendError::new(CuResult::CUDA_ERROR_INVALID_VALUE, "refused"));
            }
            self.queued_behind.push((*item, self.ends.len()));
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

        fn kernel(&self, item: &u32) -> Kernel {
            ((self.kernel)(*item), 0)
        }
    }

    /// Estimates that say every kernel of key 0 takes `ns`.
    fn known(ns: u64) -> Estimates {
        let mut e = Estimates::default();
        e.note((0, 0), ns);
        e
    }

    fn batch(sim: &mut Sim, n: u32, est: &mut Estimates) -> (Batch, Vec<(u32, Option<CuResult>)>, u32) {
        let mut next = 1u32;
        let mut out = Vec::new();
        let b = run(
            sim,
            0,
            |fit| {
                (next < n && fit(&next)).then(|| {
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
        let mut est = Estimates::default();
        let (b, out, _) = batch(&mut sim, 100, &mut est);
        assert_eq!(out, (0..100).map(|i| (i, None)).collect::<Vec<_>>());
        assert_eq!(b.launches, 100);
        // 20 µs kernels, 1 ms ahead: the batch keeps many in flight.
        assert!(b.deepest > 8, "{b:?}");
        let e = est.get((0, 0));
        // Each is timed from when the last was seen to end, a little
        // after it did.
        assert!((15_000..1_000_000).contains(&e), "estimate {e} ns for 20 µs kernels");
    }

    #[test]
    fn one_launch_at_a_time_until_a_kernel_time_is_known_and_for_long_kernels() {
        let mut sim = Sim::new(|_| Duration::from_millis(2));
        let mut est = Estimates::default();
        let (b, out, _) = batch(&mut sim, 3, &mut est);
        // Two fit in the slice.
        assert_eq!(out.len() as u64, b.launches);
        assert!(b.launches >= 2, "{b:?}");
        assert_eq!(b.deepest, 1, "{b:?}");
        // Alone, anything goes; behind others, only a known kernel that
        // fits in what is left of AHEAD, and never past MAX_DEPTH.
        assert!(fits(0, 0, 0) && fits(2_000_000, 0, 0));
        assert!(!fits(0, 1, 1) && !fits(2_000_000, 1, 1));
        assert!(fits(500_000, 500_000, 1) && !fits(500_001, 500_000, 1));
        assert!(fits(1, 0, MAX_DEPTH - 1) && !fits(1, 0, MAX_DEPTH));
    }

    #[test]
    fn nothing_is_queued_behind_a_kernel_that_runs_long() {
        // The estimate says 200 µs (5 in flight), and falls as the 10 µs
        // kernels end, making room; kernel 3 takes 30 ms.
        let mut sim = Sim::new(|i| if i == 3 { Duration::from_millis(30) } else { Duration::from_micros(10) });
        let mut est = known(200_000);
        let mut next = 1u32;
        let mut queued_while_long = 0;
        let long_start = std::cell::Cell::new(None::<Instant>);
        let b = run(
            &mut sim,
            0,
            |fit| {
                if !fit(&next) {
                    return None;
                }
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
            &mut est,
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
        assert!(e > 500_000 && !fits(e, e, 1), "{e}");
        assert_eq!(next_estimate(7, 0), 7);
    }

    #[test]
    fn a_fault_ends_the_faulting_launch_and_every_one_after_it() {
        let mut sim = Sim::new(|_| Duration::from_micros(50));
        sim.fault_at = Some(5);
        let mut est = known(50_000);
        let (_, out, _) = batch(&mut sim, 10, &mut est);
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
        let mut est = known(50_000);
        let (_, out, _) = batch(&mut sim, 12, &mut est);
        assert_eq!(out.iter().map(|(i, _)| *i).collect::<Vec<_>>(), (0..12).collect::<Vec<_>>());
        assert_eq!(out[4].1, Some(CuResult::CUDA_ERROR_INVALID_VALUE));
        assert!(out.iter().filter(|(i, _)| *i != 4).all(|(_, c)| c.is_none()), "{out:?}");
    }

    #[test]
    fn a_lane_asked_back_takes_nothing_more() {
        let mut sim = Sim::new(|_| Duration::from_micros(10));
        sim.take = false;
        let mut est = known(10_000);
        let (b, out, next) = batch(&mut sim, 50, &mut est);
        assert_eq!((b.launches, out.len(), next), (1, 1, 1));
    }

    #[test]
    fn a_batch_ends_after_its_slice() {
        let mut sim = Sim::new(|_| Duration::from_micros(100));
        let mut est = known(100_000);
        let (b, out, _) = batch(&mut sim, 100_000, &mut est);
        assert_eq!(out.len() as u64, b.launches);
        // 100 µs kernels, queued back to back: what fits in the slice, and
        // at most a full queue ahead when it ended.
        let most = (SLICE.as_micros() / 100 + AHEAD.as_micros() / 100) as u64 + 1;
        assert!(b.launches <= most, "{} launches in one slice (at most {most})", b.launches);
    }

    #[test]
    fn a_long_kernel_is_not_queued_behind_short_ones_once_its_time_is_known() {
        // Kernel 1 (every tenth launch) takes 3 ms, the others 10 µs: one
        // estimate for both would queue the long one behind many short
        // ones once the short ones had pulled it down.
        let mut sim = Sim::new(|i| if i % 10 == 5 { Duration::from_millis(3) } else { Duration::from_micros(10) });
        sim.kernel = |i| u64::from(i % 10 == 5);
        let mut est = Estimates::default();
        let mut done = 0;
        while done < 60 {
            let start = done;
            let mut next = start + 1;
            let b = run(
                &mut sim,
                start,
                |fit| {
                    (next < 60 && fit(&next)).then(|| {
                        next += 1;
                        next - 1
                    })
                },
                |_, r| assert!(r.is_ok()),
                &mut est,
            );
            done = next;
            assert!(b.launches > 0);
        }
        let long: Vec<_> = sim.queued_behind.iter().filter(|(i, _)| i % 10 == 5).collect();
        assert_eq!(long.len(), 6);
        assert!(long.iter().all(|(_, behind)| *behind == 0), "long kernels queued behind others: {long:?}");
        // The short ones were still queued many at a time.
        assert!(sim.queued_behind.iter().any(|(_, behind)| *behind > 4), "{:?}", sim.queued_behind);
        assert_eq!(est.len(), 2);
        assert!(est.get((1, 0)) >= 3_000_000 && est.get((0, 0)) < est.get((1, 0)), "{est:?}");
    }

    #[test]
    fn estimates_forget_one_kernel_for_each_new_one_past_their_bound() {
        let mut est = Estimates::default();
        for k in 0..MAX_KERNELS as u64 + 100 {
            est.note((k, 0), 1_000);
        }
        assert_eq!((est.len(), est.by_function.len()), (MAX_KERNELS, MAX_KERNELS));
        let last = (MAX_KERNELS as u64 + 99, 0);
        assert_eq!(est.get(last), 1_000);
        est.note(last, 5_000);
        assert_eq!((est.len(), est.get(last)), (MAX_KERNELS, 5_000));
    }

    #[test]
    fn a_new_shape_of_a_known_function_takes_the_functions_longest_recent_time() {
        let mut est = Estimates::default();
        est.note((7, 1), 20_000);
        est.note((7, 2), 3_000_000);
        est.note((7, 1), 20_000);
        // Each known shape keeps its own time.
        assert_eq!((est.get((7, 1)), est.get((7, 2))), (20_000, 3_000_000));
        // A new shape of function 7 is judged long, not unknown, so it is
        // neither queued behind others as if short nor held back to run
        // alone for being new.
        assert!(est.get((7, 3)) > 2_000_000, "{est:?}");
        assert_eq!(est.get((8, 1)), 0);
    }
}
