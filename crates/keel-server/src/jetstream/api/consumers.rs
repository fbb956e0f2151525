//! The consumer-side API (`CONSUMER.*`): request checks and the consumer's info. Consumers
//! are created and deleted through the registry. Info, create, names and list answer typed
//! responses (`types.rs`); pause, unpin and delete still build their few fields.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};

use super::types::{ConsumerInfo, ConsumerListResponse, ConsumerNamesResponse, ListRequest, Paged};
use super::{parse_request, to_bytes, ApiError, ErrorKind};
use crate::jetstream::api::streams::refuse_pedantic;
use crate::jetstream::stream::{self, StorageType};
use crate::jetstream::{advisory, consumer, registry, schema, JetStream};
use crate::router::Router;
use crate::server::Server;
use crate::time::{now_nanos, rfc3339};

pub type Fields = Map<String, Value>;

const NAMES_LIMIT: usize = 1024;
const LIST_LIMIT: usize = 256;

/// Go reports a string where a duration (nanoseconds) belongs by its field path; clients
/// show that text, so name the field the same way.
fn check_duration_fields(body: &[u8]) -> Result<(), ApiError> {
    let Ok(Value::Object(req)) = serde_json::from_slice::<Value>(body) else {
        return Ok(());
    };
    let Some(Value::Object(cfg)) = req.get("config") else {
        return Ok(());
    };
    for field in [
        "ack_wait",
        "idle_heartbeat",
        "inactive_threshold",
        "max_expires",
    ] {
        if cfg.get(field).is_some_and(Value::is_string) {
            return Err(ErrorKind::InvalidJson.with(format!("json: cannot unmarshal string into Go struct field CreateConsumerRequest.config.{field} of type time.Duration"
                )));
        }
    }
    Ok(())
}

fn consumer_not_found() -> ApiError {
    ErrorKind::ConsumerNotFound.err()
}

/// An ephemeral consumer's generated name (the reference uses 8 random characters).
fn random_name() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    (0..8)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

pub(super) fn consumer_create_durable(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    stream: &str,
    durable: &str,
    body: &[u8],
) -> Result<ConsumerInfo, ApiError> {
    check_duration_fields(body)?;
    let mut req: consumer::CreateRequest =
        parse_request(body, &schema::CONSUMER_CREATE, js.strict)?;
    refuse_pedantic(body)?;
    if req.stream_name != stream {
        return Err(ErrorKind::StreamMismatch.err());
    }
    let cfg = req.config.get_or_insert_with(Default::default);
    match cfg.durable_name.as_deref() {
        None | Some("") => return Err(ErrorKind::ConsumerDurableNotSet.err()),
        Some(d) if d != durable => return Err(ErrorKind::ConsumerDurableMismatch.err()),
        _ => {}
    }
    create_consumer(js, server, router, stream, Some(durable), req)
}

pub(super) fn consumer_create(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    stream: &str,
    name: Option<&str>,
    filter: Option<&str>,
    body: &[u8],
) -> Result<ConsumerInfo, ApiError> {
    check_duration_fields(body)?;
    let mut req: consumer::CreateRequest =
        parse_request(body, &schema::CONSUMER_CREATE, js.strict)?;
    refuse_pedantic(body)?;
    if req.stream_name != stream {
        return Err(ErrorKind::StreamMismatch.err());
    }
    // A request without a config gets Go's zero config (ack none), as with the reference.
    let cfg = req.config.get_or_insert_with(Default::default);
    match name {
        None => {
            if cfg.durable_name.as_deref().is_some_and(|d| !d.is_empty()) {
                return Err(ErrorKind::ConsumerEphemeralWithDurable.err());
            }
        }
        Some(n) => {
            // A durable name must match the subject; a plain name is overridden by it.
            if cfg
                .durable_name
                .as_deref()
                .is_some_and(|d| !d.is_empty() && d != n)
            {
                return Err(ErrorKind::ConsumerDurableMismatch.err());
            }
            cfg.name = Some(n.to_string());
        }
    }
    if let Some(f) = filter {
        if !cfg.filter_subjects.is_empty() {
            return Err(ErrorKind::ConsumerMultipleFilters.err());
        }
        let cf = cfg.filters();
        let matches = (cf.len() == 1 && cf[0] == f) || (cf.is_empty() && f == ">");
        if !matches {
            return Err(ErrorKind::ConsumerFilterMismatch.err());
        }
    }
    create_consumer(js, server, router, stream, name, req)
}

fn create_consumer(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    stream_name: &str,
    name: Option<&str>,
    req: consumer::CreateRequest,
) -> Result<ConsumerInfo, ApiError> {
    if !matches!(req.action.as_str(), "" | "create" | "update") {
        return Err(
            ErrorKind::InvalidJson.with(format!("unknown consumer action: {:?}", req.action))
        );
    }
    let s = js
        .stream(stream_name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let scfg = s.config();
    let mut cfg = req.config.expect("checked by callers");
    if let Some(n) = name {
        if cfg.name.as_deref().unwrap_or("").is_empty() {
            cfg.name = Some(n.to_string());
        }
    }
    if let Some(d) = cfg.durable_name.clone().filter(|d| !d.is_empty()) {
        cfg.name = Some(d);
    }
    // The server's (`jetstream { limits }`) and then the account's max_ack_pending are
    // ceilings, and the default when lower than the usual one; the server's
    // max_request_batch too, for pull consumers (the reference's order).
    let srv = server.opts.js_limits;
    let ack_limit = js.account.jetstream_limits().max_ack_pending;
    if cfg.ack_policy != consumer::AckPolicy::None && cfg.max_ack_pending == 0 {
        let lower = [srv.max_ack_pending, ack_limit]
            .into_iter()
            .filter(|l| *l > 0)
            .min();
        if let Some(l) = lower {
            cfg.max_ack_pending = l.min(consumer::DEFAULT_MAX_ACK_PENDING);
        }
    }
    let pull = cfg.deliver_subject.as_deref().unwrap_or("").is_empty();
    if pull && srv.max_request_batch > 0 {
        if cfg.max_batch == 0 {
            cfg.max_batch = srv.max_request_batch;
        } else if cfg.max_batch > srv.max_request_batch {
            return Err(ErrorKind::ConsumerMaxRequestBatchExceeds.with(srv.max_request_batch));
        }
    }
    if cfg.ack_policy != consumer::AckPolicy::None {
        if srv.max_ack_pending > 0 && cfg.max_ack_pending > srv.max_ack_pending {
            return Err(ErrorKind::ConsumerMaxAckPendingExceeds.with(srv.max_ack_pending));
        }
        if ack_limit > 0 && (cfg.max_ack_pending > ack_limit || cfg.max_ack_pending < 0) {
            return Err(ErrorKind::ConsumerMaxAckPendingExceeds.with(ack_limit));
        }
    }
    let cfg = cfg.normalize(scfg.retention)?;
    if cfg.num_replicas > 1 {
        if !js.clustered() {
            return Err(ErrorKind::ReplicasNotSupported.err());
        }
        // A consumer replicates with its stream (in the stream's group).
        if cfg.num_replicas > scfg.num_replicas {
            return Err(ErrorKind::ConsumerReplicasExceedStream.err());
        }
    }
    if let Some(ds) = &cfg.deliver_subject {
        // Delivering into the stream's own subjects would store every delivery again.
        if scfg
            .subjects
            .iter()
            .any(|s| stream::subjects_overlap(s, ds))
        {
            return Err(ErrorKind::ConsumerDeliverCycle.err());
        }
    }
    let name = cfg.name.clone().unwrap_or_else(random_name);
    let durable = cfg.durable_name.is_some();
    let mut stored_cfg = cfg.clone();
    if !durable && name.len() == 8 && cfg.name.is_none() {
        stored_cfg.name = None;
    }
    let existing = js.consumer(stream_name, &name);
    if let Some(c) = existing {
        let mut current = c.config();
        // An update never changes the pause (that is what CONSUMER.PAUSE is for).
        stored_cfg.pause_until = current.pause_until.clone();
        stored_cfg.set_req_level();
        current.metadata.remove(stream::REQ_LEVEL_KEY);
        let mut wanted = stored_cfg.clone();
        wanted.metadata.remove(stream::REQ_LEVEL_KEY);
        if current == wanted {
            return Ok(c.info(server, true));
        }
        if req.action == "create" {
            return Err(ErrorKind::ConsumerAlreadyExists.err());
        }
        current.check_update(&wanted)?;
        wanted.check_supported()?;
        // Saved first: a failed write leaves the consumer as it was.
        c.persist_config(&stored_cfg)
            .map_err(|e| ErrorKind::ConsumerCreate.with(format!("could not save consumer: {e}")))?;
        c.set_config(stored_cfg);
        return Ok(c.info(server, true));
    }
    if req.action == "update" {
        return Err(ErrorKind::ConsumerDoesNotExist.err());
    }
    cfg.check_supported()?;
    let consumers = js.consumers_of(stream_name);
    // As the reference: the stream's max_consumers, or without one the server's
    // `default_max_consumers`; the account's max_consumers, a per-stream limit too, when
    // lower.
    let account_max = js.account.jetstream_limits().max_consumers;
    let mut max = scfg.max_consumers;
    if max <= 0 {
        max = srv.default_max_consumers;
    }
    if max <= 0 || (account_max > 0 && account_max < max) {
        max = account_max;
    }
    if max > 0 && consumers.len() as i64 >= max {
        return Err(ErrorKind::MaxConsumers.err());
    }
    if scfg.retention == stream::Retention::Workqueue {
        let mine = cfg.filters();
        for o in &consumers {
            let theirs = o.config().filters();
            if mine.is_empty() && theirs.is_empty() {
                return Err(ErrorKind::WorkqueueMultipleUnfiltered.err());
            }
            let all = [">".to_string()];
            let mine = if mine.is_empty() { &all[..] } else { &mine[..] };
            let theirs = if theirs.is_empty() {
                &all[..]
            } else {
                &theirs[..]
            };
            if mine
                .iter()
                .any(|a| theirs.iter().any(|b| stream::subjects_overlap(a, b)))
            {
                return Err(ErrorKind::WorkqueueNotUnique.err());
            }
        }
    }
    // Durable consumers of file streams keep their state on disk. Every consumer of a
    // replicated stream does (of a memory stream too, gone when the stream's memory is: its
    // directory goes at a restart): those files are what the stream's group replicates, so
    // the next leader runs the consumer on, an ephemeral one included (the reference's stays
    // on its server through a stream's leader change): a KV watcher's ordered consumer
    // must not go quiet at a rolling restart (nats.py's does not make a new one).
    let dir = (s.group.is_some()
        || (durable && scfg.storage == StorageType::File && !cfg.mem_storage))
        .then(|| s.dir.join("consumers").join(&name));
    let meta = consumer::ConsumerMeta {
        config: stored_cfg,
        created: now_nanos(),
    };
    let c = registry::create_consumer(js, server, router, &s, name.clone(), meta, dir)?;
    advisory::consumer_action(server, router, stream_name, &name, advisory::Action::Create);
    Ok(c.info(server, true))
}

fn find_consumer(
    js: &JetStream,
    stream: &str,
    name: &str,
) -> Result<Arc<consumer::Consumer>, ApiError> {
    js.stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    js.consumer(stream, name)
        .ok_or_else(|| ErrorKind::ConsumerNotFound.err())
}

pub(super) fn consumer_info(
    js: &JetStream,
    server: &Server,
    stream: &str,
    name: &str,
) -> Result<ConsumerInfo, ApiError> {
    Ok(find_consumer(js, stream, name)?.info(server, true))
}

pub(super) fn consumer_names(
    js: &JetStream,
    stream: &str,
    body: &[u8],
) -> Result<ConsumerNamesResponse, ApiError> {
    let req: ListRequest = parse_request(body, &schema::CONSUMER_NAMES, js.strict)?;
    js.stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let all = js.consumers_of(stream);
    Ok(ConsumerNamesResponse {
        paged: paged(all.len(), req.offset, NAMES_LIMIT),
        consumers: page(&all, req.offset, NAMES_LIMIT)
            .map(|c| c.name.clone())
            .collect(),
    })
}

pub(super) fn consumer_list(
    js: &JetStream,
    server: &Server,
    stream: &str,
    body: &[u8],
) -> Result<ConsumerListResponse, ApiError> {
    let req: ListRequest = parse_request(body, &schema::CONSUMER_NAMES, js.strict)?;
    js.stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let all = js.consumers_of(stream);
    Ok(ConsumerListResponse {
        paged: paged(all.len(), req.offset, LIST_LIMIT),
        consumers: page(&all, req.offset, LIST_LIMIT)
            .map(|c| c.info(server, false))
            .collect(),
    })
}

/// `total, offset, limit` of a NAMES/LIST response.
fn paged(total: usize, offset: usize, limit: usize) -> Paged {
    Paged {
        total,
        offset,
        limit,
    }
}

/// One page of `all`.
fn page<T>(all: &[T], offset: usize, limit: usize) -> impl Iterator<Item = &T> {
    all.iter().skip(offset).take(limit)
}

/// `$JS.API.CONSUMER.PAUSE.<stream>.<consumer>` `{"pause_until": <time>}`: pauses
/// deliveries until then; no time (or a past one) resumes. The response is the whole body.
pub(super) fn consumer_pause(
    js: &JetStream,
    stream: &str,
    name: &str,
    body: &[u8],
) -> Result<Vec<u8>, ApiError> {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct PauseRequest {
        pause_until: Option<String>,
    }
    let trimmed = body.trim_ascii();
    // Like the reference, only a JSON object or array is parsed; anything else resumes.
    let req: PauseRequest = if trimmed.starts_with(b"{") || trimmed.starts_with(b"[") {
        serde_json::from_slice(body).map_err(|e| ApiError::invalid_json_body(body, &e))?
    } else {
        PauseRequest::default()
    };
    let until = match req.pause_until.as_deref() {
        Some(t) => consumer::parse_pause_until(t)?,
        None => None,
    };
    let c = find_consumer(js, stream, name)?;
    let mut cfg = c.config();
    cfg.pause_until = until.as_ref().map(|(_, text)| text.clone());
    cfg.set_req_level();
    // Saved first: a failed write leaves the consumer as it was.
    c.persist_config(&cfg)
        .map_err(|e| ErrorKind::ConsumerStore.with(e))?;
    c.set_config(cfg);
    let (paused, remaining) = c.pause_state();
    let mut m = super::response("consumer_pause");
    m.insert("paused".into(), paused.into());
    m.insert(
        "pause_until".into(),
        until.map_or_else(|| rfc3339(0), |(_, text)| text).into(),
    );
    if paused {
        m.insert("pause_remaining".into(), remaining.into());
    }
    Ok(to_bytes(&Value::Object(m)))
}

/// `$JS.API.CONSUMER.UNPIN.<stream>.<consumer>` `{"group": <name>}`: drops the pin of a
/// pinned_client consumer so another client can take over.
pub(super) fn consumer_unpin(
    js: &JetStream,
    stream: &str,
    name: &str,
    body: &[u8],
) -> Result<Fields, ApiError> {
    #[derive(Deserialize)]
    struct UnpinRequest {
        #[serde(default)]
        group: String,
    }
    let req: UnpinRequest = serde_json::from_slice(body)
        .map_err(|e| ErrorKind::InvalidJson.with(super::go_json_error(body, &e, false)))?;
    if req.group.is_empty() {
        return Err(ErrorKind::InvalidJson.with("consumer group not specified"));
    }
    if !consumer::valid_group_name(&req.group) {
        return Err(consumer::invalid_group_name());
    }
    let c = find_consumer(js, stream, name)?;
    if !c.config().priority_groups.contains(&req.group) {
        return Err(ErrorKind::ConsumerPriorityGroupUnknown.err());
    }
    c.unpin();
    Ok(Fields::new())
}

pub(super) async fn consumer_delete(
    js: &JetStream,
    server: &Server,
    router: &mut Router,
    stream: &str,
    name: &str,
) -> Result<Fields, ApiError> {
    let s = js
        .stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    if !registry::delete_consumer(js, server, router, &s, name, None).await {
        return Err(consumer_not_found());
    }
    let mut f = Fields::new();
    f.insert("success".into(), true.into());
    Ok(f)
}
