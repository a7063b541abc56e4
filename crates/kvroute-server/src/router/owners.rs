//! Whose a conversation is: the owner each session and each Responses API
//! answer is bound to, so that no other client can steer to it or continue
//! it.
//!
//! An engine keeps every response it wrote and continues any of them for
//! whoever names its id; it knows no owner. The router is therefore the
//! only place that can refuse another client's `previous_response_id`, and
//! it binds each pin to the request's owner: a digest of the API key the
//! request carried (`Authorization: Bearer …` or `x-api-key`), if any,
//! and of its tenant as [`Router::tenant_of`](super::Router::tenant_of)
//! resolves it (its tenant header, else the key's fingerprint, else
//! `anonymous`). Two requests have one owner when they carry the same key
//! (or none) and name the same tenant. Without keys the owner is the
//! tenant header alone, which any client may set: the binding is then
//! worth what that header is worth (see `docs/serving.md`, "Who may do
//! what"). The key itself is never kept: only its SHA-256, mixed with the
//! tenant.

use axum::http::{header, HeaderMap};
use ring::digest;

/// The header some clients send their API key in (Anthropic's SDK, among
/// others), read when there is no `Authorization: Bearer`.
pub const API_KEY_HEADER: &str = "x-api-key";

/// The owner of a request's sessions and responses: a SHA-256 digest of
/// its API key and tenant (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner(pub [u8; 32]);

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A digest of a secret: only its first bytes, to tell owners apart in logs.
        write!(
            f,
            "Owner({:02x}{:02x}{:02x}{:02x}…)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

/// The owner of a request with `headers` whose tenant resolved to `tenant`.
pub fn owner_of(headers: &HeaderMap, tenant: &str) -> Owner {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(b"kvroute owner v1\0");
    match api_key(headers) {
        Some(key) => {
            ctx.update(b"key\0");
            ctx.update(&(key.len() as u64).to_le_bytes());
            ctx.update(key.as_bytes());
        }
        None => ctx.update(b"no key\0"),
    }
    ctx.update(b"tenant\0");
    ctx.update(tenant.as_bytes());
    let mut owner = [0u8; 32];
    owner.copy_from_slice(ctx.finish().as_ref());
    Owner(owner)
}

/// The API key a request carries: the token of its `Authorization: Bearer
/// …` (the scheme in any case), else its `x-api-key`; `None` when neither
/// holds a non-empty one.
pub fn api_key(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            let token = token.trim();
            (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
        });
    bearer.or_else(|| {
        headers
            .get(API_KEY_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|k| !k.is_empty())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, HeaderValue::from_str(v).expect("a header value"));
        }
        map
    }

    #[test]
    fn the_key_is_read_from_the_bearer_then_x_api_key() {
        let both = headers(&[("authorization", "bearer  sk-a "), ("x-api-key", "sk-b")]);
        assert_eq!(api_key(&both), Some("sk-a"));
        let anthropic = headers(&[("x-api-key", " sk-b ")]);
        assert_eq!(api_key(&anthropic), Some("sk-b"));
        let basic = headers(&[("authorization", "Basic dXNlcjpwYXNz")]);
        assert_eq!(api_key(&basic), None);
        assert_eq!(api_key(&headers(&[("x-api-key", " ")])), None);
        assert_eq!(api_key(&HeaderMap::new()), None);
    }

    #[test]
    fn owners_differ_by_key_and_by_tenant() {
        let alice = headers(&[("authorization", "Bearer sk-alice")]);
        let bob = headers(&[("authorization", "Bearer sk-bob")]);
        let none = HeaderMap::new();
        let a = owner_of(&alice, "t");
        assert_eq!(a, owner_of(&alice, "t"), "stable");
        assert_eq!(
            a,
            owner_of(&headers(&[("x-api-key", "sk-alice")]), "t"),
            "the same key in either header"
        );
        assert_ne!(a, owner_of(&bob, "t"), "another key, the same tenant");
        assert_ne!(a, owner_of(&alice, "u"), "the same key, another tenant");
        assert_ne!(owner_of(&none, "t"), owner_of(&none, "u"));
        assert_ne!(owner_of(&none, "t"), a, "no key is not a key");
        assert!(!format!("{a:?}").contains("sk-alice"));
    }
}
