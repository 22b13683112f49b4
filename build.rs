//! Compiles `proto/` with protox, a pure-Rust protobuf compiler, so a fresh machine needs no
//! `protoc`. Generated clients and servers are transport-agnostic: rankgate drives them over its
//! own hyper client and server, which keeps tonic's transport stack out of the build.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/vllm_engine.proto",
        "proto/sglang_scheduler.proto",
        "proto/health.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
