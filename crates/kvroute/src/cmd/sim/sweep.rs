//! `kvroute bench sim`'s sweep: lists of the `kv` policy's knobs, every
//! combination run.

use anyhow::Result;
use clap::Args;
use kvroute_core::scheduler::{FetchConfig, ReplicaConfig};
use kvroute_loadgen::contender::{deal_from_value, Routing};
use kvroute_sim::plan::{self, SweepAxis};

/// The `kv` policy's weights; each takes a list, and every combination runs.
#[derive(Debug, Args)]
pub(super) struct SweepArgs {
    /// Multiplies the prefill term.
    #[arg(long, value_delimiter = ',')]
    prefill_load_scale: Vec<f64>,
    /// Credit per cached device block.
    #[arg(long, value_delimiter = ',')]
    overlap_credit: Vec<f64>,
    /// Credit per leading block held by a request in flight.
    #[arg(long, value_delimiter = ',')]
    active_prefix_weight: Vec<f64>,
    /// Cost per request running on the rank.
    #[arg(long, value_delimiter = ',')]
    active_request_weight: Vec<f64>,
    /// Cost per block the rank's decode steps read (the decode-load term).
    #[arg(long, value_delimiter = ',')]
    request_kv_weight: Vec<f64>,
    /// Cost per block of the request itself (steers between speeds).
    #[arg(long, value_delimiter = ',')]
    request_size_weight: Vec<f64>,
    /// Softmax temperature (0: lowest cost).
    #[arg(long, value_delimiter = ',')]
    temperature: Vec<f64>,
    /// Requests in flight at which a rank is skipped (busy).
    #[arg(long, value_delimiter = ',')]
    busy_requests: Vec<f64>,
    /// A new prefix goes to the rank dealt the least `prefixes`, `work`
    /// (default) or `requests`, or with `off` to the cheapest: the names
    /// `serve --deal-new-prefixes` takes (or their numbers 1, 2, 3, 0).
    #[arg(long, value_delimiter = ',', value_parser = parse_deal)]
    deal_new_prefixes: Vec<f64>,
    /// A request stays on its prefix's holder up to this × the cheapest's cost (below 1: off).
    #[arg(long, value_delimiter = ',')]
    holder_stickiness: Vec<f64>,
    /// Per-rank caps on requests in flight learned against this time to first token, ms (0: off).
    #[arg(long, value_delimiter = ',')]
    cap_ttft_ms: Vec<f64>,
    /// The fetch lever: a busy holder's request runs on a cooler rank that
    /// fetches the prefix, priced at this many µs per block moved (0: off).
    #[arg(long, value_delimiter = ',')]
    fetch_us_per_block: Vec<f64>,
    /// With the fetch lever: how much dearer the chosen rank must be than
    /// the fetch (1: any cheaper fetch).
    #[arg(long, value_delimiter = ',')]
    fetch_margin: Vec<f64>,
    /// Replication of hot prefixes: a prefix whose holder stays saturated
    /// this many ms is copied ahead of demand to a second rank (0: off).
    #[arg(long, value_delimiter = ',')]
    replicate_hot_ms: Vec<f64>,
    /// With replication: replicated blocks a rank may hold at once.
    #[arg(long, value_delimiter = ',')]
    replica_budget_blocks: Vec<f64>,
}

/// A `--deal-new-prefixes` value: `serve`'s names, as the sweep's numbers
/// ([`deal_from_value`]), or a number.
fn parse_deal(value: &str) -> Result<f64, String> {
    match value {
        "off" => Ok(0.0),
        "prefixes" => Ok(1.0),
        "work" => Ok(2.0),
        "requests" => Ok(3.0),
        _ => value
            .parse()
            .map_err(|_| format!("`{value}`: off, prefixes, work, requests (or 0-3)")),
    }
}

/// One axis of the sweep: its short name, its values, and how it sets a routing.
type Axis<'a> = SweepAxis<'a>;

impl SweepArgs {
    pub(super) fn axes(&self) -> Vec<Axis<'_>> {
        let all: [Axis<'_>; 15] = [
            ("pls", &self.prefill_load_scale, |r, v| {
                r.weights.prefill_load_scale = v
            }),
            ("oc", &self.overlap_credit, |r, v| {
                r.weights.overlap_credit = v
            }),
            ("apw", &self.active_prefix_weight, |r, v| {
                r.weights.active_prefix_weight = v
            }),
            ("arw", &self.active_request_weight, |r, v| {
                r.weights.active_request_weight = v
            }),
            ("kvw", &self.request_kv_weight, |r, v| {
                r.weights.request_kv_weight = v
            }),
            ("rsw", &self.request_size_weight, |r, v| {
                r.weights.request_size_weight = v
            }),
            ("t", &self.temperature, |r, v| r.temperature = v),
            ("busy", &self.busy_requests, |r, v| {
                r.busy.requests = Some(v as u64)
            }),
            ("deal", &self.deal_new_prefixes, |r, v| {
                r.deal_new_prefixes = deal_from_value(v)
            }),
            ("stick", &self.holder_stickiness, |r, v| r.stickiness = v),
            ("cap", &self.cap_ttft_ms, |r, v| {
                r.cap_ttft_ms = (v > 0.0).then_some(v)
            }),
            ("fetch", &self.fetch_us_per_block, |r, v| {
                r.fetch = (v > 0.0).then(|| FetchConfig {
                    transfer_us_per_block: v,
                    ..r.fetch.unwrap_or_default()
                })
            }),
            ("fm", &self.fetch_margin, |r, v| {
                let fetch = r.fetch.get_or_insert_with(FetchConfig::default);
                fetch.margin = v;
            }),
            ("rep", &self.replicate_hot_ms, |r, v| {
                r.replicate = (v > 0.0).then(|| ReplicaConfig {
                    hot_for_ms: v as u64,
                    ..r.replicate.unwrap_or_default()
                })
            }),
            ("rb", &self.replica_budget_blocks, |r, v| {
                let replicate = r.replicate.get_or_insert_with(ReplicaConfig::default);
                replicate.budget_blocks = v as u64;
            }),
        ];
        all.into_iter().filter(|a| !a.1.is_empty()).collect()
    }

    /// Every combination of the listed values applied to `base`, with a
    /// label each ([`plan::sweep`]).
    pub(super) fn expand(&self, base: Routing) -> Result<Vec<(String, Routing)>> {
        Ok(plan::sweep(base, &self.axes())?)
    }
}
