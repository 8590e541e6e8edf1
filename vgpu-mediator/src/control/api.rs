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

type St = State<Arc<Control>>;

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let code = match &self {
            ControlError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ControlError::NotFound(_) => StatusCode::NOT_FOUND,
            ControlError::Conflict(_) => StatusCode::CONFLICT,
            ControlError::InsufficientMemory(_) => StatusCode::INSUFFICIENT_STORAGE,
            ControlError::WorkerDown(_) => StatusCode::SERVICE_UNAVAILABLE,
            ControlError::Timeout(..) => StatusCode::GATEWAY_TIMEOUT,
            ControlError::Worker(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (code, Json(json!({ "error": self.to_string() }))).into_response()
    }
}

pub fn router(c: Arc<Control>) -> Router {
    Router::new()
        .route("/devices", get(devices))
        .route("/tenants", get(list_tenants).post(create_tenant))
        .route("/tenants/{name}", get(show_tenant).delete(delete_tenant).patch(set_tenant))
        .route("/metrics", get(metrics))
        .with_state(c)
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
}

fn device_views(c: &Control) -> Vec<DeviceView> {
    let tenants = c.tenants();
    c.devices
        .iter()
        .map(|s| {
            let st = s.stats();
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
            }
        })
        .collect()
}

fn utilization(d: &DeviceStats) -> f64 {
    if d.uptime_ns == 0 { 0.0 } else { d.busy_ns as f64 / (d.uptime_ns as f64 * d.lanes.max(1) as f64) }
}

async fn devices(State(c): St) -> Result<Json<Vec<DeviceView>>, ControlError> {
    Ok(Json(blocking(move || device_views(&c)).await?))
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

async fn set_tenant(State(c): St, Path(name): Path<String>, body: axum::body::Bytes) -> Result<Json<TenantRecord>, ControlError> {
    let change: super::TenantChange = serde_json::from_slice(&body).map_err(|e| ControlError::BadRequest(format!("bad tenant change: {e}")))?;
    Ok(Json(blocking(move || c.set_tenant(&name, &change)).await??))
}

/// 204 once the tenant is gone and its memory released; 202 while its
/// worker is still releasing it (it is revoked either way).
async fn delete_tenant(State(c): St, Path(name): Path<String>) -> Result<StatusCode, ControlError> {
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

/// Prometheus text exposition of every device and tenant.
pub fn render_metrics(c: &Control) -> String {
    let mut out = String::new();
    let stats: Vec<_> = c.devices.iter().map(|s| (s, s.stats())).collect();
    let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    };
    let dev = |f: &dyn Fn(&DeviceStats) -> f64| -> Vec<(String, f64)> {
        stats.iter().filter_map(|(s, d)| d.as_ref().map(|d| (format!("device=\"{}\"", esc(&s.spec.name)), f(d)))).collect()
    };
    family("vgpu_device_up", "gauge", "Whether the device worker is serving (1) or restarting (0).",
        stats.iter().map(|(s, d)| (format!("device=\"{}\"", esc(&s.spec.name)), d.is_some() as u8 as f64)).collect());
    family("vgpu_device_worker_restarts_total", "counter", "Times the device worker was restarted after exiting.",
        stats.iter().map(|(s, _)| (format!("device=\"{}\"", esc(&s.spec.name)), s.restarts.load(Ordering::Relaxed) as f64)).collect());
    family("vgpu_device_memory_bytes", "gauge", "Device memory size.", dev(&|d| d.memory as f64));
    family("vgpu_device_memory_allocated_bytes", "gauge", "Device memory allocated by tenants.", dev(&|d| d.allocated as f64));
    family("vgpu_device_scrubbed_bytes_total", "counter", "Bytes zeroed before hand-out on the device.", dev(&|d| d.bytes_scrubbed as f64));
    family("vgpu_device_quarantined", "gauge", "1 once a scrub failed verification: the device hands out no memory.", dev(&|d| d.quarantined as u8 as f64));
    family("vgpu_device_busy_seconds_total", "counter", "Lane-seconds the device spent running tenant work.", dev(&|d| d.busy_ns as f64 / 1e9));
    family("vgpu_device_utilization", "gauge", "Busy lane-time over available lane-time since the worker started.", dev(&utilization));
    let ten = |f: &dyn Fn(&TenantStats) -> f64| -> Vec<(String, f64)> {
        stats
            .iter()
            .filter_map(|(s, d)| d.as_ref().map(|d| (s, d)))
            .flat_map(|(s, d)| d.tenants.iter().map(move |t| (format!("tenant=\"{}\",device=\"{}\"", esc(&t.name), esc(&s.spec.name)), f(t))))
            .collect()
    };
    family("vgpu_tenant_memory_quota_bytes", "gauge", "Tenant memory quota.", ten(&|t| t.quota as f64));
    family("vgpu_tenant_memory_used_bytes", "gauge", "Device memory the tenant has allocated.", ten(&|t| t.used as f64));
    family("vgpu_tenant_kernels_total", "counter", "Kernels the tenant launched.", ten(&|t| t.kernels as f64));
    family("vgpu_tenant_device_seconds_total", "counter", "Device time the tenant's work used.", ten(&|t| t.device_ns as f64 / 1e9));
    family("vgpu_tenant_scrubbed_bytes_total", "counter", "Bytes zeroed before being handed to the tenant.", ten(&|t| t.bytes_scrubbed as f64));
    family("vgpu_tenant_connections", "gauge", "Open client connections of the tenant.", ten(&|t| t.connections as f64));
    family("vgpu_tenant_host_memory_bytes", "gauge", "Host memory the tenant's objects keep in its device worker.", ten(&|t| t.host_used as f64));
    family("vgpu_tenant_host_memory_limit_bytes", "gauge", "The tenant's host memory budget in its device worker.", ten(&|t| t.host_limit as f64));
    out
}
