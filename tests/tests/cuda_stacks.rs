//! Real CUDA software runs unmodified on the vGPU's CPU device as a host
//! tenant: a C program on NVIDIA's CUDA runtime (libcudart 12.9 and 13.0)
//! that compiles its kernels with NVRTC, a C program on cuBLAS, numba-cuda,
//! CuPy for CUDA 12 and 13, and PyTorch as far as its cubin-only kernels
//! allow, each from PyPI
//! (pinned in tests/nvrtc and tests/stacks requirements, installed by
//! scripts/setup.sh in target/pyenv, pyenv13 and pyenvtorch). Each sees
//! its quota as the device's memory and gets out-of-memory past it.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use serde_json::json;
use vgpu_tests::*;

const QUOTA: u64 = 192 << 20;

/// A compute capability above every architecture NVIDIA's libraries ship
/// machine code for: a CPU device reporting it gets their
/// forward-compatible PTX (cuBLAS's GEMMs), as a GPU newer than the
/// libraries would (docs/cuda-stacks.md).
const PTX_ONLY_CC: &str = "13.0";

fn pyenv() -> PathBuf {
    python_env("pyenv")
}

/// target/NAME, a virtual environment scripts/setup.sh makes.
fn python_env(name: &str) -> PathBuf {
    let p = workspace().join("target").join(name);
    assert!(p.join("bin/python").exists(), "{} is missing: run scripts/setup.sh (it installs the CUDA stacks from PyPI)", p.display());
    p
}

/// NVIDIA's packages in target/pyenv (nvidia/cuda_runtime, ...).
fn nvidia(pkg: &str) -> PathBuf {
    nvidia_in("pyenv", pkg)
}

/// NVIDIA's packages in the environment target/`env`.
fn nvidia_in(env: &str, pkg: &str) -> PathBuf {
    let lib = python_env(env).join("lib");
    let site = std::fs::read_dir(&lib).unwrap_or_else(|e| panic!("{}: {e}", lib.display())).flatten().map(|e| e.path().join("site-packages")).find(|p| p.is_dir()).expect("site-packages");
    let d = site.join("nvidia").join(pkg);
    assert!(d.is_dir(), "{} is missing: run scripts/setup.sh", d.display());
    d
}

/// The library path a program on the CUDA runtime needs: our libcuda.so.1
/// first, then PyPI's libcudart (12, or 13 under nvidia/cu13) and libnvrtc.
fn library_path(runtime: Runtime) -> String {
    format!("{}:{}:{}", lib_dir().display(), runtime.dir().join("lib").display(), nvidia("cuda_nvrtc").join("lib").display())
}

/// The two CUDA runtimes the probe is built against.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Runtime {
    /// nvidia-cuda-runtime-cu12 12.9: `libcudart.so.12`.
    Cuda12,
    /// nvidia-cuda-runtime 13.0 (and nvidia-cuda-crt's headers): `libcudart.so.13`.
    Cuda13,
}

impl Runtime {
    fn dir(self) -> PathBuf {
        match self {
            Runtime::Cuda12 => nvidia("cuda_runtime"),
            Runtime::Cuda13 => nvidia("cu13"),
        }
    }
}

/// samples/runtime_probe.c, built once per test binary and runtime against
/// PyPI's CUDA runtime headers and library.
fn runtime_probe(runtime: Runtime) -> &'static PathBuf {
    static BIN12: OnceLock<PathBuf> = OnceLock::new();
    static BIN13: OnceLock<PathBuf> = OnceLock::new();
    let (cell, lib, tag) = match runtime {
        Runtime::Cuda12 => (&BIN12, "-l:libcudart.so.12", 12),
        Runtime::Cuda13 => (&BIN13, "-l:libcudart.so.13", 13),
    };
    cell.get_or_init(|| {
        let out = vgpu_tests::per_process(&format!("runtime_probe{tag}"));
        let mut cc = Command::new("cc");
        cc.args(["-O2", "-Wall", "-Werror"]).arg("-I").arg(runtime.dir().join("include"));
        if runtime == Runtime::Cuda12 {
            // CUDA 12 keeps crt/host_defines.h in the nvcc package.
            cc.arg("-I").arg(nvidia("cuda_nvcc").join("include"));
        }
        let st = cc
            .arg("-I")
            .arg(nvidia("cuda_nvrtc").join("include"))
            .arg("-o")
            .arg(&out)
            .arg(workspace().join("samples/runtime_probe.c"))
            .arg("-L")
            .arg(runtime.dir().join("lib"))
            .args([lib, "-ldl"])
            .status()
            .expect("running cc");
        assert!(st.success(), "compiling samples/runtime_probe.c against CUDA {tag} failed");
        out
    })
}

fn run(mut c: Command, what: &str, summary: &str) -> String {
    let o = c.output().unwrap_or_else(|e| panic!("running {what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    println!("{text}");
    assert!(o.status.success(), "{what} failed ({}):\n{text}", o.status);
    assert!(text.contains(summary), "{what}: no '{summary}' line:\n{text}");
    // A failed check's line starts with FAIL (an error quoted in a passed
    // check's line may contain the word, as CUBLAS_STATUS_EXECUTION_FAILED).
    assert!(!text.lines().any(|l| l.starts_with("FAIL")), "{what}:\n{text}");
    text
}

/// The runtime probe on `runtime`, as a tenant of a fresh daemon: every
/// check passes, and the tenant's memory is all back once it exits.
fn runtime_probe_passes(runtime: Runtime, want_version: &str) {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let sock = m.tenant("rt", "192MiB");
    let mut c = Command::new(runtime_probe(runtime));
    c.env("VGPU_SOCKET", &sock).env("LD_LIBRARY_PATH", library_path(runtime));
    let text = run(c, "runtime_probe", "runtime probe: all passed");
    assert!(text.contains(want_version), "the probe did not run on the runtime it was built for:\n{text}");
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
        "ok cudaMallocAsync, a kernel and cudaFreeAsync in stream order",
        "ok the pool's usage goes back to 0",
        "ok a pool allocation past the quota fails",
        "ok allocation past the quota fails",
        "ok all memory returned",
    ] {
        assert!(text.contains(check), "missing '{check}':\n{text}");
    }
    assert!(text.contains(&format!("quota: total {QUOTA} bytes")), "{text}");
    let t = m.api("GET", "/tenants/rt", None).1;
    assert_eq!(t["usage"]["used"].as_u64(), Some(0), "{t}");
}

#[test]
fn a_cuda_runtime_program_with_nvrtc_runs_on_the_cpu_device() {
    runtime_probe_passes(Runtime::Cuda12, "runtime 12090");
}

/// The same program built against the CUDA 13.0 runtime, which needs the
/// context-checks export table (263e8860) at start-up.
#[test]
fn the_same_program_on_the_cuda_13_runtime_runs_on_the_cpu_device() {
    runtime_probe_passes(Runtime::Cuda13, "runtime 13000");
}

/// samples/cublas_probe.c, built once per test binary against cuBLAS 13.4
/// and the CUDA 13 runtime from PyPI (target/pyenv13).
fn cublas_probe() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let cu13 = nvidia_in("pyenv13", "cu13");
        let out = vgpu_tests::per_process("cublas_probe");
        let st = Command::new("cc")
            .args(["-O2", "-Wall", "-Werror", "-I"])
            .arg(cu13.join("include"))
            .arg("-o")
            .arg(&out)
            .arg(workspace().join("samples/cublas_probe.c"))
            .arg("-L")
            .arg(cu13.join("lib"))
            .args(["-l:libcublasLt.so.13", "-l:libcublas.so.13", "-l:libcudart.so.13", "-lm"])
            .status()
            .expect("running cc");
        assert!(st.success(), "compiling samples/cublas_probe.c against cuBLAS 13 failed");
        out
    })
}

/// The cuBLAS probe as a tenant of a fresh daemon whose device reports `cc`.
fn cublas_probe_passes(cc: &str, args: &[&str]) -> String {
    let m = Mediator::start(&["--device-memory", "512MiB", "--compute-capability", cc]);
    let sock = m.tenant("blas", "192MiB");
    let mut c = Command::new(cublas_probe());
    c.args(args).env("VGPU_SOCKET", &sock).env("LD_LIBRARY_PATH", format!("{}:{}", lib_dir().display(), nvidia_in("pyenv13", "cu13").join("lib").display()));
    let text = run(c, "cublas_probe", "cublas probe: all passed");
    assert!(text.contains(&format!("compute {cc}")), "{text}");
    text
}

/// A C program on cuBLAS and cuBLASLt: on a device reporting an
/// architecture newer than cuBLAS knows, cuBLAS runs its
/// forward-compatible PTX (tensor-core GEMMs with `mma.sync`, `ldmatrix`,
/// `cp.async`) on the interpreter, and SGEMM (every transpose), DGEMM,
/// GemmEx with FP16 and BF16 operands, FP16 accumulation and TF32,
/// strided batches, and cuBLASLt's FP8 (E4M3) and BF16-with-bias-and-ReLU
/// products match a host reference.
#[test]
fn cublas_gemms_match_a_host_reference_on_a_ptx_only_architecture() {
    let text = cublas_probe_passes(PTX_ONLY_CC, &[]);
    for check in ["sgemm nn", "sgemm tt", "dgemm nt", "gemmex f16 in", "gemmex bf16 in", "hgemm nn", "gemmex tf32", "sgemm strided batched", "cublasLt fp8 e4m3", "cublasLt bf16 with bias and relu"] {
        assert!(text.contains(&format!("ok {check}")), "no passed '{check}' check:\n{text}");
    }
}

/// On the default device (compute 8.0), cuBLAS's GEMMs for it are
/// machine code: cublasCreate works, a GEMM fails with cuBLAS's status and
/// the program goes on.
#[test]
fn cublas_gemms_fail_clearly_where_cublas_has_only_machine_code() {
    let text = cublas_probe_passes("8.0", &["--expect-refused"]);
    assert!(text.contains("ok sgemm refused (CUBLAS_STATUS_") && text.contains("ok the process goes on"), "{text}");
}

fn numba_probe_passes(python: PathBuf) -> String {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let sock = m.tenant("numba", "192MiB");
    let mut c = Command::new(python);
    c.arg(workspace().join("tests/stacks/numba_probe.py")).arg(QUOTA.to_string()).env("VGPU_SOCKET", &sock).env("LD_LIBRARY_PATH", lib_dir());
    run(c, "numba_probe.py", "numba probe: all passed")
}

#[test]
fn numba_cuda_kernels_run_on_the_cpu_device() {
    numba_probe_passes(pyenv().join("bin/python"));
}

/// numba-cuda on cuda-bindings 13 and NVVM 13, as it runs on 12.
#[test]
fn numba_cuda_on_cuda_bindings_13_runs_on_the_cpu_device() {
    let py = workspace().join("target/pyenv13/bin/python");
    assert!(py.exists(), "{} is missing: run scripts/setup.sh (it installs the CUDA 13 stacks)", py.display());
    let text = numba_probe_passes(py);
    assert!(text.contains("cuda-bindings 13."), "the probe did not run on cuda-bindings 13:\n{text}");
}

/// The CuPy probe with `python` (its environment's CuPy build) as a
/// tenant of a fresh daemon whose device reports `cc`, checking matrix
/// products as `matmul` says (`--matmul` or `--matmul-refused`).
fn cupy_probe_passes(python: PathBuf, tag: &str, cc: &str, matmul: &str) -> String {
    let m = Mediator::start(&["--device-memory", "512MiB", "--compute-capability", cc]);
    m.tenant("cupy", "192MiB");
    let mut c = Command::new(python);
    c.arg(workspace().join("tests/stacks/cupy_probe.py")).arg(QUOTA.to_string()).arg(matmul).env("LD_LIBRARY_PATH", lib_dir()).env_remove("CUPY_COMPILE_WITH_PTX");
    // The environment is what `vgpuctl tenant env` gives a tenant's user:
    // its socket and, as the CPU device runs PTX, CuPy's setting to compile
    // its kernels to PTX (docs/cuda-stacks.md). CuPy's default
    // accelerator, CUB, runs from the PTX in its prebuilt fatbin.
    let env = run_ok(m.vgpuctl().args(["tenant", "env", "cupy"]));
    assert!(env.contains("export CUPY_COMPILE_WITH_PTX=1\n"), "{env}");
    for line in env.lines() {
        let (k, v) = line.strip_prefix("export ").and_then(|l| l.split_once('=')).unwrap_or_else(|| panic!("not an export line: {line}"));
        c.env(k, v.trim_matches('\''));
    }
    c.env_remove("CUPY_ACCELERATORS").env("CUPY_CACHE_DIR", vgpu_tests::per_process(&format!("cupy-cache-{tag}")));
    let text = run(c, "cupy_probe.py", "cupy probe: all passed");
    assert!(text.contains("accelerators: [1]"), "CuPy's default reduction accelerator (CUB) was in use:\n{text}");
    assert!(text.contains("ok multi-block reductions"), "{text}");
    text
}

/// On the default device (compute 8.0, for which cuBLAS ships machine
/// code only), a matrix product fails with cuBLAS's error and CuPy goes on.
#[test]
fn cupy_arrays_reductions_and_raw_kernels_run_on_the_cpu_device() {
    let text = cupy_probe_passes(pyenv().join("bin/python"), "12", "8.0", "--matmul-refused");
    assert!(text.contains("ok a matmul cuBLAS has no kernel for fails clearly"), "{text}");
}

/// CuPy for CUDA 12 with cuBLAS 12.9: on a device reporting an
/// architecture newer than cuBLAS knows, its products (FP32, FP16, FP64,
/// batched, matrix-vector, dot, complex) run its forward-compatible PTX
/// kernels and match NumPy's.
#[test]
fn cupy_matmul_runs_cublas_ptx_kernels_on_a_ptx_only_architecture() {
    let text = cupy_probe_passes(pyenv().join("bin/python"), "12-ptx", PTX_ONLY_CC, "--matmul");
    assert!(text.contains("ok matmul float32") && text.contains("ok complex64 matmul"), "{text}");
}

/// CuPy's CUDA 13 build: NVIDIA's CUDA 13.0 runtime inside it, CUB's
/// kernels as zstd-compressed compute_120 PTX, and cuBLAS 13.4's products.
#[test]
fn cupy_for_cuda_13_runs_on_the_cpu_device() {
    let text = cupy_probe_passes(python_env("pyenv13").join("bin/python"), "13", PTX_ONLY_CC, "--matmul");
    assert!(text.contains("cupy-cuda13x"), "the probe did not run CuPy's CUDA 13 build:\n{text}");
    assert!(text.contains("ok matmul float16") && text.contains("ok batched matmul"), "{text}");
}

/// PyTorch (PyPI's default wheel, CUDA 13.2) as far as its binaries allow
/// on a device that runs PTX: its kernels are cubins only. It initialises,
/// sees the quota as the device's memory, allocates and copies, raises
/// OutOfMemoryError past the quota, and a kernel launch fails with "no
/// kernel image is available" (CUDA_ERROR_NO_BINARY_FOR_GPU), after which
/// the process goes on.
#[test]
fn pytorch_initialises_allocates_copies_and_refuses_its_cubins_clearly() {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let sock = m.tenant("torch", "192MiB");
    torch_probe_passes(&sock);
}

/// The same through the `cuda` backend, in the tenant's executor: on a
/// GPU, or on the test double of NVIDIA's driver, which refuses cubins as
/// the CPU device does (its kernels run on the PTX interpreter).
#[test]
fn pytorch_on_the_cuda_backend_initialises_allocates_and_copies() {
    let test = "pytorch_on_the_cuda_backend_initialises_allocates_and_copies";
    let Some((m, gpu)) = gpu_mediator(test, &[]) else { return };
    if !m.on_test_driver {
        return report_skip(test, "a real GPU runs PyTorch's cubins: the GPU check is tests/tests/gpu_cuda.rs");
    }
    let v = m.tenant_with(json!({ "name": "torch", "memory": "192MiB", "device": gpu }));
    // cuBLAS 13.4 starts by getting a kernel whose only images are cubins
    // (refused by the double) and compute_120 PTX, which a compute 9.0
    // GPU cannot run: there cublasCreate is refused, clearly. A real GPU
    // runs the cubin.
    torch_probe_passes_with(v["socket"].as_str().expect("socket"), &["--cublas-refused"]);
}

/// PyTorch's products through cuBLAS on a device reporting an
/// architecture newer than cuBLAS knows: matmuls in FP32, FP16, BF16 and
/// FP64, addmm with a bias (a Linear layer's forward), bmm and an FP8
/// `_scaled_mm` run cuBLAS's forward-compatible PTX and match the host's;
/// PyTorch's own kernels (cubins) are still refused clearly.
#[test]
fn pytorch_matmuls_run_cublas_ptx_kernels_on_a_ptx_only_architecture() {
    let m = Mediator::start(&["--device-memory", "512MiB", "--compute-capability", PTX_ONLY_CC]);
    let sock = m.tenant("torch", "192MiB");
    torch_probe_passes_with(&sock, &["--matmul"]);
}

fn torch_probe_passes(sock: impl AsRef<std::ffi::OsStr>) {
    torch_probe_passes_with(sock, &[]);
}

fn torch_probe_passes_with(sock: impl AsRef<std::ffi::OsStr>, args: &[&str]) {
    let py = workspace().join("target/pyenvtorch/bin/python");
    assert!(py.exists(), "{} is missing: run scripts/setup.sh (it installs PyTorch)", py.display());
    let mut c = Command::new(py);
    c.arg(workspace().join("tests/stacks/torch_probe.py")).arg(QUOTA.to_string()).args(args).env("VGPU_SOCKET", sock.as_ref()).env("LD_LIBRARY_PATH", lib_dir());
    let text = run(c, "torch_probe.py", "torch probe: all passed");
    assert!(text.contains("built for CUDA 13."), "{text}");
    assert!(text.contains("no kernel image is available"), "{text}");
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
        .env("CUPY_CACHE_DIR", vgpu_tests::per_process("cupy-cache-cubin"))
        .output()
        .expect("python");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    println!("{text}");
    assert!(o.status.success(), "{text}");
    assert!(text.contains("refused:") && text.contains("CUDA_ERROR_NO_BINARY_FOR_GPU"), "{text}");
    assert!(text.contains("cubin images are machine code for a real GPU"), "{text}");
}

/// CuPy's CUB wrapper drops the error CUB returns, so a tenant whose host
/// budget cannot hold CUB's module gets a wrong sum and no exception. The
/// refusal is still there for the operator: counted in the tenant's
/// metrics and `vgpuctl tenant show`, and logged with the tenant's name
/// (docs/cuda-stacks.md). With the default budget the same sum is right.
#[test]
fn a_cupy_tenant_short_of_host_memory_shows_the_refused_load() {
    let log = vgpu_tests::per_process("cupy-short.log");
    let m = Mediator::start_logging(&["--device-memory", "256MiB"], &log);
    let script = "import cupy as cp\na = cp.arange(200000, dtype=cp.float64)\nprint('sum', float(a.sum()))\n";
    let sum = |tenant: &str| {
        let env = run_ok(m.vgpuctl().args(["tenant", "env", tenant]));
        let mut c = Command::new(pyenv().join("bin/python"));
        c.args(["-c", script]).env("LD_LIBRARY_PATH", lib_dir()).env("CUPY_CACHE_DIR", vgpu_tests::per_process("cupy-cache-short"));
        for line in env.lines() {
            let (k, v) = line.strip_prefix("export ").and_then(|l| l.split_once('=')).unwrap_or_else(|| panic!("not an export line: {line}"));
            c.env(k, v.trim_matches('\''));
        }
        run(c, "cupy sum", "sum ")
    };
    let refusals = |tenant: &str| m.metric("vgpu_tenant_host_memory_refusals_total", &format!("tenant=\"{tenant}\",device=\"cpu0\"")).expect("refusals metric") as u64;
    m.tenant_with(json!({ "name": "short", "memory": "64MiB", "host_memory": "96MiB" }));
    sum("short");
    assert!(refusals("short") >= 1, "the refused module load was not counted");
    let show = run_ok(m.vgpuctl().args(["tenant", "show", "short"]));
    assert!(!show.contains("(0 requests refused)"), "{show}");
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(logged.lines().any(|l| l.contains("short") && l.contains("refused a request")), "{logged}");
    m.tenant("ample", "64MiB");
    let text = sum("ample");
    assert!(text.contains("sum 19999900000.0"), "{text}");
    assert_eq!(refusals("ample"), 0);
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

/// pynvml reads the tenant's GPU from the vGPU's libnvidia-ml.so.1 (the
/// same shared object as libcuda.so.1): one device, the metrics' UUID,
/// memory as the quota, a utilization, and NOT_SUPPORTED for what a vGPU
/// has no value for.
#[test]
fn pynvml_sees_the_tenants_gpu_with_its_quota_and_the_metrics_uuid() {
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    let sock = m.tenant("nvml", "192MiB");
    run_ok(sample("vectorAdd", &sock));
    // Another tenant's process holds memory meanwhile: it is never listed.
    let other = m.tenant("nvml-other", "64MiB");
    let probe = workspace().join("tests/stacks/nvml_probe.py");
    let mut holder = Command::new(pyenv().join("bin/python"))
        .arg(&probe)
        .args(["hold", "16"])
        .env("VGPU_SOCKET", &other)
        .env("LD_LIBRARY_PATH", lib_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the other tenant's holder");
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.as_mut().expect("stdout")), &mut ready).expect("holder output");
    assert_eq!(ready.trim(), "ready", "the other tenant's holder did not start");
    let mut c = Command::new(pyenv().join("bin/python"));
    c.arg(&probe).env("VGPU_SOCKET", &sock).env("LD_LIBRARY_PATH", lib_dir());
    let out = run_ok(c);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let metrics = m.metrics();
    let uuid = metrics.lines().find_map(|l| l.strip_prefix("vgpu_device_busy_seconds_total{device=\"cpu0\",uuid=\"")).and_then(|r| r.split('"').next()).expect("uuid in the metrics");
    assert_eq!((v["count"].as_u64(), v["uuid"].as_str(), v["total"].as_u64()), (Some(1), Some(uuid), Some(QUOTA)), "{v}");
    assert_eq!(v["used"].as_u64().zip(v["free"].as_u64()).map(|(u, f)| u + f), Some(QUOTA), "{v}");
    assert!(v["util"].as_u64().is_some_and(|u| u <= 100), "{v}");
    assert_eq!(
        (v["by_uuid"].as_bool(), v["temperature"].as_str(), v["second"].as_str(), v["processes_before"].as_u64()),
        (Some(true), Some("not supported"), Some("invalid argument"), Some(0)),
        "{v}"
    );
    // Its own process, once it holds a context: its pid, the 4 MiB it
    // allocated, its name from /proc; the other tenant's holder is not there.
    let procs = v["processes"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(procs.len(), 1, "only the probe's own process: {v}");
    assert_eq!((procs[0]["pid"].as_u64(), procs[0]["used"].as_u64()), (v["self"].as_u64(), Some(4 << 20)), "{v}");
    assert!(procs[0]["name"].as_str().is_some_and(|n| n.contains("python")), "{v}");
    assert_eq!(v["graphics"].as_u64(), Some(0), "{v}");
    // vgpu-smi lists the other tenant's holder to that tenant, as
    // nvidia-smi --query-compute-apps does.
    let mut c = Command::new(bin("vgpu-smi"));
    c.args(["--query-compute-apps=pid,process_name,used_memory", "--format=csv"]).arg("--socket").arg(&other);
    let out = run_ok(c);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first().copied(), Some("pid, process_name, used_gpu_memory [MiB]"), "{out}");
    assert_eq!(lines.len(), 2, "{out}");
    let cols: Vec<&str> = lines[1].split(", ").collect();
    assert_eq!((cols[0], cols[2]), (holder.id().to_string().as_str(), "16 MiB"), "{out}");
    assert!(cols[1].contains("python"), "{out}");
    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder").success());
    // Its process gone (its connection closed), the tenant lists none.
    let listed = || {
        let mut c = Command::new(bin("vgpu-smi"));
        c.args(["--query-compute-apps=pid", "--format=csv,noheader"]).arg("--socket").arg(&other);
        run_ok(c).trim().to_string()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !listed().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(listed(), "", "the holder exited");
    assert!(v["name"].as_str().is_some_and(|n| !n.is_empty()) && v["cuda"].as_i64().is_some_and(|c| c >= 12000), "{v}");
    // Without a vGPU, nvmlInit says so instead of crashing.
    let mut c = Command::new(pyenv().join("bin/python"));
    c.args(["-c", "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n    print('refused:', e)\n"]).env("VGPU_SOCKET", "/nonexistent.sock").env("LD_LIBRARY_PATH", lib_dir());
    let out = run_ok(c);
    assert!(out.contains("refused: Driver Not Loaded"), "{out}");
}
