//! `/metrics`: server, JetStream, stream and consumer figures in the Prometheus text format
//! (0.0.4), encoded by prometheus-client from a snapshot taken per scrape.
//!
//! # Names
//!
//! The names are the ones prometheus-nats-exporter publishes when it scrapes nats-server
//! (`-varz` and `-jsz=all`), so dashboards and alert rules written against the exporter keep
//! working with no sidecar. Its varz collector flattens `/varz` keys under `gnatsd_varz_`;
//! its jsz collector (collector/jsz.go) uses `jetstream_{server,account,stream,consumer}_*`.
//! Everything is a gauge, as the exporter publishes it (so `rate()` over the message counters
//! works as it does there). Two series are also published under the short names operators
//! are told to alert on, with the same labels and values:
//!
//! | keel metric | exporter metric (same name unless noted) | source |
//! |---|---|---|
//! | `gnatsd_varz_connections` | = | `/varz` connections |
//! | `gnatsd_varz_total_connections` | = | `/varz` total_connections |
//! | `gnatsd_varz_subscriptions` | = | `/varz` subscriptions |
//! | `gnatsd_varz_in_msgs`, `_out_msgs`, `_in_bytes`, `_out_bytes` | = | `/varz` |
//! | `gnatsd_varz_slow_consumers` | = | `/varz` slow_consumers |
//! | `gnatsd_varz_mem` | = | `/varz` mem (resident bytes) |
//! | `gnatsd_varz_jetstream_stats_memory`, `_storage` | = | `/varz` jetstream.stats |
//! | `gnatsd_varz_jetstream_config_max_memory`, `_max_storage` | = | `/varz` jetstream.config (-1: unlimited) |
//! | `jetstream_server_jetstream_disabled` | = | `/jsz` disabled |
//! | `jetstream_server_total_streams`, `_total_consumers`, `_total_messages`, `_total_message_bytes` | = | `/jsz` |
//! | `jetstream_server_max_memory`, `_max_storage` | = | `/jsz` config (-1: unlimited) |
//! | `jetstream_account_memory_used`, `_storage_used` | = | `/jsz` account_details |
//! | `jetstream_account_max_memory`, `_max_storage` | = | account limits (-1: unlimited) |
//! | `jetstream_stream_total_messages` | = | stream state messages |
//! | `jetstream_stream_messages` | alias of `jetstream_stream_total_messages` | |
//! | `jetstream_stream_total_bytes` | = | stream state bytes |
//! | `jetstream_stream_bytes` | alias of `jetstream_stream_total_bytes` | |
//! | `jetstream_stream_first_seq`, `_last_seq`, `_consumer_count`, `_subject_count` | = | stream state |
//! | `jetstream_stream_limit_messages`, `_limit_bytes` | = | stream config max_msgs / max_bytes |
//! | `jetstream_consumer_num_ack_pending` | = | consumer num_ack_pending |
//! | `jetstream_consumer_ack_pending` | alias of `jetstream_consumer_num_ack_pending` | |
//! | `jetstream_consumer_num_pending`, `_num_redelivered`, `_num_waiting` | = | consumer info |
//! | `jetstream_consumer_delivered_stream_seq`, `_delivered_consumer_seq` | = | consumer delivered |
//! | `jetstream_consumer_ack_floor_stream_seq`, `_ack_floor_consumer_seq` | = | consumer ack_floor |
//! | `jetstream_consumer_last_delivery_seconds` | = | seconds since the last delivery (once there was one) |
//!
//! # Labels
//!
//! `server_id` on every series (the exporter's key); JetStream series add `server_name`;
//! account, stream and consumer series add `account` (`$G`); stream series add `stream_name`
//! (the exporter's) and `stream` (the same value, shorter); consumer series add
//! `consumer_name` and `consumer` likewise. The exporter's cluster/leader labels are left
//! out: a single server is always the leader.
//!
//! # Cost
//!
//! A scrape takes the stream registry's read lock once to clone the list, then each stream's
//! and each consumer's own lock briefly, one at a time, to copy its numbers; nothing is held
//! across the scrape, so publishing and delivery continue while it runs. Encoding happens
//! after the snapshot, with no lock held.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, MetricEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde_json::Value;

use super::endpoints::GLOBAL_ACCOUNT;
use crate::jetstream::stream::StorageType;
use crate::server::Server;
use crate::time::{now_nanos, parse_rfc3339};

/// Writes the current metrics of `server` to `out`.
pub fn encode_metrics(server: &Server, out: &mut String) -> std::fmt::Result {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot::take(server)));
    prometheus_client::encoding::prometheus_text::encode(out, &registry)
}

#[derive(Debug)]
struct Snapshot {
    server_id: String,
    server_name: String,
    connections: u64,
    total_connections: u64,
    subscriptions: u64,
    in_msgs: u64,
    out_msgs: u64,
    in_bytes: u64,
    out_bytes: u64,
    slow_consumers: u64,
    mem: u64,
    js: Option<JsSnapshot>,
}

#[derive(Debug)]
struct JsSnapshot {
    max_memory: i64,
    max_storage: i64,
    memory: u64,
    storage: u64,
    messages: u64,
    bytes: u64,
    streams: Vec<StreamSnap>,
    consumers: Vec<ConsumerSnap>,
}

#[derive(Debug)]
struct StreamSnap {
    name: Arc<str>,
    messages: u64,
    bytes: u64,
    first_seq: u64,
    last_seq: u64,
    consumer_count: u64,
    subject_count: u64,
    limit_messages: i64,
    limit_bytes: i64,
}

#[derive(Debug, Default)]
struct ConsumerSnap {
    stream: Arc<str>,
    name: String,
    ack_pending: u64,
    num_pending: u64,
    redelivered: u64,
    waiting: u64,
    delivered_stream: u64,
    delivered_consumer: u64,
    ack_floor_stream: u64,
    ack_floor_consumer: u64,
    last_delivery_secs: Option<f64>,
}

fn num(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

impl Snapshot {
    fn take(server: &Server) -> Snapshot {
        let t = server.totals();
        Snapshot {
            server_id: server.server_id.clone(),
            server_name: server.server_name.clone(),
            connections: server.num_clients() as u64,
            total_connections: server.total_connections(),
            subscriptions: server.sublist.count() as u64,
            in_msgs: t.in_msgs,
            out_msgs: t.out_msgs,
            in_bytes: t.in_bytes,
            out_bytes: t.out_bytes,
            slow_consumers: crate::client::SLOW_CONSUMERS.load(Ordering::Relaxed),
            mem: super::proc::rss_bytes(),
            js: server.jetstream.get().map(|js| {
                let streams = js.streams();
                let mut snap = JsSnapshot {
                    max_memory: js.max_memory,
                    max_storage: js.max_store,
                    memory: 0,
                    storage: 0,
                    messages: 0,
                    bytes: 0,
                    streams: Vec::with_capacity(streams.len()),
                    consumers: Vec::new(),
                };
                let now = now_nanos();
                for st in &streams {
                    let name: Arc<str> = Arc::from(st.name.as_str());
                    let state = st.state();
                    let cfg = st.config();
                    let consumers = st.consumer_list();
                    snap.messages += state.msgs;
                    snap.bytes += state.bytes;
                    match cfg.storage {
                        StorageType::Memory => snap.memory += state.bytes,
                        StorageType::File => snap.storage += state.bytes,
                    }
                    snap.streams.push(StreamSnap {
                        name: name.clone(),
                        messages: state.msgs,
                        bytes: state.bytes,
                        first_seq: state.first_seq,
                        last_seq: state.last_seq,
                        consumer_count: consumers.len() as u64,
                        subject_count: state.num_subjects,
                        limit_messages: cfg.max_msgs,
                        limit_bytes: cfg.max_bytes,
                    });
                    for c in consumers {
                        // One consumer's lock (and its stream's, for num_pending) at a time.
                        let info = c.info(server, false);
                        let get = |k: &str| info.get(k).unwrap_or(&Value::Null);
                        let delivered = get("delivered");
                        let floor = get("ack_floor");
                        snap.consumers.push(ConsumerSnap {
                            stream: name.clone(),
                            name: c.name.clone(),
                            ack_pending: num(get("num_ack_pending")),
                            num_pending: num(get("num_pending")),
                            redelivered: num(get("num_redelivered")),
                            waiting: num(get("num_waiting")),
                            delivered_stream: num(&delivered["stream_seq"]),
                            delivered_consumer: num(&delivered["consumer_seq"]),
                            ack_floor_stream: num(&floor["stream_seq"]),
                            ack_floor_consumer: num(&floor["consumer_seq"]),
                            last_delivery_secs: delivered["last_active"]
                                .as_str()
                                .and_then(parse_rfc3339)
                                .map(|t| (now - t).max(0) as f64 / 1e9),
                        });
                    }
                }
                snap
            }),
        }
    }
}

/// Writes one gauge family: its descriptor, then `each` writes the samples (none when there
/// are no items, and then no descriptor either).
fn family<T>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: &[T],
    mut each: impl FnMut(&mut MetricEncoder, &T) -> std::fmt::Result,
) -> std::fmt::Result {
    if items.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for it in items {
        each(&mut m, it)?;
    }
    Ok(())
}

fn sample(
    m: &mut MetricEncoder,
    labels: &impl EncodeLabelSet,
    v: impl EncodeGaugeValue,
) -> std::fmt::Result {
    m.encode_family(labels)?.encode_gauge(&v)
}

type Labels<'a, const N: usize> = [(&'static str, &'a str); N];

fn js_labels<'a>(id: &'a str, name: &'a str) -> Labels<'a, 2> {
    [("server_id", id), ("server_name", name)]
}

fn account_labels<'a>(id: &'a str, name: &'a str) -> Labels<'a, 3> {
    [
        ("server_id", id),
        ("server_name", name),
        ("account", GLOBAL_ACCOUNT),
    ]
}

fn stream_labels<'a>(id: &'a str, name: &'a str, s: &'a StreamSnap) -> Labels<'a, 5> {
    [
        ("server_id", id),
        ("server_name", name),
        ("account", GLOBAL_ACCOUNT),
        ("stream_name", &s.name),
        ("stream", &s.name),
    ]
}

fn consumer_labels<'a>(id: &'a str, name: &'a str, c: &'a ConsumerSnap) -> Labels<'a, 7> {
    [
        ("server_id", id),
        ("server_name", name),
        ("account", GLOBAL_ACCOUNT),
        ("stream_name", &c.stream),
        ("stream", &c.stream),
        ("consumer_name", &c.name),
        ("consumer", &c.name),
    ]
}

type Field<T, V> = (&'static str, &'static str, fn(&T) -> V);

const VARZ: [Field<Snapshot, u64>; 9] = [
    (
        "gnatsd_varz_connections",
        "Current client connections",
        |s| s.connections,
    ),
    (
        "gnatsd_varz_total_connections",
        "Client connections accepted since start",
        |s| s.total_connections,
    ),
    (
        "gnatsd_varz_subscriptions",
        "Subscriptions in the subject index",
        |s| s.subscriptions,
    ),
    (
        "gnatsd_varz_in_msgs",
        "Messages received from clients",
        |s| s.in_msgs,
    ),
    ("gnatsd_varz_out_msgs", "Messages sent to clients", |s| {
        s.out_msgs
    }),
    (
        "gnatsd_varz_in_bytes",
        "Payload bytes received from clients",
        |s| s.in_bytes,
    ),
    (
        "gnatsd_varz_out_bytes",
        "Payload bytes sent to clients",
        |s| s.out_bytes,
    ),
    (
        "gnatsd_varz_slow_consumers",
        "Connections closed as slow consumers",
        |s| s.slow_consumers,
    ),
    (
        "gnatsd_varz_mem",
        "Resident memory of the process in bytes",
        |s| s.mem,
    ),
];

const VARZ_JS: [Field<JsSnapshot, i64>; 4] = [
    (
        "gnatsd_varz_jetstream_stats_memory",
        "JetStream memory store bytes used",
        |j| j.memory as i64,
    ),
    (
        "gnatsd_varz_jetstream_stats_storage",
        "JetStream file store bytes used",
        |j| j.storage as i64,
    ),
    (
        "gnatsd_varz_jetstream_config_max_memory",
        "JetStream memory store limit in bytes (-1: unlimited)",
        |j| j.max_memory,
    ),
    (
        "gnatsd_varz_jetstream_config_max_storage",
        "JetStream file store limit in bytes (-1: unlimited)",
        |j| j.max_storage,
    ),
];

const JS_SERVER: [Field<JsSnapshot, i64>; 7] = [
    (
        "jetstream_server_jetstream_disabled",
        "1 when JetStream is disabled",
        |_| 0,
    ),
    ("jetstream_server_total_streams", "Streams", |j| {
        j.streams.len() as i64
    }),
    ("jetstream_server_total_consumers", "Consumers", |j| {
        j.consumers.len() as i64
    }),
    ("jetstream_server_total_messages", "Messages stored", |j| {
        j.messages as i64
    }),
    (
        "jetstream_server_total_message_bytes",
        "Bytes stored",
        |j| j.bytes as i64,
    ),
    (
        "jetstream_server_max_memory",
        "JetStream memory store limit in bytes (-1: unlimited)",
        |j| j.max_memory,
    ),
    (
        "jetstream_server_max_storage",
        "JetStream file store limit in bytes (-1: unlimited)",
        |j| j.max_storage,
    ),
];

const JS_ACCOUNT: [Field<JsSnapshot, i64>; 4] = [
    (
        "jetstream_account_memory_used",
        "Account memory store bytes used",
        |j| j.memory as i64,
    ),
    (
        "jetstream_account_storage_used",
        "Account file store bytes used",
        |j| j.storage as i64,
    ),
    (
        "jetstream_account_max_memory",
        "Account memory store limit (-1: unlimited)",
        |_| -1,
    ),
    (
        "jetstream_account_max_storage",
        "Account file store limit (-1: unlimited)",
        |_| -1,
    ),
];

const STREAM: [Field<StreamSnap, i64>; 10] = [
    (
        "jetstream_stream_total_messages",
        "Messages in the stream",
        |s| s.messages as i64,
    ),
    (
        "jetstream_stream_messages",
        "Messages in the stream (same as jetstream_stream_total_messages)",
        |s| s.messages as i64,
    ),
    ("jetstream_stream_total_bytes", "Bytes in the stream", |s| {
        s.bytes as i64
    }),
    (
        "jetstream_stream_bytes",
        "Bytes in the stream (same as jetstream_stream_total_bytes)",
        |s| s.bytes as i64,
    ),
    (
        "jetstream_stream_first_seq",
        "First sequence in the stream",
        |s| s.first_seq as i64,
    ),
    (
        "jetstream_stream_last_seq",
        "Last sequence in the stream",
        |s| s.last_seq as i64,
    ),
    (
        "jetstream_stream_consumer_count",
        "Consumers of the stream",
        |s| s.consumer_count as i64,
    ),
    (
        "jetstream_stream_subject_count",
        "Distinct subjects in the stream",
        |s| s.subject_count as i64,
    ),
    (
        "jetstream_stream_limit_messages",
        "Stream max_msgs (-1: unlimited)",
        |s| s.limit_messages,
    ),
    (
        "jetstream_stream_limit_bytes",
        "Stream max_bytes (-1: unlimited)",
        |s| s.limit_bytes,
    ),
];

const CONSUMER: [Field<ConsumerSnap, u64>; 9] = [
    (
        "jetstream_consumer_num_ack_pending",
        "Messages delivered and not yet acknowledged",
        |c| c.ack_pending,
    ),
    (
        "jetstream_consumer_ack_pending",
        "Messages delivered and not yet acknowledged (same as jetstream_consumer_num_ack_pending)",
        |c| c.ack_pending,
    ),
    (
        "jetstream_consumer_num_pending",
        "Messages in the stream the consumer has yet to deliver",
        |c| c.num_pending,
    ),
    (
        "jetstream_consumer_num_redelivered",
        "Messages delivered more than once and not yet acknowledged",
        |c| c.redelivered,
    ),
    (
        "jetstream_consumer_num_waiting",
        "Pull requests waiting for messages",
        |c| c.waiting,
    ),
    (
        "jetstream_consumer_delivered_stream_seq",
        "Stream sequence of the last delivered message",
        |c| c.delivered_stream,
    ),
    (
        "jetstream_consumer_delivered_consumer_seq",
        "Consumer sequence of the last delivery",
        |c| c.delivered_consumer,
    ),
    (
        "jetstream_consumer_ack_floor_stream_seq",
        "Stream sequence up to which every message is acknowledged",
        |c| c.ack_floor_stream,
    ),
    (
        "jetstream_consumer_ack_floor_consumer_seq",
        "Consumer sequence up to which every delivery is acknowledged",
        |c| c.ack_floor_consumer,
    ),
];

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let (id, name) = (self.server_id.as_str(), self.server_name.as_str());
        let one = [self];
        for (metric, help, f) in VARZ {
            family(&mut enc, metric, help, &one, |m, s| {
                sample(m, &[("server_id", id)], f(s))
            })?;
        }
        let Some(js) = &self.js else {
            return family(
                &mut enc,
                "jetstream_server_jetstream_disabled",
                "1 when JetStream is disabled",
                &one,
                |m, _| sample(m, &js_labels(id, name), 1u64),
            );
        };
        let jsone = [js];
        for (metric, help, f) in VARZ_JS {
            family(&mut enc, metric, help, &jsone, |m, j| {
                sample(m, &[("server_id", id)], f(j))
            })?;
        }
        for (metric, help, f) in JS_SERVER {
            family(&mut enc, metric, help, &jsone, |m, j| {
                sample(m, &js_labels(id, name), f(j))
            })?;
        }
        for (metric, help, f) in JS_ACCOUNT {
            family(&mut enc, metric, help, &jsone, |m, j| {
                sample(m, &account_labels(id, name), f(j))
            })?;
        }
        for (metric, help, f) in STREAM {
            family(&mut enc, metric, help, &js.streams, |m, s| {
                sample(m, &stream_labels(id, name, s), f(s))
            })?;
        }
        for (metric, help, f) in CONSUMER {
            family(&mut enc, metric, help, &js.consumers, |m, c| {
                sample(m, &consumer_labels(id, name, c), f(c))
            })?;
        }
        family(
            &mut enc,
            "jetstream_consumer_last_delivery_seconds",
            "Seconds since the consumer last delivered a message",
            &js.consumers,
            |m, c| match c.last_delivery_secs {
                Some(secs) => sample(m, &consumer_labels(id, name, c), secs),
                None => Ok(()),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_metrics_without_jetstream() {
        let server = Server::new(crate::config::Opts::default());
        let mut out = String::new();
        encode_metrics(&server, &mut out).unwrap();
        let id = &server.server_id;
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
        assert!(
            out.contains("jetstream_server_jetstream_disabled{"),
            "{out}"
        );
        assert!(!out.contains("jetstream_consumer"), "{out}");
    }

    #[test]
    fn consumer_family_labels() {
        let snap = ConsumerSnap {
            stream: Arc::from("S\"1"),
            name: "c".into(),
            ack_pending: 3,
            ..Default::default()
        };
        let mut out = String::new();
        let s = Snapshot {
            server_id: "ID".into(),
            server_name: "N".into(),
            connections: 0,
            total_connections: 0,
            subscriptions: 0,
            in_msgs: 0,
            out_msgs: 0,
            in_bytes: 0,
            out_bytes: 0,
            slow_consumers: 0,
            mem: 0,
            js: Some(JsSnapshot {
                max_memory: -1,
                max_storage: -1,
                memory: 0,
                storage: 0,
                messages: 0,
                bytes: 0,
                streams: vec![],
                consumers: vec![snap],
            }),
        };
        let mut registry = Registry::default();
        registry.register_collector(Box::new(s));
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap();
        let labels = r#"{server_id="ID",server_name="N",account="$G",stream_name="S\"1",stream="S\"1",consumer_name="c",consumer="c"}"#;
        assert!(
            out.contains(&format!("jetstream_consumer_ack_pending{labels} 3\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("jetstream_consumer_num_ack_pending{labels} 3\n")),
            "{out}"
        );
        assert!(
            out.contains("jetstream_server_max_memory{server_id=\"ID\",server_name=\"N\"} -1\n"),
            "{out}"
        );
        // No delivery yet: no last-delivery sample.
        assert!(
            !out.contains("jetstream_consumer_last_delivery_seconds{"),
            "{out}"
        );
    }
}
