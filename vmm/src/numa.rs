//! Host NUMA topology: shared with the device workers, see `vgpu-topology`.

pub use vgpu_topology::*;
