//! JetStream consumers: the `$JS.API.CONSUMER.*` API (create forms, info,
//! names/list, delete, update rules, validation errors), pull requests and
//! their status messages, the `$JS.ACK` protocol, ack and deliver policies,
//! filters, push / queue / ordered consumers, KV (which rides on ordered push
//! consumers), interest and work-queue retention, bad input, and consumer
//! state across a SIGKILL of the server.
//!
//! Expectations are the observed behaviour of the reference nats-server
//! 2.15.1 (run with `KEEL_TEST_REFERENCE=1` to check them against it). Wire
//! level checks use raw requests / subscriptions so status codes, headers and
//! error JSON are asserted exactly, not the client library's reading of them.
//! Timing-based checks use 1 s ack waits and generous upper bounds.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull, push, AckPolicy, PullConsumer};
use async_nats::jetstream::kv;
use async_nats::jetstream::{self, AckKind, Context};
use async_nats::{Client, HeaderMap, Message, Subscriber};
use bytes::Bytes;
use common::{
    api, api_err, api_error, api_ok, consumer_info, js_setup, json_request, merge, next_msg,
    within, Server, STEP,
};
use futures::StreamExt;
use serde_json::{json, Value};

const API: &str = "$JS.API";
const SEC: u64 = 1_000_000_000;

/// A consumer info's (and create response's) keys, in the reference's order.
const CONSUMER_INFO_KEYS: [&str; 12] = [
    "type",
    "stream_name",
    "name",
    "created",
    "config",
    "delivered",
    "ack_floor",
    "num_ack_pending",
    "num_redelivered",
    "num_waiting",
    "num_pending",
    "ts",
];

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

/// Creates a memory stream (plus `extra` config keys) through the raw API.
async fn create_stream(client: &Client, name: &str, subjects: &[&str], extra: Value) -> Value {
    let mut config = json!({"name": name, "subjects": subjects, "storage": "memory"});
    merge(&mut config, extra);
    api_ok(client, &format!("{API}.STREAM.CREATE.{name}"), config).await
}

/// Creates a durable consumer `name` (explicit ack unless `extra` says
/// otherwise) via `$JS.API.CONSUMER.CREATE.<stream>.<name>`.
async fn create_consumer(client: &Client, stream: &str, name: &str, extra: Value) -> Value {
    let mut config = json!({"name": name, "durable_name": name, "ack_policy": "explicit"});
    merge(&mut config, extra);
    api_ok(
        client,
        &format!("{API}.CONSUMER.CREATE.{stream}.{name}"),
        json!({"stream_name": stream, "config": config}),
    )
    .await
}

/// `$JS.API.CONSUMER.CREATE.<stream>.<name>` with `config`; returns the response.
async fn create_raw(client: &Client, stream: &str, name: &str, config: Value) -> Value {
    api(
        client,
        &format!("{API}.CONSUMER.CREATE.{stream}.{name}"),
        json!({"stream_name": stream, "config": config}),
    )
    .await
}

async fn stream_state(client: &Client, stream: &str) -> Value {
    api_ok(client, &format!("{API}.STREAM.INFO.{stream}"), Value::Null).await["state"].clone()
}

/// JetStream publish (core request); returns the stream sequence.
async fn publish(client: &Client, subject: &str, payload: &str) -> u64 {
    let (text, ack) = json_request(client, subject, payload.to_string()).await;
    assert!(ack.get("error").is_none(), "publish {subject}: {text}");
    ack["seq"].as_u64().expect("PubAck seq")
}

async fn publish_with_headers(
    client: &Client,
    subject: &str,
    headers: &[(&str, &str)],
    payload: &str,
) -> u64 {
    let mut map = HeaderMap::new();
    for (k, v) in headers {
        map.insert(*k, *v);
    }
    let reply = within(
        "publish with headers",
        client.request_with_headers(subject.to_string(), map, payload.to_string().into()),
    )
    .await
    .expect("publish with headers");
    let ack: Value = serde_json::from_slice(&reply.payload).expect("PubAck JSON");
    assert!(ack.get("error").is_none(), "publish {subject}: {ack}");
    ack["seq"].as_u64().expect("PubAck seq")
}

/// The counters of a consumer info, for compact comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    /// `delivered` (consumer_seq, stream_seq)
    delivered: (u64, u64),
    /// `ack_floor` (consumer_seq, stream_seq)
    ack_floor: (u64, u64),
    ack_pending: u64,
    redelivered: u64,
    waiting: u64,
    pending: u64,
}

fn seq_pair(v: &Value) -> (u64, u64) {
    (
        v["consumer_seq"].as_u64().expect("consumer_seq"),
        v["stream_seq"].as_u64().expect("stream_seq"),
    )
}

fn state_of(info: &Value) -> State {
    State {
        delivered: seq_pair(&info["delivered"]),
        ack_floor: seq_pair(&info["ack_floor"]),
        ack_pending: info["num_ack_pending"].as_u64().expect("num_ack_pending"),
        redelivered: info["num_redelivered"].as_u64().expect("num_redelivered"),
        waiting: info["num_waiting"].as_u64().expect("num_waiting"),
        pending: info["num_pending"].as_u64().expect("num_pending"),
    }
}

async fn state(client: &Client, stream: &str, name: &str) -> State {
    state_of(&consumer_info(client, stream, name).await)
}

/// Polls consumer info until `num_pending` is `want`: the reference tells a consumer about
/// newly stored messages asynchronously, so a no_wait pull right after a publish can miss it.
async fn wait_pending(client: &Client, stream: &str, name: &str, want: u64) {
    let deadline = Instant::now() + STEP;
    while state(client, stream, name).await.pending != want {
        assert!(
            Instant::now() < deadline,
            "num_pending never reached {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls consumer info until it shows `want` (acks are processed
/// asynchronously); panics with the last state after `STEP`.
async fn wait_state(client: &Client, stream: &str, name: &str, want: State) {
    let deadline = Instant::now() + STEP;
    loop {
        let got = state(client, stream, name).await;
        if got == want {
            return;
        }
        if Instant::now() >= deadline {
            panic!("consumer {stream}/{name}: state {got:?}, expected {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls the stream's message count until it is `want`.
async fn wait_messages(client: &Client, stream: &str, want: u64) -> Value {
    let deadline = Instant::now() + STEP;
    loop {
        let st = stream_state(client, stream).await;
        if st["messages"].as_u64() == Some(want) {
            return st;
        }
        if Instant::now() >= deadline {
            panic!("stream {stream}: state {st}, expected {want} messages");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends a pull request (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`)
/// with a fresh inbox as reply subject; deliveries and status messages for
/// the request arrive on the returned subscription.
async fn pull(client: &Client, stream: &str, consumer: &str, body: &str) -> Subscriber {
    let inbox = client.new_inbox();
    let sub = client
        .subscribe(inbox.clone())
        .await
        .expect("subscribe inbox");
    client
        .publish_with_reply(
            format!("{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            inbox,
            Bytes::from(body.to_string()),
        )
        .await
        .expect("publish pull request");
    within("flush pull request", client.flush())
        .await
        .expect("flush");
    sub
}

/// Next message within `wait`, or `None`.
async fn next_within(sub: &mut Subscriber, wait: Duration) -> Option<Message> {
    match tokio::time::timeout(wait, sub.next()).await {
        Ok(Some(m)) => Some(m),
        Ok(None) => panic!("subscription ended"),
        Err(_) => None,
    }
}

/// Asserts nothing (delivery or status) arrives within `wait`.
async fn quiet(sub: &mut Subscriber, wait: Duration) {
    if let Some(m) = next_within(sub, wait).await {
        panic!(
            "unexpected message: subject {} reply {:?} status {:?} {:?} payload {:?}",
            m.subject,
            m.reply,
            m.status,
            m.description,
            String::from_utf8_lossy(&m.payload)
        );
    }
}

fn status(m: &Message) -> Option<u16> {
    m.status.map(|s| s.as_u16())
}

fn header(m: &Message, name: &str) -> Option<String> {
    m.headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_string())
}

fn text(m: &Message) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

/// A JetStream delivery: no status, a `$JS.ACK.` reply subject.
fn is_delivery(m: &Message) -> bool {
    m.status.is_none()
        && m.reply
            .as_ref()
            .is_some_and(|r| r.as_str().starts_with("$JS.ACK."))
}

/// The next message, which must be a delivery.
async fn delivery(sub: &mut Subscriber) -> Message {
    let m = next_msg(sub).await;
    assert!(
        is_delivery(&m),
        "expected a delivery, got subject {} reply {:?} status {:?} {:?}",
        m.subject,
        m.reply,
        m.status,
        m.description
    );
    m
}

/// The next message, which must be a status message with `code`; returns it.
async fn status_msg(sub: &mut Subscriber, code: u16) -> Message {
    let m = next_msg(sub).await;
    assert_eq!(
        status(&m),
        Some(code),
        "expected status {code}, got subject {} reply {:?} status {:?} {:?} payload {:?}",
        m.subject,
        m.reply,
        m.status,
        m.description,
        text(&m)
    );
    assert!(m.payload.is_empty(), "status messages carry no payload");
    m
}

/// Metadata of a delivery from its `$JS.ACK` reply subject.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Meta {
    stream: String,
    consumer: String,
    delivered: i64,
    sseq: u64,
    cseq: u64,
    pending: u64,
    /// The timestamp token (Unix ns), as text.
    ts: String,
}

/// Parses the reply subject of a delivery with async-nats (`Message::info`)
/// after checking it is the 9-token form the reference sends.
fn meta(js: &Context, m: &Message) -> Meta {
    let reply = m.reply.as_ref().expect("delivery has a reply subject");
    let tokens: Vec<&str> = reply.as_str().split('.').collect();
    assert_eq!(
        tokens.len(),
        9,
        "ack subject must be $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>, got {reply}"
    );
    assert_eq!((tokens[0], tokens[1]), ("$JS", "ACK"));
    let jm = jetstream::Message {
        message: m.clone(),
        context: js.clone(),
    };
    let info = jm.info().expect("async-nats parses the ack subject");
    Meta {
        stream: info.stream.to_string(),
        consumer: info.consumer.to_string(),
        delivered: info.delivered,
        sseq: info.stream_sequence,
        cseq: info.consumer_sequence,
        pending: info.pending,
        ts: tokens[7].to_string(),
    }
}

/// Publishes `payload` to `subject` with a reply inbox and returns the reply
/// if one arrives within `wait`.
async fn with_reply(
    client: &Client,
    subject: &str,
    payload: &str,
    wait: Duration,
) -> Option<Message> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
    client
        .publish_with_reply(subject.to_string(), inbox, Bytes::from(payload.to_string()))
        .await
        .expect("publish");
    within("flush", client.flush()).await.expect("flush");
    next_within(&mut sub, wait).await
}

/// Acks `m` with `payload` and a reply subject (AckSync); asserts the server
/// answers with an empty message.
async fn ack_sync(client: &Client, m: &Message, payload: &str) {
    let reply = m.reply.as_ref().expect("delivery has a reply subject");
    let answer = with_reply(client, reply.as_str(), payload, STEP)
        .await
        .unwrap_or_else(|| panic!("no reply to {payload:?} on {reply}"));
    assert!(answer.payload.is_empty(), "AckSync reply is empty");
    assert!(answer.status.is_none(), "AckSync reply has no status");
}

/// Plain ack (no reply subject) with `payload`.
async fn ack_plain(client: &Client, m: &Message, payload: &str) {
    let reply = m.reply.as_ref().expect("delivery has a reply subject");
    client
        .publish(reply.to_string(), Bytes::from(payload.to_string()))
        .await
        .expect("publish ack");
    within("flush", client.flush()).await.expect("flush");
}

fn keys(v: &Value) -> Vec<String> {
    v.as_object()
        .expect("object")
        .keys()
        .map(|k| k.to_string())
        .collect()
}

// ---------------------------------------------------------------------------
// CONSUMER.CREATE forms
// ---------------------------------------------------------------------------

#[tokio::test]
async fn create_named_form_durable_and_not() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;

    let r = create_raw(
        &client,
        "S",
        "c1",
        json!({"name": "c1", "durable_name": "c1", "ack_policy": "explicit"}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(keys(&r), CONSUMER_INFO_KEYS);
    assert_eq!(
        r["type"],
        "io.nats.jetstream.api.v1.consumer_create_response"
    );
    assert_eq!(r["stream_name"], "S");
    assert_eq!(r["name"], "c1");
    let c = &r["config"];
    assert_eq!(
        keys(c),
        [
            "durable_name",
            "name",
            "deliver_policy",
            "ack_policy",
            "ack_wait",
            "max_deliver",
            "replay_policy",
            "max_waiting",
            "max_ack_pending",
            "num_replicas",
            "metadata"
        ],
        "durable config keys: {c}"
    );
    assert_eq!(c["durable_name"], "c1");
    assert_eq!(c["name"], "c1");
    assert_eq!(c["deliver_policy"], "all");
    assert_eq!(c["ack_policy"], "explicit");
    assert_eq!(c["ack_wait"], 30 * SEC);
    assert_eq!(c["max_deliver"], -1);
    assert_eq!(c["replay_policy"], "instant");
    assert_eq!(c["max_waiting"], 512);
    assert_eq!(c["max_ack_pending"], 1000);
    assert_eq!(c["num_replicas"], 0);
    assert_eq!(c["metadata"]["_nats.req.level"], "0");
    assert_eq!(r["delivered"], json!({"consumer_seq": 0, "stream_seq": 0}));
    assert_eq!(r["ack_floor"], json!({"consumer_seq": 0, "stream_seq": 0}));
    for k in [
        "num_ack_pending",
        "num_redelivered",
        "num_waiting",
        "num_pending",
    ] {
        assert_eq!(r[k], 0, "{k}");
    }

    // Name only: not durable, so it gets the 5 s inactive threshold.
    let r = create_raw(
        &client,
        "S",
        "c2",
        json!({"name": "c2", "ack_policy": "explicit"}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["name"], "c2");
    assert!(r["config"].get("durable_name").is_none(), "{r}");
    assert_eq!(r["config"]["name"], "c2");
    assert_eq!(r["config"]["inactive_threshold"], 5 * SEC);

    // A config name that differs from the subject token: the subject wins.
    let r = create_raw(
        &client,
        "S",
        "c3",
        json!({"name": "other", "ack_policy": "explicit"}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["name"], "c3");
    assert_eq!(r["config"]["name"], "c3");

    // A durable name that differs from the subject token is refused.
    let r = create_raw(
        &client,
        "S",
        "c4",
        json!({"durable_name": "other", "ack_policy": "explicit"}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10017,
            "consumer name in subject does not match durable name in request".into()
        )
    );

    // A body without config: created with ack_policy none (pinned).
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.bare"),
        json!({"stream_name": "S"}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["config"]["ack_policy"], "none");

    // Through async-nats (which always uses this subject form).
    let stream = js.get_stream("S").await.expect("get stream");
    let c: PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("viaclient".into()),
            ..Default::default()
        })
        .await
        .expect("create via async-nats");
    assert_eq!(c.cached_info().name, "viaclient");
    assert_eq!(c.cached_info().config.ack_policy, AckPolicy::Explicit);
}

#[tokio::test]
async fn create_filtered_subject_form() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "1").await;
    publish(&client, "s.b", "2").await;

    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.f1.s.b"),
        json!({"stream_name": "S", "config": {"name": "f1", "durable_name": "f1", "ack_policy": "explicit", "filter_subject": "s.b"}}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["name"], "f1");
    assert_eq!(r["config"]["filter_subject"], "s.b");
    assert_eq!(r["num_pending"], 1);

    // Wildcard filters fit in the subject too.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.f2.s.>"),
        json!({"stream_name": "S", "config": {"name": "f2", "ack_policy": "explicit", "filter_subject": "s.>"}}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["num_pending"], 2);

    let mismatch = (
        400,
        10131,
        "Consumer create request did not match filtered subject from create subject".to_string(),
    );
    // Filter in the subject differs from the body's.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.f3.s.a"),
        json!({"stream_name": "S", "config": {"name": "f3", "ack_policy": "explicit", "filter_subject": "s.b"}}),
    )
    .await;
    assert_eq!(api_error(&r), mismatch);
    // Filter in the subject, none in the body.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.f4.s.a"),
        json!({"stream_name": "S", "config": {"name": "f4", "ack_policy": "explicit"}}),
    )
    .await;
    assert_eq!(api_error(&r), mismatch);
    // filter_subjects cannot use the subject form.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.f5.s.>"),
        json!({"stream_name": "S", "config": {"name": "f5", "ack_policy": "explicit", "filter_subjects": ["s.>"]}}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10137,
            "consumer with multiple subject filters cannot use subject based API".into()
        )
    );

    // async-nats puts a filter into the subject.
    let stream = js.get_stream("S").await.expect("get stream");
    let c: PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("f6".into()),
            filter_subject: "s.a".into(),
            ..Default::default()
        })
        .await
        .expect("create filtered via async-nats");
    assert_eq!(c.cached_info().config.filter_subject, "s.a");
    assert_eq!(c.cached_info().num_pending, 1);
}

#[tokio::test]
async fn create_legacy_durable_form() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;

    let r = api(
        &client,
        &format!("{API}.CONSUMER.DURABLE.CREATE.S.legacy"),
        json!({"stream_name": "S", "config": {"durable_name": "legacy", "deliver_policy": "all", "ack_policy": "explicit", "replay_policy": "instant", "ack_wait": 0, "idle_heartbeat": 0, "inactive_threshold": 0}}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(
        r["type"],
        "io.nats.jetstream.api.v1.consumer_create_response"
    );
    assert_eq!(r["name"], "legacy");
    assert_eq!(r["config"]["durable_name"], "legacy");
    assert_eq!(r["config"]["name"], "legacy");
    assert_eq!(
        r["config"]["ack_wait"],
        30 * SEC,
        "ack_wait 0 means default"
    );
    assert!(r["config"].get("inactive_threshold").is_none());

    // Without a durable name.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.DURABLE.CREATE.S.legacy2"),
        json!({"stream_name": "S", "config": {"ack_policy": "explicit"}}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10018,
            "consumer expected to be durable but a durable name was not set".into()
        )
    );
    // Durable name differs from the subject.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.DURABLE.CREATE.S.legacy3"),
        json!({"stream_name": "S", "config": {"durable_name": "zzz", "ack_policy": "explicit"}}),
    )
    .await;
    assert_eq!(api_error(&r).1, 10017);

    let info = consumer_info(&client, "S", "legacy").await;
    assert_eq!(info["config"]["durable_name"], "legacy");
}

#[tokio::test]
async fn create_ephemeral_form() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;

    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S"),
        json!({"stream_name": "S", "config": {"deliver_policy": "all", "ack_policy": "explicit", "replay_policy": "instant", "ack_wait": 0, "idle_heartbeat": 0, "inactive_threshold": 0}}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    let name = r["name"].as_str().expect("generated name").to_string();
    assert!(!name.is_empty());
    assert!(
        name.chars().all(|c| c.is_ascii_alphanumeric()),
        "generated name {name:?}"
    );
    assert!(r["config"].get("name").is_none(), "{r}");
    assert!(r["config"].get("durable_name").is_none(), "{r}");
    assert_eq!(r["config"]["inactive_threshold"], 5 * SEC);
    let info = consumer_info(&client, "S", &name).await;
    assert_eq!(info["name"], name.as_str());

    // A name in the body is used.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S"),
        json!({"stream_name": "S", "config": {"name": "given", "ack_policy": "explicit"}}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["name"], "given");

    // A durable name on the ephemeral subject is refused.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S"),
        json!({"stream_name": "S", "config": {"durable_name": "d", "ack_policy": "explicit"}}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10020,
            "consumer expected to be ephemeral but a durable name was set in request".into()
        )
    );
}

#[tokio::test]
async fn create_request_errors() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;

    let body = json!({"stream_name": "NOPE", "config": {"name": "x", "ack_policy": "explicit"}});
    let e = api_err(
        &client,
        &format!("{API}.CONSUMER.CREATE.NOPE.x"),
        body.to_string(),
    )
    .await;
    assert_eq!(e, (404, 10059, "stream not found".into()));

    let body = json!({"stream_name": "T", "config": {"name": "x", "ack_policy": "explicit"}});
    let e = api_err(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.x"),
        body.to_string(),
    )
    .await;
    assert_eq!(
        e,
        (
            400,
            10056,
            "stream name in subject does not match request".into()
        )
    );

    let e = api_err(&client, &format!("{API}.CONSUMER.CREATE.S.x"), "").await;
    assert_eq!(e.1, 10056, "empty body: {e:?}");

    let e = api_err(&client, &format!("{API}.CONSUMER.CREATE.S.x"), "{bad").await;
    assert_eq!(
        e,
        (
            400,
            10025,
            "invalid JSON: invalid character 'b' looking for beginning of object key string at offset 2"
                .into()
        )
    );

    // Nothing was created by the failed requests.
    let names = api_ok(&client, &format!("{API}.CONSUMER.NAMES.S"), Value::Null).await;
    assert_eq!(names["total"], 0, "{names}");
}

// ---------------------------------------------------------------------------
// info, names, list, delete
// ---------------------------------------------------------------------------

#[tokio::test]
async fn consumer_info_fields() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=5 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    create_consumer(&client, "S", "c", json!({})).await;
    let fresh = consumer_info(&client, "S", "c").await;
    assert_eq!(keys(&fresh), CONSUMER_INFO_KEYS);
    assert_eq!(
        fresh["type"],
        "io.nats.jetstream.api.v1.consumer_info_response"
    );
    assert_eq!(
        state_of(&fresh),
        State {
            delivered: (0, 0),
            ack_floor: (0, 0),
            ack_pending: 0,
            redelivered: 0,
            waiting: 0,
            pending: 5
        }
    );

    let mut sub = pull(&client, "S", "c", r#"{"batch":3,"no_wait":true}"#).await;
    let m1 = delivery(&mut sub).await;
    let m2 = delivery(&mut sub).await;
    let _m3 = delivery(&mut sub).await;
    // The request is complete after 3 messages: no trailing status.
    quiet(&mut sub, Duration::from_millis(200)).await;
    ack_sync(&client, &m1, "+ACK").await;
    let info = consumer_info(&client, "S", "c").await;
    assert_eq!(
        state_of(&info),
        State {
            delivered: (3, 3),
            ack_floor: (1, 1),
            ack_pending: 2,
            redelivered: 0,
            waiting: 0,
            pending: 2
        }
    );
    assert!(info["delivered"].get("last_active").is_some(), "{info}");
    assert!(info["ack_floor"].get("last_active").is_some(), "{info}");

    // A request that stays waiting after taking the last two messages.
    let mut waiting = pull(&client, "S", "c", r#"{"batch":10,"expires":3000000000}"#).await;
    delivery(&mut waiting).await;
    delivery(&mut waiting).await;
    wait_state(
        &client,
        "S",
        "c",
        State {
            delivered: (5, 5),
            ack_floor: (1, 1),
            ack_pending: 4,
            redelivered: 0,
            waiting: 1,
            pending: 0,
        },
    )
    .await;

    // A NAK goes straight to the waiting request as a redelivery.
    ack_sync(&client, &m2, "-NAK").await;
    let again = delivery(&mut waiting).await;
    let m = meta(&js, &again);
    assert_eq!((m.sseq, m.delivered, m.cseq), (2, 2, 6));
    wait_state(
        &client,
        "S",
        "c",
        State {
            delivered: (6, 5),
            ack_floor: (1, 1),
            ack_pending: 4,
            redelivered: 1,
            waiting: 1,
            pending: 0,
        },
    )
    .await;

    // async-nats reads the same numbers.
    let stream = js.get_stream("S").await.expect("get stream");
    let ci = stream.consumer_info("c").await.expect("consumer info");
    assert_eq!(ci.name, "c");
    assert_eq!(ci.stream_name, "S");
    assert_eq!(ci.delivered.consumer_sequence, 6);
    assert_eq!(ci.delivered.stream_sequence, 5);
    assert_eq!(ci.ack_floor.stream_sequence, 1);
    assert_eq!(ci.num_ack_pending, 4);
    assert_eq!(ci.num_redelivered, 1);
    assert_eq!(ci.num_waiting, 1);
    assert_eq!(ci.num_pending, 0);
}

#[tokio::test]
async fn names_and_list() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;

    let empty = api_ok(&client, &format!("{API}.CONSUMER.NAMES.S"), Value::Null).await;
    assert_eq!(
        empty["type"],
        "io.nats.jetstream.api.v1.consumer_names_response"
    );
    assert_eq!(empty["total"], 0);

    for name in ["c3", "c1", "c2"] {
        create_consumer(&client, "S", name, json!({})).await;
    }
    let names = api_ok(&client, &format!("{API}.CONSUMER.NAMES.S"), Value::Null).await;
    assert_eq!(
        names,
        json!({"type": "io.nats.jetstream.api.v1.consumer_names_response", "total": 3, "offset": 0, "limit": 1024, "consumers": ["c1", "c2", "c3"]})
    );
    let paged = api_ok(
        &client,
        &format!("{API}.CONSUMER.NAMES.S"),
        json!({"offset": 1}),
    )
    .await;
    assert_eq!(paged["total"], 3);
    assert_eq!(paged["offset"], 1);
    assert_eq!(paged["consumers"], json!(["c2", "c3"]));

    let list = api_ok(&client, &format!("{API}.CONSUMER.LIST.S"), Value::Null).await;
    assert_eq!(
        list["type"],
        "io.nats.jetstream.api.v1.consumer_list_response"
    );
    assert_eq!(list["total"], 3);
    assert_eq!(list["offset"], 0);
    assert_eq!(list["limit"], 256);
    let items = list["consumers"].as_array().expect("consumers array");
    assert_eq!(items.len(), 3);
    let mut listed = BTreeSet::new();
    for item in items {
        assert!(
            item.get("type").is_none(),
            "list items carry no type: {item}"
        );
        assert_eq!(item["stream_name"], "S");
        // A list item is an info without `type`.
        for k in CONSUMER_INFO_KEYS
            .iter()
            .filter(|k| !["type", "stream_name"].contains(k))
        {
            assert!(item.get(*k).is_some(), "list item lacks {k}: {item}");
        }
        listed.insert(item["name"].as_str().unwrap().to_string());
    }
    assert_eq!(
        listed,
        BTreeSet::from(["c1".into(), "c2".into(), "c3".into()])
    );

    // async-nats
    let stream = js.get_stream("S").await.expect("get stream");
    let names: Vec<String> = within(
        "consumer names",
        stream.consumer_names().collect::<Vec<_>>(),
    )
    .await
    .into_iter()
    .map(|r| r.expect("name"))
    .collect();
    assert_eq!(names.into_iter().collect::<BTreeSet<_>>(), listed);

    // Missing stream.
    let r = api(&client, &format!("{API}.CONSUMER.NAMES.NOPE"), Value::Null).await;
    assert_eq!(api_error(&r), (404, 10059, "stream not found".into()));
    let r = api(&client, &format!("{API}.CONSUMER.LIST.NOPE"), Value::Null).await;
    assert_eq!(api_error(&r), (404, 10059, "stream not found".into()));
}

#[tokio::test]
async fn delete_and_not_found() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    create_consumer(&client, "S", "c", json!({})).await;
    create_consumer(&client, "S", "doomed", json!({})).await;

    let r = api(&client, &format!("{API}.CONSUMER.DELETE.S.c"), Value::Null).await;
    assert_eq!(
        r,
        json!({"type": "io.nats.jetstream.api.v1.consumer_delete_response", "success": true})
    );
    let not_found = (404, 10014, "consumer not found".to_string());
    let r = api(&client, &format!("{API}.CONSUMER.INFO.S.c"), Value::Null).await;
    assert_eq!(r["type"], "io.nats.jetstream.api.v1.consumer_info_response");
    assert_eq!(api_error(&r), not_found);
    let r = api(&client, &format!("{API}.CONSUMER.DELETE.S.c"), Value::Null).await;
    assert_eq!(
        r["type"],
        "io.nats.jetstream.api.v1.consumer_delete_response"
    );
    assert_eq!(api_error(&r), not_found);
    let r = api(&client, &format!("{API}.CONSUMER.INFO.NOPE.c"), Value::Null).await;
    assert_eq!(api_error(&r), (404, 10059, "stream not found".into()));

    // A pull on a deleted consumer: no responders.
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let m = status_msg(&mut sub, 503).await;
    assert_eq!(
        header(&m, "Nats-Subject").as_deref(),
        Some("$JS.API.CONSUMER.MSG.NEXT.S.c")
    );

    // A waiting pull request is told when its consumer goes away.
    let mut sub = pull(
        &client,
        "S",
        "doomed",
        r#"{"batch":1,"expires":5000000000}"#,
    )
    .await;
    quiet(&mut sub, Duration::from_millis(200)).await;
    api_ok(
        &client,
        &format!("{API}.CONSUMER.DELETE.S.doomed"),
        Value::Null,
    )
    .await;
    let m = status_msg(&mut sub, 409).await;
    assert_eq!(m.description.as_deref(), Some("Consumer Deleted"));

    let names = api_ok(&client, &format!("{API}.CONSUMER.NAMES.S"), Value::Null).await;
    assert_eq!(names["total"], 0);
}

// ---------------------------------------------------------------------------
// updates, actions, validation
// ---------------------------------------------------------------------------

#[tokio::test]
async fn update_rules() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    let base = json!({"name": "c", "durable_name": "c", "ack_policy": "explicit"});
    create_raw(&client, "S", "c", base.clone()).await;

    // Changes that are allowed (each applied on its own to the base config).
    let allowed = [
        ("ack_wait", json!(5 * SEC)),
        ("max_deliver", json!(3)),
        ("max_ack_pending", json!(5)),
        ("description", json!("desc")),
        ("filter_subject", json!("s.x")),
        ("headers_only", json!(true)),
        ("max_batch", json!(5)),
        ("max_expires", json!(5 * SEC)),
        ("max_bytes", json!(10)),
    ];
    for (key, value) in allowed {
        let mut cfg = base.clone();
        cfg[key] = value.clone();
        let r = create_raw(&client, "S", "c", cfg).await;
        assert!(r.get("error").is_none(), "changing {key} refused: {r}");
        assert_eq!(r["config"][key], value, "{key} not applied: {r}");
        let info = consumer_info(&client, "S", "c").await;
        assert_eq!(info["config"][key], value, "{key} not in info: {info}");
    }
    let r = create_raw(
        &client,
        "S",
        "c",
        json!({"name": "c", "durable_name": "c", "ack_policy": "explicit", "metadata": {"team": "x"}}),
    )
    .await;
    assert_eq!(r["config"]["metadata"]["team"], "x", "{r}");

    // Changes that are refused, with the exact description.
    let refused = [
        ("ack_policy", json!("none"), "ack policy can not be updated"),
        ("ack_policy", json!("all"), "ack policy can not be updated"),
        (
            "deliver_policy",
            json!("new"),
            "deliver policy can not be updated",
        ),
        (
            "replay_policy",
            json!("original"),
            "replay policy can not be updated",
        ),
        ("max_waiting", json!(10), "max waiting can not be updated"),
        (
            "deliver_subject",
            json!("dlv.x"),
            "can not update pull consumer to push based",
        ),
        (
            "mem_storage",
            json!(true),
            "storage type can not be updated",
        ),
    ];
    for (key, value, description) in refused {
        let mut cfg = base.clone();
        cfg[key] = value;
        let r = create_raw(&client, "S", "c", cfg).await;
        assert_eq!(
            api_error(&r),
            (500, 10012, description.to_string()),
            "changing {key}"
        );
    }
    let info = consumer_info(&client, "S", "c").await;
    assert_eq!(info["config"]["ack_policy"], "explicit");

    // async-nats update (action "update") applies the new config.
    let stream = js.get_stream("S").await.expect("get stream");
    let updated = stream
        .update_consumer(pull::Config {
            durable_name: Some("c".into()),
            description: Some("via update".into()),
            ack_wait: Duration::from_secs(7),
            ..Default::default()
        })
        .await
        .expect("update via async-nats");
    assert_eq!(
        updated.cached_info().config.ack_wait,
        Duration::from_secs(7)
    );
    let info = consumer_info(&client, "S", "c").await;
    assert_eq!(info["config"]["description"], "via update");
    assert_eq!(info["config"]["ack_wait"], 7 * SEC);
}

#[tokio::test]
async fn create_action_create_and_update() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    let cfg = json!({"name": "c", "durable_name": "c", "ack_policy": "explicit"});
    let req = |config: Value, action: &str| json!({"stream_name": "S", "config": config, "action": action});
    let subject = format!("{API}.CONSUMER.CREATE.S.c");

    let r = api(&client, &subject, req(cfg.clone(), "create")).await;
    assert!(r.get("error").is_none(), "{r}");
    // Same config again with "create": fine (idempotent).
    let r = api(&client, &subject, req(cfg.clone(), "create")).await;
    assert!(r.get("error").is_none(), "identical create refused: {r}");
    // Different config with "create".
    let mut other = cfg.clone();
    other["description"] = json!("d");
    let r = api(&client, &subject, req(other.clone(), "create")).await;
    assert_eq!(
        api_error(&r),
        (400, 10148, "consumer already exists".into())
    );
    // "update" of an existing one works.
    let r = api(&client, &subject, req(other, "update")).await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["config"]["description"], "d");
    // "update" of a missing one.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.missing"),
        req(
            json!({"name": "missing", "ack_policy": "explicit"}),
            "update",
        ),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (400, 10149, "consumer does not exist".into())
    );
    // Unknown action.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.S.missing"),
        req(
            json!({"name": "missing", "ack_policy": "explicit"}),
            "bogus",
        ),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10025,
            "invalid JSON: unknown consumer action: \"bogus\"".into()
        )
    );

    // async-nats strict create / update map to the same errors.
    let stream = js.get_stream("S").await.expect("get stream");
    let err = stream
        .create_consumer_strict(pull::Config {
            durable_name: Some("c".into()),
            description: Some("changed".into()),
            ..Default::default()
        })
        .await
        .expect_err("strict create of a different existing consumer");
    assert_eq!(
        err.kind(),
        jetstream::stream::ConsumerCreateStrictErrorKind::AlreadyExists,
        "{err}"
    );
    let err = stream
        .update_consumer(pull::Config {
            durable_name: Some("nope".into()),
            ..Default::default()
        })
        .await
        .expect_err("update of a missing consumer");
    assert_eq!(
        err.kind(),
        jetstream::stream::ConsumerUpdateErrorKind::DoesNotExist,
        "{err}"
    );
}

#[tokio::test]
async fn consumer_name_validation() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    let subject = format!("{API}.CONSUMER.CREATE.S");
    let body = |name: &str| json!({"stream_name": "S", "config": {"name": name, "ack_policy": "explicit"}});

    for bad in ["a.b", "a*b", "a>b", "a b", "a\tb"] {
        let (raw, r) = json_request(&client, &subject, body(bad).to_string()).await;
        assert_eq!(
            api_error(&r),
            (
                500,
                10052,
                "consumer name can not contain '.', '*', '>', '\\', '/'".into()
            ),
            "name {bad:?}"
        );
        assert!(
            raw.contains(r"'\u003e'"),
            "'>' is escaped on the wire: {raw}"
        );
    }
    for bad in ["a/b", "a\\b"] {
        let r = api(&client, &subject, body(bad)).await;
        assert_eq!(
            api_error(&r),
            (
                400,
                10127,
                "Consumer name can not contain path separators".into()
            ),
            "name {bad:?}"
        );
    }
    for good in ["a-b_c", "ABC123", "ä"] {
        let r = api(&client, &subject, body(good)).await;
        assert!(r.get("error").is_none(), "name {good:?} refused: {r}");
        assert_eq!(r["name"], good);
    }
}

#[tokio::test]
async fn workqueue_consumer_rules() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "WQ", &["wq.>"], json!({"retention": "workqueue"})).await;

    let r = create_raw(
        &client,
        "WQ",
        "w1",
        json!({"name": "w1", "ack_policy": "explicit"}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    let r = create_raw(
        &client,
        "WQ",
        "w2",
        json!({"name": "w2", "ack_policy": "explicit"}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10099,
            "multiple non-filtered consumers not allowed on workqueue stream".into()
        )
    );
    // A filtered one overlaps the unfiltered one too.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.WQ.w3.wq.a"),
        json!({"stream_name": "WQ", "config": {"name": "w3", "ack_policy": "explicit", "filter_subject": "wq.a"}}),
    )
    .await;
    let not_unique = (
        400,
        10100,
        "filtered consumer not unique on workqueue stream".to_string(),
    );
    assert_eq!(api_error(&r), not_unique);

    api_ok(
        &client,
        &format!("{API}.CONSUMER.DELETE.WQ.w1"),
        Value::Null,
    )
    .await;
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.WQ.w3.wq.a"),
        json!({"stream_name": "WQ", "config": {"name": "w3", "ack_policy": "explicit", "filter_subject": "wq.a"}}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    // Disjoint filters are fine, overlapping ones are not.
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.WQ.w4.wq.b"),
        json!({"stream_name": "WQ", "config": {"name": "w4", "ack_policy": "explicit", "filter_subject": "wq.b"}}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.WQ.w5.wq.>"),
        json!({"stream_name": "WQ", "config": {"name": "w5", "ack_policy": "explicit", "filter_subject": "wq.>"}}),
    )
    .await;
    assert_eq!(api_error(&r), not_unique);

    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.WQ.w6.wq.c"),
        json!({"stream_name": "WQ", "config": {"name": "w6", "ack_policy": "none", "filter_subject": "wq.c"}}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10084,
            "consumer in pull mode requires explicit ack policy on workqueue stream".into()
        )
    );
    let r = api(
        &client,
        &format!("{API}.CONSUMER.CREATE.WQ.w7.wq.c"),
        json!({"stream_name": "WQ", "config": {"name": "w7", "ack_policy": "explicit", "filter_subject": "wq.c", "deliver_policy": "new"}}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10101,
            "consumer must be deliver all on workqueue stream".into()
        )
    );
}

#[tokio::test]
async fn flow_control_and_heartbeat_rules() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;

    let r = create_raw(
        &client,
        "S",
        "fc",
        json!({"name": "fc", "ack_policy": "explicit", "flow_control": true, "deliver_subject": "dlv.fc"}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10108,
            "consumer with flow control also needs heartbeats".into()
        )
    );
    let r = create_raw(
        &client,
        "S",
        "fc2",
        json!({"name": "fc2", "ack_policy": "explicit", "flow_control": true}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10089,
            "consumer flow control requires a push based consumer".into()
        )
    );
    let r = create_raw(
        &client,
        "S",
        "hb",
        json!({"name": "hb", "ack_policy": "explicit", "idle_heartbeat": SEC}),
    )
    .await;
    assert_eq!(
        api_error(&r),
        (
            400,
            10088,
            "consumer idle heartbeat requires a push based consumer".into()
        )
    );
    let r = create_raw(
        &client,
        "S",
        "ok",
        json!({"name": "ok", "ack_policy": "explicit", "flow_control": true, "idle_heartbeat": SEC, "deliver_subject": "dlv.ok"}),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["config"]["flow_control"], true);
    assert_eq!(r["config"]["idle_heartbeat"], SEC);
    assert_eq!(r["config"]["deliver_subject"], "dlv.ok");
    assert!(
        r["config"].get("max_waiting").is_none(),
        "push consumers have no max_waiting: {r}"
    );
}

#[tokio::test]
async fn contradictory_configs_are_json_errors() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    let cases: Vec<(Value, (u64, u64, &str))> = vec![
        (
            json!({"deliver_policy": "by_start_sequence"}),
            (400, 10094, "consumer delivery policy is deliver by start sequence, but optional start sequence is not set"),
        ),
        (
            json!({"deliver_policy": "all", "opt_start_seq": 5}),
            (400, 10094, "consumer delivery policy is deliver all, but optional start sequence is also set"),
        ),
        (
            json!({"deliver_policy": "by_start_time"}),
            (400, 10094, "consumer delivery policy is deliver by start time, but optional start time is not set"),
        ),
        (
            json!({"deliver_policy": "last_per_subject"}),
            (400, 10094, "consumer delivery policy is deliver last per subject, but optional filter subject is not set"),
        ),
        (
            json!({"filter_subject": "s.a", "filter_subjects": ["s.b"]}),
            (400, 10136, "consumer cannot have both FilterSubject and FilterSubjects specified"),
        ),
        (
            json!({"filter_subjects": ["s.a", "s.>"]}),
            (400, 10138, "consumer subject filters cannot overlap"),
        ),
        (
            json!({"max_deliver": 1, "backoff": [SEC, 2 * SEC]}),
            (400, 10116, "max deliver is required to be > length of backoff values"),
        ),
        (
            json!({"deliver_subject": "s.loop"}),
            (400, 10081, "consumer deliver subject forms a cycle"),
        ),
        (
            json!({"ack_wait": -1}),
            (400, 10183, "consumer ack wait needs to be positive"),
        ),
        (
            json!({"ack_policy": "bogus"}),
            (400, 10025, "invalid JSON: can not unmarshal \"\\\"bogus\\\"\""),
        ),
        (
            json!({"ack_wait": "5s"}),
            (400, 10025, "invalid JSON: json: cannot unmarshal string into Go struct field CreateConsumerRequest.config.ack_wait of type time.Duration"),
        ),
        (
            json!({"num_replicas": 3}),
            (500, 10074, "replicas > 1 not supported in non-clustered mode"),
        ),
    ];
    for (i, (extra, (code, err_code, description))) in cases.into_iter().enumerate() {
        let name = format!("k{i}");
        let mut cfg = json!({"name": name, "ack_policy": "explicit"});
        merge(&mut cfg, extra.clone());
        let r = create_raw(&client, "S", &name, cfg).await;
        assert_eq!(
            api_error(&r),
            (code, err_code, description.to_string()),
            "config {extra}"
        );
    }
    let names = api_ok(&client, &format!("{API}.CONSUMER.NAMES.S"), Value::Null).await;
    assert_eq!(names["total"], 0, "{names}");
}

// ---------------------------------------------------------------------------
// pull requests
// ---------------------------------------------------------------------------

#[tokio::test]
async fn pull_batch_and_ack_subject_format() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "PULL", &["pull.>"], json!({})).await;
    publish(&client, "pull.a", "first").await;
    publish_with_headers(&client, "pull.b", &[("X-Trace", "t-2")], "second").await;
    publish(&client, "pull.a", "third").await;
    create_consumer(&client, "PULL", "worker", json!({})).await;

    let mut sub = pull(
        &client,
        "PULL",
        "worker",
        r#"{"batch":2,"expires":2000000000}"#,
    )
    .await;
    let d1 = delivery(&mut sub).await;
    let d2 = delivery(&mut sub).await;
    // The request is finished after two messages: nothing else comes.
    quiet(&mut sub, Duration::from_millis(300)).await;

    assert_eq!(
        d1.subject.as_str(),
        "pull.a",
        "subject is the stored subject"
    );
    assert_eq!(text(&d1), "first");
    assert!(d1.headers.is_none(), "no headers added: {:?}", d1.headers);
    assert_eq!(d2.subject.as_str(), "pull.b");
    assert_eq!(text(&d2), "second");
    assert_eq!(header(&d2, "X-Trace").as_deref(), Some("t-2"));

    let m1 = meta(&js, &d1);
    let m2 = meta(&js, &d2);
    assert_eq!(
        (
            m1.stream.as_str(),
            m1.consumer.as_str(),
            m1.delivered,
            m1.sseq,
            m1.cseq,
            m1.pending
        ),
        ("PULL", "worker", 1, 1, 1, 2)
    );
    assert_eq!(
        (
            m2.stream.as_str(),
            m2.consumer.as_str(),
            m2.delivered,
            m2.sseq,
            m2.cseq,
            m2.pending
        ),
        ("PULL", "worker", 1, 2, 2, 1)
    );
    // The timestamp token is the stored message's timestamp.
    let stream = js.get_stream("PULL").await.expect("get stream");
    for (d, seq) in [(&d1, 1), (&d2, 2)] {
        let stored = stream.get_raw_message(seq).await.expect("get message");
        let jm = jetstream::Message {
            message: d.clone(),
            context: js.clone(),
        };
        let info = jm.info().expect("info");
        assert_eq!(info.published, stored.time, "timestamp token of seq {seq}");
        assert_eq!(
            meta(&js, d).ts,
            stored.time.unix_timestamp_nanos().to_string()
        );
    }

    // Through async-nats fetch.
    let consumer: PullConsumer = stream.get_consumer("worker").await.expect("get consumer");
    let mut batch = consumer
        .fetch()
        .max_messages(5)
        .messages()
        .await
        .expect("fetch");
    let m = within("fetch message", batch.next())
        .await
        .expect("one message")
        .expect("message ok");
    let info = m.info().expect("info");
    assert_eq!(
        (info.stream_sequence, info.consumer_sequence, info.pending),
        (3, 3, 0)
    );
    assert_eq!(text(&m.message), "third");
    assert!(
        within("fetch end", batch.next()).await.is_none(),
        "fetch ends on 404"
    );
}

#[tokio::test]
async fn pull_no_wait_gets_404() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "only").await;
    create_consumer(&client, "S", "c", json!({})).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":5,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    assert_eq!(text(&d), "only");
    let m = status_msg(&mut sub, 404).await;
    assert_eq!(m.description.as_deref(), Some("No Messages"));
    assert!(m.reply.is_none());
    assert!(
        m.subject.as_str().starts_with("_INBOX."),
        "status goes to the request inbox, deliveries carry the stored subject ({})",
        d.subject
    );
    quiet(&mut sub, Duration::from_millis(200)).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let m = status_msg(&mut sub, 404).await;
    assert_eq!(m.description.as_deref(), Some("No Messages"));
    quiet(&mut sub, Duration::from_millis(200)).await;
}

#[tokio::test]
async fn pull_expires_gets_408() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    create_consumer(&client, "S", "c", json!({})).await;

    let start = Instant::now();
    let mut sub = pull(&client, "S", "c", r#"{"batch":3,"expires":500000000}"#).await;
    let m = status_msg(&mut sub, 408).await;
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(3),
        "408 after {took:?}"
    );
    assert_eq!(m.description.as_deref(), Some("Request Timeout"));
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("3"));
    assert_eq!(header(&m, "Nats-Pending-Bytes").as_deref(), Some("0"));

    // 1 µs expiry: immediate 408.
    let start = Instant::now();
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":1000}"#).await;
    status_msg(&mut sub, 408).await;
    assert!(start.elapsed() < Duration::from_secs(1));

    // async-nats batch() waits for the server's 408 and then ends.
    let stream = js.get_stream("S").await.expect("get stream");
    let consumer: PullConsumer = stream.get_consumer("c").await.expect("get consumer");
    let start = Instant::now();
    let mut batch = consumer
        .batch()
        .max_messages(2)
        .expires(Duration::from_millis(600))
        .messages()
        .await
        .expect("batch");
    assert!(within("batch end", batch.next()).await.is_none());
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "batch ended after {took:?}"
    );
    // A message published while a request waits is delivered to it.
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":3000000000}"#).await;
    quiet(&mut sub, Duration::from_millis(200)).await;
    publish(&client, "s.a", "late arrival").await;
    let d = delivery(&mut sub).await;
    assert_eq!(text(&d), "late arrival");
    quiet(&mut sub, Duration::from_millis(200)).await;
}

#[tokio::test]
async fn pull_request_body_forms() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    create_consumer(&client, "S", "c", json!({})).await;

    // Empty body: batch 1, no expiry, waits for a message.
    let mut sub = pull(&client, "S", "c", "").await;
    quiet(&mut sub, Duration::from_millis(300)).await;
    publish(&client, "s.a", "late").await;
    let d = delivery(&mut sub).await;
    assert_eq!(text(&d), "late");
    quiet(&mut sub, Duration::from_millis(200)).await;

    // A bare number is the batch size.
    publish(&client, "s.a", "n1").await;
    publish(&client, "s.a", "n2").await;
    publish(&client, "s.a", "n3").await;
    let mut sub = pull(&client, "S", "c", "2").await;
    let a = delivery(&mut sub).await;
    let b = delivery(&mut sub).await;
    assert_eq!((text(&a).as_str(), text(&b).as_str()), ("n1", "n2"));
    quiet(&mut sub, Duration::from_millis(200)).await;

    // No reply subject: nothing happens (n3 stays available).
    client
        .publish(
            format!("{API}.CONSUMER.MSG.NEXT.S.c"),
            Bytes::from_static(br#"{"batch":1,"no_wait":true}"#),
        )
        .await
        .unwrap();
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    assert_eq!(text(&d), "n3");
    assert_eq!(meta(&js, &d).sseq, 4);
}

#[tokio::test]
async fn pull_max_bytes() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    let payload = "x".repeat(40);
    for _ in 0..3 {
        publish(&client, "s.a", &payload).await;
    }
    create_consumer(&client, "S", "c", json!({})).await;

    // Budget for one message: the next one does not fit -> 409 with what is
    // left of the request. A message counts subject + reply + headers + payload.
    let mut sub = pull(
        &client,
        "S",
        "c",
        r#"{"batch":5,"max_bytes":100,"expires":1000000000}"#,
    )
    .await;
    let d = delivery(&mut sub).await;
    let used = d.subject.len() + d.reply.as_ref().unwrap().len() + d.payload.len();
    let m = status_msg(&mut sub, 409).await;
    assert_eq!(
        m.description.as_deref(),
        Some("Message Size Exceeds MaxBytes")
    );
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("4"));
    assert_eq!(
        header(&m, "Nats-Pending-Bytes"),
        Some((100 - used).to_string())
    );
    quiet(&mut sub, Duration::from_millis(200)).await;

    // A budget smaller than the first message: 409 straight away.
    let mut sub = pull(
        &client,
        "S",
        "c",
        r#"{"batch":1,"max_bytes":50,"expires":1000000000}"#,
    )
    .await;
    let m = status_msg(&mut sub, 409).await;
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("1"));
    assert_eq!(header(&m, "Nats-Pending-Bytes").as_deref(), Some("50"));

    // Enough for the remaining two; no_wait then ends with 404.
    let mut sub = pull(
        &client,
        "S",
        "c",
        r#"{"batch":5,"max_bytes":1000,"no_wait":true}"#,
    )
    .await;
    delivery(&mut sub).await;
    delivery(&mut sub).await;
    status_msg(&mut sub, 404).await;
}

#[tokio::test]
async fn pull_consumer_limits_and_push_consumer_pull() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "LIM", &["lim.>"], json!({})).await;
    create_consumer(
        &client,
        "LIM",
        "small",
        json!({"max_waiting": 1, "max_batch": 2, "max_expires": SEC, "max_bytes": 100}),
    )
    .await;
    create_consumer(
        &client,
        "LIM",
        "pushy",
        json!({"deliver_subject": "dlv.pushy"}),
    )
    .await;

    let cases = [
        (
            r#"{"batch":5,"expires":500000000}"#,
            "Exceeded MaxRequestBatch of 2",
        ),
        (
            r#"{"batch":1,"expires":5000000000}"#,
            "Exceeded MaxRequestExpires of 1s",
        ),
        (
            r#"{"batch":1,"expires":500000000,"max_bytes":1000}"#,
            "Exceeded MaxRequestMaxBytes of 100",
        ),
    ];
    for (body, description) in cases {
        let mut sub = pull(&client, "LIM", "small", body).await;
        let m = status_msg(&mut sub, 409).await;
        assert_eq!(m.description.as_deref(), Some(description), "{body}");
        assert!(header(&m, "Nats-Pending-Messages").is_none());
        quiet(&mut sub, Duration::from_millis(100)).await;
    }

    // max_waiting 1: the second waiting request is refused, the first times out.
    let mut first = pull(
        &client,
        "LIM",
        "small",
        r#"{"batch":1,"expires":900000000}"#,
    )
    .await;
    let mut second = pull(
        &client,
        "LIM",
        "small",
        r#"{"batch":1,"expires":900000000}"#,
    )
    .await;
    let m = status_msg(&mut second, 409).await;
    assert_eq!(m.description.as_deref(), Some("Exceeded MaxWaiting"));
    let m = status_msg(&mut first, 408).await;
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("1"));

    // MSG.NEXT on a push consumer.
    let mut sub = pull(&client, "LIM", "pushy", r#"{"batch":1,"no_wait":true}"#).await;
    let m = status_msg(&mut sub, 409).await;
    assert_eq!(m.description.as_deref(), Some("Consumer is push based"));

    // A consumer that does not exist: no responders.
    let mut sub = pull(&client, "LIM", "ghost", r#"{"batch":1,"no_wait":true}"#).await;
    let m = status_msg(&mut sub, 503).await;
    assert_eq!(
        header(&m, "Nats-Subject").as_deref(),
        Some("$JS.API.CONSUMER.MSG.NEXT.LIM.ghost")
    );
}

#[tokio::test]
async fn pull_idle_heartbeat() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "one").await;
    create_consumer(&client, "S", "c", json!({})).await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    delivery(&mut sub).await;

    let start = Instant::now();
    let mut sub = pull(
        &client,
        "S",
        "c",
        r#"{"batch":1,"expires":1300000000,"idle_heartbeat":500000000}"#,
    )
    .await;
    let hb = status_msg(&mut sub, 100).await;
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(350) && took < Duration::from_millis(1200),
        "first heartbeat after {took:?}"
    );
    assert_eq!(hb.description.as_deref(), Some("Idle Heartbeat"));
    assert!(hb.reply.is_none());
    assert_eq!(header(&hb, "Nats-Last-Consumer").as_deref(), Some("1"));
    assert_eq!(header(&hb, "Nats-Last-Stream").as_deref(), Some("1"));
    status_msg(&mut sub, 100).await;
    let m = status_msg(&mut sub, 408).await;
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("1"));
}

// ---------------------------------------------------------------------------
// acks
// ---------------------------------------------------------------------------

#[tokio::test]
async fn ack_plain_empty_and_double_ack() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=4 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    create_consumer(&client, "S", "c", json!({})).await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":4,"no_wait":true}"#).await;
    let d: Vec<Message> = vec![
        delivery(&mut sub).await,
        delivery(&mut sub).await,
        delivery(&mut sub).await,
        delivery(&mut sub).await,
    ];

    // "+ACK" without reply subject.
    ack_plain(&client, &d[0], "+ACK").await;
    // Empty payload = ack (what nats-py sends).
    ack_plain(&client, &d[1], "").await;
    wait_state(
        &client,
        "S",
        "c",
        State {
            delivered: (4, 4),
            ack_floor: (2, 2),
            ack_pending: 2,
            redelivered: 0,
            waiting: 0,
            pending: 0,
        },
    )
    .await;

    // AckSync: the server answers with an empty message, also when repeated,
    // and also to a NAK of an already acked message.
    ack_sync(&client, &d[2], "+ACK").await;
    ack_sync(&client, &d[2], "+ACK").await;
    ack_sync(&client, &d[2], "-NAK").await;
    // async-nats double_ack.
    let jm = jetstream::Message {
        message: d[3].clone(),
        context: js.clone(),
    };
    within("double ack", jm.double_ack())
        .await
        .expect("double ack answered");
    assert_eq!(
        state(&client, "S", "c").await,
        State {
            delivered: (4, 4),
            ack_floor: (4, 4),
            ack_pending: 0,
            redelivered: 0,
            waiting: 0,
            pending: 0,
        }
    );
    // Nothing is redelivered.
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    status_msg(&mut sub, 404).await;
}

#[tokio::test]
async fn nak_redelivers_at_once() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "one").await;
    publish(&client, "s.a", "two").await;
    create_consumer(&client, "S", "c", json!({})).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let first = delivery(&mut sub).await;
    let m1 = meta(&js, &first);
    assert_eq!((m1.delivered, m1.sseq, m1.cseq, m1.pending), (1, 1, 1, 1));
    // With a reply (AckSync) so the NAK is processed before the next pull.
    ack_sync(&client, &first, "-NAK").await;

    // The NAKed message comes before the next new one.
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":2000000000}"#).await;
    let again = delivery(&mut sub).await;
    let m2 = meta(&js, &again);
    assert_eq!(text(&again), "one");
    assert_eq!((m2.delivered, m2.sseq, m2.cseq), (2, 1, 2));
    assert_eq!(m2.ts, m1.ts, "timestamp token unchanged on redelivery");
    assert_eq!(m2.pending, 1);
    let info = state(&client, "S", "c").await;
    assert_eq!(info.redelivered, 1);
    assert_eq!(info.ack_pending, 1);
    assert_eq!(info.delivered, (2, 1));
    ack_sync(&client, &again, "+ACK").await;

    // async-nats AckKind::Nak
    let stream = js.get_stream("S").await.unwrap();
    let consumer: PullConsumer = stream.get_consumer("c").await.unwrap();
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let m = within("fetch", batch.next()).await.unwrap().unwrap();
    assert_eq!(m.info().unwrap().stream_sequence, 2);
    m.ack_with(AckKind::Nak(None)).await.unwrap();
    let mut batch = consumer
        .batch()
        .max_messages(1)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .unwrap();
    let m = within("fetch redelivery", batch.next())
        .await
        .unwrap()
        .unwrap();
    let info = m.info().unwrap();
    assert_eq!((info.stream_sequence, info.delivered), (2, 2));
}

#[tokio::test]
async fn nak_with_delay() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "delay-1").await;
    create_consumer(&client, "S", "c", json!({})).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    // async-nats sends `-NAK {"delay":<ns>}`; nats-py sends `{"delay": <ns>}`.
    let jm = jetstream::Message {
        message: d.clone(),
        context: js.clone(),
    };
    let naked = Instant::now();
    jm.ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
        .await
        .unwrap();
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":3000000000}"#).await;
    let again = delivery(&mut sub).await;
    let took = naked.elapsed();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_millis(2500),
        "redelivered {took:?} after the NAK"
    );
    assert_eq!(meta(&js, &again).delivered, 2);
    ack_sync(&client, &again, "+ACK").await;

    // The nats-py spelling (space after the colon) works the same.
    publish(&client, "s.a", "delay-2").await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    let naked = Instant::now();
    ack_plain(&client, &d, r#"-NAK {"delay": 1000000000}"#).await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":3000000000}"#).await;
    let again = delivery(&mut sub).await;
    let took = naked.elapsed();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_millis(2500),
        "redelivered {took:?} after the NAK"
    );
    assert_eq!(text(&again), "delay-2");
}

#[tokio::test]
async fn in_progress_extends_ack_wait() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "wpi").await;
    create_consumer(&client, "S", "c", json!({"ack_wait": SEC})).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let jm = jetstream::Message {
        message: d.clone(),
        context: js.clone(),
    };
    jm.ack_with(AckKind::Progress).await.unwrap();
    within("flush", client.flush()).await.unwrap();
    let wpi = Instant::now();
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":3000000000}"#).await;
    let again = delivery(&mut sub).await;
    let took = wpi.elapsed();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_millis(2500),
        "redelivered {took:?} after +WPI (ack_wait 1 s restarted by it)"
    );
    assert_eq!(meta(&js, &again).delivered, 2);

    // +WPI with a reply subject is answered like any ack (AckSync).
    ack_sync(&client, &again, "+WPI").await;
    ack_sync(&client, &again, "+ACK").await;
}

#[tokio::test]
async fn term_stops_redelivery() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "t1").await;
    publish(&client, "s.a", "t2").await;
    create_consumer(&client, "S", "c", json!({"ack_wait": SEC})).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":2,"no_wait":true}"#).await;
    let d1 = delivery(&mut sub).await;
    let d2 = delivery(&mut sub).await;
    ack_sync(&client, &d1, "+TERM").await;
    let jm = jetstream::Message {
        message: d2.clone(),
        context: js.clone(),
    };
    jm.ack_with(AckKind::Term).await.unwrap();
    within("flush", client.flush()).await.unwrap();
    wait_state(
        &client,
        "S",
        "c",
        State {
            delivered: (2, 2),
            ack_floor: (2, 2),
            ack_pending: 0,
            redelivered: 0,
            waiting: 0,
            pending: 0,
        },
    )
    .await;
    // Well past ack_wait: nothing is redelivered.
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":1600000000}"#).await;
    status_msg(&mut sub, 408).await;

    // "+TERM <reason>" is a term too.
    publish(&client, "s.a", "t3").await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let d3 = delivery(&mut sub).await;
    ack_sync(&client, &d3, "+TERM no longer wanted").await;
    assert_eq!(state(&client, "S", "c").await.ack_pending, 0);
}

#[tokio::test]
async fn ack_wait_redelivery() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "slow").await;
    create_consumer(&client, "S", "c", json!({"ack_wait": SEC})).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let first = delivery(&mut sub).await;
    let delivered_at = Instant::now();
    let m1 = meta(&js, &first);
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":3000000000}"#).await;
    let again = delivery(&mut sub).await;
    let took = delivered_at.elapsed();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_millis(2500),
        "redelivered {took:?} after the first delivery (ack_wait 1 s)"
    );
    let m2 = meta(&js, &again);
    assert_eq!((m2.delivered, m2.sseq, m2.cseq), (2, 1, 2));
    assert_eq!(m2.ts, m1.ts);
    let st = state(&client, "S", "c").await;
    assert_eq!(st.redelivered, 1);
    assert_eq!(st.ack_pending, 1);
    ack_sync(&client, &again, "+ACK").await;
    assert_eq!(state(&client, "S", "c").await.ack_floor, (2, 1));
}

#[tokio::test]
async fn max_deliver_stops_redelivery() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "poison").await;
    create_consumer(
        &client,
        "S",
        "c",
        json!({"ack_wait": SEC, "max_deliver": 2}),
    )
    .await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let first = delivery(&mut sub).await;
    assert_eq!(meta(&js, &first).delivered, 1);
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":3000000000}"#).await;
    let second = delivery(&mut sub).await;
    assert_eq!(meta(&js, &second).delivered, 2);
    // No third delivery: the waiting request expires.
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":1800000000}"#).await;
    status_msg(&mut sub, 408).await;
    let st = state(&client, "S", "c").await;
    assert_eq!(st.ack_pending, 0, "{st:?}");
    assert_eq!(st.redelivered, 1, "{st:?}");
    assert_eq!(st.delivered, (2, 1), "{st:?}");
}

#[tokio::test]
async fn max_ack_pending_limits_outstanding() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=5 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    create_consumer(&client, "S", "c", json!({"max_ack_pending": 2})).await;

    let mut sub = pull(&client, "S", "c", r#"{"batch":5,"expires":800000000}"#).await;
    let d1 = delivery(&mut sub).await;
    let _d2 = delivery(&mut sub).await;
    let m = status_msg(&mut sub, 408).await;
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("3"));
    let st = state(&client, "S", "c").await;
    assert_eq!((st.ack_pending, st.pending, st.delivered), (2, 3, (2, 2)));

    // no_wait while at the limit: no delivery, no status; the request is
    // kept waiting (pinned) ...
    let mut queued = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    quiet(&mut queued, Duration::from_millis(300)).await;
    assert_eq!(state(&client, "S", "c").await.waiting, 1);

    // ... and served as soon as an ack frees a slot.
    ack_sync(&client, &d1, "+ACK").await;
    let d3 = delivery(&mut queued).await;
    assert_eq!(text(&d3), "m3");
    quiet(&mut queued, Duration::from_millis(200)).await;
    let st = state(&client, "S", "c").await;
    assert_eq!((st.ack_pending, st.waiting, st.pending), (2, 0, 2));

    ack_sync(&client, &d3, "+ACK").await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":5,"expires":600000000}"#).await;
    let d4 = delivery(&mut sub).await;
    assert_eq!(text(&d4), "m4");
    let m = status_msg(&mut sub, 408).await;
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("4"));
}

#[tokio::test]
async fn ack_policy_all() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=3 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    create_consumer(&client, "S", "c", json!({"ack_policy": "all"})).await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":3,"no_wait":true}"#).await;
    let _d1 = delivery(&mut sub).await;
    let d2 = delivery(&mut sub).await;
    let _d3 = delivery(&mut sub).await;
    assert_eq!(meta(&js, &d2).cseq, 2);
    ack_sync(&client, &d2, "+ACK").await;
    assert_eq!(
        state(&client, "S", "c").await,
        State {
            delivered: (3, 3),
            ack_floor: (2, 2),
            ack_pending: 1,
            redelivered: 0,
            waiting: 0,
            pending: 0,
        }
    );
}

#[tokio::test]
async fn ack_policy_none() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=3 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    let r = create_consumer(&client, "S", "c", json!({"ack_policy": "none"})).await;
    assert!(r["config"].get("ack_wait").is_none(), "{r}");
    assert!(r["config"].get("max_ack_pending").is_none(), "{r}");
    let mut sub = pull(&client, "S", "c", r#"{"batch":2,"no_wait":true}"#).await;
    let d1 = delivery(&mut sub).await;
    let m1 = meta(&js, &d1);
    assert_eq!((m1.consumer.as_str(), m1.sseq, m1.pending), ("c", 1, 2));
    delivery(&mut sub).await;
    assert_eq!(
        state(&client, "S", "c").await,
        State {
            delivered: (2, 2),
            ack_floor: (2, 2),
            ack_pending: 0,
            redelivered: 0,
            waiting: 0,
            pending: 1,
        }
    );
    // Nobody listens for acks of an ack-none consumer: no responders.
    let nr = with_reply(&client, d1.reply.as_ref().unwrap().as_str(), "+ACK", STEP)
        .await
        .expect("a reply");
    assert_eq!(status(&nr), Some(503));
    let mut sub = pull(&client, "S", "c", r#"{"batch":5,"no_wait":true}"#).await;
    assert_eq!(text(&delivery(&mut sub).await), "m3");
    status_msg(&mut sub, 404).await;
}

#[tokio::test]
async fn ack_next_delivers_to_reply() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=3 {
        publish(&client, "s.a", &format!("nxt-{i}")).await;
    }
    create_consumer(&client, "S", "c", json!({})).await;
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"no_wait":true}"#).await;
    let d1 = delivery(&mut sub).await;

    // +NXT with a reply: acks and delivers the next message to the reply.
    let inbox = client.new_inbox();
    let mut next = client.subscribe(inbox.clone()).await.unwrap();
    client
        .publish_with_reply(
            d1.reply.clone().unwrap().to_string(),
            inbox.clone(),
            Bytes::from_static(b"+NXT"),
        )
        .await
        .unwrap();
    let d2 = delivery(&mut next).await;
    assert_eq!(text(&d2), "nxt-2");
    // +NXT with a pull request body.
    client
        .publish_with_reply(
            d2.reply.clone().unwrap().to_string(),
            inbox,
            Bytes::from_static(br#"+NXT {"batch":2,"no_wait":true}"#),
        )
        .await
        .unwrap();
    let d3 = delivery(&mut next).await;
    assert_eq!(text(&d3), "nxt-3");
    status_msg(&mut next, 404).await;
    let st = state(&client, "S", "c").await;
    assert_eq!(st.ack_floor, (2, 2));
    assert_eq!(meta(&js, &d3).sseq, 3);
}

// ---------------------------------------------------------------------------
// deliver policies, filters, headers_only
// ---------------------------------------------------------------------------

/// Stream S (`s.>`): s.a "a1", s.b "b1", s.a "a2", s.c "c1", s.b "b2".
async fn policy_stream() -> (Server, Client, Context) {
    let (s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for (subject, payload) in [
        ("s.a", "a1"),
        ("s.b", "b1"),
        ("s.a", "a2"),
        ("s.c", "c1"),
        ("s.b", "b2"),
    ] {
        publish(&client, subject, payload).await;
    }
    (s, client, js)
}

/// Drains a consumer with one no_wait request: payloads and stream seqs.
async fn drain(client: &Client, js: &Context, consumer: &str) -> Vec<(String, u64)> {
    let mut sub = pull(client, "S", consumer, r#"{"batch":50,"no_wait":true}"#).await;
    let mut out = Vec::new();
    loop {
        let m = next_msg(&mut sub).await;
        if status(&m) == Some(404) {
            return out;
        }
        assert!(
            is_delivery(&m),
            "unexpected {:?} {:?}",
            m.status,
            m.description
        );
        out.push((text(&m), meta(js, &m).sseq));
    }
}

fn owned(v: &[(&str, u64)]) -> Vec<(String, u64)> {
    v.iter().map(|(p, s)| (p.to_string(), *s)).collect()
}

#[tokio::test]
async fn deliver_policy_all() {
    let (_s, client, js) = policy_stream().await;
    let r = create_consumer(&client, "S", "c", json!({"deliver_policy": "all"})).await;
    assert_eq!(r["num_pending"], 5);
    assert_eq!(
        drain(&client, &js, "c").await,
        owned(&[("a1", 1), ("b1", 2), ("a2", 3), ("c1", 4), ("b2", 5)])
    );
}

#[tokio::test]
async fn deliver_policy_last() {
    let (_s, client, js) = policy_stream().await;
    let r = create_consumer(&client, "S", "c", json!({"deliver_policy": "last"})).await;
    assert_eq!(r["num_pending"], 1);
    assert_eq!(r["delivered"]["stream_seq"], 4);
    assert_eq!(drain(&client, &js, "c").await, owned(&[("b2", 5)]));
    let st = state(&client, "S", "c").await;
    assert_eq!((st.delivered, st.ack_floor), ((1, 5), (0, 4)));

    // With a filter: the last message on the filtered subject.
    create_consumer(
        &client,
        "S",
        "ca",
        json!({"deliver_policy": "last", "filter_subject": "s.a"}),
    )
    .await;
    assert_eq!(drain(&client, &js, "ca").await, owned(&[("a2", 3)]));
    publish(&client, "s.a", "a3").await;
    wait_pending(&client, "S", "ca", 1).await;
    assert_eq!(drain(&client, &js, "ca").await, owned(&[("a3", 6)]));
}

#[tokio::test]
async fn deliver_policy_new() {
    let (_s, client, js) = policy_stream().await;
    let r = create_consumer(&client, "S", "c", json!({"deliver_policy": "new"})).await;
    assert_eq!(r["num_pending"], 0);
    assert_eq!(r["delivered"], json!({"consumer_seq": 0, "stream_seq": 5}));
    assert_eq!(r["ack_floor"], json!({"consumer_seq": 0, "stream_seq": 5}));
    assert_eq!(drain(&client, &js, "c").await, owned(&[]));
    publish(&client, "s.c", "c2").await;
    wait_pending(&client, "S", "c", 1).await;
    assert_eq!(drain(&client, &js, "c").await, owned(&[("c2", 6)]));
}

#[tokio::test]
async fn deliver_policy_by_start_sequence() {
    let (_s, client, js) = policy_stream().await;
    let r = create_consumer(
        &client,
        "S",
        "c",
        json!({"deliver_policy": "by_start_sequence", "opt_start_seq": 4}),
    )
    .await;
    assert_eq!(r["config"]["opt_start_seq"], 4);
    assert_eq!(r["num_pending"], 2);
    assert_eq!(r["delivered"]["stream_seq"], 3);
    assert_eq!(
        drain(&client, &js, "c").await,
        owned(&[("c1", 4), ("b2", 5)])
    );

    // A start beyond the end waits for that sequence.
    let r = create_consumer(
        &client,
        "S",
        "far",
        json!({"deliver_policy": "by_start_sequence", "opt_start_seq": 7}),
    )
    .await;
    assert_eq!(r["num_pending"], 0);
    assert_eq!(r["delivered"]["stream_seq"], 6);
    publish(&client, "s.a", "six").await;
    publish(&client, "s.a", "seven").await;
    wait_pending(&client, "S", "far", 1).await;
    assert_eq!(drain(&client, &js, "far").await, owned(&[("seven", 7)]));
}

#[tokio::test]
async fn deliver_policy_by_start_time() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=3 {
        publish(&client, "s.a", &format!("t{i}")).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let got = api_ok(
        &client,
        &format!("{API}.STREAM.MSG.GET.S"),
        json!({"seq": 2}),
    )
    .await;
    let start = got["message"]["time"].as_str().expect("time").to_string();

    let r = create_consumer(
        &client,
        "S",
        "c",
        json!({"deliver_policy": "by_start_time", "opt_start_time": start}),
    )
    .await;
    assert_eq!(r["config"]["deliver_policy"], "by_start_time");
    assert_eq!(r["config"]["opt_start_time"], start.as_str());
    assert_eq!(r["num_pending"], 2);
    assert_eq!(
        drain(&client, &js, "c").await,
        owned(&[("t2", 2), ("t3", 3)])
    );

    // A start time after every message: nothing until something new arrives.
    let r = create_consumer(
        &client,
        "S",
        "future",
        json!({"deliver_policy": "by_start_time", "opt_start_time": "2099-01-01T00:00:00Z"}),
    )
    .await;
    assert_eq!(r["num_pending"], 0);
    assert_eq!(drain(&client, &js, "future").await, owned(&[]));
}

#[tokio::test]
async fn deliver_policy_last_per_subject() {
    let (_s, client, js) = policy_stream().await;
    let r = create_consumer(
        &client,
        "S",
        "c",
        json!({"deliver_policy": "last_per_subject", "filter_subject": "s.>"}),
    )
    .await;
    assert_eq!(r["num_pending"], 3);
    // In stream order: a2 (3), c1 (4), b2 (5).
    assert_eq!(
        drain(&client, &js, "c").await,
        owned(&[("a2", 3), ("c1", 4), ("b2", 5)])
    );
    publish(&client, "s.a", "a3").await;
    wait_pending(&client, "S", "c", 1).await;
    assert_eq!(drain(&client, &js, "c").await, owned(&[("a3", 6)]));

    // With filter_subjects.
    create_consumer(
        &client,
        "S",
        "two",
        json!({"deliver_policy": "last_per_subject", "filter_subjects": ["s.a", "s.b"]}),
    )
    .await;
    assert_eq!(
        drain(&client, &js, "two").await,
        owned(&[("b2", 5), ("a3", 6)])
    );
}

#[tokio::test]
async fn filter_subject_and_filter_subjects() {
    let (_s, client, js) = policy_stream().await;
    let r = create_consumer(&client, "S", "fb", json!({"filter_subject": "s.b"})).await;
    assert_eq!(r["num_pending"], 2);
    let mut sub = pull(&client, "S", "fb", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    let m = meta(&js, &d);
    assert_eq!(
        (m.sseq, m.cseq, m.pending),
        (2, 1, 1),
        "pending counts only s.b"
    );
    assert_eq!(drain(&client, &js, "fb").await, owned(&[("b2", 5)]));

    let r = create_consumer(
        &client,
        "S",
        "fac",
        json!({"filter_subjects": ["s.a", "s.c"]}),
    )
    .await;
    assert_eq!(r["config"]["filter_subjects"], json!(["s.a", "s.c"]));
    assert_eq!(r["num_pending"], 3);
    assert_eq!(
        drain(&client, &js, "fac").await,
        owned(&[("a1", 1), ("a2", 3), ("c1", 4)])
    );

    // Wildcard filter; new messages on other subjects are skipped.
    create_consumer(&client, "S", "wild", json!({"filter_subject": "s.*"})).await;
    assert_eq!(drain(&client, &js, "wild").await.len(), 5);
    create_stream(&client, "T", &["t.>"], json!({})).await;
    publish(&client, "s.d", "d1").await;
    wait_pending(&client, "S", "wild", 1).await;
    assert_eq!(drain(&client, &js, "fac").await, owned(&[]));
    assert_eq!(drain(&client, &js, "wild").await, owned(&[("d1", 6)]));

    // A filter that matches none of the stream's subjects is accepted.
    let r = create_consumer(&client, "S", "none", json!({"filter_subject": "zzz.>"})).await;
    assert_eq!(r["num_pending"], 0);
}

#[tokio::test]
async fn headers_only_delivery() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "one").await;
    publish_with_headers(&client, "s.b", &[("X-App", "y")], "three").await;
    create_consumer(&client, "S", "ho", json!({"headers_only": true})).await;
    let mut sub = pull(&client, "S", "ho", r#"{"batch":2,"no_wait":true}"#).await;
    let d1 = delivery(&mut sub).await;
    assert!(d1.payload.is_empty());
    assert_eq!(header(&d1, "Nats-Msg-Size").as_deref(), Some("3"));
    let d2 = delivery(&mut sub).await;
    assert!(d2.payload.is_empty());
    assert_eq!(header(&d2, "X-App").as_deref(), Some("y"));
    assert_eq!(header(&d2, "Nats-Msg-Size").as_deref(), Some("5"));
}

// ---------------------------------------------------------------------------
// push consumers
// ---------------------------------------------------------------------------

#[tokio::test]
async fn push_deliver_subject() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "PUSH", &["push.>"], json!({})).await;
    publish(&client, "push.a", "one").await;
    publish_with_headers(&client, "push.b", &[("X-App", "y")], "two").await;
    // Created before anyone listens: nothing is lost.
    create_consumer(
        &client,
        "PUSH",
        "p",
        json!({"deliver_subject": "deliver.p"}),
    )
    .await;
    let info = consumer_info(&client, "PUSH", "p").await;
    assert!(info.get("push_bound").is_none(), "{info}");
    assert_eq!(state_of(&info).pending, 2);

    let mut sub = client.subscribe("deliver.p").await.unwrap();
    let d1 = delivery(&mut sub).await;
    let d2 = delivery(&mut sub).await;
    assert_eq!((d1.subject.as_str(), text(&d1).as_str()), ("push.a", "one"));
    assert_eq!((d2.subject.as_str(), text(&d2).as_str()), ("push.b", "two"));
    assert_eq!(header(&d2, "X-App").as_deref(), Some("y"));
    let m = meta(&js, &d2);
    assert_eq!(
        (m.consumer.as_str(), m.sseq, m.cseq, m.pending),
        ("p", 2, 2, 0)
    );
    let info = consumer_info(&client, "PUSH", "p").await;
    assert_eq!(info["push_bound"], true, "{info}");

    // Live messages follow.
    publish(&client, "push.a", "three").await;
    let d3 = delivery(&mut sub).await;
    assert_eq!(text(&d3), "three");
    for d in [&d1, &d2, &d3] {
        ack_sync(&client, d, "+ACK").await;
    }
    let st = state(&client, "PUSH", "p").await;
    assert_eq!((st.ack_floor, st.ack_pending), ((3, 3), 0));

    // async-nats push consumer.
    let stream = js.get_stream("PUSH").await.unwrap();
    let pc: jetstream::consumer::PushConsumer = stream
        .create_consumer(push::Config {
            durable_name: Some("p2".into()),
            deliver_subject: client.new_inbox(),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = pc.messages().await.unwrap();
    for want in ["one", "two", "three"] {
        let m = within("push message", messages.next())
            .await
            .expect("message")
            .expect("message ok");
        assert_eq!(text(&m.message), want);
        m.ack().await.unwrap();
    }
}

#[tokio::test]
async fn push_deliver_group() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    let mut q1 = client
        .queue_subscribe("deliver.q", "grp".into())
        .await
        .unwrap();
    let mut q2 = client
        .queue_subscribe("deliver.q", "grp".into())
        .await
        .unwrap();
    common::sync(&client).await;
    let r = create_consumer(
        &client,
        "S",
        "q",
        json!({"deliver_subject": "deliver.q", "deliver_group": "grp"}),
    )
    .await;
    assert_eq!(r["config"]["deliver_group"], "grp");
    for i in 1..=20 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    let mut seen = Vec::new();
    let deadline = Instant::now() + STEP;
    while seen.len() < 20 && Instant::now() < deadline {
        tokio::select! {
            Some(m) = q1.next() => seen.push(meta(&js, &m).sseq),
            Some(m) = q2.next() => seen.push(meta(&js, &m).sseq),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (1..=20).collect::<Vec<u64>>(), "each message once");
    assert_eq!(consumer_info(&client, "S", "q").await["push_bound"], true);
}

#[tokio::test]
async fn push_idle_heartbeat() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "one").await;
    publish(&client, "s.a", "two").await;
    let mut sub = client.subscribe("deliver.hb").await.unwrap();
    common::sync(&client).await;
    create_consumer(
        &client,
        "S",
        "hb",
        json!({"deliver_subject": "deliver.hb", "idle_heartbeat": 500_000_000u64, "ack_policy": "none"}),
    )
    .await;
    delivery(&mut sub).await;
    delivery(&mut sub).await;
    let start = Instant::now();
    let hb = status_msg(&mut sub, 100).await;
    assert!(
        start.elapsed() < Duration::from_millis(1500),
        "heartbeat after {:?}",
        start.elapsed()
    );
    assert_eq!(hb.subject.as_str(), "deliver.hb");
    assert_eq!(hb.description.as_deref(), Some("Idle Heartbeat"));
    assert!(hb.reply.is_none(), "heartbeats have no reply subject");
    assert_eq!(header(&hb, "Nats-Last-Consumer").as_deref(), Some("2"));
    assert_eq!(header(&hb, "Nats-Last-Stream").as_deref(), Some("2"));
    // They keep coming while idle.
    status_msg(&mut sub, 100).await;
}

#[tokio::test]
async fn push_flow_control() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "FC", &["fc.>"], json!({})).await;
    let big = "x".repeat(8 * 1024);
    for _ in 0..300 {
        client
            .publish("fc.data", Bytes::from(big.clone()))
            .await
            .unwrap();
    }
    // Make sure everything is stored before the consumer starts.
    publish(&client, "fc.end", "end").await;
    let mut sub = client.subscribe("deliver.fc").await.unwrap();
    common::sync(&client).await;
    create_consumer(
        &client,
        "FC",
        "fc",
        json!({"deliver_subject": "deliver.fc", "flow_control": true, "idle_heartbeat": SEC, "ack_policy": "none"}),
    )
    .await;
    let mut data = 0;
    let mut fc_requests = 0;
    let deadline = Instant::now() + Duration::from_secs(15);
    while data < 301 {
        assert!(
            Instant::now() < deadline,
            "only {data} of 301 messages arrived"
        );
        let m = next_msg(&mut sub).await;
        if is_delivery(&m) {
            data += 1;
        } else if status(&m) == Some(100) && m.reply.is_some() {
            assert_eq!(m.description.as_deref(), Some("FlowControl Request"));
            let reply = m.reply.clone().unwrap();
            assert!(
                reply.as_str().starts_with("$JS.FC.FC.fc."),
                "flow control subject {reply}"
            );
            fc_requests += 1;
            client.publish(reply, Bytes::new()).await.unwrap();
        }
    }
    assert!(fc_requests >= 1, "no flow control request for 2.4 MB");
}

// ---------------------------------------------------------------------------
// ordered consumers
// ---------------------------------------------------------------------------

async fn hundred(client: &Client) {
    create_stream(client, "S", &["s.>"], json!({})).await;
    for i in 1..=100 {
        client
            .publish(format!("s.{}", i % 3), Bytes::from(format!("m{i}")))
            .await
            .unwrap();
    }
    publish(client, "s.end", "end").await;
}

#[tokio::test]
async fn ordered_pull_consumer_reads_in_order() {
    let (_s, client, js) = js_setup().await;
    hundred(&client).await;
    let stream = js.get_stream("S").await.unwrap();
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: "s.*".into(),
            ..Default::default()
        })
        .await
        .expect("create ordered pull consumer");
    let mut messages = consumer.messages().await.expect("ordered messages");
    for i in 1..=100u64 {
        let m = within("ordered message", messages.next())
            .await
            .expect("stream ended")
            .expect("message ok");
        assert_eq!(text(&m.message), format!("m{i}"));
        let info = m.info().unwrap();
        assert_eq!(info.stream_sequence, i);
        assert_eq!(info.consumer_sequence, i);
    }
}

#[tokio::test]
async fn ordered_push_consumer_reads_in_order() {
    let (_s, client, js) = js_setup().await;
    hundred(&client).await;
    let stream = js.get_stream("S").await.unwrap();
    let consumer = stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            filter_subject: "s.*".into(),
            ..Default::default()
        })
        .await
        .expect("create ordered push consumer");
    let cfg = &consumer.cached_info().config;
    assert_eq!(cfg.ack_policy, AckPolicy::None);
    assert!(cfg.flow_control);
    let mut messages = consumer.messages().await.expect("ordered messages");
    for i in 1..=100u64 {
        let m = within("ordered message", messages.next())
            .await
            .expect("stream ended")
            .expect("message ok");
        assert_eq!(text(&m.message), format!("m{i}"));
        assert_eq!(m.info().unwrap().stream_sequence, i);
    }
}

// ---------------------------------------------------------------------------
// KV (ordered push consumers underneath)
// ---------------------------------------------------------------------------

async fn bucket(js: &Context) -> kv::Store {
    js.create_key_value(kv::Config {
        bucket: "cfg".into(),
        history: 5,
        ..Default::default()
    })
    .await
    .expect("create bucket")
}

/// Next watch entry within `STEP`.
async fn next_entry(watch: &mut kv::Watch) -> kv::Entry {
    within("kv watch entry", watch.next())
        .await
        .expect("watch ended")
        .expect("entry ok")
}

#[tokio::test]
async fn kv_watch() {
    let (_s, _client, js) = js_setup().await;
    let kv = bucket(&js).await;
    kv.put("a.one", "1".into()).await.unwrap();
    kv.put("a.two", "2".into()).await.unwrap();
    kv.put("b.x", "x".into()).await.unwrap();

    // With history: the current value of each matching key first.
    let mut hist = kv
        .watch_with_history("a.*")
        .await
        .expect("watch with history");
    let e1 = next_entry(&mut hist).await;
    let e2 = next_entry(&mut hist).await;
    assert_eq!(
        (e1.key.as_str(), &e1.value[..], e1.revision),
        ("a.one", &b"1"[..], 1)
    );
    assert_eq!(
        (e2.key.as_str(), &e2.value[..], e2.revision),
        ("a.two", &b"2"[..], 2)
    );
    assert!(e2.seen_current, "pending 0 on the last current value");
    // Plain watch: only what happens from now on.
    let mut live = kv.watch("a.*").await.expect("watch");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), live.next())
            .await
            .is_err(),
        "a new-only watch delivers nothing up front"
    );

    kv.put("b.x", "ignored".into()).await.unwrap();
    kv.put("a.one", "11".into()).await.unwrap();
    for w in [&mut hist, &mut live] {
        let e = next_entry(w).await;
        assert_eq!(
            (e.key.as_str(), &e.value[..], e.revision),
            ("a.one", &b"11"[..], 5)
        );
        assert_eq!(e.operation, kv::Operation::Put);
    }
    kv.delete("a.two").await.unwrap();
    for w in [&mut hist, &mut live] {
        let e = next_entry(w).await;
        assert_eq!(
            (e.key.as_str(), e.operation),
            ("a.two", kv::Operation::Delete)
        );
    }
    kv.purge("a.one").await.unwrap();
    for w in [&mut hist, &mut live] {
        let e = next_entry(w).await;
        assert_eq!(
            (e.key.as_str(), e.operation),
            ("a.one", kv::Operation::Purge)
        );
    }

    // From a revision: everything from there on, every key.
    let mut from = kv
        .watch_all_from_revision(3)
        .await
        .expect("watch from revision");
    let mut seen = Vec::new();
    for _ in 0..4 {
        let e = next_entry(&mut from).await;
        seen.push((e.key, e.revision, e.operation));
    }
    assert_eq!(
        seen,
        vec![
            ("b.x".to_string(), 3, kv::Operation::Put),
            ("b.x".to_string(), 4, kv::Operation::Put),
            ("a.two".to_string(), 6, kv::Operation::Delete),
            ("a.one".to_string(), 7, kv::Operation::Purge),
        ]
    );
}

#[tokio::test]
async fn kv_history() {
    let (_s, _client, js) = js_setup().await;
    let kv = bucket(&js).await;
    for v in ["v1", "v2", "v3"] {
        kv.put("k", v.to_string().into()).await.unwrap();
    }
    kv.put("other", "o".into()).await.unwrap();
    kv.delete("k").await.unwrap();
    let history: Vec<kv::Entry> = within(
        "history",
        kv.history("k").await.unwrap().collect::<Vec<_>>(),
    )
    .await
    .into_iter()
    .map(|e| e.expect("entry"))
    .collect();
    let got: Vec<(String, u64, kv::Operation)> = history
        .iter()
        .map(|e| {
            (
                String::from_utf8_lossy(&e.value).into_owned(),
                e.revision,
                e.operation,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("v1".to_string(), 1, kv::Operation::Put),
            ("v2".to_string(), 2, kv::Operation::Put),
            ("v3".to_string(), 3, kv::Operation::Put),
            (String::new(), 5, kv::Operation::Delete),
        ]
    );
}

#[tokio::test]
async fn kv_keys() {
    let (_s, _client, js) = js_setup().await;
    let kv = bucket(&js).await;
    kv.put("app.color", "blue".into()).await.unwrap();
    kv.put("app.size", "L".into()).await.unwrap();
    kv.put("app.color", "red".into()).await.unwrap();
    kv.put("gone", "x".into()).await.unwrap();
    kv.delete("gone").await.unwrap();
    let keys: BTreeSet<String> = within("keys", kv.keys().await.unwrap().collect::<Vec<_>>())
        .await
        .into_iter()
        .map(|k| k.expect("key"))
        .collect();
    assert_eq!(
        keys,
        BTreeSet::from(["app.color".to_string(), "app.size".to_string()])
    );
    assert_eq!(
        kv.get("app.color").await.unwrap().as_deref(),
        Some(&b"red"[..])
    );
}

// ---------------------------------------------------------------------------
// retention
// ---------------------------------------------------------------------------

#[tokio::test]
async fn retention_interest() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "I", &["i.>"], json!({"retention": "interest"})).await;
    // No consumer yet: acknowledged but not kept.
    assert_eq!(publish(&client, "i.a", "nobody").await, 1);
    let st = stream_state(&client, "I").await;
    assert_eq!(
        (st["messages"].as_u64(), st["last_seq"].as_u64()),
        (Some(0), Some(1))
    );

    create_consumer(&client, "I", "c1", json!({})).await;
    create_consumer(&client, "I", "c2", json!({})).await;
    publish(&client, "i.a", "both").await;
    assert_eq!(stream_state(&client, "I").await["messages"], 1);

    let mut sub = pull(&client, "I", "c1", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    ack_sync(&client, &d, "+ACK").await;
    // c2 still has to ack.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(stream_state(&client, "I").await["messages"], 1);
    let mut sub = pull(&client, "I", "c2", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    ack_sync(&client, &d, "+ACK").await;
    let st = wait_messages(&client, "I", 0).await;
    assert_eq!(st["first_seq"], 3);

    // With a single consumer, one ack removes it.
    api_ok(&client, &format!("{API}.CONSUMER.DELETE.I.c2"), Value::Null).await;
    publish(&client, "i.a", "only").await;
    assert_eq!(stream_state(&client, "I").await["messages"], 1);
    let mut sub = pull(&client, "I", "c1", r#"{"batch":1,"no_wait":true}"#).await;
    let d = delivery(&mut sub).await;
    assert_eq!(text(&d), "only");
    ack_plain(&client, &d, "+ACK").await;
    wait_messages(&client, "I", 0).await;
}

#[tokio::test]
async fn retention_workqueue() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "WQ", &["wq.>"], json!({"retention": "workqueue"})).await;
    for i in 1..=3 {
        publish(&client, "wq.job", &format!("job{i}")).await;
    }
    create_consumer(&client, "WQ", "w", json!({})).await;
    let mut sub = pull(&client, "WQ", "w", r#"{"batch":2,"no_wait":true}"#).await;
    let d1 = delivery(&mut sub).await;
    let d2 = delivery(&mut sub).await;
    // Delivered but not acked: still there.
    assert_eq!(stream_state(&client, "WQ").await["messages"], 3);
    ack_sync(&client, &d1, "+ACK").await;
    let st = wait_messages(&client, "WQ", 2).await;
    assert_eq!(st["first_seq"], 2);
    // A NAK keeps it.
    ack_sync(&client, &d2, "-NAK").await;
    assert_eq!(stream_state(&client, "WQ").await["messages"], 2);
    let mut sub = pull(&client, "WQ", "w", r#"{"batch":5,"no_wait":true}"#).await;
    let a = delivery(&mut sub).await;
    let b = delivery(&mut sub).await;
    assert_eq!((text(&a).as_str(), text(&b).as_str()), ("job2", "job3"));
    ack_sync(&client, &a, "+ACK").await;
    ack_sync(&client, &b, "+ACK").await;
    wait_messages(&client, "WQ", 0).await;
}

// ---------------------------------------------------------------------------
// bad input: never a hang
// ---------------------------------------------------------------------------

#[tokio::test]
async fn bad_acks_are_ignored() {
    let (_s, client, js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    for i in 1..=3 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    create_consumer(&client, "S", "d", json!({})).await;
    let mut sub = pull(&client, "S", "d", r#"{"batch":1,"no_wait":true}"#).await;
    let d1 = delivery(&mut sub).await;
    let reply = d1.reply.clone().unwrap().to_string();
    let tokens: Vec<&str> = reply.split('.').collect();
    let forged =
        |dseq: u64, sseq: u64| format!("$JS.ACK.S.d.1.{sseq}.{dseq}.{}.{}", tokens[7], tokens[8]);
    let before = state(&client, "S", "d").await;
    let short = Duration::from_millis(300);

    // Unknown payload: ignored, AckSync still answered.
    assert!(with_reply(&client, &reply, "WHAT", STEP).await.is_some());
    // Acks for stream sequences that were never delivered: no reply.
    assert!(with_reply(&client, &forged(99, 99), "+ACK", short)
        .await
        .is_none());
    assert!(with_reply(&client, &forged(2, 2), "+ACK", short)
        .await
        .is_none());
    // Non-numeric tokens: no reply.
    let garbage = "$JS.ACK.S.d.x.y.z.w.v";
    assert!(with_reply(&client, garbage, "+ACK", short).await.is_none());
    // Wrong number of tokens / unknown consumer: nobody listens (503).
    let nr = with_reply(&client, "$JS.ACK.S.d.1.1", "+ACK", STEP)
        .await
        .unwrap();
    assert_eq!(status(&nr), Some(503));
    let nr = with_reply(&client, &reply.replace(".S.d.", ".S.zz."), "+ACK", STEP)
        .await
        .unwrap();
    assert_eq!(status(&nr), Some(503));
    assert_eq!(state(&client, "S", "d").await, before);

    // A NAK with an unparsable body is still a NAK: redelivered at once.
    assert!(with_reply(&client, &reply, "-NAK {bad", STEP)
        .await
        .is_some());
    let mut sub = pull(&client, "S", "d", r#"{"batch":1,"no_wait":true}"#).await;
    let again = delivery(&mut sub).await;
    assert_eq!(text(&again), "m1");
    assert_eq!(meta(&js, &again).delivered, 2);

    // An ack whose consumer-seq token is wrong still acks by stream sequence.
    let by_sseq = format!("$JS.ACK.S.d.1.1.99.{}.{}", tokens[7], tokens[8]);
    assert!(with_reply(&client, &by_sseq, "+ACK", STEP).await.is_some());
    let st = state(&client, "S", "d").await;
    assert_eq!((st.ack_floor.1, st.ack_pending, st.pending), (1, 0, 2));
}

#[tokio::test]
async fn bad_pull_requests() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    publish(&client, "s.a", "m1").await;
    create_consumer(&client, "S", "c", json!({})).await;
    let short = Duration::from_millis(300);

    // Treated as a request for one message.
    for (i, body) in [
        r#"{"batch":0,"no_wait":true}"#,
        r#"{"batch":-1,"no_wait":true}"#,
        r#"{"batch":1,"max_bytes":-1,"no_wait":true}"#,
        r#"{"no_wait":true}"#,
        "{}",
        "abc",
        "[]",
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("b{i}");
        create_consumer(&client, "S", &name, json!({})).await;
        let mut sub = pull(&client, "S", &name, body).await;
        let d = delivery(&mut sub).await;
        assert_eq!(text(&d), "m1", "body {body}");
        quiet(&mut sub, short).await;
        assert_eq!(
            state(&client, "S", &name).await.ack_pending,
            1,
            "body {body}"
        );
    }
    // 400 Bad Request with the JSON error.
    let mut sub = pull(&client, "S", "c", "{bad").await;
    let m = status_msg(&mut sub, 400).await;
    assert_eq!(
        m.description.as_deref(),
        Some("Bad Request - invalid character 'b' looking for beginning of object key string")
    );
    let mut sub = pull(
        &client,
        "S",
        "c",
        r#"{"batch":1,"expires":10000000000000000000}"#,
    )
    .await;
    let m = status_msg(&mut sub, 400).await;
    assert!(
        m.description
            .as_deref()
            .unwrap_or("")
            .starts_with("Bad Request - "),
        "{:?}",
        m.description
    );
    let mut sub = pull(&client, "S", "c", r#"{"batch":1,"expires":"x"}"#).await;
    status_msg(&mut sub, 400).await;
    // Negative expiry: immediate 408.
    let mut sub = pull(
        &client,
        "S",
        "c",
        r#"{"batch":1,"expires":-5,"no_wait":true}"#,
    )
    .await;
    let m = status_msg(&mut sub, 408).await;
    assert_eq!(header(&m, "Nats-Pending-Messages").as_deref(), Some("1"));
    // An absurd batch is accepted: the one message, then 408 with the rest.
    let mut sub = pull(
        &client,
        "S",
        "c",
        r#"{"batch":1000000000,"expires":300000000}"#,
    )
    .await;
    let d = delivery(&mut sub).await;
    assert_eq!(text(&d), "m1");
    let m = status_msg(&mut sub, 408).await;
    assert_eq!(
        header(&m, "Nats-Pending-Messages").as_deref(),
        Some("999999999")
    );

    // The server is fine afterwards.
    assert_eq!(state(&client, "S", "c").await.ack_pending, 1);
    let info = consumer_info(&client, "S", "c").await;
    assert_eq!(info["num_waiting"], 0);
}

// ---------------------------------------------------------------------------
// restart
// ---------------------------------------------------------------------------

/// The reference flushes consumer ack state asynchronously: acks SIGKILLed
/// within ~50 ms were lost in observation, after ≥100 ms they were kept.
const PERSIST_SETTLE: Duration = Duration::from_millis(1000);

#[tokio::test]
async fn consumer_state_survives_sigkill() {
    let (mut server, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({"storage": "file"})).await;
    for i in 1..=5 {
        publish(&client, "s.a", &format!("m{i}")).await;
    }
    create_consumer(&client, "S", "dur", json!({"ack_wait": 2 * SEC})).await;
    let mut sub = pull(&client, "S", "dur", r#"{"batch":3,"no_wait":true}"#).await;
    let d1 = delivery(&mut sub).await;
    let d2 = delivery(&mut sub).await;
    let _d3 = delivery(&mut sub).await;
    ack_sync(&client, &d1, "+ACK").await;
    ack_sync(&client, &d2, "+ACK").await;
    let before = state(&client, "S", "dur").await;
    assert_eq!(
        before,
        State {
            delivered: (3, 3),
            ack_floor: (2, 2),
            ack_pending: 1,
            redelivered: 0,
            waiting: 0,
            pending: 2,
        }
    );
    tokio::time::sleep(PERSIST_SETTLE).await;
    drop(sub);
    drop(client);
    server.kill_hard();
    server.restart();

    let client = server.client().await;
    let after = consumer_info(&client, "S", "dur").await;
    assert_eq!(state_of(&after), before, "state after restart: {after}");
    assert_eq!(after["config"]["ack_wait"], 2 * SEC);

    // Acked messages never come back; the delivered-unacked one is
    // redelivered (delivery count 2) after ack_wait; 4 and 5 are new.
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(6);
    while got.len() < 3 && Instant::now() < deadline {
        let mut sub = pull(&client, "S", "dur", r#"{"batch":3,"expires":1000000000}"#).await;
        loop {
            let m = next_msg(&mut sub).await;
            if !is_delivery(&m) {
                assert_eq!(status(&m), Some(408));
                break;
            }
            let md = meta(&jetstream::new(client.clone()), &m);
            got.push((md.sseq, md.delivered));
            ack_sync(&client, &m, "+ACK").await;
            if got.len() == 3 {
                break;
            }
        }
    }
    got.sort_unstable();
    assert_eq!(got, vec![(3, 2), (4, 1), (5, 1)]);
    let st = state(&client, "S", "dur").await;
    assert_eq!((st.ack_floor.1, st.ack_pending, st.pending), (5, 0, 0));
}

/// A durable with an `inactive_threshold` is removed once nothing uses it, as an ephemeral
/// is (the reference does so since 2.9); one without a threshold stays. A message it
/// delivered and that is not acked yet keeps it: the threshold counts from that message's
/// ack deadline.
#[tokio::test]
async fn a_durable_with_an_inactive_threshold_goes_once_idle() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"], json!({})).await;
    create_consumer(&client, "S", "kept", json!({})).await;
    create_consumer(&client, "S", "idle", json!({"inactive_threshold": SEC / 2})).await;
    create_consumer(
        &client,
        "S",
        "busy",
        json!({"inactive_threshold": SEC / 2, "ack_wait": 10 * SEC}),
    )
    .await;
    publish(&client, "s.x", "m").await;
    let mut sub = pull(&client, "S", "busy", r#"{"batch":1,"no_wait":true}"#).await;
    let held = delivery(&mut sub).await;
    let info = |name: &'static str| {
        let client = client.clone();
        async move {
            api(
                &client,
                &format!("{API}.CONSUMER.INFO.S.{name}"),
                Value::Null,
            )
            .await
        }
    };
    let gone = |name: &'static str| async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = info(name).await;
            if r["error"]["err_code"] == 10014 {
                return;
            }
            assert!(Instant::now() < deadline, "{name} still there: {r}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    gone("idle").await;
    // (Its pending message's ack deadline is 10 s away.)
    let r = info("busy").await;
    assert!(
        r.get("error").is_none(),
        "busy went with a message pending: {r}"
    );
    client
        .publish(held.reply.clone().expect("ack subject"), Bytes::new())
        .await
        .unwrap();
    gone("busy").await;
    let r = info("kept").await;
    assert!(r.get("error").is_none(), "{r}");
}

/// A purge takes what it removed out of a consumer's pending acks and moves its delivered
/// and ack floor up to the stream's new first sequence, as the reference's consumer does:
/// purged messages no longer count against `max_ack_pending` (a consumer at its limit goes
/// on at once, not after their ack wait), and one left after a subject purge stays pending.
#[tokio::test]
async fn a_purge_releases_the_pending_acks_of_what_it_removed() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "PG", &["pg.>"], json!({})).await;
    for i in 0..10 {
        publish(&client, &format!("pg.{}", i % 2), "x").await;
    }
    create_consumer(
        &client,
        "PG",
        "D",
        json!({"max_ack_pending": 3, "ack_wait": 60 * SEC}),
    )
    .await;
    let mut sub = pull(&client, "PG", "D", r#"{"batch":5,"expires":1000000000}"#).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(delivery(&mut sub).await);
    }
    // At max_ack_pending: nothing more until the pull expires.
    status_msg(&mut sub, 408).await;
    ack_plain(&client, &got[0], "+ACK").await;
    let info = |body: Value| {
        let client = client.clone();
        async move {
            let v = api_ok(&client, &format!("{API}.STREAM.PURGE.PG"), body).await;
            assert_eq!(v["success"], true, "{v}");
            api_ok(&client, &format!("{API}.CONSUMER.INFO.PG.D"), Value::Null).await
        }
    };
    // Sequences 2 and 3 were pending; keeping 5 purges 1 to 5.
    let i = info(json!({"keep": 5})).await;
    assert_eq!(i["num_ack_pending"], 0, "{i}");
    assert_eq!(seq_pair(&i["delivered"]), (3, 5), "{i}");
    assert_eq!(seq_pair(&i["ack_floor"]), (3, 5), "{i}");
    assert_eq!(i["num_pending"], 5, "{i}");
    // Delivery goes on at once (6, 7, 8: the limit again).
    let mut sub = pull(&client, "PG", "D", r#"{"batch":3,"expires":1000000000}"#).await;
    let seqs: Vec<u64> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            let m = delivery(&mut sub).await;
            // `$JS.ACK.<stream>.<consumer>.<deliveries>.<stream seq>.…`
            let reply = m.reply.as_ref().unwrap().to_string();
            v.push(reply.split('.').nth(5).unwrap().parse().unwrap());
        }
        v
    };
    assert_eq!(seqs, [6, 7, 8]);
    // A subject purge takes 6 and 8 (pg.1) out; 7 (pg.0) stays pending.
    let i = info(json!({"filter": "pg.1"})).await;
    assert_eq!(i["num_ack_pending"], 1, "{i}");
    assert_eq!(i["ack_floor"]["stream_seq"], 6, "{i}");
    assert_eq!(i["num_pending"], 1, "{i}");
}
