//! Plain HTTP/1.1 over a socket: no client library between the test and the
//! server's bytes.

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

    /// The body's JSON object (around any SSE or chunked framing).
    pub fn json(&self) -> Value {
        json_in(&self.body)
    }
}

/// The JSON object in `raw`: the part between its outer braces (bodies may
/// be chunked or framed as SSE).
pub fn json_in(raw: &str) -> Value {
    let start = raw.find('{').expect("a JSON object");
    let end = raw.rfind('}').expect("a JSON object");
    serde_json::from_str(&raw[start..=end]).expect("valid JSON")
}

/// Opens a connection and writes one request with `headers` (`Connection:
/// close`); the socket is the caller's to read.
pub fn send_with(
    host_port: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> TcpStream {
    let mut s = connect(host_port);
    write_request(&mut s, host_port, method, path, headers, body);
    s
}

/// A connection to `host_port` with a 30 s read timeout.
pub fn connect(host_port: &str) -> TcpStream {
    let s = TcpStream::connect(host_port).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    s
}

/// Writes one request with `headers` (`Connection: close`) on `s`.
pub fn write_request(
    s: &mut TcpStream,
    host_port: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) {
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    // A refused oversized body may not be read in full: write errors are the server's answer.
    let _ = write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
}

/// [`send_with`] without extra headers.
pub fn send(host_port: &str, method: &str, path: &str, body: &str) -> TcpStream {
    send_with(host_port, method, path, &[], body)
}

/// One request with `headers`, read to the end.
pub fn request_with(
    host_port: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    read_reply(send_with(host_port, method, path, headers, body))
}

/// The answer on `s`, read to the end.
pub fn read_reply(mut s: TcpStream) -> Reply {
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

/// The body of a `Transfer-Encoding: chunked` answer without its framing,
/// and whether it ended properly (with the zero-size chunk); what follows a
/// malformed or cut-off chunk is left out.
pub fn dechunk(mut raw: &[u8]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = raw.windows(2).position(|w| w == b"\r\n") else {
            return (out, false);
        };
        let size = std::str::from_utf8(&raw[..line_end])
            .ok()
            .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok());
        let Some(size) = size else {
            return (out, false);
        };
        raw = &raw[line_end + 2..];
        if size == 0 {
            return (out, true);
        }
        let Some(chunk) = raw.get(..size) else {
            out.extend_from_slice(raw);
            return (out, false);
        };
        out.extend_from_slice(chunk);
        raw = raw.get(size + 2..).unwrap_or_default();
    }
}

/// One request, read to the end.
pub fn request(host_port: &str, method: &str, path: &str, body: &str) -> Reply {
    request_with(host_port, method, path, &[], body)
}

/// The sum of every sample of metric `name` (any labels) in the router's
/// `/metrics`, or `None` if it exports none.
pub fn metric(host_port: &str, name: &str) -> Option<f64> {
    metric_where(host_port, name, "")
}

/// [`metric`] over the samples whose labels contain `label` (for example
/// `worker="w0"`).
pub fn metric_where(host_port: &str, name: &str, label: &str) -> Option<f64> {
    let text = request(host_port, "GET", "/metrics", "").body;
    let samples: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => {
                    let (labels, value) = labelled.rsplit_once('}')?;
                    labels.contains(label).then_some(value)?
                }
                None if label.is_empty() => rest.strip_prefix(' ')?,
                None => return None,
            };
            value.split_whitespace().next()?.parse().ok()
        })
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum())
}

/// A counter's total over its label sets (0 when the router exports none).
pub fn count(host_port: &str, name: &str) -> u64 {
    metric(host_port, name).unwrap_or(0.0) as u64
}
