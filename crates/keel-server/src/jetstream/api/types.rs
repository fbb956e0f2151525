//! Typed requests and responses of the API (`$JS.API.INFO`, `STREAM.*`,
//! `STREAM.MSG.*`, consumer info, create, names and list). Field order is the reference's output order and optional fields are
//! left out as it leaves them out; responses get `type` first (see [`Response`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::errors::ApiError;
use crate::time::rfc3339;

/// A response: `type` first, then the body's fields.
#[derive(Serialize)]
pub struct Response<'a, T: Serialize> {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(flatten)]
    pub body: &'a T,
}

/// An error response: `type`, `error`, then the fields the reference writes even next to an
/// error.
#[derive(Serialize)]
pub struct ErrorResponse<'a, T: Serialize> {
    #[serde(rename = "type")]
    pub kind: String,
    pub error: &'a ApiError,
    #[serde(flatten)]
    pub extra: T,
}

/// The response type name of an API kind (`stream_info` ->
/// `io.nats.jetstream.api.v1.stream_info_response`).
pub fn type_name(kind: &str) -> String {
    format!("io.nats.jetstream.api.v1.{kind}_response")
}

/// Paging of NAMES and LIST responses.
#[derive(Serialize, Default, Clone, Copy)]
pub struct Paged {
    pub total: usize,
    pub offset: usize,
    pub limit: usize,
}

// ---- requests -------------------------------------------------------------------------

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct StreamInfoRequest {
    pub subjects_filter: Option<String>,
    pub deleted_details: bool,
    pub offset: usize,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct ListRequest {
    pub offset: usize,
    pub subject: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct PurgeRequest {
    pub filter: Option<String>,
    pub seq: Option<u64>,
    pub keep: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct MsgGetRequest {
    pub seq: Option<u64>,
    pub last_by_subj: Option<String>,
    pub next_by_subj: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct MsgDeleteRequest {
    pub seq: u64,
    pub no_erase: bool,
}

// ---- stream info ----------------------------------------------------------------------

#[derive(Serialize)]
pub struct Lost {
    pub msgs: Vec<u64>,
    pub bytes: u64,
}

/// A stream's `state`.
#[derive(Serialize)]
pub struct StreamState {
    pub messages: u64,
    pub bytes: u64,
    pub first_seq: u64,
    pub first_ts: String,
    pub last_seq: u64,
    pub last_ts: String,
    #[serde(skip_serializing_if = "is_zero")]
    pub num_subjects: u64,
    #[serde(skip_serializing_if = "empty_map")]
    pub subjects: Option<BTreeMap<String, u64>>,
    #[serde(skip_serializing_if = "is_zero")]
    pub num_deleted: u64,
    #[serde(skip_serializing_if = "empty_vec")]
    pub deleted: Option<Vec<u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost: Option<Lost>,
    pub consumer_count: usize,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
fn empty_map(m: &Option<BTreeMap<String, u64>>) -> bool {
    m.as_ref().is_none_or(|m| m.is_empty())
}
fn empty_vec(v: &Option<Vec<u64>>) -> bool {
    v.as_ref().is_none_or(|v| v.is_empty())
}

impl StreamState {
    pub fn new(
        state: keel_store::State,
        consumers: usize,
        subjects: Option<BTreeMap<String, u64>>,
        deleted: Option<Vec<u64>>,
    ) -> StreamState {
        StreamState {
            messages: state.msgs,
            bytes: state.bytes,
            first_seq: state.first_seq,
            first_ts: rfc3339(state.first_ts),
            last_seq: state.last_seq,
            last_ts: rfc3339(state.last_ts),
            num_subjects: state.num_subjects,
            subjects,
            num_deleted: state.num_deleted,
            deleted,
            lost: state.lost.map(|l| Lost {
                msgs: l.msgs,
                bytes: l.bytes,
            }),
            consumer_count: consumers,
        }
    }
}

#[derive(Serialize, Clone)]
pub struct ClusterInfo {
    /// The cluster's name (clustered JetStream only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A replicated stream's Raft group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raft_group: Option<String>,
    /// Left out while the group has no leader, as the reference does.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub leader: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leader_since: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_account: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic_account: Option<String>,
    /// The other peers, by name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<PeerInfo>>,
}

impl ClusterInfo {
    /// The object of something on one server: the cluster and that server only, as the
    /// reference shows what it runs without a Raft group.
    pub fn one_server(self) -> ClusterInfo {
        ClusterInfo {
            name: self.name,
            raft_group: None,
            leader: self.leader,
            leader_since: None,
            system_account: None,
            traffic_account: None,
            replicas: None,
        }
    }
}

/// One peer of a replicated stream as its leader sees it.
#[derive(Serialize, Clone)]
pub struct PeerInfo {
    pub name: String,
    pub current: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub offline: bool,
    /// Nanoseconds since it was last heard from.
    pub active: u64,
    #[serde(skip_serializing_if = "crate::jetstream::api::types::is_zero_u64")]
    pub lag: u64,
    pub peer: String,
}

pub fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

/// Stream info: `config, created, state, [domain, cluster], [mirror, sources], ts`.
#[derive(Serialize)]
pub struct StreamInfo {
    pub config: Value,
    pub created: String,
    pub state: StreamState,
    /// Stream info names the domain before the cluster, as the reference.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mirror: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sources: Option<Value>,
    pub ts: String,
}

#[derive(Serialize)]
pub struct StreamCreateResponse {
    #[serde(flatten)]
    pub info: StreamInfo,
    pub did_create: bool,
}

#[derive(Serialize)]
pub struct StreamInfoResponse {
    #[serde(flatten)]
    pub paged: Paged,
    #[serde(flatten)]
    pub info: StreamInfo,
}

#[derive(Serialize)]
pub struct StreamNamesResponse {
    #[serde(flatten)]
    pub paged: Paged,
    /// `null`, not `[]`, when no stream matches (the reference).
    pub streams: Option<Vec<String>>,
}

#[derive(Serialize)]
pub struct StreamListResponse {
    #[serde(flatten)]
    pub paged: Paged,
    pub streams: Vec<StreamInfo>,
}

#[derive(Serialize)]
pub struct SuccessResponse {
    pub success: bool,
}

#[derive(Serialize)]
pub struct PurgeResponse {
    pub success: bool,
    pub purged: u64,
}

// ---- messages -------------------------------------------------------------------------

/// A message as STREAM.MSG.GET returns it (headers and payload base64, left out when
/// empty).
#[derive(Serialize)]
pub struct StoredMessage {
    pub subject: String,
    pub seq: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hdrs: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    pub time: String,
}

#[derive(Serialize)]
pub struct MsgGetResponse {
    pub message: StoredMessage,
}

// ---- account --------------------------------------------------------------------------

#[derive(Serialize)]
pub struct AccountLimits {
    pub max_memory: i64,
    pub max_storage: i64,
    pub max_streams: i64,
    pub max_consumers: i64,
    pub max_ack_pending: i64,
    pub memory_max_stream_bytes: i64,
    pub storage_max_stream_bytes: i64,
    pub max_bytes_required: bool,
}

impl AccountLimits {
    /// The account's own limits (-1: none).
    pub fn of(l: &crate::auth::conf::JsAccountOpts) -> AccountLimits {
        AccountLimits {
            max_memory: l.max_mem,
            max_storage: l.max_file,
            max_streams: l.max_streams,
            max_consumers: l.max_consumers,
            max_ack_pending: l.max_ack_pending,
            memory_max_stream_bytes: l.mem_max_stream_bytes,
            storage_max_stream_bytes: l.disk_max_stream_bytes,
            max_bytes_required: l.max_bytes_required,
        }
    }
}

#[derive(Serialize)]
pub struct ApiStats {
    pub level: u32,
    pub total: u64,
    pub errors: u64,
}

/// `$JS.API.INFO`.
#[derive(Serialize)]
pub struct AccountInfo {
    pub memory: u64,
    pub storage: u64,
    pub reserved_memory: i64,
    pub reserved_storage: i64,
    pub streams: usize,
    pub consumers: usize,
    pub limits: AccountLimits,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    pub api: ApiStats,
}

// ---- consumer responses ---------------------------------------------------------------

fn is_false(b: &bool) -> bool {
    !*b
}

/// `delivered` / `ack_floor` of consumer info: the pair, then when it last moved.
#[derive(Serialize)]
pub struct SequenceInfo {
    pub consumer_seq: u64,
    pub stream_seq: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_active: Option<String>,
}

/// A priority group's state in consumer info.
#[derive(Serialize)]
pub struct PriorityGroupState {
    pub group: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_client_id: Option<String>,
    pub pinned_ts: String,
}

/// Consumer info (create, info, list, `/jsz`), in the reference's field order; the optional
/// fields are left out as it leaves them out.
#[derive(Serialize)]
pub struct ConsumerInfo {
    pub stream_name: String,
    pub name: String,
    pub created: String,
    pub config: Value,
    pub delivered: SequenceInfo,
    pub ack_floor: SequenceInfo,
    pub num_ack_pending: usize,
    pub num_redelivered: usize,
    pub num_waiting: usize,
    pub num_pending: u64,
    /// Clustered JetStream: where it runs (a consumer runs where its stream leads, so the
    /// stream's group and replicas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterInfo>,
    #[serde(skip_serializing_if = "is_false")]
    pub push_bound: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub paused: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_remaining: Option<i64>,
    pub ts: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub priority_groups: Vec<PriorityGroupState>,
}

#[derive(Serialize)]
pub struct ConsumerNamesResponse {
    #[serde(flatten)]
    pub paged: Paged,
    pub consumers: Vec<String>,
}

#[derive(Serialize)]
pub struct ConsumerListResponse {
    #[serde(flatten)]
    pub paged: Paged,
    pub consumers: Vec<ConsumerInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_without_a_leader_names_none() {
        let mut ci = ClusterInfo {
            name: Some("c1".into()),
            raft_group: None,
            leader: String::new(),
            leader_since: None,
            system_account: None,
            traffic_account: None,
            replicas: None,
        };
        assert_eq!(serde_json::to_string(&ci).unwrap(), r#"{"name":"c1"}"#);
        ci.leader = "n1".into();
        assert_eq!(
            serde_json::to_string(&ci).unwrap(),
            r#"{"name":"c1","leader":"n1"}"#
        );
    }
}
