//! The device worker's scheduler. Every kernel and copy runs inside
//! [`Scheduler::run`], which hands out execution lanes (one per host core
//! by default) and accounts device time per call.
//!
//! The order in which waiting work gets a lane is a [`Policy`]. This stage
//! ships FIFO; weighted fair sharing plugs in here as another policy,
//! without touching callers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// A unit of work waiting for a lane.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub ticket: u64,
    pub tenant: String,
    pub weight: u32,
}

/// Chooses which waiting entry runs next.
pub trait Policy: Send + Sync {
    /// Index into `queue` (never empty) of the entry to run next.
    fn pick(&self, queue: &VecDeque<Waiting>) -> usize;
}

/// First come, first served.
pub struct Fifo;

impl Policy for Fifo {
    fn pick(&self, _queue: &VecDeque<Waiting>) -> usize {
        0
    }
}

pub struct Scheduler {
    lanes: usize,
    policy: Box<dyn Policy>,
    inner: Mutex<Inner>,
    cv: Condvar,
    busy_ns: AtomicU64,
}

struct Inner {
    running: usize,
    queue: VecDeque<Waiting>,
    next: u64,
}

struct Lane<'a>(&'a Scheduler, Instant);

impl Drop for Lane<'_> {
    fn drop(&mut self) {
        // Released even if the work panicked, so the device never wedges.
        let s = self.0;
        s.busy_ns.fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let mut g = s.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.running -= 1;
        let waiting = !g.queue.is_empty();
        drop(g);
        // A wake-up costs a system call: only when someone waits.
        if waiting {
            s.cv.notify_all();
        }
    }
}

impl Scheduler {
    pub fn new(lanes: usize, policy: Box<dyn Policy>) -> Scheduler {
        Scheduler { lanes: lanes.max(1), policy, inner: Mutex::new(Inner { running: 0, queue: VecDeque::new(), next: 0 }), cv: Condvar::new(), busy_ns: AtomicU64::new(0) }
    }

    /// Runs `f` once a lane is granted; returns its result and run time.
    pub fn run<T>(&self, tenant: &str, weight: u32, f: impl FnOnce() -> T) -> (T, Duration) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.queue.is_empty() && g.running < self.lanes {
            // A free lane and nobody waiting: no queue entry needed.
            g.running += 1;
            drop(g);
            let lane = Lane(self, Instant::now());
            let out = f();
            let dt = lane.1.elapsed();
            drop(lane);
            return (out, dt);
        }
        let ticket = g.next;
        g.next += 1;
        g.queue.push_back(Waiting { ticket, tenant: tenant.to_string(), weight });
        loop {
            if g.running < self.lanes {
                let i = self.policy.pick(&g.queue).min(g.queue.len() - 1);
                if g.queue[i].ticket == ticket {
                    g.queue.remove(i);
                    g.running += 1;
                    break;
                }
            }
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        drop(g);
        let lane = Lane(self, Instant::now());
        let out = f();
        let dt = lane.1.elapsed();
        drop(lane);
        (out, dt)
    }

    /// Total time lanes were busy, summed over lanes.
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed))
    }

    pub fn lanes(&self) -> usize {
        self.lanes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn never_runs_more_than_lanes_at_once_and_accounts_time() {
        let s = Arc::new(Scheduler::new(2, Box::new(Fifo)));
        let now = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let (s, now, peak) = (s.clone(), now.clone(), peak.clone());
                std::thread::spawn(move || {
                    s.run(&format!("t{i}"), 1, || {
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(n, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(5));
                        now.fetch_sub(1, Ordering::SeqCst);
                    })
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert!(peak.load(Ordering::SeqCst) <= 2);
        assert!(s.busy() >= Duration::from_millis(40));
    }
}
