//! `kvroute serve`: ingest every worker's KV events into the index and serve
//! the HTTP API.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::index::IndexConfig;
use kvroute_server::ingest::IngestConfig;
use kvroute_server::spec::{parse_config, WorkerSpec};
use kvroute_server::{serve, ServeConfig};

/// Arguments of `kvroute serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Tokens per KV block, for workers that do not give their own.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// A worker: `name=w0,url=http://…,events=tcp://…:5557,replay=tcp://…:5657,dp=2,block_size=16`
    /// (repeatable; `replay`, `dp`, `block_size`, `topic`, `model` optional).
    #[arg(long = "worker", value_name = "SPEC")]
    workers: Vec<String>,
    /// A TOML file with `[[worker]]` tables using the same keys as `--worker`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// An SGLang worker URL whose `/server_info` describes its event sockets (repeatable).
    #[arg(long, value_name = "URL")]
    discover_sglang: Vec<String>,
    /// Bearer token required by `/register` and `/unregister` (also `KVROUTE_ADMIN_TOKEN`).
    #[arg(long)]
    admin_token: Option<String>,
    /// Seconds a worker may stay unreachable before its blocks leave the index.
    #[arg(long, default_value_t = 30)]
    unreachable_grace_secs: u64,
    /// Residencies kept per (worker, rank) at most.
    #[arg(long, default_value_t = 4 << 20)]
    max_blocks_per_rank: u64,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info")]
    log: tracing::Level,
}

/// Builds the runtime and serves until Ctrl-C or SIGTERM.
pub fn run(args: &ServeArgs) -> Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_max_level(args.log)
        .with_writer(std::io::stderr)
        .init();
    let mut workers: Vec<WorkerSpec> = Vec::new();
    for text in &args.workers {
        workers.push(
            WorkerSpec::parse(text, args.block_size).with_context(|| format!("--worker {text}"))?,
        );
    }
    if let Some(path) = &args.config {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        workers.extend(
            parse_config(&text, args.block_size)
                .with_context(|| format!("--config {}", path.display()))?,
        );
    }
    let admin_token = args
        .admin_token
        .clone()
        .or_else(|| std::env::var("KVROUTE_ADMIN_TOKEN").ok())
        .filter(|t| !t.is_empty());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .context("http client")?;
        for url in &args.discover_sglang {
            let spec = kvroute_server::discover::discover_sglang(&client, url).await?;
            workers.push(spec);
        }
        let mut names = std::collections::BTreeSet::new();
        for w in &workers {
            if !names.insert(w.name.clone()) {
                bail!("two workers are named `{}`", w.name);
            }
        }
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        eprintln!(
            "kvroute serve: listening on http://{addr} with {} worker(s)",
            workers.len()
        );
        let config = ServeConfig {
            block_size: args.block_size,
            workers,
            admin_token,
            unreachable_grace: Duration::from_secs(args.unreachable_grace_secs),
            index: IndexConfig {
                default_capacity: Some(args.max_blocks_per_rank),
                ..IndexConfig::default()
            },
            ingest: IngestConfig::default(),
        };
        serve(config, listener, shutdown_signal()).await?;
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
