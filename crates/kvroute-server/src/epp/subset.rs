//! Endpoints as the gateway names them (`ip:port`), the subset hint that
//! limits which of them a request may go to, and the endpoint that served
//! a request as the gateway reports it.
//!
//! The protocol (GIE's proposal 004): when
//! `metadata_context.filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`
//! is present, the picker picks only among those endpoints, and answers 503
//! when none of them is eligible (an empty list included). The value is a
//! string holding a comma-separated list, or a list of strings; an entry is
//! `ip:port`, or a bare `ip` that stands for every port of that address.
//! After the response, the gateway names the endpoint that served it in
//! `filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]`
//! (a comma-separated list when it retried: the last entry served).

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::Value;

/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint in its namespace.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The metadata namespace the picker writes its pick to and the gateway
/// reports the served endpoint in.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The key of the served endpoint in [`LB_NAMESPACE`].
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// Entries read from one hint at most: a hint names endpoints of one pool,
/// and more than this is not a hint but a mistake (or an attack on memory).
pub const MAX_SUBSET_ENTRIES: usize = 4096;

/// An endpoint as the gateway addresses it: a host and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The host: an IP address (what Envoy's original-destination cluster
    /// needs), or a name as the worker's URL gives it.
    host: Host,
    /// The port.
    port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    Ip(IpAddr),
    Name(String),
}

impl Endpoint {
    /// The endpoint a worker's base URL points at (the scheme's default
    /// port when it names none); `None` for a URL without a host.
    pub fn of_url(url: &str) -> Option<Endpoint> {
        let url = url::Url::parse(url).ok()?;
        let port = url.port_or_known_default()?;
        let host = match url.host()? {
            url::Host::Ipv4(ip) => Host::Ip(IpAddr::V4(ip)),
            url::Host::Ipv6(ip) => Host::Ip(IpAddr::V6(ip)),
            url::Host::Domain(name) => Host::Name(name.to_ascii_lowercase()),
        };
        Some(Endpoint { host, port })
    }

    /// Whether the host is an IP address, as Envoy's original-destination
    /// cluster requires of `x-gateway-destination-endpoint`.
    pub fn is_ip(&self) -> bool {
        matches!(self.host, Host::Ip(_))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(ip) => write!(f, "{}", SocketAddr::new(*ip, self.port)),
            Host::Name(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

/// One entry of a subset hint.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// `ip:port`: that endpoint only.
    Addr(SocketAddr),
    /// A bare `ip`: any port of that address.
    Ip(IpAddr),
    /// Anything else (`name:port`, a bare name), compared as text.
    Text(String),
}

impl Entry {
    fn parse(text: &str) -> Option<Entry> {
        let text = text.trim();
        if text.is_empty() {
            return None;
        }
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Some(Entry::Addr(addr));
        }
        let bare = text.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Some(Entry::Ip(ip));
        }
        Some(Entry::Text(text.to_ascii_lowercase()))
    }

    fn admits(&self, e: &Endpoint) -> bool {
        match (self, &e.host) {
            (Entry::Addr(a), Host::Ip(ip)) => a.ip() == *ip && a.port() == e.port,
            (Entry::Ip(a), Host::Ip(ip)) => a == ip,
            (Entry::Text(t), Host::Name(name)) => *t == e.to_string() || t == name,
            _ => false,
        }
    }
}

/// The endpoints a request may go to, from the gateway's subset hint.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Subset {
    entries: Vec<Entry>,
}

impl Subset {
    /// The subset hint in a request's metadata: `None` when there is none
    /// (every endpoint may be picked), else the endpoints it names (maybe
    /// none: then no endpoint is eligible). Entries past
    /// [`MAX_SUBSET_ENTRIES`] are ignored.
    pub fn from_metadata(metadata: Option<&Metadata>) -> Option<Subset> {
        let hint = metadata?
            .filter_metadata
            .get(SUBSET_NAMESPACE)?
            .fields
            .get(SUBSET_KEY)?;
        let mut entries = Vec::new();
        for text in strings_of(hint) {
            entries.extend(text.split(',').filter_map(Entry::parse));
            if entries.len() >= MAX_SUBSET_ENTRIES {
                entries.truncate(MAX_SUBSET_ENTRIES);
                break;
            }
        }
        Some(Subset { entries })
    }

    /// Whether the hint lets the request go to `endpoint`.
    pub fn admits(&self, endpoint: &Endpoint) -> bool {
        self.entries.iter().any(|entry| entry.admits(endpoint))
    }

    /// How many entries the hint names.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the hint names no endpoint at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The strings of a metadata value: itself when it is one, the string
/// items of a list (other items ignored), nothing otherwise.
fn strings_of(value: &Value) -> Vec<&str> {
    match &value.kind {
        Some(Kind::StringValue(s)) => vec![s.as_str()],
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .take(MAX_SUBSET_ENTRIES)
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The endpoint that served a response, as the gateway reports it in
/// `envoy.lb`: the last entry of the list it gives, if any.
pub fn served_endpoint(metadata: Option<&Metadata>) -> Option<String> {
    let value = metadata?
        .filter_metadata
        .get(LB_NAMESPACE)?
        .fields
        .get(SERVED_KEY)?;
    strings_of(value)
        .iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .rfind(|s| !s.is_empty())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{ListValue, Struct};

    fn string(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.to_owned())),
        }
    }

    fn list(items: &[&str]) -> Value {
        Value {
            kind: Some(Kind::ListValue(ListValue {
                values: items.iter().map(|s| string(s)).collect(),
            })),
        }
    }

    fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
        let mut md = Metadata::default();
        let mut fields = Struct::default();
        fields.fields.insert(key.to_owned(), value);
        md.filter_metadata.insert(namespace.to_owned(), fields);
        md
    }

    fn hint(value: Value) -> Option<Subset> {
        Subset::from_metadata(Some(&metadata(SUBSET_NAMESPACE, SUBSET_KEY, value)))
    }

    fn endpoint(url: &str) -> Endpoint {
        Endpoint::of_url(url).expect("an endpoint")
    }

    #[test]
    fn endpoints_come_from_worker_urls_as_ip_and_port() {
        assert_eq!(
            endpoint("http://10.0.0.1:8100").to_string(),
            "10.0.0.1:8100"
        );
        assert_eq!(endpoint("http://10.0.0.1").to_string(), "10.0.0.1:80");
        assert_eq!(endpoint("https://10.0.0.1/").to_string(), "10.0.0.1:443");
        assert_eq!(endpoint("http://[::1]:9000").to_string(), "[::1]:9000");
        let named = endpoint("http://GPU-01:8000");
        assert_eq!(named.to_string(), "gpu-01:8000");
        assert!(!named.is_ip() && endpoint("http://[::1]:9").is_ip());
        assert!(Endpoint::of_url("not a url").is_none());
    }

    #[test]
    fn a_hint_is_a_comma_separated_string_or_a_list_of_strings() {
        let (a, b, c) = (
            endpoint("http://10.0.0.1:8100"),
            endpoint("http://10.0.0.2:8100"),
            endpoint("http://10.0.0.3:8100"),
        );
        let from_string = hint(string("10.0.0.1:8100, 10.0.0.2:8100")).expect("a hint");
        let from_list = hint(list(&["10.0.0.1:8100", "10.0.0.2:8100"])).expect("a hint");
        for subset in [&from_string, &from_list] {
            assert_eq!(subset.len(), 2);
            assert!(subset.admits(&a) && subset.admits(&b) && !subset.admits(&c));
        }
        let mixed = hint(list(&["10.0.0.3:8100,10.0.0.1:8100", "x"])).expect("a hint");
        assert!(mixed.admits(&a) && mixed.admits(&c) && !mixed.admits(&b));
    }

    #[test]
    fn a_bare_ip_admits_every_port_and_a_port_only_its_own() {
        let subset = hint(string("10.0.0.1,[::1]:9000")).expect("a hint");
        assert!(subset.admits(&endpoint("http://10.0.0.1:8100")));
        assert!(subset.admits(&endpoint("http://10.0.0.1:8101")));
        assert!(subset.admits(&endpoint("http://[::1]:9000")));
        assert!(!subset.admits(&endpoint("http://[::1]:9001")));
        let named = hint(string("gpu-01:8000")).expect("a hint");
        assert!(named.admits(&endpoint("http://gpu-01:8000")));
        assert!(!named.admits(&endpoint("http://gpu-01:8001")));
    }

    #[test]
    fn an_absent_hint_admits_all_and_an_empty_one_none() {
        assert_eq!(Subset::from_metadata(None), None);
        let other = metadata("envoy.lb", SUBSET_KEY, string("10.0.0.1:1"));
        assert_eq!(Subset::from_metadata(Some(&other)), None);
        for empty in [string(""), string(" , "), list(&[]), Value::default()] {
            let subset = hint(empty).expect("present");
            assert!(subset.is_empty());
            assert!(!subset.admits(&endpoint("http://10.0.0.1:8100")));
        }
    }

    #[test]
    fn a_huge_hint_is_cut_at_the_bound() {
        let many = vec!["10.0.0.1:1"; MAX_SUBSET_ENTRIES + 10].join(",");
        assert_eq!(
            hint(string(&many)).expect("a hint").len(),
            MAX_SUBSET_ENTRIES
        );
    }

    #[test]
    fn the_served_endpoint_is_the_last_entry() {
        let md = |v| metadata(LB_NAMESPACE, SERVED_KEY, v);
        let served = |v| served_endpoint(Some(&md(v)));
        assert_eq!(
            served(string("10.0.0.1:8100")).as_deref(),
            Some("10.0.0.1:8100")
        );
        assert_eq!(
            served(string("10.0.0.1:8100, 10.0.0.2:8100")).as_deref(),
            Some("10.0.0.2:8100")
        );
        assert_eq!(served(list(&["a:1", "b:2"])).as_deref(), Some("b:2"));
        assert_eq!(served(string("")), None);
        assert_eq!(served_endpoint(None), None);
    }
}
