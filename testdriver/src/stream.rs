//! Streams: work runs in submission order on the stream's own thread,
//! after the call that queued it returned, as on a GPU.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use vgpu_ptx::{ExecError, LaunchConfig};
use virtio_gpu_compute::CuResult;

use crate::cuda::LoadedModule;
use crate::mem::KernelMem;

#[derive(Clone)]
pub enum Op {
    Kernel { module: Arc<LoadedModule>, index: usize, cfg: LaunchConfig, params: Vec<u8> },
    Fill { dst: u64, elem: Vec<u8>, count: u64 },
    Copy { dst: u64, src: u64, len: u64 },
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<(u64, Op)>,
    /// Sequence number of the last op queued and of the last one finished.
    queued: u64,
    done: u64,
    closed: bool,
    /// While the stream captures (`cuStreamBeginCapture`), the work
    /// submitted to it is recorded here instead of run.
    capture: Option<Vec<Op>>,
}

pub struct Stream {
    pub ctx: u64,
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Stream {
    pub fn start(ctx: u64) -> Option<Arc<Stream>> {
        let s = Arc::new(Stream { ctx, q: Mutex::new(Queue::default()), cv: Condvar::new() });
        let w = s.clone();
        std::thread::Builder::new().name("testdriver-stream".into()).spawn(move || w.run()).ok()?;
        Some(s)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `op` (records it, while capturing); returns its sequence
    /// number.
    pub fn submit(&self, op: Op) -> u64 {
        let mut q = self.lock();
        if let Some(c) = q.capture.as_mut() {
            c.push(op);
            return q.queued;
        }
        q.queued += 1;
        let seq = q.queued;
        q.ops.push_back((seq, op));
        self.cv.notify_all();
        seq
    }

    /// Starts recording the work submitted: false if it already captures.
    pub fn begin_capture(&self) -> bool {
        let mut q = self.lock();
        if q.capture.is_some() {
            return false;
        }
        q.capture = Some(Vec::new());
        true
    }

    /// Ends a capture: the work it recorded (None: it was not capturing).
    pub fn end_capture(&self) -> Option<Vec<Op>> {
        self.lock().capture.take()
    }

    /// The sequence number of the last op queued so far.
    pub fn last(&self) -> u64 {
        self.lock().queued
    }

    pub fn finished(&self, seq: u64) -> bool {
        self.lock().done >= seq
    }

    /// Blocks until op `seq` (and everything before it) has finished.
    pub fn wait(&self, seq: u64) {
        let mut q = self.lock();
        while q.done < seq {
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn wait_idle(&self) {
        let last = self.last();
        self.wait(last);
    }

    /// No more work: the thread ends once the queue is empty.
    pub fn close(&self) {
        self.lock().closed = true;
        self.cv.notify_all();
    }

    fn run(&self) {
        loop {
            let (seq, op) = {
                let mut q = self.lock();
                loop {
                    if let Some(x) = q.ops.pop_front() {
                        break x;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let d = crate::driver();
            // After a fault nothing more runs in this process.
            if d.sticky() == 0 {
                if let Err(code) = execute(op) {
                    d.fault(code as u32);
                }
            }
            let mut q = self.lock();
            q.done = seq;
            self.cv.notify_all();
        }
    }
}

fn execute(op: Op) -> Result<(), CuResult> {
    let heap = &crate::driver().heap;
    match op {
        Op::Kernel { module, index, cfg, params } => {
            let k = module.ptx.kernels.get(index).ok_or(CuResult::CUDA_ERROR_LAUNCH_FAILED)?;
            let limits = crate::cuda::limits(module.sms);
            let mut mem = KernelMem { heap };
            vgpu_ptx::launch(k, &cfg, &params, &mut mem, &limits).map(|_| ()).map_err(|e| match e {
                ExecError::IllegalAddress { .. } => CuResult::CUDA_ERROR_ILLEGAL_ADDRESS,
                ExecError::Misaligned { .. } => CuResult::CUDA_ERROR_MISALIGNED_ADDRESS,
                ExecError::Trap(_) => CuResult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
                ExecError::Assert(_) => CuResult::CUDA_ERROR_ASSERT,
                ExecError::Budget(_) | ExecError::Timeout(_) => CuResult::CUDA_ERROR_LAUNCH_TIMEOUT,
                _ => CuResult::CUDA_ERROR_LAUNCH_FAILED,
            })
        }
        // Memsets and copies were checked when queued; their memory can
        // only have been freed since, which a GPU reports as a fault.
        Op::Fill { dst, elem, count } => heap.fill(dst, &elem, count).then_some(()).ok_or(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS),
        Op::Copy { dst, src, len } => heap.copy(dst, src, len).then_some(()).ok_or(CuResult::CUDA_ERROR_ILLEGAL_ADDRESS),
    }
}
