//! The DRA driver: registered with the kubelet through its plugin
//! registration directory, it serves the kubelet's DRA plugin API (v1) and
//! keeps this node's ResourceSlices in the API server current with the
//! mediator's devices. Each device allocated to a ResourceClaim becomes a
//! tenant of the local `vgpu-mediatord` when the kubelet prepares the
//! claim, handed to the pod's containers as a CDI device; it is deleted
//! (its memory scrubbed) when the kubelet unprepares the claim, or when the
//! claim is found gone from the API server.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice, ResourceSliceSpec};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{info, warn};
use vgpu_api::tenant::TenantSpec;

use crate::cdi;
use crate::claims::{self, ClaimLimits, Planned, Publisher, Sharing};
use crate::mediator::Mediator;
use crate::plugin::{container_tenant, create_handed_over, now_s, sweep_orphans, tenant_name, Host, PluginError};
use crate::proto::dra as pb;
use crate::proto::pluginregistration as reg;
use crate::state::{ClaimState, ClaimTenant, PreparedClaim, StateError};

/// The service this driver offers the kubelet, as registration names it.
pub const DRA_SERVICE: &str = "v1.DRAPlugin";
/// The plugin type of a DRA driver in the kubelet's registration.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// Most claims one NodePrepareResources or NodeUnprepareResources call
/// may name (a node runs at most a few hundred pods).
pub const MAX_CLAIMS_PER_CALL: usize = 256;

/// How the DRA driver is set up (`vgpu-k8s dra-driver --help`).
#[derive(Debug, Clone)]
pub struct DraConfig {
    /// The driver's name (a DNS subdomain): the ResourceSlices' and
    /// DeviceClass's `driver`, and the domain of its attributes.
    pub driver: String,
    /// This node's name: the slices' node and pool.
    pub node: String,
    /// The kubelet's directory (`plugins_registry/`, `plugins/`).
    pub kubelet_dir: PathBuf,
    pub host: Host,
    pub tenant_prefix: String,
    pub sharing: Sharing,
    /// What a claim's own configuration may ask.
    pub limits: ClaimLimits,
    /// A kubeconfig; none: the pod's service account (or KUBECONFIG).
    pub kubeconfig: Option<PathBuf>,
    /// How often devices are looked at and the sockets checked.
    pub poll: Duration,
    /// How often prepared claims are looked up in the API server.
    pub reconcile: Duration,
}

impl DraConfig {
    /// The registration socket the kubelet's plugin watcher finds.
    pub fn registration_socket(&self) -> PathBuf {
        self.kubelet_dir.join("plugins_registry").join(format!("{}-reg.sock", self.driver))
    }
    /// The socket of the DRA service.
    pub fn plugin_socket(&self) -> PathBuf {
        self.kubelet_dir.join("plugins").join(&self.driver).join("dra.sock")
    }
    fn state_file(&self) -> PathBuf {
        self.host.state_dir.join("dra.json")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DraError {
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("reading the kubeconfig {path}: {err}")]
    Kubeconfig {
        path: String,
        #[source]
        err: kube::config::KubeconfigError,
    },
    #[error("finding the API server (in-cluster or KUBECONFIG): {0}")]
    Infer(#[source] kube::config::InferConfigError),
    #[error("the Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Claim(#[from] claims::ClaimError),
    #[error("claim {claim}: {why}")]
    Lookup { claim: String, why: String },
}

/// A client of the API server from a kubeconfig, or as a pod finds it.
pub async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client, DraError> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p).map_err(|err| DraError::Kubeconfig { path: p.display().to_string(), err })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await.map_err(|err| DraError::Kubeconfig { path: p.display().to_string(), err })?
        }
        None => kube::Config::infer().await.map_err(DraError::Infer)?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// The node's side of the driver: the mediator, the prepared claims, the
/// API server, and a signal that the claims changed (slices follow).
pub struct DraNode {
    pub cfg: DraConfig,
    mediator: Mediator,
    state: Mutex<ClaimState>,
    kube: kube::Client,
    changed: watch::Sender<u64>,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, DraError> + Send + 'static) -> Result<T, DraError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| DraError::Lookup { claim: "(task)".into(), why: e.to_string() })?
}

impl DraNode {
    /// Loads the prepared claims (a corrupt state file is refused) and
    /// deletes the tenants with the driver's prefix that no claim holds.
    pub fn open(cfg: DraConfig, kube: kube::Client) -> Result<DraNode, DraError> {
        std::fs::create_dir_all(&cfg.host.state_dir).map_err(|err| StateError::Write { path: cfg.host.state_dir.display().to_string(), err })?;
        let state = ClaimState::load(&cfg.state_file())?;
        let node = DraNode { mediator: Mediator::new(&cfg.host.run_dir), cfg, state: Mutex::new(state), kube, changed: watch::channel(0).0 };
        let known: BTreeSet<String> = node.lock().tenants().map(|t| t.tenant.clone()).collect();
        sweep_orphans(&node.mediator, &node.cfg.tenant_prefix, &known, &node.cfg.host.cdi_dir);
        Ok(node)
    }

    fn lock(&self) -> MutexGuard<'_, ClaimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The claims prepared here, by uid.
    pub fn prepared(&self) -> BTreeMap<String, PreparedClaim> {
        self.lock().claims.clone()
    }

    fn answer(&self, c: &PreparedClaim) -> pb::NodePrepareResourceResponse {
        let devices = c
            .tenants
            .iter()
            .map(|t| pb::Device {
                request_names: vec![t.request.clone()],
                pool_name: self.cfg.node.clone(),
                device_name: t.device_label.clone(),
                cdi_device_ids: vec![cdi::device_name(&t.tenant)],
                share_id: t.share_id.clone(),
            })
            .collect();
        pb::NodePrepareResourceResponse { devices, error: String::new() }
    }

    /// Prepares one claim: its record where it was prepared before (the
    /// kubelet asks again after restarts), else a tenant per device its
    /// allocation gives this driver, read from the API server.
    pub async fn prepare(self: &Arc<Self>, c: pb::Claim) -> pb::NodePrepareResourceResponse {
        let id = format!("{}/{}", c.namespace, c.name);
        if let Some(p) = self.lock().claims.get(&c.uid) {
            return self.answer(p);
        }
        let result = async {
            if c.uid.is_empty() || c.name.is_empty() || c.namespace.is_empty() {
                return Err(DraError::Lookup { claim: id.clone(), why: "a claim needs its namespace, name and uid".into() });
            }
            let api: Api<ResourceClaim> = Api::namespaced(self.kube.clone(), &c.namespace);
            let claim = api.get_opt(&c.name).await?.ok_or_else(|| DraError::Lookup { claim: id.clone(), why: "not found in the API server".into() })?;
            if claim.metadata.uid.as_deref() != Some(c.uid.as_str()) {
                return Err(DraError::Lookup { claim: id.clone(), why: format!("its uid is {}, not {} (deleted and made again)", claim.metadata.uid.as_deref().unwrap_or("(none)"), c.uid) });
            }
            let node = self.clone();
            blocking(move || node.make(&c, &claim)).await
        }
        .await;
        match result {
            Ok(p) => self.answer(&p),
            Err(e) => {
                warn!(claim = %id, "not prepared: {e}");
                pb::NodePrepareResourceResponse { devices: Vec::new(), error: e.to_string() }
            }
        }
    }

    /// Makes the tenants of one claim (all or none) and records them.
    fn make(&self, c: &pb::Claim, claim: &ResourceClaim) -> Result<PreparedClaim, DraError> {
        let devices = self.mediator.devices().map_err(PluginError::from)?;
        let planned = claims::plan(claim, &self.cfg.driver, &self.cfg.node, &devices, self.cfg.limits)?;
        let mut st = self.lock();
        if let Some(p) = st.claims.get(&c.uid) {
            return Ok(p.clone());
        }
        let mut made: Vec<ClaimTenant> = Vec::new();
        let undo = |made: &[ClaimTenant]| {
            for t in made {
                let _ = self.mediator.delete_tenant(&t.tenant);
                let _ = cdi::remove(&self.cfg.host.cdi_dir, &t.tenant);
            }
        };
        for p in &planned {
            let name = match tenant_name(&self.cfg.tenant_prefix, st.next) {
                Ok(n) => n,
                Err(e) => {
                    undo(&made);
                    return Err(e.into());
                }
            };
            st.next += 1;
            // The name is recorded as used before the tenant exists: a
            // driver that dies now leaves an orphan the next start sweeps.
            if let Err(e) = st.save(&self.cfg.state_file()) {
                undo(&made);
                return Err(e.into());
            }
            match create_handed_over(&self.mediator, &spec_of(&name, p), &self.cfg.host) {
                Ok((socket, _)) => made.push(ClaimTenant {
                    tenant: name,
                    request: p.request.clone(),
                    device: p.device.clone(),
                    device_label: p.device_label.clone(),
                    memory: p.memory,
                    socket,
                    share_id: p.share_id.clone(),
                }),
                Err(e) => {
                    undo(&made);
                    return Err(e.into());
                }
            }
        }
        let prepared = PreparedClaim { namespace: c.namespace.clone(), name: c.name.clone(), tenants: made, created: now_s() };
        st.claims.insert(c.uid.clone(), prepared.clone());
        if let Err(e) = st.save(&self.cfg.state_file()) {
            st.claims.remove(&c.uid);
            undo(&prepared.tenants);
            return Err(e.into());
        }
        drop(st);
        self.changed.send_modify(|n| *n += 1);
        info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, tenants = prepared.tenants.len(), "prepared");
        Ok(prepared)
    }

    /// Unprepares one claim: its tenants deleted (memory scrubbed), their
    /// specs removed, the record dropped. One never prepared (or already
    /// unprepared) is done. A tenant that cannot be deleted stays recorded,
    /// for the kubelet's next try.
    pub fn unprepare(&self, uid: &str) -> Result<(), DraError> {
        let mut st = self.lock();
        let Some(mut p) = st.claims.remove(uid) else { return Ok(()) };
        let mut failed = None;
        p.tenants.retain(|t| {
            match self
                .mediator
                .delete_tenant(&t.tenant)
                .map_err(PluginError::from)
                .and_then(|()| cdi::remove(&self.cfg.host.cdi_dir, &t.tenant).map_err(|err| PluginError::Cdi { tenant: t.tenant.clone(), err }))
            {
                Ok(()) => false,
                Err(e) => {
                    failed = Some(e);
                    true
                }
            }
        });
        let id = format!("{}/{}", p.namespace, p.name);
        if !p.tenants.is_empty() {
            st.claims.insert(uid.to_string(), p);
        }
        st.save(&self.cfg.state_file())?;
        drop(st);
        self.changed.send_modify(|n| *n += 1);
        match failed {
            Some(e) => Err(e.into()),
            None => {
                info!(claim = %id, uid, "unprepared: its tenants are deleted");
                Ok(())
            }
        }
    }

    /// Unprepares the prepared claims the API server no longer has (gone,
    /// or made again under a new uid): the kubelet could not tell a driver
    /// that was down. When the API server cannot be asked, nothing changes.
    pub async fn reconcile(self: &Arc<Self>) {
        for (uid, p) in self.prepared() {
            let api: Api<ResourceClaim> = Api::namespaced(self.kube.clone(), &p.namespace);
            match api.get_opt(&p.name).await {
                Ok(Some(c)) if c.metadata.uid.as_deref() == Some(uid.as_str()) => {}
                Ok(_) => {
                    info!(claim = %format!("{}/{}", p.namespace, p.name), uid = %uid, "the claim is gone from the API server: unpreparing it");
                    let (node, u) = (self.clone(), uid.clone());
                    if let Err(e) = blocking(move || node.unprepare(&u)).await {
                        warn!(uid = %uid, "unpreparing it: {e}");
                    }
                }
                Err(e) => warn!(claim = %format!("{}/{}", p.namespace, p.name), "looking it up: {e}"),
            }
        }
    }
}

/// The tenant spec of one planned device.
fn spec_of(name: &str, p: &Planned) -> TenantSpec {
    TenantSpec { cap: p.cap, priority: p.priority, ..container_tenant(name, p.memory, p.weight, &p.device) }
}

/// The DRA plugin service the kubelet calls.
struct Plugin(Arc<DraNode>);

#[tonic::async_trait]
impl pb::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(&self, req: Request<pb::NodePrepareResourcesRequest>) -> Result<Response<pb::NodePrepareResourcesResponse>, Status> {
        let req = req.into_inner();
        if req.claims.len() > MAX_CLAIMS_PER_CALL {
            return Err(Status::invalid_argument(format!("{} claims in one call; at most {MAX_CLAIMS_PER_CALL}", req.claims.len())));
        }
        let mut claims = std::collections::HashMap::new();
        for c in req.claims {
            let uid = c.uid.clone();
            let r = self.0.prepare(c).await;
            claims.insert(uid, r);
        }
        Ok(Response::new(pb::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(&self, req: Request<pb::NodeUnprepareResourcesRequest>) -> Result<Response<pb::NodeUnprepareResourcesResponse>, Status> {
        let req = req.into_inner();
        if req.claims.len() > MAX_CLAIMS_PER_CALL {
            return Err(Status::invalid_argument(format!("{} claims in one call; at most {MAX_CLAIMS_PER_CALL}", req.claims.len())));
        }
        let mut claims = std::collections::HashMap::new();
        for c in req.claims {
            let (node, uid) = (self.0.clone(), c.uid.clone());
            let error = match blocking(move || node.unprepare(&uid)).await {
                Ok(()) => String::new(),
                Err(e) => {
                    warn!(claim = %format!("{}/{}", c.namespace, c.name), "not unprepared: {e}");
                    e.to_string()
                }
            };
            claims.insert(c.uid, pb::NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(pb::NodeUnprepareResourcesResponse { claims }))
    }
}

/// The registration service the kubelet's plugin watcher calls.
struct Registration(DraConfig);

#[tonic::async_trait]
impl reg::registration_server::Registration for Registration {
    async fn get_info(&self, _: Request<reg::InfoRequest>) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: self.0.driver.clone(),
            endpoint: self.0.plugin_socket().display().to_string(),
            supported_versions: vec![DRA_SERVICE.into()],
        }))
    }

    async fn notify_registration_status(&self, req: Request<reg::RegistrationStatus>) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        if s.plugin_registered {
            info!(driver = %self.0.driver, "registered with the kubelet");
        } else {
            warn!(driver = %self.0.driver, "the kubelet refused the registration: {}", s.error);
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    tokio::net::UnixListener::bind(path)
}

/// Serves the DRA service and the registration for as long as the process
/// runs, binding both sockets again whenever one goes.
pub async fn serve(node: Arc<DraNode>) {
    let (plugin_sock, reg_sock) = (node.cfg.plugin_socket(), node.cfg.registration_socket());
    loop {
        // The service first: the kubelet connects to it as soon as it has
        // the registration's answer.
        let listeners = bind(&plugin_sock).and_then(|p| Ok((p, bind(&reg_sock)?)));
        let (pl, rl) = match listeners {
            Ok(l) => l,
            Err(e) => {
                warn!("binding {} and {}: {e}; trying again", plugin_sock.display(), reg_sock.display());
                tokio::time::sleep(node.cfg.poll).await;
                continue;
            }
        };
        let (stop, stopped) = watch::channel(false);
        let mut s1 = stopped.clone();
        let mut s2 = stopped;
        let plugin = tokio::spawn(tonic::transport::Server::builder().add_service(pb::dra_plugin_server::DraPluginServer::new(Plugin(node.clone()))).serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(pl),
            async move {
                let _ = s1.changed().await;
            },
        ));
        let registration =
            tokio::spawn(tonic::transport::Server::builder().add_service(reg::registration_server::RegistrationServer::new(Registration(node.cfg.clone()))).serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(rl),
                async move {
                    let _ = s2.changed().await;
                },
            ));
        info!(driver = %node.cfg.driver, registration = %reg_sock.display(), service = %plugin_sock.display(), "serving the kubelet");
        loop {
            tokio::time::sleep(node.cfg.poll).await;
            if !plugin_sock.exists() || !reg_sock.exists() {
                info!("a socket of the driver is gone: serving again");
                break;
            }
            if plugin.is_finished() || registration.is_finished() {
                warn!("a server of the driver ended: starting it again");
                break;
            }
        }
        let _ = stop.send(true);
        for mut t in [plugin, registration] {
            if tokio::time::timeout(Duration::from_secs(1), &mut t).await.is_err() {
                t.abort();
            }
        }
    }
}

/// Keeps the node's ResourceSlices what the mediator's devices and the
/// prepared claims make them: at each poll, and at once when claims change.
/// A slice of this driver and node that is not the driver's current set is
/// deleted.
pub async fn publish_loop(node: Arc<DraNode>) {
    let slices: Api<ResourceSlice> = Api::all(node.kube.clone());
    let nodes: Api<Node> = Api::all(node.kube.clone());
    let mut changed = node.changed.subscribe();
    let mut publisher = Publisher { driver: node.cfg.driver.clone(), node: node.cfg.node.clone(), node_uid: None, sharing: node.cfg.sharing };
    let mut last: Option<BTreeMap<String, ResourceSliceSpec>> = None;
    loop {
        if publisher.node_uid.is_none() {
            match nodes.get(&node.cfg.node).await {
                Ok(n) => publisher.node_uid = n.metadata.uid,
                Err(e) => warn!(node = %node.cfg.node, "looking up the Node (its slices will have no owner): {e}"),
            }
        }
        let n = node.clone();
        match tokio::task::spawn_blocking(move || n.mediator.devices()).await {
            Ok(Ok(devices)) => {
                let ours = node.lock().reserved_by_device();
                // Published again when what the devices make changed, or when
                // the API server's slices are not the ones published (the
                // kubelet deletes a driver's slices once it is gone a
                // while). Their contents are not compared: an API server
                // drops the fields of features it does not enable.
                let want: BTreeMap<String, ResourceSliceSpec> = publisher.slices(&devices, &ours, 0).into_iter().map(|s| (s.metadata.name.unwrap_or_default(), s.spec)).collect();
                match current(&slices, &publisher).await {
                    Ok(have) if last.as_ref() == Some(&want) && have.keys().eq(want.keys()) => {}
                    Ok(_) => {
                        let generation = {
                            let mut st = node.lock();
                            st.generation += 1;
                            if let Err(e) = st.save(&node.cfg.state_file()) {
                                warn!("recording the slices' generation: {e}");
                            }
                            st.generation
                        };
                        match apply(&slices, &publisher, publisher.slices(&devices, &ours, generation)).await {
                            Ok(()) => {
                                info!(devices = devices.len(), generation, "published the node's ResourceSlices");
                                last = Some(want);
                            }
                            Err(e) => warn!("publishing ResourceSlices: {e}; trying again"),
                        }
                    }
                    Err(e) => warn!("listing the node's ResourceSlices: {e}; trying again"),
                }
            }
            Ok(Err(e)) => warn!("listing the daemon's devices: {e}"),
            Err(e) => warn!("listing the daemon's devices: {e}"),
        }
        tokio::select! {
            _ = changed.changed() => {}
            _ = tokio::time::sleep(node.cfg.poll) => {}
        }
    }
}

/// This node's slices of the driver in the API server, by name.
async fn current(api: &Api<ResourceSlice>, p: &Publisher) -> Result<BTreeMap<String, ResourceSliceSpec>, kube::Error> {
    let list = api.list(&ListParams::default().fields(&format!("spec.nodeName={},spec.driver={}", p.node, p.driver))).await?;
    Ok(list.items.into_iter().map(|s| (s.metadata.name.unwrap_or_default(), s.spec)).collect())
}

/// Creates or replaces each slice, then deletes this node's other slices
/// of the driver.
async fn apply(api: &Api<ResourceSlice>, p: &Publisher, want: Vec<ResourceSlice>) -> Result<(), kube::Error> {
    let names: BTreeSet<String> = want.iter().filter_map(|s| s.metadata.name.clone()).collect();
    for mut s in want {
        let name = s.metadata.name.clone().unwrap_or_default();
        match api.get_opt(&name).await? {
            Some(old) => {
                s.metadata.resource_version = old.metadata.resource_version;
                api.replace(&name, &PostParams::default(), &s).await?;
            }
            None => {
                api.create(&PostParams::default(), &s).await?;
            }
        }
    }
    let mine = api.list(&ListParams::default().fields(&format!("spec.nodeName={},spec.driver={}", p.node, p.driver))).await?;
    for s in mine.items {
        if let Some(name) = s.metadata.name.filter(|n| !names.contains(n)) {
            info!(slice = %name, "deleting a ResourceSlice of this node that is not current");
            api.delete(&name, &DeleteParams::default()).await?;
        }
    }
    Ok(())
}

/// Unprepares, every `reconcile` period, the claims gone from the API server.
pub async fn reconcile_loop(node: Arc<DraNode>) {
    loop {
        tokio::time::sleep(node.cfg.reconcile).await;
        node.reconcile().await;
    }
}

/// Runs the driver until the process is stopped.
pub async fn run(cfg: DraConfig) -> Result<(), DraError> {
    let kube = kube_client(cfg.kubeconfig.as_deref()).await?;
    info!(driver = %cfg.driver, node = %cfg.node, sharing = ?cfg.sharing, "DRA driver starting");
    let node = Arc::new(blocking(move || DraNode::open(cfg, kube)).await?);
    let tasks = [tokio::spawn(serve(node.clone())), tokio::spawn(publish_loop(node.clone())), tokio::spawn(reconcile_loop(node))];
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}
