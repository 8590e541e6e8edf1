//! vgpu-mediatord: the control plane of the vGPU stack (REST API, tenants,
//! VMs, pools, passthrough, metering, configuration). It starts the device
//! processes (arbiters, executors and shared workers), which run the same
//! binary; their code is in `vgpu-arbiter` and `vgpu-executor`, re-exported
//! here under the module names the daemon and the tests use.

pub mod config;
pub mod control;
pub use vgpu_api::size;
pub use vgpu_arbiter::{arbiter, fatal, grant, ipc, nice, placement, sched};
pub use vgpu_executor::{backend, gpu, worker};
/// The PTX interpreter (its own crate, `vgpu-ptx`).
pub use vgpu_ptx as ptx;
