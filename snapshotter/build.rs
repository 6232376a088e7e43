//! Generates the containerd snapshots gRPC bindings (client and server) from
//! `proto/` with protoc (Debian's `protobuf-compiler`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().compile_protos(
        &[
            "proto/containerd/types/mount.proto",
            "proto/containerd/services/snapshots/v1/snapshots.proto",
        ],
        &["proto"],
    )?;
    Ok(())
}
