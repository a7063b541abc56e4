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
    assert!(text.len() % 2 == 0, "odd hex length");
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

/// A small deterministic generator (xorshift64*), so randomized tests need no seed crate.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

/// A minimal msgpack writer for hand-built payloads.
pub mod mp {
    pub fn array(out: &mut Vec<u8>, len: usize) {
        if len < 16 {
            out.push(0x90 | len as u8);
        } else if len <= u16::MAX as usize {
            out.push(0xdc);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            out.push(0xdd);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }

    pub fn map(out: &mut Vec<u8>, len: usize) {
        assert!(len < 16);
        out.push(0x80 | len as u8);
    }

    pub fn str(out: &mut Vec<u8>, s: &str) {
        let b = s.as_bytes();
        if b.len() < 32 {
            out.push(0xa0 | b.len() as u8);
        } else {
            out.push(0xd9);
            out.push(b.len() as u8);
        }
        out.extend_from_slice(b);
    }

    pub fn uint(out: &mut Vec<u8>, v: u64) {
        if v < 128 {
            out.push(v as u8);
        } else if v <= u8::MAX as u64 {
            out.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u16::MAX as u64 {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u32::MAX as u64 {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn int(out: &mut Vec<u8>, v: i64) {
        if v >= 0 {
            uint(out, v as u64);
        } else {
            out.push(0xd3);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    pub fn bin(out: &mut Vec<u8>, b: &[u8]) {
        out.push(0xc4);
        out.push(b.len() as u8);
        out.extend_from_slice(b);
    }

    pub fn f64(out: &mut Vec<u8>, v: f64) {
        out.push(0xcb);
        out.extend_from_slice(&v.to_be_bytes());
    }

    pub fn uints(out: &mut Vec<u8>, values: &[u64]) {
        array(out, values.len());
        for &v in values {
            uint(out, v);
        }
    }
}
