//! Real engines for `kvroute demo --engines`: the vLLM engines
//! `scripts/real-engines start` runs, as its `engines.json` lists them, and
//! the fleet the demo drives — those, or its own mock engines.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_server::ingest::spec::WorkerSpec;
use serde_json::{json, Value};

use crate::contender::Disagg;
use crate::driver::Endpoint;
use crate::engines::Engines;
use crate::error::{Error, Result};
use crate::event_oracle::EventSource;

/// Token ids a workload may use on the project's tiny model when
/// `engines.json` does not say: its plain words (`w16` … `w31999`).
const TINY_TOKEN_IDS: (u32, u32) = (16, 32_000);

/// Times a cache reset is asked for while the engine is still busy.
const RESET_TRIES: usize = 50;

/// One engine of `engines.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealEngine {
    /// Its name, also its worker's name at the router.
    pub name: String,
    /// Its `--worker` spec.
    pub worker: String,
    /// Its base URL, event publisher and replay socket.
    pub source: EventSource,
}

/// The engines of an `engines.json`, and what requests to them need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealEngines {
    /// The file they were read from.
    pub path: PathBuf,
    /// The engines.
    pub engines: Vec<RealEngine>,
    /// The model name they serve (every request's `model`).
    pub served_model: String,
    /// The model's `tokenizer.json`, when the file names one.
    pub tokenizer: Option<PathBuf>,
    /// Token ids a workload may draw from: `[low, high)`.
    pub token_ids: (u32, u32),
    /// Tokens per KV block.
    pub block_size: u32,
}

impl RealEngines {
    /// Reads `engines.json` (as `scripts/real-engines start` writes it).
    pub fn read(path: &Path) -> Result<RealEngines> {
        let text = std::fs::read_to_string(path)
            .map_err(Error::io(format!("reading {}", path.display())))?;
        let doc: Value = serde_json::from_str(&text)?;
        let bad = |what: &str| {
            Error::Invalid(format!(
                "{}: no {what} (a file written by `scripts/real-engines start`)",
                path.display()
            ))
        };
        let text_of =
            |v: &Value, what: &str| v.as_str().map(str::to_owned).ok_or_else(|| bad(what));
        let mut engines = Vec::new();
        for e in doc["engines"].as_array().ok_or_else(|| bad("engines"))? {
            engines.push(RealEngine {
                name: text_of(&e["name"], "engine name")?,
                worker: text_of(&e["worker"], "worker spec")?,
                source: EventSource {
                    url: text_of(&e["url"], "engine url")?,
                    events: text_of(&e["events"], "events endpoint")?,
                    replay: text_of(&e["replay"], "replay endpoint")?,
                },
            });
        }
        if engines.is_empty() {
            return Err(bad("engine"));
        }
        let token_ids = match doc["token_ids"].as_array().map(Vec::as_slice) {
            Some([low, high]) => (
                low.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| bad("token_ids"))?,
                high.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| bad("token_ids"))?,
            ),
            _ => TINY_TOKEN_IDS,
        };
        Ok(RealEngines {
            path: path.to_owned(),
            engines,
            served_model: text_of(&doc["served_model_name"], "served_model_name")?,
            tokenizer: doc["tokenizer"].as_str().map(PathBuf::from),
            token_ids,
            block_size: doc["block_size"]
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(32),
        })
    }

    /// Empties every engine's prefix cache (`POST /reset_prefix_cache`,
    /// which vLLM serves with `VLLM_SERVER_DEV_MODE=1`), then sends each a
    /// one-token request: vLLM publishes its `AllBlocksCleared` only with
    /// its next scheduler step, and a router started next must see it.
    pub(crate) async fn reset(&self, client: &reqwest::Client) -> Result<()> {
        for e in &self.engines {
            let url = format!("{}/reset_prefix_cache", e.source.url);
            let mut done = false;
            for _ in 0..RESET_TRIES {
                let resp = client
                    .post(&url)
                    .send()
                    .await
                    .map_err(Error::http(format!("resetting {}", e.source.url)))?;
                if !resp.status().is_success() {
                    return Err(Error::Unexpected(format!(
                        "{url} answered {} (the engines need VLLM_SERVER_DEV_MODE=1, as scripts/real-engines sets)",
                        resp.status()
                    )));
                }
                let body: Value = resp.json().await.map_err(Error::http(url.clone()))?;
                if body["success"] == true {
                    done = true;
                    break;
                }
                // Blocks still held by a request: try again shortly.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if !done {
                return Err(Error::Unexpected(format!(
                    "{url} kept answering success: false"
                )));
            }
            let flush =
                json!({"model": self.served_model, "prompt": [self.token_ids.0], "max_tokens": 1});
            let resp = client
                .post(format!("{}/v1/completions", e.source.url))
                .json(&flush)
                .send()
                .await
                .map_err(Error::http(format!("flushing {}", e.source.url)))?;
            if !resp.status().is_success() {
                return Err(Error::Unexpected(format!(
                    "{}/v1/completions answered {}",
                    e.source.url,
                    resp.status()
                )));
            }
        }
        Ok(())
    }
}

/// The engines a demo drives: its own mock engines, or real ones.
pub(crate) enum Fleet {
    /// Mock engines started in this process.
    Mock(Engines),
    /// Real engines running elsewhere (never stopped by the demo).
    Real(RealEngines),
}

impl Fleet {
    /// Every engine's base URL.
    pub(crate) fn urls(&self) -> Vec<String> {
        match self {
            Fleet::Mock(m) => m.urls(),
            Fleet::Real(r) => r.engines.iter().map(|e| e.source.url.clone()).collect(),
        }
    }

    /// The engines as the router's workers.
    pub(crate) fn specs(&self, block_size: u32, disagg: Disagg) -> Result<Vec<WorkerSpec>> {
        match self {
            Fleet::Mock(m) => m.specs(block_size, disagg),
            Fleet::Real(r) => r
                .engines
                .iter()
                .map(|e| Ok(WorkerSpec::parse(&e.worker, Some(block_size))?))
                .collect(),
        }
    }

    /// Whether prefill and decode run on different engines.
    pub(crate) fn disaggregated(&self) -> bool {
        matches!(self, Fleet::Mock(m) if m.disaggregated())
    }

    /// The oracle over these engines.
    pub(crate) fn oracle(&self) -> Endpoint {
        match self {
            Fleet::Mock(m) => Endpoint::Oracle { workers: m.urls() },
            Fleet::Real(r) => Endpoint::EventOracle {
                engines: r.engines.iter().map(|e| e.source.clone()).collect(),
            },
        }
    }

    /// Empties every engine's cache, so each policy starts cold.
    pub(crate) async fn reset(&self, client: &reqwest::Client) -> Result<()> {
        match self {
            Fleet::Mock(_) => crate::reset_caches(client, &self.urls()).await,
            Fleet::Real(r) => r.reset(client).await,
        }
    }

    /// Stops the mock engines (real ones keep running).
    pub(crate) async fn shutdown(self) {
        if let Fleet::Mock(m) = self {
            m.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_json_is_read_with_the_tiny_models_defaults() {
        let dir = std::env::temp_dir().join(format!("kvroute-real-engines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("engines.json");
        let doc = json!({"served_model_name": "tiny", "tokenizer": "/m/tokenizer.json", "block_size": 32,
            "engines": [{"name": "e0", "url": "http://127.0.0.1:1", "events": "tcp://127.0.0.1:2",
                         "replay": "tcp://127.0.0.1:3", "worker": "name=e0,url=http://127.0.0.1:1,events=tcp://127.0.0.1:2"}]});
        std::fs::write(&path, doc.to_string()).expect("write");
        let r = RealEngines::read(&path).expect("read");
        assert_eq!(
            (r.engines.len(), r.served_model.as_str(), r.token_ids),
            (1, "tiny", TINY_TOKEN_IDS)
        );
        assert_eq!(r.engines[0].source.replay, "tcp://127.0.0.1:3");
        std::fs::write(&path, r#"{"engines": []}"#).expect("write");
        let e = RealEngines::read(&path).expect_err("no engines");
        assert!(e.to_string().contains("scripts/real-engines"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
