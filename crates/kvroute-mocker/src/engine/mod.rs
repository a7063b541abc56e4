//! The simulated engine core of one data-parallel rank: pure, synchronous, no clock.
//!
//! [`Engine::step`] is one scheduler iteration: it picks the work (continuous
//! batching under `max_num_seqs` and a token budget, chunked prefill,
//! preemption when blocks run out), "computes" it, and returns how long that
//! would take ([`timing`]), the KV events it caused, and the tokens it
//! produced. The caller decides whether to sleep; tests call it in a loop.
//!
//! The scheduler follows vLLM v1 for both flavours:
//! * running requests first, in admission order, each taking
//!   `min(tokens left to compute, budget left)` (a decode takes 1);
//! * when a running request cannot get its blocks, the most recently admitted
//!   running request is preempted (its blocks released, its progress
//!   recomputed later from whatever stayed cached); if that is the request
//!   itself it waits;
//! * waiting requests are admitted only when nothing was preempted in the step,
//!   each with its prefix-cache hit: the longest run of cached full blocks,
//!   never the whole prompt (the last token is always computed, as in both engines).
//!
//! Caching points and events differ per flavour:
//! * vLLM: a block is cached (`BlockStored`, one event per newly cached run)
//!   when a step is scheduled that fills it, prompt and generated tokens
//!   alike, so a request admitted later in that step already hits it;
//!   evictions publish one `BlockRemoved` per hash;
//! * SGLang: prompt blocks are cached after each prefill chunk and generated
//!   blocks when the request finishes (`cache_unfinished_req` /
//!   `cache_finished_req`); consecutive compatible events are coalesced, as its
//!   event recorder does.
//!
//! A block whose digest is already cached by another block (two SGLang
//! requests computing the same prefix at once) is swapped for the cached one
//! and announced once: the cache never holds two blocks with one hash.

mod cache;
mod handoff;
mod schedule;
pub mod timing;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::time::Duration;

use rustc_hash::FxHashMap;

use crate::event::{
    BlockRemoved, BlockStored, ExtraKey, KvCacheEvent, MmKey, TrtllmImages, MEDIUM_GPU,
};
use crate::hashing::{
    sglang_page_digest, sglang_published, sha256_of, trtllm_block_key, trtllm_published,
    trtllm_root_key, vllm_block_digest, vllm_none_hash, vllm_published, Digest32, TrtllmToken,
    VllmHashKey,
};
use cache::{BlockId, BlockPool, CachedKey};
pub use handoff::Handoff;
use kvroute_core::event::WorkerFlavor;
use timing::TimingModel;

/// The parameters of one rank's engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Hashing, caching points and event shapes.
    pub flavor: WorkerFlavor,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the KV cache.
    pub num_gpu_blocks: usize,
    /// Most running requests.
    pub max_num_seqs: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Step durations.
    pub timing: TimingModel,
}

/// A request's id, unique within its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// A request as the engine receives it: tokens in, tokens to produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    /// Prompt token ids.
    pub prompt: Vec<u64>,
    /// The tokens the request will generate, in order (`max_tokens` of them).
    pub output: Vec<u64>,
    /// Multimodal items in the prompt (vLLM hashes them into block keys).
    pub mm_items: Vec<MmPlacement>,
    /// The LoRA adapter it runs with: part of every block's hash, and
    /// named in its `BlockStored` events.
    pub lora_name: Option<String>,
}

/// Where a multimodal item sits in the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmPlacement {
    /// Index of the item's first placeholder token.
    pub start: usize,
    /// Number of placeholder tokens.
    pub len: usize,
    /// The item identifier vLLM publishes in `extra_keys` (a hex digest).
    pub identifier: String,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// No prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Nothing to generate.
    #[error("max_tokens must be at least 1")]
    NoOutput,
    /// Prompt plus output cannot fit in the KV cache even alone.
    #[error(
        "prompt ({prompt} tokens) + max_tokens ({output}) exceeds the KV cache of {capacity} tokens"
    )]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested output tokens.
        output: usize,
        /// Cache capacity in tokens.
        capacity: usize,
    },
    /// A multimodal item lies outside the prompt.
    #[error("multimodal item at {start}+{len} lies outside the {prompt}-token prompt")]
    BadPlacement {
        /// Item start.
        start: usize,
        /// Item length.
        len: usize,
        /// Prompt length.
        prompt: usize,
    },
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub cached_tokens: usize,
}

/// What happened to one request in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// Output token number `index` (0-based) was generated.
    Token(usize),
    /// The request finished (after its last `Token`).
    Finished(Usage),
    /// The request was dropped (restart, or it can never be scheduled).
    Failed(String),
}

/// One request's update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutput {
    /// Which request.
    pub id: RequestId,
    /// What happened.
    pub update: Update,
}

/// The result of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// Simulated time the step takes (already divided by the speedup).
    pub duration: Duration,
    /// KV events of the step, in order (one published batch).
    pub events: Vec<KvCacheEvent>,
    /// Token and completion updates, in scheduling order.
    pub outputs: Vec<RequestOutput>,
    /// Uncached prompt tokens computed.
    pub prefill_tokens: usize,
    /// Requests that decoded one token.
    pub decodes: usize,
}

/// Counters and gauges for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting (new or preempted).
    pub waiting: usize,
    /// Blocks pinned by running requests.
    pub used_blocks: usize,
    /// Blocks holding a cached hash.
    pub cached_blocks: usize,
    /// Blocks in the cache.
    pub total_blocks: usize,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens_total: u64,
    /// Tokens generated.
    pub generation_tokens_total: u64,
    /// Prompt tokens looked up in the prefix cache (first scheduling only).
    pub prefix_cache_queries_total: u64,
    /// Of those, tokens found cached.
    pub prefix_cache_hits_total: u64,
    /// Of those, tokens neither cached nor computed here: their KV arrived
    /// from a prefill engine (decode legs, first scheduling only). Prompt
    /// tokens computed here = queries − hits − received.
    pub kv_received_tokens_total: u64,
    /// Requests finished.
    pub requests_finished_total: u64,
    /// Preemptions.
    pub preemptions_total: u64,
    /// Blocks evicted from the prefix cache.
    pub evicted_blocks_total: u64,
    /// Blocks pinned by finished requests for a remote decode to read.
    pub held_blocks: usize,
    /// Simulated time so far.
    pub elapsed: Duration,
}

/// Computes and publishes the flavour's block hashes.
#[derive(Debug, Clone)]
struct Hasher {
    flavor: WorkerFlavor,
    block_size: usize,
    none_hash: Digest32,
}

impl Hasher {
    fn digest(&self, parent: Option<&Digest32>, block: usize, r: &Request) -> Digest32 {
        let start = block * self.block_size;
        let tokens = &r.tokens[start..start + self.block_size];
        match self.flavor {
            WorkerFlavor::Vllm => {
                // vLLM's order: the adapter's key, then the items'.
                let lora = r
                    .lora_name
                    .iter()
                    .map(|name| VllmHashKey::Lora { name: name.clone() });
                let items = r
                    .mm_in_block(block, self.block_size)
                    .map(|(identifier, offset)| VllmHashKey::Mm {
                        identifier: identifier.to_owned(),
                        offset,
                    });
                let keys: Vec<VllmHashKey> = lora.chain(items).collect();
                vllm_block_digest(parent.unwrap_or(&self.none_hash), tokens, &keys)
            }
            WorkerFlavor::Sglang => match (parent, &r.lora_name) {
                // An adapter's pages chain from a digest of its name.
                (None, Some(name)) => {
                    sglang_page_digest(Some(&sglang_page_digest(None, &lora_ids(name))), tokens)
                }
                _ => sglang_page_digest(parent, tokens),
            },
            WorkerFlavor::Trtllm => {
                let root;
                let parent = match parent {
                    Some(p) => p,
                    None => {
                        let lora = r.lora_name.as_deref().map(|n| {
                            let d = sha256_of(n.as_bytes());
                            u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
                        });
                        root = trtllm_root_key(lora);
                        &root
                    }
                };
                let digests: Vec<(usize, Digest32)> = r
                    .mm_items
                    .iter()
                    .filter(|m| (start..start + self.block_size).contains(&m.start))
                    .filter_map(|m| Some((m.start, digest_of(&m.identifier)?)))
                    .collect();
                let keyed: Vec<TrtllmToken<'_>> = (start..start + self.block_size)
                    .map(|i| match digests.iter().find(|(at, _)| *at == i) {
                        Some((_, d)) => TrtllmToken::Digest(d),
                        None => TrtllmToken::Id(r.tokens[i]),
                    })
                    .collect();
                trtllm_block_key(parent, &keyed)
            }
        }
    }

    fn published(&self, digest: &Digest32) -> u64 {
        match self.flavor {
            WorkerFlavor::Vllm => vllm_published(digest),
            // The published i64, kept as its bits.
            WorkerFlavor::Sglang => sglang_published(digest) as u64,
            WorkerFlavor::Trtllm => trtllm_published(digest) as u64,
        }
    }
}

/// An image identifier's 32 bytes (64 hex digits), TensorRT-LLM's item digest.
fn digest_of(identifier: &str) -> Option<Digest32> {
    let bytes = identifier.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        let text = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(text, 16).ok()?;
    }
    Some(out)
}

#[derive(Debug, Clone)]
struct Request {
    /// Prompt followed by the tokens generated so far.
    tokens: Vec<u64>,
    prompt_len: usize,
    output: Vec<u64>,
    generated: usize,
    /// Tokens whose KV is computed (a prefix of `tokens`).
    num_computed: usize,
    blocks: Vec<BlockId>,
    /// Digest of each full block of `tokens` computed so far.
    digests: Vec<Digest32>,
    /// Leading blocks that are cached (registered or hit).
    num_registered: usize,
    cached_tokens: Option<usize>,
    mm_items: Vec<MmPlacement>,
    /// Its LoRA adapter.
    lora_name: Option<String>,
    /// How the request's KV crosses engines.
    handoff: Handoff,
}

impl Request {
    /// A request as it enters the engine: nothing computed, cached or generated yet.
    fn admitted(r: NewRequest) -> Request {
        let prompt_len = r.prompt.len();
        let mut tokens = r.prompt;
        tokens.reserve(r.output.len());
        Request {
            tokens,
            prompt_len,
            output: r.output,
            generated: 0,
            num_computed: 0,
            blocks: Vec::new(),
            digests: Vec::new(),
            num_registered: 0,
            cached_tokens: None,
            mm_items: r.mm_items,
            lora_name: r.lora_name,
            handoff: Handoff::default(),
        }
    }

    /// The multimodal items overlapping block `b`, with offsets relative to its start.
    fn mm_in_block(&self, b: usize, bs: usize) -> impl Iterator<Item = (&str, i64)> {
        let (lo, hi) = (b * bs, (b + 1) * bs);
        self.mm_items
            .iter()
            .filter(move |m| m.start < hi && m.start + m.len > lo)
            .map(move |m| (m.identifier.as_str(), m.start as i64 - lo as i64))
    }

    fn ensure_digests(&mut self, hasher: &Hasher, blocks: usize) {
        while self.digests.len() < blocks {
            let b = self.digests.len();
            let digest = hasher.digest(self.digests.last(), b, self);
            self.digests.push(digest);
        }
    }

    fn is_decode(&self) -> bool {
        self.generated > 0 && self.tokens.len() - self.num_computed == 1
    }
}

/// One rank's simulated engine.
#[derive(Debug, Clone)]
pub struct Engine {
    config: EngineConfig,
    hasher: Hasher,
    pool: BlockPool,
    requests: FxHashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    events: Vec<KvCacheEvent>,
    outputs: Vec<RequestOutput>,
    evicted: Vec<u64>,
    /// Blocks of finished requests kept for a remote decode ([`Handoff::hold`]).
    held: FxHashMap<RequestId, Vec<BlockId>>,
    stats: EngineStats,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(config: EngineConfig) -> Self {
        let hasher = Hasher {
            flavor: config.flavor,
            block_size: config.block_size.max(1),
            none_hash: vllm_none_hash(),
        };
        let pool = BlockPool::new(config.num_gpu_blocks);
        Engine {
            config,
            hasher,
            pool,
            requests: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            events: Vec::new(),
            outputs: Vec::new(),
            evicted: Vec::new(),
            held: FxHashMap::default(),
            stats: EngineStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// KV capacity in tokens.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.capacity() * self.hasher.block_size
    }

    /// Checks a request without queueing it (the HTTP layer answers 400 on an error).
    pub fn validate(&self, r: &NewRequest) -> Result<(), SubmitError> {
        validate_request(r, self.capacity_tokens())
    }

    /// Queues a request; it is scheduled by a later [`Engine::step`].
    pub fn submit(&mut self, id: RequestId, r: NewRequest) -> Result<(), SubmitError> {
        self.submit_with(id, r, Handoff::default())
    }

    /// Drops a request (client gone); its blocks are released, cached ones stay cached.
    pub fn abort(&mut self, id: RequestId) {
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        if let Some(r) = self.requests.remove(&id) {
            for &b in r.blocks.iter().rev() {
                self.pool.release(b);
            }
        }
    }

    /// True when nothing is queued, running or waiting to be published.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.events.is_empty()
    }

    /// Requests running or waiting.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// `reset_prefix_cache`: forgets every cached block and queues `AllBlocksCleared`.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.clear_cache();
        self.events.push(KvCacheEvent::AllBlocksCleared);
    }

    /// An engine restart: every request fails, the cache empties, no event is queued.
    pub fn restart(&mut self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.running.drain(..).collect();
        ids.extend(self.waiting.drain(..));
        self.requests.clear();
        self.held.clear();
        self.stats.held_blocks = 0;
        self.pool.reset();
        self.events.clear();
        self.outputs.clear();
        ids
    }

    /// Prompt tokens of `r` this rank's prefix cache holds right now: the
    /// `cached_tokens` the request would report if it were admitted at once
    /// (the longest run of cached full blocks, never the whole prompt).
    ///
    /// Read-only: nothing is pinned, touched or evicted, so asking does not
    /// change what a later request finds. The oracle policy of `kvroute bench`
    /// uses it (through `/internal/cache_match`) as the best possible routing
    /// information.
    pub fn cached_prefix_tokens(&self, r: &NewRequest) -> usize {
        let bs = self.hasher.block_size;
        let Some(last) = r.prompt.len().checked_sub(1) else {
            return 0;
        };
        let probe = Request::admitted(NewRequest {
            prompt: r.prompt.clone(),
            output: Vec::new(),
            mm_items: r.mm_items.clone(),
            lora_name: None,
        });
        let mut parent: Option<Digest32> = None;
        let mut hits = 0;
        for b in 0..last / bs {
            let digest = self.hasher.digest(parent.as_ref(), b, &probe);
            if self.pool.lookup(&digest).is_none() {
                break;
            }
            hits += 1;
            parent = Some(digest);
        }
        hits * bs
    }

    /// Counters and gauges.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            used_blocks: self.pool.in_use(),
            cached_blocks: self.pool.cached(),
            total_blocks: self.pool.capacity(),
            ..self.stats
        }
    }

    /// One scheduler iteration; `None` when there is nothing to do or publish
    /// (or nothing can run until held blocks are released).
    pub fn step(&mut self) -> Option<StepOutcome> {
        if self.running.is_empty() && self.waiting.is_empty() {
            if self.events.is_empty() {
                return None;
            }
            return Some(StepOutcome {
                duration: Duration::ZERO,
                events: std::mem::take(&mut self.events),
                outputs: Vec::new(),
                prefill_tokens: 0,
                decodes: 0,
            });
        }
        let (scheduled, preempted) = self.schedule();
        if scheduled.is_empty() && !preempted && self.running.is_empty() {
            if !self.held.is_empty() {
                // Only blocks held for remote decodes keep the head waiting:
                // nothing to do until a release (the caller steps again then).
                return (!self.events.is_empty()).then(|| StepOutcome {
                    duration: Duration::ZERO,
                    events: std::mem::take(&mut self.events),
                    outputs: std::mem::take(&mut self.outputs),
                    prefill_tokens: 0,
                    decodes: 0,
                });
            }
            // Unreachable with validated requests (a lone request always fits);
            // failing the head keeps a bug from spinning forever.
            if let Some(id) = self.waiting.pop_front() {
                self.requests.remove(&id);
                self.outputs.push(RequestOutput {
                    id,
                    update: Update::Failed("the request cannot be scheduled".into()),
                });
            }
        }
        let (prefill_tokens, decodes, active_kv) = self.execute(&scheduled);
        let usage = active_kv as f64 / self.capacity_tokens().max(1) as f64;
        let duration = self
            .config
            .timing
            .step_duration(prefill_tokens, decodes > 0, usage);
        self.stats.elapsed += duration;
        Some(StepOutcome {
            duration,
            events: std::mem::take(&mut self.events),
            outputs: std::mem::take(&mut self.outputs),
            prefill_tokens,
            decodes,
        })
    }

    /// Turns the evictions of the last allocations into `BlockRemoved` events.
    fn flush_evictions(&mut self) {
        if self.evicted.is_empty() {
            return;
        }
        self.stats.evicted_blocks_total += self.evicted.len() as u64;
        let evicted = std::mem::take(&mut self.evicted);
        for &h in &evicted {
            // vLLM: one event per hash; SGLang's recorder merges them (push_event).
            self.push_event(KvCacheEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![h],
                medium: Some(MEDIUM_GPU.to_owned()),
            }));
        }
        self.evicted = evicted;
        self.evicted.clear();
    }

    /// Queues an event; the SGLang flavour coalesces it into the previous one
    /// when its recorder would (a store continuing the previous store's chain
    /// with the same attributes, or consecutive removals of one medium).
    fn push_event(&mut self, event: KvCacheEvent) {
        if !self.config.flavor.caches_when_scheduled() {
            match (self.events.last_mut(), &event) {
                (Some(KvCacheEvent::BlockStored(tail)), KvCacheEvent::BlockStored(new))
                    if new.parent_block_hash.is_some()
                        && new.parent_block_hash == tail.block_hashes.last().copied()
                        && new.block_size == tail.block_size
                        && new.medium == tail.medium
                        && new.lora_id == tail.lora_id
                        && new.lora_name == tail.lora_name
                        && new.cache_salt == tail.cache_salt
                        && new.session_id == tail.session_id =>
                {
                    let (tail_blocks, shift) = (tail.block_hashes.len(), tail.token_ids.len());
                    tail.block_hashes.extend_from_slice(&new.block_hashes);
                    tail.token_ids.extend_from_slice(&new.token_ids);
                    if tail.trtllm_images.is_some() || new.trtllm_images.is_some() {
                        let images = tail.trtllm_images.get_or_insert_with(|| {
                            Box::new(TrtllmImages {
                                mm_keys: vec![Vec::new(); tail_blocks],
                                digest_tokens: Vec::new(),
                            })
                        });
                        match &new.trtllm_images {
                            Some(more) => {
                                images.mm_keys.extend(more.mm_keys.iter().cloned());
                                let moved = more.digest_tokens.iter();
                                images
                                    .digest_tokens
                                    .extend(moved.map(|(at, d)| (at + shift, d.clone())));
                            }
                            None => images
                                .mm_keys
                                .extend(std::iter::repeat_n(Vec::new(), new.block_hashes.len())),
                        }
                    }
                    return;
                }
                (Some(KvCacheEvent::BlockRemoved(tail)), KvCacheEvent::BlockRemoved(new))
                    if tail.medium == new.medium =>
                {
                    tail.block_hashes.extend_from_slice(&new.block_hashes);
                    return;
                }
                _ => {}
            }
        }
        self.events.push(event);
    }

    /// Panics when an invariant is broken (tests only).
    #[cfg(test)]
    fn check_invariants(&self) {
        self.pool.check_invariants();
        let pinned: usize = self.requests.values().map(|r| r.blocks.len()).sum();
        let held: usize = self.held.values().map(Vec::len).sum();
        assert_eq!(held, self.stats.held_blocks);
        assert!(self.pool.in_use() <= pinned + held);
        for id in &self.running {
            let r = &self.requests[id];
            assert!(r.blocks.len() * self.hasher.block_size >= r.num_computed);
        }
        for id in &self.waiting {
            assert!(self.requests[id].blocks.is_empty());
        }
        assert_eq!(self.running.len() + self.waiting.len(), self.requests.len());
    }
}

/// The checks [`Engine::validate`] applies, for callers that hold no engine.
pub fn validate_request(r: &NewRequest, capacity_tokens: usize) -> Result<(), SubmitError> {
    if r.prompt.is_empty() {
        return Err(SubmitError::EmptyPrompt);
    }
    if r.output.is_empty() {
        return Err(SubmitError::NoOutput);
    }
    if r.prompt.len() + r.output.len() > capacity_tokens {
        return Err(SubmitError::TooLong {
            prompt: r.prompt.len(),
            output: r.output.len(),
            capacity: capacity_tokens,
        });
    }
    for m in &r.mm_items {
        if m.len == 0 || m.start + m.len > r.prompt.len() {
            return Err(SubmitError::BadPlacement {
                start: m.start,
                len: m.len,
                prompt: r.prompt.len(),
            });
        }
    }
    Ok(())
}

/// An adapter's name as ids, to seed an SGLang chain apart from the base model's.
fn lora_ids(name: &str) -> Vec<u64> {
    name.bytes().map(|b| u64::from(b) | (1 << 40)).collect()
}

/// The `BlockStored` for blocks `start..end` of a request.
fn stored_event(hasher: &Hasher, r: &Request, start: usize, end: usize) -> BlockStored {
    let bs = hasher.block_size;
    let extra_keys = match hasher.flavor {
        WorkerFlavor::Vllm => Some(
            (start..end)
                .map(|b| {
                    let items: Vec<ExtraKey> = r
                        .mm_in_block(b, bs)
                        .map(|(identifier, offset)| ExtraKey::Mm {
                            identifier: identifier.to_owned(),
                            offset,
                        })
                        .collect();
                    (!items.is_empty()).then_some(items)
                })
                .collect(),
        ),
        WorkerFlavor::Sglang | WorkerFlavor::Trtllm => None,
    };
    // TensorRT-LLM names each image on the blocks it overlaps, and writes its
    // first position as the image's digest.
    let trtllm_images = match hasher.flavor {
        WorkerFlavor::Trtllm if !r.mm_items.is_empty() => {
            let keys = (start..end)
                .map(|b| {
                    r.mm_in_block(b, bs)
                        .map(|(identifier, offset)| MmKey {
                            hash: identifier.to_owned(),
                            start_offset: offset.min(0).unsigned_abs(),
                            uuid: None,
                        })
                        .collect()
                })
                .collect();
            let digests = r
                .mm_items
                .iter()
                .filter(|m| (start * bs..end * bs).contains(&m.start))
                .map(|m| (m.start - start * bs, m.identifier.clone()))
                .collect();
            Some(Box::new(TrtllmImages {
                mm_keys: keys,
                digest_tokens: digests,
            }))
        }
        _ => None,
    };
    BlockStored {
        block_hashes: r.digests[start..end]
            .iter()
            .map(|d| hasher.published(d))
            .collect(),
        parent_block_hash: start
            .checked_sub(1)
            .map(|p| hasher.published(&r.digests[p])),
        token_ids: r.tokens[start * bs..end * bs].to_vec(),
        block_size: u32::try_from(bs).unwrap_or(u32::MAX),
        lora_id: None,
        medium: Some(MEDIUM_GPU.to_owned()),
        lora_name: r.lora_name.clone(),
        extra_keys,
        cache_salt: None,
        session_id: None,
        trtllm_images,
    }
}
