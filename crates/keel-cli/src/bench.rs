//! `keel bench`: core NATS benchmarks (publish, pub/sub, request/reply) and an
//! idle-connection mode for measuring server memory.
//!
//! Every publisher, subscriber and requester gets its own connection, so the
//! server sees the same load shape as from independent processes.

use std::time::{Duration, Instant};

use async_nats::{client::RequestErrorKind, Client, ConnectOptions, Event, Subject};
use bytes::Bytes;
use clap::{Args, Subcommand};
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::util::{group, parse_duration, redact, ConnSettings, Pinger, Res};

pub const LONG_ABOUT: &str = "\
Core NATS benchmarks against any NATS server (keel-server, nats-server).

Modes (as nats bench):
  pub      publish-only throughput: --clients connections publish --msgs
           messages (split between them) of --size bytes; the clock stops when
           every publisher has flushed and seen a server round trip.
  sub      --clients subscribers each wait for --msgs messages that another
           process publishes (start it first, then `keel bench pub`).
  service  `service serve SUBJECT` answers requests; `service request SUBJECT`
           sends them and reports latency percentiles.
  js       JetStream: `js pub sync|async`, `js consume|fetch|ordered`, ...
  kv       `kv put` then `kv get` on the bucket benchbucket (keys 0, 1, 2, ...)

Keel's own:
  pubsub   --pubs publishers and --subs subscribers on one subject; every
           subscriber must receive all --msgs messages (an idle gap longer
           than --timeout aborts). Reports the publish rate and the aggregate
           subscriber rate (all messages received / time until the last one).
  request  request/reply latency: a built-in replier on its own connection
           echoes the payload; --clients requesters send --msgs sequential
           requests in total. Reports requests/s and latency p50/p90/p99/mean.
  idle     opens --clients idle connections and holds them for --hold; with
           --server-pid it reports the server's VmRSS before and after (use a
           freshly started server: memory from earlier load skews the delta).

Rates use payload bytes only; 1 MB = 1,000,000 bytes. --json prints one JSON
object with the results instead of text; --csv FILE saves nats bench's CSV
(one row per client). Progress bars are drawn on stderr when it is a terminal.

Examples:
  keel bench sub orders --msgs 100000 &  keel bench pub orders --msgs 100000
  keel bench pub --msgs 1000000 --size 128 --clients 2 --csv pub.csv
  keel bench pubsub --msgs 200000 --pubs 1 --subs 4
  keel bench request --msgs 20000 --json
  keel bench idle --clients 100 --hold 3s --server-pid 1234";

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub mode: BenchMode,
}

#[derive(Subcommand, Debug)]
pub enum BenchMode {
    /// Publish core NATS messages (publish-only throughput)
    Pub(PubBench),
    /// Subscribe and wait for --msgs messages published by another process
    Sub(crate::bench_nats::SubBench),
    /// Micro-service mode: request (latency) and serve (replier)
    #[command(subcommand)]
    Service(crate::bench_nats::ServiceMode),
    /// Key-value: put and get (bucket benchbucket)
    #[command(subcommand)]
    Kv(crate::bench_nats::KvMode),
    /// Keel: publishers and subscribers on one subject, in one process
    #[command(name = "pubsub")]
    PubSub(PubSubBench),
    /// Request/reply latency with a built-in replier
    #[command(visible_alias = "req")]
    Request(RequestBench),
    /// Hold idle connections open, e.g. to measure server memory
    Idle(IdleBench),
    /// JetStream: publish (sync, async), consume, fan-out, consumer memory
    #[command(subcommand, long_about = crate::bench_js::LONG_ABOUT)]
    Js(crate::bench_js::JsMode),
}

#[derive(Args, Debug)]
pub struct Common {
    /// Subject to use
    #[arg(default_value = "keel.bench")]
    pub subject: String,
    /// Total number of messages (or requests)
    #[arg(long, default_value_t = 100_000)]
    pub msgs: u64,
    /// Payload size, e.g. 128, 1KB, 64KiB, 1MB (K/M are 1024-based, as in nats bench)
    #[arg(long, default_value = "128", value_parser = parse_size)]
    pub size: usize,
}

#[derive(Args, Debug)]
pub struct PubBench {
    #[command(flatten)]
    pub common: Common,
    /// Number of concurrent publishers, each on its own connection
    #[arg(long, default_value_t = 1, visible_alias = "pubs")]
    pub clients: usize,
    /// Pause between publishes
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub sleep: Option<Duration>,
    /// Save the per-client results to this CSV file (the nats bench columns)
    #[arg(long, value_name = "FILE")]
    pub csv: Option<String>,
    /// Do not draw a progress bar
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Args, Debug)]
pub struct PubSubBench {
    #[command(flatten)]
    pub common: Common,
    /// Number of concurrent publishers, each on its own connection
    #[arg(long, default_value_t = 1)]
    pub pubs: usize,
    /// Number of subscribers, each on its own connection
    #[arg(long, default_value_t = 1)]
    pub subs: usize,
}

#[derive(Args, Debug)]
pub struct RequestBench {
    #[command(flatten)]
    pub common: Common,
    /// Number of concurrent requesters (each sends its requests sequentially)
    #[arg(long, default_value_t = 1)]
    pub clients: usize,
    /// Do not start the built-in replier (use one already listening on SUBJECT)
    #[arg(long)]
    pub no_replier: bool,
}

#[derive(Args, Debug)]
pub struct IdleBench {
    /// Number of idle connections to open
    #[arg(long, default_value_t = 100)]
    pub clients: usize,
    /// How long to hold the connections open
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub hold: Duration,
    /// Report this process's VmRSS (Linux /proc) before and while connected
    #[arg(long, value_name = "PID")]
    pub server_pid: Option<u32>,
}

pub async fn run(conn: &ConnSettings, args: &BenchArgs, json: bool) -> Res<()> {
    let (abort, mut aborted) = mpsc::unbounded_channel();
    let ctx = Ctx {
        conn: conn.clone(),
        abort,
    };
    let work = async {
        match &args.mode {
            BenchMode::Pub(b) => bench_pub(&ctx, b, !json).await,
            BenchMode::Sub(b) => crate::bench_nats::sub(&ctx, b, !json).await,
            BenchMode::Service(m) => crate::bench_nats::service(&ctx, m, !json).await,
            BenchMode::Kv(m) => crate::bench_nats::kv(&ctx, m, !json).await,
            BenchMode::PubSub(b) => bench_pubsub(&ctx, b, !json).await,
            BenchMode::Request(b) => bench_request(&ctx, b, !json).await,
            BenchMode::Idle(b) => bench_idle(&ctx, b, !json).await,
            BenchMode::Js(m) => crate::bench_js::run(&ctx, m, !json).await,
        }
    };
    // A connection event that invalidates the run (see `Ctx::options`) ends it
    // at once instead of leaving tasks waiting on a dead connection.
    let report = tokio::select! {
        report = work => report?,
        Some(reason) = aborted.recv() => return Err(reason),
    };
    if json {
        println!("{}", report.json);
    } else {
        print!("{}", report.text);
    }
    Ok(())
}

/// Results in both output forms, built together so they cannot disagree.
pub(crate) struct Report {
    pub(crate) text: String,
    pub(crate) json: Value,
}

/// A throughput measurement: `msgs` messages of `size` bytes in `elapsed`.
pub(crate) struct Rate {
    pub(crate) msgs: u64,
    pub(crate) bytes: u64,
    pub(crate) elapsed: Duration,
}

impl Rate {
    pub(crate) fn msgs_per_s(&self) -> f64 {
        self.msgs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    pub(crate) fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
    pub(crate) fn json(&self) -> Value {
        json!({
            "msgs": self.msgs,
            "bytes": self.bytes,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "msgs_per_s": self.msgs_per_s().round(),
            "mb_per_s": round2(self.mb_per_s()),
        })
    }
    pub(crate) fn line(&self, label: &str) -> String {
        format!(
            "  {label:<10} {:>12} msgs in {:>9.3?} = {:>12} msgs/s {:>10.2} MB/s\n",
            group(self.msgs),
            self.elapsed,
            group(self.msgs_per_s().round() as u64),
            self.mb_per_s()
        )
    }
}

pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Parses message sizes: plain bytes or with a B/K/KB/KiB/M/MB/MiB suffix.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 128, 1KB, 64KiB"))?;
    let mult = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1024,
        "M" | "MB" | "MIB" => 1024 * 1024,
        u => return Err(format!("invalid size {s:?}: unknown unit {u:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("invalid size {s:?}: too large"))
}

/// Splits `total` into `parts` nearly equal shares (the first ones get the remainder).
pub(crate) fn split(total: u64, parts: usize) -> Vec<u64> {
    let parts = parts.max(1) as u64;
    (0..parts)
        .map(|i| total / parts + u64::from(i < total % parts))
        .collect()
}

pub(crate) fn check_counts(what: &str, n: usize) -> Res<()> {
    if n == 0 {
        return Err(format!("--{what} must be at least 1"));
    }
    Ok(())
}

pub(crate) fn check_size(client: &Client, size: usize) -> Res<()> {
    let max = client.server_info().max_payload;
    if size > max {
        return Err(format!(
            "--size {size} exceeds the server's max_payload of {max} bytes"
        ));
    }
    Ok(())
}

/// What every benchmark needs: where to connect and how to abort the run.
pub(crate) struct Ctx {
    pub(crate) conn: ConnSettings,
    abort: mpsc::UnboundedSender<String>,
}

impl Ctx {
    /// Options for benchmark connections. A disconnect or a client-side message
    /// drop makes the numbers meaningless (and the client would otherwise wait
    /// in its reconnect loop), so these events abort the run.
    pub(crate) fn options(&self) -> ConnectOptions {
        let abort = self.abort.clone();
        self.conn.options().event_callback(move |event| {
            let abort = abort.clone();
            async move {
                let reason = match event {
                    Event::Disconnected => {
                        "lost the connection to the server during the benchmark".to_string()
                    }
                    Event::SlowConsumer(_) => "a subscriber fell behind and the client dropped \
                        messages (slow consumer); try smaller --msgs or fewer --subs"
                        .to_string(),
                    Event::ServerError(e) => format!("the server reported an error: {e}"),
                    _ => return,
                };
                let _ = abort.send(reason);
            }
        })
    }

    pub(crate) async fn connect(&self) -> Res<Client> {
        self.conn.connect_with(self.options()).await
    }

    /// Opens `n` connections concurrently (bounded, so a large --clients does
    /// not turn into a connection storm).
    pub(crate) async fn connect_many(
        &self,
        n: usize,
        tune: fn(ConnectOptions) -> ConnectOptions,
    ) -> Res<Vec<Client>> {
        futures::stream::iter(0..n)
            .map(|_| self.conn.connect_with(tune(self.options())))
            .buffer_unordered(16)
            .try_collect()
            .await
    }
}

/// Publishers may queue more commands before `publish` waits, which is what a
/// throughput test wants.
pub(crate) fn publisher_opts(opts: ConnectOptions) -> ConnectOptions {
    opts.client_capacity(65_536)
}

/// Subscribers buffer generously: the client drops messages for a slow
/// consumer, and a benchmark that loses messages measures nothing.
pub(crate) fn subscriber_opts(opts: ConnectOptions) -> ConnectOptions {
    opts.subscription_capacity(1 << 20)
}

pub(crate) fn default_opts(opts: ConnectOptions) -> ConnectOptions {
    opts
}

pub(crate) fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// Waits for the start signal shared by all benchmark tasks.
pub(crate) async fn wait_for_start(go: &mut watch::Receiver<bool>) -> Res<()> {
    go.wait_for(|started| *started)
        .await
        .map(|_| ())
        .map_err(|_| "benchmark aborted before start".to_string())
}

/// Prepares one publisher per client (the round-trip subscription is set up
/// now, outside the timed section), then spawns them waiting on `go`.
async fn spawn_publishers(
    clients: Vec<Client>,
    subject: &str,
    payload: Bytes,
    msgs: u64,
    timeout: Duration,
    go: &watch::Receiver<bool>,
) -> Res<JoinSet<Res<Instant>>> {
    let subject = Subject::from(subject.to_string());
    let shares = split(msgs, clients.len());
    let mut set = JoinSet::new();
    for (client, count) in clients.into_iter().zip(shares) {
        let mut pinger = Pinger::new(&client).await?;
        pinger.ping(timeout).await?;
        let (subject, payload, mut go) = (subject.clone(), payload.clone(), go.clone());
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            for _ in 0..count {
                client
                    .publish(subject.clone(), payload.clone())
                    .await
                    .map_err(|e| format!("publish failed: {e}"))?;
            }
            // The run is only over once the server has processed every message.
            pinger.ping(timeout).await?;
            Ok(Instant::now())
        });
    }
    Ok(set)
}

/// Waits for every task and returns all their results.
pub(crate) async fn join_all<T: 'static>(mut set: JoinSet<Res<T>>) -> Res<Vec<T>> {
    let mut out = Vec::with_capacity(set.len());
    while let Some(res) = set.join_next().await {
        match res.map_err(|e| format!("benchmark task failed: {e}"))? {
            Ok(v) => out.push(v),
            Err(e) => {
                set.abort_all();
                return Err(e);
            }
        }
    }
    Ok(out)
}

fn latest(instants: &[Instant], start: Instant) -> Duration {
    instants
        .iter()
        .map(|t| t.saturating_duration_since(start))
        .max()
        .unwrap_or_default()
}

pub(crate) fn payload_of(size: usize) -> Bytes {
    Bytes::from(vec![b'k'; size])
}

async fn bench_pub(ctx: &Ctx, b: &PubBench, progress: bool) -> Res<Report> {
    let conn = &ctx.conn;
    check_counts("clients", b.clients)?;
    let c = &b.common;
    let clients = ctx.connect_many(b.clients, publisher_opts).await?;
    check_size(&clients[0], c.size)?;
    let bar = crate::util::Progress::new("publish", c.msgs, progress && !b.no_progress);
    let (go_tx, go_rx) = watch::channel(false);
    let subject = Subject::from(c.subject.clone());
    let mut set = JoinSet::new();
    for (client, count) in clients.into_iter().zip(split(c.msgs, b.clients)) {
        let mut pinger = Pinger::new(&client).await?;
        pinger.ping(conn.timeout).await?;
        let (subject, payload, mut go) = (subject.clone(), payload_of(c.size), go_rx.clone());
        let (sleep, timeout, done) = (b.sleep, conn.timeout, bar.counter());
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let start = Instant::now();
            for k in 0..count {
                if let Some(d) = sleep.filter(|_| k > 0) {
                    tokio::time::sleep(d).await;
                }
                client
                    .publish(subject.clone(), payload.clone())
                    .await
                    .map_err(|e| format!("publish failed: {e}"))?;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            // The run is only over once the server has processed every message.
            pinger.ping(timeout).await?;
            Ok(crate::bench_nats::Sample {
                msgs: count,
                bytes: count * payload.len() as u64,
                start,
                end: Instant::now(),
                latencies: Vec::new(),
            })
        });
    }
    let start = Instant::now();
    let _ = go_tx.send(true);
    let samples = join_all(set).await?;
    bar.finish();
    let ends: Vec<Instant> = samples.iter().map(|s| s.end).collect();
    let rate = Rate {
        msgs: c.msgs,
        bytes: c.msgs * c.size as u64,
        elapsed: latest(&ends, start),
    };
    let results = crate::bench_nats::Results {
        label: "Core NATS publisher",
        prefix: "P",
        samples,
    };
    let mut text = format!(
        "Starting Core NATS publisher benchmark [subject={}, msgs={}, msgsize={}, clients={}] at {}\n\n{}",
        c.subject,
        group(c.msgs),
        crate::output::ibytes(c.size as u64),
        b.clients,
        redact(&conn.server),
        results.report()
    );
    if let Some(path) = &b.csv {
        std::fs::write(path, results.csv()).map_err(|e| format!("writing file {path}: {e}"))?;
        text += &format!("Saved metric data in csv file {path}\n");
    }
    let json = json!({
        "mode": "pub",
        "server": redact(&conn.server),
        "subject": c.subject,
        "msgs": c.msgs,
        "size": c.size,
        "pubs": b.clients,
        "pub": rate.json(),
    });
    Ok(Report { text, json })
}

struct SubResult {
    msgs: u64,
    bytes: u64,
    last: Instant,
}

async fn bench_pubsub(ctx: &Ctx, b: &PubSubBench, progress: bool) -> Res<Report> {
    let conn = &ctx.conn;
    check_counts("pubs", b.pubs)?;
    check_counts("subs", b.subs)?;
    let c = &b.common;
    let idle = conn.timeout;
    let sub_clients = ctx.connect_many(b.subs, subscriber_opts).await?;
    let pub_clients = ctx.connect_many(b.pubs, publisher_opts).await?;
    check_size(&pub_clients[0], c.size)?;
    let bar = crate::util::Progress::new("received", c.msgs * b.subs as u64, progress);

    let mut subscribers = JoinSet::new();
    for (i, client) in sub_clients.into_iter().enumerate() {
        let mut sub = client
            .subscribe(c.subject.clone())
            .await
            .map_err(|e| format!("cannot subscribe to {:?}: {e}", c.subject))?;
        // Publishing must not start before the server knows every subscriber.
        Pinger::new(&client).await?.ping(conn.timeout).await?;
        let expected = c.msgs;
        let done = bar.counter();
        subscribers.spawn(async move {
            let _keep_connection = client;
            let (mut msgs, mut bytes) = (0u64, 0u64);
            while msgs < expected {
                // Only arm a timer when no message is already waiting: the
                // timer costs more than receiving a buffered message.
                let next = match futures::FutureExt::now_or_never(sub.next()) {
                    Some(m) => m,
                    None => tokio::time::timeout(idle, sub.next()).await.map_err(|_| {
                        format!(
                            "subscriber {} received {} of {} messages, then nothing for {idle:?} \
                             (messages lost? raise --timeout if the server is just slow)",
                            i + 1,
                            group(msgs),
                            group(expected)
                        )
                    })?,
                };
                let msg = next.ok_or("subscription closed by the server")?;
                msgs += 1;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                bytes += msg.payload.len() as u64;
            }
            Ok(SubResult {
                msgs,
                bytes,
                last: Instant::now(),
            })
        });
    }

    let (go_tx, go_rx) = watch::channel(false);
    let publishers = spawn_publishers(
        pub_clients,
        &c.subject,
        payload_of(c.size),
        c.msgs,
        conn.timeout,
        &go_rx,
    )
    .await?;
    let start = Instant::now();
    let _ = go_tx.send(true);
    let pub_ends = join_all(publishers).await?;
    let subs = join_all(subscribers).await?;
    bar.finish();

    let pub_rate = Rate {
        msgs: c.msgs,
        bytes: c.msgs * c.size as u64,
        elapsed: latest(&pub_ends, start),
    };
    let sub_ends: Vec<Instant> = subs.iter().map(|s| s.last).collect();
    let sub_rate = Rate {
        msgs: subs.iter().map(|s| s.msgs).sum(),
        bytes: subs.iter().map(|s| s.bytes).sum(),
        elapsed: latest(&sub_ends, start),
    };
    let per_sub: Vec<f64> = subs
        .iter()
        .map(|s| {
            (s.msgs as f64
                / s.last
                    .saturating_duration_since(start)
                    .as_secs_f64()
                    .max(1e-9))
            .round()
        })
        .collect();
    let text = format!(
        "keel bench pubsub: {}, {}, {} msgs x {} B on {:?} at {}\n{}{}",
        plural(b.pubs, "publisher"),
        plural(b.subs, "subscriber"),
        group(c.msgs),
        c.size,
        c.subject,
        redact(&conn.server),
        pub_rate.line("publish"),
        sub_rate.line("subscribe"),
    );
    let json = json!({
        "mode": "pubsub",
        "server": redact(&conn.server),
        "subject": c.subject,
        "msgs": c.msgs,
        "size": c.size,
        "pubs": b.pubs,
        "subs": b.subs,
        "pub": pub_rate.json(),
        "sub": sub_rate.json(),
        "sub_msgs_per_s_each": per_sub,
    });
    Ok(Report { text, json })
}

/// Latency summary in microseconds.
pub(crate) struct Latency {
    pub(crate) min: f64,
    pub(crate) mean: f64,
    pub(crate) p50: f64,
    pub(crate) p90: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

impl Latency {
    /// `nanos` must be sorted and non-empty.
    pub(crate) fn from_sorted(nanos: &[u64]) -> Latency {
        let us = |n: u64| n as f64 / 1e3;
        // Nearest-rank percentile: the smallest sample with at least p% at or below it.
        let pct = |p: f64| {
            let rank = ((p / 100.0) * nanos.len() as f64).ceil() as usize;
            us(nanos[rank.clamp(1, nanos.len()) - 1])
        };
        Latency {
            min: us(nanos[0]),
            mean: nanos.iter().map(|&n| n as f64).sum::<f64>() / nanos.len() as f64 / 1e3,
            p50: pct(50.0),
            p90: pct(90.0),
            p99: pct(99.0),
            max: us(nanos[nanos.len() - 1]),
        }
    }
}

async fn bench_request(ctx: &Ctx, b: &RequestBench, progress: bool) -> Res<Report> {
    let conn = &ctx.conn;
    check_counts("clients", b.clients)?;
    let c = &b.common;
    if c.msgs == 0 {
        return Err("--msgs must be at least 1".into());
    }
    let subject = Subject::from(c.subject.clone());

    let mut replier_task = None;
    if !b.no_replier {
        let replier = ctx.connect().await?;
        check_size(&replier, c.size)?;
        let mut sub = replier
            .subscribe(subject.clone())
            .await
            .map_err(|e| format!("cannot subscribe to {:?}: {e}", c.subject))?;
        Pinger::new(&replier).await?.ping(conn.timeout).await?;
        replier_task = Some(tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                if let Some(reply) = msg.reply {
                    if replier.publish(reply, msg.payload).await.is_err() {
                        break;
                    }
                }
            }
        }));
    }

    let clients = ctx.connect_many(b.clients, default_opts).await?;
    check_size(&clients[0], c.size)?;
    let payload = payload_of(c.size);
    let request_error = |e: async_nats::RequestError| match e.kind() {
        RequestErrorKind::NoResponders => format!("no replier is listening on {subject:?}"),
        RequestErrorKind::TimedOut => format!(
            "a request on {subject:?} got no reply within {:?}",
            conn.timeout
        ),
        _ => format!("request failed: {e}"),
    };
    // Warm up outside the clock: the first request also sets up the client's
    // reply subscription.
    for client in &clients {
        client
            .request(subject.clone(), payload.clone())
            .await
            .map_err(request_error)?;
    }

    let bar = crate::util::Progress::new("requests", c.msgs, progress);
    let (go_tx, go_rx) = watch::channel(false);
    let mut requesters = JoinSet::new();
    for (client, count) in clients.into_iter().zip(split(c.msgs, b.clients)) {
        let (subject, payload, mut go) = (subject.clone(), payload.clone(), go_rx.clone());
        let done = bar.counter();
        let timeout = conn.timeout;
        requesters.spawn(async move {
            wait_for_start(&mut go).await?;
            let mut nanos = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let t0 = Instant::now();
                client
                    .request(subject.clone(), payload.clone())
                    .await
                    .map_err(|e| match e.kind() {
                        RequestErrorKind::TimedOut => {
                            format!("a request got no reply within {timeout:?}")
                        }
                        _ => format!("request failed: {e}"),
                    })?;
                nanos.push(t0.elapsed().as_nanos() as u64);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok((nanos, Instant::now()))
        });
    }
    let start = Instant::now();
    let _ = go_tx.send(true);
    let results = join_all(requesters).await?;
    bar.finish();
    if let Some(task) = replier_task {
        task.abort();
    }

    let ends: Vec<Instant> = results.iter().map(|(_, end)| *end).collect();
    let mut nanos: Vec<u64> = results.into_iter().flat_map(|(n, _)| n).collect();
    nanos.sort_unstable();
    let lat = Latency::from_sorted(&nanos);
    let rate = Rate {
        msgs: c.msgs,
        bytes: c.msgs * c.size as u64,
        elapsed: latest(&ends, start),
    };
    let text = format!(
        "keel bench request: {}, {} requests x {} B on {:?} at {}\n\
         \x20 requests   {:>12} reqs in {:>9.3?} = {:>12} req/s\n\
         \x20 latency    min {:.1} us, mean {:.1}, p50 {:.1}, p90 {:.1}, p99 {:.1}, max {:.1} us\n",
        plural(b.clients, "requester"),
        group(c.msgs),
        c.size,
        c.subject,
        redact(&conn.server),
        group(c.msgs),
        rate.elapsed,
        group(rate.msgs_per_s().round() as u64),
        lat.min,
        lat.mean,
        lat.p50,
        lat.p90,
        lat.p99,
        lat.max,
    );
    let json = json!({
        "mode": "request",
        "server": redact(&conn.server),
        "subject": c.subject,
        "msgs": c.msgs,
        "size": c.size,
        "clients": b.clients,
        "requests": rate.msgs,
        "elapsed_s": rate.elapsed.as_secs_f64(),
        "requests_per_s": rate.msgs_per_s().round(),
        "latency_us": {
            "min": round2(lat.min),
            "mean": round2(lat.mean),
            "p50": round2(lat.p50),
            "p90": round2(lat.p90),
            "p99": round2(lat.p99),
            "max": round2(lat.max),
        },
    });
    Ok(Report { text, json })
}

/// Resident set size of a process in KiB, from /proc (Linux only).
pub(crate) fn rss_kib(pid: u32) -> Res<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| format!("no VmRSS line in {path}"))
}

/// The process's CPU time so far (utime + stime, Linux /proc) in microseconds; the kernel
/// counts it in USER_HZ ticks, 100 per second on Linux.
pub(crate) fn cpu_us(pid: u32) -> Res<u64> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    // The command name (field 2) may hold spaces: count fields after its closing paren.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    match f[..] {
        [utime, stime] => Ok((utime + stime) * 10_000),
        _ => Err(format!("no utime/stime in {path}")),
    }
}

/// Server CPU per message over a timed phase, from [`cpu_us`] readings at its start and end.
pub(crate) fn cpu_per_msg(before: Option<u64>, pid: Option<u32>, msgs: u64) -> Res<Option<f64>> {
    let (Some(before), Some(pid)) = (before, pid) else {
        return Ok(None);
    };
    let after = cpu_us(pid)?;
    Ok(Some(round2(
        after.saturating_sub(before) as f64 / msgs.max(1) as f64,
    )))
}

async fn bench_idle(ctx: &Ctx, b: &IdleBench, progress: bool) -> Res<Report> {
    let conn = &ctx.conn;
    check_counts("clients", b.clients)?;
    let before = b.server_pid.map(rss_kib).transpose()?;
    let t0 = Instant::now();
    let clients = ctx.connect_many(b.clients, default_opts).await?;
    let connect_time = t0.elapsed();
    if progress {
        eprintln!(
            "{} open (connected in {connect_time:.1?}); holding for {:?}",
            plural(b.clients, "connection"),
            b.hold
        );
    }
    let spinner = crate::util::Progress::spinner("holding", progress);
    tokio::time::sleep(b.hold).await;
    spinner.finish();
    // Read at the end of the hold so the server has settled after the burst.
    let during = b.server_pid.map(rss_kib).transpose()?;
    drop(clients);

    let mut text = format!(
        "keel bench idle: {} held for {:?} at {} (connected in {connect_time:.1?})\n",
        plural(b.clients, "connection"),
        b.hold,
        redact(&conn.server)
    );
    let per_conn = match (before, during) {
        (Some(before), Some(during)) => {
            let per = (during as f64 - before as f64) / b.clients as f64;
            text += &format!(
                "  server pid {} VmRSS: {before} KiB before, {during} KiB with connections \
                 ({per:+.1} KiB per connection)\n",
                b.server_pid.unwrap_or_default()
            );
            Some(round2(per))
        }
        _ => None,
    };
    let json = json!({
        "mode": "idle",
        "server": redact(&conn.server),
        "clients": b.clients,
        "hold_s": b.hold.as_secs_f64(),
        "connect_s": connect_time.as_secs_f64(),
        "server_pid": b.server_pid,
        "rss_before_kib": before,
        "rss_kib": during,
        "rss_per_conn_kib": per_conn,
    });
    Ok(Report { text, json })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("128").unwrap(), 128);
        assert_eq!(parse_size("1KB").unwrap(), 1024);
        assert_eq!(parse_size("64kib").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert!(parse_size("1GB").is_err());
        assert!(parse_size("KB").is_err());
    }

    #[test]
    fn splits() {
        assert_eq!(split(10, 3), vec![4, 3, 3]);
        assert_eq!(split(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(split(10, 1).iter().sum::<u64>(), 10);
    }

    #[test]
    fn percentiles() {
        let nanos: Vec<u64> = (1..=100).map(|n| n * 1000).collect();
        let l = Latency::from_sorted(&nanos);
        assert_eq!(
            (l.min, l.p50, l.p90, l.p99, l.max),
            (1.0, 50.0, 90.0, 99.0, 100.0)
        );
        assert_eq!(l.mean, 50.5);
        let one = Latency::from_sorted(&[5000]);
        assert_eq!((one.p50, one.p99), (5.0, 5.0));
    }
}
