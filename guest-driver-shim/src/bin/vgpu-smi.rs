//! vgpu-smi: shows this tenant's vGPU, its memory against the quota, and
//! its kernels and device time, as the device reports them. It answers the
//! nvidia-smi forms monitoring scripts use (`-L`, `--query-gpu=...
//! --format=csv[,noheader,nounits]`, `--query-compute-apps=...`, `-l
//! SECONDS`, `-q`, `--version`), for the one GPU a tenant sees: memory is
//! its quota, utilization its share of the device's time, and the
//! processes are the tenant's own that hold contexts on it. `--env`
//! prints the settings CUDA software needs on the device, for a guest's
//! shell profile.
//!
//! The socket is `--socket`, else `$VGPU_SOCKET`, else the virtio-gpu
//! render node inside a VM.

use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use cuda::client::Client;
use virtio_gpu_compute::{name_str, uuid_text, DeviceInfo, ProcessInfo, TenantInfo};

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
    #[arg(long = "query-gpu", value_name = "FIELDS", conflicts_with = "query_apps")]
    query_gpu: Option<String>,
    /// Comma-separated fields of each process with contexts on the GPU, as
    /// nvidia-smi --query-compute-apps: pid, process_name (or name),
    /// used_memory (or used_gpu_memory), gpu_uuid, gpu_name.
    #[arg(long = "query-compute-apps", value_name = "FIELDS")]
    query_apps: Option<String>,
    /// With --query-gpu or --query-compute-apps: csv, optionally with
    /// noheader and nounits (e.g. csv,noheader,nounits).
    #[arg(long, value_name = "FORMAT")]
    format: Option<String>,
    /// Prints again every SECONDS until interrupted.
    #[arg(short = 'l', long = "loop", value_name = "SECONDS")]
    every: Option<u64>,
    /// A detailed report, as nvidia-smi -q.
    #[arg(short, long)]
    query: bool,
    /// Prints the settings CUDA software needs in its environment on this
    /// vGPU's device, as `export` lines for a shell profile (`eval
    /// "$(vgpu-smi --env)"`): on a CPU reference device
    /// CUPY_COMPILE_WITH_PTX=1, on a GPU nothing.
    #[arg(long, conflicts_with_all = ["query_gpu", "query_apps", "list_gpus", "query", "every", "format"])]
    env: bool,
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

/// The fields --query-compute-apps knows: the name each prints in the
/// header, its units, and the other names it is asked by.
const APP_FIELDS: &[(&str, &str, &[&str])] = &[("pid", "", &[]), ("process_name", "", &["name"]), ("used_gpu_memory", "MiB", &["used_memory"]), ("gpu_uuid", "", &[]), ("gpu_name", "", &[])];

/// A csv query: its fields (by the names they print), whether the header
/// is printed, and whether values carry units.
struct Query {
    fields: Vec<(String, &'static str)>,
    header: bool,
    units: bool,
}

impl Query {
    /// Checks `--OPTION=FIELDS --format=...` against the fields `known`
    /// (name, units, aliases), before anything connects.
    fn parse(option: &str, fields: &str, format: Option<&str>, known: &[(&'static str, &'static str, &[&str])]) -> Query {
        let asked: Vec<&str> = fields.split(',').map(str::trim).filter(|f| !f.is_empty()).collect();
        if asked.is_empty() {
            fail(2, format!("--{option} needs at least one field"));
        }
        let fields = asked
            .iter()
            .map(|f| match known.iter().find(|(n, _, aka)| n == f || aka.contains(f)) {
                Some((n, u, _)) => (n.to_string(), *u),
                None => {
                    let names: Vec<&str> = known.iter().map(|(n, _, _)| *n).collect();
                    fail(2, format!("field \"{f}\" is not a valid field to query; known: {}", names.join(", ")))
                }
            })
            .collect();
        let format = format.unwrap_or_else(|| fail(2, format!("--{option} needs --format=csv[,noheader][,nounits]")));
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
        Query { fields, header, units }
    }

    fn header(&self) -> String {
        let names: Vec<String> = self.fields.iter().map(|(f, u)| if !u.is_empty() && self.units { format!("{f} [{u}]") } else { f.clone() }).collect();
        names.join(", ")
    }
}

/// One look at the device and the tenant, and the tenant's share of the
/// device's time since the look before (or over a short window).
struct Sample {
    d: DeviceInfo,
    t: TenantInfo,
    utilization: f64,
    processes: Vec<ProcessInfo>,
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
        Sample { d, t, utilization, processes: Vec::new() }
    }

    /// The tenant's processes with contexts on the device.
    fn processes(&self) -> Vec<ProcessInfo> {
        self.c.processes().unwrap_or_else(|e| fail(1, e))
    }
}

fn field(s: &Sample, name: &str, units: bool) -> String {
    let mib = |b: u64| mib(b, units);
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

fn mib(b: u64, units: bool) -> String {
    if units {
        format!("{} MiB", b >> 20)
    } else {
        (b >> 20).to_string()
    }
}

fn app_field(s: &Sample, p: &ProcessInfo, name: &str, units: bool) -> String {
    match name {
        "pid" => p.pid.to_string(),
        "process_name" => process_name(p.pid),
        "used_gpu_memory" => mib(p.used, units),
        "gpu_uuid" => uuid_text(&s.d.uuid),
        "gpu_name" => name_str(&s.d.name),
        _ => "[N/A]".into(),
    }
}

/// A process's name as this system's /proc shows it; a pid from another
/// PID namespace (a tenant's socket used from elsewhere) has none here.
fn process_name(pid: u32) -> String {
    cuda::nvml::process_name(pid).unwrap_or_else(|| "[N/A]".into())
}

fn table(s: &Sample) {
    let (d, t) = (&s.d, &s.t);
    let pct = if t.quota == 0 { 0.0 } else { 100.0 * t.used as f64 / t.quota as f64 };
    println!("vgpu-smi   protocol v{}   driver API {}", virtio_gpu_compute::VERSION, cuda::api::driver_version_text());
    println!("Device 0   {}   uuid {}   cc {}.{}", name_str(&d.name), uuid_text(&d.uuid), d.cc_major, d.cc_minor);
    println!("Tenant     {}   weight {}", name_str(&t.name), t.weight);
    println!("Memory     {} used / {} quota ({pct:.1}%)", human(t.used), human(t.quota));
    println!("Kernels    {}   device time {:.3} s   scrubbed {}   utilization {:.0} %", t.kernels, t.device_ns as f64 / 1e9, human(t.bytes_scrubbed), s.utilization);
    if s.processes.is_empty() {
        println!("Processes  none");
    } else {
        println!("Processes  {:>8}  {:>10}  {:>8}  NAME", "PID", "MEMORY", "CONTEXTS");
        for p in &s.processes {
            println!("           {:>8}  {:>10}  {:>8}  {}", p.pid, human(p.used), p.contexts, process_name(p.pid));
        }
    }
}

fn json(s: &Sample) {
    let (d, t) = (&s.d, &s.t);
    let processes: Vec<serde_json::Value> = s.processes.iter().map(|p| serde_json::json!({"pid": p.pid, "name": process_name(p.pid), "used": p.used, "contexts": p.contexts})).collect();
    let v = serde_json::json!({
        "device": {
            "name": name_str(&d.name),
            "uuid": uuid_text(&d.uuid),
            "compute_capability": format!("{}.{}", d.cc_major, d.cc_minor),
            "instruction_budget": d.instruction_budget,
            "interprets_ptx": t.interprets_ptx(),
        },
        "tenant": {
            "name": name_str(&t.name),
            "quota": t.quota,
            "used": t.used,
            "kernels": t.kernels,
            "device_seconds": t.device_ns as f64 / 1e9,
            "bytes_scrubbed": t.bytes_scrubbed,
            "weight": t.weight,
            "utilization": (s.utilization * 10.0).round() / 10.0,
        },
        "processes": processes,
        "env": t.interprets_ptx().map(|i| virtio_gpu_compute::msg::program_env(i).iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect::<serde_json::Map<_, _>>()),
    });
    println!("{v}");
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
    if s.processes.is_empty() {
        println!("    Processes                     : None");
    } else {
        println!("    Processes");
        for p in &s.processes {
            println!("        Process ID                : {}", p.pid);
            println!("            Type                  : C");
            println!("            Name                  : {}", process_name(p.pid));
            println!("            Used GPU Memory       : {} MiB", p.used >> 20);
        }
    }
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
    let gpu_fields: Vec<(&'static str, &'static str, &[&str])> = FIELDS.iter().map(|(n, u)| (*n, *u, &[][..])).collect();
    let query = cli.query_gpu.as_deref().map(|q| Query::parse("query-gpu", q, cli.format.as_deref(), &gpu_fields));
    let apps = cli.query_apps.as_deref().map(|q| Query::parse("query-compute-apps", q, cli.format.as_deref(), APP_FIELDS));
    if cli.format.is_some() && query.is_none() && apps.is_none() {
        fail(2, "--format goes with --query-gpu or --query-compute-apps");
    }
    let client = match &cli.socket {
        Some(path) => Client::connect_unix(path),
        None => Client::from_env(),
    };
    let mut probe = Probe { c: client.unwrap_or_else(|e| fail(1, e)), last: None };
    if cli.env {
        let Some(interprets) = probe.tenant().interprets_ptx() else {
            fail(1, "the host's device service is too old to say what its device runs; no settings printed");
        };
        for (k, v) in virtio_gpu_compute::msg::program_env(interprets) {
            println!("export {k}={v}");
        }
        return;
    }
    let mut first = true;
    // Only the views that show processes ask for them.
    let wants_processes = !cli.list_gpus && query.is_none();
    loop {
        let mut s = probe.sample();
        if wants_processes {
            s.processes = probe.processes();
        }
        if cli.list_gpus {
            println!("GPU 0: {} (UUID: {})", name_str(&s.d.name), uuid_text(&s.d.uuid));
        } else if let Some(q) = &query {
            if q.header && first {
                println!("{}", q.header());
            }
            let values: Vec<String> = q.fields.iter().map(|(f, _)| field(&s, f, q.units)).collect();
            println!("{}", values.join(", "));
        } else if let Some(q) = &apps {
            if q.header && first {
                println!("{}", q.header());
            }
            for p in &s.processes {
                let values: Vec<String> = q.fields.iter().map(|(f, _)| app_field(&s, p, f, q.units)).collect();
                println!("{}", values.join(", "));
            }
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
