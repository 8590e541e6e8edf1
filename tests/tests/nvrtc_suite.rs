//! Issue 11: CUDA C++ compiled by NVRTC runs on the CPU reference device.
//! tests/nvrtc/run_suite.py launches every kernel of tests/nvrtc/kernels
//! through libcuda.so.1, as PTX for compute_70, compute_80 and compute_90 on
//! a device configured for compute capability 9.0, and checks each result
//! against a host reference. scripts/setup.sh installs the suite's Python
//! environment (target/pyenv) and compiles the kernels (target/nvrtc).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use vgpu_tests::*;

/// The suite's Python; compiles what changed in the kernels since setup, once per test binary.
fn python() -> &'static PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let ws = workspace();
        let py = ws.join("target/pyenv/bin/python");
        assert!(py.exists(), "{} is missing: run scripts/setup.sh (it installs the NVRTC suite's Python environment)", py.display());
        for arch in ["compute_70", "compute_80", "compute_90"] {
            let d = ws.join("target/nvrtc").join(arch);
            assert!(d.is_dir(), "{} is missing: run scripts/setup.sh (it compiles the NVRTC suite's kernels)", d.display());
        }
        // Up-to-date PTX is not compiled again; this takes a fraction of a second then.
        run_ok(Command::new(&py).arg(ws.join("scripts/nvrtc-compile.py")));
        py
    })
}

fn run_suite(arch: &str) {
    let py = python();
    let ws = workspace();
    let m = Mediator::start(&["--device-memory", "512MiB", "--compute-capability", "9.0"]);
    let sock = m.tenant("nvrtc", "256MiB");
    let out = Command::new(py)
        .arg(ws.join("tests/nvrtc/run_suite.py"))
        .args(["--arch", arch])
        .arg("--lib")
        .arg(lib_dir().join("libcuda.so.1"))
        .arg("--ptx-dir")
        .arg(ws.join("target/nvrtc"))
        .env("VGPU_SOCKET", &sock)
        .env("VGPU_LOG", "1")
        .output()
        .expect("running tests/nvrtc/run_suite.py");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "the NVRTC suite failed with {arch} PTX ({}):\n{text}", out.status);
    assert!(text.contains(&format!("nvrtc suite {arch}: ")), "no summary line:\n{text}");
}

#[test]
fn nvrtc_suite_compute_70() {
    run_suite("compute_70");
}

#[test]
fn nvrtc_suite_compute_80() {
    run_suite("compute_80");
}

#[test]
fn nvrtc_suite_compute_90() {
    run_suite("compute_90");
}
