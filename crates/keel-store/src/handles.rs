//! A bounded cache of open segment files. A large stream has thousands of segments; holding
//! a descriptor for each would exhaust the process's limit, so at most `cap` stay open and
//! the least recently used is closed when another is needed. Pinned segments (the active
//! one, and any with writes not yet fdatasynced) are never closed: an fsync error must be
//! seen on the descriptor that wrote the data.

use crate::io::{Fs, FsFile};
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::PathBuf;

pub(crate) struct Handles {
    open: HashMap<u32, (Box<dyn FsFile>, u64)>,
    pinned: HashSet<u32>,
    tick: u64,
    cap: usize,
}

impl Handles {
    pub fn new(cap: usize) -> Handles {
        Handles {
            open: HashMap::new(),
            pinned: HashSet::new(),
            tick: 0,
            cap: cap.max(2),
        }
    }

    pub fn pin(&mut self, id: u32) {
        self.pinned.insert(id);
    }

    pub fn unpin(&mut self, id: u32) {
        self.pinned.remove(&id);
    }

    /// Adds a file opened elsewhere (a new segment).
    pub fn insert(&mut self, id: u32, f: Box<dyn FsFile>) {
        self.make_room();
        self.tick += 1;
        self.open.insert(id, (f, self.tick));
    }

    /// Takes segment `id`'s file out (a sync's job carries it meanwhile; it stays pinned).
    pub fn take(&mut self, id: u32) -> Option<Box<dyn FsFile>> {
        self.open.remove(&id).map(|(f, _)| f)
    }

    /// Puts a taken file back, in place of one a reader opened meanwhile.
    pub fn put(&mut self, id: u32, f: Box<dyn FsFile>) {
        if self.open.remove(&id).is_none() {
            self.make_room();
        }
        self.tick += 1;
        self.open.insert(id, (f, self.tick));
    }

    /// Closes the file of a deleted segment.
    pub fn forget(&mut self, id: u32) {
        self.open.remove(&id);
        self.pinned.remove(&id);
    }

    pub fn clear(&mut self) {
        self.open.clear();
        self.pinned.clear();
    }

    #[cfg(test)]
    pub fn open_count(&self) -> usize {
        self.open.len()
    }

    fn make_room(&mut self) {
        while self.open.len() >= self.cap {
            let victim = self
                .open
                .iter()
                .filter(|(id, _)| !self.pinned.contains(id))
                .min_by_key(|(_, (_, used))| *used)
                .map(|(&id, _)| id);
            match victim {
                Some(id) => {
                    self.open.remove(&id);
                }
                // Everything open is pinned: go over the cap rather than fail.
                None => return,
            }
        }
    }

    /// Runs `f` on segment `id`'s file, opening it (at `path`) if needed.
    pub fn with<T>(
        &mut self,
        fs: &dyn Fs,
        id: u32,
        path: impl FnOnce() -> PathBuf,
        f: impl FnOnce(&mut dyn FsFile) -> io::Result<T>,
    ) -> io::Result<T> {
        self.tick += 1;
        let tick = self.tick;
        if let Some((file, used)) = self.open.get_mut(&id) {
            *used = tick;
            return f(file.as_mut());
        }
        self.make_room();
        let mut file = fs.open(&path(), false)?;
        let r = f(file.as_mut());
        self.open.insert(id, (file, tick));
        r
    }
}
