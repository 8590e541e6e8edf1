//! share-bench: saturating tenants with different weights on one CPU
//! device; prints each tenant's share of device time against its target
//! (weight / sum of weights) and the largest error, for 1:1:2:4 and 1:3.
//! Every tenant runs the same kernel (a fixed loop, a few ms) from two
//! threads, each keeping four launches queued.
//!
//! Usage: share-bench [--quick] [--secs S]

use vgpu_tests::{shares, Mediator};

fn run(m: &Mediator, tag: &str, weights: &[u32], secs: f64) -> f64 {
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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let secs = std::env::args().skip_while(|a| a != "--secs").nth(1).and_then(|s| s.parse().ok()).unwrap_or(if quick { 2.0 } else { 8.0 });
    // The device's lanes (one per host core) are what the tenants share.
    let m = Mediator::start(&["--device-memory", "512MiB"]);
    run(&m, "a", &[1, 1, 2, 4], secs);
    run(&m, "b", &[1, 3], secs);
}
