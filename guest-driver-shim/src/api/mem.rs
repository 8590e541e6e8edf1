//! Device memory beyond alloc/free: unified addressing (each allocation's
//! address range is reserved in this process, so a host pointer can never
//! alias it), pointer queries, pitched allocations, unified, peer, 2D and
//! 3D copies, 16-bit and 2D memsets.

use std::ffi::{c_int, c_uint, c_void};

use virtio_gpu_compute::*;

use crate::client::{CallError, CallResult};

use super::{bad, dtod, enc, fail, host_copy, memset, out, with, Alloc, CUdeviceptr, CUresult, Default, Shim, CURRENT, H, TAG_CTX};

const PAGE: u64 = 4096;

/// Pages at the edges of device allocations, shared by neighbouring
/// allocations: how many allocations hold each one's reservation.
static EDGES: std::sync::Mutex<Option<std::collections::HashMap<u64, u32>>> = std::sync::Mutex::new(None);

fn map_none(start: u64, len: u64) -> bool {
    if len == 0 {
        return true;
    }
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; a
    // PROT_NONE anonymous reservation touches no memory of ours.
    let p = unsafe { libc::mmap(start as *mut c_void, len as usize, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE, -1, 0) };
    if p == libc::MAP_FAILED {
        return false;
    }
    if p as u64 != start {
        // Kernels before 4.17 treat the flag as a hint.
        // SAFETY: `p` is the mapping just made, of `len` bytes.
        unsafe { libc::munmap(p, len as usize) };
        return false;
    }
    true
}

fn unmap(start: u64, len: u64) {
    if len > 0 {
        // SAFETY: the range is our own PROT_NONE reservation.
        unsafe { libc::munmap(start as *mut c_void, len as usize) };
    }
}

/// The pages of `[base, base+size)`: its edge pages (which a neighbour may
/// share) and the interior range only it covers.
fn pages(base: u64, size: u64) -> (Vec<u64>, u64, u64) {
    let first = base / PAGE * PAGE;
    let last = (base + size - 1) / PAGE * PAGE;
    let edges = if first == last { vec![first] } else { vec![first, last] };
    let interior = if last > first { (first + PAGE, last) } else { (first, first) };
    (edges, interior.0, interior.1)
}

/// Reserves `[base, base+size)` in this process's address space (no
/// access, no memory), so the kernel never places a host mapping there.
/// False where something else is already mapped there.
pub(super) fn reserve(base: u64, size: u64) -> bool {
    if size == 0 {
        return false;
    }
    let (edges, lo, hi) = pages(base, size);
    let mut g = EDGES.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(std::collections::HashMap::new);
    let interior = map_none(lo, hi - lo);
    let mut held = Vec::new();
    let mut ok = interior;
    if ok {
        for p in &edges {
            match m.get_mut(p) {
                Some(n) => *n += 1,
                None if map_none(*p, PAGE) => {
                    m.insert(*p, 1);
                }
                None => {
                    ok = false;
                    break;
                }
            }
            held.push(*p);
        }
    }
    if !ok {
        // Undo: nothing of a failed reservation stays.
        if interior {
            unmap(lo, hi - lo);
        }
        for p in held {
            release_edge(m, p);
        }
    }
    ok
}

fn release_edge(m: &mut std::collections::HashMap<u64, u32>, p: u64) {
    if let Some(n) = m.get_mut(&p) {
        *n -= 1;
        if *n == 0 {
            m.remove(&p);
            unmap(p, PAGE);
        }
    }
}

/// Releases a reservation made by [`reserve`].
pub(super) fn unreserve(base: u64, a: Alloc) {
    if !a.reserved {
        return;
    }
    let (edges, lo, hi) = pages(base, a.size);
    unmap(lo, hi - lo);
    let mut g = EDGES.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(std::collections::HashMap::new);
    for p in edges {
        release_edge(m, p);
    }
}

impl Shim {
    /// Records device memory at `base` (an allocation, or a variable of
    /// `module`) and reserves its addresses.
    pub(super) fn track(&self, base: u64, size: u64, ctx: u32, module: u32) {
        let reserved = reserve(base, size);
        if !reserved && super::log_enabled() {
            eprintln!("libcuda(vgpu): device range {base:#x}+{size:#x} overlaps a host mapping; unified copies treat it as device memory");
        }
        let stale = self.st().allocs.insert(base, Alloc { size, ctx, module, reserved });
        if let Some(old) = stale {
            unreserve(base, old);
        }
    }

    pub(super) fn is_tracked(&self, p: u64) -> bool {
        self.alloc_at(p).is_some()
    }

    /// The allocation holding `p`: (base, allocation).
    fn alloc_at(&self, p: u64) -> Option<(u64, Alloc)> {
        let st = self.st();
        let (&b, &a) = st.allocs.range(..=p).next_back()?;
        (p < b + a.size).then_some((b, a))
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) -> CUresult {
    let r = with("cuMemAllocPitch", |_| {
        if pitch.is_null() || !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(bad("null pointer, zero size or element size not 4, 8 or 16"));
        }
        Ok(())
    });
    if r != 0 {
        return r;
    }
    // Rows start on the device's texture pitch alignment.
    let p = width.next_multiple_of(512);
    let Some(total) = p.checked_mul(height) else {
        return fail("cuMemAllocPitch", bad("size overflows"));
    };
    // SAFETY: forwards the caller's out-pointer.
    let r = unsafe { super::cuMemAlloc_v2(dptr, total) };
    if r == 0 {
        // SAFETY: checked non-null above.
        unsafe { *pitch = p };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuMemAllocPitch_v2(dptr, pitch, width, height, elem) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) -> CUresult {
    with("cuMemGetAddressRange", |s| {
        let (b, a) = s.alloc_at(dptr).ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_NOT_FOUND, format!("{dptr:#x} is not in a device allocation")))?;
        if !base.is_null() {
            out(base, b)?;
        }
        if !size.is_null() {
            out(size, a.size as usize)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuMemGetAddressRange_v2(base, size, dptr) }
}

/// Kernels on this device cannot reach host memory: pinned memory has no
/// device address.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(_dptr: *mut CUdeviceptr, _p: *mut c_void, _flags: c_uint) -> CUresult {
    fail("cuMemHostGetDevicePointer", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "kernels on this device cannot address host memory (no CU_MEMHOSTALLOC_DEVICEMAP)"))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer(dptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuMemHostGetDevicePointer_v2(dptr, p, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetFlags(flags: *mut c_uint, p: *mut c_void) -> CUresult {
    with("cuMemHostGetFlags", |s| match s.client().host_range(p as usize) {
        Some((_, _, false)) => out(flags, 0),
        _ => Err(bad("not pinned memory from cuMemHostAlloc")),
    })
}

// ---- pointer attributes -----------------------------------------------------

const MEMORYTYPE_HOST: u32 = 1;
const MEMORYTYPE_DEVICE: u32 = 2;

/// What this process knows about an address.
enum Owner {
    Device(u64, Alloc),
    Host(usize, usize),
    Unknown,
}

fn owner(s: &Shim, p: u64) -> Owner {
    if let Some((b, a)) = s.alloc_at(p) {
        return Owner::Device(b, a);
    }
    match s.client().host_range(p as usize) {
        Some((b, n, _)) => Owner::Host(b, n),
        None => Owner::Unknown,
    }
}

/// Writes one pointer attribute; `Ok(false)` where the attribute does not
/// apply to this pointer.
fn write_attr(o: &Owner, attr: c_int, data: *mut c_void, p: u64) -> CallResult<bool> {
    if data.is_null() {
        return Err(bad("null data pointer"));
    }
    let ctx_of = |c: u32| enc(TAG_CTX, c);
    let cur = CURRENT.with(|c| c.get());
    match (attr, o) {
        (_, Owner::Unknown) => Ok(false),
        (1, Owner::Device(_, a)) => out(data.cast::<H>(), ctx_of(a.ctx)).map(|_| true),
        (1, Owner::Host(..)) => out(data.cast::<H>(), if cur != 0 { ctx_of(cur) } else { std::ptr::null_mut() }).map(|_| true),
        (2, Owner::Device(..)) => out(data.cast::<u32>(), MEMORYTYPE_DEVICE).map(|_| true),
        (2, Owner::Host(..)) => out(data.cast::<u32>(), MEMORYTYPE_HOST).map(|_| true),
        (3, Owner::Device(..)) => out(data.cast::<u64>(), p).map(|_| true),
        (4, Owner::Host(..)) => out(data.cast::<u64>(), p).map(|_| true),
        (6, _) => out(data.cast::<u32>(), 1).map(|_| true),
        (7 | 20, Owner::Device(b, _)) => out(data.cast::<u64>(), *b).map(|_| true),
        (7 | 20, Owner::Host(b, _)) => out(data.cast::<u64>(), *b as u64).map(|_| true),
        (8 | 10 | 15 | 21, _) => out(data.cast::<u32>(), 0).map(|_| true),
        (9, _) => out(data.cast::<c_int>(), 0).map(|_| true),
        (11 | 19, Owner::Device(b, _)) => out(data.cast::<u64>(), *b).map(|_| true),
        (11 | 19, Owner::Host(b, _)) => out(data.cast::<u64>(), *b as u64).map(|_| true),
        (12 | 18, Owner::Device(_, a)) => out(data.cast::<usize>(), a.size as usize).map(|_| true),
        (12 | 18, Owner::Host(_, n)) => out(data.cast::<usize>(), *n).map(|_| true),
        (13, _) => out(data.cast::<u32>(), 1).map(|_| true),
        (14, _) => out(data.cast::<u64>(), 0).map(|_| true),
        (16, _) => out(data.cast::<c_uint>(), 3).map(|_| true),
        (17, _) => out(data.cast::<H>(), std::ptr::null_mut()).map(|_| true),
        _ => Ok(false),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut c_void, attr: c_int, p: CUdeviceptr) -> CUresult {
    with("cuPointerGetAttribute", |s| {
        let o = owner(s, p);
        if matches!(o, Owner::Unknown) {
            return Err(bad(&format!("{p:#x} is neither device memory nor pinned host memory of this process")));
        }
        if !write_attr(&o, attr, data, p)? {
            return Err(bad(&format!("pointer attribute {attr} does not apply to {p:#x}")));
        }
        Ok(())
    })
}

/// Like CUDA, answers for any pointer: attributes that do not apply to it
/// are left zeroed (a memory type of 0 means "not ours").
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttributes(n: c_uint, attrs: *const c_int, data: *mut *mut c_void, p: CUdeviceptr) -> CUresult {
    with("cuPointerGetAttributes", |s| {
        if attrs.is_null() || data.is_null() || n == 0 || n > 64 {
            return Err(bad("null arrays or a bad attribute count"));
        }
        let o = owner(s, p);
        if super::trace_enabled() {
            // SAFETY: the caller passes `n` attributes.
            let list = unsafe { std::slice::from_raw_parts(attrs, n as usize) };
            eprintln!("libcuda(vgpu): cuPointerGetAttributes {p:#x} {list:?}");
        }
        for i in 0..n as usize {
            // SAFETY: the caller passes `n` attributes and `n` data pointers.
            let (a, d) = unsafe { (*attrs.add(i), *data.add(i)) };
            if d.is_null() {
                continue;
            }
            if !write_attr(&o, a, d, p)? {
                // Zero what the attribute's type may be (at most 8 bytes).
                // Flags are C ints, as CUDA's own bindings read them.
                let size = match a {
                    2 | 6 | 8 | 9 | 10 | 13 | 15 | 16 | 21 => 4,
                    _ => 8,
                };
                // SAFETY: `d` points at a value of the attribute's type.
                unsafe { std::ptr::write_bytes(d.cast::<u8>(), 0, size) };
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuPointerSetAttribute(_value: *const c_void, attr: c_int, p: CUdeviceptr) -> CUresult {
    with("cuPointerSetAttribute", |s| {
        if !s.is_tracked(p) {
            return Err(bad("not device memory"));
        }
        // SYNC_MEMOPS: every copy on this device is already synchronous
        // with respect to its memory.
        if attr == 6 {
            Ok(())
        } else {
            Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, format!("setting pointer attribute {attr}")))
        }
    })
}

// ---- unified copies ---------------------------------------------------------

#[derive(Clone, Copy)]
enum Loc {
    Host(*mut u8),
    Device(u64),
}

impl Loc {
    fn at(self, off: u64) -> Loc {
        match self {
            Loc::Host(p) => Loc::Host(p.wrapping_add(off as usize)),
            Loc::Device(d) => Loc::Device(d + off),
        }
    }
}

fn classify(s: &Shim, p: u64) -> Loc {
    if s.is_tracked(p) {
        Loc::Device(p)
    } else {
        Loc::Host(p as *mut u8)
    }
}

/// One contiguous copy between any two locations, on `stream`.
fn copy(api: &str, dst: Loc, src: Loc, n: usize, stream: H, sync: bool, default: Default) -> CUresult {
    match (dst, src) {
        (Loc::Device(d), Loc::Host(h)) => host_copy(api, true, d, h.cast(), n, stream, sync, default),
        (Loc::Host(h), Loc::Device(d)) => host_copy(api, false, d, h.cast(), n, stream, sync, default),
        (Loc::Device(d), Loc::Device(sr)) => dtod(api, d, sr, n, stream, sync, default),
        (Loc::Host(d), Loc::Host(sr)) => with(api, |s| {
            // In stream order: after the stream's queued work.
            let t = s.target(stream, default)?;
            s.wait_all(t.ctx, &s.sync_points(t))?;
            if n > 0 {
                if d.is_null() || sr.is_null() {
                    return Err(bad("null host pointer"));
                }
                // SAFETY: the caller provides `n` bytes at each; they may overlap.
                unsafe { std::ptr::copy(sr, d, n) };
            }
            Ok(())
        }),
    }
}

fn unified(api: &str, dst: u64, src: u64, n: usize, stream: H, sync: bool, default: Default) -> CUresult {
    let Some(s) = super::READY.get() else {
        return fail(api, CallError::new(CuResult::CUDA_ERROR_NOT_INITIALIZED, "cuInit has not been called"));
    };
    copy(api, classify(s, dst), classify(s, src), n, stream, sync, default)
}

#[no_mangle]
pub extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    unified("cuMemcpy", dst, src, n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    unified("cuMemcpy", dst, src, n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    unified("cuMemcpyAsync", dst, src, n, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: H) -> CUresult {
    unified("cuMemcpyAsync", dst, src, n, stream, false, Default::PerThread)
}

/// This vGPU is the process's only device: a peer copy is a copy within it.
#[no_mangle]
pub extern "C" fn cuMemcpyPeer(dst: CUdeviceptr, _dctx: H, src: CUdeviceptr, _sctx: H, n: usize) -> CUresult {
    dtod("cuMemcpyPeer", dst, src, n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpyPeer_ptds(dst: CUdeviceptr, _dctx: H, src: CUdeviceptr, _sctx: H, n: usize) -> CUresult {
    dtod("cuMemcpyPeer", dst, src, n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpyPeerAsync(dst: CUdeviceptr, _dctx: H, src: CUdeviceptr, _sctx: H, n: usize, stream: H) -> CUresult {
    dtod("cuMemcpyPeerAsync", dst, src, n, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpyPeerAsync_ptsz(dst: CUdeviceptr, _dctx: H, src: CUdeviceptr, _sctx: H, n: usize, stream: H) -> CUresult {
    dtod("cuMemcpyPeerAsync", dst, src, n, stream, false, Default::PerThread)
}

// ---- 2D and 3D copies -------------------------------------------------------

/// `CUDA_MEMCPY3D`; `CUDA_MEMCPY2D` is its 2D subset, converted on entry.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Memcpy3D {
    src_x: usize,
    src_y: usize,
    src_z: usize,
    src_lod: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: CUdeviceptr,
    src_array: H,
    reserved0: H,
    src_pitch: usize,
    src_height: usize,
    dst_x: usize,
    dst_y: usize,
    dst_z: usize,
    dst_lod: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: CUdeviceptr,
    dst_array: H,
    reserved1: H,
    dst_pitch: usize,
    dst_height: usize,
    width: usize,
    height: usize,
    depth: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Memcpy2D {
    src_x: usize,
    src_y: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: CUdeviceptr,
    src_array: H,
    src_pitch: usize,
    dst_x: usize,
    dst_y: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: CUdeviceptr,
    dst_array: H,
    dst_pitch: usize,
    width: usize,
    height: usize,
}

impl Memcpy2D {
    fn to_3d(self) -> Memcpy3D {
        Memcpy3D {
            src_x: self.src_x,
            src_y: self.src_y,
            src_z: 0,
            src_lod: 0,
            src_type: self.src_type,
            src_host: self.src_host,
            src_device: self.src_device,
            src_array: self.src_array,
            reserved0: std::ptr::null_mut(),
            src_pitch: self.src_pitch,
            src_height: self.height,
            dst_x: self.dst_x,
            dst_y: self.dst_y,
            dst_z: 0,
            dst_lod: 0,
            dst_type: self.dst_type,
            dst_host: self.dst_host,
            dst_device: self.dst_device,
            dst_array: self.dst_array,
            reserved1: std::ptr::null_mut(),
            dst_pitch: self.dst_pitch,
            dst_height: self.height,
            width: self.width,
            height: self.height,
            depth: 1,
        }
    }
}

/// The start of one side of a 3D copy.
fn side(s: &Shim, kind: c_uint, host: *const c_void, dev: CUdeviceptr, array: H) -> CallResult<Loc> {
    match kind {
        1 if host.is_null() => Err(bad("null host pointer")),
        1 => Ok(Loc::Host(host.cast_mut().cast())),
        2 | 4 if dev == 0 => Err(bad("null device pointer")),
        2 => Ok(Loc::Device(dev)),
        4 => Ok(classify(s, dev)),
        3 => {
            let _ = array;
            Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "CUDA arrays are unsupported on this device"))
        }
        _ => Err(bad(&format!("unknown memory type {kind}"))),
    }
}

/// A 3D copy resolved: the descriptor, both sides, and each side's pitch
/// and height (rows per slice).
struct Plan {
    c: Memcpy3D,
    src: Loc,
    dst: Loc,
    pitch: (usize, usize),
    height: (usize, usize),
}

fn plan3d(s: &Shim, p: *const Memcpy3D) -> CallResult<Plan> {
    if p.is_null() {
        return Err(bad("null copy descriptor"));
    }
    // SAFETY: non-null, and the API contract makes it a CUDA_MEMCPY3D.
    let c = unsafe { *p };
    if c.src_lod != 0 || c.dst_lod != 0 {
        return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "mipmap levels are unsupported"));
    }
    if (c.height > 1 || c.depth > 1) && (c.src_pitch < c.width || c.dst_pitch < c.width) {
        return Err(bad("pitch smaller than the row width"));
    }
    if c.depth > 1 && (c.src_height < c.height || c.dst_height < c.height) {
        return Err(bad("slice height smaller than the copy's height"));
    }
    // Every offset the copy touches must be representable: the furthest
    // byte on each side, computed with overflow checks.
    let last = |x: usize, y: usize, z: usize, pitch: usize, height: usize| -> Option<usize> {
        let rows = z.checked_add(c.depth.max(1) - 1)?.checked_mul(height.max(c.height))?.checked_add(y)?.checked_add(c.height.max(1) - 1)?;
        rows.checked_mul(pitch.max(c.width))?.checked_add(x)?.checked_add(c.width)
    };
    if last(c.src_x, c.src_y, c.src_z, c.src_pitch, c.src_height).is_none() || last(c.dst_x, c.dst_y, c.dst_z, c.dst_pitch, c.dst_height).is_none() {
        return Err(bad("copy extents overflow"));
    }
    let src = side(s, c.src_type, c.src_host, c.src_device, c.src_array)?;
    let dst = side(s, c.dst_type, c.dst_host, c.dst_device, c.dst_array)?;
    Ok(Plan { c, src, dst, pitch: (c.src_pitch.max(c.width), c.dst_pitch.max(c.width)), height: (c.src_height.max(c.height), c.dst_height.max(c.height)) })
}

fn copy3d(api: &str, p: *const Memcpy3D, stream: H, sync: bool, default: Default) -> CUresult {
    let mut plan = None;
    let r = with(api, |s| {
        plan = Some(plan3d(s, p)?);
        Ok(())
    });
    let Some(Plan { c, src, dst, pitch: (sp, dp), height: (sh, dh) }) = plan else { return r };
    let rows = (c.height.max(1), c.depth.max(1));
    let offsets = |z: usize, y: usize| (((c.src_z + z) * sh + c.src_y + y) * sp + c.src_x, ((c.dst_z + z) * dh + c.dst_y + y) * dp + c.dst_x);
    // A copy whose rows and slices are contiguous on both sides is one copy.
    let flat = |pitch: usize, height: usize| (rows.0 == 1 || pitch == c.width) && (rows.1 == 1 || height * pitch == rows.0 * c.width);
    if flat(sp, sh) && flat(dp, dh) {
        let (so, d_o) = offsets(0, 0);
        return copy(api, dst.at(d_o as u64), src.at(so as u64), c.width * rows.0 * rows.1, stream, sync, default);
    }
    for z in 0..rows.1 {
        for y in 0..rows.0 {
            let (so, d_o) = offsets(z, y);
            let last = z + 1 == rows.1 && y + 1 == rows.0;
            let r = copy(api, dst.at(d_o as u64), src.at(so as u64), c.width, stream, sync && last, default);
            if r != 0 {
                return r;
            }
        }
    }
    0
}

fn copy2d(api: &str, p: *const Memcpy2D, stream: H, sync: bool, default: Default) -> CUresult {
    if p.is_null() {
        return fail(api, bad("null copy descriptor"));
    }
    // SAFETY: non-null, and the API contract makes it a CUDA_MEMCPY2D.
    let c = unsafe { *p }.to_3d();
    copy3d(api, &c, stream, sync, default)
}

#[no_mangle]
pub extern "C" fn cuMemcpy2D_v2(p: *const Memcpy2D) -> CUresult {
    copy2d("cuMemcpy2D", p, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpy2D_v2_ptds(p: *const Memcpy2D) -> CUresult {
    copy2d("cuMemcpy2D", p, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpy2DUnaligned_v2(p: *const Memcpy2D) -> CUresult {
    copy2d("cuMemcpy2DUnaligned", p, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpy2DUnaligned_v2_ptds(p: *const Memcpy2D) -> CUresult {
    copy2d("cuMemcpy2DUnaligned", p, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpy2DAsync_v2(p: *const Memcpy2D, stream: H) -> CUresult {
    copy2d("cuMemcpy2DAsync", p, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpy2DAsync_v2_ptsz(p: *const Memcpy2D, stream: H) -> CUresult {
    copy2d("cuMemcpy2DAsync", p, stream, false, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpy3D_v2(p: *const Memcpy3D) -> CUresult {
    copy3d("cuMemcpy3D", p, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpy3D_v2_ptds(p: *const Memcpy3D) -> CUresult {
    copy3d("cuMemcpy3D", p, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemcpy3DAsync_v2(p: *const Memcpy3D, stream: H) -> CUresult {
    copy3d("cuMemcpy3DAsync", p, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemcpy3DAsync_v2_ptsz(p: *const Memcpy3D, stream: H) -> CUresult {
    copy3d("cuMemcpy3DAsync", p, stream, false, Default::PerThread)
}

// ---- memsets ----------------------------------------------------------------

#[no_mangle]
pub extern "C" fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) -> CUresult {
    memset("cuMemsetD16", dst, v as u32, 2, n, std::ptr::null_mut(), true, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize) -> CUresult {
    memset("cuMemsetD16", dst, v as u32, 2, n, std::ptr::null_mut(), true, Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD16Async", dst, v as u32, 2, n, stream, false, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: u16, n: usize, stream: H) -> CUresult {
    memset("cuMemsetD16Async", dst, v as u32, 2, n, stream, false, Default::PerThread)
}

/// A 2D memset: one fill where the rows are contiguous, else one per row.
#[allow(clippy::too_many_arguments)]
fn memset2d(api: &str, dst: CUdeviceptr, pitch: usize, v: u32, elem: u32, width: usize, height: usize, stream: H, sync: bool, default: Default) -> CUresult {
    let row = width * elem as usize;
    if height <= 1 || pitch == row {
        return memset(api, dst, v, elem, width * height, stream, sync, default);
    }
    if pitch < row {
        return fail(api, bad("pitch smaller than the row width"));
    }
    for y in 0..height {
        let r = memset(api, dst + (y * pitch) as u64, v, elem, width, stream, sync && y + 1 == height, default);
        if r != 0 {
            return r;
        }
    }
    0
}

macro_rules! memset2d_fns {
    ($($name:ident, $ptname:ident, $api:literal, $ty:ty, $elem:literal;)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name(dst: CUdeviceptr, pitch: usize, v: $ty, w: usize, h: usize) -> CUresult {
            memset2d($api, dst, pitch, v as u32, $elem, w, h, std::ptr::null_mut(), true, Default::Legacy)
        }
        #[no_mangle]
        pub extern "C" fn $ptname(dst: CUdeviceptr, pitch: usize, v: $ty, w: usize, h: usize) -> CUresult {
            memset2d($api, dst, pitch, v as u32, $elem, w, h, std::ptr::null_mut(), true, Default::PerThread)
        }
    )*};
}

macro_rules! memset2d_async_fns {
    ($($name:ident, $ptname:ident, $api:literal, $ty:ty, $elem:literal;)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name(dst: CUdeviceptr, pitch: usize, v: $ty, w: usize, h: usize, stream: H) -> CUresult {
            memset2d($api, dst, pitch, v as u32, $elem, w, h, stream, false, Default::Legacy)
        }
        #[no_mangle]
        pub extern "C" fn $ptname(dst: CUdeviceptr, pitch: usize, v: $ty, w: usize, h: usize, stream: H) -> CUresult {
            memset2d($api, dst, pitch, v as u32, $elem, w, h, stream, false, Default::PerThread)
        }
    )*};
}

memset2d_fns! {
    cuMemsetD2D8_v2, cuMemsetD2D8_v2_ptds, "cuMemsetD2D8", u8, 1;
    cuMemsetD2D16_v2, cuMemsetD2D16_v2_ptds, "cuMemsetD2D16", u16, 2;
    cuMemsetD2D32_v2, cuMemsetD2D32_v2_ptds, "cuMemsetD2D32", c_uint, 4;
}

memset2d_async_fns! {
    cuMemsetD2D8Async, cuMemsetD2D8Async_ptsz, "cuMemsetD2D8Async", u8, 1;
    cuMemsetD2D16Async, cuMemsetD2D16Async_ptsz, "cuMemsetD2D16Async", u16, 2;
    cuMemsetD2D32Async, cuMemsetD2D32Async_ptsz, "cuMemsetD2D32Async", c_uint, 4;
}
