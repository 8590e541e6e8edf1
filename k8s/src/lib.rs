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
//!
//! Its DRA driver (resource.k8s.io/v1 and the kubelet's DRA plugin API v1)
//! publishes the node's devices in ResourceSlices, with their memory as a
//! capacity that claims share where the cluster has consumable capacity;
//! `NodePrepareResources` makes a tenant per allocated device, with the
//! memory, weight, cap and priority the claim asks, and answers with its
//! CDI device; `NodeUnprepareResources` deletes it.

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
    /// The kubelet's DRA plugin API (v1).
    #[allow(clippy::all, clippy::pedantic)]
    pub mod dra {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// The kubelet's plugin registration API (v1), by which a DRA driver
    /// makes itself known.
    #[allow(clippy::all, clippy::pedantic)]
    pub mod pluginregistration {
        tonic::include_proto!("pluginregistration");
    }
}

pub mod cdi;
pub mod claims;
pub mod dra;
pub mod mediator;
pub mod plugin;
pub mod quantity;
pub mod slices;
pub mod state;
pub mod uds;
