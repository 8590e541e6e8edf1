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
use std::sync::Arc;
use std::time::{Duration, Instant};

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
use crate::plugin::{container_tenant, create_handed_over, ensure_spec, now_s, redact, refresh_env, tenant_name, Handed, Host, PluginError};
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
    /// The record of prepared claims: one per driver name, so that two
    /// drivers on a node keep apart.
    fn state_file(&self) -> PathBuf {
        self.host.state_dir.join(format!("dra-{}.json", self.driver))
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

/// How long one call to the API server may take.
pub const API_TIMEOUT: Duration = Duration::from_secs(30);

/// A client of the API server from a kubeconfig, or as a pod finds it.
pub async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client, DraError> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p).map_err(|err| DraError::Kubeconfig { path: p.display().to_string(), err })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await.map_err(|err| DraError::Kubeconfig { path: p.display().to_string(), err })?
        }
        None => kube::Config::infer().await.map_err(DraError::Infer)?,
    };
    // Every call ends: a connection the API server left half-open must not
    // stop publishing or reconciling for good.
    let mut config = config;
    config.connect_timeout = Some(API_TIMEOUT);
    config.read_timeout = Some(API_TIMEOUT);
    config.write_timeout = Some(API_TIMEOUT);
    Ok(kube::Client::try_from(config)?)
}

/// The node's side of the driver: the mediator, the prepared claims, the
/// API server, and a signal that the claims changed (slices follow).
///
/// The state's lock is tokio's: async tasks wait for it without holding a
/// runtime thread, and the blocking work (the mediator's calls, the state
/// file) takes it with `blocking_lock` on tokio's blocking pool. Claims
/// are prepared one at a time: a prepare holds it while it makes its
/// tenants, so that a claim is never made twice or half-seen.
pub struct DraNode {
    pub cfg: DraConfig,
    mediator: Mediator,
    state: tokio::sync::Mutex<ClaimState>,
    kube: kube::Client,
    changed: watch::Sender<u64>,
    /// Claims unprepared lately, and when: a prepare that began before is
    /// abandoned (the kubelet gave up on it and unprepared the claim).
    unprepared: std::sync::Mutex<BTreeMap<String, Instant>>,
    /// Consecutive lookups that found a prepared claim gone, by uid.
    missing: std::sync::Mutex<BTreeMap<String, u32>>,
}

/// How long an unprepare is remembered against prepares that began before.
const TOMBSTONE: Duration = Duration::from_secs(600);
/// Most unprepares remembered.
const MAX_TOMBSTONES: usize = 4096;
/// Lookups in a row that must find a claim gone before it is unprepared.
const MISSES: u32 = 2;

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, DraError> + Send + 'static) -> Result<T, DraError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| DraError::Lookup { claim: "(task)".into(), why: e.to_string() })?
}

/// A claim, or None where the API server says that claim does not exist.
/// A 404 that is not about this claim (the resource type is not served:
/// an API server without resource.k8s.io/v1, a proxy) is an error: it must
/// not read as "the claim is gone", which would delete running pods'
/// tenants.
async fn lookup(api: &Api<ResourceClaim>, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
    match api.get(name).await {
        Ok(c) => Ok(Some(c)),
        Err(kube::Error::Api(s)) if s.code == 404 && s.details.as_ref().is_some_and(|d| d.kind == "resourceclaims" && d.name == name) => Ok(None),
        Err(e) => Err(e),
    }
}

/// What a claim's allocation gives this driver on this node: (request,
/// device, share id) of each result, sorted, to compare with a record.
fn allocated_here(claim: &ResourceClaim, driver: &str, node: &str) -> Vec<(String, String, Option<String>)> {
    let results = claim.status.as_ref().and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref()).and_then(|d| d.results.as_ref());
    let mut v: Vec<_> = results.into_iter().flatten().filter(|r| r.driver == driver && r.pool == node).map(|r| (r.request.clone(), r.device.clone(), r.share_id.clone())).collect();
    v.sort();
    v
}

fn recorded(p: &PreparedClaim) -> Vec<(String, String, Option<String>)> {
    let mut v: Vec<_> = p.tenants.iter().map(|t| (t.request.clone(), t.device_label.clone(), t.share_id.clone())).collect();
    v.sort();
    v
}

impl DraNode {
    /// Loads the prepared claims (a corrupt state file is refused), drops
    /// from them the tenants the daemon no longer has, writes the CDI specs
    /// of the others again where they are gone (after a reboot), and
    /// deletes the tenants it issued that no claim holds.
    pub fn open(cfg: DraConfig, kube: kube::Client) -> Result<DraNode, DraError> {
        std::fs::create_dir_all(&cfg.host.state_dir).map_err(|err| StateError::Write { path: cfg.host.state_dir.display().to_string(), err })?;
        let mut state = ClaimState::load(&cfg.state_file())?;
        let mediator = Mediator::new(&cfg.host.run_dir);
        match mediator.tenants() {
            Ok(live) => {
                let mut lost = Vec::new();
                for (uid, p) in state.claims.iter_mut() {
                    p.tenants.retain(|t| {
                        let there = live.contains(&t.tenant);
                        if !there {
                            warn!(claim = %format!("{}/{}", p.namespace, p.name), uid = %uid, tenant = %cdi::public_id(&t.tenant), "the daemon no longer has this claim's tenant: its pods lost their vGPU, and the claim's next prepare makes it again");
                            lost.push(t.tenant.clone());
                        }
                        there
                    });
                }
                for t in lost {
                    state.issued.remove(&t);
                }
                state.claims.retain(|_, p| !p.tenants.is_empty());
                state.save(&cfg.state_file())?;
            }
            Err(e) => warn!("listing the daemon's tenants (the record is kept as it is): {e}"),
        }
        let mut refreshed = false;
        for t in state.claims.values_mut().flat_map(|p| p.tenants.iter_mut()) {
            refreshed |= refresh_env(&mediator, &cfg.host, &cfg.tenant_prefix, &t.tenant, &t.socket, &mut t.env);
        }
        if refreshed {
            state.save(&cfg.state_file())?;
        }
        for t in state.tenants() {
            if let Err(e) = ensure_spec(&cfg.host, &t.tenant, &t.socket, &t.env) {
                warn!(tenant = %t.tenant, "writing its CDI spec again: {e}");
            }
        }
        let node = DraNode { mediator, cfg, state: tokio::sync::Mutex::new(state), kube, changed: watch::channel(0).0, unprepared: Default::default(), missing: Default::default() };
        node.sweep();
        Ok(node)
    }

    /// Deletes the tenants the driver issued that no prepared claim holds
    /// (blocking): made by a driver that died in the middle of a prepare,
    /// or left by an undo that failed.
    fn sweep(&self) {
        let mut st = self.state.blocking_lock();
        let held: BTreeSet<String> = st.tenants().map(|t| t.tenant.clone()).collect();
        let orphans: Vec<String> = st.issued.iter().filter(|t| !held.contains(*t)).cloned().collect();
        if orphans.is_empty() {
            return;
        }
        for t in orphans {
            match self.mediator.delete_tenant(&t) {
                Ok(()) => {
                    info!(tenant = %t, "deleted a tenant of this driver that no claim holds");
                    let _ = cdi::remove(&self.cfg.host.cdi_dir, &t);
                    st.issued.remove(&t);
                }
                Err(e) => warn!(tenant = %t, "deleting a tenant of this driver that no claim holds: {e}"),
            }
        }
        if let Err(e) = st.save(&self.cfg.state_file()) {
            warn!("recording the sweep: {e}");
        }
    }

    /// Deletes tenants made for a claim that is not recorded (blocking);
    /// one that cannot be deleted stays issued, for the next sweep.
    fn undo(&self, st: &mut ClaimState, made: &[ClaimTenant]) {
        for t in made {
            if self.mediator.delete_tenant(&t.tenant).is_ok() {
                let _ = cdi::remove(&self.cfg.host.cdi_dir, &t.tenant);
                st.issued.remove(&t.tenant);
            }
        }
        let _ = st.save(&self.cfg.state_file());
    }

    /// The claims prepared here, by uid.
    pub async fn prepared(&self) -> BTreeMap<String, PreparedClaim> {
        self.state.lock().await.claims.clone()
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

    /// Prepares one claim, read from the API server: the recorded tenants
    /// where the claim's allocation is what they were made for (the
    /// kubelet asks again after restarts), else a tenant per device the
    /// allocation gives this driver here (a stale record's tenants deleted
    /// first). Where the API server cannot be reached, a recorded claim is
    /// answered from the record.
    pub async fn prepare(self: &Arc<Self>, c: pb::Claim) -> pb::NodePrepareResourceResponse {
        let id = format!("{}/{}", c.namespace, c.name);
        let started = Instant::now();
        let result = async {
            if c.uid.is_empty() || c.name.is_empty() || c.namespace.is_empty() {
                return Err(DraError::Lookup { claim: id.clone(), why: "a claim needs its namespace, name and uid".into() });
            }
            let api: Api<ResourceClaim> = Api::namespaced(self.kube.clone(), &c.namespace);
            let claim = match lookup(&api, &c.name).await {
                Ok(Some(claim)) => claim,
                Ok(None) => return Err(DraError::Lookup { claim: id.clone(), why: "not found in the API server".into() }),
                Err(e) => {
                    let rec = self.state.lock().await.claims.get(&c.uid).cloned();
                    // Not a record an unprepare left behind (one whose
                    // tenants could not all be deleted).
                    let unprepared_at =
                        self.unprepared.lock().unwrap_or_else(|e| e.into_inner()).get(&c.uid).filter(|t| t.elapsed() < TOMBSTONE).map(|t| now_s().saturating_sub(t.elapsed().as_secs()));
                    let rec = rec.filter(|p| unprepared_at.is_none_or(|at| at < p.created));
                    return match rec {
                        Some(p) => {
                            warn!(claim = %id, "the API server cannot be asked ({e}): answering from the record");
                            let node = self.clone();
                            blocking(move || node.specs(&p).map(|()| p)).await
                        }
                        None => Err(e.into()),
                    };
                }
            };
            if claim.metadata.uid.as_deref() != Some(c.uid.as_str()) {
                return Err(DraError::Lookup { claim: id.clone(), why: format!("its uid is {}, not {} (deleted and made again)", claim.metadata.uid.as_deref().unwrap_or("(none)"), c.uid) });
            }
            let node = self.clone();
            blocking(move || node.make(&c, &claim, started)).await
        }
        .await;
        match result {
            Ok(p) => self.answer(&p),
            Err(e) => {
                let why = redact(&self.cfg.tenant_prefix, &e.to_string());
                warn!(claim = %id, "not prepared: {why}");
                pb::NodePrepareResourceResponse { devices: Vec::new(), error: why }
            }
        }
    }

    /// The record's CDI specs, written again where they are gone.
    fn specs(&self, p: &PreparedClaim) -> Result<(), DraError> {
        for t in &p.tenants {
            ensure_spec(&self.cfg.host, &t.tenant, &t.socket, &t.env).map_err(|err| PluginError::Cdi { tenant: t.tenant.clone(), err })?;
        }
        Ok(())
    }

    /// Makes the tenants of one claim (all or none) and records them; a
    /// record that matches the allocation is the answer.
    fn make(&self, c: &pb::Claim, claim: &ResourceClaim, started: Instant) -> Result<PreparedClaim, DraError> {
        let mut st = self.state.blocking_lock();
        let id = format!("{}/{}", c.namespace, c.name);
        if self.unprepared.lock().unwrap_or_else(|e| e.into_inner()).get(&c.uid).is_some_and(|t| *t > started) {
            return Err(DraError::Lookup { claim: id, why: "it was unprepared while it was being prepared; ask again".into() });
        }
        if let Some(p) = st.claims.get(&c.uid).cloned() {
            let live = self.mediator.tenants().map_err(PluginError::from)?;
            if recorded(&p) == allocated_here(claim, &self.cfg.driver, &self.cfg.node) && p.tenants.iter().all(|t| live.contains(&t.tenant)) {
                self.specs(&p)?;
                return Ok(p);
            }
            info!(claim = %id, uid = %c.uid, "its allocation is not what its tenants were made for, or the daemon lost one: making them again");
            self.unprepare_locked(&mut st, &c.uid)?;
        }
        let devices = self.mediator.devices().map_err(PluginError::from)?;
        let planned = claims::plan(claim, &self.cfg.driver, &self.cfg.node, &devices, self.cfg.limits)?;
        let mut made: Vec<ClaimTenant> = Vec::new();
        for p in &planned {
            let name = match tenant_name(&self.cfg.tenant_prefix, st.next) {
                Ok(n) => n,
                Err(e) => {
                    self.undo(&mut st, &made);
                    return Err(e.into());
                }
            };
            st.next += 1;
            // The name is recorded as issued before the tenant exists: a
            // driver that dies now leaves an orphan the next sweep deletes.
            st.issued.insert(name.clone());
            if let Err(e) = st.save(&self.cfg.state_file()) {
                st.issued.remove(&name);
                self.undo(&mut st, &made);
                return Err(e.into());
            }
            match create_handed_over(&self.mediator, &spec_of(&name, p), &self.cfg.host) {
                Ok(Handed { socket, env, .. }) => made.push(ClaimTenant {
                    tenant: name,
                    request: p.request.clone(),
                    device: p.device.clone(),
                    device_label: p.device_label.clone(),
                    memory: p.memory,
                    socket,
                    share_id: p.share_id.clone(),
                    env,
                }),
                Err(e) => {
                    self.undo(&mut st, &made);
                    return Err(e.into());
                }
            }
        }
        let prepared = PreparedClaim { namespace: c.namespace.clone(), name: c.name.clone(), tenants: made, created: now_s() };
        st.claims.insert(c.uid.clone(), prepared.clone());
        if let Err(e) = st.save(&self.cfg.state_file()) {
            st.claims.remove(&c.uid);
            self.undo(&mut st, &prepared.tenants);
            return Err(e.into());
        }
        drop(st);
        self.changed.send_modify(|n| *n += 1);
        info!(claim = %id, uid = %c.uid, tenants = prepared.tenants.len(), "prepared");
        Ok(prepared)
    }

    /// Unprepares one claim (blocking): its tenants deleted (memory
    /// scrubbed), their specs removed, the record dropped. One never
    /// prepared (or already unprepared) is done; a prepare of it that is
    /// under way is abandoned. A tenant that cannot be deleted stays
    /// recorded, for the kubelet's next try.
    pub fn unprepare(&self, uid: &str) -> Result<(), DraError> {
        {
            let mut u = self.unprepared.lock().unwrap_or_else(|e| e.into_inner());
            u.retain(|_, t| t.elapsed() < TOMBSTONE);
            while u.len() >= MAX_TOMBSTONES {
                let Some(oldest) = u.iter().min_by_key(|(_, t)| **t).map(|(k, _)| k.clone()) else { break };
                u.remove(&oldest);
            }
            u.insert(uid.to_string(), Instant::now());
        }
        let mut st = self.state.blocking_lock();
        self.unprepare_locked(&mut st, uid)?;
        drop(st);
        self.changed.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Unprepares a claim if its record is still `seen` (blocking).
    fn unprepare_if(&self, uid: &str, seen: &PreparedClaim) -> Result<(), DraError> {
        let mut st = self.state.blocking_lock();
        if st.claims.get(uid) != Some(seen) {
            return Ok(());
        }
        self.unprepare_locked(&mut st, uid)?;
        drop(st);
        self.changed.send_modify(|n| *n += 1);
        Ok(())
    }

    fn unprepare_locked(&self, st: &mut ClaimState, uid: &str) -> Result<(), DraError> {
        let Some(mut p) = st.claims.remove(uid) else { return Ok(()) };
        let mut failed = None;
        let mut deleted = Vec::new();
        p.tenants.retain(|t| {
            match self
                .mediator
                .delete_tenant(&t.tenant)
                .map_err(PluginError::from)
                .and_then(|()| cdi::remove(&self.cfg.host.cdi_dir, &t.tenant).map_err(|err| PluginError::Cdi { tenant: t.tenant.clone(), err }))
            {
                Ok(()) => {
                    deleted.push(t.tenant.clone());
                    false
                }
                Err(e) => {
                    failed = Some(e);
                    true
                }
            }
        });
        for t in deleted {
            st.issued.remove(&t);
        }
        let id = format!("{}/{}", p.namespace, p.name);
        if !p.tenants.is_empty() {
            st.claims.insert(uid.to_string(), p);
        }
        st.save(&self.cfg.state_file())?;
        match failed {
            Some(e) => Err(e.into()),
            None => {
                info!(claim = %id, uid, "unprepared: its tenants are deleted");
                Ok(())
            }
        }
    }

    /// Unprepares the prepared claims the API server no longer has (gone,
    /// made again under a new uid, or no longer allocated here), once two
    /// lookups in a row say so: the kubelet could not tell a driver that
    /// was down. When the API server cannot be asked, nothing changes.
    /// Then sweeps the tenants no claim holds.
    pub async fn reconcile(self: &Arc<Self>) {
        let prepared = self.prepared().await;
        self.missing.lock().unwrap_or_else(|e| e.into_inner()).retain(|uid, _| prepared.contains_key(uid));
        for (uid, p) in prepared {
            let id = format!("{}/{}", p.namespace, p.name);
            let api: Api<ResourceClaim> = Api::namespaced(self.kube.clone(), &p.namespace);
            let gone = match lookup(&api, &p.name).await {
                Ok(Some(c)) => c.metadata.uid.as_deref() != Some(uid.as_str()) || allocated_here(&c, &self.cfg.driver, &self.cfg.node).is_empty(),
                Ok(None) => true,
                Err(e) => {
                    warn!(claim = %id, "looking it up: {e}");
                    continue;
                }
            };
            let misses = {
                let mut m = self.missing.lock().unwrap_or_else(|e| e.into_inner());
                if gone {
                    let n = m.entry(uid.clone()).or_insert(0);
                    *n += 1;
                    *n
                } else {
                    m.remove(&uid);
                    0
                }
            };
            if misses >= MISSES {
                info!(claim = %id, uid = %uid, "the claim is gone from the API server, or no longer allocated here: unpreparing it");
                // Only the record that was looked up: a claim prepared again
                // meanwhile (allocated here anew) keeps its fresh tenants.
                let (node, u) = (self.clone(), uid.clone());
                match blocking(move || node.unprepare_if(&u, &p)).await {
                    Ok(()) => {
                        self.missing.lock().unwrap_or_else(|e| e.into_inner()).remove(&uid);
                    }
                    Err(e) => warn!(uid = %uid, "unpreparing it: {e}"),
                }
            }
        }
        let node = self.clone();
        let _ = tokio::task::spawn_blocking(move || node.sweep()).await;
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
                    let why = redact(&self.0.cfg.tenant_prefix, &e.to_string());
                    warn!(claim = %format!("{}/{}", c.namespace, c.name), "not unprepared: {why}");
                    why
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
    let mut last: Option<Published> = None;
    let mut warned = false;
    for round in 0u64.. {
        // The Node's uid, looked up again now and then: a Node made again
        // under the same name owns the slices from then on.
        if publisher.node_uid.is_none() || round % NODE_LOOKUP_EVERY == 0 {
            match nodes.get(&node.cfg.node).await {
                Ok(n) => publisher.node_uid = n.metadata.uid,
                Err(e) => warn!(node = %node.cfg.node, "looking up the Node (its slices keep the owner they had): {e}"),
            }
        }
        // The devices and the claims' quotas are read together, so that a
        // prepare between the two cannot show twice or not at all.
        let n = node.clone();
        let read = tokio::task::spawn_blocking(move || {
            let st = n.state.blocking_lock();
            n.mediator.devices().map(|d| (d, st.reserved_by_device(), st.generation))
        })
        .await;
        match read {
            Ok(Ok((devices, ours, generation))) => {
                // Published again when what the devices make changed, or when
                // the API server's slices are not the ones published (the
                // kubelet deletes a driver's slices once it is gone a
                // while). Their contents are not compared: an API server
                // drops the fields of features it does not enable.
                let want: Published = publisher.slices(&devices, &ours, 0).into_iter().map(|s| (s.spec, s.metadata.owner_references)).collect();
                match current(&slices, &publisher).await {
                    Ok(have) if last.as_ref() == Some(&want) && have.len() == want.len() && have.iter().all(|s| s.spec.pool.name == publisher.node) => {}
                    Ok(have) => {
                        // The generation is recorded once the slices are in:
                        // a refusal does not count up.
                        let generation = generation + 1;
                        match apply(&slices, &publisher, publisher.slices(&devices, &ours, generation), have).await {
                            Ok(dropped) => {
                                info!(devices = devices.len(), generation, "published the node's ResourceSlices");
                                let n = node.clone();
                                let saved = tokio::task::spawn_blocking(move || {
                                    let mut st = n.state.blocking_lock();
                                    st.generation = st.generation.max(generation);
                                    st.save(&n.cfg.state_file())
                                })
                                .await;
                                if let Ok(Err(e)) = saved {
                                    warn!("recording the slices' generation: {e}");
                                }
                                last = Some(want);
                                if dropped && !warned {
                                    warn!("the API server dropped the devices' sharing (allowMultipleAllocations): the cluster does not enable DRAConsumableCapacity, so each device goes whole to one claim; run without --shared, or enable the feature gate");
                                    warned = true;
                                }
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

/// Polls between lookups of the Node.
const NODE_LOOKUP_EVERY: u64 = 12;

/// The slices as published: their specs and owners, in order.
type Published = Vec<(ResourceSliceSpec, Option<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>>)>;

/// This node's slices of the driver in the API server, by name.
async fn current(api: &Api<ResourceSlice>, p: &Publisher) -> Result<Vec<ResourceSlice>, kube::Error> {
    let list = api.list(&ListParams::default().fields(&format!("spec.nodeName={},spec.driver={}", p.node, p.driver))).await?;
    let mut items = list.items;
    items.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Ok(items)
}

/// Writes `want` over this node's slices `have` (in order), makes those
/// there are not yet (named by the API server), and deletes the rest.
/// True where the API server dropped the devices' sharing (a cluster
/// without consumable capacity).
async fn apply(api: &Api<ResourceSlice>, p: &Publisher, want: Vec<ResourceSlice>, have: Vec<ResourceSlice>) -> Result<bool, kube::Error> {
    let shares = |s: &ResourceSlice| s.spec.devices.iter().flatten().filter(|d| d.allow_multiple_allocations == Some(true)).count();
    let mut dropped = false;
    // Only slices of this node's pool are written over (a pool name cannot
    // change); any other of this node and driver (an admin's, an old
    // driver's) is deleted, or left with a warning where that is refused.
    let (ours, others): (Vec<ResourceSlice>, Vec<ResourceSlice>) = have.into_iter().partition(|s| s.spec.pool.name == p.node);
    let mut old = ours.into_iter();
    for mut s in want {
        let stored = match old.next() {
            Some(o) => {
                let name = o.metadata.name.clone().unwrap_or_default();
                s.metadata.name = Some(name.clone());
                s.metadata.generate_name = None;
                s.metadata.resource_version = o.metadata.resource_version;
                api.replace(&name, &PostParams::default(), &s).await?
            }
            None => api.create(&PostParams::default(), &s).await?,
        };
        dropped |= shares(&stored) < shares(&s);
    }
    for o in old {
        if let Some(name) = o.metadata.name {
            info!(slice = %name, "deleting a ResourceSlice of this node that is no longer needed");
            api.delete(&name, &DeleteParams::default()).await?;
        }
    }
    for o in others {
        if let Some(name) = o.metadata.name {
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => info!(slice = %name, pool = %o.spec.pool.name, "deleted a ResourceSlice of this node and driver in another pool"),
                Err(e) => warn!(slice = %name, pool = %o.spec.pool.name, "a ResourceSlice of this node and driver in another pool cannot be deleted: {e}"),
            }
        }
    }
    Ok(dropped)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A real cluster's API server is HTTPS: the client builds its TLS
    /// (rustls on ring, chosen without any process-wide setup) and a call
    /// to a server that is not there is an error, not a panic.
    #[test]
    fn an_https_api_server_gets_a_tls_client_and_a_dead_one_an_error() {
        let dir = std::env::temp_dir().join(format!("vgpu-k8s-kc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let kc = dir.join("kubeconfig");
        std::fs::write(
            &kc,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n",
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let client = rt.block_on(kube_client(Some(&kc))).expect("a TLS client");
        let api: Api<ResourceClaim> = Api::namespaced(client, "ns");
        assert!(rt.block_on(lookup(&api, "c")).is_err(), "a dead API server answered");
        // A kubeconfig that is not one is refused with its path.
        std::fs::write(&kc, "clusters: 7").unwrap();
        let e = rt.block_on(kube_client(Some(&kc))).err().expect("a bad kubeconfig was taken");
        assert!(e.to_string().contains("kubeconfig"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
