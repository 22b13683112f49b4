//! The Grafana dashboard (`deploy/grafana/rankgate.json`) checked against the metrics rankgate
//! really serves: a router in front of a simulated engine carries streamed and plain requests,
//! its admin `/metrics` is scraped, and every PromQL expression of the dashboard (panel targets,
//! nested rows included, and the template variables' `label_values`) is read by a small PromQL
//! reader that follows labels through selectors, aggregations, functions and vector matching.
//! Each metric must be a family of the page (`# TYPE`), each label a selector matches, an
//! aggregation keeps or a match joins on must exist where it is used, and each `{{label}}` of a
//! legend must survive to the series the legend names. The JSON itself must give every panel a
//! unique id and the `${datasource}` variable. promtool parses every expression too, in a test
//! ignored without it (`.ci/run` installs promtool and runs it).
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::Command;

use http::StatusCode;
use http_body_util::BodyExt;
use rankgate_sim::sim::SimFlavor;
use serde_json::Value;

use common::*;

const DASHBOARD: &str = "deploy/grafana/rankgate.json";
const DATASOURCE: &str = "${datasource}";

/// Families of the page the dashboard leaves out on purpose; every other family must be on it.
const NOT_ON_THE_DASHBOARD: &[&str] = &[
    // The complement of rankgate_rank_telemetry_state{state="unavailable"}, which has the reason.
    "rankgate_rank_telemetry_available",
];

/// Labels Prometheus adds to every series it scrapes: legends may name them while an expression
/// keeps them, but selectors and aggregations must use what the page itself has.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

fn dashboard() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(DASHBOARD);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

/// Every panel, those inside collapsed rows included.
fn panels(dash: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    out
}

/// Each query: (where it is, PromQL, legend format; empty where the legend is not a format).
fn queries(dash: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for p in panels(dash) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let at = format!("panel {} {:?} target {}", p["id"], p["title"], t["refId"]);
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("{at}: no expr"));
            let legend = match (t["format"].as_str(), t["legendFormat"].as_str()) {
                (Some("table"), _) | (_, None | Some("__auto")) => "",
                (_, Some(l)) => l,
            };
            out.push((at, expr.to_string(), legend.to_string()));
        }
    }
    out
}

/// The template variables, by name.
fn variables(dash: &Value) -> HashMap<String, &Value> {
    let list = dash["templating"]["list"]
        .as_array()
        .expect("templating.list");
    list.iter()
        .map(|v| (v["name"].as_str().expect("variable name").to_string(), v))
        .collect()
}

/// A query variable's query (Grafana writes it as a string or as `{"query": ...}`).
fn variable_query(v: &Value) -> &str {
    v["query"]
        .as_str()
        .or_else(|| v["query"]["query"].as_str())
        .unwrap_or_else(|| panic!("variable without a query: {v}"))
}

#[test]
fn every_panel_has_a_unique_id_the_datasource_variable_and_a_description() {
    let dash = dashboard();
    assert!(dash["schemaVersion"].as_u64().is_some_and(|v| v >= 36));
    let mut ids = BTreeSet::new();
    for p in panels(&dash) {
        let id = p["id"].as_u64().unwrap_or_else(|| panic!("no id: {p}"));
        assert!(ids.insert(id), "panel id {id} twice");
        let title = &p["title"];
        assert_eq!(p["datasource"]["uid"], DATASOURCE, "panel {title}");
        assert_eq!(p["datasource"]["type"], "prometheus", "panel {title}");
        let g = &p["gridPos"];
        let (x, w) = (g["x"].as_u64().unwrap(), g["w"].as_u64().unwrap());
        assert!(
            x + w <= 24 && g["h"].as_u64().unwrap() > 0,
            "panel {title}: {g}"
        );
        if p["type"] == "row" {
            continue;
        }
        let desc = p["description"].as_str().unwrap_or("");
        assert!(desc.len() > 40, "panel {title}: say what to look for");
        let targets = p["targets"].as_array().filter(|t| !t.is_empty());
        for t in targets.unwrap_or_else(|| panic!("panel {title} has no query")) {
            assert_eq!(t["datasource"]["uid"], DATASOURCE, "panel {title}: {t}");
        }
    }
    let vars = variables(&dash);
    let ds = vars.get("datasource").expect("a datasource variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    for name in ["model", "worker"] {
        let v = vars
            .get(name)
            .unwrap_or_else(|| panic!("no variable {name}"));
        assert_eq!(v["datasource"]["uid"], DATASOURCE, "variable {name}");
        assert!(
            variable_query(v).starts_with("label_values("),
            "variable {name}"
        );
    }
    // Every `$name` an expression uses is a variable of the dashboard or one of Grafana's own.
    for (at, expr, _) in queries(&dash) {
        for used in expr.split('$').skip(1) {
            let name: String = (used.trim_start_matches('{').chars())
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                vars.contains_key(&name) || name == "__rate_interval" || name == "__range",
                "{at}: ${name} is no variable"
            );
        }
    }
}

// ---- The scrape ----

/// The page: each family's type (from `# TYPE`), and the label names each sample name carries.
struct Page {
    types: HashMap<String, String>,
    labels: HashMap<String, BTreeSet<String>>,
}

fn parse_page(text: &str) -> Page {
    let mut page = Page {
        types: HashMap::new(),
        labels: HashMap::new(),
    };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').expect("TYPE line");
            page.types.insert(name.to_string(), ty.to_string());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).expect("sample line");
        let names = page.labels.entry(line[..name_end].to_string()).or_default();
        // Label values are quoted and may hold `,` or `=`: split outside quotes only.
        let mut rest = line[name_end..].strip_prefix('{').unwrap_or("}");
        while let Some(eq) = rest.find('=').filter(|_| !rest.starts_with('}')) {
            names.insert(rest[..eq].to_string());
            let mut escaped = false;
            let close = rest[eq + 2..]
                .find(|c| {
                    let end = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    end
                })
                .expect("closed label value");
            rest = rest[eq + 2 + close + 1..].trim_start_matches(',');
        }
    }
    page
}

// ---- A PromQL reader: the subset dashboards use, following label names ----

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Num,
    Str(String),
    /// `[...]`: a range or subquery, its content skipped.
    Range,
    Op(&'static str),
    Open(char),
    Close(char),
    Comma,
}

fn tokens(expr: &str) -> Result<Vec<Tok>, String> {
    const OPS: [&str; 17] = [
        "==", "!=", "<=", ">=", "=~", "!~", "+", "-", "*", "/", "%", "^", "<", ">", "=", "(", ")",
    ];
    let mut out = Vec::new();
    let mut rest = expr.trim_start();
    while let Some(c) = rest.chars().next() {
        let len = if c.is_ascii_alphabetic() || c == '_' {
            let n = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            out.push(Tok::Ident(rest[..n].to_string()));
            n
        } else if c.is_ascii_digit() || c == '.' {
            out.push(Tok::Num);
            (rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))).unwrap_or(rest.len())
        } else if c == '"' || c == '\'' {
            let n = 1 + rest[1..].find(c).ok_or("unterminated string")?;
            out.push(Tok::Str(rest[1..n].to_string()));
            n + 1
        } else if c == '[' {
            out.push(Tok::Range);
            1 + rest.find(']').ok_or("unterminated range")?
        } else if let Some(op) = OPS.iter().find(|op| rest.starts_with(**op)) {
            out.push(match *op {
                "(" => Tok::Open('('),
                ")" => Tok::Close(')'),
                op => Tok::Op(op),
            });
            op.len()
        } else {
            out.push(match c {
                '{' => Tok::Open('{'),
                '}' => Tok::Close('}'),
                ',' => Tok::Comma,
                c => return Err(format!("unexpected {c:?}")),
            });
            1
        };
        rest = rest[len..].trim_start();
    }
    Ok(out)
}

/// What an expression yields: a scalar, or series with these label names; `target`: the series
/// still carry the labels Prometheus adds at scrape time (no aggregation dropped them).
#[derive(Clone, Debug, PartialEq)]
enum Val {
    Scalar,
    Vector {
        labels: BTreeSet<String>,
        target: bool,
    },
}

impl Val {
    fn labels(&self) -> BTreeSet<String> {
        match self {
            Val::Scalar => BTreeSet::new(),
            Val::Vector { labels, .. } => labels.clone(),
        }
    }
}

#[rustfmt::skip]
const AGGREGATIONS: [&str; 12] = [
    "sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values",
];

/// Functions that keep their (first) vector argument's labels.
#[rustfmt::skip]
const KEEP_LABELS: [&str; 22] = [
    "rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "last_over_time", "abs",
    "ceil", "floor", "round", "sort", "sort_desc", "clamp", "clamp_min", "clamp_max",
];

struct Reader<'a> {
    toks: Vec<Tok>,
    pos: usize,
    page: &'a Page,
    /// Families the expression reads.
    families: BTreeSet<String>,
}

type R<T> = Result<T, String>;

impl Reader<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    fn next(&mut self) -> R<Tok> {
        let t = self.peek().cloned().ok_or("unexpected end")?;
        self.pos += 1;
        Ok(t)
    }

    fn expect(&mut self, want: Tok) -> R<()> {
        match self.next()? {
            t if t == want => Ok(()),
            t => Err(format!("expected {want:?}, found {t:?}")),
        }
    }

    fn ident_is(&self, word: &str) -> bool {
        matches!(self.peek(), Some(Tok::Ident(w)) if w == word)
    }

    /// `( a, b, ... )`: label names.
    fn label_list(&mut self) -> R<BTreeSet<String>> {
        self.expect(Tok::Open('('))?;
        let mut out = BTreeSet::new();
        loop {
            match self.next()? {
                Tok::Close(')') => return Ok(out),
                Tok::Comma => {}
                Tok::Ident(l) => {
                    out.insert(l);
                }
                t => return Err(format!("{t:?} in a label list")),
            }
        }
    }

    fn expr(&mut self, min_prec: u8) -> R<Val> {
        let mut left = self.unary()?;
        loop {
            let op = match self.peek() {
                Some(Tok::Op(op)) => *op,
                Some(Tok::Ident(w)) if ["and", "or", "unless"].contains(&w.as_str()) => {
                    if w == "or" {
                        "or"
                    } else {
                        "and"
                    }
                }
                _ => return Ok(left),
            };
            let prec = match op {
                "or" => 1,
                "and" => 2,
                "==" | "!=" | "<=" | ">=" | "<" | ">" => 3,
                "+" | "-" => 4,
                "*" | "/" | "%" => 5,
                "^" => 6,
                _ => return Err(format!("operator {op}")),
            };
            if prec < min_prec {
                return Ok(left);
            }
            self.pos += 1;
            if self.ident_is("bool") {
                self.pos += 1;
            }
            let mut on = None;
            let mut ignoring = BTreeSet::new();
            if self.ident_is("on") || self.ident_is("ignoring") {
                let is_on = self.ident_is("on");
                self.pos += 1;
                let l = self.label_list()?;
                if is_on {
                    on = Some(l)
                } else {
                    ignoring = l
                }
            }
            let mut group = None;
            if self.ident_is("group_left") || self.ident_is("group_right") {
                let left_side = self.ident_is("group_left");
                self.pos += 1;
                let extra = match self.peek() {
                    Some(Tok::Open('(')) => self.label_list()?,
                    _ => BTreeSet::new(),
                };
                group = Some((left_side, extra));
            }
            let right = self.expr(if op == "^" { prec } else { prec + 1 })?;
            left = binary(op, left, right, on, ignoring, group)?;
        }
    }

    fn unary(&mut self) -> R<Val> {
        if self.peek() == Some(&Tok::Op("-")) {
            self.pos += 1;
        }
        let v = self.primary()?;
        if self.peek() == Some(&Tok::Range) {
            self.pos += 1;
        }
        Ok(v)
    }

    fn primary(&mut self) -> R<Val> {
        match self.next()? {
            Tok::Num | Tok::Str(_) => Ok(Val::Scalar),
            Tok::Open('(') => {
                let v = self.expr(0)?;
                self.expect(Tok::Close(')'))?;
                Ok(v)
            }
            Tok::Ident(name) if AGGREGATIONS.contains(&name.as_str()) => self.aggregation(&name),
            Tok::Ident(name) if self.peek() == Some(&Tok::Open('(')) => self.call(&name),
            Tok::Ident(name) => self.selector(&name),
            t => Err(format!("unexpected {t:?}")),
        }
    }

    /// `sum by (a) (x)`, `sum (x) by (a)`, `topk(5, x)`, ...
    fn aggregation(&mut self, name: &str) -> R<Val> {
        let mut clause = self.grouping()?;
        self.expect(Tok::Open('('))?;
        if ["topk", "bottomk", "quantile", "count_values"].contains(&name) {
            self.expr(0)?;
            self.expect(Tok::Comma)?;
        }
        let input = self.expr(0)?;
        self.expect(Tok::Close(')'))?;
        if clause.is_none() {
            clause = self.grouping()?;
        }
        let Val::Vector { labels, target } = input else {
            return Err(format!("{name} of a scalar"));
        };
        if let Some((_, l)) = &clause {
            let missing: Vec<_> = l.difference(&labels).collect();
            if !missing.is_empty() {
                return Err(format!("{name} by/without {missing:?}: not on {labels:?}"));
            }
        }
        Ok(match (name, clause) {
            ("topk" | "bottomk", _) => Val::Vector { labels, target },
            (_, Some((true, by))) => Val::Vector {
                labels: by,
                target: false,
            },
            (_, Some((false, without))) => Val::Vector {
                labels: labels.difference(&without).cloned().collect(),
                target,
            },
            (_, None) => Val::Vector {
                labels: BTreeSet::new(),
                target: false,
            },
        })
    }

    /// `by (...)` (true) or `without (...)` (false), if there.
    fn grouping(&mut self) -> R<Option<(bool, BTreeSet<String>)>> {
        if !(self.ident_is("by") || self.ident_is("without")) {
            return Ok(None);
        }
        let by = self.ident_is("by");
        self.pos += 1;
        Ok(Some((by, self.label_list()?)))
    }

    fn call(&mut self, name: &str) -> R<Val> {
        self.expect(Tok::Open('('))?;
        let mut args = Vec::new();
        let mut strings = Vec::new();
        while self.peek() != Some(&Tok::Close(')')) {
            match self.peek() {
                Some(Tok::Str(s)) => {
                    strings.push(s.clone());
                    self.pos += 1;
                }
                _ => args.push(self.expr(0)?),
            }
            if self.peek() == Some(&Tok::Comma) {
                self.pos += 1;
            }
        }
        self.pos += 1;
        let vector = args.iter().find(|a| **a != Val::Scalar).cloned();
        match name {
            "time" => Ok(Val::Scalar),
            "scalar" => Ok(Val::Scalar),
            "vector" | "absent" => Ok(Val::Vector {
                labels: BTreeSet::new(),
                target: false,
            }),
            "histogram_quantile" => match vector {
                Some(Val::Vector { mut labels, target }) => match labels.remove("le") {
                    true => Ok(Val::Vector { labels, target }),
                    false => Err(format!("histogram_quantile over {labels:?}: no `le`")),
                },
                v => Err(format!("histogram_quantile over {v:?}")),
            },
            "label_replace" => match (vector, strings.as_slice()) {
                (Some(Val::Vector { mut labels, target }), [dst, _, src, _]) => {
                    if !src.is_empty() && !labels.contains(src) {
                        return Err(format!("label_replace from {src}: not on {labels:?}"));
                    }
                    labels.insert(dst.clone());
                    Ok(Val::Vector { labels, target })
                }
                v => Err(format!("label_replace({v:?}, {strings:?})")),
            },
            f if KEEP_LABELS.contains(&f) => vector.ok_or(format!("{f} of no vector")),
            f => Err(format!("function {f} unknown to this test: teach it")),
        }
    }

    /// `name{label op "value", ...}`: the name must be a family of the page (or a histogram's
    /// `_bucket`, `_sum` or `_count`), and each matched label on its samples.
    fn selector(&mut self, name: &str) -> R<Val> {
        if !(name.starts_with("rankgate_") || name.starts_with("process_")) {
            return Err(format!("{name}: not one of rankgate's metrics"));
        }
        let family = if self.page.types.contains_key(name) {
            name
        } else {
            ["_bucket", "_sum", "_count"]
                .iter()
                .filter_map(|s| name.strip_suffix(s))
                .find(|f| self.page.types.get(*f).is_some_and(|t| t == "histogram"))
                .ok_or(format!("{name}: no such family (# TYPE) on the page"))?
        };
        self.families.insert(family.to_string());
        let labels = (self.page.labels.get(name).cloned()).ok_or(format!(
            "{name}: no samples on the page to check its labels"
        ))?;
        if self.peek() == Some(&Tok::Open('{')) {
            self.pos += 1;
            loop {
                match self.next()? {
                    Tok::Close('}') => break,
                    Tok::Comma => {}
                    Tok::Ident(l) => {
                        if l != "__name__" && !labels.contains(&l) {
                            return Err(format!("{name}{{{l}=...}}: not on {labels:?}"));
                        }
                        match (self.next()?, self.next()?) {
                            (Tok::Op("=" | "!=" | "=~" | "!~"), Tok::Str(_)) => {}
                            t => return Err(format!("matcher {l} {t:?}")),
                        }
                    }
                    t => return Err(format!("{t:?} in a selector")),
                }
            }
        }
        Ok(Val::Vector {
            labels,
            target: true,
        })
    }
}

/// The labels of `left op right`, checking that vector matching joins on labels both sides have
/// (Prometheus' rules: one-to-one keeps the left side's labels, or only the `on` ones;
/// `group_left(x)` adds `x` from the right).
fn binary(
    op: &str,
    left: Val,
    right: Val,
    on: Option<BTreeSet<String>>,
    ignoring: BTreeSet<String>,
    group: Option<(bool, BTreeSet<String>)>,
) -> R<Val> {
    let (l, r) = match (&left, &right) {
        (Val::Scalar, _) => return Ok(right),
        (_, Val::Scalar) => return Ok(left),
        (Val::Vector { labels: l, .. }, Val::Vector { labels: r, .. }) => (l, r),
    };
    let target = |v: &Val| matches!(v, Val::Vector { target: true, .. });
    if op == "or" {
        // Series come from either side: a legend may name what both have.
        let target = target(&left) && target(&right);
        let labels = l.intersection(r).cloned().collect();
        return Ok(Val::Vector { labels, target });
    }
    let key = |side: &BTreeSet<String>| -> R<BTreeSet<String>> {
        match &on {
            Some(on) if !on.is_subset(side) => Err(format!("on {on:?}: not all on {side:?}")),
            Some(on) => Ok(on.clone()),
            None => Ok(side.difference(&ignoring).cloned().collect()),
        }
    };
    let (lk, rk) = (key(l)?, key(r)?);
    // Without `on`, the labels Prometheus adds are part of the match too.
    if lk != rk || (on.is_none() && target(&left) != target(&right)) {
        return Err(format!("{op} matches nothing: {left:?} against {right:?}"));
    }
    Ok(match group {
        // The labels a group modifier copies come from the "one" side.
        Some((left_many, extra)) if !extra.is_subset(if left_many { r } else { l }) => {
            return Err(format!("group_left/right {extra:?}: not on the one side"));
        }
        Some((true, extra)) => Val::Vector {
            labels: l.union(&extra).cloned().collect(),
            target: target(&left),
        },
        Some((false, extra)) => Val::Vector {
            labels: r.union(&extra).cloned().collect(),
            target: target(&right),
        },
        None if on.is_some() && op != "and" => Val::Vector {
            labels: lk,
            target: false,
        },
        None => left,
    })
}

/// Reads `expr` against `page`: the families it uses and what it yields.
fn read(expr: &str, page: &Page) -> R<(BTreeSet<String>, Val)> {
    let mut r = Reader {
        toks: tokens(expr)?,
        pos: 0,
        page,
        families: BTreeSet::new(),
    };
    let v = r.expr(0)?;
    match r.peek() {
        None => Ok((r.families, v)),
        Some(t) => Err(format!("{t:?} after the expression")),
    }
}

/// The `{{label}}`s of a legend format.
fn legend_labels(legend: &str) -> Vec<&str> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|s| Some(s.split_once("}}")?.0.trim()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_of_the_dashboard_reads_metrics_and_labels_the_router_serves() {
    // Prefix caching on: the engine's prefix-cache counters are on the page too.
    let e = engine(rankgate_sim::sim::SimConfig {
        prefix_caching: true,
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    // A prefill and a decode server of a model of their own: the per-rank leg counters are on
    // the page only for a fleet that has them. The requests below are for the other model,
    // served whole.
    let prefill = engine(serving(&["pd-model"], 1, 0)).await;
    let decode = engine(serving(&["pd-model"], 1, 0)).await;
    let table = |url: String, keys: &str| {
        format!("[[engines]]\nurl = \"{url}\"\nflavor = \"vllm\"\n{keys}\n")
    };
    let r = router(
        FAST,
        &[
            table(e.url(), "dp_size = 2"),
            table(prefill.url(), "dp_size = 1\nrole = \"prefill\""),
            table(decode.url(), "dp_size = 1\nrole = \"decode\""),
        ],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    wait_models(&r).await;
    // Streamed and plain completions on the engine, and answers rankgate writes itself.
    for _ in 0..2 {
        let s = stream_chat(r.addr, 8).await;
        assert_eq!(s.status(), StatusCode::OK);
        s.into_body().collect().await.expect("stream body");
        assert_eq!(chat(r.addr, 2).await.status, StatusCode::OK);
    }
    assert_eq!(get(r.addr, "/v1/models").await.status, StatusCode::OK);
    assert_eq!(
        get(r.addr, "/no/such/path").await.status,
        StatusCode::NOT_FOUND
    );
    let reply = get(r.admin_addr, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    let text = String::from_utf8(reply.body.to_vec()).unwrap();
    let page = parse_page(&text);
    r.shutdown().await;

    let dash = dashboard();
    let mut used = BTreeSet::new();
    let mut errors = Vec::new();
    for (at, expr, legend) in queries(&dash) {
        match read(&expr, &page) {
            Ok((families, v)) => {
                used.extend(families);
                let Val::Vector { labels, target } = &v else {
                    continue;
                };
                for l in legend_labels(&legend) {
                    let by_target = *target && TARGET_LABELS.contains(&l);
                    if !labels.contains(l) && !by_target {
                        errors.push(format!("{at}: legend {{{{{l}}}}} not in {:?}", v.labels()));
                    }
                }
            }
            Err(e) => errors.push(format!("{at}: {e}\n    {expr}")),
        }
    }
    for (name, v) in variables(&dash) {
        let Some(args) =
            (variable_query(v).strip_prefix("label_values(")).and_then(|q| q.strip_suffix(')'))
        else {
            continue;
        };
        let (selector, label) = args.rsplit_once(',').expect("label_values(metric, label)");
        match read(selector, &page) {
            Ok((families, v)) if v.labels().contains(label.trim()) => used.extend(families),
            Ok((_, v)) => errors.push(format!("variable {name}: {label} not in {v:?}")),
            Err(e) => errors.push(format!("variable {name}: {e}")),
        }
    }
    assert!(
        errors.is_empty(),
        "{}\n\nthe page:\n{text}",
        errors.join("\n")
    );
    let left_out: Vec<_> = (page.types.keys())
        .filter(|f| !used.contains(*f) && !NOT_ON_THE_DASHBOARD.contains(&f.as_str()))
        .collect();
    assert!(
        left_out.is_empty(),
        "families on no panel (add them, or to NOT_ON_THE_DASHBOARD with why): {left_out:?}"
    );
}

/// `promtool check rules` over every expression of the dashboard as a recording rule
/// (Grafana's variables replaced by values). promtool is Debian's `prometheus` package, which
/// `.ci/run` installs and with which it runs this test (`--ignored`); without it the test is
/// reported ignored, never passed.
#[test]
#[ignore = "needs promtool (Debian package prometheus): .ci/run installs it and runs this test"]
fn promtool_parses_every_dashboard_query() {
    let dash = dashboard();
    let rules: Vec<Value> = queries(&dash)
        .iter()
        .enumerate()
        .map(|(i, (_, expr, _))| {
            let expr = (expr.replace("$__rate_interval", "1m"))
                .replace("$model", ".*")
                .replace("$worker", ".*");
            serde_json::json!({"record": format!("dashboard:query_{i}"), "expr": expr})
        })
        .collect();
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("grafana-rules.json");
    let doc = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    std::fs::write(&file, doc.to_string()).unwrap();
    let out = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("promtool: {e} (install the Debian package prometheus)"));
    assert!(
        out.status.success(),
        "promtool check rules:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
