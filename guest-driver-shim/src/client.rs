//! Typed calls over a [`Transport`], with bulk copies routed through the
//! shared buffer when there is one.

use virtio_gpu_compute::*;

use crate::transport::{Transport, TransportError, UnixTransport};

/// Default size of the shared bulk buffer (override with `VGPU_SHM_SIZE`).
pub const DEFAULT_SHM: usize = 8 << 20;

/// A failed call: the CUDA code and the device's explanation.
#[derive(Debug, Clone, PartialEq)]
pub struct CallError {
    pub code: CuResult,
    pub msg: String,
}

impl CallError {
    pub fn new(code: CuResult, msg: impl Into<String>) -> Self {
        CallError { code, msg: msg.into() }
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.msg)
    }
}

pub type CallResult<T> = Result<T, CallError>;

pub struct Client {
    t: Box<dyn Transport>,
    seq: u32,
    broken: bool,
}

impl Client {
    /// The tenant socket named by `VGPU_SOCKET`; without it, a virtio-gpu
    /// render node that offers the compute capset.
    pub fn from_env() -> CallResult<Client> {
        match std::env::var("VGPU_SOCKET") {
            Ok(path) => Client::connect_unix(&path),
            Err(_) => {
                let size = std::env::var("VGPU_SHM_SIZE").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SHM);
                let t = crate::drm::DrmTransport::open(size).map_err(|e| CallError::new(CuResult::CUDA_ERROR_NO_DEVICE, format!("VGPU_SOCKET is not set and no virtio-gpu compute device was usable: {e}")))?;
                Ok(Client::with_transport(Box::new(t)))
            }
        }
    }

    pub fn connect_unix(path: &str) -> CallResult<Client> {
        let mut t = UnixTransport::connect(path).map_err(|e| CallError::new(CuResult::CUDA_ERROR_NO_DEVICE, format!("{path}: {e}")))?;
        let size = std::env::var("VGPU_SHM_SIZE").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SHM);
        if size > 0 {
            match t.register_shared(size, 0) {
                Ok(Reply::Empty) => {}
                Ok(Reply::Error(code, msg)) => return Err(CallError::new(code, msg)),
                Ok(_) => return Err(CallError::new(CuResult::CUDA_ERROR_UNKNOWN, "unexpected reply to RegisterShm")),
                Err(e) => return Err(CallError::new(CuResult::CUDA_ERROR_NO_DEVICE, e.to_string())),
            }
        }
        Ok(Client { t: Box::new(t), seq: 1, broken: false })
    }

    pub fn with_transport(t: Box<dyn Transport>) -> Client {
        Client { t, seq: 1, broken: false }
    }

    /// One round trip. A broken connection makes this and every later call
    /// fail with CUDA_ERROR_DEVICE_UNAVAILABLE.
    pub fn call(&mut self, req: Request) -> CallResult<Reply> {
        if self.broken {
            return Err(CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, "connection to the vGPU was lost"));
        }
        self.seq = self.seq.wrapping_add(1);
        match self.t.call(&req, self.seq) {
            Ok(Reply::Error(code, msg)) => Err(CallError::new(code, msg)),
            Ok(r) => Ok(r),
            Err(e) => {
                self.broken = true;
                let lost = matches!(e, TransportError::Io(_));
                let msg = if lost { format!("connection to the vGPU was lost: {e}") } else { e.to_string() };
                Err(CallError::new(CuResult::CUDA_ERROR_DEVICE_UNAVAILABLE, msg))
            }
        }
    }

    pub fn handle(&mut self, req: Request) -> CallResult<u32> {
        match self.call(req)? {
            Reply::Handle(h) => Ok(h),
            r => Err(unexpected(r)),
        }
    }

    pub fn empty(&mut self, req: Request) -> CallResult<()> {
        match self.call(req)? {
            Reply::Empty => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    pub fn htod(&mut self, ctx: u32, stream: u32, dst: u64, src: &[u8]) -> CallResult<()> {
        let chunk = self.t.shared().map(|s| s.len()).unwrap_or(MAX_INLINE_DATA as usize);
        for (i, part) in src.chunks(chunk.max(1)).enumerate() {
            let at = dst + (i * chunk) as u64;
            let req = match self.t.shared() {
                Some(shm) => {
                    shm[..part.len()].copy_from_slice(part);
                    let (loc, blob) = self.t.shared_loc();
                    Request::MemcpyHtoD(MemcpyHtoDReq { ctx, stream, dst: at, size: part.len() as u64, loc: loc as u32, blob, shm_offset: 0 }, Vec::new())
                }
                None => Request::MemcpyHtoD(MemcpyHtoDReq { ctx, stream, dst: at, size: part.len() as u64, loc: DataLoc::Inline as u32, blob: 0, shm_offset: 0 }, part.to_vec()),
            };
            self.empty(req)?;
        }
        Ok(())
    }

    pub fn dtoh(&mut self, ctx: u32, stream: u32, dst: &mut [u8], src: u64) -> CallResult<()> {
        let chunk = self.t.shared().map(|s| s.len()).unwrap_or(MAX_INLINE_DATA as usize);
        for (i, part) in dst.chunks_mut(chunk.max(1)).enumerate() {
            let at = src + (i * chunk) as u64;
            let shared = self.t.shared().is_some();
            let (loc, blob) = if shared { self.t.shared_loc() } else { (DataLoc::Inline, 0) };
            match self.call(Request::MemcpyDtoH(MemcpyDtoHReq { ctx, stream, src: at, size: part.len() as u64, loc: loc as u32, blob, shm_offset: 0 }))? {
                // A copy through the shared buffer carries no reply data.
                Reply::Data(d) if shared && d.is_empty() => {
                    let shm = self.t.shared().ok_or_else(|| CallError::new(CuResult::CUDA_ERROR_UNKNOWN, "shared buffer vanished"))?;
                    part.copy_from_slice(&shm[..part.len()]);
                }
                Reply::Data(d) if d.len() == part.len() => part.copy_from_slice(&d),
                r => return Err(unexpected(r)),
            }
        }
        Ok(())
    }

    pub fn device_info(&mut self) -> CallResult<DeviceInfo> {
        match self.call(Request::GetDeviceInfo)? {
            Reply::DeviceInfo(d) => Ok(d),
            r => Err(unexpected(r)),
        }
    }

    pub fn tenant_info(&mut self) -> CallResult<TenantInfo> {
        match self.call(Request::GetTenantInfo)? {
            Reply::TenantInfo(t) => Ok(t),
            r => Err(unexpected(r)),
        }
    }
}

fn unexpected(r: Reply) -> CallError {
    CallError::new(CuResult::CUDA_ERROR_UNKNOWN, format!("unexpected reply {r:?}"))
}
