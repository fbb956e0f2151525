//! A simulated filesystem for fault injection, in the style of deterministic storage
//! simulation. Each file keeps its synced bytes and the writes made since its last sync;
//! the directory keeps its durable entries and the live ones. A simulated power failure
//! keeps, per file, a random prefix of the unsynced writes (possibly tearing the last one
//! part-way) and, per name, either the durable or the live directory entry. It can also flip
//! bits in synced data, and make every operation fail after a countdown (the process dies
//! mid-operation).

use crate::io::{Fs, FsFile};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// splitmix64: small, seedable, good enough for choosing faults.
#[derive(Clone)]
pub(crate) struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
}

enum Pending {
    Write(u64, Vec<u8>),
    Truncate(u64),
}

#[derive(Default)]
struct Inode {
    data: Vec<u8>,
    synced: Vec<u8>,
    pending: Vec<Pending>,
}

fn apply(buf: &mut Vec<u8>, p: &Pending, keep: Option<usize>) {
    match p {
        Pending::Write(off, b) => {
            let b = &b[..keep.unwrap_or(b.len()).min(b.len())];
            let end = *off as usize + b.len();
            if buf.len() < end {
                buf.resize(end, 0);
            }
            buf[*off as usize..end].copy_from_slice(b);
        }
        Pending::Truncate(len) => buf.resize(*len as usize, 0),
    }
}

struct Sim {
    inodes: BTreeMap<u64, Inode>,
    live: BTreeMap<PathBuf, u64>,
    durable: BTreeMap<PathBuf, u64>,
    next_ino: u64,
    /// Bumped by every crash; handles from before are dead.
    gen: u64,
    rng: Rng,
    /// Operations left before every operation fails (until the next crash).
    fail_in: Option<u64>,
    pub syncs: u64,
    /// Allocations asked for: with zeros written, and without (fallocate).
    pub allocations: (u64, u64),
    handles: u64,
    max_handles: u64,
    /// Directories an open store owns (`Fs::lock`).
    locked: std::collections::BTreeSet<PathBuf>,
    /// Directory renames whose parent was not synced since: a crash keeps each whole or
    /// undoes it whole.
    renames: Vec<(PathBuf, PathBuf)>,
}

/// Moves every entry of `map` under `from` to the same place under `to`; true if any.
fn move_under(map: &mut BTreeMap<PathBuf, u64>, from: &Path, to: &Path) -> bool {
    let under: Vec<PathBuf> = map
        .keys()
        .filter(|p| p.starts_with(from))
        .cloned()
        .collect();
    for p in &under {
        let i = map.remove(p).unwrap();
        map.insert(to.join(p.strip_prefix(from).unwrap()), i);
    }
    !under.is_empty()
}

/// A `SimFs` lock: released when dropped.
struct SimLock(SimFs, PathBuf);

impl Drop for SimLock {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0 .0.lock() {
            s.locked.remove(&self.1);
        }
    }
}

impl Sim {
    fn tick(&mut self) -> io::Result<()> {
        match &mut self.fail_in {
            Some(0) => Err(io::Error::other("injected failure")),
            Some(n) => {
                *n -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// The seeds a simulation test runs: `cases(default)` of them from `KEEL_SIM_SEED` (0).
/// Opens (recovers) the file store at `/s` on `sim`.
pub(crate) fn open(
    sim: &SimFs,
    cfg: &crate::FileStoreConfig,
) -> (crate::FileStore, crate::RecoveryReport) {
    crate::FileStore::open_fs(
        Arc::new(sim.clone()),
        Path::new("/s"),
        crate::Limits::default(),
        cfg.clone(),
    )
    .unwrap()
}

pub(crate) fn seeds(default: u64) -> std::ops::Range<u64> {
    let base: u64 = std::env::var("KEEL_SIM_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    base..base + cases(default)
}

/// How many seeded cases a simulation test runs: `KEEL_SIM_CASES`, or `default`.
pub(crate) fn cases(default: u64) -> u64 {
    std::env::var("KEEL_SIM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone)]
pub(crate) struct SimFs(Arc<Mutex<Sim>>);

pub(crate) struct CrashReport {
    pub flipped: usize,
}

impl SimFs {
    pub fn new(seed: u64) -> SimFs {
        SimFs(Arc::new(Mutex::new(Sim {
            inodes: BTreeMap::new(),
            live: BTreeMap::new(),
            durable: BTreeMap::new(),
            next_ino: 1,
            gen: 0,
            rng: Rng(seed ^ 0x5EED),
            fail_in: None,
            syncs: 0,
            allocations: (0, 0),
            handles: 0,
            max_handles: 0,
            locked: std::collections::BTreeSet::new(),
            renames: Vec::new(),
        })))
    }

    /// Every operation after the next `n` fails until the next crash (or `heal`).
    pub fn fail_after(&self, n: u64) {
        self.0.lock().unwrap().fail_in = Some(n);
    }

    /// Operations work again (a full disk got space back).
    pub fn heal(&self) {
        self.0.lock().unwrap().fail_in = None;
    }

    /// Test helper: the durable content of `path` loses everything from `len` on (a disk
    /// or a restore that lost synced data).
    pub fn chop(&self, path: &Path, len: usize) {
        let mut s = self.0.lock().unwrap();
        if let Some(&ino) = s.live.get(path) {
            let i = s.inodes.get_mut(&ino).unwrap();
            i.synced.truncate(len);
            i.data.truncate(len);
        }
    }

    /// Test helper: `path` is gone for good.
    pub fn lose(&self, path: &Path) {
        let mut s = self.0.lock().unwrap();
        s.live.remove(path);
        s.durable.remove(path);
    }

    /// Test helper: overwrites durable bytes of `path` at `off`.
    pub fn scribble(&self, path: &Path, off: usize, bytes: &[u8]) {
        let mut s = self.0.lock().unwrap();
        if let Some(&ino) = s.live.get(path) {
            let i = s.inodes.get_mut(&ino).unwrap();
            for (k, b) in bytes.iter().enumerate() {
                if let Some(x) = i.synced.get_mut(off + k) {
                    *x = *b;
                }
                if let Some(x) = i.data.get_mut(off + k) {
                    *x = *b;
                }
            }
        }
    }

    /// File handles open now, and the most open at once (for the descriptor bound).
    pub fn handles(&self) -> (u64, u64) {
        let s = self.0.lock().unwrap();
        (s.handles, s.max_handles)
    }

    /// Allocations asked for so far: (zeros written, fallocate).
    pub fn allocations(&self) -> (u64, u64) {
        self.0.lock().unwrap().allocations
    }

    pub fn syncs(&self) -> u64 {
        self.0.lock().unwrap().syncs
    }

    /// Power failure. `flips` bits of synced data are flipped afterwards.
    pub fn crash(&self, flips: usize) -> CrashReport {
        let mut s = self.0.lock().unwrap();
        let s = &mut *s;
        s.gen += 1;
        s.fail_in = None;
        let trace = std::env::var_os("KEEL_SIM_TRACE").is_some();
        for (num, ino) in s.inodes.iter_mut() {
            if trace && !ino.pending.is_empty() {
                let ops: Vec<String> = ino
                    .pending
                    .iter()
                    .map(|p| match p {
                        Pending::Write(o, b) => format!("w{o}+{}", b.len()),
                        Pending::Truncate(l) => format!("t{l}"),
                    })
                    .collect();
                eprintln!("   inode {num} pending: {}", ops.join(" "));
            }
            let n = ino.pending.len() as u64;
            let k = s.rng.below(n + 1) as usize;
            let tear = k > 0 && s.rng.chance(3);
            let mut img = std::mem::take(&mut ino.synced);
            for (i, p) in ino.pending.iter().enumerate().take(k) {
                let keep = if tear && i == k - 1 {
                    match p {
                        Pending::Write(_, b) => Some(s.rng.below(b.len() as u64 + 1) as usize),
                        Pending::Truncate(_) => None,
                    }
                } else {
                    None
                };
                apply(&mut img, p, keep);
            }
            ino.pending.clear();
            ino.data = img.clone();
            ino.synced = img;
        }
        for (from, to) in std::mem::take(&mut s.renames) {
            if s.rng.chance(2) {
                move_under(&mut s.durable, &from, &to);
            } else {
                move_under(&mut s.live, &to, &from);
            }
        }
        let names: BTreeSet<PathBuf> = s.live.keys().chain(s.durable.keys()).cloned().collect();
        let mut out = BTreeMap::new();
        for n in names {
            let pick = if s.rng.chance(2) {
                s.live.get(&n)
            } else {
                s.durable.get(&n)
            };
            if let Some(&ino) = pick {
                out.insert(n, ino);
            }
        }
        s.live = out.clone();
        s.durable = out;
        let mut flipped = 0;
        let files: Vec<u64> = s.live.values().copied().collect();
        for _ in 0..flips {
            if files.is_empty() {
                break;
            }
            let ino = files[s.rng.below(files.len() as u64) as usize];
            let len = s.inodes[&ino].synced.len() as u64;
            if len == 0 {
                continue;
            }
            let at = s.rng.below(len) as usize;
            let bit = 1u8 << s.rng.below(8);
            let i = s.inodes.get_mut(&ino).unwrap();
            i.synced[at] ^= bit;
            i.data[at] ^= bit;
            flipped += 1;
        }
        CrashReport { flipped }
    }

    /// Test helper: (name, durable bytes) of every file.
    pub fn dump(&self) -> Vec<(PathBuf, Vec<u8>)> {
        let s = self.0.lock().unwrap();
        s.live
            .iter()
            .map(|(p, i)| (p.clone(), s.inodes[i].data.clone()))
            .collect()
    }

    /// Test helper: names currently in the directory.
    pub fn names(&self) -> Vec<PathBuf> {
        self.0.lock().unwrap().live.keys().cloned().collect()
    }
}

struct SimFile {
    sim: Arc<Mutex<Sim>>,
    ino: u64,
    gen: u64,
}

impl SimFile {
    fn with<T>(&self, f: impl FnOnce(&mut Sim, u64) -> io::Result<T>) -> io::Result<T> {
        let mut s = self.sim.lock().unwrap();
        if s.gen != self.gen {
            return Err(io::Error::other("stale handle after crash"));
        }
        f(&mut s, self.ino)
    }
}

impl Drop for SimFile {
    fn drop(&mut self) {
        if let Ok(mut s) = self.sim.lock() {
            s.handles -= 1;
        }
    }
}

impl FsFile for SimFile {
    fn len(&self) -> io::Result<u64> {
        self.with(|s, ino| Ok(s.inodes[&ino].data.len() as u64))
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.with(|s, ino| {
            let d = &s.inodes[&ino].data;
            let end = off as usize + buf.len();
            if end > d.len() {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short read"));
            }
            buf.copy_from_slice(&d[off as usize..end]);
            Ok(())
        })
    }
    fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()> {
        self.with(|s, ino| {
            s.tick()?;
            let p = Pending::Write(off, buf.to_vec());
            let i = s.inodes.get_mut(&ino).unwrap();
            apply(&mut i.data, &p, None);
            i.pending.push(p);
            Ok(())
        })
    }
    fn sync(&mut self) -> io::Result<()> {
        self.with(|s, ino| {
            s.tick()?;
            s.syncs += 1;
            let i = s.inodes.get_mut(&ino).unwrap();
            i.synced = i.data.clone();
            i.pending.clear();
            Ok(())
        })
    }
    fn allocate(&mut self, len: u64, write_zeros: bool) -> io::Result<()> {
        self.with(|s, ino| {
            s.tick()?;
            if write_zeros {
                s.allocations.0 += 1;
            } else {
                s.allocations.1 += 1;
            }
            let i = s.inodes.get_mut(&ino).unwrap();
            let cur = i.data.len() as u64;
            if len > cur {
                let p = Pending::Write(cur, vec![0; (len - cur) as usize]);
                apply(&mut i.data, &p, None);
                i.pending.push(p);
            }
            Ok(())
        })
    }
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.with(|s, ino| {
            s.tick()?;
            let p = Pending::Truncate(len);
            let i = s.inodes.get_mut(&ino).unwrap();
            apply(&mut i.data, &p, None);
            i.pending.push(p);
            Ok(())
        })
    }
}

impl Fs for SimFs {
    fn create_dir_all(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }
    fn lock(&self, dir: &Path) -> io::Result<Box<dyn Send>> {
        if !self.0.lock().unwrap().locked.insert(dir.to_path_buf()) {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} is in use by another open store", dir.display()),
            ));
        }
        Ok(Box::new(SimLock(self.clone(), dir.to_path_buf())))
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let s = self.0.lock().unwrap();
        Ok(s.live
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name()?.to_str().map(String::from))
            .collect())
    }
    fn open(&self, path: &Path, create: bool) -> io::Result<Box<dyn FsFile>> {
        let mut s = self.0.lock().unwrap();
        let ino = match s.live.get(path) {
            Some(&i) => i,
            None if create => {
                s.tick()?;
                let i = s.next_ino;
                s.next_ino += 1;
                s.inodes.insert(i, Inode::default());
                s.live.insert(path.to_path_buf(), i);
                i
            }
            None => return Err(io::Error::new(io::ErrorKind::NotFound, "no such file")),
        };
        s.handles += 1;
        s.max_handles = s.max_handles.max(s.handles);
        Ok(Box::new(SimFile {
            sim: self.0.clone(),
            ino,
            gen: s.gen,
        }))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut s = self.0.lock().unwrap();
        s.tick()?;
        s.live
            .remove(path)
            .map(|_| ())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such file"))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.0.lock().unwrap();
        s.tick()?;
        if let Some(i) = s.live.remove(from) {
            s.live.insert(to.to_path_buf(), i);
            return Ok(());
        }
        // A directory (the sim has no directory entries): its files move; the move is
        // durable once the parent is synced (a crash before keeps it whole or undoes it).
        if !move_under(&mut s.live, from, to) {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no such file"));
        }
        s.renames.push((from.to_path_buf(), to.to_path_buf()));
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.0.lock().unwrap();
        s.tick()?;
        let s = &mut *s;
        for (from, to) in std::mem::take(&mut s.renames) {
            if from.parent() == Some(dir) {
                move_under(&mut s.durable, &from, &to);
            } else {
                s.renames.push((from, to));
            }
        }
        s.durable.retain(|p, _| p.parent() != Some(dir));
        for (p, &i) in &s.live {
            if p.parent() == Some(dir) {
                s.durable.insert(p.clone(), i);
            }
        }
        Ok(())
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        // As a real one: file by file (each may fail), each removal durable only once its
        // directory is synced (a crash may bring any of them back).
        let mut s = self.0.lock().unwrap();
        let under: Vec<PathBuf> = s
            .live
            .keys()
            .filter(|p| p.starts_with(dir))
            .cloned()
            .collect();
        for p in under {
            s.tick()?;
            s.live.remove(&p);
        }
        Ok(())
    }
}
