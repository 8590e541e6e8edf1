//! The NVML queries monitoring tools and frameworks make (nvitop, gpustat,
//! pynvml, PyTorch), answered for the one GPU a tenant sees. The same
//! shared object is installed as `libnvidia-ml.so.1` beside
//! `libcuda.so.1`, so no NVIDIA library is needed in the guest.
//!
//! What they answer: one device (index 0); its name, UUID (as the
//! mediator's metrics print it) and compute capability; memory as the
//! tenant's quota (total), what it holds (used) and the rest (free);
//! utilization as the tenant's share of the device's time since the
//! previous query. What a vGPU has no value for (temperature, power, fans,
//! clocks, PCI address) answers `NVML_ERROR_NOT_SUPPORTED`, as NVML does
//! on NVIDIA's own vGPUs. The running-process lists hold the tenant's own
//! processes that have contexts on the device (each gave its pid, as this
//! system numbers it, when it made them) and the device memory each
//! holds; other tenants' processes are never listed.

// These are C entry points: their callers hold NVML's contract for every
// pointer they pass, as with NVIDIA's library, so they are not `unsafe fn`
// to Rust; each dereference says what it relies on.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use virtio_gpu_compute::nvml::*;
use virtio_gpu_compute::{name_str, uuid_text, DeviceInfo, ProcessInfo, TenantInfo};

use crate::client::Client;

/// The one device's handle.
const HANDLE: usize = 0x76_6770;

struct Session {
    client: Arc<Client>,
    /// The process that connected: a forked child connects again.
    pid: u32,
    /// Inits not yet shut down.
    refs: u32,
    /// The tenant's device time at the previous utilization query.
    last: (Instant, u64),
}

static SESSION: Mutex<Option<Session>> = Mutex::new(None);

fn session<T>(f: impl FnOnce(&mut Session) -> Result<T, NvmlReturn>) -> Result<T, NvmlReturn> {
    let mut g = SESSION.lock().unwrap_or_else(|e| e.into_inner());
    f(g.as_mut().ok_or(UNINITIALIZED)?)
}

/// The session's connection, for a query made without holding the lock
/// (one slow answer does not hold up every other thread's queries).
fn client() -> Result<Arc<Client>, NvmlReturn> {
    session(|s| {
        if s.pid != std::process::id() {
            // A forked child does not share its parent's connection.
            s.client = Arc::new(Client::from_env().map_err(|_| DRIVER_NOT_LOADED)?);
            s.pid = std::process::id();
        }
        Ok(s.client.clone())
    })
}

fn device(h: *mut c_void) -> Result<DeviceInfo, NvmlReturn> {
    if h as usize != HANDLE {
        return Err(INVALID_ARGUMENT);
    }
    client()?.device_info().map_err(|_| UNKNOWN)
}

fn tenant(h: *mut c_void) -> Result<TenantInfo, NvmlReturn> {
    if h as usize != HANDLE {
        return Err(INVALID_ARGUMENT);
    }
    client()?.tenant_info().map_err(|_| UNKNOWN)
}

fn init() -> NvmlReturn {
    entry(|| {
        let mut g = SESSION.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = g.as_mut() {
            s.refs += 1;
            return Ok(());
        }
        let client = Client::from_env().map_err(|_| DRIVER_NOT_LOADED)?;
        let ns = client.tenant_info().map_err(|_| DRIVER_NOT_LOADED)?.device_ns;
        *g = Some(Session { client: Arc::new(client), pid: std::process::id(), refs: 1, last: (Instant::now(), ns) });
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    init()
}

#[no_mangle]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    init()
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    init()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    entry(|| {
        let mut g = SESSION.lock().unwrap_or_else(|e| e.into_inner());
        let s = g.as_mut().ok_or(UNINITIALIZED)?;
        s.refs -= 1;
        if s.refs == 0 {
            *g = None;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(r: NvmlReturn) -> *const c_char {
    error_string(r)
}

#[no_mangle]
pub extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> NvmlReturn {
    entry(|| session(|_| Ok(())).and_then(|()| put_text(buf, len, &crate::api::driver_version_text())))
}

#[no_mangle]
pub extern "C" fn nvmlSystemGetNVMLVersion(buf: *mut c_char, len: c_uint) -> NvmlReturn {
    entry(|| put_text(buf, len, &crate::api::driver_version_text()))
}

#[no_mangle]
pub extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) -> NvmlReturn {
    entry(|| put(v, crate::api::DRIVER_VERSION))
}

#[no_mangle]
pub extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> NvmlReturn {
    nvmlSystemGetCudaDriverVersion(v)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetCount_v2(n: *mut c_uint) -> NvmlReturn {
    entry(|| session(|_| Ok(())).and_then(|()| put(n, 1)))
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetCount(n: *mut c_uint) -> NvmlReturn {
    nvmlDeviceGetCount_v2(n)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetHandleByIndex_v2(i: c_uint, h: *mut *mut c_void) -> NvmlReturn {
    entry(|| {
        session(|_| Ok(()))?;
        if i != 0 {
            return Err(INVALID_ARGUMENT);
        }
        put(h, HANDLE as *mut c_void)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetHandleByIndex(i: c_uint, h: *mut *mut c_void) -> NvmlReturn {
    nvmlDeviceGetHandleByIndex_v2(i, h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, h: *mut *mut c_void) -> NvmlReturn {
    entry(|| {
        if uuid.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: a NUL-terminated string, by NVML's contract.
        let want = unsafe { std::ffi::CStr::from_ptr(uuid) }.to_string_lossy().into_owned();
        let d = device(HANDLE as *mut c_void)?;
        if uuid_text(&d.uuid) != want {
            return Err(NOT_FOUND);
        }
        put(h, HANDLE as *mut c_void)
    })
}

/// The tenant sees one GPU, whatever PCI address CUDA reported for it
/// (PyTorch looks its device up this way, and asserts that it is found).
#[no_mangle]
pub extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(bus: *const c_char, h: *mut *mut c_void) -> NvmlReturn {
    entry(|| {
        if bus.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        device(HANDLE as *mut c_void)?;
        put(h, HANDLE as *mut c_void)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetHandleByPciBusId(bus: *const c_char, h: *mut *mut c_void) -> NvmlReturn {
    nvmlDeviceGetHandleByPciBusId_v2(bus, h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetIndex(h: *mut c_void, i: *mut c_uint) -> NvmlReturn {
    entry(|| device(h).and_then(|_| put(i, 0)))
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetName(h: *mut c_void, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    entry(|| device(h).and_then(|d| put_text(buf, len, &name_str(&d.name))))
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetUUID(h: *mut c_void, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    entry(|| device(h).and_then(|d| put_text(buf, len, &uuid_text(&d.uuid))))
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetCudaComputeCapability(h: *mut c_void, major: *mut c_int, minor: *mut c_int) -> NvmlReturn {
    entry(|| {
        let d = device(h)?;
        put(major, d.cc_major as c_int)?;
        put(minor, d.cc_minor as c_int)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetMemoryInfo(h: *mut c_void, m: *mut Memory) -> NvmlReturn {
    entry(|| {
        let t = tenant(h)?;
        put(m, Memory { total: t.quota, free: t.quota.saturating_sub(t.used), used: t.used })
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetMemoryInfo_v2(h: *mut c_void, m: *mut MemoryV2) -> NvmlReturn {
    entry(|| {
        if m.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null; the caller set `version` in its struct.
        if unsafe { (*m).version } != MEMORY_V2 {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let t = tenant(h)?;
        put(m, MemoryV2 { version: MEMORY_V2, total: t.quota, reserved: 0, free: t.quota.saturating_sub(t.used), used: t.used })
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetUtilizationRates(h: *mut c_void, u: *mut Utilization) -> NvmlReturn {
    entry(|| {
        if h as usize != HANDLE {
            return Err(INVALID_ARGUMENT);
        }
        let ns = client()?.tenant_info().map_err(|_| UNKNOWN)?.device_ns;
        let gpu = session(|s| {
            let now = Instant::now();
            let (t0, ns0) = std::mem::replace(&mut s.last, (now, ns));
            let wall = now.duration_since(t0).as_nanos().max(1) as f64;
            Ok((100.0 * ns.saturating_sub(ns0) as f64 / wall).round().min(100.0) as c_uint)
        })?;
        put(u, Utilization { gpu, memory: 0 })
    })
}

/// The tenant's processes holding contexts on the device, each with the
/// device memory its contexts hold (an executor too old to list them
/// answers none).
fn processes(h: *mut c_void) -> Result<Vec<ProcessInfo>, NvmlReturn> {
    device(h)?;
    match client()?.processes() {
        Ok(v) => Ok(v),
        Err(e) if e.code == virtio_gpu_compute::CuResult::CUDA_ERROR_INVALID_VALUE => Ok(Vec::new()),
        Err(_) => Err(UNKNOWN),
    }
}

fn compute_processes_v2(h: *mut c_void, count: *mut c_uint, infos: *mut ProcessInfoV2) -> NvmlReturn {
    entry(|| {
        let list: Vec<ProcessInfoV2> = processes(h)?.iter().map(|p| ProcessInfoV2 { pid: p.pid, used_gpu_memory: p.used, gpu_instance_id: NO_INSTANCE, compute_instance_id: NO_INSTANCE }).collect();
        put_list(count, infos, &list)
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(h: *mut c_void, count: *mut c_uint, infos: *mut ProcessInfoV2) -> NvmlReturn {
    compute_processes_v2(h, count, infos)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(h: *mut c_void, count: *mut c_uint, infos: *mut ProcessInfoV2) -> NvmlReturn {
    compute_processes_v2(h, count, infos)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetComputeRunningProcesses(h: *mut c_void, count: *mut c_uint, infos: *mut ProcessInfoV1) -> NvmlReturn {
    entry(|| {
        let list: Vec<ProcessInfoV1> = processes(h)?.iter().map(|p| ProcessInfoV1 { pid: p.pid, used_gpu_memory: p.used }).collect();
        put_list(count, infos, &list)
    })
}

/// A compute device runs no graphics: an empty list.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(h: *mut c_void, count: *mut c_uint, infos: *mut ProcessInfoV2) -> NvmlReturn {
    entry(|| device(h).and_then(|_| put_list(count, infos, &[])))
}

/// A process's name, from this system's /proc (where the pids the running
/// process lists give live, when the caller shares their PID namespace):
/// its argv[0], else its command name; cropped to `length` bytes with
/// its NUL, as NVML does.
#[no_mangle]
pub extern "C" fn nvmlSystemGetProcessName(pid: c_uint, name: *mut c_char, length: c_uint) -> NvmlReturn {
    entry(|| {
        session(|_| Ok(()))?;
        if length == 0 {
            return Err(INVALID_ARGUMENT);
        }
        let text = process_name(pid).ok_or(NOT_FOUND)?;
        let mut end = text.len().min(length as usize - 1);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        put_text(name, length, &text[..end])
    })
}

/// `/proc/PID/cmdline`'s argv[0], else `/proc/PID/comm`.
pub fn process_name(pid: u32) -> Option<String> {
    if pid == 0 {
        return None;
    }
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let first = cmd.split(|b| *b == 0).next().unwrap_or_default();
    if !first.is_empty() {
        return Some(String::from_utf8_lossy(first).into_owned());
    }
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim_end().to_string())
}

/// Queries a vGPU has no value for.
fn not_supported(h: *mut c_void) -> NvmlReturn {
    entry(|| device(h).and(Err(NOT_SUPPORTED)))
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetTemperature(h: *mut c_void, _sensor: c_uint, _t: *mut c_uint) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetPowerUsage(h: *mut c_void, _mw: *mut c_uint) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetEnforcedPowerLimit(h: *mut c_void, _mw: *mut c_uint) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetFanSpeed(h: *mut c_void, _pct: *mut c_uint) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetClockInfo(h: *mut c_void, _clock: c_uint, _mhz: *mut c_uint) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetPciInfo_v3(h: *mut c_void, _pci: *mut c_void) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetPersistenceMode(h: *mut c_void, _mode: *mut c_uint) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(h: *mut c_void, _link: c_uint, _kind: *mut c_uint) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(h: *mut c_void, _link: c_uint, _pci: *mut c_void) -> NvmlReturn {
    not_supported(h)
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetGpuFabricInfoV(h: *mut c_void, _info: *mut c_void) -> NvmlReturn {
    not_supported(h)
}
