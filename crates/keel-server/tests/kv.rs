//! Key-value buckets through async-nats' `jetstream::kv`: a bucket is a stream
//! `KV_<bucket>` on `$KV.<bucket>.>`; every operation is a plain JetStream
//! publish / message get / ordered consumer.
//!
//! Run with `KEEL_TEST_REFERENCE=1` to check the expectations against the
//! reference nats-server.

mod common;

use std::time::Duration;

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, Store, UpdateErrorKind};
use async_nats::jetstream::stream::{DiscardPolicy, StorageType};
use async_nats::jetstream::{self, Context};
use async_nats::Client;
use bytes::Bytes;
use common::{api_error, js_setup, json_request, within};
use futures::TryStreamExt;
use serde_json::{json, Value};

async fn bucket(js: &Context, name: &str, history: i64) -> Store {
    within(
        "create_key_value",
        js.create_key_value(kv::Config {
            bucket: name.to_string(),
            history,
            ..Default::default()
        }),
    )
    .await
    .unwrap_or_else(|e| panic!("create bucket {name}: {e}"))
}

/// `state` of the bucket's stream (raw STREAM.INFO).
async fn stream_state(client: &Client, stream: &str) -> Value {
    let (_, info) = json_request(client, &format!("$JS.API.STREAM.INFO.{stream}"), "").await;
    assert!(info.get("error").is_none(), "info {stream}: {info}");
    info["state"].clone()
}

/// The JetStream API error code somewhere in an error's source chain.
fn js_err_code(err: &(dyn std::error::Error + 'static)) -> Option<u64> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(js) = e.downcast_ref::<jetstream::Error>() {
            return Some(js.error_code().0);
        }
        cur = e.source();
    }
    None
}

async fn history(store: &Store, key: &str) -> Vec<kv::Entry> {
    let entries = within("history", store.history(key))
        .await
        .expect("history");
    within("collect history", entries.try_collect::<Vec<_>>())
        .await
        .expect("history entries")
}

async fn keys(store: &Store) -> Vec<String> {
    let keys = within("keys", store.keys()).await.expect("keys");
    let mut keys = within("collect keys", keys.try_collect::<Vec<_>>())
        .await
        .expect("keys entries");
    keys.sort();
    keys
}

#[tokio::test]
async fn bucket_stream_config() {
    let (_server, client, js) = js_setup().await;
    let store = bucket(&js, "cfg", 5).await;
    assert_eq!(store.stream_name, "KV_cfg");

    // The stream async-nats asked for, as the server stored it.
    let stream = js.get_stream("KV_cfg").await.expect("KV_cfg stream");
    let config = &stream.cached_info().config;
    assert_eq!(config.subjects, vec!["$KV.cfg.>"]);
    assert_eq!(config.max_messages_per_subject, 5);
    assert_eq!(config.discard, DiscardPolicy::New);
    assert!(config.deny_delete);
    assert!(!config.deny_purge);
    assert!(config.allow_rollup);
    assert!(config.allow_direct);
    assert_eq!(config.storage, StorageType::File);
    assert_eq!(config.max_messages, -1);
    assert_eq!(config.max_bytes, -1);
    assert_eq!(config.num_replicas, 1);
    assert_eq!(config.duplicate_window, Duration::from_secs(120));

    // Opening it again by name works; a missing bucket is an error.
    let again = within("get_key_value", js.get_key_value("cfg"))
        .await
        .expect("get_key_value cfg");
    assert_eq!(again.stream_name, "KV_cfg");
    assert!(within("get_key_value nope", js.get_key_value("nope"))
        .await
        .is_err());

    // Creating the same bucket again with the same settings is fine.
    bucket(&js, "cfg", 5).await;

    // The exact request nats-py 2.16 sends for create_key_value(bucket='py', history=5).
    let body = r#"{"name": "KV_py", "subjects": ["$KV.py.>"], "max_consumers": -1, "max_msgs": -1, "discard": "new", "discard_new_per_subject": false, "max_msgs_per_subject": 5, "num_replicas": 1, "no_ack": false, "duplicate_window": 120000000000, "sealed": false, "deny_delete": true, "deny_purge": false, "allow_rollup_hdrs": true, "allow_msg_ttl": true, "max_age": 0}"#;
    let (_, resp) = json_request(&client, "$JS.API.STREAM.CREATE.KV_py", body).await;
    assert!(resp.get("error").is_none(), "{resp}");
    let cfg = &resp["config"];
    let expected = json!({
        "name": "KV_py", "subjects": ["$KV.py.>"], "retention": "limits", "max_consumers": -1,
        "max_msgs": -1, "max_bytes": -1, "max_age": 0, "max_msgs_per_subject": 5,
        "max_msg_size": -1, "discard": "new", "storage": "file", "num_replicas": 1,
        "duplicate_window": 120_000_000_000u64, "compression": "none", "allow_direct": false,
        "mirror_direct": false, "sealed": false, "deny_delete": true, "deny_purge": false,
        "allow_rollup_hdrs": true, "consumer_limits": {}, "allow_msg_ttl": true,
    });
    for (k, v) in expected.as_object().unwrap() {
        assert_eq!(&cfg[k], v, "config.{k}: {cfg}");
    }
    // allow_msg_ttl raises the required API level.
    assert_eq!(cfg["metadata"]["_nats.req.level"], "1", "{cfg}");
    let py = within("get_key_value py", js.get_key_value("py"))
        .await
        .expect("bucket made by the raw request");
    py.put("k", "v".into()).await.expect("put into py");
    assert_eq!(py.get("k").await.expect("get"), Some(Bytes::from("v")));
}

#[tokio::test]
async fn put_get_and_revisions() {
    let (_server, client, js) = js_setup().await;
    let store = bucket(&js, "pg", 5).await;

    assert_eq!(store.put("app.color", "blue".into()).await.expect("put"), 1);
    assert_eq!(store.put("app.size", "L".into()).await.expect("put"), 2);
    assert_eq!(store.put("app.color", "red".into()).await.expect("put"), 3);

    assert_eq!(
        store.get("app.color").await.expect("get"),
        Some(Bytes::from("red"))
    );
    let entry = store
        .entry("app.color")
        .await
        .expect("entry")
        .expect("present");
    assert_eq!(entry.key, "app.color");
    assert_eq!(entry.revision, 3);
    assert_eq!(entry.operation, Operation::Put);
    assert_eq!(entry.bucket, "pg");

    let old = store
        .entry_for_revision("app.color", 1)
        .await
        .expect("entry_for_revision")
        .expect("revision 1 present");
    assert_eq!(old.value, Bytes::from("blue"));
    // A revision that belongs to another key is not this key's entry.
    assert!(store
        .entry_for_revision("app.color", 2)
        .await
        .expect("entry_for_revision")
        .is_none());

    assert_eq!(store.get("missing").await.expect("get missing"), None);

    // The values are plain stream messages on $KV.<bucket>.<key>.
    let (_, resp) = json_request(
        &client,
        "$JS.API.STREAM.MSG.GET.KV_pg",
        r#"{"last_by_subj":"$KV.pg.app.color"}"#,
    )
    .await;
    assert_eq!(resp["message"]["subject"], "$KV.pg.app.color");
    assert_eq!(resp["message"]["seq"], 3);
    assert_eq!(resp["message"]["data"], "cmVk");
    let (_, resp) = json_request(
        &client,
        "$JS.API.STREAM.MSG.GET.KV_pg",
        r#"{"last_by_subj":"$KV.pg.nope"}"#,
    )
    .await;
    assert_eq!(
        api_error(&resp),
        (404, 10037, "no message found".to_string())
    );

    let st = stream_state(&client, "KV_pg").await;
    assert_eq!(st["messages"], 3);
    assert_eq!(st["num_subjects"], 2);
}

#[tokio::test]
async fn update_and_create_with_expected_revision() {
    let (_server, _client, js) = js_setup().await;
    let store = bucket(&js, "upd", 5).await;

    // create: only if the key does not exist.
    let rev = store.create("k", "one".into()).await.expect("create");
    assert_eq!(rev, 1);
    let err = store
        .create("k", "again".into())
        .await
        .expect_err("create on an existing key");
    assert_eq!(err.kind(), CreateErrorKind::AlreadyExists);

    // update: only from the current revision.
    let rev = store.update("k", "two".into(), 1).await.expect("update");
    assert_eq!(rev, 2);
    let err = store
        .update("k", "stale".into(), 1)
        .await
        .expect_err("update with a stale revision");
    assert_eq!(err.kind(), UpdateErrorKind::WrongLastRevision);
    assert_eq!(js_err_code(&err), Some(10071));
    let err = store
        .update("fresh", "x".into(), 5)
        .await
        .expect_err("update of a missing key with a revision");
    assert_eq!(err.kind(), UpdateErrorKind::WrongLastRevision);
    assert_eq!(store.get("k").await.unwrap(), Some(Bytes::from("two")));

    // create works again once the key is deleted.
    store.delete("k").await.expect("delete");
    let rev = store
        .create("k", "reborn".into())
        .await
        .expect("create after delete");
    assert_eq!(rev, 4);
    assert_eq!(store.get("k").await.unwrap(), Some(Bytes::from("reborn")));
}

#[tokio::test]
async fn delete_and_purge() {
    let (_server, client, js) = js_setup().await;
    let store = bucket(&js, "dp", 5).await;

    store.put("gone", "1".into()).await.unwrap();
    store.put("gone", "2".into()).await.unwrap();
    store.delete("gone").await.expect("delete");

    // A deleted key reads as missing; its latest entry is the delete marker.
    assert_eq!(store.get("gone").await.expect("get deleted"), None);
    let entry = store
        .entry("gone")
        .await
        .expect("entry")
        .expect("delete marker");
    assert_eq!(entry.operation, Operation::Delete);
    assert_eq!(entry.revision, 3);
    assert!(entry.value.is_empty());
    // Delete keeps the history (marker is one more message).
    let st = stream_state(&client, "KV_dp").await;
    assert_eq!(st["messages"], 3, "{st}");

    // The marker as stored: KV-Operation: DEL header, no data.
    let (_, resp) = json_request(
        &client,
        "$JS.API.STREAM.MSG.GET.KV_dp",
        r#"{"last_by_subj":"$KV.dp.gone"}"#,
    )
    .await;
    let message = &resp["message"];
    assert!(message.get("data").is_none(), "{message}");
    // base64 of "NATS/1.0\r\nKV-Operation: DEL\r\n\r\n"
    assert_eq!(
        message["hdrs"],
        "TkFUUy8xLjANCktWLU9wZXJhdGlvbjogREVMDQoNCg=="
    );

    // Purge drops the older revisions (rollup on the subject).
    store.put("p", "1".into()).await.unwrap();
    store.put("p", "2".into()).await.unwrap();
    store.put("p", "3".into()).await.unwrap();
    store.purge("p").await.expect("purge");
    assert_eq!(store.get("p").await.expect("get purged"), None);
    let entry = store
        .entry("p")
        .await
        .expect("entry")
        .expect("purge marker");
    assert_eq!(entry.operation, Operation::Purge);
    assert_eq!(entry.revision, 7);
    let st = stream_state(&client, "KV_dp").await;
    assert_eq!(st["messages"], 4, "3 for 'gone' + 1 purge marker: {st}");
    let h = history(&store, "p").await;
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].operation, Operation::Purge);

    // The stream behind a bucket denies deleting messages directly.
    let (_, resp) = json_request(&client, "$JS.API.STREAM.MSG.DELETE.KV_dp", r#"{"seq":1}"#).await;
    assert_eq!(
        api_error(&resp),
        (500, 10057, "message delete not permitted".to_string())
    );
}

#[tokio::test]
async fn history_keeps_the_last_n() {
    let (_server, _client, js) = js_setup().await;
    let store = bucket(&js, "hist", 5).await;

    for i in 1..=7 {
        store.put("k", format!("v{i}").into()).await.unwrap();
    }
    store.put("other", "x".into()).await.unwrap();

    let h = history(&store, "k").await;
    let revisions: Vec<u64> = h.iter().map(|e| e.revision).collect();
    let values: Vec<Bytes> = h.iter().map(|e| e.value.clone()).collect();
    assert_eq!(revisions, vec![3, 4, 5, 6, 7]);
    assert_eq!(
        values,
        (3..=7)
            .map(|i| Bytes::from(format!("v{i}")))
            .collect::<Vec<_>>()
    );
    assert!(h
        .iter()
        .all(|e| e.key == "k" && e.operation == Operation::Put));

    store.delete("k").await.unwrap();
    let h = history(&store, "k").await;
    assert_eq!(h.len(), 5, "history 5 keeps 5 including the marker");
    assert_eq!(h.last().unwrap().operation, Operation::Delete);
    assert_eq!(h.first().unwrap().revision, 4);

    // A key without any entry has an empty history.
    assert!(history(&store, "never").await.is_empty());
}

#[tokio::test]
async fn keys_skip_deleted_and_purged() {
    let (_server, client, js) = js_setup().await;
    let store = bucket(&js, "keys", 3).await;
    assert!(keys(&store).await.is_empty(), "empty bucket has no keys");

    for key in ["a", "b", "c", "d.e"] {
        store.put(key, "v".into()).await.unwrap();
    }
    store.put("a", "v2".into()).await.unwrap();
    assert_eq!(keys(&store).await, vec!["a", "b", "c", "d.e"]);

    store.delete("b").await.unwrap();
    store.purge("c").await.unwrap();
    assert_eq!(keys(&store).await, vec!["a", "d.e"]);

    let status = within("status", store.status()).await.expect("status");
    assert_eq!(status.bucket(), "keys");
    assert_eq!(status.history(), 3);
    let st = stream_state(&client, "KV_keys").await;
    assert_eq!(
        st["messages"], 6,
        "a x2, b + DEL, d.e, c PURGE marker: {st}"
    );
    assert_eq!(st["num_subjects"], 4, "{st}");
}
