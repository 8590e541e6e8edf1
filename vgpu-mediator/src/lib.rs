//! vgpu-mediatord: the control plane, device workers, scheduler, scrubber
//! and backends of the vGPU stack (DESIGN §2, §5, §6).

pub mod ptx;
