//! Giving memory back after a burst. glibc's allocator keeps what a burst of connections and
//! streams freed inside its arenas, and returns it to the system only from the top of each
//! heap: one long-lived allocation above the freed pages pins them all, so after 5,000
//! concurrent streams the process stayed at its peak RSS for good. A task asks the allocator
//! every few seconds to release the free pages it holds (`malloc_trim`, which releases them
//! wherever they are in the heap), but only once the traffic that grew the heap has gone (a
//! trim takes the arenas' locks, and is pointless while the memory is in use anyway), and for a
//! minute after: the burst's idle connections close over the next seconds (engine connections
//! after the pool's idle timeout, client ones after theirs), each freeing more. A burst is of
//! requests in flight or of client connections open: a flood of idle sockets or half-done
//! handshakes grew the heap by hundreds of megabytes without a single request, and kept it.
//! A fleet's engines count as well: a reload to thousands of engines and back is a burst too.
//!
//! Trimming frees only whole free pages, and glibc's own tuning worked against it: each large
//! block it gave back to the system raised the size from which blocks are mapped apart
//! (`M_MMAP_THRESHOLD`, up to 32 MiB), so the fleet-sized vectors of every snapshot published
//! during a huge fleet went into the arenas, and the small long-lived blocks allocated among
//! them pinned their pages: after a reload to 20,000 engines and back, 33-47 MB resident for 3 MB
//! in use (13 MB before). The threshold is fixed at 1 MiB ([`tune`]): 20 MB after
//! (bench/hostile/huge-fleet.sh, docs/reliability.md). Request bodies under 1 MiB still come
//! from the arenas.

use std::sync::Arc;
use std::time::Duration;

use crate::http::{Door, Shutdown};
use crate::table::Table;

/// How often the task looks.
const EVERY: Duration = Duration::from_secs(5);
/// How long after a burst it keeps trimming.
const AFTER: Duration = Duration::from_secs(75);

/// Trims while the requests in flight and the client connections open on `doors` are well
/// below their high mark since the last trim. Runs until `shutdown`. Does nothing where the
/// allocator is not glibc's.
pub fn spawn(
    table: Arc<Table>,
    doors: Vec<Arc<Door>>,
    mut shutdown: Shutdown,
) -> tokio::task::JoinHandle<()> {
    tune();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut high = 0u64;
        let mut until: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            let (in_flight, engines): (u64, u64) = {
                let snap = table.snapshot.load();
                let n = snap.fleet.workers.iter().map(|w| w.live.in_flight()).sum();
                (n, snap.fleet.engines.len() as u64)
            };
            let connections: u64 = doors.iter().map(|d| d.open() as u64).sum();
            // A request holds a connection too: each counts once per unit of memory it holds.
            // So does an engine (its poller, entry and ranks): a reload from 20,000 engines
            // back to 2 is a burst gone like any other.
            let in_flight = in_flight + connections + engines;
            high = high.max(in_flight);
            let now = tokio::time::Instant::now();
            // A burst is over when what is left in flight is under a quarter of its peak.
            if high > 0 && in_flight <= high / 4 {
                until = Some(now + AFTER);
                high = in_flight;
            }
            match until {
                Some(t) if now <= t => {
                    let freed = tokio::task::spawn_blocking(trim).await.unwrap_or(false);
                    tracing::debug!(
                        in_flight,
                        connections,
                        freed,
                        "allocator trimmed after a burst"
                    );
                }
                _ => until = None,
            }
        }
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() -> bool {
    // SAFETY: malloc_trim only walks and releases the allocator's own free pages.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
}

/// Blocks of 1 MiB and more are mapped apart and unmapped when freed, always (see the module
/// doc), unless the operator tuned the threshold through the environment (glibc reads
/// `MALLOC_MMAP_THRESHOLD_` and `GLIBC_TUNABLES` at start): theirs stands.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune() {
    let tuned = std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("mmap_threshold"));
    if !tuned {
        // SAFETY: mallopt only sets the allocator's parameter; a value it refuses changes nothing.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune() {}

/// See [`tune`].
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: i32 = 1 << 20;
