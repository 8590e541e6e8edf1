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
            ControlError::Uid { err: super::executors::UidError::Exhausted { .. }, .. } => StatusCode::SERVICE_UNAVAILABLE,
            ControlError::Worker(_) | ControlError::Internal(_) | ControlError::Store(_) | ControlError::NotSaved { .. } | ControlError::Uid { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (code, Json(ErrorBody { error: self.to_string() })).into_response()
    }
}

/// A refusal: what every error answer holds.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    pub error: String,
}

#[derive(utoipa::OpenApi)]
#[openapi(info(
    title = "vgpu-mediatord API",
    version = "1",
    description = "The mediator's control API, served as HTTP/1.1 over the unix socket RUN_DIR/api.sock (mode 0600). `vgpuctl` is its client. \
Errors are JSON objects with one `error` string, unknown paths (404) and wrong methods (405) included. \
Sizes in requests are whole bytes or a string with a unit: KiB, MiB, GiB, TiB (also Ki/K...), or decimal KB, MB, GB, TB, with a fraction where the result is whole bytes (\"256MiB\", \"1.5GiB\", \"512MB\"); sizes in responses are bytes. \
Every path is served under /v1, the API's version (GET /v1/tenants), and at the root as listed here, for clients made before the API had a version. \
This document is generated from the daemon's types and routes; GET /openapi.yaml serves it."
))]
struct Doc;

/// The routes and, from the same handlers, the API's OpenAPI document: a
/// route cannot be served undocumented.
fn routes() -> (Router<Arc<Control>>, utoipa::openapi::OpenApi) {
    use utoipa::OpenApi as _;
    use utoipa_axum::routes;
    utoipa_axum::router::OpenApiRouter::with_openapi(Doc::openapi())
        .routes(routes!(devices))
        .routes(routes!(show_device))
        .routes(routes!(scrub_device))
        .routes(routes!(list_tenants, create_tenant))
        .routes(routes!(show_tenant, delete_tenant, set_tenant))
        .routes(routes!(list_pools, create_pool))
        .routes(routes!(show_pool, delete_pool, set_pool))
        .routes(routes!(usage))
        .routes(routes!(metrics))
        .routes(routes!(version))
        .routes(routes!(spec))
        .routes(routes!(healthz))
        .routes(routes!(list_vms, create_vm))
        .routes(routes!(show_vm, delete_vm))
        .routes(routes!(start_vm))
        .routes(routes!(stop_vm))
        .routes(routes!(reboot_vm))
        .routes(routes!(vm_console))
        .routes(routes!(vm_logs))
        .split_for_parts()
}

/// The API's OpenAPI document as YAML: what `GET /openapi.yaml` serves and
/// docs/api/mediator.yaml holds (a test keeps the two the same).
pub fn openapi_yaml() -> String {
    vgpu_api::openapi::to_yaml(&routes().1)
}

/// The document, made once.
static SPEC: std::sync::LazyLock<String> = std::sync::LazyLock::new(openapi_yaml);

/// This document.
#[utoipa::path(get, path = "/openapi.yaml", responses((status = 200, description = "The OpenAPI document of this API", body = serde_json::Value, content_type = "application/yaml")))]
async fn spec() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/yaml")], SPEC.as_str()).into_response()
}

/// Every path is served under `/v1` (the API's version) and, for clients
/// made before it had one, at the root.
pub fn router(c: Arc<Control>) -> Router {
    let api = routes().0.method_not_allowed_fallback(method_not_allowed);
    Router::new().nest("/v1", api.clone()).merge(api).fallback(no_such_path).with_state(c).layer(axum::middleware::map_response(json_errors))
}

/// Refusals axum makes before a handler runs (a path that is not UTF-8, a
/// body over the limit, a missing or wrong content type) come as plain
/// text: they are answered as JSON, as every other refusal is.
async fn json_errors(r: Response) -> Response {
    let json = r.headers().get(axum::http::header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if json || !(r.status().is_client_error() || r.status().is_server_error()) {
        return r;
    }
    let (parts, body) = r.into_parts();
    let text = axum::body::to_bytes(body, 64 << 10).await.map(|b| String::from_utf8_lossy(&b).trim().to_string()).unwrap_or_default();
    let error = if text.is_empty() { parts.status.canonical_reason().unwrap_or("refused").to_string() } else { text };
    let mut out = (parts.status, Json(ErrorBody { error })).into_response();
    // Its other headers (Allow, Retry-After, ...) stay.
    for (k, v) in &parts.headers {
        if k != axum::http::header::CONTENT_TYPE && k != axum::http::header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}

/// Every answer is JSON, an unknown path's and a wrong method's included.
async fn no_such_path(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    (StatusCode::NOT_FOUND, Json(ErrorBody { error: format!("no such path: {method} {}", uri.path()) })).into_response()
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    (StatusCode::METHOD_NOT_ALLOWED, Json(ErrorBody { error: format!("{method} is not allowed on {}", uri.path()) })).into_response()
}

/// The daemon's name and version.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Version)]
struct VersionBody {
    name: &'static str,
    version: &'static str,
}

/// Whether every device's worker is up.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Health)]
struct HealthBody {
    /// `ok`, or `degraded` while a worker is down.
    status: &'static str,
    devices_up: usize,
    /// The devices whose workers are down.
    devices_down: Vec<String>,
}

/// The daemon's name and version.
#[utoipa::path(get, path = "/version", responses((status = 200, description = "Name and version", body = VersionBody)))]
async fn version() -> Json<VersionBody> {
    Json(VersionBody { name: "vgpu-mediatord", version: env!("CARGO_PKG_VERSION") })
}

/// Health, for probes and load balancers.
///
/// 200 while every device's worker is up; 503, naming those that are not,
/// while one restarts. Unknown paths answer 404 and wrong methods 405,
/// each with an Error body, like every other refusal.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "Every device's worker is up", body = HealthBody), (status = 503, description = "A device's worker is down", body = HealthBody)))]
async fn healthz(State(c): St) -> Response {
    let down: Vec<String> = c.devices.iter().filter(|d| !d.is_up()).map(|d| d.spec.name.clone()).collect();
    let up = c.devices.len() - down.len();
    let (code, status) = if down.is_empty() { (StatusCode::OK, "ok") } else { (StatusCode::SERVICE_UNAVAILABLE, "degraded") };
    (code, Json(HealthBody { status, devices_up: up, devices_down: down })).into_response()
}

/// Only `GET /metrics`, for a TCP listener Prometheus scrapes.
pub fn metrics_router(c: Arc<Control>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(c)
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct UsageQuery {
    /// UNIX seconds: records whose interval ends after it.
    #[serde(default)]
    #[param(default = 0)]
    since: f64,
    /// Only this tenant's records (device records are left out).
    tenant: Option<String>,
    /// Most records to answer with. An answer cut by the limit ends where
    /// an interval's records end (one interval with more records than the
    /// limit is answered whole; one of more than 100000 is a 500): ask again with `since` set
    /// to the last record's end until an answer is empty.
    #[param(minimum = 1, maximum = 100000, default = 10000)]
    limit: Option<usize>,
}

/// Usage records (docs/metering.md).
#[utoipa::path(get, path = "/usage", params(UsageQuery), responses((status = 200, description = "Records, oldest first", body = Vec<super::meter::Record>), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody)))]
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
    let recs = blocking(move || meter.records(q.since, q.tenant.as_deref(), limit)).await?.map_err(|e| ControlError::Internal(e.to_string()))?;
    Ok(Json(recs))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ControlError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ControlError::Internal(e.to_string()))
}

/// A device tenants share, with its worker.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Device)]
struct DeviceView {
    name: String,
    /// `cpu` or `cuda`.
    kind: String,
    memory_total: u64,
    /// Sum of the quotas placed here.
    memory_reserved: u64,
    memory_allocated: u64,
    tenants: usize,
    #[schema(value_type = DeviceState)]
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
    /// Bytes of allocations spilled to host RAM.
    memory_spilled: u64,
    /// Host RAM the device's allocations may spill to.
    spill_budget: u64,
    /// How the device's tenants are kept apart: "process" (an executor
    /// each; `worker_pid` is the device's arbiter) or "shared".
    isolation: &'static str,
    /// With process isolation: each tenant's executor (none otherwise).
    executors: Vec<ExecutorView>,
}

/// Where a shared device's worker is (the schema of `Device.state`).
#[derive(utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
enum DeviceState {
    Running,
    Restarting,
    /// A scrub failed verification: the device hands out no memory.
    Quarantined,
}

/// A tenant's executor process.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Executor)]
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
                executors: s.executors().iter().map(|e| ExecutorView { tenant: e.tenant.clone(), pid: e.pid, uid: e.uid, bounds: e.bounds() }).collect(),
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
#[derive(Serialize, utoipa::ToSchema)]
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

/// List devices: those tenants share (with their workers) and those lent whole to VMs.
#[utoipa::path(get, path = "/devices", responses((status = 200, description = "Every device", body = Vec<AnyDevice>)))]
async fn devices(State(c): St) -> Result<Json<Vec<AnyDevice>>, ControlError> {
    Ok(Json(blocking(move || device_views(&c).into_iter().map(AnyDevice::Shared).chain(pass_views(&c).into_iter().map(AnyDevice::Passthrough)).collect()).await?))
}

/// One device; a passthrough device with its state and scrub records.
#[utoipa::path(get, path = "/devices/{name}", params(("name" = String, Path, example = "cpu0")), responses((status = 200, description = "The device", body = AnyDevice), (status = 404, description = "The request was refused", body = ErrorBody)))]
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

/// Reset, rebind and scrub a passthrough device that is not lent; free again if it passes, quarantined if not.
///
/// For a device quarantined after a failed scrub, once its cause is fixed.
#[utoipa::path(post, path = "/devices/{name}/scrub", params(("name" = String, Path, example = "cpu0")), responses((status = 200, description = "The scrub's record (its `ok` says whether it passed)", body = super::passthrough::ScrubRecord), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody), (status = 500, description = "The request was refused", body = ErrorBody)))]
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

/// List tenants.
#[utoipa::path(get, path = "/tenants", responses((status = 200, description = "Every tenant", body = Vec<TenantRecord>)))]
async fn list_tenants(State(c): St) -> Result<Json<Vec<TenantRecord>>, ControlError> {
    // The registry's lock may be held across a state-directory sync: not
    // waited for on an async worker.
    Ok(Json(blocking(move || c.tenants()).await?))
}

/// A tenant with its live usage.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = TenantWithUsage)]
struct TenantView {
    #[serde(flatten)]
    record: TenantRecord,
    /// Null while its worker restarts.
    usage: Option<TenantStats>,
}

/// One tenant with its live usage.
#[utoipa::path(get, path = "/tenants/{name}", params(("name" = String, Path, example = "web")), responses((status = 200, description = "The tenant; `usage` is null while its worker restarts", body = TenantView), (status = 404, description = "The request was refused", body = ErrorBody)))]
async fn show_tenant(State(c): St, Path(name): Path<String>) -> Result<Json<TenantView>, ControlError> {
    let (record, usage) = blocking(move || {
        let record = c.tenant(&name).ok_or_else(|| ControlError::NotFound(format!("no tenant {name}")))?;
        let usage = c.slot(&record.device).and_then(|s| s.stats()).and_then(|d| d.tenants.into_iter().find(|t| t.name == name));
        Ok::<_, ControlError>((record, usage))
    })
    .await??;
    Ok(Json(TenantView { record, usage }))
}

/// Create a tenant and its socket.
#[utoipa::path(post, path = "/tenants", request_body = TenantSpec, responses((status = 201, description = "Created; `socket` is the tenant's capability", body = TenantRecord), (status = 400, description = "The request was refused", body = ErrorBody), (status = 403, description = "The pool (named, or the named device's) is private and the tenant is not on its allow-list", body = ErrorBody), (status = 404, description = "No such pool or device", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody), (status = 503, description = "The request was refused", body = ErrorBody), (status = 507, description = "The quota is more than any device of the pool can hold, or no device of the pool has that much unreserved capacity now", body = ErrorBody), (status = 500, description = "The state directory could not record it (nothing changed), or the host failed", body = ErrorBody)))]
async fn create_tenant(State(c): St, body: axum::body::Bytes) -> Result<(StatusCode, Json<TenantRecord>), ControlError> {
    let spec: TenantSpec = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad tenant description: {e}")))?;
    let rec = blocking(move || c.create_tenant(&spec)).await??;
    Ok((StatusCode::CREATED, Json(rec)))
}

/// A pool as PoolSpec describes it (`allow` absent when empty), with what
/// its devices hold now.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Pool)]
struct PoolView {
    // The description's fields one by one, not flattened: PoolSpec refuses
    // unknown fields, which its schema says, and a response that adds to
    // it must not be held to that.
    name: String,
    devices: Vec<String>,
    access: super::pool::Access,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    allow: Vec<String>,
    placement: super::pool::Placement,
    overcommit: f64,
    sharing: super::pool::Sharing,
    memory_total: u64,
    /// Quotas its devices may hold (memory × overcommit).
    memory_capacity: u64,
    /// Sum of the quotas placed on its devices.
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
        name: spec.name,
        devices: spec.devices,
        access: spec.access,
        allow: spec.allow,
        placement: spec.placement,
        overcommit: spec.overcommit,
        sharing: spec.sharing,
    }
}

/// List pools, the default one first.
#[utoipa::path(get, path = "/pools", responses((status = 200, description = "Every pool", body = Vec<PoolView>)))]
async fn list_pools(State(c): St) -> Result<Json<Vec<PoolView>>, ControlError> {
    Ok(Json(blocking(move || c.pools().into_iter().map(|p| pool_view(&c, p)).collect()).await?))
}

/// One pool.
#[utoipa::path(get, path = "/pools/{name}", params(("name" = String, Path, example = "pool-a")), responses((status = 200, description = "The pool", body = PoolView), (status = 404, description = "The request was refused", body = ErrorBody)))]
async fn show_pool(State(c): St, Path(name): Path<String>) -> Result<Json<PoolView>, ControlError> {
    let view = blocking(move || c.pool(&name).map(|p| pool_view(&c, p)).ok_or_else(|| ControlError::NotFound(format!("no pool {name}")))).await??;
    Ok(Json(view))
}

/// Create a pool of devices that are in the default pool and hold no tenants.
#[utoipa::path(post, path = "/pools", request_body = super::pool::PoolSpec, responses((status = 201, description = "Created", body = PoolView), (status = 400, description = "The request was refused", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody)))]
async fn create_pool(State(c): St, body: axum::body::Bytes) -> Result<(StatusCode, Json<PoolView>), ControlError> {
    let spec: super::pool::PoolSpec = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad pool description: {e}")))?;
    // It may restart the devices' arbiters (MPS): not on an async worker.
    let view = blocking(move || c.create_pool(&spec).map(|p| pool_view(&c, p))).await??;
    Ok((StatusCode::CREATED, Json(view)))
}

/// Change a pool's access, allow-list, placement or overcommit; tenants placed stay where they are.
#[utoipa::path(patch, path = "/pools/{name}", params(("name" = String, Path, example = "pool-a")), request_body = super::pool::PoolChange, responses((status = 200, description = "The changed pool", body = PoolView), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "A lower overcommit would not cover the quotas placed on a device", body = ErrorBody)))]
async fn set_pool(State(c): St, Path(name): Path<String>, body: axum::body::Bytes) -> Result<Json<PoolView>, ControlError> {
    let change: super::pool::PoolChange = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad pool change: {e}")))?;
    // It writes and syncs the saved pools: not on an async worker.
    let view = blocking(move || c.set_pool(&name, &change).map(|p| pool_view(&c, p))).await??;
    Ok(Json(view))
}

/// Delete a pool without tenants; its devices return to the default pool.
#[utoipa::path(delete, path = "/pools/{name}", params(("name" = String, Path, example = "pool-a")), responses((status = 204, description = "Deleted"), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody)))]
async fn delete_pool(State(c): St, Path(name): Path<String>) -> Result<StatusCode, ControlError> {
    // It may stop MPS and restart the devices' arbiters.
    blocking(move || c.delete_pool(&name)).await??;
    Ok(StatusCode::NO_CONTENT)
}

/// Change a tenant's weight, cap, priority class or memory quota live.
///
/// Absent fields stay as they are. The worker applies the new share at
/// once (running work is re-ordered at its next checkpoint). A larger
/// quota must fit the device's unreserved capacity (409 or 507
/// otherwise); a smaller one must still cover what the tenant has
/// allocated (409 otherwise), so the memory it gives back is free.
#[utoipa::path(patch, path = "/tenants/{name}", params(("name" = String, Path, example = "web")), request_body = super::TenantChange, responses((status = 200, description = "The tenant as changed", body = TenantRecord), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody), (status = 507, description = "The request was refused", body = ErrorBody), (status = 500, description = "The state directory could not record it (nothing changed), or the host failed", body = ErrorBody)))]
async fn set_tenant(State(c): St, Path(name): Path<String>, body: axum::body::Bytes) -> Result<Json<TenantRecord>, ControlError> {
    let change: super::TenantChange = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad tenant change: {e}")))?;
    Ok(Json(blocking(move || c.set_tenant(&name, &change)).await??))
}

/// Delete a tenant.
///
/// The tenant is revoked at once: every request on every connection and
/// VM context fails from then on, and its connections are closed. Its
/// worker then frees its memory; the quota stays reserved (state
/// `deleting`) until that is done: 204 once it is, 202 before.
#[utoipa::path(delete, path = "/tenants/{name}", params(("name" = String, Path, example = "web")), responses((status = 204, description = "Deleted, its memory released and its quota free"), (status = 202, description = "Revoked; its memory is still being released (state deleting)"), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody), (status = 500, description = "The state directory could not record it (nothing changed), or the host failed", body = ErrorBody)))]
async fn delete_tenant(State(c): St, Path(name): Path<String>) -> Result<StatusCode, ControlError> {
    if c.vms.get().is_some_and(|v| v.owns_tenant(&name)) {
        return Err(ControlError::Conflict(format!("tenant {name} is VM {name}'s vGPU: delete the VM")));
    }
    let done = blocking(move || c.delete_tenant(&name)).await??;
    Ok(if done { StatusCode::NO_CONTENT } else { StatusCode::ACCEPTED })
}

/// Prometheus text exposition.
///
/// Device families (labels device, uuid, model): vgpu_device_up,
/// vgpu_device_worker_restarts_total, vgpu_device_memory_bytes,
/// vgpu_device_memory_allocated_bytes, vgpu_device_scrubbed_bytes_total,
/// vgpu_device_quarantined, vgpu_device_busy_seconds_total,
/// vgpu_device_utilization and more; tenant families (labels tenant and the
/// device's): vgpu_tenant_memory_quota_bytes, vgpu_tenant_memory_used_bytes,
/// vgpu_tenant_kernels_total, vgpu_tenant_device_seconds_total,
/// vgpu_tenant_scrubbed_bytes_total, vgpu_tenant_connections,
/// vgpu_tenant_host_memory_bytes, vgpu_tenant_host_memory_limit_bytes,
/// vgpu_tenant_host_memory_refusals_total and more; passthrough families (labels device, address).
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Metrics", body = String, content_type = "text/plain")))]
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
    family(
        "vgpu_tenant_host_memory_refusals_total",
        "counter",
        "Requests the tenant's host memory budget refused (module loads among them), since its device process started.",
        ten(&|t| t.host_refused as f64),
    );
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

/// List managed VMs (docs/vms.md).
#[utoipa::path(get, path = "/vms", responses((status = 200, description = "Every VM", body = Vec<VmView>), (status = 404, description = "The request was refused", body = ErrorBody)))]
async fn list_vms(State(c): St) -> Result<Json<Vec<VmView>>, ControlError> {
    Ok(Json(blocking(move || vms(&c).map(|v| v.list(&c))).await??))
}

/// Create a VM (with its vGPU and passthrough devices, if it asks for them) and start it.
///
/// Creates the VM's vGPU tenant (kind vm, the VM's name), placed by its
/// pool's policy, and lends it a device from each passthrough pool it
/// names (bound to vfio-pci); the VM runs on the vGPU's NUMA node (else
/// its first device's). Returns once the VMM is up. Any failure leaves
/// nothing behind: no tenant, VMM, socket, hugepage reservation or state
/// file; a device already lent is returned (reset, rebound, scrubbed) as
/// on a delete.
#[utoipa::path(post, path = "/vms", request_body = vgpu_api::vm::VmSpec, responses((status = 201, description = "Created and running", body = VmView), (status = 400, description = "The request was refused", body = ErrorBody), (status = 403, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody), (status = 500, description = "The request was refused", body = ErrorBody), (status = 503, description = "The request was refused", body = ErrorBody), (status = 507, description = "The vGPU does not fit the pool, or the VM's hugepages are not free on its node", body = ErrorBody)))]
async fn create_vm(State(c): St, body: axum::body::Bytes) -> Result<(StatusCode, Json<VmView>), ControlError> {
    let spec: vgpu_api::vm::VmSpec = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad VM description: {e}")))?;
    let v = blocking(move || vms(&c).and_then(|v| v.create(&c, spec))).await??;
    Ok((StatusCode::CREATED, Json(v)))
}

/// One VM.
#[utoipa::path(get, path = "/vms/{name}", params(("name" = String, Path, example = "vm1")), responses((status = 200, description = "The VM", body = VmView), (status = 404, description = "The request was refused", body = ErrorBody)))]
async fn show_vm(State(c): St, Path(name): Path<String>) -> Result<Json<VmView>, ControlError> {
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.show(&c, &name))).await??))
}

/// Delete a VM, its VMM, its vGPU (memory scrubbed), its state and logs; its passthrough devices are reset, rebound and scrubbed back into their pools.
#[utoipa::path(delete, path = "/vms/{name}", params(("name" = String, Path, example = "vm1")), responses((status = 204, description = "Deleted, and the vGPU's memory released"), (status = 202, description = "Deleted; the vGPU's memory is still being released"), (status = 404, description = "The request was refused", body = ErrorBody)))]
async fn delete_vm(State(c): St, Path(name): Path<String>) -> Result<StatusCode, ControlError> {
    let done = blocking(move || vms(&c).and_then(|v| v.delete(&c, &name))).await??;
    Ok(if done { StatusCode::NO_CONTENT } else { StatusCode::ACCEPTED })
}

/// Start a stopped VM (it stays running across daemon restarts).
#[utoipa::path(post, path = "/vms/{name}/start", params(("name" = String, Path, example = "vm1")), responses((status = 200, description = "Running", body = VmView), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The VM is being deleted", body = ErrorBody), (status = 500, description = "The request was refused", body = ErrorBody)))]
async fn start_vm(State(c): St, Path(name): Path<String>) -> Result<Json<VmView>, ControlError> {
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.start(&c, &name))).await??))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct StopQuery {
    /// Seconds to wait for the guest before the VMM is killed (0: at once;
    /// default vms.stop_timeout_s; at most 3600).
    timeout: Option<u64>,
}

/// Ask the guest to shut down, and kill the VMM after the timeout; the VM stays stopped.
#[utoipa::path(post, path = "/vms/{name}/stop", params(("name" = String, Path, example = "vm1"), StopQuery), responses((status = 200, description = "Stopped", body = VmView), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The VM is being deleted", body = ErrorBody)))]
async fn stop_vm(State(c): St, Path(name): Path<String>, q: Result<axum::extract::Query<StopQuery>, axum::extract::rejection::QueryRejection>) -> Result<Json<VmView>, ControlError> {
    let axum::extract::Query(q) = q.map_err(|e| ControlError::BadRequest(format!("bad stop query: {e}")))?;
    let timeout = q.timeout.map(|s| std::time::Duration::from_secs(s.min(3600)));
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.stop(&c, &name, timeout))).await??))
}

/// Reset a running VM (its VMM is killed and started again).
#[utoipa::path(post, path = "/vms/{name}/reboot", params(("name" = String, Path, example = "vm1")), responses((status = 200, description = "Running again", body = VmView), (status = 404, description = "The request was refused", body = ErrorBody), (status = 409, description = "The request was refused", body = ErrorBody)))]
async fn reboot_vm(State(c): St, Path(name): Path<String>) -> Result<Json<VmView>, ControlError> {
    Ok(Json(blocking(move || vms(&c).and_then(|v| v.reboot(&c, &name))).await??))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct TailQuery {
    /// The last this many bytes (at most 2 MiB are kept).
    #[param(default = 65536)]
    bytes: Option<u64>,
}

async fn log_tail(c: Arc<Control>, name: String, q: Result<axum::extract::Query<TailQuery>, axum::extract::rejection::QueryRejection>, console: bool) -> Result<Response, ControlError> {
    let axum::extract::Query(q) = q.map_err(|e| ControlError::BadRequest(format!("bad log query: {e}")))?;
    let bytes = q.bytes.unwrap_or(64 << 10);
    let text = blocking(move || vms(&c).and_then(|v| if console { v.console(&name, bytes) } else { v.logs(&name, bytes) })).await??;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

/// The guest's serial console output.
#[utoipa::path(get, path = "/vms/{name}/console", params(("name" = String, Path, example = "vm1"), TailQuery), responses((status = 200, description = "Console text", body = String, content_type = "text/plain"), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody)))]
async fn vm_console(State(c): St, Path(name): Path<String>, q: Result<axum::extract::Query<TailQuery>, axum::extract::rejection::QueryRejection>) -> Result<Response, ControlError> {
    log_tail(c, name, q, true).await
}

/// The VM's VMM log.
#[utoipa::path(get, path = "/vms/{name}/logs", params(("name" = String, Path, example = "vm1"), TailQuery), responses((status = 200, description = "Log text", body = String, content_type = "text/plain"), (status = 400, description = "The request was refused", body = ErrorBody), (status = 404, description = "The request was refused", body = ErrorBody)))]
async fn vm_logs(State(c): St, Path(name): Path<String>, q: Result<axum::extract::Query<TailQuery>, axum::extract::rejection::QueryRejection>) -> Result<Response, ControlError> {
    log_tail(c, name, q, false).await
}

#[cfg(test)]
mod document {
    /// docs/api/mediator.yaml is what the types and routes generate; with
    /// VGPU_WRITE_API_DOCS=1 (scripts/api-docs.sh) the test writes it.
    #[test]
    fn the_committed_document_is_the_generated_one() {
        vgpu_api::openapi::check_committed(&super::openapi_yaml(), concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api/mediator.yaml"));
    }
}
