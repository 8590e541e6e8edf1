//! The device plugin: one gRPC server per resource on a socket in the
//! kubelet's device-plugins directory, registered with the kubelet (again
//! whenever the kubelet restarts, which empties that directory), and the
//! node's allocations: tenants made at `Allocate`, deleted once no pod
//! holds their slices.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};
use vgpu_api::tenant::{TenantKind, TenantSpec};

use crate::cdi;
use crate::mediator::Mediator;
use crate::proto::deviceplugin as dp;
use crate::proto::podresources as pr;
use crate::slices::{self, Resource};
use crate::state::{Allocation, State, StateError};

/// The device plugin API version this plugin speaks.
pub const API_VERSION: &str = "v1beta1";
/// Most slices one container may hold (a tenant's weight is its slice
/// count, and weights go to 10000).
pub const MAX_SLICES_PER_CONTAINER: usize = 1024;

/// What both node components (device plugin and DRA driver) use on the
/// host: the mediator, the driver libraries, their record, CDI specs.
#[derive(Debug, Clone)]
pub struct Host {
    /// Where CDI specs go.
    pub cdi_dir: PathBuf,
    /// The mediator's run directory (its API socket).
    pub run_dir: PathBuf,
    /// Where the component keeps its record.
    pub state_dir: PathBuf,
    /// The driver libraries containers get (the shim's libcuda.so.1, and
    /// libnvidia-ml.so.1 where it exists).
    pub libs: Vec<PathBuf>,
    /// Where they go in the container.
    pub container_lib_dir: PathBuf,
}

/// How the node component is set up (`vgpu-k8s device-plugin --help`).
#[derive(Debug, Clone)]
pub struct Config {
    /// The kubelet's directory (`device-plugins/`, `pod-resources/`).
    pub kubelet_dir: PathBuf,
    pub host: Host,
    pub resources: Vec<Resource>,
    /// Answer Allocate with CDI devices (else with mounts, for runtimes
    /// without CDI); the environment is given either way.
    pub cdi: bool,
    /// The names of the tenants this plugin makes start with it.
    pub tenant_prefix: String,
    /// How often devices are looked at and the plugin's sockets checked.
    pub poll: Duration,
    /// How often pods' holdings are compared with the allocations.
    pub reconcile: Duration,
    /// How long an allocation stands before it must show in a pod (the
    /// kubelet allocates before it creates the container).
    pub grace: Duration,
}

impl Config {
    fn device_plugins(&self) -> PathBuf {
        self.kubelet_dir.join("device-plugins")
    }
    fn kubelet_socket(&self) -> PathBuf {
        self.device_plugins().join("kubelet.sock")
    }
    fn pod_resources_socket(&self) -> PathBuf {
        self.kubelet_dir.join("pod-resources/kubelet.sock")
    }
    fn state_file(&self) -> PathBuf {
        self.host.state_dir.join("state.json")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Mediator(#[from] crate::mediator::MediatorError),
    #[error("{0}")]
    Request(String),
    #[error("CDI spec for {tenant}: {err}")]
    Cdi { tenant: String, err: std::io::Error },
}

impl PluginError {
    /// As the kubelet is told: tenant names' secrets hidden.
    pub fn to_status(&self, prefix: &str) -> Status {
        let msg = redact(prefix, &self.to_string());
        match self {
            PluginError::Request(_) => Status::invalid_argument(msg),
            PluginError::Mediator(m) if matches!(m.status(), Some(507 | 409)) => Status::resource_exhausted(msg),
            _ => Status::internal(msg),
        }
    }
}

/// 64 random bits from the kernel.
pub(crate) fn random_u64() -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b, which lives
    // across the call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(u64::from_ne_bytes(b))
}

pub(crate) fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The node's side: the mediator, the allocations, and a signal that they
/// changed (ListAndWatch streams send a new list then).
pub struct Node {
    pub cfg: Config,
    mediator: Mediator,
    state: Mutex<State>,
    changed: watch::Sender<u64>,
}

impl Node {
    /// Loads the allocations (a corrupt state file is refused), writes the
    /// CDI specs of the recorded tenants again where they are gone (after a
    /// reboot), and deletes the tenants with this plugin's prefix that no
    /// allocation names (made by a plugin that died before it could record
    /// them).
    pub fn open(cfg: Config) -> Result<Node, PluginError> {
        std::fs::create_dir_all(&cfg.host.state_dir).map_err(|err| StateError::Write { path: cfg.host.state_dir.display().to_string(), err })?;
        let mut state = State::load(&cfg.state_file())?;
        let mediator = Mediator::new(&cfg.host.run_dir);
        let mut refreshed = false;
        for (t, a) in state.allocations.iter_mut() {
            refreshed |= refresh_env(&mediator, &cfg.host, &cfg.tenant_prefix, t, &a.socket, &mut a.env);
        }
        if refreshed {
            state.save(&cfg.state_file())?;
        }
        for (t, a) in &state.allocations {
            if let Err(e) = ensure_spec(&cfg.host, t, &a.socket, &a.env) {
                warn!(tenant = %t, "writing its CDI spec again: {e}");
            }
        }
        let node = Node { mediator, cfg, state: Mutex::new(state), changed: watch::channel(0).0 };
        node.sweep_orphans();
        Ok(node)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sweep_orphans(&self) {
        let known: BTreeSet<String> = self.lock().allocations.keys().cloned().collect();
        sweep_orphans(&self.mediator, &self.cfg.tenant_prefix, &known, &self.cfg.host.cdi_dir);
    }

    /// The slices `r` offers now.
    pub fn list(&self, r: &Resource) -> Result<Vec<slices::Slice>, PluginError> {
        let devices = self.mediator.devices()?;
        let st = self.lock();
        Ok(slices::slices(r, &devices, &st.allocated(&r.name), &st.reserved_by_device()))
    }

    /// Makes the tenant for one container's slices: their sum of memory, a
    /// weight of one per slice, on their device; its CDI spec; the record.
    pub fn allocate(&self, r: &Resource, ids: &[String]) -> Result<dp::ContainerAllocateResponse, PluginError> {
        if ids.is_empty() || ids.len() > MAX_SLICES_PER_CONTAINER {
            return Err(PluginError::Request(format!("a container holds 1 to {MAX_SLICES_PER_CONTAINER} slices of {}, not {}", r.name, ids.len())));
        }
        let mut by_device: BTreeMap<&str, usize> = BTreeMap::new();
        for id in ids {
            let d = slices::device_of(id).ok_or_else(|| PluginError::Request(format!("{id} is not a slice of {}", r.name)))?;
            *by_device.entry(d).or_default() += 1;
        }
        // One tenant lives on one device: the one holding most of them.
        let device = by_device.iter().max_by_key(|(_, n)| **n).map(|(d, _)| d.to_string()).unwrap_or_default();
        let devices = self.mediator.devices()?;
        if !devices.iter().any(|d| d.name == device && d.pool == r.pool) {
            return Err(PluginError::Request(format!("device {device} is not in pool {}", r.pool)));
        }
        let mut st = self.lock();
        // Slices the kubelet hands out again are free: an allocation that
        // still holds one is stale (its pod is gone before the reconcile
        // noticed).
        let stale: Vec<String> = st.allocations.iter().filter(|(_, a)| a.resource == r.name && a.ids.iter().any(|i| ids.contains(i))).map(|(t, _)| t.clone()).collect();
        for t in stale {
            info!(tenant = %t, "its slices were allocated again: deleting it");
            self.release(&mut st, &t)?;
        }
        let name = tenant_name(&self.cfg.tenant_prefix, st.next)?;
        st.next += 1;
        st.save(&self.cfg.state_file())?;
        let memory = r.slice.0.saturating_mul(ids.len() as u64);
        let spec = TenantSpec { pool: Some(r.pool.clone()), ..container_tenant(&name, memory, ids.len() as u32, &device) };
        let Handed { socket, env, edits } = create_handed_over(&self.mediator, &spec, &self.cfg.host)?;
        st.allocations.insert(name.clone(), Allocation { resource: r.name.clone(), device, ids: ids.to_vec(), memory, socket, env, created: now_s() });
        st.save(&self.cfg.state_file())?;
        drop(st);
        self.changed.send_modify(|n| *n += 1);
        info!(tenant = %name, slices = ids.len(), "allocated");
        let envs = edits.env.iter().cloned().collect();
        Ok(if self.cfg.cdi {
            dp::ContainerAllocateResponse { envs, cdi_devices: vec![dp::CdiDevice { name: cdi::device_name(&name) }], ..Default::default() }
        } else {
            let mounts = edits.mounts.iter().map(|(h, c, ro)| dp::Mount { host_path: h.display().to_string(), container_path: c.display().to_string(), read_only: *ro }).collect();
            dp::ContainerAllocateResponse { envs, mounts, ..Default::default() }
        })
    }

    /// Deletes a tenant of this node, its spec and its record.
    fn release(&self, st: &mut State, tenant: &str) -> Result<(), PluginError> {
        self.mediator.delete_tenant(tenant)?;
        cdi::remove(&self.cfg.host.cdi_dir, tenant).map_err(|err| PluginError::Cdi { tenant: tenant.into(), err })?;
        st.allocations.remove(tenant);
        st.save(&self.cfg.state_file())?;
        Ok(())
    }

    /// Deletes the allocations no pod holds any more: `in_use` is each
    /// resource's slice ids the kubelet's pods hold. One younger than the
    /// grace period stands (its container may not exist yet).
    pub fn reconcile(&self, in_use: &BTreeSet<(String, String)>) -> Vec<String> {
        let now = now_s();
        let mut st = self.lock();
        let gone: Vec<String> = st
            .allocations
            .iter()
            .filter(|(_, a)| now.saturating_sub(a.created) >= self.cfg.grace.as_secs() && !a.ids.iter().any(|i| in_use.contains(&(a.resource.clone(), i.clone()))))
            .map(|(t, _)| t.clone())
            .collect();
        let mut released = Vec::new();
        for t in gone {
            match self.release(&mut st, &t) {
                Ok(()) => {
                    info!(tenant = %t, "no pod holds its slices: deleted");
                    released.push(t);
                }
                Err(e) => warn!(tenant = %t, "deleting it: {e}"),
            }
        }
        drop(st);
        if !released.is_empty() {
            self.changed.send_modify(|n| *n += 1);
        }
        released
    }

    /// The allocations, by tenant.
    pub fn allocations(&self) -> BTreeMap<String, Allocation> {
        self.lock().allocations.clone()
    }
}

/// Lower-case hex digits.
fn is_hex(s: &[u8]) -> bool {
    s.iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
}

/// The length of a made name's tail after its prefix where `rest` starts
/// with one (`N-TTTTTTTT-SSSSSSSSSSSSSSSS`), and where its secret starts.
fn made_tail(rest: &[u8]) -> Option<(usize, usize)> {
    let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
    let tag = digits + 1;
    let secret = tag + 9;
    let end = secret + 16;
    let ok = digits > 0
        && rest.get(digits) == Some(&b'-')
        && rest.get(tag..tag + 8).is_some_and(is_hex)
        && rest.get(tag + 8) == Some(&b'-')
        && rest.get(secret..end).is_some_and(is_hex)
        && !rest.get(end).is_some_and(|c| c.is_ascii_hexdigit());
    ok.then_some((end, secret))
}

/// Whether `name` is one [`tenant_name`] makes with `prefix`.
pub(crate) fn is_made_name(prefix: &str, name: &str) -> bool {
    name.strip_prefix(prefix).and_then(|rest| made_tail(rest.as_bytes())).is_some_and(|(end, _)| end == name.len() - prefix.len())
}

/// `msg` with the secret part of every tenant name made with `prefix`
/// hidden: what the kubelet is told reaches pod events, which users of the
/// pod's namespace read, and a tenant's name opens its socket.
pub(crate) fn redact(prefix: &str, msg: &str) -> String {
    if prefix.is_empty() {
        return msg.to_string();
    }
    // Every place the prefix starts, whatever precedes it.
    let mut out = String::with_capacity(msg.len());
    let mut copied = 0;
    for (i, _) in msg.char_indices() {
        if i < copied || !msg[i..].starts_with(prefix) {
            continue;
        }
        if let Some((end, secret)) = made_tail(&msg.as_bytes()[i + prefix.len()..]) {
            out.push_str(&msg[copied..i + prefix.len() + secret]);
            out.push_str("(secret)");
            copied = i + prefix.len() + end;
        }
    }
    out.push_str(&msg[copied..]);
    out
}

/// Writes a recorded tenant's CDI spec again where it is missing (the CDI
/// directory is often a tmpfs, emptied by a reboot the record survives).
pub(crate) fn ensure_spec(host: &Host, tenant: &str, socket: &Path, env: &BTreeMap<String, String>) -> std::io::Result<()> {
    if cdi::spec_path(&host.cdi_dir, tenant).exists() {
        return Ok(());
    }
    write_spec(host, tenant, socket, env).map(drop)
}

/// Writes the tenant's CDI spec; returns its container edits.
fn write_spec(host: &Host, tenant: &str, socket: &Path, env: &BTreeMap<String, String>) -> std::io::Result<cdi::Edits> {
    let edits = cdi::edits(socket, env, &host.libs, &host.container_lib_dir);
    cdi::write(&host.cdi_dir, tenant, &cdi::spec(tenant, &edits))?;
    Ok(edits)
}

/// Brings a recorded tenant's settings (`env`) up to what the daemon now
/// gives it, and writes its CDI spec again if they changed: a record made
/// before tenants carried settings has none, and a tenant's device decides
/// them. Returns whether the record changed. The daemon's errors are
/// logged and leave the record as it is.
pub(crate) fn refresh_env(mediator: &Mediator, host: &Host, prefix: &str, tenant: &str, socket: &Path, env: &mut BTreeMap<String, String>) -> bool {
    match mediator.tenant_env(tenant) {
        Ok(Some(now)) if now != *env => {
            info!(tenant = %cdi::public_id(tenant), "the daemon gives the tenant other settings than its record has: recording them and writing its CDI spec again");
            *env = now;
            if let Err(e) = write_spec(host, tenant, socket, env) {
                warn!(tenant = %cdi::public_id(tenant), "writing its CDI spec again: {e}");
            }
            true
        }
        Ok(_) => false,
        Err(e) => {
            warn!(tenant = %cdi::public_id(tenant), "reading its settings from the daemon (its record is kept as it is): {}", redact(prefix, &e.to_string()));
            false
        }
    }
}

/// Deletes the tenants made with `prefix` (see [`is_made_name`]) that
/// `known` does not name (made by a node component that died before it
/// recorded them, or that it failed to delete), and their CDI specs.
pub(crate) fn sweep_orphans(mediator: &Mediator, prefix: &str, known: &BTreeSet<String>, cdi_dir: &Path) {
    match mediator.tenants() {
        Ok(all) => {
            for t in all.into_iter().filter(|t| is_made_name(prefix, t) && !known.contains(t)) {
                info!(tenant = %t, "deleting a tenant of this node component that it has no record of");
                if let Err(e) = mediator.delete_tenant(&t) {
                    warn!(tenant = %t, "deleting it: {e}");
                }
                let _ = cdi::remove(cdi_dir, &t);
            }
        }
        Err(e) => warn!("listing the daemon's tenants: {e}"),
    }
}

/// A fresh tenant name: `PREFIX` `N` `-` a 32-bit random tag `-` 64
/// random bits. The name is the socket's, which must be open to whatever
/// user the container runs as: the socket is hidden (only the container's
/// bind mount reaches it), and the last part keeps the name, which names
/// the socket, out of what others read (the CDI spec, root's only, alone
/// holds it; the kernel shows every user bound sockets' paths, which is
/// why hiding, not the secret, is what keeps them out). The rest (`PREFIX N-TAG`) is
/// its public id (CDI names): the tag keeps public ids apart where
/// counters meet (two drivers on a node, a record lost).
pub(crate) fn tenant_name(prefix: &str, n: u64) -> Result<String, PluginError> {
    let r = |()| random_u64().map_err(|err| PluginError::Cdi { tenant: "(new)".into(), err });
    let (tag, secret) = (r(())?, r(())?);
    Ok(format!("{prefix}{n}-{:08x}-{secret:016x}", tag as u32))
}

/// The spec of a process tenant made for a container: open to any user
/// that can name its socket (the container's user is not known here).
pub(crate) fn container_tenant(name: &str, memory: u64, weight: u32, device: &str) -> TenantSpec {
    TenantSpec {
        name: name.into(),
        memory: vgpu_api::Size(memory),
        weight,
        cap: None,
        priority: Default::default(),
        device: Some(device.into()),
        pool: None,
        numa_node: None,
        kind: TenantKind::Process,
        owner: None,
        mode: Some("0666".into()),
        host_memory: None,
        max_connections: None,
        // Where no host user may reach it by its path: only the
        // container's bind mount of it.
        hidden: true,
    }
}

/// A tenant made for a container and handed over through CDI.
pub(crate) struct Handed {
    pub socket: PathBuf,
    /// What its device needs in a program's environment (recorded, so a
    /// spec written again says the same).
    pub env: BTreeMap<String, String>,
    pub edits: cdi::Edits,
}

/// Makes the tenant and writes its CDI spec (a tenant whose spec cannot be
/// written is deleted again).
pub(crate) fn create_handed_over(mediator: &Mediator, spec: &TenantSpec, host: &Host) -> Result<Handed, PluginError> {
    let (socket, env) = mediator.create_tenant(spec)?;
    match write_spec(host, &spec.name, &socket, &env) {
        Ok(edits) => Ok(Handed { socket, env, edits }),
        Err(err) => {
            let _ = mediator.delete_tenant(&spec.name);
            Err(PluginError::Cdi { tenant: spec.name.clone(), err })
        }
    }
}

/// One resource's DevicePlugin service.
struct SlicePlugin {
    node: Arc<Node>,
    resource: Resource,
}

async fn blocking<T: Send + 'static>(prefix: &str, f: impl FnOnce() -> Result<T, PluginError> + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Status::internal(redact(prefix, &e.to_string())))?.map_err(|e| e.to_status(prefix))
}

fn to_devices(slices: Vec<slices::Slice>) -> Vec<dp::Device> {
    slices
        .into_iter()
        .map(|s| dp::Device { id: s.id, health: if s.healthy { "Healthy" } else { "Unhealthy" }.into(), topology: s.numa_node.map(|n| dp::TopologyInfo { nodes: vec![dp::NumaNode { id: n }] }) })
        .collect()
}

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for SlicePlugin {
    async fn get_device_plugin_options(&self, _: Request<dp::Empty>) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(dp::DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }))
    }

    type ListAndWatchStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

    async fn list_and_watch(&self, _: Request<dp::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let (node, r) = (self.node.clone(), self.resource.clone());
        let mut changed = node.changed.subscribe();
        tokio::spawn(async move {
            let mut last: Option<Vec<dp::Device>> = None;
            loop {
                let (n, rr) = (node.clone(), r.clone());
                match blocking(&node.cfg.tenant_prefix, move || n.list(&rr)).await {
                    Ok(s) => {
                        let devices = to_devices(s);
                        if last.as_ref() != Some(&devices) {
                            if tx.send(Ok(dp::ListAndWatchResponse { devices: devices.clone() })).await.is_err() {
                                return;
                            }
                            last = Some(devices);
                        }
                    }
                    Err(e) => warn!(resource = %r.name, "listing slices: {}", e.message()),
                }
                tokio::select! {
                    _ = changed.changed() => {}
                    _ = tokio::time::sleep(node.cfg.poll) => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(&self, req: Request<dp::PreferredAllocationRequest>) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let container_responses = req
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| dp::ContainerPreferredAllocationResponse { device_i_ds: slices::preferred(&c.available_device_i_ds, &c.must_include_device_i_ds, c.allocation_size.max(0) as usize) })
            .collect();
        Ok(Response::new(dp::PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, req: Request<dp::AllocateRequest>) -> Result<Response<dp::AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let (n, r) = (self.node.clone(), self.resource.clone());
            container_responses.push(blocking(&self.node.cfg.tenant_prefix, move || n.allocate(&r, &c.devices_ids)).await?);
        }
        Ok(Response::new(dp::AllocateResponse { container_responses }))
    }

    async fn pre_start_container(&self, _: Request<dp::PreStartContainerRequest>) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

/// Registers `r`'s socket with the kubelet.
async fn register(cfg: &Config, r: &Resource) -> Result<(), String> {
    let ch = crate::uds::channel(&cfg.kubelet_socket()).await.map_err(|e| format!("connecting to {}: {e}", cfg.kubelet_socket().display()))?;
    let req = dp::RegisterRequest {
        version: API_VERSION.into(),
        endpoint: r.socket_name(),
        resource_name: r.name.clone(),
        options: Some(dp::DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }),
    };
    dp::registration_client::RegistrationClient::new(ch).register(req).await.map_err(|s| format!("the kubelet refused {}: {}", r.name, s.message()))?;
    Ok(())
}

/// Serves `r` for as long as the process runs: binds its socket, registers
/// it, and does both again whenever the socket goes (the kubelet removes
/// every plugin socket when it starts).
pub async fn serve_resource(node: Arc<Node>, r: Resource) {
    let sock = node.cfg.device_plugins().join(r.socket_name());
    loop {
        let _ = std::fs::remove_file(&sock);
        let listener = match tokio::net::UnixListener::bind(&sock) {
            Ok(l) => l,
            Err(e) => {
                warn!(resource = %r.name, "binding {}: {e}; trying again", sock.display());
                tokio::time::sleep(node.cfg.poll).await;
                continue;
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let svc = dp::device_plugin_server::DevicePluginServer::new(SlicePlugin { node: node.clone(), resource: r.clone() });
        let server = tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), async {
            let _ = stopped.await;
        }));
        let mut registered = false;
        loop {
            if !registered {
                match register(&node.cfg, &r).await {
                    Ok(()) => {
                        info!(resource = %r.name, socket = %sock.display(), "registered with the kubelet");
                        registered = true;
                    }
                    Err(e) => warn!(resource = %r.name, "registering: {e}; trying again"),
                }
            }
            tokio::time::sleep(node.cfg.poll).await;
            if !sock.exists() {
                info!(resource = %r.name, "the plugin's socket is gone (the kubelet restarted): serving and registering again");
                break;
            }
            if server.is_finished() {
                warn!(resource = %r.name, "the plugin's server ended: starting it again");
                break;
            }
        }
        // A graceful stop waits for open ListAndWatch streams, which a
        // kubelet that went away never ends: a second, then they are cut.
        let _ = stop.send(());
        let mut server = server;
        if tokio::time::timeout(Duration::from_secs(1), &mut server).await.is_err() {
            server.abort();
        }
    }
}

/// What the kubelet's pods hold: (resource, slice id) pairs, from its pod
/// resources API; None where it cannot be asked.
async fn pods_hold(cfg: &Config) -> Result<BTreeSet<(String, String)>, String> {
    let path = cfg.pod_resources_socket();
    let ch = crate::uds::channel(&path).await.map_err(|e| format!("connecting to {}: {e}", path.display()))?;
    let list = pr::pod_resources_lister_client::PodResourcesListerClient::new(ch).list(pr::ListPodResourcesRequest {}).await.map_err(|s| format!("listing pod resources: {}", s.message()))?;
    let mut held = BTreeSet::new();
    for pod in list.into_inner().pod_resources {
        for c in pod.containers {
            for d in c.devices {
                for id in d.device_ids {
                    held.insert((d.resource_name.clone(), id));
                }
            }
        }
    }
    Ok(held)
}

/// Deletes, every `reconcile` period, the allocations no pod holds. When
/// the kubelet cannot be asked, nothing is deleted.
pub async fn reconcile_loop(node: Arc<Node>) {
    loop {
        tokio::time::sleep(node.cfg.reconcile).await;
        match pods_hold(&node.cfg).await {
            Ok(held) => {
                let n = node.clone();
                let _ = tokio::task::spawn_blocking(move || n.reconcile(&held)).await;
            }
            Err(e) => warn!("not reconciling allocations with pods: {e}"),
        }
    }
}

/// Runs the plugin: every resource served and registered, allocations
/// reconciled with pods, until the process is stopped.
pub async fn run(cfg: Config) -> Result<(), PluginError> {
    for r in &cfg.resources {
        info!(resource = %r.name, pool = %r.pool, slice = %r.slice, "offering");
    }
    let resources = cfg.resources.clone();
    let node = Arc::new(tokio::task::spawn_blocking(move || Node::open(cfg)).await.map_err(|e| PluginError::Request(e.to_string()))??);
    let mut tasks = Vec::new();
    for r in resources {
        tasks.push(tokio::spawn(serve_resource(node.clone(), r)));
    }
    tasks.push(tokio::spawn(reconcile_loop(node)));
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

/// The libraries a container gets from `dir`: `libcuda.so.1`, and
/// `libnvidia-ml.so.1` where it is there.
pub fn driver_libs(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let cuda = dir.join("libcuda.so.1");
    if !cuda.exists() {
        return Err(format!("{} is missing: give --lib-dir, the directory of the vGPU's libcuda.so.1", cuda.display()));
    }
    Ok([cuda, dir.join("libnvidia-ml.so.1")].into_iter().filter(|p| p.exists()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_names_are_recognised_and_their_secrets_hidden_from_errors() {
        let made = tenant_name("dra-", 12).unwrap();
        assert!(is_made_name("dra-", &made), "{made}");
        assert!(is_made_name("dra-", "dra-12-00c0ffee-0123456789abcdef"));
        for other in [
            "dra-admin",
            "dra-12-00c0ffee-0123456789abcde",
            "dra-12-00c0ffee-0123456789ABCDEF",
            "dra--00c0ffee-0123456789abcdef",
            "k8s-1-00c0ffee-0123456789abcdef",
            "dra-1-00c0ffee-0123456789abcdef0",
            "dra-1-0123456789abcdef",
        ] {
            assert!(!is_made_name("dra-", other), "{other}");
        }
        let msg = "DELETE /v1/tenants/dra-3-00000001-00ff00ff00ff00ff: busy; CDI spec for dra-4-00000002-0123456789abcdef: denied; dra-admin stays; é dra-5-00000003-aaaaaaaaaaaaaaaa";
        let r = redact("dra-", msg);
        assert_eq!(r, "DELETE /v1/tenants/dra-3-00000001-(secret): busy; CDI spec for dra-4-00000002-(secret): denied; dra-admin stays; é dra-5-00000003-(secret)");
        // A prefix glued to what precedes it, or overlapping itself, is
        // still found.
        assert_eq!(redact("dev-", "vgpu.dev-tenant-dev-4-0000000a-0123456789abcdef.json"), "vgpu.dev-tenant-dev-4-0000000a-(secret).json");
        assert_eq!(redact("a-a-", "a-a-a-1-0000000a-0123456789abcdef"), "a-a-a-1-0000000a-(secret)");
        assert_eq!(redact("", msg), msg);
        assert_eq!(redact("dra-", "dra-"), "dra-");
    }
}
