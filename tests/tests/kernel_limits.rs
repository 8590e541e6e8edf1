//! Kernel-side limits through the whole stack: the instruction budget stops
//! a runaway kernel, unsupported PTX names itself in the JIT error log, and
//! images without PTX have no binary for this device.

use vgpu_tests::*;
use virtio_gpu_compute::fatbin::build;
use virtio_gpu_compute::*;

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
    std::fs::write(dir.join("bad.ptx"), ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry t()\n{\n .reg .b32 %r<3>;\n suld.b.1d.b32.trap {%r1}, [%r2, {%r1}];\n ret;\n}\n")
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
    let ctx = match r.call(Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })) {
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

/// An LZ4 block of literals only (what a compressor emits for short or
/// incompressible input): one sequence with no match.
fn lz4_literals(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    if data.len() < 15 {
        out.push((data.len() as u8) << 4);
    } else {
        out.push(0xF0);
        let mut rest = data.len() - 15;
        while rest >= 255 {
            out.push(255);
            rest -= 255;
        }
        out.push(rest as u8);
    }
    out.extend_from_slice(data);
    out
}

/// One fatbin entry: kind (1 PTX, 2 ELF), architecture, flags, payload and
/// its uncompressed size (0 when stored as is).
#[test]
fn a_fatbin_runs_through_its_compressed_ptx_on_the_cpu_device() {
    let m = Mediator::start(&[]);
    let a = m.tenant("fat", "16MiB");
    let mut r = Raw::connect(&a);
    let ctx = r.ctx();
    let ptx = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry from_fatbin(.param .u64 p)\n{\n .reg .b64 %rd<2>;\n .reg .b32 %r<2>;\n ld.param.u64 %rd1, [p];\n mov.u32 %r1, 77;\n st.global.u32 [%rd1], %r1;\n ret;\n}\n\0";
    let fatbin = build::image(&[
        build::entry(2, 80, 0x11, b"\x7fELF-a-cubin-for-sm_80", 0),
        build::entry(1, 70, 0x2011, &lz4_literals(ptx.as_bytes()), ptx.len() as u64),
        build::entry(1, 90, 0x11, b".version 8.0\n.target sm_90\n", 0),
    ]);
    let module = Raw::handle(r.call(Request::ModuleLoad(ModuleLoadReq { ctx, format: ImageFormat::Fatbin as u32, image_len: fatbin.len() as u64 }, fatbin.clone())));
    assert!(matches!(r.function(ctx, module, "from_fatbin"), Reply::Function(..)), "the compute_70 PTX was chosen and loaded");
    // A fatbin whose PTX is all newer than the device (compute_90 only, on
    // this 8.0 device) runs through that PTX: the interpreter does not
    // depend on the architecture a PTX names.
    let newer = ptx.replace(".target sm_70", ".target sm_90").replace("from_fatbin", "from_newer");
    let only_newer = build::image(&[build::entry(1, 90, 0x2011, &lz4_literals(newer.as_bytes()), newer.len() as u64)]);
    let m90 = Raw::handle(r.call(Request::ModuleLoad(ModuleLoadReq { ctx, format: ImageFormat::Fatbin as u32, image_len: only_newer.len() as u64 }, only_newer)));
    assert!(matches!(r.function(ctx, m90, "from_newer"), Reply::Function(..)));
    // The same PTX alone is refused, as a real driver refuses PTX newer
    // than the device.
    match r.load(ctx, newer.trim_end_matches('\0')) {
        Reply::Error(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, msg) => assert!(msg.contains("sm_90"), "{msg}"),
        o => panic!("{o:?}"),
    }
    // A corrupt compressed entry is a clear error, not a crash: its first
    // LZ4 token now asks for a match before any output exists.
    let first = build::entry(2, 80, 0x11, b"\x7fELF-a-cubin-for-sm_80", 0).len();
    let mut bad = fatbin.clone();
    bad[16 + first + 64] = 0x0F;
    match r.call(Request::ModuleLoad(ModuleLoadReq { ctx, format: ImageFormat::Fatbin as u32, image_len: bad.len() as u64 }, bad)) {
        Reply::Error(CuResult::CUDA_ERROR_INVALID_IMAGE, msg) => assert!(msg.contains("does not decompress"), "{msg}"),
        o => panic!("{o:?}"),
    }
    assert!(r.ping(), "the worker still serves the tenant");
}

/// The linker (`cuLinkAddFile` with a fatbin) takes the PTX the device's
/// own loader would: on an interpreting 9.0 device that is the generic
/// `compute_80` code before the `compute_90a` code (architecture-specific
/// PTX may use what an interpreter lacks, as wgmma), and the `compute_100`
/// code of a fatbin that has nothing older, as `cuModuleLoadData` given
/// the fatbin would. Each entry's kernel adds a different amount, so the
/// counter tells which one ran.
#[test]
fn the_linker_takes_a_fatbins_ptx_as_the_device_would() {
    let m = Mediator::start(&["--compute-capability", "9.0"]);
    let a = m.tenant("linker", "16MiB");
    let bump = |target: &str, add: u32| {
        format!(
            ".version 7.8\n.target {target}\n.address_size 64\n.visible .entry bump(.param .u64 p)\n{{\n .reg .u64 %rd<1>;\n .reg .u32 %r<2>;\n ld.param.u64 %rd0, [p];\n ld.global.u32 %r0, [%rd0];\n add.u32 %r1, %r0, {add};\n st.global.u32 [%rd0], %r1;\n ret;\n}}\n\0"
        )
    };
    let generic_first = build::image(&[build::entry(1, 80, 0x11, bump("sm_80", 1).as_bytes(), 0), build::entry(1, 90, 0x11 | 0x10_0000, bump("sm_90a", 100).as_bytes(), 0)]);
    let only_newer = build::image(&[build::entry(1, 100, 0x11, bump("sm_100", 1000).as_bytes(), 0)]);
    for (fatbin, want, what) in [(generic_first, 42, "the compute_80 code (41 + 1), not the compute_90a code"), (only_newer, 1041, "the compute_100 code (41 + 1000)")] {
        let file = vgpu_tests::per_process("linker-fatbin");
        std::fs::write(&file, &fatbin).expect("writing the fatbin");
        let mut c = sample("tenant_probe", &a);
        c.arg("link").arg(&file);
        let out = run_ok(c);
        let _ = std::fs::remove_file(&file);
        assert!(out.contains("add=CUDA_SUCCESS") && out.contains("complete=CUDA_SUCCESS"), "{out}");
        assert!(out.contains(&format!("counter={want}")), "{what} should have run:\n{out}");
    }
}
