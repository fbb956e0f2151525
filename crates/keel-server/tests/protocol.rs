//! Byte-level protocol checks over raw TCP connections.

mod common;

use bytes::Bytes;
use common::{next_msg, sync, within, Closed, Server, STEP};

#[tokio::test]
async fn info_line_on_connect() {
    let server = Server::start();
    let raw = server.raw().await;
    let info = raw.info_json();
    assert_eq!(info["proto"], 1);
    assert_eq!(info["headers"], true);
    assert_eq!(info["max_payload"], 1024 * 1024);
    assert!(info["server_id"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(info["version"].is_string());
}

#[tokio::test]
async fn ping_pong() {
    let server = Server::start();
    let mut raw = server.raw_connected().await;
    raw.send(b"PING\r\n").await;
    assert_eq!(raw.read_op().await, "PONG");
}

#[tokio::test]
async fn raw_pub_sub_and_reply() {
    let server = Server::start();
    let mut raw = server.raw_connected().await;
    raw.send(b"SUB foo 7\r\nPUB foo 5\r\nhello\r\nPUB foo bar 3\r\nabc\r\nPING\r\n")
        .await;
    let (fields, payload) = raw.read_msg().await;
    assert_eq!(fields, ["MSG", "foo", "7", "5"]);
    assert_eq!(payload, b"hello");
    let (fields, payload) = raw.read_msg().await;
    assert_eq!(fields, ["MSG", "foo", "7", "bar", "3"]);
    assert_eq!(payload, b"abc");
    assert_eq!(raw.read_op().await, "PONG");
}

#[tokio::test]
async fn pipelined_ops_answered_in_order() {
    let server = Server::start();
    let mut raw = server.raw().await;

    // Everything in one write: connect, subscribe, publish, ping, unsubscribe,
    // publish again (must not be delivered), wildcard sub, more pings.
    let mut batch = Vec::new();
    batch.extend_from_slice(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1}\r\n");
    batch.extend_from_slice(b"SUB a.b 1\r\n");
    batch.extend_from_slice(b"PUB a.b 3\r\none\r\n");
    batch.extend_from_slice(b"PUB a.b 3\r\ntwo\r\n");
    batch.extend_from_slice(b"PING\r\n");
    batch.extend_from_slice(b"UNSUB 1\r\n");
    batch.extend_from_slice(b"PUB a.b 4\r\nlost\r\n");
    batch.extend_from_slice(b"SUB a.* 2\r\n");
    batch.extend_from_slice(b"PUB a.c 5\r\nthree\r\n");
    batch.extend_from_slice(b"PING\r\n");
    for i in 0..100 {
        let payload = format!("n{i}");
        batch.extend_from_slice(format!("PUB a.n {}\r\n{payload}\r\n", payload.len()).as_bytes());
    }
    batch.extend_from_slice(b"PING\r\n");
    raw.send(&batch).await;

    let (f, p) = raw.read_msg().await;
    assert_eq!(
        (f, p),
        (
            vec!["MSG".into(), "a.b".into(), "1".into(), "3".into()],
            b"one".to_vec()
        )
    );
    let (f, p) = raw.read_msg().await;
    assert_eq!(
        (f, p),
        (
            vec!["MSG".into(), "a.b".into(), "1".into(), "3".into()],
            b"two".to_vec()
        )
    );
    assert_eq!(raw.read_op().await, "PONG");
    let (f, p) = raw.read_msg().await;
    assert_eq!(
        (f, p),
        (
            vec!["MSG".into(), "a.c".into(), "2".into(), "5".into()],
            b"three".to_vec()
        )
    );
    assert_eq!(raw.read_op().await, "PONG");
    for i in 0..100 {
        let (f, p) = raw.read_msg().await;
        assert_eq!(f[1], "a.n");
        assert_eq!(f[2], "2");
        assert_eq!(p, format!("n{i}").into_bytes());
    }
    assert_eq!(raw.read_op().await, "PONG");
    raw.expect_silence().await;
}

#[tokio::test]
async fn pipelined_verbose_acks() {
    let server = Server::start();
    let mut raw = server.raw().await;
    raw.send(
        b"CONNECT {\"verbose\":true,\"pedantic\":false,\"protocol\":1}\r\n\
          SUB v 1\r\n\
          PUB v 2\r\nhi\r\n\
          PING\r\n\
          UNSUB 1\r\n\
          PING\r\n",
    )
    .await;
    assert_eq!(raw.read_op().await, "+OK", "CONNECT ack");
    assert_eq!(raw.read_op().await, "+OK", "SUB ack");
    assert_eq!(raw.read_op().await, "+OK", "PUB ack");
    let (f, p) = raw.read_msg().await;
    assert_eq!(f, ["MSG", "v", "1", "2"]);
    assert_eq!(p, b"hi");
    assert_eq!(raw.read_op().await, "PONG");
    assert_eq!(raw.read_op().await, "+OK", "UNSUB ack");
    assert_eq!(raw.read_op().await, "PONG");
    raw.expect_silence().await;
}

#[tokio::test]
async fn fragmented_writes_reassembled() {
    // The same protocol split at awkward byte boundaries.
    let server = Server::start();
    let mut raw = server.raw_connected().await;
    let whole = b"SUB frag 1\r\nPUB frag 11\r\nhello world\r\nPING\r\n";
    for chunk in whole.chunks(3) {
        raw.send(chunk).await;
        tokio::task::yield_now().await;
    }
    let (f, p) = raw.read_msg().await;
    assert_eq!(f, ["MSG", "frag", "1", "11"]);
    assert_eq!(p, b"hello world");
    assert_eq!(raw.read_op().await, "PONG");
}

#[tokio::test]
async fn raw_hpub_delivered_as_hmsg() {
    let server = Server::start();
    let mut raw = server.raw_connected().await;
    let hdr = "NATS/1.0\r\nA: 1\r\nA: 2\r\n\r\n";
    let body = "payload";
    let total = hdr.len() + body.len();
    let cmd = format!(
        "SUB h 9\r\nHPUB h {} {total}\r\n{hdr}{body}\r\nPING\r\n",
        hdr.len()
    );
    raw.send(cmd.as_bytes()).await;
    let line = raw.read_op().await;
    assert_eq!(line, format!("HMSG h 9 {} {total}", hdr.len()));
    let p = raw.read_payload(total).await;
    assert_eq!(p, format!("{hdr}{body}").into_bytes());
    assert_eq!(raw.read_op().await, "PONG");
}

#[tokio::test]
async fn raw_pub_over_max_payload_closes_connection() {
    let server = Server::start_with_config("max_payload: 1024\n");
    let mut raw = server.raw_connected().await;
    assert_eq!(raw.info_json()["max_payload"], 1024);
    raw.send(b"PUB big 2000\r\n").await;
    assert_eq!(raw.read_op().await, "-ERR 'Maximum Payload Violation'");
    let closed = raw.expect_closed(STEP).await;
    assert!(
        matches!(closed, Closed::Eof | Closed::Error(_)),
        "got {closed:?}"
    );

    // The server is still serving others.
    let client = server.client().await;
    let mut sub = client.subscribe("ok").await.unwrap();
    sync(&client).await;
    client.publish("ok", "fine".into()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, Bytes::from("fine"));
}

#[tokio::test]
async fn raw_pub_at_max_payload_accepted() {
    let server = Server::start_with_config("max_payload: 1024\n");
    let mut raw = server.raw_connected().await;
    let mut cmd = b"SUB big 1\r\nPUB big 1024\r\n".to_vec();
    cmd.extend(std::iter::repeat_n(b'z', 1024));
    cmd.extend_from_slice(b"\r\nPING\r\n");
    raw.send(&cmd).await;
    let (f, p) = raw.read_msg().await;
    assert_eq!(f, ["MSG", "big", "1", "1024"]);
    assert_eq!(p, vec![b'z'; 1024]);
    assert_eq!(raw.read_op().await, "PONG");
}

#[tokio::test]
async fn garbage_gets_unknown_protocol_error_and_close() {
    let server = Server::start();
    let client = server.client().await;
    let mut sub = client.subscribe("alive").await.unwrap();
    sync(&client).await;

    let mut raw = server.raw_connected().await;
    raw.send(b"FOO bar\r\n").await;
    assert_eq!(raw.read_op().await, "-ERR 'Unknown Protocol Operation'");
    let closed = raw.expect_closed(STEP).await;
    assert!(
        matches!(closed, Closed::Eof | Closed::Error(_)),
        "got {closed:?}"
    );

    // The well-behaved client is unaffected.
    client.publish("alive", "still here".into()).await.unwrap();
    within("flush", client.flush()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, Bytes::from("still here"));
    let other = server.client().await;
    other.publish("alive", "new client".into()).await.unwrap();
    within("flush", other.flush()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, Bytes::from("new client"));
}

#[tokio::test]
async fn garbage_before_connect_gets_error() {
    let server = Server::start();
    let mut raw = server.raw().await;
    raw.send(b"FOO bar\r\n").await;
    assert_eq!(raw.read_op().await, "-ERR 'Unknown Protocol Operation'");
    raw.expect_closed(STEP).await;
}

#[tokio::test]
async fn lowercase_ops_accepted() {
    let server = Server::start();
    let mut raw = server.raw().await;
    raw.send(b"connect {\"verbose\":false}\r\nsub lc 1\r\npub lc 2\r\nok\r\nping\r\n")
        .await;
    let (f, p) = raw.read_msg().await;
    assert_eq!(f, ["MSG", "lc", "1", "2"]);
    assert_eq!(p, b"ok");
    assert_eq!(raw.read_op().await, "PONG");
}

#[tokio::test]
async fn raw_queue_subscription_and_unsub_max() {
    let server = Server::start();
    let mut raw = server.raw_connected().await;
    // Auto-unsubscribe after 2 messages.
    raw.send(
        b"SUB q grp 5\r\nUNSUB 5 2\r\nPUB q 1\r\na\r\nPUB q 1\r\nb\r\nPUB q 1\r\nc\r\nPING\r\n",
    )
    .await;
    let (f, p) = raw.read_msg().await;
    assert_eq!((f[2].as_str(), p.as_slice()), ("5", b"a".as_slice()));
    let (f, p) = raw.read_msg().await;
    assert_eq!((f[2].as_str(), p.as_slice()), ("5", b"b".as_slice()));
    assert_eq!(raw.read_op().await, "PONG");
    raw.expect_silence().await;
}

/// `-V` traces the protocol as the reference does: each op from the client (`<<- [PUB foo
/// bar 5]`, its payload Go-quoted), each answer (`->> [MSG foo 7 bar 5]`, `->> [PONG]`),
/// with the client's version, language and name once its CONNECT gave them; CONNECT's
/// password never reaches the log; the subscription going at the close is traced too.
#[tokio::test]
async fn trace_flag_logs_the_protocol_without_secrets() {
    let server = Server::start_with_config_and_args(
        "authorization { user: tracer, password: \"s3cret-pw\" }",
        &["-V"],
    );
    let mut raw = server.raw().await;
    raw.send(
        b"CONNECT {\"verbose\":false,\"user\":\"tracer\",\"pass\":\"s3cret-pw\",\"lang\":\"raw\",\"version\":\"9.9\",\"name\":\"tr\"}\r\n\
          SUB foo 7\r\nPUB foo bar 6\r\nhel\"lo\r\nPING\r\n",
    )
    .await;
    let (fields, payload) = raw.read_msg().await;
    assert_eq!(fields, ["MSG", "foo", "7", "bar", "6"]);
    assert_eq!(payload, b"hel\"lo");
    assert_eq!(raw.read_op().await, "PONG");
    for line in [
        "<<- [CONNECT {",
        "<<- [SUB foo 7]",
        "<<- [PUB foo bar 6]",
        "<<- MSG_PAYLOAD: [\"hel\\\"lo\"]",
        "->> [MSG foo 7 bar 6]",
        "->> MSG_PAYLOAD: [\"hel\\\"lo\"]",
        "<<- [PING]",
        "->> [PONG]",
    ] {
        server.wait_log_count(line, 1);
    }
    let log = server.full_log();
    let sub = log.lines().find(|l| l.contains("<<- [SUB foo 7]")).unwrap();
    assert!(
        sub.contains("[TRC]") && sub.contains("\"v9.9:raw:tr\""),
        "{sub}"
    );
    let connect = log.lines().find(|l| l.contains("<<- [CONNECT")).unwrap();
    assert!(connect.contains("[REDACTED]"), "{connect}");
    assert!(
        !log.contains("s3cret-pw"),
        "the password was logged:\n{log}"
    );
    // A closing connection's subscriptions go: `<-> [DELSUB 7]`.
    drop(raw);
    server.wait_log_count("<-> [DELSUB 7]", 1);
}

/// A config reload turns tracing on and sets `max_traced_msg_len` at once, each change
/// logged as the reference logs it (`Reloaded: trace = true`).
#[tokio::test]
async fn reload_turns_trace_on() {
    let server = Server::start_with_config("debug: false");
    server.reload_config("trace: true\nmax_traced_msg_len: 3");
    server.wait_log_count("Reloaded: trace = true", 1);
    server.wait_log_count("Reloaded: max_traced_msg_len = 3", 1);
    let mut raw = server.raw_connected().await;
    raw.send(b"SUB r 1\r\nPUB r 5\r\nabcde\r\nPING\r\n").await;
    assert_eq!(raw.read_msg().await.1, b"abcde");
    assert_eq!(raw.read_op().await, "PONG");
    server.wait_log_count("<<- [PUB r 5]", 1);
    server.wait_log_count("<<- MSG_PAYLOAD: [\"abc...\"]", 1);
}

/// `max_traced_msg_len` cuts traced payloads, both ways, as the reference does: the first
/// that many bytes, Go-quoted, then `...`; a payload that fits is shown whole.
#[tokio::test]
async fn max_traced_msg_len_cuts_traced_payloads() {
    let server = Server::start_with_config_and_args("max_traced_msg_len: 5", &["-V"]);
    let mut raw = server.raw_connected().await;
    raw.send(b"SUB foo 1\r\nPUB foo 11\r\nh\"\x01llo wxyz\r\nPUB foo 5\r\nabcde\r\nPING\r\n")
        .await;
    assert_eq!(raw.read_msg().await.1, b"h\"\x01llo wxyz");
    assert_eq!(raw.read_msg().await.1, b"abcde");
    assert_eq!(raw.read_op().await, "PONG");
    for line in [
        "<<- MSG_PAYLOAD: [\"h\\\"\\x01ll...\"]",
        "->> MSG_PAYLOAD: [\"h\\\"\\x01ll...\"]",
        "<<- MSG_PAYLOAD: [\"abcde\"]",
        "->> MSG_PAYLOAD: [\"abcde\"]",
    ] {
        server.wait_log_count(line, 1);
    }
}
