//! Authentication, authorization, accounts, the system account and reload, driven with
//! async-nats and raw sockets. Every expectation also holds against the reference
//! (`KEEL_TEST_REFERENCE=1`). Keys, JWTs and bcrypt hashes are made here, by the test.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use bytes::Bytes;
use common::*;
use serde_json::{json, Value};

const ALICE_BOB: &str = r#"
authorization {
  users = [
    {user: alice, password: s3cret}
    {user: bob, password: pw, permissions: {publish: {allow: ["bob.>"]}, subscribe: {allow: ["bob.>", "_INBOX.>"]}}}
  ]
  timeout: 1
}
"#;

fn user(u: &str, p: &str) -> async_nats::ConnectOptions {
    async_nats::ConnectOptions::with_user_and_password(u.into(), p.into())
}

/// The error kind a connect attempt with `opts` fails with.
async fn connect_error(
    server: &Server,
    opts: async_nats::ConnectOptions,
) -> async_nats::ConnectErrorKind {
    match within("connect", opts.connect(server.url())).await {
        Ok(_) => panic!("connect succeeded"),
        Err(e) => e.kind(),
    }
}

async fn raw_connect(server: &Server, fields: &str) -> RawClient {
    let mut raw = server.raw().await;
    raw.send(format!("CONNECT {{\"verbose\":false,\"pedantic\":false,\"protocol\":1,\"headers\":true{fields}}}\r\nPING\r\n").as_bytes())
        .await;
    raw
}

/// Reads until PONG (answering PINGs, skipping INFOs).
async fn pong(raw: &mut RawClient) {
    assert_eq!(raw.read_op().await, "PONG");
}

#[tokio::test]
async fn wrong_password_is_refused_and_closed() {
    let server = Server::start_with_config(ALICE_BOB);
    let mut raw = server.raw().await;
    let info = raw.info_json();
    assert_eq!(info["auth_required"], true);
    // The reference's field order: auth_required right after headers.
    let keys: Vec<&str> = info
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let pos = |k: &str| keys.iter().position(|x| *x == k).unwrap();
    assert_eq!(pos("auth_required"), pos("headers") + 1, "{keys:?}");
    assert!(info.get("nonce").is_none(), "no nkey users: no nonce");
    raw.send(b"CONNECT {\"verbose\":false,\"user\":\"alice\",\"pass\":\"nope\",\"protocol\":1}\r\nPING\r\n")
        .await;
    assert_eq!(raw.read_line().await, "-ERR 'Authorization Violation'");
    raw.expect_closed(STEP).await;
    assert!(
        !server.log().contains("nope"),
        "the password is never logged"
    );

    assert_eq!(
        connect_error(&server, user("alice", "bad")).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );
    assert_eq!(
        connect_error(&server, async_nats::ConnectOptions::new()).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );
    let nc = server.client_with(user("alice", "s3cret")).await;
    let mut sub = nc.subscribe("x").await.unwrap();
    nc.publish("x", "hi".into()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, "hi");

    // Anything before CONNECT is a violation when auth is required.
    let mut raw = server.raw().await;
    raw.send(b"PUB foo 2\r\nhi\r\n").await;
    assert_eq!(raw.read_line().await, "-ERR 'Authorization Violation'");
    raw.expect_closed(STEP).await;
}

#[tokio::test]
async fn no_connect_within_the_timeout() {
    let server = Server::start_with_config(ALICE_BOB);
    let mut raw = server.raw().await;
    let line = raw.try_read_line(Duration::from_secs(5)).await;
    assert_eq!(line.as_deref(), Some("-ERR 'Authentication Timeout'"));
    raw.expect_closed(STEP).await;
}

#[tokio::test]
async fn bcrypt_password_and_token() {
    let hash = bcrypt::hash("s3cret", 4).unwrap();
    let server = Server::start_with_config(&format!(
        "authorization {{ users: [{{user: alice, password: \"{hash}\"}}] }}"
    ));
    server.client_with(user("alice", "s3cret")).await;
    assert_eq!(
        connect_error(&server, user("alice", &hash)).await,
        async_nats::ConnectErrorKind::AuthorizationViolation,
        "the hash itself is not the password"
    );

    let server = Server::start_with_args(&["--auth", "t0ken"]);
    assert_eq!(server.raw().await.info_json()["auth_required"], true);
    server
        .client_with(async_nats::ConnectOptions::with_token("t0ken".into()))
        .await;
    assert_eq!(
        connect_error(
            &server,
            async_nats::ConnectOptions::with_token("other".into())
        )
        .await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );

    let server = Server::start_with_args(&["--user", "u", "--pass", "p"]);
    server.client_with(user("u", "p")).await;
    assert_eq!(
        connect_error(&server, user("u", "q")).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );
}

/// async-nats sends every credential it was given in one CONNECT (its own suite's
/// `multiple_auth_methods`); a server looks only at the kind it has configured.
#[tokio::test]
async fn credentials_of_other_kinds_beside_the_right_one_are_ignored() {
    let all = |token: &str| {
        format!(r#","user":"js","pass":"js","auth_token":"{token}","jwt":"a.b.c","sig":"c2ln""#)
    };
    let server = Server::start_with_config("authorization { token: s3cr3t }");
    pong(&mut raw_connect(&server, &all("s3cr3t")).await).await;
    let mut raw = raw_connect(&server, &all("other")).await;
    assert_eq!(raw.read_op().await, "-ERR 'Authorization Violation'");

    let server = Server::start_with_config(ALICE_BOB);
    let both = r#","user":"bob","pass":"pw","auth_token":"t","jwt":"a.b.c","sig":"c2ln""#;
    pong(&mut raw_connect(&server, both).await).await;

    let server = Server::start();
    pong(&mut raw_connect(&server, &all("x")).await).await;
}

#[tokio::test]
async fn nkey_users_sign_the_nonce() {
    let kp = nkeys::KeyPair::new_user();
    let server = Server::start_with_config(&format!(
        "authorization {{ users: [{{nkey: {}, permissions: {{publish: \"ok.>\"}}}}] }}",
        kp.public_key()
    ));
    let raw = server.raw().await;
    let info = raw.info_json();
    let keys: Vec<&str> = info
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let pos = |k: &str| keys.iter().position(|x| *x == k).unwrap();
    assert_eq!(pos("nonce"), pos("client_ip") + 1, "{keys:?}");
    let nonce = info["nonce"].as_str().unwrap().to_string();
    drop(raw);

    let nc = server
        .client_with(async_nats::ConnectOptions::with_nkey(kp.seed().unwrap()))
        .await;
    nc.flush().await.unwrap();
    let other = nkeys::KeyPair::new_user();
    assert_eq!(
        connect_error(
            &server,
            async_nats::ConnectOptions::with_nkey(other.seed().unwrap())
        )
        .await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );
    // A signature of another nonce does not do.
    let sig = URL_SAFE_NO_PAD.encode(kp.sign(nonce.as_bytes()).unwrap());
    let mut raw = raw_connect(
        &server,
        &format!(",\"nkey\":\"{}\",\"sig\":\"{sig}\"", kp.public_key()),
    )
    .await;
    assert_eq!(raw.read_line().await, "-ERR 'Authorization Violation'");
}

#[tokio::test]
async fn denied_publish_and_subscribe_keep_the_connection() {
    let server = Server::start_with_config(ALICE_BOB);
    let mut raw = raw_connect(&server, ",\"user\":\"bob\",\"pass\":\"pw\"").await;
    pong(&mut raw).await;
    raw.send(b"PUB alice.x 2\r\nhi\r\n").await;
    assert_eq!(
        raw.read_op().await,
        "-ERR 'Permissions Violation for Publish to \"alice.x\"'"
    );
    raw.send(b"SUB alice.> 1\r\n").await;
    assert_eq!(
        raw.read_op().await,
        "-ERR 'Permissions Violation for Subscription to \"alice.>\"'"
    );
    raw.send(b"SUB bob.> 2\r\nPUB bob.x 2\r\nhi\r\nPING\r\n")
        .await;
    let (fields, payload) = raw.read_msg().await;
    assert_eq!(
        (fields[1].as_str(), payload.as_slice()),
        ("bob.x", &b"hi"[..])
    );
    pong(&mut raw).await;

    // The same with async-nats: the denied message goes nowhere, the client stays up.
    let alice = server.client_with(user("alice", "s3cret")).await;
    let mut seen = alice.subscribe("alice.>").await.unwrap();
    alice.flush().await.unwrap();
    let bob = server.client_with(user("bob", "pw")).await;
    bob.publish("alice.y", "no".into()).await.unwrap();
    bob.publish("bob.ok", "yes".into()).await.unwrap();
    bob.flush().await.unwrap();
    expect_no_msg(&mut seen).await;
    assert_eq!(
        bob.connection_state(),
        async_nats::connection::State::Connected
    );
}

#[tokio::test]
async fn deny_rules_apply_at_delivery_and_to_queues() {
    let server = Server::start_with_config(
        r#"authorization { users = [
             {user: a, password: a}
             {user: w, password: w, permissions: {subscribe: {allow: ["jobs.> workers", "feed.>"], deny: ["feed.secret"]}}}
           ] }"#,
    );
    let mut raw = raw_connect(&server, ",\"user\":\"w\",\"pass\":\"w\"").await;
    pong(&mut raw).await;
    // Only the named queue group may take jobs.
    raw.send(b"SUB jobs.1 1\r\n").await;
    assert_eq!(
        raw.read_op().await,
        "-ERR 'Permissions Violation for Subscription to \"jobs.1\"'"
    );
    raw.send(b"SUB jobs.1 others 2\r\n").await;
    assert_eq!(
        raw.read_op().await,
        "-ERR 'Permissions Violation for Subscription to \"jobs.1\" using queue \"others\"'"
    );
    raw.send(b"SUB jobs.1 workers 3\r\nSUB feed.> 4\r\nPING\r\n")
        .await;
    pong(&mut raw).await;
    let a = server.client_with(user("a", "a")).await;
    for s in ["feed.secret", "feed.public", "jobs.1"] {
        a.publish(s, "x".into()).await.unwrap();
    }
    a.flush().await.unwrap();
    // feed.secret matches the allowed `feed.>` but is denied: it is not delivered.
    let (f1, _) = raw.read_msg().await;
    let (f2, _) = raw.read_msg().await;
    assert_eq!((f1[1].as_str(), f2[1].as_str()), ("feed.public", "jobs.1"));
    raw.expect_silence().await;
}

#[tokio::test]
async fn allow_responses_lets_a_service_reply_once() {
    let server = Server::start_with_config(
        r#"authorization { users = [
             {user: client, password: c}
             {user: svc, password: s, permissions: {subscribe: "help", allow_responses: true}}
           ] }"#,
    );
    let svc = server.client_with(user("svc", "s")).await;
    let mut reqs = svc.subscribe("help").await.unwrap();
    svc.flush().await.unwrap();
    let client = server.client_with(user("client", "c")).await;
    let ask = tokio::spawn({
        let client = client.clone();
        async move { client.request("help", "?".into()).await }
    });
    let req = next_msg(&mut reqs).await;
    let reply = req.reply.clone().unwrap();
    svc.publish(reply.clone(), "answer".into()).await.unwrap();
    // A second response to the same request is not allowed (max 1).
    svc.publish(reply, "again".into()).await.unwrap();
    svc.flush().await.unwrap();
    let got = within("reply", ask).await.unwrap().unwrap();
    assert_eq!(got.payload, "answer");
    // Anything else is denied: publishing is only for responses.
    let mut raw = raw_connect(&server, ",\"user\":\"svc\",\"pass\":\"s\"").await;
    pong(&mut raw).await;
    raw.send(b"PUB elsewhere 1\r\nx\r\n").await;
    assert_eq!(
        raw.read_op().await,
        "-ERR 'Permissions Violation for Publish to \"elsewhere\"'"
    );
}

/// The seed's scenario: `admin` creates stream ORDERS and consumer order-worker; `worker`
/// may only pull from and ack that consumer.
#[tokio::test]
async fn worker_may_only_pull_and_ack_its_consumer() {
    let server = Server::start_jetstream_with_config(
        r#"authorization { users = [
             {user: admin, password: a}
             {user: worker, password: w, permissions: {
                publish: {allow: ["$JS.API.CONSUMER.MSG.NEXT.ORDERS.order-worker", "$JS.ACK.ORDERS.order-worker.>"]}
                subscribe: {allow: ["_INBOX.>"]}
             }}
           ] }"#,
    );
    let admin = server.client_with(user("admin", "a")).await;
    let js = async_nats::jetstream::new(admin.clone());
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec!["orders.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("order-worker".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("other".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    js.publish("orders.1", "o1".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let mut w = raw_connect(&server, ",\"user\":\"worker\",\"pass\":\"w\"").await;
    pong(&mut w).await;
    w.send(b"SUB _INBOX.w 1\r\nPUB $JS.API.CONSUMER.MSG.NEXT.ORDERS.order-worker _INBOX.w 11\r\n{\"batch\":1}\r\n")
        .await;
    let (fields, payload) = w.read_msg().await;
    assert_eq!(payload, b"o1");
    let ack = fields[3].clone();
    assert!(ack.starts_with("$JS.ACK.ORDERS.order-worker."), "{ack}");
    w.send(format!("PUB {ack} 0\r\n\r\nPING\r\n").as_bytes())
        .await;
    pong(&mut w).await;
    for denied in [
        "$JS.API.STREAM.DELETE.ORDERS",
        "$JS.API.CONSUMER.MSG.NEXT.ORDERS.other",
        "$JS.API.CONSUMER.DELETE.ORDERS.order-worker",
    ] {
        w.send(format!("PUB {denied} _INBOX.w 0\r\n\r\n").as_bytes())
            .await;
        assert_eq!(
            w.read_op().await,
            format!("-ERR 'Permissions Violation for Publish to \"{denied}\"'")
        );
    }
    w.send(b"SUB orders.> 2\r\n").await;
    assert_eq!(
        w.read_op().await,
        "-ERR 'Permissions Violation for Subscription to \"orders.>\"'"
    );
    // The stream is still there, and the worker's ack counted.
    let mut stream = js.get_stream("ORDERS").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    let mut c: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("order-worker").await.unwrap();
    let deadline = std::time::Instant::now() + STEP;
    loop {
        let info = c.info().await.unwrap();
        if info.ack_floor.stream_sequence == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ack not counted: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const ACCOUNTS: &str = r#"
accounts {
  A: {
    users: [{user: a, password: a}]
    exports: [
      {stream: "events.>"}
      {service: "help.>", accounts: [B]}
    ]
  }
  B: {
    users: [{user: b, password: b}]
    imports: [
      {stream: {account: A, subject: "events.>"}, prefix: "from_a"}
      {service: {account: A, subject: "help.>"}, to: "a.help.>"}
    ]
  }
  C: { users: [{user: c, password: c}] }
}
"#;

#[tokio::test]
async fn accounts_are_isolated() {
    let server = Server::start_with_config(ACCOUNTS);
    let a = server.client_with(user("a", "a")).await;
    let c = server.client_with(user("c", "c")).await;
    sync(&a).await;
    sync(&c).await;
    let mut in_a = a.subscribe("shared").await.unwrap();
    let mut in_c = c.subscribe("shared").await.unwrap();
    a.flush().await.unwrap();
    c.flush().await.unwrap();
    c.publish("shared", "from c".into()).await.unwrap();
    c.flush().await.unwrap();
    assert_eq!(next_msg(&mut in_c).await.payload, "from c");
    expect_no_msg(&mut in_a).await;
    // The second INFO names the account.
    let mut raw = raw_connect(&server, ",\"user\":\"c\",\"pass\":\"c\"").await;
    pong(&mut raw).await;
    raw.send(b"PING\r\n").await;
    pong(&mut raw).await;
    let info: Value =
        serde_json::from_str(raw.async_infos[0].trim_start_matches("INFO ").trim()).unwrap();
    assert_eq!(info["remote_account"], "C");
    assert!(info.get("acc_is_sys").is_none());
}

#[tokio::test]
async fn stream_and_service_cross_accounts() {
    let server = Server::start_with_config(ACCOUNTS);
    let a = server.client_with(user("a", "a")).await;
    let b = server.client_with(user("b", "b")).await;
    let c = server.client_with(user("c", "c")).await;
    // async-nats may hand out a client before its handshake is done: a round trip first.
    for nc in [&a, &b, &c] {
        sync(nc).await;
    }
    // Stream: A's events reach B under the prefix, and not C.
    let mut b_events = b.subscribe("from_a.events.>").await.unwrap();
    let mut c_events = c.subscribe("events.>").await.unwrap();
    sync(&b).await;
    sync(&c).await;
    a.publish("events.created", "e1".into()).await.unwrap();
    a.flush().await.unwrap();
    let m = next_msg(&mut b_events).await;
    assert_eq!(
        (m.subject.as_str(), &m.payload[..]),
        ("from_a.events.created", &b"e1"[..])
    );
    // Service: B asks on its own subject, A answers; the reply finds its way back.
    let mut svc = a.subscribe("help.>").await.unwrap();
    sync(&a).await;
    let responder = tokio::spawn(async move {
        let req = next_msg(&mut svc).await;
        let subject = req.subject.to_string();
        a.publish(
            req.reply.unwrap(),
            Bytes::from(format!("answer to {subject}")),
        )
        .await
        .unwrap();
        a.flush().await.unwrap();
        a
    });
    let resp = within("service reply", b.request("a.help.me", "?".into()))
        .await
        .unwrap();
    assert_eq!(resp.payload, "answer to help.me");
    let _a = responder.await.unwrap();
    // C imports nothing: no responders there, and it saw nothing of A's.
    assert!(c.request("a.help.me", "?".into()).await.is_err());
    expect_no_msg(&mut c_events).await;
}

#[tokio::test]
async fn import_of_what_is_not_exported_is_refused() {
    let dir = TempDir::new("keel-auth-bad");
    let p = dir.path().join("bad.conf");
    std::fs::write(
        &p,
        "accounts { A: { users: [{user: a, password: a}] }\n B: { imports: [{service: {account: A, subject: nope}}] } }",
    )
    .unwrap();
    let (code, out) = Server::run_to_exit(&["-c".into(), p.display().to_string()]);
    assert_ne!(code, Some(0), "{out}");
}

#[tokio::test]
async fn no_auth_user_lands_in_its_account() {
    let server = Server::start_with_config(&format!("{ACCOUNTS}\nno_auth_user: c\n"));
    let anon = server.client().await;
    let c = server.client_with(user("c", "c")).await;
    let mut sub = c.subscribe("x").await.unwrap();
    c.flush().await.unwrap();
    // async-nats may hand out the client before its handshake is done: a round trip first.
    sync(&anon).await;
    anon.publish("x", "anon".into()).await.unwrap();
    anon.flush().await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, "anon");
    // Wrong credentials are still refused.
    assert_eq!(
        connect_error(&server, user("c", "bad")).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );
}

const SYSTEM: &str = r#"
accounts {
  SYS: { users: [{user: sys, password: sys}] }
  A: { users: [{user: a, password: a}] }
}
system_account: SYS
"#;

async fn sys_request(nc: &async_nats::Client, subject: &str, body: &str) -> Value {
    let m = within(
        subject,
        nc.request(subject.to_string(), body.to_string().into()),
    )
    .await
    .unwrap_or_else(|e| panic!("{subject}: {e}"));
    serde_json::from_slice(&m.payload).unwrap()
}

#[tokio::test]
async fn system_account_requests() {
    let server = Server::start_with_config(SYSTEM);
    let sys = server.client_with(user("sys", "sys")).await;
    let a = server.client_with(user("a", "a")).await;
    let _sub = a.subscribe("foo").await.unwrap();
    a.flush().await.unwrap();

    let ping = sys_request(&sys, "$SYS.REQ.SERVER.PING", "").await;
    let id = ping["server"]["id"].as_str().unwrap().to_string();
    for k in [
        "name",
        "host",
        "id",
        "ver",
        "jetstream",
        "flags",
        "seq",
        "time",
    ] {
        assert!(ping["server"].get(k).is_some(), "server.{k}: {ping}");
    }
    for k in [
        "start",
        "mem",
        "cores",
        "connections",
        "total_connections",
        "subscriptions",
        "sent",
        "received",
    ] {
        assert!(ping["statsz"].get(k).is_some(), "statsz.{k}: {ping}");
    }
    assert_eq!(ping["statsz"]["connections"], 2);
    let varz = sys_request(&sys, &format!("$SYS.REQ.SERVER.{id}.VARZ"), "").await;
    assert_eq!(varz["data"]["server_id"], id.as_str());
    assert_eq!(varz["data"]["system_account"], "SYS");
    let connz = sys_request(&sys, "$SYS.REQ.SERVER.PING.CONNZ", r#"{"auth":true}"#).await;
    let conns = connz["data"]["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 2);
    assert!(
        conns
            .iter()
            .any(|c| c["authorized_user"] == "a" && c["account"] == "A"),
        "{connz}"
    );
    let health = sys_request(&sys, "$SYS.REQ.SERVER.PING.HEALTHZ", "").await;
    assert_eq!(health["data"]["status"], "ok");
    let accz = sys_request(&sys, "$SYS.REQ.SERVER.PING.ACCOUNTZ", "").await;
    let names = accz["data"]["accounts"].as_array().unwrap();
    assert!(
        names.contains(&json!("A")) && names.contains(&json!("SYS")),
        "{accz}"
    );
    let info = sys_request(&sys, "$SYS.REQ.ACCOUNT.A.INFO", "").await;
    assert_eq!(info["data"]["account_name"], "A");
    assert_eq!(info["data"]["client_connections"], 1);
    let statz = sys_request(&sys, "$SYS.REQ.ACCOUNT.PING.STATZ", "").await;
    let list = statz["data"]["account_statz"].as_array().unwrap();
    assert!(
        list.iter().any(|s| s["acc"] == "A" && s["conns"] == 1),
        "{statz}"
    );
    let nope = sys_request(&sys, "$SYS.REQ.ACCOUNT.NOPE.INFO", "").await;
    assert_eq!(nope["error"]["description"], "Account NOPE does not exist");
    let filtered = sys.request(
        "$SYS.REQ.SERVER.PING.VARZ",
        r#"{"server_name":"not-this-one"}"#.into(),
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(500), filtered)
            .await
            .map_or(true, |r| r.is_err()),
        "a server the filter does not name stays silent"
    );
    let me = sys_request(&sys, "$SYS.REQ.USER.INFO", "").await;
    assert_eq!(
        (me["data"]["user"].clone(), me["data"]["account"].clone()),
        (json!("sys"), json!("SYS"))
    );

    // Another account asks about itself through the system account's imports.
    let me = sys_request(&a, "$SYS.REQ.USER.INFO", "").await;
    assert_eq!(
        (me["data"]["user"].clone(), me["data"]["account"].clone()),
        (json!("a"), json!("A"))
    );
    let mine = sys_request(&a, "$SYS.REQ.SERVER.PING.CONNZ", "").await;
    assert_eq!(mine["data"]["num_connections"], 1, "{mine}");
    // ... and nothing else of the system account's.
    assert!(a.request("$SYS.REQ.SERVER.PING", "".into()).await.is_err());
}

#[tokio::test]
async fn connect_and_disconnect_events() {
    let server = Server::start_with_config(SYSTEM);
    let sys = server.client_with(user("sys", "sys")).await;
    let mut events = sys.subscribe("$SYS.ACCOUNT.A.>").await.unwrap();
    sys.flush().await.unwrap();
    let a = server.client_with(user("a", "a").name("events-test")).await;
    a.flush().await.unwrap();
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|(s, _): &(String, Value)| s.ends_with(".CONNECT"))
    {
        let m = next_msg(&mut events).await;
        seen.push((
            m.subject.to_string(),
            serde_json::from_slice(&m.payload).unwrap(),
        ));
    }
    let connect = &seen
        .iter()
        .find(|(s, _)| s == "$SYS.ACCOUNT.A.CONNECT")
        .unwrap()
        .1;
    assert_eq!(connect["type"], "io.nats.server.advisory.v1.client_connect");
    assert_eq!(connect["client"]["user"], "a");
    assert_eq!(connect["client"]["acc"], "A");
    assert_eq!(connect["client"]["name"], "events-test");
    drop(a);
    loop {
        let m = next_msg(&mut events).await;
        if m.subject.as_str() == "$SYS.ACCOUNT.A.DISCONNECT" {
            let d: Value = serde_json::from_slice(&m.payload).unwrap();
            assert_eq!(d["type"], "io.nats.server.advisory.v1.client_disconnect");
            assert_eq!(d["reason"], "Client Closed");
            break;
        }
    }
}

// ---------------------------------------------------------------------------
// Decentralized auth: operator, account and user JWTs made and signed here.
// ---------------------------------------------------------------------------

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn jwt(signer: &nkeys::KeyPair, claims: Value) -> String {
    let h = URL_SAFE_NO_PAD.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let mut claims = claims;
    claims["jti"] = json!(format!("{:x}", rand_u64()));
    claims["iat"] = json!(now() - 10);
    let c = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap());
    let sig = signer.sign(format!("{h}.{c}").as_bytes()).unwrap();
    format!("{h}.{c}.{}", URL_SAFE_NO_PAD.encode(sig))
}

fn rand_u64() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn creds(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
}

struct Operator {
    conf: String,
    account: nkeys::KeyPair,
}

fn operator_setup() -> Operator {
    let op = nkeys::KeyPair::new_operator();
    let acc = nkeys::KeyPair::new_account();
    let sys = nkeys::KeyPair::new_account();
    let op_jwt = jwt(
        &op,
        json!({"iss": op.public_key(), "sub": op.public_key(), "name": "OP",
        "nats": {"type": "operator", "version": 2, "system_account": sys.public_key()}}),
    );
    let account_jwt = |kp: &nkeys::KeyPair, name: &str| {
        jwt(
            &op,
            json!({"iss": op.public_key(), "sub": kp.public_key(), "name": name,
            "nats": {"type": "account", "version": 2,
                     "limits": {"subs": -1, "conn": -1, "leaf": -1, "imports": -1, "exports": -1,
                                "data": -1, "payload": -1, "wildcards": true}}}),
        )
    };
    let conf = format!(
        "operator: {op_jwt}\nsystem_account: {sys}\nresolver: MEMORY\nresolver_preload {{\n  {acc}: {acc_jwt}\n  {sys}: {sys_jwt}\n}}\n",
        sys = sys.public_key(),
        acc = acc.public_key(),
        acc_jwt = account_jwt(&acc, "APP"),
        sys_jwt = account_jwt(&sys, "SYS"),
    );
    Operator { conf, account: acc }
}

fn user_jwt(acc: &nkeys::KeyPair, user: &nkeys::KeyPair, exp: Option<i64>, nats: Value) -> String {
    let mut claims = json!({"iss": acc.public_key(), "sub": user.public_key(), "name": "u",
        "nats": nats});
    claims["nats"]["type"] = json!("user");
    claims["nats"]["version"] = json!(2);
    // As nsc writes them: no limits unless asked.
    for k in ["subs", "data", "payload"] {
        if claims["nats"].get(k).is_none() {
            claims["nats"][k] = json!(-1);
        }
    }
    if let Some(e) = exp {
        claims["exp"] = json!(e);
    }
    jwt(acc, claims)
}

#[tokio::test]
async fn creds_and_jwt_users() {
    let op = operator_setup();
    let server = Server::start_with_config(&op.conf);
    let info = server.raw().await.info_json();
    assert_eq!(info["auth_required"], true);
    assert!(info["nonce"].is_string());

    let u = nkeys::KeyPair::new_user();
    let token = user_jwt(
        &op.account,
        &u,
        Some(now() + 3600),
        json!({"pub": {"allow": ["app.>", "_INBOX.>"]}, "sub": {"allow": ["app.>", "_INBOX.>"]}}),
    );
    let dir = TempDir::new("keel-creds");
    let path = dir.path().join("user.creds");
    std::fs::write(&path, creds(&token, &u.seed().unwrap())).unwrap();
    let opts = async_nats::ConnectOptions::with_credentials_file(&path)
        .await
        .unwrap();
    let nc = server.client_with(opts).await;
    let mut sub = nc.subscribe("app.x").await.unwrap();
    nc.publish("app.x", "jwt".into()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, "jwt");
    // The JWT's permissions hold.
    let mut raw = server.raw().await;
    let nonce = raw.info_json()["nonce"].as_str().unwrap().to_string();
    let sig = URL_SAFE_NO_PAD.encode(u.sign(nonce.as_bytes()).unwrap());
    raw.send(format!("CONNECT {{\"verbose\":false,\"protocol\":1,\"jwt\":\"{token}\",\"sig\":\"{sig}\"}}\r\nPING\r\n").as_bytes())
        .await;
    pong(&mut raw).await;
    raw.send(b"PUB other 1\r\nx\r\n").await;
    assert_eq!(
        raw.read_op().await,
        "-ERR 'Permissions Violation for Publish to \"other\"'"
    );

    // An expired user JWT is refused.
    let expired = user_jwt(&op.account, &u, Some(now() - 60), json!({}));
    let opts =
        async_nats::ConnectOptions::with_credentials(&creds(&expired, &u.seed().unwrap())).unwrap();
    assert!(matches!(
        connect_error(&server, opts).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication
    ));
    // One signed by an account the operator does not know is refused.
    let stranger = nkeys::KeyPair::new_account();
    let forged = user_jwt(&stranger, &u, None, json!({}));
    let opts =
        async_nats::ConnectOptions::with_credentials(&creds(&forged, &u.seed().unwrap())).unwrap();
    assert!(matches!(
        connect_error(&server, opts).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication
    ));
    // No credentials at all: refused.
    assert_eq!(
        connect_error(&server, async_nats::ConnectOptions::new()).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );
}

/// Signs `claims` as a version 1 JWT (what nats.py's test fixtures still carry): header
/// `{"typ":"jwt","alg":"ed25519"}`, the signature over the claims part alone, the claim
/// type at the top level.
fn jwt_v1(signer: &nkeys::KeyPair, claims: Value) -> String {
    let h = URL_SAFE_NO_PAD.encode(br#"{"typ":"jwt","alg":"ed25519"}"#);
    let mut claims = claims;
    claims["jti"] = json!(format!("{:x}", rand_u64()));
    claims["iat"] = json!(now() - 10);
    let c = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap());
    let sig = signer.sign(c.as_bytes()).unwrap();
    format!("{h}.{c}.{}", URL_SAFE_NO_PAD.encode(sig))
}

/// An operator, an account and a user all with version 1 JWTs: the server starts and the
/// user's creds connect, with the user's permissions, as with the reference.
#[tokio::test]
async fn version_1_jwts_still_work() {
    let op = nkeys::KeyPair::new_operator();
    let acc = nkeys::KeyPair::new_account();
    let op_jwt = jwt_v1(
        &op,
        json!({"iss": op.public_key(), "sub": op.public_key(), "name": "OP", "type": "operator"}),
    );
    let acc_jwt = jwt_v1(
        &op,
        json!({"iss": op.public_key(), "sub": acc.public_key(), "name": "foo", "type": "account",
               "nats": {"limits": {"subs": -1, "conn": -1, "imports": -1, "exports": -1,
                                   "data": -1, "payload": -1, "wildcards": true}}}),
    );
    let server = Server::start_with_config(&format!(
        "operator: {op_jwt}\nresolver: MEMORY\nresolver_preload {{\n  {}: {acc_jwt}\n}}\n",
        acc.public_key()
    ));
    let u = nkeys::KeyPair::new_user();
    let user = jwt_v1(
        &acc,
        json!({"iss": acc.public_key(), "sub": u.public_key(), "name": "foo-user", "type": "user",
               "nats": {"pub": {"allow": ["v1.>", "_INBOX.>"]}, "sub": {}}}),
    );
    let opts =
        async_nats::ConnectOptions::with_credentials(&creds(&user, &u.seed().unwrap())).unwrap();
    let nc = server.client_with(opts).await;
    let mut sub = nc.subscribe("v1.x").await.unwrap();
    nc.publish("v1.x", "old".into()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, "old");
    // Signed by another account than the one it names: refused.
    let forged = jwt_v1(
        &nkeys::KeyPair::new_account(),
        json!({"iss": acc.public_key(), "sub": u.public_key(), "type": "user", "nats": {}}),
    );
    let opts =
        async_nats::ConnectOptions::with_credentials(&creds(&forged, &u.seed().unwrap())).unwrap();
    assert!(matches!(
        connect_error(&server, opts).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication
    ));
}

#[tokio::test]
async fn a_connection_ends_when_its_jwt_expires() {
    let op = operator_setup();
    let server = Server::start_with_config(&op.conf);
    let u = nkeys::KeyPair::new_user();
    let token = user_jwt(&op.account, &u, Some(now() + 2), json!({}));
    let mut raw = server.raw().await;
    let nonce = raw.info_json()["nonce"].as_str().unwrap().to_string();
    let sig = URL_SAFE_NO_PAD.encode(u.sign(nonce.as_bytes()).unwrap());
    raw.send(format!("CONNECT {{\"verbose\":false,\"protocol\":1,\"jwt\":\"{token}\",\"sig\":\"{sig}\"}}\r\nPING\r\n").as_bytes())
        .await;
    pong(&mut raw).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    loop {
        let line = raw.try_read_line(Duration::from_secs(8)).await;
        match line.as_deref() {
            Some("PING") => raw.send(b"PONG\r\n").await,
            Some(l) if l.starts_with("INFO") => {}
            Some(l) => {
                assert_eq!(l, "-ERR 'User Authentication Expired'");
                break;
            }
            None => panic!("closed without an error"),
        }
        assert!(std::time::Instant::now() < deadline);
    }
}

// ---------------------------------------------------------------------------
// Reload
// ---------------------------------------------------------------------------

const RELOAD_BEFORE: &str = r#"
authorization { users = [
  {user: keep, password: k}
  {user: gone, password: g}
  {user: narrowed, password: n}
] }
"#;

const RELOAD_AFTER: &str = r#"
authorization { users = [
  {user: keep, password: k}
  {user: narrowed, password: n, permissions: {publish: "ok.>", subscribe: "ok.>"}}
  {user: new, password: x}
] }
"#;

#[tokio::test]
async fn reload_keeps_allowed_connections_and_closes_the_rest() {
    let server = Server::start_with_config(RELOAD_BEFORE);
    let keep = server.client_with(user("keep", "k")).await;
    let mut keep_sub = keep.subscribe("ok.x").await.unwrap();
    keep.flush().await.unwrap();
    let mut gone = raw_connect(&server, ",\"user\":\"gone\",\"pass\":\"g\"").await;
    pong(&mut gone).await;
    let mut narrowed = raw_connect(&server, ",\"user\":\"narrowed\",\"pass\":\"n\"").await;
    pong(&mut narrowed).await;
    narrowed
        .send(b"SUB other 1\r\nSUB ok.x 2\r\nPING\r\n")
        .await;
    pong(&mut narrowed).await;

    server.reload_config(RELOAD_AFTER);

    // The removed user is disconnected (as the reference does it: no -ERR, the socket
    // just closes).
    loop {
        let line = gone.try_read_line(STEP).await;
        match line.as_deref() {
            Some("PING") => gone.send(b"PONG\r\n").await,
            Some(l) if l.starts_with("INFO") => {}
            Some(l) => panic!("unexpected {l:?}"),
            None => break,
        }
    }
    // The narrowed user loses the subscription it may no longer have (told so, with its
    // sid), may not publish outside its new rules, and stays.
    narrowed.send(b"PUB other 1\r\nx\r\nPING\r\n").await;
    let mut lines = Vec::new();
    loop {
        let l = narrowed.read_op().await;
        if l == "PONG" {
            break;
        }
        lines.push(l);
    }
    assert_eq!(
        lines,
        [
            "-ERR 'Permissions Violation for Subscription to \"other\" (sid \"1\")'",
            "-ERR 'Permissions Violation for Publish to \"other\"'"
        ]
    );
    narrowed.send(b"PUB ok.x 1\r\ny\r\n").await;
    assert_eq!(next_msg(&mut keep_sub).await.payload, "y");
    // The kept user never noticed; the new one can connect, the removed one cannot.
    keep.publish("ok.x", "z".into()).await.unwrap();
    assert_eq!(next_msg(&mut keep_sub).await.payload, "z");
    server.client_with(user("new", "x")).await;
    assert_eq!(
        connect_error(&server, user("gone", "g")).await,
        async_nats::ConnectErrorKind::AuthorizationViolation
    );
}

#[tokio::test]
async fn signal_reload_by_pid() {
    let server = Server::start_with_config(RELOAD_BEFORE);
    std::fs::write(server.config_path(), RELOAD_AFTER).unwrap();
    let before = server
        .full_log()
        .matches("Reloaded server configuration")
        .count();
    let bin = if is_reference() {
        "nats-server".to_string()
    } else {
        env!("CARGO_BIN_EXE_keel-server").to_string()
    };
    let status = std::process::Command::new(bin)
        .arg("--signal")
        .arg(format!("reload={}", server.pid()))
        .status()
        .unwrap();
    assert!(status.success());
    server.wait_log_count("Reloaded server configuration", before + 1);
    server.client_with(user("new", "x")).await;
}

#[tokio::test]
async fn failed_auth_shows_in_monitoring_without_secrets() {
    let server = Server::start_with_args(&["-m", "-1", "--user", "u", "--pass", "hunter2"]);
    let _ = connect_error(&server, user("u", "wrong-one")).await;
    let port = server.monitor_port();
    let varz = http_get(port, "/varz").await;
    let v: Value = serde_json::from_str(&varz.body).unwrap();
    assert_eq!(v["auth_required"], true);
    let text = varz.body.clone();
    assert!(
        !text.contains("hunter2") && !text.contains("wrong-one"),
        "{text}"
    );
    let closed = http_get(port, "/connz?state=closed&auth=true").await;
    let c: Value = serde_json::from_str(&closed.body).unwrap();
    let conns = c["connections"].as_array().unwrap();
    assert!(
        conns
            .iter()
            .any(|c| c["reason"] == "Authentication Failure"),
        "{c}"
    );
    let text = closed.body.clone();
    assert!(
        !text.contains("hunter2") && !text.contains("wrong-one"),
        "{text}"
    );
    assert!(!server.full_log().contains("hunter2") && !server.full_log().contains("wrong-one"));
}

/// The usual shared JetStream account: JetStream runs in account JS, which exports its API,
/// acks and stream subjects as services; account APP imports them and uses JetStream as if
/// it were its own.
#[tokio::test]
async fn shared_jetstream_account() {
    let server = Server::start_jetstream_with_config(
        r#"
accounts {
  JS: {
    jetstream: enabled
    users: [{user: js, password: js}]
    exports: [
      {service: "$JS.API.>", response_type: stream}
      {service: "$JS.ACK.>"}
      {service: "orders.>"}
    ]
  }
  APP: {
    users: [{user: app, password: app}]
    imports: [
      {service: {account: JS, subject: "$JS.API.>"}}
      {service: {account: JS, subject: "$JS.ACK.>"}}
      {service: {account: JS, subject: "orders.>"}}
    ]
  }
}
"#,
    );
    let app = server.client_with(user("app", "app")).await;
    sync(&app).await;
    let js = async_nats::jetstream::new(app.clone());
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec!["orders.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let ack = js
        .publish("orders.1", "o1".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!((ack.stream.as_str(), ack.sequence), ("ORDERS", 1));
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("w".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let m = within("fetch", futures::StreamExt::next(&mut batch))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.payload, "o1");
    m.double_ack().await.unwrap();
    // The stream lives in JS: the JS account's user sees it, with the ack counted.
    let owner = server.client_with(user("js", "js")).await;
    let ojs = async_nats::jetstream::new(owner);
    let mut s = ojs.get_stream("ORDERS").await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 1);
    let mut c: async_nats::jetstream::consumer::PullConsumer = s.get_consumer("w").await.unwrap();
    assert_eq!(c.info().await.unwrap().ack_floor.stream_sequence, 1);
}

/// An account's JetStream limits: reported by `$JS.API.INFO`, enforced on create.
#[tokio::test]
async fn account_jetstream_limits() {
    let server = Server::start_jetstream_with_config(
        r#"accounts { A: { users: [{user: a, password: a}],
             jetstream: { max_mem: 1M, max_file: 10M, max_streams: 1, max_consumers: 1 } } }"#,
    );
    let a = server.client_with(user("a", "a")).await;
    sync(&a).await;
    let info = json_request(&a, "$JS.API.INFO", "").await.1;
    let l = &info["limits"];
    assert_eq!(
        (
            l["max_memory"].clone(),
            l["max_storage"].clone(),
            l["max_streams"].clone(),
            l["max_consumers"].clone()
        ),
        (json!(1_000_000), json!(10_000_000), json!(1), json!(1)),
        "{info}"
    );
    let create =
        |name: &str| json!({"name": name, "subjects": [format!("{name}.>")], "storage": "file"});
    let ok = json_request(&a, "$JS.API.STREAM.CREATE.S1", create("S1").to_string())
        .await
        .1;
    assert!(ok.get("error").is_none(), "{ok}");
    let second = json_request(&a, "$JS.API.STREAM.CREATE.S2", create("S2").to_string())
        .await
        .1;
    assert_eq!(api_error(&second).1, 10027, "{second}");
    let c1 = json_request(
        &a,
        "$JS.API.CONSUMER.CREATE.S1.c1",
        json!({"stream_name": "S1", "config": {"durable_name": "c1", "ack_policy": "explicit"}})
            .to_string(),
    )
    .await
    .1;
    assert!(c1.get("error").is_none(), "{c1}");
    let c2 = json_request(
        &a,
        "$JS.API.CONSUMER.CREATE.S1.c2",
        json!({"stream_name": "S1", "config": {"durable_name": "c2", "ack_policy": "explicit"}})
            .to_string(),
    )
    .await
    .1;
    assert_eq!(api_error(&c2).1, 10026, "{c2}");

    let server = Server::start_jetstream_with_config(
        r#"accounts { A: { users: [{user: a, password: a}], jetstream: { max_ack_pending: 10,
             disk_max_stream_bytes: 2000, max_bytes_required: true } } }"#,
    );
    let a = server.client_with(user("a", "a")).await;
    sync(&a).await;
    let with = |b: i64| {
        json!({"name": "S", "subjects": ["s.>"], "storage": "file", "max_bytes": b}).to_string()
    };
    let no_max = json!({"name": "S", "subjects": ["s.>"], "storage": "file"}).to_string();
    let r = json_request(&a, "$JS.API.STREAM.CREATE.S", no_max).await.1;
    assert_eq!(api_error(&r).1, 10113, "{r}");
    let r = json_request(&a, "$JS.API.STREAM.CREATE.S", with(5000))
        .await
        .1;
    assert_eq!(api_error(&r).1, 10122, "{r}");
    let r = json_request(&a, "$JS.API.STREAM.CREATE.S", with(1500))
        .await
        .1;
    assert!(r.get("error").is_none(), "{r}");
    let r = json_request(&a, "$JS.API.CONSUMER.CREATE.S.c",
        json!({"stream_name": "S", "config": {"durable_name": "c", "ack_policy": "explicit", "max_ack_pending": 20}}).to_string()).await.1;
    assert_eq!(api_error(&r).1, 10121, "{r}");
    let r = json_request(
        &a,
        "$JS.API.CONSUMER.CREATE.S.d",
        json!({"stream_name": "S", "config": {"durable_name": "d", "ack_policy": "explicit"}})
            .to_string(),
    )
    .await
    .1;
    assert_eq!(r["config"]["max_ack_pending"], 10, "{r}");
}

/// An account's `max_consumers` limits each stream, not the account's total (the
/// reference's rule): two consumers on one stream and one more on another all fit under 2.
#[tokio::test]
async fn account_max_consumers_is_per_stream() {
    let server = Server::start_jetstream_with_config(
        r#"accounts { A: { users: [{user: a, password: a}], jetstream: { max_consumers: 2 } } }"#,
    );
    let a = server.client_with(user("a", "a")).await;
    sync(&a).await;
    for s in ["S1", "S2"] {
        let r = json_request(
            &a,
            &format!("$JS.API.STREAM.CREATE.{s}"),
            json!({"name": s, "subjects": [s.to_lowercase()]}).to_string(),
        )
        .await
        .1;
        assert!(r.get("error").is_none(), "{r}");
    }
    let create = |s: &str, c: &str| {
        (
            format!("$JS.API.CONSUMER.CREATE.{s}.{c}"),
            json!({"stream_name": s, "config": {"durable_name": c, "ack_policy": "explicit"}})
                .to_string(),
        )
    };
    for (s, c) in [("S1", "a"), ("S1", "b"), ("S2", "c")] {
        let (subject, body) = create(s, c);
        let r = json_request(&a, &subject, body).await.1;
        assert!(r.get("error").is_none(), "{s}.{c}: {r}");
    }
    let (subject, body) = create("S1", "d");
    let r = json_request(&a, &subject, body).await.1;
    assert_eq!(api_error(&r).1, 10026, "{r}");
}

/// The server's `max_file_store` holds every account's streams: a reservation or a publish
/// in B counts what A reserved and stored.
#[tokio::test]
async fn server_store_limit_counts_every_account() {
    let server = Server::start_jetstream_with_config(
        r#"jetstream { max_file_store: 4KB }
           accounts {
             A: { users: [{user: a, password: a}], jetstream: enabled }
             B: { users: [{user: b, password: b}], jetstream: enabled }
           }"#,
    );
    let a = server.client_with(user("a", "a")).await;
    let b = server.client_with(user("b", "b")).await;
    sync(&a).await;
    sync(&b).await;
    let create = |name: &str, max_bytes: i64| {
        json!({"name": name, "subjects": [format!("{name}.>")], "max_bytes": max_bytes}).to_string()
    };
    let ok = json_request(&a, "$JS.API.STREAM.CREATE.RES", create("RES", 3000))
        .await
        .1;
    assert!(ok.get("error").is_none(), "{ok}");
    // 3000 of A's + 3000 would pass the server's 4KB.
    let resp = json_request(&b, "$JS.API.STREAM.CREATE.RES", create("RES", 3000))
        .await
        .1;
    assert_eq!(api_error(&resp).1, 10047, "{resp}");
    // A stores about 2KB; B's stream then has room for much less than the whole limit.
    let ja = async_nats::jetstream::new(a);
    for _ in 0..8 {
        ja.publish("RES.x", vec![b'x'; 200].into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let jb = async_nats::jetstream::new(b);
    jb.create_stream(async_nats::jetstream::stream::Config {
        name: "LIM".into(),
        subjects: vec!["lim".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut refused = None;
    for i in 0..40 {
        let ack = jb
            .publish("lim", vec![b'x'; 200].into())
            .await
            .unwrap()
            .await;
        if let Err(e) = ack {
            refused = Some((i, e.to_string()));
            break;
        }
    }
    // Alone, B would store about 17 of these.
    let (i, text) = refused.expect("a publish past the server's limit is refused");
    assert!(i > 3 && i < 13, "refused after {i} messages");
    assert!(
        text.contains("insufficient") || text.contains("10047"),
        "{text}"
    );
}

/// JetStream in two accounts at once: each has its own streams, so both can have a stream
/// `ORDERS` on `orders.>` (no overlap across accounts), with their own messages, consumers
/// and lifecycle, also after a restart (SIGKILL; each account's acked messages come back
/// in its own stream).
#[tokio::test]
async fn jetstream_in_two_accounts() {
    let mut server = Server::start_jetstream_with_config(
        r#"accounts {
             A: { users: [{user: a, password: a}], jetstream: enabled }
             B: { users: [{user: b, password: b}], jetstream: enabled }
           }"#,
    );
    let orders = async_nats::jetstream::stream::Config {
        name: "ORDERS".into(),
        subjects: vec!["orders.>".into()],
        ..Default::default()
    };
    for (u, n) in [("a", 2u64), ("b", 1)] {
        let c = server.client_with(user(u, u)).await;
        sync(&c).await;
        let js = async_nats::jetstream::new(c);
        js.create_stream(orders.clone()).await.unwrap();
        for i in 0..n {
            let ack = js
                .publish(format!("orders.{u}"), format!("{u}{i}").into())
                .await
                .unwrap()
                .await
                .unwrap();
            assert_eq!((ack.stream.as_str(), ack.sequence), ("ORDERS", i + 1));
        }
    }
    let a = async_nats::jetstream::new(server.client_with(user("a", "a")).await);
    let b = async_nats::jetstream::new(server.client_with(user("b", "b")).await);
    let mut sa = a.get_stream("ORDERS").await.unwrap();
    sa.create_consumer(async_nats::jetstream::consumer::pull::Config {
        durable_name: Some("w".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    let ia = sa.info().await.unwrap().clone();
    let mut sb = b.get_stream("ORDERS").await.unwrap();
    let ib = sb.info().await.unwrap().clone();
    assert_eq!((ia.state.messages, ia.state.consumer_count), (2, 1));
    assert_eq!((ib.state.messages, ib.state.consumer_count), (1, 0));
    let m = sb.get_raw_message(1).await.unwrap();
    assert_eq!(
        (m.subject.as_str(), &m.payload[..]),
        ("orders.b", &b"b0"[..])
    );
    assert!(sb
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>("w")
        .await
        .is_err());

    // Each account's streams come back in that account.
    server.kill_hard();
    server.restart();
    let a = async_nats::jetstream::new(server.client_with(user("a", "a")).await);
    let b = async_nats::jetstream::new(server.client_with(user("b", "b")).await);
    let mut sa = a.get_stream("ORDERS").await.unwrap();
    assert_eq!(sa.info().await.unwrap().state.messages, 2);
    assert_eq!(
        b.get_stream("ORDERS")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages,
        1
    );
    // Deleting A's stream leaves B's.
    a.delete_stream("ORDERS").await.unwrap();
    assert!(a.get_stream("ORDERS").await.is_err());
    let mut sb = b.get_stream("ORDERS").await.unwrap();
    assert_eq!(sb.info().await.unwrap().state.messages, 1);
    let m = sb.get_raw_message(1).await.unwrap();
    assert_eq!(&m.payload[..], b"b0");
}

/// An account without JetStream on a server with it is told so (10039) in each API
/// request's response type, as the reference answers, instead of being left to read "no
/// responders" as if the server had no JetStream. A pull or a direct get there finds no
/// responders; a subject the API does not know gets no answer. The system account's
/// requests get the same error as `system_response`.
#[tokio::test]
async fn an_account_without_jetstream_is_told_so() {
    let server = Server::start_jetstream_with_config(
        r#"accounts {
             SYS: { users: [{user: sys, password: sys}] }
             A: { users: [{user: a, password: a}], jetstream: enabled }
             B: { users: [{user: b, password: b}] }
           }
           system_account: SYS"#,
    );
    let b = server.client_with(user("b", "b")).await;
    let sys = server.client_with(user("sys", "sys")).await;
    let a = server.client_with(user("a", "a")).await;
    let error = r#""error":{"code":503,"err_code":10039,"description":"JetStream not enabled for account"}"#;
    let raw = |c: async_nats::Client, subject: &'static str| async move {
        let m = within(subject, c.request(subject, "".into()))
            .await
            .unwrap_or_else(|e| panic!("{subject}: {e}"));
        String::from_utf8(m.payload.to_vec()).unwrap()
    };
    assert_eq!(
        raw(b.clone(), "$JS.API.INFO").await,
        format!(r#"{{"type":"io.nats.jetstream.api.v1.account_info_response",{error}}}"#)
    );
    assert_eq!(
        raw(b.clone(), "$JS.API.STREAM.NAMES").await,
        format!(
            r#"{{"type":"io.nats.jetstream.api.v1.stream_names_response",{error},"total":0,"offset":0,"limit":0,"streams":null}}"#
        )
    );
    assert_eq!(
        raw(b.clone(), "$JS.API.STREAM.CREATE.X").await,
        format!(r#"{{"type":"io.nats.jetstream.api.v1.stream_create_response",{error}}}"#)
    );
    for subject in ["$JS.API.CONSUMER.MSG.NEXT.S.C", "$JS.API.DIRECT.GET.S"] {
        let r = b.request(subject, "".into()).await;
        assert!(
            matches!(&r, Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders),
            "{subject}: {r:?}"
        );
    }
    let unknown = tokio::time::timeout(
        Duration::from_millis(500),
        b.request("$JS.API.FOO", "".into()),
    )
    .await;
    assert!(unknown.is_err(), "an answer to $JS.API.FOO: {unknown:?}");
    assert_eq!(
        raw(sys.clone(), "$JS.API.INFO").await,
        format!(r#"{{"type":"io.nats.jetstream.api.v1.account_info_response",{error}}}"#)
    );
    for subject in ["$JS.API.STREAM.NAMES", "$JS.API.FOO"] {
        assert_eq!(
            raw(sys.clone(), subject).await,
            format!(r#"{{"type":"io.nats.jetstream.api.v1.system_response",{error}}}"#)
        );
    }
    // The account with JetStream is served as before.
    let info = json_request(&a, "$JS.API.INFO", String::new()).await.1;
    assert!(info.get("error").is_none(), "{info}");
    // An account a reload adds is told too.
    server.reload_config(
        r#"accounts {
             SYS: { users: [{user: sys, password: sys}] }
             A: { users: [{user: a, password: a}], jetstream: enabled }
             B: { users: [{user: b, password: b}] }
             C: { users: [{user: c, password: c}] }
           }
           system_account: SYS"#,
    );
    let c = server.client_with(user("c", "c")).await;
    assert_eq!(
        raw(c, "$JS.API.INFO").await,
        format!(r#"{{"type":"io.nats.jetstream.api.v1.account_info_response",{error}}}"#)
    );
}
