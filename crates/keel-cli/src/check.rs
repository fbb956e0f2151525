//! `keel server check ...`: health checks as monitoring systems call them, with the
//! `nats` CLI's checks, thresholds and output (`OK|WARNING|CRITICAL|UNKNOWN <name> ... |
//! <perfdata>`) and Nagios exit codes (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN).

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, Subcommand, ValueEnum};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::js::Js;
use crate::output::{b, i, now_ns, parse_time, s, u};
use crate::server::go_dur;
use crate::util::{parse_duration, ConnSettings, Res};

/// The process exit code a check asks for (`main` uses it when the command succeeds).
pub static EXIT_CODE: AtomicU8 = AtomicU8::new(0);

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum Format {
    Nagios,
    Json,
    Text,
}

#[derive(Args, Debug)]
pub struct CheckFlags {
    /// Render the check in a specific format
    #[arg(long, value_enum, default_value = "nagios", global = true)]
    format: Format,
    /// Save output to a file rather than STDOUT
    #[arg(long, global = true, value_name = "FILE")]
    outfile: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    flags: CheckFlags,
    #[command(subcommand)]
    cmd: CheckCmd,
}

#[derive(Subcommand, Debug)]
pub enum CheckCmd {
    /// Checks basic server connection
    #[command(visible_alias = "conn")]
    Connection(ConnCheck),
    /// Checks the health of mirrored streams, streams with sources or clustered streams
    Stream(StreamCheck),
    /// Checks the health of a consumer
    Consumer(ConsumerCheck),
    /// Check JetStream account state
    #[command(visible_alias = "js")]
    Jetstream(JsCheck),
    /// Checks a NATS Server health
    Server(ServerCheck),
    /// Checks a NATS KV Bucket
    Kv(KvCheck),
}

fn dur_arg(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

#[derive(Args, Debug)]
pub struct ConnCheck {
    /// Warning threshold to allow for establishing connections
    #[arg(long, default_value = "500ms", value_parser = dur_arg)]
    connect_warn: Duration,
    /// Critical threshold to allow for establishing connections
    #[arg(long, default_value = "1s", value_parser = dur_arg)]
    connect_critical: Duration,
    /// Warning threshold to allow for server RTT
    #[arg(long, default_value = "500ms", value_parser = dur_arg)]
    rtt_warn: Duration,
    /// Critical threshold to allow for server RTT
    #[arg(long, default_value = "1s", value_parser = dur_arg)]
    rtt_critical: Duration,
    /// Warning threshold to allow for full round trip test
    #[arg(long, default_value = "500ms", value_parser = dur_arg)]
    req_warn: Duration,
    /// Critical threshold to allow for full round trip test
    #[arg(long, default_value = "1s", value_parser = dur_arg)]
    req_critical: Duration,
}

#[derive(Args, Debug)]
pub struct StreamCheck {
    /// The stream to check
    #[arg(long)]
    stream: String,
    /// Critical threshold to allow for lag on any source or mirror
    #[arg(long, value_name = "MSGS")]
    lag_critical: Option<u64>,
    /// Critical threshold for how long ago the source or mirror should have been seen
    #[arg(long, value_name = "DURATION", value_parser = dur_arg)]
    seen_critical: Option<Duration>,
    /// Minimum number of sources to expect
    #[arg(long, value_name = "SOURCES")]
    min_sources: Option<i64>,
    /// Maximum number of sources to expect
    #[arg(long, value_name = "SOURCES")]
    max_sources: Option<i64>,
    /// Number of cluster replicas to expect
    #[arg(long, value_name = "SERVERS")]
    peer_expect: Option<i64>,
    /// Warn if there are fewer than this many messages in the stream
    #[arg(long, value_name = "MSGS")]
    msgs_warn: Option<u64>,
    /// Critical if there are fewer than this many messages in the stream
    #[arg(long, value_name = "MSGS")]
    msgs_critical: Option<u64>,
    /// Warning threshold for subjects in the stream
    #[arg(long, value_name = "SUBJECTS")]
    subjects_warn: Option<i64>,
    /// Critical threshold for subjects in the stream
    #[arg(long, value_name = "SUBJECTS")]
    subjects_critical: Option<i64>,
}

#[derive(Args, Debug)]
pub struct ConsumerCheck {
    /// The stream to check
    #[arg(long)]
    stream: String,
    /// The consumer to check
    #[arg(long)]
    consumer: String,
    /// Maximum number of outstanding acks to allow
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    outstanding_ack_critical: i64,
    /// Maximum number of waiting pulls to allow
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    waiting_critical: i64,
    /// Maximum number of unprocessed messages to allow
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    unprocessed_critical: i64,
    /// Time to allow since the last delivery
    #[arg(long, default_value = "0s", value_parser = dur_arg)]
    last_delivery_critical: Duration,
    /// Time to allow since the last ack
    #[arg(long, default_value = "0s", value_parser = dur_arg)]
    last_ack_critical: Duration,
    /// Maximum number of redeliveries to allow
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    redelivery_critical: i64,
}

#[derive(Args, Debug)]
pub struct JsCheck {
    /// Warning threshold for memory storage, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = 75)]
    mem_warn: i64,
    /// Critical threshold for memory storage, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = 90)]
    mem_critical: i64,
    /// Warning threshold for disk storage, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = 75)]
    store_warn: i64,
    /// Critical threshold for disk storage, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = 90)]
    store_critical: i64,
    /// Warning threshold for number of streams used, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    streams_warn: i64,
    /// Critical threshold for number of streams used, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    streams_critical: i64,
    /// Warning threshold for number of consumers used, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    consumers_warn: i64,
    /// Critical threshold for number of consumers used, in percent of limit
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    consumers_critical: i64,
    /// Checks if all streams have healthy replicas (--replicas=false to skip)
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    replicas: bool,
    /// Critical threshold for when a stream replica should have been seen, as a duration
    #[arg(long, default_value = "5s", value_parser = dur_arg)]
    replica_seen_critical: Duration,
    /// Critical threshold for how many operations behind a peer can be
    #[arg(long, default_value_t = 200)]
    replica_lag_critical: u64,
}

#[derive(Args, Debug)]
pub struct ServerCheck {
    /// Server name to require in the result
    #[arg(long)]
    name: String,
    /// Warning threshold for CPU usage, in percent
    #[arg(long, default_value_t = 0)]
    cpu_warn: i64,
    /// Critical threshold for CPU usage, in percent
    #[arg(long, default_value_t = 0)]
    cpu_critical: i64,
    /// Warning threshold for Memory usage, in bytes
    #[arg(long, default_value_t = 0)]
    mem_warn: i64,
    /// Critical threshold Memory usage, in bytes
    #[arg(long, default_value_t = 0)]
    mem_critical: i64,
    /// Warning threshold for connections, supports inversion
    #[arg(long, default_value_t = 0)]
    conn_warn: i64,
    /// Critical threshold for connections, supports inversion
    #[arg(long, default_value_t = 0)]
    conn_critical: i64,
    /// Warning threshold for number of active subscriptions, supports inversion
    #[arg(long, default_value_t = 0)]
    subs_warn: i64,
    /// Critical threshold for number of active subscriptions, supports inversion
    #[arg(long, default_value_t = 0)]
    subs_critical: i64,
    /// Warning threshold for server uptime as duration
    #[arg(long, value_parser = dur_arg)]
    uptime_warn: Option<Duration>,
    /// Critical threshold for server uptime as duration
    #[arg(long, value_parser = dur_arg)]
    uptime_critical: Option<Duration>,
    /// Checks that authentication is enabled
    #[arg(long)]
    auth_required: bool,
    /// Checks that TLS is required
    #[arg(long)]
    tls_required: bool,
    /// Checks that JetStream is enabled
    #[arg(long)]
    js_required: bool,
}

#[derive(Args, Debug)]
pub struct KvCheck {
    /// Checks a specific bucket
    #[arg(long)]
    bucket: String,
    /// Critical threshold for number of values in the bucket
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    values_critical: i64,
    /// Warning threshold for number of values in the bucket
    #[arg(long, allow_hyphen_values = true, default_value_t = -1)]
    values_warn: i64,
    /// Requires a key to have any non-delete value set
    #[arg(long)]
    key: Option<String>,
}

/// One perfdata item: `name=value[unit][;warn[;crit]]`.
struct Perf {
    name: &'static str,
    value: f64,
    warn: f64,
    crit: f64,
    unit: &'static str,
}

impl Perf {
    fn new(name: &'static str, value: f64, warn: f64, crit: f64, unit: &'static str) -> Perf {
        Perf {
            name,
            value,
            warn,
            crit,
            unit,
        }
    }

    fn render(&self) -> String {
        let f = |v: f64| {
            if self.unit == "s" {
                format!("{v:.4}")
            } else {
                format!("{v:.0}")
            }
        };
        let mut out = format!("{}={}{}", self.name, f(self.value), self.unit);
        if self.warn != 0.0 || self.crit != 0.0 {
            if self.warn != 0.0 {
                out += &format!(";{}", f(self.warn));
            } else {
                out.push(';');
            }
            if self.crit != 0.0 {
                out += &format!(";{}", f(self.crit));
            }
        }
        out
    }
}

/// A check's findings, rendered as `nats server check` renders them.
struct Check {
    name: String,
    suite: &'static str,
    oks: Vec<String>,
    warnings: Vec<String>,
    criticals: Vec<String>,
    perf: Vec<Perf>,
}

impl Check {
    fn new(name: impl Into<String>, suite: &'static str) -> Check {
        Check {
            name: name.into(),
            suite,
            oks: Vec::new(),
            warnings: Vec::new(),
            criticals: Vec::new(),
            perf: Vec::new(),
        }
    }
    fn ok(&mut self, m: impl Into<String>) {
        self.oks.push(m.into());
    }
    fn warn(&mut self, m: impl Into<String>) {
        self.warnings.push(m.into());
    }
    fn crit(&mut self, m: impl Into<String>) {
        self.criticals.push(m.into());
    }
    fn pd(&mut self, p: Perf) {
        self.perf.push(p);
    }

    fn status(&self) -> (&'static str, u8) {
        if !self.criticals.is_empty() {
            ("CRITICAL", 2)
        } else if !self.warnings.is_empty() {
            ("WARNING", 1)
        } else {
            ("OK", 0)
        }
    }

    fn render(&self, format: Format) -> String {
        let (status, _) = self.status();
        match format {
            Format::Nagios => {
                let mut parts = vec![self.name.clone()];
                parts.extend(self.criticals.iter().map(|c| format!("Crit:{c}")));
                parts.extend(self.warnings.iter().map(|w| format!("Warn:{w}")));
                parts.extend(self.oks.iter().map(|o| format!("OK:{o}")));
                let text = format!("{status} {}", parts.join(" "));
                if self.perf.is_empty() {
                    format!("{text}\n")
                } else {
                    let pd: Vec<String> = self.perf.iter().map(Perf::render).collect();
                    format!("{text} | {}\n", pd.join(" "))
                }
            }
            Format::Json => {
                let mut v = json!({"status": status, "check_suite": self.suite,
                                   "check_name": self.name});
                let list = |l: &[String]| Value::from(l.to_vec());
                if !self.warnings.is_empty() {
                    v["warning"] = list(&self.warnings);
                }
                if !self.criticals.is_empty() {
                    v["critical"] = list(&self.criticals);
                }
                if !self.oks.is_empty() {
                    v["ok"] = list(&self.oks);
                }
                v["perf_data"] = self
                    .perf
                    .iter()
                    .map(|p| {
                        let mut o = json!({"name": p.name, "value": p.value,
                                           "warning": p.warn, "critical": p.crit});
                        if !p.unit.is_empty() {
                            o["unit"] = p.unit.into();
                        }
                        o
                    })
                    .collect::<Vec<_>>()
                    .into();
                format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_default())
            }
            Format::Text => {
                let mut out = format!("{}: {status}\n\n", self.name);
                let mut t = crate::output::Table::new("", &["Status", "Message"]);
                for o in &self.oks {
                    t.add(vec!["OK".into(), o.clone()]);
                }
                for w in &self.warnings {
                    t.add(vec!["Warning".into(), w.clone()]);
                }
                for c in &self.criticals {
                    t.add(vec!["Critical".into(), c.clone()]);
                }
                if !(self.oks.is_empty() && self.warnings.is_empty() && self.criticals.is_empty()) {
                    out += "Status Detail\n\n";
                    out += t.render().trim_start_matches([' ', '\n']);
                    out.push('\n');
                }
                if !self.perf.is_empty() {
                    let mut t = crate::output::Table::new(
                        "",
                        &[
                            "Metric",
                            "Value",
                            "Unit",
                            "Critical Threshold",
                            "Warning Threshold",
                        ],
                    );
                    for p in &self.perf {
                        t.add(vec![
                            p.name.to_string(),
                            num(p.value),
                            p.unit.to_string(),
                            num(p.crit),
                            num(p.warn),
                        ]);
                    }
                    out += "\nCheck Metrics\n\n";
                    out += t.render().trim_start_matches([' ', '\n']);
                    out.push('\n');
                }
                out
            }
        }
    }
}

fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        crate::output::n(v.abs() as u64).to_string()
    } else {
        format!("{v:.3}")
    }
}

/// Runs a check; `--json` (global) means `--format json`.
pub async fn run(conn: &ConnSettings, args: &CheckArgs, json_out: bool) -> Res<()> {
    let check = match &args.cmd {
        CheckCmd::Connection(a) => connection(conn, a).await,
        CheckCmd::Stream(a) => stream(conn, a).await,
        CheckCmd::Consumer(a) => consumer(conn, a).await,
        CheckCmd::Jetstream(a) => jetstream(conn, a).await,
        CheckCmd::Server(a) => server(conn, a).await,
        CheckCmd::Kv(a) => kv(conn, a).await,
    };
    let flags = &args.flags;
    let format = if json_out { Format::Json } else { flags.format };
    let text = check.render(format);
    match &flags.outfile {
        Some(path) => std::fs::write(path, &text)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?,
        None => print!("{text}"),
    }
    EXIT_CODE.store(check.status().1, Ordering::Relaxed);
    Ok(())
}

async fn connection(conn: &ConnSettings, a: &ConnCheck) -> Check {
    let mut c = Check::new("Connection", "connections");
    let started = Instant::now();
    let client = match conn.connect().await {
        Ok(cl) => cl,
        Err(e) => {
            c.crit(format!("connection failed: {e}"));
            return c;
        }
    };
    let ct = started.elapsed();
    let url = crate::util::redact(&conn.server);
    c.pd(Perf::new(
        "connect_time",
        ct.as_secs_f64(),
        a.connect_warn.as_secs_f64(),
        a.connect_critical.as_secs_f64(),
        "s",
    ));
    if !a.connect_critical.is_zero() && ct >= a.connect_critical {
        c.crit(format!(
            "connected to {url}, connect time exceeded {}",
            a.connect_critical.as_secs_f64()
        ));
    } else if !a.connect_warn.is_zero() && ct >= a.connect_warn {
        c.warn(format!(
            "connected to {url}, connect time exceeded {}",
            a.connect_warn.as_secs_f64()
        ));
    } else {
        c.ok(format!("connected to {url} in {}", go_dur(ct)));
    }
    // A flush is a PING answered by the server's PONG: the connection's RTT.
    let t0 = Instant::now();
    if let Err(e) = tokio::time::timeout(conn.timeout, client.flush()).await {
        c.crit(format!("rtt failed: {e}"));
        return c;
    }
    let rtt = t0.elapsed();
    c.pd(Perf::new(
        "rtt",
        rtt.as_secs_f64(),
        a.rtt_warn.as_secs_f64(),
        a.rtt_critical.as_secs_f64(),
        "s",
    ));
    if !a.rtt_critical.is_zero() && rtt >= a.rtt_critical {
        c.crit(format!(
            "rtt time exceeded {}",
            a.rtt_critical.as_secs_f64()
        ));
    } else if !a.rtt_warn.is_zero() && rtt >= a.rtt_warn {
        c.warn(format!("rtt time exceeded {}", a.rtt_warn.as_secs_f64()));
    } else {
        c.ok(format!("rtt time {}", go_dur(rtt)));
    }
    // A message through the server to ourselves.
    let body: String = {
        let seed = now_ns() as u64;
        (0..100)
            .map(|k| {
                let x = seed
                    .wrapping_add(k)
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (b'a' + (x >> 59) as u8 % 26) as char
            })
            .collect()
    };
    let inbox = client.new_inbox();
    let mut sub = match client.subscribe(inbox.clone()).await {
        Ok(s) => s,
        Err(e) => {
            c.crit(format!("could not subscribe to {inbox}: {e}"));
            return c;
        }
    };
    let start = Instant::now();
    if let Err(e) = client
        .publish(inbox.clone(), Bytes::from(body.clone()))
        .await
    {
        c.crit(format!("could not publish to {inbox}: {e}"));
        return c;
    }
    let received = match tokio::time::timeout(conn.timeout, sub.next()).await {
        Ok(Some(m)) => m,
        Ok(None) => {
            c.crit(format!("did not receive from {inbox}: connection closed"));
            return c;
        }
        Err(_) => {
            c.crit(format!("did not receive from {inbox}: nats: timeout"));
            return c;
        }
    };
    let reqt = start.elapsed();
    c.pd(Perf::new(
        "request_time",
        reqt.as_secs_f64(),
        a.req_warn.as_secs_f64(),
        a.req_critical.as_secs_f64(),
        "s",
    ));
    if received.payload.as_ref() != body.as_bytes() {
        c.crit("did not receive expected message");
    }
    if !a.req_critical.is_zero() && reqt >= a.req_critical {
        c.crit(format!("round trip request took {:.6}", reqt.as_secs_f64()));
    } else if !a.req_warn.is_zero() && reqt >= a.req_warn {
        c.warn(format!("round trip request took {:.6}", reqt.as_secs_f64()));
    } else {
        c.ok(format!("round trip took {:.6}s", reqt.as_secs_f64()));
    }
    c
}

/// Connects for a JetStream check; a failure is the check's critical finding.
async fn js_for(conn: &ConnSettings, c: &mut Check, what: &str) -> Option<Js> {
    let client = match conn.connect().await {
        Ok(cl) => cl,
        Err(e) => {
            c.crit(format!("{what}: {e}"));
            return None;
        }
    };
    Some(Js::from_client(client, conn))
}

async fn stream(conn: &ConnSettings, a: &StreamCheck) -> Check {
    let mut c = Check::new(a.stream.clone(), "stream");
    let Some(js) = js_for(conn, &mut c, "could not load info").await else {
        return c;
    };
    let info = match js.api(&format!("STREAM.INFO.{}", a.stream), None).await {
        Ok(v) => v,
        Err(e) => {
            c.crit(format!("could not load info: {}", String::from(e)));
            return c;
        }
    };
    // Thresholds from the stream's metadata, unless given as flags (as `nats`).
    let meta = &info["config"]["metadata"];
    let meta_num = |k: &str| s(meta, &format!("io.nats.monitor.{k}")).parse::<i64>().ok();
    let lag_crit = a
        .lag_critical
        .map(|v| v as i64)
        .or_else(|| meta_num("lag-critical"))
        .unwrap_or(0);
    let seen_crit = a
        .seen_critical
        .or_else(|| parse_duration(s(meta, "io.nats.monitor.seen-critical")).ok())
        .map_or(0.0, |d| d.as_secs_f64());
    let min_sources = a
        .min_sources
        .or_else(|| meta_num("min-sources"))
        .unwrap_or(0);
    let max_sources = a
        .max_sources
        .or_else(|| meta_num("max-sources"))
        .unwrap_or(0);
    let peer_expect = a
        .peer_expect
        .or_else(|| meta_num("peer-expect"))
        .unwrap_or(0);
    let msgs_warn = a
        .msgs_warn
        .map(|v| v as i64)
        .or_else(|| meta_num("msgs-warn"))
        .unwrap_or(0);
    let msgs_crit = a
        .msgs_critical
        .map(|v| v as i64)
        .or_else(|| meta_num("msgs-critical"))
        .unwrap_or(0);
    let subj_warn = a
        .subjects_warn
        .or_else(|| meta_num("subjects-warn"))
        .unwrap_or(0);
    let subj_crit = a
        .subjects_critical
        .or_else(|| meta_num("subjects-critical"))
        .unwrap_or(0);
    let cfg = &info["config"];
    let state = &info["state"];
    let replicas = i(cfg, "num_replicas");

    // Cluster: a single server's streams are not clustered.
    let cluster = &info["cluster"];
    if replicas > 1 || peer_expect > 0 {
        if replicas <= 1 || cluster.is_null() {
            c.crit("Stream is not clustered");
        } else if s(cluster, "leader").is_empty() {
            c.crit("No leader");
        } else {
            let peers = cluster["replicas"].as_array().map_or(0, Vec::len) as i64 + 1;
            if peer_expect > 0 && peers != peer_expect {
                c.crit(format!("Expected {peer_expect} replicas got {peers}"));
            } else {
                c.ok(format!("{peers} peers"));
            }
        }
    }
    // Messages: fewer than the thresholds is bad.
    if msgs_crit > 0 || msgs_warn > 0 {
        let m = u(state, "messages") as i64;
        c.pd(Perf::new(
            "messages",
            m as f64,
            msgs_warn as f64,
            msgs_crit as f64,
            "",
        ));
        if msgs_crit > 0 && m <= msgs_crit {
            c.crit(format!("{m} messages"));
        } else if msgs_warn > 0 && m <= msgs_warn {
            c.warn(format!("{m} messages"));
        } else {
            c.ok(format!("{m} messages"));
        }
    }
    // Subjects: critical below warn inverts the check.
    if subj_warn > 0 || subj_crit > 0 {
        let ns = u(state, "num_subjects") as i64;
        let lt = subj_warn < subj_crit;
        c.pd(Perf::new(
            "subjects",
            ns as f64,
            subj_warn as f64,
            subj_crit as f64,
            "",
        ));
        if lt && ns >= subj_crit {
            c.crit(format!("{ns} subjects"));
        } else if lt && ns >= subj_warn {
            c.warn(format!("{ns} subjects"));
        } else if !lt && ns <= subj_crit {
            c.crit(format!("{ns} subjects"));
        } else if !lt && ns <= subj_warn {
            c.warn(format!("{ns} subjects"));
        } else {
            c.ok(format!("{ns} subjects"));
        }
    }
    // Sources.
    let sources = info["sources"].as_array().cloned().unwrap_or_default();
    let count = sources.len() as i64;
    c.pd(Perf::new(
        "sources",
        count as f64,
        min_sources as f64,
        max_sources as f64,
        "",
    ));
    if (min_sources > 0 && count < min_sources) || (max_sources > 0 && count > max_sources) {
        c.crit(format!("{count} sources"));
    } else {
        c.ok(format!("{count} sources"));
    }
    let active_secs = |v: &Value| i(v, "active") as f64 / 1e9;
    if lag_crit > 0 || seen_crit > 0.0 {
        let lagged = sources
            .iter()
            .filter(|s| lag_crit > 0 && i(s, "lag") >= lag_crit)
            .count();
        let inactive = sources
            .iter()
            .filter(|s| seen_crit > 0.0 && active_secs(s) >= seen_crit)
            .count();
        c.pd(Perf::new("sources_lagged", lagged as f64, 0.0, 0.0, ""));
        c.pd(Perf::new("sources_inactive", inactive as f64, 0.0, 0.0, ""));
        if lagged > 0 {
            c.crit(format!("{lagged} sources are lagged"));
        } else {
            c.ok(format!("{count} sources current"));
        }
        if inactive > 0 {
            c.crit(format!("{inactive} sources are inactive"));
        } else {
            c.ok(format!("{count} sources active"));
        }
        // Mirror (exclusive with sources).
        if sources.is_empty() {
            let mirror = &info["mirror"];
            if cfg["mirror"].is_null() {
                c.crit("not mirrored");
            } else if mirror.is_null() {
                c.crit("invalid state");
            } else {
                c.pd(Perf::new(
                    "lag",
                    i(mirror, "lag") as f64,
                    0.0,
                    lag_crit as f64,
                    "",
                ));
                c.pd(Perf::new(
                    "active",
                    active_secs(mirror),
                    0.0,
                    seen_crit,
                    "s",
                ));
                let mut ok = true;
                if lag_crit > 0 && i(mirror, "lag") >= lag_crit {
                    c.crit(format!("Mirror Lag {}", i(mirror, "lag")));
                    ok = false;
                }
                if seen_crit > 0.0 && active_secs(mirror) >= seen_crit {
                    c.crit(format!(
                        "Mirror Seen {}",
                        go_dur(Duration::from_nanos(i(mirror, "active").max(0) as u64))
                    ));
                    ok = false;
                }
                if ok {
                    c.ok(format!("Mirror {}", s(&cfg["mirror"], "name")));
                }
            }
        }
    }
    c
}

async fn consumer(conn: &ConnSettings, a: &ConsumerCheck) -> Check {
    let mut c = Check::new(format!("{}_{}", a.stream, a.consumer), "consumer");
    let Some(js) = js_for(conn, &mut c, "could not load info").await else {
        return c;
    };
    let info = match js
        .api(&format!("CONSUMER.INFO.{}.{}", a.stream, a.consumer), None)
        .await
    {
        Ok(v) => v,
        Err(e) => {
            c.crit(format!("could not load info: {}", String::from(e)));
            return c;
        }
    };
    let meta = &info["config"]["metadata"];
    let meta_num = |k: &str| s(meta, &format!("io.nats.monitor.{k}")).parse::<i64>().ok();
    let pick = |flag: i64, key: &str| {
        if flag >= 0 {
            flag
        } else {
            meta_num(key).unwrap_or(-1)
        }
    };
    let ack_crit = pick(a.outstanding_ack_critical, "outstanding-ack-critical");
    let wait_crit = pick(a.waiting_critical, "waiting-critical");
    let unproc_crit = pick(a.unprocessed_critical, "unprocessed-critical");
    let redel_crit = pick(a.redelivery_critical, "redelivery-critical");
    let meta_dur = |k: &str| {
        parse_duration(s(meta, &format!("io.nats.monitor.{k}"))).map_or(0.0, |d| d.as_secs_f64())
    };
    let last_del_crit = if a.last_delivery_critical.is_zero() {
        meta_dur("last-delivery-critical")
    } else {
        a.last_delivery_critical.as_secs_f64()
    };
    let last_ack_crit = if a.last_ack_critical.is_zero() {
        meta_dur("last-ack-critical")
    } else {
        a.last_ack_critical.as_secs_f64()
    };
    let ack_pending = u(&info, "num_ack_pending") as i64;
    let waiting = u(&info, "num_waiting") as i64;
    let pending = u(&info, "num_pending") as i64;
    let redelivered = u(&info, "num_redelivered") as i64;
    for (name, value, crit) in [
        ("ack_pending", ack_pending, ack_crit),
        ("pull_waiting", waiting, wait_crit),
        ("pending", pending, unproc_crit),
        ("redelivered", redelivered, redel_crit),
    ] {
        c.pd(Perf::new(name, value as f64, 0.0, crit.max(0) as f64, ""));
    }
    let now = now_ns();
    let since = |v: &Value| {
        v.get("last_active")
            .and_then(Value::as_str)
            .and_then(parse_time)
            .map(|t| Duration::from_nanos((now - t).max(0) as u64))
    };
    let last_delivery = since(&info["delivered"]);
    let last_ack = since(&info["ack_floor"]);
    if let Some(d) = last_delivery {
        c.pd(Perf::new(
            "last_delivery",
            d.as_secs_f64(),
            0.0,
            last_del_crit,
            "s",
        ));
    }
    if let Some(d) = last_ack {
        c.pd(Perf::new(
            "last_ack",
            d.as_secs_f64(),
            0.0,
            last_ack_crit,
            "s",
        ));
    }
    let mut threshold = |crit: i64, value: i64, label: &str| {
        if crit <= 0 {
        } else if value >= crit {
            c.crit(format!("{label}: {value}"));
        } else {
            c.ok(format!("{label}: {value}"));
        }
    };
    threshold(ack_crit, ack_pending, "Ack Pending");
    threshold(wait_crit, waiting, "Waiting Pulls");
    threshold(unproc_crit, pending, "Unprocessed Messages");
    threshold(redel_crit, redelivered, "Redelivered");
    let last_time = |v: &Value| crate::output::fmt_time(s(v, "last_active"));
    if last_del_crit > 0.0 {
        match last_delivery {
            None => c.crit("No deliveries"),
            Some(d) if d.as_secs_f64() >= last_del_crit => {
                c.crit(format!("Last delivery {} ago", go_dur(d)))
            }
            Some(_) => c.ok(format!("Last delivery {}", last_time(&info["delivered"]))),
        }
    }
    if last_ack_crit > 0.0 {
        match last_ack {
            None => c.crit("No acks"),
            Some(d) if d.as_secs_f64() >= last_ack_crit => {
                c.crit(format!("Last ack {} ago", go_dur(d)))
            }
            Some(_) => c.ok(format!("Last ack {}", last_time(&info["ack_floor"]))),
        }
    }
    c
}

async fn jetstream(conn: &ConnSettings, a: &JsCheck) -> Check {
    let mut c = Check::new("JetStream", "jetstream");
    let Some(js) = js_for(conn, &mut c, "connection failed").await else {
        return c;
    };
    let info = match js.api("INFO", None).await {
        Ok(v) => v,
        Err(e) => {
            c.crit(format!("JetStream not available: {}", String::from(e)));
            return c;
        }
    };
    let limits = &info["limits"];
    let mut check_val = |item: &'static str,
                         pct_name: &'static str,
                         unit: &'static str,
                         warn: i64,
                         crit: i64,
                         max: i64,
                         current: u64| {
        let pct = if max > 0 {
            (current as f64 / max as f64 * 100.0) as i64
        } else {
            0
        };
        c.pd(Perf::new(item, current as f64, 0.0, 0.0, unit));
        c.pd(Perf::new(
            pct_name,
            pct as f64,
            warn.max(0) as f64,
            crit.max(0) as f64,
            "%",
        ));
        if warn != -1 && crit != -1 && warn >= crit {
            c.crit(format!("{item}: invalid thresholds"));
            return;
        }
        if pct > 100 {
            c.crit(format!("{item}: exceed server limits"));
            return;
        }
        if warn >= 0 && crit >= 0 {
            if pct > crit {
                c.crit(format!("{pct}% {item}"));
            } else if pct > warn {
                c.warn(format!("{pct}% {item}"));
            }
        }
    };
    check_val(
        "memory",
        "memory_pct",
        "B",
        a.mem_warn,
        a.mem_critical,
        i(limits, "max_memory"),
        u(&info, "memory"),
    );
    check_val(
        "storage",
        "storage_pct",
        "B",
        a.store_warn,
        a.store_critical,
        i(limits, "max_storage"),
        u(&info, "storage"),
    );
    check_val(
        "streams",
        "streams_pct",
        "",
        a.streams_warn,
        a.streams_critical,
        i(limits, "max_streams"),
        u(&info, "streams"),
    );
    check_val(
        "consumers",
        "consumers_pct",
        "",
        a.consumers_warn,
        a.consumers_critical,
        i(limits, "max_consumers"),
        u(&info, "consumers"),
    );
    if a.replicas {
        let infos = match js.paged("STREAM.LIST", "streams", json!({})).await {
            Ok(v) => v,
            Err(e) => {
                c.crit(format!("JetStream not available: {}", String::from(e)));
                return c;
            }
        };
        let (mut ok, mut no_leader, mut missing, mut fail, mut lagged, mut unseen) =
            (0, 0, 0, 0, 0, 0);
        let seen_crit = a.replica_seen_critical.as_nanos() as i64;
        for nfo in &infos {
            let replicas = i(&nfo["config"], "num_replicas").max(1);
            let cluster = &nfo["cluster"];
            if replicas == 1 {
                ok += 1;
            } else if cluster.is_null() {
                fail += 1;
            } else if s(cluster, "leader").is_empty() {
                no_leader += 1;
            } else {
                let peers = cluster["replicas"].as_array().cloned().unwrap_or_default();
                if peers.len() as i64 != replicas - 1 {
                    missing += 1;
                    continue;
                }
                let mut good = true;
                for r in &peers {
                    if b(r, "offline") {
                        fail += 1;
                        good = false;
                    } else if seen_crit > 0 && i(r, "active") > seen_crit {
                        unseen += 1;
                        good = false;
                    } else if a.replica_lag_critical > 0 && u(r, "lag") > a.replica_lag_critical {
                        lagged += 1;
                        good = false;
                    }
                }
                if good {
                    ok += 1;
                }
            }
        }
        c.pd(Perf::new("replicas_ok", ok as f64, 0.0, 0.0, ""));
        c.pd(Perf::new(
            "replicas_no_leader",
            no_leader as f64,
            0.0,
            0.0,
            "",
        ));
        c.pd(Perf::new(
            "replicas_missing_replicas",
            missing as f64,
            0.0,
            0.0,
            "",
        ));
        c.pd(Perf::new(
            "replicas_lagged",
            lagged as f64,
            0.0,
            a.replica_lag_critical as f64,
            "",
        ));
        c.pd(Perf::new(
            "replicas_not_seen",
            unseen as f64,
            0.0,
            a.replica_seen_critical.as_secs_f64(),
            "s",
        ));
        c.pd(Perf::new("replicas_fail", fail as f64, 0.0, 0.0, ""));
        let unhealthy = fail + missing + no_leader + unseen + lagged;
        if unhealthy > 0 {
            c.crit(format!("{unhealthy} unhealthy streams"));
        }
    }
    c
}

async fn server(conn: &ConnSettings, a: &ServerCheck) -> Check {
    let mut c = Check::new(a.name.clone(), "server");
    let client = match conn.connect().await {
        Ok(cl) => cl,
        Err(e) => {
            c.crit(format!("connection failed: {e}"));
            return c;
        }
    };
    let vz = match crate::server::varz(&client, Some(&a.name), conn.timeout).await {
        Ok(v) => v,
        Err(e) => {
            c.crit(format!("varz failed: {e}"));
            return c;
        }
    };
    if s(&vz, "server_name") != a.name {
        c.crit(format!(
            "result from wrong server {:?}",
            s(&vz, "server_name")
        ));
        return c;
    }
    if a.js_required {
        if vz["jetstream"]["config"].is_null() {
            c.crit("JetStream not enabled");
        } else {
            c.ok("JetStream enabled");
        }
    }
    if a.tls_required {
        if b(&vz, "tls_required") {
            c.ok("TLS required");
        } else {
            c.crit("TLS not required");
        }
    }
    if a.auth_required {
        if b(&vz, "auth_required") {
            c.ok("Authentication required");
        } else {
            c.crit("Authentication not required");
        }
    }
    let up = parse_time(s(&vz, "now"))
        .zip(parse_time(s(&vz, "start")))
        .map(|(now, start)| Duration::from_nanos((now - start).max(0) as u64))
        .unwrap_or_default();
    let (uw, uc) = (
        a.uptime_warn.unwrap_or_default(),
        a.uptime_critical.unwrap_or_default(),
    );
    if !uw.is_zero() || !uc.is_zero() {
        if uc > uw {
            c.crit("Up invalid thresholds");
            return c;
        }
        if up <= uc {
            c.crit(format!("Up {}", crate::output::dur(up)));
        } else if up <= uw {
            c.warn(format!("Up {}", crate::output::dur(up)));
        } else {
            c.ok(format!("Up {}", crate::output::dur(up)));
        }
    }
    let cpu = vz["cpu"].as_f64().unwrap_or(0.0);
    let mem = u(&vz, "mem") as f64;
    let conns = u(&vz, "connections") as f64;
    let subs = u(&vz, "subscriptions") as f64;
    c.pd(Perf::new(
        "uptime",
        up.as_secs_f64(),
        uw.as_secs_f64(),
        uc.as_secs_f64(),
        "s",
    ));
    c.pd(Perf::new(
        "cpu",
        cpu,
        a.cpu_warn as f64,
        a.cpu_critical as f64,
        "%",
    ));
    c.pd(Perf::new(
        "mem",
        mem,
        a.mem_warn as f64,
        a.mem_critical as f64,
        "",
    ));
    c.pd(Perf::new(
        "connections",
        conns,
        a.conn_warn as f64,
        a.conn_critical as f64,
        "",
    ));
    c.pd(Perf::new(
        "subscriptions",
        subs,
        a.subs_warn as f64,
        a.subs_critical as f64,
        "",
    ));
    let mut check_val = |name: &str, crit: f64, warn: f64, value: f64, invertible: bool| {
        if crit == 0.0 && warn == 0.0 {
            return;
        }
        if !invertible && crit < warn {
            c.crit(format!("{name} invalid thresholds"));
            return;
        }
        let (is_crit, is_warn) = if invertible && crit < warn {
            (value <= crit, value <= warn)
        } else {
            (value >= crit, value >= warn)
        };
        if is_crit {
            c.crit(format!("{name} {value:.2}"));
        } else if is_warn {
            c.warn(format!("{name} {value:.2}"));
        } else {
            c.ok(format!("{name} {value:.2}"));
        }
    };
    check_val("CPU", a.cpu_critical as f64, a.cpu_warn as f64, cpu, false);
    check_val(
        "Memory",
        a.mem_critical as f64,
        a.mem_warn as f64,
        mem,
        false,
    );
    check_val(
        "Connections",
        a.conn_critical as f64,
        a.conn_warn as f64,
        conns,
        true,
    );
    check_val(
        "Subscriptions",
        a.subs_critical as f64,
        a.subs_warn as f64,
        subs,
        true,
    );
    c
}

async fn kv(conn: &ConnSettings, a: &KvCheck) -> Check {
    let mut c = Check::new(a.bucket.clone(), "kv");
    let Some(js) = js_for(conn, &mut c, "connection failed").await else {
        return c;
    };
    let stream = format!("KV_{}", a.bucket);
    let info = match js.api(&format!("STREAM.INFO.{stream}"), None).await {
        Ok(v) => v,
        Err(e) if e.err_code() == Some(crate::js::ERR_STREAM_NOT_FOUND) => {
            c.crit(format!("bucket {} not found", a.bucket));
            return c;
        }
        Err(e) => {
            c.crit(format!("could not load bucket: {}", String::from(e)));
            return c;
        }
    };
    c.ok(format!("bucket {}", a.bucket));
    let values = u(&info["state"], "messages") as i64;
    c.pd(Perf::new(
        "values",
        values as f64,
        a.values_warn.max(0) as f64,
        a.values_critical.max(0) as f64,
        "",
    ));
    if let Some(key) = &a.key {
        let req = json!({"last_by_subj": format!("$KV.{}.{key}", a.bucket)});
        match js
            .api(&format!("STREAM.MSG.GET.{stream}"), Some(&req))
            .await
        {
            Err(e) if e.err_code() == Some(crate::js::ERR_NO_MESSAGE_FOUND) => {
                c.crit(format!("key {key} not found"))
            }
            Err(e) => c.crit(format!("key {key} not loaded: {}", String::from(e))),
            Ok(m) => {
                let hdrs = crate::output::base64_decode(s(&m["message"], "hdrs"))
                    .map(|h| String::from_utf8_lossy(&h).to_string())
                    .unwrap_or_default();
                let op = hdrs
                    .lines()
                    .find_map(|l| {
                        l.split_once(':')
                            .filter(|(k, _)| k.trim().eq_ignore_ascii_case("KV-Operation"))
                            .map(|(_, v)| v.trim().to_string())
                    })
                    .unwrap_or_default();
                // As the Go client's Get: a deleted or purged key is not found.
                match op.as_str() {
                    "DEL" | "PURGE" => c.crit(format!("key {key} not found")),
                    _ => c.ok(format!("key {key} found")),
                }
            }
        }
    }
    let (vw, vc) = (a.values_warn, a.values_critical);
    if vw > -1 || vc > -1 {
        let (crit, warn) = if vc < vw {
            (vc > -1 && values <= vc, vw > -1 && values <= vw)
        } else {
            (vc > -1 && values >= vc, vw > -1 && values >= vw)
        };
        if crit {
            c.crit(format!("{values} values"));
        } else if warn {
            c.warn(format!("{values} values"));
        } else {
            c.ok(format!("{values} values"));
        }
    }
    c.pd(Perf::new(
        "bytes",
        u(&info["state"], "bytes") as f64,
        0.0,
        0.0,
        "B",
    ));
    c.pd(Perf::new(
        "replicas",
        i(&info["config"], "num_replicas") as f64,
        0.0,
        0.0,
        "",
    ));
    c
}
