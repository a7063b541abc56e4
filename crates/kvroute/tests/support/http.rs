//! Plain HTTP/1.1 over a socket for end-to-end tests: no client library
//! between the test and the server's bytes (included with `#[path]`).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// A response: status, lower-cased header block, body.
pub struct Reply {
    /// The status code (0 when none was read).
    pub status: u16,
    /// The header block, lower-cased.
    pub headers: String,
    /// The body as text.
    pub body: String,
}

impl Reply {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<String> {
        let prefix = format!("{}:", name.to_ascii_lowercase());
        self.headers
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_owned()))
    }

    /// The body's JSON object (around any SSE framing).
    pub fn json(&self) -> Value {
        let start = self.body.find('{').expect("a JSON object");
        let end = self.body.rfind('}').expect("a JSON object");
        serde_json::from_str(&self.body[start..=end]).expect("valid JSON")
    }
}

pub fn send(host_port: &str, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(host_port).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    // A refused oversized body may not be read in full: write errors are the server's answer.
    let _ = write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s
}

pub fn request(host_port: &str, method: &str, path: &str, body: &str) -> Reply {
    let mut s = send(host_port, method, path, body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let out = String::from_utf8_lossy(&raw).into_owned();
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (headers, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    Reply {
        status,
        headers: headers.to_ascii_lowercase(),
        body: body.to_owned(),
    }
}

/// [`super::fleet::spawn_serve`], then waits until every worker's every rank
/// is connected.
pub fn start_serve(lines: &[String], extra: &[&str]) -> (super::fleet::Proc, String) {
    let (proc, serve) = super::fleet::spawn_serve(lines, extra);
    let expected = lines.len();
    super::fleet::eventually("serve up with every rank connected", || {
        TcpStream::connect(&serve).is_ok() && {
            let doc = request(&serve, "GET", "/workers", "").json();
            let list = doc["workers"].as_array().cloned().unwrap_or_default();
            list.len() == expected
                && list.iter().all(|w| {
                    w["ranks"]
                        .as_array()
                        .is_some_and(|r| r.iter().all(|r| r["connected"] == true))
                })
        }
    });
    (proc, serve)
}
