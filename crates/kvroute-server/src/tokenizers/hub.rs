//! A model's tokenizer files in the Hugging Face cache, and fetched into it
//! from the hub when the machine is online: the cache's own layout
//! (`models--org--name/refs/main` naming a commit,
//! `snapshots/<commit>/tokenizer.json`), found where the hub's clients put
//! it (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`), so a tokenizer any of them downloaded is
//! found, and one kvroute downloads is found by them.
//!
//! Only the few small files a tokenizer needs are fetched, with two GETs
//! each at most; a repository id is checked before it names a path or a URL
//! (it comes from a worker's `/v1/models`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::proxy::answer;

/// The files the router reads: the tokenizer, then (optional) its
/// configuration with the chat template, and newer models' template file.
pub const FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];

/// The most of one file downloaded.
const MAX_FILE_BYTES: usize = 64 << 20;

/// Time allowed for one file.
const FILE_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the hub and its cache are, as the hub's own clients read it from
/// the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubConfig {
    /// The cache (`HF_HUB_CACHE`, `HF_HOME/hub`, `~/.cache/huggingface/hub`).
    pub cache: PathBuf,
    /// The hub (`HF_ENDPOINT`, else `https://huggingface.co`).
    pub endpoint: String,
    /// Its token (`HF_TOKEN`), for gated models.
    pub token: Option<String>,
    /// Never ask the hub (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
}

impl HubConfig {
    /// The configuration the environment gives (`lookup` reads a variable).
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| lookup(name).filter(|v| !v.is_empty());
        let cache = set("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| set("HF_HOME").map(|h| PathBuf::from(h).join("hub")))
            .or_else(|| set("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub")))
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let offline = set("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
        });
        HubConfig {
            cache,
            endpoint: set("HF_ENDPOINT")
                .unwrap_or_else(|| "https://huggingface.co".to_owned())
                .trim_end_matches('/')
                .to_owned(),
            token: set("HF_TOKEN").or_else(|| set("HUGGING_FACE_HUB_TOKEN")),
            offline,
        }
    }
}

/// Whether `id` is a repository id (`name` or `org/name`, of letters,
/// digits, `-`, `_` and `.`, no part `.` or `..`), safe to put in a path
/// and a URL.
pub fn is_repo_id(id: &str) -> bool {
    let parts: Vec<&str> = id.split('/').collect();
    id.len() <= 96
        && (1..=2).contains(&parts.len())
        && parts.iter().all(|p| {
            !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        })
}

/// The cache folder of repository `id`.
fn repo_dir(cache: &Path, id: &str) -> PathBuf {
    cache.join(format!("models--{}", id.replace('/', "--")))
}

/// A commit or etag as the cache names folders and files by it: hex and
/// dashes only.
fn is_revision(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
}

/// `tokenizer.json` of repository `id` in the cache at `main`, if there.
pub fn cached_tokenizer(cache: &Path, id: &str) -> Option<PathBuf> {
    if !is_repo_id(id) {
        return None;
    }
    let dir = repo_dir(cache, id);
    let commit = std::fs::read_to_string(dir.join("refs/main")).ok()?;
    let commit = commit.trim();
    if !is_revision(commit) {
        return None;
    }
    let file = dir.join("snapshots").join(commit).join(FILES[0]);
    file.is_file().then_some(file)
}

/// Why the hub gave no tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The id cannot be a repository's.
    #[error("`{0}` is not a Hugging Face repository id")]
    NotARepo(String),
    /// The hub is not to be asked.
    #[error("HF_HUB_OFFLINE is set")]
    Offline,
    /// The hub did not answer, or not with the file.
    #[error("{0}")]
    Http(String),
    /// The cache could not be written.
    #[error("writing the cache at {path}: {source}")]
    Write {
        /// Where.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Fetches repository `id`'s tokenizer files at `main` into the cache and
/// returns where its `tokenizer.json` is.
pub async fn fetch(
    client: &reqwest::Client,
    hub: &HubConfig,
    id: &str,
) -> Result<PathBuf, HubError> {
    if !is_repo_id(id) {
        return Err(HubError::NotARepo(id.to_owned()));
    }
    if hub.offline {
        return Err(HubError::Offline);
    }
    let dir = repo_dir(&hub.cache, id);
    let mut commit: Option<String> = None;
    for (i, file) in FILES.iter().enumerate() {
        match fetch_file(client, hub, id, file).await? {
            Some((bytes, rev)) => {
                let rev = commit.get_or_insert(rev).clone();
                write_snapshot(&dir, &rev, file, &bytes)?;
            }
            None if i == 0 => {
                return Err(HubError::Http(format!("{id} has no {}", FILES[0])));
            }
            None => {}
        }
    }
    let commit = commit.unwrap_or_default();
    write(&dir.join("refs/main"), commit.as_bytes())?;
    Ok(dir.join("snapshots").join(commit).join(FILES[0]))
}

/// One file and the commit it is from; `None` when the repository has no
/// such file.
async fn fetch_file(
    client: &reqwest::Client,
    hub: &HubConfig,
    id: &str,
    file: &str,
) -> Result<Option<(axum::body::Bytes, String)>, HubError> {
    let url = format!("{}/{id}/resolve/main/{file}", hub.endpoint);
    let mut request = client.get(&url).timeout(FILE_TIMEOUT);
    if let Some(token) = &hub.token {
        request = request.bearer_auth(token);
    }
    let resp = request
        .send()
        .await
        .map_err(|e| HubError::Http(format!("GET {url}: {}", crate::api::error_chain(&e))))?;
    if resp.status() == reqwest::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !resp.status().is_success() {
        return Err(HubError::Http(format!("GET {url}: {}", resp.status())));
    }
    let commit = resp
        .headers()
        .get("x-repo-commit")
        .and_then(|v| v.to_str().ok())
        .filter(|c| is_revision(c))
        .unwrap_or("main-unknown-commit")
        .to_owned();
    let bytes = answer::read_capped(resp, MAX_FILE_BYTES)
        .await
        .map_err(|e| HubError::Http(format!("GET {url}: {e}")))?;
    Ok(Some((bytes, commit)))
}

/// Writes `bytes` as `file` of snapshot `commit` (through a temporary file,
/// so a reader never sees half of it).
fn write_snapshot(dir: &Path, commit: &str, file: &str, bytes: &[u8]) -> Result<(), HubError> {
    write(&dir.join("snapshots").join(commit).join(file), bytes)
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), HubError> {
    let fail = |source| HubError::Write {
        path: path.display().to_string(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(fail)?;
    }
    let tmp = path.with_extension(format!("kvroute-{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(fail)?;
    std::fs::rename(&tmp, path).map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_ids_are_checked_before_they_name_a_path() {
        for good in ["gpt2", "Qwen/Qwen2.5-7B-Instruct", "org/name_v1.5"] {
            assert!(is_repo_id(good), "{good}");
        }
        for bad in [
            "",
            "/models/qwen",
            "a/b/c",
            "../etc",
            "a/..",
            "org/ name",
            "org/x?y",
            "./x",
        ] {
            assert!(!is_repo_id(bad), "{bad}");
        }
    }

    #[test]
    fn the_cache_is_found_where_the_hubs_clients_put_it() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let hub = HubConfig::from_env(env(&[("HOME", "/home/u")]));
        assert_eq!(hub.cache, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(hub.endpoint, "https://huggingface.co");
        assert!(!hub.offline && hub.token.is_none());
        let hub = HubConfig::from_env(env(&[("HOME", "/h"), ("HF_HOME", "/hf")]));
        assert_eq!(hub.cache, PathBuf::from("/hf/hub"));
        let hub = HubConfig::from_env(env(&[
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/c"),
            ("HF_HUB_OFFLINE", "1"),
            ("HF_TOKEN", "t"),
            ("HF_ENDPOINT", "http://mirror/"),
        ]));
        assert_eq!(hub.cache, PathBuf::from("/c"));
        assert!(hub.offline);
        assert_eq!(hub.token.as_deref(), Some("t"));
        assert_eq!(hub.endpoint, "http://mirror");
    }

    #[test]
    fn a_snapshot_is_read_at_the_commit_main_names() {
        let cache = std::env::temp_dir().join(format!("kvroute-hub-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        assert_eq!(cached_tokenizer(&cache, "org/m"), None);
        let dir = repo_dir(&cache, "org/m");
        write_snapshot(&dir, "abc123", "tokenizer.json", b"{}").expect("write");
        assert_eq!(cached_tokenizer(&cache, "org/m"), None, "no ref yet");
        write(&dir.join("refs/main"), b"abc123\n").expect("write");
        let found = cached_tokenizer(&cache, "org/m").expect("found");
        assert!(found.ends_with("models--org--m/snapshots/abc123/tokenizer.json"));
        write(&dir.join("refs/main"), b"../../x").expect("write");
        assert_eq!(
            cached_tokenizer(&cache, "org/m"),
            None,
            "a ref is a revision"
        );
        let _ = std::fs::remove_dir_all(&cache);
    }
}
