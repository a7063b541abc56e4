//! The counters of prefixes moved between aggregated workers: fetched for
//! a request ([`crate::proxy::fetch`]) or copied ahead of demand
//! ([`crate::proxy::replicate`]).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::catalogue::{
    PROXY_FETCHED_BLOCKS, PROXY_FETCHES, PROXY_FETCHES_STARTED, PROXY_REPLICATED_BLOCKS,
    PROXY_REPLICATIONS, PROXY_REPLICATIONS_STARTED,
};

/// How a fetch ended: the `outcome` label of [`PROXY_FETCHES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchOutcome {
    /// The holder answered its leg (vLLM: with `kv_transfer_params`;
    /// SGLang: as the bootstrap source) and the receiver ran the request
    /// with the blocks it read.
    HandedOff,
    /// The holder's leg failed, was refused or timed out; the receiver
    /// recomputed the prefix.
    FellBack,
}

impl FetchOutcome {
    /// Every outcome, exported from the start at 0.
    pub const ALL: [FetchOutcome; 2] = [FetchOutcome::HandedOff, FetchOutcome::FellBack];

    /// The label's value.
    pub fn as_str(self) -> &'static str {
        match self {
            FetchOutcome::HandedOff => "handed_off",
            FetchOutcome::FellBack => "fell_back",
        }
    }
}

impl prometheus_client::encoding::EncodeLabelSet for FetchOutcome {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("outcome", self.as_str()).encode(encoder.encode_label())
    }
}

/// How a copy ahead of demand ended: the `outcome` label of
/// [`PROXY_REPLICATIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaOutcome {
    /// The second rank read the prefix's blocks from the holder.
    Copied,
    /// A leg failed, was refused or timed out: nothing copied.
    Failed,
    /// Not made: the pair has no hand-off, or too many copies are running.
    Skipped,
}

impl ReplicaOutcome {
    /// Every outcome, exported from the start at 0.
    pub const ALL: [ReplicaOutcome; 3] = [
        ReplicaOutcome::Copied,
        ReplicaOutcome::Failed,
        ReplicaOutcome::Skipped,
    ];

    /// The label's value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaOutcome::Copied => "copied",
            ReplicaOutcome::Failed => "failed",
            ReplicaOutcome::Skipped => "skipped",
        }
    }
}

impl prometheus_client::encoding::EncodeLabelSet for ReplicaOutcome {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("outcome", self.as_str()).encode(encoder.encode_label())
    }
}

/// [`PROXY_REPLICATIONS_STARTED`], [`PROXY_REPLICATIONS`] and
/// [`PROXY_REPLICATED_BLOCKS`].
#[derive(Debug)]
pub struct ReplicaMetrics {
    /// Copies asked for.
    pub started: Counter,
    /// Copies ended, by outcome.
    pub ended: Family<ReplicaOutcome, Counter>,
    /// Blocks planned for the copies made.
    pub blocks: Counter,
}

impl Default for ReplicaMetrics {
    fn default() -> Self {
        let ended = Family::<ReplicaOutcome, Counter>::default();
        for outcome in ReplicaOutcome::ALL {
            let _ = ended.get_or_create(&outcome);
        }
        ReplicaMetrics {
            started: Counter::default(),
            ended,
            blocks: Counter::default(),
        }
    }
}

impl ReplicaMetrics {
    /// Counts a copy that ended as `outcome`, of `blocks` blocks.
    pub fn ended(&self, outcome: ReplicaOutcome, blocks: u32) {
        self.ended.get_or_create(&outcome).inc();
        if outcome == ReplicaOutcome::Copied {
            self.blocks.inc_by(u64::from(blocks));
        }
    }

    /// Registers the three in `registry`.
    pub(super) fn register(&self, registry: &mut Registry) {
        let (s, e, b) = (
            PROXY_REPLICATIONS_STARTED,
            PROXY_REPLICATIONS,
            PROXY_REPLICATED_BLOCKS,
        );
        registry.register(s.family(), s.help, self.started.clone());
        registry.register(e.family(), e.help, self.ended.clone());
        registry.register(b.family(), b.help, self.blocks.clone());
    }
}

/// [`PROXY_FETCHES_STARTED`], [`PROXY_FETCHES`] and [`PROXY_FETCHED_BLOCKS`].
#[derive(Debug)]
pub struct FetchMetrics {
    /// Holder legs sent.
    pub started: Counter,
    /// Fetches ended, by outcome.
    pub ended: Family<FetchOutcome, Counter>,
    /// Blocks the placer planned to move for the fetches handed off.
    pub blocks: Counter,
}

impl Default for FetchMetrics {
    fn default() -> Self {
        let ended = Family::<FetchOutcome, Counter>::default();
        for outcome in FetchOutcome::ALL {
            let _ = ended.get_or_create(&outcome);
        }
        FetchMetrics {
            started: Counter::default(),
            ended,
            blocks: Counter::default(),
        }
    }
}

impl FetchMetrics {
    /// Counts a fetch that ended as `outcome`.
    pub fn ended(&self, outcome: FetchOutcome) {
        self.ended.get_or_create(&outcome).inc();
    }

    /// Counts a fetch handed off, which moved `blocks` blocks.
    pub fn handed_off(&self, blocks: u32) {
        self.ended(FetchOutcome::HandedOff);
        self.blocks.inc_by(u64::from(blocks));
    }

    /// Registers the three in `registry`.
    pub(super) fn register(&self, registry: &mut Registry) {
        let (s, e, b) = (PROXY_FETCHES_STARTED, PROXY_FETCHES, PROXY_FETCHED_BLOCKS);
        registry.register(s.family(), s.help, self.started.clone());
        registry.register(e.family(), e.help, self.ended.clone());
        registry.register(b.family(), b.help, self.blocks.clone());
    }
}
