//! A replicated stream's Raft group: its log carries the leader's decided entries in
//! batches, its state machine is the stream's store.
//!
//! **The leader applies early.** The leader's actor decides as it always has, against its
//! store with the batch's earlier messages in it, so [`RaftReplicator::propose`] applies an
//! entry at once and keeps it for the batch. `commit` appends the batch to the group's log
//! and waits until a quorum has it on disk (each replica's log fsyncs before it confirms);
//! only then are the PubAcks sent. The store keeps the last applied batch's log position
//! as its marker and is synced now and then (every `STORE_SYNC`, and for forced commits),
//! as every replica's is: a restart applies the log again from the synced marker, so the
//! store's own fsync is not on the PubAck's path. Every replica's state machine applies
//! committed batches to its store;
//! an entry already there (a message at or below the store's last sequence: the leader's
//! own, or one a restart replays) is skipped, and the other entries (removals, purges,
//! expiry, config) have the same effect applied again.
//!
//! **A failed commit** (the leader lost its quorum or its role) rolls the leader's store
//! back to its last sync and applies the committed batches after it again, read from the
//! log (so the store holds exactly the committed batches), and fences the replicator: no
//! decision until this server is leader with every entry of its log applied (so a batch
//! that does commit later, by a new leader, is in the store before anything is decided
//! after it). The fence's lock orders the rollback against the state machine applying
//! that same batch. Its publishers get an error only if it cannot commit any more; one
//! whose outcome is not known in time is answered when it is (`take_uncertain`).
//!
//! **Leadership.** Only the leader subscribes to the stream's subjects (announced to the
//! routes); a watcher follows the group's metrics, subscribes once the leader is ready and
//! unsubscribes when it is not leader any more.

#![allow(clippy::result_large_err)]

use std::io::Cursor;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use keel_store::{Store, StoreError};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};

use super::{Cmd, CmdResult, NodeId, Peer, Raft, TypeConfig, COMMIT_TIMEOUT};
use crate::jetstream::stream::apply::{apply, Applied};
use crate::jetstream::stream::entry::{MsgEntry, Rollup, StreamEntry};
use crate::jetstream::stream::read::WriteHandle;
use crate::jetstream::stream::replicator::{Replicator, Uncertain};
use crate::jetstream::stream::Stream;

/// How often a replica syncs its store (its log is synced for every batch).
const STORE_SYNC: Duration = Duration::from_millis(200);

/// Where a replicated stream's group lives (written in the stream's meta file).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// `S-R3F-xxxxxxxx`.
    pub group: String,
    /// Server names; the first made the group.
    pub peers: Vec<String>,
}

/// A change to one of the stream's durable consumers, carried in the stream's group (so
/// a thousand consumers cost no group of their own): its config file at create, its saved
/// state (the replicated part, as the consumer writes it to `state.json`), its removal.
/// Applying one again has the same effect (the last state written wins).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum ConsumerEntry {
    Create {
        name: String,
        #[serde(with = "text_bytes")]
        meta: Vec<u8>,
    },
    State {
        name: String,
        #[serde(with = "text_bytes")]
        state: Vec<u8>,
        /// The state's ack floor (stream sequence), for the leader's lag figures.
        #[serde(default)]
        ack_floor: u64,
    },
    Delete {
        name: String,
    },
}

/// A consumer file's bytes (JSON text) in an entry as a JSON string: serde's default, an
/// array of numbers, made a 3.6 KB state an 11 KB entry on every replica's log per ack.
/// Entries logged as arrays (by an older Keel) still read.
mod text_bytes {
    use serde::{de, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(b) {
            Ok(t) => s.serialize_str(t),
            Err(_) => s.collect_seq(b),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or an array of bytes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<u8>, E> {
                Ok(v.as_bytes().to_vec())
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(a.size_hint().unwrap_or(0));
                while let Some(b) = a.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

/// One log entry: a batch the leader decided.
pub struct Batch {
    /// The leader that decided it, and that process's run (a random number per start), so
    /// its state machine knows its own batches.
    pub origin: NodeId,
    pub epoch: u64,
    pub nonce: u64,
    pub entries: Vec<StreamEntry>,
    pub consumers: Vec<ConsumerEntry>,
    /// Now and then, the leader's store as of this batch (`CHECK_EVERY`).
    pub check: Option<Digest>,
}

/// What a store holds at one point of the log. Every replica applies the same entries, so
/// at the same batch its store must hold as many messages as the leader's did; one that
/// holds fewer lacks messages (a hole, however it came about), and one that holds more has
/// messages its leader lacks. (The bounds are for the log line.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Digest {
    pub msgs: u64,
    pub first_seq: u64,
    pub last_seq: u64,
}

impl Digest {
    fn of(st: &keel_store::State) -> Digest {
        Digest {
            msgs: st.msgs,
            first_seq: st.first_seq,
            last_seq: st.last_seq,
        }
    }
}

/// How often the leader puts a `Digest` in a batch.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How many checks in a row must disagree before a replica acts on it: right after a
/// replica installed a snapshot it may lack messages the leader removes a few entries
/// later (fetched after their removal), which the log then makes equal again.
const DIVERGED_AFTER: u32 = 3;

const TAG_MSG: u8 = 0;
const TAG_JSON: u8 = 1;
const TAG_CONSUMER: u8 = 2;
const TAG_CHECK: u8 = 3;

/// Compact binary: messages as length-prefixed fields (the hot path), anything else as
/// JSON. Decoding gives `Bytes` slices of the entry, no copies.
pub fn encode(b: &Batch) -> Vec<u8> {
    let size: usize = b
        .entries
        .iter()
        .map(|e| match e {
            StreamEntry::Msg(m) => 40 + m.subject.len() + m.hdr.len() + m.data.len(),
            _ => 256,
        })
        .sum();
    let mut out = Vec::with_capacity(28 + size);
    out.put_u64(b.origin);
    out.put_u64(b.epoch);
    out.put_u64(b.nonce);
    out.put_u32((b.entries.len() + b.consumers.len() + b.check.is_some() as usize) as u32);
    if let Some(d) = &b.check {
        out.put_u8(TAG_CHECK);
        out.put_u64(d.msgs);
        out.put_u64(d.first_seq);
        out.put_u64(d.last_seq);
    }
    for c in &b.consumers {
        let j = serde_json::to_vec(c).unwrap_or_default();
        out.put_u8(TAG_CONSUMER);
        out.put_u32(j.len() as u32);
        out.put_slice(&j);
    }
    for e in &b.entries {
        match e {
            StreamEntry::Msg(m) => {
                out.put_u8(TAG_MSG);
                out.put_u64(m.seq);
                out.put_i64(m.ts);
                let rollup = match m.rollup {
                    None => 0,
                    Some(Rollup::Sub) => 1,
                    Some(Rollup::All) => 2,
                };
                out.put_u8(rollup | if m.no_max_age { 0x10 } else { 0 });
                for f in [&m.subject, &m.hdr, &m.data] {
                    out.put_u32(f.len() as u32);
                    out.put_slice(f);
                }
            }
            other => {
                let j = serde_json::to_vec(other).unwrap_or_default();
                out.put_u8(TAG_JSON);
                out.put_u32(j.len() as u32);
                out.put_slice(&j);
            }
        }
    }
    out
}

pub fn decode(mut b: Bytes) -> Result<Batch, String> {
    fn need(b: &Bytes, n: usize) -> Result<(), String> {
        if b.remaining() < n {
            Err("stream batch cut short".into())
        } else {
            Ok(())
        }
    }
    need(&b, 28)?;
    let origin = b.get_u64();
    let epoch = b.get_u64();
    let nonce = b.get_u64();
    let n = b.get_u32() as usize;
    let mut entries = Vec::with_capacity(n.min(65_536));
    let mut consumers = Vec::new();
    let mut check = None;
    for _ in 0..n {
        need(&b, 1)?;
        match b.get_u8() {
            TAG_MSG => {
                need(&b, 17)?;
                let seq = b.get_u64();
                let ts = b.get_i64();
                let flags = b.get_u8();
                let mut fields = [Bytes::new(), Bytes::new(), Bytes::new()];
                for f in &mut fields {
                    need(&b, 4)?;
                    let len = b.get_u32() as usize;
                    need(&b, len)?;
                    *f = b.split_to(len);
                }
                let [subject, hdr, data] = fields;
                entries.push(StreamEntry::Msg(MsgEntry {
                    seq,
                    ts,
                    subject,
                    hdr,
                    data,
                    rollup: match flags & 0x0f {
                        1 => Some(Rollup::Sub),
                        2 => Some(Rollup::All),
                        _ => None,
                    },
                    no_max_age: flags & 0x10 != 0,
                }));
            }
            TAG_JSON => {
                need(&b, 4)?;
                let len = b.get_u32() as usize;
                need(&b, len)?;
                let j = b.split_to(len);
                entries.push(serde_json::from_slice(&j).map_err(|e| e.to_string())?);
            }
            TAG_CONSUMER => {
                need(&b, 4)?;
                let len = b.get_u32() as usize;
                need(&b, len)?;
                let j = b.split_to(len);
                consumers.push(serde_json::from_slice(&j).map_err(|e| e.to_string())?);
            }
            TAG_CHECK => {
                need(&b, 24)?;
                check = Some(Digest {
                    msgs: b.get_u64(),
                    first_seq: b.get_u64(),
                    last_seq: b.get_u64(),
                });
            }
            t => return Err(format!("unknown stream entry tag {t}")),
        }
    }
    Ok(Batch {
        origin,
        epoch,
        nonce,
        entries,
        consumers,
        check,
    })
}

/// The applied marker in the store: the log id of the last batch it holds.
fn marker(id: &LogId<NodeId>) -> [u8; 24] {
    let mut m = [0u8; 24];
    m[..8].copy_from_slice(&id.leader_id.term.to_be_bytes());
    m[8..16].copy_from_slice(&id.leader_id.node_id.to_be_bytes());
    m[16..].copy_from_slice(&id.index.to_be_bytes());
    m
}

fn unmarker(m: &[u8]) -> Option<LogId<NodeId>> {
    if m.len() != 24 {
        return None;
    }
    let n = |r: std::ops::Range<usize>| u64::from_be_bytes(m[r].try_into().expect("8 bytes"));
    Some(LogId::new(
        openraft::CommittedLeaderId::new(n(0..8), n(8..16)),
        n(16..24),
    ))
}

#[derive(Default)]
struct Fence {
    /// The newest of this run's own batches the state machine has seen.
    applied_nonce: u64,
}

#[derive(Serialize, Deserialize, Default, Clone)]
struct Memberships {
    /// The last two membership entries applied (the newest at or below the store's marker
    /// is the one to report at start; a newer one is still in the log).
    list: Vec<StoredMembership<NodeId, Peer>>,
}

/// Checks in a row whose `Digest` this replica's store did not match, and how.
#[derive(Default)]
struct Divergence {
    streak: u32,
    /// This store holds fewer messages than the leader's did (else more, or the same
    /// number over other sequences).
    short: bool,
    what: String,
}

/// A consumer's replicated ack floors: (log index, ack floor, committed at, ns).
type FloorHistory = std::collections::VecDeque<(u64, u64, i64)>;

/// What the replicator, the state machine and the watcher share.
pub struct Shared {
    pub node: NodeId,
    pub epoch: u64,
    /// The state machine's write access (it never runs at the same time as the leader's
    /// decisions for the same entries; see the module docs).
    store: WriteHandle,
    fence: Mutex<Fence>,
    /// After a failed commit, or before this server is a ready leader: no decisions. Not
    /// under the fence's lock: it is asked and set with the store locked (`propose`, a
    /// failed `capture`), and the lock order is the fence, then the store (the state
    /// machine applying a batch holds both).
    fenced: std::sync::atomic::AtomicBool,
    /// Told whenever `set_fenced` runs (a leader that stopped leading: `until_fenced`).
    fenced_set: tokio::sync::Notify,
    /// Told when this replica's Raft node starts and whenever it is fenced or unfenced
    /// (with the node's metrics, what a wait for the stream's leader watches).
    pub leadership: tokio::sync::Notify,
    applied: Mutex<(Option<LogId<NodeId>>, Memberships)>,
    memberships_file: std::path::PathBuf,
    files: keel_store::MetaFiles,
    pub stream: OnceLock<Weak<Stream>>,
    pub raft: OnceLock<Raft>,
    host: OnceLock<(Arc<super::RaftHost>, String)>,
    /// On the leader, per consumer: the ack floors it replicated, with their log index and
    /// when they committed, so it can say how far each follower's copy of the ack floor
    /// trails its own (`ack_floor_lag`).
    floors: Mutex<std::collections::HashMap<String, FloorHistory>>,
    /// When this server last became the group's leader (nanoseconds), for `leader_since`.
    pub leader_since: std::sync::atomic::AtomicI64,
    stop: tokio::sync::Notify,
    /// `stop_group` ran: a node started after it (its log opened late) stops at once.
    stopped: std::sync::atomic::AtomicBool,
    last_sync: Mutex<std::time::Instant>,
    /// A membership change (`reconcile`) is under way.
    changing: std::sync::atomic::AtomicBool,
    /// The group's log, read again when a failed commit rolls the store back past
    /// committed batches (`RaftReplicator::commit`).
    log: OnceLock<super::log::LogStore>,
    /// A log index at or below the store's last synced marker (what a rollback keeps).
    synced: std::sync::atomic::AtomicU64,
    /// The log index of the newest batch the state machine put in the store (its marker
    /// then). A store whose marker is behind it was rolled back under the state machine
    /// (a failed sync or commit on a full disk): applying the next batch on top would
    /// leave the dropped batches' sequences as a hole, so the group stops instead and the
    /// replica is loaded again from its files, which applies the log from the marker.
    batch_applied: std::sync::atomic::AtomicU64,
    /// How this replica's store compared with the leader's `Digest`s lately.
    divergence: Mutex<Divergence>,
    /// Digests of batches up to this log index are not compared: the messages a snapshot
    /// install fetched were read from the leader's store as of about there, so some the
    /// log removes later may be missing already.
    quiet_upto: std::sync::atomic::AtomicU64,
    /// The leader's store holds entries not committed yet (set when the first entry of a
    /// batch is applied early, with the store locked; cleared once it commits or is rolled
    /// back): a snapshot is taken only when it does not.
    in_flight: std::sync::atomic::AtomicBool,
    /// Set when this replica leaves its group because its store could not be written: the
    /// watcher then loads it again from its files (`reload`), as for a failed log.
    reload_wanted: std::sync::atomic::AtomicBool,
    /// A snapshot waits for the busy leader's next commit to take the store's state.
    capture_wanted: std::sync::atomic::AtomicBool,
    captured: Mutex<Option<Captured>>,
    captured_ready: tokio::sync::Notify,
    /// The last snapshot built (openraft sends it to a replica whose log is behind it).
    current: Mutex<Option<Built>>,
    /// A memory replica that restarted empty and rejoins its group (`rejoin`).
    rejoining: std::sync::atomic::AtomicBool,
}

/// A snapshot as built or installed: its meta and its data.
type Built = (SnapshotMeta<NodeId, Peer>, Vec<u8>);

/// The store's state at a synced marker, with only committed batches in it.
type Captured = (Option<LogId<NodeId>>, keel_store::Snapshot);

/// A stream group's snapshot: what the store holds (which sequences, not the messages: a
/// replica that installs it fetches those it lacks from the leader) and the durable
/// consumers' files.
#[derive(Serialize, Deserialize)]
struct StreamSnap {
    first_seq: u64,
    last_seq: u64,
    last_ts: i64,
    deleted: Vec<(u64, u64)>,
    /// (name, meta.json, state.json)
    consumers: Vec<(String, Vec<u8>, Option<Vec<u8>>)>,
    /// The leader's config when it built this (at or after the snapshot's position): a
    /// replica made from the assignment's config, which a plain update does not change,
    /// would otherwise keep the old limits until the next update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    config: Option<crate::jetstream::stream::config::StreamConfig>,
}

impl Shared {
    pub fn new(
        node: NodeId,
        store: WriteHandle,
        dir: &std::path::Path,
        files: keel_store::MetaFiles,
    ) -> Arc<Shared> {
        let applied = unmarker(&store.lock().applied());
        let memberships_file = dir.join("memberships.json");
        let memberships = match files.read(&memberships_file) {
            keel_store::MetaRead::Current(b) | keel_store::MetaRead::Older { body: b, .. } => {
                serde_json::from_slice(&b).unwrap_or_default()
            }
            _ => Memberships::default(),
        };
        Arc::new(Shared {
            node,
            epoch: rand::random(),
            store,
            fence: Mutex::new(Fence { applied_nonce: 0 }),
            fenced: std::sync::atomic::AtomicBool::new(true),
            fenced_set: tokio::sync::Notify::new(),
            leadership: tokio::sync::Notify::new(),
            applied: Mutex::new((applied, memberships)),
            memberships_file,
            files,
            stream: OnceLock::new(),
            raft: OnceLock::new(),
            host: OnceLock::new(),
            floors: Mutex::new(std::collections::HashMap::new()),
            leader_since: std::sync::atomic::AtomicI64::new(0),
            stop: tokio::sync::Notify::new(),
            stopped: std::sync::atomic::AtomicBool::new(false),
            last_sync: Mutex::new(std::time::Instant::now()),
            changing: std::sync::atomic::AtomicBool::new(false),
            log: OnceLock::new(),
            synced: std::sync::atomic::AtomicU64::new(applied.map_or(0, |l| l.index)),
            batch_applied: std::sync::atomic::AtomicU64::new(applied.map_or(0, |l| l.index)),
            divergence: Mutex::new(Divergence::default()),
            quiet_upto: std::sync::atomic::AtomicU64::new(0),
            in_flight: std::sync::atomic::AtomicBool::new(false),
            reload_wanted: std::sync::atomic::AtomicBool::new(false),
            capture_wanted: std::sync::atomic::AtomicBool::new(false),
            captured: Mutex::new(None),
            captured_ready: tokio::sync::Notify::new(),
            current: Mutex::new(None),
            rejoining: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Compares the store, having applied the batch at `index`, with the leader's digest.
    fn compare(&self, store: &dyn Store, d: &Digest, index: u64) {
        if store.has_lost() || index <= self.quiet_upto.load(std::sync::atomic::Ordering::Acquire) {
            // (Lost messages: the damage path has it, stepdown or rebuild.)
            return;
        }
        let mine = Digest::of(&store.state());
        let mut g = self.divergence.lock().unwrap_or_else(|e| e.into_inner());
        // Acted on by the count alone: a store can hold no message the log did not bring,
        // and the bounds of an empty store may differ after a snapshot install (no reason
        // to move a leader or rebuild a replica).
        if mine.msgs == d.msgs {
            g.streak = 0;
            return;
        }
        g.streak += 1;
        g.short = mine.msgs < d.msgs;
        g.what = format!(
            "at log index {index} it holds {} messages, {}..{}, the leader {}, {}..{}",
            mine.msgs, mine.first_seq, mine.last_seq, d.msgs, d.first_seq, d.last_seq
        );
    }

    /// Whether the last `DIVERGED_AFTER` checks found this store unlike the leader's:
    /// (short, how).
    fn diverged(&self) -> Option<(bool, String)> {
        let g = self.divergence.lock().unwrap_or_else(|e| e.into_inner());
        (g.streak >= DIVERGED_AFTER).then(|| (g.short, g.what.clone()))
    }

    /// A rejoining memory replica that has applied nothing yet (`Rpc::Standing`).
    pub fn is_fresh(&self) -> bool {
        self.rejoining.load(std::sync::atomic::Ordering::Acquire)
            && self.store.lock().applied().is_empty()
    }

    /// How far each follower's copy of `consumer`'s ack floor trails `floor` (the leader's
    /// own): (peer, sequences behind, seconds since the leader had the floor the follower
    /// lacks). From the floors the leader replicated and each follower's matched log index.
    pub fn ack_floor_lag(&self, consumer: &str, floor: u64) -> Vec<(String, u64, f64)> {
        let Some(raft) = self.raft.get() else {
            return Vec::new();
        };
        let m = raft.metrics().borrow().clone();
        let Some(rep) = m.replication.as_ref() else {
            return Vec::new(); // Not the leader.
        };
        let floors = self.floors.lock().unwrap_or_else(|e| e.into_inner());
        let hist = floors.get(consumer);
        let now = crate::time::now_nanos();
        let mut out = Vec::new();
        for (id, node) in m.membership_config.nodes() {
            if *id == self.node {
                continue;
            }
            let matched = rep.get(id).cloned().flatten().map_or(0, |l| l.index);
            let (mut theirs, mut behind_since) = (0, None);
            for (index, f, ts) in hist.into_iter().flatten() {
                if *index <= matched {
                    theirs = *f;
                } else if behind_since.is_none() {
                    behind_since = Some(*ts);
                }
            }
            let lag = floor.saturating_sub(theirs);
            let secs = match (lag, behind_since) {
                (0, _) | (_, None) => 0.0,
                (_, Some(ts)) => (now - ts).max(0) as f64 / 1e9,
            };
            out.push((node.name.clone(), lag, secs));
        }
        out
    }

    /// The leader committed these consumer states at log `index`.
    fn record_floors(&self, index: u64, states: &[(String, u64)]) {
        let now = crate::time::now_nanos();
        let min_matched = self
            .raft
            .get()
            .and_then(|r| {
                let m = r.metrics().borrow().clone();
                m.replication.as_ref().map(|rep| {
                    rep.values()
                        .map(|l| l.map_or(0, |l| l.index))
                        .min()
                        .unwrap_or(0)
                })
            })
            .unwrap_or(0);
        let mut floors = self.floors.lock().unwrap_or_else(|e| e.into_inner());
        for (name, floor) in states {
            let h = floors.entry(name.clone()).or_default();
            h.push_back((index, *floor, now));
            // Keep one entry every follower has (their floor), and what comes after it.
            while h.len() > 1 && h[1].0 <= min_matched {
                h.pop_front();
            }
            while h.len() > 1024 {
                h.pop_front();
            }
        }
    }

    /// Whether the store is due a sync: its log has every entry already, so the store is
    /// synced now and then (which bounds what a restart applies again), not per batch.
    fn sync_due(&self) -> bool {
        let mut last = self.last_sync.lock().unwrap_or_else(|e| e.into_inner());
        let due = last.elapsed() >= STORE_SYNC;
        if due {
            *last = std::time::Instant::now();
        }
        due
    }

    /// Syncs the store; its marker (the last applied batch) is then durable.
    fn sync_store(&self) -> Result<(), StoreError> {
        let at = unmarker(&self.store.lock().applied()).map_or(0, |l| l.index);
        self.consumers_durable()?;
        self.store.sync()?;
        self.synced
            .fetch_max(at, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }

    /// Applies a committed batch to the store (the fence held): entries already there are
    /// skipped; the store's marker becomes `log_id`.
    fn apply_batch(
        &self,
        store: &mut dyn Store,
        batch: &Batch,
        log_id: &LogId<NodeId>,
    ) -> Result<(), String> {
        for entry in &batch.entries {
            if let StreamEntry::Msg(m) = entry {
                if m.seq <= store.last_seq() {
                    continue;
                }
            }
            // Refusals (limits with discard new) are the same on every replica; a failed
            // write is not: the group stops here rather than go on with a store that lacks
            // the entry (a restart applies it again).
            match apply(store, entry) {
                Ok(Applied::Done) => {
                    if let StreamEntry::Config(cfg) = entry {
                        if let Some(s) = self.stream.get().and_then(Weak::upgrade) {
                            s.follow_config((**cfg).clone());
                        }
                    }
                }
                Err(StoreError::Io(e)) => return Err(e),
                _ => {}
            }
        }
        let _ = store.set_applied(&marker(log_id));
        Ok(())
    }

    /// The committed batches the store may hold unsynced: the log from the last sync on
    /// (an index at or below it) to the store's marker, with that marker.
    async fn unsynced_committed(&self) -> Option<(LogId<NodeId>, Vec<Entry<TypeConfig>>)> {
        use openraft::storage::RaftLogReader;
        let upto = unmarker(&self.store.lock().applied())?;
        let from = self.synced.load(std::sync::atomic::Ordering::Acquire) + 1;
        if from > upto.index {
            return Some((upto, Vec::new())); // Nothing committed since the last sync.
        }
        let mut log = self.log.get()?.clone();
        let entries = log.try_get_log_entries(from..=upto.index).await.ok()?;
        Some((upto, entries))
    }

    /// After a rollback to the last sync (the fence held): the committed batches after the
    /// store's marker applied again, up to `applied` (the marker before the rollback).
    /// An error when the entries read do not cover that span (the store is then not to be
    /// served from).
    fn redo(
        &self,
        store: &mut dyn Store,
        applied: Option<LogId<NodeId>>,
        redo: Option<(LogId<NodeId>, Vec<Entry<TypeConfig>>)>,
    ) -> Result<(), String> {
        let at = unmarker(&store.applied()).map_or(0, |l| l.index);
        let Some(applied) = applied.filter(|a| a.index > at) else {
            return Ok(()); // Nothing committed was dropped.
        };
        let Some((upto, entries)) = redo else {
            return Err("no log to apply again from".into());
        };
        let first = entries.first().map_or(u64::MAX, |e| e.log_id.index);
        if upto != applied || first > at + 1 {
            return Err("the log read does not cover the rollback".into());
        }
        for e in entries.iter().filter(|e| e.log_id.index > at) {
            if let EntryPayload::Normal(cmd) = &e.payload {
                let batch = decode(Bytes::from(cmd.0.clone()))?;
                self.apply_batch(store, &batch, &e.log_id)?;
            }
        }
        Ok(())
    }

    /// Consumer state files written without fsync (a follower's copies, the leader's
    /// saves, AckSync ones too: the group's log holds them on a quorum) are made durable
    /// before the store's marker is synced past their entries, since a restart applies the
    /// log again only after that marker. (Also before the actor's own syncs of the store:
    /// on taking the lead, at close.)
    pub fn consumers_durable(&self) -> Result<(), StoreError> {
        let Some(s) = self
            .stream
            .get()
            .and_then(Weak::upgrade)
            .filter(|s| s.storage == crate::jetstream::stream::StorageType::File)
        else {
            return Ok(()); // (A memory stream's files do not outlive it.)
        };
        self.files
            .make_durable_under(&s.dir.join("consumers"))
            .map(|_| ())
            .map_err(|e| StoreError::Io(e.to_string()))
    }

    /// Syncs the store (locked, with only committed batches in it) and takes its state.
    fn capture(&self, st: &mut dyn Store) -> Result<Captured, StoreError> {
        self.consumers_durable()?;
        if let Err(e) = st.sync() {
            // The failed sync rolled the store back past what it applied: a leader must
            // not decide on it (it would hand out sequences committed batches have), and
            // no replica may go on from it.
            self.leave();
            return Err(e);
        }
        let at = unmarker(&st.applied());
        self.synced.fetch_max(
            at.map_or(0, |l| l.index),
            std::sync::atomic::Ordering::AcqRel,
        );
        Ok((at, st.snapshot()))
    }

    /// The store's state for a snapshot: at once when no batch is in flight (a follower's
    /// store, an idle leader's), else taken by the leader's next commit.
    async fn take_state(&self) -> Result<Captured, String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            {
                let mut st = self.store.lock();
                if !self.in_flight.load(std::sync::atomic::Ordering::Acquire) {
                    return self.capture(&mut **st).map_err(|e| e.to_string());
                }
            }
            let ready = self.captured_ready.notified();
            self.capture_wanted
                .store(true, std::sync::atomic::Ordering::Release);
            let _ = tokio::time::timeout(Duration::from_millis(100), ready).await;
            if let Some(c) = self
                .captured
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                return Ok(c);
            }
            if std::time::Instant::now() > deadline {
                return Err("the store was never idle for a snapshot".into());
            }
        }
    }

    /// The durable consumers' files, for a snapshot.
    fn consumer_files(&self) -> Vec<(String, Vec<u8>, Option<Vec<u8>>)> {
        let Some(s) = self.stream.get().and_then(Weak::upgrade) else {
            return Vec::new();
        };
        let dir = s.dir.join("consumers");
        let read = |p: &std::path::Path| match self.files.read(p) {
            keel_store::MetaRead::Current(b) | keel_store::MetaRead::Older { body: b, .. } => {
                Some(b)
            }
            _ => None,
        };
        let mut out = Vec::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let d = e.path();
            if keel_store::MetaFiles::is_retired(&d) {
                continue;
            }
            if let Some(meta) = read(&d.join("meta.json")) {
                let name = e.file_name().to_string_lossy().into_owned();
                out.push((name, meta, read(&d.join("state.json"))));
            }
        }
        out
    }

    /// `Rpc::Fetch` on the leader: the messages stored in `from..=to`, up to about
    /// `max_bytes`, as a batch, and where the asker goes on from.
    pub fn serve_fetch(
        &self,
        from: u64,
        to: u64,
        max_bytes: u64,
    ) -> Result<(u64, Vec<u8>), String> {
        let st = self.store.lock();
        let mut entries = Vec::new();
        let (mut at, mut bytes) = (from, 0u64);
        while at <= to && bytes < max_bytes {
            let m = match st.load_next(at, ">") {
                Ok(m) if m.seq <= to => m,
                Ok(_) | Err(StoreError::NotFound) => {
                    at = to + 1;
                    break;
                }
                Err(e) => return Err(e.to_string()),
            };
            bytes += (m.subject.len() + m.hdr.len() + m.data.len()) as u64 + 32;
            at = m.seq + 1;
            // (`Nats-TTL: never` keeps it out of max_age on the replica too.)
            let no_max_age = keel_protocol::headers::get_str(&m.hdr, "Nats-TTL")
                .and_then(crate::jetstream::stream::decide::parse_ttl)
                .is_some_and(|t| t < 0);
            entries.push(StreamEntry::Msg(MsgEntry {
                seq: m.seq,
                ts: m.ts,
                subject: m.subject,
                hdr: m.hdr,
                data: m.data,
                rollup: None,
                no_max_age,
            }));
        }
        // The nonce says up to which log index the leader's store may have removed
        // messages these lack: digests up to there are not compared (`Shared::compare`).
        let upto = self
            .raft
            .get()
            .and_then(|r| r.metrics().borrow().last_log_index)
            .unwrap_or(u64::MAX);
        let body = encode(&Batch {
            origin: self.node,
            epoch: self.epoch,
            nonce: upto,
            entries,
            consumers: Vec::new(),
            check: None,
        });
        Ok((at, body))
    }

    /// Keeps an applied membership (the last two, on disk), and with `applied` the log
    /// position applied (a snapshot installed).
    fn record_membership(
        &self,
        m: StoredMembership<NodeId, Peer>,
        applied: Option<Option<LogId<NodeId>>>,
    ) -> Result<(), String> {
        let mut g = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = applied {
            g.0 = a;
        }
        g.1.list.push(m);
        if g.1.list.len() > 2 {
            g.1.list.remove(0);
        }
        let body = serde_json::to_vec(&g.1).map_err(|e| e.to_string())?;
        self.files
            .write(&self.memberships_file, &body, true)
            .map_err(|e| e.to_string())
    }

    /// The voters of the last membership this replica applied (so committed), if any.
    pub fn committed_voters(&self) -> Option<std::collections::BTreeSet<NodeId>> {
        let g = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        g.1.list
            .last()
            .map(|m| m.membership().voter_ids().collect())
    }

    /// The group's log's extent, once it is open.
    pub fn log_stats(&self) -> Option<super::log::LogStats> {
        self.log.get().map(|l| l.stats())
    }

    /// The server's Raft host, once the group runs.
    pub fn host(&self) -> Option<Arc<super::RaftHost>> {
        self.host.get().map(|(h, _)| h.clone())
    }

    /// Appends `body` to the group's log and waits (at most `COMMIT_TIMEOUT`) until it is
    /// committed, through the group's write gate (`RaftHost::gate`): while a leadership
    /// transfer holds it, the batch waits, then fails as any batch does at a change of leader.
    async fn write(&self, raft: &Raft, body: Vec<u8>) -> Written {
        let deadline = tokio::time::Instant::now() + COMMIT_TIMEOUT;
        let gate = self.host.get().map(|(h, g)| h.gate(g));
        let _open = match &gate {
            Some(g) => match tokio::time::timeout_at(deadline, g.read()).await {
                Ok(open) => Some(open),
                Err(_) => return Written::Not, // (Never handed to the group.)
            },
            None => None,
        };
        let Ok(mut rx) = raft.client_write_ff(Cmd(body)).await else {
            return Written::Not; // The group had stopped: it never took the batch.
        };
        match tokio::time::timeout_at(deadline, &mut rx).await {
            Ok(Ok(Ok(resp))) => Written::Committed(resp),
            // Refused by a server that was not leader, or cut from its log by a new
            // leader's (openraft answers a write whose entry is truncated so): either way
            // the entry is in no leader's log, so it never commits.
            Ok(Ok(Err(_))) => Written::Not,
            // The group stopped with the entry in its log: only the log says.
            Ok(Err(_)) => Written::Unknown(None),
            // Still in the log (openraft answers once it is applied here, committed by
            // whichever leader, or truncated): the gate is let go meanwhile.
            Err(_) => Written::Unknown(Some(rx)),
        }
    }

    /// On the leader: has its actor append an empty batch (`Rpc::Nudge`), which makes
    /// openraft replicate to every follower and so find one whose log went back.
    pub fn nudge(&self) {
        if let Some(tx) = self
            .stream
            .get()
            .and_then(Weak::upgrade)
            .and_then(|s| s.commands())
        {
            let _ = tx.try_send(crate::jetstream::stream::Command::Nudge);
        }
    }

    /// Whether the group ended (`stop_group`): no longer reachable on this server.
    fn is_stopped(&self) -> bool {
        self.host.get().is_none_or(|(h, g)| h.group(g).is_none())
    }

    /// The group's name on the transport, once the group runs.
    pub fn group_name(&self) -> Option<&str> {
        self.host.get().map(|(_, g)| g.as_str())
    }

    /// This replica's store could not be written (or lost what it applied): it stops
    /// serving and leaves the group to the others; its watcher then loads it again from
    /// its files (`reload`), which applies its log again from the store's marker.
    fn leave_to_reload(&self, raft: &Raft) {
        self.set_fenced();
        self.reload_wanted
            .store(true, std::sync::atomic::Ordering::Release);
        let raft = raft.clone();
        let log = self.log.get().cloned();
        tokio::spawn(async move {
            let _ = raft.shutdown().await;
            if let Some(l) = log {
                l.close().await;
            }
        });
    }

    /// `leave_to_reload` once the group runs; before, only fenced.
    fn leave(&self) {
        match self.raft.get() {
            Some(raft) => self.leave_to_reload(raft),
            None => self.set_fenced(),
        }
    }

    /// Closes the group's log (its node has stopped).
    pub async fn close_log(&self) {
        if let Some(l) = self.log.get() {
            l.close().await;
        }
    }

    /// Ends the group (the stream is being deleted): no longer reachable, openraft's tasks
    /// stopped, the watcher ended.
    pub async fn stop_group(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.set_fenced();
        self.stop.notify_one();
        if let Some((host, group)) = self.host.get() {
            host.remove_group(group);
        }
        if let Some(r) = self.raft.get() {
            let _ = r.shutdown().await;
        }
        self.close_log().await;
    }

    fn fence(&self) -> std::sync::MutexGuard<'_, Fence> {
        self.fence.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets the leader decide again (it is leader, its log all applied).
    pub fn unfence(&self) {
        self.fenced
            .store(false, std::sync::atomic::Ordering::Release);
        self.leadership.notify_waiters();
    }

    pub fn set_fenced(&self) {
        self.fenced
            .store(true, std::sync::atomic::Ordering::Release);
        self.fenced_set.notify_waiters();
        self.leadership.notify_waiters();
    }

    /// Resolves once this replica decides nothing more (it stopped leading).
    pub async fn until_fenced(&self) {
        loop {
            let set = self.fenced_set.notified();
            tokio::pin!(set);
            // Registered before the look: a `set_fenced` in between is not missed.
            set.as_mut().enable();
            if self.is_fenced() {
                return;
            }
            set.await;
        }
    }

    /// Whether this replica's store may answer reads (direct gets) itself: not once it
    /// left its group (its store is not to be trusted), nor while its votes are held (a
    /// restarted memory replica being refilled, a log that lost acknowledged entries),
    /// which would answer "not found" for messages the stream has.
    pub fn serves_reads(&self) -> bool {
        match self.host.get() {
            Some((h, g)) => h.group(g).is_some() && !h.votes_held(g),
            None => false,
        }
    }

    pub fn is_fenced(&self) -> bool {
        self.fenced.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The replicated stream's state machine.
#[derive(Clone)]
pub struct StreamMachine(pub Arc<Shared>);

fn sm_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write_state_machine(&std::io::Error::other(e.to_string())).into()
}

impl RaftSnapshotBuilder<TypeConfig> for StreamMachine {
    /// The store's state at a synced marker (so the log before it can go) and the
    /// consumers' files; small whatever the stream's size.
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let sh = &self.0;
        let (at, st) = match sh.take_state().await {
            Ok(c) => c,
            Err(e) => {
                // Building again later is fine; the last one still stands.
                let g = sh.current.lock().unwrap_or_else(|e| e.into_inner());
                return match g.as_ref() {
                    Some((meta, data)) => Ok(Snapshot {
                        meta: meta.clone(),
                        snapshot: Box::new(Cursor::new(data.clone())),
                    }),
                    None => Err(sm_err(e)),
                };
            }
        };
        let snap = StreamSnap {
            first_seq: st.first_seq,
            last_seq: st.last_seq,
            last_ts: st.last_ts,
            deleted: st.deleted,
            consumers: sh.consumer_files(),
            config: sh
                .stream
                .get()
                .and_then(Weak::upgrade)
                .map(|s| (*s.config()).clone()),
        };
        let data = serde_json::to_vec(&snap).map_err(sm_err)?;
        let membership = {
            let g = sh.applied.lock().unwrap_or_else(|e| e.into_inner());
            g.1.list
                .iter()
                .rev()
                .find(|m| m.log_id().as_ref() <= at.as_ref())
                .cloned()
                .unwrap_or_default()
        };
        let meta = SnapshotMeta {
            last_log_id: at,
            last_membership: membership,
            snapshot_id: format!("{}-{}", at.map_or(0, |l| l.index), rand::random::<u32>()),
        };
        *sh.current.lock().unwrap_or_else(|e| e.into_inner()) = Some((meta.clone(), data.clone()));
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StreamMachine {
    type SnapshotBuilder = StreamMachine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, Peer>), StorageError<NodeId>> {
        let g = self.0.applied.lock().unwrap_or_else(|e| e.into_inner());
        let applied = g.0;
        let membership =
            g.1.list
                .iter()
                .rev()
                .find(|m| m.log_id().as_ref() <= applied.as_ref())
                .cloned()
                .unwrap_or_default();
        Ok((applied, membership))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<CmdResult>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + openraft::OptionalSend,
        I::IntoIter: openraft::OptionalSend,
    {
        let sh = &self.0;
        let mut out = Vec::new();
        let mut wrote = false;
        let mut last = None;
        let entries: Vec<_> = entries.into_iter().collect();
        // openraft counts a leader's own append before its fsync (`log::LogStore::append`),
        // so it may call an entry committed while this server's copy is not on disk yet:
        // nothing is applied (and so no client answered, no marker moved, no snapshot taken
        // past it) until it is. (A follower's entries are on disk before it answers.)
        if let (Some(l), Some(log)) = (entries.last(), sh.log.get()) {
            let upto = Some(l.log_id);
            let mut on_disk = log.flushed();
            let durable = match on_disk.wait_for(|d| d.failed || d.last >= upto).await {
                Ok(d) => !d.failed,
                Err(_) => false,
            };
            if !durable {
                return Err(sm_err("the log could not make its entries durable"));
            }
        }
        for e in entries {
            last = Some(e.log_id);
            match e.payload {
                EntryPayload::Blank => {}
                EntryPayload::Membership(m) => {
                    sh.record_membership(StoredMembership::new(Some(e.log_id), m), None)
                        .map_err(sm_err)?;
                }
                EntryPayload::Normal(cmd) => {
                    // An entry this version cannot read is reported: the group stops
                    // rather than skip it.
                    let batch = decode(Bytes::from(cmd.0)).map_err(sm_err)?;
                    let mut fence = sh.fence();
                    let mut store = sh.store.lock();
                    let at = unmarker(&store.applied()).map_or(0, |l| l.index);
                    let before = sh.batch_applied.load(std::sync::atomic::Ordering::Acquire);
                    if at < before {
                        return Err(sm_err(format!(
                            "the store went back to log index {at} after the state machine applied {before} (a failed sync rolled it back)"
                        )));
                    }
                    sh.apply_batch(&mut **store, &batch, &e.log_id)
                        .map_err(sm_err)?;
                    sh.batch_applied
                        .store(e.log_id.index, std::sync::atomic::Ordering::Release);
                    // Seen only once in the store: a leader's failed commit takes a batch
                    // the state machine refused for not committed (and answers no one).
                    if batch.origin == sh.node && batch.epoch == sh.epoch {
                        fence.applied_nonce = fence.applied_nonce.max(batch.nonce);
                    }
                    // (A leader's own batch of this run: its store is ahead of it.)
                    let own = batch.origin == sh.node && batch.epoch == sh.epoch;
                    if let (Some(d), false) = (&batch.check, own) {
                        sh.compare(&**store, d, e.log_id.index);
                    }
                    wrote = true;
                    drop(store);
                    drop(fence);
                    // A leader's own consumers write their own files.
                    let own = batch.origin == sh.node && batch.epoch == sh.epoch;
                    if !own && !batch.consumers.is_empty() {
                        if let Some(s) = sh.stream.get().and_then(Weak::upgrade) {
                            for c in &batch.consumers {
                                follow_consumer(&sh.files, &s.dir, c);
                            }
                        }
                    }
                }
            }
            out.push(CmdResult::default());
        }
        if let Some(l) = last {
            sh.applied.lock().unwrap_or_else(|e| e.into_inner()).0 = Some(l);
        }
        if wrote {
            let leading = sh.raft.get().is_some_and(|r| {
                let m = r.metrics().borrow().clone();
                m.state == openraft::ServerState::Leader
            });
            if !leading {
                // A follower's store: synced with its marker now and then (the log has the
                // entries already; this bounds what a restart applies again, and a server
                // that becomes leader syncs first). A failed sync rolled the store back:
                // the group stops rather than apply on top of it.
                if sh.sync_due() {
                    sh.sync_store().map_err(sm_err)?;
                }
                if let Some(s) = sh.stream.get().and_then(Weak::upgrade) {
                    s.follow_applied();
                }
            }
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> StreamMachine {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    /// A replica behind the leader's log: its store brought in line with the snapshot
    /// (`Store::restore`), the messages it lacks fetched from the leader, the consumers'
    /// files written, all synced with the snapshot's position as the marker.
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Peer>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let sh = &self.0;
        let snap: StreamSnap = serde_json::from_slice(snapshot.get_ref()).map_err(sm_err)?;
        let state = keel_store::Snapshot {
            first_seq: snap.first_seq,
            last_seq: snap.last_seq,
            last_ts: snap.last_ts,
            deleted: snap.deleted,
        };
        sh.divergence
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .streak = 0;
        let missing = sh.store.lock().restore(&state).map_err(sm_err)?;
        let (host, group) = sh
            .host
            .get()
            .cloned()
            .ok_or_else(|| sm_err("no Raft host"))?;
        for (a, b) in missing {
            let mut from = a;
            let mut tries = 0;
            while from <= b {
                // The leader is the one sending the snapshot. (Named from the snapshot's
                // membership when this replica's log is empty and knows none yet.)
                let leader = sh.raft.get().and_then(|r| {
                    let m = r.metrics().borrow().clone();
                    let l = m.current_leader?;
                    super::member_name(&m, l).or_else(|| {
                        meta.last_membership
                            .nodes()
                            .find(|(n, _)| **n == l)
                            .map(|(_, p)| p.name.clone())
                    })
                });
                let got = match leader {
                    Some(l) => host.fetch(&l, &group, from, b).await,
                    None => Err("no leader".to_string()),
                };
                let (next, body) = match got {
                    Ok(r) => r,
                    Err(e) => {
                        tries += 1;
                        if tries > 30 {
                            return Err(sm_err(format!("fetching messages {from}..={b}: {e}")));
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                let batch = decode(Bytes::from(body)).map_err(sm_err)?;
                sh.quiet_upto
                    .fetch_max(batch.nonce, std::sync::atomic::Ordering::AcqRel);
                let mut st = sh.store.lock();
                for e in &batch.entries {
                    match e {
                        StreamEntry::Msg(m) if m.seq >= from && m.seq <= b => {
                            apply(&mut **st, e).map_err(sm_err)?;
                        }
                        _ => {}
                    }
                }
                drop(st);
                from = next.max(from + 1);
            }
        }
        {
            let mut st = sh.store.lock();
            st.skip_to(snap.last_seq + 1).map_err(sm_err)?;
            if let Some(cfg) = &snap.config {
                st.set_limits(cfg.limits()).map_err(sm_err)?;
            }
            if let Some(l) = &meta.last_log_id {
                st.set_applied(&marker(l)).map_err(sm_err)?;
                sh.batch_applied
                    .store(l.index, std::sync::atomic::Ordering::Release);
            }
            sh.capture(&mut **st).map_err(sm_err)?;
        }
        if let Some(s) = sh.stream.get().and_then(Weak::upgrade) {
            if let Some(cfg) = snap.config.clone() {
                s.follow_config(cfg);
            }
            let dir = s.dir.join("consumers");
            let keep: std::collections::HashSet<&str> =
                snap.consumers.iter().map(|(n, _, _)| n.as_str()).collect();
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !keep.contains(name.as_str()) {
                    let _ = sh.files.retire_dir(&e.path());
                }
            }
            for (name, meta, state) in &snap.consumers {
                let d = dir.join(name);
                sh.files.create_dir_all(&d).map_err(sm_err)?;
                sh.files
                    .write(&d.join("meta.json"), meta, true)
                    .map_err(sm_err)?;
                if let Some(state) = state {
                    sh.files
                        .overwrite(&d.join("state.json"), state, true)
                        .map_err(sm_err)?;
                }
            }
            s.follow_applied();
        }
        sh.record_membership(meta.last_membership.clone(), Some(meta.last_log_id))
            .map_err(sm_err)?;
        *sh.current.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((meta.clone(), snapshot.into_inner()));
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let g = self.0.current.lock().unwrap_or_else(|e| e.into_inner());
        Ok(g.as_ref().map(|(meta, data)| Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(data.clone())),
        }))
    }
}

/// A follower keeps its copy of a consumer's files, from which it starts the consumer
/// when it becomes the stream's leader.
fn follow_consumer(files: &keel_store::MetaFiles, stream_dir: &std::path::Path, c: &ConsumerEntry) {
    let dir = |name: &str| stream_dir.join("consumers").join(name);
    match c {
        ConsumerEntry::Create { name, meta } => {
            let d = dir(name);
            // (An ephemeral consumer's is not synced, as on the leader.)
            let durable = serde_json::from_slice::<serde_json::Value>(meta)
                .map_or(true, |v| !v["config"]["durable_name"].is_null());
            if files.create_dir_all(&d).is_ok() {
                let _ = files.write(&d.join("meta.json"), meta, durable);
            }
        }
        ConsumerEntry::State { name, state, .. } => {
            let d = dir(name);
            if d.join("meta.json").exists() {
                // Not fsynced: the group's log holds it, and a restart applies it again
                // (from the store's marker, which is synced only after this file is:
                // `Shared::consumers_durable`).
                let _ = files.overwrite(&d.join("state.json"), state, false);
            }
        }
        ConsumerEntry::Delete { name } => {
            let _ = files.retire_dir(&dir(name));
        }
    }
}

/// What became of a batch written to the group's log.
enum Written {
    Committed(openraft::raft::ClientWriteResponse<TypeConfig>),
    /// It is in no log that can commit it.
    Not,
    /// Not known yet (nor ever, without the receiver): it may commit later.
    Unknown(Option<WriteRx>),
}

type WriteRx = tokio::sync::oneshot::Receiver<openraft::raft::ClientWriteResult<TypeConfig>>;

/// How long the publishers of a batch whose commit outcome was not known in
/// `COMMIT_TIMEOUT` may still be answered (`Replicator::take_uncertain`).
const FATE_WAIT: Duration = Duration::from_secs(30);

/// The leader's side: apply early, commit = a quorum has the batch on disk.
pub struct RaftReplicator {
    shared: Arc<Shared>,
    batch: Vec<StreamEntry>,
    consumers: Vec<ConsumerEntry>,
    nonce: u64,
    /// The store refused a write since the last commit (a full disk).
    store_failed: bool,
    /// When a batch last carried a `Digest`.
    last_check: std::time::Instant,
    /// The last failed commit's batch, whose outcome was not known yet.
    uncertain: Option<WriteRx>,
}

impl RaftReplicator {
    pub fn new(shared: Arc<Shared>) -> RaftReplicator {
        RaftReplicator {
            shared,
            batch: Vec::new(),
            consumers: Vec::new(),
            nonce: 0,
            store_failed: false,
            last_check: std::time::Instant::now(),
            uncertain: None,
        }
    }
}

/// A batch without a quorum (not a storage failure: the store is fine).
fn unavailable() -> StoreError {
    StoreError::Unsupported("JetStream system temporarily unavailable")
}

impl Replicator for RaftReplicator {
    async fn nudge(&mut self) {
        // (A batch about to commit replicates anyway.)
        if !self.batch.is_empty() || !self.consumers.is_empty() {
            return;
        }
        let Some(raft) = self.shared.raft.get().cloned() else {
            return;
        };
        let body = encode(&Batch {
            origin: self.shared.node,
            epoch: self.shared.epoch,
            nonce: 0,
            entries: Vec::new(),
            consumers: Vec::new(),
            check: None,
        });
        let _ = self.shared.write(&raft, body).await;
    }

    fn propose(
        &mut self,
        store: &mut dyn Store,
        entry: &StreamEntry,
    ) -> Result<Applied, StoreError> {
        if self.shared.is_fenced() {
            return Err(StoreError::Unsupported("not the stream's leader"));
        }
        // Set with the store locked (the actor holds it), before the entry is in it.
        self.shared
            .in_flight
            .store(true, std::sync::atomic::Ordering::Release);
        let r = apply(store, entry);
        if r.is_ok() {
            self.batch.push(entry.clone());
        } else if matches!(r, Err(StoreError::Io(_))) {
            // The next commit hands the group over (`commit_batch`).
            self.store_failed = true;
        } else if self.batch.is_empty() {
            // A refused entry has no effect: nothing is in flight yet.
            self.shared
                .in_flight
                .store(false, std::sync::atomic::Ordering::Release);
        }
        r
    }

    fn is_leader(&self) -> bool {
        !self.shared.is_fenced()
    }

    fn has_uncommitted(&self) -> bool {
        !self.batch.is_empty() || !self.consumers.is_empty()
    }

    fn propose_consumer(&mut self, entry: ConsumerEntry) -> bool {
        if self.shared.is_fenced() {
            return false;
        }
        self.consumers.push(entry);
        true
    }

    fn take_uncertain(&mut self) -> Option<Uncertain> {
        let rx = self.uncertain.take()?;
        Some(Box::pin(async move {
            match tokio::time::timeout(FATE_WAIT, rx).await {
                Ok(Ok(Ok(_))) => Some(true),
                Ok(Ok(Err(_))) => Some(false),
                _ => None,
            }
        }))
    }

    async fn commit(&mut self, store: &WriteHandle, force: bool) -> Result<(), StoreError> {
        self.uncertain = None;
        let r = self.commit_batch(store, force).await;
        // Committed, or rolled back: only committed batches are in the store now.
        if self
            .shared
            .capture_wanted
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            let c = self.shared.capture(&mut **store.lock());
            if let Ok(c) = c {
                *self
                    .shared
                    .captured
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(c);
            }
            self.shared.captured_ready.notify_waiters();
        }
        self.shared
            .in_flight
            .store(false, std::sync::atomic::Ordering::Release);
        r
    }
}

impl RaftReplicator {
    async fn commit_batch(&mut self, store: &WriteHandle, force: bool) -> Result<(), StoreError> {
        if std::mem::take(&mut self.store_failed) {
            // This leader's store could not take a write (a full disk): a leader that
            // cannot store what its group commits would refuse every publish while a
            // replica with room could lead. What the batch holds is committed nowhere: it
            // goes with the store's unsynced writes, and the replica leaves the group to
            // be loaded again from its files.
            self.batch.clear();
            self.consumers.clear();
            let _ = store.lock().discard_unsynced();
            self.shared.leave();
            return Err(unavailable());
        }
        {
            if self.batch.is_empty() && self.consumers.is_empty() {
                return Ok(());
            }
            self.nonce += 1;
            let nonce = self.nonce;
            let floors: Vec<(String, u64)> = self
                .consumers
                .iter()
                .filter_map(|c| match c {
                    ConsumerEntry::State {
                        name, ack_floor, ..
                    } => Some((name.clone(), *ack_floor)),
                    _ => None,
                })
                .collect();
            // The store holds this batch's entries (applied early) and every batch before
            // it, nothing after: what each replica's must hold once it applied the batch.
            let check = if self.last_check.elapsed() >= CHECK_EVERY {
                self.last_check = std::time::Instant::now();
                let st = store.lock();
                (!st.has_lost()).then(|| Digest::of(&st.state()))
            } else {
                None
            };
            let body = encode(&Batch {
                origin: self.shared.node,
                epoch: self.shared.epoch,
                nonce,
                entries: std::mem::take(&mut self.batch),
                consumers: std::mem::take(&mut self.consumers),
                check,
            });
            let Some(raft) = self.shared.raft.get().cloned() else {
                let _ = store.lock().discard_unsynced();
                self.shared.set_fenced();
                return Err(unavailable());
            };
            let r = self.shared.write(&raft, body).await;
            match r {
                Written::Committed(resp) => {
                    if !floors.is_empty() {
                        self.shared.record_floors(resp.log_id.index, &floors);
                    }
                    // A quorum's logs have the batch on disk: that is the PubAck's promise.
                    // The store (only committed batches in it now) is synced now and then.
                    if !force && !self.shared.sync_due() {
                        return Ok(());
                    }
                    let r = self.shared.sync_store();
                    if r.is_err() {
                        // Committed on a quorum but not in this store any more (the sync
                        // rolled it back).
                        self.shared.leave_to_reload(&raft);
                    }
                    r
                }
                failed => {
                    // The rollback drops the committed batches not synced yet too: they are
                    // read from the log first and applied again after it.
                    let redo = self.shared.unsynced_committed().await;
                    let fence = self.shared.fence();
                    if fence.applied_nonce >= nonce {
                        // Committed after all: the state machine saw it.
                        drop(fence);
                        return self.shared.sync_store();
                    }
                    // (The fence held over the rollback: the state machine applies this
                    // batch, should it commit after all, before or after it, not during.)
                    let rolled_back = {
                        let mut st = store.lock();
                        let applied = unmarker(&st.applied());
                        st.discard_unsynced().is_ok()
                            && self.shared.redo(&mut **st, applied, redo).is_ok()
                    };
                    self.shared.set_fenced();
                    drop(fence);
                    // Should it still commit, the state machine puts it back in the store
                    // and openraft says so: its publishers are answered then.
                    if let Written::Unknown(Some(rx)) = failed {
                        self.uncertain = Some(rx);
                    }
                    if !rolled_back {
                        // The uncommitted batch is still in the store, or the committed
                        // batches after the last sync are not back in it: this replica must
                        // not serve from it (and its state machine takes no further batch).
                        self.shared.leave_to_reload(&raft);
                    }
                    Err(unavailable())
                }
            }
        }
    }
}

/// The JetStream of the stream's account.
fn account_js(
    server: &crate::server::Server,
    s: &Stream,
) -> Option<Arc<crate::jetstream::JetStream>> {
    server
        .jetstream
        .get()
        .and_then(|j| j.account(&s.account().name).cloned())
}

/// How often a leader whose store has damaged messages tries to hand leadership over.
const LOST_STEPDOWN_EVERY: Duration = Duration::from_secs(30);

/// Reads every message of a replica's store once, a chunk at a time in the background, so
/// that damage is found by the checksums now (and the replica rebuilt from a peer) rather
/// than when it is read or leads. Each chunk holds the store's lock (the group's applies
/// wait meanwhile), so the scrub rests at least as long as its last chunk took: at most
/// half the store's time, and less of the disk when reads are slow (a cold start).
async fn scrub(shared: Arc<Shared>) {
    let mut at = 0u64;
    let mut ra = keel_store::ReadAhead::default();
    loop {
        let started = std::time::Instant::now();
        let done = {
            let st = shared.store.lock();
            let mut bytes = 0usize;
            loop {
                match st.load_next_ahead(at, ">", &mut ra) {
                    Ok(m) => {
                        at = m.seq + 1;
                        bytes += m.subject.len() + m.hdr.len() + m.data.len() + 32;
                        if bytes >= SCRUB_CHUNK {
                            break false;
                        }
                    }
                    Err(StoreError::NotFound) => break true,
                    // (A damaged record is skipped by the read itself; anything else ends it.)
                    Err(_) => break true,
                }
            }
        };
        if done || shared.is_stopped() {
            return;
        }
        tokio::time::sleep(started.elapsed().max(Duration::from_millis(2))).await;
    }
}

/// How much a scrub reads per hold of the store's lock.
const SCRUB_CHUNK: usize = 256 * 1024;

/// Starts `rebuild` of this replica (its votes held until it is back to `upto`).
fn spawn_rebuild(
    server: &Arc<crate::server::Server>,
    stream: &Weak<Stream>,
    group: &str,
    upto: Option<u64>,
) {
    if let Some(s) = stream.upgrade() {
        if let Some(js) = account_js(server, &s) {
            tokio::spawn(rebuild(
                server.clone(),
                js,
                s.name.clone(),
                group.to_string(),
                upto.unwrap_or(0),
            ));
        }
    }
}

/// What the store and the log set aside as damaged (`damaged-*` files) is kept for the
/// operator when the replica goes: moved to `<account>/damaged/<stream>-<ns>/`.
fn keep_damaged(js: &crate::jetstream::JetStream, name: &str) {
    let Some(account_dir) = js.streams_dir.parent() else {
        return;
    };
    let to = account_dir
        .join("damaged")
        .join(format!("{name}-{}", crate::time::now_nanos()));
    let mut todo = vec![js.streams_dir.join(name)];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let file = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                todo.push(p);
            } else if file.starts_with("damaged-") {
                let _ = js.meta.create_dir_all(&to);
                let _ = js.meta.rename(&p, &to.join(&file));
            }
        }
    }
}

/// A follower whose store lost messages to damage: its replica goes and a new one is made
/// from the assignment, which the leader fills (from its log, or a snapshot and its
/// messages), as for a server added to the group. The new log starts empty, so this
/// server's votes are held until it is back to `upto` (see `RaftHost::hold_votes`).
async fn rebuild(
    server: Arc<crate::server::Server>,
    js: Arc<crate::jetstream::JetStream>,
    name: String,
    group: String,
    upto: u64,
) {
    let Some(meta) = server.jetstream.get().and_then(|j| j.meta.get()).cloned() else {
        return;
    };
    crate::error!(
        server.log,
        "JetStream stream '{} > {}': messages on this replica are damaged; it is rebuilt from the leader",
        js.account.name,
        name
    );
    keep_damaged(&js, &name);
    let mut router = crate::router::Router::new(js.account.clone(), 0x5242);
    if let Err(e) =
        crate::jetstream::registry::delete_stream(&js, &server, &mut router, &name).await
    {
        crate::warn!(server.log, "JetStream stream '{name}': rebuild: {e:?}");
        return;
    }
    // The old group's instance ends on its own task: the new one is registered only after
    // (the group's name is the same).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while meta.host.group(&group).is_some() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    meta.host.hold_votes(&group, upto);
    let Some(a) = meta.assignment(&js.account.name, &name) else {
        return;
    };
    let body = serde_json::to_vec(&a.config).unwrap_or_default();
    match crate::jetstream::api::streams::create(&js, &server, &mut router, &name, &body).await {
        Ok(_) => {
            crate::info!(
                server.log,
                "JetStream stream '{} > {name}': new replica made, catching up from the leader",
                js.account.name
            );
            // Until the leader has refilled it (see `Rpc::Nudge`).
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while meta.host.votes_held(&group) && std::time::Instant::now() < deadline {
                // (By id: an empty log knows no membership, so no names yet.)
                let leader = meta
                    .host
                    .group(&group)
                    .and_then(|r| r.metrics().borrow().current_leader)
                    .and_then(|id| a.peers.iter().find(|p| super::node_id(p) == id));
                if let Some(l) = leader.filter(|l| **l != server.server_name) {
                    meta.host.nudge(l, &group).await;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Err(e) => crate::error!(
            server.log,
            "JetStream stream '{} > {name}': rebuild could not make the replica again: {}",
            js.account.name,
            e.description
        ),
    }
    router.flush();
}

/// A replica whose group stopped on a log failure: after `wait`, the stream is taken off
/// this server (its files kept), its store closed, and opened again from its files, as at a
/// restart: its log's recovery cuts what was not synced, and the new group catches up from
/// the leader (or, failing again, comes back here later).
async fn reload(
    server: Arc<crate::server::Server>,
    js: Arc<crate::jetstream::JetStream>,
    host: Arc<super::RaftHost>,
    group: String,
    name: String,
    wait: Duration,
) {
    let mut shutdown = server.shutdown_rx();
    tokio::select! {
        _ = tokio::time::sleep(wait) => {}
        _ = shutdown.wait_for(|s| *s) => return,
    }
    let Some(old) = js.stream(&name) else {
        return;
    };
    let dir = js.streams_dir.join(&name);
    let mut router = crate::router::Router::new(js.account.clone(), 0x524c);
    crate::jetstream::registry::unload_stream(&js, &server, &mut router, &name).await;
    router.flush();
    if tokio::time::timeout(Duration::from_secs(10), old.closed())
        .await
        .is_err()
    {
        crate::error!(
            server.log,
            "JetStream stream '{} > {name}': its store did not close; the replica stays off until a restart",
            js.account.name
        );
        return;
    }
    drop(old);
    // Opening writes too (its recovery cuts what was not synced): on a disk still full it
    // is tried again, less and less often, until it opens, the server stops, or the stream
    // was made again meanwhile (a delete and a create).
    loop {
        let opened = crate::jetstream::stream::meta::read_meta(&js.meta, &dir, &server.log)
            .and_then(|meta| {
                crate::jetstream::stream::Stream::open(
                    &server,
                    &js.account,
                    &dir,
                    meta,
                    &js.settings(),
                )
            });
        match opened {
            Ok(s) => {
                js.registry.insert_stream(&js.account.name, s.clone());
                s.start_sources();
                crate::info!(
                    server.log,
                    "JetStream stream '{} > {name}': replica loaded again from its files",
                    js.account.name
                );
                return;
            }
            Err(e) => {
                let again = host.reload_wait(&group);
                crate::error!(
                    server.log,
                    "JetStream stream '{} > {name}': could not be loaded again ({e}); trying again in {again:?}",
                    js.account.name
                );
                tokio::select! {
                    _ = tokio::time::sleep(again) => {}
                    _ = shutdown.wait_for(|s| *s) => return,
                }
            }
        }
        if js.stream(&name).is_some() || !dir.exists() {
            return;
        }
    }
}

/// Starts a replicated stream's group on this server (once the cluster's Raft host is up:
/// at start the stream is recovered before the meta group starts), forms it if this server
/// made the stream, then follows leadership: the ready leader subscribes and decides, a
/// server that stops leading unsubscribes and is fenced.
pub async fn run_group(
    server: Arc<crate::server::Server>,
    stream: Weak<Stream>,
    shared: Arc<Shared>,
    spec: GroupSpec,
    bootstrap: bool,
    dir: std::path::PathBuf,
) {
    let mut shutdown = server.shutdown_rx();
    let host = loop {
        if let Some(m) = server.jetstream.get().and_then(|j| j.meta.get()) {
            break m.host.clone();
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = shutdown.changed() => return,
        }
    };
    // A memory stream's log is in memory too: a PubAck means a quorum holds the message,
    // not that it is on disk (as with the reference's memory streams).
    let memory = stream
        .upgrade()
        .is_some_and(|s| s.storage == crate::jetstream::stream::StorageType::Memory);
    // A log that cannot be opened (a full disk while recovery cuts a torn tail, or its old
    // node, after a reload, still holding the directory) is tried again, less and less
    // often, until it opens, the stream is gone or the server stops.
    let log = loop {
        if shared.stopped.load(std::sync::atomic::Ordering::SeqCst) || stream.upgrade().is_none() {
            return;
        }
        let opened = if memory {
            Ok(Box::new(super::log::MemBackend::default()) as Box<dyn super::log::LogBackend>)
        } else {
            let what = format!("JetStream stream group {} log", spec.group);
            super::log::open_logged(&server, &host, &spec.group, &dir.join("log"), &what, None)
                .map(|backend| Box::new(backend) as Box<dyn super::log::LogBackend>)
        };
        match opened.and_then(|b| super::log::LogStore::open(b, false, Some(shared.node))) {
            Ok(l) => break l,
            Err(e) => {
                let again = host.reload_wait(&spec.group);
                crate::error!(
                    server.log,
                    "JetStream stream group {}: log: {e} (trying again in {} s)",
                    spec.group,
                    again.as_secs()
                );
                tokio::select! {
                    _ = tokio::time::sleep(again) => {}
                    _ = shutdown.changed() => return,
                }
            }
        }
    };
    let rejoining = memory
        && stream
            .upgrade()
            .and_then(|s| account_js(&server, &s))
            .is_some_and(|js| js.registry.is_rejoining(&spec.group));
    // Until it knows where its peers stand: see `rejoin`.
    let hold = rejoining.then(|| host.hold(&spec.group, u64::MAX));
    shared
        .rejoining
        .store(rejoining, std::sync::atomic::Ordering::Release);
    let _ = shared.log.set(log.clone());
    let raft = match Raft::new(
        shared.node,
        super::config(&spec.group, memory),
        host.network(&spec.group, Some(log.flushed())),
        log,
        StreamMachine(shared.clone()),
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            // It could not start on its log (its vote could not be written: a full disk).
            // As after any storage error, the replica is loaded again from its files,
            // until it starts, instead of staying without a group until a restart.
            shared.close_log().await;
            if !shared.stopped.load(std::sync::atomic::Ordering::SeqCst) {
                let why = format!("its Raft group could not start ({e})");
                reload_later(&server, &host, &stream, &spec.group, &why);
            }
            return;
        }
    };
    let _ = shared.raft.set(raft.clone());
    shared.leadership.notify_waiters();
    // A `stop_group` that came while the log was being opened found no node to stop.
    if shared.stopped.load(std::sync::atomic::Ordering::SeqCst) {
        let _ = raft.shutdown().await;
        shared.close_log().await;
        return;
    }
    let _ = shared.host.set((host.clone(), spec.group.clone()));
    host.add_store(&spec.group, &shared);
    host.add_group(&spec.group, raft.clone());
    host.guard_votes(&spec.group, &raft);
    // (A memory log is "on disk" once written: nothing is held back.)
    if let Some(log) = shared.log.get().filter(|_| !memory) {
        tokio::spawn(carry_commit(raft.clone(), log.flushed()));
    }
    if let Some((hold, s)) = hold.zip(stream.upgrade()) {
        server.spawn(rejoin(
            server.clone(),
            raft.clone(),
            host.clone(),
            (s.account().name.clone(), s.name.clone()),
            spec.group.clone(),
            hold,
        ));
    }
    if bootstrap {
        let members: std::collections::BTreeMap<NodeId, Peer> = spec
            .peers
            .iter()
            .map(|n| (super::node_id(n), Peer { name: n.clone() }))
            .collect();
        let _ = raft.initialize(members).await;
    }
    let mut metrics = raft.metrics();
    let mut ready = false;
    // Damage: a scrub of the store once there is a leader to fetch from, and when the
    // store has lost messages a leader's stepdown (at most every LOST_STEPDOWN_EVERY) or a
    // follower's rebuild.
    let mut scrubbed = false;
    // When this replica last asked for the group's leadership to move (damage, digests).
    let mut handed_over: Option<std::time::Instant> = None;
    // (Looked at now and then, not at every metrics change: those come with every batch.)
    let mut damage_checked = std::time::Instant::now() - Duration::from_secs(1);
    let mut assignment_checked = damage_checked;
    let mut membership_seen = None;
    // Why the watch ended: the group stopped (a storage error, `stop_group`, the stream
    // gone), so its node stops and its log is closed here; or the server stops, which
    // stops every group (`RaftHost::shutdown`), or a rebuild takes the replica over.
    let mut stopping = false;
    loop {
        let m = metrics.borrow_and_update().clone();
        let failed = match &m.running_state {
            Err(openraft::error::Fatal::StorageError(e)) => {
                Some(format!("its Raft group stopped on a storage error ({e})"))
            }
            Err(_)
                if shared
                    .reload_wanted
                    .swap(false, std::sync::atomic::Ordering::AcqRel) =>
            {
                Some("its store could not be written".to_string())
            }
            _ => None,
        };
        if let Some(why) = failed {
            // Its log could not be written (a full disk): openraft stopped the group. The
            // replica is loaded again from its files (what was synced), as at a restart,
            // and catches up from the leader; until then the others go on without it.
            reload_later(&server, &host, &stream, &spec.group, &why);
            stopping = true;
            break;
        }
        let voters = m.membership_config.voter_ids().count();
        let follower_of = m.current_leader.filter(|l| *l != shared.node && voters > 1);
        if follower_of.is_some() && !scrubbed {
            scrubbed = true;
            tokio::spawn(scrub(shared.clone()));
        }
        let check = damage_checked.elapsed() >= Duration::from_millis(250);
        if check {
            damage_checked = std::time::Instant::now();
        }
        // Damage (lost messages) or a store unlike the leader's at the same log index
        // (`Digest`): a leader with damage hands the group over (at most every
        // LOST_STEPDOWN_EVERY); a follower with damage, or that lacks messages its leader
        // holds, is rebuilt from the leader; one that holds messages its leader lacks
        // stands for election (as often), so the leader, a follower then, finds itself
        // short and is rebuilt in turn.
        if check && voters > 1 {
            let damaged = shared.store.lock().has_lost();
            let diverged = follower_of.and_then(|_| shared.diverged());
            let due = handed_over.is_none_or(|t| t.elapsed() > LOST_STEPDOWN_EVERY);
            if damaged && super::leads(&m) {
                if due {
                    handed_over = Some(std::time::Instant::now());
                    crate::warn!(
                        server.log,
                        "JetStream stream group {}: this leader's store has damaged messages; it hands leadership over to be rebuilt",
                        spec.group
                    );
                    let (raft, host) = (raft.clone(), host.clone());
                    tokio::spawn(async move {
                        let _ = super::step_down(&host, &raft).await;
                    });
                }
            } else if follower_of.is_some() && (damaged || diverged.as_ref().is_some_and(|d| d.0)) {
                if let (false, Some((_, what))) = (damaged, &diverged) {
                    crate::error!(
                        server.log,
                        "JetStream stream group {}: this replica lacks messages its leader holds ({what})",
                        spec.group
                    );
                }
                spawn_rebuild(&server, &stream, &spec.group, m.last_log_index);
                break;
            } else if let (Some((false, what)), true) = (&diverged, due) {
                handed_over = Some(std::time::Instant::now());
                crate::error!(
                    server.log,
                    "JetStream stream group {}: its leader lacks messages this replica holds ({what}); this replica stands for election",
                    spec.group
                );
                let raft = raft.clone();
                tokio::spawn(async move {
                    let _ = raft.trigger().elect().await;
                });
            }
        }
        // The role with a quorum behind it, not just the leader id: a restarted server's
        // saved vote can make it leader with nobody else up.
        let leading = super::leads(&m);
        let caught_up = m.last_applied.map(|l| l.leader_id.term) == Some(m.current_term)
            && m.last_applied.map(|l| l.index) == m.last_log_index;
        let Some(s) = stream.upgrade() else {
            stopping = true;
            break;
        };
        if leading && !ready && (caught_up || !shared.is_fenced()) {
            ready = true;
            shared.leader_since.store(
                crate::time::now_nanos(),
                std::sync::atomic::Ordering::Relaxed,
            );
            let at = unmarker(&shared.store.lock().applied()).map_or(0, |l| l.index);
            let ok = s
                .ask(|reply| crate::jetstream::stream::Command::Lead { reply })
                .await
                .unwrap_or(false);
            if ok {
                // The lead's sync made what it had applied durable.
                shared
                    .synced
                    .fetch_max(at, std::sync::atomic::Ordering::AcqRel);
            }
            if !ok {
                // Its store lost what it applied: it must not lead from it.
                crate::error!(
                    server.log,
                    "JetStream stream '{} > {}' leaves its group: its store could not be synced",
                    s.account().name,
                    s.name
                );
                // Loaded again from its files, as a replica whose store failed: once
                // openraft has stopped the group, the next look schedules it (above).
                shared.leave_to_reload(&raft);
                drop(s);
                let _ = metrics.wait_for(|m| m.running_state.is_err()).await;
                continue;
            }
            shared.unfence();
            s.subscribe();
            if let Some(js) = account_js(&server, &s) {
                if js.registry.consumers(&js.account.name, &s.name).is_empty() {
                    crate::jetstream::registry::recover_consumers(&js, &server, &s);
                }
                if let Some(tx) = s.commands() {
                    let _ = tx
                        .send(crate::jetstream::stream::Command::RetentionAfterLead)
                        .await;
                }
            }
            crate::info!(
                server.log,
                "JetStream cluster new stream leader for '{} > {}'",
                s.account().name,
                s.name
            );
        } else if ready && (!leading || shared.is_fenced()) {
            ready = false;
            // Unsubscribed before the fence: what the actor refuses once fenced (its
            // clients retry at once) reaches the routes after their unsubscribe.
            s.unsubscribe_subjects();
            shared.set_fenced();
            if let Some(js) = account_js(&server, &s) {
                crate::jetstream::registry::stop_consumers(&js, &server, &s).await;
            }
        }
        // The group's members follow the stream's assignment in the meta group (looked at
        // when the membership moved, else at most every ASSIGNMENT_EVERY: a metrics
        // change comes with every batch).
        let membership = m.membership_config.log_id().map(|l| l.index);
        let look =
            membership != membership_seen || assignment_checked.elapsed() >= ASSIGNMENT_EVERY;
        if look {
            membership_seen = membership;
            assignment_checked = std::time::Instant::now();
        }
        if let Some(a) = server
            .jetstream
            .get()
            .and_then(|j| j.meta.get())
            .filter(|_| look)
            .and_then(|meta| meta.assignment(&s.account().name, &s.name))
        {
            if !a.peers.contains(&server.server_name)
                && shared
                    .committed_voters()
                    .is_some_and(|v| !v.contains(&shared.node))
            {
                // Removed from the group, and the removal is committed: the others have
                // what this replica had, and it goes.
                crate::info!(
                    server.log,
                    "JetStream cluster stream '{} > {}' removed from this server",
                    s.account().name,
                    s.name
                );
                if let Some(js) = account_js(&server, &s) {
                    let (server, name, stream) = (server.clone(), s.name.clone(), s.clone());
                    tokio::spawn(async move {
                        // Its consumers go on with the stream's other replicas: pulls
                        // waiting here are told to pull again, not that they are deleted.
                        crate::jetstream::registry::stop_consumers(&js, &server, &stream).await;
                        let mut router = crate::router::Router::new(js.account.clone(), 0x5250);
                        let _ = crate::jetstream::registry::delete_stream(
                            &js,
                            &server,
                            &mut router,
                            &name,
                        )
                        .await;
                        router.flush();
                    });
                }
                break;
            }
            if ready
                && leading
                && !membership_is(&m, &a.peers)
                && !shared
                    .changing
                    .swap(true, std::sync::atomic::Ordering::AcqRel)
            {
                let (raft, shared, log) = (raft.clone(), shared.clone(), server.log.clone());
                let (host, group) = (host.clone(), spec.group.clone());
                tokio::spawn(async move {
                    if let Err(e) = reconcile(&raft, &a.peers, &host, &group).await {
                        crate::warn!(log, "JetStream stream group membership: {e}");
                    }
                    shared
                        .changing
                        .store(false, std::sync::atomic::Ordering::Release);
                });
            }
        }
        drop(s);
        tokio::select! {
            r = metrics.changed() => if r.is_err() { break },
            _ = shared.stop.notified() => { stopping = true; break }
            _ = shutdown.changed() => break,
            // Looks again now and then: a fenced leader's failed batch may have committed
            // since, and a leader's quorum can go quiet without a metrics change.
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    if stopping {
        let _ = raft.shutdown().await;
        shared.close_log().await;
    }
}

/// Schedules the replica's reload from its files (`reload`), after the group's backoff,
/// saying why: its group stopped, or could not start, on a storage error.
fn reload_later(
    server: &Arc<crate::server::Server>,
    host: &Arc<super::RaftHost>,
    stream: &Weak<Stream>,
    group: &str,
    why: &str,
) {
    let Some((s, js)) = stream
        .upgrade()
        .and_then(|s| account_js(server, &s).map(|js| (s, js)))
    else {
        return;
    };
    let wait = host.reload_wait(group);
    crate::error!(
        server.log,
        "JetStream stream '{} > {}': {why}; the replica is loaded again from its files in {wait:?}",
        s.account().name,
        s.name
    );
    server.spawn(reload(
        server.clone(),
        js,
        host.clone(),
        group.to_string(),
        s.name.clone(),
        wait,
    ));
}

/// The followers learn the commit index only up to the leader's flush
/// (`Conn::append_entries`), and openraft sends it with the next append, or the next
/// heartbeat (250 ms). Once the leader's log has stayed quiet for `QUIET` after a flush, a
/// heartbeat carries it, so idle replicas are not a quarter second behind. (Under load the
/// next append carries it; a heartbeat then would take openraft's one append in flight to a
/// follower just when the next batch wants it.)
const QUIET: Duration = Duration::from_millis(20);

async fn carry_commit(raft: Raft, mut on_disk: super::Flushed) {
    while on_disk.changed().await.is_ok() {
        let flushed = on_disk.borrow_and_update().last;
        tokio::time::sleep(QUIET).await;
        let quiet = {
            let m = raft.metrics();
            let m = m.borrow();
            m.state == openraft::ServerState::Leader && m.last_log_index == flushed.map(|l| l.index)
        };
        if quiet && on_disk.borrow().last == flushed && raft.trigger().heartbeat().await.is_err() {
            return;
        }
    }
}

/// A memory stream's replica that restarted came back empty, with an empty log: it votes
/// for nobody and stands for nothing (its votes are held) until it knows where its peers
/// stand, asking them (`Rpc::Standing`) every half second:
/// - a quorum of them kept the stream, or one that kept it leads: it waits until the leader
///   has sent it the log up to where its peers were (a snapshot and the messages it lacks,
///   as for a new replica), then votes again, so its empty log never helps elect a leader
///   that lacks acknowledged messages;
/// - every peer answered and fewer than a quorum kept anything: what a quorum held is gone
///   with their memory. When none kept anything, all of them start the group again
///   (`initialize` with the same members, which openraft allows on several nodes) and the
///   stream starts empty, as the reference's memory streams do after a restart of all of
///   their servers; else it votes again, and the replica that kept the most leads.
async fn rejoin(
    server: Arc<crate::server::Server>,
    raft: Raft,
    host: Arc<super::RaftHost>,
    (account, name): (String, String),
    group: String,
    hold: u64,
) {
    crate::info!(
        server.log,
        "JetStream stream '{account} > {name}': this memory replica restarted empty; it rejoins its group"
    );
    let me = server.server_name.clone();
    let mut shutdown = server.shutdown_rx();
    while host.held_upto(&group, hold).is_some() {
        let Some(peers) = server
            .jetstream
            .get()
            .and_then(|j| j.meta.get())
            .and_then(|m| m.assignment(&account, &name))
            .map(|a| a.peers)
        else {
            return; // The stream went.
        };
        let others: Vec<&String> = peers.iter().filter(|p| **p != me).collect();
        let (mut answered, mut kept, mut upto, mut leader) = (0, 0, 0, None);
        for p in &others {
            if let Some(st) = host.standing(p, &group).await {
                answered += 1;
                if !st.fresh {
                    kept += 1;
                    upto = upto.max(st.last_log_index);
                    leader = leader.or(st.leader);
                }
            }
        }
        let quorum = peers.len() / 2 + 1;
        if kept >= quorum || (kept > 0 && leader.is_some()) {
            host.set_hold_upto(&group, hold, upto.max(1));
            // An idle leader only finds an emptied follower out when it next replicates.
            let to = leader.and_then(|id| peers.iter().find(|p| super::node_id(p) == id));
            if let Some(l) = to.filter(|l| **l != me) {
                host.nudge(l, &group).await;
            }
        } else if answered == others.len() {
            if kept == 0 {
                let members: std::collections::BTreeMap<NodeId, Peer> = peers
                    .iter()
                    .map(|n| (super::node_id(n), Peer { name: n.clone() }))
                    .collect();
                let _ = raft.initialize(members).await;
                crate::warn!(
                    server.log,
                    "JetStream stream '{account} > {name}': every replica restarted empty; the memory stream starts again empty"
                );
            } else {
                crate::warn!(
                    server.log,
                    "JetStream stream '{account} > {name}': fewer than a quorum of replicas kept this memory stream; it goes on from what they kept"
                );
            }
            host.release_votes(&group, hold, &raft);
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = shutdown.changed() => return,
        }
    }
    if let Some(js) = server.jetstream.get().and_then(|j| j.account(&account)) {
        js.registry.rejoined(&group);
    }
}

/// Whether the group's members (voters and learners) are exactly `peers`, in one config.
fn membership_is(m: &openraft::RaftMetrics<NodeId, Peer>, peers: &[String]) -> bool {
    use std::collections::BTreeSet;
    let mem = m.membership_config.membership();
    let want: BTreeSet<NodeId> = peers.iter().map(|p| super::node_id(p)).collect();
    mem.get_joint_config().len() == 1
        && mem.voter_ids().collect::<BTreeSet<_>>() == want
        && mem.nodes().map(|(id, _)| *id).collect::<BTreeSet<_>>() == want
}

/// How often a stream group looks at its assignment when its membership did not move.
const ASSIGNMENT_EVERY: Duration = Duration::from_millis(100);

/// How long the leader waits for a new peer to catch up from the log before it tries again.
const LEARNER_TIMEOUT: Duration = Duration::from_secs(120);

/// On the group's leader: brings the membership to `peers`. New peers join as learners and
/// catch up from the log, then the voters are replaced; a removed voter stays a learner
/// until it has the change (applying it is how it learns to drop its replica), then goes.
/// One change at a time, each awaited: openraft counts a leader's own entry committed
/// before its fsync (`log::LogStore::append`), and its answer to `change_membership`, which
/// comes after the apply (which waits for that fsync), is what keeps a second change from
/// starting on a joint config only the followers have on disk.
async fn reconcile(
    raft: &Raft,
    peers: &[String],
    host: &super::RaftHost,
    group: &str,
) -> Result<(), String> {
    use std::collections::BTreeSet;
    let mut want: BTreeSet<NodeId> = peers.iter().map(|p| super::node_id(p)).collect();
    // A stream moved off this leader's server (a new `placement`): the new peers join
    // beside it and catch up, then it hands the group to one of them, whose own look
    // removes this server.
    let moving = !want.contains(&host.id);
    if moving {
        want.insert(host.id);
    }
    let m = raft.metrics().borrow().clone();
    let mem = m.membership_config.membership().clone();
    if mem.get_joint_config().len() > 1 || membership_is(&m, peers) {
        return Ok(());
    }
    let nodes: BTreeSet<NodeId> = mem.nodes().map(|(id, _)| *id).collect();
    let voters: BTreeSet<NodeId> = mem.voter_ids().collect();
    for p in peers {
        let id = super::node_id(p);
        if nodes.contains(&id) {
            continue;
        }
        let peer = Peer { name: p.clone() };
        tokio::time::timeout(LEARNER_TIMEOUT, raft.add_learner(id, peer, true))
            .await
            .map_err(|_| format!("{p} did not catch up in time"))?
            .map_err(|e| format!("adding {p}: {e}"))?;
    }
    let mut index = m.membership_config.log_id().map_or(0, |l| l.index);
    if voters != want {
        let r = raft
            .change_membership(want.clone(), true)
            .await
            .map_err(|e| e.to_string())?;
        index = r.log_id.index;
    }
    if moving {
        let target = peers.first().ok_or("no peer to move to")?;
        let target = Peer {
            name: target.clone(),
        };
        return super::transfer(host, raft, group, &target).await;
    }
    let gone: BTreeSet<NodeId> = {
        let m = raft.metrics().borrow().clone();
        let all: BTreeSet<NodeId> = m
            .membership_config
            .membership()
            .nodes()
            .map(|(id, _)| *id)
            .collect();
        all.difference(&want).copied().collect()
    };
    if gone.is_empty() {
        return Ok(());
    }
    // The removed learners get the change, and learn that it committed, before they are
    // dropped (a while at most: one that is down keeps its copy until it is removed by
    // hand). The commit rides on a later append, so an idle stream's leader appends an
    // empty batch: a learner that never learns it stays out of the group with its copy.
    if let Some(shared) = host.store_of(group) {
        shared.nudge();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        let m = raft.metrics().borrow().clone();
        let has = |id: &NodeId| {
            m.replication
                .as_ref()
                .and_then(|r| r.get(id).cloned().flatten())
                .is_some_and(|l| l.index > index)
        };
        if gone.iter().all(has) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    raft.change_membership(openraft::ChangeMembers::RemoveNodes(gone), false)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod entry_tests {
    use super::*;

    fn batch(consumers: Vec<ConsumerEntry>) -> Batch {
        Batch {
            origin: 1,
            epoch: 2,
            nonce: 3,
            entries: Vec::new(),
            consumers,
            check: None,
        }
    }

    /// A batch's digest goes through the log and back; a batch without one reads as none.
    #[test]
    fn a_digest_rides_in_its_batch() {
        let d = Digest {
            msgs: 7,
            first_seq: 3,
            last_seq: 12,
        };
        let mut b = batch(Vec::new());
        b.check = Some(d);
        assert_eq!(decode(Bytes::from(encode(&b))).unwrap().check, Some(d));
        b.check = None;
        assert_eq!(decode(Bytes::from(encode(&b))).unwrap().check, None);
    }

    /// A consumer's state rides in its entry about as big as the file, and reads back the same.
    #[test]
    fn consumer_state_entries_carry_the_file_as_text() {
        let state: Vec<u8> = serde_json::to_vec(&serde_json::json!({
            "pending": (1..400u64).map(|i| [i, i]).collect::<Vec<_>>()
        }))
        .unwrap();
        let e = ConsumerEntry::State {
            name: "w".into(),
            state: state.clone(),
            ack_floor: 7,
        };
        let enc = encode(&batch(vec![e.clone()]));
        assert!(
            enc.len() < state.len() * 5 / 4,
            "{} for {}",
            enc.len(),
            state.len()
        );
        assert_eq!(decode(Bytes::from(enc)).unwrap().consumers, vec![e]);
        // Bytes that are not text still go through.
        let odd = ConsumerEntry::Create {
            name: "x".into(),
            meta: vec![0xff, 0, 1],
        };
        let enc = encode(&batch(vec![odd.clone()]));
        assert_eq!(decode(Bytes::from(enc)).unwrap().consumers, vec![odd]);
    }

    /// An entry an older Keel logged (the bytes as an array of numbers) still applies.
    #[test]
    fn consumer_entries_logged_as_byte_arrays_still_read() {
        let old = br#"{"State":{"name":"w","state":[123,125],"ack_floor":3}}"#;
        let e: ConsumerEntry = serde_json::from_slice(old).unwrap();
        assert_eq!(
            e,
            ConsumerEntry::State {
                name: "w".into(),
                state: b"{}".to_vec(),
                ack_floor: 3
            }
        );
    }
}

#[cfg(test)]
mod apply_tests {
    use super::*;
    use crate::jetstream::stream::read::WriteHandle;

    fn entry(index: u64, seqs: std::ops::RangeInclusive<u64>) -> Entry<TypeConfig> {
        let entries = seqs.map(entry_msg).collect();
        let body = encode(&Batch {
            origin: 9,
            epoch: 9,
            nonce: index,
            entries,
            consumers: Vec::new(),
            check: None,
        });
        Entry {
            log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(Cmd(body)),
        }
    }

    /// What a replica installing a snapshot fetches keeps a message's `Nats-TTL: never`
    /// (else the replica's next max_age expiry removes it there alone), and says up to
    /// which log index the leader's store may already lack messages.
    #[tokio::test]
    async fn fetched_messages_keep_their_exemption_from_max_age() {
        let mut store = keel_store::MemStore::new(keel_store::Limits::default());
        store
            .store_msg(b"a", b"NATS/1.0\r\nNats-TTL: never\r\n\r\n", b"x", 1)
            .unwrap();
        store.store_msg(b"a", b"", b"y", 2).unwrap();
        let (w, _r) = WriteHandle::new(Box::new(store), Arc::new(Default::default()));
        let dir = std::env::temp_dir().join(format!("keel-fetch-{}", std::process::id()));
        let sh = Shared::new(1, w, &dir, keel_store::MetaFiles::new());
        let (next, body) = sh.serve_fetch(1, 2, 1 << 20).unwrap();
        assert_eq!(next, 3);
        let b = decode(Bytes::from(body)).unwrap();
        let flags: Vec<bool> = b
            .entries
            .iter()
            .map(|e| matches!(e, StreamEntry::Msg(m) if m.no_max_age))
            .collect();
        assert_eq!(flags, [true, false]);
        // (No Raft here: nothing is compared up to any index.)
        assert_eq!(b.nonce, u64::MAX);
    }

    /// The actor proposes with its store locked and asks whether it is fenced; the state
    /// machine applying a batch holds the fence and then locks the store (a new leader's
    /// batch applied while a publish is decided on a replica that just lost the lead).
    /// The proposal must not wait for the fence's lock, or each waits for the other for
    /// good.
    #[test]
    fn a_proposal_does_not_wait_for_the_fence_the_state_machine_holds() {
        let store = keel_store::MemStore::new(keel_store::Limits::default());
        let (w, _r) = WriteHandle::new(Box::new(store), Arc::new(Default::default()));
        let dir = std::env::temp_dir().join(format!("keel-fence-{}", std::process::id()));
        let sh = Shared::new(1, w.follower(), &dir, keel_store::MetaFiles::new());
        let mut rep = RaftReplicator::new(sh.clone());
        let held = sh.fence();
        let (tx, rx) = std::sync::mpsc::channel();
        let sh2 = sh.clone();
        let t = std::thread::spawn(move || {
            let mut st = w.lock();
            let e = entry_msg(1);
            // (Refused: a replica is fenced until it is a ready leader.)
            let refused = rep.propose(&mut **st, &e).is_err();
            // A snapshot's capture whose sync fails fences with the store locked too.
            sh2.unfence();
            sh2.set_fenced();
            let _ = tx.send(refused && sh2.is_fenced());
        });
        let done = rx.recv_timeout(Duration::from_secs(5));
        drop(held);
        t.join().unwrap();
        assert_eq!(done, Ok(true), "waited for the fence");
    }

    fn entry_msg(seq: u64) -> StreamEntry {
        StreamEntry::Msg(MsgEntry {
            seq,
            ts: seq as i64,
            subject: Bytes::from_static(b"a"),
            hdr: Bytes::new(),
            data: Bytes::from_static(b"x"),
            rollup: None,
            no_max_age: false,
        })
    }

    /// A store rolled back under the state machine (its sync failed on a full disk after
    /// a batch was applied) must not take the next batch: that would record the dropped
    /// batch's sequences as deleted, a hole no later apply or snapshot fills. The state
    /// machine stops instead (the replica is then loaded again from its files and applies
    /// the log from the store's marker).
    #[tokio::test]
    async fn a_store_rolled_back_under_the_state_machine_takes_no_later_batch() {
        let store = keel_store::MemStore::new(keel_store::Limits::default());
        let (w, _r) = WriteHandle::new(Box::new(store), Arc::new(Default::default()));
        let dir = std::env::temp_dir().join(format!("keel-apply-{}", std::process::id()));
        let sh = Shared::new(1, w.follower(), &dir, keel_store::MetaFiles::new());
        let mut sm = StreamMachine(sh);
        sm.apply(vec![entry(1, 1..=3)]).await.unwrap();
        w.lock().sync().unwrap();
        sm.apply(vec![entry(2, 4..=6)]).await.unwrap();
        assert_eq!(w.lock().last_seq(), 6);
        // The rollback a failed sync does: back to the last completed sync.
        w.lock().discard_unsynced().unwrap();
        assert_eq!(w.lock().last_seq(), 3);
        let r = sm.apply(vec![entry(3, 7..=9)]).await;
        assert!(r.is_err(), "applied on a rolled-back store");
        let st = w.lock();
        assert_eq!(st.last_seq(), 3);
        assert_eq!(unmarker(&st.applied()).map(|l| l.index), Some(1));
    }
}
