//! TLS on the ext_proc port, on by default as GIE's pickers serve it: the
//! operator's certificate and key (PEM files), or a self-signed certificate
//! made at start (Envoy's ext_proc cluster in the GIE examples accepts any
//! certificate: its `validation_context` is empty). `--epp-plaintext`
//! turns it off, for a data plane that speaks h2c to the picker.

use std::path::PathBuf;

#[cfg(feature = "epp")]
use tonic::transport::Identity;

/// How the ext_proc port is secured.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EppTls {
    /// A certificate made at start for `localhost`, the loopback
    /// addresses and the listening host.
    #[default]
    SelfSigned,
    /// The operator's certificate chain and private key, PEM files.
    Files {
        /// The certificate chain.
        cert: PathBuf,
        /// The private key.
        key: PathBuf,
    },
    /// No TLS (h2c).
    Plaintext,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate or key file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The self-signed certificate could not be made.
    #[cfg(feature = "epp")]
    #[error("making a self-signed certificate: {0}")]
    SelfSigned(#[from] rcgen::Error),
}

impl EppTls {
    /// The scheme a client connects with, for the listening line.
    pub fn scheme(&self) -> &'static str {
        match self {
            EppTls::Plaintext => "grpc",
            EppTls::SelfSigned | EppTls::Files { .. } => "grpcs",
        }
    }

    /// The server's identity (`None`: plaintext); a self-signed one also
    /// names `host`.
    #[cfg(feature = "epp")]
    pub fn identity(&self, host: &str) -> Result<Option<Identity>, TlsError> {
        match self {
            EppTls::Plaintext => Ok(None),
            EppTls::Files { cert, key } => {
                let read = |path: &PathBuf| {
                    std::fs::read(path).map_err(|source| TlsError::Read {
                        path: path.clone(),
                        source,
                    })
                };
                Ok(Some(Identity::from_pem(read(cert)?, read(key)?)))
            }
            EppTls::SelfSigned => {
                let mut names: Vec<String> =
                    vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
                if !host.is_empty() && !names.iter().any(|n| n == host) {
                    names.push(host.to_owned());
                }
                let made = rcgen::generate_simple_self_signed(names)?;
                Ok(Some(Identity::from_pem(
                    made.cert.pem(),
                    made.signing_key.serialize_pem(),
                )))
            }
        }
    }
}

#[cfg(all(test, feature = "epp"))]
mod tests {
    use super::*;

    #[test]
    fn a_self_signed_identity_is_made_and_missing_files_are_named() {
        assert!(EppTls::SelfSigned
            .identity("10.1.2.3")
            .expect("made")
            .is_some());
        assert!(EppTls::Plaintext.identity("").expect("none").is_none());
        let missing = EppTls::Files {
            cert: "/nonexistent/tls.crt".into(),
            key: "/nonexistent/tls.key".into(),
        };
        let e = missing.identity("").expect_err("no such file");
        assert!(e.to_string().contains("/nonexistent/tls.crt"), "{e}");
    }
}
