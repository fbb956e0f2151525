//! The file store: append-only segment files of checksummed records (see `record`), an
//! in-memory index (the shared `index::Core`, each slot pointing at its record), and a
//! saved copy of that index written by `close` so a clean restart does not rescan.
//!
//! Durability rules, which the fault-injection tests (`tests/crash.rs`) check:
//! - A message is durable once `sync` returns: `sync` flushes the write buffer, fdatasyncs
//!   every segment written since the last sync, then fsyncs the directory if a segment was
//!   created or removed. `store_msg` never waits for the disk (group commit).
//! - Removals are records too. An interior removal appends a tombstone (carrying the
//!   message's timestamp). Removals at the front (limits, expiry, purge) are covered by one
//!   marker record, "everything below N is gone, last_seq is L", written at the next
//!   `sync`: a stream at its limits writes one small record per sync, not one per discard.
//! - A segment file is deleted at `sync` once none of its messages is live, and only after
//!   what keeps its removals removed is durable, directory entry included: a fresh marker
//!   (which also preserves last_seq, so sequences are never reused), and re-appended
//!   tombstones it held for messages of older, surviving segments.
//! - Erase writes a tombstone and syncs before overwriting the record in place, so a torn
//!   overwrite reads as a removed message at recovery, never as a lost one; the first
//!   erase after opening from a saved index also retires that index, since the index would
//!   call an overwritten record live.
//! - Recovery replays records in append order (segment id, then offset). With a valid saved
//!   index it loads the index and replays only what was appended after it (it checks the
//!   last covered record of every segment). A record that fails its checksum at the end of
//!   a segment is a torn tail and is cut off; elsewhere it is skipped, reported, and never
//!   served. Opening never fails or panics because of file content.

use crate::index::{Core, Payload};
use crate::io::{Fs, FsFile, StdFs};
use crate::record::{self, Kind, Parse, HDR, MAX_RECORD};
use crate::{file_msg_size, Limits, Lost, Purge, Result, State, Store, StoreError, StoredMsg};
use bytes::Bytes;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Tuning for [`FileStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStoreConfig {
    /// A new segment file is started once the active one would grow past this (a single
    /// larger record gets a segment of its own). Clamped to [64 B, 1 GiB]: offsets are
    /// 32-bit.
    pub segment_size: u64,
    /// Appends collect in memory up to this many bytes before a write(2).
    pub write_buffer: usize,
}

impl Default for FileStoreConfig {
    fn default() -> Self {
        FileStoreConfig {
            segment_size: 8 << 20,
            write_buffer: 128 << 10,
        }
    }
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
    /// Bytes of incomplete or damaged records cut from segment tails.
    pub torn_bytes: u64,
    /// Damaged records skipped in the middle of a segment.
    pub corrupt_records: u64,
    pub corrupt_bytes: u64,
    /// Sequences of the skipped records, where their sequence field was plausible.
    pub corrupt_seqs: Vec<u64>,
}

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
    file: Box<dyn FsFile>,
    /// Bytes in the file. For the active (last) segment the write buffer follows.
    flushed: u64,
    /// Range of message sequences recorded here; `first > last` when none. An empty
    /// segment's range sits just above its predecessor's so `last` stays monotonic across
    /// segments, which the by-sequence lookup relies on.
    first: u64,
    last: u64,
    live: u64,
    /// Tombstones (sequence, message timestamp) in this segment for messages of older
    /// segments: what must be re-appended if this segment is deleted while those older
    /// segments remain.
    ext_tombs: Vec<(u64, i64)>,
    /// Written since the last fdatasync.
    dirty: bool,
    /// Offset and CRC of the last record, which the saved index uses to check that the
    /// segment still holds what it covered.
    last_rec: Option<(u64, u32)>,
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
    core: Core<Loc>,
    segs: Vec<Seg>,
    wbuf: Vec<u8>,
    /// Highest marker written: everything below is gone on disk.
    marker: u64,
    dir_dirty: bool,
    /// Ids of segments written since the last sync (the fdatasync list), and of segments
    /// whose last live message went (deletion candidates), so `sync` never walks every
    /// segment of a large stream.
    dirty: Vec<u32>,
    emptied: Vec<u32>,
    failed: Option<String>,
    closed: bool,
    /// Damaged records: found at recovery or when a read failed its checksum.
    lost: RefCell<(BTreeSet<u64>, u64)>,
    /// A saved index is on disk. It stays usable while we only append (recovery replays
    /// what was appended after it), but not once a record it covers is overwritten.
    index_on_disk: bool,
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

enum Read {
    Msg(StoredMsg),
    Damaged,
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
        cfg.segment_size = cfg.segment_size.clamp(64, 1 << 30);
        let (mut store, rep) = recover(fs, dir, cfg)?;
        // Limits may have shrunk while closed; whatever they discard is made durable
        // before the caller sees the store, like everything else recovery settled.
        store.set_limits(limits)?;
        store.sync()?;
        Ok((store, rep))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn writable(&self) -> Result<()> {
        if self.closed {
            return Err(StoreError::Io("store is closed".into()));
        }
        if let Some(e) = &self.failed {
            return Err(StoreError::Io(e.clone()));
        }
        Ok(())
    }

    /// An I/O failure leaves memory and disk possibly out of step, so the store refuses
    /// further writes; a restart recovers from what is on disk.
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
        }
    }

    /// One message of segment `i` went.
    fn dec_live(&mut self, i: usize) {
        let s = &mut self.segs[i];
        s.live -= 1;
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
        let s = &mut self.segs[i];
        s.file.write_at(&self.wbuf, s.flushed)?;
        s.flushed += self.wbuf.len() as u64;
        self.wbuf.clear();
        self.mark_dirty(i);
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
        }
        let id = self.segs.last().map_or(1, |s| s.id + 1);
        let mut file = self.fs.open(&self.path(&seg_name(id)), true)?;
        if file.len()? != 0 {
            // Only possible with foreign files in the directory; never append to them.
            file.truncate(0)?;
        }
        let base = self.core.last_seq;
        self.segs.push(Seg {
            id,
            file,
            flushed: 0,
            first: base + 1,
            last: base,
            live: 0,
            ext_tombs: Vec::new(),
            dirty: false,
            last_rec: None,
        });
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
        if self.segs.is_empty() || (cur > 0 && cur + len as u64 > self.cfg.segment_size) {
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

    /// Turns what the last core operation removed into records.
    fn settle(&mut self) -> io::Result<()> {
        if self.core.reset {
            self.core.reset = false;
            for s in &mut self.segs {
                s.live = 0;
                s.ext_tombs.clear();
                self.emptied.push(s.id);
            }
            // Everything is gone: start a fresh segment so every old one can be deleted
            // at the next sync, once the marker recording the new first sequence is down.
            if self.active_len() > 0 {
                self.roll()?;
            } else if let Some(s) = self.segs.last_mut() {
                s.first = self.core.last_seq + 1;
                s.last = self.core.last_seq;
            }
        }
        let mut removed = std::mem::take(&mut self.core.removed);
        let mut r = Ok(());
        for &(seq, ts, _) in &removed {
            if let Some(i) = self.seg_idx(seq) {
                self.dec_live(i);
            }
            // Below first_seq the next marker covers it.
            if seq >= self.core.first_seq {
                r = self.write_tomb(seq, ts);
                if r.is_err() {
                    break;
                }
            }
        }
        removed.clear();
        self.core.removed = removed;
        r
    }

    fn write_marker(&mut self) -> io::Result<()> {
        let m = self.core.first_seq.max(self.marker);
        let last = self.core.last_seq.to_le_bytes();
        self.append(Kind::Marker, m, self.core.last_ts, b"", b"", &last)?;
        self.marker = m;
        Ok(())
    }

    fn do_sync(&mut self) -> io::Result<()> {
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
        // segment about to go (older segments still on disk rely on it), and so may the
        // highest sequence ever used, which the marker's last_seq keeps from being reused.
        let c = &self.core;
        let news = c.first_seq > self.marker && (c.first_seq > 1 || c.last_seq == 0);
        if news || !dead.is_empty() {
            self.write_marker()?;
        }
        if !dead.is_empty() {
            let mut again = Vec::new();
            for &i in &dead {
                for &(t, ts) in &self.segs[i].ext_tombs {
                    if t >= self.marker
                        && self.seg_idx(t).is_some()
                        && self.core.slots.get(t).is_none()
                    {
                        again.push((t, ts));
                    }
                }
            }
            for (t, ts) in again {
                self.write_tomb(t, ts)?;
            }
        }
        self.flush_wbuf()?;
        for id in std::mem::take(&mut self.dirty) {
            if let Some(i) = self.seg_by_id(id) {
                let s = &mut self.segs[i];
                if let Err(e) = s.file.sync() {
                    self.dirty.push(id);
                    return Err(e);
                }
                s.dirty = false;
            }
        }
        if !dead.is_empty() {
            // What justifies the unlinks (the marker, re-appended tombstones) must be on
            // disk with its directory entry first: it may sit in a segment created since
            // the last sync, and unlinks can reach the disk in any order.
            if self.dir_dirty {
                self.fs.sync_dir(&self.dir)?;
                self.dir_dirty = false;
            }
            for &i in dead.iter().rev() {
                let s = self.segs.remove(i);
                let path = self.path(&seg_name(s.id));
                drop(s);
                self.fs.remove(&path)?;
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
        }
        if self.dir_dirty {
            self.fs.sync_dir(&self.dir)?;
            self.dir_dirty = false;
        }
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
        self.core.limits.clone()
    }

    #[cfg(test)]
    pub(crate) fn segment_count(&self) -> usize {
        self.segs.len()
    }

    fn read(&self, seq: u64) -> Result<Read> {
        let Some(slot) = self.core.slots.get(seq) else {
            return Err(StoreError::NotFound);
        };
        let loc = slot.p;
        let i = self
            .seg_idx(seq)
            .ok_or_else(|| StoreError::Io(format!("no segment holds sequence {seq}")))?;
        let s = &self.segs[i];
        let (off, len) = (loc.off as u64, loc.len());
        let buf = if i == self.segs.len() - 1 && off >= s.flushed {
            let at = (off - s.flushed) as usize;
            match self.wbuf.get(at..at + len) {
                Some(b) => Bytes::copy_from_slice(b),
                None => return Ok(Read::Damaged),
            }
        } else {
            let mut v = vec![0; len];
            s.file.read_at(&mut v, off)?;
            Bytes::from(v)
        };
        let (sl, hl, ts) = match record::parse(&buf) {
            Parse::Ok(r) if r.kind == Kind::Msg && r.seq == seq => {
                (r.subj.len(), r.hdr.len(), r.ts)
            }
            _ => {
                let mut lost = self.lost.borrow_mut();
                if lost.0.insert(seq) {
                    lost.1 += len as u64;
                }
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
        let s = &mut self.segs[i];
        let mut buf = vec![0; len];
        s.file.read_at(&mut buf, off)?;
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
        s.file.write_at(&buf, off)?;
        if let (Some(c), Some((lo, _))) = (crc, s.last_rec) {
            if lo == off {
                s.last_rec = Some((off, c));
            }
        }
        self.mark_dirty(i);
        Ok(())
    }

    fn write_index(&mut self) -> io::Result<()> {
        let mut e = Enc(Vec::with_capacity(64 + self.core.msgs as usize * 28));
        e.0.extend_from_slice(IDX_MAGIC);
        let c = &self.core;
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
        let lost = self.lost.borrow();
        e.u32(lost.0.len() as u32);
        for &s in &lost.0 {
            e.u64(s);
        }
        e.u64(lost.1);
        drop(lost);
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
        self.core.check(subject, hdr.len(), data.len(), size)?;
        let seq = self.core.last_seq + 1;
        let r = self.append(Kind::Msg, seq, ts, subject, hdr, data);
        let (idx, loc) = self.check_io(r)?;
        self.segs[idx].note_msg(seq);
        self.segs[idx].live += 1;
        let got = self.core.append(subject, ts, loc);
        debug_assert_eq!(got, seq);
        let r = self.settle();
        self.check_io(r)?;
        Ok(seq)
    }

    fn sync(&mut self) -> Result<()> {
        self.writable()?;
        let r = self.do_sync();
        self.check_io(r)
    }

    fn load(&self, seq: u64) -> Result<StoredMsg> {
        self.load_found(Some(seq))
    }

    fn load_next(&self, start: u64, filter: &str) -> Result<StoredMsg> {
        let mut start = start;
        loop {
            let seq = self
                .core
                .find_next(start, filter)
                .ok_or(StoreError::NotFound)?;
            match self.read(seq)? {
                Read::Msg(m) => return Ok(m),
                // A damaged record reads as deleted; move on to the next match.
                Read::Damaged => start = seq + 1,
            }
        }
    }

    fn load_last(&self, filter: &str) -> Result<StoredMsg> {
        self.load_found(self.core.find_last(filter))
    }

    fn last_seq_for_subject(&self, subject: &str) -> u64 {
        self.core.last_seq_for_subject(subject)
    }

    fn peek(&self, seq: u64) -> Option<(i64, bool)> {
        self.core
            .slots
            .get(seq)
            .map(|s| (s.ts(), s.p.len & HDR_FLAG != 0))
    }

    fn remove(&mut self, seq: u64, erase: bool) -> Result<bool> {
        self.writable()?;
        let Some((loc, ts)) = self.core.slots.get(seq).map(|s| (s.p, s.ts())) else {
            return Ok(false);
        };
        self.core.remove(seq);
        let r = (|| {
            if erase {
                // The tombstone is made durable before the overwrite: a torn overwrite then
                // reads as a removed message at recovery, never as a lost one.
                self.core.removed.clear();
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
        let n = self.core.purge(opts);
        let r = self.settle();
        self.check_io(r)?;
        Ok(n)
    }

    fn expire(&mut self, now: i64) -> Result<(u64, Option<i64>)> {
        self.writable()?;
        let out = self.core.expire(now);
        let r = self.settle();
        self.check_io(r)?;
        Ok(out)
    }

    fn exempt_from_max_age(&mut self, seq: u64) {
        self.core.age_exempt.insert(seq);
    }

    fn skip_to(&mut self, next: u64) -> Result<()> {
        self.writable()?;
        if next <= self.core.last_seq + 1 {
            return Ok(());
        }
        let had_msgs = self.core.msgs > 0;
        self.core.skip_to(next);
        // A tombstone for the new last sequence is what recovery restores last_seq from
        // (an emptied store gets its marker at the next sync instead).
        let ts = self.core.last_ts;
        let r = if had_msgs {
            self.write_tomb(next - 1, ts)
        } else {
            Ok(())
        };
        let r = r.and_then(|_| self.settle());
        self.check_io(r)
    }

    fn set_limits(&mut self, limits: Limits) -> Result<()> {
        self.writable()?;
        self.core.set_limits(limits);
        let r = self.settle();
        self.check_io(r)
    }

    fn state(&self) -> State {
        let mut st = self.core.state();
        let lost = self.lost.borrow();
        if !lost.0.is_empty() || lost.1 > 0 {
            st.lost = Some(Lost {
                msgs: lost.0.iter().copied().collect(),
                bytes: lost.1,
            });
        }
        st
    }

    fn deleted(&self) -> Vec<u64> {
        self.core.deleted()
    }

    fn subjects(&self, filter: &str) -> BTreeMap<String, u64> {
        self.core.subjects_map(filter)
    }

    fn num_pending(&self, start: u64, filter: &str, last_per_subject: bool) -> u64 {
        self.core.num_pending(start, filter, last_per_subject)
    }

    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.writable()?;
        let r = self.do_sync().and_then(|_| self.write_index());
        self.check_io(r)?;
        self.closed = true;
        Ok(())
    }

    fn destroy(mut self: Box<Self>) -> Result<()> {
        self.closed = true;
        self.segs.clear();
        self.fs.remove_dir_all(&self.dir)?;
        Ok(())
    }
}

// ---- saved index ----------------------------------------------------------------------

const IDX_MAGIC: &[u8; 8] = b"KEELIDX1";

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
    lost: Vec<u64>,
    lost_bytes: u64,
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
    let nlost = d.u32()? as usize;
    let mut lost = Vec::with_capacity(nlost.min(d.0.len() / 8));
    for _ in 0..nlost {
        lost.push(d.u64()?);
    }
    let lost_bytes = d.u64()?;
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
        lost,
        lost_bytes,
    })
}

// ---- recovery -------------------------------------------------------------------------

/// Replays records into a fresh core.
struct Replay {
    core: Core<Loc>,
    marker: u64,
    /// Highest message sequence seen in any record (message or erased) and its timestamp.
    max_msg: (u64, i64),
    /// Highest last_seq a marker recorded, and the last_ts with it.
    marker_last: (u64, i64),
    /// Damaged records with a readable sequence: confirmed, and awaiting the next good
    /// message (a plausible damaged sequence lies between its good neighbours). A later
    /// tombstone or marker for the sequence means the damage hit a removed message (a torn
    /// erase): not a loss.
    lost: Vec<Damaged>,
    pending: Vec<Damaged>,
    /// (segment id, sequence) of plausible damaged records: the segment still holds that
    /// sequence, so its range must cover it (tombstones for it stay needed).
    holds: Vec<(u32, u64)>,
    /// Damaged bytes with no plausible sequence.
    lost_bytes: u64,
    damaged_bytes: u64,
    records: u64,
    torn: u64,
    corrupt: u64,
}

#[derive(Clone, Copy)]
struct Damaged {
    seq: u64,
    bytes: u64,
    seg: u32,
    removed: bool,
}

impl Replay {
    fn confirm(&mut self, next_good: u64) {
        for d in std::mem::take(&mut self.pending) {
            if d.seq < next_good {
                self.holds.push((d.seg, d.seq));
                self.lost.push(d);
            } else {
                self.lost_bytes += d.bytes;
            }
        }
    }

    /// A tombstone or marker covers damaged records of removed messages.
    fn removed(&mut self, pred: impl Fn(u64) -> bool) {
        for d in self.lost.iter_mut().chain(self.pending.iter_mut()) {
            if pred(d.seq) {
                d.removed = true;
            }
        }
    }

    fn apply(&mut self, seg: &mut Seg, r: &record::Rec, off: usize) {
        self.records += 1;
        seg.last_rec = Some((off as u64, r.crc));
        match r.kind {
            Kind::Msg | Kind::Erased => {
                seg.note_msg(r.seq);
                self.confirm(r.seq);
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
                self.removed(|s| s == t);
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
                self.removed(|s| s < m);
            }
        }
        self.core.removed.clear();
    }

    /// Scans `data`, which holds the segment from file offset `base` on; returns the file
    /// offset where the valid records end (anything after is a torn tail to cut off).
    fn scan(&mut self, seg: &mut Seg, data: &[u8], base: u64) -> u64 {
        let mut o = 0;
        while o < data.len() {
            if let Parse::Ok(r) = record::parse(&data[o..]) {
                self.apply(seg, &r, base as usize + o);
                o += r.len;
                continue;
            }
            match record::resync(data, o + 1) {
                Some(next) => {
                    // Damage in the middle: skip to the next valid record.
                    self.corrupt += 1;
                    let n = (next - o) as u64;
                    self.damaged_bytes += n;
                    match record::damaged_seq(&data[o..]) {
                        Some(s) if s > self.max_msg.0 && s >= self.marker => {
                            self.pending.push(Damaged {
                                seq: s,
                                bytes: n,
                                seg: seg.id,
                                removed: false,
                            })
                        }
                        _ => self.lost_bytes += n,
                    }
                    o = next;
                }
                None => {
                    // Nothing valid follows: a torn tail.
                    self.torn += (data.len() - o) as u64;
                    return base + o as u64;
                }
            }
        }
        base + data.len() as u64
    }
}

fn recover(
    fs: Arc<dyn Fs>,
    dir: &Path,
    cfg: FileStoreConfig,
) -> Result<(FileStore, RecoveryReport)> {
    fs.create_dir_all(dir)?;
    let names = fs.list(dir)?;
    let mut ids: Vec<u32> = names.iter().filter_map(|n| parse_seg_name(n)).collect();
    ids.sort_unstable();
    let mut rep = RecoveryReport::default();
    if names.iter().any(|n| n == INDEX_TMP) {
        let _ = fs.remove(&dir.join(INDEX_TMP));
    }

    let mut files = Vec::with_capacity(ids.len());
    for &id in &ids {
        let f = fs.open(&dir.join(seg_name(id)), false)?;
        let len = f.len()?;
        files.push((id, f, len));
    }
    rep.segments = files.len() as u64;

    let mut idx = None;
    if names.iter().any(|n| n == INDEX) {
        let ip = dir.join(INDEX);
        let loaded = (|| -> io::Result<std::result::Result<Idx, String>> {
            let f = fs.open(&ip, false)?;
            let mut b = vec![0; f.len()? as usize];
            f.read_at(&mut b, 0)?;
            let Some(ix) = decode_index(&b) else {
                return Ok(Err("index checksum or format mismatch".into()));
            };
            Ok(validate_index(&ix, &files).map(|_| ix))
        })();
        match loaded {
            Ok(Ok(ix)) => idx = Some(ix),
            Ok(Err(why)) => rep.index_rejected = Some(why),
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
        lost: Vec::new(),
        pending: Vec::new(),
        holds: Vec::new(),
        lost_bytes: 0,
        damaged_bytes: 0,
        records: 0,
        torn: 0,
        corrupt: 0,
    };
    let mut saved_lost: (Vec<u64>, u64) = (Vec::new(), 0);
    let mut covered: HashMap<u32, IdxSeg> = HashMap::new();
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
        saved_lost = (ix.lost, ix.lost_bytes);
        covered = ix.segs.into_iter().map(|s| (s.id, s)).collect();
    }

    let mut segs: Vec<Seg> = Vec::with_capacity(files.len());
    for (id, file, len) in files {
        let base = segs.last().map_or(0, |s| s.last);
        let mut seg = Seg {
            id,
            file,
            flushed: len,
            first: base + 1,
            last: base,
            live: 0,
            ext_tombs: Vec::new(),
            dirty: false,
            last_rec: None,
        };
        let mut start = 0u64;
        if let Some(c) = covered.remove(&id) {
            seg.first = c.first;
            seg.last = c.last;
            seg.ext_tombs = c.ext_tombs;
            seg.last_rec = c.last_rec;
            start = c.covered;
        }
        if start < len {
            let mut data = vec![0; (len - start) as usize];
            seg.file.read_at(&mut data, start)?;
            let end = rp.scan(&mut seg, &data, start);
            if end < len {
                seg.file.truncate(end)?;
                seg.file.sync()?;
                seg.flushed = end;
            }
        }
        segs.push(seg);
    }

    // Final stream counters.
    let (ls, lts) = if rp.max_msg.0 >= rp.marker_last.0 {
        rp.max_msg
    } else {
        rp.marker_last
    };
    // Damaged records after the last good message are plausible up to last_seq.
    rp.confirm(ls + 1);
    for &(id, seq) in &rp.holds {
        if let Some(s) = segs.iter_mut().find(|s| s.id == id) {
            s.note_msg(seq);
        }
    }
    // Keep `last` monotonic across segments (empty ones sit just above their predecessor).
    let mut prev = 0;
    for s in &mut segs {
        if !s.has_msgs() {
            s.first = prev + 1;
            s.last = prev;
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
            c.first_seq = if ls > 0 || rp.marker > 0 { ls + 1 } else { 0 };
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
    let mut lost: BTreeSet<u64> = saved_lost.0.into_iter().collect();
    for d in std::mem::take(&mut rp.lost) {
        if d.removed {
            continue;
        }
        if c.slots.get(d.seq).is_none() {
            lost.insert(d.seq);
        }
        rp.lost_bytes += d.bytes;
    }
    rep.records_scanned = rp.records;
    rep.torn_bytes = rp.torn;
    rep.corrupt_records = rp.corrupt;
    rep.corrupt_bytes = rp.damaged_bytes;
    rep.corrupt_seqs = lost.iter().copied().collect();

    let emptied = segs.iter().filter(|s| s.live == 0).map(|s| s.id).collect();
    let mut store = FileStore {
        fs,
        dir: dir.to_path_buf(),
        cfg,
        core: rp.core,
        segs,
        wbuf: Vec::new(),
        marker: rp.marker,
        dir_dirty: false,
        dirty: Vec::new(),
        emptied,
        failed: None,
        closed: false,
        lost: RefCell::new((lost, saved_lost.1 + rp.lost_bytes)),
        index_on_disk: rep.used_index,
    };
    if store.segs.is_empty() {
        let r = store.roll();
        store.check_io(r)?;
    }
    Ok((store, rep))
}

/// Checks that the segments still hold exactly what the index covered.
fn validate_index(
    ix: &Idx,
    files: &[(u32, Box<dyn FsFile>, u64)],
) -> std::result::Result<(), String> {
    let max_id = ix.segs.iter().map(|s| s.id).max().unwrap_or(0);
    let on_disk: HashMap<u32, usize> = files.iter().enumerate().map(|(i, f)| (f.0, i)).collect();
    for s in &ix.segs {
        let Some(&i) = on_disk.get(&s.id) else {
            return Err(format!("segment {} is missing", s.id));
        };
        let (_, f, len) = &files[i];
        if *len < s.covered {
            return Err(format!("segment {} is shorter than the index covers", s.id));
        }
        match s.last_rec {
            None if s.covered == 0 => {}
            None => return Err(format!("segment {}: no last record", s.id)),
            Some((off, crc)) => {
                if off >= s.covered || s.covered - off > MAX_RECORD as u64 {
                    return Err(format!("segment {}: bad last record offset", s.id));
                }
                let mut b = vec![0; (s.covered - off) as usize];
                f.read_at(&mut b, off).map_err(|e| e.to_string())?;
                match record::parse(&b) {
                    Parse::Ok(r) if r.crc == crc && r.len == b.len() => {}
                    _ => return Err(format!("segment {} changed since the index", s.id)),
                }
            }
        }
    }
    if let Some(f) = files
        .iter()
        .find(|f| f.0 <= max_id && !ix.segs.iter().any(|s| s.id == f.0))
    {
        return Err(format!("segment {} is not in the index", f.0));
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
