//! Issue 13: real CUDA software runs unmodified on the vGPU's CPU device as
//! a host tenant: a C program on NVIDIA's CUDA runtime (libcudart 12.9)
//! that compiles its kernels with NVRTC, numba-cuda, and CuPy, each from
//! PyPI (pinned in tests/nvrtc and tests/stacks requirements, installed by
//! scripts/setup.sh in target/pyenv). Each sees its quota as the device's
//! memory and gets out-of-memory past it.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use vgpu_tests::*;

const QUOTA: u64 = 192 << 20;

fn pyenv() -> PathBuf {
    let p = workspace().join("target/pyenv");
    assert!(p.join("bin/python").exists(), "{} is missing: run scripts/setup.sh (it installs the CUDA stacks from PyPI)", p.display());
    p
}

/// NVIDIA's packages in the environment (nvidia/cuda_runtime, ...).
fn nvidia(pkg: &str) -> PathBuf {
    let site = std::fs::read_dir(pyenv().join("lib")).expect("target/pyenv/lib").flatten().map(|e| e.path().join("site-packages")).find(|p| p.is_dir()).expect("site-packages in target/pyenv");
    let d = site.join("nvidia").join(pkg);
    assert!(d.is_dir(), "{} is missing: run scripts/setup.sh", d.display());
    d
}

/// The library path a program on the CUDA runtime needs: our libcuda.so.1
/// first, then PyPI's libcudart and libnvrtc.
fn library_path() -> String {
    format!("{}:{}:{}", lib_dir().display(), nvidia("cuda_runtime").join("lib").display(), nvidia("cuda_nvrtc").join("lib").display())
}

/// samples/runtime_probe.c, built once per test binary against PyPI's
/// CUDA runtime headers and libcudart.so.12.
fn runtime_probe() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = bin_dir().join(format!("runtime_probe-{}", std::process::id()));
        let st = Command::new("cc")
            .args(["-O2", "-Wall", "-Werror"])
            .arg("-I")
            .arg(nvidia("cuda_runtime").join("include"))
            .arg("-I")
            .arg(nvidia("cuda_nvcc").join("include"))
            .arg("-I")
            .arg(nvidia("cuda_nvrtc").join("include"))
            .arg("-o")
            .arg(&out)
            .arg(workspace().join("samples/runtime_probe.c"))
            .arg("-L")
            .arg(nvidia("cuda_runtime").join("lib"))
            .args(["-l:libcudart.so.12", "-ldl"])
            .status()
            .expect("running cc");
        assert!(st.success(), "compiling samples/runtime_probe.c failed");
        out
    })
}

fn run(mut c: Command, what: &str, summary: &str) -> String {
    let o = c.output().unwrap_or_else(|e| panic!("running {what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    println!("{text}");
    assert!(o.status.success(), "{what} failed ({}):\n{text}", o.status);
    assert!(text.contains(summary), "{what}: no '{summary}' line:\n{text}");
    assert!(!text.contains("FAIL"), "{what}:\n{text}");
    text
}

#[test]
fn a_cuda_runtime_program_with_nvrtc_runs_on_the_cpu_device() {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let sock = m.tenant("rt", "192MiB");
    let mut c = Command::new(runtime_probe());
    c.env("VGPU_SOCKET", &sock).env("LD_LIBRARY_PATH", library_path());
    let text = run(c, "runtime_probe", "runtime probe: all passed");
    for check in [
        "ok nvrtc",
        "ok memory info is the quota",
        "ok axpy through cudaLaunchKernel",
        "ok a driver CUfunction through cudaLaunchKernel",
        "ok the driver module unloads",
        "ok device copy, memset, unified copies",
        "ok shared-memory block sums on a stream",
        "ok host function runs in stream order",
        "ok atomics on a module global",
        "ok pitched 2D copies",
        "ok stream capture and graph replay",
        "ok allocation past the quota fails",
        "ok all memory returned",
    ] {
        assert!(text.contains(check), "missing '{check}':\n{text}");
    }
    assert!(text.contains(&format!("quota: total {QUOTA} bytes")), "{text}");
    // The tenant's memory is all back once the program exits.
    let t = m.api("GET", "/tenants/rt", None).1;
    assert_eq!(t["usage"]["used"].as_u64(), Some(0), "{t}");
}

#[test]
fn numba_cuda_kernels_run_on_the_cpu_device() {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let sock = m.tenant("numba", "192MiB");
    let mut c = Command::new(pyenv().join("bin/python"));
    c.arg(workspace().join("tests/stacks/numba_probe.py")).arg(QUOTA.to_string()).env("VGPU_SOCKET", &sock).env("LD_LIBRARY_PATH", lib_dir());
    run(c, "numba_probe.py", "numba probe: all passed");
}

#[test]
fn cupy_arrays_reductions_and_raw_kernels_run_on_the_cpu_device() {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let sock = m.tenant("cupy", "192MiB");
    let mut c = Command::new(pyenv().join("bin/python"));
    c.arg(workspace().join("tests/stacks/cupy_probe.py"))
        .arg(QUOTA.to_string())
        .env("VGPU_SOCKET", &sock)
        .env("LD_LIBRARY_PATH", lib_dir())
        // The CPU device runs PTX: CuPy is told to compile its kernels to
        // PTX (docs/cuda-stacks.md). Its default accelerator, CUB, runs
        // from the PTX in CuPy's prebuilt fatbin.
        .env("CUPY_COMPILE_WITH_PTX", "1")
        .env_remove("CUPY_ACCELERATORS")
        .env("CUPY_CACHE_DIR", bin_dir().join(format!("cupy-cache-{}", std::process::id())));
    let text = run(c, "cupy_probe.py", "cupy probe: all passed");
    assert!(text.contains("accelerators: [1]"), "CuPy's default reduction accelerator (CUB) was in use:\n{text}");
    assert!(text.contains("ok multi-block reductions"), "{text}");
}

/// Without the CuPy settings above, its default cubins are refused with a
/// clear error rather than misread (and nothing crashes).
#[test]
fn cubins_are_refused_with_no_binary_for_gpu() {
    let m = Mediator::start(&["--device-memory", "256MiB"]);
    let sock = m.tenant("cubin", "64MiB");
    let script = "import cupy as cp\ntry:\n    (cp.arange(4) * 2).get()\n    print('unexpected success')\nexcept Exception as e:\n    print('refused:', e)\n";
    let o = Command::new(pyenv().join("bin/python"))
        .args(["-c", script])
        .env("VGPU_SOCKET", &sock)
        .env("LD_LIBRARY_PATH", lib_dir())
        .env("VGPU_LOG", "1")
        .env("CUPY_CACHE_DIR", bin_dir().join(format!("cupy-cache-cubin-{}", std::process::id())))
        .output()
        .expect("python");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    println!("{text}");
    assert!(o.status.success(), "{text}");
    assert!(text.contains("refused:") && text.contains("CUDA_ERROR_NO_BINARY_FOR_GPU"), "{text}");
    assert!(text.contains("cubin images are machine code for a real GPU"), "{text}");
}

/// The device worker answers the whole `CUdevice_attribute` table the shim
/// hands runtimes (on a GPU, the hardware's own values), with what the
/// vGPU does not offer reading 0.
#[test]
fn the_worker_answers_every_device_attribute() {
    use virtio_gpu_compute::{attrs, Reply, Request};
    let m = Mediator::start(&["--compute-capability", "9.0"]);
    let sock = m.tenant("attrs", "16MiB");
    let mut r = Raw::connect(&sock);
    let t = match r.call(Request::GetDeviceAttributes) {
        Reply::Attributes(t) => t,
        o => panic!("{o:?}"),
    };
    assert_eq!(t.len(), attrs::COUNT);
    assert_eq!((t[75], t[76]), (9, 0), "compute capability");
    assert_eq!((t[41], t[83], t[95], t[115]), (1, 0, 0, 0), "unified addressing on; managed memory, cooperative launch, pools off");
    assert!((1..=138).all(|a| t[a] != attrs::UNSUPPORTED), "{t:?}");
}
