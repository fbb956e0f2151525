//! Clustered JetStream: the meta group (`_meta_`), one openraft group whose voters are the
//! cluster's JetStream servers and whose log holds the stream assignments
//! (`raft::meta`).
//!
//! **Forming the group.** A server waits until it has routes to at least as many JetStream
//! peers as it has configured routes (less one, for a list that names the server itself)
//! and its view
//! of the cluster has stayed the same for two seconds; then the server with the lowest name
//! in that view initializes the group with every server in it. The others are contacted by
//! that leader. A seed (no configured routes) alone for two seconds forms a group of one.
//! A server that joins later (a route to a JetStream server that is not a
//! member) is added by the meta leader, first as a learner (it catches up from the log or
//! a snapshot), then as a voter.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::raft::log::LogStore;
use super::raft::meta::{Follow, MetaMachine, MetaOp, MetaState, StreamAssignment};
use super::raft::{self, node_id, peer_hash, Cmd, NodeId, Peer, Raft, RaftHost};
use super::Stream;
use crate::server::Server;
use crate::{info, warn};

pub const META_GROUP: &str = "_meta_";

/// The meta log's segment size: its entries are small and few (stream creates and
/// deletes), and compaction frees whole segments.
const META_LOG_SEGMENT: u64 = 256 << 10;

/// The meta group on one server.
pub struct Meta {
    /// The group's node: replaced when the group is loaded again after its log failed
    /// (`reload`); read it through `raft()`.
    raft: std::sync::RwLock<Raft>,
    /// The node's log, closed when the node stops (see `LogStore::close`).
    log: std::sync::Mutex<LogStore>,
    /// Where its log is (to load it again).
    log_dir: std::path::PathBuf,
    /// A reload is scheduled or running.
    reloading: std::sync::atomic::AtomicBool,
    pub machine: MetaMachine,
    pub host: Arc<RaftHost>,
    pub cluster_name: String,
    inboxes: std::sync::Mutex<std::collections::HashMap<String, Arc<Inbox>>>,
    /// When this server last saw a leader change (for `leader_since`).
    leader_since: std::sync::Mutex<(Option<NodeId>, i64)>,
    /// A `$JS.API.SERVER.REMOVE` is under way (one at a time, as the reference).
    removing: std::sync::atomic::AtomicBool,
    /// When this process started the group (a removal older than that is a replay).
    started_at: i64,
    /// Stream creates (`Some`) and deletes (`None`) this leader proposed that have not been
    /// followed here yet (one answered 10008 may still commit), by (account, stream), with
    /// the term they were proposed in (one of an older term may never commit: a later
    /// leader decides anew, and the applied state guards against it anyway). A create
    /// asked again meanwhile reuses the assignment; a create after a delete places anew.
    proposed: std::sync::Mutex<std::collections::HashMap<(String, String), Proposed>>,
    /// Every server's `server_tags` as last seen (`server_tags`).
    tags: std::sync::Mutex<std::collections::HashMap<String, Vec<String>>>,
    /// Every server's JetStream memory and file limits as last seen (`server_js_limits`).
    js_limits: std::sync::Mutex<std::collections::HashMap<String, [i64; 2]>>,
}

/// A create (`Some`, its assignment) or delete (`None`) proposed, and its term.
type Proposed = (u64, Option<StreamAssignment>);

impl Meta {
    /// Starts the meta group on `server` with its log in `log_dir`.
    pub async fn start(
        server: &Arc<Server>,
        host: Arc<RaftHost>,
        log_dir: std::path::PathBuf,
    ) -> Result<Arc<Meta>, String> {
        let snapshot = (
            keel_store::MetaFiles::on_disk(&server.opts.disk),
            log_dir.join("snapshot.json"),
        );
        let (machine, applied) = MetaMachine::new(Some(snapshot))?;
        let (raft, log) = Self::node(server, &host, &log_dir, &machine).await?;
        let meta = Arc::new(Meta {
            raft: std::sync::RwLock::new(raft),
            log: std::sync::Mutex::new(log),
            log_dir,
            reloading: std::sync::atomic::AtomicBool::new(false),
            machine,
            host,
            cluster_name: server.cluster.get().map(|c| c.name()).unwrap_or_default(),
            inboxes: std::sync::Mutex::new(std::collections::HashMap::new()),
            leader_since: std::sync::Mutex::new((None, 0)),
            removing: std::sync::atomic::AtomicBool::new(false),
            started_at: crate::time::now_nanos(),
            proposed: std::sync::Mutex::new(std::collections::HashMap::new()),
            tags: std::sync::Mutex::new(std::collections::HashMap::new()),
            js_limits: std::sync::Mutex::new(std::collections::HashMap::new()),
        });
        server.spawn(tend(meta.clone(), Arc::downgrade(server)));
        server.spawn(follow(meta.clone(), Arc::downgrade(server), applied));
        meta.serve_api(server);
        Ok(meta)
    }

    /// The group's node on this server, on its log opened from `dir` (registered with the
    /// host).
    async fn node(
        server: &Server,
        host: &Arc<RaftHost>,
        dir: &std::path::Path,
        machine: &MetaMachine,
    ) -> Result<(Raft, LogStore), String> {
        let backend = raft::log::open_logged(
            server,
            host,
            META_GROUP,
            dir,
            "JetStream cluster meta log",
            Some(META_LOG_SEGMENT),
        )
        .map_err(|e| format!("meta log in {}: {e}", dir.display()))?;
        let log =
            LogStore::open(Box::new(backend), true, None).map_err(|e| format!("meta log: {e}"))?;
        log.set_purge_floor(machine.purge_floor());
        let raft = Raft::new(
            host.id,
            raft::meta_config(server.opts.meta_snapshot_every, server.opts.meta_log_kept),
            host.network(META_GROUP, None),
            log.clone(),
            machine.clone(),
        )
        .await
        .map_err(|e| format!("meta group: {e}"))?;
        host.add_group(META_GROUP, raft.clone());
        host.guard_votes(META_GROUP, &raft);
        Ok((raft, log))
    }

    /// The meta log's extent.
    pub fn log_stats(&self) -> super::raft::log::LogStats {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).stats()
    }

    /// The group's node on this server.
    pub fn raft(&self) -> Raft {
        self.raft.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Why the group stopped on this server, when its log failed (a full disk) and it is
    /// not loaded again yet.
    pub fn failed(&self) -> Option<String> {
        match &self.raft().metrics().borrow().running_state {
            Err(openraft::error::Fatal::StorageError(e)) => Some(e.to_string()),
            _ => None,
        }
    }

    /// `$JS.API.META.LEADER.STEPDOWN` and `$JS.API.SERVER.REMOVE`, which the reference takes
    /// from the system account only (other accounts never reach this subscription, which
    /// lives there). Every server subscribes (routes announce it, `raft::serves_peers`); the
    /// leader answers.
    fn serve_api(self: &Arc<Self>, server: &Arc<Server>) {
        let account = self.host.account().clone();
        let (handle, mut rx) = crate::client::ClientHandle::internal(
            server,
            &account,
            "meta leader API".into(),
            64 * 1024,
        );
        if let Some(q) = handle.internal_queue() {
            q.set_cluster_wide();
        }
        for subject in [
            &b"$JS.API.META.LEADER.STEPDOWN"[..],
            &b"$JS.API.SERVER.REMOVE"[..],
            // Other servers stopping (`Server::announce_stop`).
            &b"$SYS.SERVER.*.SHUTDOWN"[..],
            &b"$SYS.SERVER.*.LAMEDUCK"[..],
        ] {
            account.sublist.insert(crate::sublist::Sub::internal(
                &handle,
                bytes::Bytes::from_static(raft::RAFT_SID),
                bytes::Bytes::from_static(subject),
            ));
        }
        let meta = self.clone();
        let weak = Arc::downgrade(server);
        server.spawn(async move {
            let mut router = crate::router::Router::new(account, 0x4d53);
            while let Some(m) = rx.recv().await {
                if m.subject.starts_with(b"$SYS.SERVER.") {
                    let v: Value = serde_json::from_slice(m.payload()).unwrap_or(Value::Null);
                    if let (Some(name), Some(id)) = (v["name"].as_str(), v["id"].as_str()) {
                        meta.host.note_departed(name, id);
                    }
                    continue;
                }
                let Some(reply) = m.reply.clone() else {
                    continue;
                };
                if !meta.is_leader() {
                    continue;
                }
                let Some(server) = weak.upgrade() else {
                    return;
                };
                if &m.subject[..] == b"$JS.API.SERVER.REMOVE" {
                    // Answered once the removal is done (a membership change and a move of
                    // every stream replica the server held).
                    let m2 = meta.clone();
                    let body = m.payload().to_vec();
                    let account = meta.host.account().clone();
                    tokio::spawn(async move {
                        let kind = "io.nats.jetstream.api.v1.meta_server_remove_response";
                        let v = match m2.remove_server(&server, &body).await {
                            Ok(()) => json!({"type": kind, "success": true}),
                            Err(e) => json!({"type": kind, "error": e.to_json()}),
                        };
                        let mut router = crate::router::Router::new(account, 0x4d52);
                        crate::jetstream::api::reply(
                            &server,
                            &mut router,
                            &reply,
                            serde_json::to_vec(&v).unwrap_or_default(),
                        );
                        router.flush();
                    });
                    continue;
                }
                let kind = "io.nats.jetstream.api.v1.meta_leader_stepdown_response";
                let target = stepdown_request(m.payload()).and_then(|placement| {
                    stepdown_target(&meta, &meta.raft(), meta.host.id, &placement)
                });
                let body = match target {
                    Err(e) => json!({"type": kind, "error": e.to_json()}),
                    Ok(target) => {
                        spawn_stepdown(
                            Some(meta.host.clone()),
                            meta.raft(),
                            META_GROUP.to_string(),
                            target,
                            server.clone(),
                            None,
                        );
                        json!({"type": kind, "success": true})
                    }
                };
                crate::jetstream::api::reply(
                    &server,
                    &mut router,
                    &reply,
                    serde_json::to_vec(&body).unwrap_or_default(),
                );
                router.flush();
            }
        });
    }

    /// The meta leader's server name, if there is one.
    pub fn leader(&self) -> Option<String> {
        let m = self.raft().metrics().borrow().clone();
        let id = raft::leader_id(&m)?;
        let name = raft::member_name(&m, id)?;
        // Another server named by a saved vote, not heard from since: no leader yet.
        if id != self.host.id
            && self
                .host
                .since_heard(&name)
                .is_none_or(|d| d > Duration::from_millis(raft::QUORUM_LOST_MS))
        {
            return None;
        }
        Some(name)
    }

    pub fn is_leader(&self) -> bool {
        raft::leader_id(&self.raft().metrics().borrow()) == Some(self.host.id)
    }

    /// Proposes `op` (on the leader); resolves once it is committed on a quorum and
    /// applied here, or fails after `raft::COMMIT_TIMEOUT` (a leader that lost its quorum
    /// keeps the role until it hears of another: the request would wait as long, holding
    /// the group's write gate, so a meta stepdown could not go through meanwhile). A change
    /// that timed out may still commit later, as with a request the client gave up on.
    pub async fn propose(&self, op: &MetaOp) -> Result<(), String> {
        match tokio::time::timeout(raft::COMMIT_TIMEOUT, self.propose_waiting(op)).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "not committed within {}s (no quorum)",
                raft::COMMIT_TIMEOUT.as_secs()
            )),
        }
    }

    /// `propose` with no time limit: for a server's removal, whose later steps (the
    /// membership change, moving its replicas) must follow once its record commits (a
    /// record that committed after a timeout would turn the server's JetStream off with it
    /// still a voter and its replicas not moved).
    async fn propose_waiting(&self, op: &MetaOp) -> Result<(), String> {
        let body = serde_json::to_vec(op).map_err(|e| e.to_string())?;
        let gate = self.host.gate(META_GROUP);
        let _open = gate.read().await;
        self.raft()
            .client_write(Cmd(body))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// `/jsz`'s `meta_cluster`, as the reference writes it.
    pub fn jsz(&self, cluster_name: &str) -> Value {
        let m = self.raft().metrics().borrow().clone();
        let members: BTreeMap<String, NodeId> = m
            .membership_config
            .nodes()
            .map(|(id, p)| (p.name.clone(), *id))
            .collect();
        let size = members.len().max(1);
        let leader = raft::leader_id(&m).and_then(|id| raft::member_name(&m, id));
        let mut out = serde_json::Map::new();
        out.insert("name".into(), cluster_name.into());
        let mut replicas = Vec::new();
        for name in members.keys() {
            // With a leader the list leaves this server out; without one it lists all.
            if leader.is_some() && *name == self.host.name {
                continue;
            }
            replicas.push(self.replica(name, leader.as_deref()));
        }
        if let Some(l) = &leader {
            out.insert("leader".into(), l.clone().into());
            out.insert("peer".into(), peer_hash(l).into());
        }
        out.insert("replicas".into(), Value::Array(replicas));
        out.insert("cluster_size".into(), size.into());
        out.insert("quorum_needed".into(), (size / 2 + 1).into());
        // Entries in this server's log not applied yet.
        let applied = m.last_applied.map_or(0, |l| l.index);
        let pending = m.last_log_index.unwrap_or(0).saturating_sub(applied);
        out.insert("pending".into(), pending.into());
        // The log since the last snapshot, and when that was written.
        let snap = m.snapshot.map_or(0, |l| l.index);
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (at, took) = self.machine.last_snapshot();
        let mut snapshot = json!({
            "pending_entries": m.last_log_index.unwrap_or(0).saturating_sub(snap),
            "pending_size": log.bytes_after(snap),
            "last_time": crate::time::rfc3339(at),
        });
        if took > 0 {
            snapshot["last_duration"] = took.into();
        }
        out.insert("snapshot".into(), snapshot);
        Value::Object(out)
    }

    /// One peer of a group as `replicas[]` lists it.
    fn replica(&self, name: &str, leader: Option<&str>) -> Value {
        let active = self.host.since_heard(name);
        // The reference's "current": heard from within the last ten seconds.
        let current = name == self.host.name
            || leader == Some(name)
            || active.is_some_and(|d| d < Duration::from_secs(10));
        let offline = !self.host.is_up(name);
        let mut r = json!({
            "name": name,
            "current": current,
            "active": active.map(|d| d.as_nanos() as u64).unwrap_or(0),
            "peer": peer_hash(name),
        });
        if offline {
            r["offline"] = true.into();
        }
        r
    }

    /// `leader_since` of the current leader (this server's view), nanoseconds.
    pub fn leader_since(&self) -> i64 {
        self.leader_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
    }

    /// `$JS.API.SERVER.REMOVE` on the leader: server `peer` (or the one whose peer id is
    /// `peer_id`) leaves the meta group, is kept out for `REMOVED_FOR` even if it is still
    /// connected, and every stream replica it held moves to a server that holds none of that
    /// stream (where there is one: otherwise the stream keeps it, as an offline peer).
    async fn remove_server(
        &self,
        server: &Arc<Server>,
        body: &[u8],
    ) -> Result<(), super::api::ApiError> {
        use super::api::ErrorKind;
        let trimmed = String::from_utf8_lossy(body);
        if trimmed.trim().is_empty() || trimmed.trim() == "{}" {
            return Err(ErrorKind::BadRequest.err());
        }
        let req: Value = serde_json::from_slice(body)
            .map_err(|e| super::api::ApiError::invalid_json_body(body, &e))?;
        let by_name = req["peer"].as_str().unwrap_or("");
        let by_id = req["peer_id"].as_str().unwrap_or("");
        let m = self.raft().metrics().borrow().clone();
        let found = m.membership_config.nodes().find(|(_, p)| {
            if by_id.is_empty() {
                p.name == by_name
            } else {
                peer_hash(&p.name) == by_id
            }
        });
        let Some((&id, peer)) = found else {
            return Err(ErrorKind::ServerNotMember.err());
        };
        let name = peer.name.clone();
        if self
            .removing
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return Err(ErrorKind::MemberChangeInflight.err());
        }
        let r = self.remove_member(server, id, &name).await;
        self.removing
            .store(false, std::sync::atomic::Ordering::Release);
        r
    }

    async fn remove_member(
        &self,
        server: &Arc<Server>,
        id: NodeId,
        name: &str,
    ) -> Result<(), super::api::ApiError> {
        use super::api::ErrorKind;
        let unavailable = |e: String| {
            warn!(server.log, "JetStream cluster could not remove {name}: {e}");
            ErrorKind::ClusterUnavailable.err()
        };
        // First recorded, so no leader adds it back while it is still connected.
        let op = MetaOp::RemoveServer {
            name: name.to_string(),
            at: crate::time::now_nanos(),
        };
        self.propose_waiting(&op).await.map_err(unavailable)?;
        let voters: BTreeSet<NodeId> = self
            .raft()
            .metrics()
            .borrow()
            .membership_config
            .voter_ids()
            .filter(|v| *v != id)
            .collect();
        if voters.is_empty() {
            return Err(ErrorKind::ServerNotMember.err());
        }
        self.raft()
            .change_membership(voters, false)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        info!(server.log, "JetStream cluster removed peer {name}");
        // Its stream replicas move (this server may have been the one removed, and no
        // longer lead: then the new leader's streams keep the offline peer).
        let state = self.machine.state();
        for (account, streams) in &state.streams {
            for (stream, a) in streams {
                if !a.peers.iter().any(|p| p == name) || !self.is_leader() {
                    continue;
                }
                let mut peers: Vec<String> =
                    a.peers.iter().filter(|p| *p != name).cloned().collect();
                let more = place(self, &state, account, 1, &a.config, &a.peers).unwrap_or_default();
                if more.is_empty() {
                    warn!(
                        server.log,
                        "JetStream cluster: no server to take '{account} > {stream}' replica from removed peer {name}"
                    );
                    continue;
                }
                peers.extend(more);
                let op = MetaOp::AssignStream {
                    account: account.clone(),
                    name: stream.clone(),
                    assignment: a.on_peers(peers),
                };
                self.propose_waiting(&op).await.map_err(unavailable)?;
            }
        }
        Ok(())
    }

    /// Makes another voter leader (see `raft::step_down`).
    pub async fn step_down(&self) -> Result<(), String> {
        if !self.is_leader() {
            return Err("not leader".into());
        }
        raft::step_down(&self.host, &self.raft()).await
    }

    pub async fn shutdown(&self) {
        let _ = self.raft().shutdown().await;
        self.close_log().await;
    }

    async fn close_log(&self) {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner()).clone();
        log.close().await;
    }
}

/// A server with JetStream (another Keel server of the cluster) to hand requests to: the
/// meta leader this server last knew, else any.
fn serving_peer(server: &Server) -> Option<String> {
    let peers: Vec<String> = jetstream_peers(server.cluster.get()?);
    let last = server
        .jetstream
        .get()
        .and_then(|j| j.meta.get())
        .and_then(|m| m.leader());
    last.filter(|l| peers.contains(l))
        .or_else(|| peers.into_iter().next())
}

/// The Keel servers with JetStream this one has a route to, by name.
fn jetstream_peers<C: FromIterator<String>>(cluster: &crate::route::Cluster) -> C {
    cluster
        .routes()
        .iter()
        .filter(|r| r.remote_jetstream())
        .map(|r| r.remote_name())
        .filter(|n| !n.is_empty())
        .collect()
}

/// The meta group's node stopped on a storage error: after `wait` it is made again on its
/// log (opened as at a restart: recovery cuts what was not synced) and the same state
/// machine, and catches up from the leader; tried again, less and less often, while that
/// fails (the disk still full).
async fn reload(meta: Arc<Meta>, server: Arc<Server>, mut wait: Duration) {
    let mut shutdown = server.shutdown_rx();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        if server.jetstream_enabled().is_none() {
            return;
        }
        let old = meta.raft();
        meta.host.remove_group(META_GROUP);
        let _ = old.shutdown().await;
        meta.close_log().await;
        match Meta::node(&server, &meta.host, &meta.log_dir, &meta.machine).await {
            Ok((raft, log)) => {
                // Turned off (a removal) or stopping meanwhile: nothing will stop this one.
                if server.jetstream_enabled().is_none() || *shutdown.borrow() {
                    meta.host.remove_group(META_GROUP);
                    let _ = raft.shutdown().await;
                    log.close().await;
                    return;
                }
                *meta.raft.write().unwrap_or_else(|e| e.into_inner()) = raft;
                *meta.log.lock().unwrap_or_else(|e| e.into_inner()) = log;
                meta.reloading
                    .store(false, std::sync::atomic::Ordering::Release);
                info!(
                    server.log,
                    "JetStream cluster meta group loaded again from its log"
                );
                return;
            }
            Err(e) => {
                wait = meta.host.reload_wait(META_GROUP);
                crate::error!(
                    server.log,
                    "JetStream cluster meta group could not be loaded again ({e}); trying again in {wait:?}"
                );
            }
        }
    }
}

/// After this server's removal is applied, JetStream is disabled here, as the reference
/// does at once; a leader that removed itself first hands over (it leads until the
/// membership without it is committed).
async fn disable_once_out(meta: Arc<Meta>, server: Arc<Server>) {
    let mut metrics = meta.raft().metrics();
    let wait = metrics.wait_for(|m| m.current_leader != Some(meta.host.id));
    let _ = tokio::time::timeout(Duration::from_secs(30), wait).await;
    disable(&meta, &server).await;
}

/// Turns JetStream off on a server removed from the cluster, as the reference does: its
/// streams are unloaded (their files stay for the operator), its meta group node stops,
/// its INFO and its routes' INFO say `jetstream: false` (so no leader adds it back while it
/// runs), `/healthz` reports JetStream not enabled, and its clients' API requests are
/// answered by the rest of the cluster. A restart turns it on again.
pub async fn disable(meta: &Arc<Meta>, server: &Arc<Server>) {
    let Some(jss) = server.jetstream.get().cloned() else {
        return;
    };
    if !jss.set_disabled() {
        return;
    }
    crate::error!(
        server.log,
        "JetStream disabled: this server was removed from the JetStream cluster"
    );
    if let Some(sys) = server.accounts.system_account() {
        let mut router = crate::router::Router::new(sys.clone(), 0x5352);
        super::advisory::server_removed(server, &mut router);
        router.flush();
    }
    for js in jss.all() {
        let mut router = crate::router::Router::new(js.account.clone(), 0x554c);
        for s in js.streams() {
            super::registry::unload_stream(js, server, &mut router, &s.name).await;
        }
        router.flush();
    }
    meta.host.remove_group(META_GROUP);
    meta.shutdown().await;
    if let Some(c) = server.cluster.get() {
        c.announce_info(server);
    }
}

/// Forms the group, then (on the leader) adds servers that joined the cluster later, and
/// logs leader changes the way the reference does.
async fn tend(meta: Arc<Meta>, server: std::sync::Weak<Server>) {
    let mut view: BTreeSet<String> = BTreeSet::new();
    let mut stable_since = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut last_leader: Option<NodeId> = None;
    let mut warned = false;
    let started = Instant::now();
    let mut shutdown = match server.upgrade() {
        Some(s) => s.shutdown_rx(),
        None => return,
    };
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let Some(server) = server.upgrade() else {
            return;
        };
        let Some(cluster) = server.cluster.get().cloned() else {
            return;
        };
        if server.jetstream_enabled().is_none() {
            return; // Disabled here (`disable`): its group node has stopped.
        }
        let mut now_view: BTreeSet<String> = jetstream_peers(&cluster);
        now_view.insert(meta.host.name.clone());
        if now_view != view {
            view = now_view;
            stable_since = Instant::now();
        }
        let metrics = meta.raft().metrics().borrow().clone();
        if let Err(openraft::error::Fatal::StorageError(e)) = &metrics.running_state {
            // Its log could not be written (a full disk): openraft stopped the group here.
            // It is loaded again from its log, as at a restart, and catches up.
            if !meta
                .reloading
                .swap(true, std::sync::atomic::Ordering::AcqRel)
            {
                let wait = meta.host.reload_wait(META_GROUP);
                crate::error!(
                    server.log,
                    "JetStream cluster meta group stopped on a storage error ({e}); it is loaded again from its log in {wait:?}"
                );
                server.spawn(reload(meta.clone(), server.clone(), wait));
            }
            continue;
        }
        let now_leader = raft::leader_id(&metrics);
        if now_leader != last_leader {
            last_leader = now_leader;
            *meta.leader_since.lock().unwrap_or_else(|e| e.into_inner()) =
                (last_leader, crate::time::now_nanos());
            match last_leader {
                Some(id) if id == meta.host.id => {
                    info!(server.log, "Self is new JetStream cluster metadata leader")
                }
                Some(_) => {
                    if let Some(l) = meta.leader() {
                        info!(
                            server.log,
                            "JetStream cluster new metadata leader: {}/{}",
                            l,
                            cluster.name()
                        );
                    }
                }
                None => warn!(server.log, "JetStream cluster no metadata leader"),
            }
        }
        if metrics.current_leader.is_none()
            && !warned
            && started.elapsed() > Duration::from_secs(10)
        {
            warned = true;
            warn!(
                server.log,
                "JetStream has not established contact with a meta leader"
            );
        }
        let initialized = metrics.membership_config.voter_ids().count() > 0;
        if !initialized {
            let configured = cluster.opts.routes.len();
            let needed = configured.saturating_sub(1);
            let lowest = view.iter().next() == Some(&meta.host.name);
            if view.len() > needed && lowest && stable_since.elapsed() >= Duration::from_secs(2) {
                let members: BTreeMap<NodeId, Peer> = view
                    .iter()
                    .map(|n| (node_id(n), Peer { name: n.clone() }))
                    .collect();
                info!(server.log, "JetStream cluster bootstrapping");
                if let Err(e) = meta.raft().initialize(members).await {
                    warn!(server.log, "JetStream cluster bootstrap: {e}");
                }
            }
            continue;
        }
        if metrics.current_leader == Some(meta.host.id) {
            // Servers of the cluster that are not members yet join.
            let members: BTreeSet<NodeId> = metrics
                .membership_config
                .nodes()
                .map(|(id, _)| *id)
                .collect();
            let removed = meta.machine.with_state(|s| s.removed.clone());
            let now = crate::time::now_nanos();
            let voter_ids: BTreeSet<NodeId> = metrics.membership_config.voter_ids().collect();
            for name in &view {
                let id = node_id(name);
                if voter_ids.contains(&id) {
                    continue;
                }
                let recent =
                    |at: &i64| now - *at < super::raft::meta::REMOVED_FOR.as_nanos() as i64;
                if removed.get(name).is_some_and(recent) {
                    continue;
                }
                let added = if members.contains(&id) {
                    // A learner whose add timed out: promoted once it has caught up.
                    let last = metrics.last_log_index.unwrap_or(0);
                    let matched = metrics
                        .replication
                        .as_ref()
                        .and_then(|r| r.get(&id).cloned().flatten())
                        .map_or(0, |l| l.index);
                    if matched + 16 < last {
                        continue;
                    }
                    true
                } else {
                    // Bounded: a joiner that stops answering must not hold up this loop.
                    let peer = Peer { name: name.clone() };
                    let r = tokio::time::timeout(
                        Duration::from_secs(10),
                        meta.raft().add_learner(id, peer, true),
                    )
                    .await;
                    matches!(r, Ok(Ok(_)))
                };
                if added {
                    let mut voters: BTreeSet<NodeId> =
                        metrics.membership_config.voter_ids().collect();
                    voters.insert(id);
                    if let Err(e) = meta.raft().change_membership(voters, false).await {
                        warn!(server.log, "JetStream cluster could not add {name}: {e}");
                    } else {
                        info!(server.log, "JetStream cluster added peer {name}");
                    }
                }
                break;
            }
        }
    }
}

/// How many times a request may be forwarded (a leader change in flight can make the
/// first target forward it once more).
const MAX_HOPS: u8 = 2;

/// Set in a forwarded request's hop count by the meta leader on a stream update it has
/// checked and written into the stream's assignment (`update_on_meta`): the servers it
/// passes on take it to the stream's leader, not back to the meta leader. (In the count,
/// not a field of its own, so that `raft::Forwarded` stays as older servers read it.)
const CHECKED: u8 = 0x40;

/// The hop count and flags of a forwarded request (its sid says so; a client's request
/// has none).
fn raw_hops(m: &crate::client::InMsg) -> u8 {
    m.sid
        .strip_prefix(b"fwd".as_slice())
        .and_then(|d| std::str::from_utf8(d).ok())
        .and_then(|d| d.parse().ok())
        .unwrap_or(0)
}

/// The hop count of a forwarded request.
fn hops(m: &crate::client::InMsg) -> u8 {
    raw_hops(m) & !CHECKED
}

/// Whether the meta leader checked this stream update (`CHECKED`).
fn checked(m: &crate::client::InMsg) -> bool {
    raw_hops(m) & CHECKED != 0
}

/// The stream a per-stream API request is about.
fn stream_of<'a>(tokens: &[&'a str]) -> Option<&'a str> {
    match tokens {
        ["STREAM", "INFO" | "PURGE" | "UPDATE" | "CREATE", name] => Some(name),
        ["STREAM", "LEADER", "STEPDOWN", name] => Some(name),
        ["CONSUMER", "LEADER", "STEPDOWN", stream, _] => Some(stream),
        ["STREAM", "MSG", "GET" | "DELETE", name] => Some(name),
        ["DIRECT", "GET", name, ..] => Some(name),
        ["CONSUMER", "DURABLE", "CREATE", stream, ..] => Some(stream),
        ["CONSUMER", "MSG", "NEXT", stream, ..] => Some(stream),
        ["CONSUMER", _, stream, ..] => Some(stream),
        _ => None,
    }
}

impl Meta {
    /// This server's inbox in `account` for requests it sends to other servers (made on
    /// first use; its subscription serves the whole cluster).
    fn inbox(&self, server: &Arc<Server>, account: &Arc<crate::account::Account>) -> Arc<Inbox> {
        let mut g = self.inboxes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = g.get(&account.name) {
            return i.clone();
        }
        let i = Inbox::start(server, account, &self.host);
        g.insert(account.name.clone(), i.clone());
        i
    }

    /// Each server's `server_tags`: this one's, and its peers' as their route INFO said.
    /// A server with no route now (down, or stopping) keeps the tags it last had: it is
    /// still a member, placed after the servers that are up.
    fn server_tags(&self) -> std::collections::HashMap<String, Vec<String>> {
        let mut known = self.tags.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = self.host.server() {
            known.insert(server.server_name.clone(), server.opts.server_tags.clone());
            for r in server.cluster.get().map(|c| c.routes()).unwrap_or_default() {
                known.insert(r.remote_name(), r.remote_tags());
            }
        }
        known.clone()
    }

    /// Each server's JetStream memory and file store limits: this one's, and its peers' as
    /// their route INFO said (kept as last seen, as `server_tags`; none from a server too
    /// old to say them).
    fn server_js_limits(&self) -> std::collections::HashMap<String, [i64; 2]> {
        let mut known = self.js_limits.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = self.host.server() {
            let (memory, store) = server.storage_limits();
            known.insert(server.server_name.clone(), [memory, store]);
            for r in server.cluster.get().map(|c| c.routes()).unwrap_or_default() {
                if let Some(l) = r.remote_js_limits() {
                    known.insert(r.remote_name(), l);
                }
            }
        }
        known.clone()
    }

    /// `account`'s creates and deletes proposed in `term` and not followed yet (see
    /// `proposed`; those of other terms are dropped).
    fn proposed_of(&self, account: &str, term: u64) -> BTreeMap<String, Option<StreamAssignment>> {
        let mut g = self.proposed.lock().unwrap_or_else(|e| e.into_inner());
        g.retain(|_, (t, _)| *t == term);
        g.iter()
            .filter(|((a, _), _)| a == account)
            .map(|((_, n), (_, s))| (n.clone(), s.clone()))
            .collect()
    }

    /// Notes a create (`Some`) or delete (`None`) of `account`'s stream `name` proposed in
    /// the current term (see `proposed`).
    fn note_proposed(&self, account: &str, name: &str, create: Option<StreamAssignment>) {
        let term = self.raft().metrics().borrow().current_term;
        self.proposed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((account.to_string(), name.to_string()), (term, create));
    }

    /// The assignment of `account`'s stream `name`.
    pub fn assignment(&self, account: &str, name: &str) -> Option<StreamAssignment> {
        self.machine
            .with_state(|s| s.streams.get(account).and_then(|m| m.get(name)).cloned())
    }

    /// Sends a JetStream API request on to `to`, which handles it as if its client had
    /// sent it there; the answer goes straight to the request's reply subject.
    fn forward(&self, to: &str, account: &str, m: &crate::client::InMsg, hops: u8) {
        let body = super::raft::Forwarded {
            account: account.to_string(),
            subject: m.subject.to_vec(),
            reply: m.reply.as_ref().map(|r| r.to_vec()),
            hdr_len: m.hdr_len,
            data: m.data.to_vec(),
            hops: hops | (raw_hops(m) & CHECKED),
        };
        self.host.forward(to, &body);
    }
}

/// A clustered account's API request: forwarded to the server that answers it (the meta
/// leader for creates, deletes and lists; the stream's leader for everything about one
/// stream), or handled here in the cluster's way. False: handle it locally as usual.
pub async fn api(
    js: &Arc<super::JetStream>,
    server: &Arc<Server>,
    router: &mut crate::router::Router,
    m: &crate::client::InMsg,
    tokens: &[&str],
) -> bool {
    let Some(meta) = server.jetstream.get().and_then(|j| j.meta.get()).cloned() else {
        return false;
    };
    let Some(reply) = m.reply.clone() else {
        return false;
    };
    let hops = hops(m);
    let account = js.account.name.clone();
    if server.jetstream_enabled().is_none() {
        // Removed from the cluster (`disable`): the rest of the cluster answers, as the
        // reference's other servers do for the clients of one whose JetStream is off.
        if matches!(tokens, ["CONSUMER", "MSG", "NEXT", ..]) {
            return true; // The consumer's own subscription, on its leader, gets it.
        }
        match serving_peer(server) {
            Some(to) if hops < MAX_HOPS => meta.forward(&to, &account, m, hops + 1),
            _ => refuse(
                server,
                router,
                &reply,
                tokens,
                super::api::ErrorKind::NotEnabled,
            ),
        }
        return true;
    }
    // A stream update that changes its config is checked by the meta leader against every
    // stream of the account (subjects overlap, sources' cycles: streams on other servers
    // too) and written into the stream's assignment, with its new peers for a change of
    // replicas (new peers join the stream's group, removed ones leave it:
    // `raft::stream::run_group`); the stream's leader then takes the config as any other
    // update (`update_on_meta`).
    if let ["STREAM", "UPDATE", name] = tokens {
        if !checked(m) {
            if !meta.is_leader() {
                let want = rescale_wanted(&meta, &account, name, m.payload()).await;
                if want.is_some() || config_changed(js, &meta, name, m.payload()) {
                    match meta.leader() {
                        Some(l) if hops < MAX_HOPS => meta.forward(&l, &account, m, hops + 1),
                        _ => unavailable(server, router, &reply, tokens),
                    }
                    return true;
                }
            } else if update_on_meta(js, server, router, &meta, m, name, &reply).await {
                return true;
            }
        }
    }
    if let ["STREAM", "CREATE", name] = tokens {
        // A replica here in an election (or elected and not acting yet) learns the
        // outcome in moments: sent on meanwhile, the create would go between servers that
        // each know less than the next until its hops run out. (Only for a create, rare:
        // the account's API waits meanwhile.)
        wait_for_leader(js, name, &meta.host.name, Duration::from_secs(2)).await;
    }
    let meta_level = match tokens {
        // A stream whose replica here leads or knows its leader is answered by that
        // leader (below); any other create goes to the meta leader, which places a new
        // stream or has the leader of one assigned already answer (`Follow::Again`): not
        // forwarded between servers that each know less than the meta leader until the
        // hops run out.
        ["STREAM", "CREATE", name] => !js
            .stream(name)
            .is_some_and(|s| s.leads() || s.leader_name().is_some_and(|l| l != meta.host.name)),
        ["STREAM", "DELETE", _] | ["STREAM", "NAMES"] | ["STREAM", "LIST"] | ["INFO"] => true,
        ["STREAM", "PEER", "REMOVE", _] => true,
        _ => false,
    };
    if meta_level {
        // Just after start (or an election) there may be no leader for a moment: wait a
        // little rather than refuse at once (clients wait seconds for an answer).
        let deadline = Instant::now() + Duration::from_secs(4);
        while meta.leader().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if meta.is_leader() {
            return meta_api(js, server, router, &meta, m, tokens, &reply).await;
        }
        match meta.leader() {
            Some(l) if hops < MAX_HOPS => meta.forward(&l, &account, m, hops + 1),
            _ => unavailable(server, router, &reply, tokens),
        }
        return true;
    }
    let Some(stream) = stream_of(tokens) else {
        return false;
    };
    let mut a = meta.assignment(&account, stream);
    if a.is_none() && hops > 0 {
        // Sent here by a server that knows the stream: this one's meta state has not
        // applied its create yet (it learns it in moments), so it waits rather than
        // answer "stream not found" to a client that just made it.
        let deadline = Instant::now() + Duration::from_secs(2);
        while a.is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            a = meta.assignment(&account, stream);
        }
    }
    let Some(a) = a else {
        return false; // Not in the cluster: answered here (not found).
    };
    let local = js.stream(stream);
    if local.as_ref().is_some_and(|s| s.leads()) {
        return false; // This server leads it (an R1 stream's one server).
    }
    // With `allow_direct`, every replica answers direct gets from its own store, as the
    // reference's do, but one being refilled or that left its group (`serves_reads`).
    if matches!(tokens, ["DIRECT", ..])
        && local
            .as_ref()
            .is_some_and(|s| s.config().allow_direct && s.serves_reads())
    {
        return false;
    }
    if matches!(tokens, ["CONSUMER", "MSG", "NEXT", ..]) {
        // The consumer's own subscription, on its leader, gets the pull request.
        return true;
    }
    // A replica knows its group's leader; others ask a peer this server has a route to
    // (a server that went down has none), which does.
    let me = &meta.host.name;
    let routed: BTreeSet<String> = server
        .cluster
        .get()
        .map(|c| c.routes().iter().map(|r| r.remote_name()).collect())
        .unwrap_or_default();
    let up = |p: &&String| routed.contains(*p);
    let target = local
        .and_then(|s| s.leader_name())
        .filter(|l| l != me)
        .or_else(|| a.peers.iter().filter(|p| *p != me).find(up).cloned())
        .or_else(|| a.peers.iter().find(|p| *p != me).cloned());
    match target.as_ref() {
        Some(l) if hops < MAX_HOPS && *l != meta.host.name => {
            meta.forward(l, &account, m, hops + 1)
        }
        _ => unavailable(server, router, &reply, tokens),
    }
    true
}

/// A per-stream request that failed here, taken as the stream's leader, while the group
/// moved on (this server leads no more, or the failure was its group's: a commit that
/// found it was not leader): sent on to the new leader once there is one (2 s at most),
/// which answers it. If this server still leads then, the failure (`e`, in `kind`'s
/// response) is the answer. False: answer it now.
pub fn send_to_new_leader(
    js: &Arc<super::JetStream>,
    server: &Arc<Server>,
    m: &crate::client::InMsg,
    tokens: &[&str],
    kind: &str,
    e: &super::api::ApiError,
) -> bool {
    let Some(meta) = server.jetstream.get().and_then(|j| j.meta.get()).cloned() else {
        return false;
    };
    let (Some(name), hops) = (stream_of(tokens), hops(m)) else {
        return false;
    };
    let Some(s) = js.stream(name).filter(|s| s.group.is_some()) else {
        return false;
    };
    let unavailable = super::api::ErrorKind::ClusterUnavailable.err();
    let group_failed =
        e.err_code == unavailable.err_code || e.description == unavailable.description;
    if hops >= MAX_HOPS || (s.leads() && !group_failed) {
        return false;
    }
    let Some(reply) = m.reply.clone() else {
        return false;
    };
    let body = super::api::error_body_for(kind, e);
    let (js, server, m, name) = (js.clone(), server.clone(), m.clone(), name.to_string());
    drop(s);
    tokio::spawn(async move {
        let me = meta.host.name.clone();
        // (A leader that has just lost its group may not know it yet: a moment first.)
        tokio::time::sleep(Duration::from_millis(50)).await;
        wait_for_leader(&js, &name, &me, Duration::from_secs(2)).await;
        let leader = js.stream(&name).and_then(|s| s.leader_name());
        match leader {
            Some(l) if l != me => meta.forward(&l, &js.account.name, &m, hops + 1),
            _ => {
                let mut router = crate::router::Router::new(js.account.clone(), 0x4a53);
                super::api::reply(&server, &mut router, &reply, body);
                router.flush();
            }
        }
    });
    true
}

/// `503 10008`, the reference's answer while a group has no leader.
fn unavailable(
    server: &Server,
    router: &mut crate::router::Router,
    reply: &bytes::Bytes,
    tokens: &[&str],
) {
    refuse(
        server,
        router,
        reply,
        tokens,
        super::api::ErrorKind::ClusterUnavailable,
    );
}

/// Answers a request with `error` (in its response type).
fn refuse(
    server: &Server,
    router: &mut crate::router::Router,
    reply: &bytes::Bytes,
    tokens: &[&str],
    error: super::api::ErrorKind,
) {
    let kind = match tokens {
        ["INFO"] => "account_info",
        ["STREAM", op, ..] => match *op {
            "CREATE" => "stream_create",
            "DELETE" => "stream_delete",
            "NAMES" => "stream_names",
            "LIST" => "stream_list",
            "INFO" => "stream_info",
            "UPDATE" => "stream_update",
            "PURGE" => "stream_purge",
            "LEADER" => "stream_leader_stepdown",
            "PEER" => "stream_remove_peer",
            _ => "stream_msg_get",
        },
        _ => "consumer_info",
    };
    let e = error.err();
    super::api::reply(server, router, reply, super::api::error_body_for(kind, &e));
    router.flush();
}

/// The meta leader's part of the API.
async fn meta_api(
    js: &Arc<super::JetStream>,
    server: &Arc<Server>,
    router: &mut crate::router::Router,
    meta: &Arc<Meta>,
    m: &crate::client::InMsg,
    tokens: &[&str],
    reply: &bytes::Bytes,
) -> bool {
    let account = js.account.name.clone();
    let (kind, result): (&str, Result<Option<Vec<u8>>, super::api::ApiError>) = match tokens {
        ["STREAM", "CREATE", name] => (
            "stream_create",
            create(js, server, meta, name, m.payload(), reply)
                .await
                .map(|_| None),
        ),
        ["STREAM", "DELETE", name] => ("stream_delete", delete(js, meta, name).await),
        ["STREAM", "NAMES"] => ("stream_names", names(js, meta, m.payload())),
        ["STREAM", "PEER", "REMOVE", name] => (
            "stream_remove_peer",
            remove_peer(js, meta, name, m.payload()).await,
        ),
        ["STREAM", "LIST"] => (
            "stream_list",
            list(js, server, meta, m.payload()).await.map(Some),
        ),
        ["INFO"] => (
            "account_info",
            account_info(js, server, meta).await.map(Some),
        ),
        _ => return false,
    };
    let body = match result {
        Ok(None) => return true, // The stream's leader answers.
        Ok(Some(b)) => b,
        Err(e) => super::api::error_body_for(kind, &e),
    };
    super::api::reply(server, router, reply, body);
    router.flush();
    let _ = account;
    true
}

/// The config an assignment keeps: the request's, with the duplicate window this leader
/// resolved (its `jetstream { limits }` may lower the default), so every replica keeps the
/// same one.
fn assigned_config(body: &[u8], cfg: &super::stream::StreamConfig) -> Value {
    let mut raw: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if raw.is_object() && raw.get("duplicate_window").is_none() && cfg.duplicate_window > 0 {
        raw["duplicate_window"] = cfg.duplicate_window.into();
    }
    raw
}

/// STREAM.CREATE on the meta leader: checked against every assignment, placed, and
/// proposed; the first peer creates it when the assignment applies and answers then.
async fn create(
    js: &Arc<super::JetStream>,
    server: &Server,
    meta: &Meta,
    name: &str,
    body: &[u8],
    reply: &bytes::Bytes,
) -> Result<(), super::api::ApiError> {
    use super::api::ErrorKind;
    let cfg = super::api::streams::parse_config(js, name, body)?;
    super::api::streams::check_alone(&cfg)?;
    // (As each server checks it, with the same configs: no assignment a server refuses.)
    super::sourcing::check_with_streams(js, server, &mut cfg.clone())?;
    let state = meta.machine.state();
    let account = &js.account.name;
    let mut mine = state.streams.get(account).cloned().unwrap_or_default();
    let term = meta.raft().metrics().borrow().current_term;
    let mut inflight = BTreeMap::new();
    for (n, create) in meta.proposed_of(account, term) {
        // A stream being deleted counts as gone.
        mine.remove(&n);
        if let Some(a) = create {
            inflight.insert(n, a);
        }
    }
    let raw = assigned_config(body, &cfg);
    // Assigned already (the request reached this leader before the assignment reached the
    // server it was sent to, or came from a server with no replica), or proposed and not
    // yet applied: proposed again with this reply and the same group and peers
    // (`Follow::Again`), and the stream's leader answers: with the stream as it is for the
    // config it has now (an update changes it in the stream's own group, not here), 10058
    // for another, as the reference. An in-flight create has no stream to ask yet: a
    // different config is refused here.
    let committed = mine.get(name);
    if let Some(a) = committed.or_else(|| inflight.get(name)) {
        if committed.is_none() {
            let same = serde_json::to_vec(&a.config)
                .ok()
                .and_then(|b| super::api::streams::parse_config(js, name, &b).ok())
                .is_some_and(|old| old.same_as(&cfg));
            if !same {
                return Err(ErrorKind::StreamNameInUse.err());
            }
        }
        let assignment = StreamAssignment {
            config: raw,
            reply: Some(String::from_utf8_lossy(reply).into_owned()),
            asked: crate::time::now_nanos(),
            ..a.clone()
        };
        return assign(js, meta, name, assignment).await;
    }
    mine.extend(inflight);
    for a in mine.values() {
        if cfg.subjects.iter().any(|s| a.matches(Some(s))) {
            return Err(ErrorKind::SubjectsOverlap.err());
        }
    }
    let max_streams = js.account.jetstream_limits().max_streams;
    if max_streams >= 0 && mine.len() as i64 >= max_streams {
        return Err(ErrorKind::MaxStreams.err());
    }
    check_account_room(js, &mine, &cfg, cfg.num_replicas.max(1) as usize)?;
    let peers = place(
        meta,
        &state,
        &js.account.name,
        cfg.num_replicas.max(1) as usize,
        &raw,
        &[],
    )?;
    let replicas = peers.len();
    // Every stream has a group, R1 too, so that its replicas can change later (new peers
    // catch up from the group's log or a snapshot); a memory stream's log is in memory.
    let memory = cfg.storage == super::stream::StorageType::Memory;
    let group = format!(
        "S-R{replicas}{}-{}",
        if memory { "M" } else { "F" },
        crate::account::random_token(8)
    );
    let assignment = StreamAssignment {
        config: raw,
        peers,
        group,
        created: crate::time::now_nanos(),
        reply: Some(String::from_utf8_lossy(reply).into_owned()),
        asked: 0,
        regrouped: false,
    };
    meta.note_proposed(account, name, Some(assignment.clone()));
    assign(js, meta, name, assignment).await
}

/// The storage type of an assignment's (raw) config, and the bytes it reserves on each of
/// its servers (its `max_bytes`; 0 without one).
fn reserves(config: &Value) -> (super::stream::StorageType, i64) {
    let storage = match config["storage"].as_str() {
        Some("memory") => super::stream::StorageType::Memory,
        _ => super::stream::StorageType::File,
    };
    (storage, config["max_bytes"].as_i64().unwrap_or(0).max(0))
}

/// The account's storage limits, across the cluster, for a stream with `cfg` on `replicas`
/// servers beside the account's `others`: as the reference counts them, each stream
/// reserves its `max_bytes` on each of its servers. (Each server checks its own share again
/// when it makes its replica: never more than this.)
fn check_account_room(
    js: &super::JetStream,
    others: &BTreeMap<String, StreamAssignment>,
    cfg: &super::stream::StreamConfig,
    replicas: usize,
) -> Result<(), super::api::ApiError> {
    use super::api::streams::{check_account_alone, room};
    check_account_alone(js, cfg)?;
    let reserved = || {
        others
            .values()
            .filter(|a| reserves(&a.config).0 == cfg.storage)
            .map(|a| {
                reserves(&a.config)
                    .1
                    .saturating_mul(a.peers.len().max(1) as i64)
            })
            .fold(0i64, i64::saturating_add)
    };
    let need = cfg.max_bytes.max(0).saturating_mul(replicas.max(1) as i64);
    room(js.account_limit(cfg.storage), cfg, need, reserved)
}

/// Proposes `account`'s stream `name` placed as `assignment` (a create, or a change of its
/// peers); resolves once committed.
async fn assign(
    js: &super::JetStream,
    meta: &Meta,
    name: &str,
    assignment: StreamAssignment,
) -> Result<(), super::api::ApiError> {
    let op = MetaOp::AssignStream {
        account: js.account.name.clone(),
        name: name.to_string(),
        assignment,
    };
    meta.propose(&op)
        .await
        .map_err(|_| super::api::ErrorKind::ClusterUnavailable.err())
}

/// A placement's `tags`, lowercased (server tags are).
fn placement_tags(placement: &Value) -> Vec<String> {
    placement["tags"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|x| x.as_str())
                .map(str::to_ascii_lowercase)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether server `name` has every one of `tags`.
fn has_tags(
    server_tags: &std::collections::HashMap<String, Vec<String>>,
    name: &str,
    tags: &[String],
) -> bool {
    let have = server_tags.get(name);
    tags.iter()
        .all(|t| have.is_some_and(|h| h.iter().any(|x| x == t)))
}

/// Chooses `replicas` servers among the meta group's members other than `exclude` (the
/// peers a stream keeps), as the reference does: servers that are up first (`is_up`), then
/// the ones with the fewest streams (ties by name); a server that is down or said it is
/// stopping is chosen only after every one that is up, and not at all if the servers that
/// are up (with the kept peers) would not make a quorum of the group
/// (10005 ", peer offline").
fn place(
    meta: &Meta,
    state: &MetaState,
    account: &str,
    replicas: usize,
    cfg: &Value,
    exclude: &[String],
) -> Result<Vec<String>, super::api::ApiError> {
    use super::api::ErrorKind;
    let p = &cfg["placement"];
    if p["cluster"]
        .as_str()
        .is_some_and(|c| !c.is_empty() && c != meta.cluster_name)
    {
        return Err(ErrorKind::NoSuitablePeers.err());
    }
    // Every tag asked for must be one of the server's `server_tags` (either side's case).
    let tags = placement_tags(p);
    let server_tags = meta.server_tags();
    let tagged = |name: &str| has_tags(&server_tags, name, &tags);
    let m = meta.raft().metrics().borrow().clone();
    if !tags.is_empty() && !m.membership_config.nodes().any(|(_, p)| tagged(&p.name)) {
        return Err(ErrorKind::NoSuitablePeersReason
            .with(format!(", tags not matched ['{}']", tags.join("', '"))));
    }
    // A stream with `max_bytes` goes only where it fits beside what the streams there
    // reserve (every account's), as the reference places it.
    let (storage, need) = reserves(cfg);
    let limits = meta.server_js_limits();
    let mut reserved: BTreeMap<&str, i64> = BTreeMap::new();
    if need > 0 {
        for a in state.streams.values().flat_map(|m| m.values()) {
            let (s, bytes) = reserves(&a.config);
            if s == storage {
                for p in &a.peers {
                    let r = reserved.entry(p.as_str()).or_default();
                    *r = r.saturating_add(bytes);
                }
            }
        }
    }
    let fits = |name: &str| {
        let limit = limits.get(name).map(|l| match storage {
            super::stream::StorageType::Memory => l[0],
            super::stream::StorageType::File => l[1],
        });
        need == 0 || limit.is_none_or(|l| l - reserved.get(name).copied().unwrap_or(0) >= need)
    };
    let mut no_room = false;
    // Server -> (down, streams it holds).
    let mut load: BTreeMap<String, (bool, usize)> = BTreeMap::new();
    // Tags servers lacked (the reference names them in its refusal).
    let mut unmatched: Vec<&String> = Vec::new();
    for (_, p) in m.membership_config.nodes() {
        if exclude.contains(&p.name) {
            continue;
        }
        if tagged(&p.name) && !fits(&p.name) {
            no_room = true;
        } else if tagged(&p.name) {
            load.insert(p.name.clone(), (!meta.host.is_up(&p.name), 0));
        } else if let Some(t) = tags
            .iter()
            .find(|t| !has_tags(&server_tags, &p.name, std::slice::from_ref(*t)))
        {
            // (The first one it lacks, as the reference notes it.)
            if !unmatched.contains(&t) {
                unmatched.push(t);
            }
        }
    }
    let refused = |offline: bool| {
        let mut why = String::new();
        if offline {
            why.push_str(", peer offline");
        }
        if no_room {
            why.push_str(", insufficient storage");
        }
        if !unmatched.is_empty() {
            let list: Vec<&str> = unmatched.iter().map(|t| t.as_str()).collect();
            why.push_str(&format!(", tags not matched ['{}']", list.join("', '")));
        }
        if why.is_empty() {
            ErrorKind::NoSuitablePeers.err()
        } else {
            ErrorKind::NoSuitablePeersReason.with(why)
        }
    };
    for streams in state.streams.values() {
        for a in streams.values() {
            for p in &a.peers {
                if let Some((_, n)) = load.get_mut(p) {
                    *n += 1;
                }
            }
        }
    }
    if replicas > load.len() {
        return Err(refused(false));
    }
    let up = load.values().filter(|(down, _)| !down).count();
    if up + exclude.len() < (replicas + exclude.len()) / 2 + 1 {
        return Err(refused(true));
    }
    // A stream sources (or mirrors) streams of this cluster most cheaply through their
    // replicas on its own server (`sourcing.rs` reads a local store directly, others over
    // the routes): the servers holding the most of its origins come first, then the least
    // loaded.
    let origins = origin_names(cfg);
    let lacking = |server: &str| {
        origins
            .iter()
            .filter(|o| {
                !state
                    .streams
                    .get(account)
                    .and_then(|m| m.get(o.as_str()))
                    .is_some_and(|a| a.peers.iter().any(|p| p == server))
            })
            .count()
    };
    let mut ranked: Vec<((bool, usize, usize), String)> = load
        .into_iter()
        .map(|(n, (down, l))| ((down, lacking(&n), l), n))
        .collect();
    ranked.sort();
    Ok(ranked.into_iter().take(replicas).map(|(_, n)| n).collect())
}

/// The streams of this domain a stream config mirrors or sources (not `external` ones).
fn origin_names(cfg: &Value) -> Vec<String> {
    let mirror = cfg.get("mirror").into_iter();
    let sources = cfg
        .get("sources")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    mirror
        .chain(sources)
        .filter(|o| o.get("external").is_none_or(Value::is_null))
        .filter_map(|o| o.get("name").and_then(Value::as_str))
        .map(str::to_string)
        .collect()
}

/// STREAM.DELETE on the meta leader: proposed; every peer deletes its replica when it
/// applies; answered once committed.
async fn delete(
    js: &Arc<super::JetStream>,
    meta: &Meta,
    name: &str,
) -> Result<Option<Vec<u8>>, super::api::ApiError> {
    use super::api::ErrorKind;
    if meta.assignment(&js.account.name, name).is_none() {
        return Err(ErrorKind::StreamNotFound.err());
    }
    let op = MetaOp::RemoveStream {
        account: js.account.name.clone(),
        name: name.to_string(),
    };
    meta.note_proposed(&js.account.name, name, None);
    meta.propose(&op)
        .await
        .map_err(|_| ErrorKind::ClusterUnavailable.err())?;
    Ok(Some(
        br#"{"type":"io.nats.jetstream.api.v1.stream_delete_response","success":true}"#.to_vec(),
    ))
}

/// The replica count an update asks for, where it differs from the stream's assignment
/// (`None`: nothing to place). A request forwarded here by the meta leader finds the new
/// assignment applied, or shortly will: it is given a moment rather than sent back.
async fn rescale_wanted(meta: &Meta, account: &str, name: &str, body: &[u8]) -> Option<usize> {
    let v: Value = serde_json::from_slice(body).ok()?;
    // Absent or 0 is 1, as a create takes it; a negative count is the update's error.
    let want = match v.get("num_replicas").and_then(|n| n.as_i64()).unwrap_or(1) {
        n if n < 0 => return None,
        0 => 1,
        n => n as usize,
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let have = meta.assignment(account, name)?.peers.len();
        if have == want {
            return None;
        }
        if meta.is_leader() || Instant::now() >= deadline {
            return Some(want);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether an update's config differs from the one in the stream's assignment (one that
/// does not parse is answered by the stream's leader, as any other bad update).
fn config_changed(js: &Arc<super::JetStream>, meta: &Meta, name: &str, body: &[u8]) -> bool {
    use super::api::streams::parse_config;
    let Ok(cfg) = parse_config(js, name, body) else {
        return false;
    };
    let Some(a) = meta.assignment(&js.account.name, name) else {
        return false;
    };
    let old = serde_json::to_vec(&a.config).unwrap_or_default();
    parse_config(js, name, &old).map_or(true, |old| !old.same_as(&cfg))
}

/// STREAM.UPDATE on the meta leader, as the reference decides it: checked against every
/// stream of the account (`plan_update`) and, when it changes the stream, written into its
/// assignment; then sent to the stream's leader, which checks what only it knows (its
/// consumers' limits) and takes it into the stream's group. Its answer goes to the client;
/// a refusal puts the assignment back as it was, so that no later check sees a config the
/// stream never took. False: nothing changes, the request goes on as any other.
async fn update_on_meta(
    js: &Arc<super::JetStream>,
    server: &Arc<Server>,
    router: &mut crate::router::Router,
    meta: &Arc<Meta>,
    m: &crate::client::InMsg,
    name: &str,
    reply: &bytes::Bytes,
) -> bool {
    let account = js.account.name.clone();
    let fail = |router: &mut crate::router::Router, e: &super::api::ApiError| {
        let body = super::api::error_body_for("stream_update", e);
        super::api::reply(server, router, reply, body);
        router.flush();
    };
    let want = rescale_wanted(meta, &account, name, m.payload()).await;
    let (old, new) = match plan_update(js, server, meta, name, m.payload(), want) {
        Ok(Some(plan)) => plan,
        Ok(None) => return false,
        Err(e) => {
            fail(router, &e);
            return true;
        }
    };
    if let Err(e) = assign(js, meta, name, new.clone()).await {
        fail(router, &e);
        return true;
    }
    // To the stream's leader: found from the peers the stream had (a move's new peers do
    // not know it yet), through this server's own API queue when its own replica leads or
    // knows no better, the answer to this server's inbox.
    let inbox = meta.inbox(server, &js.account);
    let (ask, n, rx) = inbox.reply();
    let me = &meta.host.name;
    let local = js.stream(name);
    let to = match &local {
        Some(s) if s.leads() => None,
        _ => local
            .as_ref()
            .and_then(|s| s.leader_name())
            .filter(|l| l != me)
            .or_else(|| old.peers.iter().find(|p| *p != me).cloned()),
    };
    let sid = bytes::Bytes::from(format!("fwd{CHECKED}"));
    let sent = match to {
        Some(to) => {
            let checked = crate::client::InMsg {
                sid,
                subject: m.subject.clone(),
                reply: Some(bytes::Bytes::from(ask)),
                hdr_len: m.hdr_len,
                data: m.data.clone(),
                origin: 0,
            };
            meta.forward(&to, &account, &checked, 1);
            true
        }
        None => js.queue_request(&m.subject, &sid, Some(ask.as_bytes()), m.hdr_len, &m.data),
    };
    if !sent {
        inbox.forget(n);
        restore(js, meta, name, &new, old).await;
        fail(router, &super::api::ErrorKind::ClusterUnavailable.err());
        return true;
    }
    // Waited for in a task of its own: this queue serves the update itself.
    let (js, server, meta, reply, name) = (
        js.clone(),
        server.clone(),
        meta.clone(),
        reply.clone(),
        name.to_string(),
    );
    tokio::spawn(async move {
        let Ok(Ok(answer)) = tokio::time::timeout(UPDATE_WAIT, rx).await else {
            // No answer (the client's request timed out too): the stream may yet take it,
            // so the assignment keeps the new config.
            inbox.forget(n);
            return;
        };
        let refused = serde_json::from_slice::<Value>(&answer)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e["err_code"].as_u64()));
        // 10008: no leader, or its commit outcome unknown: the stream may yet take it.
        if refused.is_some_and(|code| code != 10008) {
            restore(&js, &meta, &name, &new, old).await;
        }
        let mut router = crate::router::Router::new(js.account.clone(), 0x4a53);
        super::api::reply(&server, &mut router, &reply, answer);
        router.flush();
    });
    true
}

/// How long the meta leader waits for a stream's leader to answer an update it checked.
const UPDATE_WAIT: Duration = Duration::from_secs(10);

/// Puts back the assignment `old` of a refused update, unless something changed the
/// assignment since it wrote `new`.
async fn restore(
    js: &super::JetStream,
    meta: &Meta,
    name: &str,
    new: &StreamAssignment,
    old: StreamAssignment,
) {
    let now = meta.assignment(&js.account.name, name);
    if now.is_some_and(|a| a.config == new.config && a.peers == new.peers) {
        let _ = assign(js, meta, name, old).await;
    }
}

/// On the meta leader, an update checked against the other streams (overlapping subjects,
/// `sourcing::check_with_streams`) and, if it changes the stream's config or placement,
/// the assignment it had and the one it gets. With `want`, the stream is placed on that
/// many servers: shrinking keeps the stream's leader where this server knows it; growing
/// adds the least loaded servers (`place`).
fn plan_update(
    js: &Arc<super::JetStream>,
    server: &Server,
    meta: &Meta,
    name: &str,
    body: &[u8],
    want: Option<usize>,
) -> Result<Option<(StreamAssignment, StreamAssignment)>, super::api::ApiError> {
    use super::api::ErrorKind;
    let mut cfg = super::api::streams::parse_config(js, name, body)?;
    let a = meta
        .assignment(&js.account.name, name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    if want.is_some() && a.group.is_empty() {
        return Err(ErrorKind::InvalidConfig.with(
            if cfg.storage == super::stream::StorageType::Memory {
                "this memory stream's replicas cannot change: it was made with one replica by an older Keel, without a Raft group (make it again)"
            } else {
                "this stream's replicas cannot change: it has no Raft group"
            },
        ));
    }
    let old = serde_json::to_vec(&a.config).unwrap_or_default();
    let old = super::api::streams::parse_config(js, name, &old).ok();
    if let Some(old) = &old {
        old.check_update(&cfg)?;
    }
    super::api::streams::check_alone(&cfg)?;
    super::sourcing::check_with_streams(js, server, &mut cfg)?;
    let state = meta.machine.state();
    let account = &js.account.name;
    let mut others = state.streams.get(account).cloned().unwrap_or_default();
    let term = meta.raft().metrics().borrow().current_term;
    for (n, create) in meta.proposed_of(account, term) {
        others.remove(&n);
        if let Some(c) = create {
            others.insert(n, c);
        }
    }
    others.remove(name);
    for o in others.values() {
        if cfg.subjects.iter().any(|s| o.matches(Some(s))) {
            return Err(ErrorKind::SubjectsOverlap.err());
        }
    }
    // Only an update that reserves more is held to the account's limits (one lowered
    // since does not block other changes).
    let replicas = want.unwrap_or(a.peers.len()).max(1);
    let had = reserves(&a.config)
        .1
        .saturating_mul(a.peers.len().max(1) as i64);
    if cfg.max_bytes.max(0).saturating_mul(replicas as i64) > had {
        check_account_room(js, &others, &cfg, replicas)?;
    }
    let moved = old.as_ref().is_some_and(|old| {
        old.placement.clone().unwrap_or_default() != cfg.placement.clone().unwrap_or_default()
    });
    if want.is_none() && old.is_some_and(|old| old.same_as(&cfg)) {
        return Ok(None);
    }
    let raw = assigned_config(body, &cfg);
    let mut peers = a.peers.clone();
    if moved {
        // A new placement moves the stream off the servers it no longer suits, as the
        // reference's does: new ones join its group and catch up, then the others leave
        // (`raft::stream::reconcile`; a leader leaving hands the group over first).
        let p = cfg.placement.clone().unwrap_or_default();
        let tags: Vec<String> = p.tags.iter().map(|t| t.to_ascii_lowercase()).collect();
        let server_tags = meta.server_tags();
        let other_cluster = !p.cluster.is_empty() && p.cluster != meta.cluster_name;
        peers.retain(|s| !other_cluster && has_tags(&server_tags, s, &tags));
    }
    let replicas = want.unwrap_or(a.peers.len());
    if replicas < peers.len() {
        if let Some(l) = js.stream(name).and_then(|s| s.leader_name()) {
            if let Some(i) = peers.iter().position(|p| *p == l) {
                let l = peers.remove(i);
                peers.insert(0, l);
            }
        }
        peers.truncate(replicas);
    } else if replicas > peers.len() {
        let more = place(meta, &state, account, replicas - peers.len(), &raw, &peers)?;
        peers.extend(more);
    }
    let new = StreamAssignment {
        config: raw,
        ..a.on_peers(peers)
    };
    Ok(Some((StreamAssignment { reply: None, ..a }, new)))
}

/// `$JS.API.STREAM.PEER.REMOVE.<stream>` on the meta leader: `peer` leaves the stream's
/// group and, where a server is free, another takes its place.
async fn remove_peer(
    js: &Arc<super::JetStream>,
    meta: &Meta,
    name: &str,
    body: &[u8],
) -> Result<Option<Vec<u8>>, super::api::ApiError> {
    use super::api::ErrorKind;
    let peer = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("peer").and_then(|p| p.as_str()).map(str::to_string))
        .unwrap_or_default();
    if peer.is_empty() {
        return Err(ErrorKind::BadRequest.err());
    }
    let a = meta
        .assignment(&js.account.name, name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    if !a.peers.contains(&peer) {
        return Err(ErrorKind::PeerNotMember.err());
    }
    let state = meta.machine.state();
    let mut peers: Vec<String> = a.peers.iter().filter(|p| **p != peer).cloned().collect();
    peers.extend(place(meta, &state, &js.account.name, 1, &a.config, &a.peers).unwrap_or_default());
    if peers.is_empty() || a.group.is_empty() {
        // Nowhere else to keep it.
        return Err(ErrorKind::PeerRemap.err());
    }
    assign(js, meta, name, a.on_peers(peers)).await?;
    Ok(Some(
        br#"{"type":"io.nats.jetstream.api.v1.stream_remove_peer_response","success":true}"#
            .to_vec(),
    ))
}

impl StreamAssignment {
    /// Whether a list request's `subject` filter (none or empty: all) overlaps the
    /// stream's subjects.
    fn matches(&self, filter: Option<&str>) -> bool {
        match filter {
            None | Some("") => true,
            Some(f) => self
                .config
                .get("subjects")
                .and_then(|s| s.as_array())
                .is_some_and(|s| {
                    s.iter()
                        .filter_map(|x| x.as_str())
                        .any(|x| super::stream::subjects_overlap(x, f))
                }),
        }
    }
}

/// `$JS.API.INFO` on the meta leader: the cluster's usage, as the reference reports it
/// (every replica's bytes, summed over the servers; the consumers of every stream, counted
/// where each leads; the streams from the assignments). A server that does not answer in
/// time is left out of the sums.
async fn account_info(
    js: &Arc<super::JetStream>,
    server: &Arc<Server>,
    meta: &Arc<Meta>,
) -> Result<Vec<u8>, super::api::ApiError> {
    let mut info = super::api::account::info(js, server);
    let (memory, storage, consumers) = super::api::account::local_usage(js);
    (info.memory, info.storage, info.consumers) = (memory, storage, consumers);
    let others: Vec<String> = meta
        .raft()
        .metrics()
        .borrow()
        .membership_config
        .nodes()
        .map(|(_, p)| p.name.clone())
        .filter(|n| *n != meta.host.name)
        .collect();
    // Asked at once, each on its own task.
    let asks: Vec<_> = others
        .into_iter()
        .map(|n| {
            let (host, a) = (meta.host.clone(), js.account.name.clone());
            tokio::spawn(async move { host.usage(&n, &a, Duration::from_secs(1)).await })
        })
        .collect();
    for a in asks {
        if let Ok(Some((m, f, c))) = a.await {
            info.memory += m;
            info.storage += f;
            info.consumers += c as usize;
        }
    }
    Ok(super::api::encoded_for("account_info", Ok(info)))
}

/// STREAM.NAMES from the assignments.
fn names(
    js: &Arc<super::JetStream>,
    meta: &Meta,
    body: &[u8],
) -> Result<Option<Vec<u8>>, super::api::ApiError> {
    let req: super::api::types::ListRequest =
        super::api::parse_request(body, &super::schema::STREAM_NAMES, js.strict)?;
    let state = meta.machine.state();
    let all: Vec<&String> = state
        .streams
        .get(&js.account.name)
        .into_iter()
        .flatten()
        .filter(|(_, a)| a.matches(req.subject.as_deref()))
        .map(|(n, _)| n)
        .collect();
    let limit = 1024;
    let page: Vec<&String> = all.iter().skip(req.offset).take(limit).copied().collect();
    let v = json!({
        "type": "io.nats.jetstream.api.v1.stream_names_response",
        "total": all.len(),
        "offset": req.offset,
        "limit": limit,
        "streams": if page.is_empty() { Value::Null } else { json!(page) },
    });
    Ok(Some(serde_json::to_vec(&v).unwrap_or_default()))
}

/// Makes this server's streams follow the meta group's applied changes: a new assignment
/// naming this server creates its replica (the first peer answers the create request); a
/// removal deletes it. Only applied changes act, never a difference between states, so a
/// server whose meta state is still catching up never deletes a stream.
pub async fn follow(
    meta: Arc<Meta>,
    server: std::sync::Weak<Server>,
    mut applied: tokio::sync::mpsc::UnboundedReceiver<Follow>,
) {
    let Some(mut shutdown) = server.upgrade().map(|s| s.shutdown_rx()) else {
        return;
    };
    // The log replays at start before the server knows its meta group: a stream made
    // before then would not find its assignment's Raft group (a memory stream, which only
    // this makes again after a restart, would come back unreplicated).
    loop {
        let Some(s) = server.upgrade() else {
            return;
        };
        if s.jetstream.get().and_then(|j| j.meta.get()).is_some() {
            break;
        }
        drop(s);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            _ = shutdown.changed() => return,
        }
    }
    loop {
        let f = tokio::select! {
            f = applied.recv() => f,
            _ = shutdown.changed() => None,
        };
        let Some(f) = f else {
            return;
        };
        let Some(server) = server.upgrade() else {
            return;
        };
        let Some(jss) = server.jetstream.get().cloned() else {
            return;
        };
        if let Follow::Op(
            MetaOp::AssignStream { account, name, .. } | MetaOp::RemoveStream { account, name },
        )
        | Follow::Again(MetaOp::AssignStream { account, name, .. }) = &f
        {
            // Applied: the state has it now.
            meta.proposed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(account.clone(), name.clone()));
        }
        match f {
            Follow::Op(op) => follow_op(&meta, &server, &jss, op).await,
            Follow::Again(op) => follow_again(&meta, &server, &jss, op).await,
            Follow::State { state, installed } => {
                follow_state(&meta, &server, &jss, state, installed).await;
                // No op after it is followed before its file says it was (else a restart
                // would take a stream made after it for one it deleted).
                while let (true, Err(e)) = (installed, meta.machine.installed_followed()) {
                    warn!(
                        server.log,
                        "JetStream cluster: could not note the installed meta snapshot as followed ({e}); trying again in 1s"
                    );
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = shutdown.changed() => return,
                    }
                }
            }
        }
        meta.machine.followed();
    }
}

/// A whole state: every stream assigned here that is missing is made; with `installed`
/// (a snapshot from the leader, the ops before it never seen here) the streams it does not
/// have go, and a recent removal of this server is followed.
async fn follow_state(
    meta: &Arc<Meta>,
    server: &Arc<Server>,
    jss: &Arc<super::JetStreams>,
    state: MetaState,
    installed: bool,
) {
    if installed {
        info!(
            server.log,
            "JetStream cluster: meta state installed from the leader's snapshot ({} streams)",
            state.streams.values().map(|m| m.len()).sum::<usize>()
        );
        for js in jss.all() {
            let assigned = state.streams.get(&js.account.name);
            for s in js.streams() {
                if assigned.is_none_or(|m| !m.contains_key(&s.name)) {
                    let op = MetaOp::RemoveStream {
                        account: js.account.name.clone(),
                        name: s.name.clone(),
                    };
                    follow_op(meta, server, jss, op).await;
                }
            }
        }
        if let Some(&at) = state.removed.get(&meta.host.name) {
            let op = MetaOp::RemoveServer {
                name: meta.host.name.clone(),
                at,
            };
            follow_op(meta, server, jss, op).await;
        }
    }
    for (account, streams) in state.streams {
        for (name, mut assignment) in streams {
            // (Answered when it was made.)
            assignment.reply = None;
            let op = MetaOp::AssignStream {
                account: account.clone(),
                name,
                assignment,
            };
            follow_op(meta, server, jss, op).await;
        }
    }
}

/// Answers a stream create at `reply`, with the stream's `cluster` as it is now.
fn answer_create(
    js: &super::JetStream,
    server: &Server,
    router: &mut crate::router::Router,
    name: &str,
    r: Result<super::api::types::StreamCreateResponse, super::api::ApiError>,
    reply: &str,
) {
    let r = r.map(|mut c| {
        if let Some(s) = js.stream(name) {
            c.info.cluster = Some(super::api::streams::cluster_info(js, &s));
        }
        c
    });
    let body = super::api::encoded_for("stream_create", r);
    super::api::reply(server, router, &bytes::Bytes::from(reply.to_string()), body);
}

/// Asks the meta leader (through this server's API queue, as a client's delete) to remove
/// the assignment of stream `name`, which this server refused to make.
fn unassign_refused(meta: &Meta, server: &Arc<Server>, js: &Arc<super::JetStream>, name: &str) {
    warn!(
        server.log,
        "JetStream cluster: stream '{} > {name}' refused here, its assignment is removed",
        js.account.name
    );
    // The answer (nobody waits for it) goes to this server's inbox, which drops it.
    let inbox = meta.inbox(server, &js.account);
    let (ask, n, _rx) = inbox.reply();
    let subject = format!("$JS.API.STREAM.DELETE.{name}");
    if !js.queue_request(
        subject.as_bytes(),
        &bytes::Bytes::new(),
        Some(ask.as_bytes()),
        0,
        &[],
    ) {
        inbox.forget(n);
    }
}

/// A create for a stream assigned already (`Follow::Again`): the stream's leader answers
/// (its first peer may be down), from the stream as it is, or with 10058 when its config
/// now differs from the one asked for. One asked before this process started (the log
/// replayed at a restart) was answered then, or its client gave up long ago.
async fn follow_again(
    meta: &Arc<Meta>,
    server: &Arc<Server>,
    jss: &Arc<super::JetStreams>,
    op: MetaOp,
) {
    let MetaOp::AssignStream {
        account,
        name,
        assignment,
    } = op
    else {
        return;
    };
    // (A minute's slack for the meta leader's clock against this server's.)
    if assignment.asked < meta.started_at - 60_000_000_000 {
        return;
    }
    let Some(reply) = assignment.reply else {
        return;
    };
    let Some(js) = jss.account(&account).cloned() else {
        return;
    };
    if js.stream(&name).is_none() {
        return;
    }
    // Not in `follow`'s way while an election runs.
    let answer = {
        let (meta, server) = (meta.clone(), server.clone());
        async move {
            wait_for_leader(&js, &name, &meta.host.name, Duration::from_secs(10)).await;
            let Some(s) = js.stream(&name).filter(|s| s.leads()) else {
                return;
            };
            let body = serde_json::to_vec(&assignment.config).unwrap_or_default();
            // Only read: the stream may be deleted meanwhile, and is not made again here.
            let r = super::api::streams::parse_config(&js, &name, &body)
                .and_then(|cfg| super::api::streams::created_already(&js, &s, &cfg));
            let mut router = crate::router::Router::new(js.account.clone(), 0x4153);
            answer_create(&js, &server, &mut router, &name, r, &reply);
            router.flush();
        }
    };
    server.spawn(answer);
}

/// Waits (`limit` at most) until stream `name`'s replica here, if any, knows a leader,
/// and, if that is this server (`me`), until it acts as one. (Woken by the changes, not
/// polled: a create's answer waits here, and an R1 group is ready in a few milliseconds.)
async fn wait_for_leader(js: &super::JetStream, name: &str, me: &str, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let Some(s) = js.stream(name) else { return };
        let replica = s.replica.get().cloned();
        // Registered before the look, so a change in between is not missed.
        let changed = replica.as_ref().map(|r| r.leadership.notified());
        let mut changed = std::pin::pin!(changed);
        if let Some(c) = changed.as_mut().as_pin_mut() {
            c.enable();
        }
        let mut metrics = replica
            .as_ref()
            .and_then(|r| r.raft.get())
            .map(|r| r.metrics());
        let leader = s.leader_name();
        if leader.is_some() && (s.leads() || leader.as_deref() != Some(me)) {
            return;
        }
        drop(s);
        let metrics_changed = async {
            match metrics.as_mut() {
                Some(m) => {
                    if m.changed().await.is_err() {
                        // (The node stopped: no more changes to wait for.)
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        let notified = async {
            match changed.as_mut().as_pin_mut() {
                Some(c) => c.await,
                // (A stream not replicated here yet: looked at again shortly.)
                None => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        };
        tokio::select! {
            _ = notified => {}
            _ = metrics_changed => {}
            _ = tokio::time::sleep_until(deadline) => return,
        }
    }
}

/// One applied op: this server's streams made to match it.
async fn follow_op(
    meta: &Arc<Meta>,
    server: &Arc<Server>,
    jss: &Arc<super::JetStreams>,
    op: MetaOp,
) {
    match op {
        MetaOp::AssignStream {
            account,
            name,
            assignment,
        } => {
            // Replaying the log at start: a stream removed later is not made again.
            if !assignment.peers.contains(&meta.host.name)
                || !meta
                    .assignment(&account, &name)
                    .is_some_and(|a| a.peers.contains(&meta.host.name))
            {
                return;
            }
            let Some(js) = jss.account(&account).cloned() else {
                return;
            };
            if js.stream(&name).is_some() {
                return;
            }
            let body = serde_json::to_vec(&assignment.config).unwrap_or_default();
            let mut router = crate::router::Router::new(js.account.clone(), 0x4153);
            let r = super::api::streams::create(&js, server, &mut router, &name, &body).await;
            let answer = assignment.peers.first() == Some(&meta.host.name);
            if let Err(e) = &r {
                // The meta leader checked it against the cluster; a replica that still
                // cannot make it (its own disk, its limits) says so.
                warn!(
                    server.log,
                    "JetStream cluster could not create stream '{account} > {name}' here: {}",
                    e.description
                );
            }
            // A replicated stream is answered once it has a leader, as the reference
            // does (a publish right after the answer then finds one).
            if answer && assignment.reply.is_some() && !assignment.group.is_empty() && r.is_ok() {
                wait_for_leader(&js, &name, &meta.host.name, Duration::from_secs(10)).await;
            }
            let refused = r.is_err();
            if let (true, Some(reply)) = (answer, assignment.reply.as_ref()) {
                answer_create(&js, server, &mut router, &name, r, reply);
            }
            router.flush();
            // A new stream its answering server could not make (its disk, or a check the
            // meta leader could not make) is not left assigned: the client was told, and a
            // create again places it anew, as the reference drops a rejected assignment.
            let fresh = crate::time::now_nanos() - assignment.created < 5_000_000_000;
            if answer && refused && assignment.reply.is_some() && fresh {
                unassign_refused(meta, server, &js, &name);
            }
        }
        MetaOp::RemoveServer { name, at } => {
            // (Not again for each old removal a restart replays.)
            let recent =
                crate::time::now_nanos() - at < super::raft::meta::REMOVED_FOR.as_nanos() as i64;
            if name == meta.host.name && recent {
                crate::error!(
                    server.log,
                    "JetStream cluster: this server was removed from the meta group"
                );
                // Only a removal made while this process runs: one replayed at a
                // restart leaves JetStream on (the leader adds it back in time).
                if at >= meta.started_at {
                    tokio::spawn(disable_once_out(meta.clone(), server.clone()));
                }
            }
        }
        MetaOp::RemoveStream { account, name } => {
            let Some(js) = jss.account(&account).cloned() else {
                return;
            };
            if js.stream(&name).is_none() {
                return;
            }
            let mut router = crate::router::Router::new(js.account.clone(), 0x4453);
            if let Err(e) = super::api::streams::delete(&js, server, &mut router, &name).await {
                warn!(
                    server.log,
                    "JetStream cluster could not delete stream '{account} > {name}': {e:?}"
                );
            }
            router.flush();
        }
    }
}

/// After a consumer create, pause or delete on a replicated stream's leader: the change goes
/// through the stream's group (its config file, or its removal) and is confirmed once a
/// quorum has it. Ephemeral consumers live on the leader only, as with the reference.
pub async fn replicate_consumer_change(
    js: &super::JetStream,
    stream: &str,
    kind: &str,
    tokens: &[&str],
    response: &[u8],
) -> Result<(), super::api::ApiError> {
    use super::raft::stream::ConsumerEntry;
    let Some(s) = js.stream(stream) else {
        return Ok(());
    };
    if s.group.is_none() {
        return Ok(());
    }
    let mut wait = true;
    let entry = if kind == "consumer_create" || kind == "consumer_pause" {
        // (A pause is a change of the consumer's config.)
        let v: Value = serde_json::from_slice(response).unwrap_or(Value::Null);
        let Some(name) = v["name"].as_str().or(tokens.last().copied()) else {
            return Ok(());
        };
        let dir = s.dir.join("consumers").join(name);
        let meta = match js.meta.read(&dir.join("meta.json")) {
            keel_store::MetaRead::Current(b) => b,
            _ => return Ok(()), // Not durable: nothing on disk to replicate.
        };
        // An ephemeral consumer is answered at once (its entry follows in the next commit):
        // clients make many (every KV watch and listing), and one lost with its leader is
        // one the client makes again, as with the reference's.
        wait = !v["config"]["durable_name"].is_null();
        ConsumerEntry::Create {
            name: name.to_string(),
            meta,
        }
    } else {
        let Some(name) = tokens.last() else {
            return Ok(());
        };
        ConsumerEntry::Delete {
            name: name.to_string(),
        }
    };
    s.replicate(entry, wait).await
}

/// `$JS.API.STREAM.LEADER.STEPDOWN.<stream>` and `$JS.API.CONSUMER.LEADER.STEPDOWN.<stream>.
/// <consumer>` on the server that leads the stream (a consumer runs where its stream leads,
/// so its stepdown moves the stream's group). An unreplicated stream has nothing to hand
/// over: success, as the reference answers for R1.
pub fn leader_stepdown(
    js: &super::JetStream,
    server: &Arc<Server>,
    stream: &str,
    consumer: Option<&str>,
    body: &[u8],
) -> Result<Value, super::api::ApiError> {
    use super::api::ErrorKind;
    let kind = if consumer.is_some() {
        "io.nats.jetstream.api.v1.consumer_leader_stepdown_response"
    } else {
        "io.nats.jetstream.api.v1.stream_leader_stepdown_response"
    };
    if !js.clustered() {
        return Err(ErrorKind::ClusteringRequired.err());
    }
    let s = js
        .stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    if let Some(c) = consumer {
        if js.consumer(stream, c).is_none() {
            return Err(ErrorKind::ConsumerNotFound.err());
        }
    }
    let placement = stepdown_request(body)?;
    if let Some(r) = s.replica.get() {
        let Some(raft) = r.raft.get().cloned() else {
            return Err(ErrorKind::ClusterUnavailable.err());
        };
        if raft
            .metrics()
            .borrow()
            .membership_config
            .voter_ids()
            .count()
            < 2
        {
            // An R1 stream has nothing to hand over: success, as the reference answers.
            if s.config().num_replicas <= 1 {
                return Ok(json!({"type": kind, "success": true}));
            }
            return Err(ErrorKind::StepdownFailed.with("no replacement peer connected"));
        }
        let me = r.node;
        let target = match server.jetstream.get().and_then(|j| j.meta.get()) {
            Some(meta) => stepdown_target(meta, &raft, me, &placement)?,
            None => None,
        };
        let group = r.group_name().unwrap_or_default().to_string();
        spawn_stepdown(
            r.host(),
            raft,
            group,
            target,
            server.clone(),
            Some(s.clone()),
        );
    }
    Ok(json!({"type": kind, "success": true}))
}

/// Hands every Raft group this server leads (the meta group, each stream's) to a voter that
/// has its whole log, before the server stops (SIGTERM, SIGINT) or enters lame duck mode,
/// as the reference does: the others need not wait out an election timeout, so a rolling
/// restart leaves a stream without a leader only for the transfer (`raft::transfer`; its
/// writes wait meanwhile). A group with no such voter up elects one itself once this server
/// is gone. With `stay_out`, this server then stands for no election (lame duck: it keeps
/// running a while but must not take a group back). Returns how many groups were handed over.
pub async fn hand_off_leadership(server: &Arc<Server>, stay_out: bool) -> usize {
    // The durables' flush and the transfers each end within this (a stop is not held up
    // longer; a transfer normally takes milliseconds).
    const HAND_OFF_LIMIT: Duration = Duration::from_secs(8);
    let Some(js) = server.jetstream.get() else {
        return 0;
    };
    let Some(meta) = js.meta.get().cloned() else {
        return 0;
    };
    // Each group this server may lead, with its stream if it leads a stream's.
    let mut groups = vec![(
        meta.host.clone(),
        meta.raft(),
        META_GROUP.to_string(),
        "the meta group".to_string(),
        None,
    )];
    let mut consumers = Vec::new();
    let mut led = Vec::new();
    for s in js.registry.all_streams() {
        let Some(r) = s.replica.get() else { continue };
        if let (Some(raft), Some(host), Some(group)) = (r.raft.get(), r.host(), r.group_name()) {
            let what = format!("stream '{} > {}'", s.account().name, s.name);
            let leads = s.leads().then(|| s.clone());
            groups.push((host, raft.clone(), group.to_string(), what, leads.clone()));
            if let Some(s) = leads {
                consumers.extend(js.registry.consumers(&s.account().name, &s.name));
                led.push(s);
            }
        }
    }
    // The durables' latest acks go to the followers first (otherwise up to 20 ms of them
    // would be redelivered by the next leader).
    let mut flushes = tokio::task::JoinSet::new();
    for c in consumers {
        flushes.spawn(async move { c.flush_replicated().await });
    }
    let _ = tokio::time::timeout(HAND_OFF_LIMIT, flushes.join_all()).await;
    if stay_out {
        // Before the transfers: their ends (and other servers' holds) must not let this
        // server stand again.
        meta.host.retire();
    }
    let groups: Vec<_> = groups
        .into_iter()
        .filter_map(|(host, raft, group, what, stream)| {
            let target = current_voter(server, &host, &raft)?;
            Some((host, raft, group, what, stream, target))
        })
        .collect();
    // A publish a peer sent to this server as its stream stops leading would find the
    // subjects unsubscribed and go unanswered (the client waits out its timeout). So the
    // peers are told first that this server takes them no more, and a round trip on each
    // route makes sure they read it and that what they sent before has arrived: this
    // server still leads then, and answers it. Until the new leader subscribes, a peer's
    // publisher hears at once that nobody answers (a 503), as in an election.
    let handing: Vec<_> = groups.iter().filter_map(|g| g.4.clone()).collect();
    withdraw_from_routes(server, &handing).await;
    let mut transfers = tokio::task::JoinSet::new();
    for (host, raft, group, what, stream, target) in groups {
        let log = server.log.clone();
        transfers.spawn(async move {
            let r = raft::transfer(&host, &raft, &group, &target).await;
            if let Some(s) = &stream {
                restore_if_leading(s);
            }
            match r {
                Ok(()) => {
                    info!(
                        log,
                        "JetStream {what}: leadership handed to {}", target.name
                    );
                    true
                }
                Err(e) => {
                    warn!(log, "JetStream {what}: leadership not handed over: {e}");
                    false
                }
            }
        });
    }
    // A transfer that cannot finish (its target stalled) must not hold the stop up: the
    // rest is left to an election (the voters it held wait out the hold, at most 12 s).
    let mut handed = 0;
    let _ = tokio::time::timeout(HAND_OFF_LIMIT, async {
        while let Some(r) = transfers.join_next().await {
            handed += usize::from(r.unwrap_or(false));
        }
    })
    .await;
    // Those still running go on by themselves, and give their stream's interest back
    // when they end if it did not move (one cut off midway would leave its group's
    // heartbeats off).
    transfers.detach_all();
    // Publishes the old leaders took meanwhile (they waited for the transfer) are answered
    // while the routes are up: an error the client retries at once at the new leader,
    // rather than no answer at all and the client's timeout. Once the stream follows (its
    // subjects unsubscribed: a retry sent here before would be taken and not answered).
    let mut drains = tokio::task::JoinSet::new();
    for s in led {
        drains.spawn(async move {
            if let Some(r) = s.replica.get() {
                let _ = tokio::time::timeout(Duration::from_millis(500), r.until_fenced()).await;
            }
            s.ask(|reply| crate::jetstream::stream::Command::Drain { reply })
                .await
        });
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), drains.join_all()).await;
    handed
}

/// After a hand-over of `s` ended: if this server still leads its group, by Raft's account
/// and not fenced yet, its peers send it publishes again (`withdraw_from_routes` undone).
fn restore_if_leading(s: &Stream) {
    let leads = s.leads()
        && s.replica
            .get()
            .and_then(|r| r.raft.get())
            .is_some_and(|raft| raft::leads(&raft.metrics().borrow()));
    if leads {
        s.restore_to_peers();
    }
}

/// Before this server's streams' leaders hand over: the peers are told that it takes the
/// streams' subjects no more, and a round trip on each route makes sure they read that and
/// that what they sent before has arrived (see `hand_off_leadership`).
async fn withdraw_from_routes(server: &Server, streams: &[Arc<Stream>]) {
    if streams.is_empty() {
        return;
    }
    for s in streams {
        s.withdraw_from_peers();
    }
    if let Some(c) = server.cluster.get() {
        let _ = tokio::time::timeout(Duration::from_secs(1), c.round_trip_all()).await;
    }
}

/// The voter of a group this server leads with the most of its log, if one was heard from
/// lately and is not in lame duck mode (`raft::transfer` then waits until it has all of it).
fn current_voter(server: &Server, host: &RaftHost, raft: &Raft) -> Option<Peer> {
    let m = raft.metrics().borrow().clone();
    if !raft::leads(&m) {
        return None;
    }
    let replication = m.replication.as_ref()?;
    m.membership_config
        .nodes()
        .filter(|(id, p)| {
            **id != host.id
                && m.membership_config.voter_ids().any(|v| v == **id)
                && host
                    .since_heard(&p.name)
                    .is_some_and(|d| d < Duration::from_millis(raft::QUORUM_LOST_MS))
                && !peer_in_lame_duck(server, &p.name)
        })
        .max_by_key(|(id, _)| replication.get(*id).cloned().flatten().map(|l| l.index))
        .map(|(_, p)| p.clone())
}

/// Whether the server `name` said it is in lame duck mode: it is no leadership's target.
fn peer_in_lame_duck(server: &Server, name: &str) -> bool {
    server
        .cluster
        .get()
        .is_some_and(|c| c.peer_in_lame_duck(name))
}

/// A stepdown in the background (the request is answered at once, as the reference does):
/// to `target` when the placement names one, else handed to the voter with the most of the
/// log (as at a stop: no election timeout to wait out), else to whichever voter wins.
/// Before a stream's leadership moves on request: its durables' latest state (what they
/// delivered and took acks for in the last moments) goes to the followers first, or the
/// next leader would deliver those messages again as first deliveries, under consumer
/// sequences already used.
async fn flush_consumers(server: &Arc<Server>, s: &Arc<Stream>) {
    const FLUSH_LIMIT: Duration = Duration::from_secs(2);
    let Some(js) = server
        .jetstream
        .get()
        .and_then(|j| j.account(&s.account().name).cloned())
    else {
        return;
    };
    let mut flushes = tokio::task::JoinSet::new();
    for c in js.registry.consumers(&s.account().name, &s.name) {
        flushes.spawn(async move { c.flush_replicated().await });
    }
    let _ = tokio::time::timeout(FLUSH_LIMIT, flushes.join_all()).await;
}

fn spawn_stepdown(
    host: Option<Arc<RaftHost>>,
    raft: Raft,
    group: String,
    target: Option<Peer>,
    server: Arc<Server>,
    stream: Option<Arc<Stream>>,
) {
    let log = server.log.clone();
    tokio::spawn(async move {
        let named = target.is_some();
        let target =
            target.or_else(|| host.as_ref().and_then(|h| current_voter(&server, h, &raft)));
        let stream = stream.filter(|s| s.leads() && host.is_some());
        if let Some(s) = &stream {
            flush_consumers(&server, s).await;
        }
        withdraw_from_routes(&server, stream.as_slice()).await;
        let r = match (target, host) {
            (Some(t), Some(host)) => match raft::transfer(&host, &raft, &group, &t).await {
                Err(e) if !named => {
                    let m = raft.metrics().borrow().clone();
                    if m.current_leader.is_some_and(|l| l != host.id) {
                        Ok(()) // Another voter won: any will do.
                    } else if m.state == openraft::ServerState::Leader {
                        // The voter this server picked did not take over: any other may.
                        warn!(log, "JetStream {group} leader stepdown to {}: {e}", t.name);
                        raft::step_down(&host, &raft).await
                    } else {
                        Err(e)
                    }
                }
                r => r,
            },
            (None, Some(host)) => raft::step_down(&host, &raft).await,
            (_, None) => Err("no Raft host".into()),
        };
        if let Err(e) = r {
            warn!(log, "JetStream {group} leader stepdown: {}", e);
        }
        if let Some(s) = &stream {
            restore_if_leading(s);
        }
    });
}

/// A stepdown request's `placement` (Null when there is none): the body is read as JSON only
/// when it looks like an object or array, as the reference does.
fn stepdown_request(body: &[u8]) -> Result<Value, super::api::ApiError> {
    let start = body.iter().position(|b| !b" \t\r\n".contains(b));
    if !start.is_some_and(|i| body[i] == b'{' || body[i] == b'[') {
        return Ok(Value::Null);
    }
    let req: Value = serde_json::from_slice(body)
        .map_err(|e| super::api::ApiError::invalid_json_body(body, &e))?;
    Ok(req.get("placement").cloned().unwrap_or(Value::Null))
}

/// Which voter a stepdown's placement asks for (None: no placement, any other voter will
/// do). `preferred` names a server; otherwise `cluster` and `tags` narrow the voters that are
/// up, and one of them is picked, as the reference does.
fn stepdown_target(
    meta: &Meta,
    raft: &Raft,
    me: NodeId,
    placement: &Value,
) -> Result<Option<Peer>, super::api::ApiError> {
    use super::api::ErrorKind;
    if placement.is_null() {
        return Ok(None);
    }
    let m = raft.metrics().borrow().clone();
    let voters: Vec<(NodeId, Peer)> = m
        .membership_config
        .nodes()
        .filter(|(id, _)| m.membership_config.voter_ids().any(|v| v == **id))
        .map(|(id, p)| (*id, p.clone()))
        .collect();
    let server = meta.host.server();
    let retiring = |p: &Peer| {
        server
            .as_ref()
            .is_some_and(|s| peer_in_lame_duck(s, &p.name))
    };
    if let Some(preferred) = placement["preferred"].as_str().filter(|p| !p.is_empty()) {
        return match voters.iter().find(|(_, p)| p.name == preferred) {
            Some((id, _)) if *id == me => Err(ErrorKind::NoPeers.with(format!(
                "preferred server \"{preferred}\" is already leader"
            ))),
            Some((_, p)) if retiring(p) => {
                // As the reference: accepted, and another voter takes over (the lame duck
                // stands for no election).
                Ok(None)
            }
            Some((_, p)) => Ok(Some(p.clone())),
            None => {
                Err(ErrorKind::NoPeers.with(format!("preferred server \"{preferred}\" not known")))
            }
        };
    }
    let cluster = placement["cluster"].as_str().unwrap_or("");
    let tags = placement_tags(placement);
    let server_tags = meta.server_tags();
    let fits = |p: &Peer| {
        let up = meta
            .host
            .since_heard(&p.name)
            .is_some_and(|d| d < Duration::from_secs(10));
        up && !retiring(p)
            && (cluster.is_empty() || cluster == meta.cluster_name)
            && has_tags(&server_tags, &p.name, &tags)
    };
    let mut fitting: Vec<Peer> = voters
        .into_iter()
        .filter(|(id, p)| *id != me && fits(p))
        .map(|(_, p)| p)
        .collect();
    if fitting.is_empty() {
        return Err(ErrorKind::NoPeers.with("no replacement peer connected"));
    }
    // Any of them (the reference picks one at random too).
    let i = (crate::time::now_nanos() as usize) % fitting.len();
    Ok(Some(fitting.swap_remove(i)))
}

/// Answers to requests this server sends on an account's behalf (the meta leader asking
/// each stream's leader for its info, for STREAM.LIST): `$KEEL.JSI.<peer>.<n>` in the
/// account, a subscription that serves the whole cluster.
pub struct Inbox {
    prefix: String,
    pending: raft::Pending,
}

impl Inbox {
    fn start(
        server: &Arc<Server>,
        account: &Arc<crate::account::Account>,
        host: &RaftHost,
    ) -> Arc<Inbox> {
        let prefix = format!("$KEEL.JSI.{}.", peer_hash(&host.name));
        let (handle, mut rx) = crate::client::ClientHandle::internal(
            server,
            account,
            "JetStream cluster inbox".into(),
            4 * 1024 * 1024,
        );
        if let Some(q) = handle.internal_queue() {
            q.set_cluster_wide();
        }
        account.sublist.insert(crate::sublist::Sub::internal(
            &handle,
            bytes::Bytes::from_static(b"jsi"),
            bytes::Bytes::from(format!("{prefix}*")),
        ));
        let inbox = Arc::new(Inbox {
            prefix,
            pending: raft::Pending::default(),
        });
        let i = inbox.clone();
        server.spawn(async move {
            while let Some(m) = rx.recv().await {
                if let Some(n) = m.subject.strip_prefix(i.prefix.as_bytes()) {
                    i.pending.answer(n, &m);
                }
            }
        });
        inbox
    }

    /// A reply subject and the answer's receiver.
    fn reply(&self) -> (String, u64, tokio::sync::oneshot::Receiver<bytes::Bytes>) {
        let (n, rx) = self.pending.open();
        (format!("{}{n}", self.prefix), n, rx)
    }

    fn forget(&self, n: u64) {
        self.pending.forget(n);
    }
}

/// STREAM.LIST on the meta leader: every assigned stream's info, from the server that
/// leads it (asked in parallel; one that does not answer in time is left out, and the
/// list says how many were missing as the reference does).
async fn list(
    js: &Arc<super::JetStream>,
    server: &Arc<Server>,
    meta: &Arc<Meta>,
    body: &[u8],
) -> Result<Vec<u8>, super::api::ApiError> {
    let req: super::api::types::ListRequest =
        super::api::parse_request(body, &super::schema::STREAM_NAMES, js.strict)?;
    let state = meta.machine.state();
    let names: Vec<(String, StreamAssignment)> = state
        .streams
        .get(&js.account.name)
        .into_iter()
        .flatten()
        .filter(|(_, a)| a.matches(req.subject.as_deref()))
        .map(|(n, a)| (n.clone(), a.clone()))
        .collect();
    let limit = 256;
    let total = names.len();
    let inbox = meta.inbox(server, &js.account);
    let mut waits = Vec::new();
    let mut infos: Vec<Value> = Vec::new();
    for (name, a) in names.into_iter().skip(req.offset).take(limit) {
        if let Some(s) = js.stream(&name).filter(|s| s.leads()) {
            // (With its `cluster` object, as the reference lists a clustered stream.)
            let i = super::api::streams::info(&s, false, Some(js), None, false);
            infos.push(serde_json::to_value(i).unwrap_or(Value::Null));
            continue;
        }
        let target = js
            .stream(&name)
            .and_then(|s| s.leader_name())
            .filter(|l| *l != meta.host.name)
            .or_else(|| a.peers.iter().find(|p| **p != meta.host.name).cloned());
        let Some(target) = target else { continue };
        let (reply, n, rx) = inbox.reply();
        let m = crate::client::InMsg {
            sid: bytes::Bytes::new(),
            subject: bytes::Bytes::from(format!("$JS.API.STREAM.INFO.{name}")),
            reply: Some(bytes::Bytes::from(reply)),
            hdr_len: 0,
            data: bytes::Bytes::new(),
            origin: 0,
        };
        meta.forward(&target, &js.account.name, &m, 1);
        waits.push((name, n, rx));
    }
    let mut missing = Vec::new();
    for (name, n, rx) in waits {
        match tokio::time::timeout(Duration::from_secs(2), rx).await {
            Ok(Ok(b)) => {
                let mut v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                if let Some(o) = v.as_object_mut() {
                    for k in ["type", "total", "offset", "limit"] {
                        o.remove(k);
                    }
                }
                if v.get("error").is_none() && v.get("config").is_some() {
                    infos.push(v);
                }
            }
            _ => {
                inbox.forget(n);
                missing.push(name);
            }
        }
    }
    infos.sort_by(|a, b| {
        a["config"]["name"]
            .as_str()
            .unwrap_or_default()
            .cmp(b["config"]["name"].as_str().unwrap_or_default())
    });
    let mut v = json!({
        "type": "io.nats.jetstream.api.v1.stream_list_response",
        "total": total,
        "offset": req.offset,
        "limit": limit,
        "streams": infos,
    });
    if !missing.is_empty() {
        v["missing"] = json!(missing);
    }
    Ok(serde_json::to_vec(&v).unwrap_or_default())
}

/// `/healthz`: the first replicated stream on this server that is not current (it knows
/// no leader of its group, or, as a follower, has not applied what its log holds), in the
/// reference's words.
pub fn not_current(jss: &super::JetStreams) -> Option<String> {
    jss.meta.get()?;
    for js in jss.all() {
        for s in js.streams() {
            let Some(r) = s.replica.get() else { continue };
            let behind = r.raft.get().is_none_or(|raft| {
                let m = raft.metrics().borrow().clone();
                m.current_leader.is_none()
                    || m.last_applied.map(|l| l.index)
                        < m.last_log_index
                            .filter(|_| m.state != openraft::ServerState::Leader)
                            .map(|i| i.saturating_sub(1000))
            });
            if behind {
                return Some(format!(
                    "JetStream stream '{} > {}' is not current",
                    js.account.name, s.name
                ));
            }
        }
    }
    None
}
