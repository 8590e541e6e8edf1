//! The GPUs the double plays, from `VGPU_TESTDRIVER_GPUS`, and how CUDA
//! and NVML name them.

/// Describes the GPUs: comma-separated, each `SIZE` (its memory, such as
/// `16GiB` or `512MiB`) optionally followed by `/migN` (MIG mode on, N
/// equal instances). Example: `16GiB,80GiB/mig2`.
pub const GPUS_ENV: &str = "VGPU_TESTDRIVER_GPUS";

/// Streaming multiprocessors of a whole GPU (an H100 SXM's count).
pub const SMS: u32 = 132;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub memory: u64,
    pub migs: u32,
}

/// A device CUDA can open: a whole GPU, or one MIG instance of one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub gpu: usize,
    pub mig: Option<u32>,
    pub memory: u64,
    pub sms: u32,
    pub uuid: [u8; 16],
    pub name: String,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (n, unit) = if let Some(n) = s.strip_suffix("GiB") {
        (n, 1u64 << 30)
    } else if let Some(n) = s.strip_suffix("MiB") {
        (n, 1u64 << 20)
    } else {
        return Err(format!("size '{s}' needs a unit (MiB or GiB)"));
    };
    let n: u64 = n.parse().map_err(|_| format!("size '{s}' is not a whole number of {}", &s[n.len()..]))?;
    match n.checked_mul(unit) {
        Some(b) if b > 0 && b <= 1 << 40 => Ok(b),
        _ => Err(format!("size '{s}' is out of range (1MiB to 1024GiB)")),
    }
}

pub fn parse_gpus(s: &str) -> Result<Vec<Gpu>, String> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim) {
        let (size, migs) = match item.split_once('/') {
            Some((size, m)) => {
                let n = m.strip_prefix("mig").and_then(|n| n.parse::<u32>().ok()).filter(|n| (1..=7).contains(n));
                (size, n.ok_or_else(|| format!("'{m}' is not migN with N from 1 to 7"))?)
            }
            None => (item, 0),
        };
        out.push(Gpu { memory: parse_size(size)?, migs });
    }
    if out.len() > 8 {
        return Err("at most 8 GPUs".into());
    }
    Ok(out)
}

fn uuid_of(gpu: usize, mig: Option<u32>) -> [u8; 16] {
    let mut u = *b"vgpu-testdrv\0\0\0\0";
    u[12] = gpu as u8;
    u[13] = mig.map_or(0, |m| m as u8 + 1);
    u
}

/// NVML's and CUDA_VISIBLE_DEVICES's spelling: `GPU-8-4-4-4-12` hex digits.
pub fn uuid_text(prefix: &str, u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

impl Device {
    pub fn uuid_text(&self) -> String {
        uuid_text(if self.mig.is_some() { "MIG" } else { "GPU" }, &self.uuid)
    }

    /// The PCI address NVML reports (its 8-digit domain form).
    pub fn nvml_bus_id(gpu: usize) -> String {
        format!("00000000:{:02X}:00.0", 0x10 + gpu)
    }
}

/// Every device: each GPU without MIG whole, and each MIG instance.
pub fn devices_of(gpus: &[Gpu]) -> Vec<Device> {
    let mut out = Vec::new();
    for (i, g) in gpus.iter().enumerate() {
        if g.migs == 0 {
            out.push(Device { gpu: i, mig: None, memory: g.memory, sms: SMS, uuid: uuid_of(i, None), name: "NVIDIA test double (vgpu-testdriver)".into() });
            continue;
        }
        for m in 0..g.migs {
            let memory = g.memory / g.migs as u64;
            out.push(Device {
                gpu: i,
                mig: Some(m),
                memory,
                sms: SMS / g.migs,
                uuid: uuid_of(i, Some(m)),
                name: format!("NVIDIA test double (vgpu-testdriver) MIG {}g.{}gb", 7 / g.migs, memory >> 30),
            });
        }
    }
    out
}

/// CUDA's device order under `CUDA_VISIBLE_DEVICES`: unset, every device;
/// set, its entries in order (an index or a UUID prefix), stopping at the
/// first that names nothing, as CUDA does.
pub fn visible(devices: &[Device], env: Option<&str>) -> Vec<usize> {
    let Some(env) = env else { return (0..devices.len()).collect() };
    let mut out = Vec::new();
    for e in env.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let hit = if let Ok(i) = e.parse::<usize>() { (i < devices.len()).then_some(i) } else { devices.iter().position(|d| d.uuid_text().starts_with(e)) };
        match hit {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_parse_with_sizes_and_mig_counts() {
        assert_eq!(parse_gpus("16GiB").unwrap(), vec![Gpu { memory: 16 << 30, migs: 0 }]);
        assert_eq!(parse_gpus("512MiB, 80GiB/mig2").unwrap(), vec![Gpu { memory: 512 << 20, migs: 0 }, Gpu { memory: 80 << 30, migs: 2 }]);
        for bad in ["", "16", "16GB", "0MiB", "x GiB", "16GiB/mig0", "16GiB/mig8", "16GiB/2", "2048GiB"] {
            assert!(parse_gpus(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn visible_devices_follow_cuda_visible_devices() {
        let d = devices_of(&parse_gpus("16GiB,80GiB/mig2").unwrap());
        assert_eq!(d.len(), 3);
        assert!(d[0].uuid_text().starts_with("GPU-"), "{}", d[0].uuid_text());
        assert!(d[2].uuid_text().starts_with("MIG-"));
        assert_eq!(d[1].memory, 40 << 30);
        assert_eq!(visible(&d, None), vec![0, 1, 2]);
        assert_eq!(visible(&d, Some("")), Vec::<usize>::new());
        assert_eq!(visible(&d, Some(&d[2].uuid_text())), vec![2]);
        assert_eq!(visible(&d, Some(&d[1].uuid_text()[..20])), vec![1]);
        assert_eq!(visible(&d, Some("2,0")), vec![2, 0]);
        // An entry that names nothing ends the list.
        assert_eq!(visible(&d, Some("1,GPU-ffff,0")), vec![1]);
    }
}
