//! Where a worker may point. The router sends clients' requests (with their
//! `Authorization` headers) to a worker's URL and connects to its sockets,
//! so a registration must not be able to aim either anywhere else: a URL is
//! `http(s)://host[:port]` and nothing more (a path or query would let a
//! registration call arbitrary endpoints), a socket is `tcp://host:port`, and
//! an operator may limit the hosts to a list of names and networks.

use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;

use super::spec::{SpecError, WorkerSpec};

fn bad(key: &'static str, value: &str, problem: &'static str) -> SpecError {
    SpecError::BadValue {
        key,
        value: value.to_owned(),
        problem,
    }
}

/// The host of a worker's HTTP URL, which must be `http://` or `https://`,
/// a host and an optional port, and at most a trailing `/`.
pub fn url_host(url: &str) -> Result<String, SpecError> {
    let parsed = reqwest::Url::parse(url).map_err(|_| bad("url", url, "not a URL"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(bad("url", url, "must be http:// or https://"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(bad("url", url, "must not hold a user name or password"));
    }
    if parsed.path() != "/" || parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(bad(
            "url",
            url,
            "must be scheme, host and port only (no path, query or fragment)",
        ));
    }
    match parsed.host() {
        Some(url::Host::Domain(d)) => Ok(d.to_ascii_lowercase()),
        Some(url::Host::Ipv4(ip)) => Ok(ip.to_string()),
        Some(url::Host::Ipv6(ip)) => Ok(ip.to_string()),
        None => Err(bad("url", url, "has no host")),
    }
}

/// The host of a socket endpoint, which must be `tcp://host:port` with a
/// name, an IPv4 address or a bracketed IPv6 address, and a port above 0.
pub fn endpoint_host(key: &'static str, endpoint: &str) -> Result<String, SpecError> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| bad(key, endpoint, "expected tcp://host:port"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad(key, endpoint, "expected tcp://host:port"))?;
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => {
            return Err(bad(
                key,
                endpoint,
                "the port must be a number from 1 to 65535",
            ))
        }
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6
            .parse::<std::net::Ipv6Addr>()
            .map(|ip| ip.to_string())
            .map_err(|_| bad(key, endpoint, "not an IPv6 address"));
    }
    let valid = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if !valid {
        return Err(bad(key, endpoint, "the host must be a name or an address"));
    }
    Ok(host.to_ascii_lowercase())
}

/// Every host a worker's URL and sockets name, each address checked for its
/// form. An empty URL (a worker only indexed, never sent requests, as
/// Dynamo's standalone indexer registers them) names no host.
pub fn worker_hosts(spec: &WorkerSpec) -> Result<Vec<String>, SpecError> {
    let mut hosts = Vec::new();
    if !spec.url.is_empty() {
        hosts.push(url_host(&spec.url)?);
    }
    for rank in &spec.ranks {
        hosts.push(endpoint_host("events", &rank.events)?);
        if let Some(replay) = &rank.replay {
            hosts.push(endpoint_host("replay", replay)?);
        }
    }
    hosts.sort_unstable();
    hosts.dedup();
    Ok(hosts)
}

/// One entry of `--allow-worker-hosts`: a host name, an address, or a network.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Allowed {
    Name(String),
    Net(IpNet),
}

/// The hosts workers may point at (`--allow-worker-hosts`): names, which
/// match exactly (no name is resolved), and addresses or CIDR networks,
/// which match addresses. Empty: any host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedHosts {
    entries: Vec<Allowed>,
}

impl FromStr for AllowedHosts {
    type Err = String;

    /// A comma-separated list such as `10.0.0.0/8,gpu-01,::1`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut entries = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let entry = if let Ok(net) = item.parse::<IpNet>() {
                Allowed::Net(net)
            } else if let Ok(ip) = item.parse::<IpAddr>() {
                Allowed::Net(IpNet::from(ip))
            } else if item
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
            {
                Allowed::Name(item.to_ascii_lowercase())
            } else {
                return Err(format!(
                    "`{item}` is not a host name, an address or a CIDR network"
                ));
            };
            entries.push(entry);
        }
        Ok(AllowedHosts { entries })
    }
}

impl AllowedHosts {
    /// Whether any host is allowed (no list given).
    pub fn is_unrestricted(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `host` (a lower-case name or an address) is allowed.
    pub fn allows(&self, host: &str) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let ip = host.parse::<IpAddr>().ok();
        self.entries.iter().any(|e| match (e, ip) {
            (Allowed::Net(net), Some(ip)) => net.contains(&ip),
            (Allowed::Name(name), None) => name == host,
            _ => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_urls_are_scheme_host_and_port_only() {
        assert_eq!(url_host("http://10.0.0.1:8100").as_deref(), Ok("10.0.0.1"));
        assert_eq!(url_host("https://GPU-01:443/").as_deref(), Ok("gpu-01"));
        assert_eq!(url_host("http://[::1]:8000").as_deref(), Ok("::1"));
        for bad in [
            "http://h:1/internal/secret?ignore=",
            "http://h:1/v1",
            "http://h:1?x=1",
            "http://h:1#top",
            "http://user:pw@h:1",
            "ftp://h:1",
            "file:///etc/passwd",
            "h:1",
            "",
        ] {
            assert!(url_host(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn socket_endpoints_are_tcp_host_and_port() {
        assert_eq!(endpoint_host("events", "tcp://h:5557").as_deref(), Ok("h"));
        assert_eq!(
            endpoint_host("events", "tcp://[::1]:5557").as_deref(),
            Ok("::1")
        );
        for bad in [
            "tcp://*:5557",
            "tcp://h:0",
            "tcp://h:99999",
            "tcp://h",
            "ipc:///tmp/x",
            "tcp://a/b:1",
            "tcp://:1",
            "tcp://[nope]:1",
        ] {
            assert!(endpoint_host("events", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_allow_list_matches_names_exactly_and_addresses_by_network() {
        let allowed: AllowedHosts = "10.0.0.0/8, gpu-01, ::1".parse().expect("valid");
        assert!(allowed.allows("10.1.2.3"));
        assert!(allowed.allows("gpu-01"));
        assert!(allowed.allows("::1"));
        assert!(!allowed.allows("11.0.0.1"));
        assert!(!allowed.allows("gpu-02"));
        assert!(!allowed.allows("gpu-01.evil.example"));
        assert!(AllowedHosts::default().allows("anything"));
        assert!("a b".parse::<AllowedHosts>().is_err());
    }
}
