//! Nested tier: a large 64-bit BAR through VFIO. QEMU gives L1 an ivshmem
//! device whose 512 MiB BAR 2 is a file this test wrote (a word at each
//! end); L1 binds it to vfio-pci and `vgpu-vmm --vfio` passes it to
//! Debian's stock kernel (images/nested/scenarios/vfio-bigbar.sh). The VMM
//! must place that BAR in its window above guest RAM, as it would a GPU's
//! frame buffer aperture; the guest reads both words through it and writes
//! two of its own, which the test finds in the file after QEMU exits.

use vgpu_tests::nested;

const SIZE: usize = 512 << 20;

#[test]
fn a_512_mib_bar_is_placed_above_guest_ram_and_reaches_the_device() {
    let test = "a_512_mib_bar_is_placed_above_guest_ram_and_reaches_the_device";
    if !nested::qemu_available(test) {
        return;
    }
    let file = std::env::temp_dir().join(format!("vgpu-nested-ivshmem-{}.bin", std::process::id()));
    let mut bytes = vec![0u8; SIZE];
    bytes[..4].copy_from_slice(&0x1122_3344u32.to_le_bytes());
    bytes[SIZE - 4..].copy_from_slice(&0x5566_7788u32.to_le_bytes());
    std::fs::write(&file, &bytes).expect("write the ivshmem file");
    drop(bytes);
    let out = nested::run_vfio("vfio-bigbar", &[("VFIO_IVSHMEM", &file)], "BIGBAR-DONE");
    let after = std::fs::read(&file).expect("read the ivshmem file back");
    let _ = std::fs::remove_file(&file);
    assert_eq!(nested::value(&out, "VMM-EXIT"), Some("0"), "{out}");
    let start =
        nested::value(&out, "CONSOLE: L2-BIGBAR-START").and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok()).unwrap_or_else(|| panic!("no BAR address from the guest:\n{out}"));
    let end = nested::value(&out, "CONSOLE: L2-BIGBAR-END").and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok()).expect("BAR end");
    assert!(start >= 1 << 32, "the 512 MiB BAR is at {start:#x}, not above the guest's 256 MiB of RAM and the 4 GiB line:\n{out}");
    assert_eq!(end + 1 - start, SIZE as u64, "{out}");
    assert_eq!(nested::value(&out, "CONSOLE: L2-BIGBAR-FIRST"), Some("0x11223344"), "{out}");
    assert_eq!(nested::value(&out, "CONSOLE: L2-BIGBAR-LAST"), Some("0x55667788"), "{out}");
    assert_eq!(nested::value(&out, "CONSOLE: L2-BIGBAR-READBACK"), Some("0xC0FFEE42"), "{out}");
    let word = |off: usize| u32::from_le_bytes(after[off..off + 4].try_into().expect("4 bytes"));
    assert_eq!(word(4096), 0xc0ff_ee42, "the guest's first word is not in the file");
    assert_eq!(word(0x1000_0000), 0x600d_f00d, "the guest's word 256 MiB in is not in the file");
    println!("nested: the guest saw the 512 MiB BAR at {start:#x}");
}
