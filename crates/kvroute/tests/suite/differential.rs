//! `kvroute serve` and the simulator place the same requests alike, request
//! by request, on an aggregated fleet and on a prefill/decode fleet, under
//! every policy: the two run one placement (`kvroute_core::scheduler::Placer`),
//! and this checks that nothing around it (hashing, the index, scoring,
//! the load each decision sees, the turn and the random draws) differs.
//!
//! Determinism by construction, not by timing: the engines are played by
//! the test ([`HeldFleet`]: each tells which request reached it and holds
//! its answer until released; [`Publisher`]: its KV events), so every
//! decision sees exactly the requests the script holds in flight and the
//! events it published, each waited for (`last_seq` in `/workers`) before
//! the next request; `serve --routing-seed` gives the router the
//! simulation's seed. The same script then drives a `SimRouter` in this
//! process with the same events and releases. Events follow placements (a
//! request's blocks are stored where it ran), so the two sides' events
//! stay equal exactly as long as their placements do.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{local_block_hashes, sequence_hashes, HASH_SEED};
use kvroute_core::rng::SplitMix64;
use kvroute_core::scheduler::{Policy, WorkerRole};
use kvroute_loadgen::contender::Disagg;
use kvroute_sim::routing::placer_seed;
use kvroute_sim::{Contender, Placement, Routing, SimRouter};

use crate::support::held::{HeldFleet, Leg};
use crate::support::publisher::{batch, removed, stored, Publisher};
use crate::support::{eventually, http, start_serve_with_env};

const BLOCK: usize = 4;
const SEED: u64 = 7;
const REQUESTS: usize = 36;

/// Where a request went: the engine it ran on (its decode leg's), and its
/// prefill leg's engine when it was split.
type Placed = (usize, Option<usize>);

/// Where a request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Whole on this engine (aggregated, or prefilled on its decode engine).
    Whole(usize),
    /// Its prefill leg on this engine; its decode engine is known when the
    /// leg ends.
    Split(usize),
}

/// One side of the comparison: a router the script drives.
trait Side {
    /// Engine `engine` publishes `payload` (one event batch); returns once
    /// the router applied it.
    fn publish(&mut self, engine: usize, payload: Vec<u8>);
    /// Request `id` of `tokens` arrives and is placed; returns once its
    /// first leg is under way at its engine.
    fn place(&mut self, id: usize, tokens: &[u32]) -> Start;
    /// Request `id`'s prefill leg ends; returns its decode engine once the
    /// decode leg is under way there.
    fn prefilled(&mut self, id: usize) -> usize;
    /// Request `id`'s first token reaches the router: its prefill is over.
    fn first_token(&mut self, id: usize);
    /// Request `id`'s answer ends.
    fn release(&mut self, id: usize);
}

/// Where a request of the script is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Its prefill leg runs on a prefill engine.
    PrefillLeg,
    /// It is prefilling where it decodes.
    Prefill,
    /// Past its first token.
    Decode,
}

/// A request of the script, held at its engine.
struct Held {
    id: usize,
    tokens: Vec<u32>,
    /// The engine it runs on (its decode leg's), once known.
    ran: Option<usize>,
    phase: Phase,
}

/// The script: requests of one hot prefix and four others, up to eight held
/// at once, some still in prefill (whose uncached tokens load their rank,
/// a prefill engine's too); a request's blocks are stored on each engine
/// that computed them as its prefill ends there, and now and then an
/// engine's oldest blocks are evicted. Returns where each request ran (its
/// decode engine) and where it was prefilled, if split.
fn script(side: &mut dyn Side, engines: usize) -> Vec<Placed> {
    let mut rng = SplitMix64::new(SEED);
    let mut held: Vec<Held> = Vec::new();
    let mut placed: Vec<Placed> = Vec::new();
    let mut events = Events::new(engines);
    for id in 0..REQUESTS {
        let group = if rng.below(2) == 0 {
            0
        } else {
            1 + rng.below(4) as u32
        };
        let prefix = 12 + 2 * group as usize;
        let mut tokens: Vec<u32> = (0..prefix * BLOCK)
            .map(|t| group * 1_000 + t as u32)
            .collect();
        let suffix = 1 + rng.below(6) * BLOCK + rng.below(BLOCK);
        tokens.extend((0..suffix).map(|t| 100_000 + (id * 100 + t) as u32));
        let (ran, phase) = match side.place(id, &tokens) {
            Start::Whole(engine) => {
                placed.push((engine, None));
                (Some(engine), Phase::Prefill)
            }
            Start::Split(prefill) => {
                placed.push((usize::MAX, Some(prefill)));
                (None, Phase::PrefillLeg)
            }
        };
        held.push(Held {
            id,
            tokens,
            ran,
            phase,
        });
        for h in &mut held {
            if h.phase != Phase::Decode
                && rng.below(if h.phase == Phase::PrefillLeg { 8 } else { 3 }) == 0
            {
                advance(side, h, (&mut events, &mut placed));
            }
        }
        while !held.is_empty() && (held.len() > 7 || rng.below(4) == 0) {
            let Some(i) = held.iter().position(|h| h.phase == Phase::Decode) else {
                advance(side, &mut held[0], (&mut events, &mut placed));
                continue;
            };
            let h = held.remove(i);
            side.release(h.id);
            let ran = h.ran.expect("decoding");
            if h.id % 7 == 6 {
                if let Some(payload) = events.evict_oldest(ran, 2) {
                    side.publish(ran, payload);
                }
            }
        }
    }
    for mut h in held {
        while h.phase != Phase::Decode {
            advance(side, &mut h, (&mut events, &mut placed));
        }
        side.release(h.id);
    }
    placed
}

/// Request `h`'s next phase: its prefill leg ends (its blocks stored on its
/// prefill engine, its decode leg sent), or its first token comes (its
/// blocks stored where it runs).
fn advance(side: &mut dyn Side, h: &mut Held, (events, placed): (&mut Events, &mut Vec<Placed>)) {
    let (engine, phase) = match h.phase {
        Phase::PrefillLeg => {
            let prefill = placed[h.id].1.expect("split");
            let decode = side.prefilled(h.id);
            placed[h.id].0 = decode;
            h.ran = Some(decode);
            (prefill, Phase::Prefill)
        }
        Phase::Prefill | Phase::Decode => {
            side.first_token(h.id);
            (h.ran.expect("placed"), Phase::Decode)
        }
    };
    h.phase = phase;
    if let Some(payload) = events.store(engine, &h.tokens) {
        side.publish(engine, payload);
    }
}

/// What each engine holds, and the event batches that say so.
struct Events {
    /// Per engine: its block hashes in the order stored.
    held: Vec<Vec<u64>>,
}

impl Events {
    fn new(engines: usize) -> Self {
        Events {
            held: vec![Vec::new(); engines],
        }
    }

    /// The batch storing the full blocks of `tokens` that `engine` lacks.
    fn store(&mut self, engine: usize, tokens: &[u32]) -> Option<Vec<u8>> {
        let full = tokens.len() / BLOCK * BLOCK;
        let seqs = sequence_hashes(&local_block_hashes(&tokens[..full], BLOCK, HASH_SEED, 0));
        let names: Vec<u64> = seqs.iter().map(|s| s.0 ^ (engine as u64 + 1)).collect();
        let held = &mut self.held[engine];
        let new = names.iter().position(|h| !held.contains(h))?;
        for name in &names[new..] {
            if !held.contains(name) {
                held.push(*name);
            }
        }
        let mut e = Vec::new();
        let parent = new.checked_sub(1).map(|p| names[p]);
        stored(
            &mut e,
            &names[new..],
            parent,
            &tokens[new * BLOCK..full],
            BLOCK,
        );
        Some(batch(&[e], 0))
    }

    /// The batch removing `engine`'s `n` oldest blocks.
    fn evict_oldest(&mut self, engine: usize, n: usize) -> Option<Vec<u8>> {
        let held = &mut self.held[engine];
        let gone: Vec<u64> = held.drain(..n.min(held.len())).collect();
        if gone.is_empty() {
            return None;
        }
        let mut e = Vec::new();
        removed(&mut e, &gone);
        Some(batch(&[e], 0))
    }
}

/// The simulator's router, driven by the script.
struct Sim {
    router: SimRouter,
    splits: bool,
    now_ms: u64,
    /// Each request's decode (or whole) placement and its prefill leg's.
    placements: Vec<(Option<Placement>, Option<Placement>)>,
}

impl Side for Sim {
    fn publish(&mut self, engine: usize, payload: Vec<u8>) {
        assert_eq!(
            self.router.ingest(engine, &payload),
            0,
            "every event applies"
        );
    }

    fn place(&mut self, id: usize, tokens: &[u32]) -> Start {
        self.now_ms += 1;
        let (decode, prefill) = if self.splits {
            let split = self
                .router
                .route_split(tokens, self.now_ms)
                .expect("placed");
            (split.decode, split.prefill)
        } else {
            (self.router.route(tokens, self.now_ms, &[]), None)
        };
        self.placements.resize(id + 1, (None, None));
        self.placements[id] = (Some(decode), prefill);
        match prefill {
            Some(p) => Start::Split(p.engine),
            None => Start::Whole(decode.engine),
        }
    }

    fn prefilled(&mut self, id: usize) -> usize {
        self.now_ms += 1;
        let (decode, prefill) = &mut self.placements[id];
        let prefill = prefill.take().expect("split");
        self.router.finished(prefill, self.now_ms * 1_000, 1);
        decode.expect("placed").engine
    }

    fn first_token(&mut self, id: usize) {
        self.now_ms += 1;
        let at = self.placements[id].0.expect("held");
        self.router.first_token(at, self.now_ms * 1_000);
    }

    fn release(&mut self, id: usize) {
        self.now_ms += 1;
        let at = self.placements[id].0.take().expect("held");
        self.router.finished(at, self.now_ms * 1_000, 1);
    }
}

/// `kvroute serve` over the test's engines, driven by the script.
struct Serve {
    addr: String,
    fleet: HeldFleet,
    publishers: Vec<Publisher>,
    seqs: Vec<u64>,
    clients: Vec<Option<(JoinHandle<String>, mpsc::Receiver<()>)>>,
    _serve: crate::support::Proc,
}

impl Serve {
    fn start(roles: &[&str], flags: &[&str], ctx: &zmq::Context) -> Serve {
        let fleet = HeldFleet::start(roles.len());
        let publishers: Vec<Publisher> = roles
            .iter()
            .map(|_| Publisher::start(ctx, 4, 1 << 16))
            .collect();
        let lines: Vec<String> = roles
            .iter()
            .enumerate()
            .map(|(i, role)| {
                let p = &publishers[i];
                format!(
                    "name=e{i},url=http://{},events={},replay={},dp=1,block_size={BLOCK},role={role}",
                    fleet.addrs[i], p.events, p.replay
                )
            })
            .collect();
        let seed = placer_seed(SEED).to_string();
        // The seed as a variable, which an older build ignores rather than refusing.
        let (serve, addr) = start_serve_with_env(&lines, flags, &[("KVROUTE_ROUTING_SEED", &seed)]);
        eventually("every rank replayed and live", || {
            let doc = http::request(&addr, "GET", "/workers", "").json();
            doc["workers"].as_array().is_some_and(|ws| {
                ws.iter()
                    .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
                    .all(|r| {
                        r["replays_ok"].as_u64().unwrap_or(0)
                            + r["replays_incomplete"].as_u64().unwrap_or(0)
                            >= 1
                    })
            })
        });
        Serve {
            addr,
            fleet,
            publishers,
            seqs: vec![0; roles.len()],
            clients: Vec::new(),
            _serve: serve,
        }
    }

    /// The next leg of request `id` to reach an engine; a panic with the
    /// router's answer if none does (its `client` ended first).
    fn arrival(&self, id: usize, client: &JoinHandle<String>) -> (usize, Leg) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(arrival) = self.fleet.next_arrival(Duration::from_millis(50)) {
                assert_eq!(arrival.id, format!("r{id}"), "requests arrive in turn");
                return (arrival.engine, arrival.leg);
            }
            assert!(
                !client.is_finished() && Instant::now() < deadline,
                "request r{id} reached no engine in time (see the router's answer)"
            );
        }
    }

    /// Engine `engine`'s rank's last applied sequence number.
    fn last_seq(&self, engine: usize) -> Option<u64> {
        let doc = http::request(&self.addr, "GET", "/workers", "").json();
        let workers = doc["workers"].as_array().cloned().unwrap_or_default();
        let name = format!("e{engine}");
        let worker = workers.iter().find(|w| w["name"] == name.as_str())?;
        worker["ranks"][0]["last_seq"].as_u64()
    }
}

impl Side for Serve {
    fn publish(&mut self, engine: usize, payload: Vec<u8>) {
        let seq = self.seqs[engine];
        self.seqs[engine] += 1;
        self.publishers[engine].publish(seq, &payload, true, 1 << 16);
        eventually("the batch applied", || self.last_seq(engine) == Some(seq));
    }

    fn place(&mut self, id: usize, tokens: &[u32]) -> Start {
        let body = serde_json::json!({
            "prompt": tokens, "max_tokens": 1, "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let (addr, name) = (self.addr.clone(), format!("r{id}"));
        let (tell, told) = mpsc::channel();
        let client = std::thread::spawn(move || {
            let headers = [
                ("content-type", "application/json"),
                ("x-request-id", name.as_str()),
            ];
            let mut s = http::send_with(&addr, "POST", "/v1/completions", &headers, &body);
            let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
            let mut marks = [&b"\r\n\r\n"[..], &b"\"text\":\"x\""[..]]
                .into_iter()
                .peekable();
            while let Ok(n) = std::io::Read::read(&mut s, &mut buf) {
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
                while marks
                    .next_if(|m| seen.windows(m.len()).any(|w| w == *m))
                    .is_some()
                {
                    let _ = tell.send(());
                }
            }
            String::from_utf8_lossy(&seen).into_owned()
        });
        let start = match self.arrival(id, &client) {
            (engine, Leg::Held) => Start::Whole(engine),
            (engine, Leg::Prefill) => Start::Split(engine),
        };
        self.clients.resize_with(id + 1, || None);
        if let Start::Whole(_) = start {
            told.recv_timeout(Duration::from_secs(30))
                .expect("the answer's head reaches the client");
        }
        self.clients[id] = Some((client, told));
        start
    }

    fn prefilled(&mut self, id: usize) -> usize {
        self.fleet.release(&format!("r{id}/prefill"));
        let (client, told) = self.clients[id].as_ref().expect("held");
        let (engine, leg) = self.arrival(id, client);
        assert_eq!(leg, Leg::Held, "the decode leg follows");
        told.recv_timeout(Duration::from_secs(30))
            .expect("the answer's head reaches the client");
        engine
    }

    fn first_token(&mut self, id: usize) {
        self.fleet.first_token(&format!("r{id}"));
        let (_, told) = self.clients[id].as_ref().expect("held");
        told.recv_timeout(Duration::from_secs(30))
            .expect("the first token reaches the client");
    }

    fn release(&mut self, id: usize) {
        self.fleet.release(&format!("r{id}"));
        let (client, _) = self.clients[id].take().expect("held");
        let answer = client.join().expect("client");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}

/// The script's placements by the simulator on a fleet of `roles`.
fn simulate(roles: &[&str], routing: Routing) -> Vec<Placed> {
    let parsed: Vec<WorkerRole> = roles.iter().map(|r| r.parse().expect("a role")).collect();
    let router = SimRouter::new(
        Contender::Router(routing),
        roles.len(),
        (BLOCK as u32, WorkerFlavor::Vllm),
        &[],
        None,
        SEED,
    )
    .with_roles(&parsed);
    let mut sim = Sim {
        router,
        splits: parsed.contains(&WorkerRole::Prefill),
        now_ms: 0,
        placements: Vec::new(),
    };
    script(&mut sim, roles.len())
}

/// The aggregated fleet.
const AGGREGATED: [&str; 4] = ["both"; 4];

/// The prefill/decode fleet.
const PD: [&str; 4] = ["prefill", "prefill", "decode", "decode"];

/// Runs the script through `serve` and through the simulator on a fleet of
/// `roles` under `routing` (its policy, and under `kv` and `approx` whether
/// a decode rank may prefill); their placements must be equal.
fn same_placements(roles: &[&str], routing: Routing) {
    let policy = routing.policy;
    let mut flags = vec!["--policy", policy.as_str()];
    if routing.disagg == Disagg::AlwaysSplit {
        flags.extend(["--local-prefill-max-tokens", "0"]);
    }
    let ctx = zmq::Context::new();
    let mut serve = Serve::start(roles, &flags, &ctx);
    let served = script(&mut serve, roles.len());
    let simulated = simulate(roles, routing);
    let first_difference = served.iter().zip(&simulated).position(|(a, b)| a != b);
    assert_eq!(
        first_difference, None,
        "{policy} on {roles:?}: serve placed {served:?}, the simulator {simulated:?}"
    );
    let engines: std::collections::BTreeSet<usize> = served.iter().map(|p| p.0).collect();
    assert!(
        engines.len() > 1,
        "{policy}: the script spreads requests: {served:?}"
    );
    if roles.contains(&"prefill") {
        let split = served.iter().filter(|p| p.1.is_some()).count();
        assert!(split > 0, "{policy}: some requests split: {served:?}");
    }
}

/// The script puts `kv`'s rules to work, so that a path that skipped one
/// would place differently: without the stickiness (on either fleet: on
/// the prefill/decode one, where it keeps a prefix on its prefill
/// engine), or without dealing new prefixes, the simulator places it
/// otherwise.
#[test]
fn the_script_makes_every_kv_rule_count() {
    let kv = Routing::new(Policy::Kv);
    let split = Routing {
        disagg: Disagg::AlwaysSplit,
        ..kv
    };
    for (roles, routing) in [(&AGGREGATED, kv), (&PD, split)] {
        let unstuck = Routing {
            stickiness: 0.0,
            ..routing
        };
        let placed = simulate(roles, routing);
        assert_ne!(
            placed,
            simulate(roles, unstuck),
            "{roles:?}: the stickiness counts"
        );
    }
    let undealt = Routing {
        deal_new_prefixes: None,
        ..kv
    };
    let placed = simulate(&AGGREGATED, kv);
    assert_ne!(placed, simulate(&AGGREGATED, undealt), "dealing counts");
}

const POLICIES: [Policy; 7] = [
    Policy::Kv,
    Policy::Approx,
    Policy::RoundRobin,
    Policy::Random,
    Policy::LeastLoaded,
    Policy::SglangCacheAware,
    Policy::Dynamo,
];

#[test]
fn serve_and_the_simulator_place_alike_on_an_aggregated_fleet() {
    for policy in POLICIES {
        same_placements(&AGGREGATED, Routing::new(policy));
    }
}

/// Every request split (so that the prefill engines' placement is at work
/// on each), and `kv`'s conditional split beside it.
#[test]
fn serve_and_the_simulator_place_alike_on_a_prefill_decode_fleet() {
    for policy in POLICIES {
        let split = Routing {
            disagg: Disagg::AlwaysSplit,
            ..Routing::new(policy)
        };
        same_placements(&PD, split);
    }
    same_placements(&PD, Routing::new(Policy::Kv));
}
