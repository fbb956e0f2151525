//! The cluster commands end to end on a 3-server JetStream cluster (separate processes):
//! `stream cluster step-down`, `consumer cluster step-down` and `server raft step-down`
//! print the leader before and the one elected after, as natscli does; `stream cluster
//! peer-remove` moves a replica to a server that had none. Runs against
//! keel-server, and against the reference nats-server with `KEEL_TEST_REFERENCE=1`.

mod common;

use std::time::{Duration, Instant};

use common::{free_port, start_with_config, text, Server};

/// `n` servers routed to each other, with a system account and an application account.
fn cluster(n: usize) -> Option<Vec<Server>> {
    cluster_with(n, |_| String::new())
}

/// `cluster`, with `extra(i)` in server `i`'s config.
fn cluster_with(n: usize, extra: impl Fn(usize) -> String) -> Option<Vec<Server>> {
    let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let routes: Vec<String> = ports
        .iter()
        .map(|p| format!("\"nats://127.0.0.1:{p}\""))
        .collect();
    let mut servers = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let conf = format!(
            "server_name: C{i}\n\
             accounts {{\n  SYS: {{ users: [{{user: sys, password: pass}}] }}\n  \
             APP: {{ jetstream: enabled, users: [{{user: app, password: pass}}] }}\n}}\n\
             system_account: SYS\n\
             cluster {{\n  name: cli\n  listen: \"127.0.0.1:{port}\"\n  routes: [{}]\n}}\n{}",
            routes.join(", "),
            extra(i)
        );
        servers.push(start_with_config(&conf)?);
    }
    Some(servers)
}

const APP: [&str; 4] = ["--user", "app", "--password", "pass"];
const SYS: [&str; 4] = ["--user", "sys", "--password", "pass"];

fn with<'a>(user: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
    user.iter().chain(args).copied().collect()
}

/// Runs `args` until it succeeds (the cluster elects its leaders meanwhile); its stdout.
fn until_ok(s: &Server, args: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = s.keel(args);
        if out.status.success() {
            return text(&out.stdout);
        }
        assert!(
            Instant::now() < deadline,
            "keel {args:?} kept failing: {}",
            text(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An R3 stream `ORDERS` on `orders.>`, once the cluster can take it.
fn add_orders(s: &Server) {
    let args = [
        "stream",
        "add",
        "ORDERS",
        "--subjects",
        "orders.>",
        "--replicas",
        "3",
        "--defaults",
    ];
    until_ok(s, &with(&APP, &args));
}

/// The two lines of a stepdown: the leader before, the new one; returns (old, new).
fn leaders(out: &str, before: &str, after: &str) -> (String, String) {
    let find = |prefix: &str| {
        out.lines()
            .find_map(|l| l.split_once(prefix).map(|(_, r)| r.trim().to_string()))
            .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{out}"))
    };
    (find(before), find(after))
}

#[test]
fn stepdowns_name_the_old_and_the_new_leader() {
    let Some(servers) = cluster(3) else { return };
    let s = &servers[0];
    add_orders(s);
    until_ok(
        s,
        &with(
            &APP,
            &["consumer", "add", "ORDERS", "w", "--pull", "--defaults"],
        ),
    );

    let out = until_ok(
        s,
        &with(&APP, &["stream", "cluster", "step-down", "ORDERS"]),
    );
    let (old, new) = leaders(
        &out,
        "Requesting leader step down of ",
        "New leader elected ",
    );
    assert!(old.contains("in a 3 peer RAFT group"), "{out}");
    assert!(!old.starts_with(&new), "{out}");

    let out = until_ok(
        s,
        &with(&APP, &["consumer", "cluster", "step-down", "ORDERS", "w"]),
    );
    let (old, new) = leaders(
        &out,
        "Requesting leader step down of ",
        "New leader elected ",
    );
    assert!(!old.starts_with(&new), "{out}");

    let out = until_ok(s, &with(&SYS, &["server", "raft", "step-down"]));
    let (old, new) = leaders(&out, "Current leader: ", "New leader: ");
    assert!(
        old.starts_with('C') && new.starts_with('C') && old != new,
        "{out}"
    );
}

#[test]
fn a_removed_stream_peer_is_replaced_by_a_free_server() {
    let Some(servers) = cluster(4) else { return };
    let s = &servers[0];
    add_orders(s);
    until_ok(s, &with(&APP, &["pub", "--jetstream", "orders.new", "one"]));
    let peers = |s: &Server| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(&until_ok(
            s,
            &with(&APP, &["--json", "stream", "info", "ORDERS"]),
        ))
        .expect("stream info JSON");
        let c = &v["cluster"];
        let mut p: Vec<String> = c["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["name"].as_str().map(String::from))
            .chain(c["leader"].as_str().map(String::from))
            .collect();
        p.sort();
        p
    };
    let before = peers(s);
    assert_eq!(before.len(), 3, "{before:?}");
    let gone = before[0].clone();
    let out = until_ok(
        s,
        &with(&APP, &["stream", "cluster", "peer-remove", "ORDERS", &gone]),
    );
    assert!(out.contains(&format!("Removing peer \"{gone}\"")), "{out}");
    assert!(
        out.contains(&format!("Requested removal of peer \"{gone}\"")),
        "{out}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = peers(s);
        if now.len() == 3 && !now.contains(&gone) {
            break;
        }
        assert!(Instant::now() < deadline, "replicas still {now:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let v: serde_json::Value = serde_json::from_str(&until_ok(
        s,
        &with(&APP, &["--json", "stream", "info", "ORDERS"]),
    ))
    .unwrap();
    assert_eq!(v["state"]["messages"], 1, "{v}");
}

/// `stream add --tag` places a stream on the servers with the tag, `stream info` shows its
/// placement, and `stream edit --tag` with another tag moves it there with its messages.
#[test]
fn a_stream_edited_with_another_tag_moves_there() {
    let Some(servers) = cluster_with(3, |i| format!("server_tags: [\"az:{i}\"]\n")) else {
        return;
    };
    let s = &servers[0];
    let add = [
        "stream",
        "add",
        "MV",
        "--subjects",
        "mv.>",
        "--tag",
        "az:1",
        "--defaults",
    ];
    until_ok(s, &with(&APP, &add));
    until_ok(s, &with(&APP, &["pub", "--jetstream", "mv.x", "one"]));
    let info = until_ok(s, &with(&APP, &["stream", "info", "MV"]));
    assert!(info.contains("Placement Tags: az:1"), "{info}");
    let out = s.keel(&with(
        &APP,
        &["stream", "edit", "MV", "--tag", "az:2", "-f"],
    ));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = text(&out.stdout);
    assert!(out.contains("Placement Tags: az:2"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v: serde_json::Value = serde_json::from_str(&until_ok(
            s,
            &with(&APP, &["--json", "stream", "info", "MV"]),
        ))
        .expect("stream info JSON");
        let alone = v["cluster"]["replicas"]
            .as_array()
            .is_none_or(|r| r.is_empty());
        if v["cluster"]["leader"] == "C2" && alone {
            assert_eq!(v["state"]["messages"], 1, "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "not moved to C2: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
}
