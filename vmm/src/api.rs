//! The per-VM REST API over a unix socket (docs/api/vmm.yaml):
//! `GET /vm`, `PUT /vm/pause`, `/vm/resume`, `/vm/shutdown`, `/vm/kill`.

use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};

use crate::devices::i8042::I8042;
use crate::vm::{Control, ExitReason, VmInfo};

/// What the API socket (mode 0600, its VMM's user only) allows: the
/// mediator and `vgpuctl` make one request per connection, so 16 at once
/// is ample, and far under any descriptor limit a VMM runs with; the
/// default timeouts close silent, half-sent and idle keep-alive
/// connections (docs/threat-model.md).
pub const API_LIMITS: vgpu_api::serve::Limits = vgpu_api::serve::Limits::with_connections(16);

#[derive(Clone)]
pub struct ApiState {
    pub control: Arc<Control>,
    pub info: VmInfo,
    pub keyboard: Arc<Mutex<I8042>>,
}

/// A refusal: what every error answer holds.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = Error)]
struct ErrorBody {
    error: String,
}

fn error(code: StatusCode, msg: impl Into<String>) -> Response {
    (code, Json(ErrorBody { error: msg.into() })).into_response()
}

#[derive(utoipa::OpenApi)]
#[openapi(info(
    title = "vgpu-vmm API",
    version = "1",
    description = "One VM's control API, served as HTTP/1.1 over the unix socket given with --api-socket (mode 0600). `vgpuctl vmm --socket PATH ...` is its client. \
Errors are JSON objects with one `error` string. This document is generated from the VMM's types and routes."
))]
struct Doc;

/// The routes and, from the same handlers, the API's OpenAPI document.
fn routes() -> (Router<ApiState>, utoipa::openapi::OpenApi) {
    use utoipa::OpenApi as _;
    use utoipa_axum::routes;
    utoipa_axum::router::OpenApiRouter::with_openapi(Doc::openapi())
        .routes(routes!(vm_info))
        .routes(routes!(pause))
        .routes(routes!(resume))
        .routes(routes!(shutdown))
        .routes(routes!(kill))
        .split_for_parts()
}

/// The API's OpenAPI document as YAML (docs/api/vmm.yaml; a test keeps the
/// two the same).
pub fn openapi_yaml() -> String {
    vgpu_api::openapi::to_yaml(&routes().1)
}

/// The VM's state and description.
#[utoipa::path(get, path = "/vm", responses((status = 200, description = "The VM", body = VmInfo)))]
async fn vm_info(State(s): State<ApiState>) -> Json<VmInfo> {
    let mut info = s.info.clone();
    info.state = s.control.state();
    Json(info)
}

/// Stop every vCPU; returns once all have stopped.
#[utoipa::path(put, path = "/vm/pause", responses((status = 204, description = "Paused (or already paused)"), (status = 409, description = "Refused", body = ErrorBody), (status = 500, description = "Refused", body = ErrorBody)))]
async fn pause(State(s): State<ApiState>) -> Response {
    match tokio::task::spawn_blocking(move || s.control.pause()).await {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => error(StatusCode::CONFLICT, e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Let the vCPUs run again.
#[utoipa::path(put, path = "/vm/resume", responses((status = 204, description = "Running"), (status = 409, description = "Refused", body = ErrorBody)))]
async fn resume(State(s): State<ApiState>) -> Response {
    match s.control.resume() {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => error(StatusCode::CONFLICT, e),
    }
}

/// Ask the guest to shut down (Ctrl-Alt-Del on the i8042).
#[utoipa::path(put, path = "/vm/shutdown", responses((status = 202, description = "Asked; the VMM exits 0 when the guest resets"), (status = 409, description = "Refused", body = ErrorBody)))]
async fn shutdown(State(s): State<ApiState>) -> Response {
    if s.control.state() != crate::vm::RunState::Running {
        return error(StatusCode::CONFLICT, "the VM is not running; resume it before asking the guest to shut down");
    }
    s.keyboard.lock().unwrap_or_else(|e| e.into_inner()).ctrl_alt_del();
    StatusCode::ACCEPTED.into_response()
}

/// End the VM at once (the VMM exits with status 4).
#[utoipa::path(put, path = "/vm/kill", responses((status = 204, description = "Ending")))]
async fn kill(State(s): State<ApiState>) -> Response {
    s.control.request_exit(ExitReason::Killed);
    StatusCode::NO_CONTENT.into_response()
}

/// Every answer is JSON, an unknown path's and a wrong method's included.
pub fn router(s: ApiState) -> Router {
    let no_such_path = |method: axum::http::Method, uri: axum::http::Uri| async move { error(StatusCode::NOT_FOUND, format!("no such path: {method} {}", uri.path())) };
    let not_allowed = |method: axum::http::Method, uri: axum::http::Uri| async move { error(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {}", uri.path())) };
    routes().0.method_not_allowed_fallback(not_allowed).fallback(no_such_path).with_state(s)
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("API socket {path}: {err}")]
    Bind {
        path: String,
        #[source]
        err: std::io::Error,
    },
    #[error("API thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("API thread: {0}")]
    Start(String),
    #[error("API thread: {0}")]
    Seccomp(#[source] crate::seccomp::SeccompError),
}

/// Binds `path` (mode 0600), refusing a socket another VMM still serves.
pub fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, ApiError> {
    let bind_err = |err| ApiError::Bind { path: path.display().to_string(), err };
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(bind_err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "another VMM is serving it")));
        }
        std::fs::remove_file(path).map_err(bind_err)?;
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(bind_err)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind_err)?;
    }
    listener.set_nonblocking(true).map_err(bind_err)?;
    Ok(listener)
}

/// Serves the API on `listener` on its own thread, which confines itself
/// (seccomp, API kind) once its runtime is up; returns when it is.
pub fn serve(listener: std::os::unix::net::UnixListener, s: ApiState) -> Result<(), ApiError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), ApiError>>();
    std::thread::Builder::new()
        .name("vmm-api".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return drop(ready_tx.send(Err(ApiError::Start(format!("runtime: {e}"))))),
            };
            rt.block_on(async move {
                let l = match tokio::net::UnixListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => return drop(ready_tx.send(Err(ApiError::Start(format!("socket: {e}"))))),
                };
                if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Api) {
                    return drop(ready_tx.send(Err(ApiError::Seccomp(e))));
                }
                let _ = ready_tx.send(Ok(()));
                vgpu_api::serve::serve(l, router(s), API_LIMITS, std::future::pending()).await;
            });
        })
        .map_err(ApiError::Thread)?;
    ready_rx.recv().map_err(|_| ApiError::Start("the API thread died while starting".into()))?
}

#[cfg(test)]
mod document {
    /// docs/api/vmm.yaml is what the types and routes generate; with
    /// VGPU_WRITE_API_DOCS=1 (scripts/api-docs.sh) the test writes it.
    #[test]
    fn the_committed_document_is_the_generated_one() {
        vgpu_api::openapi::check_committed(&super::openapi_yaml(), concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api/vmm.yaml"));
    }
}
