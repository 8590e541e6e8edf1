//! vgpu-k8s's DRA driver against the two sides it talks to, played from
//! their official definitions:
//! - a stand-in kubelet built from the kubelet's plugin registration and
//!   DRA plugin gRPC definitions (k8s/proto, from k8s.io/kubelet), which
//!   finds the driver in plugins_registry/ and calls NodePrepareResources
//!   and NodeUnprepareResources as the kubelet does;
//! - a stand-in API server (HTTP, the paths and Status errors of the
//!   Kubernetes API) that holds the Node, the ResourceClaims as the
//!   scheduler allocated them, and the ResourceSlices the driver writes.
//!   Every slice written is checked against resource.k8s.io/v1: it must
//!   read as k8s-openapi's ResourceSlice (generated from the Kubernetes
//!   OpenAPI document) and write back the same, and pass the API server's
//!   validation rules for the type (names, limits, one value per
//!   attribute, quantities, capacity request policies); a slice that
//!   fails is refused with 422, as an API server does, and the test fails.
//!
//! After each step the daemon's tenants are what the prepared claims hold,
//! no more.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};
use vgpu_k8s::proto::dra as pb;
use vgpu_k8s::proto::pluginregistration as reg;
use vgpu_tests::k8s::{assert_sample_passes_with_cdi, round_trip, run_with_cdi, spec_file, tenant_of, tenants, wait_until, NodeComponent};
use vgpu_tests::Mediator;

const DRIVER: &str = "vgpu.dev";
const NODE: &str = "node-a";
const NODE_UID: &str = "6a1f3c2e-0000-4000-8000-00000000000a";

// ---------------------------------------------------------------------
// The stand-in API server.

#[derive(Default)]
struct Store {
    rv: u64,
    claims: BTreeMap<(String, String), Value>,
    slices: BTreeMap<String, Value>,
    /// Slices refused, with why.
    refused: Vec<String>,
    /// Writes of slices (creates and replaces).
    writes: u64,
}

type Api = Arc<Mutex<Store>>;

fn status(code: StatusCode, reason: &str, message: String) -> (StatusCode, Json<Value>) {
    (code, Json(json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code.as_u16() })))
}

type Answer = Result<Json<Value>, (StatusCode, Json<Value>)>;

/// A DNS label: lower-case letters, digits and '-', at most 63.
fn dns_label(s: &str) -> bool {
    !s.is_empty() && s.len() <= 63 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') && !s.starts_with('-') && !s.ends_with('-')
}

/// A DNS subdomain: dot-separated labels, at most 253.
fn dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(dns_label)
}

/// A C identifier of at most 32 characters.
fn c_identifier(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') && !s.as_bytes()[0].is_ascii_digit()
}

/// An attribute or capacity name: an identifier, or DOMAIN/identifier.
fn qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        Some((domain, id)) => domain.len() <= 63 && dns_subdomain(domain) && c_identifier(id),
        None => c_identifier(s),
    }
}

/// A Kubernetes quantity: a decimal with an optional binary or decimal SI
/// suffix or exponent.
fn quantity(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, suffix) = s.split_at(end);
    let num_ok = num.bytes().filter(|&b| b == b'.').count() <= 1 && num.bytes().any(|b| b.is_ascii_digit());
    let suffix_ok = matches!(suffix, "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T" | "P" | "E")
        || (suffix.len() > 1 && suffix.starts_with(['e', 'E']) && suffix[1..].strip_prefix(['+', '-']).unwrap_or(&suffix[1..]).bytes().all(|b| b.is_ascii_digit()));
    num_ok && suffix_ok
}

/// Semantic version 2.0 (what a version attribute holds).
fn semver(s: &str) -> bool {
    let core = s.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = core.split('.').collect();
    s.len() <= 64 && parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p.len() == 1 || !p.starts_with('0')))
}

/// The binary value of a quantity this test's documents use (for order
/// checks); None for forms it does not compare.
fn bytes(q: &str) -> Option<u64> {
    for (suffix, shift) in [("Ki", 10), ("Mi", 20), ("Gi", 30), ("Ti", 40)] {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().ok().map(|n| n << shift);
        }
    }
    q.parse().ok()
}

/// The API server's validation of a ResourceSlice (resource.k8s.io/v1):
/// the schema by round trip through the generated type, then its rules.
fn validate_slice(v: &Value) -> Result<(), String> {
    if v["apiVersion"] != "resource.k8s.io/v1" || v["kind"] != "ResourceSlice" {
        return Err(format!("apiVersion {} kind {}", v["apiVersion"], v["kind"]));
    }
    round_trip::<ResourceSlice>(v)?;
    let name = v["metadata"]["name"].as_str().unwrap_or("");
    if !dns_subdomain(name) || name.is_empty() {
        return Err(format!("metadata.name {name:?} is not a DNS subdomain"));
    }
    for o in v["metadata"]["ownerReferences"].as_array().into_iter().flatten() {
        if o["uid"].as_str().unwrap_or("").is_empty() || o["name"].as_str().unwrap_or("").is_empty() {
            return Err(format!("owner reference without uid or name: {o}"));
        }
    }
    let spec = &v["spec"];
    let driver = spec["driver"].as_str().unwrap_or("");
    if driver.len() > 63 || !dns_subdomain(driver) || driver.is_empty() {
        return Err(format!("spec.driver {driver:?}"));
    }
    let pool = &spec["pool"];
    let pool_name = pool["name"].as_str().unwrap_or("");
    if pool_name.is_empty() || pool_name.len() > 253 || !pool_name.split('/').all(dns_subdomain) {
        return Err(format!("spec.pool.name {pool_name:?}"));
    }
    if pool["generation"].as_i64().is_none_or(|g| g < 0) || pool["resourceSliceCount"].as_i64().is_none_or(|c| c < 1) {
        return Err(format!("spec.pool {pool}"));
    }
    let placements = [spec["nodeName"].is_string(), spec["nodeSelector"].is_object(), spec["allNodes"] == true, spec["perDeviceNodeSelection"] == true].iter().filter(|x| **x).count();
    if placements != 1 {
        return Err("exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection must be set".into());
    }
    let devices = spec["devices"].as_array().cloned().unwrap_or_default();
    if devices.len() > 128 {
        return Err(format!("{} devices; at most 128", devices.len()));
    }
    let mut names = std::collections::BTreeSet::new();
    for d in &devices {
        let dn = d["name"].as_str().unwrap_or("");
        if !dns_label(dn) || !names.insert(dn.to_string()) {
            return Err(format!("device name {dn:?} (a DNS label, unique)"));
        }
        let attrs = d["attributes"].as_object().cloned().unwrap_or_default();
        let caps = d["capacity"].as_object().cloned().unwrap_or_default();
        if attrs.len() + caps.len() > 32 {
            return Err(format!("device {dn}: {} attributes and capacities; at most 32", attrs.len() + caps.len()));
        }
        for (k, a) in &attrs {
            if !qualified_name(k) {
                return Err(format!("device {dn}: attribute name {k:?}"));
            }
            let set: Vec<&str> = ["bool", "int", "string", "version"].into_iter().filter(|t| !a[*t].is_null()).collect();
            match set.as_slice() {
                ["string"] if a["string"].as_str().is_some_and(|s| s.len() <= 64) => {}
                ["version"] if a["version"].as_str().is_some_and(semver) => {}
                ["bool"] | ["int"] => {}
                _ => return Err(format!("device {dn}: attribute {k} must have exactly one valid value: {a}")),
            }
        }
        for (k, c) in &caps {
            let value = c["value"].as_str().unwrap_or("");
            if !qualified_name(k) || !quantity(value) {
                return Err(format!("device {dn}: capacity {k} = {c}"));
            }
            let p = &c["requestPolicy"];
            if p.is_object() {
                if !p["validRange"].is_null() && !p["validValues"].is_null() {
                    return Err(format!("device {dn}: capacity {k}: validRange and validValues both set"));
                }
                let (v, def, min, step) = (bytes(value), p["default"].as_str().and_then(bytes), p["validRange"]["min"].as_str().and_then(bytes), p["validRange"]["step"].as_str().and_then(bytes));
                if def.zip(v).is_some_and(|(d, v)| d > v) || min.zip(v).is_some_and(|(m, v)| m > v) || def.zip(min).is_some_and(|(d, m)| d < m) || step == Some(0) {
                    return Err(format!("device {dn}: capacity {k}: request policy out of range of {value}: {p}"));
                }
                if min.zip(step).zip(v).is_some_and(|((m, s), v)| m + s > v) {
                    return Err(format!("device {dn}: capacity {k}: min plus a step is more than the value {value}"));
                }
                if let (Some(d), Some(m), Some(s)) = (def, min, step) {
                    if (d - m) % s != 0 {
                        return Err(format!("device {dn}: capacity {k}: default is not min plus a whole number of steps"));
                    }
                }
            }
        }
        for t in d["taints"].as_array().into_iter().flatten() {
            if !qualified_name(t["key"].as_str().unwrap_or("")) && !t["key"].as_str().is_some_and(|k| k.split_once('/').is_some_and(|(d, n)| dns_subdomain(d) && dns_label(n))) {
                return Err(format!("device {dn}: taint key {}", t["key"]));
            }
            if !matches!(t["effect"].as_str(), Some("NoSchedule" | "NoExecute")) {
                return Err(format!("device {dn}: taint effect {}", t["effect"]));
            }
        }
    }
    Ok(())
}

fn next_rv(s: &mut Store) -> String {
    s.rv += 1;
    s.rv.to_string()
}

async fn get_node(UrlPath(name): UrlPath<String>) -> Answer {
    if name != NODE {
        return Err(status(StatusCode::NOT_FOUND, "NotFound", format!("nodes \"{name}\" not found")));
    }
    Ok(Json(json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": NODE, "uid": NODE_UID, "resourceVersion": "1" } })))
}

async fn get_claim(State(api): State<Api>, UrlPath((ns, name)): UrlPath<(String, String)>) -> Answer {
    let s = api.lock().unwrap();
    s.claims.get(&(ns, name.clone())).cloned().map(Json).ok_or_else(|| {
        let (code, Json(mut v)) = status(StatusCode::NOT_FOUND, "NotFound", format!("resourceclaims.resource.k8s.io \"{name}\" not found"));
        v["details"] = json!({ "name": name, "group": "resource.k8s.io", "kind": "resourceclaims" });
        (code, Json(v))
    })
}

async fn list_slices(State(api): State<Api>, Query(q): Query<BTreeMap<String, String>>) -> Answer {
    let s = api.lock().unwrap();
    let mut want: Vec<(String, String)> = Vec::new();
    for sel in q.get("fieldSelector").map(|f| f.split(',').collect::<Vec<_>>()).unwrap_or_default() {
        let (k, v) = sel.split_once('=').ok_or_else(|| status(StatusCode::BAD_REQUEST, "BadRequest", format!("field selector {sel:?}")))?;
        if !matches!(k, "spec.nodeName" | "spec.driver" | "metadata.name") {
            return Err(status(StatusCode::BAD_REQUEST, "BadRequest", format!("field label not supported: {k}")));
        }
        want.push((k.to_string(), v.to_string()));
    }
    let field = |o: &Value, k: &str| match k {
        "spec.nodeName" => o["spec"]["nodeName"].as_str().unwrap_or("").to_string(),
        "spec.driver" => o["spec"]["driver"].as_str().unwrap_or("").to_string(),
        _ => o["metadata"]["name"].as_str().unwrap_or("").to_string(),
    };
    let items: Vec<Value> = s.slices.values().filter(|o| want.iter().all(|(k, v)| &field(o, k) == v)).cloned().collect();
    Ok(Json(json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList", "metadata": { "resourceVersion": s.rv.to_string() }, "items": items })))
}

fn refuse(s: &mut Store, name: &str, why: String) -> (StatusCode, Json<Value>) {
    s.refused.push(format!("{name}: {why}"));
    status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", format!("ResourceSlice.resource.k8s.io \"{name}\" is invalid: {why}"))
}

async fn create_slice(State(api): State<Api>, Json(mut v): Json<Value>) -> Result<(StatusCode, Json<Value>), (StatusCode, Json<Value>)> {
    let mut s = api.lock().unwrap();
    // generateName: the API server adds five characters of its own.
    if v["metadata"]["name"].as_str().unwrap_or("").is_empty() {
        if let Some(g) = v["metadata"]["generateName"].as_str().map(String::from) {
            v["metadata"]["name"] = json!(format!("{g}{:05x}", (s.rv * 7919 + 12345) % 0xfffff));
        }
    }
    let name = v["metadata"]["name"].as_str().unwrap_or("").to_string();
    validate_slice(&v).map_err(|why| refuse(&mut s, &name, why))?;
    if s.slices.contains_key(&name) {
        return Err(status(StatusCode::CONFLICT, "AlreadyExists", format!("resourceslices.resource.k8s.io \"{name}\" already exists")));
    }
    v["metadata"]["resourceVersion"] = json!(next_rv(&mut s));
    v["metadata"]["uid"] = json!(format!("slice-{}", s.rv));
    s.writes += 1;
    s.slices.insert(name, v.clone());
    Ok((StatusCode::CREATED, Json(v)))
}

async fn get_slice(State(api): State<Api>, UrlPath(name): UrlPath<String>) -> Answer {
    let s = api.lock().unwrap();
    s.slices.get(&name).cloned().map(Json).ok_or_else(|| status(StatusCode::NOT_FOUND, "NotFound", format!("resourceslices.resource.k8s.io \"{name}\" not found")))
}

async fn replace_slice(State(api): State<Api>, UrlPath(name): UrlPath<String>, Json(mut v): Json<Value>) -> Answer {
    let mut s = api.lock().unwrap();
    validate_slice(&v).map_err(|why| refuse(&mut s, &name, why))?;
    let Some(old) = s.slices.get(&name) else { return Err(status(StatusCode::NOT_FOUND, "NotFound", format!("resourceslices.resource.k8s.io \"{name}\" not found"))) };
    for f in ["nodeName", "driver"] {
        if v["spec"][f] != old["spec"][f] {
            let why = format!("spec.{f}: field is immutable");
            return Err(refuse(&mut s, &name, why));
        }
    }
    if v["spec"]["pool"]["name"] != old["spec"]["pool"]["name"] {
        return Err(refuse(&mut s, &name, "spec.pool.name: field is immutable".into()));
    }
    if v["metadata"]["resourceVersion"] != old["metadata"]["resourceVersion"] {
        return Err(status(StatusCode::CONFLICT, "Conflict", format!("Operation cannot be fulfilled on resourceslices.resource.k8s.io \"{name}\": the object has been modified")));
    }
    v["metadata"]["uid"] = old["metadata"]["uid"].clone();
    v["metadata"]["resourceVersion"] = json!(next_rv(&mut s));
    s.writes += 1;
    s.slices.insert(name, v.clone());
    Ok(Json(v))
}

async fn delete_slice(State(api): State<Api>, UrlPath(name): UrlPath<String>) -> Answer {
    let mut s = api.lock().unwrap();
    let old = s.slices.remove(&name).ok_or_else(|| status(StatusCode::NOT_FOUND, "NotFound", format!("resourceslices.resource.k8s.io \"{name}\" not found")))?;
    Ok(Json(old))
}

/// Serves the stand-in API server on a local port; returns its URL.
fn serve_api(rt: &tokio::runtime::Runtime, api: Api) -> String {
    let app = Router::new()
        .route("/api/v1/nodes/{name}", get(get_node))
        .route("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}", get(get_claim))
        .route("/apis/resource.k8s.io/v1/resourceslices", get(list_slices).post(create_slice))
        .route("/apis/resource.k8s.io/v1/resourceslices/{name}", get(get_slice).put(replace_slice).delete(delete_slice))
        .with_state(api);
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    rt.spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A ResourceClaim as the scheduler leaves it: one request of the
/// driver's class, allocated on `device` of `pool`, with `consumed`
/// memory where the device is shared, and `config` as the claim's opaque
/// configuration for the driver.
fn claim(name: &str, uid: &str, pool: &str, device: &str, consumed: Option<&str>, config: Option<Value>) -> Value {
    let mut result = json!({ "request": "gpu", "driver": DRIVER, "pool": pool, "device": device });
    if let Some(c) = consumed {
        result["consumedCapacity"] = json!({ "memory": c });
        result["shareID"] = json!(format!("{}", uid.len() * 7));
    }
    let mut configs = vec![json!({ "source": "FromClass", "opaque": { "driver": "other.example.com", "parameters": { "anything": true } } })];
    if let Some(p) = config {
        configs.push(json!({ "source": "FromClaim", "requests": ["gpu"], "opaque": { "driver": DRIVER, "parameters": p } }));
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": { "name": name, "namespace": "team-a", "uid": uid },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": { "deviceClassName": DRIVER } }] } },
        "status": {
            "allocation": { "devices": { "results": [result], "config": configs } },
            "reservedFor": [{ "resource": "pods", "name": format!("pod-{name}"), "uid": format!("pod-{uid}") }],
        },
    })
}

fn put_claim(api: &Api, c: Value) {
    // The claims the test makes are ResourceClaims as the API defines them.
    round_trip::<k8s_openapi::api::resource::v1::ResourceClaim>(&c).unwrap_or_else(|e| panic!("the test's claim: {e}"));
    let key = (c["metadata"]["namespace"].as_str().unwrap().to_string(), c["metadata"]["name"].as_str().unwrap().to_string());
    api.lock().unwrap().claims.insert(key, c);
}

// ---------------------------------------------------------------------
// The stand-in kubelet.

struct Kubelet {
    dir: PathBuf,
    rt: tokio::runtime::Runtime,
}

impl Kubelet {
    /// Finds the driver as the kubelet's plugin watcher does: its socket in
    /// plugins_registry/, GetInfo, checks, NotifyRegistrationStatus.
    fn discover(&self) -> reg::PluginInfo {
        let sock = self.dir.join("plugins_registry").join(format!("{DRIVER}-reg.sock"));
        let mut info = None;
        wait_until("the driver's registration answers", Duration::from_secs(30), || {
            info = self.rt.block_on(async {
                let ch = vgpu_k8s::uds::channel(&sock).await.ok()?;
                reg::registration_client::RegistrationClient::new(ch).get_info(reg::InfoRequest {}).await.ok()
            });
            info.is_some()
        });
        let info = info.expect("info").into_inner();
        assert_eq!((info.r#type.as_str(), info.name.as_str()), ("DRAPlugin", DRIVER), "{info:?}");
        assert!(info.supported_versions.iter().any(|v| v == "v1.DRAPlugin"), "{info:?}");
        assert!(Path::new(&info.endpoint).is_absolute() && Path::new(&info.endpoint).starts_with(self.dir.join("plugins")), "{info:?}");
        self.rt
            .block_on(async {
                let ch = vgpu_k8s::uds::channel(&sock).await.map_err(|e| e.to_string())?;
                reg::registration_client::RegistrationClient::new(ch)
                    .notify_registration_status(reg::RegistrationStatus { plugin_registered: true, error: String::new() })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(())
            })
            .expect("NotifyRegistrationStatus");
        info
    }

    fn client(&self, info: &reg::PluginInfo) -> pb::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
        let ch = self.rt.block_on(vgpu_k8s::uds::channel(Path::new(&info.endpoint))).expect("connect to the driver");
        pb::dra_plugin_client::DraPluginClient::new(ch)
    }

    fn prepare(&self, c: &mut pb::dra_plugin_client::DraPluginClient<tonic::transport::Channel>, claims: &[(&str, &str)]) -> BTreeMap<String, pb::NodePrepareResourceResponse> {
        let req = pb::NodePrepareResourcesRequest { claims: claims.iter().map(|(name, uid)| pb::Claim { namespace: "team-a".into(), uid: uid.to_string(), name: name.to_string() }).collect() };
        self.rt.block_on(c.node_prepare_resources(req)).expect("NodePrepareResources").into_inner().claims.into_iter().collect()
    }

    fn unprepare(&self, c: &mut pb::dra_plugin_client::DraPluginClient<tonic::transport::Channel>, claims: &[(&str, &str)]) -> BTreeMap<String, String> {
        let req = pb::NodeUnprepareResourcesRequest { claims: claims.iter().map(|(name, uid)| pb::Claim { namespace: "team-a".into(), uid: uid.to_string(), name: name.to_string() }).collect() };
        self.rt.block_on(c.node_unprepare_resources(req)).expect("NodeUnprepareResources").into_inner().claims.into_iter().map(|(k, v)| (k, v.error)).collect()
    }
}

fn start_driver(m: &Mediator, kubelet: &Path, root: &Path, kubeconfig: &Path) -> NodeComponent {
    let kc = kubeconfig.to_str().expect("a UTF-8 path");
    NodeComponent::start(
        &["dra-driver", "--node-name", NODE, "--shared", "--default-share", "8MiB", "--min-share", "1MiB", "--poll-s", "1", "--reconcile-s", "1", "--kubeconfig", kc],
        m,
        kubelet,
        root,
    )
}

fn slice_devices(api: &Api) -> BTreeMap<String, Value> {
    let s = api.lock().unwrap();
    s.slices.values().flat_map(|v| v["spec"]["devices"].as_array().cloned().unwrap_or_default()).map(|d| (d["name"].as_str().unwrap_or("").to_string(), d)).collect()
}

fn memory_of(api: &Api, device: &str) -> Option<String> {
    slice_devices(api).get(device).and_then(|d| d["capacity"]["memory"]["value"].as_str().map(String::from))
}

#[test]
fn the_dra_driver_publishes_slices_and_prepares_claims_for_a_stand_in_kubelet() {
    let args = ["--cpu-devices", "2", "--device-memory", "64MiB"];
    let mut m = Mediator::start(&args);
    let root = m.run_dir.join("k8s-dra");
    let kubelet_dir = root.join("kubelet");
    std::fs::create_dir_all(kubelet_dir.join("plugins_registry")).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let api: Api = Arc::default();
    let url = serve_api(&rt, api.clone());
    let kubeconfig = root.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: {url}\nusers:\n- name: driver\n  user:\n    token: stand-in-token\ncontexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: driver\ncurrent-context: stand-in\n"
        ),
    )
    .unwrap();
    let k = Kubelet { dir: kubelet_dir.clone(), rt };
    let mut driver = start_driver(&m, &kubelet_dir, &root, &kubeconfig);

    // Registration: found in plugins_registry/, a DRA plugin of v1.
    let info = k.discover();
    let mut c = k.client(&info);

    // The node's ResourceSlice: both devices, their memory as a capacity
    // claims share, owned by the Node; every write valid.
    wait_until("the node's slice is published", Duration::from_secs(30), || slice_devices(&api).len() == 2);
    {
        let s = api.lock().unwrap();
        assert!(s.refused.is_empty(), "slices refused: {:?}", s.refused);
        let [slice] = s.slices.values().collect::<Vec<_>>()[..] else { panic!("one slice: {:?}", s.slices.keys()) };
        let spec = &slice["spec"];
        assert_eq!(
            (spec["driver"].as_str(), spec["nodeName"].as_str(), spec["pool"]["name"].as_str(), spec["pool"]["resourceSliceCount"].as_i64()),
            (Some(DRIVER), Some(NODE), Some(NODE), Some(1)),
            "{slice}"
        );
        assert_eq!(slice["metadata"]["ownerReferences"][0]["uid"], NODE_UID, "{slice}");
        assert_eq!(slice["metadata"]["ownerReferences"][0]["kind"], "Node", "{slice}");
    }
    let devs = slice_devices(&api);
    let cpu1 = &devs["cpu1"];
    assert_eq!(cpu1["allowMultipleAllocations"], true, "{cpu1}");
    assert_eq!(cpu1["capacity"]["memory"], json!({ "value": "64Mi", "requestPolicy": { "default": "8Mi", "validRange": { "min": "1Mi", "step": "1Mi" } } }), "{cpu1}");
    assert_eq!(cpu1["attributes"]["type"], json!({ "string": "cpu" }));
    assert_eq!(cpu1["attributes"]["pool"], json!({ "string": "default" }));
    assert_eq!(cpu1["attributes"]["isolation"], json!({ "string": "process" }));
    assert!(cpu1["attributes"]["driverVersion"]["version"].is_string(), "{cpu1}");
    assert!(tenants(&m).is_empty(), "no claim, no tenant");

    // Memory others take (a tenant made outside Kubernetes) is not offered.
    let (st, v) = m.api("POST", "/v1/tenants", Some(json!({ "name": "vm-tenant", "memory": "16MiB", "device": "cpu0" })));
    assert_eq!(st, 201, "{v}");
    wait_until("cpu0 offers 48Mi", Duration::from_secs(20), || memory_of(&api, "cpu0").as_deref() == Some("48Mi"));

    // A claim allocated 16Mi of cpu1, configured to weight 3, cap 50, batch.
    let config = json!({ "apiVersion": "vgpu.dev/v1", "kind": "TenantConfig", "weight": 3, "cap": 50, "priority": "batch" });
    put_claim(&api, claim("train", "uid-train", NODE, "cpu1", Some("16Mi"), Some(config)));
    let r = k.prepare(&mut c, &[("train", "uid-train")]);
    let a = &r["uid-train"];
    assert_eq!(a.error, "", "{a:?}");
    let [d] = &a.devices[..] else { panic!("one device: {a:?}") };
    assert_eq!((d.request_names.clone(), d.pool_name.as_str(), d.device_name.as_str(), d.share_id.clone()), (vec!["gpu".to_string()], NODE, "cpu1", Some("63".to_string())), "{d:?}");
    let [cdi_id] = &d.cdi_device_ids[..] else { panic!("one CDI device: {d:?}") };
    assert!(cdi_id.starts_with("vgpu.dev/tenant=dra-0-") && cdi_id.len() == "vgpu.dev/tenant=dra-0-".len() + 8, "the CDI device names the tenant without its secret: {cdi_id}");
    let tenant = tenant_of(&m, cdi_id);
    let cdi_public = cdi_id.trim_start_matches("vgpu.dev/tenant=");
    let secret = tenant.strip_prefix(&format!("{}-", cdi_public)).unwrap_or_else(|| panic!("{tenant}"));
    assert!(secret.len() == 16 && secret.bytes().all(|b| b.is_ascii_hexdigit()), "{tenant}");
    assert_eq!(tenants(&m), [tenant.clone(), "vm-tenant".into()]);
    let (_, t) = m.api("GET", &format!("/v1/tenants/{tenant}"), None);
    assert_eq!((t["memory"].as_u64(), t["weight"].as_u64(), t["cap"].as_u64(), t["priority"].as_str(), t["device"].as_str()), (Some(16 << 20), Some(3), Some(50), Some("batch"), Some("cpu1")), "{t}");
    // Others take the rest of cpu0: it has no share left and leaves the
    // slice (an API server refuses a capacity below its least request);
    // the slice published then still offers cpu1 whole, for the claim's
    // memory counts as offered to claims. cpu0 comes back when freed.
    let (st, v) = m.api("POST", "/v1/tenants", Some(json!({ "name": "vm-big", "memory": "48MiB", "device": "cpu0" })));
    assert_eq!(st, 201, "{v}");
    wait_until("the full cpu0 leaves the slice", Duration::from_secs(20), || !slice_devices(&api).contains_key("cpu0"));
    assert_eq!(memory_of(&api, "cpu1").as_deref(), Some("64Mi"));
    let (st, v) = m.api("DELETE", "/v1/tenants/vm-big", None);
    assert!(st < 300, "{v}");
    wait_until("cpu0 offers 48Mi again", Duration::from_secs(20), || memory_of(&api, "cpu0").as_deref() == Some("48Mi"));
    assert!(api.lock().unwrap().refused.is_empty(), "slices refused: {:?}", api.lock().unwrap().refused);

    // A CUDA sample runs as the claim's tenant through the CDI spec.
    let spec_path = spec_file(&root.join("cdi"), cdi_id);
    let spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).expect("the CDI spec")).expect("JSON");
    assert_eq!(spec["devices"][0]["containerEdits"]["mounts"][0]["hostPath"], t["socket"], "{spec}");
    assert!(t["hidden"].as_bool() == Some(true) && t["socket"].as_str().is_some_and(|s| s.contains("/hidden/")), "reached only through the bind mount: {t}");
    // The CPU device's setting for CuPy is in the spec, as the daemon says.
    assert_eq!(spec["devices"][0]["containerEdits"]["env"], json!(["VGPU_SOCKET=/run/vgpu/vgpu.sock", "CUPY_COMPILE_WITH_PTX=1"]), "{spec}");
    assert_sample_passes_with_cdi(&spec);

    // Prepared again (the kubelet retries): the same answer, no new tenant.
    let again = k.prepare(&mut c, &[("train", "uid-train")]);
    assert_eq!(again["uid-train"], *a);
    assert_eq!(tenants(&m), [tenant.clone(), "vm-tenant".into()]);

    // The kubelet restarts: it finds the driver again and prepares again.
    let info = k.discover();
    let mut c = k.client(&info);
    assert_eq!(k.prepare(&mut c, &[("train", "uid-train")])["uid-train"], *a);

    // The daemon restarts: the claim's tenant is kept.
    m.kill_and_restart(&args);
    assert_eq!(tenants(&m), [tenant.clone(), "vm-tenant".into()], "a daemon restart keeps the claims' tenants");

    // The driver dies; a tenant with its prefix that no claim holds (one
    // it made and died before recording) is there; the kubelet, missing
    // the driver, deleted its slices. The driver starts again: it
    // registers, sweeps the orphan, publishes again and still knows the
    // claim.
    driver.kill();
    // It had issued a name and made the tenant, and died before the claim
    // was recorded: the record says the name was issued.
    let state_file = root.join("state/dra-vgpu.dev.json");
    let mut record: Value = serde_json::from_slice(&std::fs::read(&state_file).expect("the driver's record")).expect("JSON");
    record["issued"].as_array_mut().expect("issued names").push(json!("dra-99-00c0ffee-0123456789abcdef"));
    // And a record from before tenants carried settings: no `env`.
    let without_env = |record: &mut Value| {
        let mut n = 0;
        for p in record["claims"].as_object_mut().expect("claims").values_mut() {
            for t in p["tenants"].as_array_mut().expect("tenants") {
                n += usize::from(t.as_object_mut().expect("tenant").remove("env").is_some());
            }
        }
        n
    };
    assert!(without_env(&mut record) > 0, "{record}");
    std::fs::write(&state_file, record.to_string()).unwrap();
    let (st, v) = m.api("POST", "/v1/tenants", Some(json!({ "name": "dra-99-00c0ffee-0123456789abcdef", "memory": "1MiB" })));
    assert_eq!(st, 201, "{v}");
    // Tenants it never issued are not its own, even named like its own
    // (another driver's on this node, an admin's).
    for name in ["dra-admin", "dra-7-00c0ffee-fedcba9876543210"] {
        let (st, v) = m.api("POST", "/v1/tenants", Some(json!({ "name": name, "memory": "1MiB" })));
        assert_eq!(st, 201, "{v}");
    }
    // The CDI directory is a tmpfs: a reboot empties it.
    std::fs::remove_file(&spec_path).expect("the spec");
    let writes_before = {
        let mut s = api.lock().unwrap();
        s.slices.clear();
        s.writes
    };
    let mut driver = start_driver(&m, &kubelet_dir, &root, &kubeconfig);
    let info = k.discover();
    let mut c = k.client(&info);
    wait_until("the orphan is deleted", Duration::from_secs(20), || tenants(&m) == [tenant.clone(), "dra-7-00c0ffee-fedcba9876543210".into(), "dra-admin".into(), "vm-tenant".into()]);
    assert!(spec_path.exists(), "the recorded tenant's CDI spec is written again");
    let again: Value = serde_json::from_slice(&std::fs::read(&spec_path).expect("the CDI spec")).expect("JSON");
    assert_eq!(again, spec, "the spec written again from the record (its settings from the daemon) is the one written first");
    let record: Value = serde_json::from_slice(&std::fs::read(&state_file).expect("the driver's record")).expect("JSON");
    let envs: Vec<Value> = record["claims"].as_object().expect("claims").values().flat_map(|p| p["tenants"].as_array().cloned().unwrap_or_default()).map(|t| t["env"].clone()).collect();
    assert!(!envs.is_empty() && envs.iter().all(|e| *e == json!({ "CUPY_COMPILE_WITH_PTX": "1" })), "the record has the daemon's settings again: {envs:?}");
    for name in ["dra-admin", "dra-7-00c0ffee-fedcba9876543210"] {
        let (st, v) = m.api("DELETE", &format!("/v1/tenants/{name}"), None);
        assert!(st < 300, "{v}");
    }
    wait_until("the slices are published again", Duration::from_secs(20), || slice_devices(&api).len() == 2);
    assert!(api.lock().unwrap().writes > writes_before);
    assert_eq!(k.prepare(&mut c, &[("train", "uid-train")])["uid-train"], *a, "the restarted driver remembers the claim");

    // Claims it cannot prepare get an error each, and nothing is made; the
    // good claim in the same call is answered.
    put_claim(&api, claim("elsewhere", "uid-elsewhere", "node-b", "cpu0", Some("1Mi"), None));
    put_claim(&api, claim("nodevice", "uid-nodevice", NODE, "gpu7", Some("1Mi"), None));
    put_claim(&api, claim("badcfg", "uid-badcfg", NODE, "cpu0", Some("1Mi"), Some(json!({ "apiVersion": "vgpu.dev/v1", "kind": "TenantConfig", "wieght": 2 }))));
    put_claim(&api, claim("badkind", "uid-badkind", NODE, "cpu0", Some("1Mi"), Some(json!({ "apiVersion": "vgpu.dev/v9", "kind": "Other" }))));
    put_claim(&api, claim("badweight", "uid-badweight", NODE, "cpu0", Some("1Mi"), Some(json!({ "apiVersion": "vgpu.dev/v1", "kind": "TenantConfig", "weight": 0 }))));
    put_claim(&api, claim("greedy", "uid-greedy", NODE, "cpu0", Some("1Mi"), Some(json!({ "apiVersion": "vgpu.dev/v1", "kind": "TenantConfig", "weight": 500 }))));
    put_claim(&api, claim("toobig", "uid-toobig", NODE, "cpu0", Some("1Gi"), None));
    let mut unallocated = claim("pending", "uid-pending", NODE, "cpu0", None, None);
    unallocated["status"] = json!({});
    put_claim(&api, unallocated);
    let bad = [
        ("missing", "uid-missing", "not found"),
        ("train", "uid-other", "not uid-other"),
        ("elsewhere", "uid-elsewhere", "not one of this node's"),
        ("nodevice", "uid-nodevice", "gpu7 is not offered"),
        ("badcfg", "uid-badcfg", "unknown field `wieght`"),
        ("badkind", "uid-badkind", "vgpu.dev/v9"),
        ("badweight", "uid-badweight", "weight must be 1..=10000, not 0"),
        ("greedy", "uid-greedy", "weight 500 is more than a claim may ask (100)"),
        ("toobig", "uid-toobig", "HTTP 507"),
        ("pending", "uid-pending", "not allocated"),
    ];
    let mut names: Vec<(&str, &str)> = bad.iter().map(|(n, u, _)| (*n, *u)).collect();
    names.push(("train", "uid-train"));
    let r = k.prepare(&mut c, &names);
    for (_, uid, says) in bad {
        let e = &r[uid];
        assert!(e.devices.is_empty() && e.error.contains(says), "{uid}: {e:?} should say {says:?}");
    }
    assert_eq!(r["uid-train"], *a);
    assert_eq!(tenants(&m), [tenant.clone(), "vm-tenant".into()], "a refused claim makes no tenant");
    let many: Vec<(&str, &str)> = (0..300).map(|_| ("train", "uid-train")).collect();
    let e =
        k.rt.block_on(
            c.node_prepare_resources(pb::NodePrepareResourcesRequest { claims: many.iter().map(|(n, u)| pb::Claim { namespace: "team-a".into(), uid: u.to_string(), name: n.to_string() }).collect() }),
        )
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // A claim on a device allocated whole (no consumed capacity), with
    // its memory configured; then the claim is deleted from the API server
    // while the kubelet is away: the driver unprepares it by itself.
    put_claim(&api, claim("whole", "uid-whole", NODE, "cpu0", None, Some(json!({ "apiVersion": "vgpu.dev/v1", "kind": "TenantConfig", "memory": "8Mi" }))));
    let w = k.prepare(&mut c, &[("whole", "uid-whole")]);
    assert_eq!(w["uid-whole"].error, "", "{w:?}");
    let whole_id = w["uid-whole"].devices[0].cdi_device_ids[0].clone();
    let whole = tenant_of(&m, &whole_id);
    let (_, t) = m.api("GET", &format!("/v1/tenants/{whole}"), None);
    assert_eq!((t["memory"].as_u64(), t["weight"].as_u64(), t["device"].as_str()), (Some(8 << 20), Some(1), Some("cpu0")), "{t}");
    api.lock().unwrap().claims.remove(&("team-a".to_string(), "whole".to_string()));
    wait_until("the deleted claim's tenant is deleted", Duration::from_secs(20), || !tenants(&m).contains(&whole));
    // The driver deletes the tenant first and its spec after: wait for both.
    let whole_spec = spec_file(&root.join("cdi"), &whole_id);
    wait_until("the deleted claim's CDI spec is removed", Duration::from_secs(20), || !whole_spec.exists());

    // The same claim allocated again elsewhere (deallocated and allocated
    // anew while the kubelet was away): its old tenant goes, a new one is
    // made where the allocation now says.
    put_claim(&api, claim("moved", "uid-moved", NODE, "cpu1", Some("2Mi"), None));
    let first = k.prepare(&mut c, &[("moved", "uid-moved")]);
    let old = tenant_of(&m, &first["uid-moved"].devices.first().unwrap_or_else(|| panic!("{first:?}")).cdi_device_ids[0]);
    put_claim(&api, claim("moved", "uid-moved", NODE, "cpu0", Some("2Mi"), None));
    let second = k.prepare(&mut c, &[("moved", "uid-moved")]);
    let d = second["uid-moved"].devices.first().unwrap_or_else(|| panic!("{second:?}"));
    let new = tenant_of(&m, &d.cdi_device_ids[0]);
    assert_eq!(d.device_name, "cpu0");
    assert_ne!(new, old);
    let now = tenants(&m);
    assert!(!now.contains(&old) && now.contains(&new), "{now:?}");
    assert_eq!(k.unprepare(&mut c, &[("moved", "uid-moved")])["uid-moved"], "");

    // Unprepare: the tenant is deleted (its memory scrubbed), its spec
    // removed, and the sample is refused. Unpreparing again is done.
    let u = k.unprepare(&mut c, &[("train", "uid-train")]);
    assert_eq!(u["uid-train"], "", "{u:?}");
    assert_eq!(tenants(&m), ["vm-tenant"]);
    assert!(!spec_path.exists(), "the CDI spec is removed with the tenant");
    let o = run_with_cdi(&spec);
    assert!(!o.status.success(), "the sample ran after its claim was unprepared");
    let (_, d) = m.api("GET", "/v1/devices/cpu1", None);
    assert_eq!(d["memory_reserved"], 0, "{d}");
    assert_eq!(k.unprepare(&mut c, &[("train", "uid-train")])["uid-train"], "");

    // Every slice the driver wrote was valid, and the node has one: each
    // write after the first replaced it, named as the API server named it.
    let s = api.lock().unwrap();
    assert!(s.refused.is_empty(), "slices refused: {:?}", s.refused);
    let names: Vec<&String> = s.slices.keys().collect();
    assert!(names.len() == 1 && names[0].starts_with("node-a-vgpu.dev-") && names[0].len() == "node-a-vgpu.dev-".len() + 5, "{names:?}");
    drop(s);
    driver.kill();
}

/// The stand-in's validation refuses what an API server refuses, so a
/// driver that wrote such slices would fail the test above.
#[test]
fn the_stand_in_refuses_invalid_resource_slices() {
    let good = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": { "name": "node-a-vgpu.dev-0" },
        "spec": { "driver": DRIVER, "nodeName": NODE, "pool": { "name": NODE, "generation": 1, "resourceSliceCount": 1 },
            "devices": [{ "name": "cpu0", "attributes": { "type": { "string": "cpu" } }, "capacity": { "memory": { "value": "64Mi", "requestPolicy": { "default": "8Mi", "validRange": { "min": "1Mi", "step": "1Mi" } } } } }] },
    });
    validate_slice(&good).expect("a good slice");
    let bad = |f: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        f(&mut v);
        validate_slice(&v).err()
    };
    assert!(bad(&|v| v["spec"]["devices"][0]["name"] = json!("CPU_0")).is_some(), "a device name that is no DNS label");
    assert!(bad(&|v| v["spec"]["devices"][0]["attributes"]["type"] = json!({ "string": "cpu", "int": 1 })).is_some(), "two values");
    assert!(bad(&|v| v["spec"]["devices"][0]["attributes"]["type"] = json!({ "version": "1.0" })).is_some(), "not semver");
    assert!(bad(&|v| v["spec"]["devices"][0]["attributes"]["bad name"] = json!({ "bool": true })).is_some(), "an attribute name");
    assert!(bad(&|v| v["spec"]["devices"][0]["capacity"]["memory"]["value"] = json!("lots")).is_some(), "not a quantity");
    assert!(bad(&|v| v["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["default"] = json!("128Mi")).is_some(), "default above the value");
    assert!(bad(&|v| v["spec"]["devices"][0]["allowMultipleAllocation"] = json!(true)).is_some(), "a misspelled field");
    assert!(bad(&|v| v["spec"]["allNodes"] = json!(true)).is_some(), "two placements");
    assert!(bad(&|v| v["spec"]["pool"]["resourceSliceCount"] = json!(0)).is_some(), "no slices in the pool");
    assert!(bad(&|v| v["spec"]["devices"] = json!((0..129).map(|i| json!({ "name": format!("d{i}") })).collect::<Vec<_>>())).is_some(), "129 devices");
    assert!(bad(&|v| v["spec"]["pool"].as_object_mut().unwrap().remove("name").map(drop).unwrap_or(())).is_some(), "no pool name");
}
