//! `kvroute serve`'s endpoint-picker flags: the Gateway API Inference
//! Extension's ext_proc service beside the HTTP API (`kvroute_server::epp`),
//! on GIE's ports when asked for without one.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use kvroute_server::epp::{EppConfig, EppListeners, EppTls, DEFAULT_HEALTH_PORT};

/// `--epp-port` given without a port: GIE's (`kvroute_server::epp::DEFAULT_PORT`).
const DEFAULT_PORT_TEXT: &str = "9002";

/// The endpoint-picker flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct EppArgs {
    /// Also serve as a Gateway API Inference Extension endpoint picker:
    /// Envoy's ext_proc (gRPC, FULL_DUPLEX_STREAMED) on this port, routing
    /// with the same index, workers, load and metrics as the HTTP API.
    /// Without a value, GIE's port 9002; 0 picks a free port (printed).
    #[arg(
        long,
        value_name = "PORT",
        num_args = 0..=1,
        default_missing_value = DEFAULT_PORT_TEXT,
        env = "KVROUTE_EPP_PORT"
    )]
    epp_port: Option<u16>,
    /// The endpoint picker's gRPC health port (plaintext; `liveness`,
    /// `readiness`, `""` and the ext_proc service); 0 picks a free port.
    #[arg(long, value_name = "PORT", default_value_t = DEFAULT_HEALTH_PORT, env = "KVROUTE_EPP_HEALTH_PORT")]
    epp_health_port: u16,
    /// Serve the ext_proc port without TLS (h2c). By default it is TLS,
    /// with --epp-cert and --epp-key or a self-signed certificate made at start.
    #[arg(long, env = "KVROUTE_EPP_PLAINTEXT", conflicts_with = "epp_cert")]
    epp_plaintext: bool,
    /// The ext_proc port's certificate chain, a PEM file (with --epp-key).
    #[arg(
        long,
        value_name = "FILE",
        requires = "epp_key",
        env = "KVROUTE_EPP_CERT"
    )]
    epp_cert: Option<PathBuf>,
    /// The ext_proc port's private key, a PEM file (with --epp-cert).
    #[arg(
        long,
        value_name = "FILE",
        requires = "epp_cert",
        env = "KVROUTE_EPP_KEY"
    )]
    epp_key: Option<PathBuf>,
}

impl EppArgs {
    /// The picker's settings, when it is asked for; it listens on `host`.
    pub fn config(&self, host: &str) -> Option<EppConfig> {
        self.epp_port?;
        let tls = match (&self.epp_cert, &self.epp_key) {
            _ if self.epp_plaintext => EppTls::Plaintext,
            (Some(cert), Some(key)) => EppTls::Files {
                cert: cert.clone(),
                key: key.clone(),
            },
            _ => EppTls::SelfSigned,
        };
        Some(EppConfig {
            tls,
            host: host.to_owned(),
        })
    }

    /// Refuses `--epp-port` in a build without the picker (feature `epp`),
    /// before anything listens.
    pub fn check_built(&self) -> Result<()> {
        if self.epp_port.is_some() && !kvroute_server::epp::BUILT {
            anyhow::bail!("--epp-port: {}", kvroute_server::epp::EppError::NotBuilt);
        }
        Ok(())
    }

    /// Binds the picker's ports on `host` and prints where they listen (so
    /// that a port 0 tells its caller the port); `None` when not asked for.
    pub async fn bind(&self, host: &str) -> Result<Option<EppListeners>> {
        let (Some(port), Some(config)) = (self.epp_port, self.config(host)) else {
            return Ok(None);
        };
        let bind = |port: u16| async move {
            let addr = format!("{host}:{port}");
            tokio::net::TcpListener::bind(&addr)
                .await
                .with_context(|| format!("binding {addr} for the endpoint picker"))
        };
        let ext_proc = bind(port).await?;
        let health = bind(self.epp_health_port).await?;
        let at = |l: &tokio::net::TcpListener| l.local_addr().context("the picker's address");
        eprintln!(
            "kvroute serve: endpoint picker (ext_proc) listening on {}://{}, gRPC health on grpc://{}",
            config.tls.scheme(),
            at(&ext_proc)?,
            at(&health)?
        );
        Ok(Some(EppListeners { ext_proc, health }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        epp: EppArgs,
    }

    fn parse(args: &[&str]) -> EppArgs {
        Flags::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .expect("flags parse")
            .epp
    }

    #[test]
    fn the_picker_is_off_unless_asked_for_and_on_gies_ports_when_asked_without_one() {
        assert_eq!(parse(&[]).config("h"), None);
        let on = parse(&["--epp-port"]);
        assert_eq!(
            on.epp_port,
            Some(kvroute_server::epp::DEFAULT_PORT),
            "the default-missing text is GIE's port"
        );
        assert_eq!(on.epp_health_port, DEFAULT_HEALTH_PORT);
        assert_eq!(on.config("h").map(|c| c.tls), Some(EppTls::SelfSigned));
        let given = parse(&[
            "--epp-port",
            "0",
            "--epp-health-port",
            "0",
            "--epp-plaintext",
        ]);
        assert_eq!((given.epp_port, given.epp_health_port), (Some(0), 0));
        assert_eq!(given.config("h").map(|c| c.tls), Some(EppTls::Plaintext));
        let files = parse(&["--epp-port", "--epp-cert", "c.pem", "--epp-key", "k.pem"]);
        assert!(matches!(
            files.config("h").map(|c| c.tls),
            Some(EppTls::Files { .. })
        ));
    }

    #[test]
    fn a_certificate_needs_its_key_and_excludes_plaintext() {
        let only_cert = ["serve", "--epp-port", "--epp-cert", "c.pem"];
        assert!(Flags::try_parse_from(only_cert).is_err());
        let both = [
            "serve",
            "--epp-port",
            "--epp-plaintext",
            "--epp-cert",
            "c.pem",
            "--epp-key",
            "k.pem",
        ];
        assert!(Flags::try_parse_from(both).is_err());
    }
}
