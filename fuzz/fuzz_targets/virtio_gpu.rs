//! Feeds arbitrary input to a VM tenant's virtio-gpu device model, as
//! commands (length-prefixed) or as a virtqueue whose descriptor table and
//! rings live in the fuzzed guest memory. Any panic is a bug: these are
//! the bytes a guest controls.
//! Run with `cargo +nightly fuzz run virtio_gpu` from the repo root.
#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use vgpu_mediator::backend::cpu::CpuBackend;
use vgpu_mediator::gpu::vhost::serve_chain;
use vgpu_mediator::gpu::{GpuConfig, GpuDevice};
use vgpu_mediator::sched::{Fifo, Scheduler};
use vgpu_mediator::worker::service::DeviceService;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const RAM: usize = 1 << 20;
const QUEUE_SIZE: u16 = 16;

fn service() -> &'static Arc<DeviceService> {
    static SVC: OnceLock<Arc<DeviceService>> = OnceLock::new();
    SVC.get_or_init(|| {
        let backend = Arc::new(CpuBackend::new(0, 16 << 20, 20_000).expect("cpu backend").with_launch_timeout(std::time::Duration::from_millis(200)));
        Arc::new(DeviceService::new(0, backend, vgpu_mediator::grant::Lanes::Local(Scheduler::new(1, Arc::new(Fifo)))))
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!("fuzz{}", N.fetch_add(1, Ordering::Relaxed));
    let svc = service();
    let tenant = svc.add_tenant(&name, 4 << 20, Default::default(), 16 << 20).expect("tenant");
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM)]).expect("guest memory");
    let mut dev = GpuDevice::new(GpuConfig::default(), mem.clone(), svc.clone(), None, tenant);
    if mode & 1 == 0 {
        // Commands: [u16 length][bytes] ...
        let mut rest = rest;
        while rest.len() >= 2 {
            let n = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
            let _ = dev.process(&rest[2..2 + n]);
            rest = &rest[2 + n..];
        }
    } else {
        // A virtqueue: descriptor table at 0, avail ring at 0x1000, used
        // ring at 0x2000, all from the input, which fills guest RAM from 0.
        let n = rest.len().min(RAM);
        mem.write_slice(&rest[..n], GuestAddress(0)).expect("fill guest memory");
        let mut q = Queue::new(QUEUE_SIZE).expect("queue");
        q.set_desc_table_address(Some(0), Some(0));
        q.set_avail_ring_address(Some(0x1000), Some(0));
        q.set_used_ring_address(Some(0x2000), Some(0));
        q.set_ready(true);
        let chains: Vec<_> = match q.iter(&mem) {
            Ok(it) => it.collect(),
            Err(_) => Vec::new(),
        };
        for chain in chains {
            let head = chain.head_index();
            let len = serve_chain(&mut dev, chain, &mem);
            let _ = q.add_used(&mem, head, len);
        }
    }
    drop(dev);
    svc.remove_tenant(&name);
});
