//! Engine tests: scheduling, caching, events and timing, all without a clock.

use super::*;
use crate::hashing::{sglang_page_digest, sglang_published, vllm_block_digest, vllm_none_hash};
use kvroute_core::rng::SplitMix64;

/// A small engine's configuration: blocks of 4 tokens, 8 sequences, 64 tokens a step.
pub(super) fn config(flavor: WorkerFlavor, blocks: usize) -> EngineConfig {
    EngineConfig {
        flavor,
        block_size: 4,
        num_gpu_blocks: blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        timing: TimingModel::default(),
    }
}

/// A request of `prompt` generating `max_tokens` ids from 900 000.
pub(super) fn request(prompt: impl IntoIterator<Item = u64>, max_tokens: usize) -> NewRequest {
    NewRequest {
        prompt: prompt.into_iter().collect(),
        output: (0..max_tokens as u64).map(|i| 900_000 + i).collect(),
        mm_items: Vec::new(),
        lora_name: None,
    }
}

/// Steps until idle; returns every event and every output, checking invariants each step.
fn drain(engine: &mut Engine) -> (Vec<KvCacheEvent>, Vec<RequestOutput>) {
    let mut events = Vec::new();
    let mut outputs = Vec::new();
    for _ in 0..100_000 {
        let Some(step) = engine.step() else {
            return (events, outputs);
        };
        engine.check_invariants();
        events.extend(step.events);
        outputs.extend(step.outputs);
    }
    panic!("engine did not go idle");
}

fn usage_of(outputs: &[RequestOutput], id: u64) -> Usage {
    outputs
        .iter()
        .find_map(|o| match (o.id == RequestId(id), &o.update) {
            (true, Update::Finished(u)) => Some(*u),
            _ => None,
        })
        .expect("request finished")
}

fn stored(events: &[KvCacheEvent]) -> Vec<&BlockStored> {
    events
        .iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

/// Every stored block hash, in event order.
fn stored_hashes(events: &[KvCacheEvent]) -> Vec<u64> {
    stored(events)
        .iter()
        .flat_map(|s| s.block_hashes.iter().copied())
        .collect()
}

fn removed_hashes(events: &[KvCacheEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockRemoved(r) => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// vLLM hashes of every full block of `tokens`, recomputed from the definition.
fn vllm_chain(tokens: &[u64], bs: usize) -> Vec<u64> {
    let mut parent = vllm_none_hash();
    tokens
        .chunks_exact(bs)
        .map(|block| {
            parent = vllm_block_digest(&parent, block, &[]);
            vllm_published(&parent)
        })
        .collect()
}

#[test]
fn a_repeated_prompt_hits_every_full_block_but_the_last_token() {
    let mut e = Engine::new(config(WorkerFlavor::Vllm, 64));
    e.submit(RequestId(1), request(1..=10, 3)).expect("valid");
    let (_, out) = drain(&mut e);
    assert_eq!(usage_of(&out, 1).cached_tokens, 0);
    // 10 tokens, block 4: blocks [1..4] and [5..8] are cached → 8 tokens.
    e.submit(RequestId(2), request(1..=10, 3)).expect("valid");
    let (_, out) = drain(&mut e);
    let u = usage_of(&out, 2);
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
        (10, 3, 8)
    );
    // A block-aligned prompt keeps its last block uncached: 8 tokens → 4 cached.
    e.submit(RequestId(3), request(1..=8, 1)).expect("valid");
    let (_, out) = drain(&mut e);
    assert_eq!(usage_of(&out, 3).cached_tokens, 4);
}

#[test]
fn vllm_stores_prompt_and_generated_blocks_as_they_fill_with_real_hashes() {
    let mut e = Engine::new(config(WorkerFlavor::Vllm, 64));
    e.submit(RequestId(1), request(1..=6, 7)).expect("valid");
    let (events, out) = drain(&mut e);
    let tokens: Vec<u64> = out
        .iter()
        .filter_map(|o| match o.update {
            Update::Token(i) => Some(900_000 + i as u64),
            _ => None,
        })
        .collect();
    assert_eq!(tokens.len(), 7);
    let stores = stored(&events);
    // Prefill computes 6 tokens → block 0; decode steps fill block 1 (tokens 5..8)
    // and block 2 (9..12). The 7th generated token (index 12) is never computed.
    let all: Vec<u64> = (1..=6).chain(tokens.iter().copied()).collect();
    let hashes: Vec<u64> = stores.iter().flat_map(|s| s.block_hashes.clone()).collect();
    assert_eq!(hashes, vllm_chain(&all[..12], 4));
    assert_eq!(stores[0].parent_block_hash, None);
    assert_eq!(stores[1].parent_block_hash, Some(hashes[0]));
    assert_eq!(stores.len(), 3, "one store per step that filled a block");
    for s in &stores {
        assert_eq!(s.token_ids.len(), s.block_hashes.len() * 4);
        assert_eq!(
            s.extra_keys.as_ref().map(Vec::len),
            Some(s.block_hashes.len())
        );
    }
}

#[test]
fn sglang_caches_prompt_pages_after_prefill_and_output_pages_at_finish() {
    let mut e = Engine::new(config(WorkerFlavor::Sglang, 64));
    e.submit(RequestId(1), request(1..=8, 9)).expect("valid");
    let (events, out) = drain(&mut e);
    let stores = stored(&events);
    assert_eq!(stores.len(), 2);
    // Prefill: pages [1..4], [5..8]. Finish: KV of 8 + 8 computed tokens → 2 more pages.
    assert_eq!(stores[0].block_hashes.len(), 2);
    assert_eq!(stores[1].block_hashes.len(), 2);
    let s1 = sglang_page_digest(None, &[1, 2, 3, 4]);
    let s2 = sglang_page_digest(Some(&s1), &[5, 6, 7, 8]);
    assert_eq!(
        stores[0].block_hashes,
        [sglang_published(&s1) as u64, sglang_published(&s2) as u64]
    );
    assert_eq!(
        stores[1].parent_block_hash,
        Some(sglang_published(&s2) as u64)
    );
    assert!(stores.iter().all(|s| s.extra_keys.is_none()));
    assert_eq!(usage_of(&out, 1).completion_tokens, 9);
}

#[test]
fn sglang_coalesces_a_chunked_prefill_into_one_store_per_step_and_merges_removals() {
    let mut cfg = config(WorkerFlavor::Sglang, 8);
    cfg.max_num_batched_tokens = 8;
    let mut e = Engine::new(cfg);
    e.submit(RequestId(1), request(1..=20, 1)).expect("valid");
    let (events, _) = drain(&mut e);
    // Chunks of 8 tokens: pages 0-1, 2-3, then page 4: one store per chunk.
    let stores = stored(&events);
    assert_eq!(
        stores
            .iter()
            .map(|s| s.block_hashes.len())
            .collect::<Vec<_>>(),
        [2, 2, 1]
    );
}

#[test]
fn sglang_merges_consecutive_removals_into_one_event() {
    let mut e = Engine::new(config(WorkerFlavor::Sglang, 5));
    e.submit(RequestId(1), request(1..=16, 1)).expect("valid");
    let (events, _) = drain(&mut e);
    let cached: Vec<u64> = stored(&events)[0].block_hashes.clone();
    assert_eq!(cached.len(), 4);
    // 17 new tokens need 5 blocks: the free one and all four cached pages, at once.
    e.submit(RequestId(2), request(101..=117, 1))
        .expect("valid");
    let (events, _) = drain(&mut e);
    let removals: Vec<&KvCacheEvent> = events
        .iter()
        .filter(|e| matches!(e, KvCacheEvent::BlockRemoved(_)))
        .collect();
    assert_eq!(removals.len(), 1);
    let mut removed = removed_hashes(&events);
    removed.sort_unstable();
    let mut expected = cached;
    expected.sort_unstable();
    assert_eq!(removed, expected);
}

#[test]
fn eviction_removes_exactly_the_least_recently_used_blocks_one_event_per_hash() {
    // 4 blocks of 4 tokens. Request A caches 2 blocks (prompt 9 tokens, 1 output).
    let mut e = Engine::new(config(WorkerFlavor::Vllm, 4));
    e.submit(RequestId(1), request(1..=9, 1)).expect("valid");
    let (events_a, _) = drain(&mut e);
    let a_hashes = stored_hashes(&events_a);
    assert_eq!(a_hashes, vllm_chain(&(1..=8).collect::<Vec<_>>(), 4));
    // B needs 4 blocks for 13 new tokens: the two free ones (A's partial 3rd
    // block went back to the free list) and both of A's cached blocks, tail first.
    e.submit(RequestId(2), request(201..=213, 1))
        .expect("valid");
    let (events_b, _) = drain(&mut e);
    let removed = removed_hashes(&events_b);
    assert_eq!(removed, [a_hashes[1], a_hashes[0]]);
    let per_event = events_b
        .iter()
        .filter(|e| matches!(e, KvCacheEvent::BlockRemoved(r) if r.block_hashes.len() == 1))
        .count();
    assert_eq!(per_event, 2, "vLLM publishes one BlockRemoved per hash");
    assert_eq!(e.stats().evicted_blocks_total, 2);
}

#[test]
fn pinned_blocks_are_never_evicted_and_memory_pressure_preempts() {
    // 6 blocks, two requests that each end up needing 4 blocks: one must be preempted.
    let mut cfg = config(WorkerFlavor::Vllm, 6);
    cfg.max_num_batched_tokens = 64;
    let mut e = Engine::new(cfg);
    e.submit(RequestId(1), request(1..=5, 10)).expect("valid");
    e.submit(RequestId(2), request(101..=105, 10))
        .expect("valid");
    let (events, out) = drain(&mut e);
    assert!(e.stats().preemptions_total > 0);
    assert_eq!(usage_of(&out, 1).completion_tokens, 10);
    assert_eq!(usage_of(&out, 2).completion_tokens, 10);
    // Every removed hash was stored before and never removed twice in a row.
    let mut live = std::collections::HashSet::new();
    for ev in &events {
        match ev {
            KvCacheEvent::BlockStored(s) => {
                for h in &s.block_hashes {
                    assert!(live.insert(*h), "stored twice without removal");
                }
            }
            KvCacheEvent::BlockRemoved(r) => {
                for h in &r.block_hashes {
                    assert!(live.remove(h), "removed a block that was not stored");
                }
            }
            KvCacheEvent::AllBlocksCleared => live.clear(),
        }
    }
    assert!(live.len() <= 6);
}

#[test]
fn identical_concurrent_prompts_share_blocks_and_announce_them_once() {
    // Both are admitted in one step. vLLM caches the first one's blocks as it
    // schedules them, so the second hits all but its last token; SGLang caches
    // a chunk after computing it, so both compute the prefix.
    for (flavor, second_hits) in [(WorkerFlavor::Vllm, 8), (WorkerFlavor::Sglang, 0)] {
        let mut e = Engine::new(config(flavor, 64));
        e.submit(RequestId(1), request(1..=12, 2)).expect("valid");
        e.submit(RequestId(2), request(1..=12, 2)).expect("valid");
        let (events, out) = drain(&mut e);
        let hashes = stored_hashes(&events);
        let mut unique = hashes.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), hashes.len(), "{flavor:?}");
        assert_eq!(usage_of(&out, 1).cached_tokens, 0, "{flavor:?}");
        assert_eq!(usage_of(&out, 2).cached_tokens, second_hits, "{flavor:?}");
        assert_eq!(e.stats().cached_blocks, 3, "{flavor:?}");
    }
}

#[test]
fn vllm_a_request_admitted_during_a_chunked_prefill_hits_the_chunk_being_computed() {
    // 64-token budget, 4-token blocks: request 1's 72-token prompt takes two
    // steps. Request 2 (the same prompt) arrives after the first and is
    // admitted in the second beside the last 8 tokens, which fill blocks 16
    // and 17: it hits them too, so all but its last token (17 blocks).
    let mut e = Engine::new(config(WorkerFlavor::Vllm, 64));
    e.submit(RequestId(1), request(1..=72, 1)).expect("valid");
    let first = e.step().expect("a step");
    assert_eq!(first.prefill_tokens, 64);
    e.submit(RequestId(2), request(1..=72, 1)).expect("valid");
    let (_, out) = drain(&mut e);
    assert_eq!(usage_of(&out, 2).cached_tokens, 68);
}

#[test]
fn reset_clears_the_cache_and_queues_all_blocks_cleared() {
    let mut e = Engine::new(config(WorkerFlavor::Vllm, 64));
    e.submit(RequestId(1), request(1..=10, 1)).expect("valid");
    drain(&mut e);
    e.reset_prefix_cache();
    let step = e.step().expect("the clear is published");
    assert_eq!(step.events, [KvCacheEvent::AllBlocksCleared]);
    assert_eq!(step.duration, Duration::ZERO);
    assert!(e.step().is_none());
    e.submit(RequestId(2), request(1..=10, 1)).expect("valid");
    let (_, out) = drain(&mut e);
    assert_eq!(usage_of(&out, 2).cached_tokens, 0);
}

#[test]
fn restart_fails_every_request_and_publishes_nothing() {
    let mut e = Engine::new(config(WorkerFlavor::Sglang, 64));
    e.submit(RequestId(1), request(1..=10, 5)).expect("valid");
    e.submit(RequestId(2), request(1..=10, 5)).expect("valid");
    e.step();
    let mut failed = e.restart();
    failed.sort();
    assert_eq!(failed, [RequestId(1), RequestId(2)]);
    assert!(e.step().is_none());
    assert_eq!(e.stats().cached_blocks, 0);
}

#[test]
fn vllm_multimodal_blocks_carry_mm_extra_keys_with_relative_offsets() {
    let mut e = Engine::new(config(WorkerFlavor::Vllm, 64));
    // An item of 6 placeholders at 2..8 spans blocks 0 and 1; block 2 is text.
    let mut r = request([1, 2, 7, 7, 7, 7, 7, 7, 3, 4, 5, 6, 9], 1);
    r.mm_items.push(MmPlacement {
        start: 2,
        len: 6,
        identifier: "ab".repeat(32),
    });
    e.submit(RequestId(1), r).expect("valid");
    let (events, _) = drain(&mut e);
    let s = stored(&events)[0];
    let keys = s.extra_keys.as_ref().expect("vLLM writes extra_keys");
    let mm = |offset| {
        Some(vec![ExtraKey::Mm {
            identifier: "ab".repeat(32),
            offset,
        }])
    };
    assert_eq!(keys, &vec![mm(2), mm(-2), None]);
    let key = |offset| VllmHashKey::Mm {
        identifier: "ab".repeat(32),
        offset,
    };
    let d0 = vllm_block_digest(&vllm_none_hash(), &[1, 2, 7, 7], &[key(2)]);
    let d1 = vllm_block_digest(&d0, &[7, 7, 7, 7], &[key(-2)]);
    assert_eq!(
        s.block_hashes[..2],
        [vllm_published(&d0), vllm_published(&d1)]
    );
}

#[test]
fn step_durations_follow_the_timing_model() {
    let mut e = Engine::new(config(WorkerFlavor::Vllm, 64));
    e.submit(RequestId(1), request(1..=10, 2)).expect("valid");
    let prefill = e.step().expect("prefill");
    assert_eq!((prefill.prefill_tokens, prefill.decodes), (10, 0));
    let t = TimingModel::default();
    assert_eq!(prefill.duration, t.step_duration(10, false, 0.0));
    let decode = e.step().expect("decode");
    assert_eq!((decode.prefill_tokens, decode.decodes), (0, 1));
    // 11 tokens of KV out of 256.
    assert_eq!(decode.duration, t.step_duration(0, true, 11.0 / 256.0));
    assert_eq!(e.stats().elapsed, prefill.duration + decode.duration);
}

#[test]
fn oversized_and_empty_requests_are_refused() {
    let e = Engine::new(config(WorkerFlavor::Vllm, 2));
    assert_eq!(e.validate(&request([], 1)), Err(SubmitError::EmptyPrompt));
    assert_eq!(e.validate(&request([1], 0)), Err(SubmitError::NoOutput));
    assert!(matches!(
        e.validate(&request(1..=8, 1)),
        Err(SubmitError::TooLong { capacity: 8, .. })
    ));
    assert_eq!(e.validate(&request(1..=7, 1)), Ok(()));
}

/// The router's view of a stream: every store names new blocks whose parent is
/// known, every removal names a known block (parents are only checked when the
/// cache was never reset, since a reset forgets the parents of running requests).
#[derive(Default)]
struct RouterView {
    live: std::collections::HashSet<u64>,
    check_parents: bool,
}

impl RouterView {
    fn apply(&mut self, events: &[KvCacheEvent]) {
        for event in events {
            match event {
                KvCacheEvent::BlockStored(s) => {
                    if self.check_parents {
                        if let Some(p) = s.parent_block_hash {
                            assert!(self.live.contains(&p), "store under an unknown parent");
                        }
                    }
                    for h in &s.block_hashes {
                        assert!(self.live.insert(*h), "block stored twice");
                    }
                }
                KvCacheEvent::BlockRemoved(r) => {
                    for h in &r.block_hashes {
                        assert!(self.live.remove(h), "removal of an unknown block");
                    }
                }
                KvCacheEvent::AllBlocksCleared => {
                    self.live.clear();
                    self.check_parents = false;
                }
            }
        }
    }
}

#[test]
fn random_workloads_keep_every_invariant_and_finish_every_request() {
    for seed in 0..40u64 {
        let resets = seed < 20;
        let mut view = RouterView {
            check_parents: true,
            ..RouterView::default()
        };
        let mut rng = SplitMix64::new(seed);
        let flavor = if seed % 2 == 0 {
            WorkerFlavor::Vllm
        } else {
            WorkerFlavor::Sglang
        };
        let mut cfg = config(flavor, 6 + rng.below(20));
        cfg.max_num_seqs = 1 + rng.below(4);
        cfg.max_num_batched_tokens = 4 + rng.below(30);
        let mut e = Engine::new(cfg);
        let mut submitted = 0u64;
        let mut finished = 0u64;
        let mut aborted = 0u64;
        for round in 0..300 {
            if rng.below(3) == 0 {
                let prefix = rng.below(3) as u64;
                let len = 1 + rng.below(16);
                let prompt: Vec<u64> = (0..len as u64).map(|i| prefix * 1000 + i).collect();
                let r = request(prompt, 1 + rng.below(6));
                if e.validate(&r).is_ok() {
                    submitted += 1;
                    e.submit(RequestId(submitted), r).expect("validated");
                }
            }
            if round % 37 == 0 && submitted > 0 {
                let victim = RequestId(1 + rng.below(submitted as usize) as u64);
                if e.requests.contains_key(&victim) {
                    e.abort(victim);
                    aborted += 1;
                }
            }
            if resets && round % 53 == 0 {
                e.reset_prefix_cache();
            }
            if let Some(step) = e.step() {
                view.apply(&step.events);
                finished += step
                    .outputs
                    .iter()
                    .filter(|o| matches!(o.update, Update::Finished(_)))
                    .count() as u64;
            }
            e.check_invariants();
        }
        let (events, out) = drain(&mut e);
        view.apply(&events);
        finished += out
            .iter()
            .filter(|o| matches!(o.update, Update::Finished(_)))
            .count() as u64;
        assert_eq!(finished + aborted, submitted, "seed {seed}");
        assert_eq!(e.stats().used_blocks, 0);
        assert_eq!(view.live.len(), e.stats().cached_blocks, "seed {seed}");
    }
}

#[test]
fn an_adapters_blocks_hash_apart_and_their_events_name_it() {
    for flavor in [WorkerFlavor::Vllm, WorkerFlavor::Sglang] {
        let mut e = Engine::new(config(flavor, 64));
        e.submit(RequestId(1), request(1..=8, 1)).expect("ok");
        let (base, _) = drain(&mut e);
        let lora = NewRequest {
            lora_name: Some("sql".into()),
            ..request(1..=8, 1)
        };
        e.submit(RequestId(2), lora).expect("ok");
        let (adapted, outputs) = drain(&mut e);
        assert_eq!(
            usage_of(&outputs, 2).cached_tokens,
            0,
            "{flavor:?}: no hit across adapters"
        );
        let (base, adapted) = (stored(&base), stored(&adapted));
        assert_eq!(adapted[0].lora_name.as_deref(), Some("sql"));
        assert_eq!(base[0].lora_name, None);
        assert_eq!(base[0].token_ids, adapted[0].token_ids);
        assert_ne!(base[0].block_hashes, adapted[0].block_hashes, "{flavor:?}");
    }
}
