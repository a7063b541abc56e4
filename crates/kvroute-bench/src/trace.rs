//! A synthetic KV-event trace shaped like a routed fleet's traffic.
//!
//! Requests belong to conversations; a conversation starts with one of a few
//! hundred shared system prompts (popularity Zipf-distributed, s = 1.1) and
//! grows by a turn of 2–8 blocks each time it returns (multi-turn growth).
//! Each conversation lives on one worker (90 % of turns), chosen among a few
//! "home" workers of its prompt, as a KV-aware router would place it. Every
//! worker simulates a prefix cache of `residencies / workers` blocks with LRU
//! eviction (a chain's tail is evicted before its head), and the trace is the
//! stream of `Stored` / `Removed` events those caches publish, with engine
//! hashes that are a function of the whole prefix, as real engines' are.
//! Deterministic for a given seed.

use std::collections::BTreeMap;

use kvroute_core::event::{ExternalHash, KvEvent, Removed, Stored, StoredBlock, Tier};
use kvroute_core::hash::{next_sequence_hash, LocalBlockHash, SequenceHash};
use kvroute_core::index::WorkerRank;
use kvroute_core::rng::SplitMix64;
use rustc_hash::FxHashMap;

/// Tokens per block the trace's stored events declare (its hashes stand
/// for whole blocks; the size only labels them).
const BLOCK_SIZE: u32 = 16;

/// Trace parameters.
#[derive(Debug, Clone)]
pub struct TraceConfig {
    /// Workers (one rank each).
    pub workers: u32,
    /// Resident blocks the whole fleet holds once caches are full.
    pub residencies: u64,
    /// Seed of every random choice.
    pub seed: u64,
}

#[derive(Debug, Clone)]
struct Conversation {
    worker: u32,
    locals: Vec<u64>,
    /// Engine hash of each prefix `locals[..=i]`.
    exts: Vec<u64>,
}

#[derive(Debug, Default, Clone)]
struct WorkerCache {
    stamp_of: FxHashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
}

/// Generates the event stream of a simulated fleet.
#[derive(Debug, Clone)]
pub struct TraceGen {
    cfg: TraceConfig,
    rng: SplitMix64,
    capacity: usize,
    prompts: Vec<Vec<u64>>,
    zipf_cdf: Vec<f64>,
    conversations: Vec<Conversation>,
    caches: Vec<WorkerCache>,
    clock: u64,
    held: u64,
}

/// Engine hash of a prefix, deterministic across workers.
fn ext_after(parent: Option<u64>, local: u64) -> u64 {
    let parent = parent.unwrap_or(0x5eed);
    next_sequence_hash(
        SequenceHash(parent ^ 0xa5a5_a5a5_a5a5_a5a5),
        LocalBlockHash(local),
    )
    .0
}

impl TraceGen {
    /// A fleet with empty caches.
    pub fn new(cfg: TraceConfig) -> Self {
        let mut rng = SplitMix64::new(cfg.seed);
        let workers = cfg.workers.max(1);
        let capacity = (cfg.residencies / u64::from(workers)).max(64) as usize;
        let prompt_count = 64 + (cfg.residencies / 10_000) as usize;
        let prompts: Vec<Vec<u64>> = (0..prompt_count)
            .map(|_| {
                let len = 8 + rng.below(40);
                (0..len).map(|_| rng.next_u64()).collect()
            })
            .collect();
        let weights: Vec<f64> = (1..=prompt_count)
            .map(|k| 1.0 / (k as f64).powf(1.1))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let zipf_cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        TraceGen {
            cfg: TraceConfig { workers, ..cfg },
            rng,
            capacity,
            prompts,
            zipf_cdf,
            conversations: Vec::new(),
            caches: vec![WorkerCache::default(); workers as usize],
            clock: 0,
            held: 0,
        }
    }

    /// Blocks held by all simulated caches together.
    pub fn held(&self) -> u64 {
        self.held
    }

    fn pick_prompt(&mut self) -> usize {
        let u = self.rng.next_f64();
        self.zipf_cdf
            .partition_point(|&c| c < u)
            .min(self.prompts.len() - 1)
    }

    fn new_conversation(&mut self) -> Conversation {
        let prompt = self.pick_prompt();
        let workers = u64::from(self.cfg.workers);
        let worker = if self.rng.next_f64() < 0.1 {
            self.rng.below(workers as usize) as u64
        } else {
            // One of four home workers of this prompt.
            (prompt as u64)
                .wrapping_mul(0x9e37_79b9)
                .wrapping_add(self.rng.below(4) as u64 * 7919)
                % workers
        } as u32;
        let locals = self.prompts[prompt].clone();
        let mut exts = Vec::with_capacity(locals.len());
        for &l in &locals {
            exts.push(ext_after(exts.last().copied(), l));
        }
        Conversation {
            worker,
            locals,
            exts,
        }
    }

    /// A 64-block query shaped like the next request of a random conversation,
    /// or (one in ten) of a conversation nobody has seen.
    pub fn query(&mut self, blocks: usize) -> Vec<LocalBlockHash> {
        let mut q: Vec<u64> = if self.conversations.is_empty() || self.rng.next_f64() < 0.1 {
            Vec::new()
        } else {
            let i = self.rng.below(self.conversations.len());
            self.conversations[i]
                .locals
                .iter()
                .take(blocks)
                .copied()
                .collect()
        };
        while q.len() < blocks {
            q.push(self.rng.next_u64());
        }
        q.into_iter().map(LocalBlockHash).collect()
    }

    /// Simulates one request and appends the events it causes. Returns block operations.
    pub fn step(&mut self, out: &mut Vec<(WorkerRank, KvEvent)>) -> u64 {
        let pool = (self.cfg.workers as usize * 8).max(16);
        let i = if self.conversations.len() < pool || self.rng.next_f64() < 0.3 {
            let c = self.new_conversation();
            if self.conversations.len() < pool {
                self.conversations.push(c);
                self.conversations.len() - 1
            } else {
                let i = self.rng.below(pool);
                self.conversations[i] = c;
                i
            }
        } else {
            let i = self.rng.below(self.conversations.len());
            let turn = 2 + self.rng.below(7);
            let c = &mut self.conversations[i];
            if c.locals.len() + turn > 200 {
                let fresh = self.new_conversation();
                self.conversations[i] = fresh;
            } else {
                for _ in 0..turn {
                    let l = self.rng.next_u64();
                    let e = ext_after(c.exts.last().copied(), l);
                    c.locals.push(l);
                    c.exts.push(e);
                }
            }
            if self.rng.next_f64() < 0.1 {
                self.conversations[i].worker = self.rng.below(self.cfg.workers as usize) as u32;
            }
            i
        };
        self.serve(i, out)
    }

    fn serve(&mut self, conv: usize, out: &mut Vec<(WorkerRank, KvEvent)>) -> u64 {
        let c = &self.conversations[conv];
        let worker = c.worker;
        let cache = &mut self.caches[worker as usize];
        let held = c
            .exts
            .iter()
            .take_while(|e| cache.stamp_of.contains_key(e))
            .count();
        let key = WorkerRank::new(worker, 0);
        let mut ops = 0;
        if held < c.locals.len() {
            let blocks: Vec<StoredBlock> = (held..c.locals.len())
                .map(|i| StoredBlock {
                    external: ExternalHash(c.exts[i]),
                    local: LocalBlockHash(c.locals[i]),
                })
                .collect();
            ops += blocks.len() as u64;
            out.push((
                key,
                KvEvent::Stored(Stored::plain(
                    held.checked_sub(1).map(|p| ExternalHash(c.exts[p])),
                    blocks,
                    Tier::Device,
                    BLOCK_SIZE,
                )),
            ));
        }
        // Touch the chain tail first, so the head is the most recent.
        let len = c.exts.len() as u64;
        let base = self.clock;
        for (i, &ext) in c.exts.iter().enumerate() {
            let stamp = base + len - i as u64;
            if let Some(old) = cache.stamp_of.insert(ext, stamp) {
                cache.by_stamp.remove(&old);
            } else {
                self.held += 1;
            }
            cache.by_stamp.insert(stamp, ext);
        }
        self.clock += len + 1;
        let mut evicted = Vec::new();
        while cache.stamp_of.len() > self.capacity {
            let Some((_, ext)) = cache.by_stamp.pop_first() else {
                break;
            };
            cache.stamp_of.remove(&ext);
            evicted.push(ExternalHash(ext));
            self.held -= 1;
        }
        if !evicted.is_empty() {
            ops += evicted.len() as u64;
            out.push((
                key,
                KvEvent::Removed(Removed {
                    blocks: evicted,
                    tier: Tier::Device,
                }),
            ));
        }
        ops
    }
}
