//! A small HTTP/1.1 client for what one engine asks another: a decode engine
//! telling a vLLM prefill it read its blocks, and waiting on an SGLang
//! prefill's bootstrap room.
//!
//! One request per connection (`Connection: close`), the whole exchange
//! under a timeout, and the answer bounded by [`MAX_RESPONSE`]: the peers
//! are other mock engines, their answers small JSON documents.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response accepted (headers and body).
pub const MAX_RESPONSE: usize = 4 * 1024 * 1024;

/// A response: its status and its (de-chunked) body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerResponse {
    /// The status code.
    pub status: u16,
    /// The body.
    pub body: Vec<u8>,
}

/// Why a peer gave no usable answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// The connection or the exchange failed.
    #[error("{addr}: {source}")]
    Io {
        /// `host:port`.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No complete answer within the timeout.
    #[error("{addr} did not answer within {timeout:?}")]
    Timeout {
        /// `host:port`.
        addr: String,
        /// The timeout.
        timeout: Duration,
    },
    /// The answer is not HTTP/1.1 as understood here, or too large.
    #[error("{addr} sent an unusable answer: {detail}")]
    Malformed {
        /// `host:port`.
        addr: String,
        /// What is wrong.
        detail: String,
    },
}

/// `host` without the brackets of an IPv6 literal, and the `Host` header value.
fn authority(host: &str, port: u16) -> (&str, String) {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let header = if bare.contains(':') {
        format!("[{bare}]:{port}")
    } else {
        format!("{bare}:{port}")
    };
    (bare, header)
}

/// One exchange: `method path` with an optional JSON body, answered within `timeout`.
pub async fn call(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<PeerResponse, PeerError> {
    let (bare, addr) = authority(host, port);
    let exchange = async {
        let io = |source| PeerError::Io {
            addr: addr.clone(),
            source,
        };
        let mut stream = TcpStream::connect((bare, port)).await.map_err(io)?;
        let _ = stream.set_nodelay(true);
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: application/json\r\n"
        );
        if let Some(body) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await.map_err(io)?;
        if let Some(body) = body {
            stream.write_all(body).await.map_err(io)?;
        }
        let mut raw = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = stream.read(&mut chunk).await.map_err(io)?;
            if n == 0 {
                break;
            }
            if raw.len() + n > MAX_RESPONSE {
                return Err(malformed(&addr, format!("more than {MAX_RESPONSE} bytes")));
            }
            raw.extend_from_slice(&chunk[..n]);
        }
        parse_response(&raw).map_err(|detail| malformed(&addr, detail))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err(PeerError::Timeout { addr, timeout }),
    }
}

fn malformed(addr: &str, detail: impl Into<String>) -> PeerError {
    PeerError::Malformed {
        addr: addr.to_owned(),
        detail: detail.into(),
    }
}

/// Parses a whole response read until the peer closed the connection.
fn parse_response(raw: &[u8]) -> Result<PeerResponse, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .filter(|l| l.starts_with("HTTP/1."))
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or("no status line")?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().map_err(|_| "bad Content-Length")?);
        }
    }
    let rest = &raw[split + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        match length {
            Some(n) => rest
                .get(..n)
                .ok_or("body shorter than Content-Length")?
                .to_vec(),
            None => rest.to_vec(),
        }
    };
    Ok(PeerResponse { status, body })
}

/// The body of a `Transfer-Encoding: chunked` message.
fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("no chunk size")?;
        let size_text = std::str::from_utf8(&b[..line_end]).map_err(|_| "bad chunk size")?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| "bad chunk size")?;
        b = &b[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = b.get(..size).ok_or("truncated chunk")?;
        out.extend_from_slice(chunk);
        b = b.get(size + 2..).ok_or("truncated chunk")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sized_and_chunked_bodies_are_read() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").expect("ok");
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        let r = parse_response(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n1;x=y\r\nd\r\n0\r\n\r\n",
        )
        .expect("ok");
        assert_eq!((r.status, r.body.as_slice()), (404, &b"abcd"[..]));
        let r = parse_response(b"HTTP/1.1 204 No Content\r\n\r\n").expect("ok");
        assert!(r.body.is_empty());
    }

    #[test]
    fn malformed_answers_are_errors_not_panics() {
        for raw in [
            &b""[..],
            b"HTTP/1.1 200 OK\r\n",
            b"SSH-2.0\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nff\r\nab",
        ] {
            assert!(
                parse_response(raw).is_err(),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn ipv6_literals_are_bracketed_only_in_the_host_header() {
        assert_eq!(authority("[::1]", 80), ("::1", "[::1]:80".to_owned()));
        assert_eq!(authority("::1", 80), ("::1", "[::1]:80".to_owned()));
        assert_eq!(
            authority("127.0.0.1", 80),
            ("127.0.0.1", "127.0.0.1:80".to_owned())
        );
    }

    #[test]
    fn a_closed_port_is_an_io_error_and_silence_a_timeout() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let port = listener.local_addr().expect("addr").port();
            // Accepts and never answers.
            let silent = tokio::spawn(async move {
                let conn = listener.accept().await;
                tokio::time::sleep(Duration::from_secs(5)).await;
                drop(conn);
            });
            let e = call(
                "127.0.0.1",
                port,
                "GET",
                "/",
                None,
                Duration::from_millis(100),
            )
            .await
            .expect_err("silent");
            assert!(matches!(e, PeerError::Timeout { .. }), "{e}");
            silent.abort();
            let closed = {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
                l.local_addr().expect("addr").port()
            };
            let e = call(
                "127.0.0.1",
                closed,
                "GET",
                "/",
                None,
                Duration::from_secs(2),
            )
            .await
            .expect_err("closed");
            assert!(matches!(e, PeerError::Io { .. }), "{e}");
        });
    }
}
