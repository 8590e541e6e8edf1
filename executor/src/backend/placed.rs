//! What a GPU driver places in device memory for a module's variables,
//! worked out from the image before it is loaded, so that a tenant's quota
//! counts it: a PTX module's `.global` and `.const` definitions
//! (`vgpu_ptx::Module::placed_bytes`); a cubin's `.nv.global*` and
//! `.nv.constant*` sections (their sizes whether or not the file holds
//! their bytes: `.nv.global` holds none); for a fatbin, the most any of its
//! entries places, whichever one the driver picks.

use virtio_gpu_compute::fatbin::{self, Kind};
use virtio_gpu_compute::{CuResult, ImageFormat};

use super::BackendError;

/// The device bytes the driver places for `image`'s variables on a GPU of
/// architecture `arch` (10 × major + minor); reading it (decompressing
/// fatbin entries, lexing PTX) takes at most `host_limit` bytes of host
/// memory, all entries together.
pub fn placed_bytes(image: &[u8], format: ImageFormat, arch: u32, host_limit: u64) -> Result<u64, BackendError> {
    match format {
        ImageFormat::Ptx => ptx(image, host_limit),
        ImageFormat::Cubin => elf(image),
        ImageFormat::Fatbin => {
            let (mut most, mut left) = (0u64, host_limit);
            // Only what the driver could pick for this GPU.
            for e in fatbin::entries(image).map_err(BackendError::fatbin)?.into_iter().filter(|e| e.runs_on(arch)) {
                // Decompression is bounded for all entries together; each
                // entry is freed before the next, so its parse gets what
                // its own text leaves.
                let bytes = e.contents_within(left).map_err(BackendError::fatbin)?;
                left = left.saturating_sub(bytes.capacity() as u64);
                let placed = match e.kind {
                    Kind::Ptx => ptx(&bytes, host_limit.saturating_sub(bytes.capacity() as u64))?,
                    Kind::Elf => elf(&bytes)?,
                    _ => 0,
                };
                most = most.max(placed);
            }
            Ok(most)
        }
    }
}

fn ptx(image: &[u8], host_limit: u64) -> Result<u64, BackendError> {
    let text = std::str::from_utf8(image.strip_suffix(&[0]).unwrap_or(image)).map_err(|_| BackendError::new(CuResult::CUDA_ERROR_INVALID_PTX, "PTX image is not valid UTF-8 text"))?;
    vgpu_ptx::Module::placed_bytes(text, host_limit).map_err(BackendError::ptx)
}

fn elf(image: &[u8]) -> Result<u64, BackendError> {
    use object::{Object, ObjectSection};
    let f = object::File::parse(image).map_err(|e| BackendError::new(CuResult::CUDA_ERROR_INVALID_IMAGE, format!("cubin: {e}")))?;
    let mut total = 0u64;
    for s in f.sections() {
        // By bytes: a name that is not UTF-8 is still compared.
        let name = s.name_bytes().unwrap_or_default();
        if name.starts_with(b".nv.global") || name.starts_with(b".nv.constant") {
            total = total.checked_next_multiple_of(s.align().max(1)).unwrap_or(u64::MAX).saturating_add(s.size());
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal 64-bit ELF with the given sections (name, type, size,
    /// alignment), as a cubin lays them out.
    fn elf_with(sections: &[(&str, u32, u64, u64)]) -> Vec<u8> {
        use object::write::Object;
        let mut o = Object::new(object::BinaryFormat::Elf, object::Architecture::X86_64, object::Endianness::Little);
        for &(name, kind, size, align) in sections {
            let id = o.add_section(Vec::new(), name.as_bytes().to_vec(), if kind == 8 { object::SectionKind::UninitializedData } else { object::SectionKind::Data });
            if kind == 8 {
                o.append_section_bss(id, size, align);
            } else {
                o.append_section_data(id, &vec![0; size as usize], align);
            }
        }
        o.write().expect("elf")
    }

    #[test]
    fn a_cubins_global_and_constant_sections_are_counted() {
        let img = elf_with(&[(".text.k", 1, 64, 128), (".nv.global", 8, 1 << 30, 16), (".nv.global.init", 1, 100, 8), (".nv.constant0.k", 1, 400, 4), (".nv.constant3", 1, 10, 4)]);
        assert_eq!(placed_bytes(&img, ImageFormat::Cubin, 90, u64::MAX).unwrap(), (1 << 30) + 510);
        assert!(placed_bytes(b"not an elf", ImageFormat::Cubin, 90, u64::MAX).is_err());
    }

    #[test]
    fn a_fatbin_counts_the_entry_that_places_most() {
        let ptx = b".version 8.0\n.target sm_90\n.address_size 64\n.global .b8 g[4096];\n".to_vec();
        let cubin = elf_with(&[(".nv.global", 8, 1 << 20, 8)]);
        let image = fatbin::build::image(&[fatbin::build::entry(fatbin::KIND_PTX, 90, 0, &ptx, 0), fatbin::build::entry(fatbin::KIND_ELF, 90, 0, &cubin, 0)]);
        assert_eq!(placed_bytes(&image, ImageFormat::Fatbin, 90, u64::MAX).unwrap(), 1 << 20);
        // A cubin for another architecture is not what the driver picks.
        assert_eq!(placed_bytes(&image, ImageFormat::Fatbin, 100, u64::MAX).unwrap(), 4096);
        assert_eq!(placed_bytes(&ptx, ImageFormat::Ptx, 90, u64::MAX).unwrap(), 4096);
    }
}
