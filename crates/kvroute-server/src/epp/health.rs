//! `grpc.health.v1.Health` for the picker, as GIE's pickers answer it:
//! `liveness` is always SERVING; `readiness`, `""` and the ext_proc
//! service's own name are SERVING while at least one worker can be routed
//! to, and NOT_SERVING from shutdown on (so Envoy stops sending while the
//! streams under way finish). Any other name is unknown (`NOT_FOUND`, the
//! health protocol's answer to `Check`). The same statuses are served on
//! the health port and on the ext_proc port, where Envoy's cluster health
//! check asks for the ext_proc service.

#[cfg(feature = "epp")]
use std::sync::Arc;
#[cfg(feature = "epp")]
use std::time::Duration;

#[cfg(feature = "epp")]
use tokio::sync::watch;
#[cfg(feature = "epp")]
use tonic_health::server::HealthReporter;
#[cfg(feature = "epp")]
use tonic_health::ServingStatus;

#[cfg(feature = "epp")]
use crate::router::Router;

/// The ext_proc service's name, which Envoy's health check asks for.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The names that follow readiness.
pub const READY_NAMES: [&str; 3] = ["", "readiness", EXT_PROC_SERVICE];

#[cfg(feature = "epp")]
/// How often readiness is re-read from the workers.
const EVERY: Duration = Duration::from_secs(1);

#[cfg(feature = "epp")]
/// Whether the picker can route: some worker is known.
fn ready(router: &Router) -> bool {
    !router.targets().is_empty()
}

#[cfg(feature = "epp")]
async fn set_ready(reporter: &HealthReporter, serving: bool) {
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for name in READY_NAMES {
        reporter.set_service_status(name, status).await;
    }
}

#[cfg(feature = "epp")]
/// Keeps the statuses up to date until `stop` turns true, then reports
/// NOT_SERVING for all but `liveness`.
pub async fn keep_reporting(
    reporter: HealthReporter,
    router: Arc<Router>,
    mut stop: watch::Receiver<bool>,
) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let mut last = None;
    let mut tick = tokio::time::interval(EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let now = ready(&router);
        if last != Some(now) {
            set_ready(&reporter, now).await;
            last = Some(now);
        }
    }
    set_ready(&reporter, false).await;
}
