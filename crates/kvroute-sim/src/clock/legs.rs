//! The two legs of a split request on the virtual clock, as `kvroute
//! serve` runs them on vLLM engines and `kvroute mocker` answers them:
//!
//! 1. the prefill leg (the prompt, `max_tokens` 1, not streamed) on the
//!    prefill engine, its blocks held when it finishes;
//! 2. its whole answer back to the router (one hop), which frees the
//!    prefill rank's charge and sends the decode leg (one hop);
//! 3. the decode engine waits the modelled transfer of the blocks it lacks
//!    (`kvroute_mocker::handoff::transfer_delay`, as the mocker's
//!    `receive_vllm`), tells the prefill engine it read them (one hop: the
//!    held blocks are released there) and, on its answer (one hop back),
//!    runs the request with its prompt arrived computed;
//! 4. the decode leg streams to the client like any request.

use kvroute_mocker::engine::{Handoff, NewRequest, RequestId, Update};
use kvroute_mocker::handoff::transfer_delay;

use super::{Event, Sim, US_PER_MS};

/// The bit that marks a prefill leg's id on its engine; request `n`'s
/// decode leg, or the request itself, is `RequestId(n)`.
const PREFILL_LEG: u64 = 1 << 62;

/// The request an engine's id belongs to, and whether it is a prefill leg.
pub(super) fn untag(id: RequestId) -> (usize, bool) {
    ((id.0 & !PREFILL_LEG) as usize, id.0 & PREFILL_LEG != 0)
}

fn prefill_leg(n: usize) -> RequestId {
    RequestId(n as u64 | PREFILL_LEG)
}

impl Sim<'_> {
    /// The router places request `n`'s phases; its prefill leg goes out,
    /// or the whole request to the decode engine that prefills it.
    pub(super) fn route_split(&mut self, n: usize) {
        let now_ms = self.now / US_PER_MS;
        let hop = self.config.delays.engine_us;
        let Some(split) = self.router.route_split(&self.requests[n].tokens, now_ms) else {
            self.at(self.now, Event::Failed(n));
            return;
        };
        self.per_engine[split.decode.engine] += 1;
        let r = &mut self.requests[n];
        r.placement = Some(split.decode);
        r.prefill = split.prefill;
        match split.prefill {
            Some(p) => {
                self.per_engine[p.engine] += 1;
                self.at(self.now + hop, Event::SubmitPrefill(n));
            }
            None => self.at(self.now + hop, Event::Submit(n)),
        }
    }

    fn prompt(&self, n: usize) -> Vec<u64> {
        self.requests[n]
            .tokens
            .iter()
            .map(|&t| u64::from(t))
            .collect()
    }

    /// The prefill leg enters its engine: one output token, and its blocks
    /// held for the decode engine when it finishes.
    pub(super) fn submit_prefill(&mut self, n: usize) {
        let Some(p) = self.requests[n].prefill else {
            return;
        };
        let request = NewRequest {
            prompt: self.prompt(n),
            output: vec![1],
            mm_items: Vec::new(),
            lora_name: None,
        };
        let hold = Handoff {
            received_tokens: 0,
            hold: true,
        };
        self.enter(p.engine, (n, prefill_leg(n)), request, hold);
    }

    /// What a prefill leg's engine put out: the answer is read whole, so
    /// only its end reaches the router.
    pub(super) fn prefill_output(&mut self, n: usize, update: Update) {
        let at = self.now + self.config.delays.engine_us;
        match update {
            Update::Token(_) => {}
            Update::Finished(usage) => self.at(at, Event::Prefilled(n, usage.cached_tokens as u64)),
            Update::Failed(_) => self.at(at, Event::Failed(n)),
        }
    }

    /// The router read the prefill answer: the prefill rank's charge is
    /// freed and the decode leg goes out.
    pub(super) fn prefilled(&mut self, n: usize, cached: u64) {
        let r = &mut self.requests[n];
        r.prefill_cached = Some(cached);
        if let Some(p) = r.prefill {
            self.router.finished(p, self.now, 1);
        }
        self.at(self.now + self.config.delays.engine_us, Event::DecodeLeg(n));
    }

    /// The decode leg reaches its engine, which reads the blocks it lacks
    /// (the fleet's speedup divides the transfer, as the mocker's
    /// `--speedup` does), then tells the prefill engine.
    pub(super) fn decode_leg(&mut self, n: usize) {
        let Some(d) = self.requests[n].placement else {
            return;
        };
        let probe = NewRequest {
            prompt: self.prompt(n),
            output: Vec::new(),
            mm_items: Vec::new(),
            lora_name: None,
        };
        let cached = self.engines[d.engine].cached_prefix_tokens(&probe);
        let bs = self.config.engine.block_size.max(1);
        let blocks = probe.prompt.len().div_ceil(bs).saturating_sub(cached / bs);
        if self.splits {
            self.transferred_blocks += blocks as u64;
        } else {
            // A fetch run as legs on an aggregated fleet.
            self.fetched_blocks += blocks as u64;
        }
        let (per_block, speedup) = (
            self.config.transfer_us_per_block,
            self.config.engine.timing.speedup,
        );
        let transfer = transfer_delay(blocks, per_block, speedup).as_micros() as u64;
        let hop = self.config.delays.engine_us;
        let read = self.now + transfer + hop;
        self.at(read, Event::Release(n));
        self.at(read + hop, Event::SubmitDecode(n));
    }

    /// The prefill engine learns its blocks were read and releases them;
    /// a request waiting for blocks may now run.
    pub(super) fn release(&mut self, n: usize) {
        let Some(p) = self.requests[n].prefill else {
            return;
        };
        self.engines[p.engine].release_held(prefill_leg(n));
        if self.stepping[p.engine].is_none() {
            self.start_step(p.engine);
        }
    }

    /// The decode leg enters its engine with its prompt arrived computed.
    pub(super) fn submit_decode(&mut self, n: usize) {
        let Some(d) = self.requests[n].placement else {
            return;
        };
        let r = &mut self.requests[n];
        let prompt: Vec<u64> = std::mem::take(&mut r.tokens)
            .into_iter()
            .map(u64::from)
            .collect();
        let received = Handoff {
            received_tokens: prompt.len(),
            hold: false,
        };
        let request = NewRequest {
            prompt,
            output: vec![1; r.max_tokens],
            mm_items: Vec::new(),
            lora_name: None,
        };
        self.enter(d.engine, (n, RequestId(n as u64)), request, received);
    }
}
