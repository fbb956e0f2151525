//! Raft for clustered JetStream, on openraft (we do not write consensus).
//!
//! Every server of a JetStream cluster runs one [`RaftHost`]: the openraft groups it is a
//! member of (the meta group `_meta_`, later one per replicated stream), sharing one
//! transport. The transport is the cluster itself: RPCs are messages in the system account
//! (`$KEEL.RAFT.<peer>.<kind>`, answered on `$KEEL.RAFT.R.<peer>.<n>`), carried by the
//! routes, so Raft traffic gets the routes' TLS and authentication and needs no port of its
//! own (the reference sends its Raft traffic through the system account the same way).
//!
//! A node's id is derived from its server name (stable across restarts, as the reference's
//! peer id is), and its [`Peer`] carries the name.

pub mod log;
pub mod meta;
pub mod stream;

use std::collections::HashMap;
use std::io::Cursor;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use crate::account::Account;
use crate::client::{ClientHandle, InMsg};
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::sublist::Sub;

/// A member of a Raft group: a server, by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// What a group's log carries: each state machine encodes its own entries (the meta
/// group's assignments as JSON; stream entries compactly), so the log and the transport
/// stay generic.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Cmd(#[serde(with = "as_bytes")] pub Vec<u8>);

/// Byte strings serialized as one length and the bytes, not element by element (which
/// bincode does for a plain `Vec<u8>`, byte by byte through serde: the hot part of every
/// replicated batch). bincode encodes both the same way, so logs written before read alike.
mod as_bytes {
    pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(Visitor)
    }

    struct Visitor;

    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("bytes")
        }

        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        // Formats that write bytes as a list of numbers (JSON).
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Vec<u8>, A::Error> {
            let mut v = Vec::with_capacity(a.size_hint().unwrap_or(0));
            while let Some(b) = a.next_element()? {
                v.push(b);
            }
            Ok(v)
        }
    }
}

impl std::fmt::Display for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cmd({} bytes)", self.0.len())
    }
}

/// A state machine's answer to an applied entry, encoded by the state machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct CmdResult(pub Vec<u8>);

openraft::declare_raft_types!(
    pub TypeConfig:
        D = Cmd,
        R = CmdResult,
        NodeId = u64,
        Node = Peer,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type NodeId = u64;

/// The reference's peer id: 8 characters of base62 from SHA-256 of the server name.
pub fn peer_hash(name: &str) -> String {
    const DIGITS: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let d = Sha256::digest(name.as_bytes());
    d[..8]
        .iter()
        .map(|b| DIGITS[(*b as usize) % 62] as char)
        .collect()
}

/// A node's Raft id: the first 8 bytes of SHA-256 of its server name, so every server
/// computes every other's id from its name.
pub fn node_id(name: &str) -> NodeId {
    let d = Sha256::digest(name.as_bytes());
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes")) & (u64::MAX >> 1)
}

/// openraft's timers. The reference uses seconds (heartbeat 1 s, election 4-9 s); these
/// are shorter so that a leader's loss is noticed within about a second, while an idle group
/// still costs a few messages a second.
/// `memory`: a memory stream's group (its log is in memory).
pub fn config(name: &str, memory: bool) -> Arc<openraft::Config> {
    let cfg = openraft::Config {
        cluster_name: name.to_string(),
        heartbeat_interval: 250,
        election_timeout_min: 1000,
        election_timeout_max: 2000,
        install_snapshot_timeout: 5000,
        max_payload_entries: 256,
        // A stream group snapshots its store's state every so many batches and drops the
        // log before it (keeping some, for a replica a little behind); a replica further
        // behind, or a new one, installs the snapshot and fetches the messages it lacks
        // from the leader. (The meta group's: `meta_config`.)
        // A memory stream's log is in memory, a second copy of its recent messages: it is
        // cut much sooner, so that copy stays small.
        snapshot_policy: if memory {
            openraft::SnapshotPolicy::LogsSinceLast(MEMORY_SNAPSHOT_EVERY)
        } else {
            openraft::SnapshotPolicy::LogsSinceLast(STREAM_SNAPSHOT_EVERY)
        },
        max_in_snapshot_log_to_keep: if memory {
            MEMORY_LOG_KEPT
        } else {
            STREAM_LOG_KEPT
        },
        ..Default::default()
    };
    Arc::new(cfg.validate().expect("valid raft config"))
}

/// The meta group snapshots its assignments after this many log entries since the last
/// (a few hundred KiB of creates and deletes) and keeps this many before the snapshot.
pub const META_SNAPSHOT_EVERY: u64 = 1024;
pub const META_LOG_KEPT: u64 = 256;

/// The meta group's config: snapshots every `every` entries, `kept` entries kept before.
pub fn meta_config(every: u64, kept: u64) -> Arc<openraft::Config> {
    let mut cfg = (*config(crate::jetstream::cluster::META_GROUP, false)).clone();
    cfg.snapshot_policy = openraft::SnapshotPolicy::LogsSinceLast(every.max(1));
    cfg.max_in_snapshot_log_to_keep = kept;
    Arc::new(cfg.validate().expect("valid raft config"))
}

/// The same for a memory stream's group (its log is in memory).
pub const MEMORY_SNAPSHOT_EVERY: u64 = 128;
const MEMORY_LOG_KEPT: u64 = 32;

/// A stream group snapshots after this many log entries (batches) since the last.
pub const STREAM_SNAPSHOT_EVERY: u64 = 1024;
/// Log entries kept before a snapshot's position.
const STREAM_LOG_KEPT: u64 = 256;

/// How long a leader may go without a quorum's answer before it counts as no leader
/// (openraft 0.9 keeps the role, and a restarted leader whose saved vote was committed
/// starts as leader with nobody else up; the reference's leader steps down after losing
/// its quorum).
pub const QUORUM_LOST_MS: u64 = 3000;

/// How long a write to a group's log (a stream's batch, a meta change) waits to be
/// committed before it is given up (it may still commit later).
pub(crate) const COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether these metrics are of a leader that has heard from a quorum lately.
pub fn leads(m: &openraft::RaftMetrics<NodeId, Peer>) -> bool {
    if m.state != openraft::ServerState::Leader || m.current_leader != Some(m.id) {
        return false;
    }
    m.membership_config.voter_ids().count() <= 1
        || m.millis_since_quorum_ack
            .is_some_and(|ms| ms <= QUORUM_LOST_MS)
}

/// The group's leader as these metrics show it, unless it is this server without a quorum
/// behind it (a saved vote, or a quorum lost).
pub fn leader_id(m: &openraft::RaftMetrics<NodeId, Peer>) -> Option<NodeId> {
    let id = m.current_leader?;
    if id == m.id && !leads(m) {
        return None;
    }
    Some(id)
}

/// The server name of member `id` of the group.
pub fn member_name(m: &openraft::RaftMetrics<NodeId, Peer>, id: NodeId) -> Option<String> {
    m.membership_config
        .nodes()
        .find(|(n, _)| **n == id)
        .map(|(_, p)| p.name.clone())
}

/// Hands a group's leadership to another voter: this one stops sending heartbeats and
/// stands for no election until another has won (openraft 0.9 has no leader transfer; the
/// followers' election timeout then runs out). Refused with one voter.
pub async fn step_down(host: &RaftHost, raft: &Raft) -> Result<(), String> {
    let me = host.id;
    let voters = raft
        .metrics()
        .borrow()
        .membership_config
        .voter_ids()
        .count();
    if voters < 2 {
        return Err("no replacement peer connected".into());
    }
    let rc = raft.runtime_config();
    rc.heartbeat(false);
    rc.elect(false);
    let r = raft
        .wait(Some(Duration::from_secs(10)))
        .metrics(
            |m| m.current_leader.is_some_and(|l| l != me),
            "another leader",
        )
        .await;
    rc.heartbeat(true);
    host.resume_elections(raft);
    r.map(|_| ()).map_err(|e| e.to_string())
}

/// How long a transfer waits for the chosen server to win (openraft's voters refuse a
/// candidate until the leader lease, `election_timeout_max`, has passed since they last
/// heard the leader, so a transfer takes about that long).
const TRANSFER_WAIT: Duration = Duration::from_secs(10);

/// How long a transfer waits for the writes in flight (each gives up after 5 s).
const GATE_WAIT: Duration = Duration::from_secs(6);

/// Hands `raft`'s leadership (this server leads group `group`) to the voter `target`.
/// openraft 0.9 has no leadership transfer, so this is Raft's usual recipe built from its
/// switches: the leader stops its heartbeats and its own elections, the other voters hold
/// theirs (`Rpc::Hold`, which expires by itself should the release be lost), and the target
/// starts elections (`Rpc::Elect`) until it wins. Its log must be as long as a quorum's to
/// win, so writes to the group wait (its gate, `RaftHost::gate`) from before the target is
/// checked until the transfer is over, and a target that does not catch up is refused.
pub async fn transfer(
    host: &RaftHost,
    raft: &Raft,
    group: &str,
    target: &Peer,
) -> Result<(), String> {
    let me = host.id;
    let to = node_id(&target.name);
    let m = raft.metrics().borrow().clone();
    if m.current_leader != Some(me) {
        return Err("not leader".into());
    }
    let others: Vec<Peer> = m
        .membership_config
        .nodes()
        .filter(|(id, _)| {
            **id != me && **id != to && m.membership_config.voter_ids().any(|v| v == **id)
        })
        .map(|(_, p)| p.clone())
        .collect();
    // No entry is appended from here on (writes in flight finish first): one appended
    // after the check below would leave the target an entry short of the others, whose
    // votes it then never gets while this leader has stopped leading.
    let gate = host.gate(group);
    let Ok(_closed) = tokio::time::timeout(GATE_WAIT, gate.write()).await else {
        return Err("writes in flight did not finish".into());
    };
    // The target must have everything the leader has (it is given a moment).
    let current = raft
        .wait(Some(Duration::from_secs(2)))
        .metrics(
            |m| {
                let last = m.last_log_index;
                m.replication
                    .as_ref()
                    .and_then(|r| r.get(&to).cloned().flatten())
                    .is_some_and(|l| Some(l.index) >= last)
            },
            "target current",
        )
        .await;
    if current.is_err() {
        return Err(format!("preferred server {:?} is not current", target.name));
    }
    let rc = raft.runtime_config();
    rc.heartbeat(false);
    rc.elect(false);
    let mut router = Router::new(host.account.clone(), 0x5248);
    let hold_ms = TRANSFER_WAIT.as_millis() as u64 + 2_000;
    hold_elections(host, &mut router, &others, group, hold_ms).await;
    let asked = host
        .call(
            &mut router,
            target,
            "ELECT",
            group,
            &Rpc::Elect,
            Duration::from_secs(2),
        )
        .await;
    // A target that refuses (its log lost entries, it is in lame duck mode) is not waited
    // for: the group would stay without heartbeats and writes for the whole wait.
    let asked = asked
        .map_err(|e| format!("preferred server {:?} did not answer: {e}", target.name))
        .and_then(|b| {
            bincode::deserialize::<Result<(), String>>(&b)
                .map_err(|e| e.to_string())
                .and_then(|r| r)
                .map_err(|e| format!("preferred server {:?} refused: {e}", target.name))
        });
    let r = match asked {
        Err(e) => Err(e),
        Ok(()) => raft
            .wait(Some(TRANSFER_WAIT))
            .metrics(
                |m| m.current_leader.is_some_and(|l| l != me),
                "another leader",
            )
            .await
            .map_err(|e| e.to_string())
            .and_then(|m| match m.current_leader {
                Some(l) if l == to => Ok(()),
                _ => Err(format!("{:?} did not win the election", target.name)),
            }),
    };
    rc.heartbeat(true);
    host.resume_elections(raft);
    hold_elections(host, &mut router, &others, group, 0).await;
    r
}

/// Tells `others` not to start elections in `group` for `ms` (0: the hold is over). One
/// that does not answer is down or cut off: it cannot win meanwhile anyway.
async fn hold_elections(
    host: &RaftHost,
    router: &mut Router,
    others: &[Peer],
    group: &str,
    ms: u64,
) {
    let rpc = Rpc::Hold { ms };
    for p in others {
        let _ = host
            .call(router, p, "HOLD", group, &rpc, Duration::from_secs(1))
            .await;
    }
}

/// The sid of the Raft transport's subscriptions (routes announce them: `serves_peers`).
pub(crate) const RAFT_SID: &[u8] = b"raft";

/// Whether `sub` belongs to an in-process subscriber that serves the whole cluster (the
/// Raft transport, the meta stepdown, clustered streams and consumers).
pub(crate) fn serves_peers(sub: &Sub) -> bool {
    sub.client
        .internal_queue()
        .is_some_and(|q| q.is_cluster_wide())
}

/// Queue in front of the transport: Raft batches are bounded by `max_payload_entries`.
const QUEUE_BYTES: usize = 64 * 1024 * 1024;

/// How long an RPC waits for its answer when openraft gives no deadline.
const RPC_TIMEOUT: Duration = Duration::from_secs(5);

/// About how much one `Rpc::Fetch` answer carries.
const FETCH_BYTES: u64 = 1 << 20;

/// A JetStream API request sent on to the server that answers it (`cluster::api`).
#[derive(Serialize, Deserialize)]
pub struct Forwarded {
    pub account: String,
    #[serde(with = "as_bytes")]
    pub subject: Vec<u8>,
    pub reply: Option<Vec<u8>>,
    pub hdr_len: usize,
    #[serde(with = "as_bytes")]
    pub data: Vec<u8>,
    pub hops: u8,
}

/// An `Rpc::Fetch` answer: where to go on from, and the messages as a batch.
#[derive(Serialize, Deserialize)]
pub struct Fetched {
    pub next: u64,
    #[serde(with = "as_bytes")]
    pub batch: Vec<u8>,
}

/// A replica's answer to `Rpc::Standing`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy)]
pub struct Standing {
    /// It restarted empty (a memory replica) and has applied nothing since.
    pub fresh: bool,
    pub last_log_index: u64,
    pub leader: Option<NodeId>,
}

#[derive(Serialize, Deserialize)]
enum Rpc {
    Append(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    Snapshot(InstallSnapshotRequest<TypeConfig>),
    /// A replica installing a stream snapshot asks the leader for the messages it lacks:
    /// those stored in `from..=to`, up to about `max_bytes`.
    Fetch {
        from: u64,
        to: u64,
        max_bytes: u64,
    },
    /// A leader handing leadership to this server (`transfer`): start elections now, until
    /// elected or a few seconds passed.
    Elect,
    /// A leader handing leadership to another server: do not start an election for `ms`
    /// (0: the hold is over), so that only the chosen one does.
    Hold {
        ms: u64,
    },
    /// The meta leader answering `$JS.API.INFO` asks each server (through the meta group)
    /// what it holds of `account`: `account::local_usage`.
    Usage {
        account: String,
    },
    /// A memory stream's replica that restarted empty asks its peers where they stand
    /// (`raft::stream::rejoin`).
    Standing,
    /// A rebuilt replica (empty log) asks the stream group's leader to append an empty
    /// batch: openraft 0.9's leader only finds out that a follower's log went back when it
    /// next replicates an entry (heartbeats do not), so an idle group would never refill it.
    Nudge,
    /// A stream sourcing or mirroring this group's stream, led on a server with no replica
    /// of it, reads the next messages (`sourcing::read_origin_waiting`), waiting up to
    /// `wait_ms` while there are none. (Last: the variants before keep their numbers.)
    ReadOrigin {
        ask: crate::jetstream::sourcing::OriginAsk,
        wait_ms: u64,
    },
}

/// Requests waiting for their answers, by number (the answer's subject ends in it): the
/// Raft transport's RPCs and the cluster inbox's requests.
#[derive(Default)]
pub struct Pending {
    waiting: Mutex<HashMap<u64, oneshot::Sender<Bytes>>>,
    next: AtomicU64,
}

impl Pending {
    /// A new request's number and its answer's receiver.
    pub fn open(&self) -> (u64, oneshot::Receiver<Bytes>) {
        let n = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(n, tx);
        (n, rx)
    }

    /// Drops a request that is not waited for any more.
    pub fn forget(&self, n: u64) {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&n);
    }

    /// Hands `m` on to its request: `tail` is the subject after the prefix (the number).
    pub fn answer(&self, tail: &[u8], m: &InMsg) {
        let n: u64 = std::str::from_utf8(tail)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let tx = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&n);
        if let Some(tx) = tx {
            let _ = tx.send(m.data.slice(m.hdr_len..));
        }
    }
}

/// One server's Raft groups and their transport.
pub struct RaftHost {
    pub name: String,
    pub id: NodeId,
    hash: String,
    server: Weak<Server>,
    account: Arc<Account>,
    groups: RwLock<HashMap<String, Raft>>,
    /// The stream groups' stores, for `Rpc::Fetch`.
    stores: RwLock<HashMap<String, std::sync::Weak<stream::Shared>>>,
    pending: Pending,
    /// Answers go out through one router (short lock per answer).
    answers: Mutex<Router>,
    /// When each peer (by peer hash) was last heard from, for `current`/`active`.
    heard: Mutex<HashMap<String, Instant>>,
    /// Servers that said they are stopping (`$SYS.SERVER.<id>.SHUTDOWN` or `.LAMEDUCK`),
    /// by name, with the server id they said it under (`departed`).
    departed: Mutex<HashMap<String, String>>,
    /// Groups whose log forgot entries it had acknowledged (or its vote), with the index a
    /// leader must bring it back to first: meanwhile this server neither votes nor stands
    /// for election in them (`hold_votes`).
    /// (The second number tells holds apart: a rebuilt replica's group has the same name
    /// as the one it replaced, whose watcher must not release the new hold.)
    held: Mutex<HashMap<String, (u64, u64)>>,
    holds: AtomicU64,
    /// Per group: a write to its log (`client_write`) holds the gate shared, a leadership
    /// transfer holds it alone (`transfer`), so the log stops growing while the chosen
    /// server catches up and runs: one entry short, it could never win.
    gates: Mutex<HashMap<String, Arc<tokio::sync::RwLock<()>>>>,
    /// Lame duck: this server stands for no election in any group from now on (as the
    /// reference makes its Raft nodes observers), whatever a hold's end or a transfer says.
    retiring: AtomicBool,
    /// Per group: when its replica was last loaded again after its log failed, and the wait
    /// before that (see `reload_wait`).
    reloads: Mutex<HashMap<String, (Instant, Duration)>>,
}

impl RaftHost {
    /// Subscribes the transport in the system account and starts serving RPCs.
    pub fn start(server: &Arc<Server>, account: Arc<Account>) -> Arc<RaftHost> {
        let name = server.server_name.clone();
        let hash = peer_hash(&name);
        let (handle, rx) =
            ClientHandle::internal(server, &account, "raft transport".into(), QUEUE_BYTES);
        if let Some(q) = handle.internal_queue() {
            q.set_cluster_wide();
        }
        for subject in [
            format!("$KEEL.RAFT.{hash}.*"),
            format!("$KEEL.RAFT.R.{hash}.*"),
        ] {
            account.sublist.insert(Sub::internal(
                &handle,
                Bytes::from_static(RAFT_SID),
                Bytes::from(subject),
            ));
        }
        let host = Arc::new(RaftHost {
            id: node_id(&name),
            name,
            hash,
            server: Arc::downgrade(server),
            answers: Mutex::new(Router::new(account.clone(), 0x5246)),
            account,
            groups: RwLock::new(HashMap::new()),
            stores: RwLock::new(HashMap::new()),
            pending: Pending::default(),
            heard: Mutex::new(HashMap::new()),
            departed: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            holds: AtomicU64::new(0),
            gates: Mutex::new(HashMap::new()),
            retiring: AtomicBool::new(false),
            reloads: Mutex::new(HashMap::new()),
        });
        server.spawn(serve(host.clone(), rx));
        host
    }

    /// The server this host runs in (while it runs).
    pub fn server(&self) -> Option<Arc<Server>> {
        self.server.upgrade()
    }

    /// The system account, where the transport lives.
    pub fn account(&self) -> &Arc<Account> {
        &self.account
    }

    /// Makes `raft` reachable as group `group` on this server.
    pub fn add_group(&self, group: &str, raft: Raft) {
        self.groups
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(group.to_string(), raft);
    }

    /// Group `group`'s log forgot what it had made durable, up to index `upto` (damage
    /// found at recovery: a flipped bit, a lost file; or its saved vote). A server that
    /// acknowledged entries and then lost them must not help elect a leader that lacks them
    /// (Jepsen's single-bit-error finding against the reference): until a leader has brought
    /// its log back to `upto`, it refuses every vote and does not stand for election.
    pub fn hold_votes(&self, group: &str, upto: u64) {
        if let Some(s) = self.server.upgrade() {
            crate::warn!(
                s.log,
                "JetStream group {group}: its log lost entries it had acknowledged (up to {upto}); it neither votes nor stands for election until a leader has sent them again"
            );
        }
        self.hold(group, upto);
    }

    /// Holds `group`'s votes until its log is back to `upto` (set later with
    /// `set_hold_upto`, or ended with `release_votes`), without a warning: a memory
    /// replica that restarted empty.
    /// Returns the hold's number (for `held_upto`, `set_hold_upto`, `release_votes`: a
    /// group made again under the same name gets a hold of its own).
    pub fn hold(&self, group: &str, upto: u64) -> u64 {
        let n = self.holds.fetch_add(1, Ordering::Relaxed);
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(group.to_string(), (upto, n));
        n
    }

    /// The index a held group waits for, while hold `n` is the one in place.
    pub fn held_upto(&self, group: &str, n: u64) -> Option<u64> {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(group)
            .filter(|(_, m)| *m == n)
            .map(|(u, _)| *u)
    }

    /// Hold `n` of a group learnt how far its log must come back.
    pub fn set_hold_upto(&self, group: &str, n: u64, upto: u64) {
        let mut g = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = g.get_mut(group).filter(|(_, m)| *m == n) {
            h.0 = upto;
        }
    }

    /// Ends hold `n` at once: the group votes and stands for election again.
    pub fn release_votes(&self, group: &str, n: u64, raft: &Raft) {
        let mut g = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if g.get(group).is_some_and(|(_, m)| *m == n) {
            g.remove(group);
            drop(g);
            self.resume_elections(raft);
        }
    }

    /// Lame duck: no group of this server stands for election any more (it still votes
    /// and follows, until it stops). Groups started later are kept out too (`guard_votes`).
    pub fn retire(&self) {
        self.retiring.store(true, Ordering::SeqCst);
        let groups: Vec<Raft> = self
            .groups
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for raft in groups {
            raft.runtime_config().elect(false);
        }
    }

    pub fn retiring(&self) -> bool {
        self.retiring.load(Ordering::SeqCst)
    }

    /// How long a group whose log failed (a full disk) waits before its replica is loaded
    /// again: 1 s, doubling up to 30 s while it keeps failing within a minute of the last.
    pub fn reload_wait(&self, group: &str) -> Duration {
        let mut r = self.reloads.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let wait = match r.get(group) {
            Some((at, w)) if now.saturating_duration_since(*at) < Duration::from_secs(60) => {
                (*w * 2).min(Duration::from_secs(30))
            }
            _ => Duration::from_secs(1),
        };
        r.insert(group.to_string(), (now + wait, wait));
        wait
    }

    /// Lets `raft` stand for election again after a pause (a transfer, a stepdown, a hold),
    /// unless this server has retired.
    fn resume_elections(&self, raft: &Raft) {
        if !self.retiring() {
            raft.runtime_config().elect(true);
            // `retire` may have run between the look and the switch: it wins.
            if self.retiring() {
                raft.runtime_config().elect(false);
            }
        }
    }

    pub(crate) fn votes_held(&self, group: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(group)
    }

    /// Once `raft` runs for `group`: if its votes are held, keeps it from standing for
    /// election until a leader (another server) has brought its log back, then lets it.
    pub fn guard_votes(self: &Arc<Self>, group: &str, raft: &Raft) {
        if self.retiring() {
            raft.runtime_config().elect(false);
        }
        let Some((_, n)) = self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(group)
            .copied()
        else {
            return;
        };
        raft.runtime_config().elect(false);
        let (host, raft, group, me) = (self.clone(), raft.clone(), group.to_string(), self.id);
        tokio::spawn(async move {
            // `upto` may be set later (`set_hold_upto`: a memory replica learns it from its
            // peers), so it is read again at each look.
            let mut metrics = raft.metrics();
            let mut upto;
            let healed: Result<(), ()> = loop {
                match host.held_upto(&group, n) {
                    Some(u) => upto = u,
                    None => return, // Released, or another hold took its place.
                }
                let done = {
                    let m = metrics.borrow_and_update();
                    m.last_log_index.unwrap_or(0) >= upto
                        && m.current_leader.is_some_and(|l| l != me)
                };
                if done {
                    break Ok(());
                }
                tokio::select! {
                    r = metrics.changed() => if r.is_err() { break Err(()) },
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
            };
            if healed.is_err() {
                return; // The group ended.
            }
            {
                let mut g = host.held.lock().unwrap_or_else(|e| e.into_inner());
                if g.get(&group).is_none_or(|(_, m)| *m != n) {
                    return; // Another hold took its place (a rebuilt replica's).
                }
                g.remove(&group);
            }
            host.resume_elections(&raft);
            if let Some(s) = host.server.upgrade() {
                crate::info!(
                    s.log,
                    "JetStream group {group}: its log is back to {upto}; it votes again"
                );
            }
        });
    }

    /// A stream group's shared state here, while it runs.
    fn store_of(&self, group: &str) -> Option<Arc<stream::Shared>> {
        self.stores
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(group)
            .and_then(std::sync::Weak::upgrade)
    }

    /// Makes a stream group's store readable by its peers (`fetch`).
    pub fn add_store(&self, group: &str, shared: &Arc<stream::Shared>) {
        self.stores
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(group.to_string(), Arc::downgrade(shared));
    }

    /// Asks `target` for group `group`'s messages stored in `from..=to` (a chunk of
    /// them): where to go on from, and the messages as a batch.
    pub async fn fetch(
        &self,
        target: &str,
        group: &str,
        from: u64,
        to: u64,
    ) -> Result<(u64, Vec<u8>), String> {
        let rpc = Rpc::Fetch {
            from,
            to,
            max_bytes: FETCH_BYTES,
        };
        let b = self
            .ask(target, "FETCH", group, &rpc, RPC_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?;
        let f =
            bincode::deserialize::<Result<Fetched, String>>(&b).map_err(|e| e.to_string())??;
        Ok((f.next, f.batch))
    }

    /// The next messages of the stream of group `group` that a source on this server asks
    /// for, from `target`'s replica (which waits up to `wait` while there are none).
    pub async fn read_origin(
        &self,
        target: &str,
        group: &str,
        ask: &crate::jetstream::sourcing::OriginAsk,
        wait: Duration,
    ) -> Result<crate::jetstream::sourcing::OriginRead, String> {
        let rpc = Rpc::ReadOrigin {
            ask: ask.clone(),
            wait_ms: wait.as_millis() as u64,
        };
        let b = self
            .ask(target, "ORIGIN", group, &rpc, wait + RPC_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?;
        bincode::deserialize::<Result<crate::jetstream::sourcing::OriginRead, String>>(&b)
            .map_err(|e| e.to_string())?
    }

    /// `target`'s usage of `account` (memory, file bytes, consumers it leads), if it
    /// answers within `timeout`.
    pub async fn usage(
        &self,
        target: &str,
        account: &str,
        timeout: Duration,
    ) -> Option<(u64, u64, u64)> {
        let rpc = Rpc::Usage {
            account: account.to_string(),
        };
        let group = crate::jetstream::cluster::META_GROUP;
        let b = self.ask(target, "USAGE", group, &rpc, timeout).await.ok()?;
        bincode::deserialize::<Option<(u64, u64, u64)>>(&b).ok()?
    }

    /// One RPC to `target` about `group`, on a router of its own.
    async fn ask(
        &self,
        target: &str,
        kind: &str,
        group: &str,
        rpc: &Rpc,
        timeout: Duration,
    ) -> Result<Bytes, NetworkError> {
        let mut router = Router::new(self.account.clone(), 0x5246);
        let peer = Peer {
            name: target.to_string(),
        };
        self.call(&mut router, &peer, kind, group, rpc, timeout)
            .await
    }

    /// Where `target`'s replica of `group` stands, if it answers.
    pub async fn standing(&self, target: &str, group: &str) -> Option<Standing> {
        let rpc = Rpc::Standing;
        let b = self
            .ask(target, "STANDING", group, &rpc, Duration::from_secs(1))
            .await
            .ok()?;
        bincode::deserialize(&b).ok()
    }

    /// Asks `target`, the leader of stream group `group`, to append an empty batch
    /// (`Rpc::Nudge`).
    pub async fn nudge(&self, target: &str, group: &str) {
        let _ = self
            .ask(target, "NUDGE", group, &Rpc::Nudge, Duration::from_secs(1))
            .await;
    }

    /// Group `group`'s write gate (see `gates`): hold it shared around each `client_write`.
    pub fn gate(&self, group: &str) -> Arc<tokio::sync::RwLock<()>> {
        let mut gates = self.gates.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = gates.get(group) {
            return g.clone(); // (No key allocated per batch.)
        }
        gates.entry(group.to_string()).or_default().clone()
    }

    pub fn remove_group(&self, group: &str) -> Option<Raft> {
        self.gates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(group);
        self.stores
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(group);
        self.groups
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(group)
    }

    pub fn group(&self, group: &str) -> Option<Raft> {
        self.groups
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(group)
            .cloned()
    }

    /// The network factory of one group.
    /// `flushed`: a stream group's log's last entry on disk (see `log::LogStore::append`).
    pub fn network(self: &Arc<Self>, group: &str, flushed: Option<Flushed>) -> Network {
        Network {
            host: self.clone(),
            group: group.to_string(),
            flushed,
        }
    }

    fn publish(&self, router: &mut Router, subject: Bytes, reply: Option<Bytes>, data: Bytes) {
        let Some(server) = self.server.upgrade() else {
            return;
        };
        router.route(
            &server,
            &Outgoing {
                subject: &subject,
                reply: reply.as_ref(),
                hdr_len: None,
                data: &data,
            },
            None,
        );
        router.flush();
    }

    /// Sends one RPC to `target` and waits for its encoded answer.
    async fn call(
        &self,
        router: &mut Router,
        target: &Peer,
        kind: &str,
        group: &str,
        rpc: &Rpc,
        timeout: Duration,
    ) -> Result<Bytes, NetworkError> {
        let (n, rx) = self.pending.open();
        let body = bincode::serialize(&(group, rpc)).map_err(|e| {
            self.pending.forget(n);
            NetworkError::new(&e)
        })?;
        let subject = Bytes::from(format!("$KEEL.RAFT.{}.{kind}", peer_hash(&target.name)));
        let reply = Bytes::from(format!("$KEEL.RAFT.R.{}.{n}", self.hash));
        self.publish(router, subject, Some(reply), Bytes::from(body));
        let r = tokio::time::timeout(timeout, rx).await;
        self.pending.forget(n);
        match r {
            Ok(Ok(b)) => {
                self.heard_from(peer_hash(&target.name).as_bytes());
                Ok(b)
            }
            Ok(Err(_)) => Err(NetworkError::new(&std::io::Error::other(
                "transport closed",
            ))),
            Err(_) => Err(NetworkError::new(&std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer from {} in {timeout:?}", target.name),
            ))),
        }
    }

    fn heard_from(&self, hash: &[u8]) {
        if let Ok(h) = std::str::from_utf8(hash) {
            self.heard
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(h.to_string(), Instant::now());
        }
    }

    /// Server `name` (running as `id`) said it is stopping or entering lame-duck mode.
    pub fn note_departed(&self, name: &str, id: &str) {
        if name != self.name {
            self.departed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.to_string(), id.to_string());
        }
    }

    /// Whether server `name` said it is stopping and has not started again since: it is
    /// back once a route from it runs under another server id (a server takes a new one
    /// at every start; a server in lame-duck mode keeps its routes and its id).
    pub fn departed(&self, name: &str) -> bool {
        let mut g = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        let Some(id) = g.get(name) else {
            return false;
        };
        let back = self
            .server
            .upgrade()
            .and_then(|s| {
                s.cluster.get().map(|c| {
                    c.routes()
                        .iter()
                        .any(|r| r.remote_name() == name && r.remote_id() != *id)
                })
            })
            .unwrap_or(false);
        if back {
            g.remove(name);
        }
        !back
    }

    /// Whether server `name` counts as up (for placement and a replica's `offline`): this
    /// server, or one heard from within the last 10 s (the reference's window) that has
    /// not said it is stopping.
    pub fn is_up(&self, name: &str) -> bool {
        name == self.name
            || (self
                .since_heard(name)
                .is_some_and(|d| d < Duration::from_secs(10))
                && !self.departed(name))
    }

    /// How long ago `name` was last heard from (an RPC or an answer), if ever.
    pub fn since_heard(&self, name: &str) -> Option<Duration> {
        self.heard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer_hash(name))
            .map(|t| t.elapsed())
    }

    /// Sends a JetStream API request to server `to` (no answer: the request's own reply
    /// subject gets it).
    pub fn forward(&self, to: &str, req: &Forwarded) {
        let Ok(body) = bincode::serialize(req) else {
            return;
        };
        let subject = Bytes::from(format!("$KEEL.RAFT.{}.FWD", peer_hash(to)));
        let mut router = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        self.publish(&mut router, subject, None, Bytes::from(body));
    }

    /// A forwarded request: into its account's API queue, as if a client here sent it.
    fn take_forwarded(&self, m: &InMsg) {
        let Ok(f) = bincode::deserialize::<Forwarded>(m.payload()) else {
            return;
        };
        let Some(server) = self.server.upgrade() else {
            return;
        };
        let Some(js) = server
            .jetstream
            .get()
            .and_then(|j| j.account(&f.account).cloned())
        else {
            return;
        };
        let sid = Bytes::from(format!("fwd{}", f.hops));
        js.queue_request(&f.subject, &sid, f.reply.as_deref(), f.hdr_len, &f.data);
    }

    /// Shuts every group down (server shutdown).
    pub async fn shutdown(&self) {
        let groups: Vec<Raft> = self
            .groups
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, r)| r)
            .collect();
        for g in groups {
            let _ = g.shutdown().await;
        }
        // Their logs' files go now, not with the last copy of each handle.
        let stores: Vec<_> = self
            .stores
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        for s in stores {
            s.close_log().await;
        }
    }
}

async fn serve(host: Arc<RaftHost>, mut rx: crate::inqueue::Receiver) {
    let answer_prefix = format!("$KEEL.RAFT.R.{}.", host.hash);
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, 256, 8 * 1024 * 1024).await > 0 {
        for m in batch.drain(..) {
            if let Some(n) = m.subject.strip_prefix(answer_prefix.as_bytes()) {
                host.pending.answer(n, &m);
                continue;
            }
            if m.subject.ends_with(b".FWD") {
                host.take_forwarded(&m);
                continue;
            }
            // A request: each is handled on its own task, so a slow group (a snapshot
            // install, a long append) does not hold up the others.
            let host = host.clone();
            tokio::spawn(async move { answer(&host, m).await });
        }
    }
}

async fn answer(host: &Arc<RaftHost>, m: InMsg) {
    let Some(reply) = m.reply.clone() else {
        return;
    };
    // The reply names the caller: `$KEEL.RAFT.R.<peer>.<n>`.
    if let Some(rest) = reply.strip_prefix(b"$KEEL.RAFT.R.".as_slice()) {
        if let Some(dot) = rest.iter().position(|b| *b == b'.') {
            host.heard_from(&rest[..dot]);
        }
    }
    let Ok((group, rpc)) = bincode::deserialize::<(String, Rpc)>(m.payload()) else {
        return;
    };
    // A group this server does not (yet) have: no answer, the caller times out and retries
    // (a stream group is created on every member when its assignment applies).
    let Some(raft) = host.group(&group) else {
        return;
    };
    let body = match rpc {
        Rpc::Append(req) => bincode::serialize(&raft.append_entries(req).await),
        Rpc::Vote(_) if host.votes_held(&group) => {
            // Refused without a word to openraft: this server's vote is as it was.
            let vote = raft.metrics().borrow().vote;
            let r: Result<VoteResponse<NodeId>, RaftError<NodeId>> =
                Ok(VoteResponse::new(vote, None, false));
            bincode::serialize(&r)
        }
        Rpc::Vote(req) => bincode::serialize(&raft.vote(req).await),
        Rpc::Snapshot(req) => bincode::serialize(&raft.install_snapshot(req).await),
        Rpc::Fetch {
            from,
            to,
            max_bytes,
        } => {
            let shared = host.store_of(&group);
            let r = match shared {
                Some(sh) => sh
                    .serve_fetch(from, to, max_bytes)
                    .map(|(next, batch)| Fetched { next, batch }),
                None => Err(format!("no stream group {group} here")),
            };
            bincode::serialize(&r)
        }
        Rpc::ReadOrigin { ask, wait_ms } => {
            // Only a replica that serves reads (not one being refilled or rebuilt).
            let origin = host
                .store_of(&group)
                .filter(|sh| sh.serves_reads())
                .and_then(|sh| sh.stream.get().and_then(std::sync::Weak::upgrade));
            let r = match origin {
                Some(s) => Ok(crate::jetstream::sourcing::read_origin_waiting(
                    &s,
                    &ask,
                    Duration::from_millis(wait_ms.min(10_000)),
                )
                .await),
                None => Err(format!("no readable replica of group {group} here")),
            };
            bincode::serialize(&r)
        }
        Rpc::Elect if host.votes_held(&group) => {
            bincode::serialize(&Err::<(), String>("its log lost entries".into()))
        }
        Rpc::Elect if host.retiring() => {
            bincode::serialize(&Err::<(), String>("it is in lame duck mode".into()))
        }
        Rpc::Elect => {
            let me = host.id;
            let host = host.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + TRANSFER_WAIT;
                while Instant::now() < deadline {
                    // (`trigger().elect()` ignores `elect(false)`: a server that retired
                    // meanwhile must stop asking itself.)
                    if raft.metrics().borrow().current_leader == Some(me) || host.retiring() {
                        return;
                    }
                    if raft.trigger().elect().await.is_err() {
                        return;
                    }
                    let _ = raft
                        .wait(Some(Duration::from_millis(200)))
                        .metrics(|m| m.current_leader == Some(me), "elected")
                        .await;
                }
            });
            bincode::serialize(&Ok::<(), String>(()))
        }
        Rpc::Standing => {
            let m = raft.metrics().borrow().clone();
            let st = Standing {
                fresh: host.store_of(&group).is_some_and(|sh| sh.is_fresh()),
                last_log_index: m.last_log_index.unwrap_or(0),
                leader: m.current_leader,
            };
            bincode::serialize(&st)
        }
        Rpc::Nudge => {
            let shared = host.store_of(&group);
            if let Some(sh) = shared.filter(|_| leads(&raft.metrics().borrow())) {
                sh.nudge();
            }
            bincode::serialize(&Ok::<(), String>(()))
        }
        Rpc::Usage { account } => {
            let usage = host
                .server()
                .and_then(|s| s.jetstream.get().and_then(|j| j.account(&account).cloned()))
                .map(|js| {
                    let (m, f, c) = crate::jetstream::api::account::local_usage(&js);
                    (m, f, c as u64)
                });
            bincode::serialize(&usage)
        }
        Rpc::Hold { .. } if host.votes_held(&group) => bincode::serialize(&Ok::<(), String>(())),
        Rpc::Hold { ms } => {
            if ms == 0 {
                host.resume_elections(&raft);
            } else {
                raft.runtime_config().elect(false);
                let host = host.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    if !host.votes_held(&group) {
                        host.resume_elections(&raft);
                    }
                });
            }
            bincode::serialize(&Ok::<(), String>(()))
        }
    };
    let Ok(body) = body else {
        return;
    };
    let mut router = host.answers.lock().unwrap_or_else(|e| e.into_inner());
    host.publish(&mut router, reply, None, Bytes::from(body));
}

/// A group's network factory (openraft makes one client per follower).
pub struct Network {
    host: Arc<RaftHost>,
    group: String,
    flushed: Option<Flushed>,
}

/// A log's last entry on disk, as it moves.
pub type Flushed = tokio::sync::watch::Receiver<log::OnDisk>;

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Conn;

    async fn new_client(&mut self, _target: NodeId, node: &Peer) -> Conn {
        Conn {
            router: Router::new(self.host.account.clone(), 0x5247),
            host: self.host.clone(),
            group: self.group.clone(),
            target: node.clone(),
            flushed: self.flushed.clone(),
        }
    }
}

/// One group's RPCs to one peer.
pub struct Conn {
    host: Arc<RaftHost>,
    group: String,
    target: Peer,
    router: Router,
    flushed: Option<Flushed>,
}

impl Conn {
    async fn rpc<R: DeserializeOwned, E: std::error::Error + DeserializeOwned>(
        &mut self,
        kind: &str,
        rpc: Rpc,
        option: &RPCOption,
    ) -> Result<R, RPCError<NodeId, Peer, RaftError<NodeId, E>>> {
        let timeout = option.hard_ttl().min(RPC_TIMEOUT);
        let b = self
            .host
            .call(
                &mut self.router,
                &self.target,
                kind,
                &self.group,
                &rpc,
                timeout,
            )
            .await
            .map_err(RPCError::Network)?;
        let r: Result<R, RaftError<NodeId, E>> =
            bincode::deserialize(&b).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        r.map_err(|e| {
            RPCError::RemoteError(RemoteError::new_with_node(
                node_id(&self.target.name),
                self.target.clone(),
                e,
            ))
        })
    }
}

impl RaftNetwork<TypeConfig> for Conn {
    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, Peer, RaftError<NodeId>>> {
        // The followers learn no commit past what the leader's own log has on disk: openraft
        // counts a leader's append before its fsync (`log::LogStore::append`).
        if let Some(f) = &self.flushed {
            let on_disk = f.borrow().last;
            if rpc.leader_commit > on_disk {
                rpc.leader_commit = on_disk;
            }
        }
        self.rpc("AE", Rpc::Append(rpc), &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, Peer, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.rpc("IS", Rpc::Snapshot(rpc), &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, Peer, RaftError<NodeId>>> {
        self.rpc("V", Rpc::Vote(rpc), &option).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_ids_match_the_reference() {
        // Captured from nats-server 2.15.1: servers A, B and C.
        assert_eq!(peer_hash("A"), "NUmM6cRx");
        assert_eq!(peer_hash("B"), "b2oh2L6w");
        assert_eq!(peer_hash("C"), "jZ6RvVRH");
    }
}

#[cfg(test)]
mod bytes_tests {
    use super::*;

    /// A command is encoded as bincode encodes a `Vec<u8>`: logs written before read alike.
    #[test]
    fn a_command_encodes_as_a_byte_vector_did() {
        let v: Vec<u8> = (0..=255).collect();
        let cmd = bincode::serialize(&Cmd(v.clone())).unwrap();
        assert_eq!(cmd, bincode::serialize(&v).unwrap());
        let back: Cmd = bincode::deserialize(&bincode::serialize(&v).unwrap()).unwrap();
        assert_eq!(back.0, v);
        let json: Cmd = serde_json::from_str("[1,2,3]").unwrap();
        assert_eq!(json.0, vec![1, 2, 3]);
    }
}
