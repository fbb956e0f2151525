//! The server-wide memory budget for per-message index entries read from disk.
//!
//! A file store keeps, per segment, a summary in memory and the entry of every message in
//! the segment's index file; entries are read in blocks of [`BLOCK`](crate::segtable::BLOCK)
//! when a query needs them and kept here, least recently used first out, within one byte
//! budget shared by every stream of the process. A block is kept the second time it is
//! read from disk within the last [`SEEN`] reads, not the first: a consumer reading a
//! stream from start to end reads each block once (its store holds the few it is reading),
//! and would otherwise fill the budget with blocks nobody asks for again. The blocks are immutable (liveness is
//! kept apart, in the segment's summary), so a reader takes one from the cache under the
//! lock and uses it without it. No publish takes this lock: appends go to the active
//! segment's entries, which its store owns.

use crate::segtable::Entry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The default budget: 64 MiB.
pub const DEFAULT_INDEX_CACHE: usize = 64 << 20;

pub(crate) type Block = Arc<[Entry]>;

/// Blocks read from disk lately that the cache did not keep: one read again while listed
/// is kept. 4,096 keys cover a million entries read once (about 200 KiB).
pub const SEEN: usize = 4096;

/// (segment instance, block number)
pub(crate) type Key = (u64, u32);

/// Counters for monitoring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexCacheStats {
    pub bytes: u64,
    pub budget: u64,
    pub blocks: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

#[derive(Default)]
struct Lru {
    map: BTreeMap<Key, (Block, u64)>,
    order: BTreeMap<u64, Key>,
    bytes: usize,
    tick: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    /// Keys read once lately (with when), oldest first (`SEEN` at most): a key listed
    /// again after it was kept and evicted goes out with its newer listing, not the old.
    seen: std::collections::HashMap<Key, u64>,
    seen_order: std::collections::VecDeque<(Key, u64)>,
}

/// A byte-bounded LRU of index blocks, shared by the file stores that use it.
pub struct IndexCache {
    inner: Mutex<Lru>,
    budget: AtomicUsize,
}

/// An [`IndexCache`] handed to file stores through `FileStoreConfig` (compared by
/// identity, so the config stays comparable).
#[derive(Clone)]
pub struct SharedCache(pub Arc<IndexCache>);

impl PartialEq for SharedCache {
    fn eq(&self, o: &Self) -> bool {
        Arc::ptr_eq(&self.0, &o.0)
    }
}

impl Eq for SharedCache {}

impl std::fmt::Debug for SharedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedCache({} bytes)", self.0.budget())
    }
}
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// A fresh segment-instance id: every change to a segment's entries gets a new one, so a
/// stale block can never be found under it.
pub(crate) fn next_uid() -> u64 {
    NEXT_UID.fetch_add(1, Ordering::Relaxed)
}

fn block_bytes(b: &Block) -> usize {
    std::mem::size_of_val::<[Entry]>(b) + 64
}

impl IndexCache {
    pub fn new(budget: usize) -> Arc<IndexCache> {
        Arc::new(IndexCache {
            inner: Mutex::new(Lru::default()),
            budget: AtomicUsize::new(budget),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the budget; shrinking evicts at once.
    pub fn set_budget(&self, bytes: usize) {
        self.budget.store(bytes, Ordering::Relaxed);
        let mut l = self.lock();
        Self::evict(&mut l, bytes);
    }

    pub fn budget(&self) -> usize {
        self.budget.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> IndexCacheStats {
        let l = self.lock();
        IndexCacheStats {
            bytes: l.bytes as u64,
            budget: self.budget() as u64,
            blocks: l.map.len() as u64,
            hits: l.hits,
            misses: l.misses,
            evictions: l.evictions,
        }
    }

    fn evict(l: &mut Lru, budget: usize) {
        while l.bytes > budget {
            let Some((_, key)) = l.order.pop_first() else {
                break;
            };
            if let Some((b, _)) = l.map.remove(&key) {
                l.bytes -= block_bytes(&b);
                l.evictions += 1;
            }
        }
    }

    pub(crate) fn get(&self, key: Key) -> Option<Block> {
        let mut l = self.lock();
        let l = &mut *l;
        l.tick += 1;
        let tick = l.tick;
        match l.map.get_mut(&key) {
            Some((b, used)) => {
                l.order.remove(used);
                *used = tick;
                l.order.insert(tick, key);
                l.hits += 1;
                Some(b.clone())
            }
            None => {
                l.misses += 1;
                None
            }
        }
    }

    /// Offers a block just read from disk: kept if it was read once already lately.
    pub(crate) fn offer(&self, key: Key, b: Block) {
        {
            let mut l = self.lock();
            let l = &mut *l;
            if l.seen.remove(&key).is_none() {
                if l.seen_order.len() >= SEEN {
                    if let Some((old, at)) = l.seen_order.pop_front() {
                        if l.seen.get(&old) == Some(&at) {
                            l.seen.remove(&old);
                        }
                    }
                }
                l.tick += 1;
                let at = l.tick;
                l.seen.insert(key, at);
                l.seen_order.push_back((key, at));
                return;
            }
        }
        self.put(key, b)
    }

    /// Keeps a block (one that cost more than a read: rebuilt from a segment's records).
    pub(crate) fn put(&self, key: Key, b: Block) {
        let budget = self.budget();
        let size = block_bytes(&b);
        if size > budget {
            return;
        }
        let mut l = self.lock();
        let l = &mut *l;
        l.tick += 1;
        let tick = l.tick;
        if let Some((old, used)) = l.map.insert(key, (b, tick)) {
            l.order.remove(&used);
            l.bytes -= block_bytes(&old);
        }
        l.order.insert(tick, key);
        l.bytes += size;
        Self::evict(l, budget);
    }

    /// Drops every block of a segment instance (deleted, rewritten or closed).
    pub(crate) fn forget(&self, uid: u64) {
        let mut l = self.lock();
        let l = &mut *l;
        let keys: Vec<Key> = l
            .map
            .range((uid, 0)..=(uid, u32::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some((b, used)) = l.map.remove(&k) {
                l.order.remove(&used);
                l.bytes -= block_bytes(&b);
            }
        }
    }
}
