//! What `bench replicas` reads from each router process: the requests it
//! routed per engine (`kvroute_proxy_routed_total` in `/metrics`) and its
//! replica sync as `/workers` shows it (peers heard, peer delay, publish
//! cost), and the wait until two replicas hear each other.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::metrics;

/// The router's counter of requests forwarded per (worker, rank).
const ROUTED: &str = "kvroute_proxy_routed_total";

/// Percentiles of a delay as `/workers` gives them (exact, over the
/// replica's last samples), in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub struct Delay {
    /// Samples ever taken (not only those kept).
    pub count: u64,
    /// Median of the kept samples.
    pub p50_us: u64,
    /// 99th percentile of the kept samples.
    pub p99_us: u64,
    /// Largest kept sample.
    pub max_us: u64,
}

/// One replica's sync after a phase, from its `/workers`.replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SyncFigures {
    /// The replica's `--replica-id`.
    pub replica_id: String,
    /// Whether it was connected to NATS when read.
    pub connected: bool,
    /// The peers it heard, by replica id.
    pub peers: Vec<String>,
    /// Delay from a peer's admission of a request to this replica applying
    /// it; `None` when it applied none.
    pub peer_delay: Option<Delay>,
    /// Time a request spent handing an event to the outbox; `None` when
    /// none was handed.
    pub publish_cost: Option<Delay>,
    /// Peer messages that never arrived (sequence gaps).
    pub lost_messages: u64,
    /// Events not published because NATS was down or too slow.
    pub dropped_events: u64,
    /// Times the NATS connection went down.
    pub outages: u64,
}

/// `/workers`.replicas as the server serializes it (the fields read here).
#[derive(Debug, Deserialize)]
struct SyncDoc {
    replica_id: String,
    connected: bool,
    outages: u64,
    lost_messages: u64,
    dropped_events: u64,
    peer_delay: Option<Delay>,
    publish_cost: Option<Delay>,
    peers: Vec<PeerDoc>,
}

/// One entry of `/workers`.replicas.peers.
#[derive(Debug, Deserialize)]
struct PeerDoc {
    replica_id: String,
}

impl From<SyncDoc> for SyncFigures {
    fn from(doc: SyncDoc) -> Self {
        SyncFigures {
            replica_id: doc.replica_id,
            connected: doc.connected,
            peers: doc.peers.into_iter().map(|p| p.replica_id).collect(),
            peer_delay: doc.peer_delay,
            publish_cost: doc.publish_cost,
            lost_messages: doc.lost_messages,
            dropped_events: doc.dropped_events,
            outages: doc.outages,
        }
    }
}

/// Requests the router at `base` routed to each worker so far, summed over
/// the worker's ranks.
pub(crate) async fn routed_per_worker(
    client: &reqwest::Client,
    base: &str,
) -> Result<BTreeMap<String, u64>> {
    let text = metrics::get_text(client, base, "/metrics").await?;
    Ok(metrics::by_label(&text, ROUTED, "worker"))
}

/// The replica sync of the router at `base`; `None` when it runs without
/// `--nats`.
pub(crate) async fn sync_figures(
    client: &reqwest::Client,
    base: &str,
) -> Result<Option<SyncFigures>> {
    let text = metrics::get_text(client, base, "/workers").await?;
    parse_sync(&text)
}

/// The `replicas` object of a `/workers` body.
fn parse_sync(workers: &str) -> Result<Option<SyncFigures>> {
    let mut doc: Value = serde_json::from_str(workers)?;
    let sync: Option<SyncDoc> = serde_json::from_value(doc["replicas"].take())?;
    Ok(sync.map(SyncFigures::from))
}

/// Each rank of the router at `base` as `worker/rank state` (with
/// `disconnected` and the state's reason when there are), for an error
/// message; what went wrong when `/workers` does not answer.
pub(crate) async fn rank_states(client: &reqwest::Client, base: &str) -> String {
    match metrics::get_text(client, base, "/workers").await {
        Ok(text) => describe_ranks(&text),
        Err(e) => format!("/workers did not answer ({e})"),
    }
}

/// The counters of a rank's stream that say how its replays went.
const RANK_COUNTERS: [&str; 6] = [
    "batches",
    "resyncs",
    "replays_ok",
    "replays_incomplete",
    "replay_timeouts",
    "verifies",
];

/// [`rank_states`] of a `/workers` body.
fn describe_ranks(workers: &str) -> String {
    let Ok(doc) = serde_json::from_str::<Value>(workers) else {
        return "/workers is not JSON".into();
    };
    let mut out = Vec::new();
    for w in doc["workers"].as_array().into_iter().flatten() {
        for r in w["ranks"].as_array().into_iter().flatten() {
            let mut s = format!(
                "{}/{} {}",
                w["name"].as_str().unwrap_or("?"),
                r["dp_rank"],
                r["state"].as_str().unwrap_or("?")
            );
            if r["connected"] != true && r["state"] != "disconnected" {
                s.push_str(" disconnected");
            }
            if let Some(reason) = r["state_reason"].as_str() {
                s.push_str(&format!(" ({reason})"));
            }
            let counters: Vec<String> = RANK_COUNTERS
                .iter()
                .filter_map(|&k| Some(format!("{k} {}", r[k].as_u64()?)))
                .collect();
            if !counters.is_empty() {
                s.push_str(&format!(" [{}]", counters.join(", ")));
            }
            out.push(s);
        }
    }
    if out.is_empty() {
        "no worker listed".into()
    } else {
        out.join(", ")
    }
}

/// Waits (at most `within`) until the replica at `base` is connected to
/// NATS and lists `peer` among the peers it heard.
pub(crate) async fn wait_for_peer(
    client: &reqwest::Client,
    base: &str,
    peer: &str,
    within: Duration,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Some(sync)) = sync_figures(client, base).await {
            if sync.connected && sync.peers.iter().any(|p| p == peer) {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout(format!(
                "the replica at {base} did not hear its peer {peer} within {} s",
                within.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Requests at the mock engine `base` now: running and waiting.
pub(crate) async fn engine_in_flight(client: &reqwest::Client, base: &str) -> Result<u64> {
    let text = metrics::get_text(client, base, "/metrics").await?;
    Ok(metrics::sum(&text, "vllm:num_requests_running")
        + metrics::sum(&text, "vllm:num_requests_waiting"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sync_section_of_workers_becomes_the_figures() {
        let body = r#"{"workers": [], "replicas": {"replica_id": "r0", "nats_url": "nats://127.0.0.1:1",
            "connected": true, "outages": 0, "lost_messages": 2, "dropped_events": 0,
            "peer_delay": {"count": 10, "p50_us": 300, "p99_us": 900, "max_us": 1200},
            "publish_cost": null,
            "peers": [{"replica_id": "r1", "last_heard_ms_ago": 5, "messages": 7, "lost": 2}]}}"#;
        let sync = parse_sync(body).expect("parses").expect("a sync section");
        assert_eq!(sync.replica_id, "r0");
        assert_eq!(sync.peers, ["r1"]);
        assert_eq!(
            sync.peer_delay.map(|d| (d.count, d.p99_us)),
            Some((10, 900))
        );
        assert_eq!(sync.publish_cost, None);
        assert_eq!(sync.lost_messages, 2);
        assert_eq!(
            parse_sync(r#"{"workers": [], "replicas": null}"#).expect("parses"),
            None
        );
        assert!(parse_sync("not json").is_err());
    }

    #[test]
    fn rank_states_name_each_rank_and_what_is_wrong_with_it() {
        let body = r#"{"workers": [{"name": "w0", "ranks": [
            {"dp_rank": 0, "connected": true, "state": "live", "state_reason": null},
            {"dp_rank": 1, "connected": false, "state": "replaying", "state_reason": "gap",
             "resyncs": 2, "replays_ok": 1}]}]}"#;
        assert_eq!(
            describe_ranks(body),
            "w0/0 live, w0/1 replaying disconnected (gap) [resyncs 2, replays_ok 1]"
        );
        assert_eq!(describe_ranks(r#"{"workers": []}"#), "no worker listed");
    }
}
