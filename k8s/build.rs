//! Compiles the kubelet's gRPC definitions (proto/, copied from
//! k8s.io/kubelet) into Rust: the messages, the plugin's servers and the
//! clients a stand-in kubelet uses in tests.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/deviceplugin/v1beta1/api.proto", "proto/podresources/v1/api.proto", "proto/dra/v1/api.proto", "proto/pluginregistration/v1/api.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
