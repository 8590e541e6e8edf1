//! The device model against mock guest memory and the real CPU device:
//! the command sequence the Linux driver and the shim produce, vectorAdd
//! through blobs, and every kind of hostile command the issue lists.

use std::sync::Arc;

use virtio_gpu_compute::capset::CapsetInfo;
use virtio_gpu_compute::virtio_gpu::*;
use virtio_gpu_compute::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{GpuConfig, GpuDevice};
use crate::backend::cpu::CpuBackend;
use crate::worker::service::{DeviceService, Tenant};
use vgpu_arbiter::sched::{Fifo, Scheduler};

const RAM: usize = 16 << 20;
const CTX: u32 = 1;
const DATA: u32 = 10;
const REPLY: u32 = 11;
const REPLY_GPA: u64 = 0x20_0000;

fn service() -> Arc<DeviceService> {
    let backend = Arc::new(CpuBackend::new(0, 64 << 20, 100_000_000).unwrap());
    Arc::new(DeviceService::new(0, backend, vgpu_arbiter::grant::Lanes::Local(Scheduler::new(2, Arc::new(Fifo)))))
}

fn device_on(svc: &Arc<DeviceService>, name: &str, quota: u64) -> (GpuDevice, GuestMemoryMmap, Arc<Tenant>) {
    device_with(svc, None, name, quota)
}

/// A device whose contexts may attach command rings, served by `engine`.
fn device_with(svc: &Arc<DeviceService>, engine: Option<Arc<crate::worker::engine::Engine>>, name: &str, quota: u64) -> (GpuDevice, GuestMemoryMmap, Arc<Tenant>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM)]).unwrap();
    let t = svc.add_tenant(name, quota, Default::default(), 1 << 30).unwrap();
    (GpuDevice::new(GpuConfig::default(), mem.clone(), svc.clone(), engine, t.clone()), mem, t)
}

fn hdr(ty: u32, ctx: u32, flags: u32, ring: u8) -> Vec<u8> {
    let mut v = Vec::new();
    CtrlHdr { ty, flags, fence_id: 99, ctx_id: ctx, ring_idx: ring, padding: [0; 3] }.put(&mut v);
    v
}

fn resp_type(r: &[u8]) -> u32 {
    u32::from_le_bytes(r[..4].try_into().unwrap())
}

fn ctx_create(dev: &mut GpuDevice, ctx: u32, capset: u32) -> u32 {
    let mut m = hdr(ty::CTX_CREATE, ctx, 0, 0);
    CtxCreateBody { nlen: 4, context_init: capset, debug_name: [b'x'; 64] }.put(&mut m);
    resp_type(&dev.process(&m))
}

fn create_blob(dev: &mut GpuDevice, res: u32, entries: &[(u64, u32)]) -> u32 {
    let mut m = hdr(ty::RESOURCE_CREATE_BLOB, CTX, 0, 0);
    let size = entries.iter().map(|e| e.1 as u64).sum();
    CreateBlobBody { resource_id: res, blob_mem: BLOB_MEM_GUEST, blob_flags: BLOB_FLAG_USE_MAPPABLE, nr_entries: entries.len() as u32, blob_id: 0, size }.put(&mut m);
    for (addr, length) in entries {
        MemEntry { addr: *addr, length: *length, padding: 0 }.put(&mut m);
    }
    resp_type(&dev.process(&m))
}

fn attach(dev: &mut GpuDevice, res: u32) -> u32 {
    let mut m = hdr(ty::CTX_ATTACH_RESOURCE, CTX, 0, 0);
    ResourceIdBody { resource_id: res, padding: 0 }.put(&mut m);
    resp_type(&dev.process(&m))
}

/// Sets up context 1 with a 64 KiB data blob in two pieces and a reply blob.
fn ready(dev: &mut GpuDevice) {
    assert_eq!(ctx_create(dev, CTX, 24), ty::RESP_OK_NODATA);
    assert_eq!(create_blob(dev, DATA, &[(0x10_0000, 0x8000), (0x30_0000, 0x8000)]), ty::RESP_OK_NODATA);
    assert_eq!(create_blob(dev, REPLY, &[(REPLY_GPA, 0x1000)]), ty::RESP_OK_NODATA);
    assert_eq!(attach(dev, DATA), ty::RESP_OK_NODATA);
    assert_eq!(attach(dev, REPLY), ty::RESP_OK_NODATA);
}

fn submit_raw(dev: &mut GpuDevice, msg: &[u8], flags: u32, ring: u8) -> u32 {
    let mut payload = Vec::new();
    SubmitHeader { magic: SUBMIT_MAGIC, reply_blob: REPLY, reply_offset: 0, reply_capacity: 0x1000, reserved: 0 }.put(&mut payload);
    payload.extend_from_slice(msg);
    let mut m = hdr(ty::SUBMIT_3D, CTX, flags, ring);
    SubmitBody { size: payload.len() as u32, padding: 0 }.put(&mut m);
    m.extend_from_slice(&payload);
    resp_type(&dev.process(&m))
}

/// Submits one compute request and reads its reply from the reply blob.
fn call(dev: &mut GpuDevice, mem: &GuestMemoryMmap, req: Request) -> Reply {
    let op = req.opcode();
    assert_eq!(submit_raw(dev, &req.encode(5), FLAG_FENCE | FLAG_INFO_RING_IDX, 3), ty::RESP_OK_NODATA);
    let mut h = [0u8; MsgHeader::SIZE];
    mem.read_slice(&mut h, GuestAddress(REPLY_GPA)).unwrap();
    let h = MsgHeader::decode(&h).unwrap();
    assert_eq!((h.opcode, h.seq), (op as u16, 5));
    let mut body = vec![0u8; h.payload_len as usize];
    mem.read_slice(&mut body, GuestAddress(REPLY_GPA + MsgHeader::SIZE as u64)).unwrap();
    Reply::decode_payload(op, h.status, &body).unwrap()
}

/// Ring entry `seq` carrying `req`, wanting its reply in slot `reply`.
fn ring_entry(seq: u64, reply: u16, req: &Request) -> Vec<u8> {
    let msg = req.encode(seq as u32);
    let len = virtio_gpu_compute::ring::entry_len(msg.len());
    let mut e = Vec::new();
    virtio_gpu_compute::ring::EntryHeader { len: len as u32, flags: 0, reply, seq }.put(&mut e);
    e.extend_from_slice(&msg);
    e.resize(len, 0);
    e
}

fn handle(r: Reply) -> u32 {
    match r {
        Reply::Handle(h) => h,
        o => panic!("{o:?}"),
    }
}

fn ptr(r: Reply) -> u64 {
    match r {
        Reply::Ptr(p) => p,
        o => panic!("{o:?}"),
    }
}

/// Blob byte offset to guest address (the data blob is in two pieces).
fn data_gpa(off: u64) -> u64 {
    if off < 0x8000 {
        0x10_0000 + off
    } else {
        0x30_0000 + off - 0x8000
    }
}

fn write_f32s(mem: &GuestMemoryMmap, off: u64, v: &[f32]) {
    for (i, x) in v.iter().enumerate() {
        mem.write_obj(x.to_bits(), GuestAddress(data_gpa(off + 4 * i as u64))).unwrap();
    }
}

fn read_f32s(mem: &GuestMemoryMmap, off: u64, n: usize) -> Vec<f32> {
    (0..n).map(|i| f32::from_bits(mem.read_obj(GuestAddress(data_gpa(off + 4 * i as u64))).unwrap())).collect()
}

#[test]
fn capset_probe_answers_by_index_and_id() {
    let svc = service();
    let (mut dev, _, _) = device_on(&svc, "vm", 32 << 20);
    let mut m = hdr(ty::GET_CAPSET_INFO, 0, 0, 0);
    CapsetInfoReq { capset_index: 0, padding: 0 }.put(&mut m);
    let r = dev.process(&m);
    assert_eq!(resp_type(&r), ty::RESP_OK_CAPSET_INFO);
    let info = CapsetInfoResp::get(&mut Reader::new(&r[CtrlHdr::SIZE..])).unwrap();
    assert_eq!((info.capset_id, info.capset_max_size), (24, CapsetInfo::SIZE as u32));

    let mut m = hdr(ty::GET_CAPSET, 0, 0, 0);
    GetCapsetReq { capset_id: 24, capset_version: 1 }.put(&mut m);
    let r = dev.process(&m);
    assert_eq!(resp_type(&r), ty::RESP_OK_CAPSET);
    let c = CapsetInfo::decode(&r[CtrlHdr::SIZE..]).unwrap();
    assert_eq!(c.quota, 32 << 20, "the capset carries the tenant's quota");

    let mut m = hdr(ty::GET_CAPSET_INFO, 0, 0, 0);
    CapsetInfoReq { capset_index: 1, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_ERR_INVALID_PARAMETER);
    let mut m = hdr(ty::GET_CAPSET, 0, 0, 0);
    GetCapsetReq { capset_id: 4, capset_version: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_ERR_INVALID_PARAMETER);
    assert_eq!(&dev.config_space()[8..16], &[1, 0, 0, 0, 1, 0, 0, 0], "one scanout, one capset");
    let r = dev.process(&hdr(ty::GET_DISPLAY_INFO, 0, 0, 0));
    assert_eq!(resp_type(&r), ty::RESP_OK_DISPLAY_INFO);
    assert_eq!(r.len(), CtrlHdr::SIZE + 16 * 24);
}

#[test]
fn vector_add_runs_through_blobs_and_fences_signal() {
    let svc = service();
    let (mut dev, mem, t) = device_on(&svc, "vm", 32 << 20);
    ready(&mut dev);
    let n = 1000usize;
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let bytes = (n * 4) as u64;
    let (a, b, c) = (0u64, 0x4000u64, 0x9000u64); // b straddles the blob's two pieces
    let da = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: bytes })));
    let db = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: bytes })));
    let dc = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: bytes })));
    let va: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let vb: Vec<f32> = (0..n).map(|i| 2.0 * i as f32 + 0.5).collect();
    write_f32s(&mem, a, &va);
    write_f32s(&mem, b, &vb);
    for (dst, off) in [(da, a), (db, b)] {
        let r = call(&mut dev, &mem, Request::MemcpyHtoD(MemcpyHtoDReq { ctx, stream: 0, dst, size: bytes, loc: DataLoc::Blob as u32, blob: DATA, shm_offset: off }, vec![]));
        assert_eq!(r, Reply::Empty);
    }
    let ptx = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../samples/kernels/vectorAdd.ptx")).unwrap();
    let module = handle(call(&mut dev, &mem, Request::ModuleLoad(ModuleLoadReq { ctx, format: 0, image_len: ptx.len() as u64 }, ptx)));
    let name = "vectorAdd".to_string();
    let func = match call(&mut dev, &mem, Request::ModuleGetFunction(GetFunctionReq { ctx, module, name_len: name.len() as u32, reserved: 0 }, name)) {
        Reply::Function(f, _) => f.func,
        o => panic!("{o:?}"),
    };
    let mut params = Vec::new();
    for p in [da, db, dc] {
        params.extend_from_slice(&p.to_le_bytes());
    }
    params.extend_from_slice(&(n as i32).to_le_bytes());
    let grid = (n as u32).div_ceil(256);
    let l = LaunchReq { ctx, func, stream: 0, shared_bytes: 0, grid: [grid, 1, 1], block: [256, 1, 1], params_len: params.len() as u32, reserved: 0 };
    assert_eq!(call(&mut dev, &mem, Request::LaunchKernel(l, params)), Reply::Empty);
    let r = call(&mut dev, &mem, Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream: 0, src: dc, size: bytes, loc: DataLoc::Blob as u32, blob: DATA, shm_offset: c }));
    // The bytes went straight into the blob: the reply carries none.
    assert!(matches!(&r, Reply::Data(d) if d.is_empty()), "{r:?}");
    let got = read_f32s(&mem, c, n);
    for i in 0..n {
        assert_eq!(got[i], va[i] + vb[i], "element {i}");
    }
    assert_eq!(dev.last_fence(CTX, 3), Some(99), "the fence on (ctx 1, ring 3) is signalled");

    // Destroying the virtio context frees the tenant's device memory.
    assert!(svc.stats().tenants.iter().any(|s| s.name == "vm" && s.used > 0));
    let m = hdr(ty::CTX_DESTROY, CTX, 0, 0);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    assert!(svc.stats().tenants.iter().any(|s| s.name == "vm" && s.used == 0));
    drop(t);
}

#[test]
fn over_quota_allocation_in_a_vm_context_is_out_of_memory() {
    let svc = service();
    let (mut dev, mem, _) = device_on(&svc, "small", 1 << 20);
    ready(&mut dev);
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    match call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 2 << 20 })) {
        Reply::Error(c, _) => assert_eq!(c, CuResult::CUDA_ERROR_OUT_OF_MEMORY),
        o => panic!("{o:?}"),
    }
    match call(&mut dev, &mem, Request::MemGetInfo) {
        Reply::MemInfo(i) => assert_eq!(i.total, 1 << 20),
        o => panic!("{o:?}"),
    }
}

#[test]
fn a_guests_processes_are_listed_by_the_pid_each_gave_with_their_memory() {
    let svc = service();
    let (mut dev, mem, _) = device_on(&svc, "procs", 8 << 20);
    ready(&mut dev);
    let processes = |dev: &mut GpuDevice| match call(dev, &mem, Request::GetProcesses) {
        Reply::Processes(v) => v.into_iter().map(|p| (p.pid, p.contexts, p.used)).collect::<Vec<_>>(),
        o => panic!("{o:?}"),
    };
    assert_eq!(processes(&mut dev), vec![]);
    // Process 41 holds two contexts, 77 one; a context made without a pid
    // (an older shim) is not listed.
    let a1 = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 41 })));
    let a2 = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 41 })));
    let b = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 77 })));
    let anon = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    for (ctx, size) in [(a1, 1u64 << 20), (a2, 1 << 20), (b, 2 << 20), (anon, 1 << 20)] {
        ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size })));
    }
    let freed = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx: b, reserved: 0, size: 1 << 20 })));
    assert_eq!(processes(&mut dev), vec![(41, 2, 2 << 20), (77, 1, 3 << 20)]);
    assert_eq!(call(&mut dev, &mem, Request::MemFree(MemFreeReq { ctx: b, reserved: 0, dptr: freed })), Reply::Empty);
    assert_eq!(call(&mut dev, &mem, Request::CtxDestroy(CtxReq { ctx: a1, reserved: 0 })), Reply::Empty);
    assert_eq!(processes(&mut dev), vec![(41, 1, 1 << 20), (77, 1, 2 << 20)]);
}

#[test]
fn blobs_outside_guest_ram_or_unattached_are_refused() {
    let svc = service();
    let (mut dev, mem, _) = device_on(&svc, "vm", 32 << 20);
    ready(&mut dev);
    let bad = ty::RESP_ERR_INVALID_PARAMETER;
    assert_eq!(create_blob(&mut dev, 20, &[(RAM as u64, 0x1000)]), bad, "past the end of guest RAM");
    assert_eq!(create_blob(&mut dev, 20, &[(RAM as u64 - 0x800, 0x1000)]), bad, "straddling the end of guest RAM");
    assert_eq!(create_blob(&mut dev, 20, &[(u64::MAX - 0x10, 0x1000)]), bad, "address overflow");
    assert_eq!(create_blob(&mut dev, 20, &[(0xfee0_0000, 0x1000)]), bad, "the LAPIC page");
    assert_eq!(create_blob(&mut dev, 20, &[(0x1000, 0)]), bad, "an empty entry");
    assert_eq!(create_blob(&mut dev, 20, &[]), bad, "no entries");
    assert_eq!(create_blob(&mut dev, DATA, &[(0x1000, 0x1000)]), ty::RESP_ERR_INVALID_RESOURCE_ID, "id in use");

    // A blob that exists but is not attached to the context cannot be used.
    assert_eq!(create_blob(&mut dev, 21, &[(0x50_0000, 0x1000)]), ty::RESP_OK_NODATA);
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let d = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4096 })));
    match call(&mut dev, &mem, Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream: 0, src: d, size: 4096, loc: DataLoc::Blob as u32, blob: 21, shm_offset: 0 })) {
        Reply::Error(c, m) => assert!(c == CuResult::CUDA_ERROR_INVALID_VALUE && m.contains("not attached"), "{m}"),
        o => panic!("{o:?}"),
    }
    // A range past the blob's end is refused too.
    match call(&mut dev, &mem, Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream: 0, src: d, size: 4096, loc: DataLoc::Blob as u32, blob: DATA, shm_offset: 0x10000 - 100 })) {
        Reply::Error(c, _) => assert_eq!(c, CuResult::CUDA_ERROR_INVALID_VALUE),
        o => panic!("{o:?}"),
    }
    // After unref the blob is gone from every context.
    let mut m = hdr(ty::RESOURCE_UNREF, CTX, 0, 0);
    ResourceIdBody { resource_id: DATA, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    match call(&mut dev, &mem, Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream: 0, src: d, size: 16, loc: DataLoc::Blob as u32, blob: DATA, shm_offset: 0 })) {
        Reply::Error(..) => {}
        o => panic!("{o:?}"),
    }
}

#[test]
fn hostile_commands_get_error_responses_and_the_device_keeps_serving() {
    let svc = service();
    let (mut dev, mem, _) = device_on(&svc, "evil", 8 << 20);
    let (mut other, other_mem, _) = device_on(&svc, "good", 8 << 20);
    ready(&mut dev);
    ready(&mut other);

    assert_eq!(resp_type(&dev.process(&hdr(0x0999, CTX, 0, 0))), ty::RESP_ERR_UNSPEC, "unknown type");
    assert_eq!(resp_type(&dev.process(&hdr(ty::RESOURCE_CREATE_3D, CTX, 0, 0))), ty::RESP_ERR_UNSPEC, "3D resources do not exist here");
    assert_eq!(resp_type(&dev.process(&hdr(ty::SUBMIT_3D, CTX, 0, 0)[..12])), ty::RESP_ERR_UNSPEC, "truncated header");
    let mut m = hdr(ty::SUBMIT_3D, CTX, 0, 0);
    SubmitBody { size: 4096, padding: 0 }.put(&mut m);
    m.extend_from_slice(&[0; 64]);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_ERR_UNSPEC, "submit larger than its descriptor");
    let mut m = hdr(ty::RESOURCE_CREATE_BLOB, CTX, 0, 0);
    CreateBlobBody { resource_id: 30, blob_mem: BLOB_MEM_GUEST, blob_flags: 1, nr_entries: 1 << 30, blob_id: 0, size: 1 << 40 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_ERR_UNSPEC, "absurd entry count");
    assert_eq!(create_blob(&mut dev, 31, &[(0x10_0000, u32::MAX)]), ty::RESP_ERR_INVALID_PARAMETER, "absurd length");
    assert_eq!(ctx_create(&mut dev, 2, 4), ty::RESP_ERR_INVALID_PARAMETER, "foreign capset (venus)");
    // The kernel's own default context (capset 0, made for display
    // clients) is accepted, can hold a 2D framebuffer, but runs no compute.
    assert_eq!(ctx_create(&mut dev, 3, 0), ty::RESP_OK_NODATA, "the kernel's default context");
    let mut m = hdr(ty::RESOURCE_CREATE_2D, 3, 0, 0);
    Create2dBody { resource_id: 40, format: 1, width: 1024, height: 768 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    let mut m = hdr(ty::CTX_ATTACH_RESOURCE, 3, 0, 0);
    ResourceIdBody { resource_id: 40, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    let mut m = hdr(ty::SUBMIT_3D, 3, 0, 0);
    SubmitBody { size: 0, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_ERR_INVALID_CONTEXT_ID, "no compute on a default context");
    assert_eq!(ctx_create(&mut dev, CTX, 24), ty::RESP_ERR_INVALID_CONTEXT_ID, "context id in use");
    let ping = Request::Ping.encode(1);
    assert_eq!(submit_raw(&mut dev, &ping, FLAG_FENCE | FLAG_INFO_RING_IDX, 64), ty::RESP_ERR_INVALID_PARAMETER, "ring_idx 64");
    assert_eq!(submit_raw(&mut dev, &ping, FLAG_FENCE | FLAG_INFO_RING_IDX, 255), ty::RESP_ERR_INVALID_PARAMETER, "ring_idx 255");
    let mut m = hdr(ty::SUBMIT_3D, 77, 0, 0);
    SubmitBody { size: 0, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_ERR_INVALID_CONTEXT_ID, "submit to a context that does not exist");
    assert_eq!(submit_raw(&mut dev, b"garbage that is no compute message", 0, 0), ty::RESP_OK_NODATA, "the command is fine; the message's error goes in the reply");
    let mut h = [0u8; MsgHeader::SIZE];
    mem.read_slice(&mut h, GuestAddress(REPLY_GPA)).unwrap();
    assert_eq!(MsgHeader::decode(&h).unwrap().status, CuResult::CUDA_ERROR_INVALID_VALUE as u32);
    assert!(dev.refused >= 10);

    // The same device still serves this tenant, and the other tenant on
    // the worker is unaffected.
    assert_eq!(call(&mut dev, &mem, Request::Ping), Reply::Empty);
    let ctx = handle(call(&mut other, &other_mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let d = ptr(call(&mut other, &other_mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4096 })));
    assert!(d != 0);
}

#[test]
fn fresh_allocation_in_a_vm_never_shows_another_tenants_bytes() {
    let svc = service();
    let (mut a, mem_a, _) = device_on(&svc, "a", 8 << 20);
    let (mut b, mem_b, _) = device_on(&svc, "b", 8 << 20);
    ready(&mut a);
    ready(&mut b);
    let size = 0x8000u64;
    let ca = handle(call(&mut a, &mem_a, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let pa = ptr(call(&mut a, &mem_a, Request::MemAlloc(MemAllocReq { ctx: ca, reserved: 0, size })));
    for off in (0..size).step_by(4) {
        mem_a.write_obj(0xdead_beefu32, GuestAddress(data_gpa(off))).unwrap();
    }
    let r = call(&mut a, &mem_a, Request::MemcpyHtoD(MemcpyHtoDReq { ctx: ca, stream: 0, dst: pa, size, loc: DataLoc::Blob as u32, blob: DATA, shm_offset: 0 }, vec![]));
    assert_eq!(r, Reply::Empty);
    // A's context goes away (as its process would): its memory is freed.
    assert_eq!(resp_type(&a.process(&hdr(ty::CTX_DESTROY, CTX, 0, 0))), ty::RESP_OK_NODATA);

    let cb = handle(call(&mut b, &mem_b, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let pb = ptr(call(&mut b, &mem_b, Request::MemAlloc(MemAllocReq { ctx: cb, reserved: 0, size })));
    // B's allocation takes A's freed granules (first fit), at an address
    // of B's own window.
    assert_ne!(pb, pa, "each tenant allocates in its own address window");
    for off in (0..size).step_by(4) {
        mem_b.write_obj(0x5555_5555u32, GuestAddress(data_gpa(off))).unwrap();
    }
    call(&mut b, &mem_b, Request::MemcpyDtoH(MemcpyDtoHReq { ctx: cb, stream: 0, src: pb, size, loc: DataLoc::Blob as u32, blob: DATA, shm_offset: 0 }));
    for off in (0..size).step_by(4) {
        let v: u32 = mem_b.read_obj(GuestAddress(data_gpa(off))).unwrap();
        assert_eq!(v, 0, "B read A's bytes at offset {off}");
    }
}

#[test]
fn a_guest_cannot_grow_the_workers_tables_without_bound() {
    let svc = service();
    let (mut dev, _, _) = device_on(&svc, "greedy", 8 << 20);
    assert_eq!(ctx_create(&mut dev, CTX, 24), ty::RESP_OK_NODATA);
    for id in 1..=super::device::MAX_RESOURCES as u32 {
        assert_eq!(create_blob(&mut dev, id, &[(0x1000, 0x1000)]), ty::RESP_OK_NODATA, "blob {id}");
    }
    assert_eq!(create_blob(&mut dev, 1 << 20, &[(0x1000, 0x1000)]), ty::RESP_ERR_OUT_OF_MEMORY);
    for id in 2..=super::device::MAX_CONTEXTS as u32 {
        assert_eq!(ctx_create(&mut dev, id, 24), ty::RESP_OK_NODATA, "context {id}");
    }
    assert_eq!(ctx_create(&mut dev, 5000, 24), ty::RESP_ERR_OUT_OF_MEMORY);
    // Freeing makes room again.
    let mut m = hdr(ty::RESOURCE_UNREF, CTX, 0, 0);
    ResourceIdBody { resource_id: 7, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    assert_eq!(create_blob(&mut dev, 1 << 20, &[(0x1000, 0x1000)]), ty::RESP_OK_NODATA);
}

#[test]
fn a_deleted_vm_tenant_can_neither_compute_nor_create_contexts() {
    // Before revocation existed, a VM whose tenant was deleted kept
    // creating contexts and allocating memory through its device.
    let svc = service();
    let (mut dev, mem, t) = device_on(&svc, "vm2", 8 << 20);
    ready(&mut dev);
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 1 << 20 })));
    assert!(svc.remove_tenant("vm2").is_some());
    assert!(t.is_revoked());
    // Its memory is released with the tenant.
    assert_eq!(svc.stats().allocated, 0);
    assert!(svc.stats().tenants.is_empty());
    // Every command of the guest is refused from now on: compute
    // messages, new virtio-gpu contexts and new blobs alike.
    let alloc = Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 1 << 20 }).encode(6);
    assert_eq!(submit_raw(&mut dev, &alloc, 0, 0), ty::RESP_ERR_UNSPEC);
    assert_eq!(ctx_create(&mut dev, 7, 24), ty::RESP_ERR_UNSPEC);
    assert_eq!(create_blob(&mut dev, 77, &[(0x10_0000, 0x1000)]), ty::RESP_ERR_UNSPEC);
    assert_eq!(svc.stats().allocated, 0, "nothing was allocated after the deletion");
}

/// The ring of a VM context: a blob of scattered guest pages, entries
/// written into guest memory, one kick by SUBMIT_3D, completions read back
/// from guest memory; bad rings are refused or broken, never followed.
#[test]
fn a_vm_context_ring_in_scattered_guest_pages_serves_entries_after_one_kick() {
    use virtio_gpu_compute::ring;
    let svc = service();
    let engine = crate::worker::engine::Engine::start(1, false, None).unwrap();
    let (mut dev, mem, _t) = device_with(&svc, Some(engine), "ringvm", 8 << 20);
    ready(&mut dev);
    const RING: u32 = 20;
    let sq = ring::MIN_SQ;
    let size = ring::region_size(sq) as u64;
    // Two runs of guest pages, the second before the first in guest memory.
    let first = 0x90_0000u64;
    let second = 0x50_0000u64;
    let split = 0x1_0000u64;
    let ring_off = |off: u64| if off < split { first + off } else { second + off - split };
    assert_eq!(create_blob(&mut dev, RING, &[(first, split as u32), (second, (size - split) as u32)]), ty::RESP_OK_NODATA);
    // Not attached yet: refused.
    let attach_req = Request::AttachRing(AttachRingReq { sq_size: sq, flags: 0, blob: RING, reserved: 0 });
    assert!(matches!(call(&mut dev, &mem, attach_req.clone()), Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, _)));
    assert_eq!(attach(&mut dev, RING), ty::RESP_OK_NODATA);
    // A queue the blob cannot hold: refused.
    let too_big = Request::AttachRing(AttachRingReq { sq_size: sq * 2, flags: 0, blob: RING, reserved: 0 });
    assert!(matches!(call(&mut dev, &mem, too_big), Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, _)));
    assert_eq!(call(&mut dev, &mem, attach_req.clone()), Reply::Empty);
    assert!(matches!(call(&mut dev, &mem, attach_req), Reply::Error(CuResult::CUDA_ERROR_INVALID_VALUE, _)), "one ring per context");
    // 300 entries (crossing from the first run into the second), one kick.
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let mut tail = 0u64;
    let n = 300u64;
    for i in 0..n {
        let seq = ring::FIRST_SEQ + i;
        let req = if i + 1 == n { Request::MemGetInfo } else { Request::CtxSynchronize(CtxReq { ctx, reserved: 0 }) };
        let msg = req.encode(seq as u32);
        let len = ring::entry_len(msg.len());
        let mut e = Vec::new();
        ring::EntryHeader { len: len as u32, flags: 0, reply: if i + 1 == n { 3 } else { ring::NO_REPLY }, seq }.put(&mut e);
        e.extend_from_slice(&msg);
        e.resize(len, 0);
        for (k, b) in e.iter().enumerate() {
            mem.write_obj(*b, GuestAddress(ring_off(ring::SQ as u64 + tail % sq as u64 + k as u64))).unwrap();
        }
        tail += len as u64;
    }
    mem.write_obj(tail, GuestAddress(ring_off(ring::SQ_TAIL as u64))).unwrap();
    assert_eq!(call(&mut dev, &mem, Request::RingKick), Reply::Empty);
    let last = ring::FIRST_SEQ + n - 1;
    let t = std::time::Instant::now();
    while mem.read_obj::<u64>(GuestAddress(ring_off(ring::done_offset(last) as u64))).unwrap() < last {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the ring was not served");
        std::thread::yield_now();
    }
    let rep = ring_off(ring::reply_offset(3) as u64);
    let mut h = [0u8; MsgHeader::SIZE];
    mem.read_slice(&mut h, GuestAddress(rep)).unwrap();
    let h = MsgHeader::decode(&h).unwrap();
    let mut body = vec![0u8; h.payload_len as usize];
    mem.read_slice(&mut body, GuestAddress(rep + MsgHeader::SIZE as u64)).unwrap();
    assert_eq!(Reply::decode_payload(Opcode::MemGetInfo, h.status, &body).unwrap(), Reply::MemInfo(MemInfoReply { free: 8 << 20, total: 8 << 20 }));
    match call(&mut dev, &mem, Request::GetConnStats) {
        Reply::ConnStats(s) => assert_eq!(s.ring_entries, n, "{s:?}"),
        o => panic!("{o:?}"),
    }
    // A tail behind the head: the ring is broken, the context still answers.
    mem.write_obj(1u64, GuestAddress(ring_off(ring::SQ_TAIL as u64))).unwrap();
    assert_eq!(call(&mut dev, &mem, Request::RingKick), Reply::Empty);
    let t = std::time::Instant::now();
    while mem.read_obj::<u32>(GuestAddress(ring_off(ring::BROKEN as u64))).unwrap() == 0 {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the bad tail was not noticed");
        std::thread::yield_now();
    }
    assert_eq!(call(&mut dev, &mem, Request::Ping), Reply::Empty);
}

/// Linux frees a GUEST blob's pages once the device answers
/// RESOURCE_UNREF (a process exit detaches and unrefs its ring blob
/// before it destroys the context). From that answer on the device must
/// never write those pages again: the guest may already hold page tables
/// or kernel data in them.
#[test]
fn a_ring_blob_is_never_written_after_the_guest_unrefs_it() {
    use virtio_gpu_compute::ring;
    let svc = service();
    let engine = crate::worker::engine::Engine::start(1, false, None).unwrap();
    let (mut dev, mem, _t) = device_with(&svc, Some(engine), "ringunref", 8 << 20);
    ready(&mut dev);
    const RING: u32 = 21;
    let sq = ring::MIN_SQ;
    let size = ring::region_size(sq) as u64;
    let base = 0x90_0000u64;
    assert_eq!(create_blob(&mut dev, RING, &[(base, size as u32)]), ty::RESP_OK_NODATA);
    assert_eq!(attach(&mut dev, RING), ty::RESP_OK_NODATA);
    assert_eq!(call(&mut dev, &mem, Request::AttachRing(AttachRingReq { sq_size: sq, flags: 0, blob: RING, reserved: 0 })), Reply::Empty);
    // One entry with a reply, so the ring's poller is awake and idling
    // when the guest lets go of the blob.
    let seq = ring::FIRST_SEQ;
    let e = ring_entry(seq, 0, &Request::MemGetInfo);
    let len = e.len();
    mem.write_slice(&e, GuestAddress(base + ring::SQ as u64)).unwrap();
    mem.write_obj(len as u64, GuestAddress(base + ring::SQ_TAIL as u64)).unwrap();
    assert_eq!(call(&mut dev, &mem, Request::RingKick), Reply::Empty);
    let t = std::time::Instant::now();
    while mem.read_obj::<u64>(GuestAddress(base + ring::done_offset(seq) as u64)).unwrap() < seq {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the ring was not served");
        std::thread::yield_now();
    }
    // Process exit: detach, unref; the guest reuses the pages at once.
    let mut m = hdr(ty::CTX_DETACH_RESOURCE, CTX, 0, 0);
    ResourceIdBody { resource_id: RING, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    let mut m = hdr(ty::RESOURCE_UNREF, CTX, 0, 0);
    ResourceIdBody { resource_id: RING, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    let pattern = vec![0xa5u8; size as usize];
    mem.write_slice(&pattern, GuestAddress(base)).unwrap();
    // Longer than the poller idles before it writes that it sleeps.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let mut now = vec![0u8; size as usize];
    mem.read_slice(&mut now, GuestAddress(base)).unwrap();
    let changed: Vec<usize> = (0..now.len()).filter(|&i| now[i] != 0xa5).collect();
    assert!(changed.is_empty(), "the device wrote {} bytes of a released blob, first at offset {:#x}", changed.len(), changed[0]);
    // The context lives on without its ring and still answers.
    assert_eq!(call(&mut dev, &mem, Request::Ping), Reply::Empty);
}

/// A device reset (or the VM's end) answers only once no copy can write
/// a blob's pages again: the guest may reuse them the moment it is told.
/// A copy queued on a command ring that already waits for a lane when the
/// reset comes must not go on to write them once it gets one.
#[test]
fn a_copy_waiting_for_a_lane_never_writes_guest_pages_after_a_reset() {
    use virtio_gpu_compute::ring;
    let sched = Scheduler::new(1, Arc::new(Fifo));
    let backend = Arc::new(CpuBackend::new(0, 64 << 20, 100_000_000).unwrap());
    let svc = Arc::new(DeviceService::new(0, backend, vgpu_arbiter::grant::Lanes::Local(sched.clone())));
    let engine = crate::worker::engine::Engine::start(1, false, None).unwrap();
    let (mut dev, mem, _t) = device_with(&svc, Some(engine), "resetcopy", 8 << 20);
    ready(&mut dev);
    const RING: u32 = 22;
    let sq = ring::MIN_SQ;
    let base = 0x90_0000u64;
    assert_eq!(create_blob(&mut dev, RING, &[(base, ring::region_size(sq) as u32)]), ty::RESP_OK_NODATA);
    assert_eq!(attach(&mut dev, RING), ty::RESP_OK_NODATA);
    assert_eq!(call(&mut dev, &mem, Request::AttachRing(AttachRingReq { sq_size: sq, flags: 0, blob: RING, reserved: 0 })), Reply::Empty);
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let d = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4096 })));
    assert_eq!(call(&mut dev, &mem, Request::Memset(MemsetReq { ctx, stream: 0, dptr: d, value: 0x77, elem_size: 1, count: 4096 })), Reply::Empty);
    // Another tenant holds the device's one lane.
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (free_tx, free_rx) = std::sync::mpsc::channel::<()>();
    let hog_sched = sched.clone();
    let hog = std::thread::spawn(move || {
        hog_sched.run("hog", || {
            held_tx.send(()).unwrap();
            let _ = free_rx.recv();
        })
    });
    held_rx.recv().unwrap();
    // The ring's copy of the device memory into the data blob waits for it.
    let seq = ring::FIRST_SEQ;
    let e = ring_entry(seq, ring::NO_REPLY, &Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream: 0, src: d, size: 4096, loc: DataLoc::Blob as u32, blob: DATA, shm_offset: 0 }));
    let len = e.len();
    mem.write_slice(&e, GuestAddress(base + ring::SQ as u64)).unwrap();
    mem.write_obj(len as u64, GuestAddress(base + ring::SQ_TAIL as u64)).unwrap();
    assert_eq!(call(&mut dev, &mem, Request::RingKick), Reply::Empty);
    let t = std::time::Instant::now();
    while sched.queued() == 0 {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the copy never waited for the lane");
        std::thread::yield_now();
    }
    // The reset; then the guest reuses the blob's pages at once.
    drop(dev);
    let pattern = vec![0xa5u8; 0x8000];
    mem.write_slice(&pattern, GuestAddress(data_gpa(0))).unwrap();
    // The lane comes free: whatever the copy does now, it must not write.
    free_tx.send(()).unwrap();
    hog.join().unwrap();
    let t = std::time::Instant::now();
    while sched.queued() > 0 && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::yield_now();
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    let mut now = vec![0u8; 0x8000];
    mem.read_slice(&mut now, GuestAddress(data_gpa(0))).unwrap();
    let changed: Vec<usize> = (0..now.len()).filter(|&i| now[i] != 0xa5).collect();
    assert!(changed.is_empty(), "a copy wrote {} bytes of the guest's pages after the reset, first at offset {:#x}", changed.len(), changed[0]);
}

/// What a guest makes its executor hold through the device (contexts,
/// blobs and their entries, attachments, a command ring, each stream its
/// ring queued work on) is charged to the tenant's host budget, refused
/// past it, and given back when it goes: the budget bounds a VM as it
/// bounds a process.
#[test]
fn what_a_guest_makes_the_executor_hold_is_on_its_host_budget() {
    use crate::worker::conn::CONN_HOST_BYTES;
    use crate::worker::service::host_cost::*;
    use virtio_gpu_compute::ring;
    let svc = service();
    let engine = crate::worker::engine::Engine::start(1, false, None).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM)]).unwrap();
    let t = svc.add_tenant("hostvm", 8 << 20, Default::default(), 512 << 10).unwrap();
    let mut dev = GpuDevice::new(GpuConfig::default(), mem.clone(), svc.clone(), Some(engine), t.clone());
    let used = || t.host.used();
    let base = used();
    ready(&mut dev);
    assert_eq!(used() - base, CONN_HOST_BYTES + 2 * BLOB + 3 * BLOB_ENTRY + 2 * ATTACHMENT);
    let before = used();
    assert_eq!(attach(&mut dev, DATA), ty::RESP_OK_NODATA);
    assert_eq!(used(), before, "attaching a blob again costs nothing more");
    // A command ring in a blob of one entry.
    const RINGBLOB: u32 = 30;
    let sq = ring::MIN_SQ;
    let size = ring::region_size(sq) as u64;
    let at = 0x90_0000u64;
    assert_eq!(create_blob(&mut dev, RINGBLOB, &[(at, size as u32)]), ty::RESP_OK_NODATA);
    assert_eq!(attach(&mut dev, RINGBLOB), ty::RESP_OK_NODATA);
    let before = used();
    assert_eq!(call(&mut dev, &mem, Request::AttachRing(AttachRingReq { sq_size: sq, flags: 0, blob: RINGBLOB, reserved: 0 })), Reply::Empty);
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let dptr = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size: 4096 })));
    let with_ring = used();
    assert!(with_ring - before >= RING + RING_RUN, "the ring was not charged: {} bytes", with_ring - before);
    // One memset through the ring: its stream's queue is charged.
    let seq = ring::FIRST_SEQ;
    let e = ring_entry(seq, ring::NO_REPLY, &Request::Memset(MemsetReq { ctx, stream: 0, dptr, value: 7, elem_size: 1, count: 4096 }));
    let len = e.len();
    mem.write_slice(&e, GuestAddress(at + ring::SQ as u64)).unwrap();
    mem.write_obj(len as u64, GuestAddress(at + ring::SQ_TAIL as u64)).unwrap();
    assert_eq!(call(&mut dev, &mem, Request::RingKick), Reply::Empty);
    let t0 = std::time::Instant::now();
    while mem.read_obj::<u64>(GuestAddress(at + ring::done_offset(seq) as u64)).unwrap() < seq {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the ring was not served");
        std::thread::yield_now();
    }
    assert_eq!(used() - with_ring, RING_STREAM, "the ring's stream was not charged");
    // Contexts until the budget is spent: refused well before the
    // device's own limit of 1024, and each given back when destroyed.
    let before = used();
    let mut made = Vec::new();
    for id in 100..1100 {
        match ctx_create(&mut dev, id, 24) {
            ty::RESP_OK_NODATA => made.push(id),
            r => {
                assert_eq!(r, ty::RESP_ERR_OUT_OF_MEMORY);
                break;
            }
        }
    }
    assert!(!made.is_empty() && made.len() < 32, "{} contexts in a 512 KiB host budget", made.len());
    assert!(used() <= 512 << 10);
    for id in made {
        let m = hdr(ty::CTX_DESTROY, id, 0, 0);
        assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    }
    assert_eq!(used(), before);
    // A blob's unref gives back its entries and its attachments.
    let mut m = hdr(ty::RESOURCE_UNREF, CTX, 0, 0);
    ResourceIdBody { resource_id: DATA, padding: 0 }.put(&mut m);
    assert_eq!(resp_type(&dev.process(&m)), ty::RESP_OK_NODATA);
    assert_eq!(before - used(), BLOB + 2 * BLOB_ENTRY + ATTACHMENT);
    // The device's end (the VM's, or its reset) gives back the rest.
    drop(dev);
    let t0 = std::time::Instant::now();
    while used() != base {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "{} host bytes still charged after the device went", used() - base);
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A copy between device memory and a guest blob larger than one copy
/// window (4 MiB) moves every byte to its place, across the windows and
/// the blob's pieces.
#[test]
fn a_blob_copy_larger_than_a_window_moves_every_byte() {
    const BIG: u32 = 12;
    let svc = service();
    let (mut dev, mem, _t) = device_on(&svc, "bigcopy", 32 << 20);
    ready(&mut dev);
    // 10 MiB in two pieces of guest RAM: 6 MiB, then 4 MiB.
    let pieces = [(0x40_0000u64, 6u32 << 20), (0xA0_0000, 4 << 20)];
    assert_eq!(create_blob(&mut dev, BIG, &pieces), ty::RESP_OK_NODATA);
    assert_eq!(attach(&mut dev, BIG), ty::RESP_OK_NODATA);
    let size = 10u64 << 20;
    let gpa = |off: u64| if off < 6 << 20 { 0x40_0000 + off } else { 0xA0_0000 + off - (6 << 20) };
    let byte = |i: u64| (i.wrapping_mul(2_654_435_761) >> 13) as u8;
    let fill = |f: &dyn Fn(u64) -> u8| {
        for (start, len) in pieces {
            let base = if start == 0x40_0000 { 0 } else { 6 << 20 };
            let v: Vec<u8> = (0..len as u64).map(|i| f(base + i)).collect();
            mem.write_slice(&v, GuestAddress(start)).unwrap();
        }
    };
    fill(&byte);
    let ctx = handle(call(&mut dev, &mem, Request::CtxCreate(CtxCreateReq { flags: 0, pid: 0 })));
    let d = ptr(call(&mut dev, &mem, Request::MemAlloc(MemAllocReq { ctx, reserved: 0, size })));
    let r = call(&mut dev, &mem, Request::MemcpyHtoD(MemcpyHtoDReq { ctx, stream: 0, dst: d, size, loc: DataLoc::Blob as u32, blob: BIG, shm_offset: 0 }, vec![]));
    assert_eq!(r, Reply::Empty);
    fill(&|_| 0);
    let r = call(&mut dev, &mem, Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream: 0, src: d, size, loc: DataLoc::Blob as u32, blob: BIG, shm_offset: 0 }));
    assert!(matches!(&r, Reply::Data(v) if v.is_empty()), "{r:?}");
    for off in (0..size).step_by(4093).chain([size - 1, (4 << 20) - 1, 4 << 20, (6 << 20) - 1, 6 << 20, 8 << 20]) {
        let got: u8 = mem.read_obj(GuestAddress(gpa(off))).unwrap();
        assert_eq!(got, byte(off), "byte {off:#x}");
    }
}
