//! Core behaviour driven through the async-nats client.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use async_nats::{ConnectOptions, HeaderMap};
use bytes::Bytes;
use common::{expect_no_msg, next_msg, sync, within, Server};
use futures::StreamExt;

#[tokio::test]
async fn pub_sub_round_trip() {
    let server = Server::start();
    let sub_client = server.client().await;
    let pub_client = server.client().await;

    let mut sub = sub_client.subscribe("greet.hello").await.unwrap();
    sync(&sub_client).await;

    for i in 0..10 {
        pub_client
            .publish("greet.hello", format!("msg {i}").into())
            .await
            .unwrap();
    }
    within("flush pub", pub_client.flush()).await.unwrap();

    for i in 0..10 {
        let msg = next_msg(&mut sub).await;
        assert_eq!(msg.subject.as_str(), "greet.hello");
        assert_eq!(msg.payload, Bytes::from(format!("msg {i}")));
        assert!(msg.reply.is_none());
    }
    expect_no_msg(&mut sub).await;
}

#[tokio::test]
async fn empty_payload_delivered() {
    let server = Server::start();
    let client = server.client().await;
    let mut sub = client.subscribe("empty").await.unwrap();
    within("flush", client.flush()).await.unwrap();
    client.publish("empty", Bytes::new()).await.unwrap();
    let msg = next_msg(&mut sub).await;
    assert!(msg.payload.is_empty());
}

/// Publishes `subjects` (payload = subject) and checks which ones `pattern`
/// receives, in order; then checks nothing else arrives.
async fn check_pattern(pattern: &str, publish: &[&str], expected: &[&str]) {
    let server = Server::start();
    let client = server.client().await;
    let mut sub = client.subscribe(pattern.to_string()).await.unwrap();
    sync(&client).await;
    for subject in publish {
        client
            .publish(subject.to_string(), Bytes::from(subject.to_string()))
            .await
            .unwrap();
    }
    within("flush pub", client.flush()).await.unwrap();
    for want in expected {
        let msg = next_msg(&mut sub).await;
        assert_eq!(
            msg.subject.as_str(),
            *want,
            "pattern {pattern}: wrong subject"
        );
        assert_eq!(msg.payload, Bytes::from(want.to_string()));
    }
    expect_no_msg(&mut sub).await;
}

#[tokio::test]
async fn wildcard_star_matches_one_token() {
    check_pattern(
        "foo.*",
        &["foo.a", "foo", "foo.a.b", "bar.a", "foo.b", "foox.a"],
        &["foo.a", "foo.b"],
    )
    .await;
}

#[tokio::test]
async fn wildcard_star_in_middle() {
    check_pattern(
        "a.*.c",
        &["a.b.c", "a.c", "a.b.c.d", "a.x.c", "a.b.d"],
        &["a.b.c", "a.x.c"],
    )
    .await;
}

#[tokio::test]
async fn wildcard_gt_matches_tail() {
    check_pattern(
        "foo.>",
        &["foo.a", "foo", "foo.a.b", "foo.a.b.c", "bar.a", "foox.a"],
        &["foo.a", "foo.a.b", "foo.a.b.c"],
    )
    .await;
}

#[tokio::test]
async fn wildcard_star_and_gt_combined() {
    check_pattern(
        "a.*.>",
        &["a.b", "a.b.c", "a", "a.x.y.z", "b.x.y", "a.b.c.d"],
        &["a.b.c", "a.x.y.z", "a.b.c.d"],
    )
    .await;
}

#[tokio::test]
async fn wildcard_negatives() {
    // `foo.*` must not match `foo.a.b`; `foo.>` must not match `foo`.
    let server = Server::start();
    let client = server.client().await;
    let mut star = client.subscribe("foo.*").await.unwrap();
    let mut tail = client.subscribe("foo.>").await.unwrap();
    within("flush", client.flush()).await.unwrap();
    client.publish("foo.a.b", "x".into()).await.unwrap();
    client.publish("foo", "y".into()).await.unwrap();
    within("flush", client.flush()).await.unwrap();

    let got = next_msg(&mut tail).await;
    assert_eq!(got.subject.as_str(), "foo.a.b");
    expect_no_msg(&mut star).await;
    expect_no_msg(&mut tail).await;
}

#[tokio::test]
async fn overlapping_subscriptions_each_get_a_copy() {
    let server = Server::start();
    let client = server.client().await;
    let mut exact = client.subscribe("x.y").await.unwrap();
    let mut star = client.subscribe("x.*").await.unwrap();
    let mut tail = client.subscribe(">").await.unwrap();
    within("flush", client.flush()).await.unwrap();
    client.publish("x.y", "v".into()).await.unwrap();
    within("flush", client.flush()).await.unwrap();
    for sub in [&mut exact, &mut star, &mut tail] {
        assert_eq!(next_msg(sub).await.payload, Bytes::from("v"));
        expect_no_msg(sub).await;
    }
}

#[tokio::test]
async fn queue_group_distribution() {
    const N: usize = 100;
    let server = Server::start();
    let member1 = server.client().await;
    let member2 = server.client().await;
    let plain = server.client().await;
    let publisher = server.client().await;

    let mut q1 = member1
        .queue_subscribe("work", "workers".into())
        .await
        .unwrap();
    let mut q2 = member2
        .queue_subscribe("work", "workers".into())
        .await
        .unwrap();
    let mut all = plain.subscribe("work").await.unwrap();
    for c in [&member1, &member2, &plain] {
        sync(c).await;
    }

    for i in 0..N {
        publisher
            .publish("work", i.to_string().into())
            .await
            .unwrap();
    }
    within("flush publisher", publisher.flush()).await.unwrap();

    // The plain subscriber sees every message, in order.
    for i in 0..N {
        let msg = next_msg(&mut all).await;
        assert_eq!(msg.payload, Bytes::from(i.to_string()));
    }

    // The plain subscriber got everything, so the server has dispatched all
    // of them; collect the queue members' share until we have N in total.
    let mut seen = HashSet::new();
    let mut got = [0usize; 2];
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.len() < N {
        assert!(Instant::now() < deadline, "queue delivery incomplete");
        tokio::select! {
            Some(m) = q1.next() => {
                got[0] += 1;
                assert!(seen.insert(m.payload.clone()), "duplicate {:?}", m.payload);
            }
            Some(m) = q2.next() => {
                got[1] += 1;
                assert!(seen.insert(m.payload.clone()), "duplicate {:?}", m.payload);
            }
            _ = tokio::time::sleep(Duration::from_secs(5)) => {
                panic!("queue members stalled after {} of {N} messages", seen.len());
            }
        }
    }
    assert_eq!(got[0] + got[1], N);
    assert!(
        got[0] > 0 && got[1] > 0,
        "both members should get some: {got:?}"
    );
    // Exactly once: nothing extra arrives on either member.
    expect_no_msg(&mut q1).await;
    expect_no_msg(&mut q2).await;
}

#[tokio::test]
async fn request_reply() {
    let server = Server::start();
    let responder = server.client().await;
    let requester = server.client().await;

    let mut service = responder.subscribe("svc.echo").await.unwrap();
    sync(&responder).await;

    let handler = tokio::spawn(async move {
        for _ in 0..3 {
            let req = next_msg(&mut service).await;
            let reply = req.reply.expect("request carries a reply subject");
            let mut body = b"echo:".to_vec();
            body.extend_from_slice(&req.payload);
            responder.publish(reply, body.into()).await.unwrap();
        }
        responder.flush().await.unwrap();
    });

    for i in 0..3 {
        let resp = within(
            "request",
            requester.request("svc.echo", format!("r{i}").into()),
        )
        .await
        .unwrap();
        assert_eq!(resp.payload, Bytes::from(format!("echo:r{i}")));
    }
    within("handler", handler).await.unwrap();
}

#[tokio::test]
async fn publish_with_reply_subject_is_delivered() {
    let server = Server::start();
    let client = server.client().await;
    let mut sub = client.subscribe("with.reply").await.unwrap();
    within("flush", client.flush()).await.unwrap();
    client
        .publish_with_reply("with.reply", "reply.to.me", "p".into())
        .await
        .unwrap();
    let msg = next_msg(&mut sub).await;
    assert_eq!(msg.reply.as_ref().map(|s| s.as_str()), Some("reply.to.me"));
    assert_eq!(msg.payload, Bytes::from("p"));
}

#[tokio::test]
async fn headers_round_trip() {
    let server = Server::start();
    let client = server.client().await;
    let mut sub = client.subscribe("hdr").await.unwrap();
    within("flush", client.flush()).await.unwrap();

    let mut headers = HeaderMap::new();
    headers.insert("X-Single", "one");
    headers.append("X-Multi", "first");
    headers.append("X-Multi", "second");
    headers.append("X-Multi", "third");
    client
        .publish_with_headers("hdr", headers, "body".into())
        .await
        .unwrap();

    // Headers with an empty payload too.
    let mut only = HeaderMap::new();
    only.insert("X-Only", "yes");
    client
        .publish_with_headers("hdr", only, Bytes::new())
        .await
        .unwrap();

    let msg = next_msg(&mut sub).await;
    assert_eq!(msg.payload, Bytes::from("body"));
    let h = msg.headers.expect("message has headers");
    assert_eq!(h.get("X-Single").map(|v| v.as_str()), Some("one"));
    let multi: Vec<&str> = h.get_all("X-Multi").map(|v| v.as_str()).collect();
    assert_eq!(multi, ["first", "second", "third"]);

    let msg = next_msg(&mut sub).await;
    assert!(msg.payload.is_empty());
    let h = msg.headers.expect("message has headers");
    assert_eq!(h.get("X-Only").map(|v| v.as_str()), Some("yes"));
}

#[tokio::test]
async fn no_responders() {
    let server = Server::start();
    let client = server.client().await;
    let started = Instant::now();
    let err = within("request", client.request("nobody.home", "?".into()))
        .await
        .expect_err("request without responders must fail");
    assert_eq!(
        err.kind(),
        async_nats::RequestErrorKind::NoResponders,
        "got {err:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no-responders took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn unsubscribe_after_n() {
    const N: u64 = 5;
    let server = Server::start();
    let client = server.client().await;
    let mut sub = client.subscribe("limited").await.unwrap();
    sub.unsubscribe_after(N).await.unwrap();
    within("flush", client.flush()).await.unwrap();

    for i in 0..(2 * N) {
        client
            .publish("limited", i.to_string().into())
            .await
            .unwrap();
    }
    within("flush", client.flush()).await.unwrap();

    for i in 0..N {
        let msg = next_msg(&mut sub).await;
        assert_eq!(msg.payload, Bytes::from(i.to_string()));
    }
    let end = within("stream end", sub.next()).await;
    assert!(
        end.is_none(),
        "stream should end after {N} messages, got {end:?}"
    );
}

#[tokio::test]
async fn unsubscribe_stops_delivery() {
    let server = Server::start();
    let client = server.client().await;
    let publisher = server.client().await;
    let mut gone = client.subscribe("u").await.unwrap();
    let mut kept = client.subscribe("u").await.unwrap();
    gone.unsubscribe().await.unwrap();
    sync(&client).await;
    publisher.publish("u", "after".into()).await.unwrap();
    within("flush", publisher.flush()).await.unwrap();
    assert_eq!(next_msg(&mut kept).await.payload, Bytes::from("after"));
    let end = within("stream end", gone.next()).await;
    assert!(end.is_none(), "unsubscribed stream delivered {end:?}");
}

#[tokio::test]
async fn no_echo() {
    let server = Server::start();
    let quiet = server.client_with(ConnectOptions::new().no_echo()).await;
    let other = server.client().await;

    let mut observer = other.subscribe("echo.test").await.unwrap();
    sync(&other).await;
    // Same connection, so the server handles this SUB before the PUB below.
    let mut own = quiet.subscribe("echo.test").await.unwrap();
    quiet.publish("echo.test", "mine".into()).await.unwrap();

    // Once the other client has it, the server has processed our PUB: an
    // echo, had there been one, would already be queued ahead of "theirs".
    assert_eq!(next_msg(&mut observer).await.payload, Bytes::from("mine"));
    other.publish("echo.test", "theirs".into()).await.unwrap();
    assert_eq!(next_msg(&mut observer).await.payload, Bytes::from("theirs"));

    assert_eq!(next_msg(&mut own).await.payload, Bytes::from("theirs"));
    expect_no_msg(&mut own).await;
}

#[tokio::test]
async fn echo_is_default() {
    let server = Server::start();
    let client = server.client().await;
    let mut sub = client.subscribe("self").await.unwrap();
    within("flush", client.flush()).await.unwrap();
    client.publish("self", "me".into()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, Bytes::from("me"));
}

fn parse_semver(v: &str) -> (u64, u64, u64) {
    let core = v.split(['-', '+']).next().unwrap();
    let parts: Vec<u64> = core
        .split('.')
        .map(|p| {
            p.parse()
                .unwrap_or_else(|_| panic!("bad version component in {v:?}"))
        })
        .collect();
    assert_eq!(parts.len(), 3, "version {v:?} is not major.minor.patch");
    (parts[0], parts[1], parts[2])
}

#[tokio::test]
async fn server_info() {
    let server = Server::start();
    let client = server.client().await;
    let info = client.server_info();
    let version = parse_semver(&info.version);
    assert!(version >= (2, 10, 0), "version {} below 2.10", info.version);
    assert!(info.headers, "headers must be supported");
    assert_eq!(info.proto, 1);
    assert_eq!(info.max_payload, 1024 * 1024, "default max_payload");
    assert!(!info.server_id.is_empty());
    assert_eq!(info.port, server.port());
    assert!(!info.auth_required);
    assert!(!info.tls_required);
    assert_eq!(client.max_payload(), 1024 * 1024);
}

#[tokio::test]
async fn server_info_reflects_configured_max_payload() {
    let server = Server::start_with_config("max_payload: 1024\n");
    let client = server.client().await;
    assert_eq!(client.server_info().max_payload, 1024);
}

#[tokio::test]
async fn flush_round_trip() {
    let server = Server::start();
    let sub_client = server.client().await;
    let publisher = server.client().await;
    // Flush on an idle connection works.
    within("idle flush", publisher.flush()).await.unwrap();

    let mut sub = sub_client.subscribe("f").await.unwrap();
    sync(&sub_client).await;
    for i in 0..1000 {
        publisher.publish("f", i.to_string().into()).await.unwrap();
    }
    // Flush pushes everything buffered client-side out to the server.
    within("flush", publisher.flush()).await.unwrap();
    for i in 0..1000 {
        assert_eq!(next_msg(&mut sub).await.payload, Bytes::from(i.to_string()));
    }
    // Repeated flushes keep working.
    for _ in 0..10 {
        within("repeat flush", publisher.flush()).await.unwrap();
    }
}

#[tokio::test]
async fn max_payload_exact_delivered_and_over_rejected() {
    let server = Server::start_with_config("max_payload: 1024\n");
    let client = server.client().await;
    assert_eq!(client.server_info().max_payload, 1024);

    let mut sub = client.subscribe("big").await.unwrap();
    sync(&client).await;

    let exact = Bytes::from(vec![b'x'; 1024]);
    client.publish("big", exact.clone()).await.unwrap();
    within("flush", client.flush()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, exact);

    // One byte over is refused by the client before it reaches the wire.
    let err = client
        .publish("big", Bytes::from(vec![b'y'; 1025]))
        .await
        .expect_err("oversized publish must fail");
    assert_eq!(err.kind(), async_nats::PublishErrorKind::MaxPayloadExceeded);
    let err = client
        .request("big", Bytes::from(vec![b'y'; 1025]))
        .await
        .expect_err("oversized request must fail");
    assert_eq!(err.kind(), async_nats::RequestErrorKind::MaxPayloadExceeded);

    // The connection is still fine afterwards.
    client.publish("big", "small".into()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, Bytes::from("small"));
    expect_no_msg(&mut sub).await;
}
