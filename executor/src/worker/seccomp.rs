//! The device worker's seccomp allow-lists (rust-vmm `seccompiler`).
//!
//! Two lists, stacked: the process-wide list is installed on every thread
//! (TSYNC) once the worker is confined; each tenant connection thread, the
//! one that parses tenant bytes, adds a narrower list of its own that
//! leaves out creating sockets, threads and files. A syscall outside the
//! lists traps: the handler names it on stderr and the worker dies of
//! SIGSYS (the control plane restarts it).
//!
//! A `cuda` backend worker (a GPU executor) gets the same lists plus what
//! NVIDIA's driver calls once it is open ([`driver_rules`]), measured with
//! strace on an H100 (driver 580.159.04, `scripts/gpu-syscalls.sh`): the
//! driver's ioctls, thread creation from any thread, scheduling-priority
//! queries, and the executor's own end (`kill(self, SIGKILL)`,
//! vgpu_arbiter::fatal). The driver opens /dev/nvidiactl and /dev/nvidiaN for
//! every context it makes, so a GPU worker is not given the filter that
//! makes every open fail ([`files_filter`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use seccompiler::{BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the seccomp filter: {0}")]
    Build(#[source] seccompiler::BackendError),
    #[error("compiling the seccomp filter: {0}")]
    Compile(#[source] seccompiler::BackendError),
    #[error("installing the seccomp filter: {0}")]
    Install(#[source] seccompiler::Error),
    #[error("installing the SIGSYS handler: {0}")]
    Handler(#[source] std::io::Error),
}

/// Syscalls every worker thread may make.
const BASE: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_close,
    libc::SYS_fstat,
    // A ring's kick is checked to be an anonymous inode (worker/conn.rs).
    libc::SYS_fstatfs,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_lseek,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_brk,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    // A sleep or a timed wait interrupted by a stop (SIGSTOP then SIGCONT:
    // a debugger, a freezer, `kill -STOP`) is resumed by the kernel through
    // it; without it a stopped worker dies of SIGSYS when continued.
    libc::SYS_restart_syscall,
    libc::SYS_sigaltstack,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_getrandom,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_shutdown,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_eventfd2,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    // Reach the kernel, and are then refused by [`files_filter`] with
    // EACCES: glibc's malloc opens a /proc file when a heap shrinks.
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_creat,
    libc::SYS_openat2,
];

/// What the worker's other threads need besides [`BASE`]: tenant sockets
/// (AF_UNIX only), threads, socket files, thread names.
const MANAGEMENT: &[i64] = &[
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_fchmodat,
    libc::SYS_chmod,
    libc::SYS_pipe2,
    // Connection threads stack a narrower filter of their own; a filter
    // can only take permissions away.
    libc::SYS_seccomp,
];

fn cond(arg: u8, op: SeccompCmpOp, v: u64) -> Result<SeccompCondition, SeccompError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, v).map_err(SeccompError::Build)
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conds).map_err(SeccompError::Build)
}

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>) -> Result<BpfProgram, SeccompError> {
    let f = SeccompFilter::new(rules, SeccompAction::Trap, SeccompAction::Allow, TargetArch::x86_64).map_err(SeccompError::Build)?;
    f.try_into().map_err(SeccompError::Compile)
}

fn plain(list: &[i64], rules: &mut BTreeMap<i64, Vec<SeccompRule>>) {
    for &nr in list {
        rules.insert(nr, Vec::new());
    }
}

/// A thread may set its own nice value to 0..=19 (lane work runs
/// lowered), and nobody else's, and never above normal priority:
/// `setpriority(PRIO_PROCESS, 0, 0..=19)` only. (The value compares as an
/// unsigned 32-bit word, so negative values fail the bound.)
///
/// Lane threads also move themselves between cores
/// (`sched_setaffinity(0, ..)`, vgpu_arbiter::placement), and, in a worker
/// without CAP_SYS_NICE, set their own time slice with nice
/// (`sched_setattr(0, .., 0)` and `sched_getattr(0, ..)`, vgpu_arbiter::nice).
/// The attributes themselves cannot be filtered (a pointer): the worker
/// caps RLIMIT_RTPRIO at 0 and RLIMIT_NICE at 20 first
/// (vgpu_arbiter::nice::fence_limits), so without the capability the kernel
/// refuses a real-time policy or a raised priority; with it,
/// sched_setattr is left off the list.
fn own_priority(rules: &mut BTreeMap<i64, Vec<SeccompRule>>) -> Result<(), SeccompError> {
    let max = vgpu_arbiter::nice::MAX as u64;
    rules.insert(libc::SYS_sched_setaffinity, vec![rule(vec![cond(0, SeccompCmpOp::Eq, 0)?])?]);
    if SLICE.load(Ordering::Relaxed) {
        rules.insert(libc::SYS_sched_setattr, vec![rule(vec![cond(0, SeccompCmpOp::Eq, 0)?, cond(2, SeccompCmpOp::Eq, 0)?])?]);
        rules.insert(libc::SYS_sched_getattr, vec![rule(vec![cond(0, SeccompCmpOp::Eq, 0)?, cond(3, SeccompCmpOp::Eq, 0)?])?]);
    }
    rules.insert(libc::SYS_setpriority, vec![rule(vec![cond(0, SeccompCmpOp::Eq, libc::PRIO_PROCESS as u64)?, cond(1, SeccompCmpOp::Eq, 0)?, cond(2, SeccompCmpOp::Le, max)?])?]);
    Ok(())
}

/// What NVIDIA's driver calls once the backend is open, on any thread,
/// beyond [`BASE`] (measured: see the module's comment):
/// - `ioctl`, any request: the driver's ABI on /dev/nvidiactl,
///   /dev/nvidiaN and /dev/nvidia-uvm is its own private numbering;
/// - `clone`/`clone3`: it starts threads inside calls a tenant connection
///   thread makes (contexts, streams), and an executor's end starts one;
/// - `sched_get_priority_min`/`max`: asked when it makes a context;
/// - `prctl(PR_SET_NAME)`: thread names;
/// - `kill`, only SIGKILL to this process: an executor ends itself after
///   a fatal error (vgpu_arbiter::fatal).
fn driver_rules(rules: &mut BTreeMap<i64, Vec<SeccompRule>>) -> Result<(), SeccompError> {
    rules.insert(libc::SYS_ioctl, Vec::new());
    plain(&[libc::SYS_clone, libc::SYS_clone3, libc::SYS_sched_get_priority_min, libc::SYS_sched_get_priority_max], rules);
    rules.entry(libc::SYS_prctl).or_default().push(rule(vec![cond(0, SeccompCmpOp::Eq, libc::PR_SET_NAME as u64)?])?);
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() } as u64;
    rules.insert(libc::SYS_kill, vec![rule(vec![cond(0, SeccompCmpOp::Eq, me)?, cond(1, SeccompCmpOp::Eq, libc::SIGKILL as u64)?])?]);
    Ok(())
}

/// Whether the lists include [`driver_rules`] (set once, by
/// [`confine_worker`]).
static DRIVER: AtomicBool = AtomicBool::new(false);

/// The process-wide list.
pub fn worker_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules = BTreeMap::new();
    plain(BASE, &mut rules);
    own_priority(&mut rules)?;
    plain(MANAGEMENT, &mut rules);
    // Unix sockets only: no network, whatever a bug would like.
    rules.insert(libc::SYS_socket, vec![rule(vec![cond(0, SeccompCmpOp::Eq, libc::AF_UNIX as u64)?])?]);
    // Thread names and no_new_privs (before a thread's own filter), and
    // nothing else of prctl.
    rules.insert(libc::SYS_prctl, vec![rule(vec![cond(0, SeccompCmpOp::Eq, libc::PR_SET_NAME as u64)?])?, rule(vec![cond(0, SeccompCmpOp::Eq, libc::PR_SET_NO_NEW_PRIVS as u64)?])?]);
    // Non-blocking mode and close-on-exec on descriptors.
    rules.insert(libc::SYS_ioctl, vec![rule(vec![cond(1, SeccompCmpOp::Eq, libc::FIONBIO)?])?, rule(vec![cond(1, SeccompCmpOp::Eq, libc::FIOCLEX)?])?]);
    if DRIVER.load(Ordering::Relaxed) {
        driver_rules(&mut rules)?;
    }
    compile(rules)
}

/// Opening any file fails with EACCES: stacked with the allow-lists
/// (ERRNO takes precedence over ALLOW), so a worker can open nothing once
/// confined, yet code that merely probes a file keeps working.
pub fn files_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules = BTreeMap::new();
    plain(&[libc::SYS_open, libc::SYS_openat, libc::SYS_creat, libc::SYS_openat2], &mut rules);
    let f = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EACCES as u32), TargetArch::x86_64).map_err(SeccompError::Build)?;
    f.try_into().map_err(SeccompError::Compile)
}

/// The narrower list of a tenant connection thread: no sockets, files
/// or (except where the driver needs them) threads.
pub fn connection_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules = BTreeMap::new();
    plain(BASE, &mut rules);
    own_priority(&mut rules)?;
    if DRIVER.load(Ordering::Relaxed) {
        driver_rules(&mut rules)?;
    }
    compile(rules)
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // Only async-signal-safe calls here: format by hand, write, re-raise.
    let mut msg = *b"vgpu worker: seccomp: forbidden syscall          \n";
    // SAFETY: the kernel passes a valid siginfo for SIGSYS; for a seccomp
    // trap, si_syscall sits right after si_call_addr in the union.
    let nr = unsafe {
        let base = (info as *const u8).add(16);
        std::ptr::read_unaligned(base.add(8).cast::<i32>())
    };
    let mut n = nr.unsigned_abs();
    let mut i = msg.len() - 2;
    loop {
        msg[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 || i == 41 {
            break;
        }
        i -= 1;
    }
    // SAFETY: write, signal and raise are async-signal-safe; the default
    // SIGSYS action then ends the process.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        libc::raise(libc::SIGSYS);
    }
}

fn install_handler() -> Result<(), SeccompError> {
    // SAFETY: an all-zero sigaction is valid; the handler is a plain
    // extern "C" function that only makes async-signal-safe calls.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigsys as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
            return Err(SeccompError::Handler(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Whether the lists allow `sched_setattr` on the calling thread (set
/// once, by [`confine_worker`]).
static SLICE: AtomicBool = AtomicBool::new(false);

/// Installs the process-wide list on every thread of the worker. With
/// `slice`, threads may set their own scheduling attributes (only for a
/// worker without CAP_SYS_NICE: see [`own_priority`]); with `driver`, the
/// lists allow what NVIDIA's driver calls ([`driver_rules`]).
pub fn confine_worker(slice: bool, driver: bool) -> Result<(), SeccompError> {
    SLICE.store(slice, Ordering::Relaxed);
    DRIVER.store(driver, Ordering::Relaxed);
    install_handler()?;
    // NVIDIA's driver opens /dev/nvidiactl and /dev/nvidiaN again for every
    // context it makes (and /sys/devices/system/cpu/online, /proc/self/*),
    // so a GPU worker keeps open(2); its uid and mount namespace bound
    // what it reaches.
    if !driver {
        let files = files_filter()?;
        seccompiler::apply_filter_all_threads(&files).map_err(SeccompError::Install)?;
    }
    let f = worker_filter()?;
    seccompiler::apply_filter_all_threads(&f).map_err(SeccompError::Install)
}

/// Narrows the calling (tenant connection) thread further.
pub fn confine_connection_thread() -> Result<(), SeccompError> {
    let f = connection_filter()?;
    seccompiler::apply_filter(&f).map_err(SeccompError::Install)
}

/// Makes one named syscall, for the seccomp self-test
/// (`vgpu-mediatord seccomp-check`): `getpid` and `socket-unix` are on
/// the worker's list; `socket-inet`, `execve`, `ptrace`, `nice-other`,
/// `nice-raise`, `slice-other` and `affinity-other` are not, and
/// `socket-unix` is not on a connection thread's; `nice-self`,
/// `affinity-self` and (unless the lists were built without it)
/// `slice-self` are on both; `openat` fails with EACCES.
pub fn make_syscall(name: &str) -> Result<i64, String> {
    let path = c"/etc/hostname";
    // struct sched_attr, first version (48 bytes): SCHED_OTHER at nice 1.
    let mut attr = [0u32; 12];
    attr[0] = 48;
    attr[4] = 1;
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut cpus: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let set = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: each call passes valid arguments (a static C string, null
    // argv/envp, integer flags) and its result is only returned.
    let rc = unsafe {
        match name {
            "getpid" => libc::syscall(libc::SYS_getpid),
            "socket-unix" => libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0),
            "socket-inet" => libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0),
            "openat" => match libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) {
                -1 => -(std::io::Error::last_os_error().raw_os_error().unwrap_or(0) as i64),
                fd => fd,
            },
            "execve" => libc::syscall(libc::SYS_execve, c"/bin/true".as_ptr(), std::ptr::null::<*const libc::c_char>(), std::ptr::null::<*const libc::c_char>()),
            "ptrace" => libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0),
            // Lowering the calling thread's priority is allowed; touching
            // another thread's (here the process's first) is not.
            "nice-self" => libc::syscall(libc::SYS_setpriority, libc::PRIO_PROCESS, 0, 1),
            "nice-other" => libc::syscall(libc::SYS_setpriority, libc::PRIO_PROCESS, libc::getpid(), 1),
            "nice-raise" => libc::syscall(libc::SYS_setpriority, libc::PRIO_PROCESS, 0, -1),
            "slice-self" => libc::syscall(libc::SYS_sched_setattr, 0, attr.as_ptr(), 0),
            "slice-other" => libc::syscall(libc::SYS_sched_setattr, libc::getpid(), attr.as_ptr(), 0),
            // The calling thread's own cores, set again.
            "affinity-self" => match libc::sched_getaffinity(0, set, &mut cpus) {
                0 => libc::syscall(libc::SYS_sched_setaffinity, 0, set, &cpus as *const libc::cpu_set_t),
                e => e as i64,
            },
            "affinity-other" => match libc::sched_getaffinity(0, set, &mut cpus) {
                0 => libc::syscall(libc::SYS_sched_setaffinity, libc::getpid(), set, &cpus as *const libc::cpu_set_t),
                e => e as i64,
            },
            other => {
                return Err(format!(
                "unknown syscall {other:?}: use getpid, socket-unix, socket-inet, openat, execve, ptrace, nice-self, nice-other, nice-raise, slice-self, slice-other, affinity-self or affinity-other"
            ))
            }
        }
    };
    Ok(rc)
}
