#![no_std]
#![no_main]

use core::arch::asm;

fn outb(port: u16, v: u8) {
    // SAFETY: port I/O has no memory effects in this guest.
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags)) };
}

fn puts(s: &str) {
    for b in s.bytes() {
        outb(0x3f8, b);
    }
}

#[no_mangle]
#[link_section = ".text._start"]
pub extern "C" fn _start() -> ! {
    puts("hello from the test guest\n");
    outb(0x64, 0xfe);
    loop {
        // SAFETY: halting waits for an interrupt; nothing else happens.
        unsafe { asm!("hlt", options(nomem, nostack)) };
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    puts("PANIC\n");
    outb(0x64, 0xfe);
    loop {}
}
