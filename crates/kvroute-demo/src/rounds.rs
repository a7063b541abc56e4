//! `kvroute demo --rounds N`: the same comparison run N times, the
//! policies' order alternating (as given in the first round, reversed in
//! the second, and so on), so that drift in the machine's speed weighs on
//! every policy alike. One run on a shared machine cannot rank two routers;
//! the rounds give each figure as its median with its spread (the lowest
//! and highest round), and each comparison the goals are stated in as a
//! ratio or a difference taken within each round, then its median and
//! spread:
//!
//! * every policy's latency p99 and TTFT p99 over `dynamo`'s, when `dynamo`
//!   ran;
//! * every policy's hit rate less `sglang-cache-aware`'s, when it ran.

use std::fmt;
use std::future::Future;

use kvroute_loadgen::contender::{DYNAMO, SGLANG};
use kvroute_loadgen::report::PolicyReport;
use serde_json::{json, Value};

use crate::embedded_router::RouterTokenizer;
use crate::error::{Error, Result};
use crate::{run, DemoConfig, DemoReport};

/// The most rounds one command runs.
pub const MAX_ROUNDS: usize = 9;

/// Every round's report, in the order they ran.
#[derive(Debug, Clone)]
pub struct Rounds {
    rounds: Vec<DemoReport>,
    policies: Vec<String>,
}

/// Runs `config` `rounds` times (1 to [`MAX_ROUNDS`], the policies'
/// order reversed every other round); `None` when `interrupt` completed
/// first. Each round starts its own engines and routers, as one run does.
pub async fn run_rounds(
    config: &DemoConfig,
    tokenizer: RouterTokenizer,
    rounds: usize,
    interrupt: impl Future<Output = ()>,
) -> Result<Option<Rounds>> {
    if !(1..=MAX_ROUNDS).contains(&rounds) {
        return Err(Error::Invalid(format!(
            "rounds must be 1 to {MAX_ROUNDS}, not {rounds}"
        )));
    }
    if rounds > 1 && config.keep {
        return Err(Error::Invalid(
            "keep the routers of one run, not of several rounds".into(),
        ));
    }
    let mut interrupt = std::pin::pin!(interrupt);
    let mut done = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let mut this = config.clone();
        if round % 2 == 1 {
            this.contenders.reverse();
        }
        if rounds > 1 {
            let order: Vec<&str> = this.contenders.iter().map(|(n, _)| n.as_str()).collect();
            eprintln!(
                "kvroute demo: round {} of {rounds} ({})",
                round + 1,
                order.join(", ")
            );
        }
        match run(&this, tokenizer.clone(), interrupt.as_mut()).await? {
            Some((report, _kept)) => done.push(report),
            None => return Ok(None),
        }
    }
    let policies = config.contenders.iter().map(|(n, _)| n.clone()).collect();
    Ok(Some(Rounds {
        rounds: done,
        policies,
    }))
}

/// The median of `values` (the mean of the middle two of an even count)
/// with the lowest and highest; `None` when there are none.
pub fn spread(values: &[f64]) -> Option<Spread> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    Some(Spread {
        median,
        min: sorted[0],
        max: sorted[n - 1],
    })
}

/// A figure over the rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// The median round's.
    pub median: f64,
    /// The lowest round's.
    pub min: f64,
    /// The highest round's.
    pub max: f64,
}

impl Spread {
    fn json(self) -> Value {
        json!({"median": self.median, "min": self.min, "max": self.max})
    }

    fn show(self, decimals: usize) -> String {
        format!(
            "{:.d$} ({:.d$}–{:.d$})",
            self.median,
            self.min,
            self.max,
            d = decimals
        )
    }
}

/// A policy's figure the rounds are summed up by.
type Figure = fn(&PolicyReport) -> f64;

/// The table's columns: name, decimals, figure.
const FIGURES: [(&str, usize, Figure); 5] = [
    ("hit rate", 3, |p| p.hit_rate),
    ("TTFT p50 ms", 1, |p| p.ttft_ms.p50),
    ("TTFT p99 ms", 1, |p| p.ttft_ms.p99),
    ("latency p99 ms", 1, |p| p.latency_ms.p99),
    ("output tok/s", 0, |p| p.output_tokens_per_s),
];

/// The comparisons: name, reference policy, decimals, per-round value.
type Comparison = (
    &'static str,
    &'static str,
    usize,
    fn(&PolicyReport, &PolicyReport) -> f64,
);
const COMPARISONS: [Comparison; 3] = [
    ("latency p99 / dynamo's", DYNAMO, 3, |p, r| {
        p.latency_ms.p99 / r.latency_ms.p99
    }),
    ("TTFT p99 / dynamo's", DYNAMO, 3, |p, r| {
        p.ttft_ms.p99 / r.ttft_ms.p99
    }),
    ("hit rate − sglang-cache-aware's", SGLANG, 4, |p, r| {
        p.hit_rate - r.hit_rate
    }),
];

impl Rounds {
    /// Every round's report.
    pub fn reports(&self) -> &[DemoReport] {
        &self.rounds
    }

    /// `policy`'s `figure` in each round it ran.
    fn each(&self, policy: &str, figure: Figure) -> Vec<f64> {
        self.rounds
            .iter()
            .filter_map(|r| r.policy(policy).map(figure))
            .collect()
    }

    /// `policy`'s comparison with `reference` in each round both ran.
    fn compared(
        &self,
        policy: &str,
        reference: &str,
        by: fn(&PolicyReport, &PolicyReport) -> f64,
    ) -> Vec<f64> {
        self.rounds
            .iter()
            .filter_map(|r| Some(by(r.policy(policy)?, r.policy(reference)?)))
            .collect()
    }

    /// The summary as JSON: per policy each figure's median, min and max,
    /// and each comparison's.
    pub fn summary(&self) -> Value {
        let mut policies = serde_json::Map::new();
        for name in &self.policies {
            let mut entry = serde_json::Map::new();
            for (figure, _, of) in FIGURES {
                if let Some(s) = spread(&self.each(name, of)) {
                    entry.insert(figure.to_owned(), s.json());
                }
            }
            for (what, reference, _, by) in COMPARISONS {
                if name == reference {
                    continue;
                }
                if let Some(s) = spread(&self.compared(name, reference, by)) {
                    entry.insert(what.to_owned(), s.json());
                }
            }
            policies.insert(name.clone(), Value::Object(entry));
        }
        json!({"rounds": self.rounds.len(), "policies": policies})
    }

    /// Every round's document and the summary, as the report file holds
    /// them.
    pub fn document(&self) -> Result<Value> {
        let rounds: Result<Vec<Value>> = self.rounds.iter().map(DemoReport::document).collect();
        Ok(json!({"rounds": rounds?, "summary": self.summary()}))
    }

    /// Writes [`Rounds::document`] as pretty JSON to `path`.
    pub fn write_json(&self, path: &std::path::Path) -> Result<()> {
        crate::write_pretty_json(path, &self.document()?)
    }
}

/// Each figure's median (lowest–highest) per policy, then the comparisons.
impl fmt::Display for Rounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "medians of {} rounds (lowest–highest), the policies' order alternating:",
            self.rounds.len()
        )?;
        let width = self
            .policies
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(6)
            .max(6);
        write!(f, "{:width$}", "policy")?;
        for (figure, _, _) in FIGURES {
            write!(f, " | {figure:>24}")?;
        }
        writeln!(f)?;
        for name in &self.policies {
            write!(f, "{name:width$}")?;
            for (_, decimals, of) in FIGURES {
                let cell = spread(&self.each(name, of)).map_or("-".into(), |s| s.show(decimals));
                write!(f, " | {cell:>24}")?;
            }
            writeln!(f)?;
        }
        for (what, reference, decimals, by) in COMPARISONS {
            for name in self.policies.iter().filter(|n| *n != reference) {
                if let Some(s) = spread(&self.compared(name, reference, by)) {
                    writeln!(f, "{name}: {what} {}", s.show(decimals))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_is_the_median_with_the_extremes() {
        let s = spread(&[3.0, 1.0, 2.0]).expect("some");
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let even = spread(&[4.0, 1.0, 2.0, 3.0]).expect("some");
        assert_eq!(even.median, 2.5);
        assert_eq!(spread(&[f64::NAN]), None);
        assert_eq!(spread(&[]), None);
        assert_eq!(even.show(1), "2.5 (1.0–4.0)");
    }
}
