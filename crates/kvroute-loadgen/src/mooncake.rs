//! Mooncake-format request traces: one JSON object per line with
//! `timestamp` (ms since the trace's start), `input_length` and
//! `output_length` (tokens) and `hash_ids`, one id per block of
//! [`TRACE_BLOCK_TOKENS`] prompt tokens, equal ids meaning equal blocks (and
//! so equal prefixes, since the ids chain as block hashes do). It is the
//! format Dynamo's and llm-d's router results are published on.
//!
//! A trace carries no tokens, so each block's tokens are drawn from its id:
//! requests that share leading ids share a token prefix, and any router
//! sees exactly the reuse the trace describes. [`synthesize`] writes a
//! trace of the same shape (shared system prompts of popular sizes,
//! conversations that grow turn by turn, unique questions) for machines
//! that cannot fetch a published one.

use std::sync::Arc;

use kvroute_core::rng::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::workload::TEXT_VOCAB;

/// Prompt tokens per hash id (Mooncake's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// The longest prompt a trace line may ask for, in tokens: bounds what a
/// line can make the reader allocate.
pub const MAX_INPUT_TOKENS: usize = 1 << 20;

/// The longest output a trace line may ask for, in tokens.
pub const MAX_OUTPUT_TOKENS: usize = 1 << 16;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// When it arrives, in ms since the trace's start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Tokens to generate.
    pub output_length: usize,
    /// One id per block of the prompt.
    pub hash_ids: Vec<u64>,
}

/// A parsed trace, shared by the runs that replay it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Where it came from (a file name), for reports.
    pub name: String,
    /// Its requests, by arrival time.
    pub requests: Arc<Vec<TraceRequest>>,
}

impl Trace {
    /// Parses JSONL text: blank lines are skipped; a bad line is an error
    /// naming its line number.
    pub fn parse(name: &str, text: &str) -> Result<Trace> {
        let mut requests = Vec::new();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: String| Error::Invalid(format!("{name} line {}: {why}", n + 1));
            let r: TraceRequest = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
            check(&r).map_err(bad)?;
            requests.push(r);
        }
        if requests.is_empty() {
            return Err(Error::Invalid(format!("{name}: the trace has no requests")));
        }
        requests.sort_by_key(|r| r.timestamp);
        Ok(Trace {
            name: name.to_owned(),
            requests: Arc::new(requests),
        })
    }

    /// Reads and parses a JSONL file.
    pub fn read(path: &std::path::Path) -> Result<Trace> {
        let text = std::fs::read_to_string(path)
            .map_err(Error::io(format!("reading the trace {}", path.display())))?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        Trace::parse(&name, &text)
    }

    /// The trace as JSONL text.
    pub fn to_jsonl(&self) -> String {
        let mut out = String::new();
        for r in self.requests.iter() {
            if let Ok(line) = serde_json::to_string(r) {
                out.push_str(&line);
                out.push('\n');
            }
        }
        out
    }
}

/// Why a request cannot be replayed, if it cannot.
fn check(r: &TraceRequest) -> std::result::Result<(), String> {
    if r.input_length == 0 || r.input_length > MAX_INPUT_TOKENS {
        return Err(format!(
            "input_length {} is not in 1..={MAX_INPUT_TOKENS}",
            r.input_length
        ));
    }
    if r.output_length == 0 || r.output_length > MAX_OUTPUT_TOKENS {
        return Err(format!(
            "output_length {} is not in 1..={MAX_OUTPUT_TOKENS}",
            r.output_length
        ));
    }
    let blocks = r.input_length.div_ceil(TRACE_BLOCK_TOKENS);
    if r.hash_ids.len() != blocks {
        return Err(format!(
            "{} hash_ids for {} input tokens (expected {blocks}, one per {TRACE_BLOCK_TOKENS})",
            r.hash_ids.len(),
            r.input_length
        ));
    }
    Ok(())
}

/// The prompt of a trace request: block `i` is [`TRACE_BLOCK_TOKENS`] ids
/// drawn from `hash_ids[i]` alone, and the prompt is cut to `input_length`.
pub fn prompt_tokens(r: &TraceRequest) -> Vec<u32> {
    let mut out = Vec::with_capacity(r.input_length);
    for &id in &r.hash_ids {
        let mut rng = SplitMix64::new(id ^ 0x6D6F_6F6E_6361_6B65);
        let n = TRACE_BLOCK_TOKENS.min(r.input_length - out.len());
        out.extend((0..n).map(|_| (rng.next_u64() % TEXT_VOCAB) as u32));
    }
    out
}

/// The shape of a synthesized trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthesisConfig {
    /// Requests.
    pub requests: usize,
    /// Mean arrivals per second (Poisson).
    pub rate: f64,
    /// Shared system prompts (popularity Zipf-like, s = 1).
    pub system_prompts: usize,
    /// Conversations open at a time; each returns for 2–6 turns.
    pub conversations: usize,
    /// Seed of every choice.
    pub seed: u64,
}

impl Default for SynthesisConfig {
    fn default() -> Self {
        SynthesisConfig {
            requests: 1_000,
            rate: 8.0,
            system_prompts: 16,
            conversations: 24,
            seed: 7,
        }
    }
}

struct Session {
    ids: Vec<u64>,
    turns_left: u32,
}

/// A trace of Mooncake's shape: each request is a system prompt of 1–4
/// blocks (a few popular ones used most), then either a conversation's
/// history grown by a turn of one or two blocks, or a fresh question of
/// one or two blocks; the last block is partly filled; 16–64 output tokens.
pub fn synthesize(config: &SynthesisConfig) -> Trace {
    let mut rng = SplitMix64::new(config.seed);
    let mut next_id = 0u64;
    let mut fresh = |n: usize| -> Vec<u64> {
        let ids = (next_id..next_id + n as u64).collect();
        next_id += n as u64;
        ids
    };
    let prompts: Vec<Vec<u64>> = (0..config.system_prompts.max(1))
        .map(|i| fresh(1 + i % 4))
        .collect();
    let weights: Vec<f64> = (1..=prompts.len()).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut sessions: Vec<Option<Session>> =
        (0..config.conversations.max(1)).map(|_| None).collect();
    let mut clock = crate::stats::PoissonArrivals::new(config.rate, config.seed ^ 0x7EACE);
    let mut requests = Vec::with_capacity(config.requests);
    for _ in 0..config.requests {
        let mut target = rng.next_f64() * total;
        let system = weights
            .iter()
            .position(|w| {
                target -= w;
                target < 0.0
            })
            .unwrap_or(prompts.len() - 1);
        let mut ids = if rng.below(3) == 0 {
            let mut ids = prompts[system].clone();
            ids.extend(fresh(1 + rng.below(2)));
            ids
        } else {
            let slot = rng.below(sessions.len());
            let session = sessions[slot].get_or_insert_with(|| Session {
                ids: prompts[system].clone(),
                turns_left: 2 + rng.below(5) as u32,
            });
            session.ids.extend(fresh(1 + rng.below(2)));
            session.turns_left -= 1;
            let ids = session.ids.clone();
            if session.turns_left == 0 {
                sessions[slot] = None;
            }
            ids
        };
        let full = (ids.len() - 1) * TRACE_BLOCK_TOKENS;
        let input_length = full + 64 + rng.below(TRACE_BLOCK_TOKENS - 64);
        ids.truncate(input_length.div_ceil(TRACE_BLOCK_TOKENS));
        requests.push(TraceRequest {
            timestamp: (clock.next_arrival() * 1e3) as u64,
            input_length,
            output_length: 16 + rng.below(49),
            hash_ids: ids,
        });
    }
    Trace {
        name: format!("synthesized-{}", config.seed),
        requests: Arc::new(requests),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_and_bad_lines_name_themselves() {
        let text = concat!(
            r#"{"timestamp": 27, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}"#,
            "\n\n",
            r#"{"timestamp": 3, "input_length": 100, "output_length": 5, "hash_ids": [1]}"#,
            "\n"
        );
        let trace = Trace::parse("t.jsonl", text).expect("parses");
        assert_eq!(trace.requests.len(), 2);
        assert_eq!(trace.requests[0].timestamp, 3, "sorted by arrival");
        let short = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}"#;
        let e = Trace::parse("t.jsonl", short).expect_err("one id for two blocks");
        assert!(
            e.to_string().contains("line 1") && e.to_string().contains("expected 2"),
            "{e}"
        );
        let huge = format!(
            r#"{{"timestamp": 0, "input_length": {}, "output_length": 1, "hash_ids": []}}"#,
            MAX_INPUT_TOKENS + 1
        );
        assert!(Trace::parse("t", &huge).is_err());
        assert!(Trace::parse("t", "not json").is_err());
        assert!(Trace::parse("t", "\n").is_err());
    }

    #[test]
    fn equal_ids_give_equal_tokens_and_the_length_is_kept() {
        let a = TraceRequest {
            timestamp: 0,
            input_length: 700,
            output_length: 1,
            hash_ids: vec![5, 6],
        };
        let b = TraceRequest {
            hash_ids: vec![5, 7],
            ..a.clone()
        };
        let (ta, tb) = (prompt_tokens(&a), prompt_tokens(&b));
        assert_eq!((ta.len(), tb.len()), (700, 700));
        assert_eq!(ta[..512], tb[..512]);
        assert_ne!(ta[512..], tb[512..]);
    }

    #[test]
    fn a_synthesized_trace_reads_back_and_reuses_prefixes() {
        let trace = synthesize(&SynthesisConfig {
            requests: 300,
            ..SynthesisConfig::default()
        });
        let again = Trace::parse(&trace.name, &trace.to_jsonl()).expect("parses");
        assert_eq!(again.requests, trace.requests);
        let firsts: std::collections::HashSet<u64> =
            trace.requests.iter().map(|r| r.hash_ids[0]).collect();
        assert!(firsts.len() <= 16, "requests start with a system prompt");
        let mut seen = std::collections::HashSet::new();
        let reused = trace
            .requests
            .iter()
            .flat_map(|r| r.hash_ids.iter())
            .filter(|&&id| !seen.insert(id))
            .count();
        let blocks: usize = trace.requests.iter().map(|r| r.hash_ids.len()).sum();
        assert!(reused * 2 > blocks, "{reused} of {blocks} blocks reused");
        assert!(trace
            .requests
            .windows(2)
            .all(|w| w[0].timestamp <= w[1].timestamp));
    }
}
