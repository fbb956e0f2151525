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
//! - The heads prove the highest sequence only while the segments are there. A small
//!   file beside them (`reserve`) promises that no sequence above a reserved one was
//!   handed out and names the newest durable segment; a sync writes it again when it hands
//!   out sequences within half the reserve of it or a newer segment became durable. If the named
//!   segment and every newer one are missing, recovery reports it and takes every
//!   sequence up to the reserve as gone, so none is handed out twice. (Not for a replica's
//!   store: its sequences come from its group's log.)
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

use crate::cache::IndexCache;
use crate::handles::Handles;
use crate::index::{Core, Meta, Sel, Table};
use crate::io::{Fs, FsFile};
use crate::ranges::{to_ranges, Ranges};
use crate::record::{self, Head, HeadParse, Kind, Ledger, Parse, HDR, HEADS_LEN, HEAD_LEN};
use crate::reserve::{self, Reservation, RESERVE_AHEAD, RESERVE_FILE, RESERVE_ID};
use crate::segtable::{
    acct, idx_name, read_summary, seg_name, FileTable, Loc, Other, Seg, Summary, HDR_FLAG,
};
use crate::{
    file_msg_size, Limits, Lost, Purge, ReadAhead, Result, Snapshot, State, Store, StoreError,
    StoredMsg, SyncJob,
};
use bytes::Bytes;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashSet};
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
    /// Allocate a new segment's file to `segment_size` up front, so that appending to it
    /// does not change its size: an fdatasync then flushes data only, not the file's
    /// metadata as well. A sealed segment is cut back to what it holds.
    pub preallocate: bool,
    /// The index-block cache this store reads through; the server gives all its file
    /// stores one (one budget). Without one the store gets a cache of its own
    /// (`DEFAULT_INDEX_CACHE`).
    pub index_cache: Option<crate::cache::SharedCache>,
    /// The filesystem its files are on.
    pub disk: crate::io::Disk,
}

impl Default for FileStoreConfig {
    fn default() -> Self {
        FileStoreConfig {
            segment_size: 8 << 20,
            write_buffer: 128 << 10,
            max_open_files: 256,
            preallocate: true,
            index_cache: None,
            disk: crate::io::Disk::real(),
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
    /// Segment index files were valid and used (the records they cover were not read).
    pub used_index: bool,
    /// Segment index files present but not used, and why (their segments were read).
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
    /// The newest segment files were missing (the sequence reservation names a segment
    /// newer than any there): the sequences after what the rest proves, up to the
    /// reservation, may have held messages. They are recorded as gone and never handed out
    /// again (inclusive range).
    pub segments_missing: Option<(u64, u64)>,
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

/// Stream storage in a directory of segment files.
pub struct FileStore {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    /// Its hold on `dir` (`Fs::lock`), from before recovery until it is closed or dropped: a
    /// second instance cannot open the directory meanwhile (a Raft replica loaded again
    /// while its old store lingers unclosed), so two never write the same files.
    owner: Option<Box<dyn Send>>,
    cfg: FileStoreConfig,
    /// In a cell so that a read finding a damaged record can take it out of the counts.
    /// Its table holds the segments.
    core: RefCell<Core<FileTable>>,
    files: RefCell<Handles>,
    wbuf: Vec<u8>,
    /// Highest marker written: everything below is gone on disk; and the highest one a
    /// completed sync made durable.
    marker: u64,
    marker_done: u64,
    dir_dirty: bool,
    /// Ids of segments written since the last sync (the fdatasync list), so `sync` never
    /// walks every segment of a large stream.
    dirty: Vec<u32>,
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
    /// Completed syncs (carried across restarts by the heads), and last_seq/last_ts as of
    /// the last completed sync (or recovery).
    syncs_done: u64,
    done_seq: u64,
    done_ts: i64,
    /// The last sequence known durable, which heads record.
    proven_seq: u64,
    /// The applied marker (see `set_applied`): as set, as the last applied record written
    /// carries it, and as of the last completed sync. None until a marker is set; from
    /// then on every sync that writes anything ends with an applied record.
    applied: Option<Vec<u8>>,
    applied_written: Option<Vec<u8>>,
    applied_done: Option<Vec<u8>>,
    observer: Option<Observer>,
    /// The sequence reservation (see `reserve`): the record the last completed sync left
    /// durable, the slot to write next, and the file, held open between syncs. A replica's
    /// store keeps none (`keeps_reserve`).
    reserve: Option<Reservation>,
    reserve_slot: u8,
    reserve_file: Option<Box<dyn FsFile>>,
    keeps_reserve: bool,
    /// Bumped whenever bytes already in a segment file may change or a segment id may name
    /// a new file (erase in place, compaction, rollback, a new segment): read-ahead blocks
    /// taken before are stale.
    rewrites: u64,
    /// This store's identity for read-ahead blocks (see [`ReadAhead`]).
    ident: Arc<()>,
}

/// Bytes a reader going forward reads at once (see [`ReadAhead`]).
const READ_AHEAD: usize = 64 << 10;
/// How far past the reader's last record the next may start and still count as reading in
/// order (tombstones and removed messages between them).
const SEQUENTIAL_GAP: u64 = 4 << 10;

/// How far ahead of its records a segment file is allocated: as much again as it holds,
/// from 4 KiB to 256 KiB, so a small stream wastes little and a busy one changes its file's
/// size (which costs the next fdatasync a metadata commit) about once per 256 KiB. (At a sync
/// the allocation writes zeros, which that sync flushes: 1 MiB steps doubled its p99 for the
/// same mean.)
const PREALLOC: u64 = 256 << 10;

fn prealloc_step(len: u64) -> u64 {
    len.clamp(4 << 10, PREALLOC)
}

/// The whole-store index of earlier versions (replaced by per-segment index files).
const LEGACY_INDEX: &str = "index.bin";
const LEGACY_INDEX_TMP: &str = "index.tmp";

fn parse_seg_name(name: &str) -> Option<u32> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn parse_idx_name(name: &str) -> Option<u32> {
    let digits = name.strip_suffix(".idx")?;
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
    /// The marker its applied record carries.
    applied: Option<Vec<u8>>,
    /// The sequence reservation it writes (`reserve`), durable once it completes.
    reserve: Option<Reservation>,
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
        Self::open_fs(cfg.disk.fs(), dir, limits, cfg)
    }

    pub(crate) fn open_fs(
        fs: Arc<dyn Fs>,
        dir: &Path,
        limits: Limits,
        mut cfg: FileStoreConfig,
    ) -> Result<(FileStore, RecoveryReport)> {
        cfg.segment_size = cfg.segment_size.clamp(2 * HEADS_LEN as u64, 1 << 30);
        fs.create_dir_all(dir)?;
        let owner = fs.lock(dir)?;
        // Read before recovery touches anything: which sync the store goes back to.
        let applied = if fs.open(&dir.join(APPLIED_FLAG), false).is_ok() {
            Some(find_applied(&*fs, dir)?)
        } else {
            None
        };
        let (mut store, mut rep) = recover(fs, dir, cfg, applied.is_none())?;
        store.owner = Some(owner);
        if let Some(found) = applied {
            store.back_to_applied(found, &mut rep)?;
        }
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

    /// Approximate heap bytes this store holds for its index (the per-segment summaries,
    /// the active segment's entries and the subjects; blocks in the shared cache aside).
    pub fn index_heap_bytes(&self) -> usize {
        self.core.borrow().slots.heap_bytes()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn t(&self) -> std::cell::Ref<'_, FileTable> {
        std::cell::Ref::map(self.core.borrow(), |c| &c.slots)
    }

    fn segs(&mut self) -> &mut Vec<Seg> {
        &mut self.core.get_mut().slots.segs
    }

    fn nsegs(&self) -> usize {
        self.core.borrow().slots.segs.len()
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
        self.t().seg_of(seq)
    }

    fn seg_by_id(&self, id: u32) -> Option<usize> {
        self.t().seg_by_id(id)
    }

    fn mark_dirty(&mut self, i: usize) {
        let s = &mut self.core.get_mut().slots.segs[i];
        if !s.dirty {
            s.dirty = true;
            let id = s.id;
            self.dirty.push(id);
            self.files.get_mut().pin(id);
        }
    }

    fn active_len(&self) -> u64 {
        self.core
            .borrow()
            .slots
            .segs
            .last()
            .map_or(0, |s| s.flushed)
            + self.wbuf.len() as u64
    }

    /// Writes the buffered records. `at_sync`: the tail of a batch that the sync now waits
    /// for (allocation ahead then writes zeros, so the fdatasync flushes data only), rather
    /// than a full buffer in a stream of writes (where copying zeros first would cost more
    /// than the metadata it saves).
    fn flush_wbuf(&mut self, at_sync: bool) -> io::Result<()> {
        if self.wbuf.is_empty() {
            return Ok(());
        }
        let i = self.nsegs() - 1;
        let (id, at, alloc) = {
            let s = &self.segs()[i];
            (s.id, s.flushed, s.alloc)
        };
        let buf = std::mem::take(&mut self.wbuf);
        let end = at + buf.len() as u64;
        // Allocate ahead in steps, so most syncs find the file's size unchanged. Failure
        // is not an error: the write below extends the file (or fails) on its own.
        let mut alloc = alloc;
        if self.cfg.preallocate && end > alloc && end < self.cfg.segment_size {
            let want = self.cfg.segment_size.min(end + prealloc_step(end));
            if self.with_file(id, |f| f.allocate(want, at_sync)).is_ok() {
                alloc = want;
            }
        }
        let r = self.with_file(id, |f| f.write_at(&buf, at));
        self.wbuf = buf;
        r?;
        let s = &mut self.segs()[i];
        s.flushed = end;
        s.alloc = alloc.max(end);
        self.wbuf.clear();
        self.mark_dirty(i);
        Ok(())
    }

    fn head_for(&self, created: u64, proven_len: u64) -> Head {
        let c = self.core.borrow();
        Head {
            pending: c.last_seq,
            ts: c.last_ts,
            created,
            synced: self.syncs_done,
            synced_seq: self.proven_seq,
            synced_len: proven_len.max(HEADS_LEN as u64),
        }
    }

    fn head_of(&self, i: usize) -> Head {
        let (created, proven) = {
            let t = self.t();
            (t.segs[i].created, t.segs[i].proven_len)
        };
        self.head_for(created, proven)
    }

    /// Rewrites the head of segment `i` in its next slot.
    fn write_head(&mut self, i: usize, h: &Head) -> io::Result<()> {
        let (id, slot) = {
            let s = &self.segs()[i];
            (s.id, s.next_slot)
        };
        let b = record::encode_head(h);
        self.with_file(id, |f| f.write_at(&b, (slot as usize * HEAD_LEN) as u64))?;
        self.segs()[i].next_slot = 1 - slot;
        Ok(())
    }

    /// Seals the active segment: gives back its unused preallocated space and writes its
    /// index file. Sealing never fails the write path: without an index file the entries
    /// stay in memory (and the file is cut at the next chance).
    fn seal_active(&mut self) {
        let n = self.nsegs();
        if n == 0 {
            return;
        }
        let i = n - 1;
        let (id, flushed, alloc) = {
            let s = &self.segs()[i];
            (s.id, s.flushed, s.alloc)
        };
        if alloc > flushed && self.with_file(id, |f| f.truncate(flushed)).is_ok() {
            self.segs()[i].alloc = flushed;
            self.mark_dirty(i);
        }
        self.core.get_mut().slots.seal(i);
    }

    /// Starts a new active segment. The previous one is left for `sync` to fdatasync.
    fn roll(&mut self) -> io::Result<()> {
        self.flush_wbuf(false)?;
        if let Some(s) = self.core.get_mut().slots.segs.last() {
            // A segment that ends up holding no live message (only tombstones or markers,
            // or everything already removed) becomes a deletion candidate once it is not
            // active.
            let (id, live, dirty) = (s.id, s.ix.live, s.dirty);
            if live == 0 {
                self.core.get_mut().slots.emptied.push(id);
            }
            self.seal_active();
            if !dirty && !self.segs().last().is_some_and(|s| s.dirty) {
                self.files.get_mut().unpin(id);
            }
        }
        let id = self
            .core
            .get_mut()
            .slots
            .segs
            .last()
            .map_or(1, |s| s.id + 1);
        // The id may be one a purged segment had.
        self.rewrites += 1;
        let mut file = self.fs.open(&self.path(&seg_name(id)), true)?;
        if file.len()? != 0 {
            // Only possible with foreign files in the directory; never append to them.
            file.truncate(0)?;
        }
        // A stale index file of that name (a segment deleted before) must not be trusted.
        let _ = self.fs.remove(&self.path(&idx_name(id)));
        let base = self.core.get_mut().last_seq;
        let mut seg = Seg::new(id, base);
        seg.flushed = HEADS_LEN as u64;
        seg.head = true;
        seg.created = self.syncs_done;
        seg.proven_len = HEADS_LEN as u64;
        let h = record::encode_head(&self.head_for(seg.created, seg.proven_len));
        file.write_at(&[&h[..], &h[..]].concat(), 0)?;
        seg.alloc = HEADS_LEN as u64;
        let want = self
            .cfg
            .segment_size
            .min(HEADS_LEN as u64 + prealloc_step(0));
        if self.cfg.preallocate && file.allocate(want, true).is_ok() {
            seg.alloc = want;
        }
        let h = self.files.get_mut();
        h.insert(id, file);
        h.pin(id);
        self.core.get_mut().slots.push_seg(seg);
        let i = self.nsegs() - 1;
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
        if self.nsegs() == 0 || (cur > HEADS_LEN as u64 && cur + len as u64 > self.cfg.segment_size)
        {
            self.roll()?;
        }
        let idx = self.nsegs() - 1;
        let off = self.active_len();
        let crc = record::encode(&mut self.wbuf, kind, seq, ts, subj, hdr, data);
        self.segs()[idx].last_rec = Some((off, crc));
        self.mark_dirty(idx);
        if self.wbuf.len() >= self.cfg.write_buffer {
            self.flush_wbuf(false)?;
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
    /// and last_ts (a sequence once used must never be handed out again); and its subject
    /// and record length, so recovery accounts for the removal without reading the entry.
    fn write_tomb(&mut self, target: u64, ts: i64, subj: &[u8], rlen: u32) -> io::Result<()> {
        let body = rlen.to_le_bytes();
        let data: &[u8] = if rlen == 0 { &[] } else { &body };
        self.append(Kind::Tomb, target, ts, subj, b"", data)?;
        self.core.get_mut().slots.note_other(Other::Tomb {
            seq: target,
            ts,
            subj: Bytes::copy_from_slice(subj),
            rlen,
        });
        Ok(())
    }

    /// Messages whose records an index rebuild could not find: lost, like damage found
    /// when reading.
    fn settle_missing(&mut self) {
        // Those a rebuild could not tell from gaps first: marked, so that reading one
        // later does not count it as a lost live message.
        let unsure = std::mem::take(self.core.get_mut().slots.unsure.get_mut());
        let missing = std::mem::take(self.core.get_mut().slots.missing.get_mut());
        let all = unsure
            .into_iter()
            .map(|q| (q, false))
            .chain(missing.into_iter().map(|q| (q, true)));
        for (seq, counted) in all {
            let i = self.seg_idx(seq);
            let c = self.core.get_mut();
            if let Some(i) = i {
                if !counted {
                    c.slots.mark_unsure(i, seq);
                } else if c.slots.kill_unknown(i, seq) {
                    c.msgs = c.msgs.saturating_sub(1);
                    if seq == c.first_seq {
                        c.advance_first(seq + 1);
                    }
                }
            }
            // Reported once.
            if !self.lost.get_mut().insert(seq, seq) {
                continue;
            }
            self.ledger_dirty.set(true);
            let d = ReadDamage {
                seq,
                segment: i.map_or(0, |i| self.segs()[i].id),
                offset: 0,
                bytes: 0,
                quarantine: None,
                quarantine_error: Some("the record is not in its segment any more".into()),
            };
            if let Some(o) = &self.observer {
                o(&StoreEvent::ReadDamage(&d));
            }
        }
    }

    /// Turns what the last core operation removed into records.
    fn settle(&mut self) -> io::Result<()> {
        self.settle_missing();
        let core = self.core.get_mut();
        if core.reset {
            core.reset = false;
            let last = core.last_seq;
            if !self.lost.get_mut().is_empty() || self.lost_bytes.get() > 0 {
                *self.lost.get_mut() = Ranges::default();
                self.lost_bytes.set(0);
                self.ledger_dirty.set(true);
            }
            // Everything is gone (the table marked every segment empty): start a fresh
            // segment so every old one can be deleted at the next sync, once the marker
            // recording the new first sequence is down.
            let fresh = self.core.get_mut().slots.segs.last().is_some_and(|s| {
                s.flushed == HEADS_LEN as u64 && s.head && s.ix.n == 0 && self.wbuf.is_empty()
            });
            if !fresh {
                self.roll()?;
            } else if let Some(s) = self.segs().last_mut() {
                s.first = last + 1;
                s.last = last;
            }
        }
        let core = self.core.get_mut();
        let mut removed = std::mem::take(&mut core.removed);
        let first_seq = core.first_seq;
        let mut r = Ok(());
        for x in &removed {
            // Below first_seq the next marker covers it.
            if x.seq >= first_seq {
                r = self.write_tomb(x.seq, x.meta.ts, &x.subject, x.p.len);
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
        let last = c.last_seq;
        let ts = c.last_ts;
        self.append(Kind::Marker, m, ts, b"", b"", &last.to_le_bytes())?;
        self.core.get_mut().slots.note_other(Other::Marker {
            seq: m,
            ts,
            last: Some(last),
        });
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
        let (_, loc) = self.append(Kind::Ledger, 0, 0, b"", b"", &data)?;
        self.core.get_mut().slots.note_ledger(loc.off as u64, data);
        self.ledger_dirty.set(false);
        Ok(())
    }

    /// Appends the applied record that ends a sync's writes (when the store has a marker and
    /// the sync writes anything or the marker changed); returns the marker it carries. It
    /// lists the stretches of records this sync wrote, so recovery can check they are all
    /// on disk before it trusts the marker.
    /// (Segments this sync deletes once it completed are left out: they hold nothing live.)
    fn write_applied(&mut self, dead: &[u32]) -> io::Result<Option<Vec<u8>>> {
        let Some(m) = self.applied.clone() else {
            return Ok(None);
        };
        if self.dirty.is_empty() && self.applied_written.as_ref() == Some(&m) {
            return Ok(None);
        }
        // Rolled first if it would not fit, so that its stretches include its own segment.
        let upper = record::record_len(0, 0, 1 + m.len() + 4 + 20 * (self.dirty.len() + 2));
        let cur = self.active_len();
        if self.nsegs() == 0
            || (cur > HEADS_LEN as u64 && cur + upper as u64 > self.cfg.segment_size)
        {
            self.roll()?;
        }
        let active = self.nsegs() - 1;
        let mut ids = self.dirty.clone();
        ids.push(self.segs()[active].id);
        ids.sort_unstable();
        ids.dedup();
        ids.retain(|id| !dead.contains(id));
        let mut spans = Vec::new();
        for id in ids {
            if let Some(i) = self.seg_by_id(id) {
                let s = &self.t().segs[i];
                let base = if s.head { HEADS_LEN as u64 } else { 0 };
                let from = s.done_len.unwrap_or(base).max(base);
                let to = if i == active {
                    s.flushed + self.wbuf.len() as u64
                } else {
                    s.flushed
                };
                spans.push((id, from, to));
            }
        }
        let mut body = Vec::with_capacity(1 + m.len() + 4 + 20 * spans.len());
        body.push(m.len() as u8);
        body.extend_from_slice(&m);
        body.extend_from_slice(&(spans.len() as u32).to_le_bytes());
        for (id, from, to) in spans {
            body.extend_from_slice(&id.to_le_bytes());
            body.extend_from_slice(&from.to_le_bytes());
            body.extend_from_slice(&to.to_le_bytes());
        }
        let (last, ts) = {
            let c = self.core.get_mut();
            (c.last_seq, c.last_ts)
        };
        self.append(Kind::Applied, last, ts, b"", b"", &body)?;
        self.applied_written = Some(m.clone());
        Ok(Some(m))
    }

    /// Writes the sequence reservation again (into the slot not holding the durable one)
    /// when this sync hands out sequences past it, or a newer segment became durable; the
    /// sync's fsyncs make it durable with the data. Returns what it wrote.
    fn write_reserve(&mut self) -> Option<Reservation> {
        if !self.keeps_reserve {
            return None;
        }
        // The newest segment a completed sync made durable, directory entry included: one
        // newer may still vanish with a crash, which must not read as a segment gone.
        let named = self
            .core
            .get_mut()
            .slots
            .segs
            .iter()
            .rev()
            .find(|s| s.done_len.is_some())
            .map(|s| s.id)?;
        let last = self.core.get_mut().last_seq;
        // Renewed half way: with a sync interval, acknowledgments run ahead of the syncs.
        let ahead = last.saturating_add(RESERVE_AHEAD / 2);
        let upto = match self.reserve {
            Some(r) if r.segment == named && ahead <= r.upto => return None,
            Some(r) if ahead <= r.upto => r.upto,
            _ => last.saturating_add(RESERVE_AHEAD),
        };
        let r = Reservation {
            gen: self.reserve.map_or(1, |r| r.gen + 1),
            upto,
            segment: named,
        };
        // A reservation that cannot be written (a full disk) fails no sync: the durable
        // one stays (a torn slot is the other one's), renewed at a later sync.
        let at = self.reserve_slot as u64 * reserve::SLOT as u64;
        let written = match self.reserve_file.take() {
            Some(f) => Ok(f),
            None => {
                // Its directory entry, if new, must be durable with it.
                if self.reserve.is_none() {
                    self.dir_dirty = true;
                }
                self.fs.open(&self.path(RESERVE_FILE), true)
            }
        }
        .and_then(|mut f| f.write_at(&reserve::encode(&r), at).map(|_| f));
        match written {
            Ok(f) => {
                self.reserve_file = Some(f);
                Some(r)
            }
            Err(_) => None,
        }
    }

    fn do_sync(&mut self) -> io::Result<()> {
        let (plan, mut job) = self.sync_prepare()?;
        job.run();
        self.sync_complete(plan, job)
    }

    /// A sync up to its fsyncs: what must be written is written (buffers, markers, the
    /// ledger, segment heads); returns what the sync covers and the fsyncs still to do.
    fn sync_prepare(&mut self) -> io::Result<(SyncPlan, SyncJob)> {
        self.settle_missing();
        // A large active segment whose messages are all gone (a consumed work queue) is
        // sealed, so that it can go now instead of staying until it fills.
        let (live, len) = self
            .core
            .get_mut()
            .slots
            .segs
            .last()
            .map_or((1, 0), |s| (s.ix.live, s.flushed + self.wbuf.len() as u64));
        if live == 0 && len > self.cfg.segment_size / 2 {
            self.roll()?;
        }
        // Deletion candidates: emptied, still empty, and not the active segment (which
        // stays a candidate until a newer one takes over).
        let active = self.core.get_mut().slots.segs.last().map(|s| s.id);
        let mut ids = std::mem::take(&mut self.core.get_mut().slots.emptied);
        ids.sort_unstable();
        ids.dedup();
        let mut dead = Vec::new();
        for id in ids {
            if Some(id) == active {
                self.core.get_mut().slots.emptied.push(id);
            } else if let Some(i) = self.seg_by_id(id) {
                if self.segs()[i].ix.live == 0 {
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
                let (first, last, has, ext) = {
                    let s = &self.segs()[i];
                    (s.first, s.last, s.has_msgs(), s.ix.ext_tombs)
                };
                if has && last >= self.marker {
                    self.gone.insert(first.max(self.marker), last);
                }
                if ext == 0 {
                    continue;
                }
                // Tombstones here for messages of older segments that remain must be
                // written again before this segment goes.
                for o in self.t().others_of(i) {
                    if let Other::Tomb {
                        seq,
                        ts,
                        subj,
                        rlen,
                    } = o
                    {
                        if seq < first
                            && seq >= self.marker
                            && self.t().has_record(seq)
                            && self.t().get(seq).is_none()
                        {
                            again.push((seq, ts, subj, rlen));
                        }
                    }
                }
            }
            for (t, ts, subj, rlen) in again {
                self.write_tomb(t, ts, &subj, rlen)?;
            }
            // The ledger may sit in a segment about to go; it is rewritten whole.
            self.ledger_dirty.set(true);
        }
        if self.ledger_dirty.get() {
            self.write_ledger()?;
        }
        let dead_ids: Vec<u32> = dead.iter().map(|&i| self.segs()[i].id).collect();
        let applied = self.write_applied(&dead_ids)?;
        self.flush_wbuf(true)?;
        // Index files found damaged (their entries were rebuilt from the records), and
        // sealed segments whose records changed in place, are written again.
        let rebuilt = std::mem::take(self.core.get_mut().slots.rebuilt.get_mut());
        for id in rebuilt {
            if let Some(i) = self.seg_by_id(id) {
                let t = &mut self.core.get_mut().slots;
                t.load_all(i);
                t.segs[i].ix.idx_dirty = true;
            }
        }
        let n = self.nsegs();
        for i in 0..n.saturating_sub(1) {
            if self.segs()[i].ix.idx_dirty {
                self.core.get_mut().slots.seal(i);
            }
        }
        // The heads of the segments about to be synced record what this sync hands out.
        for id in self.dirty.clone() {
            if let Some(i) = self.seg_by_id(id) {
                if self.segs()[i].head {
                    let h = self.head_of(i);
                    self.write_head(i, &h)?;
                }
            }
        }
        let reserve = self.write_reserve();
        // The descriptors that wrote the data go with the job (its fsyncs must see their
        // write-back errors), so the fsyncs can run while readers use the store; a reader
        // that needs one of these segments meanwhile opens it again.
        let ids = std::mem::take(&mut self.dirty);
        let mut files = Vec::with_capacity(ids.len() + 1);
        if reserve.is_some() {
            files.extend(self.reserve_file.take().map(|f| (RESERVE_ID, f)));
        }
        for &id in &ids {
            if self.seg_by_id(id).is_none() {
                continue;
            }
            if let Err(e) = self.with_file(id, |_| Ok(())) {
                for (id, f) in files {
                    if id == RESERVE_ID {
                        self.reserve_file = Some(f);
                    } else {
                        self.files.get_mut().put(id, f);
                    }
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
            dead: dead.iter().map(|&i| self.segs()[i].id).collect(),
            active,
            dir: dir.is_some(),
            applied,
            reserve,
        };
        Ok((plan, SyncJob::new(files, dir)))
    }

    /// The bookkeeping after a sync's fsyncs completed.
    fn sync_complete(&mut self, plan: SyncPlan, job: SyncJob) -> io::Result<()> {
        let (files, r) = job.finish();
        for (id, f) in files {
            if id == RESERVE_ID {
                self.reserve_file = Some(f);
            } else if self.seg_by_id(id).is_some() {
                self.files.get_mut().put(id, f);
            }
        }
        if let Err(e) = r {
            self.dirty.extend(plan.ids);
            return Err(e);
        }
        if let Some(r) = plan.reserve {
            self.reserve = Some(r);
            self.reserve_slot = 1 - self.reserve_slot;
        }
        let active = plan.active;
        for &id in &plan.ids {
            if let Some(i) = self.seg_by_id(id) {
                self.segs()[i].dirty = false;
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
        if plan.applied.is_some() {
            self.applied_done = plan.applied;
        }
        self.marker_done = self.marker;
        let c = self.core.get_mut();
        self.done_seq = c.last_seq;
        self.done_ts = c.last_ts;
        self.proven_seq = c.last_seq;
        // Only segments written since the last sync changed length.
        for &id in &plan.ids {
            if let Some(i) = self.seg_by_id(id) {
                let s = &mut self.segs()[i];
                s.done_len = Some(s.flushed);
                s.proven_len = s.flushed;
            }
        }
        if !dead.is_empty() {
            // Past the durability point a failure only leaves files behind, which the next
            // recovery finds covered by the marker and the ledger and deletes again.
            for &i in dead.iter().rev() {
                let s = self.core.get_mut().slots.remove_seg(i);
                self.files.get_mut().forget(s.id);
                let _ = self.fs.remove(&self.path(&seg_name(s.id)));
                let _ = self.fs.remove(&self.path(&idx_name(s.id)));
            }
            // The unlinks become durable with the next sync's directory fsync (until then a
            // power failure only leaves files the next recovery deletes again): no fsync
            // here, where the store is held.
            self.dir_dirty = true;
        }
        Ok(())
    }

    /// A sync's failure: the store rolls back to the last completed sync, now if it can
    /// (then it takes writes again), else at the next sync; the error says which.
    fn sync_failed(&mut self, e: io::Error) -> StoreError {
        let msg = e.to_string();
        self.failed = Some(msg.clone());
        match self.rollback() {
            Ok(()) => StoreError::Io(format!(
                "{msg} (writes since the last sync were rolled back)"
            )),
            Err(_) => StoreError::Io(format!(
                "{msg} (writes since the last sync are lost; the next sync rolls back)"
            )),
        }
    }

    /// After a failed write or sync: truncates every segment back to its length at the
    /// last completed sync, removes segments created since, restores their heads, and
    /// rebuilds the store from disk. On success the store takes writes again.
    fn rollback(&mut self) -> Result<()> {
        let why = self.failed.clone().unwrap_or_default();
        self.rewrites += 1;
        let r = (|| -> io::Result<()> {
            self.wbuf.clear();
            let mut created = Vec::new();
            let n = self.nsegs();
            for i in 0..n {
                let (id, done, head, next_slot, seg_created, proven_len) = {
                    let s = &self.segs()[i];
                    (
                        s.id,
                        s.done_len,
                        s.head,
                        s.next_slot,
                        s.created,
                        s.proven_len,
                    )
                };
                let Some(len) = done else {
                    created.push(id);
                    continue;
                };
                let head = head.then(|| {
                    record::encode_head(&Head {
                        pending: self.done_seq,
                        ts: self.done_ts,
                        created: seg_created,
                        synced: self.syncs_done,
                        synced_seq: self.proven_seq,
                        synced_len: proven_len.max(HEADS_LEN as u64),
                    })
                });
                // Over the slot the failed sync wrote: neither then claims more than the
                // last completed sync.
                let slot = (1 - next_slot as u64) * HEAD_LEN as u64;
                self.with_file(id, |f| {
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
                let _ = self.fs.remove(&self.path(&idx_name(id)));
            }
            // The reservation, over the slot the failed sync may have written: a record
            // naming a segment just removed would read as that segment gone missing.
            self.reserve_file = None;
            if self.keeps_reserve {
                let path = self.path(RESERVE_FILE);
                match self.reserve {
                    Some(r) => {
                        let mut f = self.fs.open(&path, true)?;
                        let at = self.reserve_slot as u64 * reserve::SLOT as u64;
                        f.write_at(&reserve::encode(&r), at)?;
                        f.sync()?;
                    }
                    None => match self.fs.remove(&path) {
                        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                        _ => {}
                    },
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
        let keeps = self.keeps_reserve;
        let (mut fresh, rep) = match recover(self.fs.clone(), &self.dir, self.cfg.clone(), keeps) {
            Ok(x) => x,
            Err(e) => {
                let msg = format!("{why}; rebuilding after rollback failed: {e}");
                return Err(StoreError::Io(msg));
            }
        };
        fresh.core.get_mut().set_limits(limits);
        // The marker goes back with the data: it is the one the last completed sync wrote.
        fresh.applied = self.applied_done.clone();
        fresh.applied_done = self.applied_done.clone();
        if let Err(e) = fresh.settle().and_then(|_| fresh.do_sync()) {
            fresh.closed = true;
            let msg = format!("{why}; sync after rollback failed: {e}");
            return Err(StoreError::Io(msg));
        }
        fresh.observer = self.observer.take();
        fresh.owner = self.owner.take();
        if let Some(o) = &fresh.observer {
            o(&StoreEvent::Recovered(&rep));
        }
        // The old state must not close (and write an index) when dropped.
        self.closed = true;
        *self = fresh;
        Ok(())
    }

    /// A store with an applied marker reopens exactly as of the sync that wrote the newest
    /// applied record found intact (with its stretches): what was written after it is cut
    /// (the existing rollback, as after a failed sync), so the marker is never behind nor
    /// ahead of the data.
    fn back_to_applied(
        &mut self,
        found: Option<AppliedAt>,
        rep: &mut RecoveryReport,
    ) -> Result<()> {
        let Some(a) = found else {
            // Marked as in use, but no sync wrote a marker yet: the empty one.
            self.applied = Some(Vec::new());
            self.applied_done = Some(Vec::new());
            return Ok(());
        };
        // A head a later sync rewrote may claim sequences handed out after it, too.
        if a.beyond || self.core.get_mut().last_seq != a.last_seq {
            let Some(k) = self.seg_by_id(a.seg) else {
                // Not expected (recovery keeps a segment with valid records); opening never
                // fails because of file content, so the store stays as recovered.
                self.applied = Some(a.marker.clone());
                self.applied_done = Some(a.marker);
                return Ok(());
            };
            // The cut segment's index file lists what goes.
            let _ = self.fs.remove(&self.path(&idx_name(a.seg)));
            let n = self.nsegs();
            for i in 0..n {
                let s = &mut self.segs()[i];
                if i == k {
                    s.done_len = Some(a.end);
                    s.proven_len = s.proven_len.min(a.end);
                } else if i > k {
                    s.done_len = None;
                } else {
                    s.done_len = Some(s.flushed);
                }
            }
            self.done_seq = a.last_seq;
            self.done_ts = a.last_ts;
            self.proven_seq = self.proven_seq.min(a.last_seq);
            self.applied_done = Some(a.marker.clone());
            let bytes = (k..n)
                .map(|i| {
                    let s = &self.t().segs[i];
                    s.flushed - if i == k { a.end.min(s.flushed) } else { 0 }
                })
                .sum::<u64>();
            self.failed = Some("writes after the last applied marker's sync".into());
            self.rollback()?;
            // Reported like any incomplete write (never acknowledged); sequences past the
            // marker's sync are not handed out any more.
            rep.torn.push(TornWrite {
                segment: a.seg,
                offset: a.end,
                bytes,
                cut: true,
            });
            rep.torn_bytes += bytes;
            rep.unacked.retain_mut(|r| {
                r.1 = r.1.min(a.last_seq);
                r.0 <= r.1
            });
        }
        self.applied = Some(a.marker.clone());
        self.applied_done = Some(a.marker);
        Ok(())
    }

    /// Drops the store the way a killed process would: no flush of the write buffer, no
    /// sync, no index files for the active segment.
    #[cfg(test)]
    pub(crate) fn crash(mut self) {
        self.closed = true;
    }

    #[cfg(test)]
    pub(crate) fn dump(&self) -> String {
        self.t().dump()
    }

    #[cfg(test)]
    pub(crate) fn core_limits(&self) -> Limits {
        self.core.borrow().limits.clone()
    }

    #[cfg(test)]
    pub(crate) fn segment_count(&self) -> usize {
        self.nsegs()
    }

    #[cfg(test)]
    pub(crate) fn segment_of(&self, seq: u64) -> Option<u32> {
        let t = self.t();
        t.seg_of(seq).map(|i| t.segs[i].id)
    }

    #[cfg(test)]
    pub(crate) fn open_files(&self) -> usize {
        self.files.borrow().open_count()
    }

    fn read(&self, seq: u64) -> Result<Read> {
        self.read_ahead(seq, None)
    }

    /// Reads one record; with `ra`, from the reader's block when it holds the record, else
    /// by reading a new block from the record on.
    fn read_ahead(&self, seq: u64, mut ra: Option<&mut ReadAhead>) -> Result<Read> {
        let Some((i, loc)) = self.t().loc(seq) else {
            return Err(StoreError::NotFound);
        };
        let (id, flushed, last) = {
            let t = self.t();
            (t.segs[i].id, t.segs[i].flushed, i == t.segs.len() - 1)
        };
        let (off, len) = (loc.off as u64, loc.len());
        let buf = if last && off >= flushed {
            let at = (off - flushed) as usize;
            match self.wbuf.get(at..at + len) {
                Some(b) => Bytes::copy_from_slice(b),
                None => Bytes::new(),
            }
        } else if let Some(b) = ra
            .as_deref_mut()
            .and_then(|ra| self.in_block(ra, id, off, len))
        {
            b
        } else {
            // A block only for a reader going in order (this record starts at or just past
            // where its last one ended): a sparse filter would read 64 KiB per message.
            let ahead = ra
                .as_deref()
                .is_some_and(|ra| ra.seg == id && off >= ra.end && off - ra.end <= SEQUENTIAL_GAP)
                && len < READ_AHEAD
                && off + len as u64 <= flushed;
            let n = if ahead {
                (READ_AHEAD as u64).min(flushed - off) as usize
            } else {
                len
            };
            let mut v = vec![0; n];
            // A record cut off by a shorter file is damage like any other.
            match self.with_file(id, |f| f.read_at(&mut v, off)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => v.clear(),
                Err(e) => return Err(e.into()),
            }
            let b = Bytes::from(v);
            if let Some(ra) = ra {
                *ra = ReadAhead {
                    store: Arc::downgrade(&self.ident),
                    seg: id,
                    off,
                    end: off + len as u64,
                    rewrites: self.rewrites,
                    buf: if ahead { b.clone() } else { Bytes::new() },
                };
            }
            if ahead && b.len() >= len {
                b.slice(..len)
            } else {
                b
            }
        };
        let (sl, hl, ts) = match record::parse(&buf) {
            Parse::Ok(r) if r.kind == Kind::Msg && r.seq == seq && r.len == len => {
                (r.subj.len(), r.hdr.len(), r.ts)
            }
            _ => {
                self.damaged_on_read(seq, id, off, len as u64, &buf);
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

    /// The record at `off` of segment `id` from the reader's block, if the block holds it
    /// and is not stale.
    fn in_block(&self, ra: &mut ReadAhead, id: u32, off: u64, len: usize) -> Option<Bytes> {
        if ra.store.as_ptr() != Arc::as_ptr(&self.ident)
            || ra.seg != id
            || ra.rewrites != self.rewrites
            || off < ra.off
        {
            return None;
        }
        let at = (off - ra.off) as usize;
        if at + len > ra.buf.len() {
            return None;
        }
        ra.end = off + len as u64;
        Some(ra.buf.slice(at..at + len))
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

    fn next_from(
        &self,
        mut start: u64,
        filter: &str,
        mut ra: Option<&mut ReadAhead>,
    ) -> Result<StoredMsg> {
        loop {
            let seq = self
                .core
                .borrow()
                .find_next(start, filter)
                .ok_or(StoreError::NotFound)?;
            match self.read_ahead(seq, ra.as_deref_mut())? {
                Read::Msg(m) => return Ok(m),
                // A damaged record is now lost; move on to the next match.
                Read::Damaged => start = seq + 1,
            }
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
        self.rewrites += 1;
        // The segment's index file would call the overwritten record a message: it goes
        // (durably, before the overwrite) and is written again from memory at the next
        // sync, naming the record erased.
        self.core.get_mut().slots.load_all(i);
        let id = self.segs()[i].id;
        match self.fs.remove(&self.path(&idx_name(id))) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            Ok(()) => self.fs.sync_dir(&self.dir)?,
            Err(_) => {}
        }
        let (off, len) = (loc.off as u64, loc.len());
        let id = self.segs()[i].id;
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
        let s = &mut self.segs()[i];
        if let (Some(c), Some((lo, _))) = (crc, s.last_rec) {
            if lo == off {
                s.last_rec = Some((off, c));
            }
        }
        self.core.get_mut().slots.mark_erased(i, seq);
        self.segs()[i].erases += 1;
        self.mark_dirty(i);
        Ok(())
    }

    /// What a restart needs besides the records: the active segment's index file (the
    /// sealed ones have theirs), naming the last sequence as durable.
    fn write_index(&mut self) -> io::Result<()> {
        let n = self.nsegs();
        if n == 0 {
            return Ok(());
        }
        // A stopped store leaves no preallocated space behind.
        let (id, flushed, alloc) = {
            let s = &self.segs()[n - 1];
            (s.id, s.flushed, s.alloc)
        };
        if alloc > flushed {
            self.with_file(id, |f| {
                f.truncate(flushed)?;
                f.sync()
            })?;
            self.segs()[n - 1].alloc = flushed;
        }
        let last = self.core.get_mut().last_seq;
        let ts = self.core.get_mut().last_ts;
        let t = &mut self.core.get_mut().slots;
        t.closed_at = Some((last, ts));
        let r = t.write_idx(n - 1).map(|_| ());
        t.closed_at = None;
        r
    }
}

// ---- compaction -----------------------------------------------------------------------

/// A segment is rewritten once at least this share of its bytes is dead...
const COMPACT_WASTE: u64 = 3;
/// ...and at least this many bytes (or a quarter of a segment, if smaller).
const COMPACT_MIN: u64 = 256 << 10;

fn cmp_name(id: u32) -> String {
    format!("{id:010}.cmp")
}

/// A compaction planned under the store's lock, to run without it ([`CompactJob::run`])
/// and be put in place with [`FileStore::compact_end`]. It rewrites one sealed segment
/// with only its live messages (and the tombstones, marker and ledger still needed), led
/// by a claim record saying which sequences of the segment's range it holds, into a new
/// file that is fsynced and then renamed over the old one: a power failure at any point
/// leaves either segment, each complete on its own.
pub struct CompactJob {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    id: u32,
    uid: u64,
    erases: u32,
    old_len: u64,
    /// Heads, claim and other records, written first.
    prefix: Vec<u8>,
    /// Records to copy: (sequence, offset, length).
    copy: Vec<(u64, u32, u32)>,
    /// The new file's other records and newest ledger record, for its summary.
    others: Vec<Other>,
    ledger: Option<(u64, Vec<u8>)>,
}

/// What running a [`CompactJob`] produced.
pub struct CompactDone {
    id: u32,
    uid: u64,
    erases: u32,
    old_len: u64,
    seqs: Vec<u64>,
    others: Vec<Other>,
    ledger: Option<(u64, Vec<u8>)>,
    #[allow(clippy::type_complexity)]
    result: io::Result<(u64, Vec<u32>, Option<(u64, u32)>)>,
}

impl CompactJob {
    /// The segment being compacted.
    pub fn segment(&self) -> u32 {
        self.id
    }

    /// Writes the new segment and fsyncs it. Takes no lock and touches nothing the store
    /// uses (the old segment is sealed; it is only read).
    pub fn run(self) -> CompactDone {
        let result = self.write();
        CompactDone {
            id: self.id,
            uid: self.uid,
            erases: self.erases,
            old_len: self.old_len,
            seqs: self.copy.iter().map(|c| c.0).collect(),
            others: self.others,
            ledger: self.ledger,
            result,
        }
    }

    #[allow(clippy::type_complexity)]
    fn write(&self) -> io::Result<(u64, Vec<u32>, Option<(u64, u32)>)> {
        let old = self.fs.open(&self.dir.join(seg_name(self.id)), false)?;
        let tmp = self.dir.join(cmp_name(self.id));
        let mut out = self.fs.open(&tmp, true)?;
        out.truncate(0)?;
        let mut buf = self.prefix.clone();
        let mut at = 0u64;
        let mut offs = Vec::with_capacity(self.copy.len());
        let mut last = None;
        // The old records are read in large sequential pieces, not one read each.
        let mut win: Vec<u8> = Vec::new();
        let mut win_at = 0u64;
        for &(seq, off, len) in &self.copy {
            let (off, len) = (off as u64, (len & !HDR_FLAG) as u64);
            if off < win_at || off + len > win_at + win.len() as u64 {
                win_at = off;
                let n = len
                    .max(1 << 20)
                    .min(self.old_len.saturating_sub(off).max(len));
                win.resize(n as usize, 0);
                old.read_at(&mut win, off)?;
            }
            let rec = &win[(off - win_at) as usize..(off - win_at + len) as usize];
            match record::parse(rec) {
                Parse::Ok(r) if r.kind == Kind::Msg && r.seq == seq && r.len as u64 == len => {
                    let new_off = at + buf.len() as u64;
                    offs.push(new_off as u32);
                    last = Some((new_off, r.crc));
                    buf.extend_from_slice(rec);
                }
                // Damage is for the read path to find and report; leave this segment be.
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("record {seq} does not verify"),
                    ))
                }
            }
            if buf.len() >= 1 << 20 {
                out.write_at(&buf, at)?;
                at += buf.len() as u64;
                buf.clear();
            }
        }
        out.write_at(&buf, at)?;
        at += buf.len() as u64;
        out.sync()?;
        Ok((at, offs, last))
    }
}

impl FileStore {
    /// Plans the compaction of the sealed segment with the most dead bytes, if one is
    /// worth it. Run the job off the lock, then hand the result to [`compact_end`].
    ///
    /// Whatever the store wrote is synced first: a compaction only drops messages whose
    /// removal is durable (a rollback after a failed write must not find one gone).
    pub fn compact_begin(&mut self) -> Option<CompactJob> {
        if self.closed || self.failed.is_some() {
            return None;
        }
        // Cheap when nothing is pending: no write, no fsync.
        if self.sync().is_err() {
            return None;
        }
        let n = self.nsegs();
        let min = COMPACT_MIN.min(self.cfg.segment_size / 4);
        let mut best: Option<(u64, usize)> = None;
        for i in 0..n.saturating_sub(1) {
            let s = &self.segs()[i];
            if s.dirty || s.ix.live == 0 || !s.head || s.ix.no_compact {
                continue;
            }
            let used = HEADS_LEN as u64 + s.ix.live_bytes + 10 * s.ix.live as u64;
            let waste = s.flushed.saturating_sub(used);
            if waste >= min
                && waste * COMPACT_WASTE >= s.flushed
                && best.is_none_or(|b| waste > b.0)
            {
                best = Some((waste, i));
            }
        }
        let (_, i) = best?;
        let marker = self.marker;
        let (last_seq, last_ts) = {
            let c = self.core.get_mut();
            (c.last_seq, c.last_ts)
        };
        let t = &mut self.core.get_mut().slots;
        let entries: Vec<_> = t.entries(i).to_vec();
        let copy: Vec<(u64, u32, u32)> = entries
            .iter()
            .filter(|e| t.live_entry(i, e))
            .map(|e| (e.seq, e.off, e.len))
            .collect();
        let s = &t.segs[i];
        let (id, lo, hi, old_len) = (s.id, s.first, s.last, s.flushed);
        let (others, ledger) = (s.ix.others.clone().unwrap_or_default(), s.ix.ledger.clone());
        // The claim: which sequences of the range the new file holds.
        let mut bits = vec![0u8; ((hi - lo) / 8 + 1) as usize];
        for &(q, _, _) in &copy {
            let b = q - lo;
            bits[(b / 8) as usize] |= 1 << (b % 8);
        }
        let mut recs = Vec::new();
        record::encode(
            &mut recs,
            Kind::Claim,
            lo,
            0,
            b"",
            b"",
            &record::encode_claim(hi, &bits),
        );
        let mut kept = vec![Other::Claim { lo, hi, bits }];
        // Tombstones still needed (their records are in older segments), the highest
        // marker, the newest ledger.
        let mut max_marker: Option<(u64, i64, Option<u64>)> = None;
        for o in others {
            match o {
                Other::Tomb {
                    seq,
                    ts,
                    subj,
                    rlen,
                } => {
                    // Kept when its message is in another segment: an older one, or one
                    // whose torn erase left its record past that segment's entries (then
                    // the sequence falls in this segment's range with no entry here).
                    let elsewhere = seq < lo || !t.has_entry(i, seq);
                    if elsewhere && seq >= marker && t.has_record(seq) && t.get(seq).is_none() {
                        let body = rlen.to_le_bytes();
                        let data: &[u8] = if rlen == 0 { &[] } else { &body };
                        record::encode(&mut recs, Kind::Tomb, seq, ts, &subj, b"", data);
                        kept.push(Other::Tomb {
                            seq,
                            ts,
                            subj,
                            rlen,
                        });
                    }
                }
                Other::Marker { seq, ts, last } => {
                    if max_marker.is_none_or(|m| seq >= m.0) {
                        max_marker = Some((seq, ts, last));
                    }
                }
                Other::Erased { .. } | Other::Claim { .. } => {}
            }
        }
        if let Some((m, ts, last)) = max_marker {
            let body = last.map(|l| l.to_le_bytes().to_vec()).unwrap_or_default();
            record::encode(&mut recs, Kind::Marker, m, ts, b"", b"", &body);
            kept.push(Other::Marker { seq: m, ts, last });
        }
        let mut new_ledger = None;
        if let Some((_, d)) = &ledger {
            new_ledger = Some((HEADS_LEN as u64 + recs.len() as u64, d.clone()));
            record::encode(&mut recs, Kind::Ledger, 0, 0, b"", b"", d);
        }
        let body: u64 = copy.iter().map(|c| (c.2 & !HDR_FLAG) as u64).sum();
        let new_len = HEADS_LEN as u64 + recs.len() as u64 + body;
        let head = record::encode_head(&Head {
            pending: last_seq,
            ts: last_ts,
            created: self.syncs_done,
            synced: self.syncs_done,
            synced_seq: self.proven_seq,
            synced_len: new_len,
        });
        let mut prefix = Vec::with_capacity(HEADS_LEN + recs.len());
        prefix.extend_from_slice(&head);
        prefix.extend_from_slice(&head);
        prefix.extend_from_slice(&recs);
        let s = &self.segs()[i];
        let (uid, erases) = (s.ix.uid, s.erases);
        Some(CompactJob {
            fs: self.fs.clone(),
            dir: self.dir.clone(),
            id,
            uid,
            erases,
            old_len,
            prefix,
            copy,
            others: kept,
            ledger: new_ledger,
        })
    }

    /// Puts a compaction's new segment in place, if the segment did not change meanwhile.
    /// Returns the bytes it gave back.
    pub fn compact_end(&mut self, done: CompactDone) -> Result<u64> {
        let tmp = self.path(&cmp_name(done.id));
        let i = self.seg_by_id(done.id).filter(|&i| {
            let s = &self.core.get_mut().slots.segs[i];
            s.ix.uid == done.uid && s.erases == done.erases && !s.dirty
        });
        if done
            .result
            .as_ref()
            .is_err_and(|e| e.kind() == io::ErrorKind::InvalidData)
        {
            if let Some(i) = i {
                self.core.get_mut().slots.segs[i].ix.no_compact = true;
            }
        }
        let (Some(i), Ok((new_len, offs, last_rec))) = (i, done.result) else {
            let _ = self.fs.remove(&tmp);
            // The segment stays as it is; its entries leave memory again.
            if let Some(i) = self.seg_by_id(done.id) {
                if i + 1 < self.nsegs() {
                    self.core.get_mut().slots.seal(i);
                }
            }
            return Ok(0);
        };
        let id = done.id;
        self.rewrites += 1;
        if let Err(e) = self.fs.rename(&tmp, &self.path(&seg_name(id))) {
            let _ = self.fs.remove(&tmp);
            return Err(e.into());
        }
        // The old file's descriptor must not be used again.
        self.files.get_mut().forget(id);
        self.dir_dirty = true;
        let t = &mut self.core.get_mut().slots;
        let old: Vec<_> = t.entries(i).to_vec();
        let mut kept = Vec::with_capacity(offs.len());
        let mut k = 0;
        for e in old {
            if k < done.seqs.len() && e.seq == done.seqs[k] {
                let mut e = e;
                e.off = offs[k];
                kept.push(e);
                k += 1;
            }
        }
        t.rewrite(i, kept, done.others, done.ledger);
        let created = self.syncs_done;
        let s = &mut self.segs()[i];
        s.flushed = new_len;
        s.alloc = new_len;
        s.done_len = Some(new_len);
        s.proven_len = new_len;
        s.last_rec = last_rec;
        s.head = true;
        s.created = created;
        s.next_slot = 0;
        self.core.get_mut().slots.seal(i);
        Ok(done.old_len.saturating_sub(new_len))
    }

    /// Compacts every segment worth it, here and now (tests, tools).
    pub fn compact_now(&mut self) -> Result<u64> {
        let mut freed = 0;
        while let Some(job) = self.compact_begin() {
            let id = job.segment();
            freed += self.compact_end(job.run())?;
            // A segment that could not be rewritten is not planned again at once.
            if self
                .t()
                .seg_by_id(id)
                .is_some_and(|i| self.t().segs[i].ix.idx_dirty)
            {
                break;
            }
        }
        Ok(freed)
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
            || record::record_len(subject.len(), hdr.len(), data.len()) > record::MAX_RECORD
        {
            return Err(StoreError::MsgTooLarge);
        }
        let size = file_msg_size(subject.len(), hdr.len(), data.len());
        let core = self.core.get_mut();
        core.check(subject, hdr.len(), data.len(), size)?;
        let seq = core.last_seq + 1;
        let r = self.append(Kind::Msg, seq, ts, subject, hdr, data);
        let (idx, loc) = self.check_io(r)?;
        self.segs()[idx].note_msg(seq);
        let got = self
            .core
            .get_mut()
            .append(subject, ts, size, !hdr.is_empty(), loc);
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

    /// The marker is written as the last record of every sync that writes anything once a
    /// marker was set (with the stretches of records that sync wrote). The first call syncs
    /// (so it fails while a sync is in progress) and creates `applied.flag`, so that opening
    /// knows to look for markers.
    fn set_applied(&mut self, marker: &[u8]) -> Result<()> {
        crate::check_applied(marker)?;
        if self.applied.is_none() {
            // First use: everything so far durable, then the flag, then a first applied
            // record (empty marker) for that state. A crash in between finds the flag and no
            // applied record, with nothing written after the first sync: nothing to cut.
            self.sync()?;
            let r = (|| {
                drop(self.fs.open(&self.path(APPLIED_FLAG), true)?);
                self.fs.sync_dir(&self.dir)
            })();
            r?;
            self.applied = Some(Vec::new());
            // A replica's sequences come from its group's log: it keeps no reservation.
            self.keeps_reserve = false;
            self.sync()?;
        }
        self.applied = Some(marker.to_vec());
        Ok(())
    }

    fn applied(&self) -> Vec<u8> {
        self.applied.clone().unwrap_or_default()
    }

    fn discard_unsynced(&mut self) -> Result<()> {
        if self.closed {
            return Err(StoreError::Io("store is closed".into()));
        }
        if self.in_flight.is_some() {
            return Err(StoreError::Io("a sync is in progress".into()));
        }
        self.failed
            .get_or_insert_with(|| "discarding the writes since the last sync".into());
        self.rollback()
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

    fn has_lost(&self) -> bool {
        !self.lost.borrow().is_empty()
    }

    fn needs_sync(&self) -> bool {
        (self.ledger_dirty.get()
            || !self.t().missing.borrow().is_empty()
            || !self.t().unsure.borrow().is_empty())
            && self.failed.is_none()
            && !self.closed
    }

    fn load(&self, seq: u64) -> Result<StoredMsg> {
        self.load_found(Some(seq))
    }

    fn load_next(&self, start: u64, filter: &str) -> Result<StoredMsg> {
        self.next_from(start, filter, None)
    }

    fn load_next_ahead(&self, start: u64, filter: &str, ra: &mut ReadAhead) -> Result<StoredMsg> {
        self.next_from(start, filter, Some(ra))
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
        self.t().get(seq).map(|m| (m.ts, m.hdr))
    }

    fn prev_with_headers(&self, before: u64, min_ts: i64) -> Option<(u64, i64)> {
        self.t().prev_with_headers(before, min_ts)
    }

    fn next_with_headers(&self, from: u64) -> Option<u64> {
        self.t().next_with_headers(from)
    }

    fn remove(&mut self, seq: u64, erase: bool) -> Result<bool> {
        self.writable()?;
        let Some((_, loc)) = self.t().loc(seq) else {
            return Ok(false);
        };
        let core = self.core.get_mut();
        if !core.remove(seq) {
            return Ok(false);
        }
        let r = (|| {
            if erase {
                // The tombstone is made durable before the overwrite: a torn overwrite then
                // reads as a removed message at recovery, never as a lost one.
                let x = self.core.get_mut().removed.pop();
                self.core.get_mut().removed.clear();
                if let Some(x) = x {
                    self.write_tomb(seq, x.meta.ts, &x.subject, x.p.len)?;
                }
                self.do_sync()?;
                if self.applied.is_some() {
                    // One more applied record, so the newest one's stretches never hold the
                    // overwritten record: a torn overwrite must not make recovery distrust
                    // it (and go back past the erase's own sync).
                    self.applied_written = None;
                    self.do_sync()?;
                }
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
            self.write_tomb(next - 1, ts, b"", 0)
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
        // Closed, it writes nothing more: another instance may open the directory. (A
        // failed close keeps it: a later sync would roll back, writing.)
        self.owner = None;
        Ok(())
    }

    fn compact_begin(&mut self) -> Option<CompactJob> {
        FileStore::compact_begin(self)
    }

    fn compact_end(&mut self, done: CompactDone) -> Result<u64> {
        FileStore::compact_end(self, done)
    }

    fn destroy(mut self: Box<Self>) -> Result<()> {
        self.closed = true;
        self.files.get_mut().clear();
        self.segs().clear();
        self.fs.remove_dir_all(&self.dir)?;
        Ok(())
    }
}

// ---- recovery -------------------------------------------------------------------------

/// Replays records (and segment summaries) into a fresh core.
struct Replay {
    core: Core<FileTable>,
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
    /// The newest ledger record: each holds the whole ledger.
    ledger: Option<Ledger>,
    records: u64,
    /// Sequences compactions' claims say were removed.
    compacted: Ranges,
}

/// What scanning one segment found besides records: damaged stretches followed by valid
/// records, and where the valid records end if garbage follows.
#[derive(Default)]
struct ScanOut {
    spans: Vec<Span>,
    tail: Option<u64>,
    /// Where the tail's non-zero bytes end (preallocated zeros after it are free space).
    tail_end: u64,
    /// Where zeros run to the end of the file: free space a preallocation left.
    zero_from: Option<u64>,
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
    fn cur(&mut self) -> &mut Seg {
        self.core
            .slots
            .segs
            .last_mut()
            .expect("a segment is being replayed")
    }

    /// Removes a tombstoned message: by what the tombstone says about it when it says (no
    /// entry read), else by its entry.
    fn apply_tomb(&mut self, t: u64, ts: i64, subj: &[u8], rlen: u32) {
        if !subj.is_empty() && rlen != 0 {
            if let Some(id) = self.core.subjects().id(subj) {
                let m = Meta {
                    subj: id,
                    ts,
                    size: acct(rlen),
                    hdr: rlen & HDR_FLAG != 0,
                };
                if self.core.slots.kill(t, &m) {
                    self.core.account_removed(t, &m);
                }
            }
        } else {
            self.core.remove(t);
        }
        self.core.removed.clear();
        if t > self.max_msg.0 {
            self.max_msg = (t, ts);
        }
        self.tombs.push(t);
    }

    fn apply_marker(&mut self, m: u64, ts: i64, last: Option<u64>) {
        if m > self.marker {
            self.marker = m;
            self.kill_range(0, m - 1);
        }
        if let Some(last) = last {
            if last >= self.marker_last.0 {
                self.marker_last = (last, ts);
            }
        }
    }

    /// Removes every live message in `lo..=hi`: whole segments at once by their counts,
    /// the rest one by one.
    fn kill_range(&mut self, lo: u64, hi: u64) {
        let n = self.core.slots.segs.len();
        for si in 0..n {
            let ix = &self.core.slots.segs[si].ix;
            if ix.n == 0 || ix.live == 0 || ix.e_last < lo {
                continue;
            }
            if ix.e_first > hi {
                break;
            }
            if ix.e_first >= lo && ix.e_last <= hi {
                let (msgs, bytes) = self.core.slots.kill_all(si);
                self.core.msgs = self.core.msgs.saturating_sub(msgs);
                self.core.bytes = self.core.bytes.saturating_sub(bytes);
                continue;
            }
            let (a, b) = (lo.max(ix.e_first), hi.min(ix.e_last));
            let mut v = Vec::new();
            self.core.slots.scan(a, b, &Sel::All, &mut |q, _| {
                v.push(q);
                true
            });
            for q in v {
                self.core.remove(q);
            }
        }
        self.core.removed.clear();
    }

    /// A compaction's claim: its range belongs to this segment, and what the bitmap does
    /// not hold was removed.
    fn apply_claim(&mut self, lo: u64, hi: u64, bits: &[u8]) {
        let s = self.cur();
        s.note_msg(lo);
        s.note_msg(hi);
        let mut run: Option<u64> = None;
        for q in lo..=hi.saturating_add(1) {
            let b = q - lo;
            let gone = q <= hi
                && bits
                    .get((b / 8) as usize)
                    .is_some_and(|x| x >> (b % 8) & 1 == 0);
            match (gone, run) {
                (true, None) => run = Some(q),
                (false, Some(a)) => {
                    self.compacted.insert(a, q - 1);
                    run = None;
                }
                _ => {}
            }
        }
    }

    fn apply(&mut self, r: &record::Rec, off: usize) {
        if r.kind == Kind::Head {
            // Only meaningful at offset 0, which is read separately.
            return;
        }
        self.records += 1;
        self.cur().last_rec = Some((off as u64, r.crc));
        match r.kind {
            Kind::Msg | Kind::Erased => {
                self.cur().note_msg(r.seq);
                if r.seq >= self.max_msg.0 {
                    self.max_msg = (r.seq, r.ts);
                }
                let flag = if r.hdr.is_empty() { 0 } else { HDR_FLAG };
                let loc = Loc {
                    off: off as u32,
                    len: r.len as u32 | flag,
                };
                // The same sequence twice can only follow damage or a restored file: the
                // first one found stands.
                if !self.core.slots.accepts(r.seq) {
                    return;
                }
                if r.kind == Kind::Msg && r.seq >= self.marker {
                    self.core
                        .insert(r.seq, r.subj, r.ts, acct(loc.len), !r.hdr.is_empty(), loc);
                } else {
                    // An entry that is not live keeps the segment's positions dense.
                    self.core.slots.insert_erased(r.seq, r.ts, loc);
                    if r.kind == Kind::Erased {
                        self.tombs.push(r.seq);
                        self.core.slots.note_other(Other::Erased { seq: r.seq });
                    }
                }
            }
            Kind::Tomb => {
                let rlen = if r.data.len() == 4 {
                    u32::from_le_bytes(r.data.try_into().unwrap())
                } else {
                    0
                };
                self.core.slots.note_other(Other::Tomb {
                    seq: r.seq,
                    ts: r.ts,
                    subj: Bytes::copy_from_slice(r.subj),
                    rlen,
                });
                self.apply_tomb(r.seq, r.ts, r.subj, rlen);
            }
            Kind::Marker => {
                let last =
                    (r.data.len() == 8).then(|| u64::from_le_bytes(r.data.try_into().unwrap()));
                self.core.slots.note_other(Other::Marker {
                    seq: r.seq,
                    ts: r.ts,
                    last,
                });
                self.apply_marker(r.seq, r.ts, last);
            }
            Kind::Ledger => {
                if let Some(l) = record::decode_ledger(r.data) {
                    self.ledger = Some(l);
                    self.core.slots.note_ledger(off as u64, r.data.to_vec());
                }
            }
            Kind::Claim => {
                if let Some((hi, bits)) = record::decode_claim(r.seq, r.data) {
                    self.core.slots.note_other(Other::Claim {
                        lo: r.seq,
                        hi,
                        bits: bits.to_vec(),
                    });
                    self.apply_claim(r.seq, hi, bits);
                }
            }
            Kind::Head | Kind::Applied => {}
        }
        self.core.removed.clear();
    }

    /// Adds a segment from its index file's summary instead of reading its records.
    fn bulk(&mut self, mut seg: Seg, sum: &Summary, active: bool, out: &mut ScanOut) {
        seg.last_rec = sum.last_rec;
        if sum.n > 0 {
            seg.note_msg(sum.e_first);
            seg.note_msg(sum.e_last);
            if sum.e_last >= self.max_msg.0 {
                self.max_msg = (sum.e_last, sum.last_ts);
            }
        }
        let was_empty = self.core.msgs == 0;
        let (live, bytes) = self.core.slots.push_summary(seg, sum, sum.blocks_off);
        let c = &mut self.core;
        c.msgs += live;
        c.bytes += bytes;
        if live > 0 {
            if was_empty || sum.e_first < c.first_seq {
                c.first_seq = sum.e_first;
                c.first_ts = sum.first_ts;
            }
            if sum.e_last >= c.last_seq {
                c.last_seq = sum.e_last;
                c.last_ts = sum.last_ts;
            }
        }
        if sum.n > 0 && self.marker > sum.e_first {
            self.kill_range(0, self.marker - 1);
        }
        for o in &sum.others {
            match o {
                Other::Tomb {
                    seq,
                    ts,
                    subj,
                    rlen,
                } => {
                    out.max_tomb = out.max_tomb.max(*seq);
                    self.apply_tomb(*seq, *ts, subj, *rlen);
                }
                Other::Marker { seq, ts, last } => self.apply_marker(*seq, *ts, *last),
                Other::Erased { seq } => {
                    self.tombs.push(*seq);
                    if *seq >= self.max_msg.0 {
                        self.max_msg.0 = *seq;
                    }
                }
                Other::Claim { lo, hi, bits } => self.apply_claim(*lo, *hi, bits),
            }
        }
        if let Some((_, d)) = &sum.ledger {
            if let Some(l) = record::decode_ledger(d) {
                self.ledger = Some(l);
            }
        }
        // Kept while records after the summary may still be appended to it (the caller
        // drops them otherwise): its next summary lists them all.
        let _ = active;
        let s = self.cur();
        s.ix.others = Some(sum.others.clone());
        s.ix.ledger = sum.ledger.clone();
    }

    /// Scans `data`, which holds the last segment from file offset `base` on.
    fn scan(&mut self, data: &[u8], base: u64, out: &mut ScanOut) {
        let mut o = 0;
        let mut before = {
            let s = self.cur();
            if s.has_msgs() {
                s.last
            } else {
                s.first - 1
            }
        };
        let mut open = Vec::new();
        while o < data.len() {
            if let Parse::Ok(r) = record::parse(&data[o..]) {
                self.apply(&r, base as usize + o);
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
            // Zeros to the end: the free part of a preallocated file.
            let nz = data[o..].iter().rposition(|&b| b != 0);
            let Some(nz) = nz else {
                out.zero_from = Some(base + o as u64);
                break;
            };
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
                    // A long run of zeros at the end is preallocated space, not damage.
                    let zeros = data.len() - (o + nz + 1);
                    out.tail_end = if zeros > PREALLOC as usize / 16 {
                        base + (o + nz + 1) as u64
                    } else {
                        base + data.len() as u64
                    };
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

/// Does the index file's summary still describe segment `m`?
fn summary_fits(
    sum: &Summary,
    m: &SegMeta,
    files: &mut Handles,
    fs: &dyn Fs,
    seg_path: &dyn Fn(u32) -> PathBuf,
) -> std::result::Result<(), String> {
    if sum.id != m.id {
        return Err("it names another segment".into());
    }
    if sum.created != m.head.map_or(0, |h| h.created) {
        return Err("the segment was created again since".into());
    }
    if m.len < sum.covered {
        return Err("the segment is shorter than the index covers".into());
    }
    match sum.last_rec {
        None if sum.covered <= HEADS_LEN as u64 => Ok(()),
        None => Err("no last record".into()),
        Some((off, crc)) => {
            if off >= sum.covered || sum.covered - off > record::MAX_RECORD as u64 {
                return Err("bad last record offset".into());
            }
            let mut b = vec![0; (sum.covered - off) as usize];
            files
                .with(fs, m.id, || seg_path(m.id), |f| f.read_at(&mut b, off))
                .map_err(|e| e.to_string())?;
            // Damage kept after a segment's last record is covered too.
            match record::parse(&b) {
                Parse::Ok(r) if r.crc == crc => Ok(()),
                _ => Err("the segment changed since the index".into()),
            }
        }
    }
}

/// Created (durably) when a store first gets an applied marker: only such a store looks
/// for applied records at open (the others never pay for the scan).
const APPLIED_FLAG: &str = "applied.flag";

/// The applied record a store goes back to at open.
pub(crate) struct AppliedAt {
    seg: u32,
    /// Where the record ends.
    end: u64,
    marker: Vec<u8>,
    last_seq: u64,
    last_ts: i64,
    /// Records or segments follow it (written after its sync).
    beyond: bool,
}

/// The newest applied record whose listed stretches are all intact records (so everything
/// its sync wrote is on disk), looking from the newest segment back. Reads only segment
/// files, before recovery changes them.
fn find_applied(fs: &dyn Fs, dir: &Path) -> io::Result<Option<AppliedAt>> {
    let mut ids: Vec<u32> = fs
        .list(dir)?
        .iter()
        .filter_map(|n| parse_seg_name(n))
        .collect();
    ids.sort_unstable();
    // Each segment read once (shared, not copied: segments are megabytes).
    let mut files: BTreeMap<u32, Option<Arc<Vec<u8>>>> = BTreeMap::new();
    let mut read = |id: u32| -> io::Result<Option<Arc<Vec<u8>>>> {
        if let Some(d) = files.get(&id) {
            return Ok(d.clone());
        }
        let d = match fs.open(&dir.join(seg_name(id)), false) {
            Ok(f) => {
                let mut b = vec![0; f.len()? as usize];
                f.read_at(&mut b, 0)?;
                Some(Arc::new(b))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        files.insert(id, d.clone());
        Ok(d)
    };
    for (k, &id) in ids.iter().enumerate().rev() {
        let Some(data) = read(id)? else { continue };
        // (offset, record length) of each applied record, and whether a record follows.
        let mut found: Vec<(usize, usize, bool)> = Vec::new();
        let mut o = match record::parse_head(&data) {
            HeadParse::None => 0,
            _ => HEADS_LEN.min(data.len()),
        };
        while o < data.len() {
            match record::parse(&data[o..]) {
                Parse::Ok(r) => {
                    if let Some(last) = found.last_mut() {
                        last.2 = true;
                    }
                    if r.kind == Kind::Applied {
                        found.push((o, r.len, false));
                    }
                    o += r.len;
                }
                Parse::Bad => match record::resync(&data, o + 1) {
                    Some(n) => o = n,
                    None => break,
                },
            }
        }
        for &(off, len, followed) in found.iter().rev() {
            let Parse::Ok(r) = record::parse(&data[off..]) else {
                continue;
            };
            let Some((marker, spans)) = decode_applied(r.data) else {
                continue;
            };
            let mut intact = true;
            for (sid, from, to) in spans {
                let whole = if sid == id {
                    Some(data.clone())
                } else {
                    read(sid)?
                };
                let to = if sid == id { to.min(off as u64) } else { to };
                if !whole.is_some_and(|d| records_between(&d, from, to)) {
                    intact = false;
                    break;
                }
            }
            if intact {
                return Ok(Some(AppliedAt {
                    seg: id,
                    end: (off + len) as u64,
                    marker,
                    last_seq: r.seq,
                    last_ts: r.ts,
                    // A torn write after it counts too (its header may claim a sequence).
                    beyond: followed
                        || data[off + len..].iter().any(|&b| b != 0)
                        || k + 1 < ids.len(),
                }));
            }
        }
    }
    Ok(None)
}

/// (segment id, from, to): records a sync wrote.
type Written = (u32, u64, u64);

/// (marker, stretches) of an applied record's body, if well formed.
fn decode_applied(d: &[u8]) -> Option<(Vec<u8>, Vec<Written>)> {
    let ml = *d.first()? as usize;
    let marker = d.get(1..1 + ml)?.to_vec();
    let mut o = 1 + ml;
    let n = u32::from_le_bytes(d.get(o..o + 4)?.try_into().ok()?) as usize;
    o += 4;
    if d.len() != o + n.checked_mul(20)? {
        return None;
    }
    let mut spans = Vec::with_capacity(n);
    for _ in 0..n {
        let id = u32::from_le_bytes(d[o..o + 4].try_into().ok()?);
        let from = u64::from_le_bytes(d[o + 4..o + 12].try_into().ok()?);
        let to = u64::from_le_bytes(d[o + 12..o + 20].try_into().ok()?);
        spans.push((id, from, to));
        o += 20;
    }
    Some((marker, spans))
}

/// Is `d[from..to]` a run of valid records ending exactly at `to`? A compacted segment
/// (it starts with a claim) counts as intact: compaction only rewrites synced data.
fn records_between(d: &[u8], from: u64, to: u64) -> bool {
    if let Parse::Ok(r) = record::parse(d.get(HEADS_LEN..).unwrap_or(&[])) {
        if r.kind == Kind::Claim {
            return true;
        }
    }
    let (mut o, to) = (from as usize, to as usize);
    if to > d.len() || o > to {
        return false;
    }
    while o < to {
        match record::parse(&d[o..to]) {
            Parse::Ok(r) => o += r.len,
            Parse::Bad => return false,
        }
    }
    o == to
}

fn recover(
    fs: Arc<dyn Fs>,
    dir: &Path,
    cfg: FileStoreConfig,
    keeps_reserve: bool,
) -> Result<(FileStore, RecoveryReport)> {
    fs.create_dir_all(dir)?;
    let names = fs.list(dir)?;
    let existing: HashSet<String> = names.iter().cloned().collect();
    let mut ids: Vec<u32> = names.iter().filter_map(|n| parse_seg_name(n)).collect();
    ids.sort_unstable();
    let mut rep = RecoveryReport::default();
    // The segment the reservation names, or a newer one, must be here: else the newest
    // segments are gone, and with them the proof of how far sequences went.
    let (reservation, reserve_slot) = if keeps_reserve {
        reserve::read(&*fs, dir)
    } else {
        (None, 0)
    };
    let missing = reservation.filter(|r| ids.last().is_none_or(|&n| n < r.segment));
    // Files of earlier versions and leftovers: an index file without its segment.
    for n in [LEGACY_INDEX, LEGACY_INDEX_TMP] {
        if existing.contains(n) {
            let _ = fs.remove(&dir.join(n));
        }
    }
    for n in &names {
        if let Some(id) = parse_idx_name(n) {
            if ids.binary_search(&id).is_err() {
                let _ = fs.remove(&dir.join(n));
            }
        }
        // A compaction that never got renamed into place.
        if n.ends_with(".cmp") {
            let _ = fs.remove(&dir.join(n));
        }
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

    let mut rp = Replay {
        core: Core::new(
            Limits::default(),
            FileTable::new(
                fs.clone(),
                dir.to_path_buf(),
                cfg.index_cache.as_ref().map_or_else(
                    || IndexCache::new(crate::DEFAULT_INDEX_CACHE),
                    |c| c.0.clone(),
                ),
            ),
        ),
        marker: 0,
        max_msg: (0, 0),
        marker_last: (0, 0),
        tombs: Vec::new(),
        gone: Ranges::default(),
        lost: Ranges::default(),
        lost_bytes: 0,
        ledger: None,
        records: 0,
        compacted: Ranges::default(),
    };
    // What the index files written at a clean close say was durable.
    let mut closed_last: Option<(u64, i64)> = None;
    let mut scans = Vec::with_capacity(metas.len());
    // Per segment: read from its records (verified), or taken from its index file.
    let mut scanned = Vec::with_capacity(metas.len());
    // Per segment: how much an index file covered (read back intact, so durable).
    let mut covered = Vec::with_capacity(metas.len());
    let mut rejected = Vec::new();
    let nmetas = metas.len();
    for (k, m) in metas.iter().enumerate() {
        let base = rp.core.slots.segs.last().map_or(0, |s| s.last);
        let mut seg = Seg::new(m.id, base);
        seg.flushed = m.len;
        seg.alloc = m.len;
        seg.head = m.has_head;
        seg.created = m.head.map_or(0, |h| h.created);
        seg.done_len = Some(m.len);
        seg.next_slot = m.next_slot;
        let mut start = if m.has_head { HEADS_LEN as u64 } else { 0 };
        if m.stub {
            start = m.len;
        }
        let active = k + 1 == nmetas;
        let mut out = ScanOut::default();
        let mut summary = None;
        if !m.stub {
            match read_summary(&*fs, &dir.join(idx_name(m.id))) {
                Ok(Some(sum)) => {
                    if let Some(c) = sum.closed {
                        if closed_last.is_none_or(|(l, _)| c.0 > l) {
                            closed_last = Some(c);
                        }
                    }
                    match summary_fits(&sum, m, &mut files, &*fs, &seg_path) {
                        Ok(()) if sum.n == 0 || rp.core.slots.accepts(sum.e_first) => {
                            summary = Some(sum)
                        }
                        Ok(()) => rejected.push(format!("segment {}: out of order", m.id)),
                        Err(why) => rejected.push(format!("segment {}: {why}", m.id)),
                    }
                }
                Ok(None) => {}
                Err(e) => rejected.push(format!("segment {}: {e}", m.id)),
            }
        }
        match &summary {
            Some(sum) => {
                rep.used_index = true;
                start = start.max(sum.covered);
                rp.bulk(seg, sum, active, &mut out);
            }
            None => rp.core.slots.push_seg(seg),
        }
        if start < m.len {
            let mut data = vec![0; (m.len - start) as usize];
            files.with(
                &*fs,
                m.id,
                || seg_path(m.id),
                |f| f.read_at(&mut data, start),
            )?;
            rp.scan(&data, start, &mut out);
        }
        // Free space a preallocation left is not part of the segment's records.
        if let Some(z) = out.zero_from {
            rp.cur().flushed = z;
            // Where the records end is what the last sync left (an applied record lists
            // the next sync's records from here).
            rp.cur().done_len = Some(z);
        }
        if !active && !rp.cur().in_memory() {
            let s = rp.cur();
            s.ix.others = None;
            s.ix.ledger = None;
        }
        scanned.push(summary.is_none());
        covered.push(summary.as_ref().map_or(0, |s| s.covered));
        // A sealed segment read cleanly gets its index file now, and its entries leave
        // memory (a large store read after a power failure must not hold them all).
        if !active && summary.is_none() && out.tail.is_none() && out.spans.is_empty() {
            let i = rp.core.slots.segs.len() - 1;
            rp.core.slots.seal(i);
        }
        scans.push(out);
    }
    if !rejected.is_empty() {
        rep.index_rejected = Some(rejected.join("; "));
    }

    if let Some(l) = rp.ledger.take() {
        for (a, b) in l.gone {
            rp.gone.insert(a, b);
        }
        for (a, b) in l.lost {
            rp.lost.insert(a, b);
        }
        rp.lost_bytes = l.lost_bytes;
    }

    // What the heads and the index files prove: the highest sequence handed out, the last
    // one a completed sync made durable, and how much of each segment was durable.
    let heads: Vec<Head> = metas.iter().filter_map(|m| m.head).collect();
    let synced_max = heads.iter().map(|h| h.synced).max().unwrap_or(0);
    let mut synced_seq = heads.iter().map(|h| h.synced_seq).max().unwrap_or(0);
    let (mut hw, mut hw_ts) = heads
        .iter()
        .max_by_key(|h| h.pending)
        .map_or((0, 0), |h| (h.pending, h.ts));
    if let Some((l, ts)) = closed_last {
        synced_seq = synced_seq.max(l);
        if l > hw {
            (hw, hw_ts) = (l, ts);
        }
    }
    // Per segment: the length a completed sync is known to have fsynced (an index file
    // read back intact may still be in the page cache only, after a kill).
    let mut fsynced = vec![0u64; metas.len()];
    {
        let segs = &mut rp.core.slots.segs;
        for k in 0..metas.len() {
            let m = &metas[k];
            let mut proven = m.head.map_or(0, |h| h.synced_len);
            // A sync completed after a later segment was created covered all of this one.
            let later = metas[k + 1..]
                .iter()
                .filter_map(|n| n.head.map(|h| h.created))
                .min();
            if later.is_some_and(|c| synced_max > c) {
                proven = m.len;
            }
            fsynced[k] = proven;
            // What an index file covered was read back intact.
            proven = proven.max(covered[k]);
            segs[k].proven_len = proven.min(m.len);
        }
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
    let nsegs = rp.core.slots.segs.len();
    let mut cuts: Vec<(usize, u64)> = Vec::new();
    for (k, out) in scans.iter().enumerate() {
        let (id, proven) = {
            let s = &rp.core.slots.segs[k];
            (s.id, s.proven_len)
        };
        // (offset, length, is the tail, what it hides: the message sequences between the
        // records around it).
        type Hides = Option<(u64, u64)>;
        let mut spans: Vec<(u64, u64, bool, Hides)> = Vec::new();
        for sp in &out.spans {
            let hides = sp
                .after
                .filter(|&a| a > sp.before + 1)
                .map(|a| (sp.before + 1, a - 1));
            spans.push((sp.off, sp.len, false, hides));
        }
        if let Some(t) = out.tail {
            spans.push((t, out.tail_end - t, true, None));
        }
        for (off, n, is_tail, hides) in spans {
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
            // Zeros after the records are preallocated space.
            if record::only_torn_erases(&bytes, |q| {
                q < rp.marker || rp.tombs.binary_search(&q).is_ok() || rp.gone.contains(q)
            }) {
                // An erase interrupted mid-overwrite: the message was removed (its
                // tombstone is durable) and its bytes are meant to go, not to be kept.
                // They held only removed records, so they hide no other sequence.
                if is_tail && k == nsegs - 1 {
                    cuts.push((k, off));
                }
                continue;
            }
            if let Some((a, b)) = hides {
                written.insert(a, b);
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
        let id = rp.core.slots.segs[k].id;
        files.with(
            &*fs,
            id,
            || seg_path(id),
            |f| {
                f.truncate(at)?;
                f.sync()
            },
        )?;
        let s = &mut rp.core.slots.segs[k];
        s.flushed = at;
        s.alloc = at;
        s.done_len = Some(at);
        s.proven_len = s.proven_len.min(at);
    }

    // Final stream counters. last_seq is never below what the heads or the index files
    // prove was handed out.
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
    // What the missing segments held is unknown: every sequence up to the reservation is
    // taken to be used (gone with them, in the ledger), none handed out again.
    let mut missing_gone = None;
    if let Some(r) = missing.filter(|r| r.upto > ls) {
        rep.segments_missing = Some((ls + 1, r.upto));
        rp.gone.insert(ls + 1, r.upto);
        missing_gone = Some((ls + 1, r.upto));
        ls = r.upto;
    }
    let removed_below = rp.marker;
    // Sequences of deleted segments stay removed, even if a file came back.
    for (a, b) in rp.gone.iter().collect::<Vec<_>>() {
        rp.kill_range(a, b);
    }
    // A lost sequence whose record was read back intact (a restored file) is not lost
    // after all; one an index file calls live was never checked, and stays lost.
    let mut lost = Ranges::default();
    for (a, b) in rp.lost.iter().collect::<Vec<_>>() {
        let mut at = a;
        let mut live = Vec::new();
        rp.core.slots.scan(a, b, &Sel::All, &mut |q, _| {
            live.push(q);
            true
        });
        for s in live {
            let verified = rp.core.slots.seg_of(s).is_some_and(|i| scanned[i]);
            if !verified {
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
    let from = removed_below.max(1);
    let mut lost_new = Ranges::default();
    let mut unacked = Ranges::default();
    let mut gone_new = Ranges::default();
    if let Some((a, b)) = missing_gone {
        gone_new.insert(a, b);
    }
    if from <= ls {
        let mut acc = Ranges::default();
        for (a, b) in to_ranges(rp.tombs.iter().copied()) {
            acc.insert(a, b);
        }
        acc.union(&rp.gone);
        acc.union(&lost);
        acc.union(&rp.compacted);
        for (a, b) in rp.core.slots.holes(from, ls) {
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
                    lost_new.insert(x, y2);
                }
            }
        }
    }
    // Damaged bytes count as lost where their segment lost a sequence.
    for (k, n) in new_damage {
        let s = &rp.core.slots.segs[k];
        if lost_new.intersects(s.first, s.last) {
            rp.lost_bytes += n;
        }
    }
    let ledger_changed = !lost_new.is_empty() || !unacked.is_empty() || !gone_new.is_empty();
    lost.union(&lost_new);
    rp.gone.union(&unacked);
    gone_new.union(&unacked);
    rep.lost = lost_new.iter().collect();
    rep.unacked = unacked.iter().collect();

    // Segment ranges are contiguous up to last_seq and `last` is monotonic: a sequence
    // whose record is damaged or gone still belongs to a segment, so a tombstone for it is
    // kept, and the ledger covers it once that segment is deleted.
    // A sequence between two segments' messages belongs to the earlier one if that one
    // ends in damage or tombstones it (its message came before the tombstone), else to
    // the later one.
    {
        let segs = &mut rp.core.slots.segs;
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
    }
    let c = &mut rp.core;
    c.last_seq = ls;
    c.last_ts = lts;
    match c.slots.next_live(0, ls) {
        Some(f) => {
            c.first_seq = f;
            c.first_ts = c.slots.get(f).map_or(0, |m| m.ts);
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
    rep.records_scanned = rp.records;
    // Segments read with damage or cuts get their index files now, from what was read.
    let nsegs = rp.core.slots.segs.len();
    for i in 0..nsegs.saturating_sub(1) {
        if rp.core.slots.segs[i].in_memory() {
            rp.core.slots.seal(i);
        }
    }

    let emptied: Vec<u32> = rp
        .core
        .slots
        .segs
        .iter()
        .filter(|s| s.ix.live == 0)
        .map(|s| s.id)
        .collect();
    rp.core.slots.emptied = emptied;
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
        files: RefCell::new(files),
        wbuf: Vec::new(),
        marker: rp.marker,
        marker_done: rp.marker,
        // A kill leaves directory entries in the page cache only (a segment rolled to and
        // never synced): the first sync makes the directory durable before any write in
        // those segments is acknowledged, or a power loss after could take them.
        dir_dirty: true,
        dirty: Vec::new(),
        failed: None,
        owner: None,
        closed: false,
        in_flight: None,
        gone: rp.gone,
        lost: RefCell::new(lost),
        lost_bytes: Cell::new(rp.lost_bytes),
        ledger_dirty: Cell::new(ledger_changed),
        syncs_done,
        done_seq: ls,
        done_ts: lts,
        proven_seq: synced_seq.min(ls),
        applied: None,
        applied_written: None,
        applied_done: None,
        rewrites: 0,
        ident: Arc::new(()),
        observer: None,
        reserve: reservation,
        reserve_slot,
        reserve_file: None,
        keeps_reserve,
    };
    // What a kill left in the page cache only (past what a completed sync proved) is kept:
    // the first sync makes it durable before anything after it can be acknowledged (or
    // served), as a power failure after would otherwise take it.
    for (i, &len) in fsynced.iter().enumerate().take(store.nsegs()) {
        if len < store.segs()[i].flushed {
            store.mark_dirty(i);
        }
    }
    // The active segment needs a head slot, which every sync rewrites, and its entries
    // in memory.
    let r = (|| -> io::Result<()> {
        let n = store.nsegs();
        let last = (n > 0).then(|| {
            let s = &store.segs()[n - 1];
            (s.flushed, s.head, s.id)
        });
        match last {
            None => store.roll()?,
            Some((flushed, _, id)) if last_stub && flushed < HEADS_LEN as u64 => {
                let i = n - 1;
                let mut seg_head = store.head_of(i);
                seg_head.created = store.syncs_done;
                let h = record::encode_head(&seg_head);
                let both = [&h[..], &h[..]].concat();
                store.with_file(id, |f| {
                    f.truncate(0)?;
                    f.write_at(&both, 0)
                })?;
                let s = &mut store.segs()[i];
                s.flushed = HEADS_LEN as u64;
                s.alloc = HEADS_LEN as u64;
                s.head = true;
                s.created = seg_head.created;
                s.done_len = Some(HEADS_LEN as u64);
                s.next_slot = 0;
                store.mark_dirty(i);
            }
            Some((_, false, _)) => store.roll()?,
            Some(_) => {
                store.core.get_mut().slots.load_all(n - 1);
                // What was read back may still sit in the page cache only (after a kill):
                // make it durable at the first sync, before anyone sees it.
                store.mark_dirty(n - 1);
            }
        }
        let i = store.nsegs() - 1;
        let id = store.segs()[i].id;
        store.files.get_mut().pin(id);
        Ok(())
    })();
    store.check_io(r)?;
    Ok((store, rep))
}
