//! The VM's API socket: pause stops the vCPUs (the guest's counter stops
//! advancing), resume continues, shutdown asks the guest to reboot (it ends
//! cleanly), kill ends it at once.

use std::time::{Duration, Instant};

use vgpu_tests::vmm_harness::*;

fn last_tick(serial: &str) -> u64 {
    serial.lines().filter_map(|l| l.strip_prefix("tick ")).filter_map(|n| n.trim().parse().ok()).next_back().unwrap_or(0)
}

#[test]
fn pause_stops_the_guest_resume_continues_and_shutdown_ends_it_cleanly() {
    if !kvm_available("pause_stops_the_guest_resume_continues_and_shutdown_ends_it_cleanly") {
        return;
    }
    let mut g = Guest::start("count", &["--vcpus", "2"]);
    g.wait_api();
    g.wait_for("tick 2", Duration::from_secs(60));

    let (code, body) = g.api_call("GET", "/vm");
    assert_eq!(code, 200, "{body}");
    let info: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(info["state"], "running");
    assert_eq!(info["vcpus"], 2);
    assert_eq!(info["memory_bytes"], 16u64 << 20);
    assert_eq!(info["memory_backing"], "memfd");
    assert_eq!(info["config"]["cmdline"], "test=count");

    assert_eq!(g.api_call("PUT", "/vm/pause").0, 204);
    let paused_at = g.serial_text().len();
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(g.serial_text().len(), paused_at, "the guest kept printing while paused");
    let (_, body) = g.api_call("GET", "/vm");
    assert!(body.contains("\"paused\""), "{body}");
    let (code, _) = g.api_call("PUT", "/vm/shutdown");
    assert_eq!(code, 409, "shutdown of a paused VM is refused");

    let before = last_tick(&g.serial_text());
    assert_eq!(g.api_call("PUT", "/vm/resume").0, 204);
    let deadline = Instant::now() + Duration::from_secs(60);
    while last_tick(&g.serial_text()) < before + 2 {
        assert!(Instant::now() < deadline, "the counter did not advance after resume");
        std::thread::sleep(Duration::from_millis(20));
    }

    assert_eq!(g.api_call("PUT", "/vm/shutdown").0, 202);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert!(out.contains("shutdown requested") && out.contains("TEST PASSED count"), "{out}");
    assert_eq!(st.code(), Some(0), "{err}");
}

#[test]
fn kill_ends_the_vm_at_once() {
    if !kvm_available("kill_ends_the_vm_at_once") {
        return;
    }
    let mut g = Guest::start("count", &[]);
    g.wait_api();
    g.wait_for("tick 1", Duration::from_secs(60));
    let t = Instant::now();
    assert_eq!(g.api_call("PUT", "/vm/kill").0, 204);
    let api = g.api.clone();
    let (st, err, _) = g.wait_exit(Duration::from_secs(10));
    assert_eq!(st.code(), Some(4), "{err}");
    assert!(err.contains("killed"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "kill took {:?}", t.elapsed());
    assert!(!api.exists(), "the API socket is removed on exit");
}

#[test]
fn unknown_api_paths_are_not_found() {
    if !kvm_available("unknown_api_paths_are_not_found") {
        return;
    }
    let mut g = Guest::start("count", &[]);
    g.wait_api();
    g.wait_for("tick 1", Duration::from_secs(60));
    assert_eq!(g.api_call("GET", "/nope").0, 404);
    assert_eq!(g.api_call("POST", "/vm/pause").0, 405);
    assert_eq!(g.api_call("PUT", "/vm/kill").0, 204);
}
