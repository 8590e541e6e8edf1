//! The OpenAPI documents (docs/api/*.yaml) are generated from the API
//! types and routes (utoipa; the daemons' own tests fail while a committed
//! document differs from what they generate). These tests check that the
//! generation reads the types as serde does: every field a type serializes
//! is a property of its schema and every property a field; a schema
//! refuses unknown properties exactly when its type does; its `required`
//! list is what the type cannot do without; it takes null exactly where
//! the type does; its defaults are the type's and its enums the type's
//! variants. Response bodies are also checked as a daemon serves them.
//! (The served API against the documents is tests/api/conformance.py, with
//! schemathesis.)
//!
//! The documents are read with serde_yaml_ng, and checked to read the
//! same with PyYAML where target/apienv has it.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use vgpu_tests::*;

fn load(name: &str) -> Value {
    let path = workspace().join("docs/api").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `#/components/schemas/NAME`, or a property path below it
/// (`VmSpec/properties/vgpu`), with `$ref`s followed.
fn schema<'a>(doc: &'a Value, path: &str) -> &'a Value {
    let mut s = &doc["components"]["schemas"];
    for part in path.split('/') {
        s = deref(doc, &s[part]);
        assert!(!s.is_null(), "the document has no schema at {path} (missing {part})");
    }
    s
}

/// `{type: "null"}`, what OpenAPI 3.1 adds to a `oneOf` to make it
/// nullable.
fn is_null_schema(s: &Value) -> bool {
    s.get("type") == Some(&json!("null"))
}

/// Whether a property's schema takes null: `type: [T, "null"]`, or a
/// `oneOf` with a null member.
fn nullable(s: &Value) -> bool {
    s["type"].as_array().is_some_and(|t| t.contains(&json!("null"))) || s["oneOf"].as_array().is_some_and(|a| a.iter().any(is_null_schema))
}

/// Follows `$ref`s, and a `oneOf` of one schema (with null, or alone).
fn deref<'a>(doc: &'a Value, s: &'a Value) -> &'a Value {
    if let Some(one) = s.get("oneOf").and_then(Value::as_array) {
        let real: Vec<&Value> = one.iter().filter(|m| !is_null_schema(m)).collect();
        if let [only] = real.as_slice() {
            return deref(doc, only);
        }
    }
    match s.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let p = r.strip_prefix("#/").unwrap_or_else(|| panic!("external $ref {r}"));
            let mut t = doc;
            for part in p.split('/') {
                t = &t[part];
            }
            assert!(!t.is_null(), "dangling $ref {r}");
            deref(doc, t)
        }
        None => s,
    }
}

fn props(s: &Value) -> BTreeSet<String> {
    s["properties"].as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default()
}

/// The properties of a schema and of every member of its `allOf` (how a
/// flattened struct is documented).
fn all_props(doc: &Value, s: &Value) -> BTreeSet<String> {
    let mut all = props(s);
    for m in s["allOf"].as_array().into_iter().flatten() {
        all.extend(all_props(doc, deref(doc, m)));
    }
    all
}

fn all_required(doc: &Value, s: &Value) -> BTreeSet<String> {
    let mut all: BTreeSet<String> = s["required"].as_array().into_iter().flatten().filter_map(|r| r.as_str().map(String::from)).collect();
    for m in s["allOf"].as_array().into_iter().flatten() {
        all.extend(all_required(doc, deref(doc, m)));
    }
    all
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().unwrap_or_else(|| panic!("not an object: {v}")).keys().cloned().collect()
}

fn same_fields(what: &str, served: &BTreeSet<String>, documented: &BTreeSet<String>) {
    let undocumented: Vec<_> = served.difference(documented).collect();
    let unknown: Vec<_> = documented.difference(served).collect();
    assert!(undocumented.is_empty(), "{what}: fields the type has and the document does not: {undocumented:?}");
    assert!(unknown.is_empty(), "{what}: properties the document has and the type does not: {unknown:?}");
}

/// Equal as JSON, numbers compared as numbers (1 and 1.0 are the same).
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// A request body type against its schema, from a value with every field
/// set: the fields, `additionalProperties: false`, `required`, `nullable`,
/// defaults and enum values, each as serde treats them.
fn check_request<T: Serialize + DeserializeOwned>(doc: &Value, path: &str, full: &T) {
    let s = schema(doc, path);
    let v = serde_json::to_value(full).expect("serialize");
    same_fields(path, &keys(&v), &props(s));
    let back = |v: &Value| serde_json::from_value::<T>(v.clone());
    back(&v).unwrap_or_else(|e| panic!("{path}: the fully populated value does not read back: {e}"));

    let mut extra = v.clone();
    extra["no_such_field"] = json!(1);
    let refuses = back(&extra).is_err();
    let closed = s.get("additionalProperties") == Some(&json!(false));
    assert_eq!(
        closed,
        refuses,
        "{path}: the type {} unknown fields; the document must {}say additionalProperties: false",
        if refuses { "refuses" } else { "takes" },
        if refuses { "" } else { "not " }
    );

    let required: BTreeSet<String> = s["required"].as_array().map(|a| a.iter().filter_map(|r| r.as_str().map(String::from)).collect()).unwrap_or_default();
    for k in keys(&v) {
        let mut without = v.clone();
        without.as_object_mut().expect("object").remove(&k);
        let needed = back(&without).is_err();
        assert_eq!(
            needed,
            required.contains(&k),
            "{path}.{k}: the type {} it; the document {} it as required",
            if needed { "needs" } else { "does without" },
            if required.contains(&k) { "lists" } else { "does not list" }
        );
        // serde takes null for an Option: the document must say nullable.
        let mut null = v.clone();
        null[&k] = Value::Null;
        let takes_null = back(&null).is_ok();
        let nullable = nullable(&s["properties"][&k]);
        assert_eq!(takes_null, nullable, "{path}.{k}: the type {} null; the document {} it", if takes_null { "takes" } else { "refuses" }, if nullable { "takes" } else { "refuses" });
        if let Some(d) = s["properties"][&k].get("default") {
            // The value serde fills in, where it serializes one (an
            // Option's default is applied later, by the daemon).
            let filled = serde_json::to_value(back(&without).expect("reads without it")).expect("serialize");
            if let Some(got) = filled.get(&k) {
                assert!(same_value(got, d), "{path}.{k}: the document's default is {d}, the type's {got}");
            }
        }
        if let Some(values) = deref(doc, &s["properties"][&k]).get("enum").and_then(Value::as_array) {
            for e in values {
                let mut with = v.clone();
                with[&k] = e.clone();
                assert!(back(&with).is_ok(), "{path}.{k}: the document lists {e}, which the type refuses");
            }
        }
    }
}

/// An enum's schema against all its variants, as serde writes them.
fn check_enum<T: Serialize>(doc: &Value, path: &str, variants: &[T]) {
    let s = schema(doc, path);
    let listed = s["enum"].as_array().unwrap_or_else(|| panic!("{path} has no enum"));
    let documented: BTreeSet<String> = listed.iter().filter(|e| !e.is_null()).map(|e| e.as_str().expect("string enum").to_string()).collect();
    let typed: BTreeSet<String> = variants.iter().map(|v| serde_json::to_value(v).expect("serialize").as_str().expect("a string variant").to_string()).collect();
    same_fields(&format!("{path} (enum values)"), &typed, &documented);
}

fn values<T: clap::ValueEnum>() -> &'static [T] {
    T::value_variants()
}

/// A response body (fully populated, or as served) against its schema.
fn check_response(doc: &Value, path: &str, v: &Value) {
    same_fields(path, &keys(v), &all_props(doc, schema(doc, path)));
}

fn docs_path() -> PathBuf {
    workspace().join("docs/api")
}

/// The documents read the same with PyYAML (YAML 1.1, what the
/// conformance check's tools read them with) as here (YAML 1.2), where
/// target/apienv has it: no scalar whose meaning the two versions differ
/// on (`yes`, `0600`) slips in.
#[test]
fn the_documents_read_the_same_with_pyyaml() {
    let py = workspace().join("target/apienv/bin/python");
    if !py.exists() {
        eprintln!("note: {} is missing (scripts/setup.sh makes it); the documents are not compared with PyYAML", py.display());
        return;
    }
    for name in ["mediator.yaml", "vmm.yaml"] {
        let path = docs_path().join(name);
        let o = std::process::Command::new(&py).args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"]).arg(&path).output().expect("run python");
        assert!(o.status.success(), "PyYAML on {name}: {}", String::from_utf8_lossy(&o.stderr));
        let theirs: Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(load(name), theirs, "{name}: serde_yaml_ng and PyYAML read it differently");
    }
}

#[test]
fn mediator_request_schemas_match_the_api_types() {
    use vgpu_api::vm::{DiskSpec, Hugepages, NetSpec, RateSpec, RestartPolicy, VgpuSpec, VmSpec};
    use vgpu_mediator::config::{Owner, TenantKind, TenantSpec};
    use vgpu_mediator::control::pool::{Access, Placement, PoolChange, PoolSpec, Sharing};
    use vgpu_mediator::control::TenantChange;
    use vgpu_mediator::sched::Priority;
    use vgpu_mediator::size::Size;

    let doc = load("mediator.yaml");
    let rate = RateSpec { size: Size(1 << 20), refill_ms: 1000 };
    let vgpu = VgpuSpec { memory: Size(64 << 20), weight: 3, cap: Some(50), pool: Some("gpu-a".into()) };
    let vm = VmSpec {
        name: "vm1".into(),
        vcpus: 2,
        memory: Size(512 << 20),
        hugepages: Some(Hugepages::TwoMiB),
        kernel: Some("/boot/vmlinux".into()),
        initramfs: Some("/boot/initrd".into()),
        cmdline: Some("console=ttyS0".into()),
        boot_disk: Some("/var/lib/vgpu/boot.img".into()),
        disks: vec![DiskSpec { path: "/var/lib/vgpu/data.img".into(), read_only: true, direct: true, id: Some("data".into()), bandwidth: Some(rate), ops: Some(rate) }],
        // Both tap and bridge, so every field is there: serde takes it, the
        // daemon refuses it (exactly one of them).
        nets: vec![NetSpec {
            tap: Some("tap0".into()),
            bridge: Some("br0".into()),
            mac: Some("52:54:00:12:34:56".into()),
            rx_bandwidth: Some(rate),
            rx_ops: Some(rate),
            tx_bandwidth: Some(rate),
            tx_ops: Some(rate),
        }],
        vgpu: Some(vgpu.clone()),
        passthrough: vec!["whole".into()],
        restart: RestartPolicy::Always,
    };
    check_request(&doc, "VmSpec", &vm);
    check_request(&doc, "VmSpec/properties/vgpu", &vgpu);
    check_request(&doc, "VmSpec/properties/disks/items", &vm.disks[0]);
    check_enum(&doc, "VmSpec/properties/restart", values::<RestartPolicy>());
    // Every variant, so that a new one does not compile until it is added here.
    let hugepages = [Hugepages::None, Hugepages::TwoMiB, Hugepages::OneGiB];
    for h in hugepages {
        match h {
            Hugepages::None | Hugepages::TwoMiB | Hugepages::OneGiB => {}
        }
    }
    check_enum(&doc, "VmSpec/properties/hugepages", &hugepages);
    check_request(&doc, "VmSpec/properties/nets/items", &vm.nets[0]);
    check_request(&doc, "Rate", &rate);
    assert!(vm.nets[0].attach().is_err(), "an interface with a tap and a bridge is refused");

    let tenant = TenantSpec {
        name: "web".into(),
        memory: Size(256 << 20),
        weight: 2,
        cap: Some(40),
        priority: Priority::Latency,
        device: Some("cpu0".into()),
        pool: Some("default".into()),
        numa_node: Some(0),
        kind: TenantKind::Vm,
        owner: Some(Owner { uid: 1000, gid: 1000 }),
        mode: Some("0660".into()),
        host_memory: Some(Size(64 << 20)),
        max_connections: Some(8),
        hidden: true,
    };
    check_request(&doc, "TenantSpec", &tenant);
    check_enum(&doc, "TenantSpec/properties/priority", values::<Priority>());
    let kinds = [TenantKind::Process, TenantKind::Vm];
    for k in kinds {
        match k {
            TenantKind::Process | TenantKind::Vm => {}
        }
    }
    check_enum(&doc, "TenantSpec/properties/kind", &kinds);
    let change = TenantChange { weight: Some(5), cap: Some(100), priority: Some(Priority::Batch), memory: Some(Size(128 << 20)) };
    check_request(&doc, "TenantChange", &change);
    check_enum(&doc, "TenantChange/properties/priority", values::<Priority>());

    let pool = PoolSpec { name: "gpu-a".into(), devices: vec!["cpu1".into()], access: Access::Private, allow: vec!["web".into()], placement: Placement::Pack, overcommit: 2.0, sharing: Sharing::Mps };
    check_request(&doc, "PoolSpec", &pool);
    check_enum(&doc, "PoolSpec/properties/access", values::<Access>());
    check_enum(&doc, "PoolSpec/properties/sharing", values::<Sharing>());
    check_enum(&doc, "PoolSpec/properties/placement", values::<Placement>());
    let change = PoolChange { access: Some(Access::Public), allow: Some(vec!["web".into()]), placement: Some(Placement::Spread), overcommit: Some(1.5) };
    check_request(&doc, "PoolChange", &change);
    check_enum(&doc, "PoolChange/properties/access", values::<Access>());
    check_enum(&doc, "PoolChange/properties/placement", values::<Placement>());
}

#[test]
fn mediator_response_schemas_match_the_api_types() {
    use vgpu_api::vm::{Lease, RestartPolicy, VgpuSpec, VmSpec, VmState, VmView};
    use vgpu_mediator::config::Owner;
    use vgpu_mediator::control::meter::{Record, Usage};
    use vgpu_mediator::control::{TenantPhase, TenantRecord};
    use vgpu_mediator::ipc::TenantStats;
    use vgpu_mediator::sched::Priority;
    use vgpu_mediator::size::Size;

    let doc = load("mediator.yaml");
    let spec = VmSpec {
        name: "vm1".into(),
        vcpus: 1,
        memory: Size(512 << 20),
        hugepages: None,
        kernel: Some("/boot/vmlinux".into()),
        initramfs: None,
        cmdline: None,
        boot_disk: None,
        disks: Vec::new(),
        nets: Vec::new(),
        vgpu: Some(VgpuSpec { memory: Size(64 << 20), weight: 1, cap: None, pool: None }),
        passthrough: vec!["whole".into()],
        restart: RestartPolicy::OnFailure,
    };
    let vm = VmView {
        name: "vm1".into(),
        state: VmState::Running,
        desired: "running".into(),
        spec,
        device: "cpu0".into(),
        pool: "default".into(),
        numa_node: 0,
        passthrough: vec![Lease { device: "gpu1".into(), address: "0000:3b:00.0".into(), numa_node: 0 }],
        pid: 42,
        restarts: 1,
        last_exit: Some("exit 0".into()),
        error: Some("none".into()),
        api_socket: "/run/vgpu/vms/vm1.sock".into(),
        console_log: "/var/lib/vgpu/vms/vm1/console.log".into(),
    };
    check_response(&doc, "Vm", &serde_json::to_value(&vm).expect("serialize"));
    check_response(&doc, "Vm/properties/passthrough/items", &serde_json::to_value(&vm.passthrough[0]).expect("serialize"));

    use vgpu_mediator::control::passthrough::{PassView, ScrubMethod, ScrubRecord};
    let rec = ScrubRecord {
        device: "gpu1".into(),
        address: "0000:3b:00.0".into(),
        previous_vm: "vm1".into(),
        method: ScrubMethod::ZeroAndVerify,
        bytes: 79 << 30,
        device_memory: 80 << 30,
        started: 1_700_000_000,
        duration_ms: 4200,
        verified: false,
        ok: false,
        error: Some("read back a non-zero byte".into()),
    };
    check_response(&doc, "ScrubRecord", &serde_json::to_value(&rec).expect("serialize"));
    let methods = [ScrubMethod::ZeroAndVerify, ScrubMethod::FunctionReset];
    for m in methods {
        match m {
            ScrubMethod::ZeroAndVerify | ScrubMethod::FunctionReset => {}
        }
    }
    check_enum(&doc, "ScrubRecord/properties/method", &methods);
    let pv = PassView {
        name: "gpu1".into(),
        kind: "passthrough".into(),
        address: "0000:3b:00.0".into(),
        gpu: true,
        numa_node: 0,
        state: "quarantined".into(),
        lent_to: Some("vm1".into()),
        quarantine_reason: Some("scrub failed".into()),
        host_driver: Some("nvidia".into()),
        driver: Some("nvidia".into()),
        pool: "whole".into(),
        scrubs_ok: 1,
        scrubs_failed: 1,
        scrubs: vec![rec],
    };
    check_response(&doc, "PassthroughDevice", &serde_json::to_value(&pv).expect("serialize"));
    use vgpu_mediator::control::passthrough::PassState;
    let states = [PassState::Free, PassState::Lent { vm: String::new() }, PassState::Returning { vm: String::new() }, PassState::Quarantined { reason: String::new() }];
    for st in &states {
        match st {
            PassState::Free | PassState::Lent { .. } | PassState::Returning { .. } | PassState::Quarantined { .. } => {}
        }
    }
    let names: Vec<&str> = states.iter().map(PassState::name).collect();
    check_enum(&doc, "PassthroughDevice/properties/state", &names);
    let states = [VmState::Starting, VmState::Running, VmState::Stopping, VmState::Stopped, VmState::Restarting, VmState::Failed];
    for s in states {
        match s {
            VmState::Starting | VmState::Running | VmState::Stopping | VmState::Stopped | VmState::Restarting | VmState::Failed => {}
        }
    }
    check_enum(&doc, "Vm/properties/state", &states);

    let tenant = TenantRecord {
        name: "web".into(),
        kind: "process",
        memory: 1 << 30,
        weight: 2,
        cap: Some(50),
        priority: Priority::Normal,
        device: "cpu0".into(),
        pool: "default".into(),
        numa_node: 0,
        socket: "/run/vgpu/tenants/web.sock".into(),
        state: TenantPhase::Ready,
        owner: Some(Owner { uid: 1, gid: 1 }),
        mode: "0600".into(),
        host_memory: 1 << 28,
        max_connections: 64,
        hidden: true,
        env: [("CUPY_COMPILE_WITH_PTX".to_string(), "1".to_string())].into(),
    };
    check_response(&doc, "Tenant", &serde_json::to_value(&tenant).expect("serialize"));
    let phases = [TenantPhase::Creating, TenantPhase::Ready, TenantPhase::Deleting];
    for p in phases {
        match p {
            TenantPhase::Creating | TenantPhase::Ready | TenantPhase::Deleting => {}
        }
    }
    check_enum(&doc, "Tenant/properties/state", &phases);
    check_enum(&doc, "Tenant/properties/priority", values::<Priority>());
    let stats = TenantStats { name: "web".into(), cap: Some(50), ..TenantStats::default() };
    check_response(&doc, "TenantUsage", &serde_json::to_value(&stats).expect("serialize"));

    // Every kind of usage record, each one of the document's: its fields,
    // all of them required, and its `type`.
    let t = serde_json::to_value(Record::Tenant { start: 0.0, end: 60.0, tenant: "web".into(), device: "cpu0".into(), uuid: "u".into(), usage: Usage::default() }).expect("serialize");
    let d = serde_json::to_value(Record::Device { start: 0.0, end: 60.0, device: "cpu0".into(), uuid: "u".into(), model: "m".into(), busy_seconds: 1.0, lanes: 2 }).expect("serialize");
    let x = serde_json::to_value(Record::Deleted { at: 61.0, tenant: "web".into() }).expect("serialize");
    let kinds = schema(&doc, "UsageRecord")["oneOf"].as_array().expect("UsageRecord is one of its kinds");
    assert_eq!(kinds.len(), 3, "UsageRecord: three kinds");
    for (r, s) in [&t, &d, &x].into_iter().zip(kinds) {
        let s = deref(&doc, s);
        let what = format!("UsageRecord ({})", r["type"]);
        same_fields(&what, &keys(r), &all_props(&doc, s));
        same_fields(&format!("{what} (required)"), &keys(r), &all_required(&doc, s));
        let typed: Vec<&Value> = s["allOf"].as_array().into_iter().flatten().chain([s]).filter_map(|m| m["properties"]["type"]["enum"].as_array()).flatten().collect();
        assert_eq!(typed, vec![&r["type"]], "{what}: its type");
    }
}

/// The response bodies built from private types, as a daemon serves them.
#[test]
fn mediator_served_bodies_have_the_documented_fields() {
    let doc = load("mediator.yaml");
    let m = Mediator::start(&["--cpu-devices", "2", "--device-memory", "64MiB"]);
    let (st, v) = m.api("POST", "/pools", Some(json!({"name": "gpu-a", "devices": ["cpu1"], "access": "private", "allow": ["web"]})));
    assert_eq!(st, 201, "{v}");
    check_response(&doc, "Pool", &v);
    m.tenant("web", "16MiB");
    let (st, devices) = m.api("GET", "/devices", None);
    assert_eq!(st, 200, "{devices}");
    for d in devices.as_array().expect("devices") {
        check_response(&doc, "Device", d);
    }
    let (_, pools) = m.api("GET", "/pools", None);
    for p in pools.as_array().expect("pools") {
        let documented = all_props(&doc, schema(&doc, "Pool"));
        let served = keys(p);
        assert!(served.is_subset(&documented), "Pool: served fields the document lacks: {:?}", served.difference(&documented).collect::<Vec<_>>());
    }
    let (st, t) = m.api("GET", "/tenants/web", None);
    assert_eq!(st, 200, "{t}");
    check_response(&doc, "TenantUsage", &t["usage"]);
    let mut record = t.clone();
    record.as_object_mut().expect("object").remove("usage");
    let documented = all_props(&doc, schema(&doc, "Tenant"));
    assert!(keys(&record).is_subset(&documented), "GET /tenants/web: fields the document lacks: {:?}", keys(&record).difference(&documented).collect::<Vec<_>>());
    let (st, v) = m.api("GET", "/version", None);
    assert_eq!(st, 200, "{v}");
    check_response(&doc, "Version", &v);
    let (st, v) = m.api("GET", "/healthz", None);
    assert_eq!((st, v["status"].as_str(), v["devices_up"].as_u64()), (200, Some("ok"), Some(2)), "{v}");
    check_response(&doc, "Health", &v);
    // Unknown paths and wrong methods answer with an Error body too.
    for (method, path, code) in [("GET", "/nonsense", 404), ("DELETE", "/devices", 405), ("PUT", "/tenants/web", 405)] {
        let (st, v) = m.api(method, path, None);
        assert_eq!(st, code, "{method} {path}: {v}");
        check_response(&doc, "Error", &v);
        assert!(v["error"].as_str().is_some_and(|e| e.contains(path)), "{method} {path}: {v}");
    }
}

#[test]
fn vmm_schemas_match_the_vmm_types() {
    use vgpu_mediator::size::Size;
    use vmm::config::{DiskSpec, Hugepages, MacAddr, MemMiB, NetConfig, RateSpec, SerialOut, VgpuConfig, VmConfig};
    use vmm::vm::{RunState, VmInfo};

    let doc = load("vmm.yaml");
    let bucket = RateSpec { size: Size(10 << 20), refill_ms: 1000 };
    let disk = DiskSpec { path: "/var/lib/vgpu/root.img".into(), read_only: true, direct: true, id: Some("root".into()), bandwidth: Some(bucket), ops: Some(bucket) };
    let net =
        NetConfig { tap: "tap0".into(), mac: Some(MacAddr([0x52, 0x54, 0, 0x12, 0x34, 0x56])), rx_bandwidth: Some(bucket), rx_ops: Some(bucket), tx_bandwidth: Some(bucket), tx_ops: Some(bucket) };
    let vgpu = VgpuConfig { socket: "/run/vgpu/tenants/vm1.vhost".into(), headless: true, reconnect_s: 30 };
    let config = VmConfig {
        kernel: "/boot/vmlinux".into(),
        initramfs: Some("/boot/initrd".into()),
        cmdline: "console=ttyS0".into(),
        vcpus: 2,
        memory_mib: MemMiB(512),
        hugepages: Hugepages::TwoMiB,
        numa_node: Some(0),
        serial: SerialOut::File("/tmp/serial.log".into()),
        api_socket: Some("/run/vm1.sock".into()),
        rng: false,
        vgpu: Some(vgpu.clone()),
        disks: vec![disk.clone()],
        nets: vec![net.clone()],
        vfio: vec!["0000:00:04.0".parse().expect("a PCI address")],
    };
    check_request(&doc, "VmConfig", &config);
    check_request(&doc, "VmConfig/properties/vgpu", &vgpu);
    check_request(&doc, "VmConfig/properties/disks/items", &disk);
    check_request(&doc, "VmConfig/properties/nets/items", &net);
    check_request(&doc, "Rate", &bucket);

    let info = VmInfo { state: RunState::Running, config, vcpus: 2, memory_bytes: 512 << 20, memory_backing: "memfd", numa_node: Some(0), vcpu_cpus: Some(vec![0, 1]), pid: 1 };
    check_response(&doc, "VmInfo", &serde_json::to_value(&info).expect("serialize"));
    let states = [RunState::Running, RunState::Paused, RunState::Stopped];
    for s in states {
        match s {
            RunState::Running | RunState::Paused | RunState::Stopped => {}
        }
    }
    check_enum(&doc, "VmInfo/properties/state", &states);
}

#[test]
fn every_schema_reference_resolves_and_every_path_parameter_is_declared() {
    for name in ["mediator.yaml", "vmm.yaml"] {
        let doc = load(name);
        fn walk(doc: &Value, v: &Value, at: &str) {
            match v {
                Value::Object(m) => {
                    if let Some(r) = m.get("$ref") {
                        let _ = deref(doc, v);
                        assert!(r.is_string(), "{at}: $ref {r}");
                    }
                    for (k, x) in m {
                        walk(doc, x, &format!("{at}/{k}"));
                    }
                }
                Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| walk(doc, x, &format!("{at}/{i}"))),
                _ => {}
            }
        }
        walk(&doc, &doc, name);
        for (path, item) in doc["paths"].as_object().expect("paths") {
            let named: BTreeSet<String> = path.split('/').filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).map(String::from).collect();
            for (method, op) in item.as_object().expect("path item") {
                let params: BTreeSet<String> = [&item["parameters"], &op["parameters"]]
                    .into_iter()
                    .filter_map(Value::as_array)
                    .flatten()
                    .filter(|p| p["in"] == "path")
                    .map(|p| p["name"].as_str().expect("name").to_string())
                    .collect();
                assert_eq!(params, named, "{name} {method} {path}: path parameters");
            }
        }
    }
}
