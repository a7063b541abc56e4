//! The checks: decoded events against what their specs imply, and the
//! corruptions that one bad event among good ones may carry.

use super::*;

// ---------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------

/// The registered rank used by every decode here, distinct from generated ranks
/// often enough to notice a fallback.
pub(super) const REGISTERED_RANK: u32 = 4_000_000_007;

pub(super) fn decode(
    payload: &[u8],
    block_size: Option<u32>,
) -> Result<DecodedBatch, TestCaseError> {
    let config = DecoderConfig {
        block_size,
        registered_rank: REGISTERED_RANK,
        keep_tokens: true,
        ..Default::default()
    };
    decode_batch(payload, &config).map_err(|e| TestCaseError::fail(format!("envelope: {e}")))
}

/// Checks one decoded stored event against its spec (with no inherited salt).
pub(super) fn check_stored(
    s: &StoredSpec,
    outcome: &Result<KvEvent, Skipped>,
) -> Result<(), TestCaseError> {
    let bs = s.block_size as usize;
    let lookahead = usize::from(s.bigram);
    let window = s.folded_window();
    let complete = s.units / bs;
    let kept = s.hashes.len().min(complete);
    if kept == 0 && !s.hashes.is_empty() {
        let reason = outcome.as_ref().err().map(|skipped| skipped.reason);
        prop_assert_eq!(reason, Some(SkipReason::TooFewTokens), "{:?}", outcome);
        return Ok(());
    }
    let stored = match outcome {
        Ok(KvEvent::Stored(stored)) => stored,
        other => {
            return Err(TestCaseError::fail(format!(
                "not a stored event: {other:?}"
            )))
        }
    };
    let seed = namespace_seed(s.lora(), s.salt());
    let reference = local_block_hashes(&window, bs, seed, lookahead);
    prop_assert_eq!(reference.len(), complete, "reference block count");

    let externals: Vec<u64> = stored.blocks.iter().map(|b| b.external.0).collect();
    let expected_externals: Vec<u64> = s.hashes[..kept].iter().map(|h| h.0).collect();
    prop_assert_eq!(externals, expected_externals, "engine hashes");
    let locals: Vec<_> = stored.blocks.iter().map(|b| b.local).collect();
    prop_assert_eq!(&locals[..], &reference[..kept], "local hashes");
    let expected_tokens = if kept == 0 {
        &window[..0]
    } else {
        &window[..kept * bs + lookahead]
    };
    prop_assert_eq!(stored.token_ids.as_deref(), Some(expected_tokens), "tokens");
    prop_assert_eq!(stored.dropped_blocks as usize, s.hashes.len() - kept);
    prop_assert_eq!(stored.parent.map(|p| p.0), s.parent.map(|p| p.0));
    prop_assert_eq!(stored.tier, s.medium.tier());
    prop_assert_eq!(stored.lora_name.as_deref(), s.lora());
    prop_assert_eq!(stored.cache_salt.as_deref(), s.salt());
    let expected_lookahead = u32::from(s.bigram && s.units > 0);
    prop_assert_eq!(stored.lookahead, expected_lookahead);
    Ok(())
}

/// Encodes one stored event as a vLLM map in `[ts, [event], rank]` and checks the decode.
pub(super) fn check_single_stored(s: &StoredSpec, rank: u32) -> Result<(), TestCaseError> {
    let ts = 1_767_225_600.25;
    let event = write_map(&stored_entries(s));
    let payload = batch(ts, &[event], Envelope::Triple(rank));
    let decoded = decode(&payload, Some(s.block_size))?;
    prop_assert_eq!(decoded.ts, Some(ts));
    prop_assert_eq!(decoded.dp_rank, rank);
    prop_assert_eq!(decoded.lost_events, 0);
    prop_assert_eq!(decoded.events.len(), 1);
    prop_assert_eq!(decoded.events[0].index, 0);
    check_stored(s, &decoded.events[0].outcome)
}

/// One corruption of an otherwise decodable flat stored event.
#[derive(Debug, Clone)]
pub(super) enum Corruption {
    /// A token id inside a kept block is a negative integer.
    NegativeToken(i64, Index),
    /// One engine hash is a string.
    StringHash(Index),
    /// `block_size` is missing.
    MissingBlockSize,
    /// A token id inside a kept block is a float.
    FloatToken(f64, Index),
    /// `medium` is not a string (an integer, a bool or an array).
    WrongTypeMedium(u8),
    /// The type tag names no known event.
    UnknownType(String),
}

impl Corruption {
    fn reason(&self) -> SkipReason {
        match self {
            Corruption::MissingBlockSize => SkipReason::MissingField,
            Corruption::UnknownType(_) => SkipReason::UnknownType,
            _ => SkipReason::InvalidField,
        }
    }

    /// The corrupted event, as a vLLM map.
    fn apply(&self, s: &StoredSpec) -> Vec<u8> {
        let mut entries = stored_entries(s);
        let set = |entries: &mut Vec<(&'static str, Vec<u8>)>, key: &str, value: Vec<u8>| {
            let entry = entries
                .iter_mut()
                .find(|(k, _)| *k == key)
                .expect("the key is written");
            entry.1 = value;
        };
        // Kept blocks are the first `hashes.len()` (decodable specs have enough tokens).
        let kept_tokens = s.hashes.len() * s.block_size as usize;
        let tokens_with = |at: usize, write: &dyn Fn(&mut Vec<u8>)| {
            let mut out = Vec::new();
            mp::array(&mut out, s.units);
            for (i, &(id, width)) in s.ids[..s.units].iter().enumerate() {
                if i == at {
                    write(&mut out);
                } else {
                    write_id(&mut out, id, width);
                }
            }
            out
        };
        match self {
            Corruption::NegativeToken(v, at) => {
                let tokens = tokens_with(at.index(kept_tokens), &|out| mp::int64(out, *v));
                set(&mut entries, "token_ids", tokens);
            }
            Corruption::FloatToken(v, at) => {
                let tokens = tokens_with(at.index(kept_tokens), &|out| mp::f64(out, *v));
                set(&mut entries, "token_ids", tokens);
            }
            Corruption::StringHash(at) => {
                let bad = at.index(s.hashes.len());
                let mut out = Vec::new();
                mp::array(&mut out, s.hashes.len());
                for (i, &h) in s.hashes.iter().enumerate() {
                    if i == bad {
                        mp::str(&mut out, &h.0.to_string());
                    } else {
                        write_hash(&mut out, h);
                    }
                }
                set(&mut entries, "block_hashes", out);
            }
            Corruption::MissingBlockSize => entries.retain(|(k, _)| *k != "block_size"),
            Corruption::WrongTypeMedium(kind) => {
                let value = match kind % 3 {
                    0 => uint(u64::from(*kind)),
                    1 => vec![0xc3],
                    _ => {
                        let mut out = Vec::new();
                        mp::array(&mut out, 1);
                        mp::str(&mut out, "GPU");
                        out
                    }
                };
                entries.retain(|(k, _)| *k != "medium");
                entries.push(("medium", value));
            }
            Corruption::UnknownType(tag) => set(&mut entries, "type", string(tag)),
        }
        write_map(&entries)
    }
}

pub(super) fn corruption() -> impl Strategy<Value = Corruption> {
    prop_oneof![
        (i64::MIN..0, any::<Index>()).prop_map(|(v, at)| Corruption::NegativeToken(v, at)),
        (any::<f64>(), any::<Index>()).prop_map(|(v, at)| Corruption::FloatToken(v, at)),
        any::<Index>().prop_map(Corruption::StringHash),
        Just(Corruption::MissingBlockSize),
        any::<u8>().prop_map(Corruption::WrongTypeMedium),
        "[A-Za-z]{0,16}"
            .prop_filter("an unknown tag", |t| {
                !matches!(
                    t.as_str(),
                    "BlockStored" | "BlockRemoved" | "AllBlocksCleared"
                )
            })
            .prop_map(Corruption::UnknownType),
    ]
}

/// Decodes `good` with and without the corrupted `base` inserted at `at` and
/// checks that only the corrupted event differs.
pub(super) fn check_fault_isolation(
    good: &[EventSpec],
    base: &StoredSpec,
    corruption: &Corruption,
    at: Index,
    rank: u32,
) -> Result<(), TestCaseError> {
    let ts = 1_767_225_600.25;
    let clean_events: Vec<Vec<u8>> = good.iter().map(|e| event_map(e, None)).collect();
    let at = at.index(clean_events.len() + 1);
    let mut dirty_events = clean_events.clone();
    dirty_events.insert(at, corruption.apply(base));

    let clean = decode(&batch(ts, &clean_events, Envelope::Triple(rank)), None)?;
    let dirty = decode(&batch(ts, &dirty_events, Envelope::Triple(rank)), None)?;

    prop_assert_eq!(
        clean.skipped().count(),
        0,
        "good events decode: {:?}",
        clean
    );
    prop_assert_eq!(dirty.events.len(), good.len() + 1);
    prop_assert_eq!(dirty.decoded().count(), good.len());
    prop_assert_eq!(dirty.lost_events, 0);
    prop_assert_eq!(dirty.dp_rank, rank);
    let skipped: Vec<(u32, SkipReason)> = dirty.skipped().map(|(i, s)| (i, s.reason)).collect();
    prop_assert_eq!(skipped, vec![(at as u32, corruption.reason())]);
    let clean_decoded: Vec<&KvEvent> = clean.decoded().collect();
    let dirty_decoded: Vec<&KvEvent> = dirty.decoded().collect();
    prop_assert_eq!(clean_decoded, dirty_decoded);
    for (i, event) in dirty.events.iter().enumerate() {
        prop_assert_eq!(event.index as usize, i);
    }
    Ok(())
}
