//! One VM: KVM setup, guest memory, devices, vCPU threads, and the control
//! that pauses, resumes and stops them.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_pit_config, Msrs, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::boot;
use crate::bus::Bus;
use crate::config::{SerialOut, Validate, VmConfig};
use crate::devices::i8042::{self, I8042};
use crate::devices::pci::{IrqRouting, PciRoot, CONFIG_ADDRESS_PORT};
use crate::devices::serial::{SerialConsole, COM1_IRQ, COM1_PORT};
use crate::devices::vfio::{VfioContext, VfioPci};
use crate::devices::virtio::net::Tap;
use crate::devices::virtio::{rng::Rng, VirtioPci};
use crate::memory::GuestRam;
use crate::numa::{pin_current_thread, sysfs_root, Topology};

/// Why the VM stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest reset itself (i8042 reset line, or a KVM reset event):
    /// reboot and shutdown of a guest both end here.
    Reset,
    /// The guest powered off through a KVM system event.
    PowerOff,
    /// Three nested faults: the CPU gave up.
    TripleFault,
    /// `PUT /vm/kill`.
    Killed,
    /// KVM could not continue the guest.
    Error(String),
}

impl ExitReason {
    /// The VMM's process exit status for this reason.
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitReason::Reset | ExitReason::PowerOff => 0,
            ExitReason::Killed => 4,
            ExitReason::TripleFault => 3,
            ExitReason::Error(_) => 1,
        }
    }
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitReason::Reset => write!(f, "guest reset (reboot or shutdown)"),
            ExitReason::PowerOff => write!(f, "guest powered off"),
            ExitReason::TripleFault => write!(f, "guest triple fault: the vCPU shut down"),
            ExitReason::Killed => write!(f, "killed through the API"),
            ExitReason::Error(e) => write!(f, "vCPU error: {e}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Numa(#[from] crate::numa::NumaError),
    #[error("opening /dev/kvm: {0}")]
    Kvm(String),
    #[error("KVM {0}")]
    KvmSetup(String),
    #[error("device setup: {0}")]
    Device(String),
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    #[error(transparent)]
    Net(#[from] crate::devices::virtio::net::NetError),
    #[error("VFIO passthrough: {0}")]
    Vfio(#[from] crate::devices::vfio::VfioError),
    /// A file of the description (disk, serial output): missing, of the
    /// wrong type, a symbolic link or behind one (vgpu_topology::safe_open).
    #[error(transparent)]
    File(#[from] crate::safe_open::SafeOpenError),
}

fn kvm_err(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> VmError {
    move |e| VmError::KvmSetup(format!("{what}: {e}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    Running,
    Paused,
    Stopped,
}

/// Shared between the vCPU threads, the API and the main thread.
pub struct Control {
    state: Mutex<RunState>,
    cv: Condvar,
    /// vCPUs parked in the pause wait.
    parked: AtomicUsize,
    stop: AtomicBool,
    exit: Mutex<Option<Sender<ExitReason>>>,
    threads: Mutex<Vec<libc::pthread_t>>,
    pub vcpus: usize,
    /// KVM_RUN returns per vCPU, summed: a guest-progress signal for tests.
    pub exits: AtomicU64,
}

/// Signal used to kick vCPU threads out of KVM_RUN.
fn kick_signal() -> i32 {
    libc::SIGRTMIN() + 1
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

impl Control {
    fn new(vcpus: usize, exit: Sender<ExitReason>) -> Arc<Control> {
        Arc::new(Control {
            state: Mutex::new(RunState::Running),
            cv: Condvar::new(),
            parked: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            exit: Mutex::new(Some(exit)),
            threads: Mutex::new(Vec::new()),
            vcpus,
            exits: AtomicU64::new(0),
        })
    }

    pub fn state(&self) -> RunState {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn kick_all(&self) {
        for t in self.threads.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            // SAFETY: t is a live vCPU thread of this process (threads are
            // only removed after they are joined, which happens after the
            // Control has stopped kicking); the signal has a no-op handler.
            unsafe { libc::pthread_kill(*t, kick_signal()) };
        }
    }

    /// Stops every vCPU and waits until all are parked.
    pub fn pause(&self) -> Result<(), String> {
        {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            match *s {
                RunState::Stopped => return Err("the VM has stopped".into()),
                RunState::Paused => return Ok(()),
                RunState::Running => *s = RunState::Paused,
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.parked.load(Ordering::Acquire) < self.vcpus {
            if Instant::now() > deadline {
                return Err("vCPUs did not stop within 5 s".into());
            }
            // Repeated kicks close the race with a vCPU about to enter KVM_RUN.
            self.kick_all();
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    pub fn resume(&self) -> Result<(), String> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match *s {
            RunState::Stopped => Err("the VM has stopped".into()),
            _ => {
                *s = RunState::Running;
                self.cv.notify_all();
                Ok(())
            }
        }
    }

    /// Ends the VM with `reason` (the first reason wins).
    pub fn request_exit(&self, reason: ExitReason) {
        if let Some(tx) = self.exit.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = tx.send(reason);
        }
    }

    fn stop_all(&self) {
        self.stop.store(true, Ordering::Release);
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = RunState::Stopped;
        self.cv.notify_all();
        self.kick_all();
    }

    /// Blocks a vCPU thread while paused; false when it must exit.
    fn wait_if_paused(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if *s == RunState::Paused {
            self.parked.fetch_add(1, Ordering::AcqRel);
            while *s == RunState::Paused {
                s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
            }
            self.parked.fetch_sub(1, Ordering::AcqRel);
        }
        !self.stop.load(Ordering::Acquire)
    }
}

/// Everything about a running VM that the API reports.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct VmInfo {
    pub state: RunState,
    pub config: VmConfig,
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// `memfd`, `memfd-hugetlb-2M` or `memfd-hugetlb-1G`.
    pub memory_backing: &'static str,
    pub numa_node: Option<u32>,
    /// CPUs the vCPU threads are pinned to.
    pub vcpu_cpus: Option<Vec<usize>>,
    pub pid: u32,
}

pub struct Vm {
    pub control: Arc<Control>,
    pub info: VmInfo,
    pub keyboard: Arc<Mutex<I8042>>,
    exit_rx: Receiver<ExitReason>,
    vcpu_threads: Vec<JoinHandle<()>>,
    pub start: Instant,
    /// When the first vCPU entered the guest.
    pub first_entry: Arc<Mutex<Option<Instant>>>,
    /// Passthrough devices: dropped (reset, released, their container and
    /// its DMA mappings gone) before guest RAM is.
    _vfio: Vec<Arc<Mutex<VfioPci>>>,
    _ram: GuestRam,
    _vm: Arc<VmFd>,
    _devices: Vec<Arc<Mutex<VirtioPci>>>,
}

fn serial_out(s: &SerialOut) -> Result<Box<dyn Write + Send>, VmError> {
    match s {
        SerialOut::Stdout => Ok(Box::new(std::io::stdout())),
        SerialOut::File(p) => {
            // Created if missing, never through a symbolic link; an
            // existing one must be a regular file.
            let f = crate::safe_open::open("serial output", p, crate::safe_open::Kind::File, libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT, 0o666)?;
            Ok(Box::new(f))
        }
    }
}

/// MSRs a 64-bit kernel expects set at entry.
fn boot_msrs() -> Vec<(u32, u64)> {
    vec![
        (0x174, 0),             // SYSENTER_CS
        (0x175, 0),             // SYSENTER_ESP
        (0x176, 0),             // SYSENTER_EIP
        (0xc000_0081, 0),       // STAR
        (0xc000_0082, 0),       // LSTAR
        (0xc000_0084, 0),       // SFMASK
        (0xc000_0102, 0),       // KERNEL_GS_BASE
        (0x10, 0),              // TSC
        (0x1a0, 1),             // MISC_ENABLE: fast strings
        (0x2ff, (1 << 11) | 6), // MTRR default type: enabled, write-back
    ]
}

fn setup_vcpu(kvm: &Kvm, fd: &VcpuFd, id: u8, count: u8, entry: Option<boot::Entry>) -> Result<(), VmError> {
    let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(kvm_err("GET_SUPPORTED_CPUID"))?;
    boot::adjust_cpuid(&mut cpuid, id, count);
    fd.set_cpuid2(&cpuid).map_err(kvm_err("SET_CPUID2"))?;
    let entries: Vec<kvm_bindings::kvm_msr_entry> = boot_msrs().into_iter().map(|(index, data)| kvm_bindings::kvm_msr_entry { index, data, ..Default::default() }).collect();
    let msrs = Msrs::from_entries(&entries).map_err(|e| VmError::KvmSetup(format!("MSR list: {e:?}")))?;
    fd.set_msrs(&msrs).map_err(kvm_err("SET_MSRS"))?;
    // LINT0 delivers ExtINT (the PIC), LINT1 NMI.
    let mut lapic = fd.get_lapic().map_err(kvm_err("GET_LAPIC"))?;
    let set_lvt = |regs: &mut [libc::c_char], off: usize, mode: u32| {
        let mut b = [0u8; 4];
        for (i, x) in b.iter_mut().enumerate() {
            *x = regs[off + i] as u8;
        }
        let v = (u32::from_le_bytes(b) & !0x700) | (mode << 8);
        for (i, x) in v.to_le_bytes().iter().enumerate() {
            regs[off + i] = *x as libc::c_char;
        }
    };
    set_lvt(&mut lapic.regs, 0x350, 7);
    set_lvt(&mut lapic.regs, 0x360, 4);
    fd.set_lapic(&lapic).map_err(kvm_err("SET_LAPIC"))?;
    if let Some(entry) = entry {
        fd.set_regs(&boot::boot_regs(entry)).map_err(kvm_err("SET_REGS"))?;
        fd.set_fpu(&boot::boot_fpu()).map_err(kvm_err("SET_FPU"))?;
        let mut s = fd.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        boot::setup_sregs(&mut s);
        fd.set_sregs(&s).map_err(kvm_err("SET_SREGS"))?;
    }
    Ok(())
}

struct Buses {
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
}

fn run_vcpu(mut fd: VcpuFd, id: usize, synced: bool, buses: Arc<Buses>, ctl: Arc<Control>, first: Arc<Mutex<Option<Instant>>>) {
    let mut trace = crate::trace::ExitTrace::default();
    if synced {
        fd.set_sync_valid_reg(kvm_ioctls::SyncReg::Register);
        fd.set_sync_valid_reg(kvm_ioctls::SyncReg::SystemRegister);
    }
    loop {
        if !ctl.wait_if_paused() {
            return;
        }
        {
            let mut f = first.lock().unwrap_or_else(|e| e.into_inner());
            if f.is_none() {
                *f = Some(Instant::now());
            }
        }
        let r = fd.run();
        ctl.exits.fetch_add(1, Ordering::Relaxed);
        let (what, addr, end): (&'static str, u64, Option<ExitReason>) = match r {
            Ok(VcpuExit::IoIn(port, data)) => {
                buses.pio.read(port as u64, data);
                ("io-in", port as u64, None)
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                buses.pio.write(port as u64, data);
                ("io-out", port as u64, None)
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                buses.mmio.read(addr, data);
                ("mmio-read", addr, None)
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                buses.mmio.write(addr, data);
                ("mmio-write", addr, None)
            }
            Ok(VcpuExit::Hlt) => ("hlt", 0, None),
            Ok(VcpuExit::Shutdown) => ("shutdown", 0, Some(ExitReason::TripleFault)),
            Ok(VcpuExit::SystemEvent(t, _)) => {
                let r = match t {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => ExitReason::PowerOff,
                    kvm_bindings::KVM_SYSTEM_EVENT_RESET => ExitReason::Reset,
                    other => ExitReason::Error(format!("system event {other}")),
                };
                ("system", t as u64, Some(r))
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => ("fail-entry", reason, Some(ExitReason::Error(format!("KVM entry failed (reason {reason:#x}) on CPU {cpu}")))),
            Ok(VcpuExit::InternalError) => ("internal", 0, Some(ExitReason::Error("KVM internal error (an instruction the host cannot emulate)".into()))),
            Ok(other) => {
                tracing::warn!("unhandled vCPU exit {other:?}");
                ("other", 0, None)
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => ("signal", 0, None),
            Err(e) => ("error", 0, Some(ExitReason::Error(format!("KVM_RUN: {e}")))),
        };
        let synced_regs = synced.then(|| fd.sync_regs());
        trace.record(what, addr, synced_regs.as_ref().map(|s| (&s.regs, &s.sregs)));
        if let Some(reason) = end {
            if matches!(reason, ExitReason::TripleFault | ExitReason::Error(_)) {
                // The guest died: leave what it was doing in the log.
                let report = trace.report(id, &reason.to_string(), fd.get_regs().ok().as_ref(), fd.get_sregs().ok().as_ref(), fd.get_vcpu_events().ok().as_ref(), synced);
                tracing::error!("{report}");
            }
            return ctl.request_exit(reason);
        }
    }
}

/// Opens the tap of every network interface of `cfg`, in order.
pub fn open_taps(cfg: &VmConfig) -> Result<Vec<Tap>, VmError> {
    Ok(cfg.nets.iter().map(|n| Tap::open(&n.tap)).collect::<Result<Vec<_>, _>>()?)
}

impl Vm {
    /// Builds and starts the VM, opening its taps. vCPUs are running when
    /// this returns.
    pub fn start(cfg: VmConfig) -> Result<Vm, VmError> {
        Vm::start_with_taps(cfg, None)
    }

    /// As [`Vm::start`], with the taps of `cfg.nets` opened beforehand by
    /// [`open_taps`]: a jailed VMM opens them before it enters the jail,
    /// whose network namespace holds no interface.
    pub fn start_with_taps(mut cfg: VmConfig, taps: Option<Vec<Tap>>) -> Result<Vm, VmError> {
        let start = Instant::now();
        cfg.validate()?;
        let placement = match cfg.numa_node {
            Some(n) => Some(Topology::read(&sysfs_root())?.cpus_for(n)?.to_vec()),
            None => None,
        };
        let kvm = Kvm::new().map_err(|e| VmError::Kvm(e.to_string()))?;
        let vm = Arc::new(kvm.create_vm().map_err(kvm_err("CREATE_VM"))?);
        let ram = GuestRam::new(cfg.memory_bytes(), cfg.hugepages, cfg.numa_node)?;
        for (slot, r) in ram.mem.iter().enumerate() {
            let region = kvm_bindings::kvm_userspace_memory_region { slot: slot as u32, guest_phys_addr: r.start_addr().0, memory_size: r.len(), userspace_addr: r.as_ptr() as u64, flags: 0 };
            // SAFETY: the region maps memory owned by `ram`, which the Vm
            // keeps alive for as long as the VM fd exists.
            unsafe { vm.set_user_memory_region(region) }.map_err(kvm_err("SET_USER_MEMORY_REGION"))?;
        }
        vm.set_tss_address(0xfffb_d000).map_err(kvm_err("SET_TSS_ADDR"))?;
        vm.set_identity_map_address(0xfffb_c000).map_err(kvm_err("SET_IDENTITY_MAP_ADDR"))?;
        vm.create_irq_chip().map_err(kvm_err("CREATE_IRQCHIP"))?;
        vm.create_pit2(kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() }).map_err(kvm_err("CREATE_PIT2"))?;
        let entry = boot::load(&ram.mem, &cfg)?;

        let (exit_tx, exit_rx) = channel();
        let control = Control::new(cfg.vcpus as usize, exit_tx.clone());
        let buses = Arc::new(Buses { pio: Arc::new(Bus::new("pio")), mmio: Arc::new(Bus::new("mmio")) });
        let dev_err = |e: String| VmError::Device(e);

        let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err(e.to_string()))?;
        vm.register_irqfd(&serial_irq, COM1_IRQ).map_err(kvm_err("IRQFD serial"))?;
        let serial = SerialConsole::new(serial_irq, serial_out(&cfg.serial)?);
        buses.pio.insert(COM1_PORT, 8, Arc::new(Mutex::new(serial))).map_err(|e| dev_err(e.to_string()))?;

        let kbd_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err(e.to_string()))?;
        vm.register_irqfd(&kbd_irq, i8042::KBD_IRQ).map_err(kvm_err("IRQFD i8042"))?;
        let keyboard = Arc::new(Mutex::new(I8042::new(kbd_irq, exit_tx)));
        buses.pio.insert(i8042::DATA_PORT, 5, keyboard.clone()).map_err(|e| dev_err(e.to_string()))?;

        buses.pio.insert(crate::devices::cmos::PORT, 2, Arc::new(Mutex::new(crate::devices::cmos::Cmos::default()))).map_err(|e| dev_err(e.to_string()))?;

        let routing = Arc::new(IrqRouting::new(vm.clone()));
        routing.set_msi(u32::MAX, None).map_err(dev_err)?; // install the default table
                                                           // The high BAR window ends where the guest's CPUID says its
                                                           // physical addresses do.
        let leaf = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).ok().and_then(|c| c.as_slice().iter().find(|e| e.function == 0x8000_0008).map(|e| e.eax));
        let mut pci = PciRoot::new(buses.mmio.clone(), crate::memory::high_mmio_window(ram.size, crate::memory::guest_phys_bits(leaf)));
        let mut devices = Vec::new();
        if cfg.rng {
            let d = Arc::new(Mutex::new(VirtioPci::new(Box::new(Rng::default()), ram.mem.clone(), routing.clone()).map_err(dev_err)?));
            pci.add(d.clone()).map_err(dev_err)?;
            devices.push(d);
        }
        for (i, d) in cfg.disks.iter().enumerate() {
            // Opened at every start (a reboot re-spawns the VMM), never
            // through a symbolic link, checked on the descriptor.
            let mut flags = if d.read_only { libc::O_RDONLY } else { libc::O_RDWR };
            if d.direct {
                flags |= libc::O_DIRECT;
            }
            let f = crate::safe_open::open("disk", &d.path, crate::safe_open::Kind::FileOrBlockDevice, flags, 0)?;
            let id = d.id.clone().unwrap_or_else(|| format!("vgpu-disk{i}"));
            let blk = crate::devices::virtio::block::Block::new(f, d.read_only, &id, crate::config::disk_limit(d)).map_err(|e| dev_err(format!("disk {}: {e}", d.path.display())))?;
            let dev = Arc::new(Mutex::new(VirtioPci::new(Box::new(blk), ram.mem.clone(), routing.clone()).map_err(dev_err)?));
            pci.add(dev.clone()).map_err(dev_err)?;
            devices.push(dev);
        }
        // The taps: opened before a jail by the caller, or here.
        let taps = match taps {
            Some(t) => t,
            None => open_taps(&cfg)?,
        };
        if taps.len() != cfg.nets.len() {
            return Err(dev_err(format!("{} taps for {} network interfaces", taps.len(), cfg.nets.len())));
        }
        for (i, (n, tap)) in cfg.nets.iter_mut().zip(taps).enumerate() {
            // GET /vm shows the address the guest got.
            let mac = n.mac_or_derived(i);
            n.mac = Some(mac);
            let (rx, tx) = crate::config::net_limits(n);
            let net = crate::devices::virtio::net::Net::new(tap, mac.0, rx, tx);
            let dev = Arc::new(Mutex::new(VirtioPci::new(Box::new(net), ram.mem.clone(), routing.clone()).map_err(dev_err)?));
            pci.add(dev.clone()).map_err(dev_err)?;
            devices.push(dev);
        }
        if let Some(v) = &cfg.vgpu {
            let gpu = crate::devices::virtio::vhost_gpu::VhostGpu::connect(&v.socket, v.headless, std::time::Duration::from_secs(v.reconnect_s.into())).map_err(|e| dev_err(e.to_string()))?;
            let d = Arc::new(Mutex::new(VirtioPci::new(Box::new(gpu), ram.mem.clone(), routing.clone()).map_err(dev_err)?));
            pci.add(d.clone()).map_err(dev_err)?;
            devices.push(d);
        }
        // Passthrough devices last: one VFIO container for the VM, guest
        // RAM DMA-mapped in it with the first device.
        let mut vfio = Vec::new();
        if !cfg.vfio.is_empty() {
            let slots = Arc::new(crate::memory::SlotAllocator::new(kvm.get_nr_memslots() as u32));
            let mut ctx = VfioContext::new(&vm, ram.mem.clone(), slots).map_err(|e| dev_err(format!("VFIO container: {e}")))?;
            let sysfs = sysfs_root();
            for a in &cfg.vfio {
                let d = Arc::new(Mutex::new(VfioPci::new(*a, &mut ctx, &sysfs, vm.clone(), routing.clone())?));
                pci.add(d.clone()).map_err(|e| dev_err(format!("{a}: {e}")))?;
                vfio.push(d);
            }
        }
        buses.pio.insert(CONFIG_ADDRESS_PORT, 8, Arc::new(Mutex::new(pci))).map_err(|e| dev_err(e.to_string()))?;

        // SAFETY: the handler does nothing; it only makes KVM_RUN return EINTR.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_kick as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(kick_signal(), &sa, std::ptr::null_mut());
        }

        let first_entry = Arc::new(Mutex::new(None));
        let mut vcpu_threads = Vec::new();
        let count = cfg.vcpus as u8;
        // Registers at every exit, for the log of a guest that dies (trace.rs).
        let want = (kvm_bindings::KVM_SYNC_X86_REGS | kvm_bindings::KVM_SYNC_X86_SREGS) as i32;
        let synced = kvm.check_extension_int(kvm_ioctls::Cap::SyncRegs) & want == want;
        for id in 0..count {
            let fd = vm.create_vcpu(id as u64).map_err(kvm_err("CREATE_VCPU"))?;
            setup_vcpu(&kvm, &fd, id, count, (id == 0).then_some(entry))?;
            let (buses, ctl, first, cpus, node) = (buses.clone(), control.clone(), first_entry.clone(), placement.clone(), cfg.numa_node);
            let (ready_tx, ready_rx) = channel::<Result<(), VmError>>();
            let h = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || {
                    if let (Some(cpus), Some(node)) = (cpus, node) {
                        if let Err(e) = pin_current_thread(&cpus, node) {
                            let _ = ready_tx.send(Err(e.into()));
                            return;
                        }
                    }
                    // The vCPU's own allow-list, from before its first KVM_RUN.
                    if let Err(e) = crate::seccomp::confine(crate::seccomp::ThreadKind::Vcpu) {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                    // SAFETY: pthread_self has no preconditions.
                    ctl.threads.lock().unwrap_or_else(|e| e.into_inner()).push(unsafe { libc::pthread_self() });
                    let _ = ready_tx.send(Ok(()));
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_vcpu(fd, id as usize, synced, buses, ctl.clone(), first)));
                    if r.is_err() {
                        ctl.request_exit(ExitReason::Error(format!("vCPU {id} thread panicked")));
                    }
                })
                .map_err(|e| dev_err(e.to_string()))?;
            ready_rx.recv().map_err(|_| dev_err("vCPU thread died".into()))??;
            vcpu_threads.push(h);
        }

        let info = VmInfo {
            state: RunState::Running,
            memory_bytes: ram.size,
            memory_backing: match cfg.hugepages {
                crate::config::Hugepages::None => "memfd",
                crate::config::Hugepages::TwoMiB => "memfd-hugetlb-2M",
                crate::config::Hugepages::OneGiB => "memfd-hugetlb-1G",
            },
            numa_node: cfg.numa_node,
            vcpu_cpus: placement,
            vcpus: cfg.vcpus,
            pid: std::process::id(),
            config: cfg,
        };
        Ok(Vm { control, info, keyboard, exit_rx, vcpu_threads, start, first_entry, _vfio: vfio, _ram: ram, _vm: vm, _devices: devices })
    }

    /// Asks the guest to shut down: Ctrl-Alt-Del on the keyboard.
    pub fn request_shutdown(&self) {
        self.keyboard.lock().unwrap_or_else(|e| e.into_inner()).ctrl_alt_del();
    }

    /// Waits for the VM to end and stops every vCPU.
    pub fn wait(mut self) -> ExitReason {
        let reason = self.exit_rx.recv().unwrap_or(ExitReason::Error("exit channel closed".into()));
        self.control.exit.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.control.stop_all();
        // Kick until every vCPU thread has left KVM_RUN: one that was about
        // to enter it when the first kick landed needs another.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.vcpu_threads.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            self.control.kick_all();
            std::thread::sleep(Duration::from_millis(1));
        }
        for h in self.vcpu_threads.drain(..) {
            if h.is_finished() {
                let _ = h.join();
            }
        }
        reason
    }
}
