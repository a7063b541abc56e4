//! The catalogue: every metric `kvroute serve` exposes, declared once with
//! its kind, labels and help text, and the table of `docs/metrics.md`.

use std::fmt::Write as _;

use super::{Kind, MetricInfo};

const RANK: &[&str] = &["worker", "dp_rank"];
const RANK_STATE: &[&str] = &["worker", "dp_rank", "state"];
const STATE: &[&str] = &["state"];
const RANK_STATE_ONLY: &[&str] = &["rank_state"];
const NONE: &[&str] = &[];
const KIND: &[&str] = &["kind"];
const WORKER_ROLE: &[&str] = &["worker", "role"];
const STATUS: &[&str] = &["status"];
const REASON: &[&str] = &["reason"];
/// How a fetch of a request's prefix ended (`handed_off`, `fell_back`),
/// or a copy ahead of demand (`copied`, `failed`, `skipped`).
const OUTCOME: &[&str] = &["outcome"];
/// A tenant the flags name (`--tenant-weight`, `--tenant-key`,
/// `--tenant-priority`), or `other`: bounded by the flags.
const TENANT: &[&str] = &["tenant"];
/// A model the workers list (their lists are bounded), and where its
/// tokenizer was found.
const MODEL_SOURCE: &[&str] = &["model", "source"];
/// `high` (`x-priority` below 0), `normal` (0) or `low` (above 0).
const PRIORITY: &[&str] = &["priority"];

/// Declares each metric as a constant (documented by its help text) and
/// lists them all, in exposition order, as [`CATALOGUE`].
macro_rules! catalogue {
    ($($id:ident: $name:ident $kind:ident $labels:ident $help:literal;)*) => {
        $(
            #[doc = $help]
            pub const $id: MetricInfo = MetricInfo {
                name: stringify!($name),
                kind: Kind::$kind,
                labels: $labels,
                help: $help,
            };
        )*
        /// Every metric, in exposition order.
        pub const CATALOGUE: &[MetricInfo] = &[$($id),*];
    };
}

catalogue! {
    INGEST_BATCHES:               kvroute_ingest_batches_total                 Counter   RANK "Event batches received live.";
    INGEST_EVENTS:                kvroute_ingest_events_total                  Counter   RANK "Events applied to the index.";
    INGEST_DECODE_ERRORS:         kvroute_ingest_decode_errors_total           Counter   RANK "Malformed events skipped.";
    INGEST_EVENTS_FILTERED:       kvroute_ingest_events_filtered_total         Counter   RANK "Events dropped on purpose (tier, placement, block size).";
    INGEST_ENVELOPE_ERRORS:       kvroute_ingest_envelope_errors_total         Counter   RANK "Batches whose envelope could not be decoded.";
    INGEST_BAD_FRAMES:            kvroute_ingest_bad_frames_total              Counter   RANK "Messages that were not [topic, seq, payload].";
    INGEST_GAPS:                  kvroute_ingest_gaps_total                    Counter   RANK "Sequence gaps detected.";
    INGEST_REPLAYS_OK:            kvroute_ingest_replays_ok_total              Counter   RANK "Replays that filled their gap.";
    INGEST_REPLAYS_INCOMPLETE:    kvroute_ingest_replays_incomplete_total      Counter   RANK "Replays that could not fill their gap.";
    INGEST_ENGINE_RESTARTS:       kvroute_ingest_engine_restarts_total         Counter   RANK "Engine restarts seen (sequence went back).";
    INGEST_RANK_CLEARS:           kvroute_ingest_rank_clears_total             Counter   RANK "Times a rank's blocks were dropped.";
    INGEST_STALE_BATCHES:         kvroute_ingest_stale_batches_total           Counter   RANK "Batches dropped as already applied.";
    INGEST_VERIFIES:              kvroute_ingest_verifies_total                Counter   RANK "Continuity checks that proved the stream continuous.";
    INGEST_REPLAY_TIMEOUTS:       kvroute_ingest_replay_timeouts_total         Counter   RANK "Replays that got no end marker in time.";
    INGEST_FOREIGN_RANK_BATCHES:  kvroute_ingest_foreign_rank_batches_total    Counter   RANK "Batches for a DP rank the worker does not have, dropped.";
    INGEST_EARLY_VERIFIES:        kvroute_ingest_early_verifies_total          Counter   RANK "Early checks of a quiet stream, once per quiet spell soon after its last live batch.";
    INGEST_EARLY_REPAIRS:         kvroute_ingest_early_repairs_total           Counter   RANK "Early checks that found batches the stream had lost (a burst's lost tail).";
    INGEST_PERIODIC_REPAIRS:      kvroute_ingest_periodic_repairs_total        Counter   RANK "Periodic checks of a quiet stream that found batches it had lost.";
    INGEST_CONNECTED:             kvroute_ingest_connected                     Gauge     RANK "Whether the rank's engine is reachable.";
    INGEST_RANK_STATE:            kvroute_ingest_rank_state                    Gauge     RANK_STATE "1 for the rank's current state (live, replaying, unverified, degraded, disconnected, error).";
    INGEST_RANKS:                 kvroute_ingest_ranks                         Gauge     STATE "Ranks in each state.";
    WORKER_INFO:                  kvroute_worker_info                          Gauge     WORKER_ROLE "1 for each registered worker, labelled with its prefill/decode role (prefill, decode, both).";
    INDEX_NODES:                  kvroute_index_nodes                          Gauge     NONE "Block prefixes in the index, once per index shard holding them.";
    INDEX_RESIDENCIES:            kvroute_index_residencies                    Gauge     NONE "(block, rank, tier) residencies in the index.";
    INDEX_HEAP_BYTES:             kvroute_index_heap_bytes                     Gauge     NONE "Heap bytes held by the index.";
    INDEX_BLOCKS_STORED:          kvroute_index_blocks_stored_total            Counter   NONE "Blocks stored in the index.";
    INDEX_BLOCKS_REMOVED:         kvroute_index_blocks_removed_total           Counter   NONE "Blocks removed from the index.";
    INDEX_DUPLICATE_BLOCKS:       kvroute_index_duplicate_blocks_total         Counter   NONE "Stored blocks a rank already held.";
    INDEX_PARENT_MISSING:         kvroute_index_parent_missing_total           Counter   NONE "Stored events dropped because their parent block was unknown.";
    INDEX_UNKNOWN_REMOVALS:       kvroute_index_unknown_removals_total         Counter   NONE "Removals of blocks the rank did not hold.";
    INDEX_EVICTED_OVER_CAPACITY:  kvroute_index_evicted_over_capacity_total    Counter   NONE "Residencies dropped because a rank was over its cap.";
    INDEX_HASH_CONFLICTS:         kvroute_index_hash_conflicts_total           Counter   NONE "Engine hashes a rank bound to another block than the shared binding.";
    INDEX_APPROX_EXPIRED:         kvroute_index_approx_expired_total           Counter   NONE "Approximate residencies that expired.";
    PROXY_REQUESTS:               kvroute_proxy_requests_total                 Counter   NONE "Completion requests received.";
    PROXY_BAD_REQUESTS:           kvroute_proxy_bad_requests_total             Counter   NONE "Requests refused as malformed.";
    PROXY_UPSTREAM_ERRORS:        kvroute_proxy_upstream_errors_total          Counter   NONE "Attempts a worker failed: connection errors, 503 and 429 refusals, 5xx answers, answers cut off.";
    PROXY_ERRORS:                 kvroute_proxy_errors_total                   Counter   KIND "Completion requests kvroute answered with an error of its own, by kind (a stream cut off mid-way counts as upstream_incomplete).";
    PROXY_RETRIES:                kvroute_proxy_retries_total                  Counter   NONE "Attempts on a further candidate after a failure.";
    PROXY_MIGRATIONS:             kvroute_proxy_migrations_total               Counter   NONE "Requests moved to another rank after their worker failed them mid-way (a stream continued from what was generated, a whole answer asked again); --migration-limit per request.";
    PROXY_MIGRATIONS_FAILED:      kvroute_proxy_migrations_failed_total        Counter   NONE "Requests whose worker failed them mid-way and that could not be moved on (limit reached, time spent, not continuable, or no other rank answered): the client got the error.";
    PROXY_OVERLOADED:             kvroute_proxy_overloaded_total               Counter   NONE "Requests refused because every candidate was busy.";
    PROXY_QUEUED:                 kvroute_proxy_queued_total                   Counter   NONE "Requests that waited in the overload queue.";
    PROXY_QUEUE_TIMEOUTS:         kvroute_proxy_queue_timeouts_total           Counter   NONE "Queued requests refused when their wait ran out.";
    PROXY_NO_WORKERS:             kvroute_proxy_no_workers_total               Counter   NONE "Requests refused because no worker was available.";
    PROXY_LOAD_ONLY:              kvroute_proxy_load_only_total                Counter   NONE "Text requests routed on load alone (no tokenizer).";
    PROXY_ENGINE_SCRAPES:         kvroute_proxy_engine_scrapes_total           Counter   NONE "Workers' /metrics read for their own load (--engine-metrics-ms).";
    PROXY_ENGINE_SCRAPE_FAILURES: kvroute_proxy_engine_scrape_failures_total   Counter   NONE "Workers' /metrics that could not be read (their last report ages out).";
    PROXY_SESSION_KEPT:           kvroute_proxy_session_kept_total             Counter   NONE "Requests of a known session sent back to its rank.";
    PROXY_SESSION_MOVED:          kvroute_proxy_session_moved_total            Counter   NONE "Requests of a known session sent elsewhere: its rank's queue cost more than its cached history saves, or it is gone or busy.";
    PROXY_CONTINUATION_KEPT:      kvroute_proxy_continuation_kept_total        Counter   NONE "Responses API continuations (previous_response_id) sent to the rank that produced the previous response.";
    PROXY_CONTINUATION_UNKNOWN:   kvroute_proxy_continuation_unknown_total     Counter   NONE "Responses API continuations of a known response whose rank is gone or not a candidate: routed by cost.";
    PROXY_CONTINUATION_REFUSED:   kvroute_proxy_continuation_refused_total     Counter   NONE "Responses API continuations answered 404 by the router: no replica knows their previous response as one this client's owner made (unknown, expired, or another owner's).";
    PROXY_DISAGG_SPLIT:           kvroute_proxy_disagg_split_total             Counter   NONE "Disaggregated requests split: prefill on a prefill worker, decode on a decode worker.";
    PROXY_DISAGG_LOCAL:           kvroute_proxy_disagg_local_total             Counter   NONE "Disaggregated requests prefilled on their decode rank (conditional disaggregation, or no prefill worker).";
    PROXY_FETCHES_STARTED:        kvroute_proxy_fetches_started_total          Counter   NONE "Requests the placer ran on a cooler rank with their prefix moved from its busy holder (--fetch-us-per-block): the holder's one-token leg sent.";
    PROXY_FETCHES:                kvroute_proxy_fetches_total                  Counter   OUTCOME "Those fetches by how they ended: handed_off (the holder answered its leg, with kv_transfer_params for vLLM or as the bootstrap source for SGLang, and the receiver ran the request with the blocks it read) or fell_back (the holder's leg failed, was refused or took over --prefill-timeout-secs, or an SGLang receiver's leg failed before answering: the receiver recomputed the prefix).";
    PROXY_FETCHED_BLOCKS:         kvroute_proxy_fetched_blocks_total           Counter   NONE "Blocks the placer planned to move for the fetches handed off (the prefix blocks the receiver lacked).";
    PROXY_REPLICATIONS_STARTED:   kvroute_proxy_replications_started_total     Counter   NONE "Copies of a hot prefix the placer asked for ahead of demand (--replicate-hot-ms: its holder saturated that long), from the holder to a second rank, beside the request that found it hot.";
    PROXY_REPLICATIONS:           kvroute_proxy_replications_total             Counter   OUTCOME "Those copies by how they ended: copied (the holder answered its one-token leg with kv_transfer_params and the second rank read the blocks), failed (a leg failed, was refused or took over --prefill-timeout-secs: nothing copied, no request affected) or skipped (not vLLM workers at both ends, or 4 copies already running).";
    PROXY_REPLICATED_BLOCKS:      kvroute_proxy_replicated_blocks_total        Counter   NONE "Blocks the placer planned to copy for the copies made (charged to the second rank's --replica-budget-blocks until its cache evicts them).";
    PROXY_MODEL_LISTS_REFUSED:    kvroute_proxy_model_lists_refused_total      Counter   NONE "Workers' /v1/models answers refused: over 4 MiB (read no further) or not a model list. Such a worker's models are unknown: it gets no request naming a model its spec does not name.";
    TENANT_REQUESTS:              kvroute_tenant_requests_total                Counter   TENANT "Completion requests that reached admission, by tenant (--tenant-header when trusted, else the tenant --tenant-key binds the API key to, else its fingerprint; a tenant the flags do not name counts as other).";
    TENANT_QUEUED:                kvroute_tenant_queued_total                  Counter   TENANT "Requests that waited in the overload queue, by tenant.";
    TENANT_REFUSED_OVER_SHARE:    kvroute_tenant_refused_over_share_total      Counter   TENANT "Requests refused with 429 at a full overload queue because their tenant had the most requests waiting for its weight (a newcomer, or a waiting request making room for another tenant's).";
    TENANT_WAITING:               kvroute_tenant_queue_waiting                 Gauge     TENANT "Requests waiting in the overload queue now, by tenant.";
    TENANT_POOLED:                kvroute_tenant_pooled_total                  Counter   NONE "Requests that waited in the overload queue as other because --queue-max-tenants tenants the flags do not name already waited (made-up names share one turn).";
    PRIORITY_CLAMPED:             kvroute_priority_clamped_total               Counter   NONE "Requests whose x-priority their tenant may not use, clamped into its range (an untrusted client asking to go before the default 0, or a tenant outside its --tenant-priority).";
    PRIORITY_QUEUE_WAIT:          kvroute_priority_queue_wait_seconds          Histogram PRIORITY "Time from a request's admission to its placement or refusal spent in the overload queue (0: not queued), by priority class.";
    PROXY_ROUTED:                 kvroute_proxy_routed_total                   Counter   RANK "Requests forwarded per (worker, rank).";
    PROXY_ROUTED_ON_LOAD:         kvroute_proxy_routed_on_load_total           Counter   NONE "Requests forwarded without cache knowledge: no tokens, a load-only policy, or a rank whose history is incomplete.";
    QUALITY_PROMPT_TOKENS:        kvroute_quality_prompt_tokens_total          Counter   NONE "Prompt tokens of responses whose cached_tokens the engine reported.";
    QUALITY_CACHED_TOKENS:        kvroute_quality_cached_tokens_total          Counter   NONE "Cached tokens the engines reported for those responses.";
    QUALITY_PREDICTED_TOKENS:     kvroute_quality_predicted_cached_tokens_total Counter  NONE "Cached tokens the index predicted for those responses.";
    PROXY_TTFT:                   kvroute_proxy_ttft_seconds                   Histogram NONE "From a streamed request's arrival to the worker's first chunk.";
    PROXY_LATENCY:                kvroute_proxy_request_seconds                Histogram NONE "From a request's arrival to the end of its answer.";
    ACCURACY_COMPARISONS:         kvroute_accuracy_comparisons_total           Counter   RANK_STATE_ONLY "Responses whose cached_tokens were compared with the prediction, by the state of the rank the prediction came from.";
    ACCURACY_EXACT:               kvroute_accuracy_exact_total                 Counter   RANK_STATE_ONLY "Comparisons where prediction and cached_tokens agreed exactly.";
    ACCURACY_DIFFERENCE:          kvroute_accuracy_difference_tokens           Histogram RANK_STATE_ONLY "|predicted cached tokens - engine cached_tokens|.";
    ACTIVE_REQUESTS:              kvroute_active_requests                      Gauge     RANK "Requests in flight per (worker, rank).";
    ACTIVE_PREFILL_TOKENS:        kvroute_active_prefill_tokens                Gauge     RANK "Prompt tokens still to prefill per (worker, rank).";
    HTTP_CONNECTIONS:             kvroute_http_connections                     Gauge     NONE "Client connections open.";
    HTTP_CONNECTIONS_REFUSED:     kvroute_http_connections_refused_total       Counter   NONE "Connections closed on arrival because --max-connections were open.";
    HTTP_HEADER_TIMEOUTS:         kvroute_http_header_timeouts_total           Counter   NONE "Connections closed because a request head took longer than --header-timeout-secs.";
    HTTP_IDLE_TIMEOUTS:           kvroute_http_idle_timeouts_total             Counter   NONE "Kept-alive connections closed after --idle-timeout-secs without a request.";
    MODEL_TOKENIZER:              kvroute_model_tokenizer                      Gauge     MODEL_SOURCE "1 for each model the workers list, by where the router found its tokenizer: root, cache, hub, parent, engine (/tokenize), or none (its text requests are routed on load alone).";
    BODY_MEMORY:                  kvroute_body_memory_bytes                    Gauge     NONE "Memory budget held by request bodies being read or routed, over HTTP and the endpoint picker (--body-memory-mib).";
    BODY_MEMORY_REFUSALS:         kvroute_body_memory_refusals_total           Counter   NONE "Times a request body could not take its share of the memory budget (some were answered 503 or 429, some waited and were read).";
    ACTIVE_DECODE_BLOCKS:         kvroute_active_decode_blocks                 Gauge     RANK "Distinct blocks held by requests in flight per (worker, rank).";
    RANK_SPEED:                   kvroute_rank_speed                           Gauge     RANK "The speed a rank is priced at: learned from its responses once known (--learn-speeds), else its worker's declared speed.";
    REPLICA_NATS_CONNECTED:       kvroute_replica_nats_connected               Gauge     NONE "Whether this replica is connected to NATS (--nats).";
    REPLICA_NATS_OUTAGES:         kvroute_replica_nats_outages_total           Counter   NONE "Times the NATS connection went down.";
    REPLICA_PEERS:                kvroute_replica_peers                        Gauge     NONE "Peer replicas heard within the last 3.5 s.";
    REPLICA_MESSAGES_SENT:        kvroute_replica_messages_sent_total          Counter   NONE "Messages published to the peers.";
    REPLICA_MESSAGES_RECEIVED:    kvroute_replica_messages_received_total      Counter   NONE "Peer messages received.";
    REPLICA_MESSAGES_LOST:        kvroute_replica_messages_lost_total          Counter   NONE "Peer messages that never arrived (sequence gaps).";
    REPLICA_MESSAGES_UNDECODABLE: kvroute_replica_messages_undecodable_total   Counter   NONE "Replica messages skipped as undecodable.";
    REPLICA_EVENTS_DROPPED:       kvroute_replica_events_dropped_total         Counter   NONE "In-flight events not published (NATS down or too slow); the whole state is resent.";
    REPLICA_UNKNOWN_WORKERS:      kvroute_replica_unknown_workers_total        Counter   NONE "Peer events and speed observations about a worker or rank this replica does not have.";
    REPLICA_RESYNCS_SENT:         kvroute_replica_resyncs_sent_total           Counter   NONE "Times this replica sent its whole in-flight state.";
    REPLICA_RESYNCS_ASKED:        kvroute_replica_resyncs_asked_total          Counter   NONE "Times this replica asked a peer for its whole state.";
    REPLICA_PEERS_EXPIRED:        kvroute_replica_peers_expired_total          Counter   NONE "Peers forgotten, with their requests, after 3.5 s of silence.";
    REPLICA_ID_CONFLICTS:         kvroute_replica_id_conflicts_total           Counter   NONE "Messages skipped because another router uses this replica's --replica-id.";
    REPLICA_SNAPSHOTS_WRITTEN:    kvroute_replica_snapshots_written_total      Counter   NONE "Index snapshots written to the JetStream object store.";
    REPLICA_SNAPSHOT_FAILURES:    kvroute_replica_snapshot_failures_total      Counter   NONE "Index snapshots the object store did not take.";
    REPLICA_SPEEDS_SENT:          kvroute_replica_speed_observations_sent_total     Counter NONE "Speed observations (one per streamed response) published to the peers (--learn-speeds).";
    REPLICA_SPEEDS_RECEIVED:      kvroute_replica_speed_observations_received_total Counter NONE "Peers' speed observations fed to this replica's learner.";
    REPLICA_SPEEDS_DROPPED:       kvroute_replica_speed_observations_dropped_total  Counter NONE "Speed observations not published: NATS was down or too slow.";
    REPLICA_PINS_SENT:            kvroute_replica_pins_sent_total              Counter   NONE "Session and response pins put in the shared JetStream bucket.";
    REPLICA_PINS_RECEIVED:        kvroute_replica_pins_received_total          Counter   NONE "Peers' session and response pins applied here (watched or fetched).";
    REPLICA_PINS_DROPPED:         kvroute_replica_pins_dropped_total           Counter   NONE "Pins not put in the bucket: NATS was down or too slow.";
    REPLICA_PINS_SKIPPED:         kvroute_replica_pins_skipped_total           Counter   NONE "Pins skipped: undecodable, or naming a worker or rank this replica does not have.";
    REPLICA_BUCKETS_RECREATED:    kvroute_replica_buckets_recreated_total      Counter   NONE "Times a JetStream bucket of the router's (the pins, the index snapshots) was found gone, after NATS restarted without it, and made again.";
    REPLICA_PEER_DELAY:           kvroute_replica_peer_delay_seconds           Histogram NONE "Delay from a peer's admission of a request to this replica applying it.";
    REPLICA_PUBLISH_COST:         kvroute_replica_publish_seconds              Histogram NONE "Time a request spends handing an event to the outbox.";
    EPP_STREAMS:                  kvroute_epp_streams_total                    Counter   NONE "ext_proc streams the endpoint picker opened (one per request through the gateway; --epp-port).";
    EPP_STREAMS_OPEN:             kvroute_epp_streams_open                     Gauge     NONE "ext_proc streams open now.";
    EPP_PICKS:                    kvroute_epp_picks_total                      Counter   NONE "Requests the endpoint picker sent to a worker (x-gateway-destination-endpoint set).";
    EPP_IMMEDIATE:                kvroute_epp_immediate_responses_total        Counter   STATUS "Requests the endpoint picker answered itself, by HTTP status (503 no eligible endpoint, 429 shed, 400, 413, ...).";
    EPP_REFUSED_STREAMS:          kvroute_epp_refused_streams_total            Counter   REASON "ext_proc streams closed with a gRPC error: processing_mode (not FULL_DUPLEX_STREAMED) or out_of_order.";
    EPP_SERVED_MISMATCH:          kvroute_epp_served_mismatch_total            Counter   NONE "Answers the gateway says another endpoint served than the one picked.";
    EPP_DECISION:                 kvroute_epp_decision_seconds                 Histogram NONE "From a request body's last chunk to the headers answer naming its endpoint.";
    STATE_SNAPSHOTS_WRITTEN:      kvroute_state_snapshots_written_total        Counter   NONE "Router state snapshots written to --state-dir (every --snapshot-secs and at shutdown).";
    STATE_SNAPSHOT_FAILURES:      kvroute_state_snapshot_failures_total        Counter   NONE "Router state snapshots that could not be written to --state-dir.";
    DISCOVERY_RELOADS:            kvroute_discovery_reloads_total              Counter   NONE "Times the --endpoints-file was read, or a change of the --inference-pool's pods seen, and the workers applied.";
    DISCOVERY_ERRORS:             kvroute_discovery_errors_total               Counter   NONE "Problems applying the --endpoints-file or following the --inference-pool, each new one once (the workers found before stay), and workers the registry refused.";
    DISCOVERY_ENDPOINTS:          kvroute_discovery_endpoints                  Gauge     NONE "Workers registered from the --endpoints-file or the --inference-pool's pods.";
}

/// The catalogue as the Markdown table of `docs/metrics.md`.
pub fn catalogue_table() -> String {
    let mut out = String::from("| metric | type | labels | meaning |\n| --- | --- | --- | --- |\n");
    for m in CATALOGUE {
        let labels = if m.labels.is_empty() {
            "-".to_owned()
        } else {
            m.labels.join(", ")
        };
        let help = m.help.replace('|', "\\|");
        let _ = writeln!(
            out,
            "| `{}` | {} | {labels} | {help} |",
            m.name,
            m.kind.as_str()
        );
    }
    out
}
