//! vgpu-mediatord: the control plane, device workers, scheduler, scrubber
//! and backends of the vGPU stack.

pub mod arbiter;
pub mod backend;
pub mod config;
pub mod control;
pub mod fatal;
pub mod gpu;
pub mod grant;
pub mod ipc;
pub mod nice;
pub mod placement;
pub mod sched;
pub use virtio_gpu_compute::size;
pub mod worker;
/// The PTX interpreter (its own crate, `vgpu-ptx`).
pub use vgpu_ptx as ptx;
