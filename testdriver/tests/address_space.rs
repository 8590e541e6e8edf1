//! One address space per process: a kernel in one context reaches another
//! context's allocation (measured on an H100: 256 of 256 bytes read).
mod common;
use common::*;

#[test]
fn a_kernel_in_one_context_reads_another_contexts_memory_and_nvml_agrees_with_cuda() {
    init("1GiB");
    let a = ctx();
    let secret = alloc(256);
    let m = module();
    let mut p = secret.to_le_bytes();
    let mut v = 0x5ec2e7u32.to_le_bytes();
    assert_eq!(launch(func(m, "put"), &mut [&mut p, &mut v]), 0);
    assert_eq!(cuStreamSynchronize(std::ptr::null_mut()), 0);
    assert_eq!(read_u32(secret), 0x5ec2e7);

    let b = ctx();
    assert_eq!(cuCtxSetCurrent(b), 0);
    let mine = alloc(4);
    let m = module();
    let (mut src, mut dst) = (secret.to_le_bytes(), mine.to_le_bytes());
    assert_eq!(launch(func(m, "get"), &mut [&mut src, &mut dst]), 0);
    assert_eq!(cuStreamSynchronize(std::ptr::null_mut()), 0);
    assert_eq!(read_u32(mine), 0x5ec2e7, "B's kernel read A's allocation");
    // Copies through the API are not checked against contexts either.
    assert_eq!(read_u32(secret), 0x5ec2e7);

    // An address outside every allocation is refused by copies, without
    // poisoning anything.
    let mut x = 0u32;
    assert_ne!(cuMemcpyDtoH_v2((&mut x as *mut u32).cast(), 0x1000, 4), 0);
    assert_eq!(read_u32(mine), 0x5ec2e7);

    // Destroying A frees its memory: B's kernel now faults on it.
    assert_eq!(cuCtxDestroy_v2(a), 0);
    assert_eq!(cuCtxSetCurrent(b), 0);
    let mut f = 0usize;
    let mut t = 0usize;
    assert_eq!(cuMemGetInfo_v2(&mut f, &mut t), 0);
    assert_eq!(t, 1 << 30);
    assert!(f < t && f >= t - 4096, "only B's 4 bytes (and its module) are held: free {f}");

    // NVML names the same GPU CUDA opens.
    use vgpu_testdriver::nvml::*;
    assert_eq!(nvmlInit_v2(), 0);
    let mut n = 0;
    assert_eq!(nvmlDeviceGetCount_v2(&mut n), 0);
    assert_eq!(n, 1);
    let mut hnd = std::ptr::null_mut();
    assert_eq!(nvmlDeviceGetHandleByIndex_v2(0, &mut hnd), 0);
    let mut buf = [0 as std::ffi::c_char; 96];
    assert_eq!(nvmlDeviceGetUUID(hnd, buf.as_mut_ptr(), 96), 0);
    // SAFETY: nvmlDeviceGetUUID NUL-terminated the text within the buffer.
    let nv = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap().to_string();
    let mut u = [0u8; 16];
    assert_eq!(cuDeviceGetUuid_v2(&mut u, 0), 0);
    assert_eq!(nv, vgpu_testdriver::config::uuid_text("GPU", &u));
    assert_eq!(nvmlDeviceGetUUID(hnd, buf.as_mut_ptr(), 8), 7, "NVML_ERROR_INSUFFICIENT_SIZE");
}
