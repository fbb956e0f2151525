//! `/jsz`: JetStream usage, the accounts with JetStream and, on request, their streams and
//! consumers, in the reference's shape. Every stream and consumer is read under its own
//! lock, one at a time.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::query::Query;
use super::Ctx;
use crate::jetstream::api::types::ConsumerInfo;
use crate::jetstream::stream::{StorageType, Stream};
use crate::jetstream::{JetStream, JetStreams};
use crate::time::{now_nanos, rfc3339};

/// The JetStream API level keel implements (reported where the reference reports its own).
pub fn api_level() -> u32 {
    crate::jetstream::stream::API_LEVEL
}

/// `{level, total, errors}` of the JetStream API.
pub fn api_json(level: u32, js: Option<&JetStreams>) -> Value {
    let (total, errors) = js.map_or((0, 0), JetStreams::api_stats);
    json!({"level": level, "total": total, "errors": errors})
}

/// Store usage and reservations, as `$JS.API.INFO` computes them.
pub struct Usage {
    pub memory: u64,
    pub storage: u64,
    pub reserved_memory: u64,
    pub reserved_storage: u64,
}

impl Usage {
    /// Every account's.
    pub fn of(js: &JetStreams) -> Usage {
        Usage::from_streams(&js.streams())
    }

    fn from_streams(streams: &[Arc<Stream>]) -> Usage {
        let mut u = Usage {
            memory: 0,
            storage: 0,
            reserved_memory: 0,
            reserved_storage: 0,
        };
        for s in streams {
            let bytes = s.bytes.load(std::sync::atomic::Ordering::Relaxed);
            let cfg = s.config();
            let reserve = cfg.max_bytes.max(0) as u64;
            match cfg.storage {
                StorageType::Memory => {
                    u.memory += bytes;
                    u.reserved_memory += reserve;
                }
                StorageType::File => {
                    u.storage += bytes;
                    u.reserved_storage += reserve;
                }
            }
        }
        u
    }
}

/// `config` of `/jsz` and `/varz` `jetstream`: -1 limits mean unlimited (keel enforces no
/// default share of memory or disk, unlike the reference). Sync-always (keel's default) is
/// the reference's `sync_always: true` in place of `sync_interval`.
pub fn config_json(js: &JetStream) -> Value {
    let mut c = Map::new();
    c.insert("max_memory".into(), js.max_memory.into());
    c.insert("max_storage".into(), js.max_store.into());
    c.insert(
        "store_dir".into(),
        js.store_dir.join("jetstream").display().to_string().into(),
    );
    match js.sync_interval {
        Some(d) => c.insert("sync_interval".into(), (d.as_nanos() as u64).into()),
        None => c.insert("sync_always".into(), true.into()),
    };
    if let Some(d) = &js.domain {
        c.insert("domain".into(), d.clone().into());
    }
    if js.strict {
        c.insert("strict".into(), true.into());
    }
    Value::Object(c)
}

/// `leader-only` on a server that is not the meta leader: the endpoint answers 400 with
/// this text, `$SYS.REQ.SERVER.*.JSZ` does not answer at all (as the reference).
pub const NOT_LEADER: &str = "filtered response: not leader";

pub fn jsz(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    let s = &ctx.server;
    let acc = q.str("acc").to_string();
    let mut accounts = q.bool("accounts")?;
    let mut streams_opt = q.bool("streams")?;
    let consumers_opt = q.bool("consumers")?;
    let config_opt = q.bool("config")?;
    let leader_only = q.bool("leader-only")?;
    // Paging is over accounts.
    let offset = q.int("offset")?.max(0) as usize;
    let limit = match q.int("limit")? {
        l if l > 0 => l as usize,
        _ => usize::MAX,
    };
    let raft_opt = q.bool("raft")?;
    let stream_leader_only = q.bool("stream-leader-only")?;
    if consumers_opt {
        streams_opt = true;
    }
    if streams_opt && acc.is_empty() {
        accounts = true;
    }

    let enabled = s.jetstream_enabled();
    let meta_leader = enabled.is_some_and(|js| js.meta.get().is_none_or(|m| m.is_leader()));
    if leader_only && !meta_leader {
        return Err(NOT_LEADER.to_string());
    }
    let Some(js) = enabled else {
        return Ok(json!({
            "memory": 0, "storage": 0, "reserved_memory": 0, "reserved_storage": 0,
            "accounts": 0, "ha_assets": 0, "api": api_json(0, None),
            "server_id": s.server_id, "now": rfc3339(now_nanos()), "disabled": true,
            "config": {"max_memory": 0, "max_storage": 0},
            "streams": 0, "consumers": 0, "messages": 0, "bytes": 0, "total": 0,
        }));
    };

    let streams = js.streams();
    let usage = Usage::from_streams(&streams);
    let mut n_consumers = 0usize;
    let (mut messages, mut bytes) = (0u64, 0u64);
    // With `raft`: the streams (and their consumers, which run where their stream leads)
    // led here, as the reference counts them (one without a group counts as led).
    let (mut streams_leader, mut consumers_leader) = (0usize, 0usize);
    for st in &streams {
        let state = st.state();
        n_consumers += st.consumer_count();
        messages += state.msgs;
        bytes += state.bytes;
        if raft_opt && (st.group.is_none() || st.leads()) {
            streams_leader += 1;
            consumers_leader += st.consumers.len();
        }
    }

    let first = js.first();
    let mut v = json!({
        "memory": usage.memory,
        "storage": usage.storage,
        "reserved_memory": usage.reserved_memory,
        "reserved_storage": usage.reserved_storage,
        "accounts": js.all().len(),
        "ha_assets": 0,
        "api": api_json(api_level(), Some(js)),
        "server_id": s.server_id,
        "now": rfc3339(now_nanos()),
        "config": config_json(first),
        "limits": limits_json(&first.limits),
        "streams": streams.len(),
        "consumers": n_consumers,
        "messages": messages,
        "bytes": bytes,
    });
    if streams_leader > 0 {
        v["streams_leader"] = streams_leader.into();
    }
    if consumers_leader > 0 {
        v["consumers_leader"] = consumers_leader.into();
    }
    if accounts || !acc.is_empty() {
        let chosen: Vec<&Arc<JetStream>> = js
            .all()
            .iter()
            .filter(|a| acc.is_empty() || acc == a.account.name)
            .collect();
        let mut details = Vec::new();
        for a in chosen.iter().skip(offset).take(limit) {
            details.push(account_detail(
                ctx,
                a,
                streams_opt,
                consumers_opt,
                config_opt,
                raft_opt,
                stream_leader_only,
            ));
        }
        if !details.is_empty() {
            v["account_details"] = details.into();
        }
    }
    if let Some(meta) = meta_json(ctx) {
        v["meta_cluster"] = meta;
        v["ha_assets"] = ha_assets(js).into();
    }
    v["total"] = js.all().len().into();
    Ok(v)
}

/// The meta group as `/jsz`'s `meta_cluster` and `/varz`'s `jetstream.meta` show it (in a
/// cluster).
pub fn meta_json(ctx: &Ctx) -> Option<Value> {
    let s = &ctx.server;
    let meta = s.jetstream_enabled()?.meta.get()?;
    Some(meta.jsz(&s.cluster.get()?.name()))
}

/// The Raft groups this server is in, as the reference counts its HA assets: the meta
/// group and each replicated stream's (consumers have none of their own here).
pub fn ha_assets(js: &crate::jetstream::JetStreams) -> usize {
    let replicated = js
        .streams()
        .iter()
        .filter(|s| s.group.is_some() && s.config().num_replicas > 1)
        .count();
    usize::from(js.meta.get().is_some()) + replicated
}

/// One account's entry of `account_details` (with its streams when asked for).
fn account_detail(
    ctx: &Ctx,
    js: &JetStream,
    streams_opt: bool,
    consumers_opt: bool,
    config_opt: bool,
    raft_opt: bool,
    leading_only: bool,
) -> Value {
    let streams = js.streams();
    let usage = Usage::from_streams(&streams);
    let mut details = Vec::new();
    if streams_opt {
        for st in &streams {
            // Clustered: the stream info's `cluster` object (its real leader, the replicas).
            let ci = js
                .clustered()
                .then(|| crate::jetstream::api::streams::cluster_info(js, st));
            let (cluster, leader) = match &ci {
                Some(ci) => (
                    serde_json::to_value(ci).unwrap_or_default(),
                    ci.leader.clone(),
                ),
                None => {
                    let name = ctx.server.server_name.clone();
                    (json!({ "leader": name }), name)
                }
            };
            // As the reference: only the streams whose `cluster` names this server.
            if leading_only && leader != ctx.server.server_name {
                continue;
            }
            let state = st.state();
            let consumers = if consumers_opt {
                consumer_infos(ctx, js, st, ci)
            } else {
                Vec::new()
            };
            let mut d = stream_detail(cluster, st, &state, &consumers, config_opt);
            // With `raft`: the stream's group, and its consumers' (the stream's too: Keel
            // carries them in it).
            if let (true, Some(g), Some(m)) = (raft_opt, st.group.as_ref(), d.as_object_mut()) {
                m.insert("stream_raft_group".into(), g.group.clone().into());
                if !consumers.is_empty() {
                    let groups: Vec<Value> = consumers
                        .iter()
                        .map(|c| json!({"name": c.name, "raft_group": g.group}))
                        .collect();
                    m.insert("consumer_raft_groups".into(), groups.into());
                }
            }
            details.push(d);
        }
    }
    // The account's own limits are unlimited: the reference shows -1 as uint64 here.
    let mut a = json!({
        "name": js.account.name,
        "id": js.account.name,
        "memory": usage.memory,
        "storage": usage.storage,
        "reserved_memory": u64::MAX,
        "reserved_storage": u64::MAX,
        "accounts": 0,
        "ha_assets": 0,
        "api": api_json(0, None),
    });
    if !details.is_empty() {
        a["stream_detail"] = details.into();
    }
    a
}

/// A stream's consumers for `consumer_detail`: those running here, or on a follower of a
/// replicated stream (where they do not run) as its group wrote them here, as the
/// reference's replicas list theirs; `cluster` is the stream's, which carries them.
fn consumer_infos(
    ctx: &Ctx,
    js: &JetStream,
    st: &Arc<Stream>,
    cluster: Option<crate::jetstream::api::types::ClusterInfo>,
) -> Vec<ConsumerInfo> {
    if st.group.is_none() || st.leads() {
        return js
            .consumers_of(&st.name)
            .iter()
            .map(|c| c.info(&ctx.server, false))
            .collect();
    }
    st.replica_consumer_dirs()
        .iter()
        .filter_map(|d| crate::jetstream::consumer::replica_info(st, d, cluster.clone()))
        .collect()
}

fn stream_detail(
    cluster: Value,
    st: &Arc<Stream>,
    state: &keel_store::State,
    consumers: &[ConsumerInfo],
    with_config: bool,
) -> Value {
    let mut d = Map::new();
    d.insert("name".into(), st.name.clone().into());
    d.insert("created".into(), rfc3339(st.created).into());
    d.insert("cluster".into(), cluster);
    if with_config {
        d.insert("config".into(), st.config().to_json(false));
    }
    d.insert(
        "state".into(),
        Stream::state_json(state, st.consumer_count(), None, None),
    );
    if !consumers.is_empty() {
        let list: Vec<Value> = consumers
            .iter()
            .map(|c| {
                let mut info = serde_json::to_value(c).expect("info serializes");
                if let (false, Some(m)) = (with_config, info.as_object_mut()) {
                    m.shift_remove("config");
                }
                info
            })
            .collect();
        d.insert("consumer_detail".into(), list.into());
    }
    Value::Object(d)
}

/// `jetstream { limits }` as the reference's `/jsz` and `/varz` show them (keys left out
/// when not set; `default_max_consumers` always, 1,000 unless configured).
pub fn limits_json(l: &crate::config::JsLimits) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in [
        ("max_request_batch", l.max_request_batch),
        ("max_ack_pending", l.max_ack_pending),
        ("max_duplicate_window", l.duplicate_window),
        ("default_max_consumers", l.default_max_consumers),
    ] {
        if v != 0 {
            m.insert(k.into(), v.into());
        }
    }
    Value::Object(m)
}
