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
//!
//! By part: [`dashboard`] (the JSON and its panels), [`queries`] (each query against the served
//! page, and promtool), [`promql`] (the PromQL reader) over [`tokens`].
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;
mod dashboard;
mod promql;
mod queries;
mod tokens;
