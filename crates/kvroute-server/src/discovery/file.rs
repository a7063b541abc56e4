//! The endpoints-file watcher: polls the file's size and modification time
//! (a ConfigMap update swaps a symlink, which file-event watchers miss),
//! reads a changed file once it has stayed unchanged for a poll, parses it
//! off the runtime and hands its workers to the [`Applier`]. A file that
//! cannot be read or parsed, that changed while it was read, or that lists
//! no `endpoints` (an empty file; only `endpoints: []` means "none") changes
//! nothing: the last good workers keep serving, and the problem is counted.

use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tracing::warn;

use super::endpoints::{self, EndpointDefaults};
use super::{Applier, DiscoveryCounters};
use crate::ingest::registry::Registry;
use crate::router::Router;

/// `--endpoints-file` and what completes its entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDiscovery {
    /// The file.
    pub path: PathBuf,
    /// How often its size and modification time are checked.
    pub every: Duration,
    /// What an endpoint's labels do not say.
    pub defaults: EndpointDefaults,
}

impl FileDiscovery {
    /// How often the file is checked unless told otherwise.
    pub const DEFAULT_EVERY: Duration = Duration::from_secs(1);
}

/// The file's identity between two looks: its length and modification
/// time; a change in either is a change.
type Stamp = (u64, Option<SystemTime>);

/// When the watcher reads the file (the pure part of [`Watcher`]): a file
/// changed since it was last read is read only once a look sees the same
/// stamp as the look before it, i.e. once it stayed unchanged for a whole
/// poll interval, so that a file being rewritten in place is not read
/// between the writer's truncation and its last write. The very first file
/// is read at once (no workers are there to protect yet).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Settle {
    /// The file as last read whole (applied or refused): not read again.
    read: Option<Stamp>,
    /// A stamp seen by the last look and not read yet.
    pending: Option<Stamp>,
}

impl Settle {
    /// Whether a look that finds the file at `now` reads it.
    fn should_read(&mut self, now: Stamp) -> bool {
        if self.read == Some(now) {
            self.pending = None;
            return false;
        }
        let first = self.read.is_none() && self.pending.is_none();
        if first || self.pending == Some(now) {
            return true;
        }
        self.pending = Some(now);
        false
    }

    /// The file at `stamp` was read whole: it is not read again until it
    /// changes.
    fn read_whole(&mut self, stamp: Stamp) {
        self.read = Some(stamp);
        self.pending = None;
    }

    /// The file was not read whole (it changed while being read, or could
    /// not be read): it is read once it has stayed at `now` for a poll.
    fn not_read(&mut self, now: Option<Stamp>) {
        self.pending = now;
    }
}

/// Whether a read of `bytes` bytes, between stamps `before` and `after`,
/// caught the file while it changed: a stamp moved, or the bytes read are
/// not the length the file had.
fn torn(before: Stamp, after: Stamp, bytes: usize) -> bool {
    before != after || u64::try_from(bytes) != Ok(before.0)
}

/// Watches the file for as long as the task runs; the router routes to
/// the file's workers from the moment they are registered.
pub fn spawn(
    config: FileDiscovery,
    (registry, router): (Arc<Registry>, Arc<Router>),
    default_block_size: Option<u32>,
    counters: DiscoveryCounters,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut watcher = Watcher {
            applier: Applier::new(registry, router, counters, "the endpoints file"),
            config,
            default_block_size,
            settle: Settle::default(),
        };
        let mut tick = tokio::time::interval(watcher.config.every);
        loop {
            tick.tick().await;
            watcher = match tokio::task::spawn_blocking(move || {
                watcher.look();
                watcher
            })
            .await
            {
                Ok(w) => w,
                Err(e) => {
                    warn!(error = %e, "the endpoints-file watcher stopped");
                    return;
                }
            };
        }
    })
}

/// The watcher's state between looks.
struct Watcher {
    config: FileDiscovery,
    default_block_size: Option<u32>,
    /// The file's workers as registered, and the counts.
    applier: Applier,
    /// When the file is read.
    settle: Settle,
}

/// What one read of the file found.
enum Read {
    /// Its bytes, read while it did not change.
    Whole(Vec<u8>),
    /// It changed while being read; the stamp it had after.
    Torn(Stamp),
}

impl Watcher {
    /// Reads and applies the file when it changed since the last look and
    /// then stayed unchanged for a poll ([`Settle`]). What is refused
    /// (counted and logged once, the workers so far kept): a path that is
    /// not a regular file, a file over [`endpoints::MAX_FILE_BYTES`], one
    /// that changed while being read (read again once it settles), and
    /// whatever [`endpoints::parse_endpoints`] refuses.
    fn look(&mut self) {
        let before = match self.stamp() {
            Ok(stamp) => stamp,
            Err(problem) => return self.applier.failed(problem),
        };
        if !self.settle.should_read(before) {
            return;
        }
        let path = self.config.path.display().to_string();
        if before.0 > endpoints::MAX_FILE_BYTES as u64 {
            self.settle.read_whole(before);
            let limit = endpoints::MAX_FILE_BYTES;
            return self.applier.failed(format!(
                "{path}: the file is {} bytes, over the {limit} allowed",
                before.0
            ));
        }
        let bytes = match self.read(before) {
            Ok(Read::Whole(bytes)) => bytes,
            Ok(Read::Torn(after)) => {
                self.settle.not_read(Some(after));
                return self.applier.failed(format!(
                    "{path} changed while it was read; it is read again once it stays unchanged for a poll"
                ));
            }
            Err(problem) => {
                self.settle.not_read(None);
                return self.applier.failed(problem);
            }
        };
        self.settle.read_whole(before);
        let parsed = String::from_utf8(bytes)
            .map_err(|_| endpoints::EndpointsError("not UTF-8".into()))
            .and_then(|text| {
                endpoints::parse_endpoints(&text, &self.config.defaults, self.default_block_size)
            });
        match parsed {
            Ok(desired) => self.applier.apply(desired),
            Err(problem) => self.applier.failed(format!("{path}: {problem}")),
        }
    }

    /// The file's stamp, if it is a regular file (following symlinks): a
    /// device or a pipe is refused before it is opened.
    fn stamp(&self) -> Result<Stamp, String> {
        let path = &self.config.path;
        let meta =
            std::fs::metadata(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        if !meta.is_file() {
            return Err(format!("{} is not a regular file", path.display()));
        }
        Ok((meta.len(), meta.modified().ok()))
    }

    /// The file's bytes (at most one over the limit), and whether it kept
    /// the stamp `before` while they were read.
    fn read(&self, before: Stamp) -> Result<Read, String> {
        let path = &self.config.path;
        let reading = |e: std::io::Error| format!("reading {}: {e}", path.display());
        let file = std::fs::File::open(path).map_err(reading)?;
        let mut bytes = Vec::new();
        file.take(endpoints::MAX_FILE_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(reading)?;
        let after = self.stamp()?;
        Ok(if torn(before, after, bytes.len()) {
            Read::Torn(after)
        } else {
            Read::Whole(bytes)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(len: u64, secs: u64) -> Stamp {
        (
            len,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs)),
        )
    }

    #[test]
    fn the_first_file_is_read_at_once_and_a_change_once_it_settles() {
        let mut settle = Settle::default();
        assert!(settle.should_read(at(10, 1)), "the first file at once");
        settle.read_whole(at(10, 1));
        assert!(!settle.should_read(at(10, 1)), "unchanged: not read again");
        // An in-place rewrite: truncated, half written, whole; each look sees a new stamp.
        assert!(!settle.should_read(at(0, 2)));
        assert!(!settle.should_read(at(5, 3)));
        assert!(!settle.should_read(at(10, 4)));
        assert!(settle.should_read(at(10, 4)), "unchanged for a poll: read");
        settle.read_whole(at(10, 4));
        assert!(!settle.should_read(at(10, 4)));
        // A change undone before it settled is not read either.
        assert!(!settle.should_read(at(0, 5)));
        assert!(!settle.should_read(at(10, 4)));
        assert!(!settle.should_read(at(10, 4)));
    }

    #[test]
    fn a_file_that_changed_while_read_is_read_again_once_it_settles() {
        assert!(!torn(at(10, 1), at(10, 1), 10));
        assert!(torn(at(10, 1), at(10, 2), 10), "rewritten while read");
        assert!(torn(at(10, 1), at(12, 2), 10), "grew while read");
        assert!(torn(at(10, 1), at(10, 1), 4), "fewer bytes than its length");
        let mut settle = Settle::default();
        settle.read_whole(at(10, 1));
        assert!(!settle.should_read(at(20, 2)));
        assert!(settle.should_read(at(20, 2)));
        // The read was torn: the file was at (30, 3) afterwards.
        settle.not_read(Some(at(30, 3)));
        assert!(
            settle.should_read(at(30, 3)),
            "unchanged since the torn read"
        );
        settle.not_read(None);
        assert!(
            !settle.should_read(at(30, 3)),
            "a failed read settles again"
        );
        assert!(settle.should_read(at(30, 3)));
    }
}
