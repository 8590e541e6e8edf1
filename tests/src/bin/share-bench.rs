//! share-bench: how the CPU device's scheduler shares its lanes.
//!
//! 1. Weights: saturating tenants weighted 1:1:2:4, then 1:3, each running
//!    the same kernel (a fixed loop, a few ms) from two threads with four
//!    launches queued; prints each tenant's share of device time against
//!    its target (weight / sum of weights) and the largest error.
//! 2. Caps: a tenant capped at 25% saturating alone, then beside an
//!    uncapped one; prints its share of the device's capacity.
//! 3. Preemption: a victim tenant's launch latency (short one-block
//!    kernels, one at a time) alone and while an aggressor floods long
//!    multi-block kernels from two threads; p50 and p99, for a victim of
//!    the normal and of the latency class. Run twice: with kernels at
//!    the default compute nice value (below the worker's control threads)
//!    and with compute nice off, on one device each, for comparison.
//!
//! Usage: share-bench [--quick] [--secs S] [--latency-only]
//!        share-bench --tenants NAME=SOCKET:WEIGHT,... [--secs S]
//! The second form saturates existing tenants (the README's demo) and
//! prints their shares against their weights.

use serde_json::json;
use vgpu_tests::{shares, Mediator};

fn weights(m: &Mediator, tag: &str, weights: &[u32], secs: f64) -> f64 {
    let (got, used) = shares::measure(m, tag, weights, secs, 20_000);
    let wsum: u32 = weights.iter().sum();
    let ratio = weights.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(":");
    println!("weights {ratio}: {:.2} s of device time in {secs:.1} s", used.as_secs_f64());
    let mut worst = 0f64;
    for (i, (w, g)) in weights.iter().zip(&got).enumerate() {
        let (share, target) = (100.0 * g, 100.0 * *w as f64 / wsum as f64);
        worst = worst.max((share - target).abs());
        println!("  tenant {tag}{i} weight {w}: {share:5.1}% of device time, target {target:5.1}%, error {:+.1} points", share - target);
    }
    println!("  largest error {worst:.1} percentage points (must-show: at most 3)");
    worst
}

fn caps(m: &Mediator, secs: f64) {
    let w = shares::measure_specs(m, &[json!({"name": "cap-alone", "memory": "16MiB", "cap": 25})], secs, 20_000);
    println!("cap 25%, alone on the device ({} lanes): {:.1}% of its capacity (must-show: at most 27%)", w.lanes, 100.0 * w.of_capacity()[0]);
    let w = shares::measure_specs(m, &[json!({"name": "cap-shared", "memory": "16MiB", "cap": 25}), json!({"name": "cap-other", "memory": "16MiB"})], secs, 20_000);
    let c = w.of_capacity();
    println!("cap 25% beside an uncapped tenant of the same weight: {:.1}% (the other: {:.1}%)", 100.0 * c[0], 100.0 * c[1]);
}

fn latency(m: &Mediator, n: usize, label: &str) {
    println!("preemption, {label}:");
    const SHORT: u32 = 3_000;
    const LONG: u32 = 400_000;
    let agg = m.tenant_with(json!({"name": "aggressor", "memory": "16MiB"}))["socket"].as_str().unwrap().to_string();
    for class in ["normal", "latency"] {
        let sock = m.tenant_with(json!({"name": format!("victim-{class}"), "memory": "16MiB", "priority": class}))["socket"].as_str().unwrap().to_string();
        let alone = shares::victim_latencies(&sock, n, SHORT, None);
        let flooded = shares::victim_latencies(&sock, n, SHORT, Some((&agg, LONG, 8)));
        let (a50, a99) = (shares::percentile(&alone, 50.0), shares::percentile(&alone, 99.0));
        let (f50, f99) = (shares::percentile(&flooded, 50.0), shares::percentile(&flooded, 99.0));
        println!("victim ({class} class), {n} launches each:");
        println!("  alone:              p50 {:8.3} ms  p99 {:8.3} ms", a50.as_secs_f64() * 1e3, a99.as_secs_f64() * 1e3);
        println!("  aggressor flooding: p50 {:8.3} ms  p99 {:8.3} ms", f50.as_secs_f64() * 1e3, f99.as_secs_f64() * 1e3);
        println!("  p99 ratio {:.2}x (must-show: at most 1.5x)", f99.as_secs_f64() / a99.as_secs_f64());
    }
    let one = shares::Spinner::new(&agg, 8);
    println!("  (one aggressor launch alone takes {:.1} ms)", one.timed(LONG).as_secs_f64() * 1e3);
}

/// `--tenants NAME=SOCKET:WEIGHT,...`: shares of existing tenants.
fn existing(spec: &str, secs: f64) {
    let parsed: Vec<(String, String, u32)> = spec
        .split(',')
        .map(|t| {
            let (name, rest) = t.split_once('=').expect("NAME=SOCKET:WEIGHT");
            let (sock, w) = rest.rsplit_once(':').expect("NAME=SOCKET:WEIGHT");
            (name.to_string(), sock.to_string(), w.parse().expect("weight"))
        })
        .collect();
    let socks: Vec<String> = parsed.iter().map(|p| p.1.clone()).collect();
    let w = shares::measure_sockets(&socks, secs, 20_000);
    let wsum: u32 = parsed.iter().map(|p| p.2).sum();
    println!("{} tenants saturating the device for {secs:.1} s:", parsed.len());
    for (((name, _, weight), share), used) in parsed.iter().zip(w.shares()).zip(&w.used) {
        let target = 100.0 * *weight as f64 / wsum as f64;
        let lanes = used / w.wall.as_nanos() as f64;
        println!("  {name:<8} weight {weight}: {:5.1}% of the device time used (its weight's share: {target:4.1}%), {lanes:.2} lanes busy on average", 100.0 * share);
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let secs = std::env::args().skip_while(|a| a != "--secs").nth(1).and_then(|s| s.parse().ok()).unwrap_or(if quick { 2.0 } else { 8.0 });
    if let Some(spec) = std::env::args().skip_while(|a| a != "--tenants").nth(1) {
        return existing(&spec, secs);
    }
    let n = if quick { 100 } else { 400 };
    // The device's lanes (one per host core) are what the tenants share.
    // --isolation process|shared: how the mediator keeps tenants apart.
    let isolation = std::env::args().skip_while(|a| a != "--isolation").nth(1).unwrap_or_else(|| "process".into());
    println!("isolation={isolation}");
    let m = Mediator::start(&["--device-memory", "512MiB", "--isolation", &isolation]);
    if !std::env::args().any(|a| a == "--latency-only") {
        weights(&m, "a", &[1, 1, 2, 4], secs);
        weights(&m, "b", &[1, 3], secs);
        caps(&m, secs);
    }
    latency(&m, n, "kernels at the default compute nice (10)");
    drop(m);
    let off = Mediator::start(&["--device-memory", "512MiB", "--compute-nice", "0", "--isolation", &isolation]);
    latency(&off, n, "compute nice off (kernels at the control threads' priority)");
}
