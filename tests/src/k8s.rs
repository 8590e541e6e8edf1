//! What the Kubernetes tests share: the daemon's tenants, a CUDA sample run
//! through a CDI spec's edits (as a container runtime applies them), and
//! reading a document as the Kubernetes API's own type.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::{bin, lib_dir, samples, Mediator};

/// A running `vgpu-k8s` (device plugin or DRA driver), killed when dropped.
pub struct NodeComponent(std::process::Child);

impl NodeComponent {
    /// Starts `vgpu-k8s ARGS` for the daemon `m`, with the kubelet's
    /// directory `kubelet` and its CDI specs and state under `root`.
    pub fn start(args: &[&str], m: &Mediator, kubelet: &Path, root: &Path) -> NodeComponent {
        let child = std::process::Command::new(bin("vgpu-k8s"))
            .args(args)
            .arg("--kubelet-dir")
            .arg(kubelet)
            .arg("--cdi-dir")
            .arg(root.join("cdi"))
            .arg("--run-dir")
            .arg(&m.run_dir)
            .arg("--state-dir")
            .arg(root.join("state"))
            .arg("--lib-dir")
            .arg(lib_dir())
            .env("VGPU_LOG", "info")
            .spawn()
            .expect("vgpu-k8s");
        NodeComponent(child)
    }

    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for NodeComponent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The daemon's tenants' names, sorted.
pub fn tenants(m: &Mediator) -> Vec<String> {
    let (_, v) = m.api("GET", "/v1/tenants", None);
    let mut names: Vec<String> = v.as_array().expect("a list").iter().filter_map(|t| t["name"].as_str().map(String::from)).collect();
    names.sort();
    names
}

/// The daemon's tenant a CDI device id (`vgpu.dev/tenant=k8s-3-TAG`)
/// names: the id carries no secret, the tenant's name does (the id, `-`
/// and 64 random bits in hex).
pub fn tenant_of(m: &Mediator, cdi_id: &str) -> String {
    let public = cdi_id.strip_prefix("vgpu.dev/tenant=").unwrap_or_else(|| panic!("{cdi_id} is not a vGPU tenant's CDI device"));
    let tag = public.rsplit('-').next().unwrap_or("");
    assert!(tag.len() == 8 && tag.bytes().all(|b| b.is_ascii_hexdigit()), "{cdi_id}: a public id ends in its 32-bit tag");
    let found: Vec<String> =
        tenants(m).into_iter().filter(|t| t.strip_prefix(public).and_then(|r| r.strip_prefix('-')).is_some_and(|secret| secret.len() == 16 && secret.bytes().all(|b| b.is_ascii_hexdigit()))).collect();
    let [t] = &found[..] else { panic!("{cdi_id} names {found:?}, not one tenant with a secret part") };
    t.clone()
}

/// The CDI spec file of the device `cdi_id` names, in `cdi_dir`.
pub fn spec_file(cdi_dir: &Path, cdi_id: &str) -> std::path::PathBuf {
    cdi_dir.join(format!("vgpu.dev-tenant-{}.json", cdi_id.trim_start_matches("vgpu.dev/tenant=")))
}

/// Waits for `f` to hold, failing with `what` after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < end, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs `c` as a container the spec's edits make would: with the
/// spec's environment only as far as CUDA goes (every variable it sets;
/// `VGPU_SOCKET` pointed at the host side of the socket's mount, and none
/// of the caller's CuPy settings), and the driver libraries it mounts
/// where the dynamic loader finds them.
pub fn run_in_cdi(spec: &Value, mut c: Command) -> std::process::Output {
    let edits = &spec["devices"][0]["containerEdits"];
    let mounts: BTreeMap<String, String> =
        edits["mounts"].as_array().expect("mounts").iter().map(|m| (m["containerPath"].as_str().expect("path").to_string(), m["hostPath"].as_str().expect("path").to_string())).collect();
    let libs = std::env::temp_dir().join(format!("vgpu-cdi-libs-{}-{:?}", std::process::id(), std::thread::current().id()));
    let _ = std::fs::remove_dir_all(&libs);
    std::fs::create_dir_all(&libs).expect("mkdir");
    let given: Vec<std::ffi::OsString> = c.get_envs().map(|(k, _)| k.to_owned()).collect();
    for (k, _) in std::env::vars().filter(|(k, _)| (k.starts_with("CUPY_") || k == "VGPU_SOCKET") && !given.iter().any(|g| g == k.as_str())) {
        c.env_remove(k);
    }
    let mut socket = false;
    for e in edits["env"].as_array().expect("env") {
        let (k, v) = e.as_str().expect("string").split_once('=').expect("K=V");
        if k == "VGPU_SOCKET" {
            c.env(k, mounts.get(v).unwrap_or_else(|| panic!("VGPU_SOCKET={v} is not mounted: {spec}")));
            socket = true;
        } else {
            c.env(k, v);
        }
    }
    assert!(socket, "the spec sets VGPU_SOCKET: {spec}");
    for (c, h) in &mounts {
        if c.ends_with(".so.1") {
            std::os::unix::fs::symlink(h, libs.join(Path::new(c).file_name().expect("name"))).expect("symlink");
        }
    }
    c.env("LD_LIBRARY_PATH", &libs);
    let o = c.output().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let _ = std::fs::remove_dir_all(&libs);
    o
}

/// The vectorAdd sample run through the spec's edits ([`run_in_cdi`]).
pub fn run_with_cdi(spec: &Value) -> std::process::Output {
    run_in_cdi(spec, Command::new(samples().join("vectorAdd")))
}

/// vectorAdd through the spec's edits passes.
pub fn assert_sample_passes_with_cdi(spec: &Value) {
    let o = run_with_cdi(spec);
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("PASSED"),
        "vectorAdd through the CDI spec: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Runs a CuPy program through the spec's edits ([`run_in_cdi`]) with no
/// CuPy setting of the caller's: elementwise kernels CuPy compiles and a
/// reduction, checked; what the CPU device needs comes from the spec.
pub fn assert_cupy_passes_with_cdi(spec: &Value) {
    let py = crate::workspace().join("target/pyenv/bin/python");
    assert!(py.exists(), "{} is missing: run scripts/setup.sh (it installs CuPy from PyPI)", py.display());
    let mut c = Command::new(py);
    c.args(["-c", "import cupy as cp\na = cp.arange(1000, dtype=cp.float32)\nb = cp.sqrt(a * a + 1)\nassert float((a * 2).sum()) == 999000.0\nassert abs(float(b[999]) - 999.0005) < 1e-3\nprint('cupy through the CDI spec: PASSED')"]);
    c.env("CUPY_CACHE_DIR", crate::per_process("cupy-cache-cdi"));
    let o = run_in_cdi(spec, c);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && text.contains("PASSED"), "CuPy through the CDI spec:\n{text}");
}

/// Values equal once the nulls a writer leaves out are gone on both sides.
pub fn normal(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.iter().filter(|(_, x)| !x.is_null()).map(|(k, x)| (k.clone(), normal(x))).collect()),
        Value::Array(a) => Value::Array(a.iter().map(normal).collect()),
        x => x.clone(),
    }
}

/// Reads `doc` as `T` (a type generated from the Kubernetes OpenAPI
/// document) and writes it back: the same document, or why not. So no
/// field is one the API does not have (a lenient API server drops a
/// misspelled field without a word), no value has the wrong type, and no
/// required field is missing.
pub fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<T, String> {
    let typed: T = serde_json::from_value(doc.clone()).map_err(|e| format!("does not read as the API's type: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    if normal(&back) != normal(doc) {
        return Err(format!("is not the same written back (a field the API does not have?):\n  file: {doc}\n  API:  {back}"));
    }
    Ok(typed)
}
