// Gives the cdylib the soname of the library it stands in for, so programs
// linked against it record `libcuda.so.1` as their dependency, and leaves
// `libcuda.so.1 -> libcuda.so` in the profile directory beside it, the name
// programs load, so `cargo build` alone gives a usable library
// (`LD_LIBRARY_PATH=target/release`).
use std::path::PathBuf;

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
    // OUT_DIR is <profile dir>/build/<package>-<hash>/out.
    let Some(out) = std::env::var_os("OUT_DIR").map(PathBuf::from) else { return };
    let Some(profile_dir) = out.ancestors().nth(3) else { return };
    let link = profile_dir.join("libcuda.so.1");
    if std::fs::symlink_metadata(&link).is_err() {
        // Dangling until the library is linked, a moment later.
        if let Err(e) = std::os::unix::fs::symlink("libcuda.so", &link) {
            println!("cargo:warning=could not create {}: {e}", link.display());
        }
    }
}
