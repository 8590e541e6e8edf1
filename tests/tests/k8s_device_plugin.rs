//! vgpu-k8s's device plugin against a stand-in kubelet built from the
//! kubelet's own gRPC definitions (k8s/proto, from k8s.io/kubelet): it
//! serves the kubelet's Registration and PodResourcesLister services and
//! calls the plugin's DevicePlugin service as the kubelet does. After each
//! step the daemon's tenants are what the pods hold, no more: registration,
//! ListAndWatch, GetPreferredAllocation, Allocate, a CUDA sample through
//! the CDI spec's edits (applied as a runtime would), pods going away,
//! restarts of the kubelet and of the plugin, and a tenant left by a
//! plugin that died.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tonic::{Request, Response, Status};
use vgpu_k8s::proto::deviceplugin as dp;
use vgpu_k8s::proto::podresources as pr;
use vgpu_tests::k8s::{assert_cupy_passes_with_cdi, assert_sample_passes_with_cdi, run_with_cdi, spec_file, tenant_of, tenants, wait_until, NodeComponent};
use vgpu_tests::Mediator;

const RESOURCE: &str = "vgpu.dev/slice-16m";

/// What the stand-in kubelet's pods hold: (resource, slice ids) each.
type Pods = Arc<Mutex<Vec<(String, Vec<String>)>>>;

struct Registrar(tokio::sync::mpsc::UnboundedSender<dp::RegisterRequest>);

#[tonic::async_trait]
impl dp::registration_server::Registration for Registrar {
    async fn register(&self, req: Request<dp::RegisterRequest>) -> Result<Response<dp::Empty>, Status> {
        let r = req.into_inner();
        if r.version != "v1beta1" {
            return Err(Status::invalid_argument(format!("unsupported version {}", r.version)));
        }
        let _ = self.0.send(r);
        Ok(Response::new(dp::Empty {}))
    }
}

struct Lister(Pods);

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for Lister {
    async fn list(&self, _: Request<pr::ListPodResourcesRequest>) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        let pods = self.0.lock().unwrap().clone();
        let pod_resources = pods
            .into_iter()
            .enumerate()
            .map(|(i, (resource_name, device_ids))| pr::PodResources {
                name: format!("pod-{i}"),
                namespace: "default".into(),
                containers: vec![pr::ContainerResources { name: "main".into(), devices: vec![pr::ContainerDevices { resource_name, device_ids, topology: None }], ..Default::default() }],
                ..Default::default()
            })
            .collect();
        Ok(Response::new(pr::ListPodResourcesResponse { pod_resources }))
    }
    async fn get_allocatable_resources(&self, _: Request<pr::AllocatableResourcesRequest>) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not played by the stand-in kubelet"))
    }
    async fn get(&self, _: Request<pr::GetPodResourcesRequest>) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not played by the stand-in kubelet"))
    }
}

/// The kubelet's side: its two services on their sockets, on a runtime of
/// its own; the test's calls to the plugin run on it too.
struct Kubelet {
    dir: PathBuf,
    rt: tokio::runtime::Runtime,
    registered: tokio::sync::mpsc::UnboundedReceiver<dp::RegisterRequest>,
    pods: Pods,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Kubelet {
    fn start(dir: &Path) -> Kubelet {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let (tx, registered) = tokio::sync::mpsc::unbounded_channel();
        let mut k = Kubelet { dir: dir.to_path_buf(), rt, registered, pods: Pods::default(), stop: None };
        k.serve(tx);
        k
    }

    /// Starts its servers as a kubelet does: every socket in
    /// device-plugins/ removed first (a plugin must notice and register
    /// again).
    fn serve(&mut self, tx: tokio::sync::mpsc::UnboundedSender<dp::RegisterRequest>) {
        let plugins = self.dir.join("device-plugins");
        let _ = std::fs::remove_dir_all(&plugins);
        std::fs::create_dir_all(&plugins).unwrap();
        std::fs::create_dir_all(self.dir.join("pod-resources")).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (reg_sock, pr_sock) = (plugins.join("kubelet.sock"), self.dir.join("pod-resources/kubelet.sock"));
        let _ = std::fs::remove_file(&pr_sock);
        let pods = self.pods.clone();
        self.rt.spawn(async move {
            let reg = tokio::net::UnixListener::bind(&reg_sock).unwrap();
            let lis = tokio::net::UnixListener::bind(&pr_sock).unwrap();
            let (a, b) = tokio::sync::oneshot::channel::<()>();
            let r = tonic::transport::Server::builder().add_service(dp::registration_server::RegistrationServer::new(Registrar(tx))).serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(reg),
                async {
                    let _ = b.await;
                },
            );
            let p = tonic::transport::Server::builder().add_service(pr::pod_resources_lister_server::PodResourcesListerServer::new(Lister(pods))).serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(lis),
                async {
                    let _ = stopped.await;
                    let _ = a.send(());
                },
            );
            let _ = tokio::join!(r, p);
        });
        self.stop = Some(stop);
    }

    /// Stops and starts again, as a kubelet restart does.
    fn restart(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        std::thread::sleep(Duration::from_millis(200));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.registered = rx;
        self.serve(tx);
    }

    fn wait_registration(&mut self) -> dp::RegisterRequest {
        let r = &mut self.registered;
        self.rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), r.recv()).await }).expect("the plugin did not register within 30 s").expect("registrations")
    }

    fn plugin(&self, endpoint: &str) -> dp::device_plugin_client::DevicePluginClient<tonic::transport::Channel> {
        let path = self.dir.join("device-plugins").join(endpoint);
        let ch = self.rt.block_on(vgpu_k8s::uds::channel(&path)).expect("connect to the plugin");
        dp::device_plugin_client::DevicePluginClient::new(ch)
    }

    fn hold(&self, pods: Vec<(String, Vec<String>)>) {
        *self.pods.lock().unwrap() = pods;
    }
}

fn start_plugin(m: &Mediator, k: &Kubelet, root: &Path) -> NodeComponent {
    NodeComponent::start(&["device-plugin", "--resource", &format!("{RESOURCE}=default:16MiB"), "--poll-s", "1", "--reconcile-s", "1", "--grace-s", "2"], m, &k.dir, root)
}

#[test]
fn the_device_plugin_serves_a_stand_in_kubelet_and_its_tenants_follow_the_pods() {
    let args = ["--cpu-devices", "2", "--device-memory", "64MiB"];
    let mut m = Mediator::start(&args);
    let root = m.run_dir.join("k8s");
    let mut k = Kubelet::start(&root.join("kubelet"));
    let mut plugin = start_plugin(&m, &k, &root);

    // Registration: the API version, the resource, its socket, options.
    let reg = k.wait_registration();
    assert_eq!((reg.version.as_str(), reg.resource_name.as_str(), reg.endpoint.as_str()), ("v1beta1", RESOURCE, "vgpu-vgpu-dev-slice-16m.sock"));
    assert!(reg.options.as_ref().is_some_and(|o| o.get_preferred_allocation_available && !o.pre_start_required), "{reg:?}");
    let mut client = k.plugin(&reg.endpoint);

    // ListAndWatch: four 16 MiB slices of each 64 MiB device, healthy.
    let mut stream = k.rt.block_on(client.list_and_watch(dp::Empty {})).expect("ListAndWatch").into_inner();
    let first = k.rt.block_on(stream.message()).expect("a list").expect("a list");
    let mut ids: Vec<String> = first.devices.iter().map(|d| d.id.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["cpu0-s0", "cpu0-s1", "cpu0-s2", "cpu0-s3", "cpu1-s0", "cpu1-s1", "cpu1-s2", "cpu1-s3"]);
    assert!(first.devices.iter().all(|d| d.health == "Healthy"), "{first:?}");
    assert!(tenants(&m).is_empty(), "no pod, no tenant");

    // GetPreferredAllocation keeps a container's slices on one device.
    let pref =
        k.rt.block_on(client.get_preferred_allocation(dp::PreferredAllocationRequest {
            container_requests: vec![dp::ContainerPreferredAllocationRequest { available_device_i_ds: ids.clone(), must_include_device_i_ds: vec!["cpu1-s2".into()], allocation_size: 2 }],
        }))
        .expect("preferred")
        .into_inner();
    let chosen = pref.container_responses[0].device_i_ds.clone();
    assert_eq!(chosen.len(), 2);
    assert!(chosen.contains(&"cpu1-s2".to_string()) && chosen.iter().all(|i| i.starts_with("cpu1-")), "{chosen:?}");

    // Allocate: a tenant of the slices' sum, weighted by their count,
    // handed over as a CDI device with its spec written.
    let alloc = k.rt.block_on(client.allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: chosen.clone() }] })).expect("Allocate").into_inner();
    let c = &alloc.container_responses[0];
    let names: Vec<&str> = c.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    let [device] = names.as_slice() else { panic!("one CDI device: {names:?}") };
    assert!(device.starts_with("vgpu.dev/tenant=k8s-0-") && device.len() == "vgpu.dev/tenant=k8s-0-".len() + 8, "the CDI device names the tenant without its secret: {device}");
    let tenant = tenant_of(&m, device);
    let cdi_public = device.trim_start_matches("vgpu.dev/tenant=");
    // Its name (and so its socket's) has a part no one can guess.
    let secret = tenant.strip_prefix(&format!("{}-", cdi_public)).unwrap_or_else(|| panic!("{tenant}"));
    assert!(secret.len() == 16 && secret.bytes().all(|b| b.is_ascii_hexdigit()), "{tenant}");
    assert_eq!(c.envs.get("VGPU_SOCKET").map(String::as_str), Some("/run/vgpu/vgpu.sock"));
    // A CPU device runs PTX: the container is told so for CuPy, as the
    // daemon says programs on that device need.
    assert_eq!(c.envs.get("CUPY_COMPILE_WITH_PTX").map(String::as_str), Some("1"), "{:?}", c.envs);
    assert_eq!(tenants(&m), std::slice::from_ref(&tenant));
    let (_, t) = m.api("GET", &format!("/v1/tenants/{tenant}"), None);
    assert_eq!((t["memory"].as_u64(), t["weight"].as_u64(), t["device"].as_str()), (Some(32 << 20), Some(2), Some("cpu1")), "{t}");
    // Open to any user (the container's is not known), so reached only
    // through the container's bind mount: hidden from the host's users.
    assert_eq!((t["mode"].as_str(), t["hidden"].as_bool()), (Some("0666"), Some(true)), "{t}");
    assert!(t["socket"].as_str().is_some_and(|s| s.contains("/hidden/")), "{t}");
    let spec_path = spec_file(&root.join("cdi"), device);
    let spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).expect("the CDI spec")).expect("JSON");
    assert_eq!(std::fs::metadata(&spec_path).map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777).ok(), Some(0o600), "the spec is root's only");
    assert_eq!(spec["kind"], "vgpu.dev/tenant");
    assert_eq!(spec["devices"][0]["containerEdits"]["mounts"][0]["hostPath"], t["socket"], "{spec}");

    // A CUDA sample runs as that tenant through the spec's edits.
    k.hold(vec![(RESOURCE.into(), chosen.clone())]);
    assert_sample_passes_with_cdi(&spec);
    // And CuPy, with no setting of the pod's own.
    assert_eq!(t["env"], serde_json::json!({ "CUPY_COMPILE_WITH_PTX": "1" }), "{t}");
    assert_cupy_passes_with_cdi(&spec);

    // While its pod holds the slices, the tenant stays (past the grace).
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(tenants(&m), std::slice::from_ref(&tenant));

    // The kubelet restarts (emptying device-plugins/): the plugin registers again.
    k.restart();
    let again = k.wait_registration();
    assert_eq!(again.resource_name, RESOURCE);
    assert_eq!(tenants(&m), std::slice::from_ref(&tenant), "a kubelet restart keeps the allocations");

    // The daemon is killed and started again: the pod's tenant is still
    // there (the daemon keeps its tenants), and the plugin still answers.
    m.kill_and_restart(&args);
    assert_eq!(tenants(&m), std::slice::from_ref(&tenant), "a daemon restart keeps the pods' tenants");
    let mut after = k.plugin(&again.endpoint);
    let listed = k.rt.block_on(async { after.list_and_watch(dp::Empty {}).await.expect("ListAndWatch").into_inner().message().await }).expect("a list").expect("a list");
    assert!(chosen.iter().all(|id| listed.devices.iter().any(|d| &d.id == id)), "{listed:?}");

    // The plugin is killed and started again: its allocations are kept,
    // it registers again, and a tenant with its prefix that no allocation
    // names (a plugin that died mid-Allocate) is deleted.
    plugin.kill();
    let (st, v) = m.api("POST", "/v1/tenants", Some(serde_json::json!({ "name": "k8s-99-00c0ffee-0123456789abcdef", "memory": "1MiB" })));
    assert_eq!(st, 201, "{v}");
    // Its record and the tenant's spec are from before tenants carried
    // settings (no `env`): it takes them from the daemon again.
    let state_file = root.join("state/state.json");
    let mut record: Value = serde_json::from_slice(&std::fs::read(&state_file).expect("the plugin's record")).expect("JSON");
    assert!(record["allocations"][&tenant].as_object_mut().expect("the tenant's allocation").remove("env").is_some(), "{record}");
    std::fs::write(&state_file, record.to_string()).unwrap();
    let mut old_spec = spec.clone();
    old_spec["devices"][0]["containerEdits"]["env"] = serde_json::json!(["VGPU_SOCKET=/run/vgpu/vgpu.sock"]);
    std::fs::write(&spec_path, old_spec.to_string()).unwrap();
    let _plugin = start_plugin(&m, &k, &root);
    let reg = k.wait_registration();
    wait_until("the orphan k8s-99-00c0ffee-0123456789abcdef is deleted", Duration::from_secs(20), || tenants(&m) == std::slice::from_ref(&tenant));
    let mut client = k.plugin(&reg.endpoint);
    let mut stream = k.rt.block_on(client.list_and_watch(dp::Empty {})).expect("ListAndWatch").into_inner();
    let listed = k.rt.block_on(stream.message()).expect("a list").expect("a list");
    assert!(chosen.iter().all(|id| listed.devices.iter().any(|d| &d.id == id)), "allocated slices stay listed: {listed:?}");
    let record: Value = serde_json::from_slice(&std::fs::read(&state_file).expect("the plugin's record")).expect("JSON");
    assert_eq!(record["allocations"][&tenant]["env"], serde_json::json!({ "CUPY_COMPILE_WITH_PTX": "1" }), "{record}");
    let now: Value = serde_json::from_slice(&std::fs::read(&spec_path).expect("the CDI spec")).expect("JSON");
    assert_eq!(now, spec, "the spec is written again with the daemon's settings");

    // The pod goes: once the grace has passed, the tenant is deleted (its
    // memory scrubbed), its spec removed, and its socket refuses the sample.
    k.hold(Vec::new());
    wait_until("the pod's tenant is deleted", Duration::from_secs(20), || tenants(&m).is_empty());
    // The plugin deletes the tenant first and its spec after: wait for both.
    wait_until("the CDI spec is removed with the tenant", Duration::from_secs(20), || !spec_path.exists());
    let o = run_with_cdi(&spec);
    assert!(!o.status.success(), "the sample ran after its tenant was deleted");
    let (_, d) = m.api("GET", "/v1/devices/cpu1", None);
    assert_eq!(d["memory_reserved"], 0, "{d}");

    // Bad requests get clear gRPC errors, and the plugin keeps serving.
    let e = k.rt.block_on(client.allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec!["nonsense".into()] }] })).unwrap_err();
    assert!(e.code() == tonic::Code::InvalidArgument && e.message().contains("not a slice"), "{e:?}");
    let e = k.rt.block_on(client.allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![] }] })).unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let ok = k.rt.block_on(client.allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec!["cpu0-s0".into()] }] })).expect("Allocate after bad ones");
    let next = ok.into_inner().container_responses[0].cdi_devices[0].name.clone();
    assert!(next.starts_with("vgpu.dev/tenant=k8s-1-"), "{next}");
    assert_eq!(tenants(&m), [tenant_of(&m, &next)]);
}
