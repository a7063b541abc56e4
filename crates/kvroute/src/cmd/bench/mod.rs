//! `kvroute bench`: measurements that all come from one tool.

use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Subcommand};

pub mod index;
pub mod ingest;
pub mod proxy;
pub mod trace;

/// Arguments of `kvroute bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchCommand,
}

/// What to measure.
#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The prefix index alone: apply throughput, lookup latency, memory, snapshots.
    Index(index::IndexBenchArgs),
    /// Sustained ingest: mock engines' publishers → ZeroMQ → decoder → index.
    Ingest(ingest::IngestBenchArgs),
    /// Latency `kvroute serve` adds per request: through the router vs straight to mock engines.
    Proxy(proxy::ProxyBenchArgs),
}

/// Runs the chosen benchmark.
pub fn run(args: &BenchArgs) -> Result<ExitCode> {
    match &args.what {
        BenchCommand::Index(a) => index::run(a),
        BenchCommand::Ingest(a) => ingest::run(a),
        BenchCommand::Proxy(a) => proxy::run(a),
    }
}
