//! `kvroute bench restore`: how long a router process takes to be ready
//! when it starts on a saved index, from `--state-dir` or from its peers'
//! snapshot in NATS (`--nats`).
//!
//! The index is built from the synthetic fleet trace of `bench index` and
//! saved in the router's own state format, its workers at addresses where
//! nothing listens (the router keeps their blocks for the grace period).
//! *Ready* is the first `GET /health` answered, timed from the moment the
//! process is spawned: the router serves nothing before its state is in.
//! Over NATS two starts are timed: with a live peer replica (the new one
//! asks it for a fresh snapshot and waits for it to be written) and with
//! none (the newest object in the bucket). Each start is checked to hold
//! every residency of the saved index.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvroute_core::index::{Index, IndexConfig};
use kvroute_server::ingest::spec::WorkerSpec;
use kvroute_server::ingest::stats::ResumePoint;
use kvroute_server::state::{self, SavedRank, SavedWorker, Snapshot};
use serde_json::{json, Value};

use super::child::RouterProcess;
use crate::error::{Error, Result};
use crate::metrics;
use crate::nats::NatsServer;
use crate::trace::{TraceConfig, TraceGen};

/// What `kvroute bench restore` measures.
#[derive(Debug, Clone)]
pub struct RestoreBenchConfig {
    /// The `kvroute` executable whose `serve` is timed.
    pub router_exe: PathBuf,
    /// Workers of the saved fleet.
    pub workers: u32,
    /// Residencies of the saved index (at least 1).
    pub residencies: u64,
    /// Starts timed per source; the report gives their median.
    pub runs: usize,
    /// Seed of the trace.
    pub seed: u64,
}

fn progress(msg: &str) {
    eprintln!("[bench restore] {msg}");
}

/// The saved index: the trace's fleet once every cache is full, with each
/// worker at a dead address and its rank's stream at batch 1.
fn saved_state(config: &RestoreBenchConfig) -> Result<(Snapshot, u64)> {
    // Caches fill to about 95 % of the trace's capacity: aim above it.
    let mut gen = TraceGen::new(TraceConfig {
        workers: config.workers,
        residencies: config.residencies.saturating_mul(10) / 9 + 1,
        seed: config.seed,
    });
    let mut index = Index::new(IndexConfig::default());
    let mut events = Vec::new();
    while gen.held() < config.residencies {
        events.clear();
        gen.step(&mut events);
        for (key, event) in &events {
            index.apply(*key, event);
        }
    }
    let residencies = index.stats().residencies;
    let workers = (0..config.workers)
        .map(|i| {
            let line = format!("name=w{i},url=http://127.0.0.1:9,events=tcp://127.0.0.1:9");
            let spec = WorkerSpec::parse(&line, Some(16))
                .map_err(|e| Error::Unexpected(format!("worker spec: {e}")))?;
            Ok(SavedWorker {
                id: i,
                spec,
                block_size: Some(16),
                ranks: vec![SavedRank {
                    rank: 0,
                    at: Some(ResumePoint {
                        seq: 1,
                        fingerprint: 0,
                        exact: true,
                    }),
                }],
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let snapshot = Snapshot {
        workers,
        index: index.dump(),
    };
    Ok((snapshot, residencies))
}

/// Flags every timed router gets: dead workers keep their blocks.
fn common_flags() -> Vec<String> {
    ["--unreachable-grace-secs", "3600", "--admin-token", "bench"]
        .map(String::from)
        .to_vec()
}

/// Spawns a router with `flags`, waits for its first `/health`; the time
/// that took and the residencies it then holds.
async fn timed_start(exe: &Path, flags: Vec<String>) -> Result<(f64, u64, RouterProcess)> {
    let client = crate::driver::client()?;
    let started = Instant::now();
    let exe = exe.to_owned();
    let router = tokio::task::spawn_blocking(move || RouterProcess::spawn(&exe, &[], &flags))
        .await
        .map_err(|e| Error::Unexpected(format!("starting the router: {e}")))??;
    let deadline = started + Duration::from_secs(60);
    loop {
        let health = client
            .get(format!("{}/health", router.url))
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        if health.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout("the router never answered /health".into()));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let ready_ms = started.elapsed().as_secs_f64() * 1e3;
    let text = metrics::get_text(&client, &router.url, "/metrics").await?;
    let held = metrics::sum(&text, "kvroute_index_residencies");
    Ok((ready_ms, held, router))
}

/// The median of `samples` (sorted in place).
fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples.get(samples.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times `runs` starts from `flags`, checking each holds `expected` residencies.
async fn timed_starts(
    config: &RestoreBenchConfig,
    what: &str,
    flags: impl Fn(usize) -> Vec<String>,
    expected: u64,
) -> Result<Value> {
    let mut ready = Vec::new();
    for run in 0..config.runs.max(1) {
        let (ms, held, router) = timed_start(&config.router_exe, flags(run)).await?;
        drop(router);
        if held != expected {
            return Err(Error::Unexpected(format!(
                "{what}: the router came back with {held} of {expected} residencies"
            )));
        }
        progress(&format!("{what}: ready in {ms:.0} ms, {held} residencies"));
        ready.push(ms);
    }
    Ok(json!({
        "ready_ms_median": median(&mut ready),
        "ready_ms": ready,
    }))
}

/// Runs the benchmark; the report as one JSON object.
pub async fn run(config: &RestoreBenchConfig) -> Result<Value> {
    if config.residencies == 0 || config.workers == 0 {
        return Err(Error::Invalid(
            "workers and residencies must be at least 1".into(),
        ));
    }
    progress(&format!(
        "building an index of {} residencies",
        config.residencies
    ));
    let (snapshot, residencies) = saved_state(config)?;
    let bytes = snapshot.encode().len();
    let dir = std::env::temp_dir().join(format!("kvroute-bench-restore-{}", std::process::id()));
    state::save(&dir, &snapshot)
        .map_err(|e| Error::Unexpected(format!("saving the state: {e}")))?;
    let dir_arg = dir.display().to_string();
    let state_dir = timed_starts(
        config,
        "--state-dir",
        |_| [common_flags(), vec!["--state-dir".into(), dir_arg.clone()]].concat(),
        residencies,
    )
    .await;
    let nats = match state_dir {
        Ok(_) => nats_starts(config, &dir_arg, residencies).await,
        Err(ref e) => Err(Error::Unexpected(e.to_string())),
    };
    let _ = std::fs::remove_dir_all(&dir);
    let (state_dir, (with_peer, from_bucket)) = (state_dir?, nats?);
    Ok(json!({
        "residencies": residencies,
        "snapshot_bytes": bytes,
        "workers": config.workers,
        "runs": config.runs.max(1),
        "state_dir": state_dir,
        "nats_with_a_live_peer": with_peer,
        "nats_from_the_bucket": from_bucket,
    }))
}

/// The two NATS starts: a seed replica restored from `dir` publishes the
/// snapshot; new replicas start while it lives, then after it is gone.
async fn nats_starts(
    config: &RestoreBenchConfig,
    dir: &str,
    expected: u64,
) -> Result<(Value, Value)> {
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .map_err(|e| Error::Unexpected(format!("starting nats-server: {e}")))??;
    let url = nats.url();
    let replica = |id: String| {
        let mut flags = common_flags();
        flags.extend(["--nats".into(), url.clone(), "--replica-id".into(), id]);
        flags
    };
    let seed_flags = [
        replica("seed".into()),
        vec!["--state-dir".into(), dir.to_owned()],
    ]
    .concat();
    let (_, held, seed) = timed_start(&config.router_exe, seed_flags).await?;
    if held != expected {
        return Err(Error::Unexpected(format!(
            "the seed replica holds {held} of {expected}"
        )));
    }
    // The seed writes its first snapshot at once; wait until it is in.
    wait_for_snapshot(&seed).await?;
    let with_peer = timed_starts(
        config,
        "--nats, live peer",
        |r| replica(format!("new-{r}")),
        expected,
    )
    .await?;
    drop(seed);
    let from_bucket = timed_starts(
        config,
        "--nats, no peer",
        |r| replica(format!("late-{r}")),
        expected,
    )
    .await?;
    drop(nats);
    Ok((with_peer, from_bucket))
}

/// Waits (at most 30 s) until `router` has written a snapshot.
async fn wait_for_snapshot(router: &RouterProcess) -> Result<()> {
    let client = crate::driver::client()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let text = metrics::get_text(&client, &router.url, "/metrics").await?;
        if metrics::sum(&text, "kvroute_replica_snapshots_written_total") >= 1 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(Error::Timeout("the seed replica wrote no snapshot".into()))
}
