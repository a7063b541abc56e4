//! One module per subcommand: turn arguments into a call of the core or server.

pub mod bench;
pub mod demo;
pub mod inspect;
pub mod load;
pub mod mocker;
pub mod serve;
pub mod sim;

use tracing_subscriber::filter::{LevelFilter, Targets};

/// Logs to stderr at `default` level, or as `RUST_LOG` says (`target=level`
/// pairs); colour only on a terminal.
pub fn init_logging(default: LevelFilter) {
    use std::io::IsTerminal as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|s| s.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(default));
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal()),
        )
        .with(filter)
        .try_init();
}

/// Completes on Ctrl-C or SIGTERM: how long-running commands are stopped.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

/// The multi-threaded tokio runtime every networked command runs on: one
/// worker per core, and at most as many threads again for blocking work
/// (CPU-bound tokenizing and registry upkeep gain nothing from more).
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context as _;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    tokio::runtime::Builder::new_multi_thread()
        .max_blocking_threads(cores)
        .enable_all()
        .build()
        .context("starting the runtime")
}
