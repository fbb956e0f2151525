//! Clusters, part 1: core routes (issue 14). Servers in one test process (the in-process
//! harness, through `common::Node`), or with `KEEL_TEST_REFERENCE=1` reference processes,
//! which is how every expectation here is checked against nats-server 2.15.
//!
//! Waiting is on conditions the monitoring endpoints show for both servers: `/varz`
//! `remotes` for the mesh, `/routez?subs=1` for interest that reached a peer.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::{
    expect_no_msg, free_port, http_get, is_reference, next_msg, serve_echo, sync, until_answered,
    within, Node, Proxy, ProxyMode, RawClient,
};
use futures::StreamExt;

fn conf(name: &str, listen: &str, routes: &[String], extra: &str) -> String {
    let routes: Vec<String> = routes.iter().map(|r| format!("\"{r}\"")).collect();
    format!(
        "cluster {{\n  name: {name}\n  listen: \"{listen}\"\n  routes: [{}]\n  {extra}\n}}\n",
        routes.join(", ")
    )
}

/// A member of cluster `name` on a free port dialing `routes`.
async fn member(name: &str, routes: &[String]) -> Node {
    Node::start_cluster(&conf(name, "127.0.0.1:-1", routes, "")).await
}

/// Three servers, B and C seeded with A only: the mesh forms by gossip.
async fn three() -> (Node, Node, Node) {
    // A route list that includes the server itself is fine (clients' test suites do it).
    let port = free_port();
    let own = format!("nats://127.0.0.1:{port}");
    let a = Node::start_cluster(&conf("t", &format!("127.0.0.1:{port}"), &[own], "")).await;
    let b = member("t", &[a.route_url()]).await;
    let c = member("t", &[a.route_url()]).await;
    for n in [&a, &b, &c] {
        n.wait_remotes(2).await;
    }
    (a, b, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_forms_from_one_seed_and_messages_flow_every_way() {
    let (a, b, c) = three().await;
    let nodes = [&a, &b, &c];
    let names: Vec<String> = {
        let mut v = Vec::new();
        for n in nodes {
            v.push(n.varz().await["server_name"].as_str().unwrap().to_string());
        }
        v
    };
    let clients = [a.client().await, b.client().await, c.client().await];
    let mut subs = Vec::new();
    for (i, cl) in clients.iter().enumerate() {
        subs.push(cl.subscribe(format!("to.{i}")).await.unwrap());
        sync(cl).await;
    }
    for (i, n) in nodes.iter().enumerate() {
        for j in 0..3 {
            if i != j {
                n.wait_route_interest(&format!("to.{j}"), true).await;
            }
        }
    }
    for (i, cl) in clients.iter().enumerate() {
        for j in 0..3 {
            cl.publish(format!("to.{j}"), format!("{i}->{j}").into())
                .await
                .unwrap();
        }
        cl.flush().await.unwrap();
    }
    for (j, sub) in subs.iter_mut().enumerate() {
        let mut got: Vec<String> = Vec::new();
        for _ in 0..3 {
            got.push(String::from_utf8(next_msg(sub).await.payload.to_vec()).unwrap());
        }
        got.sort();
        assert_eq!(got, (0..3).map(|i| format!("{i}->{j}")).collect::<Vec<_>>());
        expect_no_msg(sub).await;
    }
    // /routez names the peers; /varz has the cluster section.
    for (i, n) in nodes.iter().enumerate() {
        let r = n.routez("").await;
        let mut peers: Vec<String> = r["routes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["remote_name"].as_str().unwrap().to_string())
            .collect();
        peers.sort();
        peers.dedup();
        let mut want: Vec<String> = names.clone();
        want.remove(i);
        want.sort();
        assert_eq!(peers, want);
        let v = n.varz().await;
        assert_eq!(v["cluster"]["name"], "t", "{v}");
        assert_eq!(v["cluster"]["addr"], "127.0.0.1");
        assert!(v["cluster"]["cluster_port"].as_u64().unwrap() > 0);
        assert_eq!(v["remotes"], 2);
    }
    // The seed's own URL in its routes made no route to itself.
    assert!(!a.log().contains("Error trying to connect"), "{}", a.log());
    for n in [a, b, c] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_crosses_a_route_only_where_there_is_interest_and_once() {
    let a = member("t", &[]).await;
    let b = member("t", &[a.route_url()]).await;
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    let b_name = b.varz().await["server_name"].as_str().unwrap().to_string();
    let a_name = a.varz().await["server_name"].as_str().unwrap().to_string();
    let (ca, cb) = (a.client().await, b.client().await);

    // Overlapping interest on B: two subscriptions, another client's wildcard.
    let cb2 = b.client().await;
    let mut s1 = cb.subscribe("x.y").await.unwrap();
    let mut s2 = cb.subscribe("x.*").await.unwrap();
    let mut s3 = cb2.subscribe("x.>").await.unwrap();
    sync(&cb).await;
    sync(&cb2).await;
    a.wait_route_interest("x.>", true).await;
    a.wait_route_interest("x.y", true).await;
    a.wait_route_interest("x.*", true).await;

    let before = b.route_in_msgs(&a_name).await;
    for i in 0..10 {
        ca.publish("x.y", format!("{i}").into()).await.unwrap();
    }
    sync(&ca).await;
    for s in [&mut s1, &mut s2, &mut s3] {
        for i in 0..10 {
            assert_eq!(next_msg(s).await.payload, Bytes::from(format!("{i}")));
        }
    }
    // Ten messages crossed, one per publish, however many subscriptions matched.
    assert_eq!(b.route_in_msgs(&a_name).await - before, 10);

    // No interest: nothing crosses.
    drop(s3);
    cb2.flush().await.unwrap();
    a.wait_route_interest("x.>", false).await;
    let before = b.route_in_msgs(&a_name).await;
    for _ in 0..10 {
        ca.publish("nobody.listens", "x".into()).await.unwrap();
    }
    sync(&ca).await;
    // A message B does want, after them: once it is there the others would have been too.
    ca.publish("x.y", "last".into()).await.unwrap();
    assert_eq!(next_msg(&mut s1).await.payload, Bytes::from("last"));
    assert_eq!(b.route_in_msgs(&a_name).await - before, 1);

    // Unsubscribe crosses: the peer forgets the interest and sends nothing more.
    s1.unsubscribe().await.unwrap();
    s2.unsubscribe().await.unwrap();
    sync(&cb).await;
    a.wait_route_interest("x.y", false).await;
    a.wait_route_interest("x.*", false).await;
    let before = b.route_in_msgs(&a_name).await;
    ca.publish("x.y", "gone".into()).await.unwrap();
    sync(&ca).await;
    assert_eq!(b.route_in_msgs(&a_name).await, before);
    // The same holds the other way round.
    let mut sa = ca.subscribe("back").await.unwrap();
    sync(&ca).await;
    b.wait_route_interest("back", true).await;
    cb.publish("back", "hi".into()).await.unwrap();
    assert_eq!(next_msg(&mut sa).await.payload, Bytes::from("hi"));
    assert!(a.route_in_msgs(&b_name).await >= 1);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_groups_deliver_to_one_member_cluster_wide() {
    let (a, b, c) = three().await;
    let nodes = [&a, &b, &c];
    // Members: two on A, one on B, one on C; and a plain subscriber on C, which gets all.
    let mut members = Vec::new();
    let mut clients = Vec::new();
    for (i, n) in [0usize, 0, 1, 2].iter().enumerate() {
        let cl = nodes[*n].client().await;
        members.push((
            *n,
            i,
            cl.queue_subscribe("work", "workers".into()).await.unwrap(),
        ));
        sync(&cl).await;
        clients.push(cl);
    }
    let watcher_client = c.client().await;
    let mut watcher = watcher_client.subscribe("work").await.unwrap();
    sync(&watcher_client).await;
    // Every node has members, so each sees the interest on both of its peers.
    for n in nodes {
        n.wait_route_interest_count("work", 2).await;
    }
    let pubs = [a.client().await, b.client().await, c.client().await];
    const N: usize = 200;
    for (p, cl) in pubs.iter().enumerate() {
        for k in 0..N {
            cl.publish("work", format!("{p}.{k}").into()).await.unwrap();
        }
        sync(cl).await;
    }
    let total = 3 * N;
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut per_node = [0usize; 3];
    let mut got = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while got < total {
        let mut progressed = false;
        for (node, _, sub) in members.iter_mut() {
            if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(20), sub.next()).await {
                *seen
                    .entry(String::from_utf8(m.payload.to_vec()).unwrap())
                    .or_default() += 1;
                per_node[*node] += 1;
                got += 1;
                progressed = true;
            }
        }
        assert!(
            progressed || tokio::time::Instant::now() < deadline,
            "got {got} of {total}"
        );
    }
    assert_eq!(seen.len(), total, "every message once");
    assert!(seen.values().all(|&n| n == 1));
    for (_, _, sub) in members.iter_mut() {
        expect_no_msg(sub).await;
    }
    // Every node's members had a share (each has a quarter to a half of the weight).
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    // The plain subscriber got everything, once.
    for _ in 0..total {
        next_msg(&mut watcher).await;
    }
    expect_no_msg(&mut watcher).await;
    for n in [a, b, c] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_is_picked_in_proportion_to_its_members() {
    let a = member("t", &[]).await;
    let b = member("t", &[a.route_url()]).await;
    a.wait_remotes(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let mut local = ca.queue_subscribe("w", "g".into()).await.unwrap();
    let mut remote = Vec::new();
    for _ in 0..3 {
        remote.push(cb.queue_subscribe("w", "g".into()).await.unwrap());
    }
    sync(&ca).await;
    sync(&cb).await;
    a.wait_route_interest("w", true).await;
    // The weight follows B's third member: probe until B's share shows it.
    const N: usize = 400;
    let mut remote_share = 0;
    for round in 0..20 {
        for _ in 0..N {
            ca.publish("w", "m".into()).await.unwrap();
        }
        sync(&ca).await;
        let mut local_n = 0;
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(50), local.next()).await
        {
            local_n += 1;
        }
        remote_share = N - local_n;
        // Weight 3 against 1: about 300 of 400 (the reference: 34 of 40).
        if (240..=370).contains(&remote_share) {
            break;
        }
        assert!(round < 19, "remote share {remote_share} of {N}");
    }
    let mut remote_n = 0;
    for s in remote.iter_mut() {
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(50), s.next()).await {
            remote_n += 1;
        }
    }
    assert!(remote_n >= remote_share, "{remote_n} < {remote_share}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_reply_and_no_responders_across_nodes() {
    let (a, b, c) = three().await;
    let responder = c.client().await;
    let svc = responder.subscribe("svc.echo").await.unwrap();
    sync(&responder).await;
    a.wait_route_interest("svc.echo", true).await;
    b.wait_route_interest("svc.echo", true).await;
    let serve = serve_echo(&responder, svc);
    for n in [&a, &b] {
        let cl = n.client().await;
        let resp = within("request", cl.request("svc.echo", "ping".into()))
            .await
            .expect("reply across the cluster");
        assert_eq!(resp.payload, Bytes::from("ping"));
        // Nobody anywhere: the requester's server answers no responders at once.
        let err = within("no responders", cl.request("svc.none", "x".into()))
            .await
            .expect_err("no responders");
        assert_eq!(
            err.kind(),
            async_nats::client::RequestErrorKind::NoResponders,
            "{err}"
        );
    }
    serve.abort();
    for n in [a, b, c] {
        n.shutdown().await;
    }
}

/// Reads the raw client's lines until an INFO whose `connect_urls` satisfies `f`.
async fn info_until(raw: &mut RawClient, what: &str, f: impl Fn(&[String]) -> bool) {
    within(what, async {
        loop {
            let line = raw.read_line().await;
            if let Some(json) = line.strip_prefix("INFO ") {
                let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
                let urls: Vec<String> = v["connect_urls"]
                    .as_array()
                    .map(|a| a.iter().map(|u| u.as_str().unwrap().to_string()).collect())
                    .unwrap_or_default();
                if f(&urls) {
                    return;
                }
            } else if line == "PING" {
                raw.send(b"PONG\r\n").await;
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_learn_the_cluster_from_connect_urls() {
    let a = member("t", &[]).await;
    let b = member("t", &[a.route_url()]).await;
    a.wait_remotes(1).await;
    let url = |n: &Node| n.addr().to_string();
    let mut raw = RawClient::connect(a.addr()).await;
    let first: serde_json::Value =
        serde_json::from_str(raw.info.strip_prefix("INFO ").unwrap().trim()).unwrap();
    let urls: Vec<&str> = first["connect_urls"]
        .as_array()
        .expect("connect_urls in a cluster")
        .iter()
        .map(|u| u.as_str().unwrap())
        .collect();
    assert!(
        urls.contains(&url(&a).as_str()) && urls.contains(&url(&b).as_str()),
        "{urls:?}"
    );
    assert_eq!(first["cluster"], "t");
    raw.send(b"CONNECT {\"verbose\":false,\"protocol\":1}\r\nPING\r\n")
        .await;
    assert_eq!(raw.read_line().await, "PONG");
    // A server joins: an INFO update names it; it leaves: another drops it.
    let c = member("t", &[a.route_url()]).await;
    let cu = url(&c);
    info_until(&mut raw, "INFO with the new server", |u| u.contains(&cu)).await;
    c.shutdown().await;
    info_until(&mut raw, "INFO without the gone server", |u| {
        !u.is_empty() && !u.contains(&cu)
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_advertise_keeps_peers_from_clients() {
    let a = Node::start_cluster(&conf("t", "127.0.0.1:-1", &[], "no_advertise: true")).await;
    let b = Node::start_cluster(&conf(
        "t",
        "127.0.0.1:-1",
        &[a.route_url()],
        "no_advertise: true",
    ))
    .await;
    a.wait_remotes(1).await;
    let raw = RawClient::connect(a.addr()).await;
    assert!(!raw.info.contains("connect_urls"), "{}", raw.info);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_dialing_each_other_end_with_one_route() {
    let (pa, pb) = (free_port(), free_port());
    let (ua, ub) = (
        format!("nats://127.0.0.1:{pa}"),
        format!("nats://127.0.0.1:{pb}"),
    );
    let (conf_a, conf_b) = (
        conf("t", &format!("127.0.0.1:{pa}"), &[ub], ""),
        conf("t", &format!("127.0.0.1:{pb}"), &[ua], ""),
    );
    let (a, b) = tokio::join!(Node::start_cluster(&conf_a), Node::start_cluster(&conf_b));
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let mut sa = ca.subscribe("dup").await.unwrap();
    sync(&ca).await;
    b.wait_route_interest("dup", true).await;
    for i in 0..20 {
        cb.publish("dup", format!("{i}").into()).await.unwrap();
    }
    for i in 0..20 {
        assert_eq!(next_msg(&mut sa).await.payload, Bytes::from(format!("{i}")));
    }
    expect_no_msg(&mut sa).await;
    a.wait_remotes(1).await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_leaves_and_comes_back_rejoins() {
    let (a, b, c) = three().await;
    let cb = b.client().await;
    let mut sb = cb.subscribe("rejoin").await.unwrap();
    sync(&cb).await;
    c.shutdown().await;
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    // A new server seeded with A only: B learns it by gossip, and the other way round.
    let c2 = member("t", &[a.route_url()]).await;
    for n in [&a, &b, &c2] {
        n.wait_remotes(2).await;
    }
    c2.wait_route_interest("rejoin", true).await;
    let cc = c2.client().await;
    cc.publish("rejoin", "back".into()).await.unwrap();
    assert_eq!(next_msg(&mut sb).await.payload, Bytes::from("back"));
    for n in [a, b, c2] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_of_another_cluster_is_refused() {
    let a = member("t", &[]).await;
    let b = member("other", &[a.route_url()]).await;
    let want = "Rejecting connection, cluster name \"other\" does not match \"t\"";
    a.wait_logged(want).await;
    assert_eq!(a.varz().await["remotes"], 0);
    assert_eq!(b.varz().await["remotes"], 0);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_cluster_name_gives_way_to_a_configured_one() {
    let a = Node::start_cluster("cluster { listen: \"127.0.0.1:-1\" }").await;
    let b = member("fixed", &[a.route_url()]).await;
    a.wait_remotes(1).await;
    within("name adopted", async {
        while a.varz().await["cluster"]["name"] != "fixed" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // A process's log reaches the test through a pipe: the line may trail the change.
    a.wait_logged("Cluster name updated to fixed").await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_authenticate_with_the_cluster_credentials() {
    let auth = "authorization { user: ruser, password: rpass, timeout: 1 }";
    let a = Node::start_cluster(&conf("t", "127.0.0.1:-1", &[], auth)).await;
    let port = a.route_url().rsplit(':').next().unwrap().to_string();
    let wrong = format!("nats://ruser:nope@127.0.0.1:{port}");
    let b = member("t", &[wrong]).await;
    a.wait_logged("authentication error - User \"ruser\"").await;
    assert_eq!(a.varz().await["remotes"], 0);
    assert!(!a.log().contains("nope"), "a password reached the log");
    let right = format!("nats://ruser:rpass@127.0.0.1:{port}");
    // C has the same authorization and the right credentials.
    let c = Node::start_cluster(&conf("t", "127.0.0.1:-1", &[right], auth)).await;
    a.wait_remotes(1).await;
    c.wait_remotes(1).await;
    assert_eq!(a.varz().await["cluster"]["auth_timeout"], 1);

    // A route that never sends CONNECT: -ERR 'Authentication Timeout' after the timeout.
    let mut raw = RawClient::connect(a.route_url()[7..].parse().unwrap()).await;
    assert!(raw.info.contains("\"auth_required\":true"), "{}", raw.info);
    assert_eq!(raw.read_line().await, "-ERR 'Authentication Timeout'");
    for n in [a, b, c] {
        n.shutdown().await;
    }
}

/// A fake route peer: reads the server's INFO, sends CONNECT and INFO as a no-pool server
/// named `name` would.
async fn fake_peer(route_addr: std::net::SocketAddr, cluster: &str, name: &str) -> RawClient {
    let mut raw = RawClient::connect(route_addr).await;
    let id = format!("N{:0>55}", name.to_ascii_uppercase());
    raw.send(
        format!(
            "CONNECT {{\"echo\":true,\"verbose\":false,\"pedantic\":false,\"tls_required\":false,\
             \"headers\":true,\"name\":\"{id}\",\"cluster\":\"{cluster}\"}}\r\n\
             INFO {{\"server_id\":\"{id}\",\"server_name\":\"{name}\",\"version\":\"2.15.1\",\
             \"proto\":3,\"host\":\"127.0.0.1\",\"port\":1,\"headers\":true,\
             \"max_payload\":1048576,\"cluster\":\"{cluster}\",\"compression\":\"off\"}}\r\n"
        )
        .as_bytes(),
    )
    .await;
    raw
}

fn route_addr(n: &Node) -> std::net::SocketAddr {
    n.route_url()["nats://".len()..].parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_port_protocol_errors_match_the_reference() {
    let a = member("t", &[]).await;
    // Anything but CONNECT first.
    let mut raw = RawClient::connect(route_addr(&a)).await;
    raw.send(b"PING\r\n").await;
    assert_eq!(raw.read_line().await, "-ERR 'Authorization Violation'");
    // A client on the route port.
    let mut raw = RawClient::connect(route_addr(&a)).await;
    raw.send(b"CONNECT {\"lang\":\"go\",\"version\":\"1.0\",\"verbose\":false}\r\n")
        .await;
    assert_eq!(
        raw.read_line().await,
        "-ERR 'attempted to connect to route port'"
    );
    // Another cluster.
    let mut raw = RawClient::connect(route_addr(&a)).await;
    raw.send(b"CONNECT {\"name\":\"NX\",\"cluster\":\"zz\"}\r\n")
        .await;
    assert_eq!(
        raw.read_line().await,
        "-ERR 'Rejecting connection, cluster name \"zz\" does not match \"t\"'"
    );
    // A connection dedicated to an account (pooling) toward a server that does not pool.
    if !is_reference() {
        let mut raw = RawClient::connect(route_addr(&a)).await;
        raw.send(
            b"CONNECT {\"name\":\"NY\",\"cluster\":\"t\"}\r\nINFO {\"server_id\":\"NY\",\
              \"server_name\":\"y\",\"cluster\":\"t\",\"route_pool_size\":3,\
              \"route_account\":\"$SYS\"}\r\n",
        )
        .await;
        assert_eq!(
            raw.read_line().await,
            "-ERR 'Not possible to have a dedicated route for account \"$SYS\" between those servers'"
        );
    }
    // An unknown op after the handshake.
    let mut raw = fake_peer(route_addr(&a), "t", "fake").await;
    raw.send(b"FOO bar\r\n").await;
    within("unknown op", async {
        loop {
            let l = raw.read_line().await;
            if l.starts_with("-ERR") {
                assert_eq!(l, "-ERR 'Unknown Protocol Operation'");
                return;
            }
        }
    })
    .await;
    // An unknown compression mode.
    let mut raw = RawClient::connect(route_addr(&a)).await;
    raw.send(
        b"CONNECT {\"name\":\"NZ\",\"cluster\":\"t\"}\r\nINFO {\"server_id\":\"NZ\",\
          \"server_name\":\"z\",\"cluster\":\"t\",\"compression\":\"zstd\"}\r\n",
    )
    .await;
    assert_eq!(
        raw.read_line().await,
        "-ERR 'unsupported route compression mode \"zstd\"'"
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_peer_gets_interest_and_messages_in_the_reference_format() {
    let a = member("t", &[]).await;
    let ca = a.client().await;
    let _s = ca.subscribe("fp.plain").await.unwrap();
    let _q1 = ca.queue_subscribe("fp.q", "grp".into()).await.unwrap();
    let _q2 = ca.queue_subscribe("fp.q", "grp".into()).await.unwrap();
    sync(&ca).await;
    let mut raw = fake_peer(route_addr(&a), "t", "fake").await;
    let mut lines = Vec::new();
    within("interest from the server", async {
        while !(lines.iter().any(|l: &String| l == "RS+ $G fp.plain")
            && lines.iter().any(|l: &String| l == "RS+ $G fp.q grp 2"))
        {
            let l = raw.read_line().await;
            if l == "PING" {
                raw.send(b"PONG\r\n").await;
            }
            lines.push(l);
        }
    })
    .await;
    // Our interest, then a message from A's client.
    raw.send(b"RS+ $G from.a\r\nRS+ $G fq fq 1\r\nPING\r\n")
        .await;
    within("PONG", async { while raw.read_line().await != "PONG" {} }).await;
    a.wait_route_interest("from.a", true).await;
    ca.publish("from.a", "hello".into()).await.unwrap();
    ca.publish_with_reply("fq", "r.1", "q".into())
        .await
        .unwrap();
    ca.flush().await.unwrap();
    let mut got = Vec::new();
    within("routed messages", async {
        while got.len() < 4 {
            let l = raw.read_line().await;
            if l.starts_with("RMSG") || got.len() % 2 == 1 {
                got.push(l);
            } else if l == "PING" {
                raw.send(b"PONG\r\n").await;
            }
        }
    })
    .await;
    assert_eq!(
        got,
        ["RMSG $G from.a 5", "hello", "RMSG $G fq + r.1 fq 1", "q"],
        "{lines:?}"
    );
    // Messages from the peer reach A's subscribers; a queue group only when listed.
    let mut plain = ca.subscribe("to.a").await.unwrap();
    let mut q = ca.queue_subscribe("to.a", "g".into()).await.unwrap();
    sync(&ca).await;
    raw.send(b"RMSG $G to.a 2\r\nm1\r\nRMSG $G to.a | g 2\r\nm2\r\nHMSG $G to.a r 12 14\r\nNATS/1.0\r\n\r\nm3\r\n")
        .await;
    for want in ["m1", "m2", "m3"] {
        assert_eq!(next_msg(&mut plain).await.payload, Bytes::from(want));
    }
    assert_eq!(next_msg(&mut q).await.payload, Bytes::from("m2"));
    expect_no_msg(&mut q).await;
    a.shutdown().await;
}

/// With `trace: true` a route's protocol is traced as the reference traces it: each op
/// from the peer (`<<- [RS+ $G x]`, `<<- [RMSG $G x 2]` and its payload, `<<- [PING]`,
/// its CONNECT) and each sent to it (`->> [RS+ ...]`, `->> [RMSG ...]` and its payload,
/// `->> [PONG]`), after `<addr> - rid:<n> -`, but not the interest a new route is given at
/// once; a client's subscription that goes is traced as `<-> [DELSUB sid]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_covers_route_protocol_and_removed_subscriptions() {
    let a = Node::start_cluster(&format!(
        "trace: true\n{}",
        conf("t", "127.0.0.1:-1", &[], "")
    ))
    .await;
    let ca = a.client().await;
    let _s = ca.subscribe("tr.plain").await.unwrap();
    sync(&ca).await;
    let mut raw = fake_peer(route_addr(&a), "t", "fake").await;
    raw.send(b"RS+ $G tr.from\r\nPING\r\n").await;
    within("PONG", async { while raw.read_line().await != "PONG" {} }).await;
    a.wait_route_interest("tr.from", true).await;
    ca.publish("tr.from", "hello".into()).await.unwrap();
    ca.flush().await.unwrap();
    let mut plain = ca.subscribe("tr.to").await.unwrap();
    sync(&ca).await;
    raw.send(b"RMSG $G tr.to 2\r\nm1\r\n").await;
    assert_eq!(next_msg(&mut plain).await.payload, Bytes::from("m1"));
    plain.unsubscribe().await.unwrap();
    sync(&ca).await;
    for line in [
        "<<- [CONNECT {",
        "<<- [RS+ $G tr.from]",
        "<<- [PING]",
        "->> [PONG]",
        "->> [RS+ $G tr.to]",
        "->> [RS- $G tr.to]",
        "->> [RMSG $G tr.from 5]",
        "->> MSG_PAYLOAD: [\"hello\"]",
        "<<- [RMSG $G tr.to 2]",
        "<<- MSG_PAYLOAD: [\"m1\"]",
    ] {
        a.wait_logged(line).await;
    }
    // The interest a route gets as it connects is sent untraced, as by the reference.
    let log = a.log();
    assert!(!log.contains("[RS+ $G tr.plain]"), "{log}");
    let sid = log
        .lines()
        .find_map(|l| l.split("<<- [SUB tr.to ").nth(1))
        .and_then(|rest| rest.strip_suffix(']'))
        .expect("the SUB traced")
        .to_string();
    a.wait_logged(&format!("<-> [DELSUB {sid}]")).await;
    let rs = log
        .lines()
        .find(|l| l.contains("<<- [RS+ $G tr.from]"))
        .unwrap();
    assert!(rs.contains(" - rid:") && rs.contains("[TRC]"), "{rs}");
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_route_is_cut_and_memory_stays_bounded() {
    let a = Node::start_cluster(&format!(
        "max_pending: 1MB\nwrite_deadline: \"2s\"\n{}",
        conf("t", "127.0.0.1:-1", &[], "")
    ))
    .await;
    // A peer that takes our interest and then reads nothing.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(route_addr(&a)).await.unwrap();
    let mut raw = RawClient::from_stream(stream).await;
    let id = format!("N{:0>55}", "STUCK");
    raw.send(
        format!(
            "CONNECT {{\"name\":\"{id}\",\"cluster\":\"t\",\"headers\":true}}\r\n\
             INFO {{\"server_id\":\"{id}\",\"server_name\":\"stuck\",\"cluster\":\"t\",\
             \"headers\":true,\"compression\":\"off\"}}\r\nRS+ $G slow.>\r\n"
        )
        .as_bytes(),
    )
    .await;
    a.wait_route_interest("slow.>", true).await;
    let ca = a.client().await;
    let payload = Bytes::from(vec![b'x'; 64 * 1024]);
    let mut sent = 0;
    within("the stuck route is cut", async {
        loop {
            for _ in 0..16 {
                ca.publish("slow.x", payload.clone()).await.unwrap();
                sent += 1;
            }
            ca.flush().await.unwrap();
            let v = a.varz().await;
            if v["slow_consumer_stats"]["routes"].as_u64().unwrap_or(0) >= 1 {
                return;
            }
            assert!(sent < 100_000, "never cut");
        }
    })
    .await;
    a.wait_remotes(0).await;
    assert!(a.log().contains("Slow Consumer Detected"), "{}", a.log());
    // The publisher carries on.
    let mut s = ca.subscribe("after").await.unwrap();
    ca.publish("after", "ok".into()).await.unwrap();
    assert_eq!(next_msg(&mut s).await.payload, Bytes::from("ok"));
    drop(raw);
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_cut_and_restored_through_a_proxy() {
    let a = Node::start_cluster(&conf("t", "127.0.0.1:-1", &[], "ping_interval: \"1s\"")).await;
    let proxy = Proxy::start(route_addr(&a)).await;
    let b = Node::start_cluster(&conf(
        "t",
        "127.0.0.1:-1",
        &[proxy.url()],
        "ping_interval: \"1s\"",
    ))
    .await;
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let mut sa = ca.subscribe("p.x").await.unwrap();
    sync(&ca).await;
    b.wait_route_interest("p.x", true).await;
    cb.publish("p.x", "1".into()).await.unwrap();
    assert_eq!(next_msg(&mut sa).await.payload, Bytes::from("1"));

    // Cut: both sides see the route go; messages published meanwhile do not arrive.
    proxy.set(ProxyMode::Cut);
    a.wait_remotes(0).await;
    b.wait_remotes(0).await;
    cb.publish("p.x", "lost".into()).await.unwrap();
    sync(&cb).await;
    expect_no_msg(&mut sa).await;
    // Restored: B dials again and learns A's interest again.
    proxy.set(ProxyMode::Open);
    a.wait_remotes(1).await;
    b.wait_route_interest("p.x", true).await;
    cb.publish("p.x", "2".into()).await.unwrap();
    assert_eq!(next_msg(&mut sa).await.payload, Bytes::from("2"));

    // A silent partition (sockets open, nothing moves): the pings find it.
    proxy.set(ProxyMode::Stall);
    a.wait_remotes(0).await;
    b.wait_remotes(0).await;
    proxy.set(ProxyMode::Open);
    a.wait_remotes(1).await;
    b.wait_route_interest("p.x", true).await;
    cb.publish("p.x", "3".into()).await.unwrap();
    assert_eq!(next_msg(&mut sa).await.payload, Bytes::from("3"));
    expect_no_msg(&mut sa).await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routez_lists_routes_and_their_interest() {
    let a = member("t", &[]).await;
    let b = member("t", &[a.route_url()]).await;
    a.wait_remotes(1).await;
    let cb = b.client().await;
    let _s = cb.subscribe("rz.one").await.unwrap();
    let _q = cb.queue_subscribe("rz.q", "g".into()).await.unwrap();
    sync(&cb).await;
    a.wait_route_interest("rz.q", true).await;
    let r = a.routez("subs=detail").await;
    let route = r["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| {
            r["subscriptions_list_detail"]
                .as_array()
                .is_some_and(|l| l.iter().any(|s| s["subject"] == "rz.one"))
        })
        .expect("a route with B's interest")
        .clone();
    for k in [
        "rid",
        "remote_id",
        "remote_name",
        "did_solicit",
        "is_configured",
        "ip",
        "port",
        "start",
        "last_activity",
        "rtt",
        "uptime",
        "idle",
        "pending_size",
        "in_msgs",
        "out_msgs",
        "in_bytes",
        "out_bytes",
        "subscriptions",
        "compression",
    ] {
        assert!(route.get(k).is_some(), "{k} missing: {route}");
    }
    assert_eq!(route["compression"], "off");
    let detail = route["subscriptions_list_detail"].as_array().unwrap();
    let one = detail.iter().find(|s| s["subject"] == "rz.one").unwrap();
    assert_eq!(one["sid"], "R $G rz.one", "{one}");
    let q = detail.iter().find(|s| s["subject"] == "rz.q").unwrap();
    assert_eq!(
        (&q["qgroup"], &q["sid"]),
        (&"g".into(), &"R $G rz.q g".into()),
        "{q}"
    );
    if !is_reference() {
        // Keel's /metrics: the exporter's routez families.
        let m = http_get(a.monitor_port(), "/metrics").await.body;
        assert!(m.contains("gnatsd_routez_num_routes{"), "{m}");
        assert!(m.contains("gnatsd_varz_remotes{"));
        assert!(m.contains("gnatsd_varz_cluster_pool_size{"));
        assert!(m.contains("gnatsd_routez_route_in_msgs{"));
        assert!(m.contains("remote_name=\""));
        assert_eq!(a.varz().await["cluster"]["pool_size"], -1);
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_jetstream_does_not_reach_a_peers_api() {
    if is_reference() {
        // The reference wants every JetStream server to have routes configured.
        return;
    }
    let js = Node::start_jetstream(&format!(
        "server_name: js\n{}",
        conf("t", "127.0.0.1:-1", &[], "")
    ))
    .await;
    let other = member("t", &[js.route_url()]).await;
    js.wait_remotes(1).await;
    let c = js.client().await;
    let (_, created) = common::json_request(
        &c,
        "$JS.API.STREAM.CREATE.S",
        r#"{"name":"S","subjects":["s.>"],"storage":"memory"}"#,
    )
    .await;
    assert!(created.get("error").is_none(), "{created}");
    let ack = within("pub ack", c.request("s.1", "x".into()))
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&ack.payload).contains("\"seq\":1"));
    // The other server does not reach this server's JetStream.
    let co = other.client().await;
    let err = within("no JetStream there", co.request("$JS.API.INFO", "".into()))
        .await
        .expect_err("no responders");
    assert_eq!(
        err.kind(),
        async_nats::client::RequestErrorKind::NoResponders
    );
    // Only the system account's meta leader API is announced, not the account's API.
    assert!(!other
        .route_subjects()
        .await
        .iter()
        .any(|s| s.starts_with("$JS")
            && !s.ends_with("$JS.API.META.LEADER.STEPDOWN")
            && !s.ends_with("$JS.API.SERVER.REMOVE")));
    js.shutdown().await;
    other.shutdown().await;
}

/// Lame duck mode on one server: the others stop advertising it to their clients, and its
/// own clients are pointed at the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_in_lame_duck_mode_is_no_longer_advertised() {
    let ldm = "lame_duck_duration: \"30s\"\nlame_duck_grace_period: \"10s\"\n";
    let a = member("t", &[]).await;
    let b = Node::start_cluster(&format!(
        "{ldm}{}",
        conf("t", "127.0.0.1:-1", &[a.route_url()], "")
    ))
    .await;
    a.wait_remotes(1).await;
    let (ua, ub) = (a.addr().to_string(), b.addr().to_string());
    let mut on_a = RawClient::connect(a.addr()).await;
    on_a.send(b"CONNECT {\"verbose\":false,\"protocol\":1}\r\nPING\r\n")
        .await;
    assert_eq!(on_a.read_line().await, "PONG");
    let mut on_b = RawClient::connect(b.addr()).await;
    on_b.send(b"CONNECT {\"verbose\":false,\"protocol\":1}\r\nPING\r\n")
        .await;
    assert_eq!(on_b.read_line().await, "PONG");
    info_until(&mut on_a, "A's INFO names B", |u| u.contains(&ub)).await;
    info_until(&mut on_b, "B's INFO names A", |u| u.contains(&ua)).await;
    b.lame_duck();
    info_until(&mut on_a, "A stops advertising B", |u| {
        u.contains(&ua) && !u.contains(&ub)
    })
    .await;
    within("B's clients are told", async {
        loop {
            let line = on_b.read_line().await;
            if line.starts_with("INFO ") && line.contains("\"ldm\":true") {
                let v: serde_json::Value =
                    serde_json::from_str(line["INFO ".len()..].trim()).unwrap();
                assert_eq!(v["connect_urls"], serde_json::json!([ua]), "{line}");
                return;
            }
        }
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
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

/// A client of `n` as user `u` (password `u`).
async fn user(n: &Node, u: &str) -> async_nats::Client {
    within(
        "connect",
        async_nats::ConnectOptions::with_user_and_password(u.into(), u.into()).connect(n.url()),
    )
    .await
    .expect("connect")
}

/// Two servers with [`ACCOUNTS`], routed.
async fn two_with_accounts() -> (Node, Node) {
    let a = Node::start_cluster(&format!("{ACCOUNTS}{}", conf("t", "127.0.0.1:-1", &[], ""))).await;
    let routes = [a.route_url()];
    let b = Node::start_cluster(&format!(
        "{ACCOUNTS}{}",
        conf("t", "127.0.0.1:-1", &routes, "")
    ))
    .await;
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    (a, b)
}

/// Publishes `payload` on `subject` until `sub` (on another server) gets one: its interest
/// crossed the route. Returns what else arrived meanwhile (more probes).
async fn until_received(
    p: &async_nats::Client,
    sub: &mut async_nats::Subscriber,
    subject: &str,
    payload: &str,
) {
    within("interest across the route", async {
        loop {
            p.publish(subject.to_string(), payload.to_string().into())
                .await
                .unwrap();
            p.flush().await.unwrap();
            if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(50), sub.next()).await {
                assert_eq!(m.payload, Bytes::from(payload.to_string()));
                return;
            }
        }
    })
    .await
}

/// Takes every message `sub` has until it is quiet; their payloads.
async fn drain(sub: &mut async_nats::Subscriber) -> Vec<String> {
    let mut v = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), sub.next()).await {
        v.push(String::from_utf8_lossy(&m.payload).into_owned());
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accounts_keep_their_messages_apart_across_routes() {
    let (a, b) = two_with_accounts().await;
    let (sub_a, sub_b) = (user(&b, "a").await, user(&b, "b").await);
    let mut in_a = sub_a.subscribe("acc.x").await.unwrap();
    let mut in_b = sub_b.subscribe("acc.x").await.unwrap();
    let mut q_a = sub_a
        .queue_subscribe("acc.q", "g".to_string())
        .await
        .unwrap();
    sync(&sub_a).await;
    sync(&sub_b).await;
    let (pub_a, pub_b) = (user(&a, "a").await, user(&a, "b").await);
    until_received(&pub_a, &mut in_a, "acc.x", "A probe").await;
    until_received(&pub_b, &mut in_b, "acc.x", "B probe").await;
    until_received(&pub_a, &mut q_a, "acc.q", "A probe").await;
    let (got_a, got_b) = (drain(&mut in_a).await, drain(&mut in_b).await);
    assert!(got_a.iter().all(|p| p == "A probe"), "{got_a:?}");
    assert!(got_b.iter().all(|p| p == "B probe"), "{got_b:?}");
    drain(&mut q_a).await;

    pub_a.publish("acc.x", "from A".into()).await.unwrap();
    pub_b.publish("acc.x", "from B".into()).await.unwrap();
    // B has no queue subscriber: its message to acc.q reaches nobody (not A's group).
    pub_b.publish("acc.q", "B to q".into()).await.unwrap();
    pub_a.publish("acc.q", "A to q".into()).await.unwrap();
    pub_a.flush().await.unwrap();
    pub_b.flush().await.unwrap();
    assert_eq!(next_msg(&mut in_a).await.payload, Bytes::from("from A"));
    assert_eq!(next_msg(&mut in_b).await.payload, Bytes::from("from B"));
    assert_eq!(next_msg(&mut q_a).await.payload, Bytes::from("A to q"));
    expect_no_msg(&mut in_a).await;
    expect_no_msg(&mut in_b).await;
    expect_no_msg(&mut q_a).await;

    // Request/reply within account A across the route; B's subscriber is not asked.
    let mut svc_b = sub_b.subscribe("acc.svc").await.unwrap();
    let svc_a = sub_a.subscribe("acc.svc").await.unwrap();
    sync(&sub_a).await;
    sync(&sub_b).await;
    let serve = serve_echo(&sub_a, svc_a);
    let resp = within("request in A", async {
        loop {
            match pub_a.request("acc.svc", "ping".into()).await {
                Ok(m) => return m,
                Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await;
    assert_eq!(resp.payload, Bytes::from("ping"));
    expect_no_msg(&mut svc_b).await;
    serve.abort();
    for n in [a, b] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imports_and_exports_work_across_routes() {
    let (a, b) = two_with_accounts().await;
    // A stream A exports, imported by B's subscriber on the other server: once.
    let sub_b = user(&b, "b").await;
    let mut feed = sub_b.subscribe("feed.>").await.unwrap();
    sync(&sub_b).await;
    let pub_a = user(&a, "a").await;
    until_received(&pub_a, &mut feed, "feed.1", "probe").await;
    drain(&mut feed).await;
    pub_a.publish("feed.2", "news".into()).await.unwrap();
    pub_a.flush().await.unwrap();
    let m = next_msg(&mut feed).await;
    assert_eq!(
        (m.subject.as_str(), &m.payload[..]),
        ("feed.2", &b"news"[..])
    );
    expect_no_msg(&mut feed).await;

    // A service B exports, answered on the other server, asked from A.
    let responder = user(&b, "b").await;
    let svc = responder.subscribe("svc.echo").await.unwrap();
    sync(&responder).await;
    let serve = serve_echo(&responder, svc);
    // Until the responder's interest reached A's server, a request goes unanswered.
    until_answered(&pub_a, "svc.echo").await;
    for _ in 0..3 {
        let resp = within(
            "a service answered across the route",
            pub_a.request("svc.echo", "ping".into()),
        )
        .await
        .expect("the responder on the other server answers");
        assert_eq!(resp.payload, Bytes::from("ping"));
    }
    serve.abort();
    for n in [a, b] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_over_tls_verify_both_ends() {
    let certs = common::TestCerts::new();
    let tls = format!("tls {{ {}, {} }}", certs.server_keys(), certs.ca_key());
    let a = Node::start_cluster(&conf("t", "127.0.0.1:-1", &[], &tls)).await;
    let b = Node::start_cluster(&conf("t", "127.0.0.1:-1", &[a.route_url()], &tls)).await;
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let mut sub = cb.subscribe("tls.x").await.unwrap();
    sync(&cb).await;
    a.wait_route_interest("tls.x", true).await;
    ca.publish("tls.x", "hi".into()).await.unwrap();
    ca.flush().await.unwrap();
    assert_eq!(next_msg(&mut sub).await.payload, Bytes::from("hi"));
    let v = a.varz().await;
    assert_eq!(v["cluster"]["tls_required"], true, "{}", v["cluster"]);
    assert_eq!(v["cluster"]["tls_verify"], true);
    assert_eq!(v["cluster"]["tls_timeout"], 2);
    // Without its own, the authorization timeout is the handshake's plus a second.
    assert_eq!(v["cluster"]["auth_timeout"], 3);
    assert!(
        v["cluster"]["tls_cert_not_after"].is_string(),
        "{}",
        v["cluster"]
    );

    // The handshake comes first: a plain connection is sent nothing.
    let mut plain = tokio::net::TcpStream::connect(route_addr(&a))
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let got = tokio::time::timeout(
        Duration::from_millis(500),
        tokio::io::AsyncReadExt::read(&mut plain, &mut buf),
    )
    .await;
    assert!(
        !matches!(got, Ok(Ok(n)) if n > 0),
        "plain text on a TLS route port: {:?}",
        String::from_utf8_lossy(&buf)
    );
    drop(plain);

    // A peer whose certificate another CA signed is refused.
    let bad = format!(
        "tls {{ cert_file: {:?}, key_file: {:?}, {} }}",
        certs.path("other-client-cert.pem").display().to_string(),
        certs.path("other-client-key.pem").display().to_string(),
        certs.ca_key()
    );
    let c = Node::start_cluster(&conf("t", "127.0.0.1:-1", &[a.route_url()], &bad)).await;
    a.wait_logged("TLS route handshake error").await;
    assert_eq!(a.varz().await["remotes"], 1);
    for n in [a, b, c] {
        n.shutdown().await;
    }
}

/// A stream in an importing account stores what is published to it on its server, not
/// what a peer sent only because a client subscribed there (stream imports are followed on
/// the subscriber's server, for its clients).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_does_not_store_what_a_peer_sent_through_an_import() {
    if is_reference() {
        // The reference wants every JetStream server to have routes configured.
        return;
    }
    let accounts = ACCOUNTS.replace("B: { users", "B: { jetstream: enabled, users");
    let a = Node::start_cluster(&format!("{accounts}{}", conf("t", "127.0.0.1:-1", &[], ""))).await;
    let routes = [a.route_url()];
    let b = Node::start_jetstream(&format!(
        "server_name: b\n{accounts}{}",
        conf("t", "127.0.0.1:-1", &routes, "")
    ))
    .await;
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    let in_b = user(&b, "b").await;
    let (_, created) = common::json_request(
        &in_b,
        "$JS.API.STREAM.CREATE.S",
        r#"{"name":"S","subjects":["feed.>"],"storage":"memory"}"#,
    )
    .await;
    assert!(created.get("error").is_none(), "{created}");
    let mut feed = in_b.subscribe("feed.>").await.unwrap();
    sync(&in_b).await;
    let far = user(&a, "a").await;
    until_received(&far, &mut feed, "feed.1", "probe").await;
    drain(&mut feed).await;
    // Published on b by A: the stream has it.
    let near = user(&b, "a").await;
    near.publish("feed.2", "here".into()).await.unwrap();
    near.flush().await.unwrap();
    assert_eq!(next_msg(&mut feed).await.payload, Bytes::from("here"));
    // The subscriber may get it before the stream has stored it: wait for feed.2 in the
    // stream, then count (feed.1, through the import, would make two).
    within("feed.2 stored", async {
        loop {
            let (_, m) = common::json_request(
                &in_b,
                "$JS.API.STREAM.MSG.GET.S",
                r#"{"last_by_subj":"feed.2"}"#,
            )
            .await;
            if m.get("message").is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let (_, info) = common::json_request(&in_b, "$JS.API.STREAM.INFO.S", "").await;
    assert_eq!(info["state"]["messages"], 1, "{info}");
    for n in [a, b] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_requests_reach_every_server_of_the_cluster() {
    // `server list` / `server ping` ask every server: a PING from a system user on one node
    // is answered by both, and a request naming the other server's id is answered by it.
    let sys = "accounts { SYS: { users: [{user: sys, password: sys}] } }\nsystem_account: SYS\n";
    let a = Node::start_cluster(&format!("{sys}{}", conf("t", "127.0.0.1:-1", &[], ""))).await;
    let b = Node::start_cluster(&format!(
        "{sys}{}",
        conf("t", "127.0.0.1:-1", &[a.route_url()], "")
    ))
    .await;
    a.wait_remotes(1).await;
    b.wait_remotes(1).await;
    let b_id = b.varz().await["server_id"].as_str().unwrap().to_string();
    let nc = user(&a, "sys").await;
    let inbox = nc.new_inbox();
    let mut replies = nc.subscribe(inbox.clone()).await.unwrap();
    nc.flush().await.unwrap();
    let mut ids = std::collections::BTreeSet::new();
    within("both servers answer a PING", async {
        while ids.len() < 2 {
            nc.publish_with_reply("$SYS.REQ.SERVER.PING", inbox.clone(), "".into())
                .await
                .unwrap();
            nc.flush().await.unwrap();
            while let Ok(Some(m)) =
                tokio::time::timeout(Duration::from_millis(200), replies.next()).await
            {
                let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
                // The statsz of a clustered server names its cluster and routes.
                assert_eq!(v["server"]["cluster"], "t", "{v}");
                // (The reference counts the servers it has heard from, so 1 at first.)
                let active = v["statsz"]["active_servers"].as_u64().unwrap_or(0);
                assert!((1..=2).contains(&active), "{v}");
                // (The reference pools several connections per peer: at least one.)
                let routes = v["statsz"]["routes"].as_array().map_or(0, Vec::len);
                assert!(routes >= 1, "{v}");
                ids.insert(v["server"]["id"].as_str().unwrap().to_string());
            }
        }
    })
    .await;
    assert!(ids.contains(&b_id), "{ids:?}");
    let m = within(
        "VARZ of the other server",
        nc.request(format!("$SYS.REQ.SERVER.{b_id}.VARZ"), "".into()),
    )
    .await
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(v["server"]["id"], b_id.as_str(), "{v}");
    assert_eq!(v["data"]["server_id"], b_id.as_str(), "{v}");
}
