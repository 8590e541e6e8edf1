//! Stream-ordered allocation (`cuMemAllocAsync`, `cuMemFreeAsync`) and
//! memory pools (`cuMemPool*`, the device's default and current pool, the
//! CUDA 13 forms by location), as the runtimes' `cudaMallocAsync` family
//! and CuPy's and PyTorch's asynchronous allocators call them.
//!
//! Every pool allocation is an ordinary device allocation of the stream's
//! context, charged to the tenant's quota when it is made: a pool never
//! holds memory the quota does not count, and its release threshold keeps
//! nothing back (freed memory goes back to the quota at once). An
//! allocation is usable by work queued on its stream after it, as CUDA
//! promises; `cuMemFreeAsync` frees once the context's queued work is done
//! (stronger than stream order, never weaker). Capturing streams refuse
//! both (CUDA records them as graph nodes; this device does not yet).
//! Pools cannot be shared between processes (their IPC entry points stay
//! unsupported).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard};

use virtio_gpu_compute::CuResult;

use super::{alloc_device, bad, dec, enc, free_device, graph, invalid_handle, out, with, CUdevice, CUdeviceptr, CUresult, Default, H};
use crate::client::{CallError, CallResult};

pub(super) const TAG_POOL: usize = 0xCB;
/// Pools a process may create, besides the device's default one.
const MAX_POOLS: usize = 1024;

// CUmemPool_attribute: the three reuse flags (1 to 3), then 64-bit values.
const ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: c_int = 1;
const ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: c_int = 3;
const ATTR_RELEASE_THRESHOLD: c_int = 4;
const ATTR_RESERVED_MEM_CURRENT: c_int = 5;
const ATTR_RESERVED_MEM_HIGH: c_int = 6;
const ATTR_USED_MEM_CURRENT: c_int = 7;
const ATTR_USED_MEM_HIGH: c_int = 8;

// CUmemLocationType, CUmemAllocationType, CUmemAccess_flags.
const LOCATION_DEVICE: c_int = 1;
const ALLOCATION_PINNED: c_int = 1;
const ACCESS_READWRITE: c_int = 3;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `CUmemPoolProps` (88 bytes).
#[repr(C)]
pub struct PoolProps {
    alloc_type: c_int,
    handle_types: c_int,
    location: MemLocation,
    win32_security_attributes: *mut c_void,
    max_size: usize,
    usage: u16,
    reserved: [u8; 54],
}

/// `CUmemAccessDesc`.
#[repr(C)]
pub struct AccessDesc {
    location: MemLocation,
    flags: c_int,
}

#[derive(Default)]
struct Pool {
    /// Reuse policy flags and the release threshold: kept and reported,
    /// with no effect on when memory goes back to the quota.
    reuse: [c_int; 3],
    threshold: u64,
    used: u64,
    high: u64,
    /// A bound on what the pool may hold (`maxSize`), 0 for none.
    max: u64,
}

#[derive(Default)]
struct Pools {
    next: u32,
    pools: HashMap<u32, Pool>,
    /// The pool `cuMemAllocAsync` uses (the default pool until set).
    current: Option<u32>,
    /// Each pool allocation's pool and size.
    allocs: HashMap<CUdeviceptr, (u32, u64)>,
}

/// The device's default pool's id.
const DEFAULT_POOL: u32 = 1;

static POOLS: Mutex<Option<Pools>> = Mutex::new(None);

fn pools() -> MutexGuard<'static, Option<Pools>> {
    POOLS.lock().unwrap_or_else(|e| e.into_inner())
}

fn with_pools<R>(f: impl FnOnce(&mut Pools) -> R) -> R {
    let mut g = pools();
    let p = g.get_or_insert_with(|| {
        let mut p = Pools { next: DEFAULT_POOL, ..Pools::default() };
        p.pools.insert(DEFAULT_POOL, Pool::default());
        p
    });
    f(p)
}

fn pool_id(h: H) -> CallResult<u32> {
    let id = dec(TAG_POOL, h).ok_or_else(|| invalid_handle("memory pool"))?;
    if with_pools(|p| p.pools.contains_key(&id)) {
        Ok(id)
    } else {
        Err(invalid_handle("memory pool"))
    }
}

/// The device a location names; this vGPU has device 0 only.
fn location_device(loc: *const MemLocation) -> CallResult<CUdevice> {
    if loc.is_null() {
        return Err(bad("null location"));
    }
    // SAFETY: non-null; the caller passes a CUmemLocation.
    let l = unsafe { *loc };
    if l.kind != LOCATION_DEVICE {
        return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, format!("memory pools of location type {} (only device memory pools exist here)", l.kind)));
    }
    Ok(l.id)
}

fn check_alloc_type(t: c_int) -> CallResult<()> {
    if t != ALLOCATION_PINNED {
        return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, format!("allocation type {t} (only pinned device memory)")));
    }
    Ok(())
}

// ---- the device's pools -------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut H, dev: CUdevice) -> CUresult {
    with("cuDeviceGetDefaultMemPool", |s| {
        s.device(dev)?;
        out(pool, enc(TAG_POOL, with_pools(|_| DEFAULT_POOL)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut H, dev: CUdevice) -> CUresult {
    with("cuDeviceGetMemPool", |s| {
        s.device(dev)?;
        out(pool, enc(TAG_POOL, with_pools(|p| p.current.unwrap_or(DEFAULT_POOL))))
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceSetMemPool(dev: CUdevice, pool: H) -> CUresult {
    with("cuDeviceSetMemPool", |s| {
        s.device(dev)?;
        let id = pool_id(pool)?;
        with_pools(|p| p.current = Some(id));
        Ok(())
    })
}

/// CUDA 13: the default pool of a location and allocation type.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetDefaultMemPool(pool: *mut H, loc: *const MemLocation, alloc_type: c_int) -> CUresult {
    with("cuMemGetDefaultMemPool", |s| {
        s.device(location_device(loc)?)?;
        check_alloc_type(alloc_type)?;
        out(pool, enc(TAG_POOL, with_pools(|_| DEFAULT_POOL)))
    })
}

/// CUDA 13: the current pool of a location and allocation type.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetMemPool(pool: *mut H, loc: *const MemLocation, alloc_type: c_int) -> CUresult {
    with("cuMemGetMemPool", |s| {
        s.device(location_device(loc)?)?;
        check_alloc_type(alloc_type)?;
        out(pool, enc(TAG_POOL, with_pools(|p| p.current.unwrap_or(DEFAULT_POOL))))
    })
}

/// CUDA 13: sets the current pool of a location and allocation type.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetMemPool(loc: *const MemLocation, alloc_type: c_int, pool: H) -> CUresult {
    with("cuMemSetMemPool", |s| {
        s.device(location_device(loc)?)?;
        check_alloc_type(alloc_type)?;
        let id = pool_id(pool)?;
        with_pools(|p| p.current = Some(id));
        Ok(())
    })
}

// ---- pools --------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(pool: *mut H, props: *const PoolProps) -> CUresult {
    with("cuMemPoolCreate", |s| {
        if props.is_null() || pool.is_null() {
            return Err(bad("null pointer"));
        }
        // SAFETY: non-null; the caller passes a CUmemPoolProps.
        let pr = unsafe { &*props };
        check_alloc_type(pr.alloc_type)?;
        if pr.handle_types != 0 {
            return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "pools shareable with other processes"));
        }
        let loc = pr.location;
        s.device(location_device(&loc)?)?;
        let max = pr.max_size as u64;
        let id = with_pools(|p| {
            if p.pools.len() > MAX_POOLS {
                return Err(CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, format!("more than {MAX_POOLS} memory pools")));
            }
            p.next += 1;
            p.pools.insert(p.next, Pool { max, ..Pool::default() });
            Ok(p.next)
        })?;
        out(pool, enc(TAG_POOL, id))
    })
}

/// Destroys a pool; its allocations stay valid until freed (as CUDA's do
/// until their frees complete). The default pool cannot be destroyed.
#[no_mangle]
pub extern "C" fn cuMemPoolDestroy(pool: H) -> CUresult {
    with("cuMemPoolDestroy", |_| {
        let id = pool_id(pool)?;
        if id == DEFAULT_POOL {
            return Err(bad("the device's default pool cannot be destroyed"));
        }
        with_pools(|p| {
            p.pools.remove(&id);
            if p.current == Some(id) {
                p.current = None;
            }
        });
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(pool: H, attr: c_int, value: *mut c_void) -> CUresult {
    with("cuMemPoolGetAttribute", |_| {
        let id = pool_id(pool)?;
        if value.is_null() {
            return Err(bad("null value pointer"));
        }
        let v = with_pools(|p| {
            // Another thread may have destroyed it since pool_id().
            let pl = p.pools.get(&id).ok_or_else(|| invalid_handle("memory pool"))?;
            match attr {
                ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => Ok(Err(pl.reuse[(attr - 1) as usize])),
                ATTR_RELEASE_THRESHOLD => Ok(Ok(pl.threshold)),
                // Nothing is reserved beyond what is in use.
                ATTR_RESERVED_MEM_CURRENT | ATTR_USED_MEM_CURRENT => Ok(Ok(pl.used)),
                ATTR_RESERVED_MEM_HIGH | ATTR_USED_MEM_HIGH => Ok(Ok(pl.high)),
                _ => Err(bad("unknown memory pool attribute")),
            }
        })?;
        match v {
            // SAFETY: the reuse attributes are C ints, the others 64-bit
            // values, as CUDA documents for each; `value` is non-null.
            Err(i) => unsafe { value.cast::<c_int>().write(i) },
            // SAFETY: as above.
            Ok(u) => unsafe { value.cast::<u64>().write(u) },
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(pool: H, attr: c_int, value: *const c_void) -> CUresult {
    with("cuMemPoolSetAttribute", |_| {
        let id = pool_id(pool)?;
        if value.is_null() {
            return Err(bad("null value pointer"));
        }
        with_pools(|p| {
            let pl = p.pools.get_mut(&id).ok_or_else(|| invalid_handle("memory pool"))?;
            match attr {
                // SAFETY: a C int for the reuse attributes; `value` is non-null.
                ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => pl.reuse[(attr - 1) as usize] = unsafe { value.cast::<c_int>().read() },
                // SAFETY: a 64-bit value; `value` is non-null.
                ATTR_RELEASE_THRESHOLD => pl.threshold = unsafe { value.cast::<u64>().read() },
                // The high-water marks may only be reset (to 0).
                // SAFETY: a 64-bit value; `value` is non-null.
                ATTR_RESERVED_MEM_HIGH | ATTR_USED_MEM_HIGH => match unsafe { value.cast::<u64>().read() } {
                    0 => pl.high = pl.used,
                    _ => return Err(bad("a pool's high-water mark can only be reset to 0")),
                },
                _ => return Err(bad("unknown or read-only memory pool attribute")),
            }
            Ok(())
        })
    })
}

/// Memory goes back to the quota when it is freed: there is nothing to trim.
#[no_mangle]
pub extern "C" fn cuMemPoolTrimTo(pool: H, _min_bytes: usize) -> CUresult {
    with("cuMemPoolTrimTo", |_| pool_id(pool).map(|_| ()))
}

/// The only device may read and write every pool's memory.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAccess(pool: H, map: *const AccessDesc, count: usize) -> CUresult {
    with("cuMemPoolSetAccess", |s| {
        pool_id(pool)?;
        if count > 0 && map.is_null() {
            return Err(bad("null access descriptors"));
        }
        for i in 0..count.min(64) {
            // SAFETY: the caller passes `count` descriptors at `map`.
            let d = unsafe { &*map.add(i) };
            s.device(location_device(&d.location)?)?;
            if d.flags != ACCESS_READWRITE {
                return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "a pool's own device always reads and writes it"));
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAccess(flags: *mut c_int, pool: H, loc: *const MemLocation) -> CUresult {
    with("cuMemPoolGetAccess", |s| {
        pool_id(pool)?;
        s.device(location_device(loc)?)?;
        out(flags, ACCESS_READWRITE)
    })
}

// ---- stream-ordered allocation ------------------------------------------------

fn alloc_async(api: &str, dptr: *mut CUdeviceptr, size: usize, pool: Option<H>, stream: H, default: Default) -> CUresult {
    with(api, |s| {
        if dptr.is_null() {
            return Err(bad("null pointer"));
        }
        if size == 0 {
            return Err(bad("size is 0"));
        }
        let t = s.target(stream, default)?;
        if graph::capturing(t) {
            return Err(CallError::new(CuResult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "stream-ordered allocation while the stream captures (graph allocation nodes are not supported)"));
        }
        let id = match pool {
            Some(h) => pool_id(h)?,
            None => with_pools(|p| p.current.unwrap_or(DEFAULT_POOL)),
        };
        let over = with_pools(|p| p.pools.get(&id).is_some_and(|pl| pl.max > 0 && pl.used.saturating_add(size as u64) > pl.max));
        if over {
            return Err(CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "the pool's maximum size"));
        }
        let p = alloc_device(s, t.ctx, size as u64)?;
        with_pools(|ps| {
            ps.allocs.insert(p, (id, size as u64));
            if let Some(pl) = ps.pools.get_mut(&id) {
                pl.used += size as u64;
                pl.high = pl.high.max(pl.used);
            }
        });
        out(dptr, p)
    })
}

fn free_async(api: &str, dptr: CUdeviceptr, stream: H, default: Default) -> CUresult {
    with(api, |s| {
        let t = s.target(stream, default)?;
        if graph::capturing(t) {
            return Err(CallError::new(CuResult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "stream-ordered free while the stream captures (graph free nodes are not supported)"));
        }
        if dptr == 0 {
            return Ok(());
        }
        let owner = s.st().allocs.get(&dptr).filter(|a| a.module == 0).map(|a| a.ctx);
        let ctx = owner.ok_or_else(|| bad("not the start of a device allocation"))?;
        free_device(s, ctx, dptr)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: H) -> CUresult {
    alloc_async("cuMemAllocAsync", dptr, size, None, stream, Default::Legacy)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: H) -> CUresult {
    alloc_async("cuMemAllocAsync", dptr, size, None, stream, Default::PerThread)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: H, stream: H) -> CUresult {
    alloc_async("cuMemAllocFromPoolAsync", dptr, size, Some(pool), stream, Default::Legacy)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: H, stream: H) -> CUresult {
    alloc_async("cuMemAllocFromPoolAsync", dptr, size, Some(pool), stream, Default::PerThread)
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, stream: H) -> CUresult {
    free_async("cuMemFreeAsync", dptr, stream, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: H) -> CUresult {
    free_async("cuMemFreeAsync", dptr, stream, Default::PerThread)
}

/// A freed allocation leaves its pool's count (whichever call freed it).
pub(super) fn forget(dptr: CUdeviceptr) {
    let mut g = pools();
    if let Some(ps) = g.as_mut() {
        if let Some((id, size)) = ps.allocs.remove(&dptr) {
            if let Some(pl) = ps.pools.get_mut(&id) {
                pl.used = pl.used.saturating_sub(size);
            }
        }
    }
}
