//! A subscriber that stops reading must be cut off by the server without
//! stalling the publisher or other subscribers.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{next_msg, sync, within, Closed, RawClient, Server};
use futures::StreamExt;
use tokio::net::TcpSocket;

const MSG_SIZE: usize = 64 * 1024;
const MSG_COUNT: usize = 1024; // 64 MiB in total
const DEADLINE: Duration = Duration::from_secs(20);

/// Probes whether the server has closed `raw` without reading from it:
/// writes to a socket the peer has closed fail (EPIPE / ECONNRESET) once the
/// peer has answered an earlier write with a reset.
async fn peer_closed(raw: &mut RawClient) -> bool {
    match tokio::time::timeout(Duration::from_millis(200), raw.try_send(b"PING\r\n")).await {
        Ok(Ok(())) => false,
        // Our send buffer is full: the server is not reading, but it is open.
        Err(_) => false,
        Ok(Err(e)) => {
            assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                ),
                "unexpected write error {e:?}"
            );
            true
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_consumer_is_disconnected_without_hurting_others() {
    let server = Server::start_with_config("write_deadline: \"2s\"\n");

    // The slow subscriber: small receive buffer, subscribes, then never reads.
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let stream = within("slow connect", socket.connect(server.addr()))
        .await
        .unwrap();
    let mut slow = RawClient::from_stream(stream).await;
    slow.send(
        b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1}\r\nSUB big 1\r\nPING\r\n",
    )
    .await;
    assert_eq!(slow.read_op().await, "PONG");

    // A healthy subscriber to the same subject, draining as fast as it can.
    let observer = server.client().await;
    let mut observed = observer.subscribe("big").await.unwrap();
    sync(&observer).await;
    let drain = tokio::spawn(async move {
        let mut count = 0usize;
        let mut bytes = 0usize;
        while count < MSG_COUNT {
            match tokio::time::timeout(DEADLINE, observed.next()).await {
                Ok(Some(m)) => {
                    count += 1;
                    bytes += m.payload.len();
                }
                Ok(None) => break,
                Err(_) => break,
            }
        }
        (count, bytes)
    });

    // A bystander on an unrelated subject.
    let bystander = server.client().await;
    let mut side = bystander.subscribe("side").await.unwrap();
    sync(&bystander).await;

    let publisher = server.client().await;
    let started = Instant::now();
    let payload = Bytes::from(vec![b'p'; MSG_SIZE]);
    let publish_all = async {
        for _ in 0..MSG_COUNT {
            publisher.publish("big", payload.clone()).await.unwrap();
        }
        publisher.flush().await.unwrap();
    };
    tokio::time::timeout(DEADLINE, publish_all)
        .await
        .expect("publisher stalled behind the slow consumer");
    let publish_time = started.elapsed();

    // The healthy subscriber got everything.
    let (count, bytes) = tokio::time::timeout(DEADLINE, drain)
        .await
        .expect("observer stalled")
        .unwrap();
    assert_eq!(count, MSG_COUNT, "observer missed messages");
    assert_eq!(bytes, MSG_COUNT * MSG_SIZE);

    // The slow consumer gets disconnected within the deadline.
    let disconnected = loop {
        if peer_closed(&mut slow).await {
            break true;
        }
        if started.elapsed() > DEADLINE {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        disconnected,
        "slow consumer still connected {:?} after publishing started",
        started.elapsed()
    );
    let cut_off_after = started.elapsed();

    // Whatever was buffered ends in EOF or reset, well short of everything.
    let closed = slow.expect_closed(Duration::from_secs(5)).await;
    assert!(
        matches!(closed, Closed::Eof | Closed::Error(_)),
        "got {closed:?}"
    );

    // Publisher and bystander still work.
    publisher.publish("side", "after".into()).await.unwrap();
    within("publisher flush", publisher.flush()).await.unwrap();
    assert_eq!(next_msg(&mut side).await.payload, Bytes::from("after"));
    bystander.publish("side", "again".into()).await.unwrap();
    assert_eq!(next_msg(&mut side).await.payload, Bytes::from("again"));

    eprintln!(
        "published 64 MiB in {publish_time:?}; slow consumer cut off after {cut_off_after:?}"
    );
}

#[tokio::test]
async fn slow_consumer_probe_sees_open_connection() {
    // Sanity check of the probe itself: a connection nobody is flooding is open.
    let server = Server::start();
    let mut raw = server.raw_connected().await;
    for _ in 0..3 {
        assert!(!peer_closed(&mut raw).await);
    }
    // And the PINGs were all answered.
    for _ in 0..3 {
        assert_eq!(raw.read_op().await, "PONG");
    }
    raw.send(b"PING\r\n").await;
    assert_eq!(raw.read_op().await, "PONG");
}

/// Past `max_pending` bytes queued for it, a subscriber is closed at once, for that reason
/// (the log line both servers write), not later by `write_deadline`, which is set far
/// beyond the test's bound here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_consumer_past_max_pending_is_closed_at_once() {
    const BOUND: Duration = Duration::from_secs(10);
    let server = Server::start_with_config("max_pending: 1MB\nwrite_deadline: \"120s\"\n");

    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let stream = within("slow connect", socket.connect(server.addr()))
        .await
        .unwrap();
    let mut slow = RawClient::from_stream(stream).await;
    slow.send(
        b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1}\r\nSUB big 1\r\nPING\r\n",
    )
    .await;
    assert_eq!(slow.read_op().await, "PONG");

    // 32 MiB: several times what the kernel buffers can hold for the stuck socket, so more
    // than 1 MiB is left queued in the server.
    let publisher = server.client().await;
    let started = Instant::now();
    let payload = Bytes::from(vec![b'p'; MSG_SIZE]);
    let publish_all = async {
        for _ in 0..MSG_COUNT / 2 {
            publisher.publish("big", payload.clone()).await.unwrap();
        }
        publisher.flush().await.unwrap();
    };
    tokio::time::timeout(BOUND, publish_all)
        .await
        .expect("publisher stalled behind the slow consumer");

    const REASON: &str = "Slow Consumer Detected: MaxPending of 1048576 Exceeded";
    while !server.log().contains(REASON) {
        assert!(
            started.elapsed() < BOUND,
            "no {REASON:?} within {BOUND:?}; log:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let closed_after = started.elapsed();
    assert!(
        !server.log().contains("WriteDeadline"),
        "closed by the write deadline: {}",
        server.log()
    );
    let closed = slow.expect_closed(Duration::from_secs(5)).await;
    assert!(
        matches!(closed, Closed::Eof | Closed::Error(_)),
        "got {closed:?}"
    );

    // The publisher carries on.
    let mut sub = publisher.subscribe("big").await.unwrap();
    sync(&publisher).await;
    publisher.publish("big", "after".into()).await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, Bytes::from("after"));
    eprintln!("slow consumer closed for max_pending after {closed_after:?}");
}
