//! A durable, append-only Raft log of opaque entries: one directory per Raft group.
//!
//! Files in the directory:
//! - `<first index, 20 digits>.rlog`: a segment, named by the index of its first entry. It
//!   starts with two head slots (rewritten alternately at each sync, so a torn rewrite
//!   leaves the other intact) and then entry records in index order. A segment is rolled
//!   once it reaches the configured size.
//! - `purged` and `state`: [`MetaFiles`] (checksummed, written atomically and fsynced): the
//!   purge point, and the caller's small state (vote, committed index).
//! - `damaged-*`: what recovery moved out of the way (never read again, kept for the operator).
//!
//! Record: `0 magic "KRFT" | 4 payload len u32 | 8 crc32 over bytes 4..8 and 12.. | 12 kind u8
//! | 13 zero [3] | 16 index u64 | 24 payload`, little-endian. Head record: kind 2, index = the
//! segment's first index, payload = synced_len u64, synced_last u64, count u64, zero u64.
//!
//! Durability: [`RaftLog::append`] only writes; a sync ([`RaftLog::begin_sync`], the job's
//! `run` with no lock held, [`RaftLog::finish_sync`]) makes everything appended before it
//! durable (one fsync for any number of appends). Each sync rewrites the heads of the
//! segments it covers with what the last *completed* sync made durable (`synced_len`,
//! `synced_last`): so recovery can tell damage in synced data (reported) from a torn tail an
//! unfinished sync left (cut without a report). [`RaftLog::truncate_after`] and
//! [`RaftLog::purge_upto`] are durable when they return.
//!
//! Recovery never serves a damaged entry and never skips one: the log ends before the first
//! damaged or missing entry, everything from there on is moved to `damaged-*` files, and the
//! problems are returned by [`RaftLog::open`].

use crate::io::{Fs, FsFile};
use crate::meta::{MetaFiles, MetaRead};
use crate::{Result, StoreError};
use bytes::Bytes;
use std::io;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAGIC: [u8; 4] = *b"KRFT";
const HDR: usize = 24;
const KIND_ENTRY: u8 = 1;
const KIND_HEAD: u8 = 2;
const HEAD_LEN: usize = HDR + 32;
const HEADS_LEN: usize = 2 * HEAD_LEN;
/// Largest payload (the length field keeps 31 bits so a flipped top bit is never plausible).
pub const MAX_PAYLOAD: usize = (1 << 31) - 1 - HDR;
const SUFFIX: &str = ".rlog";

/// Tuning for [`RaftLog`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaftLogConfig {
    /// A segment is rolled once the next record would take it past this size (an entry
    /// larger than this gets a segment of its own).
    pub segment_size: u64,
    /// Allocate the active segment ahead of its records (zeros written for appends under
    /// `ZERO_FILL_BELOW`, see [`FsFile::allocate`]), so that an append changes neither the
    /// file's size nor its extents: its fdatasync then flushes the data only, not the
    /// file's metadata as well (about half the time of one that grows the file on ext4). A
    /// segment is cut back to its records when the next one starts.
    pub preallocate: bool,
    /// The filesystem its files are on.
    pub disk: crate::io::Disk,
}

impl Default for RaftLogConfig {
    fn default() -> Self {
        RaftLogConfig {
            segment_size: 64 << 20,
            preallocate: true,
            disk: crate::io::Disk::real(),
        }
    }
}

/// How far ahead of its records the active segment is allocated: as much again as it holds,
/// from 4 KiB to 256 KiB (each step's zeros are flushed by the next sync).
const PREALLOC: u64 = 256 << 10;

fn crc(rec: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&rec[4..8]);
    h.update(&rec[12..]);
    h.finalize()
}

fn encode(buf: &mut Vec<u8>, kind: u8, index: u64, payload: &[u8]) {
    let start = buf.len();
    buf.reserve(HDR + payload.len());
    buf.extend_from_slice(&MAGIC);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(&[kind, 0, 0, 0]);
    buf.extend_from_slice(&index.to_le_bytes());
    buf.extend_from_slice(payload);
    let c = crc(&buf[start..]);
    buf[start + 8..start + 12].copy_from_slice(&c.to_le_bytes());
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

/// (kind, index, record length) of a valid record at the start of `b`. Never panics.
fn parse(b: &[u8]) -> Option<(u8, u64, usize)> {
    if b.len() < HDR || b[0..4] != MAGIC {
        return None;
    }
    let plen = u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize;
    if plen > MAX_PAYLOAD || HDR + plen > b.len() {
        return None;
    }
    let rec = &b[..HDR + plen];
    if crc(rec) != u32::from_le_bytes(rec[8..12].try_into().unwrap()) {
        return None;
    }
    let kind = rec[12];
    if kind != KIND_ENTRY && kind != KIND_HEAD {
        return None;
    }
    Some((kind, u64_at(rec, 16), HDR + plen))
}

/// The highest index of a valid entry record at or after `from` whose index is above
/// `index`. (Then the bad bytes before it are not a torn tail: something was written
/// after them.)
fn last_entry_after(b: &[u8], from: usize, index: u64) -> Option<u64> {
    let mut o = from;
    let mut found = None;
    while o + HDR <= b.len() {
        let Some(rel) = b[o..].windows(4).position(|w| w == MAGIC) else {
            break;
        };
        o += rel;
        if let Some((KIND_ENTRY, i, len)) = parse(&b[o..]) {
            if i > index {
                found = found.max(Some(i));
                o += len;
                continue;
            }
        }
        o += 1;
    }
    found
}

/// What a segment's head says, as of the sync that last wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Head {
    first: u64,
    /// The segment's length as of the last completed sync: bytes below it were durable.
    synced_len: u64,
    /// The log's last index as of the last completed sync.
    synced_last: u64,
    /// Which of the two slots is newer.
    count: u64,
}

fn encode_head(h: &Head) -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    for v in [h.synced_len, h.synced_last, h.count, 0] {
        body.extend_from_slice(&v.to_le_bytes());
    }
    let mut buf = Vec::with_capacity(HEAD_LEN);
    encode(&mut buf, KIND_HEAD, h.first, &body);
    buf
}

fn parse_head(b: &[u8]) -> Option<Head> {
    match parse(b) {
        Some((KIND_HEAD, first, HEAD_LEN)) => Some(Head {
            first,
            synced_len: u64_at(b, HDR),
            synced_last: u64_at(b, HDR + 8),
            count: u64_at(b, HDR + 16),
        }),
        _ => None,
    }
}

fn seg_name(first: u64) -> String {
    format!("{first:020}{SUFFIX}")
}

fn parse_seg_name(name: &str) -> Option<u64> {
    let d = name.strip_suffix(SUFFIX)?;
    (d.len() == 20 && d.bytes().all(|c| c.is_ascii_digit()))
        .then(|| d.parse().ok())
        .flatten()
}

struct Seg {
    first: u64,
    /// Offset of entry `first + i`.
    offs: Vec<u64>,
    /// End of the last record written.
    len: u64,
    /// The file's size: `len` plus the allocated space after it (zeros).
    alloc: u64,
    file: Box<dyn FsFile>,
    /// A second descriptor for this file, opened before the writes it covers, that a sync
    /// job takes away: its fsync reports write-back errors of writes made through `file`,
    /// and `file` stays here for appends and reads meanwhile. Dropped once the segment is
    /// sealed and synced.
    sync_file: Option<Box<dyn FsFile>>,
    /// Length as of the last completed sync.
    proven_len: u64,
    next_slot: u8,
    /// Written since the last `begin_sync`.
    dirty: bool,
}

impl Seg {
    /// The index after its last entry.
    fn end(&self) -> u64 {
        self.first + self.offs.len() as u64
    }

    /// End offset of entry `index` (which it holds).
    fn end_of(&self, index: u64) -> u64 {
        let n = (index - self.first) as usize + 1;
        self.offs.get(n).copied().unwrap_or(self.len)
    }
}

/// The fsync half of a sync, run with no lock held (see [`RaftLog::begin_sync`]).
pub struct RaftSyncJob {
    files: Vec<(u64, Box<dyn FsFile>)>,
    /// (segment, length) this sync makes durable.
    covered: Vec<(u64, u64)>,
    last: u64,
    dir: Option<(Arc<dyn Fs>, PathBuf)>,
    outcome: Option<io::Result<()>>,
}

impl RaftSyncJob {
    /// Does the fsyncs (blocks until the disk has everything). Running it again is a no-op.
    pub fn run(&mut self) {
        if self.outcome.is_some() {
            return;
        }
        let r = crate::io::sync_files(self.files.iter_mut().map(|(_, f)| f), &self.dir);
        self.outcome = Some(r);
    }
}

/// A Raft group's log. Indexes are contiguous: the log holds `first_index()..=last_index()`
/// (empty when `first_index() > last_index()`). `Send`: keep it behind the caller's lock and
/// run a [`RaftSyncJob`] outside it.
pub struct RaftLog {
    fs: Arc<dyn Fs>,
    meta: MetaFiles,
    dir: PathBuf,
    cfg: RaftLogConfig,
    segs: Vec<Seg>,
    purged: u64,
    /// The last index as of the last completed sync (lowered by truncation).
    synced_last: u64,
    /// Head writes so far (orders the two slots).
    count: u64,
    /// A segment was created since the last sync (its directory entry is not durable).
    dir_dirty: bool,
    in_flight: bool,
    /// After a failed write or fsync nothing more is accepted: what reached the disk is
    /// unknown until the log is opened again (recovery finds out).
    failed: Option<String>,
    state: Option<Vec<u8>>,
    /// What recovery lost of what had been durable (see [`RaftLog::lost`]).
    claimed: u64,
    state_lost: bool,
    lost: Option<u64>,
    /// The directory's lock (`Fs::lock`), held while this log is open: a second instance
    /// on the same files (a group loaded again while its old node still winds down) would
    /// write heads and cut segments under this one. Let go when the log is dropped.
    _owner: Box<dyn Send>,
}

fn io_err(what: &str, e: io::Error) -> StoreError {
    StoreError::Io(format!("raft log: {what}: {e}"))
}

impl RaftLog {
    /// Opens (or creates) the log in `dir`, recovering what is there. The strings are the
    /// problems recovery found (damaged or missing data, damaged metadata); a torn tail
    /// left by an unfinished sync is cut without one.
    pub fn open(dir: &Path) -> Result<(RaftLog, Vec<String>)> {
        Self::open_with(dir, RaftLogConfig::default())
    }

    pub fn open_with(dir: &Path, cfg: RaftLogConfig) -> Result<(RaftLog, Vec<String>)> {
        Self::open_fs(cfg.disk.fs(), dir, cfg)
    }

    pub(crate) fn open_fs(
        fs: Arc<dyn Fs>,
        dir: &Path,
        mut cfg: RaftLogConfig,
    ) -> Result<(RaftLog, Vec<String>)> {
        cfg.segment_size = cfg.segment_size.clamp(4096, 1 << 40);
        fs.create_dir_all(dir)
            .map_err(|e| io_err("creating the directory", e))?;
        let owner = fs
            .lock(dir)
            .map_err(|e| io_err("locking the directory", e))?;
        let mut log = RaftLog {
            meta: MetaFiles::on(fs.clone()),
            fs,
            dir: dir.to_path_buf(),
            cfg,
            segs: Vec::new(),
            purged: 0,
            synced_last: 0,
            count: 0,
            dir_dirty: false,
            in_flight: false,
            failed: None,
            state: None,
            claimed: 0,
            state_lost: false,
            lost: None,
            _owner: owner,
        };
        let problems = log.recover().map_err(|e| io_err("recovery", e))?;
        let last = log.last_index();
        log.lost = if log.state_lost {
            Some(log.claimed.max(last))
        } else {
            (log.claimed > last).then_some(log.claimed)
        };
        Ok((log, problems))
    }

    /// Set when recovery found that entries once durable (up to the returned index) are
    /// gone, or that the newest saved state (the vote) is: the log forgot what this server
    /// acknowledged. Until a leader has brought the log back to that index, the server must
    /// neither vote nor stand for election, or it could help elect a leader that lacks
    /// entries a quorum acknowledged (a single damaged replica would then lose them).
    pub fn lost(&self) -> Option<u64> {
        self.lost
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn recover(&mut self) -> io::Result<Vec<String>> {
        let mut problems = Vec::new();
        let mut repair_state = false;
        self.state = match self.meta.read(&self.path("state")) {
            MetaRead::Missing => None,
            MetaRead::Current(b) | MetaRead::Unchecked(b) => Some(b),
            MetaRead::Older { body, damage } => {
                problems.push(format!("state file: {damage} (an older state is used)"));
                repair_state = true;
                self.state_lost = true;
                Some(body)
            }
            MetaRead::Damaged(why) => {
                self.state_lost = true;
                problems.push(format!(
                    "state file unreadable, no state (its copies are moved to damaged-state*): \
                     {why}"
                ));
                // Out of the way, so that the damage is reported once.
                let state = self.path("state");
                for from in MetaFiles::copies(&state) {
                    let name = from.file_name().unwrap_or_default().to_string_lossy();
                    match self
                        .fs
                        .rename(&from, &self.path(&format!("damaged-{name}")))
                    {
                        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                        _ => {}
                    }
                }
                self.fs.sync_dir(&self.dir)?;
                None
            }
        };
        // Written again, so that the damage is reported once.
        if let (true, Some(b)) = (repair_state, &self.state) {
            self.meta.write(&self.path("state"), b, true)?;
        }
        let mut names: Vec<(u64, String)> = self
            .fs
            .list(&self.dir)?
            .into_iter()
            .filter_map(|n| Some((parse_seg_name(&n)?, n)))
            .collect();
        names.sort();
        // An unreadable purge point is taken from the segments (entries below the first
        // segment were purged), with a problem: otherwise a damaged small file would make
        // the whole log look missing.
        let first_seg = names.first().map(|(f, _)| *f);
        let guess = first_seg.map_or(0, |f| f.saturating_sub(1));
        let mut repair_purged = true;
        self.purged = match self.meta.read(&self.path("purged")) {
            MetaRead::Missing => {
                repair_purged = false;
                0
            }
            MetaRead::Current(b) | MetaRead::Unchecked(b) => match parse_u64(&b) {
                Some(v) => {
                    repair_purged = false;
                    v
                }
                None => {
                    problems.push(format!("purge point unreadable; assuming {guess}"));
                    guess
                }
            },
            MetaRead::Older { body, damage } => {
                let v = parse_u64(&body).unwrap_or(0).max(guess);
                problems.push(format!("purge point file: {damage}; assuming {v}"));
                v
            }
            MetaRead::Damaged(why) => {
                problems.push(format!("purge point file: {why}; assuming {guess}"));
                guess
            }
        };
        if repair_purged {
            let p = self.purged.to_string();
            self.meta.write(&self.path("purged"), p.as_bytes(), true)?;
        }
        // The highest synced_last any head claims: entries up to it were durable, so a break
        // in the chain below it is damage (reported, the rest kept aside), above it a torn
        // tail of an unfinished sync (cut).
        let mut claimed = 0u64;
        for (_, name) in &names {
            if let Some(h) = self.read_heads(&self.path(name))?.0 {
                claimed = claimed.max(h.synced_last);
            }
        }
        self.claimed = claimed;
        let mut broken: Option<bool> = None;
        let mut changed_dir = false;
        for k in 0..names.len() {
            let (first, name) = names[k].clone();
            let path = self.path(&name);
            if let Some(damage) = broken {
                self.cut_file(&path, &name, damage)?;
                changed_dir = true;
                continue;
            }
            let next_first = names.get(k + 1).map(|(f, _)| *f);
            // A segment whose entries are all purged (its removal was not durable yet).
            if next_first.is_some_and(|n| n <= self.purged + 1) {
                self.fs.remove(&path)?;
                changed_dir = true;
                continue;
            }
            let mut file = self.fs.open(&path, false)?;
            let mut data = vec![0; file.len()? as usize];
            file.read_at(&mut data, 0)?;
            let (head, slot) = match (parse_head(&data), data.get(HEAD_LEN..).map(parse_head)) {
                (Some(a), Some(Some(b))) if b.count > a.count => (Some(b), 1),
                (Some(a), _) => (Some(a), 0),
                (None, Some(Some(b))) => (Some(b), 1),
                _ => (None, 0),
            };
            let mut heads_damaged = false;
            let head = match head {
                Some(h) => h,
                // Its creation never completed (nothing was ever synced in it; a later
                // segment of the same unsynced writes may exist).
                None if data.len() <= HEADS_LEN => {
                    self.fs.remove(&path)?;
                    changed_dir = true;
                    continue;
                }
                None => {
                    problems.push(format!(
                        "segment {name}: both heads damaged; all its bytes are taken as synced"
                    ));
                    heads_damaged = true;
                    Head {
                        first,
                        synced_len: data.len() as u64,
                        synced_last: 0,
                        count: 0,
                    }
                }
            };
            self.count = self.count.max(head.count);
            let expect = self
                .segs
                .last()
                .map_or(self.purged + 1, |s| s.end().max(self.purged + 1));
            if head.first != first {
                problems.push(format!(
                    "segment {name}: its head names first index {}; the log ends at {}",
                    head.first,
                    expect - 1
                ));
                broken = Some(true);
                self.cut_file(&path, &name, true)?;
                changed_dir = true;
                continue;
            }
            if first > expect {
                let damage = claimed >= expect;
                if damage {
                    problems.push(format!(
                        "entries {expect}..={} are missing; the log ends at {}",
                        first - 1,
                        expect - 1
                    ));
                }
                broken = Some(damage);
                self.cut_file(&path, &name, damage)?;
                changed_dir = true;
                continue;
            }
            if first < expect && self.segs.last().is_some_and(|s| s.end() > first) {
                problems.push(format!(
                    "segment {name} overlaps the one before (its first index {first} is \
                     below {expect}); the log ends at {}",
                    expect - 1
                ));
                broken = Some(true);
                self.cut_file(&path, &name, true)?;
                changed_dir = true;
                continue;
            }
            let mut offs = Vec::new();
            let mut o = HEADS_LEN.min(data.len());
            let mut bad = None;
            while o < data.len() {
                match parse(&data[o..]) {
                    Some((KIND_ENTRY, i, len)) if i == first + offs.len() as u64 => {
                        offs.push(o as u64);
                        o += len;
                    }
                    _ => {
                        bad = Some(o);
                        break;
                    }
                }
            }
            // (A segment cut short within its heads never held a synced entry.)
            if (data.len() as u64) < head.synced_len && head.synced_len > HEADS_LEN as u64 {
                problems.push(format!(
                    "segment {name}: {} synced bytes missing at its end",
                    head.synced_len - data.len() as u64
                ));
                broken = Some(true);
            }
            let next = first + offs.len() as u64;
            if let Some(b) = bad {
                let after = last_entry_after(&data, b + 1, next - 1);
                let damage = (b as u64) < head.synced_len || after.is_some() || claimed >= next;
                if damage {
                    let rest = match after {
                        Some(i) => format!(" (entries up to {i} follow it)"),
                        None => String::new(),
                    };
                    problems.push(format!(
                        "segment {name}: entry {next} at offset {b} is damaged{rest}; the log \
                         ends at {}; the rest of the segment is in {}",
                        next - 1,
                        quarantine_name(first, b as u64)
                    ));
                    self.quarantine(&data[b..], first, b as u64)?;
                    changed_dir = true;
                }
                broken = Some(broken.unwrap_or(false) || damage);
                // Heads first, capped to what stays, so a crash before the truncation
                // lands never leaves a head claiming the cut bytes.
                let h = Head {
                    first,
                    synced_len: head.synced_len.min(b as u64),
                    synced_last: head.synced_last.min(next - 1),
                    count: self.count + 1,
                };
                self.count += 1;
                let hb = encode_head(&h);
                file.write_at(&hb, ((1 - slot) * HEAD_LEN) as u64)?;
                file.write_at(&hb, (slot * HEAD_LEN) as u64)?;
                file.truncate(b as u64)?;
                file.sync()?;
                data.truncate(b);
            } else if heads_damaged {
                // Written again, so that the damage is reported once.
                self.count += 1;
                let hb = encode_head(&Head {
                    first,
                    synced_len: data.len() as u64,
                    synced_last: next - 1,
                    count: self.count,
                });
                file.write_at(&[&hb[..], &hb[..]].concat(), 0)?;
                file.sync()?;
            } else if (data.len() as u64) > head.synced_len {
                // Written by a sync that may not have completed (or, after a process crash,
                // only in the page cache): durable from now on, before anyone acts on it (a
                // vote on a log that is not on disk is not safe).
                file.sync()?;
            }
            if offs.is_empty() && (next_first.is_none() || broken.is_some()) {
                // Nothing in it: the next append starts a new segment.
                drop(file);
                self.fs.remove(&path)?;
                changed_dir = true;
                continue;
            }
            let sync_file = self.fs.open(&path, false)?;
            self.segs.push(Seg {
                first,
                offs,
                len: data.len() as u64,
                alloc: data.len() as u64,
                file,
                sync_file: Some(sync_file),
                proven_len: data.len() as u64,
                next_slot: 1 - slot as u8,
                dirty: false,
            });
        }
        // A last segment that holds only purged entries goes (its removal was not durable).
        while self
            .segs
            .first()
            .is_some_and(|s| s.end() <= self.purged + 1)
        {
            let s = self.segs.remove(0);
            let p = self.path(&seg_name(s.first));
            drop(s);
            self.fs.remove(&p)?;
            changed_dir = true;
        }
        let last = self.last_index();
        if claimed > last {
            problems.push(format!(
                "entries {}..={claimed} were synced and are missing; the log ends at {last}",
                last + 1
            ));
        }
        let n = self.segs.len();
        for (i, s) in self.segs.iter_mut().enumerate() {
            if i + 1 < n {
                s.sync_file = None;
            }
        }
        // The kept segments' names may not be durable either (a process crash).
        if changed_dir || !self.segs.is_empty() {
            self.fs.sync_dir(&self.dir)?;
        }
        self.synced_last = last;
        Ok(problems)
    }
}

fn parse_u64(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b).ok()?.trim().parse().ok()
}

fn quarantine_name(first: u64, off: u64) -> String {
    format!("damaged-{first:020}-{off}.bin")
}

impl RaftLog {
    /// The heads of the segment file at `path`: the newer valid one and its slot.
    fn read_heads(&self, path: &Path) -> io::Result<(Option<Head>, usize)> {
        let f = self.fs.open(path, false)?;
        let n = (f.len()? as usize).min(HEADS_LEN);
        let mut b = vec![0; n];
        f.read_at(&mut b, 0)?;
        let a = parse_head(&b);
        let c = b.get(HEAD_LEN..).and_then(parse_head);
        Ok(match (a, c) {
            (Some(a), Some(c)) if c.count > a.count => (Some(c), 1),
            (Some(a), _) => (Some(a), 0),
            (None, Some(c)) => (Some(c), 1),
            _ => (None, 0),
        })
    }

    /// Copies damaged bytes of a segment out of the log (durably) for the operator.
    fn quarantine(&self, bytes: &[u8], first: u64, off: u64) -> io::Result<()> {
        let mut f = self
            .fs
            .open(&self.path(&quarantine_name(first, off)), true)?;
        f.truncate(0)?;
        f.write_at(bytes, 0)?;
        f.sync()
    }

    /// A segment after the end of the log: moved aside when the log ended at damage (its
    /// entries may be the only copy), removed when it ended at a torn tail (never synced).
    fn cut_file(&self, path: &Path, name: &str, damage: bool) -> io::Result<()> {
        if damage {
            self.fs.rename(path, &self.path(&format!("damaged-{name}")))
        } else {
            self.fs.remove(path)
        }
    }

    fn writable(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(StoreError::Io(format!(
                "raft log failed earlier ({e}); reopen it to recover"
            ))),
            None => Ok(()),
        }
    }

    fn fail(&mut self, what: &str, e: io::Error) -> StoreError {
        let err = io_err(what, e);
        self.failed = Some(err.to_string());
        err
    }

    /// Index of the first entry held (entries at or below the purge point are gone).
    pub fn first_index(&self) -> u64 {
        self.purged + 1
    }

    /// Index of the last entry, or the purge point when the log holds none.
    pub fn last_index(&self) -> u64 {
        self.segs.last().map_or(0, |s| s.end() - 1).max(self.purged)
    }

    /// The purge point: entries up to it are gone (durable across reopen).
    pub fn purged_upto(&self) -> u64 {
        self.purged
    }

    /// Appends entries; the first must be `last_index() + 1` and the rest follow one by one
    /// (after `purge_upto(n)` past the last entry, the next is `n + 1`). Written, not yet
    /// durable: a sync makes it so. Nothing is appended when any entry is refused.
    pub fn append(&mut self, entries: &[(u64, &[u8])]) -> Result<()> {
        self.writable()?;
        for (next, &(i, p)) in (self.last_index() + 1..).zip(entries) {
            if i != next {
                return Err(StoreError::Sequence {
                    seq: i,
                    last: next - 1,
                });
            }
            if p.len() > MAX_PAYLOAD {
                return Err(StoreError::Unsupported("raft log entry too large"));
            }
        }
        let mut buf = Vec::new();
        let mut offs = Vec::new();
        for &(i, p) in entries {
            let rl = (HDR + p.len()) as u64;
            let roll = match self.segs.last() {
                None => true,
                Some(s) => {
                    s.end() <= self.purged
                        || (s.len + buf.len() as u64 + rl > self.cfg.segment_size
                            && (!s.offs.is_empty() || !buf.is_empty()))
                }
            };
            if roll {
                self.flush(&mut buf, &mut offs)?;
                self.roll(i)
                    .map_err(|e| self.fail("creating a segment", e))?;
            }
            let s = self.segs.last().unwrap();
            offs.push(s.len + buf.len() as u64);
            encode(&mut buf, KIND_ENTRY, i, p);
        }
        self.flush(&mut buf, &mut offs)
    }

    fn flush(&mut self, buf: &mut Vec<u8>, offs: &mut Vec<u64>) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let s = self.segs.last_mut().unwrap();
        let end = s.len + buf.len() as u64;
        // Allocated ahead in steps, so most syncs find the file's size unchanged. Failure
        // is not an error: the write below extends the file (or fails) on its own.
        if self.cfg.preallocate && end > s.alloc {
            let want = self
                .cfg
                .segment_size
                .min(end + end.clamp(4 << 10, PREALLOC))
                .max(end);
            if s.file
                .allocate(want, buf.len() < crate::io::ZERO_FILL_BELOW)
                .is_ok()
            {
                s.alloc = want;
            }
        }
        if let Err(e) = s.file.write_at(buf, s.len) {
            return Err(self.fail("write", e));
        }
        s.len = end;
        s.alloc = s.alloc.max(end);
        s.offs.append(offs);
        s.dirty = true;
        buf.clear();
        Ok(())
    }

    /// Starts a segment whose first entry is `first`.
    fn roll(&mut self, first: u64) -> io::Result<()> {
        // The active segment gives back its allocated space, durably before the next one
        // exists: only the last segment may end in zeros (recovery cuts them there, while a
        // segment before another must end at its last record).
        // (The file's own size: an allocation that failed part way may have grown it.)
        if let Some(s) = self.segs.last_mut() {
            if s.alloc > s.len || s.file.len()? > s.len {
                s.file.truncate(s.len)?;
                s.file.sync()?;
                s.alloc = s.len;
            }
        }
        let path = self.path(&seg_name(first));
        let mut file = self.fs.open(&path, true)?;
        if file.len()? != 0 {
            // Only a leftover of a segment removed earlier can have this name.
            file.truncate(0)?;
        }
        let sync_file = self.fs.open(&path, false)?;
        self.count += 1;
        let h = encode_head(&Head {
            first,
            synced_len: HEADS_LEN as u64,
            synced_last: self.synced_last,
            count: self.count,
        });
        file.write_at(&[&h[..], &h[..]].concat(), 0)?;
        // A segment left with no entry (the log was purged past it) is replaced.
        if self.segs.last().is_some_and(|s| s.end() <= self.purged) {
            let s = self.segs.pop().unwrap();
            let p = self.path(&seg_name(s.first));
            drop(s);
            let _ = self.fs.remove(&p);
        }
        self.segs.push(Seg {
            first,
            offs: Vec::new(),
            len: HEADS_LEN as u64,
            alloc: HEADS_LEN as u64,
            file,
            sync_file: Some(sync_file),
            proven_len: HEADS_LEN as u64,
            next_slot: 0,
            dirty: true,
        });
        self.dir_dirty = true;
        Ok(())
    }

    /// Entries in `range` that the log holds (the range is clamped to
    /// `first_index()..=last_index()`), each checked against its CRC: a damaged one is an
    /// error, never returned.
    pub fn entries(&self, range: RangeInclusive<u64>) -> Result<Vec<(u64, Bytes)>> {
        let lo = (*range.start()).max(self.first_index());
        let hi = (*range.end()).min(self.last_index());
        let mut out = Vec::new();
        if lo > hi {
            return Ok(out);
        }
        let start = self.segs.partition_point(|s| s.end() <= lo);
        for s in &self.segs[start..] {
            if s.first > hi {
                break;
            }
            let (a, b) = (lo.max(s.first), hi.min(s.end() - 1));
            let off = s.offs[(a - s.first) as usize];
            let end = s.end_of(b);
            let mut buf = vec![0; (end - off) as usize];
            s.file
                .read_at(&mut buf, off)
                .map_err(|e| io_err(&format!("reading entries {a}..={b}"), e))?;
            let buf = Bytes::from(buf);
            let mut o = 0;
            for i in a..=b {
                match parse(&buf[o..]) {
                    Some((KIND_ENTRY, got, len)) if got == i => {
                        out.push((i, buf.slice(o + HDR..o + len)));
                        o += len;
                    }
                    _ => {
                        return Err(StoreError::Io(format!(
                            "raft log: entry {i} is damaged (segment {}, offset {})",
                            seg_name(s.first),
                            off + o as u64
                        )))
                    }
                }
            }
        }
        Ok(out)
    }

    /// The last entry, if the log holds any.
    pub fn last_entry(&self) -> Result<Option<(u64, Bytes)>> {
        let last = self.last_index();
        Ok(self.entries(last..=last)?.pop())
    }

    /// The first half of a sync: rewrites the heads of the segments written since the last
    /// sync and returns the fsyncs to do, or None when nothing waits for one. Run the job
    /// (blocking) with no lock held, then hand it to [`finish_sync`](Self::finish_sync).
    /// Appends may continue meanwhile (the next sync covers them); truncation waits for
    /// `finish_sync`. One sync at a time.
    pub fn begin_sync(&mut self) -> Result<Option<RaftSyncJob>> {
        self.writable()?;
        if self.in_flight {
            return Err(StoreError::Io("raft log: a sync is in progress".into()));
        }
        if !self.dir_dirty && !self.segs.iter().any(|s| s.dirty) {
            return Ok(None);
        }
        self.count += 1;
        let mut files = Vec::new();
        let mut covered = Vec::new();
        for i in 0..self.segs.len() {
            if !self.segs[i].dirty {
                continue;
            }
            let s = &self.segs[i];
            let h = encode_head(&Head {
                first: s.first,
                synced_len: s.proven_len,
                synced_last: self.synced_last,
                count: self.count,
            });
            let slot = s.next_slot as u64 * HEAD_LEN as u64;
            let path = self.path(&seg_name(s.first));
            let s = &mut self.segs[i];
            let r = s
                .file
                .write_at(&h, slot)
                .and_then(|_| match s.sync_file.take() {
                    Some(f) => Ok(f),
                    // Not expected (every writable segment keeps one); a fresh descriptor
                    // still fsyncs the file.
                    None => self.fs.open(&path, false),
                });
            match r {
                Ok(f) => {
                    s.next_slot = 1 - s.next_slot;
                    s.dirty = false;
                    covered.push((s.first, s.len));
                    files.push((s.first, f));
                }
                Err(e) => return Err(self.fail("writing a head", e)),
            }
        }
        let dir = std::mem::take(&mut self.dir_dirty).then(|| (self.fs.clone(), self.dir.clone()));
        self.in_flight = true;
        Ok(Some(RaftSyncJob {
            files,
            covered,
            last: self.last_index(),
            dir,
            outcome: None,
        }))
    }

    /// The second half: records what the job made durable. An error means the fsyncs
    /// failed: nothing since the last completed sync may be taken as durable, and the log
    /// refuses everything until it is opened again.
    pub fn finish_sync(&mut self, mut job: RaftSyncJob) -> Result<()> {
        job.run();
        self.in_flight = false;
        for (first, f) in job.files.drain(..) {
            if let Some(s) = self.segs.iter_mut().find(|s| s.first == first) {
                s.sync_file = Some(f);
            }
        }
        if let Some(Err(e)) = job.outcome.take() {
            return Err(self.fail("fsync", e));
        }
        self.writable()?;
        for &(first, len) in &job.covered {
            if let Some(s) = self.segs.iter_mut().find(|s| s.first == first) {
                s.proven_len = s.proven_len.max(len);
            }
        }
        self.synced_last = self.synced_last.max(job.last);
        // Sealed segments that are durable need no second descriptor any more.
        let n = self.segs.len();
        for (i, s) in self.segs.iter_mut().enumerate() {
            if i + 1 < n && !s.dirty {
                s.sync_file = None;
            }
        }
        Ok(())
    }

    /// Makes everything appended so far durable (`begin_sync`, `run`, `finish_sync`).
    pub fn sync(&mut self) -> Result<()> {
        match self.begin_sync()? {
            Some(mut job) => {
                job.run();
                self.finish_sync(job)
            }
            None => Ok(()),
        }
    }

    /// Removes every entry above `index` (a follower whose log diverged from its leader's),
    /// durably when it returns; the next append is `index + 1`. Refused below the purge
    /// point and while a sync is in progress.
    pub fn truncate_after(&mut self, index: u64) -> Result<()> {
        self.writable()?;
        if self.in_flight {
            return Err(StoreError::Io(
                "raft log: truncation while a sync is in progress".into(),
            ));
        }
        if index < self.purged {
            return Err(StoreError::Unsupported(
                "raft log: cannot truncate below the purge point",
            ));
        }
        if index >= self.last_index() {
            return Ok(());
        }
        // Whole segments after `index` go first, durably: a crash before the rest leaves
        // the old log (a prefix is never missing its middle).
        let keep = self.segs.partition_point(|s| s.first <= index);
        let gone: Vec<Seg> = self.segs.split_off(keep);
        if !gone.is_empty() {
            for s in gone {
                let p = self.path(&seg_name(s.first));
                drop(s);
                match self.fs.remove(&p) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => {
                        return Err(self.fail("removing a segment", e))
                    }
                    _ => {}
                }
            }
            if let Err(e) = self.fs.sync_dir(&self.dir) {
                return Err(self.fail("syncing the directory", e));
            }
        }
        self.synced_last = self.synced_last.min(index);
        self.count += 1;
        let count = self.count;
        let synced_last = self.synced_last;
        let dir = self.dir.clone();
        let dir_dirty = self.dir_dirty;
        let fs = self.fs.clone();
        if let Some(s) = self.segs.last_mut() {
            let n = (index + 1).saturating_sub(s.first) as usize;
            let cut = s.offs.get(n).copied().unwrap_or(s.len);
            // Heads first, capped to what stays, so no crash leaves one claiming the cut
            // entries as synced.
            let h = encode_head(&Head {
                first: s.first,
                synced_len: s.proven_len.min(cut),
                synced_last,
                count,
            });
            let slot = s.next_slot as u64 * HEAD_LEN as u64;
            let other = (1 - s.next_slot as u64) * HEAD_LEN as u64;
            let r = (|| {
                s.file.write_at(&h, slot)?;
                s.file.write_at(&h, other)?;
                s.file.truncate(cut)?;
                s.file.sync()?;
                if s.sync_file.is_none() {
                    s.sync_file = Some(fs.open(&dir.join(seg_name(s.first)), false)?);
                }
                if dir_dirty {
                    fs.sync_dir(&dir)?;
                }
                Ok(())
            })();
            if let Err(e) = r {
                return Err(self.fail("truncating", e));
            }
            s.alloc = cut;
            s.offs.truncate(n);
            s.len = cut;
            s.proven_len = cut;
            s.dirty = false;
            self.dir_dirty = false;
        }
        Ok(())
    }

    /// Drops entries up to `index`. The purge point is durable when this returns; segment
    /// files go once every entry in them is purged. Purging past the last entry empties
    /// the log: the next append is then `index + 1`.
    pub fn purge_upto(&mut self, index: u64) -> Result<()> {
        self.writable()?;
        if index <= self.purged {
            return Ok(());
        }
        self.meta
            .write(&self.path("purged"), index.to_string().as_bytes(), true)
            .map_err(|e| io_err("writing the purge point", e))?;
        self.purged = index;
        let mut n = 0;
        while n < self.segs.len() {
            let end = self.segs.get(n + 1).map_or(self.segs[n].end(), |s| s.first);
            if end > index + 1 {
                break;
            }
            n += 1;
        }
        for s in self.segs.drain(..n).collect::<Vec<_>>() {
            let p = self.path(&seg_name(s.first));
            drop(s);
            // A file left behind is removed again by recovery (it is below the purge point).
            let _ = self.fs.remove(&p);
            self.dir_dirty = true;
        }
        Ok(())
    }

    /// Saves the caller's small state (vote, committed index): durable and atomic (the old
    /// or the new state after any crash) when it returns.
    pub fn save_state(&mut self, state: &[u8]) -> Result<()> {
        self.meta
            .write(&self.path("state"), state, true)
            .map_err(|e| io_err("writing the state", e))?;
        self.state = Some(state.to_vec());
        Ok(())
    }

    /// The state last saved, if any.
    pub fn load_state(&self) -> Option<Vec<u8>> {
        self.state.clone()
    }
}
