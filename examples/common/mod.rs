//! For the examples that run the real `rankgate` binary as a child process.

use std::path::PathBuf;
use std::process::Child;

/// The `rankgate` binary built beside this example (target/<profile>/rankgate), or `RANKGATE_BIN`.
pub fn rankgate_binary() -> Result<PathBuf, String> {
    // Another build of the router (say, the one before a change, to compare in one run).
    if let Some(bin) = std::env::var_os("RANKGATE_BIN") {
        return Ok(PathBuf::from(bin));
    }
    std::env::current_exe()
        .map_err(|e| e.to_string())?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("rankgate"))
        .filter(|p| p.exists())
        .ok_or_else(|| "build the router first: cargo build --release --bin rankgate".into())
}

/// The router's process, killed whatever happens to the example.
pub struct Router(pub Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
