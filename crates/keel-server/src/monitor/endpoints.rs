//! The core server endpoints: `/varz`, `/connz`, `/subsz`, `/routez`, `/leafz`, `/gatewayz`,
//! `/accountz`, `/accstatz`, `/healthz` and the `/` index. Field names, nesting and order are
//! the reference's (`shared/reference/monitoring.md`); values are keel's. Where keel has no
//! counterpart (routes, gateways, leaf nodes, TLS, Go runtime) the field is there with the
//! value the reference shows when that feature is unused.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::query::Query;
use super::{jsz, proc, Ctx, Reply};
use crate::client::ClientHandle;
use crate::config::{COMPAT_VERSION, KEEL_VERSION};
use crate::server::Server;
use crate::time::{now_nanos, rfc3339};

/// The account of every client (the reference's name for it).
pub const GLOBAL_ACCOUNT: &str = crate::account::GLOBAL;
const DEFAULT_LIST_SIZE: i64 = 1024;

/// A float64 as Go's JSON writes it: whole numbers without a fraction.
fn go_float(f: f64) -> Value {
    if f.fract() == 0.0 && f.abs() < 1e15 {
        (f as i64).into()
    } else {
        f.into()
    }
}

pub fn nanos(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

fn now() -> String {
    rfc3339(now_nanos())
}

fn since(t: SystemTime) -> Duration {
    SystemTime::now().duration_since(t).unwrap_or_default()
}

pub fn root_html(dashboard: bool) -> String {
    let mut links = vec![
        ("varz", "General"),
        ("jsz", "JetStream"),
        ("connz", "Connections"),
        ("accountz", "Accounts"),
        ("accstatz", "Account Stats"),
        ("subsz", "Subscriptions"),
        ("routez", "Routes"),
        ("leafz", "LeafNodes"),
        ("gatewayz", "Gateways"),
        ("healthz", "Health Probe"),
        ("metrics", "Prometheus Metrics"),
    ];
    if dashboard {
        links.insert(0, ("dashboard", "Dashboard"));
    }
    let mut s = format!(
        "<html lang=\"en\">\n<head><title>keel-server monitoring</title></head>\n<body>\n\
         <h3>keel-server v{KEEL_VERSION} (nats-server API level {COMPAT_VERSION})</h3>\n"
    );
    for (path, name) in links {
        s.push_str(&format!("<a href=./{path}>{name} /{path}</a><br/>\n"));
    }
    s.push_str("</body>\n</html>\n");
    s
}

// ---------------------------------------------------------------------------
// /varz
// ---------------------------------------------------------------------------

pub fn varz(ctx: &Ctx, _q: &Query) -> Result<Value, String> {
    let s = &ctx.server;
    let o = &s.opts;
    let t = s.totals();
    let addr = *s.client_addr.lock().unwrap_or_else(|e| e.into_inner());
    let process_start = Instant::now()
        .checked_sub(since(s.start))
        .unwrap_or_else(Instant::now);
    let cpu = ctx
        .cpu
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .percent(process_start);
    let cores = proc::cores();
    let slow = s.accounts.slow_consumers();
    let conns = s.num_clients();
    let cluster = s.cluster.get();
    let rt = cluster.map(|c| c.totals()).unwrap_or_default();
    let (routes, remotes) = cluster.map_or((0, 0), |c| (c.routes().len(), c.num_peers()));
    let slow_routes = cluster.map_or(0, |c| c.slow_consumers.load(Ordering::Relaxed));
    let stale_routes = cluster.map_or(0, |c| c.stale.load(Ordering::Relaxed));
    let auth = s.auth();
    let jetstream = match s.jetstream_enabled() {
        Some(js) => {
            let u = jsz::Usage::of(js);
            let mut v = json!({
                "config": jsz::config_json(js.first()),
                "stats": {
                    "memory": u.memory,
                    "storage": u.storage,
                    "reserved_memory": u.reserved_memory,
                    "reserved_storage": u.reserved_storage,
                    "accounts": js.all().len(),
                    "ha_assets": jsz::ha_assets(js),
                    "api": jsz::api_json(jsz::api_level(), Some(js)),
                },
            });
            // In a cluster, the meta group (before `limits`, as the reference orders it).
            if let Some(meta) = jsz::meta_json(ctx) {
                v["meta"] = meta;
            }
            v["limits"] = jsz::limits_json(&js.first().limits);
            v
        }
        None => json!({}),
    };
    let start = rfc3339(nanos(s.start));
    let loaded = rfc3339(nanos(
        *s.config_load_time.lock().unwrap_or_else(|e| e.into_inner()),
    ));
    let mut req_stats = Map::new();
    for (path, n) in ctx.req_stats() {
        req_stats.insert(path.into(), n.into());
    }
    let mut v = json!({
        "server_id": s.server_id,
        "server_name": s.server_name,
        "version": COMPAT_VERSION,
        "proto": 1,
        // The commit and toolchain Keel was built from, as INFO reports them.
        "git_commit": crate::config::GIT_COMMIT,
        "go": crate::config::TOOLCHAIN,
        "host": o.host,
        "port": addr.map_or(0, |a| a.port()),
        "auth_required": auth.required,
    });
    if let (false, Value::Object(m)) = (o.server_tags.is_empty(), &mut v) {
        m.insert("tags".into(), json!(o.server_tags));
    }
    if let (Some(tls), Value::Object(m)) = (&o.tls, &mut v) {
        if tls.required() {
            m.insert("tls_required".into(), true.into());
        }
        if tls.opts.verify {
            m.insert("tls_verify".into(), true.into());
        }
    }
    let tls_timeout = o.tls.as_ref().map(|t| t.opts.timeout());
    let more = json!({
        "max_connections": o.max_connections,
        "ping_interval": o.ping_interval.as_nanos() as u64,
        "ping_max": o.ping_max,
        "http_host": o.http_host.as_deref().unwrap_or(&o.host),
        // The configured value, as the reference reports it (-1 when a random port was asked
        // for); the bound port is in the "Starting http monitor" log line.
        "http_port": o.http_port.unwrap_or(ctx.http_port as i64),
        "http_base_path": "",
        "https_port": o.https_port.unwrap_or(0),
        "auth_timeout": go_float(auth.timeout.as_secs_f64()),
        "max_control_line": keel_protocol::MAX_CONTROL_LINE,
        "max_payload": o.max_payload,
        "max_pending": o.max_pending,
        "cluster": varz_cluster(s),
        "gateway": {},
        "leaf": {},
        "mqtt": {},
        "websocket": {},
        "jetstream": jetstream,
    });
    if let (Value::Object(a), Value::Object(b)) = (&mut v, more) {
        a.extend(b);
    }
    // Two halves: one json! of every field exceeds the macro recursion limit.
    let rest = json!({
        "tls_timeout": go_float(tls_timeout.unwrap_or(crate::tls::DEFAULT_TIMEOUT).as_secs_f64()),
        "write_deadline": o.write_deadline.as_nanos() as u64,
        "start": start,
        "now": now(),
        "uptime": proc::uptime(since(s.start)),
        "mem": proc::rss_bytes(),
        "cores": cores,
        "gomaxprocs": cores,
        "cpu": cpu,
        "connections": conns,
        "total_connections": s.total_connections(),
        "routes": routes,
        "remotes": remotes,
        "leafnodes": 0,
        "in_msgs": t.in_msgs + rt.in_msgs,
        "in_bytes": t.in_bytes + rt.in_bytes,
        "in_client_msgs": t.in_msgs,
        "in_client_bytes": t.in_bytes,
        "out_msgs": t.out_msgs + rt.out_msgs,
        "out_bytes": t.out_bytes + rt.out_bytes,
        "out_client_msgs": t.out_msgs,
        "out_client_bytes": t.out_bytes,
        "slow_consumers": slow + slow_routes,
        "stale_connections": stale_routes,
        "stalled_clients": 0,
        // Keel's own: failed authentications since start (the reference has no counter).
        "auth_failures": s.auth_failures.load(Ordering::Relaxed),
        "subscriptions": s.accounts.subscriptions(),
        "http_req_stats": req_stats,
        "config_load_time": loaded,
        "config_digest": "",
        "feature_flags": {
            "js_ack_fc_v2": false,
            "js_api_reply_v2": false,
            "js_raft_delete_range": false,
            "js_snapshot_sources": false,
        },
        "system_account": s.accounts.system_name(),
        "slow_consumer_stats": {"clients": slow, "routes": slow_routes, "gateways": 0, "leafs": 0},
        "stale_connection_stats": {"clients": 0, "routes": stale_routes, "gateways": 0, "leafs": 0},
        "disk_io_wait_stats": {"waiters": 0, "waits": 0, "wait_time": 0, "max_wait_time": 0},
    });
    let not_after = o.tls.as_ref().and_then(|t| t.cert_not_after);
    if let (Value::Object(a), Value::Object(b)) = (&mut v, rest) {
        a.extend(b);
        if let Some(t) = not_after {
            // Whole seconds, as Go prints a certificate time.
            a.insert(
                "tls_cert_not_after".into(),
                crate::time::rfc3339_secs(t).into(),
            );
        }
        if !auth.required {
            // The reference leaves it out then (and Keel's own counter, which means nothing).
            a.shift_remove("auth_required");
            a.shift_remove("auth_failures");
        }
    }
    Ok(v)
}

// ---------------------------------------------------------------------------
// /connz
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SortBy {
    Cid,
    Start,
    Subs,
    Pending,
    MsgsTo,
    MsgsFrom,
    BytesTo,
    BytesFrom,
    Last,
    Idle,
    Uptime,
    Stop,
    Reason,
    Rtt,
}

impl SortBy {
    fn parse(s: &str) -> Option<SortBy> {
        Some(match s {
            "" | "cid" => SortBy::Cid,
            "start" => SortBy::Start,
            "subs" => SortBy::Subs,
            "pending" => SortBy::Pending,
            "msgs_to" => SortBy::MsgsTo,
            "msgs_from" => SortBy::MsgsFrom,
            "bytes_to" => SortBy::BytesTo,
            "bytes_from" => SortBy::BytesFrom,
            "last" => SortBy::Last,
            "idle" => SortBy::Idle,
            "uptime" => SortBy::Uptime,
            "stop" => SortBy::Stop,
            "reason" => SortBy::Reason,
            "rtt" => SortBy::Rtt,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ConnState {
    Open,
    Closed,
    All,
}

/// One subscription as `/connz` and `/subsz` list it.
pub(crate) struct SubRow {
    sid: String,
    pub subject: String,
    queue: Option<String>,
    msgs: u64,
    max: u64,
    cid: u64,
    account: String,
}

impl SubRow {
    fn of(cid: u64, sub: &crate::sublist::Sub) -> SubRow {
        SubRow {
            sid: String::from_utf8_lossy(&sub.sid).into_owned(),
            subject: String::from_utf8_lossy(&sub.subject).into_owned(),
            queue: sub
                .queue
                .as_ref()
                .map(|q| String::from_utf8_lossy(q).into_owned()),
            msgs: sub.delivered.load(Ordering::Relaxed),
            max: sub.max.load(Ordering::Relaxed),
            cid,
            account: sub.client.account().name.clone(),
        }
    }

    /// Numeric sids in numeric order, then the rest by text.
    fn order_key(&self) -> (u64, &str) {
        (self.sid.parse().unwrap_or(u64::MAX), self.sid.as_str())
    }

    fn detail(&self, with_account: bool) -> Value {
        let mut m = Map::new();
        if with_account {
            m.insert("account".into(), self.account.clone().into());
            m.insert("account_tag".into(), self.account.clone().into());
        }
        m.insert("subject".into(), self.subject.clone().into());
        if let Some(q) = &self.queue {
            m.insert("qgroup".into(), q.clone().into());
        }
        m.insert("sid".into(), self.sid.clone().into());
        m.insert("msgs".into(), self.msgs.into());
        if self.max > 0 {
            m.insert("max".into(), self.max.into());
        }
        m.insert("cid".into(), self.cid.into());
        Value::Object(m)
    }
}

fn subs_of(h: &ClientHandle) -> Vec<SubRow> {
    let mut rows: Vec<SubRow> = h
        .subs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .map(|s| SubRow::of(h.id, s))
        .collect();
    rows.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
    rows
}

/// A snapshot of one connection, taken under its own locks only.
pub(crate) struct ConnRow {
    pub cid: u64,
    pub ip: String,
    port: u16,
    start: i64,
    last_activity: i64,
    rtt_nanos: u64,
    pub pending: usize,
    pub in_msgs: u64,
    pub out_msgs: u64,
    pub in_bytes: u64,
    pub out_bytes: u64,
    pub nsubs: usize,
    pub name: String,
    pub lang: String,
    version: String,
    tls: Option<Arc<crate::tls::PeerTls>>,
    pub subs: Vec<SubRow>,
    /// The authenticated user ("" without auth) and the account.
    pub user: String,
    pub account: String,
}

impl ConnRow {
    pub fn of(h: &Arc<ClientHandle>, with_subs: bool) -> ConnRow {
        let meta = h.meta.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let subs = if with_subs { subs_of(h) } else { Vec::new() };
        let nsubs = if with_subs {
            subs.len()
        } else {
            h.subs.lock().unwrap_or_else(|e| e.into_inner()).len()
        };
        ConnRow {
            cid: h.id,
            ip: meta.addr.map(|a| a.ip().to_string()).unwrap_or_default(),
            port: meta.addr.map_or(0, |a| a.port()),
            start: meta.start.map_or(0, nanos),
            last_activity: h.stats.last_activity.load(Ordering::Relaxed),
            rtt_nanos: h.stats.rtt_nanos.load(Ordering::Relaxed),
            pending: h.pending_bytes(),
            in_msgs: h.stats.in_msgs.load(Ordering::Relaxed),
            out_msgs: h.stats.out_msgs.load(Ordering::Relaxed),
            in_bytes: h.stats.in_bytes.load(Ordering::Relaxed),
            out_bytes: h.stats.out_bytes.load(Ordering::Relaxed),
            nsubs,
            name: meta.name,
            lang: meta.lang,
            version: meta.version,
            tls: meta.tls,
            subs,
            user: meta.user,
            account: h.account().name.clone(),
        }
    }

    pub fn last_activity(&self) -> i64 {
        self.last_activity.max(self.start)
    }
}

/// A row of `/connz`: an open connection, or a closed one from the ring.
enum Listed {
    Open(Box<ConnRow>),
    Closed(Arc<super::closed::Closed>),
}

impl Listed {
    fn row(&self) -> &ConnRow {
        match self {
            Listed::Open(r) => r,
            Listed::Closed(c) => &c.row,
        }
    }

    fn stop(&self) -> Option<(i64, &'static str)> {
        match self {
            Listed::Open(_) => None,
            Listed::Closed(c) => Some((c.stop, c.reason)),
        }
    }
}

/// `subs` is a boolean or `detail`.
fn subs_mode(q: &Query) -> Result<(bool, bool), String> {
    if q.str("subs") == "detail" {
        return Ok((true, true));
    }
    Ok((q.bool("subs")?, false))
}

pub fn connz(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    let s = &ctx.server;
    let sort_text = q.str("sort");
    let (subs, detail) = subs_mode(q)?;
    let mut offset = q.int("offset")?;
    let mut limit = q.int("limit")?;
    let cid = q.uint("cid")?;
    let state = match q.str("state") {
        "" | "open" => ConnState::Open,
        "closed" => ConnState::Closed,
        "any" | "all" => ConnState::All,
        other => return Err(format!("Error decoding state for {other}")),
    };
    let auth = q.bool("auth")?;
    let sort =
        SortBy::parse(sort_text).ok_or_else(|| format!("invalid sorting option: {sort_text}"))?;
    if sort == SortBy::Stop && state != ConnState::Closed {
        return Err("sort by stop only valid on closed connections".into());
    }
    if sort == SortBy::Reason && state != ConnState::Closed {
        return Err("sort by reason only valid on closed connections".into());
    }
    offset = offset.max(0);
    if limit <= 0 {
        limit = DEFAULT_LIST_SIZE;
    }
    if cid > 0 {
        limit = 1;
    }
    let now_ns = now_nanos();
    let now_text = rfc3339(now_ns);

    let open = if state == ConnState::Closed {
        Vec::new()
    } else {
        s.clients()
    };
    let closed = if state == ConnState::Open {
        Vec::new()
    } else {
        s.closed.list()
    };
    let total = open.len() + closed.len();
    let acc = q.str("acc");
    let user = q.str("user");
    let wanted =
        |r: &ConnRow| (acc.is_empty() || r.account == acc) && (user.is_empty() || r.user == user);
    let mut rows: Vec<Listed> = open
        .iter()
        .filter(|h| cid == 0 || h.id == cid)
        .map(|h| ConnRow::of(h, subs))
        .filter(|r| wanted(r))
        .map(|r| Listed::Open(Box::new(r)))
        .chain(
            closed
                .into_iter()
                .filter(|c| (cid == 0 || c.row.cid == cid) && wanted(&c.row))
                .map(Listed::Closed),
        )
        .collect();
    let total = if acc.is_empty() && user.is_empty() {
        total
    } else {
        rows.len()
    };
    // Ties keep cid order so paging is stable.
    rows.sort_by_key(|r| r.row().cid);
    // A closed connection's age and idle time end when it closed.
    let end = |r: &Listed| r.stop().map_or(now_ns, |(t, _)| t);
    match sort {
        SortBy::Cid | SortBy::Start | SortBy::Rtt => {}
        // Most recently closed first; reasons alphabetically (the reference's orders).
        SortBy::Stop => rows.sort_by_key(|r| Reverse(end(r))),
        SortBy::Reason => rows.sort_by(|a, b| a.stop().map(|s| s.1).cmp(&b.stop().map(|s| s.1))),
        SortBy::Subs => rows.sort_by_key(|r| Reverse(r.row().nsubs)),
        SortBy::Pending => rows.sort_by_key(|r| Reverse(r.row().pending)),
        SortBy::MsgsTo => rows.sort_by_key(|r| Reverse(r.row().out_msgs)),
        SortBy::MsgsFrom => rows.sort_by_key(|r| Reverse(r.row().in_msgs)),
        SortBy::BytesTo => rows.sort_by_key(|r| Reverse(r.row().out_bytes)),
        SortBy::BytesFrom => rows.sort_by_key(|r| Reverse(r.row().in_bytes)),
        SortBy::Last => rows.sort_by_key(|r| Reverse(r.row().last_activity())),
        SortBy::Idle => rows.sort_by_key(|r| Reverse(end(r) - r.row().last_activity())),
        // The reference lists the youngest connection first.
        SortBy::Uptime => rows.sort_by_key(|r| end(r) - r.row().start),
    }
    let offset = offset as usize;
    let page: Vec<Value> = rows
        .iter()
        .skip(offset)
        .take(limit as usize)
        .map(|listed| {
            let r = listed.row();
            let stop = listed.stop();
            let end_ns = stop.map_or(now_ns, |(t, _)| t);
            let mut c = Map::new();
            c.insert("cid".into(), r.cid.into());
            c.insert("kind".into(), "Client".into());
            c.insert("type".into(), "nats".into());
            c.insert("ip".into(), r.ip.clone().into());
            c.insert("port".into(), r.port.into());
            c.insert("start".into(), rfc3339(r.start).into());
            c.insert("last_activity".into(), rfc3339(r.last_activity()).into());
            if let Some((t, reason)) = stop {
                c.insert("stop".into(), rfc3339(t).into());
                c.insert("reason".into(), reason.into());
            }
            c.insert(
                "rtt".into(),
                crate::time::go_duration(r.rtt_nanos as i64).into(),
            );
            let age = Duration::from_nanos((end_ns - r.start).max(0) as u64);
            let idle = Duration::from_nanos((end_ns - r.last_activity()).max(0) as u64);
            c.insert("uptime".into(), proc::uptime(age).into());
            c.insert("idle".into(), proc::uptime(idle).into());
            c.insert("pending_bytes".into(), r.pending.into());
            c.insert("in_msgs".into(), r.in_msgs.into());
            c.insert("out_msgs".into(), r.out_msgs.into());
            c.insert("in_bytes".into(), r.in_bytes.into());
            c.insert("out_bytes".into(), r.out_bytes.into());
            c.insert("subscriptions".into(), r.nsubs.into());
            for (k, v) in [
                ("name", &r.name),
                ("lang", &r.lang),
                ("version", &r.version),
            ] {
                if !v.is_empty() {
                    c.insert(k.into(), v.clone().into());
                }
            }
            if let Some(t) = &r.tls {
                c.insert("tls_version".into(), t.version.into());
                c.insert("tls_cipher_suite".into(), t.cipher.into());
                // The reference lists the client's certificates only with auth=true.
                if auth && !t.certs.is_empty() {
                    let certs: Vec<Value> = t
                        .certs
                        .iter()
                        .map(|p| {
                            json!({
                                "subject": p.subject,
                                "spki_sha256": p.spki_sha256,
                                "cert_sha256": p.cert_sha256,
                            })
                        })
                        .collect();
                    c.insert("tls_peer_certs".into(), certs.into());
                }
                if t.first {
                    c.insert("tls_first".into(), true.into());
                }
            }
            if auth && !r.user.is_empty() {
                c.insert("authorized_user".into(), r.user.clone().into());
            }
            if auth {
                c.insert("account".into(), r.account.clone().into());
            }
            if subs && !r.subs.is_empty() {
                if detail {
                    let list: Vec<Value> = r.subs.iter().map(|s| s.detail(false)).collect();
                    c.insert("subscriptions_list_detail".into(), list.into());
                } else {
                    let list: Vec<Value> =
                        r.subs.iter().map(|s| s.subject.clone().into()).collect();
                    c.insert("subscriptions_list".into(), list.into());
                }
            }
            if auth {
                c.insert("name_tag".into(), r.account.clone().into());
            }
            Value::Object(c)
        })
        .collect();
    Ok(json!({
        "server_id": s.server_id,
        "now": now_text,
        "num_connections": page.len(),
        "total": total,
        "offset": offset,
        "limit": limit,
        "connections": page,
    }))
}

// ---------------------------------------------------------------------------
// /subsz
// ---------------------------------------------------------------------------

pub fn subsz(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    let s = &ctx.server;
    let subs = q.bool("subs")?;
    let mut offset = q.int("offset")?;
    let mut limit = q.int("limit")?;
    let test = q.str("test");
    if !test.is_empty() && !keel_protocol::subject::valid_publish(test.as_bytes()) {
        return Err(format!(
            "invalid test subject, must be valid publish subject: {test}"
        ));
    }
    offset = offset.max(0);
    if limit <= 0 {
        limit = DEFAULT_LIST_SIZE;
    }
    let mut v = json!({
        "server_id": s.server_id,
        "now": now(),
    });
    let acc = q.str("acc");
    let accounts: Vec<Arc<crate::account::Account>> = if acc.is_empty() {
        s.accounts.all()
    } else {
        s.accounts.get(acc).into_iter().collect()
    };
    if let (Value::Object(m), Value::Object(st)) = (&mut v, sublists_stats(&accounts)) {
        m.extend(st);
    }
    v["total"] = 0.into();
    v["offset"] = offset.into();
    v["limit"] = limit.into();
    if subs {
        let mut rows: Vec<SubRow> = Vec::new();
        for h in s.clients() {
            rows.extend(subs_of(&h).into_iter().filter(|r| {
                (acc.is_empty() || r.account == acc)
                    && (test.is_empty()
                        || keel_protocol::subject::matches(r.subject.as_bytes(), test.as_bytes()))
            }));
        }
        rows.sort_by(|a, b| (a.cid, a.order_key()).cmp(&(b.cid, b.order_key())));
        let list: Vec<Value> = rows
            .iter()
            .skip(offset as usize)
            .take(limit as usize)
            .map(|r| r.detail(true))
            .collect();
        v["total"] = rows.len().into();
        v["subscriptions_list"] = list.into();
    }
    Ok(v)
}

/// The reference's sublist statistics. Keel's match caches are per connection (no shared
/// cache to lock on publish): `num_cache` is what they hold now, `num_matches` every match
/// (from a cache or from the trie), `cache_hit_rate` the share answered from a cache, and
/// the fan-outs are over the cached results.
/// [`sublist_stats`] summed over accounts (the reference's server-wide figures).
fn sublists_stats(accounts: &[Arc<crate::account::Account>]) -> Value {
    if let [one] = accounts {
        return sublist_stats(&one.sublist);
    }
    let (mut subs, mut inserts, mut removes, mut matches, mut hits, mut entries) =
        (0usize, 0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut max_fanout, mut fanout_sum) = (0u64, 0f64);
    for a in accounts {
        let st = a.sublist.stats();
        let c = a.sublist.cache_stats();
        subs += a.sublist.count();
        inserts += st.inserts;
        removes += st.removes;
        matches += st.matches + c.hits;
        hits += c.hits;
        entries += c.entries;
        max_fanout = max_fanout.max(c.max_fanout);
        fanout_sum += c.avg_fanout * c.entries as f64;
    }
    json!({
        "num_subscriptions": subs,
        "num_cache": entries,
        "num_inserts": inserts,
        "num_removes": removes,
        "num_matches": matches,
        "cache_hit_rate": if matches > 0 { hits as f64 / matches as f64 } else { 0.0 },
        "max_fanout": max_fanout,
        "avg_fanout": if entries > 0 { fanout_sum / entries as f64 } else { 0.0 },
    })
}

fn sublist_stats(sublist: &crate::sublist::Sublist) -> Value {
    let stats = sublist.stats();
    let cache = sublist.cache_stats();
    let matches = stats.matches + cache.hits;
    let rate = if matches > 0 {
        cache.hits as f64 / matches as f64
    } else {
        0.0
    };
    json!({
        "num_subscriptions": sublist.count(),
        "num_cache": cache.entries,
        "num_inserts": stats.inserts,
        "num_removes": stats.removes,
        "num_matches": matches,
        "cache_hit_rate": rate,
        "max_fanout": cache.max_fanout,
        "avg_fanout": cache.avg_fanout,
    })
}

// ---------------------------------------------------------------------------
// /routez (the registered routes), /leafz, /gatewayz (none: no leaf nodes or gateways yet).
// ---------------------------------------------------------------------------

pub fn routez(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    let (subs, detail) = subs_mode(q)?;
    let s = &ctx.server;
    let now_ns = now_nanos();
    let routes: Vec<Value> = s
        .cluster
        .get()
        .map(|c| c.routes())
        .unwrap_or_default()
        .iter()
        .map(|r| {
            let st = &r.handle.stats;
            let start = nanos(r.start);
            let last = st.last_activity.load(Ordering::Relaxed).max(start);
            let mut m = Map::new();
            m.insert("rid".into(), r.rid.into());
            m.insert("remote_id".into(), r.remote_id().into());
            m.insert("remote_name".into(), r.remote_name().into());
            m.insert("did_solicit".into(), r.solicited().into());
            m.insert("is_configured".into(), r.configured().into());
            m.insert(
                "ip".into(),
                r.addr
                    .map(|a| a.ip().to_string())
                    .unwrap_or_default()
                    .into(),
            );
            m.insert("port".into(), r.addr.map_or(0, |a| a.port()).into());
            m.insert("start".into(), rfc3339(start).into());
            m.insert("last_activity".into(), rfc3339(last).into());
            m.insert(
                "rtt".into(),
                crate::time::go_duration(st.rtt_nanos.load(Ordering::Relaxed) as i64).into(),
            );
            let age = Duration::from_nanos((now_ns - start).max(0) as u64);
            let idle = Duration::from_nanos((now_ns - last).max(0) as u64);
            m.insert("uptime".into(), proc::uptime(age).into());
            m.insert("idle".into(), proc::uptime(idle).into());
            m.insert("pending_size".into(), r.handle.pending_bytes().into());
            m.insert("in_msgs".into(), st.in_msgs.load(Ordering::Relaxed).into());
            m.insert(
                "out_msgs".into(),
                st.out_msgs.load(Ordering::Relaxed).into(),
            );
            m.insert(
                "in_bytes".into(),
                st.in_bytes.load(Ordering::Relaxed).into(),
            );
            m.insert(
                "out_bytes".into(),
                st.out_bytes.load(Ordering::Relaxed).into(),
            );
            m.insert("subscriptions".into(), r.num_subs().into());
            if subs {
                let list = r.subs_info();
                if !list.is_empty() {
                    let key = if detail {
                        "subscriptions_list_detail"
                    } else {
                        "subscriptions_list"
                    };
                    let v: Vec<Value> = list
                        .iter()
                        .map(|sub| {
                            let subject = String::from_utf8_lossy(&sub.subject).into_owned();
                            if !detail {
                                return subject.into();
                            }
                            // The reference's fields: the account is in the sid.
                            let mut d = Map::new();
                            d.insert("subject".into(), subject.into());
                            if let Some(q) = &sub.queue {
                                d.insert("qgroup".into(), String::from_utf8_lossy(q).into());
                            }
                            // The reference's sid of a routed subscription: `R <acc> <subject>[ <queue>]`.
                            let sid = String::from_utf8_lossy(&sub.sid);
                            let sid = if sid.starts_with("L ") {
                                sid.into_owned()
                            } else {
                                format!("R {sid}")
                            };
                            d.insert("sid".into(), sid.into());
                            d.insert("msgs".into(), sub.msgs.into());
                            d.insert("cid".into(), r.rid.into());
                            Value::Object(d)
                        })
                        .collect();
                    m.insert(key.into(), v.into());
                }
            }
            m.insert("compression".into(), "off".into());
            Value::Object(m)
        })
        .collect();
    Ok(json!({
        "server_id": s.server_id,
        "server_name": s.server_name,
        "now": now(),
        "num_routes": routes.len(),
        "routes": routes,
    }))
}

/// `/varz` `cluster`: empty without one, as the reference.
fn varz_cluster(s: &Server) -> Value {
    let Some(c) = s.cluster.get() else {
        return json!({});
    };
    let mut m = Map::new();
    m.insert("name".into(), c.name().into());
    m.insert("addr".into(), c.opts.listen_host().into());
    m.insert(
        "cluster_port".into(),
        c.listen_addr().map_or(0, |a| a.port()).into(),
    );
    // Seconds, as the reference's float (whole numbers print without a fraction).
    let t = c.opts.auth_timeout;
    let timeout: Value = if t.subsec_nanos() == 0 {
        t.as_secs().into()
    } else {
        t.as_secs_f64().into()
    };
    m.insert("auth_timeout".into(), timeout);
    if let Some(a) = &c.opts.advertise {
        m.insert("advertise".into(), a.clone().into());
    }
    if !c.opts.routes.is_empty() {
        let urls: Vec<Value> = c.opts.routes.iter().map(|u| u.host_port().into()).collect();
        m.insert("urls".into(), urls.into());
    }
    let tls = c.opts.tls.as_ref();
    let t = tls.map_or(crate::tls::DEFAULT_TIMEOUT, |t| t.timeout());
    m.insert("tls_timeout".into(), go_float(t.as_secs_f64()));
    if tls.is_some() {
        // Routes always verify the peer's certificate.
        m.insert("tls_required".into(), true.into());
        m.insert("tls_verify".into(), true.into());
    }
    // One connection per peer: the reference's value for "no pool".
    m.insert("pool_size".into(), (-1).into());
    if let Some(t) = tls.and_then(|t| t.cert_not_after) {
        m.insert(
            "tls_cert_not_after".into(),
            crate::time::rfc3339_secs(t).into(),
        );
    }
    Value::Object(m)
}

pub fn leafz(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    q.bool("subs")?;
    Ok(json!({
        "server_id": ctx.server.server_id,
        "now": now(),
        "leafnodes": 0,
        "leafs": [],
    }))
}

pub fn gatewayz(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    q.bool("accs")?;
    q.bool("subs")?;
    Ok(json!({
        "server_id": ctx.server.server_id,
        "now": now(),
        "outbound_gateways": {},
        "inbound_gateways": {},
    }))
}

// ---------------------------------------------------------------------------
// /accountz, /accstatz
// ---------------------------------------------------------------------------

pub fn accountz(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    let s = &ctx.server;
    q.bool("unused")?;
    let acc = q.str("acc");
    let mut v = json!({
        "server_id": s.server_id,
        "now": now(),
        "system_account": s.accounts.system_name(),
    });
    if acc.is_empty() {
        let names: Vec<String> = s.accounts.all().iter().map(|a| a.name.clone()).collect();
        v["accounts"] = json!(names);
        return Ok(v);
    }
    v["account_detail"] = account_detail(s, acc)?;
    Ok(v)
}

/// One account as `/accountz?acc=` and `$SYS.REQ.ACCOUNT.<acc>.INFO` describe it.
pub(crate) fn account_detail(s: &Server, acc: &str) -> Result<Value, String> {
    let Some(account) = s.accounts.get(acc) else {
        return Err(format!("Account {acc} does not exist"));
    };
    let cfg = account.config();
    let subs = account.sublist.count();
    let mut d = Map::new();
    d.insert("account_name".into(), acc.into());
    d.insert("update_time".into(), rfc3339(nanos(cfg.updated)).into());
    if s.accounts.is_system(&account) {
        d.insert("is_system".into(), true.into());
    }
    d.insert("expired".into(), false.into());
    d.insert("complete".into(), true.into());
    let js_here = s
        .jetstream
        .get()
        .is_some_and(|js| js.all().iter().any(|j| Arc::ptr_eq(&j.account, &account)));
    d.insert("jetstream_enabled".into(), js_here.into());
    d.insert("leafnode_connections".into(), 0.into());
    d.insert(
        "client_connections".into(),
        account.conns.load(Ordering::Relaxed).into(),
    );
    d.insert("subscriptions".into(), subs.into());
    let kind = |k: crate::auth::conf::ExportKind| match k {
        crate::auth::conf::ExportKind::Stream => "stream",
        crate::auth::conf::ExportKind::Service => "service",
    };
    if !cfg.exports.is_empty() {
        let list: Vec<Value> = cfg
            .exports
            .iter()
            .map(|e| {
                let mut m = Map::new();
                m.insert("subject".into(), e.subject.clone().into());
                m.insert("type".into(), kind(e.kind).into());
                if e.kind == crate::auth::conf::ExportKind::Service {
                    m.insert("response_type".into(), e.response_type.name().into());
                }
                if let Some(a) = &e.accounts {
                    m.insert("approved_accounts".into(), json!(a));
                }
                Value::Object(m)
            })
            .collect();
        d.insert("exports".into(), list.into());
    }
    // The system account's services every account imports (as the reference lists them: not
    // for `$G`, though it has them too).
    let mut system_imports: Vec<Value> = Vec::new();
    if let Some(sys) = s
        .accounts
        .system_account()
        .filter(|sys| !Arc::ptr_eq(sys, &account) && acc != GLOBAL_ACCOUNT)
    {
        for (remote, local) in [
            (format!("$SYS.REQ.USER.{acc}.INFO"), "$SYS.REQ.USER.INFO"),
            (
                format!("$SYS.REQ.ACCOUNT.{acc}.CONNZ"),
                "$SYS.REQ.ACCOUNT.PING.CONNZ",
            ),
            (
                format!("$SYS.REQ.ACCOUNT.{acc}.CONNZ"),
                "$SYS.REQ.SERVER.PING.CONNZ",
            ),
            (
                format!("$SYS.REQ.ACCOUNT.{acc}.STATZ"),
                "$SYS.REQ.ACCOUNT.PING.STATZ",
            ),
        ] {
            system_imports.push(json!({
                "subject": remote, "account": sys.name, "to": local, "local_subject": local,
                "type": "service", "invalid": false, "share": false, "tracking": false,
            }));
        }
    }
    if !cfg.imports.is_empty() || !system_imports.is_empty() {
        let list: Vec<Value> = system_imports
            .into_iter()
            .chain(cfg.imports.iter().map(|i| {
                let local = match (&i.prefix, &i.to) {
                    (Some(p), _) => format!("{p}.{}", i.subject),
                    (None, Some(t)) => t.clone(),
                    _ => i.subject.clone(),
                };
                json!({
                    "subject": i.subject,
                    "account": i.account,
                    "local_subject": local,
                    "type": kind(i.kind),
                    "invalid": false,
                    "share": i.share,
                    "tracking": false,
                })
            }))
            .collect();
        d.insert("imports".into(), list.into());
    }
    d.insert("name_tag".into(), acc.into());
    d.insert("sublist_stats".into(), sublist_stats(&account.sublist));
    Ok(Value::Object(d))
}

/// One account's `/accstatz` entry: its connections and the messages they sent and got.
pub(crate) fn account_statz(s: &Server, account: &crate::account::Account) -> Value {
    let st = &account.stats;
    let (mut in_msgs, mut in_bytes, mut out_msgs, mut out_bytes) = (
        st.closed_in_msgs.load(Ordering::Relaxed),
        st.closed_in_bytes.load(Ordering::Relaxed),
        st.closed_out_msgs.load(Ordering::Relaxed),
        st.closed_out_bytes.load(Ordering::Relaxed),
    );
    for h in s.clients() {
        if std::ptr::eq(&**h.account(), account) {
            in_msgs += h.stats.in_msgs.load(Ordering::Relaxed);
            in_bytes += h.stats.in_bytes.load(Ordering::Relaxed);
            out_msgs += h.stats.out_msgs.load(Ordering::Relaxed);
            out_bytes += h.stats.out_bytes.load(Ordering::Relaxed);
        }
    }
    let conns = account.conns.load(Ordering::Relaxed);
    let zero = json!({"msgs": 0, "bytes": 0});
    json!({
        "acc": account.name,
        "name": account.name,
        "conns": conns,
        "leafnodes": 0,
        "total_conns": conns,
        "num_subscriptions": account.sublist.count(),
        // From the server's view: what it sent to the account's clients, what it got.
        "sent": {"msgs": out_msgs, "bytes": out_bytes,
                 "gateways": zero, "routes": zero, "leafs": zero},
        "received": {"msgs": in_msgs, "bytes": in_bytes,
                     "gateways": zero, "routes": zero, "leafs": zero},
        "slow_consumers": st.slow_consumers.load(Ordering::Relaxed),
    })
}

pub fn accstatz(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    let s = &ctx.server;
    let unused = q.bool("unused")?;
    let acc = q.str("acc");
    let list: Vec<Value> = s
        .accounts
        .all()
        .iter()
        .filter(|a| if acc.is_empty() { true } else { a.name == acc })
        // Accounts nobody uses are left out unless asked for (the reference's `unused`);
        // without accounts `$G` is always listed.
        .filter(|a| {
            unused
                || !acc.is_empty()
                || a.conns.load(Ordering::Relaxed) > 0
                || (a.name == GLOBAL_ACCOUNT
                    && s.auth_opts.read().map_or(true, |o| o.accounts.is_empty()))
        })
        .map(|a| account_statz(s, a))
        .collect();
    Ok(json!({
        "server_id": s.server_id,
        "now": now(),
        "account_statz": list,
    }))
}

// ---------------------------------------------------------------------------
// /healthz
// ---------------------------------------------------------------------------

/// The reference's health probe. Compact JSON; the HTTP status says the outcome:
/// 200 ok; 400 for `stream` without `account` (or `consumer` without `stream`); 503 when
/// JetStream was asked for but is not running; 404 when the named account, stream or
/// consumer does not exist. `js-server-only` checks the server alone, `js-enabled-only` (and
/// the deprecated `js-enabled`) only that JetStream runs; otherwise the named assets are
/// checked (on a single server there is no meta group, so `js-meta-only` adds nothing).
/// `details=true` lists errors under `errors` with their kind instead of one `error`.
pub fn healthz(ctx: &Ctx, q: &Query) -> Reply {
    let mut flags = [false; 5];
    for (i, key) in [
        "js-enabled",
        "js-enabled-only",
        "js-server-only",
        "js-meta-only",
        "details",
    ]
    .into_iter()
    .enumerate()
    {
        match q.bool(key) {
            Ok(b) => flags[i] = b,
            Err(e) => return Reply::text(400, e),
        }
    }
    let [js_enabled, js_enabled_only, js_server_only, _meta_only, details] = flags;
    let probe = Probe {
        js_enabled_only: js_enabled || js_enabled_only,
        js_server_only,
        account: q.str("account"),
        stream: q.str("stream"),
        consumer: q.str("consumer"),
    };
    let (status, body) = match health(&ctx.server, &probe) {
        Ok(()) => (200, json!({"status": "ok"})),
        Err(e) if details => (e.status, json!({"status": "error", "errors": [e.detail()]})),
        Err(e) => (e.status, json!({"status": e.status_text, "error": e.text})),
    };
    Reply::json_compact(status, &body, q)
}

/// What `/healthz` was asked to check.
pub(crate) struct Probe<'a> {
    pub js_enabled_only: bool,
    pub js_server_only: bool,
    pub account: &'a str,
    pub stream: &'a str,
    pub consumer: &'a str,
}

/// A failed check: HTTP status, the reference's status word and text, and what it is about.
pub(crate) struct HealthError {
    pub status: u16,
    status_text: &'static str,
    pub text: String,
    kind: &'static str,
    account: String,
    stream: String,
    consumer: String,
}

impl HealthError {
    fn new(status: u16, status_text: &'static str, kind: &'static str, text: String) -> Self {
        HealthError {
            status,
            status_text,
            text,
            kind,
            account: String::new(),
            stream: String::new(),
            consumer: String::new(),
        }
    }

    /// One entry of `errors` (`details=true`); empty fields are left out, as the reference's.
    fn detail(&self) -> Value {
        let mut m = Map::new();
        m.insert("type".into(), self.kind.into());
        for (k, v) in [
            ("account", &self.account),
            ("stream", &self.stream),
            ("consumer", &self.consumer),
        ] {
            if !v.is_empty() {
                m.insert(k.into(), v.clone().into());
            }
        }
        m.insert("error".into(), self.text.clone().into());
        Value::Object(m)
    }
}

pub(crate) fn health(server: &Server, p: &Probe) -> Result<(), Box<HealthError>> {
    if p.account.is_empty() && !p.stream.is_empty() {
        return Err(Box::new(HealthError::new(
            400,
            "error",
            "BAD_REQUEST",
            "\"account\" must not be empty when checking stream health".into(),
        )));
    }
    if p.stream.is_empty() && !p.consumer.is_empty() {
        return Err(Box::new(HealthError::new(
            400,
            "error",
            "BAD_REQUEST",
            "\"stream\" must not be empty when checking consumer health".into(),
        )));
    }
    if p.js_server_only || !server.opts.jetstream {
        return Ok(());
    }
    let Some(js) = server.jetstream_enabled() else {
        return Err(Box::new(HealthError::new(
            503,
            "unavailable",
            "JETSTREAM",
            "JetStream not enabled (10076)".into(),
        )));
    };
    if p.js_enabled_only {
        return Ok(());
    }
    if let Some(why) = js.meta.get().and_then(|m| m.failed()) {
        return Err(Box::new(HealthError::new(
            503,
            "unavailable",
            "JETSTREAM",
            format!("JetStream meta group stopped on a storage error ({why})"),
        )));
    }
    if js.meta.get().is_some_and(|m| m.leader().is_none()) {
        return Err(Box::new(HealthError::new(
            503,
            "unavailable",
            "JETSTREAM",
            "JetStream has not established contact with a meta leader".into(),
        )));
    }
    if let Some(why) = crate::jetstream::cluster::not_current(js) {
        return Err(Box::new(HealthError::new(
            503,
            "unavailable",
            "JETSTREAM",
            why,
        )));
    }
    if p.account.is_empty() {
        return Ok(());
    }
    // An account without JetStream (including $SYS) is not found, as with the reference.
    let Some(js) = js.account(p.account) else {
        let mut e = HealthError::new(
            404,
            "unavailable",
            "ACCOUNT",
            format!("JetStream account {:?} not found", p.account),
        );
        e.account = p.account.into();
        return Err(Box::new(e));
    };
    if p.stream.is_empty() {
        return Ok(());
    }
    let Some(stream) = js.stream(p.stream) else {
        let mut e = HealthError::new(
            404,
            "unavailable",
            "STREAM",
            format!(
                "JetStream stream {:?} not found on account {:?}",
                p.stream, p.account
            ),
        );
        e.account = p.account.into();
        e.stream = p.stream.into();
        return Err(Box::new(e));
    };
    if !p.consumer.is_empty() && js.consumer(&stream.name, p.consumer).is_none() {
        let mut e = HealthError::new(
            404,
            "unavailable",
            "CONSUMER",
            format!(
                "JetStream consumer {:?} not found for stream {:?} on account {:?}",
                p.consumer, p.stream, p.account
            ),
        );
        e.account = p.account.into();
        e.stream = p.stream.into();
        e.consumer = p.consumer.into();
        return Err(Box::new(e));
    }
    Ok(())
}

impl Reply {
    fn json_compact(status: u16, v: &Value, q: &Query) -> Reply {
        Reply::json_body(
            status,
            super::go_escape(&serde_json::to_string(v).unwrap_or_default()),
            q,
        )
    }
}
