//! vgpu-smi: shows this tenant's vGPU, its memory against the quota, and
//! its kernels and device time, as the device reports them. It answers the
//! nvidia-smi forms monitoring scripts use (`-L`, `--query-gpu=...
//! --format=csv[,noheader,nounits]`, `-l SECONDS`, `-q`, `--version`), for
//! the one GPU a tenant sees: memory is its quota, utilization its share
//! of the device's time.
//!
//! The socket is `--socket`, else `$VGPU_SOCKET`, else the virtio-gpu
//! render node inside a VM.

use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use cuda::client::Client;
use virtio_gpu_compute::{name_str, uuid_text, DeviceInfo, TenantInfo};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Parser)]
#[command(name = "vgpu-smi", version, about = "Shows the vGPU of a tenant: its device, memory against its quota, kernels and device time")]
struct Cli {
    /// Output of the default view.
    #[arg(short, long, value_enum, default_value = "table")]
    output: Output,
    /// The tenant's socket (default: $VGPU_SOCKET; in a VM, the virtio-gpu device).
    #[arg(long)]
    socket: Option<String>,
    /// Lists the GPUs, one line each, as nvidia-smi -L.
    #[arg(short = 'L', long = "list-gpus")]
    list_gpus: bool,
    /// Comma-separated fields, as nvidia-smi --query-gpu: index, name, uuid,
    /// driver_version, compute_cap, memory.total, memory.used,
    /// memory.free, utilization.gpu, pci.bus_id.
    #[arg(long = "query-gpu", value_name = "FIELDS")]
    query_gpu: Option<String>,
    /// With --query-gpu: csv, optionally with noheader and nounits
    /// (e.g. csv,noheader,nounits).
    #[arg(long, value_name = "FORMAT")]
    format: Option<String>,
    /// Prints again every SECONDS until interrupted.
    #[arg(short = 'l', long = "loop", value_name = "SECONDS")]
    every: Option<u64>,
    /// A detailed report, as nvidia-smi -q.
    #[arg(short, long)]
    query: bool,
    /// The GPU to show: a tenant sees one, index 0.
    #[arg(short = 'i', long = "id")]
    id: Option<String>,
}

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

fn fail(code: i32, msg: impl std::fmt::Display) -> ! {
    eprintln!("vgpu-smi: {msg}");
    std::process::exit(code)
}

/// The fields --query-gpu knows, with their units in a csv header.
const FIELDS: &[(&str, &str)] = &[
    ("index", ""),
    ("name", ""),
    ("uuid", ""),
    ("driver_version", ""),
    ("compute_cap", ""),
    ("memory.total", "MiB"),
    ("memory.used", "MiB"),
    ("memory.free", "MiB"),
    ("utilization.gpu", "%"),
    ("pci.bus_id", ""),
];

/// One look at the device and the tenant, and the tenant's share of the
/// device's time since the look before (or over a short window).
struct Sample {
    d: DeviceInfo,
    t: TenantInfo,
    utilization: f64,
}

struct Probe {
    c: Client,
    last: Option<(Instant, u64)>,
}

impl Probe {
    fn tenant(&self) -> TenantInfo {
        self.c.tenant_info().unwrap_or_else(|e| fail(1, e))
    }

    fn sample(&mut self) -> Sample {
        let d = self.c.device_info().unwrap_or_else(|e| fail(1, e));
        let (t0, ns0) = match self.last {
            Some(l) => l,
            None => {
                // No earlier look: measure over a short window.
                let first = (Instant::now(), self.tenant().device_ns);
                std::thread::sleep(Duration::from_millis(200));
                first
            }
        };
        let t = self.tenant();
        let now = Instant::now();
        let wall = now.duration_since(t0).as_nanos().max(1) as f64;
        let utilization = (100.0 * t.device_ns.saturating_sub(ns0) as f64 / wall).min(100.0);
        self.last = Some((now, t.device_ns));
        Sample { d, t, utilization }
    }
}

fn field(s: &Sample, name: &str, units: bool) -> String {
    let mib = |b: u64| if units { format!("{} MiB", b >> 20) } else { (b >> 20).to_string() };
    match name {
        "index" => "0".into(),
        "name" => name_str(&s.d.name),
        "uuid" => uuid_text(&s.d.uuid),
        "driver_version" => cuda::api::driver_version_text(),
        "compute_cap" => format!("{}.{}", s.d.cc_major, s.d.cc_minor),
        "memory.total" => mib(s.t.quota),
        "memory.used" => mib(s.t.used),
        "memory.free" => mib(s.t.quota.saturating_sub(s.t.used)),
        "utilization.gpu" => {
            let p = s.utilization.round() as u64;
            if units {
                format!("{p} %")
            } else {
                p.to_string()
            }
        }
        // A vGPU has no PCI address of its own to show.
        _ => "[N/A]".into(),
    }
}

fn table(s: &Sample) {
    let (d, t) = (&s.d, &s.t);
    let pct = if t.quota == 0 { 0.0 } else { 100.0 * t.used as f64 / t.quota as f64 };
    println!("vgpu-smi   protocol v{}   driver API {}", virtio_gpu_compute::VERSION, cuda::api::driver_version_text());
    println!("Device 0   {}   uuid {}   cc {}.{}", name_str(&d.name), uuid_text(&d.uuid), d.cc_major, d.cc_minor);
    println!("Tenant     {}   weight {}", name_str(&t.name), t.weight);
    println!("Memory     {} used / {} quota ({pct:.1}%)", human(t.used), human(t.quota));
    println!("Kernels    {}   device time {:.3} s   scrubbed {}   utilization {:.0} %", t.kernels, t.device_ns as f64 / 1e9, human(t.bytes_scrubbed), s.utilization);
}

fn json(s: &Sample) {
    let (d, t) = (&s.d, &s.t);
    println!(
        "{{\"device\":{{\"name\":{:?},\"uuid\":\"{}\",\"compute_capability\":\"{}.{}\",\"instruction_budget\":{}}},\"tenant\":{{\"name\":{:?},\"quota\":{},\"used\":{},\"kernels\":{},\"device_seconds\":{:.6},\"bytes_scrubbed\":{},\"weight\":{},\"utilization\":{:.1}}}}}",
        name_str(&d.name),
        uuid_text(&d.uuid),
        d.cc_major,
        d.cc_minor,
        d.instruction_budget,
        name_str(&t.name),
        t.quota,
        t.used,
        t.kernels,
        t.device_ns as f64 / 1e9,
        t.bytes_scrubbed,
        t.weight,
        s.utilization
    );
}

fn report(s: &Sample) {
    let (d, t) = (&s.d, &s.t);
    println!("Driver Version                    : {}", cuda::api::driver_version_text());
    println!("Attached GPUs                     : 1");
    println!("GPU 0");
    println!("    Product Name                  : {}", name_str(&d.name));
    println!("    GPU UUID                      : {}", uuid_text(&d.uuid));
    println!("    Compute Capability            : {}.{}", d.cc_major, d.cc_minor);
    println!("    Tenant                        : {}", name_str(&t.name));
    println!("    Weight                        : {}", t.weight);
    println!("    FB Memory Usage (the quota)");
    println!("        Total                     : {} MiB", t.quota >> 20);
    println!("        Used                      : {} MiB", t.used >> 20);
    println!("        Free                      : {} MiB", t.quota.saturating_sub(t.used) >> 20);
    println!("    Utilization (the tenant's share of the device)");
    println!("        Gpu                       : {:.0} %", s.utilization);
    println!("    Kernels                       : {}", t.kernels);
    println!("    Device Time                   : {:.3} s", t.device_ns as f64 / 1e9);
}

fn main() {
    // Output piped into `head` ends the program quietly.
    // SAFETY: restoring a signal's default action before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    if cli.id.as_deref().is_some_and(|i| i != "0") {
        fail(2, format!("no GPU {}: a tenant sees one, index 0", cli.id.as_deref().unwrap_or_default()));
    }
    // The query's fields and format are checked before anything connects.
    let query: Option<(Vec<String>, bool, bool)> = cli.query_gpu.as_deref().map(|q| {
        let fields: Vec<String> = q.split(',').map(|f| f.trim().to_string()).filter(|f| !f.is_empty()).collect();
        if fields.is_empty() {
            fail(2, "--query-gpu needs at least one field");
        }
        if let Some(f) = fields.iter().find(|f| !FIELDS.iter().any(|(n, _)| n == f)) {
            let known: Vec<&str> = FIELDS.iter().map(|(n, _)| *n).collect();
            fail(2, format!("field \"{f}\" is not a valid field to query; known: {}", known.join(", ")));
        }
        let format = cli.format.as_deref().unwrap_or_else(|| fail(2, "--query-gpu needs --format=csv[,noheader][,nounits]"));
        let mut parts = format.split(',').map(str::trim);
        if parts.next() != Some("csv") {
            fail(2, format!("--format {format}: only csv is supported"));
        }
        let (mut header, mut units) = (true, true);
        for p in parts {
            match p {
                "noheader" => header = false,
                "nounits" => units = false,
                other => fail(2, format!("--format: unknown option {other} (noheader, nounits)")),
            }
        }
        (fields, header, units)
    });
    if cli.format.is_some() && query.is_none() {
        fail(2, "--format goes with --query-gpu");
    }
    let client = match &cli.socket {
        Some(path) => Client::connect_unix(path),
        None => Client::from_env(),
    };
    let mut probe = Probe { c: client.unwrap_or_else(|e| fail(1, e)), last: None };
    let mut first = true;
    loop {
        let s = probe.sample();
        if cli.list_gpus {
            println!("GPU 0: {} (UUID: {})", name_str(&s.d.name), uuid_text(&s.d.uuid));
        } else if let Some((fields, header, units)) = &query {
            if *header && first {
                let names: Vec<String> = fields
                    .iter()
                    .map(|f| match FIELDS.iter().find(|(n, _)| n == f) {
                        Some((_, u)) if !u.is_empty() && *units => format!("{f} [{u}]"),
                        _ => f.clone(),
                    })
                    .collect();
                println!("{}", names.join(", "));
            }
            let values: Vec<String> = fields.iter().map(|f| field(&s, f, *units)).collect();
            println!("{}", values.join(", "));
        } else if cli.query {
            report(&s);
        } else if cli.output == Output::Json {
            json(&s);
        } else {
            table(&s);
        }
        first = false;
        match cli.every {
            Some(n) => std::thread::sleep(Duration::from_secs(n.max(1))),
            None => break,
        }
    }
}
