//! Choosing the (worker, rank) for a request: what each candidate would cost
//! ([`cost`]), what each is already doing ([`active`]), each candidate priced
//! ([`candidates`]), a request hashed and every rank of a fleet priced
//! ([`fleet`]), the order they are tried in under each routing policy
//! ([`policy`]), where a disaggregated fleet sends each phase
//! ([`disagg`]), when a request fetches its prefix from a busy holder
//! instead of waiting or recomputing ([`fetch`]) and when a hot prefix is
//! copied ahead of demand ([`replicate`]), the whole decision for one request assembled from those
//! parts and the state policies keep ([`placer`]), the order requests wait
//! in the overload queue ([`fair`]),
//! the workers' speeds learned from their responses
//! ([`speed`]), and other routers' policies as baselines ([`peers`]).
//!
//! Pure: the caller passes the index, the active-sequence state and a
//! random number; nothing here reads a clock or a socket.

pub mod active;
pub mod candidates;
pub mod cost;
pub mod disagg;
pub mod fair;
pub mod fetch;
pub mod fleet;
pub mod peers;
pub mod placer;
pub mod policy;
pub mod replicate;
pub mod session;
pub mod speed;

pub use active::{ActiveRequest, ActiveSequences};
pub use candidates::{
    predicted_cached_tokens, BusyThresholds, EngineReport, Load, Pricing, Scored,
};
pub use cost::{Candidate, CostBreakdown, CostWeights};
pub use disagg::{DecodeCost, LocalPrefillRule, WorkerRole};
pub use fetch::{Fetch, FetchConfig, FetchReason};
pub use fleet::{score, FleetView, MatchedHashes, RequestHashes, RouteTarget};
pub use placer::{Ordered, PlaceRequest, Placer, PlacerConfig, Plan, WhenAllBusy};
pub use policy::{deal_new_prefix, order, order_from, pick, Policy};
pub use replicate::{ReplicaConfig, Replicate, Replicator};
pub use speed::{SpeedConfig, SpeedLearner};
