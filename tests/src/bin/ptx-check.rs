//! Loads every PTX a library carries the way the CPU reference device
//! would, and reports what its interpreter refuses: which GPU libraries
//! (cuBLAS, cuDNN, CuPy's, PyTorch's) can run there, and what they still
//! need from the interpreter.
//!
//!     ptx-check [--arch 80] [--grep TEXT] FILE...
//!
//! A FILE is a shared library or any file with fatbins in it (each fatbin
//! found by its magic), a lone fatbin, or PTX text. For each fatbin the PTX
//! the device would pick (docs/ptx-subset.md, "Targets") is parsed and
//! decoded; the first error of each that fails is printed, then a count
//! of the errors by construct. Exits 1 if any PTX was refused. `--grep`
//! also prints every PTX line containing TEXT, with its module.

use std::collections::BTreeMap;
use virtio_gpu_compute::fatbin;

/// Fatbins in `data`: every offset where one starts and its length.
fn fatbins(data: &[u8]) -> Vec<&[u8]> {
    let magic = fatbin::FATBIN_MAGIC.to_le_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = data[i..].windows(4).position(|w| w == magic) {
        let at = i + p;
        match fatbin::total_len(&data[at..]) {
            Ok(len) if len >= 16 && at as u64 + len <= data.len() as u64 => {
                out.push(&data[at..at + len as usize]);
                i = at + len as usize;
            }
            _ => i = at + 4,
        }
    }
    out
}

/// The construct an error names: its quoted instruction or the message.
fn construct(msg: &str) -> String {
    match msg.split('\'').nth(1) {
        Some(q) => q.to_string(),
        None => msg.to_string(),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut arch = 80u32;
    let mut grep: Option<String> = None;
    let mut files = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--arch" {
            arch = it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                eprintln!("ptx-check: --arch takes a number such as 80");
                std::process::exit(2)
            });
        } else if a == "--grep" {
            grep = it.next().cloned();
        } else {
            files.push(a.clone());
        }
    }
    if files.is_empty() {
        eprintln!("usage: ptx-check [--arch 80] FILE...");
        std::process::exit(2);
    }
    let (mut ok, mut bad, mut no_ptx) = (0u32, 0u32, 0u32);
    let mut by: BTreeMap<String, u32> = BTreeMap::new();
    for f in &files {
        let data = match std::fs::read(f) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("ptx-check: {f}: {e}");
                std::process::exit(2);
            }
        };
        let texts: Vec<(String, Vec<u8>)> = if data.starts_with(b"//") || data.starts_with(b".version") {
            vec![(f.clone(), data.clone())]
        } else {
            let mut v = Vec::new();
            for (n, fb) in fatbins(&data).into_iter().enumerate() {
                match fatbin::ptx_for_interpreter(fb, arch, u64::MAX) {
                    Ok(Some((ptx, _))) => v.push((format!("{f} fatbin {n}"), ptx)),
                    Ok(None) => no_ptx += 1,
                    Err(e) => {
                        bad += 1;
                        println!("{f} fatbin {n}: {e}");
                        *by.entry(format!("fatbin: {e}")).or_default() += 1;
                    }
                }
            }
            v
        };
        for (name, ptx) in texts {
            let text = String::from_utf8_lossy(ptx.strip_suffix(&[0]).unwrap_or(&ptx)).into_owned();
            if let Some(g) = &grep {
                for (n, line) in text.lines().enumerate().filter(|(_, l)| l.contains(g.as_str())) {
                    println!("{name}:{}: {}", n + 1, line.trim());
                }
            }
            match vgpu_ptx::Module::parse(&text) {
                Ok(_) => ok += 1,
                Err(e) => {
                    bad += 1;
                    println!("{name}: {e}");
                    *by.entry(construct(&e.msg)).or_default() += 1;
                }
            }
        }
    }
    println!("ptx-check: {ok} loaded, {bad} refused, {no_ptx} fatbins without PTX (arch {arch})");
    for (what, n) in &by {
        println!("  {n:6}  {what}");
    }
    std::process::exit(if bad > 0 { 1 } else { 0 });
}
