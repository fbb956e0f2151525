//! A group's Raft log for openraft: entries, the vote and the committed id, over a
//! [`LogBackend`] (keel-store's durable log on disk; memory in unit tests).
//!
//! `append` writes the entries and hands their flush to the log's syncer task, which runs
//! one fsync for everything queued (group commit) and only then tells openraft the entries
//! are on disk: a follower confirms an append, and a leader counts itself, only after its
//! fsync. That is what makes a quorum ack mean "on disk on a quorum".

// openraft's storage traits fix the error type (`StorageError`, large); helpers return it too.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{
    Entry, LogId, OptionalSend, RaftLogId, RaftLogReader, StorageError, StorageIOError, Vote,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::{NodeId, TypeConfig};

/// Where a log's bytes live.
pub trait LogBackend: Send + 'static {
    /// Writes entries (index order, contiguous with what is there); not yet durable.
    fn append(&mut self, entries: &[(u64, Vec<u8>)]) -> io::Result<()>;
    /// Makes everything appended so far durable.
    fn sync(&mut self) -> io::Result<()>;
    fn read(&self, from: u64, to_inclusive: u64) -> io::Result<Vec<(u64, Bytes)>>;
    /// Durably removes every entry after `index`.
    fn truncate_after(&mut self, index: u64) -> io::Result<()>;
    /// Drops entries up to `index` (their space may come back later).
    fn purge_upto(&mut self, index: u64) -> io::Result<()>;
    fn last_index(&self) -> Option<u64>;
    /// Small durable state (vote, committed, purged): written atomically, durable on return.
    fn save_state(&mut self, body: &[u8]) -> io::Result<()>;
    fn load_state(&self) -> io::Result<Option<Vec<u8>>>;
}

/// Memory only: for tests of the consensus layer.
#[derive(Default)]
pub struct MemBackend {
    entries: BTreeMap<u64, Bytes>,
    state: Option<Vec<u8>>,
}

impl LogBackend for MemBackend {
    fn append(&mut self, entries: &[(u64, Vec<u8>)]) -> io::Result<()> {
        for (i, b) in entries {
            self.entries.insert(*i, Bytes::from(b.clone()));
        }
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn read(&self, from: u64, to: u64) -> io::Result<Vec<(u64, Bytes)>> {
        Ok(self
            .entries
            .range(from..=to)
            .map(|(i, b)| (*i, b.clone()))
            .collect())
    }
    fn truncate_after(&mut self, index: u64) -> io::Result<()> {
        self.entries.split_off(&(index + 1));
        Ok(())
    }
    fn purge_upto(&mut self, index: u64) -> io::Result<()> {
        self.entries = self.entries.split_off(&(index + 1));
        Ok(())
    }
    fn last_index(&self) -> Option<u64> {
        self.entries.keys().next_back().copied()
    }
    fn save_state(&mut self, body: &[u8]) -> io::Result<()> {
        self.state = Some(body.to_vec());
        Ok(())
    }
    fn load_state(&self) -> io::Result<Option<Vec<u8>>> {
        Ok(self.state.clone())
    }
}

/// The durable state beside the entries.
#[derive(Serialize, Deserialize, Default, Clone)]
struct Hard {
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
    purged: Option<LogId<NodeId>>,
}

struct Inner {
    backend: Box<dyn LogBackend>,
    hard: Hard,
}

/// One group's log, as openraft sees it. Cheap to clone (the reader is a clone).
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Mutex<Inner>>,
    syncer: mpsc::UnboundedSender<LogFlushed<TypeConfig>>,
}

fn io_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write_logs(&io::Error::other(e.to_string())).into()
}

impl LogStore {
    pub fn open(backend: Box<dyn LogBackend>) -> io::Result<LogStore> {
        let hard = match backend.load_state()? {
            Some(b) => serde_json::from_slice(&b).map_err(io::Error::other)?,
            None => Hard::default(),
        };
        let inner = Arc::new(Mutex::new(Inner { backend, hard }));
        // One syncer per log: callbacks queue in order; each round runs one fsync for all
        // of them. (Unbounded, but at most one entry per append openraft has in flight,
        // which its own max_payload_entries and replication window bound.)
        let (tx, mut rx) = mpsc::unbounded_channel::<LogFlushed<TypeConfig>>();
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut waiting = Vec::new();
            while rx.recv_many(&mut waiting, 1024).await > 0 {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let r = tokio::task::spawn_blocking(move || {
                    let mut g = inner.lock().unwrap_or_else(|e| e.into_inner());
                    g.backend.sync()
                })
                .await
                .unwrap_or_else(|e| Err(io::Error::other(e)));
                for cb in waiting.drain(..) {
                    cb.log_io_completed(match &r {
                        Ok(()) => Ok(()),
                        Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                    });
                }
            }
        });
        Ok(LogStore { inner, syncer: tx })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn save_hard(g: &mut Inner) -> Result<(), StorageError<NodeId>> {
        let b = serde_json::to_vec(&g.hard).map_err(io_err)?;
        g.backend.save_state(&b).map_err(io_err)
    }
}

fn decode(b: &[u8]) -> Result<Entry<TypeConfig>, StorageError<NodeId>> {
    bincode::deserialize(b).map_err(|e| StorageIOError::read_logs(&e).into())
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<NodeId>> {
        let from = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i + 1,
            Bound::Unbounded => 0,
        };
        let to = match range.end_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(0) => return Ok(Vec::new()),
            Bound::Excluded(i) => i - 1,
            Bound::Unbounded => u64::MAX,
        };
        let raw = self
            .lock()
            .backend
            .read(from.saturating_add(1), to.saturating_add(1))
            .map_err(|e| StorageError::from(StorageIOError::read_logs(&e)))?;
        raw.iter().map(|(_, b)| decode(b)).collect()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let g = self.lock();
        let purged = g.hard.purged;
        let last = match g.backend.last_index() {
            Some(i) => {
                let raw = g
                    .backend
                    .read(i, i)
                    .map_err(|e| StorageError::from(StorageIOError::read_logs(&e)))?;
                match raw.first() {
                    Some((_, b)) => Some(*decode(b)?.get_log_id()),
                    None => purged,
                }
            }
            None => purged,
        };
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> LogStore {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut g = self.lock();
        g.hard.vote = Some(*vote);
        Self::save_hard(&mut g)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        Ok(self.lock().hard.vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        // Not fsynced on its own: a committed id lost in a crash is learnt again from the
        // leader; it only lets a restarted node apply sooner.
        let mut g = self.lock();
        g.hard.committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self.lock().hard.committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = Vec::new();
        for e in entries {
            let b = bincode::serialize(&e).map_err(io_err)?;
            batch.push((e.log_id.index + 1, b));
        }
        self.lock().backend.append(&batch).map_err(io_err)?;
        // The fsync happens on the syncer; openraft learns of it through the callback.
        if let Err(e) = self.syncer.send(callback) {
            e.0.log_io_completed(Err(io::Error::other("log closed")));
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut g = self.lock();
        // Removes log_id.index and after: backend index log_id.index + 1 and after.
        g.backend.truncate_after(log_id.index).map_err(io_err)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut g = self.lock();
        g.hard.purged = Some(log_id);
        Self::save_hard(&mut g)?;
        g.backend.purge_upto(log_id.index + 1).map_err(io_err)
    }
}
