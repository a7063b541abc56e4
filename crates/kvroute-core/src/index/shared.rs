//! The index shared by many reader threads and one writer per rank.
//!
//! A read-write lock around one [`Index`]: lookups take the read side and run
//! in parallel; each event takes the write side alone. Writes are short by
//! construction: a stored event of more than [`SharedIndex::MAX_BLOCKS_PER_WRITE`]
//! blocks is applied in chunks, each chained to the previous chunk's last block,
//! so a lookup never waits behind more than one chunk. Events of one rank stay
//! in order as long as one thread applies them (the ingestion design).

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{Index, RankMatch, WorkerRank};
use crate::event::{KvEvent, Stored};
use crate::hash::LocalBlockHash;

/// An [`Index`] behind a read-write lock, with bounded write sections.
#[derive(Debug, Default)]
pub struct SharedIndex {
    inner: RwLock<Index>,
}

impl SharedIndex {
    /// Blocks applied under one write lock at most.
    pub const MAX_BLOCKS_PER_WRITE: usize = 64;

    /// Shares an index.
    pub fn new(index: Index) -> Self {
        SharedIndex {
            inner: RwLock::new(index),
        }
    }

    /// Read access. A panic in another holder does not make the index unreadable.
    pub fn read(&self) -> RwLockReadGuard<'_, Index> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Write access, for operations other than event application.
    pub fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
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
                        token_ids: None,
                        ..stored.clone_header()
                    };
                    self.write().apply(key, &KvEvent::Stored(part));
                    parent = chunk.last().map(|b| b.external);
                }
            }
            other => self.write().apply(key, other),
        }
    }
}

impl Stored {
    /// The event without its blocks and tokens (for splitting it).
    fn clone_header(&self) -> Stored {
        Stored {
            parent: self.parent,
            blocks: Vec::new(),
            tier: self.tier,
            lora_name: self.lora_name.clone(),
            cache_salt: self.cache_salt.clone(),
            lookahead: self.lookahead,
            dropped_blocks: 0,
            token_ids: None,
        }
    }
}
