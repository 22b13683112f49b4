//! `strftime_now(format)` for chat templates (Llama 3's puts "Today Date: 26 Jul 2024" in the
//! system prompt): the C `strftime` directives templates use, for the current UTC time.
//!
//! UTC because engines run in containers whose local zone is UTC; a router and an engine on
//! different sides of midnight would tokenize that one line differently, which only costs the
//! prefix match after it. Written here rather than taking a date crate for a dozen directives.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `format` applied to the current UTC time.
pub fn now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_unix(format, secs)
}

/// `format` applied to `secs` seconds after the Unix epoch, UTC. Supported: `%Y %y %m %d %e %H
/// %I %M %S %p %b %B %h %a %A %j %%`; any other directive is written as it stands.
pub fn format_unix(format: &str, secs: u64) -> String {
    let days = secs / 86_400;
    let of_day = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (of_day / 3600, of_day % 3600 / 60, of_day % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = ((days + 3) % 7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('j') => out.push_str(&format!("{:03}", day_of_year(year, month, day))),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day): Howard Hinnant's `civil_from_days`.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

fn day_of_year(year: u64, month: u64, day: u64) -> u64 {
    const BEFORE: [u64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let leap = (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400);
    BEFORE[(month - 1) as usize] + day + u64::from(leap && month > 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        // 2024-07-26 14:05:09 UTC, a Friday (Llama 3.1's example date).
        let secs = 1_722_002_709;
        assert_eq!(format_unix("%d %b %Y", secs), "26 Jul 2024");
        assert_eq!(
            format_unix("%A %B %e %H:%M:%S %I%p %j %y %%", secs),
            "Friday July 26 14:05:09 02PM 208 24 %"
        );
        assert_eq!(format_unix("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        // A leap day, and an unknown directive kept.
        assert_eq!(
            format_unix("%Y-%m-%d %j %Q", 951_782_400),
            "2000-02-29 060 %Q"
        );
    }
}
