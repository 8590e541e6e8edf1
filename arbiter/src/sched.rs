//! The device worker's scheduler. Every kernel and copy runs inside
//! [`Scheduler::run`], which hands out execution lanes (one per host core
//! by default) and accounts device time per call.
//!
//! The order in which waiting work gets a lane is a [`Policy`]: FIFO, or
//! [`WeightedFair`] (the workers' default): stride scheduling on measured
//! device time, with per-tenant weights, hard caps and priority classes
//! (docs/scheduling.md).
//!
//! Work that runs long is preempted: the CPU device's interpreter calls
//! [`Running::checkpoint`] between blocks and every few thousand
//! instructions, and there the running work gives its lane to waiting work
//! the policy puts first (after a quantum, at once for a higher priority
//! class), or stops while its tenant is over its cap. It resumes where it
//! stopped once the policy picks it again.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use vgpu_api::tenant::Priority;

/// Which class goes first: the higher rank.
fn rank(p: Priority) -> u8 {
    match p {
        Priority::Latency => 2,
        Priority::Normal => 1,
        Priority::Batch => 0,
    }
}

/// How far ahead of the others, in virtual time, the class may run
/// before it stops going first.
fn lead(p: Priority) -> f64 {
    match p {
        Priority::Latency => CLASS_LEAD,
        Priority::Normal => 0.0,
        Priority::Batch => -CLASS_LEAD,
    }
}

/// A class's lead: 20 ms of device time at weight 1, in virtual-time ns.
const CLASS_LEAD: f64 = 20e6;
/// Running work is charged at least this often while it runs.
const CHARGE_EVERY: Duration = Duration::from_micros(250);
/// Work of the same class is preempted only after running this long in
/// one turn, so two saturating tenants do not trade the lane at every
/// checkpoint.
pub const QUANTUM: Duration = Duration::from_millis(1);
/// A capped tenant may run ahead of its rate by this much wall time.
const CAP_BURST: Duration = Duration::from_millis(20);
/// Longest a waiter sleeps before it looks again (a guard; every change
/// that matters also wakes it).
const RECHECK: Duration = Duration::from_millis(50);

/// A tenant's scheduling parameters, set when it is added and changeable
/// live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    pub weight: u32,
    /// Hard cap: the percentage of the device's lane time the tenant never
    /// exceeds, even alone (None: uncapped).
    pub cap: Option<u32>,
    pub priority: Priority,
}

impl Default for Share {
    fn default() -> Share {
        Share { weight: 1, cap: None, priority: Priority::Normal }
    }
}

/// A unit of work waiting for a lane.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub ticket: u64,
    pub tenant: String,
}

/// What a policy decides for the waiting queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Index into the queue of the entry to run next.
    Run(usize),
    /// Nothing may run before this much time has passed (every waiting
    /// tenant is over its cap).
    Wait(Duration),
}

/// Chooses which waiting entry runs next.
pub trait Policy: Send + Sync {
    /// What runs next of `queue` (never empty).
    fn pick(&self, queue: &VecDeque<Waiting>) -> Pick;
    /// Accounts `dt` of device time that work of `tenant` just used.
    fn charge(&self, _tenant: &str, _dt: Duration) {}
    /// How long the tenant must wait before it may run (over its cap).
    fn throttled(&self, _tenant: &str) -> Option<Duration> {
        None
    }
    /// Whether `waiting`'s work may take the lane of `running`'s before
    /// the quantum is up (a higher priority class).
    fn urgent(&self, _waiting: &str, _running: &str) -> bool {
        false
    }
    fn configure(&self, _tenant: &str, _share: Share) {}
    fn forget(&self, _tenant: &str) {}
    /// Work of `tenant` entered the scheduler (queued or running).
    fn begin(&self, _tenant: &str) {}
    /// That work left it.
    fn end(&self, _tenant: &str) {}
}

/// First come, first served.
pub struct Fifo;

impl Policy for Fifo {
    fn pick(&self, _queue: &VecDeque<Waiting>) -> Pick {
        Pick::Run(0)
    }
}

/// Weighted fair sharing by stride scheduling on measured device time.
///
/// - Each tenant has a pass, advanced by the device time its work used
///   divided by its weight; the waiting entry whose tenant has the lowest
///   key (its pass, less its class's lead) runs next, the earliest among
///   equals.
/// - Virtual time is the lowest pass among tenants with work in the
///   scheduler. A tenant coming back from idle starts no further behind it
///   than [`IDLE_SLACK`], so time it did not use is not banked (beyond the
///   slack, which spares a tenant whose next launch comes a moment after
///   its last one ended).
/// - A capped tenant draws on a token bucket filled at its cap times the
///   device's lanes; while it is empty the tenant's work does not run, even
///   on an idle device.
/// - Otherwise work-conserving: a free lane never waits while runnable
///   work is queued.
pub struct WeightedFair {
    state: Mutex<Passes>,
    lanes: f64,
}

struct Passes {
    /// Virtual time when it was last computed (kept while nothing runs).
    now: f64,
    tenants: HashMap<String, Account>,
}

impl Passes {
    /// The tenant's account, made (unconfigured) if it has none. Accounts
    /// made this way are pruned once idle when the map grows large, so it
    /// stays bounded.
    fn account(&mut self, tenant: &str, now: f64) -> &mut Account {
        if self.tenants.len() > 4096 && !self.tenants.contains_key(tenant) {
            self.tenants.retain(|_, a| a.configured || a.active > 0);
        }
        self.tenants.entry(tenant.to_string()).or_insert_with(|| Account::new(now, Share::default(), false))
    }

    /// Virtual time: the lowest pass among active tenants not over their
    /// cap (a throttled tenant's pass advances only at its cap's rate and
    /// must not hold virtual time back for the others).
    fn now(&mut self) -> f64 {
        if let Some(low) = self.tenants.values().filter(|a| a.active > 0 && (a.share.cap.is_none() || a.tokens >= 0.0)).map(|a| a.pass).min_by(f64::total_cmp) {
            self.now = self.now.max(low);
        }
        self.now
    }
}

/// How far behind virtual time a tenant coming back from idle may start,
/// in virtual ns (2 ms of device time at weight 1).
pub const IDLE_SLACK: f64 = 2e6;

struct Account {
    pass: f64,
    /// Entries of the tenant's work in the scheduler.
    active: u32,
    share: Share,
    /// Lane-ns the tenant may still use now (capped tenants).
    tokens: f64,
    refilled: Instant,
    /// Set through `configure` (kept until `forget`), not made by a charge.
    configured: bool,
}

impl Account {
    fn new(now: f64, share: Share, configured: bool) -> Account {
        Account { pass: now, active: 0, share, tokens: 0.0, refilled: Instant::now(), configured }
    }

    /// Lane-ns per wall ns the tenant may use (capped tenants).
    fn rate(&self, lanes: f64) -> Option<f64> {
        self.share.cap.map(|c| c.min(100) as f64 / 100.0 * lanes)
    }

    fn refill(&mut self, lanes: f64, at: Instant) {
        if let Some(rate) = self.rate(lanes) {
            let dt = at.saturating_duration_since(self.refilled).as_nanos() as f64;
            self.tokens = (self.tokens + dt * rate).min(rate * CAP_BURST.as_nanos() as f64);
        }
        self.refilled = self.refilled.max(at);
    }

    /// Time until a capped tenant's bucket is no longer empty.
    fn throttled(&mut self, lanes: f64, at: Instant) -> Option<Duration> {
        let rate = self.rate(lanes)?;
        self.refill(lanes, at);
        if self.tokens >= 0.0 {
            return None;
        }
        if rate <= 0.0 {
            return Some(RECHECK);
        }
        Some(Duration::from_nanos((-self.tokens / rate).ceil() as u64 + 1))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Default for WeightedFair {
    fn default() -> Self {
        WeightedFair::new(1)
    }
}

impl WeightedFair {
    /// A policy for a device of `lanes` lanes (what caps are shares of).
    pub fn new(lanes: usize) -> WeightedFair {
        WeightedFair { state: Mutex::new(Passes { now: 0.0, tenants: HashMap::new() }), lanes: lanes.max(1) as f64 }
    }

    /// The key a tenant's work is ordered by: its pass (as it would be if
    /// it became active now), less its class's lead.
    pub fn key_of(&self, tenant: &str) -> f64 {
        let mut g = lock(&self.state);
        let now = g.now();
        match g.tenants.get(tenant) {
            Some(a) if a.active > 0 => a.pass - lead(a.share.priority),
            Some(a) => a.pass.max(now - IDLE_SLACK) - lead(a.share.priority),
            None => now - IDLE_SLACK,
        }
    }

    /// A tenant's pass relative to virtual time (tests and diagnostics).
    pub fn lag(&self, tenant: &str) -> f64 {
        let mut g = lock(&self.state);
        let now = g.now();
        g.tenants.get(tenant).map(|a| a.pass).unwrap_or(now) - now
    }

    pub fn share_of(&self, tenant: &str) -> Option<Share> {
        lock(&self.state).tenants.get(tenant).map(|a| a.share)
    }
}

impl Policy for WeightedFair {
    fn pick(&self, queue: &VecDeque<Waiting>) -> Pick {
        let mut g = lock(&self.state);
        let (now, at, lanes) = (g.now(), Instant::now(), self.lanes);
        let mut best: Option<(usize, f64)> = None;
        let mut wait = RECHECK;
        for (i, w) in queue.iter().enumerate() {
            let key = match g.tenants.get_mut(&w.tenant) {
                Some(a) => {
                    if let Some(d) = a.throttled(lanes, at) {
                        wait = wait.min(d);
                        continue;
                    }
                    a.pass - lead(a.share.priority)
                }
                None => now,
            };
            if best.is_none_or(|(_, k)| key < k) {
                best = Some((i, key));
            }
        }
        match best {
            Some((i, _)) => Pick::Run(i),
            None => Pick::Wait(wait),
        }
    }

    fn begin(&self, tenant: &str) {
        let mut g = lock(&self.state);
        let now = g.now();
        let a = g.account(tenant, now);
        if a.active == 0 {
            a.pass = a.pass.max(now - IDLE_SLACK);
        }
        a.active += 1;
    }

    fn end(&self, tenant: &str) {
        let mut g = lock(&self.state);
        // Virtual time moves on to what the work just used before the
        // work stops counting, and stays there once nothing is active: a
        // tenant that runs alone, one launch at a time, is active at no
        // other moment, and a newcomer would otherwise start behind by
        // all it used (and take the lanes until it caught up).
        g.now();
        if let Some(a) = g.tenants.get_mut(tenant) {
            a.active = a.active.saturating_sub(1);
        }
    }

    fn charge(&self, tenant: &str, dt: Duration) {
        let mut g = lock(&self.state);
        let now = g.now;
        let lanes = self.lanes;
        let a = g.account(tenant, now);
        let ns = dt.as_nanos() as f64;
        a.pass += ns / a.share.weight.max(1) as f64;
        if a.share.cap.is_some() {
            a.refill(lanes, Instant::now());
            a.tokens -= ns;
        }
    }

    fn throttled(&self, tenant: &str) -> Option<Duration> {
        let mut g = lock(&self.state);
        let lanes = self.lanes;
        g.tenants.get_mut(tenant)?.throttled(lanes, Instant::now())
    }

    fn urgent(&self, waiting: &str, running: &str) -> bool {
        let g = lock(&self.state);
        let rank_of = |t: &str| rank(g.tenants.get(t).map(|a| a.share.priority).unwrap_or_default());
        rank_of(waiting) > rank_of(running)
    }

    fn configure(&self, tenant: &str, share: Share) {
        let mut g = lock(&self.state);
        let now = g.now();
        let a = g.tenants.entry(tenant.to_string()).or_insert_with(|| Account::new(now, share, true));
        if a.share.cap != share.cap {
            // A new cap starts with a full bucket's worth of nothing: no
            // burst is owed from before it was set. A lifted one does not
            // leave the tenant far behind the others, owed device time.
            a.tokens = 0.0;
            a.refilled = Instant::now();
            a.pass = a.pass.max(now - IDLE_SLACK);
        }
        a.share = share;
        a.configured = true;
    }

    fn forget(&self, tenant: &str) {
        lock(&self.state).tenants.remove(tenant);
    }
}

/// The device's lanes and the queue of work waiting for one.
#[derive(Clone)]
pub struct Scheduler(Arc<Shared>);

struct Shared {
    lanes: usize,
    policy: Arc<dyn Policy>,
    inner: Mutex<Inner>,
    busy_ns: AtomicU64,
    /// Entries in the queue (read without the lock by running work).
    waiting: AtomicUsize,
    /// Bumped whenever work is queued: running work looks at the queue
    /// again only when it changed or its charge is due.
    arrivals: AtomicU64,
    /// More than one piece of work holds a lane (read without the lock by
    /// running work: its helpers then keep to its core).
    crowded: AtomicBool,
    /// Lane time charged to each tenant, as it is charged (with `busy_ns`,
    /// so the two agree at every instant, work in flight included).
    used: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// Work that runs elsewhere and holds (or waits to get back) a lane:
    /// poked when work is queued.
    elsewhere: Mutex<Vec<Arc<dyn PauseHook>>>,
}

struct Inner {
    running: usize,
    queue: VecDeque<Waiting>,
    next: u64,
    /// Lane numbers not held (each lane has a core: crate::placement).
    free: BinaryHeap<Reverse<usize>>,
    /// The thread waiting for each queued entry (by ticket), woken alone
    /// when its entry is picked: a lane handed on wakes one thread, not
    /// every waiter (each of which would look at the queue under the lock
    /// while the lane stood idle). Kept with the queue by `dequeue`.
    parked: HashMap<u64, std::thread::Thread>,
}

impl Shared {
    /// Queues an entry for `tenant` and returns once it holds a lane.
    fn acquire(&self, tenant: &str) -> usize {
        self.policy.begin(tenant);
        let mut g = lock(&self.inner);
        if g.queue.is_empty() && g.running < self.lanes && self.policy.throttled(tenant).is_none() {
            // A free lane and nobody waiting: no queue entry needed.
            return self.take_lane(&mut g);
        }
        let ticket = self.enqueue(&mut g, tenant);
        // Work elsewhere looks at the queue only when asked to or at its
        // holder's next tick: ask now, so an urgent arrival waits for the
        // other process's next checkpoint, not for the tick.
        for h in lock(&self.elsewhere).iter() {
            h.poke();
        }
        let _abandon = Abandon(self, ticket);
        self.wait_turn(g, ticket).1
    }

    /// Work whose thread panicked while it waited for its turn: its entry
    /// goes (nobody would take the lane it was picked for), and every
    /// waiter looks again (the policy is not asked whom to wake: it may be
    /// what panicked, and a second panic while unwinding aborts).
    fn abandon(&self, ticket: u64) {
        let mut g = lock(&self.inner);
        if let Some(i) = g.queue.iter().position(|w| w.ticket == ticket) {
            self.dequeue(&mut g, i);
        }
        for t in g.parked.values() {
            t.unpark();
        }
    }

    /// Queues new work: running work looks at it at its next checkpoint.
    fn enqueue(&self, g: &mut Inner, tenant: &str) -> u64 {
        let ticket = self.enqueue_quiet(g, tenant);
        self.arrivals.fetch_add(1, Ordering::Release);
        ticket
    }

    /// Queues work that stops to let others go (nothing to react to).
    fn enqueue_quiet(&self, g: &mut Inner, tenant: &str) -> u64 {
        let ticket = g.next;
        g.next += 1;
        g.queue.push_back(Waiting { ticket, tenant: tenant.to_string() });
        self.counted(g);
        ticket
    }

    fn dequeue(&self, g: &mut Inner, i: usize) {
        if let Some(w) = g.queue.remove(i) {
            g.parked.remove(&w.ticket);
        }
        self.counted(g);
    }

    /// The thread to wake now that a lane may be free or the policy may
    /// have changed its mind: the one whose entry the policy picks, or,
    /// where every waiting tenant is over its cap, the first waiter, to
    /// sleep until the soonest of them may run. None if no lane is free.
    fn next_waiter(&self, g: &Inner) -> Option<std::thread::Thread> {
        if g.running >= self.lanes || g.queue.is_empty() {
            return None;
        }
        let i = match self.policy.pick(&g.queue) {
            Pick::Run(i) => i,
            Pick::Wait(_) => 0,
        };
        parked_at(g, i).cloned()
    }

    /// Wakes the waiter [`Shared::next_waiter`] names.
    fn wake_next(&self) {
        let t = self.next_waiter(&lock(&self.inner));
        if let Some(t) = t {
            t.unpark();
        }
    }

    /// Takes the lowest free lane (callers checked `running < lanes`).
    fn take_lane(&self, g: &mut Inner) -> usize {
        debug_assert!(!g.free.is_empty(), "{} running of {} lanes, none free", g.running, self.lanes);
        g.running += 1;
        let lane = g.free.pop().map(|Reverse(l)| l).unwrap_or(0);
        self.counted(g);
        lane
    }

    fn put_lane(&self, g: &mut Inner, lane: usize) {
        g.running -= 1;
        g.free.push(Reverse(lane));
        self.counted(g);
    }

    /// Publishes what running work reads without the lock.
    fn counted(&self, g: &Inner) {
        self.waiting.store(g.queue.len(), Ordering::Release);
        // Waiting work is not counted: it runs only once it has a lane
        // (then it counts), and a capped tenant's queued work must not
        // keep another's helpers to one core while the others idle.
        self.crowded.store(g.running > 1, Ordering::Release);
    }

    /// Waits until the policy picks entry `ticket` while a lane is free,
    /// then takes the lane.
    fn wait_turn<'a>(&'a self, mut g: MutexGuard<'a, Inner>, ticket: u64) -> (MutexGuard<'a, Inner>, usize) {
        if g.queue.iter().any(|w| w.ticket == ticket) {
            g.parked.insert(ticket, std::thread::current());
        }
        loop {
            let mut sleep = RECHECK;
            if g.running < self.lanes {
                match self.policy.pick(&g.queue) {
                    Pick::Run(i) if g.queue.get(i).is_some_and(|w| w.ticket == ticket) => {
                        self.dequeue(&mut g, i);
                        let lane = self.take_lane(&mut g);
                        // Another lane may be free too: its waiter looks.
                        if let Some(t) = self.next_waiter(&g) {
                            t.unpark();
                        }
                        return (g, lane);
                    }
                    // Someone else's turn: make sure they look.
                    Pick::Run(i) => {
                        if let Some(t) = parked_at(&g, i) {
                            t.unpark();
                        }
                    }
                    Pick::Wait(d) => sleep = d.min(RECHECK),
                }
            }
            // An unpark between the unlock and the park is not lost: it
            // makes the park return at once.
            drop(g);
            std::thread::park_timeout(sleep);
            g = lock(&self.inner);
        }
    }

    fn release(self: &Arc<Self>, lane: usize) {
        let mut g = lock(&self.inner);
        self.put_lane(&mut g, lane);
        let waiting = !g.queue.is_empty();
        drop(g);
        // A wake-up costs a system call: only when someone waits; later
        // under a WakeLater.
        if waiting && !wake_later(self) {
            self.wake_next();
        }
    }
}

/// Work that runs in another process (a tenant's executor) and holds its
/// lane through a proxy in this one (the device's arbiter): before the
/// scheduler gives the lane away it asks the work to stop, and when the
/// work has a lane again it tells it which.
pub trait PauseHook: Send + Sync {
    /// Asks the work to stop at its next checkpoint and waits until it has.
    /// False: it did not stop (it ended meanwhile, or did not answer in
    /// time) and keeps its lane.
    fn pause(&self) -> bool;
    /// The work holds `lane` again and may go on.
    fn resume(&self, lane: usize);
    /// Work was queued that may come first: look at the queue now (call
    /// [`Running::checkpoint`]) rather than at the next tick.
    fn poke(&self) {}
}

/// Work holding a lane. Made by [`Scheduler::run`], reachable from the code
/// it runs through [`with_current`].
pub struct Running {
    s: Arc<Shared>,
    /// Set for work that runs elsewhere ([`Scheduler::run_for`]).
    hook: Option<Arc<dyn PauseHook>>,
    /// The tenant's lane time, charged as it goes.
    used: Arc<AtomicU64>,
    tenant: String,
    base: Instant,
    /// ns since `base` up to which the work has been charged.
    charged_to: AtomicU64,
    /// ns since `base` when the current turn began.
    turn_from: AtomicU64,
    /// Lane time charged so far.
    ran: AtomicU64,
    /// Time spent preempted.
    paused_ns: AtomicU64,
    /// Set while the work has given its lane away: its threads stop at
    /// their next checkpoint.
    paused: AtomicBool,
    /// The scheduler's arrival count when this work last looked at the
    /// queue.
    seen: AtomicU64,
    /// One thread decides for the work at a time; `true` while preempted.
    deciding: Mutex<bool>,
    resumed: Condvar,
    released: AtomicBool,
    /// The lane the work holds.
    lane: AtomicUsize,
}

thread_local! {
    /// Schedulers whose waiters this thread wakes when its
    /// [`WakeLater`] ends (None: no guard, wake at once).
    static DEFERRED: std::cell::RefCell<Option<Vec<Arc<Shared>>>> = const { std::cell::RefCell::new(None) };
}

/// While it lives, lanes the calling thread gives back wake the work
/// waiting for them only when it drops: the thread first finishes what
/// the work's tenant waits for (its completion), before a woken thread
/// may take its core.
/// A guard made while another lives on the thread leaves the wake-ups to
/// the outer one.
pub struct WakeLater(bool);

impl WakeLater {
    pub fn new() -> WakeLater {
        WakeLater(DEFERRED.with(|d| {
            let mut d = d.borrow_mut();
            let outer = d.is_none();
            d.get_or_insert_with(Vec::new);
            outer
        }))
    }
}

impl Default for WakeLater {
    fn default() -> Self {
        WakeLater::new()
    }
}

/// Leaves `s`'s wake-up to the calling thread's [`WakeLater`], if it has
/// one; false if it has none.
fn wake_later(s: &Arc<Shared>) -> bool {
    DEFERRED.with(|d| match d.borrow_mut().as_mut() {
        Some(v) => {
            if !v.iter().any(|x| Arc::ptr_eq(x, s)) {
                v.push(s.clone());
            }
            true
        }
        None => false,
    })
}

impl Drop for WakeLater {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        for s in DEFERRED.with(|d| d.borrow_mut().take()).unwrap_or_default() {
            s.wake_next();
        }
    }
}

thread_local! {
    static CURRENT: Cell<*const Running> = const { Cell::new(std::ptr::null()) };
}

/// Calls `f` with the work the calling thread runs under
/// [`Scheduler::run`], if any.
pub fn with_current<R>(f: impl FnOnce(Option<&Running>) -> R) -> R {
    let p = CURRENT.with(|c| c.get());
    // SAFETY: CURRENT is non-null only while `Scheduler::run` executes its
    // closure on this thread, and the `Running` it points to lives on that
    // call's stack until the closure returns and CURRENT is cleared.
    f(unsafe { p.as_ref() })
}

/// Sets CURRENT for the life of the guard (cleared even on unwind).
struct Current(*const Running);

impl Current {
    fn set(r: &Running) -> Current {
        Current(CURRENT.with(|c| c.replace(r)))
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

impl Running {
    fn new(s: Arc<Shared>, tenant: &str, lane: usize, hook: Option<Arc<dyn PauseHook>>) -> Running {
        let seen = AtomicU64::new(s.arrivals.load(Ordering::Acquire));
        let used = lock(&s.used).entry(tenant.to_string()).or_default().clone();
        Running {
            s,
            hook,
            used,
            tenant: tenant.to_string(),
            base: Instant::now(),
            charged_to: AtomicU64::new(0),
            turn_from: AtomicU64::new(0),
            ran: AtomicU64::new(0),
            paused_ns: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            seen,
            deciding: Mutex::new(false),
            resumed: Condvar::new(),
            released: AtomicBool::new(false),
            lane: AtomicUsize::new(lane),
        }
    }

    fn since_base(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_nanos() as u64
    }

    /// Charges the time up to `t` not charged yet.
    fn charge_to(&self, t: Instant) -> u64 {
        let to = self.since_base(t);
        let from = self.charged_to.fetch_max(to, Ordering::AcqRel);
        let dt = to.saturating_sub(from);
        if dt > 0 {
            self.s.policy.charge(&self.tenant, Duration::from_nanos(dt));
            self.s.busy_ns.fetch_add(dt, Ordering::Relaxed);
            self.used.fetch_add(dt, Ordering::Relaxed);
            self.ran.fetch_add(dt, Ordering::Relaxed);
        }
        to
    }

    /// Lane time this work has been charged.
    pub fn ran(&self) -> Duration {
        Duration::from_nanos(self.ran.load(Ordering::Relaxed))
    }

    /// More than one piece of work holds a lane of the device.
    pub fn crowded(&self) -> bool {
        self.s.crowded.load(Ordering::Acquire)
    }

    /// The lane the work holds now (it may change when it is preempted).
    pub fn lane(&self) -> usize {
        self.lane.load(Ordering::Relaxed)
    }

    /// Time this work has spent preempted.
    pub fn paused(&self) -> Duration {
        Duration::from_nanos(self.paused_ns.load(Ordering::Relaxed))
    }

    /// Called by the running work (any of its threads) at points where it
    /// can stop: charges the time it used, and gives the lane to waiting
    /// work the policy puts first, or stops while its tenant is over its
    /// cap. Returns once the work holds a lane again.
    pub fn checkpoint(&self) {
        // The common case costs a clock read and a few atomic loads: the
        // queue is looked at when new work arrived or the charge is due.
        let lane = self.lane.load(Ordering::Relaxed);
        if lane != NO_LANE {
            crate::placement::follow(lane, self.s.crowded.load(Ordering::Acquire));
        }
        let t = Instant::now();
        if lane != NO_LANE {
            crate::placement::settle(lane, Some(t));
        }
        let due = self.since_base(t).saturating_sub(self.charged_to.load(Ordering::Relaxed)) >= CHARGE_EVERY.as_nanos() as u64;
        let arrived = self.s.arrivals.load(Ordering::Acquire) != self.seen.load(Ordering::Relaxed);
        if !self.paused.load(Ordering::Acquire) && !due && !arrived {
            return;
        }
        // Locks others wait on are never held at compute nice.
        let _raised = crate::nice::Raised::new();
        self.decide();
    }

    fn decide(&self) {
        let mut d = lock(&self.deciding);
        if *d {
            // Another thread of this work gave the lane away: wait with it.
            while *d {
                d = self.resumed.wait(d).unwrap_or_else(|e| e.into_inner());
            }
            drop(d);
            crate::placement::resumed(self.lane.load(Ordering::Relaxed));
            return;
        }
        let to = self.charge_to(Instant::now());
        let turn = Duration::from_nanos(to.saturating_sub(self.turn_from.load(Ordering::Relaxed)));
        let s = &*self.s;
        let mut g = lock(&s.inner);
        self.seen.store(s.arrivals.load(Ordering::Acquire), Ordering::Relaxed);
        let throttled = s.policy.throttled(&self.tenant).is_some();
        if g.queue.is_empty() && !throttled {
            return;
        }
        let mut ticket = s.enqueue_quiet(&mut g, &self.tenant);
        let stay = match s.policy.pick(&g.queue) {
            // A policy's index out of range keeps the running work going.
            Pick::Run(i) => g.queue.get(i).is_none_or(|w| w.ticket == ticket || (!throttled && (w.tenant == self.tenant || (turn < QUANTUM && !s.policy.urgent(&w.tenant, &self.tenant))))),
            Pick::Wait(_) => false,
        };
        if let Some(i) = g.queue.iter().position(|w| w.ticket == ticket).filter(|_| stay || self.hook.is_some()) {
            s.dequeue(&mut g, i);
        }
        if stay {
            return;
        }
        if let Some(h) = &self.hook {
            // Work elsewhere stops before its lane is given away; no lock
            // is held while the other process answers.
            drop(g);
            if !h.pause() {
                return;
            }
            // The lane was the work's until it stopped: the time it took
            // to answer is charged too (the work ran in it), or a tenant
            // paused often (a capped one) would run that much free.
            self.charge_to(Instant::now());
            g = lock(&s.inner);
            ticket = s.enqueue_quiet(&mut g, &self.tenant);
        }
        // Give the lane away; this work's entry waits in the queue.
        *d = true;
        self.paused.store(true, Ordering::Release);
        drop(d);
        // From here the work holds no lane until it has one again; the
        // guard lets its other threads go on whatever happens.
        let _resume = Resume { r: self, ticket };
        // wait_turn hands the lane to the waiter the policy picks (waking
        // it) or takes it straight back.
        s.put_lane(&mut g, self.lane.swap(NO_LANE, Ordering::Relaxed));
        let stopped = Instant::now();
        let (g, lane) = s.wait_turn(g, ticket);
        drop(g);
        self.lane.store(lane, Ordering::Relaxed);
        // Charged from before the work hears it may go on: work elsewhere
        // runs from the moment the message is sent, whenever this thread
        // gets its core back.
        let back = Instant::now();
        match &self.hook {
            Some(h) => h.resume(lane),
            None => crate::placement::resumed(lane),
        }
        self.paused_ns.fetch_add(back.duration_since(stopped).as_nanos() as u64, Ordering::Relaxed);
        let at = self.since_base(back);
        self.charged_to.fetch_max(at, Ordering::AcqRel);
        self.turn_from.store(at, Ordering::Relaxed);
    }

    /// Charges what is left and gives the lane back (if it holds one: a
    /// panic while preempted leaves it without).
    fn finish(&self) -> Duration {
        if !self.released.swap(true, Ordering::AcqRel) {
            self.charge_to(Instant::now());
            self.s.policy.end(&self.tenant);
            let lane = self.lane.swap(NO_LANE, Ordering::Relaxed);
            if lane != NO_LANE {
                self.s.release(lane);
            }
        }
        self.ran()
    }
}

/// The thread waiting for the queue's entry `i`.
fn parked_at(g: &Inner, i: usize) -> Option<&std::thread::Thread> {
    g.queue.get(i).and_then(|w| g.parked.get(&w.ticket))
}

/// Abandons a queue entry if its thread unwinds while waiting
/// (`Shared::abandon`).
struct Abandon<'a>(&'a Shared, u64);

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abandon(self.1);
        }
    }
}

/// `Running::lane` while preempted work holds none.
const NO_LANE: usize = usize::MAX;

/// Ends a preemption: the work's other threads, waiting at their
/// checkpoints, go on. On a panic while the work waited for its turn, its
/// queue entry goes too (nobody would take the lane it was picked for).
struct Resume<'a> {
    r: &'a Running,
    ticket: u64,
}

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.r.s.abandon(self.ticket);
        }
        let mut d = lock(&self.r.deciding);
        *d = false;
        self.r.paused.store(false, Ordering::Release);
        self.r.resumed.notify_all();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Released even if the work panicked, so the device never wedges.
        self.finish();
    }
}

impl vgpu_ptx::Preempt for Running {
    fn checkpoint(&self) {
        Running::checkpoint(self)
    }

    fn paused(&self) -> Duration {
        Running::paused(self)
    }

    fn helper(&self, on: bool) {
        crate::placement::helping(on)
    }
}

impl Scheduler {
    pub fn new(lanes: usize, policy: Arc<dyn Policy>) -> Scheduler {
        Scheduler(Arc::new(Shared {
            lanes: lanes.max(1),
            policy,
            inner: Mutex::new(Inner { running: 0, queue: VecDeque::new(), next: 0, free: (0..lanes.max(1)).map(Reverse).collect(), parked: HashMap::new() }),
            busy_ns: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            arrivals: AtomicU64::new(0),
            crowded: AtomicBool::new(false),
            used: Mutex::new(HashMap::new()),
            elsewhere: Mutex::new(Vec::new()),
        }))
    }

    /// Runs `f` once a lane is granted; returns its result and the lane
    /// time it used (time spent preempted excluded).
    pub fn run<T>(&self, tenant: &str, f: impl FnOnce() -> T) -> (T, Duration) {
        let lane = self.0.acquire(tenant);
        let r = Running::new(self.0.clone(), tenant, lane, None);
        let out = {
            let _cur = Current::set(&r);
            // On the lane's core, below the worker's control threads, once
            // it proves long (crate::placement::settle).
            let _work = crate::placement::LaneWork::begin();
            f()
        };
        let dt = r.finish();
        (out, dt)
    }

    /// Holds a lane for work that runs in another process: `f` is called
    /// with the lane once it is granted and returns when the work has
    /// ended. While `f` runs, the lane is preempted through `hook` (`f`
    /// calls [`Running::checkpoint`] on the work's behalf, through
    /// [`with_current`]). The calling thread is neither pinned nor lowered:
    /// it only waits. Returns the lane time charged.
    pub fn run_for(&self, tenant: &str, hook: Arc<dyn PauseHook>, f: impl FnOnce(usize)) -> Duration {
        let lane = self.0.acquire(tenant);
        lock(&self.0.elsewhere).push(hook.clone());
        let key = Arc::as_ptr(&hook) as *const ();
        let r = Running::new(self.0.clone(), tenant, lane, Some(hook));
        {
            let _cur = Current::set(&r);
            f(lane);
        }
        lock(&self.0.elsewhere).retain(|h| Arc::as_ptr(h) as *const () != key);
        r.finish()
    }

    /// Sets (or changes) a tenant's weight, cap and class.
    pub fn configure(&self, tenant: &str, share: Share) {
        self.0.policy.configure(tenant, share);
        // A lifted cap may let waiting work run now.
        self.0.wake_next();
    }

    pub fn forget(&self, tenant: &str) {
        self.0.policy.forget(tenant);
        lock(&self.0.used).remove(tenant);
        // Its waiting work, if any, is no longer held back by its account.
        self.0.wake_next();
    }

    /// Lane time charged to `tenant` so far, work in flight included.
    pub fn used(&self, tenant: &str) -> Duration {
        Duration::from_nanos(lock(&self.0.used).get(tenant).map_or(0, |u| u.load(Ordering::Relaxed)))
    }

    /// Total time lanes were busy, summed over lanes.
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.0.busy_ns.load(Ordering::Relaxed))
    }

    /// How much work waits for a lane now.
    pub fn queued(&self) -> usize {
        self.0.waiting.load(Ordering::Acquire)
    }

    pub fn lanes(&self) -> usize {
        self.0.lanes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_runs_more_than_lanes_at_once_and_accounts_time() {
        let s = Arc::new(Scheduler::new(2, Arc::new(Fifo)));
        let now = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let (s, now, peak) = (s.clone(), now.clone(), peak.clone());
                std::thread::spawn(move || {
                    s.run(&format!("t{i}"), || {
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

    fn fair(lanes: usize, shares: &[Share]) -> Arc<Scheduler> {
        let s = Arc::new(Scheduler::new(lanes, Arc::new(WeightedFair::new(lanes))));
        for (i, sh) in shares.iter().enumerate() {
            s.configure(&format!("t{i}"), *sh);
        }
        s
    }

    /// Tenants with `shares`, each saturating `s` from two threads with
    /// work of 1 ms for `run`: each tenant's lane time over the lane time
    /// the device had.
    fn measure(s: &Arc<Scheduler>, tenants: usize, run: Duration) -> Vec<f64> {
        let used: Arc<Vec<AtomicU64>> = Arc::new((0..tenants).map(|_| AtomicU64::new(0)).collect());
        let start = Instant::now();
        let stop = start + run;
        let hs: Vec<_> = (0..tenants)
            .flat_map(|i| std::iter::repeat_n(i, 2))
            .map(|i| {
                let (s, used) = (s.clone(), used.clone());
                std::thread::spawn(move || {
                    while Instant::now() < stop {
                        let (_, dt) = s.run(&format!("t{i}"), || std::thread::sleep(Duration::from_millis(1)));
                        used[i].fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let had = start.elapsed().as_nanos() as f64 * s.lanes() as f64;
        used.iter().map(|u| u.load(Ordering::Relaxed) as f64 / had).collect()
    }

    fn w(weight: u32) -> Share {
        Share { weight, ..Share::default() }
    }

    #[test]
    fn weighted_fair_shares_follow_weights() {
        // Tolerances wide enough not to flake on a loaded machine; the
        // benchmark (share-bench) measures the real error.
        let norm = |v: Vec<f64>| {
            let t: f64 = v.iter().sum();
            v.into_iter().map(|x| x / t).collect::<Vec<_>>()
        };
        let got = norm(measure(&fair(1, &[w(1), w(3)]), 2, Duration::from_millis(600)));
        assert!((got[0] - 0.25).abs() < 0.08 && (got[1] - 0.75).abs() < 0.08, "1:3 gave {got:?}");
        let got = norm(measure(&fair(1, &[w(1), w(1), w(2), w(4)]), 4, Duration::from_millis(800)));
        for (g, want) in got.iter().zip([0.125, 0.125, 0.25, 0.5]) {
            assert!((g - want).abs() < 0.08, "1:1:2:4 gave {got:?}");
        }
    }

    #[test]
    fn a_newcomer_is_not_owed_what_a_tenant_running_alone_used() {
        let p = WeightedFair::new(1);
        p.configure("solo", w(1));
        p.configure("late", w(1));
        // One launch at a time, 100 ms in all, nobody else active.
        for _ in 0..100 {
            p.begin("solo");
            p.charge("solo", Duration::from_millis(1));
            p.end("solo");
        }
        // "late" arrives between two of them.
        p.begin("late");
        p.begin("solo");
        let q: VecDeque<Waiting> = [Waiting { ticket: 0, tenant: "solo".into() }, Waiting { ticket: 1, tenant: "late".into() }].into();
        // It goes first, but from no further back than the slack: after
        // 3 ms of its own it is solo's turn again (not after 100 ms).
        assert_eq!(p.pick(&q), Pick::Run(1));
        p.charge("late", Duration::from_millis(3));
        assert_eq!(p.pick(&q), Pick::Run(0), "late: {} solo: {}", p.key_of("late"), p.key_of("solo"));
    }

    #[test]
    fn an_idle_tenant_does_not_bank_time() {
        let p = WeightedFair::new(1);
        p.begin("busy");
        p.begin("new");
        p.end("new");
        // "new" idles while "busy" uses 100 ms.
        p.charge("busy", Duration::from_millis(100));
        p.begin("new");
        let q: VecDeque<Waiting> = [Waiting { ticket: 0, tenant: "busy".into() }, Waiting { ticket: 1, tenant: "new".into() }].into();
        // Back from idle, it goes first (it has used nothing), but from no
        // further back than the slack: the 100 ms it did not use buy it
        // only 2 ms.
        assert_eq!(p.pick(&q), Pick::Run(1));
        assert!(p.lag("new") >= -IDLE_SLACK, "{}", p.lag("new"));
        p.charge("new", Duration::from_millis(3));
        assert_eq!(p.pick(&q), Pick::Run(0));
    }

    #[test]
    fn a_capped_tenant_stays_under_its_cap_even_alone() {
        // Two lanes, one tenant capped at 25%, saturating from two threads:
        // uncapped it would use all of both lanes.
        let s = fair(2, &[Share { cap: Some(25), ..w(1) }]);
        let got = measure(&s, 1, Duration::from_millis(800))[0];
        assert!(got <= 0.27, "capped at 25%, used {:.1}%", got * 100.0);
        assert!(got >= 0.10, "capped at 25%, used only {:.1}%", got * 100.0);
        // Lifted live, the same tenant takes the idle device.
        s.configure("t0", w(1));
        let got = measure(&s, 1, Duration::from_millis(300))[0];
        assert!(got > 0.5, "uncapped alone, used {:.1}%", got * 100.0);
    }

    #[test]
    fn the_latency_class_goes_first_within_its_lead() {
        let p = WeightedFair::new(1);
        p.configure("lat", Share { priority: Priority::Latency, ..w(1) });
        p.configure("norm", w(1));
        p.begin("lat");
        p.begin("norm");
        let q: VecDeque<Waiting> = [Waiting { ticket: 0, tenant: "norm".into() }, Waiting { ticket: 1, tenant: "lat".into() }].into();
        // Ahead of the other by 10 ms of device time: still first.
        p.charge("lat", Duration::from_millis(10));
        assert_eq!(p.pick(&q), Pick::Run(1));
        // Ahead by more than the class's lead: the other goes first.
        p.charge("lat", Duration::from_millis(30));
        assert_eq!(p.pick(&q), Pick::Run(0));
        assert!(p.urgent("lat", "norm") && !p.urgent("norm", "lat"));
    }

    #[test]
    fn over_its_cap_a_tenant_waits_and_others_run() {
        let p = WeightedFair::new(1);
        p.configure("capped", Share { cap: Some(10), ..w(1) });
        p.charge("capped", Duration::from_millis(50));
        let wait = p.throttled("capped").expect("over its cap");
        // 50 ms used at 10% of one lane: about 500 ms to earn back.
        assert!(wait > Duration::from_millis(300) && wait <= Duration::from_millis(501), "{wait:?}");
        let q: VecDeque<Waiting> = [Waiting { ticket: 0, tenant: "capped".into() }, Waiting { ticket: 1, tenant: "other".into() }].into();
        assert_eq!(p.pick(&q), Pick::Run(1));
        let q: VecDeque<Waiting> = [Waiting { ticket: 0, tenant: "capped".into() }].into();
        assert!(matches!(p.pick(&q), Pick::Wait(_)));
    }

    /// Work that runs `total` of busy time, stopping at a checkpoint every
    /// 50 µs as the CPU device's interpreter does.
    fn long_work(total: Duration) {
        let end = Instant::now() + total;
        let mut spent = Duration::ZERO;
        while spent < total && Instant::now() < end + Duration::from_secs(5) {
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(50) {
                std::hint::spin_loop();
            }
            spent += t.elapsed();
            with_current(|r| r.expect("inside Scheduler::run").checkpoint());
        }
    }

    #[test]
    fn long_work_gives_its_lane_to_waiting_work() {
        let s = fair(1, &[w(1), Share { priority: Priority::Latency, ..w(1) }]);
        let s2 = s.clone();
        let long = std::thread::spawn(move || {
            let t = Instant::now();
            let (_, ran) = s2.run("t0", || long_work(Duration::from_millis(400)));
            (ran, t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        // Same class: runs once the long work's quantum is up; a higher
        // class: at its next checkpoint. Both long before it ends.
        let t = Instant::now();
        s.run("t2", || ());
        let normal = t.elapsed();
        let t = Instant::now();
        s.run("t1", || ());
        let latency = t.elapsed();
        let (ran, took) = long.join().unwrap();
        assert!(normal < Duration::from_millis(150) && latency < Duration::from_millis(150), "waited {normal:?} and {latency:?} behind 400 ms of work");
        // The long work was charged for what it ran, not for its pauses.
        assert!(ran >= Duration::from_millis(390) && ran <= took, "ran {ran:?} in {took:?}");
    }

    /// While it holds a lane (between checkpoints), no other work holds
    /// the same one: preempted work resumes on whichever lane is free.
    #[test]
    fn each_piece_of_running_work_holds_a_lane_of_its_own() {
        const LANES: usize = 2;
        let s = fair(LANES, &[w(1), w(2), Share { priority: Priority::Latency, ..w(1) }]);
        let owner: Arc<Vec<AtomicUsize>> = Arc::new((0..LANES).map(|_| AtomicUsize::new(usize::MAX)).collect());
        let paused = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..6)
            .map(|i| {
                let (s, owner, paused) = (s.clone(), owner.clone(), paused.clone());
                std::thread::spawn(move || {
                    for _ in 0..4 {
                        s.run(&format!("t{}", i % 3), || {
                            let end = Instant::now() + Duration::from_millis(15);
                            while Instant::now() < end {
                                let lane = with_current(|r| r.expect("inside run").lane());
                                assert!(lane < LANES, "lane {lane} of {LANES}");
                                let held = owner[lane].swap(i, Ordering::SeqCst);
                                assert_eq!(held, usize::MAX, "work {i} got lane {lane}, which work {held} holds");
                                let t = Instant::now();
                                while t.elapsed() < Duration::from_micros(50) {
                                    std::hint::spin_loop();
                                }
                                owner[lane].store(usize::MAX, Ordering::SeqCst);
                                with_current(|r| r.expect("inside run").checkpoint());
                            }
                            paused.fetch_add(with_current(|r| r.expect("inside run").paused()).as_nanos() as u64, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        // Three tenants on two lanes, one of them of a higher class: work
        // was preempted and resumed, on whichever lane was free then.
        assert!(paused.load(Ordering::Relaxed) > 0, "no work was ever preempted");
    }

    /// Under a WakeLater, the lane work gives back wakes its waiters only
    /// when the guard drops.
    #[test]
    fn a_wake_later_guard_holds_wake_ups_until_it_ends() {
        let s = fair(1, &[w(1), w(1)]);
        let (ran, holding) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (s2, holding2) = (s.clone(), holding.clone());
        let holder = std::thread::spawn(move || {
            let guard = WakeLater::new();
            s2.run("t0", || {
                holding2.store(true, Ordering::SeqCst);
                // Holds the lane until the other work waits for it.
                let end = Instant::now() + Duration::from_secs(10);
                while s2.0.waiting.load(Ordering::Acquire) == 0 && Instant::now() < end {
                    std::thread::yield_now();
                }
            });
            // The lane is free; its waiter's wake-up is left to the guard.
            let pending = DEFERRED.with(|d| d.borrow().as_ref().map(Vec::len));
            drop(guard);
            let after = DEFERRED.with(|d| d.borrow().is_none());
            (pending, after)
        });
        while !holding.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let ran2 = ran.clone();
        s.run("t1", move || ran2.store(true, Ordering::SeqCst));
        let (pending, after) = holder.join().unwrap();
        assert!(ran.load(Ordering::SeqCst));
        assert_eq!(pending, Some(1), "the release left one scheduler to wake");
        assert!(after, "the guard cleared the thread's list when it ended");
        // Nested guards leave the wake-ups to the outer one.
        let outer = WakeLater::new();
        let inner = WakeLater::new();
        drop(inner);
        assert!(DEFERRED.with(|d| d.borrow().is_some()), "an inner guard does not end the outer one's");
        drop(outer);
        assert!(DEFERRED.with(|d| d.borrow().is_none()));
    }
}
