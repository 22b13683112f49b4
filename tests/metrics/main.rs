//! rankgate's own `/metrics` over real sockets: scraped while simulated engines serve traffic,
//! the page is valid Prometheus text (checked here line by line, and by `promtool check metrics`
//! in a test ignored without promtool, which `.ci/run` installs and runs it with);
//! requests carry their model, route, status and worker; time to first byte is observed once
//! per stream; clients cannot multiply series; a removed worker's series leave the page.
//!
//! By part: [`page`] (the whole page), [`series`] (particular series), over [`exposition`] (the
//! format checker) and [`helpers`].

#[path = "../common/mod.rs"]
mod common;
mod exposition;
mod helpers;
mod page;
mod series;
mod status;
