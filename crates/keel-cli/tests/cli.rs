//! End-to-end tests: run the `keel` binary against a real server process.
//!
//! The server is `$KEEL_TEST_SERVER_BIN` if set (`KEEL_TEST_SERVER_BIN=nats-server`
//! uses the one on PATH), else a built `keel-server` from this workspace's
//! target dir. Without either, server-backed tests print a note and pass.
//! Every server gets its own free loopback port, and the tests wait for it to
//! accept connections (never a fixed sleep).

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStderr, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(20);

mod common;

use common::{free_port, keel, text};

/// A plain server (no JetStream) from the shared harness, which waits for the server's own
/// "Listening" log line.
fn start_server() -> Option<common::Server> {
    common::start(false)
}

/// Spawns a long-running keel command and waits for its readiness line on
/// stderr (printed only after the server confirmed the subscription).
fn spawn_ready(args: &[&str], ready_prefix: &str) -> (Child, BufReader<ChildStderr>) {
    let mut child = common::keel_cmd()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keel");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).expect("read keel stderr");
    assert!(
        line.starts_with(ready_prefix),
        "expected {ready_prefix:?}, got {line:?}"
    );
    (child, stderr)
}

/// Waits for a child with a deadline so a lost message fails instead of hanging.
fn finish(mut child: Child, mut stderr: BufReader<ChildStderr>) -> (bool, String, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll keel") {
            break status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("keel did not finish within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    stderr.read_to_string(&mut err).unwrap();
    (status.success(), out, err)
}

#[test]
fn cannot_connect_is_actionable() {
    let url = format!("nats://127.0.0.1:{}", free_port());
    let out = keel(&["pub", "foo", "bar", "-s", &url, "--timeout", "2s"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("cannot connect to {url}: connection refused")),
        "stderr: {err}"
    );
    assert!(err.contains("keel-server"), "stderr: {err}");
}

#[test]
fn bench_help_documents_modes() {
    let out = keel(&["bench", "--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for mode in ["pubsub", "request", "idle", "p50", "--json"] {
        assert!(help.contains(mode), "bench --help lacks {mode}: {help}");
    }
}

#[test]
fn pub_sub_round_trip() {
    let Some(server) = start_server() else { return };
    // Server given through NATS_URL here, and as a flag after the subcommand below.
    let mut sub = common::keel_cmd()
        .args(["sub", "cli.test.>", "--count", "3"])
        .env("NATS_URL", &server.url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keel sub");
    let mut stderr = BufReader::new(sub.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(line.starts_with("Subscribing on"), "got {line:?}");

    let out = keel(&[
        "pub",
        "cli.test.one",
        "msg {{Count}}",
        "--count",
        "3",
        "-H",
        "Trace:abc",
        "-s",
        &server.url,
    ]);
    assert!(out.status.success(), "pub failed: {}", text(&out.stderr));

    let (ok, stdout, err) = finish(sub, stderr);
    assert!(ok, "sub failed: {err}");
    for expected in [
        "[#1] Received on \"cli.test.one\"",
        "Trace: abc",
        "msg 1",
        "msg 2",
        "[#3] Received on \"cli.test.one\"",
        "msg 3",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
}

#[test]
fn request_reply_round_trip() {
    let Some(server) = start_server() else { return };
    let (replier, stderr) = spawn_ready(
        &[
            "-s",
            &server.url,
            "reply",
            "cli.svc",
            "pong {{Count}}",
            "--count",
            "1",
        ],
        "Listening on",
    );
    let out = keel(&["req", "cli.svc", "ping", "--raw", "-s", &server.url]);
    assert!(out.status.success(), "req failed: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "pong 1\n");
    let (ok, stdout, err) = finish(replier, stderr);
    assert!(ok, "reply failed: {err}");
    assert!(stdout.contains("ping"), "replier output: {stdout}");
}

#[test]
fn request_without_responders_fails_fast() {
    let Some(server) = start_server() else { return };
    let out = keel(&[
        "req",
        "nobody.home",
        "x",
        "-s",
        &server.url,
        "--timeout",
        "3s",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("no responders"), "stderr: {err}");
}

fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = keel(args);
    assert!(out.status.success(), "bench failed: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("bench --json prints one JSON object")
}

#[test]
fn bench_modes_report_json() {
    let Some(server) = start_server() else { return };
    let s = server.url.as_str();

    let v = bench_json(&[
        "bench", "pub", "--msgs", "5000", "--pubs", "2", "--json", "-s", s,
    ]);
    assert_eq!(v["mode"], "pub");
    assert_eq!(v["pub"]["msgs"], 5000);
    assert!(v["pub"]["msgs_per_s"].as_f64().unwrap() > 0.0);

    let v = bench_json(&[
        "-s", s, "bench", "--json", "pubsub", "--msgs", "3000", "--subs", "2", "--size", "1KB",
    ]);
    assert_eq!(v["sub"]["msgs"], 6000);
    assert_eq!(v["sub"]["bytes"], 6000 * 1024);

    let v = bench_json(&["bench", "request", "--msgs", "200", "--json", "-s", s]);
    let lat = &v["latency_us"];
    assert!(lat["p50"].as_f64().unwrap() > 0.0);
    assert!(lat["p50"].as_f64() <= lat["p99"].as_f64());

    let v = bench_json(&[
        "bench",
        "idle",
        "--clients",
        "5",
        "--hold",
        "10ms",
        "--json",
        "-s",
        s,
    ]);
    assert_eq!(v["clients"], 5);
}
