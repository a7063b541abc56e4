//! The router's prediction of each answer's cached tokens against real
//! vLLM's own `cached_tokens`, on every API the prompt reaches the engine
//! by: completions (text and token ids), chat (the tiny model's template:
//! roles, separators, a generation prompt) and the Responses API, with
//! `--tokenizer` (the model's `tokenizer.json`, its chat template beside it).

use serde_json::{json, Value};

use super::bed::{ask, bed, decode_errors, tokens, words, Answer};
use crate::support::http;

/// Four documents of 400 tokens, each asked three questions of 40 tokens
/// (interleaved, so repeats find their document cached): the token ranges
/// of test `base`.
fn workload(base: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut out = Vec::new();
    for round in 0..3u32 {
        for doc in 0..4u32 {
            let document = tokens(base + doc * 1_000, 400);
            let question = tokens(base + doc * 1_000 + 500 + round * 100, 40);
            out.push((document, question));
        }
    }
    out
}

/// The first round's bodies go straight to the engines (alternately),
/// before the router starts: it learns what they hold (and their block
/// size) from their replays. Then every body goes through the router with
/// `--tokenizer` — the first at once, each later one once the router has
/// the earlier answers' events — and every prediction is checked: 12
/// answers, 12 compared, 12 exact, the repeats cached.
fn predicted_exactly(what: &str, path: &str, bodies: Vec<Value>) -> Vec<Answer> {
    let (_serial, bed) = bed();
    let bodies: Vec<Value> = bodies
        .into_iter()
        .map(|mut body| {
            body["model"] = json!(bed.served);
            body
        })
        .collect();
    for (i, body) in bodies.iter().take(4).enumerate() {
        let engine = &bed.engines[i % bed.engines.len()];
        let reply = http::request(engine.addr(), "POST", path, &body.to_string());
        assert_eq!(reply.status, 200, "{}: {}", engine.name, reply.body);
    }
    let (_router, serve) = bed.router_with_tokenizer(&[]);
    let mut behind = 0;
    let answers: Vec<Answer> = bodies
        .iter()
        .enumerate()
        .map(|(i, body)| {
            if i > 0 {
                // The previous answers' events first: this checks the index.
                behind += usize::from(bed.caught_up(&serve));
            }
            ask(&serve, path, body)
        })
        .collect();
    let exact = answers.iter().filter(|a| a.exact).count();
    let hits = answers.iter().filter(|a| a.cached > 0).count();
    let cached: u64 = answers.iter().map(|a| a.cached).sum();
    let prompt: u64 = answers.iter().map(|a| a.prompt_tokens).sum();
    eprintln!(
        "{what}: predictions exact on {exact} of {} answers; {hits} answers cached, {cached} of {prompt} prompt tokens; \
         the router was still applying earlier answers' events before {behind} of them",
        answers.len(),
    );
    let wrong: Vec<String> = answers
        .iter()
        .enumerate()
        .filter(|(_, a)| !a.exact)
        .map(|(i, a)| {
            format!(
                "answer {i} from {}: cached {} of {}, predicted {}",
                a.worker, a.cached, a.prompt_tokens, a.predicted
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{what}: mispredicted answers: {wrong:?}; the router's workers: {}",
        super::bed::ranks(&serve)
    );
    assert_eq!(
        hits, 12,
        "{what}: every document was cached before it was asked again"
    );
    assert_eq!(decode_errors(&serve), 0);
    answers
}

#[test]
fn completions_with_text_prompts_are_predicted_exactly() {
    let bodies = workload(2_000)
        .into_iter()
        .map(|(d, q)| json!({"prompt": words(&[d, q].concat()), "max_tokens": 2}))
        .collect();
    predicted_exactly("completions, text", "/v1/completions", bodies);
}

#[test]
fn completions_with_token_id_prompts_are_predicted_exactly() {
    let bodies = workload(7_000)
        .into_iter()
        .map(|(d, q)| json!({"prompt": ([d, q].concat()), "max_tokens": 2}))
        .collect();
    predicted_exactly("completions, token ids", "/v1/completions", bodies);
}

#[test]
fn chat_through_the_models_template_is_predicted_exactly() {
    let bodies = workload(12_000)
        .into_iter()
        .map(|(d, q)| {
            json!({"messages": [
                {"role": "system", "content": words(&d)},
                {"role": "user", "content": words(&q)},
            ], "max_tokens": 2})
        })
        .collect();
    let answers = predicted_exactly("chat", "/v1/chat/completions", bodies);
    // The template's roles, separators and generation prompt are tokens too.
    let (d, q) = (400, 40);
    assert!(
        answers.iter().all(|a| a.prompt_tokens > d + q),
        "the template adds its own tokens"
    );
}

#[test]
fn responses_are_predicted_exactly() {
    let bodies = workload(17_000)
        .into_iter()
        .map(|(d, q)| {
            json!({"instructions": words(&d), "input": [
                {"role": "user", "content": words(&q)},
            ], "max_output_tokens": 2, "store": false})
        })
        .collect();
    predicted_exactly("responses", "/v1/responses", bodies);
}
