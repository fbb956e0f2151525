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
    /// Where the create request's answer goes (the first peer answers it; for a create
    /// asked again, `Follow::Again`, the stream's leader).
    #[serde(default)]
    pub reply: Option<String>,
    /// For a create asked again: when (ns, the meta leader's clock), so that a restart
    /// replaying the log does not answer it again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub asked: i64,
    /// Its peers changed since the create (a replica change, a move, a peer removed): the
    /// group runs already, so a new first peer joins it rather than starting it anew.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub regrouped: bool,
}

impl StreamAssignment {
    /// This assignment on `peers` (marked `regrouped` if they changed), with no create to
    /// answer.
    pub fn on_peers(&self, peers: Vec<String>) -> StreamAssignment {
        StreamAssignment {
            regrouped: self.regrouped || peers != self.peers,
            peers,
            reply: None,
            ..self.clone()
        }
    }
}

fn is_zero(n: &i64) -> bool {
    *n == 0
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

/// What an applied op did to the state.
#[derive(Debug, PartialEq)]
pub enum Applied {
    Changed,
    Unchanged,
    /// A create (an assignment with a `reply`) for a stream assigned already: the state
    /// keeps the assignment it has (its peers run its group); the request is answered from
    /// the stream as it is.
    Again,
}

impl MetaState {
    /// Deterministic: the same ops in the same order give the same state.
    pub fn apply(&mut self, op: &MetaOp) -> Applied {
        match op {
            MetaOp::AssignStream {
                account,
                name,
                assignment,
            } => {
                let streams = self.streams.entry(account.clone()).or_default();
                // A create asked twice (a client's retry while the meta group had no
                // quorum, or two clients at once) can commit twice: the second must not
                // put another Raft group or other peers in place of the running ones.
                // Changes of an existing stream's peers or config carry no reply.
                if assignment.reply.is_some() && streams.contains_key(name) {
                    return Applied::Again;
                }
                // A create asked again whose stream was deleted meanwhile: not made again
                // in the old group (a replica that missed the delete would rejoin it with
                // its old log); its client's retry places it anew.
                if assignment.asked != 0 {
                    if streams.is_empty() {
                        self.streams.remove(account);
                    }
                    return Applied::Unchanged;
                }
                streams.insert(name.clone(), assignment.clone());
                Applied::Changed
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
                if removed {
                    Applied::Changed
                } else {
                    Applied::Unchanged
                }
            }
            MetaOp::RemoveServer { name, at } => {
                self.removed.insert(name.clone(), *at);
                Applied::Changed
            }
        }
    }
}

#[derive(Serialize, Deserialize, Default, Clone)]
struct Saved {
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, Peer>,
    state: MetaState,
    /// Installed from the leader and not yet followed here (its deletions): a restart
    /// follows it as installed. Cleared once followed; no op after it is followed before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    installed: bool,
}

struct Inner {
    saved: Saved,
    snapshot: Option<(SnapshotMeta<NodeId, Peer>, Vec<u8>)>,
    /// How many `Follow`s were sent.
    sent: u64,
    /// When the last snapshot here was written, and how long writing it took (ns), for
    /// `/jsz`'s `meta_cluster.snapshot`.
    last_snapshot: (i64, i64),
}

/// What the server's streams follow (`cluster::follow`), in order.
#[derive(Debug)]
pub enum Follow {
    /// An applied op.
    Op(MetaOp),
    /// A create for a stream assigned already (`Applied::Again`): the state did not change;
    /// the stream's leader answers the request.
    Again(MetaOp),
    /// A whole state: the snapshot loaded at start (`installed` false: every op before it
    /// was followed before it was written, so only assigned streams that are missing here
    /// are made, memory ones above all), or one installed from the leader (`installed`:
    /// this server missed the ops before it, so its streams not in the state go too).
    State { state: MetaState, installed: bool },
}

/// The meta state machine; `watch()` sees the state after every applied batch, and every
/// applied op is also sent to the receiver `new` returns (the server's streams follow
/// them, `cluster::follow`, which counts each one done with `followed`).
///
/// Its snapshot (every `Opts::meta_snapshot_every` entries; the log before it is then
/// dropped) is written to a file beside the log, and only once every op before it has
/// been followed: a restart loads it and applies only the log after it.
#[derive(Clone)]
pub struct MetaMachine {
    inner: Arc<Mutex<Inner>>,
    tx: Arc<watch::Sender<MetaState>>,
    ops: mpsc::UnboundedSender<Follow>,
    /// Where the snapshot is kept (none: in memory only).
    file: Option<(keel_store::MetaFiles, std::path::PathBuf)>,
    followed: Arc<watch::Sender<u64>>,
    /// The last snapshot written (the log is purged no further: `LogStore::purge`).
    durable: super::log::PurgeFloor,
}

fn snapshot_meta(saved: &Saved) -> SnapshotMeta<NodeId, Peer> {
    SnapshotMeta {
        last_log_id: saved.applied,
        last_membership: saved.membership.clone(),
        snapshot_id: format!(
            "{}-{}",
            saved.applied.map(|l| l.leader_id.term).unwrap_or(0),
            saved.applied.map(|l| l.index).unwrap_or(0)
        ),
    }
}

impl MetaMachine {
    /// A machine with the snapshot kept in `file`, if any (loaded now; a damaged one is an
    /// error: the log before it is gone).
    #[allow(clippy::type_complexity)]
    pub fn new(
        file: Option<(keel_store::MetaFiles, std::path::PathBuf)>,
    ) -> Result<(MetaMachine, mpsc::UnboundedReceiver<Follow>), String> {
        // Unbounded, but fed only by applied meta entries: stream creates and deletes.
        let (ops, rx) = mpsc::unbounded_channel();
        let mut inner = Inner {
            saved: Saved::default(),
            snapshot: None,
            sent: 0,
            last_snapshot: (0, 0),
        };
        if let Some((files, path)) = &file {
            match files.read(path) {
                keel_store::MetaRead::Missing => {}
                keel_store::MetaRead::Current(body) => {
                    let saved: Saved = serde_json::from_slice(&body)
                        .map_err(|e| format!("meta snapshot {}: {e}", path.display()))?;
                    let state = saved.state.clone();
                    let installed = saved.installed;
                    inner.snapshot = Some((snapshot_meta(&saved), body));
                    inner.saved = saved;
                    let _ = ops.send(Follow::State { state, installed });
                    inner.sent = 1;
                }
                keel_store::MetaRead::Older { damage, .. }
                | keel_store::MetaRead::Damaged(damage) => {
                    return Err(format!(
                        "meta snapshot {} is damaged: {damage}",
                        path.display()
                    ))
                }
                keel_store::MetaRead::Unchecked(_) => {
                    return Err(format!("meta snapshot {} has no checksum", path.display()))
                }
            }
        }
        let state = inner.saved.state.clone();
        let loaded = inner.snapshot.as_ref().and_then(|(m, _)| m.last_log_id);
        let m = MetaMachine {
            inner: Arc::new(Mutex::new(inner)),
            tx: Arc::new(watch::channel(state).0),
            ops,
            file,
            followed: Arc::new(watch::channel(0).0),
            durable: Arc::new(Mutex::new(loaded)),
        };
        Ok((m, rx))
    }

    /// Up to where its log may be purged (see `LogStore::set_purge_floor`).
    pub fn purge_floor(&self) -> super::log::PurgeFloor {
        self.durable.clone()
    }

    fn written(&self, id: Option<LogId<NodeId>>) {
        let mut d = self.durable.lock().unwrap_or_else(|e| e.into_inner());
        if id > *d {
            *d = id;
        }
    }

    /// `follow` is done with one `Follow`.
    pub fn followed(&self) {
        self.followed.send_modify(|n| *n += 1);
    }

    /// `follow` is done with an installed snapshot: its file says so (else a restart
    /// follows it again as installed, deletions included).
    pub fn installed_followed(&self) -> std::io::Result<()> {
        let mut g = self.lock();
        // The snapshot as installed (the state has moved on since, with ops not followed
        // yet), only marked.
        let Some((_, body)) = g.snapshot.as_mut() else {
            return Ok(());
        };
        let mut snap: Saved = serde_json::from_slice(body).map_err(std::io::Error::other)?;
        if !snap.installed {
            return Ok(());
        }
        snap.installed = false;
        let new = serde_json::to_vec(&snap).map_err(std::io::Error::other)?;
        if let Some((files, path)) = &self.file {
            files.overwrite(path, &new, true)?;
        }
        *body = new;
        g.saved.installed = false;
        Ok(())
    }

    fn send(g: &mut Inner, ops: &mpsc::UnboundedSender<Follow>, f: Follow) {
        if ops.send(f).is_ok() {
            g.sent += 1;
        }
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

    /// When the last snapshot here was written and how long it took (ns; 0 if none yet).
    pub fn last_snapshot(&self) -> (i64, i64) {
        self.lock().last_snapshot
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
        let (meta, mut saved, sent) = {
            let g = self.lock();
            (snapshot_meta(&g.saved), g.saved.clone(), g.sent)
        };
        // Written only once the ops before it were followed (streams made or removed
        // here): a restart starts from it and never sees those ops again.
        // (No time limit: `follow` never waits on this machine. It ends only with the
        // server, and then nothing is written.)
        let mut done = self.followed.subscribe();
        let followed = done.wait_for(|n| *n >= sent).await.is_ok();
        // Written under the lock, and only when newer than the snapshot kept (one installed
        // from the leader meanwhile is newer, and the log before it may be gone already):
        // else that one is returned, which openraft takes for nothing new (no purge).
        let mut g = self.lock();
        let stale = g
            .snapshot
            .as_ref()
            .is_some_and(|(m, _)| m.last_log_id >= meta.last_log_id);
        if !followed || stale {
            return match &g.snapshot {
                Some((m, b)) => Ok(Snapshot {
                    meta: m.clone(),
                    snapshot: Box::new(Cursor::new(b.clone())),
                }),
                None => Err(sm_err("the meta ops before the snapshot were not followed")),
            };
        }
        saved.installed = false; // (An installed state before it was followed too.)
        let began = std::time::Instant::now();
        let body = serde_json::to_vec(&saved).map_err(sm_err)?;
        if let Some((files, path)) = &self.file {
            files.overwrite(path, &body, true).map_err(sm_err)?;
        }
        g.snapshot = Some((meta.clone(), body.clone()));
        g.last_snapshot = (crate::time::now_nanos(), began.elapsed().as_nanos() as i64);
        drop(g);
        self.written(meta.last_log_id);
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
                        let applied = g.saved.state.apply(&op);
                        out.push(CmdResult(vec![(applied == Applied::Changed) as u8]));
                        match applied {
                            Applied::Changed => Self::send(&mut g, &self.ops, Follow::Op(op)),
                            Applied::Again => Self::send(&mut g, &self.ops, Follow::Again(op)),
                            Applied::Unchanged => {}
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
        let mut saved: Saved = serde_json::from_slice(&body).map_err(sm_err)?;
        saved.applied = meta.last_log_id;
        saved.membership = meta.last_membership.clone();
        saved.installed = true;
        let body = serde_json::to_vec(&saved).map_err(sm_err)?;
        let state = {
            let mut g = self.lock();
            // (Under the lock: a build that finishes meanwhile sees this one as newer.)
            if let Some((files, path)) = &self.file {
                files.overwrite(path, &body, true).map_err(sm_err)?;
            }
            g.saved = saved;
            g.snapshot = Some((meta.clone(), body));
            self.written(meta.last_log_id);
            let state = g.saved.state.clone();
            Self::send(
                &mut g,
                &self.ops,
                Follow::State {
                    state: state.clone(),
                    installed: true,
                },
            );
            state
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

#[cfg(test)]
mod tests {
    use super::*;

    fn assign(name: &str) -> MetaOp {
        MetaOp::AssignStream {
            account: "APP".into(),
            name: name.into(),
            assignment: StreamAssignment {
                config: serde_json::json!({ "name": name }),
                peers: vec!["a".into()],
                group: String::new(),
                created: 1,
                reply: Some("_INBOX.x".into()),
                asked: 0,
                regrouped: false,
            },
        }
    }

    fn entry(index: u64, op: &MetaOp) -> Entry<TypeConfig> {
        Entry {
            log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(super::super::Cmd(serde_json::to_vec(op).unwrap())),
        }
    }

    /// A create that commits for a stream assigned already leaves the assignment (its
    /// group and peers) as it is; a change of peers or config (no reply) replaces it.
    #[test]
    fn a_second_create_keeps_the_first_assignment() {
        let mut state = MetaState::default();
        assert_eq!(state.apply(&assign("A")), Applied::Changed);
        let first = state.streams["APP"]["A"].clone();
        let MetaOp::AssignStream {
            account,
            name,
            mut assignment,
        } = assign("A")
        else {
            unreachable!()
        };
        assignment.group = "S-R3F-other".into();
        assignment.peers = vec!["b".into(), "c".into(), "d".into()];
        let again = MetaOp::AssignStream {
            account,
            name,
            assignment: assignment.clone(),
        };
        assert_eq!(state.apply(&again), Applied::Again);
        assert_eq!(state.streams["APP"]["A"], first);
        let change = MetaOp::AssignStream {
            account: "APP".into(),
            name: "A".into(),
            assignment: StreamAssignment {
                reply: None,
                ..assignment
            },
        };
        assert_eq!(state.apply(&change), Applied::Changed);
        assert_eq!(state.streams["APP"]["A"].peers.len(), 3);
        let remove = MetaOp::RemoveStream {
            account: "APP".into(),
            name: "A".into(),
        };
        assert_eq!(state.apply(&remove), Applied::Changed);
        assert_eq!(state.apply(&remove), Applied::Unchanged);
        // A create asked again (`asked`) after the delete: not made in the old group.
        let MetaOp::AssignStream {
            account,
            name,
            mut assignment,
        } = again
        else {
            unreachable!()
        };
        assignment.asked = 5;
        let late = MetaOp::AssignStream {
            account,
            name,
            assignment,
        };
        assert_eq!(state.apply(&late), Applied::Unchanged);
        assert!(state.streams.is_empty());
        assert_eq!(state.apply(&assign("A")), Applied::Changed);
    }

    /// A snapshot is written only once `follow` is done with the ops before it, and a
    /// machine made again from its file starts from it: its state, its log position, and
    /// a `Follow::State` first.
    #[tokio::test]
    async fn the_snapshot_waits_for_follow_and_is_loaded_again() {
        let dir = std::env::temp_dir().join(format!("keel-meta-snap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = (keel_store::MetaFiles::new(), dir.join("snapshot.json"));
        let (mut m, mut rx) = MetaMachine::new(Some(file.clone())).unwrap();
        m.apply(vec![entry(1, &assign("A")), entry(2, &assign("B"))])
            .await
            .unwrap();
        let mut b = m.get_snapshot_builder().await;
        let build = tokio::spawn(async move { b.build_snapshot().await.map(|s| s.meta) });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!build.is_finished(), "written before the ops were followed");
        assert!(matches!(
            keel_store::MetaFiles::new().read(&file.1),
            keel_store::MetaRead::Missing
        ));
        for _ in 0..2 {
            assert!(matches!(rx.recv().await, Some(Follow::Op(_))));
            m.followed();
        }
        let meta = build.await.unwrap().unwrap();
        assert_eq!(meta.last_log_id.map(|l| l.index), Some(2));

        let (mut again, mut rx) = MetaMachine::new(Some(file)).unwrap();
        let (applied, _) = again.applied_state().await.unwrap();
        assert_eq!(applied.map(|l| l.index), Some(2));
        assert_eq!(again.state(), m.state());
        match rx.recv().await {
            Some(Follow::State { state, installed }) => {
                assert!(!installed);
                assert_eq!(state.streams["APP"].len(), 2);
            }
            other => panic!("{other:?}"),
        }
        assert!(again.get_current_snapshot().await.unwrap().is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A snapshot installed from the leader is followed as installed (its deletions) also
    /// after a restart that came before `follow` was done with it, and not once it was.
    #[tokio::test]
    async fn an_installed_snapshot_is_followed_as_installed_until_it_was() {
        let dir = std::env::temp_dir().join(format!("keel-meta-inst-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = (keel_store::MetaFiles::new(), dir.join("snapshot.json"));
        let (mut leader, _rx) = MetaMachine::new(None).unwrap();
        leader.apply(vec![entry(1, &assign("A"))]).await.unwrap();
        let snap = leader.get_snapshot_builder().await;
        let mut b = snap;
        let b = tokio::spawn(async move { b.build_snapshot().await });
        leader.followed();
        let snap = b.await.unwrap().unwrap();

        let installed = |rx: &mut mpsc::UnboundedReceiver<Follow>| match rx.try_recv() {
            Ok(Follow::State { installed, .. }) => installed,
            other => panic!("{other:?}"),
        };
        let (mut m, mut rx) = MetaMachine::new(Some(file.clone())).unwrap();
        m.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        assert!(installed(&mut rx));
        // A restart before follow was done with it.
        let (again, mut rx) = MetaMachine::new(Some(file.clone())).unwrap();
        assert!(installed(&mut rx));
        again.followed();
        again.installed_followed().unwrap();
        let (_, mut rx) = MetaMachine::new(Some(file)).unwrap();
        assert!(!installed(&mut rx));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
