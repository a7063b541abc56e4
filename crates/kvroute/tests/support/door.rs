//! The two front doors a request can come in by, so that one test body runs
//! through both: `kvroute serve`'s HTTP port, and its endpoint picker
//! behind a data plane (`tests/epp/dataplane.py`, which asks the picker
//! over ext_proc with the client's headers and body, sends the request to
//! the endpoint picked and feeds the answer back to the picker). A request
//! prepared differently at one door fails there.

use super::http::Reply;
use super::picker::{start_dataplane, start_picker_with_env};
use super::{start_serve_with_env, Proc};

/// A front door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// `kvroute serve`'s HTTP port: the router forwards the request itself.
    Http,
    /// The endpoint picker: a data plane asks it where, and forwards.
    Picker,
}

/// A router with workers `lines`, reached through one door.
pub struct Front {
    /// Where clients send requests.
    pub addr: String,
    /// The router's own HTTP address (`/metrics`, `/workers`).
    pub router: String,
    /// The door.
    pub door: Door,
    /// Each worker's name and `host:port`, from its `--worker` line.
    workers: Vec<(String, String)>,
    _procs: Vec<Proc>,
}

impl Front {
    /// The worker that answered `reply`: `kvroute serve`'s
    /// `x-kvroute-worker`, or the worker at the endpoint the data plane
    /// sent the request to.
    pub fn worker_of(&self, reply: &Reply) -> String {
        if let Some(name) = reply.header("x-kvroute-worker") {
            return name;
        }
        let endpoint = reply.header("x-dataplane-endpoint").unwrap_or_default();
        self.workers
            .iter()
            .find(|(_, at)| *at == endpoint)
            .map_or_else(String::new, |(name, _)| name.clone())
    }
}

/// A `--worker` line's `name=` and `url=` (as `host:port`).
fn name_and_endpoint(line: &str) -> (String, String) {
    let field = |key: &str| {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(key))
            .unwrap_or_default()
            .to_owned()
    };
    let url = field("url=");
    let endpoint = url.trim_start_matches("http://").trim_end_matches('/');
    (field("name="), endpoint.to_owned())
}

impl Door {
    /// Starts `kvroute serve` with workers `lines`, `flags` and `env`, and
    /// what this door needs in front of it; every worker's rank connected.
    pub fn start(self, lines: &[String], flags: &[&str], env: &[(&str, &str)]) -> Front {
        let workers = lines.iter().map(|l| name_and_endpoint(l)).collect();
        match self {
            Door::Http => {
                let (serve, addr) = start_serve_with_env(lines, flags, env);
                Front {
                    router: addr.clone(),
                    addr,
                    door: self,
                    workers,
                    _procs: vec![serve],
                }
            }
            Door::Picker => {
                let mut all = vec!["--epp-plaintext"];
                all.extend_from_slice(flags);
                let picker = start_picker_with_env(lines, &all, env);
                let (dataplane, addr) = start_dataplane(&picker.ext_proc, &[]);
                Front {
                    addr,
                    router: picker.http.clone(),
                    door: self,
                    workers,
                    _procs: vec![dataplane, picker.into_proc()],
                }
            }
        }
    }

    /// The status a request shed for the load gets at this door: 503 from
    /// `kvroute serve`, 429 from the picker (the endpoint picker protocol's
    /// word for a request to drop).
    pub fn shed_status(self) -> u16 {
        match self {
            Door::Http => 503,
            Door::Picker => 429,
        }
    }
}

/// The engine's admission number of the request `reply` answers (its
/// answer's id's suffix): the order it let requests in, whatever order the
/// client threads wake up in.
pub fn admission_of(reply: &Reply) -> u64 {
    let id = reply.json()["id"].as_str().unwrap_or_default().to_owned();
    id.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}
