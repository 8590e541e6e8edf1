//! The NVML entry points GPU discovery calls (`libnvidia-ml.so.1`).
//!
//! A GPU's handle is `0x1000 * (index + 1)`; its MIG instance m's is that
//! plus `m + 1`.

// These are C entry points: their callers hold the driver API's contract
// for every pointer they pass, as with NVIDIA's library, so they are not
// `unsafe fn` to Rust; each dereference says what it relies on.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_char, c_uint, c_void};

use virtio_gpu_compute::nvml::*;

use crate::config::{uuid_text, Device};
use crate::driver;

static INITED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn ready() -> Result<(), NvmlReturn> {
    if INITED.load(std::sync::atomic::Ordering::Acquire) {
        Ok(())
    } else {
        Err(UNINITIALIZED)
    }
}

/// The GPU and (for a MIG handle) the instance a handle names.
fn resolve(h: *mut c_void) -> Result<(usize, Option<u32>), NvmlReturn> {
    let v = h as usize;
    let (gpu, mig) = (v / 0x1000, v % 0x1000);
    let gpus = driver().gpus.as_ref().map_err(|_| DRIVER_NOT_LOADED)?;
    let g = gpu.checked_sub(1).filter(|g| *g < gpus.len()).ok_or(INVALID_ARGUMENT)?;
    match mig {
        0 => Ok((g, None)),
        m if (m as u32) <= gpus[g].migs => Ok((g, Some(m as u32 - 1))),
        _ => Err(INVALID_ARGUMENT),
    }
}

fn dev_of(h: *mut c_void) -> Result<(usize, Option<u32>, Option<&'static Device>), NvmlReturn> {
    let (g, m) = resolve(h)?;
    Ok((g, m, driver().devices.iter().find(|d| d.gpu == g && d.mig == m)))
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    entry(|| {
        driver().gpus.as_ref().map_err(|_| DRIVER_NOT_LOADED)?;
        INITED.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    entry(ready)
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(r: NvmlReturn) -> *const c_char {
    error_string(r)
}

#[no_mangle]
pub extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> NvmlReturn {
    entry(|| {
        ready()?;
        put_text(buf, len, "580.0-vgpu-testdriver")
    })
}

#[no_mangle]
pub extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut i32) -> NvmlReturn {
    entry(|| {
        ready()?;
        put(v, crate::cuda::DRIVER_VERSION)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetCount_v2(n: *mut c_uint) -> NvmlReturn {
    entry(|| {
        ready()?;
        put(n, driver().gpus.as_ref().map_err(|_| DRIVER_NOT_LOADED)?.len() as c_uint)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetHandleByIndex_v2(i: c_uint, h: *mut *mut c_void) -> NvmlReturn {
    entry(|| {
        ready()?;
        let n = driver().gpus.as_ref().map_err(|_| DRIVER_NOT_LOADED)?.len();
        if i as usize >= n {
            return Err(INVALID_ARGUMENT);
        }
        put(h, (0x1000 * (i as usize + 1)) as *mut c_void)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetName(h: *mut c_void, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    entry(|| {
        ready()?;
        let (_, m, d) = dev_of(h)?;
        // A GPU in MIG mode has no device of its own in `devices`.
        let name = match (m, d) {
            (_, Some(d)) => d.name.clone(),
            (None, None) => "NVIDIA test double (vgpu-testdriver)".into(),
            (Some(_), None) => return Err(INVALID_ARGUMENT),
        };
        put_text(buf, len, &name)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetUUID(h: *mut c_void, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    entry(|| {
        ready()?;
        let (g, m, d) = dev_of(h)?;
        let text = match d {
            Some(d) => d.uuid_text(),
            None if m.is_none() => {
                let mut u = *b"vgpu-testdrv\0\0\0\0";
                u[12] = g as u8;
                u[14] = 0xff;
                uuid_text("GPU", &u)
            }
            None => return Err(INVALID_ARGUMENT),
        };
        put_text(buf, len, &text)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetPciInfo_v3(h: *mut c_void, info: *mut PciInfo) -> NvmlReturn {
    entry(|| {
        ready()?;
        let (g, m) = resolve(h)?;
        if m.is_some() {
            return Err(INVALID_ARGUMENT);
        }
        let id = Device::nvml_bus_id(g);
        let mut bus_id = [0 as c_char; 32];
        for (o, b) in bus_id.iter_mut().zip(id.bytes()) {
            *o = b as c_char;
        }
        let mut legacy = [0 as c_char; 16];
        for (o, b) in legacy.iter_mut().zip(id[4..].bytes()).take(15) {
            *o = b as c_char;
        }
        put(info, PciInfo { bus_id_legacy: legacy, domain: 0, bus: 0x10 + g as c_uint, device: 0, pci_device_id: 0x2330_10de, pci_sub_system_id: 0, bus_id })
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetMemoryInfo_v2(h: *mut c_void, mem: *mut MemoryV2) -> NvmlReturn {
    entry(|| {
        ready()?;
        let (g, m) = resolve(h)?;
        let gpu = &driver().gpus.as_ref().map_err(|_| DRIVER_NOT_LOADED)?[g];
        let total = if m.is_some() { gpu.memory / gpu.migs as u64 } else { gpu.memory };
        if mem.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null; the caller set its version field.
        let version = unsafe { (*mem).version };
        put(mem, MemoryV2 { version, total, reserved: 0, free: total, used: 0 })
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetMigMode(h: *mut c_void, current: *mut c_uint, pending: *mut c_uint) -> NvmlReturn {
    entry(|| {
        ready()?;
        let (g, m) = resolve(h)?;
        if m.is_some() {
            return Err(INVALID_ARGUMENT);
        }
        let on = (driver().gpus.as_ref().map_err(|_| DRIVER_NOT_LOADED)?[g].migs > 0) as c_uint;
        put(current, on)?;
        put(pending, on)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(h: *mut c_void, i: c_uint, mh: *mut *mut c_void) -> NvmlReturn {
    entry(|| {
        ready()?;
        let (g, m) = resolve(h)?;
        if m.is_some() {
            return Err(INVALID_ARGUMENT);
        }
        if i >= driver().gpus.as_ref().map_err(|_| DRIVER_NOT_LOADED)?[g].migs {
            return Err(NOT_FOUND);
        }
        put(mh, (h as usize + i as usize + 1) as *mut c_void)
    })
}
