//! KV-cache groups of hybrid models: which events describe the attention
//! chain the index follows, which describe a group that limits reuse, and
//! which describe nothing a router can use.
//!
//! vLLM publishes one store per KV-cache group (`group_idx`), the group's
//! kind on stores (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`),
//! only the index on removals. Its `HybridKVCacheCoordinator` reuses the
//! longest prefix that every group accepts:
//!
//! * full attention (`full_attention`, `mla_attention`,
//!   `sink_full_attention`): every block of the prefix — the chain the index
//!   keeps;
//! * a sliding window (`sliding_window`, `sliding_window_mla`):
//!   `SlidingWindowManager.find_longest_cache_hit` needs the
//!   `cdiv(window − 1, block_size)` group blocks ending at the prefix's end
//!   (all of them for a shorter prefix);
//! * chunked local attention: the blocks of the current chunk, whose size is
//!   not published, so kvroute asks for every block (never more credit than
//!   the engine gives);
//! * Mamba (`mamba`): `MambaManager.find_longest_cache_hit` needs the
//!   state at the prefix's end;
//! * other kinds (encoder-only, cross attention, unknown) do not take part
//!   in prefix reuse.
//!
//! A window or state group's events become [`KvEvent::Group`] residency by
//! engine hash; the index caps a rank's match to the longest prefix those
//! groups accept ([`crate::index`]).

use super::event::Fields;
use super::normalize::{opt_str, opt_u32, skip, Outcome};
use super::{SkipReason, StreamDecoder};
use crate::event::GroupRule;

/// Full-attention kinds: the chain the index keeps.
const ATTENTION_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];
/// Windowed kinds with a published window.
const WINDOW_KINDS: [&str; 2] = ["sliding_window", "sliding_window_mla"];

/// What an event's group is to the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GroupClass {
    /// The attention chain.
    Attention,
    /// A group that limits reuse by its rule.
    Constraint(GroupRule),
    /// A group that takes no part in prefix reuse.
    Other,
}

/// Where an event's blocks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placement {
    /// The attention chain.
    Attention,
    /// A constraining group's residency.
    Group { group: u32, rule: GroupRule },
}

/// The class of a group of `kind`, with the event's window and block size
/// and the worker's block size (attention blocks).
fn classify(
    kind: &str,
    window: Option<u32>,
    group_block_size: Option<u32>,
    worker_block_size: Option<u32>,
) -> GroupClass {
    if ATTENTION_KINDS.contains(&kind) {
        return GroupClass::Attention;
    }
    if kind == "mamba" {
        return GroupClass::Constraint(GroupRule::State);
    }
    let windowed = WINDOW_KINDS.contains(&kind) || kind == "chunked_local_attention";
    if !windowed {
        return GroupClass::Other;
    }
    let g = group_block_size.or(worker_block_size).unwrap_or(1).max(1);
    let b = worker_block_size.unwrap_or(g).max(1);
    if !g.is_multiple_of(b) {
        // Group blocks that do not end on attention block boundaries cannot
        // be lined up with the chain.
        return GroupClass::Other;
    }
    let blocks = match (WINDOW_KINDS.contains(&kind), window) {
        (true, Some(w)) => w.saturating_sub(1).div_ceil(g).max(1),
        // Chunked local attention, or a window not published: every block.
        _ => u32::MAX,
    };
    GroupClass::Constraint(GroupRule::Window {
        blocks,
        stride: g / b,
    })
}

impl StreamDecoder {
    /// Where an event's blocks go, learning each group's class from the
    /// events that name their kind; events of groups that take no part in
    /// prefix reuse, or of a group not yet learned, are skipped.
    /// `block_size`: the event's, for stores.
    pub(super) fn placement(
        &mut self,
        f: &Fields<'_>,
        block_size: Option<u32>,
    ) -> Outcome<Placement> {
        let group = opt_u32(f.group_idx, "group_idx")?;
        let kind = opt_str(f.kv_cache_spec_kind, "kv_cache_spec_kind")?;
        let class = match (kind, group) {
            (Some(kind), group) => {
                let window = opt_u32(
                    f.kv_cache_spec_sliding_window,
                    "kv_cache_spec_sliding_window",
                )?;
                let class = classify(kind, window, block_size, self.config.block_size);
                self.memory.group_class.insert(group.unwrap_or(0), class);
                class
            }
            (None, Some(group)) => match self.memory.group_class.get(&group) {
                Some(&class) => class,
                None if group == 0 => GroupClass::Attention,
                None => {
                    let detail = format!("group_idx {group} has no known kind");
                    return Err(skip(SkipReason::UnlearnedGroup, detail));
                }
            },
            (None, None) => GroupClass::Attention,
        };
        match class {
            GroupClass::Attention => Ok(Placement::Attention),
            GroupClass::Constraint(rule) => Ok(Placement::Group {
                group: group.unwrap_or(0),
                rule,
            }),
            GroupClass::Other => {
                let detail = format!("kv_cache_spec_kind {kind:?}, group_idx {group:?}");
                Err(skip(SkipReason::NonAttentionGroup, detail))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_classify_as_vllm_reuses_them() {
        let c = |kind, window, g| classify(kind, window, g, Some(16));
        assert_eq!(c("full_attention", None, Some(16)), GroupClass::Attention);
        assert_eq!(c("mla_attention", None, Some(16)), GroupClass::Attention);
        assert_eq!(
            c("mamba", None, Some(64)),
            GroupClass::Constraint(GroupRule::State)
        );
        // Window 32 at block 16: cdiv(31, 16) = 2 blocks.
        assert_eq!(
            c("sliding_window", Some(32), Some(16)),
            GroupClass::Constraint(GroupRule::Window {
                blocks: 2,
                stride: 1
            })
        );
        // Window 4096 at block 32: 128 group blocks of 2 attention blocks.
        assert_eq!(
            c("sliding_window", Some(4096), Some(32)),
            GroupClass::Constraint(GroupRule::Window {
                blocks: 128,
                stride: 2
            })
        );
        assert_eq!(
            c("chunked_local_attention", None, Some(16)),
            GroupClass::Constraint(GroupRule::Window {
                blocks: u32::MAX,
                stride: 1
            })
        );
        assert_eq!(c("sliding_window", Some(32), Some(24)), GroupClass::Other);
        assert_eq!(c("cross_attention", None, Some(16)), GroupClass::Other);
        assert_eq!(
            c("encoder_only_attention", None, Some(16)),
            GroupClass::Other
        );
        assert_eq!(c("unknown", None, Some(16)), GroupClass::Other);
    }
}
