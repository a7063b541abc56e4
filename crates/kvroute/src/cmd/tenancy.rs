//! `kvroute serve`'s tenant flags: who a request is (a trusted gateway's
//! header, or the tenant its API key is bound to, or the key's
//! fingerprint), which priorities it may use, what each tenant weighs in
//! the overload queue's fair order, and how many tenants the queue tells
//! apart (`kvroute_server::router::tenants`).

use std::io::Read as _;

use anyhow::{bail, Result};
use clap::Args;
use kvroute_core::scheduler::fair::WEIGHT_RANGE;
use kvroute_server::proxy::{key_digest, PriorityRange, TenantConfig, MAX_TENANT};

/// The longest key file read (an API key is far shorter).
const MAX_KEY_FILE: u64 = 4_096;

/// The tenant flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct TenancyArgs {
    /// The header naming a request's tenant, read only with
    /// --trust-tenant-header. Otherwise a request's tenant is the one
    /// --tenant-key binds its API key (`Authorization: Bearer`) to, else the
    /// key's fingerprint (`key-` and 12 hex digits of its SHA-256), else
    /// `anonymous`. While the queue is used, tenants share the fleet in
    /// proportion to their weights, and a full queue refuses the tenant most
    /// over its share (docs/serving.md, "Who may do what")
    #[arg(long, default_value_t = TenantConfig::default().header, env = "KVROUTE_TENANT_HEADER", value_parser = super::args::parse_header_name)]
    tenant_header: String,
    /// Take the tenant header and `x-priority` as the word of a gateway in
    /// front that sets or strips both on every request. Off by default: the
    /// header is ignored, and a request may not ask for a priority before
    /// the default 0 unless its key's tenant is granted one
    /// (--tenant-priority)
    #[arg(long, env = "KVROUTE_TRUST_TENANT_HEADER")]
    trust_tenant_header: bool,
    /// Binds an API key to a tenant, NAME=KEY: KEY is the key's SHA-256 (64
    /// hex digits: `printf %s "$KEY" | sha256sum`) or a file holding the key
    /// (repeat for each key, or comma-separate them in the environment).
    /// Requests with the key are that tenant, whatever they send
    #[arg(long = "tenant-key", value_name = "NAME=SHA256|FILE", value_parser = parse_tenant_key, value_delimiter = ',', env = "KVROUTE_TENANT_KEYS")]
    tenant_keys: Vec<(String, [u8; 32])>,
    /// The `x-priority` values a tenant may use, NAME=MIN..MAX (lower is
    /// served first; a request's is clamped into them). Without
    /// --trust-tenant-header, for a tenant --tenant-key binds a key to; every
    /// other request may use 0..2147483647 (none before the default). With
    /// it, any tenant's (default: any priority)
    #[arg(long = "tenant-priority", value_name = "NAME=MIN..MAX", value_parser = parse_tenant_priority, value_delimiter = ',', env = "KVROUTE_TENANT_PRIORITIES")]
    tenant_priorities: Vec<(String, PriorityRange)>,
    /// A tenant's weight in the queue's fair order, NAME=W (W > 0; repeat
    /// for each tenant, or comma-separate them in the environment);
    /// unnamed tenants weigh 1. The tenants the flags name are also the
    /// ones metrics name (every other one is `other`)
    #[arg(long = "tenant-weight", value_name = "NAME=W", value_parser = parse_tenant_weight, value_delimiter = ',', env = "KVROUTE_TENANT_WEIGHTS")]
    tenant_weights: Vec<(String, f64)>,
    /// Tenants the flags do not name (API keys' fingerprints, `anonymous`,
    /// the trusted header's names) that the queue tells apart at once;
    /// requests of any further one wait as one tenant, `other`, so names
    /// made up per request cannot crowd out the others
    #[arg(long, default_value_t = TenantConfig::default().max_tenants, env = "KVROUTE_QUEUE_MAX_TENANTS")]
    queue_max_tenants: usize,
}

impl TenancyArgs {
    /// The proxy's tenant settings; an error for a priority range no
    /// request could ever be given.
    pub fn config(&self) -> Result<TenantConfig> {
        if !self.trust_tenant_header {
            for (name, _) in &self.tenant_priorities {
                if !self.tenant_keys.iter().any(|(bound, _)| bound == name) {
                    bail!(
                        "--tenant-priority {name}=…: no --tenant-key binds a key to `{name}`, and \
                         without --trust-tenant-header no other request is that tenant"
                    );
                }
            }
        }
        Ok(TenantConfig {
            header: self.tenant_header.clone(),
            trust_header: self.trust_tenant_header,
            keys: self.tenant_keys.clone(),
            priorities: self.tenant_priorities.clone(),
            weights: self.tenant_weights.clone(),
            max_tenants: self.queue_max_tenants,
        })
    }
}

/// `NAME=VALUE` with NAME a tenant name (1 to 128 printable ASCII
/// characters).
fn tenant_and(value: &str) -> Result<(&str, &str), String> {
    let (name, rest) = value
        .split_once('=')
        .ok_or_else(|| format!("`{value}`: expected NAME=…"))?;
    let name = name.trim();
    if name.is_empty() || name.len() > MAX_TENANT || !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "`{name}`: a tenant is 1 to {MAX_TENANT} printable ASCII characters"
        ));
    }
    Ok((name, rest.trim()))
}

/// `NAME=W`: a tenant name as the header or `key-…` names it, and a
/// weight in `kvroute_core`'s [`WEIGHT_RANGE`].
fn parse_tenant_weight(value: &str) -> Result<(String, f64), String> {
    let (name, weight) = tenant_and(value)?;
    let (min, max) = WEIGHT_RANGE;
    match weight.parse::<f64>() {
        Ok(w) if (min..=max).contains(&w) => Ok((name.to_owned(), w)),
        _ => Err(format!(
            "`{weight}`: a weight is a number from {min} to {max}"
        )),
    }
}

/// `NAME=MIN..MAX`.
fn parse_tenant_priority(value: &str) -> Result<(String, PriorityRange), String> {
    let (name, range) = tenant_and(value)?;
    Ok((name.to_owned(), PriorityRange::parse(range)?))
}

/// `NAME=SHA256` (64 hex digits) or `NAME=FILE` (a file holding the key,
/// surrounding white space ignored): the tenant and the key's SHA-256.
fn parse_tenant_key(value: &str) -> Result<(String, [u8; 32]), String> {
    let (name, key) = tenant_and(value)?;
    if let Some(digest) = hex_digest(key) {
        return Ok((name.to_owned(), digest));
    }
    let mut text = String::new();
    std::fs::File::open(key)
        .and_then(|f| f.take(MAX_KEY_FILE + 1).read_to_string(&mut text))
        .map_err(|e| {
            format!("`{key}`: neither a SHA-256 (64 hex digits) nor a readable key file ({e})")
        })?;
    let secret = text.trim();
    if secret.is_empty() || text.len() as u64 > MAX_KEY_FILE || secret.contains(char::is_whitespace)
    {
        return Err(format!(
            "`{key}`: a key file holds one API key (no spaces, at most {MAX_KEY_FILE} bytes)"
        ));
    }
    Ok((name.to_owned(), key_digest(secret)))
}

/// The 32 bytes 64 hex digits spell, if `text` is that.
fn hex_digest(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (byte, pair) in digest.iter_mut().zip(text.as_bytes().chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_weight_is_a_name_and_a_positive_number() {
        assert_eq!(parse_tenant_weight("gold=4"), Ok(("gold".to_owned(), 4.0)));
        assert_eq!(
            parse_tenant_weight("key-f3abf2a6cc4f=0.5"),
            Ok(("key-f3abf2a6cc4f".to_owned(), 0.5))
        );
        for bad in [
            "gold", "=2", "gold=0", "gold=-1", "gold=x", "a b=1", "gold=NaN",
        ] {
            assert!(parse_tenant_weight(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_tenant_key_is_a_sha256_or_a_file_holding_the_key() {
        // printf %s sk-test | sha256sum
        let hex = "f3abf2a6cc4f00987743db5f544ba345b4899ae31f326d8ee9c4816de153c9e0";
        let (name, digest) = parse_tenant_key(&format!("gold={hex}")).expect("a digest");
        assert_eq!((name.as_str(), digest), ("gold", key_digest("sk-test")));
        let dir = std::env::temp_dir().join(format!("kvroute-key-{}", std::process::id()));
        std::fs::write(&dir, "sk-gold\n").expect("a key file");
        let (_, from_file) =
            parse_tenant_key(&format!("gold={}", dir.display())).expect("a key file");
        assert_eq!(from_file, key_digest("sk-gold"));
        std::fs::write(&dir, "two words").expect("a key file");
        assert!(parse_tenant_key(&format!("gold={}", dir.display())).is_err());
        let _ = std::fs::remove_file(&dir);
        for bad in ["gold", "=abc", "gold=/nonexistent/key", "gold=/dev/zero"] {
            assert!(parse_tenant_key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_priority_range_is_granted_only_to_a_tenant_some_request_can_be() {
        let args = |extra: &[&str]| {
            use clap::Parser;
            #[derive(Parser)]
            struct Cli {
                #[command(flatten)]
                tenancy: TenancyArgs,
            }
            let argv = ["kvroute"].iter().chain(extra);
            Cli::try_parse_from(argv).map(|c| c.tenancy)
        };
        let hex = "ab".repeat(32);
        let key = format!("gold={hex}");
        let bound = args(&["--tenant-key", &key, "--tenant-priority", "gold=-5..0"]);
        let config = bound.expect("flags").config().expect("a config");
        assert_eq!(
            config.priorities[0].1,
            PriorityRange::parse("-5..0").expect("range")
        );
        assert!(!config.trust_header, "the header is not trusted by default");
        let unbound = args(&["--tenant-priority", "gold=-5..0"]).expect("flags");
        assert!(unbound.config().is_err());
        let trusted = args(&["--tenant-priority", "gold=-5..0", "--trust-tenant-header"]);
        assert!(trusted.expect("flags").config().is_ok());
        assert!(args(&["--tenant-priority", "gold=5..-5"]).is_err());
    }
}
