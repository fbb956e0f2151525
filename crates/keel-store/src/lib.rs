//! keel-store: where JetStream messages live. One trait, [`Store`], with two implementations:
//! a memory store and a file store (append-only segment files, a CRC on every record, an
//! index saved on clean shutdown and rebuilt by scanning otherwise). No networking and no
//! async: the server's stream task calls it, batching appends and calling [`Store::sync`]
//! once per batch (group commit) before it acknowledges any message of the batch.
//!
//! Limits (max msgs/bytes/age/per-subject, discard policy) are enforced inside the store so
//! that "store one message and apply the limits" is one step. Byte accounting follows the
//! reference server so a config tuned there keeps the same number of messages here:
//! file store `30 + subject + data` (`34 + subject + headers + data` with headers),
//! memory store `16 + subject + headers + data`.

use bytes::Bytes;
use std::collections::BTreeMap;
use std::time::Duration;

/// A stored message. `ts` is nanoseconds since the Unix epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMsg {
    pub seq: u64,
    pub subject: Bytes,
    /// The header block as published (`NATS/1.0\r\n...\r\n\r\n`), empty when none.
    pub hdr: Bytes,
    pub data: Bytes,
    pub ts: i64,
}

/// A reader's block of a segment file, read ahead so that reading a stream in order costs
/// one read per block instead of one per message. The reader (a consumer) owns it, so
/// readers at different positions do not evict each other's blocks, and it is dropped
/// when the reader stops, so idle readers hold no memory. The store checks it against its
/// rewrite count before use: a block from before an erase, compaction or rollback is stale.
#[derive(Debug, Default)]
pub struct ReadAhead {
    /// The store it was read from (a Weak keeps the address from being reused).
    pub(crate) store: std::sync::Weak<()>,
    pub(crate) seg: u32,
    pub(crate) off: u64,
    /// Where the last record this reader was given ends (in segment `seg`).
    pub(crate) end: u64,
    pub(crate) rewrites: u64,
    pub(crate) buf: Bytes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Discard {
    #[default]
    Old,
    New,
}

/// The limits a stream's config puts on its store. Negative or zero means unlimited, as in
/// the reference's JSON (`-1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub max_msgs: i64,
    pub max_bytes: i64,
    pub max_age: Duration,
    pub max_msgs_per_subject: i64,
    pub max_msg_size: i64,
    pub discard: Discard,
    pub discard_new_per_subject: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_msgs: -1,
            max_bytes: -1,
            max_age: Duration::ZERO,
            max_msgs_per_subject: -1,
            max_msg_size: -1,
            discard: Discard::Old,
            discard_new_per_subject: false,
        }
    }
}

/// The stream state as STREAM.INFO reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    pub msgs: u64,
    pub bytes: u64,
    /// With no messages: `last_seq + 1` once anything was ever stored (reference behaviour),
    /// else 0.
    pub first_seq: u64,
    pub first_ts: i64,
    pub last_seq: u64,
    pub last_ts: i64,
    pub num_subjects: u64,
    /// Sequences between first and last that are gone (deleted or purged by filter).
    pub num_deleted: u64,
    /// Messages found damaged or missing (never served, not counted in `msgs`).
    pub lost: Option<Lost>,
}

/// Messages that were stored and are damaged or gone from disk (the reference's
/// `state.lost`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lost {
    pub msgs: Vec<u64>,
    /// Bytes of the damaged records, where known.
    pub bytes: u64,
}

/// STREAM.PURGE options: all of the stream, or only `filter` subjects, keeping the newest
/// `keep`, or only sequences below `seq`. `seq` and `keep` are exclusive.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Purge {
    pub filter: Option<String>,
    pub seq: Option<u64>,
    pub keep: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// Discard new and the stream is at max_msgs: "maximum messages exceeded" (10077).
    MaxMsgs,
    /// Discard new and the stream is at max_bytes: "maximum bytes exceeded" (10078).
    MaxBytes,
    /// Discard new per subject and that subject is at its limit: "maximum messages per
    /// subject exceeded" (10077 in the reference as well).
    MaxMsgsPerSubject,
    /// The message (headers included) is larger than max_msg_size (10054).
    MsgTooLarge,
    NotFound,
    /// I/O failure. The store refuses writes until the next [`Store::sync`], which rolls
    /// back what was not yet durable.
    Io(String),
    /// [`Store::store_at`] with a sequence that is not past the last one.
    Sequence {
        seq: u64,
        last: u64,
    },
    /// The operation is not available in this store (it says which, and why).
    Unsupported(&'static str),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::MaxMsgs => f.write_str("maximum messages exceeded"),
            StoreError::MaxBytes => f.write_str("maximum bytes exceeded"),
            StoreError::MaxMsgsPerSubject => f.write_str("maximum messages per subject exceeded"),
            StoreError::MsgTooLarge => f.write_str("message size exceeds maximum allowed"),
            StoreError::NotFound => f.write_str("no message found"),
            StoreError::Io(e) => write!(f, "storage failure: {e}"),
            StoreError::Sequence { seq, last } => {
                write!(f, "sequence {seq} is not past the last sequence {last}")
            }
            StoreError::Unsupported(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for StoreError {}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Io(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Which sequences a store holds, without the messages: what a replica needs to agree with
/// another on the stream's shape (a Raft snapshot carries it; the messages follow by
/// catch-up, stored with [`Store::store_at`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// As in [`State`]: with no messages, `last_seq + 1` once anything was ever stored.
    pub first_seq: u64,
    pub last_seq: u64,
    pub last_ts: i64,
    /// Sequences between first and last that are gone, as inclusive ranges in order.
    pub deleted: Vec<(u64, u64)>,
}

/// Segment files by id, as a sync job carries them.
pub(crate) type SegmentFiles = Vec<(u32, Box<dyn io::FsFile>)>;

/// The fsync half of a sync, split off by [`Store::begin_sync`] so that it runs without
/// the store: it carries the descriptors that wrote what must reach the disk (their fsyncs
/// see any write-back error). Run it (blocking) with no lock held that readers need, then
/// hand it back to [`Store::finish_sync`].
pub struct SyncJob {
    files: SegmentFiles,
    dir: Option<(std::sync::Arc<dyn io::Fs>, std::path::PathBuf)>,
    outcome: Option<std::io::Result<()>>,
}

impl SyncJob {
    pub(crate) fn new(
        files: SegmentFiles,
        dir: Option<(std::sync::Arc<dyn io::Fs>, std::path::PathBuf)>,
    ) -> SyncJob {
        SyncJob {
            files,
            dir,
            outcome: None,
        }
    }

    /// Does the fsyncs (blocks until the disk has everything). Running it again is a no-op.
    pub fn run(&mut self) {
        if self.outcome.is_some() {
            return;
        }
        let r = io::sync_files(self.files.iter_mut().map(|(_, f)| f), &self.dir);
        self.outcome = Some(r);
    }

    /// The descriptors back, and the fsyncs' result (running them first if not done).
    pub(crate) fn finish(mut self) -> (SegmentFiles, std::io::Result<()>) {
        self.run();
        let r = self.outcome.take().unwrap_or(Ok(()));
        (std::mem::take(&mut self.files), r)
    }
}

/// Storage for one stream. Filters are subject patterns that may hold `*` and `>`; an empty
/// filter or `>` means all subjects.
pub trait Store: Send {
    /// Appends a message with the next sequence and applies the limits (discard old may
    /// remove older messages; discard new may refuse). The record is written but only
    /// durable after [`sync`](Store::sync). Returns the new sequence.
    fn store_msg(&mut self, subject: &[u8], hdr: &[u8], data: &[u8], ts: i64) -> Result<u64>;

    /// Makes every record written so far durable (fsync for the file store). An error
    /// means none of the writes since the previous successful sync is in the store any
    /// more (they were rolled back), so none may be acknowledged.
    fn sync(&mut self) -> Result<()>;

    /// True when something the store found by itself (damage a read discovered) waits to
    /// be recorded durably by a [`sync`](Store::sync).
    fn needs_sync(&self) -> bool {
        false
    }

    /// True when messages were found damaged or missing (`State::lost`): cheap, for a
    /// replica deciding whether to fetch a fresh copy from its peers.
    fn has_lost(&self) -> bool {
        false
    }

    fn load(&self, seq: u64) -> Result<StoredMsg>;
    /// The first message with sequence >= `start` whose subject matches `filter`.
    fn load_next(&self, start: u64, filter: &str) -> Result<StoredMsg>;
    /// [`load_next`](Store::load_next) for a reader going forward, which may read ahead
    /// into `ra` and serve the following calls from it.
    fn load_next_ahead(&self, start: u64, filter: &str, ra: &mut ReadAhead) -> Result<StoredMsg> {
        let _ = ra;
        self.load_next(start, filter)
    }
    /// The newest message whose subject matches `filter`.
    fn load_last(&self, filter: &str) -> Result<StoredMsg>;
    /// The last sequence stored on exactly this literal subject (0 if none), for
    /// `Nats-Expected-Last-Subject-Sequence`.
    fn last_seq_for_subject(&self, subject: &str) -> u64;
    /// The timestamp of `seq` and whether it has headers, from the in-memory index alone
    /// (no I/O), or None if it is not stored. Lets the server rebuild its duplicate-window
    /// map at startup without reading every message.
    fn peek(&self, seq: u64) -> Option<(i64, bool)>;
    /// The newest message below `before` that has headers, with its timestamp, looking no
    /// further back than the first message older than `min_ts`. Lets the server rebuild its
    /// duplicate window without visiting every message of a long stream.
    fn prev_with_headers(&self, before: u64, min_ts: i64) -> Option<(u64, i64)> {
        let st = self.state();
        let mut seq = before.min(st.last_seq.saturating_add(1));
        while seq > st.first_seq.max(1) {
            seq -= 1;
            match self.peek(seq) {
                Some((ts, _)) if ts < min_ts => return None,
                Some((ts, true)) => return Some((seq, ts)),
                _ => {}
            }
        }
        None
    }
    /// The first message at or after `from` that has headers.
    fn next_with_headers(&self, from: u64) -> Option<u64> {
        let st = self.state();
        (from.max(st.first_seq).max(1)..=st.last_seq)
            .find(|&q| matches!(self.peek(q), Some((_, true))))
    }

    /// Stores a message at `seq`, which must be past the last sequence; the sequences in
    /// between count as deleted. What a replica applying a leader's entry needs, and a
    /// mirror keeping its origin's sequences. Limits apply as in
    /// [`store_msg`](Store::store_msg); a refused message leaves the skip in place (the same
    /// on every replica). Durable after [`sync`](Store::sync).
    fn store_at(
        &mut self,
        seq: u64,
        subject: &[u8],
        hdr: &[u8],
        data: &[u8],
        ts: i64,
    ) -> Result<()> {
        let last = self.state().last_seq;
        if seq <= last {
            return Err(StoreError::Sequence { seq, last });
        }
        self.skip_to(seq)?;
        let got = self.store_msg(subject, hdr, data, ts)?;
        debug_assert_eq!(got, seq);
        Ok(())
    }

    /// Removes every message above `after` and makes `after` the last sequence, so the next
    /// message stored gets `after + 1` (a replica that got ahead of its leader). `last_ts`
    /// becomes the newest remaining message's time (0 when none is left). Returns how many
    /// messages went. No-op when `after` is not below the last sequence.
    fn truncate(&mut self, after: u64) -> Result<u64>;

    /// Which sequences the store holds (for a replica's snapshot).
    fn snapshot(&self) -> Snapshot {
        let st = self.state();
        Snapshot {
            first_seq: st.first_seq,
            last_seq: st.last_seq,
            last_ts: st.last_ts,
            deleted: ranges::to_ranges(self.deleted()),
        }
    }

    /// Brings the store in line with `snap`: truncated to its last sequence when ahead, its
    /// messages below `snap.first_seq` and in `snap.deleted` removed, and started at
    /// `snap.first_seq` when it holds nothing before. Returns the ranges of sequences the
    /// snapshot has and the store lacks (above its own last sequence), which the caller
    /// fetches and stores with [`store_at`](Store::store_at) in order before
    /// `skip_to(snap.last_seq + 1)`.
    fn restore(&mut self, snap: &Snapshot) -> Result<Vec<(u64, u64)>> {
        if self.state().last_seq > snap.last_seq {
            self.truncate(snap.last_seq)?;
        }
        if snap.first_seq > 1 {
            self.purge(&Purge {
                seq: Some(snap.first_seq),
                ..Default::default()
            })?;
        }
        let last = self.state().last_seq;
        for &(a, b) in &snap.deleted {
            for seq in a..=b.min(last) {
                self.remove(seq, false)?;
            }
        }
        if last + 1 < snap.first_seq {
            self.skip_to(snap.first_seq)?;
        }
        let from = self.state().last_seq + 1;
        let mut missing = Vec::new();
        let mut at = from;
        for &(a, b) in snap.deleted.iter().filter(|(_, b)| *b >= from) {
            if a > at {
                missing.push((at, a - 1));
            }
            at = at.max(b + 1);
        }
        if at <= snap.last_seq {
            missing.push((at, snap.last_seq));
        }
        Ok(missing)
    }

    /// The first half of a [`sync`](Store::sync): writes out everything a sync makes durable
    /// (buffers, segment heads) and returns the fsyncs still to do, or None when it has
    /// nothing to wait for (or did it all itself). No write may come between this and
    /// [`finish_sync`](Store::finish_sync) (they are refused). Same result as `sync`.
    fn begin_sync(&mut self) -> Result<Option<SyncJob>> {
        self.sync().map(|_| None)
    }

    /// The second half: records what the job made durable, or, when its fsyncs failed,
    /// rolls back to the last completed sync and returns the error (as `sync` does).
    fn finish_sync(&mut self, job: SyncJob) -> Result<()> {
        job.finish().1.map_err(StoreError::from)
    }

    /// Sets the applied marker: up to [`MAX_APPLIED`] opaque bytes (a Raft replica's last
    /// applied log index, say). Held in memory until the next completed sync, which makes it
    /// durable atomically with the data written before it: after a power failure the store
    /// reopens with the marker of a completed sync and exactly the data of that sync (a
    /// file store that has a marker cuts whatever was written after it), never a marker
    /// ahead of its data nor data ahead of its marker.
    fn set_applied(&mut self, _marker: &[u8]) -> Result<()> {
        Err(StoreError::Unsupported(
            "this store keeps no applied marker",
        ))
    }

    /// The marker last set; after reopening (or [`discard_unsynced`](Store::discard_unsynced)),
    /// the one of the last completed sync (after a power failure during a sync whose writes
    /// had all reached the disk, that sync's, with all of its data). Empty when none was
    /// ever set (stores written before markers existed read as empty).
    fn applied(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Rolls the store back to its last completed sync: data and marker as that sync made
    /// them durable, everything since dropped (what a replica does before it applies its log
    /// again from the marker). The file store reports the rebuild to its observer as after
    /// a failed sync. Refused while a sync is in progress.
    fn discard_unsynced(&mut self) -> Result<()> {
        Err(StoreError::Unsupported("this store cannot roll back"))
    }

    /// Removes one message; `erase` also overwrites its bytes on disk. Ok(false) if absent.
    fn remove(&mut self, seq: u64, erase: bool) -> Result<bool>;
    /// Returns how many messages were purged.
    fn purge(&mut self, opts: &Purge) -> Result<u64>;
    /// Removes messages older than max_age at `now` (ns); returns how many. The server calls
    /// it on a timer. Also reports when the next message will expire (ns), if any.
    fn expire(&mut self, now: i64) -> Result<(u64, Option<i64>)>;
    /// Keeps `seq` out of max_age expiry (a message published with `Nats-TTL: never`). Held
    /// in memory only: the server marks such messages again when it reopens the store.
    fn exempt_from_max_age(&mut self, seq: u64);
    /// Moves the last sequence on so that the next message stored gets `next`; no-op when
    /// `next` is not ahead. Skipped sequences count as deleted; the new last sequence is
    /// durable after [`sync`](Store::sync) like any write.
    fn skip_to(&mut self, next: u64) -> Result<()>;
    /// Applies new limits (a stream update), discarding what no longer fits.
    fn set_limits(&mut self, limits: Limits) -> Result<()>;

    fn state(&self) -> State;
    /// `state().last_seq`, without building the state.
    fn last_seq(&self) -> u64 {
        self.state().last_seq
    }
    /// Deleted sequences between first and last (STREAM.INFO `deleted_details`).
    fn deleted(&self) -> Vec<u64>;
    /// Message count per subject matching `filter`.
    fn subjects(&self, filter: &str) -> BTreeMap<String, u64>;
    /// How many messages with sequence >= `start` match `filter`; with `last_per_subject`,
    /// how many distinct subjects have their last message at or after `start`.
    fn num_pending(&self, start: u64, filter: &str, last_per_subject: bool) -> u64;

    /// Plans a compaction (a file store rewriting a segment without its removed messages),
    /// to run off the caller's lock: `compact_end(job.run())`. Syncs pending writes first.
    fn compact_begin(&mut self) -> Option<file::CompactJob> {
        None
    }
    /// Puts a finished compaction in place; returns the bytes given back.
    fn compact_end(&mut self, _done: file::CompactDone) -> Result<u64> {
        Ok(0)
    }

    /// Writes what a fast restart needs (the index) and closes files. Also called on drop
    /// where possible.
    fn close(&mut self) -> Result<()>;
    /// Deletes the stream's data for good (STREAM.DELETE).
    fn destroy(self: Box<Self>) -> Result<()>;
}

/// Longest applied marker (see [`Store::set_applied`]).
pub const MAX_APPLIED: usize = 32;

fn check_applied(marker: &[u8]) -> Result<()> {
    if marker.len() > MAX_APPLIED {
        return Err(StoreError::Unsupported(
            "applied marker longer than 32 bytes",
        ));
    }
    Ok(())
}

/// Reference accounting for one message in a file-backed stream.
pub fn file_msg_size(subject: usize, hdr: usize, data: usize) -> u64 {
    if hdr == 0 {
        (30 + subject + data) as u64
    } else {
        (34 + subject + hdr + data) as u64
    }
}

/// Reference accounting for one message in a memory stream.
pub fn mem_msg_size(subject: usize, hdr: usize, data: usize) -> u64 {
    (16 + subject + hdr + data) as u64
}

/// True when `filter` selects every subject.
pub fn is_all(filter: &str) -> bool {
    filter.is_empty() || filter == ">"
}

/// Does `subject` match the subject `filter` (wildcards allowed; empty means all)?
pub fn filter_matches(filter: &str, subject: &[u8]) -> bool {
    is_all(filter) || keel_protocol::subject::matches(filter.as_bytes(), subject)
}

mod cache;
pub mod file;
mod handles;
mod index;
mod io;
pub mod lock;
pub mod mem;
pub mod meta;
pub mod raftlog;
mod ranges;
mod record;
mod reserve;
mod segtable;

pub use cache::{IndexCache, IndexCacheStats, SharedCache, DEFAULT_INDEX_CACHE};
pub use file::{
    CompactDone, CompactJob, DamagedData, FileStore, FileStoreConfig, ReadDamage, RecoveryReport,
    StoreEvent, TornWrite,
};
pub use io::{Disk, DiskFull};
pub use lock::{lock_dir, DirLock};
pub use mem::MemStore;
pub use meta::{MetaFiles, MetaRead};
pub use raftlog::{RaftLog, RaftLogConfig, RaftSyncJob};

#[cfg(test)]
mod tests;
