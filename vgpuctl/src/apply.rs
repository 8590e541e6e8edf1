//! `vgpuctl apply -f FILE`: tenants, pools and VMs described in a file
//! (YAML or JSON, one object, a list, or several YAML documents) are made
//! when missing and brought to the description when they exist.
//!
//! An object is the API's create body with a `kind` (`tenant`, `pool` or
//! `vm`, or `vm-tenant` for a VM tenant whose VMM the operator runs); a
//! VM may also say `state: running|stopped`. A field equal to the
//! live value (sizes compared in bytes) is left alone; one that differs is
//! changed where the API can change it on a live object (a tenant's
//! weight, cap, priority and quota; a pool's access, allow-list,
//! placement and overcommit; a VM's state) and refused otherwise, naming
//! the fields. Every object is checked before any request; each one's
//! outcome is printed, and one that fails does not stop the others.

use serde::Deserialize;
use serde_json::{json, Map, Value};
use vgpu_api::pool::PoolSpec;
use vgpu_api::tenant::TenantSpec;
use vgpu_api::vm::VmSpec;
use vgpu_api::{http, Size};

use crate::{call, call_waiting, Cli, Usage, STOP_WAIT};

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Tenant,
    Pool,
    Vm,
}

impl Kind {
    fn parse(s: &str) -> Option<Kind> {
        match s.to_ascii_lowercase().as_str() {
            "tenant" => Some(Kind::Tenant),
            "pool" => Some(Kind::Pool),
            "vm" => Some(Kind::Vm),
            _ => None,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Kind::Tenant => "tenant",
            Kind::Pool => "pool",
            Kind::Vm => "vm",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Kind::Tenant => "/v1/tenants",
            Kind::Pool => "/v1/pools",
            Kind::Vm => "/v1/vms",
        }
    }

    /// The fields `PATCH` changes on a live object.
    fn changeable(self) -> &'static [&'static str] {
        match self {
            Kind::Tenant => &["weight", "cap", "priority", "memory"],
            Kind::Pool => &["access", "allow", "placement", "overcommit"],
            Kind::Vm => &[],
        }
    }
}

/// One object of the file, checked.
struct Planned {
    kind: Kind,
    name: String,
    /// The create body: the object without `kind` (and a VM's `state`).
    body: Value,
    /// A VM's wanted state.
    state: Option<String>,
}

/// The objects in `text`: YAML documents (JSON is YAML too), each an
/// object or a list of them.
fn documents(text: &str) -> Result<Vec<Value>, Usage> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        match Value::deserialize(doc).map_err(|e| Usage(format!("document {} is not YAML or JSON: {e}", i + 1)))? {
            Value::Null => {}
            Value::Array(items) => out.extend(items),
            v => out.push(v),
        }
    }
    if out.is_empty() {
        return Err(Usage("the file describes nothing".into()));
    }
    Ok(out)
}

fn plan(i: usize, v: Value) -> Result<Planned, Usage> {
    let at = |msg: String| Usage(format!("object {}: {msg}", i + 1));
    let Value::Object(mut o) = v else { return Err(at("not an object with a kind and a name".into())) };
    let kind = match o.remove("kind") {
        // A tenant for a VM the operator runs (its body's own `kind`,
        // which the object's kind would otherwise hide).
        Some(Value::String(k)) if k.eq_ignore_ascii_case("vm-tenant") => {
            o.insert("kind".into(), "vm".into());
            Kind::Tenant
        }
        Some(Value::String(k)) => Kind::parse(&k).ok_or_else(|| at(format!("kind {k:?} is none of tenant, vm-tenant, pool, vm")))?,
        _ => return Err(at("no kind (tenant, vm-tenant, pool or vm)".into())),
    };
    let name = o.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| at(format!("a {} needs a name", kind.word())))?.to_string();
    let state = match (kind, o.remove("state")) {
        (_, None) => None,
        (Kind::Vm, Some(Value::String(s))) if s == "running" || s == "stopped" => Some(s),
        (Kind::Vm, Some(s)) => return Err(at(format!("vm {name}: state must be running or stopped, not {s}"))),
        (k, Some(_)) => return Err(at(format!("{} {name}: only a vm has a state", k.word()))),
    };
    let body = Value::Object(o);
    // Read as the API's own types and checked as the daemon checks them,
    // so a bad object is refused here, before anything is sent.
    let bad = |e: String| at(format!("{} {name}: {e}", kind.word()));
    match kind {
        Kind::Tenant => serde_json::from_value::<TenantSpec>(body.clone()).map_err(|e| bad(e.to_string()))?.validate().map_err(bad)?,
        Kind::Pool => serde_json::from_value::<PoolSpec>(body.clone()).map_err(|e| bad(e.to_string()))?.validate().map_err(bad)?,
        Kind::Vm => {
            let vm = serde_json::from_value::<VmSpec>(body.clone()).map_err(|e| bad(e.to_string()))?;
            vgpu_api::tenant::validate_name(&vm.name).map_err(|e| bad(e.replace("tenant name", "VM name")))?;
        }
    }
    Ok(Planned { kind, name, body, state })
}

/// Whether `want` (from the file) describes `live` (from the API): every
/// field given is equal, sizes in bytes; fields not given are not looked at.
fn matches(want: &Value, live: &Value) -> bool {
    match (want, live) {
        (Value::Object(w), Value::Object(l)) => w.iter().all(|(k, wv)| matches(wv, l.get(k).unwrap_or(&Value::Null))),
        (Value::Array(w), Value::Array(l)) => w.len() == l.len() && w.iter().zip(l).all(|(a, b)| matches(a, b)),
        (Value::String(w), Value::Number(l)) => w.parse::<Size>().is_ok_and(|s| Some(s.0) == l.as_u64()),
        (Value::Number(w), Value::Number(l)) => w.as_f64() == l.as_f64(),
        _ => want == live,
    }
}

/// What happened to one object.
fn outcome(p: &Planned, action: &str, changed: &[String]) -> Value {
    json!({ "kind": p.kind.word(), "name": p.name, "action": action, "changed": changed })
}

fn apply_one(cli: &Cli, p: &Planned) -> anyhow::Result<Value> {
    let api = cli.api.clone().unwrap_or_else(|| cli.run_dir.join("api.sock"));
    let path = format!("{}/{}", p.kind.path(), p.name);
    let r = http::request(&api, "GET", &path, None)?;
    if r.status == 404 {
        call(cli, "POST", p.kind.path(), Some(p.body.clone()))?;
        if p.state.as_deref() == Some("stopped") {
            call_waiting(&api, "POST", &format!("{path}/stop"), None, STOP_WAIT)?;
            return Ok(outcome(p, "created", &["state".into()]));
        }
        return Ok(outcome(p, "created", &[]));
    }
    let live: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    if !(200..300).contains(&r.status) {
        anyhow::bail!("{} (HTTP {})", live.get("error").and_then(Value::as_str).unwrap_or("reading it failed"), r.status);
    }
    let current = if p.kind == Kind::Vm { &live["spec"] } else { &live };
    let mut patch = Map::new();
    let mut fixed = Vec::new();
    for (k, want) in p.body.as_object().into_iter().flatten() {
        let now = current.get(k).unwrap_or(&Value::Null);
        // A tenant without a cap reads as none; 100 % is none too.
        let uncapped = p.kind == Kind::Tenant && k == "cap" && now.is_null() && want.as_f64() == Some(100.0);
        // A flag left out of the live record is off.
        let off = want == &Value::Bool(false) && now.is_null();
        // A socket mode is its bits, however many digits say them.
        let octal = |v: &Value| v.as_str().and_then(|m| u32::from_str_radix(m, 8).ok());
        let same_mode = p.kind == Kind::Tenant && k == "mode" && octal(want).is_some() && octal(want) == octal(now);
        // A NUMA node asked for is a preference for placement, not a
        // property of the tenant placed.
        let preference = p.kind == Kind::Tenant && k == "numa_node";
        if k == "name" || uncapped || off || same_mode || preference || matches(want, now) {
            continue;
        }
        if p.kind.changeable().contains(&k.as_str()) {
            patch.insert(k.clone(), want.clone());
        } else {
            fixed.push(k.clone());
        }
    }
    if !fixed.is_empty() {
        anyhow::bail!("{} cannot change on a live {}: delete it and apply the file again", fixed.join(", "), p.kind.word());
    }
    let mut changed: Vec<String> = patch.keys().cloned().collect();
    if !patch.is_empty() {
        call(cli, "PATCH", &path, Some(Value::Object(patch)))?;
    }
    if let Some(want) = &p.state {
        if live.get("desired").and_then(Value::as_str) != Some(want.as_str()) {
            let verb = if want == "running" { "start" } else { "stop" };
            call_waiting(&api, "POST", &format!("{path}/{verb}"), None, STOP_WAIT)?;
            changed.push("state".into());
        }
    }
    Ok(outcome(p, if changed.is_empty() { "unchanged" } else { "configured" }, &changed))
}

/// Applies the file `file` (`-`: standard input).
pub fn apply(cli: &Cli, file: &std::path::Path) -> anyhow::Result<()> {
    let text = if file == std::path::Path::new("-") {
        std::io::read_to_string(std::io::stdin()).map_err(|e| anyhow::anyhow!("reading standard input: {e}"))?
    } else {
        std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("reading {}: {e}", file.display()))?
    };
    let planned = documents(&text)?.into_iter().enumerate().map(|(i, v)| plan(i, v)).collect::<Result<Vec<_>, _>>()?;
    let mut done = Vec::new();
    let mut failed = 0;
    for p in &planned {
        match apply_one(cli, p) {
            Ok(o) => {
                if !cli.output.data() {
                    let changed: Vec<&str> = o["changed"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
                    let what = if changed.is_empty() || o["action"] == "created" { String::new() } else { format!(" ({})", changed.join(", ")) };
                    println!("{}/{} {}{what}", p.kind.word(), p.name, o["action"].as_str().unwrap_or(""));
                }
                done.push(o);
            }
            Err(e) => {
                eprintln!("vgpuctl: {}/{}: {e}", p.kind.word(), p.name);
                failed += 1;
            }
        }
    }
    if cli.output.data() {
        cli.output.print(&Value::Array(done));
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {} objects were not applied", planned.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_compare_in_bytes_and_unmentioned_fields_are_not_compared() {
        let live = json!({ "name": "web", "memory": 67108864, "weight": 3, "spec": { "vcpus": 2 } });
        assert!(matches(&json!({ "memory": "64MiB", "weight": 3 }), &live));
        assert!(!matches(&json!({ "memory": "32MiB" }), &live));
        assert!(matches(&json!({ "spec": { "vcpus": 2 } }), &live));
        assert!(!matches(&json!({ "overcommit": 1 }), &json!({ "overcommit": 1.5 })));
        assert!(matches(&json!({ "overcommit": 1 }), &json!({ "overcommit": 1.0 })));
    }

    #[test]
    fn files_are_checked_before_anything_is_sent() {
        let docs = documents("kind: tenant\nname: a\nmemory: 64MiB\n---\n- kind: pool\n  name: p\n  devices: [cpu0]\n").expect("two documents");
        assert_eq!(docs.len(), 2);
        assert!(documents("").is_err());
        assert!(documents("kind: [").is_err());
        assert!(plan(0, json!({ "kind": "printer", "name": "x" })).is_err());
        assert!(plan(0, json!({ "kind": "tenant" })).is_err());
        assert!(plan(0, json!({ "kind": "tenant", "name": "x", "state": "running" })).is_err());
        assert!(plan(0, json!({ "kind": "vm", "name": "x", "state": "paused" })).is_err());
        let p = plan(0, json!({ "kind": "VM", "name": "x", "state": "stopped", "vcpus": 1, "memory": "64MiB", "kernel": "/k" })).expect("a vm");
        assert!(p.kind == Kind::Vm && p.state.as_deref() == Some("stopped") && p.body == json!({ "name": "x", "vcpus": 1, "memory": "64MiB", "kernel": "/k" }));
        // The API's types and checks, before any request, in the user's terms.
        let refused = |v: Value| match plan(0, v) {
            Err(Usage(e)) => e,
            Ok(_) => panic!("accepted"),
        };
        assert!(refused(json!({ "kind": "tenant", "name": "a", "memory": "lots" })).contains("invalid size 'lots'"));
        assert!(refused(json!({ "kind": "tenant", "name": "a", "memory": "64MiB", "gpu": 1 })).contains("unknown field `gpu`"));
        assert!(refused(json!({ "kind": "tenant", "name": "a", "memory": "64MiB", "weight": 0 })).contains("weight must be 1..=10000"));
        assert!(refused(json!({ "kind": "pool", "name": "p", "devices": [] })).contains("at least one device"));
        assert!(refused(json!({ "kind": "vm", "name": "bad name", "memory": "64MiB", "kernel": "/k" })).contains("invalid VM name"));
        assert!(refused(json!({ "kind": "vm", "name": "x", "kernel": "/k" })).contains("missing field `memory`"));
    }
}
