//! The load run's progress bar on stderr: redrawn every 100 ms on a
//! terminal, one line every 5 s otherwise, cleared at the end.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use crate::driver::LoadOptions;

/// A running progress display; [`Progress::finish`] stops and clears it.
#[derive(Debug)]
pub(crate) struct Progress {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::oneshot::Sender<()>,
}

impl Progress {
    /// Starts drawing `options`' run, which started at `started`; `counts`
    /// reads (requests done, of which failed).
    pub(crate) fn spawn(
        options: LoadOptions,
        started: Instant,
        counts: impl Fn() -> (u64, u64) + Send + 'static,
    ) -> Progress {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let terminal = std::io::stderr().is_terminal();
        let every = if terminal {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(5)
        };
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                let (done, failed) = counts();
                let text = line(&options, done, failed, started.elapsed());
                let mut err = std::io::stderr().lock();
                let _ = if terminal {
                    write!(err, "\r\x1b[2K{text}")
                } else {
                    writeln!(err, "{text}")
                };
                let _ = err.flush();
            }
            if terminal {
                let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
            }
        });
        Progress { task, stop }
    }

    /// Stops drawing and clears the bar.
    pub(crate) async fn finish(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// One progress line: the label, a bar filled by requests done or time spent
/// (whichever is further along), and the counts.
fn line(options: &LoadOptions, done: u64, failed: u64, elapsed: Duration) -> String {
    let elapsed = elapsed.as_secs_f64();
    let by_count = (options.requests > 0).then(|| done as f64 / options.requests as f64);
    let by_time = options
        .max_duration
        .map(|d| elapsed / d.as_secs_f64().max(1e-9));
    let fraction = match (by_count, by_time) {
        (Some(a), Some(b)) => a.max(b),
        (Some(a), None) => a,
        (None, Some(b)) => b,
        (None, None) => 0.0,
    }
    .clamp(0.0, 1.0);
    const WIDTH: usize = 30;
    let filled = (fraction * WIDTH as f64).round() as usize;
    let bar: String = "#".repeat(filled) + &"-".repeat(WIDTH - filled);
    let total = if options.requests > 0 {
        options.requests.to_string()
    } else {
        "?".into()
    };
    format!(
        "{:<10} [{bar}] {done}/{total} done, {failed} failed, {elapsed:.1} s",
        options.label
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Arrival;
    use crate::workload::WorkloadSpec;

    fn options(requests: usize, max_duration: Option<Duration>) -> LoadOptions {
        LoadOptions {
            workload: WorkloadSpec::default(),
            arrival: Arrival::Closed { concurrency: 1 },
            requests,
            max_duration,
            progress: true,
            label: "kv".into(),
        }
    }

    #[test]
    fn the_bar_fills_by_count_or_by_time_whichever_is_further() {
        let half = line(&options(100, None), 50, 2, Duration::from_secs(3));
        assert_eq!(
            half,
            format!(
                "kv         [{}{}] 50/100 done, 2 failed, 3.0 s",
                "#".repeat(15),
                "-".repeat(15)
            )
        );
        let timed = line(
            &options(0, Some(Duration::from_secs(10))),
            7,
            0,
            Duration::from_secs(10),
        );
        assert!(timed.contains(&format!("[{}]", "#".repeat(30))), "{timed}");
        assert!(timed.contains("7/? done"), "{timed}");
        let both = line(
            &options(100, Some(Duration::from_secs(10))),
            10,
            0,
            Duration::from_secs(5),
        );
        assert!(both.contains(&format!("[{}{}]", "#".repeat(15), "-".repeat(15))));
    }
}
