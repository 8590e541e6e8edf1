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
//! - `test=triple`: load an empty IDT and fault: a triple fault;
//! - `test=vgpu`: find the virtio-gpu device, probe the capset, create a
//!   compute context and GUEST blobs, and run vectorAdd through SUBMIT_3D;
//! - `test=vgpu-hostile`: malformed virtio-gpu commands first, each of
//!   which must get its error response, then the vectorAdd;
//! - `test=blk`: find virtio-blk, read the host's marker at sector 0, write
//!   one at sector 1, flush, read it back, and try past the end, half a
//!   sector and the device id;
//! - `test=net`: find virtio-net, print the MAC from its config space, post
//!   RX buffers, send one broadcast frame (ethertype 0x88B5), and wait for
//!   the host's frame of that ethertype to its MAC.
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

fn rdtsc() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: reads the time-stamp counter; no memory is touched.
    unsafe { asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags)) };
    (hi as u64) << 32 | lo as u64
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
fn rd64(a: u64) -> u64 {
    // SAFETY: as in rd8.
    unsafe { read_volatile(a as *const u64) }
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
    /// The device-specific configuration (0: none).
    device: u64,
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
        let mut v = VirtioPci { common: 0, notify: 0, notify_mult: 0, device: 0 };
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
                    4 => v.device = base + off,
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

/// Brings the device up with the given low feature bits (plus VERSION_1)
/// and one ring set per queue; returns each queue's notify address.
fn virtio_init(v: &VirtioPci, features_lo: u32, rings: &[(u64, u64, u64)], notify: &mut [u64]) {
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
    wr32(c + 0x00, 0);
    if rd32(c + 0x04) & features_lo != features_lo {
        fail("device lacks a needed feature");
    }
    wr32(c + 0x08, 0);
    wr32(c + 0x0c, features_lo);
    wr32(c + 0x08, 1);
    wr32(c + 0x0c, 1); // VERSION_1
    wr8(c + 0x14, 1 | 2 | 8);
    if rd8(c + 0x14) & 8 == 0 {
        fail("FEATURES_OK not accepted");
    }
    for (q, &(desc, avail, used)) in rings.iter().enumerate() {
        wr16(c + 0x16, q as u16);
        if rd16(c + 0x18) < QSIZE {
            fail("queue too small");
        }
        wr16(c + 0x18, QSIZE);
        for a in (desc..desc + 0x3000).step_by(8) {
            wr64(a, 0);
        }
        wr64(c + 0x20, desc);
        wr64(c + 0x28, avail);
        wr64(c + 0x30, used);
        wr16(c + 0x1c, 1);
        notify[q] = v.notify + rd16(c + 0x1e) as u64 * v.notify_mult as u64;
    }
    wr8(c + 0x14, 1 | 2 | 8 | 4); // DRIVER_OK
    if rd8(c + 0x14) & 0x40 != 0 {
        fail("device needs reset after DRIVER_OK");
    }
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
    let mut notify = [0u64; 1];
    virtio_init(&v, 0, &[(DESC, AVAIL, USED)], &mut notify);
    let notify = notify[0];
    for a in (BUF..BUF + 0x1000).step_by(8) {
        wr64(a, 0);
    }
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

// virtio-blk request parts: header and status in BUF, data pages above.
const BLK_STATUS: u64 = BUF + 0x100;
const BLK_DATA: u64 = 0x21_0000;
const BLK_DATA2: u64 = 0x21_1000;

/// One request through descriptors 0 (header), 1 (data, unless `len` is
/// 0) and 2 (status); returns the status byte.
fn blk_request(notify: u64, n: u16, ty: u32, sector: u64, data: u64, len: u32, device_writes: bool) -> u8 {
    wr32(BUF, ty);
    wr32(BUF + 4, 0);
    wr64(BUF + 8, sector);
    wr8(BLK_STATUS, 0xff);
    let d0 = DESC;
    let (d1, d2) = (DESC + 16, DESC + 32);
    wr64(d0, BUF);
    wr32(d0 + 8, 16);
    wr16(d0 + 12, 1); // NEXT
    wr16(d0 + 14, if len > 0 { 1 } else { 2 });
    wr64(d1, data);
    wr32(d1 + 8, len);
    wr16(d1 + 12, if device_writes { 1 | 2 } else { 1 });
    wr16(d1 + 14, 2);
    wr64(d2, BLK_STATUS);
    wr32(d2 + 8, 1);
    wr16(d2 + 12, 2); // WRITE
    wr16(d2 + 14, 0);
    wr16(AVAIL + 4 + (n % QSIZE) as u64 * 2, 0);
    // SAFETY: a fence orders the descriptors before the index.
    unsafe { asm!("mfence", options(nostack)) };
    wr16(AVAIL + 2, n + 1);
    wr16(notify, 0);
    let mut spins = 0u32;
    while rd16(USED + 2) != n + 1 {
        spins += 1;
        if spins > 20_000_000 {
            fail("virtio-blk request timed out");
        }
        core::hint::spin_loop();
    }
    rd8(BLK_STATUS)
}

fn put_text(a: u64, n: u64) {
    for i in 0..n {
        let c = rd8(a + i);
        outb(0x3f8, if (0x20..0x7f).contains(&c) { c } else { b'.' });
    }
}

fn blk_status(what: &str, st: u8) {
    puts(what);
    puts(" status ");
    put_dec(st as u64);
    puts("\n");
}

/// Reads the marker the host wrote at sector 0, writes one at sector 1,
/// flushes, reads it back, and tries past the end and the device id.
fn blk_test() {
    let Some((slot, v)) = find_virtio(2) else { fail("no virtio-blk on PCI") };
    if v.device == 0 {
        fail("virtio-blk has no device configuration");
    }
    puts("virtio-blk at slot ");
    put_dec(slot as u64);
    wr32(v.common, 0);
    let ro = rd32(v.common + 4) & (1 << 5) != 0;
    puts(if ro { " read-only\n" } else { " read-write\n" });
    let mut notify = [0u64; 1];
    virtio_init(&v, 1 << 9, &[(DESC, AVAIL, USED)], &mut notify);
    let notify = notify[0];
    let cap = rd64(v.device);
    puts("BLK capacity ");
    put_dec(cap);
    puts("\n");
    let mut n = 0u16;
    let mut req = |ty: u32, sector: u64, data: u64, len: u32, w: bool| {
        let st = blk_request(notify, n, ty, sector, data, len, w);
        n += 1;
        st
    };
    let st = req(0, 0, BLK_DATA, 512, true);
    puts("BLK-READ ");
    put_text(BLK_DATA, 16);
    puts("\n");
    blk_status("BLK-READ", st);
    let marker = b"MARKER-FROM-GUEST";
    for a in (BLK_DATA2..BLK_DATA2 + 512).step_by(8) {
        wr64(a, 0);
    }
    for (i, b) in marker.iter().enumerate() {
        wr8(BLK_DATA2 + i as u64, *b);
    }
    blk_status("BLK-WRITE", req(1, 1, BLK_DATA2, 512, false));
    blk_status("BLK-FLUSH", req(4, 0, 0, 0, false));
    for a in (BLK_DATA..BLK_DATA + 512).step_by(8) {
        wr64(a, 0);
    }
    let st = req(0, 1, BLK_DATA, 512, true);
    puts("BLK-READBACK ");
    put_text(BLK_DATA, marker.len() as u64);
    puts("\n");
    blk_status("BLK-READBACK", st);
    blk_status("BLK-BEYOND-END", req(0, cap, BLK_DATA, 512, true));
    blk_status("BLK-HALF-SECTOR", req(0, 0, BLK_DATA, 100, true));
    for a in (BLK_DATA..BLK_DATA + 32).step_by(8) {
        wr64(a, 0);
    }
    let st = req(8, 0, BLK_DATA, 20, true);
    puts("BLK-ID ");
    put_text(BLK_DATA, 20);
    puts("\n");
    blk_status("BLK-ID", st);
    puts("BLK-DONE\n");
}

// virtio-net: the RX and TX rings, four RX buffers of a header and a
// 1518-byte frame each (as Linux's small buffers), one TX frame.
const NQ_RX: (u64, u64, u64) = (0x21_0000, 0x21_1000, 0x21_2000);
const NQ_TX: (u64, u64, u64) = (0x22_0000, 0x22_1000, 0x22_2000);
const NET_RXBUF: u64 = 0x23_0000;
const NET_RXLEN: u32 = 12 + 1518;
const NET_NBUF: u16 = 4;
const NET_TXBUF: u64 = 0x24_0000;
const NET_ETHERTYPE: u16 = 0x88b5;

/// Puts RX buffer `id` at position `idx` of the available ring.
fn net_post_rx(avail: u64, idx: u16, id: u16) {
    wr16(avail + 4 + (idx % QSIZE) as u64 * 2, id);
    // SAFETY: a fence orders the ring entry before the index.
    unsafe { asm!("mfence", options(nostack)) };
    wr16(avail + 2, idx.wrapping_add(1));
}

/// Reads the MAC from the config space, posts RX buffers, sends one
/// broadcast frame of ethertype 0x88B5, then waits for the host's frame of
/// that ethertype sent to its MAC (skipping others the host may send).
fn net_test() {
    let Some((slot, v)) = find_virtio(1) else { fail("no virtio-net on PCI") };
    if v.device == 0 {
        fail("virtio-net has no device configuration");
    }
    puts("virtio-net at slot ");
    put_dec(slot as u64);
    puts("\n");
    let mut notify = [0u64; 2];
    // MTU | MAC | STATUS
    virtio_init(&v, (1 << 3) | (1 << 5) | (1 << 16), &[NQ_RX, NQ_TX], &mut notify);
    let mut mac = [0u8; 6];
    for (i, m) in mac.iter_mut().enumerate() {
        *m = rd8(v.device + i as u64);
    }
    puts("NET mac ");
    for (i, m) in mac.iter().enumerate() {
        if i > 0 {
            puts(":");
        }
        put_hex(*m as u64, 2);
    }
    puts(" status ");
    put_dec(rd16(v.device + 6) as u64);
    puts(" mtu ");
    put_dec(rd16(v.device + 10) as u64);
    puts("\n");
    let (rxd, rxa, rxu) = NQ_RX;
    let mut rx_avail = 0u16;
    for id in 0..NET_NBUF {
        let d = rxd + id as u64 * 16;
        wr64(d, NET_RXBUF + id as u64 * 0x800);
        wr32(d + 8, NET_RXLEN);
        wr16(d + 12, 2); // WRITE
        wr16(d + 14, 0);
        net_post_rx(rxa, rx_avail, id);
        rx_avail += 1;
    }
    wr16(notify[0], 0);
    // One frame: a zero virtio header, then broadcast, our MAC, 0x88B5.
    let (txd, txa, txu) = NQ_TX;
    for a in (NET_TXBUF..NET_TXBUF + 128).step_by(8) {
        wr64(a, 0);
    }
    let eth = NET_TXBUF + 12;
    for (i, m) in mac.iter().enumerate() {
        wr8(eth + i as u64, 0xff);
        wr8(eth + 6 + i as u64, *m);
    }
    wr8(eth + 12, (NET_ETHERTYPE >> 8) as u8);
    wr8(eth + 13, NET_ETHERTYPE as u8);
    for (i, b) in b"FRAME-FROM-GUEST".iter().enumerate() {
        wr8(eth + 14 + i as u64, *b);
    }
    wr64(txd, NET_TXBUF);
    wr32(txd + 8, 12 + 60);
    wr16(txd + 12, 0);
    wr16(txd + 14, 0);
    wr16(txa + 4, 0);
    // SAFETY: a fence orders the descriptor before the index.
    unsafe { asm!("mfence", options(nostack)) };
    wr16(txa + 2, 1);
    wr16(notify[1], 0);
    let mut spins = 0u32;
    while rd16(txu + 2) != 1 {
        spins += 1;
        if spins > 20_000_000 {
            fail("virtio-net TX timed out");
        }
        core::hint::spin_loop();
    }
    puts("NET-TX sent\n");
    // The host answers in its own time (and a rate limit may hold frames
    // back): wait by the time-stamp counter, about half a minute.
    let t0 = rdtsc();
    let mut seen = 0u16;
    loop {
        if rd16(rxu + 2) == seen {
            if rdtsc().wrapping_sub(t0) > 60_000_000_000 {
                fail("no frame from the host");
            }
            core::hint::spin_loop();
            continue;
        }
        let e = rxu + 4 + (seen % QSIZE) as u64 * 8;
        let (id, len) = (rd32(e), rd32(e + 4));
        seen = seen.wrapping_add(1);
        if id >= NET_NBUF as u32 || len < 12 + 14 || len > NET_RXLEN {
            puts("NET-RX bad used entry: id ");
            put_dec(id as u64);
            puts(" len ");
            put_dec(len as u64);
            puts("\n");
            fail("virtio-net returned a bad RX buffer");
        }
        let b = NET_RXBUF + id as u64 * 0x800;
        let f = b + 12;
        let ethertype = (rd8(f + 12) as u16) << 8 | rd8(f + 13) as u16;
        let to_us = (0..6).all(|i| rd8(f + i) == mac[i as usize]);
        if ethertype == NET_ETHERTYPE && to_us {
            puts("NET-RX len ");
            put_dec(len as u64);
            puts(" num_buffers ");
            put_dec(rd16(b + 10) as u64);
            puts(" payload ");
            put_text(f + 14, 15);
            puts("\n");
            return;
        }
        puts("NET-RX skipped a frame of ethertype ");
        put_hex(ethertype as u64, 4);
        puts("\n");
        if seen > 64 {
            fail("only unrelated frames from the host");
        }
        net_post_rx(rxa, rx_avail, id as u16);
        rx_avail = rx_avail.wrapping_add(1);
        wr16(notify[0], 0);
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


// ---- virtio-gpu compute ------------------------------------------------
// Guest memory for the GPU test (all inside a 16 MiB guest).
const GQ0: (u64, u64, u64) = (0x21_0000, 0x21_1000, 0x21_2000);
const GQ1: (u64, u64, u64) = (0x22_0000, 0x22_1000, 0x22_2000);
const GREQ: u64 = 0x23_0000; // command being sent
const GRESP: u64 = 0x24_0000; // virtio-gpu response
const DATA_BLOB: u64 = 0x40_0000; // 64 KiB: vectors a, b, c
const REPLY_BLOB: u64 = 0x50_0000; // 4 KiB: compute replies
const MSG: u64 = 0x60_0000; // compute message under construction
const RES_DATA: u32 = 1;
const RES_REPLY: u32 = 2;
const GPU_CTX: u32 = 1;
const CAPSET: u32 = 24;
const N: u32 = 1024;
static VECTOR_ADD_PTX: &[u8] = include_bytes!("../../../samples/kernels/vectorAdd.ptx");

struct Gpu {
    notify: u64,
    sent: u16,
    /// The virtio-gpu context and the two blobs the calls use.
    ctx: u32,
    res_data: u32,
    res_reply: u32,
    /// Polls of the used ring before a command counts as lost.
    patience: u32,
}

/// A little-endian writer over guest memory.
struct W(u64);

macro_rules! writers {
    ($($name:ident: $t:ty => $store:ident),*) => {$(
        fn $name(&mut self, v: $t) -> &mut Self {
            $store(self.0, v);
            self.0 += core::mem::size_of::<$t>() as u64;
            self
        }
    )*};
}

impl W {
    writers!(u8: u8 => wr8, u16: u16 => wr16, u32: u32 => wr32, u64: u64 => wr64);
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        for &x in b {
            self.u8(x);
        }
        self
    }
}

/// ctrl_hdr: type, flags, fence_id, ctx_id, ring_idx, padding.
fn ctrl_hdr(w: &mut W, ty: u32, flags: u32, ctx: u32, ring: u8) {
    w.u32(ty).u32(flags).u64(1).u32(ctx).u8(ring).u8(0).u16(0);
}

impl Gpu {
    /// Sends the command at GREQ (len bytes) with a response buffer at
    /// GRESP on the control queue; waits; returns the response type.
    fn cmd(&mut self, len: u32) -> u32 {
        match self.try_cmd(len) {
            Ok(t) => t,
            Err(e) => fail(e),
        }
    }

    fn try_cmd(&mut self, len: u32) -> Result<u32, &'static str> {
        let (desc, avail, used) = GQ0;
        let slot = self.sent % QSIZE;
        let d0 = desc + (slot as u64 * 2 % QSIZE as u64) * 16;
        let i0 = (slot * 2) % QSIZE;
        let i1 = (i0 + 1) % QSIZE;
        let d1 = desc + i1 as u64 * 16;
        wr32(GRESP, 0);
        wr64(d0, GREQ);
        wr32(d0 + 8, len);
        wr16(d0 + 12, 1); // NEXT
        wr16(d0 + 14, i1);
        wr64(d1, GRESP);
        wr32(d1 + 8, 4096);
        wr16(d1 + 12, 2); // WRITE
        wr16(d1 + 14, 0);
        wr16(avail + 4 + slot as u64 * 2, i0);
        // SAFETY: orders the ring entry before the index the device reads.
        unsafe { asm!("mfence", options(nostack)) };
        self.sent = self.sent.wrapping_add(1);
        wr16(avail + 2, self.sent);
        wr16(self.notify, 0);
        let mut spins = 0u32;
        while rd16(used + 2) != self.sent {
            spins += 1;
            if spins > self.patience {
                return Err("virtio-gpu command timed out");
            }
            core::hint::spin_loop();
        }
        Ok(rd32(GRESP))
    }

    fn try_cmd_simple(&mut self, ty: u32, ctx: u32, a: u32, b: u32) -> Result<u32, &'static str> {
        let mut w = W(GREQ);
        ctrl_hdr(&mut w, ty, 0, ctx, 0);
        w.u32(a).u32(b);
        self.try_cmd(32)
    }

    fn ctx_create(&mut self, ctx: u32, capset: u32) -> u32 {
        let mut w = W(GREQ);
        ctrl_hdr(&mut w, 0x0200, 0, ctx, 0);
        w.u32(4).u32(capset).bytes(b"test");
        for _ in 0..60 {
            w.u8(0);
        }
        self.cmd(24 + 72)
    }

    fn create_blob(&mut self, res: u32, addr: u64, len: u32, nr_entries: u32) -> u32 {
        let mut w = W(GREQ);
        ctrl_hdr(&mut w, 0x010c, 0, self.ctx, 0);
        w.u32(res).u32(1).u32(1).u32(nr_entries).u64(0).u64(len as u64);
        w.u64(addr).u32(len).u32(0);
        self.cmd(24 + 32 + 16)
    }

    /// SUBMIT_3D of the compute message at MSG (len bytes): reply in the
    /// reply blob. Returns (virtio response type, CUresult of the reply).
    fn submit(&mut self, len: u32, flags: u32, ring: u8) -> (u32, u32) {
        let mut w = W(GREQ);
        ctrl_hdr(&mut w, 0x0207, flags, self.ctx, ring);
        w.u32(24 + len).u32(0);
        w.bytes(b"VGPS").u32(self.res_reply).u64(0).u32(4096).u32(0);
        for i in 0..len as u64 {
            w.u8(rd8(MSG + i));
        }
        wr32(REPLY_BLOB + 12, 0xffff_ffff);
        let t = self.cmd(24 + 8 + 24 + len);
        (t, rd32(REPLY_BLOB + 12))
    }

    /// Runs one compute call whose body the caller wrote after the header
    /// at MSG + 24; returns the reply status (0 = CUDA_SUCCESS).
    fn call(&mut self, opcode: u16, body_len: u32) -> Result<u32, &'static str> {
        let mut w = W(MSG);
        w.bytes(b"VGPC").u16(2).u16(opcode).u32(7).u32(0).u32(body_len).u32(0);
        let (t, status) = self.submit(24 + body_len, 3, 0); // FENCE | INFO_RING_IDX, ring 0
        if t != 0x1100 {
            return Err("SUBMIT_3D was refused");
        }
        Ok(status)
    }

    /// A compute call that must succeed.
    fn ok(&mut self, opcode: u16, body_len: u32, what: &'static str) -> Result<(), &'static str> {
        match self.call(opcode, body_len)? {
            0 => Ok(()),
            _ => Err(what),
        }
    }
}

/// The bits of the f32 nearest `v` (exact below 2^24), with integers only.
fn f32_bits(v: u32) -> u32 {
    if v == 0 {
        return 0;
    }
    let e = 31 - v.leading_zeros();
    let mant = if e <= 23 { (v << (23 - e)) & 0x7f_ffff } else { (v >> (e - 23)) & 0x7f_ffff };
    ((127 + e) << 23) | mant
}

fn gpu_init() -> Gpu {
    let Some((slot, v)) = find_virtio(16) else { fail("no virtio-gpu on PCI") };
    puts("virtio-gpu at slot ");
    put_dec(slot as u64);
    puts("\n");
    let mut notify = [0u64; 2];
    // VIRGL | RESOURCE_BLOB | CONTEXT_INIT
    virtio_init(&v, 1 | 8 | 16, &[GQ0, GQ1], &mut notify);
    Gpu { notify: notify[0], sent: 0, ctx: GPU_CTX, res_data: RES_DATA, res_reply: RES_REPLY, patience: 20_000_000 }
}

fn vgpu_setup(g: &mut Gpu) -> Result<(), &'static str> {
    // Capset probe: GET_CAPSET_INFO takes an index.
    if g.try_cmd_simple(0x0108, 0, 0, 0)? != 0x1102 || rd32(GRESP + 24) != CAPSET {
        return Err("capset info");
    }
    puts("capset id ");
    put_dec(rd32(GRESP + 24) as u64);
    puts("\n");
    if g.try_cmd_simple(0x0109, 0, CAPSET, 1)? != 0x1103 || rd32(GRESP + 24) != u32::from_le_bytes(*b"VGPC") {
        return Err("capset payload");
    }
    if g.ctx_create(g.ctx, CAPSET) != 0x1100 {
        return Err("CTX_CREATE");
    }
    let (ctx, data, reply) = (g.ctx, g.res_data, g.res_reply);
    if g.create_blob(data, DATA_BLOB, 0x1_0000, 1) != 0x1100 || g.create_blob(reply, REPLY_BLOB, 0x1000, 1) != 0x1100 {
        return Err("RESOURCE_CREATE_BLOB");
    }
    if g.try_cmd_simple(0x0202, ctx, data, 0)? != 0x1100 || g.try_cmd_simple(0x0202, ctx, reply, 0)? != 0x1100 {
        return Err("CTX_ATTACH_RESOURCE");
    }
    Ok(())
}

fn vector_add(g: &mut Gpu) -> Result<(), &'static str> {
    let body = MSG + 24;
    W(body).u32(0).u32(0);
    g.ok(4, 8, "cuCtxCreate")?;
    let ctx = rd32(REPLY_BLOB + 24);
    let bytes = (N * 4) as u64;
    let mut dptr = [0u64; 3];
    for p in dptr.iter_mut() {
        W(body).u32(ctx).u32(0).u64(bytes);
        g.ok(7, 16, "cuMemAlloc")?;
        *p = rd64(REPLY_BLOB + 24);
    }
    for i in 0..N as u64 {
        wr32(DATA_BLOB + 4 * i, f32_bits(i as u32));
        wr32(DATA_BLOB + bytes + 4 * i, f32_bits(2 * i as u32));
        wr32(DATA_BLOB + 2 * bytes + 4 * i, 0xdead_beef);
    }
    for (k, p) in dptr.iter().take(2).enumerate() {
        // HtoD from the data blob, in place: loc 2 = Blob.
        W(body).u32(ctx).u32(0).u64(*p).u64(bytes).u32(2).u32(g.res_data).u64(k as u64 * bytes);
        g.ok(11, 40, "cuMemcpyHtoD")?;
    }
    W(body).u32(ctx).u32(0).u64(VECTOR_ADD_PTX.len() as u64).bytes(VECTOR_ADD_PTX);
    g.ok(14, 16 + VECTOR_ADD_PTX.len() as u32, "cuModuleLoadData")?;
    let module = rd32(REPLY_BLOB + 24);
    W(body).u32(ctx).u32(module).u32(9).u32(0).bytes(b"vectorAdd");
    g.ok(16, 16 + 9, "cuModuleGetFunction")?;
    let func = rd32(REPLY_BLOB + 24);
    let mut w = W(body);
    w.u32(ctx).u32(func).u32(0).u32(0).u32(N / 256).u32(1).u32(1).u32(256).u32(1).u32(1).u32(28).u32(0);
    w.u64(dptr[0]).u64(dptr[1]).u64(dptr[2]).u32(N);
    g.ok(17, 48 + 28, "cuLaunchKernel")?;
    W(body).u32(ctx).u32(0).u64(dptr[2]).u64(bytes).u32(2).u32(g.res_data).u64(2 * bytes);
    g.ok(12, 40, "cuMemcpyDtoH")?;
    for i in 0..N as u64 {
        if rd32(DATA_BLOB + 2 * bytes + 4 * i) != f32_bits(3 * i as u32) {
            puts("element ");
            put_dec(i);
            puts(": ");
            put_hex(rd32(DATA_BLOB + 2 * bytes + 4 * i) as u64, 8);
            puts("\n");
            return Err("vectorAdd result");
        }
    }
    puts("VGPU vectorAdd PASSED n=1024 c[1023]=");
    put_hex(rd32(DATA_BLOB + 2 * bytes + 4 * 1023) as u64, 8);
    puts("\n");
    Ok(())
}

fn expect(t: u32, want: u32, what: &str) {
    puts(what);
    puts(": ");
    put_hex(t as u64, 4);
    puts("\n");
    if t != want {
        fail(what);
    }
}

fn vgpu_hostile(g: &mut Gpu) {
    let mut w = W(GREQ);
    ctrl_hdr(&mut w, 0x0999, 0, GPU_CTX, 0);
    expect(g.cmd(24), 0x1200, "unknown command type");
    expect(g.cmd(10), 0x1200, "truncated header");
    let mut w = W(GREQ);
    ctrl_hdr(&mut w, 0x0207, 0, GPU_CTX, 0);
    w.u32(4096).u32(0);
    expect(g.cmd(24 + 8 + 16), 0x1200, "submit larger than its descriptor");
    expect(g.create_blob(9, DATA_BLOB, 0x1000, 0x4000_0000), 0x1200, "absurd blob entry count");
    expect(g.create_blob(9, 0xf000_0000, 0x1000, 1), 0x1205, "blob outside guest RAM");
    expect(g.create_blob(9, DATA_BLOB, 0xffff_f000, 1), 0x1205, "absurd blob length");
    expect(g.ctx_create(5, 4), 0x1205, "foreign capset in CTX_CREATE");
    W(MSG).bytes(b"VGPC").u16(2).u16(1).u32(1).u32(0).u32(0).u32(0);
    expect(g.submit(24, 3, 64).0, 0x1205, "ring_idx 64");
}

/// Prints "tick K" every 2000 iterations of a busy loop.
fn tick(n: u64) {
    if n % 2000 == 0 {
        puts("tick ");
        put_dec(n / 2000);
        puts("\n");
    }
}

/// After a vectorAdd, watches the device status until the VMM reports
/// DEVICE_NEEDS_RESET (its backend went away), printing ticks meanwhile.
fn vgpu_watch() {
    let Some((_, v)) = find_virtio(16) else { fail("no virtio-gpu on PCI") };
    let mut g = gpu_init();
    vgpu_setup(&mut g).unwrap_or_else(|e| fail(e));
    vector_add(&mut g).unwrap_or_else(|e| fail(e));
    let mut n = 0u64;
    loop {
        n += 1;
        tick(n);
        if rd8(v.common + 0x14) & 0x40 != 0 {
            puts("DEVICE NEEDS RESET seen; the guest is still running\n");
            puts("TEST PASSED vgpu-watch\n");
            reset();
        }
    }
}

fn vgpu_test(hostile: bool) {
    let mut g = gpu_init();
    vgpu_setup(&mut g).unwrap_or_else(|e| fail(e));
    if hostile {
        vgpu_hostile(&mut g);
        puts("hostile commands answered\n");
    }
    vector_add(&mut g).unwrap_or_else(|e| fail(e));
}

/// vectorAdd in rounds, each in a context and blobs of its own, until the
/// VM is stopped: "round K PASSED" or "round K failed: WHY". A round whose
/// backend went away in the middle fails, and a later one passes once the
/// VMM has reconnected (commands wait meanwhile, up to seconds).
fn vgpu_again() {
    let mut g = gpu_init();
    g.patience = 2_000_000_000;
    let mut round = 0u32;
    loop {
        round += 1;
        (g.ctx, g.res_data, g.res_reply) = (round, 2 * round + 1, 2 * round + 2);
        let r = vgpu_setup(&mut g).and_then(|_| vector_add(&mut g));
        puts("round ");
        put_dec(round as u64);
        match r {
            Ok(()) => puts(" PASSED\n"),
            Err(e) => {
                puts(" failed: ");
                puts(e);
                puts("\n");
            }
        }
        // CTX_DESTROY and RESOURCE_UNREF, answered or not.
        let (ctx, data, reply) = (g.ctx, g.res_data, g.res_reply);
        let _ = g.try_cmd_simple(0x0201, ctx, 0, 0);
        let _ = g.try_cmd_simple(0x0102, 0, data, 0);
        let _ = g.try_cmd_simple(0x0102, 0, reply, 0);
        for _ in 0..2_000_000 {
            core::hint::spin_loop();
        }
    }
}

/// Resets the device and drives it again, three times, with the same
/// context and resource ids each time, and each time leaves 40 MiB of
/// device memory allocated: only a device that forgets everything at a
/// reset (as a driver reload or a kexec expects) passes every round in a
/// 64 MiB quota.
fn vgpu_reset() {
    for round in 1..=3u64 {
        let mut g = gpu_init();
        vgpu_setup(&mut g).unwrap_or_else(|e| fail(e));
        vector_add(&mut g).unwrap_or_else(|e| fail(e));
        let body = MSG + 24;
        W(body).u32(0).u32(0);
        g.ok(4, 8, "cuCtxCreate").unwrap_or_else(|e| fail(e));
        let ctx = rd32(REPLY_BLOB + 24);
        W(body).u32(ctx).u32(0).u64(40 << 20);
        g.ok(7, 16, "cuMemAlloc 40 MiB").unwrap_or_else(|e| fail(e));
        puts("reset round ");
        put_dec(round);
        puts(" PASSED\n");
    }
}

fn count_test() {
    let mut n = 0u64;
    loop {
        n += 1;
        tick(n);
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
    } else if has(cmd, b"test=vgpu-watch") {
        vgpu_watch();
    } else if has(cmd, b"test=vgpu-again") {
        vgpu_again();
    } else if has(cmd, b"test=vgpu-reset") {
        vgpu_reset();
        puts("TEST PASSED vgpu-reset\n");
    } else if has(cmd, b"test=vgpu-hostile") {
        vgpu_test(true);
        puts("TEST PASSED vgpu-hostile\n");
    } else if has(cmd, b"test=vgpu") {
        vgpu_test(false);
        puts("TEST PASSED vgpu\n");
    } else if has(cmd, b"test=net") {
        net_test();
        puts("TEST PASSED net\n");
    } else if has(cmd, b"test=blk") {
        blk_test();
        puts("TEST PASSED blk\n");
    } else if has(cmd, b"test=hostile") {
        hostile_test();
        puts("TEST PASSED hostile\n");
    } else {
        rng_test();
        puts("TEST PASSED rng\n");
    }
    reset()
}

/// `memcmp`/`bcmp` for code LLVM generates (slice comparisons). Volatile
/// reads keep LLVM from turning this loop back into a call to itself.
///
/// # Safety
/// `a` and `b` must be readable for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    for i in 0..n {
        // SAFETY: the caller guarantees both ranges are readable.
        let (x, y) = unsafe { (read_volatile(a.add(i)), read_volatile(b.add(i))) };
        if x != y {
            return x as i32 - y as i32;
        }
    }
    0
}

/// # Safety
/// As for [`memcmp`].
#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract.
    unsafe { memcmp(a, b, n) }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    fail("panic")
}
