//! The system account's services (`system_account`, default `$SYS`), as the reference
//! offers them to the `nats` CLI and other tools:
//!
//! - `$SYS.REQ.SERVER.PING` and `$SYS.REQ.SERVER.PING.STATSZ`: the server's statistics;
//!   `$SYS.REQ.SERVER.PING.<KIND>` and `$SYS.REQ.SERVER.<id>.<KIND>` for VARZ, CONNZ, SUBSZ,
//!   ROUTEZ, GATEWAYZ, LEAFZ, ACCOUNTZ, JSZ, HEALTHZ, STATSZ: the monitoring endpoint's JSON
//!   in `{"server": ..., "data": ...}`. A request's JSON may filter servers
//!   (`server_name`, `host`, `cluster`, `domain`, `tags`) and carry the endpoint's options.
//! - `$SYS.REQ.ACCOUNT.<acc>.<KIND>` for INFO, CONNZ, SUBSZ, JSZ, STATZ, LEAFZ, CONNS, and
//!   `$SYS.REQ.ACCOUNT.PING.STATZ` / `.CONNZ` for every account.
//! - `$SYS.REQ.USER.INFO`: who the requester is (user, account, permissions).
//! - Events: `$SYS.ACCOUNT.<acc>.CONNECT` / `.DISCONNECT` for each client, and
//!   `$SYS.ACCOUNT.<acc>.SERVER.CONNS` with the account's connection count;
//!   `$SYS.SERVER.<id>.LAMEDUCK` and `.SHUTDOWN` when the server is stopping.
//!
//! Every other account reaches the requests about itself through service imports the
//! accounts install (`Accounts::install_links`): its `$SYS.REQ.ACCOUNT.PING.CONNZ`,
//! `$SYS.REQ.SERVER.PING.CONNZ`, `$SYS.REQ.ACCOUNT.PING.STATZ` and `$SYS.REQ.USER.INFO` become
//! the system account's requests for that account, and the replies come back through it.
//!
//! The services run as one in-process client of the system account; answers are built by
//! `monitor::sysreq` from the same code as the HTTP endpoints.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::{json, Map, Value};

use crate::account::Account;
use crate::client::{ClientHandle, InMsg};
use crate::monitor::sysreq;
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::sublist::Sub;
use crate::time::{now_nanos, rfc3339};

/// The system services of one server.
pub struct System {
    pub account: Arc<Account>,
    /// Publishes events (connects and disconnects come from every connection's task).
    events: Mutex<Router>,
    /// `server.seq` in every message: how many the server has sent.
    seq: AtomicU64,
    ctx: crate::monitor::Ctx,
}

/// The sid of the system services' subscriptions (routes tell peers about the server and
/// account requests among them).
pub(crate) const SERVICE_SID: &[u8] = b"sys";

/// Whether `sub` is one of the system services' server or account requests, which (as
/// with the reference) serve the whole cluster: `$SYS.REQ.SERVER.PING` from any node
/// reaches every server, `$SYS.REQ.SERVER.<id>.*` the one it names. `$SYS.REQ.USER.INFO`
/// is about the requester's own connection, so it stays local.
pub(crate) fn serves_peers(sub: &crate::sublist::Sub) -> bool {
    sub.client.internal_queue().is_some()
        && sub.sid == SERVICE_SID
        && (sub.subject.starts_with(b"$SYS.REQ.SERVER.")
            || sub.subject.starts_with(b"$SYS.REQ.ACCOUNT."))
}

/// Queue in front of the system services: requests are small and rare.
const QUEUE_BYTES: usize = 1024 * 1024;

impl System {
    /// Subscribes the services in the system account and starts answering.
    pub fn start(server: &Arc<Server>, account: Arc<Account>) -> Arc<System> {
        let (handle, rx) = ClientHandle::internal(
            server,
            &account,
            "system account services".into(),
            QUEUE_BYTES,
        );
        let id = &server.server_id;
        for subject in [
            "$SYS.REQ.SERVER.PING".to_string(),
            "$SYS.REQ.SERVER.PING.*".to_string(),
            format!("$SYS.REQ.SERVER.{id}.*"),
            "$SYS.REQ.ACCOUNT.*.*".to_string(),
            "$SYS.REQ.USER.INFO".to_string(),
            "$SYS.REQ.USER.*.INFO".to_string(),
        ] {
            account.sublist.insert(Arc::new(Sub {
                client: handle.clone(),
                sid: Bytes::from_static(SERVICE_SID),
                subject: Bytes::from(subject),
                queue: None,
                max: AtomicU64::new(0),
                delivered: AtomicU64::new(0),
            }));
        }
        let sys = Arc::new(System {
            events: Mutex::new(Router::new(account.clone(), 0x5359)),
            account,
            seq: AtomicU64::new(0),
            ctx: crate::monitor::Ctx::new(server.clone(), 0),
        });
        server.spawn(serve(sys.clone(), server.clone(), rx));
        sys
    }

    /// The `server` object of every system message.
    fn server_info(&self, server: &Server) -> Value {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let js = server.jetstream_enabled().is_some();
        let mut m = Map::new();
        m.insert("name".into(), server.server_name.clone().into());
        m.insert("host".into(), server.opts.host.clone().into());
        m.insert("id".into(), server.server_id.clone().into());
        if let Some(c) = server.cluster.get() {
            m.insert("cluster".into(), c.name().into());
        }
        if let Some(d) = crate::jetstream::domain(server) {
            m.insert("domain".into(), d.into());
        }
        m.insert("ver".into(), crate::config::COMPAT_VERSION.into());
        m.insert(
            "feature_flags".into(),
            json!({"js_ack_fc_v2": false, "js_api_reply_v2": false,
                   "js_raft_delete_range": false, "js_snapshot_sources": false}),
        );
        m.insert("jetstream".into(), js.into());
        // Capability bits: 1 = JetStream.
        m.insert("flags".into(), (if js { 1 } else { 0 }).into());
        m.insert("seq".into(), seq.into());
        m.insert("time".into(), rfc3339(now_nanos()).into());
        Value::Object(m)
    }

    fn publish(&self, server: &Server, router: &mut Router, subject: &[u8], body: &Value) {
        let subject = Bytes::copy_from_slice(subject);
        let data = Bytes::from(serde_json::to_vec(body).unwrap_or_default());
        router.route(
            server,
            &Outgoing {
                subject: &subject,
                reply: None,
                hdr_len: None,
                data: &data,
            },
            None,
        );
        router.flush();
    }

    /// `$SYS.SERVER.<id>.SHUTDOWN` (or `.LAMEDUCK`), as the reference sends it: the
    /// server's own description as the body. Other servers of a cluster stop placing
    /// replicas here at once (`RaftHost::departed`).
    pub fn stopping(&self, server: &Server, lame_duck: bool) {
        let what = if lame_duck { "LAMEDUCK" } else { "SHUTDOWN" };
        let subject = format!("$SYS.SERVER.{}.{what}", server.server_id);
        let body = self.server_info(server);
        let mut router = self.events.lock().unwrap_or_else(|e| e.into_inner());
        self.publish(server, &mut router, subject.as_bytes(), &body);
    }

    /// A client's connect (or disconnect) event, and its account's connection count.
    pub fn client_event(&self, server: &Server, h: &ClientHandle, connect: bool) {
        let acc = h.account().clone();
        let what = if connect { "CONNECT" } else { "DISCONNECT" };
        let subject = format!("$SYS.ACCOUNT.{}.{what}", acc.name);
        let conns = format!("$SYS.ACCOUNT.{}.SERVER.CONNS", acc.name);
        let mut router = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if router.has_interest(server, conns.as_bytes()) {
            let body = self.account_conns(server, &acc);
            self.publish(server, &mut router, conns.as_bytes(), &body);
        }
        if !router.has_interest(server, subject.as_bytes()) {
            return;
        }
        let meta = h.meta.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut client = Map::new();
        if let Some(t) = meta.start {
            client.insert("start".into(), rfc3339(crate::monitor::nanos(t)).into());
        }
        if let Some(a) = meta.addr {
            client.insert("host".into(), a.ip().to_string().into());
        }
        client.insert("id".into(), h.id.into());
        client.insert("acc".into(), acc.name.clone().into());
        for (k, v) in [
            ("user", &meta.user),
            ("name", &meta.name),
            ("lang", &meta.lang),
            ("ver", &meta.version),
        ] {
            if !v.is_empty() {
                client.insert(k.into(), v.clone().into());
            }
        }
        if !connect {
            client.insert(
                "rtt".into(),
                h.stats.rtt_nanos.load(Ordering::Relaxed).into(),
            );
            client.insert("stop".into(), rfc3339(now_nanos()).into());
        }
        client.insert("name_tag".into(), acc.name.clone().into());
        client.insert("kind".into(), "Client".into());
        client.insert("client_type".into(), "nats".into());
        let mut body = json!({
            "type": if connect {
                "io.nats.server.advisory.v1.client_connect"
            } else {
                "io.nats.server.advisory.v1.client_disconnect"
            },
            "id": crate::account::random_token(22),
            "timestamp": rfc3339(now_nanos()),
            "server": self.server_info(server),
            "client": client,
        });
        if !connect {
            let st = &h.stats;
            // The client's view: what it sent is what the server received.
            body["sent"] = json!({"msgs": st.in_msgs.load(Ordering::Relaxed),
                                  "bytes": st.in_bytes.load(Ordering::Relaxed)});
            body["received"] = json!({"msgs": st.out_msgs.load(Ordering::Relaxed),
                                      "bytes": st.out_bytes.load(Ordering::Relaxed)});
            body["reason"] = crate::monitor::reason_text(h.close_reason()).into();
        }
        self.publish(server, &mut router, subject.as_bytes(), &body);
    }

    /// The `account_connections` event (also `$SYS.REQ.ACCOUNT.<acc>.CONNS`).
    fn account_conns(&self, server: &Server, acc: &Account) -> Value {
        let mut body = json!({
            "type": "io.nats.server.advisory.v1.account_connections",
            "id": crate::account::random_token(22),
            "timestamp": rfc3339(now_nanos()),
            "server": self.server_info(server),
        });
        if let (Value::Object(b), Value::Object(st)) =
            (&mut body, crate::monitor::account_statz(server, acc))
        {
            b.extend(st);
        }
        body
    }

    /// Whether a request's server filter (`server_name`, `host`, `cluster`, `domain`,
    /// `tags`) selects this server.
    fn selected(&self, server: &Server, opts: &Value) -> bool {
        let text = |k: &str| opts.get(k).and_then(Value::as_str).unwrap_or("");
        let name = text("server_name");
        let host = text("host");
        let domain = text("domain");
        (name.is_empty() || server.server_name.contains(name))
            && (host.is_empty() || server.opts.host.contains(host))
            && text("cluster").is_empty()
            && (domain.is_empty() || crate::jetstream::domain(server) == Some(domain))
            && opts.get("tags").and_then(Value::as_array).is_none_or(|t| {
                t.iter().filter_map(Value::as_str).all(|t| {
                    server
                        .opts
                        .server_tags
                        .iter()
                        .any(|h| h.eq_ignore_ascii_case(t))
                })
            })
    }

    fn handle(&self, server: &Arc<Server>, router: &mut Router, m: InMsg) {
        let Some(reply) = m.reply.clone() else { return };
        let Ok(subject) = std::str::from_utf8(&m.subject) else {
            return;
        };
        let opts: Value = if m.payload().is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(m.payload()).unwrap_or(Value::Null)
        };
        let tokens: Vec<&str> = subject.split('.').collect();
        let body = match tokens.as_slice() {
            ["$SYS", "REQ", "SERVER", "PING"] => {
                if !self.selected(server, &opts) {
                    return;
                }
                json!({"server": self.server_info(server), "statsz": sysreq::statsz(&self.ctx)})
            }
            ["$SYS", "REQ", "SERVER", who, kind] => {
                if *who == "PING" && !self.selected(server, &opts) {
                    return;
                }
                if *kind == "STATSZ" {
                    json!({"server": self.server_info(server), "statsz": sysreq::statsz(&self.ctx)})
                } else {
                    match sysreq::server(&self.ctx, kind, &opts) {
                        Some(r) => self.wrap(server, r),
                        None => return,
                    }
                }
            }
            ["$SYS", "REQ", "ACCOUNT", "PING", kind @ ("STATZ" | "CONNZ")] => {
                // Every account with connections (or the one asked for).
                let r = if *kind == "STATZ" {
                    let unused = opts
                        .get("include_unused")
                        .and_then(Value::as_bool)
                        .unwrap_or(false);
                    let wanted: Vec<String> = opts
                        .get("accounts")
                        .and_then(Value::as_array)
                        .map(|a| {
                            a.iter()
                                .filter_map(Value::as_str)
                                .map(str::to_string)
                                .collect()
                        })
                        .unwrap_or_default();
                    let list: Vec<Value> = server
                        .accounts
                        .all()
                        .iter()
                        .filter(|a| {
                            if wanted.is_empty() {
                                unused || a.conns.load(Ordering::Relaxed) > 0
                            } else {
                                wanted.contains(&a.name)
                            }
                        })
                        .map(|a| crate::monitor::account_statz(server, a))
                        .collect();
                    if list.is_empty() {
                        return;
                    }
                    Ok(json!({"server_id": server.server_id,
                              "now": rfc3339(now_nanos()), "account_statz": list}))
                } else {
                    // The requester's own account's connections.
                    let acc = server
                        .client(m.origin)
                        .map(|h| h.account().name.clone())
                        .unwrap_or_else(|| self.account.name.clone());
                    match sysreq::account(&self.ctx, &acc, "CONNZ", &opts) {
                        Some(r) => r,
                        None => return,
                    }
                };
                self.wrap(server, r)
            }
            ["$SYS", "REQ", "ACCOUNT", acc, "CONNS"] => match server.accounts.get(acc) {
                Some(a) => self.account_conns(server, &a),
                None => return,
            },
            ["$SYS", "REQ", "ACCOUNT", acc, kind] => {
                if server.accounts.get(acc).is_none() {
                    self.wrap(server, Err(format!("Account {acc} does not exist")))
                } else {
                    match sysreq::account(&self.ctx, acc, kind, &opts) {
                        Some(r) => self.wrap(server, r),
                        None => return,
                    }
                }
            }
            ["$SYS", "REQ", "USER", "INFO"] | ["$SYS", "REQ", "USER", _, "INFO"] => {
                let info = server.client(m.origin).map(|h| self.user_info(server, &h));
                self.wrap(server, info.ok_or_else(|| "no user".to_string()))
            }
            _ => return,
        };
        let data = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        router.route(
            server,
            &Outgoing {
                subject: &reply,
                reply: None,
                hdr_len: None,
                data: &data,
            },
            None,
        );
    }

    /// `{"server": ..., "data": ...}`, or the reference's error shape.
    fn wrap(&self, server: &Server, r: Result<Value, String>) -> Value {
        match r {
            Ok(data) => json!({"server": self.server_info(server), "data": data}),
            Err(e) => json!({"server": self.server_info(server), "data": null,
                             "error": {"code": 500, "description": e}}),
        }
    }

    fn user_info(&self, _server: &Server, h: &ClientHandle) -> Value {
        let meta = h.meta.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let acc = h.account().name.clone();
        let mut m = Map::new();
        m.insert("user".into(), meta.user.into());
        m.insert("account".into(), acc.clone().into());
        m.insert("account_name".into(), acc.into());
        if let Some(p) = h.permissions_opts() {
            let side = |s: &Option<crate::auth::conf::SubjectPerm>| {
                s.as_ref().map(|s| {
                    let mut o = Map::new();
                    if let Some(a) = &s.allow {
                        o.insert("allow".into(), json!(a));
                    }
                    if !s.deny.is_empty() {
                        o.insert("deny".into(), json!(s.deny));
                    }
                    Value::Object(o)
                })
            };
            let mut perms = Map::new();
            if let Some(v) = side(&p.publish) {
                perms.insert("publish".into(), v);
            }
            if let Some(v) = side(&p.subscribe) {
                perms.insert("subscribe".into(), v);
            }
            if let Some(r) = &p.response {
                perms.insert(
                    "responses".into(),
                    json!({"max": r.max, "ttl": r.expires.as_nanos() as u64}),
                );
            }
            m.insert("permissions".into(), Value::Object(perms));
        }
        Value::Object(m)
    }
}

async fn serve(sys: Arc<System>, server: Arc<Server>, mut rx: crate::inqueue::Receiver) {
    let mut router = Router::new(sys.account.clone(), 0x5353);
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, 64, 256 * 1024).await > 0 {
        for m in batch.drain(..) {
            // Monitoring answers read many small locks; off the async workers.
            let (s2, sv) = (sys.clone(), server.clone());
            let mut r = std::mem::replace(&mut router, Router::new(sys.account.clone(), 0));
            router = tokio::task::spawn_blocking(move || {
                s2.handle(&sv, &mut r, m);
                r.flush();
                r
            })
            .await
            .unwrap_or_else(|_| Router::new(sys.account.clone(), 0x5353));
        }
    }
}
