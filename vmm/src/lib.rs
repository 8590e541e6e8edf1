//! The vgpu VMM: one process per VM on rust-vmm crates (KVM, guest memory,
//! loader, serial), with a PCI bus, the virtio-pci transport and a per-VM
//! REST API; plus the HTTP client `vgpuctl` uses for the daemons' APIs.

pub mod api;
pub mod boot;
pub mod bus;
pub mod config;
pub mod devices;
pub mod jail;
pub mod memory;
pub mod numa;
pub mod seccomp;
pub mod trace;
pub mod vm;

/// Opening the VM's files without following symbolic links (shared with
/// the mediator, which checks managed VMs' descriptions with it).
pub use vgpu_topology::safe_open;
