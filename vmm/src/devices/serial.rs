//! The 16550 console at COM1 (0x3f8, IRQ 4), on vm-superio. The interrupt
//! line is an eventfd registered as a KVM irqfd.

use std::io::Write;

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

pub const COM1_PORT: u64 = 0x3f8;
pub const COM1_IRQ: u32 = 4;

pub struct IrqLine(pub EventFd);

impl Trigger for IrqLine {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

pub struct SerialConsole(Serial<IrqLine, NoEvents, Box<dyn Write + Send>>);

impl SerialConsole {
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> SerialConsole {
        SerialConsole(Serial::new(IrqLine(irq), out))
    }
}

impl BusDevice for SerialConsole {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < 8 {
            data[0] = self.0.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 && offset < 8 {
            if let Err(e) = self.0.write(offset as u8, data[0]) {
                tracing::debug!("serial write: {e:?}");
            }
        }
    }
}
