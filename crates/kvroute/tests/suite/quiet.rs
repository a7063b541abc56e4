//! The index's blind spots, with real mock engines and a real router: a
//! burst whose *last* batch is lost shows no gap until the engine's next
//! batch, so the router checks a stream once soon after it goes quiet
//! (the early check); and a replay answer that never gets its end marker
//! is over when it times out, so the rank's next replays are not stalled.

use std::time::{Duration, Instant};

use kvroute_core::rng::SplitMix64;

use crate::support::engine::{counter, prompt, rank, send_to_engine};
use crate::support::http::metric;
use crate::support::{eventually, spawn_this_builds_mocker, start_serve_with_env, Proc};

/// `engines` mock engines on ephemeral ports with `flags`, run by this
/// build's binary whatever `KVROUTE_TEST_BIN` says: the router is under
/// test, and its engines' faults (`--cut-replay`) are this build's.
fn start_engines(engines: usize, flags: &[&str]) -> (Proc, Vec<String>) {
    let n = engines.to_string();
    let mut args = vec!["--workers", &n, "--port", "0"];
    args.extend_from_slice(&["--kv-events-port", "0", "--replay-port", "0"]);
    args.extend_from_slice(flags);
    spawn_this_builds_mocker(&args, engines)
}

/// A `--worker` line's `key=` field.
fn field(line: &str, key: &str) -> String {
    line.split(',')
        .find_map(|kv| kv.strip_prefix(key))
        .unwrap_or_default()
        .to_owned()
}

/// One mock engine as the tests use it: its worker name and `host:port`.
struct Engine {
    name: String,
    addr: String,
}

impl Engine {
    fn of(line: &str) -> Engine {
        let url = field(line, "url=");
        Engine {
            name: field(line, "name="),
            addr: url
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_owned(),
        }
    }

    /// Batches the engine numbered (live or dropped).
    fn published(&self) -> u64 {
        metric(&self.addr, "kvroute_mocker_kv_batches_total").unwrap_or(0.0) as u64
    }

    /// Sends prompt `n` and waits until its batch is numbered.
    fn send(&self, n: u32) -> u64 {
        let before = self.published();
        send_to_engine(&self.addr, &prompt(n));
        let mut now = before;
        eventually("the engine numbers the request's batch", || {
            now = self.published();
            now > before
        });
        now
    }

    /// A burst of at least `min` requests (a batch each, back to back) that
    /// ends on a batch `--drop-every 3` keeps off the live socket; returns
    /// the batches numbered after it.
    fn burst_ending_on_a_drop(&self, min: usize, next_prompt: &mut u32) -> u64 {
        let mut sent = 0;
        loop {
            *next_prompt += 1;
            let published = self.send(*next_prompt);
            sent += 1;
            if sent >= min && published.is_multiple_of(3) {
                return published;
            }
        }
    }
}

/// The router's last applied seq of `worker`'s rank 0.
fn last_seq(serve: &str, worker: &str) -> Option<u64> {
    rank(serve, worker, 0)["last_seq"].as_u64()
}

/// The router's periodic check an hour apart: within a test, only the
/// early check can find a lost last batch.
const HOURLY: &[(&str, &str)] = &[("KVROUTE_VERIFY_SECS", "3600")];

/// Mock engines dropping every third live batch (with room for every
/// prompt: an eviction would add batches of its own), and a router with
/// `env`.
fn bed(engines: usize, mocker: &[&str], env: &[(&str, &str)]) -> (Proc, Proc, String, Vec<Engine>) {
    let mut flags = vec!["--drop-every", "3", "--speedup", "100"];
    flags.extend_from_slice(&["--num-gpu-blocks", "200000"]);
    flags.extend_from_slice(mocker);
    let (mocker, lines) = start_engines(engines, &flags);
    let (serve_proc, serve) = start_serve_with_env(&lines, &[], env);
    let engines = lines.iter().map(|l| Engine::of(l)).collect();
    (mocker, serve_proc, serve, engines)
}

#[test]
fn a_bursts_lost_last_batch_is_found_by_the_early_check() {
    let (_mocker, _serve_proc, serve, engines) = bed(2, &[], HOURLY);
    let mut n = 0;
    for round in 0..2 {
        for engine in &engines {
            let published = engine.burst_ending_on_a_drop(2, &mut n);
            // No later batch shows the gap: only a check of the quiet stream can.
            eventually("the burst's lost last batch is found", || {
                last_seq(&serve, &engine.name) == Some(published - 1)
            });
            let r = rank(&serve, &engine.name, 0);
            assert_eq!(r["state"], "live", "round {round}: {r}");
        }
    }
    for engine in &engines {
        let r = rank(&serve, &engine.name, 0);
        assert!(counter(&r, "early_repairs") >= 2, "{r}");
        assert!(
            counter(&r, "early_verifies") >= counter(&r, "early_repairs"),
            "{r}"
        );
        assert_eq!(counter(&r, "periodic_repairs"), 0, "{r}");
        assert_eq!(counter(&r, "replays_incomplete"), 0, "{r}");
    }
}

#[test]
fn a_replay_that_lost_its_end_marker_does_not_stall_the_next_one() {
    // The engine's first replay answer (the router's resync on connecting)
    // comes without its end marker.
    let (_mocker, _serve_proc, serve, engines) = bed(1, &["--cut-replay", "1"], HOURLY);
    let engine = &engines[0];
    eventually("the cut replay times out", || {
        counter(&rank(&serve, &engine.name, 0), "replay_timeouts") >= 1
    });
    // Two bursts, each with two lost batches and a live one after each, so
    // every loss shows as a gap and is replayed at once (no quiet check needed).
    let mut n = 0;
    let mut published = 0;
    for _ in 0..2 {
        engine.burst_ending_on_a_drop(4, &mut n);
        n += 1;
        published = engine.send(n);
    }
    eventually("every batch applied by complete replays", || {
        let r = rank(&serve, &engine.name, 0);
        r["last_seq"].as_u64() == Some(published - 1) && r["state"] == "live"
    });
    let r = rank(&serve, &engine.name, 0);
    assert_eq!(counter(&r, "replay_timeouts"), 1, "{r}");
    assert_eq!(counter(&r, "replays_incomplete"), 0, "{r}");
    assert!(counter(&r, "replays_ok") >= 2, "{r}");
    assert_eq!(r["state_reason"], serde_json::Value::Null, "{r}");
}

/// Latencies (ms) from the router applying a burst's last live batch to it
/// applying the lost one after it, for `trials` bursts on `engine`. Each
/// burst starts after a random pause of up to 400 ms, so that bursts do not
/// fall into step with the router's 200 ms timer.
fn early_check_latencies(serve: &str, engine: &Engine, trials: usize, first: u32) -> Vec<u64> {
    let mut n = first;
    let mut rng = SplitMix64::new(u64::from(first) + 7);
    let mut out = Vec::with_capacity(trials);
    while out.len() < trials {
        std::thread::sleep(Duration::from_millis(rng.next_u64() % 400));
        let published = engine.burst_ending_on_a_drop(2, &mut n);
        let (last_live, lost) = (published - 2, published - 1);
        let mut quiet_at = None;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let seen = last_seq(serve, &engine.name);
            let now = Instant::now();
            if seen == Some(last_live) && quiet_at.is_none() {
                quiet_at = Some(now);
            }
            if seen >= Some(lost) {
                // Not seen at the last live batch: it came within one poll.
                let from = quiet_at.unwrap_or(now);
                out.push(now.duration_since(from).as_millis() as u64);
                break;
            }
            // Polled back to back (each poll is one HTTP request to the
            // router): the figure's resolution.
            assert!(now < deadline, "{} never found seq {lost}", engine.name);
        }
    }
    out
}

/// The value at quantile `q` of sorted `v`.
fn quantile(v: &[u64], q: f64) -> u64 {
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[i.min(v.len() - 1)]
}

#[test]
#[ignore = "a measurement: KVROUTE_QUIET_TRIALS bursts per engine (default 150), two engines"]
fn the_early_check_latency_distribution() {
    let trials: usize = std::env::var("KVROUTE_QUIET_TRIALS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(150);
    // The router's default periodic check: this measures the build under
    // test as a fleet would see it (KVROUTE_TEST_BIN: an older build).
    let (_mocker, _serve_proc, serve, engines) = bed(2, &[], &[]);
    let mut all: Vec<u64> = std::thread::scope(|s| {
        let runs: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let serve = serve.as_str();
                s.spawn(move || early_check_latencies(serve, e, trials, i as u32 * 1_000_000))
            })
            .collect();
        runs.into_iter()
            .flat_map(|r| r.join().expect("a trial thread"))
            .collect()
    });
    all.sort_unstable();
    let within = all.iter().filter(|&&ms| ms <= 1_000).count();
    let mean = all.iter().sum::<u64>() as f64 / all.len() as f64;
    println!(
        "early check: {} bursts, {within} found within 1 s of quiet ({:.1} %), min {} ms, median {} ms, mean {mean:.0} ms, p90 {} ms, p99 {} ms, max {} ms",
        all.len(),
        100.0 * within as f64 / all.len() as f64,
        all[0],
        quantile(&all, 0.5),
        quantile(&all, 0.9),
        quantile(&all, 0.99),
        all[all.len() - 1],
    );
    for engine in &engines {
        let r = rank(&serve, &engine.name, 0);
        println!(
            "{}: early_verifies {}, early_repairs {}, periodic_repairs {}, gaps {}",
            engine.name,
            counter(&r, "early_verifies"),
            counter(&r, "early_repairs"),
            counter(&r, "periodic_repairs"),
            counter(&r, "gaps")
        );
    }
    assert_eq!(all.len(), 2 * trials);
}
