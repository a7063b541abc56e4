//! What `kvroute bench ingest` asks the router under test, over HTTP only:
//! registrations, the rank states and counters of `GET /workers`, and
//! `/metrics`.

use std::collections::BTreeMap;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::metrics::total;

/// The router's address and admin token.
pub(crate) struct RouterApi {
    client: reqwest::Client,
    base: String,
    token: String,
}

/// The ranks of `GET /workers`, counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FleetView {
    /// Ranks listed.
    pub ranks: u64,
    /// Ranks per `state`.
    pub states: BTreeMap<String, u64>,
    /// Sums of the per-rank counters the report shows.
    pub gaps: u64,
    /// Sum of `replays_ok`.
    pub replays_ok: u64,
    /// Sum of `replays_incomplete`.
    pub replays_incomplete: u64,
    /// Sum of `decode_errors`.
    pub decode_errors: u64,
}

impl FleetView {
    /// Counts the ranks of a `/workers` body.
    fn parse(body: &Value) -> Self {
        let mut view = FleetView::default();
        let ranks = body["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["ranks"].as_array().into_iter().flatten());
        for rank in ranks {
            view.ranks += 1;
            let state = rank["state"].as_str().unwrap_or("(none)").to_owned();
            *view.states.entry(state).or_default() += 1;
            let n = |k: &str| rank[k].as_u64().unwrap_or(0);
            view.gaps += n("gaps");
            view.replays_ok += n("replays_ok");
            view.replays_incomplete += n("replays_incomplete");
            view.decode_errors += n("decode_errors");
        }
        view
    }

    /// Ranks in state `live`.
    pub fn live(&self) -> u64 {
        self.states.get("live").copied().unwrap_or(0)
    }

    /// The state counts as a JSON object.
    pub fn states_json(&self) -> Value {
        json!(self.states)
    }
}

/// Ranks in state `live` according to the `kvroute_ingest_ranks{state}`
/// gauge, if the router exports it.
pub(crate) fn live_from_metrics(text: &str) -> Option<u64> {
    kvroute_server::prom_text::samples(text)
        .find(|s| s.name == "kvroute_ingest_ranks" && s.label("state") == Some("live"))
        .map(|s| s.value as u64)
}

/// Block operations the index has applied so far, and where the figure
/// comes from: stored + removed blocks of the index counters, or, from a
/// router without them, applied events × `blocks_per_event`.
pub(crate) fn applied_block_ops(text: &str, blocks_per_event: f64) -> Option<(u64, &'static str)> {
    let stored = total(text, "kvroute_index_blocks_stored_total");
    let removed = total(text, "kvroute_index_blocks_removed_total");
    match (stored, removed) {
        (Some(s), r) => Some((
            s + r.unwrap_or(0),
            "kvroute_index_blocks_{stored,removed}_total",
        )),
        (None, _) => total(text, "kvroute_ingest_events_total").map(|e| {
            (
                (e as f64 * blocks_per_event) as u64,
                "kvroute_ingest_events_total",
            )
        }),
    }
}

impl RouterApi {
    /// A client of the router at `base` (`http://host:port`).
    pub(crate) fn new(base: &str, token: &str) -> Self {
        RouterApi {
            client: reqwest::Client::new(),
            base: base.to_owned(),
            token: token.to_owned(),
        }
    }

    /// Registers a worker whose rank r publishes on `events` + r and
    /// replays on `replay` + r (`POST /register`, or `POST /workers` on a
    /// router that has no `/register`).
    pub(crate) async fn register(
        &self,
        name: &str,
        (events, replay): (u16, u16),
        dp: u32,
        block_size: u32,
    ) -> Result<()> {
        let body = json!({
            "name": name,
            "url": "",
            "events": format!("tcp://127.0.0.1:{events}"),
            "replay": format!("tcp://127.0.0.1:{replay}"),
            "dp": dp,
            "block_size": block_size,
        });
        let mut status = StatusCode::NOT_FOUND;
        let mut text = String::new();
        for path in ["/register", "/workers"] {
            let reply = self
                .client
                .post(format!("{}{path}", self.base))
                .bearer_auth(&self.token)
                .json(&body)
                .send()
                .await
                .map_err(Error::http(format!("registering {name}")))?;
            status = reply.status();
            text = reply.text().await.unwrap_or_default();
            if status.is_success() {
                return Ok(());
            }
            if status != StatusCode::NOT_FOUND && status != StatusCode::METHOD_NOT_ALLOWED {
                break;
            }
        }
        Err(Error::Unexpected(format!(
            "registering {name} (dp {dp}) answered {status}: {text}"
        )))
    }

    /// `GET /workers`, counted.
    pub(crate) async fn fleet(&self) -> Result<FleetView> {
        let reply = self
            .client
            .get(format!("{}/workers", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(Error::http("GET /workers"))?;
        if !reply.status().is_success() {
            return Err(Error::Unexpected(format!(
                "GET /workers answered {}",
                reply.status()
            )));
        }
        let body: Value = reply
            .json()
            .await
            .map_err(Error::http("reading /workers"))?;
        Ok(FleetView::parse(&body))
    }

    /// The `/metrics` text.
    pub(crate) async fn metrics(&self) -> Result<String> {
        self.client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .map_err(Error::http("GET /metrics"))?
            .text()
            .await
            .map_err(Error::http("reading /metrics"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fleet_view_counts_states_and_sums_counters() {
        let body = json!({"workers": [
            {"name": "a", "ranks": [
                {"state": "live", "gaps": 2, "replays_ok": 1},
                {"state": "degraded", "gaps": 1, "replays_incomplete": 1},
            ]},
            {"name": "b", "ranks": [{"state": "live"}]},
        ]});
        let view = FleetView::parse(&body);
        assert_eq!((view.ranks, view.live(), view.gaps), (3, 2, 3));
        assert_eq!((view.replays_ok, view.replays_incomplete), (1, 1));
        assert_eq!(view.states_json(), json!({"degraded": 1, "live": 2}));
    }

    #[test]
    fn metrics_give_live_ranks_and_applied_blocks() {
        let text = "# TYPE kvroute_ingest_ranks gauge\n\
                    kvroute_ingest_ranks{state=\"error\"} 1\n\
                    kvroute_ingest_ranks{state=\"live\"} 31\n\
                    kvroute_index_blocks_stored_total 100\n\
                    kvroute_index_blocks_removed_total 60\n";
        assert_eq!(live_from_metrics(text), Some(31));
        assert_eq!(applied_block_ops(text, 16.0).map(|x| x.0), Some(160));
        let old = "kvroute_ingest_events_total{worker=\"w\",dp_rank=\"0\"} 3\n";
        assert_eq!(live_from_metrics(old), None);
        assert_eq!(applied_block_ops(old, 16.0).map(|x| x.0), Some(48));
        assert_eq!(applied_block_ops("", 16.0), None);
    }
}
