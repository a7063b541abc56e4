//! The `kvroute` command: parse the command line and dispatch to a subcommand.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod alloc_meter;
mod cmd;

/// Counts live heap bytes, so `kvroute bench` reports measured memory.
#[global_allocator]
static ALLOCATOR: alloc_meter::MeteredAlloc = alloc_meter::MeteredAlloc;

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
    /// Generate load against an OpenAI-compatible endpoint, or measure kvroute's
    /// parts (`bench index|ingest|proxy`).
    Bench(cmd::bench::BenchArgs),
    /// Run simulated vLLM / SGLang engines (HTTP, prefix cache, KV events over ZeroMQ).
    Mocker(cmd::mocker::MockerArgs),
    /// Ingest the workers' KV events and serve the HTTP API.
    Serve(cmd::serve::ServeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => cmd::inspect::run(&args),
        Command::Demo(args) => cmd::demo::run(&args),
        Command::Bench(args) => cmd::bench::run(&args),
        Command::Mocker(args) => cmd::mocker::run(&args),
        Command::Serve(args) => cmd::serve::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvroute: {e:#}");
            ExitCode::from(2)
        }
    }
}
