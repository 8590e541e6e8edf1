//! Context-independent libraries and kernels (`cuLibrary*`, `cuKernel*`),
//! function attributes, occupancy, the JIT linker (`cuLink*`), extended
//! and host-function launches, and stream and capture queries.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_gpu_compute::fatbin;
use virtio_gpu_compute::*;

use crate::client::{CallError, CallResult};

use super::{bad, dec, enc, fail, get_function, get_global, image_bytes, invalid_handle, load_image, out, with, CUdevice, CUdeviceptr, CUresult, Default, Shim, H, TAG_FUNC, TAG_MOD};

pub(super) const TAG_LIB: usize = 0xC6;
pub(super) const TAG_KERNEL: usize = 0xC7;
pub(super) const TAG_LINK: usize = 0xC8;

/// A function's settable attributes.
#[derive(Clone, Copy)]
pub(super) struct FuncConf {
    max_dynamic_shared: c_int,
    carveout: c_int,
    cache: c_uint,
}

impl FuncConf {
    pub fn new(info: &DeviceInfo) -> FuncConf {
        // CUDA's default dynamic shared memory limit is 48 KiB, or less on
        // a device with less.
        FuncConf { max_dynamic_shared: info.max_shared_per_block.min(48 * 1024) as c_int, carveout: -1, cache: 0 }
    }
}

struct Library {
    image: Arc<Vec<u8>>,
    /// Its kernels' names, found when first asked for.
    entries: Arc<std::sync::OnceLock<Vec<String>>>,
    /// The module it is loaded as, per context.
    modules: HashMap<u32, u32>,
}

struct Kernel {
    lib: u32,
    name: CString,
    /// Its function, per context.
    funcs: HashMap<u32, u32>,
}

#[derive(Default)]
struct Libs {
    next: u32,
    libs: HashMap<u32, Library>,
    kernels: HashMap<u32, Kernel>,
    /// (library, name) to kernel id: one handle per kernel.
    by_name: HashMap<(u32, String), u32>,
}

static LIBS: Mutex<Option<Libs>> = Mutex::new(None);

fn libs() -> MutexGuard<'static, Option<Libs>> {
    LIBS.lock().unwrap_or_else(|e| e.into_inner())
}

fn with_libs<R>(f: impl FnOnce(&mut Libs) -> R) -> R {
    f(libs().get_or_insert_with(Libs::default))
}

impl Shim {
    /// Library `lib`'s module in context `ctx`, loaded on first use there.
    fn lib_module(&self, lib: u32, ctx: u32) -> CallResult<u32> {
        let (image, loaded) = with_libs(|l| l.libs.get(&lib).map(|x| (x.image.clone(), x.modules.get(&ctx).copied()))).ok_or_else(|| invalid_handle("library"))?;
        if let Some(m) = loaded.filter(|m| self.st().modules.contains_key(m)) {
            return Ok(m);
        }
        if image.is_empty() {
            return Err(CallError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, "the library's fatbin has no PTX: its kernels are machine code for real GPUs only"));
        }
        let m = load_image(self, ctx, &image)?;
        // Another thread may have loaded it meanwhile: keep one. (The
        // handle tables' lock is never taken inside the libraries' one.)
        let other = with_libs(|l| l.libs.get(&lib).and_then(|x| x.modules.get(&ctx).copied()));
        if let Some(o) = other.filter(|o| *o != m && self.st().modules.contains_key(o)) {
            let _ = self.client().empty(Request::ModuleUnload(ModuleReq { ctx, module: m }));
            self.forget_module(m);
            return Ok(o);
        }
        with_libs(|l| l.libs.get_mut(&lib).map(|x| x.modules.insert(ctx, m)));
        Ok(m)
    }

    /// Kernel `k`'s function in the current context.
    fn kernel_func(&self, k: u32) -> CallResult<u32> {
        let ctx = self.current()?;
        let (lib, name, cached) = with_libs(|l| l.kernels.get(&k).map(|x| (x.lib, x.name.clone(), x.funcs.get(&ctx).copied()))).ok_or_else(|| invalid_handle("kernel"))?;
        if let Some(f) = cached.filter(|f| self.st().funcs.contains_key(f)) {
            return Ok(f);
        }
        let m = self.lib_module(lib, ctx)?;
        let f = get_function(self, ctx, m, name.to_str().unwrap_or(""))?;
        with_libs(|l| l.kernels.get_mut(&k).map(|x| x.funcs.insert(ctx, f)));
        Ok(f)
    }

    /// A `CUfunction` or a `CUkernel` (CUDA 12 accepts either wherever a
    /// function is launched or queried) as a function id.
    pub(super) fn func_id(&self, h: H) -> CallResult<u32> {
        if let Some(f) = dec(TAG_FUNC, h) {
            return Ok(f);
        }
        let k = dec(TAG_KERNEL, h).ok_or_else(|| invalid_handle("function"))?;
        self.kernel_func(k)
    }

    fn func(&self, h: H) -> CallResult<Arc<super::Func>> {
        let id = self.func_id(h)?;
        self.st().funcs.get(&id).cloned().ok_or_else(|| invalid_handle("function"))
    }
}

// ---- libraries --------------------------------------------------------------

fn load_library(s: &Shim, lib: *mut H, bytes: &[u8]) -> CallResult<()> {
    if lib.is_null() {
        return Err(bad("null library pointer"));
    }
    // A fatbin is kept as only what this device can use.
    // A fatbin with nothing this device runs (cubins only, as libraries
    // ship their architecture-specific kernels) is kept as no image at all:
    // the library loads, and its kernels fail where they are first used.
    let image = Arc::new(match ImageFormat::sniff(bytes) {
        ImageFormat::Fatbin => match super::select_for(s, bytes) {
            Ok(image) => image,
            Err(e) if e.code == CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU => Vec::new(),
            Err(e) => return Err(e),
        },
        _ => bytes.to_vec(),
    });
    let entries = Arc::new(std::sync::OnceLock::new());
    let id = with_libs(|l| {
        l.next += 1;
        l.libs.insert(l.next, Library { image, entries, modules: HashMap::new() });
        l.next
    });
    // Under eager loading, load it now where a context is current, so a
    // bad image fails here. One with nothing this device runs (a fatbin of
    // cubins only, as libraries ship their architecture-specific kernels)
    // loads: its kernels fail where they are first used, with
    // CUDA_ERROR_NO_BINARY_FOR_GPU. Under lazy loading (CUDA's default)
    // each context loads it when one of its kernels or globals is first
    // asked for: cuBLAS loads about 2 600 libraries and uses a handful.
    if let Some(ctx) = s.current().ok().filter(|_| !lazy_loading()) {
        match s.lib_module(id, ctx) {
            Err(e) if e.code != CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU => {
                with_libs(|l| l.libs.remove(&id));
                return Err(e);
            }
            _ => {}
        }
    }
    out(lib, enc(TAG_LIB, id))
}

/// Loads a library; its code is loaded into each context when first used
/// there (CUDA's lazy loading). JIT and library options are accepted and
/// have no effect on this device.
#[no_mangle]
pub unsafe extern "C" fn cuLibraryLoadData(lib: *mut H, image: *const c_void, _jo: *mut c_int, _jv: *mut *mut c_void, _nj: c_uint, _lo: *mut c_int, _lv: *mut *mut c_void, _nl: c_uint) -> CUresult {
    with("cuLibraryLoadData", |s| {
        // SAFETY: per the API contract `image` points at a module image.
        let bytes = unsafe { image_bytes(image)? };
        load_library(s, lib, bytes)
    })
}

fn read_file(path: *const c_char) -> CallResult<Vec<u8>> {
    if path.is_null() {
        return Err(bad("null path"));
    }
    // SAFETY: per the API contract `path` is a NUL-terminated string.
    let p = unsafe { CStr::from_ptr(path) }.to_string_lossy().into_owned();
    let mut data = std::fs::read(&p).map_err(|e| CallError::new(CuResult::CUDA_ERROR_FILE_NOT_FOUND, format!("{p}: {e}")))?;
    if ImageFormat::sniff(&data) == ImageFormat::Ptx && data.last() != Some(&0) {
        data.push(0);
    }
    Ok(data)
}

#[no_mangle]
pub unsafe extern "C" fn cuLibraryLoadFromFile(lib: *mut H, path: *const c_char, _jo: *mut c_int, _jv: *mut *mut c_void, _nj: c_uint, _lo: *mut c_int, _lv: *mut *mut c_void, _nl: c_uint) -> CUresult {
    with("cuLibraryLoadFromFile", |s| {
        let data = read_file(path)?;
        load_library(s, lib, &data)
    })
}

#[no_mangle]
pub extern "C" fn cuLibraryUnload(lib: H) -> CUresult {
    with("cuLibraryUnload", |s| {
        let id = dec(TAG_LIB, lib).ok_or_else(|| invalid_handle("library"))?;
        let gone = with_libs(|l| {
            let gone = l.libs.remove(&id)?;
            l.kernels.retain(|_, k| k.lib != id);
            l.by_name.retain(|(lib, _), _| *lib != id);
            Some(gone)
        });
        let gone = gone.ok_or_else(|| invalid_handle("library"))?;
        let mut first = None;
        for (ctx, m) in gone.modules {
            if s.st().modules.contains_key(&m) {
                let r = s.sync_ctx(ctx).and_then(|_| s.client().empty(Request::ModuleUnload(ModuleReq { ctx, module: m })));
                s.forget_module(m);
                if let Err(e) = r {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    })
}

/// A library's kernel names (its image is already only what this device
/// runs).
fn lib_entries(id: u32) -> Vec<String> {
    let Some((image, cell)) = with_libs(|l| l.libs.get(&id).map(|x| (x.image.clone(), x.entries.clone()))) else { return Vec::new() };
    cell.get_or_init(|| super::entry_names(&image)).clone()
}

fn lib_id(lib: H) -> CallResult<u32> {
    let id = dec(TAG_LIB, lib).ok_or_else(|| invalid_handle("library"))?;
    if with_libs(|l| l.libs.contains_key(&id)) {
        Ok(id)
    } else {
        Err(invalid_handle("library"))
    }
}

fn c_name(name: *const c_char) -> CallResult<String> {
    if name.is_null() {
        return Err(bad("null name"));
    }
    // SAFETY: per the API contract `name` is a NUL-terminated string.
    Ok(unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| bad("name is not UTF-8"))?.to_string())
}

#[no_mangle]
pub unsafe extern "C" fn cuLibraryGetKernel(k: *mut H, lib: H, name: *const c_char) -> CUresult {
    with("cuLibraryGetKernel", |s| {
        let id = lib_id(lib)?;
        let n = c_name(name)?;
        if let Some(found) = with_libs(|l| l.by_name.get(&(id, n.clone())).copied()) {
            return out(k, enc(TAG_KERNEL, found));
        }
        // The kernel must exist: look it up where a context is current,
        // else in the library's PTX. An image without PTX (cubins only, as
        // PyTorch's kernels ship) names nothing readable here: its kernel
        // is checked where it is first used in a context, as CUDA's lazy
        // loading does, and on a device that runs PTX only that use fails
        // with CUDA_ERROR_NO_BINARY_FOR_GPU.
        let loaded = match s.current() {
            Ok(ctx) => match s.lib_module(id, ctx) {
                Ok(m) => Some((ctx, m)),
                Err(e) if e.code == CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU => None,
                Err(e) => return Err(e),
            },
            Err(_) => None,
        };
        if let Some((ctx, m)) = loaded {
            get_function(s, ctx, m, &n)?;
        } else {
            let names = lib_entries(id);
            if !names.is_empty() && !names.contains(&n) {
                return Err(CallError::new(CuResult::CUDA_ERROR_NOT_FOUND, format!("no kernel {n} in the library")));
            }
        }
        let cname = CString::new(n.clone()).map_err(|_| bad("name contains NUL"))?;
        let kid = with_libs(|l| {
            l.next += 1;
            let kid = l.next;
            l.kernels.insert(kid, Kernel { lib: id, name: cname, funcs: HashMap::new() });
            l.by_name.insert((id, n), kid);
            kid
        });
        out(k, enc(TAG_KERNEL, kid))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLibraryGetModule(m: *mut H, lib: H) -> CUresult {
    with("cuLibraryGetModule", |s| {
        let id = lib_id(lib)?;
        let ctx = s.current()?;
        out(m, enc(TAG_MOD, s.lib_module(id, ctx)?))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLibraryGetGlobal(dptr: *mut CUdeviceptr, bytes: *mut usize, lib: H, name: *const c_char) -> CUresult {
    with("cuLibraryGetGlobal", |s| {
        let id = lib_id(lib)?;
        let n = c_name(name)?;
        let ctx = s.current()?;
        let m = s.lib_module(id, ctx)?;
        let (addr, size) = get_global(s, ctx, m, &n)?;
        if super::trace_calls_enabled() {
            eprintln!("libcuda(vgpu): cuLibraryGetGlobal library {id} {n:?} -> {addr:#x}, {size} bytes");
        }
        if !dptr.is_null() {
            out(dptr, addr)?;
        }
        if !bytes.is_null() {
            out(bytes, size as usize)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLibraryGetKernelCount(count: *mut c_uint, lib: H) -> CUresult {
    with("cuLibraryGetKernelCount", |_| {
        let id = lib_id(lib)?;
        out(count, lib_entries(id).len() as c_uint)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLibraryEnumerateKernels(kernels: *mut H, n: c_uint, lib: H) -> CUresult {
    let names = match with("cuLibraryEnumerateKernels", |_| lib_id(lib).map(|_| ())) {
        0 => lib_entries(dec(TAG_LIB, lib).unwrap_or(0)),
        r => return r,
    };
    if kernels.is_null() || (n as usize) < names.len() {
        return fail("cuLibraryEnumerateKernels", bad("array too small for the library's kernels"));
    }
    for (i, name) in names.iter().enumerate() {
        let Ok(c) = CString::new(name.as_str()) else { continue };
        // SAFETY: the caller provides `n` >= names.len() slots.
        let r = unsafe { cuLibraryGetKernel(kernels.add(i), lib, c.as_ptr()) };
        if r != 0 {
            return r;
        }
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn cuKernelGetFunction(f: *mut H, k: H) -> CUresult {
    with("cuKernelGetFunction", |s| {
        // A CUfunction is its own function: the runtime asks this of any
        // handle given to cudaLaunchKernel that it did not register
        // (NVIDIA's driver answers it for a CUfunction too).
        if dec(TAG_FUNC, k).is_some() {
            s.func(k)?;
            return out(f, k);
        }
        let kid = dec(TAG_KERNEL, k).ok_or_else(|| invalid_handle("kernel"))?;
        out(f, enc(TAG_FUNC, s.kernel_func(kid)?))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuKernelGetLibrary(lib: *mut H, k: H) -> CUresult {
    with("cuKernelGetLibrary", |_| {
        let kid = dec(TAG_KERNEL, k).ok_or_else(|| invalid_handle("kernel"))?;
        let l = with_libs(|l| l.kernels.get(&kid).map(|x| x.lib)).ok_or_else(|| invalid_handle("kernel"))?;
        out(lib, enc(TAG_LIB, l))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuKernelGetName(name: *mut *const c_char, k: H) -> CUresult {
    with("cuKernelGetName", |_| {
        let kid = dec(TAG_KERNEL, k).ok_or_else(|| invalid_handle("kernel"))?;
        // The name lives as long as the kernel's library.
        let p = with_libs(|l| l.kernels.get(&kid).map(|x| x.name.as_ptr())).ok_or_else(|| invalid_handle("kernel"))?;
        out(name, p)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuKernelGetAttribute(v: *mut c_int, attr: c_int, k: H, dev: CUdevice) -> CUresult {
    with("cuKernelGetAttribute", |s| {
        s.device(dev)?;
        let f = s.func(k)?;
        out(v, func_attribute(s, &f, attr)?)
    })
}

#[no_mangle]
pub extern "C" fn cuKernelSetAttribute(attr: c_int, v: c_int, k: H, dev: CUdevice) -> CUresult {
    with("cuKernelSetAttribute", |s| {
        s.device(dev)?;
        let f = s.func(k)?;
        set_func_attribute(s, &f, attr, v)
    })
}

#[no_mangle]
pub extern "C" fn cuKernelSetCacheConfig(k: H, cfg: c_uint, dev: CUdevice) -> CUresult {
    with("cuKernelSetCacheConfig", |s| {
        s.device(dev)?;
        let f = s.func(k)?;
        set_cache(&f, cfg)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuKernelGetParamInfo(k: H, i: usize, off: *mut usize, size: *mut usize) -> CUresult {
    with("cuKernelGetParamInfo", |s| param_info(&*s.func(k)?, i, off, size))
}

// ---- modules ----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoad(m: *mut H, path: *const c_char) -> CUresult {
    with("cuModuleLoad", |s| {
        if m.is_null() {
            return Err(bad("null module pointer"));
        }
        let data = read_file(path)?;
        let ctx = s.current()?;
        out(m, enc(TAG_MOD, load_image(s, ctx, &data)?))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadFatBinary(m: *mut H, image: *const c_void) -> CUresult {
    // SAFETY: same contract as cuModuleLoadData.
    unsafe { super::cuModuleLoadData(m, image) }
}

/// Modules load eagerly (CU_MODULE_EAGER_LOADING); libraries lazily.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetLoadingMode(mode: *mut c_int) -> CUresult {
    // CU_MODULE_LAZY_LOADING = 2, CU_MODULE_EAGER_LOADING = 1.
    with("cuModuleGetLoadingMode", |_| out(mode, if lazy_loading() { 2 } else { 1 }))
}

/// Whether libraries load into a context at first use (CUDA's default
/// since 12.2) rather than at `cuLibraryLoad*`: CUDA's own setting,
/// `CUDA_MODULE_LOADING=EAGER`, chooses eager loading. Modules
/// (`cuModuleLoad*`) always load at once here.
fn lazy_loading() -> bool {
    static LAZY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LAZY.get_or_init(|| std::env::var("CUDA_MODULE_LOADING").map_or(true, |v| !v.eq_ignore_ascii_case("EAGER")))
}

fn module_entries(s: &Shim, m: H) -> CallResult<(u32, Arc<Vec<String>>)> {
    let id = dec(TAG_MOD, m).ok_or_else(|| invalid_handle("module"))?;
    let st = s.st();
    let mi = st.modules.get(&id).ok_or_else(|| invalid_handle("module"))?;
    Ok((mi.ctx, mi.entries.clone()))
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunctionCount(count: *mut c_uint, m: H) -> CUresult {
    with("cuModuleGetFunctionCount", |s| out(count, module_entries(s, m)?.1.len() as c_uint))
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleEnumerateFunctions(fs: *mut H, n: c_uint, m: H) -> CUresult {
    with("cuModuleEnumerateFunctions", |s| {
        let (ctx, names) = module_entries(s, m)?;
        if fs.is_null() || (n as usize) < names.len() {
            return Err(bad("array too small for the module's functions"));
        }
        let id = dec(TAG_MOD, m).unwrap_or(0);
        for (i, name) in names.iter().enumerate() {
            let f = get_function(s, ctx, id, name)?;
            // SAFETY: the caller provides `n` >= names.len() slots.
            unsafe { *fs.add(i) = enc(TAG_FUNC, f) };
        }
        Ok(())
    })
}

// ---- functions --------------------------------------------------------------

/// `CUfunction_attribute` values. Register and local-memory figures are
/// those of an interpreter: it has no register file to run out of.
fn func_attribute(s: &Shim, f: &super::Func, attr: c_int) -> CallResult<c_int> {
    let conf = *f.conf.lock().unwrap_or_else(|e| e.into_inner());
    let arch = (s.info.cc_major * 10 + s.info.cc_minor) as c_int;
    Ok(match attr {
        0 => s.info.max_threads_per_block as c_int,
        1..=3 => 0,
        4 => 32,
        // The code's architecture, which may differ from the device's.
        5 | 6 => {
            if f.arch > 0 {
                f.arch as c_int
            } else {
                arch
            }
        }
        7 => 0,
        8 => conf.max_dynamic_shared,
        9 => conf.carveout,
        10 | 14 | 15 => 0,
        11..=13 => 0,
        _ => return Err(bad(&format!("unknown function attribute {attr}"))),
    })
}

fn set_func_attribute(s: &Shim, f: &super::Func, attr: c_int, v: c_int) -> CallResult<()> {
    let mut conf = f.conf.lock().unwrap_or_else(|e| e.into_inner());
    match attr {
        8 => {
            if v < 0 || v as u32 > s.info.max_shared_per_block {
                return Err(bad(&format!("{v} bytes of dynamic shared memory; the device has {}", s.info.max_shared_per_block)));
            }
            conf.max_dynamic_shared = v;
        }
        9 => {
            if !(-1..=100).contains(&v) {
                return Err(bad("carveout is a percentage"));
            }
            conf.carveout = v;
        }
        10 | 14 | 15 if v == 0 => {}
        _ => return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, format!("setting function attribute {attr} to {v}"))),
    }
    Ok(())
}

fn set_cache(f: &super::Func, cfg: c_uint) -> CallResult<()> {
    if cfg > 4 {
        return Err(bad("unknown cache configuration"));
    }
    f.conf.lock().unwrap_or_else(|e| e.into_inner()).cache = cfg;
    Ok(())
}

fn param_info(f: &super::Func, i: usize, off: *mut usize, size: *mut usize) -> CallResult<()> {
    let p = f.params.get(i).ok_or_else(|| bad(&format!("the kernel has {} parameters", f.params.len())))?;
    if !off.is_null() {
        out(off, p.offset as usize)?;
    }
    if !size.is_null() {
        out(size, p.size as usize)?;
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(v: *mut c_int, attr: c_int, f: H) -> CUresult {
    with("cuFuncGetAttribute", |s| {
        let func = s.func(f)?;
        out(v, func_attribute(s, &func, attr)?)
    })
}

#[no_mangle]
pub extern "C" fn cuFuncSetAttribute(f: H, attr: c_int, v: c_int) -> CUresult {
    with("cuFuncSetAttribute", |s| set_func_attribute(s, &*s.func(f)?, attr, v))
}

#[no_mangle]
pub extern "C" fn cuFuncSetCacheConfig(f: H, cfg: c_uint) -> CUresult {
    with("cuFuncSetCacheConfig", |s| set_cache(&*s.func(f)?, cfg))
}

#[no_mangle]
pub extern "C" fn cuFuncSetSharedMemConfig(f: H, cfg: c_uint) -> CUresult {
    with("cuFuncSetSharedMemConfig", |s| {
        s.func(f)?;
        if cfg > 2 {
            Err(bad("unknown shared memory configuration"))
        } else {
            Ok(())
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetName(name: *mut *const c_char, f: H) -> CUresult {
    with("cuFuncGetName", |s| {
        let func = s.func(f)?;
        // Valid as long as the function: it lives in the function's record.
        out(name, func.name.as_ptr())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetParamInfo(f: H, i: usize, off: *mut usize, size: *mut usize) -> CUresult {
    with("cuFuncGetParamInfo", |s| param_info(&*s.func(f)?, i, off, size))
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetModule(m: *mut H, f: H) -> CUresult {
    with("cuFuncGetModule", |s| out(m, enc(TAG_MOD, s.func(f)?.module)))
}

/// Functions are loaded with their module: always CU_FUNCTION_LOADING_STATE_LOADED.
#[no_mangle]
pub unsafe extern "C" fn cuFuncIsLoaded(state: *mut c_int, f: H) -> CUresult {
    with("cuFuncIsLoaded", |s| {
        s.func(f)?;
        out(state, 1)
    })
}

#[no_mangle]
pub extern "C" fn cuFuncLoad(f: H) -> CUresult {
    with("cuFuncLoad", |s| s.func(f).map(|_| ()))
}

// ---- occupancy --------------------------------------------------------------

/// Blocks of `block` threads using `smem` bytes of shared memory that fit
/// on one multiprocessor at once.
fn blocks_per_sm(info: &DeviceInfo, block: c_int, smem: usize) -> c_int {
    if block <= 0 || block as u32 > info.max_threads_per_block {
        return 0;
    }
    let by_threads = 2048 / block;
    let by_smem = (info.max_shared_per_block as usize).checked_div(smem).map_or(c_int::MAX, |n| n.min(c_int::MAX as usize) as c_int);
    by_threads.min(by_smem).min(32)
}

#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(n: *mut c_int, f: H, block: c_int, smem: usize) -> CUresult {
    with("cuOccupancyMaxActiveBlocksPerMultiprocessor", |s| {
        s.func(f)?;
        out(n, blocks_per_sm(&s.info, block, smem))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n: *mut c_int, f: H, block: c_int, smem: usize, _flags: c_uint) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, block, smem) }
}

type SmemForBlock = Option<unsafe extern "C" fn(c_int) -> usize>;

#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxPotentialBlockSizeWithFlags(grid: *mut c_int, block: *mut c_int, f: H, smem_fn: SmemForBlock, smem: usize, limit: c_int, _flags: c_uint) -> CUresult {
    with("cuOccupancyMaxPotentialBlockSize", |s| {
        s.func(f)?;
        let warp = s.info.warp_size.max(1) as c_int;
        let max = if limit > 0 { limit.min(s.info.max_threads_per_block as c_int) } else { s.info.max_threads_per_block as c_int };
        let (mut best, mut best_threads) = (warp.min(max).max(1), 0);
        let mut b = max / warp * warp;
        while b > 0 {
            let sm = match smem_fn {
                // SAFETY: the caller's callback maps a block size to bytes.
                Some(cb) => unsafe { cb(b) },
                None => smem,
            };
            let threads = blocks_per_sm(&s.info, b, sm) * b;
            if threads > best_threads {
                (best, best_threads) = (b, threads);
            }
            b -= warp;
        }
        let sm = match smem_fn {
            // SAFETY: as above.
            Some(cb) => unsafe { cb(best) },
            None => smem,
        };
        out(grid, blocks_per_sm(&s.info, best, sm) * s.info.sm_count as c_int)?;
        out(block, best)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxPotentialBlockSize(grid: *mut c_int, block: *mut c_int, f: H, smem_fn: SmemForBlock, smem: usize, limit: c_int) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuOccupancyMaxPotentialBlockSizeWithFlags(grid, block, f, smem_fn, smem, limit, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cuOccupancyAvailableDynamicSMemPerBlock(size: *mut usize, f: H, blocks: c_int, block: c_int) -> CUresult {
    with("cuOccupancyAvailableDynamicSMemPerBlock", |s| {
        s.func(f)?;
        if blocks <= 0 || block <= 0 || blocks_per_sm(&s.info, block, 0) < blocks {
            return out(size, 0);
        }
        out(size, s.info.max_shared_per_block as usize / blocks as usize)
    })
}

// ---- the linker -------------------------------------------------------------

/// A link in progress: its PTX inputs, then its output.
struct Link {
    ptx: Vec<Vec<u8>>,
    /// An input is a fatbin's PTX newer than the device, which only an
    /// interpreting device takes, and only from a fatbin.
    newer: bool,
    output: Vec<u8>,
}

static LINKS: Mutex<Vec<(u32, Link)>> = Mutex::new(Vec::new());

fn links() -> MutexGuard<'static, Vec<(u32, Link)>> {
    LINKS.lock().unwrap_or_else(|e| e.into_inner())
}

const JIT_INPUT_CUBIN: c_int = 0;
const JIT_INPUT_PTX: c_int = 1;
const JIT_INPUT_FATBINARY: c_int = 2;

#[no_mangle]
pub unsafe extern "C" fn cuLinkCreate_v2(_n: c_uint, _opts: *mut c_int, _vals: *mut *mut c_void, state: *mut H) -> CUresult {
    with("cuLinkCreate", |s| {
        s.current()?;
        let mut l = links();
        if l.len() >= 64 {
            return Err(CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "too many links in progress"));
        }
        let id = l.iter().map(|(i, _)| *i).max().unwrap_or(0) + 1;
        l.push((id, Link { ptx: Vec::new(), newer: false, output: Vec::new() }));
        out(state, enc(TAG_LINK, id))
    })
}

/// The PTX of a fatbin the device takes, chosen as the device's own loader
/// would: the PTX a GPU of its architecture compiles, or on a device that
/// interprets PTX the one the interpreter prefers (generic code first, and
/// newer code where nothing older is there; see `fatbin::ptx_for_interpreter`),
/// with whether it is newer than the device.
fn fatbin_ptx(s: &Shim, data: &[u8]) -> Result<Option<(Vec<u8>, bool)>, fatbin::FatbinError> {
    static INTERPRETS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let arch = s.info.cc_major * 10 + s.info.cc_minor;
    // Asked once; a host too old to say gets the GPU rule, as before.
    let interprets = *INTERPRETS.get_or_init(|| s.client().tenant_info().ok().and_then(|t| t.interprets_ptx()).unwrap_or(false));
    if interprets {
        fatbin::ptx_for_interpreter(data, arch, fatbin::MAX_UNCOMPRESSED)
    } else {
        fatbin::best_ptx(data, arch).map(|p| p.map(|p| (p, false)))
    }
}

fn add_input(s: &Shim, state: H, kind: c_int, data: &[u8], name: &str) -> CallResult<()> {
    let id = dec(TAG_LINK, state).ok_or_else(|| invalid_handle("link state"))?;
    let (ptx, newer) = match kind {
        JIT_INPUT_PTX => (data.strip_suffix(&[0]).unwrap_or(data).to_vec(), false),
        JIT_INPUT_FATBINARY => match fatbin_ptx(s, data) {
            Ok(Some(p)) => p,
            Ok(None) => return Err(CallError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, format!("{name}: the fatbin carries no PTX"))),
            Err(e) => return Err(CallError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, format!("{name}: {e}"))),
        },
        JIT_INPUT_CUBIN => return Err(CallError::new(CuResult::CUDA_ERROR_NO_BINARY_FOR_GPU, format!("{name}: this device runs PTX; it cannot link a cubin"))),
        _ => return Err(CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, format!("{name}: linker input type {kind} (objects, libraries and NVVM IR) is unsupported; link PTX"))),
    };
    let mut l = links();
    let link = l.iter_mut().find(|(i, _)| *i == id).map(|(_, l)| l).ok_or_else(|| invalid_handle("link state"))?;
    if link.ptx.iter().map(|p| p.len()).sum::<usize>() + ptx.len() > 256 << 20 {
        return Err(CallError::new(CuResult::CUDA_ERROR_OUT_OF_MEMORY, "link inputs exceed 256 MiB"));
    }
    link.ptx.push(ptx);
    link.newer |= newer;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuLinkAddData_v2(state: H, kind: c_int, data: *mut c_void, size: usize, name: *const c_char, _n: c_uint, _o: *mut c_int, _v: *mut *mut c_void) -> CUresult {
    with("cuLinkAddData", |s| {
        if data.is_null() || size == 0 {
            return Err(bad("null or empty input"));
        }
        let n = if name.is_null() { String::from("input") } else { c_name(name)? };
        // SAFETY: the caller provides `size` readable bytes at `data`.
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) };
        add_input(s, state, kind, bytes, &n)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLinkAddFile_v2(state: H, kind: c_int, path: *const c_char, _n: c_uint, _o: *mut c_int, _v: *mut *mut c_void) -> CUresult {
    with("cuLinkAddFile", |s| {
        let data = read_file(path)?;
        add_input(s, state, kind, &data, &c_name(path)?)
    })
}

/// Links the PTX inputs into one module's PTX: the output is PTX, which is
/// what this device loads (`cuModuleLoadData` accepts it as the "cubin").
#[no_mangle]
pub unsafe extern "C" fn cuLinkComplete(state: H, cubin: *mut *mut c_void, size: *mut usize) -> CUresult {
    with("cuLinkComplete", |_| {
        let id = dec(TAG_LINK, state).ok_or_else(|| invalid_handle("link state"))?;
        let mut l = links();
        let link = l.iter_mut().find(|(i, _)| *i == id).map(|(_, l)| l).ok_or_else(|| invalid_handle("link state"))?;
        let mut text = crate::ptxlink::link(&link.ptx).map_err(|e| CallError::new(CuResult::CUDA_ERROR_INVALID_PTX, e))?;
        text.push(0);
        link.output = if link.newer {
            // Code newer than the device goes out as a fatbin's PTX, the
            // way it came in: an interpreting device runs that, and
            // refuses the same code as a plain PTX (as a GPU would).
            let head = String::from_utf8_lossy(&text[..text.len().min(4096)]).lines().find(|l| l.trim_start().starts_with(".target")).map_or(0, crate::ptxlink::target_arch);
            fatbin::build::image(&[fatbin::build::entry(fatbin::KIND_PTX, head, fatbin::FLAGS_HOST_64, &text, 0)])
        } else {
            text
        };
        out(cubin, link.output.as_mut_ptr().cast())?;
        if !size.is_null() {
            out(size, link.output.len())?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuLinkDestroy(state: H) -> CUresult {
    with("cuLinkDestroy", |_| {
        let id = dec(TAG_LINK, state).ok_or_else(|| invalid_handle("link state"))?;
        let mut l = links();
        let before = l.len();
        l.retain(|(i, _)| *i != id);
        if l.len() == before {
            Err(invalid_handle("link state"))
        } else {
            Ok(())
        }
    })
}

// ---- launches ---------------------------------------------------------------

/// `CUlaunchConfig`.
#[repr(C)]
pub struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: H,
    attrs: *const LaunchAttr,
    num_attrs: c_uint,
}

/// `CUlaunchAttribute`: an id, padding, and a 64-byte value.
#[repr(C)]
pub struct LaunchAttr {
    id: c_uint,
    pad: [u8; 4],
    value: [u64; 8],
}

const LAUNCH_ATTR_COOPERATIVE: c_uint = 2;
const LAUNCH_ATTR_CLUSTER_DIMENSION: c_uint = 4;
const LAUNCH_ATTR_PRIORITY: c_uint = 8;

fn launch_ex(config: *const LaunchConfig, f: H, params: *mut *mut c_void, extra: *mut *mut c_void, default: Default) -> CUresult {
    if config.is_null() {
        return fail("cuLaunchKernelEx", bad("null launch configuration"));
    }
    // SAFETY: non-null, and the API contract makes it a CUlaunchConfig.
    let c = unsafe { &*config };
    if c.num_attrs > 0 {
        if c.attrs.is_null() || c.num_attrs > 64 {
            return fail("cuLaunchKernelEx", bad("bad launch attribute array"));
        }
        // SAFETY: the caller passes `num_attrs` attributes.
        let attrs = unsafe { std::slice::from_raw_parts(c.attrs, c.num_attrs as usize) };
        for a in attrs {
            let v = a.value[0] as u32;
            let ok = match a.id {
                0 | LAUNCH_ATTR_PRIORITY => true,
                LAUNCH_ATTR_COOPERATIVE => v == 0,
                LAUNCH_ATTR_CLUSTER_DIMENSION => a.value[0] as u32 <= 1 && (a.value[0] >> 32) as u32 <= 1 && a.value[1] as u32 <= 1,
                _ => false,
            };
            if !ok {
                return fail("cuLaunchKernelEx", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, format!("launch attribute {} is unsupported on this device", a.id)));
            }
        }
    }
    // SAFETY: the caller's arguments follow cuLaunchKernelEx's contract.
    unsafe { super::launch(f, c.grid, c.block, c.shared, c.stream, params, extra, default) }
}

#[no_mangle]
pub extern "C" fn cuLaunchKernelEx(config: *const LaunchConfig, f: H, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult {
    launch_ex(config, f, params, extra, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuLaunchKernelEx_ptsz(config: *const LaunchConfig, f: H, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult {
    launch_ex(config, f, params, extra, Default::PerThread)
}

/// Cooperative launches need every block resident at once for grid-wide
/// barriers, which this device does not provide.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn cuLaunchCooperativeKernel(_f: H, _gx: c_uint, _gy: c_uint, _gz: c_uint, _bx: c_uint, _by: c_uint, _bz: c_uint, _sh: c_uint, _st: H, _p: *mut *mut c_void) -> CUresult {
    fail("cuLaunchCooperativeKernel", CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "cooperative launches (grid-wide barriers) are unsupported on this device"))
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn cuLaunchCooperativeKernel_ptsz(f: H, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, sh: c_uint, st: H, p: *mut *mut c_void) -> CUresult {
    cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, sh, st, p)
}

type HostFn = Option<unsafe extern "C" fn(*mut c_void)>;
type StreamCallback = Option<unsafe extern "C" fn(H, CUresult, *mut c_void)>;

/// Runs a host function in stream order: once the stream's earlier work is
/// done, on the calling thread, before anything later is queued on it.
pub(super) fn host_func(api: &str, stream: H, default: Default, call: impl FnOnce(CUresult)) -> CUresult {
    let mut status = None;
    let r = with(api, |s| {
        let t = s.target(stream, default)?;
        status = Some(match s.wait_all(t.ctx, &s.sync_points(t)) {
            Ok(()) => 0,
            Err(e) => e.code as CUresult,
        });
        Ok(())
    });
    match status {
        Some(st) => {
            call(st);
            0
        }
        None => r,
    }
}

/// cuLaunchHostFunc: recorded on a capturing stream, else run in order.
fn launch_host_func(stream: H, f: HostFn, data: *mut c_void, default: Default) -> CUresult {
    let Some(f) = f else { return fail("cuLaunchHostFunc", bad("null host function")) };
    let mut recorded = false;
    let r = with("cuLaunchHostFunc", |s| {
        let t = s.target(stream, default)?;
        recorded = super::graph::record(t, || super::graph::Node::Host { f, data: data as usize })?;
        Ok(())
    });
    if r != 0 || recorded {
        return r;
    }
    // SAFETY: the caller's function takes its user data.
    host_func("cuLaunchHostFunc", stream, default, |_| unsafe { f(data) })
}

#[no_mangle]
pub extern "C" fn cuLaunchHostFunc(stream: H, f: HostFn, data: *mut c_void) -> CUresult {
    launch_host_func(stream, f, data, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuLaunchHostFunc_ptsz(stream: H, f: HostFn, data: *mut c_void) -> CUresult {
    launch_host_func(stream, f, data, Default::PerThread)
}

#[no_mangle]
pub extern "C" fn cuStreamAddCallback(stream: H, cb: StreamCallback, data: *mut c_void, flags: c_uint) -> CUresult {
    let Some(cb) = cb else { return fail("cuStreamAddCallback", bad("null callback")) };
    if flags != 0 {
        return fail("cuStreamAddCallback", bad("flags must be 0"));
    }
    // SAFETY: the caller's callback takes (stream, status, user data).
    host_func("cuStreamAddCallback", stream, Default::Legacy, |st| unsafe { cb(stream, st, data) })
}

#[no_mangle]
pub extern "C" fn cuStreamAddCallback_ptsz(stream: H, cb: StreamCallback, data: *mut c_void, flags: c_uint) -> CUresult {
    let Some(cb) = cb else { return fail("cuStreamAddCallback", bad("null callback")) };
    if flags != 0 {
        return fail("cuStreamAddCallback", bad("flags must be 0"));
    }
    // SAFETY: the caller's callback takes (stream, status, user data).
    host_func("cuStreamAddCallback", stream, Default::PerThread, |st| unsafe { cb(stream, st, data) })
}

// ---- stream queries and capture ---------------------------------------------

/// (flags, priority, context) of a stream handle, the default streams
/// included.
fn stream_props(s: &Shim, h: H, default: Default) -> CallResult<(c_uint, c_int, u32, u32)> {
    let t = s.target(h, default)?;
    if t.stream == DEFAULT_STREAM {
        return Ok((0, 0, t.ctx, t.stream));
    }
    let st = s.st();
    let info = st.streams.get(&t.stream).ok_or_else(|| invalid_handle("stream"))?;
    Ok((info.flags, info.priority, t.ctx, t.stream))
}

macro_rules! stream_query {
    ($name:ident, $pt:ident, $api:literal, $ty:ty, |$s:ident, $p:ident| $e:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(h: H, v: *mut $ty) -> CUresult {
            with($api, |$s| {
                let $p = stream_props($s, h, Default::Legacy)?;
                out(v, $e)
            })
        }
        #[no_mangle]
        pub unsafe extern "C" fn $pt(h: H, v: *mut $ty) -> CUresult {
            with($api, |$s| {
                let $p = stream_props($s, h, Default::PerThread)?;
                out(v, $e)
            })
        }
    };
}

stream_query!(cuStreamGetFlags, cuStreamGetFlags_ptsz, "cuStreamGetFlags", c_uint, |s, p| p.0);
stream_query!(cuStreamGetPriority, cuStreamGetPriority_ptsz, "cuStreamGetPriority", c_int, |s, p| p.1);
stream_query!(cuStreamGetCtx, cuStreamGetCtx_ptsz, "cuStreamGetCtx", H, |s, p| enc(super::TAG_CTX, p.2));
stream_query!(cuStreamGetId, cuStreamGetId_ptsz, "cuStreamGetId", u64, |s, p| ((p.2 as u64) << 32) | p.3 as u64);
stream_query!(cuStreamGetDevice, cuStreamGetDevice_ptsz, "cuStreamGetDevice", CUdevice, |s, _p| 0);

fn stream_ctx_v2(h: H, ctx: *mut H, green: *mut H, default: Default) -> CUresult {
    with("cuStreamGetCtx", |s| {
        let p = stream_props(s, h, default)?;
        out(ctx, enc(super::TAG_CTX, p.2))?;
        if !green.is_null() {
            out(green, std::ptr::null_mut())?;
        }
        Ok(())
    })
}

/// The CUDA 12.5 form: also the green context (never one here).
#[no_mangle]
pub extern "C" fn cuStreamGetCtx_v2(h: H, ctx: *mut H, green: *mut H) -> CUresult {
    stream_ctx_v2(h, ctx, green, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuStreamGetCtx_v2_ptsz(h: H, ctx: *mut H, green: *mut H) -> CUresult {
    stream_ctx_v2(h, ctx, green, Default::PerThread)
}

/// CU_STREAM_CAPTURE_STATUS_ACTIVE while the stream captures (graph.rs).
fn is_capturing(h: H, status: *mut c_int, default: Default) -> CUresult {
    with("cuStreamIsCapturing", |s| out(status, super::graph::capture_status(s, h, default)?.0))
}

#[no_mangle]
pub extern "C" fn cuStreamIsCapturing(h: H, status: *mut c_int) -> CUresult {
    is_capturing(h, status, Default::Legacy)
}

#[no_mangle]
pub extern "C" fn cuStreamIsCapturing_ptsz(h: H, status: *mut c_int) -> CUresult {
    is_capturing(h, status, Default::PerThread)
}

/// Every version of cuStreamGetCaptureInfo: the status, the capture's id
/// and graph; a capture is a chain, so it reports no dependency set.
fn capture_info(h: H, status: *mut c_int, id: *mut u64, graph: *mut H, deps: *mut *const H, n: *mut usize, default: Default) -> CUresult {
    with("cuStreamGetCaptureInfo", |s| {
        let (st, cid, g) = super::graph::capture_status(s, h, default)?;
        out(status, st)?;
        if !id.is_null() && st != 0 {
            out(id, cid)?;
        }
        if !graph.is_null() && st != 0 {
            out(graph, enc(super::graph::TAG_GRAPH, g))?;
        }
        if !deps.is_null() && st != 0 {
            out(deps, std::ptr::null())?;
        }
        if !n.is_null() && st != 0 {
            out(n, 0)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamGetCaptureInfo(h: H, status: *mut c_int, id: *mut u64) -> CUresult {
    capture_info(h, status, id, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuStreamGetCaptureInfo_ptsz(h: H, status: *mut c_int, id: *mut u64) -> CUresult {
    capture_info(h, status, id, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), Default::PerThread)
}
#[no_mangle]
pub extern "C" fn cuStreamGetCaptureInfo_v2(h: H, status: *mut c_int, id: *mut u64, g: *mut H, d: *mut *const H, n: *mut usize) -> CUresult {
    capture_info(h, status, id, g, d, n, Default::Legacy)
}
#[no_mangle]
pub extern "C" fn cuStreamGetCaptureInfo_v2_ptsz(h: H, status: *mut c_int, id: *mut u64, g: *mut H, d: *mut *const H, n: *mut usize) -> CUresult {
    capture_info(h, status, id, g, d, n, Default::PerThread)
}
/// v3 adds edge data between the dependencies (none here).
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3(h: H, status: *mut c_int, id: *mut u64, g: *mut H, d: *mut *const H, e: *mut *const c_void, n: *mut usize) -> CUresult {
    let r = capture_info(h, status, id, g, d, n, Default::Legacy);
    if r == 0 && !e.is_null() {
        // SAFETY: non-null out-pointer per the API contract.
        unsafe { *e = std::ptr::null() };
    }
    r
}
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3_ptsz(h: H, status: *mut c_int, id: *mut u64, g: *mut H, d: *mut *const H, e: *mut *const c_void, n: *mut usize) -> CUresult {
    let r = capture_info(h, status, id, g, d, n, Default::PerThread);
    if r == 0 && !e.is_null() {
        // SAFETY: non-null out-pointer per the API contract.
        unsafe { *e = std::ptr::null() };
    }
    r
}

thread_local! {
    static CAPTURE_MODE: std::cell::Cell<c_int> = const { std::cell::Cell::new(0) };
}

#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CUresult {
    if mode.is_null() {
        return fail("cuThreadExchangeStreamCaptureMode", bad("null mode"));
    }
    // SAFETY: non-null, and the API contract makes it a CUstreamCaptureMode.
    unsafe { *mode = CAPTURE_MODE.with(|m| m.replace(*mode)) };
    0
}

#[no_mangle]
pub extern "C" fn cuEventRecordWithFlags(e: H, stream: H, _flags: c_uint) -> CUresult {
    super::cuEventRecord(e, stream)
}
#[no_mangle]
pub extern "C" fn cuEventRecordWithFlags_ptsz(e: H, stream: H, _flags: c_uint) -> CUresult {
    super::cuEventRecord_ptsz(e, stream)
}

/// Profiler control: nothing to start or stop; success, as with no
/// profiler attached.
#[no_mangle]
pub extern "C" fn cuProfilerStart() -> CUresult {
    0
}
#[no_mangle]
pub extern "C" fn cuProfilerStop() -> CUresult {
    0
}
#[no_mangle]
pub extern "C" fn cuProfilerInitialize(_c: *const c_char, _o: *const c_char, _m: c_int) -> CUresult {
    0
}
