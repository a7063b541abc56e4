//! The timed loops of `kvroute bench proxy`: one path alone (closed or open
//! loop), or both paths alternating request by request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::body::Bodies;
use crate::error::{Error, Result};

/// How one timed loop runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Loop {
    /// Requests in all (spread evenly over the tasks; a remainder is not sent).
    pub requests: u64,
    /// Tasks, each with one request in flight.
    pub concurrency: u64,
    /// Open loop at this many requests per second; 0: closed loop.
    pub rate: f64,
    /// The first request's number (prompts are a function of it).
    pub first: u64,
}

/// One path's latencies in µs, and the wall time of the loop they ran in.
pub(crate) struct Timed {
    /// The latency of each request.
    pub latencies_us: Vec<f64>,
    /// Wall time of the whole loop, s.
    pub secs: f64,
}

/// POSTs `body` and reads the whole answer; its latency in µs from `since`.
async fn timed_post(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    since: Instant,
) -> Result<f64> {
    let resp = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(Error::http(format!("POST {url}")))?;
    let status = resp.status();
    resp.bytes()
        .await
        .map_err(Error::http(format!("reading {url}")))?;
    if !status.is_success() {
        return Err(Error::Unexpected(format!("{url} answered {status}")));
    }
    Ok(since.elapsed().as_secs_f64() * 1e6)
}

/// Runs `each(task, k)` for `k` in `0..requests / concurrency` on every task
/// and gathers what the tasks return.
async fn on_tasks<T, F, Fut>(spec: Loop, each: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Result<T>> + Send + 'static,
{
    let tasks: Vec<_> = (0..spec.concurrency)
        .map(|task| tokio::spawn(each(task)))
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(
            t.await
                .map_err(|e| Error::Unexpected(format!("bench task: {e}")))??,
        );
    }
    Ok(out)
}

/// One path alone: the requests over `urls` (round-robin by request number).
pub(crate) async fn single(
    client: &reqwest::Client,
    urls: Arc<Vec<String>>,
    bodies: &Bodies,
    spec: Loop,
) -> Result<Timed> {
    let started = Instant::now();
    let per_task = spec.requests / spec.concurrency.max(1);
    let per_task_results = on_tasks(spec, |task| {
        let (client, urls, bodies) = (client.clone(), urls.clone(), bodies.clone());
        async move {
            let mut lat = Vec::with_capacity(per_task as usize);
            for k in 0..per_task {
                let i = k * spec.concurrency + task;
                let scheduled = if spec.rate > 0.0 {
                    let at = started + Duration::from_secs_f64(i as f64 / spec.rate);
                    tokio::time::sleep_until(at.into()).await;
                    at
                } else {
                    Instant::now()
                };
                let n = spec.first + i;
                let body = bodies.body(n, 0);
                let url = &urls[(n % urls.len() as u64) as usize];
                lat.push(timed_post(&client, url, &body, scheduled).await?);
            }
            Ok(lat)
        }
    })
    .await?;
    Ok(Timed {
        latencies_us: per_task_results.into_iter().flatten().collect(),
        secs: started.elapsed().as_secs_f64(),
    })
}

/// Both paths, alternating request by request on every task: each sends one
/// request straight to an engine, then one through the router (closed
/// loop). Returns (direct, routed), both over the same wall time.
pub(crate) async fn interleaved(
    client: &reqwest::Client,
    direct: Arc<Vec<String>>,
    routed: Arc<Vec<String>>,
    bodies: &Bodies,
    spec: Loop,
) -> Result<(Timed, Timed)> {
    let started = Instant::now();
    let per_task = spec.requests / spec.concurrency.max(1);
    let per_task_results = on_tasks(spec, |task| {
        let (client, bodies) = (client.clone(), bodies.clone());
        let (direct, routed) = (direct.clone(), routed.clone());
        async move {
            let mut d = Vec::with_capacity(per_task as usize);
            let mut r = Vec::with_capacity(per_task as usize);
            for k in 0..per_task {
                let n = spec.first + k * spec.concurrency + task;
                let url = &direct[(n % direct.len() as u64) as usize];
                d.push(timed_post(&client, url, &bodies.body(n, 0), Instant::now()).await?);
                let url = &routed[(n % routed.len() as u64) as usize];
                r.push(timed_post(&client, url, &bodies.body(n, 1), Instant::now()).await?);
            }
            Ok((d, r))
        }
    })
    .await?;
    let (d, r): (Vec<_>, Vec<_>) = per_task_results.into_iter().unzip();
    let secs = started.elapsed().as_secs_f64();
    let timed = |lat: Vec<Vec<f64>>| Timed {
        latencies_us: lat.into_iter().flatten().collect(),
        secs,
    };
    Ok((timed(d), timed(r)))
}
