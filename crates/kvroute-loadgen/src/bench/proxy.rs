//! `kvroute bench proxy`: the latency `kvroute serve` adds to a request.
//!
//! Starts a fleet of mock engines and a router over them in this process,
//! then sends the same requests twice: straight to the engines (round-robin)
//! and through the router. The difference between the two latency
//! distributions is the router's cost: parsing, hashing, the index walk, the
//! pick, and the extra HTTP hop over 127.0.0.1.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::index::IndexConfig;
use kvroute_mocker::{Fleet, MockerConfig};
use kvroute_server::ingest::IngestConfig;
use kvroute_server::proxy::RouterConfig;
use kvroute_server::spec::WorkerSpec;
use kvroute_server::{serve, ServeConfig};
use serde::Serialize;
use serde_json::json;

use crate::error::{Error, Result};
use crate::stats;

/// What `kvroute bench proxy` sends.
#[derive(Debug, Clone, Copy)]
pub struct ProxyBenchConfig {
    /// Mock engines behind the router.
    pub workers: u16,
    /// Requests per phase (direct, then through the router).
    pub requests: u64,
    /// Requests in flight at once.
    pub concurrency: u64,
    /// Target requests per second (open loop, latency from each request's
    /// scheduled start); 0: closed loop, as fast as possible.
    pub rate: f64,
    /// Prompt tokens per request (a shared prefix of half, then a unique suffix).
    pub prompt_tokens: u32,
    /// Divides the engines' simulated time (large: measure the router, not the engine).
    pub speedup: f64,
    /// Alternate the two paths request by request instead of running all
    /// direct requests before all routed ones (closed loop only).
    pub interleave: bool,
}

/// One path's figures: throughput and latency statistics in µs.
///
/// A percentile that only a larger sample could tell apart from the maximum
/// (p99 of fewer than 100 requests, p99.9 of fewer than 1,000) is `None`,
/// so that a maximum is never reported under a percentile's name.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PathFigures {
    /// Requests completed per second of the phase.
    pub rps: f64,
    /// Median latency.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: Option<f64>,
    /// 99.9th percentile.
    pub p999_us: Option<f64>,
    /// The slowest request.
    pub max_us: f64,
}

impl PathFigures {
    /// The figures of `latencies_us`, completed in `secs`.
    fn of(latencies_us: Vec<f64>, secs: f64) -> Self {
        let lat = stats::sorted(latencies_us);
        PathFigures {
            rps: lat.len() as f64 / secs,
            p50_us: stats::percentile(&lat, 0.5),
            p90_us: stats::percentile(&lat, 0.9),
            p99_us: stats::resolved_percentile(&lat, 0.99),
            p999_us: stats::resolved_percentile(&lat, 0.999),
            max_us: stats::max(&lat),
        }
    }
}

/// `a - b` when both are known.
fn minus(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? - b?)
}

/// A µs figure for the table: `-` when unknown.
fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

/// The benchmark's result.
#[derive(Debug, Clone, Copy)]
pub struct ProxyBenchReport {
    /// The settings it ran with.
    pub config: ProxyBenchConfig,
    /// Straight to the engines.
    pub direct: PathFigures,
    /// Through the router.
    pub proxy: PathFigures,
}

impl ProxyBenchReport {
    /// The report as one JSON object (`direct`, `proxy`, `added_us`).
    pub fn to_json(&self) -> serde_json::Value {
        let (c, d, p) = (&self.config, self.direct, self.proxy);
        json!({
            "requests": c.requests, "concurrency": c.concurrency, "rate": c.rate,
            "prompt_tokens": c.prompt_tokens, "workers": c.workers,
            "interleave": c.interleave,
            "direct": d,
            "proxy": p,
            "added_us": {
                "p50": p.p50_us - d.p50_us,
                "p90": p.p90_us - d.p90_us,
                "p99": minus(p.p99_us, d.p99_us),
            },
        })
    }
}

impl fmt::Display for ProxyBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (c, d, p) = (&self.config, self.direct, self.proxy);
        writeln!(
            f,
            "{} requests, concurrency {}, {} prompt tokens, {} engines{}",
            c.requests,
            c.concurrency,
            c.prompt_tokens,
            c.workers,
            if c.rate > 0.0 {
                format!(", open loop at {} req/s", c.rate)
            } else if c.interleave {
                ", closed loop, paths interleaved".into()
            } else {
                ", closed loop".into()
            }
        )?;
        writeln!(
            f,
            "path      req/s      p50 µs    p90 µs    p99 µs  p99.9 µs    max µs"
        )?;
        for (name, s) in [("direct", d), ("proxy", p)] {
            writeln!(
                f,
                "{name:<8}{:>8.0}{:>11.0}{:>10.0}{:>10}{:>10}{:>10.0}",
                s.rps,
                s.p50_us,
                s.p90_us,
                cell(s.p99_us),
                cell(s.p999_us),
                s.max_us
            )?;
        }
        writeln!(
            f,
            "added   {:>8}{:>11.0}{:>10.0}{:>10}{:>10}",
            "",
            p.p50_us - d.p50_us,
            p.p90_us - d.p90_us,
            cell(minus(p.p99_us, d.p99_us)),
            cell(minus(p.p999_us, d.p999_us)),
        )
    }
}

/// Request `n`'s body: a prefix shared by one request in 8, then a suffix
/// unique to `n` (and to `path`, so that the paths of `interleave` do not
/// warm each other's caches).
fn request_body(n: u64, prompt_tokens: u32, path: u32) -> serde_json::Value {
    let half = prompt_tokens / 2;
    let prefix = (n % 8) as u32 * 100_000;
    let mut prompt: Vec<u32> = (prefix..prefix + half).collect();
    let unique = 1_000_000 + n as u32 * prompt_tokens + path * 500_000_000;
    prompt.extend(unique..unique + (prompt_tokens - half));
    json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1})
}

/// POSTs `body` and reads the whole answer; its latency in µs from `since`.
async fn timed_post(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    since: Instant,
) -> Result<f64> {
    let resp = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(Error::http(format!("POST {url}")))?;
    let status = resp.status();
    resp.bytes()
        .await
        .map_err(Error::http(format!("reading {url}")))?;
    if !status.is_success() {
        return Err(Error::Unexpected(format!("{url} answered {status}")));
    }
    Ok(since.elapsed().as_secs_f64() * 1e6)
}

/// Both paths, alternating request by request: (direct, proxied).
async fn interleaved(
    client: &reqwest::Client,
    direct: Arc<Vec<String>>,
    proxied: Arc<Vec<String>>,
    args: &ProxyBenchConfig,
) -> Result<(PathFigures, PathFigures)> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for task in 0..args.concurrency {
        let client = client.clone();
        let (direct, proxied) = (direct.clone(), proxied.clone());
        let per_task = args.requests / args.concurrency.max(1);
        let (conc, prompt_tokens) = (args.concurrency, args.prompt_tokens);
        tasks.push(tokio::spawn(async move {
            let mut d = Vec::with_capacity(per_task as usize);
            let mut p = Vec::with_capacity(per_task as usize);
            for k in 0..per_task {
                let n = k * conc + task;
                let url = &direct[(n % direct.len() as u64) as usize];
                let body = request_body(n, prompt_tokens, 0);
                d.push(timed_post(&client, url, &body, Instant::now()).await?);
                let url = &proxied[(n % proxied.len() as u64) as usize];
                let body = request_body(n, prompt_tokens, 1);
                p.push(timed_post(&client, url, &body, Instant::now()).await?);
            }
            Ok::<_, Error>((d, p))
        }));
    }
    let (mut d, mut p) = (Vec::new(), Vec::new());
    for t in tasks {
        let (td, tp) = t
            .await
            .map_err(|e| Error::Unexpected(format!("bench task: {e}")))??;
        d.extend(td);
        p.extend(tp);
    }
    let secs = started.elapsed().as_secs_f64();
    Ok((PathFigures::of(d, secs), PathFigures::of(p, secs)))
}

/// One path alone: `args.requests` requests over `urls` (round-robin).
async fn phase(
    client: &reqwest::Client,
    urls: Arc<Vec<String>>,
    args: &ProxyBenchConfig,
) -> Result<PathFigures> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for task in 0..args.concurrency {
        let client = client.clone();
        let urls = urls.clone();
        let per_task = args.requests / args.concurrency.max(1);
        let (conc, rate, prompt_tokens) = (args.concurrency, args.rate, args.prompt_tokens);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(per_task as usize);
            for k in 0..per_task {
                let n = k * conc + task;
                let scheduled = if rate > 0.0 {
                    let at = started + Duration::from_secs_f64(n as f64 / rate);
                    tokio::time::sleep_until(at.into()).await;
                    at
                } else {
                    Instant::now()
                };
                let body = request_body(n, prompt_tokens, 0);
                let url = &urls[(n % urls.len() as u64) as usize];
                lat.push(timed_post(&client, url, &body, scheduled).await?);
            }
            Ok::<_, Error>(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(
            t.await
                .map_err(|e| Error::Unexpected(format!("bench task: {e}")))??,
        );
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(PathFigures::of(all, secs))
}

/// Runs the benchmark.
pub async fn run(args: &ProxyBenchConfig) -> Result<ProxyBenchReport> {
    if args.concurrency == 0 || args.requests < args.concurrency {
        return Err(Error::Invalid(
            "requests must be at least concurrency (≥ 1)".into(),
        ));
    }
    if args.interleave && args.rate > 0.0 {
        return Err(Error::Invalid(
            "interleave runs a closed loop; a rate cannot be given".into(),
        ));
    }
    let mut config = MockerConfig {
        workers: args.workers,
        port: 0,
        kv_events_port: 0,
        replay_port: 0,
        ..MockerConfig::default()
    };
    config.timing.speedup = args.speedup;
    let fleet = Fleet::start(config).await?;
    let mut specs = Vec::new();
    for w in fleet.workers() {
        specs.push(WorkerSpec::parse(&w.worker_arg(), 16)?);
    }
    let direct: Vec<String> = fleet
        .workers()
        .iter()
        .map(|w| format!("{}/v1/completions", w.url()))
        .collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(Error::io("binding the router's port"))?;
    let addr = listener
        .local_addr()
        .map_err(Error::io("the router's address"))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        ServeConfig {
            block_size: 16,
            workers: specs,
            admin_token: None,
            unreachable_grace: Duration::from_secs(30),
            index: IndexConfig::default(),
            ingest: IngestConfig::default(),
            router: RouterConfig::default(),
            max_body_bytes: 32 << 20,
        },
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(Error::http("building the HTTP client"))?;
    // Wait for the router, then warm both paths (connections, caches, index).
    let health = format!("http://{addr}/health");
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.get(&health).send().await.is_err() {
        if Instant::now() > deadline {
            return Err(Error::Timeout("the router did not start".into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let proxied = Arc::new(vec![format!("http://{addr}/v1/completions")]);
    let direct = Arc::new(direct);
    let warm = ProxyBenchConfig {
        requests: args.concurrency * 50,
        rate: 0.0,
        ..*args
    };
    phase(&client, direct.clone(), &warm).await?;
    phase(&client, proxied.clone(), &warm).await?;
    let (d, p) = if args.interleave {
        interleaved(&client, direct, proxied, args).await?
    } else {
        let d = phase(&client, direct, args).await?;
        (d, phase(&client, proxied, args).await?)
    };
    let _ = stop.send(());
    let _ = server.await;
    fleet.shutdown().await;
    Ok(ProxyBenchReport {
        config: *args,
        direct: d,
        proxy: p,
    })
}
