//! Consumers: named cursors over a stream, kept on the server.
//!
//! Each consumer is one task (an actor) that owns its delivery loop. Pull requests, acks and
//! flow-control replies reach it through in-process subscriptions on
//! `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, `$JS.ACK.<stream>.<consumer>.>` and
//! `$JS.FC.<stream>.<consumer>.>`; the stream wakes it when new messages are stored. Its state
//! (delivered, ack floor, pending acks with delivery counts) sits behind a mutex so info
//! requests can read it, and durable consumers of file streams persist it: always before an
//! acknowledged ack (AckSync) is confirmed, and otherwise at most every 20 ms when it changed.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use keel_store::StoredMsg;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::api::ApiError;
use super::stream::{null_default, Retention, Stream, REQ_LEVEL_KEY};
use crate::client::{ClientHandle, InMsg};
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::sublist::Sub;
use crate::time::{now_nanos, parse_rfc3339, rfc3339};

fn is_false(b: &bool) -> bool {
    !*b
}
fn is_zero(n: &i64) -> bool {
    *n == 0
}
fn neg1() -> i64 {
    -1
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum DeliverPolicy {
    #[default]
    All,
    Last,
    New,
    ByStartSequence,
    ByStartTime,
    LastPerSubject,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum AckPolicy {
    /// Go's zero value: a create request without `ack_policy` gets none, as with the reference.
    #[default]
    None,
    All,
    Explicit,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReplayPolicy {
    #[default]
    Instant,
    Original,
}

/// A consumer's configuration, in the reference's key order; zero values are left out.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct ConsumerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default)]
    pub deliver_policy: DeliverPolicy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opt_start_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opt_start_time: Option<String>,
    #[serde(default)]
    pub ack_policy: AckPolicy,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ack_wait: i64,
    #[serde(default = "neg1")]
    pub max_deliver: i64,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_default"
    )]
    pub backoff: Vec<i64>,
    #[serde(
        default,
        skip_serializing_if = "String::is_empty",
        deserialize_with = "null_default"
    )]
    pub filter_subject: String,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_default"
    )]
    pub filter_subjects: Vec<String>,
    #[serde(default)]
    pub replay_policy: ReplayPolicy,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rate_limit_bps: i64,
    #[serde(
        default,
        skip_serializing_if = "String::is_empty",
        deserialize_with = "null_default"
    )]
    pub sample_freq: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_waiting: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_ack_pending: i64,
    #[serde(default, skip_serializing_if = "is_false")]
    pub flow_control: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub headers_only: bool,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_batch: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_expires: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_bytes: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deliver_subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deliver_group: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub idle_heartbeat: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inactive_threshold: i64,
    #[serde(default)]
    pub num_replicas: i64,
    #[serde(default, skip_serializing_if = "is_false")]
    pub mem_storage: bool,
    #[serde(default, deserialize_with = "null_default")]
    pub metadata: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_until: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CreateRequest {
    pub stream_name: String,
    pub config: Option<ConsumerConfig>,
    pub action: String,
}

const DEFAULT_ACK_WAIT: i64 = 30_000_000_000;
const DEFAULT_MAX_ACK_PENDING: i64 = 1000;
const DEFAULT_MAX_WAITING: i64 = 512;
const DEFAULT_INACTIVE: i64 = 5_000_000_000;
/// How often a durable consumer's changed state is written when no AckSync forces it.
const SAVE_INTERVAL: Duration = Duration::from_millis(20);
/// Push flow control: ask for a reply every this many bytes, stall at twice as many.
const FC_WINDOW: usize = 1024 * 1024;

impl ConsumerConfig {
    pub fn is_push(&self) -> bool {
        self.deliver_subject
            .as_deref()
            .is_some_and(|s| !s.is_empty())
    }

    pub fn filters(&self) -> Vec<String> {
        if !self.filter_subject.is_empty() {
            vec![self.filter_subject.clone()]
        } else {
            self.filter_subjects.clone()
        }
    }

    /// Defaults and the reference's checks. `stream` is the stream's config.
    pub fn normalize(mut self, retention: Retention) -> Result<ConsumerConfig, ApiError> {
        let bad = |code: u32, text: &str| ApiError::new(400, code, text);
        if let (Some(d), Some(n)) = (&self.durable_name, &self.name) {
            if !d.is_empty() && !n.is_empty() && d != n {
                return Err(bad(
                    10132,
                    "Consumer Durable and Name have to be equal if both are provided",
                ));
            }
        }
        for n in [&self.durable_name, &self.name].into_iter().flatten() {
            if n.is_empty() {
                continue;
            }
            if n.contains('/') || n.contains('\\') {
                return Err(bad(10127, "Consumer name can not contain path separators"));
            }
            if !super::stream::valid_name(n) {
                return Err(ApiError::invalid_config(
                    "consumer name can not contain '.', '*', '>', '\\', '/'",
                ));
            }
            if n.len() > 255 {
                return Err(bad(
                    10102,
                    "consumer name is too long, maximum allowed is 255",
                ));
            }
        }
        if self.durable_name.as_deref() == Some("") {
            self.durable_name = None;
        }
        if self.name.as_deref() == Some("") {
            self.name = None;
        }
        if !self.filter_subject.is_empty() && !self.filter_subjects.is_empty() {
            return Err(bad(
                10136,
                "consumer cannot have both FilterSubject and FilterSubjects specified",
            ));
        }
        if self.filter_subject == ">" {
            self.filter_subject.clear();
        }
        for f in self.filters() {
            if f.is_empty() {
                return Err(bad(
                    10139,
                    "consumer filter in FilterSubjects cannot be empty",
                ));
            }
            if !keel_protocol::subject::valid_subscribe(f.as_bytes()) {
                return Err(ApiError::invalid_config(
                    "consumer filter subject is not valid",
                ));
            }
        }
        let filters = self.filters();
        for (i, a) in filters.iter().enumerate() {
            for b in &filters[i + 1..] {
                if super::stream::subjects_overlap(a, b) {
                    return Err(bad(10138, "consumer subject filters cannot overlap"));
                }
            }
        }
        if self.ack_wait < 0 {
            return Err(bad(10183, "consumer ack wait needs to be positive"));
        }
        if self.backoff.iter().any(|b| *b <= 0) {
            return Err(bad(10184, "consumer backoff needs to be positive"));
        }
        if !self.backoff.is_empty() {
            if self.max_deliver > 0 && self.max_deliver <= self.backoff.len() as i64 {
                return Err(bad(
                    10116,
                    "max deliver is required to be > length of backoff values",
                ));
            }
            // The reference stores the first backoff value as ack_wait.
            self.ack_wait = self.backoff[0];
        }
        if self.ack_policy == AckPolicy::None {
            // Nothing waits for acks: the reference leaves ack_wait out.
            self.ack_wait = 0;
        } else if self.ack_wait == 0 {
            self.ack_wait = DEFAULT_ACK_WAIT;
        }
        if self.max_deliver == 0 {
            self.max_deliver = -1;
        }
        if self.is_push() {
            let ds = self.deliver_subject.as_deref().unwrap_or_default();
            if !keel_protocol::subject::valid_publish(ds.as_bytes()) {
                return Err(bad(10079, "consumer deliver subject has wildcards"));
            }
            if self.max_waiting != 0 {
                return Err(bad(10080, "consumer in push mode can not set max waiting"));
            }
            if self.flow_control && self.idle_heartbeat <= 0 {
                return Err(bad(
                    10108,
                    "consumer with flow control also needs heartbeats",
                ));
            }
            if self.max_batch != 0 || self.max_expires != 0 || self.max_bytes != 0 {
                return Err(ApiError::invalid_config(
                    "consumer in push mode can not set max batch, max expires or max bytes",
                ));
            }
        } else {
            self.deliver_subject = None;
            if self.deliver_group.is_some() {
                return Err(ApiError::invalid_config(
                    "consumer in pull mode can not have a deliver group",
                ));
            }
            if self.flow_control {
                return Err(bad(
                    10089,
                    "consumer flow control requires a push based consumer",
                ));
            }
            if self.rate_limit_bps != 0 {
                return Err(bad(
                    10086,
                    "consumer in pull mode can not have rate limit set",
                ));
            }
            if self.max_waiting < 0 {
                return Err(bad(10087, "consumer max waiting needs to be positive"));
            }
            if self.max_waiting == 0 {
                self.max_waiting = DEFAULT_MAX_WAITING;
            }
            if self.max_batch < 0 {
                return Err(bad(10114, "consumer max request batch needs to be > 0"));
            }
            if self.max_expires != 0 && self.max_expires < 1_000_000 {
                return Err(bad(
                    10115,
                    "consumer max request expires needs to be >= 1ms",
                ));
            }
        }
        if !self.is_push() && self.idle_heartbeat != 0 {
            return Err(bad(
                10088,
                "consumer idle heartbeat requires a push based consumer",
            ));
        }
        if self.idle_heartbeat != 0 && self.idle_heartbeat < 100_000_000 {
            return Err(bad(10083, "consumer idle heartbeat needs to be >= 100ms"));
        }
        if self.ack_policy == AckPolicy::None {
            if self.max_ack_pending > 0 {
                // Nothing is ever pending without acks; the reference drops the limit.
                self.max_ack_pending = 0;
            }
        } else if self.max_ack_pending == 0 {
            self.max_ack_pending = DEFAULT_MAX_ACK_PENDING;
        }
        if self.max_ack_pending < -1 {
            self.max_ack_pending = -1;
        }
        match self.deliver_policy {
            DeliverPolicy::ByStartSequence if self.opt_start_seq.unwrap_or(0) == 0 => {
                return Err(bad(
                    10094,
                    "consumer delivery policy is deliver by start sequence, but optional start sequence is not set",
                ));
            }
            DeliverPolicy::LastPerSubject if self.filters().is_empty() => {
                return Err(bad(
                    10094,
                    "consumer delivery policy is deliver last per subject, but optional filter subject is not set",
                ));
            }
            DeliverPolicy::ByStartTime => match &self.opt_start_time {
                Some(t) if parse_rfc3339(t).is_some() => {}
                _ => {
                    return Err(bad(
                        10094,
                        "consumer delivery policy is deliver by start time, but optional start time is not set",
                    ))
                }
            },
            p if p != DeliverPolicy::ByStartSequence && self.opt_start_seq.unwrap_or(0) > 0 => {
                return Err(bad(
                    10094,
                    &format!(
                        "consumer delivery policy is deliver {}, but optional start sequence is also set",
                        policy_name(p)
                    ),
                ));
            }
            p if p != DeliverPolicy::ByStartTime && self.opt_start_time.is_some() => {
                return Err(bad(
                    10094,
                    &format!(
                        "consumer delivery policy is deliver {}, but optional start time is also set",
                        policy_name(p)
                    ),
                ));
            }
            _ => {}
        }
        if retention == Retention::Workqueue {
            if self.ack_policy != AckPolicy::Explicit {
                return Err(if self.is_push() {
                    bad(10098, "workqueue stream requires explicit ack")
                } else {
                    bad(
                        10084,
                        "consumer in pull mode requires explicit ack policy on workqueue stream",
                    )
                });
            }
            if self.deliver_policy != DeliverPolicy::All {
                return Err(bad(
                    10101,
                    "consumer must be deliver all on workqueue stream",
                ));
            }
        }
        let durable = self.durable_name.is_some();
        if !durable && self.inactive_threshold == 0 {
            self.inactive_threshold = DEFAULT_INACTIVE;
        }
        for k in ["_nats.level", "_nats.ver"] {
            self.metadata.remove(k);
        }
        self.metadata.insert(REQ_LEVEL_KEY.into(), "0".into());
        if self.num_replicas > 1 {
            return Err(ApiError::replicas_not_supported());
        }
        self.num_replicas = 0;
        Ok(self)
    }

    /// Features Keel does not implement: refused clearly rather than silently ignored.
    /// Checked after the update rules so an update gets the reference's error first.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        if !self.sample_freq.is_empty() {
            return Err(ApiError::not_supported("consumer sampling"));
        }
        if self.replay_policy == ReplayPolicy::Original {
            return Err(ApiError::not_supported("replay policy original"));
        }
        if self.rate_limit_bps > 0 {
            return Err(ApiError::not_supported("consumer rate limits"));
        }
        Ok(())
    }

    /// What an update may not change (the reference's rules).
    pub fn check_update(&self, new: &ConsumerConfig) -> Result<(), ApiError> {
        let fail = |what: &str| {
            Err(ApiError::new(
                500,
                10012,
                format!("{what} can not be updated"),
            ))
        };
        if self.ack_policy != new.ack_policy {
            return fail("ack policy");
        }
        if self.deliver_policy != new.deliver_policy {
            return fail("deliver policy");
        }
        if self.opt_start_seq != new.opt_start_seq {
            return fail("start sequence");
        }
        if self.opt_start_time != new.opt_start_time {
            return fail("start time");
        }
        if self.replay_policy != new.replay_policy {
            return fail("replay policy");
        }
        if self.mem_storage != new.mem_storage {
            return fail("storage type");
        }
        if self.is_push() != new.is_push() {
            let text = if self.is_push() {
                "can not update push consumer to pull based"
            } else {
                "can not update pull consumer to push based"
            };
            return Err(ApiError::new(500, 10012, text));
        }
        if self.max_waiting != new.max_waiting {
            return fail("max waiting");
        }
        Ok(())
    }

    fn to_json(&self, dynamic_meta: bool) -> Value {
        super::stream::config_json(self, dynamic_meta)
    }
}

/// `{consumer_seq, stream_seq}` as info shows it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqPair {
    pub consumer_seq: u64,
    pub stream_seq: u64,
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    cseq: u64,
    /// When an ack is due; passed deadlines queue the message for redelivery.
    deadline: Instant,
}

/// A waiting pull request.
struct PullRequest {
    id: u64,
    reply: Bytes,
    batch: i64,
    /// Byte budget left; 0 when the request set none.
    max_bytes: i64,
    expires: Option<Instant>,
    heartbeat: Option<Duration>,
    next_hb: Option<Instant>,
}

/// What is persisted for a durable consumer.
#[derive(Serialize, Deserialize, Default)]
struct SavedState {
    delivered: SeqPair,
    ack_floor: SeqPair,
    /// (stream seq, consumer seq) delivered and not acked.
    pending: Vec<(u64, u64)>,
    /// (stream seq, deliveries) of redelivered messages.
    redelivered: Vec<(u64, u64)>,
}

#[derive(Serialize, Deserialize)]
pub struct ConsumerMeta {
    pub config: ConsumerConfig,
    pub created: i64,
}

pub struct State {
    pub config: ConsumerConfig,
    delivered: SeqPair,
    ack_floor: SeqPair,
    pending: BTreeMap<u64, Pending>,
    /// Deliveries so far of messages delivered more than once.
    redelivered: HashMap<u64, u64>,
    /// Stream sequences due for redelivery, oldest first.
    rdq: BTreeSet<u64>,
    /// Initial deliveries of deliver-policy last_per_subject, in order.
    lps: VecDeque<u64>,
    /// Next stream sequence to look at for a first delivery.
    next_seq: u64,
    waiting: VecDeque<PullRequest>,
    last_active: Instant,
    last_delivery: i64,
    last_ack: i64,
    /// Push flow control: bytes sent since the last request, and the unanswered request.
    fc_bytes: usize,
    fc_pending: Option<String>,
    fc_seq: u64,
    pull_seq: u64,
    last_push_hb: Instant,
    push_bound: bool,
    dirty: bool,
    last_save: Instant,
    deleted: bool,
}

pub struct Consumer {
    pub name: String,
    pub stream: Arc<Stream>,
    pub created: i64,
    pub durable: bool,
    state: Mutex<State>,
    handle: Arc<ClientHandle>,
    subs: Mutex<Vec<Arc<Sub>>>,
    /// Set when there is news (stored messages); the task clears it.
    kick: AtomicBool,
    wake: tokio::sync::Notify,
    dir: Option<PathBuf>,
}

/// An ack parsed from `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`.
struct AckInfo {
    sseq: u64,
}

fn parse_ack_subject(subject: &[u8]) -> Option<AckInfo> {
    let s = std::str::from_utf8(subject).ok()?;
    let t: Vec<&str> = s.split('.').collect();
    if t.len() < 9 {
        return None;
    }
    // Count from the end so the longer (domain, account hash) forms parse too.
    let n = t.len();
    Some(AckInfo {
        sseq: t[n - 4].parse().ok()?,
    })
}

fn status_hdr(status: &str, headers: &[(&str, String)]) -> Vec<u8> {
    let mut h = format!("NATS/1.0 {status}\r\n");
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    h.push_str("\r\n");
    h.into_bytes()
}

fn policy_name(p: DeliverPolicy) -> &'static str {
    match p {
        DeliverPolicy::All => "all",
        DeliverPolicy::Last => "last",
        DeliverPolicy::New => "new",
        DeliverPolicy::ByStartSequence => "by start sequence",
        DeliverPolicy::ByStartTime => "by start time",
        DeliverPolicy::LastPerSubject => "last per subject",
    }
}

impl Consumer {
    /// Creates the consumer, restores saved state when `dir` holds some, subscribes and
    /// starts its task.
    pub fn start(
        server: &Arc<Server>,
        stream: &Arc<Stream>,
        name: String,
        meta: ConsumerMeta,
        dir: Option<PathBuf>,
    ) -> Arc<Consumer> {
        let config = meta.config;
        let durable = config.durable_name.is_some();
        let saved = dir
            .as_deref()
            .map_or(Loaded::Fresh, |d| load_state(d, &stream.name, &name));
        let now = Instant::now();
        let mut st = State {
            config,
            delivered: SeqPair::default(),
            ack_floor: SeqPair::default(),
            pending: BTreeMap::new(),
            redelivered: HashMap::new(),
            rdq: BTreeSet::new(),
            lps: VecDeque::new(),
            next_seq: 1,
            waiting: VecDeque::new(),
            last_active: now,
            last_delivery: 0,
            last_ack: 0,
            fc_bytes: 0,
            fc_pending: None,
            fc_seq: 0,
            pull_seq: 0,
            last_push_hb: now,
            push_bound: false,
            dirty: false,
            last_save: now,
            deleted: false,
        };
        match saved {
            Loaded::Saved(s) => {
                st.delivered = s.delivered;
                st.ack_floor = s.ack_floor;
                st.next_seq = s.delivered.stream_seq + 1;
                // Delivered but unacked before the restart: redeliver them now.
                for (sseq, cseq) in s.pending {
                    st.pending.insert(
                        sseq,
                        Pending {
                            cseq,
                            deadline: now,
                        },
                    );
                    st.rdq.insert(sseq);
                }
                st.redelivered = s.redelivered.into_iter().collect();
                st.check_against(stream, &name);
            }
            Loaded::Fresh => st.init_position(stream),
            Loaded::Untrusted => st.safe_position(stream, meta.created),
        }
        let (handle, rx) = ClientHandle::internal(server.next_client_id());
        let c = Arc::new(Consumer {
            name: name.clone(),
            stream: stream.clone(),
            created: meta.created,
            durable,
            state: Mutex::new(st),
            handle,
            subs: Mutex::new(Vec::new()),
            kick: AtomicBool::new(true),
            wake: tokio::sync::Notify::new(),
            dir,
        });
        let s = &stream.name;
        let acks = c.lock().config.ack_policy != AckPolicy::None;
        let subjects = [
            Some(format!("$JS.API.CONSUMER.MSG.NEXT.{s}.{name}")),
            // Exactly the 9-token ack form: anything else finds nobody (503), as with the
            // reference; an ack-none consumer listens for no acks at all.
            acks.then(|| format!("$JS.ACK.{s}.{name}.*.*.*.*.*")),
            Some(format!("$JS.FC.{s}.{name}.>")),
        ];
        for subj in subjects.into_iter().flatten() {
            let sub = Arc::new(Sub {
                client: c.handle.clone(),
                sid: Bytes::from_static(b"c"),
                subject: Bytes::from(subj),
                queue: None,
                max: AtomicU64::new(0),
                delivered: AtomicU64::new(0),
            });
            server.sublist.insert(sub.clone());
            c.subs.lock().unwrap_or_else(|e| e.into_inner()).push(sub);
        }
        tokio::spawn(run(c.clone(), server.clone(), rx));
        c
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn config(&self) -> ConsumerConfig {
        self.lock().config.clone()
    }

    /// New messages were stored: wake the task (once, however many arrive).
    pub fn notify(&self) {
        if !self.kick.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// Stops the task, drops the subscriptions, and tells waiting pulls.
    pub fn stop(&self, server: &Server, router: &mut Router) {
        let waiting: Vec<Bytes> = {
            let mut st = self.lock();
            st.deleted = true;
            st.waiting.drain(..).map(|w| w.reply).collect()
        };
        for reply in waiting {
            send_status(
                server,
                router,
                &reply,
                &status_hdr("409 Consumer Deleted", &[]),
            );
        }
        for s in self
            .subs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            server.sublist.remove(&s);
        }
        self.handle
            .close(crate::client::CloseReason::ServerShutdown);
        self.wake.notify_one();
    }

    pub fn persist_meta(&self) -> std::io::Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let meta = ConsumerMeta {
            config: self.config(),
            created: self.created,
        };
        super::files::write(
            &dir.join("meta.json"),
            &serde_json::to_vec_pretty(&meta)?,
            true,
        )
    }

    /// Has the consumer finished with `seq` (acked, or past it and not pending)?
    pub fn is_done_with(&self, seq: u64, subject: &[u8]) -> bool {
        let st = self.lock();
        if !st.matches(subject) {
            return true;
        }
        seq <= st.ack_floor.stream_seq
            || (seq < st.next_seq && !st.pending.contains_key(&seq) && !st.rdq.contains(&seq))
    }

    /// Consumer info fields (without `type`).
    pub fn info(&self, server: &Server, dynamic_meta: bool) -> Map<String, Value> {
        let st = self.lock();
        let num_pending = st.num_pending(&self.stream);
        let mut f = Map::new();
        f.insert("stream_name".into(), self.stream.name.clone().into());
        f.insert("name".into(), self.name.clone().into());
        f.insert("created".into(), rfc3339(self.created).into());
        f.insert("config".into(), st.config.to_json(dynamic_meta));
        let mut delivered = serde_json::to_value(st.delivered).expect("pair serializes");
        if st.last_delivery > 0 {
            delivered["last_active"] = rfc3339(st.last_delivery).into();
        }
        f.insert("delivered".into(), delivered);
        let mut floor = serde_json::to_value(st.ack_floor).expect("pair serializes");
        if st.last_ack > 0 {
            floor["last_active"] = rfc3339(st.last_ack).into();
        }
        f.insert("ack_floor".into(), floor);
        f.insert("num_ack_pending".into(), st.pending.len().into());
        f.insert("num_redelivered".into(), st.redelivered.len().into());
        f.insert("num_waiting".into(), st.waiting.len().into());
        f.insert("num_pending".into(), num_pending.into());
        if let Some(ds) = &st.config.deliver_subject {
            if !server.sublist.matches(ds.as_bytes()).is_empty() {
                f.insert("push_bound".into(), true.into());
            }
        }
        f.insert("ts".into(), rfc3339(now_nanos()).into());
        f
    }

    /// Writes and syncs the state now (clean shutdown).
    pub fn flush_state(&self) {
        let mut st = self.lock();
        self.save(&mut st, true);
    }

    /// Writes the state (fsynced with `sync`); false if that failed.
    fn save(&self, st: &mut State, sync: bool) -> bool {
        st.dirty = false;
        st.last_save = Instant::now();
        let Some(dir) = &self.dir else { return true };
        if st.deleted {
            // Its directory is being removed: writing would bring it back.
            return true;
        }
        let saved = SavedState {
            delivered: st.delivered,
            ack_floor: st.ack_floor,
            pending: st.pending.iter().map(|(s, p)| (*s, p.cseq)).collect(),
            redelivered: st.redelivered.iter().map(|(s, n)| (*s, *n)).collect(),
        };
        let bytes = serde_json::to_vec(&saved).expect("state serializes");
        if let Err(e) = super::files::write(&dir.join("state.json"), &bytes, sync) {
            crate::error!(
                "Consumer {} > {}: could not save state: {e}",
                self.stream.name,
                self.name
            );
            st.dirty = true;
            return false;
        }
        true
    }
}

impl State {
    fn matches(&self, subject: &[u8]) -> bool {
        let filters = self.config.filters();
        filters.is_empty()
            || filters
                .iter()
                .any(|f| keel_protocol::subject::matches(f.as_bytes(), subject))
    }

    /// Where a new consumer starts, by deliver policy.
    fn init_position(&mut self, stream: &Stream) {
        let inner = stream.lock();
        let state = inner.store.state();
        let filters = self.config.filters();
        let last_matching = || -> u64 {
            if filters.is_empty() {
                return state.last_seq;
            }
            filters
                .iter()
                .filter_map(|f| inner.store.load_last(f).ok().map(|m| m.seq))
                .max()
                .unwrap_or(0)
        };
        self.next_seq = match self.config.deliver_policy {
            DeliverPolicy::All => state.first_seq.max(1),
            DeliverPolicy::New => state.last_seq + 1,
            DeliverPolicy::Last => {
                let l = last_matching();
                if l == 0 {
                    state.last_seq + 1
                } else {
                    l
                }
            }
            DeliverPolicy::ByStartSequence => self.config.opt_start_seq.unwrap_or(1).max(1),
            DeliverPolicy::ByStartTime => {
                let t = self
                    .config
                    .opt_start_time
                    .as_deref()
                    .and_then(parse_rfc3339)
                    .unwrap_or(0);
                let mut seq = state.first_seq.max(1);
                loop {
                    match inner.store.load_next(seq, ">") {
                        Ok(m) if m.ts >= t => break m.seq,
                        Ok(m) => seq = m.seq + 1,
                        Err(_) => break state.last_seq + 1,
                    }
                }
            }
            DeliverPolicy::LastPerSubject => {
                let pats = if filters.is_empty() {
                    vec![">".to_string()]
                } else {
                    filters.clone()
                };
                let mut seqs: Vec<u64> = vec![];
                for p in &pats {
                    for subj in inner.store.subjects(p).keys() {
                        if let Ok(m) = inner.store.load_last(subj) {
                            seqs.push(m.seq);
                        }
                    }
                }
                seqs.sort_unstable();
                seqs.dedup();
                self.lps = seqs.into();
                state.last_seq + 1
            }
        };
        let start = self.lps.front().copied().unwrap_or(self.next_seq);
        self.delivered.stream_seq = start.saturating_sub(1);
        self.ack_floor.stream_seq = start.saturating_sub(1);
    }

    /// A saved state ahead of the stream (a disk that lost messages the stream could not
    /// account for) would skip the messages stored from now on: deliver from the stream's
    /// end instead.
    fn check_against(&mut self, stream: &Stream, name: &str) {
        let last = stream.state().last_seq;
        if self.delivered.stream_seq > last {
            crate::warn!(
                "Consumer {} > {name}: saved state has delivered up to {} but the stream ends at {last}; delivering from {}",
                stream.name,
                self.delivered.stream_seq,
                last + 1
            );
            self.delivered.stream_seq = last;
            self.ack_floor.stream_seq = self.ack_floor.stream_seq.min(last);
            self.next_seq = last + 1;
            let gone: Vec<u64> = self.pending.range(last + 1..).map(|(s, _)| *s).collect();
            for s in gone {
                self.pending.remove(&s);
                self.rdq.remove(&s);
            }
        }
    }

    /// Where to start when the saved state cannot be trusted: as early as the consumer
    /// could ever have wanted, so nothing is skipped (duplicates instead). Policies that
    /// start from a config value start there again; `new` starts from the first message
    /// stored after the consumer was created; the others from the stream's start.
    fn safe_position(&mut self, stream: &Stream, created: i64) {
        match self.config.deliver_policy {
            DeliverPolicy::ByStartSequence | DeliverPolicy::ByStartTime | DeliverPolicy::All => {
                self.init_position(stream)
            }
            DeliverPolicy::New => {
                let inner = stream.lock();
                let state = inner.store.state();
                let mut seq = state.first_seq.max(1);
                self.next_seq = loop {
                    match inner.store.load_next(seq, ">") {
                        Ok(m) if m.ts >= created => break m.seq,
                        Ok(m) => seq = m.seq + 1,
                        Err(_) => break state.last_seq + 1,
                    }
                };
                self.delivered.stream_seq = self.next_seq - 1;
                self.ack_floor.stream_seq = self.next_seq - 1;
            }
            DeliverPolicy::Last | DeliverPolicy::LastPerSubject => {
                let first = stream.state().first_seq.max(1);
                self.next_seq = first;
                self.delivered.stream_seq = first - 1;
                self.ack_floor.stream_seq = first - 1;
            }
        }
    }

    fn num_pending(&self, stream: &Stream) -> u64 {
        let inner = stream.lock();
        let filters = self.config.filters();
        let n = if filters.is_empty() {
            inner.store.num_pending(self.next_seq, ">", false)
        } else {
            filters
                .iter()
                .map(|f| inner.store.num_pending(self.next_seq, f, false))
                .sum()
        };
        n + self.lps.len() as u64
    }

    /// The next message for a first delivery, if any.
    fn next_new(&mut self, stream: &Stream) -> Option<StoredMsg> {
        let inner = stream.lock();
        while let Some(seq) = self.lps.front().copied() {
            self.lps.pop_front();
            if let Ok(m) = inner.store.load(seq) {
                return Some(m);
            }
        }
        let filters = self.config.filters();
        let found = if filters.is_empty() {
            inner.store.load_next(self.next_seq, ">").ok()
        } else {
            filters
                .iter()
                .filter_map(|f| inner.store.load_next(self.next_seq, f).ok())
                .min_by_key(|m| m.seq)
        };
        if let Some(m) = &found {
            self.next_seq = m.seq + 1;
        }
        found
    }

    fn ack_wait_for(&self, deliveries: u64) -> Duration {
        let b = &self.config.backoff;
        let ns = if b.is_empty() {
            self.config.ack_wait
        } else {
            b[((deliveries.max(1) - 1) as usize).min(b.len() - 1)]
        };
        Duration::from_nanos(ns.max(1) as u64)
    }

    /// Recomputes the ack floor from what is still pending.
    fn update_floor(&mut self) {
        match self.pending.iter().next() {
            Some((&sseq, p)) => {
                self.ack_floor = SeqPair {
                    consumer_seq: p.cseq.saturating_sub(1),
                    stream_seq: sseq.saturating_sub(1),
                }
            }
            None => self.ack_floor = self.delivered,
        }
        self.dirty = true;
    }

    /// Processes one ack payload for `sseq`. Returns stream sequences now done with.
    fn apply_ack(&mut self, sseq: u64, payload: &[u8]) -> AckOutcome {
        let text = std::str::from_utf8(payload).unwrap_or("").trim();
        let (verb, rest) = match text.find(' ') {
            Some(i) => (&text[..i], text[i + 1..].trim()),
            None => (text, ""),
        };
        let mut out = AckOutcome::default();
        match verb {
            "" | "+ACK" => out.done = self.ack(sseq),
            "+NXT" => {
                out.done = self.ack(sseq);
                out.next = Some(rest.to_string());
            }
            "-NAK" if self.pending.contains_key(&sseq) => {
                let delay = serde_json::from_str::<Value>(rest)
                    .ok()
                    .and_then(|v| v.get("delay").and_then(Value::as_i64))
                    .filter(|d| *d > 0);
                match delay {
                    Some(d) => {
                        if let Some(p) = self.pending.get_mut(&sseq) {
                            p.deadline = Instant::now() + Duration::from_nanos(d as u64);
                        }
                    }
                    None => {
                        self.rdq.insert(sseq);
                    }
                }
            }
            "+WPI" => {
                let dc = self.redelivered.get(&sseq).copied().unwrap_or(1);
                let wait = self.ack_wait_for(dc);
                if let Some(p) = self.pending.get_mut(&sseq) {
                    p.deadline = Instant::now() + wait;
                }
            }
            "+TERM" if self.pending.remove(&sseq).is_some() => {
                self.rdq.remove(&sseq);
                self.redelivered.remove(&sseq);
                self.update_floor();
                out.done = vec![sseq];
            }
            _ => {} // Unknown payloads are ignored, as by the reference.
        }
        out
    }

    fn ack(&mut self, sseq: u64) -> Vec<u64> {
        let mut done = vec![];
        if self.config.ack_policy != AckPolicy::None {
            self.last_ack = now_nanos();
        }
        match self.config.ack_policy {
            AckPolicy::None => {}
            AckPolicy::Explicit => {
                if self.pending.remove(&sseq).is_some() {
                    self.rdq.remove(&sseq);
                    self.redelivered.remove(&sseq);
                    done.push(sseq);
                    self.update_floor();
                }
            }
            AckPolicy::All => {
                let acked: Vec<u64> = self.pending.range(..=sseq).map(|(s, _)| *s).collect();
                for s in &acked {
                    self.pending.remove(s);
                    self.rdq.remove(s);
                    self.redelivered.remove(s);
                }
                if !acked.is_empty() {
                    done = acked;
                    self.update_floor();
                }
            }
        }
        done
    }
}

#[derive(Default)]
struct AckOutcome {
    done: Vec<u64>,
    next: Option<String>,
}

fn send_status(server: &Server, router: &mut Router, to: &Bytes, hdr: &[u8]) {
    let data = Bytes::copy_from_slice(hdr);
    router.route(
        server,
        &Outgoing {
            subject: to,
            reply: None,
            hdr_len: Some(hdr.len()),
            data: &data,
        },
        None,
    );
}

/// Parses a MSG.NEXT body: JSON, a bare batch number, or empty (batch 1).
/// A MSG.NEXT request: batch, byte budget, expiry (ns), no_wait, heartbeat (ns).
type PullBody = (i64, i64, Option<i64>, bool, Option<i64>);

fn parse_pull(body: &[u8]) -> Result<PullBody, String> {
    let text = std::str::from_utf8(body).map_err(|e| e.to_string())?.trim();
    // Only a JSON object is parsed as one; anything else is a batch size, or 1.
    if !text.starts_with('{') {
        let n = text.parse::<i64>().unwrap_or(1).max(1);
        return Ok((n, 0, None, false, None));
    }
    #[derive(Deserialize)]
    struct Req {
        #[serde(default)]
        batch: i64,
        #[serde(default)]
        max_bytes: i64,
        #[serde(default)]
        expires: i64,
        #[serde(default)]
        no_wait: bool,
        #[serde(default)]
        idle_heartbeat: i64,
    }
    let r: Req = serde_json::from_str(text)
        .map_err(|e| super::api::go_json_error(text.as_bytes(), &e, false))?;
    Ok((
        r.batch.max(1),
        r.max_bytes,
        (r.expires != 0).then_some(r.expires),
        r.no_wait,
        (r.idle_heartbeat > 0).then_some(r.idle_heartbeat),
    ))
}

async fn run(
    c: Arc<Consumer>,
    server: Arc<Server>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<InMsg>,
) {
    let mut router = Router::new(c.created as u64);
    let mut closed = c.handle.closed_rx();
    loop {
        let deadline = c.lock().next_deadline();
        let sleep = tokio::time::sleep_until(
            deadline
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(1))
                .into(),
        );
        let mut batch = vec![];
        tokio::select! {
            m = rx.recv() => match m {
                Some(m) => batch.push(m),
                None => break,
            },
            _ = c.wake.notified() => {}
            _ = sleep => {}
            _ = crate::client::until_true(&mut closed) => break,
        }
        while let Ok(m) = rx.try_recv() {
            batch.push(m);
        }
        c.kick.store(false, Ordering::Release);
        if c.lock().deleted {
            break;
        }
        let mut sync_replies = vec![];
        let mut done = vec![];
        for m in batch {
            handle_msg(&c, &server, &mut router, m, &mut sync_replies, &mut done);
        }
        timers(&c, &server, &mut router);
        deliver(&c, &server, &mut router);
        {
            let mut st = c.lock();
            if !sync_replies.is_empty() {
                // An ack the client asked to be confirmed is on disk before we confirm it;
                // if it cannot be written it is not confirmed (the client retries).
                if !c.save(&mut st, true) {
                    sync_replies.clear();
                }
            } else if st.dirty && st.last_save.elapsed() >= SAVE_INTERVAL {
                // Other changes are written at most every SAVE_INTERVAL (without fsync: they
                // survive a process kill), so a busy consumer does not rewrite its file per ack.
                c.save(&mut st, false);
            }
        }
        for reply in sync_replies {
            let empty = Bytes::new();
            router.route(
                &server,
                &Outgoing {
                    subject: &reply,
                    reply: None,
                    hdr_len: None,
                    data: &empty,
                },
                None,
            );
        }
        if !done.is_empty() {
            retention_check(&c, &server, &done);
        }
        router.flush();
        if inactive_expired(&c, &server) {
            crate::debug!("Deleting inactive consumer {} > {}", c.stream.name, c.name);
            if let Some(js) = server.jetstream.get() {
                js.remove_consumer(&server, &c.stream, &c.name, &mut router);
            }
            router.flush();
            break;
        }
    }
}

fn handle_msg(
    c: &Arc<Consumer>,
    server: &Server,
    router: &mut Router,
    m: InMsg,
    sync_replies: &mut Vec<Bytes>,
    done: &mut Vec<u64>,
) {
    let subject = &m.subject[..];
    if subject.starts_with(b"$JS.ACK.") {
        let Some(ack) = parse_ack_subject(subject) else {
            return;
        };
        let (out, was_delivered) = {
            let mut st = c.lock();
            st.last_active = Instant::now();
            let was_delivered = ack.sseq <= st.delivered.stream_seq;
            (st.apply_ack(ack.sseq, m.payload()), was_delivered)
        };
        done.extend(out.done);
        if let Some(body) = out.next {
            if let Some(reply) = &m.reply {
                pull_request(c, server, router, reply.clone(), body.as_bytes());
            }
        } else if let Some(reply) = m.reply.as_ref().filter(|_| was_delivered) {
            // Acks for sequences never delivered get no confirmation (the reference).
            sync_replies.push(reply.clone());
        }
    } else if subject.starts_with(b"$JS.FC.") {
        let mut st = c.lock();
        if st.fc_pending.as_deref().map(str::as_bytes) == Some(subject) {
            st.fc_pending = None;
            st.fc_bytes = 0;
        }
    } else if let Some(reply) = m.reply.clone() {
        pull_request(c, server, router, reply, m.payload());
    }
}

fn pull_request(
    c: &Arc<Consumer>,
    server: &Server,
    router: &mut Router,
    reply: Bytes,
    body: &[u8],
) {
    let mut st = c.lock();
    st.last_active = Instant::now();
    if st.config.is_push() {
        drop(st);
        send_status(
            server,
            router,
            &reply,
            &status_hdr("409 Consumer is push based", &[]),
        );
        return;
    }
    let (batch, max_bytes, expires, no_wait, hb) = match parse_pull(body) {
        Ok(r) => r,
        Err(e) => {
            drop(st);
            let hdr = status_hdr(&format!("400 Bad Request - {e}"), &[]);
            send_status(server, router, &reply, &hdr);
            return;
        }
    };
    let cfg = &st.config;
    let violation = if cfg.max_batch > 0 && batch > cfg.max_batch {
        Some(format!("409 Exceeded MaxRequestBatch of {}", cfg.max_batch))
    } else if cfg.max_expires > 0 && expires.is_some_and(|e| e > cfg.max_expires) {
        Some(format!(
            "409 Exceeded MaxRequestExpires of {}",
            crate::time::go_duration(cfg.max_expires)
        ))
    } else if cfg.max_bytes > 0 && max_bytes > cfg.max_bytes {
        Some(format!(
            "409 Exceeded MaxRequestMaxBytes of {}",
            cfg.max_bytes
        ))
    } else if st.waiting.len() as i64 >= cfg.max_waiting.max(1) {
        Some("409 Exceeded MaxWaiting".to_string())
    } else {
        None
    };
    if let Some(v) = violation {
        drop(st);
        send_status(server, router, &reply, &status_hdr(&v, &[]));
        return;
    }
    if expires.is_some_and(|e| e < 0) {
        drop(st);
        let hdr = status_hdr(
            "408 Request Timeout",
            &[
                ("Nats-Pending-Messages", batch.to_string()),
                ("Nats-Pending-Bytes", max_bytes.max(0).to_string()),
            ],
        );
        send_status(server, router, &reply, &hdr);
        return;
    }
    let now = Instant::now();
    st.pull_seq += 1;
    let id = st.pull_seq;
    st.waiting.push_back(PullRequest {
        id,
        reply,
        batch,
        max_bytes: max_bytes.max(0),
        expires: expires.map(|e| now + Duration::from_nanos(e.max(0) as u64)),
        heartbeat: hb.map(|h| Duration::from_nanos(h as u64)),
        next_hb: hb.map(|h| now + Duration::from_nanos(h as u64)),
    });
    drop(st);
    deliver(c, server, router);
    if no_wait {
        // What was available has gone out; a request still short gets 404 now, unless
        // messages are there but held back by max_ack_pending: then it waits for acks.
        let mut st = c.lock();
        let blocked = st.config.max_ack_pending > 0
            && st.pending.len() as i64 >= st.config.max_ack_pending
            && st.num_pending(&c.stream) > 0;
        let expired = expires.is_some_and(|e| e < 0);
        if let Some(pos) = st
            .waiting
            .iter()
            .position(|w| w.id == id)
            .filter(|_| !blocked || expired)
        {
            let w = st.waiting.remove(pos).expect("position exists");
            drop(st);
            send_status(
                server,
                router,
                &w.reply,
                &if expired {
                    status_hdr(
                        "408 Request Timeout",
                        &[
                            ("Nats-Pending-Messages", w.batch.to_string()),
                            ("Nats-Pending-Bytes", w.max_bytes.to_string()),
                        ],
                    )
                } else {
                    status_hdr("404 No Messages", &[])
                },
            );
        }
    }
}

impl State {
    fn next_deadline(&self) -> Option<Instant> {
        let mut d: Option<Instant> = None;
        let mut consider = |t: Instant| d = Some(d.map_or(t, |x| x.min(t)));
        if self.dirty {
            consider(self.last_save + SAVE_INTERVAL);
        }
        if self.config.ack_policy != AckPolicy::None {
            for p in self.pending.values() {
                consider(p.deadline);
            }
        }
        for w in &self.waiting {
            if let Some(e) = w.expires {
                consider(e);
            }
            if let Some(h) = w.next_hb {
                consider(h);
            }
        }
        if self.config.idle_heartbeat > 0 && self.config.is_push() {
            consider(self.last_push_hb + Duration::from_nanos(self.config.idle_heartbeat as u64));
        }
        if self.config.is_push() {
            // Interest on the deliver subject can appear at any time; look again soon.
            consider(Instant::now() + Duration::from_millis(100));
        }
        d
    }
}

/// Ack deadlines, pull expiries and heartbeats.
fn timers(c: &Arc<Consumer>, server: &Server, router: &mut Router) {
    let now = Instant::now();
    let mut statuses: Vec<(Bytes, Vec<u8>)> = vec![];
    {
        let mut st = c.lock();
        if st.config.ack_policy != AckPolicy::None {
            let due: Vec<u64> = st
                .pending
                .iter()
                .filter(|(s, p)| p.deadline <= now && !st.rdq.contains(s))
                .map(|(s, _)| *s)
                .collect();
            for s in due {
                st.rdq.insert(s);
                // Park it far away until it is redelivered.
                if let Some(p) = st.pending.get_mut(&s) {
                    p.deadline = now + Duration::from_secs(86400 * 365);
                }
            }
        }
        let (last_c, last_s) = (st.delivered.consumer_seq, st.delivered.stream_seq);
        let mut i = 0;
        while i < st.waiting.len() {
            let w = &mut st.waiting[i];
            if w.expires.is_some_and(|e| e <= now) {
                let w = st.waiting.remove(i).expect("index valid");
                let hdr = status_hdr(
                    "408 Request Timeout",
                    &[
                        ("Nats-Pending-Messages", w.batch.to_string()),
                        ("Nats-Pending-Bytes", w.max_bytes.max(0).to_string()),
                    ],
                );
                statuses.push((w.reply, hdr));
                continue;
            }
            if let (Some(h), Some(next)) = (w.heartbeat, w.next_hb) {
                if next <= now {
                    w.next_hb = Some(now + h);
                    let hdr = status_hdr(
                        "100 Idle Heartbeat",
                        &[
                            ("Nats-Last-Consumer", last_c.to_string()),
                            ("Nats-Last-Stream", last_s.to_string()),
                        ],
                    );
                    statuses.push((w.reply.clone(), hdr));
                }
            }
            i += 1;
        }
        if st.config.is_push() && st.config.idle_heartbeat > 0 {
            let hb = Duration::from_nanos(st.config.idle_heartbeat as u64);
            if st.last_push_hb + hb <= now {
                st.last_push_hb = now;
                let mut h = vec![
                    ("Nats-Last-Consumer", last_c.to_string()),
                    ("Nats-Last-Stream", last_s.to_string()),
                ];
                if let Some(fc) = &st.fc_pending {
                    h.push(("Nats-Consumer-Stalled", fc.clone()));
                }
                let ds = st.config.deliver_subject.clone().unwrap_or_default();
                statuses.push((Bytes::from(ds), status_hdr("100 Idle Heartbeat", &h)));
            }
        }
    }
    for (to, hdr) in statuses {
        send_status(server, router, &to, &hdr);
    }
}

/// Delivers as much as the consumer's targets and limits allow.
fn deliver(c: &Arc<Consumer>, server: &Server, router: &mut Router) {
    let mut st = c.lock();
    let push = st.config.is_push();
    let deliver_subject = st.config.deliver_subject.clone().map(Bytes::from);
    if push {
        let ds = deliver_subject
            .as_ref()
            .expect("push has a deliver subject");
        st.push_bound = router.has_interest(server, ds);
        if st.push_bound {
            st.last_active = Instant::now();
        } else {
            return;
        }
    }
    loop {
        if st.deleted {
            return;
        }
        if !push && st.waiting.is_empty() {
            return;
        }
        if push && st.fc_pending.is_some() && st.fc_bytes >= 2 * FC_WINDOW {
            return; // Stalled until the client answers flow control.
        }
        // Redeliveries first, then new messages within max_ack_pending.
        let (msg, deliveries) = if let Some(seq) = st.rdq.pop_first() {
            let dc = st.redelivered.get(&seq).copied().unwrap_or(1) + 1;
            if st.config.max_deliver > 0 && dc > st.config.max_deliver as u64 {
                // Out of attempts: it stays unacked but is never sent again.
                st.pending.remove(&seq);
                st.update_floor();
                continue;
            }
            let loaded = c.stream.lock().store.load(seq);
            match loaded {
                Ok(m) => (m, dc),
                Err(_) => {
                    // Gone from the stream (deleted, expired): nothing to redeliver.
                    st.pending.remove(&seq);
                    st.redelivered.remove(&seq);
                    st.update_floor();
                    continue;
                }
            }
        } else {
            let limit = st.config.max_ack_pending;
            if st.config.ack_policy != AckPolicy::None
                && limit > 0
                && st.pending.len() as i64 >= limit
            {
                return;
            }
            match st.next_new(&c.stream) {
                Some(m) => (m, 1),
                None => return,
            }
        };
        // Sized as the reference does: subject, ack reply subject, headers, payload.
        let pending_after = st.num_pending(&c.stream);
        let ack_subject = format!(
            "$JS.ACK.{}.{}.{}.{}.{}.{}.{}",
            c.stream.name,
            c.name,
            deliveries,
            msg.seq,
            st.delivered.consumer_seq + 1,
            msg.ts,
            pending_after
        );
        let size = msg.subject.len() + ack_subject.len() + msg.hdr.len() + msg.data.len();
        // Pick the target: the oldest waiting pull (if the message fits), or the push subject.
        let target = if push {
            deliver_subject.clone().expect("push has a deliver subject")
        } else {
            let w = st.waiting.front().expect("checked non-empty");
            if w.max_bytes > 0 && size as i64 > w.max_bytes {
                let w = st.waiting.pop_front().expect("front exists");
                // Put the message back for the next request.
                if deliveries > 1 {
                    st.rdq.insert(msg.seq);
                } else {
                    st.next_seq = msg.seq;
                }
                let hdr = status_hdr(
                    "409 Message Size Exceeds MaxBytes",
                    &[
                        ("Nats-Pending-Messages", w.batch.to_string()),
                        ("Nats-Pending-Bytes", w.max_bytes.to_string()),
                    ],
                );
                drop(st);
                send_status(server, router, &w.reply, &hdr);
                st = c.lock();
                continue;
            }
            w.reply.clone()
        };
        // Bookkeeping for this delivery.
        st.delivered.consumer_seq += 1;
        let cseq = st.delivered.consumer_seq;
        if deliveries == 1 {
            st.delivered.stream_seq = st.delivered.stream_seq.max(msg.seq);
        } else {
            st.redelivered.insert(msg.seq, deliveries);
        }
        if st.config.ack_policy == AckPolicy::None {
            st.update_floor();
        } else {
            let wait = st.ack_wait_for(deliveries);
            st.pending.insert(
                msg.seq,
                Pending {
                    cseq,
                    deadline: Instant::now() + wait,
                },
            );
        }
        st.last_delivery = now_nanos();
        st.dirty = true;
        if !push {
            let w = st.waiting.front_mut().expect("checked non-empty");
            w.batch -= 1;
            let mut spent = false;
            if w.max_bytes > 0 {
                w.max_bytes -= size as i64;
                spent = w.max_bytes <= 0;
            }
            if let Some(h) = w.heartbeat {
                w.next_hb = Some(Instant::now() + h);
            }
            if w.batch <= 0 || spent {
                st.waiting.pop_front();
            }
        } else {
            st.last_push_hb = Instant::now();
            st.fc_bytes += size;
        }
        debug_assert_eq!(cseq, st.delivered.consumer_seq);
        let headers_only = st.config.headers_only;
        let need_fc =
            push && st.config.flow_control && st.fc_pending.is_none() && st.fc_bytes >= FC_WINDOW;
        let fc_subject = if need_fc {
            st.fc_seq += 1;
            let s = format!("$JS.FC.{}.{}.{}", c.stream.name, c.name, st.fc_seq);
            st.fc_pending = Some(s.clone());
            Some(s)
        } else {
            None
        };
        drop(st);
        let (hdr_len, data) = if headers_only {
            let mut h: Vec<u8> = if msg.hdr.is_empty() {
                b"NATS/1.0\r\n".to_vec()
            } else {
                msg.hdr[..msg.hdr.len() - 2].to_vec()
            };
            h.extend_from_slice(format!("Nats-Msg-Size: {}\r\n\r\n", msg.data.len()).as_bytes());
            (Some(h.len()), Bytes::from(h))
        } else if msg.hdr.is_empty() {
            (None, msg.data.clone())
        } else {
            let mut d = Vec::with_capacity(msg.hdr.len() + msg.data.len());
            d.extend_from_slice(&msg.hdr);
            d.extend_from_slice(&msg.data);
            (Some(msg.hdr.len()), Bytes::from(d))
        };
        let reply = Bytes::from(ack_subject);
        router.route_to(
            server,
            &target,
            &Outgoing {
                subject: &msg.subject,
                reply: Some(&reply),
                hdr_len,
                data: &data,
            },
            None,
        );
        if let Some(fc) = fc_subject {
            let hdr = Bytes::from(status_hdr("100 FlowControl Request", &[]));
            let fc = Bytes::from(fc);
            router.route_to(
                server,
                &target,
                &Outgoing {
                    subject: &target,
                    reply: Some(&fc),
                    hdr_len: Some(hdr.len()),
                    data: &hdr,
                },
                None,
            );
        }
        st = c.lock();
    }
}

/// Interest and work-queue streams drop a message once every interested consumer is done.
fn retention_check(c: &Arc<Consumer>, server: &Server, done: &[u64]) {
    let retention = c.stream.retention();
    if retention == Retention::Limits {
        return;
    }
    let Some(js) = server.jetstream.get() else {
        return;
    };
    let consumers = js.consumers_of(&c.stream.name);
    for &seq in done {
        let subject = match c.stream.lock().store.load(seq) {
            Ok(m) => m.subject,
            Err(_) => continue,
        };
        let all_done = retention == Retention::Workqueue
            || consumers.iter().all(|o| o.is_done_with(seq, &subject));
        if all_done {
            let mut inner = c.stream.lock();
            let _ = inner.store.remove(seq, false);
            c.stream.refresh_bytes(&inner);
        }
    }
}

fn inactive_expired(c: &Arc<Consumer>, server: &Server) -> bool {
    let st = c.lock();
    if c.durable || st.config.inactive_threshold <= 0 {
        return false;
    }
    if st.config.is_push() {
        if let Some(ds) = &st.config.deliver_subject {
            if !server.sublist.matches(ds.as_bytes()).is_empty() {
                return false;
            }
        }
    } else if !st.waiting.is_empty() {
        return false;
    }
    st.last_active.elapsed() >= Duration::from_nanos(st.config.inactive_threshold as u64)
}

/// What a durable consumer finds of its saved state.
enum Loaded {
    /// Nothing saved yet: a new consumer.
    Fresh,
    Saved(SavedState),
    /// Saved state exists but no copy can be trusted.
    Untrusted,
}

fn load_state(dir: &Path, stream: &str, name: &str) -> Loaded {
    let what = format!("Consumer {stream} > {name}: state");
    let why = match super::files::read(&dir.join("state.json"), &what) {
        Ok(None) => return Loaded::Fresh,
        Ok(Some(b)) => match serde_json::from_slice::<SavedState>(&b) {
            Ok(s) if s.consistent() => return Loaded::Saved(s),
            Ok(_) => "inconsistent content".to_string(),
            Err(e) => e.to_string(),
        },
        Err(e) => e,
    };
    crate::error!(
        "Consumer {stream} > {name}: saved state is damaged ({why}) and no older copy verifies; redelivering from where the consumer started"
    );
    Loaded::Untrusted
}

impl SavedState {
    /// The invariants every state this server wrote keeps.
    fn consistent(&self) -> bool {
        let (floor, top) = (self.ack_floor.stream_seq, self.delivered.stream_seq);
        floor <= top && self.pending.iter().all(|&(s, _)| s > floor && s <= top)
    }
}

pub fn read_meta(dir: &Path) -> Result<ConsumerMeta, String> {
    let b = super::files::read(&dir.join("meta.json"), "Consumer config")?
        .ok_or("no consumer config (meta.json)")?;
    serde_json::from_slice(&b).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_bodies() {
        assert_eq!(parse_pull(b"").unwrap().0, 1);
        assert_eq!(parse_pull(b"2").unwrap().0, 2);
        let r = parse_pull(br#"{"batch":5,"no_wait":true,"expires":1000}"#).unwrap();
        assert_eq!((r.0, r.2, r.3), (5, Some(1000), true));
        assert!(parse_pull(b"{bad").is_err());
    }

    #[test]
    fn ack_subjects() {
        let a = parse_ack_subject(b"$JS.ACK.S.c.1.7.3.1795953538955218381.2").unwrap();
        assert_eq!(a.sseq, 7);
        assert!(parse_ack_subject(b"$JS.ACK.S.c.1").is_none());
    }
}
