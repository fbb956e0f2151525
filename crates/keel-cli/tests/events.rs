//! `keel events`: the JetStream advisories a stream's life produces, as `keel` shows them.
//! See tests/common/mod.rs for how the server is chosen (`KEEL_TEST_SERVER_BIN=nats-server`
//! runs it against the reference).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{start, KEEL};

#[test]
fn events_show_stream_advisories_and_api_audits() {
    let Some(srv) = start(true) else { return };
    let mut events = Command::new(KEEL)
        .args(["events", "--short", "-s", &srv.url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keel events");
    let mut stderr = BufReader::new(events.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("Listening for Advisories on $JS.EVENT.>"),
        "{line}"
    );
    // Lines arrive on a thread so the wait below is bounded.
    let stdout = BufReader::new(events.stdout.take().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in stdout.lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });

    srv.ok(&["stream", "add", "EV", "--subjects", "ev.>"]);
    srv.ok(&["stream", "rm", "EV", "-f"]);

    let mut seen = vec![];
    let wanted = [
        "[Stream Created] Stream: EV",
        "[Stream Deleted] Stream: EV",
        "[JetStream API Access]",
        "Subject: $JS.API.STREAM.CREATE.EV",
    ];
    while !wanted
        .iter()
        .all(|w| seen.iter().any(|l: &String| l.contains(w)))
    {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(l) => seen.push(l),
            Err(_) => panic!("missing events; got:\n{}", seen.join("\n")),
        }
    }
    let _ = events.kill();
    let _ = events.wait();
}
