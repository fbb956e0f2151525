//! The seam between deciding and applying. The leader hands each decided entry to its
//! [`Replicator`]; once the replicator says the entries are committed, their effects may be
//! seen (acks sent, consumers woken).
//!
//! [`LocalReplicator`] is a single server's: the local log is the store itself, so an entry
//! is applied as it is proposed (the next decision sees it), and commit is the group-commit
//! sync of everything applied since the last one. A Raft replicator (issue 15) appends
//! proposed entries to the log instead, resolves `commit` once a quorum has them, and
//! applies committed entries with the same [`apply`](super::apply::apply) on every replica.

use std::future::Future;

use keel_store::{Store, StoreError};

use super::apply::{apply, Applied};
use super::entry::StreamEntry;
use super::read::WriteHandle;

/// See [`Replicator::take_uncertain`].
pub type Uncertain = std::pin::Pin<Box<dyn Future<Output = Option<bool>> + Send>>;

pub trait Replicator: Send + 'static {
    /// Hands a decided entry on. The local replicator applies it at once and says what it
    /// did; a refusal by the store (limits, a failed write) means the entry has no effect.
    fn propose(
        &mut self,
        store: &mut dyn Store,
        entry: &StreamEntry,
    ) -> Result<Applied, StoreError>;

    /// Whether this server decides for the stream now (a replicated stream's followers
    /// and a fenced leader do not: their actor only keeps its store).
    fn is_leader(&self) -> bool {
        true
    }

    /// Hands on a change to a durable consumer (a replicated stream carries them in its
    /// group); false where there is nothing to replicate to (one server: the consumer's
    /// own files are the record) or this server does not lead.
    fn propose_consumer(&mut self, _entry: crate::jetstream::raft::stream::ConsumerEntry) -> bool {
        false
    }

    /// Entries were proposed that no commit has covered yet (a replicated stream's
    /// retention removals wait for the next commit): the maintenance tick commits them, so
    /// the replicas get them in time and a leader that lost its group rolls them back.
    fn has_uncommitted(&self) -> bool {
        false
    }

    /// Appends an empty batch to a replicated stream's log (on its leader; see
    /// `raft::Rpc::Nudge`). Nothing for one server.
    fn nudge(&mut self) -> impl Future<Output = ()> + Send + '_ {
        async {}
    }

    /// After a failed `commit` whose batch may still commit (a replicated one, its outcome
    /// not known in time): resolves to whether it did, once known (None: not known).
    fn take_uncertain(&mut self) -> Option<Uncertain> {
        None
    }

    /// Waits until every entry proposed so far is committed. `force` makes it durable even
    /// where commits are lazy (purges, deletes, delete markers, the sync interval) and
    /// after a failed write (the sync rolls it back). An error means none of the entries
    /// since the last commit is there: the store is back at its last commit.
    fn commit<'a>(
        &'a mut self,
        store: &'a WriteHandle,
        force: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;
}

/// One server's replicator: apply at once, commit = the group commit.
pub struct LocalReplicator {
    /// Sync at every commit (the default), or only when forced (lazy mode; a memory
    /// store's sync does nothing).
    sync_always: bool,
    /// Something was proposed since the last commit.
    pending: bool,
}

impl LocalReplicator {
    pub fn new(sync_always: bool) -> LocalReplicator {
        LocalReplicator {
            sync_always,
            pending: false,
        }
    }
}

impl Replicator for LocalReplicator {
    fn propose(
        &mut self,
        store: &mut dyn Store,
        entry: &StreamEntry,
    ) -> Result<Applied, StoreError> {
        let r = apply(store, entry);
        self.pending |= r.is_ok();
        r
    }

    fn commit<'a>(
        &'a mut self,
        store: &'a WriteHandle,
        force: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let sync = force || (self.pending && self.sync_always);
        self.pending = false;
        async move {
            if sync {
                store.sync()
            } else {
                Ok(())
            }
        }
    }
}
