//! The multi-turn workload on two real vLLM engines (block size 32):
//! 12 chat conversations over three rounds, each round resending the whole
//! conversation (a 500-token system prompt, 60-token user turns, the
//! engine's own replies) — about 730 tokens by the third round. Rounds 2-3
//! should find their conversation cached on the engine that served it.

use std::collections::BTreeSet;

use serde_json::{json, Value};

use super::bed::{ask, bed, decode_errors, tokens, words, Answer, Bed};

/// Conversations and rounds.
const CONVERSATIONS: u32 = 12;
const ROUNDS: u32 = 3;

/// What a run gave: every answer with its round, and the routers' counts.
pub struct Outcome {
    /// (round, answer) in the order sent.
    pub answers: Vec<(u32, Answer)>,
    /// Decode errors of the router's ingest.
    pub decode_errors: u64,
    /// Requests before which the router was still applying earlier
    /// answers' events (each waited for them: see `Bed::caught_up`).
    pub behind: usize,
}

impl Outcome {
    /// The hit rate of rounds 2-3: cached over prompt tokens.
    pub fn later_hit_rate(&self) -> f64 {
        let later = self.answers.iter().filter(|(r, _)| *r > 0);
        let (cached, prompt) =
            later.fold((0, 0), |(c, p), (_, a)| (c + a.cached, p + a.prompt_tokens));
        cached as f64 / prompt.max(1) as f64
    }

    /// Answers predicted exactly, and answers.
    pub fn exact(&self) -> (usize, usize) {
        let exact = self.answers.iter().filter(|(_, a)| a.exact).count();
        (exact, self.answers.len())
    }

    /// The workers that served a request.
    pub fn workers(&self) -> BTreeSet<String> {
        self.answers.iter().map(|(_, a)| a.worker.clone()).collect()
    }

    /// One line of figures.
    pub fn summary(&self) -> String {
        let (exact, n) = self.exact();
        let prompt: u64 = self
            .answers
            .iter()
            .filter(|(r, _)| *r == ROUNDS - 1)
            .map(|(_, a)| a.prompt_tokens)
            .sum();
        format!(
            "rounds 2-3 hit rate {:.3}, predictions exact on {exact} of {n}, workers {:?}, {} decode errors, round-3 prompts {} tokens on average; the router was still applying earlier events before {} requests",
            self.later_hit_rate(),
            self.workers(),
            self.decode_errors,
            prompt / u64::from(CONVERSATIONS),
            self.behind
        )
    }
}

/// Runs the workload through a router over the bed's engines started with
/// `extra` flags.
pub fn run(bed: &Bed, extra: &[&str]) -> Outcome {
    let (_router, serve) = bed.router(extra);
    let mut histories: Vec<Vec<Value>> = (0..CONVERSATIONS)
        .map(|c| vec![json!({"role": "system", "content": words(&tokens(1_000 + c * 2_000, 500))})])
        .collect();
    let mut answers = Vec::new();
    let mut behind = 0;
    for round in 0..ROUNDS {
        for (c, history) in histories.iter_mut().enumerate() {
            let user = tokens(1_600 + c as u32 * 2_000 + round * 100, 60);
            history.push(json!({"role": "user", "content": words(&user)}));
            let body = json!({"model": bed.served, "messages": history, "max_tokens": 16});
            behind += usize::from(bed.caught_up(&serve));
            let answer = ask(&serve, "/v1/chat/completions", &body);
            let reply = answer.body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            history.push(json!({"role": "assistant", "content": reply}));
            answers.push((round, answer));
        }
    }
    Outcome {
        answers,
        decode_errors: decode_errors(&serve),
        behind,
    }
}

#[test]
fn conversations_hit_in_later_rounds_and_are_predicted_with_the_tokenizer() {
    let (_serial, bed) = bed();
    let tokenizer = bed.tokenizer.clone();
    let outcome = run(&bed, &["--tokenizer", &tokenizer]);
    eprintln!("multi-turn, --tokenizer: {}", outcome.summary());
    let (exact, n) = outcome.exact();
    assert_eq!(n, (CONVERSATIONS * ROUNDS) as usize);
    assert!(outcome.later_hit_rate() >= 0.85, "{}", outcome.summary());
    assert!(exact * 100 >= n * 99, "{}", outcome.summary());
    assert_eq!(outcome.decode_errors, 0);
    assert_eq!(
        outcome.workers().len(),
        2,
        "both engines used: {}",
        outcome.summary()
    );
}
