//! What `kvroute bench replicas` reports: per phase the load's figures,
//! the requests each engine got and how even that was, the replica sync's
//! delays; then the differences from one router. As a text table or one
//! JSON object.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;
use serde_json::{json, Value};

use super::scrape::SyncFigures;
use super::ReplicasBenchConfig;
use crate::report::PolicyReport;

/// How far the synced replicas' hit rate may be from one router's for the
/// two to count as routing alike.
pub const HIT_RATE_GOAL: f64 = 0.01;

/// Which set-up a phase runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseKind {
    /// One router: the reference.
    OneRouter,
    /// Two replicas sharing their requests in flight over NATS.
    Synced,
    /// Two routers sharing nothing.
    NoSync,
    /// As [`PhaseKind::Synced`], and replica `r0` killed with SIGKILL under load.
    KillOne,
}

impl PhaseKind {
    /// The phases, in the order they run.
    pub const ALL: [PhaseKind; 4] = [
        PhaseKind::OneRouter,
        PhaseKind::Synced,
        PhaseKind::NoSync,
        PhaseKind::KillOne,
    ];

    /// The phase's name in the text output.
    pub fn title(self) -> &'static str {
        match self {
            PhaseKind::OneRouter => "one router",
            PhaseKind::Synced => "2 replicas, synced",
            PhaseKind::NoSync => "2 replicas, no sync",
            PhaseKind::KillOne => "kill -9 one replica",
        }
    }

    /// The phase's key in the JSON output (and in its NATS prefix).
    pub fn key(self) -> &'static str {
        match self {
            PhaseKind::OneRouter => "one_router",
            PhaseKind::Synced => "synced",
            PhaseKind::NoSync => "no_sync",
            PhaseKind::KillOne => "kill_one",
        }
    }

    /// Router processes the phase starts.
    pub fn routers(self) -> usize {
        match self {
            PhaseKind::OneRouter => 1,
            _ => 2,
        }
    }

    /// Whether its routers share their state over NATS.
    pub fn synced(self) -> bool {
        matches!(self, PhaseKind::Synced | PhaseKind::KillOne)
    }

    /// Whether its requests stream (phase 4 asks for whole answers, so that
    /// the requests a killed replica had in flight can be retried).
    pub fn streamed(self) -> bool {
        self != PhaseKind::KillOne
    }

    /// The title with a mark for the footnote on phase 4.
    fn label(self) -> String {
        match self {
            PhaseKind::KillOne => format!("{}*", self.title()),
            _ => self.title().to_owned(),
        }
    }
}

/// What one phase measured.
#[derive(Debug, Clone)]
pub struct PhaseReport {
    /// Which phase.
    pub kind: PhaseKind,
    /// The load's figures (requests, failed, retried, hit rate, TTFT, latency).
    pub load: PolicyReport,
    /// Requests routed to each engine (`kvroute_proxy_routed_total`, summed
    /// over the routers in `counted_from`), every engine listed.
    pub per_engine: BTreeMap<String, u64>,
    /// The routers whose `/metrics` and `/workers` were read (all of them,
    /// except one killed).
    pub counted_from: Vec<String>,
    /// The replica sync of each router read that has one.
    pub sync: Vec<SyncFigures>,
    /// CPU time (user + system) the phase's routers used during the load, s
    /// (a killed router's up to its kill).
    pub router_cpu_s: f64,
    /// Phase 4: seconds into the load `r0` was killed; `None` when nothing was.
    pub killed_at_s: Option<f64>,
    /// Samples of the engines' requests in flight as max / mean over the
    /// engines (1.00: even at that moment), every 20 ms of the load.
    pub in_flight_imbalance: Vec<f64>,
}

impl PhaseReport {
    /// Max / mean of the requests per engine (1.00: perfectly even);
    /// `None` when no request was counted.
    pub fn balance(&self) -> Option<f64> {
        let total: u64 = self.per_engine.values().sum();
        let max = self.per_engine.values().copied().max()?;
        (total > 0).then(|| max as f64 * self.per_engine.len() as f64 / total as f64)
    }

    /// The mean and the 99th percentile of [`PhaseReport::in_flight_imbalance`];
    /// `None` without samples.
    pub fn imbalance(&self) -> Option<(f64, f64)> {
        let mut v = self.in_flight_imbalance.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let rank = ((0.99 * v.len() as f64).ceil() as usize).clamp(1, v.len());
        Some((mean, v[rank - 1]))
    }

    /// Whether phase 4's kill came before the load's last request (not
    /// during the pause after it).
    pub fn killed_during_load(&self) -> bool {
        self.killed_at_s.is_some_and(|at| at < self.load.duration_s)
    }

    /// The routers' CPU µs per request answered.
    pub fn router_cpu_us_per_request(&self) -> f64 {
        let answered = self.load.requests.saturating_sub(self.load.failed).max(1);
        self.router_cpu_s * 1e6 / answered as f64
    }

    fn to_json(&self) -> Value {
        let l = &self.load;
        json!({
            "phase": self.kind,
            "title": self.kind.title(),
            "routers": self.kind.routers(),
            "synced": self.kind.synced(),
            "stream": self.kind.streamed(),
            "requests": l.requests,
            "failed": l.failed,
            "retried": l.retried,
            "hit_rate": l.hit_rate,
            "prompt_tokens": l.prompt_tokens,
            "cached_tokens": l.cached_tokens,
            "ttft_ms": {"p50": l.ttft_ms.p50, "p99": l.ttft_ms.p99},
            "latency_ms": {"p50": l.latency_ms.p50, "p99": l.latency_ms.p99},
            "duration_s": l.duration_s,
            "index_accuracy": l.index_accuracy,
            "requests_per_engine": self.per_engine,
            "balance": self.balance(),
            "in_flight_imbalance_samples": self.in_flight_imbalance.len(),
            "in_flight_imbalance_mean": self.imbalance().map(|i| i.0),
            "in_flight_imbalance_p99": self.imbalance().map(|i| i.1),
            "counted_from": self.counted_from,
            "replicas": self.sync,
            "router_cpu_s": self.router_cpu_s,
            "router_cpu_us_per_request": self.router_cpu_us_per_request(),
            "killed_at_s": self.killed_at_s,
            "killed_during_load": self.killed_during_load(),
        })
    }
}

/// The benchmark's result: the four phases in order.
#[derive(Debug, Clone)]
pub struct ReplicasBenchReport {
    /// The settings it ran with.
    pub config: ReplicasBenchConfig,
    /// The workload's description ([`kvroute_loadgen::WorkloadSpec::describe`], streamed).
    pub workload: Value,
    /// Per phase, in the order they ran.
    pub phases: Vec<PhaseReport>,
}

impl ReplicasBenchReport {
    /// A phase's report, if it ran.
    pub fn phase(&self, kind: PhaseKind) -> Option<&PhaseReport> {
        self.phases.iter().find(|p| p.kind == kind)
    }

    /// The phase's hit rate minus one router's.
    pub fn hit_rate_minus_one_router(&self, kind: PhaseKind) -> Option<f64> {
        let one = self.phase(PhaseKind::OneRouter)?;
        Some(self.phase(kind)?.load.hit_rate - one.load.hit_rate)
    }

    /// One JSON object: the settings, the workload, `phases` (one object
    /// each) and `differences` from one router.
    pub fn to_json(&self) -> Value {
        let c = &self.config;
        let diff = |kind| self.hit_rate_minus_one_router(kind);
        let balance = |kind| self.phase(kind).and_then(PhaseReport::balance);
        json!({
            "engines": c.engines,
            "gpu_blocks": c.gpu_blocks,
            "requests": c.requests,
            "concurrency": c.concurrency,
            "speedup": c.speedup,
            "kill_after_s": c.kill_after.as_secs_f64(),
            "workload": self.workload,
            "phases": self.phases.iter().map(PhaseReport::to_json).collect::<Vec<_>>(),
            "differences": {
                "synced_minus_one_router_hit_rate": diff(PhaseKind::Synced),
                "synced_within_goal": diff(PhaseKind::Synced).map(|d| d.abs() <= HIT_RATE_GOAL),
                "hit_rate_goal": HIT_RATE_GOAL,
                "no_sync_minus_one_router_hit_rate": diff(PhaseKind::NoSync),
                "kill_one_minus_one_router_hit_rate": diff(PhaseKind::KillOne),
                "balance": PhaseKind::ALL
                    .iter()
                    .map(|&k| (k.key().to_owned(), json!(balance(k))))
                    .collect::<serde_json::Map<_, _>>(),
            },
        })
    }

    fn heading(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let sizes = self.workload["sizes"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        writeln!(
            f,
            "{} requests per phase, {} (scale {}: {sizes}; {} groups, {} tokens out, seed {}), \
             closed loop at concurrency {}",
            c.requests, c.workload, c.scale, c.groups, c.max_tokens, c.seed, c.concurrency
        )?;
        writeln!(
            f,
            "{} mock engines ({} KV blocks each, speedup {}), fresh for each phase; \
             routers are `kvroute serve` processes",
            c.engines, c.gpu_blocks, c.speedup
        )
    }

    fn main_table(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "\n{:<22}{:>9}{:>8}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}{:>9}{:>13}{:>12}",
            "phase",
            "requests",
            "failed",
            "retried",
            "hit rate",
            "TTFT p50",
            "TTFT p99",
            "lat. p50",
            "lat. p99",
            "balance",
            "in flight ×",
            "CPU µs/req"
        )?;
        for p in &self.phases {
            let l = &p.load;
            writeln!(
                f,
                "{:<22}{:>9}{:>8}{:>9}{:>10.4}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>9}{:>13}{:>12.0}",
                p.kind.label(),
                l.requests,
                l.failed,
                l.retried,
                l.hit_rate,
                l.ttft_ms.p50,
                l.ttft_ms.p99,
                l.latency_ms.p50,
                l.latency_ms.p99,
                p.balance()
                    .map_or_else(|| "-".into(), |b| format!("{b:.2}")),
                p.imbalance()
                    .map_or_else(|| "-".into(), |(m, p99)| format!("{m:.2}/{p99:.2}")),
                p.router_cpu_us_per_request(),
            )?;
        }
        writeln!(
            f,
            "(TTFT and latency in ms; balance: max/mean of requests per engine, 1.00 = even; \
             in flight ×: max/mean of the engines' requests in flight, sampled every 20 ms, \
             mean/p99; CPU: the routers' user + system time per request answered)"
        )
    }

    fn engines_table(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "\nrequests per engine (kvroute_proxy_routed_total, summed over the routers read)"
        )?;
        for p in &self.phases {
            let counts: Vec<String> = p
                .per_engine
                .iter()
                .map(|(w, n)| format!("{w} {n:>6}"))
                .collect();
            writeln!(
                f,
                "{:<22}{}   from {}",
                p.kind.label(),
                counts.join("  "),
                p.counted_from.join(", ")
            )?;
        }
        Ok(())
    }

    fn sync_table(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.phases.iter().all(|p| p.sync.is_empty()) {
            return Ok(());
        }
        writeln!(
            f,
            "\n{:<22}{:<9}{:>12}{:>9}{:>9}{:>9}{:>16}{:>6}{:>9}",
            "replica sync",
            "replica",
            "peer delay n",
            "p50 µs",
            "p99 µs",
            "max µs",
            "publish p99 µs",
            "lost",
            "dropped"
        )?;
        let cell = |v: Option<u64>| v.map_or_else(|| "-".into(), |v| v.to_string());
        for p in self.phases.iter().filter(|p| !p.sync.is_empty()) {
            for (i, s) in p.sync.iter().enumerate() {
                let name = if i == 0 {
                    p.kind.label()
                } else {
                    String::new()
                };
                let d = s.peer_delay;
                writeln!(
                    f,
                    "{name:<22}{:<9}{:>12}{:>9}{:>9}{:>9}{:>16}{:>6}{:>9}",
                    s.replica_id,
                    cell(d.map(|d| d.count)),
                    cell(d.map(|d| d.p50_us)),
                    cell(d.map(|d| d.p99_us)),
                    cell(d.map(|d| d.max_us)),
                    cell(s.publish_cost.map(|c| c.p99_us)),
                    s.lost_messages,
                    s.dropped_events,
                )?;
            }
        }
        Ok(())
    }

    fn differences(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let balance = |kind| {
            self.phase(kind)
                .and_then(PhaseReport::balance)
                .map_or_else(|| "-".into(), |b| format!("{b:.2}"))
        };
        let one = balance(PhaseKind::OneRouter);
        writeln!(f)?;
        for kind in [PhaseKind::Synced, PhaseKind::NoSync, PhaseKind::KillOne] {
            let Some(d) = self.hit_rate_minus_one_router(kind) else {
                continue;
            };
            let goal = match kind {
                PhaseKind::Synced => {
                    let met = if d.abs() <= HIT_RATE_GOAL {
                        "met"
                    } else {
                        "NOT met"
                    };
                    format!(" (goal: within ±{HIT_RATE_GOAL}, {met})")
                }
                // A router learns that a whole answer's prefill is over only
                // when the answer comes: its load, hence its routing, differs.
                PhaseKind::KillOne => " (whole answers against streams: not the same load)".into(),
                _ => String::new(),
            };
            writeln!(
                f,
                "{:<36}hit rate {d:+.4}{goal}; balance {} (one router {one})",
                format!("{} − one router:", kind.label()),
                balance(kind)
            )?;
        }
        Ok(())
    }

    fn footnote(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(p) = self.phase(PhaseKind::KillOne) else {
            return Ok(());
        };
        write!(
            f,
            "\n* whole answers, not streamed, so that what r0 had in flight could be retried \
             (TTFT is then the whole latency); "
        )?;
        match p.killed_at_s {
            Some(at) if p.killed_during_load() => writeln!(
                f,
                "r0 killed with SIGKILL {at:.2} s into a {:.2} s load; requests per engine and \
                 replica sync from the survivor ({}) only: r0's figures died with it.",
                p.load.duration_s,
                p.counted_from.join(", ")
            ),
            Some(at) => writeln!(
                f,
                "r0 was killed {at:.2} s in, after the load's last request ({:.2} s): the kill \
                 cost this load nothing (use more requests); figures from {} only.",
                p.load.duration_s,
                p.counted_from.join(", ")
            ),
            None => writeln!(
                f,
                "the load ended ({:.2} s) before r0 was to be killed: nothing was killed.",
                p.load.duration_s
            ),
        }
    }
}

impl fmt::Display for ReplicasBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.heading(f)?;
        self.main_table(f)?;
        self.engines_table(f)?;
        self.sync_table(f)?;
        self.differences(f)?;
        self.footnote(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replicas::Delay;

    fn phase(kind: PhaseKind, hit_rate: f64, counts: [u64; 2]) -> PhaseReport {
        let delay = Delay {
            count: 40,
            p50_us: 300,
            p99_us: 900,
            max_us: 1000,
        };
        PhaseReport {
            kind,
            load: PolicyReport {
                hit_rate,
                requests: 100,
                failed: 0,
                retried: if kind == PhaseKind::KillOne { 7 } else { 0 },
                duration_s: 2.0,
                ..PolicyReport::default()
            },
            per_engine: [("w0".to_owned(), counts[0]), ("w1".to_owned(), counts[1])].into(),
            counted_from: vec!["r1".into()],
            sync: if kind.synced() {
                vec![SyncFigures {
                    replica_id: "r1".into(),
                    connected: true,
                    peers: vec!["r0".into()],
                    peer_delay: Some(delay),
                    publish_cost: Some(delay),
                    lost_messages: 0,
                    dropped_events: 0,
                    outages: 0,
                }]
            } else {
                vec![]
            },
            router_cpu_s: 0.01,
            killed_at_s: (kind == PhaseKind::KillOne).then_some(1.0),
            in_flight_imbalance: vec![1.0, 1.5, 2.0],
        }
    }

    fn report() -> ReplicasBenchReport {
        let config = ReplicasBenchConfig::new("kvroute".into());
        ReplicasBenchReport {
            workload: config.workload_spec(true).describe(),
            config,
            phases: vec![
                phase(PhaseKind::OneRouter, 0.80, [50, 50]),
                phase(PhaseKind::Synced, 0.805, [60, 40]),
                phase(PhaseKind::NoSync, 0.70, [75, 25]),
                phase(PhaseKind::KillOne, 0.78, [0, 0]),
            ],
        }
    }

    #[test]
    fn balance_is_max_over_mean_and_unknown_without_counts() {
        let r = report();
        let b = |k| r.phase(k).and_then(PhaseReport::balance);
        assert_eq!(b(PhaseKind::OneRouter), Some(1.0));
        assert_eq!(b(PhaseKind::NoSync), Some(1.5));
        assert_eq!(b(PhaseKind::KillOne), None);
        let sampled = r
            .phase(PhaseKind::OneRouter)
            .and_then(PhaseReport::imbalance);
        assert_eq!(
            sampled,
            Some((1.5, 2.0)),
            "mean and p99 of the in-flight samples"
        );
        let d = r
            .hit_rate_minus_one_router(PhaseKind::NoSync)
            .expect("both ran");
        assert!((d + 0.1).abs() < 1e-12);
    }

    #[test]
    fn json_has_every_phase_and_the_differences() {
        let doc = report().to_json();
        let phases = doc["phases"].as_array().expect("phases");
        assert_eq!(phases.len(), 4);
        assert_eq!(phases[0]["phase"], "one_router");
        assert_eq!(phases[1]["replicas"][0]["peer_delay"]["count"], 40);
        assert_eq!(phases[2]["replicas"].as_array().map(Vec::len), Some(0));
        assert_eq!(phases[3]["stream"], false);
        assert_eq!(phases[3]["retried"], 7);
        assert_eq!(phases[3]["killed_at_s"], 1.0);
        assert_eq!(phases[3]["killed_during_load"], true);
        assert_eq!(phases[2]["killed_during_load"], false);
        assert_eq!(phases[0]["requests_per_engine"]["w1"], 50);
        assert_eq!(doc["differences"]["synced_within_goal"], true);
        assert_eq!(doc["differences"]["balance"]["no_sync"], 1.5);
        assert!(doc["differences"]["balance"]["kill_one"].is_null());
        assert_eq!(doc["workload"]["sizes"]["prefix_tokens"], 300);
    }

    #[test]
    fn the_text_names_each_phase_the_goal_and_the_kill() {
        let text = report().to_string();
        for title in [
            "one router",
            "2 replicas, synced",
            "2 replicas, no sync",
            "kill -9 one replica*",
        ] {
            assert!(text.contains(title), "{title}: {text}");
        }
        assert!(
            text.contains("hit rate +0.0050 (goal: within ±0.01, met)"),
            "{text}"
        );
        assert!(
            text.contains("hit rate -0.1000; balance 1.50 (one router 1.00)"),
            "{text}"
        );
        assert!(
            text.contains("r0 killed with SIGKILL 1.00 s into a 2.00 s load"),
            "{text}"
        );
        assert!(
            text.contains("prefix_tokens 300, question_tokens 60"),
            "{text}"
        );
    }
}
