//! End-to-end tests of the JetStream commands: the walkthrough lines exactly
//! as a tutorial writes them, the two consumer walkthroughs driven only
//! through `keel`, `--json` shapes, and the errors a person can act on.
//! See tests/common/mod.rs for how the server is chosen.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{contains_all, keel, keel_with_stdin, start, text};
use serde_json::Value;

#[test]
fn walkthrough_lines_work_as_written() {
    let Some(srv) = start(true) else { return };

    // keel stream add ORDERS --subjects 'orders.>' --retention limits --max-age 24h --storage file
    let out = srv.ok(&[
        "stream",
        "add",
        "ORDERS",
        "--subjects",
        "orders.>",
        "--retention",
        "limits",
        "--max-age",
        "24h",
        "--storage",
        "file",
    ]);
    contains_all(
        &out,
        &[
            "Stream ORDERS was created",
            "Information for Stream ORDERS created",
            "Subjects: orders.>",
            "Storage: File",
            "Retention: Limits",
            "Discard Policy: Old",
            "Maximum Age: 1d0h0m0s",
            "Messages: 0",
        ],
    );

    // keel consumer add ORDERS --durable order-worker --ack explicit --deliver all
    let out = srv.ok(&[
        "consumer",
        "add",
        "ORDERS",
        "--durable",
        "order-worker",
        "--ack",
        "explicit",
        "--deliver",
        "all",
    ]);
    contains_all(
        &out,
        &[
            "Consumer ORDERS > order-worker was created",
            "Name: order-worker",
            "Pull Mode: true",
            "Deliver Policy: All",
            "Ack Policy: Explicit",
            "Ack Wait: 30.00s",
        ],
    );

    // keel pub orders.new '{"id":1}'
    let out = srv.keel(&["pub", "orders.new", r#"{"id":1}"#]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("Published 8 bytes to \"orders.new\""));

    // keel consumer info ORDERS order-worker
    let out = srv.ok(&["consumer", "info", "ORDERS", "order-worker"]);
    contains_all(
        &out,
        &[
            "Information for Consumer ORDERS > order-worker created",
            "Acknowledgment Floor: Consumer sequence: 0 Stream sequence: 0",
            "Outstanding Acks: 0",
            "Redelivered Messages: 0",
            "Unprocessed Messages: 1",
            "Waiting Pulls: 0",
        ],
    );

    // keel stream rm ORDERS: with no terminal to ask, refuse and say how.
    let out = keel_with_stdin(&["stream", "rm", "ORDERS", "-s", &srv.url], "y\n");
    assert_eq!(out.status.code(), Some(1));
    contains_all(
        &text(&out.stderr),
        &["Really delete Stream ORDERS", "not a terminal", "-f"],
    );
    srv.ok(&["stream", "info", "ORDERS"]);
    // -f skips the question.
    let out = srv.ok(&["stream", "rm", "ORDERS", "-f"]);
    assert!(out.contains("Stream ORDERS was deleted"), "{out}");
    let err = srv.fails(&["stream", "info", "ORDERS"]);
    assert!(err.contains("stream ORDERS not found"), "{err}");

    // keel stream add ORDERS --subjects="ORDERS.*" --retention=limits --storage=file
    let out = srv.ok(&[
        "stream",
        "add",
        "ORDERS",
        "--subjects=ORDERS.*",
        "--retention=limits",
        "--storage=file",
    ]);
    contains_all(&out, &["Stream ORDERS was created", "Subjects: ORDERS.*"]);

    // keel consumer add ORDERS order-processor --durable --ack explicit --ack-wait=30s
    let out = srv.ok(&[
        "consumer",
        "add",
        "ORDERS",
        "order-processor",
        "--durable",
        "--ack",
        "explicit",
        "--ack-wait=30s",
    ]);
    contains_all(
        &out,
        &[
            "Consumer ORDERS > order-processor was created",
            "Ack Policy: Explicit",
            "Ack Wait: 30.00s",
        ],
    );
    let v = srv.json(&["consumer", "info", "ORDERS", "order-processor", "--json"]);
    assert_eq!(v["config"]["durable_name"], "order-processor");
    assert_eq!(v["config"]["ack_wait"], 30_000_000_000u64);
}

/// Seed walkthrough 1 of the consumers issue, through `keel` only, with the server
/// SIGKILLed and restarted on the same port and store between the acks and the restarted
/// worker (as the README's walkthrough says).
#[test]
fn consumer_walkthrough_one() {
    let Some(mut srv) = start(true) else { return };
    srv.ok(&[
        "stream",
        "add",
        "ORDERS",
        "--subjects",
        "orders.>",
        "--retention",
        "limits",
        "--max-age",
        "24h",
        "--storage",
        "file",
    ]);
    srv.ok(&[
        "consumer",
        "add",
        "ORDERS",
        "--durable",
        "order-worker",
        "--ack",
        "explicit",
        "--deliver",
        "all",
    ]);
    for id in 1..=3 {
        srv.ok(&["pub", "orders.new", &format!(r#"{{"id":{id}}}"#)]);
    }
    // A worker acks the first two.
    let out = srv.ok(&["consumer", "next", "ORDERS", "order-worker", "--count", "2"]);
    contains_all(
        &out,
        &[
            "subj: orders.new / tries: 1 / cons seq: 1 / str seq: 1 / pending: 2",
            r#"{"id":1}"#,
            r#"{"id":2}"#,
            "Acknowledged message",
        ],
    );
    assert!(!out.contains(r#"{"id":3}"#), "{out}");
    // Ack floor stream seq 2, one message pending.
    let v = srv.json(&["consumer", "info", "ORDERS", "order-worker", "--json"]);
    assert_eq!(v["ack_floor"]["stream_seq"], 2, "{v}");
    assert_eq!(v["num_pending"], 1, "{v}");
    assert_eq!(v["num_ack_pending"], 0, "{v}");
    let out = srv.ok(&["consumer", "info", "ORDERS", "order-worker"]);
    contains_all(
        &out,
        &[
            "Acknowledgment Floor: Consumer sequence: 2 Stream sequence: 2",
            "Unprocessed Messages: 1",
        ],
    );

    // The server dies (kill -9) and comes back. `consumer next` acks with AckSync, which
    // Keel confirms only once the ack is on disk; the reference flushes consumer state
    // asynchronously (see PERSIST_SETTLE in crates/keel-server/tests/walkthrough.rs), so
    // against it the kill waits for that flush.
    if common::is_reference() {
        std::thread::sleep(Duration::from_secs(1));
    }
    srv.kill_hard();
    srv.restart();
    let v = srv.json(&["consumer", "info", "ORDERS", "order-worker", "--json"]);
    assert_eq!(v["ack_floor"]["stream_seq"], 2, "after the restart: {v}");
    assert_eq!(v["num_pending"], 1, "after the restart: {v}");
    assert_eq!(v["num_ack_pending"], 0, "after the restart: {v}");

    // The next worker receives only message 3.
    let out = srv.ok(&["consumer", "next", "ORDERS", "order-worker", "--raw"]);
    assert_eq!(out, "{\"id\":3}\n");
    let out = srv.keel(&[
        "consumer",
        "next",
        "ORDERS",
        "order-worker",
        "--timeout",
        "500ms",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no message received"),
        "{}",
        text(&out.stderr)
    );
}

/// Seed walkthrough 2 of the consumers issue, through `keel` only.
#[test]
fn consumer_walkthrough_two() {
    let Some(srv) = start(true) else { return };
    srv.ok(&[
        "stream",
        "add",
        "ORDERS",
        "--subjects=ORDERS.*",
        "--retention=limits",
        "--storage=file",
    ]);
    srv.ok(&[
        "consumer",
        "add",
        "ORDERS",
        "order-processor",
        "--durable",
        "--ack",
        "explicit",
        "--ack-wait=30s",
    ]);
    let out = srv.ok(&[
        "pub",
        "ORDERS.new",
        r#"{"id":{{Count}}}"#,
        "--count",
        "5",
        "--jetstream",
    ]);
    assert!(
        out.contains("Stored in Stream: ORDERS Sequence: 5"),
        "{out}"
    );
    let out = srv.ok(&[
        "consumer",
        "next",
        "ORDERS",
        "order-processor",
        "--count",
        "5",
        "--raw",
    ]);
    let ids: Vec<&str> = out.lines().collect();
    assert_eq!(
        ids,
        [
            r#"{"id":1}"#,
            r#"{"id":2}"#,
            r#"{"id":3}"#,
            r#"{"id":4}"#,
            r#"{"id":5}"#
        ]
    );
    srv.ok(&[
        "pub",
        "ORDERS.new",
        r#"{"id":{{Count}},"batch":2}"#,
        "--count",
        "5",
        "-J",
    ]);
    // Exactly the five new ones, in order.
    let out = srv.ok(&[
        "consumer",
        "next",
        "ORDERS",
        "order-processor",
        "--count",
        "5",
    ]);
    let seqs: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split(" / str seq: ").nth(1))
        .map(|rest| rest.split(' ').next().unwrap())
        .collect();
    assert_eq!(seqs, ["6", "7", "8", "9", "10"], "{out}");
    assert_eq!(out.matches(r#""batch":2"#).count(), 5, "{out}");
    let v = srv.json(&["consumer", "info", "ORDERS", "order-processor", "--json"]);
    assert_eq!(v["ack_floor"]["stream_seq"], 10, "{v}");
    assert_eq!(v["num_pending"], 0, "{v}");
}

#[test]
fn json_output_is_the_api_json() {
    let Some(srv) = start(true) else { return };
    let v = srv.json(&[
        "stream",
        "add",
        "ORDERS",
        "--subjects",
        "orders.>",
        "--max-bytes",
        "1GB",
        "--max-msg-size",
        "512KiB",
        "--max-age",
        "1d",
        "--json",
    ]);
    assert!(v.get("type").is_none(), "the nats CLI prints no type: {v}");
    assert_eq!(v["config"]["name"], "ORDERS");
    assert_eq!(v["config"]["max_bytes"], 1u64 << 30);
    assert_eq!(v["config"]["max_msg_size"], 512 << 10);
    assert_eq!(v["config"]["max_age"], 86_400_000_000_000u64);
    assert_eq!(v["config"]["retention"], "limits");
    assert_eq!(v["config"]["storage"], "file");
    assert_eq!(v["config"]["discard"], "old");
    assert_eq!(v["config"]["num_replicas"], 1);

    // pub --jetstream --json prints the stream's ack.
    let out = srv.ok(&[
        "pub",
        "orders.new",
        r#"{"id":1}"#,
        "-J",
        "--json",
        "-H",
        "Trace:abc",
    ]);
    let ack: Value = serde_json::from_str(out.trim()).expect("ack JSON");
    assert_eq!(ack["stream"], "ORDERS");
    assert_eq!(ack["seq"], 1);

    let v = srv.json(&["stream", "info", "ORDERS", "-j"]);
    assert!(v.get("type").is_none());
    assert_eq!(v["state"]["messages"], 1);
    assert_eq!(v["state"]["first_seq"], 1);
    assert!(v["created"].is_string());

    let v = srv.json(&["stream", "ls", "--json"]);
    assert_eq!(v, serde_json::json!(["ORDERS"]));

    let v = srv.json(&["stream", "get", "ORDERS", "1", "--json"]);
    assert_eq!(v["subject"], "orders.new");
    assert_eq!(v["seq"], 1);
    assert_eq!(v["data"], "eyJpZCI6MX0="); // base64 of {"id":1}
    let out = srv.ok(&["stream", "get", "ORDERS", "1"]);
    contains_all(&out, &["Item: ORDERS#1", "Trace: abc", r#"{"id":1}"#]);

    let v = srv.json(&["stream", "subjects", "ORDERS", "--json"]);
    assert_eq!(v, serde_json::json!({"orders.new": 1}));

    srv.ok(&["consumer", "add", "ORDERS", "c1", "--pull"]);
    let v = srv.json(&["consumer", "info", "ORDERS", "c1", "--json"]);
    assert!(v.get("type").is_none());
    assert_eq!(v["stream_name"], "ORDERS");
    assert_eq!(v["name"], "c1");
    assert_eq!(v["config"]["ack_policy"], "explicit");
    assert_eq!(v["config"]["deliver_policy"], "all");
    for key in [
        "delivered",
        "ack_floor",
        "num_ack_pending",
        "num_redelivered",
        "num_waiting",
        "num_pending",
    ] {
        assert!(v.get(key).is_some(), "consumer info lacks {key}: {v}");
    }
    assert_eq!(v["num_pending"], 1);

    let v = srv.json(&["consumer", "ls", "ORDERS", "--json"]);
    assert_eq!(v, serde_json::json!(["c1"]));

    let v = srv.json(&["account", "info", "--json"]);
    assert_eq!(v["streams"], 1);
    assert_eq!(v["consumers"], 1);
    assert!(v["limits"].is_object());

    // `server ...` needs a system account user; this server's default user is not one.
    let err = srv.fails(&["server", "info"]);
    assert!(
        err.contains("no responders on $SYS.REQ.SERVER.PING"),
        "{err}"
    );
}

#[test]
fn ack_auto_is_none_on_the_wire() {
    let Some(srv) = start(true) else { return };
    srv.ok(&["stream", "add", "ORDERS", "--subjects", "orders.>"]);
    let out = srv.keel(&["consumer", "add", "ORDERS", "auto-worker", "--ack", "auto"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("ack policy \"none\" on the wire"));
    let info = srv.ok(&["consumer", "info", "ORDERS", "auto-worker"]);
    assert!(info.contains("Ack Policy: None (auto"), "{info}");
    let v = srv.json(&["consumer", "info", "ORDERS", "auto-worker", "--json"]);
    assert_eq!(v["config"]["ack_policy"], "none");
    // `all` too.
    srv.ok(&["consumer", "add", "ORDERS", "all-worker", "--ack", "all"]);
    let v = srv.json(&["consumer", "info", "ORDERS", "all-worker", "-j"]);
    assert_eq!(v["config"]["ack_policy"], "all");
}

#[test]
fn stream_and_consumer_edit_purge_and_ls() {
    let Some(srv) = start(true) else { return };
    srv.ok(&[
        "stream",
        "add",
        "ORDERS",
        "--subjects",
        "orders.>",
        "--description",
        "all orders",
    ]);
    let out = srv.ok(&["stream", "edit", "ORDERS", "--max-age", "48h"]);
    contains_all(
        &out,
        &["Stream ORDERS was updated", "Maximum Age: 2d0h0m0s"],
    );
    srv.ok(&["consumer", "add", "ORDERS", "w"]);
    let out = srv.ok(&["consumer", "edit", "ORDERS", "w", "--ack-wait", "1m"]);
    contains_all(&out, &["Consumer ORDERS > w was updated", "Ack Wait: 1m0s"]);
    srv.ok(&["pub", "orders.a", "x", "--count", "3"]);
    let out = srv.ok(&["stream", "ls"]);
    contains_all(&out, &["Streams", "ORDERS", "all orders", "3"]);
    let out = srv.ok(&["consumer", "ls", "ORDERS"]);
    contains_all(&out, &["Consumers", "w", "Unprocessed"]);
    let out = srv.ok(&["stream", "subjects", "ORDERS"]);
    contains_all(&out, &["orders.a", "3"]);
    let err = srv.fails(&["stream", "purge", "ORDERS"]);
    assert!(err.contains("-f"), "{err}");
    let out = srv.ok(&["stream", "purge", "ORDERS", "-f"]);
    contains_all(&out, &["Purged 3 messages from ORDERS", "Messages: 0"]);
    let err = srv.fails(&["consumer", "rm", "ORDERS", "w"]);
    assert!(err.contains("-f"), "{err}");
    assert!(srv
        .ok(&["consumer", "rm", "ORDERS", "w", "-f"])
        .contains("was deleted"));
}

#[test]
fn sub_shows_jetstream_metadata_and_headers() {
    let Some(srv) = start(true) else { return };
    srv.ok(&["stream", "add", "ORDERS", "--subjects", "orders.>"]);
    srv.ok(&["pub", "orders.new", r#"{"id":1}"#, "-H", "Trace:abc", "-J"]);
    let mut sub = common::keel_cmd()
        .args([
            "sub",
            "deliver.orders",
            "--count",
            "1",
            "--ack",
            "-s",
            &srv.url,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keel sub");
    let mut stderr = BufReader::new(sub.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(line.starts_with("Subscribing on"), "{line}");
    srv.ok(&[
        "consumer",
        "add",
        "ORDERS",
        "pusher",
        "--target",
        "deliver.orders",
        "--ack",
        "explicit",
    ]);
    let start = Instant::now();
    while sub.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(20), "sub got nothing");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = sub.wait_with_output().unwrap();
    let stdout = text(&out.stdout);
    contains_all(
        &stdout,
        &[
            "[#1] Received JetStream message: stream: ORDERS seq: 1 / consumer: pusher seq: 1 / delivered: 1 / pending: 0 / subject: orders.new",
            "Trace: abc",
            r#"{"id":1}"#,
        ],
    );
    // --ack acknowledged it.
    let start = Instant::now();
    loop {
        let v = srv.json(&["consumer", "info", "ORDERS", "pusher", "--json"]);
        if v["ack_floor"]["stream_seq"] == 1 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "not acked: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn kv_round_trip() {
    let Some(srv) = start(true) else { return };
    let out = srv.ok(&["kv", "add", "CONFIG", "--history", "5"]);
    assert!(out.contains("Bucket CONFIG was created"), "{out}");
    assert_eq!(srv.ok(&["kv", "put", "CONFIG", "color", "blue"]), "blue\n");
    srv.ok(&["kv", "put", "CONFIG", "color", "red"]);
    assert_eq!(srv.ok(&["kv", "get", "CONFIG", "color", "--raw"]), "red\n");
    let out = srv.ok(&["kv", "get", "CONFIG", "color"]);
    contains_all(&out, &["CONFIG > color revision: 2", "red"]);
    let v = srv.json(&["kv", "get", "CONFIG", "color", "--json"]);
    assert_eq!(v["value"], "red");
    assert_eq!(v["revision"], 2);
    let out = srv.ok(&["kv", "history", "CONFIG", "color"]);
    contains_all(&out, &["blue", "red", "PUT"]);
    let out = srv.ok(&["kv", "watch", "CONFIG", "--history", "--count", "1"]);
    assert!(out.contains("PUT CONFIG > color: red"), "{out}");
    assert_eq!(srv.ok(&["kv", "ls", "CONFIG"]), "color\n");
    assert!(srv.ok(&["kv", "ls"]).contains("CONFIG"));
    assert_eq!(
        srv.json(&["kv", "ls", "--json"]),
        serde_json::json!(["CONFIG"])
    );
    srv.ok(&["kv", "del", "CONFIG", "color", "-f"]);
    let err = srv.fails(&["kv", "get", "CONFIG", "color"]);
    assert!(err.contains("key color not found"), "{err}");
    let err = srv.fails(&["kv", "rm", "CONFIG"]);
    assert!(err.contains("-f"), "{err}");
    srv.ok(&["kv", "rm", "CONFIG", "-f"]);
    let err = srv.fails(&["kv", "get", "CONFIG", "color"]);
    assert!(err.contains("bucket CONFIG not found"), "{err}");
}

#[test]
fn errors_a_person_can_act_on() {
    // No server at the URL.
    let url = format!("nats://127.0.0.1:{}", common::free_port());
    let out = keel(&["stream", "ls", "-s", &url, "--timeout", "2s"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("connection refused"), "{err}");
    assert!(err.contains("is `keel-server -js` running?"), "{err}");

    // A server without JetStream.
    if let Some(plain) = start(false) {
        for args in [
            &["stream", "ls"][..],
            &["stream", "info", "ORDERS"],
            &["consumer", "info", "ORDERS", "w"],
            &["kv", "ls"],
        ] {
            let err = plain.fails(args);
            assert!(
                err.contains("JetStream is not enabled on the server") && err.contains("-js"),
                "{args:?}: {err}"
            );
        }
        let err = plain.fails(&["pub", "orders.new", "x", "--jetstream"]);
        assert!(err.contains("no stream stores subject"), "{err}");
    }

    let Some(srv) = start(true) else { return };
    let err = srv.fails(&["stream", "info", "NOPE"]);
    assert!(err.contains("stream NOPE not found"), "{err}");
    let err = srv.fails(&["consumer", "add", "NOPE", "w"]);
    assert!(err.contains("stream NOPE not found"), "{err}");
    srv.ok(&["stream", "add", "ORDERS", "--subjects", "orders.>"]);
    let err = srv.fails(&["consumer", "info", "ORDERS", "nope"]);
    assert!(err.contains("consumer ORDERS > nope not found"), "{err}");
    let err = srv.fails(&["consumer", "next", "ORDERS", "nope"]);
    assert!(err.contains("consumer ORDERS > nope not found"), "{err}");
    let err = srv.fails(&["pub", "nowhere.x", "x", "-J"]);
    assert!(
        err.contains("no stream stores subject \"nowhere.x\""),
        "{err}"
    );

    // Bad flag values.
    let err = srv.fails(&["stream", "add", "X", "--max-age", "24x"]);
    assert!(err.contains("invalid duration \"24x\""), "{err}");
    let err = srv.fails(&["stream", "add", "X", "--max-bytes", "1XB"]);
    assert!(err.contains("invalid size \"1XB\""), "{err}");
    let err = srv.fails(&["stream", "add", "BAD.NAME"]);
    assert!(err.contains("invalid stream name"), "{err}");
    let err = srv.fails(&["consumer", "add", "ORDERS", "w", "--ack-wait", "soon"]);
    assert!(err.contains("--ack-wait"), "{err}");
    let err = srv.fails(&["consumer", "add", "ORDERS", "w", "--deliver", "sometimes"]);
    assert!(err.contains("invalid --deliver"), "{err}");
    for args in [
        &["stream", "add", "X", "--retention", "sometimes"][..],
        &["stream", "add", "X", "--storage", "tape"],
        &["consumer", "add", "ORDERS", "w", "--ack", "maybe"],
    ] {
        let out = srv.keel(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            text(&out.stderr).contains("invalid value"),
            "{}",
            text(&out.stderr)
        );
    }
    // Nothing was created by the failed commands.
    assert_eq!(
        srv.json(&["stream", "ls", "--json"]),
        serde_json::json!(["ORDERS"])
    );
}

#[test]
fn bench_js_modes_report_json() {
    let Some(srv) = start(true) else { return };
    let v = srv.json(&["bench", "js", "pub", "--msgs", "300", "--json"]);
    assert_eq!(v["mode"], "js-pub");
    assert_eq!(v["pub"]["msgs"], 300);
    let lat = &v["latency_us"];
    assert!(lat["p50"].as_f64().unwrap() > 0.0);
    assert!(lat["p50"].as_f64() <= lat["p99"].as_f64());

    let v = srv.json(&[
        "bench",
        "js",
        "pub-async",
        "--msgs",
        "3000",
        "--inflight",
        "64",
        "--json",
    ]);
    assert_eq!(v["pub"]["msgs"], 3000);
    assert!(v["pub"]["msgs_per_s"].as_f64().unwrap() > 0.0);

    let v = srv.json(&[
        "bench",
        "js",
        "consume-fill",
        "--msgs",
        "3000",
        "--batch",
        "100",
        "--json",
    ]);
    assert_eq!(v["consume"]["msgs"], 3000);

    let v = srv.json(&[
        "bench",
        "js",
        "fanout",
        "--msgs",
        "1000",
        "--consumers",
        "3",
        "--json",
    ]);
    assert_eq!(v["consume"]["msgs"], 3000);

    let pid = srv.pid().to_string();
    let v = srv.json(&[
        "bench",
        "js",
        "consumers-mem",
        "--msgs",
        "200",
        "--consumers",
        "10",
        "--fetch",
        "2",
        "--settle",
        "10ms",
        "--server-pid",
        &pid,
        "--json",
    ]);
    assert_eq!(v["consumers"], 10);
    assert_eq!(v["pending_acks"], 20);
    assert!(v["rss_kib"].as_u64().unwrap() > 0);
    // The benchmark streams are gone afterwards.
    assert_eq!(srv.json(&["stream", "ls", "--json"]), serde_json::json!([]));
}

#[test]
fn help_names_the_nats_commands() {
    let out = keel(&["--help"]);
    let help = text(&out.stdout);
    for cmd in [
        "stream", "consumer", "kv", "account", "server", "bench", "--json", "--creds",
    ] {
        assert!(help.contains(cmd), "keel --help lacks {cmd}");
    }
    let out = keel(&["bench", "js", "--help"]);
    let help = text(&out.stdout);
    for mode in [
        "pub-async",
        "consume-fill",
        "fanout",
        "consumers-mem",
        "p99",
        "pub sync",
        "ordered",
    ] {
        assert!(help.contains(mode), "bench js --help lacks {mode}");
    }
}
