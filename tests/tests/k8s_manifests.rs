//! The manifests vgpu-k8s ships (k8s/deploy/*.yaml) against the
//! Kubernetes API's own types (k8s-openapi, generated from the Kubernetes
//! OpenAPI document, here for Kubernetes 1.34): every document reads as
//! its kind's type, and written back it is the same document. So no field
//! is one the API does not have (a lenient API server drops a misspelled
//! field without a word), no value has the wrong type, and no required
//! field is missing. The container's flags are checked against the
//! packaged binary's own.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use vgpu_tests::k8s::round_trip;
use vgpu_tests::{bin, workspace};

fn check(doc: &Value) -> Result<(), String> {
    match (doc["apiVersion"].as_str(), doc["kind"].as_str()) {
        (Some("apps/v1"), Some("DaemonSet")) => round_trip::<k8s_openapi::api::apps::v1::DaemonSet>(doc).map(drop),
        (Some("v1"), Some("ServiceAccount")) => round_trip::<k8s_openapi::api::core::v1::ServiceAccount>(doc).map(drop),
        (Some("v1"), Some("Pod")) => round_trip::<k8s_openapi::api::core::v1::Pod>(doc).map(drop),
        (Some("rbac.authorization.k8s.io/v1"), Some("ClusterRole")) => round_trip::<k8s_openapi::api::rbac::v1::ClusterRole>(doc).map(drop),
        (Some("rbac.authorization.k8s.io/v1"), Some("ClusterRoleBinding")) => round_trip::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>(doc).map(drop),
        (Some("admissionregistration.k8s.io/v1"), Some("ValidatingAdmissionPolicy")) => round_trip::<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy>(doc).map(drop),
        (Some("admissionregistration.k8s.io/v1"), Some("ValidatingAdmissionPolicyBinding")) => {
            round_trip::<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding>(doc).map(drop)
        }
        (Some("resource.k8s.io/v1"), Some("DeviceClass")) => round_trip::<k8s_openapi::api::resource::v1::DeviceClass>(doc).map(drop),
        (Some("resource.k8s.io/v1"), Some("ResourceClaim")) => round_trip::<k8s_openapi::api::resource::v1::ResourceClaim>(doc).map(drop),
        (Some("resource.k8s.io/v1"), Some("ResourceClaimTemplate")) => round_trip::<k8s_openapi::api::resource::v1::ResourceClaimTemplate>(doc).map(drop),
        (v, k) => Err(format!("no check for apiVersion {v:?} kind {k:?}")),
    }
}

/// The YAML files under `dir`, at any depth.
fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("entry").path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
}

/// Every document of every manifest and example in k8s/deploy.
fn manifests() -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    let mut files = Vec::new();
    yaml_files(&workspace().join("k8s/deploy"), &mut files);
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
fn each_daemonset_runs_vgpu_k8s_with_flags_it_has_and_mounts_what_they_name() {
    let docs = manifests();
    let daemonsets: Vec<&Value> = docs.iter().map(|(_, d)| d).filter(|d| d["kind"] == "DaemonSet").collect();
    let commands: Vec<&str> = daemonsets.iter().map(|d| d["spec"]["template"]["spec"]["containers"][0]["args"][0].as_str().expect("a subcommand")).collect();
    assert_eq!(commands, ["device-plugin", "dra-driver"], "a DaemonSet for each of the node component's jobs");
    for ds in daemonsets {
        let pod = &ds["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let args: Vec<&str> = c["args"].as_array().expect("args").iter().map(|a| a.as_str().expect("string")).collect();
        let help = std::process::Command::new(bin("vgpu-k8s")).args([args[0], "--help"]).output().expect("vgpu-k8s --help");
        let help = String::from_utf8_lossy(&help.stdout);
        let mounts: Vec<(&str, &str)> = c["volumeMounts"].as_array().expect("mounts").iter().map(|m| (m["name"].as_str().expect("name"), m["mountPath"].as_str().expect("path"))).collect();
        let volumes: Vec<&str> = pod["volumes"].as_array().expect("volumes").iter().map(|v| v["name"].as_str().expect("name")).collect();
        for (name, _) in &mounts {
            assert!(volumes.contains(name), "volume mount {name} names no volume");
        }
        for a in &args[1..] {
            let (flag, value) = a.split_once('=').unwrap_or((a, ""));
            assert!(help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")), "{flag} is not a flag of vgpu-k8s {}:\n{help}", args[0]);
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
        if args[0] == "dra-driver" {
            // The kubelet's DRA directories are mounted where the driver
            // puts its sockets, and the node's name comes from the pod.
            for dir in ["/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins"] {
                assert!(mounts.iter().any(|(_, p)| *p == dir), "{dir} is not mounted: {mounts:?}");
            }
            let env = c["env"].as_array().expect("env");
            assert!(env.iter().any(|e| e["name"] == "NODE_NAME" && e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"), "NODE_NAME from spec.nodeName: {env:?}");
            assert!(!pod["serviceAccountName"].is_null(), "the driver runs as its service account");
        }
    }
}

#[test]
fn the_dra_driver_can_do_what_it_does_and_its_class_and_examples_name_it() {
    let docs = manifests();
    let find = |kind: &str| docs.iter().map(|(_, d)| d).filter(|d| d["kind"] == kind).collect::<Vec<_>>();
    let ds = find("DaemonSet").into_iter().find(|d| d["spec"]["template"]["spec"]["containers"][0]["args"][0] == "dra-driver").expect("the DRA DaemonSet");
    let args: Vec<&str> = ds["spec"]["template"]["spec"]["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let driver = args.iter().find_map(|a| a.strip_prefix("--driver-name=")).unwrap_or("vgpu.dev");
    // Its service account's role allows every call the driver makes.
    let sa = ds["spec"]["template"]["spec"]["serviceAccountName"].as_str().unwrap();
    let binding = find("ClusterRoleBinding")
        .into_iter()
        .find(|b| b["subjects"].as_array().unwrap().iter().any(|s| s["name"] == sa && s["namespace"] == ds["metadata"]["namespace"]))
        .expect("a binding of the service account");
    let role = find("ClusterRole").into_iter().find(|r| r["metadata"]["name"] == binding["roleRef"]["name"]).expect("the bound role");
    let allowed = |group: &str, resource: &str, verb: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            let has = |k: &str, v: &str| r[k].as_array().unwrap().iter().any(|x| x == v || x == "*");
            has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
        })
    };
    for verb in ["get", "list", "create", "update", "delete"] {
        assert!(allowed("resource.k8s.io", "resourceslices", verb), "resourceslices {verb}");
    }
    assert!(allowed("resource.k8s.io", "resourceclaims", "get") && allowed("", "nodes", "get"));
    // And no more: exactly those rules, nothing by wildcard.
    let granted: usize =
        role["rules"].as_array().unwrap().iter().map(|r| r["apiGroups"].as_array().unwrap().len() * r["resources"].as_array().unwrap().len() * r["verbs"].as_array().unwrap().len()).sum();
    assert_eq!(granted, 7, "the role grants more than the driver's seven calls: {role}");
    assert!(!role.to_string().contains('*'), "a wildcard in the role");
    // The admission policy holds each node's driver to its own node's
    // slices of this driver: it matches the driver's service account, and
    // its binding denies.
    let policies = find("ValidatingAdmissionPolicy");
    let [policy] = &policies[..] else { panic!("one admission policy: {policies:?}") };
    let user = format!("system:serviceaccount:{}:{sa}", ds["metadata"]["namespace"].as_str().unwrap());
    assert_eq!(policy["spec"]["matchConditions"][0]["expression"], format!("request.userInfo.username == \"{user}\""));
    let rules = policy["spec"]["validations"].to_string();
    assert!(rules.contains("authentication.kubernetes.io/node-name") || policy["spec"]["variables"].to_string().contains("authentication.kubernetes.io/node-name"));
    assert!(rules.contains(&format!("variables.slice.spec.driver == \\\"{driver}\\\"")), "{rules}");
    assert!(rules.contains("variables.slice.spec.pool.name == variables.nodeName"), "{rules}");
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    let bindings = find("ValidatingAdmissionPolicyBinding");
    assert!(bindings.iter().any(|b| b["spec"]["policyName"] == policy["metadata"]["name"] && b["spec"]["validationActions"] == serde_json::json!(["Deny"])), "{bindings:?}");
    // The class selects the driver's devices.
    let classes = find("DeviceClass");
    let [class] = &classes[..] else { panic!("one DeviceClass: {classes:?}") };
    assert_eq!(class["spec"]["selectors"][0]["cel"]["expression"], format!("device.driver == \"{driver}\""));
    // The examples ask for that class, and the driver prepares them as the
    // DaemonSet runs it, whether the cluster shares devices (the scheduler
    // gives each request the capacity it asks, or the class's default) or
    // gives them whole.
    let flag = |name: &str| args.iter().find_map(|a| a.strip_prefix(&format!("--{name}=")));
    let limits = vgpu_k8s::claims::ClaimLimits { max_weight: flag("claim-max-weight").map_or(100, |w| w.parse().unwrap()), latency: args.contains(&"--claim-latency") };
    let default_share: vgpu_api::Size = flag("default-share").unwrap_or("1GiB").parse().unwrap();
    let gpu = vgpu_k8s::slices::Device { name: "gpu0".into(), pool: "default".into(), kind: "cuda".into(), isolation: "process".into(), numa_node: 0, capacity: 80 << 30, reserved: 0, running: true };
    let examples: Vec<&Value> = find("ResourceClaim").into_iter().map(|c| &c["spec"]).chain(find("ResourceClaimTemplate").into_iter().map(|t| &t["spec"]["spec"])).collect();
    for spec in &examples {
        for shared in [true, false] {
            let results: Vec<Value> = spec["devices"]["requests"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    let mut res = serde_json::json!({ "request": r["name"], "driver": driver, "pool": "n1", "device": "gpu0" });
                    if shared {
                        let asked = r["exactly"]["capacity"]["requests"]["memory"].as_str().map(String::from).unwrap_or_else(|| vgpu_k8s::quantity::format(default_share.0));
                        res["consumedCapacity"] = serde_json::json!({ "memory": asked });
                    }
                    res
                })
                .collect();
            let config: Vec<Value> =
                spec["devices"]["config"].as_array().unwrap().iter().map(|c| serde_json::json!({ "source": "FromClaim", "requests": c["requests"], "opaque": c["opaque"] })).collect();
            let claim = serde_json::json!({ "metadata": { "name": "example", "namespace": "ns", "uid": "u" }, "spec": spec, "status": { "allocation": { "devices": { "results": results, "config": config } } } });
            let claim: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(claim).unwrap();
            let planned = vgpu_k8s::claims::plan(&claim, driver, "n1", std::slice::from_ref(&gpu), limits).unwrap_or_else(|e| panic!("the example {spec} is refused (shared: {shared}): {e}"));
            assert!(planned.iter().all(|p| p.memory < 80 << 30), "an example takes a whole GPU: {planned:?}");
        }
    }
    // Their configuration is what the driver reads.
    let claims: Vec<&Value> = find("ResourceClaim").into_iter().map(|c| &c["spec"]).chain(find("ResourceClaimTemplate").into_iter().map(|t| &t["spec"]["spec"])).collect();
    assert!(claims.len() >= 2, "example claims");
    for spec in claims {
        for r in spec["devices"]["requests"].as_array().unwrap() {
            assert_eq!(r["exactly"]["deviceClassName"], class["metadata"]["name"], "{r}");
        }
        for c in spec["devices"]["config"].as_array().unwrap() {
            assert_eq!(c["opaque"]["driver"], driver);
            let t: vgpu_k8s::claims::TenantConfig = serde_json::from_value(c["opaque"]["parameters"].clone()).unwrap_or_else(|e| panic!("{e}: {c}"));
            assert_eq!((t.api_version.as_str(), t.kind.as_str()), (vgpu_k8s::claims::CONFIG_API_VERSION, vgpu_k8s::claims::CONFIG_KIND));
            if let Some(m) = &t.memory {
                vgpu_k8s::quantity::parse(m).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}
