//! The meta group's state machine: which streams exist in the cluster, their config and
//! their peers (the reference's stream assignments). Every JetStream server of the cluster
//! is a voter; the meta leader alone decides creates, updates and deletes, and every server
//! applies the same assignments and then makes its local streams match them.

// openraft's storage traits fix the error type (`StorageError`, large); helpers return it too.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::io::Cursor;
use std::sync::{Arc, Mutex};

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::{CmdResult, NodeId, Peer, TypeConfig};

/// A stream's place in the cluster.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StreamAssignment {
    /// The stream's config as the API took it (JSON).
    pub config: serde_json::Value,
    /// Server names holding a replica; the first is the preferred leader.
    pub peers: Vec<String>,
    /// The Raft group's name (`S-R3F-xxxxxxxx`), or empty for R1.
    pub group: String,
    /// Nanoseconds since the epoch, the meta leader's clock.
    pub created: i64,
    /// Where the create request's answer goes (the first peer answers it).
    #[serde(default)]
    pub reply: Option<String>,
}

/// One meta change, decided by the meta leader.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum MetaOp {
    AssignStream {
        account: String,
        name: String,
        assignment: StreamAssignment,
    },
    RemoveStream {
        account: String,
        name: String,
    },
    /// `$JS.API.SERVER.REMOVE`: server `name` left the meta group at `at` (ns, the leader's
    /// clock); it is not added back while the removal is recent (`REMOVED_FOR`).
    RemoveServer {
        name: String,
        at: i64,
    },
}

/// How long a removed server stays out before it may join again (the reference's 5 min).
pub const REMOVED_FOR: std::time::Duration = std::time::Duration::from_secs(300);

/// Every assignment: account -> stream -> assignment.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct MetaState {
    pub streams: BTreeMap<String, BTreeMap<String, StreamAssignment>>,
    /// Servers removed from the meta group, and when (`MetaOp::RemoveServer`).
    #[serde(default)]
    pub removed: BTreeMap<String, i64>,
}

impl MetaState {
    /// Deterministic: the same ops in the same order give the same state.
    pub fn apply(&mut self, op: &MetaOp) -> bool {
        match op {
            MetaOp::AssignStream {
                account,
                name,
                assignment,
            } => {
                self.streams
                    .entry(account.clone())
                    .or_default()
                    .insert(name.clone(), assignment.clone());
                true
            }
            MetaOp::RemoveStream { account, name } => {
                let removed = self
                    .streams
                    .get_mut(account)
                    .and_then(|m| m.remove(name))
                    .is_some();
                if self.streams.get(account).is_some_and(|m| m.is_empty()) {
                    self.streams.remove(account);
                }
                removed
            }
            MetaOp::RemoveServer { name, at } => {
                self.removed.insert(name.clone(), *at);
                true
            }
        }
    }
}

#[derive(Serialize, Deserialize, Default, Clone)]
struct Saved {
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, Peer>,
    state: MetaState,
}

struct Inner {
    saved: Saved,
    snapshot: Option<(SnapshotMeta<NodeId, Peer>, Vec<u8>)>,
}

/// The meta state machine; `watch()` sees the state after every applied batch, and every
/// applied op is also sent to the receiver `new` returns (the server's streams follow
/// them, `cluster::follow`).
#[derive(Clone)]
pub struct MetaMachine {
    inner: Arc<Mutex<Inner>>,
    tx: Arc<watch::Sender<MetaState>>,
    ops: mpsc::UnboundedSender<MetaOp>,
}

impl MetaMachine {
    pub fn new() -> (MetaMachine, mpsc::UnboundedReceiver<MetaOp>) {
        // Unbounded, but fed only by applied meta entries: stream creates and deletes.
        let (ops, rx) = mpsc::unbounded_channel();
        let m = MetaMachine {
            inner: Arc::new(Mutex::new(Inner {
                saved: Saved::default(),
                snapshot: None,
            })),
            tx: Arc::new(watch::channel(MetaState::default()).0),
            ops,
        };
        (m, rx)
    }

    pub fn watch(&self) -> watch::Receiver<MetaState> {
        self.tx.subscribe()
    }

    pub fn state(&self) -> MetaState {
        self.lock().saved.state.clone()
    }

    /// Reads the state in place: a look at one assignment copies no others (each stream
    /// group looks at its own after every commit).
    pub fn with_state<T>(&self, f: impl FnOnce(&MetaState) -> T) -> T {
        f(&self.lock().saved.state)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn sm_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write_state_machine(&std::io::Error::other(e.to_string())).into()
}

impl RaftSnapshotBuilder<TypeConfig> for MetaMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let mut g = self.lock();
        let body = serde_json::to_vec(&g.saved).map_err(sm_err)?;
        let meta = SnapshotMeta {
            last_log_id: g.saved.applied,
            last_membership: g.saved.membership.clone(),
            snapshot_id: format!(
                "{}-{}",
                g.saved.applied.map(|l| l.leader_id.term).unwrap_or(0),
                g.saved.applied.map(|l| l.index).unwrap_or(0)
            ),
        };
        g.snapshot = Some((meta.clone(), body.clone()));
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(body)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for MetaMachine {
    type SnapshotBuilder = MetaMachine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, Peer>), StorageError<NodeId>> {
        let g = self.lock();
        Ok((g.saved.applied, g.saved.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<CmdResult>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + openraft::OptionalSend,
        I::IntoIter: openraft::OptionalSend,
    {
        let mut out = Vec::new();
        let state = {
            let mut g = self.lock();
            for e in entries {
                g.saved.applied = Some(e.log_id);
                match e.payload {
                    EntryPayload::Blank => out.push(CmdResult::default()),
                    EntryPayload::Membership(m) => {
                        g.saved.membership = StoredMembership::new(Some(e.log_id), m);
                        out.push(CmdResult::default());
                    }
                    EntryPayload::Normal(cmd) => {
                        // An entry this version cannot read is reported, never skipped
                        // silently: the group stops (openraft treats it as fatal).
                        let op: MetaOp = serde_json::from_slice(&cmd.0).map_err(sm_err)?;
                        let changed = g.saved.state.apply(&op);
                        out.push(CmdResult(vec![changed as u8]));
                        if changed {
                            let _ = self.ops.send(op);
                        }
                    }
                }
            }
            g.saved.state.clone()
        };
        self.tx.send_replace(state);
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> MetaMachine {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Peer>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let body = snapshot.into_inner();
        let saved: Saved = serde_json::from_slice(&body).map_err(sm_err)?;
        let state = {
            let mut g = self.lock();
            g.saved = saved;
            g.saved.applied = meta.last_log_id;
            g.saved.membership = meta.last_membership.clone();
            g.snapshot = Some((meta.clone(), body));
            g.saved.state.clone()
        };
        self.tx.send_replace(state);
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let g = self.lock();
        Ok(g.snapshot.as_ref().map(|(meta, body)| Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(body.clone())),
        }))
    }
}
