//! The virtio-gpu compute device, as the device worker serves it to a VM
//! tenant (DESIGN §4). `device` is the command model; the vhost-user
//! transport that feeds it from the VM's virtqueues builds on it.

pub mod device;
pub mod vhost;

pub use device::{GpuConfig, GpuDevice};

#[cfg(test)]
mod tests;
