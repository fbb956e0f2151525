//! End-to-end tests of the commands that go through the system account (`server ping`,
//! `list`, `info`, `report connections|jetstream`, `check ...`) and of `consumer
//! pause|resume|reset`. Each runs the `keel` binary against keel-server, and against
//! the reference nats-server with `KEEL_TEST_REFERENCE=1` (see tests/common/mod.rs).

mod common;

use std::process::Output;

use common::{contains_all, start, start_with_config, text, Server};
use serde_json::Value;

const SYS_CONF: &str = "accounts {
  SYS: { users: [{user: sys, password: sys}] }
  APP: { jetstream: enabled, users: [{user: a, password: a}] }
}
system_account: SYS
";

const SYS: [&str; 4] = ["--user", "sys", "--password", "sys"];
const APP: [&str; 4] = ["--user", "a", "--password", "a"];

fn with(creds: &[&str], args: &[&str]) -> Vec<String> {
    args.iter()
        .chain(creds.iter())
        .map(|s| s.to_string())
        .collect()
}

fn run(srv: &Server, creds: &[&str], args: &[&str]) -> Output {
    let all = with(creds, args);
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    srv.keel(&refs)
}

fn ok(srv: &Server, creds: &[&str], args: &[&str]) -> String {
    let all = with(creds, args);
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    srv.ok(&refs)
}

/// Runs a check and returns (exit code, stdout).
fn check(srv: &Server, creds: &[&str], args: &[&str]) -> (i32, String) {
    let mut all = vec!["server", "check"];
    all.extend(args);
    let out = run(srv, creds, &all);
    assert!(
        out.stderr.is_empty() || !text(&out.stderr).contains("panicked"),
        "{}",
        text(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text(&out.stdout))
}

#[test]
fn server_commands_answer_through_the_system_account() {
    let Some(srv) = start_with_config(SYS_CONF) else {
        return;
    };
    // The server's name and ID, from the ping's JSON (one server: `1` stops waiting).
    let v: Value = serde_json::from_str(&ok(&srv, &SYS, &["server", "ping", "1", "--json"]))
        .expect("ping --json");
    let list = v.as_array().expect("array of replies");
    assert_eq!(list.len(), 1, "{v}");
    let name = list[0]["name"].as_str().unwrap().to_string();
    let id = list[0]["id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 56, "{v}");

    // Without the expected count the first reply's active_servers says when to stop.
    let out = ok(&srv, &SYS, &["server", "ping"]);
    let first = out.lines().next().unwrap_or("");
    assert!(first.starts_with(&name) && first.contains(" rtt="), "{out}");
    contains_all(&out, &["---- ping statistics ----", "1 replies max: "]);
    assert!(!out.contains("Missing"), "{out}");
    let out = ok(&srv, &SYS, &["server", "ping", "--id", "1"]);
    assert!(out.starts_with(&format!("{id} {name}")), "{out}");

    let out = ok(&srv, &SYS, &["server", "list", "1"]);
    contains_all(
        &out,
        &[
            "Server Overview",
            "│ Name ",
            "│ JS ",
            "│ Uptime",
            "│ RTT ",
            &name,
            " yes ",
        ],
    );

    // info by name, by ID, and of any server.
    for who in [name.as_str(), id.as_str()] {
        let out = ok(&srv, &SYS, &["server", "info", who]);
        contains_all(
            &out,
            &[
                &format!("Server information for {name}"),
                "Process Details:",
                "Connection Details:",
                "Auth Required: true",
                "JetStream:",
                "Storage Directory: ",
                "Statistics:",
            ],
        );
    }
    let v: Value = serde_json::from_str(&ok(&srv, &SYS, &["server", "info", "--json"])).unwrap();
    assert_eq!(v["server_name"], name.as_str(), "{v}");
    assert_eq!(v["auth_required"], true, "{v}");
    let err = text(
        &run(
            &srv,
            &SYS,
            &["server", "info", "no-such-server", "--timeout", "1s"],
        )
        .stderr,
    );
    assert!(err.contains("no server named or with ID"), "{err}");

    // A stream in APP shows in the JetStream report, in total and for the account.
    ok(
        &srv,
        &APP,
        &["stream", "add", "ORDERS", "--subjects", "orders.>"],
    );
    for k in 0..3 {
        ok(&srv, &APP, &["pub", &format!("orders.{k}"), "x"]);
    }
    let out = ok(&srv, &SYS, &["server", "report", "jetstream"]);
    contains_all(
        &out,
        &[
            "JetStream Summary",
            "│ Streams │ Consumers │ Messages │",
            &name,
        ],
    );
    let v: Value = serde_json::from_str(&ok(
        &srv,
        &SYS,
        &["server", "report", "jetstream", "--json"],
    ))
    .unwrap();
    assert_eq!(v[0]["data"]["streams"], 1, "{v}");
    assert_eq!(v[0]["data"]["messages"], 3, "{v}");
    let out = ok(
        &srv,
        &SYS,
        &["server", "report", "jetstream", "--account", "APP"],
    );
    contains_all(&out, &["JetStream Summary for Account APP"]);
    let row = out.lines().find(|l| l.contains(&name)).expect("server row");
    let cells: Vec<&str> = row.split('│').map(str::trim).collect();
    // Server, Cluster, Streams, Consumers, Messages.
    assert_eq!(&cells[3..6], ["1", "0", "3"], "{out}");

    // The connections report lists this very connection (in SYS).
    let out = ok(&srv, &SYS, &["server", "report", "connections"]);
    contains_all(
        &out,
        &[
            "Top 1 Connections out of 1 by subs",
            "│ CID │ Name ",
            "keel-cli",
            " SYS ",
            "Connections per server",
        ],
    );
    let v: Value = serde_json::from_str(&ok(
        &srv,
        &SYS,
        &["server", "report", "connections", "--json"],
    ))
    .unwrap();
    assert_eq!(v[0]["account"], "SYS", "{v}");
    assert_eq!(v[0]["server"]["name"], name.as_str(), "{v}");
    // The CLI's earlier APP connections are closed: `--state closed` (sent as the
    // reference's numeric state) lists them, the open SYS one is not there.
    let v: Value = serde_json::from_str(&ok(
        &srv,
        &SYS,
        &[
            "server",
            "report",
            "connections",
            "--state",
            "closed",
            "--json",
        ],
    ))
    .unwrap();
    let conns = v.as_array().expect("a list");
    assert!(conns.iter().any(|c| c["account"] == "APP"), "{v}");
    assert!(
        conns
            .iter()
            .all(|c| c["account"] != "SYS" || c["stop"].is_string()),
        "{v}"
    );
    // Nobody of APP is connected during the report.
    let err = text(
        &run(
            &srv,
            &SYS,
            &["server", "report", "connections", "--account", "APP"],
        )
        .stderr,
    );
    assert!(
        err.contains("did not get results from any servers"),
        "{err}"
    );

    // A user outside the system account is told why nothing answers.
    for args in [
        &["server", "ping"][..],
        &["server", "list"][..],
        &["server", "info"][..],
        &["server", "report", "jetstream"][..],
    ] {
        let out = run(&srv, &APP, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = text(&out.stderr);
        assert!(
            err.contains("no responders on $SYS.REQ.SERVER.PING") && err.contains("system account"),
            "{args:?}: {err}"
        );
    }

    // `check server` asks the named server's VARZ.
    let (code, out) = check(
        &srv,
        &SYS,
        &[
            "server",
            "--name",
            &name,
            "--js-required",
            "--auth-required",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with(&format!(
            "OK {name} OK:JetStream enabled OK:Authentication required | uptime="
        )),
        "{out}"
    );
    contains_all(&out, &[" connections=1 ", " subscriptions="]);
    // One connection (this check's own) reaches a warning threshold of 1.
    let (code, out) = check(
        &srv,
        &SYS,
        &[
            "server",
            "--name",
            &name,
            "--conn-warn",
            "1",
            "--conn-critical",
            "5",
        ],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.starts_with(&format!("WARNING {name} Warn:Connections 1.00 |")),
        "{out}"
    );
    let (code, out) = check(
        &srv,
        &SYS,
        &["server", "--name", "other", "--timeout", "1s"],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.starts_with("CRITICAL other Crit:varz failed: "),
        "{out}"
    );
}

#[test]
fn checks_use_nagios_output_and_exit_codes() {
    let Some(srv) = start_with_config(SYS_CONF) else {
        return;
    };
    let (code, out) = check(&srv, &APP, &["connection"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with(&format!("OK Connection OK:connected to {} in ", srv.url)),
        "{out}"
    );
    contains_all(
        &out,
        &[
            " OK:rtt time ",
            " OK:round trip took ",
            "| connect_time=",
            ";0.5000;1.0000 rtt=",
            " request_time=",
        ],
    );
    // Nothing listening: critical, exit 2.
    let dead = format!("nats://127.0.0.1:{}", common::free_port());
    let out = common::keel(&["server", "check", "connection", "-s", &dead]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stdout).starts_with("CRITICAL Connection Crit:connection failed: "),
        "{}",
        text(&out.stdout)
    );

    ok(
        &srv,
        &APP,
        &["stream", "add", "ORDERS", "--subjects", "orders.>"],
    );
    for k in 0..3 {
        ok(&srv, &APP, &["pub", &format!("orders.{k}"), "x"]);
    }
    let (code, out) = check(&srv, &APP, &["jetstream"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("OK JetStream | memory=0B memory_pct=0%;75;90 "),
        "{out}"
    );
    contains_all(
        &out,
        &[" streams=1 ", " replicas_ok=1 ", " replicas_fail=0"],
    );

    // Fewer messages than a threshold: critical, then warning, then fine.
    let (code, out) = check(
        &srv,
        &APP,
        &["stream", "--stream", "ORDERS", "--msgs-critical", "5"],
    );
    assert_eq!(
        (code, out.as_str()),
        (
            2,
            "CRITICAL ORDERS Crit:3 messages OK:0 sources | messages=3;;5 sources=0\n"
        )
    );
    let (code, out) = check(
        &srv,
        &APP,
        &["stream", "--stream", "ORDERS", "--msgs-warn", "5"],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.starts_with("WARNING ORDERS Warn:3 messages"), "{out}");
    let (code, out) = check(
        &srv,
        &APP,
        &[
            "stream",
            "--stream",
            "ORDERS",
            "--msgs-warn",
            "1",
            "--subjects-warn",
            "5",
            "--subjects-critical",
            "10",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("OK ORDERS OK:3 messages OK:3 subjects OK:0 sources |"),
        "{out}"
    );
    // Thresholds from the stream's metadata, as with nats; a flag overrides them.
    ok(
        &srv,
        &APP,
        &[
            "stream",
            "add",
            "META",
            "--subjects",
            "meta.>",
            "--metadata",
            "io.nats.monitor.msgs-critical=1",
        ],
    );
    let (code, out) = check(&srv, &APP, &["stream", "--stream", "META"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.starts_with("CRITICAL META Crit:0 messages"), "{out}");
    let (code, _) = check(
        &srv,
        &APP,
        &["stream", "--stream", "META", "--msgs-critical", "0"],
    );
    assert_eq!(code, 0);
    let (code, out) = check(&srv, &APP, &["stream", "--stream", "NOPE"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.starts_with("CRITICAL NOPE Crit:could not load info: "),
        "{out}"
    );

    ok(
        &srv,
        &APP,
        &["consumer", "add", "ORDERS", "C", "--pull", "--defaults"],
    );
    let (code, out) = check(
        &srv,
        &APP,
        &[
            "consumer",
            "--stream",
            "ORDERS",
            "--consumer",
            "C",
            "--unprocessed-critical",
            "2",
        ],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.starts_with("CRITICAL ORDERS_C Crit:Unprocessed Messages: 3 | ack_pending=0 "),
        "{out}"
    );
    let (code, out) = check(
        &srv,
        &APP,
        &[
            "consumer",
            "--stream",
            "ORDERS",
            "--consumer",
            "C",
            "--unprocessed-critical",
            "10",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("OK ORDERS_C OK:Unprocessed Messages: 3 |"),
        "{out}"
    );
    contains_all(&out, &[" pending=3;;10 "]);
    // JSON format, as `--format json`.
    let (code, out) = check(
        &srv,
        &APP,
        &[
            "--format",
            "json",
            "consumer",
            "--stream",
            "ORDERS",
            "--consumer",
            "NOPE",
        ],
    );
    assert_eq!(code, 2, "{out}");
    let v: Value = serde_json::from_str(&out).expect("json check");
    assert_eq!(v["status"], "CRITICAL");
    assert_eq!(v["check_suite"], "consumer");
    assert_eq!(v["check_name"], "ORDERS_NOPE");

    ok(&srv, &APP, &["kv", "add", "CFG"]);
    ok(&srv, &APP, &["kv", "put", "CFG", "k", "v"]);
    let (code, out) = check(&srv, &APP, &["kv", "--bucket", "CFG", "--key", "k"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("OK CFG OK:bucket CFG OK:key k found | values=1 bytes="),
        "{out}"
    );
    let (code, out) = check(&srv, &APP, &["kv", "--bucket", "CFG", "--key", "gone"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.starts_with("CRITICAL CFG Crit:key gone not found OK:bucket CFG"),
        "{out}"
    );
    let (code, out) = check(
        &srv,
        &APP,
        &[
            "kv",
            "--bucket",
            "CFG",
            "--values-warn",
            "1",
            "--values-critical",
            "5",
        ],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.starts_with("WARNING CFG Warn:1 values OK:bucket CFG"),
        "{out}"
    );
    let (code, out) = check(&srv, &APP, &["kv", "--bucket", "NOPE"]);
    assert_eq!(
        (code, out.as_str()),
        (2, "CRITICAL NOPE Crit:bucket NOPE not found\n")
    );
}

#[test]
fn consumer_pause_resume_and_reset() {
    let Some(srv) = start(true) else { return };
    srv.ok(&["stream", "add", "ORDERS", "--subjects", "orders.>"]);
    for k in 0..3 {
        srv.ok(&["pub", &format!("orders.{k}"), "x"]);
    }
    srv.ok(&["consumer", "add", "ORDERS", "C", "--pull", "--defaults"]);

    // Without a time: an hour from now, as the answer nats offers when it asks.
    let out = srv.ok(&["consumer", "pause", "ORDERS", "C", "-f"]);
    assert!(out.starts_with("Paused ORDERS > C until "), "{out}");
    assert!(
        out.trim_end().ends_with("(1h0m0s)") || out.contains("(59m59s)"),
        "{out}"
    );
    let v = srv.json(&["consumer", "info", "ORDERS", "C", "--json"]);
    assert_eq!(v["paused"], true, "{v}");
    let info = srv.ok(&["consumer", "info", "ORDERS", "C"]);
    contains_all(
        &info,
        &["Paused Until Deadline: ", "Paused Until: ", " remaining)"],
    );
    // Paused: a pull gets nothing.
    let out = srv.keel(&["consumer", "next", "ORDERS", "C", "--timeout", "500ms"]);
    assert!(
        !text(&out.stdout).contains("orders.0"),
        "{}",
        text(&out.stdout)
    );

    let out = srv.ok(&["consumer", "resume", "ORDERS", "C", "-f"]);
    assert!(
        out.starts_with("Consumer ORDERS > C was resumed while previously paused until "),
        "{out}"
    );
    let v = srv.json(&["consumer", "info", "ORDERS", "C", "--json"]);
    assert_ne!(v["paused"], true, "{v}");
    let err = srv.fails(&["consumer", "resume", "ORDERS", "C", "-f"]);
    assert!(err.contains("consumer is not paused"), "{err}");
    // A time already past does not pause; nonsense is refused before asking the server.
    let err = srv.fails(&[
        "consumer",
        "pause",
        "ORDERS",
        "C",
        "2001-01-01 00:00:00",
        "-f",
    ]);
    assert!(err.contains("consumer failed to pause"), "{err}");
    let err = srv.fails(&["consumer", "pause", "ORDERS", "C", "soon", "-f"]);
    assert!(err.contains("could not parse the pause time"), "{err}");

    // Consume and ack all three, then reset to the start: all three are pending again.
    let out = srv.ok(&["consumer", "next", "ORDERS", "C", "--count", "3"]);
    assert!(out.contains("orders.2"), "{out}");
    assert_eq!(
        srv.json(&["consumer", "info", "ORDERS", "C", "--json"])["num_pending"],
        0
    );
    let out = srv.ok(&["consumer", "reset", "ORDERS", "C", "--sequence", "1", "-f"]);
    contains_all(
        &out,
        &["State for Consumer ORDERS > C", "Unprocessed Messages: 3"],
    );
    let v = srv.json(&["consumer", "info", "ORDERS", "C", "--json"]);
    assert_eq!(v["num_pending"], 3, "{v}");
    let out = srv.ok(&["consumer", "next", "ORDERS", "C"]);
    assert!(out.contains("orders.0"), "{out}");
    let err = srv.fails(&["consumer", "reset", "ORDERS", "NOPE", "-f"]);
    assert!(err.contains("not found"), "{err}");
}
