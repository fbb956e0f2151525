//! JetStream streams: the `$JS.API.STREAM.*` / `$JS.API.INFO` API, publish
//! acknowledgements, limits, purge, message get/delete, direct get and file
//! store durability across a SIGKILL.
//!
//! Expectations come from the reference nats-server 2.15.1 (run these tests
//! with `KEEL_TEST_REFERENCE=1` to check them against it). Error
//! checks go through raw requests so the wire JSON (`code`, `err_code`,
//! `description`) is asserted, not the client library's interpretation.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{Config, DirectGetErrorKind, DiscardPolicy, StorageType};
use async_nats::jetstream::{self, Context};
use async_nats::{Client, HeaderMap};
use bytes::Bytes;
use common::{api_err, api_error, js_setup, json_request, within, Server};
use serde_json::{json, Value};

const API: &str = "$JS.API";

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

/// Creates a stream from a raw JSON config; panics on an error response.
async fn create_raw(client: &Client, config: Value) -> Value {
    let name = config["name"].as_str().expect("config.name").to_string();
    let (_, resp) = json_request(
        client,
        &format!("{API}.STREAM.CREATE.{name}"),
        config.to_string(),
    )
    .await;
    assert!(
        resp.get("error").is_none(),
        "creating {name} failed: {resp}"
    );
    resp
}

/// Raw `STREAM.INFO` (with an optional request body); returns the response.
async fn info_raw(client: &Client, name: &str, body: Option<Value>) -> Value {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    json_request(client, &format!("{API}.STREAM.INFO.{name}"), body)
        .await
        .1
}

/// `state` of a stream (raw `STREAM.INFO`, no error allowed).
async fn state(client: &Client, name: &str) -> Value {
    let resp = info_raw(client, name, None).await;
    assert!(resp.get("error").is_none(), "info {name} failed: {resp}");
    resp["state"].clone()
}

/// Publishes with a reply subject (a JetStream publish done by hand) and
/// returns the raw ack text and its JSON.
async fn publish_raw(
    client: &Client,
    subject: &str,
    headers: &[(&str, &str)],
    payload: &[u8],
) -> (String, Value) {
    let payload = Bytes::copy_from_slice(payload);
    let reply = if headers.is_empty() {
        within("publish", client.request(subject.to_string(), payload)).await
    } else {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(*k, *v);
        }
        within(
            "publish",
            client.request_with_headers(subject.to_string(), map, payload),
        )
        .await
    }
    .unwrap_or_else(|e| panic!("publish to {subject} failed: {e}"));
    let text = String::from_utf8_lossy(&reply.payload).into_owned();
    let json = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("ack from {subject} is not JSON ({e}): {text:?}"));
    (text, json)
}

/// Publishes and asserts a successful ack with the given sequence.
async fn publish_ok(client: &Client, subject: &str, payload: &[u8], seq: u64) {
    let (_, ack) = publish_raw(client, subject, &[], payload).await;
    assert!(ack.get("error").is_none(), "publish {subject}: {ack}");
    assert_eq!(ack["seq"], seq, "publish {subject}: {ack}");
}

/// Asserts an error ack: `{"error":{..},"stream":<stream>,"seq":0}`.
fn assert_error_ack(ack: &Value, stream: &str, code: u64, err_code: u64, description: &str) {
    assert_eq!(
        api_error(ack),
        (code, err_code, description.to_string()),
        "ack {ack}"
    );
    assert_eq!(ack["stream"], stream, "ack {ack}");
    assert_eq!(ack["seq"], 0, "ack {ack}");
    assert!(ack.get("type").is_none(), "error acks carry no type: {ack}");
}

/// The JetStream API error carried somewhere in an error's source chain.
fn js_error<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a jetstream::Error> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(js) = e.downcast_ref::<jetstream::Error>() {
            return Some(js);
        }
        cur = e.source();
    }
    None
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Stored size of a message as the reference accounts it in `state.bytes`.
fn file_size(subject: &str, hdr_len: usize, data_len: usize) -> u64 {
    if hdr_len == 0 {
        (30 + subject.len() + data_len) as u64
    } else {
        (34 + subject.len() + hdr_len + data_len) as u64
    }
}

fn mem_size(subject: &str, hdr_len: usize, data_len: usize) -> u64 {
    (16 + subject.len() + hdr_len + data_len) as u64
}

/// Length of the header block async-nats puts on the wire for `headers`
/// (`NATS/1.0\r\n` + `Name: value\r\n`... + `\r\n`).
fn header_block_len(headers: &[(&str, &str)]) -> usize {
    10 + headers
        .iter()
        .map(|(k, v)| k.len() + 2 + v.len() + 2)
        .sum::<usize>()
        + 2
}

/// Polls `STREAM.INFO` until `done(state)` holds, or panics after `wait`.
async fn wait_for_state(
    client: &Client,
    name: &str,
    wait: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + wait;
    loop {
        let st = state(client, name).await;
        if done(&st) {
            return st;
        }
        if Instant::now() >= deadline {
            panic!("stream {name} did not reach the expected state within {wait:?}: {st}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------
// account info
// ---------------------------------------------------------------------------

#[tokio::test]
async fn account_info_shape_and_counters() {
    let (_server, client, js) = js_setup().await;

    let (text, info) = json_request(&client, &format!("{API}.INFO"), "").await;
    assert!(
        text.starts_with(r#"{"type":"io.nats.jetstream.api.v1.account_info_response","#),
        "{text}"
    );
    assert_eq!(
        keys(&info),
        set(&[
            "type",
            "memory",
            "storage",
            "reserved_memory",
            "reserved_storage",
            "streams",
            "consumers",
            "limits",
            "api"
        ])
    );
    for k in [
        "memory",
        "storage",
        "reserved_memory",
        "reserved_storage",
        "streams",
        "consumers",
    ] {
        assert_eq!(info[k], 0, "fresh server {k}: {info}");
    }
    let limits = &info["limits"];
    assert_eq!(
        keys(limits),
        set(&[
            "max_memory",
            "max_storage",
            "max_streams",
            "max_consumers",
            "max_ack_pending",
            "memory_max_stream_bytes",
            "storage_max_stream_bytes",
            "max_bytes_required"
        ])
    );
    for k in [
        "max_memory",
        "max_storage",
        "max_streams",
        "max_consumers",
        "max_ack_pending",
        "memory_max_stream_bytes",
        "storage_max_stream_bytes",
    ] {
        assert_eq!(limits[k], -1, "limits.{k}: {limits}");
    }
    assert_eq!(limits["max_bytes_required"], false);
    assert_eq!(keys(&info["api"]), set(&["level", "total", "errors"]));
    assert!(info["api"]["level"].as_u64().unwrap() >= 1, "{info}");
    let errors_before = info["api"]["errors"].as_u64().unwrap();

    // One memory and one file stream, one message each, one consumer.
    create_raw(
        &client,
        json!({"name": "MEM", "subjects": ["mem"], "storage": "memory", "max_bytes": 4096}),
    )
    .await;
    create_raw(&client, json!({"name": "FILE", "subjects": ["file"]})).await;
    publish_ok(&client, "mem", b"hello", 1).await;
    publish_ok(&client, "file", b"hello", 1).await;
    let stream = js.get_stream("FILE").await.expect("get FILE");
    stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("C1".to_string()),
            ..Default::default()
        })
        .await
        .expect("create consumer");

    // An API error bumps api.errors.
    let (code, err_code, _) = api_err(&client, &format!("{API}.STREAM.INFO.NOPE"), "").await;
    assert_eq!((code, err_code), (404, 10059));

    let (_, info) = json_request(&client, &format!("{API}.INFO"), "").await;
    assert_eq!(info["streams"], 2, "{info}");
    assert_eq!(info["consumers"], 1, "{info}");
    assert_eq!(info["memory"], mem_size("mem", 0, 5), "{info}");
    assert_eq!(info["storage"], file_size("file", 0, 5), "{info}");
    // reserved_memory counts max_bytes of memory streams.
    assert_eq!(info["reserved_memory"], 4096, "{info}");
    assert_eq!(
        info["api"]["errors"].as_u64().unwrap(),
        errors_before + 1,
        "{info}"
    );
    assert!(info["api"]["total"].as_u64().unwrap() >= 6, "{info}");

    // The client library's view agrees.
    let account = within("query_account", js.query_account())
        .await
        .expect("query_account");
    assert_eq!(account.streams, 2);
    assert_eq!(account.consumers, 1);

    // Deleting a stream drops it and its consumers from the counts.
    js.delete_stream("FILE").await.expect("delete FILE");
    let (_, info) = json_request(&client, &format!("{API}.INFO"), "").await;
    assert_eq!(info["streams"], 1, "{info}");
    assert_eq!(info["consumers"], 0, "{info}");
    assert_eq!(info["storage"], 0, "{info}");
}

// ---------------------------------------------------------------------------
// stream create
// ---------------------------------------------------------------------------

/// Every config key the server echoes for a minimal create.
const DEFAULT_CONFIG_KEYS: &[&str] = &[
    "name",
    "subjects",
    "retention",
    "max_consumers",
    "max_msgs",
    "max_bytes",
    "max_age",
    "max_msgs_per_subject",
    "max_msg_size",
    "discard",
    "storage",
    "num_replicas",
    "duplicate_window",
    "compression",
    "allow_direct",
    "mirror_direct",
    "sealed",
    "deny_delete",
    "deny_purge",
    "allow_rollup_hdrs",
    "consumer_limits",
    "allow_msg_ttl",
    "metadata",
];

#[tokio::test]
async fn create_minimal_fills_in_defaults() {
    let (_server, client, _js) = js_setup().await;

    let (text, resp) = json_request(
        &client,
        &format!("{API}.STREAM.CREATE.ORDERS"),
        r#"{"name":"ORDERS","subjects":["orders.>"]}"#,
    )
    .await;
    assert!(
        text.starts_with(
            r#"{"type":"io.nats.jetstream.api.v1.stream_create_response","config":{"name":"ORDERS","subjects":["orders.\u003e"],"retention":"limits","#
        ),
        "type first, then config in server order, '>' escaped as \\u003e: {text}"
    );
    assert_eq!(
        keys(&resp),
        set(&["type", "config", "created", "state", "ts", "did_create"])
    );
    assert_eq!(resp["did_create"], true);

    let config = &resp["config"];
    assert_eq!(keys(config), set(DEFAULT_CONFIG_KEYS), "{config}");
    let expected = json!({
        "name": "ORDERS",
        "subjects": ["orders.>"],
        "retention": "limits",
        "max_consumers": -1,
        "max_msgs": -1,
        "max_bytes": -1,
        "max_age": 0,
        "max_msgs_per_subject": -1,
        "max_msg_size": -1,
        "discard": "old",
        "storage": "file",
        "num_replicas": 1,
        "duplicate_window": 120_000_000_000u64,
        "compression": "none",
        "allow_direct": false,
        "mirror_direct": false,
        "sealed": false,
        "deny_delete": false,
        "deny_purge": false,
        "allow_rollup_hdrs": false,
        "consumer_limits": {},
        "allow_msg_ttl": false,
    });
    for (k, v) in expected.as_object().unwrap() {
        assert_eq!(&config[k], v, "config.{k}: {config}");
    }
    let metadata = config["metadata"].as_object().expect("metadata object");
    for k in ["_nats.level", "_nats.ver", "_nats.req.level"] {
        assert!(metadata[k].is_string(), "metadata.{k}: {config}");
    }
    assert_eq!(metadata["_nats.req.level"], "0");

    let st = &resp["state"];
    assert_eq!(
        keys(st),
        set(&[
            "messages",
            "bytes",
            "first_seq",
            "first_ts",
            "last_seq",
            "last_ts",
            "consumer_count"
        ])
    );
    for k in [
        "messages",
        "bytes",
        "first_seq",
        "last_seq",
        "consumer_count",
    ] {
        assert_eq!(st[k], 0, "state.{k}: {st}");
    }
    assert_eq!(st["first_ts"], "0001-01-01T00:00:00Z");
    assert_eq!(st["last_ts"], "0001-01-01T00:00:00Z");
    assert!(resp["created"].as_str().unwrap().ends_with('Z'), "{resp}");
    let created = resp["created"].clone();

    // Without subjects the stream listens on its own name.
    let resp = create_raw(&client, json!({"name": "NOSUBJ"})).await;
    assert_eq!(resp["config"]["subjects"], json!(["NOSUBJ"]));
    publish_ok(&client, "NOSUBJ", b"x", 1).await;

    // Work-queue retention is echoed as "workqueue".
    let resp = create_raw(
        &client,
        json!({"name": "WQ", "subjects": ["wq.>"], "retention": "workqueue"}),
    )
    .await;
    assert_eq!(resp["config"]["retention"], "workqueue");

    // INFO carries the same config plus paging fields and a cluster block.
    let info = info_raw(&client, "ORDERS", None).await;
    assert_eq!(
        keys(&info),
        set(&["type", "total", "offset", "limit", "config", "created", "state", "cluster", "ts"])
    );
    assert_eq!(keys(&info["config"]), set(DEFAULT_CONFIG_KEYS));
    assert_eq!(info["created"], created);
}

async fn check_full_config(js: &Context, client: &Client, name: &str, storage: StorageType) {
    let subjects = vec![
        format!("{}.*", name.to_lowercase()),
        format!("{}2.>", name.to_lowercase()),
    ];
    let config = Config {
        name: name.to_string(),
        description: Some("all the knobs".to_string()),
        subjects: subjects.clone(),
        max_consumers: 10,
        max_messages: 1000,
        max_bytes: 1 << 20,
        max_age: Duration::from_secs(3600),
        max_messages_per_subject: 5,
        max_message_size: 4096,
        discard: DiscardPolicy::New,
        storage,
        num_replicas: 1,
        duplicate_window: Duration::from_secs(30),
        allow_rollup: true,
        allow_direct: true,
        deny_delete: true,
        // deny_purge together with allow_rollup_hdrs is refused (see
        // create_repeated_and_conflicting).
        deny_purge: false,
        metadata: HashMap::from([("owner".to_string(), "test".to_string())]),
        ..Default::default()
    };
    let stream = within("create_stream", js.create_stream(config.clone()))
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
    let got = &stream.cached_info().config;
    assert_eq!(got.name, name);
    assert_eq!(got.description.as_deref(), Some("all the knobs"));
    assert_eq!(got.subjects, subjects);
    assert_eq!(got.max_consumers, 10);
    assert_eq!(got.max_messages, 1000);
    assert_eq!(got.max_bytes, 1 << 20);
    assert_eq!(got.max_age, Duration::from_secs(3600));
    assert_eq!(got.max_messages_per_subject, 5);
    assert_eq!(got.max_message_size, 4096);
    assert_eq!(got.discard, DiscardPolicy::New);
    assert_eq!(got.storage, storage);
    assert_eq!(got.duplicate_window, Duration::from_secs(30));
    assert!(got.allow_rollup && got.allow_direct && got.deny_delete && !got.deny_purge);
    assert_eq!(got.metadata.get("owner").map(String::as_str), Some("test"));
    assert!(
        got.metadata.contains_key("_nats.req.level"),
        "{:?}",
        got.metadata
    );

    // Raw view: optional keys show up once set.
    let info = info_raw(client, name, None).await;
    let raw = &info["config"];
    assert_eq!(raw["description"], "all the knobs");
    assert_eq!(raw["max_age"], 3_600_000_000_000u64);
    assert_eq!(raw["duplicate_window"], 30_000_000_000u64);
    assert_eq!(
        raw["storage"],
        if storage == StorageType::Memory {
            "memory"
        } else {
            "file"
        }
    );
    assert_eq!(raw["discard"], "new");
    assert_eq!(raw["allow_rollup_hdrs"], true);
    assert_eq!(raw["metadata"]["owner"], "test");
    let mut expected_keys = set(DEFAULT_CONFIG_KEYS);
    expected_keys.insert("description".to_string());
    assert_eq!(keys(raw), expected_keys, "{raw}");

    // Creating again with the identical config is fine.
    within("create_stream again", js.create_stream(config))
        .await
        .unwrap_or_else(|e| panic!("identical re-create of {name}: {e}"));
}

#[tokio::test]
async fn create_with_full_config_memory_and_file() {
    let (_server, client, js) = js_setup().await;
    check_full_config(&js, &client, "FULLMEM", StorageType::Memory).await;
    check_full_config(&js, &client, "FULLFILE", StorageType::File).await;
    let (_, info) = json_request(&client, &format!("{API}.INFO"), "").await;
    assert_eq!(info["streams"], 2);
    assert_eq!(info["reserved_memory"], 1 << 20, "{info}");
}

#[tokio::test]
async fn create_repeated_and_conflicting() {
    let (_server, client, _js) = js_setup().await;
    let cfg = json!({"name": "S", "subjects": ["s.>"]});
    create_raw(&client, cfg.clone()).await;

    // Identical create again: OK, and did_create is true again.
    let resp = create_raw(&client, cfg).await;
    assert_eq!(resp["did_create"], true, "{resp}");

    // Same name, other config.
    let (code, err_code, desc) = api_err(
        &client,
        &format!("{API}.STREAM.CREATE.S"),
        json!({"name": "S", "subjects": ["s.>"], "max_msgs": 5}).to_string(),
    )
    .await;
    assert_eq!(
        (code, err_code, desc.as_str()),
        (
            400,
            10058,
            "stream name already in use with a different configuration"
        )
    );

    // Overlapping subjects with another stream.
    let (text, resp) = json_request(
        &client,
        &format!("{API}.STREAM.CREATE.T"),
        json!({"name": "T", "subjects": ["s.a"]}).to_string(),
    )
    .await;
    assert_eq!(
        api_error(&resp),
        (
            400,
            10065,
            "subjects overlap with an existing stream".to_string()
        )
    );
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_create_response","error":{"code":400,"err_code":10065,"description":"subjects overlap with an existing stream"}}"#
    );

    // Name in the subject differs from the body; an empty body counts the same.
    for body in [
        json!({"name": "U", "subjects": ["u"]}).to_string(),
        String::new(),
    ] {
        let (code, err_code, desc) =
            api_err(&client, &format!("{API}.STREAM.CREATE.T"), body.clone()).await;
        assert_eq!(
            (code, err_code, desc.as_str()),
            (400, 10056, "stream name in subject does not match request"),
            "body {body:?}"
        );
    }

    // Bad JSON: only code and err_code are compared; the description is Go's
    // decoder message (reference: "invalid JSON: invalid character 'n'
    // looking for beginning of object key string at offset 2").
    for body in ["{nope", "[1]"] {
        let (code, err_code, desc) =
            api_err(&client, &format!("{API}.STREAM.CREATE.T"), body).await;
        assert_eq!((code, err_code), (400, 10025), "body {body:?}: {desc}");
        eprintln!("bad JSON {body:?} -> {desc:?}");
    }

    // Roll-ups need the purge permission.
    let (code, err_code, desc) = api_err(
        &client,
        &format!("{API}.STREAM.CREATE.RP"),
        json!({"name": "RP", "subjects": ["rp"], "allow_rollup_hdrs": true, "deny_purge": true})
            .to_string(),
    )
    .await;
    assert_eq!(
        (code, err_code, desc.as_str()),
        (500, 10052, "roll-ups require the purge permission")
    );

    // None of the failures created anything.
    let (_, names) = json_request(&client, &format!("{API}.STREAM.NAMES"), "").await;
    assert_eq!(names["streams"], json!(["S"]), "{names}");
}

#[tokio::test]
async fn missing_stream_is_10059_everywhere() {
    let (_server, client, js) = js_setup().await;

    // Byte-exact INFO error (paging fields follow the error).
    let (text, _) = json_request(&client, &format!("{API}.STREAM.INFO.NOPE"), "").await;
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_info_response","error":{"code":404,"err_code":10059,"description":"stream not found"},"total":0,"offset":0,"limit":0}"#
    );

    let cases: [(&str, String); 5] = [
        ("DELETE", String::new()),
        ("PURGE", "{}".to_string()),
        ("MSG.GET", r#"{"seq":1}"#.to_string()),
        ("MSG.DELETE", r#"{"seq":1}"#.to_string()),
        (
            "UPDATE",
            r#"{"name":"NOPE","subjects":["nope"]}"#.to_string(),
        ),
    ];
    for (op, body) in cases {
        let (_, resp) = json_request(&client, &format!("{API}.STREAM.{op}.NOPE"), body).await;
        assert_eq!(
            api_error(&resp),
            (404, 10059, "stream not found".to_string()),
            "{op}: {resp}"
        );
        let kind = op.to_lowercase().replace('.', "_");
        assert_eq!(
            resp["type"],
            format!("io.nats.jetstream.api.v1.stream_{kind}_response"),
            "{op}: {resp}"
        );
    }
    let (_, resp) = json_request(&client, &format!("{API}.STREAM.PURGE.NOPE"), "{}").await;
    assert_eq!(resp["purged"], 0, "purge error keeps purged:0: {resp}");

    // Client library view.
    let err = js.get_stream("NOPE").await.expect_err("get_stream NOPE");
    match err.kind() {
        jetstream::context::GetStreamErrorKind::JetStream(e) => {
            assert_eq!(e.error_code(), jetstream::ErrorCode::STREAM_NOT_FOUND)
        }
        other => panic!("unexpected error kind {other:?}"),
    }
}

// ---------------------------------------------------------------------------
// stream update
// ---------------------------------------------------------------------------

#[tokio::test]
async fn update_allowed_and_refused_changes() {
    let (_server, client, js) = js_setup().await;
    let config = Config {
        name: "UPD".to_string(),
        subjects: vec!["upd.a".to_string()],
        ..Default::default()
    };
    js.create_stream(config.clone()).await.expect("create UPD");
    publish_ok(&client, "upd.a", b"1", 1).await;

    // Add a subject and a max_msgs limit.
    let updated = Config {
        subjects: vec!["upd.a".to_string(), "upd.b".to_string()],
        max_messages: 2,
        ..config.clone()
    };
    let info = within("update_stream", js.update_stream(&updated))
        .await
        .expect("update UPD");
    assert_eq!(info.config.subjects, vec!["upd.a", "upd.b"]);
    assert_eq!(info.config.max_messages, 2);
    assert_eq!(info.state.messages, 1, "update keeps the data");

    publish_ok(&client, "upd.b", b"2", 2).await;
    publish_ok(&client, "upd.b", b"3", 3).await;
    let st = state(&client, "UPD").await;
    assert_eq!(
        (st["messages"].as_u64(), st["first_seq"].as_u64()),
        (Some(2), Some(2)),
        "{st}"
    );

    // The raw response: stream_update_response with config/state but no did_create.
    let (text, resp) = json_request(
        &client,
        &format!("{API}.STREAM.UPDATE.UPD"),
        json!({"name": "UPD", "subjects": ["upd.a", "upd.b"], "max_msgs": 3}).to_string(),
    )
    .await;
    assert!(
        text.starts_with(r#"{"type":"io.nats.jetstream.api.v1.stream_update_response","config":"#),
        "{text}"
    );
    assert!(resp.get("did_create").is_none(), "{resp}");
    assert_eq!(resp["config"]["max_msgs"], 3);

    // Storage type can not change.
    let (code, err_code, desc) = api_err(
        &client,
        &format!("{API}.STREAM.UPDATE.UPD"),
        json!({"name": "UPD", "subjects": ["upd.a", "upd.b"], "storage": "memory"}).to_string(),
    )
    .await;
    assert_eq!(
        (code, err_code, desc.as_str()),
        (
            500,
            10052,
            "stream configuration update can not change storage type"
        )
    );
    let err = js
        .update_stream(&Config {
            storage: StorageType::Memory,
            ..updated.clone()
        })
        .await
        .expect_err("storage change must fail");
    match err.kind() {
        jetstream::context::CreateStreamErrorKind::JetStream(e) => {
            assert_eq!(e.error_code(), jetstream::ErrorCode(10052))
        }
        other => panic!("unexpected error kind {other:?}"),
    }

    // Name mismatch between subject and body.
    let (code, err_code, _) = api_err(
        &client,
        &format!("{API}.STREAM.UPDATE.UPD"),
        json!({"name": "OTHER"}).to_string(),
    )
    .await;
    assert_eq!((code, err_code), (400, 10056));

    // The stream still has the last good config.
    let info = info_raw(&client, "UPD", None).await;
    assert_eq!(info["config"]["storage"], "file");
    assert_eq!(info["config"]["max_msgs"], 3);
}

// ---------------------------------------------------------------------------
// stream info state
// ---------------------------------------------------------------------------

async fn check_byte_accounting(client: &Client, js: &Context, name: &str, memory: bool) {
    let prefix = name.to_lowercase();
    let mut cfg = json!({"name": name, "subjects": [format!("{prefix}.>")]});
    if memory {
        cfg["storage"] = json!("memory");
    }
    create_raw(client, cfg).await;
    let size = |subject: &str, hdr: usize, data: usize| {
        if memory {
            mem_size(subject, hdr, data)
        } else {
            file_size(subject, hdr, data)
        }
    };

    let s1 = format!("{prefix}.a");
    let s2 = format!("{prefix}.abc");
    let hdrs = [("X-A", "1"), ("X-Longer-Header", "value")];
    let hdr_len = header_block_len(&hdrs);

    publish_ok(client, &s1, b"hello", 1).await;
    let mut expected = size(&s1, 0, 5);
    let st = state(client, name).await;
    assert_eq!(st["bytes"], expected, "{name} after 1 message: {st}");

    let mut headers = HeaderMap::new();
    for (k, v) in hdrs {
        headers.append(k, v);
    }
    let ack = js
        .publish_with_headers(s2.clone(), headers, Bytes::from_static(b"hello world"))
        .await
        .expect("publish")
        .await
        .expect("ack");
    assert_eq!(ack.sequence, 2);
    expected += size(&s2, hdr_len, 11);
    let st = state(client, name).await;
    assert_eq!(
        st["bytes"], expected,
        "{name} after a message with headers: {st}"
    );

    publish_ok(client, &s2, b"", 3).await;
    expected += size(&s2, 0, 0);
    let st = state(client, name).await;
    assert_eq!(st["bytes"], expected, "{name} after an empty message: {st}");
    assert_eq!(st["messages"], 3);
    assert_eq!(st["first_seq"], 1);
    assert_eq!(st["last_seq"], 3);
    assert_eq!(st["num_subjects"], 2);
    assert_ne!(st["first_ts"], "0001-01-01T00:00:00Z");
    assert_ne!(st["last_ts"], "0001-01-01T00:00:00Z");

    // Deleting a message gives its bytes back.
    let stream = js.get_stream(name).await.expect("get_stream");
    assert!(stream.delete_message(1).await.expect("delete 1"));
    let st = state(client, name).await;
    assert_eq!(
        st["bytes"],
        expected - size(&s1, 0, 5),
        "{name} after delete: {st}"
    );
    assert_eq!(st["messages"], 2);
    assert_eq!(st["num_subjects"], 1);
}

#[tokio::test]
async fn info_state_byte_accounting_file() {
    let (_server, client, js) = js_setup().await;
    check_byte_accounting(&client, &js, "BFILE", false).await;
    let (_, info) = json_request(&client, &format!("{API}.INFO"), "").await;
    assert_eq!(info["storage"], state(&client, "BFILE").await["bytes"]);
}

#[tokio::test]
async fn info_state_byte_accounting_memory() {
    let (_server, client, js) = js_setup().await;
    check_byte_accounting(&client, &js, "BMEM", true).await;
    let (_, info) = json_request(&client, &format!("{API}.INFO"), "").await;
    assert_eq!(info["memory"], state(&client, "BMEM").await["bytes"]);
}

#[tokio::test]
async fn info_subjects_filter_and_deleted_details() {
    let (_server, client, js) = js_setup().await;
    create_raw(&client, json!({"name": "S", "subjects": ["s.>"]})).await;
    for (i, subject) in ["s.a", "s.b", "s.a", "s.b", "s.a", "s.c.d"]
        .iter()
        .enumerate()
    {
        publish_ok(&client, subject, format!("m{i}").as_bytes(), i as u64 + 1).await;
    }

    // No filter: no subjects map, paging fields zero.
    let info = info_raw(&client, "S", None).await;
    assert_eq!(
        (
            info["total"].as_u64(),
            info["offset"].as_u64(),
            info["limit"].as_u64()
        ),
        (Some(0), Some(0), Some(0))
    );
    assert!(info["state"].get("subjects").is_none(), "{info}");
    assert_eq!(info["state"]["num_subjects"], 3);

    let info = info_raw(&client, "S", Some(json!({"subjects_filter": ">"}))).await;
    assert_eq!(
        info["state"]["subjects"],
        json!({"s.a": 3, "s.b": 2, "s.c.d": 1}),
        "{info}"
    );
    assert_eq!(info["total"], 3);
    assert_eq!(info["offset"], 0);
    assert_eq!(info["limit"], 100_000);

    let info = info_raw(&client, "S", Some(json!({"subjects_filter": "s.*"}))).await;
    assert_eq!(
        info["state"]["subjects"],
        json!({"s.a": 3, "s.b": 2}),
        "{info}"
    );
    assert_eq!(info["total"], 2);

    let info = info_raw(&client, "S", Some(json!({"subjects_filter": "s.b"}))).await;
    assert_eq!(info["state"]["subjects"], json!({"s.b": 2}), "{info}");

    let info = info_raw(&client, "S", Some(json!({"subjects_filter": "zzz"}))).await;
    assert!(
        info["state"].get("subjects").is_none(),
        "no match, no subjects key: {info}"
    );
    assert_eq!(info["total"], 0);

    // Deletes: num_deleted always, the list only with deleted_details.
    let stream = js.get_stream("S").await.unwrap();
    assert!(stream.delete_message(2).await.unwrap());
    assert!(stream.delete_message(3).await.unwrap());
    let info = info_raw(&client, "S", None).await;
    assert_eq!(info["state"]["num_deleted"], 2, "{info}");
    assert!(info["state"].get("deleted").is_none(), "{info}");
    assert_eq!(info["state"]["messages"], 4);
    assert_eq!(info["state"]["first_seq"], 1);
    assert_eq!(info["state"]["last_seq"], 6);

    let info = info_raw(&client, "S", Some(json!({"deleted_details": true}))).await;
    assert_eq!(info["state"]["deleted"], json!([2, 3]), "{info}");
    assert_eq!(info["state"]["num_deleted"], 2);

    // Through the client library.
    let mut with_subjects = within(
        "info builder",
        stream
            .info_builder()
            .with_deleted(true)
            .subjects("s.a")
            .fetch(),
    )
    .await
    .expect("info_builder");
    assert_eq!(with_subjects.info.state.deleted, Some(vec![2, 3]));
    assert_eq!(with_subjects.info.state.deleted_count, Some(2));
    use futures::TryStreamExt;
    let mut got = Vec::new();
    while let Some(entry) = within("subjects", with_subjects.try_next()).await.unwrap() {
        got.push(entry);
    }
    assert_eq!(got, vec![("s.a".to_string(), 2)]);

    // Deleting the first message moves first_seq; the gap below it is not "deleted".
    assert!(stream.delete_message(1).await.unwrap());
    let info = info_raw(&client, "S", Some(json!({"deleted_details": true}))).await;
    assert_eq!(info["state"]["first_seq"], 4, "{info}");
    assert!(info["state"].get("num_deleted").is_none(), "{info}");
    assert!(info["state"].get("deleted").is_none(), "{info}");
}

#[tokio::test]
async fn stream_names_and_list() {
    let (_server, client, js) = js_setup().await;

    // No streams at all.
    let (text, _) = json_request(&client, &format!("{API}.STREAM.NAMES"), "").await;
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_names_response","total":0,"offset":0,"limit":1024,"streams":null}"#
    );

    create_raw(&client, json!({"name": "ORDERS", "subjects": ["orders.>"]})).await;
    create_raw(&client, json!({"name": "AUDIT", "subjects": ["audit.*"]})).await;
    create_raw(
        &client,
        json!({"name": "MEM", "subjects": ["mem"], "storage": "memory"}),
    )
    .await;

    let (_, names) = json_request(&client, &format!("{API}.STREAM.NAMES"), "").await;
    assert_eq!(
        names["streams"],
        json!(["AUDIT", "MEM", "ORDERS"]),
        "sorted: {names}"
    );
    assert_eq!(names["total"], 3);
    assert_eq!(names["limit"], 1024);

    let (_, names) = json_request(
        &client,
        &format!("{API}.STREAM.NAMES"),
        r#"{"subject":"orders.new"}"#,
    )
    .await;
    assert_eq!(names["streams"], json!(["ORDERS"]), "{names}");
    assert_eq!(names["total"], 1);

    // A wildcard filter matches overlapping stream subjects.
    let (_, names) = json_request(
        &client,
        &format!("{API}.STREAM.NAMES"),
        r#"{"subject":"audit.>"}"#,
    )
    .await;
    assert_eq!(names["streams"], json!(["AUDIT"]), "{names}");

    let (text, names) = json_request(
        &client,
        &format!("{API}.STREAM.NAMES"),
        r#"{"subject":"zzz"}"#,
    )
    .await;
    assert_eq!(names["streams"], Value::Null, "no match gives null: {text}");
    assert!(text.contains(r#""streams":null"#), "{text}");
    assert_eq!(names["total"], 0);

    let (_, names) = json_request(&client, &format!("{API}.STREAM.NAMES"), r#"{"offset":1}"#).await;
    assert_eq!(names["streams"], json!(["MEM", "ORDERS"]), "{names}");
    assert_eq!(names["offset"], 1);
    assert_eq!(names["total"], 3);

    // LIST: full infos without type/cluster.
    let (text, list) =
        json_request(&client, &format!("{API}.STREAM.LIST"), r#"{"offset":0}"#).await;
    assert!(
        text.starts_with(r#"{"type":"io.nats.jetstream.api.v1.stream_list_response","#),
        "{text}"
    );
    assert_eq!(list["total"], 3);
    assert_eq!(list["limit"], 256);
    let items = list["streams"].as_array().expect("streams array");
    let listed: Vec<&str> = items
        .iter()
        .map(|s| s["config"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(listed, vec!["AUDIT", "MEM", "ORDERS"]);
    for item in items {
        assert_eq!(
            keys(item),
            set(&["config", "created", "state", "ts"]),
            "{item}"
        );
    }

    let (_, list) = json_request(
        &client,
        &format!("{API}.STREAM.LIST"),
        r#"{"offset":0,"subject":"mem"}"#,
    )
    .await;
    assert_eq!(list["total"], 1);
    assert_eq!(list["streams"][0]["config"]["name"], "MEM");

    // LIST with no match answers an empty array (unlike NAMES' null).
    let (text, list) = json_request(
        &client,
        &format!("{API}.STREAM.LIST"),
        r#"{"subject":"zzz"}"#,
    )
    .await;
    assert_eq!(list["total"], 0, "{text}");
    assert_eq!(list["streams"], json!([]), "{text}");

    // Client library iterators.
    use futures::TryStreamExt;
    let mut names: Vec<String> = within(
        "stream_names",
        js.stream_names().try_collect::<Vec<String>>(),
    )
    .await
    .expect("stream_names");
    names.sort();
    assert_eq!(names, vec!["AUDIT", "MEM", "ORDERS"]);
    let infos: Vec<jetstream::stream::Info> =
        within("streams", js.streams().try_collect::<Vec<_>>())
            .await
            .expect("streams");
    assert_eq!(infos.len(), 3);
    assert_eq!(
        within("stream_by_subject", js.stream_by_subject("orders.x"))
            .await
            .expect("stream_by_subject"),
        "ORDERS"
    );
}

// ---------------------------------------------------------------------------
// publish acks
// ---------------------------------------------------------------------------

#[tokio::test]
async fn publish_acks_and_dedup() {
    let (_server, client, js) = js_setup().await;
    create_raw(
        &client,
        json!({"name": "P", "subjects": ["p.>"], "duplicate_window": 60_000_000_000u64}),
    )
    .await;

    // Byte-exact ack.
    let (text, _) = publish_raw(&client, "p.a", &[], b"one").await;
    assert_eq!(text, r#"{"stream":"P","seq":1}"#);

    for seq in 2..=5u64 {
        let ack = js
            .publish("p.b", Bytes::from(format!("m{seq}")))
            .await
            .expect("publish")
            .await
            .expect("ack");
        assert_eq!(
            (ack.stream.as_str(), ack.sequence, ack.duplicate),
            ("P", seq, false)
        );
    }

    // Dedup on Nats-Msg-Id: the duplicate gets the original seq and is not stored.
    let (_, ack) = publish_raw(&client, "p.a", &[("Nats-Msg-Id", "A1")], b"dup").await;
    assert_eq!(ack, json!({"stream": "P", "seq": 6}));
    let (text, ack) = publish_raw(&client, "p.a", &[("Nats-Msg-Id", "A1")], b"dup").await;
    assert_eq!(
        ack,
        json!({"stream": "P", "seq": 6, "duplicate": true}),
        "{text}"
    );
    let ack = js
        .send_publish(
            "p.other",
            PublishMessage::build().payload("x".into()).message_id("A1"),
        )
        .await
        .expect("publish")
        .await
        .expect("ack");
    assert!(
        ack.duplicate,
        "same id on another subject is still a duplicate"
    );
    assert_eq!(ack.sequence, 6);

    let st = state(&client, "P").await;
    assert_eq!(st["messages"], 6, "duplicates are not stored: {st}");
    assert_eq!(st["last_seq"], 6);

    // A new id is a new message; the stored message keeps its Nats-Msg-Id header.
    let (_, ack) = publish_raw(&client, "p.a", &[("Nats-Msg-Id", "A2")], b"new").await;
    assert_eq!(ack, json!({"stream": "P", "seq": 7}));
    let stream = js.get_stream("P").await.unwrap();
    let msg = stream.get_raw_message(6).await.expect("get 6");
    assert_eq!(
        msg.headers.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some("A1")
    );
    assert_eq!(msg.payload, Bytes::from_static(b"dup"));
}

#[tokio::test]
async fn dedup_window_expires() {
    let (_server, client, _js) = js_setup().await;
    create_raw(
        &client,
        json!({"name": "D", "subjects": ["d"], "duplicate_window": 1_000_000_000u64}),
    )
    .await;
    let (_, ack) = publish_raw(&client, "d", &[("Nats-Msg-Id", "k")], b"x").await;
    assert_eq!(ack["seq"], 1);
    let (_, ack) = publish_raw(&client, "d", &[("Nats-Msg-Id", "k")], b"x").await;
    assert_eq!(ack["duplicate"], true, "{ack}");

    // After the 1 s window the same id is accepted again (the reference takes ~1 s).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, ack) = publish_raw(&client, "d", &[("Nats-Msg-Id", "k")], b"x").await;
        if ack.get("duplicate").is_none() {
            assert_eq!(ack, json!({"stream": "D", "seq": 2}));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "msg id still a duplicate after 5 s"
        );
    }
}

#[tokio::test]
async fn publish_expected_headers() {
    let (_server, client, js) = js_setup().await;
    create_raw(&client, json!({"name": "P", "subjects": ["p.>"]})).await;

    publish_ok(&client, "p.a", b"one", 1).await;

    // Nats-Expected-Stream
    let (_, ack) = publish_raw(&client, "p.b", &[("Nats-Expected-Stream", "P")], b"x").await;
    assert_eq!(ack, json!({"stream": "P", "seq": 2}));
    let (text, ack) = publish_raw(&client, "p.b", &[("Nats-Expected-Stream", "WRONG")], b"x").await;
    assert_error_ack(&ack, "P", 400, 10060, "expected stream does not match");
    assert_eq!(
        text,
        r#"{"error":{"code":400,"err_code":10060,"description":"expected stream does not match"},"stream":"P","seq":0}"#
    );

    // Nats-Expected-Last-Sequence
    let (_, ack) = publish_raw(
        &client,
        "p.b",
        &[("Nats-Expected-Last-Sequence", "2")],
        b"x",
    )
    .await;
    assert_eq!(ack["seq"], 3, "{ack}");
    let (_, ack) = publish_raw(
        &client,
        "p.b",
        &[("Nats-Expected-Last-Sequence", "1")],
        b"x",
    )
    .await;
    assert_error_ack(&ack, "P", 400, 10071, "wrong last sequence: 3");

    // Nats-Expected-Last-Msg-Id
    let (_, ack) = publish_raw(&client, "p.c", &[("Nats-Msg-Id", "C1")], b"x").await;
    assert_eq!(ack["seq"], 4);
    let (_, ack) = publish_raw(
        &client,
        "p.c",
        &[("Nats-Expected-Last-Msg-Id", "C1"), ("Nats-Msg-Id", "C2")],
        b"x",
    )
    .await;
    assert_eq!(ack["seq"], 5, "{ack}");
    let (_, ack) = publish_raw(&client, "p.c", &[("Nats-Expected-Last-Msg-Id", "C1")], b"x").await;
    assert_error_ack(&ack, "P", 400, 10070, "wrong last msg ID: C2");

    // Nats-Expected-Last-Subject-Sequence (per subject; 0 = subject must be empty)
    let (_, ack) = publish_raw(
        &client,
        "p.b",
        &[("Nats-Expected-Last-Subject-Sequence", "3")],
        b"x",
    )
    .await;
    assert_eq!(ack["seq"], 6, "{ack}");
    let (_, ack) = publish_raw(
        &client,
        "p.b",
        &[("Nats-Expected-Last-Subject-Sequence", "3")],
        b"x",
    )
    .await;
    assert_error_ack(&ack, "P", 400, 10071, "wrong last sequence: 6");
    let (_, ack) = publish_raw(
        &client,
        "p.new",
        &[("Nats-Expected-Last-Subject-Sequence", "0")],
        b"x",
    )
    .await;
    assert_eq!(ack["seq"], 7, "{ack}");
    let (_, ack) = publish_raw(
        &client,
        "p.new",
        &[("Nats-Expected-Last-Subject-Sequence", "0")],
        b"x",
    )
    .await;
    assert_error_ack(&ack, "P", 400, 10071, "wrong last sequence: 7");
    // ... checked against another subject named in a header.
    let (_, ack) = publish_raw(
        &client,
        "p.a",
        &[
            ("Nats-Expected-Last-Subject-Sequence", "7"),
            ("Nats-Expected-Last-Subject-Sequence-Subject", "p.new"),
        ],
        b"x",
    )
    .await;
    assert_eq!(ack["seq"], 8, "{ack}");

    // Failed publishes stored nothing.
    let st = state(&client, "P").await;
    assert_eq!(
        (st["messages"].as_u64(), st["last_seq"].as_u64()),
        (Some(8), Some(8)),
        "{st}"
    );

    // The client library maps the codes to its error kinds.
    let err = js
        .send_publish(
            "p.b",
            PublishMessage::build()
                .payload("x".into())
                .expected_last_sequence(1),
        )
        .await
        .expect("send")
        .await
        .expect_err("wrong last sequence");
    assert_eq!(err.kind(), PublishErrorKind::WrongLastSequence);
    assert_eq!(js_error(&err).map(|e| e.error_code().0), Some(10071));
    let err = js
        .send_publish(
            "p.b",
            PublishMessage::build()
                .payload("x".into())
                .expected_last_message_id("nope"),
        )
        .await
        .expect("send")
        .await
        .expect_err("wrong last msg id");
    assert_eq!(err.kind(), PublishErrorKind::WrongLastMessageId);
    let err = js
        .send_publish(
            "p.b",
            PublishMessage::build()
                .payload("x".into())
                .expected_stream("OTHER"),
        )
        .await
        .expect("send")
        .await
        .expect_err("wrong stream");
    assert_eq!(js_error(&err).map(|e| e.error_code().0), Some(10060));
    let ack = js
        .send_publish(
            "p.b",
            PublishMessage::build()
                .payload("x".into())
                .expected_last_subject_sequence(6),
        )
        .await
        .expect("send")
        .await
        .expect("expected last subject sequence 6");
    assert_eq!(ack.sequence, 9);
}

#[tokio::test]
async fn publish_limits_errors() {
    let (_server, client, js) = js_setup().await;

    // max_msg_size counts headers too.
    create_raw(
        &client,
        json!({"name": "SZ", "subjects": ["sz"], "max_msg_size": 32}),
    )
    .await;
    publish_ok(&client, "sz", &[b'x'; 32], 1).await;
    let (_, ack) = publish_raw(&client, "sz", &[], &[b'x'; 33]).await;
    assert_error_ack(
        &ack,
        "SZ",
        400,
        10054,
        "message size exceeds maximum allowed",
    );
    let (_, ack) = publish_raw(&client, "sz", &[("X-Pad", "123456")], &[b'x'; 16]).await;
    assert_error_ack(
        &ack,
        "SZ",
        400,
        10054,
        "message size exceeds maximum allowed",
    );
    let err = js
        .publish("sz", Bytes::from(vec![b'y'; 100]))
        .await
        .expect("send")
        .await
        .expect_err("too big");
    assert_eq!(js_error(&err).map(|e| e.error_code().0), Some(10054));

    // discard new + max_msgs
    create_raw(
        &client,
        json!({"name": "LIM", "subjects": ["lim"], "max_msgs": 1, "discard": "new"}),
    )
    .await;
    publish_ok(&client, "lim", b"1", 1).await;
    let (_, ack) = publish_raw(&client, "lim", &[], b"2").await;
    assert_error_ack(&ack, "LIM", 503, 10077, "maximum messages exceeded");

    // discard new + max_bytes (file: 30 + 2 + 20 = 52 bytes per message)
    create_raw(
        &client,
        json!({"name": "MB", "subjects": ["mb"], "max_bytes": 120, "discard": "new"}),
    )
    .await;
    publish_ok(&client, "mb", &[b'x'; 20], 1).await;
    publish_ok(&client, "mb", &[b'x'; 20], 2).await;
    let (_, ack) = publish_raw(&client, "mb", &[], &[b'x'; 20]).await;
    assert_error_ack(&ack, "MB", 503, 10077, "maximum bytes exceeded");
    let st = state(&client, "MB").await;
    assert_eq!(
        (st["messages"].as_u64(), st["bytes"].as_u64()),
        (Some(2), Some(104)),
        "{st}"
    );

    // discard new + max_msgs_per_subject + discard_new_per_subject
    create_raw(
        &client,
        json!({"name": "PS", "subjects": ["ps.*"], "max_msgs_per_subject": 1, "discard": "new", "discard_new_per_subject": true}),
    )
    .await;
    publish_ok(&client, "ps.a", b"1", 1).await;
    let (_, ack) = publish_raw(&client, "ps.a", &[], b"2").await;
    assert_error_ack(
        &ack,
        "PS",
        503,
        10077,
        "maximum messages per subject exceeded",
    );
    publish_ok(&client, "ps.b", b"3", 2).await;

    // No stream for the subject: no responders.
    let err = js
        .publish("nostream.x", "x".into())
        .await
        .expect("send")
        .await
        .expect_err("no stream");
    assert_eq!(err.kind(), PublishErrorKind::StreamNotFound);
    let err = within("request", client.request("nostream.y", "x".into()))
        .await
        .expect_err("no responders");
    assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);
}

// ---------------------------------------------------------------------------
// limits
// ---------------------------------------------------------------------------

#[tokio::test]
async fn limits_max_msgs_and_per_subject_discard_old() {
    let (_server, client, js) = js_setup().await;

    create_raw(
        &client,
        json!({"name": "MM", "subjects": ["mm"], "max_msgs": 3}),
    )
    .await;
    for i in 1..=10u64 {
        publish_ok(&client, "mm", format!("m{i}").as_bytes(), i).await;
    }
    let st = state(&client, "MM").await;
    assert_eq!(
        (
            st["messages"].as_u64(),
            st["first_seq"].as_u64(),
            st["last_seq"].as_u64()
        ),
        (Some(3), Some(8), Some(10)),
        "{st}"
    );
    let stream = js.get_stream("MM").await.unwrap();
    for seq in 8..=10u64 {
        let msg = stream.get_raw_message(seq).await.expect("kept message");
        assert_eq!(msg.payload, Bytes::from(format!("m{seq}")));
    }

    create_raw(
        &client,
        json!({"name": "PER", "subjects": ["per.*"], "max_msgs_per_subject": 2}),
    )
    .await;
    let mut seq = 0;
    for subject in ["per.a", "per.a", "per.b", "per.a", "per.a", "per.a"] {
        seq += 1;
        publish_ok(&client, subject, format!("{subject}-{seq}").as_bytes(), seq).await;
    }
    let info = info_raw(&client, "PER", Some(json!({"subjects_filter": ">"}))).await;
    assert_eq!(
        info["state"]["subjects"],
        json!({"per.a": 2, "per.b": 1}),
        "{info}"
    );
    assert_eq!(info["state"]["messages"], 3);
    assert_eq!(info["state"]["first_seq"], 3);
    let stream = js.get_stream("PER").await.unwrap();
    let last_a = stream
        .get_last_raw_message_by_subject("per.a")
        .await
        .unwrap();
    assert_eq!(last_a.sequence, 6);
    let first_a = stream
        .get_next_raw_message_by_subject("per.a")
        .await
        .unwrap();
    assert_eq!(first_a.sequence, 5);
}

#[tokio::test]
async fn limits_max_bytes_discard_old() {
    let (_server, client, _js) = js_setup().await;
    // File store: 30 + 3 + 19 = 52 bytes per message; 160 holds 3.
    create_raw(
        &client,
        json!({"name": "MBF", "subjects": ["mbf"], "max_bytes": 160}),
    )
    .await;
    for i in 1..=5u64 {
        publish_ok(&client, "mbf", &[b'x'; 19], i).await;
    }
    let st = state(&client, "MBF").await;
    assert_eq!(
        (
            st["messages"].as_u64(),
            st["bytes"].as_u64(),
            st["first_seq"].as_u64()
        ),
        (Some(3), Some(3 * file_size("mbf", 0, 19)), Some(3)),
        "{st}"
    );

    // Memory store: 16 + 3 + 20 = 39 bytes per message; 100 holds 2.
    create_raw(
        &client,
        json!({"name": "MBM", "subjects": ["mbm"], "max_bytes": 100, "storage": "memory"}),
    )
    .await;
    for i in 1..=5u64 {
        publish_ok(&client, "mbm", &[b'x'; 20], i).await;
    }
    let st = state(&client, "MBM").await;
    assert_eq!(
        (
            st["messages"].as_u64(),
            st["bytes"].as_u64(),
            st["first_seq"].as_u64()
        ),
        (Some(2), Some(2 * mem_size("mbm", 0, 20)), Some(4)),
        "{st}"
    );
}

#[tokio::test]
async fn limits_max_age_expires_without_writes() {
    let (_server, client, _js) = js_setup().await;
    for (name, storage) in [("AGEF", "file"), ("AGEM", "memory")] {
        let subject = name.to_lowercase();
        create_raw(
            &client,
            json!({"name": name, "subjects": [subject.clone()], "max_age": 1_000_000_000u64, "storage": storage}),
        )
        .await;
        for i in 1..=3u64 {
            publish_ok(&client, &subject, b"x", i).await;
        }
    }
    for name in ["AGEF", "AGEM"] {
        let st = wait_for_state(&client, name, Duration::from_secs(5), |st| {
            st["messages"] == 0
        })
        .await;
        assert_eq!(st["bytes"], 0, "{name}: {st}");
        assert_eq!(st["first_seq"], 4, "{name}: {st}");
        assert_eq!(st["last_seq"], 3, "{name}: {st}");
        assert_eq!(st["first_ts"], "0001-01-01T00:00:00Z", "{name}: {st}");
    }
    // The sequence continues after expiry.
    publish_ok(&client, "agef", b"y", 4).await;
}

#[tokio::test]
async fn rollup_sub_and_all() {
    let (_server, client, js) = js_setup().await;

    // Without allow_rollup_hdrs the header is refused.
    create_raw(&client, json!({"name": "NR", "subjects": ["nr"]})).await;
    let (_, ack) = publish_raw(&client, "nr", &[("Nats-Rollup", "sub")], b"x").await;
    assert_error_ack(&ack, "NR", 500, 10111, "rollup not permitted");

    create_raw(
        &client,
        json!({"name": "R", "subjects": ["r.>"], "allow_rollup_hdrs": true}),
    )
    .await;
    publish_ok(&client, "r.a", b"1", 1).await;
    publish_ok(&client, "r.a", b"2", 2).await;
    publish_ok(&client, "r.b", b"3", 3).await;

    let (_, ack) = publish_raw(&client, "r.a", &[("Nats-Rollup", "sub")], b"roll").await;
    assert_eq!(ack, json!({"stream": "R", "seq": 4}));
    let info = info_raw(&client, "R", Some(json!({"subjects_filter": ">"}))).await;
    assert_eq!(
        info["state"]["subjects"],
        json!({"r.a": 1, "r.b": 1}),
        "{info}"
    );
    assert_eq!(info["state"]["messages"], 2);
    assert_eq!(info["state"]["first_seq"], 3);

    publish_ok(&client, "r.c", b"5", 5).await;
    let (_, ack) = publish_raw(&client, "r.b", &[("Nats-Rollup", "all")], b"roll").await;
    assert_eq!(ack, json!({"stream": "R", "seq": 6}));
    let info = info_raw(&client, "R", Some(json!({"subjects_filter": ">"}))).await;
    assert_eq!(info["state"]["subjects"], json!({"r.b": 1}), "{info}");
    assert_eq!(info["state"]["messages"], 1);
    assert_eq!(info["state"]["first_seq"], 6);
    let stream = js.get_stream("R").await.unwrap();
    let msg = stream.get_raw_message(6).await.unwrap();
    assert_eq!(msg.payload, Bytes::from_static(b"roll"));
    assert_eq!(
        msg.headers.get("Nats-Rollup").map(|v| v.as_str()),
        Some("all")
    );

    let (_, ack) = publish_raw(&client, "r.b", &[("Nats-Rollup", "bogus")], b"x").await;
    assert_error_ack(&ack, "R", 500, 10111, "rollup value invalid: \"bogus\"");
}

// ---------------------------------------------------------------------------
// purge, get, delete
// ---------------------------------------------------------------------------

#[tokio::test]
async fn purge_variants() {
    let (_server, client, js) = js_setup().await;
    create_raw(&client, json!({"name": "P", "subjects": ["p.*"]})).await;
    let mut seq = 0;
    for subject in ["p.a", "p.a", "p.a", "p.b", "p.b", "p.b", "p.c", "p.c"] {
        seq += 1;
        publish_ok(&client, subject, b"x", seq).await;
    }
    let stream = js.get_stream("P").await.unwrap();

    // filter
    let resp = stream.purge().filter("p.c").await.expect("purge filter");
    assert!(resp.success);
    assert_eq!(resp.purged, 2);
    assert_eq!(state(&client, "P").await["messages"], 6);

    // filter + keep: p.a keeps its newest
    let resp = stream
        .purge()
        .filter("p.a")
        .keep(1)
        .await
        .expect("purge filter keep");
    assert_eq!(resp.purged, 2);
    let st = state(&client, "P").await;
    assert_eq!(
        (st["messages"].as_u64(), st["first_seq"].as_u64()),
        (Some(4), Some(3)),
        "{st}"
    );

    // keep: the newest 2 of the whole stream (seqs 5, 6)
    let (text, resp) =
        json_request(&client, &format!("{API}.STREAM.PURGE.P"), r#"{"keep":2}"#).await;
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_purge_response","success":true,"purged":2}"#
    );
    assert_eq!(resp["purged"], 2);
    let st = state(&client, "P").await;
    assert_eq!(
        (st["messages"].as_u64(), st["first_seq"].as_u64()),
        (Some(2), Some(5)),
        "{st}"
    );

    // seq: purges everything below it
    let resp = stream.purge().sequence(6).await.expect("purge seq");
    assert_eq!(resp.purged, 1);
    let st = state(&client, "P").await;
    assert_eq!(
        (st["messages"].as_u64(), st["first_seq"].as_u64()),
        (Some(1), Some(6)),
        "{st}"
    );

    publish_ok(&client, "p.a", b"x", 9).await;
    publish_ok(&client, "p.b", b"x", 10).await;

    // filter + seq: only that subject, below seq
    let resp = stream
        .purge()
        .filter("p.b")
        .sequence(10)
        .await
        .expect("purge filter seq");
    assert_eq!(resp.purged, 1);
    let st = state(&client, "P").await;
    assert_eq!(
        (st["messages"].as_u64(), st["first_seq"].as_u64()),
        (Some(2), Some(9)),
        "{st}"
    );

    // seq and keep together are a bad request
    let (code, err_code, desc) = api_err(
        &client,
        &format!("{API}.STREAM.PURGE.P"),
        r#"{"seq":10,"keep":1}"#,
    )
    .await;
    assert_eq!((code, err_code, desc.as_str()), (400, 10003, "bad request"));
    // bad JSON
    let (code, err_code, _) = api_err(&client, &format!("{API}.STREAM.PURGE.P"), "{bad").await;
    assert_eq!((code, err_code), (400, 10025));

    // everything (empty body); sequences keep counting
    let (_, resp) = json_request(&client, &format!("{API}.STREAM.PURGE.P"), "").await;
    assert_eq!(resp["success"], true);
    assert_eq!(resp["purged"], 2);
    let st = state(&client, "P").await;
    assert_eq!(
        (
            st["messages"].as_u64(),
            st["bytes"].as_u64(),
            st["first_seq"].as_u64(),
            st["last_seq"].as_u64()
        ),
        (Some(0), Some(0), Some(11), Some(10)),
        "{st}"
    );
    assert_eq!(st["first_ts"], "0001-01-01T00:00:00Z");
    publish_ok(&client, "p.a", b"x", 11).await;
    let resp = stream.purge().await.expect("purge all");
    assert_eq!(resp.purged, 1);
}

#[tokio::test]
async fn msg_get_by_seq_last_and_next() {
    let (_server, client, js) = js_setup().await;
    create_raw(&client, json!({"name": "G", "subjects": ["g.*"]})).await;
    publish_raw(&client, "g.a", &[("X-Tag", "t1")], b"a1").await;
    publish_ok(&client, "g.b", b"b1", 2).await;
    publish_ok(&client, "g.a", b"a2", 3).await;
    publish_ok(&client, "g.b", b"", 4).await;
    let stream = js.get_stream("G").await.unwrap();

    let msg = stream.get_raw_message(1).await.expect("get 1");
    assert_eq!(msg.subject.as_str(), "g.a");
    assert_eq!(msg.sequence, 1);
    assert_eq!(msg.payload, Bytes::from_static(b"a1"));
    assert_eq!(msg.headers.get("X-Tag").map(|v| v.as_str()), Some("t1"));

    // Raw shape: hdrs only with headers, data only when non-empty.
    let (text, resp) =
        json_request(&client, &format!("{API}.STREAM.MSG.GET.G"), r#"{"seq":1}"#).await;
    assert!(text.starts_with(r#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":{"subject":"g.a","seq":1,"hdrs":""#), "{text}");
    assert_eq!(
        keys(&resp["message"]),
        set(&["subject", "seq", "hdrs", "data", "time"])
    );
    assert_eq!(
        resp["message"]["hdrs"], "TkFUUy8xLjANClgtVGFnOiB0MQ0KDQo=",
        "base64 of NATS/1.0\\r\\nX-Tag: t1\\r\\n\\r\\n"
    );
    assert_eq!(resp["message"]["data"], "YTE=");
    let (_, resp) = json_request(&client, &format!("{API}.STREAM.MSG.GET.G"), r#"{"seq":2}"#).await;
    assert_eq!(
        keys(&resp["message"]),
        set(&["subject", "seq", "data", "time"]),
        "{resp}"
    );
    let (_, resp) = json_request(&client, &format!("{API}.STREAM.MSG.GET.G"), r#"{"seq":4}"#).await;
    assert_eq!(
        keys(&resp["message"]),
        set(&["subject", "seq", "time"]),
        "{resp}"
    );

    // last_by_subj
    let (_, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.GET.G"),
        r#"{"last_by_subj":"g.a"}"#,
    )
    .await;
    assert_eq!(resp["message"]["seq"], 3, "{resp}");
    let msg = stream
        .get_last_raw_message_by_subject("g.b")
        .await
        .expect("last g.b");
    assert_eq!(msg.sequence, 4);
    assert!(msg.payload.is_empty());
    let (_, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.GET.G"),
        r#"{"last_by_subj":"g.*"}"#,
    )
    .await;
    assert_eq!(resp["message"]["seq"], 4, "wildcard last_by_subj: {resp}");

    // next_by_subj: first message >= seq on that subject
    let (_, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.GET.G"),
        r#"{"seq":2,"next_by_subj":"g.a"}"#,
    )
    .await;
    assert_eq!(resp["message"]["seq"], 3, "{resp}");
    let (_, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.GET.G"),
        r#"{"seq":3,"next_by_subj":"g.a"}"#,
    )
    .await;
    assert_eq!(
        resp["message"]["seq"], 3,
        "next_by_subj includes seq itself: {resp}"
    );
    let (_, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.GET.G"),
        r#"{"seq":2,"next_by_subj":"g.*"}"#,
    )
    .await;
    assert_eq!(resp["message"]["seq"], 2, "{resp}");
    let msg = stream
        .raw_message_builder()
        .sequence(2)
        .next_by_subject("g.b".to_string())
        .send()
        .await
        .expect("next g.b from 2");
    assert_eq!(msg.sequence, 2);

    // not found
    let (text, resp) =
        json_request(&client, &format!("{API}.STREAM.MSG.GET.G"), r#"{"seq":99}"#).await;
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":{"code":404,"err_code":10037,"description":"no message found"}}"#
    );
    assert_eq!(api_error(&resp).1, 10037);
    for body in [
        r#"{"seq":4,"next_by_subj":"g.a"}"#,
        r#"{"last_by_subj":"g.zzz"}"#,
    ] {
        let (code, err_code, desc) =
            api_err(&client, &format!("{API}.STREAM.MSG.GET.G"), body).await;
        assert_eq!(
            (code, err_code, desc.as_str()),
            (404, 10037, "no message found"),
            "{body}"
        );
    }
    let err = stream.get_raw_message(99).await.expect_err("99 missing");
    assert_eq!(
        err.kind(),
        jetstream::stream::LastRawMessageErrorKind::NoMessageFound
    );

    // An empty request (no seq, no subject) and seq together with last_by_subj are bad requests.
    for body in ["{}", r#"{"seq":1,"last_by_subj":"g.a"}"#] {
        let (code, err_code, desc) =
            api_err(&client, &format!("{API}.STREAM.MSG.GET.G"), body).await;
        assert_eq!(
            (code, err_code, desc.as_str()),
            (400, 10003, "bad request"),
            "{body}"
        );
    }
}

#[tokio::test]
async fn msg_delete_and_again() {
    let (_server, client, js) = js_setup().await;
    create_raw(&client, json!({"name": "DEL", "subjects": ["del"]})).await;
    for i in 1..=4u64 {
        publish_ok(&client, "del", format!("m{i}").as_bytes(), i).await;
    }
    let (text, _) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.DELETE.DEL"),
        r#"{"seq":2}"#,
    )
    .await;
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_msg_delete_response","success":true}"#
    );

    let (text, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.DELETE.DEL"),
        r#"{"seq":2}"#,
    )
    .await;
    assert_eq!(
        api_error(&resp),
        (400, 10043, "sequence 2 not found".to_string()),
        "{text}"
    );

    // Secure erase (no_erase:false) answers the same way.
    let (_, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.DELETE.DEL"),
        r#"{"seq":3,"no_erase":false}"#,
    )
    .await;
    assert_eq!(resp["success"], true, "{resp}");

    // Beyond the last sequence: an error (reference: 500 / 10057 "stream store EOF").
    let (_, resp) = json_request(
        &client,
        &format!("{API}.STREAM.MSG.DELETE.DEL"),
        r#"{"seq":99}"#,
    )
    .await;
    assert!(resp.get("error").is_some(), "{resp}");

    let stream = js.get_stream("DEL").await.unwrap();
    let err = stream.delete_message(2).await.expect_err("already deleted");
    match err.kind() {
        jetstream::stream::DeleteMessageErrorKind::JetStream(e) => {
            assert_eq!(e.error_code(), jetstream::ErrorCode::SEQUENCE_NOT_FOUND)
        }
        other => panic!("unexpected kind {other:?}"),
    }
    assert!(stream.delete_message(4).await.expect("delete 4"));

    let (code, err_code, _) = api_err(
        &client,
        &format!("{API}.STREAM.MSG.GET.DEL"),
        r#"{"seq":2}"#,
    )
    .await;
    assert_eq!((code, err_code), (404, 10037));

    let info = info_raw(&client, "DEL", Some(json!({"deleted_details": true}))).await;
    let st = &info["state"];
    assert_eq!(st["messages"], 1, "{st}");
    assert_eq!(st["first_seq"], 1, "{st}");
    // Deleting the last message does not move last_seq.
    assert_eq!(st["last_seq"], 4, "{st}");
    assert_eq!(st["deleted"], json!([2, 3, 4]), "{st}");
    assert_eq!(st["num_deleted"], 3, "{st}");
    assert_eq!(st["bytes"], file_size("del", 0, 2), "{st}");
    // ... and the next publish still gets the next sequence.
    publish_ok(&client, "del", b"m5", 5).await;
}

#[tokio::test]
async fn direct_get() {
    let (_server, client, js) = js_setup().await;
    create_raw(
        &client,
        json!({"name": "DG", "subjects": ["dg.*"], "allow_direct": true}),
    )
    .await;
    publish_raw(&client, "dg.a", &[("X-N", "0")], b"v0").await;
    publish_ok(&client, "dg.a", b"v1", 2).await;
    publish_ok(&client, "dg.b", b"b0", 3).await;
    let stream = js.get_stream("DG").await.unwrap();

    let msg = within("direct_get", stream.direct_get(1))
        .await
        .expect("direct_get 1");
    assert_eq!(msg.subject.as_str(), "dg.a");
    assert_eq!(msg.sequence, 1);
    assert_eq!(msg.payload, Bytes::from_static(b"v0"));
    assert_eq!(msg.headers.get("X-N").map(|v| v.as_str()), Some("0"));

    let msg = within("last", stream.direct_get_last_for_subject("dg.a"))
        .await
        .expect("last dg.a");
    assert_eq!((msg.sequence, msg.payload.as_ref()), (2, &b"v1"[..]));
    let msg = within("next", stream.direct_get_next_for_subject("dg.b", Some(1)))
        .await
        .expect("next dg.b");
    assert_eq!(msg.sequence, 3);

    let err = within("missing", stream.direct_get(99))
        .await
        .expect_err("99 missing");
    assert_eq!(err.kind(), DirectGetErrorKind::NotFound);

    // Raw: the stored message with Nats-* headers appended, no JSON envelope.
    let reply = within(
        "raw direct get",
        client.request(format!("{API}.DIRECT.GET.DG"), r#"{"seq":1}"#.into()),
    )
    .await
    .expect("raw direct get");
    assert_eq!(reply.payload, Bytes::from_static(b"v0"));
    let headers = reply.headers.expect("headers");
    assert_eq!(headers.get("X-N").map(|v| v.as_str()), Some("0"));
    assert_eq!(headers.get("Nats-Stream").map(|v| v.as_str()), Some("DG"));
    assert_eq!(
        headers.get("Nats-Subject").map(|v| v.as_str()),
        Some("dg.a")
    );
    assert_eq!(headers.get("Nats-Sequence").map(|v| v.as_str()), Some("1"));
    let ts = headers
        .get("Nats-Time-Stamp")
        .expect("Nats-Time-Stamp")
        .as_str()
        .to_string();
    assert!(ts.ends_with('Z') && ts.contains('T'), "{ts}");

    // Subject form: last message on that subject.
    let reply = within(
        "raw direct get last",
        client.request(format!("{API}.DIRECT.GET.DG.dg.b"), "".into()),
    )
    .await
    .expect("raw direct get last");
    assert_eq!(reply.payload, Bytes::from_static(b"b0"));
    assert_eq!(
        reply
            .headers
            .unwrap()
            .get("Nats-Sequence")
            .map(|v| v.as_str()),
        Some("3")
    );

    // Not found: 404 status; empty request: 408 status.
    let reply = within(
        "raw missing",
        client.request(format!("{API}.DIRECT.GET.DG"), r#"{"seq":99}"#.into()),
    )
    .await
    .expect("raw missing");
    assert_eq!(reply.status, Some(async_nats::StatusCode::NOT_FOUND));
    assert_eq!(reply.description.as_deref(), Some("Message Not Found"));
    let reply = within(
        "raw empty",
        client.request(format!("{API}.DIRECT.GET.DG"), "".into()),
    )
    .await
    .expect("raw empty");
    assert_eq!(reply.status, Some(async_nats::StatusCode::TIMEOUT));
    assert_eq!(reply.description.as_deref(), Some("Empty Request"));

    // A stream without allow_direct has nobody serving DIRECT.GET.
    create_raw(&client, json!({"name": "ND", "subjects": ["nd"]})).await;
    publish_ok(&client, "nd", b"x", 1).await;
    let err = within(
        "no direct",
        client.request(format!("{API}.DIRECT.GET.ND"), r#"{"seq":1}"#.into()),
    )
    .await
    .expect_err("no responders");
    assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);
}

#[tokio::test]
async fn deny_delete_and_deny_purge() {
    let (_server, client, js) = js_setup().await;
    create_raw(
        &client,
        json!({"name": "DD", "subjects": ["dd.>"], "deny_delete": true, "deny_purge": true}),
    )
    .await;
    publish_ok(&client, "dd.a", b"x", 1).await;

    for body in [r#"{"seq":1}"#, r#"{"seq":1,"no_erase":true}"#] {
        let (code, err_code, desc) =
            api_err(&client, &format!("{API}.STREAM.MSG.DELETE.DD"), body).await;
        assert_eq!(
            (code, err_code, desc.as_str()),
            (500, 10057, "message delete not permitted"),
            "{body}"
        );
    }
    for body in ["{}", r#"{"filter":"dd.a"}"#, ""] {
        let (_, resp) = json_request(&client, &format!("{API}.STREAM.PURGE.DD"), body).await;
        assert_eq!(
            api_error(&resp),
            (500, 10110, "stream purge not permitted".to_string()),
            "{body:?}"
        );
        assert_eq!(resp["purged"], 0);
    }
    let stream = js.get_stream("DD").await.unwrap();
    assert!(stream.delete_message(1).await.is_err());
    assert!(stream.purge().await.is_err());
    assert_eq!(state(&client, "DD").await["messages"], 1);

    // Deleting the whole stream is still allowed.
    js.delete_stream("DD").await.expect("delete DD");
}

#[tokio::test]
async fn stream_delete() {
    let (_server, client, js) = js_setup().await;
    create_raw(&client, json!({"name": "GONE", "subjects": ["gone.>"]})).await;
    publish_ok(&client, "gone.a", b"x", 1).await;

    let (text, _) = json_request(&client, &format!("{API}.STREAM.DELETE.GONE"), "").await;
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_delete_response","success":true}"#
    );

    let (text, _) = json_request(&client, &format!("{API}.STREAM.DELETE.GONE"), "").await;
    assert_eq!(
        text,
        r#"{"type":"io.nats.jetstream.api.v1.stream_delete_response","error":{"code":404,"err_code":10059,"description":"stream not found"}}"#
    );
    let (code, err_code, _) = api_err(&client, &format!("{API}.STREAM.INFO.GONE"), "").await;
    assert_eq!((code, err_code), (404, 10059));

    // Its subjects no longer reach a stream ...
    let err = within("request", client.request("gone.a", "x".into()))
        .await
        .expect_err("no responders");
    assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);

    // ... and are free for a new stream, which starts from seq 1.
    js.create_stream(Config {
        name: "AGAIN".to_string(),
        subjects: vec!["gone.>".to_string()],
        ..Default::default()
    })
    .await
    .expect("create AGAIN");
    publish_ok(&client, "gone.a", b"x", 1).await;
    let status = js.delete_stream("AGAIN").await.expect("delete AGAIN");
    assert!(status.success);
    let (_, names) = json_request(&client, &format!("{API}.STREAM.NAMES"), "").await;
    assert_eq!(names["streams"], Value::Null, "{names}");
}

// ---------------------------------------------------------------------------
// durability
// ---------------------------------------------------------------------------

#[tokio::test]
async fn file_stream_survives_sigkill() {
    const N: u64 = 1000;
    let mut server = Server::start_jetstream();
    let client = server.client().await;
    let js = jetstream::new(client.clone());
    create_raw(&client, json!({"name": "DUR", "subjects": ["dur.*"]})).await;
    create_raw(
        &client,
        json!({"name": "VOLATILE", "subjects": ["vol"], "storage": "memory"}),
    )
    .await;
    publish_ok(&client, "vol", b"gone", 1).await;

    let payload = |i: u64| Bytes::from(format!("message {i} {}", "x".repeat((i % 50) as usize)));
    let subject = |i: u64| format!("dur.{}", i % 7);

    // Publish with acks, 100 in flight at a time; every message carries a Nats-Msg-Id.
    let mut acked = 0;
    for chunk in (1..=N).collect::<Vec<_>>().chunks(100) {
        let mut futures = Vec::new();
        for &i in chunk {
            let fut = js
                .send_publish(
                    subject(i),
                    PublishMessage::build()
                        .payload(payload(i))
                        .message_id(format!("id-{i}")),
                )
                .await
                .expect("publish");
            futures.push((i, fut));
        }
        for (i, fut) in futures {
            let ack = within("ack", fut).await.expect("ack");
            assert_eq!(ack.sequence, i);
            acked += 1;
        }
    }
    assert_eq!(acked, N);
    let stream = js.get_stream("DUR").await.unwrap();
    assert!(stream.delete_message(500).await.expect("delete 500"));
    let before = info_raw(
        &client,
        "DUR",
        Some(json!({"subjects_filter": ">", "deleted_details": true})),
    )
    .await;
    assert_eq!(before["state"]["messages"], N - 1);
    drop(client);

    server.kill_hard();
    server.restart();

    let client = server.client().await;
    let js = jetstream::new(client.clone());
    // Recovery may take a moment after the port opens.
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let info = info_raw(
            &client,
            "DUR",
            Some(json!({"subjects_filter": ">", "deleted_details": true})),
        )
        .await;
        if info.get("error").is_none() || Instant::now() >= deadline {
            break info;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        after.get("error").is_none(),
        "stream gone after restart: {after}"
    );
    assert_eq!(after["config"], before["config"], "config survives");
    assert_eq!(after["created"], before["created"]);
    let (sb, sa) = (&before["state"], &after["state"]);
    for k in [
        "messages",
        "bytes",
        "first_seq",
        "first_ts",
        "last_seq",
        "last_ts",
        "num_subjects",
        "subjects",
        "num_deleted",
        "deleted",
    ] {
        assert_eq!(
            sa[k], sb[k],
            "state.{k} after restart\nbefore {sb}\nafter  {sa}"
        );
    }

    let stream = js.get_stream("DUR").await.unwrap();
    for i in 1..=N {
        if i == 500 {
            let err = stream
                .get_raw_message(i)
                .await
                .expect_err("500 was deleted");
            assert_eq!(
                err.kind(),
                jetstream::stream::LastRawMessageErrorKind::NoMessageFound
            );
            continue;
        }
        let msg = stream
            .get_raw_message(i)
            .await
            .unwrap_or_else(|e| panic!("message {i} lost: {e}"));
        assert_eq!(msg.sequence, i);
        assert_eq!(msg.subject.as_str(), subject(i));
        assert_eq!(msg.payload, payload(i), "payload of {i}");
        let id = format!("id-{i}");
        assert_eq!(
            msg.headers.get("Nats-Msg-Id").map(|v| v.as_str()),
            Some(id.as_str())
        );
    }

    // The dedup window is rebuilt from the stored messages; new publishes continue the sequence.
    let (_, ack) = publish_raw(&client, "dur.1", &[("Nats-Msg-Id", "id-999")], b"again").await;
    assert_eq!(ack, json!({"stream": "DUR", "seq": 999, "duplicate": true}));
    publish_ok(&client, "dur.1", b"after restart", N + 1).await;

    // Memory streams do not survive a restart.
    let (code, err_code, _) = api_err(&client, &format!("{API}.STREAM.INFO.VOLATILE"), "").await;
    assert_eq!((code, err_code), (404, 10059));
    let (_, info) = json_request(&client, &format!("{API}.INFO"), "").await;
    assert_eq!(info["streams"], 1, "{info}");
}

/// STREAM.DELETE takes no body: the reference refuses anything but an empty payload or an
/// empty JSON object (JSON `null` and `[]` included), before looking the stream up, and the
/// stream stays.
#[tokio::test]
async fn stream_delete_refuses_a_body() {
    let (_server, client, _js) = js_setup().await;
    create_raw(&client, json!({"name": "KEEP", "subjects": ["keep"]})).await;
    for body in ["x", "null", "[]", "0", " ", r#"{"a":1}"#, r#""s""#, "{bad"] {
        let (text, _) = json_request(&client, &format!("{API}.STREAM.DELETE.KEEP"), body).await;
        assert_eq!(
            text,
            r#"{"type":"io.nats.jetstream.api.v1.stream_delete_response","error":{"code":400,"err_code":10038,"description":"expected an empty request payload"}}"#,
            "{body:?}"
        );
    }
    let (_, resp) = json_request(&client, &format!("{API}.STREAM.INFO.KEEP"), "").await;
    assert_eq!(resp["config"]["name"], "KEEP", "{resp}");
    // The body is checked first: the same answer for a stream that does not exist.
    let (_, resp) = json_request(&client, &format!("{API}.STREAM.DELETE.NOPE"), "x").await;
    assert_eq!(api_error(&resp).1, 10038);
    for body in ["{}", " { }\n"] {
        create_raw(&client, json!({"name": "KEEP", "subjects": ["keep"]})).await;
        let (_, resp) = json_request(&client, &format!("{API}.STREAM.DELETE.KEEP"), body).await;
        assert_eq!(resp["success"], true, "{body:?}: {resp}");
    }
}

/// `jetstream { limits { ... } }`: the server's ceilings and defaults for streams'
/// duplicate window and consumers' max_ack_pending, max_request_batch and count, applied
/// and shown in `/varz` and `/jsz` as the reference does; without the block, 1,000
/// consumers per stream (nats-server 2.15's default).
#[tokio::test]
async fn server_jetstream_limits_cap_and_default() {
    let s = Server::start_jetstream_with_config(
        r#"http_port: -1
           jetstream { limits { max_ack_pending: 100, max_request_batch: 50,
             duplicate_window: "1m", default_max_consumers: 2 } }"#,
    );
    let want = json!({"max_request_batch": 50, "max_ack_pending": 100,
        "max_duplicate_window": 60_000_000_000i64, "default_max_consumers": 2});
    for (path, at) in [("/varz", "/jetstream/limits"), ("/jsz", "/limits")] {
        let r = common::http_get(s.monitor_port(), path).await;
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v.pointer(at), Some(&want), "{path}: {v}");
    }
    let c = s.client().await;
    let stream = |name: &str, extra: Value| {
        let mut cfg = json!({"name": name, "subjects": [format!("{}.>", name.to_lowercase())]});
        common::merge(&mut cfg, extra);
        cfg
    };
    let r = common::api(&c, "$JS.API.STREAM.CREATE.L", stream("L", json!({}))).await;
    assert_eq!(r["config"]["duplicate_window"], 60_000_000_000i64, "{r}");
    let (code, err, text) = api_err(
        &c,
        "$JS.API.STREAM.CREATE.L2",
        stream("L2", json!({"duplicate_window": 90_000_000_000i64})).to_string(),
    )
    .await;
    assert_eq!((code, err), (500, 10052), "{text}");
    assert_eq!(
        text,
        "duplicates window can not be larger then server limit of 1m0s"
    );
    let consumer = |name: &str, extra: Value| {
        let mut cfg = json!({"durable_name": name, "ack_policy": "explicit"});
        common::merge(&mut cfg, extra);
        (
            format!("$JS.API.CONSUMER.CREATE.L.{name}"),
            json!({"stream_name": "L", "config": cfg}).to_string(),
        )
    };
    let (subject, body) = consumer("a", json!({}));
    let r = json_request(&c, &subject, body).await.1;
    assert_eq!(r["config"]["max_ack_pending"], 100, "{r}");
    assert_eq!(r["config"]["max_batch"], 50, "{r}");
    let (subject, body) = consumer("big", json!({"max_ack_pending": 200}));
    let (_, err, text) = api_err(&c, &subject, body).await;
    assert_eq!(err, 10121, "{text}");
    assert_eq!(text, "consumer max ack pending exceeds system limit of 100");
    let (subject, body) = consumer("batch", json!({"max_batch": 60}));
    let (_, err, text) = api_err(&c, &subject, body).await;
    assert_eq!(err, 10125, "{text}");
    assert_eq!(
        text,
        "consumer max request batch exceeds server limit of 50"
    );
    let (subject, body) = consumer("b", json!({}));
    assert!(json_request(&c, &subject, body)
        .await
        .1
        .get("error")
        .is_none());
    let (subject, body) = consumer("c", json!({}));
    assert_eq!(api_err(&c, &subject, body).await.1, 10026);
    // A stream's own max_consumers wins over the server's default.
    let r = common::api(
        &c,
        "$JS.API.STREAM.CREATE.M",
        stream("M", json!({"max_consumers": 3})),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    for n in ["a", "b", "c"] {
        let r = common::api(
            &c,
            &format!("$JS.API.CONSUMER.CREATE.M.{n}"),
            json!({"stream_name": "M", "config": {"durable_name": n}}),
        )
        .await;
        assert!(r.get("error").is_none(), "{r}");
    }

    let s = Server::start_jetstream_with_config("http_port: -1");
    let r = common::http_get(s.monitor_port(), "/varz").await;
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        v["jetstream"]["limits"],
        json!({"default_max_consumers": 1000}),
        "{v}"
    );
}
