//! A test double of NVIDIA's driver, for CI machines without a GPU.
//!
//! One shared object answers as `libcuda.so.1` (the CUDA driver API entry
//! points the `cuda` backend calls) and as `libnvidia-ml.so.1` (the NVML
//! queries GPU discovery makes). Tests link both names to it in a folder of
//! their own and put that folder on `LD_LIBRARY_PATH`; nothing installs it,
//! and it answers only while `VGPU_TESTDRIVER_GPUS` describes the GPUs it
//! plays. It models what was measured on an H100 with NVIDIA's driver
//! (docs/testdriver.md):
//! - **one address space per process**: a kernel in any context of the
//!   process reaches every allocation of the process, whichever context
//!   made it; an address outside every allocation faults;
//! - **a fault is sticky for the whole process**: after a kernel faults,
//!   every later call in every context returns the fault's error, and no
//!   new context can be made;
//! - **`cuCtxDestroy` waits for a running kernel**, however long it runs;
//!   only the process's end stops it;
//! - launches, memsets and device-to-device copies run in order on each
//!   stream's own thread, after the call returned; copies to and from host
//!   memory wait for the stream first;
//! - **MPS** as NVIDIA documents it: a process pointed at a control
//!   daemon's pipe directory is a client of its server, and one client's
//!   fault reaches every client ([`mps`]).
//!
//! Kernels run on the PTX interpreter (`vgpu-ptx`), so images must carry
//! PTX (PTX text, or a fatbin with a PTX entry); cubins are refused with
//! `CUDA_ERROR_NO_BINARY_FOR_GPU`. Device memory is host memory of this
//! process, counted against the GPU's size per process (a real GPU's memory
//! is shared by every process on it).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

pub mod config;
pub mod cuda;
pub mod mem;
pub mod mps;
pub mod nvml;
mod stream;

pub use config::{Device, Gpu, GPUS_ENV};

/// The driver's state: one per process, as NVIDIA's is.
pub(crate) struct Driver {
    /// The GPUs played, or why there are none.
    pub gpus: Result<Vec<Gpu>, String>,
    /// Every device CUDA could open (whole GPUs and MIG instances).
    pub devices: Vec<Device>,
    /// Indices into `devices` in CUDA's order, after CUDA_VISIBLE_DEVICES.
    pub visible: Vec<usize>,
    pub inited: AtomicBool,
    /// The first fault's error code: once set, the process's contexts are
    /// all unusable.
    pub sticky: AtomicU32,
    pub heap: mem::Heap,
    pub state: Mutex<cuda::State>,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();

pub(crate) fn driver() -> &'static Driver {
    DRIVER.get_or_init(|| {
        let gpus = match std::env::var(GPUS_ENV) {
            Ok(v) => config::parse_gpus(&v).map_err(|e| format!("{GPUS_ENV}: {e}")),
            Err(_) => Err(format!("{GPUS_ENV} is not set: this test double answers only inside the project's tests")),
        };
        if let Err(e) = &gpus {
            eprintln!("vgpu-testdriver: {e}");
        }
        let devices = gpus.as_deref().map(config::devices_of).unwrap_or_default();
        let visible = config::visible(&devices, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref());
        Driver { gpus, devices, visible, inited: AtomicBool::new(false), sticky: AtomicU32::new(0), heap: mem::Heap::new(), state: Mutex::new(cuda::State::default()) }
    })
}

impl Driver {
    pub fn sticky(&self) -> u32 {
        self.sticky.load(Ordering::Acquire)
    }

    /// Records a fault; the first one stays.
    pub fn poison(&self, code: u32) {
        let _ = self.sticky.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }

    /// A fault of this process's own work: it poisons the process and,
    /// for an MPS client, every other client of its server ([`mps`]).
    pub fn fault(&self, code: u32) {
        if self.sticky.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            mps::report_fault(code);
        }
    }

    pub fn state(&self) -> std::sync::MutexGuard<'_, cuda::State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}
