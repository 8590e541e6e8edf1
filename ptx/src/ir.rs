//! Decoded modules: registers are frame-relative slot indices, labels are
//! instruction indices into the module's one code array, and every type and
//! modifier is resolved once at load.

use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    B8,
    B16,
    B32,
    B64,
    F16,
    Bf16,
    F16x2,
    Bf16x2,
    F32,
    F64,
    Pred,
}

impl Ty {
    pub fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "u8" => Ty::U8,
            "u16" => Ty::U16,
            "u32" => Ty::U32,
            "u64" => Ty::U64,
            "s8" => Ty::S8,
            "s16" => Ty::S16,
            "s32" => Ty::S32,
            "s64" => Ty::S64,
            "b8" => Ty::B8,
            "b16" => Ty::B16,
            "b32" => Ty::B32,
            "b64" => Ty::B64,
            "f16" => Ty::F16,
            "bf16" => Ty::Bf16,
            "f16x2" => Ty::F16x2,
            "bf16x2" => Ty::Bf16x2,
            "f32" => Ty::F32,
            "f64" => Ty::F64,
            "pred" => Ty::Pred,
            _ => return None,
        })
    }

    pub fn bytes(self) -> usize {
        match self {
            Ty::U8 | Ty::S8 | Ty::B8 | Ty::Pred => 1,
            Ty::U16 | Ty::S16 | Ty::B16 | Ty::F16 | Ty::Bf16 => 2,
            Ty::U32 | Ty::S32 | Ty::B32 | Ty::F32 | Ty::F16x2 | Ty::Bf16x2 => 4,
            Ty::U64 | Ty::S64 | Ty::B64 | Ty::F64 => 8,
        }
    }

    pub fn bits(self) -> u32 {
        if self == Ty::Pred {
            1
        } else {
            8 * self.bytes() as u32
        }
    }

    pub fn is_signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }

    pub fn is_float(self) -> bool {
        matches!(self, Ty::F32 | Ty::F64 | Ty::F16 | Ty::Bf16 | Ty::F16x2 | Ty::Bf16x2)
    }

    /// Keeps the low `bits` of `v`.
    #[inline]
    pub fn mask(self, v: u64) -> u64 {
        match self.bits() {
            64 => v,
            1 => v & 1,
            b => v & ((1u64 << b) - 1),
        }
    }

    /// Reads the low bits of `v` as this type, sign-extended when signed.
    #[inline]
    pub fn sext(self, v: u64) -> i64 {
        let b = self.bits();
        if b >= 64 {
            v as i64
        } else {
            ((v << (64 - b)) as i64) >> (64 - b)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    Tid(u8),
    Ntid(u8),
    Ctaid(u8),
    Nctaid(u8),
    LaneId,
    WarpId,
    NWarpId,
    Clock,
    Clock64,
    ClockHi,
    LaneMaskEq,
    LaneMaskLt,
    LaneMaskLe,
    LaneMaskGt,
    LaneMaskGe,
    SmId,
    NSmId,
    GridId,
    GlobalTimer,
    GlobalTimerLo,
    GlobalTimerHi,
    DynSmemSize,
    TotalSmemSize,
    /// Registers with a fixed value on this device (`%envregN`, `%pmN`,
    /// `%reserved_smem_offset_*`, the cluster registers of a one-CTA cluster).
    Const(u64),
    /// Shared-space offset where dynamic shared memory starts for the
    /// launching kernel (an `extern .shared` array).
    DynShared,
    /// The block's reserved shared memory (what sm_80 and later set aside
    /// for system software; cooperative groups keep the barriers of tiles
    /// wider than a warp there): 0 its start (`%reserved_smem_offset_begin`
    /// and `_0`), 1 a second slot (`_1`), 2 its end, 3 its size (`_cap`).
    ReservedSmem(u8),
}

/// A source operand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Src {
    Reg(u32),
    /// Raw bits, already converted to the instruction's type.
    Imm(u64),
    Special(Special),
    /// The address of module variable N, fixed when the module is linked.
    Sym(u32),
    /// Offset N in the current frame's local memory (a local-space address).
    Local(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Global,
    Shared,
    /// The kernel's parameter buffer.
    Param,
    /// Per-thread memory: `.local` variables, and the `.param` variables of
    /// calls and function parameters.
    Local,
    /// No state space: decided by the address window.
    Generic,
}

/// An address: `[base + offset]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Addr {
    pub base: Src,
    pub offset: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bin {
    Add,
    Sub,
    MulLo,
    MulHi,
    MulWide,
    Div,
    Rem,
    Min,
    Max,
    And,
    Or,
    Xor,
    Shl,
    Shr,
    Copysign,
    /// `min.relu`/`max.relu`: the result clamped below at zero.
    MinRelu,
    MaxRelu,
    /// `min.NaN`/`max.NaN`: NaN if either input is NaN.
    MinNan,
    MaxNan,
    Mul24Lo,
    Mul24Hi,
    /// Float add/sub/mul with `.sat` (clamped to [0, 1]).
    AddSat,
    SubSat,
    MulSat,
    /// `sqrt` with a directed rounding (only in [`Op::BinR`]; `b` unused).
    Sqrt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Un {
    Neg,
    Abs,
    Not,
    Sqrt,
    Rsqrt,
    Rcp,
    Ex2,
    Lg2,
    Sin,
    Cos,
    Tanh,
    Popc,
    Clz,
    Brev,
    Cnot,
    /// `bfind`: position of the most significant non-sign bit.
    Bfind,
    BfindShift,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadMode {
    Lo,
    Hi,
    Wide,
    Lo24,
    Hi24,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Lo,
    Ls,
    Hi,
    Hs,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoolOp {
    And,
    Or,
    Xor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    Default,
    Rn,
    Rz,
    Rm,
    Rp,
    Rna,
    Rni,
    Rzi,
    Rmi,
    Rpi,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShflMode {
    Up,
    Down,
    Bfly,
    Idx,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomOp {
    Add,
    Min,
    Max,
    Exch,
    Cas,
    And,
    Or,
    Xor,
    Inc,
    Dec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VoteMode {
    All,
    Any,
    Uni,
    Ballot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduxOp {
    Add,
    Min,
    Max,
    And,
    Or,
    Xor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestpKind {
    Finite,
    Infinite,
    Number,
    NotANumber,
    Normal,
    Subnormal,
}

/// Three-source integer families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tri {
    /// `bfe d, a, pos, len`.
    Bfe,
    /// `prmt.b32{.mode} d, a, b, c`.
    Prmt(u8),
    /// `lop3.b32 d, a, b, c, LUT`.
    Lop3(u8),
    /// `shf.{l,r}.{wrap,clamp} d, lo, hi, n`.
    Shf { left: bool, wrap: bool },
    /// `sad d, a, b, c`.
    Sad,
    /// `dp4a.atype.btype d, a, b, c` (signedness of a and b).
    Dp4a(bool, bool),
    /// `dp2a.{lo,hi}.atype.btype d, a, b, c`.
    Dp2a { hi: bool, sa: bool, sb: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// `bar.sync`/`barrier.sync`: wait for the barrier.
    Sync,
    /// `bar.arrive`: count the arrival, do not wait.
    Arrive,
    /// `bar.red.popc.u32`, `.and.pred`, `.or.pred`.
    RedPopc,
    RedAnd,
    RedOr,
    /// `barrier.cluster.arrive`/`.wait`: a cluster is one CTA here.
    ClusterArrive,
    ClusterWait,
}

/// What a `call` calls.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Callee {
    Direct(u32),
    /// A function address held in a register (`call %rd, (...), proto`).
    Indirect(Src),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Mov {
        ty: Ty,
        d: u32,
        a: Src,
    },
    Ld {
        space: Space,
        ty: Ty,
        d: Vec<u32>,
        addr: Addr,
        dst_bits: u32,
    },
    St {
        space: Space,
        ty: Ty,
        addr: Addr,
        s: Vec<Src>,
    },
    /// `cvta{.to}.space`: `window` is the generic base of that space.
    Cvta {
        to_generic: bool,
        window: u64,
        d: u32,
        a: Src,
    },
    Cvt {
        dty: Ty,
        sty: Ty,
        round: Round,
        sat: bool,
        relu: bool,
        d: u32,
        a: Src,
    },
    /// `cvt.rn.satfinite{.relu}.{e4m3x2,e5m2x2}.f32 d, hi, lo` (and `.f16x2
    /// d, a`, whose halves are hi and lo): two FP8 values in a .b16.
    CvtToFp8x2 {
        e5m2: bool,
        relu: bool,
        from_f16x2: bool,
        d: u32,
        hi: Src,
        lo: Src,
    },
    /// `cvt.rn{.relu}.f16x2.{e4m3x2,e5m2x2} d, a`.
    CvtFromFp8x2 {
        e5m2: bool,
        relu: bool,
        d: u32,
        a: Src,
    },
    /// `cvt.pack.sat` of two s32 to `bits`-wide integers: d = (c <<
    /// 2·bits) | (a' << bits) | b', a' and b' saturated.
    CvtPack {
        bits: u32,
        signed: bool,
        d: u32,
        a: Src,
        b: Src,
        c: Option<Src>,
    },
    /// `cvt.pack`/two-source `cvt.rn.f16x2.f32 d, hi, lo`.
    Cvt2 {
        dty: Ty,
        round: Round,
        relu: bool,
        d: u32,
        hi: Src,
        lo: Src,
    },
    Bin {
        op: Bin,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
    },
    /// Float add/sub/mul/div with a directed rounding mode.
    BinR {
        op: Bin,
        ty: Ty,
        round: Round,
        d: u32,
        a: Src,
        b: Src,
    },
    /// `add.cc`, `addc{.cc}`, `sub.cc`, `subc{.cc}`: the carry lives in slot 0.
    Carry {
        sub: bool,
        cin: bool,
        cout: bool,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
    },
    /// `min`/`max` `.s16x2`/`.u16x2` (`.relu` for signed): each 16-bit half
    /// of two 32-bit registers on its own.
    MinMax16x2 {
        max: bool,
        signed: bool,
        relu: bool,
        d: u32,
        a: Src,
        b: Src,
    },
    Un {
        op: Un,
        ty: Ty,
        d: u32,
        a: Src,
    },
    Mad {
        mode: MadMode,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
        carry: (bool, bool),
    },
    Fma {
        ty: Ty,
        round: Round,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
        sat: bool,
        relu: bool,
    },
    Tri {
        op: Tri,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    Bfi {
        ty: Ty,
        d: u32,
        f: Src,
        b: Src,
        pos: Src,
        len: Src,
    },
    Setp {
        cmp: Cmp,
        ty: Ty,
        p: u32,
        q: Option<u32>,
        a: Src,
        b: Src,
        comb: Option<(BoolOp, Src, bool)>,
    },
    /// `set.cmp.dtype.stype`: all ones (or 1.0) when the comparison holds.
    Set {
        cmp: Cmp,
        dty: Ty,
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
    },
    Selp {
        ty: Ty,
        d: u32,
        a: Src,
        b: Src,
        p: Src,
    },
    /// `slct.dtype.s32/f32 d, a, b, c`: a if c >= 0, else b.
    Slct {
        ty: Ty,
        cty: Ty,
        d: u32,
        a: Src,
        b: Src,
        c: Src,
    },
    Testp {
        kind: TestpKind,
        ty: Ty,
        p: u32,
        a: Src,
    },
    Bra {
        target: u32,
    },
    /// `brx.idx index, table`.
    Brx {
        index: Src,
        targets: Vec<u32>,
    },
    Call {
        callee: Callee,
        args: Vec<(u32, u32)>,
        ret: Option<(u32, u32)>,
    },
    /// `ret`: back to the caller, or the thread exits in a kernel.
    Ret,
    Bar {
        kind: BarKind,
        id: Src,
        count: Option<Src>,
        d: Option<u32>,
        a: Option<(Src, bool)>,
    },
    WarpSync {
        mask: Src,
    },
    Shfl {
        mode: ShflMode,
        d: u32,
        p: Option<u32>,
        a: Src,
        b: Src,
        c: Src,
        mask: Src,
    },
    Vote {
        mode: VoteMode,
        d: u32,
        a: Src,
        negate: bool,
        mask: Src,
    },
    Match {
        all: bool,
        ty: Ty,
        d: u32,
        p: Option<u32>,
        a: Src,
        mask: Src,
    },
    Redux {
        op: ReduxOp,
        ty: Ty,
        d: u32,
        a: Src,
        mask: Src,
    },
    Elect {
        d: Option<u32>,
        p: Option<u32>,
        mask: Src,
    },
    ActiveMask {
        d: u32,
    },
    Atom {
        space: Space,
        op: AtomOp,
        ty: Ty,
        d: Option<u32>,
        addr: Addr,
        b: Src,
        c: Option<Src>,
    },
    /// `cp.async`: copies at once (completion is immediate on this device).
    CpAsync {
        dst: Addr,
        src: Addr,
        size: u32,
        src_size: Option<Src>,
    },
    /// `mma.sync.aligned`: the warp's D = A × B + C (ptx/src/mma.rs).
    Mma(Box<Mma>),
    /// `wmma.load.{a,b,c}` (`store: false`, into `regs`) and `wmma.store.d`
    /// (from `regs`).
    Wmma(Box<WmmaMove>),
    /// `ldmatrix.sync.aligned.m8n8.xN{.trans}.b16 d, [addr]`: `num` 8×8
    /// tiles from shared memory into fragments.
    Ldmatrix {
        num: u8,
        trans: bool,
        space: Space,
        d: Vec<u32>,
        addr: Addr,
    },
    /// `stmatrix.sync.aligned.m8n8.xN{.trans}.b16 [addr], s`: the inverse.
    Stmatrix {
        num: u8,
        trans: bool,
        space: Space,
        addr: Addr,
        s: Vec<Src>,
    },
    /// `cvt.{rna,rn,rz}.tf32.f32 d, a`: `a` rounded to 10 fraction bits,
    /// kept in an f32 register.
    CvtTf32 {
        round: Round,
        d: u32,
        a: Src,
    },
    /// `isspacep.space p, a`.
    Isspacep {
        space: Space,
        p: u32,
        a: Src,
    },
    /// `mov.b64 {lo, hi}, src` and friends.
    Unpack {
        d: Vec<Option<u32>>,
        a: Src,
        part_bits: u32,
    },
    /// `mov.b64 d, {lo, hi}`.
    Pack {
        d: u32,
        s: Vec<Src>,
        part_bits: u32,
    },
    Nop,
    /// `membar`/`fence`: orders this thread's global accesses against
    /// blocks running on other host threads.
    Fence,
    Exit,
    /// `trap` / `brkpt`: the launch fails.
    Trap,
}

/// Element types of `mma` operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmaTy {
    F16,
    Bf16,
    Tf32,
    F32,
    F64,
    S8,
    U8,
    S32,
    E4m3,
    E5m2,
}

impl MmaTy {
    pub fn parse(s: &str) -> Option<MmaTy> {
        Some(match s {
            "f16" => MmaTy::F16,
            "bf16" => MmaTy::Bf16,
            "tf32" => MmaTy::Tf32,
            "f32" => MmaTy::F32,
            "f64" => MmaTy::F64,
            "s8" => MmaTy::S8,
            "u8" => MmaTy::U8,
            "s32" => MmaTy::S32,
            "e4m3" => MmaTy::E4m3,
            "e5m2" => MmaTy::E5m2,
            _ => return None,
        })
    }

    /// The register type a fragment of this element type is read as.
    pub fn reg_ty(self) -> Ty {
        match self {
            MmaTy::F32 => Ty::F32,
            MmaTy::F64 => Ty::F64,
            _ => Ty::B32,
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            MmaTy::F16 | MmaTy::Bf16 => 16,
            MmaTy::Tf32 | MmaTy::F32 | MmaTy::S32 => 32,
            MmaTy::F64 => 64,
            MmaTy::S8 | MmaTy::U8 | MmaTy::E4m3 | MmaTy::E5m2 => 8,
        }
    }
}

/// A `wmma.load` or `wmma.store`: a `rows`×`cols` matrix of `ty` between
/// memory (row- or column-major, `stride` elements between rows or columns)
/// and the warp's fragments (ptx/src/mma.rs has their layout).
#[derive(Debug, Clone, PartialEq)]
pub struct WmmaMove {
    pub store: bool,
    pub rows: u32,
    pub cols: u32,
    pub ty: MmaTy,
    pub row_major: bool,
    pub space: Space,
    pub addr: Addr,
    pub stride: Option<Src>,
    /// Destination registers of a load.
    pub d: Vec<u32>,
    /// Source registers of a store.
    pub s: Vec<Src>,
}

/// One `mma.sync.aligned` instruction, shape `m`×`n`×`k`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mma {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub aty: MmaTy,
    pub bty: MmaTy,
    pub cty: MmaTy,
    pub dty: MmaTy,
    /// `.satfinite` on integer accumulators: clamp instead of wrapping.
    pub satfinite: bool,
    /// `wmma.mma`: fragments in this device's own layout (what its
    /// `wmma.load`/`wmma.store` use), not `mma`'s documented one.
    pub wmma: bool,
    pub d: Vec<u32>,
    pub a: Vec<Src>,
    pub b: Vec<Src>,
    pub c: Vec<Src>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Inst {
    /// Predicate guard: register and whether it is negated (`@!%p`).
    pub guard: Option<(u32, bool)>,
    pub op: Op,
    pub line: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: String,
    pub offset: u32,
    pub size: u32,
}

/// Functions the device provides itself, declared `.extern .func`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// `__assertfail(msg, file, line, func, charsize)`: the launch fails
    /// with CUDA_ERROR_ASSERT.
    AssertFail,
    /// `vprintf(fmt, args)`: output is discarded; returns 0.
    Vprintf,
}

/// A `.func`: where its code starts and its frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Func {
    pub name: String,
    /// First instruction; None while only declared (or for a builtin).
    pub entry: Option<u32>,
    pub builtin: Option<Builtin>,
    /// Registers of one activation (slot 0 is the carry flag).
    pub num_regs: u32,
    /// Local bytes of one activation: `.local` variables, parameters and
    /// the `.param` variables of the calls it makes.
    pub local_size: u32,
    /// Parameters as (offset in the frame, size).
    pub params: Vec<(u32, u32)>,
    pub ret: Option<(u32, u32)>,
    pub line: u32,
}

/// What every kernel of a module shares: the code of all its bodies, its
/// functions, and the addresses its variables were linked at.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Code {
    pub insts: Vec<Inst>,
    pub funcs: Vec<Func>,
    pub syms: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    pub name: String,
    pub params: Vec<Param>,
    pub params_size: u32,
    pub entry: u32,
    /// Registers of the kernel's own frame (slot 0 is the carry flag).
    pub num_regs: u32,
    /// Local bytes of the kernel's own frame.
    pub local_size: u32,
    /// Static shared bytes; dynamic shared memory starts after them.
    pub shared_bytes: u32,
    pub code: Arc<Code>,
}

impl Kernel {
    /// Host bytes this kernel keeps beyond the shared code.
    pub fn host_bytes(&self) -> u64 {
        let params: usize = self.params.iter().map(|p| std::mem::size_of::<Param>() + p.name.capacity()).sum();
        (std::mem::size_of::<Kernel>() + self.name.capacity() + params) as u64
    }
}

impl Code {
    /// Host bytes of the decoded code: instructions, operand vectors and
    /// the function table.
    pub fn host_bytes(&self) -> u64 {
        let ops: usize = self
            .insts
            .iter()
            .map(|i| match &i.op {
                Op::Ld { d, .. } => d.capacity() * 4,
                Op::Unpack { d, .. } => d.capacity() * 8,
                Op::St { s, .. } | Op::Pack { s, .. } => s.capacity() * std::mem::size_of::<Src>(),
                Op::Brx { targets, .. } => targets.capacity() * 4,
                Op::Mma(m) => std::mem::size_of::<Mma>() + (m.d.capacity() * 4) + (m.a.capacity() + m.b.capacity() + m.c.capacity()) * std::mem::size_of::<Src>(),
                Op::Ldmatrix { d, .. } => d.capacity() * 4,
                Op::Wmma(w) => std::mem::size_of::<WmmaMove>() + w.d.capacity() * 4 + w.s.capacity() * std::mem::size_of::<Src>(),
                Op::Stmatrix { s, .. } => s.capacity() * std::mem::size_of::<Src>(),
                Op::Call { args, .. } => args.capacity() * 8,
                _ => 0,
            })
            .sum();
        let funcs: usize = self.funcs.iter().map(|f| std::mem::size_of::<Func>() + f.name.capacity() + f.params.capacity() * 8).sum();
        (std::mem::size_of::<Code>() + self.insts.capacity() * std::mem::size_of::<Inst>() + ops + funcs + self.syms.capacity() * 8) as u64
    }
}
