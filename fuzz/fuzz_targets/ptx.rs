//! Feeds arbitrary text to the PTX lexer and parser, then runs what parses
//! on a small bounds-checked memory with a small budget and time limit.
//! Any panic, overflow or hang is a bug: tenants and guests send modules.
//! Run with `cargo +nightly fuzz run ptx` from the repo root.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vgpu_ptx::{launch, ExecError, GlobalMem, LaunchConfig, Limits, Module};

const BASE: u64 = 0x7000_0000_0000;

/// One 4 KiB allocation at BASE, bounds-checked like a tenant's view.
struct Flat(Vec<u8>);

impl Flat {
    fn range(&self, addr: u64, n: usize) -> Result<std::ops::Range<usize>, ExecError> {
        let off = addr.checked_sub(BASE).filter(|o| o.checked_add(n as u64).is_some_and(|e| e <= self.0.len() as u64));
        match off {
            Some(o) => Ok(o as usize..o as usize + n),
            None => Err(ExecError::IllegalAddress { kind: "global", addr, len: n, line: 0 }),
        }
    }
}

impl GlobalMem for Flat {
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let r = self.range(addr, out.len())?;
        out.copy_from_slice(&self.0[r]);
        Ok(())
    }
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), ExecError> {
        let r = self.range(addr, data.len())?;
        self.0[r].copy_from_slice(data);
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = Module::signatures(text, 16 << 20);
    let Ok(m) = Module::parse_within(text, 64 << 20) else { return };
    assert!(m.host_bytes() > 0);
    // Every parameter slot points into the allocation, so loads through
    // parameters reach memory as a real kernel's would.
    let params: Vec<u8> = (0..64u64).flat_map(|i| (BASE + (i * 64) % 4096).to_le_bytes()).collect();
    let limits = Limits { budget: 50_000, timeout: Some(Duration::from_millis(200)), ..Limits::default() };
    for k in m.kernels.iter().take(4) {
        let cfg = LaunchConfig { grid: [2, 1, 1], block: [33, 1, 1], dynamic_shared: 64 };
        let _ = launch(k, &cfg, &params, &mut Flat(vec![0; 4096]), &limits);
    }
});
