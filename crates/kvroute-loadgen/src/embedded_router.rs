//! A kvroute router started in this process for one demo policy, and the
//! readiness wait every measurement of a router needs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::contender::Routing;
use kvroute_core::index::IndexConfig;
use kvroute_prompt::Renderer;
use kvroute_server::ingest::registry::IngestConfig;
use kvroute_server::ingest::spec::WorkerSpec;
use kvroute_server::proxy::ProxyConfig;
use kvroute_server::replica::ReplicaConfig;
use kvroute_server::{serve, ServeConfig};
use serde_json::{json, Map, Value};
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::metrics;
use crate::report::Fetches;

/// How the router turns text and chat requests into tokens: the same
/// rendering as the mock engines', so its predictions can be exact.
pub type RouterTokenizer = Arc<Renderer>;

/// Waits (at most `within`) until the router at `base_url` lists its
/// workers with every rank's event stream connected and past its first
/// replay (not `replaying`): until then the router does not know what the
/// engines hold (a real engine's long history takes seconds to replay).
pub async fn wait_until_connected(
    client: &reqwest::Client,
    base_url: &str,
    within: Duration,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(resp) = client.get(format!("{base_url}/workers")).send().await {
            if let Ok(doc) = resp.json::<Value>().await {
                let ranks: Vec<bool> = doc["workers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
                    .map(|r| r["connected"].as_bool().unwrap_or(false) && r["state"] != "replaying")
                    .collect();
                if !ranks.is_empty() && ranks.iter().all(|c| *c) {
                    return Ok(());
                }
            }
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout(format!(
                "the router's event streams did not connect and replay within {} s",
                within.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A router started for one policy; dropping it shuts the router down.
pub struct RunningRouter {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvroute_server::ServeError>>,
}

impl RunningRouter {
    /// Serves `specs` with `policy` on an ephemeral port of 127.0.0.1; with
    /// `replicas`, as one replica sharing its state with its peers over NATS.
    pub async fn start(
        specs: &[WorkerSpec],
        routing: Routing,
        block_size: u32,
        tokenizer: RouterTokenizer,
        replicas: Option<ReplicaConfig>,
    ) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(Error::io("binding the router's port"))?;
        let addr = listener
            .local_addr()
            .map_err(Error::io("the router's address"))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let proxy = ProxyConfig {
            policy: routing.policy,
            weights: routing.weights,
            temperature: routing.temperature,
            busy: routing.busy,
            local_prefill: routing.disagg.local_prefill(),
            deal_new_prefixes: routing.deal_new_prefixes,
            holder_stickiness: routing.stickiness,
            fetch: routing.fetch,
            replicate: routing.replicate,
            renderer: Some(tokenizer),
            ..ProxyConfig::default()
        };
        let task = tokio::spawn(serve(
            ServeConfig {
                block_size: Some(block_size),
                workers: specs.to_vec(),
                unreachable_grace: Duration::from_secs(60),
                index: IndexConfig::default(),
                index_shards: kvroute_server::default_index_shards(),
                ingest: IngestConfig::default(),
                proxy,
                max_body_bytes: 64 << 20,
                replicas,
                // The demo chose a closed admin API; no advice about its flag.
                announce_access: false,
                ..ServeConfig::default()
            },
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        Ok(RunningRouter {
            url: format!("http://{addr}"),
            stop: Some(stop),
            task,
        })
    }

    /// Waits until every rank's event stream is connected and replayed.
    pub async fn ready(&self, client: &reqwest::Client) -> Result<()> {
        wait_until_connected(client, &self.url, Duration::from_secs(60)).await
    }

    /// What the router's ingestion did: events and blocks applied, and
    /// events or envelopes it could not decode.
    pub async fn ingest_counts(&self, client: &reqwest::Client) -> Result<Map<String, Value>> {
        let text = self.metrics(client).await?;
        let mut counts = Map::new();
        counts.insert(
            "kv_events".into(),
            json!(metrics::sum(&text, "kvroute_ingest_events_total")),
        );
        counts.insert(
            "blocks_stored".into(),
            json!(metrics::sum(&text, "kvroute_index_blocks_stored_total")),
        );
        counts.insert(
            "decode_errors".into(),
            json!(
                metrics::sum(&text, "kvroute_ingest_decode_errors_total")
                    + metrics::sum(&text, "kvroute_ingest_envelope_errors_total")
            ),
        );
        Ok(counts)
    }

    /// What this router's fetch lever did: fetches handed off and fallen
    /// back, and blocks moved (`kvroute_proxy_fetches_total`,
    /// `kvroute_proxy_fetched_blocks_total`).
    pub async fn fetches(&self, client: &reqwest::Client) -> Result<Fetches> {
        let text = self.metrics(client).await?;
        let outcomes = metrics::by_label(&text, "kvroute_proxy_fetches_total", "outcome");
        let outcome = |o: &str| outcomes.get(o).copied().unwrap_or(0);
        let copies = metrics::by_label(&text, "kvroute_proxy_replications_total", "outcome");
        Ok(Fetches {
            handed_off: outcome("handed_off"),
            fell_back: outcome("fell_back"),
            blocks: metrics::sum(&text, "kvroute_proxy_fetched_blocks_total"),
            copies: copies.get("copied").copied().unwrap_or(0),
            copied_blocks: metrics::sum(&text, "kvroute_proxy_replicated_blocks_total"),
        })
    }

    /// Peer messages this replica received over NATS
    /// (`kvroute_replica_messages_received_total`).
    pub async fn replica_messages_received(&self, client: &reqwest::Client) -> Result<u64> {
        let text = self.metrics(client).await?;
        Ok(metrics::sum(
            &text,
            "kvroute_replica_messages_received_total",
        ))
    }

    /// Waits (at most `within`) until this replica is connected to NATS and
    /// hears at least `peers` other replicas; false when it did not in time.
    pub async fn replica_ready(
        &self,
        client: &reqwest::Client,
        peers: u64,
        within: Duration,
    ) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(text) = self.metrics(client).await {
                let connected = metrics::sum(&text, "kvroute_replica_nats_connected") == 1;
                if connected && metrics::sum(&text, "kvroute_replica_peers") >= peers {
                    return true;
                }
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The router's `/metrics` text.
    async fn metrics(&self, client: &reqwest::Client) -> Result<String> {
        let url = format!("{}/metrics", self.url);
        client
            .get(&url)
            .send()
            .await
            .map_err(Error::http(format!("GET {url}")))?
            .text()
            .await
            .map_err(Error::http(format!("reading {url}")))
    }

    /// Stops the router and waits (at most 10 s) for it to finish.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
    }
}

impl Drop for RunningRouter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
