//! The configuration each router of a run starts with: its listeners, the variant's `[routing]`
//! (and, with `+flow`, the scenario's `[flow]` table as written), the telemetry cadence, the
//! fleet's engines as the run started them, and the scenario's `[[routes]]` as written.
//!
//! The `[flow]` table is passed through without being read here, so the scenario file follows
//! whatever keys the router's flow control takes. It is written back as TOML text by a small
//! emitter below: the `toml` crate is built without its serializer in this workspace.

use std::fmt::Write as _;

use toml::{Table, Value};

use super::{Scenario, Variant};
use crate::sim::PdRole;

/// One engine as the run started it.
pub(super) struct Started {
    /// `url = "..."` or `grpc_url = "..."`.
    pub(super) url_line: String,
    pub(super) role: Option<PdRole>,
    /// An SGLang prefill server's bootstrap port.
    pub(super) bootstrap_port: Option<u16>,
}

/// The router configuration for `variant` in front of `engines`.
pub(super) fn router_toml(
    s: &Scenario,
    variant: Variant,
    engines: &[Started],
) -> Result<String, String> {
    let mut toml = format!(
        // `expose_worker = "url"`: the load client reads which rank served each request from
        // `x-rankgate-worker`, which a router tells no client by default.
        // `max_streams_per_client`: the load client, one address, stands for many clients.
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n\
         max_streams_per_client = 1000000\n{}\
         {}\
         [telemetry]\ninterval = \"{}ms\"\nstale_after = \"{}ms\"\n",
        if s.workload.grpc {
            "grpc_listen = \"127.0.0.1:0\"\n"
        } else {
            ""
        },
        variant.routing_toml(),
        s.router.interval.0.as_millis(),
        s.router.stale_after.0.as_millis()
    );
    for (e, spec) in engines.iter().zip(&s.engines) {
        let _ = write!(
            toml,
            "[[engines]]\n{}\nflavor = \"{}\"\ndp_size = {}\n",
            e.url_line,
            spec.flavor.as_str(),
            spec.dp_size,
        );
        if let Some(role) = e.role {
            let _ = writeln!(toml, "role = \"{}\"", super::run::role_name(role));
        }
        // The engines' --max-loras, for adapter affinity's free slots.
        if spec.serves_adapters() {
            let _ = writeln!(toml, "max_loras = {}", spec.max_loras_or_default());
        }
        // An SGLang prefill server's decode peers reach it on its bootstrap port.
        if let Some(port) = e.bootstrap_port {
            let _ = writeln!(toml, "bootstrap_port = {port}");
        }
        // A member of a multi-server deployment says so; an independent server needs nothing.
        if let Some(group) = &spec.dp_group {
            let _ = write!(
                toml,
                "dp_group = \"{group}\"\nstart_rank = {}\n",
                spec.start_rank
            );
        }
    }
    if variant.kv_events() {
        // The engines' model, tokenized as they tokenize it (`sim::model`).
        let dir = crate::sim::model::tiny_model_dir()?;
        let _ = write!(
            toml,
            "[[models]]\nname = \"{}\"\ntokenizer = {:?}\n",
            crate::sim::DEFAULT_MODEL,
            dir.display().to_string()
        );
    }
    for route in &s.routes {
        toml.push_str("[[routes]]\n");
        write_body(&mut toml, "routes", route);
    }
    // Without `+flow` the router gets no `[flow]` section at all, as a router before flow
    // control had none.
    if let Some(flow) = s.flow.as_ref().filter(|_| variant.flow) {
        toml.push_str(&flow_section(flow));
    }
    Ok(toml)
}

/// `table` as the router's `[flow]` section: its plain keys first, then its sub-tables and
/// arrays of tables (`[flow.x]`, `[[flow.objectives]]`), each under its full path.
pub fn flow_section(table: &Table) -> String {
    let mut out = String::new();
    write_table(&mut out, "flow", table);
    out
}

fn write_table(out: &mut String, path: &str, table: &Table) {
    let _ = writeln!(out, "[{path}]");
    write_body(out, path, table);
}

/// Plain keys, then what needs a header of its own: TOML reads every key after a header as the
/// header's, so a table's plain keys must come before its first sub-table.
fn write_body(out: &mut String, path: &str, table: &Table) {
    let tables_array =
        |v: &Value| matches!(v, Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_table));
    for (k, v) in table {
        if !v.is_table() && !tables_array(v) {
            let _ = writeln!(out, "{} = {}", key(k), inline(v));
        }
    }
    for (k, v) in table {
        let sub = format!("{path}.{}", key(k));
        match v {
            Value::Table(t) => write_table(out, &sub, t),
            Value::Array(a) if tables_array(v) => {
                for t in a.iter().filter_map(Value::as_table) {
                    let _ = writeln!(out, "[[{sub}]]");
                    write_body(out, &sub, t);
                }
            }
            _ => {}
        }
    }
}

/// A key bare when TOML allows it, quoted otherwise.
fn key(k: &str) -> String {
    let bare = !k.is_empty()
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        k.to_string()
    } else {
        string(k)
    }
}

/// A TOML basic string.
fn string(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\t' => o.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(o, "\\u{:04X}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// A value on one line (arrays and tables inline).
fn inline(v: &Value) -> String {
    match v {
        Value::String(s) => string(s),
        Value::Integer(i) => i.to_string(),
        Value::Float(f) if f.is_nan() => "nan".into(),
        Value::Float(f) if f.is_infinite() => (if *f > 0.0 { "inf" } else { "-inf" }).into(),
        // `{:?}` keeps the point (`1.0`), which tells TOML it is a float.
        Value::Float(f) => format!("{f:?}"),
        Value::Boolean(b) => b.to_string(),
        Value::Datetime(d) => d.to_string(),
        Value::Array(a) => format!("[{}]", a.iter().map(inline).collect::<Vec<_>>().join(", ")),
        Value::Table(t) => format!(
            "{{ {} }}",
            t.iter()
                .map(|(k, v)| format!("{} = {}", key(k), inline(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOW: &str = r#"
name = "f"
policies = ["least_kv", "least_kv+flow", "least_kv+affinity+flow"]
[[engines]]
flavor = "vllm"
dp_size = 2
[workload]
duration = "5s"
requests = 10
prompt_tokens = 100
output_tokens = 8
[[workload.tenants]]
name = "a"
rate = 5
[flow]
enabled = true
max_running = 4
"odd key" = "a \"quoted\"\nline"
weights = [1.5, 2.0]
window = { start = 1, end = 2 }
[flow.queue]
capacity = 100
[[flow.objectives]]
name = "interactive"
priority = 100
[[flow.objectives]]
name = "batch"
priority = -10
"#;

    fn engines() -> Vec<Started> {
        vec![Started {
            url_line: "url = \"http://127.0.0.1:1\"".into(),
            role: None,
            bootstrap_port: None,
        }]
    }

    #[test]
    fn flow_goes_to_the_router_only_with_plus_flow_and_as_written() {
        let s = Scenario::parse(FLOW, None).unwrap();
        let plain = router_toml(&s, s.policies[0], &engines()).unwrap();
        assert!(!plain.contains("flow"), "{plain}");
        for v in &s.policies[1..] {
            let text = router_toml(&s, *v, &engines()).unwrap();
            let parsed: Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(
                parsed.get("flow"),
                s.flow.as_ref().map(|f| Value::Table(f.clone())).as_ref(),
                "{text}"
            );
            assert_eq!(parsed["routing"]["policy"].as_str(), Some("least_kv"));
            assert_eq!(parsed["engines"][0]["dp_size"].as_integer(), Some(2));
        }
        let with_affinity = router_toml(&s, s.policies[2], &engines()).unwrap();
        assert!(
            with_affinity.contains("prefix_affinity = true"),
            "{with_affinity}"
        );
        assert!(
            with_affinity.contains("[[flow.objectives]]\nname = \"batch\"\npriority = -10\n"),
            "{with_affinity}"
        );
    }

    #[test]
    fn routes_go_to_every_variants_router_as_written() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/scenarios/canary.toml"
        ))
        .unwrap();
        let s = Scenario::parse(&text, None).unwrap();
        let toml = router_toml(&s, s.policies[0], &engines()).unwrap();
        let cfg =
            rankgate::config::Config::from_str(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
        let route = cfg.routes.get("chat").unwrap();
        let weights: Vec<(&str, u32)> = (route.targets.iter())
            .map(|t| (&*t.model, t.weight))
            .collect();
        assert_eq!(weights, [("tiny-llama", 90), ("chat-v2", 10)]);
    }

    #[test]
    fn a_flow_variant_needs_a_flow_table() {
        let without = FLOW.split("[flow]").next().unwrap_or_default();
        let e = Scenario::parse(without, None).unwrap_err();
        assert!(e.contains("least_kv+flow") && e.contains("[flow]"), "{e}");
        let only_plain = without.replace(", \"least_kv+flow\", \"least_kv+affinity+flow\"", "");
        assert!(Scenario::parse(&only_plain, None).is_ok());
    }
}
