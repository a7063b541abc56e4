//! The fast text path (cuts at added tokens and, for byte-level BPE, between
//! words; the lean byte-level encoder; the segment cache) gives exactly the
//! ids of `tokenizers::Tokenizer::encode(whole_text, false)`, on real
//! tokenizer files (see `tests/data/README.md`) in the configurations their
//! models ship with: byte-level BPE (GPT-2 as shipped; GPT-2's vocabulary
//! with Qwen2's pre-tokenizer, NFC and ChatML specials) and SentencePiece-style
//! BPE (Mistral 7B as shipped, with the `Prepend("▁")` normaliser; and with
//! the `Metaspace` `prepend_scheme: "first"` pre-tokenizer that current
//! conversions write), plus one configuration whose cuts cannot be proved
//! (an `lstrip` token), where the whole text is encoded.
//!
//! Texts: random chats rendered through each model family's chat template,
//! texts with added tokens at odd places (start, end, doubled, inside words,
//! truncated), unicode (combining marks, CJK, emoji, ZWJ), whitespace runs,
//! long prompts sharing prefixes, and every kind of character around a cut
//! between words. Each text is encoded twice, the second time from the cache.

#![cfg(feature = "hf")]

use std::str::FromStr;

#[path = "support/fixtures.rs"]
mod fixtures;

use fixtures::{added, fixture, mistral_first, qwen_style, MISTRAL_TEMPLATE, QWEN2_TEMPLATE};
use kvroute_core::rng::SplitMix64;
use kvroute_prompt::{ChatTemplate, Tokenizer};
use serde_json::{json, Value};

/// One tokenizer configuration under test.
struct Case {
    name: &'static str,
    json: Value,
    template: ChatTemplate,
    /// The added tokens to sprinkle into texts.
    specials: Vec<&'static str>,
    /// Whether cutting is expected to be provable.
    cuts: bool,
    /// Whether long pieces are expected to be cut between words too.
    words: bool,
    /// Chats alternate user and assistant (Mistral's template demands it).
    alternating: bool,
}

fn cases() -> Vec<Case> {
    let gpt2 = fixture("gpt2");
    let qwen_style = qwen_style();
    let mistral = fixture("mistral");
    let mistral_first = mistral_first();
    let mut mistral_lstrip = mistral.clone();
    if let Some(list) = mistral_lstrip["added_tokens"].as_array_mut() {
        let mut mask = added(5, "<mask>", false);
        mask["lstrip"] = true.into();
        list.push(mask);
    }
    let chatml = || ChatTemplate::new(QWEN2_TEMPLATE.into(), String::new(), "<|im_end|>".into());
    let llama = || ChatTemplate::new(MISTRAL_TEMPLATE.into(), "<s>".into(), "</s>".into());
    let template = |t: Result<ChatTemplate, _>| t.expect("template compiles");
    vec![
        Case {
            name: "gpt2",
            json: gpt2,
            template: template(chatml()),
            specials: vec!["<|endoftext|>", "<|im_start|>"],
            cuts: true,
            words: true,
            alternating: false,
        },
        Case {
            name: "gpt2-vocab, qwen2 pipeline",
            json: qwen_style,
            template: template(chatml()),
            specials: vec!["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            cuts: true,
            words: true,
            alternating: false,
        },
        Case {
            name: "mistral (Prepend normaliser)",
            json: mistral,
            template: template(llama()),
            specials: vec!["<s>", "</s>", "<unk>"],
            cuts: true,
            words: false,
            alternating: true,
        },
        Case {
            name: "mistral (Metaspace prepend_scheme first)",
            json: mistral_first,
            template: template(llama()),
            specials: vec!["<s>", "</s>", "[INST]", "[/INST]"],
            cuts: true,
            words: false,
            alternating: true,
        },
        Case {
            name: "mistral with an lstrip token (whole text)",
            json: mistral_lstrip,
            template: template(llama()),
            specials: vec!["<s>", "</s>", "<mask>"],
            cuts: false,
            words: false,
            alternating: true,
        },
    ]
}

const WORDS: &[&str] = &[
    "the",
    "router",
    "cache",
    "Hello",
    "world",
    "KV",
    "blocks",
    "don't",
    "it's",
    "we'll",
    "1234567",
    "3.14159",
    "naïve",
    "café",
    "e\u{301}",
    "Ünïcödé",
    "日本語",
    "中文文本",
    "한국어",
    "😀",
    "👩\u{200d}💻",
    "🦙",
    "مرحبا",
    "Привет",
    "x86_64",
    "<html>",
    "a+b=c",
    "$100",
    "--flag",
    "snake_case",
    "CamelCase",
    "URL:https://x.invalid/a?b=c",
    "\u{a0}",
    "tab\tbed",
    "▁",
];

const GAPS: &[&str] = &[
    " ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "",
];

fn pick<'a>(rng: &mut SplitMix64, items: &[&'a str]) -> &'a str {
    items[rng.below(items.len())]
}

/// Random prose: words, punctuation, whitespace runs.
fn prose(rng: &mut SplitMix64, words: usize) -> String {
    let mut out = String::new();
    if rng.below(4) == 0 {
        out.push_str(pick(rng, GAPS));
    }
    for i in 0..words {
        if i > 0 {
            out.push_str(pick(rng, GAPS));
        }
        out.push_str(pick(rng, WORDS));
        if rng.below(6) == 0 {
            out.push_str(pick(
                rng,
                &[",", ".", "!", "?", ";", ":", "'", "\"", "...", ")"],
            ));
        }
    }
    if rng.below(4) == 0 {
        out.push_str(pick(rng, GAPS));
    }
    out
}

/// Prose with added tokens at odd places: first, last, doubled, glued to
/// words, and truncated copies that must stay text.
fn with_specials(rng: &mut SplitMix64, specials: &[&str], words: usize) -> String {
    let mut out = String::new();
    for _ in 0..1 + rng.below(6) {
        let special = pick(rng, specials);
        match rng.below(6) {
            0 => out.push_str(special),
            1 => {
                out.push_str(special);
                out.push_str(special);
            }
            2 => out.push_str(&special[..special.len() - 1]),
            3 => out.push(' '),
            _ => {}
        }
        let n = 1 + rng.below(words);
        out.push_str(&prose(rng, n));
        if rng.below(2) == 0 {
            out.push_str(special);
        }
    }
    out
}

/// A random chat rendered through the case's template.
fn chat(rng: &mut SplitMix64, case: &Case, systems: &[String]) -> String {
    let mut messages = Vec::new();
    if !case.alternating && rng.below(3) > 0 {
        messages.push(json!({"role": "system", "content": systems[rng.below(systems.len())]}));
    }
    let turns = 1 + rng.below(4);
    for t in 0..turns {
        let content = if rng.below(5) == 0 {
            with_specials(rng, &case.specials, 8)
        } else {
            let n = 1 + rng.below(40);
            prose(rng, n)
        };
        messages.push(json!({"role": "user", "content": content}));
        if t + 1 < turns {
            let n = 1 + rng.below(20);
            messages.push(json!({"role": "assistant", "content": prose(rng, n)}));
        }
    }
    if case.alternating && !systems.is_empty() && rng.below(2) == 0 {
        // A long shared first question, as a system prompt would be.
        messages[0]["content"] = Value::from(systems[rng.below(systems.len())].clone());
    }
    case.template
        .render(&Value::Array(messages), true)
        .expect("the template renders")
}

fn texts(case: &Case, seed: u64) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    let systems: Vec<String> = (0..3).map(|_| prose(&mut rng, 120)).collect();
    let mut out: Vec<String> = Vec::new();
    for _ in 0..60 {
        out.push(chat(&mut rng, case, &systems));
    }
    for _ in 0..60 {
        out.push(with_specials(&mut rng, &case.specials, 12));
    }
    for _ in 0..30 {
        let n = 1 + rng.below(60);
        out.push(prose(&mut rng, n));
    }
    for special in &case.specials {
        out.push((*special).to_owned());
        out.push(format!("{special}{special}"));
        out.push(format!(" {special} "));
        out.push(format!("a{special}b"));
        out.push(format!("{special}\n"));
        out.push(format!("\n{special}"));
    }
    out.extend(
        [
            "",
            " ",
            "  ",
            "\n",
            "\t\t",
            " \n\n ",
            "e\u{301}",
            "😀",
            "   leading",
            "trailing   ",
        ]
        .map(String::from),
    );
    out
}

#[test]
fn the_fast_path_matches_hugging_face_on_every_text() {
    for case in cases() {
        let json = case.json.to_string();
        let reference = tokenizers::Tokenizer::from_str(&json).expect("reference loads");
        let fast = Tokenizer::from_json(&json, None, 8 << 20).expect("loads");
        let path = fast.text_path().expect("a Hugging Face tokenizer");
        assert_eq!(
            path.whole_text_reason.is_none(),
            case.cuts,
            "{}: {path:?}",
            case.name
        );
        // The byte-level pipelines take the word cuts and the lean encoder.
        assert_eq!(path.between_words, case.words, "{}", case.name);
        assert_eq!(path.lean_byte_level, case.words, "{}", case.name);
        assert!(path.cached);
        let texts = texts(&case, 0x5eed);
        // Twice: the second round is answered from the cache.
        for round in 0..2 {
            for text in &texts {
                let expected: Vec<u64> = reference
                    .encode(text.as_str(), false)
                    .expect("reference encodes")
                    .get_ids()
                    .iter()
                    .map(|&id| u64::from(id))
                    .collect();
                let got = fast.encode(text).expect("fast path encodes");
                assert_eq!(got, expected, "{} (round {round}): {text:?}", case.name);
            }
        }
        let stats = fast.cache_stats().expect("a cache");
        assert!(stats.hits > stats.misses, "{}: {stats:?}", case.name);
    }
}

#[test]
fn a_piece_cached_at_the_start_is_not_reused_elsewhere_under_metaspace_first() {
    let case = cases().swap_remove(3);
    let json = case.json.to_string();
    let reference = tokenizers::Tokenizer::from_str(&json).expect("reference loads");
    let fast = Tokenizer::from_json(&json, None, 1 << 20).expect("loads");
    let ids = |text: &str| -> Vec<u64> {
        let e = reference.encode(text, false).expect("encodes");
        e.get_ids().iter().map(|&id| u64::from(id)).collect()
    };
    // "Hello" first gets the `▁` prefix; after `<s>` it must not.
    assert_eq!(fast.encode("Hello").expect("encodes"), ids("Hello"));
    assert_eq!(fast.encode("<s>Hello").expect("encodes"), ids("<s>Hello"));
    assert_eq!(
        fast.encode("Hello<s>Hello").expect("encodes"),
        ids("Hello<s>Hello")
    );
    assert_ne!(
        ids("Hello")[..],
        ids("<s>Hello")[1..],
        "the scheme matters here"
    );
}

/// The fixtures give the real models' ids (GPT-2's well-known ids; Mistral's
/// from mistral-tokenizer-js's own test cases, with `<s>` added).
#[test]
fn the_fixtures_reproduce_the_models_ids() {
    let gpt2 = tokenizers::Tokenizer::from_str(&fixture("gpt2").to_string()).expect("loads");
    let ids = |t: &tokenizers::Tokenizer, text: &str, special: bool| -> Vec<u32> {
        t.encode(text, special).expect("encodes").get_ids().to_vec()
    };
    assert_eq!(ids(&gpt2, "Hello world", false), [15496, 995]);
    assert_eq!(ids(&gpt2, "Hello, world!", false), [15496, 11, 995, 0]);
    assert_eq!(ids(&gpt2, "<|endoftext|>", false), [50256]);
    let mistral = tokenizers::Tokenizer::from_str(&fixture("mistral").to_string()).expect("loads");
    assert_eq!(ids(&mistral, "grabbed", true), [1, 13300]);
    assert_eq!(ids(&mistral, " grabbed", true), [1, 28705, 13300]);
    assert_eq!(ids(&mistral, "           grabbed", true), [1, 17422, 13300]);
    assert_eq!(ids(&mistral, "\n", true), [1, 28705, 13]);
    assert_eq!(
        ids(&mistral, "🦙Ꙋ", true),
        [1, 28705, 243, 162, 169, 156, 237, 156, 141]
    );
    assert_eq!(
        ids(&mistral, "ax\n####\nboo", true),
        [1, 6056, 13, 2000, 13, 1798, 28709]
    );
}

/// The whole router path: chat messages as JSON, through the model's
/// template and the renderer, give the ids `tokenizers` gives the rendered
/// text; from several threads sharing one renderer (and its cache).
#[test]
fn rendered_chats_match_hugging_face_from_many_threads() {
    use kvroute_prompt::{ImageTokenRule, Prompt, Renderer};
    let json = qwen_style().to_string();
    let reference = tokenizers::Tokenizer::from_str(&json).expect("reference loads");
    let template = || {
        ChatTemplate::new(QWEN2_TEMPLATE.into(), String::new(), "<|im_end|>".into())
            .expect("template compiles")
    };
    let tokenizer = Tokenizer::from_json(&json, Some(template()), 1 << 20).expect("loads");
    let renderer = Renderer::new(tokenizer, ImageTokenRule::fixed(4));
    let system = fixtures::words(3, 300);
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let (renderer, reference, system) = (&renderer, &reference, &system);
            scope.spawn(move || {
                let template = template();
                for turn in 0..40u64 {
                    let messages = json!([
                        {"role": "system", "content": system},
                        {"role": "user", "content": fixtures::words(thread * 100 + turn % 7, 30)},
                        {"role": "assistant", "content": fixtures::words(turn, 10)},
                        {"role": "user", "content": fixtures::words(thread * 1000 + turn, 12)},
                    ]);
                    let got = renderer
                        .render(&Prompt::chat(Some(&messages)).expect("valid"))
                        .expect("renders");
                    let text = template.render(&messages, true).expect("renders");
                    let expected: Vec<u64> = reference
                        .encode(text.as_str(), false)
                        .expect("encodes")
                        .get_ids()
                        .iter()
                        .map(|&id| u64::from(id))
                        .collect();
                    assert_eq!(got.tokens, expected, "thread {thread} turn {turn}");
                    assert!(got.images.is_empty());
                }
            });
        }
    });
    let stats = renderer.tokenizer().cache_stats().expect("a cache");
    assert!(stats.hits > stats.misses, "{stats:?}");
}
