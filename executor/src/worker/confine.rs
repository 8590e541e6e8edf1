//! Confines a device worker once its device is open: its own mount
//! namespace, an unprivileged uid and gid with no supplementary groups
//! (which clears every capability), and `no_new_privs`.

use vgpu_arbiter::ipc::Owner;

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("{what} failed: {err}")]
    Sys {
        what: &'static str,
        #[source]
        err: std::io::Error,
    },
    #[error("capabilities remain after dropping privileges (CapEff {0})")]
    CapsLeft(String),
    #[error("keeping CAP_SYS_NICE failed: {0}")]
    KeepNice(#[source] std::io::Error),
}

fn check(rc: libc::c_int, what: &'static str) -> Result<(), ConfineError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(ConfineError::Sys { what, err: std::io::Error::last_os_error() })
    }
}

/// Sets `no_new_privs`: no exec can grant privileges again, and seccomp
/// filters may be installed without CAP_SYS_ADMIN.
pub fn no_new_privs() -> Result<(), ConfineError> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, "PR_SET_NO_NEW_PRIVS")
}

/// Enters a private mount namespace, drops to `user`, and sets
/// `no_new_privs`. Fails (and the worker with it) if anything is left.
///
/// With `keep_nice`, CAP_SYS_NICE alone survives, so lane threads can
/// return to nice 0 (vgpu_arbiter::nice) on a host that denies raising
/// RLIMIT_NICE. Only for a worker about to install its seccomp lists: they
/// allow no syscall that uses it but `setpriority` of the calling thread
/// to 0..=19.
pub fn drop_privileges(user: Owner, keep_nice: bool) -> Result<(), ConfineError> {
    // SAFETY: unshare affects only this process.
    check(unsafe { libc::unshare(libc::CLONE_NEWNS) }, "unshare(CLONE_NEWNS)")?;
    // Mounts made from here on stay in this namespace.
    // SAFETY: a propagation change on "/" with no data argument.
    check(unsafe { libc::mount(c"none".as_ptr(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) }, "making / private")?;
    // SAFETY: an empty group list.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }, "setgroups")?;
    // SAFETY: plain id changes of this process.
    check(unsafe { libc::setresgid(user.gid, user.gid, user.gid) }, "setresgid")?;
    if keep_nice {
        // SAFETY: prctl with integer arguments only.
        check(unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) }, "PR_SET_KEEPCAPS")?;
    }
    // SAFETY: as above; leaving uid 0 clears the effective capabilities
    // (and the permitted ones, unless kept just above).
    check(unsafe { libc::setresuid(user.uid, user.uid, user.uid) }, "setresuid")?;
    let kept = if keep_nice {
        // SAFETY: prctl with integer arguments only.
        check(unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0) }, "PR_SET_KEEPCAPS")?;
        keep_only(CAP_SYS_NICE).map_err(ConfineError::KeepNice)?;
        1u64 << CAP_SYS_NICE
    } else {
        0
    };
    no_new_privs()?;
    let status = std::fs::read_to_string("/proc/self/status").map_err(|err| ConfineError::Sys { what: "reading /proc/self/status", err })?;
    for set in ["CapEff:", "CapPrm:"] {
        if let Some(v) = status.lines().find_map(|l| l.strip_prefix(set)) {
            if u64::from_str_radix(v.trim(), 16).map_or(true, |caps| caps & !kept != 0) {
                return Err(ConfineError::CapsLeft(v.trim().to_string()));
            }
        }
    }
    Ok(())
}

const CAP_SYS_NICE: u32 = 23;

/// capget/capset header and data (linux/capability.h), version 3: two
/// 32-bit words per set.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// Whether the calling thread has CAP_SYS_NICE in its effective set (as
/// root, or kept by [`drop_privileges`]); true if that cannot be read.
pub fn holds_cap_sys_nice() -> bool {
    let mut hdr = CapHeader { version: CAP_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget on the calling thread with a version-3 header writes
    // the two data words that version has.
    if unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut CapHeader, data.as_mut_ptr()) } != 0 {
        return true;
    }
    data[(CAP_SYS_NICE / 32) as usize].effective & (1 << (CAP_SYS_NICE % 32)) != 0
}

/// Leaves `cap` alone in the permitted and effective sets (nothing
/// inheritable).
fn keep_only(cap: u32) -> Result<(), std::io::Error> {
    let mut hdr = CapHeader { version: CAP_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    let word = &mut data[(cap / 32) as usize];
    word.effective = 1 << (cap % 32);
    word.permitted = 1 << (cap % 32);
    // SAFETY: capset on the calling thread with a version-3 header and the
    // two data words that version reads.
    if unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
