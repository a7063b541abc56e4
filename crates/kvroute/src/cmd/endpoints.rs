//! `kvroute serve`'s discovery flags: workers listed in a file of llm-d's
//! `endpoints.yaml` shape, or the pods of a Kubernetes InferencePool
//! (feature `kube`), followed as they change (`kvroute_server::discovery`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use kvroute_server::discovery::{Discovery, EndpointDefaults, FileDiscovery, PoolRef};
use kvroute_server::ingest::spec::WorkerFlavor;

/// The discovery flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct EndpointsArgs {
    /// A file of workers in llm-d's `endpoints.yaml` shape (`endpoints:` a
    /// list of `name`, `namespace`, `address`, `port`, `labels`), read at
    /// start and again whenever it changes: workers gone from it are
    /// removed, new ones added. Labels `kvroute.io/events-port`,
    /// `kvroute.io/replay-port`, `kvroute.io/flavor`, `kvroute.io/dp-size`,
    /// `kvroute.io/role` (or `llm-d.ai/role`), `kvroute.io/bootstrap-port`,
    /// `kvroute.io/block-size` and `kvroute.io/model` complete each entry.
    /// A change is applied once the file stayed unchanged for a poll. A file
    /// that cannot be read or parsed, is over 1 MiB, 4 096 entries or the
    /// YAML bounds (aliases counted expanded), changed while it was read, or
    /// lists no endpoints (empty; only `endpoints: []` removes every
    /// worker) changes nothing and is counted (docs/serving.md)
    #[arg(long, value_name = "FILE", env = "KVROUTE_ENDPOINTS_FILE")]
    endpoints_file: Option<PathBuf>,
    /// Follow a Gateway API Inference Extension InferencePool
    /// (inference.networking.k8s.io/v1), NAMESPACE/NAME or NAME in the
    /// client's namespace: each ready pod its selector names becomes one
    /// worker per target port, completed by the pod's annotations (or
    /// labels) of the same names as the endpoints file's labels; not-ready
    /// and deleted pods are removed. Needs a kvroute built with the `kube`
    /// feature, and RBAC to get, list and watch pods and inferencepools
    /// (docs/kubernetes.md)
    #[arg(
        long,
        value_name = "NAMESPACE/NAME",
        env = "KVROUTE_INFERENCE_POOL",
        conflicts_with = "endpoints_file"
    )]
    inference_pool: Option<PoolRef>,
    /// The kubeconfig file --inference-pool reaches the API server with;
    /// without one, KUBECONFIG or ~/.kube/config, else the pod's service
    /// account.
    #[arg(
        long,
        value_name = "FILE",
        env = "KVROUTE_KUBECONFIG",
        requires = "inference_pool"
    )]
    kubeconfig: Option<PathBuf>,
    /// The KV-event port of endpoints (and pool pods) whose labels name none.
    #[arg(long, default_value_t = EndpointDefaults::default().events_port, env = "KVROUTE_ENDPOINTS_EVENTS_PORT")]
    endpoints_events_port: u16,
    /// The replay port of endpoints (and pool pods) whose labels name none
    /// (default: none).
    #[arg(long, env = "KVROUTE_ENDPOINTS_REPLAY_PORT")]
    endpoints_replay_port: Option<u16>,
    /// The engine of endpoints (and pool pods) whose labels name none: vllm
    /// or sglang.
    #[arg(long, default_value_t = EndpointDefaults::default().flavor, env = "KVROUTE_ENDPOINTS_FLAVOR")]
    endpoints_flavor: WorkerFlavor,
    /// How often the file's size and modification time are checked, in ms;
    /// a change is read once two checks in a row find it the same.
    #[arg(long, default_value_t = FileDiscovery::DEFAULT_EVERY.as_millis() as u64, value_parser = clap::value_parser!(u64).range(50..=3_600_000), env = "KVROUTE_ENDPOINTS_POLL_MS")]
    endpoints_poll_ms: u64,
}

impl EndpointsArgs {
    /// What completes a discovered worker's labels.
    fn defaults(&self) -> EndpointDefaults {
        EndpointDefaults {
            events_port: self.endpoints_events_port,
            replay_port: self.endpoints_replay_port,
            flavor: self.endpoints_flavor,
        }
    }

    /// The discovery these flags ask for, if any; an error for
    /// --inference-pool in a kvroute built without the `kube` feature.
    pub fn discovery(&self) -> Result<Option<Discovery>> {
        if let Some(pool) = &self.inference_pool {
            return self.pool_discovery(pool).map(Some);
        }
        Ok(self.endpoints_file.clone().map(|path| {
            Discovery::File(FileDiscovery {
                path,
                every: Duration::from_millis(self.endpoints_poll_ms),
                defaults: self.defaults(),
            })
        }))
    }

    #[cfg(feature = "kube")]
    fn pool_discovery(&self, pool: &PoolRef) -> Result<Discovery> {
        Ok(Discovery::Pool(kvroute_server::discovery::PoolDiscovery {
            pool: pool.clone(),
            kubeconfig: self.kubeconfig.clone(),
            defaults: self.defaults(),
        }))
    }

    #[cfg(not(feature = "kube"))]
    fn pool_discovery(&self, pool: &PoolRef) -> Result<Discovery> {
        anyhow::bail!(
            "--inference-pool {pool}: this kvroute was built without the `kube` feature; \
             build it with `cargo build --release -p kvroute --features kube`"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        endpoints: EndpointsArgs,
    }

    fn parse(args: &[&str]) -> Result<EndpointsArgs, clap::Error> {
        Flags::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map(|f| f.endpoints)
    }

    #[test]
    fn one_source_at_most_and_the_pool_only_where_built_in() {
        let none = parse(&[]).expect("no flags");
        assert!(none.discovery().expect("fine").is_none());
        let file = parse(&[
            "--endpoints-file",
            "e.yaml",
            "--endpoints-events-port",
            "6000",
        ])
        .expect("a file");
        match file.discovery().expect("fine") {
            Some(Discovery::File(f)) => assert_eq!(f.defaults.events_port, 6000),
            other => panic!("{other:?}"),
        }
        assert!(parse(&["--endpoints-file", "e", "--inference-pool", "ns/p"]).is_err());
        assert!(parse(&["--kubeconfig", "k"]).is_err(), "needs a pool");
        assert!(parse(&["--inference-pool", "ns/Not_A_Name"]).is_err());
        let pool = parse(&[
            "--inference-pool",
            "inference/llama",
            "--endpoints-flavor",
            "sglang",
        ])
        .expect("a pool");
        let found = pool.discovery();
        #[cfg(feature = "kube")]
        match found.expect("built in") {
            Some(Discovery::Pool(p)) => {
                assert_eq!(p.pool.to_string(), "inference/llama");
                assert_eq!(p.defaults.flavor, WorkerFlavor::Sglang);
            }
            other => panic!("{other:?}"),
        }
        #[cfg(not(feature = "kube"))]
        {
            let e = found.expect_err("not built in").to_string();
            assert!(
                e.contains("`kube` feature") && e.contains("--features kube"),
                "{e}"
            );
        }
    }
}
