//! Executes decoded kernels.
//!
//! A block runs thread by thread: each thread executes until it reaches a
//! block barrier, a warp-collective (`shfl.sync`, `vote.sync`) or exit. A
//! collective completes once every live lane of its warp waits on it, and
//! the barrier opens once every live thread of the block waits there. That
//! gives CUDA's semantics for converged collectives and barriers without
//! lockstep execution. Every access is bounds-checked: global memory
//! through [`GlobalMem`], shared and parameter memory against their sizes.

use std::time::{Duration, Instant};

use super::ir::*;

/// Generic addresses in `[SHARED_WINDOW, SHARED_WINDOW + shared size)` name
/// the block's shared memory; everything else is global.
pub const SHARED_WINDOW: u64 = 0x0000_1000_0000_0000;
pub const WARP: usize = 32;

/// Global memory as one tenant sees it. Implementations check every access
/// against that tenant's own allocations.
pub trait GlobalMem {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError>;
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError>;
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

#[derive(Debug, Clone, Copy)]
pub struct Limits {
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
}

/// Largest per-block register file (threads × registers × 8 bytes) the
/// interpreter allocates; larger launches fail with out-of-resources, as a
/// GPU refuses a block whose registers do not fit an SM.
pub const MAX_REGISTER_FILE: u64 = 64 << 20;
/// Bytes of register file or shared memory zeroed per cost unit.
const ZERO_BYTES_PER_UNIT: u64 = 64;
/// Fixed cost of starting a block, in units.
const BLOCK_UNITS: u64 = 16;
/// How often (in units spent) a running launch looks at the clock.
const CLOCK_EVERY: u64 = 1 << 12;

/// What a launch may still spend.
struct Meter {
    left: u64,
    budget: u64,
    deadline: Option<(Instant, Duration)>,
    next_clock: u64,
}

impl Meter {
    /// Charges `units`; fails once the budget or the time limit is spent.
    #[inline]
    fn charge(&mut self, units: u64) -> Result<(), ExecError> {
        if self.left < units {
            self.left = 0;
            return Err(ExecError::Budget(self.budget));
        }
        self.left -= units;
        if self.left <= self.next_clock {
            self.next_clock = self.left.saturating_sub(CLOCK_EVERY);
            if let Some((at, limit)) = self.deadline {
                if Instant::now() >= at {
                    return Err(ExecError::Timeout(limit));
                }
            }
        }
        Ok(())
    }

    fn spent(&self) -> u64 {
        self.budget - self.left
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_threads_per_block: 1024, max_block: [1024, 1024, 64], max_grid: [i32::MAX as u32, 65535, 65535], max_shared: 48 * 1024, budget: 0, timeout: None }
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
    Bar,
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

impl Coords {
    #[inline]
    fn special(&self, s: Special, clock: u64) -> u64 {
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
            Special::Clock64 => clock,
            Special::LaneMaskEq => 1u64 << lane,
            Special::LaneMaskLt => (1u64 << lane) - 1,
            Special::LaneMaskLe => (1u64 << (lane + 1)) - 1,
            Special::LaneMaskGt => 0xffff_ffff & !((1u64 << (lane + 1)) - 1),
            Special::LaneMaskGe => 0xffff_ffff & !((1u64 << lane) - 1),
        }
    }
}

/// Runs `k` over the grid. `params` is the packed parameter buffer.
///
/// Every cost of a launch is metered against `limits.budget`: each
/// instruction (one unit per register written or element moved), each
/// block's set-up (a fixed cost plus one unit per [`ZERO_BYTES_PER_UNIT`]
/// bytes of register file and shared memory zeroed) and each scheduling
/// round over a block's threads. `limits.timeout` bounds wall-clock time
/// whatever the budget.
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
    let shared = k.shared_bytes as u64 + cfg.dynamic_shared as u64;
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
    let budget = if limits.budget == 0 { u64::MAX } else { limits.budget };
    let mut meter = Meter { left: budget, budget, deadline: limits.timeout.map(|t| (Instant::now() + t, t)), next_clock: budget.saturating_sub(CLOCK_EVERY) };
    let block_units = BLOCK_UNITS + nthreads + (regfile + shared) / ZERO_BYTES_PER_UNIT;
    // The first block's allocation is charged before it is made.
    meter.charge(block_units)?;
    let mut b = BlockState {
        n: nthreads as usize,
        nregs: k.num_regs as usize,
        regs: vec![0; nthreads as usize * k.num_regs as usize],
        pc: vec![0; nthreads as usize],
        st: vec![St::Run; nthreads as usize],
        shared: vec![0; shared as usize],
    };
    let mut stats = Stats::default();
    for cz in 0..cfg.grid[2] {
        for cy in 0..cfg.grid[1] {
            for cx in 0..cfg.grid[0] {
                if stats.blocks > 0 {
                    meter.charge(block_units)?;
                    b.reset();
                }
                run_block(k, &mut b, cfg, [cx, cy, cz], params, mem, &mut meter)?;
                stats.blocks += 1;
            }
        }
    }
    stats.instructions = meter.spent();
    Ok(stats)
}

struct BlockState {
    n: usize,
    nregs: usize,
    regs: Vec<u64>,
    pc: Vec<u32>,
    st: Vec<St>,
    shared: Vec<u8>,
}

impl BlockState {
    fn reset(&mut self) {
        self.regs.fill(0);
        self.pc.fill(0);
        self.st.fill(St::Run);
        self.shared.fill(0);
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
fn run_block(k: &Kernel, b: &mut BlockState, cfg: &LaunchConfig, ctaid: [u32; 3], params: &[u8], mem: &mut dyn GlobalMem, meter: &mut Meter) -> Result<(), ExecError> {
    let n = b.n;
    let r = b.nregs;
    // One scheduling round scans every thread and warp of the block.
    let round_units = (n as u64).div_ceil(WARP as u64);
    loop {
        meter.charge(round_units)?;
        for t in 0..n {
            if b.st[t] == St::Run {
                let c = coords(t, cfg, ctaid, n);
                let regs = &mut b.regs[t * r..(t + 1) * r];
                b.st[t] = run_thread(k, regs, &mut b.pc[t], &c, &mut b.shared, params, mem, meter)?;
            }
        }
        let mut released = false;
        for w in 0..n.div_ceil(WARP) {
            released |= resolve_collective(k, b, w, cfg, ctaid)?;
        }
        if released {
            continue;
        }
        let live = b.st.iter().filter(|s| **s != St::Exit).count();
        if live == 0 {
            return Ok(());
        }
        if b.st.iter().all(|s| matches!(s, St::Bar | St::Exit)) {
            for s in b.st.iter_mut() {
                if *s == St::Bar {
                    *s = St::Run;
                }
            }
            continue;
        }
        let t = b.st.iter().position(|s| *s == St::Coll).unwrap_or(0);
        let line = k.insts.get(b.pc[t] as usize).map(|i| i.line).unwrap_or(0);
        return Err(ExecError::Deadlock(format!("warp collective at PTX line {line} waits on lanes held at a barrier or another collective")));
    }
}

/// Completes a warp's `shfl.sync`/`vote.sync` once all its live lanes wait on
/// the same instruction. Returns whether lanes were released.
fn resolve_collective(k: &Kernel, b: &mut BlockState, w: usize, cfg: &LaunchConfig, ctaid: [u32; 3]) -> Result<bool, ExecError> {
    let lo = w * WARP;
    let hi = (lo + WARP).min(b.n);
    let r = b.nregs;
    let mut pc = None;
    for t in lo..hi {
        match b.st[t] {
            St::Exit => {}
            St::Coll => match pc {
                None => pc = Some(b.pc[t]),
                Some(p) if p == b.pc[t] => {}
                Some(_) => return Ok(false),
            },
            _ => return Ok(false),
        }
    }
    let Some(pc) = pc else { return Ok(false) };
    let inst = &k.insts[pc as usize];
    let mut wait_mask = [false; WARP];
    for t in lo..hi {
        wait_mask[t - lo] = b.st[t] == St::Coll;
    }
    let waiting = |t: usize| t >= lo && t < hi && wait_mask[t - lo];
    let rd = |b: &BlockState, t: usize, s: &Src| -> u64 {
        match s {
            Src::Reg(x) => b.regs[t * r + *x as usize],
            Src::Imm(v) => *v,
            Src::Special(sp) => coords(t, cfg, ctaid, b.n).special(*sp, 0),
        }
    };
    match &inst.op {
        Op::Shfl { mode, d, p, a, b: bsrc, c } => {
            let vals: Vec<u64> = (lo..hi).map(|t| rd(b, t, a)).collect();
            let mut out = Vec::with_capacity(hi - lo);
            for t in lo..hi {
                if !waiting(t) {
                    out.push((0, false));
                    continue;
                }
                let lane = (t - lo) as i64;
                let bv = (rd(b, t, bsrc) & 0x1f) as i64;
                let cv = rd(b, t, c);
                let clamp = (cv & 0x1f) as i64;
                let seg = ((cv >> 8) & 0x1f) as i64;
                let max_lane = (lane & seg) | (clamp & !seg);
                let min_lane = lane & seg;
                let (j, ok) = match mode {
                    ShflMode::Up => (lane - bv, lane - bv >= max_lane),
                    ShflMode::Down => (lane + bv, lane + bv <= max_lane),
                    ShflMode::Bfly => (lane ^ bv, (lane ^ bv) <= max_lane),
                    ShflMode::Idx => {
                        let j = min_lane | (bv & !seg);
                        (j, j <= max_lane)
                    }
                };
                let src = if ok && j >= 0 && ((lo + j as usize) < hi) && waiting(lo + j as usize) { j as usize } else { lane as usize };
                out.push((vals[src] & 0xffff_ffff, ok));
            }
            for t in lo..hi {
                if waiting(t) {
                    let (v, ok) = out[t - lo];
                    b.regs[t * r + *d as usize] = v;
                    if let Some(p) = p {
                        b.regs[t * r + *p as usize] = ok as u64;
                    }
                }
            }
        }
        Op::Vote { mode, d, a, negate } => {
            let mut ballot = 0u64;
            let mut count = 0;
            for t in lo..hi {
                if waiting(t) {
                    count += 1;
                    if ((rd(b, t, a) & 1) != 0) != *negate {
                        ballot |= 1 << (t - lo);
                    }
                }
            }
            let set = ballot.count_ones();
            let v = match mode {
                VoteMode::Ballot => ballot,
                VoteMode::All => (set == count) as u64,
                VoteMode::Any => (set > 0) as u64,
                VoteMode::Uni => (set == 0 || set == count) as u64,
            };
            for t in lo..hi {
                if waiting(t) {
                    b.regs[t * r + *d as usize] = v;
                }
            }
        }
        _ => return Err(ExecError::Deadlock(format!("internal: collective state at non-collective PTX line {}", inst.line))),
    }
    for t in lo..hi {
        if waiting(t) {
            b.pc[t] = pc + 1;
            b.st[t] = St::Run;
        }
    }
    Ok(true)
}

#[inline(always)]
fn rd(regs: &[u64], s: &Src, c: &Coords, clock: u64) -> u64 {
    match s {
        Src::Reg(r) => regs[*r as usize],
        Src::Imm(v) => *v,
        Src::Special(sp) => c.special(*sp, clock),
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
#[inline(always)]
fn fbits(ty: Ty, x: f64) -> u64 {
    if ty == Ty::F32 { (x as f32).to_bits() as u64 } else { x.to_bits() }
}
#[inline(always)]
fn fval(ty: Ty, v: u64) -> f64 {
    if ty == Ty::F32 { f32v(v) as f64 } else { f64v(v) }
}

struct Mem<'a> {
    shared: &'a mut [u8],
    params: &'a [u8],
    global: &'a mut dyn GlobalMem,
}

impl Mem<'_> {
    fn resolve(&self, space: Space, addr: u64) -> Space {
        match space {
            Space::Generic if addr >= SHARED_WINDOW && addr - SHARED_WINDOW < self.shared.len() as u64 => Space::Shared,
            Space::Generic => Space::Global,
            s => s,
        }
    }

    fn local_range(&self, space: Space, addr: u64, len: usize) -> Result<std::ops::Range<usize>, ExecError> {
        let (base, size, kind) = match space {
            Space::Shared => (if addr >= SHARED_WINDOW { SHARED_WINDOW } else { 0 }, self.shared.len(), "shared"),
            _ => (0, self.params.len(), "param"),
        };
        let off = addr.wrapping_sub(base);
        match off.checked_add(len as u64) {
            Some(end) if end <= size as u64 => Ok(off as usize..end as usize),
            _ => Err(ExecError::IllegalAddress { kind, addr, len, line: 0 }),
        }
    }

    fn check_align(addr: u64, len: usize) -> Result<(), ExecError> {
        if addr % len as u64 != 0 {
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
                let r = self.local_range(space, addr, out.len())?;
                out.copy_from_slice(&self.shared[r]);
                Ok(())
            }
            Space::Param => {
                let r = self.local_range(space, addr, out.len())?;
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
                let r = self.local_range(space, addr, data.len())?;
                self.shared[r].copy_from_slice(data);
                Ok(())
            }
            Space::Param => Err(ExecError::IllegalAddress { kind: "param (store)", addr, len: data.len(), line: 0 }),
        }
    }

    fn load_val(&mut self, space: Space, addr: u64, n: usize) -> Result<u64, ExecError> {
        let mut buf = [0u8; 8];
        self.load(space, addr, &mut buf[..n])?;
        Ok(u64::from_le_bytes(buf))
    }
}

#[allow(clippy::too_many_arguments)]
fn run_thread(
    k: &Kernel,
    regs: &mut [u64],
    pc_out: &mut u32,
    c: &Coords,
    shared: &mut [u8],
    params: &[u8],
    global: &mut dyn GlobalMem,
    meter: &mut Meter,
) -> Result<St, ExecError> {
    let mut m = Mem { shared, params, global };
    let insts = &k.insts[..];
    let mut pc = *pc_out as usize;
    loop {
        let inst = &insts[pc];
        meter.charge(match &inst.op {
            Op::Ld { d, .. } | Op::Unpack { d, .. } => d.len().max(1) as u64,
            Op::St { s, .. } | Op::Pack { s, .. } => s.len().max(1) as u64,
            _ => 1,
        })?;
        pc += 1;
        if let Some((p, neg)) = inst.guard {
            if ((regs[p as usize] & 1) != 0) == neg {
                continue;
            }
        }
        let clock = meter.spent();
        match &inst.op {
            Op::Mov { ty, d, a } => regs[*d as usize] = ty.mask(rd(regs, a, c, clock)),
            Op::Ld { space, ty, d, addr, dst_bits } => {
                let base = rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64);
                let n = ty.bytes();
                if d.len() > 1 {
                    // Vector loads need the whole vector aligned.
                    let total = n * d.len();
                    if *space != Space::Param && base % total as u64 != 0 {
                        return Err(ExecError::Misaligned { addr: base, len: total, line: inst.line });
                    }
                }
                for (i, dr) in d.iter().enumerate() {
                    let v = m.load_val(*space, base.wrapping_add((i * n) as u64), n).map_err(|e| e.at(inst.line))?;
                    let v = if ty.is_signed() && (n as u32) * 8 < *dst_bits {
                        let s = ty.sext(v) as u64;
                        if *dst_bits >= 64 { s } else { s & ((1u64 << dst_bits) - 1) }
                    } else {
                        v
                    };
                    regs[*dr as usize] = v;
                }
            }
            Op::St { space, ty, addr, s } => {
                let base = rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64);
                let n = ty.bytes();
                if s.len() > 1 && base % (n * s.len()) as u64 != 0 {
                    return Err(ExecError::Misaligned { addr: base, len: n * s.len(), line: inst.line });
                }
                for (i, sv) in s.iter().enumerate() {
                    let v = rd(regs, sv, c, clock).to_le_bytes();
                    m.store(*space, base.wrapping_add((i * n) as u64), &v[..n]).map_err(|e| e.at(inst.line))?;
                }
            }
            Op::Cvta { to_generic, shared, d, a } => {
                let v = rd(regs, a, c, clock);
                regs[*d as usize] = match (shared, to_generic) {
                    (false, _) => v,
                    (true, true) => v.wrapping_add(SHARED_WINDOW),
                    (true, false) => v.wrapping_sub(SHARED_WINDOW) & 0xffff_ffff,
                };
            }
            Op::Cvt { dty, sty, round, sat, d, a } => regs[*d as usize] = cvt(*dty, *sty, *round, *sat, rd(regs, a, c, clock)),
            Op::Bin { op, ty, d, a, b } => {
                let (x, y) = (rd(regs, a, c, clock), rd(regs, b, c, clock));
                regs[*d as usize] = if ty.is_float() { fbin(*op, *ty, x, y) } else { ibin(*op, *ty, x, y) };
            }
            Op::Un { op, ty, d, a } => regs[*d as usize] = un(*op, *ty, rd(regs, a, c, clock)),
            Op::Mad { mode, ty, d, a, b, c: cc } => {
                let (x, y, z) = (rd(regs, a, c, clock), rd(regs, b, c, clock), rd(regs, cc, c, clock));
                regs[*d as usize] = match mode {
                    MadMode::Lo => ty.mask(ibin(Bin::MulLo, *ty, x, y).wrapping_add(z)),
                    MadMode::Hi => ty.mask(ibin(Bin::MulHi, *ty, x, y).wrapping_add(z)),
                    MadMode::Wide => {
                        let w = if ty.bits() == 32 { if ty.is_signed() { Ty::S64 } else { Ty::U64 } } else { Ty::U32 };
                        w.mask(ibin(Bin::MulWide, *ty, x, y).wrapping_add(z))
                    }
                };
            }
            Op::Fma { ty, d, a, b, c: cc, sat } => {
                let (x, y, z) = (rd(regs, a, c, clock), rd(regs, b, c, clock), rd(regs, cc, c, clock));
                let r = if *ty == Ty::F32 {
                    let v = f32v(x).mul_add(f32v(y), f32v(z));
                    let v = if *sat { sat01(v as f64) as f32 } else { v };
                    v.to_bits() as u64
                } else {
                    let v = f64v(x).mul_add(f64v(y), f64v(z));
                    (if *sat { sat01(v) } else { v }).to_bits()
                };
                regs[*d as usize] = r;
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
            Op::Selp { ty, d, a, b, p } => {
                let v = if rd(regs, p, c, clock) & 1 != 0 { rd(regs, a, c, clock) } else { rd(regs, b, c, clock) };
                regs[*d as usize] = ty.mask(v);
            }
            Op::Bra { target } => pc = *target as usize,
            Op::Bar => {
                *pc_out = pc as u32;
                return Ok(St::Bar);
            }
            Op::Shfl { .. } | Op::Vote { .. } => {
                // Park on the collective; the warp resolves it.
                *pc_out = (pc - 1) as u32;
                return Ok(St::Coll);
            }
            Op::Nop => {}
            Op::Atom { space, op, ty, d, addr, b, c: cas } => {
                let a = rd(regs, &addr.base, c, clock).wrapping_add(addr.offset as u64);
                let n = ty.bytes();
                let old = m.load_val(*space, a, n).map_err(|e| e.at(inst.line))?;
                let bv = rd(regs, b, c, clock);
                let new = match op {
                    AtomOp::Add if ty.is_float() => fbin(Bin::Add, *ty, old, bv),
                    AtomOp::Add => ty.mask(old.wrapping_add(bv)),
                    AtomOp::Min => ibin(Bin::Min, *ty, old, bv),
                    AtomOp::Max => ibin(Bin::Max, *ty, old, bv),
                    AtomOp::Exch => bv,
                    AtomOp::Cas => {
                        let cv = cas.map(|s| rd(regs, &s, c, clock)).unwrap_or(0);
                        if ty.mask(old) == ty.mask(bv) { cv } else { old }
                    }
                    AtomOp::And => old & bv,
                    AtomOp::Or => old | bv,
                    AtomOp::Xor => old ^ bv,
                    AtomOp::Inc => if ty.mask(old) >= ty.mask(bv) { 0 } else { old + 1 },
                    AtomOp::Dec => if old == 0 || ty.mask(old) > ty.mask(bv) { bv } else { old - 1 },
                };
                m.store(*space, a, &ty.mask(new).to_le_bytes()[..n]).map_err(|e| e.at(inst.line))?;
                if let Some(d) = d {
                    regs[*d as usize] = old;
                }
            }
            Op::Unpack { d, a, part_bits } => {
                let v = rd(regs, a, c, clock);
                for (i, r) in d.iter().enumerate() {
                    let shifted = v.checked_shr(i as u32 * part_bits).unwrap_or(0);
                    regs[*r as usize] = if *part_bits >= 64 { shifted } else { shifted & ((1u64 << part_bits) - 1) };
                }
            }
            Op::Pack { d, s, part_bits } => {
                let mut v = 0u64;
                for (i, sv) in s.iter().enumerate() {
                    let part = rd(regs, sv, c, clock);
                    let part = if *part_bits >= 64 { part } else { part & ((1u64 << part_bits) - 1) };
                    v |= part.checked_shl(i as u32 * part_bits).unwrap_or(0);
                }
                regs[*d as usize] = v;
            }
            Op::Exit => {
                *pc_out = pc as u32;
                return Ok(St::Exit);
            }
        }
    }
}

fn sat01(v: f64) -> f64 {
    if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) }
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
            Bin::Copysign => b.copysign(a),
            Bin::Rem => a % b,
            _ => f32::from_bits((x as u32) & (y as u32)),
        };
        r.to_bits() as u64
    } else {
        let (a, b) = (f64v(x), f64v(y));
        let r = match op {
            Bin::Add => a + b,
            Bin::Sub => a - b,
            Bin::MulLo | Bin::MulHi | Bin::MulWide => a * b,
            Bin::Div => a / b,
            Bin::Min => a.min(b),
            Bin::Max => a.max(b),
            Bin::Copysign => b.copysign(a),
            Bin::Rem => a % b,
            _ => f64::from_bits(x & y),
        };
        r.to_bits()
    }
}

fn ibin(op: Bin, ty: Ty, x: u64, y: u64) -> u64 {
    let bits = ty.bits();
    let (ux, uy) = (ty.mask(x), ty.mask(y));
    let (sx, sy) = (ty.sext(x), ty.sext(y));
    let signed = ty.is_signed();
    match op {
        Bin::Add => ty.mask(ux.wrapping_add(uy)),
        Bin::Sub => ty.mask(ux.wrapping_sub(uy)),
        Bin::MulLo => ty.mask(ux.wrapping_mul(uy)),
        Bin::MulHi => {
            if signed {
                ty.mask(((sx as i128 * sy as i128) >> bits) as u64)
            } else {
                ty.mask(((ux as u128 * uy as u128) >> bits) as u64)
            }
        }
        Bin::MulWide => {
            if signed { (sx as i128 * sy as i128) as u64 } else { (ux as u128 * uy as u128) as u64 }
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
        Bin::Min => if signed { ty.mask(sx.min(sy) as u64) } else { ux.min(uy) },
        Bin::Max => if signed { ty.mask(sx.max(sy) as u64) } else { ux.max(uy) },
        Bin::And => ux & uy,
        Bin::Or => ux | uy,
        Bin::Xor => ux ^ uy,
        // Shift amounts are unsigned and clamp at the operand width,
        // however wide the register holding them.
        Bin::Shl => if y >= bits as u64 { 0 } else { ty.mask(ux << y) },
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
        Bin::Copysign => ux,
    }
}

fn un(op: Un, ty: Ty, v: u64) -> u64 {
    if ty.is_float() {
        let x = fval(ty, v);
        let r = match op {
            Un::Neg => -x,
            Un::Abs => x.abs(),
            Un::Sqrt => x.sqrt(),
            Un::Rsqrt => 1.0 / x.sqrt(),
            Un::Rcp => 1.0 / x,
            Un::Ex2 => x.exp2(),
            Un::Lg2 => x.log2(),
            Un::Sin => x.sin(),
            Un::Cos => x.cos(),
            _ => return v,
        };
        return fbits(ty, r);
    }
    match op {
        Un::Neg => ty.mask((ty.sext(v)).wrapping_neg() as u64),
        Un::Abs => ty.mask(ty.sext(v).wrapping_abs() as u64),
        Un::Not => ty.mask(!v),
        Un::Cnot => (ty.mask(v) == 0) as u64,
        Un::Popc => ty.mask(v).count_ones() as u64,
        Un::Clz => (ty.mask(v).leading_zeros() - (64 - ty.bits())) as u64,
        Un::Brev => ty.mask(v).reverse_bits() >> (64 - ty.bits()),
        _ => v,
    }
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
        Cmp::Lt | Cmp::Ltu => if s { sx < sy } else { ux < uy },
        Cmp::Le | Cmp::Leu => if s { sx <= sy } else { ux <= uy },
        Cmp::Gt | Cmp::Gtu => if s { sx > sy } else { ux > uy },
        Cmp::Ge | Cmp::Geu => if s { sx >= sy } else { ux >= uy },
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
        Round::Rmi | Round::Rm => x.floor(),
        Round::Rpi | Round::Rp => x.ceil(),
        _ => x.trunc(),
    }
}

fn cvt(dty: Ty, sty: Ty, round: Round, sat: bool, v: u64) -> u64 {
    if sty.is_float() {
        let x = fval(sty, v);
        if dty.is_float() {
            let x = if matches!(round, Round::Rni | Round::Rzi | Round::Rmi | Round::Rpi) { round_int(x, round) } else { x };
            let x = if sat { sat01(x) } else { x };
            return fbits(dty, x);
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
        return fbits(dty, val as f64);
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
