//! Executes decoded kernels.
//!
//! A block runs thread by thread, in rounds. In its turn a thread executes
//! until it parks (at a block barrier or a warp collective), exits, or has
//! used its time slice; the slice lets a thread that spins on memory yield,
//! so warps of a block make independent forward progress as on Volta and
//! later. After each round the block settles what parked:
//! - a warp collective (`shfl.sync`, `vote.sync`, `match`, `redux`, `elect`,
//!   `bar.warp.sync`) completes once every lane of its member mask that has
//!   not exited waits on it; lanes outside the mask are not waited for;
//! - `activemask` (and a vote without `.sync`) reports the lanes that
//!   reached the same instruction in the same round;
//! - a barrier opens once its thread count (or, without one, every thread
//!   of the block that has not exited) has arrived.
//!
//! Every access is bounds-checked: global memory through [`GlobalMem`],
//! shared, local and parameter memory against their sizes.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::ir::*;

/// Generic addresses in `[SHARED_WINDOW, SHARED_WINDOW + shared size)` name
/// the block's shared memory; the other windows name the thread's local
/// memory and the kernel's parameters, and function addresses live in
/// their own window. Everything else is global.
pub const SHARED_WINDOW: u64 = 0x0000_1000_0000_0000;

/// Shared memory each block has beyond its own, for system software (the
/// 1 KiB sm_80 and later reserve; `%reserved_smem_offset_*` name it).
pub const RESERVED_SMEM: u64 = 1024;
pub const LOCAL_WINDOW: u64 = 0x0000_2000_0000_0000;
pub const PARAM_WINDOW: u64 = 0x0000_3000_0000_0000;
pub const FUNC_WINDOW: u64 = 0x0000_4000_0000_0000;
pub const WARP: usize = 32;

/// Global memory as one tenant sees it. Implementations check every access
/// against that tenant's own allocations.
pub trait GlobalMem {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError>;
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError>;
    /// Atomic read-modify-write of `n` (2, 4 or 8) aligned bytes: stores
    /// `f(old)` and returns `old`. The default is a load then a store, right
    /// for memory that only one host thread touches.
    fn atomic(&mut self, addr: u64, n: usize, f: &mut dyn FnMut(u64) -> u64) -> Result<u64, ExecError> {
        let mut buf = [0u8; 8];
        self.load(addr, &mut buf[..n])?;
        let old = u64::from_le_bytes(buf);
        self.store(addr, &f(old).to_le_bytes()[..n])?;
        Ok(old)
    }
    /// Another view of the same memory for a second host thread. Memory
    /// that offers one must make `load`, `store` and `atomic` safe to run
    /// concurrently from its views; a launch whose memory offers none runs
    /// its blocks on one thread.
    fn fork(&self) -> Option<Box<dyn GlobalMem + Send + '_>> {
        None
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    #[error("illegal {kind} address {addr:#x} ({len} bytes) at PTX line {line}")]
    IllegalAddress { kind: &'static str, addr: u64, len: usize, line: u32 },
    #[error("misaligned {len}-byte access at {addr:#x} at PTX line {line}")]
    Misaligned { addr: u64, len: usize, line: u32 },
    #[error("launch exceeded its budget of {0} instruction units")]
    Budget(u64),
    #[error("launch ran past its {0:?} time limit")]
    Timeout(Duration),
    #[error("too many resources requested for launch: {0}")]
    OutOfResources(String),
    #[error("invalid launch: {0}")]
    BadLaunch(String),
    #[error("threads deadlocked: {0}")]
    Deadlock(String),
    #[error("device-side assertion failed: {0}")]
    Assert(String),
    #[error("kernel trapped at PTX line {0}")]
    Trap(u32),
    #[error("launch failed: {0}")]
    Failed(String),
}

impl ExecError {
    /// Fills in the PTX line once the faulting instruction is known.
    fn at(mut self, l: u32) -> Self {
        match &mut self {
            ExecError::IllegalAddress { line, .. } | ExecError::Misaligned { line, .. } => *line = l,
            _ => {}
        }
        self
    }
}

#[derive(Debug, Clone, Copy)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_shared: u32,
}

/// Where a long launch may be stopped for others: the device scheduler's
/// hold on the launch's lane (the device scheduler's running work, in `vgpu-mediator`).
pub trait Preempt: Sync {
    /// Called between blocks and every few thousand units by each thread of
    /// the launch; returns once the launch may go on (at once, or after
    /// others had the lane).
    fn checkpoint(&self);
    /// Time the launch has spent stopped so far: not counted against its
    /// time limit.
    fn paused(&self) -> Duration;
    /// The calling thread starts (true) or ends (false) helping a launch
    /// that runs on another thread's lane.
    fn helper(&self, _on: bool) {}
}

#[derive(Clone, Copy)]
pub struct Limits<'a> {
    pub max_threads_per_block: u32,
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
    pub max_shared: u32,
    /// Cost units one launch may spend (0: unlimited). An instruction
    /// costs one unit per register it writes or element it moves; setting
    /// up a block and scanning its threads cost units too (see [`launch`]).
    pub budget: u64,
    /// Wall-clock time one launch may run (None: unlimited).
    pub timeout: Option<Duration>,
    /// The device's streaming-multiprocessor count (`%nsmid`).
    pub sm_count: u32,
    /// Host threads one launch's blocks may run on (0 or 1: the calling
    /// thread only). Extra threads come from rayon's pool.
    pub threads: usize,
    /// Lets the device scheduler stop the launch between its slices.
    pub preempt: Option<&'a dyn Preempt>,
}

/// Largest per-block register file (threads × registers × 8 bytes) the
/// interpreter allocates; larger launches fail with out-of-resources, as a
/// GPU refuses a block whose registers do not fit an SM.
pub const MAX_REGISTER_FILE: u64 = 64 << 20;
/// Largest host memory one block's thread state may take: its register
/// file, its threads' local frames and every call frame, together.
pub const MAX_BLOCK_STACK: u64 = MAX_REGISTER_FILE;
/// Most nested calls of one thread.
pub const MAX_CALL_DEPTH: usize = 1024;
/// Bytes of register file or shared memory zeroed per cost unit.
const ZERO_BYTES_PER_UNIT: u64 = 64;
/// Fixed cost of starting a block, in units.
const BLOCK_UNITS: u64 = 16;
/// Fixed cost of a call or return, in units (plus its frame).
const CALL_UNITS: u64 = 8;
/// How often (in units spent) a running launch looks at the clock.
const CLOCK_EVERY: u64 = 1 << 12;
/// Units a thread runs in one turn before it yields to the others.
const SLICE: u64 = 1 << 12;
/// The body index of a kernel's own frame.
const KERNEL: u32 = u32::MAX;

/// When a launch runs out of time: `limit` after it started, plus the time
/// its lane was taken from it since (`Preempt::paused` beyond
/// `paused_before`, what the work had been paused before this launch).
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    limit: Duration,
    paused_before: Duration,
}

/// What a launch may still spend. A launch on several host threads gives
/// each its own meter drawing chunks of units from one shared pool.
struct Meter<'p> {
    left: u64,
    budget: u64,
    deadline: Option<Deadline>,
    next_clock: u64,
    pool: Option<&'p AtomicU64>,
    /// Units taken from the pool so far (the whole budget without one).
    taken: u64,
    preempt: Option<&'p dyn Preempt>,
}

/// Units a parallel launch's thread takes from the shared budget at once.
const POOL_CHUNK: u64 = 1 << 16;

impl Meter<'_> {
    /// Charges `units`; fails once the budget or the time limit is spent.
    #[inline]
    fn charge(&mut self, units: u64) -> Result<(), ExecError> {
        if self.left < units && !self.refill(units) {
            self.left = 0;
            return Err(ExecError::Budget(self.budget));
        }
        self.left -= units;
        if self.left <= self.next_clock {
            self.next_clock = self.left.saturating_sub(CLOCK_EVERY);
            self.clock()?;
        }
        Ok(())
    }

    /// A slice boundary: the scheduler may stop the launch here; then the
    /// time limit, less the time it was stopped.
    #[cold]
    fn clock(&self) -> Result<(), ExecError> {
        let paused = match self.preempt {
            Some(p) => {
                p.checkpoint();
                p.paused()
            }
            None => Duration::ZERO,
        };
        if let Some(d) = self.deadline {
            if Instant::now() >= d.at + paused.saturating_sub(d.paused_before) {
                return Err(ExecError::Timeout(d.limit));
            }
        }
        Ok(())
    }

    fn spent(&self) -> u64 {
        self.taken - self.left
    }

    /// Takes another chunk from the shared pool; false when it is empty.
    #[cold]
    fn refill(&mut self, units: u64) -> bool {
        let Some(pool) = self.pool else { return false };
        let want = POOL_CHUNK.max(units);
        let got = pool.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| Some(p - p.min(want))).map(|p| p.min(want)).unwrap_or(0);
        self.left += got;
        self.taken += got;
        // The clock is looked at within the next CLOCK_EVERY units.
        self.next_clock = self.left.saturating_sub(CLOCK_EVERY);
        self.left >= units
    }
}

impl Default for Limits<'_> {
    fn default() -> Self {
        Limits {
            max_threads_per_block: 1024,
            max_block: [1024, 1024, 64],
            max_grid: [i32::MAX as u32, 65535, 65535],
            max_shared: 48 * 1024,
            budget: 0,
            timeout: None,
            sm_count: 1,
            threads: 1,
            preempt: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub instructions: u64,
    pub blocks: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum St {
    Run,
    /// Waiting at barrier N.
    Bar(u8),
    /// Waiting at a warp collective.
    Coll,
    Exit,
}

struct Coords {
    tid: [u32; 3],
    ntid: [u32; 3],
    ctaid: [u32; 3],
    nctaid: [u32; 3],
    lane: u32,
    warp: u32,
    nwarp: u32,
}

/// Launch-wide values special registers read.
struct LaunchInfo {
    dyn_base: u64,
    dyn_size: u64,
    total_smem: u64,
    /// Where the block's reserved shared memory starts: after its own.
    reserved_base: u64,
    sm_count: u32,
    start: Instant,
}

impl Coords {
    #[inline]
    fn special(&self, s: Special, clock: u64, li: &LaunchInfo) -> u64 {
        let lane = self.lane;
        match s {
            Special::Tid(d) => self.tid[d as usize] as u64,
            Special::Ntid(d) => self.ntid[d as usize] as u64,
            Special::Ctaid(d) => self.ctaid[d as usize] as u64,
            Special::Nctaid(d) => self.nctaid[d as usize] as u64,
            Special::LaneId => lane as u64,
            Special::WarpId => self.warp as u64,
            Special::NWarpId => self.nwarp as u64,
            Special::Clock => clock & 0xffff_ffff,
            Special::ClockHi => clock >> 32,
            Special::Clock64 => clock,
            Special::LaneMaskEq => 1u64 << lane,
            Special::LaneMaskLt => (1u64 << lane) - 1,
            Special::LaneMaskLe => (1u64 << (lane + 1)) - 1,
            Special::LaneMaskGt => 0xffff_ffff & !((1u64 << (lane + 1)) - 1),
            Special::LaneMaskGe => 0xffff_ffff & !((1u64 << lane) - 1),
            Special::SmId => 0,
            Special::NSmId => li.sm_count as u64,
            Special::GridId => 1,
            Special::GlobalTimer => globaltimer(li),
            Special::GlobalTimerLo => globaltimer(li) & 0xffff_ffff,
            Special::GlobalTimerHi => globaltimer(li) >> 32,
            Special::DynSmemSize => li.dyn_size,
            Special::TotalSmemSize => li.total_smem,
            Special::Const(v) => v,
            Special::DynShared => li.dyn_base,
            Special::ReservedSmem(which) => match which {
                0 => li.reserved_base,
                1 => li.reserved_base + 16,
                2 => li.reserved_base + RESERVED_SMEM,
                _ => RESERVED_SMEM,
            },
        }
    }
}

fn globaltimer(li: &LaunchInfo) -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    since.max(li.start.elapsed().as_nanos() as u64)
}

/// A warp collective's operands (taken when the lane parks) and its result.
#[derive(Clone, Copy, Default)]
struct Coll {
    mask: u32,
    a: u64,
    b: u64,
    c: u64,
    /// Register operands of a matrix instruction (`mma`: A's, B's, then
    /// C's; `stmatrix`: its sources).
    v: [u64; MAX_MATRIX_REGS],
    /// Set once the collective completed: `out` and `outp` are its results
    /// (`outv` for a matrix instruction's destination registers).
    done: bool,
    out: u64,
    outp: bool,
    outv: [u64; 8],
    /// The cluster barrier's phase when this thread last arrived on it; kept
    /// across the collectives it may run before it waits.
    cluster_phase: u64,
}

/// Most register operands a matrix instruction takes from one lane
/// (`wmma.mma` .m16n16k16 on f16: 8 of A, 8 of B, 8 of C).
const MAX_MATRIX_REGS: usize = 24;

impl Coll {
    /// Operands of a collective the thread parks on.
    fn park(&mut self, mask: u32, a: u64, b: u64, c: u64) {
        *self = Coll { mask, a, b, c, cluster_phase: self.cluster_phase, ..Coll::default() };
    }
}

#[derive(Clone, Copy, Default)]
struct Barrier {
    arrived: u32,
    count: Option<u32>,
    /// Completions so far (the cluster barrier's phase).
    phase: u64,
}

/// Barrier slot of `barrier.cluster`, after the 16 named barriers.
const CLUSTER_BARRIER: usize = 16;

/// A call in progress: where to go back to and what to copy back.
struct Frame {
    ret_pc: u32,
    body: u32,
    fb: u32,
    lb: u32,
    /// Return value: (offset in the caller's frame, callee's return slot).
    ret: Option<((u32, u32), (u32, u32))>,
}

/// One thread's frames beyond the kernel's own registers.
#[derive(Default)]
struct Stack {
    frames: Vec<Frame>,
    /// Registers of called functions' frames.
    regs: Vec<u64>,
    /// Local memory: the kernel's frame, then each call's frame.
    local: Vec<u8>,
    body: u32,
    fb: u32,
    lb: u32,
}

/// Runs `k` over the grid. `params` is the packed parameter buffer.
///
/// Every cost of a launch is metered against `limits.budget`: each
/// instruction (one unit per register written or element moved), each
/// block's set-up (a fixed cost plus one unit per [`ZERO_BYTES_PER_UNIT`]
/// bytes of register file, local and shared memory zeroed), each call's
/// frame, and each scheduling round over a block's threads.
/// `limits.timeout` bounds wall-clock time whatever the budget.
pub fn launch(k: &Kernel, cfg: &LaunchConfig, params: &[u8], mem: &mut dyn GlobalMem, limits: &Limits) -> Result<Stats, ExecError> {
    let nthreads = cfg.block.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64)).unwrap_or(u64::MAX);
    if nthreads == 0 || nthreads > limits.max_threads_per_block as u64 {
        return Err(ExecError::BadLaunch(format!("{nthreads} threads per block (limit {})", limits.max_threads_per_block)));
    }
    for d in 0..3 {
        if cfg.block[d] == 0 || cfg.block[d] > limits.max_block[d] || cfg.grid[d] == 0 || cfg.grid[d] > limits.max_grid[d] {
            return Err(ExecError::BadLaunch(format!("grid {:?} / block {:?} outside the device limits", cfg.grid, cfg.block)));
        }
    }
    let dyn_base = (k.shared_bytes as u64).div_ceil(16) * 16;
    let shared = if cfg.dynamic_shared > 0 { dyn_base + cfg.dynamic_shared as u64 } else { k.shared_bytes as u64 };
    if shared > limits.max_shared as u64 {
        return Err(ExecError::BadLaunch(format!("{shared} bytes of shared memory (limit {})", limits.max_shared)));
    }
    if (params.len() as u64) < k.params_size as u64 {
        return Err(ExecError::BadLaunch(format!("{} parameter bytes given, kernel '{}' takes {}", params.len(), k.name, k.params_size)));
    }
    let regfile = nthreads.saturating_mul(k.num_regs as u64).saturating_mul(8);
    if regfile > MAX_REGISTER_FILE {
        return Err(ExecError::OutOfResources(format!("{nthreads} threads × {} registers need a {regfile}-byte register file per block (limit {MAX_REGISTER_FILE})", k.num_regs)));
    }
    let local = nthreads.saturating_mul(k.local_size as u64);
    if regfile.saturating_add(local) > MAX_BLOCK_STACK {
        return Err(ExecError::OutOfResources(format!("{nthreads} threads × {} bytes of local memory and a {regfile}-byte register file exceed the {MAX_BLOCK_STACK}-byte block limit", k.local_size)));
    }
    // The reserved shared memory follows the kernel's own, outside its
    // limit, as on sm_80 and later, past a guard of the same size that
    // faults, so a kernel overrunning its own shared memory still faults.
    let reserved_base = shared.div_ceil(16) * 16 + RESERVED_SMEM;
    let total_smem = shared;
    let shared = reserved_base + RESERVED_SMEM;
    let budget = if limits.budget == 0 { u64::MAX } else { limits.budget };
    let start = Instant::now();
    // Pauses of the work before this launch (an earlier launch's, on the
    // same lane lease) give it no extra time.
    let paused_before = limits.preempt.map_or(Duration::ZERO, |p| p.paused());
    let deadline = limits.timeout.map(|limit| Deadline { at: start + limit, limit, paused_before });
    let block_units = BLOCK_UNITS + nthreads + (regfile + shared + local) / ZERO_BYTES_PER_UNIT;
    let li = LaunchInfo { dyn_base, dyn_size: cfg.dynamic_shared as u64, total_smem, reserved_base, sm_count: limits.sm_count.max(1), start };
    let nblocks = cfg.grid.iter().map(|&g| g as u64).product::<u64>();
    let threads = (limits.threads.max(1) as u64).min(nblocks) as usize;
    let _in_flight = InFlight::enter();
    if threads > 1 {
        if let Some(_pool) = PoolClaim::take() {
            let views: Vec<_> = (0..threads).map_while(|_| mem.fork()).collect();
            if views.len() == threads {
                return launch_parallel(k, cfg, params, views, budget, deadline, block_units, shared, &li, limits.preempt);
            }
        }
    }
    let mut meter = Meter { left: budget, budget, deadline, next_clock: budget.saturating_sub(CLOCK_EVERY), pool: None, taken: budget, preempt: limits.preempt };
    let mut b = BlockState::new(k, nthreads as usize, shared);
    let mut stats = Stats::default();
    for i in 0..nblocks {
        // Each block's allocation is charged before it is made.
        meter.charge(block_units)?;
        b.reset(k);
        run_block(k, &mut b, cfg, block_index(cfg, i), params, mem, &mut meter, &li)?;
        stats.blocks += 1;
    }
    stats.instructions = meter.spent();
    Ok(stats)
}

/// Launches running in this process (one device worker) right now.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Set while one launch has the block pool.
static POOL_BUSY: AtomicBool = AtomicBool::new(false);

/// Counts a launch in [`IN_FLIGHT`] for as long as it lives.
struct InFlight;

impl InFlight {
    fn enter() -> InFlight {
        IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The block pool, held by one launch at a time: its jobs then all start
/// at once, and no launch ever waits for another's jobs. A launch that
/// finds the pool taken runs on its own lane, as every launch gets one.
struct PoolClaim;

impl PoolClaim {
    fn take() -> Option<PoolClaim> {
        POOL_BUSY.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).ok().map(|_| PoolClaim)
    }
}

impl Drop for PoolClaim {
    fn drop(&mut self) {
        POOL_BUSY.store(false, Ordering::Release);
    }
}

/// Block number `i` of the grid, x fastest.
fn block_index(cfg: &LaunchConfig, i: u64) -> [u32; 3] {
    let (gx, gy) = (cfg.grid[0] as u64, cfg.grid[1] as u64);
    [(i % gx) as u32, ((i / gx) % gy) as u32, (i / (gx * gy)) as u32]
}

/// Runs the grid's blocks on `views.len()` host threads of rayon's pool,
/// each taking the next block not yet started, with one shared budget; the
/// first error stops every thread after its current block.
#[allow(clippy::too_many_arguments)]
fn launch_parallel(
    k: &Kernel,
    cfg: &LaunchConfig,
    params: &[u8],
    views: Vec<Box<dyn GlobalMem + Send + '_>>,
    budget: u64,
    deadline: Option<Deadline>,
    block_units: u64,
    shared: u64,
    li: &LaunchInfo,
    preempt: Option<&dyn Preempt>,
) -> Result<Stats, ExecError> {
    let nblocks = cfg.grid.iter().map(|&g| g as u64).product::<u64>();
    let nthreads = cfg.block.iter().map(|&d| d as usize).product::<usize>();
    let pool = AtomicU64::new(budget);
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let first_err: Mutex<Option<ExecError>> = Mutex::new(None);
    let spent = AtomicU64::new(0);
    let blocks = AtomicU64::new(0);
    let work = |job: usize, mut view: Box<dyn GlobalMem + Send + '_>| {
        let _job = JobGuard::enter(preempt.filter(|_| job > 0), &stop);
        let mut meter = Meter { left: 0, budget, deadline, next_clock: 0, pool: Some(&pool), taken: 0, preempt };
        let mut b = BlockState::new(k, nthreads, shared);
        let r = (|| -> Result<(), ExecError> {
            while !stop.load(Ordering::Relaxed) {
                // Helpers give their cores back as soon as another
                // launch runs: it has a lane of its own, and this
                // launch keeps its first job.
                if job > 0 && IN_FLIGHT.load(Ordering::Relaxed) > 1 {
                    return Ok(());
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= nblocks {
                    return Ok(());
                }
                meter.charge(block_units)?;
                b.reset(k);
                run_block(k, &mut b, cfg, block_index(cfg, i), params, &mut *view, &mut meter, li)?;
                blocks.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })();
        spent.fetch_add(meter.spent(), Ordering::Relaxed);
        if let Err(e) = r {
            stop.store(true, Ordering::Relaxed);
            first_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
    };
    let work = &work;
    // The first job runs on the calling thread (the lane's), the others on
    // rayon's pool.
    rayon::in_place_scope(|s| {
        let mut views = views.into_iter().enumerate();
        let first = views.next();
        for (job, view) in views {
            s.spawn(move |_| work(job, view));
        }
        if let Some((job, view)) = first {
            work(job, view);
        }
    });
    if let Some(e) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(Stats { instructions: spent.into_inner(), blocks: blocks.into_inner() })
}

/// One job of a parallel launch while it runs: a helper job (on rayon's
/// pool) is announced to the scheduler and, however it ends, leaves as
/// one; a job that panics stops the others after their current block.
struct JobGuard<'a> {
    helper: Option<&'a dyn Preempt>,
    stop: &'a AtomicBool,
}

impl<'a> JobGuard<'a> {
    fn enter(helper: Option<&'a dyn Preempt>, stop: &'a AtomicBool) -> JobGuard<'a> {
        if let Some(p) = helper {
            p.helper(true);
        }
        JobGuard { helper, stop }
    }
}

impl Drop for JobGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.stop.store(true, Ordering::Relaxed);
        }
        if let Some(p) = self.helper {
            p.helper(false);
        }
    }
}

struct BlockState {
    n: usize,
    nregs: usize,
    regs: Vec<u64>,
    pc: Vec<u32>,
    st: Vec<St>,
    shared: Vec<u8>,
    stacks: Vec<Stack>,
    coll: Vec<Coll>,
    bars: [Barrier; 17],
    /// Bytes of call frames (registers and local memory) the block holds.
    stack_bytes: u64,
}

impl BlockState {
    fn new(k: &Kernel, n: usize, shared: u64) -> BlockState {
        BlockState {
            n,
            nregs: k.num_regs as usize,
            regs: vec![0; n * k.num_regs as usize],
            pc: vec![k.entry; n],
            st: vec![St::Run; n],
            shared: vec![0; shared as usize],
            stacks: (0..n).map(|_| Stack { body: KERNEL, ..Stack::default() }).collect(),
            coll: vec![Coll::default(); n],
            bars: [Barrier::default(); 17],
            stack_bytes: Self::base_bytes(k, n),
        }
    }

    /// Host bytes a block holds before any call: register file and local
    /// frames; calls add to it up to [`MAX_BLOCK_STACK`].
    fn base_bytes(k: &Kernel, n: usize) -> u64 {
        (n as u64).saturating_mul(k.num_regs as u64 * 8 + k.local_size as u64)
    }

    fn reset(&mut self, k: &Kernel) {
        self.regs.fill(0);
        self.pc.fill(k.entry);
        self.st.fill(St::Run);
        self.shared.fill(0);
        for s in &mut self.stacks {
            s.frames.clear();
            s.regs.clear();
            s.local.clear();
            s.local.resize(k.local_size as usize, 0);
            s.body = KERNEL;
            s.fb = 0;
            s.lb = 0;
        }
        self.coll.fill(Coll::default());
        self.bars = [Barrier::default(); 17];
        self.stack_bytes = Self::base_bytes(k, self.n);
    }

    /// Lane `t`'s register `r` in its current frame (0 if out of range).
    fn peek_reg(&self, t: usize, r: u32) -> u64 {
        let s = &self.stacks[t];
        if s.body == KERNEL {
            if (r as usize) < self.nregs {
                self.regs[t * self.nregs + r as usize]
            } else {
                0
            }
        } else {
            s.regs.get(s.fb as usize + r as usize).copied().unwrap_or(0)
        }
    }
}

fn coords(t: usize, cfg: &LaunchConfig, ctaid: [u32; 3], n: usize) -> Coords {
    let bx = cfg.block[0] as usize;
    let by = cfg.block[1] as usize;
    Coords {
        tid: [(t % bx) as u32, ((t / bx) % by) as u32, (t / (bx * by)) as u32],
        ntid: cfg.block,
        ctaid,
        nctaid: cfg.grid,
        lane: (t % WARP) as u32,
        warp: (t / WARP) as u32,
        nwarp: n.div_ceil(WARP) as u32,
    }
}

#[allow(clippy::too_many_arguments)]
fn run_block(k: &Kernel, b: &mut BlockState, cfg: &LaunchConfig, ctaid: [u32; 3], params: &[u8], mem: &mut dyn GlobalMem, meter: &mut Meter<'_>, li: &LaunchInfo) -> Result<(), ExecError> {
    let n = b.n;
    // One scheduling round scans every thread and warp of the block.
    let round_units = (n as u64).div_ceil(WARP as u64);
    loop {
        meter.charge(round_units)?;
        let mut ran = false;
        for t in 0..n {
            if b.st[t] == St::Run {
                ran = true;
                let c = coords(t, cfg, ctaid, n);
                b.st[t] = run_thread(k, b, t, &c, params, mem, meter, li)?;
            }
        }
        let mut released = false;
        if b.st.contains(&St::Coll) {
            for w in 0..n.div_ceil(WARP) {
                released |= resolve_warp(k, b, w)?;
            }
        }
        if b.bars.iter().any(|bar| bar.arrived > 0) {
            released |= resolve_barriers(k, b)?;
        }
        if released || b.st.contains(&St::Run) {
            continue;
        }
        if b.st.iter().all(|s| *s == St::Exit) {
            return Ok(());
        }
        let _ = ran;
        let t = b.st.iter().position(|s| *s != St::Exit).unwrap_or(0);
        let line = k.code.insts.get(b.pc[t] as usize).map(|i| i.line).unwrap_or(0);
        let what = match b.st[t] {
            St::Bar(id) => format!("barrier {id}"),
            _ => "a warp collective".to_string(),
        };
        return Err(ExecError::Deadlock(format!("thread {t} waits at {what} (PTX line {line}) for threads that can never arrive")));
    }
}

/// Opens every barrier whose thread count has arrived.
fn resolve_barriers(k: &Kernel, b: &mut BlockState) -> Result<bool, ExecError> {
    let live = b.st.iter().filter(|s| **s != St::Exit).count() as u32;
    let mut released = false;
    for id in 0..17u8 {
        let bar = b.bars[id as usize];
        if bar.arrived == 0 {
            continue;
        }
        let want = bar.count.unwrap_or(live).min(live.max(1));
        if bar.arrived < want {
            continue;
        }
        let waiting: Vec<usize> = (0..b.n).filter(|&t| b.st[t] == St::Bar(id)).collect();
        // A reduction over the threads that waited with bar.red.
        let (mut popc, mut all, mut any) = (0u64, true, false);
        for &t in &waiting {
            let v = b.coll[t].a & 1 != 0;
            popc += v as u64;
            all &= v;
            any |= v;
        }
        for &t in &waiting {
            let out = match &k.code.insts[b.pc[t] as usize].op {
                Op::Bar { kind: BarKind::RedPopc, .. } => popc,
                Op::Bar { kind: BarKind::RedAnd, .. } => all as u64,
                Op::Bar { kind: BarKind::RedOr, .. } => any as u64,
                _ => 0,
            };
            b.coll[t].done = true;
            b.coll[t].out = out;
            b.st[t] = St::Run;
        }
        b.bars[id as usize] = Barrier { phase: bar.phase + 1, ..Barrier::default() };
        released = true;
    }
    Ok(released)
}

/// Completes the warp's collectives whose member lanes have all arrived.
fn resolve_warp(k: &Kernel, b: &mut BlockState, w: usize) -> Result<bool, ExecError> {
    let lo = w * WARP;
    let hi = (lo + WARP).min(b.n);
    let insts = &k.code.insts;
    let waiting = |b: &BlockState, t: usize| b.st[t] == St::Coll && !b.coll[t].done;
    let mut exited = 0u32;
    let mut parked = 0u32;
    for t in lo..hi {
        if b.st[t] == St::Exit {
            exited |= 1 << (t - lo);
        }
        if waiting(b, t) {
            parked |= 1 << (t - lo);
        }
    }
    if parked == 0 {
        return Ok(false);
    }
    let present: u32 = if hi - lo == WARP { u32::MAX } else { (1u32 << (hi - lo)) - 1 };
    let mut released = false;
    let mut settled = 0u32;
    for i in 0..(hi - lo) {
        let t = lo + i;
        if settled & (1 << i) != 0 || !waiting(b, t) {
            continue;
        }
        let pc = b.pc[t];
        let op = &insts[pc as usize].op;
        let by_arrival = matches!(op, Op::ActiveMask { .. }) || matches!(op, Op::Vote { mask: Src::Imm(0), .. });
        let group = if by_arrival {
            // Lanes that reached this instruction in the same round.
            (0..(hi - lo)).filter(|&j| parked & (1 << j) != 0 && b.pc[lo + j] == pc).fold(0u32, |m, j| m | (1 << j))
        } else {
            let members = (b.coll[t].mask | (1 << i)) & present & !exited;
            let ready = (0..(hi - lo))
                .filter(|&j| members & (1 << j) != 0)
                .all(|j| parked & (1 << j) != 0 && (b.pc[lo + j] == pc || (matches!(op, Op::WarpSync { .. }) && matches!(insts[b.pc[lo + j] as usize].op, Op::WarpSync { .. }))));
            if !ready {
                continue;
            }
            members
        };
        settled |= group;
        complete(op, b, lo, hi, group).map_err(|e| e.at(insts[pc as usize].line))?;
        released = true;
    }
    Ok(released)
}

/// Computes a collective for the lanes in `group` (bits relative to `lo`).
fn complete(op: &Op, b: &mut BlockState, lo: usize, hi: usize, group: u32) -> Result<(), ExecError> {
    let lanes: Vec<usize> = (0..(hi - lo)).filter(|j| group & (1 << j) != 0).collect();
    let mut results: Vec<(usize, u64, bool)> = Vec::with_capacity(lanes.len());
    match op {
        Op::Mma(mma) => {
            let n = mma.a.len() + mma.b.len() + mma.c.len();
            let coll = &b.coll;
            let d = crate::mma::run(mma, &|lane| {
                let j = lane as usize;
                (group & (1 << j) != 0).then(|| coll[lo + j].v[..n].to_vec())
            });
            for &j in &lanes {
                let c = &mut b.coll[lo + j];
                c.outv[..d[j].len()].copy_from_slice(&d[j]);
            }
            results.extend(lanes.iter().map(|&j| (j, 0, false)));
        }
        Op::Ldmatrix { num, trans, space, .. } | Op::Stmatrix { num, trans, space, .. } => {
            let load = matches!(op, Op::Ldmatrix { .. });
            // Lane r's address names row r % 8 of matrix r / 8; a lane that
            // is not in the group gives no row.
            let row_addr = |b: &BlockState, r: u32| -> Result<usize, ExecError> {
                let t = r as usize;
                if group & (1 << t) == 0 {
                    return Err(ExecError::Failed(format!("matrix row {} needs lane {t}, which did not take part", r % 8)));
                }
                let a = b.coll[lo + t].a;
                // A generic address must fall in the shared window.
                let off = if *space == Space::Generic { a.wrapping_sub(SHARED_WINDOW) } else { a };
                if off % 16 != 0 {
                    return Err(ExecError::Misaligned { addr: a, len: 16, line: 0 });
                }
                if off.checked_add(16).is_none_or(|end| end > b.shared.len() as u64) {
                    return Err(ExecError::IllegalAddress { kind: "shared", addr: a, len: 16, line: 0 });
                }
                Ok(off as usize)
            };
            for &j in &lanes {
                for q in 0..*num as u32 {
                    let mut reg = 0u64;
                    for h in 0..2 {
                        let (r, byte) = crate::mma::tile_at(j as u32, q, h, *trans);
                        let at = row_addr(b, r)? + byte as usize;
                        if load {
                            reg |= (u16::from_le_bytes([b.shared[at], b.shared[at + 1]]) as u64) << (16 * h);
                        } else {
                            let v = (b.coll[lo + j].v[q as usize] >> (16 * h)) as u16;
                            b.shared[at..at + 2].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    b.coll[lo + j].outv[q as usize] = reg;
                }
            }
            results.extend(lanes.iter().map(|&j| (j, 0, false)));
        }
        Op::Shfl { mode, a, .. } => {
            for &j in &lanes {
                let lane = j as i64;
                let cl = &b.coll[lo + j];
                let bv = (cl.b & 0x1f) as i64;
                let clamp = (cl.c & 0x1f) as i64;
                let seg = ((cl.c >> 8) & 0x1f) as i64;
                let max_lane = (lane & seg) | (clamp & !seg);
                let min_lane = lane & seg;
                let (src, ok) = match mode {
                    ShflMode::Up => (lane - bv, lane - bv >= max_lane),
                    ShflMode::Down => (lane + bv, lane + bv <= max_lane),
                    ShflMode::Bfly => (lane ^ bv, (lane ^ bv) <= max_lane),
                    ShflMode::Idx => {
                        let s = min_lane | (bv & !seg);
                        (s, s <= max_lane)
                    }
                };
                let src = if ok { src as usize } else { j };
                // A source lane in the group gives the value it brought; one
                // outside it (undefined in PTX) gives its register as it is.
                let v = if group & (1 << src) != 0 {
                    b.coll[lo + src].a
                } else if lo + src < hi {
                    match a {
                        Src::Reg(r) => b.peek_reg(lo + src, *r),
                        _ => b.coll[lo + j].a,
                    }
                } else {
                    b.coll[lo + j].a
                };
                results.push((j, v & 0xffff_ffff, ok));
            }
        }
        Op::Vote { mode, negate, .. } => {
            let mut ballot = 0u64;
            for &j in &lanes {
                if ((b.coll[lo + j].a & 1) != 0) != *negate {
                    ballot |= 1 << j;
                }
            }
            let set = ballot.count_ones() as usize;
            let v = match mode {
                VoteMode::Ballot => ballot,
                VoteMode::All => (set == lanes.len()) as u64,
                VoteMode::Any => (set > 0) as u64,
                VoteMode::Uni => (set == 0 || set == lanes.len()) as u64,
            };
            results.extend(lanes.iter().map(|&j| (j, v, false)));
        }
        Op::Match { all, ty, .. } => {
            let val = |j: usize| ty.mask(b.coll[lo + j].a);
            if *all {
                let same = lanes.iter().all(|&j| val(j) == val(lanes[0]));
                results.extend(lanes.iter().map(|&j| (j, if same { group as u64 } else { 0 }, same)));
            } else {
                for &j in &lanes {
                    let m = lanes.iter().filter(|&&x| val(x) == val(j)).fold(0u64, |m, &x| m | (1 << x));
                    results.push((j, m, false));
                }
            }
        }
        Op::Redux { op, ty, .. } => {
            let vals = lanes.iter().map(|&j| b.coll[lo + j].a & 0xffff_ffff);
            let signed = ty.is_signed();
            let v = match op {
                ReduxOp::Add => vals.fold(0u64, |s, v| s.wrapping_add(v)) & 0xffff_ffff,
                ReduxOp::And => vals.fold(0xffff_ffff, |s, v| s & v),
                ReduxOp::Or => vals.fold(0, |s, v| s | v),
                ReduxOp::Xor => vals.fold(0, |s, v| s ^ v),
                ReduxOp::Min if signed => vals.map(|v| v as u32 as i32).min().unwrap_or(0) as u32 as u64,
                ReduxOp::Max if signed => vals.map(|v| v as u32 as i32).max().unwrap_or(0) as u32 as u64,
                ReduxOp::Min => vals.min().unwrap_or(0),
                ReduxOp::Max => vals.max().unwrap_or(0),
            };
            results.extend(lanes.iter().map(|&j| (j, v, false)));
        }
        Op::Elect { .. } => {
            let leader = lanes.first().copied().unwrap_or(0);
            results.extend(lanes.iter().map(|&j| (j, leader as u64, j == leader)));
        }
        Op::ActiveMask { .. } => results.extend(lanes.iter().map(|&j| (j, group as u64, false))),
        _ => results.extend(lanes.iter().map(|&j| (j, 0, false))),
    }
    for (j, out, outp) in results {
        let c = &mut b.coll[lo + j];
        c.done = true;
        c.out = out;
        c.outp = outp;
        b.st[lo + j] = St::Run;
    }
    Ok(())
}

/// Per-thread values an instruction's operands read.
struct Th<'a> {
    c: &'a Coords,
    li: &'a LaunchInfo,
    syms: &'a [u64],
    lb: u64,
}

#[inline(always)]
fn rd(regs: &[u64], s: &Src, th: &Th, clock: u64) -> u64 {
    match s {
        Src::Reg(r) => regs[*r as usize],
        Src::Imm(v) => *v,
        Src::Special(sp) => th.c.special(*sp, clock, th.li),
        Src::Sym(i) => th.syms.get(*i as usize).copied().unwrap_or(0),
        Src::Local(off) => th.lb + *off as u64,
    }
}

#[inline(always)]
fn f32v(v: u64) -> f32 {
    f32::from_bits(v as u32)
}
#[inline(always)]
fn f64v(v: u64) -> f64 {
    f64::from_bits(v)
}

struct Mem<'a> {
    shared: &'a mut [u8],
    /// The kernel's own shared bytes, and where the reserved ones start
    /// (between them, a guard that faults).
    smem_own: u64,
    smem_reserved: u64,
    params: &'a [u8],
    local: &'a mut Vec<u8>,
    global: &'a mut dyn GlobalMem,
}

impl Mem<'_> {
    fn resolve(&self, space: Space, addr: u64) -> Space {
        match space {
            Space::Generic if addr >= SHARED_WINDOW && addr - SHARED_WINDOW < self.shared.len() as u64 => Space::Shared,
            Space::Generic if addr >= LOCAL_WINDOW && addr - LOCAL_WINDOW < self.local.len() as u64 => Space::Local,
            Space::Generic if addr >= PARAM_WINDOW && addr - PARAM_WINDOW < self.params.len() as u64 => Space::Param,
            Space::Generic => Space::Global,
            s => s,
        }
    }

    fn range(&self, space: Space, addr: u64, len: usize) -> Result<std::ops::Range<usize>, ExecError> {
        let (window, size, kind) = match space {
            Space::Shared => (SHARED_WINDOW, self.shared.len(), "shared"),
            Space::Local => (LOCAL_WINDOW, self.local.len(), "local"),
            _ => (PARAM_WINDOW, self.params.len(), "param"),
        };
        let off = if addr >= window { addr - window } else { addr };
        let guard = space == Space::Shared && off < self.smem_reserved && off.saturating_add(len as u64) > self.smem_own;
        match off.checked_add(len as u64) {
            Some(end) if end <= size as u64 && !guard => Ok(off as usize..end as usize),
            _ => Err(ExecError::IllegalAddress { kind, addr, len, line: 0 }),
        }
    }

    fn check_align(addr: u64, len: usize) -> Result<(), ExecError> {
        if !addr.is_multiple_of(len as u64) {
            return Err(ExecError::Misaligned { addr, len, line: 0 });
        }
        Ok(())
    }

    fn load(&mut self, space: Space, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let space = self.resolve(space, addr);
        if space != Space::Param {
            Self::check_align(addr, out.len())?;
        }
        match space {
            Space::Global | Space::Generic => self.global.load(addr, out),
            Space::Shared => {
                let r = self.range(space, addr, out.len())?;
                out.copy_from_slice(&self.shared[r]);
                Ok(())
            }
            Space::Local => {
                let r = self.range(space, addr, out.len())?;
                out.copy_from_slice(&self.local[r]);
                Ok(())
            }
            Space::Param => {
                let r = self.range(space, addr, out.len())?;
                out.copy_from_slice(&self.params[r]);
                Ok(())
            }
        }
    }

    fn store(&mut self, space: Space, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        let space = self.resolve(space, addr);
        Self::check_align(addr, data.len())?;
        match space {
            Space::Global | Space::Generic => self.global.store(addr, data),
            Space::Shared => {
                let r = self.range(space, addr, data.len())?;
                self.shared[r].copy_from_slice(data);
                Ok(())
            }
            Space::Local => {
                let r = self.range(space, addr, data.len())?;
                self.local[r].copy_from_slice(data);
                Ok(())
            }
            Space::Param => Err(ExecError::IllegalAddress { kind: "param (store)", addr, len: data.len(), line: 0 }),
        }
    }

    /// An atomic read-modify-write: on global memory through the tenant's
    /// view (other blocks may run on other host threads), elsewhere in place.
    fn atomic(&mut self, space: Space, addr: u64, n: usize, f: impl Fn(u64) -> u64) -> Result<u64, ExecError> {
        let space = self.resolve(space, addr);
        Self::check_align(addr, n)?;
        if matches!(space, Space::Global | Space::Generic) {
            return self.global.atomic(addr, n, &mut |old| f(old));
        }
        let old = self.load_val(space, addr, n)?;
        self.store(space, addr, &f(old).to_le_bytes()[..n])?;
        Ok(old)
    }

    fn load_val(&mut self, space: Space, addr: u64, n: usize) -> Result<u64, ExecError> {
        let mut buf = [0u8; 8];
        self.load(space, addr, &mut buf[..n])?;
        Ok(u64::from_le_bytes(buf))
    }

    /// A NUL-terminated string of at most `max` bytes from global memory.
    fn cstr(&mut self, addr: u64, max: usize) -> String {
        let mut out = Vec::new();
        let mut byte = [0u8];
        while out.len() < max && self.load(Space::Generic, addr.wrapping_add(out.len() as u64), &mut byte).is_ok() && byte[0] != 0 {
            out.push(byte[0]);
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Why a frame stopped running.
enum Ev {
    Park(St),
    Call { callee: u32, at: usize },
    Ret,
}

#[allow(clippy::too_many_arguments)]
fn run_thread(k: &Kernel, b: &mut BlockState, t: usize, c: &Coords, params: &[u8], global: &mut dyn GlobalMem, meter: &mut Meter, li: &LaunchInfo) -> Result<St, ExecError> {
    let code = &*k.code;
    let nk = b.nregs;
    // A parallel launch's meter holds a chunk of the shared budget: with
    // less than a slice left, the slice would never end (yield_at 0) and a
    // thread spinning on another warp's store (a cooperative-groups tile
    // barrier) would spin through every refill. Take the next chunk first.
    if meter.left < 2 * SLICE {
        meter.refill(2 * SLICE);
    }
    let yield_at = meter.left.saturating_sub(SLICE);
    let BlockState { regs: kregs, pc: pcs, shared, stacks, coll, bars, stack_bytes, .. } = b;
    let stack = &mut stacks[t];
    let mut pc = pcs[t] as usize;
    loop {
        let nregs = if stack.body == KERNEL { nk } else { code.funcs[stack.body as usize].num_regs as usize };
        let regs: &mut [u64] = if stack.body == KERNEL { &mut kregs[t * nk..(t + 1) * nk] } else { &mut stack.regs[stack.fb as usize..stack.fb as usize + nregs] };
        let th = Th { c, li, syms: &code.syms, lb: stack.lb as u64 };
        let cl = &mut coll[t];
        if cl.done {
            // The collective or barrier this lane parked on completed.
            cl.done = false;
            match &code.insts[pc].op {
                Op::Shfl { d, p, .. } | Op::Match { d, p, .. } => {
                    regs[*d as usize] = cl.out;
                    if let Some(p) = p {
                        regs[*p as usize] = cl.outp as u64;
                    }
                }
                Op::Vote { d, .. } | Op::Redux { d, .. } | Op::ActiveMask { d } => regs[*d as usize] = cl.out,
                Op::Bar { d: Some(d), .. } => regs[*d as usize] = cl.out,
                Op::Mma(m) => {
                    for (i, d) in m.d.iter().enumerate() {
                        regs[*d as usize] = cl.outv[i];
                    }
                }
                Op::Ldmatrix { d, .. } => {
                    for (i, d) in d.iter().enumerate() {
                        regs[*d as usize] = cl.outv[i];
                    }
                }
                Op::Elect { d, p, .. } => {
                    if let Some(d) = d {
                        regs[*d as usize] = cl.out;
                    }
                    if let Some(p) = p {
                        regs[*p as usize] = cl.outp as u64;
                    }
                }
                _ => {}
            }
            pc += 1;
        }
        let mut m = Mem { shared, smem_own: li.total_smem, smem_reserved: li.reserved_base, params, local: &mut stack.local, global: &mut *global };
        let ev = run_frame(&code.insts, &mut pc, regs, &th, &mut m, meter, yield_at, cl, bars);
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                pcs[t] = pc as u32;
                return Err(e);
            }
        };
        match ev {
            Ev::Park(st) => {
                pcs[t] = pc as u32;
                return Ok(st);
            }
            Ev::Ret => {
                let Some(f) = stack.frames.pop() else {
                    pcs[t] = pc as u32;
                    return Ok(St::Exit);
                };
                meter.charge(CALL_UNITS)?;
                if let Some(((dst, dsize), (src, ssize))) = f.ret {
                    let n = dsize.min(ssize) as usize;
                    let (s, d) = (stack.lb as usize + src as usize, f.lb as usize + dst as usize);
                    if s + n <= stack.local.len() && d + n <= stack.local.len() {
                        stack.local.copy_within(s..s + n, d);
                    }
                }
                let callee = &code.funcs[stack.body as usize];
                let freed = callee.num_regs as u64 * 8 + callee.local_size as u64 + std::mem::size_of::<Frame>() as u64;
                *stack_bytes = stack_bytes.saturating_sub(freed);
                stack.regs.truncate(stack.fb as usize);
                stack.local.truncate(stack.lb as usize);
                stack.body = f.body;
                stack.fb = f.fb;
                stack.lb = f.lb;
                pc = f.ret_pc as usize;
            }
            Ev::Call { callee, at } => {
                let (args, ret): (&[(u32, u32)], _) = match &code.insts[at].op {
                    Op::Call { args, ret, .. } => (args, *ret),
                    _ => (&[], None),
                };
                let line = code.insts[at].line;
                let Some(f) = code.funcs.get(callee as usize) else {
                    pcs[t] = at as u32;
                    return Err(ExecError::IllegalAddress { kind: "function", addr: FUNC_WINDOW + callee as u64, len: 0, line });
                };
                if let Some(builtin) = f.builtin {
                    let arg = |i: usize, m: &Vec<u8>| -> u64 {
                        let Some(&(off, _)) = args.get(i) else { return 0 };
                        let at = stack.lb as usize + off as usize;
                        m.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8]))).unwrap_or(0)
                    };
                    match builtin {
                        Builtin::AssertFail => {
                            let (msg, file, ln, func) = (arg(0, &stack.local), arg(1, &stack.local), arg(2, &stack.local) as u32, arg(3, &stack.local));
                            let mut m = Mem { shared, smem_own: li.total_smem, smem_reserved: li.reserved_base, params, local: &mut stack.local, global: &mut *global };
                            let (msg, file, func) = (m.cstr(msg, 256), m.cstr(file, 256), m.cstr(func, 256));
                            pcs[t] = pc as u32;
                            return Err(ExecError::Assert(format!(
                                "{file}:{ln}: {func}: block [{},{},{}], thread [{},{},{}]: Assertion `{msg}` failed.",
                                c.ctaid[0], c.ctaid[1], c.ctaid[2], c.tid[0], c.tid[1], c.tid[2]
                            )));
                        }
                        Builtin::Vprintf => {
                            // Output is discarded; printf returns 0.
                            if let Some((off, size)) = ret {
                                let at = stack.lb as usize + off as usize;
                                let n = (size as usize).min(4);
                                if let Some(s) = stack.local.get_mut(at..at + n) {
                                    s.fill(0);
                                }
                            }
                            continue;
                        }
                    }
                }
                let Some(entry) = f.entry else {
                    return Err(ExecError::Failed(format!("call to undefined function '{}' at PTX line {line}", f.name)));
                };
                if stack.frames.len() >= MAX_CALL_DEPTH {
                    return Err(ExecError::Failed(format!("call stack overflow: more than {MAX_CALL_DEPTH} nested calls at PTX line {line}")));
                }
                let caller_local = if stack.body == KERNEL { k.local_size } else { code.funcs[stack.body as usize].local_size };
                let new_lb = (stack.lb as usize + caller_local as usize).div_ceil(16) * 16;
                let new_fb = if stack.body == KERNEL { 0 } else { stack.fb as usize + nregs };
                let frame = f.num_regs as u64 * 8 + f.local_size as u64 + std::mem::size_of::<Frame>() as u64;
                *stack_bytes = stack_bytes.saturating_add(frame);
                if *stack_bytes > MAX_BLOCK_STACK {
                    return Err(ExecError::Failed(format!("call stack overflow: the block's registers, local memory and call frames exceed {MAX_BLOCK_STACK} bytes at PTX line {line}")));
                }
                meter.charge(CALL_UNITS + frame / ZERO_BYTES_PER_UNIT)?;
                stack.local.resize(new_lb + f.local_size as usize, 0);
                stack.local[new_lb..].fill(0);
                for (i, &(aoff, asize)) in args.iter().enumerate() {
                    let Some(&(poff, psize)) = f.params.get(i) else { break };
                    let n = asize.min(psize) as usize;
                    let s = stack.lb as usize + aoff as usize;
                    let d = new_lb + poff as usize;
                    if s + n <= stack.local.len() && d + n <= stack.local.len() {
                        stack.local.copy_within(s..s + n, d);
                    }
                }
                stack.regs.resize(new_fb + f.num_regs as usize, 0);
                stack.regs[new_fb..].fill(0);
                stack.frames.push(Frame { ret_pc: pc as u32, body: stack.body, fb: stack.fb, lb: stack.lb, ret: ret.and_then(|r| f.ret.map(|fr| (r, fr))) });
                stack.body = callee;
                stack.fb = new_fb as u32;
                stack.lb = new_lb as u32;
                pc = entry as usize;
            }
        }
    }
}

/// Runs one frame until it parks, calls, returns or yields. `pc` is left at
/// the instruction to run next (a parked instruction itself).
#[allow(clippy::too_many_arguments)]
fn run_frame(insts: &[Inst], pc_io: &mut usize, regs: &mut [u64], th: &Th, m: &mut Mem, meter: &mut Meter, yield_at: u64, cl: &mut Coll, bars: &mut [Barrier; 17]) -> Result<Ev, ExecError> {
    let mut pc = *pc_io;
    macro_rules! park {
        ($st:expr) => {{
            *pc_io = pc;
            return Ok(Ev::Park($st));
        }};
    }
    // One compare per instruction: past `stop` the slow path yields, looks
    // at the clock or fails on the budget. Instructions that move several
    // elements take their extra units in their own arm (at most
    // MAX_INST_UNITS - 1 past the budget before the next check fails).
    const MAX_INST_UNITS: u64 = 8;
    let mut stop = meter.next_clock.max(yield_at).max(MAX_INST_UNITS);
    loop {
        if meter.left <= stop {
            if meter.left < yield_at {
                // Time slice used: let the block's other threads run.
                park!(St::Run);
            }
            meter.charge(1).inspect_err(|_| *pc_io = pc)?;
            stop = meter.next_clock.max(yield_at).max(MAX_INST_UNITS);
        } else {
            meter.left -= 1;
        }
        let inst = &insts[pc];
        if let Some((p, neg)) = inst.guard {
            if ((regs[p as usize] & 1) != 0) == neg {
                pc += 1;
                continue;
            }
        }
        let clock = meter.spent();
        let c = th;
        let fail = |e: ExecError| e.at(inst.line);
        match &inst.op {
            Op::Mov { ty, d, a } => regs[*d as usize] = ty.mask(rd(regs, a, c, clock)),
            Op::Ld { space, ty, d, addr, dst_bits } => {
                meter.left = meter.left.saturating_sub(d.len() as u64 - 1);
                let base = rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64);
                let n = ty.bytes();
                if d.len() > 1 {
                    // Vector loads need the whole vector aligned.
                    let total = n * d.len();
                    if *space != Space::Param && !base.is_multiple_of(total as u64) {
                        *pc_io = pc;
                        return Err(ExecError::Misaligned { addr: base, len: total, line: inst.line });
                    }
                }
                for (i, dr) in d.iter().enumerate() {
                    let v = m.load_val(*space, base.wrapping_add((i * n) as u64), n).map_err(fail).inspect_err(|_| *pc_io = pc)?;
                    let v = if ty.is_signed() && (n as u32) * 8 < *dst_bits {
                        let s = ty.sext(v) as u64;
                        if *dst_bits >= 64 {
                            s
                        } else {
                            s & ((1u64 << dst_bits) - 1)
                        }
                    } else {
                        v
                    };
                    regs[*dr as usize] = v;
                }
            }
            Op::St { space, ty, addr, s } => {
                meter.left = meter.left.saturating_sub(s.len().max(1) as u64 - 1);
                let base = rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64);
                let n = ty.bytes();
                if s.len() > 1 && !base.is_multiple_of((n * s.len()) as u64) {
                    *pc_io = pc;
                    return Err(ExecError::Misaligned { addr: base, len: n * s.len(), line: inst.line });
                }
                for (i, sv) in s.iter().enumerate() {
                    let v = rd(regs, sv, c, clock).to_le_bytes();
                    m.store(*space, base.wrapping_add((i * n) as u64), &v[..n]).map_err(fail).inspect_err(|_| *pc_io = pc)?;
                }
            }
            Op::Cvta { to_generic, window, d, a } => {
                let v = rd(regs, a, c, clock);
                regs[*d as usize] = match (*window, to_generic) {
                    (0, _) => v,
                    (w, true) => v.wrapping_add(w),
                    (w, false) => v.wrapping_sub(w),
                };
            }
            Op::Cvt { dty, sty, round, sat, relu, d, a } => regs[*d as usize] = cvt(*dty, *sty, *round, *sat, *relu, rd(regs, a, c, clock)),
            Op::CvtPack { bits, signed, d, a, b, c: cc } => {
                let (lo, hi) = if *signed { (-(1i64 << (bits - 1)), (1i64 << (bits - 1)) - 1) } else { (0, (1i64 << bits) - 1) };
                let mask = (1u64 << bits) - 1;
                let sat = |v: u64| (v as u32 as i32 as i64).clamp(lo, hi) as u64 & mask;
                let (ta, tb) = (sat(rd(regs, a, c, clock)), sat(rd(regs, b, c, clock)));
                let high = cc.map(|s| rd(regs, &s, c, clock) << (2 * bits)).unwrap_or(0);
                regs[*d as usize] = (high | (ta << bits) | tb) & 0xffff_ffff;
            }
            Op::CvtToFp8x2 { e5m2, relu, from_f16x2, d, hi, lo } => {
                let (h, l) = if *from_f16x2 {
                    let v = rd(regs, hi, c, clock);
                    (half::f16::from_bits((v >> 16) as u16).to_f64(), half::f16::from_bits(v as u16).to_f64())
                } else {
                    (f32v(rd(regs, hi, c, clock)) as f64, f32v(rd(regs, lo, c, clock)) as f64)
                };
                let enc = |x: f64| crate::mma::to_fp8(if *relu && x < 0.0 { 0.0 } else { x }, *e5m2) as u64;
                regs[*d as usize] = (enc(h) << 8) | enc(l);
            }
            Op::CvtFromFp8x2 { e5m2, relu, d, a } => {
                let v = rd(regs, a, c, clock);
                let half = |b: u64| {
                    let x = crate::mma::from_fp8(b as u8, *e5m2);
                    let x = if *relu && x < 0.0 { 0.0 } else { x };
                    half::f16::from_f64(x).to_bits() as u64
                };
                regs[*d as usize] = (half((v >> 8) & 0xff) << 16) | half(v & 0xff);
            }
            Op::Cvt2 { dty, round, relu, d, hi, lo } => {
                let h = cvt(half_of(*dty), Ty::F32, *round, false, *relu, rd(regs, hi, c, clock));
                let l = cvt(half_of(*dty), Ty::F32, *round, false, *relu, rd(regs, lo, c, clock));
                regs[*d as usize] = (h << 16) | l;
            }
            Op::Bin { op, ty, d, a, b } => {
                let (x, y) = (rd(regs, a, c, clock), rd(regs, b, c, clock));
                regs[*d as usize] = match ty {
                    Ty::F32 | Ty::F64 => fbin(*op, *ty, x, y),
                    Ty::F16 | Ty::Bf16 | Ty::F16x2 | Ty::Bf16x2 => hbin(*op, *ty, x, y),
                    _ => ibin(*op, *ty, x, y),
                };
            }
            Op::BinR { op, ty, round, d, a, b } => {
                let (x, y) = (rd(regs, a, c, clock), rd(regs, b, c, clock));
                regs[*d as usize] = if ty.is_float() { fbin_round(*op, *ty, *round, x, y) } else { sat_int(*op, *ty, x, y) };
            }
            Op::Carry { sub, cin, cout, ty, d, a, b } => {
                let bits = ty.bits();
                let (x, y) = (ty.mask(rd(regs, a, c, clock)) as u128, ty.mask(rd(regs, b, c, clock)) as u128);
                let cf = if *cin { (regs[0] & 1) as u128 } else { 0 };
                let (r, carry) = if *sub {
                    (x.wrapping_sub(y).wrapping_sub(cf), x < y + cf)
                } else {
                    let s = x + y + cf;
                    (s, (s >> bits) != 0)
                };
                regs[*d as usize] = ty.mask(r as u64);
                if *cout {
                    regs[0] = carry as u64;
                }
            }
            Op::MinMax16x2 { max, signed, relu, d, a, b } => {
                let (x, y) = (rd(regs, a, c, clock) as u32, rd(regs, b, c, clock) as u32);
                let half = |v: u32, i: u32| -> i32 {
                    let h = (v >> (16 * i)) as u16;
                    if *signed {
                        h as i16 as i32
                    } else {
                        h as i32
                    }
                };
                let mut r = 0u32;
                for i in 0..2 {
                    let (p, q) = (half(x, i), half(y, i));
                    let mut v = if *max { p.max(q) } else { p.min(q) };
                    if *relu {
                        v = v.max(0);
                    }
                    r |= (v as u16 as u32) << (16 * i);
                }
                regs[*d as usize] = r as u64;
            }
            Op::Un { op, ty, d, a } => regs[*d as usize] = un(*op, *ty, rd(regs, a, c, clock)),
            Op::Mad { mode, ty, d, a, b, c: cc, carry } => {
                let (x, y, z) = (rd(regs, a, c, clock), rd(regs, b, c, clock), rd(regs, cc, c, clock));
                let prod = match mode {
                    MadMode::Lo => ibin(Bin::MulLo, *ty, x, y),
                    MadMode::Hi => ibin(Bin::MulHi, *ty, x, y),
                    MadMode::Lo24 => ibin(Bin::Mul24Lo, *ty, x, y),
                    MadMode::Hi24 => ibin(Bin::Mul24Hi, *ty, x, y),
                    MadMode::Wide => ibin(Bin::MulWide, *ty, x, y),
                };
                let rty = if *mode == MadMode::Wide {
                    if ty.bits() == 32 {
                        if ty.is_signed() {
                            Ty::S64
                        } else {
                            Ty::U64
                        }
                    } else {
                        Ty::U32
                    }
                } else {
                    *ty
                };
                let cf = if carry.0 { regs[0] & 1 } else { 0 };
                let s = rty.mask(prod) as u128 + rty.mask(z) as u128 + cf as u128;
                regs[*d as usize] = rty.mask(s as u64);
                if carry.1 {
                    regs[0] = ((s >> rty.bits()) != 0) as u64;
                }
            }
            Op::Fma { ty, round, d, a, b, c: cc, sat, relu } => {
                let (x, y, z) = (rd(regs, a, c, clock), rd(regs, b, c, clock), rd(regs, cc, c, clock));
                regs[*d as usize] = fma(*ty, *round, x, y, z, *sat, *relu);
            }
            Op::Tri { op, ty, d, a, b, c: cc } => {
                let (x, y, z) = (rd(regs, a, c, clock), rd(regs, b, c, clock), rd(regs, cc, c, clock));
                regs[*d as usize] = tri(*op, *ty, x, y, z);
            }
            Op::Bfi { ty, d, f, b, pos, len } => {
                let (fv, bv) = (rd(regs, f, c, clock), rd(regs, b, c, clock));
                let (p, l) = ((rd(regs, pos, c, clock) & 0xff) as u32, (rd(regs, len, c, clock) & 0xff) as u32);
                let bits = ty.bits();
                regs[*d as usize] = if l == 0 || p >= bits {
                    ty.mask(bv)
                } else {
                    let l = l.min(bits - p);
                    let mask = if l >= 64 { u64::MAX } else { ((1u64 << l) - 1) << p };
                    ty.mask((bv & !mask) | ((fv << p) & mask))
                };
            }
            Op::Testp { kind, ty, p, a } => {
                let x = fval(*ty, rd(regs, a, c, clock));
                let r = match kind {
                    TestpKind::Finite => x.is_finite(),
                    TestpKind::Infinite => x.is_infinite(),
                    TestpKind::Number => !x.is_nan(),
                    TestpKind::NotANumber => x.is_nan(),
                    TestpKind::Normal => {
                        if *ty == Ty::F32 {
                            (x as f32).is_normal()
                        } else {
                            x.is_normal()
                        }
                    }
                    TestpKind::Subnormal => {
                        if *ty == Ty::F32 {
                            (x as f32).is_subnormal()
                        } else {
                            x.is_subnormal()
                        }
                    }
                };
                regs[*p as usize] = r as u64;
            }
            Op::Setp { cmp, ty, p, q, a, b, comb } => {
                let mut r = compare(*cmp, *ty, rd(regs, a, c, clock), rd(regs, b, c, clock));
                let mut nr = !r;
                if let Some((bop, cs, neg)) = comb {
                    let cv = ((rd(regs, cs, c, clock) & 1) != 0) != *neg;
                    let f = |x: bool| match bop {
                        BoolOp::And => x && cv,
                        BoolOp::Or => x || cv,
                        BoolOp::Xor => x ^ cv,
                    };
                    r = f(r);
                    nr = f(nr);
                }
                regs[*p as usize] = r as u64;
                if let Some(q) = q {
                    regs[*q as usize] = nr as u64;
                }
            }
            Op::Set { cmp, dty, ty, d, a, b } => {
                let r = compare(*cmp, *ty, rd(regs, a, c, clock), rd(regs, b, c, clock));
                regs[*d as usize] = match (r, dty) {
                    (false, _) => 0,
                    (true, Ty::F32) => 1f32.to_bits() as u64,
                    (true, t) => t.mask(u64::MAX),
                };
            }
            Op::Selp { ty, d, a, b, p } => {
                let v = if rd(regs, p, c, clock) & 1 != 0 { rd(regs, a, c, clock) } else { rd(regs, b, c, clock) };
                regs[*d as usize] = ty.mask(v);
            }
            Op::Slct { ty, cty, d, a, b, c: cc } => {
                let cv = rd(regs, cc, c, clock);
                let pos = if *cty == Ty::F32 { f32v(cv) >= 0.0 } else { (cv as u32 as i32) >= 0 };
                regs[*d as usize] = ty.mask(if pos { rd(regs, a, c, clock) } else { rd(regs, b, c, clock) });
            }
            Op::Bra { target } => {
                pc = *target as usize;
                continue;
            }
            Op::Brx { index, targets } => {
                let i = rd(regs, index, c, clock) as usize;
                match targets.get(i) {
                    Some(t) => {
                        pc = *t as usize;
                        continue;
                    }
                    None => {
                        *pc_io = pc;
                        return Err(ExecError::Failed(format!("brx.idx index {i} outside its {}-entry table at PTX line {}", targets.len(), inst.line)));
                    }
                }
            }
            Op::Call { callee, .. } => {
                let callee = match callee {
                    Callee::Direct(f) => *f,
                    Callee::Indirect(s) => {
                        let a = rd(regs, s, c, clock);
                        match a.checked_sub(FUNC_WINDOW) {
                            Some(f) if f < u32::MAX as u64 => f as u32,
                            _ => {
                                *pc_io = pc;
                                return Err(ExecError::IllegalAddress { kind: "function", addr: a, len: 0, line: inst.line });
                            }
                        }
                    }
                };
                *pc_io = pc + 1;
                return Ok(Ev::Call { callee, at: pc });
            }
            Op::Ret => {
                *pc_io = pc;
                return Ok(Ev::Ret);
            }
            Op::Exit => park!(St::Exit),
            Op::Trap => {
                *pc_io = pc;
                return Err(ExecError::Trap(inst.line));
            }
            Op::Bar { kind: BarKind::ClusterArrive, .. } => {
                let bar = &mut bars[CLUSTER_BARRIER];
                bar.arrived += 1;
                cl.cluster_phase = bar.phase;
            }
            Op::Bar { kind: BarKind::ClusterWait, .. } => {
                if bars[CLUSTER_BARRIER].phase <= cl.cluster_phase {
                    park!(St::Bar(CLUSTER_BARRIER as u8));
                }
            }
            Op::Bar { kind, id, count, a, .. } => {
                let id = rd(regs, id, c, clock);
                if id >= 16 {
                    *pc_io = pc;
                    return Err(ExecError::Failed(format!("barrier {id} out of range (0-15) at PTX line {}", inst.line)));
                }
                let count = count.map(|s| rd(regs, &s, c, clock) as u32);
                let bar = &mut bars[id as usize];
                bar.arrived += 1;
                if count.is_some() {
                    bar.count = count;
                }
                if *kind == BarKind::Arrive {
                    pc += 1;
                    continue;
                }
                if let Some((p, neg)) = a {
                    cl.a = (((rd(regs, p, c, clock) & 1) != 0) != *neg) as u64;
                }
                park!(St::Bar(id as u8));
            }
            Op::Shfl { a, b, c: cc, mask, .. } => {
                cl.park(rd(regs, mask, c, clock) as u32, rd(regs, a, c, clock), rd(regs, b, c, clock), rd(regs, cc, c, clock));
                park!(St::Coll);
            }
            Op::Vote { a, mask, .. } | Op::Match { a, mask, .. } | Op::Redux { a, mask, .. } => {
                cl.park(rd(regs, mask, c, clock) as u32, rd(regs, a, c, clock), 0, 0);
                park!(St::Coll);
            }
            Op::Elect { mask, .. } | Op::WarpSync { mask } => {
                cl.park(rd(regs, mask, c, clock) as u32, 0, 0, 0);
                park!(St::Coll);
            }
            Op::ActiveMask { .. } => {
                cl.park(0, 0, 0, 0);
                park!(St::Coll);
            }
            Op::Mma(mma) => {
                // The tensor-core work is done once for the warp; each lane
                // pays for its share of it.
                meter.left = meter.left.saturating_sub(MAX_INST_UNITS - 1);
                cl.park(u32::MAX, 0, 0, 0);
                for (i, s) in mma.a.iter().chain(&mma.b).chain(&mma.c).enumerate() {
                    cl.v[i] = rd(regs, s, c, clock);
                }
                park!(St::Coll);
            }
            Op::Ldmatrix { addr, .. } => {
                cl.park(u32::MAX, rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64), 0, 0);
                park!(St::Coll);
            }
            Op::Stmatrix { addr, s, .. } => {
                cl.park(u32::MAX, rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64), 0, 0);
                for (i, s) in s.iter().enumerate() {
                    cl.v[i] = rd(regs, s, c, clock);
                }
                park!(St::Coll);
            }
            Op::Wmma(w) => {
                meter.left = meter.left.saturating_sub(MAX_INST_UNITS - 1);
                let lane = c.c.special(Special::LaneId, clock, c.li) as u32;
                let base = rd(regs, &w.addr.base, c, clock).wrapping_add(w.addr.offset as u64);
                let stride = w.stride.map(|s| rd(regs, &s, c, clock)).unwrap_or(if w.row_major { w.cols } else { w.rows } as u64);
                let bits = w.ty.bits();
                let bytes = (bits / 8) as usize;
                let per = crate::mma::per_reg(w.ty);
                let nregs = if w.store { w.s.len() } else { w.d.len() };
                for r in 0..nregs {
                    let mut reg = if w.store { rd(regs, &w.s[r], c, clock) } else { 0 };
                    for j in 0..per {
                        let (row, col) = crate::mma::wmma_at(lane, r as u32 * per + j, w.rows, w.cols);
                        // The stride is the tenant's: addresses wrap, and the access is checked.
                        let (major, minor) = if w.row_major { (row, col) } else { (col, row) };
                        let idx = (major as u64).wrapping_mul(stride).wrapping_add(minor as u64);
                        let at = base.wrapping_add(idx.wrapping_mul(bytes as u64));
                        let shift = if bits >= 32 { 0 } else { j * bits };
                        let mut buf = [0u8; 8];
                        if w.store {
                            let v = if bits >= 64 { reg } else { (reg >> shift) & ((1u64 << bits) - 1) };
                            buf[..bytes].copy_from_slice(&v.to_le_bytes()[..bytes]);
                            m.store(w.space, at, &buf[..bytes]).map_err(fail).inspect_err(|_| *pc_io = pc)?;
                        } else {
                            m.load(w.space, at, &mut buf[..bytes]).map_err(fail).inspect_err(|_| *pc_io = pc)?;
                            reg |= u64::from_le_bytes(buf) << shift;
                        }
                    }
                    if !w.store {
                        regs[w.d[r] as usize] = reg;
                    }
                }
            }
            Op::CvtTf32 { round, d, a } => regs[*d as usize] = tf32(rd(regs, a, c, clock) as u32, *round) as u64,
            Op::Nop => {}
            Op::Atom { space, op, ty, d, addr, b, c: cas } => {
                let a = rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64);
                let n = ty.bytes();
                let bv = rd(regs, b, c, clock);
                let cv = cas.map(|s| rd(regs, &s, c, clock)).unwrap_or(0);
                let f = |old: u64| atom_op(*op, *ty, old, bv, cv);
                let old = m.atomic(*space, a, n, f).map_err(fail).inspect_err(|_| *pc_io = pc)?;
                if let Some(d) = d {
                    regs[*d as usize] = old;
                }
            }
            Op::Fence => std::sync::atomic::fence(Ordering::SeqCst),
            Op::CpAsync { dst, src, size, src_size } => {
                let da = rd(regs, &dst.base, c, clock).wrapping_add(dst.offset as u64);
                let sa = rd(regs, &src.base, c, clock).wrapping_add(src.offset as u64);
                let n = *size as usize;
                let valid = src_size.map(|s| (rd(regs, &s, c, clock) as usize).min(n)).unwrap_or(n);
                let mut buf = [0u8; 16];
                if valid > 0 {
                    m.load(Space::Generic, sa, &mut buf[..valid]).map_err(fail).inspect_err(|_| *pc_io = pc)?;
                }
                m.store(Space::Shared, da, &buf[..n]).map_err(fail).inspect_err(|_| *pc_io = pc)?;
            }
            Op::Isspacep { space, p, a } => {
                let v = rd(regs, a, c, clock);
                let r = m.resolve(Space::Generic, v);
                regs[*p as usize] = (r == *space) as u64;
            }
            Op::Unpack { d, a, part_bits } => {
                meter.left = meter.left.saturating_sub(d.len().max(1) as u64 - 1);
                let v = rd(regs, a, c, clock);
                for (i, r) in d.iter().enumerate() {
                    let Some(r) = r else { continue };
                    let shifted = v.checked_shr(i as u32 * part_bits).unwrap_or(0);
                    regs[*r as usize] = if *part_bits >= 64 { shifted } else { shifted & ((1u64 << part_bits) - 1) };
                }
            }
            Op::Pack { d, s, part_bits } => {
                meter.left = meter.left.saturating_sub(s.len().max(1) as u64 - 1);
                let mut v = 0u64;
                for (i, sv) in s.iter().enumerate() {
                    let part = rd(regs, sv, c, clock);
                    let part = if *part_bits >= 64 { part } else { part & ((1u64 << part_bits) - 1) };
                    v |= part.checked_shl(i as u32 * part_bits).unwrap_or(0);
                }
                regs[*d as usize] = v;
            }
        }
        pc += 1;
    }
}

/// The new value of an `atom`/`red` location holding `old`.
/// An f32 rounded to tf32 (10 fraction bits), kept in f32 form.
fn tf32(bits: u32, round: Round) -> u32 {
    const LOW: u32 = 0x1fff;
    if (bits & 0x7f80_0000) == 0x7f80_0000 {
        // Infinities stay; a NaN stays a NaN (its payload cut, kept non-zero).
        return if bits & 0x007f_ffff == 0 { bits } else { (bits & !LOW) | 0x0040_0000 };
    }
    let up = match round {
        Round::Rna => 0x1000,
        Round::Rn => 0x0fff + ((bits >> 13) & 1),
        _ => 0,
    };
    // Adding to the magnitude rounds it; a carry into the exponent is right.
    (bits + up) & !LOW
}

fn atom_op(op: AtomOp, ty: Ty, old: u64, bv: u64, cv: u64) -> u64 {
    let new = match op {
        AtomOp::Add if matches!(ty, Ty::F32 | Ty::F64) => fbin(Bin::Add, ty, old, bv),
        AtomOp::Add if ty.is_float() => hbin(Bin::Add, ty, old, bv),
        AtomOp::Min | AtomOp::Max if matches!(ty, Ty::F32 | Ty::F64) => fbin(if op == AtomOp::Min { Bin::Min } else { Bin::Max }, ty, old, bv),
        AtomOp::Min | AtomOp::Max if ty.is_float() => hbin(if op == AtomOp::Min { Bin::Min } else { Bin::Max }, ty, old, bv),
        AtomOp::Add => old.wrapping_add(bv),
        AtomOp::Min => ibin(Bin::Min, ty, old, bv),
        AtomOp::Max => ibin(Bin::Max, ty, old, bv),
        AtomOp::Exch => bv,
        AtomOp::Cas => {
            if ty.mask(old) == ty.mask(bv) {
                cv
            } else {
                old
            }
        }
        AtomOp::And => old & bv,
        AtomOp::Or => old | bv,
        AtomOp::Xor => old ^ bv,
        AtomOp::Inc => {
            if ty.mask(old) >= ty.mask(bv) {
                0
            } else {
                old + 1
            }
        }
        AtomOp::Dec => {
            if ty.mask(old) == 0 || ty.mask(old) > ty.mask(bv) {
                bv
            } else {
                old - 1
            }
        }
    };
    ty.mask(new)
}

fn half_of(t: Ty) -> Ty {
    match t {
        Ty::F16x2 => Ty::F16,
        Ty::Bf16x2 => Ty::Bf16,
        t => t,
    }
}

fn sat01(v: f64) -> f64 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(0.0, 1.0)
    }
}

/// A float of type `ty` (scalar) as f64.
#[inline]
fn fval(ty: Ty, v: u64) -> f64 {
    match ty {
        Ty::F32 => f32v(v) as f64,
        Ty::F16 | Ty::F16x2 => half::f16::from_bits(v as u16).to_f64(),
        Ty::Bf16 | Ty::Bf16x2 => half::bf16::from_bits(v as u16).to_f64(),
        _ => f64v(v),
    }
}

/// An f64 rounded (to nearest even) to the scalar type `ty`, as bits.
#[inline]
fn fbits(ty: Ty, x: f64) -> u64 {
    match ty {
        Ty::F32 => (x as f32).to_bits() as u64,
        Ty::F16 | Ty::F16x2 => half::f16::from_f64(x).to_bits() as u64,
        Ty::Bf16 | Ty::Bf16x2 => half::bf16::from_f64(x).to_bits() as u64,
        _ => x.to_bits(),
    }
}

fn fop(op: Bin, a: f64, b: f64) -> f64 {
    match op {
        Bin::Add => a + b,
        Bin::Sub => a - b,
        Bin::MulLo | Bin::MulHi | Bin::MulWide => a * b,
        Bin::AddSat => sat01(a + b),
        Bin::SubSat => sat01(a - b),
        Bin::MulSat => sat01(a * b),
        Bin::Div => a / b,
        Bin::Min => a.min(b),
        Bin::Max => a.max(b),
        Bin::MinNan => {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.min(b)
            }
        }
        Bin::MaxNan => {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.max(b)
            }
        }
        Bin::MinRelu => a.min(b).max(0.0),
        Bin::MaxRelu => a.max(b).max(0.0),
        Bin::Copysign => b.copysign(a),
        Bin::Rem => a % b,
        _ => f64::NAN,
    }
}

/// f16/bf16 arithmetic, scalar or on both halves of a packed pair. Each
/// result is exact in f64 before its one rounding, so it is IEEE-correct.
fn hbin(op: Bin, ty: Ty, x: u64, y: u64) -> u64 {
    let one = |x: u64, y: u64| fbits(ty, fop(op, fval(ty, x & 0xffff), fval(ty, y & 0xffff))) & 0xffff;
    if matches!(ty, Ty::F16x2 | Ty::Bf16x2) {
        one(x, y) | (one(x >> 16, y >> 16) << 16)
    } else {
        one(x, y)
    }
}

fn fbin(op: Bin, ty: Ty, x: u64, y: u64) -> u64 {
    if ty == Ty::F32 {
        let (a, b) = (f32v(x), f32v(y));
        let r = match op {
            Bin::Add => a + b,
            Bin::Sub => a - b,
            Bin::MulLo | Bin::MulHi | Bin::MulWide => a * b,
            Bin::Div => a / b,
            Bin::Min => a.min(b),
            Bin::Max => a.max(b),
            _ => fop(op, a as f64, b as f64) as f32,
        };
        r.to_bits() as u64
    } else {
        fop(op, f64v(x), f64v(y)).to_bits()
    }
}

/// Float add/sub/mul/div with a directed rounding: the round-to-nearest
/// result is moved one step when its exact error says the mode wants it.
fn fbin_round(op: Bin, ty: Ty, round: Round, x: u64, y: u64) -> u64 {
    if ty == Ty::F32 {
        let (a, b) = (f32v(x), f32v(y));
        let (s, err) = match op {
            Bin::Add => two_sum32(a, b),
            Bin::Sub => two_sum32(a, -b),
            Bin::MulLo => {
                let p = a * b;
                // The f64 product of two f32 values is exact.
                (p, a as f64 * b as f64 - p as f64)
            }
            Bin::Sqrt => {
                let r = a.sqrt();
                (r, a as f64 - r as f64 * r as f64)
            }
            _ => {
                let q = a / b;
                let r = (-(q as f64)).mul_add(b as f64, a as f64);
                (q, r * (b as f64).signum())
            }
        };
        directed32(s, err, round).to_bits() as u64
    } else {
        let (a, b) = (f64v(x), f64v(y));
        let (s, err) = match op {
            Bin::Add => two_sum64(a, b),
            Bin::Sub => two_sum64(a, -b),
            Bin::MulLo => {
                let p = a * b;
                (p, fma_err(a, b, 0.0, p))
            }
            Bin::Sqrt => {
                let r = a.sqrt();
                (r, (-r).mul_add(r, a))
            }
            _ => {
                let q = a / b;
                const S: f64 = 4.149515568880993e180; // 2^600
                let err = if q.is_infinite() && a.is_finite() && b != 0.0 {
                    -q
                } else if (q.abs() < f64::MIN_POSITIVE || a.abs() < 1e-250) && (q * S).is_finite() && a.abs() < 1e100 {
                    // A subnormal quotient: the residual, scaled to stay exact.
                    (-(q * S)).mul_add(b, a * S) * b.signum()
                } else {
                    (-q).mul_add(b, a) * b.signum()
                };
                (q, err)
            }
        };
        directed64(s, err, round).to_bits()
    }
}

/// The sign-exact error of `r = fma(a, b, c)` (true value minus `r`), from
/// an exact product split and two error-free sums; a product too small for
/// that is scaled up first (scaling by a power of two is exact).
fn fma_err(a: f64, b: f64, c: f64, r: f64) -> f64 {
    if r.is_infinite() {
        // An overflow is above the largest finite value; infinite inputs
        // give an exact infinity.
        return if a.is_finite() && b.is_finite() && c.is_finite() { -r } else { 0.0 };
    }
    const S: f64 = 4.149515568880993e180; // 2^600
    let (a, c, r) = if a != 0.0 && b != 0.0 && (a * b).abs() < 1e-270 {
        if c.abs() >= 2f64.powi(400) {
            // The product is far below c's last bit: only its sign counts.
            return if (a < 0.0) != (b < 0.0) { -f64::MIN_POSITIVE } else { f64::MIN_POSITIVE };
        }
        (a * S, c * S, r * S)
    } else {
        (a, c, r)
    };
    let (u1, u2) = (a * b, a.mul_add(b, -(a * b)));
    let (a1, a2) = two_sum64(c, u2);
    let (b1, b2) = two_sum64(u1, a1);
    ((b1 - r) + b2) + a2
}

fn two_sum32(a: f32, b: f32) -> (f32, f64) {
    let s = a + b;
    let bb = s - a;
    (s, ((a - (s - bb)) + (b - bb)) as f64)
}

fn two_sum64(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

/// Moves a round-to-nearest result `bits` (a float `width` bits wide) one
/// step where the directed mode wants it, given the sign of the exact
/// error `err` (true value = result + err). Sign-magnitude stepping also
/// takes an overflowed infinity back to the largest finite value.
fn directed_bits(bits: u64, width: u32, err: f64, round: Round) -> u64 {
    if err == 0.0 || err.is_nan() {
        return bits;
    }
    let sign_bit = 1u64 << (width - 1);
    let neg = bits & sign_bit != 0;
    let mag = bits & (sign_bit - 1);
    let toward_zero = || if mag == 0 { bits } else { bits - 1 };
    let away = || bits + 1;
    match round {
        Round::Rz if (err < 0.0) != neg => toward_zero(),
        Round::Rm if err < 0.0 => {
            if neg {
                away()
            } else if mag == 0 {
                sign_bit | 1
            } else {
                toward_zero()
            }
        }
        Round::Rp if err > 0.0 => {
            if !neg {
                away()
            } else if mag == 0 {
                1
            } else {
                toward_zero()
            }
        }
        _ => bits,
    }
}

fn directed32(s: f32, err: f64, round: Round) -> f32 {
    if s.is_nan() {
        s
    } else {
        f32::from_bits(directed_bits(s.to_bits() as u64, 32, err, round) as u32)
    }
}

fn directed64(s: f64, err: f64, round: Round) -> f64 {
    if s.is_nan() {
        s
    } else {
        f64::from_bits(directed_bits(s.to_bits(), 64, err, round))
    }
}

/// Rounds an f64 to the scalar float type `ty` with `round`.
fn round_to(ty: Ty, x: f64, round: Round) -> u64 {
    let rn = fbits(ty, x);
    if !matches!(round, Round::Rz | Round::Rm | Round::Rp) || x.is_nan() {
        return rn;
    }
    let back = fval(ty, rn);
    let err = if back.is_infinite() && x.is_finite() { -back } else { x - back };
    directed_bits(rn, ty.bits(), err, round)
}

/// `add.sat.s32` / `sub.sat.s32`.
fn sat_int(op: Bin, ty: Ty, x: u64, y: u64) -> u64 {
    let (a, b) = (ty.sext(x) as i128, ty.sext(y) as i128);
    let r = if op == Bin::Sub { a - b } else { a + b };
    let bits = ty.bits();
    let (lo, hi) = (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1);
    ty.mask(r.clamp(lo, hi) as u64)
}

fn fma(ty: Ty, round: Round, x: u64, y: u64, z: u64, sat: bool, relu: bool) -> u64 {
    let post = |v: f64| {
        let v = if sat { sat01(v) } else { v };
        if relu && (v.is_nan() || v < 0.0) {
            0.0
        } else {
            v
        }
    };
    match ty {
        Ty::F32 => {
            let v = f32v(x).mul_add(f32v(y), f32v(z));
            let v = if matches!(round, Round::Rz | Round::Rm | Round::Rp) {
                // In f64 the product is exact and the sum splits exactly.
                let p = f32v(x) as f64 * f32v(y) as f64;
                let (s, e) = two_sum64(p, f32v(z) as f64);
                let err = if v.is_infinite() && s.is_finite() { -(v as f64) } else { (s - v as f64) + e };
                directed32(v, err, round)
            } else {
                v
            };
            (post(v as f64) as f32).to_bits() as u64
        }
        Ty::F64 => {
            let (a, b, c) = (f64v(x), f64v(y), f64v(z));
            let r = a.mul_add(b, c);
            let r = if matches!(round, Round::Rz | Round::Rm | Round::Rp) && a.is_finite() && b.is_finite() && c.is_finite() { directed64(r, fma_err(a, b, c, r), round) } else { r };
            post(r).to_bits()
        }
        Ty::F16x2 | Ty::Bf16x2 => {
            let h = ty_half(ty);
            let one = |x: u64, y: u64, z: u64| fbits(h, post(fval(h, x & 0xffff).mul_add(fval(h, y & 0xffff), fval(h, z & 0xffff)))) & 0xffff;
            one(x, y, z) | (one(x >> 16, y >> 16, z >> 16) << 16)
        }
        _ => fbits(ty, post(fval(ty, x).mul_add(fval(ty, y), fval(ty, z)))),
    }
}

fn ty_half(t: Ty) -> Ty {
    if t == Ty::Bf16x2 {
        Ty::Bf16
    } else {
        Ty::F16
    }
}

#[inline]
fn ibin(op: Bin, ty: Ty, x: u64, y: u64) -> u64 {
    let bits = ty.bits();
    let (ux, uy) = (ty.mask(x), ty.mask(y));
    let (sx, sy) = (ty.sext(x), ty.sext(y));
    let signed = ty.is_signed();
    match op {
        Bin::Add | Bin::AddSat => ty.mask(ux.wrapping_add(uy)),
        Bin::Sub | Bin::SubSat => ty.mask(ux.wrapping_sub(uy)),
        Bin::MulLo | Bin::MulSat => ty.mask(ux.wrapping_mul(uy)),
        Bin::MulHi => {
            if signed {
                ty.mask(((sx as i128 * sy as i128) >> bits) as u64)
            } else {
                ty.mask(((ux as u128 * uy as u128) >> bits) as u64)
            }
        }
        Bin::MulWide => {
            if signed {
                (sx as i128 * sy as i128) as u64
            } else {
                (ux as u128 * uy as u128) as u64
            }
        }
        Bin::Mul24Lo | Bin::Mul24Hi => {
            let (a, b) = if signed { ((((x as u32) << 8) as i32 >> 8) as i64, (((y as u32) << 8) as i32 >> 8) as i64) } else { ((x & 0xff_ffff) as i64, (y & 0xff_ffff) as i64) };
            let p = a * b;
            if op == Bin::Mul24Lo {
                p as u64 & 0xffff_ffff
            } else {
                (p >> 16) as u64 & 0xffff_ffff
            }
        }
        Bin::Div => {
            if uy == 0 {
                ty.mask(u64::MAX)
            } else if signed {
                ty.mask(sx.wrapping_div(sy) as u64)
            } else {
                ux / uy
            }
        }
        Bin::Rem => {
            if uy == 0 {
                ux
            } else if signed {
                ty.mask(sx.wrapping_rem(sy) as u64)
            } else {
                ux % uy
            }
        }
        Bin::Min | Bin::MinNan => {
            if signed {
                ty.mask(sx.min(sy) as u64)
            } else {
                ux.min(uy)
            }
        }
        Bin::Max | Bin::MaxNan => {
            if signed {
                ty.mask(sx.max(sy) as u64)
            } else {
                ux.max(uy)
            }
        }
        Bin::MinRelu => ty.mask(sx.min(sy).max(0) as u64),
        Bin::MaxRelu => ty.mask(sx.max(sy).max(0) as u64),
        Bin::And => ux & uy,
        Bin::Or => ux | uy,
        Bin::Xor => ux ^ uy,
        // Shift amounts are unsigned and clamp at the operand width,
        // however wide the register holding them.
        Bin::Shl => {
            if y >= bits as u64 {
                0
            } else {
                ty.mask(ux << y)
            }
        }
        Bin::Shr => {
            let s = y.min(bits as u64) as u32;
            if signed {
                ty.mask((sx >> s.min(63)) as u64)
            } else if s >= bits {
                0
            } else {
                ux >> s
            }
        }
        Bin::Copysign | Bin::Sqrt => ux,
    }
}

fn un(op: Un, ty: Ty, v: u64) -> u64 {
    if ty.is_float() {
        if matches!(ty, Ty::F16x2 | Ty::Bf16x2) {
            let h = ty_half(ty);
            return un(op, h, v & 0xffff) | (un(op, h, (v >> 16) & 0xffff) << 16);
        }
        match (op, ty) {
            // Sign operations act on the bits, NaN payloads included.
            (Un::Neg, _) => return ty.mask(v ^ (1u64 << (ty.bits() - 1))),
            (Un::Abs, _) => return ty.mask(v & !(1u64 << (ty.bits() - 1))),
            _ => {}
        }
        let x = fval(ty, v);
        let r = match op {
            Un::Sqrt => x.sqrt(),
            Un::Rsqrt => 1.0 / x.sqrt(),
            Un::Rcp => 1.0 / x,
            Un::Ex2 => x.exp2(),
            Un::Lg2 => x.log2(),
            Un::Sin => x.sin(),
            Un::Cos => x.cos(),
            Un::Tanh => x.tanh(),
            _ => return v,
        };
        if ty == Ty::F32 {
            // Single-precision results come from the f32 operation itself.
            let xf = f32v(v);
            let rf = match op {
                Un::Sqrt => xf.sqrt(),
                Un::Rcp => 1.0 / xf,
                _ => r as f32,
            };
            return rf.to_bits() as u64;
        }
        return fbits(ty, r);
    }
    let bits = ty.bits();
    match op {
        Un::Neg => ty.mask((ty.sext(v)).wrapping_neg() as u64),
        Un::Abs => ty.mask(ty.sext(v).wrapping_abs() as u64),
        Un::Not => ty.mask(!v),
        Un::Cnot => (ty.mask(v) == 0) as u64,
        Un::Popc => ty.mask(v).count_ones() as u64,
        Un::Clz => (ty.mask(v).leading_zeros() - (64 - bits)) as u64,
        Un::Brev => ty.mask(v).reverse_bits() >> (64 - bits),
        Un::Bfind | Un::BfindShift => {
            // For a negative signed value, the highest bit that is 0.
            let x = if ty.is_signed() && ty.sext(v) < 0 { ty.mask(!v) } else { ty.mask(v) };
            if x == 0 {
                0xffff_ffff
            } else {
                let pos = 63 - x.leading_zeros() as u64;
                if op == Un::BfindShift {
                    bits as u64 - 1 - pos
                } else {
                    pos
                }
            }
        }
        _ => v,
    }
}

fn tri(op: Tri, ty: Ty, a: u64, b: u64, c: u64) -> u64 {
    let bits = ty.bits();
    match op {
        Tri::Bfe => {
            let (pos, len) = ((b & 0xff) as u32, (c & 0xff) as u32);
            let x = ty.mask(a);
            if ty.is_signed() {
                let sbit = if len == 0 {
                    false
                } else if pos + len > bits {
                    ty.sext(a) < 0
                } else {
                    (x >> (pos + len - 1)) & 1 != 0
                };
                let mut r = 0u64;
                for i in 0..bits {
                    let bit = if i < len && pos + i < bits { (x >> (pos + i)) & 1 != 0 } else { sbit };
                    if bit {
                        r |= 1 << i;
                    }
                }
                if len == 0 {
                    0
                } else {
                    ty.mask(r)
                }
            } else if pos >= bits || len == 0 {
                0
            } else {
                let l = len.min(bits - pos);
                let v = x >> pos;
                if l >= 64 {
                    v
                } else {
                    v & ((1u64 << l) - 1)
                }
            }
        }
        Tri::Prmt(mode) => {
            let bytes = ((b & 0xffff_ffff) << 32) | (a & 0xffff_ffff);
            let byte = |i: u64| (bytes >> ((i & 7) * 8)) & 0xff;
            let sel = |s: [u64; 4]| s.iter().enumerate().fold(0u64, |r, (i, &k)| r | (byte(k) << (8 * i)));
            let s = c & 3;
            match mode {
                0 => (0..4).fold(0u64, |r, i| {
                    let nib = (c >> (4 * i)) & 0xf;
                    let v = byte(nib & 7);
                    let v = if nib & 8 != 0 {
                        if v & 0x80 != 0 {
                            0xff
                        } else {
                            0
                        }
                    } else {
                        v
                    };
                    r | (v << (8 * i))
                }),
                1 => sel([s, s + 1, s + 2, s + 3]),
                2 => sel([s, s.wrapping_sub(1) & 7, s.wrapping_sub(2) & 7, s.wrapping_sub(3) & 7]),
                3 => sel([s, s, s, s]),
                4 => ecl(&sel, s),
                5 => ecr(&sel, s),
                _ => {
                    if s & 1 == 0 {
                        sel([0, 1, 0, 1])
                    } else {
                        sel([2, 3, 2, 3])
                    }
                }
            }
        }
        Tri::Lop3(lut) => {
            let mut r = 0u64;
            for i in 0..8 {
                if lut >> i & 1 != 0 {
                    let fa = if i & 4 != 0 { a } else { !a };
                    let fb = if i & 2 != 0 { b } else { !b };
                    let fc = if i & 1 != 0 { c } else { !c };
                    r |= fa & fb & fc;
                }
            }
            r & 0xffff_ffff
        }
        Tri::Shf { left, wrap } => {
            let n = if wrap { (c & 31) as u32 } else { c.min(32) as u32 };
            let v = ((b & 0xffff_ffff) << 32) | (a & 0xffff_ffff);
            if left {
                ((v << n) >> 32) & 0xffff_ffff
            } else {
                (v >> n) & 0xffff_ffff
            }
        }
        Tri::Sad => {
            let d = if ty.is_signed() { ty.sext(a).abs_diff(ty.sext(b)) } else { ty.mask(a).abs_diff(ty.mask(b)) };
            ty.mask(d.wrapping_add(c))
        }
        Tri::Dp4a(sa, sb) => {
            let byte = |v: u64, i: u32, s: bool| -> i64 {
                let x = (v >> (8 * i)) & 0xff;
                if s {
                    x as u8 as i8 as i64
                } else {
                    x as i64
                }
            };
            let sum: i64 = (0..4).map(|i| byte(a, i, sa) * byte(b, i, sb)).sum();
            (c as u32 as i64).wrapping_add(sum) as u64 & 0xffff_ffff
        }
        Tri::Dp2a { hi, sa, sb } => {
            let half = |i: u32| -> i64 {
                let x = (a >> (16 * i)) & 0xffff;
                if sa {
                    x as u16 as i16 as i64
                } else {
                    x as i64
                }
            };
            let byte = |i: u32| -> i64 {
                let x = (b >> (8 * i)) & 0xff;
                if sb {
                    x as u8 as i8 as i64
                } else {
                    x as i64
                }
            };
            let k = if hi { 2 } else { 0 };
            let sum = half(0) * byte(k) + half(1) * byte(k + 1);
            (c as u32 as i64).wrapping_add(sum) as u64 & 0xffff_ffff
        }
    }
}

/// `prmt.ecl`: edge clamp left (bytes above the selector repeat it).
fn ecl(sel: &dyn Fn([u64; 4]) -> u64, s: u64) -> u64 {
    sel(match s {
        0 => [0, 1, 2, 3],
        1 => [1, 1, 2, 3],
        2 => [2, 2, 2, 3],
        _ => [3, 3, 3, 3],
    })
}

/// `prmt.ecr`: edge clamp right.
fn ecr(sel: &dyn Fn([u64; 4]) -> u64, s: u64) -> u64 {
    sel(match s {
        0 => [0, 0, 0, 0],
        1 => [0, 1, 1, 1],
        2 => [0, 1, 2, 2],
        _ => [0, 1, 2, 3],
    })
}

fn compare(cmp: Cmp, ty: Ty, x: u64, y: u64) -> bool {
    if ty.is_float() {
        let (a, b) = (fval(ty, x), fval(ty, y));
        let unord = a.is_nan() || b.is_nan();
        return match cmp {
            Cmp::Eq => a == b,
            Cmp::Ne => !unord && a != b,
            Cmp::Lt | Cmp::Lo => a < b,
            Cmp::Le | Cmp::Ls => a <= b,
            Cmp::Gt | Cmp::Hi => a > b,
            Cmp::Ge | Cmp::Hs => a >= b,
            Cmp::Equ => unord || a == b,
            Cmp::Neu => unord || a != b,
            Cmp::Ltu => unord || a < b,
            Cmp::Leu => unord || a <= b,
            Cmp::Gtu => unord || a > b,
            Cmp::Geu => unord || a >= b,
            Cmp::Num => !unord,
            Cmp::Nan => unord,
        };
    }
    let (ux, uy) = (ty.mask(x), ty.mask(y));
    let (sx, sy) = (ty.sext(x), ty.sext(y));
    let s = ty.is_signed();
    match cmp {
        Cmp::Eq | Cmp::Equ => ux == uy,
        Cmp::Ne | Cmp::Neu => ux != uy,
        Cmp::Lt | Cmp::Ltu => {
            if s {
                sx < sy
            } else {
                ux < uy
            }
        }
        Cmp::Le | Cmp::Leu => {
            if s {
                sx <= sy
            } else {
                ux <= uy
            }
        }
        Cmp::Gt | Cmp::Gtu => {
            if s {
                sx > sy
            } else {
                ux > uy
            }
        }
        Cmp::Ge | Cmp::Geu => {
            if s {
                sx >= sy
            } else {
                ux >= uy
            }
        }
        Cmp::Lo => ux < uy,
        Cmp::Ls => ux <= uy,
        Cmp::Hi => ux > uy,
        Cmp::Hs => ux >= uy,
        Cmp::Num => true,
        Cmp::Nan => false,
    }
}

fn round_int(x: f64, r: Round) -> f64 {
    match r {
        Round::Rni | Round::Rn => x.round_ties_even(),
        Round::Rna => x.round(),
        Round::Rmi | Round::Rm => x.floor(),
        Round::Rpi | Round::Rp => x.ceil(),
        _ => x.trunc(),
    }
}

fn cvt(dty: Ty, sty: Ty, round: Round, sat: bool, relu: bool, v: u64) -> u64 {
    let dty = half_of(dty);
    if sty.is_float() {
        let x = fval(half_of(sty), v);
        if dty.is_float() {
            let x = if matches!(round, Round::Rni | Round::Rzi | Round::Rmi | Round::Rpi) { round_int(x, round) } else { x };
            let x = if sat { sat01(x) } else { x };
            let x = if relu && x < 0.0 { 0.0 } else { x };
            return round_to(dty, x, round);
        }
        if x.is_nan() {
            return 0;
        }
        let x = round_int(x, round);
        // Float to integer saturates to the destination range.
        let bits = dty.bits();
        let v: i128 = if dty.is_signed() {
            let lo = -(1i128 << (bits - 1));
            let hi = (1i128 << (bits - 1)) - 1;
            (x as i128).clamp(lo, hi)
        } else {
            let hi = if bits == 64 { u64::MAX as i128 } else { (1i128 << bits) - 1 };
            (x.max(0.0) as i128).min(hi)
        };
        return dty.mask(v as u64);
    }
    let val: i128 = if sty.is_signed() { sty.sext(v) as i128 } else { sty.mask(v) as i128 };
    if dty.is_float() {
        let f = val as f64;
        if matches!(round, Round::Rz | Round::Rm | Round::Rp) {
            if dty == Ty::F32 {
                let s = val as f32;
                let err = (val - s as i128) as f64;
                return directed32(s, err, round).to_bits() as u64;
            }
            if dty == Ty::F64 {
                let err = (val - f as i128) as f64;
                return directed64(f, err, round).to_bits();
            }
            return round_to(dty, f, round);
        }
        return fbits(dty, f);
    }
    let val = if sat {
        let bits = dty.bits();
        if dty.is_signed() {
            val.clamp(-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
        } else {
            val.clamp(0, if bits == 64 { u64::MAX as i128 } else { (1i128 << bits) - 1 })
        }
    } else {
        val
    };
    dty.mask(val as u64)
}
