//! The endpoint picker as a test meets it: `kvroute serve` with its
//! ext_proc port on, the Python that runs the ext_proc client kvroute
//! shares no code with (`tests/epp/client.py`), and the data plane in
//! front of the picker (`tests/epp/dataplane.py`: what Envoy's ext_proc
//! filter and an ORIGINAL_DST cluster do).
//!
//! The Python comes from `KVROUTE_EPP_PYTHON`, or the virtual environment
//! `scripts/test` makes under `~/.cache/kvroute/epp`; without it these
//! tests fail naming the command that installs it (never skip).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::http::request;
use super::{eventually, lines_of, Proc};

/// The packages the client imports.
pub const PACKAGES: &str = "envoy-data-plane grpcio grpcio-health-checking";

/// The Python with the client's packages (see the module docs).
pub fn python() -> PathBuf {
    super::python_with(
        "KVROUTE_EPP_PYTHON",
        "epp",
        PACKAGES,
        "import envoy_data_plane, grpc, grpc_health",
    )
}

/// The client script.
pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/epp/client.py")
}

/// A router with the picker on: its HTTP, ext_proc and health addresses.
pub struct Picker {
    /// The router's process.
    pub proc: Proc,
    /// Its HTTP address (`/metrics`, `/workers`, `/query`).
    pub http: String,
    /// Its ext_proc address.
    pub ext_proc: String,
    /// Its gRPC health address.
    pub health: String,
}

impl Picker {
    /// The router's process, killed when dropped.
    pub fn into_proc(self) -> Proc {
        self.proc
    }
}

/// `kvroute serve` on ephemeral ports with the picker on (`--epp-port 0
/// --epp-health-port 0`), the `workers` and `extra` flags; waits until it
/// printed both listening lines and every worker's rank is connected.
pub fn start_picker(workers: &[String], extra: &[&str]) -> Picker {
    start_picker_with_env(workers, extra, &[])
}

/// [`start_picker`] with `env` set for the router.
pub fn start_picker_with_env(workers: &[String], extra: &[&str], env: &[(&str, &str)]) -> Picker {
    let mut flags = vec!["--epp-health-port", "0"];
    if !extra.contains(&"--epp-port") {
        flags.extend(["--epp-port", "0"]);
    }
    flags.extend_from_slice(extra);
    let mut child = super::serve_child(workers, &flags, env);
    let lines = lines_of(child.stderr.take().expect("stderr"));
    let proc = Proc(child);
    let (mut http, mut picker) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    while http.is_none() || picker.is_none() {
        let wait = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(wait)
            .expect("serve prints its listening lines within 30 s");
        if let Some((_, rest)) = line.split_once("listening on http://") {
            http = rest.split_whitespace().next().map(str::to_owned);
        }
        if let Some((_, rest)) = line.split_once("endpoint picker (ext_proc) listening on ") {
            picker = Some(rest.to_owned());
        }
    }
    let picker = picker.unwrap_or_default();
    let after_scheme = |s: &str| s.split_once("://").map(|(_, a)| a.to_owned());
    let ext_proc = picker
        .split(',')
        .next()
        .and_then(after_scheme)
        .expect("the ext_proc address");
    let health = picker
        .split_once("gRPC health on ")
        .and_then(|(_, h)| after_scheme(h.trim()))
        .expect("the health address");
    let http = http.unwrap_or_default();
    eventually("every worker's rank connected", || {
        let doc = request(&http, "GET", "/workers", "").json();
        let list = doc["workers"].as_array().cloned().unwrap_or_default();
        list.len() == workers.len()
            && list.iter().all(|w| {
                w["ranks"]
                    .as_array()
                    .is_some_and(|r| r.iter().all(|r| r["connected"] == true))
            })
    });
    Picker {
        proc,
        http,
        ext_proc,
        health,
    }
}

/// The data plane (`tests/epp/dataplane.py`) in front of the picker at
/// `ext_proc`, falling open to `fail_open` when given: its `host:port`.
pub fn start_dataplane(ext_proc: &str, fail_open: &[String]) -> (Proc, String) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/epp/dataplane.py");
    let mut child = Command::new(python())
        .arg(script)
        .args(["--epp", ext_proc, "--fail-open", &fail_open.join(",")])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("python runs");
    let lines = lines_of(child.stdout.take().expect("stdout"));
    let proc = Proc(child);
    let line = lines
        .recv_timeout(Duration::from_secs(30))
        .expect("the data plane says where it listens");
    let port = line.trim().strip_prefix("listening on ").expect("its port");
    (proc, format!("127.0.0.1:{port}"))
}
