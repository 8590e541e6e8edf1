//! The capset payload the virtio-gpu device reports for the compute context
//! type. The guest shim checks the magic before CONTEXT_INIT.

use crate::wire::{wire_struct, Reader, Wire};
use crate::WireError;

/// Default capset id of the compute context type (ids 1..9 are taken; the
/// Linux driver keeps the capset mask in an int, so it must stay <= 31).
pub const DEFAULT_CAPSET_ID: u32 = 24;
/// Highest capset id the Linux guest driver can express.
pub const MAX_CAPSET_ID: u32 = 31;

wire_struct! {
    pub struct CapsetInfo {
        pub magic: u32,
        pub version: u32,
        pub quota: u64,
        pub max_payload: u32,
        pub reserved: u32,
    }
}

impl CapsetInfo {
    pub fn decode(b: &[u8]) -> Result<CapsetInfo, WireError> {
        let c = CapsetInfo::get(&mut Reader::new(b))?;
        if c.magic != crate::MAGIC {
            return Err(WireError::BadMagic(c.magic));
        }
        if c.version != crate::VERSION as u32 {
            return Err(WireError::BadVersion(c.version as u16));
        }
        Ok(c)
    }
}
