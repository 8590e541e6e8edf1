//! The guest (and host-process) driver shim: `libcuda.so.1`, implementing
//! the CUDA Driver API over the vGPU compute protocol, plus the client
//! library `vgpu-smi` uses. See `include/cuda.h` for the exported subset.

pub mod api;
pub mod client;
pub mod drm;
pub mod nvml;
pub mod ptxlink;
pub mod ring;
pub mod transport;
