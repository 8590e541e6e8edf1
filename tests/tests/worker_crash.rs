//! Must-show 6: a worker killed with SIGKILL gives its tenants an error, is
//! restarted by the control plane, and serves new work.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

use vgpu_tests::*;

#[test]
fn killed_worker_errors_its_tenants_restarts_and_serves_again() {
    let log = per_process("worker-crash.log");
    let m = Mediator::start_logging_at(&["--cpu-devices", "2", "--device-memory", "64MiB"], &log, "info");
    let a = m.tenant("before", "16MiB");
    let (_, v) = m.api("GET", "/tenants/before", None);
    let dev = v["device"].as_str().expect("device").to_string();
    let mut holder = sample("tenant_probe", &a);
    holder.args(["hold", "4096"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = holder.spawn().expect("spawn");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("ptr");

    let pid = m.device(&dev)["worker_pid"].as_u64().expect("pid") as i32;
    assert!(pid > 0);
    // The process holding the tenant's state: the worker itself, or, with
    // an executor per tenant, its executor, which ends when its arbiter
    // (the worker) is gone.
    let served = m.serving_pid(&dev, "before");
    // SAFETY: signals the worker process the mediator reported.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // A call that reaches the executor before it has seen its arbiter go
    // still completes; the client's next call is made once the state it
    // refers to is gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(format!("/proc/{served}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
        assert!(Instant::now() < deadline, "the tenant's executor outlived its arbiter by 10 s");
        std::thread::sleep(Duration::from_millis(10));
    }

    // The connected client's next call fails cleanly.
    child.stdin.take().expect("stdin").write_all(b"go\n").expect("write");
    let status = child.wait().expect("wait");
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("stderr");
    assert!(!status.success());
    assert!(err.contains("CUDA_ERROR_DEVICE_UNAVAILABLE"), "{err}");

    // The control plane restarts the worker and re-creates its tenants.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let d = m.device(&dev);
        if d["state"] == "running" && d["worker_restarts"] == 1 && d["worker_pid"].as_u64() != Some(pid as u64) {
            break;
        }
        assert!(Instant::now() < deadline, "worker not restarted: {d}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(m.metric("vgpu_device_worker_restarts_total", &format!("device=\"{dev}\"")), Some(1.0));
    assert!(run_ok(sample("vectorAdd", &a)).contains("PASSED"), "existing tenant works again");
    // With an executor per tenant, the restart gave the tenant one new
    // executor: the re-population and the old executor's own restart
    // both ask, and the second finds the first's, instead of replacing it.
    if served != pid as u32 {
        std::thread::sleep(Duration::from_millis(500));
        let text = std::fs::read_to_string(&log).expect("log");
        let starts = text.lines().filter(|l| l.contains("tenant executor started") && l.contains("tenant=before")).count();
        assert_eq!(starts, 2, "executor starts for tenant `before` (one at creation, one after the restart):\n{text}");
    }
    let (_, v) = m.api("POST", "/tenants", Some(serde_json::json!({ "name": "after", "memory": "16MiB", "device": dev })));
    let b = std::path::PathBuf::from(v["socket"].as_str().expect("socket"));
    assert!(run_ok(sample("matrixMul", &b).arg("64")).contains("PASSED"), "new tenant works");
}
