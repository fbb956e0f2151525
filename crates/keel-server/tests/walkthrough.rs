//! The two product walkthroughs for durable pull consumers, step by step, as
//! automated tests. Each runs in two variants: the worker process is killed
//! (or stopped) between the steps, or the server itself is SIGKILLed and
//! restarted on the same port and store directory between the steps.
//!
//! The worker is a separate OS process: this test binary re-invoked with
//! `--exact worker_process` and the job in the `KEEL_WALKTHROUGH_WORKER`
//! environment variable. It prints what it receives and acks, one line each,
//! so the test can follow it and SIGKILL it at the right moment.
//!
//! Expectations were pinned against the reference nats-server 2.15.1
//! (`KEEL_TEST_REFERENCE=1`).

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PullConsumer};
use async_nats::Client;
use common::{api_ok, consumer_info, json_request, within, Server};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

const WORKER_ENV: &str = "KEEL_WALKTHROUGH_WORKER";
const SEC: u64 = 1_000_000_000;

/// The reference flushes consumer ack state to disk asynchronously: acks
/// (even AckSync'ed ones) SIGKILLed within ~50 ms were lost in observation,
/// after >= 100 ms they were kept. The server-kill variants wait this long
/// after the last ack before pulling the plug.
const PERSIST_SETTLE: Duration = Duration::from_millis(1000);

// ---------------------------------------------------------------------------
// the worker process
// ---------------------------------------------------------------------------

/// What a worker process does (JSON in `KEEL_WALKTHROUGH_WORKER`).
///
/// * `max`: stop after this many messages (0 = until a no-wait fetch is empty)
/// * `min`: before giving up on an empty consumer, wait (pull with expiry)
///   until at least this many messages arrived (for redeliveries)
/// * `ack`: ack (AckSync) the first `ack` messages (-1 = all)
/// * `hang`: after the work, print `DONE` and wait to be killed instead of
///   exiting
fn worker_job(
    url: &str,
    stream: &str,
    consumer: &str,
    max: u64,
    min: u64,
    ack: i64,
    hang: bool,
) -> String {
    json!({
        "url": url, "stream": stream, "consumer": consumer,
        "max": max, "min": min, "ack": ack, "hang": hang,
    })
    .to_string()
}

/// Not a test of its own: the body of the worker process. Without the
/// environment variable (a normal test run) it returns at once.
#[tokio::test]
async fn worker_process() {
    let Ok(job) = std::env::var(WORKER_ENV) else {
        return;
    };
    let job: Value = serde_json::from_str(&job).expect("worker job JSON");
    // The whole job is bounded; a stuck worker exits on its own.
    match tokio::time::timeout(Duration::from_secs(30), run_worker(&job)).await {
        Ok(()) => {}
        Err(_) => {
            println!("WORKER TIMEOUT");
            std::process::exit(3);
        }
    }
}

async fn run_worker(job: &Value) {
    let url = job["url"].as_str().unwrap();
    let max = job["max"].as_u64().unwrap();
    let min = job["min"].as_u64().unwrap();
    let ack = job["ack"].as_i64().unwrap();
    let client = async_nats::ConnectOptions::new()
        .connect(url)
        .await
        .expect("worker connect");
    let js = jetstream::new(client);
    let consumer: PullConsumer = js
        .get_consumer_from_stream(
            job["consumer"].as_str().unwrap(),
            job["stream"].as_str().unwrap(),
        )
        .await
        .expect("worker binds the consumer");
    let mut got: u64 = 0;
    loop {
        if max > 0 && got >= max {
            break;
        }
        let want = if max > 0 { (max - got) as usize } else { 100 };
        let mut batch = if got < min {
            consumer
                .batch()
                .max_messages(want)
                .expires(Duration::from_millis(500))
                .messages()
                .await
                .expect("worker pull")
        } else {
            consumer
                .fetch()
                .max_messages(want)
                .messages()
                .await
                .expect("worker fetch")
        };
        let mut n = 0;
        while let Some(m) = batch.next().await {
            let m = m.expect("worker message");
            n += 1;
            got += 1;
            let info = m.info().expect("ack subject");
            let (sseq, delivered) = (info.stream_sequence, info.delivered);
            println!(
                "WORKER MSG {sseq} {delivered} {}",
                String::from_utf8_lossy(&m.payload)
            );
            if ack < 0 || got <= ack as u64 {
                m.double_ack().await.expect("worker ack");
                println!("WORKER ACK {sseq}");
            }
        }
        if n == 0 && got >= min {
            break;
        }
    }
    println!("WORKER DONE");
    if job["hang"].as_bool().unwrap() {
        // Wait to be killed (the outer timeout bounds this).
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
}

/// A running worker process and its output.
struct Worker {
    child: Child,
    lines: tokio::io::Lines<BufReader<ChildStdout>>,
    /// (stream seq, delivery count, payload) of every message it received.
    received: Vec<(u64, i64, String)>,
    /// Stream seqs it acked (AckSync, so the server has processed them).
    acked: Vec<u64>,
}

impl Worker {
    fn spawn(job: String) -> Worker {
        let exe = std::env::current_exe().expect("current exe");
        let mut child = Command::new(exe)
            .args([
                "worker_process",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WORKER_ENV, job)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn worker process");
        let stdout = child.stdout.take().expect("worker stdout");
        Worker {
            child,
            lines: BufReader::new(stdout).lines(),
            received: Vec::new(),
            acked: Vec::new(),
        }
    }

    /// Reads the worker's report until `WORKER DONE`.
    async fn wait_done(&mut self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .expect("worker did not finish in time")
                .expect("read worker output")
                .expect("worker exited before DONE");
            // libtest's "test worker_process ... " may precede the first
            // report on the same line.
            let Some(at) = line.find("WORKER ") else {
                continue;
            };
            let rest = &line[at + "WORKER ".len()..];
            let mut parts = rest.splitn(4, ' ');
            match parts.next() {
                Some("MSG") => {
                    let sseq = parts.next().unwrap().parse().unwrap();
                    let delivered = parts.next().unwrap().parse().unwrap();
                    let payload = parts.next().unwrap_or("").to_string();
                    self.received.push((sseq, delivered, payload));
                }
                Some("ACK") => self.acked.push(parts.next().unwrap().parse().unwrap()),
                Some("DONE") => return,
                other => panic!("worker: {other:?} {line}"),
            }
        }
    }

    /// SIGKILLs the worker process.
    async fn kill(mut self) {
        self.child.start_kill().expect("kill worker");
        within("worker exit", self.child.wait())
            .await
            .expect("wait worker");
    }

    /// Waits for a worker that finishes on its own; it must exit cleanly.
    async fn exit(mut self) {
        let status = within("worker exit", self.child.wait())
            .await
            .expect("wait worker");
        assert!(status.success(), "worker exited with {status}");
    }

    fn payloads(&self) -> Vec<&str> {
        self.received.iter().map(|(_, _, p)| p.as_str()).collect()
    }
}

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

async fn publish(client: &Client, subject: &str, payload: &str) -> u64 {
    let (text, ack) = json_request(client, subject, payload.to_string()).await;
    assert!(ack.get("error").is_none(), "publish {subject}: {text}");
    ack["seq"].as_u64().expect("PubAck seq")
}

fn seqs(v: &Value) -> (u64, u64) {
    (
        v["consumer_seq"].as_u64().unwrap(),
        v["stream_seq"].as_u64().unwrap(),
    )
}

/// `(ack_floor.stream_seq, num_ack_pending, num_pending, delivered.stream_seq)`
fn summary(info: &Value) -> (u64, u64, u64, u64) {
    (
        seqs(&info["ack_floor"]).1,
        info["num_ack_pending"].as_u64().unwrap(),
        info["num_pending"].as_u64().unwrap(),
        seqs(&info["delivered"]).1,
    )
}

/// SIGKILLs the server and starts it again on the same port and store.
async fn crash_and_restart(server: &mut Server) -> Client {
    server.kill_hard();
    server.restart();
    server.client().await
}

// ---------------------------------------------------------------------------
// walkthrough 1: ORDERS on orders.>, durable order-worker
// ---------------------------------------------------------------------------

/// Stream ORDERS (`orders.>`, limits retention, max age 24 h, file storage),
/// durable pull consumer `order-worker` (explicit ack, deliver all) and the
/// three orders `{"id":1}`, `{"id":2}`, `{"id":3}` on `orders.new`.
async fn walkthrough1_setup(ack_wait: Option<Duration>) -> (Server, Client) {
    let server = Server::start_jetstream();
    let client = server.client().await;
    let stream = api_ok(
        &client,
        "$JS.API.STREAM.CREATE.ORDERS",
        json!({
            "name": "ORDERS", "subjects": ["orders.>"], "retention": "limits",
            "max_age": 24 * 3600 * SEC, "storage": "file",
        }),
    )
    .await;
    assert_eq!(stream["config"]["max_age"], 24 * 3600 * SEC);
    assert_eq!(stream["config"]["storage"], "file");
    let mut config = json!({
        "durable_name": "order-worker", "ack_policy": "explicit", "deliver_policy": "all",
    });
    if let Some(wait) = ack_wait {
        config["ack_wait"] = json!(wait.as_nanos() as u64);
    }
    let created = api_ok(
        &client,
        "$JS.API.CONSUMER.CREATE.ORDERS.order-worker",
        json!({"stream_name": "ORDERS", "config": config}),
    )
    .await;
    assert_eq!(created["config"]["durable_name"], "order-worker");
    for id in 1..=3 {
        let seq = publish(&client, "orders.new", &format!("{{\"id\":{id}}}")).await;
        assert_eq!(seq, id);
    }
    (server, client)
}

/// How the first worker goes away.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Interruption {
    /// The worker process is SIGKILLed.
    WorkerKilled,
    /// The server is SIGKILLed and restarted (the worker is killed too).
    ServerKilled,
}

/// Walkthrough 1. `delivered_third`: the first worker fetched all three
/// orders (the third is delivered but never acked; ack_wait 2 s) instead of
/// only the first two (the third never delivered).
async fn walkthrough1(interruption: Interruption, delivered_third: bool) {
    let ack_wait = delivered_third.then_some(Duration::from_secs(2));
    let (mut server, mut client) = walkthrough1_setup(ack_wait).await;
    let fetch = if delivered_third { 3 } else { 2 };

    // A worker acks the first two orders ...
    let mut worker = Worker::spawn(worker_job(
        &server.url(),
        "ORDERS",
        "order-worker",
        fetch,
        fetch,
        2,
        true,
    ));
    worker.wait_done().await;
    let mut expected = vec![
        (1, 1, r#"{"id":1}"#.to_string()),
        (2, 1, r#"{"id":2}"#.to_string()),
    ];
    if delivered_third {
        expected.push((3, 1, r#"{"id":3}"#.to_string()));
    }
    assert_eq!(worker.received, expected);
    assert_eq!(worker.acked, vec![1, 2]);

    // ... and is killed (or the server dies under it).
    match interruption {
        Interruption::WorkerKilled => worker.kill().await,
        Interruption::ServerKilled => {
            tokio::time::sleep(PERSIST_SETTLE).await;
            client = crash_and_restart(&mut server).await;
            worker.kill().await;
        }
    }

    // Consumer info: ack floor at stream seq 2, one message outstanding:
    // delivered-but-unacked (num_ack_pending 1) or never delivered
    // (num_pending 1).
    let info = consumer_info(&client, "ORDERS", "order-worker").await;
    if delivered_third {
        assert_eq!(summary(&info), (2, 1, 0, 3), "{info}");
        assert_eq!(seqs(&info["ack_floor"]), (2, 2));
    } else {
        assert_eq!(summary(&info), (2, 0, 1, 2), "{info}");
        assert_eq!(seqs(&info["ack_floor"]), (2, 2));
    }
    assert_eq!(info["num_redelivered"], 0);
    let stream = api_ok(&client, "$JS.API.STREAM.INFO.ORDERS", Value::Null).await;
    assert_eq!(stream["state"]["messages"], 3, "limits retention keeps all");

    // A restarted worker receives only order 3: at once if it was never
    // delivered, after ack_wait (delivery count 2) if it was.
    let started = Instant::now();
    let mut again = Worker::spawn(worker_job(
        &server.url(),
        "ORDERS",
        "order-worker",
        0,
        1,
        -1,
        false,
    ));
    again.wait_done().await;
    let took = started.elapsed();
    let delivered = if delivered_third { 2 } else { 1 };
    assert_eq!(
        again.received,
        vec![(3, delivered, r#"{"id":3}"#.to_string())]
    );
    assert_eq!(again.acked, vec![3]);
    again.exit().await;
    if delivered_third && interruption == Interruption::WorkerKilled {
        // Not before the 2 s ack wait of the first delivery ran out (the
        // worker started well within it).
        assert!(
            took >= Duration::from_millis(1000),
            "redelivered after {took:?}"
        );
    }

    let info = consumer_info(&client, "ORDERS", "order-worker").await;
    assert_eq!(summary(&info), (3, 0, 0, 3), "{info}");
    // num_redelivered counts outstanding redelivered messages: 0 once acked.
    assert_eq!(info["num_redelivered"], 0, "{info}");
    assert_eq!(
        seqs(&info["ack_floor"]).0,
        if delivered_third { 4 } else { 3 }
    );
}

#[tokio::test]
async fn walkthrough1_worker_killed_third_delivered() {
    walkthrough1(Interruption::WorkerKilled, true).await;
}

#[tokio::test]
async fn walkthrough1_worker_killed_third_never_delivered() {
    walkthrough1(Interruption::WorkerKilled, false).await;
}

#[tokio::test]
async fn walkthrough1_server_killed_third_delivered() {
    walkthrough1(Interruption::ServerKilled, true).await;
}

#[tokio::test]
async fn walkthrough1_server_killed_third_never_delivered() {
    walkthrough1(Interruption::ServerKilled, false).await;
}

// ---------------------------------------------------------------------------
// walkthrough 2: ORDERS on ORDERS.*, durable order-processor
// ---------------------------------------------------------------------------

async fn walkthrough2(interruption: Interruption) {
    let mut server = Server::start_jetstream();
    let mut client = server.client().await;
    let stream = api_ok(
        &client,
        "$JS.API.STREAM.CREATE.ORDERS",
        json!({"name": "ORDERS", "subjects": ["ORDERS.*"], "storage": "file"}),
    )
    .await;
    assert_eq!(stream["config"]["storage"], "file");
    // Through async-nats this time: durable, explicit ack, ack wait 30 s.
    let js = jetstream::new(client.clone());
    let consumer: PullConsumer = js
        .get_stream("ORDERS")
        .await
        .expect("get stream")
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("order-processor".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .expect("create order-processor");
    assert_eq!(
        consumer.cached_info().config.ack_wait,
        Duration::from_secs(30)
    );

    for n in 1..=5 {
        publish(&client, "ORDERS.new", &format!("order-{n}")).await;
    }

    // The worker processes all five and stops.
    let mut worker = Worker::spawn(worker_job(
        &server.url(),
        "ORDERS",
        "order-processor",
        0,
        0,
        -1,
        false,
    ));
    worker.wait_done().await;
    assert_eq!(
        worker.payloads(),
        ["order-1", "order-2", "order-3", "order-4", "order-5"]
    );
    assert_eq!(worker.acked, vec![1, 2, 3, 4, 5]);
    worker.exit().await;
    let info = consumer_info(&client, "ORDERS", "order-processor").await;
    assert_eq!(summary(&info), (5, 0, 0, 5), "{info}");

    if interruption == Interruption::ServerKilled {
        tokio::time::sleep(PERSIST_SETTLE).await;
        client = crash_and_restart(&mut server).await;
    }

    // Five more orders while the worker is away.
    for n in 6..=10 {
        publish(&client, "ORDERS.new", &format!("order-{n}")).await;
    }
    if interruption == Interruption::ServerKilled {
        client = crash_and_restart(&mut server).await;
    }
    let info = consumer_info(&client, "ORDERS", "order-processor").await;
    assert_eq!(summary(&info), (5, 0, 5, 5), "{info}");

    // Restarted: exactly the five new ones, in order.
    let mut worker = Worker::spawn(worker_job(
        &server.url(),
        "ORDERS",
        "order-processor",
        0,
        0,
        -1,
        false,
    ));
    worker.wait_done().await;
    assert_eq!(
        worker.payloads(),
        ["order-6", "order-7", "order-8", "order-9", "order-10"]
    );
    assert_eq!(
        worker
            .received
            .iter()
            .map(|r| (r.0, r.1))
            .collect::<Vec<_>>(),
        vec![(6, 1), (7, 1), (8, 1), (9, 1), (10, 1)]
    );
    worker.exit().await;

    let info = consumer_info(&client, "ORDERS", "order-processor").await;
    assert_eq!(seqs(&info["ack_floor"]), (10, 10), "{info}");
    assert_eq!(summary(&info), (10, 0, 0, 10), "{info}");
    assert_eq!(info["num_redelivered"], 0);

    // Nothing else is waiting for it.
    let js = jetstream::new(client.clone());
    let consumer: PullConsumer = js
        .get_consumer_from_stream("order-processor", "ORDERS")
        .await
        .expect("get consumer");
    let mut batch = consumer
        .fetch()
        .max_messages(10)
        .messages()
        .await
        .expect("fetch");
    assert!(within("final fetch", batch.next()).await.is_none());
}

#[tokio::test]
async fn walkthrough2_worker_stopped_and_restarted() {
    walkthrough2(Interruption::WorkerKilled).await;
}

#[tokio::test]
async fn walkthrough2_server_killed_between_steps() {
    walkthrough2(Interruption::ServerKilled).await;
}
