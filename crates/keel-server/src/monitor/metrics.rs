//! `/metrics`: what prometheus-nats-exporter publishes for a nats-server, in the Prometheus
//! text format (0.0.4), encoded by prometheus-client. Keel builds the same JSON the
//! exporter would fetch from its own endpoints and turns it into series the way the
//! exporter does, so its dashboards and alert rules work with no sidecar.
//!
//! # Families (the exporter's flag in brackets)
//!
//! | prefix | from | how |
//! |---|---|---|
//! | `gnatsd_varz_*` [`-varz`] | `/varz` | every number, nested keys joined with `_` (`gnatsd_varz_jetstream_stats_memory`, `gnatsd_varz_cpu`, `gnatsd_varz_http_req_stats_varz`); `start` and `config_load_time` as epoch milliseconds; `server_id`, `server_name`, `version` as a `value` label on a sample of 1. Label `server_id`. |
//! | `gnatsd_subsz_*` [`-subz`], `gnatsd_routez_*` [`-routez`] | `/subsz`, `/routez` | every number, as for varz (`gnatsd_routez_num_routes`, `gnatsd_routez_server_id{value}`, ...) |
//! | `gnatsd_routez_route_*` | `/routez` `routes` | one series per route connection, with the names and labels of the exporter's route collector (nats-io/prometheus-nats-exporter PR "feat(routez): add metrics for route monitoring"): `route_info` (1, labels add `is_configured did_solicit compression`), `route_pending_bytes`, `route_rtt_seconds`, `route_in_msgs`, `route_out_msgs`, `route_in_bytes`, `route_out_bytes`, `route_subscriptions`, `route_uptime_seconds`, `route_idle_seconds`, `route_start_time_seconds`, `route_last_activity_seconds`; labels `server_id rid remote_id remote_name account ip port` |
//! | `gnatsd_connz_*` [`-connz`] | `/connz` | `num_connections`, `total`, `offset`, `limit`, and the sums of `pending_bytes`, `subscriptions`, `in_msgs`, `out_msgs`, `in_bytes`, `out_bytes` over the listed connections |
//! | `gnatsd_healthz_status`, `gnatsd_healthz_js_enabled_only_status`, `gnatsd_healthz_js_server_only_status` [`-healthz*`] | `/healthz` (and its two variants) | 0 when ok, 1 otherwise; `..._status_value{value="ok"}` 1 when ok |
//! | `gnatsd_accstatz_*` [`-accstatz`] | `/accstatz` | `current_connections`, `total_connections`, `subscriptions`, `leaf_nodes`, `sent_messages`, `sent_bytes`, `received_messages`, `received_bytes`, `slow_consumers`; labels `server_id`, `account`, `account_id`, `account_name` |
//! | `jetstream_server_*`, `jetstream_account_*`, `jetstream_stream_*`, `jetstream_consumer_*` [`-jsz=all`] | `/jsz?consumers=true&config=true` | the exporter's jsz collector, with its labels (below), including `jetstream_consumer_last_delivery_seconds` and `jetstream_consumer_last_ack_seconds` once there was a delivery / an ack |
//!
//! Everything is a gauge (the exporter's counters would get a `_total` suffix from
//! prometheus-client; as gauges the names stay the exporter's, and `rate()` works the same).
//! Three aliases are also published with the same labels and values:
//! `jetstream_stream_messages` (= `jetstream_stream_total_messages`),
//! `jetstream_stream_bytes` (= `jetstream_stream_total_bytes`) and
//! `jetstream_consumer_ack_pending` (= `jetstream_consumer_num_ack_pending`).
//!
//! # Labels of the JetStream families
//!
//! As the exporter's: `server_id server_name cluster domain meta_leader is_meta_leader`;
//! accounts add `account account_name account_id`; streams add those and `stream_name
//! stream_leader is_stream_leader stream_raft_group`; consumers add `consumer_name
//! consumer_leader is_consumer_leader consumer_desc`. On a single server the cluster and
//! raft labels are empty and every `is_*_leader` is `"true"`. Keel adds `stream` and
//! `consumer` (copies of `stream_name` and `consumer_name`, shorter to write).
//!
//! # Cost
//!
//! A scrape builds those JSON values the way the endpoints do: the stream registry's read
//! lock once to clone the list, then each stream's and consumer's own lock briefly, one at
//! a time; nothing is held across the scrape, so publishing and delivery continue while it
//! runs. Encoding happens afterwards, with no lock held.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde_json::Value;

use super::query::Query;
use super::{endpoints, jsz, Ctx};
use crate::time::parse_rfc3339;

/// Writes the current metrics to `out`.
pub(crate) fn encode_metrics(ctx: &Ctx, out: &mut String) -> std::fmt::Result {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Families::take(ctx)));
    prometheus_client::encoding::prometheus_text::encode(out, &registry)
}

type Labels = Vec<(String, String)>;

/// A sample value: integers print exactly, the rest as floats.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Num {
    Int(i64),
    Float(f64),
}

impl Num {
    fn of(v: &Value) -> Option<Num> {
        if let Some(i) = v.as_i64() {
            Some(Num::Int(i))
        } else {
            v.as_f64().map(Num::Float)
        }
    }
}

#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    samples: Vec<(Labels, Num)>,
}

/// Every family of one scrape, in the order they were first added.
#[derive(Debug, Default)]
struct Families {
    list: Vec<Family>,
    index: std::collections::HashMap<String, usize>,
}

impl Families {
    fn add(&mut self, name: &str, help: &str, labels: Labels, v: Num) {
        let i = match self.index.get(name) {
            Some(&i) => i,
            None => {
                self.list.push(Family {
                    name: name.to_string(),
                    help: help.to_string(),
                    samples: Vec::new(),
                });
                self.index.insert(name.to_string(), self.list.len() - 1);
                self.list.len() - 1
            }
        };
        self.list[i].samples.push((labels, v));
    }

    /// The exporter's generic collector: every number of `v` under `prefix`, nested keys
    /// joined with `_` (slashes too, runs of `_` collapsed); RFC 3339 times among `start` and
    /// `config_load_time` as epoch milliseconds; the identity strings as a `value` label.
    fn flatten(&mut self, prefix: &str, path: &mut Vec<String>, v: &Value, id: &str) {
        const LABEL_KEYS: [&str; 8] = [
            "server_id",
            "server_name",
            "version",
            "domain",
            "leader",
            "name",
            "start",
            "config_load_time",
        ];
        // As the exporter's collector, which leaves these out.
        const SKIP: [&str; 9] = [
            "leaf",
            "trusted_operators_claim",
            "cluster_tls_timeout",
            "cluster_cluster_port",
            "cluster_auth_timeout",
            "gateway_port",
            "gateway_auth_timeout",
            "gateway_tls_timeout",
            "gateway_connect_retries",
        ];
        let Value::Object(m) = v else { return };
        for (k, x) in m {
            path.push(k.clone());
            let fq = fq_name(path);
            if !SKIP.contains(&fq.as_str()) {
                let name = format!("{prefix}_{fq}");
                let server = vec![("server_id".to_string(), id.to_string())];
                match x {
                    Value::Number(_) => {
                        if let Some(n) = Num::of(x) {
                            self.add(&name, &help_for(&name), server, n);
                        }
                    }
                    Value::String(text) if LABEL_KEYS.contains(&k.as_str()) => {
                        match parse_rfc3339(text) {
                            Some(ns) => {
                                self.add(&name, &help_for(&name), server, Num::Int(ns / 1_000_000))
                            }
                            None => {
                                let mut l = server;
                                l.push(("value".into(), text.clone()));
                                self.add(&name, &help_for(&name), l, Num::Int(1));
                            }
                        }
                    }
                    Value::Object(_) => self.flatten(prefix, path, x, id),
                    _ => {}
                }
            }
            path.pop();
        }
    }

    fn take(ctx: &Ctx) -> Families {
        let s = &ctx.server;
        let id = s.server_id.as_str();
        let mut f = Families::default();
        let none = Query::default();
        if let Ok(v) = endpoints::varz(ctx, &none) {
            f.flatten("gnatsd_varz", &mut Vec::new(), &v, id);
        }
        if let Ok(v) = endpoints::subsz(ctx, &none) {
            f.flatten("gnatsd_subsz", &mut Vec::new(), &v, id);
        }
        if let Ok(v) = endpoints::routez(ctx, &none) {
            f.flatten("gnatsd_routez", &mut Vec::new(), &v, id);
            f.routes(&v, id);
        }
        f.connz(ctx, id);
        f.healthz(ctx, id);
        f.accstatz(ctx, id);
        f.jsz(ctx, id);
        f.raft(ctx, id);
        f
    }

    /// Clustered JetStream: each Raft group this server is in (the meta group and its
    /// replicated streams): role, term, log and applied index, each follower's lag on the
    /// leader; and per durable consumer of a replicated stream, how far each follower's
    /// copy of the ack floor trails the leader's, in sequences and in seconds.
    fn raft(&mut self, ctx: &Ctx, id: &str) {
        let Some(jss) = ctx.server.jetstream_enabled() else {
            return;
        };
        let Some(meta) = jss.meta.get() else {
            return;
        };
        let mut groups = vec![(
            String::new(),
            String::new(),
            crate::jetstream::cluster::META_GROUP.to_string(),
            meta.raft(),
        )];
        for js in jss.all() {
            for s in js.streams() {
                let (Some(spec), Some(r)) = (s.group.as_ref(), s.replica.get()) else {
                    continue;
                };
                let Some(raft) = r.raft.get() else { continue };
                groups.push((
                    js.account.name.clone(),
                    s.name.clone(),
                    spec.group.clone(),
                    raft.clone(),
                ));
                for c in js.consumers_of(&s.name) {
                    let floor = c.ack_floor();
                    for (peer, seqs, secs) in r.ack_floor_lag(&c.name, floor) {
                        let labels: Labels = vec![
                            ("server_id".into(), id.into()),
                            ("account".into(), js.account.name.clone()),
                            ("stream_name".into(), s.name.clone()),
                            ("consumer_name".into(), c.name.clone()),
                            ("peer".into(), peer),
                        ];
                        self.add(
                            "keel_consumer_ack_floor_lag_sequences",
                            "How many stream sequences a follower's copy of the consumer's ack floor trails the leader's",
                            labels.clone(),
                            Num::Int(seqs as i64),
                        );
                        self.add(
                            "keel_consumer_ack_floor_lag_seconds",
                            "How long ago the leader had the ack floor a follower's copy still lacks",
                            labels,
                            Num::Float(secs),
                        );
                    }
                }
            }
        }
        for (account, stream, group, raft) in groups {
            let m = raft.metrics().borrow().clone();
            let labels: Labels = vec![
                ("server_id".into(), id.into()),
                ("account".into(), account),
                ("stream_name".into(), stream),
                ("raft_group".into(), group),
            ];
            let leader = m.state == openraft::ServerState::Leader;
            for (name, help, v) in [
                (
                    "keel_raft_group_leader",
                    "1 on the group's leader",
                    leader as i64,
                ),
                (
                    "keel_raft_group_term",
                    "The group's current term",
                    m.current_term as i64,
                ),
                (
                    "keel_raft_group_last_log_index",
                    "Index of the last entry in this server's log of the group",
                    m.last_log_index.unwrap_or(0) as i64,
                ),
                (
                    "keel_raft_group_applied_index",
                    "Index of the last entry this server applied",
                    m.last_applied.map_or(0, |l| l.index) as i64,
                ),
                (
                    "keel_raft_group_state",
                    "This server's role in the group: 0 learner, 1 follower, 2 candidate, 3 leader, 4 stopped",
                    match m.state {
                        openraft::ServerState::Learner => 0,
                        openraft::ServerState::Follower => 1,
                        openraft::ServerState::Candidate => 2,
                        openraft::ServerState::Leader => 3,
                        openraft::ServerState::Shutdown => 4,
                    },
                ),
            ] {
                self.add(name, help, labels.clone(), Num::Int(v));
            }
            if let Some(ms) = m.millis_since_quorum_ack.filter(|_| leader) {
                self.add(
                    "keel_raft_group_quorum_ack_age_milliseconds",
                    "On the leader: how long ago a quorum last confirmed it (over 3 s: it counts as no leader)",
                    labels.clone(),
                    Num::Int(ms as i64),
                );
            }
            if let Some(rep) = m.replication.as_ref() {
                let last = m.last_log_index.unwrap_or(0);
                for (peer, matched) in rep {
                    let name = crate::jetstream::raft::member_name(&m, *peer).unwrap_or_default();
                    let mut l = labels.clone();
                    l.push(("peer".into(), name));
                    self.add(
                        "keel_raft_group_follower_lag_entries",
                        "On the leader: how many log entries a follower has not yet confirmed",
                        l,
                        Num::Int(last.saturating_sub(matched.map_or(0, |x| x.index)) as i64),
                    );
                }
            }
        }
    }

    /// One series per route connection of `/routez`.
    fn routes(&mut self, v: &Value, id: &str) {
        let text = |x: &Value| match x {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        };
        let secs = |x: &Value| {
            crate::time::parse_go_duration(x.as_str().unwrap_or_default())
                .map_or(Num::Int(0), |ns| Num::Float(ns as f64 / 1e9))
        };
        let epoch = |x: &Value| {
            parse_rfc3339(x.as_str().unwrap_or_default())
                .map_or(Num::Int(0), |ns| Num::Int(ns / 1_000_000_000))
        };
        for r in v["routes"].as_array().into_iter().flatten() {
            let base: Labels = vec![
                ("server_id".into(), id.into()),
                ("rid".into(), text(&r["rid"])),
                ("remote_id".into(), text(&r["remote_id"])),
                ("remote_name".into(), text(&r["remote_name"])),
                ("account".into(), text(&r["account"])),
                ("ip".into(), text(&r["ip"])),
                ("port".into(), text(&r["port"])),
            ];
            let mut info = base.clone();
            info.push(("is_configured".into(), text(&r["is_configured"])));
            info.push(("did_solicit".into(), text(&r["did_solicit"])));
            info.push(("compression".into(), text(&r["compression"])));
            self.add(
                "gnatsd_routez_route_info",
                "Route connection information.",
                info,
                Num::Int(1),
            );
            let n = |x: &Value| Num::of(x).unwrap_or(Num::Int(0));
            for (name, help, value) in [
                (
                    "route_pending_bytes",
                    "Bytes pending on the route connection.",
                    n(&r["pending_size"]),
                ),
                (
                    "route_rtt_seconds",
                    "Round-trip time of the route connection in seconds.",
                    secs(&r["rtt"]),
                ),
                (
                    "route_in_msgs",
                    "Messages received from the route connection.",
                    n(&r["in_msgs"]),
                ),
                (
                    "route_out_msgs",
                    "Messages sent to the route connection.",
                    n(&r["out_msgs"]),
                ),
                (
                    "route_in_bytes",
                    "Bytes received from the route connection.",
                    n(&r["in_bytes"]),
                ),
                (
                    "route_out_bytes",
                    "Bytes sent to the route connection.",
                    n(&r["out_bytes"]),
                ),
                (
                    "route_subscriptions",
                    "Subscriptions on the route connection.",
                    n(&r["subscriptions"]),
                ),
                (
                    "route_uptime_seconds",
                    "Uptime of the route connection in seconds.",
                    secs(&r["uptime"]),
                ),
                (
                    "route_idle_seconds",
                    "Idle time of the route connection in seconds.",
                    secs(&r["idle"]),
                ),
                (
                    "route_start_time_seconds",
                    "Start time of the route connection in Unix seconds.",
                    epoch(&r["start"]),
                ),
                (
                    "route_last_activity_seconds",
                    "Last activity time of the route connection in Unix seconds.",
                    epoch(&r["last_activity"]),
                ),
            ] {
                self.add(&format!("gnatsd_routez_{name}"), help, base.clone(), value);
            }
        }
    }

    fn connz(&mut self, ctx: &Ctx, id: &str) {
        let Ok(v) = endpoints::connz(ctx, &Query::default()) else {
            return;
        };
        let server = || vec![("server_id".to_string(), id.to_string())];
        for k in ["num_connections", "total", "offset", "limit"] {
            if let Some(n) = Num::of(&v[k]) {
                self.add(&format!("gnatsd_connz_{k}"), k, server(), n);
            }
        }
        let conns = v["connections"].as_array().cloned().unwrap_or_default();
        for k in [
            "pending_bytes",
            "subscriptions",
            "in_bytes",
            "out_bytes",
            "in_msgs",
            "out_msgs",
        ] {
            let sum: i64 = conns.iter().filter_map(|c| c[k].as_i64()).sum();
            self.add(&format!("gnatsd_connz_{k}"), k, server(), Num::Int(sum));
        }
    }

    fn healthz(&mut self, ctx: &Ctx, id: &str) {
        for (name, enabled_only, server_only) in [
            ("gnatsd_healthz", false, false),
            ("gnatsd_healthz_js_enabled_only", true, false),
            ("gnatsd_healthz_js_server_only", false, true),
        ] {
            let probe = endpoints::Probe {
                js_enabled_only: enabled_only,
                js_server_only: server_only,
                account: "",
                stream: "",
                consumer: "",
            };
            let status = match endpoints::health(&ctx.server, &probe) {
                Ok(()) => "ok",
                Err(e) if e.status == 400 => "error",
                Err(_) => "unavailable",
            };
            let ok = status == "ok";
            let server = vec![("server_id".to_string(), id.to_string())];
            self.add(
                &format!("{name}_status"),
                "0 when /healthz answers ok, 1 otherwise",
                server.clone(),
                Num::Int(i64::from(!ok)),
            );
            let mut l = server;
            l.push(("value".into(), status.into()));
            self.add(
                &format!("{name}_status_value"),
                "1 when /healthz answers ok; the status text in label value",
                l,
                Num::Int(i64::from(ok)),
            );
        }
    }

    fn accstatz(&mut self, ctx: &Ctx, id: &str) {
        let Ok(v) = endpoints::accstatz(ctx, &Query::parse("unused=1")) else {
            return;
        };
        for acc in v["account_statz"].as_array().cloned().unwrap_or_default() {
            let a = acc["acc"].as_str().unwrap_or_default().to_string();
            let labels = vec![
                ("server_id".to_string(), id.to_string()),
                ("account".into(), a.clone()),
                ("account_id".into(), a),
                (
                    "account_name".into(),
                    acc["name"].as_str().unwrap_or_default().into(),
                ),
            ];
            for (name, v, help) in [
                (
                    "current_connections",
                    &acc["conns"],
                    "Client connections of the account",
                ),
                (
                    "total_connections",
                    &acc["total_conns"],
                    "Client and leaf connections of the account",
                ),
                (
                    "subscriptions",
                    &acc["num_subscriptions"],
                    "Subscriptions of the account",
                ),
                (
                    "leaf_nodes",
                    &acc["leafnodes"],
                    "Leaf node connections of the account",
                ),
                (
                    "sent_messages",
                    &acc["sent"]["msgs"],
                    "Messages sent to the account's clients",
                ),
                (
                    "sent_bytes",
                    &acc["sent"]["bytes"],
                    "Bytes sent to the account's clients",
                ),
                (
                    "received_messages",
                    &acc["received"]["msgs"],
                    "Messages received from the account's clients",
                ),
                (
                    "received_bytes",
                    &acc["received"]["bytes"],
                    "Bytes received from the account's clients",
                ),
                (
                    "slow_consumers",
                    &acc["slow_consumers"],
                    "Slow consumers of the account",
                ),
            ] {
                self.add(
                    &format!("gnatsd_accstatz_{name}"),
                    help,
                    labels.clone(),
                    Num::of(v).unwrap_or(Num::Int(0)),
                );
            }
        }
    }

    /// The exporter's jsz collector over `/jsz?consumers=true&config=true`.
    fn jsz(&mut self, ctx: &Ctx, id: &str) {
        let Ok(v) = jsz::jsz(ctx, &Query::parse("consumers=true&config=true")) else {
            return;
        };
        let name = ctx.server.server_name.clone();
        let server: Labels = vec![
            ("server_id".into(), id.into()),
            ("server_name".into(), name.clone()),
            ("cluster".into(), String::new()),
            ("domain".into(), String::new()),
            ("meta_leader".into(), String::new()),
            ("is_meta_leader".into(), "true".into()),
        ];
        let disabled = v["disabled"].as_bool().unwrap_or(false);
        self.add(
            "jetstream_server_jetstream_disabled",
            "JetStream disabled or not",
            server.clone(),
            Num::Int(i64::from(disabled)),
        );
        if disabled {
            return;
        }
        let n = |x: &Value| Num::of(x).unwrap_or(Num::Int(0));
        for (metric, x, help) in [
            (
                "jetstream_server_max_memory",
                &v["config"]["max_memory"],
                "JetStream max memory",
            ),
            (
                "jetstream_server_max_storage",
                &v["config"]["max_storage"],
                "JetStream max storage",
            ),
            (
                "jetstream_server_total_streams",
                &v["streams"],
                "Total number of streams in JetStream",
            ),
            (
                "jetstream_server_total_consumers",
                &v["consumers"],
                "Total number of consumers in JetStream",
            ),
            (
                "jetstream_server_total_messages",
                &v["messages"],
                "Total number of stored messages in JetStream",
            ),
            (
                "jetstream_server_total_message_bytes",
                &v["bytes"],
                "Total number of bytes stored in JetStream",
            ),
        ] {
            self.add(metric, help, server.clone(), n(x));
        }
        for acc in v["account_details"].as_array().into_iter().flatten() {
            let a = acc["name"].as_str().unwrap_or_default().to_string();
            let mut account = server.clone();
            account.push(("account".into(), a.clone()));
            account.push(("account_name".into(), a.clone()));
            account.push((
                "account_id".into(),
                acc["id"].as_str().unwrap_or_default().into(),
            ));
            for (metric, x, help) in [
                (
                    "jetstream_account_max_storage",
                    &acc["reserved_storage"],
                    "JetStream max storage in bytes",
                ),
                (
                    "jetstream_account_max_memory",
                    &acc["reserved_memory"],
                    "JetStream max memory in bytes",
                ),
                (
                    "jetstream_account_storage_used",
                    &acc["storage"],
                    "Total storage used in bytes",
                ),
                (
                    "jetstream_account_memory_used",
                    &acc["memory"],
                    "Total memory used in bytes",
                ),
            ] {
                self.add(metric, help, account.clone(), n(x));
            }
            for st in acc["stream_detail"].as_array().into_iter().flatten() {
                self.stream(st, &account, &name);
            }
        }
    }

    fn stream(&mut self, st: &Value, account: &Labels, server_name: &str) {
        let n = |x: &Value| Num::of(x).unwrap_or(Num::Int(0));
        let stream_name = st["name"].as_str().unwrap_or_default().to_string();
        let leader = st["cluster"]["leader"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let is_leader = leader.is_empty() || leader == server_name;
        let mut labels = account.clone();
        labels.push(("stream_name".into(), stream_name.clone()));
        labels.push(("stream_leader".into(), leader));
        labels.push(("is_stream_leader".into(), is_leader.to_string()));
        labels.push(("stream_raft_group".into(), String::new()));
        let mut with_alias = labels.clone();
        with_alias.push(("stream".into(), stream_name));
        let state = &st["state"];
        for (metric, x, help) in [
            (
                "jetstream_stream_total_messages",
                &state["messages"],
                "Total number of messages from a stream",
            ),
            (
                "jetstream_stream_messages",
                &state["messages"],
                "Same as jetstream_stream_total_messages",
            ),
            (
                "jetstream_stream_total_bytes",
                &state["bytes"],
                "Total stored bytes from a stream",
            ),
            (
                "jetstream_stream_bytes",
                &state["bytes"],
                "Same as jetstream_stream_total_bytes",
            ),
            (
                "jetstream_stream_first_seq",
                &state["first_seq"],
                "First sequence from a stream",
            ),
            (
                "jetstream_stream_last_seq",
                &state["last_seq"],
                "Last sequence from a stream",
            ),
            (
                "jetstream_stream_consumer_count",
                &state["consumer_count"],
                "Total number of consumers from a stream",
            ),
            (
                "jetstream_stream_subject_count",
                &state["num_subjects"],
                "Total number of subjects in a stream",
            ),
            (
                "jetstream_stream_limit_bytes",
                &st["config"]["max_bytes"],
                "The maximum configured storage limit (in bytes) of a stream (-1: unlimited)",
            ),
            (
                "jetstream_stream_limit_messages",
                &st["config"]["max_msgs"],
                "The maximum number of messages allowed in a stream (-1: unlimited)",
            ),
        ] {
            if !x.is_null() {
                self.add(metric, help, with_alias.clone(), n(x));
            }
        }
        for c in st["consumer_detail"].as_array().into_iter().flatten() {
            let cname = c["name"].as_str().unwrap_or_default().to_string();
            let mut cl = labels.clone();
            cl.push(("consumer_name".into(), cname.clone()));
            cl.push(("consumer_leader".into(), String::new()));
            cl.push(("is_consumer_leader".into(), "true".into()));
            cl.push((
                "consumer_desc".into(),
                c["config"]["description"]
                    .as_str()
                    .unwrap_or_default()
                    .into(),
            ));
            cl.push(("stream".into(), labels[labels.len() - 4].1.clone()));
            cl.push(("consumer".into(), cname));
            let ts = c["ts"].as_str().and_then(parse_rfc3339);
            let since = |x: &Value| -> Option<Num> {
                let t = parse_rfc3339(x.as_str()?)?;
                Some(Num::Float((ts? - t) as f64 / 1e9))
            };
            if let Some(secs) = since(&c["delivered"]["last_active"]) {
                self.add(
                    "jetstream_consumer_last_delivery_seconds",
                    "Seconds since the last message was delivered",
                    cl.clone(),
                    secs,
                );
            }
            if let Some(secs) = since(&c["ack_floor"]["last_active"]) {
                self.add(
                    "jetstream_consumer_last_ack_seconds",
                    "Seconds since the last acknowledgement",
                    cl.clone(),
                    secs,
                );
            }
            for (metric, x, help) in [
                (
                    "jetstream_consumer_delivered_consumer_seq",
                    &c["delivered"]["consumer_seq"],
                    "Latest sequence number of a stream consumer",
                ),
                (
                    "jetstream_consumer_delivered_stream_seq",
                    &c["delivered"]["stream_seq"],
                    "Latest sequence number of a stream",
                ),
                (
                    "jetstream_consumer_num_ack_pending",
                    &c["num_ack_pending"],
                    "Number of pending acks from a consumer",
                ),
                (
                    "jetstream_consumer_ack_pending",
                    &c["num_ack_pending"],
                    "Same as jetstream_consumer_num_ack_pending",
                ),
                (
                    "jetstream_consumer_num_redelivered",
                    &c["num_redelivered"],
                    "Number of redelivered messages from a consumer",
                ),
                (
                    "jetstream_consumer_num_waiting",
                    &c["num_waiting"],
                    "Number of inflight fetch requests from a pull consumer",
                ),
                (
                    "jetstream_consumer_num_pending",
                    &c["num_pending"],
                    "Number of pending messages from a consumer",
                ),
                (
                    "jetstream_consumer_ack_floor_stream_seq",
                    &c["ack_floor"]["stream_seq"],
                    "Number of ack floor stream seq from a consumer",
                ),
                (
                    "jetstream_consumer_ack_floor_consumer_seq",
                    &c["ack_floor"]["consumer_seq"],
                    "Number of ack floor consumer seq from a consumer",
                ),
            ] {
                self.add(metric, help, cl.clone(), n(x));
            }
        }
    }
}

/// The exporter's metric-name rule for nested keys.
fn fq_name(path: &[String]) -> String {
    let mut s = path.join("_").replace('/', "_");
    while s.contains("__") {
        s = s.replace("__", "_");
    }
    s.trim_matches('_').to_string()
}

/// Help text for the varz-style families (the exporter uses the name itself).
fn help_for(name: &str) -> String {
    let known = [
        ("gnatsd_varz_connections", "Current client connections"),
        (
            "gnatsd_varz_total_connections",
            "Client connections accepted since start",
        ),
        (
            "gnatsd_varz_subscriptions",
            "Subscriptions in the subject index",
        ),
        ("gnatsd_varz_in_msgs", "Messages received from clients"),
        ("gnatsd_varz_out_msgs", "Messages sent to clients"),
        (
            "gnatsd_varz_in_bytes",
            "Payload bytes received from clients",
        ),
        ("gnatsd_varz_out_bytes", "Payload bytes sent to clients"),
        (
            "gnatsd_varz_slow_consumers",
            "Connections closed as slow consumers",
        ),
        ("gnatsd_varz_mem", "Resident memory of the process in bytes"),
        (
            "gnatsd_varz_cpu",
            "CPU use of the process in percent of one core",
        ),
        ("gnatsd_varz_start", "Server start, epoch milliseconds"),
        (
            "gnatsd_varz_jetstream_stats_memory",
            "JetStream memory store bytes used",
        ),
        (
            "gnatsd_varz_jetstream_stats_storage",
            "JetStream file store bytes used",
        ),
        (
            "gnatsd_varz_jetstream_config_max_memory",
            "JetStream memory store limit in bytes",
        ),
        (
            "gnatsd_varz_jetstream_config_max_storage",
            "JetStream file store limit in bytes",
        ),
    ];
    known.iter().find(|(n, _)| *n == name).map_or_else(
        || name.trim_start_matches("gnatsd_").to_string(),
        |(_, h)| h.to_string(),
    )
}

impl Collector for Families {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        for fam in &self.list {
            let mut m = enc.encode_descriptor(&fam.name, &fam.help, None, MetricType::Gauge)?;
            for (labels, v) in &fam.samples {
                let mut e = m.encode_family(labels)?;
                match *v {
                    Num::Int(i) => e.encode_gauge(&i)?,
                    Num::Float(f) => e.encode_gauge(&f)?,
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::Server;

    fn scrape(server: std::sync::Arc<Server>) -> String {
        let ctx = Ctx::new(server, 8222);
        let mut out = String::new();
        encode_metrics(&ctx, &mut out).unwrap();
        out
    }

    #[test]
    fn server_metrics_without_jetstream() {
        let server = Server::new(crate::config::Opts::default(), crate::log::Log::stderr());
        let id = server.server_id.clone();
        let out = scrape(server);
        assert!(
            out.contains("# TYPE gnatsd_varz_connections gauge\n"),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "gnatsd_varz_connections{{server_id=\"{id}\"}} 0\n"
            )),
            "{out}"
        );
        for name in [
            "gnatsd_varz_cpu{",
            "gnatsd_varz_start{",
            "gnatsd_varz_max_payload{",
            "gnatsd_varz_slow_consumer_stats_clients{",
            "gnatsd_subsz_num_subscriptions{",
            "gnatsd_routez_num_routes{",
            "gnatsd_connz_total{",
            "gnatsd_accstatz_current_connections{",
            "jetstream_server_jetstream_disabled{",
        ] {
            assert!(out.contains(name), "{name} missing: {out}");
        }
        assert!(
            out.contains(&format!(
                "gnatsd_varz_version{{server_id=\"{id}\",value=\"{}\"}} 1\n",
                crate::config::COMPAT_VERSION
            )),
            "{out}"
        );
        assert!(
            out.contains(&format!("gnatsd_healthz_status{{server_id=\"{id}\"}} 0\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "gnatsd_healthz_status_value{{server_id=\"{id}\",value=\"ok\"}} 1\n"
            )),
            "{out}"
        );
        assert!(!out.contains("jetstream_consumer"), "{out}");
    }

    #[test]
    fn names_follow_the_exporter() {
        let p = |v: &[&str]| fq_name(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(p(&["http_req_stats", "/varz"]), "http_req_stats_varz");
        assert_eq!(
            p(&["jetstream", "stats", "api", "level"]),
            "jetstream_stats_api_level"
        );
        let mut f = Families::default();
        f.flatten(
            "gnatsd_varz",
            &mut Vec::new(),
            &serde_json::json!({"a": {"b": 2, "ok": true}, "start": "1970-01-01T00:00:01Z",
                                "name": "n", "other": "x", "leaf": {"x": 1}}),
            "ID",
        );
        let names: Vec<&str> = f.list.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(
            names,
            ["gnatsd_varz_a_b", "gnatsd_varz_start", "gnatsd_varz_name"]
        );
        assert_eq!(f.list[1].samples[0].1, Num::Int(1000));
        assert_eq!(
            f.list[2].samples[0].0[1],
            ("value".to_string(), "n".to_string())
        );
    }
}
