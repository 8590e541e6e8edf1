//! Device models. Legacy devices live in single files; PCI and virtio
//! devices get their own folders.

pub mod cmos;
pub mod i8042;
pub mod pci;
pub mod serial;
pub mod vfio;
pub mod virtio;
