//! Process-level durability: the server is SIGKILLed in the middle of a publish burst with
//! many acks in flight, restarted on the same store, and every message it acknowledged
//! must be there with the same sequence and content. Also checks that stored data survives
//! a clean restart and that damage to a segment never deletes the stream.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use common::{within, Server};
use futures::stream::{FuturesUnordered, StreamExt};

/// Publishes from 4 tasks with 64 acks in flight each, until told to stop or the
/// connection dies; returns every (seq, payload) the server acknowledged.
async fn burst(
    js: jetstream::Context,
    stop: Arc<std::sync::atomic::AtomicBool>,
    acked: Arc<Mutex<BTreeMap<u64, String>>>,
    task: usize,
) {
    let mut n = 0u64;
    let mut inflight = FuturesUnordered::new();
    loop {
        while inflight.len() < 64 && !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let payload = format!("t{task}-m{n}");
            n += 1;
            let js = js.clone();
            inflight.push(async move {
                let ack = js.publish("dur.burst", payload.clone().into()).await.ok()?;
                let ack = ack.await.ok()?;
                Some((ack.sequence, payload))
            });
        }
        match inflight.next().await {
            Some(Some((seq, payload))) => {
                acked.lock().unwrap().insert(seq, payload);
            }
            Some(None) => {}
            None => return,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_publish_burst_keeps_every_acked_message() {
    let mut server = Server::start_jetstream();
    let client = server.client().await;
    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: "DUR".into(),
        subjects: vec!["dur.>".into()],
        storage: jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("create stream");

    let acked = Arc::new(Mutex::new(BTreeMap::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks: Vec<_> = (0..4)
        .map(|t| tokio::spawn(burst(js.clone(), stop.clone(), acked.clone(), t)))
        .collect();
    // Kill once a good number of acks came back, with many more still in flight.
    within("acks before the kill", async {
        while acked.lock().unwrap().len() < 3000 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    server.kill_hard();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() >= 3000);

    server.restart();
    let client = server.client().await;
    let js = jetstream::new(client);
    let mut stream = js.get_stream("DUR").await.expect("stream survives");
    let info = stream.info().await.expect("info");
    let last_acked = *acked.keys().last().unwrap();
    assert!(
        info.state.last_sequence >= last_acked,
        "last seq {} < last acked {last_acked}",
        info.state.last_sequence
    );
    for (seq, payload) in &acked {
        let m = stream
            .get_raw_message(*seq)
            .await
            .unwrap_or_else(|e| panic!("acked seq {seq} lost after SIGKILL: {e}"));
        assert_eq!(
            std::str::from_utf8(&m.payload).unwrap(),
            payload,
            "seq {seq} content"
        );
    }
}

#[tokio::test]
async fn clean_restart_keeps_stream_and_state() {
    let mut server = Server::start_jetstream();
    let js = jetstream::new(server.client().await);
    js.create_stream(jetstream::stream::Config {
        name: "CLEAN".into(),
        subjects: vec!["clean.*".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    for i in 0..500u32 {
        js.publish(format!("clean.{}", i % 5), i.to_string().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let before = js
        .get_stream("CLEAN")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .clone();
    server.restart();
    let js = jetstream::new(server.client().await);
    let mut s = js.get_stream("CLEAN").await.unwrap();
    let after = s.info().await.unwrap().state.clone();
    assert_eq!(before.messages, after.messages);
    assert_eq!(before.bytes, after.bytes);
    assert_eq!(before.first_sequence, after.first_sequence);
    assert_eq!(before.last_sequence, after.last_sequence);
    let m = s.get_last_raw_message_by_subject("clean.4").await.unwrap();
    assert_eq!(&m.payload[..], b"499");
}

/// Overwrites bytes in the middle of the newest segment file: the stream must come back,
/// serve every undamaged message, and never serve the damaged one with wrong content.
#[tokio::test]
async fn damaged_segment_never_deletes_the_stream() {
    if common::is_reference() {
        // The reference's file layout differs; this checks Keel's own store.
        return;
    }
    let mut server = Server::start_jetstream();
    let js = jetstream::new(server.client().await);
    js.create_stream(jetstream::stream::Config {
        name: "DMG".into(),
        subjects: vec!["dmg".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    for i in 0..100u32 {
        js.publish("dmg", format!("payload-{i:04}").into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    server.kill_hard();
    // Find the segment files and flip bytes in the middle of the largest.
    let dir = server.store_dir().unwrap().to_path_buf();
    let mut segs = vec![];
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().contains("/DMG/") && !p.ends_with("keel-meta.json") {
                segs.push(p);
            }
        }
    }
    let seg = segs
        .iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .expect("a segment file");
    let mut bytes = std::fs::read(seg).unwrap();
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 8] {
        *b ^= 0xFF;
    }
    std::fs::write(seg, &bytes).unwrap();

    server.restart();
    let js = jetstream::new(server.client().await);
    let mut s = within("stream after damage", js.get_stream("DMG"))
        .await
        .expect("a damaged stream is still there");
    let info = s.info().await.unwrap();
    assert!(info.state.messages >= 98, "lost too much: {:?}", info.state);
    for seq in 1..=100u64 {
        if let Ok(m) = s.get_raw_message(seq).await {
            assert_eq!(
                std::str::from_utf8(&m.payload).unwrap(),
                format!("payload-{:04}", seq - 1),
                "seq {seq} served with wrong content"
            );
        }
    }
}

/// `jetstream { max_file_store }` is a server-wide budget: a publish that would pass it is
/// refused with the reference's error, and so is a stream reserving more than it.
#[tokio::test]
async fn server_store_limit_is_enforced() {
    let server = Server::start_jetstream_with_config("jetstream { max_file_store: 4KB }\n");
    let client = server.client().await;
    let (_, resp) = common::json_request(
        &client,
        "$JS.API.STREAM.CREATE.BIG",
        r#"{"name":"BIG","subjects":["big"],"max_bytes":1048576}"#,
    )
    .await;
    let (code, err_code, _) = common::api_error(&resp);
    assert_eq!((code, err_code), (500, 10047), "{resp}");

    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: "LIM".into(),
        subjects: vec!["lim".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let payload = vec![b'x'; 200];
    let mut refused = None;
    for i in 0..100 {
        let ack = js
            .publish("lim", payload.clone().into())
            .await
            .unwrap()
            .await;
        if let Err(e) = ack {
            refused = Some((i, e.to_string()));
            break;
        }
    }
    let (i, text) = refused.expect("a publish past the limit is refused");
    assert!(i > 5 && i < 30, "refused after {i} messages");
    assert!(
        text.contains("insufficient") || text.contains("10047"),
        "{text}"
    );
    let info = js
        .get_stream("LIM")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    // Like the reference: the message that crosses the limit is taken, the next refused.
    assert!(info.state.bytes < 4096 + 300, "{:?}", info.state);
}
