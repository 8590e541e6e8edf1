//! Warp-level matrix instructions: `mma.sync` (D = A × B + C over one warp's
//! register fragments) and `ldmatrix`/`stmatrix` (8×8 tiles of 16-bit
//! elements between shared memory and fragments).
//!
//! Fragment layouts follow the PTX ISA ("Matrix Fragments for mma"): with
//! `g = laneid >> 2` and `t = laneid % 4`, and `e` elements packed in each
//! 32-bit register,
//! - A (M×K, row): register `r`, element `j` is row `g + 8·(r & 1)`, column
//!   `(r >> 1)·4e + t·e + j`;
//! - B (K×N, col): register `r`, element `j` is row `r·4e + t·e + j`,
//!   column `g`;
//! - C and D (M×N): element `i` is row `g + 8·(i >> 1)`, column
//!   `2t + (i & 1)`;
//!
//! and for `.m8n8k4.f64`: A is row `g`, column `t`; B row `t`, column `g`;
//! C/D element `i` row `g`, column `2t + i`.
//!
//! Products are exact and summed in f64 (integers in i64), then rounded once
//! to the result type: at least as accurate as the tensor cores, whose
//! accumulation order the ISA leaves open.

use crate::ir::{Mma, MmaTy};
use half::{bf16, f16};

/// Elements of `ty` in one fragment register (one for 32- and 64-bit types).
pub fn per_reg(ty: MmaTy) -> u32 {
    32 / ty.bits().min(32)
}

/// Registers each lane holds of A, B and C/D for a shape and its types, or
/// why the combination is not one this device runs.
pub fn fragment_regs(m: u32, n: u32, k: u32, ab: MmaTy, cd: MmaTy) -> Result<(usize, usize, usize), String> {
    use MmaTy::*;
    let ok = matches!(
        (m, n, k, ab, cd),
        (16, 8, 8 | 16, F16, F16 | F32) | (16, 8, 8 | 16, Bf16, F32) | (16, 8, 4 | 8, Tf32, F32) | (16, 8, 16 | 32, S8 | U8, S32) | (16, 8, 32, E4m3 | E5m2, F32) | (8, 8, 4, F64, F64)
    );
    if !ok {
        return Err(format!("mma .m{m}n{n}k{k} with {} operands and {} accumulators is not supported on this device", ab.name(), cd.name()));
    }
    if ab == F64 {
        return Ok((1, 1, 2));
    }
    let e = per_reg(ab);
    let c = if cd == F16 { 2 } else { 4 };
    Ok(((k / (2 * e)) as usize, (k / (4 * e)) as usize, c))
}

/// One element of a register as a number.
fn elem(ty: MmaTy, reg: u64, j: u32) -> f64 {
    let bits = ty.bits().min(32);
    let v = if bits >= 32 { reg } else { (reg >> (j * bits)) & ((1u64 << bits) - 1) };
    match ty {
        MmaTy::F16 => f16::from_bits(v as u16).to_f64(),
        MmaTy::Bf16 => bf16::from_bits(v as u16).to_f64(),
        // The tensor cores read a .tf32 operand's sign, exponent and top 10
        // fraction bits.
        MmaTy::Tf32 => f32::from_bits(v as u32 & 0xffff_e000) as f64,
        MmaTy::F32 => f32::from_bits(v as u32) as f64,
        MmaTy::F64 => f64::from_bits(reg),
        MmaTy::S8 => v as u8 as i8 as f64,
        MmaTy::U8 => v as u8 as f64,
        MmaTy::S32 => v as u32 as i32 as f64,
        MmaTy::E4m3 => e4m3(v as u8),
        MmaTy::E5m2 => e5m2(v as u8),
    }
}

/// OCP FP8 E4M3 (no infinities; S.1111.111 is NaN).
fn e4m3(b: u8) -> f64 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 0xf && m == 7 {
        return f64::NAN;
    }
    s * if e == 0 { m as f64 / 8.0 * 2f64.powi(-6) } else { (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7) }
}

/// OCP FP8 E5M2 (IEEE-like, with infinities and NaNs).
fn e5m2(b: u8) -> f64 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 2) & 0x1f, b & 3);
    match e {
        0x1f if m == 0 => s * f64::INFINITY,
        0x1f => f64::NAN,
        0 => s * m as f64 / 4.0 * 2f64.powi(-14),
        _ => s * (1.0 + m as f64 / 4.0) * 2f64.powi(e as i32 - 15),
    }
}

/// An FP8 byte's value (E4M3 or E5M2).
pub fn from_fp8(b: u8, is_e5m2: bool) -> f64 {
    if is_e5m2 {
        e5m2(b)
    } else {
        e4m3(b)
    }
}

/// `x` rounded to the nearest FP8 value, ties to even, saturating to the
/// largest finite one (`.satfinite`; infinities too); NaN stays NaN.
pub fn to_fp8(x: f64, e5m2: bool) -> u8 {
    // Exponent bits, fraction bits, bias, and the largest finite byte.
    let (mbits, bias, max) = if e5m2 { (2i32, 15i32, 0x7bu8) } else { (3, 7, 0x7e) };
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return 0x7f;
    }
    let a = x.abs();
    let max_value = from_fp8(max, e5m2);
    if a >= max_value {
        return sign | max;
    }
    if a == 0.0 {
        return sign;
    }
    // The spacing of representable values around `a` (subnormals share the
    // smallest normal exponent's).
    let e = (a.log2().floor() as i32).max(1 - bias);
    let step = 2f64.powi(e - mbits);
    let q = a / step;
    let mut r = q.floor();
    let frac = q - r;
    if frac > 0.5 || (frac == 0.5 && r % 2.0 == 1.0) {
        r += 1.0;
    }
    let v = r * step;
    if v >= max_value {
        return sign | max;
    }
    if v == 0.0 {
        return sign;
    }
    // Encode v exactly.
    let e = (v.log2().floor() as i32).max(1 - bias);
    let m = v / 2f64.powi(e - mbits);
    let code = if m < 2f64.powi(mbits) { m as u32 } else { (((e + bias) as u32) << mbits) | (m as u32 - (1 << mbits)) };
    sign | code as u8
}

/// The `wmma` fragment layout, this device's own (the PTX ISA leaves it
/// unspecified; only this device's `wmma.load`, `wmma.mma` and `wmma.store`
/// read it): slot `s` (register `s / e`, element `s % e`) of `lane` holds
/// element `(32·s + lane) mod count` of the matrix in row-major order.
/// Fragments with more slots than elements (f16 A and B) hold them twice.
pub fn wmma_at(lane: u32, slot: u32, rows: u32, cols: u32) -> (u32, u32) {
    let i = (32 * slot + lane) % (rows * cols);
    (i / cols, i % cols)
}

/// Registers of a `wmma` fragment of a `rows`×`cols` matrix of `ty`: A or
/// B (`operand`), or C/D (the PTX ISA's counts).
pub fn wmma_regs(rows: u32, cols: u32, ty: MmaTy, operand: bool) -> u32 {
    let count = rows * cols;
    match ty {
        MmaTy::F16 if operand => 8,
        MmaTy::F16 => count / 64,
        MmaTy::Bf16 => count / 64,
        MmaTy::S8 | MmaTy::U8 | MmaTy::E4m3 | MmaTy::E5m2 => count / 128,
        _ => count / 32,
    }
}

/// (row, column) of A's register `r`, element `j`, held by `lane`.
fn a_at(op: &Mma, lane: u32, r: u32, j: u32) -> (u32, u32) {
    if op.wmma {
        return wmma_at(lane, r * per_reg(op.aty) + j, op.m, op.k);
    }
    let (g, t) = (lane >> 2, lane & 3);
    if op.aty == MmaTy::F64 {
        return (g, t);
    }
    let e = per_reg(op.aty);
    (g + 8 * (r & 1), (r >> 1) * 4 * e + t * e + j)
}

/// (row, column) of B's register `r`, element `j`, held by `lane`.
fn b_at(op: &Mma, lane: u32, r: u32, j: u32) -> (u32, u32) {
    if op.wmma {
        return wmma_at(lane, r * per_reg(op.bty) + j, op.k, op.n);
    }
    let (g, t) = (lane >> 2, lane & 3);
    if op.bty == MmaTy::F64 {
        return (t, g);
    }
    let e = per_reg(op.bty);
    (r * 4 * e + t * e + j, g)
}

/// (row, column) of C/D element `i` held by `lane`.
fn cd_at(op: &Mma, lane: u32, i: u32) -> (u32, u32) {
    if op.wmma {
        return wmma_at(lane, i, op.m, op.n);
    }
    let (g, t) = (lane >> 2, lane & 3);
    if op.m == 8 {
        return (g, 2 * t + i);
    }
    (g + 8 * (i >> 1), 2 * t + (i & 1))
}

/// Computes D for the warp. `regs(lane)` gives a lane's A, B and C
/// registers, in that order (None for a lane that is not there: exited,
/// its fragments read as zero). Returns each lane's D registers.
pub fn run(op: &Mma, regs: &dyn Fn(u32) -> Option<Vec<u64>>) -> Vec<Vec<u64>> {
    let (m, n, k) = (op.m as usize, op.n as usize, op.k as usize);
    let (na, nb, nc) = (op.a.len(), op.b.len(), op.c.len());
    let mut a = vec![0f64; m * k];
    let mut bm = vec![0f64; k * n];
    let mut c = vec![0f64; m * n];
    let (ea, eb) = (per_reg(op.aty), per_reg(op.bty));
    let per_c = if op.cty == MmaTy::F16 { 2 } else { 1 };
    for lane in 0..32u32 {
        let Some(v) = regs(lane) else { continue };
        let (va, rest) = v.split_at(na.min(v.len()));
        let (vb, vc) = rest.split_at(nb.min(rest.len()));
        for (r, &reg) in va.iter().enumerate() {
            for j in 0..ea {
                let (row, col) = a_at(op, lane, r as u32, j);
                if let Some(x) = a.get_mut(row as usize * k + col as usize) {
                    *x = elem(op.aty, reg, j);
                }
            }
        }
        for (r, &reg) in vb.iter().enumerate() {
            for j in 0..eb {
                let (row, col) = b_at(op, lane, r as u32, j);
                if let Some(x) = bm.get_mut(row as usize * n + col as usize) {
                    *x = elem(op.bty, reg, j);
                }
            }
        }
        for (r, &reg) in vc.iter().take(nc).enumerate() {
            for j in 0..per_c {
                let (row, col) = cd_at(op, lane, (r * per_c + j) as u32);
                if let Some(x) = c.get_mut(row as usize * n + col as usize) {
                    *x = elem(op.cty, reg, j as u32);
                }
            }
        }
    }
    let int = op.dty == MmaTy::S32;
    let mut d = vec![0u64; m * n];
    for i in 0..m {
        for j in 0..n {
            if int {
                // Integer products are exact in f64 (|a·b| < 2^16, K ≤ 32).
                let s: i64 = (0..k).map(|x| (a[i * k + x] * bm[x * n + j]) as i64).sum::<i64>() + c[i * n + j] as i64;
                d[i * n + j] = if op.satfinite { s.clamp(i32::MIN as i64, i32::MAX as i64) as i32 as u32 as u64 } else { s as i32 as u32 as u64 };
            } else {
                let s: f64 = (0..k).map(|x| a[i * k + x] * bm[x * n + j]).sum::<f64>() + c[i * n + j];
                d[i * n + j] = match op.dty {
                    MmaTy::F64 => s.to_bits(),
                    MmaTy::F16 => f16::from_f64(s).to_bits() as u64,
                    _ => (s as f32).to_bits() as u64,
                };
            }
        }
    }
    let nd = op.d.len();
    let per_d = if op.dty == MmaTy::F16 { 2 } else { 1 };
    (0..32u32)
        .map(|lane| {
            (0..nd)
                .map(|r| {
                    (0..per_d).fold(0u64, |acc, j| {
                        let (row, col) = cd_at(op, lane, (r * per_d + j) as u32);
                        let v = d.get(row as usize * n + col as usize).copied().unwrap_or(0);
                        if per_d == 2 {
                            acc | (v & 0xffff) << (16 * j)
                        } else {
                            v
                        }
                    })
                })
                .collect()
        })
        .collect()
}

/// `ldmatrix` / `stmatrix` `.m8n8` on 16-bit elements: lane `l` of matrix
/// `q` (of `num`) holds, in its register `q`, the two elements of row
/// `l >> 2`, columns `2·(l & 3)` and `+1` (with `.trans`, of the transposed
/// matrix), and lanes `8q..8q+7` give the addresses of matrix `q`'s rows.
/// Returns (lane whose address names the row, byte offset in that row) for
/// each element `h` (0, 1) of register `q` of `lane`.
pub fn tile_at(lane: u32, q: u32, h: u32, trans: bool) -> (u32, u32) {
    let (row, col) = (lane >> 2, 2 * (lane & 3) + h);
    let (row, col) = if trans { (col, row) } else { (row, col) };
    (8 * q + row, 2 * col)
}

impl MmaTy {
    pub fn name(self) -> &'static str {
        match self {
            MmaTy::F16 => ".f16",
            MmaTy::Bf16 => ".bf16",
            MmaTy::Tf32 => ".tf32",
            MmaTy::F32 => ".f32",
            MmaTy::F64 => ".f64",
            MmaTy::S8 => ".s8",
            MmaTy::U8 => ".u8",
            MmaTy::S32 => ".s32",
            MmaTy::E4m3 => ".e4m3",
            MmaTy::E5m2 => ".e5m2",
        }
    }
}
