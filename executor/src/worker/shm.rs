//! A tenant's shared bulk-data buffer: a memfd it passed with SCM_RIGHTS,
//! mapped into the worker so copies move straight between it and device
//! memory.
//!
//! The memfd must carry F_SEAL_SHRINK: otherwise the tenant could truncate
//! it under a copy and fault the worker with SIGBUS. It must also be
//! ordinary shared memory: a hole the tenant punches in a hugetlbfs memfd
//! (the seal allows that) faults with SIGBUS once the host's huge pages
//! run out, where shared memory refills it with zeroes.

use std::fs::File;
use std::os::fd::AsRawFd;

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("shared buffer must be a memfd sealed with F_SEAL_SHRINK")]
    NotSealed,
    #[error("shared buffer must be ordinary shared memory (a memfd made without MFD_HUGETLB)")]
    NotShmem,
    #[error("shared buffer is {actual} bytes, {stated} were stated")]
    TooSmall { stated: u64, actual: u64 },
    #[error("mapping the shared buffer failed: {0}")]
    Map(std::io::Error),
}

/// Whether `fd` may back memory the worker maps from a tenant: a memfd
/// sealed against shrinking, of ordinary shared memory.
pub fn check_memfd(fd: &impl AsRawFd) -> Result<(), ShmError> {
    // SAFETY: F_GET_SEALS only reads the seal set of a descriptor the
    // caller holds.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(ShmError::NotSealed);
    }
    // SAFETY: an all-zero statfs is a valid value for fstatfs to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes only into `st`, which lives for the call.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) } != 0 || st.f_type as i64 != libc::TMPFS_MAGIC {
        return Err(ShmError::NotShmem);
    }
    Ok(())
}

pub struct Shm {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only reached through the
// bounds-checked volatile views below.
unsafe impl Send for Shm {}
// SAFETY: as above.
unsafe impl Sync for Shm {}

impl Shm {
    pub fn map(file: File, size: u64) -> Result<Shm, ShmError> {
        let fd = file.as_raw_fd();
        check_memfd(&file)?;
        let actual = file.metadata().map_err(ShmError::Map)?.len();
        if actual < size || size == 0 || size > isize::MAX as u64 {
            return Err(ShmError::TooSmall { stated: size, actual });
        }
        // SAFETY: a fresh shared mapping of `size` bytes of an fd we own;
        // the file cannot shrink below `size` (sealed), so every page of the
        // mapping stays backed. MAP_FAILED is checked below.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), size as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(ShmError::Map(std::io::Error::last_os_error()));
        }
        // The mapping keeps the memory; the descriptor can go (a region
        // costs no fd while it is registered).
        drop(file);
        Ok(Shm { ptr: ptr.cast(), len: size as usize })
    }

    /// The start of the mapping, for host-memory registration only.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, off: u64, n: u64) -> Option<usize> {
        match off.checked_add(n) {
            Some(end) if end <= self.len as u64 => Some(off as usize),
            _ => None,
        }
    }

    /// Bytes `[off, off+n)` of the buffer. The tenant may write them while
    /// a copy runs: that can only change its own data, nothing here makes
    /// decisions on them, and they are reached only through the volatile
    /// view, never as a Rust slice.
    pub fn volatile(&self, off: u64, n: u64) -> Result<crate::backend::VolatileSlice<'_>, crate::backend::BackendError> {
        let o = self.range(off, n).ok_or_else(|| range_error(off, n))?;
        // SAFETY: [o, o+n) lies inside the live mapping (checked above),
        // which outlives the borrow of `self`.
        Ok(unsafe { crate::backend::VolatileSlice::new(self.ptr.add(o), n as usize) })
    }
}

fn range_error(off: u64, n: u64) -> crate::backend::BackendError {
    crate::backend::BackendError::new(virtio_gpu_compute::CuResult::CUDA_ERROR_INVALID_VALUE, format!("shared buffer range {off}+{n} out of bounds"))
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
