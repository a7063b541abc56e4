//! The msgpack writers: specs written in every shape the decoder accepts.

use super::*;

// ---------------------------------------------------------------------------
// Writers
// ---------------------------------------------------------------------------

pub(super) fn write_id(out: &mut Vec<u8>, id: u64, width: IntWidth) {
    match width {
        IntWidth::U64 => {
            out.push(0xcf);
            out.extend_from_slice(&id.to_be_bytes());
        }
        IntWidth::I64 if id <= i64::MAX as u64 => {
            out.push(0xd3);
            out.extend_from_slice(&id.to_be_bytes());
        }
        IntWidth::Minimal | IntWidth::I64 => mp::uint(out, id),
    }
}

pub(super) fn write_hash(out: &mut Vec<u8>, (hash, form): (u64, HashForm)) {
    match form {
        HashForm::Unsigned => mp::uint(out, hash),
        HashForm::Signed => {
            out.push(0xd3);
            out.extend_from_slice(&hash.to_be_bytes());
        }
        HashForm::Digest(prefix) => {
            let mut digest: Vec<u8> = (0..prefix).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
            digest.extend_from_slice(&hash.to_be_bytes());
            mp::bin(out, &digest);
        }
    }
}

pub(super) fn hash_array(hashes: &[(u64, HashForm)]) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, hashes.len());
    for &h in hashes {
        write_hash(&mut out, h);
    }
    out
}

pub(super) fn string(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    mp::str(&mut out, s);
    out
}

pub(super) fn nil() -> Vec<u8> {
    vec![0xc0]
}

pub(super) fn uint(v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    mp::uint(&mut out, v);
    out
}

pub(super) fn medium_value(m: Medium) -> Option<Vec<u8>> {
    match m {
        Medium::Absent => None,
        Medium::Nil => Some(nil()),
        Medium::Named(name) => Some(string(name)),
    }
}

/// The `token_ids` value: flat ids or bigram pairs.
pub(super) fn token_ids(s: &StoredSpec) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, s.units);
    for i in 0..s.units {
        let (id, width) = s.ids[i];
        if s.bigram {
            mp::array(&mut out, 2);
            write_id(&mut out, id, width);
            let (next, width) = s.ids[i + 1];
            write_id(&mut out, next, width);
        } else {
            write_id(&mut out, id, width);
        }
    }
    out
}

/// vLLM `extra_keys`: one entry per block, the LoRA name in each, the salt in the first.
pub(super) fn extra_keys(s: &StoredSpec) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, s.hashes.len());
    for b in 0..s.hashes.len() {
        let mut items: Vec<&str> = s.lora().into_iter().collect();
        if b == 0 {
            items.extend(s.salt.as_deref());
        }
        if items.is_empty() {
            mp::nil(&mut out);
        } else {
            mp::array(&mut out, items.len());
            for item in items {
                mp::str(&mut out, item);
            }
        }
    }
    out
}

/// The key/value entries of a stored event as a vLLM ≥ 0.24 map, in vLLM's key order.
pub(super) fn stored_entries(s: &StoredSpec) -> Vec<(&'static str, Vec<u8>)> {
    let mut entries = vec![
        ("type", string("BlockStored")),
        ("block_hashes", hash_array(&s.hashes)),
        (
            "parent_block_hash",
            s.parent.map_or_else(nil, |p| {
                let mut out = Vec::new();
                write_hash(&mut out, p);
                out
            }),
        ),
        ("token_ids", token_ids(s)),
        ("block_size", uint(u64::from(s.block_size))),
        ("lora_id", nil()),
    ];
    if let Some(medium) = medium_value(s.medium) {
        entries.push(("medium", medium));
    }
    match (&s.lora, s.lora_nil) {
        (Some(lora), _) => entries.push(("lora_name", string(lora))),
        (None, true) => entries.push(("lora_name", nil())),
        (None, false) => {}
    }
    match s.salt_place {
        SaltPlace::ExtraKeys => entries.push(("extra_keys", extra_keys(s))),
        SaltPlace::Key => {
            if let Some(salt) = &s.salt {
                entries.push(("cache_salt", string(salt)));
            }
        }
    }
    entries.push(("group_idx", uint(0)));
    entries.push(("kv_cache_spec_kind", string("full_attention")));
    entries
}

pub(super) fn event_entries(e: &EventSpec) -> Vec<(&'static str, Vec<u8>)> {
    match e {
        EventSpec::Stored(s) => stored_entries(s),
        EventSpec::Removed { hashes, medium } => {
            let mut entries = vec![
                ("type", string("BlockRemoved")),
                ("block_hashes", hash_array(hashes)),
            ];
            entries.extend(medium_value(*medium).map(|m| ("medium", m)));
            entries
        }
        EventSpec::Cleared => vec![("type", string("AllBlocksCleared"))],
    }
}

pub(super) fn write_map(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    mp::map(&mut out, entries.len());
    for (key, value) in entries {
        mp::str(&mut out, key);
        out.extend_from_slice(value);
    }
    out
}

/// An event as a tagged map; with `shuffle`, its keys in a random order.
pub(super) fn event_map(e: &EventSpec, shuffle: Option<&mut SplitMix64>) -> Vec<u8> {
    let mut entries = event_entries(e);
    if let Some(rng) = shuffle {
        for i in (1..entries.len()).rev() {
            let j = rng.below(i + 1);
            entries.swap(i, j);
        }
    }
    write_map(&entries)
}

/// An event as a tagged array (vLLM ≤ 0.23 positional layout).
///
/// Stored: `[type, hashes, parent, tokens, block_size, lora_id, medium, lora_name]`,
/// plus `extra_keys` when the salt travels there.
pub(super) fn event_positional(e: &EventSpec) -> Vec<u8> {
    let mut out = Vec::new();
    match e {
        EventSpec::Stored(s) => {
            let with_extra = matches!(s.salt_place, SaltPlace::ExtraKeys);
            mp::array(&mut out, if with_extra { 9 } else { 8 });
            mp::str(&mut out, "BlockStored");
            out.extend_from_slice(&hash_array(&s.hashes));
            match s.parent {
                Some(p) => write_hash(&mut out, p),
                None => mp::nil(&mut out),
            }
            out.extend_from_slice(&token_ids(s));
            mp::uint(&mut out, u64::from(s.block_size));
            mp::nil(&mut out); // lora_id
            out.extend_from_slice(&medium_value(s.medium).unwrap_or_else(nil));
            match &s.lora {
                Some(lora) => mp::str(&mut out, lora),
                None => mp::nil(&mut out),
            }
            if with_extra {
                out.extend_from_slice(&extra_keys(s));
            }
        }
        EventSpec::Removed { hashes, medium } => {
            mp::array(&mut out, 3);
            mp::str(&mut out, "BlockRemoved");
            out.extend_from_slice(&hash_array(hashes));
            out.extend_from_slice(&medium_value(*medium).unwrap_or_else(nil));
        }
        EventSpec::Cleared => {
            mp::array(&mut out, 1);
            mp::str(&mut out, "AllBlocksCleared");
        }
    }
    out
}

/// A batch payload around already-encoded events.
pub(super) fn batch(ts: f64, events: &[Vec<u8>], envelope: Envelope) -> Vec<u8> {
    let mut list = Vec::new();
    mp::array(&mut list, events.len());
    for e in events {
        list.extend_from_slice(e);
    }
    let mut out = Vec::new();
    match envelope {
        Envelope::Pair => {
            mp::array(&mut out, 2);
            mp::f64(&mut out, ts);
            out.extend_from_slice(&list);
        }
        Envelope::Triple(rank) => {
            mp::array(&mut out, 3);
            mp::f64(&mut out, ts);
            out.extend_from_slice(&list);
            mp::uint(&mut out, u64::from(rank));
        }
        Envelope::Map(rank) => {
            mp::map(&mut out, 3);
            mp::str(&mut out, "ts");
            mp::f64(&mut out, ts);
            mp::str(&mut out, "events");
            out.extend_from_slice(&list);
            mp::str(&mut out, "attn_dp_rank");
            mp::uint(&mut out, u64::from(rank));
        }
    }
    out
}
