//! A stream's configuration: the reference's fields, defaults and output order, the checks
//! a create makes (`normalize`) and what an update may change (`check_update`).

use std::collections::BTreeMap;
use std::time::Duration;

use keel_protocol::subject;
use keel_store::{Discard, Limits};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::jetstream::api::{ApiError, ErrorKind};
use crate::jetstream::republish::{self, RePublish};
use crate::jetstream::sourcing::{self, StreamSource, SubjectTransformConfig};
use crate::jetstream::transform::validate_mapping;

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
    /// Where a cluster keeps the stream (`cluster::place`); kept and shown as given.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "placement_or_none"
    )]
    pub placement: Option<Placement>,
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
/// A stream's `placement`: the cluster and the server tags its servers must have.
/// (`preferred` is refused before a config is parsed.)
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Placement {
    #[serde(
        default,
        skip_serializing_if = "String::is_empty",
        deserialize_with = "null_default"
    )]
    pub cluster: String,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_default"
    )]
    pub tags: Vec<String>,
}

/// An empty `placement` (`{}`) is none, as the reference keeps it.
fn placement_or_none<'de, D>(d: D) -> Result<Option<Placement>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let p = Option::<Placement>::deserialize(d)?;
    Ok(p.filter(|p| !p.cluster.is_empty() || !p.tags.is_empty()))
}

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
pub const DEFAULT_DUPLICATE_WINDOW: i64 = 120_000_000_000;

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

    /// Whether a create asking for `other` gets this stream as it is (else 10058): the
    /// same config, but for the API level the server notes in its metadata.
    pub fn same_as(&self, other: &StreamConfig) -> bool {
        let mut a = self.clone();
        a.metadata.remove(REQ_LEVEL_KEY);
        let mut b = other.clone();
        b.metadata.remove(REQ_LEVEL_KEY);
        a == b
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
