//! Bad input to vgpu-vmm gets a clear error and a failure status, never a panic.

use vgpu_tests::vmm_harness::*;

/// Refused: status 1 for a bad VM description, 2 for a malformed command line.
fn refused(args: &[&str], expect: &str) {
    let o = vmm_run(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(matches!(o.status.code(), Some(1 | 2)), "{args:?} should fail with status 1 or 2:\n{err}");
    assert!(err.contains(expect), "{args:?}: expected {expect:?} in:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_command_lines_and_configs_are_refused_with_reasons() {
    let dir = std::env::temp_dir().join(format!("vgpu-badinput-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("notes.txt");
    std::fs::write(&text, "this is not a kernel\n").unwrap();
    let text = text.to_str().unwrap();
    let guest = test_guest().to_str().unwrap().to_string();

    refused(&["--kernel", "/nonexistent/vmlinuz"], "/nonexistent/vmlinuz");
    refused(&[], "--kernel");
    refused(&["--kernel", &guest, "--vcpus", "0"], "vcpus must be");
    refused(&["--kernel", &guest, "--memory", "100TiB"], "larger than the host");
    refused(&["--kernel", &guest, "--memory", "lots"], "invalid");
    refused(&["--kernel", &guest, "--hugepages", "3M"], "hugepages");
    refused(&["--kernel", &guest, "--memory", "16", "--initramfs", "/nonexistent/initrd"], "initrd");

    let bad_json = dir.join("bad.json");
    std::fs::write(&bad_json, "{\"kernel\": \"/k\", \"vcpu\": 2}").unwrap();
    refused(&["--config", bad_json.to_str().unwrap()], "unknown field");
    std::fs::write(&bad_json, "{\"kernel\": ").unwrap();
    refused(&["--config", bad_json.to_str().unwrap()], "invalid VM config");
    refused(&["--config", "/nonexistent/vm.json"], "/nonexistent/vm.json");

    if kvm_available("non_kernel_file_is_refused") {
        refused(&["--kernel", text], "neither an x86-64 ELF kernel nor a bzImage");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn good_json_config_runs_the_guest() {
    if !kvm_available("good_json_config_runs_the_guest") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vgpu-goodcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let serial = dir.join("serial.log");
    let cfg = dir.join("vm.json");
    let json = serde_json::json!({ "kernel": test_guest(), "cmdline": "test=rng", "vcpus": 1, "memory_mib": "16MiB", "serial": serial });
    std::fs::write(&cfg, json.to_string()).unwrap();
    let o = vmm_run(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read_to_string(&serial).unwrap().contains("TEST PASSED rng"));
    std::fs::remove_dir_all(dir).unwrap();
}
