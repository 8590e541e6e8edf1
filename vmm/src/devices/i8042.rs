//! A minimal i8042 keyboard controller: enough for Linux's probe, the reset
//! line (guest reboot ends the VMM), and Ctrl-Alt-Del injection (the API's
//! shutdown asks the guest to reboot itself).

use std::collections::VecDeque;
use std::sync::mpsc::Sender;

use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::vm::ExitReason;

pub const DATA_PORT: u64 = 0x60;
pub const KBD_IRQ: u32 = 1;

const STATUS_OBF: u8 = 1;
const STATUS_SYS: u8 = 1 << 2;
const STATUS_CMD: u8 = 1 << 3;
const CTR_KBD_INT: u8 = 1;
const CTR_SYS: u8 = 1 << 2;
const CTR_XLATE: u8 = 1 << 6;

pub struct I8042 {
    ctr: u8,
    status: u8,
    out: VecDeque<u8>,
    /// A command (0x60 write CTR, 0xd1 output port, 0xd4 aux) waiting for its data byte.
    pending: Option<u8>,
    irq: EventFd,
    exit: Sender<ExitReason>,
}

impl I8042 {
    pub fn new(irq: EventFd, exit: Sender<ExitReason>) -> I8042 {
        I8042 { ctr: CTR_KBD_INT | CTR_SYS | CTR_XLATE, status: STATUS_SYS, out: VecDeque::new(), pending: None, irq, exit }
    }

    fn push(&mut self, b: u8) {
        if self.out.len() < 64 {
            self.out.push_back(b);
        }
        self.status |= STATUS_OBF;
        if self.ctr & CTR_KBD_INT != 0 {
            let _ = self.irq.write(1);
        }
    }

    /// Queues Ctrl-Alt-Del, pressed and released. The keyboard speaks
    /// scancode set 2; with translation on (CTR bit 6, as Linux leaves it)
    /// the controller hands the guest set 1, as a real i8042 does.
    pub fn ctrl_alt_del(&mut self) {
        const SET2: [u8; 11] = [0x14, 0x11, 0xe0, 0x71, 0xe0, 0xf0, 0x71, 0xf0, 0x11, 0xf0, 0x14];
        const SET1: [u8; 8] = [0x1d, 0x38, 0xe0, 0x53, 0xe0, 0xd3, 0xb8, 0x9d];
        let codes: &[u8] = if self.ctr & CTR_XLATE != 0 { &SET1 } else { &SET2 };
        for &b in codes {
            self.push(b);
        }
    }

    fn command(&mut self, c: u8) {
        match c {
            0x20 => self.push(self.ctr),
            0x60 | 0xd1 | 0xd2 | 0xd4 => self.pending = Some(c),
            0xaa => self.push(0x55),       // controller self-test passed
            0xab => self.push(0x00),       // keyboard interface test passed
            0xa9 => self.push(0xff),       // no aux port
            0xad => self.ctr |= 1 << 4,    // disable keyboard
            0xae => self.ctr &= !(1 << 4), // enable keyboard
            0xfe => self.reset(),          // pulse the reset line
            _ => {}
        }
    }

    fn reset(&mut self) {
        tracing::info!("guest pulsed the i8042 reset line");
        let _ = self.exit.send(ExitReason::Reset);
    }

    fn keyboard(&mut self, b: u8) {
        match b {
            0xff => {
                self.push(0xfa);
                self.push(0xaa);
            }
            0xf2 => {
                self.push(0xfa);
                self.push(0xab);
                self.push(0x83);
            }
            0xee => self.push(0xee),
            _ => self.push(0xfa),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let v = match offset {
            0 => {
                let v = self.out.pop_front().unwrap_or(0);
                if self.out.is_empty() {
                    self.status &= !STATUS_OBF;
                } else if self.ctr & CTR_KBD_INT != 0 {
                    let _ = self.irq.write(1);
                }
                v
            }
            4 => self.status,
            _ => 0xff,
        };
        data.fill(0);
        if let Some(d) = data.first_mut() {
            *d = v;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&b) = data.first() else { return };
        match offset {
            0 => {
                self.status &= !STATUS_CMD;
                match self.pending.take() {
                    Some(0x60) => self.ctr = b,
                    Some(0xd1) if b & 1 == 0 => self.reset(),
                    Some(0xd2) => self.push(b),
                    Some(_) => {}
                    None => self.keyboard(b),
                }
            }
            4 => {
                self.status |= STATUS_CMD;
                self.command(b);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev() -> (I8042, std::sync::mpsc::Receiver<ExitReason>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (I8042::new(EventFd::new(0).unwrap(), tx), rx)
    }

    #[test]
    fn reset_command_requests_vm_exit() {
        let (mut d, rx) = dev();
        d.write(4, &[0xfe]);
        assert_eq!(rx.try_recv().unwrap(), ExitReason::Reset);
    }

    #[test]
    fn self_test_and_ctrl_alt_del_are_readable() {
        let (mut d, _rx) = dev();
        d.write(4, &[0xaa]);
        let mut b = [0u8];
        d.read(4, &mut b);
        assert_eq!(b[0] & STATUS_OBF, STATUS_OBF);
        d.read(0, &mut b);
        assert_eq!(b[0], 0x55);
        d.ctrl_alt_del();
        let mut got = vec![];
        loop {
            d.read(4, &mut b);
            if b[0] & STATUS_OBF == 0 {
                break;
            }
            d.read(0, &mut b);
            got.push(b[0]);
        }
        // Translation is on by default: set 1 (Ctrl, Alt, Del makes).
        assert_eq!(&got[..4], &[0x1d, 0x38, 0xe0, 0x53]);
        // With translation off the keyboard's own set 2 comes through.
        d.write(4, &[0x60]);
        d.write(0, &[CTR_KBD_INT | CTR_SYS]);
        d.ctrl_alt_del();
        d.read(0, &mut b);
        assert_eq!(b[0], 0x14);
    }
}
