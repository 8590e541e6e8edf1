//! NVML's C ABI as the libraries answering `libnvidia-ml.so.1` use it (the
//! guest shim and the test double of NVIDIA's driver): return codes, the
//! structs they fill, and the helpers every entry point runs through.

use std::ffi::{c_char, c_uint};

pub type NvmlReturn = c_uint;
pub const SUCCESS: NvmlReturn = 0;
pub const UNINITIALIZED: NvmlReturn = 1;
pub const INVALID_ARGUMENT: NvmlReturn = 2;
pub const NOT_SUPPORTED: NvmlReturn = 3;
pub const NOT_FOUND: NvmlReturn = 6;
pub const INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const DRIVER_NOT_LOADED: NvmlReturn = 9;
pub const ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub const UNKNOWN: NvmlReturn = 999;

/// `nvmlPciInfo_t` (the `_v3` query's layout).
#[repr(C)]
pub struct PciInfo {
    pub bus_id_legacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [c_char; 32],
}

/// `nvmlMemory_t`.
#[repr(C)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct MemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2` as `NVML_STRUCT_VERSION(Memory, 2)` names it.
pub const MEMORY_V2: c_uint = (std::mem::size_of::<MemoryV2>() as c_uint) | (2 << 24);

/// `nvmlUtilization_t`.
#[repr(C)]
pub struct Utilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlProcessInfo_v1_t`: what the unversioned running-process queries fill.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_v2_t` (also `nvmlProcessInfo_t`): what the `_v2` and
/// `_v3` running-process queries fill.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ProcessInfoV2 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    /// [`NO_INSTANCE`] outside MIG.
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// The instance ids of a process not on a MIG instance.
pub const NO_INSTANCE: c_uint = u32::MAX;

/// Fills a caller's array as NVML's list queries do: `*count` says how many
/// entries `infos` holds; a list that does not fit (or a null `infos` when
/// the list is not empty) returns INSUFFICIENT_SIZE with the length needed
/// in `*count`; otherwise the entries are written and `*count` is their
/// number (for C entry points, as [`put`]).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn put_list<T: Copy>(count: *mut c_uint, infos: *mut T, list: &[T]) -> Result<(), NvmlReturn> {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract makes it a valid c_uint.
    let room = unsafe { count.read() } as usize;
    let n = list.len() as c_uint;
    if list.len() > room || (infos.is_null() && !list.is_empty()) {
        put(count, n)?;
        return Err(INSUFFICIENT_SIZE);
    }
    for (i, v) in list.iter().enumerate() {
        // SAFETY: non-null (checked when the list is not empty) and the
        // caller said it holds `room` >= list.len() entries.
        unsafe { infos.add(i).write(*v) };
    }
    put(count, n)
}

/// Runs an entry point's body: its error code, and UNKNOWN for a panic,
/// which must not unwind into C.
pub fn entry(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => UNKNOWN,
    }
}

/// `nvmlErrorString`: a static, NUL-terminated text for `r`.
pub fn error_string(r: NvmlReturn) -> *const c_char {
    let s: &'static [u8] = match r {
        SUCCESS => b"Success\0",
        UNINITIALIZED => b"Uninitialized\0",
        INVALID_ARGUMENT => b"Invalid Argument\0",
        NOT_SUPPORTED => b"Not Supported\0",
        NOT_FOUND => b"Not Found\0",
        INSUFFICIENT_SIZE => b"Insufficient Size\0",
        DRIVER_NOT_LOADED => b"Driver Not Loaded\0",
        ARGUMENT_VERSION_MISMATCH => b"Argument Version Mismatch\0",
        _ => b"Unknown Error\0",
    };
    s.as_ptr().cast()
}

/// Writes through an out-pointer the caller passed. For C entry points,
/// whose callers hold NVML's contract for every pointer they pass.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn put<T>(p: *mut T, v: T) -> Result<(), NvmlReturn> {
    if p.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract makes it valid for a T.
    unsafe { p.write(v) };
    Ok(())
}

/// Copies `s` and its NUL into the caller's `len`-byte buffer (for C
/// entry points, as [`put`]).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn put_text(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if s.len() >= len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: the caller's buffer holds `len` bytes, more than s.len().
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}
