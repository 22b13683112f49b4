//! The client tools a user runs against rankgate or an engine, as `rankgate` subcommands: the
//! load client and scenario runner (`rankgate load`), the openai SDK's first requests
//! (`rankgate openai-client`) and one gRPC call (`rankgate grpc-client`).
//!
//! They are subcommands rather than cargo examples so that they are built once, with the
//! binary's own features: an example builds with the dev-dependencies, whose features change
//! those of crates the router shares with them, so `cargo run --example` compiled the router
//! library a second time (with fat LTO) after the demo's build.

pub mod grpc;
pub mod load;
pub mod openai;

/// The admin token from `--admin-token`, else the `RANKGATE_ADMIN_TOKEN` variable (as the
/// deployment's manifests name it); an empty one is none.
pub fn admin_token(flag: Option<String>) -> Option<String> {
    flag.or_else(|| std::env::var("RANKGATE_ADMIN_TOKEN").ok())
        .filter(|t| !t.is_empty())
}

/// Errors of a tool: printed by the binary after the subcommand's name.
pub type ToolResult = Result<(), String>;
