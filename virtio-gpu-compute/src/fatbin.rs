//! NVIDIA fatbin containers: the `fatbinc` wrapper a host program embeds,
//! the fatbin header, and its entries (PTX text or cubin ELF images, per
//! architecture, optionally LZ4- or zstd-compressed). Parsing is bounded and
//! total: a hostile image gets an error, never a panic or an unbounded
//! allocation.
//!
//! Layout (little-endian), as observed in images `nvcc` and `nvrtc` emit:
//! the header is `{ u32 magic 0xBA55ED50, u16 version, u16 header_size,
//! u64 body_size }`; the body is a sequence of entries, each `{ u16 kind
//! (1 PTX, 2 ELF), u16 version, u32 header_size, u64 payload_size,
//! u32 compressed_size, u32 _, u16 minor, u16 major, u32 arch, u32
//! name_offset, u32 name_len, u64 flags, u64 _, u64 uncompressed_size }`
//! followed by its payload at `header_size`. Flag 0x2000 marks an LZ4
//! block-compressed payload, 0x8000 a zstd frame (CUDA 13 compresses so);
//! the old 0x1000 is recognised and refused. A compressed payload is
//! `compressed_size` bytes long. Flag 0x100000 marks architecture-specific
//! code (`sm_90a`, `compute_90a`) and 0x200000 family-specific code
//! (`sm_100f`): read from cuBLASLt 13.4's fatbins, whose `sm_90a`,
//! `sm_100a`, `sm_100f`, `sm_103f` and `sm_120f` cubins carry them and
//! name themselves so inside.
//!
//! Which entry a device runs follows NVIDIA's compatibility rules: a
//! generic cubin runs on its architecture and later minor versions of the
//! same major (sm_80 on 8.6), a family-specific one likewise (sm_100f on
//! 10.3), an architecture-specific one only on its own; generic PTX is
//! compiled for any later architecture, architecture-specific PTX only
//! for its own, family-specific PTX for its family.

use thiserror::Error;

pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
pub const WRAPPER_MAGIC: u32 = 0x4662_43B1;

pub const KIND_PTX: u16 = 1;
pub const KIND_ELF: u16 = 2;
/// The flags NVIDIA's tools give every entry for a 64-bit Linux host
/// (entries this crate writes carry them).
pub const FLAGS_HOST_64: u64 = 0x11;
const FLAG_LZ4: u64 = 0x2000;
const FLAG_ZSTD: u64 = 0x8000;
const FLAG_OTHER_COMPRESSION: u64 = 0x1000;
const FLAG_ARCH_SPECIFIC: u64 = 0x10_0000;
const FLAG_FAMILY_SPECIFIC: u64 = 0x20_0000;
const ENTRY_MIN_HEADER: usize = 64;
/// No entry decompresses to more than this; callers pass a tighter
/// limit where a budget applies (the device worker: the tenant's host
/// memory budget).
pub const MAX_UNCOMPRESSED: u64 = 256 << 20;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum FatbinError {
    #[error("fatbin is truncated ({0})")]
    Truncated(&'static str),
    #[error("not a fatbin (magic {0:#x})")]
    BadMagic(u32),
    #[error("fatbin entry {index} is malformed: {what}")]
    BadEntry { index: usize, what: &'static str },
    #[error("fatbin entry {index} is compressed in an unknown way (flags {flags:#x})")]
    UnknownCompression { index: usize, flags: u64 },
    #[error("fatbin entry {index} decompresses to {size} bytes, over the limit of {limit}")]
    TooLarge { index: usize, size: u64, limit: u64 },
    #[error("fatbin entry {index} does not decompress: {what}")]
    Decompress { index: usize, what: &'static str },
}

/// What an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Ptx,
    Elf,
    Other(u16),
}

/// Which devices an entry's code is for (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Variant {
    /// `sm_XY`, `compute_XY`.
    Generic,
    /// `sm_XYf`, `compute_XYf`: the architecture's family.
    Family,
    /// `sm_XYa`, `compute_XYa`: that architecture alone.
    Specific,
}

/// One entry of a fatbin, borrowing its payload.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    pub index: usize,
    pub kind: Kind,
    /// Virtual architecture (PTX) or real one (cubin), e.g. 80 for sm_80.
    pub arch: u32,
    pub flags: u64,
    payload: &'a [u8],
    uncompressed: u64,
    /// The whole entry, header and payload, as it stands in the image.
    raw: &'a [u8],
}

impl Entry<'_> {
    pub fn compressed(&self) -> bool {
        self.flags & (FLAG_LZ4 | FLAG_ZSTD) != 0
    }

    pub fn variant(&self) -> Variant {
        if self.flags & FLAG_ARCH_SPECIFIC != 0 {
            Variant::Specific
        } else if self.flags & FLAG_FAMILY_SPECIFIC != 0 {
            Variant::Family
        } else {
            Variant::Generic
        }
    }

    /// Whether a GPU of architecture `dev` (10 × major + minor) runs this
    /// entry: a cubin as it is, PTX once NVIDIA's driver compiles it.
    pub fn runs_on(&self, dev: u32) -> bool {
        let later_in_major = self.arch / 10 == dev / 10 && dev >= self.arch;
        match (self.kind, self.variant()) {
            (Kind::Other(_), _) => false,
            (_, Variant::Specific) => dev == self.arch,
            (_, Variant::Family) | (Kind::Elf, Variant::Generic) => later_in_major,
            (Kind::Ptx, Variant::Generic) => dev >= self.arch,
        }
    }

    /// The entry's contents, decompressed; PTX loses its trailing NULs.
    pub fn contents(&self) -> Result<Vec<u8>, FatbinError> {
        self.contents_within(MAX_UNCOMPRESSED)
    }

    /// [`Entry::contents`], refusing an entry that would decompress to
    /// more than `limit` bytes.
    pub fn contents_within(&self, limit: u64) -> Result<Vec<u8>, FatbinError> {
        let mut data = if self.compressed() {
            if self.uncompressed == 0 {
                return Err(FatbinError::BadEntry { index: self.index, what: "compressed entry states no uncompressed size" });
            }
            if self.uncompressed > MAX_UNCOMPRESSED.min(limit) {
                return Err(FatbinError::TooLarge { index: self.index, size: self.uncompressed, limit: MAX_UNCOMPRESSED.min(limit) });
            }
            let size = self.uncompressed as usize;
            let out = if self.flags & FLAG_ZSTD != 0 { zstd_frame(self.payload, size) } else { lz4_block(self.payload, size) };
            out.map_err(|what| FatbinError::Decompress { index: self.index, what })?
        } else {
            self.payload.to_vec()
        };
        if self.kind == Kind::Ptx {
            while data.last() == Some(&0) {
                data.pop();
            }
            // Padding gone, its memory goes too: what a caller holds is
            // what it measures.
            data.shrink_to_fit();
        }
        Ok(data)
    }
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

/// The whole fatbin's length (header plus body) from its first 16 bytes.
pub fn total_len(head: &[u8]) -> Result<u64, FatbinError> {
    let magic = u32_at(head, 0).ok_or(FatbinError::Truncated("header"))?;
    if magic != FATBIN_MAGIC {
        return Err(FatbinError::BadMagic(magic));
    }
    let hs = u16_at(head, 6).ok_or(FatbinError::Truncated("header"))? as u64;
    let body = u64_at(head, 8).ok_or(FatbinError::Truncated("header"))?;
    hs.checked_add(body).ok_or(FatbinError::Truncated("size overflows"))
}

/// The entries of a fatbin image.
pub fn entries(image: &[u8]) -> Result<Vec<Entry<'_>>, FatbinError> {
    let total = total_len(image)?;
    let hs = u16_at(image, 6).unwrap_or(0) as usize;
    if hs < 16 || total > image.len() as u64 {
        return Err(FatbinError::Truncated("body"));
    }
    let end = total as usize;
    let mut off = hs;
    let mut out = Vec::new();
    while off < end {
        let index = out.len();
        if out.len() >= 4096 {
            return Err(FatbinError::BadEntry { index, what: "too many entries" });
        }
        let e = image.get(off..end).ok_or(FatbinError::Truncated("entry"))?;
        let bad = |what| FatbinError::BadEntry { index, what };
        if e.len() < ENTRY_MIN_HEADER {
            // Trailing padding is allowed; a partial header is not.
            if e.iter().all(|b| *b == 0) {
                break;
            }
            return Err(FatbinError::Truncated("entry header"));
        }
        let kind = match u16_at(e, 0).unwrap_or(0) {
            KIND_PTX => Kind::Ptx,
            KIND_ELF => Kind::Elf,
            k => Kind::Other(k),
        };
        let ehs = u32_at(e, 4).unwrap_or(0) as usize;
        let psz = u64_at(e, 8).unwrap_or(0);
        if ehs < ENTRY_MIN_HEADER || ehs > e.len() {
            return Err(bad("header size"));
        }
        if psz > (e.len() - ehs) as u64 {
            return Err(bad("payload runs past the fatbin"));
        }
        let psz = psz as usize;
        let flags = u64_at(e, 40).unwrap_or(0);
        let compressed_size = u32_at(e, 16).unwrap_or(0) as usize;
        let mut payload = &e[ehs..ehs + psz];
        if flags & (FLAG_LZ4 | FLAG_ZSTD) != 0 && compressed_size > 0 && compressed_size <= psz {
            payload = &payload[..compressed_size];
        }
        // Another compression scheme (the old 0x1000), or two at once, is
        // refused, not misread as a plain payload.
        if flags & FLAG_OTHER_COMPRESSION != 0 || flags & (FLAG_LZ4 | FLAG_ZSTD) == FLAG_LZ4 | FLAG_ZSTD {
            return Err(FatbinError::UnknownCompression { index, flags });
        }
        out.push(Entry { index, kind, arch: u32_at(e, 28).unwrap_or(0), flags, payload, uncompressed: u64_at(e, 56).unwrap_or(0), raw: &e[..ehs + psz] });
        off += ehs + psz;
    }
    Ok(out)
}

/// The best PTX a device of architecture `arch` runs: the newest one it
/// can compile (see [`Entry::runs_on`]), generic before specific at one
/// architecture. `Ok(None)` if the fatbin carries none it runs.
pub fn best_ptx(image: &[u8], arch: u32) -> Result<Option<Vec<u8>>, FatbinError> {
    best_ptx_within(image, arch, MAX_UNCOMPRESSED)
}

/// [`best_ptx`], decompressing at most `limit` bytes.
pub fn best_ptx_within(image: &[u8], arch: u32, limit: u64) -> Result<Option<Vec<u8>>, FatbinError> {
    let es = entries(image)?;
    runnable_ptx(&es, arch).map(|e| e.contents_within(limit)).transpose()
}

fn runnable_ptx<'e, 'a>(es: &'e [Entry<'a>], arch: u32) -> Option<&'e Entry<'a>> {
    // At one architecture the generic PTX goes first: it uses nothing an
    // interpreter may lack (wgmma, tcgen05) and compiles the same.
    es.iter().filter(|e| e.kind == Kind::Ptx && e.runs_on(arch)).max_by_key(|e| (e.arch, std::cmp::Reverse(e.variant())))
}

/// The PTX an interpreting device of architecture `arch` runs: the newest
/// generic one a GPU of that architecture could compile, else the
/// architecture- or family-specific one it would ([`best_ptx`]), else the
/// oldest newer generic one, else the nearest of any other (an interpreter
/// does not depend on the architecture a PTX names; what it cannot run it
/// names in its error). Generic code goes first because it uses nothing an
/// interpreter may lack (wgmma, tcgen05): given `compute_80` and
/// `compute_90a`, a 9.0 device interprets the `compute_80`. The flag says
/// whether the PTX is newer than `arch`.
pub fn ptx_for_interpreter(image: &[u8], arch: u32, limit: u64) -> Result<Option<(Vec<u8>, bool)>, FatbinError> {
    let es = entries(image)?;
    interpreter_ptx(&es, arch).map(|e| e.contents_within(limit).map(|c| (c, e.arch > arch))).transpose()
}

/// The PTX entry [`ptx_for_interpreter`] and [`select`] choose.
fn interpreter_ptx<'e, 'a>(es: &'e [Entry<'a>], arch: u32) -> Option<&'e Entry<'a>> {
    let ptx = || es.iter().filter(|e| e.kind == Kind::Ptx);
    let generic = || ptx().filter(|e| e.variant() == Variant::Generic);
    generic()
        .filter(|e| e.runs_on(arch))
        .max_by_key(|e| e.arch)
        .or_else(|| runnable_ptx(es, arch))
        .or_else(|| generic().filter(|e| e.arch > arch).min_by_key(|e| e.arch))
        .or_else(|| ptx().min_by_key(|e| (e.arch.abs_diff(arch), e.variant())))
}

/// A fatbin holding only what a device of architecture `arch` can use:
/// the cubins of the newest architecture it runs (see [`Entry::runs_on`];
/// NVIDIA's driver picks among them), the PTX a GPU of that architecture
/// compiles ([`best_ptx`]) and the PTX an interpreter takes
/// ([`ptx_for_interpreter`]; mostly the same entry). Entries are copied as
/// they are (still compressed). `Ok(None)` if nothing in the image suits
/// the device.
pub fn select(image: &[u8], arch: u32) -> Result<Option<Vec<u8>>, FatbinError> {
    let es = entries(image)?;
    let ptx = [runnable_ptx(&es, arch), interpreter_ptx(&es, arch)].map(|e| e.map(|e| e.index));
    let cubins = || es.iter().filter(|e| e.kind == Kind::Elf && e.runs_on(arch));
    let newest = cubins().map(|e| e.arch).max();
    let keep: Vec<&Entry<'_>> = es.iter().filter(|e| (e.kind == Kind::Elf && e.runs_on(arch) && Some(e.arch) == newest) || ptx.contains(&Some(e.index))).collect();
    if keep.is_empty() {
        return Ok(None);
    }
    let body: usize = keep.iter().map(|e| e.raw.len()).sum();
    let mut out = Vec::with_capacity(16 + body);
    out.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(&(body as u64).to_le_bytes());
    for e in keep {
        out.extend_from_slice(e.raw);
    }
    Ok(Some(out))
}

/// The highest PTX architecture a fatbin carries, if any.
pub fn ptx_archs(image: &[u8]) -> Result<Vec<u32>, FatbinError> {
    Ok(entries(image)?.iter().filter(|e| e.kind == Kind::Ptx).map(|e| e.arch).collect())
}

/// Decodes one zstd frame of exactly `size` bytes of output. The caller
/// bounds `size`; the frame's window may not exceed it (rounded up to a
/// power of two, at least 1 MiB), so a hostile frame cannot make the
/// decoder hold more than that either.
pub fn zstd_frame(src: &[u8], size: usize) -> Result<Vec<u8>, &'static str> {
    use std::io::Read;
    let window = (size as u64).next_power_of_two().clamp(1 << 20, ruzstd::decoding::DEFAULT_MAX_WINDOW_SIZE);
    let mut dec = ruzstd::decoding::StreamingDecoder::new_with_max_window_size(src, window).map_err(|_| "bad zstd frame header, or a window larger than the entry")?;
    let mut out = Vec::new();
    out.try_reserve_exact(size + 1).map_err(|_| "no memory for the decompressed entry")?;
    (&mut dec).take(size as u64 + 1).read_to_end(&mut out).map_err(|_| "corrupt zstd data")?;
    if out.len() != size {
        return Err("zstd data does not decompress to the size its entry gives");
    }
    Ok(out)
}

/// Decodes one LZ4 block (the raw block format, no frame) of exactly
/// `size` bytes of output.
pub fn lz4_block(src: &[u8], size: usize) -> Result<Vec<u8>, &'static str> {
    let mut out: Vec<u8> = Vec::new();
    // Memory the host cannot give is an error, not an abort.
    out.try_reserve_exact(size).map_err(|_| "no memory for the output")?;
    let mut i = 0usize;
    let read_len = |i: &mut usize, mut n: usize| -> Result<usize, &'static str> {
        if n == 15 {
            loop {
                let b = *src.get(*i).ok_or("length runs past the input")?;
                *i += 1;
                n = n.checked_add(b as usize).ok_or("length overflows")?;
                if b != 255 {
                    break;
                }
            }
        }
        Ok(n)
    };
    while i < src.len() {
        let token = src[i];
        i += 1;
        let lit = read_len(&mut i, (token >> 4) as usize)?;
        let lits = src.get(i..i.checked_add(lit).ok_or("literal length overflows")?).ok_or("literals run past the input")?;
        if lit > size - out.len() {
            return Err("output exceeds the stated size");
        }
        out.extend_from_slice(lits);
        i += lit;
        if i == src.len() {
            break;
        }
        let off = u16_at(src, i).ok_or("match offset runs past the input")? as usize;
        i += 2;
        if off == 0 || off > out.len() {
            return Err("match offset out of range");
        }
        let mlen = read_len(&mut i, (token & 15) as usize)?.checked_add(4).ok_or("match length overflows")?;
        if mlen > size - out.len() {
            return Err("output exceeds the stated size");
        }
        let start = out.len() - off;
        for k in 0..mlen {
            out.push(out[start + k]);
        }
    }
    if out.len() != size {
        return Err("output is shorter than the stated size");
    }
    Ok(out)
}

/// Writing fatbins in the layout [`entries`] reads: for tests and fuzz
/// seeds, and the shim's linker (code it must hand on as a fatbin's).
pub mod build {
    use super::FATBIN_MAGIC;

    /// One entry: its 64-byte header (kind, version 0x101, header size,
    /// padded payload size, payload size, architecture, flags and the
    /// uncompressed size), then the payload padded to 8 bytes.
    pub fn entry(kind: u16, arch: u32, flags: u64, payload: &[u8], uncompressed: u64) -> Vec<u8> {
        let padded = payload.len().next_multiple_of(8);
        let mut e = vec![0u8; 64];
        e[0..2].copy_from_slice(&kind.to_le_bytes());
        e[2..4].copy_from_slice(&0x101u16.to_le_bytes());
        e[4..8].copy_from_slice(&64u32.to_le_bytes());
        e[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
        e[16..20].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        e[28..32].copy_from_slice(&arch.to_le_bytes());
        e[40..48].copy_from_slice(&flags.to_le_bytes());
        e[56..64].copy_from_slice(&uncompressed.to_le_bytes());
        e.extend_from_slice(payload);
        e.resize(64 + padded, 0);
        e
    }

    /// A fatbin of `entries`: the 16-byte header, then the entries.
    pub fn image(entries: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = entries.concat();
        let mut f = Vec::with_capacity(16 + body.len());
        f.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&16u16.to_le_bytes());
        f.extend_from_slice(&(body.len() as u64).to_le_bytes());
        f.extend_from_slice(&body);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use build::{entry, image as fatbin};

    /// "abcabcabcabc!" as an LZ4 block: 3 literals, a 9-byte match at
    /// offset 3, then the last literal.
    const LZ4: &[u8] = &[0x35, b'a', b'b', b'c', 3, 0, 0x10, b'!'];

    #[test]
    fn lz4_decodes_and_refuses_bad_input() {
        assert_eq!(lz4_block(LZ4, 13).unwrap(), b"abcabcabcabc!");
        assert!(lz4_block(LZ4, 12).is_err());
        assert!(lz4_block(LZ4, 14).is_err());
        assert!(lz4_block(&[0x35, b'a', b'b', b'c', 9, 0, 0x10, b'!'], 13).is_err());
        assert!(lz4_block(&[0xF0, 255, 255], 100).is_err());
        assert!(lz4_block(&[0x10], 1).is_err());
    }

    /// PTX padded with NULs (a whole budget of them compresses to a few
    /// bytes) comes back trimmed and holding no more memory than its text,
    /// which is what a caller charges; a compressed entry that states no
    /// size is malformed, not too large.
    #[test]
    fn padded_ptx_is_trimmed_to_its_text_in_memory_too() {
        // "ab\0", then a match at offset 1 copying the NUL 1 MiB over
        // (length 4 + 15 + 255 × k + r), then five NULs as the last
        // literals.
        let extra = (1usize << 20) - 4 - 15;
        let mut block = vec![0x3F, b'a', b'b', 0, 1, 0];
        block.extend(std::iter::repeat_n(255u8, extra / 255));
        block.push((extra % 255) as u8);
        block.extend_from_slice(&[0x50, 0, 0, 0, 0, 0]);
        let size = 3 + (1 << 20) + 5;
        let f = fatbin(&[entry(KIND_PTX, 80, 0x2011, &block, size as u64)]);
        let (text, _) = ptx_for_interpreter(&f, 80, MAX_UNCOMPRESSED).unwrap().unwrap();
        assert_eq!(text, b"ab");
        assert!(text.capacity() < 64, "the trimmed text holds {} bytes", text.capacity());
        let f = fatbin(&[entry(KIND_PTX, 80, 0x2011, &block, 0)]);
        assert!(matches!(ptx_for_interpreter(&f, 80, MAX_UNCOMPRESSED), Err(FatbinError::BadEntry { .. })));
    }

    #[test]
    fn picks_the_best_ptx_and_decompresses() {
        let f = fatbin(&[
            entry(KIND_ELF, 80, 0x11, b"\x7fELF....", 0),
            entry(KIND_PTX, 52, 0x11, b".version 7.0\0\0", 0),
            entry(KIND_PTX, 80, 0x2011, LZ4, 13),
            entry(KIND_PTX, 90, 0x11, b".version 8.0", 0),
        ]);
        assert_eq!(total_len(&f).unwrap() as usize, f.len());
        let es = entries(&f).unwrap();
        assert_eq!(es.len(), 4);
        assert_eq!(es[0].kind, Kind::Elf);
        assert_eq!(best_ptx(&f, 80).unwrap().unwrap(), b"abcabcabcabc!");
        assert_eq!(best_ptx(&f, 75).unwrap().unwrap(), b".version 7.0");
        assert_eq!(best_ptx(&f, 50).unwrap(), None);
        assert_eq!(ptx_archs(&f).unwrap(), vec![52, 80, 90]);
        // Selection keeps the sm_80 cubin and the compute_80 PTX only.
        let sel = select(&f, 80).unwrap().unwrap();
        let kept = entries(&sel).unwrap();
        assert_eq!(kept.iter().map(|e| (e.kind, e.arch)).collect::<Vec<_>>(), vec![(Kind::Elf, 80), (Kind::Ptx, 80)]);
        assert_eq!(best_ptx(&sel, 80).unwrap().unwrap(), b"abcabcabcabc!");
        // Only newer PTX: the oldest of it, flagged as newer.
        let sel = select(&f, 50).unwrap().unwrap();
        assert_eq!(entries(&sel).unwrap().iter().map(|e| (e.kind, e.arch)).collect::<Vec<_>>(), vec![(Kind::Ptx, 52)]);
        assert_eq!(ptx_for_interpreter(&f, 50, MAX_UNCOMPRESSED).unwrap().unwrap(), (b".version 7.0".to_vec(), true));
        assert_eq!(ptx_for_interpreter(&f, 85, MAX_UNCOMPRESSED).unwrap().unwrap(), (b"abcabcabcabc!".to_vec(), false));
        let cubin_only = fatbin(&[entry(KIND_ELF, 90, 0x11, b"\x7fELF", 0)]);
        assert_eq!(select(&cubin_only, 80).unwrap(), None);
    }

    /// The flags and rules of architecture- and family-specific code, as
    /// cuBLASLt 13.4's fatbins carry it (`sm_90a` 0x108011, `sm_100f`
    /// 0x1208011, generic 0x8011 and 0x1008011), less the zstd bit 0x8000.
    #[test]
    fn specific_code_goes_only_where_it_runs() {
        let (a, f, g, g10) = (0x10_0011, 0x120_0011, 0x11, 0x100_0011);
        let kinds = |img: &[u8]| entries(img).unwrap().iter().map(|e| (e.kind, e.arch, e.variant())).collect::<Vec<_>>();
        let f1 = fatbin(&[
            entry(KIND_ELF, 80, g, b"sm_80", 0),
            entry(KIND_ELF, 90, a, b"sm_90a", 0),
            entry(KIND_ELF, 90, g, b"sm_90", 0),
            entry(KIND_ELF, 100, f, b"sm_100f", 0),
            entry(KIND_ELF, 100, g10, b"sm_100", 0),
            entry(KIND_PTX, 80, g, b"compute_80", 0),
            entry(KIND_PTX, 90, a, b"compute_90a", 0),
        ]);
        // A 9.0 device: both sm_90 cubins, the compute_90a a GPU compiles
        // (the newest it runs) and the compute_80 an interpreter takes
        // (generic code first: it needs no wgmma).
        assert_eq!(
            kinds(&select(&f1, 90).unwrap().unwrap()),
            [(Kind::Elf, 90, Variant::Specific), (Kind::Elf, 90, Variant::Generic), (Kind::Ptx, 80, Variant::Generic), (Kind::Ptx, 90, Variant::Specific)]
        );
        assert_eq!(ptx_for_interpreter(&f1, 90, MAX_UNCOMPRESSED).unwrap().unwrap(), (b"compute_80".to_vec(), false));
        // 8.6: sm_80 runs there (a later minor of its major); 8.9 too.
        assert_eq!(kinds(&select(&f1, 86).unwrap().unwrap()), [(Kind::Elf, 80, Variant::Generic), (Kind::Ptx, 80, Variant::Generic)]);
        // 10.3: sm_100f and sm_100 run there, sm_90a does not; nor does
        // compute_90a, so the PTX is compute_80, which NVIDIA's driver
        // compiles for it (the old rule kept compute_90a: no code at all).
        assert_eq!(kinds(&select(&f1, 103).unwrap().unwrap()), [(Kind::Elf, 100, Variant::Family), (Kind::Elf, 100, Variant::Generic), (Kind::Ptx, 80, Variant::Generic)]);
        assert_eq!(best_ptx(&f1, 103).unwrap().unwrap(), b"compute_80");
        assert_eq!(best_ptx(&f1, 90).unwrap().unwrap(), b"compute_90a");
        // 12.0: no cubin of its major; generic PTX only.
        assert_eq!(kinds(&select(&f1, 120).unwrap().unwrap()), [(Kind::Ptx, 80, Variant::Generic)]);
        // An interpreter at 8.0 given only specific or newer PTX still
        // gets the nearest, generic first.
        let f2 = fatbin(&[entry(KIND_PTX, 90, a, b"compute_90a", 0), entry(KIND_PTX, 120, g, b"compute_120", 0)]);
        assert_eq!(ptx_for_interpreter(&f2, 80, MAX_UNCOMPRESSED).unwrap().unwrap(), (b"compute_120".to_vec(), true));
        assert_eq!(best_ptx(&f2, 100).unwrap(), None, "compute_90a is for 9.0 alone; compute_120 is newer");
        let f3 = fatbin(&[entry(KIND_PTX, 90, a, b"compute_90a", 0)]);
        assert_eq!(ptx_for_interpreter(&f3, 100, MAX_UNCOMPRESSED).unwrap().unwrap(), (b"compute_90a".to_vec(), false));
        // Family PTX: its major, this minor or later.
        let f4 = fatbin(&[entry(KIND_PTX, 100, f, b"compute_100f", 0)]);
        assert!(best_ptx(&f4, 103).unwrap().is_some() && best_ptx(&f4, 120).unwrap().is_none() && best_ptx(&f4, 90).unwrap().is_none());
    }

    #[test]
    fn zstd_entries_decompress_within_their_bounds() {
        let ptx = b".version 9.0\n.target sm_120\n.address_size 64\n// a CUDA 13 library's PTX, zstd-compressed\n".repeat(40);
        let z = ruzstd::encoding::compress_to_vec(&ptx[..], ruzstd::encoding::CompressionLevel::Fastest);
        assert!(z.len() < ptx.len());
        let image = fatbin(&[entry(KIND_ELF, 120, 0x8011, b"cubin", 5), entry(KIND_PTX, 120, 0x8011, &z, ptx.len() as u64)]);
        let (got, newer) = ptx_for_interpreter(&image, 80, MAX_UNCOMPRESSED).unwrap().unwrap();
        assert_eq!((&got[..], newer), (&ptx[..], true));
        // The size the entry gives must be the size it decompresses to.
        for wrong in [ptx.len() as u64 - 1, ptx.len() as u64 + 1] {
            let bad = fatbin(&[entry(KIND_PTX, 120, 0x8011, &z, wrong)]);
            assert!(matches!(best_ptx(&bad, 120), Err(FatbinError::Decompress { .. })), "size {wrong}");
        }
        // The caller's limit holds before anything is decoded.
        assert!(matches!(best_ptx_within(&image, 120, 100), Err(FatbinError::TooLarge { .. })));
        // Garbage, a truncated frame and a cut payload are errors.
        for junk in [&b"not a zstd frame at all"[..], &z[..z.len() / 2], &z[..4]] {
            let bad = fatbin(&[entry(KIND_PTX, 120, 0x8011, junk, ptx.len() as u64)]);
            assert!(best_ptx(&bad, 120).is_err());
        }
        assert!(zstd_frame(&z, ptx.len()).is_ok());
    }

    #[test]
    fn hostile_images_are_errors() {
        let good = fatbin(&[entry(KIND_PTX, 80, 0x11, b"x", 0)]);
        for cut in 0..good.len() {
            assert!(entries(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut big = good.clone();
        big[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(entries(&big).is_err());
        let mut e = good.clone();
        e[16 + 8..16 + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(entries(&e).is_err());
        let old = fatbin(&[entry(KIND_PTX, 80, 0x1011, b"x", 1)]);
        assert!(matches!(entries(&old), Err(FatbinError::UnknownCompression { .. })));
        let both = fatbin(&[entry(KIND_PTX, 80, 0xa011, b"x", 1)]);
        assert!(matches!(entries(&both), Err(FatbinError::UnknownCompression { .. })));
        let huge = fatbin(&[entry(KIND_PTX, 80, 0x2011, LZ4, 1 << 40)]);
        assert!(best_ptx(&huge, 80).is_err());
        let big = fatbin(&[entry(KIND_PTX, 80, 0x2011, LZ4, 13)]);
        assert!(matches!(best_ptx_within(&big, 80, 12), Err(FatbinError::TooLarge { .. })));
        assert!(best_ptx_within(&big, 80, 13).is_ok());
        assert_eq!(entries(b"\x50\xed\x55\xbaxxxx").unwrap_err(), FatbinError::Truncated("header"));
    }
}
