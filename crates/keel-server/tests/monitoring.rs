//! Monitoring over HTTP (`-m` / `http_port`): every endpoint's JSON against the key sets of
//! the reference's captures (`shared/reference/captures/monitoring/endpoints.json`, embedded
//! below so the test does not need `shared/`), paging / sorting / subscription detail,
//! `/healthz`, the reference's 400 texts for malformed queries and its 404, and `/metrics`
//! (keel only: the reference has no Prometheus endpoint, so those assertions are skipped
//! with `is_reference()`, and the reference run checks the same numbers through `/jsz`).
//!
//! Servers start through the shared harness with a config file: `http_port: -1` (a free port,
//! read back from the "Starting http monitor on" log line so no port can be raced) and, for
//! JetStream, `jetstream { store_dir }` in a temp dir. HTTP is a minimal GET over a tokio
//! `TcpStream` (HTTP/1.1, `Connection: close`, chunked bodies decoded): no client crate.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use async_nats::Client;
use bytes::Bytes;
use common::{
    http_get, is_reference, json_request, json_request_within, within, Http, Server, TempDir, STEP,
};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const API: &str = "$JS.API";

// ---------------------------------------------------------------------------
// Reference key sets: `path:type` (o object, a array, s string, n number, b bool) of every
// key in the captured responses, array elements as `[]`. Subtrees that belong to the
// JetStream API's own shapes (stream/consumer config and state, delivered/ack_floor) and
// free-form maps (http_req_stats) are compared at their root only.
// ---------------------------------------------------------------------------

/// `/varz`
const VARZ: &[&str] = &[
    "server_id:s",
    "server_name:s",
    "version:s",
    "proto:n",
    "git_commit:s",
    "go:s",
    "host:s",
    "port:n",
    "max_connections:n",
    "ping_interval:n",
    "ping_max:n",
    "http_host:s",
    "http_port:n",
    "http_base_path:s",
    "https_port:n",
    "auth_timeout:n",
    "max_control_line:n",
    "max_payload:n",
    "max_pending:n",
    "cluster:o",
    "gateway:o",
    "leaf:o",
    "mqtt:o",
    "websocket:o",
    "jetstream:o",
    "jetstream.config:o",
    "jetstream.config.max_memory:n",
    "jetstream.config.max_storage:n",
    "jetstream.config.store_dir:s",
    "jetstream.config.sync_interval:n",
    "jetstream.config.strict:b",
    "jetstream.stats:o",
    "jetstream.stats.memory:n",
    "jetstream.stats.storage:n",
    "jetstream.stats.reserved_memory:n",
    "jetstream.stats.reserved_storage:n",
    "jetstream.stats.accounts:n",
    "jetstream.stats.ha_assets:n",
    "jetstream.stats.api:o",
    "jetstream.stats.api.level:n",
    "jetstream.stats.api.total:n",
    "jetstream.stats.api.errors:n",
    "jetstream.limits:o",
    "jetstream.limits.default_max_consumers:n",
    "tls_timeout:n",
    "write_deadline:n",
    "start:s",
    "now:s",
    "uptime:s",
    "mem:n",
    "cores:n",
    "gomaxprocs:n",
    "cpu:n",
    "connections:n",
    "total_connections:n",
    "routes:n",
    "remotes:n",
    "leafnodes:n",
    "in_msgs:n",
    "in_bytes:n",
    "in_client_msgs:n",
    "in_client_bytes:n",
    "out_msgs:n",
    "out_bytes:n",
    "out_client_msgs:n",
    "out_client_bytes:n",
    "slow_consumers:n",
    "stale_connections:n",
    "stalled_clients:n",
    "subscriptions:n",
    "http_req_stats:o",
    "config_load_time:s",
    "config_digest:s",
    "feature_flags:o",
    "feature_flags.js_ack_fc_v2:b",
    "feature_flags.js_api_reply_v2:b",
    "feature_flags.js_raft_delete_range:b",
    "feature_flags.js_snapshot_sources:b",
    "system_account:s",
    "slow_consumer_stats:o",
    "slow_consumer_stats.clients:n",
    "slow_consumer_stats.routes:n",
    "slow_consumer_stats.gateways:n",
    "slow_consumer_stats.leafs:n",
    "stale_connection_stats:o",
    "stale_connection_stats.clients:n",
    "stale_connection_stats.routes:n",
    "stale_connection_stats.gateways:n",
    "stale_connection_stats.leafs:n",
    "disk_io_wait_stats:o",
    "disk_io_wait_stats.waiters:n",
    "disk_io_wait_stats.waits:n",
    "disk_io_wait_stats.wait_time:n",
    "disk_io_wait_stats.max_wait_time:n",
];
/// `/connz`
const CONNZ: &[&str] = &[
    "server_id:s",
    "now:s",
    "num_connections:n",
    "total:n",
    "offset:n",
    "limit:n",
    "connections:a",
    "connections[].cid:n",
    "connections[].kind:s",
    "connections[].type:s",
    "connections[].ip:s",
    "connections[].port:n",
    "connections[].start:s",
    "connections[].last_activity:s",
    "connections[].rtt:s",
    "connections[].uptime:s",
    "connections[].idle:s",
    "connections[].pending_bytes:n",
    "connections[].in_msgs:n",
    "connections[].out_msgs:n",
    "connections[].in_bytes:n",
    "connections[].out_bytes:n",
    "connections[].subscriptions:n",
    "connections[].name:s",
    "connections[].lang:s",
    "connections[].version:s",
];
/// `/connz?subs=1`
const CONNZ_SUBS: &[&str] = &[
    "server_id:s",
    "now:s",
    "num_connections:n",
    "total:n",
    "offset:n",
    "limit:n",
    "connections:a",
    "connections[].cid:n",
    "connections[].kind:s",
    "connections[].type:s",
    "connections[].ip:s",
    "connections[].port:n",
    "connections[].start:s",
    "connections[].last_activity:s",
    "connections[].rtt:s",
    "connections[].uptime:s",
    "connections[].idle:s",
    "connections[].pending_bytes:n",
    "connections[].in_msgs:n",
    "connections[].out_msgs:n",
    "connections[].in_bytes:n",
    "connections[].out_bytes:n",
    "connections[].subscriptions:n",
    "connections[].name:s",
    "connections[].lang:s",
    "connections[].version:s",
    "connections[].subscriptions_list:a",
];
/// `/jsz`
const JSZ: &[&str] = &[
    "memory:n",
    "storage:n",
    "reserved_memory:n",
    "reserved_storage:n",
    "accounts:n",
    "ha_assets:n",
    "api:o",
    "api.level:n",
    "api.total:n",
    "api.errors:n",
    "server_id:s",
    "now:s",
    "config:o",
    "config.max_memory:n",
    "config.max_storage:n",
    "config.store_dir:s",
    "config.sync_interval:n",
    "config.strict:b",
    "limits:o",
    "limits.default_max_consumers:n",
    "streams:n",
    "consumers:n",
    "messages:n",
    "bytes:n",
    "total:n",
];
/// `/jsz?streams=1&consumers=1&config=1`
const JSZ_DETAIL: &[&str] = &[
    "memory:n",
    "storage:n",
    "reserved_memory:n",
    "reserved_storage:n",
    "accounts:n",
    "ha_assets:n",
    "api:o",
    "api.level:n",
    "api.total:n",
    "api.errors:n",
    "server_id:s",
    "now:s",
    "config:o",
    "config.max_memory:n",
    "config.max_storage:n",
    "config.store_dir:s",
    "config.sync_interval:n",
    "config.strict:b",
    "limits:o",
    "limits.default_max_consumers:n",
    "streams:n",
    "consumers:n",
    "messages:n",
    "bytes:n",
    "account_details:a",
    "account_details[].name:s",
    "account_details[].id:s",
    "account_details[].memory:n",
    "account_details[].storage:n",
    "account_details[].reserved_memory:n",
    "account_details[].reserved_storage:n",
    "account_details[].accounts:n",
    "account_details[].ha_assets:n",
    "account_details[].api:o",
    "account_details[].api.level:n",
    "account_details[].api.total:n",
    "account_details[].api.errors:n",
    "account_details[].stream_detail:a",
    "account_details[].stream_detail[].name:s",
    "account_details[].stream_detail[].created:s",
    "account_details[].stream_detail[].cluster:o",
    "account_details[].stream_detail[].cluster.leader:s",
    "account_details[].stream_detail[].config:o",
    "account_details[].stream_detail[].state:o",
    "account_details[].stream_detail[].consumer_detail:a",
    "account_details[].stream_detail[].consumer_detail[].stream_name:s",
    "account_details[].stream_detail[].consumer_detail[].name:s",
    "account_details[].stream_detail[].consumer_detail[].created:s",
    "account_details[].stream_detail[].consumer_detail[].config:o",
    "account_details[].stream_detail[].consumer_detail[].delivered:o",
    "account_details[].stream_detail[].consumer_detail[].ack_floor:o",
    "account_details[].stream_detail[].consumer_detail[].num_ack_pending:n",
    "account_details[].stream_detail[].consumer_detail[].num_redelivered:n",
    "account_details[].stream_detail[].consumer_detail[].num_waiting:n",
    "account_details[].stream_detail[].consumer_detail[].num_pending:n",
    "account_details[].stream_detail[].consumer_detail[].ts:s",
    "total:n",
];
/// `/subsz`
const SUBSZ: &[&str] = &[
    "server_id:s",
    "now:s",
    "num_subscriptions:n",
    "num_cache:n",
    "num_inserts:n",
    "num_removes:n",
    "num_matches:n",
    "cache_hit_rate:n",
    "max_fanout:n",
    "avg_fanout:n",
    "total:n",
    "offset:n",
    "limit:n",
];
/// `/accountz`
const ACCOUNTZ: &[&str] = &["server_id:s", "now:s", "system_account:s", "accounts:a"];
/// `/routez`
const ROUTEZ: &[&str] = &[
    "server_id:s",
    "server_name:s",
    "now:s",
    "num_routes:n",
    "routes:a",
];
/// `/leafz`
const LEAFZ: &[&str] = &["server_id:s", "now:s", "leafnodes:n", "leafs:a"];
/// `/gatewayz`
const GATEWAYZ: &[&str] = &[
    "server_id:s",
    "now:s",
    "outbound_gateways:o",
    "inbound_gateways:o",
];
/// `/jsz?acc=$G`
const JSZ_ACC: &[&str] = &[
    "memory:n",
    "storage:n",
    "reserved_memory:n",
    "reserved_storage:n",
    "accounts:n",
    "ha_assets:n",
    "api:o",
    "api.level:n",
    "api.total:n",
    "api.errors:n",
    "server_id:s",
    "now:s",
    "config:o",
    "config.max_memory:n",
    "config.max_storage:n",
    "config.store_dir:s",
    "config.sync_interval:n",
    "config.strict:b",
    "limits:o",
    "limits.default_max_consumers:n",
    "streams:n",
    "consumers:n",
    "messages:n",
    "bytes:n",
    "account_details:a",
    "account_details[].name:s",
    "account_details[].id:s",
    "account_details[].memory:n",
    "account_details[].storage:n",
    "account_details[].reserved_memory:n",
    "account_details[].reserved_storage:n",
    "account_details[].accounts:n",
    "account_details[].ha_assets:n",
    "account_details[].api:o",
    "account_details[].api.level:n",
    "account_details[].api.total:n",
    "account_details[].api.errors:n",
    "total:n",
];

/// `/connz?subs=detail` (observed on nats-server 2.15.1; not in the capture file): `/connz`
/// plus the detail list.
const CONNZ_DETAIL_EXTRA: &[&str] = &[
    "connections[].subscriptions_list_detail:a",
    "connections[].subscriptions_list_detail[].subject:s",
    "connections[].subscriptions_list_detail[].qgroup:s",
    "connections[].subscriptions_list_detail[].sid:s",
    "connections[].subscriptions_list_detail[].msgs:n",
    "connections[].subscriptions_list_detail[].cid:n",
];

/// `/accountz?acc=$G` (observed on nats-server 2.15.1; not in the capture file).
const ACCOUNTZ_G: &[&str] = &[
    "server_id:s",
    "now:s",
    "system_account:s",
    "account_detail:o",
    "account_detail.account_name:s",
    "account_detail.update_time:s",
    "account_detail.expired:b",
    "account_detail.complete:b",
    "account_detail.jetstream_enabled:b",
    "account_detail.leafnode_connections:n",
    "account_detail.client_connections:n",
    "account_detail.subscriptions:n",
    "account_detail.imports:a",
    "account_detail.name_tag:s",
    "account_detail.sublist_stats:o",
    "account_detail.sublist_stats.num_subscriptions:n",
    "account_detail.sublist_stats.num_cache:n",
    "account_detail.sublist_stats.num_inserts:n",
    "account_detail.sublist_stats.num_removes:n",
    "account_detail.sublist_stats.num_matches:n",
    "account_detail.sublist_stats.cache_hit_rate:n",
    "account_detail.sublist_stats.max_fanout:n",
    "account_detail.sublist_stats.avg_fanout:n",
];

/// Where keel's shape knowingly differs from the reference's (applied only when testing
/// keel): `(reference key, keel key or none)`.
const KEEL_DIFFS: &[(&str, Option<&str>)] = &[
    // keel syncs before every ack by default: the reference's `sync_always: true` form.
    ("config.sync_interval:n", Some("config.sync_always:b")),
    (
        "jetstream.config.sync_interval:n",
        Some("jetstream.config.sync_always:b"),
    ),
    // keel has no account imports; the reference leaves an empty list out.
    ("account_detail.imports:a", None),
];

const SKIP_CHILDREN: &[&str] = &[
    "http_req_stats",
    "account_details[].stream_detail[].config",
    "account_details[].stream_detail[].state",
    "account_details[].stream_detail[].consumer_detail[].config",
    "account_details[].stream_detail[].consumer_detail[].delivered",
    "account_details[].stream_detail[].consumer_detail[].ack_floor",
    "account_detail.imports",
];

fn type_code(v: &Value) -> char {
    match v {
        Value::Object(_) => 'o',
        Value::Array(_) => 'a',
        Value::String(_) => 's',
        Value::Bool(_) => 'b',
        Value::Number(_) => 'n',
        Value::Null => 'z',
    }
}

fn key_paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.insert(format!("{p}:{}", type_code(x)));
                if !SKIP_CHILDREN.contains(&p.as_str()) {
                    key_paths(x, &p, out);
                }
            }
        }
        Value::Array(a) => {
            for x in a {
                key_paths(x, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}

/// Asserts `body` has exactly the reference's key paths and value types.
fn assert_shape(what: &str, body: &Value, reference: &[&str]) {
    let mut want: BTreeSet<String> = reference.iter().map(|s| s.to_string()).collect();
    if !is_reference() {
        for (theirs, ours) in KEEL_DIFFS {
            if want.remove(*theirs) {
                if let Some(o) = ours {
                    want.insert(o.to_string());
                }
            }
        }
    }
    let mut got = BTreeSet::new();
    key_paths(body, "", &mut got);
    let missing: Vec<_> = want.difference(&got).collect();
    let extra: Vec<_> = got.difference(&want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what}: key paths differ from the reference's\n  missing: {missing:?}\n  extra: {extra:?}\n  body: {body:#}"
    );
}

// ---------------------------------------------------------------------------
// HTTP and server helpers
// ---------------------------------------------------------------------------

/// A server with monitoring on a free port (and JetStream when asked).
struct Mon {
    server: Server,
    port: u16,
    // Dropped after the server (fields drop in order).
    _store: Option<TempDir>,
}

impl Mon {
    fn start(jetstream: bool) -> Mon {
        let store = jetstream.then(|| TempDir::new("keel-monitoring-store"));
        let mut conf = String::from("http_port: -1\n");
        if let Some(dir) = &store {
            conf.push_str(&format!(
                "jetstream {{ store_dir: \"{}\" }}\n",
                dir.path().display()
            ));
        }
        let server = Server::start_with_config(&conf);
        let port = server.monitor_port();
        Mon {
            server,
            port,
            _store: store,
        }
    }

    async fn get(&self, path: &str) -> Http {
        http_get(self.port, path).await
    }

    /// A JSON endpoint: 200, `application/json`, a JSON object.
    async fn json(&self, path: &str) -> Value {
        let r = self.get(path).await;
        assert_eq!(r.status, 200, "GET {path}: {}", r.body);
        assert_eq!(
            r.header("content-type"),
            Some("application/json"),
            "GET {path}"
        );
        serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("GET {path}: {e}: {}", r.body))
    }

    async fn client(&self, name: &str) -> Client {
        self.server
            .client_with(async_nats::ConnectOptions::new().name(name))
            .await
    }
}

/// Raw JetStream API request; panics on an error response.
async fn api(client: &Client, subject: &str, body: Value) -> Value {
    let (_, resp) = json_request(client, &format!("{API}.{subject}"), body.to_string()).await;
    assert!(resp.get("error").is_none(), "{subject}: {resp}");
    resp
}

async fn create_stream(client: &Client, name: &str, subjects: &[&str]) {
    api(
        client,
        &format!("STREAM.CREATE.{name}"),
        json!({"name": name, "subjects": subjects, "storage": "memory"}),
    )
    .await;
}

async fn create_durable(client: &Client, stream: &str, name: &str) {
    api(
        client,
        &format!("CONSUMER.CREATE.{stream}.{name}"),
        json!({"stream_name": stream, "config": {
            "durable_name": name, "ack_policy": "explicit", "ack_wait": 30_000_000_000u64,
        }}),
    )
    .await;
}

/// A JetStream publish (request with an ack).
async fn js_publish(client: &Client, subject: &str, payload: &'static str) {
    let (_, ack) = json_request(client, subject, Bytes::from_static(payload.as_bytes())).await;
    assert!(ack.get("seq").is_some(), "publish to {subject}: {ack}");
}

/// Sends a pull request for `batch` messages and returns them (with their ack subjects).
async fn fetch(
    client: &Client,
    stream: &str,
    consumer: &str,
    batch: usize,
) -> Vec<async_nats::Message> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
    client
        .publish_with_reply(
            format!("{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            inbox,
            Bytes::from(json!({"batch": batch, "expires": 2_000_000_000u64}).to_string()),
        )
        .await
        .expect("pull request");
    let mut out = Vec::new();
    while out.len() < batch {
        let m = within("pulled message", sub.next())
            .await
            .expect("subscription open");
        if m.status.is_none() {
            out.push(m);
        }
    }
    out
}

/// Polls `check` (up to STEP) until it returns true.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + STEP;
    loop {
        match check().await {
            Ok(()) => return,
            Err(e) if Instant::now() >= deadline => panic!("{what}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
}

/// One sample of the Prometheus text format.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Sample {
    fn label(&self, k: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses the text exposition format, checking every sample follows a `# TYPE` of its family.
fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut typed = BTreeSet::new();
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let name = it.next().expect("TYPE name");
            assert!(typed.insert(name.to_string()), "family {name} typed twice");
            assert_eq!(it.next(), Some("gauge"), "{line}");
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample value");
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("value in {line:?}"));
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), Vec::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                (name.to_string(), parse_labels(body))
            }
        };
        assert!(typed.contains(&name), "sample before its TYPE: {line}");
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

fn parse_labels(body: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = body.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if key.is_empty() {
            return out;
        }
        assert_eq!(chars.next(), Some('"'), "label {key} value quote");
        let mut val = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => val.push('\n'),
                    Some(o) => val.push(o),
                    None => break,
                },
                '"' => break,
                c => val.push(c),
            }
        }
        out.push((key.trim_start_matches(',').to_string(), val));
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
}

/// The value of `name` for the series with all of `labels`.
fn metric(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
        .map(|s| s.value)
}

impl Mon {
    /// Scrapes `/metrics` (keel only).
    async fn metrics(&self) -> Vec<Sample> {
        let r = self.get("/metrics").await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("content-type"),
            Some("text/plain; version=0.0.4; charset=utf-8")
        );
        parse_metrics(&r.body)
    }

    /// The one consumer's entry of `/jsz?consumers=true`.
    async fn jsz_consumer(&self, stream: &str, consumer: &str) -> Value {
        let v = self.json("/jsz?consumers=true").await;
        let streams = v["account_details"][0]["stream_detail"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let st = streams
            .iter()
            .find(|s| s["name"] == stream)
            .unwrap_or_else(|| panic!("no stream {stream} in {v:#}"));
        st["consumer_detail"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == consumer).cloned())
            .unwrap_or_else(|| panic!("no consumer {consumer} in {st:#}"))
    }
}

// ---------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------

/// The capture's scenario (one named client with a subscription, memory stream `MON` with
/// one message, durable consumer `mc`), then every endpoint's key paths and value types.
#[tokio::test]
async fn endpoints_have_the_reference_shape() {
    let mon = Mon::start(true);
    let client = mon.client("monitored-client").await;
    let _watch = client.subscribe("mon.watch").await.unwrap();
    let _queue = client
        .queue_subscribe("mon.q", "workers".into())
        .await
        .unwrap();
    create_stream(&client, "MON", &["mon.>"]).await;
    js_publish(&client, "mon.a", "hello").await;
    create_durable(&client, "MON", "mc").await;
    common::sync(&client).await;

    let cases: &[(&str, &[&str])] = &[
        ("/varz", VARZ),
        ("/connz", CONNZ),
        ("/connz?subs=1", CONNZ_SUBS),
        ("/jsz", JSZ),
        ("/jsz?streams=1&consumers=1&config=1", JSZ_DETAIL),
        ("/jsz?acc=$G", JSZ_ACC),
        ("/subsz", SUBSZ),
        ("/accountz", ACCOUNTZ),
        ("/accountz?acc=$G", ACCOUNTZ_G),
        ("/routez", ROUTEZ),
        ("/leafz", LEAFZ),
        ("/gatewayz", GATEWAYZ),
    ];
    for (path, keys) in cases {
        let v = mon.json(path).await;
        assert_shape(path, &v, keys);
        let r = mon.get(path).await;
        assert_eq!(r.header("access-control-allow-origin"), Some("*"), "{path}");
        // Pretty-printed with two spaces, as the reference writes it.
        assert!(r.body.starts_with("{\n  \""), "{path}: {}", r.body);
    }
    let mut detail: Vec<&str> = CONNZ.to_vec();
    detail.extend_from_slice(CONNZ_DETAIL_EXTRA);
    assert_shape(
        "/connz?subs=detail",
        &mon.json("/connz?subs=detail").await,
        &detail,
    );

    // Values that do not vary by implementation.
    let varz = mon.json("/varz").await;
    assert_eq!(varz["connections"], 1);
    // The configured value (`http_port: -1`), not the bound port, as the reference does.
    assert_eq!(varz["http_port"], -1);
    assert_eq!(varz["port"], mon.server.port());
    assert_eq!(varz["system_account"], "$SYS");
    assert!(
        varz["http_req_stats"]["/varz"].as_u64() >= Some(1),
        "{varz:#}"
    );
    let connz = mon.json("/connz?subs=1").await;
    let c = &connz["connections"][0];
    assert_eq!(c["name"], "monitored-client");
    assert_eq!(c["kind"], "Client");
    assert_eq!(c["type"], "nats");
    assert_eq!(c["ip"], "127.0.0.1");
    let subjects: Vec<&str> = c["subscriptions_list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(subjects.contains(&"mon.watch"), "{subjects:?}");
    let jsz = mon.json("/jsz?streams=1&consumers=1&config=1").await;
    assert_eq!(
        (jsz["streams"].as_u64(), jsz["consumers"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(jsz["messages"], 1);
    assert_eq!(jsz["total"], 1);
    let acc = &jsz["account_details"][0];
    assert_eq!(
        (acc["name"].as_str(), acc["id"].as_str()),
        (Some("$G"), Some("$G"))
    );
    assert_eq!(acc["reserved_memory"].as_u64(), Some(u64::MAX));
    let st = &acc["stream_detail"][0];
    assert_eq!(st["name"], "MON");
    assert_eq!(st["config"]["name"], "MON");
    assert_eq!(st["state"]["messages"], 1);
    assert_eq!(st["state"]["consumer_count"], 1);
    let cd = &st["consumer_detail"][0];
    assert_eq!(
        (cd["stream_name"].as_str(), cd["name"].as_str()),
        (Some("MON"), Some("mc"))
    );
    assert_eq!(cd["config"]["durable_name"], "mc");
    assert_eq!(cd["num_pending"], 1);
    assert_eq!(mon.json("/routez").await["routes"], json!([]));
    assert_eq!(mon.json("/routez").await["num_routes"], 0);
    assert_eq!(mon.json("/leafz").await["leafs"], json!([]));
    assert_eq!(mon.json("/gatewayz").await["outbound_gateways"], json!({}));
    // The reference lists accounts in map order: compare as a set.
    let accounts: BTreeSet<String> =
        serde_json::from_value(mon.json("/accountz").await["accounts"].clone()).unwrap();
    assert_eq!(
        accounts,
        BTreeSet::from(["$G".to_string(), "$SYS".to_string()])
    );
    let acc = mon.json("/accountz?acc=$G").await;
    assert_eq!(acc["account_detail"]["account_name"], "$G");
    assert_eq!(acc["account_detail"]["jetstream_enabled"], true);
}

/// `/jsz` options: which parts each adds.
#[tokio::test]
async fn jsz_options_select_the_detail() {
    let mon = Mon::start(true);
    let client = mon.client("jsz").await;
    create_stream(&client, "A", &["a.>"]).await;
    create_stream(&client, "B", &["b.>"]).await;
    js_publish(&client, "a.1", "x").await;
    js_publish(&client, "b.1", "y").await;
    js_publish(&client, "b.2", "z").await;
    create_durable(&client, "B", "d").await;

    let plain = mon.json("/jsz").await;
    assert!(plain.get("account_details").is_none(), "{plain:#}");
    assert_eq!(plain["streams"], 2);
    assert_eq!(plain["consumers"], 1);
    assert_eq!(plain["messages"], 3);

    let accounts = mon.json("/jsz?accounts=true").await;
    let a = &accounts["account_details"][0];
    assert_eq!(a["name"], "$G");
    assert!(a.get("stream_detail").is_none(), "{a:#}");
    let by_acc = mon.json("/jsz?acc=$G").await;
    assert!(by_acc["account_details"][0].get("stream_detail").is_none());
    let other = mon.json("/jsz?acc=nope").await;
    assert!(other.get("account_details").is_none(), "{other:#}");

    let streams = mon.json("/jsz?streams=true").await;
    let sd = streams["account_details"][0]["stream_detail"]
        .as_array()
        .unwrap()
        .clone();
    let mut names: Vec<&str> = sd.iter().filter_map(|s| s["name"].as_str()).collect();
    names.sort();
    assert_eq!(names, ["A", "B"]);
    for s in &sd {
        assert!(s.get("config").is_none(), "{s:#}");
        assert!(s.get("consumer_detail").is_none(), "{s:#}");
        assert!(s["cluster"]["leader"].is_string(), "{s:#}");
    }
    let consumers = mon.json("/jsz?consumers=true").await;
    let b = consumers["account_details"][0]["stream_detail"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "B")
        .cloned()
        .unwrap();
    assert!(b.get("config").is_none(), "{b:#}");
    let d = &b["consumer_detail"][0];
    assert_eq!(d["name"], "d");
    assert!(d.get("config").is_none(), "{d:#}");
    assert_eq!(d["num_pending"], 2);
    let with_config = mon.json("/jsz?consumers=true&config=true").await;
    let b = with_config["account_details"][0]["stream_detail"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "B")
        .cloned()
        .unwrap();
    assert_eq!(b["config"]["subjects"], json!(["b.>"]));
    assert_eq!(b["consumer_detail"][0]["config"]["ack_policy"], "explicit");
    // `>` is escaped the way Go writes JSON.
    let raw = mon.get("/jsz?streams=1&config=1").await.body;
    assert!(raw.contains("\"b.\\u003e\""), "{raw}");
}

/// Without JetStream: `/jsz` says disabled, `/varz` has an empty `jetstream`, health is ok.
#[tokio::test]
async fn without_jetstream() {
    let mon = Mon::start(false);
    let jsz = mon.json("/jsz").await;
    assert_eq!(jsz["disabled"], true);
    assert_eq!(jsz["total"], 0);
    assert_eq!(jsz["config"], json!({"max_memory": 0, "max_storage": 0}));
    assert_eq!(mon.json("/varz").await["jetstream"], json!({}));
    for path in ["/healthz", "/healthz?js-enabled-only=true"] {
        let r = mon.get(path).await;
        assert_eq!(
            (r.status, r.body.as_str()),
            (200, r#"{"status":"ok"}"#),
            "{path}"
        );
    }
    if !is_reference() {
        let m = mon.metrics().await;
        assert_eq!(
            metric(&m, "jetstream_server_jetstream_disabled", &[]),
            Some(1.0)
        );
        assert!(!m.iter().any(|s| s.name.starts_with("jetstream_stream")));
    }
}

/// `/healthz` and its JetStream variants: compact `{"status":"ok"}`.
#[tokio::test]
async fn healthz_variants() {
    let mon = Mon::start(true);
    for path in [
        "/healthz",
        "/healthz?js-enabled-only=true",
        "/healthz?js-server-only=true",
        "/healthz?js-enabled-only=1&js-server-only=false",
    ] {
        let r = mon.get(path).await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.body, r#"{"status":"ok"}"#, "{path}");
    }
}

/// Malformed query values get 400 with the reference's text (never a crash); unknown paths
/// the reference's 404; the server keeps serving afterwards.
#[tokio::test]
async fn malformed_queries_are_400_and_unknown_paths_404() {
    let mon = Mon::start(true);
    let cases = [
        (
            "/connz?limit=abc",
            "Error decoding int for 'limit': strconv.Atoi: parsing \"abc\": invalid syntax",
        ),
        (
            "/connz?offset=1.5",
            "Error decoding int for 'offset': strconv.Atoi: parsing \"1.5\": invalid syntax",
        ),
        ("/connz?sort=bogus", "invalid sorting option: bogus"),
        (
            "/connz?sort=stop",
            "sort by stop only valid on closed connections",
        ),
        (
            "/connz?sort=reason",
            "sort by reason only valid on closed connections",
        ),
        (
            "/connz?subs=abc",
            "Error decoding boolean for 'subs': strconv.ParseBool: parsing \"abc\": invalid syntax",
        ),
        (
            "/connz?cid=abc",
            "Error decoding uint64 for 'cid': strconv.ParseUint: parsing \"abc\": invalid syntax",
        ),
        ("/connz?state=bogus", "Error decoding state for bogus"),
        (
            "/subsz?limit=x",
            "Error decoding int for 'limit': strconv.Atoi: parsing \"x\": invalid syntax",
        ),
        (
            "/subsz?test=foo.*",
            "invalid test subject, must be valid publish subject: foo.*",
        ),
        (
            "/jsz?streams=abc",
            "Error decoding boolean for 'streams': strconv.ParseBool: parsing \"abc\": invalid syntax",
        ),
        (
            "/jsz?limit=x",
            "Error decoding int for 'limit': strconv.Atoi: parsing \"x\": invalid syntax",
        ),
        (
            "/healthz?js-enabled-only=abc",
            "Error decoding boolean for 'js-enabled-only': strconv.ParseBool: parsing \"abc\": invalid syntax",
        ),
        (
            "/routez?subs=abc",
            "Error decoding boolean for 'subs': strconv.ParseBool: parsing \"abc\": invalid syntax",
        ),
        ("/accountz?acc=x", "Account x does not exist"),
    ];
    for (path, text) in cases {
        let r = mon.get(path).await;
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        assert_eq!(
            r.header("content-type"),
            Some("text/plain; charset=utf-8"),
            "{path}"
        );
        assert_eq!(r.body, text, "{path}");
    }
    for path in ["/nope", "/varz/x", "/connzz"] {
        let r = mon.get(path).await;
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.header("content-type"), Some("text/plain; charset=utf-8"));
        assert_eq!(r.body, "404 page not found\n", "{path}");
    }
    if is_reference() {
        // No Prometheus endpoint on the reference.
        assert_eq!(mon.get("/metrics").await.status, 404);
    }
    // Lenient where the reference is lenient: a bad escape drops the pair, a negative
    // offset is 0, a zero limit the default.
    assert_eq!(mon.get("/varz?x=%zz").await.status, 200);
    let c = mon.json("/connz?offset=-1&limit=0").await;
    assert_eq!(
        (c["offset"].as_u64(), c["limit"].as_u64()),
        (Some(0), Some(1024))
    );
    assert_eq!(mon.json("/healthz").await["status"], "ok");
}

/// `/connz` paging, every sort the test can arrange, `cid`, `subs=1` and `subs=detail`.
#[tokio::test]
async fn connz_paging_sorting_and_subscriptions() {
    let mon = Mon::start(false);
    let a = mon.client("a").await;
    let _a1 = a.subscribe("a.one").await.unwrap();
    common::sync(&a).await;
    let b = mon.client("b").await;
    let _b1 = b.subscribe("b.one").await.unwrap();
    let _b2 = b.subscribe("b.two").await.unwrap();
    let _b3 = b.queue_subscribe("b.three", "q".into()).await.unwrap();
    common::sync(&b).await;
    let c = mon.client("c").await;
    let _c1 = c.subscribe("c.one").await.unwrap();
    let _c2 = c.subscribe("c.two").await.unwrap();
    for _ in 0..5 {
        c.publish("nowhere", Bytes::from_static(b"0123456789"))
            .await
            .unwrap();
    }
    common::sync(&c).await;

    let names = |v: &Value| -> Vec<String> {
        v["connections"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let all = mon.json("/connz").await;
    assert_eq!(
        (all["num_connections"].as_u64(), all["total"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(
        (all["offset"].as_u64(), all["limit"].as_u64()),
        (Some(0), Some(1024))
    );
    assert_eq!(names(&all), ["a", "b", "c"]);
    let cids: Vec<u64> = all["connections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["cid"].as_u64().unwrap())
        .collect();
    assert!(cids.windows(2).all(|w| w[0] < w[1]), "{cids:?}");
    assert_eq!(all["connections"][1]["subscriptions"], 3);
    assert!(all["connections"][0].get("subscriptions_list").is_none());

    for (sort, want) in [
        ("cid", ["a", "b", "c"]),
        ("start", ["a", "b", "c"]),
        ("subs", ["b", "c", "a"]),
        ("msgs_from", ["c", "a", "b"]),
        ("bytes_from", ["c", "a", "b"]),
        ("uptime", ["c", "b", "a"]),
    ] {
        let v = mon.json(&format!("/connz?sort={sort}")).await;
        let got = names(&v);
        if sort == "msgs_from" || sort == "bytes_from" {
            // a and b sent the same number of messages; only c's place is fixed.
            assert_eq!(got[0], "c", "sort={sort}: {got:?}");
        } else {
            assert_eq!(got, want, "sort={sort}");
        }
    }
    for sort in ["pending", "msgs_to", "bytes_to", "last", "idle", "rtt"] {
        let v = mon.json(&format!("/connz?sort={sort}")).await;
        assert_eq!(v["num_connections"], 3, "sort={sort}");
    }

    let page = mon.json("/connz?offset=1&limit=1").await;
    assert_eq!(names(&page), ["b"]);
    assert_eq!(
        (page["num_connections"].as_u64(), page["total"].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(
        (page["offset"].as_u64(), page["limit"].as_u64()),
        (Some(1), Some(1))
    );
    let past = mon.json("/connz?offset=5").await;
    assert_eq!(past["connections"], json!([]));
    assert_eq!(past["num_connections"], 0);

    let by_cid = mon.json(&format!("/connz?cid={}", cids[1])).await;
    assert_eq!(names(&by_cid), ["b"]);
    assert_eq!(by_cid["limit"], 1);
    let none = mon.json("/connz?cid=999999").await;
    assert_eq!(none["num_connections"], 0);

    let subs = mon.json("/connz?subs=1").await;
    let b_conn = &subs["connections"][1];
    let mut list: Vec<&str> = b_conn["subscriptions_list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    list.sort();
    assert_eq!(list, ["b.one", "b.three", "b.two"]);

    let detail = mon.json("/connz?subs=detail").await;
    let b_conn = &detail["connections"][1];
    assert!(b_conn.get("subscriptions_list").is_none());
    let d = b_conn["subscriptions_list_detail"].as_array().unwrap();
    assert_eq!(d.len(), 3);
    let q = d.iter().find(|s| s["subject"] == "b.three").unwrap();
    assert_eq!(q["qgroup"], "q");
    assert_eq!(q["cid"], cids[1]);
    assert!(q["sid"].is_string() && q["msgs"].is_number(), "{q}");
    let plain = d.iter().find(|s| s["subject"] == "b.one").unwrap();
    assert!(plain.get("qgroup").is_none(), "{plain}");
}

/// `/subsz`: counts, and `subs=1` with a `test` subject and paging.
#[tokio::test]
async fn subsz_lists_and_filters() {
    let mon = Mon::start(false);
    let client = mon.client("subs").await;
    let _s1 = client.queue_subscribe("foo.bar", "q".into()).await.unwrap();
    let _s2 = client.subscribe("foo.*").await.unwrap();
    let _s3 = client.subscribe("other").await.unwrap();
    common::sync(&client).await;

    let plain = mon.json("/subsz").await;
    assert!(plain["num_subscriptions"].as_u64() >= Some(3), "{plain:#}");
    assert_eq!(plain["total"], 0);
    assert!(plain.get("subscriptions_list").is_none());

    let v = mon.json("/subsz?subs=1&test=foo.bar").await;
    assert_eq!(v["total"], 2, "{v:#}");
    let list = v["subscriptions_list"].as_array().unwrap();
    let mut subjects: Vec<&str> = list.iter().filter_map(|s| s["subject"].as_str()).collect();
    subjects.sort();
    assert_eq!(subjects, ["foo.*", "foo.bar"]);
    for s in list {
        assert_eq!(s["account"], "$G");
        assert_eq!(s["account_tag"], "$G");
        assert!(s["sid"].is_string() && s["cid"].is_number() && s["msgs"].is_number());
    }
    let q = list.iter().find(|s| s["subject"] == "foo.bar").unwrap();
    assert_eq!(q["qgroup"], "q");
    let one = mon.json("/subsz?subs=1&test=foo.baz").await;
    assert_eq!(one["total"], 1);
    assert_eq!(one["subscriptions_list"][0]["subject"], "foo.*");
    let page = mon
        .json("/subsz?subs=1&test=foo.bar&limit=1&offset=1")
        .await;
    assert_eq!(page["total"], 2);
    assert_eq!(page["subscriptions_list"].as_array().unwrap().len(), 1);
    assert_eq!(
        (page["offset"].as_u64(), page["limit"].as_u64()),
        (Some(1), Some(1))
    );
}

/// `/varz` counters move with traffic.
#[tokio::test]
async fn varz_counters_move() {
    let mon = Mon::start(false);
    let a = mon.client("a").await;
    let before = mon.json("/varz").await;
    assert_eq!(before["connections"], 1);
    let _b = mon.client("b").await;
    let mut sub = a.subscribe("v.x").await.unwrap();
    common::sync(&a).await;
    for _ in 0..3 {
        a.publish("v.x", Bytes::from_static(b"12345"))
            .await
            .unwrap();
    }
    for _ in 0..3 {
        within("delivery", sub.next()).await.unwrap();
    }
    let after = mon.json("/varz").await;
    assert_eq!(after["connections"], 2);
    let d = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    assert!(d("in_msgs") >= 3, "{after:#}");
    assert!(d("out_msgs") >= 3, "{after:#}");
    assert!(d("in_bytes") >= 15, "{after:#}");
    assert!(after["subscriptions"].as_u64() > before["subscriptions"].as_u64());
    assert!(after["http_req_stats"]["/varz"].as_u64() > before["http_req_stats"]["/varz"].as_u64());
    assert!(after["mem"].as_u64() > Some(0));
    assert!(after["cores"].as_u64() >= Some(1));
}

/// The consumer figures move as messages are published, delivered and acknowledged: in
/// `/jsz` on both servers and in `/metrics` on keel (the reference has no `/metrics`).
#[tokio::test]
async fn consumer_numbers_follow_publish_deliver_ack() {
    let mon = Mon::start(true);
    let client = mon.client("flow").await;
    create_stream(&client, "S", &["s.>"]).await;
    create_durable(&client, "S", "c").await;
    for _ in 0..5 {
        js_publish(&client, "s.x", "hello").await;
    }
    let labels = [("stream", "S"), ("consumer", "c"), ("account", "$G")];
    let stream_labels = [("stream_name", "S"), ("stream", "S"), ("account", "$G")];

    // Published, nothing delivered.
    let cd = mon.jsz_consumer("S", "c").await;
    assert_eq!(
        (cd["num_pending"].as_u64(), cd["num_ack_pending"].as_u64()),
        (Some(5), Some(0))
    );
    if !is_reference() {
        let m = mon.metrics().await;
        assert_eq!(
            metric(&m, "jetstream_consumer_num_pending", &labels),
            Some(5.0)
        );
        assert_eq!(
            metric(&m, "jetstream_consumer_ack_pending", &labels),
            Some(0.0)
        );
        assert_eq!(
            metric(&m, "jetstream_consumer_num_ack_pending", &labels),
            Some(0.0)
        );
        assert_eq!(
            metric(&m, "jetstream_consumer_delivered_stream_seq", &labels),
            Some(0.0)
        );
        assert_eq!(
            metric(&m, "jetstream_stream_messages", &stream_labels),
            Some(5.0)
        );
        assert_eq!(
            metric(&m, "jetstream_stream_total_messages", &stream_labels),
            Some(5.0)
        );
        assert_eq!(
            metric(&m, "jetstream_stream_first_seq", &stream_labels),
            Some(1.0)
        );
        assert_eq!(
            metric(&m, "jetstream_stream_last_seq", &stream_labels),
            Some(5.0)
        );
        assert_eq!(
            metric(&m, "jetstream_stream_consumer_count", &stream_labels),
            Some(1.0)
        );
        assert!(metric(&m, "jetstream_stream_bytes", &stream_labels) > Some(0.0));
        assert_eq!(metric(&m, "jetstream_server_total_streams", &[]), Some(1.0));
        assert_eq!(
            metric(&m, "jetstream_server_total_consumers", &[]),
            Some(1.0)
        );
        assert_eq!(
            metric(&m, "jetstream_server_total_messages", &[]),
            Some(5.0)
        );
        assert_eq!(
            metric(&m, "jetstream_server_jetstream_disabled", &[]),
            Some(0.0)
        );
        assert!(metric(&m, "gnatsd_varz_connections", &[]) >= Some(1.0));
        assert!(metric(&m, "gnatsd_varz_in_msgs", &[]) >= Some(5.0));
        assert!(metric(&m, "gnatsd_varz_subscriptions", &[]) > Some(0.0));
        assert!(metric(&m, "gnatsd_varz_jetstream_stats_memory", &[]) > Some(0.0));
        // A real limit (3/4 of RAM when unset), so "% used" panels work.
        assert!(metric(&m, "gnatsd_varz_jetstream_config_max_memory", &[]) > Some(0.0));
        assert!(metric(&m, "jetstream_account_memory_used", &[("account", "$G")]) > Some(0.0));
        // Every series carries server_id; JetStream ones server_name too.
        assert!(m.iter().all(|s| s.label("server_id").is_some()));
        let c = m
            .iter()
            .find(|s| s.name == "jetstream_consumer_num_pending")
            .unwrap();
        assert_eq!(c.label("stream_name"), Some("S"));
        assert_eq!(c.label("consumer_name"), Some("c"));
        assert!(c.label("server_name").is_some());
    }

    // Three delivered, none acknowledged.
    let msgs = fetch(&client, "S", "c", 3).await;
    eventually("after delivery", || async {
        let cd = mon.jsz_consumer("S", "c").await;
        let got = (
            cd["num_pending"].as_u64(),
            cd["num_ack_pending"].as_u64(),
            cd["delivered"]["stream_seq"].as_u64(),
        );
        if got != (Some(2), Some(3), Some(3)) {
            return Err(format!("jsz {cd}"));
        }
        if !is_reference() {
            let m = mon.metrics().await;
            let got = (
                metric(&m, "jetstream_consumer_num_pending", &labels),
                metric(&m, "jetstream_consumer_ack_pending", &labels),
                metric(&m, "jetstream_consumer_delivered_stream_seq", &labels),
                metric(&m, "jetstream_consumer_delivered_consumer_seq", &labels),
                metric(&m, "jetstream_consumer_ack_floor_stream_seq", &labels),
            );
            if got != (Some(2.0), Some(3.0), Some(3.0), Some(3.0), Some(0.0)) {
                return Err(format!("metrics {got:?}"));
            }
            if metric(&m, "jetstream_consumer_last_delivery_seconds", &labels).is_none() {
                return Err("no last_delivery_seconds".into());
            }
        }
        Ok(())
    })
    .await;

    // The first two acknowledged.
    for m in &msgs[..2] {
        client
            .publish(m.reply.clone().expect("ack subject"), Bytes::new())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    eventually("after acks", || async {
        let cd = mon.jsz_consumer("S", "c").await;
        let got = (
            cd["num_pending"].as_u64(),
            cd["num_ack_pending"].as_u64(),
            cd["ack_floor"]["stream_seq"].as_u64(),
        );
        if got != (Some(2), Some(1), Some(2)) {
            return Err(format!("jsz {cd}"));
        }
        if !is_reference() {
            let m = mon.metrics().await;
            let got = (
                metric(&m, "jetstream_consumer_num_pending", &labels),
                metric(&m, "jetstream_consumer_ack_pending", &labels),
                metric(&m, "jetstream_consumer_num_ack_pending", &labels),
                metric(&m, "jetstream_consumer_ack_floor_stream_seq", &labels),
                metric(&m, "jetstream_consumer_ack_floor_consumer_seq", &labels),
                metric(&m, "jetstream_consumer_num_redelivered", &labels),
            );
            if got
                != (
                    Some(2.0),
                    Some(1.0),
                    Some(1.0),
                    Some(2.0),
                    Some(2.0),
                    Some(0.0),
                )
            {
                return Err(format!("metrics {got:?}"));
            }
        }
        Ok(())
    })
    .await;

    // More published: num_pending grows, the stream's last sequence moves.
    js_publish(&client, "s.y", "again").await;
    eventually("after another publish", || async {
        let cd = mon.jsz_consumer("S", "c").await;
        if cd["num_pending"].as_u64() != Some(3) {
            return Err(format!("jsz {cd}"));
        }
        if !is_reference() {
            let m = mon.metrics().await;
            if metric(&m, "jetstream_stream_last_seq", &stream_labels) != Some(6.0) {
                return Err("last_seq".into());
            }
        }
        Ok(())
    })
    .await;
}

/// A scrape with 1,000 consumers: how long `/metrics` takes (keel; `/jsz?consumers=true` on
/// both, for comparison), and that JetStream publishing keeps going while scrapes run.
/// Times are printed (`--nocapture`); the bounds only catch a pathological regression.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_with_1000_consumers_is_cheap() {
    const CONSUMERS: usize = 1000;
    let mon = Mon::start(true);
    let client = mon.client("bulk").await;
    create_stream(&client, "BIG", &["big.>"]).await;
    for _ in 0..100 {
        js_publish(&client, "big.x", "payload").await;
    }
    let started = Instant::now();
    for i in 0..CONSUMERS {
        create_durable(&client, "BIG", &format!("c{i}")).await;
    }
    eprintln!(
        "created {CONSUMERS} durable consumers in {:?}",
        started.elapsed()
    );

    let path = if is_reference() {
        "/jsz?consumers=true"
    } else {
        "/metrics"
    };
    // Check completeness once.
    let body = mon.get(path).await.body;
    if is_reference() {
        assert_eq!(body.matches("\"stream_name\": \"BIG\"").count(), CONSUMERS);
    } else {
        let m = parse_metrics(&body);
        let n = m
            .iter()
            .filter(|s| s.name == "jetstream_consumer_num_pending")
            .count();
        assert_eq!(n, CONSUMERS);
        assert!(m
            .iter()
            .filter(|s| s.name == "jetstream_consumer_num_pending")
            .all(|s| s.value == 100.0));
        eprintln!("/metrics body: {} bytes, {} samples", body.len(), m.len());
    }

    // A publisher running alongside the scrapes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publisher = {
        let client = client.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                js_publish(&client, "big.y", "during-scrape").await;
                worst = worst.max(t.elapsed());
                n += 1;
            }
            (n, worst)
        })
    };
    let mut times = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let r = mon.get(path).await;
        times.push(t.elapsed());
        assert_eq!(r.status, 200);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (published, worst_publish) = publisher.await.unwrap();
    times.sort();
    eprintln!(
        "{path} with {CONSUMERS} consumers: min {:?}, median {:?}, max {:?}; \
         {published} publishes during the scrapes, slowest ack {worst_publish:?}",
        times[0],
        times[times.len() / 2],
        times[times.len() - 1]
    );
    assert!(published > 0, "no publish completed while scraping");
    assert!(
        times[times.len() / 2] < Duration::from_secs(2),
        "scrape too slow: {times:?}"
    );
    assert!(
        worst_publish < Duration::from_secs(2),
        "publishing stalled during scrapes: {worst_publish:?}"
    );
}

/// Metric names (`gnatsd_*`, `jetstream_*`) in `text`.
fn metric_names_in(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("jetstream_") || w.starts_with("gnatsd_"))
        .map(str::to_string)
        .collect()
}

/// The metrics prometheus-nats-exporter's own Grafana dashboards query
/// (walkthrough/grafana-nats-dash.json and grafana-jetstream-dash.json in its repository).
const EXPORTER_DASHBOARD_NAMES: &[&str] = &[
    "gnatsd_varz_connections",
    "gnatsd_varz_cpu",
    "gnatsd_varz_in_bytes",
    "gnatsd_varz_in_msgs",
    "gnatsd_varz_mem",
    "gnatsd_varz_out_bytes",
    "gnatsd_varz_out_msgs",
    "gnatsd_varz_slow_consumers",
    "gnatsd_varz_subscriptions",
    "gnatsd_varz_jetstream_config_max_memory",
    "gnatsd_varz_jetstream_config_max_storage",
    "gnatsd_varz_jetstream_stats_memory",
    "gnatsd_varz_jetstream_stats_storage",
    "jetstream_consumer_delivered_consumer_seq",
    "jetstream_consumer_num_ack_pending",
    "jetstream_consumer_num_pending",
    "jetstream_server_total_consumers",
    "jetstream_stream_last_seq",
    "jetstream_stream_total_bytes",
    "jetstream_stream_total_messages",
];

/// The shipped Grafana dashboard (examples/grafana/keel-dashboard.json), the example alert
/// rules (examples/prometheus/keel-alerts.yml) and the exporter's own dashboards query only
/// metrics `/metrics` publishes; the rules pass `promtool check rules` (when promtool is
/// installed, see `have_tool`). Keel only: the reference has no `/metrics`.
#[tokio::test]
async fn dashboards_and_alert_rules_use_published_metrics() {
    let rules_path = repo_path("examples/prometheus/keel-alerts.yml");
    let rules = std::fs::read_to_string(&rules_path).expect("read the example alert rules");
    let rule_names = metric_names_in(
        &rules
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    assert!(
        rule_names.contains("jetstream_consumer_num_ack_pending"),
        "{rule_names:?}"
    );
    let dash_text = std::fs::read_to_string(repo_path("examples/grafana/keel-dashboard.json"))
        .expect("read the Grafana dashboard");
    let dash: Value = serde_json::from_str(&dash_text).expect("dashboard is JSON");
    let mut queries = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            queries.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().expect("templating") {
        if let Some(q) = v["definition"].as_str() {
            queries.push(q.to_string());
        }
    }
    assert!(queries.len() > 20, "{queries:?}");
    let dash_names = metric_names_in(&queries.join("\n"));
    // Exporter-compatible names only: none of Keel's aliases.
    for alias in [
        "jetstream_consumer_ack_pending",
        "jetstream_stream_messages",
        "jetstream_stream_bytes",
    ] {
        assert!(
            !dash_names.contains(alias) && !rule_names.contains(alias),
            "{alias}"
        );
    }
    for q in &queries {
        assert!(
            !q.contains("stream=") && !q.contains("consumer="),
            "alias label in {q}"
        );
    }

    if have_tool(
        "promtool",
        std::process::Command::new("promtool")
            .arg("--version")
            .output()
            .is_ok(),
    ) {
        let out = std::process::Command::new("promtool")
            .args(["check", "rules"])
            .arg(&rules_path)
            .output()
            .expect("run promtool");
        assert!(
            out.status.success(),
            "promtool check rules:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if is_reference() {
        return;
    }
    let mon = Mon::start(true);
    let _client = scenario_with_traffic(&mon).await;
    let published: BTreeSet<String> = mon.metrics().await.into_iter().map(|s| s.name).collect();
    for (what, names) in [
        ("alert rules", rule_names),
        ("Grafana dashboard", dash_names),
        (
            "exporter dashboards",
            EXPORTER_DASHBOARD_NAMES
                .iter()
                .map(|s| s.to_string())
                .collect(),
        ),
    ] {
        let missing: Vec<_> = names.difference(&published).collect();
        assert!(
            missing.is_empty(),
            "{what} use unpublished metrics: {missing:?}"
        );
    }
}

impl Mon {
    /// A server with monitoring on a free port, `extra` config lines, and JetStream when
    /// asked.
    fn start_with(extra: &str, jetstream: bool) -> Mon {
        let store = jetstream.then(|| TempDir::new("keel-monitoring-store"));
        let mut conf = format!("http_port: -1\n{extra}\n");
        if let Some(dir) = &store {
            conf.push_str(&format!(
                "jetstream {{ store_dir: \"{}\" }}\n",
                dir.path().display()
            ));
        }
        let server = Server::start_with_config(&conf);
        let port = server.monitor_port();
        Mon {
            server,
            port,
            _store: store,
        }
    }

    /// The `/connz?state=closed&subs=1` entry of the client called `name`, once it is there.
    async fn wait_closed(&self, name: &str) -> Value {
        let deadline = Instant::now() + STEP;
        loop {
            let list = self.connz_by_name("/connz?state=closed&subs=1").await;
            if let Some(c) = list.iter().find(|c| c["name"] == name) {
                return c.clone();
            }
            assert!(Instant::now() < deadline, "{name} not closed: {list:?}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `/connz` entries (of `path`) by client name.
    async fn connz_by_name(&self, path: &str) -> Vec<Value> {
        self.json(path).await["connections"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

/// A raw client that identifies itself with `name` and subscribes to `a.b` and `c.d` (queue
/// `q`), then waits for the PONG so the server has processed all of it.
async fn raw_named(server: &Server, name: &str) -> common::RawClient {
    let mut raw = server.raw().await;
    raw.send(
        format!(
            "CONNECT {{\"verbose\":false,\"name\":\"{name}\",\"lang\":\"raw\",\"version\":\"1\"}}\r\n\
             SUB a.b 1\r\nSUB c.d q 2\r\nPING\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(raw.read_op().await, "PONG");
    raw
}

/// `/connz?state=closed` lists connections that have gone, with the reference's reason
/// texts, stop times and the subscriptions they had; `state=all` adds them to the open ones;
/// `sort=stop` puts the most recent first, `sort=reason` orders by reason. A slow consumer
/// shows as "Slow Consumer (Pending Bytes)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connections_are_listed_with_reasons() {
    let mon = Mon::start_with("max_pending: 1MB\nwrite_deadline: \"120s\"", false);
    let named =
        |v: &[Value], n: &str| -> Option<Value> { v.iter().find(|c| c["name"] == n).cloned() };
    let wait_closed = |name: &'static str| mon.wait_closed(name);

    let open = mon.client("stays").await;
    common::sync(&open).await;
    // (The harness's readiness probe may already be there: it connected and left.)

    let gone = raw_named(&mon.server, "gone").await;
    drop(gone);
    let c = wait_closed("gone").await;
    assert_eq!(c["reason"], "Client Closed", "{c:#}");
    assert!(c["stop"].is_string() && c["start"].is_string(), "{c:#}");
    assert_eq!(c["subscriptions"], 2);
    let mut subs: Vec<&str> = c["subscriptions_list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    subs.sort();
    assert_eq!(subs, ["a.b", "c.d"]);
    assert_eq!(
        (c["lang"].as_str(), c["kind"].as_str()),
        (Some("raw"), Some("Client"))
    );
    // Key order as the reference's: stop and reason right after last_activity.
    let keys: Vec<&String> = c.as_object().unwrap().keys().collect();
    let at = |k: &str| keys.iter().position(|x| *x == k).unwrap();
    assert_eq!(
        (at("stop"), at("reason")),
        (at("last_activity") + 1, at("last_activity") + 2)
    );

    let mut bad = raw_named(&mon.server, "bad").await;
    bad.send(b"FOO\r\n").await;
    let c = wait_closed("bad").await;
    assert_eq!(c["reason"], "Protocol Violation", "{c:#}");

    // A subscriber that does not read, past max_pending.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let stream = within("slow connect", socket.connect(mon.server.addr()))
        .await
        .unwrap();
    let mut slow = common::RawClient::from_stream(stream).await;
    slow.send(
        b"CONNECT {\"verbose\":false,\"protocol\":1,\"name\":\"slow\"}\r\nSUB big 1\r\nPING\r\n",
    )
    .await;
    assert_eq!(slow.read_op().await, "PONG");
    let payload = Bytes::from(vec![b'p'; 64 * 1024]);
    for _ in 0..256 {
        open.publish("big", payload.clone()).await.unwrap();
    }
    open.flush().await.unwrap();
    let c = wait_closed("slow").await;
    assert_eq!(c["reason"], "Slow Consumer (Pending Bytes)", "{c:#}");

    // Open connections are not in the closed list, closed ones not in the open list.
    let closed = mon.connz_by_name("/connz?state=closed").await;
    assert!(named(&closed, "stays").is_none());
    let opened = mon.connz_by_name("/connz").await;
    assert!(named(&opened, "gone").is_none() && named(&opened, "stays").is_some());
    assert!(opened.iter().all(|c| c.get("reason").is_none()));
    let all = mon.json("/connz?state=all").await;
    let all_list = all["connections"].as_array().unwrap();
    for n in ["stays", "gone", "bad", "slow"] {
        assert!(named(all_list, n).is_some(), "{n} missing from state=all");
    }
    assert_eq!(all["total"].as_u64(), Some(all_list.len() as u64));

    let names = |v: &[Value]| -> Vec<String> {
        v.iter()
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect()
    };
    assert_eq!(
        names(&mon.connz_by_name("/connz?state=closed&sort=stop").await),
        ["slow", "bad", "gone"]
    );
    assert_eq!(
        names(&mon.connz_by_name("/connz?state=closed&sort=reason").await),
        ["gone", "bad", "slow"]
    );
}

/// `max_closed_clients` bounds the list: only the newest are kept.
#[tokio::test]
async fn closed_connections_ring_is_bounded() {
    let mon = Mon::start_with("max_closed_clients: 2", false);
    for name in ["c1", "c2", "c3"] {
        let raw = raw_named(&mon.server, name).await;
        drop(raw);
        eventually(&format!("{name} closed"), || async {
            let list = mon.connz_by_name("/connz?state=closed").await;
            if list.iter().any(|c| c["name"] == name) {
                Ok(())
            } else {
                Err(format!("{list:?}"))
            }
        })
        .await;
    }
    let list = mon.json("/connz?state=closed").await;
    let names: Vec<&str> = list["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["c2", "c3"]);
    assert_eq!(list["total"], 2);
}

/// `/healthz` with `account`, `stream`, `consumer`, `js-enabled-only`, `js-server-only` and
/// `details`: the reference's codes and bodies.
#[tokio::test]
async fn healthz_checks_the_named_assets() {
    let mon = Mon::start(true);
    let client = mon.client("health").await;
    api(
        &client,
        "STREAM.CREATE.FILE",
        json!({"name": "FILE", "subjects": ["f.>"], "storage": "file"}),
    )
    .await;
    create_durable(&client, "FILE", "fc").await;
    create_stream(&client, "MEM", &["m.>"]).await;
    let ok = r#"{"status":"ok"}"#;
    let cases: &[(&str, u16, &str)] = &[
        ("", 200, ok),
        ("js-enabled-only=true", 200, ok),
        ("js-server-only=true", 200, ok),
        ("account=$G", 200, ok),
        ("account=$G&stream=FILE", 200, ok),
        ("account=$G&stream=FILE&consumer=fc", 200, ok),
        (
            "account=NOPE",
            404,
            r#"{"status":"unavailable","error":"JetStream account \"NOPE\" not found"}"#,
        ),
        (
            "account=$SYS",
            404,
            r#"{"status":"unavailable","error":"JetStream account \"$SYS\" not found"}"#,
        ),
        (
            "account=$G&stream=NOPE",
            404,
            r#"{"status":"unavailable","error":"JetStream stream \"NOPE\" not found on account \"$G\""}"#,
        ),
        (
            "account=$G&stream=FILE&consumer=nope",
            404,
            r#"{"status":"unavailable","error":"JetStream consumer \"nope\" not found for stream \"FILE\" on account \"$G\""}"#,
        ),
        (
            "stream=FILE",
            400,
            r#"{"status":"error","error":"\"account\" must not be empty when checking stream health"}"#,
        ),
        (
            "account=$G&consumer=fc",
            400,
            r#"{"status":"error","error":"\"stream\" must not be empty when checking consumer health"}"#,
        ),
        // Only JetStream itself (or only the server) is checked: the names are not.
        ("account=$G&stream=NOPE&js-enabled-only=true", 200, ok),
        ("account=$G&stream=NOPE&js-server-only=true", 200, ok),
        ("account=$G&stream=NOPE&js-enabled=true", 200, ok),
        ("details=true", 200, ok),
        (
            "details=true&account=$G&stream=NOPE",
            404,
            r#"{"status":"error","errors":[{"type":"STREAM","account":"$G","stream":"NOPE","error":"JetStream stream \"NOPE\" not found on account \"$G\""}]}"#,
        ),
        (
            "details=true&account=$G&stream=FILE&consumer=nope",
            404,
            r#"{"status":"error","errors":[{"type":"CONSUMER","account":"$G","stream":"FILE","consumer":"nope","error":"JetStream consumer \"nope\" not found for stream \"FILE\" on account \"$G\""}]}"#,
        ),
        (
            "details=1&account=NOPE",
            404,
            r#"{"status":"error","errors":[{"type":"ACCOUNT","account":"NOPE","error":"JetStream account \"NOPE\" not found"}]}"#,
        ),
        (
            "details=true&stream=X",
            400,
            r#"{"status":"error","errors":[{"type":"BAD_REQUEST","error":"\"account\" must not be empty when checking stream health"}]}"#,
        ),
    ];
    for (q, status, body) in cases {
        let r = mon.get(&format!("/healthz?{q}")).await;
        assert_eq!(
            (r.status, r.body.as_str()),
            (*status, *body),
            "/healthz?{q}"
        );
        assert_eq!(r.header("content-type"), Some("application/json"), "{q}");
    }
    // A memory stream: the reference looks for stream directories on disk and so reports
    // its memory streams missing; Keel reports the stream it has (a documented difference).
    let r = mon.get("/healthz?account=$G&stream=MEM").await;
    if is_reference() {
        assert_eq!(r.status, 404, "{}", r.body);
    } else {
        assert_eq!((r.status, r.body.as_str()), (200, ok));
    }
}

/// Sysinfo total RAM: what the reference (Go's sysmem) bases the default limit on.
fn total_ram() -> u64 {
    // SAFETY: sysinfo fills the struct it is given.
    unsafe {
        let mut info: libc::sysinfo = std::mem::zeroed();
        assert_eq!(libc::sysinfo(&mut info), 0);
        info.totalram as u64 * info.mem_unit as u64
    }
}

/// With no `max_memory_store` / `max_file_store`, the JetStream limits are the reference's
/// defaults from the machine (3/4 of RAM, 3/4 of the store's free disk), not -1, in `/jsz`
/// and `/varz`; `$JS.API.INFO` shows the account's own limits, unlimited (-1).
#[tokio::test]
async fn jetstream_limits_are_real_when_unset() {
    let mon = Mon::start(true);
    let jsz = mon.json("/jsz").await;
    let varz = mon.json("/varz").await;
    let want_mem = total_ram() / 4 * 3;
    for cfg in [&jsz["config"], &varz["jetstream"]["config"]] {
        assert_eq!(cfg["max_memory"].as_u64(), Some(want_mem), "{cfg}");
        let store = cfg["max_storage"].as_u64().expect("max_storage");
        let dir = std::ffi::CString::new(cfg["store_dir"].as_str().unwrap()).unwrap();
        // SAFETY: statfs fills the struct; `dir` is NUL-terminated.
        let avail = unsafe {
            let mut fs: libc::statfs = std::mem::zeroed();
            assert_eq!(libc::statfs(dir.as_ptr(), &mut fs), 0);
            fs.f_bavail as u64 * fs.f_bsize as u64 / 4 * 3
        };
        // Other processes write to the same disk meanwhile: close, not equal.
        let diff = store.abs_diff(avail);
        assert!(
            diff < avail / 20,
            "max_storage {store} vs 3/4 of free {avail}"
        );
    }
    let client = mon.client("limits").await;
    let info = api(&client, "INFO", Value::Null).await;
    assert_eq!(
        (
            info["limits"]["max_memory"].as_i64(),
            info["limits"]["max_storage"].as_i64()
        ),
        (Some(-1), Some(-1)),
        "{info}"
    );
    if !is_reference() {
        let m = mon.metrics().await;
        assert_eq!(
            metric(&m, "jetstream_server_max_memory", &[]),
            Some(want_mem as f64)
        );
        assert_eq!(
            metric(&m, "gnatsd_varz_jetstream_config_max_memory", &[]),
            Some(want_mem as f64)
        );
    }
    drop(mon);
    // A configured limit is reported as configured.
    let mon = Mon::start_with("jetstream { max_memory_store: 64MB }", false);
    let jsz = mon.json("/jsz").await;
    assert_eq!(jsz["config"]["max_memory"], 64 * 1024 * 1024, "{jsz:#}");
}

/// The nats-server release each JetStream API level arrived in.
fn level_of_release(version: &str) -> Option<u64> {
    let minor: u64 = version.split('.').nth(1)?.parse().ok()?;
    Some(match minor {
        0..=10 => 0,
        11 => 1,
        12 => 2,
        14 => 4,
        15 => 5,
        _ => return None,
    })
}

/// INFO `version`, `/varz` `version`, `_nats.ver`, and the API level in `/jsz`, `/varz`,
/// `$JS.API.INFO` and `_nats.level` all tell the same story: the level is the one the
/// advertised nats-server release introduced.
#[tokio::test]
async fn api_level_and_version_agree() {
    let mon = Mon::start(true);
    let info = mon.server.raw().await.info_json();
    let version = info["version"].as_str().expect("INFO version").to_string();
    let varz = mon.json("/varz").await;
    assert_eq!(varz["version"], version.as_str());
    let client = mon.client("levels").await;
    let js_info = api(&client, "INFO", Value::Null).await;
    create_stream(&client, "LV", &["lv.>"]).await;
    let st = api(&client, "STREAM.INFO.LV", Value::Null).await;
    let meta = &st["config"]["metadata"];
    assert_eq!(meta["_nats.ver"], version.as_str(), "{st}");
    let level = js_info["api"]["level"].as_u64().expect("api level");
    assert_eq!(meta["_nats.level"], level.to_string().as_str());
    assert_eq!(mon.json("/jsz").await["api"]["level"].as_u64(), Some(level));
    assert_eq!(
        varz["jetstream"]["stats"]["api"]["level"].as_u64(),
        Some(level)
    );
    // 2.12.x moved from level 2 to 3 within the series; every other release has one level.
    if level_of_release(&version) != Some(2) || level != 3 {
        assert_eq!(level_of_release(&version), Some(level), "version {version}");
    }
}

/// The names prometheus-nats-exporter publishes for a nats-server with `-varz -jsz=all`
/// (its varz names are the reference's `/varz` numbers flattened; its jsz names are fixed),
/// plus its `-connz -healthz -accstatz -subz -routez` families. Left out, because they do not
/// apply to Keel: `gnatsd_varz_jetstream_config_sync_interval` (Keel syncs before every ack
/// unless `sync_interval` is set; then it is there), `gnatsd_varz_jetstream_limits_*` (no
/// default consumer limit), and the source/mirror families (no sources or mirrors yet).
const EXPORTER_NAMES: &[&str] = &[
    "gnatsd_varz_server_id",
    "gnatsd_varz_server_name",
    "gnatsd_varz_version",
    "gnatsd_varz_proto",
    "gnatsd_varz_port",
    "gnatsd_varz_max_connections",
    "gnatsd_varz_ping_interval",
    "gnatsd_varz_ping_max",
    "gnatsd_varz_http_port",
    "gnatsd_varz_https_port",
    "gnatsd_varz_auth_timeout",
    "gnatsd_varz_max_control_line",
    "gnatsd_varz_max_payload",
    "gnatsd_varz_max_pending",
    "gnatsd_varz_jetstream_config_max_memory",
    "gnatsd_varz_jetstream_config_max_storage",
    "gnatsd_varz_jetstream_stats_memory",
    "gnatsd_varz_jetstream_stats_storage",
    "gnatsd_varz_jetstream_stats_reserved_memory",
    "gnatsd_varz_jetstream_stats_reserved_storage",
    "gnatsd_varz_jetstream_stats_accounts",
    "gnatsd_varz_jetstream_stats_ha_assets",
    "gnatsd_varz_jetstream_stats_api_level",
    "gnatsd_varz_jetstream_stats_api_total",
    "gnatsd_varz_jetstream_stats_api_errors",
    "gnatsd_varz_tls_timeout",
    "gnatsd_varz_write_deadline",
    "gnatsd_varz_start",
    "gnatsd_varz_mem",
    "gnatsd_varz_cores",
    "gnatsd_varz_gomaxprocs",
    "gnatsd_varz_cpu",
    "gnatsd_varz_connections",
    "gnatsd_varz_total_connections",
    "gnatsd_varz_routes",
    "gnatsd_varz_remotes",
    "gnatsd_varz_leafnodes",
    "gnatsd_varz_in_msgs",
    "gnatsd_varz_in_bytes",
    "gnatsd_varz_in_client_msgs",
    "gnatsd_varz_in_client_bytes",
    "gnatsd_varz_out_msgs",
    "gnatsd_varz_out_bytes",
    "gnatsd_varz_out_client_msgs",
    "gnatsd_varz_out_client_bytes",
    "gnatsd_varz_slow_consumers",
    "gnatsd_varz_stale_connections",
    "gnatsd_varz_stalled_clients",
    "gnatsd_varz_subscriptions",
    "gnatsd_varz_http_req_stats_varz",
    "gnatsd_varz_config_load_time",
    "gnatsd_varz_slow_consumer_stats_clients",
    "gnatsd_varz_slow_consumer_stats_routes",
    "gnatsd_varz_slow_consumer_stats_gateways",
    "gnatsd_varz_slow_consumer_stats_leafs",
    "gnatsd_varz_stale_connection_stats_clients",
    "gnatsd_varz_stale_connection_stats_routes",
    "gnatsd_varz_stale_connection_stats_gateways",
    "gnatsd_varz_stale_connection_stats_leafs",
    "gnatsd_varz_disk_io_wait_stats_waiters",
    "gnatsd_varz_disk_io_wait_stats_waits",
    "gnatsd_varz_disk_io_wait_stats_wait_time",
    "gnatsd_varz_disk_io_wait_stats_max_wait_time",
    "jetstream_server_jetstream_disabled",
    "jetstream_server_total_streams",
    "jetstream_server_total_consumers",
    "jetstream_server_total_messages",
    "jetstream_server_total_message_bytes",
    "jetstream_server_max_memory",
    "jetstream_server_max_storage",
    "jetstream_account_max_memory",
    "jetstream_account_max_storage",
    "jetstream_account_storage_used",
    "jetstream_account_memory_used",
    "jetstream_stream_total_messages",
    "jetstream_stream_limit_messages",
    "jetstream_stream_total_bytes",
    "jetstream_stream_limit_bytes",
    "jetstream_stream_first_seq",
    "jetstream_stream_last_seq",
    "jetstream_stream_consumer_count",
    "jetstream_stream_subject_count",
    "jetstream_consumer_delivered_consumer_seq",
    "jetstream_consumer_delivered_stream_seq",
    "jetstream_consumer_last_delivery_seconds",
    "jetstream_consumer_last_ack_seconds",
    "jetstream_consumer_num_ack_pending",
    "jetstream_consumer_num_redelivered",
    "jetstream_consumer_num_waiting",
    "jetstream_consumer_num_pending",
    "jetstream_consumer_ack_floor_stream_seq",
    "jetstream_consumer_ack_floor_consumer_seq",
    "gnatsd_connz_num_connections",
    "gnatsd_connz_total",
    "gnatsd_connz_offset",
    "gnatsd_connz_limit",
    "gnatsd_connz_pending_bytes",
    "gnatsd_connz_subscriptions",
    "gnatsd_connz_in_bytes",
    "gnatsd_connz_out_bytes",
    "gnatsd_connz_in_msgs",
    "gnatsd_connz_out_msgs",
    "gnatsd_healthz_status",
    "gnatsd_healthz_status_value",
    "gnatsd_healthz_js_enabled_only_status",
    "gnatsd_healthz_js_server_only_status",
    "gnatsd_accstatz_current_connections",
    "gnatsd_accstatz_total_connections",
    "gnatsd_accstatz_subscriptions",
    "gnatsd_accstatz_leaf_nodes",
    "gnatsd_accstatz_sent_messages",
    "gnatsd_accstatz_sent_bytes",
    "gnatsd_accstatz_received_messages",
    "gnatsd_accstatz_received_bytes",
    "gnatsd_accstatz_slow_consumers",
    "gnatsd_subsz_num_subscriptions",
    "gnatsd_subsz_num_cache",
    "gnatsd_subsz_num_inserts",
    "gnatsd_subsz_num_removes",
    "gnatsd_subsz_num_matches",
    "gnatsd_subsz_cache_hit_rate",
    "gnatsd_subsz_max_fanout",
    "gnatsd_subsz_avg_fanout",
    "gnatsd_routez_num_routes",
];

/// A stream and a consumer that has delivered and had an ack, so every family has a series.
async fn scenario_with_traffic(mon: &Mon) -> Client {
    let client = mon.client("traffic").await;
    create_stream(&client, "S", &["s.>"]).await;
    create_durable(&client, "S", "c").await;
    for _ in 0..3 {
        js_publish(&client, "s.x", "hello").await;
    }
    let msgs = fetch(&client, "S", "c", 1).await;
    client
        .publish(msgs[0].reply.clone().unwrap(), Bytes::new())
        .await
        .unwrap();
    client.flush().await.unwrap();
    eventually("ack seen", || async {
        let cd = mon.jsz_consumer("S", "c").await;
        match cd["ack_floor"]["stream_seq"].as_u64() {
            Some(1) => Ok(()),
            _ => Err(cd.to_string()),
        }
    })
    .await;
    let _ = mon.get("/varz").await;
    client
}

/// `/metrics` publishes every exporter name that applies, with the exporter's labels on the
/// JetStream series, and values that agree with the JSON endpoints (keel only: the reference
/// has no `/metrics`).
#[tokio::test]
async fn metrics_cover_the_exporters_names() {
    if is_reference() {
        return;
    }
    let mon = Mon::start(true);
    let _client = scenario_with_traffic(&mon).await;
    let m = mon.metrics().await;
    let published: BTreeSet<&str> = m.iter().map(|s| s.name.as_str()).collect();
    let missing: Vec<_> = EXPORTER_NAMES
        .iter()
        .filter(|n| !published.contains(**n))
        .collect();
    assert!(missing.is_empty(), "not published: {missing:?}");

    let label_names = |name: &str| -> Vec<String> {
        let s = m.iter().find(|s| s.name == name).unwrap();
        s.labels.iter().map(|(k, _)| k.clone()).collect()
    };
    let server = [
        "server_id",
        "server_name",
        "cluster",
        "domain",
        "meta_leader",
        "is_meta_leader",
    ];
    assert_eq!(label_names("jetstream_server_total_streams"), server);
    let mut account: Vec<&str> = server.to_vec();
    account.extend(["account", "account_name", "account_id"]);
    assert_eq!(label_names("jetstream_account_memory_used"), account);
    let mut stream = account.clone();
    stream.extend([
        "stream_name",
        "stream_leader",
        "is_stream_leader",
        "stream_raft_group",
    ]);
    let mut stream_keel = stream.clone();
    stream_keel.push("stream");
    assert_eq!(label_names("jetstream_stream_total_messages"), stream_keel);
    let mut consumer = stream.clone();
    consumer.extend([
        "consumer_name",
        "consumer_leader",
        "is_consumer_leader",
        "consumer_desc",
        "stream",
        "consumer",
    ]);
    assert_eq!(label_names("jetstream_consumer_num_pending"), consumer);
    let c = m
        .iter()
        .find(|s| s.name == "jetstream_consumer_num_pending")
        .unwrap();
    assert_eq!(c.label("is_meta_leader"), Some("true"));
    assert_eq!(c.label("is_stream_leader"), Some("true"));
    assert_eq!(c.label("is_consumer_leader"), Some("true"));
    assert_eq!(c.label("stream_leader"), c.label("server_name"));
    assert_eq!(c.value, 2.0);
    assert!(
        metric(
            &m,
            "jetstream_consumer_last_ack_seconds",
            &[("consumer", "c")]
        ) >= Some(0.0)
    );

    // Values agree with the endpoints.
    assert_eq!(metric(&m, "gnatsd_healthz_status", &[]), Some(0.0));
    assert_eq!(
        metric(&m, "gnatsd_healthz_status_value", &[("value", "ok")]),
        Some(1.0)
    );
    assert_eq!(metric(&m, "gnatsd_connz_num_connections", &[]), Some(1.0));
    assert_eq!(
        metric(
            &m,
            "gnatsd_accstatz_current_connections",
            &[("account", "$G")]
        ),
        Some(1.0)
    );
    assert_eq!(metric(&m, "gnatsd_varz_connections", &[]), Some(1.0));
    let start = metric(&m, "gnatsd_varz_start", &[]).unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as f64;
    assert!(
        start <= now_ms && start > now_ms - 600_000.0,
        "start {start}"
    );
    let version = m.iter().find(|s| s.name == "gnatsd_varz_version").unwrap();
    assert_eq!(
        version.label("value"),
        mon.json("/varz").await["version"].as_str()
    );
    // The account's own limit is unlimited, as the reference shows it (uint64 max).
    assert_eq!(
        metric(&m, "jetstream_account_max_memory", &[("account", "$G")]),
        Some(u64::MAX as f64)
    );
}

/// Whether an external tool a test needs is there. Without it the test skips with a loud
/// note, unless `KEEL_MONITORING_TOOLS=required` (scripts/test.sh sets it once
/// scripts/monitoring-test-tools.sh installed everything): then it fails.
fn have_tool(what: &str, found: bool) -> bool {
    if found {
        return true;
    }
    let msg = format!(
        "{what} is not installed: run scripts/monitoring-test-tools.sh (this test is SKIPPED)"
    );
    if std::env::var("KEEL_MONITORING_TOOLS").as_deref() == Ok("required") {
        panic!("{msg}");
    }
    eprintln!("!!!! {msg}");
    false
}

fn repo_path(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// `GET path` with extra request headers.
async fn http_get_with(port: u16, path: &str, headers: &str) -> Http {
    within(&format!("GET {path}"), async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let req =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.unwrap();
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        Http {
            status,
            headers,
            body: String::from_utf8_lossy(&raw[split + 4..]).into_owned(),
        }
    })
    .await
}

/// The dashboard's page and assets are served from the binary with a strict content policy
/// and an ETag (a refresh revalidates to 304); `/dashboard/data` has the streams, consumers
/// and history the page shows, and `since` trims the history to what the page lacks;
/// `http_dashboard: false` turns it all off. Keel only: the reference has no dashboard.
#[tokio::test]
async fn dashboard_is_served_and_can_be_turned_off() {
    if is_reference() {
        return;
    }
    let mon = Mon::start(true);
    let client = mon.client("dash").await;
    create_stream(&client, "ORDERS", &["orders.>"]).await;
    create_durable(&client, "ORDERS", "order-worker").await;
    js_publish(&client, "orders.new", "1").await;
    for (path, ctype) in [
        ("/dashboard", "text/html; charset=utf-8"),
        ("/dashboard/app.js", "text/javascript; charset=utf-8"),
        ("/dashboard/app.css", "text/css; charset=utf-8"),
    ] {
        let r = mon.get(path).await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some(ctype), "{path}");
        let csp = r.header("content-security-policy").unwrap_or_default();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("script-src 'self'"),
            "{csp}"
        );
        let etag = r.header("etag").expect("etag").to_string();
        let again = http_get_with(mon.port, path, &format!("If-None-Match: {etag}\r\n")).await;
        assert_eq!(again.status, 304, "{path}");
        assert!(again.body.is_empty());
    }
    assert!(mon.get("/").await.body.contains("./dashboard"));
    let d = mon.json_compact("/dashboard/data").await;
    assert_eq!(d["streams"][0]["name"], "ORDERS");
    assert_eq!(d["streams"][0]["messages"], 1);
    assert_eq!(d["consumers"][0]["name"], "order-worker");
    assert_eq!(d["consumers"][0]["num_pending"], 1);
    assert_eq!(d["consumers"][0]["max_ack_pending"], 1000);
    assert!(d["server"]["jetstream"]["max_memory"].as_i64() > Some(0));
    // The sampler has taken its first sample at start.
    let seq = d["history"]["seq"].as_u64().unwrap();
    assert!(seq >= 1, "{d}");
    let later = mon
        .json_compact(&format!("/dashboard/data?since={seq}"))
        .await;
    assert!(
        later["history"]["t"].as_array().unwrap().len() <= 1,
        "{later}"
    );
    assert_eq!(
        mon.get("/dashboard/data?since=x").await.status,
        400,
        "bad since"
    );
    drop(mon);

    let off = Mon::start_with("http_dashboard: false", false);
    for path in ["/dashboard", "/dashboard/app.js", "/dashboard/data"] {
        assert_eq!(off.get(path).await.status, 404, "{path}");
    }
    assert!(!off.get("/").await.body.contains("dashboard"));
}

impl Mon {
    /// A compact JSON endpoint (the dashboard's data).
    async fn json_compact(&self, path: &str) -> Value {
        let r = self.get(path).await;
        assert_eq!(r.status, 200, "GET {path}: {}", r.body);
        assert!(
            r.body.starts_with('{') && !r.body.starts_with("{\n"),
            "{path}"
        );
        serde_json::from_str(&r.body).unwrap()
    }
}

/// The dashboard in headless Chromium (Debian's, driven by playwright-core): against a real
/// server with a stream and a consumer that keep moving, the page shows the numbers, they
/// update by themselves, the sparklines draw, nothing is fetched from anywhere but the
/// server, and no script error occurs. Saves a screenshot (`KEEL_DASHBOARD_SCREENSHOT=path`
/// to keep it; docs/dashboard.png is made with that and `KEEL_DASHBOARD_MIN_POINTS=12`).
/// Keel only; skipped loudly when the browser tools are missing (see `have_tool`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_headless_chromium() {
    if is_reference() {
        return;
    }
    let chromium =
        std::env::var("KEEL_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".to_string());
    let script_dir = repo_path("tests/dashboard");
    if !have_tool("chromium", std::path::Path::new(&chromium).exists())
        || !have_tool(
            "playwright-core (tests/dashboard/node_modules)",
            script_dir.join("node_modules/playwright-core").exists(),
        )
    {
        return;
    }
    let mon = Mon::start_with("server_name: keel-1", true);
    let client = mon.client("order-service").await;
    api(
        &client,
        "STREAM.CREATE.ORDERS",
        json!({"name": "ORDERS", "subjects": ["orders.>"], "storage": "file",
               "max_msgs": 100_000}),
    )
    .await;
    create_stream(&client, "EVENTS", &["events.>"]).await;
    create_durable(&client, "ORDERS", "order-worker").await;
    create_durable(&client, "EVENTS", "analytics").await;
    for i in 0..50 {
        js_publish(&client, "orders.new", "{\"id\":1}").await;
        if i % 2 == 0 {
            js_publish(&client, "events.click", "x").await;
        }
    }
    // Traffic while the page is open: publishes, and a worker taking and acking some.
    // Chromium starting beside another test on a 2-core CI machine can hold one fsync for
    // seconds (a CI run once saw a publish take over 5 s), so a publish may take up to 30 s
    // here: this test is about the page. A publish that never completes still fails it.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let mut n = 0u64;
            let publish = |subject: &'static str, payload: &'static str| {
                let client = client.clone();
                async move {
                    let t = Instant::now();
                    let body = Bytes::from_static(payload.as_bytes());
                    let limit = Duration::from_secs(30);
                    let (_, ack) = json_request_within(&client, subject, body, limit).await;
                    assert!(ack.get("seq").is_some(), "publish to {subject}: {ack}");
                    t.elapsed()
                }
            };
            let mut slowest = Duration::ZERO;
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && started.elapsed() < Duration::from_secs(240)
            {
                slowest = slowest.max(publish("orders.new", "{\"id\":2}").await);
                slowest = slowest.max(publish("events.click", "y").await);
                if n.is_multiple_of(3) {
                    let msgs = fetch(&client, "ORDERS", "order-worker", 2).await;
                    client
                        .publish(msgs[0].reply.clone().unwrap(), Bytes::new())
                        .await
                        .unwrap();
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if slowest > STEP {
                eprintln!("note: the slowest publish during the page check took {slowest:?}");
            }
        })
    };
    let shot = std::env::var("KEEL_DASHBOARD_SCREENSHOT").map_or_else(
        |_| std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png"),
        std::path::PathBuf::from,
    );
    let url = format!("http://127.0.0.1:{}/dashboard", mon.port);
    let run = tokio::process::Command::new("node")
        .arg(script_dir.join("check.mjs"))
        .arg(&url)
        .arg(&shot)
        .env("KEEL_CHROMIUM", &chromium)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(240), run)
        .await
        .expect("browser check timed out")
        .expect("run node");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // The traffic's own failure first: without traffic the page has nothing to show.
    if let Err(e) = traffic.await {
        std::panic::resume_unwind(e.into_panic());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "browser check failed:\n{stdout}\n{stderr}"
    );
    let v: Value = serde_json::from_str(stdout.trim().lines().last().unwrap_or("{}"))
        .unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let num = |s: &Value| -> u64 {
        s.as_str()
            .unwrap_or("")
            .replace(',', "")
            .parse()
            .unwrap_or(0)
    };
    assert!(num(&v["first"]["messages"]) >= 50, "{v:#}");
    assert!(
        num(&v["later"]["messages"]) > num(&v["first"]["messages"]),
        "{v:#}"
    );
    assert!(v["sparkline_points"].as_u64() >= Some(2), "{v:#}");
    assert!(v["consumer_sparkline_points"].as_u64() >= Some(2), "{v:#}");
    assert_eq!(v["foreign_requests"], json!([]), "{v:#}");
    assert_eq!(v["errors"], json!([]), "{v:#}");
    for card in ["Connections", "Msgs in/s", "Slow consumers", "Memory (RSS)"] {
        assert!(
            v["cards"].as_array().unwrap().iter().any(|c| c == card),
            "{card}: {v:#}"
        );
    }
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{}",
        png.len()
    );
    eprintln!("dashboard screenshot: {}", shot.display());
}

/// `/subsz` cache figures move with traffic: repeated publishes to one subject are matched
/// from the cache (`cache_hit_rate` > 0, `num_matches` grows), the result is cached
/// (`num_cache`) and its fan-out (two subscriptions and a queue group: 3) shows in
/// `max_fanout`; `/accountz?acc=$G` carries the same figures.
#[tokio::test]
async fn subsz_cache_counters_follow_traffic() {
    let mon = Mon::start(false);
    let subs = mon.client("subs").await;
    let mut a = subs.subscribe("fan.x").await.unwrap();
    let _b = subs.subscribe("fan.*").await.unwrap();
    let _q = subs
        .queue_subscribe("fan.x", "workers".into())
        .await
        .unwrap();
    common::sync(&subs).await;
    let before = mon.json("/subsz").await;
    let publisher = mon.client("pub").await;
    for _ in 0..20 {
        publisher
            .publish("fan.x", Bytes::from_static(b"x"))
            .await
            .unwrap();
    }
    // Delivered, so matched; no new subscription (that would invalidate the caches).
    for _ in 0..20 {
        common::next_msg(&mut a).await;
    }
    let after = mon.json("/subsz").await;
    let n = |v: &Value, k: &str| v[k].as_f64().unwrap_or(-1.0);
    assert!(
        n(&after, "num_matches") > n(&before, "num_matches"),
        "{after:#}"
    );
    assert!(n(&after, "cache_hit_rate") > 0.0, "{after:#}");
    assert!(n(&after, "num_cache") >= 1.0, "{after:#}");
    assert!(n(&after, "max_fanout") >= 3.0, "{after:#}");
    assert!(n(&after, "avg_fanout") > 0.0, "{after:#}");
    let acc = mon.json("/accountz?acc=$G").await;
    let st = &acc["account_detail"]["sublist_stats"];
    assert!(
        n(st, "num_matches") > 0.0 && n(st, "num_cache") >= 1.0,
        "{acc:#}"
    );
    if !is_reference() {
        let m = mon.metrics().await;
        assert!(metric(&m, "gnatsd_subsz_cache_hit_rate", &[]) > Some(0.0));
    }
}
