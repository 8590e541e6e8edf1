//! Seccomp allow-lists per thread kind (rust-vmm `seccompiler`), after
//! Firecracker: the main thread, the vCPU threads, the device worker
//! threads and the API thread each install their own list once their
//! setup is done. A syscall off the list traps: the SIGSYS handler names
//! it on stderr and the process dies of SIGSYS.
//!
//! Every thread also carries two small stacked filters that answer instead
//! of trapping: opening a file fails with EACCES (glibc's malloc may probe
//! a /proc file when it trims a thread's heap), and `clone3` fails with
//! ENOSYS so that glibc falls back to `clone`, whose flags a filter can
//! read (threads yes, processes no).
//!
//! Threads inherit their creator's filters: device threads are started by
//! a vCPU (when the guest driver activates the device), so the vCPU list
//! holds what they need before they narrow themselves, and `tokio`'s
//! blocking threads run under the API thread's list.
//!
//! docs/vmm.md lists the syscalls of each kind and why.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the {kind} seccomp filter: {err}")]
    Build {
        kind: &'static str,
        #[source]
        err: seccompiler::BackendError,
    },
    #[error("installing the {kind} seccomp filter: {err}")]
    Install {
        kind: &'static str,
        #[source]
        err: seccompiler::Error,
    },
    #[error("installing the SIGSYS handler: {0}")]
    Handler(#[source] std::io::Error),
    #[error("seccomp is not initialised: call seccomp::init first")]
    NotInitialised,
    #[error("unknown thread kind {0:?}: use main, vcpu, api or device")]
    UnknownKind(String),
}

/// The kinds of thread the VMM runs; each has its own allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ThreadKind {
    /// Starts the VM, then waits for it to end and stops the vCPUs.
    Main,
    /// Runs KVM_RUN and dispatches port and MMIO exits to the devices.
    Vcpu,
    /// Serves the REST API (tokio, current-thread runtime).
    Api,
    /// A device's worker (virtio-rng, the vGPU interrupt forwarder).
    Device,
    /// The vGPU's link to its backend, which connects again to the same
    /// unix socket when the backend hangs up.
    Link,
}

impl ThreadKind {
    pub const ALL: [ThreadKind; 5] = [ThreadKind::Main, ThreadKind::Vcpu, ThreadKind::Api, ThreadKind::Device, ThreadKind::Link];

    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Main => "main",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Api => "api",
            ThreadKind::Device => "device",
            ThreadKind::Link => "link",
        }
    }
}

impl std::str::FromStr for ThreadKind {
    type Err = SeccompError;
    fn from_str(s: &str) -> Result<Self, SeccompError> {
        ThreadKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| SeccompError::UnknownKind(s.to_string()))
    }
}

impl std::fmt::Display for ThreadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The KVM ioctls a vCPU thread makes once the VM runs.
pub mod kvm {
    use kvm_bindings::{kvm_device_attr, kvm_ioeventfd, kvm_irq_routing, kvm_irqfd, kvm_regs, kvm_sregs, kvm_userspace_memory_region, kvm_vcpu_events};

    const KVMIO: u32 = 0xAE;
    vmm_sys_util::ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    // A guest that moves a virtio BAR moves the queues' notify ioeventfds.
    vmm_sys_util::ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);
    // A guest that programs an MSI-X vector changes the GSI routes.
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_GSI_ROUTING, KVMIO, 0x6a, kvm_irq_routing);
    // A guest that masks or unmasks a passthrough device's MSI-X vector
    // removes or adds its irqfd.
    vmm_sys_util::ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_irqfd);
    // A guest that moves a passthrough BAR, or turns its decoding off and
    // on, moves the memory slots the BAR is mapped with.
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_USER_MEMORY_REGION, KVMIO, 0x46, kvm_userspace_memory_region);
    // A VFIO group leaving KVM's VFIO device when a passthrough device is released.
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_DEVICE_ATTR, KVMIO, 0xe1, kvm_device_attr);
    // A vCPU whose guest died reads its own state for the log (trace.rs).
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
}

/// The VFIO ioctls made once the VM runs (`_IO(';', 100 + n)`).
pub mod vfio {
    const VFIO_TYPE: u32 = 0x3B;
    const VFIO_BASE: u32 = 100;
    // A passthrough device's group leaves the VM's container on release.
    vmm_sys_util::ioctl_io_nr!(VFIO_GROUP_UNSET_CONTAINER, VFIO_TYPE, VFIO_BASE + 5);
    // A guest enabling or disabling MSI-X on a passthrough device.
    vmm_sys_util::ioctl_io_nr!(VFIO_DEVICE_SET_IRQS, VFIO_TYPE, VFIO_BASE + 10);
    // A passthrough device reset when the VM stops.
    vmm_sys_util::ioctl_io_nr!(VFIO_DEVICE_RESET, VFIO_TYPE, VFIO_BASE + 11);
}

/// What every thread may do: memory, locks, time, signals for itself,
/// reading and writing descriptors it already has, ending.
const COMMON: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_futex,
    libc::SYS_brk,
    libc::SYS_munmap,
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettimeofday,
    libc::SYS_getrandom,
    libc::SYS_rseq,
    libc::SYS_set_robust_list,
    libc::SYS_exit,
    libc::SYS_exit_group,
    // Reach the stacked files filter, which fails them with EACCES.
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_creat,
    libc::SYS_openat2,
];

/// vCPU threads, besides COMMON: KVM_RUN and the two VM ioctls a guest's
/// PCI programming causes; activating a device (eventfds, the vhost-user
/// messages, its worker thread) and resetting one.
const VCPU: &[i64] = &[
    libc::SYS_eventfd2,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_clone3,
    // What the device threads started here need before their own list.
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    // virtio-blk's disk I/O, which its device thread does under this list
    // and its own (the filters stack).
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_fdatasync,
];

/// The API thread and its blocking helpers, besides COMMON.
const API: &[i64] =
    &[libc::SYS_epoll_ctl, libc::SYS_epoll_wait, libc::SYS_epoll_pwait, libc::SYS_accept4, libc::SYS_recvfrom, libc::SYS_sendto, libc::SYS_shutdown, libc::SYS_getsockopt, libc::SYS_clone3];

/// The main thread after the VM started, besides COMMON: removing the API
/// socket at the end; readlink, for vfio-ioctls's release of a passthrough
/// device (it reads the device's iommu_group link again), with the ioctls
/// of that release (see `rules`).
const MAIN: &[i64] = &[libc::SYS_unlink, libc::SYS_readlink, libc::SYS_readlinkat];

/// Device worker threads, besides COMMON: waiting on their eventfds, and
/// the disk I/O of virtio-blk on the image files opened before the VM ran.
const DEVICE: &[i64] = &[libc::SYS_epoll_wait, libc::SYS_epoll_pwait, libc::SYS_pread64, libc::SYS_pwrite64, libc::SYS_fdatasync];

/// The vGPU link thread, besides COMMON: waiting on its connection, and
/// reconnecting: a unix stream socket (`rules` allows AF_UNIX,
/// SOCK_STREAM|SOCK_CLOEXEC only), connect, and
/// the vhost-user messages, whose descriptors it already holds. The path
/// it connects to is fixed at start; in a jail it is the only socket the
/// VMM can see.
const LINK: &[i64] = &[libc::SYS_epoll_ctl, libc::SYS_epoll_wait, libc::SYS_epoll_pwait, libc::SYS_connect, libc::SYS_sendmsg, libc::SYS_recvmsg];

/// Never on any list: the SIGSYS handler makes it to be killed for sure
/// when a re-raised SIGSYS was not fatal (the init of a PID namespace
/// ignores its own default-action signals).
const NEVER_ALLOWED: i64 = libc::SYS_getppid;

fn cond(kind: ThreadKind, arg: u8, op: SeccompCmpOp, v: u64) -> Result<SeccompCondition, SeccompError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, v).map_err(|err| SeccompError::Build { kind: kind.name(), err })
}

/// One rule per value: argument `arg` equals any of `values`.
fn any_of(kind: ThreadKind, arg: u8, values: &[u64]) -> Result<Vec<SeccompRule>, SeccompError> {
    values.iter().map(|&v| SeccompRule::new(vec![cond(kind, arg, SeccompCmpOp::Eq, v)?]).map_err(|err| SeccompError::Build { kind: kind.name(), err })).collect()
}

/// Argument `arg` has none of the bits in `mask`.
fn without_bits(kind: ThreadKind, arg: u8, mask: u64) -> Result<Vec<SeccompRule>, SeccompError> {
    let c = cond(kind, arg, SeccompCmpOp::MaskedEq(mask), 0)?;
    Ok(vec![SeccompRule::new(vec![c]).map_err(|err| SeccompError::Build { kind: kind.name(), err })?])
}

/// Argument `arg` has all of the bits in `mask`.
fn with_bits(kind: ThreadKind, arg: u8, mask: u64) -> Result<Vec<SeccompRule>, SeccompError> {
    let c = cond(kind, arg, SeccompCmpOp::MaskedEq(mask), mask)?;
    Ok(vec![SeccompRule::new(vec![c]).map_err(|err| SeccompError::Build { kind: kind.name(), err })?])
}

/// The signal that kicks vCPUs out of KVM_RUN (see vm.rs).
fn kick_signal() -> u64 {
    (libc::SIGRTMIN() + 1) as u64
}

/// The allow-list of `kind`, as seccompiler rules.
pub fn rules(kind: ThreadKind) -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut r: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let extra = match kind {
        ThreadKind::Main => MAIN,
        ThreadKind::Vcpu => VCPU,
        ThreadKind::Api => API,
        ThreadKind::Device => DEVICE,
        ThreadKind::Link => LINK,
    };
    for &nr in COMMON.iter().chain(extra) {
        r.insert(nr, Vec::new());
    }
    // No executable mappings: nothing is loaded once the VM runs.
    r.insert(libc::SYS_mmap, without_bits(kind, 2, libc::PROT_EXEC as u64)?);
    r.insert(libc::SYS_mprotect, without_bits(kind, 2, libc::PROT_EXEC as u64)?);
    // The SIGSYS handler resets its action and re-raises.
    r.insert(libc::SYS_rt_sigaction, any_of(kind, 0, &[libc::SIGSYS as u64])?);
    let mut signals = vec![libc::SIGSYS as u64];
    match kind {
        ThreadKind::Main | ThreadKind::Api => signals.push(kick_signal()),
        ThreadKind::Vcpu | ThreadKind::Device | ThreadKind::Link => {}
    }
    r.insert(libc::SYS_tgkill, any_of(kind, 2, &signals)?);
    match kind {
        ThreadKind::Vcpu => {
            // The passthrough ones: a guest programming MSI-X (irqfds, VFIO's
            // trigger eventfds) and placing BARs (memory slots).
            let ioctls = [
                kvm::KVM_RUN(),
                kvm::KVM_IOEVENTFD(),
                kvm::KVM_SET_GSI_ROUTING(),
                kvm::KVM_IRQFD(),
                kvm::KVM_SET_USER_MEMORY_REGION(),
                vfio::VFIO_DEVICE_SET_IRQS(),
                kvm::KVM_GET_REGS(),
                kvm::KVM_GET_SREGS(),
                kvm::KVM_GET_VCPU_EVENTS(),
            ];
            r.insert(libc::SYS_ioctl, any_of(kind, 1, &ioctls)?);
            r.insert(libc::SYS_fcntl, any_of(kind, 1, &[libc::F_DUPFD_CLOEXEC as u64])?);
            // Threads, never processes.
            r.insert(libc::SYS_clone, with_bits(kind, 0, libc::CLONE_THREAD as u64)?);
            r.insert(libc::SYS_prctl, any_of(kind, 0, &[libc::PR_SET_NAME as u64, libc::PR_SET_NO_NEW_PRIVS as u64])?);
            // A device thread narrows itself: another filter, this thread only.
            let add = SeccompRule::new(vec![cond(kind, 0, SeccompCmpOp::Eq, libc::SECCOMP_SET_MODE_FILTER as u64)?, cond(kind, 1, SeccompCmpOp::Eq, 0)?])
                .map_err(|err| SeccompError::Build { kind: kind.name(), err })?;
            r.insert(libc::SYS_seccomp, vec![add]);
        }
        ThreadKind::Api => {
            r.insert(libc::SYS_clone, with_bits(kind, 0, libc::CLONE_THREAD as u64)?);
            r.insert(libc::SYS_prctl, any_of(kind, 0, &[libc::PR_SET_NAME as u64])?);
            r.insert(libc::SYS_fcntl, any_of(kind, 1, &[libc::F_DUPFD_CLOEXEC as u64])?);
        }
        ThreadKind::Main => {
            // Releasing a passthrough device when the VM ends (the Vm is
            // dropped here): MSI-X off and its irqfds removed, its memory
            // slots removed, the device reset, its group out of KVM's VFIO
            // device and out of the container.
            let ioctls = [vfio::VFIO_DEVICE_SET_IRQS(), vfio::VFIO_DEVICE_RESET(), vfio::VFIO_GROUP_UNSET_CONTAINER(), kvm::KVM_IRQFD(), kvm::KVM_SET_USER_MEMORY_REGION(), kvm::KVM_SET_DEVICE_ATTR()];
            r.insert(libc::SYS_ioctl, any_of(kind, 1, &ioctls)?);
        }
        ThreadKind::Device => {}
        ThreadKind::Link => {
            // A unix stream socket (close-on-exec), never a datagram or a
            // network one; the clone of the connection it watches.
            let stream = SeccompRule::new(vec![cond(kind, 0, SeccompCmpOp::Eq, libc::AF_UNIX as u64)?, cond(kind, 1, SeccompCmpOp::Eq, (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64)?])
                .map_err(|err| SeccompError::Build { kind: kind.name(), err })?;
            r.insert(libc::SYS_socket, vec![stream]);
            r.insert(libc::SYS_fcntl, any_of(kind, 1, &[libc::F_DUPFD_CLOEXEC as u64])?);
            // The handshake's time limit, set and lifted.
            let timeout = SeccompRule::new(vec![cond(kind, 1, SeccompCmpOp::Eq, libc::SOL_SOCKET as u64)?, cond(kind, 2, SeccompCmpOp::Eq, libc::SO_RCVTIMEO as u64)?])
                .map_err(|err| SeccompError::Build { kind: kind.name(), err })?;
            r.insert(libc::SYS_setsockopt, vec![timeout]);
        }
    }
    Ok(r)
}

fn compile(kind: ThreadKind, rules: BTreeMap<i64, Vec<SeccompRule>>, mismatch: SeccompAction, matched: SeccompAction) -> Result<BpfProgram, SeccompError> {
    let build = |err| SeccompError::Build { kind: kind.name(), err };
    let f = SeccompFilter::new(rules, mismatch, matched, TargetArch::x86_64).map_err(build)?;
    f.try_into().map_err(build)
}

/// The filters a thread of `kind` installs, in order: the two answering
/// filters (files: EACCES; clone3: ENOSYS), then its allow-list.
pub fn filters(kind: ThreadKind) -> Result<Vec<BpfProgram>, SeccompError> {
    let listed = |nrs: &[i64]| nrs.iter().map(|&n| (n, Vec::new())).collect::<BTreeMap<_, _>>();
    Ok(vec![
        compile(kind, listed(&[libc::SYS_open, libc::SYS_openat, libc::SYS_creat, libc::SYS_openat2]), SeccompAction::Allow, SeccompAction::Errno(libc::EACCES as u32))?,
        compile(kind, listed(&[libc::SYS_clone3]), SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32))?,
        compile(kind, rules(kind)?, SeccompAction::Trap, SeccompAction::Allow)?,
    ])
}

/// Compiled filters per kind, or none when seccomp is off (`--no-seccomp`).
struct Compiled(Option<BTreeMap<ThreadKind, Vec<BpfProgram>>>);

static FILTERS: OnceLock<Compiled> = OnceLock::new();

/// Compiles every kind's filters and installs the SIGSYS handler, once
/// per process, before any thread confines itself. With `enabled` false
/// (`--no-seccomp`) every later [`confine`] does nothing.
pub fn init(enabled: bool) -> Result<(), SeccompError> {
    if FILTERS.get().is_some() {
        return Ok(());
    }
    let compiled = if enabled {
        install_handler()?;
        let mut m = BTreeMap::new();
        for k in ThreadKind::ALL {
            m.insert(k, filters(k)?);
        }
        Some(m)
    } else {
        None
    };
    let _ = FILTERS.set(Compiled(compiled));
    Ok(())
}

/// Whether [`init`] turned the filters on.
pub fn enabled() -> bool {
    matches!(FILTERS.get(), Some(Compiled(Some(_))))
}

/// Confines the calling thread as a thread of `kind`. Does nothing when
/// seccomp is off or [`init`] was never called (the library's own tests).
pub fn confine(kind: ThreadKind) -> Result<(), SeccompError> {
    let Some(Compiled(Some(m))) = FILTERS.get() else { return Ok(()) };
    for f in m.get(&kind).into_iter().flatten() {
        seccompiler::apply_filter(f).map_err(|err| SeccompError::Install { kind: kind.name(), err })?;
    }
    Ok(())
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // Async-signal-safe only: the number is formatted by hand into a
    // fixed buffer and written with write(2).
    const PREFIX: &[u8] = b"vgpu-vmm: seccomp: forbidden syscall ";
    let mut msg = [0u8; PREFIX.len() + 12];
    msg[..PREFIX.len()].copy_from_slice(PREFIX);
    // SAFETY: the kernel hands a SIGSYS handler a valid siginfo; on x86_64
    // a seccomp trap's syscall number is the int at byte 24 (after
    // si_signo, si_errno, si_code, padding and si_call_addr).
    let nr = unsafe { std::ptr::read_unaligned((info as *const u8).add(24).cast::<i32>()) };
    let mut digits = [0u8; 10];
    let mut n = nr.unsigned_abs();
    let mut d = 0;
    loop {
        digits[d] = b'0' + (n % 10) as u8;
        n /= 10;
        d += 1;
        if n == 0 {
            break;
        }
    }
    let mut len = PREFIX.len();
    if nr < 0 {
        msg[len] = b'-';
        len += 1;
    }
    for i in (0..d).rev() {
        msg[len] = digits[i];
        len += 1;
    }
    msg[len] = b'\n';
    len += 1;
    // SAFETY: write, signal, raise and a raw syscall are async-signal-safe;
    // msg[..len] is initialised.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), len);
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        libc::raise(libc::SIGSYS);
        // Still alive: this process is a PID namespace's init, which
        // ignores its own default-action signals. A trap while SIGSYS has
        // its default action is fatal even to an init.
        libc::syscall(NEVER_ALLOWED);
        libc::_exit(128 + libc::SIGSYS);
    }
}

fn install_handler() -> Result<(), SeccompError> {
    // SAFETY: a zeroed sigaction is a valid value; the handler is an
    // extern "C" fn making only async-signal-safe calls.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigsys as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
            return Err(SeccompError::Handler(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// The syscalls `vgpu-vmm seccomp-check --syscall NAME` can make.
pub const CHECK_SYSCALLS: &[&str] = &["getpid", "openat", "clone3", "thread", "fork", "execve", "ptrace", "socket-unix", "socket-unix-dgram", "socket-inet", "kvm-run", "kvm-create-vm", "unlink"];

/// Makes one named syscall for the seccomp self-test and returns its
/// result (a negative errno on failure). A forbidden one never returns.
pub fn make_syscall(name: &str) -> Result<i64, String> {
    let errno = |rc: i64| if rc == -1 { -(std::io::Error::last_os_error().raw_os_error().unwrap_or(0) as i64) } else { rc };
    // SAFETY: each call passes valid arguments (static C strings, null
    // pointers where the kernel accepts them, integers, an invalid fd for
    // the ioctls) and only its result is used. "fork" ends the child at once.
    let rc = unsafe {
        match name {
            "getpid" => libc::syscall(libc::SYS_getpid),
            "openat" => errno(libc::syscall(libc::SYS_openat, libc::AT_FDCWD, c"/etc/hostname".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC)),
            "clone3" => errno(libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize)),
            "thread" => match std::thread::Builder::new().name("check".into()).spawn(|| 7).map(|h| h.join()) {
                Ok(Ok(v)) => v,
                Ok(Err(_)) => return Err("the thread panicked".into()),
                Err(e) => return Err(format!("spawning a thread: {e}")),
            },
            "fork" => match libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) {
                0 => libc::_exit(0),
                pid => errno(pid),
            },
            "execve" => errno(libc::syscall(libc::SYS_execve, c"/bin/true".as_ptr(), std::ptr::null::<*const libc::c_char>(), std::ptr::null::<*const libc::c_char>())),
            "ptrace" => errno(libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0)),
            "socket-unix" => errno(libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)),
            "socket-unix-dgram" => errno(libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)),
            "socket-inet" => errno(libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)),
            "kvm-run" => errno(libc::syscall(libc::SYS_ioctl, -1, kvm::KVM_RUN(), 0)),
            "kvm-create-vm" => errno(libc::syscall(libc::SYS_ioctl, -1, 0xAE01u64, 0)),
            "unlink" => errno(libc::syscall(libc::SYS_unlink, c"/nonexistent/vgpu-seccomp-check".as_ptr())),
            other => return Err(format!("unknown syscall {other:?}: use one of {}", CHECK_SYSCALLS.join(", "))),
        }
    };
    Ok(rc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_compiles_and_no_list_holds_the_handlers_fallback() {
        for k in ThreadKind::ALL {
            assert_eq!(filters(k).unwrap().len(), 3);
            let r = rules(k).unwrap();
            assert!(!r.contains_key(&NEVER_ALLOWED), "{k}");
            for forbidden in [libc::SYS_execve, libc::SYS_execveat, libc::SYS_ptrace, libc::SYS_fork, libc::SYS_vfork, libc::SYS_bind, libc::SYS_listen, libc::SYS_mount, libc::SYS_setuid] {
                assert!(!r.contains_key(&forbidden), "{k} allows syscall {forbidden}");
            }
            // Only the vGPU link connects, and only to unix sockets.
            if k != ThreadKind::Link {
                assert!(!r.contains_key(&libc::SYS_socket) && !r.contains_key(&libc::SYS_connect), "{k} may connect");
            }
        }
        assert_eq!(rules(ThreadKind::Link).unwrap()[&libc::SYS_socket].len(), 1, "the link's socket rule is a unix stream socket alone");
        assert!(!rules(ThreadKind::Device).unwrap().contains_key(&libc::SYS_ioctl));
        assert!(!rules(ThreadKind::Device).unwrap().contains_key(&libc::SYS_clone));
    }

    #[test]
    fn kvm_ioctl_numbers_match_the_kernel_headers() {
        assert_eq!(kvm::KVM_RUN(), 0xAE80);
        assert_eq!(kvm::KVM_IOEVENTFD(), 0x4040_AE79);
        assert_eq!(kvm::KVM_SET_GSI_ROUTING(), 0x4008_AE6A);
        assert_eq!(kvm::KVM_IRQFD(), 0x4020_AE76);
        assert_eq!(kvm::KVM_SET_USER_MEMORY_REGION(), 0x4020_AE46);
        assert_eq!(kvm::KVM_SET_DEVICE_ATTR(), 0x4018_AEE1);
        assert_eq!(kvm::KVM_GET_REGS(), 0x8090_AE81);
        assert_eq!(kvm::KVM_GET_SREGS(), 0x8138_AE83);
        assert_eq!(kvm::KVM_GET_VCPU_EVENTS(), 0x8040_AE9F);
        assert_eq!(vfio::VFIO_GROUP_UNSET_CONTAINER(), 0x3B69);
        assert_eq!(vfio::VFIO_DEVICE_SET_IRQS(), 0x3B6E);
        assert_eq!(vfio::VFIO_DEVICE_RESET(), 0x3B6F);
    }

    #[test]
    fn thread_kinds_parse_by_name() {
        for k in ThreadKind::ALL {
            assert_eq!(k.name().parse::<ThreadKind>().unwrap(), k);
        }
        assert!("vcpu0".parse::<ThreadKind>().is_err());
    }
}
