//! Where the pieces of a staged copy go in a staging buffer, for both
//! ends of the copy: the shim between a program's pageable buffer and its
//! shared staging slots, and an executor between tenant memory and its
//! pinned staging buffers.

/// Where in a staging slot of `slot_len` bytes a piece of a copy goes, and
/// how many bytes of the copy each slot takes, for a program's buffer at
/// `user`. The piece starts half a page away from the program's buffer's
/// offset in its page: a memcpy whose destination lies a few bytes past
/// its source modulo 4096 (a buffer from malloc, 16 bytes into its page,
/// against a page-aligned slot) stalls on every load behind the stores
/// it seems to alias, 14 times slower on the development machine; half a
/// page apart, neither this copy nor the worker's between the slot and
/// (mostly page-aligned) device memory meets that.
pub fn place(user: usize, slot_len: usize) -> (usize, usize) {
    const PAGE: usize = 4096;
    if slot_len < 2 * PAGE {
        return (0, slot_len);
    }
    ((user % PAGE + PAGE / 2) % PAGE, slot_len - PAGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOT: usize = 256 << 10;

    #[test]
    fn a_staged_piece_lies_half_a_page_from_the_programs_buffer_and_inside_its_slot() {
        for user in [0usize, 16, 64, 2048, 4080, 0x7f00_0000_1010] {
            let (at, step) = place(user, SLOT);
            assert_eq!(step, SLOT - 4096);
            assert!(at + step <= SLOT, "{user:#x}: {at} + {step}");
            // The copy's destination minus its source, modulo a page, is
            // half a page either way.
            assert_eq!((at + 4096 - user % 4096) % 4096, 2048, "{user:#x}");
        }
        // Too small a buffer to move pieces in: used whole, from its start.
        assert_eq!(place(16, 4096), (0, 4096));
    }
}
