//! The mediator's REST API over `RUN_DIR/api.sock` (docs/api/mediator.yaml).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use serde_json::json;

use super::{Control, ControlError, TenantRecord};
use crate::config::TenantSpec;
use crate::ipc::{DeviceStats, TenantStats};
use vgpu_api::vm::VmView;

type St = State<Arc<Control>>;

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let code = match &self {
            ControlError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ControlError::NotFound(_) => StatusCode::NOT_FOUND,
            ControlError::Forbidden(_) => StatusCode::FORBIDDEN,
            ControlError::Conflict(_) => StatusCode::CONFLICT,
            ControlError::InsufficientMemory(_) => StatusCode::INSUFFICIENT_STORAGE,
            ControlError::WorkerDown(_) => StatusCode::SERVICE_UNAVAILABLE,
            ControlError::Timeout(..) => StatusCode::GATEWAY_TIMEOUT,
            ControlError::Worker(_) | ControlError::Internal(_) | ControlError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (code, Json(json!({ "error": self.to_string() }))).into_response()
    }
}

/// The API's OpenAPI document, as committed (docs/api/mediator.yaml).
const SPEC: &str = include_str!("../../../docs/api/mediator.yaml");

async fn spec() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/yaml")], SPEC).into_response()
}

/// Every path is served under `/v1` (the API's version) and, for clients
/// made before it had one, at the root.
pub fn router(c: Arc<Control>) -> Router {
    let api = Router::new()
        .route("/devices", get(devices))
        .route("/devices/{name}", get(show_device))
        .route("/devices/{name}/scrub", axum::routing::post(scrub_device))
        .route("/tenants", get(list_tenants).post(create_tenant))
        .route("/tenants/{name}", get(show_tenant).delete(delete_tenant).patch(set_tenant))
        .route("/pools", get(list_pools).post(create_pool))
        .route("/pools/{name}", get(show_pool).delete(delete_pool).patch(set_pool))
        .route("/metrics", get(metrics))
        .route("/usage", get(usage))
        .route("/vms", get(list_vms).post(create_vm))
        .route("/vms/{name}", get(show_vm).delete(delete_vm))
        .route("/vms/{name}/start", axum::routing::post(start_vm))
        .route("/vms/{name}/stop", axum::routing::post(stop_vm))
        .route("/vms/{name}/reboot", axum::routing::post(reboot_vm))
        .route("/vms/{name}/console", get(vm_console))
        .route("/vms/{name}/logs", get(vm_logs))
        .route("/version", get(version))
        .route("/healthz", get(healthz))
        .route("/openapi.yaml", get(spec))
        .method_not_allowed_fallback(method_not_allowed);
    Router::new().nest("/v1", api.clone()).merge(api).fallback(no_such_path).with_state(c)
}

/// Every answer is JSON, an unknown path's and a wrong method's included.
async fn no_such_path(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    (StatusCode::NOT_FOUND, Json(json!({ "error": format!("no such path: {method} {}", uri.path()) }))).into_response()
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    (StatusCode::METHOD_NOT_ALLOWED, Json(json!({ "error": format!("{method} is not allowed on {}", uri.path()) }))).into_response()
}

async fn version() -> Json<serde_json::Value> {
    Json(json!({ "name": "vgpu-mediatord", "version": env!("CARGO_PKG_VERSION") }))
}

/// 200 while every device's worker is up; 503, naming those that are not,
/// while one restarts.
async fn healthz(State(c): St) -> Response {
    let down: Vec<String> = c.devices.iter().filter(|d| !d.is_up()).map(|d| d.spec.name.clone()).collect();
    let up = c.devices.len() - down.len();
    let (code, status) = if down.is_empty() { (StatusCode::OK, "ok") } else { (StatusCode::SERVICE_UNAVAILABLE, "degraded") };
    (code, Json(json!({ "status": status, "devices_up": up, "devices_down": down }))).into_response()
}

/// Only `GET /metrics`, for a TCP listener Prometheus scrapes.
pub fn metrics_router(c: Arc<Control>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(c)
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageQuery {
    /// UNIX seconds: records whose interval ends after it.
    #[serde(default)]
    since: f64,
    tenant: Option<String>,
    limit: Option<usize>,
}

async fn usage(State(c): St, q: Result<axum::extract::Query<UsageQuery>, axum::extract::rejection::QueryRejection>) -> Result<Json<Vec<super::meter::Record>>, ControlError> {
    let axum::extract::Query(q) = q.map_err(|e| ControlError::BadRequest(format!("bad usage query: {e}")))?;
    if !q.since.is_finite() {
        return Err(ControlError::BadRequest("since must be a number of seconds since 1970".into()));
    }
    let limit = q.limit.unwrap_or(10_000);
    if !(1..=super::meter::MAX_RECORDS).contains(&limit) {
        return Err(ControlError::BadRequest(format!("limit must be 1 to {}, not {limit}", super::meter::MAX_RECORDS)));
    }
    let meter = c.meter.get().cloned().ok_or_else(|| ControlError::NotFound("metering is not running".into()))?;
    let recs = blocking(move || meter.records(q.since, q.tenant.as_deref(), limit)).await?.map_err(|e| ControlError::Worker(e.to_string()))?;
    Ok(Json(recs))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ControlError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ControlError::Worker(e.to_string()))
}

#[derive(Serialize)]
struct DeviceView {
    name: String,
    kind: String,
    memory_total: u64,
    memory_reserved: u64,
    memory_allocated: u64,
    tenants: usize,
    state: &'static str,
    worker_pid: u32,
    worker_restarts: u64,
    utilization: f64,
    /// Execution lanes: the device's capacity is this many lane-seconds
    /// per second.
    lanes: u32,
    pool: String,
    /// The host NUMA node the device is attached to (-1: unknown).
    numa_node: i32,
    /// Quotas the device may hold: its memory times its pool's overcommit.
    memory_capacity: u64,
    /// Bytes of allocations spilled to host RAM, and the spill budget.
    memory_spilled: u64,
    spill_budget: u64,
    /// How the device's tenants are kept apart: "process" (an executor
    /// each; `worker_pid` is the device's arbiter) or "shared".
    isolation: &'static str,
    /// With process isolation: each tenant's executor (none otherwise).
    executors: Vec<ExecutorView>,
}

/// A tenant's executor process.
#[derive(Serialize)]
struct ExecutorView {
    tenant: String,
    pid: u32,
    /// The uid it runs as (absent: the daemon's workers').
    #[serde(skip_serializing_if = "Option::is_none")]
    uid: Option<u32>,
    /// What the kernel bounds it to.
    bounds: super::executors::ExecBounds,
}

fn device_views(c: &Control) -> Vec<DeviceView> {
    let pools = c.pools();
    let tenants = c.tenants();
    c.devices
        .iter()
        .map(|s| {
            let st = s.stats();
            let pool = pools.iter().find(|p| p.devices.contains(&s.spec.name));
            let mine: Vec<&TenantRecord> = tenants.iter().filter(|t| t.device == s.spec.name).collect();
            DeviceView {
                name: s.spec.name.clone(),
                kind: s.spec.kind().to_string(),
                memory_total: s.spec.memory,
                memory_reserved: mine.iter().map(|t| t.memory).sum(),
                memory_allocated: st.as_ref().map(|d| d.allocated).unwrap_or(0),
                tenants: mine.len(),
                state: match &st {
                    Some(d) if d.quarantined => "quarantined",
                    Some(_) => "running",
                    None => "restarting",
                },
                worker_pid: s.pid.load(Ordering::Relaxed),
                worker_restarts: s.restarts.load(Ordering::Relaxed),
                utilization: st.as_ref().map(utilization).unwrap_or(0.0),
                lanes: st.as_ref().map(|d| d.lanes).unwrap_or(s.spec.lanes),
                pool: pool.map(|p| p.name.clone()).unwrap_or_default(),
                numa_node: s.spec.numa_node,
                memory_capacity: pool.map(|p| p.capacity(s.spec.memory)).unwrap_or(s.spec.memory),
                memory_spilled: st.as_ref().map(|d| d.spilled).unwrap_or(0),
                spill_budget: s.spec.spill,
                isolation: if s.spec.executors { "process" } else { "shared" },
                executors: s.executors().iter().map(|e| ExecutorView { tenant: e.tenant.clone(), pid: e.pid, uid: e.uid, bounds: e.bounds.clone() }).collect(),
            }
        })
        .collect()
}

fn utilization(d: &DeviceStats) -> f64 {
    if d.uptime_ns == 0 {
        0.0
    } else {
        d.busy_ns as f64 / (d.uptime_ns as f64 * d.lanes.max(1) as f64)
    }
}

/// A device as `GET /devices` lists it: one a worker shares among
/// tenants, or one lent whole to VMs.
#[derive(Serialize)]
#[serde(untagged)]
enum AnyDevice {
    Shared(DeviceView),
    Passthrough(super::passthrough::PassView),
}

fn pass_views(c: &Control) -> Vec<super::passthrough::PassView> {
    let Some(p) = c.passthrough.get() else { return Vec::new() };
    let pools = c.pools();
    p.devices
        .iter()
        .map(|d| {
            let pool = pools.iter().find(|p| p.devices.contains(&d.name)).map(|p| p.name.clone()).unwrap_or_default();
            p.view(d, &pool)
        })
        .collect()
}

async fn devices(State(c): St) -> Result<Json<Vec<AnyDevice>>, ControlError> {
    Ok(Json(blocking(move || device_views(&c).into_iter().map(AnyDevice::Shared).chain(pass_views(&c).into_iter().map(AnyDevice::Passthrough)).collect()).await?))
}

async fn show_device(State(c): St, Path(name): Path<String>) -> Result<Json<AnyDevice>, ControlError> {
    blocking(move || {
        if let Some(v) = pass_views(&c).into_iter().find(|v| v.name == name) {
            return Ok(AnyDevice::Passthrough(v));
        }
        device_views(&c).into_iter().find(|v| v.name == name).map(AnyDevice::Shared).ok_or_else(|| ControlError::NotFound(format!("no device named {name}")))
    })
    .await?
    .map(Json)
}

/// Resets, rebinds and scrubs a passthrough device that is not lent (one
/// quarantined after a failed scrub, once its cause is fixed).
async fn scrub_device(State(c): St, Path(name): Path<String>) -> Result<Json<super::passthrough::ScrubRecord>, ControlError> {
    blocking(move || {
        if c.slot(&name).is_some() {
            return Err(ControlError::BadRequest(format!("{name} is a shared device: its worker scrubs memory on every allocation and release; only passthrough devices are scrubbed on demand")));
        }
        let p = c.passthrough.get().ok_or_else(|| ControlError::NotFound(format!("no device named {name}")))?;
        p.rescrub(&name).map_err(super::vms::pass_error)
    })
    .await?
    .map(Json)
}

async fn list_tenants(State(c): St) -> Json<Vec<TenantRecord>> {
    Json(c.tenants())
}

#[derive(Serialize)]
struct TenantView {
    #[serde(flatten)]
    record: TenantRecord,
    usage: Option<TenantStats>,
}

async fn show_tenant(State(c): St, Path(name): Path<String>) -> Result<Json<TenantView>, ControlError> {
    let record = c.tenant(&name).ok_or_else(|| ControlError::NotFound(format!("no tenant {name}")))?;
    let dev = record.device.clone();
    let usage = blocking(move || c.slot(&dev).and_then(|s| s.stats()).and_then(|d| d.tenants.into_iter().find(|t| t.name == name))).await?;
    Ok(Json(TenantView { record, usage }))
}

async fn create_tenant(State(c): St, body: axum::body::Bytes) -> Result<(StatusCode, Json<TenantRecord>), ControlError> {
    let spec: TenantSpec = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad tenant description: {e}")))?;
    let rec = blocking(move || c.create_tenant(&spec)).await??;
    Ok((StatusCode::CREATED, Json(rec)))
}

/// A pool with what its devices hold now.
#[derive(Serialize)]
struct PoolView {
    #[serde(flatten)]
    spec: super::pool::PoolSpec,
    memory_total: u64,
    /// Quotas its devices may hold (memory × overcommit).
    memory_capacity: u64,
    memory_reserved: u64,
    tenants: Vec<String>,
}

fn pool_view(c: &Control, spec: super::pool::PoolSpec) -> PoolView {
    let tenants: Vec<TenantRecord> = c.tenants().into_iter().filter(|t| spec.devices.contains(&t.device)).collect();
    let slots: Vec<_> = spec.devices.iter().filter_map(|d| c.slot(d)).collect();
    PoolView {
        memory_total: slots.iter().map(|s| s.spec.memory).sum(),
        memory_capacity: slots.iter().map(|s| spec.capacity(s.spec.memory)).sum(),
        memory_reserved: tenants.iter().map(|t| t.memory).sum(),
        tenants: tenants.into_iter().map(|t| t.name).collect(),
        spec,
    }
}

async fn list_pools(State(c): St) -> Json<Vec<PoolView>> {
    Json(c.pools().into_iter().map(|p| pool_view(&c, p)).collect())
}

async fn show_pool(State(c): St, Path(name): Path<String>) -> Result<Json<PoolView>, ControlError> {
    let p = c.pool(&name).ok_or_else(|| ControlError::NotFound(format!("no pool {name}")))?;
    Ok(Json(pool_view(&c, p)))
}

async fn create_pool(State(c): St, body: axum::body::Bytes) -> Result<(StatusCode, Json<PoolView>), ControlError> {
    let spec: super::pool::PoolSpec = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad pool description: {e}")))?;
    let p = c.create_pool(&spec)?;
    Ok((StatusCode::CREATED, Json(pool_view(&c, p))))
}

async fn set_pool(State(c): St, Path(name): Path<String>, body: axum::body::Bytes) -> Result<Json<PoolView>, ControlError> {
    let change: super::pool::PoolChange = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad pool change: {e}")))?;
    let p = c.set_pool(&name, &change)?;
    Ok(Json(pool_view(&c, p)))
}

async fn delete_pool(State(c): St, Path(name): Path<String>) -> Result<StatusCode, ControlError> {
    c.delete_pool(&name)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_tenant(State(c): St, Path(name): Path<String>, body: axum::body::Bytes) -> Result<Json<TenantRecord>, ControlError> {
    let change: super::TenantChange = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad tenant change: {e}")))?;
    Ok(Json(blocking(move || c.set_tenant(&name, &change)).await??))
}

/// 204 once the tenant is gone and its memory released; 202 while its
/// worker is still releasing it (it is revoked either way).
async fn delete_tenant(State(c): St, Path(name): Path<String>) -> Result<StatusCode, ControlError> {
    if c.vms.get().is_some_and(|v| v.owns_tenant(&name)) {
        return Err(ControlError::Conflict(format!("tenant {name} is VM {name}'s vGPU: delete the VM")));
    }
    let done = blocking(move || c.delete_tenant(&name)).await??;
    Ok(if done { StatusCode::NO_CONTENT } else { StatusCode::ACCEPTED })
}

async fn metrics(State(c): St) -> Result<Response, ControlError> {
    let text = blocking(move || render_metrics(&c)).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Prometheus text exposition of every device and tenant. Counters come
/// from the meter (they survive worker and daemon restarts), gauges from
/// the same fresh sample of the workers. Every series carries the device's name, UUID and model.
pub fn render_metrics(c: &Control) -> String {
    let mut out = String::new();
    // With a meter, one sample serves both: the counters are as of now.
    let now: Vec<Option<DeviceStats>> = match c.meter.get() {
        Some(m) => m.sample(c),
        None => c.devices.iter().map(|s| s.stats()).collect(),
    };
    let stats: Vec<_> = c.devices.iter().zip(now).collect();
    let super::meter::Totals { tenants: totals, busy, labels } = c.meter.get().map(|m| m.totals()).unwrap_or_default();
    let dev_labels = |name: &str, d: Option<&DeviceStats>| {
        let (uuid, model) = d.map(|d| (d.uuid.clone(), d.name.clone())).or_else(|| labels.get(name).cloned()).unwrap_or_default();
        format!("device=\"{}\",uuid=\"{}\",model=\"{}\"", esc(name), esc(&uuid), esc(&model))
    };
    let by_dev: std::collections::HashMap<&str, String> = stats.iter().map(|(s, d)| (s.spec.name.as_str(), dev_labels(&s.spec.name, d.as_ref()))).collect();
    let labels_of = |device: &str| by_dev.get(device).cloned().unwrap_or_else(|| dev_labels(device, None));
    let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    };
    let dev = |f: &dyn Fn(&DeviceStats) -> f64| -> Vec<(String, f64)> { stats.iter().filter_map(|(s, d)| d.as_ref().map(|d| (labels_of(&s.spec.name), f(d)))).collect() };
    family("vgpu_device_up", "gauge", "Whether the device worker is serving (1) or restarting (0).", stats.iter().map(|(s, d)| (labels_of(&s.spec.name), d.is_some() as u8 as f64)).collect());
    family(
        "vgpu_device_worker_restarts_total",
        "counter",
        "Times the device worker was restarted after exiting.",
        stats.iter().map(|(s, _)| (labels_of(&s.spec.name), s.restarts.load(Ordering::Relaxed) as f64)).collect(),
    );
    family("vgpu_device_memory_bytes", "gauge", "Device memory size.", dev(&|d| d.memory as f64));
    family("vgpu_device_memory_allocated_bytes", "gauge", "Device memory allocated by tenants.", dev(&|d| d.allocated as f64));
    family("vgpu_device_scrubbed_bytes_total", "counter", "Bytes zeroed before hand-out on the device (this worker's life).", dev(&|d| d.bytes_scrubbed as f64));
    family("vgpu_device_quarantined", "gauge", "1 once a scrub failed verification: the device hands out no memory.", dev(&|d| d.quarantined as u8 as f64));
    family("vgpu_device_busy_seconds_total", "counter", "Lane-seconds the device spent running tenant work.", busy.iter().map(|(d, s)| (labels_of(d), *s)).collect());
    family("vgpu_device_utilization", "gauge", "Busy lane-time over available lane-time since the worker started.", dev(&utilization));
    family("vgpu_device_spilled_bytes", "gauge", "Bytes of the device's allocations spilled to host RAM.", dev(&|d| d.spilled as f64));
    family("vgpu_device_spill_budget_bytes", "gauge", "Host RAM the device's allocations may spill to.", dev(&|d| d.spill_budget as f64));
    family("vgpu_device_lanes", "gauge", "Execution lanes: the device's capacity in lane-seconds per second.", dev(&|d| d.lanes as f64));
    let ten = |f: &dyn Fn(&TenantStats) -> f64| -> Vec<(String, f64)> {
        stats
            .iter()
            .filter_map(|(s, d)| d.as_ref().map(|d| (s, d)))
            .flat_map(|(s, d)| d.tenants.iter().map(move |t| (format!("tenant=\"{}\",{}", esc(&t.name), labels_of(&s.spec.name)), f(t))))
            .collect()
    };
    let used = |f: &dyn Fn(&super::meter::Usage) -> f64| -> Vec<(String, f64)> { totals.iter().map(|(t, d, u)| (format!("tenant=\"{}\",{}", esc(t), labels_of(d)), f(u))).collect() };
    family("vgpu_tenant_memory_quota_bytes", "gauge", "Tenant memory quota.", ten(&|t| t.quota as f64));
    family("vgpu_tenant_memory_used_bytes", "gauge", "Device memory the tenant has allocated.", ten(&|t| t.used as f64));
    family("vgpu_tenant_memory_spilled_bytes", "gauge", "Bytes of the tenant's allocations held in host RAM (overcommit).", ten(&|t| t.spilled as f64));
    family("vgpu_tenant_weight", "gauge", "The tenant's compute share weight.", ten(&|t| t.weight as f64));
    family("vgpu_tenant_cap_ratio", "gauge", "The tenant's hard cap as a fraction of the device (1: uncapped).", ten(&|t| t.cap.map(|c| c as f64 / 100.0).unwrap_or(1.0)));
    family("vgpu_tenant_kernels_total", "counter", "Kernels the tenant launched.", used(&|u| u.kernels as f64));
    family("vgpu_tenant_device_seconds_total", "counter", "Device time the tenant's work used.", used(&|u| u.device_seconds));
    family("vgpu_tenant_memory_byte_seconds_total", "counter", "Device memory the tenant held, integrated over time.", used(&|u| u.memory_byte_seconds));
    family("vgpu_tenant_spilled_byte_seconds_total", "counter", "Spilled memory the tenant held, integrated over time.", used(&|u| u.spilled_byte_seconds));
    family("vgpu_tenant_copied_bytes_total", "counter", "Bytes the tenant's copies moved.", used(&|u| u.bytes_copied as f64));
    family("vgpu_tenant_scrubbed_bytes_total", "counter", "Bytes zeroed before being handed to the tenant.", used(&|u| u.bytes_scrubbed as f64));
    family("vgpu_tenant_connections", "gauge", "Open client connections of the tenant.", ten(&|t| t.connections as f64));
    family("vgpu_tenant_host_memory_bytes", "gauge", "Host memory the tenant's objects keep in its device worker.", ten(&|t| t.host_used as f64));
    family("vgpu_tenant_host_memory_limit_bytes", "gauge", "The tenant's host memory budget in its device worker.", ten(&|t| t.host_limit as f64));
    let pass = pass_views(c);
    let pl = |v: &super::passthrough::PassView| format!("device=\"{}\",address=\"{}\"", esc(&v.name), esc(&v.address));
    let states = ["free", "lent", "returning", "quarantined"];
    family(
        "vgpu_passthrough_state",
        "gauge",
        "1 for the state the passthrough device is in (free, lent, returning or quarantined).",
        pass.iter().flat_map(|v| states.iter().map(move |s| (format!("{},state=\"{s}\"", pl(v)), (v.state == *s) as u8 as f64))).collect(),
    );
    family(
        "vgpu_passthrough_scrubs_total",
        "counter",
        "Returns of the passthrough device, by whether its reset, rebind and scrub passed.",
        pass.iter().flat_map(|v| [(format!("{},result=\"ok\"", pl(v)), v.scrubs_ok as f64), (format!("{},result=\"failed\"", pl(v)), v.scrubs_failed as f64)]).collect(),
    );
    let last = |f: &dyn Fn(&super::passthrough::ScrubRecord) -> f64| -> Vec<(String, f64)> { pass.iter().filter_map(|v| v.scrubs.last().map(|r| (pl(v), f(r)))).collect() };
    family("vgpu_passthrough_last_scrub_timestamp_seconds", "gauge", "When the device's last return began (seconds since the epoch).", last(&|r| r.started as f64));
    family("vgpu_passthrough_last_scrub_duration_seconds", "gauge", "How long the device's last reset, rebind and scrub took.", last(&|r| r.duration_ms as f64 / 1000.0));
    family("vgpu_passthrough_last_scrub_bytes", "gauge", "Bytes of device memory the last scrub zeroed and read back as zero (0: not a GPU).", last(&|r| r.bytes as f64));
    family("vgpu_passthrough_last_scrub_verified", "gauge", "1 if the last scrub read the device's memory back and found it zero.", last(&|r| r.verified as u8 as f64));
    family("vgpu_passthrough_last_scrub_ok", "gauge", "1 if the last return passed (reset, rebound and, for a GPU, verified).", last(&|r| r.ok as u8 as f64));
    out
}

fn vms(c: &Control) -> Result<&super::vms::Vms, ControlError> {
    c.vms.get().ok_or_else(|| ControlError::NotFound("this daemon manages no VMs".into()))
}

async fn list_vms(State(c): St) -> Result<Json<Vec<VmView>>, ControlError> {
    Ok(Json(blocking(move || vms(&c).map(|v| v.list(&c))).await??))
}

async fn create_vm(State(c): St, body: axum::body::Bytes) -> Result<(StatusCode, Json<VmView>), ControlError> {
    let spec: vgpu_api::vm::VmSpec = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad VM description: {e}")))?;
    let v = blocking(move || vms(&c).and_then(|v| v.create(&c, spec))).await??;
    Ok((StatusCode::CREATED, Json(v)))
}

async fn show_vm(State(c): St, Path(name): Path<String>) -> Result<Json<VmView>, ControlError> {
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.show(&c, &name))).await??))
}

async fn delete_vm(State(c): St, Path(name): Path<String>) -> Result<StatusCode, ControlError> {
    let done = blocking(move || vms(&c).and_then(|v| v.delete(&c, &name))).await??;
    Ok(if done { StatusCode::NO_CONTENT } else { StatusCode::ACCEPTED })
}

async fn start_vm(State(c): St, Path(name): Path<String>) -> Result<Json<VmView>, ControlError> {
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.start(&c, &name))).await??))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StopQuery {
    /// Seconds to wait for the guest before the VMM is killed (0: at once).
    timeout: Option<u64>,
}

async fn stop_vm(State(c): St, Path(name): Path<String>, q: Result<axum::extract::Query<StopQuery>, axum::extract::rejection::QueryRejection>) -> Result<Json<VmView>, ControlError> {
    let axum::extract::Query(q) = q.map_err(|e| ControlError::BadRequest(format!("bad stop query: {e}")))?;
    let timeout = q.timeout.map(|s| std::time::Duration::from_secs(s.min(3600)));
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.stop(&c, &name, timeout))).await??))
}

async fn reboot_vm(State(c): St, Path(name): Path<String>) -> Result<Json<VmView>, ControlError> {
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.reboot(&c, &name))).await??))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TailQuery {
    /// The last this many bytes (default 64 KiB).
    bytes: Option<u64>,
}

async fn log_tail(c: Arc<Control>, name: String, q: Result<axum::extract::Query<TailQuery>, axum::extract::rejection::QueryRejection>, console: bool) -> Result<Response, ControlError> {
    let axum::extract::Query(q) = q.map_err(|e| ControlError::BadRequest(format!("bad log query: {e}")))?;
    let bytes = q.bytes.unwrap_or(64 << 10);
    let text = blocking(move || vms(&c).and_then(|v| if console { v.console(&name, bytes) } else { v.logs(&name, bytes) })).await??;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

async fn vm_console(State(c): St, Path(name): Path<String>, q: Result<axum::extract::Query<TailQuery>, axum::extract::rejection::QueryRejection>) -> Result<Response, ControlError> {
    log_tail(c, name, q, true).await
}

async fn vm_logs(State(c): St, Path(name): Path<String>, q: Result<axum::extract::Query<TailQuery>, axum::extract::rejection::QueryRejection>) -> Result<Response, ControlError> {
    log_tail(c, name, q, false).await
}
