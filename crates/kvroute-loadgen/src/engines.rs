//! Mock engines started in this process for the demo and `bench proxy`:
//! one aggregated fleet, or a disaggregated one (prefill engines and decode
//! engines, [`PdLayout`]), and the counters that give a disaggregated
//! fleet's prefill-side hit rate.

use kvroute_core::event::WorkerFlavor;
use kvroute_core::scheduler::WorkerRole;
use kvroute_mocker::{Fleet, MockerConfig, WorkerInfo};
use kvroute_server::ingest::spec::WorkerSpec;

use crate::contender::Disagg;
use crate::error::{Error, Result};
use crate::metrics;
use crate::preset::PdLayout;

/// The engines a demo or a benchmark drives, started in this process.
pub struct Engines {
    /// One fleet per role: `[all]`, or `[prefill, decode]`.
    fleets: Vec<(Fleet, WorkerRole)>,
}

impl Engines {
    /// Starts `mocker.workers` aggregated engines, or with `layout` its
    /// prefill engines then its decode engines (`mocker.workers` ignored).
    pub async fn start(mocker: MockerConfig, layout: Option<PdLayout>) -> Result<Engines> {
        let Some(layout) = layout else {
            let fleet = Fleet::start(mocker).await?;
            return Ok(Engines {
                fleets: vec![(fleet, WorkerRole::Both)],
            });
        };
        let mut fleets = Vec::new();
        for (role, workers) in [
            (WorkerRole::Prefill, layout.prefill),
            (WorkerRole::Decode, layout.decode),
        ] {
            let config = MockerConfig {
                role,
                workers,
                // Each SGLang prefill engine's bootstrap server on a port of its own.
                bootstrap_port: 0,
                seed: mocker
                    .seed
                    .wrapping_add(u64::from(role == WorkerRole::Decode)),
                ..mocker.clone()
            };
            match Fleet::start(config).await {
                Ok(fleet) => fleets.push((fleet, role)),
                Err(e) => {
                    for (fleet, _) in fleets {
                        fleet.shutdown().await;
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(Engines { fleets })
    }

    /// Every engine with the name the router knows it by: `w0`, `w1`, … in
    /// an aggregated fleet, `prefill-0`, …, `decode-0`, … in a disaggregated one.
    fn named(&self) -> impl Iterator<Item = (String, &WorkerInfo)> {
        self.fleets.iter().flat_map(|(fleet, role)| {
            fleet.workers().iter().enumerate().map(move |(k, w)| {
                let name = match role {
                    WorkerRole::Both => w.name.clone(),
                    role => format!("{role}-{k}"),
                };
                (name, w)
            })
        })
    }

    /// Every engine as `kvroute serve --worker` takes it, by the name
    /// [`Engines::specs`] gives it.
    pub fn worker_args(&self) -> Vec<String> {
        self.named()
            .map(|(name, w)| w.worker_arg_as(&name))
            .collect()
    }

    /// Every engine's base URL.
    pub fn urls(&self) -> Vec<String> {
        self.named().map(|(_, w)| w.url()).collect()
    }

    /// The engines as the router's workers, served as `disagg` says:
    /// [`Disagg::Aggregated`] registers every engine with `role=both`.
    pub fn specs(&self, block_size: u32, disagg: Disagg) -> Result<Vec<WorkerSpec>> {
        let mut specs = Vec::new();
        for (name, w) in self.named() {
            let mut spec = WorkerSpec::parse(&w.worker_arg_as(&name), Some(block_size))?;
            if disagg == Disagg::Aggregated {
                spec.role = WorkerRole::Both;
            }
            specs.push(spec);
        }
        Ok(specs)
    }

    /// Whether prefill and decode run on different engines.
    pub fn disaggregated(&self) -> bool {
        self.fleets.len() > 1
    }

    /// Stops every engine.
    pub async fn shutdown(self) {
        for (fleet, _) in self.fleets {
            fleet.shutdown().await;
        }
    }
}

/// Prompt tokens the engines looked up, found cached, and received from a
/// prefill engine, summed over the fleet (vLLM's prefix-cache counters and
/// the mock engine's transfer counter).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptWork {
    queries: u64,
    hits: u64,
    received: u64,
}

impl PromptWork {
    /// The fleet's counters now; `None` for SGLang engines, which count no
    /// prefix-cache hits in tokens.
    pub async fn read(
        client: &reqwest::Client,
        urls: &[String],
        flavor: WorkerFlavor,
    ) -> Result<Option<PromptWork>> {
        if flavor != WorkerFlavor::Vllm {
            return Ok(None);
        }
        let mut work = PromptWork::default();
        for url in urls {
            let text = metrics::get_text(client, url, "/metrics").await?;
            work.queries += metrics::sum(&text, "vllm:prefix_cache_queries_total");
            work.hits += metrics::sum(&text, "vllm:prefix_cache_hits_total");
            work.received += metrics::sum(&text, "kvroute_mocker_kv_received_tokens_total");
        }
        Ok(Some(work))
    }

    /// Of `prompt_tokens` sent between `self` and `later`, the fraction no
    /// engine computed: cached where it was prefilled. KV a decode engine
    /// received is not a hit: its prefill engine computed it.
    pub fn hit_rate_until(self, later: PromptWork, prompt_tokens: u64) -> Result<f64> {
        let delta = |a: u64, b: u64| b.checked_sub(a);
        let computed = delta(self.queries, later.queries)
            .zip(delta(self.hits, later.hits))
            .zip(delta(self.received, later.received))
            .and_then(|((q, h), r)| q.checked_sub(h)?.checked_sub(r))
            .ok_or_else(|| Error::Unexpected("an engine's counters went backwards".into()))?;
        if prompt_tokens == 0 {
            return Ok(0.0);
        }
        Ok(1.0 - (computed as f64 / prompt_tokens as f64).min(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_side_hit_rate_counts_received_kv_as_computed_elsewhere() {
        let before = PromptWork {
            queries: 1_000,
            hits: 400,
            received: 0,
        };
        // A split request of 100 tokens: its prefill engine found 60
        // cached and computed 40; the decode engine received 99 and
        // computed the last one. Computed in all: 41.
        let after = PromptWork {
            queries: 1_200,
            hits: 460,
            received: 99,
        };
        let rate = before.hit_rate_until(after, 100).expect("monotonic");
        assert!((rate - 0.59).abs() < 1e-12, "{rate}");
        let e = after.hit_rate_until(before, 100).expect_err("backwards");
        assert!(e.to_string().contains("backwards"), "{e}");
        assert_eq!(before.hit_rate_until(before, 0).ok(), Some(0.0));
    }
}
