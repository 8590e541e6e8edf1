"""Host references for the NVRTC suite: exact IEEE rounding of rational
results to f16, bf16, f32 and f64 in every rounding mode, bit patterns, and
the comparisons the cases use. Python's integers and Fractions only."""

import math
import struct
from fractions import Fraction

# precision (significand bits incl. the hidden one), minimum normal exponent
FORMATS = {"f16": (11, -14), "bf16": (8, -126), "f32": (24, -126), "f64": (53, -1022)}
MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF


def max_finite(fmt):
    p, emin = FORMATS[fmt]
    emax = 1 - emin
    return Fraction((1 << p) - 1) * Fraction(2) ** (emax - p + 1)


def _exp2(e):
    return Fraction(2) ** e


def floor_log2(a):
    """floor(log2(a)) of a positive Fraction."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if _exp2(e) > a:
        e -= 1
    return e


def round_frac(q, fmt, mode="rn"):
    """The value of the rational q rounded to fmt in mode (rn, rz, ru, rd),
    as a Python float (±inf on overflow, a signed zero on underflow)."""
    p, emin = FORMATS[fmt]
    if q == 0:
        return 0.0
    neg = q < 0
    a = -q if neg else q
    e = max(floor_log2(a), emin)
    qe = e - (p - 1)
    scaled = a / _exp2(qe)
    n = scaled.numerator // scaled.denominator
    rem = scaled - n
    if rem:
        if mode == "rn":
            if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n & 1):
                n += 1
        elif mode == "ru":
            n += 0 if neg else 1
        elif mode == "rd":
            n += 1 if neg else 0
        elif mode != "rz":
            raise ValueError(mode)
    r = n * _exp2(qe)
    mf = max_finite(fmt)
    if r > mf:
        to_inf = mode == "rn" or (mode == "ru" and not neg) or (mode == "rd" and neg)
        r = None if to_inf else mf
    if r is None:
        return -math.inf if neg else math.inf
    v = float(r)
    return -v if neg else v


def sgn(x):
    return math.copysign(1.0, x) < 0


def finite(*xs):
    return all(math.isfinite(x) for x in xs)


def _zero_sum(neg_a, neg_b, both_zero, mode):
    if both_zero:
        neg = (neg_a and neg_b) or (mode == "rd" and (neg_a or neg_b))
    else:
        neg = mode == "rd"
    return -0.0 if neg else 0.0


def add(x, y, fmt="f32", mode="rn"):
    if not finite(x, y):
        return x + y
    q = Fraction(x) + Fraction(y)
    if q == 0:
        return _zero_sum(sgn(x), sgn(y), x == 0 and y == 0, mode)
    return round_frac(q, fmt, mode)


def sub(x, y, fmt="f32", mode="rn"):
    return add(x, -y, fmt, mode)


def mul(x, y, fmt="f32", mode="rn"):
    if not finite(x, y):
        return x * y
    q = Fraction(x) * Fraction(y)
    if q == 0:
        return -0.0 if sgn(x) != sgn(y) else 0.0
    r = round_frac(q, fmt, mode)
    return r


def div(x, y, fmt="f32", mode="rn"):
    if math.isnan(x) or math.isnan(y):
        return math.nan
    if y == 0:
        if x == 0:
            return math.nan
        return -math.inf if sgn(x) != sgn(y) else math.inf
    if math.isinf(x):
        if math.isinf(y):
            return math.nan
        return -math.inf if sgn(x) != sgn(y) else math.inf
    if math.isinf(y) or x == 0:
        return -0.0 if sgn(x) != sgn(y) else 0.0
    return round_frac(Fraction(x) / Fraction(y), fmt, mode)


def fma(x, y, z, fmt="f32", mode="rn"):
    if not finite(x, y, z):
        if math.isnan(x) or math.isnan(y) or math.isnan(z):
            return math.nan
        if (math.isinf(x) and y == 0) or (math.isinf(y) and x == 0):
            return math.nan
        return x * y + z  # Python's inf arithmetic
    p = Fraction(x) * Fraction(y)
    q = p + Fraction(z)
    if q == 0:
        pneg = sgn(x) != sgn(y)
        return _zero_sum(pneg, sgn(z), p == 0 and z == 0, mode)
    return round_frac(q, fmt, mode)


def _sqrt_frac(q, fmt, mode):
    """sqrt of a positive Fraction, rounded: isqrt at 2*(p+8) extra bits and
    a sticky half-step for the inexact part."""
    p, _ = FORMATS[fmt]
    e = floor_log2(q)
    k = (p + 8) - e // 2  # scale so the root has about p+8 integer bits
    s = q * _exp2(2 * k)
    n = s.numerator // s.denominator
    r = math.isqrt(n)
    exact = r * r == n and s.denominator == 1
    root = Fraction(r, 1 << k) if k >= 0 else Fraction(r * (1 << -k))
    if not exact:
        root += Fraction(1, 1 << (k + 1)) if k + 1 >= 0 else Fraction(1 << -(k + 1))
    return round_frac(root, fmt, mode)


def sqrt(x, fmt="f32", mode="rn"):
    if math.isnan(x) or x < 0:
        return math.nan
    if x == 0 or math.isinf(x):
        return x
    return _sqrt_frac(Fraction(x), fmt, mode)


def rsqrt_rn(x, fmt="f32"):
    if math.isnan(x) or x < 0:
        return math.nan
    if x == 0:
        return math.copysign(math.inf, x)
    if math.isinf(x):
        return 0.0
    return _sqrt_frac(1 / Fraction(x), fmt, "rn")


def rnd(x, fmt="f32", mode="rn"):
    """A float converted to fmt (cvt.rX.fmt.f64 and the like)."""
    if not math.isfinite(x):
        return x
    if x == 0:
        return x
    return round_frac(Fraction(x), fmt, mode)


def from_int(k, fmt="f32", mode="rn"):
    return round_frac(Fraction(k), fmt, mode) if k else 0.0


def to_int(x, mode, bits=32, signed=True):
    """cvt.rXi.{s,u}N.fM: saturating, NaN -> 0."""
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if math.isnan(x):
        return 0
    if math.isinf(x):
        return hi if x > 0 else lo
    f = Fraction(x)
    if mode == "rz":
        n = math.trunc(f)
    elif mode == "rd":
        n = math.floor(f)
    elif mode == "ru":
        n = math.ceil(f)
    else:
        n = round(f)  # half to even
    return max(lo, min(hi, n))


def integral(x, mode):
    """cvt.rXi.f32.f32 / floor, ceil, trunc, rint: keeps the sign of zero."""
    if not math.isfinite(x) or x == 0:
        return x
    n = to_int(x, mode, bits=2000)
    return float(n) if n else math.copysign(0.0, x)


def fminmax(x, y, is_max):
    if math.isnan(x):
        return y
    if math.isnan(y):
        return x
    return max(x, y) if is_max else min(x, y)


# --- bit patterns ---------------------------------------------------------

def f32_bits(x):
    if math.isnan(x):
        return 0x7FFFFFFF
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b):
    return struct.unpack("<f", struct.pack("<I", b & MASK32))[0]


def f64_bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def bits_f64(b):
    return struct.unpack("<d", struct.pack("<Q", b & MASK64))[0]


def f16_bits(x):
    if math.isnan(x):
        return 0x7FFF
    return struct.unpack("<H", struct.pack("<e", x))[0]


def bits_f16(b):
    return struct.unpack("<e", struct.pack("<H", b & 0xFFFF))[0]


def bf16_bits(x):
    if math.isnan(x):
        return 0x7FFF
    b = f32_bits(x)
    assert b & 0xFFFF == 0, f"{x} is not a bf16 value"
    return b >> 16


def bits_bf16(b):
    return bits_f32((b & 0xFFFF) << 16)


def f32(x):
    """x (a float) rounded to f32, as cvt.rn.f32.f64 does."""
    return rnd(x, "f32")


# --- comparisons ---------------------------------------------------------

def same_float(got, want, zero_sign=True):
    """Bitwise equality, any NaN matching any NaN; signed zeros equal when
    zero_sign is False."""
    if math.isnan(want):
        return math.isnan(got)
    if got == want:
        return zero_sign is False or want != 0 or sgn(got) == sgn(want)
    return False


def ulp(x, fmt="f32"):
    p, emin = FORMATS[fmt]
    a = abs(x)
    if not math.isfinite(a):
        return math.inf
    e = max(floor_log2(Fraction(a)) if a else emin, emin)
    return 2.0 ** (e - p + 1)


def within_ulps(got, want, n, fmt="f32", abs_tol=0.0):
    """|got - want| <= n ulps of the larger magnitude (or abs_tol)."""
    if math.isnan(want):
        return math.isnan(got)
    if math.isinf(want) or math.isinf(got):
        return got == want
    err = abs(got - want)
    return err <= max(n * max(ulp(want, fmt), ulp(got, fmt)), abs_tol)


def s32(v):
    v &= MASK32
    return v - (1 << 32) if v >> 31 else v


def s64(v):
    v &= MASK64
    return v - (1 << 64) if v >> 63 else v


def s8(v):
    v &= 0xFF
    return v - 256 if v >> 7 else v


def s16(v):
    v &= 0xFFFF
    return v - 65536 if v >> 15 else v


def cdiv(a, b):
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def crem(a, b):
    return a - cdiv(a, b) * b
