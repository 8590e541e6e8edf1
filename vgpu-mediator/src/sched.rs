//! The device worker's scheduler. Every kernel and copy runs inside
//! [`Scheduler::run`], which hands out execution lanes (one per host core
//! by default) and accounts device time per call.
//!
//! The order in which waiting work gets a lane is a [`Policy`]: FIFO, or
//! [`WeightedFair`] (stride scheduling on device time, the workers'
//! default), which gives each tenant with work waiting a share of the
//! lanes in proportion to its weight.

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
    /// Accounts `dt` of device time that work of `tenant` just used.
    fn charge(&self, _tenant: &str, _weight: u32, _dt: Duration) {}
}

/// First come, first served.
pub struct Fifo;

impl Policy for Fifo {
    fn pick(&self, _queue: &VecDeque<Waiting>) -> usize {
        0
    }
}

/// Weighted fair sharing by stride scheduling on measured device time:
/// each tenant has a pass, advanced by the device time its work used
/// divided by its weight; the waiting entry whose tenant has the lowest
/// pass runs next (the earliest among equals). A tenant coming back from
/// idle starts at the current virtual time, the pass of the last work
/// picked, so time it did not use is not banked. Work-conserving: a free
/// lane never waits while work is queued.
#[derive(Default)]
pub struct WeightedFair {
    state: Mutex<Passes>,
}

#[derive(Default)]
struct Passes {
    /// Virtual time: the (lifted) pass of the last entry picked.
    now: f64,
    pass: std::collections::HashMap<String, f64>,
}

impl WeightedFair {
    pub fn new() -> WeightedFair {
        WeightedFair::default()
    }

    /// A tenant's pass, lifted to the current virtual time (what it would
    /// be compared with).
    pub fn pass_of(&self, tenant: &str) -> f64 {
        let g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.pass.get(tenant).copied().unwrap_or(g.now).max(g.now)
    }

    /// Work with pass `pass` was chosen: virtual time moves up to it.
    pub fn advance(&self, pass: f64) {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.now = g.now.max(pass);
    }

    /// Each tenant's pass relative to the current virtual time (tests and
    /// diagnostics).
    pub fn lag(&self, tenant: &str) -> f64 {
        let g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.pass.get(tenant).copied().unwrap_or(g.now) - g.now
    }
}

impl Policy for WeightedFair {
    fn pick(&self, queue: &VecDeque<Waiting>) -> usize {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = g.now;
        let lifted = |p: Option<&f64>| p.copied().unwrap_or(now).max(now);
        let (i, pass) = queue.iter().enumerate().map(|(i, w)| (i, lifted(g.pass.get(&w.tenant)))).fold((0, f64::INFINITY), |best, (i, p)| if p < best.1 { (i, p) } else { best });
        g.now = pass.max(now);
        i
    }

    fn charge(&self, tenant: &str, weight: u32, dt: Duration) {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = g.now;
        // Bounded by the device's tenants; a pass far behind is as good as
        // none, so the map is pruned of them when it grows.
        if g.pass.len() > 4096 {
            g.pass.retain(|_, p| *p >= now);
        }
        let p = g.pass.entry(tenant.to_string()).or_insert(now);
        *p = p.max(now) + dt.as_nanos() as f64 / weight.max(1) as f64;
    }
}

pub struct Scheduler {
    lanes: usize,
    policy: std::sync::Arc<dyn Policy>,
    inner: Mutex<Inner>,
    cv: Condvar,
    busy_ns: AtomicU64,
}

struct Inner {
    running: usize,
    queue: VecDeque<Waiting>,
    next: u64,
}

struct Lane<'a>(&'a Scheduler, Instant, &'a str, u32);

impl Drop for Lane<'_> {
    fn drop(&mut self) {
        // Released even if the work panicked, so the device never wedges.
        let s = self.0;
        let dt = self.1.elapsed();
        s.busy_ns.fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
        s.policy.charge(self.2, self.3, dt);
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
    pub fn new(lanes: usize, policy: std::sync::Arc<dyn Policy>) -> Scheduler {
        Scheduler { lanes: lanes.max(1), policy, inner: Mutex::new(Inner { running: 0, queue: VecDeque::new(), next: 0 }), cv: Condvar::new(), busy_ns: AtomicU64::new(0) }
    }

    /// Runs `f` once a lane is granted; returns its result and run time.
    pub fn run<T>(&self, tenant: &str, weight: u32, f: impl FnOnce() -> T) -> (T, Duration) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.queue.is_empty() && g.running < self.lanes {
            // A free lane and nobody waiting: no queue entry needed.
            g.running += 1;
            drop(g);
            let lane = Lane(self, Instant::now(), tenant, weight);
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
        let lane = Lane(self, Instant::now(), tenant, weight);
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
        let s = Arc::new(Scheduler::new(2, Arc::new(Fifo)));
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

    /// Saturating tenants with `weights`, each from two threads submitting
    /// work of 1 ms on one lane for `run`: each tenant's device time.
    fn shares(weights: &[u32], run: Duration) -> Vec<f64> {
        let s = Arc::new(Scheduler::new(1, Arc::new(WeightedFair::new())));
        let used: Arc<Vec<AtomicU64>> = Arc::new(weights.iter().map(|_| AtomicU64::new(0)).collect());
        let stop = Instant::now() + run;
        let hs: Vec<_> = weights
            .iter()
            .enumerate()
            .flat_map(|(i, w)| std::iter::repeat_n((i, *w), 2))
            .map(|(i, w)| {
                let (s, used) = (s.clone(), used.clone());
                std::thread::spawn(move || {
                    while Instant::now() < stop {
                        let (_, dt) = s.run(&format!("t{i}"), w, || std::thread::sleep(Duration::from_millis(1)));
                        used[i].fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let total: u64 = used.iter().map(|u| u.load(Ordering::Relaxed)).sum();
        used.iter().map(|u| u.load(Ordering::Relaxed) as f64 / total as f64).collect()
    }

    #[test]
    fn weighted_fair_shares_follow_weights() {
        // Tolerances wide enough not to flake on a loaded machine; the
        // benchmark (vgpu-bench --shares) measures the real error.
        let got = shares(&[1, 3], Duration::from_millis(600));
        assert!((got[0] - 0.25).abs() < 0.08 && (got[1] - 0.75).abs() < 0.08, "1:3 gave {got:?}");
        let got = shares(&[1, 1, 2, 4], Duration::from_millis(800));
        for (g, want) in got.iter().zip([0.125, 0.125, 0.25, 0.5]) {
            assert!((g - want).abs() < 0.08, "1:1:2:4 gave {got:?}");
        }
    }

    #[test]
    fn an_idle_tenant_does_not_bank_time() {
        let p = WeightedFair::new();
        p.charge("busy", 1, Duration::from_millis(100));
        let q: VecDeque<Waiting> = [Waiting { ticket: 0, tenant: "busy".into(), weight: 1 }, Waiting { ticket: 1, tenant: "new".into(), weight: 1 }].into();
        // The newcomer goes first (it has used nothing), but only from now.
        assert_eq!(p.pick(&q), 1);
        p.charge("new", 1, Duration::from_millis(1));
        assert!(p.lag("new") >= 0.0);
        assert!(p.lag("busy") > p.lag("new"));
    }
}
