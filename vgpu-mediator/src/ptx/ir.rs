//! Decoded kernels: registers are slot indices, labels are instruction
//! indices, and every type and modifier is resolved once at load.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    U8, U16, U32, U64,
    S8, S16, S32, S64,
    B8, B16, B32, B64,
    F32, F64,
    Pred,
}

impl Ty {
    pub fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "u8" => Ty::U8, "u16" => Ty::U16, "u32" => Ty::U32, "u64" => Ty::U64,
            "s8" => Ty::S8, "s16" => Ty::S16, "s32" => Ty::S32, "s64" => Ty::S64,
            "b8" => Ty::B8, "b16" => Ty::B16, "b32" => Ty::B32, "b64" => Ty::B64,
            "f32" => Ty::F32, "f64" => Ty::F64, "pred" => Ty::Pred,
            _ => return None,
        })
    }

    pub fn bytes(self) -> usize {
        match self {
            Ty::U8 | Ty::S8 | Ty::B8 | Ty::Pred => 1,
            Ty::U16 | Ty::S16 | Ty::B16 => 2,
            Ty::U32 | Ty::S32 | Ty::B32 | Ty::F32 => 4,
            Ty::U64 | Ty::S64 | Ty::B64 | Ty::F64 => 8,
        }
    }

    pub fn bits(self) -> u32 {
        if self == Ty::Pred { 1 } else { 8 * self.bytes() as u32 }
    }

    pub fn is_signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }

    pub fn is_float(self) -> bool {
        matches!(self, Ty::F32 | Ty::F64)
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
    Tid(u8), Ntid(u8), Ctaid(u8), Nctaid(u8),
    LaneId, WarpId, NWarpId, Clock, Clock64,
    LaneMaskEq, LaneMaskLt, LaneMaskLe, LaneMaskGt, LaneMaskGe,
}

/// A source operand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Src {
    Reg(u32),
    /// Raw bits, already converted to the instruction's type.
    Imm(u64),
    Special(Special),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Global,
    Shared,
    Param,
    /// No state space: global or shared, decided by the address window.
    Generic,
}

/// An address: `[base + offset]`. Param addresses are byte offsets in the
/// kernel's parameter buffer; shared addresses are offsets in the block's
/// shared window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Addr {
    pub base: Src,
    pub offset: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bin {
    Add, Sub, MulLo, MulHi, MulWide, Div, Rem, Min, Max,
    And, Or, Xor, Shl, Shr, Copysign,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Un {
    Neg, Abs, Not, Sqrt, Rsqrt, Rcp, Ex2, Lg2, Sin, Cos, Popc, Clz, Brev, Cnot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadMode { Lo, Hi, Wide }

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq, Ne, Lt, Le, Gt, Ge, Lo, Ls, Hi, Hs,
    Equ, Neu, Ltu, Leu, Gtu, Geu, Num, Nan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoolOp { And, Or, Xor }

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round { Default, Rn, Rz, Rm, Rp, Rni, Rzi, Rmi, Rpi }

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShflMode { Up, Down, Bfly, Idx }

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomOp { Add, Min, Max, Exch, Cas, And, Or, Xor, Inc, Dec }

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VoteMode { All, Any, Uni, Ballot }

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Mov { ty: Ty, d: u32, a: Src },
    Ld { space: Space, ty: Ty, d: Vec<u32>, addr: Addr, dst_bits: u32 },
    St { space: Space, ty: Ty, addr: Addr, s: Vec<Src> },
    /// `cvta.shared` (to_generic) or `cvta.to.shared`; global is identity.
    Cvta { to_generic: bool, shared: bool, d: u32, a: Src },
    Cvt { dty: Ty, sty: Ty, round: Round, sat: bool, d: u32, a: Src },
    Bin { op: Bin, ty: Ty, d: u32, a: Src, b: Src },
    Un { op: Un, ty: Ty, d: u32, a: Src },
    Mad { mode: MadMode, ty: Ty, d: u32, a: Src, b: Src, c: Src },
    Fma { ty: Ty, d: u32, a: Src, b: Src, c: Src, sat: bool },
    Setp { cmp: Cmp, ty: Ty, p: u32, q: Option<u32>, a: Src, b: Src, comb: Option<(BoolOp, Src, bool)> },
    Selp { ty: Ty, d: u32, a: Src, b: Src, p: Src },
    Bra { target: u32 },
    Bar,
    Nop,
    Shfl { mode: ShflMode, d: u32, p: Option<u32>, a: Src, b: Src, c: Src },
    Vote { mode: VoteMode, d: u32, a: Src, negate: bool },
    Atom { space: Space, op: AtomOp, ty: Ty, d: Option<u32>, addr: Addr, b: Src, c: Option<Src> },
    /// `mov.b64 {lo, hi}, src` and friends.
    Unpack { d: Vec<u32>, a: Src, part_bits: u32 },
    /// `mov.b64 d, {lo, hi}`.
    Pack { d: u32, s: Vec<Src>, part_bits: u32 },
    Exit,
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

impl Kernel {
    /// Host bytes this decoded kernel keeps (its instructions, operand
    /// vectors and parameter table), as charged to its tenant.
    pub fn host_bytes(&self) -> u64 {
        let ops: usize = self
            .insts
            .iter()
            .map(|i| match &i.op {
                Op::Ld { d, .. } | Op::Unpack { d, .. } => d.capacity() * 4,
                Op::St { s, .. } | Op::Pack { s, .. } => s.capacity() * std::mem::size_of::<Src>(),
                _ => 0,
            })
            .sum();
        let params: usize = self.params.iter().map(|p| std::mem::size_of::<Param>() + p.name.capacity()).sum();
        (std::mem::size_of::<Kernel>() + self.name.capacity() + self.insts.capacity() * std::mem::size_of::<Inst>() + ops + params) as u64
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    pub name: String,
    pub params: Vec<Param>,
    pub params_size: u32,
    pub insts: Vec<Inst>,
    pub num_regs: u32,
    /// Static shared bytes; dynamic shared memory starts after them.
    pub shared_bytes: u32,
}
