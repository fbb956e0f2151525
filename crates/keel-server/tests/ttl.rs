//! Per-message TTL (`Nats-TTL`) on streams with `allow_msg_ttl`: parsing and errors as the
//! reference answers them, expiry on a timer, and TTLs found again after a restart.

mod common;

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use common::Server;
use serde_json::{json, Value};

async fn publish_ttl(client: &async_nats::Client, subject: &str, ttl: &str) -> Value {
    let mut h = HeaderMap::new();
    h.insert("Nats-TTL", ttl);
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        client.request_with_headers(subject.to_string(), h, "x".into()),
    )
    .await
    .expect("ack in time")
    .expect("ack");
    serde_json::from_slice(&reply.payload).unwrap()
}

async fn messages(client: &async_nats::Client, stream: &str) -> u64 {
    let (_, info) =
        common::json_request(client, &format!("$JS.API.STREAM.INFO.{stream}"), "").await;
    info["state"]["messages"].as_u64().unwrap()
}

async fn wait_messages(client: &async_nats::Client, stream: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while messages(client, stream).await != want {
        assert!(
            Instant::now() < deadline,
            "stream {stream} never reached {want} messages"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn ttl_headers_are_checked_and_expire() {
    let mut server = Server::start_jetstream();
    let client = server.client().await;
    let cfg = json!({"name": "T", "subjects": ["t.>"], "allow_msg_ttl": true});
    let (_, r) = common::json_request(&client, "$JS.API.STREAM.CREATE.T", cfg.to_string()).await;
    assert!(r.get("error").is_none(), "{r}");
    let (_, r) = common::json_request(
        &client,
        "$JS.API.STREAM.CREATE.N",
        json!({"name": "N", "subjects": ["n"]}).to_string(),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");

    // Disabled on a stream without allow_msg_ttl; invalid values refused.
    let r = publish_ttl(&client, "n", "5s").await;
    assert_eq!(r["error"]["err_code"], 10166, "{r}");
    for bad in ["nope", "500ms", "-3"] {
        let r = publish_ttl(&client, "t.bad", bad).await;
        assert_eq!(r["error"]["err_code"], 10165, "{bad}: {r}");
        assert_eq!(r["error"]["description"], "invalid per-message TTL");
    }
    assert_eq!(publish_ttl(&client, "t.keep", "never").await["seq"], 1);
    assert_eq!(publish_ttl(&client, "t.long", "1h").await["seq"], 2);
    assert_eq!(publish_ttl(&client, "t.short", "1s").await["seq"], 3);
    assert_eq!(publish_ttl(&client, "t.secs", "2").await["seq"], 4);
    assert_eq!(messages(&client, "T").await, 4);
    // The 1 s and 2 s messages go by themselves, with no further writes.
    wait_messages(&client, "T", 2).await;

    // A TTL set before a restart still expires after it.
    assert_eq!(publish_ttl(&client, "t.again", "2s").await["seq"], 5);
    server.kill_hard();
    server.restart();
    let client = server.client().await;
    assert_eq!(messages(&client, "T").await, 3);
    wait_messages(&client, "T", 2).await;
}
