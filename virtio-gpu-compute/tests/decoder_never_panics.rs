//! Property tests: the decoders never panic, whatever bytes arrive, and every
//! request a well-behaved client encodes decodes back to itself.

use proptest::prelude::*;
use virtio_gpu_compute::*;

fn header(op: u16, len: u32) -> Vec<u8> {
    let mut v = Vec::new();
    MsgHeader { magic: MAGIC, version: VERSION, opcode: op, seq: 7, status: 0, payload_len: len, reserved: 0 }.put(&mut v);
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn request_decoder_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Request::decode(&bytes);
        let _ = MsgHeader::decode(&bytes);
    }

    #[test]
    fn request_decoder_never_panics_on_valid_headers(op in 0u16..40, body in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut m = header(op, body.len() as u32);
        m.extend_from_slice(&body);
        let _ = Request::decode(&m);
        // A header that lies about the payload length is rejected, not trusted.
        let mut lying = header(op, body.len() as u32 + 1);
        lying.extend_from_slice(&body);
        prop_assert!(Request::decode(&lying).is_err());
    }

    #[test]
    fn reply_decoder_never_panics(op in 1u16..27, status in prop_oneof![Just(0u32), any::<u32>()], body in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(op) = Opcode::from_u16(op) {
            let _ = Reply::decode_payload(op, status, &body);
        }
    }

    #[test]
    fn virtio_gpu_command_decoder_never_panics(ty in prop_oneof![0x0100u32..0x0110, 0x0200u32..0x020a, 0x0300u32..0x0302, any::<u32>()], body in proptest::collection::vec(any::<u8>(), 0..400)) {
        use virtio_gpu_compute::virtio_gpu::*;
        let mut m = Vec::new();
        CtrlHdr { ty, flags: 0, fence_id: 0, ctx_id: 1, ring_idx: 0, padding: [0; 3] }.put(&mut m);
        m.extend_from_slice(&body);
        let _ = decode_command(&m);
        let _ = decode_command(&body);
        let _ = SubmitHeader::split(&body);
    }

    #[test]
    fn launch_round_trips(grid in [1u32..100, 1..100, 1..100], block in [1u32..32, 1..32, 1..2], params in proptest::collection::vec(any::<u8>(), 0..64)) {
        let req = Request::LaunchKernel(LaunchReq { ctx: 1, func: 2, stream: 0, shared_bytes: 16, grid, block, params_len: params.len() as u32, reserved: 0 }, params);
        let (h, back) = Request::decode(&req.encode(9)).unwrap();
        prop_assert_eq!(h.seq, 9);
        prop_assert_eq!(back, req);
    }
}

proptest! {
    #[test]
    fn graph_round_trips(kinds in proptest::collection::vec(0u8..3, 1..20), params in proptest::collection::vec(any::<u8>(), 0..64), value in any::<u8>()) {
        let nodes: Vec<GraphNode> = kinds.iter().map(|k| match k {
            0 => GraphNode::Kernel(GraphKernel { func: 3, shared_bytes: 0, grid: [2, 1, 1], block: [32, 1, 1], params_len: params.len() as u32, reserved: 0 }, params.clone()),
            1 => GraphNode::Memset(GraphMemset { dptr: 0x7000_0000_0000, value: value as u32, elem_size: 1, count: 100 }),
            _ => GraphNode::Copy(GraphCopy { dst: 0x7000_0000_1000, src: 0x7000_0000_0000, size: 64 }),
        }).collect();
        let req = Request::GraphCreate(GraphCreateReq { ctx: 1, count: 0, nodes_len: 0, reserved: 0 }, nodes.clone());
        let (_, back) = Request::decode(&req.encode(3)).unwrap();
        let Request::GraphCreate(b, got) = back else { panic!("not a graph") };
        prop_assert_eq!(b.count as usize, nodes.len());
        prop_assert_eq!(got, nodes);
    }
}

#[test]
fn graph_nodes_are_checked_like_their_own_requests() {
    let create = |n: GraphNode| Request::decode(&Request::GraphCreate(GraphCreateReq { ctx: 1, count: 0, nodes_len: 0, reserved: 0 }, vec![n]).encode(1));
    let k = GraphKernel { func: 1, shared_bytes: 0, grid: [1, 1, 1], block: [1, 1, 1], params_len: 0, reserved: 0 };
    assert!(create(GraphNode::Kernel(k, vec![])).is_ok());
    assert!(matches!(create(GraphNode::Kernel(GraphKernel { grid: [0, 1, 1], ..k }, vec![])), Err(WireError::BadField { what: "grid dimension", .. })));
    assert!(matches!(create(GraphNode::Kernel(GraphKernel { params_len: 5000, ..k }, vec![0; 5000])), Err(WireError::TooLarge { .. })));
    let m = GraphMemset { dptr: 0, value: 256, elem_size: 1, count: 1 };
    assert!(matches!(create(GraphNode::Memset(m)), Err(WireError::BadField { what: "memset value", .. })));
    assert!(matches!(create(GraphNode::Memset(GraphMemset { elem_size: 3, value: 0, ..m })), Err(WireError::BadField { what: "memset element size", .. })));
    // A count that claims more nodes than the bytes hold, and one over the bound.
    let mut lying = Request::GraphCreate(GraphCreateReq { ctx: 1, count: 0, nodes_len: 0, reserved: 0 }, vec![GraphNode::Kernel(k, vec![])]).encode(1);
    lying[MsgHeader::SIZE + 4..MsgHeader::SIZE + 8].copy_from_slice(&2u32.to_le_bytes());
    assert!(matches!(Request::decode(&lying), Err(WireError::Truncated)));
    lying[MsgHeader::SIZE + 4..MsgHeader::SIZE + 8].copy_from_slice(&(MAX_GRAPH_NODES + 1).to_le_bytes());
    assert!(matches!(Request::decode(&lying), Err(WireError::TooLarge { .. })));
    // An unknown kind, and an empty graph.
    let mut bad = Request::GraphCreate(GraphCreateReq { ctx: 1, count: 0, nodes_len: 0, reserved: 0 }, vec![GraphNode::Kernel(k, vec![])]).encode(1);
    bad[MsgHeader::SIZE + GraphCreateReq::SIZE] = 9;
    assert!(matches!(Request::decode(&bad), Err(WireError::BadField { what: "graph node kind", .. })));
    let empty = Request::GraphCreate(GraphCreateReq { ctx: 1, count: 0, nodes_len: 0, reserved: 0 }, vec![]).encode(1);
    assert!(matches!(Request::decode(&empty), Err(WireError::BadField { what: "graph node count", .. })));
}

#[test]
fn every_opcode_rejects_truncated_body() {
    for op in Opcode::ALL {
        let m = header(*op as u16, 0);
        match Request::decode(&m) {
            Ok((_, r)) => assert!(
                matches!(
                    r,
                    Request::Ping
                        | Request::GetDeviceInfo
                        | Request::GetTenantInfo
                        | Request::MemGetInfo
                        | Request::GetConnStats
                        | Request::RingKick
                        | Request::GetDeviceAttributes
                        | Request::GetProcesses
                ),
                "{op:?} accepted an empty body"
            ),
            Err(e) => assert!(matches!(e, WireError::Truncated), "{op:?}: {e}"),
        }
    }
}

#[test]
fn bad_magic_version_and_reserved_are_rejected() {
    let mut m = Request::Ping.encode(1);
    m[0] ^= 1;
    assert!(matches!(Request::decode(&m), Err(WireError::BadMagic(_))));
    let mut m = Request::Ping.encode(1);
    m[4] = 99;
    assert!(matches!(Request::decode(&m), Err(WireError::BadVersion(99))));
    let mut m = Request::Ping.encode(1);
    m[20] = 1;
    assert!(matches!(Request::decode(&m), Err(WireError::NonZeroReserved(_))));
}

#[test]
fn oversized_payload_is_rejected_from_the_header_alone() {
    let h = header(Opcode::ModuleLoad as u16, MAX_PAYLOAD + 1);
    assert!(matches!(MsgHeader::decode(&h), Err(WireError::TooLarge { .. })));
}

#[test]
fn zero_launch_dimension_and_bad_memset_width_are_rejected() {
    let req = Request::LaunchKernel(LaunchReq { ctx: 1, func: 1, stream: 0, shared_bytes: 0, grid: [1, 0, 1], block: [1, 1, 1], params_len: 0, reserved: 0 }, vec![]);
    assert!(matches!(Request::decode(&req.encode(1)), Err(WireError::BadField { what: "grid dimension", .. })));
    let req = Request::Memset(MemsetReq { ctx: 1, stream: 0, dptr: 0, value: 0, elem_size: 3, count: 1 });
    assert!(Request::decode(&req.encode(1)).is_err());
    let req = Request::Memset(MemsetReq { ctx: 1, stream: 0, dptr: 0, value: 0x1ff, elem_size: 1, count: 1 });
    assert!(Request::decode(&req.encode(1)).is_err());
}

#[test]
fn error_reply_carries_code_and_text() {
    let bytes = Reply::error(CuResult::CUDA_ERROR_INVALID_PTX, "line 3: unsupported instruction 'tex.2d'").encode(Opcode::ModuleLoad, 4);
    let h = MsgHeader::decode(&bytes).unwrap();
    let r = Reply::decode_payload(h.opcode(), h.status, &bytes[MsgHeader::SIZE..]).unwrap();
    assert_eq!(r, Reply::Error(CuResult::CUDA_ERROR_INVALID_PTX, "line 3: unsupported instruction 'tex.2d'".into()));
}

#[test]
fn image_formats_are_sniffed_by_magic() {
    assert_eq!(ImageFormat::sniff(b"\x7fELF...."), ImageFormat::Cubin);
    assert_eq!(ImageFormat::sniff(&0xBA55_ED50u32.to_le_bytes()), ImageFormat::Fatbin);
    assert_eq!(ImageFormat::sniff(b".version 7.0"), ImageFormat::Ptx);
}

#[test]
fn device_attributes_round_trip_and_are_bounded() {
    let table: Vec<i32> = (0..virtio_gpu_compute::attrs::COUNT as i32).map(|a| a * 3 - 7).collect();
    let bytes = Reply::Attributes(table.clone()).encode(Opcode::GetDeviceAttributes, 5);
    let h = MsgHeader::decode(&bytes).unwrap();
    let back = Reply::decode_payload(Opcode::GetDeviceAttributes, h.status, &bytes[MsgHeader::SIZE..]).unwrap();
    assert_eq!(back, Reply::Attributes(table));
    let too_long = vec![0u8; virtio_gpu_compute::attrs::COUNT * 4 + 4];
    assert!(Reply::decode_payload(Opcode::GetDeviceAttributes, 0, &too_long).is_err());
    assert!(Reply::decode_payload(Opcode::GetDeviceAttributes, 0, &[1, 2, 3]).is_err());
}

#[test]
fn process_lists_round_trip_and_are_bounded() {
    let list: Vec<ProcessInfo> = (1..=3).map(|i| ProcessInfo { pid: 100 + i, contexts: i, used: (i as u64) << 20 }).collect();
    let bytes = Reply::Processes(list.clone()).encode(Opcode::GetProcesses, 7);
    let h = MsgHeader::decode(&bytes).unwrap();
    let back = Reply::decode_payload(Opcode::GetProcesses, h.status, &bytes[MsgHeader::SIZE..]).unwrap();
    assert_eq!(back, Reply::Processes(list));
    assert_eq!(Reply::decode_payload(Opcode::GetProcesses, 0, &[]).unwrap(), Reply::Processes(vec![]));
    // Past the most contexts a tenant may hold, and a torn entry.
    let too_many = vec![0u8; (virtio_gpu_compute::MAX_CONTEXTS + 1) * 16];
    assert!(Reply::decode_payload(Opcode::GetProcesses, 0, &too_many).is_err());
    assert!(Reply::decode_payload(Opcode::GetProcesses, 0, &[0u8; 20]).is_err());
}
