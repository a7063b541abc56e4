//! The real tokenizer files of `tests/data` and the configurations derived
//! from them, shared by the parity tests and the benchmarks.

#![allow(dead_code)]

use std::io::Read;

use serde_json::{json, Value};

/// Qwen2's chat template, as its `tokenizer_config.json` ships it.
pub const QWEN2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Mistral 7B Instruct v0.1's chat template.
pub const MISTRAL_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

/// Qwen2's pre-tokenizer regex.
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tests/data/{name}.tokenizer.json.gz`, parsed.
pub fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/data/{name}.tokenizer.json.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    let file = std::fs::File::open(&path).expect("fixture present");
    let mut json = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut json)
        .expect("gzip");
    serde_json::from_str(&json).expect("json")
}

/// An added-token entry of a `tokenizer.json`.
pub fn added(id: usize, content: &str, normalized: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false,
           "rstrip": false, "normalized": normalized, "special": true})
}

/// GPT-2's vocabulary in Qwen2's pipeline: NFC, Qwen2's split regex, byte
/// level without regex, and the ChatML specials as added tokens.
pub fn qwen_style() -> Value {
    let mut json = fixture("gpt2");
    let base = json["model"]["vocab"].as_object().map_or(0, |v| v.len());
    json["added_tokens"] = json!([
        added(base - 1, "<|endoftext|>", false),
        added(base, "<|im_start|>", false),
        added(base + 1, "<|im_end|>", false),
    ]);
    json["normalizer"] = json!({"type": "NFC"});
    json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
    ]});
    json
}

/// Mistral's vocabulary with the pre-tokenizer current conversions write
/// (`Metaspace`, `prepend_scheme: "first"`, no normaliser) and `[INST]`
/// specials.
pub fn mistral_first() -> Value {
    let mut json = fixture("mistral");
    json["normalizer"] = Value::Null;
    json["pre_tokenizer"] =
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false});
    if let Some(list) = json["added_tokens"].as_array_mut() {
        list.push(added(3, "[INST]", false));
        list.push(added(4, "[/INST]", false));
    }
    json
}

/// English-like prose of `words` words from a fixed list, varied by `seed`.
pub fn words(seed: u64, words: usize) -> String {
    const LIST: &[&str] = &[
        "the",
        "router",
        "sends",
        "each",
        "request",
        "to",
        "a",
        "worker",
        "whose",
        "cache",
        "already",
        "holds",
        "its",
        "prefix",
        "blocks",
        "so",
        "prefill",
        "is",
        "shorter",
        "and",
        "latency",
        "drops",
        "when",
        "many",
        "users",
        "share",
        "system",
        "prompts",
        "or",
        "documents",
        "of",
        "long",
        "context",
        "models",
        "tokens",
        "hashes",
        "engines",
        "publish",
        "events",
        "over",
        "sockets",
        "which",
        "index",
        "reads",
        "quickly",
        "while",
        "serving",
        "thousands",
        "per",
        "second",
        "with",
        "care",
        "for",
        "fairness",
        "load",
        "queues",
        "batches",
        "memory",
        "bandwidth",
        "attention",
        "kernels",
        "GPUs",
        "clusters",
        "nodes",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::new();
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(if i % 17 == 0 { '\n' } else { ' ' });
        }
        out.push_str(LIST[(x % LIST.len() as u64) as usize]);
        if i % 11 == 10 {
            out.push(if i % 3 == 0 { ',' } else { '.' });
        }
    }
    out
}
