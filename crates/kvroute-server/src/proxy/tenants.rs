//! Tenants at the proxy: whose request it is, what it weighs in the
//! overload queue's fair order, and the label its metrics go under.
//!
//! A request's tenant is the value of its `--tenant-header` (default
//! `x-tenant`), else the fingerprint of the API key in its
//! `Authorization: Bearer …` ([`key_fingerprint`]: `key-` and 12 hex digits
//! of the key's SHA-256; the key itself is never logged or exported), else
//! [`ANONYMOUS`]. The header is the client's word: put kvroute behind a
//! gateway that sets it when tenants must not name each other. Each tenant
//! weighs 1 unless `--tenant-weight NAME=W` says otherwise; the queue
//! shares the fleet among the tenants waiting in proportion to their
//! weights (`kvroute_core::scheduler::fair`). Metrics name the tenants
//! `--tenant-weight` names and count every other one as `other`, so their
//! label set is bounded by the flags, not by the clients.

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::{header, HeaderMap};
use kvroute_core::scheduler::fair::{clamp_weight, key_fingerprint};

use super::Proxy;
use crate::api::ProxyError;
use crate::metrics::tenants::{TenantLabel, OTHER_TENANT};

/// The longest tenant name taken from the header.
pub const MAX_TENANT: usize = 128;

/// The tenant of a request that names none and carries no API key.
pub const ANONYMOUS: &str = "anonymous";

/// `--tenant-header` and `--tenant-weight`.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantConfig {
    /// The header naming a request's tenant (lower case).
    pub header: String,
    /// The tenants given a weight, with it (every other tenant weighs 1);
    /// these are also the tenants metrics name.
    pub weights: Vec<(String, f64)>,
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            header: "x-tenant".to_owned(),
            weights: Vec::new(),
        }
    }
}

impl TenantConfig {
    /// The tenants named by `--tenant-weight`.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.weights.iter().map(|(name, _)| name.as_str())
    }
}

/// The named tenants' weights and metric labels, looked up per request.
#[derive(Debug)]
pub struct Tenants {
    named: HashMap<String, (f64, TenantLabel)>,
    other: TenantLabel,
}

impl Tenants {
    /// The lookup for `config` (a name given twice keeps its last weight).
    pub fn new(config: &TenantConfig) -> Self {
        let named = config
            .weights
            .iter()
            .map(|(name, w)| {
                let label = TenantLabel(Arc::from(name.as_str()));
                (name.clone(), (clamp_weight(*w), label))
            })
            .collect();
        Tenants {
            named,
            other: TenantLabel(Arc::from(OTHER_TENANT)),
        }
    }

    /// `tenant`'s weight: its `--tenant-weight`, else 1.
    pub fn weight(&self, tenant: &str) -> f64 {
        self.named.get(tenant).map_or(1.0, |(w, _)| *w)
    }

    /// The label `tenant`'s metrics go under: its name when
    /// `--tenant-weight` names it, else `other`.
    pub fn label(&self, tenant: &str) -> &TenantLabel {
        self.named.get(tenant).map_or(&self.other, |(_, l)| l)
    }
}

impl Proxy {
    /// The tenant a request's headers name (see the module docs); a 400
    /// when the tenant header is not printable ASCII of 1 to
    /// [`MAX_TENANT`] bytes.
    pub fn tenant_of(&self, headers: &HeaderMap) -> Result<String, ProxyError> {
        let name = self.config.tenants.header.as_str();
        if let Some(value) = headers.get(name) {
            return match value.to_str() {
                Ok(t)
                    if (1..=MAX_TENANT).contains(&t.len())
                        && t.bytes().all(|b| b.is_ascii_graphic()) =>
                {
                    Ok(t.to_owned())
                }
                _ => Err(ProxyError::bad_request(format!(
                    "`{name}` must be 1 to {MAX_TENANT} printable ASCII characters"
                ))),
            };
        }
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        Ok(key.map_or_else(|| ANONYMOUS.to_owned(), key_fingerprint))
    }
}

/// The token of an `Authorization: Bearer <token>` value (the scheme is
/// case-insensitive); `None` for another scheme or an empty token.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use kvroute_core::index::SharedIndex;

    fn proxy() -> Proxy {
        let config = super::super::ProxyConfig {
            tenants: TenantConfig {
                header: "x-team".to_owned(),
                weights: vec![("gold".to_owned(), 4.0), ("free".to_owned(), 0.0)],
            },
            ..Default::default()
        };
        Proxy::new(config, Arc::new(SharedIndex::default())).expect("a proxy")
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, HeaderValue::from_str(v).expect("a header value"));
        }
        map
    }

    #[test]
    fn the_header_names_the_tenant_then_the_api_key_then_no_one() {
        let proxy = proxy();
        let both = headers(&[("x-team", "gold"), ("authorization", "Bearer sk-test")]);
        assert_eq!(proxy.tenant_of(&both).expect("a tenant"), "gold");
        let key = headers(&[("authorization", "bearer  sk-test ")]);
        assert_eq!(proxy.tenant_of(&key).expect("a tenant"), "key-f3abf2a6cc4f");
        let basic = headers(&[("authorization", "Basic dXNlcjpwYXNz")]);
        assert_eq!(proxy.tenant_of(&basic).expect("a tenant"), ANONYMOUS);
        assert_eq!(
            proxy.tenant_of(&HeaderMap::new()).expect("a tenant"),
            ANONYMOUS
        );
        let long = "t".repeat(MAX_TENANT + 1);
        assert!(proxy.tenant_of(&headers(&[("x-team", &long)])).is_err());
        assert!(proxy.tenant_of(&headers(&[("x-team", "a b")])).is_err());
    }

    #[test]
    fn named_tenants_have_their_weight_and_label_and_the_rest_are_other() {
        let tenants = Tenants::new(&proxy().config.tenants);
        assert_eq!(tenants.weight("gold"), 4.0);
        assert!(tenants.weight("free") > 0.0, "clamped above 0");
        assert_eq!(tenants.weight("key-f3abf2a6cc4f"), 1.0);
        assert_eq!(&*tenants.label("gold").0, "gold");
        assert_eq!(&*tenants.label("someone").0, OTHER_TENANT);
    }
}
