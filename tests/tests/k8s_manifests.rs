//! The manifests vgpu-k8s ships (k8s/deploy/*.yaml) against the
//! Kubernetes API's own types (k8s-openapi, generated from the Kubernetes
//! OpenAPI document, here for Kubernetes 1.34): every document reads as
//! its kind's type, and written back it is the same document. So no field
//! is one the API does not have (a lenient API server drops a misspelled
//! field without a word), no value has the wrong type, and no required
//! field is missing. The container's flags are checked against the
//! packaged binary's own.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use vgpu_tests::{bin, workspace};

/// Values equal once the nulls and empty objects a writer leaves out are
/// gone on both sides.
fn normal(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.iter().filter(|(_, x)| !x.is_null()).map(|(k, x)| (k.clone(), normal(x))).collect()),
        Value::Array(a) => Value::Array(a.iter().map(normal).collect()),
        x => x.clone(),
    }
}

/// Reads `doc` as `T` and writes it back: the same document, or why not.
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.clone()).map_err(|e| format!("does not read as the API's type: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    if normal(&back) != normal(doc) {
        return Err(format!("is not the same written back (a field the API does not have?):\n  file: {doc}\n  API:  {back}"));
    }
    Ok(())
}

fn check(doc: &Value) -> Result<(), String> {
    match (doc["apiVersion"].as_str(), doc["kind"].as_str()) {
        (Some("apps/v1"), Some("DaemonSet")) => round_trip::<k8s_openapi::api::apps::v1::DaemonSet>(doc),
        (v, k) => Err(format!("no check for apiVersion {v:?} kind {k:?}")),
    }
}

fn manifests() -> Vec<(PathBuf, Value)> {
    let dir = workspace().join("k8s/deploy");
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).expect("k8s/deploy").map(|e| e.expect("entry").path()).filter(|p| p.extension().is_some_and(|x| x == "yaml")).collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read");
        for d in serde_yaml_ng::Deserializer::from_str(&text) {
            let v = Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if !v.is_null() {
                out.push((f.clone(), v));
            }
        }
    }
    out
}

#[test]
fn the_shipped_manifests_are_kubernetes_objects_as_the_api_types_define_them() {
    let docs = manifests();
    assert!(!docs.is_empty(), "k8s/deploy has no manifest");
    for (f, d) in &docs {
        check(d).unwrap_or_else(|e| panic!("{} ({} {}): {e}", f.display(), d["kind"], d["metadata"]["name"]));
    }
    // The check can fail: a misspelled field, a value of the wrong type and
    // a missing required field are each caught.
    let (_, ds) = docs.iter().find(|(_, d)| d["kind"] == "DaemonSet").expect("a DaemonSet");
    let mut typo = ds.clone();
    typo["spec"]["template"]["spec"]["nodeSelektor"] = serde_json::json!({ "a": "b" });
    assert!(check(&typo).is_err(), "a misspelled field passed");
    let mut wrong = ds.clone();
    wrong["spec"]["template"]["spec"]["containers"][0]["args"] = serde_json::json!("device-plugin");
    assert!(check(&wrong).is_err(), "a string where a list goes passed");
    let mut missing = ds.clone();
    missing["spec"].as_object_mut().expect("spec").remove("selector");
    assert!(check(&missing).is_err(), "a DaemonSet without its selector passed");
}

#[test]
fn the_daemonset_runs_vgpu_k8s_with_flags_it_has_and_mounts_what_they_name() {
    let docs = manifests();
    let (_, ds) = docs.iter().find(|(_, d)| d["kind"] == "DaemonSet").expect("a DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"].as_array().expect("args").iter().map(|a| a.as_str().expect("string")).collect();
    assert_eq!(args.first(), Some(&"device-plugin"));
    let help = std::process::Command::new(bin("vgpu-k8s")).args(["device-plugin", "--help"]).output().expect("vgpu-k8s --help");
    let help = String::from_utf8_lossy(&help.stdout);
    let mounts: Vec<(&str, &str)> = c["volumeMounts"].as_array().expect("mounts").iter().map(|m| (m["name"].as_str().expect("name"), m["mountPath"].as_str().expect("path"))).collect();
    let volumes: Vec<&str> = pod["volumes"].as_array().expect("volumes").iter().map(|v| v["name"].as_str().expect("name")).collect();
    for (name, _) in &mounts {
        assert!(volumes.contains(name), "volume mount {name} names no volume");
    }
    for a in &args[1..] {
        let (flag, value) = a.split_once('=').unwrap_or((a, ""));
        assert!(help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")), "{flag} is not a flag of vgpu-k8s device-plugin:\n{help}");
        // Every directory a flag names is mounted in the container.
        if flag.ends_with("-dir") {
            assert!(mounts.iter().any(|(_, p)| Path::new(value).starts_with(p) || Path::new(p).starts_with(value)), "{flag}={value} is not mounted: {mounts:?}");
        }
    }
    // The resources parse as the plugin parses them.
    for r in args.iter().filter_map(|a| a.strip_prefix("--resource=")) {
        r.parse::<vgpu_k8s::slices::Resource>().unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(c["command"][0], "/host/usr/bin/vgpu-k8s");
}
