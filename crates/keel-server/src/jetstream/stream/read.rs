//! A stream's store behind two kinds of handle. The actor holds the one [`WriteHandle`]:
//! it alone writes. Everyone else (consumers, the API's info and gets, direct gets,
//! monitoring, sources reading an origin) holds a [`ReadHandle`], which gives `&dyn Store`
//! for as long as one read takes.
//!
//! Both take the same short mutex (a store's reads update its caches, so reads are not
//! shared). The actor holds it while it applies a batch and around the two halves of a
//! sync, never across the fsync itself: [`WriteHandle::sync`] writes out under the lock,
//! releases it, fsyncs (off the tokio worker's other work), and records the sync under the
//! lock again. So no reader ever waits behind a group commit's fsync.

use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use keel_store::{Store, StoreError};

type Cell = Mutex<Box<dyn Store>>;

/// Read access to a stream's store.
#[derive(Clone)]
pub struct ReadHandle(Arc<Cell>);

/// The store, locked for one read.
pub struct ReadGuard<'a>(MutexGuard<'a, Box<dyn Store>>);

impl Deref for ReadGuard<'_> {
    type Target = dyn Store;
    fn deref(&self) -> &(dyn Store + 'static) {
        &**self.0
    }
}

impl ReadHandle {
    pub fn read(&self) -> ReadGuard<'_> {
        ReadGuard(self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The actor's handle: the only way to write the store.
pub struct WriteHandle(Arc<Cell>, Arc<AtomicUsize>);

impl WriteHandle {
    /// `syncing` is the server's count of fsyncs running on tokio workers.
    pub fn new(store: Box<dyn Store>, syncing: Arc<AtomicUsize>) -> (WriteHandle, ReadHandle) {
        let cell = Arc::new(Mutex::new(store));
        (WriteHandle(cell.clone(), syncing), ReadHandle(cell))
    }

    /// A second writer for a replicated stream's state machine, which applies what the
    /// leader decided (never the actor's own decisions: see `raft::stream`).
    pub fn follower(&self) -> WriteHandle {
        WriteHandle(self.0.clone(), self.1.clone())
    }

    /// The store, locked for writing (keep it short: readers wait meanwhile).
    pub fn lock(&self) -> MutexGuard<'_, Box<dyn Store>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A sync with the fsync outside the lock (see the module docs). Same outcome as
    /// `Store::sync`: on failure the store has rolled back to its last completed sync.
    pub fn sync(&self) -> Result<(), StoreError> {
        let job = self.lock().begin_sync()?;
        let Some(mut job) = job else {
            return Ok(());
        };
        fsync(&self.1, || job.run());
        self.lock().finish_sync(job)
    }

    /// Takes the store out (to destroy it), leaving an empty memory store for any reader
    /// that still looks.
    pub fn take(&self) -> Box<dyn Store> {
        std::mem::replace(
            &mut *self.lock(),
            Box::new(keel_store::mem::MemStore::new(Default::default())),
        )
    }
}

/// Runs an fsync (`f`) from a tokio task. It blocks this worker. While another worker is
/// free that is cheapest: the answers then go out from this thread with no hand-off (one
/// publisher waiting for each ack: ~50 us and half the context switches). Once most
/// workers sit in an fsync, block_in_place moves this worker's other tasks to another
/// thread. `syncing` is the server's count of fsyncs running on workers.
pub fn fsync<T>(syncing: &AtomicUsize, f: impl FnOnce() -> T) -> T {
    let busy = syncing.fetch_add(1, Ordering::AcqRel) + 1;
    let r = if workers().is_some_and(|n| busy < n) {
        f()
    } else {
        blocking(f)
    };
    syncing.fetch_sub(1, Ordering::AcqRel);
    r
}

/// Runs blocking work (an fsync) on this thread, telling a multi-thread tokio runtime to
/// move its other tasks elsewhere meanwhile.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    if workers().is_some() {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// The worker threads of the current multi-thread tokio runtime (None outside one).
fn workers() -> Option<usize> {
    tokio::runtime::Handle::try_current()
        .ok()
        .filter(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
        .map(|h| h.metrics().num_workers())
}
