//! Generates the protocol's Rust code from its .proto, with protox (a
//! protobuf compiler in Rust) so that no `protoc` need be installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/vkd/provider/v1/provider.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
