//! The cluster commands end to end on a 3-server JetStream cluster (separate processes):
//! `stream cluster step-down`, `consumer cluster step-down` and `server raft step-down`
//! print the leader before and the one elected after, as natscli does. Runs against
//! keel-server, and against the reference nats-server with `KEEL_TEST_REFERENCE=1`.

mod common;

use std::time::{Duration, Instant};

use common::{free_port, start_with_config, text, Server};

/// Three servers routed to each other, with a system account and an application account.
fn cluster() -> Option<Vec<Server>> {
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
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
             cluster {{\n  name: cli\n  listen: \"127.0.0.1:{port}\"\n  routes: [{}]\n}}\n",
            routes.join(", ")
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
    let Some(servers) = cluster() else { return };
    let s = &servers[0];
    until_ok(
        s,
        &with(
            &APP,
            &[
                "stream",
                "add",
                "ORDERS",
                "--subjects",
                "orders.>",
                "--replicas",
                "3",
                "--defaults",
            ],
        ),
    );
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
