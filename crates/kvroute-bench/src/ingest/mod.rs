//! `kvroute bench ingest`: a real `kvroute serve` process ingesting
//! thousands of (worker, DP rank) event streams.
//!
//! The router is a child process (`EXE serve --admin-token … --max-connections
//! 256`, no static workers); the engines are publisher child processes
//! (`EXE bench-publisher`, [`publisher`]), one thread each serving up to
//! [`publisher::MAX_RANKS_PER_PUBLISHER`] ranks with the engines' wire format
//! (PUB + replay ROUTER per rank, on free 127.0.0.1 ports below 32 768).
//! Everything is observed from outside: registrations with `POST /register`,
//! rank states from `GET /workers` and `/metrics`, threads, memory and CPU
//! from `/proc/PID/{status,stat}`. Measured, in order:
//!
//! 1. seconds from the first registration until every rank is `live`;
//! 2. the router's threads against cores + 8;
//! 3. its CPU over `idle_secs` with every rank connected and quiet;
//! 4. its resident memory before registering and once idle, per rank;
//! 5. a flood: every rank publishes as fast as its publisher thread can for
//!    `flood_secs`; the apply rate is the router's own count of block
//!    operations (`kvroute_index_blocks_{stored,removed}_total`) per second,
//!    not what the publishers sent; then the drain, gaps and rank states.

mod fleet;
mod ports;
mod probe;
pub mod publisher;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::child::{cpu_time_of, RouterProcess};
use crate::error::{Error, Result};
use fleet::{PublisherFlags, Publishers};
use probe::{applied_block_ops, live_from_metrics, RouterApi};

/// What `kvroute bench ingest` runs.
#[derive(Debug, Clone)]
pub struct IngestBenchConfig {
    /// The `kvroute` executable: its `serve` is measured and its
    /// `bench-publisher` plays the engines.
    pub exe: PathBuf,
    /// Workers registered.
    pub workers: u32,
    /// DP ranks per worker.
    pub dp: u32,
    /// Seconds of quiet over which the idle CPU is measured.
    pub idle_secs: f64,
    /// Seconds every rank publishes.
    pub flood_secs: f64,
    /// Block operations per second offered by all publishers together (0: unpaced).
    pub flood_rate: u64,
    /// Stored events per batch (each batch also removes older blocks).
    pub events_per_batch: u32,
    /// Blocks per stored event.
    pub blocks_per_event: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Batches each rank keeps for replay.
    pub replay_buffer: usize,
    /// Ranks per publisher process (at most 500).
    pub ranks_per_publisher: u32,
    /// Longest wait for every rank to be `live`.
    pub live_timeout: Duration,
    /// First port tried for the publishers' sockets.
    pub first_port: u16,
}

impl IngestBenchConfig {
    /// The defaults of the issue's figure: 512 workers × dp 8 = 4 096 ranks.
    pub fn new(exe: PathBuf) -> Self {
        IngestBenchConfig {
            exe,
            workers: 512,
            dp: 8,
            idle_secs: 10.0,
            flood_secs: 10.0,
            flood_rate: 1_500_000,
            events_per_batch: 4,
            blocks_per_event: 16,
            block_size: 16,
            replay_buffer: 64,
            ranks_per_publisher: publisher::MAX_RANKS_PER_PUBLISHER,
            live_timeout: Duration::from_secs(180),
            first_port: 20_000,
        }
    }

    fn validate(&self) -> Result<()> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let bad = |what: &str| Err(Error::Invalid(what.to_owned()));
        if self.workers == 0 || self.dp == 0 {
            return bad("workers and dp must be at least 1");
        }
        if !(1..=publisher::MAX_RANKS_PER_PUBLISHER).contains(&self.ranks_per_publisher) {
            return bad("ranks_per_publisher must be between 1 and 500");
        }
        if self.dp > self.ranks_per_publisher {
            return bad("dp must be at most ranks_per_publisher (a worker lives in one publisher)");
        }
        if !positive(self.idle_secs) || !positive(self.flood_secs) {
            return bad("idle_secs and flood_secs must be positive");
        }
        if self.events_per_batch == 0 || self.blocks_per_event == 0 || self.block_size == 0 {
            return bad("events_per_batch, blocks_per_event and block_size must be at least 1");
        }
        Ok(())
    }

    /// Block operations per applied event once the index is steady: each
    /// batch has `events_per_batch` stored events and one removal, with
    /// `events_per_batch × blocks_per_event` blocks each way.
    fn block_ops_per_event(&self) -> f64 {
        let e = f64::from(self.events_per_batch);
        2.0 * e * f64::from(self.blocks_per_event) / (e + 1.0)
    }
}

/// How often the router is asked whether every rank is live, and whether
/// it has drained after the flood: the resolution of those two figures (a
/// `/metrics` scrape of thousands of ranks is not free for the router).
const POLL: Duration = Duration::from_millis(250);

fn progress(msg: &str) {
    eprintln!("[bench ingest] {msg}");
}

/// The processes under test and the router's API.
struct Setup<'a> {
    config: &'a IngestBenchConfig,
    router: RouterProcess,
    api: RouterApi,
    publishers: Publishers,
    ports: Vec<(u16, u16)>,
    report: Map<String, Value>,
}

/// Runs the benchmark (progress on stderr) and returns its figures as one
/// flat JSON object.
pub fn run(config: &IngestBenchConfig) -> Result<Value> {
    config.validate()?;
    let ranks = config.workers * config.dp;
    let ports = ports::allocate(config.workers, config.dp, config.first_port)?;
    let token = format!("bench-ingest-{}", std::process::id());
    let router = RouterProcess::spawn(
        &config.exe,
        &[],
        &[
            "--admin-token".into(),
            token.clone(),
            "--max-connections".into(),
            "256".into(),
        ],
    )?;
    let api = RouterApi::new(&router.url, &token);
    let per_publisher = (config.ranks_per_publisher / config.dp) as usize;
    let groups: Vec<&[(u16, u16)]> = ports.chunks(per_publisher).collect();
    progress(&format!(
        "{ranks} ranks ({} workers × dp {}) in {} publisher processes",
        config.workers,
        config.dp,
        groups.len()
    ));
    let flags = PublisherFlags {
        dp: config.dp,
        events_per_batch: config.events_per_batch,
        blocks_per_event: config.blocks_per_event,
        block_size: config.block_size,
        replay_buffer: config.replay_buffer,
    };
    let publishers = Publishers::start(&config.exe, &flags, &groups, 1)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let mut report = Map::new();
    for (k, v) in [
        ("workers", json!(config.workers)),
        ("dp", json!(config.dp)),
        ("ranks", json!(ranks)),
        ("publisher_processes", json!(groups.len())),
        ("cores", json!(cores)),
        ("thread_limit", json!(cores + 8)),
    ] {
        report.insert(k.into(), v);
    }
    let mut setup = Setup {
        config,
        router,
        api,
        publishers,
        ports,
        report,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::io("starting the runtime"))?;
    runtime.block_on(setup.measure())?;
    let Setup {
        publishers, report, ..
    } = setup;
    publishers.stop();
    Ok(Value::Object(report))
}

impl Setup<'_> {
    fn put(&mut self, key: &str, value: Value) {
        self.report.insert(key.to_owned(), value);
    }

    async fn measure(&mut self) -> Result<()> {
        let before = self.router.status()?;
        self.put("rss_kib_before", json!(before.rss_kib));
        self.register_and_wait().await?;
        self.idle().await?;
        let idle = self.router.status()?;
        let ranks = u64::from(self.config.workers * self.config.dp);
        self.put("rss_kib_idle", json!(idle.rss_kib));
        self.put(
            "kib_per_idle_rank",
            json!(round2(
                idle.rss_kib.saturating_sub(before.rss_kib) as f64 / ranks as f64
            )),
        );
        self.put("threads_idle", json!(idle.threads));
        self.flood().await?;
        let after = self.router.status()?;
        self.put("rss_kib_after_flood", json!(after.rss_kib));
        self.put("threads_after_flood", json!(after.threads));
        let threads = [
            "threads_idle",
            "threads_during_flood",
            "threads_after_flood",
        ]
        .iter()
        .filter_map(|k| self.report.get(*k)?.as_u64())
        .max()
        .unwrap_or(0);
        let limit = self.report["thread_limit"].as_u64().unwrap_or(0);
        self.put("threads_max", json!(threads));
        self.put("threads_within_limit", json!(threads <= limit));
        Ok(())
    }

    /// Registers every worker, then waits until every rank is `live`.
    async fn register_and_wait(&mut self) -> Result<()> {
        let c = self.config;
        let ranks = u64::from(c.workers * c.dp);
        progress(&format!("registering {} workers", c.workers));
        let started = Instant::now();
        for (w, &ports) in self.ports.iter().enumerate() {
            self.api
                .register(&format!("w{w}"), ports, c.dp, c.block_size)
                .await?;
        }
        self.put("registration_secs", json!(round3(secs(started))));
        let deadline = started + c.live_timeout;
        let live = loop {
            let live = match live_from_metrics(&self.api.metrics().await?) {
                Some(live) => live,
                None => self.api.fleet().await?.live(),
            };
            if live >= ranks || Instant::now() > deadline {
                break live;
            }
            tokio::time::sleep(POLL).await;
        };
        let all_live = live >= ranks;
        let view = self.api.fleet().await?;
        progress(&format!(
            "{} of {ranks} ranks live after {:.1} s: {}",
            view.live(),
            secs(started),
            view.states_json()
        ));
        let to_live = all_live.then(|| round3(secs(started)));
        self.put("seconds_to_all_live", json!(to_live));
        self.put("ranks_live", json!(view.live()));
        self.put("all_live", json!(view.live() == ranks));
        self.put("rank_states", view.states_json());
        Ok(())
    }

    /// The router's CPU over `idle_secs` of quiet, after a second to settle.
    async fn idle(&mut self) -> Result<()> {
        let c = self.config;
        progress(&format!("measuring idle CPU for {} s", c.idle_secs));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let cpu0 = self.router.cpu_time()?;
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(c.idle_secs)).await;
        let cpu = (self.router.cpu_time()? - cpu0).as_secs_f64();
        self.put("idle_secs", json!(round3(secs(t0))));
        self.put(
            "idle_cpu_percent_of_one_core",
            json!(round3(100.0 * cpu / secs(t0))),
        );
        Ok(())
    }

    /// Every rank publishes for `flood_secs`; the router's apply rate from
    /// its own counters, while publishing and until it has drained.
    async fn flood(&mut self) -> Result<()> {
        let c = self.config;
        let per_event = c.block_ops_per_event();
        let applied = |text: &str| {
            applied_block_ops(text, per_event).ok_or_else(|| {
                Error::Unexpected("the router's /metrics counts no applied blocks or events".into())
            })
        };
        let (ops0, source) = applied(&self.api.metrics().await?)?;
        let duration = Duration::from_secs_f64(c.flood_secs);
        progress(&format!("flooding for {} s", c.flood_secs));
        let cpu0 = self.router.cpu_time()?;
        let publisher_cpu0 = self.publisher_cpu()?;
        let t0 = Instant::now();
        // Each batch stores `events_per_batch` events and removes as many blocks.
        let ops_per_batch = u64::from(c.events_per_batch) * u64::from(c.blocks_per_event) * 2;
        let batches_per_sec = c.flood_rate / ops_per_batch.max(1);
        self.publishers.start_flood(duration, batches_per_sec)?;
        tokio::time::sleep(duration / 2).await;
        let threads = self.router.status()?.threads;
        self.put("threads_during_flood", json!(threads));
        tokio::time::sleep(duration.saturating_sub(t0.elapsed())).await;
        let (ops1, _) = applied(&self.api.metrics().await?)?;
        let t1 = secs(t0);
        let router_cpu = (self.router.cpu_time()? - cpu0).as_secs_f64();
        let sent = self
            .publishers
            .flood_counts(Duration::from_secs(30) + duration)?;
        let publisher_cpu = (self.publisher_cpu()? - publisher_cpu0).as_secs_f64();
        progress("waiting for the router to drain");
        let (mut ops2, mut t2) = (ops1, t1);
        let drain_deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < drain_deadline {
            tokio::time::sleep(POLL).await;
            let (ops, _) = applied(&self.api.metrics().await?)?;
            if ops == ops2 {
                break;
            }
            (ops2, t2) = (ops, secs(t0));
        }
        let published = sent.stored_blocks + sent.removed_blocks;
        let rate = |ops: u64, t: f64| (ops.saturating_sub(ops0) as f64 / t).round();
        for (k, v) in [
            ("flood_secs", json!(round3(t1))),
            ("rate_source", json!(source)),
            ("block_ops_per_s", json!(rate(ops1, t1))),
            ("block_ops_per_s_with_drain", json!(rate(ops2, t2))),
            ("drain_secs", json!(round3((t2 - t1).max(0.0)))),
            ("published_batches", json!(sent.batches)),
            ("published_block_ops", json!(published)),
            (
                "published_block_ops_per_s",
                json!(rate(published + ops0, t1)),
            ),
            ("applied_block_ops", json!(ops2.saturating_sub(ops0))),
            (
                "router_cpu_percent_during_flood",
                json!(round3(100.0 * router_cpu / t1)),
            ),
            (
                "publishers_cpu_percent_during_flood",
                json!(round3(100.0 * publisher_cpu / t1)),
            ),
            ("replays_served", json!(sent.replays)),
        ] {
            self.put(k, v);
        }
        let view = self.api.fleet().await?;
        self.put("gaps", json!(view.gaps));
        self.put("replays_ok", json!(view.replays_ok));
        self.put("replays_incomplete", json!(view.replays_incomplete));
        self.put("decode_errors", json!(view.decode_errors));
        self.put("ranks_live_after_flood", json!(view.live()));
        self.put("rank_states_after_flood", view.states_json());
        Ok(())
    }

    /// CPU time of every publisher process so far.
    fn publisher_cpu(&self) -> Result<Duration> {
        self.publishers.pids().into_iter().map(cpu_time_of).sum()
    }
}

fn secs(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_issues_figure_and_bad_settings_are_named() {
        let c = IngestBenchConfig::new("kvroute".into());
        assert_eq!(c.workers * c.dp, 4096);
        assert!(c.validate().is_ok());
        // 4 stored events of 16 blocks and one removal of 64 blocks.
        assert!((c.block_ops_per_event() - 128.0 / 5.0).abs() < 1e-9);
        let bad = IngestBenchConfig {
            dp: 600,
            ..c.clone()
        };
        assert!(bad.validate().is_err());
        let bad = IngestBenchConfig {
            flood_secs: 0.0,
            ..c
        };
        assert!(bad.validate().is_err());
    }
}
