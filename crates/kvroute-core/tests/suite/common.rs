//! Helpers shared by the core's integration tests.
#![allow(dead_code, missing_docs)]

use std::path::PathBuf;

/// The directory of golden payloads (copied from the engines' own encoders).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
}

/// Parses lowercase hex (no separators) into bytes.
pub fn parse_hex(text: &str) -> Vec<u8> {
    let text = text.trim();
    assert!(text.len().is_multiple_of(2), "odd hex length");
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex digit"))
        .collect()
}

/// The payload of a `.hex` fixture (line 1 is a `#` comment, line 2 the payload).
pub fn fixture_payload(name: &str) -> Vec<u8> {
    let text = std::fs::read_to_string(fixtures_dir().join(format!("{name}.hex")))
        .expect("fixture exists");
    let line = text
        .lines()
        .find(|l| !l.starts_with('#'))
        .expect("payload line");
    parse_hex(line)
}

/// The JSON view of a fixture.
pub fn fixture_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures_dir().join(format!("{name}.json")))
        .expect("fixture exists");
    serde_json::from_str(&text).expect("valid json")
}

/// Every fixture's name.
pub fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("fixtures dir")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".hex"))
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    names
}

/// The core's msgpack writer, under the short name the tests use.
pub use kvroute_core::wire::write as mp;
