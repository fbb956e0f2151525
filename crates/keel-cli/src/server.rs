//! `keel server ping|list|info|report|check`, with the `nats` CLI's meaning: every server
//! answers through the system account (`$SYS.REQ.SERVER.PING[.<KIND>]`,
//! `$SYS.REQ.SERVER.<id>.<KIND>`), so these need a user of the system account
//! (`--user/--password`, `--creds` or a `--context` with one).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::Client;
use bytes::Bytes;
use clap::{Args, Subcommand, ValueEnum};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::output::{b, dur, fmt_time, i, ibytes, n, parse_time, print_json, s, u, Cols, Table};
use crate::util::{ConnSettings, Res};

#[derive(Subcommand, Debug)]
pub enum ServerCmd {
    /// Ping all servers
    Ping(PingArgs),
    /// List known servers
    #[command(visible_alias = "ls")]
    List(ListArgs),
    /// Show information about a single server
    #[command(visible_alias = "i")]
    Info(InfoArgs),
    /// Report on various server metrics: connections, jetstream
    #[command(subcommand, visible_alias = "rep")]
    Report(ReportCmd),
    /// Health check for NATS servers (Nagios exit codes: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN)
    Check(crate::check::CheckArgs),
    /// Manage the JetStream meta group (as the system account)
    #[command(subcommand)]
    Raft(RaftCmd),
}

#[derive(Subcommand, Debug)]
pub enum RaftCmd {
    /// Make another server the JetStream meta group's leader
    #[command(name = "step-down")]
    StepDown(RaftStepDownArgs),
    /// Remove a server that is gone for good from the JetStream meta group (its stream
    /// replicas move to other servers)
    #[command(name = "peer-remove")]
    PeerRemove(RaftPeerRemoveArgs),
}

#[derive(Args, Debug)]
pub struct RaftStepDownArgs {
    /// The server to hand leadership to
    #[arg(long)]
    preferred: Option<String>,
}

#[derive(Args, Debug)]
pub struct RaftPeerRemoveArgs {
    /// The server's name (or its peer id, with --peer-id)
    name: String,
    /// NAME is a peer id (8 characters, as /jsz shows)
    #[arg(long)]
    peer_id: bool,
}

#[derive(Args, Debug)]
pub struct PingArgs {
    /// How many servers to expect (default: as many as the first reply says are active)
    expect: Option<u32>,
    /// Include the Server ID in the output
    #[arg(long)]
    id: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum ListSort {
    Name,
    Cluster,
    #[value(alias = "conn")]
    Conns,
    #[value(alias = "sub")]
    Subs,
    #[value(alias = "route")]
    Routes,
    #[value(alias = "gw")]
    Gws,
    Mem,
    Cpu,
    Slow,
    Uptime,
    Rtt,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// How many servers to expect
    expect: Option<u32>,
    /// Sort servers by a specific key
    #[arg(long, value_enum, default_value = "rtt")]
    sort: ListSort,
    /// Reverse sort servers
    #[arg(short = 'R', long)]
    reverse: bool,
    /// Compact server names: drop the domain parts all names share (the default)
    #[arg(long, overrides_with = "no_compact")]
    compact: bool,
    /// Show full server names
    #[arg(long)]
    no_compact: bool,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Server ID or Name to inspect (default: any one server)
    #[arg(value_name = "SERVER")]
    id: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum ReportCmd {
    /// Report on connections
    #[command(visible_aliases = ["conn", "connz", "conns"])]
    Connections(ConnReportArgs),
    /// Report on JetStream activity
    #[command(visible_aliases = ["jsz", "js"])]
    Jetstream(JsReportArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum ConnSort {
    InBytes,
    OutBytes,
    InMsgs,
    OutMsgs,
    Uptime,
    Cid,
    Subs,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum ConnState {
    Open,
    Closed,
    All,
}

/// Filters shared by the reports: which servers answer.
#[derive(Args, Debug)]
pub struct ServerFilter {
    /// Limit the report to a specific NATS server (by name)
    #[arg(long)]
    host: Option<String>,
    /// Limit the report to a specific Cluster
    #[arg(long)]
    cluster: Option<String>,
    /// Reverse sort
    #[arg(short = 'R', long)]
    reverse: bool,
}

#[derive(Args, Debug)]
pub struct ConnReportArgs {
    /// Limit the responses to a certain amount of servers
    limit: Option<u32>,
    /// Limit report to a specific account
    #[arg(long)]
    account: Option<String>,
    /// Sort by a specific property
    #[arg(long, value_enum, default_value = "subs")]
    sort: ConnSort,
    /// Limit results to the top results
    #[arg(long, default_value_t = 1000)]
    top: usize,
    /// Limits responses only to those connections with matching subscription interest
    #[arg(long)]
    subject: Option<String>,
    /// Limits responses only to those connections for a specific authentication username
    #[arg(long)]
    username: Option<String>,
    /// Limits responses only to those connections that are in a specific state
    #[arg(long, value_enum, default_value = "open")]
    state: ConnState,
    #[command(flatten)]
    filter: ServerFilter,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum JsSort {
    Name,
    Cluster,
    Streams,
    Consumers,
    Msgs,
    #[value(alias = "bytes")]
    Mbytes,
    Mem,
    #[value(alias = "store")]
    File,
    Api,
    Err,
}

#[derive(Args, Debug)]
pub struct JsReportArgs {
    /// Limit the responses to a certain amount of servers
    limit: Option<u32>,
    /// Produce the report for a specific account
    #[arg(long)]
    account: Option<String>,
    /// Sort by a specific property
    #[arg(long, value_enum, default_value = "cluster")]
    sort: JsSort,
    /// Compact server names: drop the domain parts all names share (the default)
    #[arg(long, overrides_with = "no_compact")]
    compact: bool,
    /// Show full server names
    #[arg(long)]
    no_compact: bool,
    #[command(flatten)]
    filter: ServerFilter,
}

/// What the user is told when nobody in the connected account serves `$SYS.REQ`.
pub fn no_responders(subject: &str) -> String {
    format!(
        "no responders on {subject}: connect as a user of the system account (--user/--password, \
--creds or --context; the server needs `system_account` set), with permission for $SYS.REQ.>"
    )
}

/// Sends one system request and gathers the answers (with each one's time since the
/// request) until `expect` arrived or the timeout passed. With `learn`, and no `expect`,
/// the first answer's `statsz.active_servers` says how many to wait for (as `nats`).
pub async fn collect(
    client: &Client,
    subject: &str,
    body: &Value,
    expect: Option<usize>,
    learn: bool,
    timeout: Duration,
) -> Res<Vec<(Value, Duration)>> {
    let inbox = client.new_inbox();
    let mut sub = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| format!("subscribe failed: {e}"))?;
    let payload = if body.is_null() {
        Bytes::new()
    } else {
        Bytes::from(body.to_string())
    };
    let started = Instant::now();
    client
        .publish_with_reply(subject.to_string(), inbox, payload)
        .await
        .map_err(|e| format!("publish to {subject} failed: {e}"))?;
    client
        .flush()
        .await
        .map_err(|e| format!("flush failed: {e}"))?;
    let deadline = tokio::time::Instant::from_std(started + timeout);
    let mut expect = expect;
    let mut out = Vec::new();
    loop {
        if expect.is_some_and(|e| out.len() >= e) {
            break;
        }
        let msg = match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(m)) => m,
            Ok(None) | Err(_) => break,
        };
        if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(no_responders(subject));
        }
        let v: Value = serde_json::from_slice(&msg.payload)
            .map_err(|e| format!("could not decode the response to {subject}: {e}"))?;
        if learn && expect.is_none() {
            let active = u(&v["statsz"], "active_servers") as usize;
            if active > 0 {
                expect = Some(active);
            }
        }
        out.push((v, started.elapsed()));
    }
    Ok(out)
}

/// How many servers to wait for: the given number, else what the first ping reply says.
async fn expected(client: &Client, given: Option<u32>, timeout: Duration) -> Res<Option<usize>> {
    if let Some(n) = given.filter(|n| *n > 0) {
        return Ok(Some(n as usize));
    }
    let first = collect(
        client,
        "$SYS.REQ.SERVER.PING",
        &Value::Null,
        Some(1),
        false,
        timeout,
    )
    .await?;
    Ok(first
        .first()
        .map(|(v, _)| u(&v["statsz"], "active_servers") as usize)
        .filter(|n| *n > 0))
}

fn no_results() -> String {
    "no results received, ensure the account used has system privileges and appropriate permissions"
        .into()
}

/// Server names without the trailing dot-separated parts they all share, as `nats`
/// compacts host names (`n1.example.net`, `n2.example.net` become `n1`, `n2`; the
/// comparison goes by token position, as nats' does).
pub fn compact_names(names: &[String]) -> Vec<String> {
    let parts: Vec<Vec<&str>> = names.iter().map(|n| n.split('.').collect()).collect();
    let Some(shortest) = parts.iter().map(Vec::len).min() else {
        return Vec::new();
    };
    let mut remove = String::new();
    for k in (1..shortest).rev() {
        let s = parts[0][k];
        if parts.iter().all(|p| p[k] == s) {
            remove = format!(".{s}{remove}");
        } else {
            break;
        }
    }
    names
        .iter()
        .map(|n| n.strip_suffix(remove.as_str()).unwrap_or(n).to_string())
        .collect()
}

/// Go's `time.Duration.String()`: `1.234567ms`, `850µs`, `2m3.5s`.
pub fn go_dur(d: Duration) -> String {
    let ns = d.as_nanos();
    let frac = |v: u128, unit: u128, width: usize| {
        let (int, rem) = (v / unit, v % unit);
        if rem == 0 {
            int.to_string()
        } else {
            let f = format!("{rem:0width$}");
            format!("{int}.{}", f.trim_end_matches('0'))
        }
    };
    match ns {
        0 => "0s".into(),
        n if n < 1_000 => format!("{n}ns"),
        n if n < 1_000_000 => format!("{}µs", frac(n, 1_000, 3)),
        n if n < 1_000_000_000 => format!("{}ms", frac(n, 1_000_000, 6)),
        n => {
            let (h, m) = (n / 3_600_000_000_000, n / 60_000_000_000 % 60);
            let secs = frac(n % 60_000_000_000, 1_000_000_000, 9);
            if h > 0 {
                format!("{h}h{m}m{secs}s")
            } else if m > 0 {
                format!("{m}m{secs}s")
            } else {
                format!("{secs}s")
            }
        }
    }
}

pub async fn run(conn: &ConnSettings, cmd: &ServerCmd, json_out: bool) -> Res<()> {
    if let ServerCmd::Check(c) = cmd {
        return crate::check::run(conn, c, json_out).await;
    }
    let client = conn.connect().await?;
    match cmd {
        ServerCmd::Ping(a) => ping(&client, conn, a, json_out).await,
        ServerCmd::List(a) => list(&client, conn, a, json_out).await,
        ServerCmd::Info(a) => info(&client, conn, a, json_out).await,
        ServerCmd::Report(ReportCmd::Connections(a)) => {
            report_connections(&client, conn, a, json_out).await
        }
        ServerCmd::Report(ReportCmd::Jetstream(a)) => {
            report_jetstream(&client, conn, a, json_out).await
        }
        ServerCmd::Raft(r) => raft(&client, conn, r, json_out).await,
        ServerCmd::Check(_) => unreachable!("handled above"),
    }
}

/// `server raft step-down` / `peer-remove`: one meta leader API request, its answer shown.
async fn raft(client: &Client, conn: &ConnSettings, cmd: &RaftCmd, json_out: bool) -> Res<()> {
    let (subject, body) = match cmd {
        RaftCmd::StepDown(a) => (
            "$JS.API.META.LEADER.STEPDOWN",
            a.preferred
                .as_ref()
                .map(|p| json!({"placement": {"preferred": p}}).to_string())
                .unwrap_or_default(),
        ),
        RaftCmd::PeerRemove(a) => (
            "$JS.API.SERVER.REMOVE",
            if a.peer_id {
                json!({"peer_id": a.name}).to_string()
            } else {
                json!({"peer": a.name}).to_string()
            },
        ),
    };
    let before = match cmd {
        RaftCmd::StepDown(_) if !json_out => meta_leader(client).await,
        _ => None,
    };
    let m = tokio::time::timeout(conn.timeout, client.request(subject, body.into()))
        .await
        .map_err(|_| format!("no answer to {subject} (is this the system account?)"))?
        .map_err(|e| format!("{subject}: {e}"))?;
    let v: Value = serde_json::from_slice(&m.payload).map_err(|e| e.to_string())?;
    if json_out {
        print_json(&v);
    }
    if let Some(e) = v.get("error") {
        return Err(format!(
            "{} (error code {})",
            s(e, "description"),
            i(e, "err_code")
        ));
    }
    if let Some(old) = before {
        // natscli's lines: the leader before, then the one elected after it.
        let stamp = crate::output::now_stamp;
        println!("{} Current leader: {old}", stamp());
        let limit = conn.timeout.max(Duration::from_secs(10));
        let new = crate::util::new_leader(&old, limit, || meta_leader(client)).await;
        let new = new.ok_or_else(|| format!("the meta leader is still {old}"))?;
        println!("{} New leader: {new}", stamp());
        return Ok(());
    }
    if !json_out {
        match cmd {
            RaftCmd::StepDown(_) => println!("Meta leader step down requested"),
            RaftCmd::PeerRemove(a) => println!("Removed peer {:?} from the meta group", a.name),
        }
    }
    Ok(())
}

/// The JetStream meta leader's name: the one server that answers a `leader_only` JSZ
/// request (None without one within a second).
async fn meta_leader(client: &Client) -> Option<String> {
    let body = json!({"leader_only": true}).to_string();
    let m = tokio::time::timeout(
        Duration::from_secs(1),
        client.request("$SYS.REQ.SERVER.PING.JSZ", body.into()),
    )
    .await
    .ok()?
    .ok()?;
    let v: Value = serde_json::from_slice(&m.payload).ok()?;
    Some(s(&v["server"], "name").to_string()).filter(|n| !n.is_empty())
}

async fn ping(client: &Client, conn: &ConnSettings, a: &PingArgs, json_out: bool) -> Res<()> {
    let expect = a.expect.filter(|n| *n > 0).map(|n| n as usize);
    let replies = collect(
        client,
        "$SYS.REQ.SERVER.PING",
        &Value::Null,
        expect,
        true,
        conn.timeout,
    )
    .await?;
    let expect = expect.or_else(|| {
        replies
            .first()
            .map(|(v, _)| u(&v["statsz"], "active_servers") as usize)
            .filter(|n| *n > 0)
    });
    if json_out {
        let v: Vec<Value> = replies
            .iter()
            .map(|(v, rtt)| {
                json!({
                    "id": s(&v["server"], "id"),
                    "name": s(&v["server"], "name"),
                    "rtt": rtt.as_nanos() as u64,
                })
            })
            .collect();
        print_json(&Value::Array(v));
    } else {
        for (v, rtt) in &replies {
            let srv = &v["server"];
            if a.id {
                println!(
                    "{} {:<60} rtt={}",
                    s(srv, "id"),
                    s(srv, "name"),
                    go_dur(*rtt)
                );
            } else {
                println!("{:<60} rtt={}", s(srv, "name"), go_dur(*rtt));
            }
        }
        println!();
        println!("---- ping statistics ----");
        if replies.is_empty() {
            println!("no responses received");
        } else {
            let ms: Vec<f64> = replies.iter().map(|(_, d)| d.as_millis() as f64).collect();
            let max = ms.iter().cloned().fold(f64::MIN, f64::max);
            let min = ms.iter().cloned().fold(f64::MAX, f64::min);
            let avg = ms.iter().sum::<f64>() / ms.len() as f64;
            println!(
                "{} replies max: {max:.2} min: {min:.2} avg: {avg:.2}",
                replies.len()
            );
        }
    }
    if let Some(e) = expect.filter(|e| *e > replies.len()) {
        if !json_out {
            println!("\nMissing {} server(s)", e - replies.len());
        }
    }
    if replies.is_empty() {
        return Err(no_results());
    }
    Ok(())
}

async fn list(client: &Client, conn: &ConnSettings, a: &ListArgs, json_out: bool) -> Res<()> {
    let expect = a.expect.filter(|n| *n > 0).map(|n| n as usize);
    let mut replies = collect(
        client,
        "$SYS.REQ.SERVER.PING",
        &Value::Null,
        expect,
        true,
        conn.timeout,
    )
    .await?;
    if replies.is_empty() {
        return Err(no_results());
    }
    if json_out {
        let v: Vec<Value> = replies
            .iter()
            .map(|(v, _)| json!({"server": v["server"], "statsz": v["statsz"]}))
            .collect();
        print_json(&Value::Array(v));
        return Ok(());
    }
    let name = |v: &Value| s(&v["server"], "name").to_string();
    let st = |v: &Value, k: &str| v["statsz"][k].as_f64().unwrap_or(0.0);
    let len = |v: &Value, k: &str| v["statsz"][k].as_array().map_or(0, Vec::len);
    let start_ns = |v: &Value| parse_time(s(&v["statsz"], "start")).unwrap_or(0);
    // As `nats`: descending by default, -R for ascending; name and cluster ascending.
    replies.sort_by(|(x, rx), (y, ry)| {
        use std::cmp::Ordering;
        let f = |p: f64, q: f64| p.partial_cmp(&q).unwrap_or(Ordering::Equal);
        let ord = match a.sort {
            ListSort::Name => name(y).cmp(&name(x)),
            ListSort::Cluster => s(&y["server"], "cluster")
                .cmp(s(&x["server"], "cluster"))
                .then_with(|| name(y).cmp(&name(x))),
            ListSort::Conns => f(st(x, "connections"), st(y, "connections")),
            ListSort::Subs => f(st(x, "subscriptions"), st(y, "subscriptions")),
            ListSort::Routes => len(x, "routes")
                .cmp(&len(y, "routes"))
                .then_with(|| name(y).cmp(&name(x))),
            ListSort::Gws => len(x, "gateways")
                .cmp(&len(y, "gateways"))
                .then_with(|| name(y).cmp(&name(x))),
            ListSort::Mem => f(st(x, "mem"), st(y, "mem")),
            ListSort::Cpu => f(st(x, "cpu"), st(y, "cpu")),
            ListSort::Slow => f(st(x, "slow_consumers"), st(y, "slow_consumers")),
            ListSort::Uptime => start_ns(y).cmp(&start_ns(x)),
            ListSort::Rtt => rx.cmp(ry),
        };
        let ord = ord.reverse();
        if a.reverse {
            ord.reverse()
        } else {
            ord
        }
    });
    let mut t = Table::new(
        "Server Overview",
        &[
            "Name", "Cluster", "Host", "Version", "JS", "Conns", "Subs", "Routes", "GWs", "Mem",
            "CPU %", "Cores", "Slow", "Uptime", "RTT",
        ],
    );
    let names: Vec<String> = replies.iter().map(|(v, _)| name(v)).collect();
    let hosts: Vec<String> = replies
        .iter()
        .map(|(v, _)| s(&v["server"], "host").to_string())
        .collect();
    let (names, hosts) = if a.no_compact {
        (names, hosts)
    } else {
        (compact_names(&names), compact_names(&hosts))
    };
    let mut clusters: BTreeMap<String, (usize, Vec<usize>)> = BTreeMap::new();
    let (mut conns, mut subs, mut mem, mut slow, mut js) = (0u64, 0u64, 0u64, 0u64, 0usize);
    let first_ver = s(&replies[0].0["server"], "ver").to_string();
    let first_gws = len(&replies[0].0, "gateways");
    let (mut versions_ok, mut gws_ok) = ("", "");
    for (k, (v, rtt)) in replies.iter().enumerate() {
        let srv = &v["server"];
        let stz = &v["statsz"];
        let cluster = s(srv, "cluster");
        conns += u(stz, "connections");
        subs += u(stz, "subscriptions");
        mem += u(stz, "mem");
        slow += u(stz, "slow_consumers");
        if b(srv, "jetstream") {
            js += 1;
        }
        if !cluster.is_empty() {
            let e = clusters.entry(cluster.to_string()).or_default();
            e.0 += u(stz, "connections") as usize;
            e.1.push(len(v, "routes"));
        }
        if s(srv, "ver") != first_ver {
            versions_ok = "X";
        }
        if len(v, "gateways") != first_gws {
            gws_ok = "X";
        }
        let js_cell = if b(srv, "jetstream") {
            if s(srv, "domain").is_empty() {
                "yes".to_string()
            } else {
                s(srv, "domain").to_string()
            }
        } else {
            "no".to_string()
        };
        let uptime = parse_time(s(srv, "time"))
            .zip(parse_time(s(stz, "start")))
            .map(|(now, start)| dur(Duration::from_nanos((now - start).max(0) as u64)))
            .unwrap_or_default();
        t.add(vec![
            names[k].clone(),
            cluster.to_string(),
            hosts[k].clone(),
            s(srv, "ver").to_string(),
            js_cell,
            n(u(stz, "connections")),
            n(u(stz, "subscriptions")),
            len(v, "routes").to_string(),
            len(v, "gateways").to_string(),
            ibytes(u(stz, "mem")),
            format!("{:.0}", st(v, "cpu")),
            u(stz, "cores").to_string(),
            n(u(stz, "slow_consumers")),
            uptime,
            dur(Duration::from_millis((rtt.as_micros() as u64 + 500) / 1000)),
        ]);
    }
    let routes_ok = if clusters
        .values()
        .any(|(_, sizes)| sizes.iter().any(|x| *x != sizes[0]))
    {
        "X"
    } else {
        ""
    };
    t.footer(vec![
        String::new(),
        clusters.len().to_string(),
        replies.len().to_string(),
        versions_ok.into(),
        js.to_string(),
        n(conns),
        n(subs),
        routes_ok.into(),
        gws_ok.into(),
        ibytes(mem),
        String::new(),
        String::new(),
        n(slow),
        String::new(),
        String::new(),
    ]);
    print!("{}", t.render());
    if !clusters.is_empty() {
        println!();
        let mut ct = Table::new(
            "Cluster Overview",
            &[
                "Cluster",
                "Node Count",
                "Outgoing Gateways",
                "Incoming Gateways",
                "Connections",
            ],
        );
        let mut list: Vec<_> = clusters.iter().collect();
        list.sort_by_key(|(_, (c, _))| *c);
        let (mut nodes, mut total) = (0, 0);
        for (name, (c, sizes)) in list {
            nodes += sizes.len();
            total += c;
            ct.add(vec![
                name.clone(),
                sizes.len().to_string(),
                "0".into(),
                "0".into(),
                c.to_string(),
            ]);
        }
        ct.footer(vec![
            String::new(),
            nodes.to_string(),
            "0".into(),
            "0".into(),
            total.to_string(),
        ]);
        print!("{}", ct.render());
    }
    Ok(())
}

/// `$SYS.REQ.SERVER.<id>.VARZ` for a server ID, else the PING form filtered by name.
pub async fn varz(client: &Client, who: Option<&str>, timeout: Duration) -> Res<Value> {
    let who = who.unwrap_or("");
    let is_id = who.len() == 56
        && who
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit());
    let (subject, body) = if is_id {
        (format!("$SYS.REQ.SERVER.{who}.VARZ"), json!({}))
    } else {
        (
            "$SYS.REQ.SERVER.PING.VARZ".to_string(),
            if who.is_empty() {
                json!({})
            } else {
                json!({"server_name": who, "exact_match": true})
            },
        )
    };
    let replies = collect(client, &subject, &body, Some(1), false, timeout).await?;
    let Some((v, _)) = replies.into_iter().next() else {
        return Err(if who.is_empty() {
            no_results()
        } else {
            format!("no server named or with ID {who:?} answered (see `keel server list`)")
        });
    };
    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
        return Err(format!(
            "invalid response received: {}",
            s(e, "description")
        ));
    }
    match v.get("data").filter(|d| !d.is_null()) {
        Some(d) => Ok(d.clone()),
        None => Err(format!("no data received in response: {v}")),
    }
}

async fn info(client: &Client, conn: &ConnSettings, a: &InfoArgs, json_out: bool) -> Res<()> {
    let v = varz(client, a.id.as_deref(), conn.timeout).await?;
    if json_out {
        print_json(&v);
        return Ok(());
    }
    let (id, name) = (s(&v, "server_id"), s(&v, "server_name"));
    let mut c = Cols::new(if id == name {
        format!("Server information for {id}")
    } else {
        format!("Server information for {name} ({id})")
    });
    let time = |k: &str| fmt_time(s(&v, k)).trim_end_matches(" UTC").to_string();
    c.section("Process Details");
    c.row("Version", s(&v, "version"));
    c.row("Git Commit", s(&v, "git_commit"));
    c.row("Go Version", s(&v, "go"));
    c.row("Start Time", time("start"));
    c.row("Configuration Load Time", time("config_load_time"));
    c.row_if(
        !s(&v, "config_digest").is_empty(),
        "Configuration Digest",
        s(&v, "config_digest"),
    );
    c.row("Uptime", s(&v, "uptime"));
    c.section("Connection Details");
    c.row("Auth Required", b(&v, "auth_required"));
    c.row("TLS Required", b(&v, "tls_required"));
    if s(&v, "ip").is_empty() {
        c.row("Host", format!("{}:{}", s(&v, "host"), u(&v, "port")));
    } else {
        c.row(
            "Host",
            format!("{}:{} ({})", s(&v, "host"), u(&v, "port"), s(&v, "ip")),
        );
    }
    let urls = |c: &mut Cols, label: &str, key: &str| {
        for (k, url) in v[key]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .enumerate()
        {
            c.row(if k == 0 { label } else { "" }, url);
        }
    };
    urls(&mut c, "Client URLs", "connect_urls");
    urls(&mut c, "WebSocket URLs", "ws_connect_urls");
    let js = &v["jetstream"];
    let jc = &js["config"];
    if !s(jc, "store_dir").is_empty() {
        let st = &js["stats"];
        c.section("JetStream");
        c.row("Domain", s(jc, "domain"));
        c.row("API Support Level", u(&st["api"], "level"));
        c.row("Storage Directory", s(jc, "store_dir"));
        c.row("Active Accounts", u(st, "accounts"));
        c.row("Memory In Use", ibytes(u(st, "memory")));
        c.row("File In Use", ibytes(u(st, "storage")));
        c.row("API Requests", u(&st["api"], "total"));
        c.row("API Errors", u(&st["api"], "errors"));
        if i(jc, "sync_interval") > 0 {
            c.row("Always sync writes to disk", b(jc, "sync_always"));
            c.row(
                "Write sync Frequency",
                dur(Duration::from_nanos(u(jc, "sync_interval"))),
            );
        }
        c.row(
            "Maximum Memory Storage",
            ibytes(i(jc, "max_memory").max(0) as u64),
        );
        c.row(
            "Maximum File Storage",
            ibytes(i(jc, "max_storage").max(0) as u64),
        );
        c.row_if(
            !s(jc, "unique_tag").is_empty(),
            "Unique Tag",
            s(jc, "unique_tag"),
        );
        c.row("Cluster Message Compression", b(jc, "compress_ok"));
        if let Some(l) = js.get("limits").filter(|l| l.is_object()) {
            let unlimited = |x: i64| {
                if x <= 0 {
                    "unlimited".to_string()
                } else {
                    n(x as u64)
                }
            };
            c.row("Maximum HA Assets", unlimited(i(l, "max_ha_assets")));
            c.row("Maximum Ack Pending", unlimited(i(l, "max_ack_pending")));
            c.row(
                "Maximum Request Batch",
                unlimited(i(l, "max_request_batch")),
            );
            if i(l, "duplicate_window") == 0 {
                c.row("Maximum Duplicate Window", "unlimited");
            } else {
                c.row(
                    "Maximum Duplicate Window",
                    dur(Duration::from_nanos(u(l, "duplicate_window"))),
                );
            }
            c.row("Maximum Messages Per Batch", i(l, "max_request_batch"));
            c.row(
                "Maximum Batch Timeout",
                dur(Duration::from_nanos(u(l, "max_batch_timeout"))),
            );
            c.row(
                "Maximum Open Batches Per Stream",
                i(l, "max_batch_inflight_per_stream"),
            );
            c.row(
                "Maximum Open Batches Per Server",
                i(l, "max_batch_inflight_total"),
            );
        }
        c.row("Strict API Parsing", b(jc, "strict"));
    }
    c.section("Limits");
    c.row("Maximum Connections", i(&v, "max_connections"));
    c.row("Maximum Subscriptions", i(&v, "max_subscriptions"));
    c.row("Maximum Payload", ibytes(u(&v, "max_payload")));
    c.row(
        "TLS Timeout",
        dur(Duration::from_secs_f64(
            v["tls_timeout"].as_f64().unwrap_or(0.0).max(0.0),
        )),
    );
    c.row(
        "Write Deadline",
        dur(Duration::from_millis(u(&v, "write_deadline") / 1_000_000)),
    );
    c.section("Statistics");
    c.row(
        "CPU Cores",
        format!(
            "{} {:.2}%",
            u(&v, "cores"),
            v["cpu"].as_f64().unwrap_or(0.0)
        ),
    );
    c.row_if(u(&v, "gomaxprocs") > 0, "GOMAXPROCS", u(&v, "gomaxprocs"));
    c.row("Memory", ibytes(u(&v, "mem")));
    c.row("Connections", u(&v, "connections"));
    c.row("Subscriptions", u(&v, "subscriptions"));
    c.row(
        "Messages",
        format!("{} in {} out", n(u(&v, "in_msgs")), n(u(&v, "out_msgs"))),
    );
    c.row(
        "Bytes",
        format!(
            "{} in {} out",
            ibytes(u(&v, "in_bytes")),
            ibytes(u(&v, "out_bytes"))
        ),
    );
    c.row("Slow Consumers", u(&v, "slow_consumers"));
    let cl = &v["cluster"];
    if cl["urls"].as_array().is_some_and(|a| !a.is_empty()) {
        c.section("Cluster");
        c.row("Name", s(cl, "name"));
        c.row(
            "Host",
            format!("{}:{}", s(cl, "addr"), u(cl, "cluster_port")),
        );
        for (k, url) in cl["urls"].as_array().into_iter().flatten().enumerate() {
            c.row(if k == 0 { "URLs" } else { "" }, url.as_str().unwrap_or(""));
        }
    }
    print!("{}", c.render());
    println!();
    Ok(())
}

/// The request's server filter, as `nats` builds it (`EventFilterOptions`).
fn filter_opts(f: &ServerFilter, conn: &ConnSettings) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    if let Some(h) = &f.host {
        m.insert("server_name".into(), h.clone().into());
        m.insert("exact_match".into(), true.into());
    }
    if let Some(c) = &f.cluster {
        m.insert("cluster".into(), c.clone().into());
        m.insert("exact_match".into(), true.into());
    }
    // `$JS.<domain>.API` names the domain the report is about.
    if let Some(d) = conn
        .js_api_prefix
        .strip_prefix("$JS.")
        .and_then(|r| r.strip_suffix(".API"))
    {
        m.insert("domain".into(), d.into());
    }
    m
}

fn check_reply_errors(replies: &[(Value, Duration)]) -> Res<()> {
    for (v, _) in replies {
        if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
            return Err(format!(
                "invalid response received: {}",
                s(e, "description")
            ));
        }
        if v.get("data").is_none_or(Value::is_null) {
            return Err("no data received in response".into());
        }
    }
    Ok(())
}

async fn report_connections(
    client: &Client,
    conn: &ConnSettings,
    a: &ConnReportArgs,
    json_out: bool,
) -> Res<()> {
    let expect = expected(client, a.limit, conn.timeout).await?;
    let mut opts = filter_opts(&a.filter, conn);
    opts.insert("subscriptions".into(), true.into());
    opts.insert("auth".into(), true.into());
    // The reference's ConnState numbers; open is the default and is left out.
    match a.state {
        ConnState::Open => {}
        ConnState::Closed => {
            opts.insert("state".into(), 1.into());
        }
        ConnState::All => {
            opts.insert("state".into(), 2.into());
        }
    }
    if let Some(acc) = &a.account {
        opts.insert("acc".into(), acc.clone().into());
    }
    if let Some(user) = &a.username {
        opts.insert("user".into(), user.clone().into());
    }
    if let Some(subj) = &a.subject {
        opts.insert("filter_subject".into(), subj.clone().into());
    }
    const PAGE: u64 = 1024;
    opts.insert("limit".into(), PAGE.into());
    // Every server's connections, page by page while any server has more.
    let mut conns: Vec<(Value, Value)> = Vec::new();
    let mut offset = 0u64;
    let mut answered = false;
    loop {
        opts.insert("offset".into(), offset.into());
        let replies = collect(
            client,
            "$SYS.REQ.SERVER.PING.CONNZ",
            &Value::Object(opts.clone()),
            expect,
            false,
            conn.timeout,
        )
        .await?;
        check_reply_errors(&replies)?;
        answered |= !replies.is_empty();
        let mut more = false;
        for (v, _) in &replies {
            let data = &v["data"];
            for c in data["connections"].as_array().into_iter().flatten() {
                conns.push((c.clone(), v["server"].clone()));
            }
            if u(data, "offset") + u(data, "limit") < u(data, "total") {
                more = true;
            }
        }
        if !more {
            break;
        }
        offset += PAGE;
    }
    // As `nats`: servers without matching connections count as no results.
    if !answered || conns.is_empty() {
        return Err("did not get results from any servers".into());
    }
    if json_out {
        let v: Vec<Value> = conns
            .iter()
            .map(|(c, srv)| {
                let mut c = c.clone();
                if let Some(m) = c.as_object_mut() {
                    m.insert("server".into(), srv.clone());
                }
                c
            })
            .collect();
        print_json(&Value::Array(v));
        return Ok(());
    }
    let nsubs = |c: &Value| c["subscriptions_list"].as_array().map_or(0, Vec::len);
    conns.sort_by(|(x, _), (y, _)| {
        let ord = match a.sort {
            ConnSort::InBytes => u(x, "in_bytes").cmp(&u(y, "in_bytes")),
            ConnSort::OutBytes => u(x, "out_bytes").cmp(&u(y, "out_bytes")),
            ConnSort::InMsgs => u(x, "in_msgs").cmp(&u(y, "in_msgs")),
            ConnSort::OutMsgs => u(x, "out_msgs").cmp(&u(y, "out_msgs")),
            ConnSort::Uptime => parse_time(s(y, "start")).cmp(&parse_time(s(x, "start"))),
            ConnSort::Cid => u(x, "cid").cmp(&u(y, "cid")),
            ConnSort::Subs => nsubs(x).cmp(&nsubs(y)),
        };
        if a.filter.reverse {
            ord.reverse()
        } else {
            ord
        }
    });
    let total = conns.len();
    let limit = if a.top > 0 && a.top <= total {
        a.top
    } else {
        total
    };
    let sort_name = match a.sort {
        ConnSort::InBytes => "in-bytes",
        ConnSort::OutBytes => "out-bytes",
        ConnSort::InMsgs => "in-msgs",
        ConnSort::OutMsgs => "out-msgs",
        ConnSort::Uptime => "uptime",
        ConnSort::Cid => "cid",
        ConnSort::Subs => "subs",
    };
    let show_reason = a.state != ConnState::Open;
    let mut headers = vec![
        "CID",
        "Name",
        "Server",
        "Cluster",
        "IP",
        "Account",
        "Uptime",
        "In Msgs",
        "Out Msgs",
        "In Bytes",
        "Out Bytes",
        "Subs",
    ];
    if show_reason {
        headers.push("Reason");
    }
    let mut t = Table::new(
        format!(
            "Top {limit} Connections out of {} by {sort_name}",
            n(total as u64)
        ),
        &headers,
    );
    let (mut im, mut om, mut ib, mut ob, mut subs) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut per_server: Vec<(String, String, usize)> = Vec::new();
    for (k, (c, srv)) in conns.iter().enumerate() {
        im += u(c, "in_msgs");
        om += u(c, "out_msgs");
        ib += u(c, "in_bytes");
        ob += u(c, "out_bytes");
        subs += u(c, "subscriptions");
        let sname = s(srv, "name").to_string();
        match per_server.iter_mut().find(|(nm, _, _)| *nm == sname) {
            Some(e) => e.2 += 1,
            None => per_server.push((sname.clone(), s(srv, "cluster").to_string(), 1)),
        }
        if k >= limit {
            continue;
        }
        let mut name = s(c, "name").to_string();
        if name.is_empty() {
            name = s(c, "mqtt_client").to_string();
        }
        if name.chars().count() > 40 {
            name = name.chars().take(40).collect::<String>() + " ..";
        }
        let mut acc = s(c, "account").to_string();
        if acc.chars().count() > 46 {
            acc = acc.chars().take(12).collect::<String>() + " ..";
        }
        let kind = s(c, "kind");
        let cid = if kind.is_empty() || kind == "Client" {
            u(c, "cid").to_string()
        } else {
            format!("{}{}", &kind[..1], u(c, "cid"))
        };
        let mut row = vec![
            cid,
            name,
            sname,
            s(srv, "cluster").to_string(),
            format!("{}:{}", s(c, "ip"), u(c, "port")),
            acc,
            s(c, "uptime").to_string(),
            n(u(c, "in_msgs")),
            n(u(c, "out_msgs")),
            ibytes(u(c, "in_bytes")),
            ibytes(u(c, "out_bytes")),
            n(nsubs(c) as u64),
        ];
        if show_reason {
            row.push(s(c, "reason").to_string());
        }
        t.add(row);
    }
    if total > 1 {
        let mut row = vec![
            String::new(),
            format!("Totals for {} connections", n(total as u64)),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            n(im),
            n(om),
            ibytes(ib),
            ibytes(ob),
            n(subs),
        ];
        if show_reason {
            row.push(String::new());
        }
        t.footer(row);
    }
    print!("{}", t.render());
    if !per_server.is_empty() {
        println!();
        per_server.sort_by_key(|(_, _, c)| *c);
        let mut st = Table::new(
            "Connections per server",
            &["Server", "Cluster", "Connections"],
        );
        for (name, cluster, c) in per_server {
            st.add(vec![name, cluster, c.to_string()]);
        }
        print!("{}", st.render());
    }
    Ok(())
}

async fn report_jetstream(
    client: &Client,
    conn: &ConnSettings,
    a: &JsReportArgs,
    json_out: bool,
) -> Res<()> {
    let expect = expected(client, a.limit, conn.timeout).await?;
    let mut opts = filter_opts(&a.filter, conn);
    opts.insert("raft".into(), true.into());
    if let Some(acc) = &a.account {
        opts.insert("account".into(), acc.clone().into());
        opts.insert("streams".into(), true.into());
        opts.insert("consumer".into(), true.into());
        opts.insert("limit".into(), 10000.into());
    }
    let mut replies = collect(
        client,
        "$SYS.REQ.SERVER.PING.JSZ",
        &Value::Object(opts),
        expect,
        false,
        conn.timeout,
    )
    .await?;
    check_reply_errors(&replies)?;
    if replies.is_empty() {
        return Err(no_results());
    }
    if json_out {
        let v: Vec<Value> = replies.iter().map(|(v, _)| v.clone()).collect();
        print_json(&Value::Array(v));
        return Ok(());
    }
    let name = |v: &Value| s(&v["server"], "name").to_string();
    let d = |v: &Value, k: &str| u(&v["data"], k);
    replies.sort_by(|(x, _), (y, _)| {
        let ord = match a.sort {
            JsSort::Name => name(x).cmp(&name(y)),
            JsSort::Streams => d(x, "streams")
                .cmp(&d(y, "streams"))
                .then_with(|| name(x).cmp(&name(y))),
            JsSort::Consumers => d(x, "consumers")
                .cmp(&d(y, "consumers"))
                .then_with(|| name(x).cmp(&name(y))),
            JsSort::Msgs => d(x, "messages").cmp(&d(y, "messages")),
            JsSort::Mbytes => d(x, "bytes").cmp(&d(y, "bytes")),
            JsSort::Mem => d(x, "memory").cmp(&d(y, "memory")),
            JsSort::File => d(x, "storage").cmp(&d(y, "storage")),
            JsSort::Api => u(&x["data"]["api"], "total").cmp(&u(&y["data"]["api"], "total")),
            JsSort::Err => u(&x["data"]["api"], "errors").cmp(&u(&y["data"]["api"], "errors")),
            JsSort::Cluster => s(&x["server"], "cluster")
                .cmp(s(&y["server"], "cluster"))
                .then_with(|| name(x).cmp(&name(y))),
        };
        if a.filter.reverse {
            ord.reverse()
        } else {
            ord
        }
    });
    let domain = replies
        .iter()
        .any(|(v, _)| !s(&v["data"]["config"], "domain").is_empty());
    let title = match &a.account {
        Some(acc) => format!("JetStream Summary for Account {acc}"),
        None => "JetStream Summary".to_string(),
    };
    let mut headers = vec!["Server", "Cluster"];
    if domain {
        headers.push("Domain");
    }
    headers.extend([
        "Streams",
        "Consumers",
        "Messages",
        "Bytes",
        "Memory",
        "File",
        "API Req",
        "Pending",
    ]);
    let mut t = Table::new(title, &headers);
    let names: Vec<String> = replies.iter().map(|(v, _)| name(v)).collect();
    let names = if a.no_compact {
        names
    } else {
        compact_names(&names)
    };
    let (mut streams_t, mut cons_t, mut msgs_t, mut bytes_t) = (0u64, 0u64, 0u64, 0u64);
    let (mut mem_t, mut store_t, mut api_t, mut pend_t) = (0u64, 0u64, 0u64, 0u64);
    for (k, (v, _)) in replies.iter().enumerate() {
        let data = &v["data"];
        let account = a
            .account
            .as_ref()
            .and(data["account_details"].as_array())
            .filter(|l| l.len() == 1)
            .map(|l| &l[0]);
        let stats = account.unwrap_or(data);
        let (mem, store, api) = (
            u(stats, "memory"),
            u(stats, "storage"),
            u(&stats["api"], "total"),
        );
        let (rs, rc, rm, rb) = match account {
            Some(acc) => {
                let list = acc["stream_detail"].as_array().cloned().unwrap_or_default();
                (
                    list.len() as u64,
                    list.iter().map(|s| u(&s["state"], "consumer_count")).sum(),
                    list.iter().map(|s| u(&s["state"], "messages")).sum(),
                    u(acc, "memory") + u(acc, "storage"),
                )
            }
            None => (
                u(data, "streams"),
                u(data, "consumers"),
                u(data, "messages"),
                u(data, "bytes"),
            ),
        };
        let meta = &data["meta_cluster"];
        let leader = if !meta.is_null() && s(meta, "leader") == name(v) {
            "*"
        } else {
            ""
        };
        let pending = u(meta, "pending");
        streams_t += rs;
        cons_t += rc;
        msgs_t += rm;
        bytes_t += rb;
        mem_t += mem;
        store_t += store;
        api_t += api;
        pend_t += pending;
        let mut row = vec![
            format!("{}{leader}", names[k]),
            s(&v["server"], "cluster").to_string(),
        ];
        if domain {
            row.push(s(&data["config"], "domain").to_string());
        }
        row.extend([
            n(rs),
            n(rc),
            n(rm),
            ibytes(rb),
            ibytes(mem),
            ibytes(store),
            n(api),
            pending.to_string(),
        ]);
        t.add(row);
    }
    let mut row = vec![String::new(), String::new()];
    if domain {
        row.push(String::new());
    }
    row.extend([
        n(streams_t),
        n(cons_t),
        n(msgs_t),
        ibytes(bytes_t),
        ibytes(mem_t),
        ibytes(store_t),
        n(api_t),
        pend_t.to_string(),
    ]);
    t.footer(row);
    print!("{}", t.render());
    println!();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        assert_eq!(go_dur(Duration::ZERO), "0s");
        assert_eq!(go_dur(Duration::from_nanos(850)), "850ns");
        assert_eq!(go_dur(Duration::from_micros(107)), "107µs");
        assert_eq!(go_dur(Duration::from_nanos(1_234_567)), "1.234567ms");
        assert_eq!(go_dur(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_dur(Duration::from_millis(123_500)), "2m3.5s");
        assert_eq!(go_dur(Duration::from_secs(3600)), "1h0m0s");
    }

    #[test]
    fn names_are_compacted_as_nats_does() {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            compact_names(&v(&["n1.example.net", "n2.example.net"])),
            v(&["n1", "n2"])
        );
        assert_eq!(
            compact_names(&v(&["n1.a.net", "n2.b.net"])),
            v(&["n1.a", "n2.b"])
        );
        assert_eq!(compact_names(&v(&["NABC", "NDEF"])), v(&["NABC", "NDEF"]));
        assert_eq!(compact_names(&v(&["127.0.0.1"])), v(&["127"]));
    }
}
