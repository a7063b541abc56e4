//! `kvroute serve` configured from the environment alone, as a container
//! deployment configures it: every flag has a `KVROUTE_*` variable; and what
//! serve says at start about its configuration (a worker it cannot take, the
//! admin API).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::http::*;
use crate::support::*;

#[test]
fn serve_takes_its_port_workers_and_token_from_the_environment() {
    let (_mocker, lines) = start_mocker(2, "100");
    let mut child = kvroute()
        .arg("serve")
        .env("KVROUTE_PORT", "0")
        .env("KVROUTE_WORKERS", lines.join(";"))
        .env("KVROUTE_ADMIN_TOKEN", "from-env")
        .env("KVROUTE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvroute serve runs");
    let stderr = child.stderr.take().expect("stderr");
    let _serve = Proc(child);
    // Port 0 from the environment: the router binds an ephemeral port and
    // says which (without the variable it would listen on its default, 8000).
    let serve = listening_addr(stderr);
    let port: u16 = serve
        .strip_prefix("127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("not 127.0.0.1:PORT: {serve}"));
    assert!(port != 0 && port != 8000, "KVROUTE_PORT=0 ignored: {serve}");
    let token = [("Authorization", "Bearer from-env")];
    eventually("both workers from KVROUTE_WORKERS connected", || {
        std::net::TcpStream::connect(&serve).is_ok() && {
            let doc = request_with(&serve, "GET", "/workers", &token, "").json();
            doc["workers"].as_array().is_some_and(|ws| {
                ws.len() == 2 && ws.iter().all(|w| w["ranks"][0]["connected"] == true)
            })
        }
    });
    // The admin token came from the environment too.
    assert_eq!(request(&serve, "GET", "/workers", "").status, 401);
}

#[test]
fn help_names_the_environment_variable_of_every_flag() {
    let out = kvroute()
        .args(["serve", "--help"])
        .output()
        .expect("kvroute serve --help");
    let help = String::from_utf8_lossy(&out.stdout);
    let flags = help
        .lines()
        .filter(|l| l.trim_start().starts_with("--"))
        .count();
    // kvroute's own variables, and OpenTelemetry's standard one for the
    // collector (an operator's existing OTEL_* settings apply as they are).
    let envs = help.matches("[env: KVROUTE_").count();
    let standard = help
        .matches("[env: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .count();
    assert!(flags > 30, "{help}");
    // `-h, --help` is not counted among the flags and has no variable.
    assert_eq!(envs + standard, flags, "{help}");
    assert_eq!(help.matches("[env: ").count(), flags, "{help}");
    assert!(help.contains("[env: KVROUTE_WORKERS=]"));
}

#[test]
fn roles_come_from_kvroute_workers_and_a_config_file() {
    let events = || format!("tcp://127.0.0.1:{}", free_port());
    let workers = format!(
        "name=p,url=http://127.0.0.1:9,events={},flavor=sglang,role=prefill,bootstrap_port=8998;\
         name=d,url=http://127.0.0.1:9,events={},role=decode",
        events(),
        events()
    );
    let dir = std::env::temp_dir().join(format!("kvroute-roles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("workers.toml");
    let toml = format!(
        "[[worker]]\nname = \"f\"\nurl = \"http://127.0.0.1:9\"\nevents = \"{}\"\nrole = \"prefill-decode\"\n\n\
         [[worker]]\nname = \"g\"\nurl = \"http://127.0.0.1:9\"\nevents = \"{}\"\nrole = \"decode\"\n",
        events(),
        events()
    );
    std::fs::write(&config, toml).expect("write the config");
    let config_path = config.to_string_lossy().into_owned();
    let (_serve, serve) = spawn_serve_with_env(
        &[],
        &[],
        &[
            ("KVROUTE_WORKERS", &workers),
            ("KVROUTE_CONFIG", &config_path),
        ],
    );
    eventually("serve answers /workers", || {
        std::net::TcpStream::connect(&serve).is_ok()
            && request(&serve, "GET", "/workers", "").status == 200
    });
    let doc = request(&serve, "GET", "/workers", "").json();
    let mut listed: Vec<(String, String, Option<u64>)> = doc["workers"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|w| {
            (
                w["name"].as_str().unwrap_or("").to_owned(),
                w["role"].as_str().unwrap_or("").to_owned(),
                w.get("bootstrap_port").and_then(serde_json::Value::as_u64),
            )
        })
        .collect();
    listed.sort();
    let expected = [
        ("d", "decode", None),
        ("f", "both", None),
        ("g", "decode", None),
        ("p", "prefill", Some(8998)),
    ]
    .map(|(n, r, p)| (n.to_owned(), r.to_owned(), p));
    assert_eq!(listed, expected);
    let metrics = request(&serve, "GET", "/metrics", "").body;
    assert!(metrics.contains("kvroute_worker_info{worker=\"p\",role=\"prefill\"} 1"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bootstrap_port_on_a_vllm_worker_stops_serve_with_the_reason() {
    let out = kvroute()
        .args(["serve", "--port", "0"])
        .env(
            "KVROUTE_WORKERS",
            "name=v,url=http://127.0.0.1:9,events=tcp://127.0.0.1:9,role=prefill,bootstrap_port=8998",
        )
        .output()
        .expect("kvroute serve runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bootstrap_port=8998") && stderr.contains("only SGLang workers"),
        "{stderr}"
    );
}

/// `kvroute serve` with `args` and one worker `big` of `dp` ranks (nothing
/// listens on its ports), run through `sh` so that `ulimit` may set the
/// open-file limit first: its exit status and stderr.
fn serve_big_worker(ulimit: Option<u32>, dp: u32, args: &str) -> (bool, String) {
    let worker = format!(
        "name=big,url=http://127.0.0.1:9,events=tcp://127.0.0.1:9,replay=tcp://127.0.0.1:200,dp={dp},block_size=16"
    );
    let limit = ulimit.map_or(String::new(), |n| format!("ulimit -n {n} && "));
    let script = format!("{limit}exec \"$0\" serve --port 0 --worker {worker} {args}");
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(kvroute_path())
        .output()
        .expect("kvroute serve runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), stderr)
}

/// The line of `stderr` that says why serve stopped (`kvroute: …`).
fn reason(stderr: &str) -> &str {
    stderr
        .lines()
        .find(|l| l.starts_with("kvroute: "))
        .unwrap_or_else(|| panic!("no `kvroute: ` line in {stderr}"))
}

/// A configured worker with more ranks than `--max-ranks` stops serve with
/// one sentence that names the worker once and the flag to raise.
#[test]
fn a_worker_over_max_ranks_stops_serve_naming_it_once_and_the_flag_to_raise() {
    let (ok, stderr) = serve_big_worker(None, 2, "--max-ranks 1");
    assert!(!ok, "{stderr}");
    let line = reason(&stderr);
    assert_eq!(line.matches("big").count(), 1, "{line}");
    assert!(
        line.contains("needs 2 rank slot(s) but --max-ranks 1 has 1 free")
            && line.ends_with("raise --max-ranks"),
        "{line}"
    );
}

/// With `--max-ranks` left to its default, the refusal names the open-file
/// limit it follows: at 512 files, 32 slots ((512 − 256 − 2 × 64) / 4).
#[test]
fn a_worker_over_the_default_max_ranks_names_the_open_file_limit() {
    let (ok, stderr) = serve_big_worker(Some(512), 40, "");
    assert!(!ok, "{stderr}");
    let line = reason(&stderr);
    assert_eq!(line.matches("big").count(), 1, "{line}");
    assert!(
        line.contains("needs 40 rank slot(s) but --max-ranks 32 has 32 free")
            && line.contains("raise the open-file limit (`ulimit -n`, now 512)"),
        "{line}"
    );
}

/// `kvroute serve` still says at start that its admin API is closed (the
/// demo's own routers, which chose it, do not: see the demo tests).
#[test]
fn serve_says_at_start_that_the_admin_api_is_closed() {
    let mut child = kvroute()
        .args(["serve", "--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvroute serve runs");
    let lines = lines_of(child.stderr.take().expect("stderr"));
    let _serve = Proc(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.contains("admin API disabled") && line.contains("--admin-token") {
            return;
        }
        seen.push(line);
    }
    panic!("no admin API line within 30 s: {seen:#?}");
}
