//! Feeds arbitrary bytes to the fatbin parser and the LZ4 and zstd
//! decoders, which
//! read tenant-supplied images inside the device worker. Any panic, any
//! allocation past the stated limits, is a bug. Run with
//! `cargo +nightly fuzz run fatbin` from the repo root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use virtio_gpu_compute::fatbin;

fuzz_target!(|data: &[u8]| {
    if let Ok(es) = fatbin::entries(data) {
        for e in &es {
            if let Ok(c) = e.contents_within(1 << 20) {
                assert!(c.len() <= 1 << 20, "decompressed past the limit");
            }
        }
    }
    for arch in [50, 80, 100] {
        let _ = fatbin::ptx_for_interpreter(data, arch, 1 << 20);
        if let Ok(Some(sel)) = fatbin::select(data, arch) {
            // What selection keeps parses again, within the original.
            assert!(fatbin::entries(&sel).is_ok(), "a selected fatbin does not parse");
            assert!(sel.len() <= data.len(), "selection grew the image");
        }
    }
    // The raw block decoder, with the output size taken from the input.
    if data.len() > 2 {
        let size = u16::from_le_bytes([data[0], data[1]]) as usize;
        if let Ok(out) = fatbin::lz4_block(&data[2..], size) {
            assert_eq!(out.len(), size);
        }
        // The same bytes as a zstd frame (with the zstd magic in front, so
        // the fuzzer reaches the frame decoder rather than its header check).
        let mut frame = vec![0x28, 0xb5, 0x2f, 0xfd];
        frame.extend_from_slice(&data[2..]);
        if let Ok(out) = fatbin::zstd_frame(&frame, size) {
            assert_eq!(out.len(), size);
        }
    }
});
