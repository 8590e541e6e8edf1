//! Container Device Interface specs: one per tenant, naming the device
//! `vgpu.dev/tenant=NAME`. A CDI-enabled runtime (containerd 1.7+, CRI-O)
//! applies its edits to the container: the tenant's socket and the vGPU
//! driver libraries bind-mounted in, and `VGPU_SOCKET` set. The same edits
//! are what the plugin answers with as mounts and environment for
//! runtimes without CDI.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// The CDI kind: vendor `vgpu.dev`, class `tenant`. A tenant's device is
/// named by its [`public_id`].
pub const KIND: &str = "vgpu.dev/tenant";
/// The CDI spec version written (the oldest with every field used).
pub const CDI_VERSION: &str = "0.6.0";
/// Where the tenant's socket is in the container.
pub const CONTAINER_SOCKET: &str = "/run/vgpu/vgpu.sock";

/// What goes into a container for one tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edits {
    pub env: Vec<(String, String)>,
    /// (host path, container path, read-only).
    pub mounts: Vec<(PathBuf, PathBuf, bool)>,
}

/// The edits for a tenant whose socket is `socket`: the socket at
/// [`CONTAINER_SOCKET`], and each driver library in `libs` (the shim's
/// `libcuda.so.1`, and `libnvidia-ml.so.1` where it exists) read-only in
/// `container_lib_dir`, where the dynamic loader finds it without any
/// `LD_LIBRARY_PATH` (as NVIDIA's container toolkit places its own).
/// The environment is `VGPU_SOCKET` and `env`, the settings the daemon
/// says programs need on the tenant's device, so that nobody has to set
/// them in the pod (a name no shell takes, or `VGPU_SOCKET` itself, is
/// left out).
pub fn edits(socket: &Path, env: &BTreeMap<String, String>, libs: &[PathBuf], container_lib_dir: &Path) -> Edits {
    let mut mounts = vec![(socket.to_path_buf(), PathBuf::from(CONTAINER_SOCKET), false)];
    for l in libs {
        if let Some(name) = l.file_name() {
            mounts.push((l.clone(), container_lib_dir.join(name), true));
        }
    }
    let mut all = vec![("VGPU_SOCKET".to_string(), CONTAINER_SOCKET.to_string())];
    all.extend(env.iter().filter(|(k, _)| vgpu_api::tenant::is_env_name(k) && *k != "VGPU_SOCKET").map(|(k, v)| (k.clone(), v.clone())));
    Edits { env: all, mounts }
}

/// A tenant's name without its secret: `k8s-3-00c0ffee-0123456789abcdef`
/// is `k8s-3-00c0ffee`. CDI device names reach places others read (the kubelet's
/// answers and a runtime's errors end up in pod status; the CDI directory
/// can be listed by any user of the host), so they name the tenant by this;
/// only the spec's contents (root's alone) hold the socket's path.
pub fn public_id(tenant: &str) -> &str {
    match tenant.rsplit_once('-') {
        Some((id, secret)) if secret.len() == 16 && secret.bytes().all(|b| b.is_ascii_hexdigit()) && !id.is_empty() => id,
        _ => tenant,
    }
}

/// The fully qualified CDI device name of a tenant.
pub fn device_name(tenant: &str) -> String {
    format!("{KIND}={}", public_id(tenant))
}

/// The spec's file in the CDI directory.
pub fn spec_path(cdi_dir: &Path, tenant: &str) -> PathBuf {
    cdi_dir.join(format!("vgpu.dev-tenant-{}.json", public_id(tenant)))
}

/// The CDI spec of one tenant's device.
pub fn spec(tenant: &str, e: &Edits) -> Value {
    let tenant = public_id(tenant);
    let env: Vec<String> = e.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mounts: Vec<Value> = e
        .mounts
        .iter()
        .map(|(host, container, ro)| {
            let mut options = vec!["bind", "nosuid", "nodev"];
            if *ro {
                options.push("ro");
            }
            json!({ "hostPath": host, "containerPath": container, "options": options })
        })
        .collect();
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{ "name": tenant, "containerEdits": { "env": env, "mounts": mounts } }],
    })
}

/// Writes the spec atomically (a runtime never reads half of one), mode
/// 0600: the runtime reads it as root, and the socket path in it is the
/// tenant's secret.
pub fn write(cdi_dir: &Path, tenant: &str, spec: &Value) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(cdi_dir)?;
    let path = spec_path(cdi_dir, tenant);
    // A spec of the same name for another socket is another tenant's: it
    // is never replaced (a container would get that tenant's socket).
    let socket = |v: &Value| v["devices"][0]["containerEdits"]["mounts"][0]["hostPath"].clone();
    if let Some(old) = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok()) {
        if socket(&old) != socket(spec) {
            return Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, format!("{} is another tenant's CDI spec", path.display())));
        }
    }
    vgpu_topology::safe_open::write_atomically(&path, serde_json::to_string_pretty(spec).map_err(std::io::Error::other)?.as_bytes())?;
    Ok(path)
}

/// Removes a tenant's spec (gone already is fine).
pub fn remove(cdi_dir: &Path, tenant: &str) -> std::io::Result<()> {
    match std::fs::remove_file(spec_path(cdi_dir, tenant)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_mounts_the_socket_and_the_libraries_and_sets_the_socket() {
        let e = edits(Path::new("/run/vgpu/tenants/k8s-1.sock"), &BTreeMap::new(), &["/usr/lib/vgpu/libcuda.so.1".into()], Path::new("/usr/lib/x86_64-linux-gnu"));
        let s = spec("k8s-1", &e);
        assert_eq!(s["kind"], "vgpu.dev/tenant");
        assert_eq!(s["devices"][0]["name"], "k8s-1");
        assert_eq!(s["devices"][0]["containerEdits"]["env"], json!(["VGPU_SOCKET=/run/vgpu/vgpu.sock"]));
        let m = &s["devices"][0]["containerEdits"]["mounts"];
        assert_eq!(m[0]["hostPath"], "/run/vgpu/tenants/k8s-1.sock");
        assert_eq!(m[1]["containerPath"], "/usr/lib/x86_64-linux-gnu/libcuda.so.1");
        assert_eq!(m[1]["options"], json!(["bind", "nosuid", "nodev", "ro"]));
        assert_eq!(device_name("k8s-1"), "vgpu.dev/tenant=k8s-1");
        // A made tenant's secret is in none of the names.
        let t = "k8s-7-00c0ffee-0123456789abcdef";
        assert_eq!(device_name(t), "vgpu.dev/tenant=k8s-7-00c0ffee");
        assert_eq!(spec_path(Path::new("/cdi"), t), Path::new("/cdi/vgpu.dev-tenant-k8s-7-00c0ffee.json"));
        assert_eq!(spec(t, &e)["devices"][0]["name"], "k8s-7-00c0ffee");
        assert_eq!(public_id("vm-0123456789abcdeg"), "vm-0123456789abcdeg");
        // A spec is never written over another tenant's of the same name.
        let dir = std::env::temp_dir().join(format!("vgpu-cdi-{}", std::process::id()));
        write(&dir, t, &spec(t, &e)).unwrap();
        write(&dir, t, &spec(t, &e)).expect("the same tenant's spec again");
        let other = edits(Path::new("/run/vgpu/tenants/other.sock"), &BTreeMap::new(), &[], Path::new("/usr/lib"));
        let err = write(&dir, t, &spec(t, &other)).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The settings a tenant's device needs follow the socket; a name no
    /// shell takes, or one that would move the socket, is left out.
    #[test]
    fn a_spec_sets_what_the_tenants_device_needs() {
        let env = BTreeMap::from([
            ("CUPY_COMPILE_WITH_PTX".to_string(), "1".to_string()),
            ("VGPU_SOCKET".to_string(), "/elsewhere".to_string()),
            ("A=B".to_string(), "x".to_string()),
            ("".to_string(), "x".to_string()),
            ("1X".to_string(), "x".to_string()),
        ]);
        let e = edits(Path::new("/run/vgpu/tenants/t.sock"), &env, &[], Path::new("/usr/lib"));
        assert_eq!(spec("t", &e)["devices"][0]["containerEdits"]["env"], json!(["VGPU_SOCKET=/run/vgpu/vgpu.sock", "CUPY_COMPILE_WITH_PTX=1"]));
    }
}
