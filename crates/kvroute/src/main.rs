//! The `kvroute` command: parse the command line and dispatch to a subcommand.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(feature = "alloc-meter")]
mod alloc_meter;
mod cmd;

// The process's global allocator, chosen here and nowhere else. By default
// the system allocator; `--features alloc-meter` swaps in one that counts
// live heap bytes (one atomic update per allocation) so that `kvroute bench
// index` can report measured memory. Never build the router with it.
#[cfg(not(feature = "alloc-meter"))]
#[global_allocator]
static ALLOCATOR: std::alloc::System = std::alloc::System;
#[cfg(feature = "alloc-meter")]
#[global_allocator]
static ALLOCATOR: alloc_meter::MeteredAlloc = alloc_meter::MeteredAlloc;

/// The live heap bytes of this process, when the allocator above counts them.
pub fn heap_meter() -> Option<fn() -> usize> {
    #[cfg(feature = "alloc-meter")]
    return Some(alloc_meter::live_bytes);
    #[cfg(not(feature = "alloc-meter"))]
    return None;
}

/// kvroute: a KV-cache-aware router for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Decode one engine KV-event payload and print each event as a JSON line.
    Inspect(cmd::inspect::InspectArgs),
    /// Show the win: a mock fleet, the router under each policy, the same workload, a report.
    Demo(cmd::demo::DemoArgs),
    /// Generate load against an OpenAI-compatible endpoint, measure one of
    /// kvroute's parts, or simulate routing on a virtual clock (its
    /// subcommands: `kvroute bench --help`).
    Bench(cmd::bench::BenchArgs),
    /// Run simulated vLLM / SGLang engines (HTTP, prefix cache, KV events over ZeroMQ).
    Mocker(cmd::mocker::MockerArgs),
    /// Ingest the workers' KV events and serve the HTTP API.
    Serve(Box<cmd::serve::ServeArgs>),
    /// One publisher process of `kvroute bench ingest` (started by it).
    #[command(hide = true)]
    BenchPublisher(cmd::bench::PublisherArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => cmd::inspect::run(&args),
        Command::Demo(args) => cmd::demo::run(&args),
        Command::Bench(args) => cmd::bench::run(&args),
        Command::Mocker(args) => cmd::mocker::run(&args),
        Command::Serve(args) => cmd::serve::run(&args),
        Command::BenchPublisher(args) => cmd::bench::run_publisher(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvroute: {e:#}");
            ExitCode::from(2)
        }
    }
}
