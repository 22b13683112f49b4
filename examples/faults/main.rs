//! The reliability runner behind `docs/reliability.md`: every fault rankgate is built to survive,
//! each against a fresh simulated fleet under the same bounded streaming load, summed up in one
//! markdown table.
//!
//!   cargo run --release --example faults [-- --only <name>] [-- --json]
//!
//! Each row: 3 simulated vLLM engines x 2 DP ranks and one rankgate in this process, on
//! 127.0.0.1 with ports picked by the OS; streaming chat requests at a fixed rate for a fixed
//! time (so bounded in count and time, each request also capped); the fault switched on at a
//! fixed point of the run and (where it can be) off again later, while `/workers` is sampled
//! to time when the affected ranks leave and rejoin selection. Nothing here panics on a failure
//! of the thing under test: a fleet that fails to start or a check that times out becomes a
//! note in its row.
//!
//! By part: [`fault`] (the faults), [`fleet`] (the simulated fleet and switching a fault),
//! [`load`] (the streaming load and what it observes), [`run`] (one row) and [`report`] (the
//! table).

mod fault;
mod fleet;
mod load;
mod report;
mod run;

use clap::Parser;
use tokio::time::Instant;

use crate::{fault::*, report::*, run::*};

#[derive(Parser)]
#[command(about = "Runs every fault against a simulated fleet and prints one markdown table")]
struct Args {
    /// Run only this fault (see the `fault` column for names).
    #[arg(long)]
    only: Option<String>,
    /// Print the rows as JSON instead of the markdown table.
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let faults: Vec<Fault> = match &args.only {
        Some(name) => match ALL.iter().find(|f| f.name() == name) {
            Some(f) => vec![*f],
            None => {
                let names: Vec<&str> = ALL.iter().map(|f| f.name()).collect();
                eprintln!("unknown fault {name:?}; one of: {}", names.join(", "));
                std::process::exit(2);
            }
        },
        None => ALL.to_vec(),
    };
    let began = Instant::now();
    let mut rows = Vec::with_capacity(faults.len());
    for (i, f) in faults.iter().enumerate() {
        eprint!("[{}/{}] {} ... ", i + 1, faults.len(), f.name());
        let row = run(*f).await;
        eprintln!("{:.1} s", row.wall.as_secs_f64());
        rows.push(row);
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&rows)).unwrap_or_default()
        );
    } else {
        print!("{}", markdown(&rows));
    }
    eprintln!("total {:.1} s", began.elapsed().as_secs_f64());
}
