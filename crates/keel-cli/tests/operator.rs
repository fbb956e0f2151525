//! End-to-end tests of what an operator reaches for daily: contexts shared
//! with the `nats` CLI, connection flags, stream and consumer reports, views,
//! single-message removal, seal, copy, backup and restore, the KV and object
//! store commands, the core tools' new flags, `rtt` and the `nats bench`
//! grammar. Each runs against keel-server, and against the reference
//! nats-server with `KEEL_TEST_REFERENCE=1` (see tests/common/mod.rs).

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, ChildStderr, Stdio};
use std::time::{Duration, Instant};

use common::{contains_all, keel, keel_cmd, start, temp_dir, text, Server};
use serde_json::Value;

/// Runs keel with a context directory of its own.
fn keel_in(config: &Path, args: &[&str]) -> std::process::Output {
    keel_cmd()
        .env("XDG_CONFIG_HOME", config)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run keel")
}

fn ok_in(config: &Path, args: &[&str]) -> String {
    let out = keel_in(config, args);
    assert!(
        out.status.success(),
        "keel {args:?} failed:\nstdout: {}\nstderr: {}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Spawns a long-running keel command and waits for a line on stderr that starts with `ready`.
/// The caller waits for the child (`finish`).
#[allow(clippy::zombie_processes)]
fn spawn_ready(srv: &Server, args: &[&str], ready: &str) -> (Child, BufReader<ChildStderr>) {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["-s", &srv.url]);
    let mut child = keel_cmd()
        .args(&all)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keel");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let deadline = Instant::now() + common::DEADLINE;
    loop {
        let mut line = String::new();
        let ended = err.read_line(&mut line).unwrap_or(0) == 0;
        if !ended && line.starts_with(ready) {
            return (child, err);
        }
        if ended || Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no {ready:?} from keel {args:?}");
        }
    }
}

/// Waits for the child to exit (bounded) and returns (success, stdout, stderr).
fn finish(mut child: Child, mut err: BufReader<ChildStderr>) -> (bool, String, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > common::DEADLINE {
            let _ = child.kill();
            panic!("keel did not finish");
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
    let mut e = String::new();
    err.read_to_string(&mut e).unwrap();
    (status.success(), out, e)
}

#[test]
fn contexts_are_shared_with_the_nats_cli() {
    let Some(srv) = start(true) else { return };
    let cfg = temp_dir("ctx");
    // A context exactly as the nats CLI writes it, selected in context.txt.
    let dir = cfg.join("nats").join("context");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("local.json"),
        format!(
            "{{\n  \"description\": \"made by nats\",\n  \"url\": \"{}\",\n  \"token\": \"\",\n  \"user\": \"\",\n  \"password\": \"\",\n  \"creds\": \"\",\n  \"nkey\": \"\",\n  \"cert\": \"\",\n  \"key\": \"\",\n  \"ca\": \"\",\n  \"nsc\": \"\",\n  \"jetstream_domain\": \"\",\n  \"jetstream_api_prefix\": \"\",\n  \"jetstream_event_prefix\": \"\",\n  \"inbox_prefix\": \"\",\n  \"user_jwt\": \"\",\n  \"color_scheme\": \"\"\n}}",
            srv.url
        ),
    )
    .unwrap();
    std::fs::write(cfg.join("nats").join("context.txt"), "local").unwrap();
    // No -s: the selected context decides where keel connects.
    ok_in(&cfg, &["stream", "add", "CTX", "--subjects", "ctx.>"]);
    assert_eq!(ok_in(&cfg, &["stream", "ls", "--names"]), "CTX\n");
    let out = ok_in(&cfg, &["context", "ls"]);
    contains_all(&out, &["Known Contexts", "local*", "made by nats"]);
    let out = ok_in(&cfg, &["context", "info"]);
    contains_all(&out, &["NATS Configuration Context \"local\"", &srv.url]);

    // keel writes the same files: a second context, selected, with a description.
    let dead = format!("nats://127.0.0.1:{}", common::free_port());
    ok_in(
        &cfg,
        &[
            "context",
            "add",
            "dead",
            "--server",
            &dead,
            "--description",
            "nothing here",
            "--user",
            "al",
            "--password",
            "s3cret",
        ],
    );
    // The password is in the file (as nats writes it), never in keel's output.
    let shown = ok_in(&cfg, &["context", "info", "dead", "--json"]);
    assert!(
        !shown.contains("s3cret") && shown.contains("\"******\""),
        "{shown}"
    );
    assert!(!ok_in(&cfg, &["context", "info", "dead"]).contains("s3cret"));
    assert!(!ok_in(&cfg, &["context", "ls", "--json"]).contains("s3cret"));
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("dead.json")).unwrap()).unwrap();
    assert_eq!(saved["url"], dead.as_str());
    assert_eq!(saved["description"], "nothing here");
    assert_eq!(saved["user"], "al");
    assert_eq!(saved["password"], "s3cret");
    assert_eq!(
        std::fs::read_to_string(cfg.join("nats").join("context.txt")).unwrap(),
        "local",
        "add without --select keeps the selection"
    );
    // --context picks one for a single command; flags beat the context.
    let out = keel_in(
        &cfg,
        &["--context", "dead", "stream", "ls", "--timeout", "2s"],
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("connection refused"),
        "{}",
        text(&out.stderr)
    );
    ok_in(
        &cfg,
        &["--context", "dead", "-s", &srv.url, "stream", "info", "CTX"],
    );
    ok_in(
        &cfg,
        &[
            "--context",
            "dead",
            "--no-context",
            "-s",
            &srv.url,
            "stream",
            "info",
            "CTX",
        ],
    );
    let out = keel_in(&cfg, &["--context", "nope", "stream", "ls"]);
    assert!(
        text(&out.stderr).contains("unknown context \"nope\""),
        "{}",
        text(&out.stderr)
    );

    // select, edit in $EDITOR (unknown keys kept), rm.
    ok_in(&cfg, &["context", "select", "dead"]);
    assert_eq!(
        std::fs::read_to_string(cfg.join("nats").join("context.txt")).unwrap(),
        "dead"
    );
    let edited = keel_cmd()
        .env("XDG_CONFIG_HOME", &cfg)
        .env("EDITOR", "sed -i -e s/nothing\\ here/edited/")
        .env_remove("VISUAL")
        .args(["context", "edit", "dead"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(edited.status.success(), "{}", text(&edited.stderr));
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("dead.json")).unwrap()).unwrap();
    assert_eq!(saved["description"], "edited");
    let out = keel_in(&cfg, &["context", "rm", "dead"]);
    assert!(text(&out.stderr).contains("cannot remove the selected context"));
    ok_in(&cfg, &["context", "select", "local"]);
    ok_in(&cfg, &["context", "rm", "dead", "-f"]);
    assert!(!dir.join("dead.json").exists());
    assert_eq!(ok_in(&cfg, &["context", "ls", "--names"]), "local\n");
    // The local context's file is untouched by all this.
    let local: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("local.json")).unwrap()).unwrap();
    assert_eq!(local["color_scheme"], "");
}

#[test]
fn connection_flags_reach_the_client() {
    let Some(srv) = start(true) else { return };
    let dir = temp_dir("flags");
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let junk = junk.to_str().unwrap();
    // TLS asked for: the client starts a TLS handshake the plain server cannot answer.
    let err = srv.fails(&["pub", "x", "y", "--tlsca", junk, "--timeout", "2s"]);
    assert!(err.contains("TLS was asked for"), "{err}");
    let err = srv.fails(&["pub", "x", "y", "--tlscert", junk]);
    assert!(err.contains("--tlscert and --tlskey go together"), "{err}");
    let err = srv.fails(&["pub", "x", "y", "--tlsca", "/nonexistent/ca.pem"]);
    assert!(err.contains("no such file"), "{err}");
    let err = srv.fails(&["pub", "x", "y", "--nkey", junk]);
    assert!(err.contains("no user NKey seed"), "{err}");
    let err = srv.fails(&["pub", "x", "y", "--creds", junk]);
    assert!(err.contains("invalid credentials"), "{err}");
    // A well-formed seed is sent: a server without auth accepts the connection.
    let seed = dir.join("user.nk");
    std::fs::write(
        &seed,
        "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU\n",
    )
    .unwrap();
    srv.ok(&["pub", "x", "y", "--nkey", seed.to_str().unwrap()]);

    // --js-domain changes the API subjects to $JS.<domain>.API.
    let (sub, err) = spawn_ready(
        &srv,
        &["sub", "$JS.hub.API.>", "--count", "1"],
        "Subscribing",
    );
    let out = srv.keel(&["stream", "ls", "--js-domain", "hub", "--timeout", "1s"]);
    assert!(!out.status.success());
    let (ok, got, _) = finish(sub, err);
    assert!(ok);
    assert!(got.contains("Received on \"$JS.hub.API.INFO\""), "{got}");
}

#[test]
fn destructive_commands_are_never_suggested() {
    // `rmm` removes one message; a typo must not be steered to `rm` or `purge`.
    for (args, bad) in [
        (&["stream", "rmn"][..], "'rm'"),
        (&["kv", "purg"], "'purge'"),
        (&["object", "sael"], "'seal'"),
    ] {
        let out = keel(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.contains("unrecognized subcommand"), "{err}");
        assert!(!err.contains(bad), "{args:?} suggests {bad}: {err}");
    }
    // Harmless suggestions stay.
    let err = text(&keel(&["stream", "inf"]).stderr);
    assert!(err.contains("'info'"), "{err}");
    let err = text(&keel(&["kv", "purg"]).stderr);
    assert!(err.contains("'put'"), "{err}");
}

#[test]
fn stream_report_find_view_rmm_seal_copy() {
    let Some(srv) = start(true) else { return };
    srv.ok(&["stream", "add", "ORDERS", "--subjects", "orders.>"]);
    srv.ok(&[
        "stream",
        "add",
        "EMPTY",
        "--subjects",
        "empty.>",
        "--storage",
        "memory",
    ]);
    srv.ok(&[
        "pub",
        "orders.new",
        "order {{Count}}",
        "--count",
        "5",
        "-H",
        "Trace:abc",
    ]);
    srv.ok(&["consumer", "add", "ORDERS", "w"]);

    let out = srv.ok(&["stream", "report"]);
    contains_all(
        &out,
        &[
            "Stream Report",
            "Consumers",
            "Messages",
            "ORDERS",
            "EMPTY",
            "Memory",
            "File",
        ],
    );
    let v = srv.json(&["stream", "report", "--json"]);
    let orders = v
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "ORDERS")
        .unwrap();
    assert_eq!(orders["msgs"], 5);
    assert_eq!(orders["consumers"], 1);

    assert_eq!(srv.ok(&["stream", "find", "--empty", "--names"]), "EMPTY\n");
    assert_eq!(
        srv.ok(&["stream", "find", "--empty", "--invert", "--names"]),
        "ORDERS\n"
    );
    assert_eq!(
        srv.ok(&["stream", "find", "--consumers", "1", "--names"]),
        "EMPTY\n"
    );
    assert_eq!(
        srv.ok(&["stream", "find", "--subject", "orders.new", "--names"]),
        "ORDERS\n"
    );
    assert_eq!(
        srv.ok(&["stream", "find", "--created", "1h", "--names"]),
        ""
    );

    // view: one page of 2 from sequence 2, with headers; stdin is no terminal.
    let out = srv.ok(&["stream", "view", "ORDERS", "2", "--id", "2"]);
    contains_all(
        &out,
        &[
            "[2] Subject: orders.new Received:",
            "Trace: abc",
            "order 2",
            "[3] Subject",
        ],
    );
    assert!(!out.contains("order 4"), "{out}");
    assert_eq!(
        srv.ok(&[
            "stream",
            "view",
            "ORDERS",
            "--subject",
            "orders.new",
            "--raw",
            "--since",
            "1h"
        ]),
        "order 1\norder 2\norder 3\norder 4\norder 5\n"
    );

    // rmm removes exactly one message, and asks first.
    let err = srv.fails(&["stream", "rmm", "ORDERS", "3"]);
    assert!(
        err.contains("Really remove message 3 from Stream ORDERS"),
        "{err}"
    );
    srv.ok(&["stream", "rmm", "ORDERS", "3", "-f"]);
    let st = srv.json(&["stream", "state", "ORDERS", "--json"]);
    assert_eq!(st["messages"], 4);
    assert_eq!(st["num_deleted"], 1);
    let err = srv.fails(&["stream", "get", "ORDERS", "3"]);
    assert!(err.contains("no message with sequence 3"), "{err}");
    let err = srv.fails(&["stream", "rmm", "ORDERS", "3", "-f"]);
    assert!(err.contains("3"), "{err}");

    // copy takes the configuration, not the data; new subjects avoid the overlap.
    let err = srv.fails(&["stream", "copy", "ORDERS", "ARCHIVE"]);
    assert!(err.contains("overlap"), "{err}");
    let out = srv.ok(&[
        "stream",
        "copy",
        "ORDERS",
        "ARCHIVE",
        "--subjects",
        "archive.>",
    ]);
    contains_all(
        &out,
        &[
            "Stream ARCHIVE was created",
            "Subjects: archive.>",
            "Messages: 0",
        ],
    );

    // seal: asks, then no more messages, ever.
    assert!(srv
        .fails(&["stream", "seal", "ORDERS"])
        .contains("sealed streams can not be unsealed"));
    let out = srv.ok(&["stream", "seal", "ORDERS", "-f"]);
    assert!(out.contains("Sealed: true"), "{out}");
    let err = srv.fails(&["pub", "orders.new", "late", "-J"]);
    assert!(err.contains("sealed"), "{err}");
}

#[test]
fn stream_backup_and_restore_keep_sequences_and_detect_damage() {
    let Some(srv) = start(true) else { return };
    srv.ok(&[
        "stream",
        "add",
        "ORDERS",
        "--subjects",
        "orders.>",
        "--max-msgs-per-subject",
        "10",
    ]);
    srv.ok(&[
        "pub",
        "orders.a",
        "a{{Count}}",
        "--count",
        "4",
        "-H",
        "Trace:t1",
    ]);
    srv.ok(&["pub", "orders.b", "b", "-H", "Nats-Msg-Id:one"]);
    srv.ok(&["pub", "orders.b", "b2", "-H", "Nats-Msg-Id:two"]);
    // A stream with a short duplicate window holds a repeated message id; the
    // restore must keep both messages.
    srv.ok(&[
        "stream",
        "add",
        "IDS",
        "--subjects",
        "ids.>",
        "--dupe-window",
        "100ms",
    ]);
    srv.ok(&["pub", "ids.x", "first", "-H", "Nats-Msg-Id:same", "-J"]);
    let t0 = Instant::now();
    loop {
        let out = srv.ok(&["pub", "ids.x", "second", "-H", "Nats-Msg-Id:same", "-J"]);
        if !out.contains("Duplicate") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{out}");
        std::thread::sleep(Duration::from_millis(50));
    }
    srv.ok(&["stream", "rmm", "ORDERS", "2", "-f"]);
    srv.ok(&["stream", "rmm", "ORDERS", "6", "-f"]); // the last one: the next sequence must still be 7
    srv.ok(&["consumer", "add", "ORDERS", "worker", "--ack-wait", "45s"]);
    let before = srv.json(&["stream", "info", "ORDERS", "--json"]);

    let dir = temp_dir("backup").join("orders");
    let out = srv.ok(&["stream", "backup", "ORDERS", dir.to_str().unwrap()]);
    assert!(out.contains("Backed up 4 messages"), "{out}");
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("backup.json")).unwrap()).unwrap();
    assert_eq!(meta["format"], "keel-stream-backup");
    assert_eq!(meta["config"]["name"], "ORDERS");
    assert_eq!(meta["consumers"][0]["durable_name"], "worker");
    let lines = std::fs::read_to_string(dir.join("messages.jsonl")).unwrap();
    let first: Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["seq"], 1);
    assert_eq!(first["subject"], "orders.a");
    assert_eq!(first["data"], "YTE="); // base64 of a1
                                       // A second backup into a non-empty directory is refused.
    assert!(srv
        .fails(&["stream", "backup", "ORDERS", dir.to_str().unwrap()])
        .contains("not empty"));
    // Restoring over an existing stream is refused.
    assert!(srv
        .fails(&["stream", "restore", dir.to_str().unwrap()])
        .contains("already exists"));

    srv.ok(&["stream", "rm", "ORDERS", "-f"]);
    let out = srv.ok(&["stream", "restore", dir.to_str().unwrap()]);
    assert!(out.contains("Restored stream ORDERS"), "{out}");
    let after = srv.json(&["stream", "info", "ORDERS", "--json"]);
    for key in [
        "messages",
        "first_seq",
        "last_seq",
        "num_deleted",
        "consumer_count",
    ] {
        assert_eq!(
            after["state"][key], before["state"][key],
            "state.{key}: {after}"
        );
    }
    assert_eq!(after["config"]["max_msgs_per_subject"], 10);
    assert_eq!(
        after["config"]["duplicate_window"],
        before["config"]["duplicate_window"]
    );
    let m = srv.json(&["stream", "get", "ORDERS", "4", "--json"]);
    assert_eq!(m["data"], "YTQ=");
    assert!(srv
        .ok(&["stream", "get", "ORDERS", "1"])
        .contains("Trace: t1"));
    assert!(srv
        .fails(&["stream", "get", "ORDERS", "2"])
        .contains("no message with sequence 2"));
    let c = srv.json(&["consumer", "info", "ORDERS", "worker", "--json"]);
    assert_eq!(c["config"]["ack_wait"], 45_000_000_000u64);
    // Sequence numbers are never reused: the next publish is 7.
    assert!(srv
        .ok(&["pub", "orders.a", "new", "-J"])
        .contains("Sequence: 7"));

    // Repeated message ids survive the restore.
    let ids = temp_dir("backup").join("ids");
    srv.ok(&["stream", "backup", "IDS", ids.to_str().unwrap()]);
    srv.ok(&["stream", "rm", "IDS", "-f"]);
    srv.ok(&["stream", "restore", ids.to_str().unwrap()]);
    assert_eq!(
        srv.json(&["stream", "state", "IDS", "--json"])["messages"],
        2
    );
    srv.ok(&["stream", "rm", "IDS", "-f"]);

    // Damage is detected before anything is created.
    srv.ok(&["stream", "rm", "ORDERS", "-f"]);
    let text_now = std::fs::read_to_string(dir.join("messages.jsonl")).unwrap();
    std::fs::write(dir.join("messages.jsonl"), text_now.replace("YTE=", "YTk=")).unwrap();
    let err = srv.fails(&["stream", "restore", dir.to_str().unwrap()]);
    assert!(err.contains("damaged"), "{err}");
    let cut: String = text_now.lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(dir.join("messages.jsonl"), cut).unwrap();
    let err = srv.fails(&["stream", "restore", dir.to_str().unwrap()]);
    assert!(err.contains("incomplete"), "{err}");
    assert_eq!(srv.json(&["stream", "ls", "--json"]), serde_json::json!([]));
    // The nats CLI's server-snapshot format is named, not misread.
    let natsdir = temp_dir("natsbackup");
    std::fs::write(natsdir.join("backup.json"), "{}").unwrap();
    std::fs::write(natsdir.join("stream.tar.s2"), "x").unwrap();
    let err = srv.fails(&["stream", "restore", natsdir.to_str().unwrap()]);
    assert!(err.contains("nats-server snapshot"), "{err}");
}

#[test]
fn consumer_state_report_and_sub() {
    let Some(srv) = start(true) else { return };
    srv.ok(&["stream", "add", "ORDERS", "--subjects", "orders.>"]);
    srv.ok(&["pub", "orders.new", "o{{Count}}", "--count", "4"]);
    srv.ok(&["consumer", "add", "ORDERS", "pull"]);
    srv.ok(&[
        "consumer",
        "add",
        "ORDERS",
        "push",
        "--target",
        "deliver.push",
        "--ack",
        "explicit",
    ]);
    srv.ok(&["consumer", "next", "ORDERS", "pull", "--count", "1"]);

    let out = srv.ok(&["consumer", "state", "ORDERS", "pull"]);
    contains_all(
        &out,
        &[
            "State for Consumer ORDERS > pull",
            "Unprocessed Messages: 3",
        ],
    );
    assert!(!out.contains("Ack Policy"), "{out}");

    let out = srv.ok(&["consumer", "report", "ORDERS"]);
    contains_all(
        &out,
        &[
            "Consumer report for ORDERS with 2 consumers",
            "Ack Floor",
            "pull",
            "Pull",
            "push",
            "Push",
            "Explicit",
            "3 / 75%",
            "4 / 100%",
        ],
    );

    // sub on a pull consumer acks what it prints.
    let out = srv.ok(&["consumer", "sub", "ORDERS", "pull", "--count", "3", "--raw"]);
    assert_eq!(out, "o2\no3\no4\n");
    let v = srv.json(&["consumer", "info", "ORDERS", "pull", "--json"]);
    assert_eq!(v["num_pending"], 0);
    assert_eq!(v["num_ack_pending"], 0);
    // sub on a push consumer subscribes to its deliver subject.
    let out = srv.ok(&["consumer", "sub", "ORDERS", "push", "--count", "4"]);
    contains_all(
        &out,
        &[
            "subj: orders.new / tries: 1 / cons seq: 1 / str seq: 1",
            "o4",
        ],
    );
    let start = Instant::now();
    while srv.json(&["consumer", "info", "ORDERS", "push", "--json"])["ack_floor"]["stream_seq"]
        != 4
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "push acks not seen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn kv_create_update_purge_revert_compact_edit() {
    let Some(srv) = start(true) else { return };
    srv.ok(&["kv", "add", "CFG", "--history", "5"]);
    assert_eq!(srv.ok(&["kv", "create", "CFG", "color", "blue"]), "blue\n");
    assert!(srv
        .fails(&["kv", "create", "CFG", "color", "red"])
        .contains("already exists"));
    let err = srv.fails(&["kv", "update", "CFG", "color", "red", "7"]);
    assert!(err.contains("is not at revision 7"), "{err}");
    srv.ok(&["kv", "update", "CFG", "color", "red", "1"]);
    assert_eq!(srv.ok(&["kv", "get", "CFG", "color", "--raw"]), "red\n");
    // revert puts revision 1's value as a new revision.
    assert!(srv
        .fails(&["kv", "revert", "CFG", "color", "1"])
        .contains("-f"));
    srv.ok(&["kv", "revert", "CFG", "color", "1", "-f"]);
    let v = srv.json(&["kv", "get", "CFG", "color", "--json"]);
    assert_eq!(
        (v["value"].as_str(), v["revision"].as_u64()),
        (Some("blue"), Some(3))
    );
    // purge leaves only a marker; create works again afterwards.
    srv.ok(&["kv", "put", "CFG", "size", "xl"]);
    srv.ok(&["kv", "purge", "CFG", "color", "-f"]);
    assert!(srv
        .fails(&["kv", "get", "CFG", "color"])
        .contains("not found"));
    let h = srv.json(&["kv", "history", "CFG", "color", "--json"]);
    assert_eq!(h.as_array().map(Vec::len), Some(1), "{h}");
    srv.ok(&["kv", "create", "CFG", "color", "green"]);
    // compact keeps live keys and recent markers.
    srv.ok(&["kv", "del", "CFG", "size", "-f"]);
    let out = srv.ok(&["kv", "compact", "CFG", "-f"]);
    assert!(
        out.contains("Compacted bucket CFG: 1 deleted keys"),
        "{out}"
    );
    assert_eq!(srv.ok(&["kv", "get", "CFG", "color", "--raw"]), "green\n");
    let h = srv.json(&["kv", "history", "CFG", "size", "--json"]);
    assert_eq!(
        h.as_array().map(Vec::len),
        Some(1),
        "only the delete marker is left: {h}"
    );
    // edit changes the bucket's stream.
    let out = srv.ok(&[
        "kv",
        "edit",
        "CFG",
        "--history",
        "10",
        "--description",
        "settings",
    ]);
    contains_all(
        &out,
        &["Bucket CFG was updated", "History Kept: 10", "settings"],
    );
    assert!(srv
        .fails(&["kv", "edit", "CFG", "--history", "65"])
        .contains("between 1 and 64"));
}

#[test]
fn object_store_round_trip() {
    let Some(srv) = start(true) else { return };
    let dir = temp_dir("obj");
    let src = dir.join("data.bin");
    // Larger than one 128 KiB chunk, and not a multiple of it.
    let data: Vec<u8> = (0..300_001u32).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&src, &data).unwrap();

    let out = srv.ok(&["object", "add", "FILES", "--description", "test files"]);
    contains_all(
        &out,
        &[
            "Bucket Name: FILES",
            "test files",
            "Sealed: false",
            "JetStream Stream: OBJ_FILES",
        ],
    );
    let out = srv.ok(&[
        "object",
        "put",
        "FILES",
        src.to_str().unwrap(),
        "--name",
        "data.bin",
        "-H",
        "Kind:blob",
    ]);
    contains_all(
        &out,
        &[
            "Object information for FILES > data.bin",
            "Size: 293 KiB",
            "Chunks: 3",
            "Digest: SHA-256 ",
        ],
    );
    // Putting it again asks first.
    let err = srv.fails(&[
        "object",
        "put",
        "FILES",
        src.to_str().unwrap(),
        "--name",
        "data.bin",
    ]);
    assert!(
        err.contains("Replace existing file FILES > data.bin"),
        "{err}"
    );
    let out = srv.ok(&["object", "ls", "FILES"]);
    contains_all(&out, &["Bucket Contents", "data.bin", "293 KiB"]);
    assert_eq!(srv.ok(&["object", "ls", "--names"]), "FILES\n");
    let v = srv.json(&["object", "info", "FILES", "data.bin", "--json"]);
    assert_eq!(v["size"], 300_001);
    assert_eq!(v["bucket"], "FILES");

    let dst = dir.join("copy.bin");
    let out = srv.ok(&[
        "object",
        "get",
        "FILES",
        "data.bin",
        "-O",
        dst.to_str().unwrap(),
    ]);
    assert!(out.contains("Wrote: 293 KiB"), "{out}");
    assert_eq!(std::fs::read(&dst).unwrap(), data);
    assert!(srv
        .fails(&[
            "object",
            "get",
            "FILES",
            "data.bin",
            "-O",
            dst.to_str().unwrap()
        ])
        .contains("Replace existing target file"));
    assert!(srv
        .fails(&["object", "get", "FILES", "nope"])
        .contains("not found"));

    let out = srv.ok(&["object", "watch", "FILES", "--count", "1"]);
    assert!(
        out.contains("PUT FILES > data.bin: 293 KiB bytes in 3 chunks"),
        "{out}"
    );
    srv.ok(&["object", "rm", "FILES", "data.bin", "-f"]);
    assert_eq!(srv.ok(&["object", "ls", "FILES"]), "No entries found\n");

    srv.ok(&[
        "object",
        "put",
        "FILES",
        src.to_str().unwrap(),
        "--name",
        "again",
    ]);
    assert!(srv
        .fails(&["object", "seal", "FILES"])
        .contains("sealed buckets can not be unsealed"));
    assert_eq!(
        srv.ok(&["object", "seal", "FILES", "-f"]),
        "FILES has been sealed\n"
    );
    assert!(srv
        .ok(&["object", "info", "FILES"])
        .contains("Sealed: true"));
    srv.fails(&[
        "object",
        "put",
        "FILES",
        src.to_str().unwrap(),
        "--name",
        "late",
        "-f",
    ]);
    srv.ok(&["object", "rm", "FILES", "-f"]);
    assert_eq!(srv.ok(&["object", "ls"]), "No Object Store buckets found\n");
}

#[test]
fn sub_reads_streams_and_dumps() {
    let Some(srv) = start(true) else { return };
    srv.ok(&["stream", "add", "ORDERS", "--subjects", "orders.>"]);
    srv.ok(&[
        "pub",
        "orders.new",
        "o{{Count}}",
        "--count",
        "3",
        "-H",
        "Trace:x",
    ]);
    // --all (and -T to stop at the end), found by subject.
    let out = srv.ok(&["sub", "orders.>", "--all", "-T", "--raw"]);
    assert_eq!(out, "o1\no2\no3\n");
    let out = srv.ok(&[
        "sub",
        "orders.new",
        "--stream",
        "ORDERS",
        "--last",
        "--count",
        "1",
    ]);
    contains_all(
        &out,
        &["Received JetStream message: stream: ORDERS seq: 3", "o3"],
    );
    let out = srv.ok(&["sub", "orders.new", "--since", "1h", "-T", "--headers-only"]);
    assert!(out.contains("Trace: x"), "{out}");
    assert!(!out.contains("o1"), "{out}");
    let out = srv.ok(&["sub", "orders.new", "--start-sequence", "2", "-T", "--raw"]);
    assert_eq!(out, "o2\no3\n");
    // --new waits for a message published after it started.
    let (sub, err) = spawn_ready(
        &srv,
        &["sub", "orders.new", "--new", "--count", "1", "--raw"],
        "Subscribing to JetStream",
    );
    srv.ok(&["pub", "orders.new", "fresh"]);
    let (ok, out, e) = finish(sub, err);
    assert!(ok, "{e}");
    assert_eq!(out, "fresh\n");
    // --dump writes one JSON file per message, named by stream sequence.
    let dir = temp_dir("dump");
    srv.ok(&[
        "sub",
        "orders.new",
        "--all",
        "-T",
        "--dump",
        dir.to_str().unwrap(),
    ]);
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("2.json")).unwrap()).unwrap();
    assert_eq!(m["Subject"], "orders.new");
    assert_eq!(m["Data"], "bzI=");
    assert_eq!(m["Header"]["Trace"][0], "x");
    assert!(dir.join("4.json").exists());
    // Not JetStream, not found: clear errors.
    assert!(srv
        .fails(&["sub", "nowhere.x", "--all"])
        .contains("no stream stores"));
    assert!(srv
        .fails(&["sub", "orders.new", "-T"])
        .contains("--terminate-at-end"));
}

#[test]
fn pub_sleep_req_replies_and_reply_modes() {
    let Some(srv) = start(false) else { return };
    // --sleep spaces the messages out: three messages take at least two pauses.
    let t0 = Instant::now();
    srv.ok(&["pub", "x", "y", "--count", "3", "--sleep", "200ms"]);
    assert!(t0.elapsed() >= Duration::from_millis(400));

    // Two repliers in different groups both answer one request.
    let (r1, e1) = spawn_ready(
        &srv,
        &["reply", "svc", "one", "--queue", "a", "--count", "1"],
        "Listening",
    );
    let (r2, e2) = spawn_ready(
        &srv,
        &["reply", "svc", "two", "--queue", "b", "--count", "1"],
        "Listening",
    );
    let out = srv.ok(&["req", "svc", "hi", "--replies", "2", "--raw"]);
    let mut got: Vec<&str> = out.lines().collect();
    got.sort();
    assert_eq!(got, ["one", "two"]);
    assert!(finish(r1, e1).0 && finish(r2, e2).0);

    // --echo returns the body and headers, with a reply counter.
    let (r, e) = spawn_ready(
        &srv,
        &["reply", "echo.svc", "--echo", "--count", "1"],
        "Listening",
    );
    let out = srv.ok(&["req", "echo.svc", "ping", "-H", "Trace:abc"]);
    contains_all(&out, &["Trace: abc", "NATS-Reply-Counter: 0", "ping"]);
    assert!(finish(r, e).0);
    // --command runs per request, with the subject's tokens and the body.
    let (r, e) = spawn_ready(
        &srv,
        &[
            "reply",
            "cmd.*",
            "--command",
            "echo token={{1}} body={{Request}}",
            "--count",
            "1",
        ],
        "Listening",
    );
    assert_eq!(
        srv.ok(&["req", "cmd.abc", "hello", "--raw"]),
        "token=abc body=hello\n\n"
    );
    assert!(finish(r, e).0);
    // Without a replier: no responders, at once.
    assert!(srv
        .fails(&["req", "nobody", "x", "--replies", "0"])
        .contains("no responders"));
}

#[test]
fn rtt_reports_each_address() {
    let Some(srv) = start(false) else { return };
    let out = srv.ok(&["rtt", "3"]);
    let host = srv.url.trim_start_matches("nats://");
    contains_all(
        &out,
        &[&format!("{}:", srv.url), &format!("nats://{host}: ")],
    );
    let v = srv.json(&["rtt", "2", "--json"]);
    assert!(v[0]["results"][0]["rtt"].as_u64().unwrap() > 0, "{v}");
}

#[test]
fn bench_follows_the_nats_bench_grammar() {
    let Some(srv) = start(true) else { return };
    let dir = temp_dir("bench");
    let csv = dir.join("sync.csv");
    let out = srv.ok(&[
        "bench",
        "js",
        "pub",
        "sync",
        "bench.js",
        "--create",
        "--msgs",
        "400",
        "--clients",
        "2",
        "--csv",
        csv.to_str().unwrap(),
    ]);
    contains_all(
        &out,
        &[
            "JetStream synchronous publisher",
            "aggregated stats",
            "P99",
            "Saved metric data in csv file",
        ],
    );
    let csv = std::fs::read_to_string(&csv).unwrap();
    let mut lines = csv.lines();
    assert!(lines.next().unwrap().starts_with(
        "#RunID,ClientID,MsgCount,MsgBytes,MsgsPerSec,BytesPerSec,DurationSecs,MinLatencyMicroSecs"
    ));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0][1], rows[0][2]), ("P0", "200"));
    // The stream stays for the consumers.
    let v = srv.json(&[
        "bench", "js", "pub", "async", "bench.js", "--msgs", "600", "--batch", "50", "--json",
    ]);
    assert_eq!(v["msgs"], 600);
    assert_eq!(
        srv.json(&["stream", "state", "benchstream", "--json"])["messages"],
        1000
    );
    let v = srv.json(&[
        "bench",
        "js",
        "consume",
        "--msgs",
        "1000",
        "--clients",
        "2",
        "--json",
    ]);
    assert_eq!(v["msgs"], 1000);
    let v = srv.json(&[
        "bench",
        "js",
        "fetch",
        "--msgs",
        "500",
        "--consumer",
        "f",
        "--acks",
        "none",
        "--json",
    ]);
    assert_eq!(v["msgs"], 500);
    let v = srv.json(&["bench", "js", "ordered", "--msgs", "1000", "--json"]);
    assert_eq!(v["msgs"], 1000);
    assert!(srv
        .fails(&["bench", "js", "consume", "--stream", "nope", "--msgs", "1"])
        .contains("not found"));
    assert!(srv
        .fails(&["bench", "js", "pub", "sync", "x.y", "--stream", "nope", "--msgs", "1"])
        .contains("--create"));

    // kv put makes benchbucket; kv get reads the same keys back.
    let out = srv.ok(&["bench", "kv", "put", "--msgs", "300", "--clients", "2"]);
    contains_all(&out, &["NATS KV putter aggregated stats", "P50"]);
    let v = srv.json(&["bench", "kv", "get", "--msgs", "300", "--json"]);
    assert_eq!(v["msgs"], 300);
    assert!(srv
        .fails(&["bench", "kv", "get", "--msgs", "301"])
        .contains("key 300 not found"));
    assert!(srv
        .fails(&["bench", "kv", "get", "--bucket", "nope", "--msgs", "1"])
        .contains("finding kv bucket"));

    // bench sub waits for another process's publishes.
    let (sub, err) = spawn_ready(
        &srv,
        &[
            "bench",
            "sub",
            "bench.core",
            "--msgs",
            "2000",
            "--clients",
            "2",
        ],
        "Waiting for",
    );
    let out = srv.ok(&["bench", "pub", "bench.core", "--msgs", "2000"]);
    assert!(out.contains("NATS Core NATS publisher stats:"), "{out}");
    let (ok, out, e) = finish(sub, err);
    assert!(ok, "{e}");
    contains_all(
        &out,
        &["Core NATS subscriber", "aggregated stats", "(2,000 msgs)"],
    );

    // service serve + service request.
    let mut all = vec!["bench", "service", "serve", "bench.svc", "-s", &srv.url];
    let mut serve = keel_cmd()
        .args(&all)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(serve.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("Serving requests"), "{line}");
    all.clear();
    let v = srv.json(&[
        "bench",
        "service",
        "request",
        "bench.svc",
        "--msgs",
        "200",
        "--json",
    ]);
    assert_eq!(v["msgs"], 200);
    assert!(v["latency_us"]["p50"].as_f64().unwrap() > 0.0);
    let _ = serve.kill();
    let _ = serve.wait();
}

/// The Python interpreter with nats-py: `$KEEL_TEST_PYTHON` (scripts/test.sh sets
/// it to its venv's), else `python3` if it can import nats.
fn python_with_nats() -> Option<String> {
    let py = std::env::var("KEEL_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&py)
        .args(["-c", "import nats.js.object_store"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

/// Objects written by nats-py read back through keel, and the other way round.
#[test]
fn object_store_interoperates_with_nats_py() {
    let Some(py) = python_with_nats() else {
        eprintln!("note: skipping, no python with nats-py (set KEEL_TEST_PYTHON)");
        return;
    };
    let Some(srv) = start(true) else { return };
    let dir = temp_dir("objpy");
    let from_py = dir.join("from-py.bin");
    let from_keel = dir.join("from-keel.bin");
    let data: Vec<u8> = (0..200_003u32).map(|i| (i * 7 % 253) as u8).collect();
    std::fs::write(&from_keel, &data).unwrap();
    srv.ok(&["object", "add", "SHARED"]);
    srv.ok(&[
        "object",
        "put",
        "SHARED",
        from_keel.to_str().unwrap(),
        "--name",
        "by-keel",
    ]);
    let script = r#"
import asyncio, sys, nats
async def main(url, out):
    nc = await nats.connect(url)
    obs = await nc.jetstream().object_store("SHARED")
    got = await obs.get("by-keel")
    open(out, "wb").write(got.data)
    await obs.put("by-py", bytes((i * 11) % 241 for i in range(150_007)))
    await nc.close()
asyncio.run(main(sys.argv[1], sys.argv[2]))
"#;
    let out = std::process::Command::new(&py)
        .args(["-c", script, &srv.url, from_py.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "nats-py: {}", text(&out.stderr));
    assert_eq!(
        std::fs::read(&from_py).unwrap(),
        data,
        "nats-py read keel's object"
    );
    let back = dir.join("back.bin");
    srv.ok(&[
        "object",
        "get",
        "SHARED",
        "by-py",
        "-O",
        back.to_str().unwrap(),
    ]);
    let want: Vec<u8> = (0..150_007u32).map(|i| (i * 11 % 241) as u8).collect();
    assert_eq!(
        std::fs::read(&back).unwrap(),
        want,
        "keel read nats-py's object"
    );
    let out = srv.ok(&["object", "ls", "SHARED", "--names"]);
    assert_eq!(out, "by-keel\nby-py\n");
}
