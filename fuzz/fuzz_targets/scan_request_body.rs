//! The router's request-body scanner (`kvroute_prompt::body`), fed any bytes:
//! it never panics, reads every body exactly as serde's derive does (the
//! one-pass scan is an optimisation, never a second opinion), and a body it
//! accepts keeps its token ids folded and its output budget within what it
//! read. SGLang's native `/generate` reader gets the same bytes: it never
//! panics, and a body it accepts holds ids or text, never both. So do the
//! Responses and Anthropic Messages readers, and the chat messages they
//! convert a body into always pass the chat prompt's own checks (what the
//! router reads, the mock engine renders). The shape reader
//! (`kvroute_prompt::shape`, which the router runs on large bodies before
//! parsing them) never panics, has a shape exactly for one valid JSON
//! document, and counts at least the messages the chat reader keeps. Seeds:
//! `fuzz/corpus/scan_request_body` (see docs/fuzzing.md).
#![no_main]

use kvroute_prompt::body::{parse_query, parse_request, parse_request_by_serde, TextPrompt};
use kvroute_prompt::Prompt;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let shape = kvroute_prompt::shape::shape(data);
    // Valid as a parse reads it (strings in UTF-8: serde's IgnoredAny
    // skips strings without checking them).
    let valid = serde_json::from_slice::<serde_json::Value>(data).is_ok();
    assert_eq!(shape.is_some(), valid, "a shape exactly for valid JSON");
    if let (Ok(req), Some(shape)) = (parse_request(data, true), shape) {
        if let Some(TextPrompt::Chat(serde_json::Value::Array(messages))) = &req.text {
            assert!(shape.prompt_parts >= messages.len(), "every message counted");
            assert!(shape.values > messages.len(), "every value counted");
        }
    }
    for chat in [false, true] {
        let scanned = parse_request(data, chat);
        let reference = parse_request_by_serde(data, chat);
        assert_eq!(scanned, reference, "the scan and serde disagree");
        if let Ok(req) = &scanned {
            assert!(
                req.tokens.is_none() || req.text.is_none(),
                "ids or text, not both"
            );
            if let Some(tokens) = &req.tokens {
                assert!(!tokens.is_empty() || chat, "an empty prompt is refused");
            }
        }
    }
    let _ = parse_query(data);
    if let Ok(req) = kvroute_prompt::generate::parse_generate(data) {
        assert!(
            req.tokens.is_none() || req.text.is_none(),
            "ids or text, not both"
        );
    }
    for parse in [
        kvroute_prompt::responses::parse_responses,
        kvroute_prompt::messages::parse_messages,
    ] {
        if let Ok(req) = parse(data) {
            assert!(req.tokens.is_none(), "converted bodies are text");
            if let Some(TextPrompt::Chat(messages)) = &req.text {
                assert!(
                    Prompt::chat(Some(messages)).is_ok(),
                    "converted messages render"
                );
            }
        }
    }
});
