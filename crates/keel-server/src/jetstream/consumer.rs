//! Consumers: named cursors over a stream, kept on the server.
//!
//! Each consumer is one task (an actor) that owns its delivery loop. Pull requests, acks and
//! flow-control replies reach it through in-process subscriptions on
//! `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, `$JS.ACK.<stream>.<consumer>.>` and
//! `$JS.FC.<stream>.<consumer>.>`; the stream wakes it when new messages are stored. Its state
//! (delivered, ack floor, pending acks with delivery counts) sits behind a mutex so info
//! requests can read it, and durable consumers of file streams persist it: always before an
//! acknowledged ack (AckSync) is confirmed, and otherwise at most every 20 ms when it changed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use keel_store::StoredMsg;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::advisory::{ConsumerEvent, ConsumerEventKind};
use super::api::types::{ConsumerInfo, PriorityGroupState, SequenceInfo};
use super::api::{ApiError, ErrorKind};
pub use super::consumer_state::SeqPair;
use super::consumer_state::{ConsumerOp, Replicated};
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
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_default"
    )]
    pub priority_groups: Vec<String>,
    #[serde(default, skip_serializing_if = "PriorityPolicy::is_none")]
    pub priority_policy: PriorityPolicy,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority_timeout: i64,
}

/// How waiting pull requests of a priority group are chosen (the reference's policies).
/// Unknown names are kept so that validation can answer with the reference's text.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(from = "String", into = "String")]
pub enum PriorityPolicy {
    #[default]
    None,
    /// Serve a request only while the consumer is backed up (`min_pending`, `min_ack_pending`).
    Overflow,
    /// One client (by pin id) gets everything until it stops asking.
    PinnedClient,
    /// Requests with a lower `priority` number are served first.
    Prioritized,
    Unknown(String),
}

impl PriorityPolicy {
    fn is_none(&self) -> bool {
        *self == PriorityPolicy::None
    }
}

impl From<String> for PriorityPolicy {
    fn from(s: String) -> Self {
        match s.as_str() {
            "none" => PriorityPolicy::None,
            "overflow" => PriorityPolicy::Overflow,
            "pinned_client" => PriorityPolicy::PinnedClient,
            "prioritized" => PriorityPolicy::Prioritized,
            _ => PriorityPolicy::Unknown(s),
        }
    }
}

impl From<PriorityPolicy> for String {
    fn from(p: PriorityPolicy) -> String {
        match p {
            PriorityPolicy::None => "none".into(),
            PriorityPolicy::Overflow => "overflow".into(),
            PriorityPolicy::PinnedClient => "pinned_client".into(),
            PriorityPolicy::Prioritized => "prioritized".into(),
            PriorityPolicy::Unknown(s) => s,
        }
    }
}

/// Priority group names: 1 to 16 of `A-Z a-z 0-9 - _ / =` (the reference's rule).
pub fn valid_group_name(g: &str) -> bool {
    (1..=16).contains(&g.len())
        && g.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'/' | b'='))
}

pub fn invalid_group_name() -> ApiError {
    ErrorKind::ConsumerInvalidGroupName.err()
}

/// Parses a `pause_until` time as Go's decoder does: Ok(None) for Go's zero time (no pause),
/// otherwise the instant (Unix ns) and its UTC text; the error is the reference's text.
pub fn parse_pause_until(s: &str) -> Result<Option<(i64, String)>, ApiError> {
    let Some(ns) = parse_rfc3339(s) else {
        return Err(ErrorKind::InvalidJson.with(format!(
            "parsing time {s:?} as \"2006-01-02T15:04:05Z07:00\": cannot parse {s:?} as \"2006\""
        )));
    };
    if ns == 0 && s.starts_with("0001-") {
        return Ok(None);
    }
    // rfc3339() writes 0 as Go's zero time; the Unix epoch is a real time here.
    let text = if ns == 0 {
        "1970-01-01T00:00:00Z".to_string()
    } else {
        rfc3339(ns)
    };
    Ok(Some((ns, text)))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CreateRequest {
    pub stream_name: String,
    pub config: Option<ConsumerConfig>,
    pub action: String,
}

const DEFAULT_ACK_WAIT: i64 = 30_000_000_000;
pub const DEFAULT_MAX_ACK_PENDING: i64 = 1000;
const DEFAULT_MAX_WAITING: i64 = 512;
const DEFAULT_INACTIVE: i64 = 5_000_000_000;
/// How long a pinned client keeps its pin without asking again (`priority_timeout`).
const DEFAULT_PINNED_TTL: i64 = 120_000_000_000;
/// How often a durable consumer's changed state is written when no AckSync forces it.
const SAVE_INTERVAL: Duration = Duration::from_millis(20);
/// How often a subscription change makes the task look for waiting requests whose
/// requester went away.
const PRUNE_INTERVAL: Duration = Duration::from_millis(100);
/// Push flow control: ask for a reply every this many bytes, stall at twice as many.
const FC_WINDOW: usize = 1024 * 1024;

impl ConsumerConfig {
    pub fn is_push(&self) -> bool {
        self.deliver_subject
            .as_deref()
            .is_some_and(|s| !s.is_empty())
    }

    /// The effective filters: `filter_subject: ">"` is echoed as given (the reference keeps
    /// it) but filters nothing.
    pub fn filters(&self) -> Vec<String> {
        self.filter_list().to_vec()
    }

    /// [`filters`](Self::filters) without copying them (the delivery path asks per message).
    pub fn filter_list(&self) -> &[String] {
        if self.filter_subject == ">" {
            &[]
        } else if !self.filter_subject.is_empty() {
            std::slice::from_ref(&self.filter_subject)
        } else {
            &self.filter_subjects
        }
    }

    /// Defaults and the reference's checks. `stream` is the stream's config.
    pub fn normalize(mut self, retention: Retention) -> Result<ConsumerConfig, ApiError> {
        if let (Some(d), Some(n)) = (&self.durable_name, &self.name) {
            if !d.is_empty() && !n.is_empty() && d != n {
                return Err(ErrorKind::ConsumerDurableNameNotEqual.err());
            }
        }
        for n in [&self.durable_name, &self.name].into_iter().flatten() {
            if n.is_empty() {
                continue;
            }
            if n.contains('/') || n.contains('\\') {
                return Err(ErrorKind::ConsumerNamePathSeparators.err());
            }
            if !super::stream::valid_name(n) {
                return Err(ErrorKind::InvalidConfig
                    .with("consumer name can not contain '.', '*', '>', '\\', '/'"));
            }
            if n.len() > 255 {
                return Err(ErrorKind::ConsumerNameTooLong.err());
            }
        }
        if self.durable_name.as_deref() == Some("") {
            self.durable_name = None;
        }
        if self.name.as_deref() == Some("") {
            self.name = None;
        }
        if !self.filter_subject.is_empty() && !self.filter_subjects.is_empty() {
            return Err(ErrorKind::ConsumerFilterAndFilters.err());
        }
        for f in self.filters() {
            if f.is_empty() {
                return Err(ErrorKind::ConsumerEmptyFilter.err());
            }
            if !keel_protocol::subject::valid_subscribe(f.as_bytes()) {
                return Err(ErrorKind::InvalidConfig.with("consumer filter subject is not valid"));
            }
        }
        let filters = self.filters();
        for (i, a) in filters.iter().enumerate() {
            for b in &filters[i + 1..] {
                if super::stream::subjects_overlap(a, b) {
                    return Err(ErrorKind::ConsumerFiltersOverlap.err());
                }
            }
        }
        if self.ack_wait < 0 {
            return Err(ErrorKind::ConsumerAckWaitNegative.err());
        }
        if self.backoff.iter().any(|b| *b <= 0) {
            return Err(ErrorKind::ConsumerBackoffNegative.err());
        }
        if !self.backoff.is_empty() {
            if self.max_deliver > 0 && self.max_deliver <= self.backoff.len() as i64 {
                return Err(ErrorKind::ConsumerBackoffMaxDeliver.err());
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
        if !self.sample_freq.is_empty() {
            super::advisory::parse_sample_freq(&self.sample_freq)?;
        }
        if self.is_push() {
            let ds = self.deliver_subject.as_deref().unwrap_or_default();
            if !keel_protocol::subject::valid_publish(ds.as_bytes()) {
                return Err(ErrorKind::ConsumerDeliverSubjectWildcards.err());
            }
            if self.max_waiting != 0 {
                return Err(ErrorKind::ConsumerPushMaxWaiting.err());
            }
            if self.flow_control && self.idle_heartbeat <= 0 {
                return Err(ErrorKind::ConsumerFlowControlHeartbeat.err());
            }
            if self.max_batch != 0 || self.max_expires != 0 || self.max_bytes != 0 {
                return Err(ErrorKind::InvalidConfig.with(
                    "consumer in push mode can not set max batch, max expires or max bytes",
                ));
            }
        } else {
            self.deliver_subject = None;
            if self.deliver_group.is_some() {
                return Err(ErrorKind::InvalidConfig
                    .with("consumer in pull mode can not have a deliver group"));
            }
            if self.flow_control {
                return Err(ErrorKind::ConsumerFlowControlPull.err());
            }
            if self.rate_limit_bps != 0 {
                return Err(ErrorKind::ConsumerPullRateLimit.err());
            }
            if self.max_waiting < 0 {
                return Err(ErrorKind::ConsumerMaxWaitingNegative.err());
            }
            if self.max_waiting == 0 {
                self.max_waiting = DEFAULT_MAX_WAITING;
            }
            if self.max_batch < 0 {
                return Err(ErrorKind::ConsumerMaxRequestBatch.err());
            }
            if self.max_expires != 0 && self.max_expires < 1_000_000 {
                return Err(ErrorKind::ConsumerMaxRequestExpires.err());
            }
        }
        if !self.is_push() && self.idle_heartbeat != 0 {
            return Err(ErrorKind::ConsumerHeartbeatPull.err());
        }
        if self.idle_heartbeat != 0 && self.idle_heartbeat < 100_000_000 {
            return Err(ErrorKind::ConsumerHeartbeatTooShort.err());
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
                return Err(ErrorKind::ConsumerInvalidPolicy.with("consumer delivery policy is deliver by start sequence, but optional start sequence is not set"));
            }
            DeliverPolicy::LastPerSubject if self.filters().is_empty() => {
                return Err(ErrorKind::ConsumerInvalidPolicy.with("consumer delivery policy is deliver last per subject, but optional filter subject is not set"));
            }
            DeliverPolicy::ByStartTime => match &self.opt_start_time {
                Some(t) if parse_rfc3339(t).is_some() => {}
                _ => {
                    return Err(ErrorKind::ConsumerInvalidPolicy.with("consumer delivery policy is deliver by start time, but optional start time is not set"))
                }
            },
            p if p != DeliverPolicy::ByStartSequence && self.opt_start_seq.unwrap_or(0) > 0 => {
                return Err(ErrorKind::ConsumerInvalidPolicy.with(format!(
                        "consumer delivery policy is deliver {}, but optional start sequence is also set",
                        policy_name(p)
                    )));
            }
            p if p != DeliverPolicy::ByStartTime && self.opt_start_time.is_some() => {
                return Err(ErrorKind::ConsumerInvalidPolicy.with(format!(
                        "consumer delivery policy is deliver {}, but optional start time is also set",
                        policy_name(p)
                    )));
            }
            _ => {}
        }
        if retention == Retention::Workqueue {
            if self.ack_policy != AckPolicy::Explicit {
                return Err(if self.is_push() {
                    ErrorKind::WorkqueueExplicitAck.err()
                } else {
                    ErrorKind::ConsumerPullWorkqueueAck.err()
                });
            }
            if self.deliver_policy != DeliverPolicy::All {
                return Err(ErrorKind::WorkqueueDeliverAll.err());
            }
        }
        let durable = self.durable_name.is_some();
        if !durable && self.inactive_threshold == 0 {
            self.inactive_threshold = DEFAULT_INACTIVE;
        }
        for k in ["_nats.level", "_nats.ver"] {
            self.metadata.remove(k);
        }
        // More than one replica is checked against the stream (`api::consumers`).
        if self.num_replicas < 0 {
            return Err(ErrorKind::ReplicasNegative.err());
        }
        // 0 and 1 are echoed as given, as the reference does.
        if let Some(p) = &self.pause_until {
            // Stored in UTC, as the reference does.
            if let Some((_, utc)) = parse_pause_until(p)? {
                self.pause_until = Some(utc);
            }
        }
        if self.priority_timeout < 0 {
            self.priority_timeout = 0;
        }
        match &self.priority_policy {
            PriorityPolicy::Unknown(p) => {
                return Err(ErrorKind::InvalidJson.with(format!("unknown priority policy: {p:?}")))
            }
            PriorityPolicy::None => {
                if !self.priority_groups.is_empty() {
                    return Err(ErrorKind::ConsumerGroupsWithoutPolicy.err());
                }
                if self.priority_timeout > 0 {
                    return Err(ErrorKind::ConsumerPinnedTtlWithoutPolicy.err());
                }
            }
            policy => {
                if self.is_push() {
                    return Err(ErrorKind::ConsumerPushPriorityGroups.err());
                }
                if self.priority_groups.is_empty() {
                    return Err(ErrorKind::ConsumerPriorityPolicyWithoutGroup.err());
                }
                for g in &self.priority_groups {
                    if g.is_empty() {
                        return Err(ErrorKind::ConsumerEmptyGroupName.err());
                    }
                    if !valid_group_name(g) {
                        return Err(invalid_group_name());
                    }
                }
                if *policy == PriorityPolicy::PinnedClient && self.priority_timeout == 0 {
                    self.priority_timeout = DEFAULT_PINNED_TTL;
                }
            }
        }
        self.set_req_level();
        Ok(self)
    }

    /// `_nats.req.level`: the API level a server needs to honour this config (pause and
    /// priority groups came with level 1).
    pub fn set_req_level(&mut self) {
        let paused = self
            .pause_until
            .as_deref()
            .is_some_and(|p| !p.starts_with("0001-"));
        let level = if paused || !self.priority_policy.is_none() || self.priority_timeout != 0 {
            "1"
        } else {
            "0"
        };
        self.metadata.insert(REQ_LEVEL_KEY.into(), level.into());
    }

    /// The pause deadline (Unix ns), if a pause is configured.
    pub fn pause_ns(&self) -> Option<i64> {
        let p = self.pause_until.as_deref()?;
        parse_pause_until(p).ok().flatten().map(|(ns, _)| ns)
    }

    /// Features Keel does not implement: refused clearly rather than silently ignored.
    /// Checked after the update rules so an update gets the reference's error first.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        if self.rate_limit_bps > 0 {
            return Err(ApiError::not_supported("consumer rate limits"));
        }
        Ok(())
    }

    /// What an update may not change (the reference's rules).
    pub fn check_update(&self, new: &ConsumerConfig) -> Result<(), ApiError> {
        let fail =
            |what: &str| Err(ErrorKind::ConsumerCreate.with(format!("{what} can not be updated")));
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
            return Err(ErrorKind::ConsumerCreate.with(text));
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
    no_wait: bool,
    /// Messages delivered to it so far.
    delivered: u64,
    /// A delivery pass has looked at it (and could not fill it): only then may a timer
    /// end a no_wait request (a prioritized one waits for the task's pass).
    seen: bool,
    /// The priority group fields of a JSON request body (absent for other bodies).
    group: Option<PullGroup>,
}

/// `group`, `min_pending`, `min_ack_pending`, `id` (pin) and `priority` of a pull request.
#[derive(Deserialize, Default, Clone, Debug)]
#[serde(default)]
struct PullGroup {
    // Clients (async-nats) send null for the fields they do not use.
    #[serde(deserialize_with = "null_default")]
    group: String,
    #[serde(deserialize_with = "null_default")]
    min_pending: i64,
    #[serde(deserialize_with = "null_default")]
    min_ack_pending: i64,
    #[serde(deserialize_with = "null_default")]
    id: String,
    #[serde(deserialize_with = "null_default")]
    priority: i64,
}

impl PullRequest {
    fn priority(&self) -> i64 {
        self.group
            .as_ref()
            .map_or(i64::from(i32::MAX), |g| g.priority)
    }

    fn timeout_status(&self) -> Vec<u8> {
        status_hdr(
            "408 Request Timeout",
            &[
                ("Nats-Pending-Messages", self.batch.to_string()),
                ("Nats-Pending-Bytes", self.max_bytes.max(0).to_string()),
            ],
        )
    }
}

/// The client a `pinned_client` consumer serves while it keeps asking.
struct Pin {
    id: String,
    /// When it was pinned (Unix ns), for info.
    ts: i64,
    /// Unpinned when no request with this id arrives before then (`priority_timeout`).
    deadline: Instant,
}

/// What is persisted for a durable consumer (and, for a replicated stream, carried in its
/// group's log at every confirmed ack: keep it small).
#[derive(Serialize, Deserialize, Default)]
struct SavedState {
    delivered: SeqPair,
    ack_floor: SeqPair,
    /// Delivered and not acked, as runs (first stream seq, first consumer seq, count) in
    /// which both sequences step by one: a window of 500 in-order deliveries is one run
    /// instead of 500 pairs (it made each confirmed ack's log entry about 6 KB).
    #[serde(default)]
    pending_runs: Vec<(u64, u64, u64)>,
    /// The older form, one (stream seq, consumer seq) per message, still read. Never
    /// written: a Keel that only knows this field then finds it missing and redelivers
    /// from its start rather than take the runs for acked.
    #[serde(default, skip_serializing)]
    pending: Vec<(u64, u64)>,
    /// (stream seq, deliveries) of redelivered messages.
    redelivered: Vec<(u64, u64)>,
    /// A `pinned_client` consumer's pin (id, when pinned in Unix ns): a replicated
    /// stream's next leader keeps serving that client, as the reference's consumer does
    /// when only its stream's leader moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pin: Option<(String, i64)>,
    /// When each pending delivery is due again (its ack deadline, a nak's delay, a
    /// progress ack's extension), as runs over `pending` in stream order: (count, Unix ms),
    /// each run's time the latest of its members rounded up to 100 ms, so a pulled batch is
    /// one run. A replicated stream's next leader redelivers at these times, as the
    /// reference's consumer keeps its pending messages' timestamps; absent (an older Keel,
    /// or counts that do not add up) it waits one ack wait from the change.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pending_due: Vec<(u64, i64)>,
}

#[derive(Serialize, Deserialize)]
pub struct ConsumerMeta {
    pub config: ConsumerConfig,
    pub created: i64,
}

/// Writes a consumer's config file (`<dir>/meta.json`) durably.
pub fn write_meta(
    files: &keel_store::MetaFiles,
    dir: &Path,
    config: &ConsumerConfig,
    created: i64,
) -> std::io::Result<()> {
    #[derive(Serialize)]
    struct MetaRef<'a> {
        config: &'a ConsumerConfig,
        created: i64,
    }
    let body = serde_json::to_vec_pretty(&MetaRef { config, created })?;
    // An ephemeral one's (a replicated stream's) is not synced: what keeps it is the
    // stream's group, and a client makes a new one when it is gone. (Each fsync made a
    // KV listing's ordered consumer a millisecond slower.)
    files.write(&dir.join("meta.json"), &body, config.durable_name.is_some())
}

/// A consumer's state: the replicated part (`rep`, changed only through [`State::apply`])
/// and what only the leader has (the rest: delivery position, ack deadlines, waiting
/// pulls, flow control, heartbeats, pins, pacing).
pub struct State {
    pub config: ConsumerConfig,
    /// Delivered, ack floor, pending, delivery counts: what a follower needs.
    rep: Replicated,
    /// When each pending delivery's ack is due; a passed deadline queues it for redelivery.
    deadlines: BTreeMap<u64, Instant>,
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
    /// `pause_until` as Unix ns (None: not paused), kept in step with the config.
    pause_ns: Option<i64>,
    pin: Option<Pin>,
    /// Replay policy original: stored messages up to this sequence are paced by their
    /// timestamps (0 once caught up), with the last one sent (timestamp, when).
    replay_until: u64,
    replay_prev: Option<(i64, Instant)>,
    /// When the next paced message is due.
    replay_wait: Option<Instant>,
    /// The last first delivery came from the last-per-subject list.
    from_lps: bool,
    /// Bumped by a reset, so a delivery undone afterwards does not touch the new state.
    epoch: u64,
    /// Sublist generation when the waiting requests were last checked for interest.
    interest_gen: u64,
    last_prune: Instant,
    /// Advisories and metrics recorded under the lock, published by the task after it.
    events: Vec<ConsumerEvent>,
    /// The stream's next block, read ahead for first deliveries; dropped after each
    /// delivery pass, so an idle consumer holds none.
    ra: keel_store::ReadAhead,
}

/// A consumer's figures at one moment (see [`Consumer::numbers`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct ConsumerNumbers {
    pub num_pending: u64,
    pub num_ack_pending: u64,
    pub num_redelivered: u64,
    pub num_waiting: u64,
    pub delivered_stream_seq: u64,
    pub ack_floor_stream_seq: u64,
    pub max_ack_pending: i64,
    pub max_waiting: i64,
    pub pull: bool,
    /// Unix nanoseconds, 0 when never.
    pub last_delivery: i64,
    pub last_ack: i64,
}

pub struct Consumer {
    pub name: String,
    pub stream: Arc<Stream>,
    pub created: i64,
    /// Shared with the stream's consumer set (a read-only view for retention).
    state: Arc<Mutex<State>>,
    handle: Arc<ClientHandle>,
    subs: Mutex<Vec<Arc<Sub>>>,
    /// Set when there is news (stored messages); the task clears it.
    kick: AtomicBool,
    wake: tokio::sync::Notify,
    dir: Option<PathBuf>,
    /// Held from a replicated state's save to its send (the delivery loop, the hand-off
    /// flush): states reach the group's log in the order they were taken, so followers
    /// never end on an older one.
    sending: tokio::sync::Mutex<()>,
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
        requests: tokio::sync::mpsc::Sender<super::registry::Request>,
    ) -> (Arc<Consumer>, tokio::task::JoinHandle<()>) {
        let config = meta.config;
        let saved = dir.as_deref().map_or(Loaded::Fresh, |d| {
            load_state(&stream.meta, d, &stream.name, &name, &server.log)
        });
        let now = Instant::now();
        let mut st = State {
            config,
            rep: Replicated::default(),
            deadlines: BTreeMap::new(),
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
            pause_ns: None,
            pin: None,
            replay_until: 0,
            replay_prev: None,
            replay_wait: None,
            from_lps: false,
            epoch: 0,
            interest_gen: u64::MAX,
            last_prune: now,
            events: Vec::new(),
            ra: keel_store::ReadAhead::default(),
        };
        st.pause_ns = st.config.pause_ns();
        match saved {
            Loaded::Saved(mut s) => {
                st.next_seq = s.delivered.stream_seq + 1;
                let ttl = Duration::from_nanos(st.config.priority_timeout.max(0) as u64);
                st.pin = s.pin.take().map(|(id, ts)| Pin {
                    id,
                    ts,
                    deadline: now + ttl,
                });
                let due = std::mem::take(&mut s.pending_due);
                st.rep = s.into_replicated();
                if stream.group.is_some() {
                    // A replicated stream's new leader: the clients that got these may be
                    // working on them still (connected to other servers), so they come
                    // again when they were due, as from the reference's consumer, not at
                    // once.
                    st.set_due(&due, now);
                } else {
                    // Delivered but unacked before the restart: redeliver them now.
                    for &sseq in st.rep.pending.keys() {
                        st.deadlines.insert(sseq, now);
                        st.rdq.insert(sseq);
                    }
                }
                st.check_against(stream, &name);
            }
            Loaded::Fresh => st.init_position(stream),
            Loaded::Untrusted => st.safe_position(stream, meta.created),
        }
        if st.config.replay_policy == ReplayPolicy::Original {
            st.replay_until = stream.committed_seq();
        }
        let (handle, rx) = ClientHandle::internal(
            server,
            stream.account(),
            format!("consumer {} > {name}", stream.name),
            crate::inqueue::CONSUMER_QUEUE_BYTES,
        );
        if let Some(q) = handle.internal_queue() {
            if stream.cluster_wide() {
                q.set_cluster_wide();
            }
            set_ranking(q, &st.config);
        }
        let c = Arc::new(Consumer {
            name: name.clone(),
            stream: stream.clone(),
            created: meta.created,
            state: Arc::new(Mutex::new(st)),
            handle,
            subs: Mutex::new(Vec::new()),
            kick: AtomicBool::new(true),
            wake: tokio::sync::Notify::new(),
            dir,
            sending: tokio::sync::Mutex::new(()),
        });
        let s = &stream.name;
        let acks = c.lock().config.ack_policy != AckPolicy::None;
        let subjects = [
            Some(format!("$JS.API.CONSUMER.MSG.NEXT.{s}.{name}")),
            // Exactly the 9-token ack form: anything else finds nobody (503), as with the
            // reference; an ack-none consumer listens for no acks at all.
            acks.then(|| format!("$JS.ACK.{s}.{name}.*.*.*.*.*")),
            Some(format!("$JS.FC.{s}.{name}.>")),
            // Like the reference, the consumer answers its own resets (in order with its
            // deliveries); the API ignores these subjects.
            Some(format!("$JS.API.CONSUMER.RESET.{s}.{name}")),
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
            c.handle.account().sublist.insert(sub.clone());
            c.subs.lock().unwrap_or_else(|e| e.into_inner()).push(sub);
        }
        let task = server.spawn(run(c.clone(), server.clone(), rx, requests));
        // `kick` starts set, so no notify() would wake the task: deliver what is stored now.
        c.wake.notify_one();
        (c, task)
    }

    /// The read-only view of this consumer's state its stream keeps (for retention).
    pub fn view(&self) -> super::registry::ConsumerView {
        super::registry::ConsumerView::new(self.name.clone(), self.state.clone())
    }

    /// Replaces the config (an update or a pause) and what is derived from it.
    pub fn set_config(&self, config: ConsumerConfig) {
        let mut st = self.lock();
        st.pause_ns = config.pause_ns();
        if config.priority_policy != PriorityPolicy::PinnedClient {
            st.pin = None;
        }
        if let Some(q) = self.handle.internal_queue() {
            set_ranking(q, &config);
        }
        st.config = config;
        drop(st);
        self.notify();
    }

    /// Pause state for responses: (paused, pause_remaining ns).
    pub fn pause_state(&self) -> (bool, i64) {
        let st = self.lock();
        paused_for(st.pause_ns)
    }

    /// Drops the pin of a `pinned_client` consumer (`$JS.API.CONSUMER.UNPIN`): the next
    /// request without a pin id gets a new one.
    pub fn unpin(&self) {
        let mut st = self.lock();
        st.pin = None;
        st.dirty = true;
        drop(st);
        self.notify();
    }

    /// At shutdown: every waiting pull is told `409 Server Shutdown` with what it still
    /// wanted (as the reference's `signalPullConsumers`), so its client pulls again from
    /// the server it reconnects to instead of waiting out its expiry. True if any was told.
    pub fn signal_shutdown(&self, server: &Server, router: &mut Router) -> bool {
        let waiting: Vec<PullRequest> = self.lock().waiting.drain(..).collect();
        for w in &waiting {
            let hdr = status_hdr(
                "409 Server Shutdown",
                &[
                    ("Nats-Pending-Messages", w.batch.to_string()),
                    ("Nats-Pending-Bytes", w.max_bytes.max(0).to_string()),
                ],
            );
            send_status(server, router, &w.reply, &hdr);
        }
        !waiting.is_empty()
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn config(&self) -> ConsumerConfig {
        self.lock().config.clone()
    }

    /// The stream was purged: what was pending and is gone (everything before the stream's
    /// first sequence now, and, after a purge of some subjects, what the store no longer
    /// holds) is no longer waited for, as the reference's consumer drops it; so it frees
    /// `max_ack_pending` at once instead of after its ack wait.
    pub fn on_purge(&self) {
        {
            let mut st = self.lock();
            let gone: Vec<u64> = {
                let store = self.stream.read();
                st.apply(ConsumerOp::Purged {
                    first: store.state().first_seq,
                });
                st.rep
                    .pending
                    .keys()
                    .copied()
                    .filter(|s| store.peek(*s).is_none())
                    .collect()
            };
            for sseq in gone {
                st.apply(ConsumerOp::Gone { sseq });
            }
        }
        self.notify();
    }

    /// New messages were stored: wake the task (once, however many arrive).
    pub fn notify(&self) {
        if !self.kick.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// Stops the task, drops the subscriptions, and tells waiting pulls that the consumer
    /// is gone (`409 Consumer Deleted`: clients end their consume loops).
    pub fn stop(&self, server: &Server, router: &mut Router) {
        self.stop_with(server, router, "409 Consumer Deleted");
    }

    /// As `stop`, for a consumer that goes on elsewhere (its stream's leadership moved, or
    /// the stream left this server): waiting pulls get `409 Leadership Change`, as the
    /// reference's new leader sends them, so their clients pull again instead of giving up.
    pub fn stop_for_move(&self, server: &Server, router: &mut Router) {
        self.stop_with(server, router, "409 Leadership Change");
    }

    fn stop_with(&self, server: &Server, router: &mut Router, status: &str) {
        let waiting: Vec<Bytes> = {
            let mut st = self.lock();
            st.deleted = true;
            st.waiting.drain(..).map(|w| w.reply).collect()
        };
        for reply in waiting {
            send_status(server, router, &reply, &status_hdr(status, &[]));
        }
        for s in self
            .subs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            self.handle.account().sublist.remove(&s);
        }
        self.handle
            .close(crate::client::CloseReason::ServerShutdown);
        self.wake.notify_one();
    }

    /// Writes (durably) `config` as this consumer's saved config. Called before the
    /// config goes live (`set_config`), so a failed write leaves the consumer as it was.
    pub fn persist_config(&self, config: &ConsumerConfig) -> std::io::Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        write_meta(&self.stream.meta, dir, config, self.created)
    }

    /// Consumer info (without `type`). (Interest is looked up in the consumer's own
    /// account; `_server` stays for the callers' sake.)
    pub fn info(&self, server: &Server, dynamic_meta: bool) -> ConsumerInfo {
        let cluster = server
            .jetstream
            .get()
            .and_then(|j| j.account(&self.stream.account().name).cloned())
            .filter(|js| js.clustered())
            .map(|js| super::api::streams::cluster_info(&js, &self.stream))
            .map(|ci| {
                // A consumer of one replica: the reference's runs on one server without a
                // group and names only the cluster and its server (Keel's goes on being
                // carried by its stream's group).
                if self.lock().config.num_replicas == 1 {
                    ci.one_server()
                } else {
                    ci
                }
            });
        let mut st = self.lock();
        // Requests whose requester went away are not waiting (the reference checks here too).
        st.waiting
            .retain(|w| !self.handle.account().sublist.matches(&w.reply).is_empty());
        let num_pending = st.num_pending(&self.stream);
        let active = |pair: SeqPair, ts: i64| SequenceInfo {
            consumer_seq: pair.consumer_seq,
            stream_seq: pair.stream_seq,
            last_active: (ts > 0).then(|| rfc3339(ts)),
        };
        let push_bound = st.config.deliver_subject.as_ref().is_some_and(|ds| {
            !self
                .handle
                .account()
                .sublist
                .matches(ds.as_bytes())
                .is_empty()
        });
        let (paused, remaining) = paused_for(st.pause_ns);
        ConsumerInfo {
            stream_name: self.stream.name.clone(),
            name: self.name.clone(),
            created: rfc3339(self.created),
            config: st.config.to_json(dynamic_meta),
            delivered: active(st.rep.delivered, st.last_delivery),
            ack_floor: active(st.rep.ack_floor, st.last_ack),
            num_ack_pending: st.rep.pending.len(),
            // With max_deliver 1 nothing is redelivered; the reference reports 0.
            num_redelivered: if st.config.max_deliver == 1 {
                0
            } else {
                st.rep.redelivered.len()
            },
            num_waiting: st.waiting.len(),
            num_pending,
            cluster,
            push_bound,
            paused,
            pause_remaining: paused.then_some(remaining),
            ts: rfc3339(now_nanos()),
            priority_groups: st
                .config
                .priority_groups
                .first()
                .map(|g| PriorityGroupState {
                    group: g.clone(),
                    pinned_client_id: st.pin.as_ref().map(|p| p.id.clone()),
                    pinned_ts: rfc3339(st.pin.as_ref().map_or(0, |p| p.ts)),
                })
                .into_iter()
                .collect(),
        }
    }

    /// The ack floor's stream sequence (cheap: no pending count).
    pub fn ack_floor(&self) -> u64 {
        self.lock().floor_seq()
    }

    /// The figures monitoring samples (the dashboard), without building the info JSON.
    pub fn numbers(&self) -> ConsumerNumbers {
        let st = self.lock();
        ConsumerNumbers {
            num_pending: st.num_pending(&self.stream),
            num_ack_pending: st.rep.pending.len() as u64,
            num_redelivered: st.rep.redelivered.len() as u64,
            num_waiting: st.waiting.len() as u64,
            delivered_stream_seq: st.rep.delivered.stream_seq,
            ack_floor_stream_seq: st.rep.ack_floor.stream_seq,
            max_ack_pending: st.config.max_ack_pending,
            max_waiting: st.config.max_waiting,
            pull: st.config.deliver_subject.is_none(),
            last_delivery: st.last_delivery,
            last_ack: st.last_ack,
        }
    }

    /// Writes and syncs the state now (clean shutdown).
    pub fn flush_state(&self) {
        let mut st = self.lock();
        let _ = self.save(&mut st, true);
    }

    /// A durable of a replicated stream whose state changed since its last save: written and
    /// replicated now, confirmed by a quorum (before its server hands the stream's
    /// leadership over: acks it took in its last moments are not redelivered by the next).
    pub async fn flush_replicated(&self) {
        if self.stream.group.is_none() {
            return;
        }
        let sending = self.sending.lock().await;
        let saved = {
            let mut st = self.lock();
            if !st.dirty {
                return;
            }
            match self.save(&mut st, false) {
                Ok(Some(bytes)) => Some((bytes, st.rep.ack_floor.stream_seq)),
                _ => None,
            }
        };
        if let Some((state, ack_floor)) = saved {
            self.send_state(sending, state, ack_floor, true).await;
        }
    }

    /// Sends the state just written to the replicated stream's followers through its group
    /// (with `wait`, resolves once a quorum has it). `sending` (taken before the save) is
    /// let go once the entry is queued. If it could not be sent, the state is marked
    /// changed again so the next pass writes and sends it (a new leader starts from the
    /// followers' copy). Whether it was sent.
    async fn send_state(
        &self,
        sending: tokio::sync::MutexGuard<'_, ()>,
        state: Vec<u8>,
        ack_floor: u64,
        wait: bool,
    ) -> bool {
        let entry = super::raft::stream::ConsumerEntry::State {
            name: self.name.clone(),
            state,
            ack_floor,
        };
        let queued = self.stream.replicate_queued(entry, wait).await;
        drop(sending);
        let sent = match queued {
            Ok(Some(answer)) => answer.await.is_ok(),
            Ok(None) => true,
            Err(_) => false,
        };
        if !sent {
            self.lock().dirty = true;
        }
        sent
    }

    /// Writes the state (fsynced with `sync`): the bytes written (None when there is
    /// nothing on disk to write: not durable, or being deleted), an error if that failed.
    fn save(&self, st: &mut State, sync: bool) -> Result<Option<Vec<u8>>, ()> {
        st.dirty = false;
        st.last_save = Instant::now();
        let Some(dir) = &self.dir else {
            return Ok(None);
        };
        if st.deleted {
            // Its directory is being removed: writing would bring it back.
            return Ok(None);
        }
        let mut saved = SavedState::of(&st.rep);
        saved.pin = st.pin.as_ref().map(|p| (p.id.clone(), p.ts));
        saved.pending_due = st.due_runs();
        let bytes = serde_json::to_vec(&saved).expect("state serializes");
        if let Err(e) = self
            .stream
            .meta
            .overwrite(&dir.join("state.json"), &bytes, sync)
        {
            crate::error!(
                self.handle.log(),
                "Consumer {} > {}: could not save state: {e}",
                self.stream.name,
                self.name
            );
            st.dirty = true;
            return Err(());
        }
        Ok(Some(bytes))
    }
}

impl State {
    /// Has the consumer finished with `seq` (acked, or past it and not pending)? True when
    /// it does not want the subject.
    pub fn is_done_with(&self, seq: u64, subject: &[u8]) -> bool {
        if !self.matches(subject) {
            return true;
        }
        seq <= self.rep.ack_floor.stream_seq
            || (seq < self.next_seq
                && !self.rep.pending.contains_key(&seq)
                && !self.rdq.contains(&seq))
    }

    /// The ack floor's stream sequence.
    pub fn floor_seq(&self) -> u64 {
        self.rep.ack_floor.stream_seq
    }

    pub fn matches(&self, subject: &[u8]) -> bool {
        let filters = self.config.filter_list();
        filters.is_empty()
            || filters
                .iter()
                .any(|f| keel_protocol::subject::matches(f.as_bytes(), subject))
    }

    /// Where a new consumer starts, by deliver policy.
    fn init_position(&mut self, stream: &Stream) {
        let store = stream.read();
        let state = store.state();
        let filters = self.config.filters();
        let last_matching = || -> u64 {
            if filters.is_empty() {
                return state.last_seq;
            }
            filters
                .iter()
                .filter_map(|f| store.load_last(f).ok().map(|m| m.seq))
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
                    match store.load_next(seq, ">") {
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
                    for subj in store.subjects(p).keys() {
                        if let Ok(m) = store.load_last(subj) {
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
        self.rep.apply(&ConsumerOp::Start { seq: start });
    }

    /// A saved state ahead of the stream (a disk that lost messages the stream could not
    /// account for) would skip the messages stored from now on: deliver from the stream's
    /// end instead.
    fn check_against(&mut self, stream: &Stream, name: &str) {
        let last = stream.state().last_seq;
        if self.rep.delivered.stream_seq > last {
            crate::warn!(
                stream.handle_log(),
                "Consumer {} > {name}: saved state has delivered up to {} but the stream ends at {last}; delivering from {}",
                stream.name,
                self.rep.delivered.stream_seq,
                last + 1
            );
            self.next_seq = last + 1;
            self.apply(ConsumerOp::Clamp { last });
            // Loaded, not changed: nothing to save yet (as before the split).
            self.dirty = false;
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
                let store = stream.read();
                let state = store.state();
                let mut seq = state.first_seq.max(1);
                self.next_seq = loop {
                    match store.load_next(seq, ">") {
                        Ok(m) if m.ts >= created => break m.seq,
                        Ok(m) => seq = m.seq + 1,
                        Err(_) => break state.last_seq + 1,
                    }
                };
                self.rep.apply(&ConsumerOp::Start { seq: self.next_seq });
            }
            DeliverPolicy::Last | DeliverPolicy::LastPerSubject => {
                let first = stream.state().first_seq.max(1);
                self.next_seq = first;
                self.rep.apply(&ConsumerOp::Start { seq: first });
            }
        }
    }

    fn num_pending(&self, stream: &Stream) -> u64 {
        pending_from(stream, &self.config, self.next_seq) + self.lps.len() as u64
    }

    /// The next message for a first delivery, if any: only committed ones (up to the
    /// stream's watermark), so nothing is delivered before it is durable.
    fn next_new(&mut self, stream: &Stream) -> Option<StoredMsg> {
        let committed = stream.committed_seq();
        let store = stream.read();
        while let Some(seq) = self.lps.front().copied() {
            if seq > committed {
                return None;
            }
            self.lps.pop_front();
            if let Ok(m) = store.load(seq) {
                self.from_lps = true;
                return Some(m);
            }
        }
        self.from_lps = false;
        let filters = self.config.filter_list();
        let found = if filters.len() <= 1 {
            // One position to read from: read ahead (several filters would share a block).
            let f = filters.first().map_or(">", String::as_str);
            store.load_next_ahead(self.next_seq, f, &mut self.ra).ok()
        } else {
            filters
                .iter()
                .filter_map(|f| store.load_next(self.next_seq, f).ok())
                .min_by_key(|m| m.seq)
        }
        .filter(|m| m.seq <= committed);
        if let Some(m) = &found {
            self.next_seq = m.seq + 1;
        }
        found
    }

    /// [`SavedState::pending_due`] from the ack deadlines: a message queued for
    /// redelivery is due now.
    fn due_runs(&self) -> Vec<(u64, i64)> {
        let (now, wall) = (Instant::now(), crate::time::now_nanos() / 1_000_000);
        due_runs_of(
            self.rep
                .pending
                .keys()
                .map(|sseq| match self.deadlines.get(sseq) {
                    Some(d) if !self.rdq.contains(sseq) => {
                        wall + d.saturating_duration_since(now).as_millis() as i64
                    }
                    _ => wall,
                }),
        )
    }

    /// Ack deadlines for the pending deliveries from a saved [`SavedState::pending_due`];
    /// without it (or when it does not cover them all), one ack wait from `now`.
    fn set_due(&mut self, due: &[(u64, i64)], now: Instant) {
        let wall = crate::time::now_nanos() / 1_000_000;
        let pending: Vec<u64> = self.rep.pending.keys().copied().collect();
        match due_times(due, pending.len()) {
            Some(times) => {
                for (sseq, at) in pending.into_iter().zip(times) {
                    let wait = Duration::from_millis(at.saturating_sub(wall).max(0) as u64);
                    self.deadlines.insert(sseq, now + wait);
                }
            }
            None => {
                for sseq in pending {
                    let wait = self.ack_wait_for(self.rep.deliveries(sseq));
                    self.deadlines.insert(sseq, now + wait);
                }
            }
        }
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

    /// The one place the replicated state changes: applies `op` to it, then keeps the
    /// leader's own bookkeeping (ack deadlines, the redelivery queue) in step with what it
    /// removed. Returns the stream sequences the consumer is now done with.
    fn apply(&mut self, op: ConsumerOp) -> Vec<u64> {
        let applied = self.rep.apply(&op);
        if applied.changed {
            self.dirty = true;
        }
        match op {
            ConsumerOp::Ack { .. } | ConsumerOp::Term { .. } | ConsumerOp::AckAll { .. } => {
                for s in &applied.done {
                    self.rdq.remove(s);
                    self.deadlines.remove(s);
                }
            }
            ConsumerOp::GiveUp { sseq } | ConsumerOp::Gone { sseq } => {
                self.deadlines.remove(&sseq);
            }
            ConsumerOp::Clamp { last } => {
                self.rdq.split_off(&(last + 1));
                self.deadlines.split_off(&(last + 1));
            }
            ConsumerOp::Reset { .. } => {
                self.rdq.clear();
                self.deadlines.clear();
            }
            ConsumerOp::Purged { first } => {
                for s in &applied.done {
                    self.rdq.remove(s);
                    self.deadlines.remove(s);
                }
                self.next_seq = self.next_seq.max(first);
            }
            // Deadlines of (un)deliveries are set by the delivery code, which knows them.
            ConsumerOp::Start { .. } | ConsumerOp::Delivered { .. } | ConsumerOp::Undo { .. } => {}
        }
        applied.done
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
            "-NAK" if self.rep.pending.contains_key(&sseq) => {
                self.on_nak(sseq);
                // `{"delay": ns}` (the clients' nak with a delay) or a Go duration
                // (`-NAK 5s`), as the reference reads it; anything else is a plain nak.
                let delay = if rest.starts_with('{') {
                    serde_json::from_str::<Value>(rest)
                        .ok()
                        .and_then(|v| v.get("delay").and_then(Value::as_i64))
                } else {
                    crate::time::parse_go_duration(rest)
                }
                .filter(|d| *d > 0);
                match delay {
                    Some(d) => {
                        if let Some(p) = self.deadlines.get_mut(&sseq) {
                            *p = Instant::now() + Duration::from_nanos(d as u64);
                            // Replicated, so the next leader waits the delay out too.
                            self.dirty = true;
                        }
                    }
                    None => {
                        self.rdq.insert(sseq);
                    }
                }
            }
            "+WPI" => {
                let wait = self.ack_wait_for(self.rep.deliveries(sseq));
                if let Some(p) = self.deadlines.get_mut(&sseq) {
                    *p = Instant::now() + wait;
                    self.dirty = true;
                }
            }
            "+TERM" if self.rep.pending.contains_key(&sseq) => {
                self.on_term(sseq, rest);
                out.done = self.apply(ConsumerOp::Term { sseq });
            }
            _ => {} // Unknown payloads are ignored, as by the reference.
        }
        out
    }

    fn ack(&mut self, sseq: u64) -> Vec<u64> {
        if self.config.ack_policy != AckPolicy::None {
            self.last_ack = now_nanos();
        }
        match self.config.ack_policy {
            AckPolicy::None => vec![],
            AckPolicy::Explicit => {
                self.sample_ack(sseq);
                self.apply(ConsumerOp::Ack { sseq })
            }
            AckPolicy::All => self.apply(ConsumerOp::AckAll { sseq }),
        }
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

/// A MSG.NEXT request body: JSON, a bare batch number, or empty (batch 1).
#[derive(Debug, Default)]
struct PullBody {
    batch: i64,
    max_bytes: i64,
    /// Expiry in ns.
    expires: Option<i64>,
    no_wait: bool,
    /// Heartbeat interval in ns.
    heartbeat: Option<i64>,
    /// Priority group fields; only a JSON body has them (as with the reference).
    group: Option<PullGroup>,
}

fn parse_pull(body: &[u8]) -> Result<PullBody, String> {
    let text = std::str::from_utf8(body).map_err(|e| e.to_string())?.trim();
    // Only a JSON object is parsed as one; anything else is a batch size, or 1.
    if !text.starts_with('{') {
        let n = text.parse::<i64>().unwrap_or(1).max(1);
        return Ok(PullBody {
            batch: n,
            ..Default::default()
        });
    }
    // Go's decoder leaves a field alone on null: so does this one.
    #[derive(Deserialize)]
    struct Req {
        #[serde(default, deserialize_with = "null_default")]
        batch: i64,
        #[serde(default, deserialize_with = "null_default")]
        max_bytes: i64,
        #[serde(default, deserialize_with = "null_default")]
        expires: i64,
        #[serde(default, deserialize_with = "null_default")]
        no_wait: bool,
        #[serde(default, deserialize_with = "null_default")]
        idle_heartbeat: i64,
        #[serde(flatten)]
        group: PullGroup,
    }
    let r: Req = super::api::parse_lenient(text.as_bytes(), &super::schema::PULL)?;
    // A heartbeat must fit twice into the wait (and needs one): the reference's rule.
    if r.idle_heartbeat > 0 && r.idle_heartbeat.saturating_mul(2) > r.expires {
        return Err("heartbeat value too large".into());
    }
    Ok(PullBody {
        batch: r.batch.max(1),
        max_bytes: r.max_bytes,
        expires: (r.expires != 0).then_some(r.expires),
        no_wait: r.no_wait,
        heartbeat: (r.idle_heartbeat > 0).then_some(r.idle_heartbeat),
        group: Some(r.group),
    })
}

/// (paused, remaining ns) for a pause deadline in Unix ns.
fn paused_for(pause_ns: Option<i64>) -> (bool, i64) {
    match pause_ns {
        Some(p) => {
            let left = p - now_nanos();
            (left > 0, left.max(0))
        }
        None => (false, 0),
    }
}

/// A pin id: random, like the reference's NUIDs (22 characters).
fn new_pin_id() -> String {
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    (0..22)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// Most inbound messages (acks, pull requests) handled per turn of the consumer's loop.
const INBOUND_BATCH_MSGS: usize = 1024;
const INBOUND_BATCH_BYTES: usize = 256 * 1024;

async fn run(
    c: Arc<Consumer>,
    server: Arc<Server>,
    mut rx: crate::inqueue::Receiver,
    requests: tokio::sync::mpsc::Sender<super::registry::Request>,
) {
    let mut router = Router::new(c.handle.account().clone(), c.created as u64);
    let mut closed = c.handle.closed_rx();
    // The stream's committed watermark: new messages to deliver (nothing past it is).
    let mut committed = c.stream.committed_watch();
    // For retention removals: the stream's actor waits for this sender to go at shutdown.
    let commands = c.stream.commands();
    let mut batch = vec![];
    loop {
        let (deadline, unbound) = {
            let st = c.lock();
            let unbound = st.config.is_push() && !st.push_bound;
            (st.next_deadline(), unbound.then_some(st.interest_gen))
        };
        let sleep = tokio::time::sleep_until(
            deadline
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(1))
                .into(),
        );
        // An unbound push consumer starts delivering as soon as its deliver subject has a
        // subscriber (the reference is told of new interest, it does not poll for it).
        let interest = c.handle.account().sublist.subscribed(unbound);
        tokio::select! {
            _ = interest => {}
            n = rx.recv_many(&mut batch, INBOUND_BATCH_MSGS, INBOUND_BATCH_BYTES) => if n == 0 {
                break;
            },
            _ = c.wake.notified() => {}
            r = committed.changed() => if r.is_err() {
                break;
            },
            _ = sleep => {}
            _ = crate::client::until_true(&mut closed) => break,
        }
        if batch.is_empty() {
            // Woken by a kick or a timer: take what is queued as well.
            rx.try_recv_many(&mut batch, INBOUND_BATCH_MSGS, INBOUND_BATCH_BYTES);
        }
        c.kick.store(false, Ordering::Release);
        if c.lock().deleted {
            break;
        }
        let mut sync_replies = vec![];
        let mut done = vec![];
        for m in batch.drain(..) {
            handle_msg(&c, &server, &mut router, m, &mut sync_replies, &mut done);
        }
        if rx.is_empty() {
            // Idle consumers are many: hold no batch capacity between bursts.
            batch = vec![];
        }
        timers(&c, &server, &mut router);
        deliver(&c, &server, &mut router);
        let mut replicate: Option<(Vec<u8>, u64)> = None;
        let sending = match c.stream.group {
            Some(_) => Some(c.sending.lock().await),
            None => None,
        };
        {
            let mut st = c.lock();
            let saved = if !sync_replies.is_empty() {
                // An ack the client asked to be confirmed is on disk before we confirm it;
                // if it cannot be written it is not confirmed (the client retries). For a
                // replicated stream that disk is a quorum's logs (the group commit below),
                // so the file here skips its fsync: it is made durable before the store's
                // marker passes its entry (`raft::stream::Shared::consumers_durable`).
                // Consumers confirming acks at once fsync side by side: each file has its
                // own lock in `MetaFiles`, and `fsync` moves this worker's other tasks
                // away once most workers sit in one.
                let sync = c.stream.group.is_none();
                let r = if sync {
                    super::stream::read::fsync(&c.stream.syncing, || c.save(&mut st, true))
                } else {
                    c.save(&mut st, false)
                };
                if r.is_err() {
                    sync_replies.clear();
                }
                r
            } else if st.dirty && st.last_save.elapsed() >= SAVE_INTERVAL {
                // Other changes are written at most every SAVE_INTERVAL (without fsync: they
                // survive a process kill), so a busy consumer does not rewrite its file per ack.
                c.save(&mut st, false)
            } else {
                Ok(None)
            };
            // A replicated stream's followers get the bytes just written.
            if let (Ok(Some(bytes)), true) = (saved, c.stream.group.is_some()) {
                replicate = Some((bytes, st.rep.ack_floor.stream_seq));
            }
        }
        if let Some(((state, ack_floor), sending)) = replicate.zip(sending) {
            // A confirmed ack is on a quorum's disks first.
            if !c
                .send_state(sending, state, ack_floor, !sync_replies.is_empty())
                .await
            {
                sync_replies.clear();
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
            // No lock is held here: the consumer may wait for room on its stream's queue.
            retention_check(&c, &commands, std::mem::take(&mut done)).await;
        }
        let events = std::mem::take(&mut c.lock().events);
        super::advisory::consumer_events(&server, &mut router, &c.stream.name, &c.name, events);
        router.flush();
        if inactive_expired(&c, &server, &mut router) {
            crate::debug!(
                server.log,
                "Deleting inactive consumer {} > {}",
                c.stream.name,
                c.name
            );
            // The registry removes it (the consumer never deletes itself); if its queue is
            // full, the next round asks again.
            let asked = requests.try_send(super::registry::Request::DeleteConsumer {
                account: c.handle.account().name.clone(),
                stream: c.stream.name.clone(),
                name: c.name.clone(),
                created: c.created,
            });
            if asked.is_ok() {
                break;
            }
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
            let was_delivered = ack.sseq <= st.rep.delivered.stream_seq;
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
    } else if subject.starts_with(b"$JS.API.CONSUMER.RESET.") {
        if let Some(reply) = &m.reply {
            reset_request(c, server, router, reply, m.payload(), done);
        }
    } else if let Some(reply) = m.reply.clone() {
        pull_request(c, server, router, reply, m.payload());
    }
}

/// `$JS.API.CONSUMER.RESET.<stream>.<consumer>`: back to the ack floor (empty body or
/// `seq` 0) or to `{"seq": n}`, answered with the consumer info and `reset_seq`.
fn reset_request(
    c: &Arc<Consumer>,
    server: &Server,
    router: &mut Router,
    reply: &Bytes,
    body: &[u8],
    done: &mut Vec<u64>,
) {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct ResetRequest {
        seq: u64,
    }
    let kind = "consumer_reset";
    let result = if body.iter().all(|b| b.is_ascii_whitespace()) {
        Ok(ResetRequest::default())
    } else {
        serde_json::from_slice::<ResetRequest>(body)
            .map_err(|e| ErrorKind::InvalidJson.with(super::api::go_json_error(body, &e, false)))
    }
    .and_then(|req| {
        let mut st = c.lock();
        st.reset(req.seq, &c.stream)
            .map_err(|e| ErrorKind::ConsumerInvalidReset.with(e))
    });
    let out = match result {
        Ok((seq, skipped)) => {
            // Skipped messages no longer keep an interest stream's copy alive.
            if c.stream.retention() == Retention::Interest {
                done.extend(skipped);
            }
            #[derive(Serialize)]
            struct ResetResponse {
                #[serde(flatten)]
                info: ConsumerInfo,
                reset_seq: u64,
            }
            super::api::to_bytes(&super::api::types::Response {
                kind: super::api::types::type_name(kind),
                body: &ResetResponse {
                    info: c.info(server, true),
                    reset_seq: seq,
                },
            })
        }
        Err(e) => super::api::error_response(kind, &e, &[("reset_seq", 0.into())]),
    };
    let data = Bytes::from(out);
    router.route(
        server,
        &Outgoing {
            subject: reply,
            reply: None,
            hdr_len: None,
            data: &data,
        },
        None,
    );
}

impl State {
    /// Resets the delivery state to start at `seq` (0: one past the ack floor). Returns
    /// the sequence and, for a forward move, the skipped sequences (retention may drop them).
    fn reset(&mut self, seq: u64, stream: &Stream) -> Result<(u64, Vec<u64>), &'static str> {
        let seq = if seq == 0 {
            self.rep.ack_floor.stream_seq + 1
        } else {
            match self.config.deliver_policy {
                DeliverPolicy::All => seq,
                DeliverPolicy::ByStartSequence => {
                    if seq < self.config.opt_start_seq.unwrap_or(0) {
                        return Err("below start seq");
                    }
                    seq
                }
                DeliverPolicy::ByStartTime => {
                    let t = self
                        .config
                        .opt_start_time
                        .as_deref()
                        .and_then(parse_rfc3339)
                        .unwrap_or(0);
                    let store = stream.read();
                    let state = store.state();
                    let mut s = state.first_seq.max(1);
                    let first = loop {
                        match store.load_next(s, ">") {
                            Ok(m) if m.ts >= t => break m.seq,
                            Ok(m) => s = m.seq + 1,
                            Err(_) => break state.last_seq + 1,
                        }
                    };
                    if seq < first {
                        return Err("below start time");
                    }
                    seq
                }
                _ => return Err("not allowed"),
            }
        }
        .max(1);
        let old_floor = self.rep.ack_floor.stream_seq;
        let skipped: Vec<u64> = if seq > old_floor + 1 {
            let store = stream.read();
            let mut v = vec![];
            let mut s = old_floor + 1;
            while let Ok(m) = store.load_next(s, ">") {
                if m.seq >= seq {
                    break;
                }
                v.push(m.seq);
                s = m.seq + 1;
            }
            v
        } else {
            vec![]
        };
        self.apply(ConsumerOp::Reset { seq });
        self.lps.clear();
        self.next_seq = seq;
        self.last_delivery = 0;
        self.last_ack = 0;
        self.replay_prev = None;
        self.replay_wait = None;
        self.epoch += 1;
        self.dirty = true;
        Ok((seq, skipped))
    }
}

/// Is anyone subscribed to `reply`? Through the router's match cache, so cheap per delivery.
fn has_interest(router: &mut Router, server: &Server, reply: &Bytes) -> bool {
    router.has_interest(server, reply)
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
    let reject = |st: MutexGuard<'_, State>, router: &mut Router, status: &str| {
        drop(st);
        send_status(server, router, &reply, &status_hdr(status, &[]));
    };
    if st.config.is_push() {
        return reject(st, router, "409 Consumer is push based");
    }
    let req = match parse_pull(body) {
        Ok(r) => r,
        Err(e) => return reject(st, router, &format!("400 Bad Request - {e}")),
    };
    let cfg = &st.config;
    let violation = if cfg.max_batch > 0 && req.batch > cfg.max_batch {
        Some(format!("409 Exceeded MaxRequestBatch of {}", cfg.max_batch))
    } else if cfg.max_expires > 0 && req.expires.is_some_and(|e| e > cfg.max_expires) {
        Some(format!(
            "409 Exceeded MaxRequestExpires of {}",
            crate::time::go_duration(cfg.max_expires)
        ))
    } else if cfg.max_bytes > 0 && req.max_bytes > cfg.max_bytes {
        Some(format!(
            "409 Exceeded MaxRequestMaxBytes of {}",
            cfg.max_bytes
        ))
    } else if let Some(g) = &req.group {
        let policy = &cfg.priority_policy;
        if (g.min_pending != 0 || g.min_ack_pending != 0) && *policy != PriorityPolicy::Overflow {
            Some("400 Bad Request - Not a Overflow Priority consumer".into())
        } else if !g.id.is_empty() && *policy != PriorityPolicy::PinnedClient {
            Some("400 Bad Request - Not a Pinned Client Priority consumer".into())
        } else if !(0..=9).contains(&g.priority) {
            Some("400 Bad Request - Priority must be between 0 and 9".into())
        } else if policy.is_none() {
            None
        } else if g.group.is_empty() {
            Some("400 Bad Request - Priority Group missing".into())
        } else if !cfg.priority_groups.contains(&g.group) {
            Some("400 Bad Request - Invalid Priority Group".into())
        } else {
            None
        }
    } else {
        None
    };
    if let Some(v) = violation {
        return reject(st, router, &v);
    }
    let ttl = Duration::from_nanos(st.config.priority_timeout.max(0) as u64);
    let pin_state = match (&req.group, &st.pin) {
        (Some(g), Some(pin)) if g.id == pin.id => Some(true),
        (Some(g), Some(_)) if !g.id.is_empty() => Some(false),
        _ => None,
    };
    match pin_state {
        // The pinned client is still asking: it keeps its pin.
        Some(true) => {
            if let Some(pin) = st.pin.as_mut() {
                pin.deadline = Instant::now() + ttl;
            }
        }
        Some(false) => return reject(st, router, "423 Nats-Pin-Id mismatch"),
        None => {}
    }
    let max_waiting = st.config.max_waiting.max(1) as usize;
    if st.waiting.len() >= max_waiting {
        // Full: make room by dropping requests whose requester is gone, so a crash-looping
        // worker cannot fill the queue with dead requests.
        prune_dead(&mut st, server, router);
    }
    if req.no_wait {
        let available = st.num_pending(&c.stream) + st.rdq.len() as u64;
        if available == 0 && req.expires.is_none() {
            return reject(st, router, "404 No Messages");
        }
        if available > 0 {
            let asked: i64 = st.waiting.iter().map(|w| w.batch).sum();
            if available < asked.max(0) as u64 {
                return reject(st, router, "408 Requests Pending");
            }
        }
    }
    if st.waiting.len() >= max_waiting {
        drop(st);
        // With a heartbeat the client notices the missing heartbeats instead; a 409 would
        // have it retry in a hot loop (the reference's reasoning).
        if req.heartbeat.is_none() {
            send_status(
                server,
                router,
                &reply,
                &status_hdr("409 Exceeded MaxWaiting", &[]),
            );
        }
        return;
    }
    if req.expires.is_some_and(|e| e < 0) {
        drop(st);
        let hdr = status_hdr(
            "408 Request Timeout",
            &[
                ("Nats-Pending-Messages", req.batch.to_string()),
                ("Nats-Pending-Bytes", req.max_bytes.max(0).to_string()),
            ],
        );
        send_status(server, router, &reply, &hdr);
        return;
    }
    let now = Instant::now();
    st.pull_seq += 1;
    let id = st.pull_seq;
    let hb = req.heartbeat.map(|h| Duration::from_nanos(h as u64));
    let w = PullRequest {
        id,
        reply,
        batch: req.batch,
        max_bytes: req.max_bytes.max(0),
        expires: req
            .expires
            .map(|e| now + Duration::from_nanos(e.max(0) as u64)),
        heartbeat: hb,
        next_hb: hb.map(|h| now + h),
        no_wait: req.no_wait,
        delivered: 0,
        seen: false,
        group: req.group,
    };
    if st.config.priority_policy == PriorityPolicy::Prioritized {
        insert_by_priority(&mut st.waiting, w);
        drop(st);
        // Served once this batch is handled, not at once: requests that arrived together
        // are all queued by then (`set_ranking`), so the most urgent is served first, as
        // by the reference's queue, not merely the first to arrive.
        c.notify();
        return;
    }
    st.waiting.push_back(w);
    drop(st);
    deliver(c, server, router);
}

/// A prioritized consumer's task is woken once a client's read batch is routed, so the
/// pull requests of one write reach it together and are ranked together.
fn set_ranking(q: &crate::inqueue::InQueue, config: &ConsumerConfig) {
    q.set_wake_after_batch(config.priority_policy == PriorityPolicy::Prioritized);
}

/// Queues `w` after every request of the same or a more urgent (lower) priority.
fn insert_by_priority(waiting: &mut VecDeque<PullRequest>, w: PullRequest) {
    let p = w.priority();
    let at = waiting
        .iter()
        .position(|o| o.priority() > p)
        .unwrap_or(waiting.len());
    waiting.insert(at, w);
}

/// Drops waiting requests nobody listens for any more (requester unsubscribed, closed or
/// died). They get no status: there is no one to tell.
fn prune_dead(st: &mut State, server: &Server, router: &mut Router) {
    st.interest_gen = router.account().sublist.generation();
    st.waiting
        .retain(|w| has_interest(router, server, &w.reply));
}

impl State {
    fn next_deadline(&self) -> Option<Instant> {
        let mut d: Option<Instant> = None;
        let mut consider = |t: Instant| d = Some(d.map_or(t, |x| x.min(t)));
        if self.dirty {
            consider(self.last_save + SAVE_INTERVAL);
        }
        if self.config.ack_policy != AckPolicy::None {
            for &d in self.deadlines.values() {
                consider(d);
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
        if self.config.is_push() && !self.push_bound {
            // New subscriptions wake the task; this only backs that up.
            consider(Instant::now() + Duration::from_secs(1));
        }
        if let (true, left) = paused_for(self.pause_ns) {
            consider(Instant::now() + Duration::from_nanos(left as u64));
        }
        if let Some(w) = self.replay_wait {
            consider(w);
        }
        if let Some(p) = &self.pin {
            consider(p.deadline);
        }
        d
    }
}

/// Ack deadlines, pull expiries, heartbeats, pin timeouts and requesters that went away.
fn timers(c: &Arc<Consumer>, server: &Server, router: &mut Router) {
    let now = Instant::now();
    let mut statuses: Vec<(Bytes, Vec<u8>)> = vec![];
    {
        let mut st = c.lock();
        if st.config.ack_policy != AckPolicy::None {
            let due: Vec<u64> = st
                .deadlines
                .iter()
                .filter(|(s, d)| **d <= now && !st.rdq.contains(s))
                .map(|(s, _)| *s)
                .collect();
            for s in due {
                if st.deliveries_exhausted(s) {
                    continue;
                }
                st.rdq.insert(s);
                // Park it far away until it is redelivered.
                if let Some(d) = st.deadlines.get_mut(&s) {
                    *d = now + Duration::from_secs(86400 * 365);
                }
            }
        }
        if st.pin.as_ref().is_some_and(|p| p.deadline <= now) {
            // The pinned client stopped asking: the next request gets the pin.
            st.pin = None;
            st.dirty = true;
        }
        if !st.waiting.is_empty()
            && st.interest_gen != router.account().sublist.generation()
            && st.last_prune.elapsed() >= PRUNE_INTERVAL
        {
            // Someone subscribed or unsubscribed since the last look. Only housekeeping
            // (deliveries check each request themselves), so at most every PRUNE_INTERVAL.
            st.last_prune = now;
            prune_dead(&mut st, server, router);
        }
        let (last_c, last_s) = (st.rep.delivered.consumer_seq, st.rep.delivered.stream_seq);
        // A waiting request's timer fired (an expiry or a heartbeat due): as the
        // reference's, that also ends the no_wait requests that got something (or set no
        // expiry) but are held back, by max_ack_pending or pacing, with 404; otherwise one
        // would wait until an ack and then get messages its client no longer waits for.
        let fired = st
            .waiting
            .iter()
            .any(|w| w.expires.is_some_and(|e| e <= now) || w.next_hb.is_some_and(|n| n <= now));
        let mut i = 0;
        while i < st.waiting.len() {
            let w = &mut st.waiting[i];
            if w.expires.is_some_and(|e| e <= now) {
                let w = st.waiting.remove(i).expect("index valid");
                statuses.push((w.reply.clone(), w.timeout_status()));
                continue;
            }
            if fired && w.no_wait && w.seen && (w.expires.is_none() || w.delivered > 0) {
                let w = st.waiting.remove(i).expect("index valid");
                statuses.push((w.reply.clone(), status_hdr("404 No Messages", &[])));
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

/// Why a delivery pass stopped.
#[derive(PartialEq, Eq)]
enum Stop {
    /// Nothing more to deliver now (or nobody to deliver to).
    Done,
    /// Held back by max_ack_pending: waiting no_wait requests keep waiting for acks.
    AckPending,
    /// Replay policy original: the next message is not due yet.
    Pacing,
}

/// Delivers as much as the consumer's targets and limits allow, then finishes the
/// no_wait requests that got what there was.
fn deliver(c: &Arc<Consumer>, server: &Server, router: &mut Router) {
    let stop = deliver_pass(c, server, router);
    if stop != Stop::Done {
        // Held back: the no_wait requests were looked at, and a timer may end them now.
        for w in c.lock().waiting.iter_mut().filter(|w| w.no_wait) {
            w.seen = true;
        }
        return;
    }
    // End of what is available: a no_wait request that got something (or set no expiry)
    // is answered 404; one with an expiry that got nothing waits for it (the reference).
    let finished: Vec<Bytes> = {
        let mut st = c.lock();
        if st.waiting.iter().all(|w| !w.no_wait) {
            return;
        }
        let mut out = vec![];
        st.waiting.retain(|w| {
            let done = w.no_wait && (w.expires.is_none() || w.delivered > 0);
            if done {
                out.push(w.reply.clone());
            }
            !done
        });
        out
    };
    for reply in finished {
        send_status(server, router, &reply, &status_hdr("404 No Messages", &[]));
    }
}

/// What a delivery changed, so it can be undone when nobody received it.
struct Undo {
    epoch: u64,
    seq: u64,
    deliveries: u64,
    before: super::consumer_state::UndoPoint,
    deadline: Option<Instant>,
    last_delivery: i64,
    from_lps: bool,
    request: Option<u64>,
    size: usize,
}

/// Puts a message that was taken but not sent back where it came from.
fn put_back(st: &mut State, seq: u64, deliveries: u64, from_lps: bool) {
    if deliveries > 1 {
        st.rdq.insert(seq);
    } else if from_lps {
        st.lps.push_front(seq);
    } else {
        st.next_seq = st.next_seq.min(seq);
    }
}

/// The waiting request that gets the next message, if any (the reference's order: expired
/// ones answered, pins and overflow thresholds honoured, byte budgets checked, requesters
/// that went away dropped). Updates the request as served and returns (id, reply, batch
/// left, bytes left, pin id).
fn next_waiting(
    st: &mut State,
    size: usize,
    pending_incl: u64,
    server: &Server,
    router: &mut Router,
    statuses: &mut Vec<(Bytes, Vec<u8>)>,
) -> Option<(u64, Bytes, i64, i64, Option<String>)> {
    let now = Instant::now();
    let policy = st.config.priority_policy.clone();
    let mut cycled = 0;
    while !st.waiting.is_empty() {
        let w = &st.waiting[0];
        if w.expires.is_some_and(|e| e <= now) {
            let w = st.waiting.pop_front().expect("not empty");
            statuses.push((w.reply.clone(), w.timeout_status()));
            continue;
        }
        let wrong_pin = |w: &PullRequest| {
            status_hdr(
                "423 Nats-Wrong-Pin-Id",
                &[
                    ("Nats-Pending-Messages", w.batch.to_string()),
                    ("Nats-Pending-Bytes", w.max_bytes.to_string()),
                ],
            )
        };
        let mut assigned = false;
        if policy == PriorityPolicy::PinnedClient {
            enum Act {
                Assign,
                Serve,
                Wait,
                Wrong,
            }
            let wid = w.group.as_ref().map_or("", |g| g.id.as_str());
            let has_group = w.group.as_ref().is_some_and(|g| !g.group.is_empty());
            let act = match &st.pin {
                None if wid.is_empty() && has_group => Act::Assign,
                // Without a group nothing can be pinned; it is served as is.
                None if wid.is_empty() => Act::Serve,
                Some(pin) if wid == pin.id => Act::Serve,
                Some(_) if wid.is_empty() => Act::Wait,
                _ => Act::Wrong,
            };
            match act {
                Act::Assign => {
                    let id = new_pin_id();
                    let ttl = Duration::from_nanos(st.config.priority_timeout.max(0) as u64);
                    st.pin = Some(Pin {
                        id: id.clone(),
                        ts: now_nanos(),
                        deadline: now + ttl,
                    });
                    st.dirty = true;
                    if let Some(g) = st.waiting[0].group.as_mut() {
                        g.id = id;
                    }
                    assigned = true;
                }
                Act::Serve => {}
                Act::Wait => {
                    // Someone else holds the pin: this one waits its turn.
                    st.waiting.rotate_left(1);
                    cycled += 1;
                    if cycled >= st.waiting.len() {
                        return None;
                    }
                    continue;
                }
                Act::Wrong => {
                    let w = st.waiting.pop_front().expect("not empty");
                    statuses.push((w.reply.clone(), wrong_pin(&w)));
                    continue;
                }
            }
        }
        let w = &st.waiting[0];
        if policy == PriorityPolicy::Overflow {
            if let Some(g) = &w.group {
                let wanted = g.min_pending > 0 || g.min_ack_pending > 0;
                let backed_up = (g.min_pending > 0 && g.min_pending as u64 <= pending_incl)
                    || (g.min_ack_pending > 0
                        && g.min_ack_pending as usize <= st.rep.pending.len());
                if wanted && !backed_up {
                    st.waiting.rotate_left(1);
                    cycled += 1;
                    if cycled >= st.waiting.len() {
                        return None;
                    }
                    continue;
                }
            }
        }
        if w.max_bytes > 0 && size as i64 > w.max_bytes {
            let w = st.waiting.pop_front().expect("not empty");
            if assigned {
                st.pin = None;
            }
            let hdr = status_hdr(
                "409 Message Size Exceeds MaxBytes",
                &[
                    ("Nats-Pending-Messages", w.batch.to_string()),
                    ("Nats-Pending-Bytes", w.max_bytes.to_string()),
                ],
            );
            statuses.push((w.reply, hdr));
            continue;
        }
        if !has_interest(router, server, &w.reply) {
            // The requester is gone: drop the request, tell no one.
            st.waiting.pop_front();
            if assigned {
                st.pin = None;
            }
            continue;
        }
        let mut w = st.waiting.pop_front().expect("not empty");
        if w.max_bytes > 0 {
            w.max_bytes -= size as i64;
            if w.max_bytes == 0 {
                w.batch = 1; // The budget is spent exactly: this is its last message.
            }
        }
        w.batch -= 1;
        w.delivered += 1;
        if let Some(h) = w.heartbeat {
            w.next_hb = Some(now + h);
        }
        let pin = (policy == PriorityPolicy::PinnedClient)
            .then(|| st.pin.as_ref().map(|p| p.id.clone()))
            .flatten();
        let chosen = (w.id, w.reply.clone(), w.batch, w.max_bytes, pin);
        if w.batch > 0 {
            // Requests take turns, one message each (the reference's order).
            if policy == PriorityPolicy::Prioritized {
                insert_by_priority(&mut st.waiting, w);
            } else {
                st.waiting.push_back(w);
            }
        }
        return Some(chosen);
    }
    None
}

fn deliver_pass(c: &Arc<Consumer>, server: &Server, router: &mut Router) -> Stop {
    let mut st = c.lock();
    let push = st.config.is_push();
    let deliver_subject = st.config.deliver_subject.clone().map(Bytes::from);
    if push {
        let ds = deliver_subject
            .as_ref()
            .expect("push has a deliver subject");
        // Read before the check: a later change wakes the task (see Sublist::subscribed).
        st.interest_gen = router.account().sublist.generation();
        st.push_bound = router.has_interest(server, ds);
        if st.push_bound {
            st.last_active = Instant::now();
        } else {
            return Stop::Done;
        }
    }
    let mut statuses: Vec<(Bytes, Vec<u8>)> = vec![];
    let mut ack_subjects = AckSubjects::new(&c.stream.name, &c.name);
    let stop = loop {
        if st.deleted || paused_for(st.pause_ns).0 {
            break Stop::Done;
        }
        if !push && st.waiting.is_empty() {
            break Stop::Done;
        }
        if push && st.fc_pending.is_some() && st.fc_bytes >= 2 * FC_WINDOW {
            break Stop::Done; // Stalled until the client answers flow control.
        }
        if let Some(due) = st.replay_wait {
            if Instant::now() < due {
                break Stop::Pacing;
            }
            st.replay_wait = None;
        }
        // Redeliveries first, then new messages within max_ack_pending.
        let (msg, deliveries) = if let Some(seq) = st.rdq.pop_first() {
            let dc = st.rep.deliveries(seq) + 1;
            if st.config.max_deliver > 0 && dc > st.config.max_deliver as u64 {
                // Out of attempts: it stays unacked but is never sent again.
                st.on_max_deliveries(seq, dc - 1);
                st.apply(ConsumerOp::GiveUp { sseq: seq });
                continue;
            }
            let loaded = c.stream.read().load(seq);
            match loaded {
                Ok(m) => (m, dc),
                Err(_) => {
                    // Gone from the stream (deleted, expired): nothing to redeliver.
                    st.apply(ConsumerOp::Gone { sseq: seq });
                    continue;
                }
            }
        } else {
            let limit = st.config.max_ack_pending;
            if st.config.ack_policy != AckPolicy::None
                && limit > 0
                && st.rep.pending.len() as i64 >= limit
            {
                break Stop::AckPending;
            }
            match st.next_new(&c.stream) {
                Some(m) => (m, 1),
                None => break Stop::Done,
            }
        };
        let from_lps = deliveries == 1 && st.from_lps;
        // Replay policy original: messages go out as far apart as they were stored.
        if st.replay_until > 0 {
            if let Some((lts, sent)) = st.replay_prev {
                let gap = msg.ts - lts;
                if gap > 1_000_000 {
                    let due = sent + Duration::from_nanos(gap as u64);
                    if Instant::now() < due {
                        put_back(&mut st, msg.seq, deliveries, from_lps);
                        st.replay_wait = Some(due);
                        break Stop::Pacing;
                    }
                }
            }
        }
        // Sized as the reference does: subject, ack reply subject, headers, payload.
        let pending_after = st.num_pending(&c.stream);
        let cseq = st.rep.delivered.consumer_seq + 1;
        let ack_subject = ack_subjects.next(&[deliveries, msg.seq, cseq], msg.ts, pending_after);
        let size = msg.subject.len() + ack_subject.len() + msg.hdr.len() + msg.data.len();
        // Pick the target: a waiting pull request, or the push subject.
        let (target, request, left, pin) = if push {
            let ds = deliver_subject.clone().expect("push has a deliver subject");
            (ds, None, None, None)
        } else {
            match next_waiting(
                &mut st,
                size,
                pending_after + 1,
                server,
                router,
                &mut statuses,
            ) {
                Some((id, reply, batch, bytes, pin)) => {
                    (reply, Some(id), Some((batch, bytes)), pin)
                }
                None => {
                    put_back(&mut st, msg.seq, deliveries, from_lps);
                    break Stop::Done;
                }
            }
        };
        if st.replay_until > 0 {
            st.replay_prev = Some((msg.ts, Instant::now()));
        }
        // Bookkeeping for this delivery.
        let undo = Undo {
            epoch: st.epoch,
            seq: msg.seq,
            deliveries,
            before: st.rep.undo_point(msg.seq),
            deadline: st.deadlines.get(&msg.seq).copied(),
            last_delivery: st.last_delivery,
            from_lps,
            request,
            size,
        };
        let tracked = st.config.ack_policy != AckPolicy::None;
        st.apply(ConsumerOp::Delivered {
            sseq: msg.seq,
            cseq,
            deliveries,
            tracked,
        });
        if tracked {
            let wait = st.ack_wait_for(deliveries);
            st.deadlines.insert(msg.seq, Instant::now() + wait);
        }
        if st.replay_until > 0 && st.next_seq > st.replay_until && st.lps.is_empty() {
            st.replay_until = 0; // Caught up: new messages go out at once.
        }
        st.last_delivery = now_nanos();
        st.dirty = true;
        if push {
            st.last_push_hb = Instant::now();
            st.fc_bytes += size;
        }
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
        for (to, hdr) in statuses.drain(..) {
            send_status(server, router, &to, &hdr);
        }
        let (hdr_len, data) = delivery_body(&msg, headers_only, pin.as_deref());
        let reply = ack_subject;
        let received = router.route_to(
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
        st = c.lock();
        if !received {
            // The subscriber vanished since the interest check: this was no delivery.
            undo_delivery(&mut st, undo);
            if push {
                st.push_bound = false;
                break Stop::Done;
            }
            continue;
        }
        drop(st);
        if let Some((batch, bytes)) = left {
            if batch <= 0 && bytes > 0 {
                // The batch is complete with bytes to spare: say so (the reference).
                let hdr = status_hdr(
                    "409 Batch Completed",
                    &[
                        ("Nats-Pending-Messages", batch.to_string()),
                        ("Nats-Pending-Bytes", bytes.to_string()),
                    ],
                );
                send_status(server, router, &target, &hdr);
            }
        }
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
    };
    st.ra = keel_store::ReadAhead::default();
    drop(st);
    for (to, hdr) in statuses {
        send_status(server, router, &to, &hdr);
    }
    stop
}

/// The reply subjects of a delivery pass, `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.
/// <cseq>.<ts>.<pending>`, written into one buffer and split off it, so most cost no
/// allocation of their own.
struct AckSubjects {
    prefix: Vec<u8>,
    buf: bytes::BytesMut,
}

impl AckSubjects {
    fn new(stream: &str, consumer: &str) -> AckSubjects {
        AckSubjects {
            prefix: format!("$JS.ACK.{stream}.{consumer}.").into_bytes(),
            buf: bytes::BytesMut::new(),
        }
    }

    fn next(&mut self, nums: &[u64; 3], ts: i64, pending: u64) -> Bytes {
        use bytes::BufMut;
        let need = self.prefix.len() + 5 * 21;
        if self.buf.capacity() - self.buf.len() < need {
            self.buf.reserve(need.max(4096));
        }
        self.buf.put_slice(&self.prefix);
        for &n in nums {
            keel_protocol::encode::put_uint(&mut self.buf, n);
            self.buf.put_u8(b'.');
        }
        if ts < 0 {
            self.buf.put_u8(b'-');
        }
        keel_protocol::encode::put_uint(&mut self.buf, ts.unsigned_abs());
        self.buf.put_u8(b'.');
        keel_protocol::encode::put_uint(&mut self.buf, pending);
        self.buf.split().freeze()
    }
}

/// Reverts the bookkeeping of a delivery nobody received, and drops its (dead) request.
fn undo_delivery(st: &mut State, u: Undo) {
    if st.epoch != u.epoch {
        return; // A reset replaced the state meanwhile.
    }
    st.apply(ConsumerOp::Undo {
        sseq: u.seq,
        before: u.before,
    });
    match u.deadline {
        Some(d) => st.deadlines.insert(u.seq, d),
        None => st.deadlines.remove(&u.seq),
    };
    st.last_delivery = u.last_delivery;
    if st.config.is_push() {
        st.fc_bytes = st.fc_bytes.saturating_sub(u.size);
    }
    if let Some(id) = u.request {
        st.waiting.retain(|w| w.id != id);
    }
    put_back(st, u.seq, u.deliveries, u.from_lps);
}

/// The header block and payload of a delivery: stored headers (plus `Nats-Msg-Size` for
/// headers_only, `Nats-Pin-Id` for a pinned client) and the payload.
fn delivery_body(msg: &StoredMsg, headers_only: bool, pin: Option<&str>) -> (Option<usize>, Bytes) {
    if !headers_only && pin.is_none() {
        if msg.hdr.is_empty() {
            return (None, msg.data.clone());
        }
        let mut d = Vec::with_capacity(msg.hdr.len() + msg.data.len());
        d.extend_from_slice(&msg.hdr);
        d.extend_from_slice(&msg.data);
        return (Some(msg.hdr.len()), Bytes::from(d));
    }
    let mut h: Vec<u8> = if msg.hdr.is_empty() {
        b"NATS/1.0\r\n".to_vec()
    } else {
        msg.hdr[..msg.hdr.len() - 2].to_vec()
    };
    if headers_only {
        h.extend_from_slice(format!("Nats-Msg-Size: {}\r\n", msg.data.len()).as_bytes());
    }
    if let Some(p) = pin {
        h.extend_from_slice(format!("Nats-Pin-Id: {p}\r\n").as_bytes());
    }
    h.extend_from_slice(b"\r\n");
    let hdr_len = h.len();
    if !headers_only {
        h.extend_from_slice(&msg.data);
    }
    (Some(hdr_len), Bytes::from(h))
}

/// Interest and work-queue streams drop a message once every interested consumer is done:
/// the stream's actor decides (with every consumer's view) and removes.
async fn retention_check(
    c: &Arc<Consumer>,
    commands: &Option<tokio::sync::mpsc::Sender<super::stream::Command>>,
    done: Vec<u64>,
) {
    if c.stream.retention() == Retention::Limits {
        return;
    }
    if let Some(tx) = commands {
        let _ = tx
            .send(super::stream::Command::Retention { seqs: done })
            .await;
    }
}

fn inactive_expired(c: &Arc<Consumer>, server: &Server, router: &mut Router) -> bool {
    let mut st = c.lock();
    // A durable with a threshold goes too, as with the reference (an ephemeral always has
    // one).
    if st.config.inactive_threshold <= 0 {
        return false;
    }
    let threshold = Duration::from_nanos(st.config.inactive_threshold as u64);
    if st.last_active.elapsed() < threshold {
        return false;
    }
    // A message delivered and not acked may still be worked on: the threshold counts from
    // its ack deadline.
    let now = Instant::now();
    if st.deadlines.values().any(|d| *d + threshold > now) {
        return false;
    }
    if st.config.is_push() {
        if let Some(ds) = &st.config.deliver_subject {
            if !router.account().sublist.matches(ds.as_bytes()).is_empty() {
                return false;
            }
        }
    } else {
        // Requests of requesters that went away do not keep it alive.
        prune_dead(&mut st, server, router);
        if !st.waiting.is_empty() {
            return false;
        }
    }
    true
}

/// The granularity of [`SavedState::pending_due`]: a pulled batch's due times fall in one
/// step, so it is one run.
const DUE_STEP_MS: i64 = 100;

/// Runs of (count, due time) over due times in Unix ms, each rounded up to `DUE_STEP_MS`
/// (never earlier than it was).
fn due_runs_of(dues_ms: impl Iterator<Item = i64>) -> Vec<(u64, i64)> {
    let mut runs: Vec<(u64, i64)> = Vec::new();
    for at in dues_ms {
        let at = at.div_euclid(DUE_STEP_MS) * DUE_STEP_MS
            + if at.rem_euclid(DUE_STEP_MS) > 0 {
                DUE_STEP_MS
            } else {
                0
            };
        match runs.last_mut() {
            Some((n, t)) if *t == at => *n += 1,
            _ => runs.push((1, at)),
        }
    }
    runs
}

/// The due times of `n` pending deliveries in order, if `runs` covers exactly that many
/// (a state from an older Keel has none; a damaged one may not add up).
fn due_times(runs: &[(u64, i64)], n: usize) -> Option<Vec<i64>> {
    let total = runs
        .iter()
        .try_fold(0u64, |sum, (count, _)| sum.checked_add(*count))?;
    if total != n as u64 {
        return None;
    }
    Some(
        runs.iter()
            .flat_map(|&(count, t)| std::iter::repeat_n(t, count as usize))
            .collect(),
    )
}

/// What a durable consumer finds of its saved state.
enum Loaded {
    /// Nothing saved yet: a new consumer.
    Fresh,
    Saved(SavedState),
    /// Saved state exists but no copy can be trusted.
    Untrusted,
}

fn load_state(
    meta: &keel_store::MetaFiles,
    dir: &Path,
    stream: &str,
    name: &str,
    log: &crate::log::Log,
) -> Loaded {
    let what = format!("Consumer {stream} > {name}: state");
    let why = match super::files::read(meta, &dir.join("state.json"), &what, log) {
        Ok(None) => return Loaded::Fresh,
        Ok(Some(b)) => match serde_json::from_slice::<SavedState>(&b) {
            Ok(s) if s.consistent() => return Loaded::Saved(s),
            Ok(_) => "inconsistent content".to_string(),
            Err(e) => e.to_string(),
        },
        Err(e) => e,
    };
    crate::error!(
        log,
        "Consumer {stream} > {name}: saved state is damaged ({why}) and no older copy verifies; redelivering from where the consumer started"
    );
    Loaded::Untrusted
}

impl SavedState {
    /// The invariants every state this server wrote keeps.
    fn consistent(&self) -> bool {
        let (floor, top) = (self.ack_floor.stream_seq, self.delivered.stream_seq);
        floor <= top
            && self.pending.iter().all(|&(s, _)| s > floor && s <= top)
            && self.pending_runs.iter().all(|&(s, c, n)| {
                n > 0
                    && s > floor
                    && s.checked_add(n - 1).is_some_and(|last| last <= top)
                    && c.checked_add(n - 1).is_some()
            })
    }

    /// The snapshot of the replicated state that is written.
    fn of(r: &Replicated) -> SavedState {
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        for (&s, &c) in &r.pending {
            match runs.last_mut() {
                Some((s0, c0, n)) if *s0 + *n == s && *c0 + *n == c => *n += 1,
                _ => runs.push((s, c, 1)),
            }
        }
        SavedState {
            delivered: r.delivered,
            ack_floor: r.ack_floor,
            pending_runs: runs,
            pending: Vec::new(),
            redelivered: r.redelivered.iter().map(|(s, n)| (*s, *n)).collect(),
            pin: None,
            pending_due: Vec::new(),
        }
    }

    /// (Only after `consistent`: the runs are bounded by the delivered sequence.)
    fn into_replicated(self) -> Replicated {
        let runs = self
            .pending_runs
            .into_iter()
            .flat_map(|(s, c, n)| (0..n).map(move |i| (s + i, c + i)));
        Replicated {
            delivered: self.delivered,
            ack_floor: self.ack_floor,
            pending: self.pending.into_iter().chain(runs).collect(),
            redelivered: self.redelivered.into_iter().collect(),
        }
    }
}

/// The stream's messages from `from` on that `config`'s filters take.
fn pending_from(stream: &Stream, config: &ConsumerConfig, from: u64) -> u64 {
    let store = stream.read();
    let filters = config.filter_list();
    if filters.is_empty() {
        return store.num_pending(from, ">", false);
    }
    filters
        .iter()
        .map(|f| store.num_pending(from, f, false))
        .sum()
}

/// A consumer as a follower of its replicated stream has it (the files its group wrote
/// here; it runs where the stream leads), for `/jsz`'s `consumer_detail`, as the
/// reference's replicas report theirs. Read quietly (monitoring polls it): None when its
/// config cannot be read; a state that cannot be read counts as nothing delivered.
pub fn replica_info(
    stream: &Stream,
    dir: &Path,
    cluster: Option<super::api::types::ClusterInfo>,
) -> Option<ConsumerInfo> {
    use keel_store::MetaRead;
    let body = |file: &str| match stream.meta.read(&dir.join(file)) {
        MetaRead::Current(b) | MetaRead::Older { body: b, .. } | MetaRead::Unchecked(b) => Some(b),
        MetaRead::Missing | MetaRead::Damaged(_) => None,
    };
    let meta: ConsumerMeta = serde_json::from_slice(&body("meta.json")?).ok()?;
    let rep = body("state.json")
        .and_then(|b| serde_json::from_slice::<SavedState>(&b).ok())
        .filter(|s| s.consistent())
        .map_or_else(Replicated::default, SavedState::into_replicated);
    let config = meta.config;
    let num_pending = pending_from(stream, &config, rep.delivered.stream_seq + 1);
    let seq = |p: SeqPair| SequenceInfo {
        consumer_seq: p.consumer_seq,
        stream_seq: p.stream_seq,
        last_active: None,
    };
    Some(ConsumerInfo {
        stream_name: stream.name.clone(),
        name: dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        created: rfc3339(meta.created),
        config: config.to_json(false),
        delivered: seq(rep.delivered),
        ack_floor: seq(rep.ack_floor),
        num_ack_pending: rep.pending.len(),
        num_redelivered: if config.max_deliver == 1 {
            0
        } else {
            rep.redelivered.len()
        },
        num_waiting: 0,
        num_pending,
        cluster,
        push_bound: false,
        paused: false,
        pause_remaining: None,
        ts: rfc3339(now_nanos()),
        priority_groups: Vec::new(),
    })
}

pub fn read_meta(
    meta: &keel_store::MetaFiles,
    dir: &Path,
    log: &crate::log::Log,
) -> Result<ConsumerMeta, String> {
    let b = super::files::read(meta, &dir.join("meta.json"), "Consumer config", log)?
        .ok_or("no consumer config (meta.json)")?;
    serde_json::from_slice(&b).map_err(|e| e.to_string())
}

/// Advisory hooks: what the reference reports about deliveries, recorded as events.
impl State {
    fn deliveries(&self, sseq: u64) -> u64 {
        self.rep.deliveries(sseq)
    }

    fn on_nak(&mut self, sseq: u64) {
        let Some(&cseq) = self.rep.pending.get(&sseq) else {
            return;
        };
        let kind = ConsumerEventKind::Nak {
            stream_seq: sseq,
            consumer_seq: cseq,
            deliveries: self.deliveries(sseq),
        };
        self.events.push(ConsumerEvent::new(kind));
    }

    fn on_term(&mut self, sseq: u64, reason: &str) {
        let Some(&cseq) = self.rep.pending.get(&sseq) else {
            return;
        };
        let kind = ConsumerEventKind::Terminated {
            stream_seq: sseq,
            consumer_seq: cseq,
            deliveries: self.deliveries(sseq),
            reason: reason.to_string(),
        };
        self.events.push(ConsumerEvent::new(kind));
    }

    fn on_max_deliveries(&mut self, sseq: u64, deliveries: u64) {
        let kind = ConsumerEventKind::MaxDeliveries {
            stream_seq: sseq,
            deliveries,
        };
        self.events.push(ConsumerEvent::new(kind));
    }

    /// At an ack deadline: a message already delivered `max_deliver` times is given up on
    /// now (the reference's rule, so the advisory does not wait for the next pull).
    fn deliveries_exhausted(&mut self, sseq: u64) -> bool {
        let dc = self.deliveries(sseq);
        if self.config.max_deliver <= 0 || dc < self.config.max_deliver as u64 {
            return false;
        }
        self.on_max_deliveries(sseq, dc);
        self.apply(ConsumerOp::GiveUp { sseq });
        true
    }

    /// The `sample_freq` metric for an explicit ack of a pending delivery.
    fn sample_ack(&mut self, sseq: u64) {
        let (Some(&cseq), Some(&deadline)) =
            (self.rep.pending.get(&sseq), self.deadlines.get(&sseq))
        else {
            return;
        };
        if !super::advisory::should_sample(&self.config.sample_freq) {
            return;
        }
        let dc = self.deliveries(sseq);
        // The deadline is the delivery (or last progress) plus the ack wait.
        let since = deadline
            .checked_sub(self.ack_wait_for(dc))
            .map_or(0, |t| t.elapsed().as_nanos() as i64);
        let kind = ConsumerEventKind::Ack {
            stream_seq: sseq,
            consumer_seq: cseq,
            deliveries: dc,
            ack_time: since,
        };
        self.events.push(ConsumerEvent::new(kind));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Due times are saved as runs rounded up to 100 ms (a batch delivered together is one
    /// run, never due earlier than it was), and read back only when they cover every pending
    /// delivery.
    #[test]
    fn due_times_are_saved_as_runs_and_read_back_only_when_they_add_up() {
        let runs = due_runs_of([1_000_001, 1_000_050, 1_000_100, 1_000_101, 900, -150].into_iter());
        assert_eq!(runs, [(3, 1_000_100), (1, 1_000_200), (1, 900), (1, -100)]);
        assert_eq!(
            due_times(&runs, 6),
            Some(vec![1_000_100, 1_000_100, 1_000_100, 1_000_200, 900, -100])
        );
        assert_eq!(due_times(&runs, 5), None);
        assert_eq!(due_times(&[], 0), Some(vec![]));
        assert_eq!(due_times(&[], 2), None);
        assert_eq!(due_times(&[(u64::MAX, 1), (2, 1)], 1), None);
        // Saved beside the state and read back; absent from an older state.
        let mut saved = SavedState::of(&Replicated::default());
        saved.pending_due = runs.clone();
        let back: SavedState =
            serde_json::from_slice(&serde_json::to_vec(&saved).unwrap()).unwrap();
        assert_eq!(back.pending_due, runs);
        let old: SavedState = serde_json::from_slice(
            br#"{"delivered":{"consumer_seq":0,"stream_seq":0},"ack_floor":{"consumer_seq":0,"stream_seq":0},"redelivered":[]}"#,
        )
        .unwrap();
        assert!(old.pending_due.is_empty());
    }

    /// Pending messages are saved as runs: a window of in-order deliveries is one run, gaps
    /// (acked in the middle, redelivered out of order) start new ones, and the state reads
    /// back the same. The older one-pair-per-message form still reads; runs reaching past
    /// what was delivered make the state untrusted.
    #[test]
    fn pending_is_saved_as_runs_and_reads_back_the_same() {
        let pair = |s, c| SeqPair {
            stream_seq: s,
            consumer_seq: c,
        };
        let mut r = Replicated {
            delivered: pair(1_000_600, 900),
            ack_floor: pair(1_000_000, 300),
            ..Default::default()
        };
        // 500 in order, a gap (1_000_501 acked), then two whose consumer seqs jump
        // (redelivered), then one more.
        r.pending
            .extend((1_000_001..=1_000_500).map(|s| (s, s - 1_000_000 + 300)));
        r.pending
            .extend([(1_000_502, 802), (1_000_503, 850), (1_000_600, 900)]);
        r.redelivered.insert(1_000_503, 2);
        let saved = SavedState::of(&r);
        assert_eq!(
            saved.pending_runs,
            [
                (1_000_001, 301, 500),
                (1_000_502, 802, 1),
                (1_000_503, 850, 1),
                (1_000_600, 900, 1)
            ]
        );
        let bytes = serde_json::to_vec(&saved).unwrap();
        assert!(bytes.len() < 300, "{}", String::from_utf8_lossy(&bytes));
        let back: SavedState = serde_json::from_slice(&bytes).unwrap();
        assert!(back.consistent());
        assert_eq!(back.into_replicated(), r);

        let old = br#"{"delivered":{"consumer_seq":3,"stream_seq":3},"ack_floor":{"consumer_seq":1,"stream_seq":1},"pending":[[2,2],[3,3]],"redelivered":[]}"#;
        let old: SavedState = serde_json::from_slice(old).unwrap();
        assert!(old.consistent());
        assert_eq!(old.into_replicated().pending.len(), 2);

        for bad in [(1_000_590, 890, 20), (1_000_001, 1, 0), (1_000_000, 1, 1)] {
            let mut s: SavedState = serde_json::from_slice(&bytes).unwrap();
            s.pending_runs.push(bad);
            assert!(!s.consistent(), "{bad:?}");
        }
    }

    #[test]
    fn pull_bodies() {
        assert_eq!(parse_pull(b"").unwrap().batch, 1);
        assert_eq!(parse_pull(b"2").unwrap().batch, 2);
        let r = parse_pull(br#"{"batch":5,"no_wait":true,"expires":1000}"#).unwrap();
        assert_eq!((r.batch, r.expires, r.no_wait), (5, Some(1000), true));
        assert!(parse_pull(b"{bad").is_err());
        // Nulls are absent values; a heartbeat needs twice its length of expiry.
        let r = parse_pull(br#"{"batch":2,"group":null,"min_pending":null,"expires":null}"#);
        assert_eq!(r.unwrap().expires, None);
        assert_eq!(
            parse_pull(br#"{"expires":1000,"idle_heartbeat":501}"#).unwrap_err(),
            "heartbeat value too large"
        );
    }

    #[test]
    fn ack_subjects() {
        let a = parse_ack_subject(b"$JS.ACK.S.c.1.7.3.1795953538955218381.2").unwrap();
        assert_eq!(a.sseq, 7);
        assert!(parse_ack_subject(b"$JS.ACK.S.c.1").is_none());
    }

    #[test]
    fn ack_subjects_written_into_one_buffer() {
        let mut w = AckSubjects::new("ORDERS", "worker");
        let mut all = vec![];
        for i in 0..200u64 {
            all.push(w.next(&[1, 7 + i, 3], 1_795_953_538_955_218_381, 200 - i));
        }
        let neg = w.next(&[2, 1, 1], -5, 0);
        assert_eq!(
            &all[0][..],
            b"$JS.ACK.ORDERS.worker.1.7.3.1795953538955218381.200"
        );
        assert_eq!(
            &all[199][..],
            b"$JS.ACK.ORDERS.worker.1.206.3.1795953538955218381.1"
        );
        assert_eq!(&neg[..], b"$JS.ACK.ORDERS.worker.2.1.1.-5.0");
        for (i, s) in all.iter().enumerate() {
            assert_eq!(parse_ack_subject(s).unwrap().sseq, 7 + i as u64);
        }
    }
}
