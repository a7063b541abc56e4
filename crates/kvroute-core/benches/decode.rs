//! Wire decoder throughput: kvroute's [`StreamDecoder`] against a serde baseline.
//!
//! Every benchmark decodes msgpack KV-event batches that are already in memory
//! into normalized [`KvEvent`]s, local block hashes included, and drops the
//! result; nothing else is inside the timed region. Workloads:
//!
//! * `samples`: every golden payload of `tests/fixtures/*.hex`, decoded one
//!   after the other (one reused decoder per payload, as one per stream);
//! * `synthetic_1000x16`: one vLLM 0.33 `BlockStored` of 1000 blocks × 16
//!   `u32` token ids of mixed msgpack widths;
//! * `small_events`: 64 `BlockStored` of 4 blocks and 64 single-hash
//!   `BlockRemoved`, the common production shape.
//!
//! The baseline is the rejected design: `#[serde(untagged)]` enums read by
//! `rmp_serde::from_slice` into owned structs with `Vec<u64>` token ids, a
//! second `Vec<u32>` of folded ids per event, then the same local hashes
//! through [`kvroute_core::hash::local_block_hash`]. Before measuring, the
//! bench checks that both sides produce the same (external, local) hashes,
//! prints the allocations per event of one decode on each side (counted by
//! this binary's allocator) and a paired, interleaved kvroute/baseline ratio
//! that resists machine noise.
#![allow(unsafe_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::event::KvEvent;
use kvroute_core::wire::{decode_batch, DecoderConfig, StreamDecoder};

// ---------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------

#[path = "../tests/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{count_allocations, CountingAlloc};

/// The bench binary's allocator.
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

// ---------------------------------------------------------------------------
// Payloads
// ---------------------------------------------------------------------------

#[path = "../tests/support/payloads.rs"]
mod payloads;
use payloads::{fixture_payloads, small_events_batch, synthetic_batch, BLOCK_SIZE};

/// The decoder configuration of every benchmark: a worker with 16-token blocks.
fn config() -> DecoderConfig {
    DecoderConfig {
        block_size: Some(BLOCK_SIZE as u32),
        ..DecoderConfig::default()
    }
}

/// One benchmark workload: payloads decoded one after the other per iteration.
struct Workload {
    /// Benchmark parameter name.
    name: &'static str,
    /// `(name, payload)` of every batch of one iteration.
    payloads: Vec<(String, Vec<u8>)>,
}

impl Workload {
    /// Total payload bytes of one iteration.
    fn bytes(&self) -> u64 {
        self.payloads.iter().map(|(_, p)| p.len() as u64).sum()
    }

    /// Events (decoded or skipped) in one iteration, as kvroute counts them.
    fn events(&self) -> u64 {
        self.payloads
            .iter()
            .map(|(_, p)| {
                let batch = decode_batch(p, &config()).expect("payload decodes");
                batch.events.len() as u64
            })
            .sum()
    }

    /// One reused decoder per payload (each payload stands for one stream).
    fn decoders(&self) -> Vec<StreamDecoder> {
        self.payloads
            .iter()
            .map(|_| StreamDecoder::new(config()))
            .collect()
    }
}

/// The three decode workloads.
fn workloads() -> Vec<Workload> {
    vec![
        Workload {
            name: "samples",
            payloads: fixture_payloads(),
        },
        Workload {
            name: "synthetic_1000x16",
            payloads: vec![("synthetic_1000x16".to_owned(), synthetic_batch())],
        },
        Workload {
            name: "small_events",
            payloads: vec![("small_events".to_owned(), small_events_batch())],
        },
    ]
}

// ---------------------------------------------------------------------------
// Baseline: the rejected serde design
// ---------------------------------------------------------------------------

/// The rejected design: untagged serde enums into owned structs, then a second
/// pass that folds a `Vec<u64>` into a `Vec<u32>` and hashes each block.
///
/// It has no fault isolation (one bad event fails the batch) and ignores
/// vLLM `extra_keys` (multimodal items, salts) and `lookahead_token_ids`, so
/// it does slightly *less* hashing work than kvroute on those two samples.
mod baseline {
    use kvroute_core::event::{ExternalHash, KvEvent, Removed, Stored, StoredBlock, Tier};
    use kvroute_core::hash::{local_block_hash, namespace_seed};
    use kvroute_core::tokens::fold_token_id;
    use serde::de::{self, IgnoredAny, Visitor};
    use serde::{Deserialize, Deserializer};
    use std::fmt;

    /// An engine hash: `uint64`, negative `int64` or a `bin` digest.
    #[derive(Debug, Deserialize)]
    #[serde(untagged)]
    pub enum WireHash {
        /// vLLM: unsigned.
        Unsigned(u64),
        /// SGLang: signed.
        Signed(i64),
        /// vLLM with int hashes off: the raw digest.
        Digest(Digest),
    }

    /// A msgpack `bin` value, owned.
    #[derive(Debug)]
    pub struct Digest(pub Vec<u8>);

    impl<'de> Deserialize<'de> for Digest {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            /// Accepts bytes only.
            struct BytesVisitor;
            impl Visitor<'_> for BytesVisitor {
                type Value = Digest;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a bin digest")
                }
                fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Digest, E> {
                    Ok(Digest(v.to_vec()))
                }
            }
            d.deserialize_byte_buf(BytesVisitor)
        }
    }

    /// Token ids: flat, or SGLang EAGLE bigram pairs.
    #[derive(Debug, Deserialize)]
    #[serde(untagged)]
    pub enum WireTokens {
        /// One id per position.
        Flat(Vec<u64>),
        /// `[t_i, t_i+1]` per position.
        Pairs(Vec<(u64, u64)>),
    }

    /// An event as a tagged map (vLLM ≥ 0.24, SGLang ≥ 0.5.20); unknown keys are ignored.
    #[derive(Debug, Deserialize)]
    pub struct MapEvent {
        /// `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.
        #[serde(rename = "type")]
        pub kind: String,
        /// Engine hashes.
        #[serde(default)]
        pub block_hashes: Vec<WireHash>,
        /// Parent engine hash.
        #[serde(default)]
        pub parent_block_hash: Option<WireHash>,
        /// Token ids of the stored blocks.
        #[serde(default)]
        pub token_ids: Option<WireTokens>,
        /// Tokens per block.
        #[serde(default)]
        pub block_size: Option<u32>,
        /// Storage tier.
        #[serde(default)]
        pub medium: Option<String>,
        /// LoRA adapter name.
        #[serde(default)]
        pub lora_name: Option<String>,
        /// Tenant cache salt.
        #[serde(default)]
        pub cache_salt: Option<String>,
    }

    /// An event as a tagged array (vLLM ≤ 0.23 `BlockStored` slot order; a
    /// `BlockRemoved` with more than its hashes would misread slot 2 as a parent).
    #[derive(Debug, Deserialize)]
    pub struct ArrayEvent(
        String,
        #[serde(default)] Vec<WireHash>,
        #[serde(default)] Option<WireHash>,
        #[serde(default)] Option<WireTokens>,
        #[serde(default)] Option<u32>,
        #[serde(default)] IgnoredAny,
        #[serde(default)] Option<String>,
        #[serde(default)] Option<String>,
        #[serde(default)] IgnoredAny,
        #[serde(default)] IgnoredAny,
        #[serde(default)] IgnoredAny,
        #[serde(default)] IgnoredAny,
        #[serde(default)] IgnoredAny,
        #[serde(default)] IgnoredAny,
    );

    /// An event in either shape. The array form is tried first: a derived
    /// struct would also accept an array for the map form.
    #[derive(Debug, Deserialize)]
    #[serde(untagged)]
    pub enum WireEvent {
        /// Positional form.
        Array(ArrayEvent),
        /// Keyed form.
        Map(MapEvent),
    }

    /// The batch `[ts, events, rank?]`.
    #[derive(Debug, Deserialize)]
    pub struct WireBatch(f64, Vec<WireEvent>, #[serde(default)] Option<u32>);

    /// A decoded batch.
    #[derive(Debug)]
    pub struct Batch {
        /// The batch's rank, if any.
        pub dp_rank: Option<u32>,
        /// Normalized events (unknown or unusable ones dropped).
        pub events: Vec<KvEvent>,
    }

    /// Decodes and normalizes one payload.
    pub fn decode(payload: &[u8]) -> Result<Batch, rmp_serde::decode::Error> {
        let WireBatch(_ts, wire_events, dp_rank) = rmp_serde::from_slice(payload)?;
        let mut events = Vec::with_capacity(wire_events.len());
        for event in wire_events {
            let event = match event {
                WireEvent::Map(m) => m,
                WireEvent::Array(ArrayEvent(
                    kind,
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    _,
                    medium,
                    lora_name,
                    ..,
                )) => MapEvent {
                    kind,
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    medium,
                    lora_name,
                    cache_salt: None,
                },
            };
            if let Some(event) = normalize(event) {
                events.push(event);
            }
        }
        Ok(Batch { dp_rank, events })
    }

    /// The 64-bit engine hash.
    fn external(h: &WireHash) -> Option<ExternalHash> {
        Some(ExternalHash(match h {
            WireHash::Unsigned(v) => *v,
            WireHash::Signed(v) => *v as u64,
            WireHash::Digest(d) => {
                let tail = d.0.get(d.0.len().checked_sub(8)?..)?;
                u64::from_be_bytes(tail.try_into().ok()?)
            }
        }))
    }

    /// The tier of `medium` (absent or empty = device); `None` when unknown.
    fn tier(medium: Option<&str>) -> Option<Tier> {
        match medium.filter(|m| !m.is_empty()) {
            None => Some(Tier::Device),
            Some(m) => Tier::from_medium(m),
        }
    }

    /// One event into a [`KvEvent`]; `None` when it cannot be used.
    fn normalize(e: MapEvent) -> Option<KvEvent> {
        match e.kind.as_str() {
            "BlockStored" => stored(e).map(KvEvent::Stored),
            "BlockRemoved" => Some(KvEvent::Removed(Removed {
                blocks: e.block_hashes.iter().map(external).collect::<Option<_>>()?,
                tier: tier(e.medium.as_deref())?,
            })),
            "AllBlocksCleared" => Some(KvEvent::Cleared),
            _ => None,
        }
    }

    /// A stored event: fold the owned ids into a second list, then hash each block.
    fn stored(e: MapEvent) -> Option<Stored> {
        let bs = e.block_size? as usize;
        if bs == 0 {
            return None;
        }
        let (tokens, positions, lookahead): (Vec<u32>, usize, usize) = match e.token_ids? {
            WireTokens::Flat(ids) => {
                let folded = ids.iter().map(|&t| fold_token_id(t)).collect::<Vec<u32>>();
                let n = folded.len();
                (folded, n, 0)
            }
            WireTokens::Pairs(pairs) => {
                // Window of block i: the pairs' first ids, then the last pair's second id.
                let mut folded = pairs
                    .iter()
                    .map(|&(t, _)| fold_token_id(t))
                    .collect::<Vec<u32>>();
                folded.extend(pairs.last().map(|&(_, t)| fold_token_id(t)));
                (folded, pairs.len(), 1)
            }
        };
        let lora_name = e.lora_name.filter(|s| !s.is_empty());
        let cache_salt = e.cache_salt.filter(|s| !s.is_empty());
        let seed = namespace_seed(lora_name.as_deref(), cache_salt.as_deref());
        let kept = e.block_hashes.len().min(positions / bs);
        if kept == 0 {
            return None;
        }
        let mut blocks = Vec::with_capacity(kept);
        for (i, hash) in e.block_hashes.iter().take(kept).enumerate() {
            blocks.push(StoredBlock {
                external: external(hash)?,
                local: local_block_hash(&tokens[i * bs..(i + 1) * bs + lookahead], seed),
            });
        }
        Some(Stored {
            parent: e.parent_block_hash.as_ref().and_then(external),
            blocks,
            tier: tier(e.medium.as_deref())?,
            block_size: bs as u32,
            lora_name,
            cache_salt,
            lookahead: lookahead as u32,
            dropped_blocks: (e.block_hashes.len() - kept) as u32,
            token_ids: None,
            image_items: None,
        })
    }
}

// ---------------------------------------------------------------------------
// Equivalence check and allocation report
// ---------------------------------------------------------------------------

/// What both decoders must agree on: per event, the engine and local hashes.
#[derive(Debug, PartialEq, Eq)]
enum HashView {
    /// Parent, then `(external, local)` per block.
    Stored(Option<u64>, Vec<(u64, u64)>),
    /// External hashes.
    Removed(Vec<u64>),
    /// A cleared rank.
    Cleared,
    /// A hybrid model's group blocks (kvroute only).
    Group(Vec<u64>),
}

/// The hash view of a list of events.
fn hash_view<'a>(events: impl IntoIterator<Item = &'a KvEvent>) -> Vec<HashView> {
    events
        .into_iter()
        .map(|e| match e {
            KvEvent::Stored(s) => HashView::Stored(
                s.parent.map(|p| p.0),
                s.blocks.iter().map(|b| (b.external.0, b.local.0)).collect(),
            ),
            KvEvent::Removed(r) => HashView::Removed(r.blocks.iter().map(|h| h.0).collect()),
            KvEvent::Cleared => HashView::Cleared,
            KvEvent::Group(g) => HashView::Group(g.blocks.iter().map(|h| h.0).collect()),
        })
        .collect()
}

/// Samples where the baseline decodes but its local hashes differ by design:
/// it ignores `lookahead_token_ids` and the multimodal items and cache salt
/// carried in vLLM `extra_keys`, hybrid models' groups, REMOTE tiers and
/// vLLM 0.34's offloading placeholders.
const BASELINE_DIFFERS: &[&str] = &[
    "vllm_0.33.0_lookahead_cpu_removed_cleared",
    "vllm_0.33.0_multimodal_lora_salt",
    "vllm_0.34.0_hybrid_sliding_window",
    "vllm_0.34.0_multimodal_text_chain",
    "vllm_0.34.0_offload_storage_remote",
];

/// Samples the baseline cannot decode at all: TensorRT-LLM's digest tokens
/// (strings among the token ids). Every other hash fits `u64`/`i64` (or is a
/// `bin`) and every other token id, the SGLang 0.5.23 wide pads (~62 bits)
/// included, fits `u64`.
const BASELINE_FAILS: &[&str] = &["trtllm_multimodal_mm_keys"];

/// Checks that kvroute and the baseline agree, and prints allocations per event.
fn check_and_report(workloads: &[Workload]) {
    println!("decode check: kvroute vs baseline, (external, local) hashes per event");
    for w in workloads {
        for (name, payload) in &w.payloads {
            let ours = decode_batch(payload, &config()).expect("kvroute decodes");
            assert!(
                ours.skipped().all(|(_, s)| !s.reason.is_error()),
                "{name}: kvroute found bad input"
            );
            let ours_rank = ours.dp_rank;
            let ours = hash_view(ours.decoded());
            match baseline::decode(payload) {
                Err(e) => {
                    println!("  {name:<45} baseline cannot decode: {e}");
                    assert!(BASELINE_FAILS.contains(&name.as_str()), "{name}: {e}");
                }
                Ok(theirs) => {
                    assert_eq!(ours_rank, theirs.dp_rank.unwrap_or(0), "{name}: rank");
                    let same = ours == hash_view(&theirs.events);
                    println!(
                        "  {name:<45} {}",
                        if same {
                            "identical"
                        } else {
                            "differs (baseline ignores extra_keys/lookahead)"
                        }
                    );
                    assert_eq!(
                        same,
                        !BASELINE_DIFFERS.contains(&name.as_str()),
                        "{name}: unexpected baseline agreement status"
                    );
                }
            }
        }
    }

    println!("allocations of one decode per payload (kvroute: reused, warmed-up StreamDecoder):");
    for w in workloads {
        let events = w.events();
        let mut decoders = w.decoders();
        let mut ours = 0;
        let mut theirs = 0;
        for ((_, payload), decoder) in w.payloads.iter().zip(decoders.iter_mut()) {
            drop(decoder.decode(payload)); // warm up the scratch buffers
            let (batch, n) = count_allocations(|| decoder.decode(payload));
            drop(batch);
            ours += n;
            let (batch, n) = count_allocations(|| baseline::decode(payload));
            drop(batch);
            theirs += n;
        }
        let batches = w.payloads.len() as u64;
        println!(
            "  {:<18} {events:>4} events in {batches:>2} batch(es): \
             kvroute {ours:>4} allocations = {:.3}/event ({:.3}/event besides each batch's \
             event list); baseline {theirs:>5} = {:.1}/event",
            w.name,
            ours as f64 / events as f64,
            ours.saturating_sub(batches) as f64 / events as f64,
            theirs as f64 / events as f64,
        );
    }
}

/// Rounds of the paired measurement.
const PAIRED_ROUNDS: usize = 100;

/// Runs `f` `iters` times, timing each run; returns the median in nanoseconds.
fn median_time(iters: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_nanos() as f64
        })
        .collect();
    median(&mut times)
}

/// The median of `values` (sorted in place).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A noise-resistant ratio for a shared machine: kvroute and the baseline are
/// timed alternately, at least 5 runs and about a millisecond per side per
/// round, and the median of the per-round ratios (each side's median run) is
/// printed next to both medians. Criterion measures the two sides seconds
/// apart, so load from other processes can skew its ratio; here both sides of
/// a round see the same load. Taking each round's median run drops the first
/// run after a switch, which for the baseline's large transient allocations
/// can pay page faults after glibc returned its heap top to the kernel.
fn paired_ratios(workloads: &[Workload]) {
    println!("paired kvroute/baseline throughput ratio ({PAIRED_ROUNDS} alternating rounds):");
    for w in workloads {
        let mut decoders = w.decoders();
        let mut ours = || {
            for ((_, payload), decoder) in w.payloads.iter().zip(decoders.iter_mut()) {
                black_box(decoder.decode(black_box(payload)).expect("kvroute decodes"));
            }
        };
        let theirs = || {
            for (_, payload) in &w.payloads {
                let _ = black_box(baseline::decode(black_box(payload)));
            }
        };
        // Size each side's round to about a millisecond, and at least 5 runs.
        let runs = |ns: f64| (1e6 / ns).clamp(5.0, 1e4) as usize;
        let ours_runs = runs(median_time(10, &mut ours));
        let theirs_runs = runs(median_time(10, theirs));
        let (mut a, mut b, mut r) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..PAIRED_ROUNDS {
            let ta = median_time(ours_runs, &mut ours);
            let tb = median_time(theirs_runs, theirs);
            a.push(ta);
            b.push(tb);
            r.push(tb / ta);
        }
        println!(
            "  {:<18} kvroute median {:>10.2} µs, baseline median {:>10.2} µs, \
             median ratio {:.2}x",
            w.name,
            median(&mut a) / 1e3,
            median(&mut b) / 1e3,
            median(&mut r),
        );
    }
}

// ---------------------------------------------------------------------------
// Benchmarks
// ---------------------------------------------------------------------------

/// kvroute vs the baseline, per workload, in events/s and bytes/s.
fn bench_decode(c: &mut Criterion) {
    let workloads = workloads();
    check_and_report(&workloads);
    paired_ratios(&workloads);

    let mut group = c.benchmark_group("decode");
    for w in &workloads {
        group.throughput(Throughput::ElementsAndBytes {
            elements: w.events(),
            bytes: w.bytes(),
        });
        let mut decoders = w.decoders();
        group.bench_function(BenchmarkId::new("kvroute", w.name), |b| {
            b.iter(|| {
                for ((_, payload), decoder) in w.payloads.iter().zip(decoders.iter_mut()) {
                    black_box(decoder.decode(black_box(payload)).expect("kvroute decodes"));
                }
            })
        });
        group.bench_function(BenchmarkId::new("baseline", w.name), |b| {
            b.iter(|| {
                for (_, payload) in &w.payloads {
                    let _ = black_box(baseline::decode(black_box(payload)));
                }
            })
        });
    }
    group.finish();
}

/// A reused [`StreamDecoder`] against [`decode_batch`] (a fresh decoder per batch).
fn bench_stream(c: &mut Criterion) {
    let workloads: Vec<Workload> = workloads()
        .into_iter()
        .filter(|w| w.name != "synthetic_1000x16")
        .collect();
    let config = config();
    let mut group = c.benchmark_group("stream_vs_fresh");
    for w in &workloads {
        group.throughput(Throughput::ElementsAndBytes {
            elements: w.events(),
            bytes: w.bytes(),
        });
        let mut decoders = w.decoders();
        group.bench_function(BenchmarkId::new("reused_stream_decoder", w.name), |b| {
            b.iter(|| {
                for ((_, payload), decoder) in w.payloads.iter().zip(decoders.iter_mut()) {
                    black_box(decoder.decode(black_box(payload)).expect("kvroute decodes"));
                }
            })
        });
        group.bench_function(BenchmarkId::new("decode_batch_fresh", w.name), |b| {
            b.iter(|| {
                for (_, payload) in &w.payloads {
                    black_box(decode_batch(black_box(payload), &config).expect("kvroute decodes"));
                }
            })
        });
    }
    group.finish();
}

/// Puts the system allocator into the steady state a long-running process
/// reaches, whatever ran before: freeing one large mapped block makes glibc
/// raise its mmap and trim thresholds, so the baseline's ~0.7 MB of transient
/// allocations per synthetic batch are served from the heap instead of being
/// mapped, or trimmed and faulted back in, on every decode (which otherwise
/// makes the baseline up to 2x slower depending on what ran before it).
fn settle_allocator() {
    drop(black_box(vec![1u8; 8 << 20]));
}

/// Runs the equivalence check and allocation report, then both groups.
fn benches(c: &mut Criterion) {
    settle_allocator();
    bench_decode(c);
    bench_stream(c);
}

criterion_group! {
    name = decode;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = benches
}
criterion_main!(decode);
