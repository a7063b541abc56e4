//! The index shared by many reader threads and one writer per rank.
//!
//! A read-write lock around one [`Index`]: lookups take the read side and run
//! in parallel; each event takes the write side alone. Two rules keep lookups
//! from waiting behind writes:
//! * writes are short: a stored event of more than
//!   [`SharedIndex::MAX_BLOCKS_PER_WRITE`] blocks is applied in chunks, each
//!   chained to the previous chunk's last block;
//! * writers are polite: a lock that is released and re-taken at once would
//!   starve readers, so after each write section a writer waits (briefly,
//!   bounded) until readers that were waiting have the lock.
//!
//! Events of one rank stay in order as long as one thread applies them (the
//! ingestion design). A lookup sees each write section whole or not at all.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{Index, RankMatch, WorkerRank};
use crate::event::{KvEvent, Stored};
use crate::hash::LocalBlockHash;

/// An [`Index`] behind a read-write lock, with bounded, reader-friendly writes.
#[derive(Debug, Default)]
pub struct SharedIndex {
    inner: RwLock<Index>,
    waiting_readers: AtomicU32,
}

/// Spins a reader makes before it sleeps on the lock; a write section is a few
/// microseconds, so most waits end spinning.
const READER_SPINS: u32 = 4_000;

/// Longest a polite writer waits for waiting readers (spin iterations).
const WRITER_COURTESY_SPINS: u32 = 20_000;

impl SharedIndex {
    /// Blocks applied under one write lock at most.
    pub const MAX_BLOCKS_PER_WRITE: usize = 16;

    /// Shares an index.
    pub fn new(index: Index) -> Self {
        SharedIndex {
            inner: RwLock::new(index),
            waiting_readers: AtomicU32::new(0),
        }
    }

    /// Read access. A panic in another holder does not make the index unreadable.
    pub fn read(&self) -> RwLockReadGuard<'_, Index> {
        if let Ok(guard) = self.inner.try_read() {
            return guard;
        }
        self.waiting_readers.fetch_add(1, Ordering::AcqRel);
        let mut guard = None;
        for _ in 0..READER_SPINS {
            if let Ok(g) = self.inner.try_read() {
                guard = Some(g);
                break;
            }
            spin_loop();
        }
        let guard =
            guard.unwrap_or_else(|| self.inner.read().unwrap_or_else(PoisonError::into_inner));
        self.waiting_readers.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    /// Write access, for operations other than event application.
    pub fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets readers that are waiting take the lock before this writer takes it again.
    fn yield_to_readers(&self) {
        let mut spins = 0;
        while self.waiting_readers.load(Ordering::Acquire) > 0 && spins < WRITER_COURTESY_SPINS {
            spin_loop();
            spins += 1;
        }
    }

    /// Looks up a request's blocks (see [`Index::find_matches`]).
    pub fn find_matches(&self, locals: &[LocalBlockHash]) -> Vec<RankMatch> {
        self.read().find_matches(locals)
    }

    /// Applies one event, in write sections of bounded length.
    pub fn apply(&self, key: WorkerRank, event: &KvEvent) {
        match event {
            KvEvent::Stored(stored) if stored.blocks.len() > Self::MAX_BLOCKS_PER_WRITE => {
                let mut parent = stored.parent;
                for chunk in stored.blocks.chunks(Self::MAX_BLOCKS_PER_WRITE) {
                    let part = Stored {
                        parent,
                        blocks: chunk.to_vec(),
                        ..stored.header()
                    };
                    self.write().apply(key, &KvEvent::Stored(part));
                    self.yield_to_readers();
                    parent = chunk.last().map(|b| b.external);
                }
            }
            KvEvent::Removed(removed) if removed.blocks.len() > Self::MAX_BLOCKS_PER_WRITE => {
                for chunk in removed.blocks.chunks(Self::MAX_BLOCKS_PER_WRITE) {
                    let part = crate::event::Removed {
                        blocks: chunk.to_vec(),
                        tier: removed.tier,
                    };
                    self.write().apply(key, &KvEvent::Removed(part));
                    self.yield_to_readers();
                }
            }
            other => {
                self.write().apply(key, other);
                self.yield_to_readers();
            }
        }
    }
}

impl Stored {
    /// The event without its blocks and tokens (for splitting it).
    fn header(&self) -> Stored {
        Stored {
            parent: self.parent,
            blocks: Vec::new(),
            tier: self.tier,
            block_size: self.block_size,
            lora_name: self.lora_name.clone(),
            cache_salt: self.cache_salt.clone(),
            lookahead: self.lookahead,
            dropped_blocks: 0,
            token_ids: None,
        }
    }
}
