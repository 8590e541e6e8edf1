//! Must-show 4: tenant B passes tenant A's device pointer to copies, a
//! memset and a kernel; each fails, A's data is unchanged, and nothing of
//! A's reached B.

use vgpu_tests::*;

#[test]
fn foreign_device_pointer_is_rejected_everywhere() {
    let m = Mediator::start(&[]);
    let a = m.tenant("owner", "32MiB");
    let b = m.tenant("thief", "32MiB");
    let got = checks::steal_from(&a, &b);
    assert!(got.contains("dtoh=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("htod=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("dtod=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("memset=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("kernel=CUDA_ERROR_ILLEGAL_ADDRESS"), "{got}");
}

#[test]
fn kernel_fault_poisons_only_the_faulting_context() {
    let m = Mediator::start(&[]);
    let a = m.tenant("faulty", "16MiB");
    let b = m.tenant("bystander", "16MiB");
    // Out-of-bounds write through a kernel: the launch fails with
    // CUDA_ERROR_ILLEGAL_ADDRESS...
    let mut raw = Raw::connect(&a);
    use virtio_gpu_compute::*;
    let ctx = match raw.call(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })) {
        Reply::Handle(h) => h,
        r => panic!("{r:?}"),
    };
    let dptr = match raw.call(Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 256 })) {
        Reply::Ptr(p) => p,
        r => panic!("{r:?}"),
    };
    let ptx = std::fs::read(workspace().join("samples/kernels/faults.ptx")).expect("ptx");
    let module = match raw.call(Request::ModuleLoad(ModuleLoadReq { ctx, format: 0, image_len: ptx.len() as u64 }, ptx)) {
        Reply::Handle(h) => h,
        r => panic!("{r:?}"),
    };
    let name = "pokeOffset".to_string();
    let func = match raw.call(Request::ModuleGetFunction(GetFunctionReq { ctx, module, name_len: name.len() as u32, reserved: 0 }, name)) {
        Reply::Function(f, _) => f.func,
        r => panic!("{r:?}"),
    };
    let mut params = dptr.to_le_bytes().to_vec();
    params.extend_from_slice(&(1u64 << 20).to_le_bytes());
    let launch = LaunchReq { ctx, func, stream: 0, shared_bytes: 0, grid: [1; 3], block: [1; 3], params_len: 16, reserved: 0 };
    match raw.call(Request::LaunchKernel(launch, params)) {
        Reply::Error(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, msg) => assert!(msg.contains("pokeOffset"), "{msg}"),
        r => panic!("expected ILLEGAL_ADDRESS, got {r:?}"),
    }
    // ...the context stays unusable, as on a GPU...
    assert!(matches!(raw.call(Request::CtxSynchronize(CtxReq { ctx, reserved: 0 })), Reply::Error(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS, _)));
    // ...while a new context of the same tenant and another tenant work.
    assert!(matches!(raw.call(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })), Reply::Handle(_)));
    assert!(run_ok(sample("vectorAdd", &b)).contains("PASSED"));
}

#[test]
fn a_faulted_context_can_be_replaced_through_the_driver_api() {
    let m = Mediator::start(&[]);
    let a = m.tenant("crasher", "16MiB");
    let mut c = sample("tenant_probe", &a);
    c.args(["fault", "1099511627776"]);
    let out = run_ok(c);
    assert!(out.contains("launch=CUDA_SUCCESS"), "launches are asynchronous: {out}");
    assert!(out.contains("sync=CUDA_ERROR_ILLEGAL_ADDRESS"), "the fault is sticky: {out}");
    assert!(out.contains("after=CUDA_ERROR_ILLEGAL_ADDRESS"), "{out}");
    assert!(out.contains("fresh=CUDA_SUCCESS value=0x3c"), "a new context works: {out}");
}
