//! Compiles `proto/` with protox, a pure-Rust protobuf compiler, so a fresh machine needs no
//! `protoc`. Generated clients and servers are transport-agnostic: rankgate drives them over its
//! own hyper client and server, which keeps tonic's transport stack out of the build.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let files = [
        proto.join("vllm_engine.proto"),
        proto.join("sglang_scheduler.proto"),
        proto.join("health.proto"),
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&proto])?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
