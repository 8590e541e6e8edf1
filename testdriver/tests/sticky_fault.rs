//! A fault is sticky for the whole process: every context fails after it
//! and no new context can be made (measured on an H100).
mod common;
use common::*;

#[test]
fn one_fault_breaks_every_context_of_the_process() {
    init("1GiB");
    let a = ctx();
    let ma = module();
    let b = ctx();
    let kept = alloc(4);
    assert_eq!(cuCtxSetCurrent(a), 0);
    let mut p = 0x10u64.to_le_bytes();
    let mut v = 1u32.to_le_bytes();
    // The launch is accepted; the fault shows at the next synchronisation.
    assert_eq!(launch(func(ma, "put"), &mut [&mut p, &mut v]), 0);
    assert_eq!(cuStreamSynchronize(std::ptr::null_mut()), ILLEGAL_ADDRESS);
    assert_eq!(cuCtxSetCurrent(b), 0);
    let mut d = 0;
    assert_eq!(cuMemAlloc_v2(&mut d, 4), ILLEGAL_ADDRESS, "the other context fails too");
    let mut x = 0u32;
    assert_eq!(cuMemcpyDtoH_v2((&mut x as *mut u32).cast(), kept, 4), ILLEGAL_ADDRESS);
    let mut c = std::ptr::null_mut();
    assert_eq!(cuCtxCreate_v2(&mut c, 0, 0), ILLEGAL_ADDRESS, "no new context in this process");
}
