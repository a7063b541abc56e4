//! One module per subcommand: turn arguments into a call of the core or server.

pub mod args;
pub mod bench;
pub mod bounds;
pub mod demo;
pub mod endpoints;
pub mod epp;
pub mod fetch;
pub mod inspect;
pub mod load;
pub mod mocker;
pub mod otlp;
pub mod serve;
pub mod sim;
pub mod tenancy;
pub mod tokenizers;

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
///
/// The handlers are installed when this is called (it must be called
/// inside the runtime), not when the future is first polled, so a signal
/// that arrives while the command is still starting (after it printed its
/// address, before it awaits this) stops it cleanly instead of killing it.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let interrupt = signal(SignalKind::interrupt()).ok();
        let terminate = signal(SignalKind::terminate()).ok();
        let recv = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        async move {
            tokio::select! {
                () = recv(interrupt) => {}
                () = recv(terminate) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
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
