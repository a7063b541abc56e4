//! `serve --inference-pool` against recorded Kubernetes API responses
//! (feature `kube`): a loopback HTTP server plays the API server with the
//! JSON of `tests/fixtures/kubernetes/` (an InferencePoolList, PodLists and
//! watch streams, one `{"type": …, "object": …}` event a line, written in
//! the API's shapes), and the router, reaching it through a kubeconfig,
//! registers and removes workers as the pods come, turn unready and go.
//!
//! The story the fixtures tell: pods 2xk4p and 8hq2m are ready (8hq2m
//! annotated as an SGLang engine on other ports), k7w9n is not, a
//! `curl-debug` pod outside the selector and a pending pod without an IP
//! are listed too. Then k7w9n turns ready, 2xk4p unready, 8hq2m is deleted,
//! and the watch's version expires (410): the new list has only zz8r4. The
//! pool is deleted, and comes back with two target ports.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::Response;
use axum::routing::get;
use futures_util::stream;
use kvroute_server::admin::Access;
use kvroute_server::discovery::{Discovery, EndpointDefaults, PoolDiscovery};
use kvroute_server::{serve, ServeConfig};
use serde_json::Value;
use tokio::sync::mpsc;

const NS: &str = "inference";

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/kubernetes/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// One resource's answers: the lists in turn (the last one again once
/// they run out), and each watch's event lines as the test releases them.
#[derive(Default)]
struct Resource {
    lists: VecDeque<String>,
    watches: VecDeque<mpsc::UnboundedReceiver<String>>,
}

/// The fake API server's state: what it answers, and what it was asked.
#[derive(Default)]
struct Api {
    pods: Mutex<Resource>,
    pools: Mutex<Resource>,
    asked: Mutex<Vec<String>>,
}

fn answer(api: &Api, resource: &Mutex<Resource>, uri: &Uri) -> Response {
    api.asked
        .lock()
        .expect("not poisoned")
        .push(uri.to_string());
    let watch = uri.query().unwrap_or_default().contains("watch=true");
    let mut r = resource.lock().expect("not poisoned");
    let body = if watch {
        match r.watches.pop_front() {
            // Each line as the test sends it; the watch stays open until then.
            Some(lines) => Body::from_stream(stream::unfold(lines, |mut lines| async move {
                let line = lines.recv().await?;
                Some((
                    Ok::<_, std::convert::Infallible>(format!("{line}\n")),
                    lines,
                ))
            })),
            None => {
                Body::from_stream(stream::pending::<Result<String, std::convert::Infallible>>())
            }
        }
    } else {
        let list = match r.lists.len() {
            0 | 1 => r.lists.front().cloned().unwrap_or_default(),
            _ => r.lists.pop_front().unwrap_or_default(),
        };
        Body::from(list)
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .expect("a response")
}

async fn pods(State(api): State<Arc<Api>>, uri: Uri) -> Response {
    answer(&api, &api.pods, &uri)
}

async fn pools(State(api): State<Arc<Api>>, uri: Uri) -> Response {
    answer(&api, &api.pools, &uri)
}

/// Starts the fake API server; its base URL.
async fn start_api(api: Arc<Api>) -> String {
    let app = axum::Router::new()
        .route("/api/v1/namespaces/{ns}/pods", get(pods))
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
            get(pools),
        )
        .with_state(api);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A kubeconfig that reaches `server` without credentials.
fn kubeconfig(dir: &std::path::Path, server: &str) -> std::path::PathBuf {
    let text = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\nclusters:\n- name: test\n  cluster:\n    server: {server}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: {NS}\nusers:\n- name: test\n  user: {{}}\n"
    );
    let path = dir.join("kubeconfig");
    std::fs::write(&path, text).expect("written");
    path
}

/// The router's workers: name, URL, each rank's events endpoint, flavour.
async fn workers(client: &reqwest::Client, base: &str) -> Vec<(String, String, String, String)> {
    let Ok(answer) = client.get(format!("{base}/workers")).send().await else {
        return Vec::new();
    };
    let doc: Value = answer.json().await.unwrap_or_default();
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    doc["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            let events: Vec<String> = w["ranks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| text(&r["events_endpoint"]))
                .collect();
            (
                text(&w["name"]),
                text(&w["url"]),
                events.join(" "),
                text(&w["flavor"]),
            )
        })
        .collect()
}

/// Waits (10 s at most) until the router's worker names are `names`.
async fn until_names(client: &reqwest::Client, base: &str, names: &[&str], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = workers(client, base).await;
        let seen: Vec<&str> = now.iter().map(|w| w.0.as_str()).collect();
        if seen == names {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: workers {seen:?}, wanted {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A metric's value in `/metrics`.
async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// The router, started on the fake API at `server` through a kubeconfig
/// in `dir`: its base URL, what stops it, and its task.
async fn start_router(
    server: &str,
    dir: &std::path::Path,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), kvroute_server::ServeError>>,
) {
    let config = ServeConfig {
        discovery: Some(Discovery::Pool(PoolDiscovery {
            pool: "llama3-8b".parse().expect("a pool name"),
            kubeconfig: Some(kubeconfig(dir, server)),
            defaults: EndpointDefaults {
                replay_port: Some(5657),
                ..EndpointDefaults::default()
            },
        })),
        access: Access {
            admin_token: None,
            public_introspection: true,
        },
        announce_access: false,
        ..ServeConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = tokio::spawn(serve(config, listener, async move {
        let _ = stopped.await;
    }));
    (base, stop, router)
}

/// The first list's two ready pods, as their annotations or the defaults
/// complete them, found with the pool's selector.
async fn check_first_list(client: &reqwest::Client, base: &str, api: &Api) {
    let (a, b) = (
        "inference/vllm-llama3-8b-6f9d8c7b5-2xk4p",
        "inference/vllm-llama3-8b-6f9d8c7b5-8hq2m",
    );
    until_names(client, base, &[a, b], "the first list").await;
    let listed = workers(client, base).await;
    let expected = |name: &str, ip: &str, events: u16, flavor: &str| {
        let url = format!("http://{ip}:8000");
        (
            name.to_owned(),
            url,
            format!("tcp://{ip}:{events}"),
            flavor.to_owned(),
        )
    };
    assert_eq!(listed[0], expected(a, "127.0.0.11", 5557, "vllm"));
    assert_eq!(
        listed[1],
        expected(b, "127.0.0.12", 6000, "sglang"),
        "8hq2m's annotations"
    );
    let asked = api.asked.lock().expect("not poisoned").clone();
    assert!(
        asked
            .iter()
            .any(|q| q.contains("/pods?") && q.contains("labelSelector=app%3Dvllm-llama3-8b")),
        "the pods are listed by the pool's selector: {asked:?}"
    );
    assert!(
        asked.iter().any(|q| q.contains("inferencepools?")
            && q.contains("fieldSelector=metadata.name%3Dllama3-8b")),
        "the pool is watched by name, in the kubeconfig's namespace: {asked:?}"
    );
}

fn lines(name: &str) -> Vec<String> {
    fixture(name).lines().map(str::to_owned).collect()
}

/// Feeds the fake API, starts the router on it, and walks the story.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_the_pools_pods_through_watches_relists_and_the_pool_itself() {
    let api = Arc::new(Api::default());
    let (pod_lines, first_watch) = mpsc::unbounded_channel();
    let (_quiet, second_watch) = mpsc::unbounded_channel::<String>();
    let (pool_lines, pool_watch) = mpsc::unbounded_channel();
    {
        let mut pods = api.pods.lock().expect("not poisoned");
        pods.lists
            .extend([fixture("pods-list-1.json"), fixture("pods-list-2.json")]);
        pods.watches.extend([first_watch, second_watch]);
        let mut pools = api.pools.lock().expect("not poisoned");
        pools.lists.push_back(fixture("pools-list.json"));
        pools.watches.push_back(pool_watch);
    }
    let server = start_api(api.clone()).await;
    let dir = std::env::temp_dir().join(format!("kvroute-kube-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let (base, stop, router) = start_router(&server, &dir).await;
    let client = reqwest::Client::new();
    check_first_list(&client, &base, &api).await;

    let pod_events = lines("pods-watch-1.jsonl");
    for line in &pod_events[..4] {
        pod_lines.send(line.clone()).expect("the watch is open");
    }
    let c = "inference/vllm-llama3-8b-6f9d8c7b5-k7w9n";
    let what = "k7w9n ready, 2xk4p unready, 8hq2m deleted";
    until_names(&client, &base, &[c], what).await;

    pod_lines
        .send(pod_events[4].clone())
        .expect("the watch is open");
    let d = "inference/vllm-llama3-8b-6f9d8c7b5-zz8r4";
    until_names(&client, &base, &[d], "the relist after 410 Gone").await;
    let endpoints = "kvroute_discovery_endpoints";
    assert_eq!(metric(&client, &base, endpoints).await, 1.0);

    let pool_events = lines("pools-watch.jsonl");
    let errors = metric(&client, &base, "kvroute_discovery_errors_total").await;
    pool_lines.send(pool_events[0].clone()).expect("open");
    until_names(&client, &base, &[], "the pool deleted").await;
    assert!(metric(&client, &base, "kvroute_discovery_errors_total").await > errors);

    pool_lines.send(pool_events[1].clone()).expect("open");
    let (d0, d1) = (format!("{d}:8000"), format!("{d}:8001"));
    until_names(&client, &base, &[&d0, &d1], "the pool back with two ports").await;
    let now = workers(&client, &base).await;
    let events: Vec<&str> = now.iter().map(|w| w.2.as_str()).collect();
    assert_eq!(events, ["tcp://127.0.0.14:5557", "tcp://127.0.0.14:5558"]);
    assert_eq!(metric(&client, &base, endpoints).await, 2.0);
    assert!(metric(&client, &base, "kvroute_discovery_reloads_total").await >= 5.0);

    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), router).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without a way to reach an API server, serve stops at once and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeconfig_that_cannot_be_read_stops_serve_with_the_reason() {
    let missing =
        std::env::temp_dir().join(format!("kvroute-no-kubeconfig-{}", std::process::id()));
    let config = ServeConfig {
        discovery: Some(Discovery::Pool(PoolDiscovery {
            pool: "inference/llama3-8b".parse().expect("a pool"),
            kubeconfig: Some(missing.clone()),
            defaults: EndpointDefaults::default(),
        })),
        announce_access: false,
        ..ServeConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        serve(config, listener, std::future::pending()),
    )
    .await
    .expect("serve stops by itself");
    let e = ended.expect_err("no API server").to_string();
    assert!(
        e.contains("--inference-pool") && e.contains(&missing.display().to_string()),
        "{e}"
    );
}
