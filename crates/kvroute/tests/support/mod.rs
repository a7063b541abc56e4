//! Helpers of the end-to-end suite: the real `kvroute` binary as child
//! processes (killed when the test ends, pass or fail) on ports they bind
//! themselves and report, the one bounded wait, and a raw HTTP/1.1 client
//! ([`http`]).
//!
//! A child binds port 0 and says which port it got (`kvroute serve` on
//! stderr, `kvroute mocker` in its `--worker` lines): a port picked here and
//! handed to a child can be taken by another test in between. [`free_port`]
//! is for the few places that need a port number before anything listens on
//! it (see there).
#![allow(dead_code)]

pub mod door;
pub mod engine;
pub mod held;
pub mod http;
pub mod picker;
pub mod publisher;
pub mod spans;

use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStderr, Command, Stdio};
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

/// The `kvroute` binary under test, as a command to add arguments to: this
/// build's, or the one `KVROUTE_TEST_BIN` names (to run the suite against
/// another build, such as the commit before a fix).
///
/// Hermetic by default: it never asks the Hugging Face hub
/// (`HF_HUB_OFFLINE=1`), and a router it starts looks for no tokenizer of
/// its own (`KVROUTE_TOKENIZER_SOURCES=none`), so that text routed on load
/// alone stays so for the whole test; a test of tokenizer discovery sets
/// both itself.
pub fn kvroute() -> Command {
    let mut command = Command::new(kvroute_path());
    command
        .env("HF_HUB_OFFLINE", "1")
        .env("KVROUTE_TOKENIZER_SOURCES", "none");
    command
}

/// The path of the `kvroute` binary under test (see [`kvroute`]).
pub fn kvroute_path() -> std::path::PathBuf {
    std::env::var_os("KVROUTE_TEST_BIN")
        .map_or_else(|| env!("CARGO_BIN_EXE_kvroute").into(), Into::into)
}

/// A port nothing listens on right now, and that nothing reserves: another
/// test may bind it next. Use it only where a port must be known before a
/// process listens on it, and a child cannot bind port 0 and report its own:
/// a worker spec whose events endpoint nobody publishes on (or not yet), or
/// the base ports of a multi-rank engine (rank r on base + r, see
/// [`free_port_pair`]). An engine restarted "on the same port" reuses the
/// port it reported the first time instead.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A free port whose successor is free too (ranks 0 and 1 of one engine),
/// not next to any port in `avoid`: for a two-rank engine, whose `--worker`
/// line names rank 0's port and implies rank 1's (base + 1), so the pair
/// must be chosen before the engine starts. Racy as [`free_port`] is.
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

/// The most of `body`'s prompt the router at `serve` holds on any one rank,
/// as its `/query` scores it: a test compares it with what the engines hold
/// to know their events reached the index.
pub fn indexed(serve: &str, body: &serde_json::Value) -> u64 {
    let q = http::request(serve, "POST", "/query", &body.to_string()).json();
    q["scores"]
        .as_object()
        .into_iter()
        .flat_map(|workers| workers.values())
        .filter_map(serde_json::Value::as_object)
        .flat_map(|ranks| ranks.values())
        .filter_map(serde_json::Value::as_u64)
        .max()
        .unwrap_or(0)
}

/// Waits (at most 30 s, polling every 20 ms) until `check` holds.
pub fn eventually(what: &str, check: impl FnMut() -> bool) {
    eventually_within(what, Duration::from_secs(30), check);
}

/// Waits (at most `limit`, polling every 20 ms) until `check` holds;
/// panics naming `what` and the limit otherwise.
pub fn eventually_within(what: &str, limit: Duration, check: impl FnMut() -> bool) {
    if !polled_until(limit, check) {
        panic!("timed out after {limit:?} waiting for: {what}");
    }
}

/// Polls `check` every 20 ms until it holds (true) or `limit` has passed
/// (false): for a wait whose failure message needs what was last seen.
pub fn polled_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The lines of a child's piped output, read on a thread that keeps
/// draining it (a closed pipe would end the child at its next print).
pub fn lines_of(out: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Runs `kvroute mocker ARGS` and returns it with its first `engines` `--worker` lines.
pub fn spawn_mocker(args: &[&str], engines: usize) -> (Proc, Vec<String>) {
    spawn_mocker_of(kvroute(), args, engines)
}

/// [`spawn_mocker`] run by this build's binary whatever `KVROUTE_TEST_BIN`
/// says: for a test of the router whose engines need this build's faults.
pub fn spawn_this_builds_mocker(args: &[&str], engines: usize) -> (Proc, Vec<String>) {
    spawn_mocker_of(Command::new(env!("CARGO_BIN_EXE_kvroute")), args, engines)
}

fn spawn_mocker_of(mut command: Command, args: &[&str], engines: usize) -> (Proc, Vec<String>) {
    let mut child = command
        .arg("mocker")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvroute mocker runs");
    let rx = lines_of(child.stdout.take().expect("stdout"));
    let child = Proc(child);
    let lines = (0..engines)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(30))
                .expect("a worker line")
        })
        .collect();
    (child, lines)
}

/// `workers` engines on ephemeral ports (HTTP, events, replay), with
/// `extra` flags; returns the mocker and its `--worker` lines.
pub fn start_mocker_with(workers: usize, extra: &[&str]) -> (Proc, Vec<String>) {
    let n = workers.to_string();
    let mut args = vec![
        "--workers",
        &n,
        "--port",
        "0",
        "--kv-events-port",
        "0",
        "--replay-port",
        "0",
    ];
    args.extend_from_slice(extra);
    spawn_mocker(&args, workers)
}

/// `workers` engines on ephemeral ports, `speedup` times faster than real time.
pub fn start_mocker(workers: usize, speedup: &str) -> (Proc, Vec<String>) {
    start_mocker_with(workers, &["--speedup", speedup])
}

/// One engine of `flavor` with two data-parallel ranks on fixed ports (rank r
/// publishes on the rank-0 port + r, as a descriptor or a base port implies,
/// so the bases are picked with [`free_port_pair`] before it starts; its HTTP
/// port is its own).
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

/// Runs `kvroute serve --port 0` with `--worker` for each of `lines` and
/// `extra` flags; returns it and the `host:port` it printed in its listening
/// line (its workers' event streams are not waited for).
pub fn spawn_serve(lines: &[String], extra: &[&str]) -> (Proc, String) {
    spawn_serve_with_env(lines, extra, &[])
}

/// [`spawn_serve`] with `env` set for the router (settings given as
/// `KVROUTE_*` variables, which a build without them ignores rather than
/// refusing to start, so the suite can run against an older build).
pub fn spawn_serve_with_env(
    lines: &[String],
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Proc, String) {
    let mut child = serve_child(lines, extra, env);
    let stderr = child.stderr.take().expect("stderr");
    let child = Proc(child);
    let addr = listening_addr(stderr);
    (child, addr)
}

/// `kvroute serve --port 0 --log warn` with `env`, a `--worker` for each of
/// `lines` and the `extra` flags, started with its stderr piped (where it
/// prints its listening lines).
pub fn serve_child(lines: &[String], extra: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    let mut command = kvroute();
    command.args(["serve", "--port", "0", "--log", "warn"]);
    command.envs(env.iter().copied());
    for line in lines {
        command.arg("--worker").arg(line);
    }
    command
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvroute serve runs")
}

/// The `host:port` in `kvroute serve`'s `listening on http://ADDR` line on
/// `stderr` (at most 30 s); the rest of `stderr` is drained on a thread.
pub fn listening_addr(stderr: ChildStderr) -> String {
    let rx = lines_of(stderr);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let wait = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(wait)
            .expect("kvroute serve prints `listening on http://ADDR` within 30 s");
        if let Some((_, rest)) = line.split_once("listening on http://") {
            let addr = rest.split_whitespace().next().unwrap_or_default();
            assert!(!addr.is_empty(), "no address in {line:?}");
            return addr.to_owned();
        }
    }
}

/// [`spawn_serve`], then waits until every worker's every rank is connected.
pub fn start_serve(lines: &[String], extra: &[&str]) -> (Proc, String) {
    start_serve_with_env(lines, extra, &[])
}

/// [`start_serve`] with `env` set for the router (see [`spawn_serve_with_env`]).
pub fn start_serve_with_env(
    lines: &[String],
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Proc, String) {
    let (proc, serve) = spawn_serve_with_env(lines, extra, env);
    let expected = lines.len();
    eventually("serve up with every rank connected", || {
        TcpStream::connect(&serve).is_ok() && {
            let doc = http::request(&serve, "GET", "/workers", "").json();
            let list = doc["workers"].as_array().cloned().unwrap_or_default();
            list.len() == expected
                && list.iter().all(|w| {
                    w["ranks"]
                        .as_array()
                        .is_some_and(|r| !r.is_empty() && r.iter().all(|r| r["connected"] == true))
                })
        }
    });
    (proc, serve)
}

/// Runs `kvroute bench --json --no-progress` at `host_port` with `args` (the
/// workload and its bounds) and returns its report, the run checked to have
/// succeeded.
pub fn bench_report(host_port: &str, args: &[&str]) -> serde_json::Value {
    let out = kvroute()
        .args(["bench", "--url", &format!("http://{host_port}")])
        .args(args)
        .args(["--json", "--no-progress"])
        .output()
        .expect("kvroute bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// A Python with `packages` for a client test: `$var`, or the virtual
/// environment `scripts/test` makes under `~/.cache/kvroute/{dir}`. Fails,
/// naming the command that installs it, when `imports` do not import there
/// (never skips).
pub fn python_with(var: &str, dir: &str, packages: &str, imports: &str) -> std::path::PathBuf {
    use std::path::PathBuf;
    let python = std::env::var_os(var).map_or_else(
        || {
            let cache = std::env::var_os("XDG_CACHE_HOME").map_or_else(
                || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"),
                PathBuf::from,
            );
            cache.join("kvroute").join(dir).join("bin/python")
        },
        PathBuf::from,
    );
    let imported = Command::new(&python).args(["-c", imports]).output();
    let ok = imported.as_ref().is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "this test needs a Python with {packages} at {} (or {var}): run scripts/test, or \
         `python3 -m venv ~/.cache/kvroute/{dir} && ~/.cache/kvroute/{dir}/bin/pip install {packages}` ({:?})",
        python.display(),
        imported.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
    );
    python
}

/// A field of `/proc/PID/status` in bytes (`VmRSS`, `VmHWM`); 0 if unread.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The resident memory of a process now, in bytes.
pub fn rss(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS")
}

/// The most resident memory a process ever had, in bytes (its high-water
/// mark: a peak between two samples is not missed).
pub fn peak_rss(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM")
}

/// Asserts that process `pid` never held `bound` bytes or more (its
/// `VmHWM`), printing the figure with `what` it was under.
pub fn assert_peak_rss_under(pid: u32, bound: u64, what: &str) {
    let peak = peak_rss(pid);
    eprintln!("router peak RSS {what}: {} MiB", peak >> 20);
    assert!(
        peak > 0 && peak < bound,
        "router peak RSS {} MiB {what} (bound {} MiB)",
        peak >> 20,
        bound >> 20
    );
}
