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

use super::raft::log::{LogBackend, LogStore};
use super::raft::meta::{MetaMachine, MetaOp};
use super::raft::{self, node_id, peer_hash, Cmd, NodeId, Peer, Raft, RaftHost};
use crate::server::Server;
use crate::{info, warn};

pub const META_GROUP: &str = "_meta_";

/// The meta group on one server.
pub struct Meta {
    pub raft: Raft,
    pub machine: MetaMachine,
    pub host: Arc<RaftHost>,
    /// When this server last saw a leader change (for `leader_since`).
    leader_since: std::sync::Mutex<(Option<NodeId>, i64)>,
}

impl Meta {
    /// Starts the meta group on `server` with its log in `backend`.
    pub async fn start(
        server: &Arc<Server>,
        host: Arc<RaftHost>,
        backend: Box<dyn LogBackend>,
    ) -> Result<Arc<Meta>, String> {
        let log = LogStore::open(backend).map_err(|e| format!("meta log: {e}"))?;
        let machine = MetaMachine::new();
        let raft = Raft::new(
            host.id,
            raft::config(META_GROUP),
            host.network(META_GROUP),
            log,
            machine.clone(),
        )
        .await
        .map_err(|e| format!("meta group: {e}"))?;
        host.add_group(META_GROUP, raft.clone());
        let meta = Arc::new(Meta {
            raft,
            machine,
            host,
            leader_since: std::sync::Mutex::new((None, 0)),
        });
        server.spawn(tend(meta.clone(), Arc::downgrade(server)));
        meta.serve_api(server);
        Ok(meta)
    }

    /// `$JS.API.META.LEADER.STEPDOWN`, which the reference takes from the system account
    /// only (other accounts never reach this subscription, which lives there). Every server
    /// subscribes (routes announce it, `raft::serves_peers`); the leader answers.
    fn serve_api(self: &Arc<Self>, server: &Arc<Server>) {
        let account = self.host.account().clone();
        let (handle, mut rx) = crate::client::ClientHandle::internal(
            server,
            &account,
            "meta leader stepdown".into(),
            64 * 1024,
        );
        account.sublist.insert(Arc::new(crate::sublist::Sub {
            client: handle,
            sid: bytes::Bytes::from_static(raft::RAFT_SID),
            subject: bytes::Bytes::from_static(b"$JS.API.META.LEADER.STEPDOWN"),
            queue: None,
            max: std::sync::atomic::AtomicU64::new(0),
            delivered: std::sync::atomic::AtomicU64::new(0),
        }));
        let meta = self.clone();
        let weak = Arc::downgrade(server);
        server.spawn(async move {
            let mut router = crate::router::Router::new(account, 0x4d53);
            while let Some(m) = rx.recv().await {
                let Some(reply) = m.reply.clone() else {
                    continue;
                };
                if !meta.is_leader() {
                    continue;
                }
                let Some(server) = weak.upgrade() else {
                    return;
                };
                let req: Value = serde_json::from_slice(m.payload()).unwrap_or(Value::Null);
                let body = if req.get("placement").is_some_and(|p| !p.is_null()) {
                    // openraft 0.9 cannot hand leadership to a chosen server.
                    json!({"type": "io.nats.jetstream.api.v1.meta_leader_stepdown_response",
                           "error": {"code": 400, "err_code": 10003,
                                     "description": "bad request: placement on stepdown is not supported"}})
                } else {
                    let m2 = meta.clone();
                    tokio::spawn(async move {
                        let _ = m2.step_down().await;
                    });
                    json!({"type": "io.nats.jetstream.api.v1.meta_leader_stepdown_response",
                           "success": true})
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
        let m = self.raft.metrics().borrow().clone();
        let id = leader_id(&m)?;
        let name = m
            .membership_config
            .nodes()
            .find(|(n, _)| **n == id)
            .map(|(_, p)| p.name.clone());
        name
    }

    pub fn is_leader(&self) -> bool {
        leader_id(&self.raft.metrics().borrow()) == Some(self.host.id)
    }

    /// Proposes `op` (on the leader); resolves once it is committed on a quorum and
    /// applied here.
    pub async fn propose(&self, op: &MetaOp) -> Result<(), String> {
        let body = serde_json::to_vec(op).map_err(|e| e.to_string())?;
        self.raft
            .client_write(Cmd(body))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// `/jsz`'s `meta_cluster`, as the reference writes it.
    pub fn jsz(&self, cluster_name: &str) -> Value {
        let m = self.raft.metrics().borrow().clone();
        let members: BTreeMap<String, NodeId> = m
            .membership_config
            .nodes()
            .map(|(id, p)| (p.name.clone(), *id))
            .collect();
        let size = members.len().max(1);
        let leader = leader_id(&m).and_then(|id| {
            members
                .iter()
                .find(|(_, n)| **n == id)
                .map(|(name, _)| name.clone())
        });
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
        out.insert("pending".into(), 0.into());
        Value::Object(out)
    }

    /// One peer of a group as `replicas[]` lists it.
    fn replica(&self, name: &str, leader: Option<&str>) -> Value {
        let active = self.host.since_heard(name);
        // The reference's "current": heard from within the last ten seconds.
        let current = name == self.host.name
            || leader == Some(name)
            || active.is_some_and(|d| d < Duration::from_secs(10));
        let mut r = json!({
            "name": name,
            "current": current,
            "active": active.map(|d| d.as_nanos() as u64).unwrap_or(0),
            "peer": peer_hash(name),
        });
        if name != self.host.name && active.is_none_or(|d| d > Duration::from_secs(10)) {
            r["offline"] = true.into();
        }
        r
    }

    /// `leader_since` of the current leader (this server's view), nanoseconds.
    pub fn leader_since(&self) -> i64 {
        self.leader_since.lock().unwrap_or_else(|e| e.into_inner()).1
    }

    /// Makes another voter leader: this one stops sending heartbeats for longer than an
    /// election timeout (openraft 0.9 has no leader transfer), and a follower takes over.
    pub async fn step_down(&self) -> Result<(), String> {
        if !self.is_leader() {
            return Err("not leader".into());
        }
        let voters = self
            .raft
            .metrics()
            .borrow()
            .membership_config
            .voter_ids()
            .count();
        if voters < 2 {
            return Err("no replacement peer connected".into());
        }
        let rc = self.raft.runtime_config();
        rc.heartbeat(false);
        rc.elect(false);
        let me = self.host.id;
        let r = self
            .raft
            .wait(Some(Duration::from_secs(10)))
            .metrics(
                |m| m.current_leader.is_some_and(|l| l != me),
                "another leader",
            )
            .await;
        rc.heartbeat(true);
        rc.elect(true);
        r.map(|_| ()).map_err(|e| e.to_string())
    }

    pub async fn shutdown(&self) {
        let _ = self.raft.shutdown().await;
    }
}

/// How long a leader may go without hearing from a quorum before it is no leader
/// (openraft 0.9 keeps the role; the reference's leader steps down after losing quorum).
const QUORUM_LOST: u64 = 3000;

/// The group's leader, unless this server is a leader that has lost its quorum.
fn leader_id(m: &openraft::RaftMetrics<NodeId, Peer>) -> Option<NodeId> {
    let id = m.current_leader?;
    if id == m.id && m.membership_config.voter_ids().count() > 1 {
        match m.millis_since_quorum_ack {
            Some(ms) if ms <= QUORUM_LOST => {}
            _ => return None,
        }
    }
    Some(id)
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
        let mut now_view: BTreeSet<String> = cluster
            .routes()
            .iter()
            .filter(|r| r.remote_jetstream())
            .map(|r| r.remote_name())
            .filter(|n| !n.is_empty())
            .collect();
        now_view.insert(meta.host.name.clone());
        if now_view != view {
            view = now_view;
            stable_since = Instant::now();
        }
        let metrics = meta.raft.metrics().borrow().clone();
        if metrics.current_leader != last_leader {
            last_leader = metrics.current_leader;
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
            if view.len() > needed
                && lowest
                && stable_since.elapsed() >= Duration::from_secs(2)
            {
                let members: BTreeMap<NodeId, Peer> = view
                    .iter()
                    .map(|n| (node_id(n), Peer { name: n.clone() }))
                    .collect();
                info!(server.log, "JetStream cluster bootstrapping");
                if let Err(e) = meta.raft.initialize(members).await {
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
            for name in &view {
                let id = node_id(name);
                if members.contains(&id) {
                    continue;
                }
                let peer = Peer { name: name.clone() };
                if meta.raft.add_learner(id, peer, true).await.is_ok() {
                    let mut voters: BTreeSet<NodeId> =
                        metrics.membership_config.voter_ids().collect();
                    voters.insert(id);
                    if let Err(e) = meta.raft.change_membership(voters, false).await {
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
