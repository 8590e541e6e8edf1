//! The CPU reference device's PTX interpreter: parse and decode a module
//! once ([`Module::parse`]), then run kernels over a grid ([`launch`]).
//! The supported subset is documented in `docs/ptx-subset.md`.

mod exec;
mod ir;
mod lex;
mod mma;
mod parse;

pub use exec::{launch, ExecError, GlobalMem, LaunchConfig, Limits, Preempt, Stats, SHARED_WINDOW};
pub use ir::{Kernel, Param};
pub use parse::{Module, Signature};

/// A module that cannot be loaded: the line and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("PTX line {line}: {msg}")]
pub struct PtxError {
    pub line: u32,
    pub msg: String,
    /// The module would not fit the tenant's host budget (not a PTX fault).
    pub budget: bool,
}

impl PtxError {
    pub fn at(line: u32, msg: impl Into<String>) -> PtxError {
        PtxError { line, msg: msg.into(), budget: false }
    }

    pub fn over_budget(line: u32, msg: impl Into<String>) -> PtxError {
        PtxError { line, msg: msg.into(), budget: true }
    }
}

#[cfg(test)]
mod tests;
