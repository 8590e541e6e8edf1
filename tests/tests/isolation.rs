//! Must-show 4: tenant B passes tenant A's device pointer to copies, a
//! memset and a kernel; each fails, A's data is unchanged, and nothing of
//! A's reached B.

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use vgpu_tests::*;

#[test]
fn foreign_device_pointer_is_rejected_everywhere() {
    let m = Mediator::start(&[]);
    let a = m.tenant("owner", "32MiB");
    let b = m.tenant("thief", "32MiB");
    let mut holder = sample("tenant_probe", &a);
    holder.args(["hold", "4096"]).stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = holder.spawn().expect("spawn holder");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("ptr line");
    let ptr = line.trim().strip_prefix("ptr=").expect("ptr").to_string();

    let mut thief = sample("tenant_probe", &b);
    thief.args(["steal", &ptr]);
    let got = run_ok(thief);
    assert!(got.contains("dtoh=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("htod=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("dtod=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("memset=CUDA_ERROR_INVALID_VALUE"), "{got}");
    assert!(got.contains("kernel=CUDA_ERROR_ILLEGAL_ADDRESS"), "{got}");
    assert!(got.contains("leaked=0"), "{got}");

    child.stdin.take().expect("stdin").write_all(b"go\n").expect("release holder");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).expect("holder output");
    assert!(child.wait().expect("wait").success(), "{rest}");
    assert!(rest.contains("intact=4096"), "owner's data changed: {rest}");
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
    let ctx = match raw.call(Request::CtxCreate(CtxCreateReq { flags: 0, reserved: 0 })) {
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
    assert!(matches!(raw.call(Request::CtxCreate(CtxCreateReq { flags: 0, reserved: 0 })), Reply::Handle(_)));
    assert!(run_ok(sample("vectorAdd", &b)).contains("PASSED"));
}
