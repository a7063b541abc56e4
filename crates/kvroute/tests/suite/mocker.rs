//! `kvroute mocker` as a user runs it: the real binary, its `--worker` lines, SIGTERM.

use std::io::Read;
use std::process::Command;

use crate::support::http::{request, send};
use crate::support::{kvroute, start_mocker_with};

/// The raw answer (status line, headers, body) to `GET path`.
fn http_get(host_port: &str, path: &str) -> String {
    let mut s = send(host_port, "GET", path, "");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn mocker_prints_one_worker_line_per_engine_serves_and_stops_on_sigterm() {
    let (mut child, lines) = start_mocker_with(
        2,
        &[
            "--engine-flavor",
            "sglang",
            "--dp-size",
            "2",
            "--block-size",
            "32",
        ],
    );
    for (k, line) in lines.iter().enumerate() {
        let pairs: Vec<(&str, &str)> = line
            .split(',')
            .map(|kv| kv.split_once('=').expect("key=value"))
            .collect();
        let keys: Vec<&str> = pairs.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "name",
                "url",
                "events",
                "replay",
                "flavor",
                "dp",
                "block_size"
            ],
            "{line}"
        );
        assert_eq!(pairs[0].1, format!("w{k}"));
        assert!(pairs[2].1.starts_with("tcp://127.0.0.1:"));
        assert!(pairs[3].1.starts_with("tcp://127.0.0.1:"));
        assert_eq!((pairs[4].1, pairs[5].1, pairs[6].1), ("sglang", "2", "32"));
        let host_port = pairs[1].1.strip_prefix("http://").expect("http url");
        let health = http_get(host_port, "/health");
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    }
    let pid = child.0.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let status = child.0.wait().expect("exits");
    assert!(status.success(), "{status:?}");
}

#[test]
fn mocker_rejects_bad_flags_with_exit_code_2() {
    let out = kvroute()
        .args(["mocker", "--fail-rate", "2"])
        .output()
        .expect("kvroute runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--fail-rate"), "{stderr}");
}

/// A replay ring of no batches could not answer any replay: refused by the flag's range.
#[test]
fn mocker_rejects_an_empty_replay_buffer() {
    let out = kvroute()
        .args(["mocker", "--replay-buffer", "0"])
        .output()
        .expect("kvroute runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--replay-buffer"), "{stderr}");
}

/// The `host:port` of a `--worker` line's HTTP url.
fn http_host_port(line: &str) -> String {
    line.split(',')
        .find_map(|kv| kv.strip_prefix("url=http://"))
        .expect("a url")
        .to_owned()
}

/// vLLM caches the blocks a step will fill while it schedules the step, so a
/// request admitted beside the last chunk of another's prefill hits that
/// chunk too. 544 tokens in 64-token steps: the first request computes
/// tokens 512..544 (blocks 32 and 33) in its ninth step, and the second,
/// admitted with the budget left over, must find all 33 blocks it can hit
/// (528 tokens), not the 32 that earlier steps computed.
#[test]
fn a_vllm_request_admitted_beside_a_prefill_chunk_hits_the_blocks_that_chunk_fills() {
    let (_mocker, lines) = start_mocker_with(
        1,
        &[
            "--engine-flavor",
            "vllm",
            "--max-num-batched-tokens",
            "64",
            "--speedup",
            "0.1",
        ],
    );
    let host = http_host_port(&lines[0]);
    let prompt: Vec<u32> = (1000..1544).collect();
    let body =
        serde_json::json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1}).to_string();
    let senders: Vec<_> = (0..2)
        .map(|_| {
            let (host, body) = (host.clone(), body.clone());
            std::thread::spawn(move || request(&host, "POST", "/v1/completions", &body))
        })
        .collect();
    let mut cached: Vec<u64> = senders
        .into_iter()
        .map(|s| {
            let reply = s.join().expect("the request thread");
            assert_eq!(reply.status, 200, "{}", reply.body);
            reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached_tokens")
        })
        .collect();
    cached.sort_unstable();
    assert_eq!(cached, [0, 528]);
}
