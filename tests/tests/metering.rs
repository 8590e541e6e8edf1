//! Issue 14, must-show 6: usage records add up (per-tenant device-seconds
//! sum to the device's busy time within 1%) and survive a worker kill;
//! `GET /usage?since=` serves them and the metrics counters do not reset.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vgpu_tests::{shares, Mediator};

fn load(socks: &[String], secs: f64) -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    for s in socks.iter().flat_map(|s| [s.clone(), s.clone()]) {
        let stop = stop.clone();
        std::thread::spawn(move || shares::saturate_until_lost(&s, 20_000, stop));
    }
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop
}

fn sum(records: &Value, kind: &str, field: &str, tenant: Option<&str>) -> f64 {
    records.as_array().expect("records").iter().filter(|r| r["type"] == kind && tenant.is_none_or(|t| r["tenant"] == t)).map(|r| r[field].as_f64().expect(field)).sum()
}

#[test]
fn usage_records_add_up_and_survive_a_worker_kill() {
    let m = Mediator::start(&["--device-memory", "256MiB", "--usage-interval", "1"]);
    let socks: Vec<String> = [("payg", 1), ("reserved", 2)].iter().map(|(n, w)| m.tenant_with(json!({"name": n, "memory": "16MiB", "weight": w}))["socket"].as_str().unwrap().to_string()).collect();
    // One tenant holds 4 MiB for the whole run: billed by the byte-second.
    let holder = shares::Spinner::new(&socks[1], 1);
    holder.c.call(virtio_gpu_compute::Request::MemAlloc(virtio_gpu_compute::MemAllocReq { ctx: holder.ctx(), reserved: 0, size: 4 << 20 })).expect("alloc");
    let start = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();

    // Load, then the worker is killed under it.
    let stop = load(&socks, 2.5);
    let before = m.metric("vgpu_tenant_device_seconds_total", "tenant=\"payg\",device=\"cpu0\"").expect("metric");
    assert!(before > 0.1, "payg used {before} s");
    let pid = m.worker_pid("cpu0");
    // SAFETY: signals the worker process the mediator reported.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    stop.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(20);
    while m.device("cpu0")["state"] != "running" || m.device("cpu0")["worker_pid"].as_u64() == Some(pid as u64) {
        assert!(Instant::now() < deadline, "the worker did not come back");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The tenants' executors come back after the worker (each a short
    // delay after it): the load below starts once both serve a launch.
    for s in &socks {
        while std::panic::catch_unwind(|| shares::Spinner::new(s, 1).timed(1)).is_err() {
            assert!(Instant::now() < deadline, "tenant socket {s} does not serve again");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // The counters go on from where they were, not from zero.
    let after_kill = m.metric("vgpu_tenant_device_seconds_total", "tenant=\"payg\",device=\"cpu0\"").expect("metric");
    assert!(after_kill >= before, "the counter went back from {before} to {after_kill}");
    let stop = load(&socks, 2.0);
    stop.store(true, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(2500));
    let after = m.metric("vgpu_tenant_device_seconds_total", "tenant=\"payg\",device=\"cpu0\"").expect("metric");
    assert!(after > after_kill + 0.1, "no usage counted after the restart: {after_kill} then {after}");

    let (st, recs) = m.api("GET", &format!("/usage?since={start}"), None);
    assert_eq!(st, 200, "{recs}");
    let tenants = sum(&recs, "tenant", "device_seconds", None);
    let busy = sum(&recs, "device", "busy_seconds", None);
    assert!(tenants > 1.0, "{recs}");
    assert!((tenants - busy).abs() <= 0.01 * busy, "tenants' device-seconds {tenants} against the device's busy time {busy}");
    // Both phases are in the records, and every field a bill needs.
    let payg = sum(&recs, "tenant", "device_seconds", Some("payg"));
    assert!(payg >= after * 0.95 && payg <= after * 1.05 + 0.05, "records {payg} s, counter {after} s");
    let r = recs.as_array().unwrap().iter().find(|r| r["type"] == "tenant").unwrap();
    for k in ["start", "end", "tenant", "device", "uuid", "device_seconds", "memory_byte_seconds", "spilled_byte_seconds", "kernels", "bytes_copied", "bytes_scrubbed"] {
        assert!(!r[k].is_null(), "record lacks {k}: {r}");
    }
    assert!(r["uuid"].as_str().unwrap().starts_with("GPU-"), "{r}");
    // The holder's connection died with the worker: 4 MiB for the ~3 s
    // before the kill.
    let mbs = sum(&recs, "tenant", "memory_byte_seconds", Some("reserved"));
    assert!(mbs > 1.0 * (4 << 20) as f64 && mbs < 6.0 * (4 << 20) as f64, "memory byte-seconds {mbs}: {recs}");

    // Filters and bad queries.
    let (_, only) = m.api("GET", &format!("/usage?since={start}&tenant=reserved"), None);
    assert!(only.as_array().unwrap().iter().all(|r| r["tenant"] == "reserved"), "{only}");
    let (_, none) = m.api("GET", "/usage?since=99999999999", None);
    assert_eq!(none, json!([]));
    let (st, _) = m.api("GET", "/usage?since=yesterday", None);
    assert_eq!(st, 400);
    let mut c = m.vgpuctl();
    c.args(["usage", "--tenant", "payg"]);
    let o = c.output().expect("vgpuctl usage");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.starts_with("END") && text.contains("payg") && !text.contains("reserved"), "{text}");
    // The file is JSON lines a billing system can read.
    let text = std::fs::read_to_string(m.run_dir.join("usage.jsonl")).expect("usage file");
    assert!(text.lines().all(|l| serde_json::from_str::<Value>(l).is_ok()), "{text}");
    // The metrics carry the device's uuid and model.
    let metrics = m.metrics();
    assert!(metrics.lines().any(|l| l.starts_with("vgpu_device_busy_seconds_total{device=\"cpu0\",uuid=\"GPU-") && l.contains("model=")), "{metrics}");

    // A deleted tenant leaves /metrics at once, and its end is recorded
    // after its usage.
    let (st, v) = m.api("DELETE", "/tenants/payg", None);
    assert!(st == 204 || st == 202, "{st} {v}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while m.api("GET", "/tenants/payg", None).0 != 404 {
        assert!(Instant::now() < deadline, "payg was not deleted");
        std::thread::sleep(Duration::from_millis(50));
    }
    let metrics = m.metrics();
    assert!(!metrics.contains("tenant=\"payg\""), "a deleted tenant stays in /metrics:\n{metrics}");
    assert!(metrics.contains("tenant=\"reserved\""), "{metrics}");
    let recs = loop {
        let (_, recs) = m.api("GET", &format!("/usage?since={start}&tenant=payg"), None);
        if recs.as_array().unwrap().iter().any(|r| r["type"] == "deleted") {
            break recs;
        }
        assert!(Instant::now() < deadline, "no deleted record for payg: {recs}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let last = recs.as_array().unwrap().last().unwrap();
    assert!(last["type"] == "deleted" && last["tenant"] == "payg" && last["at"].as_f64().unwrap() > start, "{recs}");
    let o = m.vgpuctl().args(["usage", "--tenant", "payg"]).output().expect("vgpuctl usage");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.lines().last().unwrap_or("").contains("(deleted)"), "{text}");
}

fn http_tcp(addr: &str, req: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics listener");
    s.write_all(req.as_bytes()).expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

/// Opt-in: with --metrics-listen, Prometheus can scrape GET /metrics over
/// TCP; nothing else of the API is served there.
#[test]
fn metrics_are_served_over_tcp_only_when_asked_and_only_metrics() {
    let addr = format!("127.0.0.1:{}", 20000 + std::process::id() % 20000);
    let m = Mediator::start(&["--device-memory", "64MiB", "--metrics-listen", &addr]);
    m.tenant_with(json!({"name": "scraped", "memory": "16MiB"}));
    let r = http_tcp(&addr, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 200") && r.contains("vgpu_tenant_memory_quota_bytes{tenant=\"scraped\",device=\"cpu0\",uuid=\"GPU-"), "{r}");
    let r = http_tcp(&addr, "GET /tenants HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 404"), "the management API is not on TCP: {r}");
    drop(m);
    let plain = Mediator::start(&["--device-memory", "64MiB"]);
    assert!(std::net::TcpStream::connect(&addr).is_err(), "no listener unless asked");
    drop(plain);
}

/// A long usage file: `GET /usage` answers in pages cut between
/// intervals, and `vgpuctl usage` reads them all, each record once.
#[test]
fn a_long_usage_file_is_served_in_pages_that_miss_nothing() {
    let dir = std::path::PathBuf::from(format!("/tmp/vgpu-usage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // 8000 intervals of 3 tenants, ending at 1000, 1001, ... (a long
    // history, older than anything the daemon writes itself).
    let mut text = String::new();
    for i in 0..8000 {
        for t in ["a", "b", "c"] {
            let r = json!({"type": "tenant", "start": 999 + i, "end": 1000 + i, "tenant": t, "device": "cpu0", "uuid": "GPU-x",
                "device_seconds": 1.0, "memory_byte_seconds": 0.0, "spilled_byte_seconds": 0.0, "kernels": i, "bytes_copied": 0, "bytes_scrubbed": 0});
            text += &format!("{r}\n");
        }
    }
    std::fs::write(dir.join("usage.jsonl"), text).unwrap();
    let m = Mediator::start_in(dir, &[]);
    // A page of 10 ends where an interval does: 9 records, 3 intervals.
    let (st, page) = m.api("GET", "/usage?since=4000&limit=10", None);
    assert_eq!(st, 200, "{page}");
    let ends: Vec<f64> = page.as_array().unwrap().iter().map(|r| r["end"].as_f64().unwrap()).collect();
    assert_eq!(ends, [4001.0, 4001.0, 4001.0, 4002.0, 4002.0, 4002.0, 4003.0, 4003.0, 4003.0], "{page}");
    // vgpuctl pages through everything since a time, each record once.
    let o = m.vgpuctl().args(["-o", "json", "usage", "--since", "1000"]).output().expect("vgpuctl usage");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all: Value = serde_json::from_slice(&o.stdout).expect("json");
    let all = all.as_array().unwrap();
    let old: Vec<&Value> = all.iter().filter(|r| r["end"].as_f64().is_some_and(|e| e < 9000.0)).collect();
    assert_eq!(old.len(), 3 * 7999, "records after 1000 of the 8000 intervals");
    assert!(old.windows(2).all(|w| (w[0]["end"].as_f64(), w[0]["tenant"].as_str()) < (w[1]["end"].as_f64(), w[1]["tenant"].as_str())), "out of order or twice");
}
