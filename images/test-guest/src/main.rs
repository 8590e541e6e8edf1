//! The bare-metal test guest for the KVM tier.
//!
//! The VMM enters `_start` in 64-bit mode per the Linux boot protocol, with
//! RSI pointing at the zero page and the first 4 GiB identity-mapped. The
//! kernel command line picks a test:
//! - `test=rng` (default): find virtio-rng on PCI, drive it through the
//!   modern virtio-pci transport, print the bytes it returns;
//! - `test=hostile`: unmapped MMIO and port I/O, bad PCI config accesses,
//!   then the rng test again to show the VMM still serves the guest;
//! - `test=count`: print a rising counter until a key arrives on the
//!   i8042 (the API's Ctrl-Alt-Del), then reset;
//! - `test=triple`: load an empty IDT and fault: a triple fault.
//!
//! Every run ends with a result line and an i8042 reset. There is no SSE
//! anywhere (see .cargo/config.toml); work is kept to thousands of
//! instructions because the CI host's KVM emulates every one.

#![no_std]
#![no_main]

use core::arch::{asm, global_asm};
use core::ptr::{read_volatile, write_volatile};

global_asm!(
    ".section .text._start,\"ax\"",
    ".global _start",
    "_start:",
    "mov rdi, rsi",
    "mov rsp, 0x80000",
    "call guest_main",
    "2: hlt",
    "jmp 2b",
);

fn outb(port: u16, v: u8) {
    // SAFETY: port I/O has no effect on this program's memory.
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags)) };
}
fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: as above.
    unsafe { asm!("in al, dx", out("al") v, in("dx") port, options(nomem, nostack, preserves_flags)) };
    v
}
fn outl(port: u16, v: u32) {
    // SAFETY: as above.
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags)) };
}
fn inl(port: u16) -> u32 {
    let v: u32;
    // SAFETY: as above.
    unsafe { asm!("in eax, dx", out("eax") v, in("dx") port, options(nomem, nostack, preserves_flags)) };
    v
}
fn inw(port: u16) -> u16 {
    let v: u16;
    // SAFETY: as above.
    unsafe { asm!("in ax, dx", out("ax") v, in("dx") port, options(nomem, nostack, preserves_flags)) };
    v
}

fn puts(s: &str) {
    for b in s.bytes() {
        outb(0x3f8, b);
    }
}
fn put_hex(v: u64, digits: u32) {
    for i in (0..digits).rev() {
        let d = ((v >> (i * 4)) & 0xf) as u8;
        outb(0x3f8, if d < 10 { b'0' + d } else { b'a' + d - 10 });
    }
}
fn put_dec(mut v: u64) {
    let mut buf = [0u8; 20];
    let mut n = 0;
    loop {
        buf[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    while n > 0 {
        n -= 1;
        outb(0x3f8, buf[n]);
    }
}

fn reset() -> ! {
    outb(0x64, 0xfe);
    loop {
        // SAFETY: halting waits for the reset to take effect.
        unsafe { asm!("hlt", options(nomem, nostack)) };
    }
}

fn fail(what: &str) -> ! {
    puts("TEST FAILED: ");
    puts(what);
    puts("\n");
    reset()
}

// Guest-physical memory, identity-mapped; all of it lies in guest RAM
// (the VMM gives this guest at least 8 MiB) or in a device BAR.
fn rd8(a: u64) -> u8 {
    // SAFETY: `a` is identity-mapped guest RAM or MMIO the VMM emulates.
    unsafe { read_volatile(a as *const u8) }
}
fn rd16(a: u64) -> u16 {
    // SAFETY: as in rd8.
    unsafe { read_volatile(a as *const u16) }
}
fn rd32(a: u64) -> u32 {
    // SAFETY: as in rd8.
    unsafe { read_volatile(a as *const u32) }
}
fn wr8(a: u64, v: u8) {
    // SAFETY: as in rd8.
    unsafe { write_volatile(a as *mut u8, v) }
}
fn wr16(a: u64, v: u16) {
    // SAFETY: as in rd8.
    unsafe { write_volatile(a as *mut u16, v) }
}
fn wr32(a: u64, v: u32) {
    // SAFETY: as in rd8.
    unsafe { write_volatile(a as *mut u32, v) }
}
fn wr64(a: u64, v: u64) {
    // SAFETY: as in rd8.
    unsafe { write_volatile(a as *mut u64, v) }
}

fn pci_read(slot: u32, reg: u32) -> u32 {
    outl(0xcf8, 0x8000_0000 | (slot << 11) | (reg & 0xfc));
    inl(0xcfc)
}
fn pci_write(slot: u32, reg: u32, v: u32) {
    outl(0xcf8, 0x8000_0000 | (slot << 11) | (reg & 0xfc));
    outl(0xcfc, v);
}

/// The command line from the zero page (hdr.cmd_line_ptr at 0x228).
fn cmdline(zero_page: u64) -> &'static [u8] {
    let p = rd32(zero_page + 0x228) as u64;
    if p == 0 {
        return &[];
    }
    let mut n = 0;
    while n < 256 && rd8(p + n) != 0 {
        n += 1;
    }
    // SAFETY: [p, p+n) is the NUL-terminated command line the VMM wrote
    // into guest RAM, which nothing modifies while this guest runs.
    unsafe { core::slice::from_raw_parts(p as *const u8, n as usize) }
}

fn has(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

struct VirtioPci {
    common: u64,
    notify: u64,
    notify_mult: u32,
}

const VIRTIO_VENDOR: u32 = 0x1af4;

fn find_virtio(device_id: u32) -> Option<(u32, VirtioPci)> {
    for slot in 0..32 {
        let id = pci_read(slot, 0);
        if id == 0xffff_ffff || id & 0xffff != VIRTIO_VENDOR || id >> 16 != 0x1040 + device_id {
            continue;
        }
        // Memory decoding and bus mastering on.
        pci_write(slot, 4, pci_read(slot, 4) | 0x6);
        let mut v = VirtioPci { common: 0, notify: 0, notify_mult: 0 };
        let mut cap = pci_read(slot, 0x34) & 0xff;
        let mut guard = 0;
        while cap != 0 && guard < 48 {
            guard += 1;
            let hdr = pci_read(slot, cap);
            if hdr & 0xff == 0x09 {
                let cfg_type = (hdr >> 24) & 0xff;
                let bar = pci_read(slot, cap + 4) & 0xff;
                let off = pci_read(slot, cap + 8) as u64;
                let base = (pci_read(slot, 0x10 + bar * 4) & !0xf) as u64;
                match cfg_type {
                    1 => v.common = base + off,
                    2 => {
                        v.notify = base + off;
                        v.notify_mult = pci_read(slot, cap + 16);
                    }
                    _ => {}
                }
            }
            cap = (hdr >> 8) & 0xff;
        }
        if v.common == 0 || v.notify == 0 {
            fail("virtio capabilities missing");
        }
        return Some((slot, v));
    }
    None
}

// Ring memory for the one queue this guest uses (guest RAM below 8 MiB).
const DESC: u64 = 0x20_0000;
const AVAIL: u64 = 0x20_1000;
const USED: u64 = 0x20_2000;
const BUF: u64 = 0x20_3000;
const QSIZE: u16 = 8;

/// Brings the device up with one queue; returns its notify address.
fn virtio_init(v: &VirtioPci) -> u64 {
    let c = v.common;
    wr8(c + 0x14, 0); // reset
    if rd8(c + 0x14) != 0 {
        fail("device did not reset");
    }
    wr8(c + 0x14, 1 | 2); // ACKNOWLEDGE | DRIVER
    wr32(c + 0x00, 1);
    if rd32(c + 0x04) & 1 == 0 {
        fail("device lacks VIRTIO_F_VERSION_1");
    }
    wr32(c + 0x08, 0);
    wr32(c + 0x0c, 0);
    wr32(c + 0x08, 1);
    wr32(c + 0x0c, 1); // VERSION_1
    wr8(c + 0x14, 1 | 2 | 8);
    if rd8(c + 0x14) & 8 == 0 {
        fail("FEATURES_OK not accepted");
    }
    wr16(c + 0x16, 0); // queue 0
    if rd16(c + 0x18) < QSIZE {
        fail("queue too small");
    }
    wr16(c + 0x18, QSIZE);
    for a in (DESC..BUF + 0x1000).step_by(8) {
        wr64(a, 0);
    }
    wr64(c + 0x20, DESC);
    wr64(c + 0x28, AVAIL);
    wr64(c + 0x30, USED);
    wr16(c + 0x1c, 1);
    let notify_off = rd16(c + 0x1e) as u64;
    wr8(c + 0x14, 1 | 2 | 8 | 4); // DRIVER_OK
    if rd8(c + 0x14) & 0x40 != 0 {
        fail("device needs reset after DRIVER_OK");
    }
    v.notify + notify_off * v.notify_mult as u64
}

/// Offers one device-writable buffer of `len` bytes and waits for it.
fn virtio_request(notify: u64, n: u16, len: u32) -> u32 {
    let d = DESC + (n % QSIZE) as u64 * 16;
    wr64(d, BUF + n as u64 * 64);
    wr32(d + 8, len);
    wr16(d + 12, 2); // VIRTQ_DESC_F_WRITE
    wr16(d + 14, 0);
    wr16(AVAIL + 4 + (n % QSIZE) as u64 * 2, n % QSIZE);
    // SAFETY: a compiler fence orders the ring entry before the index.
    unsafe { asm!("mfence", options(nostack)) };
    wr16(AVAIL + 2, n + 1);
    wr16(notify, 0);
    let mut spins = 0u32;
    while rd16(USED + 2) != n + 1 {
        spins += 1;
        if spins > 2_000_000 {
            fail("virtio request timed out");
        }
        core::hint::spin_loop();
    }
    rd32(USED + 4 + (n % QSIZE) as u64 * 8 + 4)
}

fn rng_test() {
    let Some((slot, v)) = find_virtio(4) else { fail("no virtio-rng on PCI") };
    puts("virtio-rng at slot ");
    put_dec(slot as u64);
    puts("\n");
    let notify = virtio_init(&v);
    let a = virtio_request(notify, 0, 16);
    let b = virtio_request(notify, 1, 16);
    if a != 16 || b != 16 {
        fail("short rng read");
    }
    puts("RNG ");
    let mut same = true;
    let mut zero = true;
    for i in 0..16 {
        let x = rd8(BUF + i);
        let y = rd8(BUF + 64 + i);
        same &= x == y;
        zero &= x == 0;
        put_hex(x as u64, 2);
    }
    puts("\n");
    if same || zero {
        fail("rng bytes are not random");
    }
}

fn hostile_test() {
    // Unmapped MMIO inside the PCI hole and above it: reads float high.
    wr32(0xe000_0000, 0xdead_beef);
    if rd32(0xe000_0000) != 0xffff_ffff {
        fail("unmapped MMIO read was not all ones");
    }
    wr8(0xfed0_0000, 1);
    // Unmapped ports.
    outb(0x2000, 0x55);
    outl(0x4000, 1);
    if inb(0x2000) != 0xff {
        fail("unmapped port read was not all ones");
    }
    // Bad PCI config accesses: another bus, an empty slot, a disabled
    // address, odd widths, and a write to read-only identity registers.
    outl(0xcf8, 0x8005_0000);
    if inl(0xcfc) != 0xffff_ffff {
        fail("config read on bus 5 was not all ones");
    }
    if pci_read(31, 0) != 0xffff_ffff {
        fail("empty slot answered");
    }
    outl(0xcf8, 0x0000_0800);
    let _ = inl(0xcfc);
    outl(0xcf8, 0x8000_0800);
    let _ = inw(0xcfd);
    let _ = inw(0xcff);
    outb(0xcf9, 0x12);
    pci_write(0, 0, 0);
    if pci_read(0, 0) & 0xffff != 0x8086 {
        fail("host bridge identity changed");
    }
    puts("hostile accesses done\n");
    rng_test();
}

fn count_test() {
    let mut n = 0u64;
    loop {
        n += 1;
        if n % 2000 == 0 {
            puts("tick ");
            put_dec(n / 2000);
            puts("\n");
        }
        if inb(0x64) & 1 != 0 {
            let code = inb(0x60);
            puts("key ");
            put_hex(code as u64, 2);
            puts(": shutdown requested\n");
            puts("TEST PASSED count\n");
            reset();
        }
    }
}

fn triple_fault() -> ! {
    puts("triple fault next\n");
    let idt = [0u16; 5];
    // SAFETY: deliberately loads an empty IDT and raises an exception: the
    // CPU cannot deliver it, nor the double fault, and shuts down.
    unsafe {
        asm!("lidt [{}]", "ud2", in(reg) idt.as_ptr(), options(nostack));
    }
    fail("still running after the triple fault")
}

#[no_mangle]
extern "C" fn guest_main(zero_page: u64) -> ! {
    let cmd = cmdline(zero_page);
    puts("test guest up\n");
    if has(cmd, b"test=triple") {
        triple_fault();
    } else if has(cmd, b"test=count") {
        count_test();
    } else if has(cmd, b"test=hostile") {
        hostile_test();
        puts("TEST PASSED hostile\n");
    } else {
        rng_test();
        puts("TEST PASSED rng\n");
    }
    reset()
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    fail("panic")
}
