//! vgpuctl: the admin CLI for vgpu-mediatord and for each VM's vgpu-vmm.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};
use vgpu_api::pool::{Access, Placement, PoolChange, PoolSpec, Sharing};
use vgpu_api::tenant::{Owner, Priority, TenantChange, TenantKind, TenantSpec};
use vgpu_api::{http, Size};

mod apply;

#[derive(Parser)]
#[command(name = "vgpuctl", version, about = "Manage vGPU devices and tenants")]
struct Cli {
    /// The mediator's run directory (its API is RUN_DIR/api.sock).
    #[arg(long, env = "VGPU_RUN_DIR", default_value = "/run/vgpu", global = true)]
    run_dir: PathBuf,
    /// Path of the API socket, overriding --run-dir.
    #[arg(long, global = true)]
    api: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, global = true)]
    output: Output,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Output {
    /// Text for people: a table for lists, fields for one object.
    Table,
    /// The table with more columns (lists; other verbs print as table).
    Wide,
    /// The API's answer as JSON.
    Json,
    /// The API's answer as YAML.
    Yaml,
}

impl Output {
    /// Whether the verb prints the API's data (JSON or YAML), not text.
    fn data(self) -> bool {
        matches!(self, Output::Json | Output::Yaml)
    }

    /// Prints `v` as this format's data (JSON unless YAML was asked for).
    fn print(self, v: &Value) {
        match self {
            Output::Yaml => match serde_yaml_ng::to_string(v) {
                Ok(text) => print!("{text}"),
                Err(e) => eprintln!("vgpuctl: the answer cannot be printed as YAML: {e}"),
            },
            _ => println!("{}", serde_json::to_string_pretty(v).unwrap_or_default()),
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// vGPU tenants.
    #[command(subcommand)]
    Tenant(TenantCmd),
    /// Physical and reference devices.
    #[command(subcommand)]
    Device(DeviceCmd),
    /// Device pools: access, placement policy and overcommit.
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Prometheus metrics, as the API serves them.
    Metrics,
    /// vgpuctl's version and the daemon's, and whether the daemon is healthy.
    Version,
    /// Usage records (the billing file), oldest first: every one since
    /// `--since`, asked for page by page.
    Usage {
        /// Records whose interval ends after this time (UNIX seconds).
        #[arg(long, default_value_t = 0.0)]
        since: f64,
        /// Only this tenant's records.
        #[arg(long, value_parser = object_name)]
        tenant: Option<String>,
    },
    /// Managed VMs: a VM and its vGPU made, run and deleted together.
    #[command(subcommand)]
    Vm(VmCmd),
    /// One VMM directly, through its API socket (any vgpu-vmm, managed or not).
    Vmm {
        /// The VM's API socket (vgpu-vmm --api-socket; `vm show` prints a
        /// managed VM's).
        #[arg(long)]
        socket: PathBuf,
        #[command(subcommand)]
        cmd: VmmCmd,
    },
    /// Make or update the tenants, pools and VMs a file describes (YAML or
    /// JSON: objects with a kind, tenant, pool or vm, and the fields of
    /// their create verbs; a VM may say state: running or stopped).
    Apply {
        /// The file (- reads standard input).
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Print a shell completion script for vgpuctl.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print vgpuctl's manual page (roff), or write every verb's page.
    Man {
        /// Write vgpuctl.1 and a page per verb (vgpuctl-tenant-create.1, ...)
        /// into this directory instead, naming each.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum VmCmd {
    /// Create a VM (with its vGPU and passthrough devices, if any) and start
    /// it; the answer comes once its VMM is up.
    Create {
        #[command(flatten)]
        spec: Box<vgpu_api::vm::VmSpec>,
        #[command(flatten)]
        wait: Wait,
    },
    List,
    Show {
        #[arg(value_parser = object_name)]
        name: String,
    },
    /// Start a stopped VM; the answer comes once its VMM is up.
    Start {
        #[arg(value_parser = object_name)]
        name: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Ask the guest to shut down; kill the VMM if it has not after the
    /// timeout. The answer comes once the VMM has ended.
    Stop {
        #[arg(value_parser = object_name)]
        name: String,
        /// Seconds to wait for the guest (0: kill at once; default: the daemon's).
        #[arg(long)]
        timeout: Option<u64>,
        #[command(flatten)]
        wait: Wait,
    },
    /// Reset the VM (its VMM is killed and started again).
    Reboot {
        #[arg(value_parser = object_name)]
        name: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Delete the VM and its vGPU (whose memory is scrubbed).
    Delete {
        #[arg(value_parser = object_name)]
        name: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// The guest's serial console output.
    Console {
        #[arg(value_parser = object_name)]
        name: String,
        /// Keep printing what the guest writes.
        #[arg(short, long)]
        follow: bool,
        /// Start from the last this many bytes.
        #[arg(long, default_value_t = 65536)]
        bytes: u64,
    },
    /// The VM's VMM log.
    Logs {
        #[arg(value_parser = object_name)]
        name: String,
        #[arg(long, default_value_t = 65536)]
        bytes: u64,
    },
}

/// `--wait`: progress while the daemon works, and for a delete, the wait
/// until the vGPU's memory is released.
#[derive(clap::Args, Clone, Copy)]
struct Wait {
    /// Print the VM's state on standard error while the daemon works (when
    /// it changes, and every 5 s); a delete also waits until the vGPU's
    /// memory is scrubbed and released.
    #[arg(long)]
    wait: bool,
}

#[derive(Subcommand)]
enum VmmCmd {
    /// State, vCPUs, memory backing and NUMA placement.
    Info,
    /// Stop every vCPU.
    Pause,
    Resume,
    /// Ask the guest to shut down (Ctrl-Alt-Del).
    Shutdown,
    /// End the VM at once.
    Kill,
}

#[derive(Subcommand)]
enum TenantCmd {
    /// Create a tenant and print its socket path.
    Create {
        #[arg(value_parser = object_name)]
        name: String,
        /// Memory quota: bytes, or a number with a unit (KiB, MiB, GiB,
        /// TiB; KB, MB, GB, TB), such as 256MiB or 1.5GiB.
        #[arg(long)]
        memory: Size,
        /// Compute share weight (1..=10000).
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// Hard cap: the percentage of the device's time the tenant never
        /// exceeds, even alone (1..=100; default uncapped).
        #[arg(long)]
        cap: Option<u32>,
        /// Priority class: latency work goes first within its share.
        #[arg(long, value_enum, default_value_t = Priority::Normal)]
        priority: Priority,
        /// Device to place it on (default: chosen by its pool's policy).
        #[arg(long)]
        device: Option<String>,
        /// Pool to place it in (default: the device's pool, or `default`).
        #[arg(long)]
        pool: Option<String>,
        /// NUMA node the tenant runs on: a device there is preferred.
        #[arg(long)]
        numa_node: Option<u32>,
        /// A VM tenant: prints the vhost-user socket for `vgpu-vmm --vgpu socket=PATH`.
        #[arg(long)]
        vm: bool,
        /// Owner of the tenant's socket, UID:GID: that user (or container)
        /// is the tenant. Default: root.
        #[arg(long)]
        owner: Option<Owner>,
        /// Mode of the tenant's socket, octal (default 0600).
        #[arg(long)]
        mode: Option<String>,
        /// Host memory the tenant's objects may keep in its worker
        /// (default: the mediator's devices.tenant_host_memory).
        #[arg(long)]
        host_memory: Option<Size>,
        /// Client connections the tenant may hold at once (default: the
        /// mediator's devices.tenant_connections).
        #[arg(long)]
        max_connections: Option<u32>,
        /// Put the socket where only root may reach it by its path: for a
        /// socket bind-mounted into a container (with --mode 0666).
        #[arg(long)]
        hidden: bool,
    },
    List,
    Show {
        #[arg(value_parser = object_name)]
        name: String,
    },
    /// Print what a program needs in its environment to run as this
    /// tenant, as shell lines: `eval "$(vgpuctl tenant env NAME)"`. That
    /// is its socket (`VGPU_SOCKET`) and the settings its device needs
    /// (on a CPU reference device, CuPy's to compile to PTX).
    Env {
        #[arg(value_parser = object_name)]
        name: String,
    },
    /// Change a tenant's share, cap, class or memory quota while it runs.
    Set {
        #[arg(value_parser = object_name)]
        name: String,
        #[arg(long)]
        weight: Option<u32>,
        /// Percent of the device (1..=100); 100 removes the cap.
        #[arg(long)]
        cap: Option<u32>,
        #[arg(long, value_enum)]
        priority: Option<Priority>,
        /// New memory quota. A smaller one must still cover what the
        /// tenant has allocated.
        #[arg(long)]
        memory: Option<Size>,
    },
    Delete {
        #[arg(value_parser = object_name)]
        name: String,
    },
}

#[derive(Subcommand)]
enum DeviceCmd {
    /// Every device: those shared by tenants and those lent whole to VMs.
    List,
    /// One device; for a passthrough device, its state and scrub records.
    Show {
        #[arg(value_parser = object_name)]
        name: String,
    },
    /// Reset, rebind and scrub a passthrough device that is not lent (one
    /// quarantined after a failed scrub, once its cause is fixed); it is
    /// free again if the scrub passes.
    Scrub {
        #[arg(value_parser = object_name)]
        name: String,
    },
}

#[derive(Subcommand)]
enum PoolCmd {
    /// Group devices (in the default pool, holding no tenants) into a pool.
    Create {
        #[arg(value_parser = object_name)]
        name: String,
        /// A device of the pool (repeat for more).
        #[arg(long = "device", required = true)]
        devices: Vec<String>,
        /// Only the tenants given with --allow may be placed in it.
        #[arg(long)]
        private: bool,
        /// A tenant a private pool admits (repeat for more).
        #[arg(long = "allow")]
        allow: Vec<String>,
        /// pack fills the fullest device that fits; spread the freest.
        #[arg(long, value_enum, default_value_t = Placement::Spread)]
        placement: Placement,
        /// Quotas on a device may add up to this times its memory.
        #[arg(long, default_value_t = 1.0)]
        overcommit: f64,
        /// time-sliced: tenants take turns on each GPU, each isolated from
        /// the others' faults; mps: NVIDIA's MPS runs their kernels at
        /// once, and one tenant's fault fails them all (trusted tenants
        /// only; GPUs only).
        #[arg(long, value_enum, default_value_t = Sharing::TimeSliced)]
        sharing: Sharing,
    },
    List,
    Show {
        #[arg(value_parser = object_name)]
        name: String,
    },
    /// Change a pool's access, allow-list, placement or overcommit.
    Set {
        #[arg(value_parser = object_name)]
        name: String,
        #[arg(long, conflicts_with = "public")]
        private: bool,
        #[arg(long)]
        public: bool,
        /// Replaces the allow-list (repeat for more tenants).
        #[arg(long = "allow")]
        allow: Vec<String>,
        /// Empties the allow-list.
        #[arg(long, conflicts_with = "allow")]
        allow_none: bool,
        #[arg(long, value_enum)]
        placement: Option<Placement>,
        #[arg(long)]
        overcommit: Option<f64>,
    },
    /// Delete a pool without tenants; its devices return to `default`.
    Delete {
        #[arg(value_parser = object_name)]
        name: String,
    },
}

fn print_pool(v: &Value) {
    let list = |k: &str| v.get(k).and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", ")).unwrap_or_default();
    println!(
        "name:       {}\naccess:     {}\nallow:      {}\nplacement:  {}\novercommit: {}\nsharing:    {}\ndevices:    {}\nmemory:     {} (capacity {}, reserved {})\ntenants:    {}",
        s(v, "name"),
        s(v, "access"),
        if s(v, "access") == "private" { list("allow") } else { "anyone".into() },
        s(v, "placement"),
        v.get("overcommit").and_then(Value::as_f64).unwrap_or(1.0),
        v.get("sharing").and_then(Value::as_str).unwrap_or("time-sliced"),
        list("devices"),
        human(u(v, "memory_total")),
        human(u(v, "memory_capacity")),
        human(u(v, "memory_reserved")),
        list("tenants"),
    );
}

fn human(b: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift {
            let v = b as f64 / (1u64 << shift) as f64;
            return if v.fract() == 0.0 { format!("{v:.0}{unit}") } else { format!("{v:.1}{unit}") };
        }
    }
    format!("{b}B")
}

fn u(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

fn cap_text(v: &Value) -> String {
    match v.get("cap").and_then(Value::as_u64) {
        Some(c) => format!("{c}%"),
        None => "none".into(),
    }
}

fn table(rows: Vec<Vec<String>>) {
    let w: Vec<usize> = (0..rows[0].len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    for r in rows {
        let line: Vec<String> = r.iter().enumerate().map(|(i, c)| format!("{c:<w$}", w = w[i])).collect();
        println!("{}", line.join("  ").trim_end());
    }
}

/// A command line that parsed but asks for nothing (exit status 2, as
/// clap's own usage errors; a failure is 1).
#[derive(Debug)]
struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

fn main() -> ExitCode {
    // Output piped into `head` ends the program quietly, as in any Unix
    // tool, instead of a panic on the closed pipe.
    // SAFETY: restoring a signal's default action before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpuctl: {e}");
            if e.is::<Usage>() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn call(cli: &Cli, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
    let api = cli.api.clone().unwrap_or_else(|| cli.run_dir.join("api.sock"));
    call_at(&api, method, path, body)
}

/// PATCHes `path` with the fields the user gave; none is a usage error
/// naming `flags`.
fn patch(cli: &Cli, path: &str, body: Value, flags: &str) -> anyhow::Result<Value> {
    if body.as_object().is_some_and(|o| o.is_empty()) {
        return Err(Usage(format!("nothing to change: give {flags}")).into());
    }
    call(cli, "PATCH", path, Some(body))
}

/// A tenant, VM, pool or device name, as the daemon gives them (it goes
/// into a request's path: nothing else may reach the daemon in its place).
fn object_name(s: &str) -> Result<String, String> {
    vgpu_api::tenant::validate_name(s).map(|()| s.to_string()).map_err(|_| format!("{s:?} is not a name: names are 1-48 letters, digits, '-', '_' or '.', starting with a letter or digit"))
}

fn call_at(api: &std::path::Path, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
    call_status(api, method, path, body).map(|(_, v)| v)
}

fn call_status(api: &std::path::Path, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<(u16, Value)> {
    call_waiting(api, method, path, body, http::DEFAULT_WAIT)
}

/// The longest a VM's stop may take: the daemon caps a stop's timeout at
/// an hour, and a delete or reboot stops the VM first.
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(3600 + 30);

fn call_waiting(api: &std::path::Path, method: &str, path: &str, body: Option<Value>, wait: std::time::Duration) -> anyhow::Result<(u16, Value)> {
    let body = body.map(|b| b.to_string());
    let r = http::request_waiting(api, method, path, body.as_deref().map(str::as_bytes), wait)?;
    let v: Value = if r.body.is_empty() { Value::Null } else { serde_json::from_slice(&r.body).unwrap_or(Value::String(r.text())) };
    if !(200..300).contains(&r.status) {
        let msg = v.get("error").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| r.text());
        anyhow::bail!("{msg} (HTTP {})", r.status);
    }
    Ok((r.status, v))
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let data_out = cli.output.data();
    let wide = cli.output == Output::Wide;
    let print_data = |v: &Value| cli.output.print(v);
    match &cli.cmd {
        Cmd::Tenant(TenantCmd::Create { name, memory, weight, cap, priority, device, pool, numa_node, vm, owner, mode, host_memory, max_connections, hidden }) => {
            let spec = TenantSpec {
                name: name.clone(),
                memory: *memory,
                weight: *weight,
                cap: *cap,
                priority: *priority,
                device: device.clone(),
                pool: pool.clone(),
                numa_node: *numa_node,
                kind: if *vm { TenantKind::Vm } else { TenantKind::Process },
                owner: *owner,
                mode: mode.clone(),
                host_memory: *host_memory,
                max_connections: *max_connections,
                hidden: *hidden,
            };
            // The daemon's own checks, here first: a bad request is a usage
            // error, said in the same words.
            spec.validate().map_err(Usage)?;
            let v = call(cli, "POST", "/v1/tenants", Some(serde_json::to_value(&spec)?))?;
            if data_out {
                print_data(&v)
            } else {
                println!("{}", s(&v, "socket"))
            }
        }
        Cmd::Tenant(TenantCmd::List) => {
            let v = call(cli, "GET", "/v1/tenants", None)?;
            if data_out {
                print_data(&v);
            } else {
                let mut head = ["NAME", "KIND", "POOL", "DEVICE", "QUOTA", "WEIGHT", "SOCKET"].map(String::from).to_vec();
                if wide {
                    head.extend(["STATE", "CAP", "PRIORITY", "NODE", "HOST-MEM", "CONNS", "OWNER", "MODE"].map(String::from));
                }
                let mut rows = vec![head];
                for t in v.as_array().into_iter().flatten() {
                    let mut row = vec![s(t, "name").into(), s(t, "kind").into(), s(t, "pool").into(), s(t, "device").into(), human(u(t, "memory")), u(t, "weight").to_string(), s(t, "socket").into()];
                    if wide {
                        let node = t.get("numa_node").and_then(Value::as_i64).unwrap_or(-1);
                        row.extend([
                            s(t, "state").into(),
                            cap_text(t),
                            s(t, "priority").into(),
                            if node < 0 { "-".into() } else { node.to_string() },
                            human(u(t, "host_memory")),
                            u(t, "max_connections").to_string(),
                            t.get("owner").and_then(Value::as_str).unwrap_or("0:0").into(),
                            s(t, "mode").into(),
                        ]);
                    }
                    rows.push(row);
                }
                table(rows);
            }
        }
        Cmd::Tenant(TenantCmd::Show { name }) => {
            let v = call(cli, "GET", &format!("/v1/tenants/{name}"), None)?;
            if data_out {
                print_data(&v);
            } else {
                println!(
                    "name:      {}\nstate:     {}\ndevice:    {} (pool {}, NUMA node {})\nquota:     {}\nweight:    {}\ncap:       {}\npriority:  {}\nsocket:    {} (owner {}, mode {})\nhost mem:  {}\nmax conns: {}",
                    s(&v, "name"),
                    s(&v, "state"),
                    s(&v, "device"),
                    s(&v, "pool"),
                    v.get("numa_node").and_then(Value::as_i64).unwrap_or(-1),
                    human(u(&v, "memory")),
                    u(&v, "weight"),
                    cap_text(&v),
                    s(&v, "priority"),
                    s(&v, "socket"),
                    v.get("owner").and_then(Value::as_str).unwrap_or("0:0"),
                    s(&v, "mode"),
                    human(u(&v, "host_memory")),
                    u(&v, "max_connections")
                );
                if let Some(env) = v.get("env").and_then(Value::as_object).filter(|e| !e.is_empty()) {
                    println!("env:       {}", env.iter().map(|(k, x)| format!("{k}={}", x.as_str().unwrap_or_default())).collect::<Vec<_>>().join(" "));
                }
                match v.get("usage").filter(|x| !x.is_null()) {
                    Some(us) => println!(
                        "used:      {} ({} spilled to host RAM)\nhost used: {} ({} requests refused)\nkernels:   {}\ndevice-s:  {:.3}\nscrubbed:  {}\nclients:   {}",
                        human(u(us, "used")),
                        human(u(us, "spilled")),
                        human(u(us, "host_used")),
                        u(us, "host_refused"),
                        u(us, "kernels"),
                        u(us, "device_ns") as f64 / 1e9,
                        human(u(us, "bytes_scrubbed")),
                        u(us, "connections")
                    ),
                    None => println!("usage:     unavailable (device worker restarting)"),
                }
            }
        }
        Cmd::Tenant(TenantCmd::Env { name }) => {
            let v = call(cli, "GET", &format!("/v1/tenants/{name}"), None)?;
            // The device's own settings, strings only; the socket is the
            // daemon's `socket` field, never one of these.
            let mut settings = Vec::new();
            for (k, x) in v.get("env").and_then(Value::as_object).into_iter().flatten() {
                let x = x.as_str().ok_or_else(|| anyhow::anyhow!("the daemon answered a non-string value for the environment variable {k}: {x}"))?;
                if k != "VGPU_SOCKET" {
                    settings.push((k.clone(), x.to_string()));
                }
            }
            if s(&v, "kind") == "vm" {
                let needs = if settings.is_empty() {
                    String::new()
                } else {
                    format!("; set {} in the guest (`eval \"$(vgpu-smi --env)\"` there prints them)", settings.iter().map(|(k, x)| format!("{k}={x}")).collect::<Vec<_>>().join(" "))
                };
                anyhow::bail!("tenant {name} is a VM's vGPU: its programs run in the guest, which reaches the device through /dev/dri{needs}");
            }
            let socket = v.get("socket").and_then(Value::as_str).filter(|p| !p.is_empty()).ok_or_else(|| anyhow::anyhow!("the daemon's answer for tenant {name} has no socket"))?;
            let mut env = vec![("VGPU_SOCKET".to_string(), socket.to_string())];
            env.extend(settings);
            if data_out {
                print_data(&Value::Object(env.into_iter().map(|(k, x)| (k, Value::String(x))).collect()));
            } else {
                for (k, x) in env {
                    // The daemon's names and values, checked and quoted
                    // all the same: this text goes to `eval`.
                    anyhow::ensure!(vgpu_api::tenant::is_env_name(&k), "the daemon answered an environment variable name no shell takes: {k:?}");
                    println!("export {k}={}", shlex::try_quote(&x)?);
                }
            }
        }
        Cmd::Tenant(TenantCmd::Set { name, weight, cap, priority, memory }) => {
            let change = TenantChange { weight: *weight, cap: *cap, priority: *priority, memory: *memory };
            if let Some(w) = weight {
                vgpu_api::tenant::check_share(name, *w, *cap).map_err(Usage)?;
            }
            let v = patch(cli, &format!("/v1/tenants/{name}"), serde_json::to_value(&change)?, "--weight, --cap, --priority or --memory")?;
            if data_out {
                print_data(&v)
            } else {
                println!("{}: weight {}, cap {}, priority {}, quota {}", s(&v, "name"), u(&v, "weight"), cap_text(&v), s(&v, "priority"), human(u(&v, "memory")))
            }
        }
        Cmd::Tenant(TenantCmd::Delete { name }) => {
            let api = cli.api.clone().unwrap_or_else(|| cli.run_dir.join("api.sock"));
            let (status, _) = call_status(&api, "DELETE", &format!("/v1/tenants/{name}"), None)?;
            // 202: revoked everywhere, its memory still being released.
            let done = status != 202;
            if data_out {
                print_data(&json!({ "deleted": name, "released": done }))
            } else if done {
                println!("deleted {name}")
            } else {
                println!("revoked {name}; its memory is still being released (state: deleting)")
            }
        }
        Cmd::Usage { since, tenant } => {
            // Page by page: each answer ends where an interval does, so the
            // next starts after its last record's end; an empty one ends it.
            let mut since = *since;
            let mut all = Vec::new();
            loop {
                let mut path = format!("/v1/usage?since={since}&limit=10000");
                if let Some(t) = tenant {
                    path += &format!("&tenant={t}");
                }
                let page = match call(cli, "GET", &path, None)? {
                    Value::Array(a) => a,
                    other => anyhow::bail!("the daemon answered usage with {other}, not a list of records"),
                };
                let Some(last) = page.last() else { break };
                let end = last.get("end").or_else(|| last.get("at")).and_then(Value::as_f64).unwrap_or(f64::NAN);
                // A daemon that answers records it was not asked for
                // would otherwise be asked again forever.
                if end.partial_cmp(&since) != Some(std::cmp::Ordering::Greater) {
                    anyhow::bail!("the daemon answered usage since {since} with a record that ends at {end}");
                }
                since = end;
                all.extend(page);
            }
            let v = Value::Array(all);
            if data_out {
                print_data(&v);
            } else {
                let mut rows = vec![["END", "TENANT", "DEVICE", "DEVICE-S", "MEM-MiB·S", "KERNELS", "COPIED", "SCRUBBED"].map(String::from).to_vec()];
                let f = |r: &Value, k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(0.0);
                for r in v.as_array().into_iter().flatten() {
                    let end = format!("{:.0}", f(r, "end"));
                    if s(r, "type") == "device" {
                        rows.push(vec![end, "(busy)".into(), s(r, "device").into(), format!("{:.3}", f(r, "busy_seconds")), String::new(), String::new(), String::new(), String::new()]);
                    } else if s(r, "type") == "deleted" {
                        rows.push(vec![format!("{:.0}", f(r, "at")), s(r, "tenant").into(), "(deleted)".into(), String::new(), String::new(), String::new(), String::new(), String::new()]);
                    } else {
                        rows.push(vec![
                            end,
                            s(r, "tenant").into(),
                            s(r, "device").into(),
                            format!("{:.3}", f(r, "device_seconds")),
                            format!("{:.1}", f(r, "memory_byte_seconds") / (1u64 << 20) as f64),
                            u(r, "kernels").to_string(),
                            human(u(r, "bytes_copied")),
                            human(u(r, "bytes_scrubbed")),
                        ]);
                    }
                }
                table(rows);
            }
        }
        Cmd::Device(DeviceCmd::List) => {
            let v = call(cli, "GET", "/v1/devices", None)?;
            if data_out {
                print_data(&v);
            } else {
                let mut head = ["NAME", "KIND", "POOL", "NODE", "STATE", "MEMORY", "RESERVED", "ALLOCATED", "SPILLED", "TENANTS", "UTIL", "RESTARTS", "ISOLATION"].map(String::from).to_vec();
                if wide {
                    head.extend(["CAPACITY", "SPILL-BUDGET", "LANES", "EXECUTORS", "WORKER-PID"].map(String::from));
                }
                let mut rows = vec![head];
                let (shared, whole): (Vec<&Value>, Vec<&Value>) = v.as_array().into_iter().flatten().partition(|d| s(d, "kind") != "passthrough");
                for d in shared {
                    let node = d.get("numa_node").and_then(Value::as_i64).unwrap_or(-1);
                    let extra = [
                        human(u(d, "memory_capacity")),
                        human(u(d, "spill_budget")),
                        u(d, "lanes").to_string(),
                        d.get("executors").and_then(Value::as_array).map_or(0, Vec::len).to_string(),
                        u(d, "worker_pid").to_string(),
                    ];
                    let mut row = vec![
                        s(d, "name").into(),
                        s(d, "kind").into(),
                        s(d, "pool").into(),
                        if node < 0 { "-".into() } else { node.to_string() },
                        s(d, "state").into(),
                        human(u(d, "memory_total")),
                        human(u(d, "memory_reserved")),
                        human(u(d, "memory_allocated")),
                        human(u(d, "memory_spilled")),
                        u(d, "tenants").to_string(),
                        format!("{:.1}%", d.get("utilization").and_then(Value::as_f64).unwrap_or(0.0) * 100.0),
                        u(d, "worker_restarts").to_string(),
                        d.get("isolation").and_then(Value::as_str).unwrap_or("shared").into(),
                    ];
                    if wide {
                        row.extend(extra);
                    }
                    rows.push(row);
                }
                table(rows);
                if !whole.is_empty() {
                    println!();
                    let mut rows = vec![["NAME", "KIND", "POOL", "NODE", "ADDRESS", "STATE", "LENT TO", "DRIVER", "LAST SCRUB"].map(String::from).to_vec()];
                    for d in whole {
                        let node = d.get("numa_node").and_then(Value::as_i64).unwrap_or(-1);
                        rows.push(vec![
                            s(d, "name").into(),
                            if d.get("gpu").and_then(Value::as_bool) == Some(true) { "passthrough-gpu".into() } else { "passthrough".into() },
                            s(d, "pool").into(),
                            if node < 0 { "-".into() } else { node.to_string() },
                            s(d, "address").into(),
                            s(d, "state").into(),
                            d.get("lent_to").and_then(Value::as_str).unwrap_or("-").into(),
                            d.get("driver").and_then(Value::as_str).unwrap_or("-").into(),
                            d["scrubs"].as_array().and_then(|a| a.last()).map(scrub_text).unwrap_or_else(|| "-".into()),
                        ]);
                    }
                    table(rows);
                }
            }
        }
        Cmd::Device(DeviceCmd::Show { name }) => {
            let v = call(cli, "GET", &format!("/v1/devices/{name}"), None)?;
            if data_out {
                print_data(&v);
            } else if s(&v, "kind") != "passthrough" {
                let node = v.get("numa_node").and_then(Value::as_i64).unwrap_or(-1);
                let execs = v.get("executors").and_then(Value::as_array).map(Vec::len).unwrap_or(0);
                println!(
                    "name:        {}\nkind:        {}\npool:        {}\nnode:        {}\nstate:       {} (worker pid {}, {} restarts)\nisolation:   {} ({execs} executors)\nlanes:       {}\nmemory:      {} (capacity {}, reserved {}, allocated {}, spilled {}, spill budget {})\ntenants:     {}\nutilization: {:.1}%",
                    s(&v, "name"),
                    s(&v, "kind"),
                    s(&v, "pool"),
                    if node < 0 { "-".into() } else { node.to_string() },
                    s(&v, "state"),
                    u(&v, "worker_pid"),
                    u(&v, "worker_restarts"),
                    v.get("isolation").and_then(Value::as_str).unwrap_or("shared"),
                    u(&v, "lanes"),
                    human(u(&v, "memory_total")),
                    human(u(&v, "memory_capacity")),
                    human(u(&v, "memory_reserved")),
                    human(u(&v, "memory_allocated")),
                    human(u(&v, "memory_spilled")),
                    human(u(&v, "spill_budget")),
                    u(&v, "tenants"),
                    v.get("utilization").and_then(Value::as_f64).unwrap_or(0.0) * 100.0,
                );
            } else {
                let node = v.get("numa_node").and_then(Value::as_i64).unwrap_or(-1);
                println!(
                    "name:      {}
address:   {}{}
pool:      {}
node:      {}",
                    s(&v, "name"),
                    s(&v, "address"),
                    if v.get("gpu").and_then(Value::as_bool) == Some(true) { " (NVIDIA GPU)" } else { "" },
                    s(&v, "pool"),
                    if node < 0 { "unknown".into() } else { node.to_string() }
                );
                println!("state:     {}{}", s(&v, "state"), v.get("lent_to").and_then(Value::as_str).map(|t| format!(" (VM {t})")).unwrap_or_default());
                if let Some(r) = v.get("quarantine_reason").and_then(Value::as_str) {
                    println!("reason:    {r}");
                }
                println!("driver:    {} (host driver {})", v.get("driver").and_then(Value::as_str).unwrap_or("none"), v.get("host_driver").and_then(Value::as_str).unwrap_or("none"));
                println!("scrubs:    {} passed, {} failed", u(&v, "scrubs_ok"), u(&v, "scrubs_failed"));
                let recs = v["scrubs"].as_array().cloned().unwrap_or_default();
                if !recs.is_empty() {
                    let mut rows = vec![["STARTED", "PREVIOUS VM", "METHOD", "BYTES", "VERIFIED", "MS", "RESULT"].map(String::from).to_vec()];
                    for r in &recs {
                        rows.push(vec![
                            u(r, "started").to_string(),
                            r.get("previous_vm").and_then(Value::as_str).filter(|x| !x.is_empty()).unwrap_or("-").into(),
                            s(r, "method").into(),
                            human(u(r, "bytes")),
                            if r.get("verified").and_then(Value::as_bool) == Some(true) { "yes".into() } else { "no".into() },
                            u(r, "duration_ms").to_string(),
                            scrub_text(r),
                        ]);
                    }
                    table(rows);
                }
            }
        }
        Cmd::Device(DeviceCmd::Scrub { name }) => {
            let v = call(cli, "POST", &format!("/v1/devices/{name}/scrub"), None)?;
            if data_out {
                print_data(&v);
            } else {
                println!("{name}: {}", scrub_text(&v));
            }
            if v.get("ok").and_then(Value::as_bool) != Some(true) {
                anyhow::bail!("{name} failed its scrub and stays quarantined");
            }
        }
        Cmd::Pool(PoolCmd::Create { name, devices, private, allow, placement, overcommit, sharing }) => {
            let spec = PoolSpec {
                name: name.clone(),
                devices: devices.clone(),
                access: if *private { Access::Private } else { Access::Public },
                allow: allow.clone(),
                placement: *placement,
                overcommit: *overcommit,
                sharing: *sharing,
            };
            spec.validate().map_err(Usage)?;
            let v = call(cli, "POST", "/v1/pools", Some(serde_json::to_value(&spec)?))?;
            if data_out {
                print_data(&v)
            } else {
                println!("created pool {name}")
            }
        }
        Cmd::Pool(PoolCmd::List) => {
            let v = call(cli, "GET", "/v1/pools", None)?;
            if data_out {
                print_data(&v);
            } else {
                let mut head = ["NAME", "ACCESS", "PLACEMENT", "OVERCOMMIT", "DEVICES", "MEMORY", "RESERVED", "TENANTS"].map(String::from).to_vec();
                if wide {
                    head.extend(["SHARING", "CAPACITY", "DEVICE-NAMES", "TENANT-NAMES"].map(String::from));
                }
                let mut rows = vec![head];
                for p in v.as_array().into_iter().flatten() {
                    let n = |k: &str| p.get(k).and_then(Value::as_array).map(Vec::len).unwrap_or(0);
                    let names =
                        |k: &str| p.get(k).and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(",")).filter(|t| !t.is_empty()).unwrap_or_else(|| "-".into());
                    let mut row = vec![
                        s(p, "name").into(),
                        s(p, "access").into(),
                        s(p, "placement").into(),
                        format!("{}", p.get("overcommit").and_then(Value::as_f64).unwrap_or(1.0)),
                        n("devices").to_string(),
                        human(u(p, "memory_total")),
                        human(u(p, "memory_reserved")),
                        n("tenants").to_string(),
                    ];
                    if wide {
                        row.extend([p.get("sharing").and_then(Value::as_str).unwrap_or("time-sliced").to_string(), human(u(p, "memory_capacity")), names("devices"), names("tenants")]);
                    }
                    rows.push(row);
                }
                table(rows);
            }
        }
        Cmd::Pool(PoolCmd::Show { name }) => {
            let v = call(cli, "GET", &format!("/v1/pools/{name}"), None)?;
            if data_out {
                print_data(&v)
            } else {
                print_pool(&v)
            }
        }
        Cmd::Pool(PoolCmd::Set { name, private, public, allow, allow_none, placement, overcommit }) => {
            let change = PoolChange {
                access: (*private).then_some(Access::Private).or((*public).then_some(Access::Public)),
                allow: (!allow.is_empty() || *allow_none).then(|| allow.clone()),
                placement: *placement,
                overcommit: *overcommit,
            };
            if let Some(o) = overcommit {
                vgpu_api::pool::check_overcommit(name, *o).map_err(Usage)?;
            }
            let v = patch(cli, &format!("/v1/pools/{name}"), serde_json::to_value(&change)?, "--private, --public, --allow, --allow-none, --placement or --overcommit")?;
            if data_out {
                print_data(&v)
            } else {
                print_pool(&v)
            }
        }
        Cmd::Pool(PoolCmd::Delete { name }) => {
            call(cli, "DELETE", &format!("/v1/pools/{name}"), None)?;
            if data_out {
                print_data(&json!({ "deleted": name }))
            } else {
                println!("deleted pool {name}")
            }
        }
        Cmd::Vmm { socket, cmd } => vmm(socket, cmd, cli.output)?,
        Cmd::Vm(cmd) => managed_vm(cli, cmd)?,
        Cmd::Apply { file } => apply::apply(cli, file)?,
        Cmd::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut cmd, "vgpuctl", &mut std::io::stdout());
        }
        Cmd::Man { dir: None } => {
            clap_mangen::Man::new(<Cli as clap::CommandFactory>::command()).render(&mut std::io::stdout())?;
        }
        Cmd::Man { dir: Some(dir) } => {
            std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("making {}: {e}", dir.display()))?;
            clap_mangen::generate_to(<Cli as clap::CommandFactory>::command(), dir).map_err(|e| anyhow::anyhow!("writing the pages into {}: {e}", dir.display()))?;
            let mut pages: Vec<String> = std::fs::read_dir(dir)?.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.starts_with("vgpuctl") && n.ends_with(".1")).collect();
            pages.sort();
            for p in pages {
                println!("{}", dir.join(p).display());
            }
        }
        Cmd::Version => {
            let api = api_of(cli);
            let server = call_at(&api, "GET", "/v1/version", None)?;
            // 503 while a device's worker restarts: still an answer.
            let health = http::request(&api, "GET", "/v1/healthz", None).ok().and_then(|r| serde_json::from_slice::<Value>(&r.body).ok()).unwrap_or(Value::Null);
            if data_out {
                print_data(&json!({ "client": { "name": "vgpuctl", "version": env!("CARGO_PKG_VERSION") }, "server": server, "health": health }));
            } else {
                println!("vgpuctl {}", env!("CARGO_PKG_VERSION"));
                println!("{} {} at {}", s(&server, "name"), s(&server, "version"), api.display());
                let down: Vec<&str> = health.get("devices_down").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
                println!("health: {} ({} devices up{})", s(&health, "status"), u(&health, "devices_up"), if down.is_empty() { String::new() } else { format!(", down: {}", down.join(", ")) });
            }
        }
        Cmd::Metrics => {
            if data_out {
                return Err(Usage("metrics are Prometheus text: -o json and -o yaml are not offered for them".into()).into());
            }
            let api = cli.api.clone().unwrap_or_else(|| cli.run_dir.join("api.sock"));
            let r = http::request(&api, "GET", "/v1/metrics", None)?;
            print!("{}", r.text());
        }
    }
    Ok(())
}

fn vmm(socket: &std::path::Path, cmd: &VmmCmd, output: Output) -> anyhow::Result<()> {
    let data_out = output.data();
    let print_data = |v: &Value| output.print(v);
    let (path, done) = match cmd {
        VmmCmd::Info => {
            let v = call_at(socket, "GET", "/vm", None)?;
            if data_out {
                print_data(&v);
                return Ok(());
            }
            let c = &v["config"];
            println!(
                "state:     {}\npid:       {}\nvcpus:     {}\nmemory:    {} ({})\nnuma node: {}\nvcpu cpus: {}\nkernel:    {}\ncmdline:   {}",
                s(&v, "state"),
                u(&v, "pid"),
                u(&v, "vcpus"),
                human(u(&v, "memory_bytes")),
                s(&v, "memory_backing"),
                v.get("numa_node").and_then(Value::as_u64).map_or("none".into(), |n| n.to_string()),
                v.get("vcpu_cpus").and_then(Value::as_array).map_or("any".into(), |a| a.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",")),
                s(c, "kernel"),
                s(c, "cmdline"),
            );
            return Ok(());
        }
        VmmCmd::Pause => ("/vm/pause", "paused"),
        VmmCmd::Resume => ("/vm/resume", "resumed"),
        VmmCmd::Shutdown => ("/vm/shutdown", "shutdown requested"),
        VmmCmd::Kill => ("/vm/kill", "killed"),
    };
    call_at(socket, "PUT", path, None)?;
    if data_out {
        print_data(&json!({ "result": done }));
    } else {
        println!("{done}");
    }
    Ok(())
}

fn print_vm(v: &Value) {
    let spec = &v["spec"];
    let node = v.get("numa_node").and_then(Value::as_i64).unwrap_or(-1);
    println!(
        "name:      {}\nstate:     {} (desired {})\nvcpus:     {}\nmemory:    {}{}\nboot:      {}\nvgpu:      {}\nnode:      {}\nrestart:   {} ({} restarts{})\npid:       {}\napi:       {}\nconsole:   {}",
        s(v, "name"),
        s(v, "state"),
        s(v, "desired"),
        u(spec, "vcpus"),
        spec.get("memory").map(size_text).unwrap_or_default(),
        spec.get("hugepages").and_then(Value::as_str).map(|h| format!(" ({h} hugepages)")).unwrap_or_default(),
        spec.get("kernel").and_then(Value::as_str).or(spec.get("boot_disk").and_then(Value::as_str)).unwrap_or(""),
        match spec.get("vgpu").filter(|g| g.is_object()) {
            Some(g) => format!("{} on {} (pool {}), weight {}", g.get("memory").map(size_text).unwrap_or_default(), s(v, "device"), s(v, "pool"), u(g, "weight")),
            None => "none".into(),
        },
        if node < 0 { "unknown".to_string() } else { node.to_string() },
        s(spec, "restart"),
        u(v, "restarts"),
        v.get("last_exit").and_then(Value::as_str).map(|e| format!(", last {e}")).unwrap_or_default(),
        u(v, "pid"),
        s(v, "api_socket"),
        s(v, "console_log"),
    );
    for l in v.get("passthrough").and_then(Value::as_array).into_iter().flatten() {
        println!("passthrough: {} at {}", s(l, "device"), s(l, "address"));
    }
    if let Some(e) = v.get("error").and_then(Value::as_str) {
        println!("error:     {e}");
    }
}

/// A scrub record in a few words: `ok (function-reset)` or the error.
fn scrub_text(r: &Value) -> String {
    if r.get("ok").and_then(Value::as_bool) == Some(true) {
        format!("ok ({})", s(r, "method"))
    } else {
        format!("FAILED: {}", r.get("error").and_then(Value::as_str).unwrap_or("unknown"))
    }
}

/// A size the API returns as bytes (a number) or as text.
fn size_text(v: &Value) -> String {
    match v {
        Value::Number(n) => human(n.as_u64().unwrap_or(0)),
        Value::String(t) => t.clone(),
        _ => String::new(),
    }
}

fn managed_vm(cli: &Cli, cmd: &VmCmd) -> anyhow::Result<()> {
    let data_out = cli.output.data();
    let wide = cli.output == Output::Wide;
    let print_data = |v: &Value| cli.output.print(v);
    let one = |v: &Value| if data_out { print_data(v) } else { print_vm(v) };
    match cmd {
        VmCmd::Create { spec, wait } => {
            let api = api_of(cli);
            let body = serde_json::to_value(spec)?;
            one(&progress(&api, &spec.name, wait.wait, "being created", || call_waiting(&api, "POST", "/v1/vms", Some(body), STOP_WAIT))?.1)
        }
        VmCmd::List => {
            let v = call(cli, "GET", "/v1/vms", None)?;
            if data_out {
                print_data(&v);
            } else {
                let mut head = ["NAME", "STATE", "VCPUS", "MEMORY", "VGPU", "DEVICE", "NODE", "RESTARTS", "PID"].map(String::from).to_vec();
                if wide {
                    head.extend(["DESIRED", "POOL", "RESTART", "DISKS", "NETS", "API"].map(String::from));
                }
                let mut rows = vec![head];
                for m in v.as_array().into_iter().flatten() {
                    let node = m.get("numa_node").and_then(Value::as_i64).unwrap_or(-1);
                    let count = |k: &str| m["spec"].get(k).and_then(Value::as_array).map(Vec::len).unwrap_or(0).to_string();
                    let extra = [s(m, "desired").to_string(), s(m, "pool").to_string(), s(&m["spec"], "restart").to_string(), count("disks"), count("nets"), s(m, "api_socket").to_string()];
                    let mut row = vec![
                        s(m, "name").into(),
                        s(m, "state").into(),
                        u(&m["spec"], "vcpus").to_string(),
                        m["spec"].get("memory").map(size_text).unwrap_or_default(),
                        m["spec"]["vgpu"].get("memory").map(size_text).unwrap_or_default(),
                        s(m, "device").into(),
                        if node < 0 { "-".into() } else { node.to_string() },
                        u(m, "restarts").to_string(),
                        u(m, "pid").to_string(),
                    ];
                    if wide {
                        row.extend(extra);
                    }
                    rows.push(row);
                }
                table(rows);
            }
        }
        VmCmd::Show { name } => one(&call(cli, "GET", &format!("/v1/vms/{name}"), None)?),
        VmCmd::Start { name, wait } => {
            let api = api_of(cli);
            one(&progress(&api, name, wait.wait, "gone", || call_waiting(&api, "POST", &format!("/v1/vms/{name}/start"), None, STOP_WAIT))?.1)
        }
        VmCmd::Stop { name, timeout, wait: w } => {
            let api = api_of(cli);
            let q = timeout.map(|t| format!("?timeout={t}")).unwrap_or_default();
            // The answer comes once the guest stopped or the timeout passed.
            let wait = timeout.map(|t| std::time::Duration::from_secs(t.min(3600) + 30)).unwrap_or(STOP_WAIT);
            one(&progress(&api, name, w.wait, "gone", || call_waiting(&api, "POST", &format!("/v1/vms/{name}/stop{q}"), None, wait))?.1)
        }
        VmCmd::Reboot { name, wait } => {
            let api = api_of(cli);
            one(&progress(&api, name, wait.wait, "gone", || call_waiting(&api, "POST", &format!("/v1/vms/{name}/reboot"), None, STOP_WAIT))?.1)
        }
        VmCmd::Delete { name, wait } => {
            let api = api_of(cli);
            let (status, _) = progress(&api, name, wait.wait, "deleted", || call_waiting(&api, "DELETE", &format!("/v1/vms/{name}"), None, STOP_WAIT))?;
            // Its vGPU tenant has its name; once the tenant is gone, its
            // memory is scrubbed and released.
            let released = status != 202 || (wait.wait && wait_released(&api, name)?);
            if data_out {
                print_data(&json!({ "deleted": name, "released": released }))
            } else if released {
                println!("deleted VM {name}: its vGPU (if any) is released and its passthrough devices (if any) are back in their pools")
            } else {
                println!("deleted VM {name}; its vGPU's memory is still being released")
            }
        }
        VmCmd::Console { name, follow, bytes } => {
            let api = api_of(cli);
            let mut seen = print_tail(&api, &format!("/v1/vms/{name}/console?bytes={bytes}"))?;
            if !*follow {
                return Ok(());
            }
            loop {
                std::thread::sleep(std::time::Duration::from_millis(500));
                // What came since: the tail's end past what was printed.
                let now = http::request(&api, "GET", &format!("/v1/vms/{name}/console?bytes={}", 2u64 << 20), None)?;
                if now.status != 200 {
                    anyhow::bail!("{} (HTTP {})", now.text(), now.status);
                }
                let all = now.body;
                let new = new_part(&seen, &all);
                std::io::Write::write_all(&mut std::io::stdout(), new)?;
                std::io::Write::flush(&mut std::io::stdout())?;
                seen = all;
            }
        }
        VmCmd::Logs { name, bytes } => {
            print_tail(&api_of(cli), &format!("/v1/vms/{name}/logs?bytes={bytes}"))?;
        }
    }
    Ok(())
}

/// Runs `f`, a request the daemon answers once it is done; with `show`,
/// prints the VM's state on standard error meanwhile: at once, when it
/// changes and every 5 s (`missing`: what to call a VM not listed).
fn progress<T>(api: &std::path::Path, name: &str, show: bool, missing: &'static str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    if !show {
        return f();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let start = std::time::Instant::now();
            let mut last: Option<(String, u64)> = None;
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                let state = match http::request(api, "GET", &format!("/v1/vms/{name}"), None) {
                    Ok(r) if r.status == 200 => serde_json::from_slice::<Value>(&r.body).ok().and_then(|v| v["state"].as_str().map(String::from)).unwrap_or_else(|| "?".into()),
                    Ok(r) if r.status == 404 => missing.into(),
                    Ok(r) => format!("unknown (HTTP {})", r.status),
                    Err(e) => format!("unknown ({e})"),
                };
                let secs = start.elapsed().as_secs();
                if last.as_ref().is_none_or(|(st, at)| *st != state || secs >= at + 5) {
                    eprintln!("vgpuctl: VM {name}: {state} ({secs} s)");
                    last = Some((state, secs));
                }
                // Poll every 0.5 s, checking for the end more often.
                for _ in 0..5 {
                    if done.load(std::sync::atomic::Ordering::Acquire) {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        });
        let r = f();
        done.store(true, std::sync::atomic::Ordering::Release);
        r
    })
}

/// Longest `vm delete --wait` waits for a vGPU's memory to be released.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Waits until the VM's vGPU tenant is gone (its memory scrubbed and
/// released), printing progress every 5 s; true once it is.
fn wait_released(api: &std::path::Path, name: &str) -> anyhow::Result<bool> {
    let start = std::time::Instant::now();
    let mut said = None;
    loop {
        let r = http::request(api, "GET", &format!("/v1/tenants/{name}"), None)?;
        if r.status == 404 {
            eprintln!("vgpuctl: VM {name}: its vGPU's memory is released ({} s)", start.elapsed().as_secs());
            return Ok(true);
        }
        let secs = start.elapsed().as_secs();
        if said.is_none_or(|at| secs >= at + 5) {
            eprintln!("vgpuctl: VM {name}: its vGPU's memory is being released ({secs} s)");
            said = Some(secs);
        }
        if start.elapsed() >= RELEASE_WAIT {
            anyhow::bail!("VM {name} is deleted, but its vGPU's memory was still being released after {} s", RELEASE_WAIT.as_secs());
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

fn api_of(cli: &Cli) -> PathBuf {
    cli.api.clone().unwrap_or_else(|| cli.run_dir.join("api.sock"))
}

fn print_tail(api: &std::path::Path, path: &str) -> anyhow::Result<Vec<u8>> {
    let r = http::request(api, "GET", path, None)?;
    if r.status != 200 {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        anyhow::bail!("{} (HTTP {})", v.get("error").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| r.text()), r.status);
    }
    std::io::Write::write_all(&mut std::io::stdout(), &r.body)?;
    Ok(r.body)
}

/// The part of `now` after the longest suffix of `seen` it starts with.
fn new_part<'a>(seen: &[u8], now: &'a [u8]) -> &'a [u8] {
    let keep = seen.len().min(4096);
    let probe = &seen[seen.len() - keep..];
    if probe.is_empty() {
        return now;
    }
    match now.windows(probe.len()).rposition(|w| w == probe) {
        Some(at) => &now[at + probe.len()..],
        None => now,
    }
}
