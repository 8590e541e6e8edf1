//! `CUdevice_attribute` values: the table a device answers with
//! (`Request::GetDeviceAttributes`), indexed by attribute number.

use std::ffi::c_int;

use crate::DeviceInfo;

/// Attribute numbers below this are answered (CUDA 12.9 defines 1..=143).
pub const COUNT: usize = 160;
/// The value of an attribute the device does not answer.
pub const UNSUPPORTED: i32 = i32::MIN;

/// The CPU reference device's value for `attr`: its real limits where the
/// device states them, CUDA's documented values for an sm_80-class device
/// elsewhere (docs/cuda-stacks.md), and 0 for features it lacks (textures
/// are sized but unsupported).
pub fn reference(info: &DeviceInfo, attr: c_int) -> Option<c_int> {
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    Some(match attr {
        1 => i(info.max_threads_per_block),
        2..=4 => i(info.max_block[(attr - 2) as usize]),
        5..=7 => i(info.max_grid[(attr - 5) as usize]),
        8 | 81 | 97 => i(info.max_shared_per_block),
        9 => 65536,
        10 => i(info.warp_size),
        11 => i32::MAX,
        12 | 82 => 65536,
        13 | 36 => 1_000_000,
        14 | 30 => 512,
        // Streams overlap (copies with kernels, kernels with kernels),
        // addresses are unified, priorities and registration are accepted.
        15 | 31 | 40 | 41 | 78 | 79 | 80 | 99 | 126 => 1,
        16 => i(info.sm_count),
        17 => (info.instruction_budget != 0) as c_int,
        // L2 cache size: an A100's 40 MiB, as for the other sm_80-class
        // figures (libraries size tiles, split-k and persisting windows by
        // it; none at all is no real GPU's answer).
        38 => 40 << 20,
        // Shared memory the driver reserves per block: the 1 KiB the
        // interpreter sets aside (%reserved_smem_offset_*), as sm_80 does.
        111 => 1024,
        18 | 19 | 20 | 32 | 33 | 35 | 44 | 50 | 83..=86 | 88..=96 | 98 | 100..=105 | 107..=110 | 112..=125 | 127..=130 | 132 | 133 | 135..=143 => 0,
        21 | 56 | 70 => 131072,
        22 | 27 | 28 | 45 | 46 | 52 | 53 | 55 | 61 | 63 | 64 | 66 | 67 | 73 | 74 | 77 => 32768,
        23 | 57 => 65536,
        24..=26 | 58..=60 => 16384,
        29 | 43 | 62 | 65 => 2048,
        47 | 48 => 8192,
        49 => 32768,
        51 => 32,
        54 | 68 => 2046,
        42 => 32768,
        69 => 1 << 28,
        71 => 65000,
        72 => 2_097_120,
        34 => i(info.ordinal),
        37 => 64,
        39 => 2048,
        75 => i(info.cc_major),
        76 => i(info.cc_minor),
        87 => 2,
        106 => 32,
        131 => -1,
        134 => info.numa_node,
        _ => return None,
    })
}

/// The whole reference table.
pub fn reference_table(info: &DeviceInfo) -> Vec<i32> {
    (0..COUNT as c_int).map(|a| reference(info, a).unwrap_or(UNSUPPORTED)).collect()
}

/// What any vGPU offers whatever the hardware underneath: features the
/// vGPU's driver does not provide (managed and mapped host memory, IPC,
/// memory pools, virtual memory management, cooperative and cluster
/// launches, multicast) read 0; unified addressing, stream priorities and
/// host registration read 1.
pub fn vgpu_view(table: &mut [i32]) {
    let set = |t: &mut [i32], a: usize, v: i32| {
        if let Some(x) = t.get_mut(a) {
            *x = v;
        }
    };
    for a in [19, 83, 88, 89, 91, 92, 93, 94, 95, 96, 98, 100, 101, 102, 103, 104, 105, 110, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 128, 129, 132, 133] {
        set(table, a, 0);
    }
    for a in [41, 78, 99] {
        set(table, a, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_table_answers_every_cuda_12_attribute() {
        let info = DeviceInfo {
            name: [0; 64],
            uuid: [0; 16],
            total_mem: 1 << 30,
            free_mem: 1 << 30,
            cc_major: 8,
            cc_minor: 0,
            sm_count: 4,
            warp_size: 32,
            max_threads_per_block: 1024,
            max_shared_per_block: 48 << 10,
            max_block: [1024, 1024, 64],
            max_grid: [i32::MAX as u32, 65535, 65535],
            numa_node: 0,
            ordinal: 0,
            instruction_budget: 0,
        };
        let t = reference_table(&info);
        assert_eq!(t.len(), COUNT);
        for a in (1..=138).chain(140..=143) {
            assert_ne!(t[a], UNSUPPORTED, "attribute {a}");
        }
        assert_eq!((t[75], t[76], t[16], t[1], t[41]), (8, 0, 4, 1024, 1));
        assert_eq!(t[0], UNSUPPORTED);
    }

    #[test]
    fn the_vgpu_view_hides_what_the_driver_does_not_offer() {
        let mut t = vec![1; COUNT];
        vgpu_view(&mut t);
        assert_eq!((t[83], t[95], t[115], t[41]), (0, 0, 0, 1));
    }
}
