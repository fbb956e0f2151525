//! The field names the reference's JetStream API knows, per request type, and what a JSON
//! `null` means for each. One table drives the shared request parsing
//! ([`super::api::parse_request`]):
//!
//! * strict mode (`jetstream { strict: true }`, the default) refuses a field no table lists,
//!   with Go's `json: unknown field "x"`, as the reference does;
//! * `null` is Go's "leave it at its zero value", i.e. absent, except for the enum-like fields
//!   whose decoders the reference runs on `null` and which then fail with their own text;
//! * keys match case-insensitively, as Go's decoder matches struct fields.
//!
//! The lists were checked field by field against nats-server 2.15.1.

/// What one field of a request holds.
pub enum Field {
    /// Any value; `null` is absent.
    Value,
    /// An enum the reference decodes itself: `null` fails with this text.
    Enum(&'static str),
    /// A `map[string]string`: free keys, a `null` value is the empty string.
    Map,
    /// A nested object (a pointer or struct in Go: `null` is absent).
    Obj(&'static Schema),
    /// An array of objects.
    List(&'static Schema),
}

/// The fields of one request object.
pub struct Schema(pub &'static [(&'static str, Field)]);

impl Schema {
    /// The field matching `key`: the exact name first, then case-insensitively (Go's rule).
    pub fn field(&self, key: &str) -> Option<&'static (&'static str, Field)> {
        self.0
            .iter()
            .find(|(k, _)| *k == key)
            .or_else(|| self.0.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)))
    }
}

const NULL_ENUM: &str = "can not unmarshal \"null\"";

static SUBJECT_TRANSFORM: Schema = Schema(&[("src", Field::Value), ("dest", Field::Value)]);
static EXTERNAL: Schema = Schema(&[("api", Field::Value), ("deliver", Field::Value)]);
static SOURCE_CONSUMER: Schema =
    Schema(&[("name", Field::Value), ("deliver_subject", Field::Value)]);
static STREAM_SOURCE: Schema = Schema(&[
    ("name", Field::Value),
    ("opt_start_seq", Field::Value),
    ("opt_start_time", Field::Value),
    ("filter_subject", Field::Value),
    ("subject_transforms", Field::List(&SUBJECT_TRANSFORM)),
    ("external", Field::Obj(&EXTERNAL)),
    ("consumer", Field::Obj(&SOURCE_CONSUMER)),
]);
static PLACEMENT: Schema = Schema(&[
    ("cluster", Field::Value),
    ("tags", Field::Value),
    ("preferred", Field::Value),
]);
static REPUBLISH: Schema = Schema(&[
    ("src", Field::Value),
    ("dest", Field::Value),
    ("headers_only", Field::Value),
]);
static CONSUMER_LIMITS: Schema = Schema(&[
    ("inactive_threshold", Field::Value),
    ("max_ack_pending", Field::Value),
]);

/// `STREAM.CREATE` / `STREAM.UPDATE`: the stream config plus `pedantic`.
pub static STREAM_CONFIG: Schema = Schema(&[
    ("name", Field::Value),
    ("description", Field::Value),
    ("subjects", Field::Value),
    ("retention", Field::Enum(NULL_ENUM)),
    ("max_consumers", Field::Value),
    ("max_msgs", Field::Value),
    ("max_bytes", Field::Value),
    ("max_age", Field::Value),
    ("max_msgs_per_subject", Field::Value),
    ("max_msg_size", Field::Value),
    ("discard", Field::Enum(NULL_ENUM)),
    ("storage", Field::Enum(NULL_ENUM)),
    ("num_replicas", Field::Value),
    ("no_ack", Field::Value),
    ("duplicate_window", Field::Value),
    ("placement", Field::Obj(&PLACEMENT)),
    ("mirror", Field::Obj(&STREAM_SOURCE)),
    ("sources", Field::List(&STREAM_SOURCE)),
    ("compression", Field::Enum("unknown compression algorithm")),
    ("first_seq", Field::Value),
    ("subject_transform", Field::Obj(&SUBJECT_TRANSFORM)),
    ("republish", Field::Obj(&REPUBLISH)),
    ("allow_direct", Field::Value),
    ("mirror_direct", Field::Value),
    ("discard_new_per_subject", Field::Value),
    ("sealed", Field::Value),
    ("deny_delete", Field::Value),
    ("deny_purge", Field::Value),
    ("allow_rollup_hdrs", Field::Value),
    ("consumer_limits", Field::Obj(&CONSUMER_LIMITS)),
    ("allow_msg_ttl", Field::Value),
    ("subject_delete_marker_ttl", Field::Value),
    ("allow_msg_counter", Field::Value),
    ("allow_atomic", Field::Value),
    ("allow_msg_schedules", Field::Value),
    ("persist_mode", Field::Enum(NULL_ENUM)),
    ("allow_batched", Field::Value),
    ("metadata", Field::Map),
    ("pedantic", Field::Value),
]);

static CONSUMER_CONFIG: Schema = Schema(&[
    ("durable_name", Field::Value),
    ("name", Field::Value),
    ("description", Field::Value),
    ("deliver_policy", Field::Enum(NULL_ENUM)),
    ("opt_start_seq", Field::Value),
    ("opt_start_time", Field::Value),
    ("ack_policy", Field::Enum(NULL_ENUM)),
    ("ack_wait", Field::Value),
    ("max_deliver", Field::Value),
    ("backoff", Field::Value),
    ("filter_subject", Field::Value),
    ("filter_subjects", Field::Value),
    ("replay_policy", Field::Enum(NULL_ENUM)),
    ("rate_limit_bps", Field::Value),
    ("sample_freq", Field::Value),
    ("max_waiting", Field::Value),
    ("max_ack_pending", Field::Value),
    ("flow_control", Field::Value),
    ("headers_only", Field::Value),
    ("max_batch", Field::Value),
    ("max_expires", Field::Value),
    ("max_bytes", Field::Value),
    ("deliver_subject", Field::Value),
    ("deliver_group", Field::Value),
    ("idle_heartbeat", Field::Value),
    ("inactive_threshold", Field::Value),
    ("num_replicas", Field::Value),
    ("mem_storage", Field::Value),
    ("direct", Field::Value),
    ("sourcing", Field::Value),
    ("metadata", Field::Map),
    ("pause_until", Field::Value),
    ("priority_groups", Field::Value),
    (
        "priority_policy",
        Field::Enum("unknown priority policy: null"),
    ),
    ("priority_timeout", Field::Value),
]);

/// `CONSUMER.CREATE` and `CONSUMER.DURABLE.CREATE`.
pub static CONSUMER_CREATE: Schema = Schema(&[
    ("stream_name", Field::Value),
    ("config", Field::Obj(&CONSUMER_CONFIG)),
    ("action", Field::Enum("unknown consumer action: null")),
    ("pedantic", Field::Value),
]);

pub static STREAM_INFO: Schema = Schema(&[
    ("deleted_details", Field::Value),
    ("subjects_filter", Field::Value),
    ("offset", Field::Value),
]);

/// `STREAM.NAMES` and `STREAM.LIST`.
pub static STREAM_NAMES: Schema = Schema(&[("offset", Field::Value), ("subject", Field::Value)]);

/// `CONSUMER.NAMES` and `CONSUMER.LIST`.
pub static CONSUMER_NAMES: Schema = Schema(&[("offset", Field::Value)]);

pub static STREAM_PURGE: Schema = Schema(&[
    ("filter", Field::Value),
    ("seq", Field::Value),
    ("keep", Field::Value),
]);

/// `STREAM.MSG.GET` (and the body of `DIRECT.GET`, which the reference parses leniently).
pub static MSG_GET: Schema = Schema(&[
    ("seq", Field::Value),
    ("last_by_subj", Field::Value),
    ("next_by_subj", Field::Value),
    ("batch", Field::Value),
    ("max_bytes", Field::Value),
    ("start_time", Field::Value),
    ("multi_last", Field::Value),
    ("up_to_seq", Field::Value),
    ("up_to_time", Field::Value),
    ("no_hdr", Field::Value),
]);

pub static MSG_DELETE: Schema = Schema(&[("seq", Field::Value), ("no_erase", Field::Value)]);

/// A pull request (`CONSUMER.MSG.NEXT`), which the reference parses leniently.
pub static PULL: Schema = Schema(&[
    ("expires", Field::Value),
    ("batch", Field::Value),
    ("max_bytes", Field::Value),
    ("no_wait", Field::Value),
    ("idle_heartbeat", Field::Value),
    ("group", Field::Value),
    ("min_pending", Field::Value),
    ("min_ack_pending", Field::Value),
    ("id", Field::Value),
    ("priority", Field::Value),
]);
