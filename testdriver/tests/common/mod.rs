//! Shared by the test double's own tests: each test file is a process of
//! its own, since a fault poisons the whole process (as on NVIDIA's driver).
#![allow(dead_code)]

use std::ffi::c_void;

pub use vgpu_testdriver::cuda::*;

pub const PTX: &str = "
.version 7.0
.target sm_70
.address_size 64
.visible .entry put(.param .u64 p, .param .u32 v)
{
    .reg .b64 %rd<2>;
    .reg .b32 %r<2>;
    ld.param.u64 %rd1, [p];
    ld.param.u32 %r1, [v];
    st.global.u32 [%rd1], %r1;
    ret;
}
.visible .entry get(.param .u64 src, .param .u64 dst)
{
    .reg .b64 %rd<3>;
    .reg .b32 %r<2>;
    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.global.u32 %r1, [%rd1];
    st.global.u32 [%rd2], %r1;
    ret;
}
.visible .entry spin()
{
SPIN:
    bra.uni SPIN;
}
\0";

pub fn init(gpus: &str) {
    std::env::set_var(vgpu_testdriver::GPUS_ENV, gpus);
    std::env::remove_var("CUDA_VISIBLE_DEVICES");
    assert_eq!(cuInit(0), 0);
}

pub fn ctx() -> Handle {
    let mut c = std::ptr::null_mut();
    assert_eq!(cuCtxCreate_v2(&mut c, 0, 0), 0);
    c
}

pub fn module() -> Handle {
    let mut m = std::ptr::null_mut();
    assert_eq!(cuModuleLoadData(&mut m, PTX.as_ptr().cast()), 0);
    m
}

pub fn func(m: Handle, name: &str) -> Handle {
    let mut f = std::ptr::null_mut();
    let n = std::ffi::CString::new(name).unwrap();
    assert_eq!(cuModuleGetFunction(&mut f, m, n.as_ptr()), 0);
    f
}

/// Launches `f` on one thread with the given parameters (each a u64 or u32
/// given as bytes) on the current context's null stream.
pub fn launch(f: Handle, args: &mut [&mut [u8]]) -> CUresult {
    let mut ptrs: Vec<*mut c_void> = args.iter_mut().map(|a| a.as_mut_ptr().cast()).collect();
    cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, std::ptr::null_mut(), ptrs.as_mut_ptr(), std::ptr::null_mut())
}

pub fn alloc(n: usize) -> u64 {
    let mut d = 0;
    assert_eq!(cuMemAlloc_v2(&mut d, n), 0);
    d
}

pub fn read_u32(d: u64) -> u32 {
    let mut v = 0u32;
    assert_eq!(cuMemcpyDtoH_v2((&mut v as *mut u32).cast(), d, 4), 0);
    v
}

pub const ILLEGAL_ADDRESS: CUresult = 700;
