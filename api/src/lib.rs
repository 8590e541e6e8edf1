//! vgpu-api: what `vgpu-mediatord`, `vgpu-vmm` and `vgpuctl` share about
//! their REST APIs over unix sockets (DESIGN §9: every API is REST over a
//! unix socket, with the CLI as its client).

pub mod http;
pub mod openapi;
pub mod pool;
#[cfg(feature = "server")]
pub mod serve;
pub mod tenant;
pub mod vm;
pub mod vmm;

/// The one size type and grammar of every API, config and command line.
pub mod size;
pub use size::{Size, SizeError};
