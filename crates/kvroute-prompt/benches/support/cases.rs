//! The benchmark cases, shared by the system-allocator and mimalloc binaries.

use std::hint::black_box;
use std::str::FromStr;

use criterion::{criterion_group, BatchSize, Criterion};
use kvroute_prompt::{ChatTemplate, ImageTokenRule, Prompt, Renderer, Tokenizer};
use serde_json::{json, Value};

use crate::fixtures;

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

/// A completion prompt rendered from its `prompt` value.
fn render_completion(renderer: &Renderer, prompt: &Value) -> usize {
    let p = Prompt::completion(Some(prompt)).expect("valid");
    renderer.render(&p).expect("renders").tokens.len()
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
                Value::from(format!("{n} {}", fixtures::words(n, 512)))
            },
            |prompt| render_completion(&renderer, &prompt),
            BatchSize::SmallInput,
        )
    });
    let prompt = Value::from(text.clone());
    group.bench_function("render_hit", |b| {
        b.iter(|| render_completion(&renderer, black_box(&prompt)))
    });
    // The first 400 words were rendered before; the last 112 are new.
    let prefix = fixtures::words(7, 400);
    render_completion(&renderer, &Value::from(prefix.clone()));
    group.bench_function("render_shared_prefix", |b| {
        b.iter_batched(
            || {
                n += 1;
                Value::from(format!("{prefix} {}", fixtures::words(n, 112)))
            },
            |prompt| render_completion(&renderer, &prompt),
            BatchSize::SmallInput,
        )
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
                renderer.render(&p).expect("renders").tokens.len()
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, completion, chat);
