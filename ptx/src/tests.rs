use super::*;

const VECTOR_ADD: &str = include_str!("../../samples/kernels/vectorAdd.ptx");
const SAXPY: &str = include_str!("../../samples/kernels/saxpy.ptx");
const MATRIX_MUL: &str = include_str!("../../samples/kernels/matrixMul.ptx");
const REDUCTION: &str = include_str!("../../samples/kernels/reduction.ptx");
const FAULTS: &str = include_str!("../../samples/kernels/faults.ptx");

/// Global memory made of separate allocations, like one tenant's view.
struct VecMem {
    allocs: Vec<(u64, Vec<u8>)>,
}

impl VecMem {
    fn new() -> Self {
        VecMem { allocs: Vec::new() }
    }
    fn alloc(&mut self, bytes: &[u8]) -> u64 {
        let base = 0x7000_0000_0000 + self.allocs.len() as u64 * 0x1000_0000;
        self.allocs.push((base, bytes.to_vec()));
        base
    }
    fn alloc_f32(&mut self, v: &[f32]) -> u64 {
        self.alloc(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
    }
    fn find(&mut self, addr: u64, len: usize) -> Result<&mut [u8], ExecError> {
        for (base, data) in self.allocs.iter_mut() {
            if addr >= *base && addr - *base + len as u64 <= data.len() as u64 {
                let off = (addr - *base) as usize;
                return Ok(&mut data[off..off + len]);
            }
        }
        Err(ExecError::IllegalAddress { kind: "global", addr, len, line: 0 })
    }
    fn f32s(&self, base: u64) -> Vec<f32> {
        let d = &self.allocs.iter().find(|a| a.0 == base).unwrap().1;
        d.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }
    fn bytes(&self, base: u64) -> &[u8] {
        &self.allocs.iter().find(|a| a.0 == base).unwrap().1
    }
}

impl GlobalMem for VecMem {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        out.copy_from_slice(self.find(addr, out.len())?);
        Ok(())
    }
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        self.find(addr, data.len())?.copy_from_slice(data);
        Ok(())
    }
}

struct Params(Vec<u8>);
impl Params {
    fn new() -> Self {
        Params(Vec::new())
    }
    fn put(mut self, bytes: &[u8]) -> Self {
        let a = bytes.len();
        while !self.0.len().is_multiple_of(a) {
            self.0.push(0);
        }
        self.0.extend_from_slice(bytes);
        self
    }
    fn u64(self, v: u64) -> Self {
        self.put(&v.to_le_bytes())
    }
    fn u32(self, v: u32) -> Self {
        self.put(&v.to_le_bytes())
    }
    fn f32(self, v: f32) -> Self {
        self.put(&v.to_le_bytes())
    }
}

fn cfg(grid: [u32; 3], block: [u32; 3]) -> LaunchConfig {
    LaunchConfig { grid, block, dynamic_shared: 0 }
}

#[test]
fn vector_add_matches_host() {
    let m = Module::parse(VECTOR_ADD).unwrap();
    let k = m.kernel("vectorAdd").unwrap();
    assert_eq!(k.params.iter().map(|p| (p.offset, p.size)).collect::<Vec<_>>(), vec![(0, 8), (8, 8), (16, 8), (24, 4)]);
    let n = 1000;
    let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| 1000.0 - i as f32).collect();
    let mut mem = VecMem::new();
    let (pa, pb, pc) = (mem.alloc_f32(&a), mem.alloc_f32(&b), mem.alloc_f32(&vec![0.0; n]));
    let p = Params::new().u64(pa).u64(pb).u64(pc).u32(n as u32);
    launch(k, &cfg([4, 1, 1], [256, 1, 1]), &p.0, &mut mem, &Limits::default()).unwrap();
    let c = mem.f32s(pc);
    for i in 0..n {
        assert_eq!(c[i], a[i] + b[i], "element {i}");
    }
}

#[test]
fn saxpy_lays_out_mixed_parameters_and_fuses() {
    let m = Module::parse(SAXPY).unwrap();
    let k = m.kernel("saxpy").unwrap();
    assert_eq!(k.params_size, 24);
    let n = 300;
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let y: Vec<f32> = (0..n).map(|i| 2.0 * i as f32 + 1.0).collect();
    let mut mem = VecMem::new();
    let (px, py) = (mem.alloc_f32(&x), mem.alloc_f32(&y));
    let p = Params::new().u32(n as u32).f32(3.0).u64(px).u64(py);
    launch(k, &cfg([2, 1, 1], [256, 1, 1]), &p.0, &mut mem, &Limits::default()).unwrap();
    let out = mem.f32s(py);
    for i in 0..n {
        assert_eq!(out[i], 3.0f32.mul_add(x[i], y[i]));
    }
}

#[test]
fn tiled_matrix_mul_matches_host_reference() {
    let m = Module::parse(MATRIX_MUL).unwrap();
    let k = m.kernel("matrixMul").unwrap();
    let (ha, wa, wb) = (64usize, 48usize, 32usize);
    let a: Vec<f32> = (0..ha * wa).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
    let b: Vec<f32> = (0..wa * wb).map(|i| ((i * 5) % 11) as f32 * 0.25).collect();
    let mut mem = VecMem::new();
    let (pa, pb, pc) = (mem.alloc_f32(&a), mem.alloc_f32(&b), mem.alloc_f32(&vec![0.0; ha * wb]));
    let p = Params::new().u64(pc).u64(pa).u64(pb).u32(wa as u32).u32(wb as u32);
    launch(k, &cfg([(wb / 16) as u32, (ha / 16) as u32, 1], [16, 16, 1]), &p.0, &mut mem, &Limits::default()).unwrap();
    let c = mem.f32s(pc);
    for r in 0..ha {
        for col in 0..wb {
            let want: f32 = (0..wa).map(|i| a[r * wa + i] * b[i * wb + col]).sum();
            assert!((c[r * wb + col] - want).abs() < 1e-3, "C[{r}][{col}] = {} want {want}", c[r * wb + col]);
        }
    }
}

#[test]
fn reduction_uses_shared_memory_shuffles_and_atomics() {
    let m = Module::parse(REDUCTION).unwrap();
    let k = m.kernel("reduce").unwrap();
    let n = 10_000;
    let x: Vec<f32> = (0..n).map(|i| (i % 17) as f32).collect();
    let mut mem = VecMem::new();
    let (px, pout, pblocks) = (mem.alloc_f32(&x), mem.alloc_f32(&[0.0]), mem.alloc(&[0; 4]));
    let p = Params::new().u64(px).u64(pout).u64(pblocks).u32(n as u32);
    launch(k, &cfg([8, 1, 1], [256, 1, 1]), &p.0, &mut mem, &Limits::default()).unwrap();
    let want: f32 = x.iter().sum();
    assert_eq!(mem.f32s(pout)[0], want);
    assert_eq!(mem.bytes(pblocks), &8u32.to_le_bytes());
}

#[test]
fn butterfly_shuffle_gives_every_lane_the_warp_total() {
    let m = Module::parse(REDUCTION).unwrap();
    let k = m.kernel("warpSumBfly").unwrap();
    let v: Vec<u8> = (0..128u32).flat_map(|i| i.to_le_bytes()).collect();
    let mut mem = VecMem::new();
    let (pin, pout) = (mem.alloc(&v), mem.alloc(&[0; 512]));
    launch(k, &cfg([2, 1, 1], [64, 1, 1]), &Params::new().u64(pin).u64(pout).0, &mut mem, &Limits::default()).unwrap();
    let out: Vec<u32> = mem.bytes(pout).chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    for (i, v) in out.iter().enumerate() {
        let w = (i / 32) as u32;
        let want: u32 = (w * 32..w * 32 + 32).sum();
        assert_eq!(*v, want, "lane {i}");
    }
}

const OPS: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry ops(.param .u64 ops_param_0, .param .u32 ops_param_1, .param .u64 ops_param_2)
{
    .reg .pred %p<8>;
    .reg .b32 %r<30>;
    .reg .b64 %rd<10>;
    .reg .f32 %f<10>;
    ld.param.u64 %rd1, [ops_param_0];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r1, [ops_param_1];
    ld.param.u64 %rd2, [ops_param_2];
    rem.s32 %r2, %r1, 3;
    st.global.u32 [%rd1], %r2;
    rem.u32 %r3, %r1, 10;
    st.global.u32 [%rd1+4], %r3;
    min.s32 %r4, %r1, 5;
    st.global.u32 [%rd1+8], %r4;
    max.u32 %r5, %r1, 5;
    st.global.u32 [%rd1+12], %r5;
    and.b32 %r6, %r1, 0xFF;
    or.b32 %r7, %r6, 0x100;
    xor.b32 %r8, %r7, 3;
    st.global.u32 [%rd1+16], %r8;
    shl.b32 %r9, %r8, 4;
    st.global.u32 [%rd1+20], %r9;
    shr.s32 %r10, %r1, 1;
    st.global.u32 [%rd1+24], %r10;
    shr.u32 %r11, %r1, 28;
    st.global.u32 [%rd1+28], %r11;
    setp.lt.s32 %p1, %r1, 0;
    selp.u32 %r12, 11, 22, %p1;
    st.global.u32 [%rd1+32], %r12;
    setp.lt.u32 %p2, %r1, 0;
    selp.u32 %r13, 11, 22, %p2;
    st.global.u32 [%rd1+36], %r13;
    setp.gt.s64 %p3, %rd2, 0;
    setp.gt.u64 %p4, %rd2, 0;
    selp.u32 %r14, 1, 0, %p3;
    selp.u32 %r15, 2, 0, %p4;
    or.b32 %r16, %r14, %r15;
    st.global.u32 [%rd1+40], %r16;
    cvt.rn.f32.s32 %f1, %r1;
    mov.f32 %f2, 0f40000000;
    fma.rn.f32 %f3, %f1, %f2, 0f3F800000;
    st.global.f32 [%rd1+44], %f3;
    cvt.rzi.s32.f32 %r17, %f3;
    st.global.u32 [%rd1+48], %r17;
    mul.wide.s32 %rd3, %r1, 1000000;
    st.global.u64 [%rd1+56], %rd3;
    mad.lo.s32 %r18, %r1, %r1, 1;
    st.global.u32 [%rd1+64], %r18;
    cvt.u64.u32 %rd4, %r1;
    st.global.u64 [%rd1+72], %rd4;
    cvt.s64.s32 %rd5, %r1;
    st.global.u64 [%rd1+80], %rd5;
    setp.eq.f32 %p5, %f3, 0fC1500000;
    mov.u32 %r19, 77;
    @%p5 st.global.u32 [%rd1+88], %r19;
    @!%p5 st.global.u32 [%rd1+92], %r19;
    min.f32 %f4, %f3, %f2;
    max.f32 %f5, %f3, %f2;
    sub.f32 %f6, %f5, %f4;
    st.global.f32 [%rd1+96], %f6;
    div.rn.f32 %f7, %f6, %f2;
    st.global.f32 [%rd1+100], %f7;
    setp.ge.u64 %p6, %rd2, %rd4;
    selp.u32 %r20, 1, 0, %p6;
    st.global.u32 [%rd1+104], %r20;
    setp.lt.s32.and %p7, %r1, 0, %p6;
    selp.u32 %r21, 5, 6, %p7;
    st.global.u32 [%rd1+108], %r21;
    mov.b64 {%r22, %r23}, %rd2;
    st.global.u32 [%rd1+112], %r23;
    ret;
}
"#;

#[test]
fn integer_float_predicate_and_conversion_ops() {
    let m = Module::parse(OPS).unwrap();
    let k = m.kernel("ops").unwrap();
    let mut mem = VecMem::new();
    let out = mem.alloc(&[0; 128]);
    let x: i32 = -7;
    let y: u64 = 0xFFFF_FFFF_0000_0010;
    launch(k, &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(out).u32(x as u32).u64(y).0, &mut mem, &Limits::default()).unwrap();
    let b = mem.bytes(out);
    let u32at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let f32at = |o: usize| f32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    assert_eq!(u32at(0) as i32, -1, "rem.s32");
    assert_eq!(u32at(4), (x as u32) % 10, "rem.u32");
    assert_eq!(u32at(8) as i32, -7, "min.s32");
    assert_eq!(u32at(12), x as u32, "max.u32");
    assert_eq!(u32at(16), 0x1FA, "and/or/xor");
    assert_eq!(u32at(20), 0x1FA0, "shl");
    assert_eq!(u32at(24) as i32, -4, "shr.s32");
    assert_eq!(u32at(28), 0xF, "shr.u32");
    assert_eq!(u32at(32), 11, "setp.lt.s32");
    assert_eq!(u32at(36), 22, "setp.lt.u32");
    assert_eq!(u32at(40), 2, "setp s64/u64");
    assert_eq!(f32at(44), -13.0, "cvt + fma");
    assert_eq!(u32at(48) as i32, -13, "cvt.rzi");
    assert_eq!(u64at(56) as i64, -7_000_000, "mul.wide.s32");
    assert_eq!(u32at(64), 50, "mad.lo");
    assert_eq!(u64at(72), 0xFFFF_FFF9, "cvt.u64.u32");
    assert_eq!(u64at(80) as i64, -7, "cvt.s64.s32");
    assert_eq!(u32at(88), 77, "guarded store taken");
    assert_eq!(u32at(92), 0, "negated guard skipped");
    assert_eq!(f32at(96), 15.0, "min/max/sub.f32");
    assert_eq!(f32at(100), 7.5, "div.f32");
    assert_eq!(u32at(104), 1, "setp.ge.u64");
    assert_eq!(u32at(108), 5, "setp with .and");
    assert_eq!(u32at(112), 0xFFFF_FFFF, "mov.b64 unpack");
}

#[test]
fn special_registers_cover_three_dimensions() {
    let src = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry coords(.param .u64 p)
{
    .reg .b32 %r<20>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [p];
    mov.u32 %r1, %tid.x; mov.u32 %r2, %tid.y; mov.u32 %r3, %tid.z;
    mov.u32 %r4, %ntid.x; mov.u32 %r5, %ntid.y; mov.u32 %r6, %ntid.z;
    mov.u32 %r7, %ctaid.x; mov.u32 %r8, %ctaid.y; mov.u32 %r9, %ctaid.z;
    mov.u32 %r10, %nctaid.x; mov.u32 %r11, %nctaid.y; mov.u32 %r12, %nctaid.z;
    // linear block id and thread id
    mad.lo.u32 %r13, %r9, %r11, %r8;
    mad.lo.u32 %r13, %r13, %r10, %r7;
    mad.lo.u32 %r14, %r3, %r5, %r2;
    mad.lo.u32 %r14, %r14, %r4, %r1;
    mul.lo.u32 %r15, %r4, %r5;
    mul.lo.u32 %r15, %r15, %r6;
    mad.lo.u32 %r16, %r13, %r15, %r14;
    mul.wide.u32 %rd2, %r16, 16;
    add.s64 %rd3, %rd1, %rd2;
    st.global.v4.u32 [%rd3], {%r1, %r2, %r3, %r13};
    ret;
}
"#;
    let m = Module::parse(src).unwrap();
    let k = m.kernel("coords").unwrap();
    let (grid, block) = ([2u32, 3, 2], [4u32, 2, 3]);
    let total = 12 * 24;
    let mut mem = VecMem::new();
    let out = mem.alloc(&vec![0; total * 16]);
    launch(k, &cfg(grid, block), &Params::new().u64(out).0, &mut mem, &Limits::default()).unwrap();
    let b = mem.bytes(out);
    let mut i = 0;
    for bz in 0..2 {
        for by in 0..3 {
            for bx in 0..2 {
                for tz in 0..3 {
                    for ty in 0..2 {
                        for tx in 0..4 {
                            let w: Vec<u32> = b[i * 16..i * 16 + 16].chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
                            assert_eq!(w, vec![tx, ty, tz, (bz * 3 + by) * 2 + bx]);
                            i += 1;
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn infinite_loop_stops_at_the_instruction_budget() {
    let m = Module::parse(FAULTS).unwrap();
    let k = m.kernel("spin").unwrap();
    let mut mem = VecMem::new();
    let limits = Limits { budget: 100_000, ..Limits::default() };
    assert_eq!(launch(k, &cfg([1, 1, 1], [32, 1, 1]), &[], &mut mem, &limits).unwrap_err(), ExecError::Budget(100_000));
}

#[test]
fn out_of_bounds_and_foreign_pointers_fault() {
    let m = Module::parse(FAULTS).unwrap();
    let poke = m.kernel("pokeOffset").unwrap();
    let mut mem = VecMem::new();
    let mine = mem.alloc(&[0; 64]);
    // Just past the end of the allocation.
    let e = launch(poke, &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(mine).u64(64).0, &mut mem, &Limits::default()).unwrap_err();
    assert!(matches!(e, ExecError::IllegalAddress { kind: "global", .. }), "{e}");
    // An address no allocation of this tenant covers.
    let e = launch(poke, &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(mine).u64(0x1000_0000).0, &mut mem, &Limits::default()).unwrap_err();
    assert!(matches!(e, ExecError::IllegalAddress { .. }), "{e}");
    assert!(e.to_string().contains("line"), "{e}");
    // Misaligned.
    let e = launch(poke, &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(mine).u64(2).0, &mut mem, &Limits::default()).unwrap_err();
    assert!(matches!(e, ExecError::Misaligned { .. }), "{e}");
    assert_eq!(mem.bytes(mine), &[0; 64], "no partial write");
}

#[test]
fn shared_memory_out_of_bounds_faults() {
    let src = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry s() {\n .reg .b32 %r<3>;\n .shared .align 4 .b8 buf[16];\n mov.u32 %r1, buf;\n st.shared.u32 [%r1+16], %r1;\n ret;\n}\n";
    let m = Module::parse(src).unwrap();
    let e = launch(m.kernel("s").unwrap(), &cfg([1, 1, 1], [1, 1, 1]), &[], &mut VecMem::new(), &Limits::default()).unwrap_err();
    assert!(matches!(e, ExecError::IllegalAddress { kind: "shared", line: 8, .. }), "{e}");
}

#[test]
fn unsupported_instruction_names_itself() {
    let src = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry t(.param .u64 p) {\n .reg .f32 %f<5>;\n .reg .b64 %rd<3>;\n tex.2d.v4.f32.f32 {%f1, %f2, %f3, %f4}, [%rd1, {%f1, %f2}];\n ret;\n}\n";
    let e = Module::parse(src).unwrap_err();
    assert_eq!(e.line, 7);
    assert!(e.msg.contains("unsupported instruction 'tex.2d.v4.f32.f32'"), "{e}");
    let e = Module::parse(".version 7.0\n.address_size 64\n.global .texref tr;\n.visible .entry t() {\n ret;\n}\n").unwrap_err();
    assert!(e.msg.contains("texref"), "{e}");
    let e = Module::parse(".version 7.0\n.address_size 32\n").unwrap_err();
    assert!(e.msg.contains("64-bit"), "{e}");
}

#[test]
fn bad_launch_shapes_are_rejected() {
    let m = Module::parse(VECTOR_ADD).unwrap();
    let k = m.kernel("vectorAdd").unwrap();
    let mut mem = VecMem::new();
    assert!(matches!(launch(k, &cfg([1, 1, 1], [2048, 1, 1]), &[0; 28], &mut mem, &Limits::default()), Err(ExecError::BadLaunch(_))));
    assert!(matches!(launch(k, &cfg([1, 1, 1], [32, 1, 1]), &[0; 8], &mut mem, &Limits::default()), Err(ExecError::BadLaunch(_))));
    let big_shared = LaunchConfig { grid: [1, 1, 1], block: [32, 1, 1], dynamic_shared: 1 << 20 };
    assert!(matches!(launch(k, &big_shared, &[0; 28], &mut mem, &Limits::default()), Err(ExecError::BadLaunch(_))));
}

#[test]
fn parser_survives_garbage() {
    // Random-ish mutations of a real module: errors, never panics.
    let base = REDUCTION.as_bytes();
    let mut seed = 0x1234_5678u64;
    for _ in 0..2000 {
        let mut v = base.to_vec();
        for _ in 0..4 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let i = (seed as usize) % v.len();
            v[i] = (seed >> 32) as u8 & 0x7f;
        }
        if let Ok(s) = std::str::from_utf8(&v) {
            if let Ok(m) = Module::parse(s) {
                for k in &m.kernels {
                    let mut mem = VecMem::new();
                    let limits = Limits { budget: 200_000, ..Limits::default() };
                    let _ = launch(k, &cfg([1, 1, 1], [64, 1, 1]), &[0; 64], &mut mem, &limits);
                }
            }
        }
    }
}

#[test]
fn signatures_lay_out_parameters_without_decoding_bodies() {
    // The body uses an instruction the interpreter does not support; the
    // signature scan must not care.
    let src = r#"
.version 8.0
.target sm_90
.address_size 64
.file 1 "k.cu"
.visible .entry k(
    .param .u64 .ptr .global .align 1 k_param_0,
    .param .u32 k_param_1,
    .param .align 16 .b8 k_param_2[24],
    .param .u8 k_param_3
)
.maxntid 256, 1, 1
{
    tex.2d.v4.f32.f32 {%f1, %f2, %f3, %f4}, [t, {%f5, %f6}];
    ret;
}
.entry noargs
{
    ret;
}
"#;
    let sigs = Module::signatures(src, u64::MAX).unwrap();
    assert_eq!(sigs.len(), 2);
    let k = &sigs[0];
    assert_eq!(k.name, "k");
    let layout: Vec<(u32, u32)> = k.params.iter().map(|p| (p.offset, p.size)).collect();
    assert_eq!(layout, [(0, 8), (8, 4), (16, 24), (40, 1)]);
    assert_eq!(k.params_size, 41);
    assert_eq!(sigs[1].name, "noargs");
    assert!(sigs[1].params.is_empty());
    assert!(Module::parse(src).is_err(), "the full parser refuses the texture instruction");
}

/// Regression tests for hostile modules and launches (issue: tenant-proof
/// workers). Each failed, crashed or ran unbounded before its fix.
mod hostile {
    use super::*;

    const HEAD: &str = ".version 7.0\n.target sm_70\n.address_size 64\n";

    fn kernel_with(body: &str) -> String {
        format!("{HEAD}.visible .entry k(.param .u64 out) {{\n .reg .b64 %rd<8>;\n .reg .b32 %r<8>;\n .reg .pred %p<2>;\n{body}\n ret;\n}}\n")
    }

    #[test]
    fn deeply_nested_operands_are_refused_not_recursed_into() {
        // A few thousand levels used to overflow the worker's stack,
        // which no catch_unwind can stop: the whole worker aborted.
        for (open, close) in [("!", ""), ("{", "}"), ("%r1|", "")] {
            let deep = format!("{}%r1{}", open.repeat(20_000), close.repeat(20_000));
            let src = kernel_with(&format!(" mov.u32 %r1, {deep};"));
            let e = Module::parse(&src).unwrap_err();
            assert!(e.msg.contains("nested too deeply"), "{open}: {e}");
        }
    }

    #[test]
    fn vector_operands_are_limited_to_eight_elements() {
        let regs: Vec<String> = (0..9).map(|i| format!("%r{}", i % 8)).collect();
        let src = kernel_with(&format!(" ld.global.v4.u32 {{{}}}, [%rd1];", regs.join(",")));
        assert!(Module::parse(&src).unwrap_err().msg.contains("more than 8 elements"));
    }

    #[test]
    fn module_scope_shared_variables_are_shared_by_entries_not_copied() {
        // 12000 module-scope variables and 12000 entries took 6 s of a
        // worker thread when each entry copied and scanned the list; with
        // one indexed table it is linear. The bound is 30x the linear cost.
        let mut src = String::from(HEAD);
        for i in 0..12_000 {
            src.push_str(&format!(".shared .align 4 .b8 s{i}[4];\n"));
        }
        for i in 0..12_000 {
            src.push_str(&format!(".visible .entry e{i}() {{\n .reg .b32 %r<2>;\n mov.u32 %r1, s{i};\n ret;\n}}\n"));
        }
        let t = std::time::Instant::now();
        let m = Module::parse(&src).unwrap();
        let took = t.elapsed();
        assert_eq!(m.kernels.len(), 12_000);
        assert!(took < std::time::Duration::from_secs(3), "parsing took {took:?}");
        // Each entry resolves the module-scope variable at its own offset.
        let k = m.kernel("e11999").unwrap();
        // Slot 0 is the carry flag; %r1 is slot 2.
        assert_eq!(k.code.insts[k.entry as usize].op, ir::Op::Mov { ty: ir::Ty::U32, d: 2, a: ir::Src::Imm(11_999 * 4) });
    }

    #[test]
    fn oversized_alignment_is_refused_instead_of_wrapping() {
        for decl in [".shared .align 2147483648 .b8 s[4];", ".shared .align 3 .b8 s[4];"] {
            let src = format!("{HEAD}{decl}\n.visible .entry k() {{ ret; }}\n");
            assert!(Module::parse(&src).unwrap_err().msg.contains(".align"), "{decl}");
        }
        let src = kernel_with(" .shared .align 65536 .b8 a[4];\n .shared .align 65536 .b8 b[4];");
        assert_eq!(Module::parse(&src).unwrap().kernels[0].shared_bytes, 65536 + 4);
    }

    #[test]
    fn register_ranges_resolve_without_one_name_per_register() {
        let src = format!("{HEAD}.visible .entry k() {{\n .reg .b32 %r<65536>;\n mov.u32 %r65535, %r0;\n ret;\n}}\n");
        let k = &Module::parse(&src).unwrap().kernels[0];
        assert_eq!(k.num_regs, 65537, "65536 registers and the carry flag");
        assert_eq!(k.code.insts[k.entry as usize].op, ir::Op::Mov { ty: ir::Ty::U32, d: 65536, a: ir::Src::Reg(1) });
        for bad in ["%r65536", "%r01"] {
            let src = format!("{HEAD}.visible .entry k() {{\n .reg .b32 %r<65536>;\n mov.u32 {bad}, %r0;\n ret;\n}}\n");
            assert!(Module::parse(&src).unwrap_err().msg.contains("unknown register"), "{bad}");
        }
    }

    #[test]
    fn shifts_by_64_bit_amounts_clamp_instead_of_truncating() {
        let src = kernel_with(" ld.param.u64 %rd1, [out];\n mov.b64 %rd2, 1;\n mov.b64 %rd3, 4294967296;\n shl.b64 %rd4, %rd2, %rd3;\n shr.u64 %rd5, %rd2, %rd3;\n st.global.u64 [%rd1], %rd4;\n st.global.u64 [%rd1+8], %rd5;");
        let m = Module::parse(&src).unwrap();
        let mut mem = VecMem::new();
        let out = mem.alloc(&[0xff; 16]);
        launch(&m.kernels[0], &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(out).0, &mut mem, &Limits::default()).unwrap();
        assert_eq!(mem.bytes(out), &[0; 16], "1 << 2^32 and 1 >> 2^32 are 0");
    }

    #[test]
    fn a_register_file_larger_than_the_limit_is_out_of_resources() {
        let src = format!("{HEAD}.visible .entry k() {{\n .reg .b64 %rd<60000>;\n ret;\n}}\n");
        let m = Module::parse(&src).unwrap();
        let e = launch(&m.kernels[0], &cfg([1, 1, 1], [1024, 1, 1]), &[], &mut VecMem::new(), &Limits::default()).unwrap_err();
        assert!(matches!(e, ExecError::OutOfResources(_)), "{e}");
    }

    #[test]
    fn block_setup_is_charged_so_many_tiny_blocks_hit_the_budget() {
        // One instruction per block: a million blocks used to cost a
        // million units of a ten-million budget, whatever their set-up.
        let src = format!("{HEAD}.visible .entry k() {{\n .reg .b64 %rd<64>;\n ret;\n}}\n");
        let m = Module::parse(&src).unwrap();
        let limits = Limits { budget: 10_000_000, ..Limits::default() };
        let e = launch(&m.kernels[0], &cfg([1_000_000, 1, 1], [1, 1, 1]), &[], &mut VecMem::new(), &limits).unwrap_err();
        assert_eq!(e, ExecError::Budget(10_000_000));
        // Small grids still run, and report what they were charged.
        let s = launch(&m.kernels[0], &cfg([4, 1, 1], [32, 1, 1]), &[], &mut VecMem::new(), &limits).unwrap();
        assert!(s.instructions > 4 * 32, "{s:?}");
    }

    #[test]
    fn vector_operands_cost_one_unit_per_element() {
        let src = kernel_with(" ld.param.u64 %rd1, [out];\n ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];");
        let m = Module::parse(&src).unwrap();
        let mut mem = VecMem::new();
        let out = mem.alloc(&[0; 16]);
        let one = launch(&m.kernels[0], &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(out).0, &mut mem, &Limits::default()).unwrap();
        let src = kernel_with(" ld.param.u64 %rd1, [out];\n ld.global.u32 %r1, [%rd1];");
        let m = Module::parse(&src).unwrap();
        let scalar = launch(&m.kernels[0], &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(out).0, &mut mem, &Limits::default()).unwrap();
        assert_eq!(one.instructions, scalar.instructions + 3);
    }

    #[test]
    fn a_launch_stops_at_its_wall_clock_limit_whatever_its_budget() {
        let m = Module::parse(FAULTS).unwrap();
        let limits = Limits { budget: 0, timeout: Some(std::time::Duration::from_millis(200)), ..Limits::default() };
        let t = std::time::Instant::now();
        let e = launch(m.kernel("spin").unwrap(), &cfg([1, 1, 1], [32, 1, 1]), &[], &mut VecMem::new(), &limits).unwrap_err();
        assert_eq!(e, ExecError::Timeout(std::time::Duration::from_millis(200)));
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "stopped after {:?}", t.elapsed());
    }

    /// Work paused for 10 s before the launch, as a lane lease reused by
    /// launch after launch can be; and paused by another 300 ms within it. A
    /// stand-in for the device scheduler's hold on the lane.
    struct PausedBefore {
        began: std::time::Instant,
        paused: std::sync::Mutex<Option<std::time::Instant>>,
    }

    impl crate::exec::Preempt for PausedBefore {
        fn checkpoint(&self) {
            let mut p = self.paused.lock().unwrap();
            if p.is_none() && self.began.elapsed() >= std::time::Duration::from_millis(50) {
                std::thread::sleep(std::time::Duration::from_millis(300));
                *p = Some(std::time::Instant::now());
            }
        }

        fn paused(&self) -> std::time::Duration {
            let before = std::time::Duration::from_secs(10);
            if self.paused.lock().unwrap().is_some() {
                before + std::time::Duration::from_millis(300)
            } else {
                before
            }
        }
    }

    #[test]
    fn only_pauses_within_a_launch_extend_its_time_limit() {
        let m = Module::parse(FAULTS).unwrap();
        let p = PausedBefore { began: std::time::Instant::now(), paused: std::sync::Mutex::new(None) };
        let limits = Limits { budget: 0, timeout: Some(std::time::Duration::from_millis(200)), preempt: Some(&p), ..Limits::default() };
        let t = std::time::Instant::now();
        let e = launch(m.kernel("spin").unwrap(), &cfg([1, 1, 1], [32, 1, 1]), &[], &mut VecMem::new(), &limits).unwrap_err();
        assert_eq!(e, ExecError::Timeout(std::time::Duration::from_millis(200)));
        // 10 s of earlier pauses gave it no more time (it would have run
        // for 10.5 s); the 300 ms pause within it did.
        assert!(p.paused.lock().unwrap().is_some(), "the launch was never paused");
        let took = t.elapsed();
        assert!(took >= std::time::Duration::from_millis(500) && took < std::time::Duration::from_secs(5), "stopped after {took:?}");
    }

    #[test]
    fn a_module_larger_than_the_host_limit_is_refused_before_it_is_parsed() {
        let src = kernel_with(&" add.u32 %r1, %r1, 1;\n".repeat(10_000));
        let full = Module::parse(&src).unwrap();
        assert!(full.host_bytes() > 10_000 * std::mem::size_of::<ir::Inst>() as u64);
        // Too little for the tokens: refused before they are allocated.
        let e = Module::parse_within(&src, 1 << 16).unwrap_err();
        assert!(e.budget && e.msg.contains("tokens"), "{e}");
        // Enough for the tokens, too little for the decoded form.
        let tokens = lex::count(&src).unwrap() as u64 * lex::TOKEN_BYTES;
        let e = Module::parse_within(&src, tokens + 4096).unwrap_err();
        assert!(e.budget && e.msg.contains("decoded module"), "{e}");
        assert!(Module::parse_within(&src, tokens + full.host_bytes() * 2).is_ok());
    }

    /// The parser holds one module-scope statement's tokens at a time: a
    /// module of many kernels (as libraries ship them) parses within
    /// much less than all its tokens would take, and initialisers in
    /// braces, prototypes, `.file` lines and comments between statements
    /// keep their meaning.
    #[test]
    fn a_module_of_many_kernels_is_parsed_one_statement_at_a_time() {
        let mut src = format!("{HEAD}.file 1 \"a.cu\"\n.global .align 4 .u32 table[3] = {{7, 8, 9}};\n.extern .func (.param .b32 r) helper (.param .b32 x);\n");
        src += ".func (.param .b32 r) helper (.param .b32 x)\n{\n .reg .b32 %r<2>;\n ld.param.b32 %r1, [x];\n add.u32 %r1, %r1, 1;\n st.param.b32 [r], %r1;\n ret;\n}\n";
        for k in 0..400 {
            src += &format!("// kernel {k}\n.visible .entry k{k}(.param .u64 out)\n{{\n .reg .b64 %rd<4>;\n .reg .b32 %r<4>;\n ld.param.u64 %rd1, [out];\n ld.global.u32 %r1, [table+4];\n add.u32 %r1, %r1, {k};\n {{\n .param .b32 a;\n .param .b32 r;\n st.param.b32 [a], %r1;\n call.uni (r), helper, (a);\n ld.param.b32 %r2, [r];\n }}\n st.global.u32 [%rd1], %r2;\n ret;\n}}\n/* between */\n");
        }
        let full = Module::parse(&src).unwrap();
        assert_eq!(full.kernels.len(), 400);
        let all_tokens = lex::count(&src).unwrap() as u64 * lex::TOKEN_BYTES;
        let one = all_tokens / 400;
        // Far less than all the tokens: the decoded module and a few
        // statements' worth.
        let limit = full.host_bytes() * 2 + one * 4;
        assert!(limit < all_tokens, "{limit} {all_tokens}");
        let mut m = Module::parse_within(&src, limit).unwrap();
        let mut mem = VecMem::new();
        let seg = mem.alloc(&[0; 16]);
        let out = mem.alloc(&[0; 4]);
        for (addr, bytes) in m.link(seg, 0) {
            mem.find(addr, bytes.len()).unwrap().copy_from_slice(&bytes);
        }
        launch(m.kernel("k399").unwrap(), &cfg([1, 1, 1], [1, 1, 1]), &out.to_le_bytes(), &mut mem, &Limits::default()).unwrap();
        assert_eq!(mem.bytes(out), (8u32 + 399 + 1).to_le_bytes());
        // A statement the budget leaves no room for is refused, and says so.
        let e = Module::parse_within(&src, one / 2).unwrap_err();
        assert!(e.budget && e.msg.contains("tokens of one statement"), "{e}");
    }

    /// What `signatures` returns is charged as it grows: bare `.entry a;`
    /// lines, three tokens each, would otherwise make ten times the text
    /// in memory, uncharged.
    #[test]
    fn signatures_are_charged_as_they_are_collected() {
        let src = format!("{HEAD}{}", ".entry a;\n".repeat(100_000));
        assert_eq!(Module::signatures(&src, u64::MAX).unwrap().len(), 100_000);
        let e = Module::signatures(&src, 4 << 20).unwrap_err();
        assert!(e.budget, "{e}");
    }

    fn one_warp() -> LaunchConfig {
        cfg([1, 1, 1], [32, 1, 1])
    }

    #[test]
    fn unbounded_recursion_fails_the_launch_with_bounded_memory() {
        let src = format!("{HEAD}.func f(.param .b64 x)\n{{\n .reg .b64 %rd<2>;\n ld.param.u64 %rd1, [x];\n {{\n .param .b64 a;\n st.param.b64 [a], %rd1;\n call.uni f, (a);\n }}\n ret;\n}}\n.visible .entry k() {{\n .reg .b64 %rd<2>;\n {{\n .param .b64 a;\n st.param.b64 [a], %rd1;\n call.uni f, (a);\n }}\n ret;\n}}\n");
        let m = Module::parse(&src).unwrap();
        let t = std::time::Instant::now();
        let e = launch(&m.kernels[0], &cfg([1, 1, 1], [1024, 1, 1]), &[], &mut VecMem::new(), &Limits::default()).unwrap_err();
        assert!(matches!(&e, ExecError::Failed(msg) if msg.contains("call stack overflow")), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn oversized_frames_and_segments_are_refused_or_cost_no_host_memory() {
        let e = Module::parse(&kernel_with(" .local .align 8 .b8 big[600000];")).unwrap_err();
        assert!(e.msg.contains("local frame"), "{e}");
        // 70000 bytes of local memory for each of 1024 threads: over the
        // 64 MiB block limit.
        let m = Module::parse(&kernel_with(" .local .align 8 .b8 big[70000];\n mov.u64 %rd1, big;")).unwrap();
        let e = launch(&m.kernels[0], &cfg([1, 1, 1], [1024, 1, 1]), &[0; 8], &mut VecMem::new(), &Limits::default()).unwrap_err();
        assert!(matches!(e, ExecError::OutOfResources(_)), "{e}");
        // A 64 GiB variable is device memory (the tenant's quota decides);
        // the host keeps only its declaration.
        let m = Module::parse(&format!("{HEAD}.visible .global .align 8 .b8 g[68719476736];\n.visible .entry k() {{ ret; }}\n")).unwrap();
        assert_eq!(m.global_size, 1 << 36);
        assert!(m.host_bytes() < 64 << 10, "{}", m.host_bytes());
        let e = Module::parse(&format!("{HEAD}.global .b8 g[4] = {{1, 2, 3, 4, 5}};\n")).unwrap_err();
        assert!(e.msg.contains("more elements"), "{e}");
    }

    #[test]
    fn branch_tables_and_indirect_calls_are_checked() {
        let src = format!("{HEAD}.visible .entry k(.param .u32 i) {{\n .reg .b32 %r<2>;\n ld.param.u32 %r1, [i];\n tab: .branchtargets L0, L1;\n brx.idx %r1, tab;\nL0:\n ret;\nL1:\n ret;\n}}\n");
        let m = Module::parse(&src).unwrap();
        launch(&m.kernels[0], &one_warp(), &1u32.to_le_bytes(), &mut VecMem::new(), &Limits::default()).unwrap();
        let e = launch(&m.kernels[0], &one_warp(), &7u32.to_le_bytes(), &mut VecMem::new(), &Limits::default()).unwrap_err();
        assert!(matches!(&e, ExecError::Failed(msg) if msg.contains("brx.idx")), "{e}");
        let src = format!("{HEAD}.visible .entry k(.param .u64 f) {{\n .reg .b64 %rd<2>;\n ld.param.u64 %rd1, [f];\n proto: .callprototype _ ();\n call %rd1, (), proto;\n ret;\n}}\n");
        let m = Module::parse(&src).unwrap();
        for junk in [0x7000_0000_0000u64, super::super::exec::FUNC_WINDOW + 12345] {
            let e = launch(&m.kernels[0], &one_warp(), &junk.to_le_bytes(), &mut VecMem::new(), &Limits::default()).unwrap_err();
            assert!(matches!(e, ExecError::IllegalAddress { kind: "function", .. }), "{e}");
        }
        let e = Module::parse(&format!("{HEAD}.extern .func malloc(.param .b64 n);\n.visible .entry k() {{\n {{\n .param .b64 a;\n call.uni malloc, (a);\n }}\n ret;\n}}\n")).unwrap_err();
        assert!(e.msg.contains("'malloc'"), "{e}");
    }

    #[test]
    fn partial_mask_shuffles_do_not_wait_for_lanes_outside_the_mask() {
        // Lanes 0-15 shuffle among themselves; lanes 16-31 leave first.
        let src = kernel_with(" mov.u32 %r1, %laneid;\n setp.ge.u32 %p1, %r1, 16;\n @%p1 bra DONE;\n shfl.sync.up.b32 %r2|%p1, %r1, 1, 0, 65535;\n ld.param.u64 %rd1, [out];\n mul.wide.u32 %rd2, %r1, 4;\n add.s64 %rd3, %rd1, %rd2;\n st.global.u32 [%rd3], %r2;\nDONE:");
        let m = Module::parse(&src).unwrap();
        let mut mem = VecMem::new();
        let out = mem.alloc(&[0xff; 64]);
        launch(&m.kernels[0], &one_warp(), &out.to_le_bytes(), &mut mem, &Limits::default()).unwrap();
        let got: Vec<u32> = mem.bytes(out).chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        let want: Vec<u32> = (0..16).map(|l: u32| l.saturating_sub(1)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_collective_whose_mask_never_fills_fails_instead_of_hanging() {
        // Lane 0 shuffles with lane 1 in its mask, but lane 1 waits at a
        // block barrier that lane 0 never reaches.
        let src = kernel_with(" mov.u32 %r1, %laneid;\n setp.eq.u32 %p1, %r1, 0;\n @%p1 bra A;\n bar.sync 0;\n bra DONE;\nA:\n shfl.sync.idx.b32 %r2, %r1, 0, 31, 3;\nDONE:");
        let m = Module::parse(&src).unwrap();
        let e = launch(&m.kernels[0], &one_warp(), &[0; 8], &mut VecMem::new(), &Limits::default()).unwrap_err();
        assert!(matches!(e, ExecError::Deadlock(_)), "{e}");
    }

    #[test]
    fn device_assert_reports_its_message() {
        let src = format!("{HEAD}.global .align 1 .b8 msg[5] = {{98, 111, 111, 109, 0}};\n.extern .func __assertfail(.param .b64 m, .param .b64 f, .param .b32 l, .param .b64 fn, .param .b64 c);\n.visible .entry k() {{\n .reg .b64 %rd<2>;\n .reg .b32 %r<2>;\n mov.u64 %rd1, msg;\n {{\n .param .b64 a0;\n st.param.b64 [a0], %rd1;\n .param .b64 a1;\n st.param.b64 [a1], %rd1;\n .param .b32 a2;\n st.param.b32 [a2], 42;\n .param .b64 a3;\n st.param.b64 [a3], %rd1;\n .param .b64 a4;\n st.param.b64 [a4], 1;\n call.uni __assertfail, (a0, a1, a2, a3, a4);\n }}\n ret;\n}}\n");
        let mut m = Module::parse(&src).unwrap();
        let mut mem = VecMem::new();
        let seg = mem.alloc(&[0; 16]);
        for (addr, bytes) in m.link(seg, 0) {
            mem.find(addr, bytes.len()).unwrap().copy_from_slice(&bytes);
        }
        let e = launch(&m.kernels[0], &one_warp(), &[], &mut mem, &Limits::default()).unwrap_err();
        assert!(matches!(&e, ExecError::Assert(msg) if msg.contains("boom") && msg.contains(":42:")), "{e}");
    }

    #[test]
    fn long_words_and_shared_branch_tables_cost_linear_time() {
        // A long word with '::' continuations used to be rescanned from its
        // start at each one.
        let word = format!("{}.b{}", "a".repeat(200_000), "::b".repeat(60_000));
        let t = std::time::Instant::now();
        assert!(super::super::lex::count(&word).is_ok());
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "{:?}", t.elapsed());
        // Many brx.idx on one table with a long label resolve it once.
        let label = "L".repeat(100_000);
        let src = format!("{HEAD}.visible .entry k() {{\n .reg .b32 %r<2>;\n T: .branchtargets {label};\n{label}:\n{} ret;\n}}\n", " brx.idx %r1, T;\n".repeat(20_000));
        let t = std::time::Instant::now();
        let m = Module::parse(&src).unwrap();
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "{:?}", t.elapsed());
        launch(&m.kernels[0], &cfg([1, 1, 1], [1, 1, 1]), &[], &mut VecMem::new(), &Limits { budget: 10_000, ..Limits::default() }).unwrap_err();
    }

    #[test]
    fn extreme_operands_do_not_overflow() {
        let e = Module::parse(&format!("{HEAD}.global .u64 x;\n.global .u64 p = x - 9223372036854775808;\n")).unwrap_err();
        assert!(e.msg.contains("out of range"), "{e}");
        let src = kernel_with(" sad.s64 %rd1, -9223372036854775808, 1, 0;\n ld.param.u64 %rd2, [out];\n st.global.u64 [%rd2], %rd1;");
        let m = Module::parse(&src).unwrap();
        let mut mem = VecMem::new();
        let out = mem.alloc(&[0; 8]);
        launch(&m.kernels[0], &cfg([1, 1, 1], [1, 1, 1]), &out.to_le_bytes(), &mut mem, &Limits::default()).unwrap();
        assert_eq!(u64::from_le_bytes(mem.bytes(out).try_into().unwrap()), (1u64 << 63) + 1);
    }

    #[test]
    fn a_cluster_barrier_split_by_a_shuffle_still_completes() {
        // Arrive, shuffle (which parks and resumes), then wait.
        let src = kernel_with(" mov.u32 %r1, %laneid;\n barrier.cluster.arrive;\n shfl.sync.down.b32 %r2, %r1, 1, 31, -1;\n barrier.cluster.wait;\n ld.param.u64 %rd1, [out];\n mul.wide.u32 %rd2, %r1, 4;\n add.s64 %rd3, %rd1, %rd2;\n mov.u32 %r3, %tid.x;\n setp.lt.u32 %p1, %r3, 32;\n @%p1 st.global.u32 [%rd3], %r2;");
        let m = Module::parse(&src).unwrap();
        let mut mem = VecMem::new();
        let out = mem.alloc(&[0; 128]);
        launch(&m.kernels[0], &cfg([1, 1, 1], [64, 1, 1]), &out.to_le_bytes(), &mut mem, &Limits::default()).unwrap();
        let got: Vec<u32> = mem.bytes(out).chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        let want: Vec<u32> = (0..32).map(|l: u32| if l < 31 { l + 1 } else { l }).collect();
        assert_eq!(got, want);
    }
}

#[test]
fn packed_16x2_min_and_max_work_on_each_half() {
    let src = ".version 8.8\n.target sm_100\n.address_size 64\n.visible .entry k(.param .u64 out)\n{\n .reg .b32 %r<9>;\n .reg .b64 %rd<2>;\n ld.param.u64 %rd1, [out];\n mov.b32 %r1, 0xFFFE0005;\n mov.b32 %r2, 0x00030009;\n min.s16x2 %r3, %r1, %r2;\n max.s16x2 %r4, %r1, %r2;\n min.u16x2 %r5, %r1, %r2;\n max.u16x2 %r6, %r1, %r2;\n max.s16x2.relu %r7, %r1, 0xFFF0FFF0;\n st.global.v4.u32 [%rd1], {%r3, %r4, %r5, %r6};\n st.global.u32 [%rd1+16], %r7;\n ret;\n}\n";
    let m = Module::parse(src).unwrap();
    let mut mem = VecMem::new();
    let out = mem.alloc(&[0u8; 20]);
    launch(m.kernel("k").unwrap(), &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(out).0, &mut mem, &Limits::default()).unwrap();
    let w: Vec<u32> = mem.bytes(out).chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    // High halves: -2 vs 3; low halves: 5 vs 9.
    assert_eq!(w[0], 0xFFFE_0005, "signed min");
    assert_eq!(w[1], 0x0003_0009, "signed max");
    assert_eq!(w[2], 0x0003_0005, "unsigned min");
    assert_eq!(w[3], 0xFFFE_0009, "unsigned max");
    assert_eq!(w[4], 0x0000_0005, "signed max with relu clamps negatives to 0");
    assert!(Module::parse(&src.replace("max.s16x2.relu", "max.u16x2.relu")).is_err(), "relu is for signed halves only");
}

#[test]
fn fp8_encodings_round_trip_round_to_even_and_saturate() {
    use crate::mma::{from_fp8, to_fp8};
    for e5m2 in [false, true] {
        for b in 0..=255u8 {
            let v = from_fp8(b, e5m2);
            if v.is_nan() || v.is_infinite() {
                continue;
            }
            assert_eq!(to_fp8(v, e5m2), b, "byte {b:#x} (e5m2 {e5m2}) is {v}");
        }
    }
    // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): to even.
    assert_eq!(to_fp8(1.0625, false), 0x38);
    assert_eq!(to_fp8(1.1875, false), 0x3a);
    assert_eq!(to_fp8(1.07, false), 0x39);
    // Saturating: past 448 (E4M3) and 57344 (E5M2), and infinities.
    assert_eq!(to_fp8(1000.0, false), 0x7e);
    assert_eq!(to_fp8(-1e9, true), 0xfb);
    assert_eq!(to_fp8(f64::INFINITY, true), 0x7b);
    assert_eq!(to_fp8(f64::NAN, false), 0x7f);
    // The smallest subnormals, and what rounds to zero.
    assert_eq!(to_fp8(2f64.powi(-9), false), 0x01);
    assert_eq!(to_fp8(2f64.powi(-11), false), 0x00);
    assert_eq!(to_fp8(2f64.powi(-16), true), 0x01);
}

#[test]
fn cvt_pack_saturates_and_packs_below_c() {
    let src = r#"
.version 8.0
.target sm_80
.address_size 64
.visible .entry k(.param .u64 out) {
    .reg .b32 %r<8>;
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [out];
    mov.b32 %r1, 300;
    mov.b32 %r2, -5;
    mov.b32 %r3, 0xABCD;
    cvt.pack.sat.s8.s32.b32 %r4, %r1, %r2, %r3;
    cvt.pack.sat.u8.s32.b32 %r5, %r1, %r2, %r3;
    cvt.pack.sat.s16.s32 %r6, %r2, %r1;
    cvt.pack.sat.u4.s32.b32 %r7, %r1, %r2, %r3;
    st.global.b32 [%rd1], %r4;
    st.global.b32 [%rd1+4], %r5;
    st.global.b32 [%rd1+8], %r6;
    st.global.b32 [%rd1+12], %r7;
    ret;
}
"#;
    let m = Module::parse(src).unwrap();
    let mut mem = VecMem::new();
    let out = mem.alloc(&[0; 16]);
    launch(&m.kernels[0], &cfg([1, 1, 1], [1, 1, 1]), &Params::new().u64(out).0, &mut mem, &Limits::default()).unwrap();
    let w: Vec<u32> = mem.bytes(out).chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    // s8: 300 -> 127, -5 -> 0xfb; c above them.
    assert_eq!(w[0], 0xABCD_7FFB);
    // u8: 300 -> 255, -5 -> 0.
    assert_eq!(w[1], 0xABCD_FF00);
    // s16 (no c): -5 -> 0xfffb high, 300 low.
    assert_eq!(w[2], 0xFFFB_012C);
    // u4: 15 and 0, c shifted by 8.
    assert_eq!(w[3], 0x00AB_CDF0);
}

#[test]
fn placed_bytes_size_a_modules_variables_without_decoding_bodies() {
    let src = r#"
.version 8.0
.target sm_90
.address_size 64
.extern .global .align 4 .b8 elsewhere[1048576];
.visible .global .align 8 .b8 big[1000000];
.global .u32 one = 7;
.global .align 16 .v4 .f32 quads[3];
.const .align 4 .b32 table[] = {1, 2, 3, 4, 5};
.global .attribute(.managed) .u64 shared_with_host;
.global .b128 wide[2];
.visible .entry k(.param .u64 .ptr .global .align 1 p)
{
    tex.2d.v4.f32.f32 {%f1, %f2, %f3, %f4}, [t, {%f5, %f6}];
    ret;
}
"#;
    // big 1000000, one 4 (at 1000000), quads 48 (aligned to 1000016),
    // table 20 (at 1000064), shared_with_host 8 (aligned to 1000088), wide
    // 2 x 16 (a type the interpreter does not know: 16 an element).
    assert_eq!(Module::placed_bytes(src, u64::MAX).unwrap(), 1_000_088 + 8 + 32);
    assert_eq!(Module::placed_bytes(".version 8.0\n.target sm_90\n.address_size 64\n", u64::MAX).unwrap(), 0);
    // The scan is bounded by the host budget like the others.
    assert!(Module::placed_bytes(src, 10).unwrap_err().budget);
    let module = |decls: &str| format!(".version 8.0\n.target sm_90\n.address_size 64\n.file 1 \"a\\\"(\"\n{decls}\n.visible .entry k(.param .u64 .ptr .const .align 8 p)\n{{\n    ret;\n}}\n");
    // Every variable of a list, `name<N>` variables, nested attributes,
    // and a stray parenthesis before them hides nothing.
    for (decls, bytes) in [
        (".global .u32 a, b[1000], c = 5;", 4 + 4000 + 4),
        (".global .align 8 .b64 g<1000>;", 8000),
        (".global .attribute(.unified(0x1, 0x2)) .u64 u[100];", 800),
        (".const .b32 t[] = {1, 2, 3}, s[2];", 12 + 8),
    ] {
        assert_eq!(Module::placed_bytes(&module(decls), u64::MAX).unwrap(), bytes, "{decls}");
    }
    // What follows a variable is understood or refused, never skipped.
    assert!(Module::placed_bytes(&module(".global .u32 a b[1000000];"), u64::MAX).is_err());
}
