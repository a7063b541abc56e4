//! The router's state on disk (`--state-dir`): the index and, for every
//! registered worker, its spec, its id in the index and where each rank's
//! stream stood, so a restarted router comes back with what it knew, even
//! when the engines' replay rings no longer reach back that far.
//!
//! A restored rank trusts nothing yet: its first resync asks the engine's
//! ring for the batch the snapshot recorded (`ResumePoint`), which proves the
//! engine is the same (and replays what followed) or shows that it restarted
//! (and the rank is cleared). The snapshot is taken under the index's write
//! lock, and a rank records a batch only once all of it is in the index, so
//! what a snapshot holds for a rank is never ahead of its resume point (at
//! most one batch behind, which is replayed again; stores are idempotent).
//!
//! Layout: magic `KVRSTATE`, version (`u32` LE), the length of the header
//! (`u64` LE), the header as JSON (workers), then the index's own snapshot
//! (`Index::dump`). Written to a temporary file and renamed over the old one,
//! so a crash mid-write leaves the previous snapshot.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvroute_core::index::Index;
use kvroute_core::index::SnapshotError;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use serde::{Deserialize, Serialize};

use crate::ingest::spec::WorkerSpec;
use crate::ingest::stats::ResumePoint;
use crate::metrics::{encode_single, STATE_SNAPSHOTS_WRITTEN, STATE_SNAPSHOT_FAILURES};

const MAGIC: &[u8; 8] = b"KVRSTATE";
const VERSION: u32 = 1;
const FILE: &str = "router.state";

/// One worker as the snapshot keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedWorker {
    /// Its id in the index.
    pub id: u32,
    /// Its spec, as registered.
    pub spec: WorkerSpec,
    /// Its block size, configured or learned.
    pub block_size: Option<u32>,
    /// Where each rank's stream stood.
    pub ranks: Vec<SavedRank>,
}

/// One rank as the snapshot keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedRank {
    /// The rank.
    pub rank: u32,
    /// Where its stream stood (`None`: nothing applied yet).
    pub at: Option<ResumePoint>,
}

/// A consistent picture of the router's state.
#[derive(Debug)]
pub struct Snapshot {
    /// Every registered worker.
    pub workers: Vec<SavedWorker>,
    /// The index, as `Index::dump` wrote it.
    pub index: Vec<u8>,
}

/// Why a snapshot could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// Reading or writing the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a snapshot this build can read.
    #[error("{0}")]
    Format(String),
    /// The index part is corrupt.
    #[error("index snapshot: {0}")]
    Index(#[from] SnapshotError),
}

fn format_error(what: &str) -> StateError {
    StateError::Format(format!(
        "not a kvroute state file this build can read: {what}"
    ))
}

impl Snapshot {
    /// The snapshot as bytes.
    pub fn encode(&self) -> Vec<u8> {
        let header = serde_json::to_vec(&self.workers).unwrap_or_else(|_| b"[]".to_vec());
        let mut out = Vec::with_capacity(20 + header.len() + self.index.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(&self.index);
        out
    }

    /// Reads [`Snapshot::encode`] output, checking every length against the
    /// bytes there are; the index itself is checked by [`Snapshot::index`].
    pub fn decode(bytes: &[u8]) -> Result<Snapshot, StateError> {
        let rest = bytes
            .strip_prefix(MAGIC)
            .ok_or_else(|| format_error("bad magic"))?;
        let (version, rest) = rest
            .split_at_checked(4)
            .ok_or_else(|| format_error("cut short"))?;
        let version = u32::from_le_bytes(version.try_into().map_err(|_| format_error("version"))?);
        if version != VERSION {
            return Err(format_error(&format!(
                "version {version}, this build reads {VERSION}"
            )));
        }
        let (len, rest) = rest
            .split_at_checked(8)
            .ok_or_else(|| format_error("cut short"))?;
        let len = u64::from_le_bytes(len.try_into().map_err(|_| format_error("length"))?);
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= rest.len())
            .ok_or_else(|| format_error("header longer than the file"))?;
        let (header, index) = rest.split_at(len);
        let workers =
            serde_json::from_slice(header).map_err(|e| format_error(&format!("header: {e}")))?;
        Ok(Snapshot {
            workers,
            index: index.to_vec(),
        })
    }

    /// Whether every rank's history up to its resume point was complete:
    /// a router that started cold after an engine's ring wrapped, or whose
    /// rank has applied nothing yet, knows less than the engine holds.
    pub fn complete(&self) -> bool {
        self.workers
            .iter()
            .flat_map(|w| &w.ranks)
            .all(|r| r.at.is_some_and(|at| at.exact))
    }

    /// Whether any rank has applied anything (a router that just started
    /// has nothing to save for others).
    pub fn knows_anything(&self) -> bool {
        self.workers
            .iter()
            .flat_map(|w| &w.ranks)
            .any(|r| r.at.is_some())
    }

    /// The index it holds.
    pub fn index(&self) -> Result<Index, StateError> {
        Ok(Index::restore(&self.index)?)
    }
}

/// The snapshot file in `dir`.
pub fn state_file(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Writes `snapshot` into `dir` (created if missing), replacing the last one
/// only once the new one is complete on disk.
pub fn save(dir: &Path, snapshot: &Snapshot) -> Result<(), StateError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| StateError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let target = state_file(dir);
    let tmp = dir.join(format!("{FILE}.tmp"));
    let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(&snapshot.encode()).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, &target).map_err(io(&target))
}

/// How many snapshots were written into `--state-dir` and how many failed,
/// shared by the writer and `/metrics`, so that an operator (or a test) can
/// see that the state on disk is current without watching the file.
/// Clones count into the same figures.
#[derive(Debug, Clone, Default)]
pub struct SnapshotCounters {
    written: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
}

impl SnapshotCounters {
    /// Counts one snapshot written; returns how many have been.
    pub fn count_written(&self) -> u64 {
        self.written.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Counts one snapshot that could not be written; returns how many could not.
    pub fn count_failed(&self) -> u64 {
        self.failed.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// [`STATE_SNAPSHOTS_WRITTEN`] and [`STATE_SNAPSHOT_FAILURES`], read at
/// scrape time (0 without `--state-dir`).
impl Collector for SnapshotCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (info, value) in [
            (STATE_SNAPSHOTS_WRITTEN, &self.written),
            (STATE_SNAPSHOT_FAILURES, &self.failed),
        ] {
            encode_single(&mut encoder, &info, value.load(Ordering::Relaxed))?;
        }
        Ok(())
    }
}

/// The snapshot in `dir`, if there is one.
pub fn load(dir: &Path) -> Result<Option<Snapshot>, StateError> {
    let path = state_file(dir);
    match std::fs::read(&path) {
        Ok(bytes) => Snapshot::decode(&bytes).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(StateError::Io { path, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::index::IndexConfig;

    fn snapshot() -> Snapshot {
        let spec = WorkerSpec::parse("name=w0,url=http://h:1,events=tcp://h:2,dp=2", Some(16))
            .expect("spec");
        let at = ResumePoint {
            seq: 9,
            fingerprint: 77,
            exact: true,
        };
        Snapshot {
            workers: vec![SavedWorker {
                id: 3,
                spec,
                block_size: Some(16),
                ranks: vec![
                    SavedRank {
                        rank: 0,
                        at: Some(at),
                    },
                    SavedRank { rank: 1, at: None },
                ],
            }],
            index: Index::new(IndexConfig::default()).dump(),
        }
    }

    #[test]
    fn a_snapshot_survives_disk_and_a_damaged_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("kvroute-state-{}", std::process::id()));
        assert!(load(&dir).expect("no file yet").is_none());
        let original = snapshot();
        save(&dir, &original).expect("save");
        let back = load(&dir).expect("load").expect("a snapshot");
        assert_eq!(back.workers, original.workers);
        back.index().expect("index");
        assert!(!back.complete(), "rank 1 has applied nothing");
        assert!(back.knows_anything(), "rank 0 has");
        let bytes = original.encode();
        for cut in [0, 7, 12, 20, bytes.len() - 1] {
            let damaged = Snapshot::decode(&bytes[..cut]).and_then(|s| s.index().map(|_| ()));
            assert!(damaged.is_err(), "cut at {cut}");
        }
        let mut wrong = bytes.clone();
        wrong[8] = 9;
        assert!(Snapshot::decode(&wrong).is_err(), "another version");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_role_survives_a_restart_and_older_snapshots_load_as_both() {
        use crate::ingest::spec::WorkerRole;
        let mut original = snapshot();
        let line =
            "name=p,url=http://h:1,events=tcp://h:2,flavor=sglang,role=prefill,bootstrap_port=8998";
        let prefill = WorkerSpec::parse(line, Some(16)).expect("spec");
        original.workers.push(SavedWorker {
            id: 4,
            spec: prefill,
            block_size: Some(16),
            ranks: vec![SavedRank { rank: 0, at: None }],
        });
        let back = Snapshot::decode(&original.encode()).expect("decodes");
        assert_eq!(back.workers, original.workers);
        assert_eq!(
            (
                back.workers[1].spec.role,
                back.workers[1].spec.bootstrap_port
            ),
            (WorkerRole::Prefill, Some(8998))
        );

        // The header exactly as a build before roles wrote it.
        let header = br#"[{"id":3,"spec":{"name":"w0","url":"http://h:1","ranks":[{"rank":0,"events":"tcp://h:2","replay":null}],"block_size":16,"topic":"","model":null,"flavor":"vllm","speed":1.0},"block_size":16,"ranks":[{"rank":0,"at":{"seq":9,"fingerprint":77,"exact":true}}]}]"#;
        let mut older = Vec::new();
        older.extend_from_slice(MAGIC);
        older.extend_from_slice(&1u32.to_le_bytes());
        older.extend_from_slice(&(header.len() as u64).to_le_bytes());
        older.extend_from_slice(header);
        older.extend_from_slice(&Index::new(IndexConfig::default()).dump());
        let old = Snapshot::decode(&older).expect("an older snapshot loads");
        let spec = &old.workers[0].spec;
        assert_eq!(
            (spec.name.as_str(), spec.role, spec.bootstrap_port),
            ("w0", WorkerRole::Both, None)
        );
        old.index().expect("index");
    }

    #[test]
    fn snapshots_written_and_failed_are_scraped_from_every_clone() {
        use crate::listen::ConnectionMetrics;
        use crate::metrics::{Metrics, ProxyMetrics};
        let counters = SnapshotCounters::default();
        let metrics = Metrics::new(
            &ProxyMetrics::default(),
            &ConnectionMetrics::default(),
            vec![Box::new(counters.clone())],
        );
        assert_eq!(counters.count_written(), 1);
        assert_eq!(counters.clone().count_written(), 2);
        assert_eq!(counters.count_failed(), 1);
        let (_, text) = metrics.render(None);
        assert!(
            text.contains("\nkvroute_state_snapshots_written_total 2\n"),
            "{text}"
        );
        assert!(
            text.contains("\nkvroute_state_snapshot_failures_total 1\n"),
            "{text}"
        );
    }
}
