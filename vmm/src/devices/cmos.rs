//! The CMOS real-time clock at ports 0x70/0x71: the host's UTC time in BCD,
//! 24-hour mode, never "update in progress". Without it Linux spins on the
//! update flag (all ones from an empty port) during boot.

use crate::bus::BusDevice;

pub const PORT: u64 = 0x70;

pub struct Cmos {
    index: u8,
    /// Battery-backed bytes the guest may write (0x0e..0x80).
    nvram: [u8; 128],
}

impl Default for Cmos {
    fn default() -> Self {
        Cmos { index: 0, nvram: [0; 128] }
    }
}

fn bcd(v: i32) -> u8 {
    let v = v.rem_euclid(100) as u8;
    ((v / 10) << 4) | (v % 10)
}

impl Cmos {
    fn now() -> libc::tm {
        // SAFETY: time(NULL) has no preconditions; gmtime_r writes only
        // into the tm we pass, which an all-zero value initialises.
        unsafe {
            let t = libc::time(std::ptr::null_mut());
            let mut tm: libc::tm = std::mem::zeroed();
            libc::gmtime_r(&t, &mut tm);
            tm
        }
    }

    fn register(&self, r: u8) -> u8 {
        let tm = Cmos::now();
        match r {
            0x00 => bcd(tm.tm_sec),
            0x02 => bcd(tm.tm_min),
            0x04 => bcd(tm.tm_hour),
            0x06 => bcd(tm.tm_wday + 1),
            0x07 => bcd(tm.tm_mday),
            0x08 => bcd(tm.tm_mon + 1),
            0x09 => bcd(tm.tm_year),
            0x32 => bcd(tm.tm_year / 100 + 19),
            0x0a => 0x26, // divider on, 1024 Hz, no update in progress
            0x0b => 0x02, // 24-hour mode, BCD, no interrupts
            0x0c => 0x00, // no interrupt flags
            0x0d => 0x80, // the clock's battery is good
            r => self.nvram[(r & 0x7f) as usize],
        }
    }
}

impl BusDevice for Cmos {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        if data.len() == 1 && offset == 1 {
            data[0] = self.register(self.index);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() != 1 {
            return;
        }
        match offset {
            // Bit 7 is the NMI mask, not part of the index.
            0 => self.index = data[0] & 0x7f,
            1 if self.index >= 0x0e => self.nvram[self.index as usize] = data[0],
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_reads_bcd_time_and_never_reports_update_in_progress() {
        let mut c = Cmos::default();
        let mut b = [0u8];
        c.write(0, &[0x8a]); // NMI-mask bit set, register A
        c.read(1, &mut b);
        assert_eq!(b[0] & 0x80, 0);
        c.write(0, &[0x00]);
        c.read(1, &mut b);
        assert!(b[0] >> 4 <= 5 && b[0] & 0xf <= 9, "seconds {:#x} are BCD", b[0]);
        c.write(0, &[0x20]);
        c.write(1, &[0x5a]);
        c.read(1, &mut b);
        assert_eq!(b[0], 0x5a, "nvram keeps what the guest wrote");
    }
}
