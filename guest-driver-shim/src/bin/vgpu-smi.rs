//! vgpu-smi: shows this tenant's vGPU, its memory against the quota, and
//! its kernels and device time, as the device reports them.
//!
//! Usage: vgpu-smi [-o json] [--socket PATH]   (default: $VGPU_SOCKET, else
//! the virtio-gpu render node inside a VM)

use cuda::client::Client;
use virtio_gpu_compute::name_str;

fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

fn main() {
    // Output piped into `head` ends the program quietly.
    // SAFETY: restoring a signal's default action before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let mut json = false;
    let mut socket = std::env::var("VGPU_SOCKET").ok();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-o" | "--output" => json = args.next().as_deref() == Some("json"),
            "--socket" => socket = args.next(),
            "-h" | "--help" => {
                println!("usage: vgpu-smi [-o json] [--socket PATH]\nShows the vGPU of the tenant whose socket is given (default: $VGPU_SOCKET; in a VM, the virtio-gpu device).");
                return;
            }
            other => {
                eprintln!("vgpu-smi: unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    let client = match &socket {
        Some(path) => Client::connect_unix(path),
        None => Client::from_env(),
    };
    let r = client.and_then(|c| Ok((c.device_info()?, c.tenant_info()?)));
    let (d, t) = match r {
        Ok(v) => v,
        Err(e) => {
            eprintln!("vgpu-smi: {e}");
            std::process::exit(1);
        }
    };
    let uuid: String = d.uuid.iter().map(|b| format!("{b:02x}")).collect();
    if json {
        println!(
            "{{\"device\":{{\"name\":{:?},\"uuid\":\"{uuid}\",\"compute_capability\":\"{}.{}\",\"instruction_budget\":{}}},\"tenant\":{{\"name\":{:?},\"quota\":{},\"used\":{},\"kernels\":{},\"device_seconds\":{:.6},\"bytes_scrubbed\":{},\"weight\":{}}}}}",
            name_str(&d.name), d.cc_major, d.cc_minor, d.instruction_budget, name_str(&t.name), t.quota, t.used, t.kernels, t.device_ns as f64 / 1e9, t.bytes_scrubbed, t.weight
        );
        return;
    }
    let pct = if t.quota == 0 { 0.0 } else { 100.0 * t.used as f64 / t.quota as f64 };
    println!("vgpu-smi   protocol v{}   driver API {}.{}", virtio_gpu_compute::VERSION, cuda::api::DRIVER_VERSION / 1000, cuda::api::DRIVER_VERSION % 1000 / 10);
    println!("Device 0   {}   uuid {uuid}   cc {}.{}", name_str(&d.name), d.cc_major, d.cc_minor);
    println!("Tenant     {}   weight {}", name_str(&t.name), t.weight);
    println!("Memory     {} used / {} quota ({pct:.1}%)", human(t.used), human(t.quota));
    println!("Kernels    {}   device time {:.3} s   scrubbed {}", t.kernels, t.device_ns as f64 / 1e9, human(t.bytes_scrubbed));
}
