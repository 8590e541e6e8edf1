//! The vGPU compute protocol.
//!
//! The same messages travel over a host tenant's unix socket (length-prefixed
//! by their header) and, in a later stage, inside virtio-gpu SUBMIT_3D
//! commands of the compute context type. The crate does no I/O: it encodes,
//! decodes and validates. Every decode path returns a [`WireError`] on bad
//! input and never panics; `tests/decoder_never_panics.rs` checks that with
//! random input, and `fuzz/` holds the cargo-fuzz target.

pub mod attrs;
pub mod capset;
pub mod cuda;
pub mod fatbin;
pub mod msg;
pub mod nvml;
pub mod ring;
pub mod staging;
pub mod virtio_gpu;
pub mod wire;

pub use cuda::CuResult;
pub use msg::*;
pub use wire::{Reader, Wire};

/// Why a message was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message truncated")]
    Truncated,
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported protocol version {0}")]
    BadVersion(u16),
    #[error("unknown opcode {0}")]
    BadOpcode(u16),
    #[error("reserved field {0} is not zero")]
    NonZeroReserved(&'static str),
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge { what: &'static str, len: u64, max: u64 },
    #[error("{what}: stated {stated} bytes, got {actual}")]
    LengthMismatch { what: &'static str, stated: u64, actual: u64 },
    #[error("{0} trailing bytes after message")]
    TrailingBytes(usize),
    #[error("invalid {what}: {value}")]
    BadField { what: &'static str, value: u64 },
    #[error("{0} is not valid UTF-8")]
    BadUtf8(&'static str),
}

impl WireError {
    /// The CUDA error a bad message maps to.
    pub fn cuda(&self) -> CuResult {
        CuResult::CUDA_ERROR_INVALID_VALUE
    }
}
