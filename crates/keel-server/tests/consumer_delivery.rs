//! Consumer delivery as real workers see it (issue 10): pull requests whose requester
//! went away (unsubscribed, disconnected, SIGKILLed) get nothing and count for nothing;
//! deleting a stream stops its consumers; pull validation (heartbeat, no_wait with
//! expires); prompt first push delivery; priority groups (overflow, pinned client,
//! prioritized, unpin); consumer pause/resume and reset; replay policy original; and the
//! stream options that used to be accepted without effect.
//!
//! Expectations are the reference nats-server 2.15.1's behaviour: run with
//! `KEEL_TEST_REFERENCE=1` to check them against it. Status messages are asserted from
//! raw inbox subscriptions; timings only have generous bounds.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::{Client, Message, Subscriber};
use bytes::Bytes;
use common::{api, api_error, api_ok, js_setup, json_request, next_msg, within, STEP};
use futures::StreamExt;
use serde_json::{json, Value};

const API: &str = "$JS.API";
const SEC: i64 = 1_000_000_000;

async fn create_stream(client: &Client, name: &str, subjects: &[&str]) {
    api_ok(
        client,
        &format!("{API}.STREAM.CREATE.{name}"),
        json!({"name": name, "subjects": subjects, "storage": "memory"}),
    )
    .await;
}

/// A durable consumer `name` with explicit acks plus `extra` config keys.
async fn create_consumer(client: &Client, stream: &str, name: &str, extra: Value) -> Value {
    let mut config = json!({"durable_name": name, "ack_policy": "explicit"});
    if let Value::Object(m) = extra {
        for (k, v) in m {
            config[k] = v;
        }
    }
    api(
        client,
        &format!("{API}.CONSUMER.CREATE.{stream}.{name}"),
        json!({"stream_name": stream, "config": config}),
    )
    .await
}

async fn info(client: &Client, stream: &str, name: &str) -> Value {
    api_ok(
        client,
        &format!("{API}.CONSUMER.INFO.{stream}.{name}"),
        Value::Null,
    )
    .await
}

async fn publish(client: &Client, subject: &str, payload: &str) -> u64 {
    let (text, ack) = json_request(client, subject, payload.to_string()).await;
    assert!(ack.get("error").is_none(), "publish {subject}: {text}");
    ack["seq"].as_u64().expect("PubAck seq")
}

/// Sends a pull request from `client` with a fresh inbox; everything for it arrives on
/// the returned subscription.
async fn pull(client: &Client, stream: &str, consumer: &str, body: Value) -> Subscriber {
    let inbox = client.new_inbox();
    let sub = client.subscribe(inbox.clone()).await.expect("subscribe");
    client
        .publish_with_reply(
            format!("{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            inbox,
            Bytes::from(body.to_string()),
        )
        .await
        .expect("publish pull");
    within("flush", client.flush()).await.expect("flush");
    sub
}

async fn next_within(sub: &mut Subscriber, wait: Duration) -> Option<Message> {
    match tokio::time::timeout(wait, sub.next()).await {
        Ok(Some(m)) => Some(m),
        Ok(None) => panic!("subscription ended"),
        Err(_) => None,
    }
}

fn status(m: &Message) -> Option<u16> {
    m.status.map(|s| s.as_u16())
}

fn describe(m: &Message) -> String {
    format!(
        "subject {} reply {:?} status {:?} {:?} headers {:?} payload {:?}",
        m.subject,
        m.reply,
        m.status,
        m.description,
        m.headers,
        String::from_utf8_lossy(&m.payload)
    )
}

fn header(m: &Message, name: &str) -> Option<String> {
    m.headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_string())
}

/// The next message, which must be a delivery; returns (payload, delivery count).
async fn delivery(sub: &mut Subscriber) -> (String, u64) {
    let m = next_msg(sub).await;
    let reply = m.reply.as_ref().map(|r| r.to_string()).unwrap_or_default();
    assert!(
        m.status.is_none() && reply.starts_with("$JS.ACK."),
        "expected a delivery, got {}",
        describe(&m)
    );
    let tokens: Vec<&str> = reply.split('.').collect();
    (
        String::from_utf8_lossy(&m.payload).into_owned(),
        tokens[4].parse().expect("delivery count"),
    )
}

/// The next message, which must be a status with `code`; returns its description.
async fn status_msg(sub: &mut Subscriber, code: u16) -> String {
    let m = next_msg(sub).await;
    assert_eq!(status(&m), Some(code), "got {}", describe(&m));
    m.description.clone().unwrap_or_default()
}

async fn quiet(sub: &mut Subscriber, wait: Duration) {
    if let Some(m) = next_within(sub, wait).await {
        panic!("unexpected message: {}", describe(&m));
    }
}

/// Polls consumer info until `f` holds for it (the reference updates some counters
/// asynchronously); panics with the last info after `STEP`.
async fn wait_info(client: &Client, stream: &str, name: &str, f: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + STEP;
    loop {
        let i = info(client, stream, name).await;
        if f(&i) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "consumer info never matched: {i}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn counters(i: &Value) -> (u64, u64, u64, u64) {
    (
        i["num_waiting"].as_u64().unwrap(),
        i["num_pending"].as_u64().unwrap(),
        i["num_ack_pending"].as_u64().unwrap(),
        i["delivered"]["consumer_seq"].as_u64().unwrap(),
    )
}

// ---------------------------------------------------------------------------
// 1. Pull requests whose requester went away
// ---------------------------------------------------------------------------

/// nats.js `consume()`: a 30 s request, then the consumer is stopped (inbox
/// unsubscribed). One publish must stay pending for the next worker, delivered once.
#[tokio::test]
async fn unsubscribed_pull_request_is_dropped() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "W", &["w.>"]).await;
    create_consumer(&client, "W", "worker", json!({})).await;
    let worker = _s.client().await;
    let mut sub = pull(
        &worker,
        "W",
        "worker",
        json!({"batch": 100, "expires": 30 * SEC, "idle_heartbeat": 15 * SEC}),
    )
    .await;
    wait_info(&client, "W", "worker", |i| i["num_waiting"] == 1).await;
    sub.unsubscribe().await.expect("unsubscribe");
    common::sync(&worker).await;
    publish(&client, "w.job", "job-1").await;
    wait_info(&client, "W", "worker", |i| i["num_pending"] == 1).await;
    let i = info(&client, "W", "worker").await;
    // Nothing went to the dead request: not waiting, not delivered, not ack pending.
    assert_eq!(counters(&i), (0, 1, 0, 0), "{i}");
    let mut live = pull(
        &client,
        "W",
        "worker",
        json!({"batch": 1, "expires": 5 * SEC}),
    )
    .await;
    assert_eq!(delivery(&mut live).await, ("job-1".into(), 1));
}

/// A worker whose connection closes while its request waits; `max_deliver: 3` must not
/// be used up on the dead request: the next worker gets the message, first delivery.
#[tokio::test]
async fn closed_connection_pull_request_is_dropped() {
    let (s, client, _js) = js_setup().await;
    create_stream(&client, "W", &["w.>"]).await;
    create_consumer(
        &client,
        "W",
        "worker",
        json!({"max_deliver": 3, "ack_wait": SEC}),
    )
    .await;
    {
        let worker = s.client().await;
        let _sub = pull(
            &worker,
            "W",
            "worker",
            json!({"batch": 1, "expires": 30 * SEC}),
        )
        .await;
        wait_info(&client, "W", "worker", |i| i["num_waiting"] == 1).await;
        // Dropping the last handle closes the connection (no UNSUB sent).
        drop(_sub);
        drop(worker);
    }
    // The server notices the close; the request then no longer counts.
    wait_info(&client, "W", "worker", |i| i["num_waiting"] == 0).await;
    publish(&client, "w.job", "job-1").await;
    wait_info(&client, "W", "worker", |i| i["num_pending"] == 1).await;
    let mut live = pull(
        &client,
        "W",
        "worker",
        json!({"batch": 1, "expires": 5 * SEC}),
    )
    .await;
    assert_eq!(delivery(&mut live).await, ("job-1".into(), 1));
}

/// The worker of `sigkilled_worker_long_poll`: a Go-style `Fetch(5, MaxWait(20s))` long
/// poll from a separate process. Runs only when the parent test starts it.
#[tokio::test]
#[ignore = "child process of sigkilled_worker_long_poll"]
async fn child_pull_worker() {
    let Ok(url) = std::env::var("KEEL_CHILD_WORKER_URL") else {
        return;
    };
    let client = async_nats::connect(url).await.expect("connect");
    let inbox = client.new_inbox();
    let _sub = client.subscribe(inbox.clone()).await.expect("subscribe");
    client
        .publish_with_reply(
            format!("{API}.CONSUMER.MSG.NEXT.B.worker"),
            inbox,
            Bytes::from(json!({"batch": 5, "expires": 20 * SEC}).to_string()),
        )
        .await
        .expect("pull");
    client.flush().await.expect("flush");
    println!("READY");
    tokio::time::sleep(Duration::from_secs(60)).await;
}

/// Seed walkthrough B: the subscriber process is SIGKILLed during a long poll; the
/// restarted subscriber must get all 5 messages published meanwhile.
#[tokio::test]
async fn sigkilled_worker_long_poll() {
    let (s, client, _js) = js_setup().await;
    create_stream(&client, "B", &["b.>"]).await;
    create_consumer(&client, "B", "worker", json!({})).await;
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "child_pull_worker",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KEEL_CHILD_WORKER_URL", s.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn worker");
    let stdout = child.stdout.take().expect("stdout");
    let ready = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.trim_end().ends_with("READY"))
    });
    assert!(
        within("worker ready", ready).await.expect("reader"),
        "worker never got ready"
    );
    wait_info(&client, "B", "worker", |i| i["num_waiting"] == 1).await;
    child.kill().expect("SIGKILL worker");
    child.wait().expect("reap worker");
    wait_info(&client, "B", "worker", |i| i["num_waiting"] == 0).await;
    for n in 1..=5 {
        publish(&client, "b.msg", &format!("m{n}")).await;
    }
    wait_info(&client, "B", "worker", |i| i["num_pending"] == 5).await;
    let restarted = s.client().await;
    let mut sub = pull(
        &restarted,
        "B",
        "worker",
        json!({"batch": 5, "expires": 5 * SEC}),
    )
    .await;
    for n in 1..=5 {
        assert_eq!(delivery(&mut sub).await, (format!("m{n}"), 1));
    }
}

/// A crash-looping worker (connect, long poll, die) must not fill `max_waiting` with
/// dead requests: a live worker still gets in and gets the message.
#[tokio::test]
async fn crash_looping_worker_cannot_fill_max_waiting() {
    let s = common::Server::start_jetstream_with_config("http_port: -1\n");
    let client = s.client().await;
    create_stream(&client, "C", &["c.>"]).await;
    create_consumer(&client, "C", "worker", json!({"max_waiting": 2})).await;
    for n in 0..5 {
        if common::is_reference() {
            // The reference drops dead requests of a full queue at most once a second; a
            // real crash loop is that slow. Keel drops them whenever the queue is full.
            tokio::time::sleep(Duration::from_millis(1100)).await;
        }
        let mut raw = s.raw_connected().await;
        let body = json!({"batch": 1, "expires": 30 * SEC}).to_string();
        raw.send(
            format!(
                "SUB _INBOX.crash.{n} 1\r\nPUB {API}.CONSUMER.MSG.NEXT.C.worker _INBOX.crash.{n} {}\r\n{body}\r\nPING\r\n",
                body.len()
            )
            .as_bytes(),
        )
        .await;
        assert_eq!(raw.read_op().await, "PONG");
        drop(raw);
    }
    // A dead worker's request is dropped once the server has seen its connection close:
    // on a busy machine that can come after the next request, so wait for it (only
    // `client` left), as a real crash loop is slower than this one.
    let deadline = Instant::now() + STEP;
    loop {
        let varz = common::http_get(s.monitor_port(), "/varz").await;
        let v: Value = serde_json::from_str(&varz.body).expect("varz JSON");
        if v["connections"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dead workers still connected: {v}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if common::is_reference() {
        // Under load the reference may not yet have seen the last dead connection close
        // when the next request cleaned the queue; give its once-a-second sweep one more go.
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let mut live = pull(
        &client,
        "C",
        "worker",
        json!({"batch": 1, "expires": 10 * SEC}),
    )
    .await;
    publish(&client, "c.job", "job").await;
    assert_eq!(delivery(&mut live).await, ("job".into(), 1));
}

// ---------------------------------------------------------------------------
// 2. Deleting a stream stops its consumers
// ---------------------------------------------------------------------------

/// A server that stops (SIGTERM) tells every pull waiting on it `409 Server Shutdown`, with
/// what the pull still wanted, so its client pulls again where it reconnects instead of
/// waiting out the expiry (nats.py's ordered consumer hung on a restart without it).
#[tokio::test]
async fn a_stopping_server_tells_waiting_pulls() {
    let (mut s, client, _js) = js_setup().await;
    create_stream(&client, "SD", &["sd.>"]).await;
    create_consumer(&client, "SD", "dur", json!({})).await;
    let mut waiting = pull(
        &client,
        "SD",
        "dur",
        json!({"batch": 7, "max_bytes": 4096, "expires": 60 * SEC}),
    )
    .await;
    wait_info(&client, "SD", "dur", |i| i["num_waiting"] == 1).await;
    let stopped = std::thread::spawn(move || {
        s.stop();
        s
    });
    let m = next_msg(&mut waiting).await;
    assert_eq!(status(&m), Some(409), "got {}", describe(&m));
    assert_eq!(m.description.as_deref(), Some("Server Shutdown"));
    let h = m.headers.as_ref().expect("headers");
    assert_eq!(
        h.get("Nats-Pending-Messages").map(|v| v.as_str()),
        Some("7")
    );
    assert_eq!(
        h.get("Nats-Pending-Bytes").map(|v| v.as_str()),
        Some("4096")
    );
    drop(stopped.join().unwrap());
}

#[tokio::test]
async fn stream_delete_stops_its_consumers() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "D", &["d.>"]).await;
    create_consumer(&client, "D", "dur", json!({})).await;
    let mut waiting = pull(
        &client,
        "D",
        "dur",
        json!({"batch": 1, "expires": 30 * SEC}),
    )
    .await;
    wait_info(&client, "D", "dur", |i| i["num_waiting"] == 1).await;
    api_ok(&client, &format!("{API}.STREAM.DELETE.D"), Value::Null).await;
    assert_eq!(status_msg(&mut waiting, 409).await, "Consumer Deleted");
    // A pull on the old name: exactly one answer, the no-responders status.
    let mut ghost = pull(&client, "D", "dur", json!({"batch": 1, "no_wait": true})).await;
    assert_eq!(status(&next_msg(&mut ghost).await), Some(503));
    quiet(&mut ghost, Duration::from_millis(300)).await;
    // Recreated: the new consumer answers, no ghost 404 first.
    create_stream(&client, "D", &["d.>"]).await;
    create_consumer(&client, "D", "dur", json!({})).await;
    publish(&client, "d.x", "fresh").await;
    wait_info(&client, "D", "dur", |i| i["num_pending"] == 1).await;
    let mut sub = pull(&client, "D", "dur", json!({"batch": 1, "no_wait": true})).await;
    assert_eq!(delivery(&mut sub).await, ("fresh".into(), 1));
    quiet(&mut sub, Duration::from_millis(300)).await;
}

// ---------------------------------------------------------------------------
// 5. Pull semantics and validation
// ---------------------------------------------------------------------------

#[tokio::test]
async fn pull_heartbeat_over_half_of_expires_is_refused() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "H", &["h.>"]).await;
    create_consumer(&client, "H", "c", json!({})).await;
    for body in [
        json!({"batch": 1, "expires": 2 * SEC, "idle_heartbeat": 1_500_000_000}),
        json!({"batch": 1, "idle_heartbeat": SEC}),
    ] {
        let mut sub = pull(&client, "H", "c", body).await;
        assert_eq!(
            status_msg(&mut sub, 400).await,
            "Bad Request - heartbeat value too large"
        );
    }
    // Exactly half is fine: a heartbeat, then the timeout.
    let mut sub = pull(
        &client,
        "H",
        "c",
        json!({"batch": 1, "expires": 2 * SEC, "idle_heartbeat": SEC}),
    )
    .await;
    assert_eq!(status_msg(&mut sub, 100).await, "Idle Heartbeat");
    assert_eq!(status_msg(&mut sub, 408).await, "Request Timeout");
}

#[tokio::test]
async fn no_wait_with_expires_waits_for_messages() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "N", &["n.>"]).await;
    create_consumer(&client, "N", "c", json!({})).await;
    // Nothing there: it waits the whole expiry, then times out (not an immediate 404).
    let started = Instant::now();
    let mut sub = pull(
        &client,
        "N",
        "c",
        json!({"batch": 2, "no_wait": true, "expires": SEC}),
    )
    .await;
    assert_eq!(status_msg(&mut sub, 408).await, "Request Timeout");
    assert!(started.elapsed() >= Duration::from_millis(900));
    // A message arriving meanwhile is delivered, then the request ends with 404.
    let mut sub = pull(
        &client,
        "N",
        "c",
        json!({"batch": 2, "no_wait": true, "expires": 5 * SEC}),
    )
    .await;
    wait_info(&client, "N", "c", |i| i["num_waiting"] == 1).await;
    publish(&client, "n.x", "late").await;
    assert_eq!(delivery(&mut sub).await, ("late".into(), 1));
    assert_eq!(status_msg(&mut sub, 404).await, "No Messages");
    // Without expires and nothing there: 404 at once.
    let mut sub = pull(&client, "N", "c", json!({"batch": 1, "no_wait": true})).await;
    assert_eq!(status_msg(&mut sub, 404).await, "No Messages");
}

/// A no_wait request with an expiry that got part of its batch and is then held back by
/// max_ack_pending ends with 404 at its next heartbeat, as the reference's (nats.py's
/// `fetch` with heartbeats waited otherwise, and its next fetch then failed): the acks that
/// follow send nothing more to it.
#[tokio::test]
async fn a_no_wait_pull_held_back_by_max_ack_pending_ends_at_its_heartbeat() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "HB", &["hb.>"]).await;
    create_consumer(&client, "HB", "c", json!({"max_ack_pending": 2})).await;
    for n in 0..4 {
        publish(&client, "hb.x", &format!("m{n}")).await;
    }
    let started = Instant::now();
    let mut sub = pull(
        &client,
        "HB",
        "c",
        json!({"batch": 4, "no_wait": true, "expires": 20 * SEC, "idle_heartbeat": SEC / 10}),
    )
    .await;
    let mut acks = vec![];
    for want in ["m0", "m1"] {
        let m = next_msg(&mut sub).await;
        assert_eq!(m.payload, want.as_bytes(), "{}", describe(&m));
        acks.push(m.reply.clone().expect("ack subject"));
    }
    let m = next_msg(&mut sub).await;
    assert_eq!(status(&m), Some(404), "got {}", describe(&m));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "ended at its heartbeat"
    );
    for a in acks {
        client.publish(a, "+ACK".into()).await.unwrap();
    }
    within("flush", client.flush()).await.unwrap();
    wait_info(&client, "HB", "c", |i| i["num_ack_pending"] == 0).await;
    quiet(&mut sub, Duration::from_millis(300)).await;
}

/// The first stored message reaches a new push consumer without a poll delay, whether
/// the deliver subject was subscribed before (nats-py, KV watchers) or after (async-nats)
/// the create. Ten in a row used to take over a second.
#[tokio::test]
async fn new_push_consumer_delivers_at_once() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "P", &["p.>"]).await;
    publish(&client, "p.x", "first").await;
    let started = Instant::now();
    for n in 0..10 {
        let ds = format!("deliver.before.{n}");
        let mut sub = client.subscribe(ds.clone()).await.expect("subscribe");
        let c = create_consumer(
            &client,
            "P",
            &format!("before{n}"),
            json!({"deliver_subject": ds, "ack_policy": "none"}),
        )
        .await;
        assert!(c.get("error").is_none(), "{c}");
        assert_eq!(delivery(&mut sub).await.0, "first");
    }
    let before = started.elapsed();
    let started = Instant::now();
    for n in 0..10 {
        let ds = format!("deliver.after.{n}");
        let c = create_consumer(
            &client,
            "P",
            &format!("after{n}"),
            json!({"deliver_subject": ds, "ack_policy": "none"}),
        )
        .await;
        assert!(c.get("error").is_none(), "{c}");
        let mut sub = client.subscribe(ds).await.expect("subscribe");
        assert_eq!(delivery(&mut sub).await.0, "first");
    }
    let after = started.elapsed();
    assert!(
        before < Duration::from_millis(800) && after < Duration::from_millis(800),
        "first deliveries took {before:?} / {after:?} for 10 consumers"
    );
}

#[tokio::test]
async fn stream_options_without_effect_are_refused() {
    let (_s, client, _js) = js_setup().await;
    let resp = api(
        &client,
        &format!("{API}.STREAM.CREATE.M"),
        json!({"name": "M", "subjects": ["m.>"], "storage": "memory", "mirror_direct": true}),
    )
    .await;
    assert_eq!(
        api_error(&resp),
        (
            500,
            10052,
            "stream has no mirror but does have mirror direct".into()
        )
    );
    // consumer_limits below what an existing consumer uses.
    api_ok(
        &client,
        &format!("{API}.STREAM.CREATE.L"),
        json!({"name": "L", "subjects": ["l.>"], "storage": "memory"}),
    )
    .await;
    create_consumer(&client, "L", "big", json!({"max_ack_pending": 100})).await;
    create_consumer(&client, "L", "small", json!({"max_ack_pending": 5})).await;
    let resp = api(
        &client,
        &format!("{API}.STREAM.UPDATE.L"),
        json!({"name": "L", "subjects": ["l.>"], "storage": "memory",
               "consumer_limits": {"max_ack_pending": 10}}),
    )
    .await;
    assert_eq!(
        api_error(&resp),
        (
            500,
            10069,
            "change to limits violates consumers: big".into()
        )
    );
    if !common::is_reference() {
        // Fast batch publishing is not implemented: refused, never silently dropped.
        let resp = api(
            &client,
            &format!("{API}.STREAM.CREATE.F"),
            json!({"name": "F", "subjects": ["f.>"], "storage": "memory", "allow_batched": true}),
        )
        .await;
        let (code, err_code, _) = api_error(&resp);
        assert_eq!((code, err_code), (500, 10052), "{resp}");
    }
}

// ---------------------------------------------------------------------------
// 5. Priority groups
// ---------------------------------------------------------------------------

#[tokio::test]
async fn priority_group_config_validation() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "G", &["g.>"]).await;
    let cases = [
        (
            json!({"priority_policy": "overflow"}),
            (400, 10159, "Setting PriorityPolicy requires at least one PriorityGroup to be set"),
        ),
        (
            json!({"priority_groups": ["A"]}),
            (400, 10196, "consumer can not have priority groups when policy is none"),
        ),
        (
            json!({"priority_timeout": SEC}),
            (400, 10197, "PinnedTTL cannot be set when PriorityPolicy is none"),
        ),
        (
            json!({"priority_policy": "overflow", "priority_groups": [""]}),
            (400, 10161, "Group name cannot be an empty string"),
        ),
        (
            json!({"priority_policy": "overflow", "priority_groups": ["a.b"]}),
            (400, 10162, "Valid priority group name must match A-Z, a-z, 0-9, -_/=)+ and may not exceed 16 characters"),
        ),
        (
            json!({"priority_policy": "overflow", "priority_groups": ["A"], "deliver_subject": "push.g"}),
            (400, 10178, "priority groups can not be used with push consumers"),
        ),
    ];
    for (i, (extra, (code, err_code, text))) in cases.into_iter().enumerate() {
        let resp = create_consumer(&client, "G", &format!("c{i}"), extra).await;
        assert_eq!(
            api_error(&resp),
            (code, err_code, text.to_string()),
            "case {i}"
        );
    }
    let resp = create_consumer(
        &client,
        "G",
        "pin",
        json!({"priority_policy": "pinned_client", "priority_groups": ["A"]}),
    )
    .await;
    assert!(resp.get("error").is_none(), "{resp}");
    assert_eq!(resp["config"]["priority_groups"], json!(["A"]));
    assert_eq!(resp["config"]["priority_policy"], "pinned_client");
    assert_eq!(resp["config"]["priority_timeout"], 120 * SEC);
    assert_eq!(resp["config"]["metadata"]["_nats.req.level"], "1");
    assert_eq!(
        resp["priority_groups"],
        json!([{"group": "A", "pinned_ts": "0001-01-01T00:00:00Z"}])
    );
}

#[tokio::test]
async fn priority_group_pull_validation() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "G", &["g.>"]).await;
    create_consumer(&client, "G", "plain", json!({})).await;
    create_consumer(
        &client,
        "G",
        "over",
        json!({"priority_policy": "overflow", "priority_groups": ["A"]}),
    )
    .await;
    let cases = [
        (
            "plain",
            json!({"batch": 1, "min_pending": 1}),
            "Bad Request - Not a Overflow Priority consumer",
        ),
        (
            "plain",
            json!({"batch": 1, "id": "x"}),
            "Bad Request - Not a Pinned Client Priority consumer",
        ),
        (
            "plain",
            json!({"batch": 1, "priority": 10}),
            "Bad Request - Priority must be between 0 and 9",
        ),
        (
            "over",
            json!({"batch": 1, "expires": SEC}),
            "Bad Request - Priority Group missing",
        ),
        (
            "over",
            json!({"batch": 1, "group": "B"}),
            "Bad Request - Invalid Priority Group",
        ),
    ];
    for (consumer, body, text) in cases {
        let mut sub = pull(&client, "G", consumer, body.clone()).await;
        assert_eq!(status_msg(&mut sub, 400).await, text, "{consumer} {body}");
    }
}

/// Overflow: a request with `min_pending` is only served while that many are pending.
#[tokio::test]
async fn priority_overflow_serves_only_when_backed_up() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "O", &["o.>"]).await;
    create_consumer(
        &client,
        "O",
        "c",
        json!({"priority_policy": "overflow", "priority_groups": ["A"]}),
    )
    .await;
    publish(&client, "o.x", "1").await;
    let mut overflow = pull(
        &client,
        "O",
        "c",
        json!({"batch": 10, "expires": 10 * SEC, "group": "A", "min_pending": 3}),
    )
    .await;
    quiet(&mut overflow, Duration::from_millis(300)).await;
    publish(&client, "o.x", "2").await;
    quiet(&mut overflow, Duration::from_millis(300)).await;
    publish(&client, "o.x", "3").await;
    // Three pending now: served while at least three are pending (1, then none).
    assert_eq!(delivery(&mut overflow).await.0, "1");
    quiet(&mut overflow, Duration::from_millis(300)).await;
    // A normal member of the group takes what is left.
    let mut normal = pull(
        &client,
        "O",
        "c",
        json!({"batch": 5, "expires": 2 * SEC, "group": "A"}),
    )
    .await;
    assert_eq!(delivery(&mut normal).await.0, "2");
    assert_eq!(delivery(&mut normal).await.0, "3");
}

/// Pinned client: the first request gets a pin id (`Nats-Pin-Id` on its messages); other
/// requests wait; a wrong id gets 423; unpinning hands the pin to the next request.
#[tokio::test]
async fn priority_pinned_client() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "Q", &["q.>"]).await;
    create_consumer(
        &client,
        "Q",
        "c",
        json!({"priority_policy": "pinned_client", "priority_groups": ["A"]}),
    )
    .await;
    for n in 1..=3 {
        publish(&client, "q.x", &n.to_string()).await;
    }
    let mut first = pull(
        &client,
        "Q",
        "c",
        json!({"batch": 1, "expires": 5 * SEC, "group": "A"}),
    )
    .await;
    let m = next_msg(&mut first).await;
    assert_eq!(m.payload, "1");
    let pin = header(&m, "Nats-Pin-Id").expect("pinned delivery carries Nats-Pin-Id");
    let i = info(&client, "Q", "c").await;
    assert_eq!(i["priority_groups"][0]["pinned_client_id"], pin.as_str());
    // Another client without the pin waits while the pinned one keeps getting messages.
    let mut other = pull(
        &client,
        "Q",
        "c",
        json!({"batch": 1, "expires": 5 * SEC, "group": "A"}),
    )
    .await;
    quiet(&mut other, Duration::from_millis(300)).await;
    let mut again = pull(
        &client,
        "Q",
        "c",
        json!({"batch": 1, "expires": 5 * SEC, "group": "A", "id": pin}),
    )
    .await;
    let m = next_msg(&mut again).await;
    assert_eq!(m.payload, "2");
    assert_eq!(header(&m, "Nats-Pin-Id").as_deref(), Some(pin.as_str()));
    // A stale pin id is refused.
    let mut wrong = pull(
        &client,
        "Q",
        "c",
        json!({"batch": 1, "expires": 5 * SEC, "group": "A", "id": "stale"}),
    )
    .await;
    assert_eq!(status_msg(&mut wrong, 423).await, "Nats-Pin-Id mismatch");
    // Unpin: the waiting request gets the next message with a new pin.
    let resp = api_ok(
        &client,
        &format!("{API}.CONSUMER.UNPIN.Q.c"),
        json!({"group": "A"}),
    )
    .await;
    assert_eq!(
        resp,
        json!({"type": "io.nats.jetstream.api.v1.consumer_unpin_response"})
    );
    let m = next_msg(&mut other).await;
    assert_eq!(m.payload, "3");
    let new_pin = header(&m, "Nats-Pin-Id").expect("new pin");
    assert_ne!(new_pin, pin);
    let resp = api(
        &client,
        &format!("{API}.CONSUMER.UNPIN.Q.c"),
        json!({"group": "B"}),
    )
    .await;
    assert_eq!(
        api_error(&resp),
        (
            400,
            10160,
            "Provided priority group does not exist for this consumer".into()
        )
    );
    let resp = api(&client, &format!("{API}.CONSUMER.UNPIN.Q.c"), json!({})).await;
    assert_eq!(
        api_error(&resp),
        (
            400,
            10025,
            "invalid JSON: consumer group not specified".into()
        )
    );
}

/// Prioritized: waiting requests with a lower priority number are served first.
#[tokio::test]
async fn priority_prioritized_serves_lower_numbers_first() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "R", &["r.>"]).await;
    create_consumer(
        &client,
        "R",
        "c",
        json!({"priority_policy": "prioritized", "priority_groups": ["A"]}),
    )
    .await;
    let mut low = pull(
        &client,
        "R",
        "c",
        json!({"batch": 2, "expires": 10 * SEC, "group": "A", "priority": 5}),
    )
    .await;
    let mut high = pull(
        &client,
        "R",
        "c",
        json!({"batch": 2, "expires": 10 * SEC, "group": "A", "priority": 1}),
    )
    .await;
    wait_info(&client, "R", "c", |i| i["num_waiting"] == 2).await;
    for n in 1..=3 {
        publish(&client, "r.x", &n.to_string()).await;
    }
    assert_eq!(delivery(&mut high).await.0, "1");
    assert_eq!(delivery(&mut high).await.0, "2");
    assert_eq!(delivery(&mut low).await.0, "3");
}

/// Prioritized, with messages already there: of two requests that arrive together (one
/// write), the more urgent is served first even though it came second (nats.py's
/// prioritized `messages()` test), as by the reference's request queue.
#[tokio::test]
async fn priority_prioritized_requests_arriving_together_serve_the_urgent_first() {
    let (s, client, _js) = js_setup().await;
    create_stream(&client, "RT", &["rt.>"]).await;
    create_consumer(
        &client,
        "RT",
        "c",
        json!({"priority_policy": "prioritized", "priority_groups": ["A"]}),
    )
    .await;
    publish(&client, "rt.x", "only").await;
    let mut raw = s.raw_connected().await;
    raw.send(b"SUB in.low 1\r\nSUB in.high 2\r\nPING\r\n").await;
    assert_eq!(raw.read_op().await, "PONG");
    // Both requests in one write, the less urgent first.
    let mut burst = String::new();
    for (inbox, priority) in [("in.low", 5), ("in.high", 1)] {
        let body =
            json!({"batch": 1, "expires": 2 * SEC, "group": "A", "priority": priority}).to_string();
        burst += &format!(
            "PUB {API}.CONSUMER.MSG.NEXT.RT.c {inbox} {}\r\n{body}\r\n",
            body.len()
        );
    }
    raw.send(burst.as_bytes()).await;
    let (fields, payload) = raw.read_msg().await;
    assert_eq!(fields[2], "2", "to in.high's subscription: {fields:?}");
    assert_eq!(payload, b"only");
}

// ---------------------------------------------------------------------------
// 6. Pause and resume, reset, replay original
// ---------------------------------------------------------------------------

#[tokio::test]
async fn pause_and_resume() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "P", &["p.>"]).await;
    create_consumer(&client, "P", "c", json!({})).await;
    publish(&client, "p.x", "held").await;
    let resp = api_ok(
        &client,
        &format!("{API}.CONSUMER.PAUSE.P.c"),
        json!({"pause_until": "2099-01-01T01:00:00+01:00"}),
    )
    .await;
    assert_eq!(
        resp["type"],
        "io.nats.jetstream.api.v1.consumer_pause_response"
    );
    assert_eq!(resp["paused"], true);
    assert_eq!(resp["pause_until"], "2099-01-01T00:00:00Z");
    assert!(resp["pause_remaining"].as_i64().unwrap() > 0);
    let i = info(&client, "P", "c").await;
    assert_eq!(i["paused"], true);
    assert!(i["pause_remaining"].as_i64().unwrap() > 0);
    assert_eq!(i["config"]["pause_until"], "2099-01-01T00:00:00Z");
    assert_eq!(i["config"]["metadata"]["_nats.req.level"], "1");
    // Paused: requests wait and time out; no_wait ones get 404.
    let mut sub = pull(&client, "P", "c", json!({"batch": 1, "expires": SEC})).await;
    assert_eq!(status_msg(&mut sub, 408).await, "Request Timeout");
    let mut sub = pull(&client, "P", "c", json!({"batch": 1, "no_wait": true})).await;
    assert_eq!(status_msg(&mut sub, 404).await, "No Messages");
    // An update does not change the pause.
    let resp = create_consumer(&client, "P", "c", json!({"description": "x"})).await;
    assert_eq!(
        resp["config"]["pause_until"], "2099-01-01T00:00:00Z",
        "{resp}"
    );
    // Resume (nats-py sends the epoch). The reference does not wake requests already
    // waiting (Keel does), so only a request made after it is checked.
    let resp = api_ok(
        &client,
        &format!("{API}.CONSUMER.PAUSE.P.c"),
        json!({"pause_until": "1970-01-01T00:00:00Z"}),
    )
    .await;
    assert_eq!(
        resp,
        json!({"type": "io.nats.jetstream.api.v1.consumer_pause_response",
               "paused": false, "pause_until": "1970-01-01T00:00:00Z"})
    );
    let mut sub = pull(&client, "P", "c", json!({"batch": 1, "expires": 10 * SEC})).await;
    assert_eq!(delivery(&mut sub).await, ("held".into(), 1));
    let i = info(&client, "P", "c").await;
    assert!(i.get("paused").is_none(), "{i}");
    // An empty body resumes too; the zero time is shown.
    let resp = api_ok(&client, &format!("{API}.CONSUMER.PAUSE.P.c"), Value::Null).await;
    assert_eq!(resp["pause_until"], "0001-01-01T00:00:00Z");
    let resp = api(
        &client,
        &format!("{API}.CONSUMER.PAUSE.P.ghost"),
        json!({"pause_until": "2099-01-01T00:00:00Z"}),
    )
    .await;
    assert_eq!(api_error(&resp), (404, 10014, "consumer not found".into()));
    assert_eq!(resp["paused"], false);
    assert_eq!(resp["pause_until"], "0001-01-01T00:00:00Z");
    let resp = api(
        &client,
        &format!("{API}.CONSUMER.PAUSE.X.c"),
        json!({"pause_until": "2099-01-01T00:00:00Z"}),
    )
    .await;
    assert_eq!(api_error(&resp), (404, 10059, "stream not found".into()));
}

/// `pause_until` in the create config pauses a push consumer until then.
#[tokio::test]
async fn pause_until_in_config_holds_push_delivery() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "P", &["p.>"]).await;
    publish(&client, "p.x", "one").await;
    let until = chrono_in(2);
    let mut sub = client.subscribe("push.p").await.expect("subscribe");
    let resp = create_consumer(
        &client,
        "P",
        "c",
        json!({"deliver_subject": "push.p", "pause_until": until}),
    )
    .await;
    assert_eq!(resp["paused"], true, "{resp}");
    quiet(&mut sub, Duration::from_millis(800)).await;
    // Delivery starts once the pause is over.
    let m = within("delivery after the pause", sub.next())
        .await
        .unwrap();
    assert_eq!(m.payload, "one");
}

/// RFC 3339 time `secs` from now (UTC).
fn chrono_in(secs: u64) -> String {
    let t = std::time::SystemTime::now() + Duration::from_secs(secs);
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let (days, rem) = (d.div_euclid(86400), d.rem_euclid(86400));
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[tokio::test]
async fn reset_to_ack_floor_and_to_sequence() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "S", &["s.>"]).await;
    create_consumer(&client, "S", "c", json!({})).await;
    for n in 1..=3 {
        publish(&client, "s.x", &format!("m{n}")).await;
    }
    let mut sub = pull(&client, "S", "c", json!({"batch": 2, "expires": 5 * SEC})).await;
    assert_eq!(delivery(&mut sub).await.0, "m1");
    assert_eq!(delivery(&mut sub).await.0, "m2");
    // Back to the ack floor: both unacked messages come again, as first deliveries.
    let resp = api_ok(&client, &format!("{API}.CONSUMER.RESET.S.c"), Value::Null).await;
    assert_eq!(
        resp["type"],
        "io.nats.jetstream.api.v1.consumer_reset_response"
    );
    assert_eq!(resp["reset_seq"], 1);
    assert_eq!(
        resp["delivered"],
        json!({"consumer_seq": 0, "stream_seq": 0})
    );
    assert_eq!(resp["num_ack_pending"], 0);
    assert_eq!(resp["num_pending"], 3);
    let mut sub = pull(&client, "S", "c", json!({"batch": 1, "expires": 5 * SEC})).await;
    assert_eq!(delivery(&mut sub).await, ("m1".into(), 1));
    // To a sequence.
    let resp = api_ok(
        &client,
        &format!("{API}.CONSUMER.RESET.S.c"),
        json!({"seq": 3}),
    )
    .await;
    assert_eq!(resp["reset_seq"], 3);
    assert_eq!(
        resp["ack_floor"],
        json!({"consumer_seq": 0, "stream_seq": 2})
    );
    assert_eq!(resp["num_pending"], 1);
    let mut sub = pull(&client, "S", "c", json!({"batch": 1, "expires": 5 * SEC})).await;
    assert_eq!(delivery(&mut sub).await, ("m3".into(), 1));
    // Deliver policy new: only a reset to the ack floor is allowed.
    create_consumer(&client, "S", "n", json!({"deliver_policy": "new"})).await;
    let resp = api(
        &client,
        &format!("{API}.CONSUMER.RESET.S.n"),
        json!({"seq": 2}),
    )
    .await;
    assert_eq!(
        api_error(&resp),
        (400, 10204, "invalid reset: not allowed".into())
    );
    assert_eq!(resp["reset_seq"], 0);
    // A consumer that does not exist answers nothing at all.
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.unwrap();
    client
        .publish_with_reply(format!("{API}.CONSUMER.RESET.S.ghost"), inbox, Bytes::new())
        .await
        .unwrap();
    quiet(&mut replies, Duration::from_millis(300)).await;
}

/// Replay policy original: stored messages go out as far apart as they were stored.
#[tokio::test]
async fn replay_original_paces_by_stored_timestamps() {
    let (_s, client, _js) = js_setup().await;
    create_stream(&client, "T", &["t.>"]).await;
    for n in 1..=3 {
        publish(&client, "t.x", &n.to_string()).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let resp = create_consumer(&client, "T", "c", json!({"replay_policy": "original"})).await;
    assert!(resp.get("error").is_none(), "{resp}");
    let mut sub = pull(&client, "T", "c", json!({"batch": 3, "expires": 10 * SEC})).await;
    let mut times = vec![];
    for n in 1..=3 {
        assert_eq!(delivery(&mut sub).await.0, n.to_string());
        times.push(Instant::now());
    }
    for w in times.windows(2) {
        let gap = w[1] - w[0];
        assert!(gap >= Duration::from_millis(300), "gap {gap:?}");
    }
}
