//! `kvroute bench proxy`: the latency `kvroute serve` adds to a request.
//!
//! Starts a fleet of mock engines and a router over them in this process,
//! then sends the same requests twice: straight to the engines (round-robin)
//! and through the router. The difference between the two latency
//! distributions is the router's cost: parsing, hashing, the index walk, the
//! pick, and the extra HTTP hop over 127.0.0.1.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::index::IndexConfig;
use kvroute_mocker::{Fleet, MockerConfig};
use kvroute_server::ingest::spec::WorkerSpec;
use kvroute_server::ingest::stream::IngestConfig;
use kvroute_server::proxy::ProxyConfig;
use kvroute_server::{serve, ServeConfig};
use serde_json::json;

/// Arguments of `kvroute bench proxy`.
#[derive(Debug, Args)]
pub struct ProxyBenchArgs {
    /// Mock engines behind the router.
    #[arg(long, default_value_t = 2)]
    workers: u16,
    /// Requests per phase (direct, then through the router).
    #[arg(long, default_value_t = 20_000)]
    requests: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: u64,
    /// Target requests per second (open loop, latency measured from each
    /// request's scheduled start); 0: closed loop, as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Prompt tokens per request (a shared prefix of half, then a unique suffix).
    #[arg(long, default_value_t = 256)]
    prompt_tokens: u32,
    /// Divides the engines' simulated time (large: measure the router, not the engine).
    #[arg(long, default_value_t = 10_000.0)]
    speedup: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Alternate the two paths request by request (each task sends one
    /// request straight to an engine, then one through the router) instead of
    /// running all direct requests before all routed ones, so that drift in
    /// the machine's speed weighs on both alike. Closed loop only.
    #[arg(long)]
    interleave: bool,
}

#[derive(Debug, Clone, Copy)]
struct Summary {
    rps: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    p999: f64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summary(mut lat: Vec<f64>, secs: f64) -> Summary {
    lat.sort_by(f64::total_cmp);
    Summary {
        rps: lat.len() as f64 / secs,
        p50: percentile(&lat, 0.5),
        p90: percentile(&lat, 0.9),
        p99: percentile(&lat, 0.99),
        p999: percentile(&lat, 0.999),
    }
}

/// Request `n`'s body: a prefix shared by one request in 8, then a suffix
/// unique to `n` (and to `path`, so that the paths of `--interleave` do not
/// warm each other's caches).
fn request_body(n: u64, prompt_tokens: u32, path: u32) -> serde_json::Value {
    let half = prompt_tokens / 2;
    let prefix = (n % 8) as u32 * 100_000;
    let mut prompt: Vec<u32> = (prefix..prefix + half).collect();
    let unique = 1_000_000 + n as u32 * prompt_tokens + path * 500_000_000;
    prompt.extend(unique..unique + (prompt_tokens - half));
    json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1})
}

async fn timed_post(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> Result<f64> {
    let started = Instant::now();
    let resp = client.post(url).json(body).send().await?;
    let status = resp.status();
    resp.bytes().await?;
    if !status.is_success() {
        bail!("{url} answered {status}");
    }
    Ok(started.elapsed().as_secs_f64() * 1e6)
}

/// Both paths, alternating request by request: (direct, proxied).
async fn interleaved(
    client: &reqwest::Client,
    direct: Arc<Vec<String>>,
    proxied: Arc<Vec<String>>,
    args: &ProxyBenchArgs,
) -> Result<(Summary, Summary)> {
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
                d.push(timed_post(&client, url, &request_body(n, prompt_tokens, 0)).await?);
                let url = &proxied[(n % proxied.len() as u64) as usize];
                p.push(timed_post(&client, url, &request_body(n, prompt_tokens, 1)).await?);
            }
            Ok::<_, anyhow::Error>((d, p))
        }));
    }
    let (mut d, mut p) = (Vec::new(), Vec::new());
    for t in tasks {
        let (td, tp) = t.await.context("bench task")??;
        d.extend(td);
        p.extend(tp);
    }
    let secs = started.elapsed().as_secs_f64();
    Ok((summary(d, secs), summary(p, secs)))
}

async fn phase(
    client: &reqwest::Client,
    urls: Arc<Vec<String>>,
    args: &ProxyBenchArgs,
) -> Result<Summary> {
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
                let resp = client.post(url).json(&body).send().await?;
                let status = resp.status();
                resp.bytes().await?;
                if !status.is_success() {
                    anyhow::bail!("{url} answered {status}");
                }
                lat.push(scheduled.elapsed().as_secs_f64() * 1e6);
            }
            Ok::<_, anyhow::Error>(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.context("bench task")??);
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(summary(all, secs))
}

/// Runs the benchmark.
pub fn run(args: &ProxyBenchArgs) -> Result<ExitCode> {
    if args.concurrency == 0 || args.requests < args.concurrency {
        bail!("--requests must be at least --concurrency (≥ 1)");
    }
    if args.interleave && args.rate > 0.0 {
        bail!("--interleave runs a closed loop; leave out --rate");
    }
    let runtime = crate::cmd::runtime()?;
    runtime.block_on(async {
        let mut config = MockerConfig {
            workers: args.workers,
            port: 0,
            kv_events_port: 0,
            replay_port: 0,
            ..MockerConfig::default()
        };
        config.timing.speedup = args.speedup;
        let fleet = Fleet::start(config).await.context("starting the mock engines")?;
        let mut specs = Vec::new();
        for w in fleet.workers() {
            specs.push(WorkerSpec::parse(&w.worker_arg(), 16).context("worker spec")?);
        }
        let direct: Vec<String> = fleet
            .workers()
            .iter()
            .map(|w| format!("{}/v1/completions", w.url()))
            .collect();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            ServeConfig {
                block_size: 16,
                workers: specs,
                unreachable_grace: Duration::from_secs(30),
                index: IndexConfig::default(),
                ingest: IngestConfig::default(),
                proxy: ProxyConfig::default(),
                max_body_bytes: 32 << 20,
                ..ServeConfig::default()
            },
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .build()?;
        // Wait for the router, then warm both paths (connections, caches, index).
        let health = format!("http://{addr}/health");
        let deadline = Instant::now() + Duration::from_secs(10);
        while client.get(&health).send().await.is_err() {
            if Instant::now() > deadline {
                bail!("the router did not start");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let proxied = Arc::new(vec![format!("http://{addr}/v1/completions")]);
        let direct = Arc::new(direct);
        let warm = ProxyBenchArgs {
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
        if args.json {
            println!(
                "{}",
                json!({
                    "requests": args.requests, "concurrency": args.concurrency, "rate": args.rate,
                    "prompt_tokens": args.prompt_tokens, "workers": args.workers,
                    "interleave": args.interleave,
                    "direct": {"rps": d.rps, "p50_us": d.p50, "p90_us": d.p90, "p99_us": d.p99, "p999_us": d.p999},
                    "proxy": {"rps": p.rps, "p50_us": p.p50, "p90_us": p.p90, "p99_us": p.p99, "p999_us": p.p999},
                    "added_us": {"p50": p.p50 - d.p50, "p90": p.p90 - d.p90, "p99": p.p99 - d.p99},
                })
            );
        } else {
            println!(
                "{} requests, concurrency {}, {} prompt tokens, {} engines{}",
                args.requests,
                args.concurrency,
                args.prompt_tokens,
                args.workers,
                if args.rate > 0.0 {
                    format!(", open loop at {} req/s", args.rate)
                } else if args.interleave {
                    ", closed loop, paths interleaved".into()
                } else {
                    ", closed loop".into()
                }
            );
            println!("path      req/s      p50 µs    p90 µs    p99 µs  p99.9 µs");
            for (name, s) in [("direct", d), ("proxy", p)] {
                println!(
                    "{name:<8}{:>8.0}{:>11.0}{:>10.0}{:>10.0}{:>10.0}",
                    s.rps, s.p50, s.p90, s.p99, s.p999
                );
            }
            println!(
                "added   {:>8}{:>11.0}{:>10.0}{:>10.0}{:>10.0}",
                "",
                p.p50 - d.p50,
                p.p90 - d.p90,
                p.p99 - d.p99,
                p.p999 - d.p999
            );
        }
        Ok(ExitCode::SUCCESS)
    })
}
