//! Small metadata files the server reads back (stream and consumer configs, consumer
//! state), written through the same [`Fs`] seam as the segments so the fault-injection
//! tests cover them.
//!
//! Each file is `KEELMETA1 <length> <crc32 hex>\n` followed by the body (JSON, so an
//! operator can still read it). A write goes to `<name>.tmp`, optionally fsynced, and is
//! renamed over `<name>`. `<name>.prev` holds an older good copy: before a durable write,
//! and before a write that skips the fsync replaces a current copy that is (or may be)
//! durable, the current copy is copied there (durably in the second case, so such writes
//! can never leave the last durable version unreadable after a power failure). A read takes the newest copy
//! that verifies: the current one, else a `.tmp` left by an interrupted write (always
//! newer), else `.prev`. Falling back to an older copy is what keeps a consumer
//! at-least-once when its state file is damaged: the older state has a lower ack floor,
//! so it redelivers (duplicates) rather than skips.

use crate::io::{Fs, StdFs};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const MAGIC: &str = "KEELMETA1";

/// What [`MetaFiles::read`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaRead {
    /// No copy of the file exists.
    Missing,
    /// The current copy, checksum verified.
    Current(Vec<u8>),
    /// The current copy is missing or damaged (`damage` says how); `body` is an older
    /// copy that verified.
    Older { body: Vec<u8>, damage: String },
    /// Copies exist but none verifies.
    Damaged(String),
    /// The current copy has no checksum header (written by a Keel from before
    /// checksums); its content cannot be verified.
    Unchecked(Vec<u8>),
}

/// Checksummed, atomically replaced metadata files.
#[derive(Clone)]
pub struct MetaFiles {
    fs: Arc<dyn Fs>,
    /// Whether the current copy of each file this process wrote is durable (ordered, so
    /// the files under one directory are one range: `make_durable_under`).
    durable: Arc<Mutex<BTreeMap<PathBuf, bool>>>,
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

/// The body if `b` is a complete file whose checksum matches.
fn verify(b: &[u8]) -> Result<Vec<u8>, String> {
    let nl = b
        .iter()
        .take(64)
        .position(|&c| c == b'\n')
        .ok_or("no header")?;
    let head = std::str::from_utf8(&b[..nl]).map_err(|_| "bad header")?;
    let mut parts = head.split(' ');
    if parts.next() != Some(MAGIC) {
        return Err("bad header".into());
    }
    let len: usize = parts
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or("bad length")?;
    let crc = parts
        .next()
        .and_then(|v| u32::from_str_radix(v, 16).ok())
        .ok_or("bad checksum field")?;
    let body = &b[nl + 1..];
    if body.len() != len {
        return Err(format!("length {} instead of {len}", body.len()));
    }
    if crc32fast::hash(body) != crc {
        return Err("checksum mismatch".into());
    }
    Ok(body.to_vec())
}

/// The file content for `body`: header, then the body.
fn frame(body: &[u8]) -> Vec<u8> {
    let mut buf = format!("{MAGIC} {} {:08x}\n", body.len(), crc32fast::hash(body)).into_bytes();
    buf.extend_from_slice(body);
    buf
}

enum Copy {
    Missing,
    Ok(Vec<u8>),
    Legacy(Vec<u8>),
    Bad(String),
}

impl MetaFiles {
    /// On the real filesystem.
    pub fn new() -> MetaFiles {
        Self::on(Arc::new(StdFs))
    }

    pub(crate) fn on(fs: Arc<dyn Fs>) -> MetaFiles {
        MetaFiles {
            fs,
            durable: Arc::default(),
        }
    }

    #[cfg(test)]
    pub(crate) fn with_fs(fs: Arc<dyn Fs>) -> MetaFiles {
        Self::on(fs)
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
        if !b.starts_with(MAGIC.as_bytes()) && b.first() == Some(&b'{') {
            return Copy::Legacy(b);
        }
        match verify(&b) {
            Ok(body) => Copy::Ok(body),
            Err(why) => Copy::Bad(why),
        }
    }

    /// Replaces `path` with `body`. With `durable`, the new content and its directory
    /// entry are on disk when this returns.
    pub fn write(&self, path: &Path, body: &[u8], durable: bool) -> io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        self.fs.create_dir_all(dir)?;
        let tmp = sibling(path, ".tmp");
        let mut known = self.durable.lock().unwrap_or_else(|e| e.into_inner());
        if !known.contains_key(path) && !matches!(self.load(path), Copy::Ok(_)) {
            // A good `.tmp` with no good current copy is an interrupted write (the newest
            // state): finish it rather than overwrite it.
            if let Copy::Ok(_) = self.load(&tmp) {
                self.fs.rename(&tmp, path)?;
            }
        }
        let mut f = self.fs.open(&tmp, true)?;
        f.truncate(0)?;
        f.write_at(&frame(body), 0)?;
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
        let state = known.get(path).copied();
        if durable || state != Some(false) {
            if let Copy::Ok(old) = self.load(path) {
                let ptmp = sibling(path, ".prev.tmp");
                let mut f = self.fs.open(&ptmp, true)?;
                f.truncate(0)?;
                f.write_at(&frame(&old), 0)?;
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
            known.remove(path);
            self.fs.sync_dir(dir)?;
        }
        known.insert(path.to_path_buf(), durable);
        Ok(())
    }

    /// Makes durable every file under `dir` that this process last wrote without fsync
    /// (their content and their names), so that a marker synced after this never runs
    /// ahead of them: a replicated stream's consumer state files, written without fsync
    /// (the group's log has them), before the store's applied marker moves past their
    /// entries. Returns how many were synced.
    pub fn make_durable_under(&self, dir: &Path) -> io::Result<usize> {
        let mut known = self.durable.lock().unwrap_or_else(|e| e.into_inner());
        let todo: Vec<PathBuf> = known
            .range(dir.to_path_buf()..)
            .take_while(|(p, _)| p.starts_with(dir))
            .filter(|(_, durable)| !**durable)
            .map(|(p, _)| p.clone())
            .collect();
        let mut dirs: Vec<PathBuf> = Vec::new();
        for p in &todo {
            match self.fs.open(p, false) {
                Ok(mut f) => f.sync()?,
                // Removed since (its directory went): nothing left to make durable.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    known.remove(p);
                    continue;
                }
                Err(e) => return Err(e),
            }
            if let Some(d) = p.parent() {
                if !dirs.iter().any(|x| x == d) {
                    dirs.push(d.to_path_buf());
                }
            }
        }
        for d in &dirs {
            self.fs.sync_dir(d)?;
        }
        for p in &todo {
            if let Some(v) = known.get_mut(p) {
                *v = true;
            }
        }
        Ok(todo.len())
    }

    /// The newest copy of `path` that verifies.
    pub fn read(&self, path: &Path) -> MetaRead {
        let why = match self.load(path) {
            Copy::Ok(b) => return MetaRead::Current(b),
            Copy::Legacy(b) => return MetaRead::Unchecked(b),
            Copy::Missing => None,
            Copy::Bad(why) => Some(why),
        };
        let damage = why.clone().unwrap_or_else(|| "missing".into());
        let mut others = Vec::new();
        for suffix in [".tmp", ".prev"] {
            match self.load(&sibling(path, suffix)) {
                Copy::Ok(body) => {
                    return MetaRead::Older {
                        body,
                        damage: format!("{damage}; using {suffix} copy"),
                    }
                }
                Copy::Bad(w) => others.push(format!("{suffix} copy: {w}")),
                Copy::Legacy(_) | Copy::Missing => {}
            }
        }
        match why {
            None if others.is_empty() => MetaRead::Missing,
            _ => {
                let mut all = vec![damage];
                all.extend(others);
                MetaRead::Damaged(all.join("; "))
            }
        }
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
        self.fs.rename(from, to)
    }

    /// Removes `dir` and everything in it; a missing directory is not an error.
    pub fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.fs.remove_dir_all(dir)
    }
}
