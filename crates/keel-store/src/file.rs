//! The file store: append-only segment files of checksummed records (see `record`), an
//! in-memory index (the shared `index::Core`, each slot pointing at its record), and a
//! saved copy of that index written by `close` so a clean restart does not rescan.
//!
//! Durability rules, which the fault-injection tests (`tests/crash.rs`) check:
//! - A message is durable once `sync` returns: `sync` flushes the write buffer, fdatasyncs
//!   every segment written since the last sync, then fsyncs the directory if a segment was
//!   created or removed. `store_msg` never waits for the disk (group commit).
//! - Every segment starts with a head record that each sync rewrites in place (same
//!   fdatasync): the highest sequence handed out, and what the last completed sync made
//!   durable. A disk that loses the tail of a synced file therefore cannot make a
//!   sequence be handed out twice, and recovery can tell data that was synced and is now
//!   missing (lost: reported) from writes that never completed (torn: never acknowledged).
//! - Removals are records too. An interior removal appends a tombstone (carrying the
//!   message's timestamp). Removals at the front (limits, expiry, purge) are covered by one
//!   marker record, "everything below N is gone, last_seq is L", written at the next
//!   `sync`: a stream at its limits writes one small record per sync, not one per discard.
//! - A segment file is deleted at `sync` once none of its messages is live, and only after
//!   what keeps its removals removed is durable, directory entry included: a fresh marker
//!   (which also preserves last_seq), re-appended tombstones it held for messages of older,
//!   surviving segments, and a ledger record naming the deleted segment's sequence range as
//!   gone. So every sequence between the marker and last_seq is accounted for on disk (a
//!   message, a tombstone, the ledger); recovery reports any that is not as lost.
//! - Erase writes a tombstone and syncs before overwriting the record in place, so a torn
//!   overwrite reads as a removed message at recovery, never as a lost one; the first
//!   erase after opening from a saved index also retires that index, since the index would
//!   call an overwritten record live.
//! - A failed write or sync leaves the store refusing writes until the next `sync`, which
//!   rolls back to the last completed sync (truncating what came after, rebuilding the
//!   index from disk) and returns an error for the discarded writes; if the rollback
//!   works the store takes writes again (a full disk recovers once space is freed).
//! - Recovery replays records in append order (segment id, then offset). With a valid saved
//!   index it loads the index and replays only what was appended after it; records the
//!   index covers are checked when read, and one that fails its checksum is reported lost
//!   then. Incomplete writes after the last completed sync are cut; damaged data that had
//!   been synced is copied to a `damaged-*.bin` file in the store directory, reported, and
//!   never served. Opening never fails or panics because of file content.

use crate::handles::Handles;
use crate::index::{Core, Payload};
use crate::io::{Fs, FsFile, StdFs};
use crate::ranges::{to_ranges, Ranges};
use crate::record::{
    self, Head, HeadParse, Kind, Ledger, Parse, HDR, HEADS_LEN, HEAD_LEN, MAX_RECORD,
};
use crate::{
    file_msg_size, Limits, Lost, Purge, Result, Snapshot, State, Store, StoreError, StoredMsg,
    SyncJob,
};
use bytes::Bytes;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Tuning for [`FileStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStoreConfig {
    /// A new segment file is started once the active one would grow past this (a single
    /// larger record gets a segment of its own). Clamped to [128 B, 1 GiB]: offsets are
    /// 32-bit.
    pub segment_size: u64,
    /// Appends collect in memory up to this many bytes before a write(2).
    pub write_buffer: usize,
    /// Segment files kept open at once; the least recently used one is closed when another
    /// is needed (the active segment and unsynced ones stay open).
    pub max_open_files: usize,
}

impl Default for FileStoreConfig {
    fn default() -> Self {
        FileStoreConfig {
            segment_size: 8 << 20,
            write_buffer: 128 << 10,
            max_open_files: 256,
        }
    }
}

/// An incomplete write past what the last completed sync covered: never acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornWrite {
    pub segment: u32,
    pub offset: u64,
    pub bytes: u64,
    /// Cut from the end of its segment.
    pub cut: bool,
}

/// Damaged bytes in data that had been synced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedData {
    pub segment: u32,
    pub offset: u64,
    pub bytes: u64,
    /// File (in the store directory) holding a copy of the damaged bytes.
    pub quarantine: Option<String>,
    /// Why the copy could not be made (the bytes then stay where they are).
    pub quarantine_error: Option<String>,
}

/// What [`FileStore::open`] found. The store does not log; the caller decides what to say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segment files opened.
    pub segments: u64,
    /// Records read while scanning (all of them without a saved index, only those
    /// appended after it with one).
    pub records_scanned: u64,
    /// The index saved by the last `close` was valid and used.
    pub used_index: bool,
    /// Why a saved index was present but not used.
    pub index_rejected: Option<String>,
    /// Incomplete writes found (cut when at a segment's end).
    pub torn: Vec<TornWrite>,
    pub torn_bytes: u64,
    /// Damaged stretches of synced data.
    pub damaged: Vec<DamagedData>,
    pub corrupt_records: u64,
    pub corrupt_bytes: u64,
    /// Sequences found lost at this recovery (damaged or missing although synced), as
    /// inclusive ranges. Earlier losses are in `state().lost`.
    pub lost: Vec<(u64, u64)>,
    /// Sequences handed out whose records never reached the disk completely (a crash
    /// during their sync): never acknowledged, and not reused.
    pub unacked: Vec<(u64, u64)>,
    /// Set when the index or a segment head proved a higher last sequence than the
    /// records found: the records' own last sequence (the tail holding the rest is gone).
    pub records_last_seq: Option<u64>,
}

/// A record found damaged when read (the index said it was there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDamage {
    pub seq: u64,
    pub segment: u32,
    pub offset: u64,
    pub bytes: u64,
    pub quarantine: Option<String>,
    pub quarantine_error: Option<String>,
}

/// What the store tells its observer as it happens.
#[derive(Debug)]
pub enum StoreEvent<'a> {
    /// A read found a damaged record; it is now lost (out of the counts, in `state().lost`).
    ReadDamage(&'a ReadDamage),
    /// After a failed write or sync the store rolled back and rebuilt its index from disk.
    Recovered(&'a RecoveryReport),
}

pub type Observer = Box<dyn Fn(&StoreEvent) + Send>;

/// Where a message's record lives: offset and length within its segment (the segment
/// follows from the sequence). The top bit of `len` says the message has headers, which
/// is all the reference byte accounting needs besides the record length.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct Loc {
    off: u32,
    len: u32,
}

const HDR_FLAG: u32 = 1 << 31;

#[cfg(test)]
pub(crate) fn slot_size() -> usize {
    std::mem::size_of::<crate::index::Slot<Loc>>()
}

impl Loc {
    fn len(&self) -> usize {
        (self.len & !HDR_FLAG) as usize
    }
}

impl Payload for Loc {
    fn acct_size(&self, _subj_len: usize) -> u64 {
        // record = 40 + subject + hdr + data; reference = 30 + subject + data, or
        // 34 + subject + hdr + data with headers.
        let l = self.len() as u64;
        if self.len & HDR_FLAG != 0 {
            l.saturating_sub(6)
        } else {
            l.saturating_sub(10)
        }
    }
}

struct Seg {
    id: u32,
    /// Bytes in the file. For the active (last) segment the write buffer follows.
    flushed: u64,
    /// Range of message sequences recorded here; `first > last` when none. Ranges of
    /// consecutive segments are contiguous and `last` is monotonic across segments, which
    /// the by-sequence lookup relies on.
    first: u64,
    last: u64,
    live: u64,
    /// Tombstones (sequence, message timestamp) in this segment for messages of older
    /// segments: what must be re-appended if this segment is deleted while those older
    /// segments remain.
    ext_tombs: Vec<(u64, i64)>,
    /// Written since the last fdatasync.
    dirty: bool,
    /// Offset and CRC of the last appended record, which the saved index uses to check
    /// that the segment still holds what it covered.
    last_rec: Option<(u64, u32)>,
    /// Starts with a head record (every segment this version creates).
    head: bool,
    /// Completed syncs when the segment was created (from its head).
    created: u64,
    /// Length as of the last completed sync, which a failed sync truncates back to; None
    /// for a segment created since.
    done_len: Option<u64>,
    /// Length known to be durable, which the head records for the next recovery.
    proven_len: u64,
    /// Head slot (0 or 1) the next head rewrite goes to.
    next_slot: u8,
}

impl Seg {
    fn has_msgs(&self) -> bool {
        self.first <= self.last
    }
    fn note_msg(&mut self, seq: u64) {
        if !self.has_msgs() {
            self.first = seq;
            self.last = seq;
        } else {
            self.first = self.first.min(seq);
            self.last = self.last.max(seq);
        }
    }
}

/// Stream storage in a directory of segment files.
pub struct FileStore {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    cfg: FileStoreConfig,
    /// In a cell so that a read finding a damaged record can take it out of the counts.
    core: RefCell<Core<Loc>>,
    segs: Vec<Seg>,
    files: RefCell<Handles>,
    wbuf: Vec<u8>,
    /// Highest marker written: everything below is gone on disk; and the highest one a
    /// completed sync made durable.
    marker: u64,
    marker_done: u64,
    dir_dirty: bool,
    /// Ids of segments written since the last sync (the fdatasync list), and of segments
    /// whose last live message went (deletion candidates), so `sync` never walks every
    /// segment of a large stream.
    dirty: Vec<u32>,
    emptied: Vec<u32>,
    failed: Option<String>,
    closed: bool,
    /// Between `begin_sync` and `finish_sync`: what that sync covers. Writes are refused
    /// meanwhile (what the sync records must be what it made durable).
    in_flight: Option<SyncPlan>,
    /// The ledger: sequences of deleted segments, and lost ones with their bytes.
    gone: Ranges,
    lost: RefCell<Ranges>,
    lost_bytes: Cell<u64>,
    ledger_dirty: Cell<bool>,
    /// Sequences a read found damaged and took out of the core; their segments' live
    /// counts are settled at the next write.
    evicted: RefCell<Vec<u64>>,
    /// A saved index is on disk. It stays usable while we only append (recovery replays
    /// what was appended after it), but not once a record it covers is overwritten.
    index_on_disk: bool,
    /// Completed syncs (carried across restarts by the heads), and last_seq/last_ts as of
    /// the last completed sync (or recovery).
    syncs_done: u64,
    done_seq: u64,
    done_ts: i64,
    /// The last sequence known durable, which heads record.
    proven_seq: u64,
    observer: Option<Observer>,
}

const INDEX: &str = "index.bin";
const INDEX_TMP: &str = "index.tmp";

fn seg_name(id: u32) -> String {
    format!("{id:010}.seg")
}

fn parse_seg_name(name: &str) -> Option<u32> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn quarantine_name(id: u32, off: u64) -> String {
    format!("damaged-{id:010}-{off:010}.bin")
}

/// Copies damaged bytes aside before anything else may happen to them. Returns the file
/// name, and whether it was written now (false: an earlier start already did).
fn quarantine(
    fs: &dyn Fs,
    dir: &Path,
    existing: &HashSet<String>,
    id: u32,
    off: u64,
    bytes: &[u8],
) -> io::Result<(String, bool)> {
    let name = quarantine_name(id, off);
    if existing.contains(&name) {
        return Ok((name, false));
    }
    let mut f = fs.open(&dir.join(&name), true)?;
    f.truncate(0)?;
    f.write_at(bytes, 0)?;
    f.sync()?;
    Ok((name, true))
}

enum Read {
    Msg(StoredMsg),
    Damaged,
}

/// What one sync covers, between its two halves.
struct SyncPlan {
    /// Segments whose writes it fdatasyncs.
    ids: Vec<u32>,
    /// Segments it deletes once the rest is durable.
    dead: Vec<u32>,
    active: Option<u32>,
    /// It fsyncs the directory.
    dir: bool,
}

impl FileStore {
    /// Opens (or creates) the store in `dir`, recovering what is there.
    pub fn open(dir: &Path, limits: Limits) -> Result<(FileStore, RecoveryReport)> {
        Self::open_with(dir, limits, FileStoreConfig::default())
    }

    pub fn open_with(
        dir: &Path,
        limits: Limits,
        cfg: FileStoreConfig,
    ) -> Result<(FileStore, RecoveryReport)> {
        Self::open_fs(Arc::new(StdFs), dir, limits, cfg)
    }

    pub(crate) fn open_fs(
        fs: Arc<dyn Fs>,
        dir: &Path,
        limits: Limits,
        mut cfg: FileStoreConfig,
    ) -> Result<(FileStore, RecoveryReport)> {
        cfg.segment_size = cfg.segment_size.clamp(2 * HEADS_LEN as u64, 1 << 30);
        let (mut store, rep) = recover(fs, dir, cfg)?;
        // Limits may have shrunk while closed; whatever they discard is made durable
        // before the caller sees the store, like everything else recovery settled.
        store.set_limits(limits)?;
        let r = store.do_sync();
        store.check_io(r)?;
        Ok((store, rep))
    }

    /// Called on read-time damage and on a rollback's recovery (the server logs them).
    pub fn set_observer(&mut self, f: Observer) {
        self.observer = Some(f);
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn with_file<T>(
        &self,
        id: u32,
        f: impl FnOnce(&mut dyn FsFile) -> io::Result<T>,
    ) -> io::Result<T> {
        self.files
            .borrow_mut()
            .with(&*self.fs, id, || self.dir.join(seg_name(id)), f)
    }

    fn writable(&self) -> Result<()> {
        if self.closed {
            return Err(StoreError::Io("store is closed".into()));
        }
        if self.in_flight.is_some() {
            return Err(StoreError::Io("a sync is in progress".into()));
        }
        if let Some(e) = &self.failed {
            return Err(StoreError::Io(e.clone()));
        }
        Ok(())
    }

    /// An I/O failure leaves memory and disk possibly out of step, so the store refuses
    /// further writes until `sync` rolls back to the last completed sync.
    fn check_io<T>(&mut self, r: io::Result<T>) -> Result<T> {
        r.map_err(|e| {
            let msg = e.to_string();
            self.failed = Some(msg.clone());
            StoreError::Io(msg)
        })
    }

    fn seg_idx(&self, seq: u64) -> Option<usize> {
        let i = self.segs.partition_point(|s| s.last < seq);
        (i < self.segs.len() && self.segs[i].first <= seq).then_some(i)
    }

    fn seg_by_id(&self, id: u32) -> Option<usize> {
        self.segs.binary_search_by_key(&id, |s| s.id).ok()
    }

    fn mark_dirty(&mut self, i: usize) {
        let s = &mut self.segs[i];
        if !s.dirty {
            s.dirty = true;
            self.dirty.push(s.id);
            self.files.get_mut().pin(s.id);
        }
    }

    /// One message of segment `i` went.
    fn dec_live(&mut self, i: usize) {
        let s = &mut self.segs[i];
        s.live = s.live.saturating_sub(1);
        if s.live == 0 {
            self.emptied.push(s.id);
        }
    }

    fn active_len(&self) -> u64 {
        self.segs.last().map_or(0, |s| s.flushed) + self.wbuf.len() as u64
    }

    fn flush_wbuf(&mut self) -> io::Result<()> {
        if self.wbuf.is_empty() {
            return Ok(());
        }
        let i = self.segs.len() - 1;
        let (id, at) = (self.segs[i].id, self.segs[i].flushed);
        let buf = std::mem::take(&mut self.wbuf);
        let r = self.with_file(id, |f| f.write_at(&buf, at));
        self.wbuf = buf;
        r?;
        self.segs[i].flushed += self.wbuf.len() as u64;
        self.wbuf.clear();
        self.mark_dirty(i);
        Ok(())
    }

    fn head_for(&self, s: &Seg) -> Head {
        let c = self.core.borrow();
        Head {
            pending: c.last_seq,
            ts: c.last_ts,
            created: s.created,
            synced: self.syncs_done,
            synced_seq: self.proven_seq,
            synced_len: s.proven_len.max(HEADS_LEN as u64),
        }
    }

    /// Rewrites the head of segment `i` in its next slot.
    fn write_head(&mut self, i: usize, h: &Head) -> io::Result<()> {
        let (id, slot) = (self.segs[i].id, self.segs[i].next_slot);
        let b = record::encode_head(h);
        self.with_file(id, |f| f.write_at(&b, (slot as usize * HEAD_LEN) as u64))?;
        self.segs[i].next_slot = 1 - slot;
        Ok(())
    }

    /// Starts a new active segment. The previous one is left for `sync` to fdatasync.
    fn roll(&mut self) -> io::Result<()> {
        self.flush_wbuf()?;
        // A segment that ends up holding no live message (only tombstones or markers, or
        // everything already removed) becomes a deletion candidate once it is not active.
        if let Some(s) = self.segs.last() {
            if s.live == 0 {
                self.emptied.push(s.id);
            }
            let id = s.id;
            if !s.dirty {
                self.files.get_mut().unpin(id);
            }
        }
        let id = self.segs.last().map_or(1, |s| s.id + 1);
        let mut file = self.fs.open(&self.path(&seg_name(id)), true)?;
        if file.len()? != 0 {
            // Only possible with foreign files in the directory; never append to them.
            file.truncate(0)?;
        }
        let base = self.core.get_mut().last_seq;
        let seg = Seg {
            id,
            flushed: HEADS_LEN as u64,
            first: base + 1,
            last: base,
            live: 0,
            ext_tombs: Vec::new(),
            dirty: false,
            last_rec: None,
            head: true,
            created: self.syncs_done,
            done_len: None,
            proven_len: HEADS_LEN as u64,
            next_slot: 0,
        };
        let h = record::encode_head(&self.head_for(&seg));
        file.write_at(&[&h[..], &h[..]].concat(), 0)?;
        let h = self.files.get_mut();
        h.insert(id, file);
        h.pin(id);
        self.segs.push(seg);
        let i = self.segs.len() - 1;
        self.mark_dirty(i);
        self.dir_dirty = true;
        Ok(())
    }

    /// Appends one record to the active segment (rolling first if it would overflow).
    /// Returns the segment index and the record's location.
    fn append(
        &mut self,
        kind: Kind,
        seq: u64,
        ts: i64,
        subj: &[u8],
        hdr: &[u8],
        data: &[u8],
    ) -> io::Result<(usize, Loc)> {
        let len = record::record_len(subj.len(), hdr.len(), data.len());
        let cur = self.active_len();
        if self.segs.is_empty()
            || (cur > HEADS_LEN as u64 && cur + len as u64 > self.cfg.segment_size)
        {
            self.roll()?;
        }
        let idx = self.segs.len() - 1;
        let off = self.active_len();
        let crc = record::encode(&mut self.wbuf, kind, seq, ts, subj, hdr, data);
        self.segs[idx].last_rec = Some((off, crc));
        self.mark_dirty(idx);
        if self.wbuf.len() >= self.cfg.write_buffer {
            self.flush_wbuf()?;
        }
        let flag = if hdr.is_empty() { 0 } else { HDR_FLAG };
        Ok((
            idx,
            Loc {
                off: off as u32,
                len: len as u32 | flag,
            },
        ))
    }

    /// Records the removal of `target`. The tombstone carries the message's timestamp so
    /// that, if it is the highest sequence left on disk, recovery still restores last_seq
    /// and last_ts (a sequence once used must never be handed out again).
    fn write_tomb(&mut self, target: u64, ts: i64) -> io::Result<()> {
        let (idx, _) = self.append(Kind::Tomb, target, ts, b"", b"", b"")?;
        let s = &mut self.segs[idx];
        if !s.has_msgs() || target < s.first {
            s.ext_tombs.push((target, ts));
        }
        Ok(())
    }

    /// Live counts for messages a read took out as damaged.
    fn settle_evicted(&mut self) {
        for seq in std::mem::take(self.evicted.get_mut()) {
            if let Some(i) = self.seg_idx(seq) {
                self.dec_live(i);
            }
        }
    }

    /// Turns what the last core operation removed into records.
    fn settle(&mut self) -> io::Result<()> {
        self.settle_evicted();
        let core = self.core.get_mut();
        if core.reset {
            core.reset = false;
            let last = core.last_seq;
            if !self.lost.get_mut().is_empty() || self.lost_bytes.get() > 0 {
                *self.lost.get_mut() = Ranges::default();
                self.lost_bytes.set(0);
                self.ledger_dirty.set(true);
            }
            for s in &mut self.segs {
                s.live = 0;
                s.ext_tombs.clear();
                self.emptied.push(s.id);
            }
            // Everything is gone: start a fresh segment so every old one can be deleted
            // at the next sync, once the marker recording the new first sequence is down.
            if self.active_len() > HEADS_LEN as u64 || self.segs.last().is_some_and(|s| !s.head) {
                self.roll()?;
            } else if let Some(s) = self.segs.last_mut() {
                s.first = last + 1;
                s.last = last;
            }
        }
        let core = self.core.get_mut();
        let mut removed = std::mem::take(&mut core.removed);
        let first_seq = core.first_seq;
        let mut r = Ok(());
        for &(seq, ts, _) in &removed {
            if let Some(i) = self.seg_idx(seq) {
                self.dec_live(i);
            }
            // Below first_seq the next marker covers it.
            if seq >= first_seq {
                r = self.write_tomb(seq, ts);
                if r.is_err() {
                    break;
                }
            }
        }
        removed.clear();
        self.core.get_mut().removed = removed;
        r
    }

    fn write_marker(&mut self) -> io::Result<()> {
        let c = self.core.get_mut();
        let m = c.first_seq.max(self.marker);
        let last = c.last_seq.to_le_bytes();
        let ts = c.last_ts;
        self.append(Kind::Marker, m, ts, b"", b"", &last)?;
        self.marker = m;
        Ok(())
    }

    /// Writes the whole ledger (it is small: a few ranges).
    fn write_ledger(&mut self) -> io::Result<()> {
        // Gone sequences below a durable marker need no record (the marker being written
        // in the same sync may not reach the disk with it). Lost ones stay reported (the
        // front moving past a loss does not undo it) until the stream is purged.
        self.gone.prune_below(self.marker_done);
        let l = Ledger {
            gone: self.gone.iter().collect(),
            lost: self.lost.get_mut().iter().collect(),
            lost_bytes: self.lost_bytes.get(),
        };
        let data = record::encode_ledger(&l);
        self.append(Kind::Ledger, 0, 0, b"", b"", &data)?;
        self.ledger_dirty.set(false);
        Ok(())
    }

    fn do_sync(&mut self) -> io::Result<()> {
        let (plan, mut job) = self.sync_prepare()?;
        job.run();
        self.sync_complete(plan, job)
    }

    /// A sync up to its fsyncs: what must be written is written (buffers, markers, the
    /// ledger, segment heads); returns what the sync covers and the fsyncs still to do.
    fn sync_prepare(&mut self) -> io::Result<(SyncPlan, SyncJob)> {
        self.settle_evicted();
        // Deletion candidates: emptied, still empty, and not the active segment (which
        // stays a candidate until a newer one takes over).
        let active = self.segs.last().map(|s| s.id);
        let mut ids = std::mem::take(&mut self.emptied);
        ids.sort_unstable();
        ids.dedup();
        let mut dead = Vec::new();
        for id in ids {
            if Some(id) == active {
                self.emptied.push(id);
            } else if let Some(i) = self.seg_by_id(id) {
                if self.segs[i].live == 0 {
                    dead.push(i);
                }
            }
        }
        // A marker is only news once something below first_seq existed, or for the
        // "purged before first use" state (first 1, last 0) that a scan could not infer.
        // Before deleting segments it is written regardless: the latest marker may sit in a
        // segment about to go (older segments still on disk rely on it).
        let c = self.core.get_mut();
        let news = c.first_seq > self.marker && (c.first_seq > 1 || c.last_seq == 0);
        if news || !dead.is_empty() {
            self.write_marker()?;
        }
        if !dead.is_empty() {
            let mut again = Vec::new();
            for &i in &dead {
                let s = &self.segs[i];
                if s.has_msgs() && s.last >= self.marker {
                    self.gone.insert(s.first.max(self.marker), s.last);
                }
                for &(t, ts) in &s.ext_tombs {
                    if t >= self.marker
                        && self.seg_idx(t).is_some()
                        && self.core.get_mut().slots.get(t).is_none()
                    {
                        again.push((t, ts));
                    }
                }
            }
            for (t, ts) in again {
                self.write_tomb(t, ts)?;
            }
            // The ledger may sit in a segment about to go; it is rewritten whole.
            self.ledger_dirty.set(true);
        }
        if self.ledger_dirty.get() {
            self.write_ledger()?;
        }
        self.flush_wbuf()?;
        // The heads of the segments about to be synced record what this sync hands out.
        for id in self.dirty.clone() {
            if let Some(i) = self.seg_by_id(id) {
                if self.segs[i].head {
                    let h = self.head_for(&self.segs[i]);
                    self.write_head(i, &h)?;
                }
            }
        }
        // The descriptors that wrote the data go with the job (its fsyncs must see their
        // write-back errors), so the fsyncs can run while readers use the store; a reader
        // that needs one of these segments meanwhile opens it again.
        let ids = std::mem::take(&mut self.dirty);
        let mut files = Vec::with_capacity(ids.len());
        for &id in &ids {
            if self.seg_by_id(id).is_none() {
                continue;
            }
            if let Err(e) = self.with_file(id, |_| Ok(())) {
                for (id, f) in files {
                    self.files.get_mut().put(id, f);
                }
                self.dirty = ids;
                return Err(e);
            }
            if let Some(f) = self.files.get_mut().take(id) {
                files.push((id, f));
            }
        }
        // New segments' directory entries are part of their data being durable; so is
        // what justifies the unlinks below (unlinks can reach the disk in any order).
        let dir = self.dir_dirty.then(|| (self.fs.clone(), self.dir.clone()));
        let plan = SyncPlan {
            ids,
            dead: dead.iter().map(|&i| self.segs[i].id).collect(),
            active,
            dir: dir.is_some(),
        };
        Ok((plan, SyncJob::new(files, dir)))
    }

    /// The bookkeeping after a sync's fsyncs (`r`) completed.
    fn sync_complete(&mut self, plan: SyncPlan, job: SyncJob) -> io::Result<()> {
        let (files, r) = job.finish();
        for (id, f) in files {
            if self.seg_by_id(id).is_some() {
                self.files.get_mut().put(id, f);
            }
        }
        if let Err(e) = r {
            self.dirty.extend(plan.ids);
            return Err(e);
        }
        let active = plan.active;
        for id in plan.ids {
            if let Some(i) = self.seg_by_id(id) {
                self.segs[i].dirty = false;
                if Some(id) != active {
                    self.files.get_mut().unpin(id);
                }
            }
        }
        if plan.dir {
            self.dir_dirty = false;
        }
        let mut dead: Vec<usize> = plan
            .dead
            .iter()
            .filter_map(|&id| self.seg_by_id(id))
            .collect();
        dead.sort_unstable();
        // Everything written so far is durable.
        self.syncs_done += 1;
        self.marker_done = self.marker;
        let c = self.core.get_mut();
        self.done_seq = c.last_seq;
        self.done_ts = c.last_ts;
        self.proven_seq = c.last_seq;
        for s in &mut self.segs {
            s.done_len = Some(s.flushed);
            s.proven_len = s.flushed;
        }
        if !dead.is_empty() {
            // Past the durability point a failure only leaves files behind, which the next
            // recovery finds covered by the marker and the ledger and deletes again.
            for &i in dead.iter().rev() {
                let s = self.segs.remove(i);
                self.files.get_mut().forget(s.id);
                let _ = self.fs.remove(&self.path(&seg_name(s.id)));
            }
            self.dir_dirty = true;
            // Tombstones below the marker or for deleted segments are moot now.
            let ranges: Vec<(u64, u64)> = self.segs.iter().map(|s| (s.first, s.last)).collect();
            let marker = self.marker;
            let exists = |t: u64| {
                let i = ranges.partition_point(|r| r.1 < t);
                i < ranges.len() && ranges[i].0 <= t
            };
            for s in &mut self.segs {
                s.ext_tombs.retain(|&(t, _)| t >= marker && exists(t));
            }
            // The unlinks become durable with the next sync's directory fsync (until then a
            // power failure only leaves files the next recovery deletes again): no fsync
            // here, where the store is held.
        }
        Ok(())
    }

    /// A sync's failure: the store rolls back to the last completed sync.
    fn sync_failed(&mut self, e: io::Error) -> StoreError {
        let msg = e.to_string();
        self.failed = Some(msg.clone());
        let _ = self.rollback();
        StoreError::Io(format!(
            "{msg} (writes since the last sync were rolled back)"
        ))
    }

    /// After a failed write or sync: truncates every segment back to its length at the
    /// last completed sync, removes segments created since, restores their heads, and
    /// rebuilds the store from disk. On success the store takes writes again.
    fn rollback(&mut self) -> Result<()> {
        let why = self.failed.clone().unwrap_or_default();
        let r = (|| -> io::Result<()> {
            self.wbuf.clear();
            let mut created = Vec::new();
            for i in 0..self.segs.len() {
                let s = &self.segs[i];
                let Some(len) = s.done_len else {
                    created.push(s.id);
                    continue;
                };
                let head = s.head.then(|| {
                    record::encode_head(&Head {
                        pending: self.done_seq,
                        ts: self.done_ts,
                        created: s.created,
                        synced: self.syncs_done,
                        synced_seq: self.proven_seq,
                        synced_len: s.proven_len.max(HEADS_LEN as u64),
                    })
                });
                // Over the slot the failed sync wrote: neither then claims more than the
                // last completed sync.
                let slot = (1 - s.next_slot as u64) * HEAD_LEN as u64;
                self.with_file(s.id, |f| {
                    if f.len()? > len {
                        f.truncate(len)?;
                    }
                    if let Some(h) = &head {
                        f.write_at(h, slot)?;
                    }
                    f.sync()
                })?;
            }
            for id in created {
                self.files.get_mut().forget(id);
                match self.fs.remove(&self.path(&seg_name(id))) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            self.fs.sync_dir(&self.dir)
        })();
        if let Err(e) = r {
            let msg = format!("{why}; rollback failed: {e}");
            return Err(StoreError::Io(msg));
        }
        self.files.get_mut().clear();
        let limits = self.core.get_mut().limits.clone();
        let (mut fresh, rep) = match recover(self.fs.clone(), &self.dir, self.cfg.clone()) {
            Ok(x) => x,
            Err(e) => {
                let msg = format!("{why}; rebuilding after rollback failed: {e}");
                return Err(StoreError::Io(msg));
            }
        };
        fresh.core.get_mut().set_limits(limits);
        if let Err(e) = fresh.settle().and_then(|_| fresh.do_sync()) {
            fresh.closed = true;
            let msg = format!("{why}; sync after rollback failed: {e}");
            return Err(StoreError::Io(msg));
        }
        fresh.observer = self.observer.take();
        if let Some(o) = &fresh.observer {
            o(&StoreEvent::Recovered(&rep));
        }
        // The old state must not close (and write an index) when dropped.
        self.closed = true;
        *self = fresh;
        Ok(())
    }

    /// Drops the store the way a killed process would: no flush of the write buffer, no
    /// sync, no saved index.
    #[cfg(test)]
    pub(crate) fn crash(mut self) {
        self.closed = true;
    }

    #[cfg(test)]
    pub(crate) fn core_limits(&self) -> Limits {
        self.core.borrow().limits.clone()
    }

    #[cfg(test)]
    pub(crate) fn segment_count(&self) -> usize {
        self.segs.len()
    }

    #[cfg(test)]
    pub(crate) fn segment_of(&self, seq: u64) -> Option<u32> {
        self.seg_idx(seq).map(|i| self.segs[i].id)
    }

    #[cfg(test)]
    pub(crate) fn open_files(&self) -> usize {
        self.files.borrow().open_count()
    }

    fn read(&self, seq: u64) -> Result<Read> {
        let Some(loc) = self.core.borrow().slots.get(seq).map(|s| s.p) else {
            return Err(StoreError::NotFound);
        };
        let i = self
            .seg_idx(seq)
            .ok_or_else(|| StoreError::Io(format!("no segment holds sequence {seq}")))?;
        let s = &self.segs[i];
        let (off, len) = (loc.off as u64, loc.len());
        let buf = if i == self.segs.len() - 1 && off >= s.flushed {
            let at = (off - s.flushed) as usize;
            match self.wbuf.get(at..at + len) {
                Some(b) => Bytes::copy_from_slice(b),
                None => Bytes::new(),
            }
        } else {
            let mut v = vec![0; len];
            // A record cut off by a shorter file is damage like any other.
            match self.with_file(s.id, |f| f.read_at(&mut v, off)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => v.clear(),
                Err(e) => return Err(e.into()),
            }
            Bytes::from(v)
        };
        let (sl, hl, ts) = match record::parse(&buf) {
            Parse::Ok(r) if r.kind == Kind::Msg && r.seq == seq && r.len == len => {
                (r.subj.len(), r.hdr.len(), r.ts)
            }
            _ => {
                self.damaged_on_read(seq, s.id, off, len as u64, &buf);
                return Ok(Read::Damaged);
            }
        };
        Ok(Read::Msg(StoredMsg {
            seq,
            subject: buf.slice(HDR..HDR + sl),
            hdr: buf.slice(HDR + sl..HDR + sl + hl),
            data: buf.slice(HDR + sl + hl..),
            ts,
        }))
    }

    /// A record the index calls live failed its checksum: it leaves the counts at once, is
    /// recorded lost (in the ledger at the next sync), and its bytes are copied aside.
    fn damaged_on_read(&self, seq: u64, seg: u32, off: u64, len: u64, bytes: &[u8]) {
        {
            let mut c = self.core.borrow_mut();
            if c.remove(seq) {
                c.removed.pop();
            }
        }
        self.evicted.borrow_mut().push(seq);
        self.lost.borrow_mut().insert(seq, seq);
        self.lost_bytes.set(self.lost_bytes.get() + len);
        self.ledger_dirty.set(true);
        let q = quarantine(&*self.fs, &self.dir, &HashSet::new(), seg, off, bytes)
            .and_then(|(name, _)| self.fs.sync_dir(&self.dir).map(|_| name));
        let d = ReadDamage {
            seq,
            segment: seg,
            offset: off,
            bytes: len,
            quarantine: q.as_ref().ok().cloned(),
            quarantine_error: q.err().map(|e| e.to_string()),
        };
        if let Some(o) = &self.observer {
            o(&StoreEvent::ReadDamage(&d));
        }
    }

    fn load_found(&self, seq: Option<u64>) -> Result<StoredMsg> {
        match self.read(seq.ok_or(StoreError::NotFound)?)? {
            Read::Msg(m) => Ok(m),
            Read::Damaged => Err(StoreError::NotFound),
        }
    }

    fn erase_at(&mut self, seq: u64, loc: Loc) -> io::Result<()> {
        let Some(i) = self.seg_idx(seq) else {
            return Ok(());
        };
        if self.index_on_disk {
            // The overwrite and its tombstone live in different files, so a crash can keep
            // the first and lose the second; a saved index would then call the erased
            // record live. Retire the index durably before touching a record it covers.
            self.fs.remove(&self.path(INDEX))?;
            self.fs.sync_dir(&self.dir)?;
            self.index_on_disk = false;
        }
        let (off, len) = (loc.off as u64, loc.len());
        let id = self.segs[i].id;
        let mut buf = vec![0; len];
        self.with_file(id, |f| f.read_at(&mut buf, off))?;
        let crc = match record::parse(&buf) {
            Parse::Ok(r) if r.kind == Kind::Msg && r.seq == seq => {
                Some(record::erase_in_place(&mut buf))
            }
            _ => {
                // Already damaged: wipe it; recovery skips the zeros.
                buf.fill(0);
                None
            }
        };
        self.with_file(id, |f| f.write_at(&buf, off))?;
        let s = &mut self.segs[i];
        if let (Some(c), Some((lo, _))) = (crc, s.last_rec) {
            if lo == off {
                s.last_rec = Some((off, c));
            }
        }
        self.mark_dirty(i);
        Ok(())
    }

    fn write_index(&mut self) -> io::Result<()> {
        let core = self.core.get_mut();
        let mut e = Enc(Vec::with_capacity(64 + core.msgs as usize * 28));
        e.0.extend_from_slice(IDX_MAGIC);
        let c = &*core;
        for v in [c.first_seq, c.first_ts as u64, c.last_seq, c.last_ts as u64] {
            e.u64(v);
        }
        e.u64(self.marker);
        e.u64(c.msgs);
        e.u32(self.segs.len() as u32);
        for s in &self.segs {
            e.u32(s.id);
            e.u64(s.flushed);
            e.u64(s.first);
            e.u64(s.last);
            let (o, k) = s.last_rec.unwrap_or((u64::MAX, 0));
            e.u64(o);
            e.u32(k);
            e.u32(s.ext_tombs.len() as u32);
            for &(t, ts) in &s.ext_tombs {
                e.u64(t);
                e.u64(ts as u64);
            }
        }
        let mut remap = HashMap::new();
        let subjects: Vec<_> = c.subjects.iter().collect();
        e.u32(subjects.len() as u32);
        for (n, (id, info)) in subjects.iter().enumerate() {
            remap.insert(*id, n as u32);
            e.u32(info.subject.len() as u32);
            e.0.extend_from_slice(&info.subject);
        }
        let mut prev = 0;
        for (seq, slot) in c.slots.iter(c.first_seq, c.last_seq) {
            e.u64(seq - prev);
            prev = seq;
            e.u32(slot.p.off);
            e.u32(slot.p.len);
            e.u64(slot.ts() as u64);
            e.u32(remap[&slot.subj_id()]);
        }
        let ledger = Ledger {
            gone: self.gone.iter().collect(),
            lost: self.lost.get_mut().iter().collect(),
            lost_bytes: self.lost_bytes.get(),
        };
        let l = record::encode_ledger(&ledger);
        e.u32(l.len() as u32);
        e.0.extend_from_slice(&l);
        let crc = crc32fast::hash(&e.0);
        e.u32(crc);

        let tmp = self.path(INDEX_TMP);
        let mut f = self.fs.open(&tmp, true)?;
        f.truncate(0)?;
        f.write_at(&e.0, 0)?;
        f.sync()?;
        drop(f);
        self.fs.rename(&tmp, &self.path(INDEX))?;
        self.fs.sync_dir(&self.dir)
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        if !self.closed && self.failed.is_none() {
            let _ = self.close();
        }
    }
}

impl Store for FileStore {
    fn store_msg(&mut self, subject: &[u8], hdr: &[u8], data: &[u8], ts: i64) -> Result<u64> {
        self.writable()?;
        if subject.len() > u16::MAX as usize
            || record::record_len(subject.len(), hdr.len(), data.len()) > MAX_RECORD
        {
            return Err(StoreError::MsgTooLarge);
        }
        let size = file_msg_size(subject.len(), hdr.len(), data.len());
        let core = self.core.get_mut();
        core.check(subject, hdr.len(), data.len(), size)?;
        let seq = core.last_seq + 1;
        let r = self.append(Kind::Msg, seq, ts, subject, hdr, data);
        let (idx, loc) = self.check_io(r)?;
        self.segs[idx].note_msg(seq);
        self.segs[idx].live += 1;
        let got = self.core.get_mut().append(subject, ts, loc);
        debug_assert_eq!(got, seq);
        let r = self.settle();
        self.check_io(r)?;
        Ok(seq)
    }

    /// Makes every write so far durable. After a failed write or sync it instead rolls
    /// back to the last completed sync and returns an error: the writes since are gone
    /// (none of them may be acknowledged). If the rollback works the store takes writes
    /// again; otherwise the next `sync` tries again.
    fn sync(&mut self) -> Result<()> {
        match self.begin_sync()? {
            Some(mut job) => {
                job.run();
                self.finish_sync(job)
            }
            None => Ok(()),
        }
    }

    fn begin_sync(&mut self) -> Result<Option<SyncJob>> {
        if self.closed {
            return Err(StoreError::Io("store is closed".into()));
        }
        if self.in_flight.is_some() {
            return Err(StoreError::Io("a sync is in progress".into()));
        }
        if let Some(e) = self.failed.clone() {
            self.rollback()?;
            return Err(StoreError::Io(format!(
                "{e} (writes since the last sync were rolled back)"
            )));
        }
        match self.sync_prepare() {
            Ok((plan, job)) => {
                self.in_flight = Some(plan);
                Ok(Some(job))
            }
            Err(e) => Err(self.sync_failed(e)),
        }
    }

    fn finish_sync(&mut self, job: SyncJob) -> Result<()> {
        let Some(plan) = self.in_flight.take() else {
            return Err(StoreError::Io("no sync in progress".into()));
        };
        self.sync_complete(plan, job)
            .map_err(|e| self.sync_failed(e))
    }

    fn store_at(
        &mut self,
        seq: u64,
        subject: &[u8],
        hdr: &[u8],
        data: &[u8],
        ts: i64,
    ) -> Result<()> {
        let last = self.core.get_mut().last_seq;
        if seq <= last {
            return Err(StoreError::Sequence { seq, last });
        }
        self.skip_to(seq)?;
        self.store_msg(subject, hdr, data, ts).map(|_| ())
    }

    fn truncate(&mut self, after: u64) -> Result<u64> {
        if after >= self.core.get_mut().last_seq {
            return Ok(0);
        }
        // Recovery never lets last_seq go below what the segment heads prove was handed
        // out (that is what keeps a sequence from being reused), so a lowered last
        // sequence needs a record of its own in the on-disk format first.
        Err(StoreError::Unsupported(
            "the file store cannot truncate yet (its recovery keeps every sequence handed out)",
        ))
    }

    fn snapshot(&self) -> Snapshot {
        let c = self.core.borrow();
        Snapshot {
            first_seq: c.first_seq,
            last_seq: c.last_seq,
            last_ts: c.last_ts,
            deleted: c.deleted_ranges(),
        }
    }

    fn needs_sync(&self) -> bool {
        self.ledger_dirty.get() && self.failed.is_none() && !self.closed
    }

    fn load(&self, seq: u64) -> Result<StoredMsg> {
        self.load_found(Some(seq))
    }

    fn load_next(&self, start: u64, filter: &str) -> Result<StoredMsg> {
        let mut start = start;
        loop {
            let seq = self
                .core
                .borrow()
                .find_next(start, filter)
                .ok_or(StoreError::NotFound)?;
            match self.read(seq)? {
                Read::Msg(m) => return Ok(m),
                // A damaged record is now lost; move on to the next match.
                Read::Damaged => start = seq + 1,
            }
        }
    }

    fn load_last(&self, filter: &str) -> Result<StoredMsg> {
        loop {
            let seq = self.core.borrow().find_last(filter);
            match self.read(seq.ok_or(StoreError::NotFound)?)? {
                Read::Msg(m) => return Ok(m),
                // Out of the index now: the previous match is the last.
                Read::Damaged => {}
            }
        }
    }

    fn last_seq_for_subject(&self, subject: &str) -> u64 {
        self.core.borrow().last_seq_for_subject(subject)
    }

    fn peek(&self, seq: u64) -> Option<(i64, bool)> {
        self.core
            .borrow()
            .slots
            .get(seq)
            .map(|s| (s.ts(), s.p.len & HDR_FLAG != 0))
    }

    fn remove(&mut self, seq: u64, erase: bool) -> Result<bool> {
        self.writable()?;
        let core = self.core.get_mut();
        let Some((loc, ts)) = core.slots.get(seq).map(|s| (s.p, s.ts())) else {
            return Ok(false);
        };
        core.remove(seq);
        let r = (|| {
            if erase {
                // The tombstone is made durable before the overwrite: a torn overwrite then
                // reads as a removed message at recovery, never as a lost one.
                self.core.get_mut().removed.clear();
                if let Some(i) = self.seg_idx(seq) {
                    self.dec_live(i);
                }
                self.write_tomb(seq, ts)?;
                self.do_sync()?;
                self.erase_at(seq, loc)?;
            }
            self.settle()
        })();
        self.check_io(r)?;
        Ok(true)
    }

    fn purge(&mut self, opts: &Purge) -> Result<u64> {
        self.writable()?;
        let n = self.core.get_mut().purge(opts);
        let r = self.settle();
        self.check_io(r)?;
        Ok(n)
    }

    fn expire(&mut self, now: i64) -> Result<(u64, Option<i64>)> {
        self.writable()?;
        let out = self.core.get_mut().expire(now);
        let r = self.settle();
        self.check_io(r)?;
        Ok(out)
    }

    fn exempt_from_max_age(&mut self, seq: u64) {
        self.core.get_mut().age_exempt.insert(seq);
    }

    fn skip_to(&mut self, next: u64) -> Result<()> {
        self.writable()?;
        let core = self.core.get_mut();
        if next <= core.last_seq + 1 {
            return Ok(());
        }
        let had_msgs = core.msgs > 0;
        let from = core.last_seq + 1;
        core.skip_to(next);
        // A tombstone for the new last sequence is what recovery restores last_seq from
        // (an emptied store gets its marker at the next sync instead); the ledger accounts
        // for the skipped sequences, as for a deleted segment's.
        let ts = core.last_ts;
        let r = if had_msgs {
            self.gone.insert(from, next - 1);
            self.ledger_dirty.set(true);
            self.write_tomb(next - 1, ts)
        } else {
            Ok(())
        };
        let r = r.and_then(|_| self.settle());
        self.check_io(r)
    }

    fn set_limits(&mut self, limits: Limits) -> Result<()> {
        self.writable()?;
        self.core.get_mut().set_limits(limits);
        let r = self.settle();
        self.check_io(r)
    }

    fn last_seq(&self) -> u64 {
        self.core.borrow().last_seq
    }

    fn state(&self) -> State {
        let mut st = self.core.borrow().state();
        let lost = self.lost.borrow();
        if !lost.is_empty() || self.lost_bytes.get() > 0 {
            st.lost = Some(Lost {
                msgs: lost.expand(),
                bytes: self.lost_bytes.get(),
            });
        }
        st
    }

    fn deleted(&self) -> Vec<u64> {
        self.core.borrow().deleted()
    }

    fn subjects(&self, filter: &str) -> BTreeMap<String, u64> {
        self.core.borrow().subjects_map(filter)
    }

    fn num_pending(&self, start: u64, filter: &str, last_per_subject: bool) -> u64 {
        self.core
            .borrow()
            .num_pending(start, filter, last_per_subject)
    }

    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        if self.failed.is_some() {
            self.rollback()?;
        }
        self.writable()?;
        let r = self.do_sync().and_then(|_| self.write_index());
        self.check_io(r)?;
        self.closed = true;
        self.files.get_mut().clear();
        Ok(())
    }

    fn destroy(mut self: Box<Self>) -> Result<()> {
        self.closed = true;
        self.files.get_mut().clear();
        self.segs.clear();
        self.fs.remove_dir_all(&self.dir)?;
        Ok(())
    }
}

// ---- saved index ----------------------------------------------------------------------

const IDX_MAGIC: &[u8; 8] = b"KEELIDX2";

struct Enc(Vec<u8>);

impl Enc {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

/// Bounds-checked reader: every accessor returns None past the end, so a damaged index
/// is rejected rather than trusted or panicked on.
struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

struct IdxSeg {
    id: u32,
    covered: u64,
    first: u64,
    last: u64,
    last_rec: Option<(u64, u32)>,
    ext_tombs: Vec<(u64, i64)>,
}

struct Idx {
    first_seq: u64,
    first_ts: i64,
    last_seq: u64,
    last_ts: i64,
    marker: u64,
    segs: Vec<IdxSeg>,
    subjects: Vec<Bytes>,
    /// (seq, loc, ts, subject index)
    msgs: Vec<(u64, Loc, i64, u32)>,
    ledger: Ledger,
}

fn decode_index(b: &[u8]) -> Option<Idx> {
    if b.len() < IDX_MAGIC.len() + 4 {
        return None;
    }
    let (body, crc) = b.split_at(b.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().ok()?) {
        return None;
    }
    let mut d = Dec(body);
    if d.take(8)? != IDX_MAGIC {
        return None;
    }
    let first_seq = d.u64()?;
    let first_ts = d.u64()? as i64;
    let last_seq = d.u64()?;
    let last_ts = d.u64()? as i64;
    let marker = d.u64()?;
    let nmsgs = d.u64()?;
    let nsegs = d.u32()?;
    let mut segs = Vec::new();
    for _ in 0..nsegs {
        let id = d.u32()?;
        let covered = d.u64()?;
        let first = d.u64()?;
        let last = d.u64()?;
        let o = d.u64()?;
        let k = d.u32()?;
        let n = d.u32()? as usize;
        let mut ext = Vec::with_capacity(n.min(d.0.len() / 16));
        for _ in 0..n {
            ext.push((d.u64()?, d.u64()? as i64));
        }
        segs.push(IdxSeg {
            id,
            covered,
            first,
            last,
            last_rec: (o != u64::MAX).then_some((o, k)),
            ext_tombs: ext,
        });
    }
    let nsubj = d.u32()? as usize;
    let mut subjects = Vec::with_capacity(nsubj.min(d.0.len() / 4));
    for _ in 0..nsubj {
        let n = d.u32()? as usize;
        subjects.push(Bytes::copy_from_slice(d.take(n)?));
    }
    let mut msgs = Vec::with_capacity((nmsgs as usize).min(d.0.len() / 28));
    let mut seq = 0u64;
    for _ in 0..nmsgs {
        seq = seq.checked_add(d.u64()?)?;
        let off = d.u32()?;
        let len = d.u32()?;
        let ts = d.u64()? as i64;
        let subj = d.u32()?;
        if subj as usize >= subjects.len() || ((len & !HDR_FLAG) as usize) < HDR {
            return None;
        }
        if !msgs.is_empty() && msgs.last().map(|m: &(u64, Loc, i64, u32)| m.0) >= Some(seq) {
            return None;
        }
        msgs.push((seq, Loc { off, len }, ts, subj));
    }
    let n = d.u32()? as usize;
    let ledger = record::decode_ledger(d.take(n)?)?;
    if !d.0.is_empty() {
        return None;
    }
    Some(Idx {
        first_seq,
        first_ts,
        last_seq,
        last_ts,
        marker,
        segs,
        subjects,
        msgs,
        ledger,
    })
}

// ---- recovery -------------------------------------------------------------------------

/// Replays records into a fresh core.
struct Replay {
    core: Core<Loc>,
    marker: u64,
    /// Highest message sequence seen in any record (message, erased, tombstone) and its
    /// timestamp.
    max_msg: (u64, i64),
    /// Highest last_seq a marker recorded, and the last_ts with it.
    marker_last: (u64, i64),
    /// Sequences tombstoned (or erased in place).
    tombs: Vec<u64>,
    gone: Ranges,
    lost: Ranges,
    lost_bytes: u64,
    /// The last ledger record, with where it was (segment, offset): each holds the whole
    /// ledger, so the newest wins.
    ledger: Option<(u32, u64, Ledger)>,
    records: u64,
}

/// What scanning one segment found besides records: damaged stretches followed by valid
/// records, and where the valid records end if garbage follows.
#[derive(Default)]
struct ScanOut {
    spans: Vec<Span>,
    tail: Option<u64>,
    /// Damage after the segment's last message record.
    trailing_damage: bool,
    /// Highest sequence tombstoned in this segment: its message was here or earlier.
    max_tomb: u64,
}

/// Damaged bytes with valid records after them. Such damage is not an incomplete append
/// (those only cut a file short), so the sequences it hides, between the message records
/// around it, were fully written: lost, not unacknowledged.
struct Span {
    off: u64,
    len: u64,
    /// Message sequences of the records before and after it in the segment.
    before: u64,
    after: Option<u64>,
}

impl Replay {
    fn apply(&mut self, seg: &mut Seg, r: &record::Rec, off: usize) {
        if r.kind == Kind::Head {
            // Only meaningful at offset 0, which is read separately.
            return;
        }
        self.records += 1;
        seg.last_rec = Some((off as u64, r.crc));
        match r.kind {
            Kind::Msg | Kind::Erased => {
                seg.note_msg(r.seq);
                if r.seq >= self.max_msg.0 {
                    self.max_msg = (r.seq, r.ts);
                }
                if self.core.slots.get(r.seq).is_some() {
                    // The same sequence twice can only follow damage; the later record wins.
                    self.core.remove(r.seq);
                }
                if r.kind == Kind::Msg && r.seq >= self.marker {
                    let flag = if r.hdr.is_empty() { 0 } else { HDR_FLAG };
                    let loc = Loc {
                        off: off as u32,
                        len: r.len as u32 | flag,
                    };
                    self.core.insert(r.seq, r.subj, r.ts, loc);
                } else if r.kind == Kind::Erased {
                    self.tombs.push(r.seq);
                }
            }
            Kind::Tomb => {
                let t = r.seq;
                self.core.remove(t);
                if t > self.max_msg.0 {
                    self.max_msg = (t, r.ts);
                }
                if !seg.has_msgs() || t < seg.first {
                    seg.ext_tombs.push((t, r.ts));
                }
                self.tombs.push(t);
            }
            Kind::Marker => {
                let m = r.seq;
                if m > self.marker {
                    self.marker = m;
                    let below: Vec<u64> = self.core.slots.iter(0, m - 1).map(|(s, _)| s).collect();
                    for s in below {
                        self.core.remove(s);
                    }
                }
                if r.data.len() == 8 {
                    let last = u64::from_le_bytes(r.data.try_into().unwrap());
                    if last >= self.marker_last.0 {
                        self.marker_last = (last, r.ts);
                    }
                }
            }
            Kind::Ledger => {
                if let Some(l) = record::decode_ledger(r.data) {
                    self.ledger = Some((seg.id, off as u64, l));
                }
            }
            Kind::Head => {}
        }
        self.core.removed.clear();
    }

    /// Scans `data`, which holds the segment from file offset `base` on.
    fn scan(&mut self, seg: &mut Seg, data: &[u8], base: u64, out: &mut ScanOut) {
        let mut o = 0;
        let mut before = if seg.has_msgs() {
            seg.last
        } else {
            seg.first - 1
        };
        let mut open = Vec::new();
        while o < data.len() {
            if let Parse::Ok(r) = record::parse(&data[o..]) {
                self.apply(seg, &r, base as usize + o);
                if r.kind == Kind::Tomb {
                    out.max_tomb = out.max_tomb.max(r.seq);
                }
                if matches!(r.kind, Kind::Msg | Kind::Erased) {
                    for i in open.drain(..) {
                        let sp: &mut Span = &mut out.spans[i];
                        sp.after = Some(r.seq);
                    }
                    before = r.seq;
                }
                o += r.len;
                continue;
            }
            match record::resync(data, o + 1) {
                Some(next) => {
                    open.push(out.spans.len());
                    out.spans.push(Span {
                        off: base + o as u64,
                        len: (next - o) as u64,
                        before,
                        after: None,
                    });
                    o = next;
                }
                None => {
                    out.tail = Some(base + o as u64);
                    out.trailing_damage = true;
                    return;
                }
            }
        }
        out.trailing_damage = !open.is_empty();
    }
}

/// A segment as found on disk before replay.
struct SegMeta {
    id: u32,
    len: u64,
    head: Option<Head>,
    /// Starts with a head slot (valid or torn).
    has_head: bool,
    /// Empty, or heads cut short: a segment whose creation never completed.
    stub: bool,
    next_slot: u8,
}

fn recover(
    fs: Arc<dyn Fs>,
    dir: &Path,
    cfg: FileStoreConfig,
) -> Result<(FileStore, RecoveryReport)> {
    fs.create_dir_all(dir)?;
    let names = fs.list(dir)?;
    let existing: HashSet<String> = names.iter().cloned().collect();
    let mut ids: Vec<u32> = names.iter().filter_map(|n| parse_seg_name(n)).collect();
    ids.sort_unstable();
    let mut rep = RecoveryReport::default();
    if existing.contains(INDEX_TMP) {
        let _ = fs.remove(&dir.join(INDEX_TMP));
    }
    let seg_path = |id: u32| dir.join(seg_name(id));
    let mut files = Handles::new(cfg.max_open_files);

    let mut metas = Vec::with_capacity(ids.len());
    for &id in &ids {
        let f = fs.open(&seg_path(id), false)?;
        let len = f.len()?;
        let mut hb = vec![0; (len as usize).min(HEADS_LEN)];
        f.read_at(&mut hb, 0)?;
        let (mut head, mut has_head, mut next_slot) = (None, false, 0u8);
        if hb.len() == HEADS_LEN {
            let slots = [
                record::parse_head(&hb[..HEAD_LEN]),
                record::parse_head(&hb[HEAD_LEN..]),
            ];
            has_head = slots.iter().all(|p| !matches!(p, HeadParse::None));
            if has_head {
                // What both slots claim holds (each was true when written): take the most.
                let valid: Vec<(usize, Head)> = slots
                    .iter()
                    .enumerate()
                    .filter_map(|(k, p)| match p {
                        HeadParse::Ok(h) => Some((k, *h)),
                        _ => None,
                    })
                    .collect();
                if let Some(&(k, newest)) = valid.iter().max_by_key(|(_, h)| (h.synced, h.pending))
                {
                    next_slot = 1 - k as u8;
                    let mut h = newest;
                    for (_, o) in &valid {
                        h.synced_seq = h.synced_seq.max(o.synced_seq);
                        h.synced_len = h.synced_len.max(o.synced_len);
                        if o.pending > h.pending {
                            (h.pending, h.ts) = (o.pending, o.ts);
                        }
                    }
                    head = Some(h);
                }
            }
        }
        let stub = !has_head && (len == 0 || record::is_heads_prefix(&hb));
        files.insert(id, f);
        metas.push(SegMeta {
            id,
            len,
            head,
            has_head,
            stub,
            next_slot,
        });
    }
    rep.segments = metas.len() as u64;

    // The saved index: used if it still matches the segments; otherwise what it says
    // (last sequence, which sequences were live) still bounds what recovery may conclude.
    let mut idx = None;
    let mut hint = None;
    if existing.contains(INDEX) {
        let ip = dir.join(INDEX);
        let loaded = (|| -> io::Result<std::result::Result<Idx, (String, Option<Idx>)>> {
            let f = fs.open(&ip, false)?;
            let mut b = vec![0; f.len()? as usize];
            f.read_at(&mut b, 0)?;
            let Some(ix) = decode_index(&b) else {
                return Ok(Err(("index checksum or format mismatch".into(), None)));
            };
            Ok(
                match validate_index(&ix, &metas, &mut files, &*fs, &seg_path) {
                    Ok(()) => Ok(ix),
                    Err(why) => Err((why, Some(ix))),
                },
            )
        })();
        match loaded {
            Ok(Ok(ix)) => idx = Some(ix),
            Ok(Err((why, ix))) => {
                rep.index_rejected = Some(why);
                hint = ix;
            }
            Err(e) => rep.index_rejected = Some(format!("index unreadable: {e}")),
        }
        if idx.is_none() {
            // Never let a stale index come back into use after the segments change.
            fs.remove(&ip)?;
        }
    }

    let mut rp = Replay {
        core: Core::new(Limits::default()),
        marker: 0,
        max_msg: (0, 0),
        marker_last: (0, 0),
        tombs: Vec::new(),
        gone: Ranges::default(),
        lost: Ranges::default(),
        lost_bytes: 0,
        ledger: None,
        records: 0,
    };
    let mut covered: HashMap<u32, IdxSeg> = HashMap::new();
    let mut idx_covered: HashMap<u32, u64> = HashMap::new();
    let mut idx_last = None;
    let mut idx_ledger = None;
    if let Some(ix) = idx {
        rep.used_index = true;
        let c = &mut rp.core;
        for (seq, loc, ts, subj) in ix.msgs {
            c.insert(seq, &ix.subjects[subj as usize], ts, loc);
        }
        c.first_seq = ix.first_seq;
        c.first_ts = ix.first_ts;
        c.last_seq = ix.last_seq;
        c.last_ts = ix.last_ts;
        rp.marker = ix.marker;
        rp.max_msg = (ix.last_seq, ix.last_ts);
        rp.marker_last = (ix.last_seq, ix.last_ts);
        idx_ledger = Some(ix.ledger);
        idx_covered = ix.segs.iter().map(|s| (s.id, s.covered)).collect();
        covered = ix.segs.into_iter().map(|s| (s.id, s)).collect();
        idx_last = Some(ix.last_seq);
    } else if let Some(h) = &hint {
        idx_covered = h.segs.iter().map(|s| (s.id, s.covered)).collect();
    }

    let mut segs: Vec<Seg> = Vec::with_capacity(metas.len());
    let mut scans = Vec::with_capacity(metas.len());
    for m in &metas {
        let base = segs.last().map_or(0, |s| s.last);
        let mut seg = Seg {
            id: m.id,
            flushed: m.len,
            first: base + 1,
            last: base,
            live: 0,
            ext_tombs: Vec::new(),
            dirty: false,
            last_rec: None,
            head: m.has_head,
            created: m.head.map_or(0, |h| h.created),
            done_len: Some(m.len),
            proven_len: 0,
            next_slot: m.next_slot,
        };
        let mut start = if m.has_head { HEADS_LEN as u64 } else { 0 };
        if m.stub {
            start = m.len;
        }
        if let Some(c) = covered.remove(&m.id) {
            seg.first = c.first;
            seg.last = c.last;
            seg.ext_tombs = c.ext_tombs;
            seg.last_rec = c.last_rec;
            start = start.max(c.covered);
        }
        let mut out = ScanOut::default();
        if start < m.len {
            let mut data = vec![0; (m.len - start) as usize];
            files.with(
                &*fs,
                m.id,
                || seg_path(m.id),
                |f| f.read_at(&mut data, start),
            )?;
            rp.scan(&mut seg, &data, start, &mut out);
        }
        segs.push(seg);
        scans.push(out);
    }

    // The newest ledger: one appended after the saved index (used or not) beats the
    // index's copy, which beats older records.
    let max_covered = idx_covered.keys().max().copied();
    let after_index = |seg: u32, off: u64| match idx_covered.get(&seg) {
        Some(&c) => off >= c,
        None => max_covered.is_none_or(|m| seg > m),
    };
    let ledger = match (
        rp.ledger.take(),
        idx_ledger.or_else(|| hint.as_ref().map(|h| h.ledger.clone())),
    ) {
        (Some((seg, off, l)), _) if after_index(seg, off) => Some(l),
        (_, Some(l)) => Some(l),
        (found, None) => found.map(|(_, _, l)| l),
    };
    if let Some(l) = ledger {
        for (a, b) in l.gone {
            rp.gone.insert(a, b);
        }
        for (a, b) in l.lost {
            rp.lost.insert(a, b);
        }
        rp.lost_bytes = l.lost_bytes;
    }

    // What the heads and the index prove: the highest sequence handed out, the last one a
    // completed sync made durable, and how much of each segment was durable.
    let heads: Vec<Head> = metas.iter().filter_map(|m| m.head).collect();
    let synced_max = heads.iter().map(|h| h.synced).max().unwrap_or(0);
    let mut synced_seq = heads.iter().map(|h| h.synced_seq).max().unwrap_or(0);
    let (mut hw, mut hw_ts) = heads
        .iter()
        .max_by_key(|h| h.pending)
        .map_or((0, 0), |h| (h.pending, h.ts));
    for l in [idx_last, hint.as_ref().map(|h| h.last_seq)]
        .into_iter()
        .flatten()
    {
        synced_seq = synced_seq.max(l);
    }
    if let Some(h) = &hint {
        if h.last_seq > hw {
            (hw, hw_ts) = (h.last_seq, h.last_ts);
        }
    }
    for k in 0..metas.len() {
        let m = &metas[k];
        let mut proven = m.head.map_or(0, |h| h.synced_len);
        if let Some(&c) = idx_covered.get(&m.id) {
            proven = proven.max(c);
        }
        // A sync completed after a later segment was created covered all of this one.
        let later = metas[k + 1..]
            .iter()
            .filter_map(|n| n.head.map(|h| h.created))
            .min();
        if later.is_some_and(|c| synced_max > c) {
            proven = m.len;
        }
        segs[k].proven_len = proven.min(m.len);
    }

    // Damage inside what was durable is copied aside and reported; anything after it is
    // an incomplete write (never acknowledged), cut where it ends a segment.
    rp.tombs.sort_unstable();
    rp.tombs.dedup();
    let mut quarantined_now = false;
    let mut new_damage: Vec<(usize, u64)> = Vec::new();
    // Sequences whose records were fully written (damage with valid records after it).
    let mut written = Ranges::default();
    // (sequence, stretch length) that damaged records claim.
    let mut claims: Vec<(u64, u64)> = Vec::new();
    let nsegs = segs.len();
    let mut cuts: Vec<(usize, u64)> = Vec::new();
    for (k, out) in scans.iter().enumerate() {
        let (id, proven, len) = (segs[k].id, segs[k].proven_len, segs[k].flushed);
        let mut spans: Vec<(u64, u64, bool)> = Vec::new();
        for sp in &out.spans {
            spans.push((sp.off, sp.len, false));
            if let Some(a) = sp.after {
                if a > sp.before + 1 {
                    written.insert(sp.before + 1, a - 1);
                }
            }
        }
        if let Some(t) = out.tail {
            spans.push((t, len - t, true));
        }
        for (off, n, is_tail) in spans {
            let mut h = [0u8; 24];
            if n >= 24 {
                files.with(&*fs, id, || seg_path(id), |f| f.read_at(&mut h, off))?;
                if let Some(q) = record::claimed_seq(&h) {
                    claims.push((q, n));
                }
            }
            if is_tail && off >= proven {
                rep.torn.push(TornWrite {
                    segment: id,
                    offset: off,
                    bytes: n,
                    cut: true,
                });
                rep.torn_bytes += n;
                cuts.push((k, off));
                continue;
            }
            let mut bytes = vec![0; n as usize];
            files.with(&*fs, id, || seg_path(id), |f| f.read_at(&mut bytes, off))?;
            if record::only_torn_erases(&bytes, |q| {
                q < rp.marker || rp.tombs.binary_search(&q).is_ok() || rp.gone.contains(q)
            }) {
                // An erase interrupted mid-overwrite: the message was removed (its
                // tombstone is durable) and its bytes are meant to go, not to be kept.
                if is_tail && k == nsegs - 1 {
                    cuts.push((k, off));
                }
                continue;
            }
            rep.corrupt_records += 1;
            rep.corrupt_bytes += n;
            let q = quarantine(&*fs, dir, &existing, id, off, &bytes);
            let (name, err) = match q {
                Ok((name, new)) => {
                    if new {
                        quarantined_now = true;
                        new_damage.push((k, n));
                    }
                    (Some(name), None)
                }
                Err(e) => (None, Some(e.to_string())),
            };
            // The active segment is appended to, so damage at its end is cut once copied.
            if is_tail && k == nsegs - 1 && name.is_some() {
                cuts.push((k, off));
            }
            rep.damaged.push(DamagedData {
                segment: id,
                offset: off,
                bytes: n,
                quarantine: name,
                quarantine_error: err,
            });
        }
    }
    if quarantined_now {
        fs.sync_dir(dir)?;
    }
    for (k, at) in cuts {
        let id = segs[k].id;
        files.with(
            &*fs,
            id,
            || seg_path(id),
            |f| {
                f.truncate(at)?;
                f.sync()
            },
        )?;
        segs[k].flushed = at;
        segs[k].done_len = Some(at);
        segs[k].proven_len = segs[k].proven_len.min(at);
    }

    // Final stream counters. last_seq is never below what the heads or the index prove
    // was handed out.
    let (found, found_ts) = if rp.max_msg.0 >= rp.marker_last.0 {
        rp.max_msg
    } else {
        rp.marker_last
    };
    let (mut ls, mut lts) = (found, found_ts);
    // A damaged record past the last good one still had its sequence handed out (and
    // maybe acknowledged): it is not handed out again. Only claims a stretch of that
    // length could hold count (a flipped bit can make any number).
    let claimed = claims
        .iter()
        .filter(|&&(q, n)| q > found && q <= found + n / HDR as u64)
        .map(|&(q, _)| q)
        .max();
    let hw = match claimed {
        Some(q) if q > hw => {
            hw_ts = found_ts;
            q
        }
        _ => hw,
    };
    if hw > ls {
        rep.records_last_seq = Some(found);
        (ls, lts) = (hw, hw_ts);
    }
    let mut gone_new = Ranges::default();
    let mut ix_live: Option<(u64, Vec<u64>)> = None;
    // What the on-disk records say is below the marker; a rejected index can know more,
    // which the first sync then writes down (a marker record, the ledger).
    let mut removed_below = rp.marker;
    if let Some(h) = hint.take() {
        if h.marker > removed_below {
            removed_below = h.marker;
            let below: Vec<u64> = rp
                .core
                .slots
                .iter(0, h.marker - 1)
                .map(|(s, _)| s)
                .collect();
            for s in below {
                rp.core.remove(s);
            }
        }
        let live: Vec<u64> = h.msgs.iter().map(|m| m.0).collect();
        // Removed before the index was written: never live again, whatever tombstone was
        // lost since.
        let back: Vec<u64> = rp
            .core
            .slots
            .iter(0, h.last_seq)
            .map(|(s, _)| s)
            .filter(|s| live.binary_search(s).is_err())
            .collect();
        for s in back {
            rp.core.remove(s);
            gone_new.insert(s, s);
        }
        ix_live = Some((h.last_seq, live));
    }
    // Sequences of deleted segments stay removed, even if a file came back.
    for (a, b) in rp.gone.iter().collect::<Vec<_>>() {
        let back: Vec<u64> = rp.core.slots.iter(a, b).map(|(s, _)| s).collect();
        for s in back {
            rp.core.remove(s);
        }
    }
    // A lost sequence whose record was read back intact (a restored file) is not lost
    // after all; one the saved index calls live was never checked, and stays lost.
    let trusted = idx_last.map_or(0, |l| l + 1);
    let mut lost = Ranges::default();
    for (a, b) in rp.lost.iter() {
        let mut at = a;
        let live: Vec<u64> = rp.core.slots.iter(a, b).map(|(s, _)| s).collect();
        for s in live {
            if s < trusted {
                rp.core.remove(s);
                continue;
            }
            if s > at {
                lost.insert(at, s - 1);
            }
            at = s + 1;
        }
        if at <= b {
            lost.insert(at, b);
        }
    }
    rp.core.removed.clear();

    // Every sequence from the marker to last_seq must be accounted for: live, tombstoned,
    // gone with a deleted segment, or already known lost. What is not was lost if a
    // completed sync had made it durable, else it was never acknowledged.
    let from = idx_last.map_or(0, |l| l + 1).max(removed_below).max(1);
    let mut lost_new = Ranges::default();
    let mut unacked = Ranges::default();
    if from <= ls {
        let mut acc = Ranges::default();
        for (a, b) in to_ranges(rp.tombs.iter().copied()) {
            acc.insert(a, b);
        }
        acc.union(&rp.gone);
        acc.union(&gone_new);
        acc.union(&lost);
        let mut holes = Vec::new();
        let mut next = from;
        for (q, _) in rp.core.slots.iter(from, ls) {
            if q > next {
                holes.push((next, q - 1));
            }
            next = q + 1;
        }
        if next <= ls {
            holes.push((next, ls));
        }
        for (a, b) in holes {
            for (x, y) in acc.gaps(a, b) {
                let mut missing = Vec::new();
                if x <= synced_seq {
                    missing.push((x, y.min(synced_seq)));
                }
                if y > synced_seq {
                    let lo = x.max(synced_seq + 1);
                    // Past the last sync known complete, only what was fully written
                    // before some damage counts as lost.
                    for (p, q) in written.gaps(lo, y) {
                        unacked.insert(p, q);
                    }
                    for (p, q) in written.iter() {
                        let (p, q) = (p.max(lo), q.min(y));
                        if p <= q {
                            missing.push((p, q));
                        }
                    }
                }
                for (x, y2) in missing {
                    match &ix_live {
                        Some((il, live)) => {
                            for s in x..=y2 {
                                if s > *il || live.binary_search(&s).is_ok() {
                                    lost_new.insert(s, s);
                                } else {
                                    gone_new.insert(s, s);
                                }
                            }
                        }
                        None => {
                            lost_new.insert(x, y2);
                        }
                    }
                }
            }
        }
    }
    // Damaged bytes count as lost where their segment lost a sequence.
    for (k, n) in new_damage {
        let s = &segs[k];
        if lost_new.intersects(s.first, s.last) {
            rp.lost_bytes += n;
        }
    }
    let ledger_changed = !lost_new.is_empty() || !unacked.is_empty() || !gone_new.is_empty();
    lost.union(&lost_new);
    rp.gone.union(&gone_new);
    rp.gone.union(&unacked);
    rep.lost = lost_new.iter().collect();
    rep.unacked = unacked.iter().collect();

    // Segment ranges are contiguous up to last_seq and `last` is monotonic: a sequence
    // whose record is damaged or gone still belongs to a segment, so a tombstone for it is
    // kept, and the ledger covers it once that segment is deleted.
    // A sequence between two segments' messages belongs to the earlier one if that one
    // ends in damage or tombstones it (its message came before the tombstone), else to
    // the later one.
    let firsts: Vec<Option<u64>> = segs
        .iter()
        .map(|s| s.has_msgs().then_some(s.first))
        .collect();
    let mut prev = 0;
    let n = segs.len();
    for (k, s) in segs.iter_mut().enumerate() {
        s.first = prev + 1;
        s.last = s.last.max(prev).max(scans[k].max_tomb.min(ls));
        let next = firsts[k + 1..].iter().flatten().next().copied();
        if scans[k].trailing_damage {
            s.last = s.last.max(next.map_or(ls, |f| f - 1));
        }
        if k == n - 1 {
            s.last = s.last.max(ls);
        }
        prev = s.last;
    }
    let c = &mut rp.core;
    c.last_seq = ls;
    c.last_ts = lts;
    match c.slots.next_live(0, ls) {
        Some(f) => {
            c.first_seq = f;
            c.first_ts = c.slots.get(f).unwrap().ts();
        }
        None => {
            c.first_seq = if ls > 0 || removed_below > 0 {
                ls + 1
            } else {
                0
            };
            c.first_ts = 0;
        }
    }
    for s in &mut segs {
        s.live = if s.has_msgs() {
            c.slots.count(s.first, s.last)
        } else {
            0
        };
    }
    rep.records_scanned = rp.records;

    let emptied = segs.iter().filter(|s| s.live == 0).map(|s| s.id).collect();
    let syncs_done = metas
        .iter()
        .filter_map(|m| m.head)
        .map(|h| h.synced.max(h.created))
        .max()
        .unwrap_or(0)
        + 1;
    let last_stub = metas.last().is_some_and(|m| m.stub);
    let mut store = FileStore {
        fs,
        dir: dir.to_path_buf(),
        cfg,
        core: RefCell::new(rp.core),
        segs,
        files: RefCell::new(files),
        wbuf: Vec::new(),
        marker: rp.marker,
        marker_done: rp.marker,
        dir_dirty: false,
        dirty: Vec::new(),
        emptied,
        failed: None,
        closed: false,
        in_flight: None,
        gone: rp.gone,
        lost: RefCell::new(lost),
        lost_bytes: Cell::new(rp.lost_bytes),
        ledger_dirty: Cell::new(ledger_changed),
        evicted: RefCell::new(Vec::new()),
        index_on_disk: rep.used_index,
        syncs_done,
        done_seq: ls,
        done_ts: lts,
        proven_seq: synced_seq.min(ls),
        observer: None,
    };
    // The active segment needs a head slot, which every sync rewrites.
    let r = (|| -> io::Result<()> {
        match store.segs.last() {
            None => store.roll()?,
            Some(s) if last_stub && s.flushed < HEADS_LEN as u64 => {
                let i = store.segs.len() - 1;
                let id = s.id;
                let mut seg_head = store.head_for(s);
                seg_head.created = store.syncs_done;
                let h = record::encode_head(&seg_head);
                let both = [&h[..], &h[..]].concat();
                store.with_file(id, |f| {
                    f.truncate(0)?;
                    f.write_at(&both, 0)
                })?;
                let s = &mut store.segs[i];
                s.flushed = HEADS_LEN as u64;
                s.head = true;
                s.created = seg_head.created;
                s.done_len = Some(HEADS_LEN as u64);
                s.next_slot = 0;
                store.mark_dirty(i);
            }
            Some(s) if !s.head => store.roll()?,
            Some(_) => {
                // What was read back may still sit in the page cache only (after a kill):
                // make it durable at the first sync, before anyone sees it.
                let i = store.segs.len() - 1;
                store.mark_dirty(i);
            }
        }
        let i = store.segs.len() - 1;
        let id = store.segs[i].id;
        store.files.get_mut().pin(id);
        Ok(())
    })();
    store.check_io(r)?;
    Ok((store, rep))
}

/// Checks that the segments still hold exactly what the index covered.
fn validate_index(
    ix: &Idx,
    metas: &[SegMeta],
    files: &mut Handles,
    fs: &dyn Fs,
    seg_path: &dyn Fn(u32) -> PathBuf,
) -> std::result::Result<(), String> {
    let max_id = ix.segs.iter().map(|s| s.id).max().unwrap_or(0);
    let on_disk: HashMap<u32, usize> = metas.iter().enumerate().map(|(i, m)| (m.id, i)).collect();
    for s in &ix.segs {
        let Some(&i) = on_disk.get(&s.id) else {
            return Err(format!("segment {} is missing", s.id));
        };
        let len = metas[i].len;
        if len < s.covered {
            return Err(format!("segment {} is shorter than the index covers", s.id));
        }
        match s.last_rec {
            None if s.covered <= HEADS_LEN as u64 => {}
            None => return Err(format!("segment {}: no last record", s.id)),
            Some((off, crc)) => {
                if off >= s.covered || s.covered - off > MAX_RECORD as u64 {
                    return Err(format!("segment {}: bad last record offset", s.id));
                }
                let mut b = vec![0; (s.covered - off) as usize];
                files
                    .with(fs, s.id, || seg_path(s.id), |f| f.read_at(&mut b, off))
                    .map_err(|e| e.to_string())?;
                // Damage kept after a segment's last record is covered too.
                match record::parse(&b) {
                    Parse::Ok(r) if r.crc == crc => {}
                    _ => return Err(format!("segment {} changed since the index", s.id)),
                }
            }
        }
    }
    if let Some(m) = metas
        .iter()
        .find(|m| m.id <= max_id && !ix.segs.iter().any(|s| s.id == m.id))
    {
        return Err(format!("segment {} is not in the index", m.id));
    }
    let mut prev_last = 0;
    for s in &ix.segs {
        if s.last < prev_last {
            return Err("segment ranges out of order".into());
        }
        prev_last = s.last;
    }
    Ok(())
}
