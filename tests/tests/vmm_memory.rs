//! Guest memory placement: hugepage backing (HugePages_Free drops by the
//! guest size; a short pool is refused with a clear message) and NUMA
//! binding (numa_maps shows the bind, vCPU threads run on the node's CPUs).

use std::time::Duration;

use vgpu_tests::vmm_harness::*;

fn meminfo(field: &str) -> u64 {
    let t = std::fs::read_to_string("/proc/meminfo").unwrap();
    vmm::config::meminfo_field(&t, field).unwrap_or(0)
}

const NR: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";

/// Restores the host's hugepage pool when the test ends, however it ends.
struct Pool(u64);
impl Drop for Pool {
    fn drop(&mut self) {
        let _ = std::fs::write(NR, self.0.to_string());
    }
}

#[test]
fn hugepage_backed_guest_takes_its_memory_from_the_pool_and_short_pool_is_refused() {
    if !kvm_available("hugepage_backed_guest_takes_its_memory_from_the_pool_and_short_pool_is_refused") {
        return;
    }
    let Ok(old) = std::fs::read_to_string(NR) else {
        eprintln!("SKIPPED hugepage test: {NR} is missing (no 2 MiB hugepage support)");
        return;
    };
    let old: u64 = old.trim().parse().unwrap();
    let _restore = Pool(old);
    if std::fs::write(NR, (old + 16).to_string()).is_err() {
        eprintln!("SKIPPED hugepage test: cannot reserve hugepages (needs root)");
        return;
    }
    let free_before = meminfo("HugePages_Free");
    if free_before < 8 {
        eprintln!("SKIPPED hugepage test: the kernel reserved only {free_before} free 2 MiB pages");
        return;
    }
    // A 16 MiB guest on 2 MiB pages: 8 pages.
    let mut g = Guest::start("count", &["--hugepages", "2M"]);
    g.wait_api();
    g.wait_for("tick 1", Duration::from_secs(60));
    let free_during = meminfo("HugePages_Free");
    let (_, body) = g.api_call("GET", "/vm");
    assert!(body.contains("memfd-hugetlb-2M"), "{body}");
    assert_eq!(free_before - free_during, 8, "HugePages_Free should drop by 16 MiB / 2 MiB");
    assert_eq!(g.api_call("PUT", "/vm/kill").0, 204);
    let _ = g.wait_exit(Duration::from_secs(10));

    // More than the pool holds: refused before the guest starts.
    let want = format!("{}", (meminfo("HugePages_Free") + 4) * 2);
    let o = vmm_run(&["--kernel", test_guest().to_str().unwrap(), "--memory", &want, "--hugepages", "2M"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not enough 2M hugepages"), "{err}");
}

fn node0_cpus() -> Vec<usize> {
    let root = std::path::Path::new("/sys");
    let t = vmm::numa::Topology::read(root).expect("host topology");
    t.cpus_for(0).expect("node 0").to_vec()
}

#[test]
fn numa_node_binds_guest_memory_and_pins_vcpu_threads() {
    if !kvm_available("numa_node_binds_guest_memory_and_pins_vcpu_threads") {
        return;
    }
    let mut g = Guest::start("count", &["--numa-node", "0", "--vcpus", "2"]);
    g.wait_api();
    g.wait_for("tick 1", Duration::from_secs(60));
    let pid = g.child.id();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/numa_maps")).unwrap();
    let ram: Vec<&str> = maps.lines().filter(|l| l.contains("vgpu-guest-ram")).collect();
    assert!(!ram.is_empty(), "guest RAM mapping not found:\n{maps}");
    assert!(ram.iter().all(|l| l.contains("bind:0")), "guest RAM not bound to node 0:\n{}", ram.join("\n"));

    let want = node0_cpus();
    let mut vcpus = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let t = t.unwrap().path();
        let comm = std::fs::read_to_string(t.join("comm")).unwrap_or_default();
        if !comm.starts_with("vcpu") {
            continue;
        }
        vcpus += 1;
        let status = std::fs::read_to_string(t.join("status")).unwrap();
        let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string();
        assert_eq!(vmm::numa::parse_cpulist(&list).unwrap(), want, "{} runs on {list}", comm.trim());
    }
    assert_eq!(vcpus, 2);
    let (_, body) = g.api_call("GET", "/vm");
    let info: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(info["numa_node"], 0);

    // A node this host lacks is refused with the list of nodes it has.
    let o = vmm_run(&["--kernel", test_guest().to_str().unwrap(), "--numa-node", "7"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("NUMA node 7 does not exist"), "{err}");
    assert_eq!(g.api_call("PUT", "/vm/kill").0, 204);
}
