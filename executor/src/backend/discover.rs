//! GPU discovery: what NVML reports, turned into the devices the mediator
//! runs workers for.
//!
//! NVML's answers are first copied into plain data ([`NvmlAnswers`]), and
//! the placement logic ([`plan`]) works on that alone. Tests feed it
//! recorded answers (`tests/nvml/*.json`), and `vgpu-mediatord discover
//! --record` writes the answers of the machine it runs on in that format.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// What NVML said about the machine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlAnswers {
    /// `nvmlSystemGetDriverVersion`, e.g. "550.54.15".
    pub driver_version: String,
    /// `nvmlSystemGetCudaDriverVersion`, e.g. 12040.
    pub cuda_driver_version: i32,
    pub gpus: Vec<NvmlGpu>,
}

/// One physical GPU.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlGpu {
    pub index: u32,
    pub name: String,
    /// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
    pub uuid: String,
    /// NVML's form: "00000000:3B:00.0" (8-digit domain, upper case).
    pub pci_bus_id: String,
    pub memory_total: u64,
    /// `nvmlDeviceGetMigMode`'s current mode; None where MIG is unsupported.
    pub mig_enabled: Option<bool>,
    /// `nvmlDeviceGetMigDeviceHandleByIndex` for each populated index.
    #[serde(default)]
    pub mig_devices: Vec<NvmlMig>,
}

/// One MIG device (a compute instance inside a GPU instance).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlMig {
    /// "MIG-xxxxxxxx-..." (drivers since R470), or the older
    /// "MIG-GPU-<uuid>/<gi>/<ci>".
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuKind {
    Whole,
    Mig,
}

/// A device the mediator will run a `cuda` worker for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlannedGpu {
    /// `gpu0` for a whole GPU, `gpu0-mig3` for MIG device 3 of GPU 0.
    pub name: String,
    pub kind: GpuKind,
    pub model: String,
    pub uuid: String,
    pub parent_uuid: String,
    pub pci_bus_id: String,
    pub memory: u64,
    /// From sysfs; -1 where the platform reports none.
    pub numa_node: i32,
    /// What the worker sets `CUDA_VISIBLE_DEVICES` to before cuInit, so
    /// its device 0 is exactly this GPU or MIG instance.
    pub visible_devices: String,
}

/// NVML's "00000000:3B:00.0" in the form sysfs names it: "0000:3b:00.0".
pub fn sysfs_bus_id(nvml: &str) -> Option<String> {
    let (domain, rest) = nvml.trim().split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let (bus, devfn) = rest.split_once(':')?;
    let (dev, func) = devfn.split_once('.')?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if domain > 0xffff || dev > 31 || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The NUMA node of a PCI device, from `<sysfs>/bus/pci/devices/<id>/numa_node`.
pub fn numa_node_of(sysfs_root: &Path, nvml_bus_id: &str) -> i32 {
    let Some(id) = sysfs_bus_id(nvml_bus_id) else { return -1 };
    std::fs::read_to_string(sysfs_root.join("bus/pci/devices").join(id).join("numa_node")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(-1)
}

/// Why a GPU NVML listed gets no worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    pub gpu: String,
    pub reason: String,
}

/// Turns NVML's answers into devices: a GPU in MIG mode contributes one
/// device per MIG device, any other GPU one device for the whole GPU.
pub fn plan(answers: &NvmlAnswers, sysfs_root: &Path) -> (Vec<PlannedGpu>, Vec<Skipped>) {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for g in &answers.gpus {
        let numa_node = numa_node_of(sysfs_root, &g.pci_bus_id);
        if !g.uuid.starts_with("GPU-") {
            skipped.push(Skipped { gpu: format!("gpu{}", g.index), reason: format!("NVML gave an unexpected UUID {:?}", g.uuid) });
            continue;
        }
        if g.mig_enabled == Some(true) {
            if g.mig_devices.is_empty() {
                skipped.push(Skipped { gpu: format!("gpu{}", g.index), reason: "MIG mode is on but no GPU or compute instances exist; create them with nvidia-smi mig".into() });
            }
            for (i, m) in g.mig_devices.iter().enumerate() {
                if !m.uuid.starts_with("MIG-") {
                    skipped.push(Skipped { gpu: format!("gpu{}-mig{i}", g.index), reason: format!("NVML gave an unexpected MIG UUID {:?}", m.uuid) });
                    continue;
                }
                out.push(PlannedGpu {
                    name: format!("gpu{}-mig{i}", g.index),
                    kind: GpuKind::Mig,
                    model: m.name.clone(),
                    uuid: m.uuid.clone(),
                    parent_uuid: g.uuid.clone(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    memory: m.memory_total,
                    numa_node,
                    // CUDA takes MIG devices by their own UUID, whatever
                    // form the driver reports it in.
                    visible_devices: m.uuid.clone(),
                });
            }
        } else {
            out.push(PlannedGpu {
                name: format!("gpu{}", g.index),
                kind: GpuKind::Whole,
                model: g.name.clone(),
                uuid: g.uuid.clone(),
                parent_uuid: g.uuid.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                memory: g.memory_total,
                numa_node,
                // By UUID, not index: CUDA orders devices fastest first,
                // NVML by PCI bus id.
                visible_devices: g.uuid.clone(),
            });
        }
    }
    (out, skipped)
}

/// Asks the machine's NVML. Errors say why there is nothing to ask (no
/// driver, no library): the mediator then runs CPU devices only.
#[cfg(feature = "cuda")]
pub fn query_nvml() -> Result<NvmlAnswers, String> {
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::Nvml;
    let nvml = Nvml::init().map_err(|e| format!("NVML is unavailable: {e}"))?;
    let e = |what: &str, err: NvmlError| format!("NVML {what}: {err}");
    let mut a = NvmlAnswers {
        driver_version: nvml.sys_driver_version().map_err(|x| e("driver version", x))?,
        cuda_driver_version: nvml.sys_cuda_driver_version().map_err(|x| e("CUDA driver version", x))?,
        gpus: Vec::new(),
    };
    for index in 0..nvml.device_count().map_err(|x| e("device count", x))? {
        let d = nvml.device_by_index(index).map_err(|x| e("device handle", x))?;
        let mig_enabled = match d.mig_mode() {
            Ok(m) => Some(m.current == 1),
            Err(NvmlError::NotSupported) => None,
            Err(x) => return Err(e("MIG mode", x)),
        };
        let mut mig_devices = Vec::new();
        if mig_enabled == Some(true) {
            // Indices are dense from 0; H100 has at most 7 MIG devices.
            for i in 0..16 {
                match d.mig_device_by_index(i) {
                    Ok(m) => mig_devices.push(NvmlMig {
                        uuid: m.uuid().map_err(|x| e("MIG UUID", x))?,
                        name: m.name().unwrap_or_default(),
                        memory_total: m.memory_info().map_err(|x| e("MIG memory", x))?.total,
                    }),
                    Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue,
                    Err(x) => return Err(e("MIG device handle", x)),
                }
            }
        }
        a.gpus.push(NvmlGpu {
            index,
            name: d.name().map_err(|x| e("name", x))?,
            uuid: d.uuid().map_err(|x| e("UUID", x))?,
            pci_bus_id: d.pci_info().map_err(|x| e("PCI info", x))?.bus_id,
            memory_total: d.memory_info().map_err(|x| e("memory", x))?.total,
            mig_enabled,
            mig_devices,
        });
    }
    Ok(a)
}

#[cfg(not(feature = "cuda"))]
pub fn query_nvml() -> Result<NvmlAnswers, String> {
    Err("this vgpu-mediatord was built without the `cuda` feature".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(name: &str) -> NvmlAnswers {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nvml").join(name);
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    fn fake_sysfs(nodes: &[(&str, &str)]) -> tempdir::Dir {
        let d = tempdir::Dir::new();
        for (id, node) in nodes {
            let p = d.0.join("bus/pci/devices").join(id);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("numa_node"), format!("{node}\n")).unwrap();
        }
        d
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!("vgpu-discover-{}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn nvml_bus_ids_become_sysfs_names() {
        assert_eq!(sysfs_bus_id("00000000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(sysfs_bus_id("00000001:C1:1F.7").as_deref(), Some("0001:c1:1f.7"));
        assert_eq!(sysfs_bus_id("0000:3b:00.0").as_deref(), Some("0000:3b:00.0"));
        for bad in ["", "3B:00.0", "00000000:3B:00", "00000000:3B:20.0", "00000000:3B:00.8", "100000000:00:00.0", "zz:00:00.0"] {
            assert_eq!(sysfs_bus_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn whole_gpus_are_addressed_by_uuid_with_their_numa_node() {
        let a = recorded("dgx-h100-8gpu.json");
        let sys = fake_sysfs(&[("0000:18:00.0", "0"), ("0000:2a:00.0", "0"), ("0000:ab:00.0", "1"), ("0000:db:00.0", "1")]);
        let (devs, skipped) = plan(&a, &sys.0);
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(devs.len(), 8);
        assert_eq!(devs[0].name, "gpu0");
        assert_eq!(devs[0].kind, GpuKind::Whole);
        assert_eq!(devs[0].visible_devices, a.gpus[0].uuid);
        assert_eq!(devs[0].memory, 85_520_809_984);
        assert_eq!(devs[0].numa_node, 0);
        assert_eq!(devs[5].numa_node, 1, "{}", devs[5].pci_bus_id);
        // GPUs whose sysfs entry is missing get no node rather than a guess.
        assert_eq!(devs[2].numa_node, -1, "{}", devs[2].pci_bus_id);
    }

    #[test]
    fn a_mig_gpu_becomes_one_device_per_mig_instance() {
        let a = recorded("h100-mig-mixed.json");
        let sys = fake_sysfs(&[("0000:c1:00.0", "1"), ("0000:41:00.0", "0")]);
        let (devs, skipped) = plan(&a, &sys.0);
        assert!(skipped.is_empty(), "{skipped:?}");
        let names: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu0-mig0", "gpu0-mig1", "gpu0-mig2", "gpu1"]);
        let mig = &devs[1];
        assert_eq!(mig.kind, GpuKind::Mig);
        assert_eq!(mig.visible_devices, a.gpus[0].mig_devices[1].uuid);
        assert!(mig.visible_devices.starts_with("MIG-"));
        assert_eq!(mig.parent_uuid, a.gpus[0].uuid);
        assert_eq!(mig.memory, a.gpus[0].mig_devices[1].memory_total, "a MIG device's memory is its own slice, not the GPU's");
        assert_eq!(mig.numa_node, 1, "MIG devices inherit the parent's PCI NUMA node");
        assert_eq!(devs[3].kind, GpuKind::Whole);
        assert_eq!(devs[3].numa_node, 0);
    }

    #[test]
    fn mig_mode_without_instances_is_skipped_with_a_reason() {
        let a = recorded("a100-mig-empty.json");
        let (devs, skipped) = plan(&a, Path::new("/nonexistent"));
        assert!(devs.is_empty());
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].reason.contains("no GPU or compute instances"), "{}", skipped[0].reason);
    }

    #[test]
    fn old_style_mig_uuids_are_passed_through_to_cuda() {
        let mut a = recorded("h100-mig-mixed.json");
        a.gpus[0].mig_devices[0].uuid = format!("MIG-{}/1/0", a.gpus[0].uuid);
        let (devs, _) = plan(&a, Path::new("/nonexistent"));
        assert_eq!(devs[0].visible_devices, format!("MIG-{}/1/0", a.gpus[0].uuid));
    }

    #[test]
    fn malformed_uuids_are_refused_not_guessed() {
        let mut a = recorded("h100-mig-mixed.json");
        a.gpus[0].mig_devices[2].uuid = "0".into();
        a.gpus[1].uuid = String::new();
        let (devs, skipped) = plan(&a, Path::new("/nonexistent"));
        assert_eq!(devs.len(), 2);
        assert_eq!(skipped.len(), 2);
    }

    #[test]
    fn recorded_answers_round_trip_through_the_record_format() {
        for f in ["dgx-h100-8gpu.json", "h100-mig-mixed.json", "a100-mig-empty.json"] {
            let a = recorded(f);
            let text = serde_json::to_string_pretty(&a).unwrap();
            assert_eq!(serde_json::from_str::<NvmlAnswers>(&text).unwrap(), a);
        }
    }
}
