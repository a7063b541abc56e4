//! Tenants at the router: whose request it is, which priorities it may ask
//! for, what it weighs in the overload queue's fair order, and the label
//! its metrics go under.
//!
//! **Who a request is** (its [`Identity`]), first that applies:
//! 1. with `--trust-tenant-header` only, the value of its `--tenant-header`
//!    (default `x-tenant`): the word of a gateway in front, which sets or
//!    strips it (and `x-priority`) for every request;
//! 2. the tenant `--tenant-key NAME=…` binds its API key to
//!    (`Authorization: Bearer …`, matched by the key's whole SHA-256);
//! 3. the fingerprint of its API key
//!    ([`digest_fingerprint`]:
//!    `key-` and 12 hex digits of the key's SHA-256; the key itself is never
//!    logged or exported);
//! 4. [`ANONYMOUS`].
//!
//! Without `--trust-tenant-header` the header is ignored: a client cannot
//! name itself after another tenant, and names it makes up per request are
//! not tenants. A made-up API key still is (the router does not check keys),
//! so the queue tells at most `--queue-max-tenants` tenants that the flags
//! do not name apart at once (`super::queue`).
//!
//! **Priorities.** A request's `x-priority` is clamped into its tenant's
//! [`PriorityRange`]: with `--trust-tenant-header`, any priority (the
//! gateway's word) unless `--tenant-priority NAME=MIN..MAX` narrows its
//! tenant's; without it, the range `--tenant-priority` grants the tenant a
//! key is bound to, and for everyone else [`PriorityRange::UNTRUSTED`]:
//! the default 0 or a lower urgency (a higher number), never a higher one.
//!
//! Each tenant weighs 1 unless `--tenant-weight NAME=W` says otherwise.
//! Metrics name the tenants the flags name and count every other one as
//! `other`, so their label set is bounded by the flags, not by the clients.

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::{header, HeaderMap};
use kvroute_core::scheduler::fair::clamp_weight;
use ring::digest;

use super::Router;
use crate::api::ProxyError;
use crate::metrics::tenants::{TenantLabel, OTHER_TENANT};

/// The longest tenant name taken from the header.
pub const MAX_TENANT: usize = 128;

/// The tenant of a request that names none and carries no API key.
pub const ANONYMOUS: &str = "anonymous";

/// The default of `--queue-max-tenants`: tenants the flags do not name
/// that the queue tells apart at once.
pub const DEFAULT_MAX_TENANTS: usize = 8;

/// The `x-priority` values a tenant may use (lower is served first); a
/// request's is clamped into them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriorityRange {
    /// The lowest (most urgent) priority allowed.
    pub most_urgent: i32,
    /// The highest (least urgent) priority allowed.
    pub least_urgent: i32,
}

impl PriorityRange {
    /// Every priority: a trusted gateway's tenant with no narrower range.
    pub const ANY: PriorityRange = PriorityRange {
        most_urgent: i32::MIN,
        least_urgent: i32::MAX,
    };

    /// The default 0 or less urgent: an untrusted client may lower its own
    /// priority, never raise it above everyone else's.
    pub const UNTRUSTED: PriorityRange = PriorityRange {
        most_urgent: 0,
        least_urgent: i32::MAX,
    };

    /// `MIN..MAX` (integers, `MIN <= MAX`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (low, high) = text
            .split_once("..")
            .ok_or_else(|| format!("`{text}`: expected MIN..MAX"))?;
        let bound = |v: &str| {
            v.trim()
                .parse::<i32>()
                .map_err(|_| format!("`{v}`: a priority is an integer (32 bits)"))
        };
        let (most_urgent, least_urgent) = (bound(low)?, bound(high)?);
        if most_urgent > least_urgent {
            return Err(format!("`{text}`: MIN must not be above MAX"));
        }
        Ok(PriorityRange {
            most_urgent,
            least_urgent,
        })
    }

    /// `priority` clamped into the range.
    pub fn clamp(self, priority: i64) -> i64 {
        priority.clamp(i64::from(self.most_urgent), i64::from(self.least_urgent))
    }
}

/// The tenant flags: `--tenant-header`, `--trust-tenant-header`,
/// `--tenant-key`, `--tenant-priority`, `--tenant-weight` and
/// `--queue-max-tenants`.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantConfig {
    /// The header naming a request's tenant (lower case).
    pub header: String,
    /// Whether that header (and `x-priority`) is a trusted gateway's word;
    /// otherwise the header is ignored.
    pub trust_header: bool,
    /// API keys bound to tenants: (tenant, SHA-256 of the key).
    pub keys: Vec<(String, [u8; 32])>,
    /// The priorities trusted tenants may use.
    pub priorities: Vec<(String, PriorityRange)>,
    /// The tenants given a weight, with it (every other tenant weighs 1).
    pub weights: Vec<(String, f64)>,
    /// Tenants the flags do not name that the queue tells apart at once;
    /// the rest wait as one, `other`.
    pub max_tenants: usize,
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            header: "x-tenant".to_owned(),
            trust_header: false,
            keys: Vec::new(),
            priorities: Vec::new(),
            weights: Vec::new(),
            max_tenants: DEFAULT_MAX_TENANTS,
        }
    }
}

impl TenantConfig {
    /// The tenants the flags name (`--tenant-weight`, `--tenant-key`,
    /// `--tenant-priority`), each once: the ones metrics name.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.weights.iter().map(|(n, _)| n.as_str()).collect();
        names.extend(self.keys.iter().map(|(n, _)| n.as_str()));
        names.extend(self.priorities.iter().map(|(n, _)| n.as_str()));
        names.sort_unstable();
        names.dedup();
        names
    }
}

/// Who a request is, as far as the router can tell (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Its tenant.
    pub tenant: String,
    /// The priorities it may use.
    pub priorities: PriorityRange,
}

/// The named tenants' weights, labels, keys and priorities, looked up per
/// request.
#[derive(Debug)]
pub struct Tenants {
    named: HashMap<String, (f64, TenantLabel)>,
    keys: HashMap<[u8; 32], Arc<str>>,
    priorities: HashMap<String, PriorityRange>,
    other: TenantLabel,
    trust_header: bool,
    max_tenants: usize,
}

impl Tenants {
    /// The lookup for `config` (a name or key given twice keeps its last
    /// setting).
    pub fn new(config: &TenantConfig) -> Self {
        let weight = |name: &str| {
            let w = config.weights.iter().rev().find(|(n, _)| n == name);
            w.map_or(1.0, |(_, w)| clamp_weight(*w))
        };
        let named = config
            .names()
            .into_iter()
            .map(|name| {
                let label = TenantLabel(Arc::from(name));
                (name.to_owned(), (weight(name), label))
            })
            .collect();
        Tenants {
            named,
            keys: (config.keys.iter())
                .map(|(name, digest)| (*digest, Arc::from(name.as_str())))
                .collect(),
            priorities: config.priorities.iter().cloned().collect(),
            other: TenantLabel(Arc::from(OTHER_TENANT)),
            trust_header: config.trust_header,
            max_tenants: config.max_tenants,
        }
    }

    /// `tenant`'s weight: its `--tenant-weight`, else 1.
    pub fn weight(&self, tenant: &str) -> f64 {
        self.named.get(tenant).map_or(1.0, |(w, _)| *w)
    }

    /// The label `tenant`'s metrics go under: its name when the flags name
    /// it, else `other`.
    pub fn label(&self, tenant: &str) -> &TenantLabel {
        self.named.get(tenant).map_or(&self.other, |(_, l)| l)
    }

    /// Whether the flags name `tenant` (or it is `other`, where the tenants
    /// beyond `--queue-max-tenants` wait): the queue always tells it apart.
    pub fn is_known(&self, tenant: &str) -> bool {
        tenant == OTHER_TENANT || self.named.contains_key(tenant)
    }

    /// Tenants the flags do not name that the queue tells apart at once.
    pub fn max_tenants(&self) -> usize {
        self.max_tenants
    }

    /// Who a request with these headers is (see the module docs), the
    /// header's tenant as `from_header` when it is trusted and given.
    fn identify(&self, from_header: Option<&str>, api_key: Option<&str>) -> Identity {
        // Behind a trusted gateway every request's `x-priority` is its word.
        let default = if self.trust_header {
            PriorityRange::ANY
        } else {
            PriorityRange::UNTRUSTED
        };
        let named = |tenant: &str| Identity {
            tenant: tenant.to_owned(),
            priorities: self.priorities.get(tenant).copied().unwrap_or(default),
        };
        if let Some(tenant) = from_header.filter(|_| self.trust_header) {
            return named(tenant);
        }
        let unnamed = |tenant: String| Identity {
            tenant,
            priorities: default,
        };
        let Some(key) = api_key else {
            return unnamed(ANONYMOUS.to_owned());
        };
        let digest = key_digest(key);
        match self.keys.get(&digest) {
            Some(tenant) => named(tenant),
            None => unnamed(digest_fingerprint(&digest)),
        }
    }
}

impl Router {
    /// Who a request is (see the module docs); a 400 when the header is
    /// trusted and not printable ASCII of 1 to [`MAX_TENANT`] bytes.
    pub fn identify(&self, headers: &HeaderMap) -> Result<Identity, ProxyError> {
        let tenants = self.waiting.tenants();
        let name = self.config.tenants.header.as_str();
        let from_header = match headers
            .get(name)
            .filter(|_| self.config.tenants.trust_header)
        {
            None => None,
            Some(value) => match value.to_str() {
                Ok(t)
                    if (1..=MAX_TENANT).contains(&t.len())
                        && t.bytes().all(|b| b.is_ascii_graphic()) =>
                {
                    Some(t)
                }
                _ => {
                    return Err(ProxyError::bad_request(format!(
                        "`{name}` must be 1 to {MAX_TENANT} printable ASCII characters"
                    )))
                }
            },
        };
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        Ok(tenants.identify(from_header, key))
    }

    /// The tenant a request's headers name (see [`Router::identify`]).
    pub fn tenant_of(&self, headers: &HeaderMap) -> Result<String, ProxyError> {
        self.identify(headers).map(|i| i.tenant)
    }

    /// The priority a request of `identity` asking for `requested` gets:
    /// clamped into what its tenant may use (counted when it changes).
    pub fn allowed_priority(&self, identity: &Identity, requested: i64) -> i64 {
        let priority = identity.priorities.clamp(requested);
        if priority != requested {
            self.metrics.tenants.priority_clamped.inc();
            tracing::debug!(
                tenant = %identity.tenant, requested, priority,
                "x-priority outside what the tenant may use: clamped"
            );
        }
        priority
    }
}

/// The token of an `Authorization: Bearer <token>` value (the scheme is
/// case-insensitive); `None` for another scheme or an empty token.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The SHA-256 of an API key: what an operator binds to a tenant (the key
/// itself need not be written in flags or files the router reads).
pub fn key_digest(api_key: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest::digest(&digest::SHA256, api_key.as_bytes()).as_ref());
    out
}

/// The name an API key's tenant goes by in metrics, logs and
/// `--tenant-weight`: `key-` and the first 12 hex digits of the key's
/// SHA-256, stable across restarts and replicas and never the key itself
/// (`printf %s "$KEY" | sha256sum | cut -c1-12` gives the digits).
#[cfg(test)]
pub fn key_fingerprint(api_key: &str) -> String {
    digest_fingerprint(&key_digest(api_key))
}

/// The name an API key's tenant goes by in metrics, logs and
/// `--tenant-weight`, from the key's [`key_digest`]: `key-` and the first 12
/// hex digits of the key's SHA-256, stable across restarts and replicas and
/// never the key itself (`printf %s "$KEY" | sha256sum | cut -c1-12` gives
/// the digits).
pub fn digest_fingerprint(digest: &[u8; 32]) -> String {
    let mut name = String::with_capacity(16);
    name.push_str("key-");
    for byte in &digest[..6] {
        name.push_str(&format!("{byte:02x}"));
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_api_keys_fingerprint_is_stable_and_hides_the_key() {
        // printf %s sk-test | sha256sum
        assert_eq!(key_fingerprint("sk-test"), "key-f3abf2a6cc4f");
        assert!(!key_fingerprint("sk-test").contains("sk-test"));
        assert_ne!(key_fingerprint("sk-test"), key_fingerprint("sk-tesu"));
    }
    use axum::http::HeaderValue;
    use kvroute_core::index::SharedIndex;

    fn router(trust_header: bool) -> Router {
        let config = super::super::ProxyConfig {
            tenants: TenantConfig {
                header: "x-team".to_owned(),
                trust_header,
                keys: vec![("gold".to_owned(), key_digest("sk-gold"))],
                priorities: vec![
                    (
                        "gold".to_owned(),
                        PriorityRange::parse("-10..5").expect("a range"),
                    ),
                    (
                        "batch".to_owned(),
                        PriorityRange::parse("3..9").expect("a range"),
                    ),
                ],
                weights: vec![("gold".to_owned(), 4.0), ("free".to_owned(), 0.0)],
                max_tenants: 4,
            },
            ..Default::default()
        };
        Router::builder(config, Arc::new(SharedIndex::default()))
            .build()
            .expect("a router")
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, HeaderValue::from_str(v).expect("a header value"));
        }
        map
    }

    fn who(router: &Router, pairs: &[(&'static str, &str)]) -> (String, PriorityRange) {
        let id = router.identify(&headers(pairs)).expect("an identity");
        (id.tenant, id.priorities)
    }

    #[test]
    fn an_untrusted_header_is_ignored_and_the_api_key_names_the_tenant() {
        let router = router(false);
        let untrusted = PriorityRange::UNTRUSTED;
        let both = [("x-team", "gold"), ("authorization", "Bearer sk-test")];
        assert_eq!(who(&router, &both), ("key-f3abf2a6cc4f".into(), untrusted));
        // Not even checked: the header is not the router's business.
        assert_eq!(
            who(&router, &[("x-team", "a b")]),
            (ANONYMOUS.into(), untrusted)
        );
        let key = [("authorization", "bearer  sk-test ")];
        assert_eq!(who(&router, &key), ("key-f3abf2a6cc4f".into(), untrusted));
        let basic = [("authorization", "Basic dXNlcjpwYXNz")];
        assert_eq!(who(&router, &basic), (ANONYMOUS.into(), untrusted));
        assert_eq!(who(&router, &[]), (ANONYMOUS.into(), untrusted));
        // A bound key is its tenant, with the priorities granted to it.
        let gold = [("x-team", "batch"), ("authorization", "Bearer sk-gold")];
        let range = PriorityRange::parse("-10..5").expect("a range");
        assert_eq!(who(&router, &gold), ("gold".into(), range));
    }

    #[test]
    fn a_trusted_header_names_the_tenant_then_the_api_key_then_no_one() {
        let router = router(true);
        let both = [("x-team", "batch"), ("authorization", "Bearer sk-gold")];
        let batch = PriorityRange::parse("3..9").expect("a range");
        assert_eq!(who(&router, &both), ("batch".into(), batch));
        // The gateway's tenants may use any priority unless narrowed.
        let other = [("x-team", "someone")];
        assert_eq!(who(&router, &other), ("someone".into(), PriorityRange::ANY));
        let key = [("authorization", "Bearer sk-gold")];
        let gold = PriorityRange::parse("-10..5").expect("a range");
        assert_eq!(who(&router, &key), ("gold".into(), gold));
        // Requests without the header: the gateway's word too.
        let other_key = [("authorization", "Bearer sk-test")];
        let any = PriorityRange::ANY;
        assert_eq!(who(&router, &other_key), ("key-f3abf2a6cc4f".into(), any));
        assert_eq!(who(&router, &[]), (ANONYMOUS.into(), any));
        let long = "t".repeat(MAX_TENANT + 1);
        assert!(router.identify(&headers(&[("x-team", &long)])).is_err());
        assert!(router.identify(&headers(&[("x-team", "a b")])).is_err());
    }

    #[test]
    fn priorities_are_clamped_into_the_tenants_range() {
        let router = router(false);
        let anyone = router.identify(&HeaderMap::new()).expect("an identity");
        assert_eq!(router.allowed_priority(&anyone, -2_147_483_648), 0);
        assert_eq!(router.allowed_priority(&anyone, 7), 7);
        let gold = router
            .identify(&headers(&[("authorization", "Bearer sk-gold")]))
            .expect("an identity");
        assert_eq!(router.allowed_priority(&gold, -5), -5);
        assert_eq!(router.allowed_priority(&gold, -50), -10);
        assert_eq!(router.allowed_priority(&gold, 50), 5);
        assert_eq!(router.metrics.tenants.priority_clamped.get(), 3);
        for bad in ["5", "5..", "..5", "a..b", "5..-5", "0..3000000000"] {
            assert!(PriorityRange::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn named_tenants_have_their_weight_and_label_and_the_rest_are_other() {
        let tenants = Tenants::new(&router(false).config.tenants);
        assert_eq!(tenants.weight("gold"), 4.0);
        assert!(tenants.weight("free") > 0.0, "clamped above 0");
        assert_eq!(tenants.weight("batch"), 1.0);
        assert_eq!(tenants.weight("key-f3abf2a6cc4f"), 1.0);
        assert_eq!(&*tenants.label("gold").0, "gold");
        assert_eq!(&*tenants.label("batch").0, "batch");
        assert_eq!(&*tenants.label("someone").0, OTHER_TENANT);
        for known in ["gold", "free", "batch", OTHER_TENANT] {
            assert!(tenants.is_known(known), "{known}");
        }
        assert!(!tenants.is_known("someone"));
    }
}
