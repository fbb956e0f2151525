//! A group's Raft log for openraft: entries, the vote and the committed id, over a
//! [`LogBackend`] (keel-store's durable log on disk; memory in unit tests).
//!
//! `append` writes the entries and hands their flush to the log's syncer task, which runs
//! one fsync for everything queued (group commit) and only then tells openraft the entries
//! are on disk: a follower confirms an append only after its fsync. A stream leader's own
//! appends are reported at once (so that its fsync runs alongside the followers'), and
//! what openraft could then count too early waits for the `flushed` watch instead (see
//! `LogStore::append`). That is what makes a quorum ack mean "on disk on a quorum".

// openraft's storage traits fix the error type (`StorageError`, large); helpers return it too.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    fn begin_sync(&mut self) -> io::Result<Option<SyncJob>> {
        Ok(None)
    }
    fn finish_sync(&mut self, _job: SyncJob) -> io::Result<()> {
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

/// The fsync half of a split sync, run with no lock held.
pub enum SyncJob {
    Log(keel_store::RaftSyncJob),
    /// A test's: waits for the test to let it finish (or fail).
    #[cfg(test)]
    Held(tests::Gate),
}

impl SyncJob {
    fn run(&mut self) {
        match self {
            SyncJob::Log(j) => j.run(),
            #[cfg(test)]
            SyncJob::Held(g) => g.pass(),
        }
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

/// What a closed log's store holds: nothing; every read and write fails.
struct Closed;

fn closed() -> io::Error {
    io::Error::other("the log is closed")
}

impl LogBackend for Closed {
    fn append(&mut self, _entries: &[(u64, Vec<u8>)]) -> io::Result<()> {
        Err(closed())
    }
    fn sync(&mut self) -> io::Result<()> {
        Err(closed())
    }
    fn read(&self, _from: u64, _to: u64) -> io::Result<Vec<(u64, Bytes)>> {
        Err(closed())
    }
    fn truncate_after(&mut self, _index: u64) -> io::Result<()> {
        Err(closed())
    }
    fn purge_upto(&mut self, _index: u64) -> io::Result<()> {
        Err(closed())
    }
    fn last_index(&self) -> Option<u64> {
        None
    }
    fn save_state(&mut self, _body: &[u8]) -> io::Result<()> {
        Err(closed())
    }
    fn load_state(&self) -> io::Result<Option<Vec<u8>>> {
        Err(closed())
    }
}

/// On disk: keel-store's Raft log (segmented, CRC'd, through its `Fs` seam).
pub struct FileBackend(keel_store::RaftLog);

impl FileBackend {
    /// Opens (or creates) the log in `dir`; what recovery found damaged is returned to be
    /// logged (the log ends before it, and the leader sends the rest again), with the index
    /// up to which it forgot durable entries (or its vote), if it did: see
    /// `RaftHost::hold_votes`.
    /// `segment_size`: a purge drops whole segments only, so a small log (the meta
    /// group's) needs small ones for its compaction to free anything.
    pub fn open(
        dir: &std::path::Path,
        disk: &keel_store::Disk,
        segment_size: Option<u64>,
    ) -> io::Result<(FileBackend, Vec<String>, Option<u64>)> {
        let mut cfg = keel_store::RaftLogConfig {
            disk: disk.clone(),
            ..Default::default()
        };
        if let Some(n) = segment_size {
            cfg.segment_size = n;
        }
        let (log, problems) = keel_store::RaftLog::open_with(dir, cfg).map_err(store_io)?;
        let lost = log.lost();
        Ok((FileBackend(log), problems, lost))
    }
}

/// Opens a group's log in `dir` (on the server's disk) as at a start: the problems its
/// recovery found are logged, each after `what` (the log's name), and a log that forgot
/// entries it had acknowledged holds the group's votes until a leader sends them again.
pub fn open_logged(
    server: &crate::server::Server,
    host: &super::RaftHost,
    group: &str,
    dir: &std::path::Path,
    what: &str,
    segment_size: Option<u64>,
) -> io::Result<FileBackend> {
    let (backend, problems, lost) = FileBackend::open(dir, &server.opts.disk, segment_size)?;
    for p in problems {
        crate::warn!(server.log, "{what}: {p}");
    }
    if let Some(upto) = lost {
        host.hold_votes(group, upto);
    }
    Ok(backend)
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
    fn begin_sync(&mut self) -> io::Result<Option<SyncJob>> {
        Ok(self.0.begin_sync().map_err(store_io)?.map(SyncJob::Log))
    }
    fn finish_sync(&mut self, job: SyncJob) -> io::Result<()> {
        match job {
            SyncJob::Log(j) => self.0.finish_sync(j).map_err(store_io),
            #[cfg(test)]
            SyncJob::Held(_) => Ok(()),
        }
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
    /// This server's id, when a leader's own appends are reported to openraft before their
    /// fsync (a stream group's: see `append`); None: every append after its fsync.
    early: Option<NodeId>,
    /// The last entry appended.
    appended: Option<LogId<NodeId>>,
    /// When the first append not yet in a sync round was written.
    unsynced_since: Option<Instant>,
    /// The meta group's: the last snapshot its state machine made durable. A purge goes
    /// no further (openraft purges after installing a snapshot without waiting for the
    /// state machine to have written it: a crash between would leave a log that starts
    /// after the snapshot on disk).
    purge_floor: Option<PurgeFloor>,
    /// The running round's oldest append: a round older than `STALL` means the disk has
    /// stalled (see `write`).
    round_since: Option<Instant>,
}

/// A leader's own appends are waited for again (as openraft 0.9 waits for them) while an
/// fsync has run this long: openraft's core then stops, heartbeats too, and another server
/// is elected, as before, instead of a leader that goes on heartbeating while nothing it
/// writes reaches its disk.
const STALL: Duration = Duration::from_millis(500);

/// How long `LogStore::close` waits for a running fsync round.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// A log's extent, as `LogStore::stats` reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogStats {
    pub entries: u64,
    pub first: u64,
    pub last: u64,
    pub committed: u64,
}

/// How far a log is on disk.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OnDisk {
    /// The last entry known to be on disk (a volatile backend's: the last appended).
    pub last: Option<LogId<NodeId>>,
    /// An fsync failed: nothing after `last` will be (the log refuses everything after).
    pub failed: bool,
}

/// Where an append went.
#[derive(Debug, PartialEq)]
enum Written {
    /// Nothing to make durable (memory).
    Volatile,
    /// A leader's own: reported now, the syncer makes it durable (`flushed` moves).
    Own,
    /// Reported once the syncer's fsync covers it.
    Wait,
}

/// Whether an append is this server's own as the leader of the current term (reported
/// before its fsync: see `LogStore::append`): its vote is committed, for itself, and every
/// entry carries that leader id. A follower saves the new leader's vote before it takes
/// that leader's entries, so its appends never count, even of entries it once wrote itself.
fn own_append(
    early: Option<NodeId>,
    vote: Option<Vote<NodeId>>,
    leaders: &[openraft::CommittedLeaderId<NodeId>],
) -> bool {
    let (Some(me), Some(v)) = (early, vote) else {
        return false;
    };
    v.is_committed()
        && v.leader_id().voted_for() == Some(me)
        && !leaders.is_empty()
        && leaders.iter().all(|l| l == v.leader_id())
}

/// The saved vote as a stream group's log gives it back at start. openraft 0.9 resumes a
/// server whose saved vote is its own committed one as leader of that term at once. But a
/// leader's own appends go to the followers before its fsync (`append`), and a kill cuts
/// its unsynced tail at recovery while the followers keep those entries: resumed in the
/// same term, it would write other entries under the same log ids, which the followers
/// take for the ones they hold (found by the fault checker: a PubAck for sequences every
/// replica holds other messages at). Not committed, the vote makes it stand for election
/// in a new term, whose entries no follower can mistake for old ones.
fn restart_vote(early: Option<NodeId>, v: Vote<NodeId>) -> Vote<NodeId> {
    match early {
        Some(me) if v.is_committed() && v.leader_id().voted_for() == Some(me) => {
            Vote::new(v.leader_id().term, me)
        }
        _ => v,
    }
}

/// What waits for the syncer's next fsync.
enum Waiter {
    /// openraft's callback: a follower's append, answered only once it is on disk.
    Flush(LogFlushed<TypeConfig>),
    /// A leader's own append, already reported: `flushed` tells when it is on disk.
    Own,
}

/// One group's log, as openraft sees it. Cheap to clone (the reader is a clone).
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Mutex<Inner>>,
    syncer: mpsc::UnboundedSender<Waiter>,
    flushed: Arc<tokio::sync::watch::Sender<OnDisk>>,
    /// Held by the syncer for a round: keel-store's log refuses a truncation while an
    /// fsync runs, and a leader's own appends no longer keep openraft waiting for it.
    turn: Arc<tokio::sync::Mutex<()>>,
}

/// The last snapshot made durable (`LogStore::set_purge_floor`).
pub type PurgeFloor = Arc<Mutex<Option<LogId<NodeId>>>>;

fn io_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write_logs(&io::Error::other(e.to_string())).into()
}

impl LogStore {
    /// `early`: this server's id, for a stream group (a leader's own appends are reported
    /// at once, see `append`); None for the meta group.
    pub fn open(
        backend: Box<dyn LogBackend>,
        persist_committed: bool,
        early: Option<NodeId>,
    ) -> io::Result<LogStore> {
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
        // What the log holds at opening is what it reads back: counted as on disk.
        let appended = last_log_id(&*backend)
            .map_err(|e| io::Error::other(e.to_string()))?
            .or(hard.purged);
        let inner = Arc::new(Mutex::new(Inner {
            backend,
            hard,
            persist_committed,
            early,
            appended,
            unsynced_since: None,
            purge_floor: None,
            round_since: None,
        }));
        let flushed = Arc::new(tokio::sync::watch::Sender::new(OnDisk {
            last: appended,
            failed: false,
        }));
        // One syncer per log: waiters queue in order; each round runs one fsync for all of
        // them. (Unbounded, but one waiter per append: a follower's are bounded by what
        // openraft has in flight, a leader's own by its clients' batches, which wait for
        // their commit, and `STALL` turns them back into waited-for appends.)
        let (tx, mut rx) = mpsc::unbounded_channel::<Waiter>();
        let weak = Arc::downgrade(&inner);
        let on_disk = flushed.clone();
        let turn = Arc::new(tokio::sync::Mutex::new(()));
        let my_turn = turn.clone();
        tokio::spawn(async move {
            let mut waiting = Vec::new();
            while rx.recv_many(&mut waiting, 1024).await > 0 {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                // Held until `flushed` is updated: a truncation waits for the round.
                let _turn = my_turn.lock().await;
                let r = tokio::task::spawn_blocking(move || {
                    let lock = || inner.lock().unwrap_or_else(|e| e.into_inner());
                    let round = || {
                        let (job, upto) = {
                            let mut g = lock();
                            g.round_since = g.unsynced_since.take();
                            (g.backend.begin_sync()?, g.appended)
                        };
                        match job {
                            // The fsync with no lock held: appends go on meanwhile.
                            Some(mut job) => {
                                job.run();
                                lock().backend.finish_sync(job)?;
                            }
                            None => lock().backend.sync()?,
                        }
                        Ok(upto)
                    };
                    let r = round();
                    lock().round_since = None;
                    r
                })
                .await
                .unwrap_or_else(|e| Err(io::Error::other(e)));
                // A failed fsync leaves `last` where it was: a leader's own batch past it is
                // never applied (and the log refuses everything after such a failure).
                on_disk.send_if_modified(|d| match &r {
                    Ok(upto) if *upto > d.last => {
                        d.last = *upto;
                        true
                    }
                    Err(_) if !d.failed => {
                        d.failed = true;
                        true
                    }
                    _ => false,
                });
                for w in waiting.drain(..) {
                    if let Waiter::Flush(cb) = w {
                        cb.log_io_completed(match &r {
                            Ok(_) => Ok(()),
                            Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                        });
                    }
                }
            }
        });
        Ok(LogStore {
            inner,
            syncer: tx,
            flushed,
            turn,
        })
    }

    /// Writes entries (not yet durable); an own append (see `own_append`) is queued for
    /// the syncer here, the others wait for it through openraft's callback.
    fn write(
        &self,
        entries: impl IntoIterator<Item = Entry<TypeConfig>>,
    ) -> Result<Written, StorageError<NodeId>> {
        let mut batch = Vec::new();
        let mut leaders = Vec::new();
        let mut last = None;
        for e in entries {
            let b = bincode::serialize(&e).map_err(io_err)?;
            batch.push((e.log_id.index + 1, b));
            if leaders.last() != Some(&e.log_id.leader_id) {
                leaders.push(e.log_id.leader_id);
            }
            last = Some(e.log_id);
        }
        let mut g = self.lock();
        g.backend.append(&batch).map_err(io_err)?;
        if last.is_some() {
            g.appended = last;
        }
        if g.backend.volatile() {
            let last = g.appended;
            drop(g);
            self.flushed.send_modify(|d| d.last = last);
            return Ok(Written::Volatile);
        }
        if g.unsynced_since.is_none() {
            g.unsynced_since = Some(Instant::now());
        }
        let stalled = g.round_since.is_some_and(|t| t.elapsed() > STALL);
        if stalled || !own_append(g.early, g.hard.vote, &leaders) {
            return Ok(Written::Wait);
        }
        drop(g);
        if self.syncer.send(Waiter::Own).is_err() {
            return Err(io_err("log closed"));
        }
        Ok(Written::Own)
    }

    /// Lets go of the log's files (and its directory's lock) once its group's node has
    /// stopped: a copy of this handle kept elsewhere (the stream's `Shared`, a task winding
    /// down) would otherwise keep them open, and the group loaded again on the same
    /// directory could not open it. Waits for a running fsync round; everything after fails.
    pub async fn close(&self) {
        // A round whose fsync hangs (a stalled disk) would hold a stop or a shutdown up:
        // after a while the log stays open instead, let go with its last handle.
        let Ok(_turn) = tokio::time::timeout(CLOSE_WAIT, self.turn.lock()).await else {
            return;
        };
        let old = std::mem::replace(&mut self.lock().backend, Box::new(Closed));
        drop(old);
    }

    /// Purges go no further than `floor` says (see `Inner::purge_floor`).
    pub fn set_purge_floor(&self, floor: PurgeFloor) {
        self.lock().purge_floor = Some(floor);
    }

    /// Its first and last entries and the committed one (`/raftz`'s `wal`).
    pub fn stats(&self) -> LogStats {
        let g = self.lock();
        let purged = g.hard.purged.map(|p| p.index);
        let last = g.backend.last_index().or(purged).unwrap_or(0);
        let first = purged.map_or(1, |p| p + 1);
        LogStats {
            entries: (last + 1).saturating_sub(first),
            first: if last >= first { first } else { 0 },
            last,
            committed: g.hard.committed.map_or(0, |c| c.index),
        }
    }

    /// The bytes of the entries after `index` (the meta log's since its snapshot, for
    /// `/jsz`: a few small entries; a read that fails counts none).
    pub fn bytes_after(&self, index: u64) -> u64 {
        let g = self.lock();
        let Some(last) = g.backend.last_index().filter(|l| *l > index) else {
            return 0;
        };
        let from = (index + 1).max(g.hard.purged.map_or(1, |p| p.index + 1));
        g.backend
            .read(from, last)
            .map_or(0, |es| es.iter().map(|(_, b)| b.len() as u64).sum())
    }

    /// How far the log is on disk, as it moves.
    pub fn flushed(&self) -> tokio::sync::watch::Receiver<OnDisk> {
        self.flushed.subscribe()
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

/// The id of the last entry the backend holds (None when it holds none: all purged).
fn last_log_id(backend: &dyn LogBackend) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
    let Some(i) = backend.last_index() else {
        return Ok(None);
    };
    let raw = backend
        .read(i, i)
        .map_err(|e| StorageError::from(StorageIOError::read_logs(&e)))?;
    match raw.first() {
        Some((_, b)) => Ok(Some(*decode(b)?.get_log_id())),
        None => Ok(None),
    }
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
        Ok(LogState {
            last_purged_log_id: g.hard.purged,
            last_log_id: last_log_id(&*g.backend)?.or(g.hard.purged),
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
        let g = self.lock();
        Ok(g.hard.vote.map(|v| restart_vote(g.early, v)))
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
        match self.write(entries)? {
            // openraft 0.9's core waits for a leader's own append to be flushed before it
            // sends the entries to the followers, so their fsyncs came after the leader's,
            // one after the other. A leader's own append is reported at once: the
            // followers' fsyncs run alongside its own. openraft may then count the leader
            // in a quorum before its fsync, so what depends on that waits for `flushed`
            // instead: the state machine applies (and so a batch is confirmed, a marker
            // moves, a snapshot is taken) only what the leader's fsync covers, and the
            // commit index the followers learn is held to it (`Conn::append_entries`): no
            // replica applies, and no client hears of, an entry only one disk holds.
            Written::Volatile | Written::Own => callback.log_io_completed(Ok(())),
            // The fsync happens on the syncer; openraft learns of it through the callback.
            Written::Wait => {
                if let Err(e) = self.syncer.send(Waiter::Flush(callback)) {
                    if let Waiter::Flush(cb) = e.0 {
                        cb.log_io_completed(Err(io::Error::other("log closed")));
                    }
                }
            }
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let _turn = self.turn.lock().await;
        let mut g = self.lock();
        // Removes log_id.index and after: backend index log_id.index + 1 and after.
        g.backend.truncate_after(log_id.index).map_err(io_err)?;
        let last = last_log_id(&*g.backend)?.or(g.hard.purged);
        g.appended = last;
        self.flushed.send_if_modified(|d| {
            let past = d.last > last;
            if past {
                d.last = last;
            }
            past
        });
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut g = self.lock();
        let log_id = match &g.purge_floor {
            None => log_id,
            Some(f) => match *f.lock().unwrap_or_else(|e| e.into_inner()) {
                Some(d) if d.index < log_id.index => d,
                Some(_) => log_id,
                None => return Ok(()),
            },
        };
        if g.hard.purged.is_some_and(|p| p.index >= log_id.index) {
            return Ok(());
        }
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

    use openraft::{CommittedLeaderId, EntryPayload};
    use std::sync::Condvar;

    /// A log whose fsyncs wait (with no lock held, as keel-store's) until the test lets
    /// them finish (or fail).
    #[derive(Clone, Default)]
    pub struct Gate(Arc<(Mutex<(u32, bool)>, Condvar)>);

    impl Gate {
        /// The fsync: waits for the test; a failure is taken up by `finish_sync`.
        pub fn pass(&self) {
            let (lock, cv) = &*self.0;
            let mut g = cv.wait_while(lock.lock().unwrap(), |g| g.0 == 0).unwrap();
            g.0 -= 1;
        }
        fn failing(&self) -> bool {
            self.0 .0.lock().unwrap().1
        }

        /// Lets `n` more fsyncs finish; `fail`: they fail.
        fn open(&self, n: u32, fail: bool) {
            let mut g = self.0 .0.lock().unwrap();
            g.0 += n;
            g.1 = fail;
            self.0 .1.notify_all();
        }
    }

    struct Gated(MemBackend, Gate);

    impl LogBackend for Gated {
        fn append(&mut self, entries: &[(u64, Vec<u8>)]) -> io::Result<()> {
            self.0.append(entries)
        }
        fn sync(&mut self) -> io::Result<()> {
            unreachable!("the syncer splits its syncs")
        }
        fn begin_sync(&mut self) -> io::Result<Option<SyncJob>> {
            Ok(Some(SyncJob::Held(self.1.clone())))
        }
        fn finish_sync(&mut self, _job: SyncJob) -> io::Result<()> {
            if self.1.failing() {
                return Err(io::Error::other("injected fsync failure"));
            }
            Ok(())
        }
        fn read(&self, from: u64, to: u64) -> io::Result<Vec<(u64, Bytes)>> {
            self.0.read(from, to)
        }
        fn truncate_after(&mut self, index: u64) -> io::Result<()> {
            self.0.truncate_after(index)
        }
        fn purge_upto(&mut self, index: u64) -> io::Result<()> {
            self.0.purge_upto(index)
        }
        fn last_index(&self) -> Option<u64> {
            self.0.last_index()
        }
        fn save_state(&mut self, body: &[u8]) -> io::Result<()> {
            self.0.save_state(body)
        }
        fn load_state(&self) -> io::Result<Option<Vec<u8>>> {
            self.0.load_state()
        }
    }

    /// A stream group's log (server 1) over a `Gated` backend, with its gate.
    fn gated() -> (Gate, LogStore) {
        let gate = Gate::default();
        let log = LogStore::open(
            Box::new(Gated(MemBackend::default(), gate.clone())),
            false,
            Some(1),
        )
        .unwrap();
        (gate, log)
    }

    fn entry(term: u64, node: NodeId, index: u64) -> Entry<TypeConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, node), index),
            payload: EntryPayload::Blank,
        }
    }

    /// The meta group's purge goes no further than its last durable snapshot, and not at
    /// all before there is one.
    #[tokio::test]
    async fn a_purge_stops_at_the_durable_snapshot() {
        use openraft::storage::{RaftLogReader, RaftLogStorage};
        let mut log = LogStore::open(Box::new(MemBackend::default()), true, None).unwrap();
        let floor: PurgeFloor = Arc::new(Mutex::new(None));
        log.set_purge_floor(floor.clone());
        let mut on_disk = log.flushed();
        let _ = log.write((1..=5).map(|i| entry(1, 1, i))).unwrap();
        on_disk
            .wait_for(|d| d.last.is_some_and(|l| l.index == 5))
            .await
            .unwrap();
        log.purge(entry(1, 1, 4).log_id).await.unwrap();
        assert_eq!(log.get_log_state().await.unwrap().last_purged_log_id, None);
        *floor.lock().unwrap() = Some(entry(1, 1, 2).log_id);
        log.purge(entry(1, 1, 4).log_id).await.unwrap();
        let st = log.get_log_state().await.unwrap();
        assert_eq!(st.last_purged_log_id.map(|l| l.index), Some(2));
        assert_eq!(log.try_get_log_entries(3..=5).await.unwrap().len(), 3);
    }

    #[test]
    fn only_a_leaders_appends_in_its_own_term_are_its_own() {
        let lead = |t, n| Some(Vote::new_committed(t, n));
        let ids = |v: &[(u64, NodeId)]| {
            v.iter()
                .map(|(t, n)| CommittedLeaderId::new(*t, *n))
                .collect::<Vec<_>>()
        };
        assert!(own_append(Some(1), lead(3, 1), &ids(&[(3, 1)])));
        // A follower: the vote (and the entries) are another server's.
        assert!(!own_append(Some(1), lead(3, 2), &ids(&[(3, 2)])));
        // Entries this server wrote as leader of an earlier term, sent back by a later
        // leader: not its own any more (it must answer only once they are on disk).
        assert!(!own_append(Some(1), lead(4, 2), &ids(&[(3, 1)])));
        assert!(!own_append(Some(1), lead(4, 1), &ids(&[(3, 1), (4, 1)])));
        // A candidate's vote is not committed; the meta group opts out (None).
        assert!(!own_append(Some(1), Some(Vote::new(3, 1)), &ids(&[(3, 1)])));
        assert!(!own_append(None, lead(3, 1), &ids(&[(3, 1)])));
        assert!(!own_append(Some(1), None, &ids(&[(3, 1)])));
    }

    /// A stream group's leader that restarts does not resume its term as leader (its log
    /// may have lost entries the followers hold under the same ids): its saved vote reads
    /// back as not committed. Another leader's vote, and the meta group's, read back as saved.
    #[tokio::test]
    async fn a_restarted_leader_of_a_stream_group_stands_for_election_again() {
        let (_gate, mut log) = gated();
        log.save_vote(&Vote::new_committed(3, 1)).await.unwrap();
        let v = log.read_vote().await.unwrap().unwrap();
        assert!(!v.is_committed());
        assert_eq!(v, Vote::new(3, 1));
        log.save_vote(&Vote::new_committed(4, 2)).await.unwrap();
        assert_eq!(
            log.read_vote().await.unwrap(),
            Some(Vote::new_committed(4, 2))
        );
        let mut meta = LogStore::open(Box::new(MemBackend::default()), true, None).unwrap();
        meta.save_vote(&Vote::new_committed(3, 1)).await.unwrap();
        assert_eq!(
            meta.read_vote().await.unwrap(),
            Some(Vote::new_committed(3, 1))
        );
    }

    /// A leader's own append is reported before its fsync and `flushed` moves only once
    /// the fsync is done (what the state machine waits for before applying); a follower's
    /// append waits for its fsync; a failed fsync is reported and `flushed` stays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leaders_own_append_is_on_disk_only_once_flushed_says_so() {
        let (gate, mut log) = gated();
        let mut on_disk = log.flushed();
        assert_eq!(*on_disk.borrow(), OnDisk::default());
        log.save_vote(&Vote::new_committed(3, 1)).await.unwrap();
        assert_eq!(
            log.write([entry(3, 1, 1), entry(3, 1, 2)]).unwrap(),
            Written::Own
        );
        // Not on disk yet: the fsync is held.
        assert!(
            tokio::time::timeout(Duration::from_millis(200), on_disk.changed())
                .await
                .is_err()
        );
        assert_eq!(on_disk.borrow().last, None);
        gate.open(1, false);
        let d = *on_disk.wait_for(|d| d.last.is_some()).await.unwrap();
        assert_eq!(d.last, Some(entry(3, 1, 2).log_id));
        assert!(!d.failed);

        // Another leader's entries: reported only after the fsync (through the callback).
        log.save_vote(&Vote::new_committed(4, 2)).await.unwrap();
        assert_eq!(log.write([entry(4, 2, 3)]).unwrap(), Written::Wait);

        // A failed fsync: `flushed` keeps its place and says so.
        log.save_vote(&Vote::new_committed(5, 1)).await.unwrap();
        assert_eq!(log.write([entry(5, 1, 4)]).unwrap(), Written::Own);
        gate.open(1, true);
        let d = *on_disk.wait_for(|d| d.failed).await.unwrap();
        assert_eq!(d.last, Some(entry(3, 1, 2).log_id));

        // Truncation takes `flushed` back with it.
        log.truncate(entry(3, 1, 2).log_id).await.unwrap();
        assert_eq!(on_disk.borrow().last, Some(entry(3, 1, 1).log_id));
    }

    /// While an fsync runs longer than `STALL`, a leader's own appends are waited for
    /// again (openraft's core stops, and another server is elected); a truncation waits
    /// for the running fsync (keel-store's log refuses one meanwhile).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_fsync_makes_appends_wait_and_truncation_waits_for_it() {
        let (gate, mut log) = gated();
        let mut on_disk = log.flushed();
        log.save_vote(&Vote::new_committed(3, 1)).await.unwrap();
        assert_eq!(log.write([entry(3, 1, 1)]).unwrap(), Written::Own);
        assert_eq!(log.write([entry(3, 1, 2)]).unwrap(), Written::Own);
        let started = Instant::now();
        while log.lock().round_since.is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "no sync round began"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(STALL + Duration::from_millis(50)).await;
        assert_eq!(log.write([entry(3, 1, 3)]).unwrap(), Written::Wait);

        let mut t = log.clone();
        let truncating = tokio::spawn(async move { t.truncate(entry(3, 1, 2).log_id).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!truncating.is_finished(), "truncated while an fsync ran");
        gate.open(1, false);
        truncating.await.unwrap().unwrap();
        let d = *on_disk.wait_for(|d| d.last.is_some()).await.unwrap();
        assert_eq!(d.last, Some(entry(3, 1, 1).log_id));
        // The disk is back: a leader's own appends are reported at once again.
        assert_eq!(log.write([entry(3, 1, 2)]).unwrap(), Written::Own);
        gate.open(10, false);
    }
}
