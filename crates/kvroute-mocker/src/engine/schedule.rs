//! The scheduler's half of a step: which requests run and with how many
//! tokens (vLLM v1's rules, in the crate docs of [`super`]), admission with
//! the prefix-cache hit, block growth, preemption, and what computing the
//! step's tokens does to each request and to the cache.
//!
//! When a block enters the prefix cache is the flavours' difference that
//! routing feels most: vLLM caches the full blocks a step will compute while
//! it schedules them (`allocate_slots` → `cache_blocks`; the hashes depend on
//! token ids only), so a request admitted later in the same step, or while
//! the first is still prefilling, finds them; SGLang inserts a chunk into
//! its radix tree after the chunk is computed, and TensorRT-LLM commits a
//! block to its radix tree once computed too, so two requests that start
//! together both compute their common prefix.

use super::*;

impl Engine {
    /// Picks the step's work: `(request, tokens to compute)` and whether anything was preempted.
    pub(super) fn schedule(&mut self) -> (Vec<(RequestId, usize)>, bool) {
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(want) = self
                .requests
                .get(&id)
                .map(|r| (r.tokens.len() - r.num_computed).min(budget))
            else {
                self.running.remove(i);
                continue;
            };
            loop {
                if self.try_grow(id, want) {
                    self.cache_scheduled(id, want);
                    scheduled.push((id, want));
                    budget -= want;
                    i += 1;
                    break;
                }
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                preempted = true;
                if victim == id {
                    break;
                }
            }
        }
        if !preempted {
            while self.running.len() < self.config.max_num_seqs && budget > 0 {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                let Some(n) = self.try_admit(id, budget) else {
                    break;
                };
                self.waiting.pop_front();
                self.running.push(id);
                self.cache_scheduled(id, n);
                scheduled.push((id, n));
                budget -= n;
            }
        }
        (scheduled, preempted)
    }

    /// vLLM: caches the full blocks `n` scheduled tokens of `id` will fill,
    /// before they are computed (see the module docs).
    fn cache_scheduled(&mut self, id: RequestId, n: usize) {
        if self.config.flavor.caches_when_scheduled() {
            self.register(id, n);
        }
    }

    /// Allocates the blocks a running request needs for `n` more tokens; all or nothing.
    fn try_grow(&mut self, id: RequestId, n: usize) -> bool {
        let bs = self.hasher.block_size;
        let Some(r) = self.requests.get_mut(&id) else {
            return false;
        };
        let needed = (r.num_computed + n)
            .div_ceil(bs)
            .saturating_sub(r.blocks.len());
        if needed > self.pool.available() {
            return false;
        }
        for _ in 0..needed {
            if let Some(b) = self.pool.allocate(&mut self.evicted) {
                r.blocks.push(b);
            }
        }
        self.flush_evictions();
        true
    }

    /// Admits a waiting request with its prefix hit if its first chunk fits;
    /// returns the tokens it computes this step.
    fn try_admit(&mut self, id: RequestId, budget: usize) -> Option<usize> {
        let bs = self.hasher.block_size;
        let r = self.requests.get_mut(&id)?;
        let max_hit_blocks = (r.tokens.len() - 1) / bs;
        r.ensure_digests(&self.hasher, max_hit_blocks);
        let hits: Vec<BlockId> = r.digests[..max_hit_blocks]
            .iter()
            .map_while(|d| self.pool.lookup(d))
            .collect();
        let local = hits.len() * bs;
        // A decode leg's prompt arrives computed from the prefill engine
        // (never its last token, which both engines compute themselves).
        let computed = local.max(r.handoff.received_tokens.min(r.prompt_len - 1));
        let n = (r.tokens.len() - computed).min(budget);
        let needed = (computed + n).div_ceil(bs) - hits.len();
        let pinned_by_hit = hits.iter().filter(|&&b| self.pool.is_evictable(b)).count();
        if needed > self.pool.available() - pinned_by_hit {
            return None;
        }
        for &b in &hits {
            self.pool.acquire(b);
        }
        r.blocks = hits;
        for _ in 0..needed {
            if let Some(b) = self.pool.allocate(&mut self.evicted) {
                r.blocks.push(b);
            }
        }
        r.num_computed = computed;
        r.num_registered = local / bs;
        // Received once: after a preemption the blocks are found cached, or recomputed.
        let received = std::mem::take(&mut r.handoff.received_tokens) > 0;
        if r.cached_tokens.is_none() {
            r.cached_tokens = Some(computed);
            self.stats.prompt_tokens_total += r.prompt_len as u64;
            self.stats.prefix_cache_queries_total += r.prompt_len as u64;
            self.stats.prefix_cache_hits_total += local as u64;
            self.stats.kv_received_tokens_total += (computed - local) as u64;
        }
        self.flush_evictions();
        if received {
            // The transferred blocks enter the cache as they land: BlockStored now.
            self.register(id, 0);
        }
        Some(n)
    }

    /// Releases a running request's blocks and queues it to be recomputed.
    fn preempt(&mut self, id: RequestId) {
        if let Some(r) = self.requests.get_mut(&id) {
            for &b in r.blocks.iter().rev() {
                self.pool.release(b);
            }
            r.blocks.clear();
            r.num_computed = 0;
            r.num_registered = 0;
            self.waiting.push_front(id);
            self.stats.preemptions_total += 1;
        }
    }

    /// Advances every scheduled request; returns (prefill tokens, decodes,
    /// KV tokens held by running requests at the end of the step).
    pub(super) fn execute(&mut self, scheduled: &[(RequestId, usize)]) -> (usize, usize, usize) {
        let mut prefill_tokens = 0;
        let mut decodes = 0;
        let mut finished = Vec::new();
        for &(id, n) in scheduled {
            let Some(r) = self.requests.get_mut(&id) else {
                continue;
            };
            let decode = r.is_decode();
            if decode {
                decodes += 1;
            } else {
                prefill_tokens += n;
            }
            r.num_computed += n;
            if r.num_computed == r.tokens.len() && r.generated < r.output.len() {
                let index = r.generated;
                r.tokens.push(r.output[index]);
                r.generated += 1;
                self.stats.generation_tokens_total += 1;
                self.outputs.push(RequestOutput {
                    id,
                    update: Update::Token(index),
                });
            }
            let done = r.generated == r.output.len();
            if !self.config.flavor.caches_when_scheduled() && !decode {
                self.register(id, 0);
            }
            if done {
                finished.push(id);
            }
        }
        let active_kv = self
            .running
            .iter()
            .filter_map(|id| self.requests.get(id))
            .map(|r| r.num_computed)
            .sum();
        for id in finished {
            self.finish(id);
        }
        (prefill_tokens, decodes, active_kv)
    }

    fn finish(&mut self, id: RequestId) {
        self.running.retain(|&r| r != id);
        if !self.config.flavor.caches_when_scheduled() {
            self.register(id, 0);
        }
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        if r.handoff.hold {
            self.stats.held_blocks += r.blocks.len();
            self.held.insert(id, r.blocks);
        } else {
            for &b in r.blocks.iter().rev() {
                self.pool.release(b);
            }
        }
        self.stats.requests_finished_total += 1;
        self.outputs.push(RequestOutput {
            id,
            update: Update::Finished(Usage {
                prompt_tokens: r.prompt_len,
                completion_tokens: r.generated,
                cached_tokens: r.cached_tokens.unwrap_or(0),
            }),
        });
    }

    /// Caches the request's full blocks, computed or among the next `ahead`
    /// tokens to compute, that are not cached yet, and queues their `BlockStored`.
    fn register(&mut self, id: RequestId, ahead: usize) {
        let bs = self.hasher.block_size;
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        let full = (r.num_computed + ahead) / bs;
        if full <= r.num_registered {
            return;
        }
        r.ensure_digests(&self.hasher, full);
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut run_start: Option<usize> = None;
        for b in r.num_registered..full {
            let digest = r.digests[b];
            let key = CachedKey {
                digest,
                published: self.hasher.published(&digest),
            };
            match self.pool.register(r.blocks[b], key) {
                Ok(()) => {
                    run_start.get_or_insert(b);
                }
                Err(existing) => {
                    if let Some(start) = run_start.take() {
                        runs.push((start, b));
                    }
                    self.pool.acquire(existing);
                    self.pool.release(r.blocks[b]);
                    r.blocks[b] = existing;
                }
            }
        }
        if let Some(start) = run_start {
            runs.push((start, full));
        }
        r.num_registered = full;
        let stored: Vec<BlockStored> = runs
            .into_iter()
            .map(|(start, end)| stored_event(&self.hasher, r, start, end))
            .collect();
        for e in stored {
            self.push_event(KvCacheEvent::BlockStored(e));
        }
    }
}
