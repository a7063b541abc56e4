//! Rendering prompts with a real tokenizer (GPT-2's vocabulary in Qwen2's
//! pipeline, `tests/data`), against plain `tokenizers` as the baseline:
//!
//! * `completion_512/*`: a 512-word completion prompt. `hf_encode` and
//!   `hf_encode_fast` are `tokenizers` alone (the path before the segment
//!   cache); `render_miss` renders a prompt never seen before (unique per
//!   iteration), `render_hit` one rendered before.
//! * `chat/*`: a ~400-word system prompt and a unique ~20-word question
//!   through Qwen2's template. `hf_encode` renders the template and encodes
//!   the whole text with `tokenizers`; `render` is the renderer (the system
//!   prompt's piece comes from the cache, the question is encoded).
//!
//! `cargo bench -p kvroute-prompt --features hf` (pin with `taskset -c 0` on a
//! noisy machine).

use std::hint::black_box;
use std::str::FromStr;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kvroute_prompt::{ChatTemplate, ImageTokenRule, Prompt, Renderer, Tokenizer};
use serde_json::{json, Value};

#[path = "../tests/support/fixtures.rs"]
mod fixtures;

fn setup() -> (tokenizers::Tokenizer, Renderer, ChatTemplate) {
    let json = fixtures::qwen_style().to_string();
    let hf = tokenizers::Tokenizer::from_str(&json).expect("loads");
    let template = || {
        ChatTemplate::new(
            fixtures::QWEN2_TEMPLATE.into(),
            String::new(),
            "<|im_end|>".into(),
        )
        .expect("compiles")
    };
    let tokenizer =
        Tokenizer::from_json(&json, Some(template()), 64 << 20).expect("tokenizer loads");
    let renderer = Renderer::new(tokenizer, ImageTokenRule::fixed(64));
    (hf, renderer, template())
}

fn completion(c: &mut Criterion) {
    let (hf, renderer, _) = setup();
    let text = fixtures::words(1, 512);
    let mut group = c.benchmark_group("completion_512");
    group.bench_function("hf_encode", |b| {
        b.iter(|| hf.encode(black_box(text.as_str()), false).expect("encodes"))
    });
    group.bench_function("hf_encode_fast", |b| {
        b.iter(|| {
            hf.encode_fast(black_box(text.as_str()), false)
                .expect("encodes")
        })
    });
    let mut n = 0u64;
    group.bench_function("render_miss", |b| {
        b.iter_batched(
            || {
                n += 1;
                Value::from(format!("{n} {text}"))
            },
            |prompt| {
                let p = Prompt::completion(Some(&prompt)).expect("valid");
                renderer.render(&p).expect("renders")
            },
            BatchSize::SmallInput,
        )
    });
    let prompt = Value::from(text.clone());
    group.bench_function("render_hit", |b| {
        b.iter(|| {
            let p = Prompt::completion(Some(black_box(&prompt))).expect("valid");
            renderer.render(&p).expect("renders")
        })
    });
    group.finish();
}

fn chat(c: &mut Criterion) {
    let (hf, renderer, template) = setup();
    let system = fixtures::words(2, 400);
    let messages = |n: u64| {
        json!([
            {"role": "system", "content": system},
            {"role": "user", "content": fixtures::words(1000 + n, 20)},
        ])
    };
    let mut group = c.benchmark_group("chat");
    let mut n = 0u64;
    group.bench_function("hf_encode", |b| {
        b.iter_batched(
            || {
                n += 1;
                messages(n)
            },
            |m| {
                let text = template.render(&m, true).expect("renders");
                hf.encode(text.as_str(), false).expect("encodes")
            },
            BatchSize::SmallInput,
        )
    });
    group.bench_function("render", |b| {
        b.iter_batched(
            || {
                n += 1;
                messages(n)
            },
            |m| {
                let p = Prompt::chat(Some(&m)).expect("valid");
                renderer.render(&p).expect("renders")
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, completion, chat);
criterion_main!(benches);
