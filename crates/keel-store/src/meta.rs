//! Small metadata files the server reads back (stream and consumer configs, consumer
//! state), written through the same [`Fs`] seam as the segments so the fault-injection
//! tests cover them.
//!
//! A file `<name>` has two slots, `<name>` and `<name>.alt`, each holding one copy:
//! `KEELMETA2 <length> <crc32 hex> <generation>\n`, the body (JSON, so an operator can
//! still read it), and possibly stale bytes after it. A write overwrites one slot in place
//! with the next generation, never the slot holding the newest copy that is (or may be)
//! durable, so a torn write (a crash, a kill in the middle of it) always leaves that copy
//! whole; a durable write fsyncs its slot, which then becomes the one kept. Writing in
//! place matters: replacing a file by rename frees the old one's blocks, and on a
//! filesystem mounted with `discard` that is a synchronous trim per write (about 300 us,
//! paid per confirmed ack). A slot is created through `<slot>.tmp` and a rename, so a
//! half-made file never carries the slot's name.
//!
//! A read takes the copy of the highest generation that verifies, else (no slot verifies)
//! a `.tmp` left by an interrupted first write, else a `.prev` (files written by an older
//! Keel: `KEELMETA1 <length> <crc32 hex>\n`, renamed over `<name>`, an older copy in
//! `.prev`; they read as generation 0). A `.tmp` that does not verify, with no slot at all,
//! is a first write cut short (a full disk, a crash): the file reads as missing. Falling
//! back to an older copy is what keeps a consumer at-least-once when its state file is
//! damaged: the older state has a lower ack floor, so it redelivers (duplicates) rather
//! than skips.

use crate::io::{Fs, StdFs};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const MAGIC: &str = "KEELMETA2";
/// Files written before slots: no generation, exactly the body after the header.
const MAGIC1: &str = "KEELMETA1";
const ALT: &str = ".alt";
/// A slot is cut back to its copy when it holds this much more than twice the copy (a
/// consumer whose pending list shrank), not on every shorter write: a truncate frees
/// blocks, the cost the in-place write avoids.
const SHRINK_SLACK: u64 = 64 * 1024;

/// What [`MetaFiles::read`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaRead {
    /// No copy of the file exists.
    Missing,
    /// The newest copy, checksum verified.
    Current(Vec<u8>),
    /// A copy is missing or damaged (`damage` says how); `body` is the newest copy that
    /// verified, which may be older than the damaged one.
    Older { body: Vec<u8>, damage: String },
    /// Copies exist but none verifies.
    Damaged(String),
    /// The current copy has no checksum header (written by a Keel from before
    /// checksums); its content cannot be verified.
    Unchecked(Vec<u8>),
}

/// What this process knows of one file's slots.
#[derive(Clone, Copy, Default, Debug)]
struct Slots {
    /// The generation of the newest copy written or found.
    gen: u64,
    /// The slot holding the newest copy that is (or may be) durable: never overwritten.
    keep: Option<usize>,
    /// The slot holding a newer copy written without fsync.
    newer: Option<usize>,
    /// Whether each slot's file exists.
    exists: [bool; 2],
    /// Whether each slot's name is durable (its directory synced since this process
    /// looked: a name made by a process that was killed may not be).
    named: [bool; 2],
    /// A write failed since the last good one: the slot it went to may be torn.
    failed: bool,
    /// Each slot's file length, once known.
    lens: [Option<u64>; 2],
}

/// Checksummed metadata files, each replaced by writing one of its two slots in place.
#[derive(Clone)]
pub struct MetaFiles {
    fs: Arc<dyn Fs>,
    /// Whether the current copy of each file this process wrote by rename is durable
    /// (ordered, so the files under one directory are one range: `make_durable_under`),
    /// each behind its own lock, held across that file's write and fsyncs.
    durable: Arc<Mutex<BTreeMap<PathBuf, RenamedCell>>>,
    /// What this process knows of each file it wrote in place, each behind its own lock
    /// (held across that file's write and fsync), so one file's fsync does not hold up
    /// another's write: consumers confirming acks at once fsync side by side.
    slots: Arc<Mutex<BTreeMap<PathBuf, SlotCell>>>,
}

/// One file's slots; None until this process has looked at the files (or after they
/// went).
type SlotCell = Arc<Mutex<Option<Slots>>>;

/// Whether a file this process replaced by rename is durable; None: not known (never
/// written by this process, or its name may not be durable yet).
type RenamedCell = Arc<Mutex<Option<bool>>>;

/// `path`'s cell in `map`, made on its first use.
fn cell<T: Default>(map: &Mutex<BTreeMap<PathBuf, Arc<Mutex<T>>>>, path: &Path) -> Arc<Mutex<T>> {
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    // (No new key per write: a consumer's state is written per confirmed ack.)
    match map.get(path) {
        Some(c) => c.clone(),
        None => map.entry(path.to_path_buf()).or_default().clone(),
    }
}

/// The cells of the files at or under `dir`.
fn cells_under<T>(
    map: &Mutex<BTreeMap<PathBuf, Arc<Mutex<T>>>>,
    dir: &Path,
) -> Vec<(PathBuf, Arc<Mutex<T>>)> {
    map.lock()
        .unwrap_or_else(|e| e.into_inner())
        .range(dir.to_path_buf()..)
        .take_while(|(p, _)| p.starts_with(dir))
        .map(|(p, c)| (p.clone(), c.clone()))
        .collect()
}

impl Default for MetaFiles {
    fn default() -> Self {
        MetaFiles::new()
    }
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

fn slot_path(path: &Path, slot: usize) -> PathBuf {
    if slot == 0 {
        path.to_path_buf()
    } else {
        sibling(path, ALT)
    }
}

fn checksum(gen: u64, body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&gen.to_le_bytes());
    h.update(body);
    h.finalize()
}

/// The generation and body if `b` holds a complete copy whose checksum matches.
fn verify(b: &[u8]) -> Result<(u64, Vec<u8>), String> {
    let nl = b
        .iter()
        .take(80)
        .position(|&c| c == b'\n')
        .ok_or("no header")?;
    let head = std::str::from_utf8(&b[..nl]).map_err(|_| "bad header")?;
    let mut parts = head.split(' ');
    let v1 = match parts.next() {
        Some(MAGIC) => false,
        Some(MAGIC1) => true,
        _ => return Err("bad header".into()),
    };
    let len: usize = parts
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or("bad length")?;
    let crc = parts
        .next()
        .and_then(|v| u32::from_str_radix(v, 16).ok())
        .ok_or("bad checksum field")?;
    let rest = &b[nl + 1..];
    if v1 {
        if rest.len() != len {
            return Err(format!("length {} instead of {len}", rest.len()));
        }
        if crc32fast::hash(rest) != crc {
            return Err("checksum mismatch".into());
        }
        return Ok((0, rest.to_vec()));
    }
    let gen: u64 = parts
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or("bad generation")?;
    // Bytes past the copy are what a longer earlier copy left.
    let body = rest
        .get(..len)
        .ok_or_else(|| format!("length {} instead of {len}", rest.len()))?;
    if checksum(gen, body) != crc {
        return Err("checksum mismatch".into());
    }
    Ok((gen, body.to_vec()))
}

/// A renamed file's content: the older header (generation 0), then the body.
fn frame1(body: &[u8]) -> Vec<u8> {
    let mut buf = format!("{MAGIC1} {} {:08x}\n", body.len(), crc32fast::hash(body)).into_bytes();
    buf.extend_from_slice(body);
    buf
}

/// A slot's copy for `body` at generation `gen`: header, then the body.
fn frame(gen: u64, body: &[u8]) -> Vec<u8> {
    let mut buf =
        format!("{MAGIC} {} {:08x} {gen}\n", body.len(), checksum(gen, body)).into_bytes();
    buf.extend_from_slice(body);
    buf
}

enum Copy {
    Missing,
    Ok(u64, Vec<u8>),
    /// No header at all: a file from before checksums.
    Legacy(Vec<u8>),
    Bad(String),
}

impl Copy {
    /// The generation of a copy that can be used.
    fn gen(&self) -> Option<u64> {
        match self {
            Copy::Ok(g, _) => Some(*g),
            Copy::Legacy(_) => Some(0),
            Copy::Missing | Copy::Bad(_) => None,
        }
    }
}

/// Marks a directory `retire` renamed (stream and consumer names have no `.`).
const RETIRED: &str = ".deleted.";

impl MetaFiles {
    /// On the real filesystem.
    pub fn new() -> MetaFiles {
        Self::on(Arc::new(StdFs))
    }

    /// On `disk`.
    pub fn on_disk(disk: &crate::io::Disk) -> MetaFiles {
        Self::on(disk.fs())
    }

    pub(crate) fn on(fs: Arc<dyn Fs>) -> MetaFiles {
        MetaFiles {
            fs,
            durable: Arc::default(),
            slots: Arc::default(),
        }
    }

    #[cfg(test)]
    pub(crate) fn with_fs(fs: Arc<dyn Fs>) -> MetaFiles {
        Self::on(fs)
    }

    /// Every name a copy of `path` may have (slots, interrupted writes, an older Keel's
    /// fallback), for moving a damaged file's copies aside.
    pub fn copies(path: &Path) -> Vec<PathBuf> {
        ["", ALT, ".tmp", ".alt.tmp", ".prev", ".prev.tmp"]
            .iter()
            .map(|s| sibling(path, s))
            .collect()
    }

    fn load(&self, path: &Path) -> Copy {
        let f = match self.fs.open(path, false) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Copy::Missing,
            Err(e) => return Copy::Bad(format!("unreadable: {e}")),
        };
        let mut b = match f.len() {
            Ok(n) => vec![0; n as usize],
            Err(e) => return Copy::Bad(format!("unreadable: {e}")),
        };
        if let Err(e) = f.read_at(&mut b, 0) {
            return Copy::Bad(format!("unreadable: {e}"));
        }
        if !b.starts_with(b"KEELMETA") && b.first() == Some(&b'{') {
            return Copy::Legacy(b);
        }
        match verify(&b) {
            Ok((gen, body)) => Copy::Ok(gen, body),
            Err(why) => Copy::Bad(why),
        }
    }

    /// What the files of `path` hold, for its first write by this process.
    fn scan(&self, path: &Path) -> io::Result<Slots> {
        let mut c = [self.load(path), self.load(&slot_path(path, 1))];
        let tmp = sibling(path, ".tmp");
        if c[0].gen().is_none() {
            // A good `.tmp` newer than every slot is an interrupted write (the newest
            // state): finish it rather than overwrite it.
            let t = self.load(&tmp);
            if let Some(g) = t.gen().filter(|&g| c[1].gen().is_none_or(|g1| g > g1)) {
                self.fs.rename(&tmp, path)?;
                c[0] = Copy::Ok(g, Vec::new());
            }
        }
        let mut s = Slots {
            exists: [
                !matches!(c[0], Copy::Missing),
                !matches!(c[1], Copy::Missing),
            ],
            ..Slots::default()
        };
        for (i, copy) in c.iter().enumerate() {
            if let Some(g) = copy.gen() {
                if s.keep.is_none() || g > s.gen {
                    s.keep = Some(i);
                    s.gen = g;
                }
            }
        }
        Ok(s)
    }

    /// Replaces `path` with `body` by a rename (for files written now and then: configs,
    /// a Raft log's vote). With `durable`, the new content and its directory entry are on
    /// disk when this returns.
    pub fn write(&self, path: &Path, body: &[u8], durable: bool) -> io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        self.fs.create_dir_all(dir)?;
        if self.fs.open(&slot_path(path, 1), false).is_ok() {
            // Written in place before: it stays so (a renamed copy would read as older).
            return self.overwrite(path, body, durable);
        }
        // What an in-place write knew no longer holds once a rename replaces the file.
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(path);
        let tmp = sibling(path, ".tmp");
        let cell = cell(&self.durable, path);
        let mut known = cell.lock().unwrap_or_else(|e| e.into_inner());
        if known.is_none() && !matches!(self.load(path), Copy::Ok(..)) {
            // A good `.tmp` with no good current copy is an interrupted write (the newest
            // state): finish it rather than overwrite it.
            if let Copy::Ok(..) = self.load(&tmp) {
                self.fs.rename(&tmp, path)?;
            }
        }
        let mut f = self.fs.open(&tmp, true)?;
        f.truncate(0)?;
        f.write_at(&frame1(body), 0)?;
        if durable {
            f.sync()?;
        }
        drop(f);
        // The current copy (if it verifies: a damaged one must not push out the last good
        // copy) becomes the fallback. Before a write that skips the fsync replaces a copy
        // that is (or may be) durable, it is copied there durably: the current name must
        // keep naming a durable copy until the replacing rename, and the fallback must be
        // durable once it is not. Before a durable write a plain copy does: the new
        // current copy is the durable one.
        if durable || *known != Some(false) {
            if let Copy::Ok(_, old) = self.load(path) {
                let ptmp = sibling(path, ".prev.tmp");
                let mut f = self.fs.open(&ptmp, true)?;
                f.truncate(0)?;
                f.write_at(&frame1(&old), 0)?;
                if !durable {
                    f.sync()?;
                }
                drop(f);
                self.fs.rename(&ptmp, &sibling(path, ".prev"))?;
                if !durable {
                    self.fs.sync_dir(dir)?;
                }
            }
        }
        self.fs.rename(&tmp, path)?;
        if durable {
            // Until the directory is synced the new copy's name may not be durable.
            *known = None;
            self.fs.sync_dir(dir)?;
        }
        *known = Some(durable);
        Ok(())
    }

    /// Replaces `path` with `body` by writing one of its slots in place (for files written
    /// often: a consumer's state, per ack). With `durable`, the new content and its name
    /// are on disk when this returns.
    pub fn overwrite(&self, path: &Path, body: &[u8], durable: bool) -> io::Result<()> {
        // What a rename knew no longer holds once a slot is written.
        self.durable
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(path);
        let cell = cell(&self.slots, path);
        let mut known = cell.lock().unwrap_or_else(|e| e.into_inner());
        let mut s = match *known {
            Some(s) => s,
            None => {
                let dir = path.parent().unwrap_or(Path::new("."));
                self.fs.create_dir_all(dir)?;
                self.scan(path)?
            }
        };
        s.gen += 1;
        let slot = s.keep.map_or(0, |k| 1 - k);
        let r = self.put(path, slot, &frame(s.gen, body), durable, &mut s);
        match r {
            Ok(()) => {
                s.failed = false;
                if durable {
                    s.keep = Some(slot);
                    s.newer = None;
                } else {
                    s.newer = Some(slot);
                }
            }
            Err(_) => s.failed = true,
        }
        *known = Some(s);
        r
    }

    /// Syncs `path`'s newer slot, under its lock: the lock keeps a write from going into
    /// that slot between its fsync and its becoming the kept copy.
    fn durable_slot(&self, path: &Path, cell: &SlotCell) -> io::Result<bool> {
        let mut known = cell.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = known.as_mut() else {
            return Ok(false);
        };
        if s.failed {
            return Err(io::Error::other(format!(
                "the last write of {} failed",
                path.display()
            )));
        }
        let Some(slot) = s.newer else {
            return Ok(false);
        };
        match self.fs.open(&slot_path(path, slot), false) {
            Ok(mut f) => f.sync()?,
            // Removed since (its directory went): nothing left to make durable.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                *known = None;
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        if !s.named[slot] {
            self.fs.sync_dir(path.parent().unwrap_or(Path::new(".")))?;
        }
        s.keep = s.newer.take();
        s.named = [s.exists[0], s.exists[1]];
        Ok(true)
    }

    /// Writes one slot: in place, or (a slot not made yet) through `<slot>.tmp`.
    fn put(
        &self,
        path: &Path,
        slot: usize,
        bytes: &[u8],
        durable: bool,
        s: &mut Slots,
    ) -> io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let name = slot_path(path, slot);
        if s.exists[slot] {
            let mut f = match self.fs.open(&name, false) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    // Removed behind our back: made again below.
                    s.exists[slot] = false;
                    s.lens[slot] = None;
                    return self.put(path, slot, bytes, durable, s);
                }
                r => r?,
            };
            // The slot's length as this process left it (read once), not a stat per write.
            let len = match s.lens[slot] {
                Some(l) => l,
                None => f.len()?,
            };
            s.lens[slot] = None;
            f.write_at(bytes, 0)?;
            let mut len = len.max(bytes.len() as u64);
            if len > 2 * bytes.len() as u64 + SHRINK_SLACK {
                f.truncate(bytes.len() as u64)?;
                len = bytes.len() as u64;
            }
            s.lens[slot] = Some(len);
            if durable {
                f.sync()?;
            }
        } else {
            let tmp = sibling(&name, ".tmp");
            // (Its directory may have gone behind our back too.)
            self.fs.create_dir_all(dir)?;
            let mut f = self.fs.open(&tmp, true)?;
            f.truncate(0)?;
            f.write_at(bytes, 0)?;
            if durable {
                f.sync()?;
            }
            drop(f);
            self.fs.rename(&tmp, &name)?;
            s.exists[slot] = true;
            s.lens[slot] = Some(bytes.len() as u64);
            s.named[slot] = false;
        }
        if durable && !s.named[slot] {
            self.fs.sync_dir(dir)?;
            s.named = [s.exists[0], s.exists[1]];
        }
        Ok(())
    }

    /// Makes durable every file under `dir` whose newest copy this process wrote without
    /// fsync (content and name), so that a marker synced after this never runs ahead of
    /// them: a replicated stream's consumer state files, written without fsync (the
    /// group's log has them), before the store's applied marker moves past their entries.
    /// Fails while a file's last write failed (its newest copy may be torn). Returns how
    /// many were synced.
    pub fn make_durable_under(&self, dir: &Path) -> io::Result<usize> {
        Ok(self.renamed_durable_under(dir)? + self.slots_durable_under(dir)?)
    }

    fn renamed_durable_under(&self, dir: &Path) -> io::Result<usize> {
        let mut n = 0;
        // One file at a time under its own lock (its writer waits; others go on).
        for (p, c) in cells_under(&self.durable, dir) {
            let mut known = c.lock().unwrap_or_else(|e| e.into_inner());
            if *known != Some(false) {
                continue;
            }
            match self.fs.open(&p, false) {
                Ok(mut f) => f.sync()?,
                // Removed since (its directory went): nothing left to make durable.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    *known = None;
                    continue;
                }
                Err(e) => return Err(e),
            }
            self.fs.sync_dir(p.parent().unwrap_or(Path::new(".")))?;
            *known = Some(true);
            n += 1;
        }
        Ok(n)
    }

    fn slots_durable_under(&self, dir: &Path) -> io::Result<usize> {
        // One file at a time under its own lock (a write to another goes on meanwhile).
        let mut n = 0;
        for (p, c) in cells_under(&self.slots, dir) {
            if self.durable_slot(&p, &c)? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// The newest copy of `path` that verifies.
    pub fn read(&self, path: &Path) -> MetaRead {
        let names = ["", ALT];
        let c = [self.load(path), self.load(&slot_path(path, 1))];
        let bad: Vec<String> = c
            .iter()
            .zip(names)
            .filter_map(|(c, n)| match c {
                Copy::Bad(why) => Some(format!("{} copy: {why}", label(n))),
                _ => None,
            })
            .collect();
        let best = (0..2)
            .filter_map(|i| Some((c[i].gen()?, i)))
            .max_by_key(|&(g, i)| (g, std::cmp::Reverse(i)));
        if let Some((_, i)) = best {
            let [a, b] = c;
            let copy = if i == 0 { a } else { b };
            return match copy {
                Copy::Ok(_, body) if bad.is_empty() => MetaRead::Current(body),
                Copy::Ok(_, body) => MetaRead::Older {
                    body,
                    damage: format!("{}; using the {} copy", bad.join("; "), label(names[i])),
                },
                Copy::Legacy(b) => MetaRead::Unchecked(b),
                Copy::Missing | Copy::Bad(_) => unreachable!("has a generation"),
            };
        }
        let damage = if bad.is_empty() {
            "missing".to_string()
        } else {
            bad.join("; ")
        };
        let mut others = Vec::new();
        let mut found: Option<(u64, &str, Vec<u8>)> = None;
        for suffix in [".tmp", ".alt.tmp", ".prev"] {
            match self.load(&sibling(path, suffix)) {
                // The newest interrupted write, else the older Keel's fallback.
                Copy::Ok(g, body) if found.as_ref().is_none_or(|(fg, _, _)| g > *fg) => {
                    found = Some((g, suffix, body))
                }
                // With no slot at all, a `.tmp` that does not verify is a first write cut
                // short (a full disk, a crash before its rename): nothing was ever written
                // whole, so nothing was lost.
                Copy::Bad(_) if bad.is_empty() && suffix != ".prev" => {}
                Copy::Bad(w) => others.push(format!("{suffix} copy: {w}")),
                _ => {}
            }
        }
        if let Some((_, suffix, body)) = found {
            return MetaRead::Older {
                body,
                damage: format!("{damage}; using {suffix} copy"),
            };
        }
        if bad.is_empty() && others.is_empty() {
            return MetaRead::Missing;
        }
        let mut all = vec![damage];
        all.extend(others);
        MetaRead::Damaged(all.join("; "))
    }

    pub fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.fs.create_dir_all(dir)
    }

    /// Makes the directory's entries durable (after creating it, say).
    pub fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.fs.sync_dir(dir)
    }

    /// Renames `from` to `to` (same filesystem).
    pub fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.forget(from);
        self.forget(to);
        self.fs.rename(from, to)
    }

    /// Removes a stream's or consumer's directory so that it cannot come back: `retire`,
    /// then removed. A missing directory is not an error.
    pub fn retire_dir(&self, dir: &Path) -> io::Result<()> {
        match self.retire(dir)? {
            Some(gone) => self.remove_dir_all(&gone),
            None => Ok(()),
        }
    }

    /// Renames `dir` to a name no stream or consumer can have (one step, made durable) and
    /// returns that name, for the caller to remove (`None`: there was no `dir`). A removal
    /// that fails part way after it, or a crash during it, leaves a directory that the next
    /// start removes instead of loading (`is_retired`).
    pub fn retire(&self, dir: &Path) -> io::Result<Option<PathBuf>> {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let (Some(name), Some(parent)) = (name, dir.parent()) else {
            return Err(io::Error::other(format!("{} has no name", dir.display())));
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        // The name shortened (a name may have 255 bytes, as long as a file name may be).
        let mut end = name.len().min(64);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let short = &name[..end];
        let gone = parent.join(format!("{short}{RETIRED}{nanos}"));
        match self.rename(dir, &gone) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            r => r?,
        }
        self.sync_dir(parent)?;
        Ok(Some(gone))
    }

    /// Whether `dir` is one `retire` left behind (to remove, never to load).
    pub fn is_retired(dir: &Path) -> bool {
        dir.file_name()
            .is_some_and(|n| n.to_string_lossy().contains(RETIRED))
    }

    /// Removes `dir` and everything in it; a missing directory is not an error.
    pub fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.forget(dir);
        self.fs.remove_dir_all(dir)
    }

    /// What this process knew of the files at or under `path` no longer holds (they went,
    /// or something else takes their names): the next write looks again.
    fn forget(&self, path: &Path) {
        fn under<T>(map: &Mutex<BTreeMap<PathBuf, T>>, path: &Path) {
            let mut known = map.lock().unwrap_or_else(|e| e.into_inner());
            let gone: Vec<PathBuf> = known
                .range(path.to_path_buf()..)
                .take_while(|(p, _)| p.starts_with(path))
                .map(|(p, _)| p.clone())
                .collect();
            for p in gone {
                known.remove(&p);
            }
        }
        under(&self.durable, path);
        under(&self.slots, path);
    }
}

/// How a read names a slot.
fn label(suffix: &str) -> &str {
    if suffix.is_empty() {
        "main"
    } else {
        suffix
    }
}
