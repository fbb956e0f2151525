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
    /// A sync in two halves, the fsync (`run`) with no lock held: None when the backend
    /// has no such split (then `sync` is called under the lock).
    fn begin_sync(&mut self) -> io::Result<Option<keel_store::RaftSyncJob>> {
        Ok(None)
    }
    fn finish_sync(&mut self, _job: keel_store::RaftSyncJob) -> io::Result<()> {
        Ok(())
    }
    fn read(&self, from: u64, to_inclusive: u64) -> io::Result<Vec<(u64, Bytes)>>;
    /// Durably removes every entry after `index`.
    fn truncate_after(&mut self, index: u64) -> io::Result<()>;
    /// Drops entries up to `index` (their space may come back later).
    fn purge_upto(&mut self, index: u64) -> io::Result<()>;
    fn last_index(&self) -> Option<u64>;
    /// Small durable state (vote, committed, purged): written atomically, durable on return.
    fn save_state(&mut self, body: &[u8]) -> io::Result<()>;
    fn load_state(&self) -> io::Result<Option<Vec<u8>>>;
    /// Nothing to make durable (memory): an append is complete once written, with no trip
    /// through the syncer.
    fn volatile(&self) -> bool {
        false
    }
}

/// Memory only: a replicated memory stream's log (and tests of the consensus layer).
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
        // An empty span is asked for (`from` = `to` + 1: nothing committed since the last
        // sync); `BTreeMap::range` would panic on it.
        if from > to {
            return Ok(Vec::new());
        }
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
    fn volatile(&self) -> bool {
        true
    }
}

/// On disk: keel-store's Raft log (segmented, CRC'd, through its `Fs` seam).
pub struct FileBackend(keel_store::RaftLog);

impl FileBackend {
    /// Opens (or creates) the log in `dir`; what recovery found damaged is returned to be
    /// logged (the log ends before it, and the leader sends the rest again), with the index
    /// up to which it forgot durable entries (or its vote), if it did: see
    /// `RaftHost::hold_votes`.
    pub fn open(dir: &std::path::Path) -> io::Result<(FileBackend, Vec<String>, Option<u64>)> {
        let (log, problems) = keel_store::RaftLog::open(dir).map_err(store_io)?;
        let lost = log.lost();
        Ok((FileBackend(log), problems, lost))
    }
}

fn store_io(e: keel_store::StoreError) -> io::Error {
    io::Error::other(e.to_string())
}

impl LogBackend for FileBackend {
    fn append(&mut self, entries: &[(u64, Vec<u8>)]) -> io::Result<()> {
        let refs: Vec<(u64, &[u8])> = entries.iter().map(|(i, b)| (*i, b.as_slice())).collect();
        self.0.append(&refs).map_err(store_io)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.0.sync().map_err(store_io)
    }
    fn begin_sync(&mut self) -> io::Result<Option<keel_store::RaftSyncJob>> {
        self.0.begin_sync().map_err(store_io)
    }
    fn finish_sync(&mut self, job: keel_store::RaftSyncJob) -> io::Result<()> {
        self.0.finish_sync(job).map_err(store_io)
    }
    fn read(&self, from: u64, to: u64) -> io::Result<Vec<(u64, Bytes)>> {
        let from = from.max(self.0.first_index());
        let to = to.min(self.0.last_index());
        if from > to {
            return Ok(Vec::new());
        }
        self.0.entries(from..=to).map_err(store_io)
    }
    fn truncate_after(&mut self, index: u64) -> io::Result<()> {
        if index >= self.0.last_index() {
            return Ok(());
        }
        self.0.truncate_after(index).map_err(store_io)
    }
    fn purge_upto(&mut self, index: u64) -> io::Result<()> {
        self.0.purge_upto(index).map_err(store_io)
    }
    fn last_index(&self) -> Option<u64> {
        (self.0.last_index() >= self.0.first_index()).then(|| self.0.last_index())
    }
    fn save_state(&mut self, body: &[u8]) -> io::Result<()> {
        self.0.save_state(body).map_err(store_io)
    }
    fn load_state(&self) -> io::Result<Option<Vec<u8>>> {
        Ok(self.0.load_state())
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
    /// Save the committed id durably (the meta group: its state machine lives in memory
    /// and is rebuilt from the log up to it at start). A stream's state machine keeps its
    /// own applied marker, so its log saves no committed id (an fsync less per batch).
    persist_committed: bool,
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
    pub fn open(backend: Box<dyn LogBackend>, persist_committed: bool) -> io::Result<LogStore> {
        let mut hard: Hard = match backend.load_state()? {
            Some(b) => serde_json::from_slice(&b).map_err(io::Error::other)?,
            None => Hard::default(),
        };
        // A log that lost entries to damage may end before the committed id it saved: only
        // what it still holds can be applied (the leader says the rest again).
        if hard
            .committed
            .is_some_and(|c| Some(c.index) > backend.last_index())
        {
            hard.committed = None;
        }
        let inner = Arc::new(Mutex::new(Inner {
            backend,
            hard,
            persist_committed,
        }));
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
                    let job = inner
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .backend
                        .begin_sync()?;
                    match job {
                        // The fsync with no lock held: appends go on meanwhile.
                        Some(mut job) => {
                            job.run();
                            inner
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .backend
                                .finish_sync(job)
                        }
                        None => inner
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .backend
                            .sync(),
                    }
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
        let mut g = self.lock();
        g.hard.committed = committed;
        if g.persist_committed {
            Self::save_hard(&mut g)?;
        }
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
        let volatile = {
            let mut g = self.lock();
            g.backend.append(&batch).map_err(io_err)?;
            g.backend.volatile()
        };
        if volatile {
            callback.log_io_completed(Ok(()));
            return Ok(());
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Both backends answer an empty span (`from` past `to`) with nothing: a failed commit
    /// right after a sync asks for the committed batches since, which are none.
    #[test]
    fn an_empty_span_reads_as_nothing() {
        let mut m = MemBackend::default();
        m.append(&[(1, b"a".to_vec()), (2, b"b".to_vec())]).unwrap();
        assert!(m.read(3, 2).unwrap().is_empty());
        assert!(m.read(2, 1).unwrap().is_empty());
        assert_eq!(m.read(1, 2).unwrap().len(), 2);
    }
}
