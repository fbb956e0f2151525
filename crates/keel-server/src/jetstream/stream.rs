//! One stream: its configuration (with the reference's defaults and checks), its store, and
//! the publish pipeline that stores messages in batches and acknowledges them only after
//! the batch is synced (group commit).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use keel_protocol::{headers, subject};
use keel_store::{Discard, Limits, MetaFiles, Purge, State, Store, StoreError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::api::{ApiError, ErrorKind};
use super::counter;
use super::republish::{self, RePublish, Republisher};
use super::sourcing::{self, SourcedBatch, StreamSource, SubjectTransformConfig, Taken};
use super::transform::{validate_mapping, Transform};
use crate::account::Account;
use crate::client::{ClientHandle, InMsg};
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::sublist::Sub;
use crate::time::{now_nanos, rfc3339};

fn neg1() -> i64 {
    -1
}
fn neg1_i32() -> i32 {
    -1
}
fn one() -> i64 {
    1
}
fn is_false(b: &bool) -> bool {
    !*b
}
fn is_zero(n: &i64) -> bool {
    *n == 0
}
fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}
fn none_str() -> String {
    "none".into()
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Retention {
    #[default]
    Limits,
    Interest,
    Workqueue,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum DiscardPolicy {
    #[default]
    Old,
    New,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum StorageType {
    #[default]
    File,
    Memory,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct ConsumerLimits {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inactive_threshold: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_ack_pending: i64,
}

/// A stream's configuration. Field order is the reference's output order; optional fields
/// are left out when unset, as it does. Durations are nanoseconds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StreamConfig {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub subjects: Vec<String>,
    #[serde(default)]
    pub retention: Retention,
    #[serde(default = "neg1")]
    pub max_consumers: i64,
    #[serde(default = "neg1")]
    pub max_msgs: i64,
    #[serde(default = "neg1")]
    pub max_bytes: i64,
    #[serde(default)]
    pub max_age: i64,
    #[serde(default = "neg1")]
    pub max_msgs_per_subject: i64,
    #[serde(default = "neg1_i32")]
    pub max_msg_size: i32,
    #[serde(default)]
    pub discard: DiscardPolicy,
    #[serde(default, skip_serializing_if = "is_false")]
    pub discard_new_per_subject: bool,
    #[serde(default)]
    pub storage: StorageType,
    #[serde(default = "one")]
    pub num_replicas: i64,
    #[serde(default, skip_serializing_if = "is_false")]
    pub no_ack: bool,
    /// Zero only for mirrors and streams with sources (no deduplication), as the reference.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub duplicate_window: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<StreamSource>,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_default"
    )]
    pub sources: Vec<StreamSource>,
    #[serde(default = "none_str")]
    pub compression: String,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub first_seq: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject_transform: Option<SubjectTransformConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub republish: Option<RePublish>,
    #[serde(default)]
    pub allow_direct: bool,
    #[serde(default)]
    pub mirror_direct: bool,
    #[serde(default)]
    pub sealed: bool,
    #[serde(default)]
    pub deny_delete: bool,
    #[serde(default)]
    pub deny_purge: bool,
    #[serde(default)]
    pub allow_rollup_hdrs: bool,
    #[serde(default, deserialize_with = "null_default")]
    pub consumer_limits: ConsumerLimits,
    #[serde(default)]
    pub allow_msg_ttl: bool,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub subject_delete_marker_ttl: i64,
    #[serde(default, skip_serializing_if = "is_false")]
    pub allow_msg_counter: bool,
    #[serde(default, deserialize_with = "null_default")]
    pub metadata: BTreeMap<String, String>,
    // Features Keel does not implement: accepted only when absent or empty, so that a
    // config relying on them is refused with a clear error instead of silently ignored.
    #[serde(default, skip_serializing)]
    pub allow_atomic: Option<bool>,
    #[serde(default, skip_serializing)]
    pub allow_msg_schedules: Option<bool>,
    /// Fast batch publishing (nats.go's AllowBatchPublish).
    #[serde(default, skip_serializing)]
    pub allow_batched: Option<bool>,
    #[serde(default, skip_serializing)]
    pub persist_mode: Option<Value>,
}

/// Deserializes JSON `null` as the type's default (clients send null for empty lists).
pub fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl Default for StreamConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("defaults deserialize")
    }
}

/// Metadata keys the server adds to responses; never stored.
const DYNAMIC_META: [&str; 2] = ["_nats.level", "_nats.ver"];
pub const REQ_LEVEL_KEY: &str = "_nats.req.level";
/// The JetStream API level Keel reports in `_nats.level`, `$JS.API.INFO`, `/jsz` and `/varz`:
/// level 1 (per-message TTL) with `config::COMPAT_VERSION` = 2.11.0 to match. Level 2's
/// counters, atomic batches and schedules are not implemented, so Keel does not claim it.
pub const API_LEVEL: u32 = 1;

const MAX_NAME_LEN: usize = 255;
/// How long publishes are refused after a storage failure before the next try.
const STORAGE_RETRY: Duration = Duration::from_secs(1);
const DEFAULT_DUPLICATE_WINDOW: i64 = 120_000_000_000;

/// Is `name` usable as a stream or consumer name (the reference's rule)?
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && !name
            .chars()
            .any(|c| matches!(c, '.' | '*' | '>' | '\\' | '/') || c.is_whitespace())
}

/// Do two subject patterns match some subject in common?
pub fn subjects_overlap(a: &str, b: &str) -> bool {
    let mut x = a.split('.');
    let mut y = b.split('.');
    loop {
        match (x.next(), y.next()) {
            (Some(">"), Some(_)) | (Some(_), Some(">")) => return true,
            (Some(p), Some(q)) => {
                if p != "*" && q != "*" && p != q {
                    return false;
                }
            }
            (None, None) => return true,
            _ => return false,
        }
    }
}

impl StreamConfig {
    /// Applies defaults and checks the config the way the reference's create does.
    pub fn normalize(mut self) -> Result<StreamConfig, ApiError> {
        if !valid_name(&self.name) {
            return Err(ErrorKind::InvalidConfig
                .with("stream name is required and can not contain '.', '*', '>', '\\', '/'"));
        }
        if self.name.len() > MAX_NAME_LEN {
            return Err(ErrorKind::InvalidConfig.with(format!(
                "stream name is too long, maximum allowed is {MAX_NAME_LEN}"
            )));
        }
        if self.allow_atomic == Some(true) {
            return Err(ApiError::not_supported("atomic batch publishing"));
        }
        if self.allow_msg_schedules == Some(true) {
            return Err(ApiError::not_supported("message schedules"));
        }
        if self.allow_batched == Some(true) {
            return Err(ApiError::not_supported("fast batch publishing"));
        }
        if self
            .persist_mode
            .as_ref()
            .is_some_and(|p| !p.is_null() && p != "default")
        {
            return Err(ApiError::not_supported("persist_mode"));
        }
        match self.compression.as_str() {
            "" | "none" => self.compression = "none".into(),
            "s2" => return Err(ApiError::not_supported("s2 compression")),
            _ => return Err(ErrorKind::InvalidConfig.with("invalid compression")),
        }
        if self.num_replicas == 0 {
            self.num_replicas = 1;
        }
        if self.num_replicas < 0 {
            return Err(ErrorKind::ReplicasNegative.err());
        }
        if self.num_replicas > 1 {
            return Err(ErrorKind::ReplicasNotSupported.err());
        }
        if self.max_age < 0 {
            return Err(ErrorKind::InvalidConfig.with("max age can not be negative"));
        }
        if self.max_age > 0 && self.max_age < 100_000_000 {
            return Err(ErrorKind::InvalidConfig.with("max age needs to be >= 100ms"));
        }
        if self.duplicate_window < 0 {
            return Err(ErrorKind::InvalidConfig.with("duplicates window can not be negative"));
        }
        let sourcing = self.mirror.is_some() || !self.sources.is_empty();
        if self.duplicate_window == 0 && !sourcing {
            self.duplicate_window = if self.max_age > 0 && self.max_age < DEFAULT_DUPLICATE_WINDOW {
                self.max_age
            } else {
                DEFAULT_DUPLICATE_WINDOW
            };
        }
        if self.max_age > 0 && self.duplicate_window > self.max_age {
            return Err(
                ErrorKind::InvalidConfig.with("duplicates window can not be larger then max age")
            );
        }
        if self.duplicate_window > 0 && self.duplicate_window < 100_000_000 {
            return Err(ErrorKind::InvalidConfig.with("duplicates window needs to be >= 100ms"));
        }
        if self.allow_rollup_hdrs && self.deny_purge {
            return Err(ErrorKind::InvalidConfig.with("roll-ups require the purge permission"));
        }
        if self.discard_new_per_subject {
            if self.discard != DiscardPolicy::New {
                return Err(ErrorKind::InvalidConfig
                    .with("discard new per subject requires discard new policy to be set"));
            }
            if self.max_msgs_per_subject <= 0 {
                return Err(ErrorKind::InvalidConfig
                    .with("discard new per subject requires max msgs per subject > 0"));
            }
        }
        if self.allow_msg_counter {
            let bad = if self.discard == DiscardPolicy::New {
                Some("counter stream cannot use discard new")
            } else if self.allow_msg_ttl {
                Some("counter stream cannot use message TTLs")
            } else if self.allow_msg_schedules == Some(true) {
                Some("counter stream cannot use message schedules")
            } else if self.retention != Retention::Limits {
                Some("counter stream can only use limits retention")
            } else {
                None
            };
            if let Some(text) = bad {
                return Err(ErrorKind::InvalidConfig.with(text));
            }
        }
        // Markers are stored with a TTL and roll up their subject, so both get enabled.
        if self.subject_delete_marker_ttl > 0 {
            if self.subject_delete_marker_ttl < 1_000_000_000 {
                return Err(ErrorKind::InvalidConfig
                    .with("subject delete marker TTL must be at least 1 second"));
            }
            self.allow_msg_ttl = true;
            if !self.allow_rollup_hdrs {
                self.allow_rollup_hdrs = true;
                self.deny_purge = false;
            }
        } else if self.subject_delete_marker_ttl < 0 {
            return Err(
                ErrorKind::InvalidConfig.with("subject delete marker TTL must not be negative")
            );
        }
        sourcing::check_config(&self)?;
        for v in [
            &mut self.max_msgs,
            &mut self.max_bytes,
            &mut self.max_msgs_per_subject,
            &mut self.max_consumers,
        ] {
            if *v == 0 {
                *v = -1;
            }
        }
        if self.max_msg_size == 0 {
            self.max_msg_size = -1;
        }
        if self.subjects.is_empty() && !sourcing {
            self.subjects = vec![self.name.clone()];
        }
        let mut seen = std::collections::HashSet::new();
        for s in &self.subjects {
            if !subject::valid_subscribe(s.as_bytes()) {
                return Err(ErrorKind::InvalidConfig.with("invalid subject"));
            }
            if !seen.insert(s.as_str()) {
                return Err(ErrorKind::InvalidConfig.with("duplicate subjects detected"));
            }
            if s == ">" && !self.no_ack {
                return Err(ErrorKind::InvalidConfig
                    .with("capturing all subjects requires no-ack to be true"));
            }
            if (subjects_overlap(s, "$JS.API.>") || subjects_overlap(s, "$SYS.>")) && !self.no_ack {
                return Err(ErrorKind::InvalidConfig
                    .with("subjects that overlap with jetstream api require no-ack to be true"));
            }
        }
        for (i, a) in self.subjects.iter().enumerate() {
            for b in &self.subjects[i + 1..] {
                if subjects_overlap(a, b) {
                    return Err(
                        ErrorKind::InvalidConfig.with(format!("subject {a:?} overlaps with {b:?}"))
                    );
                }
            }
        }
        if let Some(t) = &self.subject_transform {
            if !t.src.is_empty() && !subject::valid_subscribe(t.src.as_bytes()) {
                return Err(ErrorKind::StreamTransformSource.with(&t.src));
            }
            validate_mapping(&t.src, &t.dest).map_err(|e| ErrorKind::StreamTransform.with(e))?;
        }
        republish::check(&mut self)?;
        for k in DYNAMIC_META {
            self.metadata.remove(k);
        }
        let level = if self.allow_msg_counter {
            "2"
        } else if self.allow_msg_ttl {
            "1"
        } else {
            "0"
        };
        self.metadata.insert(REQ_LEVEL_KEY.into(), level.into());
        Ok(self)
    }

    /// Checks what an update may change (the reference's rules).
    pub fn check_update(&self, new: &StreamConfig) -> Result<(), ApiError> {
        if new.name != self.name {
            return Err(
                ErrorKind::InvalidConfig.with("stream configuration name must match original")
            );
        }
        if new.storage != self.storage {
            return Err(ErrorKind::InvalidConfig
                .with("stream configuration update can not change storage type"));
        }
        if new.retention != self.retention
            && (new.retention == Retention::Workqueue || self.retention == Retention::Workqueue)
        {
            return Err(ErrorKind::InvalidConfig.with(
                "stream configuration update can not change retention policy to/from workqueue",
            ));
        }
        if self.sealed && !new.sealed {
            return Err(ErrorKind::InvalidConfig
                .with("stream configuration update can not unseal a sealed stream"));
        }
        if self.deny_delete && !new.deny_delete {
            return Err(ErrorKind::InvalidConfig
                .with("stream configuration update can not cancel deny message deletes"));
        }
        if self.deny_purge && !new.deny_purge {
            return Err(ErrorKind::InvalidConfig
                .with("stream configuration update can not cancel deny purge"));
        }
        if new.mirror.is_some() && new.mirror != self.mirror {
            return Err(ErrorKind::MirrorConfigUpdate.err());
        }
        if self.allow_msg_counter != new.allow_msg_counter {
            return Err(ErrorKind::InvalidConfig
                .with("stream configuration update can not change message counter setting"));
        }
        if self.allow_msg_ttl && !new.allow_msg_ttl {
            return Err(ErrorKind::InvalidConfig.with("message TTL status can not be disabled"));
        }
        Ok(())
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_msgs: self.max_msgs,
            max_bytes: self.max_bytes,
            max_age: Duration::from_nanos(self.max_age.max(0) as u64),
            max_msgs_per_subject: self.max_msgs_per_subject,
            max_msg_size: self.max_msg_size as i64,
            discard: match self.discard {
                DiscardPolicy::Old => Discard::Old,
                DiscardPolicy::New => Discard::New,
            },
            discard_new_per_subject: self.discard_new_per_subject,
        }
    }

    /// The config as responses show it: stored metadata plus the server's level and version.
    pub fn to_json(&self, dynamic_meta: bool) -> Value {
        config_json(self, dynamic_meta)
    }
}

/// A stream or consumer config as responses show it: with `dynamic_meta`, the server's API
/// level and version join the stored metadata (the reference adds them and never stores them).
pub fn config_json<T: Serialize>(config: &T, dynamic_meta: bool) -> Value {
    let mut v = serde_json::to_value(config).expect("config serializes");
    if dynamic_meta {
        if let Some(Value::Object(meta)) = v.get_mut("metadata") {
            let mut m = Map::new();
            m.insert("_nats.level".into(), API_LEVEL.to_string().into());
            m.insert(
                REQ_LEVEL_KEY.into(),
                meta.remove(REQ_LEVEL_KEY).unwrap_or_else(|| "0".into()),
            );
            m.insert("_nats.ver".into(), crate::config::COMPAT_VERSION.into());
            m.extend(std::mem::take(meta));
            *meta = m;
        }
    }
    v
}

/// What survives a restart besides the messages.
#[derive(Serialize, Deserialize)]
pub struct StreamMeta {
    pub config: StreamConfig,
    pub created: i64,
}

/// Remembers `Nats-Msg-Id`s inside the duplicate window.
#[derive(Default)]
struct Dedup {
    ids: HashMap<String, u64>,
    order: VecDeque<(i64, String)>,
}

impl Dedup {
    fn prune(&mut self, now: i64, window: i64) {
        while let Some((ts, _)) = self.order.front() {
            if now - ts <= window {
                break;
            }
            let (_, id) = self.order.pop_front().expect("front exists");
            self.ids.remove(&id);
        }
    }
    fn insert(&mut self, id: String, seq: u64, ts: i64) {
        self.ids.insert(id.clone(), seq);
        self.order.push_back((ts, id));
    }
}

/// The parts of a stream behind its lock.
pub struct StreamInner {
    pub config: StreamConfig,
    pub store: Box<dyn Store>,
    dedup: Dedup,
    /// (expiry ns, seq) of messages published with a `Nats-TTL`.
    ttls: std::collections::BTreeSet<(i64, u64)>,
    /// `Nats-Msg-Id` of the last stored message (for Nats-Expected-Last-Msg-Id).
    last_msg_id: String,
    /// After a storage failure (the store rolled back what was not yet durable):
    /// publishes are refused with the reason until the instant, then tried again, so a
    /// full disk recovers without a restart and is not hammered meanwhile.
    storage_down: Option<(std::time::Instant, String)>,
    /// A store write in the current batch failed: the batch must be rolled back.
    io_error: bool,
    /// `subject_transform`, applied to every message before anything else.
    input_tr: Option<Transform>,
    republisher: Option<Republisher>,
    /// Republishes decided for stored messages, sent once their batch is synced.
    republish_out: Vec<republish::Pending>,
}

/// Where a message to store comes from: the decision differs (a sourced message was
/// checked by its origin; a mirrored one keeps its origin's sequence and time).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Intake {
    Publish,
    Sourced,
    Mirrored { seq: u64, ts: i64 },
}

pub struct Stream {
    pub name: String,
    pub created: i64,
    pub dir: PathBuf,
    /// Fixed at creation (an update may not change it), so readable without the lock.
    pub storage: StorageType,
    /// The JetStream instance's metadata files (configs, consumer state, source positions).
    pub meta: MetaFiles,
    inner: Mutex<StreamInner>,
    handle: Arc<ClientHandle>,
    subs: Mutex<Vec<Arc<Sub>>>,
    /// Bytes stored, for account usage without taking every stream's lock.
    pub bytes: AtomicU64,
    /// Sync before acknowledging (the default); otherwise a timer syncs.
    sync_always: bool,
    /// Its consumers as the registry lists them (read-only views of their state).
    pub consumers: super::registry::ConsumerSet,
    /// The last sequence whose batch is committed, watched by streams that source this one.
    committed: tokio::sync::watch::Sender<u64>,
    /// Batches from this stream's sources or mirror, taken by its writer.
    sourced_tx: tokio::sync::mpsc::Sender<SourcedBatch>,
    /// The running sources or mirror (None when it has neither).
    sourcing: Mutex<Option<sourcing::Sourcing>>,
    /// Origin identities per source index name, and whether positions await saving.
    source_idents: Mutex<(HashMap<String, String>, bool)>,
    /// Bumped (under the stream lock) each time the sources restart; see [`SourcedBatch`].
    sourcing_gen: AtomicU64,
}

/// The outcome of one publish.
pub(super) enum PubResult {
    Stored(u64),
    /// Stored on a counter stream, with the subject's new total.
    Counted(u64, String),
    Duplicate(u64),
    Error(ApiError),
}

impl PubResult {
    pub(super) fn stored(&self) -> bool {
        matches!(self, PubResult::Stored(_) | PubResult::Counted(..))
    }
}

impl Stream {
    /// Opens (or creates) a stream's store and subscribes to its subjects.
    pub fn open(
        server: &Arc<Server>,
        account: &Arc<Account>,
        dir: &Path,
        meta: StreamMeta,
        sync_always: bool,
        files: &MetaFiles,
    ) -> Result<Arc<Stream>, String> {
        let config = meta.config;
        let store: Box<dyn Store> = match config.storage {
            StorageType::Memory => Box::new(keel_store::mem::MemStore::new(config.limits())),
            StorageType::File => {
                let msgs = dir.join("msgs");
                let (mut fs, report) = keel_store::file::FileStore::open(&msgs, config.limits())
                    .map_err(|e| e.to_string())?;
                super::files::log_recovery(
                    &server.log,
                    &config.name,
                    &msgs,
                    &report,
                    Some(&fs.state()),
                );
                crate::debug!(server.log, "Stream {} recovery: {report:?}", config.name);
                fs.set_observer(super::files::observer(
                    server.log.clone(),
                    config.name.clone(),
                    msgs,
                ));
                Box::new(fs)
            }
        };
        let (handle, rx) = ClientHandle::internal(
            server,
            account,
            format!("stream {}", config.name),
            crate::inqueue::STREAM_QUEUE_BYTES,
        );
        let mut inner = StreamInner {
            config,
            store,
            dedup: Dedup::default(),
            ttls: Default::default(),
            last_msg_id: String::new(),
            storage_down: None,
            io_error: false,
            input_tr: None,
            republisher: None,
            republish_out: Vec::new(),
        };
        inner.compile();
        inner.rebuild_dedup();
        inner.rebuild_ttls();
        let bytes = inner.store.state().bytes;
        let (committed, _) = tokio::sync::watch::channel(inner.store.state().last_seq);
        // Each source has at most one batch in flight, so a few slots are enough.
        let (sourced_tx, sourced_rx) = tokio::sync::mpsc::channel(8);
        let stream = Arc::new(Stream {
            name: inner.config.name.clone(),
            created: meta.created,
            dir: dir.to_path_buf(),
            storage: inner.config.storage,
            meta: files.clone(),
            inner: Mutex::new(inner),
            handle,
            subs: Mutex::new(Vec::new()),
            bytes: AtomicU64::new(bytes),
            sync_always,
            consumers: Default::default(),
            committed,
            sourced_tx,
            sourcing: Mutex::new(None),
            source_idents: Mutex::new((HashMap::new(), false)),
            sourcing_gen: AtomicU64::new(0),
        });
        stream.subscribe();
        server.spawn(publish_loop(stream.clone(), server.clone(), rx, sourced_rx));
        stream.restart_sourcing(server);
        Ok(stream)
    }

    pub fn lock(&self) -> MutexGuard<'_, StreamInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The retention policy, without cloning the whole config.
    pub fn retention(&self) -> Retention {
        self.lock().config.retention
    }

    pub fn config(&self) -> StreamConfig {
        self.lock().config.clone()
    }

    /// The server's log (the stream's handle carries it).
    pub fn handle_log(&self) -> &crate::log::Log {
        self.handle.log()
    }

    /// The account the stream serves.
    pub fn account(&self) -> &Arc<Account> {
        self.handle.account()
    }

    /// (Re)subscribes to the config's subjects, in the stream's account.
    pub fn subscribe(&self) {
        let subjects = self.lock().config.subjects.clone();
        let mut subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        for s in subs.drain(..) {
            self.account().sublist.remove(&s);
        }
        for (i, subj) in subjects.iter().enumerate() {
            let sub = Arc::new(Sub {
                client: self.handle.clone(),
                sid: Bytes::from(i.to_string()),
                subject: Bytes::copy_from_slice(subj.as_bytes()),
                queue: None,
                max: AtomicU64::new(0),
                delivered: AtomicU64::new(0),
            });
            self.account().sublist.insert(sub.clone());
            subs.push(sub);
        }
    }

    pub fn unsubscribe(&self) {
        let mut subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        for s in subs.drain(..) {
            self.account().sublist.remove(&s);
        }
        // Closing the handle ends the publish loop once its queue drains.
        self.handle
            .close(crate::client::CloseReason::ServerShutdown);
    }

    pub fn persist_meta(&self) -> std::io::Result<()> {
        let meta = StreamMeta {
            config: self.config(),
            created: self.created,
        };
        write_meta(&self.meta, &self.dir, &meta)
    }

    pub fn state(&self) -> State {
        self.lock().store.state()
    }

    pub fn refresh_bytes(&self, inner: &StreamInner) {
        self.bytes
            .store(inner.store.state().bytes, Ordering::Relaxed);
    }

    /// Stores a batch and returns the ack for each message that asked for one. With
    /// sync-always the acks are only produced after the batch is on disk.
    /// `budget`: bytes this stream may still add under the server-wide store limit;
    /// `domain`: the JetStream domain that acks name.
    fn process_batch(
        &self,
        batch: &mut Vec<InMsg>,
        budget: Option<u64>,
        domain: Option<&str>,
    ) -> Vec<(Bytes, Vec<u8>)> {
        // Interest retention keeps a message only while some consumer wants its subject.
        let interest: Option<Vec<Vec<String>>> = (self.retention() == Retention::Interest)
            .then(|| self.consumers.views().iter().map(|c| c.filters()).collect());
        let mut inner = self.lock();
        let mut results = Vec::with_capacity(batch.len());
        let mut stored_any = false;
        for m in batch.drain(..) {
            let r = match budget {
                // As the reference: refused once usage has reached the limit (the message
                // that crosses it is still taken).
                Some(b) if inner.store.state().bytes >= b => {
                    PubResult::Error(if inner.store_is_memory() {
                        ErrorKind::InsufficientMemory.err()
                    } else {
                        ErrorKind::InsufficientStorage.err()
                    })
                }
                _ => inner.process(&m),
            };
            if let (PubResult::Stored(seq), Some(filters)) = (&r, &interest) {
                let stored = inner.stored_subject(&m.subject);
                let wanted = filters.iter().any(|f| {
                    f.is_empty() || f.iter().any(|p| subject::matches(p.as_bytes(), &stored))
                });
                if !wanted {
                    let _ = inner.store.remove(*seq, false);
                }
            }
            stored_any |= r.stored();
            results.push((m.reply, r));
        }
        // A memory store's sync is a no-op; a file store's is the group commit. After a
        // failed write the sync rolls the batch back, so none of it may be acknowledged.
        if (stored_any && self.sync_always) || inner.io_error {
            let r = inner.store.sync();
            let n = results.iter().filter(|(_, r)| r.stored()).count();
            inner.storage_result(self.handle.log(), &self.name, r, n, |text| {
                for (_, r) in results.iter_mut() {
                    if r.stored() {
                        *r = PubResult::Error(ErrorKind::StoreFailed.with(text.to_string()));
                    }
                }
            });
        }
        self.refresh_bytes(&inner);
        let name = inner.config.name.clone();
        drop(inner);
        results
            .into_iter()
            .filter_map(|(reply, r)| reply.map(|reply| (reply, pub_ack(&name, domain, &r))))
            .collect()
    }

    /// Syncs unsynced writes (the timer path when sync is not per batch).
    pub fn sync(&self) {
        let mut inner = self.lock();
        let r = inner.store.sync();
        inner.storage_result(self.handle.log(), &self.name, r, 0, |_| {});
    }
}

fn pub_ack(stream: &str, domain: Option<&str>, r: &PubResult) -> Vec<u8> {
    let name = serde_json::to_string(stream).expect("string serializes");
    // With a JetStream domain, successful acks name it (errors do not), as the reference.
    let domain = domain
        .map(|d| format!(",\"domain\":{}", serde_json::to_string(d).expect("string")))
        .unwrap_or_default();
    match r {
        PubResult::Stored(seq) => {
            format!("{{\"stream\":{name}{domain},\"seq\":{seq}}}").into_bytes()
        }
        PubResult::Counted(seq, val) => {
            let val = serde_json::to_string(val).expect("string serializes");
            format!("{{\"stream\":{name}{domain},\"seq\":{seq},\"val\":{val}}}").into_bytes()
        }
        // The one non-compact JSON the reference sends: a space after the colon.
        PubResult::Duplicate(seq) => {
            format!("{{\"stream\":{name}{domain},\"seq\":{seq},\"duplicate\": true}}").into_bytes()
        }
        PubResult::Error(e) => {
            let err = super::api::to_bytes(&e.to_json());
            let mut out = b"{\"error\":".to_vec();
            out.extend_from_slice(&err);
            out.extend_from_slice(format!(",\"stream\":{name},\"seq\":0}}").as_bytes());
            out
        }
    }
}

impl StreamInner {
    fn store_is_memory(&self) -> bool {
        self.config.storage == StorageType::Memory
    }

    /// Removes messages whose `Nats-TTL` has passed. Returns how many.
    pub fn expire_ttls(&mut self, now: i64) -> usize {
        let mut n = 0;
        while let Some(&(at, seq)) = self.ttls.first() {
            if at > now {
                break;
            }
            self.ttls.pop_first();
            if self.store.remove(seq, false).unwrap_or(false) {
                n += 1;
            }
        }
        n
    }

    pub fn has_ttls(&self) -> bool {
        !self.ttls.is_empty()
    }

    /// Takes the sequences whose `Nats-TTL` has passed (delete-marker streams decide what
    /// to do with them).
    pub(super) fn take_expired_ttls(&mut self, now: i64) -> Vec<u64> {
        let mut out = vec![];
        while let Some(&(at, seq)) = self.ttls.first() {
            if at > now {
                break;
            }
            self.ttls.pop_first();
            out.push(seq);
        }
        out
    }

    /// Finds the messages that carry a `Nats-TTL` after a restart (only streams that allow
    /// them; only messages with headers are read).
    fn rebuild_ttls(&mut self) {
        // Sourced copies may carry `Nats-TTL: never` even where TTLs are off.
        let sourced = self.config.mirror.is_some() || !self.config.sources.is_empty();
        if !self.config.allow_msg_ttl && !sourced {
            return;
        }
        let state = self.store.state();
        for seq in state.first_seq.max(1)..=state.last_seq {
            if !matches!(self.store.peek(seq), Some((_, true))) {
                continue;
            }
            if let Ok(m) = self.store.load(seq) {
                if let Some(secs) = headers::get_str(&m.hdr, "Nats-TTL").and_then(parse_ttl) {
                    if secs > 0 && self.config.allow_msg_ttl {
                        self.ttls.insert((m.ts + secs * 1_000_000_000, seq));
                    } else if secs < 0 {
                        self.store.exempt_from_max_age(seq);
                    }
                }
            }
        }
    }

    /// Rebuilds the duplicate-window map from the newest messages after a restart.
    fn rebuild_dedup(&mut self) {
        let state = self.store.state();
        let window = self.config.duplicate_window;
        let now = now_nanos();
        let mut seq = state.last_seq;
        let mut found = vec![];
        while seq >= state.first_seq && seq > 0 {
            // The index tells age and whether there are headers without reading the
            // message; only messages that can carry a Nats-Msg-Id are read.
            match self.store.peek(seq) {
                Some((ts, _)) if now - ts > window => break,
                Some((_, true)) => {}
                _ => {
                    seq -= 1;
                    continue;
                }
            }
            if let Ok(m) = self.store.load(seq) {
                if let Some(id) = headers::get_str(&m.hdr, "Nats-Msg-Id") {
                    found.push((m.ts, id.to_string(), m.seq));
                }
                if seq == state.last_seq {
                    self.last_msg_id = headers::get_str(&m.hdr, "Nats-Msg-Id")
                        .unwrap_or_default()
                        .to_string();
                }
            }
            seq -= 1;
        }
        for (ts, id, seq) in found.into_iter().rev() {
            self.dedup.insert(id, seq, ts);
        }
    }

    /// What a sync's outcome means for the stream. On failure the store has rolled back
    /// to its last completed sync: `refuse` turns the batch's results into errors, and
    /// publishes are refused for a moment before the next try.
    fn storage_result(
        &mut self,
        log: &crate::log::Log,
        stream: &str,
        r: Result<(), StoreError>,
        stored: usize,
        refuse: impl FnOnce(&str),
    ) {
        self.io_error = false;
        match r {
            Ok(()) => {
                if self.storage_down.take().is_some() {
                    crate::info!(log, "Stream {stream}: storage writable again");
                }
            }
            Err(e) => {
                let text = e.to_string();
                if self.storage_down.is_none() {
                    crate::error!(
                        log,
                        "Stream {stream}: {text}; {stored} publishes of this batch were not stored and got an error; retrying every {:?}",
                        STORAGE_RETRY
                    );
                }
                refuse(&text);
                self.storage_down = Some((std::time::Instant::now() + STORAGE_RETRY, text));
            }
        }
    }

    /// Compiles what the config implies for the write path (a stream update recompiles).
    pub(super) fn compile(&mut self) {
        self.input_tr = self
            .config
            .subject_transform
            .as_ref()
            .and_then(|t| Transform::new(&t.src, &t.dest).ok().flatten());
        self.republisher = Republisher::new(&self.config);
    }

    /// The subject a message is stored under (after `subject_transform`).
    pub(super) fn stored_subject(&self, subject: &Bytes) -> Bytes {
        match (&self.input_tr, std::str::from_utf8(subject)) {
            (Some(t), Ok(s)) => t
                .apply(s)
                .map(Bytes::from)
                .unwrap_or_else(|| subject.clone()),
            _ => subject.clone(),
        }
    }

    /// Takes the republishes of what was stored since the last call; none after a failed
    /// sync (those messages were not acknowledged and may not exist).
    pub(super) fn take_republish(&mut self) -> Vec<republish::Pending> {
        let out = std::mem::take(&mut self.republish_out);
        if self.storage_down.is_some() {
            return Vec::new();
        }
        out
    }

    /// One publish: the reference's checks in its order, then store.
    fn process(&mut self, m: &InMsg) -> PubResult {
        self.process_parts(&m.subject, m.headers(), m.payload(), Intake::Publish)
    }

    /// Decides on one message and stores it: the checks a client publish gets (a sourced
    /// or mirrored one skips those its origin made), the sequence and time, the headers
    /// stored, then the store write and what follows from it (rollup, TTL, republish).
    pub(super) fn process_parts(
        &mut self,
        subject: &Bytes,
        hdr: &[u8],
        data: &[u8],
        intake: Intake,
    ) -> PubResult {
        if let Some((until, why)) = &self.storage_down {
            if std::time::Instant::now() < *until {
                return PubResult::Error(ErrorKind::StoreFailed.with(why.clone()));
            }
        }
        let publish = intake == Intake::Publish;
        let cfg = &self.config;
        if cfg.sealed {
            return PubResult::Error(ErrorKind::Sealed.err());
        }
        let subject = self.stored_subject(subject);
        if let Intake::Mirrored { seq, .. } = intake {
            if seq <= self.store.state().last_seq {
                return PubResult::Duplicate(seq);
            }
        }
        if cfg.max_msg_size >= 0 && (hdr.len() + data.len()) as i64 > cfg.max_msg_size as i64 {
            return PubResult::Error(ErrorKind::MessageTooLarge.err());
        }
        if hdr.len() > 64 * 1024 {
            return PubResult::Error(ErrorKind::HeaderTooLarge.err());
        }
        let now = now_nanos();
        let mut msg_id = None;
        let mut ttl = 0i64;
        let incr = match counter::increment(hdr) {
            Ok(i) => i,
            Err(e) => return PubResult::Error(e),
        };
        if incr.is_some() && publish {
            if !cfg.allow_msg_counter {
                return PubResult::Error(counter::disabled());
            }
            if !data.is_empty() {
                return PubResult::Error(counter::has_payload());
            }
            if counter::conflicting_headers(hdr) {
                return PubResult::Error(counter::invalid());
            }
        }
        if !hdr.is_empty() {
            if publish {
                if let Some(exp) = headers::get(hdr, "Nats-Expected-Stream") {
                    if exp != cfg.name.as_bytes() {
                        return PubResult::Error(ErrorKind::ExpectedStreamMismatch.err());
                    }
                }
                // Only the sourcing path may write this header (the reference's rule).
                if headers::get(hdr, "Nats-Stream-Source").is_some_and(|v| !v.is_empty()) {
                    return PubResult::Error(ErrorKind::StreamSourceHeader.err());
                }
            }
            // A mirror keeps every message of its origin: it does not deduplicate.
            if !matches!(intake, Intake::Mirrored { .. }) {
                if let Some(id) = headers::get_str(hdr, "Nats-Msg-Id").filter(|s| !s.is_empty()) {
                    self.dedup.prune(now, cfg.duplicate_window);
                    if let Some(&seq) = self.dedup.ids.get(id) {
                        return PubResult::Duplicate(seq);
                    }
                    msg_id = Some(id.to_string());
                }
            }
            if publish {
                let last_seq = self.store.state().last_seq;
                if let Some(exp) = headers::get(hdr, "Nats-Expected-Last-Sequence") {
                    if parse_u64(exp) != Some(last_seq) {
                        return PubResult::Error(wrong_last_seq(last_seq));
                    }
                }
                if let Some(exp) = headers::get_str(hdr, "Nats-Expected-Last-Msg-Id") {
                    if exp != self.last_msg_id {
                        return PubResult::Error(ErrorKind::WrongLastMsgId.with(&self.last_msg_id));
                    }
                }
                if let Some(exp) = headers::get(hdr, "Nats-Expected-Last-Subject-Sequence") {
                    let subj = headers::get_str(hdr, "Nats-Expected-Last-Subject-Sequence-Subject")
                        .map(str::to_string)
                        .unwrap_or_else(|| String::from_utf8_lossy(&subject).into_owned());
                    let last = self.store.last_seq_for_subject(&subj);
                    if parse_u64(exp) != Some(last) {
                        return PubResult::Error(wrong_last_seq(last));
                    }
                }
            }
            if let Some(roll) = headers::get_str(hdr, "Nats-Rollup") {
                if publish && !cfg.allow_rollup_hdrs {
                    return PubResult::Error(ErrorKind::RollupFailed.with("rollup not permitted"));
                }
                if roll != "sub" && roll != "all" {
                    return PubResult::Error(
                        ErrorKind::RollupFailed.with(format!("rollup value invalid: {roll:?}")),
                    );
                }
            }
            if let Some(v) = headers::get_str(hdr, "Nats-TTL") {
                if publish && !cfg.allow_msg_ttl {
                    return PubResult::Error(ErrorKind::MsgTtlDisabled.err());
                }
                match parse_ttl(v) {
                    Some(secs) => ttl = secs,
                    None => return PubResult::Error(ErrorKind::MsgTtlInvalid.err()),
                }
            }
        }
        // A counter stores the subject's new total instead of what was published.
        let counted;
        let (hdr, data, total) = match incr {
            None if cfg.allow_msg_counter => return PubResult::Error(counter::missing()),
            Some(incr) if cfg.allow_msg_counter => {
                let last = std::str::from_utf8(&subject)
                    .ok()
                    .and_then(|s| self.store.load_last(s).ok());
                match counter::next(
                    last.as_ref().map(|m| (&m.hdr[..], &m.data[..])),
                    hdr,
                    data,
                    incr,
                ) {
                    Ok(c) => {
                        counted = c;
                        if cfg.max_msg_size >= 0
                            && (counted.0.len() + counted.1.len()) as i64 > cfg.max_msg_size as i64
                        {
                            return PubResult::Error(ErrorKind::MessageTooLarge.err());
                        }
                        (&counted.0[..], &counted.1[..], Some(counted.2.clone()))
                    }
                    Err(e) => return PubResult::Error(e),
                }
            }
            _ => (hdr, data, None),
        };
        // With delete markers a TTL is at least the marker TTL (so a marker left for the
        // subject cannot outlive a newer message), and the stored header says so.
        let sdm = cfg.subject_delete_marker_ttl / 1_000_000_000;
        let bumped;
        let hdr = if ttl > 0 && sdm > 0 && cfg.max_msgs_per_subject != 1 && ttl < sdm {
            ttl = sdm;
            bumped = super::expiry::with_ttl_header(hdr, sdm);
            &bumped[..]
        } else {
            hdr
        };
        let last_on_subject = match &self.republisher {
            Some(_) => std::str::from_utf8(&subject)
                .map(|s| self.store.last_seq_for_subject(s))
                .unwrap_or(0),
            None => 0,
        };
        let stored = match intake {
            Intake::Mirrored { seq, ts } => self
                .store
                .skip_to(seq)
                .and_then(|_| self.store.store_msg(&subject, hdr, data, ts))
                .map(|s| (s, ts)),
            _ => self
                .store
                .store_msg(&subject, hdr, data, now)
                .map(|s| (s, now)),
        };
        let (seq, ts) = match stored {
            Ok(x) => x,
            Err(e) => {
                self.io_error |= matches!(e, StoreError::Io(_));
                return PubResult::Error(store_error(e));
            }
        };
        let cfg = &self.config;
        if cfg.allow_rollup_hdrs && !cfg.deny_purge {
            if let Some(roll) = headers::get_str(hdr, "Nats-Rollup") {
                let filter = match roll {
                    "sub" => Some(String::from_utf8_lossy(&subject).into_owned()),
                    _ => None,
                };
                let _ = self.store.purge(&Purge {
                    filter,
                    seq: None,
                    keep: Some(1),
                });
            }
        }
        if ttl > 0 && cfg.allow_msg_ttl {
            self.ttls.insert((ts + ttl * 1_000_000_000, seq));
        } else if ttl < 0 {
            self.store.exempt_from_max_age(seq);
        }
        self.last_msg_id = msg_id.clone().unwrap_or_default();
        if let Some(id) = msg_id {
            self.dedup.insert(id, seq, now);
        }
        if let Some(rp) = &self.republisher {
            if let Some(p) = rp.prepare(&cfg.name, &subject, hdr, data, seq, ts, last_on_subject) {
                self.republish_out.push(p);
            }
        }
        match total {
            Some(t) => PubResult::Counted(seq, t),
            None => PubResult::Stored(seq),
        }
    }
}

/// `Nats-TTL` as the reference reads it: `never` (no expiry, -1), a Go duration of at least
/// one second, or whole seconds; None when invalid.
pub(super) fn parse_ttl(v: &str) -> Option<i64> {
    if v.eq_ignore_ascii_case("never") {
        return Some(-1);
    }
    if let Ok(d) = crate::conf::parse_duration(v) {
        if v.chars().any(|c| c.is_ascii_alphabetic()) {
            return (d >= Duration::from_secs(1)).then_some(d.as_secs() as i64);
        }
    }
    v.parse::<i64>().ok().filter(|s| *s >= 0)
}

fn wrong_last_seq(actual: u64) -> ApiError {
    ErrorKind::WrongLastSequence.with(actual)
}

fn parse_u64(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b).ok()?.trim().parse().ok()
}

pub fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::MaxMsgs | StoreError::MaxMsgsPerSubject => {
            ErrorKind::StoreFailed.with(e.to_string())
        }
        StoreError::MaxBytes => ErrorKind::StoreFailed.with(e.to_string()),
        StoreError::MsgTooLarge => ErrorKind::MessageTooLarge.err(),
        StoreError::NotFound => ErrorKind::NoMessageFound.err(),
        StoreError::Io(t) => ErrorKind::StoreFailed.with(t),
        e @ (StoreError::Sequence { .. } | StoreError::Unsupported(_)) => {
            ErrorKind::StoreFailed.with(e.to_string())
        }
    }
}

/// Writes the stream's config durably (checksummed, replaced atomically).
pub fn write_meta(files: &MetaFiles, dir: &Path, meta: &StreamMeta) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(meta).map_err(std::io::Error::other)?;
    files.write(&dir.join("keel-meta.json"), &body, true)
}

pub fn read_meta(
    files: &MetaFiles,
    dir: &Path,
    log: &crate::log::Log,
) -> Result<StreamMeta, String> {
    let b = super::files::read(files, &dir.join("keel-meta.json"), "Stream config", log)?
        .ok_or("no stream config (keel-meta.json)")?;
    serde_json::from_slice(&b).map_err(|e| e.to_string())
}

/// Most messages and bytes in one group-commit batch.
const BATCH_MSGS: usize = 4096;
const BATCH_BYTES: usize = 8 * 1024 * 1024;
/// A consumer directory holding nothing but temporary files: what a create that failed
/// before writing its config leaves.
pub(super) fn leftover(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .all(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
    })
}

/// Takes publishes off the stream's queue in batches: store all, sync once, ack all.
async fn publish_loop(
    stream: Arc<Stream>,
    server: Arc<Server>,
    mut rx: crate::inqueue::Receiver,
    mut sourced_rx: tokio::sync::mpsc::Receiver<SourcedBatch>,
) {
    let mut router = Router::new(stream.account().clone(), stream.created as u64);
    let mut batch = Vec::with_capacity(256);
    let mut closed = stream.handle_closed();
    loop {
        tokio::select! {
            n = rx.recv_many(&mut batch, BATCH_MSGS, BATCH_BYTES) => if n == 0 {
                break;
            },
            Some(b) = sourced_rx.recv() => {
                stream.apply_sourced(&server, &mut router, b);
                continue;
            }
            _ = crate::client::until_true(&mut closed) => break,
        }
        // The fsync blocks; let tokio move other work off this thread meanwhile.
        let budget = server
            .jetstream
            .get()
            .and_then(|js| js.store_budget(&stream));
        let acks = if stream.sync_always && stream.storage == StorageType::File {
            tokio::task::block_in_place(|| {
                stream.process_batch(&mut batch, budget, super::domain(&server))
            })
        } else {
            stream.process_batch(&mut batch, budget, super::domain(&server))
        };
        // The committed watch wakes the consumers (and streams sourcing this one).
        stream.after_commit(&server, &mut router);
        for (reply, body) in acks {
            let body = Bytes::from(body);
            router.route(
                &server,
                &Outgoing {
                    subject: &reply,
                    reply: None,
                    hdr_len: None,
                    data: &body,
                },
                None,
            );
        }
        router.flush();
        if batch.capacity() > 1024 && rx.is_empty() {
            // A burst is over: do not keep its batch's capacity.
            batch = Vec::with_capacity(256);
        }
    }
}

impl Stream {
    fn handle_closed(&self) -> tokio::sync::watch::Receiver<bool> {
        self.handle.closed_rx()
    }

    /// After a committed (synced) batch: wake streams sourcing this one and send the
    /// batch's republishes.
    pub(super) fn after_commit(&self, server: &Server, router: &mut Router) {
        let (last, pending) = {
            let mut inner = self.lock();
            (inner.store.state().last_seq, inner.take_republish())
        };
        self.committed.send_if_modified(|v| {
            let changed = *v != last;
            *v = last;
            changed
        });
        republish::publish(server, router, pending);
    }

    /// The last committed sequence: consumers and streams sourcing this one wake on it,
    /// and consumers deliver nothing past it.
    pub fn committed_watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.committed.subscribe()
    }

    pub fn committed_seq(&self) -> u64 {
        *self.committed.borrow()
    }

    pub(super) fn sourced_queue(&self) -> &tokio::sync::mpsc::Sender<SourcedBatch> {
        &self.sourced_tx
    }

    /// (Re)starts the sources or mirror for the current config (an update may change them).
    pub fn restart_sourcing(self: &Arc<Self>, server: &Arc<Server>) {
        let cfg = self.config();
        let mut slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        let mut previous = sourcing::Positions::new();
        if let Some(old) = slot.take() {
            old.stop();
            let idents = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
            previous = old.positions(&idents.0);
        }
        // From here on batches the old tasks still have queued are refused.
        let gen = {
            let _inner = self.lock();
            self.sourcing_gen.fetch_add(1, Ordering::AcqRel) + 1
        };
        *slot = sourcing::start(server, self, &cfg, gen, &previous).map(|(s, idents)| {
            let mut g = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
            g.0 = idents;
            s
        });
    }

    pub fn stop_sourcing(&self) {
        let mut slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = slot.take() {
            old.stop();
        }
    }

    /// `mirror` / `sources` for stream info.
    pub fn sourcing_info(&self) -> Vec<(&'static str, Value)> {
        let slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        slot.as_ref().map(|s| s.info()).unwrap_or_default()
    }

    /// A mirror with `mirror_direct` that is caught up answers its origin's direct gets.
    pub fn serves_mirror_direct(&self, origin: &str) -> bool {
        let current = self
            .sourcing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|s| s.mirror_current());
        if !current {
            return false;
        }
        let inner = self.lock();
        inner.config.mirror_direct
            && inner
                .config
                .mirror
                .as_ref()
                .is_some_and(|m| m.name == origin)
    }

    /// A source committed progress; its position is saved by [`Self::save_source_positions`].
    pub(super) fn sources_progressed(&self, ident: Option<(String, String)>) {
        let mut g = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((iname, id)) = ident {
            g.0.insert(iname, id);
        }
        g.1 = true;
    }

    /// Writes the sources' positions when they changed (`durable`: fsynced, at shutdown).
    pub fn save_source_positions(&self, durable: bool) {
        if self.storage != StorageType::File {
            return;
        }
        let idents = {
            let mut g = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
            if !g.1 && !durable {
                return;
            }
            g.1 = false;
            g.0.clone()
        };
        let slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slot.as_ref() {
            sourcing::save_positions(
                &self.meta,
                self.handle.log(),
                &self.dir,
                s,
                &idents,
                durable,
            );
        }
    }

    /// Stores a batch from a source or the mirror, syncs it, and answers its task; then the
    /// same follow-up as a publish batch (consumers, republish, sourcing streams).
    fn apply_sourced(&self, server: &Arc<Server>, router: &mut Router, b: SourcedBatch) {
        let budget = server.jetstream.get().and_then(|js| js.store_budget(self));
        let taken = if self.sync_always && self.storage == StorageType::File {
            tokio::task::block_in_place(|| self.store_sourced(&b.msgs, budget, b.gen))
        } else {
            self.store_sourced(&b.msgs, budget, b.gen)
        };
        let stored = taken.contains(&Taken::Stored);
        let _ = b.done.send(taken);
        if stored {
            self.after_commit(server, router);
        }
    }

    fn store_sourced(
        &self,
        msgs: &[sourcing::SourcedMsg],
        budget: Option<u64>,
        gen: u64,
    ) -> Vec<Taken> {
        // Interest retention keeps a message only while some consumer wants its subject.
        let interest: Option<Vec<Vec<String>>> = (self.retention() == Retention::Interest)
            .then(|| self.consumers.views().iter().map(|c| c.filters()).collect());
        let mut inner = self.lock();
        let mut out = Vec::with_capacity(msgs.len());
        if gen != self.sourcing_gen.load(Ordering::Acquire) {
            return vec![Taken::Refused(
                ErrorKind::StoreFailed.with("sources restarted"),
            )];
        }
        for m in msgs {
            if let Some(b) = budget {
                if inner.store.state().bytes >= b {
                    out.push(Taken::Refused(ErrorKind::InsufficientStorage.err()));
                    break;
                }
            }
            let intake = match m.mirror {
                Some((seq, ts)) => Intake::Mirrored { seq, ts },
                None => Intake::Sourced,
            };
            match inner.process_parts(&m.subject, &m.hdr, &m.data, intake) {
                PubResult::Stored(seq) | PubResult::Counted(seq, _) => {
                    if let Some(filters) = &interest {
                        let stored = inner.stored_subject(&m.subject);
                        let wanted = filters.iter().any(|f| {
                            f.is_empty()
                                || f.iter().any(|p| subject::matches(p.as_bytes(), &stored))
                        });
                        if !wanted {
                            let _ = inner.store.remove(seq, false);
                        }
                    }
                    out.push(Taken::Stored)
                }
                PubResult::Duplicate(_) => out.push(Taken::Skipped),
                PubResult::Error(e) => {
                    // Later messages wait until this one can be stored.
                    out.push(Taken::Refused(e));
                    break;
                }
            }
        }
        // As for publishes: after a failed write the sync rolls the batch back, and what
        // was rolled back is refused (the sourcing task offers it again later).
        if (out.contains(&Taken::Stored) && self.sync_always) || inner.io_error {
            let r = inner.store.sync();
            let n = out.iter().filter(|t| **t == Taken::Stored).count();
            inner.storage_result(self.handle.log(), &self.name, r, n, |text| {
                for t in out.iter_mut() {
                    if *t == Taken::Stored {
                        *t = Taken::Refused(ErrorKind::StoreFailed.with(text.to_string()));
                    }
                }
            });
        }
        self.refresh_bytes(&inner);
        out
    }

    /// Info `state` JSON.
    pub fn state_json(
        state: &State,
        consumers: usize,
        subjects: Option<&BTreeMap<String, u64>>,
        deleted: Option<&[u64]>,
    ) -> Value {
        let mut m = Map::new();
        m.insert("messages".into(), state.msgs.into());
        m.insert("bytes".into(), state.bytes.into());
        m.insert("first_seq".into(), state.first_seq.into());
        m.insert("first_ts".into(), rfc3339(state.first_ts).into());
        m.insert("last_seq".into(), state.last_seq.into());
        m.insert("last_ts".into(), rfc3339(state.last_ts).into());
        if state.num_subjects > 0 {
            m.insert("num_subjects".into(), state.num_subjects.into());
        }
        if let Some(s) = subjects {
            if !s.is_empty() {
                m.insert(
                    "subjects".into(),
                    serde_json::to_value(s).expect("map serializes"),
                );
            }
        }
        if state.num_deleted > 0 {
            m.insert("num_deleted".into(), state.num_deleted.into());
        }
        if let Some(d) = deleted {
            if !d.is_empty() {
                m.insert(
                    "deleted".into(),
                    serde_json::to_value(d).expect("vec serializes"),
                );
            }
        }
        if let Some(lost) = &state.lost {
            let mut l = Map::new();
            l.insert(
                "msgs".into(),
                serde_json::to_value(&lost.msgs).expect("vec serializes"),
            );
            l.insert("bytes".into(), lost.bytes.into());
            m.insert("lost".into(), Value::Object(l));
        }
        m.insert("consumer_count".into(), consumers.into());
        Value::Object(m)
    }
}
