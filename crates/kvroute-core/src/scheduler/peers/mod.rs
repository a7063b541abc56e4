//! Other routers' policies, re-implemented from their published rules as
//! baselines that `kvroute bench sim` and `kvroute demo` can run beside
//! kvroute's own on the same fleet and traffic: SGLang router's
//! `cache_aware` ([`sglang_cache_aware`], `--policy sglang-cache-aware`)
//! and Dynamo's KV router ([`dynamo`], `--policy dynamo`). Each module names
//! the source files it follows.

pub mod dynamo;
pub mod sglang_cache_aware;

pub use dynamo::{DynamoConfig, DynamoInputs};
pub use sglang_cache_aware::{CacheAware, CacheAwareConfig, Reason, TenantTree};

/// The tenant id of a (worker, rank) in a [`TenantTree`]: worker and rank
/// packed in 32 bits (ranks above 255 or workers above 2²⁴ share ids, which
/// only blurs the baseline's tree).
pub fn tenant_of(key: crate::index::WorkerRank) -> u32 {
    (key.worker.0 << 8) | (key.rank.0 & 0xff)
}
