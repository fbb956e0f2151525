//! `STREAM.CREATE`, `UPDATE`, `INFO`, `NAMES`, `LIST`, `DELETE`, `PURGE`: checks and
//! typed responses. The lifecycle itself (creating, updating, deleting) is the registry's;
//! changes to a stream are its actor's, answered once they are committed.

use std::sync::Arc;

use keel_store::Purge;
use serde::Deserialize;

use super::types::{
    ClusterInfo, ListRequest, Paged, PeerInfo, PurgeRequest, PurgeResponse, StreamCreateResponse,
    StreamInfo, StreamInfoRequest, StreamInfoResponse, StreamListResponse, StreamNamesResponse,
    StreamState, SuccessResponse,
};
use super::{parse_request, ApiError, ErrorKind};
use crate::jetstream::stream::{self, StorageType, Stream, StreamConfig};
use crate::jetstream::{advisory, registry, schema, sourcing, JetStream};
use crate::router::Router;
use crate::server::Server;
use crate::time::{now_nanos, rfc3339};

const NAMES_LIMIT: usize = 1024;
const LIST_LIMIT: usize = 256;
/// Most subjects a stream info with `subjects_filter` lists.
const SUBJECTS_LIMIT: usize = 100_000;

/// One stream's info. `cluster`: the JetStream whose server leads it (a single server:
/// always this one), for stream info; create, update and list leave it out.
pub fn info(
    s: &Stream,
    dynamic_meta: bool,
    cluster: Option<&JetStream>,
    subjects_filter: Option<&str>,
    deleted_details: bool,
) -> StreamInfo {
    let (state, subjects, deleted) = {
        let store = s.read();
        (
            store.state(),
            subjects_filter.map(|f| store.subjects(f)),
            deleted_details.then(|| store.deleted()),
        )
    };
    let mut mirror = None;
    let mut sources = None;
    for (k, v) in s.sourcing_info() {
        match k {
            "mirror" => mirror = Some(v),
            _ => sources = Some(v),
        }
    }
    StreamInfo {
        config: s.config().to_json(dynamic_meta),
        created: rfc3339(s.created),
        state: StreamState::new(state, s.consumers.len(), subjects, deleted),
        domain: cluster.and_then(|js| js.domain.clone()),
        cluster: cluster.map(|js| cluster_info(js, s)),
        mirror,
        sources,
        ts: rfc3339(now_nanos()),
    }
}

/// The `cluster` object: the server that leads it; for a replicated stream its group,
/// since when, and the other peers with how far behind each is.
pub fn cluster_info(js: &JetStream, s: &Stream) -> ClusterInfo {
    let mut ci = ClusterInfo {
        name: js.cluster_name(),
        raft_group: None,
        leader: js.server_name.clone(),
        leader_since: None,
        system_account: None,
        traffic_account: None,
        replicas: None,
    };
    let (Some(spec), Some(r)) = (s.group.as_ref(), s.replica.get()) else {
        return ci;
    };
    if s.config().num_replicas <= 1 {
        // One server: the reference runs no Raft group for it and names only the cluster
        // and that server (Keel's group of one is its own business).
        ci.leader = s.leader_name().unwrap_or_default();
        return ci;
    }
    ci.raft_group = Some(spec.group.clone());
    ci.system_account = Some(true);
    ci.traffic_account = js.system_account_name();
    ci.leader = s.leader_name().unwrap_or_default();
    let since = r.leader_since.load(std::sync::atomic::Ordering::Relaxed);
    if since > 0 && ci.leader == js.server_name {
        ci.leader_since = Some(rfc3339(since));
    }
    let host = r.host();
    let m = r.raft.get().map(|raft| raft.metrics().borrow().clone());
    // The group's voters as this server knows them (they follow the assignment).
    let members: Vec<String> = match m.as_ref() {
        Some(m) if m.membership_config.log_id().is_some() => m
            .membership_config
            .membership()
            .voter_ids()
            .filter_map(|id| crate::jetstream::raft::member_name(m, id))
            .collect(),
        _ => spec.peers.clone(),
    };
    let mut peers: Vec<PeerInfo> = members
        .iter()
        .filter(|p| **p != ci.leader)
        .map(|p| {
            let heard = host.as_ref().and_then(|h| h.since_heard(p));
            let matched = m
                .as_ref()
                .and_then(|m| m.replication.as_ref())
                .and_then(|rep| rep.get(&crate::jetstream::raft::node_id(p)).cloned())
                .flatten()
                .map(|l| l.index);
            // As the reference counts them: against what the leader has applied (not its
            // last entry, which under load is nearly always one in flight), so a replica
            // that has every committed batch is current while publishes go on.
            let applied = m
                .as_ref()
                .and_then(|m| m.last_applied)
                .map_or(0, |l| l.index);
            let lag = match matched {
                Some(i) => applied.saturating_sub(i),
                None if *p == js.server_name => 0,
                None => applied,
            };
            let recent = *p == js.server_name
                || heard.is_some_and(|d| d < std::time::Duration::from_secs(10));
            // (A server in lame-duck mode still replicates, as the reference's, and is
            // offline to placement and here all the same.)
            let up = host.as_ref().map_or(recent, |h| h.is_up(p));
            PeerInfo {
                name: p.clone(),
                current: recent && lag == 0,
                offline: !up,
                active: heard.map(|d| d.as_nanos() as u64).unwrap_or(0),
                lag,
                peer: crate::jetstream::raft::peer_hash(p),
            }
        })
        .collect();
    peers.sort_by(|a, b| a.name.cmp(&b.name));
    ci.replicas = (!peers.is_empty()).then_some(peers);
    ci
}

pub(crate) fn parse_config(
    js: &JetStream,
    name: &str,
    body: &[u8],
) -> Result<StreamConfig, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ErrorKind::StreamMismatch.err());
    }
    let cfg: StreamConfig = parse_request(body, &schema::STREAM_CONFIG, js.strict)?;
    refuse_pedantic(body)?;
    if cfg.name != name {
        return Err(ErrorKind::StreamMismatch.err());
    }
    // `jetstream { limits { duplicate_window } }` lowers the default window (2 minutes, or
    // max_age if shorter) and caps a given one, as the reference's.
    let dup_limit = js.limits.duplicate_window;
    let mut cfg = cfg;
    let sourcing = cfg.mirror.is_some() || !cfg.sources.is_empty();
    if dup_limit > 0 && cfg.duplicate_window == 0 && !sourcing {
        cfg.duplicate_window = if cfg.max_age > 0 {
            dup_limit.min(cfg.max_age)
        } else {
            dup_limit
        }
        .min(crate::jetstream::stream::config::DEFAULT_DUPLICATE_WINDOW);
    }
    let cfg = cfg.normalize()?;
    if dup_limit > 0 && cfg.duplicate_window > dup_limit {
        return Err(ErrorKind::InvalidConfig.with(format!(
            "duplicates window can not be larger then server limit of {}",
            crate::time::go_duration(dup_limit)
        )));
    }
    if cfg.num_replicas > 1 && !js.clustered() {
        return Err(ErrorKind::ReplicasNotSupported.err());
    }
    if cfg.num_replicas > 5 {
        return Err(ErrorKind::InvalidConfig.with("maximum replicas is 5"));
    }
    refuse_preferred(body)?;
    Ok(cfg)
}

/// A stream config naming a preferred server in its `placement`: refused, as the
/// reference does (a preferred server is for a leader stepdown only).
fn refuse_preferred(body: &[u8]) -> Result<(), ApiError> {
    let Ok(cfg) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Ok(());
    };
    if cfg["placement"]["preferred"]
        .as_str()
        .is_some_and(|p| !p.is_empty())
    {
        return Err(ErrorKind::InvalidConfig.with("preferred server not permitted in placement"));
    }
    Ok(())
}

/// `pedantic: true` asks the server to refuse rather than adjust a config; Keel adjusts, so
/// the request is refused as unsupported instead of being silently treated as non-pedantic.
pub fn refuse_pedantic(body: &[u8]) -> Result<(), ApiError> {
    #[derive(Deserialize)]
    struct Pedantic {
        #[serde(default)]
        pedantic: Option<bool>,
    }
    match serde_json::from_slice::<Pedantic>(body) {
        Ok(Pedantic {
            pedantic: Some(true),
        }) => Err(ApiError::not_supported("pedantic mode")),
        _ => Ok(()),
    }
}

fn check_overlap(js: &JetStream, cfg: &StreamConfig) -> Result<(), ApiError> {
    for other in js.streams() {
        if other.name == cfg.name {
            continue;
        }
        let oc = other.config();
        for a in &cfg.subjects {
            if oc.subjects.iter().any(|b| stream::subjects_overlap(a, b)) {
                return Err(ErrorKind::SubjectsOverlap.err());
            }
        }
    }
    Ok(())
}

/// Server-wide storage limits: a stream's max_bytes is a reservation against them.
fn check_resources(
    js: &JetStream,
    cfg: &StreamConfig,
    except: Option<&str>,
) -> Result<(), ApiError> {
    check_account_alone(js, cfg)?;
    // The server's limit holds every account's reservations, the account's its own.
    room(js.server_limit(cfg.storage), cfg, cfg.max_bytes, || {
        js.reserved_by_all(cfg.storage, except)
    })?;
    room(js.account_limit(cfg.storage), cfg, cfg.max_bytes, || {
        js.reserved(cfg.storage, except)
    })
}

/// The account's limits that a stream's config meets or not alone: the meta leader makes
/// these checks too.
pub(crate) fn check_account_alone(js: &JetStream, cfg: &StreamConfig) -> Result<(), ApiError> {
    let acc = js.account.jetstream_limits();
    if acc.max_bytes_required && cfg.max_bytes <= 0 {
        return Err(ErrorKind::MaxBytesRequired.err());
    }
    let per_stream = match cfg.storage {
        StorageType::Memory => acc.mem_max_stream_bytes,
        StorageType::File => acc.disk_max_stream_bytes,
    };
    if per_stream > 0 && cfg.max_bytes > per_stream {
        return Err(ErrorKind::StreamMaxBytesExceedsAccount.err());
    }
    Ok(())
}

/// Whether `need` bytes (a stream's max_bytes; on the meta leader, times its replicas) fit
/// under `limit` (-1: none) beside what is `reserved` already.
pub(crate) fn room(
    limit: i64,
    cfg: &StreamConfig,
    need: i64,
    reserved: impl FnOnce() -> i64,
) -> Result<(), ApiError> {
    if limit < 0 {
        return Ok(());
    }
    if need > limit || (need > 0 && reserved().saturating_add(need) > limit) {
        return Err(match cfg.storage {
            StorageType::Memory => ErrorKind::InsufficientMemory.err(),
            StorageType::File => ErrorKind::InsufficientStorage.err(),
        });
    }
    Ok(())
}

/// The checks of a create that look at the config alone (no other stream): the meta
/// leader makes them too, so that it never assigns a stream its servers then refuse.
pub(crate) fn check_alone(cfg: &StreamConfig) -> Result<(), ApiError> {
    if cfg.mirror_direct && cfg.mirror.is_none() {
        return Err(
            ErrorKind::InvalidConfig.with("stream has no mirror but does have mirror direct")
        );
    }
    sourcing::check_filters(cfg)
}

pub async fn create(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    name: &str,
    body: &[u8],
) -> Result<StreamCreateResponse, ApiError> {
    let mut cfg = parse_config(js, name, body)?;
    if cfg.mirror_direct && cfg.mirror.is_none() {
        return Err(
            ErrorKind::InvalidConfig.with("stream has no mirror but does have mirror direct")
        );
    }
    sourcing::check_with_streams(js, server, &mut cfg)?;
    if let Some(existing) = js.stream(name) {
        return created_already(js, &existing, &cfg);
    }
    sourcing::check_filters(&cfg)?;
    check_overlap(js, &cfg)?;
    check_resources(js, &cfg, None)?;
    let max_streams = js.account.jetstream_limits().max_streams;
    if max_streams >= 0 && js.streams().len() as i64 >= max_streams {
        return Err(ErrorKind::MaxStreams.err());
    }
    let s = registry::create_stream(js, server, cfg).await?;
    advisory::stream_action(server, router, name, advisory::Action::Create);
    let created = StreamCreateResponse {
        info: info(&s, true, js.clustered().then_some(&**js), None, false),
        did_create: true,
    };
    s.start_sources();
    Ok(created)
}

/// A create asking for `cfg` of a stream that exists: answered with the stream as it is,
/// or 10058 if its config differs.
pub fn created_already(
    js: &JetStream,
    existing: &Stream,
    cfg: &StreamConfig,
) -> Result<StreamCreateResponse, ApiError> {
    if !existing.config().same_as(cfg) {
        return Err(ErrorKind::StreamNameInUse.err());
    }
    Ok(StreamCreateResponse {
        info: info(existing, true, js.clustered().then_some(js), None, false),
        did_create: true,
    })
}

pub async fn update(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    name: &str,
    body: &[u8],
) -> Result<StreamInfo, ApiError> {
    let mut cfg = parse_config(js, name, body)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let old = s.config();
    old.check_update(&cfg)?;
    if cfg.num_replicas != old.num_replicas && s.group.is_none() {
        // In a cluster the meta leader has placed the new count already (`cluster::api`);
        // a stream with no group of its own has no peers to change.
        return Err(ErrorKind::InvalidConfig
            .with("this stream's replicas cannot change: it has no Raft group"));
    }
    if cfg.mirror_direct && cfg.mirror.is_none() {
        return Err(
            ErrorKind::InvalidConfig.with("stream has no mirror but does have mirror direct")
        );
    }
    sourcing::check_with_streams(js, server, &mut cfg)?;
    check_consumer_limits(js, &s, &old, &cfg)?;
    check_overlap(js, &cfg)?;
    check_resources(js, &cfg, Some(name))?;
    registry::update_stream(&s, cfg).await?;
    advisory::stream_action(server, router, name, advisory::Action::Update);
    Ok(info(&s, true, js.clustered().then_some(&**js), None, false))
}

/// Lowering a stream's `consumer_limits` below what an existing consumer uses is refused,
/// naming the consumers (the reference's check and text).
fn check_consumer_limits(
    js: &JetStream,
    s: &Stream,
    old: &StreamConfig,
    new: &StreamConfig,
) -> Result<(), ApiError> {
    let (oi, ni) = (
        old.consumer_limits.inactive_threshold,
        new.consumer_limits.inactive_threshold,
    );
    let (om, nm) = (
        old.consumer_limits.max_ack_pending,
        new.consumer_limits.max_ack_pending,
    );
    if !((ni > 0 && ni != oi) || (nm > 0 && nm != om)) {
        return Ok(());
    }
    let violating: Vec<String> = js
        .consumers_of(&s.name)
        .iter()
        .filter(|c| {
            let cfg = c.config();
            (ni > 0 && cfg.inactive_threshold > ni) || (nm > 0 && cfg.max_ack_pending > nm)
        })
        .map(|c| c.name.clone())
        .collect();
    if violating.is_empty() {
        return Ok(());
    }
    Err(ErrorKind::UpdateFailed.with(format!(
        "change to limits violates consumers: {}",
        violating.join(", ")
    )))
}

pub fn stream_info(
    js: &JetStream,
    name: &str,
    body: &[u8],
) -> Result<StreamInfoResponse, ApiError> {
    let req: StreamInfoRequest = parse_request(body, &schema::STREAM_INFO, js.strict)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let mut info = info(
        &s,
        true,
        Some(js),
        req.subjects_filter.as_deref(),
        req.deleted_details,
    );
    // Paging applies to the subjects map when one was asked for.
    let paged = match &req.subjects_filter {
        Some(_) => {
            let subjects = info.state.subjects.take().unwrap_or_default();
            let total = subjects.len();
            info.state.subjects = Some(if req.offset > 0 || total > SUBJECTS_LIMIT {
                subjects
                    .into_iter()
                    .skip(req.offset)
                    .take(SUBJECTS_LIMIT)
                    .collect()
            } else {
                subjects
            });
            Paged {
                total,
                offset: req.offset,
                limit: SUBJECTS_LIMIT,
            }
        }
        None => Paged::default(),
    };
    Ok(StreamInfoResponse { paged, info })
}

fn filtered_streams(js: &JetStream, subject: Option<&str>) -> Vec<Arc<Stream>> {
    js.streams()
        .into_iter()
        .filter(|s| match subject {
            None | Some("") => true,
            Some(f) => s
                .config()
                .subjects
                .iter()
                .any(|x| stream::subjects_overlap(x, f)),
        })
        .collect()
}

pub fn names(js: &JetStream, body: &[u8]) -> Result<StreamNamesResponse, ApiError> {
    let req: ListRequest = parse_request(body, &schema::STREAM_NAMES, js.strict)?;
    let all = filtered_streams(js, req.subject.as_deref());
    let names: Vec<String> = all
        .iter()
        .skip(req.offset)
        .take(NAMES_LIMIT)
        .map(|s| s.name.clone())
        .collect();
    Ok(StreamNamesResponse {
        paged: Paged {
            total: all.len(),
            offset: req.offset,
            limit: NAMES_LIMIT,
        },
        streams: (!names.is_empty()).then_some(names),
    })
}

pub fn list(js: &JetStream, body: &[u8]) -> Result<StreamListResponse, ApiError> {
    let req: ListRequest = parse_request(body, &schema::STREAM_NAMES, js.strict)?;
    let all = filtered_streams(js, req.subject.as_deref());
    Ok(StreamListResponse {
        paged: Paged {
            total: all.len(),
            offset: req.offset,
            limit: LIST_LIMIT,
        },
        streams: all
            .iter()
            .skip(req.offset)
            .take(LIST_LIMIT)
            .map(|s| info(s, false, None, None, false))
            .collect(),
    })
}

pub async fn delete(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    name: &str,
) -> Result<SuccessResponse, ApiError> {
    registry::delete_stream(js, server, router, name).await?;
    advisory::stream_action(server, router, name, advisory::Action::Delete);
    Ok(SuccessResponse { success: true })
}

pub async fn purge(js: &JetStream, name: &str, body: &[u8]) -> Result<PurgeResponse, ApiError> {
    let req: PurgeRequest = parse_request(body, &schema::STREAM_PURGE, js.strict)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let req = Purge {
        filter: req.filter,
        seq: req.seq,
        keep: req.keep,
    };
    // The actor decides (sealed, deny_purge, the options) and answers once committed.
    let purged = s
        .ask(|reply| stream::Command::Purge { req, reply })
        .await
        .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()))?;
    for c in js.consumers_of(name) {
        c.on_purge();
    }
    Ok(PurgeResponse {
        success: true,
        purged,
    })
}
