//! `cuCtxDestroy` of a context whose kernel spins does not return (measured
//! on an H100: still blocked after 5 s); only the process's end stops it.
mod common;
use common::*;
use std::time::Duration;

#[test]
fn destroying_a_context_waits_for_its_running_kernel() {
    init("1GiB");
    let a = ctx();
    let m = module();
    assert_eq!(launch(func(m, "spin"), &mut []), 0);
    let mut s = std::ptr::null_mut();
    // A second context's work goes on meanwhile (on its own stream).
    let b = ctx();
    assert_eq!(cuStreamCreate(&mut s, 0), 0);
    let d = alloc(4);
    assert_eq!(cuMemsetD32Async(d, 7, 1, s), 0);
    assert_eq!(cuStreamSynchronize(s), 0);
    assert_eq!(read_u32(d), 7);
    assert_eq!(cuStreamQuery(s), 0);
    let _ = b;
    let a = a as usize;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        tx.send(cuCtxDestroy_v2(a as Handle)).ok();
    });
    assert!(rx.recv_timeout(Duration::from_secs(2)).is_err(), "cuCtxDestroy returned while its kernel ran");
}
