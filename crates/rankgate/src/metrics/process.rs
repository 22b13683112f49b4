//! The standard `process_*` series (CPU, memory, file descriptors, start time), read from
//! `/proc/self` at scrape time, under the names every Prometheus client library uses so that
//! existing dashboards and alerts work unchanged. Linux only: elsewhere the collector writes
//! nothing, and a file that cannot be read leaves out its series rather than failing the page.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
#[cfg(target_os = "linux")]
use prometheus_client::encoding::EncodeMetric;
#[cfg(target_os = "linux")]
use prometheus_client::metrics::counter::ConstCounter;
#[cfg(target_os = "linux")]
use prometheus_client::metrics::gauge::ConstGauge;

#[derive(Debug, Default)]
pub(super) struct Process;

/// What `/proc/self/stat` says of the process.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
#[derive(Debug, PartialEq)]
struct Stat {
    cpu_ticks: u64,
    threads: u64,
    start_ticks: u64,
    virtual_bytes: u64,
    resident_pages: u64,
}

/// Parses `/proc/self/stat`. The command name (field 2) is in parentheses and may hold spaces
/// or parentheses itself, so the fields are counted from the last `)`.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name.
    let f: Vec<&str> = rest.split_ascii_whitespace().collect();
    let field = |n: usize| -> Option<u64> { f.get(n - 3)?.parse().ok() };
    Some(Stat {
        cpu_ticks: field(14)? + field(15)?,
        threads: field(20)?,
        start_ticks: field(22)?,
        virtual_bytes: field(23)?,
        resident_pages: field(24)?,
    })
}

/// The boot time in seconds since the epoch (`btime` of `/proc/stat`).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

impl Collector for Process {
    #[cfg(not(target_os = "linux"))]
    fn encode(&self, _: DescriptorEncoder) -> fmt::Result {
        Ok(())
    }

    #[cfg(target_os = "linux")]
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        use prometheus_client::metrics::MetricType::{Counter, Gauge};
        // SAFETY: sysconf only reads configuration values.
        let (tick, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let (tick, page) = (tick.max(1) as f64, page.max(0) as u64);
        if let Some(stat) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|t| parse_stat(&t))
        {
            let m = enc.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                Counter,
            )?;
            ConstCounter::new(stat.cpu_ticks as f64 / tick).encode(m)?;
            let m = enc.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                None,
                Gauge,
            )?;
            ConstGauge::new((stat.resident_pages * page) as i64).encode(m)?;
            let m = enc.encode_descriptor(
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                None,
                Gauge,
            )?;
            ConstGauge::new(stat.virtual_bytes as i64).encode(m)?;
            let m = enc.encode_descriptor(
                "process_threads",
                "Number of OS threads in the process.",
                None,
                Gauge,
            )?;
            ConstGauge::new(stat.threads as i64).encode(m)?;
            let boot = std::fs::read_to_string("/proc/stat")
                .ok()
                .and_then(|t| parse_boot_time(&t));
            if let Some(boot) = boot {
                let m = enc.encode_descriptor(
                    "process_start_time_seconds",
                    "Start time of the process since unix epoch in seconds.",
                    None,
                    Gauge,
                )?;
                ConstGauge::new(boot as f64 + stat.start_ticks as f64 / tick).encode(m)?;
            }
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            let m = enc.encode_descriptor(
                "process_open_fds",
                "Number of open file descriptors.",
                None,
                Gauge,
            )?;
            // The directory's own descriptor, open while it is read, is one of them.
            ConstGauge::new(fds.count().saturating_sub(1) as i64).encode(m)?;
        }
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given and nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            let m = enc.encode_descriptor(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                None,
                Gauge,
            )?;
            ConstGauge::new(limit.rlim_cur.min(i64::MAX as u64) as i64).encode(m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_end_of_the_name() {
        let line = "4242 (rank gate) (x)) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 7 0 12345 \
                    1048576 300 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                cpu_ticks: 300,
                threads: 7,
                start_ticks: 12345,
                virtual_bytes: 1048576,
                resident_pages: 300,
            })
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_read() {
        let text = std::fs::read_to_string("/proc/self/stat").unwrap();
        let stat = parse_stat(&text).unwrap();
        assert!(stat.threads >= 1 && stat.resident_pages > 0);
    }
}
