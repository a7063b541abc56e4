//! The event loop of a simulation: a queue of timed events, each handled
//! at its time, the clock jumping from one to the next.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::config::EventFormat;
use kvroute_mocker::encode::{encode_batch, EncodeOptions};
use kvroute_mocker::engine::{Engine, Handoff, NewRequest, RequestId, StepOutcome, Update};

mod fetch;
mod legs;

use super::routing::{Pins, Placement, SimRouter};
use super::{SimConfig, SimLoad, SimReport};
use crate::driver::{summarize, Arrival, Sample};
use crate::error::{Error, Result};
use crate::stats::PoissonArrivals;
use crate::workload::{PlannedRequest, Workload, WorkloadKind};

/// Something that happens at a time.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A client sends its next request (closed loop), or a request arrives (open loop).
    Send,
    /// Request `n` reaches the router.
    Route(usize),
    /// Request `n` reaches its engine (whole: aggregated, or prefilled on
    /// its decode engine).
    Submit(usize),
    /// Request `n`'s prefill leg reaches its prefill engine.
    SubmitPrefill(usize),
    /// Request `n`'s prefill answer reaches the router, with the prefill
    /// engine's cached tokens.
    Prefilled(usize, u64),
    /// Request `n`'s decode leg reaches its decode engine, which starts
    /// reading the prompt's KV.
    DecodeLeg(usize),
    /// The decode engine's read of request `n`'s KV reaches the prefill
    /// engine, which releases the held blocks.
    Release(usize),
    /// Request `n`'s decode leg enters its decode engine, the KV read.
    SubmitDecode(usize),
    /// The copy of request `n`'s prefix made ahead of demand reaches its
    /// target, the blocks transferred.
    ReplicaArrives(usize),
    /// Engine `e`'s step ends.
    StepEnd(usize),
    /// A published batch of engine `e` reaches the index.
    Ingest(usize, Vec<u8>),
    /// Request `n`'s first token reaches the router.
    FirstToken(usize),
    /// Request `n`'s end reaches the router, with the engine's cached tokens.
    Finished(usize, u64),
    /// Request `n` failed at its engine.
    Failed(usize),
    /// Request `n`'s end reaches its client.
    ClientDone(usize),
}

/// A request on its way.
#[derive(Debug)]
struct Request {
    planned: PlannedRequest,
    prompt_tokens: u64,
    tokens: Vec<u32>,
    max_tokens: usize,
    sent_us: u64,
    /// Where it runs whole, or where its decode leg runs.
    placement: Option<Placement>,
    /// Where its prefill leg runs (a split request).
    prefill: Option<Placement>,
    /// The cached tokens its prefill engine reported (a split request).
    prefill_cached: Option<u64>,
    first_token_us: Option<u64>,
    /// Prompt tokens it receives from another engine before it runs (a
    /// fetch; 0: none).
    received_tokens: usize,
    /// Its fetch runs as two legs ([`SimConfig::fetch_legs`]).
    fetch_legs: bool,
}

/// The state of a simulation.
pub(super) struct Sim<'a> {
    config: &'a SimConfig,
    load: &'a SimLoad,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    engines: Vec<Engine>,
    stepping: Vec<Option<StepOutcome>>,
    router: SimRouter,
    workload: Workload,
    requests: Vec<Request>,
    samples: Vec<Sample>,
    per_engine: Vec<u64>,
    /// Clients with nothing to send until a conversation is free.
    waiting: usize,
    arrivals: Option<PoissonArrivals>,
    failed: u64,
    steps: u64,
    skipped: u64,
    predicted_exactly: u64,
    compared: u64,
    /// Requests are split into prefill and decode legs.
    splits: bool,
    /// Prompt tokens of finished requests found cached where they were
    /// prefilled, and their prompt tokens.
    prefill_hits: (u64, u64),
    transferred_blocks: u64,
    /// Requests that fetched their prefix, and the blocks they fetched.
    fetches: u64,
    fetched_blocks: u64,
    /// Fetches whose source no longer held more than the receiver.
    fetch_misses: u64,
    /// Copies made ahead of demand in flight: request → (target, prompt,
    /// tokens the target lacked).
    copies: std::collections::HashMap<usize, (usize, Vec<u64>, usize)>,
    /// Copies made, their blocks, and the tokens their targets received.
    replicas: (u64, u64, u64),
    /// Prompt tokens fetches by legs found cached on their sources.
    leg_fetched: u64,
}

const US_PER_MS: u64 = 1_000;

impl<'a> Sim<'a> {
    /// A fleet of idle engines with empty caches, and the clients' first sends.
    pub(super) fn new(config: &'a SimConfig, load: &'a SimLoad) -> Self {
        let block_size = u32::try_from(config.engine.block_size).unwrap_or(u32::MAX);
        let mut sim = Sim {
            config,
            load,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            engines: (0..config.engines)
                .map(|i| {
                    let mut engine = config.engine.clone();
                    engine.timing.speedup *= config.engine_speeds.get(i).copied().unwrap_or(1.0);
                    Engine::new(engine)
                })
                .collect(),
            stepping: vec![None; config.engines],
            router: router(config, block_size),
            workload: Workload::new(&load.workload),
            requests: Vec::new(),
            samples: Vec::new(),
            per_engine: vec![0; config.engines],
            waiting: 0,
            arrivals: None,
            failed: 0,
            steps: 0,
            skipped: 0,
            predicted_exactly: 0,
            compared: 0,
            splits: config.splits(),
            prefill_hits: (0, 0),
            transferred_blocks: 0,
            fetches: 0,
            fetched_blocks: 0,
            fetch_misses: 0,
            copies: std::collections::HashMap::new(),
            replicas: (0, 0, 0),
            leg_fetched: 0,
        };
        match load.arrival {
            Arrival::Closed { concurrency } => {
                for _ in 0..concurrency {
                    sim.at(0, Event::Send);
                }
            }
            Arrival::Poisson { rate } => {
                let mut arrivals = PoissonArrivals::new(rate, load.workload.seed ^ 0xA55E_55ED);
                sim.at(seconds_to_us(arrivals.next_arrival()), Event::Send);
                sim.arrivals = Some(arrivals);
            }
            Arrival::Trace => {
                if let Some(trace) = &load.workload.trace {
                    let times: Vec<u64> = trace
                        .requests
                        .iter()
                        .take(sim.limit())
                        .map(|r| r.timestamp * US_PER_MS)
                        .collect();
                    for t in times {
                        sim.at(t, Event::Send);
                    }
                }
            }
        }
        sim
    }

    fn limit(&self) -> usize {
        match &self.load.workload.trace {
            Some(t) if self.load.workload.kind == WorkloadKind::Trace => {
                if self.load.requests == 0 {
                    t.requests.len()
                } else {
                    self.load.requests.min(t.requests.len())
                }
            }
            _ => self.load.requests,
        }
    }

    fn at(&mut self, time: u64, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse((time, self.seq, event)));
    }

    /// Handles every event in time order until none is left.
    pub(super) fn run(mut self) -> Result<SimReport> {
        if self.limit() == 0 {
            return Err(Error::Invalid("a simulation needs a request count".into()));
        }
        while let Some(Reverse((time, _, event))) = self.queue.pop() {
            self.now = time;
            self.handle(event)?;
        }
        let duration = std::time::Duration::from_micros(self.now);
        let per_kind = self.load.workload.kind == WorkloadKind::Images;
        let issued = self.requests.len() as u64;
        let mut report = summarize(&self.samples, issued, self.failed, duration, per_kind);
        report.index_accuracy =
            (self.compared > 0).then(|| self.predicted_exactly as f64 / self.compared as f64);
        let (hits, prompt) = self.prefill_hits;
        report.prefill_hit_rate = self.config.layout.map(|_| {
            if prompt > 0 {
                hits as f64 / prompt as f64
            } else {
                0.0
            }
        });
        let prefilled_tokens = self
            .engines
            .iter()
            .map(|e| {
                let s = e.stats();
                let found = s.prefix_cache_hits_total + s.kv_received_tokens_total;
                s.prefix_cache_queries_total.saturating_sub(found)
            })
            .collect();
        // An aggregated fleet receives KV only by fetches and copies.
        let fetched_tokens = if self.splits {
            0
        } else if self.config.fetch_legs {
            self.leg_fetched
        } else {
            let received: u64 = self
                .engines
                .iter()
                .map(|e| e.stats().kv_received_tokens_total)
                .sum();
            received.saturating_sub(self.replicas.2)
        };
        Ok(SimReport {
            report,
            per_engine: self.per_engine,
            prefilled_tokens,
            transferred_blocks: self.transferred_blocks,
            fetches: self.fetches,
            fetched_blocks: self.fetched_blocks,
            fetch_misses: self.fetch_misses,
            replicas: self.replicas.0,
            replicated_blocks: self.replicas.1,
            fetched_tokens,
            steps: self.steps,
            skipped_events: self.skipped,
        })
    }

    fn handle(&mut self, event: Event) -> Result<()> {
        let d = self.config.delays;
        match event {
            Event::Send => self.send()?,
            Event::Route(n) if self.splits => self.route_split(n),
            Event::Route(n) => {
                let now_ms = self.now / US_PER_MS;
                let placement = self
                    .router
                    .route(&self.requests[n].tokens, now_ms, &self.engines);
                self.per_engine[placement.engine] += 1;
                self.requests[n].placement = Some(placement);
                self.start_copy(n);
                if self.fetch_by_legs(n) {
                    return Ok(());
                }
                let transfer = self.fetch_delay(n);
                self.at(self.now + d.engine_us + transfer, Event::Submit(n));
            }
            Event::Submit(n) => self.submit(n),
            Event::SubmitPrefill(n) => self.submit_prefill(n),
            Event::Prefilled(n, cached) => self.prefilled(n, cached),
            Event::DecodeLeg(n) => self.decode_leg(n),
            Event::Release(n) => self.release(n),
            Event::SubmitDecode(n) => self.submit_decode(n),
            Event::ReplicaArrives(n) => self.copy_arrives(n),
            Event::StepEnd(e) => self.step_end(e),
            Event::Ingest(e, payload) => self.skipped += self.router.ingest(e, &payload),
            Event::FirstToken(n) => {
                if let Some(p) = self.requests[n].placement {
                    self.router.first_token(p, self.now);
                }
            }
            Event::Finished(n, cached) => self.finished(n, cached),
            Event::Failed(n) => {
                let r = &mut self.requests[n];
                // A prefill leg's charge is freed when its answer is read.
                let prefill = r.prefill.filter(|_| r.prefill_cached.is_none());
                for p in [r.placement, prefill].into_iter().flatten() {
                    self.router.finished(p, self.now, 0);
                }
                self.failed += 1;
                self.at(self.now + d.client_us, Event::ClientDone(n));
            }
            Event::ClientDone(n) => {
                self.workload.finished(&self.requests[n].planned);
                if matches!(self.load.arrival, Arrival::Closed { .. }) {
                    self.at(self.now, Event::Send);
                }
                for _ in 0..std::mem::take(&mut self.waiting) {
                    self.at(self.now, Event::Send);
                }
            }
        }
        Ok(())
    }

    /// A client sends the workload's next request, if the run wants more.
    fn send(&mut self) -> Result<()> {
        if self.requests.len() >= self.limit() {
            return Ok(());
        }
        let Some(mut planned) = self.workload.try_next() else {
            self.waiting += 1;
            return Ok(());
        };
        let tokens = prompt_ids(&planned.body)?;
        let max_tokens = planned.body["max_tokens"].as_u64().unwrap_or(1).max(1) as usize;
        // Only the conversation and the label are needed from here on.
        planned.body = serde_json::Value::Null;
        let n = self.requests.len();
        self.requests.push(Request {
            planned,
            prompt_tokens: tokens.len() as u64,
            tokens,
            max_tokens,
            sent_us: self.now,
            placement: None,
            prefill: None,
            prefill_cached: None,
            first_token_us: None,
            received_tokens: 0,
            fetch_legs: false,
        });
        if let Some(arrivals) = &mut self.arrivals {
            let next = seconds_to_us(arrivals.next_arrival());
            self.at(next, Event::Send);
        }
        self.at(self.now + self.config.delays.client_us, Event::Route(n));
        Ok(())
    }

    fn submit(&mut self, n: usize) {
        let Some(p) = self.requests[n].placement else {
            return;
        };
        let r = &mut self.requests[n];
        let request = NewRequest {
            prompt: std::mem::take(&mut r.tokens)
                .into_iter()
                .map(u64::from)
                .collect(),
            output: vec![1; r.max_tokens],
            mm_items: Vec::new(),
            lora_name: None,
        };
        let id = RequestId(n as u64);
        let received = Handoff {
            received_tokens: r.received_tokens,
            hold: false,
        };
        self.enter(p.engine, (n, id), request, received);
    }

    /// Queues a request, or one leg of request `n`, on engine `e`, which
    /// starts stepping if it was idle; a refusal fails the request.
    fn enter(&mut self, e: usize, (n, id): (usize, RequestId), r: NewRequest, handoff: Handoff) {
        if self.engines[e].submit_with(id, r, handoff).is_err() {
            self.at(self.now + self.config.delays.engine_us, Event::Failed(n));
            return;
        }
        if self.stepping[e].is_none() {
            self.start_step(e);
        }
    }

    fn start_step(&mut self, e: usize) {
        if let Some(step) = self.engines[e].step() {
            self.steps += 1;
            let lag = if step.duration.is_zero() {
                0
            } else {
                self.config.delays.step_us
            };
            let end = self.now + step.duration.as_micros() as u64 + lag;
            self.stepping[e] = Some(step);
            self.at(end, Event::StepEnd(e));
        }
    }

    /// A step's events go to the index and its tokens to the router; the
    /// engine starts its next step at once.
    fn step_end(&mut self, e: usize) {
        let Some(step) = self.stepping[e].take() else {
            return;
        };
        let d = self.config.delays;
        if !step.events.is_empty() {
            let options = EncodeOptions {
                flavor: self.config.engine.flavor,
                format: EventFormat::Map,
            };
            let dp_rank = (self.config.engine.flavor == WorkerFlavor::Sglang).then_some(0);
            let payload = encode_batch(options, self.now as f64 / 1e6, &step.events, dp_rank, None);
            self.at(self.now + d.event_us, Event::Ingest(e, payload));
        }
        for out in step.outputs {
            if fetch::is_copy(out.id) {
                continue;
            }
            let (n, prefill_leg) = legs::untag(out.id);
            if prefill_leg {
                self.prefill_output(n, out.update);
                continue;
            }
            match out.update {
                Update::Token(0) => {
                    self.requests[n].first_token_us = Some(self.now);
                    self.at(self.now + d.engine_us, Event::FirstToken(n));
                }
                Update::Token(_) => {}
                Update::Finished(usage) => {
                    let cached = usage.cached_tokens as u64;
                    self.at(self.now + d.engine_us, Event::Finished(n, cached));
                }
                Update::Failed(_) => self.at(self.now + d.engine_us, Event::Failed(n)),
            }
        }
        self.start_step(e);
    }

    /// The router frees the request; its client records it.
    fn finished(&mut self, n: usize, cached: u64) {
        let d = self.config.delays;
        let r = &self.requests[n];
        if let Some(p) = r.placement {
            self.router.finished(p, self.now, r.max_tokens as u64);
            if let Some(predicted) = p.predicted_cached {
                self.compared += 1;
                self.predicted_exactly += u64::from(predicted == cached);
            }
        }
        let seen = self.now + d.client_us;
        let first = r
            .first_token_us
            .map_or(seen, |t| t + d.engine_us + d.client_us);
        let prompt_tokens = r.prompt_tokens;
        // Where the prompt was computed: the prefill engine of a split
        // request (the KV its decode engine received is no hit), else here.
        let found = r.prefill_cached.unwrap_or(cached).min(prompt_tokens);
        self.prefill_hits.0 += found;
        self.prefill_hits.1 += prompt_tokens;
        // A fetch by legs recomputed on its source what the source lacked.
        let cached = if r.fetch_legs {
            self.leg_fetched += found;
            found
        } else {
            cached
        };
        self.samples.push(Sample {
            start_s: r.sent_us as f64 / 1e6,
            ttft_ms: (first - r.sent_us) as f64 / 1e3,
            latency_ms: (seen - r.sent_us) as f64 / 1e3,
            prompt_tokens,
            cached_tokens: cached.min(prompt_tokens),
            output_tokens: r.max_tokens as u64,
            label: r.planned.label,
        });
        self.at(seen, Event::ClientDone(n));
    }
}

/// The simulation's router: its policy, or its fixed placement of groups.
fn router(config: &SimConfig, block_size: u32) -> SimRouter {
    let router = SimRouter::new(
        config.policy,
        config.engines,
        (block_size, config.engine.flavor),
        &config.worker_speeds,
        config.learn_speeds,
        config.seed,
    );
    let router = match &config.pins {
        Some(pins) => router.pinned(Pins::new(pins.clone(), block_size)),
        None => router,
    };
    match config.layout {
        Some(layout) if config.splits() => router.with_roles(&layout.roles()),
        _ => router,
    }
}

fn seconds_to_us(s: f64) -> u64 {
    (s * 1e6) as u64
}

/// The token ids of a completion body's `prompt`.
fn prompt_ids(body: &serde_json::Value) -> Result<Vec<u32>> {
    let ids = body["prompt"].as_array().ok_or_else(|| {
        Error::Invalid(
            "the simulator sends token-id completions; this workload sends other prompts".into(),
        )
    })?;
    ids.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| Error::Invalid(format!("prompt id {v} is not a u32")))
        })
        .collect()
}
