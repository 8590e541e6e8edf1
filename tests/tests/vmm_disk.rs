//! KVM tier: virtio-blk. The bare-metal test guest drives `vgpu-vmm
//! --disk` through the modern virtio-pci transport: it reads a marker the
//! test wrote into the image, writes one back that the test then finds in
//! the file, flushes, and gets I/O errors for requests past the end, of
//! half a sector, and for writes to a read-only disk. Bad `--disk` values
//! are refused before the VM starts.

use std::path::PathBuf;
use std::time::Duration;

use vgpu_tests::vmm_harness::*;

fn image(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("vgpu-disk-{}-{tag}.img", std::process::id()));
    let mut b = vec![0u8; 64 << 10];
    b[..16].copy_from_slice(b"MARKER-FROM-HOST");
    std::fs::write(&p, b).expect("image");
    p
}

fn status(out: &str, what: &str) -> Option<u32> {
    out.lines().find_map(|l| l.strip_prefix(&format!("{what} status "))).and_then(|v| v.trim().parse().ok())
}

#[test]
fn a_guest_reads_and_writes_a_disk_image_through_virtio_blk() {
    if !kvm_available("a_guest_reads_and_writes_a_disk_image_through_virtio_blk") {
        return;
    }
    let img = image("rw");
    let g = Guest::start("blk", &["--disk", &format!("path={},id=disk-under-test", img.display())]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "stderr:\n{err}\nserial:\n{out}");
    assert!(out.contains("read-write") && out.contains("BLK capacity 128"), "{out}");
    assert!(out.contains("BLK-READ MARKER-FROM-HOST"), "{out}");
    assert_eq!(status(&out, "BLK-READ"), Some(0), "{out}");
    assert_eq!(status(&out, "BLK-WRITE"), Some(0), "{out}");
    assert_eq!(status(&out, "BLK-FLUSH"), Some(0), "{out}");
    assert!(out.contains("BLK-READBACK MARKER-FROM-GUEST"), "{out}");
    assert_eq!(status(&out, "BLK-BEYOND-END"), Some(1), "past the end is an I/O error: {out}");
    assert_eq!(status(&out, "BLK-HALF-SECTOR"), Some(1), "half a sector is an I/O error: {out}");
    assert!(out.contains("BLK-ID disk-under-test"), "{out}");
    assert!(out.contains("TEST PASSED blk"), "{out}");
    // The guest's write is in the file, where it said.
    let b = std::fs::read(&img).expect("image");
    assert_eq!(&b[512..512 + 17], b"MARKER-FROM-GUEST");
    assert_eq!(&b[..16], b"MARKER-FROM-HOST", "sector 0 is untouched");
    assert_eq!(b.len(), 64 << 10, "the image did not grow");
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_file(img);
}

#[test]
fn a_read_only_disk_refuses_writes_and_its_image_is_unchanged() {
    if !kvm_available("a_read_only_disk_refuses_writes_and_its_image_is_unchanged") {
        return;
    }
    let img = image("ro");
    let before = std::fs::read(&img).expect("image");
    let g = Guest::start("blk", &["--disk", &format!("path={},ro", img.display())]);
    let (st, err, out) = g.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "stderr:\n{err}\nserial:\n{out}");
    assert!(out.contains(" read-only"), "the device offers VIRTIO_BLK_F_RO: {out}");
    assert!(out.contains("BLK-READ MARKER-FROM-HOST"), "{out}");
    assert_eq!(status(&out, "BLK-WRITE"), Some(1), "a write to a read-only disk is an I/O error: {out}");
    assert!(out.contains("BLK-ID vgpu-disk0"), "the default id: {out}");
    assert_eq!(std::fs::read(&img).expect("image"), before, "the read-only image changed");
    let _ = std::fs::remove_file(img);
}

#[test]
fn bad_disk_arguments_are_refused_before_the_vm_starts() {
    let dir = std::env::temp_dir().join(format!("vgpu-disk-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let odd = dir.join("odd.img");
    std::fs::write(&odd, [0u8; 700]).expect("odd image");
    let mut cases = vec![
        ("path=/nonexistent/disk.img".to_string(), "/nonexistent/disk.img"),
        (format!("path={}", dir.display()), "not a regular file"),
        ("ro".to_string(), "needs path=PATH"),
        (format!("path={},speed=9", odd.display()), "invalid --disk part"),
        (format!("path={},bw=10MiB", odd.display()), "AMOUNT/MILLISECONDS"),
        (format!("path={},id=an-id-much-longer-than-twenty", odd.display()), "invalid --disk part"),
    ];
    // Refused when the device is made, which needs the VM, so KVM.
    if kvm_available("bad_disk_arguments_are_refused_before_the_vm_starts (an image of a partial sector)") {
        cases.push((format!("path={}", odd.display()), "512-byte sectors"));
    }
    for (arg, says) in cases {
        let o = std::process::Command::new(vgpu_tests::bin("vgpu-vmm")).arg("--kernel").arg(test_guest()).args(["--memory", "16", "--disk", &arg]).output().expect("vgpu-vmm");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "--disk {arg} was accepted");
        assert!(err.contains(says), "--disk {arg}: the error does not say {says:?}:\n{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // One image given twice read-write is refused: two writers would
    // corrupt it (the same lock keeps two VMs apart). Twice read-only is fine.
    if kvm_available("bad_disk_arguments_are_refused_before_the_vm_starts (an image given twice)") {
        let img = dir.join("twice.img");
        std::fs::write(&img, vec![0u8; 4096]).expect("image");
        let run = |a: &str, b: &str| {
            std::process::Command::new(vgpu_tests::bin("vgpu-vmm"))
                .arg("--kernel")
                .arg(test_guest())
                .args(["--memory", "16", "--cmdline", "test=rng", "--disk", a, "--disk", b])
                .output()
                .expect("vgpu-vmm")
        };
        let rw = format!("path={}", img.display());
        let o = run(&rw, &rw);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("in use by another VM"), "{err}");
        let ro = format!("path={},ro", img.display());
        let o = run(&ro, &ro);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let _ = std::fs::remove_dir_all(dir);
}
