//! Several servers in one test process (`keel_server::harness`, through `common::Node`):
//! each is complete (clients, JetStream, monitoring, log) and they share nothing: subjects,
//! streams, slow-consumer counts and logs are each server's own, and one can be shut down
//! and another started while the rest carry on. With `KEEL_TEST_REFERENCE=1` the servers are
//! reference processes, for which all of this is a given.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    api_error, api_ok, expect_no_msg, http_get, js_publish, json_request, next_msg, sync, within,
    Closed, Node, RawClient, STEP,
};
use serde_json::{json, Value};
use tokio::net::TcpSocket;

const CONF: &str = "max_pending: 1MB\nwrite_deadline: \"120s\"\n";
const SLOW: &str = "Slow Consumer Detected: MaxPending of 1048576 Exceeded";

async fn varz(node: &Node) -> Value {
    let r = http_get(node.monitor_port(), "/varz").await;
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).expect("varz JSON")
}

async fn stream_count(client: &async_nats::Client) -> u64 {
    let info = api_ok(client, "$JS.API.INFO", Value::Null).await;
    info["streams"].as_u64().expect("streams")
}

/// A subscriber on `subject` that never reads (small receive buffer), so the server queues
/// for it until `max_pending` closes it.
async fn stuck_subscriber(node: &Node, subject: &str) -> RawClient {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let stream = within("stuck connect", socket.connect(node.addr()))
        .await
        .unwrap();
    let mut raw = RawClient::from_stream(stream).await;
    raw.send(
        format!("CONNECT {{\"verbose\":false,\"protocol\":1}}\r\nSUB {subject} 1\r\nPING\r\n")
            .as_bytes(),
    )
    .await;
    assert_eq!(raw.read_op().await, "PONG");
    raw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_in_one_process_share_nothing() {
    let a = Node::start_jetstream(CONF).await;
    let b = Node::start_jetstream(CONF).await;
    assert_ne!(a.addr(), b.addr());
    let (ca, cb) = (a.client().await, b.client().await);

    // Core pub/sub on both at once: each subscriber hears only its own server.
    let mut sa = ca.subscribe("greet").await.unwrap();
    let mut sb = cb.subscribe("greet").await.unwrap();
    sync(&ca).await;
    sync(&cb).await;
    let (ra, rb) = tokio::join!(ca.publish("greet", "from a".into()), async {
        cb.publish("greet", "from b".into()).await
    });
    ra.unwrap();
    rb.unwrap();
    assert_eq!(next_msg(&mut sa).await.payload, Bytes::from("from a"));
    assert_eq!(next_msg(&mut sb).await.payload, Bytes::from("from b"));
    let (ea, eb) = (expect_no_msg(&mut sa), expect_no_msg(&mut sb));
    tokio::join!(ea, eb);

    // JetStream: a stream created on a is not visible on b; b's own stream of the same
    // name is a different stream with its own messages.
    let cfg = json!({"name": "ORDERS", "subjects": ["orders.>"], "storage": "file"});
    api_ok(&ca, "$JS.API.STREAM.CREATE.ORDERS", cfg.clone()).await;
    assert_eq!(js_publish(&ca, "orders.1", &[], "one").await["seq"], 1);
    let (_, missing) = json_request(&cb, "$JS.API.STREAM.INFO.ORDERS", "").await;
    assert_eq!(api_error(&missing).1, 10059, "{missing}");
    assert_eq!(stream_count(&cb).await, 0);
    api_ok(&cb, "$JS.API.STREAM.CREATE.ORDERS", cfg).await;
    for i in 1..=3 {
        assert_eq!(js_publish(&cb, "orders.x", &[], "b").await["seq"], i);
    }
    let ia = api_ok(&ca, "$JS.API.STREAM.INFO.ORDERS", Value::Null).await;
    let ib = api_ok(&cb, "$JS.API.STREAM.INFO.ORDERS", Value::Null).await;
    assert_eq!(ia["state"]["messages"], 1, "{ia}");
    assert_eq!(ib["state"]["messages"], 3, "{ib}");

    // A slow consumer on a: counted and logged by a alone, while b keeps serving.
    let mut stuck = stuck_subscriber(&a, "big").await;
    let payload = Bytes::from(vec![b'p'; 64 * 1024]);
    let flood = async {
        for _ in 0..512 {
            ca.publish("big", payload.clone()).await.unwrap();
        }
        ca.flush().await.unwrap();
    };
    let meanwhile = async {
        for i in 0..20 {
            cb.publish("greet", i.to_string().into()).await.unwrap();
            assert_eq!(next_msg(&mut sb).await.payload, Bytes::from(i.to_string()));
        }
    };
    within("flood a, use b", async { tokio::join!(flood, meanwhile) }).await;
    let started = Instant::now();
    while !a.log().contains(SLOW) {
        assert!(
            started.elapsed() < STEP,
            "no {SLOW:?} in a's log:\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let closed = stuck.expect_closed(STEP).await;
    assert!(
        matches!(closed, Closed::Eof | Closed::Error(_)),
        "{closed:?}"
    );
    let (va, vb) = (varz(&a).await, varz(&b).await);
    assert_eq!(va["slow_consumers"], 1, "a: {va}");
    assert_eq!(vb["slow_consumers"], 0, "b: {vb}");
    assert!(!b.log().contains(SLOW), "b's log:\n{}", b.log());
    // Each log is its server's alone: one startup each.
    for (name, node) in [("a", &a), ("b", &b)] {
        let log = node.log();
        let ready = log.matches("Listening for client connections on").count();
        assert_eq!(ready, 1, "{name}'s log:\n{log}");
        assert!(log.contains(&format!("{}", node.addr().port())), "{log}");
    }

    // a stops completely (its port is free again); b is untouched, and a new server starts
    // next to it with nothing of a's.
    let a_addr = a.addr();
    drop(ca);
    a.shutdown().await;
    assert!(
        tokio::net::TcpStream::connect(a_addr).await.is_err(),
        "a still listens"
    );
    assert_eq!(js_publish(&cb, "orders.x", &[], "b").await["seq"], 4);
    let c = Node::start_jetstream(CONF).await;
    let cc = c.client().await;
    assert_eq!(stream_count(&cc).await, 0);
    cc.publish("greet", "from c".into()).await.unwrap();
    sync(&cc).await;
    cb.publish("greet", "still b".into()).await.unwrap();
    assert_eq!(next_msg(&mut sb).await.payload, Bytes::from("still b"));
    drop((cb, cc, sa, sb));
    b.shutdown().await;
    c.shutdown().await;
}
