"""The NVRTC suite's cases: each launches kernels of one tests/nvrtc/kernels
file and checks every output against a reference computed here.

A case is `@case(file, min_arch=70)` on a function of `t` (run_suite.T):
t.upload/zeros/read move data, t.launch(kernel, grid, block, params) runs
and synchronises, t.expect(...) compares. Float results are compared
bit-exactly where the PTX ISA makes the operation exact (IEEE add, sub, mul,
div.rn, fma.rn, sqrt.rn, rcp.rn, conversions with an explicit rounding) and
within the documented error bound (CUDA C++ Programming Guide, "Mathematical
Functions", maximum ULP errors) for approximate ones; see TOLERANCES.
"""

import math
import random
import struct
from fractions import Fraction

import refs
from refs import MASK32, MASK64, s8, s16, s32, s64

CASES = []


class Case:
    def __init__(self, file, name, fn, min_arch, sticky, refused=None):
        self.file, self.name, self.fn, self.min_arch, self.sticky = file, f"{file}.{name}", fn, min_arch, sticky
        self.refused = refused


def case(file, min_arch=70, sticky=False, refused=None):
    """sticky: the case leaves the context in an error state on purpose.
    refused: a construct the CPU reference device documents as unsupported
    (docs/ptx-subset.md); the case passes there when the module load fails
    with CUDA_ERROR_INVALID_PTX and a log matching this regex, and runs
    normally on a device that loads it."""
    def deco(fn):
        CASES.append(Case(file, fn.__name__, fn, min_arch, sticky, refused))
        return fn
    return deco


def rng(seed):
    return random.Random(seed)


def rand_u32(r, n):
    special = [0, 1, 2, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 0x00010000, 0xF0F0F0F0, 0x12345678, 0x000000FF]
    return (special + [r.getrandbits(32) >> r.randrange(0, 32) for _ in range(n)])[:n]


def as_s32(v):
    return [s32(x) for x in v]


# Maximum errors allowed for approximate functions, in ulps of the result
# (CUDA C++ Programming Guide, "Mathematical Functions", and the PTX ISA for
# the .approx instructions). The f64 bounds add 1 ulp for the host libm.
TOLERANCES = {
    "rsqrtf": 2, "__fdividef": 2, "exp2f": 2, "__log2f": 2,
    "sinf": 2, "cosf": 2, "expf": 2, "logf": 1, "tanhf": 2, "powf": 4,
    "sin": 3, "cos": 3, "exp": 2, "log": 2,
}


# ----------------------------------------------------------------------------
# integer / bit
# ----------------------------------------------------------------------------

def msb(x):
    return x.bit_length() - 1


def brev(x, bits=32):
    return int(format(x, f"0{bits}b")[::-1], 2)


def clz(x, bits=32):
    return bits - x.bit_length()


def ffs(x):
    return (x & -x).bit_length() if x else 0


def bfind_s32(x):
    sx = s32(x)
    if sx == 0 or sx == -1:
        return MASK32
    return msb(x) if sx > 0 else msb(~x & MASK32)


@case("int_bits")
def int_unary32(t):
    n = 64
    a = rand_u32(rng(1), n)
    out = t.zeros("I", n * 8)
    t.launch("int_unary32", [1], [n], [t.ptr(t.upload("I", a)), t.ptr(out), t.i32(n)])
    got = t.read(out, "I", n * 8)
    want = []
    for x in a:
        want += [brev(x), clz(x), bin(x).count("1"), ffs(x), msb(x) & MASK32, bfind_s32(x),
                 (31 - msb(x)) if x else MASK32, (~x ^ (x >> 7)) & MASK32]
    names = ["brev", "clz", "popc", "ffs", "bfind.u32", "bfind.s32", "bfind.shiftamt.u32", "not/xor/shr"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::8], want[k::8], show=lambda i: f"x={a[i]:#x}")


@case("int_bits")
def int_unary64(t):
    n = 64
    r = rng(2)
    a = [0, 1, MASK64, 1 << 63, 0x00000000FFFFFFFF, 0xFFFFFFFF00000000] + [r.getrandbits(64) >> r.randrange(64) for _ in range(n - 6)]
    out = t.zeros("Q", n * 5)
    t.launch("int_unary64", [1], [n], [t.ptr(t.upload("Q", a)), t.ptr(out), t.i32(n)])
    got = t.read(out, "Q", n * 5)
    want = []
    for x in a:
        want += [brev(x, 64), clz(x, 64), bin(x).count("1"), ffs(x), msb(x) & MASK32]
    for k, nm in enumerate(["brevll", "clzll", "popcll", "ffsll", "bfind.u64"]):
        t.expect(nm, got[k::5], want[k::5], show=lambda i: f"x={a[i]:#x}")


def bfe(x, pos, ln, signed):
    pos, ln = pos & 0xFF, ln & 0xFF
    sbit = 0 if (not signed or ln == 0) else (x >> min(pos + ln - 1, 31)) & 1
    d = 0
    for i in range(32):
        bit = (x >> (pos + i)) & 1 if (i < ln and pos + i <= 31) else sbit
        d |= bit << i
    return d


def bfi(a, b, pos, ln):
    pos, ln = pos & 0xFF, ln & 0xFF
    f = b
    for i in range(ln):
        if pos + i > 31:
            break
        f = (f & ~(1 << (pos + i))) | (((a >> i) & 1) << (pos + i))
    return f & MASK32


def prmt(a, b, c):
    tmp = (b << 32) | a
    d = 0
    for k in range(4):
        sel = (c >> (4 * k)) & 0xF
        byte = (tmp >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        d |= byte << (8 * k)
    return d


def lop3(a, b, c, lut):
    d = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        d |= ((lut >> idx) & 1) << i
    return d


def funnel(lo, hi, s, left):
    v = (hi << 32) | lo
    return ((v << s) >> 32) & MASK32 if left else (v >> s) & MASK32


@case("int_bits")
def int_bitfield(t):
    n = 96
    r = rng(3)
    a, b = rand_u32(r, n), rand_u32(r, n)[::-1]
    c = [r.getrandbits(32) for _ in range(n)]
    c[:6] = [0, 0x1F1F, 0x0820, 0x1000, 0xFFFFFFFF, 0x3F3F]
    out = t.zeros("I", n * 12)
    t.launch("int_bitfield", [2], [n // 2], [t.ptr(t.upload("I", a)), t.ptr(t.upload("I", b)), t.ptr(t.upload("I", c)), t.ptr(out), t.i32(n)])
    got = t.read(out, "I", n * 12)
    want = []
    for x, y, z in zip(a, b, c):
        pos, ln = z & 31, (z >> 8) & 31
        want += [bfe(x, pos, ln, False), bfe(x, pos, ln, True), bfi(x, y, pos, ln), prmt(x, y, z & 0x7777), prmt(x, y, z),
                 funnel(x, y, z & 31, True), funnel(x, y, z & 31, False), funnel(x, y, min(z & 63, 32), True),
                 funnel(x, y, min(z & 63, 32), False), lop3(x, y, z, 0x96), lop3(x, y, z, 0xE8),
                 ((x & ~y) | ((y & z) ^ (~x & z))) & MASK32]
    names = ["bfe.u32", "bfe.s32", "bfi.b32", "__byte_perm", "prmt.b32 (sign mode)", "__funnelshift_l", "__funnelshift_r",
             "__funnelshift_lc", "__funnelshift_rc", "lop3 0x96", "lop3 0xE8", "and/or/xor expression"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::12], want[k::12], show=lambda i: f"a={a[i]:#x} b={b[i]:#x} c={c[i]:#x}")


def mul24(x, y, signed):
    if signed:
        x, y = x & 0xFFFFFF, y & 0xFFFFFF
        x, y = (x - (1 << 24) if x >> 23 else x), (y - (1 << 24) if y >> 23 else y)
    else:
        x, y = x & 0xFFFFFF, y & 0xFFFFFF
    return (x * y) & MASK32


@case("int_arith")
def int_mul(t):
    n = 64
    r = rng(4)
    a = as_s32(rand_u32(r, n))
    b = as_s32(rand_u32(r, n)[::-1])
    c = [r.getrandbits(32) for _ in range(n)]
    out = t.zeros("I", n * 10)
    t.launch("int_mul", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("i", b)), t.ptr(t.upload("I", c)), t.ptr(out), t.i32(n)])
    got = t.read(out, "I", n * 10)
    want = []
    for x, y, z in zip(a, b, c):
        wx = s64((x << 20) ^ y)
        wy = s64((y << 25) + z)
        hs = ((wx * wy) >> 64) & MASK64
        hu = (((wx & MASK64) * (wy & MASK64)) >> 64) & MASK64
        want += [mul24(x, y, True), mul24(x & MASK32, y & MASK32, False), ((x * y) >> 32) & MASK32,
                 (((x & MASK32) * (y & MASK32)) >> 32) & MASK32, hs & MASK32, hs >> 32, hu & MASK32, hu >> 32,
                 (abs(x - y) + z) & MASK32, (abs((x & MASK32) - (y & MASK32)) + z) & MASK32]
    names = ["__mul24", "__umul24", "__mulhi", "__umulhi", "__mul64hi lo", "__mul64hi hi", "__umul64hi lo", "__umul64hi hi", "__sad", "__usad"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::10], want[k::10], show=lambda i: f"a={a[i]} b={b[i]} c={c[i]:#x}")


def dp4a(x, y, c, signed):
    conv = s8 if signed else (lambda v: v & 0xFF)
    return (c + sum(conv(x >> (8 * k)) * conv(y >> (8 * k)) for k in range(4))) & MASK32


def dp2a(x, y, c, signed, hi):
    c16 = s16 if signed else (lambda v: v & 0xFFFF)
    c8 = s8 if signed else (lambda v: v & 0xFF)
    base = 2 if hi else 0
    return (c + c16(x) * c8(y >> (8 * base)) + c16(x >> 16) * c8(y >> (8 * (base + 1)))) & MASK32


@case("int_arith")
def int_dot(t):
    n = 64
    r = rng(5)
    a, b = as_s32(rand_u32(r, n)), as_s32([r.getrandbits(32) for _ in range(n)])
    c = [r.randrange(-(1 << 31), 1 << 31) for _ in range(n)]
    out = t.zeros("i", n * 6)
    t.launch("int_dot", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("i", b)), t.ptr(t.upload("i", c)), t.ptr(out), t.i32(n)])
    got = [v & MASK32 for v in t.read(out, "i", n * 6)]
    want = []
    for x, y, z in zip(a, b, c):
        want += [dp4a(x, y, z, True), dp4a(x, y, z, False), dp2a(x, y, z, True, False), dp2a(x, y, z, True, True),
                 dp2a(x, y, z, False, False), dp2a(x, y, z, False, True)]
    for k, nm in enumerate(["__dp4a s32", "__dp4a u32", "__dp2a_lo s32", "__dp2a_hi s32", "__dp2a_lo u32", "__dp2a_hi u32"]):
        t.expect(nm, got[k::6], want[k::6], show=lambda i: f"a={a[i] & MASK32:#x} b={b[i] & MASK32:#x} c={c[i]}")


@case("int_arith")
def int_minmax(t):
    n = 64
    r = rng(6)
    a = as_s32(rand_u32(r, n))
    b = as_s32(rand_u32(r, n)[::-1])
    c = as_s32([r.getrandbits(32) for _ in range(n)])
    out = t.zeros("i", n * 10)
    t.launch("int_minmax", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("i", b)), t.ptr(t.upload("i", c)), t.ptr(out), t.i32(n)])
    got = t.read(out, "i", n * 10)
    want = []
    for x, y, z in zip(a, b, c):
        want += [min(x, y), max(x, y), s32(min(x & MASK32, y & MASK32)), s32(max(x & MASK32, y & MASK32)),
                 max(x, y, 0), max(min(x, y), 0), max(x, y, z), s32(min(x & MASK32, y & MASK32, z & MASK32)),
                 max(x, y), int(x >= y)]
    names = ["min.s32", "max.s32", "min.u32", "max.u32", "__vimax_s32_relu", "__vimin_s32_relu", "__vimax3_s32",
             "__vimin3_u32", "__vibmax_s32", "__vibmax_s32 pred"]
    for k, nm in enumerate(names):
        same = (lambda g, w: (g != 0) == (w != 0)) if k == 9 else None
        t.expect(nm, got[k::10], want[k::10], same=same, show=lambda i: f"a={a[i]} b={b[i]} c={c[i]}")


@case("int_arith", min_arch=90)
def int_relu_asm(t):
    n = 64
    r = rng(7)
    a, b = as_s32(rand_u32(r, n)), as_s32(rand_u32(r, n)[::-1])
    out = t.zeros("i", n * 2)
    t.launch("int_relu_asm", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("i", b)), t.ptr(out), t.i32(n)])
    got = t.read(out, "i", n * 2)
    t.expect("max.relu.s32", got[0::2], [max(x, y, 0) for x, y in zip(a, b)])
    t.expect("min.relu.s32", got[1::2], [max(min(x, y), 0) for x, y in zip(a, b)])


@case("int_arith")
def int_divrem(t):
    n = 64
    r = rng(8)
    a = [r.randrange(-(1 << 31), 1 << 31) >> r.randrange(31) for _ in range(n)]
    b = [r.choice([1, -1, 3, -7, 1 << 30]) if k < 8 else (r.randrange(-(1 << 31), 1 << 31) >> r.randrange(31) or 5) for k in range(n)]
    a[0], b[0] = -(1 << 31), 3
    out = t.zeros("q", n * 8)
    t.launch("int_divrem", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("i", b)), t.ptr(out), t.i32(n)])
    got = t.read(out, "q", n * 8)
    want = []
    for x, y in zip(a, b):
        ux, uy = x & MASK32, y & MASK32
        wx, wy = x * 1000003 + y, y * 7 - 3
        uwx, uwy = wx & MASK64, wy & MASK64
        want += [cd(x, y), cr(x, y), ux // uy, ux % uy, cd(wx, wy), cr(wx, wy), s64(uwx // uwy),
                 s64((uwx >> (y & 63)) ^ ((uwy << (x & 63)) & MASK64) ^ ((wx >> (x & 63)) & MASK64))]
    names = ["div.s32", "rem.s32", "div.u32", "rem.u32", "div.s64", "rem.s64", "div.u64", "64-bit shifts"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::8], want[k::8], show=lambda i: f"a={a[i]} b={b[i]}")


def cd(a, b):
    return refs.cdiv(a, b)


def cr(a, b):
    return refs.crem(a, b)


@case("int_carry")
def carry128(t):
    n = 32
    r = rng(9)
    xs = [(1 << 128) - 1, 0, 1 << 127, 0xFFFFFFFF] + [r.getrandbits(128) for _ in range(n - 4)]
    ys = [1, 1, 1 << 127, 1] + [r.getrandbits(128) >> r.randrange(0, 128, 32) for _ in range(n - 4)]

    def limbs(v):
        return [(v >> (32 * k)) & MASK32 for k in range(4)]

    s, d = t.zeros("I", n * 4), t.zeros("I", n * 4)
    t.launch("carry128", [1], [n], [t.ptr(t.upload("I", sum((limbs(v) for v in xs), []))),
                                    t.ptr(t.upload("I", sum((limbs(v) for v in ys), []))), t.ptr(s), t.ptr(d), t.i32(n)])
    gs, gd = t.read(s, "I", n * 4), t.read(d, "I", n * 4)
    join = lambda g: [sum(g[4 * i + k] << (32 * k) for k in range(4)) for i in range(n)]
    t.expect("add.cc/addc 128-bit", join(gs), [(x + y) % (1 << 128) for x, y in zip(xs, ys)])
    t.expect("sub.cc/subc 128-bit", join(gd), [(x - y) % (1 << 128) for x, y in zip(xs, ys)])


@case("int_carry")
def carry64_mul(t):
    n = 32
    r = rng(10)
    xs = [MASK64, MASK64, 1 << 63, 0] + [r.getrandbits(64) for _ in range(n - 4)]
    ys = [1, MASK64, 1 << 63, 5] + [r.getrandbits(64) >> r.randrange(64) for _ in range(n - 4)]
    out = t.zeros("Q", n * 6)
    t.launch("carry64_mul", [1], [n], [t.ptr(t.upload("Q", xs)), t.ptr(t.upload("Q", ys)), t.ptr(out), t.i32(n)])
    got = t.read(out, "Q", n * 6)
    want = []
    for x, y in zip(xs, ys):
        p = x * y
        want += [(x + y) & MASK64, (x + y) >> 64, p & MASK64, p >> 64, p & MASK64, p >> 64]
    names = ["add.cc.u64", "addc.u64", "mad.lo.cc/madc.hi lo", "mad.lo.cc/madc.hi hi", "mul.lo.u64", "mul.hi.u64"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::6], want[k::6], show=lambda i: f"x={xs[i]:#x} y={ys[i]:#x}")


# ----------------------------------------------------------------------------
# float
# ----------------------------------------------------------------------------

def f32_pool(r, n, specials=True):
    """f32 values across exponents, with specials and subnormals."""
    sp = [0.0, -0.0, 1.0, -1.0, 0.5, 2.5, -2.5, 3.0, math.inf, -math.inf, math.nan, 1e-40, -3e-42,
          3.4028234663852886e+38, 1.1754943508222875e-38, 16777217.0, 0.1, -7.75] if specials else []
    vals = []
    while len(vals) < n:
        v = refs.f32(r.choice([-1, 1]) * r.uniform(1, 2) * 2.0 ** r.randint(-40, 40))
        vals.append(v)
    return [refs.f32(v) for v in sp + vals][:n]


def fbits(vals):
    return [refs.f32_bits(v) for v in vals]


@case("f32_exact")
def f32_arith(t):
    n = 128
    r = rng(11)
    a = f32_pool(r, n)
    b = f32_pool(r, n)[::-1]
    c = f32_pool(r, n, specials=False)
    # near-cancellations and exact ties
    for k in range(20, 30):
        b[k] = refs.f32(-a[k] * (1 + 2.0 ** -20)) if math.isfinite(a[k]) else b[k]
    out = t.zeros("f", n * 16)
    t.launch("f32_arith", [2], [64], [t.ptr(t.upload("f", a)), t.ptr(t.upload("f", b)), t.ptr(t.upload("f", c)), t.ptr(out), t.i32(n)])
    got = t.read(out, "f", n * 16)
    want = []
    for x, y, z in zip(a, b, c):
        want += [refs.add(x, y), refs.sub(x, y), refs.mul(x, y), refs.div(x, y), refs.fma(x, y, z), refs.sqrt(abs(x)),
                 refs.div(1.0, y), refs.fminmax(x, y, False), refs.fminmax(x, y, True), refs.sub(abs(x), y),
                 math.copysign(x, y), (0.0 if math.isnan(x) else min(max(x, 0.0), 1.0)),
                 refs.integral(x, "rd"), refs.integral(x, "ru"), refs.integral(x, "rz"), refs.integral(x, "rn")]
    names = ["add.f32", "sub.f32", "mul.f32", "div.rn.f32", "fma.rn.f32", "sqrt.rn.f32", "rcp.rn.f32", "fminf", "fmaxf",
             "fabsf+sub", "copysignf", "__saturatef", "floorf", "ceilf", "truncf", "rintf"]
    for k, nm in enumerate(names):
        zs = k not in (7, 8, 11)
        t.expect(nm, got[k::16], want[k::16], same=lambda g, w, zs=zs: refs.same_float(g, w, zs),
                 show=lambda i: f"a={a[i]!r} b={b[i]!r} c={c[i]!r}")


@case("f32_exact")
def f32_classify(t):
    vals = [0.0, -0.0, 1.0, -2.0, math.inf, -math.inf, math.nan, 1e-40, -1e-45, 1.1754943508222875e-38, 3.4e38, -5.5]
    n = len(vals)
    out = t.zeros("I", n)
    t.launch("f32_classify", [1], [n], [t.ptr(t.upload("f", vals)), t.ptr(out), t.i32(n)])
    want = []
    for x in vals:
        sub = x != 0 and math.isfinite(x) and abs(x) < 1.1754943508222875e-38
        norm = math.isfinite(x) and x != 0 and not sub
        want.append(int(math.isnan(x)) | 2 * int(math.isinf(x)) | 4 * int(math.isfinite(x)) | 8 * int(refs.sgn(x) and not math.isnan(x))
                    | 16 * int(sub) | 32 * int(norm) | 64 * int(math.isfinite(x)) | 128 * int(math.isinf(x))
                    | 256 * int(not math.isnan(x)) | 512 * int(math.isnan(x)))
    t.expect("bits isnan|isinf|isfinite|signbit|testp.subnormal|normal|finite|infinite|number|notanumber.f64", t.read(out, "I", n), want,
             show=lambda i: repr(vals[i]))


@case("f32_round")
def f32_rounding(t):
    n = 128
    r = rng(12)
    a, b, c = f32_pool(r, n), f32_pool(r, n)[::-1], f32_pool(r, n, specials=False)
    out = t.zeros("f", n * 16)
    t.launch("f32_rounding", [2], [64], [t.ptr(t.upload("f", a)), t.ptr(t.upload("f", b)), t.ptr(t.upload("f", c)), t.ptr(out), t.i32(n)])
    got = t.read(out, "f", n * 16)
    want = []
    for x, y, z in zip(a, b, c):
        want += [refs.add(x, y, mode="rn"), refs.add(x, y, mode="rz"), refs.add(x, y, mode="ru"), refs.add(x, y, mode="rd"),
                 refs.mul(x, y, mode="rz"), refs.mul(x, y, mode="ru"), refs.mul(x, y, mode="rd"),
                 refs.fma(x, y, z, mode="rz"), refs.fma(x, y, z, mode="ru"), refs.fma(x, y, z, mode="rd"),
                 refs.div(x, y, mode="rz"), refs.div(x, y, mode="ru"), refs.sqrt(abs(x), mode="rd"), refs.sqrt(abs(x), mode="ru"),
                 refs.div(1.0, y, mode="rz"), refs.sub(x, y, mode="ru")]
    names = ["__fadd_rn", "__fadd_rz", "__fadd_ru", "__fadd_rd", "__fmul_rz", "__fmul_ru", "__fmul_rd", "__fmaf_rz", "__fmaf_ru",
             "__fmaf_rd", "__fdiv_rz", "__fdiv_ru", "__fsqrt_rd", "__fsqrt_ru", "__frcp_rz", "__fsub_ru"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::16], want[k::16], same=refs.same_float, show=lambda i: f"a={a[i]!r} b={b[i]!r} c={c[i]!r}")


@case("f32_round")
def f32_convert(t):
    n = 64
    r = rng(13)
    a = f32_pool(r, 40) + [0.5, 1.5, 2.5, -0.5, -1.5, 3e9, -3e9, 4.5e9, 2147483520.0, -2147483648.0, 1e19, -1e19,
                           8388609.0, -1.25, 0.75, 1e-3, 123456.789, -98765.4321, 7.5, -7.5,
                           4294967040.0, 65535.5, -0.0, 1e30]
    a = [refs.f32(v) for v in a[:n]]
    d = [r.uniform(-1, 1) * 10.0 ** r.randint(-50, 50) for _ in range(n - 8)] + [1e300, -1e300, 1e-300, -1e-300, math.inf, math.nan, 2.5, -3e9]
    k = [r.getrandbits(32) - (1 << 31) for _ in range(n - 4)] + [16777217, -16777219, 0x7FFFFFFF, -(1 << 31)]
    l = [r.getrandbits(64) - (1 << 63) for _ in range(n - 2)] + [(1 << 63) - 1, (1 << 24) + 1]
    out = t.zeros("I", n * 20)
    t.launch("f32_convert", [1], [n], [t.ptr(t.upload("f", a)), t.ptr(t.upload("d", d)), t.ptr(t.upload("i", k)), t.ptr(t.upload("q", l)), t.ptr(out), t.i32(n)])
    got = t.read(out, "I", n * 20)
    names = ["__float2int_rn", "__float2int_rz", "__float2int_ru", "__float2int_rd", "__float2uint_rn", "__float2uint_rz",
             "__int2float_rn", "__int2float_rz", "__int2float_ru", "__uint2float_rd", "__double2float_rn", "__double2float_rz",
             "__double2float_ru", "__double2float_rd", "__double2int_rz", "__double2int_rn", "__float2ll_rd lo", "__float2ll_rd hi",
             "__ll2float_rz", "(float)int"]
    want = []
    for x, w, kv, lv in zip(a, d, k, l):
        q = refs.to_int(x, "rd", 64) & MASK64
        want += [refs.to_int(x, m) & MASK32 for m in ("rn", "rz", "ru", "rd")]
        want += [refs.to_int(x, "rn", 32, False), refs.to_int(x, "rz", 32, False)]
        want += [refs.f32_bits(refs.from_int(kv, "f32", m)) for m in ("rn", "rz", "ru")]
        want += [refs.f32_bits(refs.from_int(kv & MASK32, "f32", "rd"))]
        want += [refs.f32_bits(refs.rnd(w, "f32", m)) for m in ("rn", "rz", "ru", "rd")]
        want += [refs.to_int(w, "rz") & MASK32, refs.to_int(w, "rn") & MASK32, q & MASK32, q >> 32,
                 refs.f32_bits(refs.from_int(lv, "f32", "rz")), refs.f32_bits(refs.from_int(kv, "f32", "rn"))]
    for j, nm in enumerate(names):
        nan_any = j in (16, 17)  # NaN to 64-bit integer: no check
        src = a if j < 6 or j in (16, 17) else (d if 10 <= j <= 15 else (l if j == 18 else k))
        same = None
        g, wv = got[j::20], want[j::20]
        if nan_any:
            g = [0 if math.isnan(a[i]) else v for i, v in enumerate(g)]
            wv = [0 if math.isnan(a[i]) else v for i, v in enumerate(wv)]
        if 10 <= j <= 13:  # NaN results: any NaN
            same = lambda gg, ww: (gg & 0x7FFFFFFF) > 0x7F800000 if (ww & 0x7FFFFFFF) > 0x7F800000 else gg == ww
        t.expect(nm, g, wv, same=same, show=lambda i, src=src: f"in={src[i]!r}")


@case("f32_approx")
def f32_approx(t):
    n = 128
    r = rng(14)
    a = [refs.f32(r.uniform(-30, 30)) for _ in range(n - 8)] + [0.0, 1.0, -1.0, 2.0, 30.0, -30.0, 0.001, 7.25]
    b = [refs.f32(r.choice([-1, 1]) * r.uniform(1, 2) * 2.0 ** r.randint(-20, 20)) for _ in range(n)]
    out = t.zeros("f", n * 8)
    t.launch("f32_approx", [2], [64], [t.ptr(t.upload("f", a)), t.ptr(t.upload("f", b)), t.ptr(out), t.i32(n)])
    got = t.read(out, "f", n * 8)
    show = lambda i: f"a={a[i]!r} b={b[i]!r}"
    col = lambda k: got[k::8]
    arg_rs = [refs.add(abs(x), 0.5) for x in a]
    t.expect("rsqrtf (2 ulp)", col(0), [1 / math.sqrt(v) for v in arg_rs], same=lambda g, w: refs.within_ulps(g, w, 2), show=show)
    t.expect("__fdividef (2 ulp)", col(1), [x / y for x, y in zip(a, b)], same=lambda g, w: refs.within_ulps(g, w, 2), show=show)
    ex = [x * 0.125 for x in a]
    bad = [i for i, v in enumerate(ex) if not refs.within_ulps(col(2)[i], math.exp(v), 2 + math.floor(abs(1.173 * v)))]
    t.check(not bad, "__expf: " + "; ".join(f"[{i}] x={ex[i]!r} got {col(2)[i]!r} want {math.exp(ex[i])!r}" for i in bad[:4]))
    t.expect("exp2f (2 ulp)", col(3), [2.0 ** (x * 0.25) for x in a], same=lambda g, w: refs.within_ulps(g, w, 2), show=show)
    lg = [refs.add(abs(x), 1.0) for x in a]
    t.expect("__log2f (2 ulp, 2^-22 abs in [0.5, 2])", col(4), [math.log2(v) for v in lg],
             same=lambda g, w: refs.within_ulps(g, w, 2, abs_tol=2.0 ** -22), show=show)
    sa = [refs.mul(x, refs.f32(0.1)) for x in a]
    t.expect("__sinf (2^-21.41 abs on [-pi, pi])", col(5), [math.sin(v) for v in sa],
             same=lambda g, w: abs(g - w) <= 2.0 ** -21.41, show=show)
    t.expect("__cosf (2^-21.41 abs on [-pi, pi])", col(6), [math.cos(v) for v in sa],
             same=lambda g, w: abs(g - w) <= 2.0 ** -21.41, show=show)
    t.expect("__frsqrt_rn (exact)", col(7), [refs.rsqrt_rn(v) for v in arg_rs], same=refs.same_float, show=show)


@case("f32_libm")
def f32_libm(t):
    n = 96
    r = rng(15)
    a = [refs.f32(r.uniform(-10, 10)) for _ in range(n - 24)] + [refs.f32(v) for v in (
        0.0, -0.0, 1.0, math.pi, -math.pi / 2, 100.0, 1e4, -1e4, 123456.7, 1e6, 3e8, -3e8, 1e20, -1e20, 3e35, 1e38,
        0.5, 1e-30, -1e-6, 88.0, -1e3, 710.5, 105615.0, 1.5e7)]
    out = t.zeros("f", n * 7)
    t.launch("f32_libm", [2], [48], [t.ptr(t.upload("f", a)), t.ptr(out), t.i32(n)])
    got = t.read(out, "f", n * 7)
    col = lambda k: got[k::7]
    show = lambda i: f"x={a[i]!r}"
    ok = lambda nm: (lambda g, w: refs.within_ulps(g, w, TOLERANCES[nm]))
    t.expect("sinf (2 ulp)", col(0), [math.sin(x) for x in a], same=ok("sinf"), show=show)
    t.expect("cosf (2 ulp)", col(1), [math.cos(x) for x in a], same=ok("cosf"), show=show)
    half = [x * 0.5 for x in a]
    want = [math.sin(h) + math.cos(h) for h in half]
    tol = [2 * refs.ulp(math.sin(h)) + 2 * refs.ulp(math.cos(h)) + refs.ulp(w) for h, w in zip(half, want)]
    bad = [i for i in range(n) if not abs(col(2)[i] - want[i]) <= tol[i]]
    t.check(not bad, "sincosf s+c: " + "; ".join(f"[{i}] x={half[i]!r} got {col(2)[i]!r} want {want[i]!r}" for i in bad[:4]))
    m = [min(abs(x), 80.0) * 0.5 for x in a]
    t.expect("expf (2 ulp)", col(3), [math.exp(v) for v in m], same=ok("expf"), show=show)
    lg = [refs.add(abs(x), 1.0) for x in a]
    t.expect("logf (1 ulp)", col(4), [math.log(v) for v in lg], same=ok("logf"), show=show)
    th = [refs.mul(x, refs.f32(1e-3)) for x in a]
    t.expect("tanhf (2 ulp)", col(5), [math.tanh(v) for v in th], same=ok("tanhf"), show=show)
    pw = [refs.add(min(abs(x), 100.0), 1.0) for x in a]
    t.expect("powf (4 ulp)", col(6), [v ** 1.5 for v in pw], same=lambda g, w: refs.within_ulps(g, w, 4), show=show)


def f64_pool(r, n, specials=True):
    sp = [0.0, -0.0, 1.0, -1.0, 2.5, -3.5, math.inf, -math.inf, math.nan, 5e-324, -2.5e-310, 1.7976931348623157e308,
          2.2250738585072014e-308, 9007199254740993.0, 0.1] if specials else []
    vals = [r.choice([-1, 1]) * r.uniform(1, 2) * 2.0 ** r.randint(-200, 200) for _ in range(n)]
    return (sp + vals)[:n]


@case("f64")
def f64_arith(t):
    n = 96
    r = rng(16)
    a, b, c = f64_pool(r, n), f64_pool(r, n)[::-1], f64_pool(r, n, specials=False)
    out = t.zeros("d", n * 18)
    t.launch("f64_arith", [2], [48], [t.ptr(t.upload("d", a)), t.ptr(t.upload("d", b)), t.ptr(t.upload("d", c)), t.ptr(out), t.i32(n)])
    got = t.read(out, "d", n * 18)
    want = []
    F = "f64"
    for x, y, z in zip(a, b, c):
        want += [refs.add(x, y, F), refs.sub(x, y, F), refs.mul(x, y, F), refs.div(x, y, F), refs.fma(x, y, z, F),
                 refs.sqrt(abs(x), F), refs.div(1.0, y, F), refs.fminmax(x, y, False), refs.fminmax(x, y, True),
                 refs.add(x, y, F, "rz"), refs.add(x, y, F, "ru"), refs.mul(x, y, F, "rd"), refs.fma(x, y, z, F, "ru"),
                 refs.div(x, y, F, "rz"), refs.sqrt(abs(x), F, "rd"), refs.div(1.0, y, F, "ru"), refs.rnd(x, "f32"),
                 refs.add(refs.integral(x, "rd"), math.copysign(1.0, y), F)]
    names = ["add.f64", "sub.f64", "mul.f64", "div.rn.f64", "fma.rn.f64", "sqrt.rn.f64", "rcp.rn.f64", "fmin", "fmax", "__dadd_rz",
             "__dadd_ru", "__dmul_rd", "__fma_ru", "__ddiv_rz", "__dsqrt_rd", "__drcp_ru", "cvt f64->f32->f64", "floor+copysign"]
    for k, nm in enumerate(names):
        zs = k not in (7, 8)
        t.expect(nm, got[k::18], want[k::18], same=lambda g, w, zs=zs: refs.same_float(g, w, zs),
                 show=lambda i: f"a={a[i]!r} b={b[i]!r} c={c[i]!r}")


@case("f64")
def f64_libm(t):
    n = 64
    r = rng(17)
    a = [r.uniform(-10, 10) for _ in range(n - 12)] + [0.0, 1.0, math.pi, 1e4, -1e6, 1e10, 1e22, -1e100, 1e300, 0.5, 700.0, 1e-10]
    out = t.zeros("d", n * 4)
    t.launch("f64_libm", [1], [n], [t.ptr(t.upload("d", a)), t.ptr(out), t.i32(n)])
    got = t.read(out, "d", n * 4)
    show = lambda i: f"x={a[i]!r}"
    ok = lambda nm: (lambda g, w: refs.within_ulps(g, w, TOLERANCES[nm], "f64"))
    t.expect("sin (2+1 ulp)", got[0::4], [math.sin(x) for x in a], same=ok("sin"), show=show)
    t.expect("cos (2+1 ulp)", got[1::4], [math.cos(x) for x in a], same=ok("cos"), show=show)
    t.expect("exp (1+1 ulp)", got[2::4], [math.exp(min(abs(x), 700.0) * 0.5) for x in a], same=ok("exp"), show=show)
    t.expect("log (1+1 ulp)", got[3::4], [math.log(abs(x) + 1.0) for x in a], same=ok("log"), show=show)


def half_pool(r, n, specials=True, fmt="f16"):
    sp = [0.0, 1.0, -1.0, 0.5, 65504.0, -2.0, math.inf, math.nan, 6.103515625e-05, 5.960464477539063e-08] if specials else []
    lo, hi = (-8, 8)
    vals = [refs.rnd(r.choice([-1, 1]) * r.uniform(1, 2) * 2.0 ** r.randint(lo, hi), fmt) for _ in range(n)]
    return (sp + vals)[:n]


def hb(vals):
    return [refs.f16_bits(v) for v in vals]


def same_h(g, w):
    nan = lambda b: (b & 0x7FFF) > 0x7C00
    return nan(g) if nan(w) else g == w


@case("f16")
def half_scalar(t):
    n = 64
    r = rng(18)
    a, b, c = half_pool(r, n), half_pool(r, n)[::-1], half_pool(r, n, specials=False)
    out = t.zeros("H", n * 8)
    t.launch("half_scalar", [1], [n], [t.ptr(t.upload("H", hb(a))), t.ptr(t.upload("H", hb(b))), t.ptr(t.upload("H", hb(c))), t.ptr(out), t.i32(n)])
    got = t.read(out, "H", n * 8)
    F = "f16"
    names = ["__hadd", "__hsub", "__hmul", "__hfma", "__hneg", "__habs", "x*y+z (mul, add or fused)", "__hlt select"]
    want = []
    for x, y, z in zip(a, b, c):
        want += [hb([refs.add(x, y, F)])[0], hb([refs.sub(x, y, F)])[0], hb([refs.mul(x, y, F)])[0], hb([refs.fma(x, y, z, F)])[0],
                 refs.f16_bits(x) ^ 0x8000, refs.f16_bits(y) & 0x7FFF, hb([refs.add(refs.mul(x, y, F), z, F)])[0],
                 refs.f16_bits(x if x < y else z)]
    for k, nm in enumerate(names):
        g, w = got[k::8], want[k::8]
        same = same_h
        if k == 6:  # ptxas may contract mul.f16 + add.f16 into fma
            fused = [hb([refs.fma(x, y, z, F)])[0] for x, y, z in zip(a, b, c)]
            w = [fu if same_h(gg, fu) else ww for gg, ww, fu in zip(g, w, fused)]
        if k in (4, 5):
            same = lambda gg, ww: same_h(gg, ww) or ((gg & 0x7FFF) > 0x7C00 and (ww & 0x7FFF) > 0x7C00)
        t.expect(nm, g, w, same=same, show=lambda i: f"a={a[i]!r} b={b[i]!r} c={c[i]!r}")


@case("f16")
def half_vec(t):
    n = 64
    r = rng(19)
    a, b, c = half_pool(r, 2 * n), half_pool(r, 2 * n)[::-1], half_pool(r, 2 * n, specials=False)
    out = t.zeros("H", n * 10)
    t.launch("half_vec", [1], [n], [t.ptr(t.upload("H", hb(a))), t.ptr(t.upload("H", hb(b))), t.ptr(t.upload("H", hb(c))), t.ptr(out), t.i32(n)])
    got = t.read(out, "H", n * 10)
    F = "f16"
    want = []
    for i in range(n):
        lo, hi = 2 * i, 2 * i + 1
        want += [hb([refs.add(a[lo], b[lo], F)])[0], hb([refs.add(a[hi], b[hi], F)])[0],
                 hb([refs.mul(a[lo], b[lo], F)])[0], hb([refs.mul(a[hi], b[hi], F)])[0],
                 hb([refs.fma(a[lo], b[lo], c[lo], F)])[0], hb([refs.fma(a[hi], b[hi], c[hi], F)])[0],
                 hb([refs.sub(a[lo], b[lo], F)])[0], hb([refs.sub(a[hi], b[hi], F)])[0],
                 refs.f16_bits(b[hi]), refs.f16_bits(a[lo])]
    for k, nm in enumerate(["__hadd2", "__hmul2", "__hfma2", "__hsub2", "__lowhigh2highlow"]):
        g = [got[10 * i + 2 * k + j] for i in range(n) for j in (0, 1)]
        w = [want[10 * i + 2 * k + j] for i in range(n) for j in (0, 1)]
        t.expect(nm + " (lo, hi interleaved)", g, w, same=same_h, show=lambda i: f"a={a[i]!r} b={b[i]!r} c={c[i]!r}")


@case("f16")
def half_convert(t):
    n = 64
    r = rng(20)
    f = [refs.f32(r.uniform(-1, 1) * 2.0 ** r.randint(-26, 17)) for _ in range(n - 12)] + [
        65504.0, 65520.0, -65536.0, 1e9, math.inf, math.nan, 5.9e-8, 2.98e-8, -0.0, 1.00048828125, 2049.0, -70000.0]
    f = [refs.f32(v) for v in f]
    k = [r.randrange(-100000, 100000) for _ in range(n - 3)] + [2049, 65519, -65520]
    out = t.zeros("I", n * 8)
    t.launch("half_convert", [1], [n], [t.ptr(t.upload("f", f)), t.ptr(t.upload("i", k)), t.ptr(out), t.i32(n)])
    got = t.read(out, "I", n * 8)
    want = []
    for x, kv in zip(f, k):
        h = refs.rnd(x, "f16")
        hi = refs.rnd(refs.mul(-x, 0.5), "f16")
        want += [refs.f16_bits(refs.rnd(x, "f16", m)) for m in ("rn", "rz", "ru", "rd")]
        want += [refs.f32_bits(h), refs.to_int(h, "rz") & MASK32, refs.f16_bits(refs.from_int(kv, "f16")),
                 refs.f16_bits(h) | (refs.f16_bits(hi) << 16)]
    names = ["__float2half_rn", "__float2half_rz", "__float2half_ru", "__float2half_rd", "__half2float", "__half2int_rz",
             "__int2half_rn", "__floats2half2_rn"]
    for j, nm in enumerate(names):
        if j == 4:
            same = lambda g, w: ((g & 0x7FFFFFFF) > 0x7F800000) if (w & 0x7FFFFFFF) > 0x7F800000 else g == w
        elif j == 7:
            same = lambda g, w: same_h(g & 0xFFFF, w & 0xFFFF) and same_h(g >> 16, w >> 16)
        else:
            same = same_h if j != 5 else None
        t.expect(nm, got[j::8], want[j::8], same=same, show=lambda i: f"f={f[i]!r} k={k[i]}")


def bfb(vals):
    return [refs.bf16_bits(v) for v in vals]


def bf16_fma_exact(x, y, z):
    q = Fraction(x) * Fraction(y) + Fraction(z)
    return q == 0 or Fraction(refs.round_frac(q, "f32")) == q


@case("bf16")
def bf16_scalar(t):
    n = 64
    r = rng(21)
    a, b, c = [], [], []
    while len(a) < n:  # no zeros or NaN; the f32 fma exact (the sm_70 path rounds twice otherwise)
        x, y, z = (refs.rnd(r.choice([-1, 1]) * r.uniform(1, 2) * 2.0 ** r.randint(-6, 6), "bf16") for _ in range(3))
        if bf16_fma_exact(x, y, z):
            a.append(x), b.append(y), c.append(z)
    out = t.zeros("H", n * 6)
    t.launch("bf16_scalar", [1], [n], [t.ptr(t.upload("H", bfb(a))), t.ptr(t.upload("H", bfb(b))), t.ptr(t.upload("H", bfb(c))), t.ptr(out), t.i32(n)])
    got = t.read(out, "H", n * 6)
    F = "bf16"
    want = []
    for x, y, z in zip(a, b, c):
        want += bfb([refs.add(x, y, F), refs.sub(x, y, F), refs.mul(x, y, F), refs.fma(x, y, z, F), -x, max(x, y)])
    for k, nm in enumerate(["__hadd bf16", "__hsub bf16", "__hmul bf16", "__hfma bf16", "__hneg bf16", "__hmax bf16"]):
        t.expect(nm, got[k::6], want[k::6], show=lambda i: f"a={a[i]!r} b={b[i]!r} c={c[i]!r}")


@case("bf16")
def bf16_vec(t):
    n = 32
    r = rng(22)
    a, b, c = [], [], []
    while len(a) < 2 * n:
        x, y, z = (refs.rnd(r.choice([-1, 1]) * r.uniform(1, 2) * 2.0 ** r.randint(-6, 6), "bf16") for _ in range(3))
        if bf16_fma_exact(x, y, z):
            a.append(x), b.append(y), c.append(z)
    out = t.zeros("H", n * 6)
    t.launch("bf16_vec", [1], [n], [t.ptr(t.upload("H", bfb(a))), t.ptr(t.upload("H", bfb(b))), t.ptr(t.upload("H", bfb(c))), t.ptr(out), t.i32(n)])
    got = t.read(out, "H", n * 6)
    F = "bf16"
    for k, (nm, op) in enumerate([("__hadd2 bf16", lambda x, y, z: refs.add(x, y, F)), ("__hmul2 bf16", lambda x, y, z: refs.mul(x, y, F)),
                                  ("__hfma2 bf16", lambda x, y, z: refs.fma(x, y, z, F))]):
        g = [got[6 * i + 2 * k + j] for i in range(n) for j in (0, 1)]
        w = [refs.bf16_bits(op(a[2 * i + j], b[2 * i + j], c[2 * i + j])) for i in range(n) for j in (0, 1)]
        t.expect(nm + " (lo, hi interleaved)", g, w, show=lambda i: f"a={a[i]!r} b={b[i]!r} c={c[i]!r}")


@case("bf16")
def bf16_convert(t):
    n = 48
    r = rng(23)
    f = [refs.f32(r.uniform(-1, 1) * 2.0 ** r.randint(-130, 127)) for _ in range(n - 8)] + [
        3.3895313892515355e+38, 3.4028234663852886e+38, math.inf, math.nan, 1.00390625, 1.01171875, -0.0, 1e-39]
    f = [refs.f32(v) for v in f]
    out = t.zeros("I", n * 4)
    t.launch("bf16_convert", [1], [n], [t.ptr(t.upload("f", f)), t.ptr(out), t.i32(n)])
    got = t.read(out, "I", n * 4)
    nanb = lambda b: (b & 0x7FFF) > 0x7F80
    same16 = lambda g, w: nanb(g) if nanb(w) else g == w
    want = []
    for x in f:
        rn, rz = refs.rnd(x, "bf16"), refs.rnd(x, "bf16", "rz")
        hi = refs.rnd(refs.mul(x, 3.0), "bf16")
        want += [refs.bf16_bits(rn), refs.bf16_bits(rz), refs.f32_bits(rn), refs.bf16_bits(rn) | (refs.bf16_bits(hi) << 16)]
    t.expect("__float2bfloat16", got[0::4], want[0::4], same=same16, show=lambda i: repr(f[i]))
    t.expect("__float2bfloat16_rz", got[1::4], want[1::4], same=same16, show=lambda i: repr(f[i]))
    nan32 = lambda b: (b & 0x7FFFFFFF) > 0x7F800000
    t.expect("__bfloat162float", got[2::4], want[2::4], same=lambda g, w: nan32(g) if nan32(w) else g == w, show=lambda i: repr(f[i]))
    t.expect("__floats2bfloat162_rn", got[3::4], want[3::4], same=lambda g, w: same16(g & 0xFFFF, w & 0xFFFF) and same16(g >> 16, w >> 16), show=lambda i: repr(f[i]))


# ----------------------------------------------------------------------------
# memory and module model
# ----------------------------------------------------------------------------

G_TABLE = [3, 1, 4, 1, 5, 9, 2, 6]
C_TABLE = [10, 20, 30, 40]


@case("module_vars")
def read_vars(t):
    out = t.zeros("i", 20)
    t.launch("read_vars", [1], [1], [t.ptr(t.upload("i", [3])), t.ptr(out)])
    got = t.read(out, "i", 20)
    want = [42] + [G_TABLE[(j + 3) & 7] for j in range(8)] + [0x12345678, s32(0x9ABCDEF0), 0x3FC00000] + \
           [C_TABLE[(j + 3) & 3] for j in range(4)] + [4, 9, 42, refs.f32_bits(0.25)]
    t.expect("__device__/__constant__ initialisers and stored symbol addresses", got, want)


@case("module_vars")
def use_host_vars(t):
    n = 64
    r = rng(24)
    host = [k * k - 7 for k in range(16)]
    _, size = t.write_global("c_host", "i", host)
    t.check(size == 64, f"cuModuleGetGlobal(c_host) size {size}, want 64")
    _, size = t.write_global("g_host", "i", [3])
    t.check(size == 4, f"cuModuleGetGlobal(g_host) size {size}, want 4")
    idx = [r.randrange(1 << 20) for _ in range(n)]
    out = t.zeros("i", n)
    t.launch("use_host_vars", [1], [n], [t.ptr(t.upload("i", idx)), t.ptr(out), t.i32(n)])
    t.expect("c_host[idx] * g_host + c_table[i & 3]", t.read(out, "i", n), [host[v & 15] * 3 + C_TABLE[i & 3] for i, v in enumerate(idx)])
    t.check(t.read_global("g_host", "i", 1) == [3], "g_host changed")


@case("module_vars")
def symbol_addresses(t):
    out = t.zeros("Q", 4)
    t.launch("store_addrs", [1], [1], [t.ptr(out)])
    got = t.read(out, "Q", 4)
    table, tsize = t.global_("g_table")
    scalar, _ = t.global_("g_scalar")
    t.check(tsize == 32, f"cuModuleGetGlobal(g_table) size {tsize}, want 32")
    t.expect("&g_table[3], &g_scalar, g_ptr (initialised to &g_table[2])", got[:3], [table + 12, scalar, table + 8])
    ptrs = t.upload("Q", got)
    res = t.zeros("i", 4)
    t.launch("deref", [1], [4], [t.ptr(ptrs), t.ptr(res), t.i32(4)])
    t.expect("loads through the stored addresses (incl. a generic &c_table[1])", t.read(res, "i", 4), [1, 42, 4, 20])


@case("module_vars")
def device_counter(t):
    t.launch("bump", [4], [32], [t.i32(100)])
    t.launch("bump", [4], [32], [t.i32(100)])
    t.check(t.read_global("g_counter", "I", 1) == [200], f"g_counter after two launches: {t.read_global('g_counter', 'I', 1)}, want [200]")
    m2 = t.another_module()
    t.launch("bump", [1], [64], [t.i32(50)], mod=m2)
    t.check(t.read_global("g_counter", "I", 1, mod=m2) == [50], "a second module's g_counter is its own")
    t.check(t.read_global("g_counter", "I", 1) == [200], "the first module's g_counter changed with the second's")


@case("shared_mem")
def smem_reverse(t):
    r = rng(25)
    a = [r.randrange(-1000, 1000) for _ in range(512)]
    out = t.zeros("i", 512)
    t.launch("smem_reverse", [2], [256], [t.ptr(t.upload("i", a)), t.ptr(out)])
    t.expect("reversed per block", t.read(out, "i", 512), [a[(i // 256) * 256 + 255 - i % 256] for i in range(512)])


@case("shared_mem")
def smem_dynamic(t):
    nt = 64
    a = [float(k) * 0.5 - 7 for k in range(2 * nt)]
    out, info = t.zeros("f", 2 * nt), t.zeros("I", 4)
    t.launch("smem_dynamic", [2], [nt], [t.ptr(t.upload("f", a)), t.ptr(out), t.ptr(info)], shared=2 * nt * 4)
    want = [refs.add(a[(i // nt) * nt + (i % nt + 1) % nt], 2 * a[i]) for i in range(2 * nt)]
    t.expect("dyn[(t+1)%n] + dyn[n+t]", t.read(out, "f", 2 * nt), want)
    t.expect("%dynamic_smem_size and the static histogram", t.read(info, "I", 4), [512, 17776, 512, 17776])


@case("shared_mem")
def smem_transpose(t):
    w, h = 40, 24
    a = [float(k) for k in range(w * h)]
    out = t.zeros("f", w * h)
    t.launch("smem_transpose", [3, 2], [16, 16], [t.ptr(t.upload("f", a)), t.ptr(out), t.i32(w), t.i32(h)])
    t.expect("transpose 40x24 (2-D grid and block)", t.read(out, "f", w * h), [a[(i % h) * w + i // h] for i in range(w * h)])


@case("local_mem")
def local_array(t):
    n = 64
    r = rng(26)
    sel = [r.randrange(1 << 15) for _ in range(n)]
    out = t.zeros("i", n)
    t.launch("local_array", [1], [n], [t.ptr(t.upload("i", sel)), t.ptr(out), t.i32(n)])
    want = []
    for i, s in enumerate(sel):
        arr = [k * k + i for k in range(32)]
        arr[(s >> 10) & 31] += 1000
        want.append(arr[s & 31] + arr[(s >> 5) & 31])
    t.expect("per-thread array indexed at run time", t.read(out, "i", n), want, show=lambda i: f"sel={sel[i]:#x}")


@case("local_mem")
def local_struct(t):
    n = 64
    r = rng(27)
    sel = [r.randrange(1000) for _ in range(n)]
    out = t.zeros("d", n)
    t.launch("local_struct", [1], [n], [t.ptr(t.upload("i", sel)), t.ptr(out), t.i32(n)])
    t.expect("struct in local memory", t.read(out, "d", n), [0.5 * (s % 6) + i + (s % 5 - i) for i, s in enumerate(sel)])


@case("ldg")
def ldg_loads(t):
    n = 64
    r = rng(28)
    a = [r.randrange(-(1 << 20), 1 << 20) for _ in range(n)]
    b = [float(r.randrange(-100, 100)) for _ in range(4 * n)]
    c = [r.getrandbits(64) for _ in range(n)]
    out, out4, out64 = t.zeros("i", 2 * n), t.zeros("f", 4 * n), t.zeros("Q", n)
    t.launch("ldg_loads", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("f", b)), t.ptr(t.upload("Q", c)), t.ptr(out), t.ptr(out4), t.ptr(out64), t.i32(n)])
    got = t.read(out, "i", 2 * n)
    t.expect("__ldg int * 3 (__stcg)", got[0::2], [3 * v for v in a])
    t.expect("__ldcg+__ldcs+__ldca+__ldlu+__ldcv (__stcs)", got[1::2], [sum(a[(i + k) % n] for k in range(1, 6)) for i in range(n)])
    t.expect("__ldg float4 reversed (__stwt)", t.read(out4, "f", 4 * n), [b[4 * (i // 4) + 3 - i % 4] for i in range(4 * n)])
    t.expect("__ldg u64", t.read(out64, "Q", n), [w ^ ((v & MASK32) << 32) for w, v in zip(c, a)])


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


@case("calls")
def call_noinline(t):
    n = 64
    r = rng(29)
    a, b = [r.randrange(-10000, 10000) for _ in range(n)], [r.randrange(-10000, 10000) for _ in range(n)]
    out, dout = t.zeros("i", 3 * n), t.zeros("d", n)
    t.launch("call_noinline", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("i", b)), t.ptr(out), t.ptr(dout), t.i32(n)])
    got = t.read(out, "i", 3 * n)
    t.expect("mix(a, b, i)", got[0::3], [x * 3 + y - 2 * i for i, (x, y) in enumerate(zip(a, b))])
    t.expect("struct return .x", got[1::3], [refs.f32_bits(refs.mul(1.5 * i, float(y & 7))) for i, y in enumerate(b)])
    t.expect("struct return .y", got[2::3], [x + (y & 7) for x, y in zip(a, b)])
    t.expect("struct return .z", t.read(dout, "d", n), [0.25 * y - (y & 7) for y in b])


@case("calls")
def call_recursive(t):
    n = 32
    a = list(range(16)) * 2
    out = t.zeros("i", n)
    t.launch("call_recursive", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(out), t.i32(n)])
    t.expect("fib", t.read(out, "i", n), [fib(v & 15) for v in a])


@case("calls")
def call_indirect(t):
    n = 64
    r = rng(30)
    a, b = [r.randrange(-5000, 5000) for _ in range(n)], [r.randrange(-5000, 5000) for _ in range(n)]
    out = t.zeros("i", 2 * n)
    t.launch("call_indirect", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(t.upload("i", b)), t.ptr(out), t.i32(n)])
    got = t.read(out, "i", 2 * n)
    ops = [lambda x, y: x + y, lambda x, y: x - y, lambda x, y: s32(x * y), lambda x, y: x ^ y]
    t.expect("g_ops[b & 3](a, b)", got[0::2], [ops[y & 3](x, y) for x, y in zip(a, b)])
    t.expect("(a & 1 ? op_sub : op_xor)(a, 7)", got[1::2], [x - 7 if x & 1 else x ^ 7 for x in a])


# ----------------------------------------------------------------------------
# warp
# ----------------------------------------------------------------------------

def shfl_ref(vals, mode, arg, width=32):
    """CUDA's __shfl*_sync over each warp of vals."""
    out = []
    for i, v in enumerate(vals):
        base, lane = i - i % 32, i % 32
        seg = lane - lane % width
        if mode == "idx":
            src = seg + (arg(lane) % width)
        elif mode == "up":
            src = lane - arg if lane % width >= arg else lane
        elif mode == "down":
            src = lane + arg if lane % width + arg < width else lane
        else:
            src = lane ^ arg
            if src >= seg + width:
                src = lane
        out.append(vals[base + src])
    return out


@case("warp_shfl")
def shfl_full(t):
    n = 128
    r = rng(31)
    a = [r.randrange(-(1 << 31), 1 << 31) for _ in range(n)]
    out = t.zeros("i", n * 8)
    t.launch("shfl_full", [2], [64], [t.ptr(t.upload("i", a)), t.ptr(out)])
    got = t.read(out, "i", n * 8)
    want = [shfl_ref(a, "idx", lambda l: (l * 7 + 3) & 31), shfl_ref(a, "up", 3), shfl_ref(a, "down", 5), shfl_ref(a, "xor", 0x13),
            shfl_ref(a, "idx", lambda l: l + 2, 8), shfl_ref(a, "up", 1, 16), shfl_ref(a, "down", 2, 4), shfl_ref(a, "xor", 5, 8)]
    names = ["shfl.idx (lane*7+3)", "shfl.up 3", "shfl.down 5", "shfl.bfly 0x13", "shfl.idx width 8", "shfl.up 1 width 16",
             "shfl.down 2 width 4", "shfl.bfly 5 width 8"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::8], want[k])


@case("warp_shfl")
def shfl_types(t):
    n = 64
    r = rng(32)
    d = [r.uniform(-1e10, 1e10) for _ in range(n)]
    w = [r.getrandbits(64) for _ in range(n)]
    f = [refs.f32(r.uniform(-100, 100)) for _ in range(n)]
    od, ow, of = t.zeros("d", n), t.zeros("Q", n), t.zeros("f", n)
    t.launch("shfl_types", [1], [n], [t.ptr(t.upload("d", d)), t.ptr(t.upload("Q", w)), t.ptr(t.upload("f", f)), t.ptr(od), t.ptr(ow), t.ptr(of)])
    t.expect("double shfl.bfly 1", t.read(od, "d", n), shfl_ref(d, "xor", 1))
    t.expect("u64 shfl.idx 31-lane", t.read(ow, "Q", n), shfl_ref(w, "idx", lambda l: 31 - l))
    t.expect("float shfl.down 16", t.read(of, "f", n), shfl_ref(f, "down", 16))


@case("warp_shfl")
def shfl_partial_scan(t):
    n = 64
    r = rng(33)
    a = [r.randrange(-1000, 1000) for _ in range(n)]
    out = t.zeros("i", n)
    t.launch("shfl_partial_scan", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(out)])
    want = [sum(a[i - i % 32: i + 1]) if i % 32 < 16 else -1 for i in range(n)]
    t.expect("inclusive scan by lanes 0..15 (mask 0xffff)", t.read(out, "i", n), want)


def ballot(preds):
    return sum(1 << k for k, p in enumerate(preds) if p)


@case("warp_vote")
def vote(t):
    nb, bs = 2, 48
    r = rng(34)
    a = [r.randrange(-50, 50) for _ in range(nb * bs)]
    a[5], a[60] = 7, -200
    out = t.zeros("I", nb * bs * 6)
    t.launch("vote", [nb], [bs], [t.ptr(t.upload("i", a)), t.ptr(out)])
    got = t.read(out, "I", nb * bs * 6)
    want = []
    for i in range(nb * bs):
        b, tt = divmod(i, bs)
        w0 = b * bs + (tt // 32) * 32
        lanes = a[w0: min(w0 + 32, (b + 1) * bs)]
        v = a[i]
        odd = [x & 1 for x in lanes]
        want += [(1 << len(lanes)) - 1, ballot(x > 0 for x in lanes), int(all(x > -100 for x in lanes)), int(all(x > 0 for x in lanes)),
                 int(any(x == 7 for x in lanes)), ballot(o and x > 5 for o, x in zip(odd, lanes)) if v & 1 else 0xDEADBEEF]
    names = ["__activemask (48-thread blocks)", "__ballot_sync", "__all_sync (true)", "__all_sync", "__any_sync", "__ballot_sync in a divergent branch"]
    for k, nm in enumerate(names):
        same = (lambda g, w: (g != 0) == (w != 0)) if k in (2, 3, 4) else None
        t.expect(nm, got[k::6], want[k::6], same=same)


@case("warp_vote")
def match(t):
    n = 64
    r = rng(35)
    keys = [0x100 | r.randrange(4) for _ in range(32)] + [r.choice([0x100, 0x101, 0x7]) for _ in range(32)]
    wide = [(r.randrange(3) << 32) | (k & 1) for k in keys]
    out = t.zeros("I", n * 5)
    t.launch("match", [1], [n], [t.ptr(t.upload("i", keys)), t.ptr(t.upload("Q", wide)), t.ptr(out)])
    got = t.read(out, "I", n * 5)
    want = []
    for i in range(n):
        w0 = i - i % 32
        ks, ws = keys[w0: w0 + 32], wide[w0: w0 + 32]
        allbit = len({k & 0x100 for k in ks}) == 1
        allk = len(set(ks)) == 1
        want += [ballot(k == keys[i] for k in ks), MASK32 if allbit else 0, int(allbit), (MASK32 if allk else 0) | int(allk),
                 ballot(x == wide[i] for x in ws)]
    names = ["__match_any_sync b32", "__match_all_sync (k & 0x100)", "__match_all_sync pred", "__match_all_sync (k) | pred", "__match_any_sync b64"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::5], want[k::5])


@case("warp_vote", min_arch=80)
def redux(t):
    n = 64
    r = rng(36)
    a = [r.randrange(-(1 << 31), 1 << 31) >> r.randrange(31) for _ in range(n)]
    out = t.zeros("I", n * 7)
    t.launch("redux", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(out)])
    got = t.read(out, "I", n * 7)
    want = []
    for i in range(n):
        w = a[i - i % 32: i - i % 32 + 32]
        u = [x & MASK32 for x in w]
        andv, orv, xorv = MASK32, 0, 0
        for x in u:
            andv, orv, xorv = andv & x, orv | x, xorv ^ x
        want += [sum(u) & MASK32, min(w) & MASK32, max(w) & MASK32, min(u), andv, orv ^ xorv,
                 sum(u[:16]) & MASK32 if i % 32 < 16 else 0xDEADBEEF]
    names = ["redux.sync.add", "redux.sync.min.s32", "redux.sync.max.s32", "redux.sync.min.u32", "redux.sync.and", "redux.sync.or ^ xor", "redux.sync.add mask 0xffff"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::7], want[k::7])


@case("warp_syncwarp")
def syncwarp_reduce(t):
    r = rng(37)
    a = [r.randrange(-1000, 1000) for _ in range(256)]
    out = t.zeros("i", 8)
    t.launch("syncwarp_reduce", [2], [128], [t.ptr(t.upload("i", a)), t.ptr(out)])
    t.expect("per-warp sums through shared memory and __syncwarp", t.read(out, "i", 8), [sum(a[32 * w: 32 * w + 32]) for w in range(8)])


@case("warp_syncwarp")
def syncwarp_partial(t):
    r = rng(38)
    a = [r.randrange(-1000, 1000) for _ in range(64)]
    out = t.zeros("i", 64)
    t.launch("syncwarp_partial", [1], [64], [t.ptr(t.upload("i", a)), t.ptr(out)])
    want = [sum(a[i - i % 32: i - i % 32 + 16]) if i % 32 < 16 else -a[i] for i in range(64)]
    t.expect("lanes 0..15 reduce with __syncwarp(0xffff)", t.read(out, "i", 64), want)


@case("assert")
def assert_not_firing(t):
    n = 64
    a = [k for k in range(n) if k != 13] + [99]
    out = t.zeros("i", n)
    t.launch("check_not_13", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(out), t.i32(n)])
    t.expect("out = 2 * in", t.read(out, "i", n), [2 * v for v in a])


@case("assert", sticky=True)
def assert_firing(t):
    n = 64
    a = list(range(n))  # in[13] == 13
    out = t.zeros("i", n)
    e = t.try_launch("check_not_13", [1], [n], [t.ptr(t.upload("i", a)), t.ptr(out), t.i32(n)])
    t.check(e is not None, "the launch and synchronize succeeded; wanted CUDA_ERROR_ASSERT (710)")
    t.check(e.code == 710, f"wanted CUDA_ERROR_ASSERT (710) from the launch or synchronize, got {e}")


# ----------------------------------------------------------------------------
# atomics
# ----------------------------------------------------------------------------

@case("atomics")
def atomics_global(t):
    n = 50
    I32_MAX, I32_MIN = (1 << 31) - 1, -(1 << 31)
    s32i = t.upload("i", [0, 0, I32_MAX, I32_MIN])
    u = t.upload("I", [MASK32, 0, MASK32, 0, 0, 0, 0, 12345])
    w = t.upload("Q", [0, MASK64, 0, (1 << 63) - 1, 0, 0, MASK64])
    f, d = t.upload("f", [0.0, 0.0]), t.upload("d", [0.0])
    olds = t.zeros("I", 2 * n)
    t.launch("atomics_global", [2], [32], [t.ptr(s32i), t.ptr(u), t.ptr(w), t.ptr(f), t.ptr(d), t.ptr(olds), t.i32(n)])
    ts = range(n)
    g = t.read(s32i, "i", 4)
    t.expect("atomicAdd (red) s32, atomicAdd count, atomicMin s32, atomicMax s32", g,
             [sum(ts), n, min(1000 - 37 * x for x in ts), max(13 * x - 500 for x in ts)])
    o = t.read(olds, "I", 2 * n)
    t.check(sorted(o[:n]) == list(ts), f"atomicAdd's old values are not a permutation of 0..{n - 1}: {o[:n]}")
    gu = t.read(u, "I", 8)
    xor = 0
    for x in ts:
        xor ^= 1 << (x & 31)
    t.expect("u32 min, max, and, or, xor, inc(9), dec(9)", gu[:7],
             [min((x * 2654435761) & MASK32 for x in ts), max((x * 2654435761) & MASK32 for x in ts), MASK32 & ~((1 << 29) - 1),
              (1 << 27) - 1, xor, n % 10, (-n) % 10])
    t.check(sorted(o[n:] + [gu[7]]) == sorted(list(ts) + [12345]), f"atomicExch: old values {o[n:]} and final {gu[7]}")
    gw = t.read(w, "Q", 7)
    x64, and64 = 0, MASK64
    for x in ts:
        x64 ^= (x * 0x9E3779B97F4A7C15) & MASK64
        and64 &= ~(1 << ((x * 3) & 63)) & MASK64
    t.expect("u64 add, min, max, s64 min, or, xor, and", gw,
             [sum(x << 33 for x in ts) & MASK64, min(x * 0x100000001 + 5 for x in ts), max(x * 0x100000001 for x in ts),
              min((x - 40) * 0x10000000 for x in ts) & MASK64, sum(1 << x for x in ts), x64, and64])
    t.expect("f32 atomicAdd, atomicExch", t.read(f, "f", 2), [sum((x & 7) * 0.25 for x in ts), 2.5])
    t.expect("f64 atomicAdd", t.read(d, "d", 1), [sum(x * 0.5 for x in ts)])


@case("atomics")
def atomics_cas(t):
    n = 64
    r = rng(39)
    a = [refs.f32(r.uniform(-1000, 1000)) for _ in range(n)]
    fm, ds = t.upload("I", [0xFF800000]), t.upload("Q", [0])
    t.launch("atomics_cas", [2], [32], [t.ptr(t.upload("f", a)), t.ptr(fm), t.ptr(ds), t.i32(n)])
    t.expect("float max by 32-bit CAS", t.read(fm, "I", 1), [refs.f32_bits(max(a))])
    t.expect("double sum by 64-bit CAS", t.read(ds, "d", 1), [float(n * (n + 1) // 2)])


@case("atomics")
def atomics_shared(t):
    r = rng(40)
    a = [r.randrange(-1000, 1000) for _ in range(512)]
    out = t.zeros("i", 16)
    t.launch("atomics_shared", [2], [256], [t.ptr(t.upload("i", a)), t.ptr(out)])
    want = []
    for b in range(2):
        v = a[256 * b: 256 * b + 256]
        andv = -1
        for tt, x in enumerate(v):
            andv &= ~(1 << (tt & 31)) | (x & 1)
        want += [sum(v), -sum(v), min(v), max(v), s32(andv), sum(x & 15 for x in v), 256 % 100, 77]
    t.expect("shared add, sub, min, max, and, CAS loop, inc(99), exch", t.read(out, "i", 16), want)


@case("atomics")
def atomics_scoped(t):
    n = 64
    c, c64 = t.zeros("I", 5), t.zeros("Q", 1)
    t.launch("atomics_scoped", [2], [32], [t.ptr(c), t.ptr(c64), t.i32(n)])
    t.expect("atomicAdd_block, atomicAdd_system, atomicMax_block, atomicOr_system, atomicCAS_block", t.read(c, "I", 5),
             [n, 2 * n, n - 1, MASK32, 7])
    t.expect("atomicAdd_system u64", t.read(c64, "Q", 1), [3 * n])


@case("atomics_half")
def atomics_half(t):
    n = 64
    h2, h, b2 = t.zeros("H", 2), t.zeros("H", 1), t.zeros("H", 2)
    t.launch("atomics_half", [2], [32], [t.ptr(h2), t.ptr(h), t.ptr(b2), t.i32(n)])
    t.expect("__half2 atomicAdd", t.read(h2, "H", 2), [refs.f16_bits(32.0), refs.f16_bits(24.0)])
    t.expect("__half atomicAdd", t.read(h, "H", 1), [refs.f16_bits(64.0)])
    t.expect("__nv_bfloat162 atomicAdd", t.read(b2, "H", 2), [refs.bf16_bits(64.0), refs.bf16_bits(32.0)])


@case("cuda_atomic")
def atomic_ref_ops(t):
    n = 64
    cells, wide, olds = t.upload("i", [0, -1, 5555, 0]), t.zeros("Q", 2), t.zeros("i", n)
    t.launch("atomic_ref_ops", [2], [32], [t.ptr(cells), t.ptr(wide), t.ptr(olds), t.i32(n)])
    c = t.read(cells, "i", 4)
    o = t.read(olds, "i", n)
    t.expect("fetch_add, fetch_max", c[:2], [sum(range(n)), max(x * 7 % 101 for x in range(n))])
    t.check(sorted(o + [c[2]]) == sorted(list(range(n)) + [5555]), f"exchange: old values {o} and final {c[2]}")
    t.check(1000 <= c[3] < 1000 + n, f"compare_exchange_strong from 0: final {c[3]}, want one thread's 1000+t")
    t.expect("fetch_add (system scope), fetch_or (block scope)", t.read(wide, "Q", 2), [n << 32, (1 << n) - 1])


# ----------------------------------------------------------------------------
# block synchronisation
# ----------------------------------------------------------------------------

@case("block_sync")
def bar_red(t):
    r = rng(41)
    a = [r.randrange(-4, 50) for _ in range(256)]
    a[17], a[128 + 3] = 42, -10
    a = [x if x != 42 or i == 17 else 41 for i, x in enumerate(a)]
    out = t.zeros("i", 6)
    t.launch("bar_red", [2], [128], [t.ptr(t.upload("i", a)), t.ptr(out)])
    got = t.read(out, "i", 6)
    want = []
    for b in range(2):
        v = a[128 * b: 128 * b + 128]
        want += [sum(x > 0 for x in v), int(all(x > -5 for x in v)), int(any(x == 42 for x in v))]
    t.expect("__syncthreads_count", got[0::3], want[0::3])
    t.expect("__syncthreads_and", [g != 0 for g in got[1::3]], [w != 0 for w in want[1::3]])
    t.expect("__syncthreads_or", [g != 0 for g in got[2::3]], [w != 0 for w in want[2::3]])


@case("block_sync")
def block_tree_sum(t):
    r = rng(42)
    a = [r.randrange(-1000, 1000) for _ in range(512)]
    out = t.zeros("i", 2)
    t.launch("block_tree_sum", [2], [256], [t.ptr(t.upload("i", a)), t.ptr(out)])
    t.expect("tree sums", t.read(out, "i", 2), [sum(a[:256]), sum(a[256:])])


@case("block_sync")
def named_barriers(t):
    a = list(range(100, 228))
    out = t.zeros("i", 128)
    t.launch("named_barriers", [1], [128], [t.ptr(t.upload("i", a)), t.ptr(out)])
    t.expect("bar.sync 1, 64 / bar.sync 2, 64", t.read(out, "i", 128), [3 * a[i ^ 32] for i in range(128)])


@case("block_sync")
def producer_consumer(t):
    a = [k * 3 - 50 for k in range(64)]
    out = t.zeros("i", 64)
    t.launch("producer_consumer", [1], [128], [t.ptr(t.upload("i", a)), t.ptr(out)])
    t.expect("bar.arrive 3, 128 / bar.sync 3, 128", t.read(out, "i", 64), [a[63 - j] * 5 + 1 for j in range(64)])


# ----------------------------------------------------------------------------
# cooperative groups and cross-warp waiting
# ----------------------------------------------------------------------------

@case("coop_groups")
def cg_grid_stride(t):
    n = 1000
    a = [k * 0.5 for k in range(n)]
    out, info = t.zeros("f", n), t.zeros("Q", 3)
    t.launch("cg_grid_stride", [3], [64], [t.ptr(t.upload("f", a)), t.ptr(out), t.u64(n), t.ptr(info)])
    t.expect("grid-stride loop over this_grid() ranks", t.read(out, "f", n), [x * 2 + 1 for x in a])
    t.expect("grid size, num_blocks, dim_blocks.x", t.read(info, "Q", 3), [192, 3, 3])


@case("coop_groups")
def cg_block(t):
    out = t.zeros("I", 64 * 5)
    t.launch("cg_block", [2], [8, 4], [t.ptr(out)])
    want = []
    for b in range(2):
        for rnk in range(32):
            x, y = rnk % 8, rnk // 8
            want += [rnk, 32, b, x + 100 * y, 8004]
    got = t.read(out, "I", 64 * 5)
    for k, nm in enumerate(["thread_rank", "size", "group_index.x", "thread_index", "dim_threads"]):
        t.expect(nm, got[k::5], want[k::5])


@case("coop_groups")
def cg_tiles(t):
    n = 128
    r = rng(43)
    a = [r.randrange(-40, 40) for _ in range(n)]
    a[9] = 3
    out = t.zeros("i", n * 7)
    t.launch("cg_tiles", [2], [64], [t.ptr(t.upload("i", a)), t.ptr(out)])
    got = t.read(out, "i", n * 7)
    want = []
    for i in range(n):
        w32, w8 = a[i - i % 32: i - i % 32 + 32], a[i - i % 8: i - i % 8 + 8]
        tid = i % 64
        want += [sum(w32) if i % 32 == 0 else 0, sum(w8) if i % 8 == 0 else 0, sum(w32), max(w8), (tid // 8) * 100 + tid % 8,
                 s32(ballot(x > 0 for x in w32)), int(any(x == 3 for x in w8)) + 2 * int(all(x > -50 for x in w8))]
    names = ["tile<32> shfl_down sum", "tile<8> shfl_down sum", "cg::reduce plus (tile<32>)", "cg::reduce greater (tile<8>)",
             "tile<8> meta_group_rank/thread_rank", "tile<32> ballot", "tile<8> any + 2*all"]
    for k, nm in enumerate(names):
        t.expect(nm, got[k::7], want[k::7])


@case("spin_wait")
def spin_shared_flag(t):
    out = t.zeros("i", 32)
    t.launch("spin_shared_flag", [1], [64], [t.ptr(out)])
    t.expect("warp 1 waits for warp 0's release store", t.read(out, "i", 32), [(31 - l) ** 2 + 7 for l in range(32)])


@case("spin_wait")
def spin_pingpong(t):
    flags, data, out = t.zeros("I", 2), t.zeros("i", 2), t.zeros("i", 64)
    t.launch("spin_pingpong", [1], [64], [t.ptr(flags), t.ptr(data), t.ptr(out)])
    t.expect("ping-pong between warps in global memory", t.read(out, "i", 64), [99 - l for l in range(32)] + [100 + l for l in range(32)])


# ----------------------------------------------------------------------------
# special registers
# ----------------------------------------------------------------------------

@case("sregs")
def sregs(t):
    n = 128
    out = t.zeros("I", n * 12)
    t.launch("sregs", [2], [64], [t.ptr(out)], shared=256)
    g = t.read(out, "I", n * 12)
    col = lambda k: g[k::12]
    lanes = [i % 32 for i in range(n)]
    t.expect("%laneid", col(0), lanes)
    t.check(all(1 <= nw for nw in col(2)) and all(w < nw for w, nw in zip(col(1), col(2))), f"%warpid < %nwarpid: {set(zip(col(1), col(2)))}")
    t.check(all(1 <= ns for ns in col(4)) and all(s < ns for s, ns in zip(col(3), col(4))), f"%smid < %nsmid: {set(zip(col(3), col(4)))}")
    t.expect("%lanemask_eq", col(5), [1 << l for l in lanes])
    t.expect("%lanemask_lt", col(6), [(1 << l) - 1 for l in lanes])
    t.expect("%lanemask_le", col(7), [(1 << (l + 1)) - 1 for l in lanes])
    t.expect("%lanemask_gt", col(8), [MASK32 & ~((1 << (l + 1)) - 1) for l in lanes])
    t.expect("%lanemask_ge", col(9), [MASK32 & ~((1 << l) - 1) for l in lanes])
    t.expect("%dynamic_smem_size", col(10), [256] * n)
    t.check(all(v >= 256 for v in col(11)), f"%total_smem_size < the dynamic 256 bytes: {set(col(11))}")


@case("sregs")
def timers(t):
    r = rng(44)
    a = [r.randrange(-100, 100) for _ in range(16)]
    iters = 1000
    out = t.zeros("Q", 32 * 5)
    t.launch("timers", [1], [32], [t.ptr(t.upload("i", a)), t.ptr(out), t.i32(iters)])
    g = t.read(out, "Q", 32 * 5)
    acc = 0
    for k in range(iters):
        acc = s32(acc * 31 + a[k & 15])
    t.check(all(g[5 * i] <= g[5 * i + 1] for i in range(32)), f"clock64 went back: {[(g[5 * i], g[5 * i + 1]) for i in range(2)]}")
    t.check(all(g[5 * i + 2] <= g[5 * i + 3] for i in range(32)), f"%globaltimer went back: {[(g[5 * i + 2], g[5 * i + 3]) for i in range(2)]}")
    t.check(all(g[5 * i + 2] > 0 for i in range(32)), "%globaltimer reads 0")
    t.expect("the loop's result", [v & MASK32 for v in g[4::5]], [acc & MASK32] * 32)


@case("sm90_cluster", min_arch=90, refused=r"CUDA_ERROR_INVALID_PTX.*clusters of more than one CTA")
def cluster_pairs(t):
    a = [k * 7 % 1000 for k in range(256)]
    out = t.zeros("i", 256)
    t.launch("cluster_pairs", [4], [64], [t.ptr(t.upload("i", a)), t.ptr(out)])
    want = [a[((i // 64) ^ 1) * 64 + 63 - i % 64] * 10 + (i // 64) % 2 + 200 for i in range(256)]
    t.expect("peer block's shared memory through map_shared_rank", t.read(out, "i", 256), want)


# ----------------------------------------------------------------------------
# warp-level matrix instructions (mma.sync, ldmatrix, stmatrix)
# ----------------------------------------------------------------------------
# Operands are small integers (and halves), so every product and sum is exact
# in the accumulator type and the comparison is bit for bit whatever order a
# device sums in.

def matmul(a, b, c, m, n, k):
    return [sum(a[i * k + x] * b[x * n + j] for x in range(k)) + c[i * n + j] for i in range(m) for j in range(n)]


def bf16_bits(v):
    return struct.unpack("<I", struct.pack("<f", v))[0] >> 16


def small(r, count, lo=-8, hi=8, halves=False):
    return [r.randrange(lo * 2, hi * 2 + 1) / 2 if halves else r.randrange(lo, hi + 1) for _ in range(count)]


@case("mma", min_arch=80)
def mma_f16_bf16(t):
    r = rng(81)
    a, b, c = small(r, 256, halves=True), small(r, 128, halves=True), small(r, 128, -100, 100)
    want = matmul(a, b, c, 16, 8, 16)
    for kernel, bits in (("mma_f16", hb), ("mma_bf16", lambda v: [bf16_bits(x) for x in v])):
        d = t.zeros("f", 128)
        t.launch(kernel, [1], [32], [t.ptr(t.upload("H", bits(a))), t.ptr(t.upload("H", bits(b))), t.ptr(t.upload("f", c)), t.ptr(d)])
        t.expect(f"{kernel}: m16n8k16 D = A x B + C", t.read(d, "f", 128), want)


@case("mma", min_arch=80)
def mma_f16_k8(t):
    r = rng(82)
    a, b, c = small(r, 128), small(r, 64), small(r, 128, -100, 100)
    d = t.zeros("f", 128)
    t.launch("mma_f16_k8", [1], [32], [t.ptr(t.upload("H", hb(a))), t.ptr(t.upload("H", hb(b))), t.ptr(t.upload("f", c)), t.ptr(d)])
    t.expect("m16n8k8 f16 D = A x B + C", t.read(d, "f", 128), matmul(a, b, c, 16, 8, 8))


@case("mma", min_arch=80)
def mma_ldmatrix(t):
    r = rng(83)
    a, b, c = small(r, 256, -4, 4), small(r, 128, -4, 4), small(r, 128, -50, 50)
    want = matmul(a, b, c, 16, 8, 16)
    d, df = t.zeros("H", 128), t.zeros("f", 128)
    t.launch("mma_ldmatrix", [1], [32], [t.ptr(t.upload("H", hb(a))), t.ptr(t.upload("H", hb(b))), t.ptr(t.upload("H", hb(c))), t.ptr(d), t.ptr(df)])
    how = "stmatrix" if t.arch >= 90 else "fragment stores"
    t.expect(f"ldmatrix .x4 / .x2.trans, f16 accumulators, {how}", t.read(d, "H", 128), hb(want))
    t.expect("ldmatrix .x2 of B's transpose, f32 accumulators", t.read(df, "f", 128), matmul(a, b, [0] * 128, 16, 8, 16))


def tf32_rna(v):
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    if bits & 0x7F800000 == 0x7F800000:
        return bits if bits & 0x7FFFFF == 0 else (bits & ~0x1FFF) | 0x400000
    return (bits + 0x1000) & ~0x1FFF & MASK32


@case("mma", min_arch=80)
def mma_tf32(t):
    r = rng(84)
    a, b, c = small(r, 128, halves=True), small(r, 64, halves=True), small(r, 128, -100, 100)
    x = [refs.f32(r.uniform(-1e6, 1e6)) for _ in range(48)] + [refs.f32(v) for v in (1 + 2 ** -11, 1 + 3 * 2 ** -12, -(1 + 2 ** -11), 3.4028234e38, 1e-40, 0.0, -0.0, 1.0)]
    x += [math.inf, -math.inf, math.nan] + [refs.f32(1 + k * 2 ** -23) for k in range(5)]
    d, xr = t.zeros("f", 128), t.zeros("I", 64)
    t.launch("mma_tf32", [1], [32], [t.ptr(t.upload("f", a)), t.ptr(t.upload("f", b)), t.ptr(t.upload("f", c)), t.ptr(d), t.ptr(t.upload("f", x)), t.ptr(xr)])
    t.expect("m16n8k8 tf32 D = A x B + C", t.read(d, "f", 128), matmul(a, b, c, 16, 8, 8))
    got = t.read(xr, "I", 64)
    want = [tf32_rna(v) for v in x]
    nan = lambda w: (w & 0x7F800000) == 0x7F800000 and (w & 0x7FFFFF) != 0
    t.expect("cvt.rna.tf32.f32", got, want, same=lambda g, w: g == w or (nan(g) and nan(w)), show=lambda i: f"x={x[i]!r}")


@case("mma", min_arch=80)
def mma_s8(t):
    r = rng(85)
    a, b = small(r, 512, -128, 127), small(r, 256, -128, 127)
    c = small(r, 128, -1000, 1000)
    # Row 3 of C sits near the top of the s32 range: the plain form wraps,
    # .satfinite clamps.
    for j in range(8):
        c[3 * 8 + j] = 2 ** 31 - 100 - j
    exact = matmul(a, b, c, 16, 8, 32)
    d, ds = t.zeros("i", 128), t.zeros("i", 128)
    sb = lambda v: [x & 0xFF for x in v]
    t.launch("mma_s8", [1], [32], [t.ptr(t.upload("B", sb(a))), t.ptr(t.upload("B", sb(b))), t.ptr(t.upload("i", c)), t.ptr(d), t.ptr(ds)])
    t.expect("m16n8k32 s8 D = A x B + C, wrapping", t.read(d, "i", 128), [s32(v & MASK32) for v in exact])
    t.expect("m16n8k32 s8 .satfinite", t.read(ds, "i", 128), [max(-(2 ** 31), min(2 ** 31 - 1, v)) for v in exact])
    t.check(any(v > 2 ** 31 - 1 for v in exact), "the saturating row does not overflow: the check would not tell the forms apart")


def e4m3_value(byte):
    s = -1 if byte & 0x80 else 1
    e, m = (byte >> 3) & 0xF, byte & 7
    return s * (m / 8 * 2 ** -6 if e == 0 else (1 + m / 8) * 2 ** (e - 7))


@case("mma", min_arch=90)
def mma_e4m3(t):
    r = rng(86)
    # Bytes whose values are multiples of 1/8 up to 8: exact sums in f32.
    pool = [v for v in range(256) if (v & 0x7F) != 0x7F and abs(e4m3_value(v)) <= 8 and (e4m3_value(v) * 8).is_integer()]
    a, b = [r.choice(pool) for _ in range(512)], [r.choice(pool) for _ in range(256)]
    c = small(r, 128, -100, 100)
    want = matmul([e4m3_value(v) for v in a], [e4m3_value(v) for v in b], c, 16, 8, 32)
    d = t.zeros("f", 128)
    t.launch("mma_e4m3", [1], [32], [t.ptr(t.upload("B", a)), t.ptr(t.upload("B", b)), t.ptr(t.upload("f", c)), t.ptr(d)])
    t.expect("m16n8k32 e4m3 D = A x B + C", t.read(d, "f", 128), want)


@case("mma", min_arch=80)
def mma_f64(t):
    r = rng(87)
    a, b, c = [r.uniform(-10, 10) for _ in range(32)], [r.uniform(-10, 10) for _ in range(32)], [r.uniform(-10, 10) for _ in range(64)]
    d = t.zeros("d", 64)
    t.launch("mma_f64", [1], [32], [t.ptr(t.upload("d", a)), t.ptr(t.upload("d", b)), t.ptr(t.upload("d", c)), t.ptr(d)])
    terms = [[a[i * 4 + x] * b[x * 8 + j] for x in range(4)] + [c[i * 8 + j]] for i in range(8) for j in range(8)]
    want = [math.fsum(ts) for ts in terms]
    # The dot product's error bound: 5 terms, each sum rounded once.
    bound = [8 * 2 ** -53 * sum(abs(x) for x in ts) for ts in terms]
    got = t.read(d, "d", 64)
    t.expect("m8n8k4 f64 D = A x B + C (within the dot product's rounding bound)", [abs(g - w) <= e for g, w, e in zip(got, want, bound)], [True] * 64,
             show=lambda i: f"got {got[i]!r}, exact {want[i]!r}")


# The WMMA API (mma.h). Memory layouts: `rm(m, rows, cols, ld)` places a
# row-major matrix in a buffer whose rows are `ld` wide, `cm` a column-major
# one whose columns are `ld` tall; the filler around the tile must not leak in.

def rm(m, rows, cols, ld, fill=99):
    out = [fill] * (rows * ld)
    for i in range(rows):
        for j in range(cols):
            out[i * ld + j] = m[i * cols + j]
    return out


def cm(m, rows, cols, ld, fill=99):
    out = [fill] * (cols * ld)
    for i in range(rows):
        for j in range(cols):
            out[j * ld + i] = m[i * cols + j]
    return out


@case("wmma", min_arch=70)
def wmma_f16(t):
    r = rng(91)
    a, b, c = small(r, 256, halves=True), small(r, 256, halves=True), small(r, 256, -100, 100)
    d = t.zeros("f", 256)
    t.launch("wmma_f16", [1], [32], [t.ptr(t.upload("H", hb(rm(a, 16, 16, 24)))), t.ptr(t.upload("H", hb(cm(b, 16, 16, 20)))), t.ptr(t.upload("f", c)), t.ptr(d)])
    t.expect("16x16x16 f16, A row-major (ld 24), B column-major (ld 20)", t.read(d, "f", 256), matmul(a, b, c, 16, 16, 16))


@case("wmma", min_arch=70)
def wmma_f16_acc(t):
    r = rng(92)
    a, b, c = small(r, 512, -4, 4), small(r, 128, -4, 4), small(r, 256, -50, 50)
    d = t.zeros("H", 256)
    t.launch("wmma_f16_acc", [1], [32], [t.ptr(t.upload("H", hb(a))), t.ptr(t.upload("H", hb(b))), t.ptr(t.upload("H", hb(c))), t.ptr(d)])
    want = matmul(a, b, c, 32, 8, 16)
    t.expect("32x8x16 f16 accumulators, D column-major", t.read(d, "H", 256), hb(cm(want, 32, 8, 32)))


@case("wmma", min_arch=80)
def wmma_s8(t):
    r = rng(93)
    a, b, c = small(r, 256, -128, 127), small(r, 256, -128, 127), small(r, 256, -10 ** 6, 10 ** 6)
    d = t.zeros("i", 256)
    sb = lambda v: [x & 0xFF for x in v]
    t.launch("wmma_s8", [1], [32], [t.ptr(t.upload("B", sb(a))), t.ptr(t.upload("B", sb(b))), t.ptr(t.upload("i", c)), t.ptr(d)])
    t.expect("16x16x16 s8, s32 accumulators", t.read(d, "i", 256), matmul(a, b, c, 16, 16, 16))


@case("wmma", min_arch=80)
def wmma_bf16_tf32(t):
    r = rng(94)
    a, b = small(r, 256, halves=True), small(r, 256, halves=True)
    at, bt = small(r, 128, halves=True), small(r, 128, halves=True)
    d, dt = t.zeros("f", 256), t.zeros("f", 256)
    t.launch("wmma_bf16_tf32", [1], [32], [t.ptr(t.upload("H", [bf16_bits(x) for x in a])), t.ptr(t.upload("H", [bf16_bits(x) for x in b])),
                                           t.ptr(t.upload("f", at)), t.ptr(t.upload("f", cm(bt, 8, 16, 8))), t.ptr(d), t.ptr(dt)])
    t.expect("16x16x16 bf16", t.read(d, "f", 256), matmul(a, b, [0] * 256, 16, 16, 16))
    t.expect("16x16x8 tf32, B column-major", t.read(dt, "f", 256), matmul(at, bt, [0] * 256, 16, 16, 8))


@case("wmma", min_arch=80)
def wmma_f64(t):
    r = rng(95)
    a, b, c = small(r, 32, -50, 50), small(r, 32, -50, 50), small(r, 64, -1000, 1000)
    d = t.zeros("d", 64)
    t.launch("wmma_f64", [1], [32], [t.ptr(t.upload("d", a)), t.ptr(t.upload("d", b)), t.ptr(t.upload("d", c)), t.ptr(d)])
    t.expect("8x8x4 f64", t.read(d, "d", 64), matmul(a, b, c, 8, 8, 4))


@case("coop_groups")
def cg_wide_tiles(t):
    n = 512
    r = rng(45)
    a = [r.randrange(-90, 90) for _ in range(n)]
    a[300] = 7
    out = t.zeros("i", n * 6)
    t.launch("cg_wide_tiles", [2], [256], [t.ptr(t.upload("i", a)), t.ptr(out)])
    got = t.read(out, "i", n * 6)
    want = []
    for i in range(n):
        w64, w128 = a[i - i % 64: i - i % 64 + 64], a[i - i % 128: i - i % 128 + 128]
        tid, r64 = i % 256, i % 64
        scan = sum(w64[:r64])
        want += [sum(w64), max(w128), (tid // 64) * 1000 + r64, w64[37], int(any(x == 7 for x in w128)) + 2 * int(all(x > -100 for x in w128)), scan]
    for k, nm in enumerate(["reduce over 64", "max over 128", "meta_group_rank, thread_rank", "shfl from rank 37 of 64", "any/all over 128", "exclusive_scan over 64"]):
        t.expect(nm, got[k::6], want[k::6])
