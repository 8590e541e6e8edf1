//! vgpu-k8s: the Kubernetes node component of the vGPU stack.
//!
//! Its device plugin (the kubelet's device plugin API v1beta1) offers each
//! configured pool as a resource of fixed-size slices (`vgpu.dev/slice-16g`
//! = 16 GiB of a device in pool `default`). The kubelet's `Allocate` makes
//! a tenant of the local `vgpu-mediatord` with that much memory (and a
//! weight of one per slice) and answers with a CDI device whose spec mounts
//! the tenant's socket and `libcuda.so.1` into the container and sets
//! `VGPU_SOCKET`. Tenants whose pods are gone (the kubelet's pod resources
//! API says so) are deleted, their memory scrubbed. Isolation and quotas
//! are the executor's, outside the container: nothing in the pod can
//! bypass them (docs/kubernetes.md).

/// The kubelet's gRPC definitions (proto/, from k8s.io/kubelet), compiled
/// by build.rs: the plugin's side and, for tests, the kubelet's.
pub mod proto {
    /// The device plugin API.
    #[allow(clippy::all, clippy::pedantic)]
    pub mod deviceplugin {
        tonic::include_proto!("v1beta1");
    }
    /// The kubelet's pod resources API.
    #[allow(clippy::all, clippy::pedantic)]
    pub mod podresources {
        tonic::include_proto!("v1");
    }
}

pub mod cdi;
pub mod mediator;
pub mod plugin;
pub mod slices;
pub mod state;
pub mod uds;
