//! Clusters of server processes (issue 14): a cluster of two keel-servers and one
//! nats-server, messages, queue groups and requests in every direction; a node killed with
//! SIGKILL, whose clients reconnect elsewhere with no duplicate deliveries. With
//! `KEEL_TEST_REFERENCE=1` every node is the reference, which checks the expectations.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use common::{
    expect_no_msg, is_reference, keel_binary, next_msg, reference_binary, serve_echo, sync,
    until_answered, within, Node, Server,
};
use futures::StreamExt;

fn keel() -> PathBuf {
    if is_reference() {
        reference_binary()
    } else {
        keel_binary()
    }
}

fn node(bin: &Path, name: &str, routes: &[String]) -> Node {
    let routes: Vec<String> = routes.iter().map(|r| format!("\"{r}\"")).collect();
    let conf = format!(
        "server_name: {name}\nhttp_port: -1\ncluster {{\n  name: mix\n  listen: \"127.0.0.1:-1\"\n  \
         routes: [{}]\n}}\n",
        routes.join(", ")
    );
    Node::Process(Server::start_binary(bin, &conf, &[]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_keel_servers_and_a_nats_server_form_one_cluster() {
    let k1 = node(&keel(), "k1", &[]);
    let k2 = node(&keel(), "k2", &[k1.route_url()]);
    let n3 = node(&reference_binary(), "n3", &[k1.route_url()]);
    let nodes = [&k1, &k2, &n3];
    for n in nodes {
        n.wait_remotes(2).await;
    }
    let mut clients = Vec::new();
    for n in nodes {
        clients.push(n.client().await);
    }

    // Plain subscriptions, and a responder, on every node.
    let mut subs = Vec::new();
    let mut serving = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        subs.push(c.subscribe(format!("to.{i}")).await.unwrap());
        let mut svc = c.subscribe(format!("svc.{i}")).await.unwrap();
        let cl = c.clone();
        serving.push(tokio::spawn(async move {
            while let Some(m) = svc.next().await {
                if let Some(r) = m.reply {
                    let mut body = m.payload.to_vec();
                    body.extend_from_slice(format!(" by {i}").as_bytes());
                    cl.publish(r, body.into()).await.unwrap();
                }
            }
        }));
        sync(c).await;
    }
    for (i, n) in nodes.iter().enumerate() {
        for j in 0..3 {
            if i != j {
                n.wait_route_interest(&format!("to.{j}"), true).await;
                n.wait_route_interest(&format!("svc.{j}"), true).await;
            }
        }
    }
    // Every direction: a message with headers and one without, then a request.
    for (i, c) in clients.iter().enumerate() {
        for j in 0..3 {
            let mut h = async_nats::HeaderMap::new();
            h.insert("X-From", i.to_string().as_str());
            c.publish_with_headers(format!("to.{j}"), h, format!("h{i}").into())
                .await
                .unwrap();
            c.publish(format!("to.{j}"), format!("p{i}").into())
                .await
                .unwrap();
            let r = within(
                "request",
                c.request(format!("svc.{j}"), format!("q{i}").into()),
            )
            .await
            .unwrap_or_else(|e| panic!("request {i} -> {j}: {e}"));
            assert_eq!(r.payload, Bytes::from(format!("q{i} by {j}")));
        }
        let e = within("no responders", c.request("svc.none", "".into()))
            .await
            .expect_err("no responders");
        assert_eq!(e.kind(), async_nats::client::RequestErrorKind::NoResponders);
    }
    for (j, s) in subs.iter_mut().enumerate() {
        let mut got = Vec::new();
        for _ in 0..6 {
            let m = next_msg(s).await;
            let from = m
                .headers
                .as_ref()
                .and_then(|h| h.get("X-From"))
                .map(|v| v.to_string());
            got.push((String::from_utf8(m.payload.to_vec()).unwrap(), from));
        }
        got.sort();
        let mut want = Vec::new();
        for i in 0..3 {
            want.push((format!("h{i}"), Some(i.to_string())));
            want.push((format!("p{i}"), None));
        }
        want.sort();
        assert_eq!(got, want, "subscriber on node {j}");
        expect_no_msg(s).await;
    }

    // A queue group with members on every node: each message to one of them, once.
    let mut members = Vec::new();
    for c in &clients {
        members.push(c.queue_subscribe("jobs", "workers".into()).await.unwrap());
        sync(c).await;
    }
    for n in nodes {
        n.wait_route_interest_count("jobs", 2).await;
    }
    const N: usize = 150;
    for (i, c) in clients.iter().enumerate() {
        for k in 0..N {
            c.publish("jobs", format!("{i}.{k}").into()).await.unwrap();
        }
        sync(c).await;
    }
    let mut seen = HashSet::new();
    let mut per_node = [0usize; 3];
    within("every job", async {
        while seen.len() < 3 * N {
            for (i, m) in members.iter_mut().enumerate() {
                if let Ok(Some(msg)) =
                    tokio::time::timeout(Duration::from_millis(20), m.next()).await
                {
                    let id = String::from_utf8(msg.payload.to_vec()).unwrap();
                    assert!(seen.insert(id.clone()), "{id} delivered twice");
                    per_node[i] += 1;
                }
            }
        }
    })
    .await;
    for m in members.iter_mut() {
        expect_no_msg(m).await;
    }
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    for s in serving {
        s.abort();
    }
    for n in [k1, k2, n3] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_a_killed_node_reconnect_elsewhere_without_duplicates() {
    let bin = keel();
    let n1 = node(&bin, "n1", &[]);
    let n2 = node(&bin, "n2", &[n1.route_url()]);
    let n3 = node(&bin, "n3", &[n1.route_url()]);
    for n in [&n1, &n2, &n3] {
        n.wait_remotes(2).await;
    }
    // The subscriber and a responder know only n1's URL; the cluster tells them the rest.
    let opts = || {
        async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .max_reconnects(None)
    };
    let sub_client = opts().connect(n1.url()).await.unwrap();
    let mut sub = sub_client.subscribe("ha.data").await.unwrap();
    let mut probe = sub_client.subscribe("ha.probe").await.unwrap();
    let mut svc = sub_client.subscribe("ha.svc").await.unwrap();
    sync(&sub_client).await;
    let sc = sub_client.clone();
    let responder = tokio::spawn(async move {
        while let Some(m) = svc.next().await {
            if let Some(r) = m.reply {
                let _ = sc.publish(r, "up".into()).await;
            }
        }
    });
    let urls: Vec<String> = sub_client
        .server_info()
        .connect_urls
        .iter()
        .map(|u| u.to_string())
        .collect();
    assert_eq!(urls.len(), 3, "{urls:?}");

    let publisher = n2.client().await;
    let requester = n3.client().await;
    n2.wait_route_interest("ha.data", true).await;
    for k in 0..100 {
        publisher
            .publish("ha.data", format!("{k}").into())
            .await
            .unwrap();
    }
    sync(&publisher).await;
    let mut got = Vec::new();
    for _ in 0..100 {
        got.push(String::from_utf8(next_msg(&mut sub).await.payload.to_vec()).unwrap());
    }

    // SIGKILL: no goodbye; the survivors find out from the dead connections.
    let Node::Process(mut p1) = n1 else {
        unreachable!()
    };
    p1.kill_hard();
    n2.wait_remotes(1).await;
    n3.wait_remotes(1).await;
    // The subscriber is back once a probe reaches it.
    within("the subscriber reconnects to another node", async {
        loop {
            publisher.publish("ha.probe", "p".into()).await.unwrap();
            if let Ok(Some(_)) =
                tokio::time::timeout(Duration::from_millis(100), probe.next()).await
            {
                return;
            }
        }
    })
    .await;
    let now = sub_client.server_info().port;
    assert_ne!(now, p1.port(), "reconnected to the killed node?");
    n2.wait_route_interest("ha.data", now != n2.addr().port())
        .await;
    for k in 100..200 {
        publisher
            .publish("ha.data", format!("{k}").into())
            .await
            .unwrap();
    }
    sync(&publisher).await;
    for _ in 100..200 {
        got.push(String::from_utf8(next_msg(&mut sub).await.payload.to_vec()).unwrap());
    }
    expect_no_msg(&mut sub).await;
    let unique: HashSet<&String> = got.iter().collect();
    assert_eq!(unique.len(), got.len(), "a message was delivered twice");
    assert_eq!(got, (0..200).map(|k| k.to_string()).collect::<Vec<_>>());
    // The responder is reachable again from the third node.
    let r = within("request after failover", async {
        loop {
            match requester.request("ha.svc", "?".into()).await {
                Ok(r) => return r,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    assert_eq!(r.payload, Bytes::from("up"));
    responder.abort();
    n2.shutdown().await;
    n3.shutdown().await;
}

/// Two accounts with a user each; A exports a stream `feed.>` that B imports, B exports a
/// service `svc.>` that A imports.
const ACCOUNTS: &str = "accounts {
  A: { users: [{user: a, password: a}], exports: [{stream: \"feed.>\"}],
       imports: [{service: {account: B, subject: \"svc.>\"}}] }
  B: { users: [{user: b, password: b}], exports: [{service: \"svc.>\"}],
       imports: [{stream: {account: A, subject: \"feed.>\"}}] }
}
";

fn node_with_accounts(bin: &Path, name: &str, routes: &[String]) -> Node {
    let routes: Vec<String> = routes.iter().map(|r| format!("\"{r}\"")).collect();
    let conf = format!(
        "server_name: {name}\nhttp_port: -1\n{ACCOUNTS}cluster {{\n  name: mix\n  \
         listen: \"127.0.0.1:-1\"\n  routes: [{}]\n}}\n",
        routes.join(", ")
    );
    Node::Process(Server::start_binary(bin, &conf, &[]))
}

async fn user(n: &Node, u: &str) -> async_nats::Client {
    within(
        "connect",
        async_nats::ConnectOptions::with_user_and_password(u.into(), u.into()).connect(n.url()),
    )
    .await
    .expect("connect")
}

/// Publishes on `subject` until `sub` gets it (the interest crossed the route), then takes
/// what else came.
async fn until_received(p: &async_nats::Client, sub: &mut async_nats::Subscriber, subject: &str) {
    within("interest across the route", async {
        loop {
            p.publish(subject.to_string(), "probe".into())
                .await
                .unwrap();
            p.flush().await.unwrap();
            if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(50), sub.next()).await {
                return;
            }
        }
    })
    .await;
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(200), sub.next()).await {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accounts_across_a_keel_server_and_a_nats_server() {
    let k = node_with_accounts(&keel(), "k1", &[]);
    let n = node_with_accounts(&reference_binary(), "n2", &[k.route_url()]);
    k.wait_remotes(1).await;
    n.wait_remotes(1).await;
    for (from, to) in [(&k, &n), (&n, &k)] {
        let (pa, pb) = (user(from, "a").await, user(from, "b").await);
        let (sa, sb) = (user(to, "a").await, user(to, "b").await);
        let mut in_a = sa.subscribe("acc.x").await.unwrap();
        let mut in_b = sb.subscribe("acc.x").await.unwrap();
        let mut feed = sb.subscribe("feed.>").await.unwrap();
        sync(&sa).await;
        sync(&sb).await;
        until_received(&pa, &mut in_a, "acc.x").await;
        until_received(&pb, &mut in_b, "acc.x").await;
        until_received(&pa, &mut feed, "feed.1").await;
        // Settled: each message reaches its own account's subscriber only, once.
        pa.publish("acc.x", "A".into()).await.unwrap();
        pb.publish("acc.x", "B".into()).await.unwrap();
        pa.publish("feed.2", "news".into()).await.unwrap();
        pa.flush().await.unwrap();
        pb.flush().await.unwrap();
        assert_eq!(next_msg(&mut in_a).await.payload, Bytes::from("A"));
        assert_eq!(next_msg(&mut in_b).await.payload, Bytes::from("B"));
        let m = next_msg(&mut feed).await;
        assert_eq!(
            (m.subject.as_str(), &m.payload[..]),
            ("feed.2", &b"news"[..])
        );
        expect_no_msg(&mut in_a).await;
        expect_no_msg(&mut in_b).await;
        expect_no_msg(&mut feed).await;

        // B's service, answered on the other server, asked from A.
        let svc = sb.subscribe("svc.echo").await.unwrap();
        sync(&sb).await;
        let serve = serve_echo(&sb, svc);
        until_answered(&pa, "svc.echo").await;
        let resp = within("request", pa.request("svc.echo", "ping".into()))
            .await
            .expect("answered across the route");
        assert_eq!(resp.payload, Bytes::from("ping"));
        serve.abort();
    }
    for node in [k, n] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keel_server_and_a_nats_server_route_over_tls() {
    let certs = common::TestCerts::new();
    let tls = format!("tls {{ {}, {} }}", certs.server_keys(), certs.ca_key());
    let start = |bin: &Path, name: &str, routes: &[String]| {
        let routes: Vec<String> = routes.iter().map(|r| format!("\"{r}\"")).collect();
        let conf = format!(
            "server_name: {name}\nhttp_port: -1\ncluster {{\n  name: mix\n  \
             listen: \"127.0.0.1:-1\"\n  routes: [{}]\n  {tls}\n}}\n",
            routes.join(", ")
        );
        Node::Process(Server::start_binary(bin, &conf, &[]))
    };
    // Each dials the other: both the accepting and the dialing side of each are used.
    let k = start(&keel(), "k1", &[]);
    let n = start(&reference_binary(), "n2", &[k.route_url()]);
    let k2 = start(&keel(), "k3", &[n.route_url()]);
    for node in [&k, &n, &k2] {
        node.wait_remotes(2).await;
    }
    let clients = [k.client().await, n.client().await, k2.client().await];
    let mut subs = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        subs.push(c.subscribe(format!("tls.{i}")).await.unwrap());
        sync(c).await;
    }
    for (i, node) in [&k, &n, &k2].iter().enumerate() {
        for j in 0..3 {
            if i != j {
                node.wait_route_interest(&format!("tls.{j}"), true).await;
            }
        }
    }
    for (i, c) in clients.iter().enumerate() {
        for j in 0..3 {
            c.publish(format!("tls.{j}"), format!("{i}").into())
                .await
                .unwrap();
        }
        c.flush().await.unwrap();
    }
    for s in subs.iter_mut() {
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(String::from_utf8(next_msg(s).await.payload.to_vec()).unwrap());
        }
        got.sort();
        assert_eq!(got, ["0", "1", "2"]);
        expect_no_msg(s).await;
    }
    for node in [k, n, k2] {
        node.shutdown().await;
    }
}
