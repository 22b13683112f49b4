//! The dashboard's JSON, read: its panels (nested rows included), their queries and legends, and
//! its template variables; and the test that gives every panel a unique id, the `${datasource}`
//! variable and a description.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use serde_json::Value;

const DASHBOARD: &str = "deploy/grafana/rankgate.json";
const DATASOURCE: &str = "${datasource}";

pub fn dashboard() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(DASHBOARD);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

/// Every panel, those inside collapsed rows included.
pub fn panels(dash: &Value) -> Vec<&Value> {
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
pub fn queries(dash: &Value) -> Vec<(String, String, String)> {
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
pub fn variables(dash: &Value) -> HashMap<String, &Value> {
    let list = dash["templating"]["list"]
        .as_array()
        .expect("templating.list");
    list.iter()
        .map(|v| (v["name"].as_str().expect("variable name").to_string(), v))
        .collect()
}

/// A query variable's query (Grafana writes it as a string or as `{"query": ...}`).
pub fn variable_query(v: &Value) -> &str {
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
