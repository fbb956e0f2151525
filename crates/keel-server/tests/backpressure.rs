//! Publishers that outrun a stream's store are slowed down, never buffered without bound
//! and never dropped (issue 9, item 1).
//!
//! Keel holds a publisher back (stops reading its socket) while the stream's ingest queue
//! is full. The reference instead drops past its ingest queue limit ("Dropping messages due
//! to excessive stream ingest rate"), so the no-drop and memory checks here are Keel's own;
//! with `KEEL_TEST_REFERENCE=1` only the parts both servers share are checked.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::StorageType};
use common::{within, Server};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Resident memory of a process in KiB, from /proc/<pid>/status.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// A raw connection that writes `count` plain `PUB <subject> <size>` (no reply) as fast as
/// the server reads them, in large chunks, and never reads what the server sends.
async fn flood(addr: std::net::SocketAddr, subject: &str, size: usize, count: usize) {
    let stream = within("flood connect", TcpStream::connect(addr))
        .await
        .unwrap();
    stream.set_nodelay(true).unwrap();
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut line = String::new();
    within("INFO", r.read_line(&mut line)).await.unwrap();
    w.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1}\r\nPING\r\n")
        .await
        .unwrap();
    line.clear();
    within("PONG", r.read_line(&mut line)).await.unwrap();
    assert_eq!(line, "PONG\r\n");
    let mut one = format!("PUB {subject} {size}\r\n").into_bytes();
    one.extend(std::iter::repeat_n(b'x', size));
    one.extend_from_slice(b"\r\n");
    let per_chunk = (256 * 1024 / one.len()).max(1);
    let chunk = one.repeat(per_chunk);
    let mut sent = 0;
    while sent < count {
        let n = per_chunk.min(count - sent);
        // Generous: the server may hold us back, but must keep reading.
        tokio::time::timeout(
            Duration::from_secs(60),
            w.write_all(&chunk[..n * one.len()]),
        )
        .await
        .expect("the server stopped reading for a minute")
        .expect("the server closed the publisher");
        sent += n;
    }
    w.flush().await.unwrap();
    // Keep the connection open until the server has read everything: a PING answered
    // means every PUB before it was processed.
    w.write_all(b"PING\r\n").await.unwrap();
    loop {
        line.clear();
        let n = tokio::time::timeout(Duration::from_secs(60), r.read_line(&mut line))
            .await
            .expect("no PONG after the flood")
            .unwrap();
        assert!(n > 0, "server closed the publisher");
        if line == "PONG\r\n" {
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flood_of_plain_publishes_into_a_stream_is_backpressured_not_buffered() {
    const SIZE: usize = 4096;
    const PER_CONN: usize = 50_000; // 2 x 200 MiB: far more than the bound below
    let server = Server::start_jetstream();
    let client = server.client().await;
    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: "LOAD".into(),
        subjects: vec!["load.>".into()],
        storage: StorageType::File,
        max_bytes: 256 * 1000 * 1000,
        ..Default::default()
    })
    .await
    .unwrap();

    let pid = server.pid();
    let base = rss_kib(pid);
    let peak = Arc::new(AtomicU64::new(base));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let started = Instant::now();
    let a = tokio::spawn(flood(server.addr(), "load.a", SIZE, PER_CONN));
    let b = tokio::spawn(flood(server.addr(), "load.b", SIZE, PER_CONN));

    // While the publishers are held back, other clients are served as usual.
    tokio::time::sleep(Duration::from_millis(200)).await;
    within("a bystander's round trip during the flood", client.flush())
        .await
        .unwrap();

    a.await.unwrap();
    b.await.unwrap();
    let flood_time = started.elapsed();
    if common::is_reference() {
        // The reference drops past its ingest queue limit instead; its memory is its own.
        return;
    }

    // Every message was stored: held back, never dropped.
    let total = 2 * PER_CONN as u64;
    let mut stream = js.get_stream("LOAD").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let last_seq = loop {
        let info = stream.info().await.unwrap();
        if info.state.last_sequence >= total || Instant::now() > deadline {
            break info.state.last_sequence;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    sampler.abort();
    let peak = peak.load(Ordering::Relaxed);
    eprintln!("peak RSS {peak} KiB (base {base} KiB), {last_seq} stored, flood {flood_time:?}");
    assert_eq!(last_seq, total, "messages were dropped");
    // The bounded queues hold a few tens of MiB; buffering the flood would take 400.
    assert!(
        peak < 128 * 1024,
        "peak RSS {peak} KiB (started at {base} KiB) during a {flood_time:?} flood"
    );
}
