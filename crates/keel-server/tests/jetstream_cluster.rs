//! Clusters, part 2 (issue 15): clustered JetStream. Three JetStream servers in one test
//! process (the in-process harness, through `common::Node`), or with `KEEL_TEST_REFERENCE=1`
//! reference processes, so every expectation here also holds for nats-server 2.15.
//!
//! Waiting is on what the monitoring endpoints show for both servers: `/jsz`'s
//! `meta_cluster` and `/healthz`.

mod common;

use std::time::{Duration, Instant};

use common::{http_get, Node};
use futures::FutureExt;

/// The system account (for the meta stepdown) and an application account with JetStream.
const ACCOUNTS: &str = "accounts {\n  SYS: { users: [{user: sys, password: pass}] }\n  \
     APP: { jetstream: enabled, users: [{user: app, password: pass}] }\n}\n\
     system_account: SYS\n";

async fn connect(n: &Node, user: &str) -> async_nats::Client {
    async_nats::ConnectOptions::with_user_and_password(user.into(), "pass".into())
        .connect(n.url())
        .await
        .expect("connect")
}

/// A full mesh of JetStream servers named `names`, each listing every route (itself too,
/// as generated configs do).
async fn mesh(names: &[&str]) -> Vec<Node> {
    let (nodes, _) = mesh_in(names, None).await;
    nodes
}

/// A mesh whose servers are tagged `az:<n>` for a name ending in `n` (`Q1` is in `az:1`),
/// with `extra` in each config, once the meta group has a leader.
async fn az_mesh(names: &[&str], extra: &str) -> Vec<Node> {
    let (nodes, _) = mesh_with(names, None, |n| {
        format!("server_tags: [\"az:{}\"]\n{extra}", &n[1..])
    })
    .await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    nodes
}

/// A stream `name` on subjects `<name in lower case>.>`, placed on the server tagged
/// `az:<az>` (see `az_mesh`).
async fn create_in_az(c: &async_nats::Client, name: &str, az: &str) -> serde_json::Value {
    let lower = name.to_lowercase();
    create_stream(
        c,
        name,
        &format!(
            r#"{{"name":"{name}","subjects":["{lower}.>"],"placement":{{"tags":["az:{az}"]}}}}"#
        ),
    )
    .await
}

/// One server's config: `listen` for its route port, `routes` to dial.
fn member_conf(name: &str, listen: &str, routes: &[String]) -> String {
    let routes: Vec<String> = routes.iter().map(|r| format!("\"{r}\"")).collect();
    format!(
        "server_name: {name}\n{ACCOUNTS}\njetstream {{ max_mem_store: 64MB, max_file_store: 256MB }}\n\
         cluster {{\n  name: jsc\n  listen: \"{listen}\"\n  routes: [{}]\n}}\n",
        routes.join(", ")
    )
}

/// A mesh started one server at a time, each dialing the ones before it (gossip completes
/// the mesh; only the first one's port is chosen before it binds it). With `stores`, each keeps its
/// store under `stores/<name>`; the returned configs restart a server where it was.
async fn mesh_in(names: &[&str], stores: Option<&std::path::Path>) -> (Vec<Node>, Vec<String>) {
    mesh_with(names, stores, |_| String::new()).await
}

/// `mesh_in` with `extra(name)` added to each server's config.
async fn mesh_with(
    names: &[&str],
    stores: Option<&std::path::Path>,
    extra: impl Fn(&str) -> String,
) -> (Vec<Node>, Vec<String>) {
    mesh_started(names, stores, extra, Start::InProcess).await
}

/// How `mesh_started` starts its servers (with `stores`, in this process).
enum Start {
    InProcess,
    /// Separate processes (keel's too).
    Processes,
    /// In this process, each on its own disk (as many as names).
    OnDisks(Vec<keel_store::Disk>),
    /// In this process (with `stores`), the meta group snapshotting every so many entries
    /// and keeping so many before the snapshot.
    MetaSnapshots(u64, u64),
}

/// `mesh_with`, its servers started as `start` says.
async fn mesh_started(
    names: &[&str],
    stores: Option<&std::path::Path>,
    extra: impl Fn(&str) -> String,
    start: Start,
) -> (Vec<Node>, Vec<String>) {
    let mut nodes: Vec<Node> = Vec::new();
    let mut confs = Vec::new();
    // The first lists itself: the reference wants configured routes on every server.
    let first = common::free_port();
    for name in names {
        let mut routes: Vec<String> = nodes.iter().map(|n| n.route_url()).collect();
        let listen = if nodes.is_empty() {
            routes.push(format!("nats://127.0.0.1:{first}"));
            format!("127.0.0.1:{first}")
        } else {
            "127.0.0.1:-1".to_string()
        };
        let conf = member_conf(name, &listen, &routes) + &extra(name);
        let node = match (stores, &start) {
            (Some(d), Start::MetaSnapshots(every, kept)) => {
                let (every, kept) = (*every, *kept);
                Node::start_jetstream_at_with(&conf, &d.join(name), |o| {
                    o.meta_snapshot_every = every;
                    o.meta_log_kept = kept;
                })
                .await
            }
            (Some(d), _) => Node::start_jetstream_at(&conf, &d.join(name)).await,
            (None, Start::Processes) => Node::start_jetstream_process(&conf).await,
            (None, Start::OnDisks(disks)) => {
                Node::start_jetstream_on(&conf, disks[nodes.len()].clone()).await
            }
            (None, Start::InProcess | Start::MetaSnapshots(..)) => {
                Node::start_jetstream(&conf).await
            }
        };
        let port = node.route_url().rsplit(':').next().unwrap().to_string();
        confs.push(member_conf(name, &format!("127.0.0.1:{port}"), &routes) + &extra(name));
        nodes.push(node);
    }
    for n in &nodes {
        n.wait_remotes(names.len() as u64 - 1).await;
    }
    (nodes, confs)
}

async fn jsz(n: &Node) -> serde_json::Value {
    let r = http_get(n.monitor_port(), "/jsz").await;
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).expect("jsz JSON")
}

/// Waits until every one of `nodes` names the same meta leader, other than `not`, and
/// returns it.
async fn meta_leader(nodes: &[&Node], not: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut leaders = Vec::new();
        for n in nodes {
            leaders.push(jsz(n).await["meta_cluster"]["leader"].clone());
        }
        if leaders[0].is_string() && leaders[0] != not && leaders.iter().all(|l| *l == leaders[0]) {
            return leaders[0].as_str().unwrap().to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no common meta leader: {leaders:?}\n{}",
            nodes[0].log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meta_group_elects_a_leader_and_survives_losing_it() {
    let names = ["N1", "N2", "N3"];
    let mut nodes = mesh(&names).await;
    let leader = meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    assert!(names.contains(&leader.as_str()), "{leader}");

    // The reference's meta_cluster: the leader and its peer id, the others as replicas.
    let j = jsz(&nodes[0]).await;
    let mc = &j["meta_cluster"];
    assert_eq!(mc["name"], "jsc");
    assert_eq!(mc["cluster_size"], 3);
    assert_eq!(mc["quorum_needed"], 2);
    let peer = mc["peer"].as_str().unwrap();
    assert_eq!(peer.len(), 8, "{mc}");
    let replicas = mc["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2, "{mc}");
    for r in replicas {
        assert_ne!(r["name"], "N1", "the answering server is not listed: {mc}");
        assert!(r["peer"].as_str().unwrap().len() == 8, "{mc}");
    }
    for n in &nodes {
        let h = http_get(n.monitor_port(), "/healthz").await;
        assert_eq!(h.status, 200, "{}", h.body);
    }

    // The leader goes: the other two elect one of themselves.
    let i = names.iter().position(|n| *n == leader).unwrap();
    let old = nodes.remove(i);
    old.shutdown().await;
    let next = meta_leader(&nodes.iter().collect::<Vec<_>>(), &leader).await;
    assert_ne!(next, leader);

    // With one of three left there is no quorum: health says so.
    let lost = nodes.pop().unwrap();
    lost.shutdown().await;
    let last = &nodes[0];
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let h = http_get(last.monitor_port(), "/healthz").await;
        if h.status == 503 {
            assert_eq!(
                h.body,
                r#"{"status":"unavailable","error":"JetStream has not established contact with a meta leader"}"#
            );
            break;
        }
        assert!(Instant::now() < deadline, "{} {}", h.status, h.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let h = http_get(last.monitor_port(), "/healthz?js-enabled-only=true").await;
    assert_eq!(h.status, 200, "{}", h.body);
    nodes.pop().unwrap().shutdown().await;
}

/// A stream create on a meta leader whose two peers just stopped is answered: the reference
/// refuses it at once (10005, "no suitable peers for placement, peer offline": it has their
/// shutdown events); Keel's in-process servers here stop without one (as a server that
/// went away, see `a_server_that_stopped_gracefully_is_not_counted_on` for the notice), so
/// Keel, which counts a peer up for 10 s after it last heard from it, proposes the change,
/// which cannot commit, and answers 10008 ("JetStream system temporarily unavailable") once
/// the proposal's time limit runs out, instead of keeping the request, and the meta group's
/// write gate, until it hears of a new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meta_change_without_a_quorum_is_answered() {
    let names = ["P1", "P2", "P3"];
    let mut nodes = mesh(&names).await;
    let leader = meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let i = names.iter().position(|n| *n == leader).unwrap();
    let l = nodes.remove(i);
    let c = async_nats::ConnectOptions::with_user_and_password("app".into(), "pass".into())
        .request_timeout(Some(Duration::from_secs(60)))
        .connect(l.url())
        .await
        .expect("connect");
    // The two others go together; for a few seconds the leader still counts as leading.
    let (a, b) = (nodes.pop().unwrap(), nodes.pop().unwrap());
    tokio::join!(a.shutdown(), b.shutdown());
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        c.request(
            "$JS.API.STREAM.CREATE.NQ",
            r#"{"name":"NQ","subjects":["nq"],"num_replicas":3}"#.into(),
        ),
    )
    .await;
    let m = r.expect("no answer without a quorum").expect("request");
    let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    let code = v["error"]["err_code"].as_u64();
    assert!(matches!(code, Some(10005 | 10008)), "{v}");
    l.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meta_leader_steps_down_when_the_system_account_asks() {
    let nodes = mesh(&["S1", "S2", "S3"]).await;
    let all: Vec<&Node> = nodes.iter().collect();
    let leader = meta_leader(&all, "").await;
    // From an application account: no answer at all (the reference logs a warning).
    let app = connect(&nodes[1], "app").await;
    let r = tokio::time::timeout(
        Duration::from_secs(3),
        app.request("$JS.API.META.LEADER.STEPDOWN", "".into()),
    )
    .await;
    assert!(
        !matches!(r, Ok(Ok(_))),
        "an application account was answered"
    );
    // From the system account, on any server: the leader answers and steps down.
    let sys = connect(&nodes[2], "sys").await;
    let msg = common::within(
        "stepdown reply",
        sys.request("$JS.API.META.LEADER.STEPDOWN", "".into()),
    )
    .await
    .expect("stepdown answered");
    let v: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(
        v["type"], "io.nats.jetstream.api.v1.meta_leader_stepdown_response",
        "{v}"
    );
    assert_eq!(v["success"], true, "{v}");
    let next = meta_leader(&all, &leader).await;
    assert_ne!(next, leader);
    for n in nodes {
        n.shutdown().await;
    }
}

/// A JSON API request as the application account.
async fn api(c: &async_nats::Client, subject: &str, body: &str) -> serde_json::Value {
    let m = common::within(
        subject,
        c.request(subject.to_string(), body.to_string().into()),
    )
    .await
    .unwrap_or_else(|e| panic!("{subject}: {e}"));
    serde_json::from_slice(&m.payload).expect("API JSON")
}

/// A JSON API request asked again until some server answers: right after a server restarts
/// or a leader changes, the reference (and a client's retry) may see one request go unanswered.
async fn api_answered(c: &async_nats::Client, subject: &str, body: &str) -> serde_json::Value {
    request_until(c, subject, body.to_string(), |v| Some(v.clone())).await
}

/// Requests `subject` (2 s per try, 30 s in all) until an answer's JSON gives `take` a value.
async fn request_until<T>(
    c: &async_nats::Client,
    subject: &str,
    body: String,
    take: impl Fn(&serde_json::Value) -> Option<T>,
) -> T {
    request_until_with(c, subject, async_nats::HeaderMap::new(), body, take).await
}

/// As `request_until`, with headers.
async fn request_until_with<T>(
    c: &async_nats::Client,
    subject: &str,
    headers: async_nats::HeaderMap,
    body: String,
    take: impl Fn(&serde_json::Value) -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // (No headers: a plain PUB, not an empty header block.)
        let request = if headers.is_empty() {
            c.request(subject.to_string(), body.clone().into()).boxed()
        } else {
            c.request_with_headers(subject.to_string(), headers.clone(), body.clone().into())
                .boxed()
        };
        let r = tokio::time::timeout(Duration::from_secs(2), request).await;
        if let Ok(Ok(m)) = r {
            let v: serde_json::Value = serde_json::from_slice(&m.payload).expect("API JSON");
            if let Some(t) = take(&v) {
                return t;
            }
        }
        assert!(Instant::now() < deadline, "{subject}: no answer for {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r1_stream_is_placed_on_one_server_and_served_from_every_server() {
    let nodes = mesh(&["P1", "P2", "P3"]).await;
    let all: Vec<&Node> = nodes.iter().collect();
    meta_leader(&all, "").await;
    let clients = [
        connect(&nodes[0], "app").await,
        connect(&nodes[1], "app").await,
        connect(&nodes[2], "app").await,
    ];
    let created = create_stream(
        &clients[1],
        "ORDERS",
        r#"{"name":"ORDERS","subjects":["orders.>"],"storage":"file","num_replicas":1}"#,
    )
    .await;
    assert_eq!(created["config"]["name"], "ORDERS", "{created}");
    let host = created["cluster"]["leader"].as_str().unwrap().to_string();
    assert!(["P1", "P2", "P3"].contains(&host.as_str()), "{created}");
    // The same create again is answered with the stream as it is.
    create_stream(
        &clients[2],
        "ORDERS",
        r#"{"name":"ORDERS","subjects":["orders.>"],"storage":"file","num_replicas":1}"#,
    )
    .await;
    // A stream whose subjects overlap is refused, whichever server is asked.
    let overlap = api(
        &clients[0],
        "$JS.API.STREAM.CREATE.MORE",
        r#"{"name":"MORE","subjects":["orders.new"]}"#,
    )
    .await;
    assert_eq!(overlap["error"]["err_code"], 10065, "{overlap}");
    // Publishing from every server reaches it, and each gets its PubAck.
    for (i, c) in clients.iter().enumerate() {
        let ack = common::within(
            "pub ack",
            c.request("orders.new", format!("{{\"id\":{i}}}").into()),
        )
        .await
        .expect("pub ack");
        let v: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
        assert_eq!(v["stream"], "ORDERS", "{v}");
        assert_eq!(v["seq"], i as u64 + 1, "{v}");
    }
    // Info and names from every server. The cluster object names the cluster and the
    // stream's server only (no group for one replica, as the reference), its consumers' too.
    let consumer = api(
        &clients[0],
        "$JS.API.CONSUMER.CREATE.ORDERS.C",
        r#"{"stream_name":"ORDERS","config":{"durable_name":"C","ack_policy":"explicit"}}"#,
    )
    .await;
    assert_eq!(
        consumer["cluster"],
        serde_json::json!({"name": "jsc", "leader": host.as_str()}),
        "{consumer}"
    );
    for c in &clients {
        let info = api(c, "$JS.API.STREAM.INFO.ORDERS", "").await;
        assert_eq!(info["state"]["messages"], 3, "{info}");
        assert_eq!(
            info["cluster"],
            serde_json::json!({"name": "jsc", "leader": host.as_str()}),
            "{info}"
        );
        let names = api(c, "$JS.API.STREAM.NAMES", "").await;
        assert_eq!(names["streams"], serde_json::json!(["ORDERS"]), "{names}");
        let list = api(c, "$JS.API.STREAM.LIST", "").await;
        assert_eq!(list["total"], 1, "{list}");
        assert_eq!(list["streams"][0]["config"]["name"], "ORDERS", "{list}");
        assert_eq!(list["streams"][0]["state"]["messages"], 3, "{list}");
        assert_eq!(
            list["streams"][0]["cluster"],
            serde_json::json!({"name": "jsc", "leader": host.as_str()}),
            "{list}"
        );
        let acc = api(c, "$JS.API.INFO", "").await;
        assert_eq!(acc["streams"], 1, "{acc}");
    }
    // R6 is more than the reference allows; R4 more than this cluster has.
    let r4 = api(
        &clients[0],
        "$JS.API.STREAM.CREATE.R4",
        r#"{"name":"R4","subjects":["r4"],"num_replicas":4}"#,
    )
    .await;
    assert_eq!(r4["error"]["err_code"], 10005, "{r4}");
    // Deleted from another server: gone everywhere.
    let deleted = api(&clients[2], "$JS.API.STREAM.DELETE.ORDERS", "").await;
    assert_eq!(deleted["success"], true, "{deleted}");
    for c in &clients {
        let info = api(c, "$JS.API.STREAM.INFO.ORDERS", "").await;
        assert_eq!(info["error"]["err_code"], 10059, "{info}");
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// Creates a stream (`body` its config) and returns the create response, which must not be
/// an error.
async fn create_stream(c: &async_nats::Client, name: &str, body: &str) -> serde_json::Value {
    let created = api(c, &format!("$JS.API.STREAM.CREATE.{name}"), body).await;
    assert!(created.get("error").is_none(), "{created}");
    created
}

/// Once the meta group has a leader: an R3 stream `name` on `subjects` made through the
/// first node's client, that client, the meta leader and the stream's leader.
async fn r3_stream(
    nodes: &[Node],
    name: &str,
    subjects: &str,
) -> (async_nats::Client, String, String) {
    let meta = meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let body = format!(r#"{{"name":"{name}","subjects":["{subjects}"],"num_replicas":3}}"#);
    create_stream(&c, name, &body).await;
    let leader = stream_leader(&c, name, "").await;
    (c, meta, leader)
}

/// Creates the durable `name` on `stream` with explicit acks (`extra`: more config fields,
/// each with its leading comma); it must not be refused.
async fn durable(c: &async_nats::Client, stream: &str, name: &str, extra: &str) {
    let created = api(
        c,
        &format!("$JS.API.CONSUMER.CREATE.{stream}.{name}"),
        &format!(
            r#"{{"stream_name":"{stream}","config":{{"durable_name":"{name}","ack_policy":"explicit"{extra}}}}}"#
        ),
    )
    .await;
    assert!(created.get("error").is_none(), "{created}");
}

/// Publishes `body` on `subject` until a PubAck comes (a leader change in flight may drop
/// or refuse one attempt; the acked sequence is what counts).
async fn publish_acked(c: &async_nats::Client, subject: &str, body: String) -> u64 {
    request_until(c, subject, body, |v| v["seq"].as_u64().filter(|s| *s > 0)).await
}

/// As `publish_acked`, with the body as its `Nats-Msg-Id`, so that a retry after a lost
/// ack is deduplicated.
async fn publish_acked_with_id(c: &async_nats::Client, subject: &str, body: String) -> u64 {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", body.as_str());
    request_until_with(c, subject, headers, body, |v| {
        v["seq"].as_u64().filter(|s| *s > 0)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r3_stream_keeps_every_acked_message_when_its_leader_goes() {
    let stores = common::TempDir::new("r3");
    let names = ["R1", "R2", "R3"];
    let (mut nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c0 = connect(&nodes[0], "app").await;
    let created = create_stream(
        &c0,
        "ORDERS",
        r#"{"name":"ORDERS","subjects":["orders.>"],"storage":"file","num_replicas":3}"#,
    )
    .await;
    let cl = &created["cluster"];
    assert_eq!(cl["name"], "jsc", "{created}");
    assert!(
        cl["raft_group"].as_str().unwrap().starts_with("S-R3F-"),
        "{created}"
    );
    let leader = cl["leader"].as_str().unwrap().to_string();
    assert!(names.contains(&leader.as_str()), "{created}");
    let replicas = cl["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2, "{created}");
    assert!(
        replicas.iter().all(|r| r["name"] != leader.as_str()),
        "{created}"
    );
    // A consumer of one replica is named as the reference names it: its cluster and
    // server only; one of the stream's replicas has its group.
    for (name, replicas, keys) in [
        ("ONE", 1, vec!["leader", "name"]),
        (
            "ALL",
            0,
            vec!["leader", "leader_since", "name", "raft_group", "replicas"],
        ),
    ] {
        let body = format!(
            r#"{{"stream_name":"ORDERS","config":{{"durable_name":"{name}","ack_policy":"explicit","num_replicas":{replicas}}}}}"#
        );
        let c = api(
            &c0,
            &format!("$JS.API.CONSUMER.CREATE.ORDERS.{name}"),
            &body,
        )
        .await;
        let mut got: Vec<&str> = c["cluster"]
            .as_object()
            .unwrap_or_else(|| panic!("{c}"))
            .keys()
            .map(String::as_str)
            .filter(|k| !["system_account", "traffic_account"].contains(k))
            .collect();
        got.sort();
        assert_eq!(got, keys, "{c}");
    }
    // Listed with its cluster object, from any server.
    for n in &nodes {
        let c = connect(n, "app").await;
        let list = api(&c, "$JS.API.STREAM.LIST", "").await;
        let cl = &list["streams"][0]["cluster"];
        assert_eq!(cl["raft_group"], created["cluster"]["raft_group"], "{list}");
        assert_eq!(cl["leader"], leader.as_str(), "{list}");
    }

    // Acked publishes from every server.
    let mut acked = Vec::new();
    for i in 0..30 {
        let c = connect(&nodes[i % 3], "app").await;
        let seq = publish_acked(&c, "orders.new", format!("{{\"id\":{i}}}")).await;
        acked.push((seq, i));
    }
    let seqs: Vec<u64> = acked.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (1..=30).collect::<Vec<u64>>());

    // The leader goes: the others elect one of themselves and keep every acked message.
    let li = names.iter().position(|n| *n == leader).unwrap();
    nodes.remove(li).shutdown().await;
    let survivor = connect(&nodes[0], "app").await;
    let seq = publish_acked(&survivor, "orders.new", "{\"id\":30}".to_string()).await;
    assert_eq!(seq, 31, "a sequence was lost or reused");
    let info = api_answered(&survivor, "$JS.API.STREAM.INFO.ORDERS", "").await;
    assert_eq!(info["state"]["messages"], 31, "{info}");
    assert_ne!(info["cluster"]["leader"], leader.as_str(), "{info}");
    // The two left are healthy: a meta leader and a current stream.
    for n in &nodes {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let h = http_get(n.monitor_port(), "/healthz").await;
            if h.status == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "{} {}", h.status, h.body);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for seq in [1u64, 15, 30, 31] {
        let m = api(
            &survivor,
            "$JS.API.STREAM.MSG.GET.ORDERS",
            &format!("{{\"seq\":{seq}}}"),
        )
        .await;
        assert_eq!(m["message"]["seq"], seq, "{m}");
    }

    // The old leader comes back and catches up from the log.
    let back = Node::start_jetstream_at(&confs[li], &stores.path().join(leader.as_str())).await;
    let bc = connect(&back, "app").await;
    let seq = publish_acked(&bc, "orders.new", "{\"id\":31}".to_string()).await;
    assert_eq!(seq, 32);
    // Every replica holds the same messages: take the others down one at a time and read
    // from the one left with the old leader.
    let info = api_answered(&bc, "$JS.API.STREAM.INFO.ORDERS", "").await;
    assert_eq!(info["state"]["messages"], 32, "{info}");
    back.shutdown().await;
    for n in nodes {
        n.shutdown().await;
    }
}

/// An R5 stream on five servers: a PubAck needs three of them, so it goes on with two
/// down (the leader among them), keeps every acked message, and the two catch up when they
/// come back; then, with two others down, the three left (the two that were away among them)
/// still hold and serve all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r5_stream_keeps_acking_with_two_of_five_servers_down() {
    let stores = common::TempDir::new("r5");
    let names = ["F1", "F2", "F3", "F4", "F5"];
    let (nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    let mut nodes: Vec<Option<Node>> = nodes.into_iter().map(Some).collect();
    meta_leader(&nodes.iter().flatten().collect::<Vec<_>>(), "").await;
    let c0 = connect(nodes[0].as_ref().unwrap(), "app").await;
    let created = create_stream(
        &c0,
        "FIVE",
        r#"{"name":"FIVE","subjects":["five.>"],"storage":"file","num_replicas":5}"#,
    )
    .await;
    let cl = &created["cluster"];
    assert!(
        cl["raft_group"].as_str().unwrap().starts_with("S-R5F-"),
        "{created}"
    );
    assert_eq!(cl["replicas"].as_array().unwrap().len(), 4, "{created}");
    for i in 0..20 {
        let seq = publish_acked(&c0, "five.new", format!("{{\"id\":{i}}}")).await;
        assert_eq!(seq, i + 1);
    }

    // The leader and one other go: three of five still make a quorum.
    let leader = stream_leader(&c0, "FIVE", "").await;
    let li = names.iter().position(|n| *n == leader).unwrap();
    let other = (li + 1) % 5;
    let away = [li, other];
    for i in away {
        nodes[i].take().unwrap().shutdown().await;
    }
    let up = (0..5).find(|i| nodes[*i].is_some()).unwrap();
    let c = connect(nodes[up].as_ref().unwrap(), "app").await;
    for i in 20..30 {
        let seq = publish_acked(&c, "five.new", format!("{{\"id\":{i}}}")).await;
        assert_eq!(seq, i + 1, "a sequence was lost or reused");
    }
    let info = api_answered(&c, "$JS.API.STREAM.INFO.FIVE", "").await;
    assert_eq!(info["state"]["messages"], 30, "{info}");

    // They come back and catch up.
    for i in away {
        nodes[i] = Some(Node::start_jetstream_at(&confs[i], &stores.path().join(names[i])).await);
    }
    replicas_current(&c, "FIVE", 4, "").await;

    // Two of the servers that never left go now: the three left include both that were
    // away, so they must have caught up for the stream to go on with every message.
    let stay: Vec<usize> = (0..5).filter(|i| !away.contains(i)).take(2).collect();
    for i in &stay {
        nodes[*i].take().unwrap().shutdown().await;
    }
    let c = connect(nodes[away[0]].as_ref().unwrap(), "app").await;
    let seq = publish_acked(&c, "five.new", "{\"id\":30}".to_string()).await;
    assert_eq!(seq, 31, "a sequence was lost or reused");
    for seq in 1..=31u64 {
        let m = api(
            &c,
            "$JS.API.STREAM.MSG.GET.FIVE",
            &format!("{{\"seq\":{seq}}}"),
        )
        .await;
        assert_eq!(m["message"]["seq"], seq, "{m}");
    }
    for n in nodes.into_iter().flatten() {
        n.shutdown().await;
    }
}

/// The seed's walkthrough on a 3-server cluster with an R3 stream: a worker acks 1 and 2
/// (confirmed acks), the server leading the stream and its consumer goes, and a worker on
/// another server gets only 3; the consumer's numbers are the same from every server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_on_an_r3_stream_survives_the_consumers_server() {
    use async_nats::jetstream::{
        self, consumer::pull, consumer::AckPolicy, consumer::DeliverPolicy,
    };
    use futures::StreamExt;
    let names = ["W1", "W2", "W3"];
    let mut nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let created = create_stream(&connect(&nodes[0], "app").await, "ORDERS", r#"{"name":"ORDERS","subjects":["orders.>"],"retention":"limits","max_age":86400000000000,"storage":"file","num_replicas":3}"#).await;
    let leader = created["cluster"]["leader"].as_str().unwrap().to_string();
    let li = names.iter().position(|n| *n == leader).unwrap();
    // Everything else from servers that are not the leader.
    let other = (li + 1) % 3;
    let js = jetstream::new(connect(&nodes[other], "app").await);
    let stream = js
        .get_stream("ORDERS")
        .await
        .expect("stream from a follower");
    stream
        .create_consumer(pull::Config {
            durable_name: Some("order-worker".into()),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .expect("consumer created through a follower");
    for i in 1..=3 {
        let ack = js
            .publish("orders.new", format!("{{\"id\":{i}}}").into())
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(ack.sequence, i);
    }
    {
        let consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer("order-worker").await.unwrap();
        for (i, m) in fetch(&consumer, 2).await.into_iter().enumerate() {
            assert_eq!(m.payload, format!("{{\"id\":{}}}", i + 1));
            m.double_ack().await.expect("ack confirmed");
        }
    }
    // The server leading the stream (and running its consumer) goes.
    nodes.remove(li).shutdown().await;
    let survivor = if other > li { other - 1 } else { other };
    let worker_node = (survivor + 1) % 2;
    let js2 = jetstream::new(connect(&nodes[worker_node], "app").await);
    // The new leader starts the consumer from the replicated state: only 3 is left.
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        let r = async {
            let stream = js2.get_stream("ORDERS").await.ok()?;
            let consumer: jetstream::consumer::PullConsumer =
                stream.get_consumer("order-worker").await.ok()?;
            let mut batch = consumer
                .fetch()
                .max_messages(1)
                .expires(Duration::from_secs(2))
                .messages()
                .await
                .ok()?;
            batch.next().await?.ok()
        }
        .await;
        if let Some(m) = r {
            break m;
        }
        assert!(Instant::now() < deadline, "no consumer after the failover");
    };
    assert_eq!(m.payload, "{\"id\":3}");
    assert_eq!(m.info().unwrap().stream_sequence, 3);
    m.double_ack().await.unwrap();
    for n in &nodes {
        let c = connect(n, "app").await;
        let info = api(&c, "$JS.API.CONSUMER.INFO.ORDERS.order-worker", "").await;
        assert_eq!(info["ack_floor"]["stream_seq"], 3, "{info}");
        assert_eq!(info["cluster"]["name"], "jsc", "{info}");
        assert!(info["cluster"]["leader"].is_string(), "{info}");
        assert_eq!(info["num_pending"], 0, "{info}");
        assert_eq!(info["num_ack_pending"], 0, "{info}");
    }
    let deleted = api(
        &connect(&nodes[0], "app").await,
        "$JS.API.STREAM.DELETE.ORDERS",
        "",
    )
    .await;
    assert_eq!(deleted["success"], true, "{deleted}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// Waits until STREAM.INFO names a leader other than `not`, and returns it (a request left
/// unanswered mid-election, as the reference may, is asked again).
async fn stream_leader(c: &async_nats::Client, stream: &str, not: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = api_answered(c, &format!("$JS.API.STREAM.INFO.{stream}"), "").await;
        if let Some(l) = info["cluster"]["leader"].as_str() {
            if !l.is_empty() && l != not {
                return l.to_string();
            }
        }
        assert!(Instant::now() < deadline, "leader still {not}: {info}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// STREAM.LEADER.STEPDOWN with `placement` (a JSON object), which must be accepted; then
/// the leader that follows `from`.
async fn stream_step_down(
    c: &async_nats::Client,
    stream: &str,
    placement: &str,
    from: &str,
) -> String {
    let r = api(
        c,
        &format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}"),
        &format!(r#"{{"placement":{placement}}}"#),
    )
    .await;
    assert_eq!(r["success"], true, "stepdown of {stream}: {r}");
    stream_leader(c, stream, from).await
}

/// The next `n` messages of a pull consumer, in one fetch.
async fn fetch(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
    n: usize,
) -> Vec<async_nats::jetstream::Message> {
    use futures::StreamExt;
    let mut batch = consumer.fetch().max_messages(n).messages().await.unwrap();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        out.push(
            common::within("fetch", batch.next())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    out
}

/// Polls `f` (every 50 ms, at most 30 s) until it gives a value: reads from a replica
/// catch up with a write on another server, and a leader change in flight refuses a write.
async fn eventually<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut f: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(v)) = tokio::time::timeout(Duration::from_secs(5), f()).await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A key-value bucket with three replicas, used through async-nats' `kv` from every server:
/// a put on one is read on the others, compare-and-set is decided once for the whole
/// cluster, a watcher on a third server sees every change in order; then the server leading
/// the bucket goes, and the other two keep every value, its history and its revisions, and
/// take new writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r3_key_value_bucket_works_from_every_server_and_survives_its_leader() {
    use async_nats::jetstream::{self, kv};
    use futures::{StreamExt, TryStreamExt};
    let names = ["K1", "K2", "K3"];
    let mut nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let mut js = Vec::new();
    for n in &nodes {
        js.push(jetstream::new(connect(n, "app").await));
    }
    common::within(
        "create_key_value",
        js[0].create_key_value(kv::Config {
            bucket: "CFG".into(),
            history: 5,
            num_replicas: 3,
            ..Default::default()
        }),
    )
    .await
    .expect("an R3 bucket");
    let mut kvs = Vec::new();
    for j in &js {
        kvs.push(
            common::within("get_key_value", j.get_key_value("CFG"))
                .await
                .expect("the bucket from every server"),
        );
    }
    let info = api(
        &connect(&nodes[1], "app").await,
        "$JS.API.STREAM.INFO.KV_CFG",
        "",
    )
    .await;
    assert_eq!(info["config"]["num_replicas"], 3, "{info}");
    assert_eq!(
        info["cluster"]["replicas"].as_array().map(Vec::len),
        Some(2),
        "{info}"
    );
    let mut watch = common::within("watch_all", kvs[2].watch_all())
        .await
        .expect("a watcher on the third server");

    let r1 = kvs[0].put("db.url", "pg://a".into()).await.expect("put");
    let got = eventually("the put read on another server", || async {
        kvs[1].get("db.url").await.ok().flatten()
    })
    .await;
    assert_eq!(got, "pg://a");
    // Compare-and-set: one writer wins, the stale revision is refused wherever it is sent.
    let r2 = kvs[1]
        .update("db.url", "pg://b".into(), r1)
        .await
        .expect("update at the current revision");
    assert!(r2 > r1);
    let stale = kvs[2].update("db.url", "pg://c".into(), r1).await;
    assert!(stale.is_err(), "a stale revision was taken: {stale:?}");
    assert!(
        kvs[0].create("db.url", "pg://d".into()).await.is_err(),
        "create over an existing key"
    );
    kvs[2].create("db.pool", "10".into()).await.expect("create");
    kvs[0].delete("db.pool").await.expect("delete");
    // The watcher on the third server saw each change once, in order.
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let e = common::within("watch entry", watch.next())
            .await
            .expect("watch open")
            .expect("watch entry");
        seen.push((e.key, e.operation, e.value, e.revision));
    }
    assert_eq!(
        seen.iter()
            .map(|(k, op, v, _)| (k.as_str(), *op, &v[..]))
            .collect::<Vec<_>>(),
        vec![
            ("db.url", kv::Operation::Put, &b"pg://a"[..]),
            ("db.url", kv::Operation::Put, &b"pg://b"[..]),
            ("db.pool", kv::Operation::Put, &b"10"[..]),
            ("db.pool", kv::Operation::Delete, &b""[..]),
        ]
    );
    assert!(seen.windows(2).all(|w| w[0].3 < w[1].3), "{seen:?}");

    // The server leading the bucket goes.
    let c = connect(&nodes[0], "app").await;
    let leader = stream_leader(&c, "KV_CFG", "").await;
    let li = names.iter().position(|n| *n == leader).unwrap();
    nodes.remove(li).shutdown().await;
    kvs.remove(li);
    js.remove(li);
    // Every value, history and revision is on the survivors, and they take writes.
    stream_leader(&connect(&nodes[0], "app").await, "KV_CFG", &leader).await;
    let r3 = kvs[0]
        .put("db.url", "pg://e".into())
        .await
        .expect("a put after the failover");
    assert!(r3 > r2);
    for (i, store) in kvs.iter().enumerate() {
        let hist: Vec<(Vec<u8>, u64)> = eventually("history on a survivor", || async {
            let h: Vec<kv::Entry> = store
                .history("db.url")
                .await
                .ok()?
                .try_collect()
                .await
                .ok()?;
            let h: Vec<(Vec<u8>, u64)> = h
                .into_iter()
                .map(|e| (e.value.to_vec(), e.revision))
                .collect();
            (h.len() == 3).then_some(h)
        })
        .await;
        assert_eq!(
            hist,
            vec![
                (b"pg://a".to_vec(), r1),
                (b"pg://b".to_vec(), r2),
                (b"pg://e".to_vec(), r3)
            ],
            "survivor {i}"
        );
        let pool = store
            .entry("db.pool")
            .await
            .expect("entry")
            .expect("a delete marker");
        assert_eq!(pool.operation, kv::Operation::Delete);
        let keys: Vec<String> = store
            .keys()
            .await
            .expect("keys")
            .try_collect()
            .await
            .expect("keys");
        assert_eq!(keys, vec!["db.url".to_string()], "survivor {i}");
    }
    // The revision check still holds across the new leader.
    assert!(kvs[1].update("db.url", "pg://f".into(), r2).await.is_err());
    let r4 = kvs[1]
        .update("db.url", "pg://f".into(), r3)
        .await
        .expect("update at the current revision after the failover");
    assert!(r4 > r3);
}

/// A server stopped as SIGTERM stops it first hands the Raft groups it leads (the meta
/// group, its streams') to servers that have their whole log, as the reference does: the
/// others do not wait out an election timeout. Every acked message is still there and the
/// stream takes publishes from the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopped_gracefully_hands_its_leaderships_over_first() {
    let names = ["G1", "G2", "G3"];
    let mut nodes = mesh(&names).await;
    let meta = meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let mi = names.iter().position(|n| *n == meta).unwrap();
    let c = connect(&nodes[mi], "app").await;
    // A preferred server is for stepdowns only: a config naming one is refused.
    let refused = api(
        &c,
        "$JS.API.STREAM.CREATE.HAND",
        &format!(
            r#"{{"name":"HAND","subjects":["hand.>"],"num_replicas":3,"placement":{{"preferred":"{meta}"}}}}"#
        ),
    )
    .await;
    assert_eq!(refused["error"]["err_code"], 10052, "{refused}");
    assert_eq!(
        refused["error"]["description"], "preferred server not permitted in placement",
        "{refused}"
    );
    create_stream(
        &c,
        "HAND",
        r#"{"name":"HAND","subjects":["hand.>"],"num_replicas":3}"#,
    )
    .await;
    let refused = api(
        &c,
        "$JS.API.CONSUMER.CREATE.HAND.w",
        &format!(
            r#"{{"stream_name":"HAND","config":{{"durable_name":"w","ack_policy":"explicit","placement":{{"preferred":"{meta}"}}}}}}"#
        ),
    )
    .await;
    // A consumer has no placement in 2.15 at all (strict mode: an unknown field).
    assert_eq!(refused["error"]["err_code"], 10025, "{refused}");
    // The meta leader leads the stream too (a stepdown to it), so one stop moves both.
    let mut leader = stream_leader(&c, "HAND", "").await;
    if leader != meta {
        api(
            &c,
            "$JS.API.STREAM.LEADER.STEPDOWN.HAND",
            &format!(r#"{{"placement":{{"preferred":"{meta}"}}}}"#),
        )
        .await;
        leader = eventually("HAND led by the meta leader", || async {
            let l = stream_leader(&c, "HAND", "").await;
            (l == meta).then_some(l)
        })
        .await;
    }
    assert_eq!(leader, meta);
    for i in 1..=5 {
        publish_acked(&c, "hand.x", format!("m{i}")).await;
    }
    // A worker's plain acks (no confirmation asked), taken by the leader just before it
    // stops: the next leader has them too, so nothing is delivered again.
    {
        use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
        let js = jetstream::new(c.clone());
        let stream = js.get_stream("HAND").await.expect("stream");
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some("w".into()),
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            })
            .await
            .expect("a durable");
        for (i, m) in fetch(&consumer, 5).await.into_iter().enumerate() {
            assert_eq!(m.payload, format!("m{}", i + 1));
            m.ack().await.expect("ack sent");
        }
        eventually("the leader took the acks", || async {
            let info = api(&c, "$JS.API.CONSUMER.INFO.HAND.w", "").await;
            (info["ack_floor"]["stream_seq"] == 5).then_some(())
        })
        .await;
    }
    let stopping_log = nodes.remove(mi).terminate().await;
    if !common::is_reference() {
        // Both groups were handed over before the server stopped, each to a survivor.
        for what in ["the meta group", "stream 'APP > HAND'"] {
            let line = stopping_log
                .lines()
                .find(|l| l.contains(&format!("JetStream {what}: leadership handed to ")))
                .unwrap_or_else(|| panic!("no hand-over of {what}:\n{stopping_log}"));
            let to = line.rsplit(' ').next().unwrap();
            assert!(names.contains(&to) && to != meta, "{line}");
        }
    }
    let c2 = connect(&nodes[0], "app").await;
    let next = stream_leader(&c2, "HAND", &meta).await;
    assert_ne!(next, meta);
    assert_ne!(
        meta_leader(&nodes.iter().collect::<Vec<_>>(), &meta).await,
        meta
    );
    let w = api_answered(&c2, "$JS.API.CONSUMER.INFO.HAND.w", "").await;
    assert_eq!(w["ack_floor"]["stream_seq"], 5, "{w}");
    assert_eq!(w["num_ack_pending"], 0, "{w}");
    assert_eq!(w["num_pending"], 0, "{w}");
    let seq = publish_acked(&c2, "hand.x", "m6".into()).await;
    assert_eq!(seq, 6);
    let info = api(&c2, "$JS.API.STREAM.INFO.HAND", "").await;
    assert_eq!(info["state"]["messages"], 6, "{info}");
}

/// A stream leader's server stopped with SIGTERM (a rolling restart) answers every publish
/// it took before it goes, so a client publishing one message at a time through it waits
/// for no timeout: the one caught by the hand-over gets an error and is sent again to the
/// next leader at once. Separate processes: this is about a whole server's stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_stream_leader_answers_the_publishes_it_took() {
    let names = ["P1", "P2", "P3"];
    let (mut nodes, _) = mesh_started(&names, None, |_| String::new(), Start::Processes).await;
    let (_, _, leader) = r3_stream(&nodes, "ROLL", "roll.>").await;
    let li = names.iter().position(|n| *n == leader).unwrap();
    let si = (li + 1) % names.len();
    let publisher = connect(&nodes[si], "app").await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publishing = {
        use async_nats::jetstream::context::PublishErrorKind;
        let stop = stop.clone();
        let mut js = async_nats::jetstream::new(publisher);
        // Long enough for a slow commit on a busy machine: a publish nobody answers times out
        // whatever the limit.
        js.set_timeout(Duration::from_secs(3));
        tokio::spawn(async move {
            // What the last publishes met and when (sent, answered): a failure shows them.
            let (mut acked, mut timed_out, mut recent) = (0u64, Vec::new(), Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let sent = std::time::SystemTime::now();
                let outcome = match js.publish("roll.x", "m".into()).await {
                    Ok(ack) => match ack.await {
                        Ok(a) => {
                            acked += 1;
                            format!("stored {}", a.sequence)
                        }
                        Err(e) if e.kind() == PublishErrorKind::TimedOut => {
                            timed_out.push(sent);
                            "timed out".to_string()
                        }
                        Err(e) => format!("{e}"), // An error: sent again at once.
                    },
                    Err(e) => format!("not sent: {e}"),
                };
                if recent.len() == 20 && timed_out.is_empty() {
                    recent.remove(0);
                }
                if recent.len() < 40 {
                    recent.push((sent, std::time::SystemTime::now(), outcome));
                }
            }
            (acked, timed_out, recent)
        })
    };
    let c = connect(&nodes[si], "app").await;
    let count = |c: async_nats::Client| async move {
        api_answered(&c, "$JS.API.STREAM.INFO.ROLL", "").await["state"]["messages"]
            .as_u64()
            .unwrap_or(0)
    };
    eventually("publishes before the stop", || async {
        (count(c.clone()).await > 50).then_some(())
    })
    .await;
    // The scenario, not a wait for a condition: leaders that have led for longer than
    // openraft's leader lease (2 s), whose transfers take milliseconds, as in a cluster that
    // ran a while (a newer one's take up to the lease, during which its answers got out).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let stopped_at = std::time::SystemTime::now();
    let stopping_log = nodes.remove(li).terminate().await;
    let after = count(c.clone()).await;
    eventually("publishes after the stop", || async {
        (count(c.clone()).await > after + 50).then_some(())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (acked, timed_out, recent) = publishing.await.unwrap();
    assert!(acked > 100, "{acked}");
    if !common::is_reference() {
        // (The reference leaves the one in flight unanswered now and then.)
        let since = |t: &std::time::SystemTime| {
            t.duration_since(stopped_at)
                .map(|d| d.as_secs_f64())
                .unwrap_or_else(|e| -e.duration().as_secs_f64())
        };
        assert!(
            timed_out.is_empty(),
            "publishes the stopping leader left unanswered, sent at {:?} s after the stop \
             began; the publishes around them (sent, answered, outcome): {:#?}\nits log:\n\
             {stopping_log}",
            timed_out.iter().map(since).collect::<Vec<_>>(),
            recent
                .iter()
                .map(|(s, a, o)| format!("{:.4} {:.4} {o}", since(s), since(a)))
                .collect::<Vec<_>>()
        );
    }
}

/// The same with a window of publishes in flight through another server when the stream's
/// leader is stopped (SIGTERM): each is answered, stored or refused at once, none left to
/// the client's timeout. (Those on their way over a route as the leader stopped leading
/// found its subjects unsubscribed and got no answer, before the routes were told first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_stream_leader_answers_every_publish_in_flight() {
    use futures::StreamExt;
    const WINDOW: usize = 64;
    let names = ["W1", "W2", "W3"];
    let (mut nodes, _) = mesh_started(&names, None, |_| String::new(), Start::Processes).await;
    let (_, _, leader) = r3_stream(&nodes, "WIN", "win.>").await;
    let li = names.iter().position(|n| *n == leader).unwrap();
    let si = (li + 1) % names.len();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publishing = {
        use async_nats::jetstream::context::PublishErrorKind;
        let stop = stop.clone();
        let mut js = async_nats::jetstream::new(connect(&nodes[si], "app").await);
        js.set_timeout(Duration::from_secs(3));
        tokio::spawn(async move {
            let (mut acked, mut refused, mut timed_out) = (0u64, 0u64, 0u64);
            let mut window = futures::stream::FuturesUnordered::new();
            loop {
                while window.len() < WINDOW && !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match js.publish("win.x", "m".into()).await {
                        Ok(ack) => window.push(std::future::IntoFuture::into_future(ack)),
                        Err(_) => refused += 1,
                    }
                }
                match window.next().await {
                    None => break,
                    Some(Ok(_)) => acked += 1,
                    Some(Err(e)) if e.kind() == PublishErrorKind::TimedOut => timed_out += 1,
                    Some(Err(_)) => refused += 1,
                }
            }
            (acked, refused, timed_out)
        })
    };
    let c = connect(&nodes[si], "app").await;
    let count = |c: async_nats::Client| async move {
        api_answered(&c, "$JS.API.STREAM.INFO.WIN", "").await["state"]["messages"]
            .as_u64()
            .unwrap_or(0)
    };
    eventually("publishes before the stop", || async {
        (count(c.clone()).await > 1000).then_some(())
    })
    .await;
    let stopping_log = nodes.remove(li).terminate().await;
    let after = count(c.clone()).await;
    eventually("publishes after the stop", || async {
        (count(c.clone()).await > after + 1000).then_some(())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (acked, refused, timed_out) = publishing.await.unwrap();
    assert!(acked > 2000, "{acked}");
    if !common::is_reference() {
        assert_eq!(
            timed_out, 0,
            "{timed_out} publishes left unanswered ({acked} stored, {refused} refused); \
             the stopped leader's log:\n{stopping_log}"
        );
    }
}

/// `/jsz`'s `leader-only` and `stream-leader-only`, and the `cluster` of its streams, in a
/// cluster: only the meta leader answers `leader-only` (400 elsewhere; over
/// `$SYS.REQ.SERVER.PING.JSZ` the others stay silent), a stream is listed only where it
/// leads with `stream-leader-only`, and every server names its real leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jsz_leader_only_options_follow_the_leaders() {
    use futures::StreamExt;
    let names = ["J1", "J2", "J3"];
    let nodes = mesh(&names).await;
    let (c, meta, leader) = r3_stream(&nodes, "JZ", "jz.>").await;
    durable(&c, "JZ", "dur", "").await;
    for (i, n) in nodes.iter().enumerate() {
        let r = http_get(n.monitor_port(), "/jsz?leader-only=true").await;
        if names[i] == meta {
            assert_eq!(r.status, 200, "{}", r.body);
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["meta_cluster"]["leader"], meta, "{v}");
            // The meta log since its last snapshot: the stream's create at least.
            let snap = &v["meta_cluster"]["snapshot"];
            assert!(snap["pending_entries"].as_u64() >= Some(1), "{v}");
            assert!(snap["pending_size"].as_u64() > Some(0), "{v}");
            assert!(snap["last_time"].is_string(), "{v}");
        } else {
            assert_eq!(r.status, 400, "{}: {}", names[i], r.body);
            assert!(r.body.contains("not leader"), "{}", r.body);
        }
        // (A follower learns the stream and its leader a moment after the create.)
        eventually("the stream's leader in /jsz", || async {
            let all = jsz_at(n, "/jsz?acc=APP&streams=true").await;
            let detail = &all["account_details"][0]["stream_detail"][0];
            (detail["name"] == "JZ" && detail["cluster"]["leader"] == leader.as_str()).then_some(())
        })
        .await;
        let led = jsz_at(n, "/jsz?acc=APP&streams=true&stream-leader-only=true").await;
        let listed = led["account_details"][0]["stream_detail"]
            .as_array()
            .map_or(0, |l| l.len());
        assert_eq!(
            listed,
            usize::from(names[i] == leader),
            "{}: {led}",
            names[i]
        );
        // `raft`: the stream's group and its consumer's, and what this server leads.
        // (Every replica counts the consumer, once its create reached it.)
        let raft = eventually("the consumer on every replica", || async {
            let v = jsz_at(n, "/jsz?acc=APP&consumers=true&raft=true").await;
            (v["consumers"] == 1).then_some(v)
        })
        .await;
        let d = &raft["account_details"][0]["stream_detail"][0];
        assert!(
            d["stream_raft_group"]
                .as_str()
                .is_some_and(|g| g.starts_with("S-R3F-")),
            "{raft}"
        );
        assert_eq!(d["state"]["consumer_count"], 1, "{}: {raft}", names[i]);
        // Every replica lists the consumer and its group.
        assert_eq!(d["consumer_raft_groups"][0]["name"], "dur", "{raft}");
        assert!(
            d["consumer_raft_groups"][0]["raft_group"].is_string(),
            "{raft}"
        );
        assert_eq!(d["consumer_detail"][0]["name"], "dur", "{raft}");
        assert_eq!(d["consumer_detail"][0]["stream_name"], "JZ", "{raft}");
        assert_eq!(d["consumer_detail"][0]["num_pending"], 0, "{raft}");
        assert_eq!(
            raft["streams_leader"].as_u64().unwrap_or(0),
            u64::from(names[i] == leader),
            "{}: {raft}",
            names[i]
        );
        let plain = jsz_at(n, "/jsz?acc=APP&consumers=true").await;
        let d = &plain["account_details"][0]["stream_detail"][0];
        assert!(d.get("stream_raft_group").is_none(), "{plain}");
        assert!(plain.get("streams_leader").is_none(), "{plain}");
        // `/varz` shows the meta group too.
        let varz: serde_json::Value =
            serde_json::from_str(&http_get(n.monitor_port(), "/varz").await.body).unwrap();
        assert_eq!(varz["jetstream"]["meta"]["leader"], meta, "{varz}");
        assert_eq!(varz["jetstream"]["meta"]["cluster_size"], 3, "{varz}");
    }
    // Over the system account: one answer, the meta leader's.
    let sys = connect(&nodes[1], "sys").await;
    let inbox = sys.new_inbox();
    let mut answers = sys.subscribe(inbox.clone()).await.unwrap();
    sys.publish_with_reply(
        "$SYS.REQ.SERVER.PING.JSZ",
        inbox,
        r#"{"leader_only":true}"#.into(),
    )
    .await
    .unwrap();
    let first = common::within("the meta leader's answer", answers.next())
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(v["server"]["name"], meta, "{v}");
    let more = tokio::time::timeout(Duration::from_millis(500), answers.next()).await;
    assert!(more.is_err(), "a second answer: {more:?}");
}

/// `/raftz`: by default the system account's groups (the meta group), with `acc` an
/// account's streams' groups, with `group` one of them; `{}` when the filters match none.
/// `$SYS.REQ.SERVER.PING.RAFTZ` answers the same from every server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raftz_shows_each_raft_group_of_a_server() {
    use futures::StreamExt;
    let names = ["Z1", "Z2", "Z3"];
    let nodes = mesh(&names).await;
    let (c, meta, leader) = r3_stream(&nodes, "RZ", "rz.>").await;
    publish_acked(&c, "rz.x", "1".into()).await;
    let info = api(&c, "$JS.API.STREAM.INFO.RZ", "").await;
    let group = info["cluster"]["raft_group"].as_str().unwrap().to_string();
    let meta_peer = jsz_at(&nodes[0], "/jsz").await["meta_cluster"]["peer"].clone();
    let state = |lead: bool| if lead { "LEADER" } else { "FOLLOWER" };
    for (i, n) in nodes.iter().enumerate() {
        let v = jsz_at(n, "/raftz").await;
        let g = &v["SYS"]["_meta_"];
        assert_eq!(g["state"], state(names[i] == meta), "{}: {v}", names[i]);
        assert_eq!(g["size"], 3, "{v}");
        assert_eq!(g["quorum_needed"], 2, "{v}");
        assert_eq!(g["leader"], meta_peer, "{v}");
        assert!(g["applied"].as_u64() > Some(0), "{v}");
        assert_eq!(g["peers"].as_object().map(|p| p.len()), Some(2), "{v}");
        assert_eq!(v.as_object().map(|m| m.len()), Some(1), "{v}");
        // The stream's group, once this replica has the message.
        let v = eventually("the stream's group in /raftz", || async {
            let v = jsz_at(n, "/raftz?acc=APP").await;
            v["APP"][&group]["state"].is_string().then_some(v)
        })
        .await;
        let g = &v["APP"][&group];
        assert_eq!(g["state"], state(names[i] == leader), "{}: {v}", names[i]);
        assert_eq!(g["size"], 3, "{v}");
        assert_eq!(g["peers"].as_object().map(|p| p.len()), Some(2), "{v}");
        let one = jsz_at(n, &format!("/raftz?acc=APP&group={group}")).await;
        assert_eq!(one["APP"].as_object().map(|m| m.len()), Some(1), "{one}");
        let none = jsz_at(n, "/raftz?acc=APP&group=nope").await;
        assert_eq!(none, serde_json::json!({}));
    }
    let sys = connect(&nodes[0], "sys").await;
    let inbox = sys.new_inbox();
    let mut answers = sys.subscribe(inbox.clone()).await.unwrap();
    sys.publish_with_reply("$SYS.REQ.SERVER.PING.RAFTZ", inbox, "{}".into())
        .await
        .unwrap();
    let mut servers = Vec::new();
    while servers.len() < 3 {
        let m = common::within("a RAFTZ answer", answers.next())
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(v["data"]["SYS"]["_meta_"]["size"], 3, "{v}");
        servers.push(v["server"]["name"].as_str().unwrap().to_string());
    }
    servers.sort();
    assert_eq!(servers, names);
}

async fn jsz_at(n: &Node, path: &str) -> serde_json::Value {
    let r = http_get(n.monitor_port(), path).await;
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).expect("jsz JSON")
}

/// A server in lame duck mode gives its leaderships away and is given none back: not by a
/// stepdown whose placement it fits, not when the leader it handed to goes away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_in_lame_duck_mode_is_given_no_leadership() {
    let names = ["L1", "L2", "L3"];
    let ldm = "lame_duck_duration: \"60s\"\nlame_duck_grace_period: \"30s\"\n";
    let (mut nodes, _) = mesh_with(&names, None, |_| ldm.to_string()).await;
    let (_, _, duck) = r3_stream(&nodes, "LAME", "lame.>").await;
    let di = names.iter().position(|n| *n == duck).unwrap();
    let others: Vec<usize> = (0..names.len()).filter(|i| *i != di).collect();
    nodes[di].lame_duck();
    let c = connect(&nodes[others[0]], "app").await;
    let mut leader = stream_leader(&c, "LAME", &duck).await;
    let survivors: Vec<&Node> = others.iter().map(|i| &nodes[*i]).collect();
    assert_ne!(meta_leader(&survivors, &duck).await, duck);
    // It said so (`$SYS.SERVER.<id>.LAMEDUCK`): listed offline, though it still runs.
    let info = api_answered(&c, "$JS.API.STREAM.INFO.LAME", "").await;
    let listed = info["cluster"]["replicas"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["name"] == duck.as_str()).cloned())
        .unwrap_or_else(|| panic!("{info}"));
    assert_eq!(listed["offline"], true, "{info}");
    // Not even when it is asked for by name: the stepdown goes to the other survivor.
    let placement = format!(r#"{{"preferred":"{duck}"}}"#);
    let next = stream_step_down(&c, "LAME", &placement, &leader).await;
    assert_ne!(next, duck, "the lame duck leads when named");
    leader = next;
    // Each stepdown whose placement the lame duck fits as well as the other survivor goes
    // to that survivor (a random pick among both would miss it in 4 tries 1 time in 16).
    for round in 0..4 {
        let next = stream_step_down(&c, "LAME", r#"{"cluster":"jsc"}"#, &leader).await;
        assert_ne!(next, duck, "round {round}: the lame duck leads again");
        leader = next;
        publish_acked(&c, "lame.x", format!("m{round}")).await;
    }
    if !common::is_reference() {
        // It still follows and votes (the reference stops its JetStream instead), but when
        // the leader goes, the other survivor is the only one that stands.
        let li = names.iter().position(|n| *n == leader).unwrap();
        let si = others.iter().copied().find(|i| *i != li).unwrap();
        nodes.remove(li).shutdown().await;
        let c = connect(&nodes[if si > li { si - 1 } else { si }], "app").await;
        let next = stream_leader(&c, "LAME", &leader).await;
        assert_ne!(next, duck, "the lame duck stood for election");
        let seq = publish_acked(&c, "lame.x", "after".into()).await;
        assert_eq!(seq, 5);
    }
}

/// Sources and mirrors in a cluster: the sourcing stream is placed where its origins'
/// replicas are (Keel sources through a local replica), so an R1 stream sourcing or
/// mirroring another R1 stream, and an R3 one sourcing an R3 one, get every message
/// (nats.py's `test_stream_source_opt_start_time` and `test_subject_transforms` on a
/// cluster found sourced streams empty: R1 streams are spread over the servers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sources_and_mirrors_in_a_cluster_get_every_message() {
    let nodes = mesh(&["O1", "O2", "O3"]).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[1], "app").await;
    for (origin, replicas) in [("ORG1", 1), ("ORG3", 3)] {
        let lower = origin.to_lowercase();
        create_stream(
            &c,
            origin,
            &format!(r#"{{"name":"{origin}","subjects":["{lower}.>"],"num_replicas":{replicas}}}"#),
        )
        .await;
        for n in 0..3 {
            publish_acked(&c, &format!("{lower}.x"), format!("m{n}")).await;
        }
    }
    let targets = [
        ("SRC1", r#""num_replicas":1,"sources":[{"name":"ORG1"}]"#),
        ("MIR1", r#""num_replicas":1,"mirror":{"name":"ORG1"}"#),
        ("SRC3", r#""num_replicas":3,"sources":[{"name":"ORG3"}]"#),
    ];
    for (name, rest) in targets {
        create_stream(&c, name, &format!(r#"{{"name":"{name}",{rest}}}"#)).await;
    }
    for (name, _) in targets {
        eventually(&format!("{name} has the 3 messages"), || async {
            let i = api(&c, &format!("$JS.API.STREAM.INFO.{name}"), "").await;
            (i["state"]["messages"] == 3).then_some(())
        })
        .await;
    }
    // New messages keep coming after the sourcing stream's leader changes.
    let first = stream_leader(&c, "SRC3", "").await;
    let r = api(&c, "$JS.API.STREAM.LEADER.STEPDOWN.SRC3", "").await;
    assert_eq!(r["success"], true, "{r}");
    stream_leader(&c, "SRC3", &first).await;
    publish_acked(&c, "org3.x", "after".into()).await;
    eventually("SRC3 has the 4th message", || async {
        let i = api(&c, "$JS.API.STREAM.INFO.SRC3", "").await;
        (i["state"]["messages"] == 4).then_some(())
    })
    .await;
}

/// Sources and a mirror whose origins have no replica on their server (placement tags put
/// each stream on a server of its own) read them from the origins' servers, over the
/// routes: an R1 stream sourcing two R1 streams of two other servers (one through a filter)
/// and a mirror of one of them get every message, published before and after they were
/// made, once each, the mirror at the origin's sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sources_on_other_servers_are_read_over_the_routes() {
    let names = ["Q1", "Q2", "Q3"];
    let nodes = az_mesh(&names, "").await;
    let c = connect(&nodes[0], "app").await;
    for (origin, az) in [("OA", "1"), ("OB", "2")] {
        let created = create_in_az(&c, origin, az).await;
        assert_eq!(created["cluster"]["leader"], format!("Q{az}"), "{created}");
    }
    for n in 0..3 {
        publish_acked(&c, "oa.x", format!("a{n}")).await;
        publish_acked(&c, "ob.keep.x", format!("b{n}")).await;
    }
    publish_acked(&c, "ob.drop.x", "dropped".into()).await;
    let targets = [
        (
            "AGG",
            r#""sources":[{"name":"OA"},{"name":"OB","filter_subject":"ob.keep.>"}]"#,
        ),
        ("MIR", r#""mirror":{"name":"OA"}"#),
    ];
    for (name, rest) in targets {
        let created = create_stream(
            &c,
            name,
            &format!(r#"{{"name":"{name}",{rest},"placement":{{"tags":["az:3"]}}}}"#),
        )
        .await;
        assert_eq!(created["cluster"]["leader"], "Q3", "{created}");
    }
    let holds = |name: &'static str, n: u64| {
        let c = c.clone();
        async move {
            eventually(&format!("{name} holds {n}"), || async {
                let i = api(&c, &format!("$JS.API.STREAM.INFO.{name}"), "").await;
                (i["state"]["messages"] == n).then_some(i)
            })
            .await
        }
    };
    holds("AGG", 6).await;
    holds("MIR", 3).await;
    publish_acked(&c, "oa.x", "a3".into()).await;
    publish_acked(&c, "ob.drop.y", "dropped".into()).await;
    publish_acked(&c, "ob.keep.y", "b3".into()).await;
    holds("AGG", 8).await;
    // One more: had anything come twice, the count would pass it.
    publish_acked(&c, "oa.x", "a4".into()).await;
    let agg = holds("AGG", 9).await;
    assert_eq!(agg["state"]["last_seq"], 9, "{agg}");
    for s in agg["sources"].as_array().unwrap() {
        assert!(s.get("error").is_none(), "{agg}");
    }
    let mir = holds("MIR", 5).await;
    assert_eq!(mir["state"]["last_seq"], 5, "{mir}");
    let m = api(&c, "$JS.API.STREAM.MSG.GET.MIR", r#"{"seq":4}"#).await;
    assert_eq!(m["message"]["subject"], "oa.x", "{m}");
    // An R3 stream sourcing the R1 origin, led by a server without it.
    create_stream(
        &c,
        "R3S",
        r#"{"name":"R3S","num_replicas":3,"sources":[{"name":"OA"}]}"#,
    )
    .await;
    lead_on(&c, "R3S", "Q2").await;
    holds("R3S", 5).await;
    publish_acked(&c, "oa.x", "a5".into()).await;
    let r3 = holds("R3S", 6).await;
    assert_eq!(r3["state"]["last_seq"], 6, "{r3}");
}

/// The checks a source or mirror makes against its origins see streams on other servers
/// too (each server, and the meta leader, read them from the meta group's assignments): a
/// cycle through streams placed on different servers, and a mirror whose origin elsewhere
/// takes larger messages, are refused as on one server, and nothing is assigned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_checks_see_streams_on_other_servers() {
    let names = ["V1", "V2", "V3"];
    let nodes = az_mesh(&names, "").await;
    let c = connect(&nodes[0], "app").await;
    create_stream(
        &c,
        "CA",
        r#"{"name":"CA","subjects":["ca.>"],"max_msg_size":100,"sources":[{"name":"CB"}],"placement":{"tags":["az:1"]}}"#,
    )
    .await;
    let refused = [
        (
            "CB",
            r#"{"name":"CB","subjects":["cb.>"],"sources":[{"name":"CA"}],"placement":{"tags":["az:2"]}}"#,
            10052,
            "detected cycle",
        ),
        (
            "MS",
            r#"{"name":"MS","max_msg_size":10,"mirror":{"name":"CA"},"placement":{"tags":["az:3"]}}"#,
            10030,
            "stream mirror must have max message size >= source",
        ),
    ];
    for (name, body, code, text) in refused {
        let r = api(&c, &format!("$JS.API.STREAM.CREATE.{name}"), body).await;
        assert_eq!(r["error"]["err_code"], code, "{r}");
        assert_eq!(r["error"]["description"], text, "{r}");
        let names = api(&c, "$JS.API.STREAM.NAMES", "").await;
        let listed = names["streams"].as_array().cloned().unwrap_or_default();
        assert!(!listed.iter().any(|n| n == name), "{names}");
    }
    // A cycle made by two updates, of streams on two servers.
    for (name, az) in [("PA", "1"), ("PB", "2")] {
        create_in_az(&c, name, az).await;
    }
    let update = |name: &str, origin: &str| {
        let lower = name.to_lowercase();
        format!(r#"{{"name":"{name}","subjects":["{lower}.>"],"sources":[{{"name":"{origin}"}}]}}"#)
    };
    let r = api(&c, "$JS.API.STREAM.UPDATE.PA", &update("PA", "PB")).await;
    assert!(r.get("error").is_none(), "{r}");
    let r = api(&c, "$JS.API.STREAM.UPDATE.PB", &update("PB", "PA")).await;
    assert_eq!(r["error"]["err_code"], 10052, "{r}");
    assert_eq!(r["error"]["description"], "detected cycle", "{r}");
    let info = api(&c, "$JS.API.STREAM.INFO.PB", "").await;
    assert!(info["config"].get("sources").is_none(), "{info}");
}

/// A stream update is checked against every stream of the cluster, as a create is, and
/// the meta group's assignment keeps the config the stream took: subjects that overlap a
/// stream on another server are refused (10065); an update the stream's leader refuses
/// (here its consumers' limits) leaves no trace in later checks (a source back to that
/// stream is no cycle); a stream's new `max_msg_size` is what a mirror on another server
/// is checked against.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_updates_are_checked_against_every_stream_of_the_cluster() {
    let names = ["W1", "W2", "W3"];
    let nodes = az_mesh(&names, "").await;
    let c = connect(&nodes[2], "app").await;
    for (name, az) in [("UA", "1"), ("UB", "2")] {
        create_in_az(&c, name, az).await;
    }
    let r = api(
        &c,
        "$JS.API.STREAM.UPDATE.UA",
        r#"{"name":"UA","subjects":["ua.>","ub.x"]}"#,
    )
    .await;
    assert_eq!(r["error"]["err_code"], 10065, "{r}");
    let info = api(&c, "$JS.API.STREAM.INFO.UA", "").await;
    assert_eq!(
        info["config"]["subjects"],
        serde_json::json!(["ua.>"]),
        "{info}"
    );
    durable(&c, "UA", "D", r#","max_ack_pending":100"#).await;
    let r = api(
        &c,
        "$JS.API.STREAM.UPDATE.UA",
        r#"{"name":"UA","subjects":["ua.>"],"sources":[{"name":"UB"}],"consumer_limits":{"max_ack_pending":10}}"#,
    )
    .await;
    assert_eq!(r["error"]["err_code"], 10069, "{r}");
    let r = api(
        &c,
        "$JS.API.STREAM.UPDATE.UB",
        r#"{"name":"UB","subjects":["ub.>"],"sources":[{"name":"UA"}]}"#,
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    create_stream(
        &c,
        "MC",
        r#"{"name":"MC","subjects":["mc.>"],"max_msg_size":100,"placement":{"tags":["az:1"]}}"#,
    )
    .await;
    let r = api(
        &c,
        "$JS.API.STREAM.UPDATE.MC",
        r#"{"name":"MC","subjects":["mc.>"],"max_msg_size":10}"#,
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    let mirror = create_stream(
        &c,
        "MM",
        r#"{"name":"MM","max_msg_size":50,"mirror":{"name":"MC"},"placement":{"tags":["az:3"]}}"#,
    )
    .await;
    assert_eq!(mirror["config"]["mirror"]["name"], "MC", "{mirror}");
}

/// A stream update with a new `placement` moves the stream, as the reference's does: the
/// config keeps the placement asked for, a server with the new tags joins the stream's
/// group and catches up, then the old one leaves (its leader handing the group over
/// first), with every message and the consumer's state; a placement no server has is
/// refused (10005) and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_placement_moves_the_stream() {
    let names = ["M1", "M2", "M3"];
    let nodes = az_mesh(&names, "").await;
    let c = connect(&nodes[2], "app").await;
    let body = |az: &str| {
        format!(r#"{{"name":"MV","subjects":["mv.>"],"placement":{{"tags":["az:{az}"]}}}}"#)
    };
    let created = create_stream(&c, "MV", &body("1")).await;
    assert_eq!(created["cluster"]["leader"], "M1", "{created}");
    assert_eq!(
        created["config"]["placement"]["tags"],
        serde_json::json!(["az:1"]),
        "{created}"
    );
    for i in 1..=3u64 {
        assert_eq!(publish_acked(&c, "mv.x", format!("m{i}")).await, i);
    }
    durable(&c, "MV", "D", "").await;
    let r = api(&c, "$JS.API.STREAM.UPDATE.MV", &body("2")).await;
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(
        r["config"]["placement"]["tags"],
        serde_json::json!(["az:2"]),
        "{r}"
    );
    eventually("the stream led on M2 alone", || async {
        let i = api(&c, "$JS.API.STREAM.INFO.MV", "").await;
        let alone = i["cluster"]["replicas"]
            .as_array()
            .is_none_or(|r| r.is_empty());
        (i["cluster"]["leader"] == "M2" && alone).then_some(())
    })
    .await;
    let i = api(&c, "$JS.API.STREAM.INFO.MV", "").await;
    assert_eq!(i["state"]["messages"], 3, "{i}");
    assert_eq!(
        i["config"]["placement"]["tags"],
        serde_json::json!(["az:2"]),
        "{i}"
    );
    assert_eq!(publish_acked(&c, "mv.x", "m4".into()).await, 4);
    let d = api(&c, "$JS.API.CONSUMER.INFO.MV.D", "").await;
    assert_eq!(d["num_pending"], 4, "{d}");
    // (The reference refuses another move, 10124, until it has finished with this one.)
    let r = eventually("the move finished", || async {
        let r = api(&c, "$JS.API.STREAM.UPDATE.MV", &body("9")).await;
        (r["error"]["err_code"] != 10124).then_some(r)
    })
    .await;
    assert_eq!(r["error"]["err_code"], 10005, "{r}");
    let i = api(&c, "$JS.API.STREAM.INFO.MV", "").await;
    assert_eq!(
        i["config"]["placement"]["tags"],
        serde_json::json!(["az:2"]),
        "{i}"
    );
    if !common::is_reference() {
        let old = nodes[0]
            .store_dir()
            .unwrap()
            .join("jetstream/APP/streams/MV");
        eventually("the old server's replica removed", || async {
            (!old.exists()).then_some(())
        })
        .await;
    }
}

/// A consumer update and a stream update sent right after a stream's stepdown was
/// answered are answered by the new leader: they reached the old one, which took them as
/// leader, and were refused with a 503 when its group had moved on. (The stream update is
/// keel only: nats-server leaves it unanswered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_right_after_a_stepdown_reach_the_new_leader() {
    let nodes = mesh(&["H1", "H2", "H3"]).await;
    let (c, _, _) = r3_stream(&nodes, "HO", "ho.>").await;
    let consumer = |wait: u64| {
        format!(
            r#"{{"stream_name":"HO","config":{{"durable_name":"D","ack_policy":"explicit","ack_wait":{wait}}}}}"#
        )
    };
    let r = api(
        &c,
        "$JS.API.CONSUMER.CREATE.HO.D",
        &consumer(30_000_000_000),
    )
    .await;
    assert!(r.get("error").is_none(), "{r}");
    for round in 1..=4u64 {
        // (The last round's requests are answered; the reference may still be settling.)
        stream_leader(&c, "HO", "").await;
        let r = api(&c, "$JS.API.STREAM.LEADER.STEPDOWN.HO", "").await;
        assert_eq!(r["success"], true, "{r}");
        let wait = (30 + round) * 1_000_000_000;
        let r = api(&c, "$JS.API.CONSUMER.CREATE.HO.D", &consumer(wait)).await;
        assert_eq!(r["config"]["ack_wait"], wait, "round {round}: {r}");
        // (nats-server leaves this one unanswered: the request times out.)
        if !common::is_reference() {
            let update = format!(
                r#"{{"name":"HO","subjects":["ho.>"],"num_replicas":3,"max_msgs":{round}}}"#
            );
            let r = api(&c, "$JS.API.STREAM.UPDATE.HO", &update).await;
            assert_eq!(r["config"]["max_msgs"], round, "round {round}: {r}");
        }
    }
}

/// Storage limits hold across the cluster, as the reference keeps them: an account's
/// `max_file` counts each stream's `max_bytes` on each of its servers (a stream refused
/// there is not assigned, so a create again is answered), `max_bytes_required` is checked
/// before anything is assigned, and a stream is placed only on servers whose
/// `max_file_store` has room beside what the streams there reserve (10005 `insufficient
/// storage` where none has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_limits_hold_across_the_cluster() {
    let names = ["Y1", "Y2", "Y3"];
    let nodes = az_mesh(
        &names,
        "accounts {\n  SYS: { users: [{user: sys, password: pass}] }\n  \
         APP: { jetstream: { max_file: 3MB, max_mem: 1MB }, users: [{user: app, password: pass}] }\n  \
         STRICT: { jetstream: { max_bytes_required: true }, users: [{user: strict, password: pass}] }\n}\n\
         jetstream { max_mem_store: 64MB, max_file_store: 2MB }\n",
    )
    .await;
    let c = connect(&nodes[0], "app").await;
    let strict = connect(&nodes[1], "strict").await;
    let body = |name: &str, bytes: u64, az: &str| {
        let lower = name.to_lowercase();
        format!(
            r#"{{"name":"{name}","subjects":["{lower}.>"],"max_bytes":{bytes},"placement":{{"tags":["az:{az}"]}}}}"#
        )
    };
    // No server can hold it.
    let r = api(
        &c,
        "$JS.API.STREAM.CREATE.BIG",
        &body("BIG", 2_500_000, "1"),
    )
    .await;
    assert_eq!(r["error"]["err_code"], 10005, "{r}");
    assert_eq!(
        r["error"]["description"],
        "no suitable peers for placement, insufficient storage, tags not matched ['az:1']",
        "{r}"
    );
    create_stream(&c, "S1", &body("S1", 1_500_000, "1")).await;
    // Y1 has about 0.6MB left of its 2MB. (The reference's meta leader learns a server's
    // reservations from its periodic statistics, so it may not know of S1 yet.)
    if !common::is_reference() {
        let r = api(&c, "$JS.API.STREAM.CREATE.S2", &body("S2", 1_000_000, "1")).await;
        assert_eq!(r["error"]["err_code"], 10005, "{r}");
    }
    create_stream(&c, "S2", &body("S2", 1_000_000, "2")).await;
    // The account's 3MB (3,145,728 bytes): 2.5MB reserved on two servers.
    for _ in 0..2 {
        let r = api(&c, "$JS.API.STREAM.CREATE.S3", &body("S3", 1_000_000, "3")).await;
        assert_eq!(r["error"]["err_code"], 10047, "{r}");
    }
    let names = api(&c, "$JS.API.STREAM.NAMES", "").await;
    assert_eq!(names["total"], 2, "{names}");
    create_stream(&c, "S3", &body("S3", 500_000, "3")).await;
    // An update is held to the same limit (its own reservation aside).
    let r = api(&c, "$JS.API.STREAM.UPDATE.S3", &body("S3", 700_000, "3")).await;
    assert_eq!(r["error"]["err_code"], 10047, "{r}");
    let r = api(&c, "$JS.API.STREAM.UPDATE.S2", &body("S2", 900_000, "2")).await;
    assert!(r.get("error").is_none(), "{r}");
    let r = api(
        &strict,
        "$JS.API.STREAM.CREATE.NB",
        r#"{"name":"NB","subjects":["nb.>"]}"#,
    )
    .await;
    assert_eq!(r["error"]["err_code"], 10113, "{r}");
    let r = api(&strict, "$JS.API.STREAM.NAMES", "").await;
    assert_eq!(r["total"], 0, "{r}");
}

/// A create the servers would refuse (here `mirror_direct` without a mirror) is refused
/// by the meta leader, not assigned: no stream is left that exists nowhere (info 503,
/// publishes unanswered, a create again timing out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_every_server_would_refuse_is_not_assigned() {
    let nodes = mesh(&["G1", "G2", "G3"]).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[1], "app").await;
    let r = api(
        &c,
        "$JS.API.STREAM.CREATE.GHOST",
        r#"{"name":"GHOST","subjects":["ghost.>"],"mirror_direct":true}"#,
    )
    .await;
    assert_eq!(r["error"]["err_code"], 10052, "{r}");
    let info = api(&c, "$JS.API.STREAM.INFO.GHOST", "").await;
    assert_eq!(info["error"]["err_code"], 10059, "{info}");
    let created = create_stream(&c, "GHOST", r#"{"name":"GHOST","subjects":["ghost.>"]}"#).await;
    assert_eq!(created["config"]["name"], "GHOST", "{created}");
}

/// A replicated stream made with `first_seq` starts there on every replica (nats.py's
/// `test_stream_first_seq` on a cluster got a 503: the skip was asked of a group with no
/// leader yet), for R1 and R3, and after a leader change too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clustered_stream_with_first_seq_starts_there() {
    let nodes = mesh(&["F1", "F2", "F3"]).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[1], "app").await;
    for (name, replicas) in [("FS1", 1), ("FS3", 3)] {
        let lower = name.to_lowercase();
        let created = create_stream(
            &c,
            name,
            &format!(
                r#"{{"name":"{name}","subjects":["{lower}.>"],"num_replicas":{replicas},"first_seq":1000}}"#
            ),
        )
        .await;
        assert_eq!(created["state"]["first_seq"], 1000, "{created}");
        assert_eq!(
            publish_acked(&c, &format!("{lower}.x"), "a".into()).await,
            1000
        );
    }
    let first = stream_leader(&c, "FS3", "").await;
    let r = api(&c, "$JS.API.STREAM.LEADER.STEPDOWN.FS3", "").await;
    assert_eq!(r["success"], true, "{r}");
    stream_leader(&c, "FS3", &first).await;
    assert_eq!(publish_acked(&c, "fs3.x", "b".into()).await, 1001);
    let info = api(&c, "$JS.API.STREAM.INFO.FS3", "").await;
    assert_eq!(
        (
            info["state"]["first_seq"].as_u64(),
            info["state"]["messages"].as_u64()
        ),
        (Some(1000), Some(2)),
        "{info}"
    );
}

/// A worker's `consume()` loop (async-nats' `messages()`) on another server keeps going
/// through a hand-over of its consumer: the old leader's `409 Consumer Deleted` ended it
/// with an error (async-nats stops on that status); `409 Leadership Change` makes it pull
/// again from the new leader, and the next message arrives on the same loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consume_loop_keeps_going_through_its_consumers_hand_over() {
    use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
    use futures::StreamExt;
    let names = ["K1", "K2", "K3"];
    let nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let created = create_stream(
        &c,
        "CL",
        r#"{"name":"CL","subjects":["cl.>"],"num_replicas":3}"#,
    )
    .await;
    let leader = created["cluster"]["leader"].as_str().unwrap().to_string();
    let li = names.iter().position(|n| *n == leader).unwrap();
    let js = jetstream::new(connect(&nodes[(li + 1) % 3], "app").await);
    let consumer: jetstream::consumer::PullConsumer = js
        .get_stream("CL")
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some("worker".into()),
            ack_policy: AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    js.publish("cl.x", "before".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let m = common::within("the first message", messages.next())
        .await
        .expect("the loop goes on")
        .expect("a message");
    assert_eq!(m.payload, "before");
    m.double_ack().await.unwrap();
    // Its pull now waits at the consumer's leader, which hands over.
    eventually("the pull waits", || async {
        let i = api(&c, "$JS.API.CONSUMER.INFO.CL.worker", "").await;
        (i["num_waiting"].as_u64() >= Some(1)).then_some(())
    })
    .await;
    let info = api(&c, "$JS.API.CONSUMER.INFO.CL.worker", "").await;
    let old = info["cluster"]["leader"].clone();
    let r = api(&c, "$JS.API.CONSUMER.LEADER.STEPDOWN.CL.worker", "").await;
    assert_eq!(r["success"], true, "{r}");
    // Published once the new leader leads: one taken by the old leader while it hands over
    // may be delivered by it, and an AckSync reaching it after it stopped leading gets no
    // confirmation (the client's double_ack times out; the message comes again after
    // ack_wait), as with nats-server.
    // (nats-server answers no consumer info while its consumer's group elects.)
    request_until(&c, "$JS.API.CONSUMER.INFO.CL.worker", String::new(), |i| {
        let now = &i["cluster"]["leader"];
        (now.is_string() && *now != old).then_some(())
    })
    .await;
    eventually("a publish after the hand-over", || async {
        js.publish("cl.x", "after".into()).await.ok()?.await.ok()
    })
    .await;
    let m = common::within("the message after the hand-over", messages.next())
        .await
        .expect("the loop goes on")
        .expect("no error on the loop");
    assert_eq!(m.payload, "after");
    m.double_ack().await.unwrap();
}

/// A pull waiting on a replicated consumer whose leader steps down is told `409 Leadership
/// Change` (not `Consumer Deleted`, which ends a client's consume loop), so its client
/// pulls again from the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_waiting_through_a_consumer_stepdown_is_told_to_pull_again() {
    use futures::StreamExt;
    let nodes = mesh(&["W1", "W2", "W3"]).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[1], "app").await;
    create_stream(
        &c,
        "PW",
        r#"{"name":"PW","subjects":["pw.>"],"num_replicas":3}"#,
    )
    .await;
    let mut sub = waiting_pull(&c, "PW").await;
    let r = api(&c, "$JS.API.CONSUMER.LEADER.STEPDOWN.PW.dur", "").await;
    assert_eq!(r["success"], true, "{r}");
    let m = common::within("the pull's status", sub.next())
        .await
        .unwrap();
    assert_eq!(m.status.map(|s| s.as_u16()), Some(409), "{m:?}");
    assert_eq!(m.description.as_deref(), Some("Leadership Change"), "{m:?}");
}

/// A durable `dur` on `stream` and a pull of 3 (expiring in 60 s) waiting on it: the
/// subscription its status comes to.
async fn waiting_pull(c: &async_nats::Client, stream: &str) -> async_nats::Subscriber {
    let cc = api(
        c,
        &format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.dur"),
        &format!(
            r#"{{"stream_name":"{stream}","config":{{"durable_name":"dur","ack_policy":"explicit"}}}}"#
        ),
    )
    .await;
    assert!(cc.get("error").is_none(), "{cc}");
    let inbox = c.new_inbox();
    let sub = c.subscribe(inbox.clone()).await.unwrap();
    c.publish_with_reply(
        format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.dur"),
        inbox,
        r#"{"batch":3,"expires":60000000000}"#.into(),
    )
    .await
    .unwrap();
    eventually("the pull waits", || async {
        let i = api(c, &format!("$JS.API.CONSUMER.INFO.{stream}.dur"), "").await;
        (i["num_waiting"] == 1).then_some(())
    })
    .await;
    sub
}

/// A pull from a client of another server, waiting on a consumer of a server that goes
/// into lame duck mode (an R1 stream: its consumer cannot move), is told `409 Server
/// Shutdown` before that server stops, so its client pulls again elsewhere instead of
/// waiting out its expiry. (Its own clients are closed by then: the notice goes through
/// the route.) Keel only: nats-server 2.15 stops its JetStream early in lame duck mode and
/// tells such a pull nothing (none came in 45 s), where its SIGTERM shutdown tells it
/// (`consumer_delivery::a_stopping_server_tells_waiting_pulls`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_waiting_on_a_lame_duck_is_told_it_shuts_down() {
    use futures::StreamExt;
    if common::is_reference() {
        return;
    }
    let names = ["Y1", "Y2", "Y3"];
    // (30 s is the shortest duration; its clients are closed a second apart after the grace.)
    let ldm = "lame_duck_duration: \"30s\"\nlame_duck_grace_period: \"1s\"\n";
    let (nodes, _) = mesh_with(&names, None, |_| ldm.to_string()).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let created = create_stream(
        &c,
        "LDP",
        r#"{"name":"LDP","subjects":["ldp.>"],"num_replicas":1}"#,
    )
    .await;
    let at = created["cluster"]["leader"].as_str().unwrap().to_string();
    let di = names.iter().position(|n| *n == at).unwrap();
    drop(c);
    let c = connect(&nodes[(di + 1) % names.len()], "app").await;
    let mut sub = waiting_pull(&c, "LDP").await;
    nodes[di].lame_duck();
    let m = tokio::time::timeout(Duration::from_secs(15), sub.next())
        .await
        .expect("the pull is told")
        .unwrap();
    assert_eq!(m.status.map(|s| s.as_u16()), Some(409), "{m:?}");
    assert_eq!(m.description.as_deref(), Some("Server Shutdown"), "{m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_and_consumer_leaders_step_down_on_request() {
    let nodes = mesh(&["D1", "D2", "D3"]).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[1], "app").await;
    create_stream(
        &c,
        "S3",
        r#"{"name":"S3","subjects":["s3.>"],"num_replicas":3}"#,
    )
    .await;
    let first = stream_leader(&c, "S3", "").await;
    let r = api(&c, "$JS.API.STREAM.LEADER.STEPDOWN.S3", "").await;
    assert_eq!(
        r["type"], "io.nats.jetstream.api.v1.stream_leader_stepdown_response",
        "{r}"
    );
    assert_eq!(r["success"], true, "{r}");
    let second = stream_leader(&c, "S3", &first).await;
    // Publishing goes on with the new leader.
    let ack = common::within("pub ack", c.request("s3.x", "x".into()))
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
    assert_eq!(v["seq"], 1, "{v}");
    // A consumer's stepdown.
    let cc = api(
        &c,
        "$JS.API.CONSUMER.DURABLE.CREATE.S3.dur",
        r#"{"stream_name":"S3","config":{"durable_name":"dur","ack_policy":"explicit"}}"#,
    )
    .await;
    assert!(cc.get("error").is_none(), "{cc}");
    let r = api(&c, "$JS.API.CONSUMER.LEADER.STEPDOWN.S3.dur", "").await;
    assert_eq!(
        r["type"], "io.nats.jetstream.api.v1.consumer_leader_stepdown_response",
        "{r}"
    );
    assert_eq!(r["success"], true, "{r}");
    let missing = api(&c, "$JS.API.CONSUMER.LEADER.STEPDOWN.S3.nope", "").await;
    assert_eq!(missing["error"]["err_code"], 10014, "{missing}");
    let _ = second;
    // An R1 stream has nothing to hand over: success.
    create_stream(
        &c,
        "S1",
        r#"{"name":"S1","subjects":["s1.>"],"num_replicas":1}"#,
    )
    .await;
    let r = api(&c, "$JS.API.STREAM.LEADER.STEPDOWN.S1", "").await;
    assert_eq!(r["success"], true, "{r}");
    let none = api(&c, "$JS.API.STREAM.LEADER.STEPDOWN.NOPE", "").await;
    assert_eq!(none["error"]["err_code"], 10059, "{none}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// Interest and work-queue streams with three replicas: what a consumer acked is gone from
/// every replica (not only from the leader's store), and stays gone after the stream's
/// leader steps down at once after the acks or a moment later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_messages_of_interest_and_work_queue_streams_go_on_every_replica() {
    let names = ["I1", "I2", "I3"];
    let nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let js = async_nats::jetstream::new(c.clone());
    for (name, retention) in [("IN", "interest"), ("WQ", "workqueue")] {
        let subject = format!("{}.x", name.to_lowercase());
        create_stream(
            &c,
            name,
            &format!(
                r#"{{"name":"{name}","subjects":["{subject}"],"num_replicas":3,"retention":"{retention}"}}"#
            ),
        )
        .await;
        let consumer: async_nats::jetstream::consumer::PullConsumer = js
            .create_consumer_on_stream(
                async_nats::jetstream::consumer::pull::Config {
                    durable_name: Some("W".into()),
                    ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
                name,
            )
            .await
            .unwrap();
        for i in 0..10 {
            publish_acked(&c, &subject, format!("m{i}")).await;
        }
        let msgs = fetch(&consumer, 10).await;
        // Every replica's store, as its /jsz shows it: `messages` and `first_seq`.
        let replicas_hold = |want: (u64, u64)| {
            let nodes = &nodes;
            async move {
                for (i, n) in nodes.iter().enumerate() {
                    eventually(
                        &format!("{name} on {} holds {want:?}", names[i]),
                        || async {
                            let v = jsz_at(n, "/jsz?acc=APP&streams=true").await;
                            let streams =
                                v["account_details"][0]["stream_detail"].as_array()?.clone();
                            let st = &streams.iter().find(|d| d["name"] == name)?["state"];
                            let got = (st["messages"].as_u64()?, st["first_seq"].as_u64()?);
                            (got == want).then_some(())
                        },
                    )
                    .await;
                }
            }
        };
        // Acks confirmed, then at once a stepdown: what the old leader removed, the new
        // one has removed too.
        for m in &msgs[..6] {
            m.double_ack().await.unwrap();
        }
        let first = stream_leader(&c, name, "").await;
        let second = stream_step_down(&c, name, "{}", &first).await;
        replicas_hold((4, 7)).await;
        // An ack, then the removal reaches every replica without a publish or another ack
        // to carry it.
        msgs[6].double_ack().await.unwrap();
        replicas_hold((3, 8)).await;
        stream_step_down(&c, name, "{}", &second).await;
        replicas_hold((3, 8)).await;
        let info = api(&c, &format!("$JS.API.CONSUMER.INFO.{name}.W"), "").await;
        assert_eq!(info["ack_floor"]["stream_seq"], 7, "{info}");
        assert_eq!(info["num_ack_pending"], 3, "{info}");
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// A consumer of an R3 stream paused through one server stays paused when its leader
/// changes (a consumer stepdown), and a resume is kept the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_pause_is_kept_when_its_leader_changes() {
    let nodes = mesh(&["P1", "P2", "P3"]).await;
    let (c, _, _) = r3_stream(&nodes, "PS", "ps.>").await;
    let other = connect(&nodes[2], "app").await;
    durable(&c, "PS", "W", "").await;
    let until = "2099-01-01T00:00:00Z";
    let r = api(
        &other,
        "$JS.API.CONSUMER.PAUSE.PS.W",
        &format!(r#"{{"pause_until":"{until}"}}"#),
    )
    .await;
    assert_eq!(r["paused"], true, "{r}");
    let paused = |want: bool| {
        let c = &c;
        async move {
            for _ in 0..2 {
                let info = api_answered(c, "$JS.API.CONSUMER.INFO.PS.W", "").await;
                let leader = info["cluster"]["leader"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let r = api(c, "$JS.API.CONSUMER.LEADER.STEPDOWN.PS.W", "").await;
                assert_eq!(r["success"], true, "{r}");
                let info = eventually("the consumer's new leader", || async {
                    let info = api_answered(c, "$JS.API.CONSUMER.INFO.PS.W", "").await;
                    let now = info["cluster"]["leader"].as_str()?;
                    (!now.is_empty() && now != leader).then_some(info)
                })
                .await;
                assert_eq!(info["paused"].as_bool().unwrap_or(false), want, "{info}");
                if want {
                    assert_eq!(info["config"]["pause_until"], until, "{info}");
                } else {
                    assert!(info["config"].get("pause_until").is_none(), "{info}");
                }
            }
        }
    };
    paused(true).await;
    let r = api(&other, "$JS.API.CONSUMER.PAUSE.PS.W", "").await;
    assert_eq!(r["paused"], false, "{r}");
    paused(false).await;
    for n in nodes {
        n.shutdown().await;
    }
}

/// Ephemeral consumers of an R3 stream go on through the stream's leader changes, as the
/// reference's (which stay on their server when the stream's leader moves): a pull
/// consumer keeps what it delivered just before the stepdown (not delivered again as new,
/// under the same consumer sequences), a push consumer in memory (as the clients' ordered
/// consumers of KV watchers are) keeps delivering, and one that expired for lack of
/// interest stays gone under the next leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_consumers_go_on_through_a_stream_stepdown() {
    let nodes = mesh(&["E1", "E2", "E3"]).await;
    let (c, _, first) = r3_stream(&nodes, "ES", "es.>").await;
    let other = connect(&nodes[2], "app").await;
    for i in 0..3 {
        publish_acked(&c, "es.x", format!("m{i}")).await;
    }
    let pull = api(
        &other,
        "$JS.API.CONSUMER.CREATE.ES",
        r#"{"stream_name":"ES","config":{"ack_policy":"explicit","inactive_threshold":60000000000}}"#,
    )
    .await;
    let pull_name = pull["name"]
        .as_str()
        .unwrap_or_else(|| panic!("{pull}"))
        .to_string();
    let inbox = other.new_inbox();
    let mut pushed = other.subscribe(inbox.clone()).await.unwrap();
    common::sync(&other).await;
    let push = api(
        &other,
        "$JS.API.CONSUMER.CREATE.ES",
        &format!(
            r#"{{"stream_name":"ES","config":{{"deliver_subject":"{inbox}","ack_policy":"none","mem_storage":true,"inactive_threshold":1000000000}}}}"#
        ),
    )
    .await;
    let push_name = push["name"]
        .as_str()
        .unwrap_or_else(|| panic!("{push}"))
        .to_string();
    for _ in 0..3 {
        common::next_msg(&mut pushed).await;
    }
    // Three delivered, not acked; then at once the stepdown.
    let reply = other.new_inbox();
    let mut batch = other.subscribe(reply.clone()).await.unwrap();
    other
        .publish_with_reply(
            format!("$JS.API.CONSUMER.MSG.NEXT.ES.{pull_name}"),
            reply,
            r#"{"batch":3,"expires":5000000000}"#.into(),
        )
        .await
        .unwrap();
    for _ in 0..3 {
        common::next_msg(&mut batch).await;
    }
    let second = stream_step_down(&c, "ES", "{}", &first).await;
    // (The reference's consumer keeps its own leader.)
    let info = eventually("the pull consumer after the stepdown", || async {
        let info = api_answered(&c, &format!("$JS.API.CONSUMER.INFO.ES.{pull_name}"), "").await;
        info.get("error").is_none().then_some(info)
    })
    .await;
    assert_eq!(info["delivered"]["consumer_seq"], 3, "{info}");
    assert_eq!(info["num_ack_pending"], 3, "{info}");
    // The push consumer delivers what comes next.
    publish_acked(&c, "es.x", "m3".into()).await;
    let m = common::next_msg(&mut pushed).await;
    assert_eq!(&m.payload[..], b"m3");
    // Its subscriber goes: it expires, and the next leader does not bring it back.
    drop(pushed);
    common::sync(&other).await;
    let push_info = format!("$JS.API.CONSUMER.INFO.ES.{push_name}");
    eventually("the push consumer's expiry", || async {
        let info = api_answered(&c, &push_info, "").await;
        (info["error"]["err_code"] == 10014).then_some(())
    })
    .await;
    stream_step_down(&c, "ES", "{}", &second).await;
    eventually("the pull consumer after the second stepdown", || async {
        let info = api_answered(&c, &format!("$JS.API.CONSUMER.INFO.ES.{pull_name}"), "").await;
        info.get("error").is_none().then_some(())
    })
    .await;
    let info = api_answered(&c, &push_info, "").await;
    assert_eq!(info["error"]["err_code"], 10014, "{info}");
    if !common::is_reference() {
        // Keel only: the stream's leader fails (its server stops), and the ephemeral
        // consumer goes on with the stream on a server that stays, its state with it. (The
        // reference's ephemeral is an R1 consumer: gone with its server.)
        let third = stream_leader(&c, "ES", "").await;
        if third != "E2" {
            stream_step_down(&c, "ES", r#"{"preferred":"E2"}"#, &third).await;
        }
        let mut nodes = nodes;
        nodes.remove(1).shutdown().await;
        let pull_info = format!("$JS.API.CONSUMER.INFO.ES.{pull_name}");
        let info = eventually("the pull consumer after its leader failed", || async {
            let info = api_answered(&c, &pull_info, "").await;
            let leader = info["cluster"]["leader"].as_str()?;
            (leader != "E2" && !leader.is_empty()).then_some(info)
        })
        .await;
        assert_eq!(info["delivered"]["consumer_seq"], 3, "{info}");
        assert_eq!(info["num_ack_pending"], 3, "{info}");
        for n in nodes {
            n.shutdown().await;
        }
        return;
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// A `pinned_client` consumer of an R3 stream keeps its pin through the stream's leader
/// change, as the reference's does (its consumer stays where it is): the pinned client goes
/// on being served, another request without the pin id waits (408 at its expiry). A
/// message delivered before the change and not acked is not delivered again before its
/// ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_client_keeps_its_pin_through_a_stream_stepdown() {
    let nodes = mesh(&["Q1", "Q2", "Q3"]).await;
    let (c, _, first) = r3_stream(&nodes, "PQ", "pq.>").await;
    for i in 0..4 {
        publish_acked(&c, "pq.x", format!("m{i}")).await;
    }
    durable(&c, "PQ", "PIN", r#","priority_groups":["g"],"priority_policy":"pinned_client","priority_timeout":60000000000"#).await;
    let pull = |body: String| {
        let c = c.clone();
        async move {
            let inbox = c.new_inbox();
            let mut sub = c.subscribe(inbox.clone()).await.unwrap();
            c.publish_with_reply("$JS.API.CONSUMER.MSG.NEXT.PQ.PIN", inbox, body.into())
                .await
                .unwrap();
            common::next_msg(&mut sub).await
        }
    };
    let m = pull(r#"{"batch":1,"expires":5000000000,"group":"g"}"#.into()).await;
    let pin = m
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Pin-Id"))
        .map(|v| v.to_string())
        .unwrap_or_else(|| panic!("no pin id: {m:?}"));
    // (Not acked: within its ack wait it is not delivered again, by the new leader
    // either, so what the pinned client gets next is the next message.)
    stream_step_down(&c, "PQ", "{}", &first).await;
    let info = eventually("the consumer after the stepdown", || async {
        let info = api_answered(&c, "$JS.API.CONSUMER.INFO.PQ.PIN", "").await;
        info.get("error").is_none().then_some(info)
    })
    .await;
    assert_eq!(
        info["priority_groups"][0]["pinned_client_id"],
        pin.as_str(),
        "{info}"
    );
    // Not pinned: it waits out its expiry.
    let other = pull(r#"{"batch":1,"expires":1000000000,"group":"g"}"#.into()).await;
    assert_eq!(
        other.status,
        Some(async_nats::StatusCode::TIMEOUT),
        "{other:?}"
    );
    // The pinned client is served.
    let m = pull(format!(
        r#"{{"batch":1,"expires":5000000000,"group":"g","id":"{pin}"}}"#
    ))
    .await;
    assert!(m.status.is_none(), "{m:?}");
    assert_eq!(&m.payload[..], b"m1");
    for n in nodes {
        n.shutdown().await;
    }
}

/// Pending messages come again when they were due across a consumer's leader change, as
/// from the reference's consumer (its pending messages keep their times): one delivered
/// before the change after its ack wait counted from its delivery, not from the change; one
/// nakked with a delay (`-NAK 2s`, a Go duration) after that delay, not after an ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_messages_are_due_when_they_were_across_a_consumer_leader_change() {
    use futures::StreamExt;
    let nodes = mesh(&["D1", "D2", "D3"]).await;
    let (c, _, _) = r3_stream(&nodes, "DUE", "due.>").await;
    publish_acked(&c, "due.x", "a".into()).await;
    publish_acked(&c, "due.x", "b".into()).await;
    durable(&c, "DUE", "W", r#","ack_wait":8000000000"#).await;
    let pull = |expires_s: u64| {
        let c = c.clone();
        async move {
            let inbox = c.new_inbox();
            let mut sub = c.subscribe(inbox.clone()).await.unwrap();
            let body = format!(r#"{{"batch":1,"expires":{}}}"#, expires_s * 1_000_000_000);
            c.publish_with_reply("$JS.API.CONSUMER.MSG.NEXT.DUE.W", inbox, body.into())
                .await
                .unwrap();
            let m = tokio::time::timeout(Duration::from_secs(expires_s + 5), sub.next())
                .await
                .expect("an answer to the pull")
                .unwrap();
            assert!(m.status.is_none(), "{m:?}");
            m
        }
    };
    let a = pull(5).await;
    let t0 = Instant::now();
    assert_eq!(&a.payload[..], b"a");
    // The worker is busy with it for a while (part of its ack wait goes by).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let b = pull(5).await;
    assert_eq!(&b.payload[..], b"b");
    let mut naked = c
        .subscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.DUE.W")
        .await
        .unwrap();
    c.flush().await.unwrap();
    c.publish(b.reply.clone().unwrap(), "-NAK 2s".into())
        .await
        .unwrap();
    let t1 = Instant::now();
    // The leader took the nak (it advises it), then hands over.
    common::within("the nak advisory", naked.next())
        .await
        .unwrap();
    let old =
        api_answered(&c, "$JS.API.CONSUMER.INFO.DUE.W", "").await["cluster"]["leader"].clone();
    let r = api(&c, "$JS.API.CONSUMER.LEADER.STEPDOWN.DUE.W", "").await;
    assert_eq!(r["success"], true, "{r}");
    request_until(&c, "$JS.API.CONSUMER.INFO.DUE.W", String::new(), |i| {
        let now = &i["cluster"]["leader"];
        (now.is_string() && *now != old).then_some(())
    })
    .await;
    let again = pull(10).await;
    assert_eq!(&again.payload[..], b"b");
    let after = t1.elapsed();
    assert!(
        after >= Duration::from_millis(1500) && after < Duration::from_millis(4500),
        "the nakked message came {after:?} after its 2 s nak"
    );
    let again = pull(10).await;
    assert_eq!(&again.payload[..], b"a");
    let after = t0.elapsed();
    assert!(
        after >= Duration::from_secs(7) && after < Duration::from_millis(10_500),
        "the unacked message came {after:?} after its delivery (ack wait 8 s)"
    );
    for n in nodes {
        n.shutdown().await;
    }
}

/// A stepdown's `placement`: `preferred` hands leadership to that server (meta, stream and
/// consumer leaders); the reference's errors for a server that already leads, one it does not
/// know, placement nobody fits, and a body that is not JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stepdown_hands_leadership_to_the_preferred_server() {
    let names = ["W1", "W2", "W3"];
    let nodes = mesh(&names).await;
    let all: Vec<&Node> = nodes.iter().collect();
    let leader = meta_leader(&all, "").await;
    let sys = connect(&nodes[0], "sys").await;
    let other = |not: &str| names.iter().find(|n| **n != not).unwrap().to_string();

    let already = api(
        &sys,
        "$JS.API.META.LEADER.STEPDOWN",
        &format!(r#"{{"placement":{{"preferred":"{leader}"}}}}"#),
    )
    .await;
    assert_eq!(
        already["error"],
        serde_json::json!({"code": 400, "err_code": 10005,
            "description": format!("preferred server \"{leader}\" is already leader")}),
        "{already}"
    );
    let unknown = api(
        &sys,
        "$JS.API.META.LEADER.STEPDOWN",
        r#"{"placement":{"preferred":"NOPE"}}"#,
    )
    .await;
    assert_eq!(
        unknown["error"]["description"], "preferred server \"NOPE\" not known",
        "{unknown}"
    );
    let nobody = api(
        &sys,
        "$JS.API.META.LEADER.STEPDOWN",
        r#"{"placement":{"tags":["nowhere"]}}"#,
    )
    .await;
    assert_eq!(
        nobody["error"],
        serde_json::json!({"code": 400, "err_code": 10005,
            "description": "no replacement peer connected"}),
        "{nobody}"
    );
    let bad = api(&sys, "$JS.API.META.LEADER.STEPDOWN", "{nope").await;
    assert_eq!(bad["error"]["err_code"], 10025, "{bad}");

    let want = other(&leader);
    let r = api(
        &sys,
        "$JS.API.META.LEADER.STEPDOWN",
        &format!(r#"{{"placement":{{"preferred":"{want}"}}}}"#),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    assert_eq!(meta_leader(&all, &leader).await, want);

    // A stream's leader, then a consumer's.
    let c = connect(&nodes[1], "app").await;
    create_stream(
        &c,
        "PS",
        r#"{"name":"PS","subjects":["ps.>"],"num_replicas":3}"#,
    )
    .await;
    let first = stream_leader(&c, "PS", "").await;
    publish_acked(&c, "ps.a", "1".into()).await;
    let want = other(&first);
    let r = api(
        &c,
        "$JS.API.STREAM.LEADER.STEPDOWN.PS",
        &format!(r#"{{"placement":{{"preferred":"{want}"}}}}"#),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    assert_eq!(stream_leader(&c, "PS", &first).await, want);
    assert_eq!(publish_acked(&c, "ps.a", "2".into()).await, 2);

    let cc = api(
        &c,
        "$JS.API.CONSUMER.DURABLE.CREATE.PS.dur",
        r#"{"stream_name":"PS","config":{"durable_name":"dur","ack_policy":"explicit"}}"#,
    )
    .await;
    assert!(cc.get("error").is_none(), "{cc}");
    let consumer_leader = |not: String| {
        let c = c.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                // No answer while the consumer has no leader (the reference's, mid-election).
                let r = tokio::time::timeout(
                    Duration::from_secs(2),
                    c.request("$JS.API.CONSUMER.INFO.PS.dur", "".into()),
                )
                .await;
                let i: serde_json::Value = match r {
                    Ok(Ok(m)) => serde_json::from_slice(&m.payload).unwrap(),
                    _ => serde_json::Value::Null,
                };
                if let Some(l) = i["cluster"]["leader"].as_str() {
                    if !l.is_empty() && l != not {
                        return l.to_string();
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "consumer leader still {not}: {i}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let first = consumer_leader(String::new()).await;
    let already = api(
        &c,
        "$JS.API.CONSUMER.LEADER.STEPDOWN.PS.dur",
        &format!(r#"{{"placement":{{"preferred":"{first}"}}}}"#),
    )
    .await;
    assert_eq!(already["error"]["err_code"], 10005, "{already}");
    let want = other(&first);
    let r = api(
        &c,
        "$JS.API.CONSUMER.LEADER.STEPDOWN.PS.dur",
        &format!(r#"{{"placement":{{"preferred":"{want}"}}}}"#),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    let next = consumer_leader(first).await;
    if common::is_reference() {
        // nats-server hands it to the preferred server only if its Raft node heard from
        // that one within the last three heartbeats, else to another healthy one (seen in
        // about 1 run in 12).
        assert!(names.contains(&next.as_str()), "{next}");
    } else {
        assert_eq!(next, want);
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// A stepdown to a preferred server while publishers keep the stream's log growing lands
/// on that server, round after round: the target must have the leader's whole log to win,
/// so an entry appended between the leader's check and the target's election would leave
/// it one short, refused by both others while the old leader stands aside (seen as ~12 s
/// with no leader, then another server winning). Every acked publish is in the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stepdown_to_a_preferred_server_lands_there_while_publishes_go_on() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let names = ["T1", "T2", "T3"];
    let nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    create_stream(
        &c,
        "TS",
        r#"{"name":"TS","subjects":["ts.>"],"num_replicas":3}"#,
    )
    .await;
    let mut leader = stream_leader(&c, "TS", "").await;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let mut pubs = Vec::new();
    for p in 0..4 {
        let (c, stop, acked) = (c.clone(), stop.clone(), acked.clone());
        pubs.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = tokio::time::timeout(
                    Duration::from_secs(2),
                    c.request("ts.x", format!("{p}-{i}").into()),
                )
                .await;
                if let Ok(Ok(m)) = r {
                    let v: serde_json::Value =
                        serde_json::from_slice(&m.payload).unwrap_or_default();
                    // (An error answer may carry `seq` 0.)
                    if let (None, Some(seq)) = (v.get("error"), v["seq"].as_u64()) {
                        acked.lock().unwrap().push(seq);
                    }
                }
            }
        }));
    }
    // While they publish, a replica with every batch the leader applied counts as current
    // (as the reference counts them), so at every look at least one is (a batch commits
    // only once a replica has it); against the leader's last entry, nearly always one in
    // flight under load, most looks showed none.
    for look in 0..20 {
        let info = api_answered(&c, "$JS.API.STREAM.INFO.TS", "").await;
        let reps = info["cluster"]["replicas"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            reps.iter().any(|r| r["current"] == true),
            "look {look}: no replica current while publishing: {info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for round in 0..3 {
        // Wait for the publishers to be acked by this leader before each stepdown.
        let before = acked.lock().unwrap().len();
        let deadline = Instant::now() + Duration::from_secs(30);
        while acked.lock().unwrap().len() < before + 50 {
            assert!(Instant::now() < deadline, "round {round}: no publish acked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let at = names.iter().position(|n| *n == leader).unwrap();
        let want = names[(at + 1) % names.len()];
        let placement = format!(r#"{{"preferred":"{want}"}}"#);
        let now = stream_step_down(&c, "TS", &placement, &leader).await;
        assert_eq!(
            now, want,
            "round {round}: leadership went from {leader} to {now}"
        );
        leader = now;
    }
    stop.store(true, Ordering::Relaxed);
    for p in pubs {
        p.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let info = api(&c, "$JS.API.STREAM.INFO.TS", "").await;
    let last = info["state"]["last_seq"].as_u64().unwrap();
    let mut seen = std::collections::HashSet::new();
    for s in &acked {
        assert!(seen.insert(*s), "sequence {s} acked twice");
        assert!(
            *s <= last,
            "acked {s} past the stream's last {last}: {info}"
        );
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// `$JS.API.SERVER.REMOVE` from the system account: a server that is gone for good leaves
/// the meta group, and the replica it held of an R3 stream moves to the server that had
/// none, which catches up; the reference's errors for an empty request and a non-member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_server_leaves_the_meta_group_and_its_replicas_move() {
    let names = ["V1", "V2", "V3", "V4"];
    let mut nodes = mesh(&names).await;
    let all: Vec<&Node> = nodes.iter().collect();
    let leader = meta_leader(&all, "").await;
    let keep = names.iter().position(|n| *n == leader).unwrap();
    let c = connect(&nodes[keep], "app").await;
    let sys = connect(&nodes[keep], "sys").await;
    let created = create_stream(
        &c,
        "RS",
        r#"{"name":"RS","subjects":["rs.>"],"num_replicas":3}"#,
    )
    .await;
    let peers = |info: &serde_json::Value| -> Vec<String> {
        let cl = &info["cluster"];
        let mut p: Vec<String> = cl["replicas"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|x| x["name"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(l) = cl["leader"].as_str() {
            p.push(l.to_string());
        }
        p.sort();
        p
    };
    stream_leader(&c, "RS", "").await;
    for i in 0..5 {
        publish_acked(&c, "rs.x", format!("{i}")).await;
    }
    let before = api(&c, "$JS.API.STREAM.INFO.RS", "").await;
    let held = peers(&before);
    assert_eq!(held.len(), 3, "{created}\n{before}");
    let victim = held.iter().find(|p| **p != leader).unwrap().clone();
    let spare = names
        .iter()
        .find(|n| !held.contains(&n.to_string()))
        .unwrap()
        .to_string();

    let empty = api(&sys, "$JS.API.SERVER.REMOVE", "").await;
    assert_eq!(
        empty["error"],
        serde_json::json!({"code": 400, "err_code": 10003, "description": "bad request"}),
        "{empty}"
    );
    let stranger = api(&sys, "$JS.API.SERVER.REMOVE", r#"{"peer":"NOPE"}"#).await;
    assert_eq!(
        stranger["error"],
        serde_json::json!({"code": 400, "err_code": 10044,
            "description": "server is not a member of the cluster"}),
        "{stranger}"
    );

    let i = names.iter().position(|n| *n == victim).unwrap();
    nodes.remove(i).shutdown().await;
    let r = api(
        &sys,
        "$JS.API.SERVER.REMOVE",
        &format!(r#"{{"peer":"{victim}"}}"#),
    )
    .await;
    assert_eq!(
        r["type"], "io.nats.jetstream.api.v1.meta_server_remove_response",
        "{r}"
    );
    assert_eq!(r["success"], true, "{r}");

    // The meta group is the three left; the stream's replicas are on them, all current.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mc = jsz(&nodes[0]).await["meta_cluster"].clone();
        let info = api(&c, "$JS.API.STREAM.INFO.RS", "").await;
        let now = peers(&info);
        let caught_up = info["cluster"]["replicas"]
            .as_array()
            .is_some_and(|r| r.iter().all(|x| x["current"] == true));
        if mc["cluster_size"] == 3
            && now.len() == 3
            && !now.contains(&victim)
            && now.contains(&spare)
            && caught_up
        {
            assert_eq!(info["state"]["messages"], 5, "{info}");
            break;
        }
        assert!(Instant::now() < deadline, "{mc}\n{info}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(publish_acked(&c, "rs.x", "5".into()).await, 6);
    let again = api(
        &sys,
        "$JS.API.SERVER.REMOVE",
        &format!(r#"{{"peer":"{victim}"}}"#),
    )
    .await;
    assert_eq!(again["error"]["err_code"], 10044, "{again}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// `$JS.API.SERVER.REMOVE` of a server that is still running: it turns JetStream off, as
/// the reference does (an advisory says so, `/healthz` and a new client's INFO report
/// JetStream off), its replica moves, and its clients' API requests are answered by the
/// rest of the cluster with the cluster's numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_server_that_is_removed_turns_jetstream_off() {
    use futures::StreamExt;
    let names = ["X1", "X2", "X3", "X4"];
    let nodes = mesh(&names).await;
    let all: Vec<&Node> = nodes.iter().collect();
    let leader = meta_leader(&all, "").await;
    let keep = names.iter().position(|n| *n == leader).unwrap();
    let c = connect(&nodes[keep], "app").await;
    let sys = connect(&nodes[keep], "sys").await;
    create_stream(
        &c,
        "RX",
        r#"{"name":"RX","subjects":["rx.>"],"num_replicas":3}"#,
    )
    .await;
    let sl = stream_leader(&c, "RX", "").await;
    for i in 0..5 {
        publish_acked(&c, "rx.x", format!("{i}")).await;
    }
    let info = api(&c, "$JS.API.STREAM.INFO.RX", "").await;
    let replicas: Vec<String> = info["cluster"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect();
    // A replica that neither leads the stream nor the meta group.
    let victim = replicas
        .iter()
        .find(|r| **r != leader && **r != sl)
        .expect("a plain replica")
        .clone();
    let vi = names.iter().position(|n| *n == victim).unwrap();
    let vsys = connect(&nodes[vi], "sys").await;
    let mut adv = vsys
        .subscribe("$JS.EVENT.ADVISORY.SERVER.REMOVED")
        .await
        .unwrap();
    vsys.flush().await.unwrap();

    let r = api(
        &sys,
        "$JS.API.SERVER.REMOVE",
        &format!(r#"{{"peer":"{victim}"}}"#),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    let m = tokio::time::timeout(Duration::from_secs(30), adv.next())
        .await
        .expect("server_removed advisory")
        .unwrap();
    let a: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(
        a["type"], "io.nats.jetstream.advisory.v1.server_removed",
        "{a}"
    );
    assert_eq!(a["server"], victim.as_str(), "{a}");
    assert_eq!(a["cluster"], "jsc", "{a}");

    // Its health and a new client's INFO say JetStream is off.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = http_get(nodes[vi].monitor_port(), "/healthz").await;
        if h.status == 503 {
            let v: serde_json::Value = serde_json::from_str(&h.body).unwrap();
            assert_eq!(v["error"], "JetStream not enabled (10076)", "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "{} {}", h.status, h.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // (The reference's INFO may say so a little after its health does.)
    let late = loop {
        let late = connect(&nodes[vi], "app").await;
        if !late.server_info().jetstream {
            break late;
        }
        assert!(Instant::now() < deadline, "{:?}", late.server_info());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Its clients still get the cluster's answers, without it among the stream's peers.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = api_answered(&late, "$JS.API.STREAM.INFO.RX", "").await;
        let cl = &info["cluster"];
        let listed = cl["leader"] == victim.as_str()
            || cl["replicas"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x["name"] == victim.as_str()));
        if info["state"]["messages"] == 5 && !listed && cl["replicas"].as_array().is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "{info}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let seq = publish_acked(&late, "rx.x", "5".into()).await;
    assert_eq!(seq, 6);
    // A worker on it pulls from a durable that lives on the others, and acks.
    let js = async_nats::jetstream::new(late.clone());
    let stream = js
        .get_stream("RX")
        .await
        .expect("stream through the cluster");
    // (The reference may answer 10023 insufficient resources while its replicas move.)
    let deadline = Instant::now() + Duration::from_secs(30);
    let consumer: async_nats::jetstream::consumer::PullConsumer = loop {
        let r = stream
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("w".into()),
                ..Default::default()
            })
            .await;
        match r {
            Ok(c) => break c,
            Err(e) => assert!(
                Instant::now() < deadline,
                "durable through the cluster: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < 6 {
        let mut batch = consumer
            .fetch()
            .max_messages(6 - got.len())
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(m)) = batch.next().await {
            m.double_ack().await.expect("confirmed ack");
            got.push(m.info().unwrap().stream_sequence);
        }
        assert!(Instant::now() < deadline, "{got:?}");
    }
    assert_eq!(got, (1..=6).collect::<Vec<u64>>());
    for n in nodes {
        n.shutdown().await;
    }
}

/// Jepsen's finding against the reference (a single-bit error on a minority node lost
/// acknowledged writes), for the meta group: while one server is down, stream creates are
/// acknowledged by the other two; then one of those has a bit of those entries flipped on
/// disk and every server goes down. The damaged server and the one that never had the
/// entries come back first: the damaged one must neither vote nor stand for election (it
/// could help elect a leader without the entries, whose log would then overwrite them).
/// Once the third is back it leads, the damaged one is brought back, and every stream is
/// there. (Keel's own log format: not run against the reference.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_log_lost_acked_entries_does_not_vote_until_it_has_them_again() {
    if common::is_reference() {
        return;
    }
    let stores = common::TempDir::new("bitflip");
    let names = ["F1", "F2", "F3"];
    // Tags, so the streams below go to the leader (a server just shut down still counts as
    // up for placement for a while).
    let (mut nodes, confs) = mesh_with(&names, Some(stores.path()), |n| {
        format!("server_tags: [\"n:{}\"]\n", n.to_lowercase())
    })
    .await;
    let leader = meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let li = names.iter().position(|n| *n == leader).unwrap();
    let bi = (li + 1) % 3;
    let ci = (li + 2) % 3;
    let c = connect(&nodes[li], "app").await;
    create_stream(&c, "BASE", r#"{"name":"BASE","subjects":["base"]}"#).await;
    // C goes: the creates below are on the leader and B only.
    let mut slots: Vec<Option<Node>> = nodes.drain(..).map(Some).collect();
    slots[ci].take().unwrap().shutdown().await;
    let created: Vec<String> = (0..6).map(|i| format!("ONLY{i}")).collect();
    for n in &created {
        create_stream(
            &c,
            n,
            &format!(
                r#"{{"name":"{n}","subjects":["{}"],"placement":{{"tags":["n:{}"]}}}}"#,
                n.to_lowercase(),
                leader.to_lowercase()
            ),
        )
        .await;
    }
    drop(c);
    slots[bi].take().unwrap().shutdown().await;
    slots[li].take().unwrap().shutdown().await;
    // A flipped bit in one of B's newest meta entries (a stream create).
    let seg = files_like(&stores.path().join(names[bi]), "meta", "rlog")
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .expect("B's meta log");
    let mut data = std::fs::read(&seg).unwrap();
    let records: Vec<usize> = (0..data.len().saturating_sub(24))
        .filter(|&o| &data[o..o + 4] == b"KRFT" && data[o + 12] == 1)
        .collect();
    assert!(records.len() > 6, "{records:?}");
    let o = records[records.len() - 3];
    let len = u32::from_le_bytes(data[o + 4..o + 8].try_into().unwrap()) as usize;
    data[o + 24 + len / 2] ^= 0x10;
    std::fs::write(&seg, &data).unwrap();

    let b = Node::start_jetstream_at(&confs[bi], &stores.path().join(names[bi])).await;
    let cn = Node::start_jetstream_at(&confs[ci], &stores.path().join(names[ci])).await;
    // Longer than two election timeouts: with B's vote C could have won by now.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        for n in [&b, &cn] {
            let mc = jsz(n).await["meta_cluster"].clone();
            // (A restarted server names the leader its saved vote names until it hears more.)
            assert!(
                mc["leader"] != names[bi] && mc["leader"] != names[ci],
                "a meta leader without the acked creates: {mc}\n{}",
                b.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        b.log().contains("neither votes nor stands for election"),
        "{}",
        b.log()
    );
    let l = Node::start_jetstream_at(&confs[li], &stores.path().join(names[li])).await;
    let all = [&l, &b, &cn];
    meta_leader(&all, "").await;
    let c = connect(&cn, "app").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = api(&c, "$JS.API.STREAM.NAMES", "").await;
        let got: Vec<String> = r["streams"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x.as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default();
        if created.iter().all(|n| got.contains(n)) && b.log().contains("it votes again") {
            break;
        }
        assert!(Instant::now() < deadline, "{r}\n{}", b.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for n in [l, b, cn] {
        n.shutdown().await;
    }
}

/// `$JS.API.INFO` in a cluster reports the cluster's usage, from any server: every
/// replica's bytes (an R3 stream counts three times), the consumers of every stream, and
/// every stream, as the reference does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn account_info_sums_the_usage_of_every_server() {
    let nodes = mesh(&["U1", "U2", "U3"]).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    create_stream(
        &c,
        "U3R",
        r#"{"name":"U3R","subjects":["u3.>"],"num_replicas":3}"#,
    )
    .await;
    create_stream(
        &c,
        "U1R",
        r#"{"name":"U1R","subjects":["u1.>"],"num_replicas":1}"#,
    )
    .await;
    stream_leader(&c, "U3R", "").await;
    stream_leader(&c, "U1R", "").await;
    for i in 0..10 {
        publish_acked(&c, "u3.x", format!("message {i}")).await;
        publish_acked(&c, "u1.x", format!("message {i}")).await;
    }
    for (stream, durable) in [("U3R", "a"), ("U3R", "b"), ("U1R", "c")] {
        let cc = api(
            &c,
            &format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}"),
            &format!(
                r#"{{"stream_name":"{stream}","config":{{"durable_name":"{durable}","ack_policy":"explicit"}}}}"#
            ),
        )
        .await;
        assert!(cc.get("error").is_none(), "{cc}");
    }
    let b3 = api(&c, "$JS.API.STREAM.INFO.U3R", "").await["state"]["bytes"]
        .as_u64()
        .unwrap();
    let b1 = api(&c, "$JS.API.STREAM.INFO.U1R", "").await["state"]["bytes"]
        .as_u64()
        .unwrap();
    assert!(b3 > 0 && b1 > 0);
    // Asked on every server (usage reaches the meta leader within a moment).
    for n in &nodes {
        let c = connect(n, "app").await;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let i = api(&c, "$JS.API.INFO", "").await;
            assert_eq!(
                i["type"], "io.nats.jetstream.api.v1.account_info_response",
                "{i}"
            );
            if i["storage"] == 3 * b3 + b1 && i["streams"] == 2 && i["consumers"] == 3 {
                assert_eq!(i["memory"], 0, "{i}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{i}\nwant storage {} (3 x {b3} + {b1})",
                3 * b3 + b1
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// Files under `dir` whose path contains `part` and ends in `ext`.
fn files_like(dir: &std::path::Path, part: &str, ext: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == ext) && p.to_string_lossy().contains(part)
            {
                out.push(p);
            }
        }
    }
    out
}

/// A flipped bit in one message of a follower's store: the follower finds it (a scrub of its
/// store once it has a leader), drops its replica and gets a fresh copy from the leader; made
/// leader afterwards it serves every message intact. (Keel's file format: not run against
/// the reference.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_a_damaged_message_is_rebuilt_from_the_leader() {
    if common::is_reference() {
        return;
    }
    let stores = common::TempDir::new("dmg");
    let names = ["G1", "G2", "G3"];
    let (mut nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let leader_client = connect(&nodes[0], "app").await;
    create_stream(
        &leader_client,
        "DMG",
        r#"{"name":"DMG","subjects":["dmg.>"],"num_replicas":3}"#,
    )
    .await;
    let leader = stream_leader(&leader_client, "DMG", "").await;
    let payload = |i: u64| format!("payload-{i:03}-{}", "x".repeat(200));
    for i in 1..=30 {
        assert_eq!(publish_acked(&leader_client, "dmg.x", payload(i)).await, i);
    }
    // A follower that is not the server the client uses.
    let bi = names
        .iter()
        .position(|n| *n != leader && *n != "G1")
        .unwrap();
    let victim = names[bi];
    // Its store syncs every 200 ms as it applies: a few more rounds so that message 17 is
    // in what the store made durable (damage there is damage, not a torn tail).
    for round in 0..3u64 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        for i in 0..5 {
            let seq = 31 + round * 5 + i;
            assert_eq!(
                publish_acked(&leader_client, "dmg.x", payload(seq)).await,
                seq
            );
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    nodes.remove(bi).shutdown().await;
    let segs = files_like(&stores.path().join(victim), "DMG", "seg");
    let needle = payload(17);
    let mut flipped = false;
    for seg in segs {
        let mut data = std::fs::read(&seg).unwrap();
        if let Some(at) = data
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
        {
            data[at + 40] ^= 0x04;
            std::fs::write(&seg, &data).unwrap();
            flipped = true;
        }
    }
    assert!(flipped, "message 17 not found in {victim}'s store");
    let back = Node::start_jetstream_at(&confs[bi], &stores.path().join(victim)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(back.log().contains("it is rebuilt from the leader")
        && back.log().contains("it votes again"))
    {
        assert!(Instant::now() < deadline, "{}", back.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // What its store set aside is kept for the operator.
    let kept = files_like(
        &stores.path().join(victim).join("jetstream/APP/damaged"),
        "DMG",
        "bin",
    );
    assert!(!kept.is_empty(), "no damaged-* file kept");
    // Made the leader, it serves every message as published.
    lead_on(&leader_client, "DMG", victim).await;
    let info = api(&leader_client, "$JS.API.STREAM.INFO.DMG", "").await;
    assert_eq!(info["cluster"]["leader"], victim, "{info}");
    assert_eq!(info["state"]["messages"], 45, "{info}");
    let acked = (1..=45u64).map(|i| (i, payload(i))).collect();
    holds_exactly(&leader_client, "DMG", &acked).await;
    back.shutdown().await;
    for n in nodes {
        n.shutdown().await;
    }
}

/// A replica whose store lacks a message the others hold, recorded there as removed (the
/// hole a store rolled back under its state machine used to leave): the digests the leader
/// puts in its batches find it. Made leader, the others find it short of a message: one
/// stands for election, and the short replica, a follower then, is rebuilt from the new
/// leader. Made leader again, it serves every acked message. (Keel's file format and
/// digests: not run against the reference.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_lacking_a_message_is_found_by_the_digests_and_rebuilt() {
    if common::is_reference() {
        return;
    }
    let stores = common::TempDir::new("hole");
    let names = ["H1", "H2", "H3"];
    let (mut nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    create_stream(
        &c,
        "HOLE",
        r#"{"name":"HOLE","subjects":["hole.>"],"num_replicas":3}"#,
    )
    .await;
    let payload = |i: u64| format!("payload-{i:04}");
    let mut acked = std::collections::BTreeMap::new();
    for i in 1..=30 {
        assert_eq!(publish_acked(&c, "hole.x", payload(i)).await, i);
        acked.insert(i, payload(i));
    }
    // (Its store syncs every 200 ms as it applies; the shutdown syncs the rest.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let victim = "H2";
    let bi = 1;
    nodes.remove(bi).shutdown().await;
    {
        let dir = stores
            .path()
            .join(victim)
            .join("jetstream/APP/streams/HOLE/msgs");
        let (mut st, _) = keel_store::FileStore::open(&dir, Default::default()).unwrap();
        use keel_store::Store;
        assert!(
            st.remove(17, false).unwrap(),
            "no message 17 in {victim}'s store"
        );
        st.close().unwrap();
    }
    nodes.insert(
        bi,
        Node::start_jetstream_at(&confs[bi], &stores.path().join(victim)).await,
    );
    lead_on(&c, "HOLE", victim).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seq = 30;
    loop {
        let stood = nodes.iter().any(|n| {
            n.log()
                .contains("its leader lacks messages this replica holds")
        });
        let log = nodes[bi].log();
        if stood
            && log.contains("this replica lacks messages its leader holds")
            && log.contains("it votes again")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}\n{}\n{}",
            nodes[0].log(),
            nodes[1].log(),
            nodes[2].log()
        );
        seq += 1;
        // With a message id: a publish retried after its ack was lost to the election
        // these checks set off is answered as the duplicate it is, not stored twice.
        assert_eq!(publish_acked_with_id(&c, "hole.x", payload(seq)).await, seq);
        acked.insert(seq, payload(seq));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lead_on(&c, "HOLE", victim).await;
    holds_exactly(&c, "HOLE", &acked).await;
    for n in nodes {
        n.shutdown().await;
    }
}

/// The meta group's log is compacted: every server writes the group's snapshot beside
/// its log and drops the log before it. A server down while streams were deleted and the
/// others' logs moved past what it has installs the leader's snapshot: the streams deleted
/// meanwhile go from it, the others stay with their messages. After a restart of every
/// server (each from its own snapshot) the streams are all there, messages included.
/// (Keel's meta files: not run against the reference.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_meta_log_is_compacted_and_a_server_behind_it_installs_the_snapshot() {
    if common::is_reference() {
        return;
    }
    let stores = common::TempDir::new("metasnap");
    let names = ["P1", "P2", "P3"];
    let start = || Start::MetaSnapshots(8, 2);
    let (mut nodes, confs) =
        mesh_started(&names, Some(stores.path()), |_| String::new(), start()).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let r3 = |i: u32| format!(r#"{{"name":"S{i}","subjects":["s{i}.>"],"num_replicas":3}}"#);
    for i in 0..10 {
        create_stream(&c, &format!("S{i}"), &r3(i)).await;
    }
    // A memory stream is made again at a restart only from the meta state.
    create_stream(
        &c,
        "M",
        r#"{"name":"M","subjects":["m.>"],"num_replicas":3,"storage":"memory"}"#,
    )
    .await;
    assert_eq!(publish_acked(&c, "s7.x", "kept".into()).await, 1);
    for i in 0..5 {
        let r = api(&c, &format!("$JS.API.STREAM.DELETE.S{i}"), "").await;
        assert_eq!(r["success"], true, "{r}");
    }
    let snapshot = |n: &str| {
        stores
            .path()
            .join(n)
            .join("jetstream/_cluster_/meta/snapshot.json")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !names.iter().all(|n| snapshot(n).exists()) {
        assert!(
            Instant::now() < deadline,
            "no meta snapshot written on every server"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // P3 goes down; two of its streams are deleted and R1 streams come and go, until the
    // others' logs start past what P3 has.
    nodes.remove(2).shutdown().await;
    for i in 5..7 {
        let r = api(&c, &format!("$JS.API.STREAM.DELETE.S{i}"), "").await;
        assert_eq!(r["success"], true, "{r}");
    }
    for i in 0..8 {
        create_stream(
            &c,
            &format!("T{i}"),
            &format!(r#"{{"name":"T{i}","subjects":["t{i}.>"],"num_replicas":1}}"#),
        )
        .await;
        let r = api(&c, &format!("$JS.API.STREAM.DELETE.T{i}"), "").await;
        assert_eq!(r["success"], true, "{r}");
    }
    let p3_store = stores.path().join("P3");
    let stream_dir = |n: &str| p3_store.join("jetstream/APP/streams").join(n);
    assert!(stream_dir("S5").exists() && stream_dir("S6").exists());
    let p3 = Node::start_jetstream_at_with(&confs[2], &p3_store, |o| {
        o.meta_snapshot_every = 8;
        o.meta_log_kept = 2;
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream_dir("S5").exists() || stream_dir("S6").exists() {
        assert!(Instant::now() < deadline, "{}", p3.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        p3.log()
            .contains("meta state installed from the leader's snapshot"),
        "{}",
        p3.log()
    );
    nodes.push(p3);
    for i in 7..10 {
        assert!(stream_dir(&format!("S{i}")).exists(), "S{i} gone from P3");
    }
    lead_on(&c, "S7", "P3").await;
    let m = api(&c, "$JS.API.STREAM.MSG.GET.S7", r#"{"seq":1}"#).await;
    assert_eq!(m["message"]["data"], "a2VwdA==", "{m}");
    drop(c);
    // Every server again, each from its own snapshot and the log after it.
    for n in nodes.drain(..) {
        n.shutdown().await;
    }
    for (i, name) in names.iter().enumerate() {
        nodes.push(
            Node::start_jetstream_at_with(&confs[i], &stores.path().join(name), |o| {
                o.meta_snapshot_every = 8;
                o.meta_log_kept = 2;
            })
            .await,
        );
    }
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = api(&c, "$JS.API.STREAM.NAMES", "").await;
        let mut got: Vec<String> = l["streams"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        got.sort();
        if got == ["M", "S7", "S8", "S9"] {
            break;
        }
        assert!(Instant::now() < deadline, "{l}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stream_leader(&c, "S7", "").await;
    stream_leader(&c, "M", "").await;
    let m = api(&c, "$JS.API.STREAM.MSG.GET.S7", r#"{"seq":1}"#).await;
    assert_eq!(m["message"]["data"], "a2VwdA==", "{m}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// Keel's own series in `/metrics`: each Raft group's role and indexes, and per durable
/// consumer of a replicated stream how far each follower's copy of the ack floor trails
/// the leader's (the seed's "the ack floor may lag a few milliseconds").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_raft_groups_and_the_ack_floor_lag() {
    use async_nats::jetstream::{self, consumer::pull};
    use futures::StreamExt;
    if common::is_reference() {
        return; // Keel's series.
    }
    let nodes = mesh(&["M1", "M2", "M3"]).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let created = create_stream(
        &c,
        "L",
        r#"{"name":"L","subjects":["l.>"],"num_replicas":3}"#,
    )
    .await;
    let leader = created["cluster"]["leader"].as_str().unwrap().to_string();
    let js = jetstream::new(c.clone());
    for i in 0..20 {
        js.publish("l.x", format!("{i}").into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let stream = js.get_stream("L").await.unwrap();
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("lag".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut batch = consumer.fetch().max_messages(20).messages().await.unwrap();
    for _ in 0..20 {
        let m = common::within("fetch", batch.next())
            .await
            .unwrap()
            .unwrap();
        m.double_ack().await.unwrap();
    }
    let mut ln = None;
    for n in &nodes {
        if n.varz().await["server_name"] == leader.as_str() {
            ln = Some(n);
        }
    }
    let ln = ln.expect("leader node");
    let metrics = http_get(ln.monitor_port(), "/metrics").await.body;
    let lags: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("keel_consumer_ack_floor_lag_sequences{"))
        .collect();
    assert_eq!(lags.len(), 2, "one per follower:\n{metrics}");
    // Confirmed acks are on a quorum; the other follower catches up within moments.
    assert!(
        lags.iter().any(|l| l.ends_with(" 0")),
        "a follower holds the leader's ack floor:\n{}",
        lags.join("\n")
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("keel_raft_group_leader{")
                && l.contains("stream_name=\"L\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
    assert!(metrics.contains("raft_group=\"_meta_\""), "{metrics}");
    let series = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("stream_name=\"L\""))
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_string)
    };
    assert_eq!(
        series("keel_raft_group_state").as_deref(),
        Some("3"),
        "{metrics}"
    );
    let age: u64 = series("keel_raft_group_quorum_ack_age_milliseconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no quorum ack age:\n{metrics}"));
    assert!(age < 3000, "{age}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// A clustered server's Raft identity is its name: without `server_name` (or a cluster
/// name) JetStream in a cluster does not start, with the reference's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clustered_jetstream_server_needs_a_name() {
    if common::is_reference() {
        return; // The reference exits with the same text (checked by hand: it is fatal there).
    }
    let conf = "jetstream: enabled\ncluster { name: c, listen: \"127.0.0.1:-1\" }\n";
    let opts = keel_server::harness::opts_from_config(conf).unwrap();
    let err = keel_server::harness::start(opts)
        .await
        .err()
        .expect("refused");
    assert!(
        err.contains("jetstream cluster requires `server_name` to be set"),
        "{err}"
    );
}

/// A server restarted alone (the others down) does not pass for a leader of anything: its
/// saved vote is not a quorum. Health says so, and nothing is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restarted_alone_leads_nothing() {
    let stores = common::TempDir::new("alone");
    let names = ["A1", "A2", "A3"];
    let (nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let created = create_stream(&c, "S", r#"{"name":"S","subjects":["s"],"num_replicas":3}"#).await;
    let leader = created["cluster"]["leader"].as_str().unwrap().to_string();
    publish_acked(&c, "s", "x".into()).await;
    drop(c);
    for n in nodes {
        n.shutdown().await;
    }
    let li = names.iter().position(|n| *n == leader).unwrap();
    let alone = Node::start_jetstream_at(&confs[li], &stores.path().join(leader.as_str())).await;
    // Give a saved vote every chance to show.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let j = jsz(&alone).await;
    assert!(j["meta_cluster"]["leader"].is_null(), "{j}");
    let h = http_get(alone.monitor_port(), "/healthz").await;
    assert_eq!(h.status, 503, "{}", h.body);
    let c = connect(&alone, "app").await;
    let r = tokio::time::timeout(Duration::from_secs(3), c.request("s", "y".into())).await;
    if let Ok(Ok(m)) = r {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap_or_default();
        assert!(v["seq"].as_u64().unwrap_or(0) == 0, "acked alone: {v}");
    }
    alone.shutdown().await;
}

/// Waits until STREAM.INFO (asked on `c`) shows `n` replicas besides the leader, each
/// current and none of them `not`, and returns the info.
async fn replicas_current(
    c: &async_nats::Client,
    stream: &str,
    n: usize,
    not: &str,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let info = api(c, &format!("$JS.API.STREAM.INFO.{stream}"), "").await;
        let cl = &info["cluster"];
        let reps = cl["replicas"].as_array().cloned().unwrap_or_default();
        if cl["leader"]
            .as_str()
            .is_some_and(|l| !l.is_empty() && l != not)
            && reps.len() == n
            && reps
                .iter()
                .all(|r| r["current"] == true && r["name"] != not)
        {
            return info;
        }
        assert!(
            Instant::now() < deadline,
            "replicas not {n} current: {info}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `keel stream edit --replicas`: an R1 stream with a durable consumer grows to R3 (the
/// new peers get every message and the consumer's acks), survives losing the server it
/// started on, and shrinks back to R1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_scales_from_r1_to_r3_and_back() {
    scales_from_r1_to_r3_and_back("file").await;
}

/// The same with a memory stream (its group's log in memory; the new peers are refilled
/// from the leader's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_stream_scales_from_r1_to_r3_and_back() {
    scales_from_r1_to_r3_and_back("memory").await;
}

async fn scales_from_r1_to_r3_and_back(storage: &str) {
    let names = ["E1", "E2", "E3"];
    let mut nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let cfg = |r: u32| {
        format!(
            r#"{{"name":"ORDERS","subjects":["orders.>"],"storage":"{storage}","num_replicas":{r}}}"#
        )
    };
    let created = create_stream(&c, "ORDERS", &cfg(1)).await;
    let host = created["cluster"]["leader"].as_str().unwrap().to_string();
    for i in 1..=10u64 {
        assert_eq!(publish_acked(&c, "orders.new", format!("{i}")).await, i);
    }
    let cc = api(
        &c,
        "$JS.API.CONSUMER.DURABLE.CREATE.ORDERS.worker",
        r#"{"stream_name":"ORDERS","config":{"durable_name":"worker","ack_policy":"explicit"}}"#,
    )
    .await;
    assert!(cc.get("error").is_none(), "{cc}");
    {
        use async_nats::jetstream;
        use futures::StreamExt;
        let js = jetstream::new(c.clone());
        let consumer: jetstream::consumer::PullConsumer = js
            .get_stream("ORDERS")
            .await
            .unwrap()
            .get_consumer("worker")
            .await
            .unwrap();
        let mut batch = consumer.fetch().max_messages(3).messages().await.unwrap();
        for i in 1..=3u64 {
            let m = common::within("fetch", batch.next())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(m.payload, format!("{i}"));
            m.double_ack().await.expect("ack confirmed");
        }
    }

    // R1 -> R3, asked on a server that does not host it.
    let hi = names.iter().position(|n| *n == host).unwrap();
    let other = connect(&nodes[(hi + 1) % 3], "app").await;
    let up = api(&other, "$JS.API.STREAM.UPDATE.ORDERS", &cfg(3)).await;
    assert!(up.get("error").is_none(), "{up}");
    assert_eq!(up["config"]["num_replicas"], 3, "{up}");
    assert_eq!(up["cluster"]["name"], "jsc", "{up}");
    let info = replicas_current(&other, "ORDERS", 2, "").await;
    assert_eq!(info["state"]["messages"], 10, "{info}");

    // The server it started on goes: the new peers have everything.
    nodes.remove(hi).shutdown().await;
    let c = connect(&nodes[0], "app").await;
    assert_eq!(publish_acked(&c, "orders.new", "11".into()).await, 11);
    for seq in [1u64, 10, 11] {
        let m = api(
            &c,
            "$JS.API.STREAM.MSG.GET.ORDERS",
            &format!("{{\"seq\":{seq}}}"),
        )
        .await;
        assert_eq!(m["message"]["seq"], seq, "{m}");
    }
    // Keel's consumers ride in their stream's group, so they move with it; the
    // reference's consumer stays on the server it was made on (10119, offline).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !common::is_reference() {
        let ci = api(&c, "$JS.API.CONSUMER.INFO.ORDERS.worker", "").await;
        if ci["ack_floor"]["stream_seq"] == 3 {
            assert_eq!(ci["num_pending"], 8, "{ci}");
            break;
        }
        assert!(Instant::now() < deadline, "consumer: {ci}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // And back to R1 on what is left (without the consumer, which holds the reference's
    // shrink back while it is offline).
    let del = api(&c, "$JS.API.CONSUMER.DELETE.ORDERS.worker", "").await;
    assert_eq!(del["success"], true, "{del}");
    let down = api(&c, "$JS.API.STREAM.UPDATE.ORDERS", &cfg(1)).await;
    assert!(down.get("error").is_none(), "{down}");
    assert_eq!(down["config"]["num_replicas"], 1, "{down}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = api(&c, "$JS.API.STREAM.INFO.ORDERS", "").await;
        let reps = info["cluster"]["replicas"]
            .as_array()
            .map_or(0, |r| r.len());
        if reps == 0 && info["cluster"]["leader"].is_string() {
            assert_eq!(info["state"]["messages"], 11, "{info}");
            break;
        }
        assert!(Instant::now() < deadline, "still replicated: {info}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(publish_acked(&c, "orders.new", "12".into()).await, 12);
    for n in nodes {
        n.shutdown().await;
    }
}

/// `$JS.API.STREAM.PEER.REMOVE`: the peer leaves the stream's group and a free server takes
/// its place with every message; a server that is not a peer is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_peer_is_replaced() {
    let names = ["F1", "F2", "F3", "F4"];
    let mut nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let created = create_stream(
        &c,
        "ORDERS",
        r#"{"name":"ORDERS","subjects":["orders.>"],"storage":"file","num_replicas":3}"#,
    )
    .await;
    let leader = created["cluster"]["leader"].as_str().unwrap().to_string();
    let mut peers: Vec<String> = created["cluster"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect();
    peers.push(leader.clone());
    let spare = names
        .iter()
        .find(|n| !peers.contains(&n.to_string()))
        .unwrap()
        .to_string();
    for i in 1..=5u64 {
        assert_eq!(publish_acked(&c, "orders.new", format!("{i}")).await, i);
    }
    let not_member = api(
        &c,
        "$JS.API.STREAM.PEER.REMOVE.ORDERS",
        &format!("{{\"peer\":\"{spare}\"}}"),
    )
    .await;
    assert_eq!(not_member["error"]["err_code"], 10040, "{not_member}");
    let empty = api(&c, "$JS.API.STREAM.PEER.REMOVE.ORDERS", "{}").await;
    assert_eq!(empty["error"]["err_code"], 10003, "{empty}");
    // A follower goes; the spare takes its place.
    let gone = peers.iter().find(|p| **p != leader).unwrap().clone();
    let r = api(
        &c,
        "$JS.API.STREAM.PEER.REMOVE.ORDERS",
        &format!("{{\"peer\":\"{gone}\"}}"),
    )
    .await;
    assert_eq!(
        r["type"], "io.nats.jetstream.api.v1.stream_remove_peer_response",
        "{r}"
    );
    assert_eq!(r["success"], true, "{r}");
    let info = replicas_current(&c, "ORDERS", 2, &gone).await;
    let names_now: Vec<&str> = info["cluster"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect();
    assert!(names_now.contains(&spare.as_str()), "{info}");
    // The removed server drops its replica.
    let gi = names.iter().position(|n| *n == gone).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let j = jsz(&nodes[gi]).await;
        if j["streams"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "replica kept: {j}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The spare has every message: the leader goes, and the two left (one of them the
    // spare) carry on.
    let li = names.iter().position(|n| *n == leader).unwrap();
    nodes.remove(li).shutdown().await;
    let c = connect(&nodes[0], "app").await;
    assert_eq!(publish_acked(&c, "orders.new", "6".into()).await, 6);
    let info = api(&c, "$JS.API.STREAM.INFO.ORDERS", "").await;
    assert_eq!(info["state"]["messages"], 6, "{info}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// Three servers keeping their stores under `stores` (restartable with the configs
/// returned) and an R3 stream `S` on subject `s` with `allow_direct`: the servers, their
/// configs, the stream leader's index and a client on it.
async fn r3_on_stores(
    names: &[&str],
    stores: &common::TempDir,
) -> (Vec<Node>, Vec<String>, usize, async_nats::Client) {
    r3_stored_on(names, stores, "file").await
}

async fn r3_stored_on(
    names: &[&str],
    stores: &common::TempDir,
    storage: &str,
) -> (Vec<Node>, Vec<String>, usize, async_nats::Client) {
    let (nodes, confs) = mesh_in(names, Some(stores.path())).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let created = create_stream(
        &c,
        "S",
        &format!(
            r#"{{"name":"S","subjects":["s"],"num_replicas":3,"allow_direct":true,"storage":"{storage}"}}"#
        ),
    )
    .await;
    let leader = created["cluster"]["leader"].as_str().unwrap().to_string();
    let li = names.iter().position(|n| *n == leader).unwrap();
    let lc = connect(&nodes[li], "app").await;
    (nodes, confs, li, lc)
}

/// A stream leader that loses its quorum mid-commit keeps exactly what was committed: its
/// store is rolled back past batches it had not synced yet and they are applied again from
/// the log. Once the others are back, every replica serves every acked message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_its_quorum_keeps_what_was_committed() {
    leader_loses_its_quorum("file").await;
}

/// The same with a memory stream: its store rolls back too (an undo journal), and the
/// others come back empty and are refilled from the leader, which kept it in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_stream_leader_that_loses_its_quorum_keeps_what_was_committed() {
    leader_loses_its_quorum("memory").await;
}

async fn leader_loses_its_quorum(storage: &str) {
    let stores = common::TempDir::new("quorum");
    let names = ["Q1", "Q2", "Q3"];
    let (mut nodes, confs, li, lc) = r3_stored_on(&names, &stores, storage).await;
    for i in 1..=20u64 {
        assert_eq!(publish_acked(&lc, "s", format!("m{i}")).await, i);
    }
    // One more after the store's sync interval (200 ms): its commit syncs the store, so
    // the batch that fails below is the first after a sync, with no committed batch to
    // apply again (reading that empty span of a memory log once killed the stream's actor,
    // leaving its uncommitted messages in the store).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(publish_acked(&lc, "s", "m21".into()).await, 21);
    // The two others go; the leader's next batch cannot commit.
    let others: Vec<usize> = (0..3).filter(|i| *i != li).collect();
    for i in others.iter().rev() {
        nodes.remove(*i).shutdown().await;
    }
    let r = tokio::time::timeout(Duration::from_secs(8), lc.request("s", "lost?".into())).await;
    if let Ok(Ok(m)) = r {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap_or_default();
        assert!(
            v["seq"].as_u64().unwrap_or(0) == 0,
            "acked without a quorum: {v}"
        );
    }
    // They come back: the group goes on from what was committed.
    for i in &others {
        let n = Node::start_jetstream_at(&confs[*i], &stores.path().join(names[*i])).await;
        nodes.push(n);
    }
    let seq = publish_acked(&lc, "s", "after".into()).await;
    assert!(seq > 21, "seq {seq}");
    for n in &nodes {
        let c = connect(n, "app").await;
        for (i, want) in [(1u64, "m1"), (10, "m10"), (21, "m21"), (seq, "after")] {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let m = common::within(
                    "direct get",
                    c.request("$JS.API.DIRECT.GET.S", format!("{{\"seq\":{i}}}").into()),
                )
                .await
                .expect("direct get");
                if m.payload == want {
                    break;
                }
                assert!(Instant::now() < deadline, "seq {i} on {}: {m:?}", n.url());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// A new peer whose stream's log was compacted away catches up from a snapshot: the
/// leader's store state (which sequences, the consumers' files) and then the messages it
/// lacks, fetched from the leader. Deleted messages stay deleted on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_peer_catches_up_from_a_snapshot() {
    let names = ["N1", "N2", "N3"];
    let mut nodes = mesh(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    let cfg = |r: u32| {
        format!(r#"{{"name":"BIG","subjects":["big.>"],"storage":"file","num_replicas":{r}}}"#)
    };
    let created = create_stream(&c, "BIG", &cfg(1)).await;
    let host = created["cluster"]["leader"].as_str().unwrap().to_string();
    let hi = names.iter().position(|n| *n == host).unwrap();
    let hc = connect(&nodes[hi], "app").await;
    let cc = api(
        &hc,
        "$JS.API.CONSUMER.DURABLE.CREATE.BIG.worker",
        r#"{"stream_name":"BIG","config":{"durable_name":"worker","ack_policy":"explicit"}}"#,
    )
    .await;
    assert!(cc.get("error").is_none(), "{cc}");
    // More batches than a group keeps in its log (one publish waiting for each ack is one
    // batch each).
    let total = 1500u64;
    for i in 1..=total {
        let ack = common::within("pub", hc.request("big.x", format!("m{i}").into()))
            .await
            .expect("ack");
        let v: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
        assert_eq!(v["seq"], i, "{v}");
        if i == 10 {
            // Early, so the snapshot carries it.
            let del = api(&hc, "$JS.API.STREAM.MSG.DELETE.BIG", r#"{"seq":7}"#).await;
            assert_eq!(del["success"], true, "{del}");
        }
    }

    let up = api(&hc, "$JS.API.STREAM.UPDATE.BIG", &cfg(3)).await;
    assert!(up.get("error").is_none(), "{up}");
    replicas_current(&hc, "BIG", 2, "").await;
    // Only the new peers have it now.
    nodes.remove(hi).shutdown().await;
    let c = connect(&nodes[0], "app").await;
    assert_eq!(publish_acked(&c, "big.x", "after".into()).await, total + 1);
    let info = api(&c, "$JS.API.STREAM.INFO.BIG", "").await;
    assert_eq!(info["state"]["messages"], total, "{info}");
    assert_eq!(info["state"]["num_deleted"], 1, "{info}");
    for seq in [1u64, 6, 8, 700, total] {
        let m = api(
            &c,
            "$JS.API.STREAM.MSG.GET.BIG",
            &format!("{{\"seq\":{seq}}}"),
        )
        .await;
        assert_eq!(m["message"]["seq"], seq, "{m}");
    }
    let gone = api(&c, "$JS.API.STREAM.MSG.GET.BIG", r#"{"seq":7}"#).await;
    assert_eq!(gone["error"]["err_code"], 10037, "{gone}");
    // The consumer came with the snapshot (Keel's consumers ride in the stream's group).
    if !common::is_reference() {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ci = api(&c, "$JS.API.CONSUMER.INFO.BIG.worker", "").await;
            if ci["num_pending"] == total {
                break;
            }
            assert!(Instant::now() < deadline, "consumer: {ci}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// A replica that was down while its group's log was compacted catches up from the
/// snapshot: its store is brought in line (a message deleted meanwhile goes from it too)
/// and the messages it lacks come from the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_down_through_a_compaction_catches_up() {
    let stores = common::TempDir::new("compact");
    let names = ["C1", "C2", "C3"];
    let (mut nodes, confs, li, lc) = r3_on_stores(&names, &stores).await;
    for i in 1..=10u64 {
        assert_eq!(publish_acked(&lc, "s", format!("m{i}")).await, i);
    }
    // A follower goes (with messages 1..=10 on it).
    let fi = (li + 1) % 3;
    let fname = names[fi];
    let follower = nodes.remove(fi);
    follower.shutdown().await;
    let li = if li > fi { li - 1 } else { li };
    let del = api(&lc, "$JS.API.STREAM.MSG.DELETE.S", r#"{"seq":5}"#).await;
    assert_eq!(del["success"], true, "{del}");
    let total = 1500u64;
    for i in 11..=total {
        let ack = common::within("pub", lc.request("s", format!("m{i}").into()))
            .await
            .expect("ack");
        let v: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
        assert_eq!(v["seq"], i, "{v}");
    }
    let back = Node::start_jetstream_at(&confs[fi], &stores.path().join(fname)).await;
    nodes.push(back);
    replicas_current(&lc, "S", 2, "").await;
    // Read the returned replica's own store: the old leader goes, and direct gets
    // (allow_direct) on the returned one's connection are answered from its store.
    nodes.remove(li).shutdown().await;
    let bc = connect(nodes.last().unwrap(), "app").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            bc.request("$JS.API.DIRECT.GET.S", r#"{"seq":1500}"#.into()),
        )
        .await;
        if let Ok(Ok(m)) = r {
            if m.payload == format!("m{total}") {
                break;
            }
        }
        assert!(Instant::now() < deadline, "seq {total} not on {fname}");
    }
    for seq in [1u64, 10, 11, 700] {
        let m = common::within(
            "direct get",
            bc.request("$JS.API.DIRECT.GET.S", format!("{{\"seq\":{seq}}}").into()),
        )
        .await
        .unwrap();
        assert_eq!(m.payload, format!("m{seq}"), "seq {seq} on {fname}");
    }
    let gone = common::within(
        "direct get",
        bc.request("$JS.API.DIRECT.GET.S", r#"{"seq":5}"#.into()),
    )
    .await
    .unwrap();
    let status = gone.status.map(|s| s.as_u16()).unwrap_or_default();
    assert_eq!(status, 404, "seq 5 still on {fname}: {gone:?}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// `server_tags` and `placement.tags`: a stream goes only to servers with every tag asked
/// for; a tag no server has is refused with the reference's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_tags_pick_the_servers() {
    let names = ["T1", "T2", "T3"];
    let (nodes, _) = mesh_with(&names, None, |n| {
        let az = &n[1..];
        format!("server_tags: [\"cloud:test\", \"AZ:{az}\"]\n")
    })
    .await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    for az in ["2", "3"] {
        let name = format!("AZ{az}");
        let created = create_stream(
            &c,
            &name,
            &format!(
                r#"{{"name":"{name}","subjects":["az{az}"],"storage":"file","placement":{{"tags":["az:{az}"]}}}}"#
            ),
        )
        .await;
        assert_eq!(created["cluster"]["leader"], format!("T{az}"), "{created}");
    }
    let all = create_stream(
        &c,
        "ALL",
        r#"{"name":"ALL","subjects":["all"],"num_replicas":3,"placement":{"tags":["cloud:test"]}}"#,
    )
    .await;
    assert_eq!(all["config"]["num_replicas"], 3, "{all}");
    let none = api(
        &c,
        "$JS.API.STREAM.CREATE.NONE",
        r#"{"name":"NONE","subjects":["none"],"placement":{"tags":["az:9"]}}"#,
    )
    .await;
    assert_eq!(none["error"]["err_code"], 10005, "{none}");
    assert!(
        none["error"]["description"]
            .as_str()
            .unwrap()
            .contains("tags not matched ['az:9']"),
        "{none}"
    );
    let two = api(
        &c,
        "$JS.API.STREAM.CREATE.TWO",
        r#"{"name":"TWO","subjects":["two"],"num_replicas":3,"placement":{"tags":["az:2"]}}"#,
    )
    .await;
    assert_eq!(two["error"]["err_code"], 10005, "{two}");
    let varz = http_get(nodes[1].monitor_port(), "/varz").await;
    let v: serde_json::Value = serde_json::from_str(&varz.body).unwrap();
    assert_eq!(v["tags"], serde_json::json!(["cloud:test", "az:2"]), "{v}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// An R3 memory stream (`storage: memory`, `num_replicas: 3`): acked messages and a
/// durable's confirmed acks survive its leader going; a replica that restarts comes back
/// empty and is refilled from the leader (shown by making it the only copy that leads);
/// after every server restarts, the stream is there again, empty, and takes messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r3_memory_stream_keeps_acked_messages_while_a_quorum_stays_up() {
    use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
    use futures::StreamExt;
    let stores = common::TempDir::new("r3mem");
    let names = ["M1", "M2", "M3"];
    let (mut nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c0 = connect(&nodes[0], "app").await;
    let created = create_stream(
        &c0,
        "MEM",
        r#"{"name":"MEM","subjects":["mem.>"],"storage":"memory","num_replicas":3}"#,
    )
    .await;
    assert_eq!(created["config"]["storage"], "memory", "{created}");
    assert!(
        created["cluster"]["raft_group"]
            .as_str()
            .unwrap()
            .starts_with("S-R3M-"),
        "{created}"
    );
    for i in 0..20 {
        let c = connect(&nodes[i % 3], "app").await;
        let seq = publish_acked(&c, "mem.x", format!("m{i}")).await;
        assert_eq!(seq, i as u64 + 1);
    }
    let js = jetstream::new(c0.clone());
    let stream = js.get_stream("MEM").await.unwrap();
    stream
        .create_consumer(pull::Config {
            durable_name: Some("w".into()),
            ack_policy: AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    {
        let consumer: jetstream::consumer::PullConsumer = stream.get_consumer("w").await.unwrap();
        let mut batch = consumer.fetch().max_messages(5).messages().await.unwrap();
        for _ in 0..5 {
            let m = common::within("fetch", batch.next())
                .await
                .unwrap()
                .unwrap();
            m.double_ack().await.expect("ack confirmed");
        }
    }

    // A follower restarts: empty, it is refilled by the leader.
    let leader = stream_leader(&c0, "MEM", "").await;
    let fi = (names.iter().position(|n| *n == leader).unwrap() + 1) % 3;
    let follower = names[fi];
    nodes.remove(fi).shutdown().await;
    // Enough batches that the group snapshots and drops its log: the restarted replica
    // installs the snapshot and fetches the messages.
    let pc = connect(&nodes[0], "app").await;
    for i in 20..1120 {
        assert_eq!(
            publish_acked(&pc, "mem.x", format!("m{i}")).await,
            i as u64 + 1
        );
    }
    let back = Node::start_jetstream_at(&confs[fi], &stores.path().join(follower)).await;
    nodes.insert(fi, back);
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let info = api_answered(&c0, "$JS.API.STREAM.INFO.MEM", "").await;
        let reps = info["cluster"]["replicas"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if reps.len() == 2 && reps.iter().all(|r| r["current"] == true) {
            break;
        }
        if Instant::now() > deadline {
            let j = http_get(nodes[fi].monitor_port(), "/jsz?streams=true").await;
            panic!("not refilled: {info}\n{}\n{}", j.body, nodes[fi].log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The third server goes, then the leader hands over to the restarted replica: what it
    // serves is what it was refilled with.
    let third = names
        .iter()
        .position(|n| *n != leader && *n != follower)
        .unwrap();
    nodes.remove(third).shutdown().await;
    let alive: Vec<&str> = names
        .iter()
        .filter(|n| **n != names[third])
        .copied()
        .collect();
    let li = alive.iter().position(|n| *n == leader).unwrap();
    let cl = connect(&nodes[li], "app").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = api(&cl, "$JS.API.STREAM.LEADER.STEPDOWN.MEM", "").await;
        if r["success"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "no stepdown: {r}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(stream_leader(&cl, "MEM", &leader).await, follower);
    let fc = connect(&nodes[1 - li], "app").await;
    let info = api_answered(&fc, "$JS.API.STREAM.INFO.MEM", "").await;
    assert_eq!(info["state"]["messages"], 1120, "{info}");
    assert_eq!(info["state"]["last_seq"], 1120, "{info}");
    for seq in [1u64, 20, 600, 1120] {
        let m = api(
            &fc,
            "$JS.API.STREAM.MSG.GET.MEM",
            &format!("{{\"seq\":{seq}}}"),
        )
        .await;
        assert_eq!(m["message"]["seq"], seq, "{m}");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let info = loop {
        let info = api(&fc, "$JS.API.CONSUMER.INFO.MEM.w", "").await;
        if info["ack_floor"]["stream_seq"].is_u64() {
            break info;
        }
        assert!(
            Instant::now() < deadline,
            "no consumer on the new leader: {info}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(info["ack_floor"]["stream_seq"], 5, "{info}");
    assert_eq!(info["num_pending"], 1115, "{info}");
    assert_eq!(
        publish_acked(&fc, "mem.x", "m1120".to_string()).await,
        1121,
        "a sequence was reused"
    );

    // Every server restarts: the memory stream is there again, empty, and works.
    for n in nodes.drain(..) {
        n.shutdown().await;
    }
    for (i, name) in names.iter().enumerate() {
        nodes.push(Node::start_jetstream_at(&confs[i], &stores.path().join(name)).await);
    }
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[2], "app").await;
    // (nats-server leaves requests unanswered for a while after such a restart.)
    request_until(&c, "$JS.API.STREAM.INFO.MEM", String::new(), |v| {
        v["cluster"]["leader"]
            .as_str()
            .filter(|l| !l.is_empty())
            .map(String::from)
    })
    .await;
    let info = api_answered(&c, "$JS.API.STREAM.INFO.MEM", "").await;
    assert_eq!(info["config"]["storage"], "memory", "{info}");
    assert_eq!(info["state"]["messages"], 0, "{info}");
    let seq = request_until(&c, "mem.x", "again".to_string(), |v| v["seq"].as_u64()).await;
    assert!(seq >= 1);
    let info = api_answered(&c, "$JS.API.STREAM.INFO.MEM", "").await;
    assert_eq!(info["state"]["messages"], 1, "{info}");
    // Its durable is there again too (its config outlives the restart, its state does not,
    // as with the stream's messages), and delivers what is stored now.
    let info = request_until(&c, "$JS.API.CONSUMER.INFO.MEM.w", String::new(), |v| {
        v["config"]["durable_name"].is_string().then(|| v.clone())
    })
    .await;
    assert_eq!(info["config"]["ack_policy"], "explicit", "{info}");
    let js = jetstream::new(c.clone());
    let consumer: jetstream::consumer::PullConsumer = js
        .get_stream("MEM")
        .await
        .unwrap()
        .get_consumer("w")
        .await
        .unwrap();
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let m = common::within("fetch after the restart", batch.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&m.payload[..], b"again");
    m.double_ack().await.expect("ack confirmed");
    for n in nodes {
        n.shutdown().await;
    }
}

/// An R1 memory stream in a cluster (it has a Raft group, so it can grow): when its one
/// server restarts, the stream is there again, empty, leads on that server and takes
/// messages; then it still grows to R3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r1_memory_stream_comes_back_empty_after_its_server_restarts() {
    let stores = common::TempDir::new("r1mem");
    let names = ["O1", "O2", "O3"];
    let (mut nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c0 = connect(&nodes[0], "app").await;
    let cfg = |r: u32| {
        format!(r#"{{"name":"ONE","subjects":["one.>"],"storage":"memory","num_replicas":{r}}}"#)
    };
    let created = create_stream(&c0, "ONE", &cfg(1)).await;
    let host = created["cluster"]["leader"].as_str().unwrap().to_string();
    for i in 1..=5u64 {
        assert_eq!(publish_acked(&c0, "one.x", format!("m{i}")).await, i);
    }
    let hi = names.iter().position(|n| *n == host).unwrap();
    nodes.remove(hi).shutdown().await;
    nodes.insert(
        hi,
        Node::start_jetstream_at(&confs[hi], &stores.path().join(names[hi])).await,
    );
    let c = connect(&nodes[(hi + 1) % 3], "app").await;
    // (nats-server leaves requests unanswered for a while after a restart.)
    let info = request_until(&c, "$JS.API.STREAM.INFO.ONE", String::new(), |v| {
        v["cluster"]["leader"]
            .as_str()
            .filter(|l| !l.is_empty())
            .map(|_| v.clone())
    })
    .await;
    assert_eq!(info["cluster"]["leader"], host.as_str(), "{info}");
    assert_eq!(info["state"]["messages"], 0, "{info}");
    let seq = publish_acked(&c, "one.x", "again".into()).await;
    assert!(seq >= 1, "{seq}");
    let up = api(&c, "$JS.API.STREAM.UPDATE.ONE", &cfg(3)).await;
    assert!(up.get("error").is_none(), "{up}");
    let info = replicas_current(&c, "ONE", 2, "").await;
    assert_eq!(info["state"]["messages"], 1, "{info}");
    for n in nodes {
        n.shutdown().await;
    }
}

/// A server removed (`$JS.API.SERVER.REMOVE`) while it was down, restarted at once (before
/// a leader would add it back): it does not serve the copy it kept of a stream it no longer
/// holds; its clients get the cluster's answers, with the message published meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_removed_while_down_does_not_serve_its_stale_copy() {
    let stores = common::TempDir::new("removed");
    let names = ["Y1", "Y2", "Y3", "Y4"];
    let (mut nodes, confs) = mesh_in(&names, Some(stores.path())).await;
    let all: Vec<&Node> = nodes.iter().collect();
    let leader = meta_leader(&all, "").await;
    let keep = names.iter().position(|n| *n == leader).unwrap();
    let c = connect(&nodes[keep], "app").await;
    let sys = connect(&nodes[keep], "sys").await;
    create_stream(
        &c,
        "RY",
        r#"{"name":"RY","subjects":["ry.>"],"num_replicas":3,"allow_direct":true}"#,
    )
    .await;
    let sl = stream_leader(&c, "RY", "").await;
    for i in 1..=5u64 {
        assert_eq!(publish_acked(&c, "ry.x", format!("m{i}")).await, i);
    }
    let info = api(&c, "$JS.API.STREAM.INFO.RY", "").await;
    let victim = info["cluster"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .find(|r| *r != leader && *r != sl)
        .expect("a plain replica");
    let vi = names.iter().position(|n| *n == victim).unwrap();
    nodes.remove(vi).shutdown().await;
    let r = api(
        &sys,
        "$JS.API.SERVER.REMOVE",
        &format!(r#"{{"peer":"{victim}"}}"#),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    let listed = |info: &serde_json::Value| {
        let cl = &info["cluster"];
        cl["leader"] == victim.as_str()
            || cl["replicas"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x["name"] == victim.as_str()))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = api_answered(&c, "$JS.API.STREAM.INFO.RY", "").await;
        let current = info["cluster"]["replicas"]
            .as_array()
            .is_some_and(|r| r.len() == 2 && r.iter().all(|x| x["current"] == true));
        if !listed(&info) && current {
            break;
        }
        assert!(Instant::now() < deadline, "{info}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(publish_acked(&c, "ry.x", "m6".into()).await, 6);

    // It comes back on its store, with its copy of the five.
    let back = Node::start_jetstream_at(&confs[vi], &stores.path().join(&victim)).await;
    let vc = connect(&back, "app").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = api_answered(&vc, "$JS.API.STREAM.INFO.RY", "").await;
        let m = tokio::time::timeout(
            Duration::from_secs(2),
            vc.request("$JS.API.DIRECT.GET.RY", r#"{"seq":6}"#.into()),
        )
        .await;
        let six = matches!(&m, Ok(Ok(m)) if m.payload == "m6");
        if info["state"]["messages"] == 6 && !listed(&info) && six {
            break;
        }
        assert!(Instant::now() < deadline, "{info}\n{m:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    nodes.push(back);
    for n in nodes {
        n.shutdown().await;
    }
}

/// Direct gets through a memory replica that restarted empty: while it is being refilled
/// it does not answer from its own store (which would say 404 for messages the stream
/// has), so every answer is the message (or a moment of no answer), never "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refilling_memory_replica_does_not_answer_direct_gets_with_not_found() {
    let stores = common::TempDir::new("refill");
    let names = ["F1", "F2", "F3"];
    let (mut nodes, confs, li, c) = r3_stored_on(&names, &stores, "memory").await;
    let total = 2000u64;
    for i in 1..=total {
        let ack = common::within("pub", c.request("s", format!("m{i}").into()))
            .await
            .expect("ack");
        let v: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
        assert_eq!(v["seq"], i, "{v}");
    }
    let fi = (li + 1) % names.len();
    nodes.remove(fi).shutdown().await;
    nodes.insert(
        fi,
        Node::start_jetstream_at(&confs[fi], &stores.path().join(names[fi])).await,
    );
    let fc = connect(&nodes[fi], "app").await;
    let (mut found, mut other) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    for round in 0u64.. {
        if found >= 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "found {found}, other answers {other}"
        );
        let seq = 1 + (round * 7) % total;
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            fc.request("$JS.API.DIRECT.GET.S", format!("{{\"seq\":{seq}}}").into()),
        )
        .await;
        if let Ok(Ok(m)) = r {
            let status = m.status.map(|s| s.as_u16());
            assert_ne!(status, Some(404), "seq {seq} not found in round {round}");
            if status.is_none() {
                assert_eq!(m.payload, format!("m{seq}"), "seq {seq}");
                found += 1;
                continue;
            }
        }
        // (No answer yet: the reference has no direct-get responder there for a moment.)
        other += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// Steps the leadership of `stream` down until `to` leads it.
async fn lead_on(c: &async_nats::Client, stream: &str, to: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if stream_leader(c, stream, "").await == to {
            return;
        }
        let r = api(
            c,
            &format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}"),
            &format!(r#"{{"placement":{{"preferred":"{to}"}}}}"#),
        )
        .await;
        assert!(Instant::now() < deadline, "{to} never led {stream}: {r}");
        if r["success"] == true {
            let until = Instant::now() + Duration::from_secs(5);
            while Instant::now() < until && stream_leader(c, stream, "").await != to {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Every acked message of `stream` (`acked`: sequence to body) as published, and no other
/// sequence (the stream ends at the last one).
async fn holds_exactly(
    c: &async_nats::Client,
    stream: &str,
    acked: &std::collections::BTreeMap<u64, String>,
) {
    use base64::Engine;
    let last = *acked.keys().next_back().unwrap();
    let info = api(c, &format!("$JS.API.STREAM.INFO.{stream}"), "").await;
    assert_eq!(info["state"]["last_seq"], last, "{info}");
    assert!(info["state"].get("lost").is_none(), "{info}");
    for (seq, body) in acked {
        let m = api(
            c,
            &format!("$JS.API.STREAM.MSG.GET.{stream}"),
            &format!(r#"{{"seq":{seq}}}"#),
        )
        .await;
        let data = m["message"]["data"].as_str().unwrap_or_default();
        let got = base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap_or_default();
        assert!(got == body.as_bytes(), "seq {seq}: {m}");
    }
}

/// A mesh in this process, each server on a disk of its own that the test can fill or
/// stall (`keel_store::Disk::fillable`), with their switches.
async fn mesh_on_fillable_disks(names: &[&str]) -> (Vec<Node>, Vec<keel_store::DiskFull>) {
    let (disks, switches): (Vec<_>, Vec<_>) =
        names.iter().map(|_| keel_store::Disk::fillable()).unzip();
    let (nodes, _) = mesh_started(names, None, |_| String::new(), Start::OnDisks(disks)).await;
    (nodes, switches)
}

/// A new stream its server cannot make (here: no room on its disk, which placement does
/// not see) is answered with the error and not left assigned, as the reference drops a
/// rejected assignment: once there is room, a create again makes it (it timed out, the
/// stream assigned and nowhere). Keel only: these disks are this process's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_stream_its_server_cannot_make_is_not_left_assigned() {
    if common::is_reference() {
        return;
    }
    let names = ["E1", "E2", "E3"];
    let (nodes, fills) = mesh_on_fillable_disks(&names).await;
    meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let c = connect(&nodes[0], "app").await;
    for (n, f) in nodes.iter().zip(&fills) {
        f.fill(&n.store_dir().unwrap().join("jetstream/APP/streams"));
    }
    let body = r#"{"name":"NEW","subjects":["new.>"]}"#;
    let r = api(&c, "$JS.API.STREAM.CREATE.NEW", body).await;
    assert!(r.get("error").is_some(), "{r}");
    eventually("the refused stream unassigned", || async {
        let names = api(&c, "$JS.API.STREAM.NAMES", "").await;
        (names["total"] == 0).then_some(())
    })
    .await;
    for f in &fills {
        f.free();
    }
    let created = create_stream(&c, "NEW", body).await;
    assert_eq!(created["config"]["name"], "NEW", "{created}");
    assert_eq!(publish_acked(&c, "new.x", "m".into()).await, 1);
}

/// A full disk, in this process (`keel_store::Disk::fillable`; the fault checker fills
/// real loop-mounted disks, the reference's too). A follower whose whole store is full
/// fails to write its Raft log: it leaves the group, is loaded again from its files (again
/// and again while the disk stays full) and, once there is room, catches up. A leader whose
/// stream store alone is full (its Raft log still has room) cannot apply what its group
/// committed: it hands the group over and comes back the same way. Every acked message is
/// then on each of them, as published. (The reference turns JetStream off on a full disk
/// until it restarts: keel only.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_whose_disk_filled_come_back_once_there_is_room() {
    if common::is_reference() {
        return;
    }
    let names = ["D1", "D2", "D3"];
    let (nodes, fills) = mesh_on_fillable_disks(&names).await;
    let (c, _, leader) = r3_stream(&nodes, "FULL", "full.>").await;
    let mut acked = std::collections::BTreeMap::new();
    let mut n = 0u64;
    // Message `n`, `size` bytes, until acked.
    let mut publish = async |c: &async_nats::Client,
                             acked: &mut std::collections::BTreeMap<u64, String>,
                             size: usize| {
        n += 1;
        let body = format!("m{n:05}-{}", "x".repeat(size));
        let seq = publish_acked(c, "full.x", body.clone()).await;
        acked.insert(seq, body);
    };
    for _ in 0..20 {
        publish(&c, &mut acked, 1000).await;
    }

    // A follower other than D1 (whose client publishes) fills up.
    let fi = names
        .iter()
        .position(|x| *x != leader && *x != "D1")
        .unwrap();
    let follower = &nodes[fi];
    fills[fi].fill(&follower.store_dir().unwrap());
    let reloaded = "the replica is loaded again from its files";
    // Its log fails; loading it again fails too while the disk is full (opening allocates
    // ahead) and is tried again, or it loads and its log fails again.
    let again =
        |log: &str| log.contains("could not be loaded again") || log.matches(reloaded).count() >= 2;
    let until = Instant::now() + Duration::from_secs(60);
    while !again(&follower.log()) {
        assert!(Instant::now() < until, "{}", follower.log());
        publish(&c, &mut acked, 1000).await;
    }
    assert!(
        follower
            .log()
            .contains("its Raft group stopped on a storage error"),
        "{}",
        follower.log()
    );
    // The other two went on acking meanwhile.
    let filled_at = *acked.keys().next_back().unwrap();
    for _ in 0..20 {
        publish(&c, &mut acked, 1000).await;
    }
    fills[fi].free();
    replicas_current(&c, "FULL", 2, "").await;
    lead_on(&c, "FULL", names[fi]).await;
    holds_exactly(&c, "FULL", &acked).await;
    assert!(
        acked.len() as u64 > filled_at,
        "nothing acked while the disk was full"
    );

    // The leader's stream store fills (not its Raft log): what its group commits, it
    // cannot keep.
    let li = fi;
    let store = nodes[li]
        .store_dir()
        .unwrap()
        .join("jetstream/APP/streams/FULL/msgs");
    assert!(store.is_dir(), "{}", store.display());
    let before = nodes[li].log().matches(reloaded).count();
    fills[li].fill(&store);
    // Messages larger than the store's write buffer: written as the leader takes them,
    // so the write it cannot make is a publish's (a sync's is the other way it fails).
    let until = Instant::now() + Duration::from_secs(60);
    while nodes[li].log().matches(reloaded).count() == before {
        assert!(Instant::now() < until, "{}", nodes[li].log());
        publish(&c, &mut acked, 200_000).await;
    }
    assert!(
        nodes[li].log().contains("its store could not be written"),
        "{}",
        nodes[li].log()
    );
    // Another server leads and acks.
    stream_leader(&c, "FULL", names[li]).await;
    for _ in 0..20 {
        publish(&c, &mut acked, 1000).await;
    }
    fills[li].free();
    replicas_current(&c, "FULL", 2, "").await;
    lead_on(&c, "FULL", names[li]).await;
    holds_exactly(&c, "FULL", &acked).await;
    // A full disk is not damage: no replica found any.
    for node in &nodes {
        assert!(!node.log().contains("damaged"), "{}", node.log());
    }
    for node in nodes {
        node.shutdown().await;
    }
}

/// A publish whose batch the leader cannot see committed in time (its own Raft log's fsync
/// hangs, while its followers have the batch on disk and commit it) is answered with its
/// PubAck once the batch turns out committed, not with an error: a publisher told "failed"
/// of a message the stream then holds stores it twice when it tries again. (A stalled disk
/// in this process: keel only.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_whose_commit_outcome_comes_late_gets_its_puback() {
    use futures::StreamExt;
    if common::is_reference() {
        return;
    }
    let names = ["U1", "U2", "U3"];
    let (nodes, switches) = mesh_on_fillable_disks(&names).await;
    let (c, _, leader) = r3_stream(&nodes, "LATE", "late.>").await;
    let mut acked = std::collections::BTreeMap::new();
    for i in 1..=3u64 {
        assert_eq!(publish_acked(&c, "late.x", format!("m{i}")).await, i);
        acked.insert(i, format!("m{i}"));
    }
    let li = names.iter().position(|n| *n == leader).unwrap();
    let log_dir = stream_log_dir(&nodes[li].store_dir().unwrap(), "LATE");
    switches[li].stall(&log_dir);
    let inbox = c.new_inbox();
    let mut answers = c.subscribe(inbox.clone()).await.unwrap();
    c.publish_with_reply("late.x", inbox, "late".into())
        .await
        .unwrap();
    c.flush().await.unwrap();
    // The leader gives up waiting for the commit (after 5 s) and rolls its store back...
    let until = Instant::now() + Duration::from_secs(20);
    while !nodes[li]
        .log()
        .contains("a batch was not committed in time")
    {
        assert!(Instant::now() < until, "{}", nodes[li].log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ...and its disk answers again: it applies the batch its followers committed.
    switches[li].unstall();
    let m = tokio::time::timeout(Duration::from_secs(20), answers.next())
        .await
        .expect("the publish is answered")
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(v["seq"], 4, "{v}");
    acked.insert(4, "late".into());
    assert_eq!(publish_acked(&c, "late.x", "m5".into()).await, 5);
    acked.insert(5, "m5".into());
    holds_exactly(&c, "LATE", &acked).await;
    // Every replica holds it once.
    for n in names.iter().filter(|n| **n != leader) {
        lead_on(&c, "LATE", n).await;
        holds_exactly(&c, "LATE", &acked).await;
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// The directory of `stream`'s Raft log under a server's store.
fn stream_log_dir(store: &std::path::Path, stream: &str) -> std::path::PathBuf {
    let mut todo = vec![store.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            if p.ends_with(std::path::Path::new(stream).join("raft/log")) {
                return p;
            }
            todo.push(p);
        }
    }
    panic!("no log of {stream} under {}", store.display())
}

/// The meta group's log on a full disk (in this process, `keel_store::Disk::fillable`):
/// that server's meta node stops and `/healthz` says so; once there is room its node is
/// loaded again from its log, catches up, and takes its part in what the cluster decided
/// meanwhile and after (a new R3 stream gets its replica there). Keel only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meta_log_that_could_not_be_written_is_loaded_again() {
    if common::is_reference() {
        return;
    }
    let names = ["M1", "M2", "M3"];
    let (nodes, fills) = mesh_on_fillable_disks(&names).await;
    let leader = meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    let li = names.iter().position(|n| *n == leader).unwrap();
    let vi = (li + 1) % names.len();
    let victim = &nodes[vi];
    let c = connect(&nodes[li], "app").await;
    fills[vi].fill(&victim.store_dir().unwrap().join("jetstream/_cluster_/meta"));
    let mut made = 0;
    while !victim
        .log()
        .contains("meta group stopped on a storage error")
    {
        assert!(made < 300, "{}", victim.log());
        made += 1;
        // (The one placed on the victim as its meta node stops gets no answer: it starts
        // once that node is back.)
        let body = format!(r#"{{"name":"S{made}","subjects":["s{made}.>"]}}"#);
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            c.request(format!("$JS.API.STREAM.CREATE.S{made}"), body.into()),
        )
        .await;
    }
    let h = http_get(victim.monitor_port(), "/healthz").await;
    assert_eq!(h.status, 503, "{}", h.body);
    assert!(
        h.body.contains("meta group stopped on a storage error"),
        "{}",
        h.body
    );
    // The others go on deciding (R3 streams: two replicas make a quorum; one placed on it
    // alone would wait for it, as its create would).
    for k in 0..3 {
        let name = format!("W{k}");
        let body = format!(r#"{{"name":"{name}","subjects":["w{k}.>"],"num_replicas":3}}"#);
        create_stream(&c, &name, &body).await;
        publish_acked(&c, &format!("w{k}.x"), "during".into()).await;
    }
    fills[vi].free();
    victim
        .wait_logged("meta group loaded again from its log")
        .await;
    let body = r#"{"name":"AFTER","subjects":["after.>"],"num_replicas":3}"#;
    create_stream(&c, "AFTER", body).await;
    publish_acked(&c, "after.x", "one".into()).await;
    // Its replicas of the streams made meanwhile and after start and catch up.
    for s in ["W0", "W1", "W2", "AFTER"] {
        replicas_current(&c, s, 2, "").await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = http_get(victim.monitor_port(), "/healthz").await;
        if h.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "{} {}", h.status, h.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its view of the streams is the cluster's.
    let vc = connect(victim, "app").await;
    let names_seen = api(&vc, "$JS.API.STREAM.NAMES", "").await;
    let total = names_seen["total"].as_u64().unwrap_or(0);
    assert_eq!(total, made + 3 + 1, "{names_seen}");
    for node in nodes {
        node.shutdown().await;
    }
}

/// Creating a stream that exists is answered with the stream as it is, from its own
/// replicas and Raft group (not placed again: an R1 stream could land on an empty server),
/// and with 10058 when the config differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_an_existing_stream_again_keeps_it_where_it_is() {
    let names = ["C1", "C2", "C3"];
    let (nodes, _) = mesh_with(&names, None, |n| format!("server_tags: [\"n:{n}\"]\n")).await;
    let meta = meta_leader(&nodes.iter().collect::<Vec<_>>(), "").await;
    // ONE lives on a server other than the meta leader (a create the meta leader takes is
    // then not answered from a replica of its own).
    let host = names.iter().find(|n| **n != meta).unwrap();
    let one = format!(r#""placement":{{"tags":["n:{host}"]}}"#);
    let c = connect(&nodes[1], "app").await;
    for (name, replicas, extra) in [
        ("ONE", 1, one.as_str()),
        ("THREE", 3, r#""storage":"file""#),
    ] {
        let body = format!(
            r#"{{"name":"{name}","subjects":["{name}.>"],"num_replicas":{replicas},{extra}}}"#
        );
        let first = create_stream(&c, name, &body).await;
        // (The reference names the group only in some answers; keel in every one.)
        let group = first["cluster"]["raft_group"].clone();
        publish_acked(&c, &format!("{name}.x"), "1".into()).await;
        let info = api(&c, &format!("$JS.API.STREAM.INFO.{name}"), "").await;
        let leader = info["cluster"]["leader"].clone();
        for _ in 0..4 {
            let again = create_stream(&c, name, &body).await;
            assert_eq!(again["state"]["messages"], 1, "{again}");
            assert_eq!(again["cluster"]["raft_group"], group, "{again}");
            let info = api(&c, &format!("$JS.API.STREAM.INFO.{name}"), "").await;
            assert_eq!(info["state"]["messages"], 1, "{info}");
            assert_eq!(info["cluster"]["raft_group"], group, "{info}");
            if replicas == 1 {
                // Its one server (an R3's leader may change under load).
                assert_eq!(info["cluster"]["leader"], leader, "{info}");
            }
        }
        let other = api(
            &c,
            &format!("$JS.API.STREAM.CREATE.{name}"),
            &format!(r#"{{"name":"{name}","subjects":["{name}.>"],"num_replicas":{replicas},{extra},"max_msgs":5}}"#),
        )
        .await;
        assert_eq!(other["error"]["err_code"], 10058, "{other}");
    }
    // After an update, from every server (two have no replica of ONE): the config it has
    // now is answered with the stream, the one it was made with is refused.
    let made = format!(r#"{{"name":"ONE","subjects":["ONE.>"],"num_replicas":1,{one}}}"#);
    let now =
        format!(r#"{{"name":"ONE","subjects":["ONE.>"],"num_replicas":1,{one},"max_msgs":50}}"#);
    let updated = api(&c, "$JS.API.STREAM.UPDATE.ONE", &now).await;
    assert!(updated.get("error").is_none(), "{updated}");
    for n in &nodes {
        let c = connect(n, "app").await;
        let again = create_stream(&c, "ONE", &now).await;
        assert_eq!(again["config"]["max_msgs"], 50, "{again}");
        let old = api(&c, "$JS.API.STREAM.CREATE.ONE", &made).await;
        assert_eq!(old["error"]["err_code"], 10058, "{old}");
    }
    // Asked at once from every server (each forwards to the meta leader before any has
    // the assignment): one stream, one group, every answer a success naming it.
    let clients = [
        connect(&nodes[0], "app").await,
        connect(&nodes[1], "app").await,
        connect(&nodes[2], "app").await,
    ];
    let body = r#"{"name":"RACE","subjects":["race"],"num_replicas":3}"#;
    // (A create answered after an election may take seconds on a busy machine.)
    let ask = |c: &async_nats::Client| {
        let c = c.clone();
        async move {
            let m = tokio::time::timeout(
                Duration::from_secs(20),
                c.request("$JS.API.STREAM.CREATE.RACE", body.into()),
            )
            .await
            .expect("no answer in 20 s")
            .expect("request");
            serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap()
        }
    };
    let answers = futures::future::join_all(clients.iter().cycle().take(6).map(ask)).await;
    let group = answers[0]["cluster"]["raft_group"].clone();
    for a in &answers {
        assert!(a.get("error").is_none(), "{a}");
        assert_eq!(a["cluster"]["raft_group"], group, "{a}");
    }
    for c in &clients {
        let info = api(c, "$JS.API.STREAM.INFO.RACE", "").await;
        assert_eq!(info["cluster"]["raft_group"], group, "{info}");
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// A server stopped gracefully says so (`$SYS.SERVER.<id>.SHUTDOWN`): at once it is listed
/// offline in a stream's `cluster`, placement puts it after every server that is up, and a
/// placement that needs it for a quorum is refused with the reference's 10005 "no suitable
/// peers for placement, peer offline" (and the tags a server lacked; without the notice it
/// counts as up for 10 s); started again, it is placed on again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stopped_gracefully_is_not_counted_on() {
    let names = ["G1", "G2", "G3"];
    let stores = common::TempDir::new("gone");
    // G1 and G2 are in zone a, G3 elsewhere.
    let (mut nodes, confs) = mesh_with(&names, Some(stores.path()), |n| {
        let zone = if n == "G3" { "b" } else { "a" };
        format!("server_tags: [\"zone:{zone}\"]\n")
    })
    .await;
    let all: Vec<&Node> = nodes.iter().collect();
    let leader = meta_leader(&all, "").await;
    let li = names.iter().position(|n| *n == leader).unwrap();
    let c = connect(&nodes[li], "app").await;
    create_stream(
        &c,
        "ONE",
        r#"{"name":"ONE","subjects":["one"],"num_replicas":3}"#,
    )
    .await;
    // A zone-a server other than the meta leader goes (the meta group keeps its quorum).
    let gi = (0..2).find(|i| *i != li).unwrap();
    let gone = names[gi];
    let node = nodes.remove(gi);
    node.terminate().await;
    let offline = |v: &serde_json::Value| {
        v["cluster"]["replicas"]
            .as_array()
            .and_then(|rs| rs.iter().find(|r| r["name"] == gone).cloned())
            .unwrap_or_else(|| panic!("{gone} not listed: {v}"))["offline"]
            == true
    };
    // (The reference leaves requests unanswered while the stream elects a new leader; the
    // notice is taken in a moment, and without it the server would count as up for 10 s.)
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let info = api_answered(&c, "$JS.API.STREAM.INFO.ONE", "").await;
        if offline(&info) {
            break;
        }
        assert!(Instant::now() < deadline, "not listed offline: {info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Zone a has one server up: an R2 there has no quorum.
    let zoned =
        r#"{"name":"ZONED","subjects":["zoned"],"num_replicas":2,"placement":{"tags":["zone:a"]}}"#;
    let refused = api(&c, "$JS.API.STREAM.CREATE.ZONED", zoned).await;
    assert_eq!(refused["error"]["err_code"], 10005, "{refused}");
    assert_eq!(
        refused["error"]["description"],
        "no suitable peers for placement, peer offline, tags not matched ['zone:a']",
        "{refused}"
    );
    // Three servers, two up: an R3 is placed, the one that went listed offline.
    let two = create_stream(
        &c,
        "TWO",
        r#"{"name":"TWO","subjects":["two"],"num_replicas":3}"#,
    )
    .await;
    assert!(offline(&two), "{two}");
    // Back (under a new server id): counted on again.
    let back = Node::start_jetstream_at(&confs[gi], &stores.path().join(gone)).await;
    back.wait_remotes(2).await;
    request_until(&c, "$JS.API.STREAM.CREATE.ZONED", zoned.to_string(), |v| {
        v.get("error").is_none().then_some(())
    })
    .await;
    back.shutdown().await;
    for n in nodes {
        n.shutdown().await;
    }
}
