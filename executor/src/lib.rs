//! What runs a tenant's work on one device: the device service (a
//! tenant's contexts, modules, streams, events and memory, its sockets and
//! command rings), the stream engine, the virtio-gpu device model a VM's
//! vhost-user backend serves, the process confinement, and the backends
//! (the CPU reference device on the PTX interpreter, and CUDA).
//!
//! In an executor process it holds one tenant's state; in a shared device
//! worker (`isolation = "shared"` on CPU devices) every tenant's. It asks
//! the device's scheduler (`vgpu-arbiter`) for a lane before it runs work.

pub mod backend;
pub mod gpu;
pub mod worker;
