//! `kvroute bench proxy`: the latency and the CPU `kvroute serve` adds to a
//! request.
//!
//! Starts a fleet of mock engines in this process and the router as a real
//! child process (`kvroute serve` from [`ProxyBenchConfig::router_exe`],
//! given the engines as `--worker` specs), then, at each concurrency, sends
//! the same kind of requests twice: straight to the engines (round-robin)
//! and through the router. The difference between the two latency
//! distributions is the router's cost: parsing, hashing, the index walk, the
//! pick, and the extra HTTP hop over 127.0.0.1. The router's CPU time (user +
//! system, from `/proc/PID/stat`) is read just before and just after the
//! routed phase and divided by the routed requests completed; it includes
//! the ingestion of the KV events those requests make the engines publish
//! (with `interleave`, also those of the direct requests sent meanwhile).
//!
//! With a [`PdLayout`] the engines are prefill and decode engines and the
//! router splits every request (`--local-prefill-max-tokens 0`): each
//! routed request is two legs, prefill then decode, so its CPU per request
//! compares with an aggregated run's. The direct path still sends whole
//! requests round-robin to every engine (vLLM engines of either role serve
//! them), so the latency difference is not the router's alone there.

mod body;
mod phase;
mod report;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvroute_mocker::MockerConfig;

use super::child::RouterProcess;
use crate::embedded_router::wait_until_connected;
use crate::engines::Engines;
use crate::error::{Error, Result};
use crate::metrics::{accuracy_between, accuracy_counters};
use crate::preset::PdLayout;
use crate::workload::TextRenderer;
use body::Bodies;
use phase::Loop;
pub use report::{PathFigures, ProxyBenchReport, ProxyRun};

/// The tokenizer of text prompts, given to the router (`kvroute serve
/// --tokenizer`) and to the mock engines alike, so that the router's view of
/// a prompt is the engines' and their `cached_tokens` agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    /// The mocker's built-in tokenizer (prompts of four-letter words, one
    /// token each).
    Builtin,
    /// A Hugging Face `tokenizer.json` (prompts are its decoding of random ids).
    File(PathBuf),
}

impl std::str::FromStr for TokenizerSource {
    type Err = std::convert::Infallible;

    /// `builtin`, or the path of a `tokenizer.json`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(if s == "builtin" {
            TokenizerSource::Builtin
        } else {
            TokenizerSource::File(s.into())
        })
    }
}

/// `builtin` or the file's path, as `kvroute serve --tokenizer` takes it.
impl fmt::Display for TokenizerSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerSource::Builtin => f.write_str("builtin"),
            TokenizerSource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// What each request's prompt is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// `"prompt": [ids…]`: half a prefix shared by one request in 8, half
    /// unique; the router needs no tokenizer.
    TokenIds {
        /// Ids per prompt.
        tokens: u32,
    },
    /// `"prompt": "text"` of the same shape in words, tokenized by the
    /// router and the engines with `tokenizer`.
    Text {
        /// Words per prompt.
        words: u32,
        /// Whose tokenizer.
        tokenizer: TokenizerSource,
        /// Every request sends the same prompt, as a tool that replays one
        /// body does (`wrk`); otherwise half of each prompt is new.
        repeat: bool,
    },
}

/// What `kvroute bench proxy` runs.
#[derive(Debug, Clone)]
pub struct ProxyBenchConfig {
    /// The `kvroute` executable whose `serve` is measured.
    pub router_exe: PathBuf,
    /// Mock engines behind the router (ignored with `pd`).
    pub workers: u16,
    /// Prefill and decode engines instead, every request split by the router.
    pub pd: Option<PdLayout>,
    /// Requests per phase (direct, then through the router), at each concurrency.
    pub requests: u64,
    /// Requests in flight at once; one run per value, in order.
    pub concurrency: Vec<u64>,
    /// Target requests per second (open loop, latency from each request's
    /// scheduled start); 0: closed loop, as fast as possible.
    pub rate: f64,
    /// The prompts.
    pub prompt: Prompt,
    /// Divides the engines' simulated time (large: measure the router, not the engine).
    pub speedup: f64,
    /// Alternate the two paths request by request instead of running all
    /// direct requests before all routed ones (closed loop only).
    pub interleave: bool,
}

impl ProxyBenchConfig {
    fn validate(&self) -> Result<()> {
        if self.concurrency.is_empty()
            || self
                .concurrency
                .iter()
                .any(|&c| c == 0 || self.requests < c)
        {
            return Err(Error::Invalid(
                "requests must be at least every concurrency (≥ 1)".into(),
            ));
        }
        if self.interleave && self.rate > 0.0 {
            return Err(Error::Invalid(
                "interleave runs a closed loop; a rate cannot be given".into(),
            ));
        }
        Ok(())
    }
}

/// The engines, the router process over them, and how to reach both.
struct Bench {
    fleet: Engines,
    router: RouterProcess,
    client: reqwest::Client,
    bodies: Bodies,
    direct: Arc<Vec<String>>,
    routed: Arc<Vec<String>>,
}

impl Bench {
    async fn start(config: &ProxyBenchConfig) -> Result<Bench> {
        let (bodies, engine_tokenizer, mut router_flags) = match &config.prompt {
            Prompt::TokenIds { tokens } => (Bodies::TokenIds { tokens: *tokens }, None, vec![]),
            Prompt::Text {
                words,
                tokenizer,
                repeat,
            } => {
                let flags = vec!["--tokenizer".to_owned(), tokenizer.to_string()];
                match tokenizer {
                    TokenizerSource::Builtin => (Bodies::text(*words, None, *repeat), None, flags),
                    TokenizerSource::File(path) => {
                        let render = TextRenderer::from_tokenizer_file(path)?;
                        (
                            Bodies::text(*words, Some(render), *repeat),
                            Some(path.clone()),
                            flags,
                        )
                    }
                }
            }
        };
        let mut mocker = MockerConfig {
            workers: config.workers,
            port: 0,
            kv_events_port: 0,
            replay_port: 0,
            tokenizer: engine_tokenizer,
            ..MockerConfig::default()
        };
        mocker.timing.speedup = config.speedup;
        let fleet = Engines::start(mocker, config.pd).await?;
        let specs = fleet.worker_args();
        if config.pd.is_some() {
            router_flags.extend(["--local-prefill-max-tokens".to_owned(), "0".to_owned()]);
        }
        let exe = config.router_exe.clone();
        let router =
            tokio::task::spawn_blocking(move || RouterProcess::spawn(&exe, &specs, &router_flags))
                .await
                .map_err(|e| Error::Unexpected(format!("starting the router: {e}")))??;
        let client = crate::driver::client()?;
        wait_until_connected(&client, &router.url, Duration::from_secs(20)).await?;
        let direct = fleet
            .urls()
            .iter()
            .map(|url| format!("{url}/v1/completions"))
            .collect();
        let routed = vec![format!("{}/v1/completions", router.url)];
        Ok(Bench {
            fleet,
            router,
            client,
            bodies,
            direct: Arc::new(direct),
            routed: Arc::new(routed),
        })
    }

    /// Warms both paths, then measures them at `concurrency`; requests are
    /// numbered from `first`.
    async fn measure(
        &self,
        config: &ProxyBenchConfig,
        concurrency: u64,
        first: u64,
    ) -> Result<ProxyRun> {
        let (client, bodies) = (&self.client, &self.bodies);
        let spec = Loop {
            requests: config.requests,
            concurrency,
            rate: config.rate,
            first,
        };
        // Connections, caches and the index warm on both paths first.
        let warm = Loop {
            requests: concurrency * 50,
            rate: 0.0,
            ..spec
        };
        phase::single(client, self.direct.clone(), bodies, warm).await?;
        phase::single(client, self.routed.clone(), bodies, warm).await?;
        let accuracy_before = accuracy_counters(client, &self.router.url).await;
        let (direct, routed, cpu) = if config.interleave {
            let cpu_before = self.router.cpu_time()?;
            let (d, r) = phase::interleaved(
                client,
                self.direct.clone(),
                self.routed.clone(),
                bodies,
                spec,
            )
            .await?;
            (d, r, self.router.cpu_time()?.saturating_sub(cpu_before))
        } else {
            let d = phase::single(client, self.direct.clone(), bodies, spec).await?;
            let cpu_before = self.router.cpu_time()?;
            let r = phase::single(client, self.routed.clone(), bodies, spec).await?;
            (d, r, self.router.cpu_time()?.saturating_sub(cpu_before))
        };
        // The router compares after each response ends: give the last ones a moment.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let accuracy_after = accuracy_counters(client, &self.router.url).await;
        Ok(ProxyRun {
            concurrency,
            direct: PathFigures::of(direct.latencies_us, direct.secs),
            proxy: PathFigures::of(routed.latencies_us, routed.secs),
            router_cpu_s: cpu.as_secs_f64(),
            index_accuracy: accuracy_before
                .zip(accuracy_after)
                .and_then(|(before, after)| accuracy_between(before, after)),
        })
    }
}

/// Runs the benchmark: one [`ProxyRun`] per concurrency.
pub async fn run(config: &ProxyBenchConfig) -> Result<ProxyBenchReport> {
    config.validate()?;
    let bench = Bench::start(config).await?;
    let mut runs = Vec::new();
    let mut first = 0;
    for &concurrency in &config.concurrency {
        let run = bench.measure(config, concurrency, first).await;
        match run {
            Ok(run) => runs.push(run),
            Err(e) => {
                bench.fleet.shutdown().await;
                return Err(e);
            }
        }
        // Fresh prompts for the next concurrency: no suffix is seen twice.
        first += config.requests.max(concurrency * 50);
    }
    let Bench { fleet, router, .. } = bench;
    drop(router);
    fleet.shutdown().await;
    Ok(ProxyBenchReport {
        config: config.clone(),
        runs,
    })
}
