//! What the DNS discovery tests share: the discovery's lookup interval and the longest wait for it.

use std::time::Duration;

pub const INTERVAL: Duration = Duration::from_millis(100);
/// The longest any test waits for something that should happen.
pub const WAIT: Duration = Duration::from_secs(5);
