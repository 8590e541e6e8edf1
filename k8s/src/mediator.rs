//! The local `vgpu-mediatord`'s API, as the plugin uses it (blocking calls
//! over its unix socket; the plugin makes them on tokio's blocking pool).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use vgpu_api::tenant::TenantSpec;

use crate::slices::Device;

#[derive(Debug, thiserror::Error)]
pub enum MediatorError {
    #[error(transparent)]
    Http(#[from] vgpu_api::http::HttpError),
    #[error("{method} {path}: {message} (HTTP {status})")]
    Refused { method: &'static str, path: String, status: u16, message: String },
    #[error("{method} {path}: the answer is not what the API documents: {why}")]
    Answer { method: &'static str, path: String, why: String },
}

impl MediatorError {
    /// The HTTP status of a refusal.
    pub fn status(&self) -> Option<u16> {
        match self {
            MediatorError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

pub struct Mediator {
    api: PathBuf,
}

impl Mediator {
    /// The daemon whose run directory is `run_dir` (its API is
    /// `RUN_DIR/api.sock`).
    pub fn new(run_dir: &Path) -> Mediator {
        Mediator { api: run_dir.join("api.sock") }
    }

    fn call(&self, method: &'static str, path: &str, body: Option<&Value>) -> Result<(u16, Value), MediatorError> {
        let bytes = body.map(|b| b.to_string());
        let r = vgpu_api::http::request(&self.api, method, path, bytes.as_deref().map(str::as_bytes))?;
        let v: Value = if r.body.is_empty() { Value::Null } else { serde_json::from_slice(&r.body).unwrap_or(Value::String(r.text())) };
        if !(200..300).contains(&r.status) {
            let message = v.get("error").and_then(Value::as_str).map(String::from).unwrap_or_else(|| r.text());
            return Err(MediatorError::Refused { method, path: path.into(), status: r.status, message });
        }
        Ok((r.status, v))
    }

    /// The devices tenants share (not those lent whole to VMs).
    pub fn devices(&self) -> Result<Vec<Device>, MediatorError> {
        let path = "/v1/devices";
        let (_, v) = self.call("GET", path, None)?;
        let answer = |why: &str| MediatorError::Answer { method: "GET", path: path.into(), why: why.into() };
        let list = v.as_array().ok_or_else(|| answer("not a list"))?;
        Ok(list
            .iter()
            .filter(|d| d["kind"] != "passthrough")
            .map(|d| Device {
                name: d["name"].as_str().unwrap_or_default().into(),
                pool: d["pool"].as_str().unwrap_or_default().into(),
                kind: d["kind"].as_str().unwrap_or_default().into(),
                isolation: d["isolation"].as_str().unwrap_or_default().into(),
                numa_node: d["numa_node"].as_i64().and_then(|n| i32::try_from(n).ok()).unwrap_or(-1),
                capacity: d["memory_capacity"].as_u64().unwrap_or(0),
                reserved: d["memory_reserved"].as_u64().unwrap_or(0),
                running: d["state"] == "running",
            })
            .collect())
    }

    /// Creates the tenant; returns its socket and the settings its
    /// programs need in their environment on its device (the tenant's
    /// `env`, without `VGPU_SOCKET`).
    pub fn create_tenant(&self, spec: &TenantSpec) -> Result<(PathBuf, BTreeMap<String, String>), MediatorError> {
        let body = serde_json::to_value(spec).map_err(|e| MediatorError::Answer { method: "POST", path: "/v1/tenants".into(), why: e.to_string() })?;
        let (_, v) = self.call("POST", "/v1/tenants", Some(&body))?;
        let read = || {
            let answer = |why: &str| MediatorError::Answer { method: "POST", path: "/v1/tenants".into(), why: why.into() };
            let socket = v["socket"].as_str().map(PathBuf::from).ok_or_else(|| answer("no socket"))?;
            Ok((socket, tenant_env(&v).map_err(|e| answer(&e))?))
        };
        let got = read();
        if got.is_err() {
            // Made, but not usable as answered: not left behind.
            let _ = self.delete_tenant(&spec.name);
        }
        got
    }

    /// The settings the tenant's programs need on its device (see
    /// [`Mediator::create_tenant`]); `None` if there is no such tenant.
    pub fn tenant_env(&self, name: &str) -> Result<Option<BTreeMap<String, String>>, MediatorError> {
        let path = format!("/v1/tenants/{name}");
        match self.call("GET", &path, None) {
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
            Ok((_, v)) => tenant_env(&v).map(Some).map_err(|why| MediatorError::Answer { method: "GET", path, why }),
        }
    }

    /// Deletes the tenant (revoked at once; its memory is scrubbed before
    /// anyone else gets it). One already gone is not an error.
    pub fn delete_tenant(&self, name: &str) -> Result<(), MediatorError> {
        match self.call("DELETE", &format!("/v1/tenants/{name}"), None) {
            Err(e) if e.status() == Some(404) => Ok(()),
            r => r.map(drop),
        }
    }

    /// The names of every tenant.
    pub fn tenants(&self) -> Result<Vec<String>, MediatorError> {
        let (_, v) = self.call("GET", "/v1/tenants", None)?;
        Ok(v.as_array().into_iter().flatten().filter_map(|t| t["name"].as_str().map(String::from)).collect())
    }
}

/// A tenant description's `env` (absent or null: none).
fn tenant_env(v: &Value) -> Result<BTreeMap<String, String>, String> {
    match v.get("env") {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(e) => serde_json::from_value(e.clone()).map_err(|e| format!("env: {e}")),
    }
}
