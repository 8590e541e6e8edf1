//! Feeds arbitrary bytes to every decoder of the compute protocol. Any
//! panic is a bug: these decoders read guest- and tenant-controlled bytes.
//! Run with `cargo +nightly fuzz run decode` from the repo root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use virtio_gpu_compute::capset::CapsetInfo;
use virtio_gpu_compute::{MsgHeader, Reply, Request};

fuzz_target!(|data: &[u8]| {
    let _ = MsgHeader::decode(data);
    let _ = Request::decode(data);
    let _ = CapsetInfo::decode(data);
    let _ = virtio_gpu_compute::virtio_gpu::decode_command(data);
    let _ = virtio_gpu_compute::virtio_gpu::SubmitHeader::split(data);
    if let Ok((h, _)) = Request::decode(data) {
        // A decoded request re-encodes to bytes that decode to the same request.
        let (_, req) = Request::decode(data).expect("decoded once");
        let again = Request::decode(&req.encode(h.seq)).expect("re-encoded request decodes");
        assert_eq!(again.1, req);
    }
    if data.len() >= 6 {
        let op = u16::from_le_bytes([data[0], data[1]]);
        let status = u32::from_le_bytes([data[2], data[3], data[4], data[5]]);
        if let Ok(op) = virtio_gpu_compute::Opcode::from_u16(op) {
            let _ = Reply::decode_payload(op, status, &data[6..]);
        }
    }
});
