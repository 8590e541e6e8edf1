//! Confines a device worker once its device is open: its own mount
//! namespace, an unprivileged uid and gid with no supplementary groups
//! (which clears every capability), and `no_new_privs`.

use crate::config::Owner;

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("{what} failed: {err}")]
    Sys { what: &'static str, #[source] err: std::io::Error },
    #[error("capabilities remain after dropping privileges (CapEff {0})")]
    CapsLeft(String),
}

fn check(rc: libc::c_int, what: &'static str) -> Result<(), ConfineError> {
    if rc == 0 { Ok(()) } else { Err(ConfineError::Sys { what, err: std::io::Error::last_os_error() }) }
}

/// Sets `no_new_privs`: no exec can grant privileges again, and seccomp
/// filters may be installed without CAP_SYS_ADMIN.
pub fn no_new_privs() -> Result<(), ConfineError> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, "PR_SET_NO_NEW_PRIVS")
}

/// Enters a private mount namespace, drops to `user`, and sets
/// `no_new_privs`. Fails (and the worker with it) if anything is left.
pub fn drop_privileges(user: Owner) -> Result<(), ConfineError> {
    // SAFETY: unshare affects only this process.
    check(unsafe { libc::unshare(libc::CLONE_NEWNS) }, "unshare(CLONE_NEWNS)")?;
    // Mounts made from here on stay in this namespace.
    // SAFETY: a propagation change on "/" with no data argument.
    check(unsafe { libc::mount(c"none".as_ptr(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) }, "making / private")?;
    // SAFETY: an empty group list.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }, "setgroups")?;
    // SAFETY: plain id changes of this process.
    check(unsafe { libc::setresgid(user.gid, user.gid, user.gid) }, "setresgid")?;
    // SAFETY: as above; leaving uid 0 clears the capability sets.
    check(unsafe { libc::setresuid(user.uid, user.uid, user.uid) }, "setresuid")?;
    no_new_privs()?;
    let status = std::fs::read_to_string("/proc/self/status").map_err(|err| ConfineError::Sys { what: "reading /proc/self/status", err })?;
    if let Some(eff) = status.lines().find_map(|l| l.strip_prefix("CapEff:")) {
        if !eff.trim().trim_start_matches('0').is_empty() {
            return Err(ConfineError::CapsLeft(eff.trim().to_string()));
        }
    }
    Ok(())
}
