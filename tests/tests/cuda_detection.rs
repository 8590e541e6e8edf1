//! A mediator built with the `cuda` backend on a machine without an NVIDIA
//! driver: it starts, serves CPU devices, and says why there is no GPU;
//! `required` mode and `discover` fail with the reason. (On a GPU machine
//! these checks do not apply and say so; tests/gpu_cuda.rs covers it.)

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::*;

fn no_gpu(test: &str) -> bool {
    if let Ok(v) = discover_gpus() {
        report_skip(test, &format!("this machine has a GPU ({}); tests/gpu_cuda.rs covers it", v["devices"][0]["model"]));
        return false;
    }
    true
}

#[test]
fn without_a_driver_the_mediator_serves_cpu_devices_and_logs_why() {
    if !no_gpu("without_a_driver_the_mediator_serves_cpu_devices_and_logs_why") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vgpu-nodrv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let child = Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(&dir).env("VGPU_LOG", "info").stderr(Stdio::piped()).spawn().expect("start");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(dir.join("api.sock")).is_err() {
        assert!(Instant::now() < deadline, "mediator did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    let devices = vgpu_api::http::request(&dir.join("api.sock"), "GET", "/devices", None).expect("devices").text();
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().expect("wait");
    let log = String::from_utf8_lossy(&out.stderr);
    let v: serde_json::Value = serde_json::from_str(&devices).expect("json");
    let kinds: Vec<&str> = v.as_array().expect("array").iter().map(|d| d["kind"].as_str().unwrap_or("")).collect();
    assert_eq!(kinds, ["cpu"], "{devices}");
    assert!(log.contains("serving CPU devices only: NVML is unavailable"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cuda_required_without_a_driver_fails_with_the_reason() {
    if !no_gpu("cuda_required_without_a_driver_fails_with_the_reason") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vgpu-req-{}", std::process::id()));
    let out = Command::new(bin("vgpu-mediatord")).arg("--run-dir").arg(&dir).args(["--cuda", "required"]).output().expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("devices.cuda is `required`, but NVML is unavailable"), "{err}");
    let out = Command::new(bin("vgpu-mediatord")).args(["--cuda", "sometimes"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2), "a bad --cuda value is a usage error");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn discover_without_a_driver_says_why() {
    if !no_gpu("discover_without_a_driver_says_why") {
        return;
    }
    let out = Command::new(bin("vgpu-mediatord")).arg("discover").output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("NVML is unavailable"));
}
