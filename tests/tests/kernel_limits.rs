//! Kernel-side limits through the whole stack: the instruction budget stops
//! a runaway kernel, unsupported PTX names itself in the JIT error log, and
//! images without PTX have no binary for this device.

use virtio_gpu_compute::*;
use vgpu_tests::*;

#[test]
fn runaway_kernel_is_stopped_by_the_budget_and_others_continue() {
    let m = Mediator::start(&["--instruction-budget", "2000000"]);
    let a = m.tenant("spinner", "16MiB");
    let b = m.tenant("worker", "16MiB");
    let mut c = sample("tenant_probe", &a);
    c.args(["ptx", "faults.ptx", "spin"]);
    let out = run_ok(c);
    assert!(out.contains("launch=CUDA_SUCCESS sync=CUDA_ERROR_LAUNCH_TIMEOUT"), "the budget stops it and the sync reports it: {out}");
    assert!(out.contains("budget"), "the shim log names the reason: {out}");
    assert!(run_ok(sample("vectorAdd", &b).arg("2000")).contains("PASSED"));
}

#[test]
fn unsupported_ptx_instruction_is_named_in_the_jit_log() {
    let m = Mediator::start(&[]);
    let a = m.tenant("jit", "16MiB");
    let dir = std::env::temp_dir().join(format!("vgpu-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("bad.ptx"),
        ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry t()\n{\n .reg .b32 %r<3>;\n suld.b.1d.b32.trap {%r1}, [%r2, {%r1}];\n ret;\n}\n",
    )
    .expect("write");
    let mut c = sample("tenant_probe", &a);
    c.env("VGPU_KERNEL_DIR", &dir).args(["ptx", "bad.ptx", "t"]);
    let out = run_ok(c);
    assert!(out.contains("load=CUDA_ERROR_INVALID_PTX"), "{out}");
    assert!(out.contains("line 7: unsupported instruction 'suld.b.1d.b32.trap'"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cubins_and_fatbins_without_ptx_have_no_binary_for_the_cpu_device() {
    let m = Mediator::start(&[]);
    let a = m.tenant("bin", "16MiB");
    let mut r = Raw::connect(&a);
    let ctx = match r.call(Request::CtxCreate(CtxCreateReq { flags: 0, reserved: 0 })) {
        Reply::Handle(h) => h,
        o => panic!("{o:?}"),
    };
    let mut fatbin = 0xBA55_ED50u32.to_le_bytes().to_vec();
    fatbin.extend_from_slice(&[1, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    for (image, fmt) in [(b"\x7fELF\x02\x01\x01\x00rest-of-cubin".to_vec(), ImageFormat::Cubin), (fatbin, ImageFormat::Fatbin)] {
        match r.call(Request::ModuleLoad(ModuleLoadReq { ctx, format: fmt as u32, image_len: image.len() as u64 }, image)) {
            Reply::Error(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, msg) => assert!(msg.contains("PTX"), "{msg}"),
            o => panic!("{o:?}"),
        }
    }
}
