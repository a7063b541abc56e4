//! The `kvroute` command: parse the command line and dispatch to a subcommand.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => cmd::inspect::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvroute: {e:#}");
            ExitCode::from(2)
        }
    }
}
