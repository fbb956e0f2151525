//! `keel bench js ...`: JetStream benchmarks. Publish with a wait for every
//! ack (latency percentiles), publish with many acks in flight, consume from
//! a durable pull consumer with explicit acks, fan out to N durables, and the
//! server's memory with many durable consumers holding pending acks.
//!
//! Every run uses its own stream (deleted first and, unless --keep, after),
//! so runs do not see each other's messages.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use async_nats::Client;
use clap::{Args, Subcommand, ValueEnum};
use futures::StreamExt;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::bench::{
    check_counts, check_size, join_all, parse_size, payload_of, plural, publisher_opts, round2,
    rss_kib, split, subscriber_opts, wait_for_start, Ctx, Latency, Rate, Report,
};
use crate::util::{group, parse_duration, redact, ConnSettings, Progress, Res};

pub const LONG_ABOUT: &str = "\
JetStream benchmarks against any NATS server started with JetStream (-js).

As nats bench (stream benchstream, kept between runs):
  pub sync SUBJECT   publish, waiting for each ack (--create makes the stream)
  pub async SUBJECT  publish with --batch acks outstanding per client
  consume            --clients share the durable nats-bench and receive
                     --msgs messages of the stream (--acks explicit|none|all)
  fetch              the same, with fetch requests of --batch
  ordered            each client reads with its own ordered consumer

Keel's own (a fresh stream, --stream default KEELBENCH, deleted afterwards):
  pub            synchronous publish: each publisher waits for the stream's
                 ack before sending the next message; reports msgs/s and the
                 publish latency (p50/p90/p99 of publish-to-ack).
  pub-async      asynchronous publish: up to --inflight messages wait for
                 their acks at once; reports msgs/s.
  consume-fill   fills the stream with --msgs messages (not timed), then one
                 durable pull consumer (explicit ack, --batch per pull)
                 receives and acks them all; reports msgs/s.
  fanout         fills the stream, then --consumers durables, each on its own
                 connection, consume and ack every message; reports the
                 aggregate rate.
  consumers-mem  fills the stream, creates --consumers durables and has each
                 fetch --fetch messages without acking them (so every one
                 holds pending acks), then reports the server's VmRSS growth
                 (needs --server-pid; Linux /proc).

For keel's modes the stream (--stream, default KEELBENCH) is deleted and
created afresh with --storage (file by default) on subject SUBJECT, and deleted
again afterwards unless --keep. A progress bar is drawn on stderr when it is a
terminal.

Examples:
  keel bench js pub sync orders.bench --create --msgs 20000 --csv sync.csv
  keel bench js pub async orders.bench --msgs 200000 --batch 500 --clients 2
  keel bench js consume --msgs 200000 --batch 500
  keel bench js pub --msgs 20000
  keel bench js pub-async --msgs 200000 --inflight 512
  keel bench js consume-fill --msgs 200000 --batch 500
  keel bench js fanout --msgs 50000 --consumers 4
  keel bench js consumers-mem --msgs 100000 --consumers 1000 --server-pid 1234";

#[derive(Subcommand, Debug)]
pub enum JsMode {
    /// Publish: `pub sync|async SUBJECT` as nats bench (stream benchstream), or
    /// keel's `pub [SUBJECT]` (sync, on a fresh KEELBENCH stream)
    Pub(JsPubCmd),
    /// Publish with many acks in flight (throughput)
    #[command(name = "pub-async")]
    PubAsync(PubAsyncArgs),
    /// nats bench: consume --msgs from the stream with a shared durable pull consumer
    Consume(crate::bench_nats::JsConsumeFlags),
    /// nats bench: the same with fetch requests of --batch
    Fetch(crate::bench_nats::JsConsumeFlags),
    /// nats bench: read with ordered ephemeral consumers
    Ordered(crate::bench_nats::JsOrdered),
    /// Fill a fresh stream, then consume and ack it from one durable pull consumer
    #[command(name = "consume-fill")]
    ConsumeFill(ConsumeArgs),
    /// Several durables consume the same stream at once
    Fanout(FanoutArgs),
    /// Server memory with many durables holding pending acks
    #[command(name = "consumers-mem")]
    ConsumersMem(MemArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum BenchStorage {
    File,
    Memory,
}

#[derive(Args, Debug)]
pub struct StreamOpts {
    /// Subject to publish on (the stream stores it)
    #[arg(default_value = "keel.bench.js")]
    pub subject: String,
    /// Number of messages
    #[arg(long, default_value_t = 100_000)]
    pub msgs: u64,
    /// Payload size, e.g. 128, 1KB, 16KiB
    #[arg(long, default_value = "128", value_parser = parse_size)]
    pub size: usize,
    /// Stream to use (created afresh)
    #[arg(long, default_value = "KEELBENCH")]
    pub stream: String,
    /// Stream storage
    #[arg(long, value_enum, default_value = "file")]
    pub storage: BenchStorage,
    /// Keep the stream afterwards
    #[arg(long)]
    pub keep: bool,
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct JsPubCmd {
    #[command(subcommand)]
    pub mode: Option<crate::bench_nats::JsPubMode>,
    #[command(flatten)]
    pub legacy: PubArgs,
}

#[derive(Args, Debug)]
pub struct PubArgs {
    #[command(flatten)]
    pub s: StreamOpts,
    /// Concurrent publishers, each on its own connection
    #[arg(long, default_value_t = 1)]
    pub pubs: usize,
}

#[derive(Args, Debug)]
pub struct PubAsyncArgs {
    #[command(flatten)]
    pub s: StreamOpts,
    /// Concurrent publishers, each on its own connection
    #[arg(long, default_value_t = 1)]
    pub pubs: usize,
    /// Publishes awaiting their ack at once, per publisher
    #[arg(long, default_value_t = 256)]
    pub inflight: usize,
    /// Spread the messages over this many subjects, SUBJECT.0 to SUBJECT.<N-1> in turn, on
    /// a stream keeping the last message of each (a key-value bucket's shape)
    #[arg(long, value_name = "N")]
    pub keys: Option<u64>,
}

#[derive(Args, Debug)]
pub struct ConsumeArgs {
    #[command(flatten)]
    pub s: StreamOpts,
    /// Messages per pull request
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Report this server process's CPU time per message over the timed phase (Linux /proc)
    #[arg(long, value_name = "PID")]
    pub server_pid: Option<u32>,
}

#[derive(Args, Debug)]
pub struct FanoutArgs {
    #[command(flatten)]
    pub s: StreamOpts,
    /// Number of durable consumers
    #[arg(long, default_value_t = 4)]
    pub consumers: usize,
    /// Messages per pull request
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Wait for the server to confirm each ack (AckSync), every consumer at once
    #[arg(long)]
    pub doubleack: bool,
    /// Report this server process's CPU time per message over the timed phase (Linux /proc)
    #[arg(long, value_name = "PID")]
    pub server_pid: Option<u32>,
}

#[derive(Args, Debug)]
pub struct MemArgs {
    #[command(flatten)]
    pub s: StreamOpts,
    /// Number of durable consumers to create
    #[arg(long, default_value_t = 1000)]
    pub consumers: usize,
    /// Messages each consumer fetches without acking (its pending acks)
    #[arg(long, default_value_t = 5)]
    pub fetch: usize,
    /// Wait this long after the last consumer before reading memory
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub settle: Duration,
    /// Report this process's VmRSS (Linux /proc) before and after
    #[arg(long, value_name = "PID")]
    pub server_pid: Option<u32>,
}

pub async fn run(ctx: &Ctx, mode: &JsMode, progress: bool) -> Res<Report> {
    match mode {
        JsMode::Pub(JsPubCmd { mode: Some(m), .. }) => {
            crate::bench_nats::js_pub(ctx, m, progress).await
        }
        JsMode::Pub(JsPubCmd { legacy, .. }) => bench_pub(ctx, legacy, progress).await,
        JsMode::Consume(a) => {
            crate::bench_nats::js_consume(ctx, a, crate::bench_nats::ConsumeKind::Consume, progress)
                .await
        }
        JsMode::Fetch(a) => {
            crate::bench_nats::js_consume(ctx, a, crate::bench_nats::ConsumeKind::Fetch, progress)
                .await
        }
        JsMode::Ordered(a) => crate::bench_nats::js_ordered(ctx, a, progress).await,
        JsMode::PubAsync(a) => bench_pub_async(ctx, a, progress).await,
        JsMode::ConsumeFill(a) => bench_consume(ctx, a, progress).await,
        JsMode::Fanout(a) => bench_fanout(ctx, a, progress).await,
        JsMode::ConsumersMem(a) => bench_mem(ctx, a, progress).await,
    }
}

fn context(client: &Client, conn: &ConnSettings, inflight: usize) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(conn.timeout)
        .api_prefix(conn.js_api_prefix.clone())
        .max_ack_inflight(inflight.max(1))
        .build(client.clone())
}

fn js_error(e: impl std::fmt::Display) -> String {
    let msg = e.to_string();
    if msg.contains("no responders") {
        "JetStream is not enabled on the server (start it with -js)".into()
    } else {
        msg
    }
}

/// Deletes and creates the benchmark stream.
async fn fresh_stream(client: &Client, ctx: &Ctx, s: &StreamOpts) -> Res<stream::Stream> {
    fresh_stream_with(client, ctx, s, None).await
}

/// The same; with `keys`, on SUBJECT.> keeping one message per subject.
async fn fresh_stream_with(
    client: &Client,
    ctx: &Ctx,
    s: &StreamOpts,
    keys: Option<u64>,
) -> Res<stream::Stream> {
    crate::js::check_name("stream", &s.stream)?;
    let js = context(client, &ctx.conn, 1);
    match js.delete_stream(&s.stream).await {
        Ok(_) => {}
        Err(e) if e.to_string().contains("not found") => {}
        Err(e) => {
            return Err(format!(
                "cannot delete old stream {}: {}",
                s.stream,
                js_error(e)
            ))
        }
    }
    js.create_stream(stream::Config {
        name: s.stream.clone(),
        subjects: vec![match keys {
            Some(_) => format!("{}.>", s.subject),
            None => s.subject.clone(),
        }],
        storage: match s.storage {
            BenchStorage::File => stream::StorageType::File,
            BenchStorage::Memory => stream::StorageType::Memory,
        },
        max_messages_per_subject: if keys.is_some() { 1 } else { 0 },
        allow_direct: keys.is_some(),
        ..Default::default()
    })
    .await
    .map_err(|e| format!("cannot create stream {}: {}", s.stream, js_error(e)))
}

async fn cleanup(client: &Client, ctx: &Ctx, s: &StreamOpts) {
    if !s.keep {
        let js = context(client, &ctx.conn, 1);
        let _ = js.delete_stream(&s.stream).await;
    }
}

/// Fills the stream with `s.msgs` messages, many acks in flight (not timed).
async fn fill(client: &Client, ctx: &Ctx, s: &StreamOpts, progress: bool) -> Res<()> {
    let js = context(client, &ctx.conn, 1024);
    let payload = payload_of(s.size);
    let bar = Progress::new("fill", s.msgs, progress);
    let mut acks = VecDeque::with_capacity(1024);
    for _ in 0..s.msgs {
        if acks.len() >= 1024 {
            let fut: jetstream::context::PublishAckFuture = acks.pop_front().unwrap();
            fut.await
                .map_err(|e| format!("filling the stream failed: {e}"))?;
            bar.add(1);
        }
        acks.push_back(
            js.publish(s.subject.clone(), payload.clone())
                .await
                .map_err(|e| format!("filling the stream failed: {}", js_error(e)))?,
        );
    }
    for fut in acks {
        fut.await
            .map_err(|e| format!("filling the stream failed: {e}"))?;
        bar.add(1);
    }
    bar.finish();
    Ok(())
}

fn header(mode: &str, ctx: &Ctx, s: &StreamOpts, extra: &str) -> String {
    format!(
        "keel bench js {mode}: {extra}{} msgs x {} B on {:?} (stream {}, {} storage) at {}\n",
        group(s.msgs),
        s.size,
        s.subject,
        s.stream,
        match s.storage {
            BenchStorage::File => "file",
            BenchStorage::Memory => "memory",
        },
        redact(&ctx.conn.server)
    )
}

fn stream_json(mode: &str, ctx: &Ctx, s: &StreamOpts) -> serde_json::Value {
    json!({
        "mode": mode,
        "server": redact(&ctx.conn.server),
        "subject": s.subject,
        "stream": s.stream,
        "storage": match s.storage { BenchStorage::File => "file", BenchStorage::Memory => "memory" },
        "msgs": s.msgs,
        "size": s.size,
    })
}

fn latency_json(l: &Latency) -> serde_json::Value {
    json!({
        "min": round2(l.min),
        "mean": round2(l.mean),
        "p50": round2(l.p50),
        "p90": round2(l.p90),
        "p99": round2(l.p99),
        "max": round2(l.max),
    })
}

async fn bench_pub(ctx: &Ctx, a: &PubArgs, progress: bool) -> Res<Report> {
    check_counts("pubs", a.pubs)?;
    if a.s.msgs == 0 {
        return Err("--msgs must be at least 1".into());
    }
    let clients = ctx.connect_many(a.pubs, publisher_opts).await?;
    check_size(&clients[0], a.s.size)?;
    fresh_stream(&clients[0], ctx, &a.s).await?;
    let bar = Progress::new("publish", a.s.msgs, progress);
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    for (client, count) in clients.iter().cloned().zip(split(a.s.msgs, a.pubs)) {
        let js = context(&client, &ctx.conn, 1);
        let (subject, payload, mut go) = (a.s.subject.clone(), payload_of(a.s.size), go_rx.clone());
        let done = bar.counter();
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let mut nanos = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let t0 = Instant::now();
                js.publish(subject.clone(), payload.clone())
                    .await
                    .map_err(|e| format!("publish failed: {}", js_error(e)))?
                    .await
                    .map_err(|e| format!("publish ack failed: {e}"))?;
                nanos.push(t0.elapsed().as_nanos() as u64);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok((nanos, Instant::now()))
        });
    }
    let start = Instant::now();
    let _ = go_tx.send(true);
    let results = join_all(set).await;
    bar.finish();
    cleanup(&clients[0], ctx, &a.s).await;
    let results = results?;
    let end = results.iter().map(|(_, e)| *e).max().unwrap_or(start);
    let mut nanos: Vec<u64> = results.into_iter().flat_map(|(n, _)| n).collect();
    nanos.sort_unstable();
    let lat = Latency::from_sorted(&nanos);
    let rate = Rate {
        msgs: a.s.msgs,
        bytes: a.s.msgs * a.s.size as u64,
        elapsed: end.saturating_duration_since(start),
    };
    let text = format!(
        "{}{}  latency    min {:.1} us, mean {:.1}, p50 {:.1}, p90 {:.1}, p99 {:.1}, max {:.1} us (publish to ack)\n",
        header("pub", ctx, &a.s, &format!("{}, sync, ", plural(a.pubs, "publisher"))),
        rate.line("publish"),
        lat.min,
        lat.mean,
        lat.p50,
        lat.p90,
        lat.p99,
        lat.max
    );
    let mut json = stream_json("js-pub", ctx, &a.s);
    json["pubs"] = json!(a.pubs);
    json["pub"] = rate.json();
    json["latency_us"] = latency_json(&lat);
    Ok(Report { text, json })
}

async fn bench_pub_async(ctx: &Ctx, a: &PubAsyncArgs, progress: bool) -> Res<Report> {
    check_counts("pubs", a.pubs)?;
    check_counts("inflight", a.inflight)?;
    let clients = ctx.connect_many(a.pubs, publisher_opts).await?;
    check_size(&clients[0], a.s.size)?;
    if a.keys == Some(0) {
        return Err("--keys must be at least 1".into());
    }
    fresh_stream_with(&clients[0], ctx, &a.s, a.keys).await?;
    let bar = Progress::new("publish", a.s.msgs, progress);
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    let mut first = 0u64;
    for (client, count) in clients.iter().cloned().zip(split(a.s.msgs, a.pubs)) {
        let (base, keys) = (first, a.keys);
        first += count;
        let inflight = a.inflight;
        let js = context(&client, &ctx.conn, inflight);
        let (subject, payload, mut go) = (a.s.subject.clone(), payload_of(a.s.size), go_rx.clone());
        let done = bar.counter();
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let mut acks = VecDeque::with_capacity(inflight);
            let ack_err = |e: jetstream::context::PublishError| format!("publish ack failed: {e}");
            for i in 0..count {
                if acks.len() >= inflight {
                    let fut: jetstream::context::PublishAckFuture = acks.pop_front().unwrap();
                    fut.await.map_err(ack_err)?;
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let subj = match keys {
                    Some(k) => format!("{subject}.{}", (base + i) % k),
                    None => subject.clone(),
                };
                acks.push_back(
                    js.publish(subj, payload.clone())
                        .await
                        .map_err(|e| format!("publish failed: {}", js_error(e)))?,
                );
            }
            for fut in acks {
                fut.await.map_err(ack_err)?;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(Instant::now())
        });
    }
    let start = Instant::now();
    let _ = go_tx.send(true);
    let ends = join_all(set).await;
    bar.finish();
    cleanup(&clients[0], ctx, &a.s).await;
    let ends = ends?;
    let rate = Rate {
        msgs: a.s.msgs,
        bytes: a.s.msgs * a.s.size as u64,
        elapsed: ends
            .iter()
            .map(|e| e.saturating_duration_since(start))
            .max()
            .unwrap_or_default(),
    };
    let text = format!(
        "{}{}",
        header(
            "pub-async",
            ctx,
            &a.s,
            &format!(
                "{}, {} in flight, ",
                plural(a.pubs, "publisher"),
                a.inflight
            )
        ),
        rate.line("publish"),
    );
    let mut json = stream_json("js-pub-async", ctx, &a.s);
    json["pubs"] = json!(a.pubs);
    json["inflight"] = json!(a.inflight);
    json["keys"] = json!(a.keys);
    json["pub"] = rate.json();
    Ok(Report { text, json })
}

/// Creates a durable pull consumer with explicit acks.
async fn durable(
    js: &jetstream::Context,
    stream: &str,
    name: &str,
    ack_wait: Duration,
) -> Res<jetstream::consumer::Consumer<pull::Config>> {
    js.create_consumer_on_stream(
        pull::Config {
            durable_name: Some(name.to_string()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait,
            max_ack_pending: 20_000,
            ..Default::default()
        },
        stream,
    )
    .await
    .map_err(|e| format!("cannot create consumer {stream} > {name}: {}", js_error(e)))
}

/// Receives and acks `total` messages; returns the time of the last ack.
async fn consume_all(
    client: Client,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    total: u64,
    batch: usize,
    idle: Duration,
    double: bool,
    done: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Res<Instant> {
    let mut msgs = consumer
        .stream()
        .max_messages_per_batch(batch)
        .expires(
            idle.min(Duration::from_secs(30))
                .max(Duration::from_secs(1)),
        )
        .messages()
        .await
        .map_err(|e| format!("cannot start consuming: {e}"))?;
    let mut got = 0u64;
    while got < total {
        let msg = tokio::time::timeout(idle, msgs.next())
            .await
            .map_err(|_| {
                format!(
                    "received {} of {} messages, then nothing for {idle:?}",
                    group(got),
                    group(total)
                )
            })?
            .ok_or("the consumer's message stream ended")?
            .map_err(|e| format!("receiving failed: {e}"))?;
        if double {
            msg.double_ack().await
        } else {
            msg.ack().await
        }
        .map_err(|e| format!("ack failed: {e}"))?;
        got += 1;
        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    // The last acks must have reached the server.
    client
        .flush()
        .await
        .map_err(|e| format!("flush failed: {e}"))?;
    Ok(Instant::now())
}

async fn bench_consume(ctx: &Ctx, a: &ConsumeArgs, progress: bool) -> Res<Report> {
    check_counts("batch", a.batch)?;
    if a.s.msgs == 0 {
        return Err("--msgs must be at least 1".into());
    }
    let client = ctx.connect().await?;
    check_size(&client, a.s.size)?;
    fresh_stream(&client, ctx, &a.s).await?;
    let result = async {
        fill(&client, ctx, &a.s, progress).await?;
        let consumer_client = ctx
            .conn
            .connect_with(subscriber_opts(ctx.options()))
            .await?;
        let js = context(&consumer_client, &ctx.conn, 1);
        let consumer = durable(
            &js,
            &a.s.stream,
            "keel-bench-consume",
            Duration::from_secs(60),
        )
        .await?;
        let bar = Progress::new("consume", a.s.msgs, progress);
        let cpu0 = a.server_pid.map(crate::bench::cpu_us).transpose()?;
        let start = Instant::now();
        let end = consume_all(
            consumer_client,
            consumer,
            a.s.msgs,
            a.batch,
            ctx.conn.timeout,
            false,
            bar.counter(),
        )
        .await;
        bar.finish();
        let end = end?;
        let cpu = crate::bench::cpu_per_msg(cpu0, a.server_pid, a.s.msgs)?;
        Ok::<_, String>((start, end, cpu))
    }
    .await;
    cleanup(&client, ctx, &a.s).await;
    let (start, end, cpu) = result?;
    let rate = Rate {
        msgs: a.s.msgs,
        bytes: a.s.msgs * a.s.size as u64,
        elapsed: end.saturating_duration_since(start),
    };
    let text = format!(
        "{}{}",
        header(
            "consume",
            ctx,
            &a.s,
            &format!("1 durable pull consumer, explicit ack, batch {}, ", a.batch)
        ),
        rate.line("consume"),
    );
    let mut json = stream_json("js-consume", ctx, &a.s);
    json["batch"] = json!(a.batch);
    json["consume"] = rate.json();
    json["server_cpu_us_per_msg"] = json!(cpu);
    Ok(Report { text, json })
}

async fn bench_fanout(ctx: &Ctx, a: &FanoutArgs, progress: bool) -> Res<Report> {
    check_counts("consumers", a.consumers)?;
    check_counts("batch", a.batch)?;
    let client = ctx.connect().await?;
    check_size(&client, a.s.size)?;
    fresh_stream(&client, ctx, &a.s).await?;
    let result = async {
        fill(&client, ctx, &a.s, progress).await?;
        let clients = ctx.connect_many(a.consumers, subscriber_opts).await?;
        let mut consumers = Vec::new();
        for (k, c) in clients.iter().enumerate() {
            let js = context(c, &ctx.conn, 1);
            consumers.push(
                durable(
                    &js,
                    &a.s.stream,
                    &format!("keel-fanout-{k}"),
                    Duration::from_secs(60),
                )
                .await?,
            );
        }
        let total = a.s.msgs * a.consumers as u64;
        let bar = Progress::new("fan-out", total, progress);
        let (go_tx, go_rx) = watch::channel(false);
        let mut set = JoinSet::new();
        for (c, consumer) in clients.into_iter().zip(consumers) {
            let (msgs, batch, idle, done) = (a.s.msgs, a.batch, ctx.conn.timeout, bar.counter());
            let double = a.doubleack;
            let mut go = go_rx.clone();
            set.spawn(async move {
                wait_for_start(&mut go).await?;
                consume_all(c, consumer, msgs, batch, idle, double, done).await
            });
        }
        let cpu0 = a.server_pid.map(crate::bench::cpu_us).transpose()?;
        let start = Instant::now();
        let _ = go_tx.send(true);
        let ends = join_all(set).await;
        bar.finish();
        let ends = ends?;
        let total = a.s.msgs * a.consumers as u64;
        let cpu = crate::bench::cpu_per_msg(cpu0, a.server_pid, total)?;
        Ok::<_, String>((start, ends, cpu))
    }
    .await;
    cleanup(&client, ctx, &a.s).await;
    let (start, ends, cpu) = result?;
    let elapsed = ends
        .iter()
        .map(|e| e.saturating_duration_since(start))
        .max()
        .unwrap_or_default();
    let total = a.s.msgs * a.consumers as u64;
    let rate = Rate {
        msgs: total,
        bytes: total * a.s.size as u64,
        elapsed,
    };
    let text = format!(
        "{}{}",
        header(
            "fanout",
            ctx,
            &a.s,
            &format!(
                "{} (each gets every message{}), ",
                plural(a.consumers, "durable"),
                if a.doubleack { ", confirmed acks" } else { "" }
            )
        ),
        rate.line("consume"),
    );
    let mut json = stream_json("js-fanout", ctx, &a.s);
    json["consumers"] = json!(a.consumers);
    json["batch"] = json!(a.batch);
    json["doubleack"] = json!(a.doubleack);
    json["consume"] = rate.json();
    json["server_cpu_us_per_msg"] = json!(cpu);
    Ok(Report { text, json })
}

async fn bench_mem(ctx: &Ctx, a: &MemArgs, progress: bool) -> Res<Report> {
    check_counts("consumers", a.consumers)?;
    let client = ctx.connect().await?;
    check_size(&client, a.s.size)?;
    fresh_stream(&client, ctx, &a.s).await?;
    let result = async {
        fill(&client, ctx, &a.s, progress).await?;
        // Let the server settle after the fill before the baseline reading.
        tokio::time::sleep(a.settle).await;
        let before = a.server_pid.map(rss_kib).transpose()?;
        let js = context(&client, &ctx.conn, 1);
        let bar = Progress::new("consumers", a.consumers as u64, progress);
        let t0 = Instant::now();
        let fetch = a.fetch;
        let stream_name = a.s.stream.clone();
        let done = bar.counter();
        let pending: Vec<usize> = futures::stream::iter(0..a.consumers)
            .map(|k| {
                let (js, stream_name, done) = (js.clone(), stream_name.clone(), done.clone());
                async move {
                    // A long ack wait keeps the fetched messages pending.
                    let c = durable(
                        &js,
                        &stream_name,
                        &format!("mem-{k:05}"),
                        Duration::from_secs(3600),
                    )
                    .await?;
                    let mut got = 0;
                    if fetch > 0 {
                        let mut batch = c
                            .fetch()
                            .max_messages(fetch)
                            .expires(Duration::from_secs(2))
                            .messages()
                            .await
                            .map_err(|e| format!("fetch failed: {e}"))?;
                        while let Some(m) = batch.next().await {
                            m.map_err(|e| format!("fetch failed: {e}"))?;
                            got += 1;
                        }
                    }
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok::<usize, String>(got)
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<Res<usize>>>()
            .await
            .into_iter()
            .collect::<Res<Vec<usize>>>()?;
        bar.finish();
        let create_time = t0.elapsed();
        tokio::time::sleep(a.settle).await;
        let after = a.server_pid.map(rss_kib).transpose()?;
        Ok::<_, String>((before, after, create_time, pending.iter().sum::<usize>()))
    }
    .await;
    cleanup(&client, ctx, &a.s).await;
    let (before, after, create_time, pending) = result?;
    let mut text = format!(
        "{}  created {} with {} pending acks in total in {create_time:.2?}\n",
        header(
            "consumers-mem",
            ctx,
            &a.s,
            &format!(
                "{} fetching {} each, ",
                plural(a.consumers, "durable"),
                a.fetch
            )
        ),
        plural(a.consumers, "consumer"),
        group(pending as u64),
    );
    let per = match (before, after) {
        (Some(b), Some(af)) => {
            let per = (af as f64 - b as f64) / a.consumers as f64;
            text += &format!(
                "  server pid {} VmRSS: {b} KiB with the stream, {af} KiB with the consumers ({per:+.1} KiB per consumer)\n",
                a.server_pid.unwrap_or_default()
            );
            Some(round2(per))
        }
        _ => None,
    };
    let mut json = stream_json("js-consumers-mem", ctx, &a.s);
    json["consumers"] = json!(a.consumers);
    json["fetch"] = json!(a.fetch);
    json["pending_acks"] = json!(pending);
    json["create_s"] = json!(create_time.as_secs_f64());
    json["server_pid"] = json!(a.server_pid);
    json["rss_before_kib"] = json!(before);
    json["rss_kib"] = json!(after);
    json["rss_per_consumer_kib"] = json!(per);
    Ok(Report { text, json })
}
