//! `cuGetExportTable`: the driver's private interface tables that NVIDIA's
//! runtime (libcudart 12.x, and the copies CuPy and cuda-bindings link)
//! looks up by UUID at start-up. Written from public documentation of
//! their layout (ZLUDA's notes); docs/cuda-stacks.md describes each table.
//! Unknown tables get CUDA_ERROR_NOT_FOUND and a NULL table.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, OnceLock};

use virtio_gpu_compute::CuResult;

use crate::client::CallError;

use super::{bad, dec, enc, fail, trace_enabled, with, CUdevice, CUresult, CURRENT, H, TAG_CTX};

type Uuid = [u8; 16];

const CUDART_INTERFACE: Uuid = [0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9];
const CALLBACK_HOOKS: Uuid = [0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66];
const TOOLS_TLS: Uuid = [0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc];
const CONTEXT_STORAGE: Uuid = [0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93];
const INTEGRITY_CHECK: Uuid = [0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2];
const CONTEXT_CHECKS: Uuid = [0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e];
const STREAM_RESOLVE: Uuid = [0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2];

fn uuid_str(u: &Uuid) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

extern "C" fn noop() -> CUresult {
    0
}

// ---- CUDART_INTERFACE ---------------------------------------------------------

/// Slot 2: the device's primary context, made if need be, without taking
/// a reference (the runtime retains it itself later, and must get the
/// same handle).
unsafe extern "C" fn primary_ctx(pctx: *mut H, dev: CUdevice) -> CUresult {
    with("cudart interface: primary context", |s| {
        if pctx.is_null() {
            return Err(bad("null context pointer"));
        }
        let c = s.primary_ctx(dev)?;
        // SAFETY: checked non-null; the caller passes a CUcontext slot.
        unsafe { *pctx = enc(TAG_CTX, c) };
        Ok(())
    })
}

#[repr(C)]
struct CudartInterface {
    size: usize,
    slots: [Option<unsafe extern "C" fn()>; 12],
}

/// The table's slot 2 as a generic function pointer.
fn slot<F>(f: F) -> Option<unsafe extern "C" fn()>
where
    F: Copy,
{
    // Only function pointers are stored: same size as the erased type.
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<unsafe extern "C" fn()>(), "export table slots hold function pointers");
    // SAFETY: `F` is always an `unsafe extern "C" fn(..)` pointer here
    // (size checked above); the table stores it type-erased, and callers
    // call it with the signature the table's documentation gives.
    Some(unsafe { std::mem::transmute_copy::<F, unsafe extern "C" fn()>(&f) })
}

/// For slots a runtime does not call in normal operation: a function that
/// reads no arguments (safe to call with any, under the C convention) and
/// answers CUDA_ERROR_NOT_SUPPORTED.
extern "C" fn not_supported() -> CUresult {
    fail("cuGetExportTable slot", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "this export table entry is not supported"))
}

fn cudart_interface() -> &'static CudartInterface {
    static T: OnceLock<CudartInterface> = OnceLock::new();
    T.get_or_init(|| {
        let mut slots: [Option<unsafe extern "C" fn()>; 12] = [slot(not_supported as extern "C" fn() -> CUresult); 12];
        slots[1] = slot(primary_ctx as unsafe extern "C" fn(*mut H, CUdevice) -> CUresult);
        let n = slot(noop as extern "C" fn() -> CUresult);
        // Slots the runtime does not call in normal operation answer
        // success rather than sit NULL.
        for i in [6, 11] {
            slots[i] = n;
        }
        CudartInterface { size: 13 * 8, slots }
    })
}

// ---- tools callbacks and TLS ----------------------------------------------------

/// Hands out a zeroed array of `n` flags, made once and never freed.
fn flags(cell: &OnceLock<usize>, n: usize, ptr: *mut *mut c_void, count: *mut usize) -> CUresult {
    let p = *cell.get_or_init(|| Box::leak(vec![0u32; n].into_boxed_slice()).as_mut_ptr() as usize);
    if ptr.is_null() || count.is_null() {
        return CuResult::CUDA_ERROR_INVALID_VALUE as CUresult;
    }
    // SAFETY: checked non-null out-pointers.
    unsafe {
        *ptr = p as *mut c_void;
        *count = n;
    }
    0
}

/// Per-callback enable flags the runtime reads (all off: no tool attached).
unsafe extern "C" fn callback_flags(ptr: *mut *mut c_void, count: *mut usize) -> CUresult {
    static P: OnceLock<usize> = OnceLock::new();
    flags(&P, 1024, ptr, count)
}

/// Per-domain enable flags (all off).
unsafe extern "C" fn callback_domains(ptr: *mut *mut c_void, count: *mut usize) -> CUresult {
    static P: OnceLock<usize> = OnceLock::new();
    flags(&P, 14, ptr, count)
}

#[repr(C)]
struct Table<const N: usize> {
    size: usize,
    slots: [Option<unsafe extern "C" fn()>; N],
}

fn hooks() -> &'static Table<6> {
    static T: OnceLock<Table<6>> = OnceLock::new();
    T.get_or_init(|| {
        let n = slot(noop as extern "C" fn() -> CUresult);
        let mut slots = [n; 6];
        slots[1] = slot(callback_flags as unsafe extern "C" fn(*mut *mut c_void, *mut usize) -> CUresult);
        slots[5] = slot(callback_domains as unsafe extern "C" fn(*mut *mut c_void, *mut usize) -> CUresult);
        Table { size: 7 * 8, slots }
    })
}

/// Slot 2 (offset 0x10): the calling thread's current context (NULL when
/// it has none). cuBLASLt passes it to the 21318c60 table below.
unsafe extern "C" fn thread_context(ctx: *mut H) -> CUresult {
    if !ctx.is_null() {
        let c = CURRENT.with(|c| c.get());
        // SAFETY: checked non-null; the caller passes a CUcontext slot.
        unsafe { *ctx = if c == 0 { std::ptr::null_mut() } else { enc(TAG_CTX, c) } };
    }
    0
}

fn tools_tls() -> &'static Table<3> {
    static T: OnceLock<Table<3>> = OnceLock::new();
    T.get_or_init(|| {
        let mut slots = [slot(noop as extern "C" fn() -> CUresult); 3];
        slots[1] = slot(thread_context as unsafe extern "C" fn(*mut H) -> CUresult);
        Table { size: 4 * 8, slots }
    })
}

// ---- context-local storage ------------------------------------------------------

type Dtor = Option<unsafe extern "C" fn(H, *mut c_void, *mut c_void)>;

/// Values the runtime keeps per context, with the destructor it wants
/// called when the context goes away. Keys are the runtime's pointers.
type Stored = HashMap<(u32, usize), (usize, Dtor)>;

static STORAGE: Mutex<Option<Stored>> = Mutex::new(None);

fn storage_ctx(ctx: H) -> Result<u32, CUresult> {
    if ctx.is_null() {
        let c = CURRENT.with(|c| c.get());
        return if c == 0 { Err(CuResult::CUDA_ERROR_INVALID_CONTEXT as CUresult) } else { Ok(c) };
    }
    dec(TAG_CTX, ctx).ok_or(CuResult::CUDA_ERROR_INVALID_CONTEXT as CUresult)
}

unsafe extern "C" fn storage_put(ctx: H, key: *mut c_void, value: *mut c_void, dtor: Dtor) -> CUresult {
    let c = match storage_ctx(ctx) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let mut g = STORAGE.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    if m.len() >= 65536 && !m.contains_key(&(c, key as usize)) {
        return CuResult::CUDA_ERROR_OUT_OF_MEMORY as CUresult;
    }
    m.insert((c, key as usize), (value as usize, dtor));
    0
}

unsafe extern "C" fn storage_delete(ctx: H, key: *mut c_void) -> CUresult {
    let c = match storage_ctx(ctx) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let mut g = STORAGE.lock().unwrap_or_else(|e| e.into_inner());
    match g.as_mut().and_then(|m| m.remove(&(c, key as usize))) {
        Some(_) => 0,
        None => CuResult::CUDA_ERROR_INVALID_HANDLE as CUresult,
    }
}

unsafe extern "C" fn storage_get(value: *mut *mut c_void, ctx: H, key: *mut c_void) -> CUresult {
    let c = match storage_ctx(ctx) {
        Ok(c) => c,
        Err(e) => return e,
    };
    if value.is_null() {
        return CuResult::CUDA_ERROR_INVALID_VALUE as CUresult;
    }
    let g = STORAGE.lock().unwrap_or_else(|e| e.into_inner());
    match g.as_ref().and_then(|m| m.get(&(c, key as usize))) {
        Some((v, _)) => {
            // SAFETY: checked non-null out-pointer.
            unsafe { *value = *v as *mut c_void };
            0
        }
        None => CuResult::CUDA_ERROR_INVALID_HANDLE as CUresult,
    }
}

/// The storage table has no size entry: put, delete, get, NULL.
#[repr(C)]
struct StorageTable {
    slots: [Option<unsafe extern "C" fn()>; 4],
}

fn storage_table() -> &'static StorageTable {
    static T: OnceLock<StorageTable> = OnceLock::new();
    T.get_or_init(|| StorageTable {
        slots: [
            slot(storage_put as unsafe extern "C" fn(H, *mut c_void, *mut c_void, Dtor) -> CUresult),
            slot(storage_delete as unsafe extern "C" fn(H, *mut c_void) -> CUresult),
            slot(storage_get as unsafe extern "C" fn(*mut *mut c_void, H, *mut c_void) -> CUresult),
            None,
        ],
    })
}

/// Runs the destructors of everything stored for context `c`, which is
/// going away.
pub(super) fn context_destroyed(c: u32) {
    let gone: Vec<(usize, (usize, Dtor))> = {
        let mut g = STORAGE.lock().unwrap_or_else(|e| e.into_inner());
        let Some(m) = g.as_mut() else { return };
        let keys: Vec<(u32, usize)> = m.keys().filter(|(x, _)| *x == c).copied().collect();
        keys.into_iter().filter_map(|k| m.remove(&k).map(|v| (k.1, v))).collect()
    };
    for (key, (value, dtor)) in gone {
        if let Some(d) = dtor {
            // SAFETY: the runtime registered this destructor for this
            // (context, key, value).
            unsafe { d(enc(TAG_CTX, c), key as *mut c_void, value as *mut c_void) };
        }
    }
}

// ---- the integrity check ----------------------------------------------------------

/// MD2's substitution table (RFC 1319), built from the digits of pi.
const MD2_S: [u8; 256] = [
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199, 115, 140, 152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66, 111,
    24, 138, 23, 229, 18, 190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47, 238, 122, 169, 104, 121, 145, 21, 178, 7, 63, 148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93, 154, 90,
    144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3, 255, 25, 48, 179, 72, 165, 181, 209, 215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182, 118, 252, 107, 226, 156, 116, 4,
    241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2, 27, 96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81, 175, 58, 195, 92,
    249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205, 244, 65, 129, 77, 82, 106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74, 120, 136, 149, 139,
    227, 99, 232, 109, 233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14, 102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10, 49, 68, 80, 180, 143, 237, 31, 26, 219, 153, 141, 51, 159, 17,
    131, 20,
];

fn md2(data: &[u8]) -> [u8; 16] {
    let pad = 16 - data.len() % 16;
    let mut m = data.to_vec();
    m.extend(std::iter::repeat_n(pad as u8, pad));
    let mut c = [0u8; 16];
    let mut l = 0u8;
    for block in m.chunks(16) {
        for j in 0..16 {
            c[j] ^= MD2_S[(block[j] ^ l) as usize];
            l = c[j];
        }
    }
    m.extend_from_slice(&c);
    let mut x = [0u8; 48];
    for block in m.chunks(16) {
        for j in 0..16 {
            x[16 + j] = block[j];
            x[32 + j] = block[j] ^ x[j];
        }
        let mut t = 0u8;
        for round in 0..18u8 {
            for v in x.iter_mut() {
                *v ^= MD2_S[t as usize];
                t = *v;
            }
            t = t.wrapping_add(round);
        }
    }
    x[..16].try_into().unwrap_or([0; 16])
}

const INTEGRITY_KEY: [u8; 16] = [0x14, 0x6a, 0xdd, 0xae, 0x53, 0xa9, 0xa7, 0x52, 0xaa, 0x08, 0x41, 0x36, 0x0b, 0xf5, 0x5a, 0x9f];

fn hmac_md2(msg: &[u8]) -> [u8; 16] {
    let mut inner: Vec<u8> = INTEGRITY_KEY.iter().map(|k| k ^ 0x36).collect();
    inner.extend_from_slice(msg);
    let mut outer: Vec<u8> = INTEGRITY_KEY.iter().map(|k| k ^ 0x5c).collect();
    outer.extend_from_slice(&md2(&inner));
    md2(&outer)
}

/// What the runtime hashes about one device: UUID, PCI domain, bus, device.
pub struct DeviceId {
    pub uuid: [u8; 16],
    pub pci: [c_int; 3],
}

/// The message the integrity check signs.
#[allow(clippy::too_many_arguments)]
fn integrity_message(driver: u32, version: u32, pid: u32, tid: u32, tables: [u64; 3], time: u64, devices: &[DeviceId]) -> Vec<u8> {
    let mut m = Vec::with_capacity(48 + 28 * devices.len());
    for v in [driver, version, pid, tid] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    for t in tables {
        m.extend_from_slice(&t.to_le_bytes());
    }
    m.extend_from_slice(&time.to_le_bytes());
    for d in devices {
        m.extend_from_slice(&d.uuid);
        for v in d.pci {
            m.extend_from_slice(&v.to_le_bytes());
        }
    }
    m
}

/// Slot 1: signs the runtime's view of this driver (version, process,
/// table addresses, devices) so that the runtime can check it talks to a
/// driver that answers consistently.
unsafe extern "C" fn integrity_check(version: u32, time: u64, out: *mut [u64; 2]) -> CUresult {
    if out.is_null() {
        return CuResult::CUDA_ERROR_INVALID_VALUE as CUresult;
    }
    let result = match version % 10 {
        0 => [0x3341_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8],
        1 => [0x1841_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8],
        _ => {
            let mut devices = Vec::new();
            let r = with("cuGetExportTable integrity check", |s| {
                let a = |n| s.attribute(n).unwrap_or(0);
                devices.push(DeviceId { uuid: s.info.uuid, pci: [a(50), a(33), a(34)] });
                Ok(())
            });
            if r != 0 {
                return r;
            }
            let t = integrity_table();
            let tables = [cudart_interface() as *const _ as u64, t as *const _ as u64, t.slots[0].map(|f| f as usize as u64).unwrap_or(0)];
            // SAFETY: getpid and pthread_self have no preconditions.
            let (pid, tid) = unsafe { (libc::getpid() as u32, libc::pthread_self() as u32) };
            let msg = integrity_message(super::DRIVER_VERSION as u32, version, pid, tid, tables, time, &devices);
            let h = hmac_md2(&msg);
            [u64::from_le_bytes(h[..8].try_into().unwrap_or([0; 8])), u64::from_le_bytes(h[8..].try_into().unwrap_or([0; 8]))]
        }
    };
    // SAFETY: checked non-null; the caller passes 16 writable bytes.
    unsafe { *out = result };
    0
}

fn integrity_table() -> &'static Table<2> {
    static T: OnceLock<Table<2>> = OnceLock::new();
    T.get_or_init(|| Table { size: 3 * 8, slots: [slot(integrity_check as unsafe extern "C" fn(u32, u64, *mut [u64; 2]) -> CUresult), slot(not_supported as extern "C" fn() -> CUresult)] })
}

// ---- context checks -------------------------------------------------------------

/// Slot 2: asks the driver about a context; its first answer is a flag
/// word a driver leaves 0, and its second is left as the caller set it
/// (as NVIDIA's driver does, observed by others on real GPUs).
unsafe extern "C" fn context_check(_ctx: H, flags: *mut u32, _other: *mut *const c_void) -> CUresult {
    if !flags.is_null() {
        // SAFETY: a non-null out-pointer to a 32-bit word, from the caller.
        unsafe { *flags = 0 };
    }
    0
}

/// Slot 3: a check whose answer is 0 on the drivers observed.
extern "C" fn check_zero() -> u32 {
    0
}

fn context_checks() -> &'static Table<3> {
    static T: OnceLock<Table<3>> = OnceLock::new();
    T.get_or_init(|| Table {
        size: 4 * 8,
        slots: [slot(noop as extern "C" fn() -> CUresult), slot(context_check as unsafe extern "C" fn(H, *mut u32, *mut *const c_void) -> CUresult), slot(check_zero as extern "C" fn() -> u32)],
    })
}

// ---- 21318c60: contexts and streams as cuBLASLt keys its caches ----------------------

/// The table's slot count after its size word, as driver 595 serves it.
const STREAM_RESOLVE_SLOTS: usize = 94;

/// Slot 4: the id of a context (NULL: the current one), as
/// `cuCtxGetId` gives it. cuBLASLt keys its heuristics cache by it.
unsafe extern "C" fn context_number(ctx: H, id: *mut u64) -> CUresult {
    // SAFETY: the caller's contract is cuCtxGetId's.
    unsafe { super::ctx::cuCtxGetId(ctx, id) }
}

/// Slot 51: resolves a stream handle as a launch would (NULL and
/// CU_STREAM_LEGACY: the current context's legacy default stream;
/// CU_STREAM_PER_THREAD: this thread's default stream, made if need be)
/// to a handle that names that stream alone. The first argument (the
/// thread's context from the tools-TLS table: the stream names its own)
/// and the last (whether the caller asked for the per-thread stream, which
/// the handle says too) are not needed.
unsafe extern "C" fn resolve_stream(_thread: *mut c_void, stream: H, resolved: *mut H) -> CUresult {
    with("cuGetExportTable stream table: resolve a stream", |s| {
        let v = stream as usize;
        let r = if v == 0 || v == 1 {
            s.target(stream, super::Default::Legacy)?;
            1 as H
        } else {
            let t = s.target(stream, super::Default::PerThread)?;
            enc(super::TAG_STREAM, t.stream)
        };
        super::out(resolved, r)
    })
}

/// Slot 39: the id of a stream that slot 51 resolved, as
/// `cuStreamGetId` gives it (cuBLASLt's per-stream workspace key). The
/// first argument is the thread's context, as for slot 51.
unsafe extern "C" fn resolved_stream_id(_thread: *mut c_void, stream: H, id: *mut u64) -> CUresult {
    // SAFETY: the caller's contract is cuStreamGetId's.
    unsafe { super::library::cuStreamGetId(stream, id) }
}

/// Every other slot: a private entry point whose meaning is not known
/// here. It says which slot was called and fails cleanly.
macro_rules! unknown_slots {
    ($($n:literal),* $(,)?) => {
        fn unknown_stream_slots() -> [Option<unsafe extern "C" fn()>; STREAM_RESOLVE_SLOTS] {
            [$({
                extern "C" fn f() -> CUresult {
                    fail(concat!("export table 21318c60 slot ", stringify!($n)), CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "this private entry point is not supported on this device"))
                }
                slot(f as extern "C" fn() -> CUresult)
            }),*]
        }
    };
}
unknown_slots!(
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51,
    52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94,
);

fn stream_resolve_table() -> &'static Table<STREAM_RESOLVE_SLOTS> {
    static T: OnceLock<Table<STREAM_RESOLVE_SLOTS>> = OnceLock::new();
    T.get_or_init(|| {
        let mut slots = unknown_stream_slots();
        // Slot N is the N-th word after the size word.
        slots[4 - 1] = slot(context_number as unsafe extern "C" fn(H, *mut u64) -> CUresult);
        slots[39 - 1] = slot(resolved_stream_id as unsafe extern "C" fn(*mut c_void, H, *mut u64) -> CUresult);
        slots[51 - 1] = slot(resolve_stream as unsafe extern "C" fn(*mut c_void, H, *mut H) -> CUresult);
        Table { size: (STREAM_RESOLVE_SLOTS + 1) * 8, slots }
    })
}

// ---- the entry point ----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuGetExportTable(table: *mut *const c_void, id: *const Uuid) -> CUresult {
    if table.is_null() || id.is_null() {
        return fail("cuGetExportTable", bad("null pointer"));
    }
    // SAFETY: non-null, and a CUuuid is 16 bytes.
    let id = unsafe { *id };
    let found: Option<*const c_void> = match id {
        CUDART_INTERFACE => Some(cudart_interface() as *const _ as *const c_void),
        CALLBACK_HOOKS => Some(hooks() as *const _ as *const c_void),
        TOOLS_TLS => Some(tools_tls() as *const _ as *const c_void),
        CONTEXT_STORAGE => Some(storage_table() as *const _ as *const c_void),
        INTEGRITY_CHECK => Some(integrity_table() as *const _ as *const c_void),
        CONTEXT_CHECKS => Some(context_checks() as *const _ as *const c_void),
        STREAM_RESOLVE => Some(stream_resolve_table() as *const _ as *const c_void),
        _ => None,
    };
    if trace_enabled() {
        eprintln!("libcuda(vgpu): cuGetExportTable {}: {}", uuid_str(&id), if found.is_some() { "found" } else { "unknown" });
    }
    // SAFETY: checked non-null out-pointer.
    unsafe { *table = found.unwrap_or(std::ptr::null()) };
    match found {
        Some(_) => 0,
        None => fail("cuGetExportTable", CallError::new(CuResult::CUDA_ERROR_NOT_FOUND, format!("export table {} is unknown to this driver", uuid_str(&id)))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md2_matches_rfc_1319() {
        let hex = |d: [u8; 16]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(hex(md2(b"")), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(hex(md2(b"abc")), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(hex(md2(b"abcdefghijklmnopqrstuvwxyz")), "4e8ddff3650292ab5a4108c3aa47940b");
    }

    /// A published sample of the check (CUDA 11.8's runtime, one device).
    #[test]
    fn integrity_hash_matches_a_known_sample() {
        let dev = DeviceId { uuid: [0x67, 0x22, 0xCB, 0xCF, 0xC6, 0x61, 0xF2, 0x92, 0x74, 0xD6, 0xED, 0x23, 0x2A, 0x32, 0x13, 0x1C], pci: [0, 4, 0] };
        let msg = integrity_message(12020, 0x2B4A, 0x4D08, 0x2B78, [0x7FF8_C807_17F0, 0x7FF8_C825_E4B0, 0x7FF8_C7DD_0AD0], 0x64A3_65EE, &[dev]);
        assert_eq!(u128::from_le_bytes(hmac_md2(&msg)), 0xEAF1_3133_42BF_CD84_A7C3_4628_F214_707A);
    }
}
