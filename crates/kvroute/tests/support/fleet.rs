//! Starting real `kvroute` processes for end-to-end tests (included with
//! `#[path]` by each test binary that needs it).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A child process killed when the test ends, pass or fail.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A free port whose successor is free too (ranks 0 and 1 of one engine),
/// not next to any port in `avoid`.
pub fn free_port_pair(avoid: &[u16]) -> u16 {
    loop {
        let p = free_port();
        if p < u16::MAX
            && !avoid.iter().any(|a| a.abs_diff(p) <= 1)
            && TcpListener::bind(("127.0.0.1", p + 1)).is_ok()
        {
            return p;
        }
    }
}

/// Waits (at most 30 s) until `check` holds.
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for: {what}");
}

/// Runs `kvroute mocker ARGS` and returns it with its first `engines` `--worker` lines.
pub fn spawn_mocker(args: &[&str], engines: usize) -> (Proc, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .arg("mocker")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvroute mocker runs");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    // Keep draining stdout: a closed pipe would end the engine at its next print.
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let child = Proc(child);
    let lines = (0..engines)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(30))
                .expect("a worker line")
        })
        .collect();
    (child, lines)
}

/// `workers` engines on ephemeral ports.
pub fn start_mocker(workers: usize, speedup: &str) -> (Proc, Vec<String>) {
    let n = workers.to_string();
    spawn_mocker(
        &[
            "--workers",
            &n,
            "--port",
            "0",
            "--kv-events-port",
            "0",
            "--replay-port",
            "0",
            "--speedup",
            speedup,
        ],
        workers,
    )
}

/// One engine of `flavor` with two data-parallel ranks on fixed ports (rank r
/// publishes on the rank-0 port + r, as a descriptor or a base port implies).
pub fn start_two_rank_mocker(flavor: &str) -> (Proc, String) {
    let events = free_port_pair(&[]);
    let replay = free_port_pair(&[events]);
    let (events, replay) = (events.to_string(), replay.to_string());
    let (child, mut lines) = spawn_mocker(
        &[
            "--engine-flavor",
            flavor,
            "--dp-size",
            "2",
            "--port",
            "0",
            "--kv-events-port",
            &events,
            "--replay-port",
            &replay,
            "--speedup",
            "100",
        ],
        1,
    );
    (child, lines.remove(0))
}

/// Runs `kvroute serve` on a free port with `--worker` for each of `lines`
/// and `extra` flags; returns it and its `host:port` (not waited for).
pub fn spawn_serve(lines: &[String], extra: &[&str]) -> (Proc, String) {
    let port = free_port();
    let port_arg = port.to_string();
    let mut args = vec!["serve", "--port", &port_arg, "--log", "warn"];
    for line in lines {
        args.push("--worker");
        args.push(line);
    }
    args.extend_from_slice(extra);
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvroute serve runs");
    (Proc(child), format!("127.0.0.1:{port}"))
}
