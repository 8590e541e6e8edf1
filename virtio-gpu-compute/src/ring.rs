//! The command ring: memory a tenant shares with its device worker (a
//! sealed memfd for host processes, a guest blob for VMs) that carries
//! compute messages without a round trip per call.
//!
//! ```text
//! 0x00000  control block (one 64-byte line per word)
//!          SQ_TAIL  u64  shim: bytes of entries written (never decreases)
//!          SQ_HEAD  u64  worker: bytes of entries consumed
//!          STATE    u32  worker: AWAKE or SLEEPING; the shim swaps
//!                        SLEEPING for KICKED before it wakes the worker
//!          WAITERS  u32  shim: threads sleeping on WAKE (host futex)
//!          WAKE     u32  worker: bumped, and woken, when WAITERS != 0
//!          BROKEN   u32  worker: non-zero (a CUresult) once it stopped
//!                        serving the ring because of what it found there
//!          ERR..    the last asynchronous error: count, code, entry, text
//! 0x01000  DONE     ENTRY_SLOTS x u64: slot k holds the newest completed
//!                   entry sequence number s with s % ENTRY_SLOTS == k
//! REPLIES  REPLY_SLOTS x REPLY_SLOT_SIZE: replies to calls that want one
//! SQ       the submission queue, `sq_size` bytes (a power of two)
//! ```
//!
//! An entry is an [`EntryHeader`] and one compute message, padded to
//! [`ENTRY_ALIGN`]; entries never wrap (a PAD entry fills the end of the
//! queue instead). Sequence numbers start at [`FIRST_SEQ`] and grow by one
//! per message; the shim writes entry `s` only once entry `s - ENTRY_SLOTS`
//! is complete, so `DONE[s % ENTRY_SLOTS] >= s` means `s` is complete.
//!
//! The worker trusts none of it: it keeps its own head and sequence, copies
//! each entry out of shared memory before decoding it, and a ring whose
//! words or entries make no sense is marked BROKEN and no longer served.

use crate::wire::{wire_struct, Wire};

/// Completion slots; also the most entries in flight at once.
pub const ENTRY_SLOTS: u64 = 4096;
/// The first entry's sequence number (slot k starts out holding k, as if
/// entry k had completed).
pub const FIRST_SEQ: u64 = ENTRY_SLOTS;
/// Reply slots: calls that wait for a reply at the same time.
pub const REPLY_SLOTS: u16 = 32;
pub const REPLY_SLOT_SIZE: usize = 8192;
/// `EntryHeader::reply` of an entry that wants no reply.
pub const NO_REPLY: u16 = 0xFFFF;
pub const ENTRY_ALIGN: usize = 16;
/// Largest entry, header included: a launch with the largest parameter
/// buffer fits.
pub const MAX_ENTRY: usize = 8192;
/// Submission queue sizes the worker accepts.
pub const MIN_SQ: u32 = 64 << 10;
pub const MAX_SQ: u32 = 16 << 20;
pub const DEFAULT_SQ: u32 = 256 << 10;

pub const SQ_TAIL: usize = 0;
pub const SQ_HEAD: usize = 64;
pub const STATE: usize = 128;
pub const WAITERS: usize = 192;
pub const WAKE: usize = 256;
pub const BROKEN: usize = 320;
/// The error block, a sequence lock: ERR_COUNT (u32) is odd while the
/// worker writes the block and grows by 2 per error; ERR_CODE (u32),
/// ERR_SEQ (u64, the entry that failed), ERR_LEN (u32), ERR_CTX (u32, the
/// context of the failed work, 0 if none) and ERR_TEXT.
pub const ERR_COUNT: usize = 1024;
pub const ERR_CODE: usize = 1028;
pub const ERR_SEQ: usize = 1032;
pub const ERR_LEN: usize = 1040;
pub const ERR_CTX: usize = 1044;
pub const ERR_TEXT: usize = 1048;
pub const ERR_TEXT_MAX: usize = 1024;
pub const DONE: usize = 4096;
pub const REPLIES: usize = DONE + ENTRY_SLOTS as usize * 8;
pub const SQ: usize = REPLIES + REPLY_SLOTS as usize * REPLY_SLOT_SIZE;

pub const STATE_AWAKE: u32 = 0;
pub const STATE_SLEEPING: u32 = 1;
pub const STATE_KICKED: u32 = 2;

/// `EntryHeader::flags`: the entry fills the rest of the queue; skip it.
pub const ENTRY_PAD: u16 = 1;

// The error block fits the control block.
const _: () = assert!(ERR_TEXT + ERR_TEXT_MAX <= DONE);

/// Whether the worker accepts a submission queue of `n` bytes.
pub fn sq_size_ok(n: u32) -> bool {
    n.is_power_of_two() && (MIN_SQ..=MAX_SQ).contains(&n)
}

/// Bytes of shared memory a ring with an `sq_size`-byte queue takes.
pub fn region_size(sq_size: u32) -> usize {
    SQ + sq_size as usize
}

/// The completion slot of entry `seq`.
pub fn done_offset(seq: u64) -> usize {
    DONE + (seq % ENTRY_SLOTS) as usize * 8
}

pub fn reply_offset(slot: u16) -> usize {
    REPLIES + slot as usize * REPLY_SLOT_SIZE
}

/// An entry's length, header included, rounded up to [`ENTRY_ALIGN`].
pub fn entry_len(msg_len: usize) -> usize {
    (EntryHeader::SIZE + msg_len).next_multiple_of(ENTRY_ALIGN)
}

wire_struct! {
    /// Leads every ring entry.
    pub struct EntryHeader {
        /// Bytes of the whole entry, a multiple of ENTRY_ALIGN.
        pub len: u32,
        pub flags: u16,
        /// The reply slot to answer in, or NO_REPLY.
        pub reply: u16,
        pub seq: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_is_page_aligned_and_the_header_is_one_alignment_unit() {
        assert_eq!(EntryHeader::SIZE, ENTRY_ALIGN);
        for off in [DONE, REPLIES, SQ] {
            assert_eq!(off % 4096, 0, "{off:#x}");
        }
        assert!(sq_size_ok(DEFAULT_SQ) && !sq_size_ok(DEFAULT_SQ + 1) && !sq_size_ok(MIN_SQ / 2) && !sq_size_ok(MAX_SQ * 2));
        assert_eq!(done_offset(FIRST_SEQ), DONE);
        assert_eq!(entry_len(1), 32);
        assert_eq!(entry_len(16), 32);
    }
}
