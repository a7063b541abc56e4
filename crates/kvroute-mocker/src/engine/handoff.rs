//! Prefill/decode disaggregation inside one engine: a prefill leg's blocks
//! held for the decode engine to read, and a decode leg's prompt arriving
//! computed.
//!
//! * Hold (vLLM's `delay_free_blocks`, SGLang's transfer in flight): when the
//!   request finishes, its blocks stay pinned, cached ones still hit by
//!   others, until [`Engine::release_held`] (the decode read them, or the
//!   caller's lease ended). Held blocks cannot be evicted, so a prefill
//!   engine whose decodes never read fills up, as a real one does.
//! * Receive (vLLM's `WAITING_FOR_REMOTE_KVS`, SGLang's prebuilt extend): at
//!   admission the prompt counts as computed up to `received_tokens` (never
//!   its last token), the blocks that were not cached locally are cached at
//!   once and announced with `BlockStored`, and `cached_tokens` reports the
//!   computed prefix, as vLLM reports the transferred tokens.

use super::*;

/// How a request's KV crosses engines; the default is neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Handoff {
    /// Prompt tokens whose KV a prefill engine computed and sent (a decode
    /// leg); capped at the prompt length minus one.
    pub received_tokens: usize,
    /// Keep the blocks pinned when the request finishes, for a decode
    /// engine to read (a prefill leg), until [`Engine::release_held`].
    pub hold: bool,
}

impl Engine {
    /// Queues a request whose KV crosses engines as `handoff` says.
    pub fn submit_with(
        &mut self,
        id: RequestId,
        r: NewRequest,
        handoff: Handoff,
    ) -> Result<(), SubmitError> {
        self.validate(&r)?;
        let mut request = Request::admitted(r);
        request.handoff = handoff;
        self.requests.insert(id, request);
        self.waiting.push_back(id);
        Ok(())
    }

    /// The block ids a finished request holds, in prompt order (vLLM's
    /// `remote_block_ids`).
    pub fn held_blocks(&self, id: RequestId) -> Option<&[u32]> {
        self.held.get(&id).map(Vec::as_slice)
    }

    /// Unpins the blocks `id` holds; returns how many there were, `None` when
    /// it holds none. Cached blocks stay cached (and become evictable).
    pub fn release_held(&mut self, id: RequestId) -> Option<usize> {
        let blocks = self.held.remove(&id)?;
        for &b in blocks.iter().rev() {
            self.pool.release(b);
        }
        self.stats.held_blocks = self.stats.held_blocks.saturating_sub(blocks.len());
        Some(blocks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::tests::{config, request};

    fn engine(flavor: WorkerFlavor, blocks: usize) -> Engine {
        Engine::new(config(flavor, blocks))
    }

    /// Steps until idle, checking invariants; every event and output.
    fn drain(engine: &mut Engine) -> (Vec<KvCacheEvent>, Vec<RequestOutput>, Duration) {
        let (mut events, mut outputs, mut time) = (Vec::new(), Vec::new(), Duration::ZERO);
        for _ in 0..10_000 {
            let Some(step) = engine.step() else {
                return (events, outputs, time);
            };
            engine.check_invariants();
            events.extend(step.events);
            outputs.extend(step.outputs);
            time += step.duration;
        }
        panic!("engine did not go idle");
    }

    fn usage(outputs: &[RequestOutput]) -> Usage {
        outputs
            .iter()
            .find_map(|o| match &o.update {
                Update::Finished(u) => Some(*u),
                _ => None,
            })
            .expect("finished")
    }

    fn stored_hashes(events: &[KvCacheEvent]) -> Vec<u64> {
        events
            .iter()
            .filter_map(|e| match e {
                KvCacheEvent::BlockStored(s) => Some(s.block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn a_received_prompt_is_cached_at_admission_and_reported_as_cached() {
        for flavor in [WorkerFlavor::Vllm, WorkerFlavor::Sglang] {
            // The same prompt computed locally, for the expected hashes.
            let mut local = engine(flavor, 64);
            local.submit(RequestId(1), request(1..=10, 1)).expect("ok");
            let (local_events, _, prefill_time) = drain(&mut local);

            let mut e = engine(flavor, 64);
            let handoff = Handoff {
                received_tokens: 10,
                hold: false,
            };
            e.submit_with(RequestId(1), request(1..=10, 3), handoff)
                .expect("ok");
            let first = e.step().expect("admitted");
            // 9 tokens arrived (the last is computed here): blocks 0 and 1
            // are stored before anything else, as the first event.
            let hashes = stored_hashes(&first.events);
            assert_eq!(hashes, stored_hashes(&local_events)[..2], "{flavor:?}");
            assert_eq!(first.prefill_tokens, 1, "only the last prompt token");
            assert!(first.duration < prefill_time, "{flavor:?}");
            let (_, outputs, _) = drain(&mut e);
            let u = usage(&outputs);
            assert_eq!((u.cached_tokens, u.completion_tokens), (9, 3));
            let stats = e.stats();
            assert_eq!(stats.prefix_cache_hits_total, 0, "no local hit");
            assert_eq!(stats.kv_received_tokens_total, 9, "received, not hit");
            // A repeat hits the received blocks locally.
            e.submit(RequestId(2), request(1..=10, 1)).expect("ok");
            let (_, outputs, _) = drain(&mut e);
            assert_eq!(usage(&outputs).cached_tokens, 8);
        }
    }

    #[test]
    fn received_tokens_beyond_the_prompt_and_local_hits_combine() {
        let mut e = engine(WorkerFlavor::Vllm, 64);
        e.submit(RequestId(1), request(1..=8, 1)).expect("ok");
        drain(&mut e);
        // Blocks 0 and 1 cached locally; 12 of the 13 tokens received.
        let handoff = Handoff {
            received_tokens: usize::MAX,
            hold: false,
        };
        e.submit_with(RequestId(2), request(1..=13, 1), handoff)
            .expect("ok");
        let (events, outputs, _) = drain(&mut e);
        assert_eq!(usage(&outputs).cached_tokens, 12);
        assert_eq!(stored_hashes(&events).len(), 1, "only block 2 is new");
        assert_eq!(e.stats().prefix_cache_hits_total, 8, "local hits only");
        assert_eq!(
            e.stats().kv_received_tokens_total,
            4,
            "12 computed elsewhere, 8 of them here"
        );
    }

    #[test]
    fn held_blocks_stay_pinned_until_released() {
        let mut e = engine(WorkerFlavor::Vllm, 4);
        let hold = Handoff {
            received_tokens: 0,
            hold: true,
        };
        // 9 prompt tokens + 1 generated: 3 blocks, kept after the finish.
        e.submit_with(RequestId(1), request(1..=9, 1), hold)
            .expect("ok");
        drain(&mut e);
        let held = e.held_blocks(RequestId(1)).expect("held").to_vec();
        assert_eq!(held.len(), 3);
        assert_eq!(e.stats().held_blocks, 3);
        assert_eq!(e.stats().used_blocks, 3);
        // Another request hits the held (cached) blocks while they are held.
        e.submit(RequestId(2), request(1..=9, 1)).expect("ok");
        let (_, outputs, _) = drain(&mut e);
        assert_eq!(usage(&outputs).cached_tokens, 8);
        // Only one block is left for anyone else: a 2-block request waits...
        e.submit(RequestId(3), request(100..=105, 1)).expect("ok");
        assert!(
            e.step().is_none(),
            "it cannot be admitted, and is not failed"
        );
        assert!(e.step().is_none());
        assert!(!e.is_idle());
        // ...until the hold is released.
        assert_eq!(e.release_held(RequestId(1)), Some(3));
        assert_eq!(e.release_held(RequestId(1)), None);
        let (_, outputs, _) = drain(&mut e);
        assert_eq!(usage(&outputs).prompt_tokens, 6);
        assert_eq!(e.stats().held_blocks, 0);
        assert!(e.held_blocks(RequestId(1)).is_none());
    }

    #[test]
    fn a_restart_drops_every_hold() {
        let mut e = engine(WorkerFlavor::Sglang, 8);
        let hold = Handoff {
            received_tokens: 0,
            hold: true,
        };
        e.submit_with(RequestId(1), request(1..=9, 1), hold)
            .expect("ok");
        drain(&mut e);
        assert!(e.held_blocks(RequestId(1)).is_some());
        e.restart();
        e.check_invariants();
        assert!(e.held_blocks(RequestId(1)).is_none());
        assert_eq!(e.stats().held_blocks, 0);
        assert_eq!(e.stats().used_blocks, 0);
    }
}
