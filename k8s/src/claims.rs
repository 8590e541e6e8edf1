//! The DRA driver's pure half: the ResourceSlices that publish this node's
//! devices, and the tenants a ResourceClaim's allocation asks for. Both are
//! functions of the mediator's devices and the Kubernetes objects, tested
//! on their own.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::Deserialize;
use vgpu_api::tenant::Priority;

use crate::quantity;
use crate::slices::Device;

/// Most devices one ResourceSlice lists: resource.k8s.io/v1 allows 128,
/// and from Kubernetes 1.35 only 64 where any device has a taint (a device
/// whose worker is down has one).
pub const MAX_DEVICES_PER_SLICE: usize = 64;
/// The opaque configuration's apiVersion and kind.
pub const CONFIG_API_VERSION: &str = "vgpu.dev/v1";
pub const CONFIG_KIND: &str = "TenantConfig";
/// The step of a shared device's memory shares (and the least `min`).
pub const SHARE_STEP: u64 = 1 << 20;
/// The taint a device whose worker is down carries.
pub const UNAVAILABLE_TAINT: &str = "vgpu.dev/unavailable";

/// How devices are offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// Each device goes whole to one claim (its free memory, or what the
    /// claim's config asks).
    Exclusive,
    /// Claims share a device, each taking the memory it requests from the
    /// device's `memory` capacity (Kubernetes' consumable capacity;
    /// `default` is what a request that names no amount takes, `min` the
    /// least one may take, which bounds how many tenants one device has).
    Shared { default: u64, min: u64 },
}

/// A device's name in a ResourceSlice: a DNS label (lower case letters,
/// digits and '-', at most 63) made from the mediator's name.
pub fn device_label(name: &str) -> String {
    let mut s: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    s.truncate(63);
    let s = s.trim_matches('-').to_string();
    if s.is_empty() {
        "device".into()
    } else {
        s
    }
}

fn attr_string(v: &str) -> res::DeviceAttribute {
    res::DeviceAttribute { string: Some(v.chars().take(64).collect()), ..Default::default() }
}

/// The memory a device offers this driver's claims: what others (VMs,
/// tenants made outside Kubernetes) leave; quotas held by this node's
/// claims count as offered.
pub fn offered(d: &Device, ours: u64) -> u64 {
    d.capacity.saturating_sub(d.reserved.saturating_sub(ours))
}

/// Where the published slices go.
#[derive(Debug, Clone)]
pub struct Publisher {
    pub driver: String,
    pub node: String,
    /// The Node object's uid: the slices are owned by it (deleted with it).
    pub node_uid: Option<String>,
    pub sharing: Sharing,
}

impl Publisher {
    /// The start of the slices' names (`generateName`: the API server
    /// adds a random part). No name is fixed in advance, so that no one
    /// can take a node's slice names before its driver does; the driver
    /// finds its slices by node and driver.
    pub fn generate_name(&self) -> String {
        let base: String = format!("{}-{}", self.node, self.driver).chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c.to_ascii_lowercase() } else { '-' }).collect();
        let mut base = base;
        base.truncate(200);
        format!("{}-", base.trim_end_matches(['-', '.']))
    }

    /// One device as a DRA device: attributes from the mediator, its memory
    /// as capacity, tainted while its worker is down. None where a shared
    /// device has less than a share left to offer (an API server refuses a
    /// request policy whose least request exceeds the capacity).
    fn device(&self, d: &Device, ours: u64) -> Option<res::Device> {
        let mut attributes = BTreeMap::from([
            ("type".to_string(), attr_string(&d.kind)),
            ("pool".to_string(), attr_string(&d.pool)),
            ("isolation".to_string(), attr_string(&d.isolation)),
            ("driverVersion".to_string(), res::DeviceAttribute { version: Some(env!("CARGO_PKG_VERSION").into()), ..Default::default() }),
        ]);
        if d.numa_node >= 0 {
            attributes.insert("numaNode".into(), res::DeviceAttribute { int: Some(i64::from(d.numa_node)), ..Default::default() });
        }
        let offer = offered(d, ours);
        let (value, policy, multiple) = match self.sharing {
            // A device others filled is not offered: a claim given it could
            // never be prepared.
            Sharing::Exclusive if offer < SHARE_STEP => return None,
            Sharing::Exclusive => (offer, None, None),
            Sharing::Shared { default, min } => {
                let min = min.max(SHARE_STEP) / SHARE_STEP * SHARE_STEP;
                let value = offer / SHARE_STEP * SHARE_STEP;
                if value < min {
                    return None;
                }
                // A default is min plus whole steps, within the value;
                // min plus a step must fit too, or no step is given.
                let default = (default.clamp(min, value) - min) / SHARE_STEP * SHARE_STEP + min;
                let step = (min + SHARE_STEP <= value).then(|| Quantity(quantity::format(SHARE_STEP)));
                let policy = res::CapacityRequestPolicy {
                    default: Some(Quantity(quantity::format(default))),
                    valid_range: Some(res::CapacityRequestPolicyRange { min: Quantity(quantity::format(min)), step, max: None }),
                    valid_values: None,
                };
                (value, Some(policy), Some(true))
            }
        };
        let capacity = BTreeMap::from([("memory".to_string(), res::DeviceCapacity { value: Quantity(quantity::format(value)), request_policy: policy })]);
        let taints = (!d.running).then(|| vec![res::DeviceTaint { key: UNAVAILABLE_TAINT.into(), value: None, effect: "NoSchedule".into(), time_added: None }]);
        Some(res::Device { name: device_label(&d.name), attributes: Some(attributes), capacity: Some(capacity), allow_multiple_allocations: multiple, taints, ..Default::default() })
    }

    /// The node's slices: one pool named after the node, its devices in
    /// slices of at most [`MAX_DEVICES_PER_SLICE`], all of `generation`.
    /// `ours` is the memory this node's claims hold on each device.
    pub fn slices(&self, devices: &[Device], ours: &BTreeMap<String, u64>, generation: i64) -> Vec<res::ResourceSlice> {
        let mut seen = std::collections::BTreeSet::new();
        let devs: Vec<res::Device> = devices.iter().filter(|d| seen.insert(device_label(&d.name))).filter_map(|d| self.device(d, ours.get(&d.name).copied().unwrap_or(0))).collect();
        let chunks: Vec<&[res::Device]> = if devs.is_empty() { vec![&[]] } else { devs.chunks(MAX_DEVICES_PER_SLICE).collect() };
        let count = chunks.len() as i64;
        chunks
            .into_iter()
            .map(|chunk| res::ResourceSlice {
                metadata: ObjectMeta {
                    generate_name: Some(self.generate_name()),
                    owner_references: self.node_uid.as_ref().map(|uid| {
                        vec![OwnerReference { api_version: "v1".into(), kind: "Node".into(), name: self.node.clone(), uid: uid.clone(), controller: Some(true), block_owner_deletion: None }]
                    }),
                    ..Default::default()
                },
                spec: res::ResourceSliceSpec {
                    driver: self.driver.clone(),
                    pool: res::ResourcePool { name: self.node.clone(), generation, resource_slice_count: count },
                    node_name: Some(self.node.clone()),
                    devices: Some(chunk.to_vec()),
                    ..Default::default()
                },
            })
            .collect()
    }
}

/// What a claim's opaque configuration for this driver may set
/// (`apiVersion: vgpu.dev/v1`, `kind: TenantConfig`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TenantConfig {
    pub api_version: String,
    pub kind: String,
    /// The tenant's memory quota, a quantity (`4Gi`). With a shared
    /// device the claim's capacity request decides instead.
    pub memory: Option<String>,
    /// Its share of compute against the device's other tenants.
    pub weight: Option<u32>,
    /// The most of the device's compute it may take, in percent.
    pub cap: Option<u32>,
    /// `latency`, `normal` or `batch`.
    pub priority: Option<Priority>,
}

impl TenantConfig {
    /// Fields set in `later` override.
    fn merge(&mut self, later: TenantConfig) {
        self.memory = later.memory.or(self.memory.take());
        self.weight = later.weight.or(self.weight);
        self.cap = later.cap.or(self.cap);
        self.priority = later.priority.or(self.priority);
    }
}

/// Why a claim cannot be prepared: the kubelet shows it on the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("claim {0} is not allocated")]
    NotAllocated(String),
    #[error("claim {claim}: device {device} of pool {pool} is not one of this node's ({node})")]
    NotHere { claim: String, pool: String, device: String, node: String },
    #[error("claim {claim}: device {device} is not offered by the vGPU daemon (any more)")]
    NoDevice { claim: String, device: String },
    #[error("claim {claim}: its configuration for request {request} is not a {CONFIG_API_VERSION} {CONFIG_KIND}: {why}")]
    Config { claim: String, request: String, why: String },
    #[error("claim {claim}: request {request}: {why}")]
    Memory { claim: String, request: String, why: String },
    #[error("claim {claim}: {why}")]
    Limit { claim: String, why: String },
    #[error("claim {claim} allocates no device of this driver")]
    Nothing { claim: String },
    #[error("claim {claim} allocates {n} devices of this driver; at most {max}")]
    TooMany { claim: String, n: usize, max: usize },
}

/// What a claim's own configuration may ask, beyond which it is refused.
/// A DeviceClass's configuration is the admin's: what it sets is not
/// bounded by these, and it bounds the claim's in turn (a claim may lower
/// the class's weight or cap, or lower its priority, never raise them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimLimits {
    /// Most weight a claim may ask where its class sets none.
    pub max_weight: u32,
    /// Whether a claim may ask for the latency class where its class does
    /// not give it.
    pub latency: bool,
}

impl Default for ClaimLimits {
    fn default() -> ClaimLimits {
        ClaimLimits { max_weight: 100, latency: false }
    }
}

/// A priority class's rank: latency first.
fn rank(p: Priority) -> u8 {
    match p {
        Priority::Latency => 2,
        Priority::Normal => 1,
        Priority::Batch => 0,
    }
}

/// Checks a claim's own configuration against its class's and the limits.
fn within(class: &TenantConfig, claim: &TenantConfig, limits: ClaimLimits) -> Result<(), String> {
    if let Some(w) = claim.weight {
        let most = class.weight.unwrap_or(limits.max_weight);
        if w > most {
            return Err(format!("weight {w} is more than a claim may ask ({most}); a DeviceClass of the admin's may give more"));
        }
    }
    if let (Some(c), Some(most)) = (claim.cap, class.cap) {
        if c > most {
            return Err(format!("cap {c} is more than the class allows ({most})"));
        }
    }
    if let Some(p) = claim.priority {
        let most = class.priority.unwrap_or(if limits.latency { Priority::Latency } else { Priority::Normal });
        if rank(p) > rank(most) {
            return Err(format!("priority {} is above what a claim may ask ({}); a DeviceClass of the admin's may give it", p.as_str(), most.as_str()));
        }
    }
    Ok(())
}

/// Most devices of this driver one claim may hold here.
pub const MAX_DEVICES_PER_CLAIM: usize = 32;

/// One tenant a claim asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// The request's name (`gpu`, or `gpu/small` for a subrequest).
    pub request: String,
    /// The mediator's device, and its name in the slice.
    pub device: String,
    pub device_label: String,
    pub memory: u64,
    pub weight: u32,
    pub cap: Option<u32>,
    pub priority: Priority,
    pub share_id: Option<String>,
}

/// Whether a configuration entry's `requests` names `request` (none named:
/// every request; a subrequest `a/b` matches `a` too).
fn applies(requests: &Option<Vec<String>>, request: &str) -> bool {
    match requests {
        None => true,
        Some(r) if r.is_empty() => true,
        Some(r) => r.iter().any(|x| x == request || request.split_once('/').is_some_and(|(main, _)| main == x)),
    }
}

/// The tenants `claim`'s allocation asks of this node: one per device
/// result of `driver`, on `devices` (the mediator's).
pub fn plan(claim: &res::ResourceClaim, driver: &str, node: &str, devices: &[Device], limits: ClaimLimits) -> Result<Vec<Planned>, ClaimError> {
    let name = format!("{}/{}", claim.metadata.namespace.as_deref().unwrap_or(""), claim.metadata.name.as_deref().unwrap_or(""));
    let alloc = claim.status.as_ref().and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref()).ok_or_else(|| ClaimError::NotAllocated(name.clone()))?;
    let results: Vec<&res::DeviceRequestAllocationResult> = alloc.results.iter().flatten().filter(|r| r.driver == driver).collect();
    if results.is_empty() {
        return Err(ClaimError::Nothing { claim: name });
    }
    if results.len() > MAX_DEVICES_PER_CLAIM {
        return Err(ClaimError::TooMany { claim: name, n: results.len(), max: MAX_DEVICES_PER_CLAIM });
    }
    let mut planned = Vec::new();
    for r in results {
        if r.pool != node {
            return Err(ClaimError::NotHere { claim: name, pool: r.pool.clone(), device: r.device.clone(), node: node.into() });
        }
        let d = devices.iter().find(|d| device_label(&d.name) == r.device).ok_or_else(|| ClaimError::NoDevice { claim: name.clone(), device: r.device.clone() })?;
        if r.admin_access == Some(true) {
            return Err(ClaimError::Limit { claim: name.clone(), why: "admin access to a vGPU device is not supported (a tenant sees only its own work)".into() });
        }
        // The class's configurations first (the admin's), then the claim's,
        // which stay within the class's.
        let mut class_cfg = TenantConfig::default();
        let mut claim_cfg = TenantConfig::default();
        for c in alloc.config.iter().flatten().filter(|c| applies(&c.requests, &r.request)) {
            let Some(o) = c.opaque.as_ref().filter(|o| o.driver == driver) else { continue };
            let bad = |why: String| ClaimError::Config { claim: name.clone(), request: r.request.clone(), why };
            let t: TenantConfig = serde_json::from_value(o.parameters.0.clone()).map_err(|e| bad(e.to_string()))?;
            if t.api_version != CONFIG_API_VERSION || t.kind != CONFIG_KIND {
                return Err(bad(format!("apiVersion {:?} kind {:?}", t.api_version, t.kind)));
            }
            if c.source == "FromClass" {
                class_cfg.merge(t);
            } else {
                claim_cfg.merge(t);
            }
        }
        within(&class_cfg, &claim_cfg, limits).map_err(|why| ClaimError::Limit { claim: name.clone(), why })?;
        let claim_memory = claim_cfg.memory.clone();
        let mut cfg = class_cfg;
        cfg.merge(claim_cfg);
        let mem_err = |why: String| ClaimError::Memory { claim: name.clone(), request: r.request.clone(), why };
        let memory = if let Some(q) = r.consumed_capacity.as_ref().and_then(|c| c.get("memory")) {
            let consumed = quantity::parse(&q.0).map_err(|e| mem_err(format!("consumed capacity: {e}")))?;
            // On a shared device the scheduler counted what the claim
            // consumed: a quota the claim configures that differs would be
            // memory the scheduler does not know of. (A class's memory is
            // for whole devices.)
            if let Some(m) = &claim_memory {
                if quantity::parse(m).ok() != Some(consumed) {
                    return Err(mem_err(format!(
                        "the configuration asks for memory {m} but the device is shared and the claim was given {}: ask for it as the request's capacity (capacity.requests.memory)",
                        q.0
                    )));
                }
            }
            consumed
        } else if let Some(q) = &cfg.memory {
            quantity::parse(q).map_err(|e| mem_err(format!("configured memory: {e}")))?
        } else {
            // The device is the claim's alone: all the memory it offers.
            d.capacity.saturating_sub(d.reserved)
        };
        if memory == 0 {
            return Err(mem_err(format!("no memory: device {} has none free", r.device)));
        }
        let weight = cfg.weight.unwrap_or(1);
        vgpu_api::tenant::check_share("of the claim", weight, cfg.cap).map_err(|why| ClaimError::Config {
            claim: name.clone(),
            request: r.request.clone(),
            why: why.replacen("tenant of the claim: ", "", 1),
        })?;
        planned.push(Planned {
            request: r.request.clone(),
            device: d.name.clone(),
            device_label: r.device.clone(),
            memory,
            weight,
            cap: cfg.cap,
            priority: cfg.priority.unwrap_or_default(),
            share_id: r.share_id.clone(),
        });
    }
    Ok(planned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dev(name: &str, capacity: u64, reserved: u64, running: bool) -> Device {
        Device { name: name.into(), pool: "default".into(), kind: "cuda".into(), isolation: "process".into(), numa_node: 1, capacity, reserved, running }
    }

    fn claim(results: serde_json::Value, config: serde_json::Value) -> res::ResourceClaim {
        serde_json::from_value(json!({
            "metadata": { "name": "c", "namespace": "ns", "uid": "u" },
            "spec": {},
            "status": { "allocation": { "devices": { "results": results, "config": config } } },
        }))
        .unwrap()
    }

    #[test]
    fn slices_offer_what_others_leave_shared_or_whole_and_split_at_the_limit() {
        let p = Publisher { driver: "vgpu.dev".into(), node: "n1".into(), node_uid: Some("nu".into()), sharing: Sharing::Shared { default: 1 << 30, min: 1 << 20 } };
        // Others hold 16 MiB of gpu0 (48 reserved, 32 of them ours): 48 MiB
        // offered; a default above the value is cut to it.
        let s = p.slices(&[dev("gpu0", 64 << 20, 48 << 20, true), dev("MIG.1g/0", 8 << 20, 0, false)], &BTreeMap::from([("gpu0".into(), 32 << 20)]), 4);
        let [one] = &s[..] else { panic!("{s:?}") };
        assert_eq!((one.metadata.name.as_deref(), one.metadata.generate_name.as_deref()), (None, Some("n1-vgpu.dev-")));
        assert_eq!(one.metadata.owner_references.as_ref().unwrap()[0].uid, "nu");
        assert_eq!((one.spec.pool.name.as_str(), one.spec.pool.generation, one.spec.pool.resource_slice_count), ("n1", 4, 1));
        let devs = one.spec.devices.as_ref().unwrap();
        let mem = &devs[0].capacity.as_ref().unwrap()["memory"];
        assert_eq!(mem.value.0, "48Mi");
        assert_eq!(mem.request_policy.as_ref().unwrap().default.as_ref().unwrap().0, "48Mi");
        assert_eq!(devs[0].allow_multiple_allocations, Some(true));
        assert_eq!(devs[0].attributes.as_ref().unwrap()["numaNode"].int, Some(1));
        // A device's name becomes a DNS label; one whose worker is down is tainted.
        assert_eq!(devs[1].name, "mig-1g-0");
        assert_eq!(devs[1].taints.as_ref().unwrap()[0].key, UNAVAILABLE_TAINT);
        // Whole devices: no policy, no sharing.
        let whole = Publisher { sharing: Sharing::Exclusive, ..p.clone() };
        let d = &whole.slices(&[dev("gpu0", 64 << 20, 0, true)], &BTreeMap::new(), 1)[0].spec.devices.clone().unwrap()[0];
        assert_eq!((d.allow_multiple_allocations, d.capacity.as_ref().unwrap()["memory"].request_policy.is_none()), (None, true));
        // 100 devices: two slices of one pool, both counting two.
        let many: Vec<Device> = (0..100).map(|i| dev(&format!("cpu{i}"), 1 << 20, 0, true)).collect();
        let s = p.slices(&many, &BTreeMap::new(), 1);
        assert_eq!(s.len(), 2);
        assert_eq!(s.iter().map(|x| x.spec.devices.as_ref().unwrap().len()).collect::<Vec<_>>(), [64, 36]);
        assert!(s.iter().all(|x| x.spec.pool.resource_slice_count == 2));
        // A whole device others filled is not offered.
        assert!(whole.slices(&[dev("gpu0", 64 << 20, 64 << 20, true)], &BTreeMap::new(), 1)[0].spec.devices.as_ref().unwrap().is_empty());
        // A shared device with less than a share left leaves the slice; one
        // with a share but not a share and a step gets no step.
        let s = p.slices(&[dev("gpu0", 64 << 20, (63 << 20) + (512 << 10), true), dev("gpu1", 64 << 20, 63 << 20, true)], &BTreeMap::new(), 1);
        let devs = s[0].spec.devices.as_ref().unwrap();
        assert_eq!(devs.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["gpu1"]);
        let pol = devs[0].capacity.as_ref().unwrap()["memory"].request_policy.clone().unwrap();
        let range = pol.valid_range.clone().unwrap();
        assert_eq!((pol.default.unwrap().0.as_str(), range.min.0.as_str(), range.step), ("1Mi", "1Mi", None));
        // A larger least share: defaults are the least plus whole steps.
        let big = Publisher { sharing: Sharing::Shared { default: (3 << 20) + 5, min: 2 << 20 }, ..p.clone() };
        let d = &big.slices(&[dev("gpu0", 64 << 20, 0, true)], &BTreeMap::new(), 1)[0].spec.devices.clone().unwrap()[0];
        let pol = d.capacity.as_ref().unwrap()["memory"].request_policy.clone().unwrap();
        assert_eq!((pol.default.unwrap().0.as_str(), pol.valid_range.unwrap().min.0.as_str()), ("3Mi", "2Mi"));
        // No devices: one empty slice still says the pool is there.
        assert_eq!(p.slices(&[], &BTreeMap::new(), 1).len(), 1);
    }

    #[test]
    fn a_claim_plans_a_tenant_per_device_with_its_configuration() {
        let devices = [dev("gpu0", 64 << 20, 16 << 20, true), dev("gpu1", 64 << 20, 0, true)];
        let results = json!([
            { "request": "a", "driver": "vgpu.dev", "pool": "n1", "device": "gpu0", "consumedCapacity": { "memory": "8Mi" }, "shareID": "s1" },
            { "request": "b/small", "driver": "vgpu.dev", "pool": "n1", "device": "gpu1" },
            { "request": "c", "driver": "other.example.com", "pool": "x", "device": "y" },
        ]);
        let cfg = |p: serde_json::Value| json!({ "driver": "vgpu.dev", "parameters": p });
        let tc = |extra: serde_json::Value| {
            let mut v = json!({ "apiVersion": "vgpu.dev/v1", "kind": "TenantConfig" });
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            v
        };
        let config = |class: serde_json::Value, claim_b: serde_json::Value| {
            json!([
                { "source": "FromClass", "opaque": cfg(tc(class)) },
                { "source": "FromClaim", "requests": ["b"], "opaque": cfg(tc(claim_b)) },
            ])
        };
        let open = ClaimLimits { max_weight: 10, latency: true };
        let p = plan(&claim(results.clone(), config(json!({ "weight": 8, "memory": "4Mi" }), json!({ "weight": 5, "priority": "latency" }))), "vgpu.dev", "n1", &devices, open).unwrap();
        assert_eq!(p.len(), 2, "the other driver's device is not ours");
        // Consumed capacity decides the memory (the class's memory is for
        // whole devices); the class's weight applies.
        assert_eq!((p[0].memory, p[0].weight, p[0].share_id.as_deref(), p[0].priority), (8 << 20, 8, Some("s1"), Priority::Normal));
        // The claim's config for "b" (and so "b/small") lowers the class's weight.
        assert_eq!((p[1].memory, p[1].weight, p[1].priority, p[1].device.as_str()), (4 << 20, 5, Priority::Latency, "gpu1"));
        // A claim may not raise what its class sets, nor pass the limits
        // where the class sets nothing; a class is not bounded.
        let refused = |class: serde_json::Value, claim_b: serde_json::Value, limits: ClaimLimits| {
            plan(&claim(results.clone(), config(class, claim_b)), "vgpu.dev", "n1", &devices, limits).unwrap_err().to_string()
        };
        assert!(refused(json!({ "weight": 8 }), json!({ "weight": 9 }), open).contains("weight 9 is more than a claim may ask (8)"));
        assert!(refused(json!({}), json!({ "weight": 11 }), open).contains("weight 11 is more than a claim may ask (10)"));
        assert!(refused(json!({ "cap": 50 }), json!({ "cap": 60 }), open).contains("cap 60 is more than the class allows (50)"));
        assert!(refused(json!({ "priority": "batch" }), json!({ "priority": "normal" }), open).contains("priority normal is above what a claim may ask (batch)"));
        assert!(refused(json!({}), json!({ "priority": "latency" }), ClaimLimits { max_weight: 10, latency: false }).contains("priority latency is above"));
        let p = plan(&claim(results.clone(), config(json!({ "weight": 500, "priority": "latency" }), json!({}))), "vgpu.dev", "n1", &devices, ClaimLimits::default()).unwrap();
        assert_eq!((p[1].weight, p[1].priority), (500, Priority::Latency));
        // A claim's own memory on a shared device must be what it consumed.
        let mem = json!([{ "source": "FromClaim", "opaque": cfg(tc(json!({ "memory": "16Mi" }))) }]);
        assert!(plan(&claim(results.clone(), mem), "vgpu.dev", "n1", &devices, open).unwrap_err().to_string().contains("ask for it as the request's capacity"));
        // Admin access is refused.
        let admin = claim(json!([{ "request": "a", "driver": "vgpu.dev", "pool": "n1", "device": "gpu0", "adminAccess": true }]), json!([]));
        assert!(plan(&admin, "vgpu.dev", "n1", &devices, open).unwrap_err().to_string().contains("admin access"));
        // Whole, unconfigured: the device's free memory.
        let whole = claim(json!([{ "request": "a", "driver": "vgpu.dev", "pool": "n1", "device": "gpu0" }]), json!([]));
        assert_eq!(plan(&whole, "vgpu.dev", "n1", &devices, open).unwrap()[0].memory, 48 << 20);
        let full = [dev("gpu0", 64 << 20, 64 << 20, true)];
        assert!(matches!(plan(&whole, "vgpu.dev", "n1", &full, open), Err(ClaimError::Memory { .. })));
        // Bad configurations are refused by name.
        let bad = claim(
            json!([{ "request": "a", "driver": "vgpu.dev", "pool": "n1", "device": "gpu0" }]),
            json!([{ "source": "FromClaim", "opaque": cfg(json!({ "apiVersion": "vgpu.dev/v1", "kind": "TenantConfig", "cap": 101 })) }]),
        );
        assert!(plan(&bad, "vgpu.dev", "n1", &devices, open).unwrap_err().to_string().contains("cap must be a percentage"));
        let bad = claim(json!([{ "request": "a", "driver": "vgpu.dev", "pool": "n1", "device": "gpu0", "consumedCapacity": { "memory": "lots" } }]), json!([]));
        assert!(plan(&bad, "vgpu.dev", "n1", &devices, open).unwrap_err().to_string().contains("not a quantity"));
        let none = claim(json!([{ "request": "c", "driver": "other.example.com", "pool": "x", "device": "y" }]), json!([]));
        assert!(matches!(plan(&none, "vgpu.dev", "n1", &devices, open), Err(ClaimError::Nothing { .. })));
        let many: Vec<serde_json::Value> = (0..33).map(|_| json!({ "request": "a", "driver": "vgpu.dev", "pool": "n1", "device": "gpu0" })).collect();
        assert!(matches!(plan(&claim(json!(many), json!([])), "vgpu.dev", "n1", &devices, open), Err(ClaimError::TooMany { .. })));
    }
}
