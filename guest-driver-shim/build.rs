// Gives the cdylib the soname of the library it stands in for, so programs
// linked against it record `libcuda.so.1` as their dependency.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
