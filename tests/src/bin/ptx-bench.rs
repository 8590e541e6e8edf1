//! ptx-bench: the CPU reference device's PTX interpreter against the same
//! computation written as plain scalar C on one core, in one run.
//!
//!   matrixMul   tiled 16x16 shared-memory f32 matrix multiply
//!   reduction   shared-memory tree reduction, one partial sum per block
//!   saxpy       y = a*x + y, memory-bound
//!   hash        per-thread integer LCG/xorshift loop, ALU-bound
//!
//! The kernels are the PTX files in tests/bench-kernels/, handwritten as
//! nvcc emits them; every interpreter result is checked against a host
//! reference (exit 1 on a mismatch). tests/bench-kernels/ref.c holds the
//! same computations as scalar C loops; it is built at run time with
//! `cc -O2 -fno-tree-vectorize` and reports its own timings and checksums.
//! Interpreter and C are each timed a few times; the table shows the best
//! (and the interpreter's median), and the ratio of the bests.
//!
//! Usage: ptx-bench [--quick]

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use vgpu_mediator::backend::cpu::CpuBackend;
use vgpu_mediator::backend::{AllocTable, Backend, BackendError, Launch, VolatileSlice};
use vgpu_ptx::{self as ptx, ExecError, GlobalMem, Module};
use virtio_gpu_compute::{CuResult, ImageFormat};

const MATRIX_MUL_PTX: &str = include_str!("../../bench-kernels/matrixMul.ptx");
const REDUCTION_PTX: &str = include_str!("../../bench-kernels/reduction.ptx");
const SAXPY_PTX: &str = include_str!("../../bench-kernels/saxpy.ptx");
const HASH_PTX: &str = include_str!("../../bench-kernels/hash.ptx");
const REF_C: &str = include_str!("../../bench-kernels/ref.c");

/// Flat device memory: one host buffer at `base`, handed out by a bump allocator.
struct Flat {
    base: u64,
    mem: Vec<u8>,
}

impl Flat {
    fn new() -> Flat {
        Flat { base: 0x7000_0000_0000, mem: Vec::new() }
    }

    fn alloc(&mut self, bytes: usize) -> u64 {
        let off = self.mem.len().next_multiple_of(256);
        self.mem.resize(off + bytes, 0);
        self.base + off as u64
    }

    fn range(&self, addr: u64, len: usize) -> std::ops::Range<usize> {
        let o = (addr - self.base) as usize;
        o..o + len
    }

    fn write_f32(&mut self, addr: u64, v: &[f32]) {
        let r = self.range(addr, v.len() * 4);
        for (d, x) in self.mem[r].chunks_exact_mut(4).zip(v) {
            d.copy_from_slice(&x.to_le_bytes());
        }
    }

    fn read_f32(&self, addr: u64, n: usize) -> Vec<f32> {
        self.mem[self.range(addr, n * 4)].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
    }

    fn read_u32(&self, addr: u64, n: usize) -> Vec<u32> {
        self.mem[self.range(addr, n * 4)].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
    }

    fn fill(&mut self, addr: u64, bytes: usize, v: u8) {
        let r = self.range(addr, bytes);
        self.mem[r].fill(v);
    }
}

impl GlobalMem for Flat {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let bad = ExecError::IllegalAddress { kind: "global", addr, len: out.len(), line: 0 };
        let o = addr.checked_sub(self.base).ok_or(bad.clone())? as usize;
        out.copy_from_slice(self.mem.get(o..o + out.len()).ok_or(bad)?);
        Ok(())
    }
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        let bad = ExecError::IllegalAddress { kind: "global", addr, len: data.len(), line: 0 };
        let o = addr.checked_sub(self.base).ok_or(bad.clone())? as usize;
        self.mem.get_mut(o..o + data.len()).ok_or(bad)?.copy_from_slice(data);
        Ok(())
    }
}

/// Kernel parameters packed as the ABI lays them out (natural alignment).
#[derive(Default)]
struct Params(Vec<u8>);

impl Params {
    fn push(mut self, b: &[u8]) -> Params {
        let at = self.0.len().next_multiple_of(b.len());
        self.0.resize(at, 0);
        self.0.extend_from_slice(b);
        self
    }
    fn u32(self, v: u32) -> Params {
        self.push(&v.to_le_bytes())
    }
    fn f32(self, v: f32) -> Params {
        self.push(&v.to_le_bytes())
    }
    fn ptr(self, v: u64) -> Params {
        self.push(&v.to_le_bytes())
    }
}

struct Sizes {
    matmul_n: u32,
    reduce_n: u32,
    saxpy_n: u32,
    hash_threads: u32,
    hash_iters: u32,
    reps: usize,
    c_reps: usize,
}

/// One kernel's interpreter figures.
struct Row {
    name: &'static str,
    size: String,
    times: Vec<f64>,
    /// The same launches on the CPU device with every host core.
    par_times: Vec<f64>,
    instructions: u64,
    blocks: u64,
    threads: u32,
    /// What ref.c's checksum must equal: the sum of the reference output.
    checksum: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn fail(msg: String) -> ! {
    eprintln!("ptx-bench: {msg}");
    std::process::exit(1);
}

/// Launches `kernel` `reps` times, calling `reset` (untimed) before each,
/// on the interpreter alone (one thread), then as the CPU device runs it
/// (its blocks on every host core, device memory shared between them);
/// both must leave the same bytes.
fn time_launch(src: &str, kernel: &str, cfg: ptx::LaunchConfig, params: &Params, mem: &mut Flat, reps: usize, reset: &mut dyn FnMut(&mut Flat)) -> (Vec<f64>, u64, u64, Vec<f64>) {
    let module = Module::parse(src).unwrap_or_else(|e| fail(format!("{kernel}: {e}")));
    let k = module.kernel(kernel).unwrap_or_else(|| fail(format!("{kernel}: no such kernel")));
    let mut times = Vec::new();
    let mut stats = None;
    for _ in 0..reps {
        reset(mem);
        let t = Instant::now();
        let s = ptx::launch(k, &cfg, &params.0, mem, &ptx::Limits::default()).unwrap_or_else(|e| fail(format!("{kernel}: launch failed: {e}")));
        times.push(t.elapsed().as_secs_f64());
        stats = Some(s);
    }
    let s = stats.expect("at least one repetition");

    // The CPU device's first allocation sits at the same base as Flat's.
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let size = (mem.mem.len() as u64).next_multiple_of(256);
    let dev = CpuBackend::new(0, size, 0).unwrap_or_else(|e| fail(format!("device: {e}"))).with_launch_threads(cores);
    let (base, len) = dev.alloc(0, size).unwrap_or_else(|e| fail(format!("device alloc: {}", e.msg)));
    if base != mem.base {
        fail(format!("device memory at {base:#x}, not {:#x}", mem.base));
    }
    let mut owned = AllocTable::default();
    owned.0.insert(base, len);
    let m = dev
        .load_module(0, src.as_bytes(), ImageFormat::Ptx, u64::MAX, &mut |_, _| Err(BackendError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "no module variables here")))
        .unwrap_or_else(|e| fail(format!("{kernel}: {}", e.msg)));
    let index = m.function(kernel).unwrap_or_else(|| fail(format!("{kernel}: no such kernel"))).index;
    let l = Launch { grid: cfg.grid, block: cfg.block, shared_bytes: cfg.dynamic_shared };
    let mut par_times = Vec::new();
    for _ in 0..reps {
        reset(mem);
        dev.write(0, base, VolatileSlice::from(&mut mem.mem[..])).unwrap_or_else(|e| fail(e.msg));
        let t = Instant::now();
        dev.launch(0, &*m, index, &l, &params.0, &owned).unwrap_or_else(|e| fail(format!("{kernel}: device launch failed: {}", e.msg)));
        par_times.push(t.elapsed().as_secs_f64());
    }
    let single = mem.mem.clone();
    let mut back = vec![0u8; single.len()];
    dev.read(0, base, VolatileSlice::from(&mut back[..])).unwrap_or_else(|e| fail(e.msg));
    // `reset` then the single-thread launch left `single` before; redo it.
    reset(mem);
    ptx::launch(k, &cfg, &params.0, mem, &ptx::Limits::default()).unwrap_or_else(|e| fail(format!("{kernel}: launch failed: {e}")));
    if back != mem.mem {
        fail(format!("{kernel}: the device's parallel run left different bytes from the single-thread run"));
    }
    (times, s.instructions, s.blocks, par_times)
}

fn check<T: PartialEq + std::fmt::Debug>(name: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len());
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let bad = (0..got.len()).filter(|&i| got[i] != want[i]).count();
        fail(format!("{name}: interpreter result differs from the host reference at {bad} of {} elements; first at [{i}]: got {:?}, want {:?}", got.len(), got[i], want[i]));
    }
}

// Inputs: small multiples of 1/2 and 1/4, so every sum below is exact in
// f32 whatever the order (fma or mul+add, tree or loop) and results can be
// compared bit for bit, with each other and with ref.c's.

fn matrix_mul(z: &Sizes) -> Row {
    let n = z.matmul_n;
    let w = (n * n) as usize;
    let a: Vec<f32> = (0..w).map(|i| (i % 7) as f32 * 0.5).collect();
    let b: Vec<f32> = (0..w).map(|i| (i % 5) as f32 * 0.25).collect();
    let mut mem = Flat::new();
    let (da, db, dc) = (mem.alloc(w * 4), mem.alloc(w * 4), mem.alloc(w * 4));
    mem.write_f32(da, &a);
    mem.write_f32(db, &b);
    let params = Params::default().ptr(dc).ptr(da).ptr(db).u32(n).u32(n);
    let cfg = ptx::LaunchConfig { grid: [n / 16, n / 16, 1], block: [16, 16, 1], dynamic_shared: 0 };
    let (times, instructions, blocks, par_times) = time_launch(MATRIX_MUL_PTX, "matrixMul", cfg, &params, &mut mem, z.reps, &mut |m| m.fill(dc, w * 4, 0xff));
    let n = n as usize;
    let mut want = vec![0f32; w];
    for i in 0..n {
        for j in 0..n {
            want[i * n + j] = (0..n).fold(0f32, |s, k| a[i * n + k].mul_add(b[k * n + j], s));
        }
    }
    check("matrixMul", &mem.read_f32(dc, w), &want);
    Row { name: "matrixMul", size: format!("{n}x{n} f32"), times, par_times, instructions, blocks, threads: 256, checksum: want.iter().map(|&x| x as f64).sum() }
}

fn reduction(z: &Sizes) -> Row {
    let n = z.reduce_n as usize;
    let nb = n.div_ceil(256);
    let input: Vec<f32> = (0..n).map(|i| (i % 17) as f32 * 0.25).collect();
    let mut mem = Flat::new();
    let (din, dp) = (mem.alloc(n * 4), mem.alloc(nb * 4));
    mem.write_f32(din, &input);
    let params = Params::default().ptr(din).ptr(dp).u32(n as u32);
    let cfg = ptx::LaunchConfig { grid: [nb as u32, 1, 1], block: [256, 1, 1], dynamic_shared: 0 };
    let (times, instructions, blocks, par_times) = time_launch(REDUCTION_PTX, "reduce", cfg, &params, &mut mem, z.reps, &mut |m| m.fill(dp, nb * 4, 0xff));
    let want: Vec<f32> = input.chunks(256).map(|c| c.iter().sum()).collect();
    check("reduction", &mem.read_f32(dp, nb), &want);
    Row { name: "reduction", size: format!("{n} f32"), times, par_times, instructions, blocks, threads: 256, checksum: want.iter().map(|&x| x as f64).sum() }
}

fn saxpy(z: &Sizes) -> Row {
    let n = z.saxpy_n as usize;
    let a = 2.0f32;
    let x: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.5).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.25).collect();
    let mut mem = Flat::new();
    let (dx, dy) = (mem.alloc(n * 4), mem.alloc(n * 4));
    mem.write_f32(dx, &x);
    let params = Params::default().u32(n as u32).f32(a).ptr(dx).ptr(dy);
    let cfg = ptx::LaunchConfig { grid: [n.div_ceil(256) as u32, 1, 1], block: [256, 1, 1], dynamic_shared: 0 };
    let (times, instructions, blocks, par_times) = time_launch(SAXPY_PTX, "saxpy", cfg, &params, &mut mem, z.reps, &mut |m| m.write_f32(dy, &y));
    let want: Vec<f32> = x.iter().zip(&y).map(|(&x, &y)| x.mul_add(a, y)).collect();
    check("saxpy", &mem.read_f32(dy, n), &want);
    Row { name: "saxpy", size: format!("{n} f32"), times, par_times, instructions, blocks, threads: 256, checksum: want.iter().map(|&x| x as f64).sum() }
}

fn hash(z: &Sizes) -> Row {
    let n = z.hash_threads as usize;
    let mut mem = Flat::new();
    let dout = mem.alloc(n * 4);
    let params = Params::default().ptr(dout).u32(z.hash_iters);
    let cfg = ptx::LaunchConfig { grid: [n.div_ceil(256) as u32, 1, 1], block: [256, 1, 1], dynamic_shared: 0 };
    let (times, instructions, blocks, par_times) = time_launch(HASH_PTX, "hash", cfg, &params, &mut mem, z.reps, &mut |m| m.fill(dout, n * 4, 0));
    let want: Vec<u32> = (0..n as u32)
        .map(|mut x| {
            for _ in 0..z.hash_iters {
                x = x.wrapping_mul(1664525).wrapping_add(1013904223);
                x ^= x >> 13;
                x ^= x << 7;
            }
            x
        })
        .collect();
    check("hash", &mem.read_u32(dout, n), &want);
    Row { name: "hash", size: format!("{n} thr x {} it", z.hash_iters), times, par_times, instructions, blocks, threads: 256, checksum: want.iter().map(|&x| x as f64).sum() }
}

/// C timings: name -> (best s, median s, checksum).
fn run_c(z: &Sizes) -> Vec<(String, f64, f64, f64)> {
    let dir = std::env::temp_dir().join(format!("ptx-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
    let src = dir.join("ref.c");
    let exe: PathBuf = dir.join("ref");
    std::fs::write(&src, REF_C).unwrap_or_else(|e| fail(format!("{}: {e}", src.display())));
    let cc = Command::new("cc").args(["-O2", "-fno-tree-vectorize", "-o"]).arg(&exe).arg(&src).output().unwrap_or_else(|e| fail(format!("cannot run cc: {e}")));
    if !cc.status.success() {
        fail(format!("cc failed:\n{}", String::from_utf8_lossy(&cc.stderr)));
    }
    let args = [z.matmul_n, z.reduce_n, z.saxpy_n, z.hash_threads, z.hash_iters, z.c_reps as u32].map(|v| v.to_string());
    let out = Command::new(&exe).args(&args).output().unwrap_or_else(|e| fail(format!("cannot run {}: {e}", exe.display())));
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        fail(format!("ref failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or_else(|| fail(format!("ref: bad line {l:?}")));
            (f[0].to_string(), num(1), num(2), num(3))
        })
        .collect()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let z = if quick {
        Sizes { matmul_n: 128, reduce_n: 1 << 16, saxpy_n: 1 << 18, hash_threads: 1 << 12, hash_iters: 64, reps: 2, c_reps: 3 }
    } else {
        Sizes { matmul_n: 256, reduce_n: 1 << 20, saxpy_n: 1 << 22, hash_threads: 1 << 16, hash_iters: 128, reps: 5, c_reps: 7 }
    };
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!(
        "ptx-bench{}: host cores (available_parallelism) = {cores}; interpreter on one thread, and the CPU device with its blocks on {cores} threads, best of {} launches;",
        if quick { " --quick" } else { "" },
        z.reps
    );
    println!("C reference: cc -O2 -fno-tree-vectorize, scalar, one core, best of {}", z.c_reps);

    let start = Instant::now();
    let c = run_c(&z);
    let rows = [matrix_mul(&z), reduction(&z), saxpy(&z), hash(&z)];

    println!();
    println!("{:<10} {:<18} {:>9} {:>9} {:>13} {:>9} {:>10} {:>9} {:>9} {:>8}", "kernel", "size", "interp_s", "median_s", "instructions", "M inst/s", "C_s", "interp/C", "device_s", "device/C");
    let mut bad = false;
    for r in &rows {
        let Some((_, c_best, _, c_sum)) = c.iter().find(|(n, ..)| n == r.name) else { fail(format!("ref printed no line for {}", r.name)) };
        if *c_sum != r.checksum {
            eprintln!("ptx-bench: {}: C checksum {c_sum} differs from the host reference's {}", r.name, r.checksum);
            bad = true;
        }
        let b = best(&r.times);
        println!(
            "{:<10} {:<18} {:>9.4} {:>9.4} {:>13} {:>9.1} {:>10.6} {:>9.1} {:>9.4} {:>8.1}",
            r.name,
            r.size,
            b,
            median(&r.times),
            r.instructions,
            r.instructions as f64 / b / 1e6,
            c_best,
            b / c_best,
            best(&r.par_times),
            best(&r.par_times) / c_best
        );
    }
    println!();
    let grid: Vec<String> = rows.iter().map(|r| format!("{} {} blocks x {} threads", r.name, r.blocks, r.threads)).collect();
    println!("grid-level parallelism: {}; available_parallelism() = {cores}", grid.join(", "));
    println!("total wall time {:.1} s", start.elapsed().as_secs_f64());
    if bad {
        std::process::exit(1);
    }
}
