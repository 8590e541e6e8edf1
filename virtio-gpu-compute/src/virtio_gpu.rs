//! The virtio-gpu commands the compute device implements (virtio spec 5.7,
//! Linux `include/uapi/linux/virtio_gpu.h`), decoded with every length and
//! count checked, and the framing of compute messages inside SUBMIT_3D.

use crate::wire::{wire_struct, Reader, Wire};
use crate::WireError;

pub const F_VIRGL: u64 = 1 << 0;
pub const F_RESOURCE_BLOB: u64 = 1 << 3;
pub const F_CONTEXT_INIT: u64 = 1 << 4;

pub const FLAG_FENCE: u32 = 1 << 0;
pub const FLAG_INFO_RING_IDX: u32 = 1 << 1;

pub const BLOB_MEM_GUEST: u32 = 1;
pub const BLOB_FLAG_USE_MAPPABLE: u32 = 1;
pub const BLOB_FLAG_USE_SHAREABLE: u32 = 2;
pub const BLOB_FLAG_USE_CROSS_DEVICE: u32 = 4;

/// Rings a context may name in `ring_idx` (the driver's limit is 64).
pub const MAX_RINGS: u8 = 64;
pub const MAX_SCANOUTS: usize = 16;
/// Most (addr, len) entries one blob may list.
pub const MAX_BLOB_ENTRIES: u32 = 16384;
/// Largest SUBMIT_3D payload.
pub const MAX_SUBMIT: u32 = 8 << 20;
pub const CTX_CAPSET_ID_MASK: u32 = 0xff;

/// Command and response types.
pub mod ty {
    pub const GET_DISPLAY_INFO: u32 = 0x0100;
    pub const RESOURCE_CREATE_2D: u32 = 0x0101;
    pub const RESOURCE_UNREF: u32 = 0x0102;
    pub const SET_SCANOUT: u32 = 0x0103;
    pub const RESOURCE_FLUSH: u32 = 0x0104;
    pub const TRANSFER_TO_HOST_2D: u32 = 0x0105;
    pub const RESOURCE_ATTACH_BACKING: u32 = 0x0106;
    pub const RESOURCE_DETACH_BACKING: u32 = 0x0107;
    pub const GET_CAPSET_INFO: u32 = 0x0108;
    pub const GET_CAPSET: u32 = 0x0109;
    pub const GET_EDID: u32 = 0x010a;
    pub const RESOURCE_CREATE_BLOB: u32 = 0x010c;
    pub const CTX_CREATE: u32 = 0x0200;
    pub const CTX_DESTROY: u32 = 0x0201;
    pub const CTX_ATTACH_RESOURCE: u32 = 0x0202;
    pub const CTX_DETACH_RESOURCE: u32 = 0x0203;
    pub const SUBMIT_3D: u32 = 0x0207;
    pub const UPDATE_CURSOR: u32 = 0x0300;
    pub const MOVE_CURSOR: u32 = 0x0301;
    pub const RESOURCE_CREATE_3D: u32 = 0x0204;
    pub const RESP_OK_NODATA: u32 = 0x1100;
    pub const RESP_OK_DISPLAY_INFO: u32 = 0x1101;
    pub const RESP_OK_CAPSET_INFO: u32 = 0x1102;
    pub const RESP_OK_CAPSET: u32 = 0x1103;
    pub const RESP_ERR_UNSPEC: u32 = 0x1200;
    pub const RESP_ERR_OUT_OF_MEMORY: u32 = 0x1201;
    pub const RESP_ERR_INVALID_SCANOUT_ID: u32 = 0x1202;
    pub const RESP_ERR_INVALID_RESOURCE_ID: u32 = 0x1203;
    pub const RESP_ERR_INVALID_CONTEXT_ID: u32 = 0x1204;
    pub const RESP_ERR_INVALID_PARAMETER: u32 = 0x1205;
}

wire_struct! {
    /// Leads every command and response.
    pub struct CtrlHdr {
        pub ty: u32,
        pub flags: u32,
        pub fence_id: u64,
        pub ctx_id: u32,
        pub ring_idx: u8,
        pub padding: [u8; 3],
    }
}

impl CtrlHdr {
    /// The response header for a command: its fence, context and ring echoed.
    pub fn response(&self, ty: u32) -> CtrlHdr {
        CtrlHdr { ty, flags: self.flags & (FLAG_FENCE | FLAG_INFO_RING_IDX), fence_id: self.fence_id, ctx_id: self.ctx_id, ring_idx: self.ring_idx, padding: [0; 3] }
    }
}

wire_struct! { pub struct Rect { pub x: u32, pub y: u32, pub width: u32, pub height: u32 } }
wire_struct! { pub struct CapsetInfoReq { pub capset_index: u32, pub padding: u32 } }
wire_struct! { pub struct CapsetInfoResp { pub capset_id: u32, pub capset_max_version: u32, pub capset_max_size: u32, pub padding: u32 } }
wire_struct! { pub struct GetCapsetReq { pub capset_id: u32, pub capset_version: u32 } }
wire_struct! { pub struct CtxCreateBody { pub nlen: u32, pub context_init: u32, pub debug_name: [u8; 64] } }
wire_struct! { pub struct ResourceIdBody { pub resource_id: u32, pub padding: u32 } }
wire_struct! {
    pub struct CreateBlobBody {
        pub resource_id: u32,
        pub blob_mem: u32,
        pub blob_flags: u32,
        pub nr_entries: u32,
        pub blob_id: u64,
        pub size: u64,
    }
}
wire_struct! { pub struct MemEntry { pub addr: u64, pub length: u32, pub padding: u32 } }
wire_struct! { pub struct SubmitBody { pub size: u32, pub padding: u32 } }
wire_struct! { pub struct Create2dBody { pub resource_id: u32, pub format: u32, pub width: u32, pub height: u32 } }
wire_struct! { pub struct AttachBackingBody { pub resource_id: u32, pub nr_entries: u32 } }

/// A decoded control-queue command.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuCommand {
    GetDisplayInfo,
    GetCapsetInfo(CapsetInfoReq),
    GetCapset(GetCapsetReq),
    CtxCreate(CtxCreateBody),
    CtxDestroy,
    CtxAttachResource(ResourceIdBody),
    CtxDetachResource(ResourceIdBody),
    ResourceCreateBlob(CreateBlobBody, Vec<MemEntry>),
    ResourceUnref(ResourceIdBody),
    Submit3d(Vec<u8>),
    /// A 2D resource (the kernel's framebuffer console makes one).
    Create2d(Create2dBody),
    /// Display commands of the compatibility scanout: accepted, no effect.
    Display2d(u32),
    /// Cursor-queue commands: accepted, no effect.
    Cursor(u32),
    /// Anything else: answered with ERR_UNSPEC.
    Unsupported(u32),
}

/// Decodes a command. Each type's fixed body must be present; trailers
/// (blob entries, submit payload) must be exactly as long as stated.
pub fn decode_command(bytes: &[u8]) -> Result<(CtrlHdr, GpuCommand), WireError> {
    let mut r = Reader::new(bytes);
    let h = CtrlHdr::get(&mut r)?;
    let cmd = match h.ty {
        ty::GET_DISPLAY_INFO => GpuCommand::GetDisplayInfo,
        ty::GET_CAPSET_INFO => GpuCommand::GetCapsetInfo(CapsetInfoReq::get(&mut r)?),
        ty::GET_CAPSET => GpuCommand::GetCapset(GetCapsetReq::get(&mut r)?),
        ty::CTX_CREATE => {
            let b = CtxCreateBody::get(&mut r)?;
            if b.nlen > 64 {
                return Err(WireError::BadField { what: "context name length", value: b.nlen as u64 });
            }
            GpuCommand::CtxCreate(b)
        }
        ty::CTX_DESTROY => GpuCommand::CtxDestroy,
        ty::CTX_ATTACH_RESOURCE => GpuCommand::CtxAttachResource(ResourceIdBody::get(&mut r)?),
        ty::CTX_DETACH_RESOURCE => GpuCommand::CtxDetachResource(ResourceIdBody::get(&mut r)?),
        ty::RESOURCE_CREATE_BLOB => {
            let b = CreateBlobBody::get(&mut r)?;
            if b.nr_entries > MAX_BLOB_ENTRIES {
                return Err(WireError::TooLarge { what: "blob entry count", len: b.nr_entries as u64, max: MAX_BLOB_ENTRIES as u64 });
            }
            let need = b.nr_entries as usize * MemEntry::SIZE;
            if r.remaining() < need {
                return Err(WireError::LengthMismatch { what: "blob entries", stated: need as u64, actual: r.remaining() as u64 });
            }
            let mut entries = Vec::with_capacity(b.nr_entries as usize);
            for _ in 0..b.nr_entries {
                entries.push(MemEntry::get(&mut r)?);
            }
            GpuCommand::ResourceCreateBlob(b, entries)
        }
        ty::RESOURCE_UNREF => GpuCommand::ResourceUnref(ResourceIdBody::get(&mut r)?),
        ty::SUBMIT_3D => {
            let b = SubmitBody::get(&mut r)?;
            if b.size > MAX_SUBMIT {
                return Err(WireError::TooLarge { what: "submit payload", len: b.size as u64, max: MAX_SUBMIT as u64 });
            }
            if (r.remaining() as u64) < b.size as u64 {
                return Err(WireError::LengthMismatch { what: "submit payload", stated: b.size as u64, actual: r.remaining() as u64 });
            }
            GpuCommand::Submit3d(r.take(b.size as usize)?.to_vec())
        }
        ty::RESOURCE_CREATE_2D => GpuCommand::Create2d(Create2dBody::get(&mut r)?),
        ty::SET_SCANOUT | ty::RESOURCE_FLUSH | ty::TRANSFER_TO_HOST_2D | ty::RESOURCE_ATTACH_BACKING | ty::RESOURCE_DETACH_BACKING => {
            // Bodies are checked for presence only: the stubs ignore them.
            let min = match h.ty {
                ty::SET_SCANOUT => Rect::SIZE + 8,
                ty::RESOURCE_FLUSH => Rect::SIZE + 8,
                ty::TRANSFER_TO_HOST_2D => Rect::SIZE + 16,
                _ => AttachBackingBody::SIZE,
            };
            r.take(min)?;
            GpuCommand::Display2d(h.ty)
        }
        ty::UPDATE_CURSOR | ty::MOVE_CURSOR => GpuCommand::Cursor(h.ty),
        other => GpuCommand::Unsupported(other),
    };
    Ok((h, cmd))
}

/// The device config space: events_read, events_clear, num_scanouts,
/// num_capsets (one: the compute capset).
pub fn config_space(num_scanouts: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[8..12].copy_from_slice(&num_scanouts.to_le_bytes());
    c[12..16].copy_from_slice(&1u32.to_le_bytes());
    c
}

/// "VGPS": leads every compute message inside a SUBMIT_3D.
pub const SUBMIT_MAGIC: u32 = u32::from_le_bytes(*b"VGPS");

wire_struct! {
    /// Precedes the compute message in a SUBMIT_3D payload: where in which
    /// blob (attached to the context) the worker writes the reply before
    /// it signals the command's fence.
    pub struct SubmitHeader {
        pub magic: u32,
        pub reply_blob: u32,
        pub reply_offset: u64,
        pub reply_capacity: u32,
        pub reserved: u32,
    }
}

impl SubmitHeader {
    /// Splits a SUBMIT_3D payload into its header and compute message.
    pub fn split(payload: &[u8]) -> Result<(SubmitHeader, &[u8]), WireError> {
        let mut r = Reader::new(payload);
        let h = SubmitHeader::get(&mut r)?;
        if h.magic != SUBMIT_MAGIC {
            return Err(WireError::BadMagic(h.magic));
        }
        if h.reserved != 0 {
            return Err(WireError::NonZeroReserved("submit header"));
        }
        if h.reply_blob == 0 {
            return Err(WireError::BadField { what: "reply blob", value: 0 });
        }
        h.reply_offset.checked_add(h.reply_capacity as u64).ok_or(WireError::BadField { what: "reply range", value: h.reply_offset })?;
        Ok((h, r.rest()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(ty: u32) -> Vec<u8> {
        let mut v = Vec::new();
        CtrlHdr { ty, flags: FLAG_FENCE, fence_id: 7, ctx_id: 1, ring_idx: 0, padding: [0; 3] }.put(&mut v);
        v
    }

    #[test]
    fn layouts_match_the_linux_uapi_sizes() {
        assert_eq!(CtrlHdr::SIZE, 24);
        assert_eq!(CtxCreateBody::SIZE, 72);
        assert_eq!(CreateBlobBody::SIZE, 32);
        assert_eq!(MemEntry::SIZE, 16);
        assert_eq!(CapsetInfoResp::SIZE, 16);
    }

    #[test]
    fn blob_entries_and_submit_payloads_are_bounded_by_what_arrived() {
        let mut m = hdr(ty::RESOURCE_CREATE_BLOB);
        CreateBlobBody { resource_id: 1, blob_mem: BLOB_MEM_GUEST, blob_flags: 1, nr_entries: 2, blob_id: 0, size: 8192 }.put(&mut m);
        MemEntry { addr: 0x1000, length: 4096, padding: 0 }.put(&mut m);
        assert!(matches!(decode_command(&m), Err(WireError::LengthMismatch { .. })));
        MemEntry { addr: 0x3000, length: 4096, padding: 0 }.put(&mut m);
        let (_, c) = decode_command(&m).unwrap();
        assert!(matches!(c, GpuCommand::ResourceCreateBlob(_, ref e) if e.len() == 2));

        let mut m = hdr(ty::RESOURCE_CREATE_BLOB);
        CreateBlobBody { resource_id: 1, blob_mem: 1, blob_flags: 1, nr_entries: u32::MAX, blob_id: 0, size: 1 }.put(&mut m);
        assert!(matches!(decode_command(&m), Err(WireError::TooLarge { .. })));

        let mut m = hdr(ty::SUBMIT_3D);
        SubmitBody { size: 100, padding: 0 }.put(&mut m);
        m.extend_from_slice(&[0; 40]);
        assert!(matches!(decode_command(&m), Err(WireError::LengthMismatch { .. })), "a submit whose size exceeds its descriptor");
        assert!(decode_command(&m[..10]).is_err(), "truncated header");
        let (_, c) = decode_command(&hdr(0x0999)).unwrap();
        assert_eq!(c, GpuCommand::Unsupported(0x999));
    }

    #[test]
    fn responses_echo_fence_context_and_ring() {
        let h = CtrlHdr { ty: ty::SUBMIT_3D, flags: FLAG_FENCE | FLAG_INFO_RING_IDX, fence_id: 42, ctx_id: 3, ring_idx: 5, padding: [0; 3] };
        let r = h.response(ty::RESP_OK_NODATA);
        assert_eq!((r.ty, r.flags, r.fence_id, r.ctx_id, r.ring_idx), (ty::RESP_OK_NODATA, 3, 42, 3, 5));
    }
}
