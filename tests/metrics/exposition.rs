//! A strict checker of the Prometheus text format (0.0.4): metric and label names, samples, and
//! families (each `# TYPE` once, before its samples), and promtool's own check.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::{Command, Stdio};

fn is_metric_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || c == b':')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

fn is_label_name(s: &str) -> bool {
    let mut b = s.bytes();
    !s.starts_with("__")
        && b.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// One sample line: its name, labels (in order) and value.
type Sample = (String, Vec<(String, String)>, f64);

/// `name{a="x",b="y"} value` split into its name, labels (in order) and value.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut r = r;
        loop {
            if let Some(after) = r.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = r.find('=').ok_or("label without =")?;
            let key = &r[..eq];
            let mut chars = r[eq + 1..]
                .strip_prefix('"')
                .ok_or("unquoted label value")?
                .chars();
            let mut value = String::new();
            loop {
                match chars.next().ok_or("unterminated label value")? {
                    '"' => break,
                    '\\' => match chars.next() {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => return Err(format!("bad escape \\{other:?}")),
                    },
                    '\n' => return Err("raw newline in label value".into()),
                    c => value.push(c),
                }
            }
            labels.push((key.to_string(), value));
            r = chars.as_str();
            r = r.strip_prefix(',').unwrap_or(r);
        }
    }
    let value = rest.strip_prefix(' ').ok_or("no space before the value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().map_err(|e| format!("value {v:?}: {e}"))?,
    };
    Ok((name.to_string(), labels, value))
}

/// Checks `page` as the Prometheus text format with promtool's lint rules: every family has one
/// HELP and one TYPE before its samples, which are contiguous; names and labels are well
/// formed, no series twice; counters end in `_total` and never go negative; histograms have
/// sorted, cumulative buckets ending in `+Inf` equal to `_count`, and a `_sum`. Returns the
/// families and their types.
pub fn check_exposition(page: &str) -> HashMap<String, String> {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut helped: HashSet<String> = HashSet::new();
    let mut done: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut seen: HashSet<String> = HashSet::new();
    // Per histogram series (labels without `le`): buckets, sum, count.
    type Hist = (Vec<(f64, f64)>, Option<f64>, Option<f64>);
    let mut hists: HashMap<String, Hist> = HashMap::new();
    assert!(page.ends_with('\n'), "the page ends with a newline");
    for (n, line) in page.lines().enumerate() {
        let fail = |why: &str| -> ! { panic!("line {}: {why}: {line:?}", n + 1) };
        if line.is_empty() {
            fail("empty line");
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest
                .split_once(' ')
                .unwrap_or_else(|| fail("HELP without text"));
            if !is_metric_name(name) || help.trim().is_empty() {
                fail("bad HELP");
            }
            if !helped.insert(name.to_string()) || done.contains(name) {
                fail("second HELP");
            }
            if let Some(c) = current.replace(name.to_string()) {
                if c != name {
                    done.insert(c);
                }
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest
                .split_once(' ')
                .unwrap_or_else(|| fail("TYPE without type"));
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty) {
                fail("unknown type");
            }
            if current.as_deref() != Some(name) || types.contains_key(name) {
                fail("TYPE not right after its HELP, or twice");
            }
            if ty == "counter" && !name.ends_with("_total") {
                fail("counter not named _total");
            }
            if ty != "counter" && name.ends_with("_total") {
                fail("_total on a non-counter");
            }
            types.insert(name.to_string(), ty.to_string());
            continue;
        }
        if line.starts_with('#') {
            fail("comment that is not HELP or TYPE");
        }
        let (name, labels, value) = parse_sample(line).unwrap_or_else(|e| fail(&e));
        let family = current
            .clone()
            .unwrap_or_else(|| fail("sample before any HELP"));
        let ty = types
            .get(&family)
            .unwrap_or_else(|| fail("sample before its TYPE"));
        let suffix = name
            .strip_prefix(family.as_str())
            .unwrap_or_else(|| fail("sample outside its family"));
        let ok = match ty.as_str() {
            "histogram" => ["_bucket", "_sum", "_count"].contains(&suffix),
            _ => suffix.is_empty(),
        };
        if !ok || !is_metric_name(&name) {
            fail("sample name does not fit its family");
        }
        let mut keys = HashSet::new();
        for (k, _) in &labels {
            if !is_label_name(k) || !keys.insert(k.clone()) {
                fail("bad or repeated label name");
            }
        }
        let mut sorted = labels.clone();
        sorted.sort();
        if !seen.insert(format!("{name}{sorted:?}")) {
            fail("series twice");
        }
        if ty == "counter" && (value.is_nan() || value < 0.0) {
            fail("negative counter");
        }
        if ty == "histogram" {
            let key: Vec<_> = sorted.iter().filter(|(k, _)| k != "le").collect();
            let h = hists.entry(format!("{family}{key:?}")).or_default();
            match suffix {
                "_bucket" => {
                    let le = labels
                        .iter()
                        .find(|(k, _)| k == "le")
                        .unwrap_or_else(|| fail("bucket without le"));
                    let le = match le.1.as_str() {
                        "+Inf" => f64::INFINITY,
                        v => v.parse().unwrap_or_else(|_| fail("bad le")),
                    };
                    h.0.push((le, value));
                }
                "_sum" => h.1 = Some(value),
                _ => h.2 = Some(value),
            }
        }
    }
    for name in &helped {
        assert!(types.contains_key(name), "{name} has HELP but no TYPE");
    }
    for (series, (buckets, sum, count)) in &hists {
        let count = count.unwrap_or_else(|| panic!("{series}: no _count"));
        assert!(sum.is_some(), "{series}: no _sum");
        assert!(
            buckets
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
            "{series}: buckets not sorted and cumulative: {buckets:?}"
        );
        let last = buckets
            .last()
            .unwrap_or_else(|| panic!("{series}: no buckets"));
        assert_eq!(last.0, f64::INFINITY, "{series}: no +Inf bucket");
        assert_eq!(last.1, count, "{series}: +Inf bucket != _count");
    }
    types
}

/// `promtool check metrics` on `page`: no complaint at all.
pub fn promtool(page: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("promtool: {e} (install the Debian package prometheus)"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(page.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics:\n{said}\n{page}"
    );
}
