//! Repeated images on real vision-language engines: two serving the
//! project's tiny Qwen2-VL (random weights) on vLLM's CPU build, behind a
//! router given no `--tokenizer`. The router finds the model's tokenizer and image
//! placeholders in its root, asks the engine's `/tokenize` for a chat's
//! image spans (the processor decides how many positions an image takes),
//! and names each image as vLLM does (BLAKE3 of its bytes and the model's
//! folder), so its prediction of each answer's cached tokens is the
//! engine's own, a repeated image goes to the engine holding it and hits,
//! and a different image with the same text does not.

use kvroute_core::rng::SplitMix64;
use kvroute_loadgen::image::png_data_url;
use serde_json::{json, Value};

use super::bed::{ask, decode_errors, tokens, vlm_bed, words, Answer, Bed};
use crate::support::http;

/// The tiny model's image placeholder id (`<|image_pad|>`).
const IMAGE_PAD: u64 = 6;

/// A 128×128 PNG of seeded random pixels (25 positions after Qwen2-VL's
/// resize to 140×140).
fn image(seed: u64) -> String {
    png_data_url(&mut SplitMix64::new(seed), 128)
}

/// A chat of one user turn: 60 words, the images, 200 words.
fn chat(bed: &Bed, before: u32, images: &[&str], after: u32) -> Value {
    let mut content = vec![json!({"type": "text", "text": words(&tokens(before, 60))})];
    content.extend(
        images
            .iter()
            .map(|url| json!({"type": "image_url", "image_url": {"url": url}})),
    );
    content.push(json!({"type": "text", "text": words(&tokens(after, 200))}));
    json!({
        "model": bed.served,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": content}],
    })
}

/// The position of the first image placeholder in the engine's own
/// tokens of `body`'s chat.
fn first_image_position(bed: &Bed, body: &Value) -> usize {
    let ask = json!({"model": bed.served, "messages": body["messages"]});
    let reply = http::request(bed.engines[0].addr(), "POST", "/tokenize", &ask.to_string());
    assert_eq!(reply.status, 200, "/tokenize: {}", reply.body);
    reply.json()["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .position(|t| t.as_u64() == Some(IMAGE_PAD))
        .expect("the chat's image is in the engine's tokens")
}

#[test]
fn repeated_images_hit_and_are_predicted_exactly_on_a_real_vision_language_engine() {
    let (_serial, bed) = vlm_bed();
    let (_router, serve) = bed.router(&[]);
    let (a, b, c) = (image(1), image(2), image(3));
    // (body, whether the same chat was answered before)
    let script: Vec<(Value, bool)> = vec![
        (chat(&bed, 100, &[&a], 300), false),
        (chat(&bed, 100, &[&a], 300), true),
        (chat(&bed, 100, &[&b], 300), false),
        (chat(&bed, 100, &[&b], 300), true),
        (chat(&bed, 100, &[&a], 300), true),
        (chat(&bed, 700, &[&c], 900), false),
        (chat(&bed, 700, &[&c], 900), true),
        (chat(&bed, 1_300, &[&a, &b], 1_500), false),
        (chat(&bed, 1_300, &[&a, &b], 1_500), true),
        (chat(&bed, 1_300, &[&b, &a], 1_500), false),
        (chat(&bed, 1_300, &[&b, &a], 1_500), true),
    ];
    let mut answers: Vec<(bool, Answer)> = Vec::new();
    for (body, repeat) in &script {
        bed.caught_up(&serve);
        answers.push((*repeat, ask(&serve, "/v1/chat/completions", body)));
    }
    let line = |(i, (repeat, a)): (usize, &(bool, Answer))| {
        format!(
            "#{i}{} on {}: cached {} of {}, predicted {}",
            if *repeat { " (repeat)" } else { "" },
            a.worker,
            a.cached,
            a.prompt_tokens,
            a.predicted
        )
    };
    let report: Vec<String> = answers.iter().enumerate().map(line).collect();
    let (cached, prompt) = answers
        .iter()
        .filter(|(repeat, _)| *repeat)
        .fold((0, 0), |(c, p), (_, a)| (c + a.cached, p + a.prompt_tokens));
    let exact = answers.iter().filter(|(_, a)| a.exact).count();
    eprintln!(
        "images on a real VLM: repeats cached {cached} of {prompt} prompt tokens ({:.3}); \
         predictions exact on {exact} of {}; {}",
        cached as f64 / prompt.max(1) as f64,
        answers.len(),
        report.join("; ")
    );
    assert!(
        cached as f64 >= 0.9 * prompt as f64,
        "repeats hit: {}",
        report.join("; ")
    );
    assert_eq!(
        exact,
        answers.len(),
        "every prediction is the engine's cached_tokens: {}",
        report.join("; ")
    );
    // Image B after image A with the same text: only the blocks before the
    // image are the same (so the engine and the router agree B is not A).
    let before_image = first_image_position(&bed, &script[2].0);
    let b_first = &answers[2].1;
    assert!(
        b_first.cached as usize <= before_image && b_first.cached > 0,
        "a different image with the same text hits only its text prefix (≤ {before_image}): {}",
        report.join("; ")
    );
    // Each repeat went where its chat was answered before.
    for (i, (body, repeat)) in script.iter().enumerate() {
        let first = script.iter().position(|(b, _)| b == body).expect("itself");
        assert!(
            !repeat || answers[i].1.worker == answers[first].1.worker,
            "#{i} went to the engine holding its images: {}",
            report.join("; ")
        );
    }
    assert_eq!(decode_errors(&serve), 0);
}
