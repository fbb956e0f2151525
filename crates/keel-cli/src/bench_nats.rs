//! The `nats bench` grammar and meaning: `bench sub` waits for another
//! process's publishes, `bench service request|serve`, `bench js pub
//! sync|async`, `bench js ordered|consume|fetch` on the `benchstream` stream
//! (which `js pub --create` makes and nothing deletes), with the nats CLI's
//! report lines and `--csv` columns. Each client has its own connection and
//! its own sample; the aggregate spans the earliest start to the latest end.

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
    check_counts, check_size, join_all, parse_size, payload_of, publisher_opts, split,
    subscriber_opts, wait_for_start, Ctx, Report,
};
use crate::util::{group, parse_bytes, parse_headers, redact, Progress, Res};

pub const DEFAULT_STREAM: &str = "benchstream";
pub const DEFAULT_CONSUMER: &str = "nats-bench";

/// Flags every nats-style benchmark takes.
#[derive(Args, Debug, Clone)]
pub struct CommonFlags {
    /// Number of concurrent clients, each on its own connection
    #[arg(long, default_value_t = 1)]
    pub clients: usize,
    /// Number of messages to publish or receive (split between the clients)
    #[arg(long, default_value_t = 100_000)]
    pub msgs: u64,
    /// Message size, e.g. 128B, 1KB, 64KiB (K/M are 1024-based, as in nats bench)
    #[arg(long, default_value = "128B", value_parser = parse_size)]
    pub size: usize,
    /// Save the per-client results to this CSV file (the nats bench columns)
    #[arg(long, value_name = "FILE")]
    pub csv: Option<String>,
    /// Do not draw progress bars
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Args, Debug)]
pub struct SubBench {
    /// Subject to subscribe to
    pub subject: String,
    #[command(flatten)]
    pub c: CommonFlags,
}

#[derive(Subcommand, Debug)]
pub enum ServiceMode {
    /// Send requests and wait for each reply (latency percentiles)
    Request(ServiceRequest),
    /// Answer requests (echoing the payload) until interrupted
    Serve(ServiceServe),
}

#[derive(Args, Debug)]
pub struct ServiceRequest {
    /// Subject to send requests to
    pub subject: String,
    #[command(flatten)]
    pub c: CommonFlags,
    /// Pause between requests
    #[arg(long, value_name = "DURATION", value_parser = crate::util::parse_duration)]
    pub sleep: Option<Duration>,
    /// Header as key:value (repeatable)
    #[arg(short = 'H', long = "header", value_name = "KEY:VALUE")]
    pub headers: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ServiceServe {
    /// Subject to answer on (in the queue group nats-bench-service)
    pub subject: String,
    #[command(flatten)]
    pub c: CommonFlags,
    /// Pause before each reply
    #[arg(long, value_name = "DURATION", value_parser = crate::util::parse_duration)]
    pub sleep: Option<Duration>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum StorageArg {
    File,
    Memory,
}

/// Stream flags of `bench js pub sync|async`.
#[derive(Args, Debug)]
pub struct JsPubFlags {
    /// Subject to publish to
    pub subject: String,
    #[command(flatten)]
    pub c: CommonFlags,
    /// The stream to use
    #[arg(long, default_value = DEFAULT_STREAM)]
    pub stream: String,
    /// Create (or update) the stream first, storing SUBJECT
    #[arg(long)]
    pub create: bool,
    /// Storage of the stream created with --create
    #[arg(long, value_enum, default_value = "file")]
    pub storage: StorageArg,
    /// Replicas of the stream created with --create
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Largest size of the stream created with --create
    #[arg(long, default_value = "1GB")]
    pub maxbytes: String,
    /// Purge the stream before publishing
    #[arg(long)]
    pub purge: bool,
    /// Pause between publishes
    #[arg(long, value_name = "DURATION", value_parser = crate::util::parse_duration)]
    pub sleep: Option<Duration>,
}

#[derive(Subcommand, Debug)]
pub enum JsPubMode {
    /// Publish and wait for each ack
    Sync(JsPubSync),
    /// Publish with up to --batch acks outstanding per client
    Async(JsPubAsync),
}

#[derive(Args, Debug)]
pub struct JsPubSync {
    #[command(flatten)]
    pub f: JsPubFlags,
}

#[derive(Args, Debug)]
pub struct JsPubAsync {
    #[command(flatten)]
    pub f: JsPubFlags,
    /// Publishes awaiting their ack at once, per client
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AckMode {
    Explicit,
    None,
    All,
}

#[derive(Args, Debug)]
pub struct JsConsumeFlags {
    #[command(flatten)]
    pub c: CommonFlags,
    /// The stream to read (filled by `bench js pub ... --create`)
    #[arg(long, default_value = DEFAULT_STREAM)]
    pub stream: String,
    /// Durable consumer to use (created or updated)
    #[arg(long, default_value = DEFAULT_CONSUMER)]
    pub consumer: String,
    /// Messages buffered per pull
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Acknowledgement mode
    #[arg(long, value_enum, default_value = "explicit")]
    pub acks: AckMode,
    /// Wait for the server to confirm each ack
    #[arg(long)]
    pub doubleack: bool,
    /// Only messages on these subjects (repeatable)
    #[arg(long, value_name = "SUBJECTS")]
    pub filter: Vec<String>,
}

#[derive(Args, Debug)]
pub struct JsOrdered {
    #[command(flatten)]
    pub c: CommonFlags,
    /// The stream to read
    #[arg(long, default_value = DEFAULT_STREAM)]
    pub stream: String,
    /// Only messages on this subject
    #[arg(long, value_name = "SUBJECT")]
    pub filter: Option<String>,
}

/// One client's measurement, as nats bench's BenchSample.
pub(crate) struct Sample {
    pub(crate) msgs: u64,
    pub(crate) bytes: u64,
    pub(crate) start: Instant,
    pub(crate) end: Instant,
    /// Sorted nanoseconds, when the mode measures latency.
    pub(crate) latencies: Vec<u64>,
}

impl Sample {
    fn secs(&self) -> f64 {
        self.end
            .saturating_duration_since(self.start)
            .as_secs_f64()
            .max(1e-9)
    }
    fn rate(&self) -> u64 {
        (self.msgs as f64 / self.secs()) as u64
    }
    fn throughput(&self) -> f64 {
        self.bytes as f64 / self.secs()
    }
}

fn pct(l: &[u64], p: f64) -> f64 {
    if l.is_empty() {
        return 0.0;
    }
    let idx = ((p / 100.0) * l.len() as f64).ceil() as usize;
    l[idx.clamp(1, l.len()) - 1] as f64 / 1e3
}

fn avg(l: &[u64]) -> f64 {
    if l.is_empty() {
        return 0.0;
    }
    l.iter().map(|&x| x as f64).sum::<f64>() / l.len() as f64 / 1e3
}

fn stddev(l: &[u64]) -> f64 {
    if l.is_empty() {
        return 0.0;
    }
    let m = avg(l) * 1e3;
    (l.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / l.len() as f64).sqrt() / 1e3
}

fn us(x: f64) -> String {
    let whole = group(x.trunc() as u64);
    let frac = ((x.fract() * 100.0).round() as u64).min(99);
    if frac == 0 {
        whole
    } else {
        format!("{whole}.{frac:02}")
    }
}

fn ibytes_f(x: f64) -> String {
    crate::output::ibytes(x as u64)
}

/// All samples of one run, with the nats bench report and CSV.
pub(crate) struct Results {
    pub(crate) label: &'static str,
    /// "P" for publishers, "S" for subscribers (the CSV's ClientID prefix).
    pub(crate) prefix: &'static str,
    pub(crate) samples: Vec<Sample>,
}

impl Results {
    fn line(s: &Sample) -> String {
        let base = format!(
            "{} msgs/sec ~ {}/sec",
            group(s.rate()),
            ibytes_f(s.throughput())
        );
        if s.latencies.is_empty() {
            return base;
        }
        let l = &s.latencies;
        format!(
            "{base} ~ min: {}us ~ avg: {}us ~ max: {}us ~ P50: {}us ~ P90: {}us ~ P99: {}us ~ P99.9: {}us",
            us(pct(l, 0.0)),
            us(avg(l)),
            us(pct(l, 100.0)),
            us(pct(l, 50.0)),
            us(pct(l, 90.0)),
            us(pct(l, 99.0)),
            us(pct(l, 99.9))
        )
    }

    fn aggregate(&self) -> Sample {
        let mut latencies: Vec<u64> = self
            .samples
            .iter()
            .flat_map(|s| s.latencies.iter().copied())
            .collect();
        latencies.sort_unstable();
        Sample {
            msgs: self.samples.iter().map(|s| s.msgs).sum(),
            bytes: self.samples.iter().map(|s| s.bytes).sum(),
            start: self
                .samples
                .iter()
                .map(|s| s.start)
                .min()
                .unwrap_or_else(Instant::now),
            end: self
                .samples
                .iter()
                .map(|s| s.end)
                .max()
                .unwrap_or_else(Instant::now),
            latencies,
        }
    }

    pub(crate) fn report(&self) -> String {
        if self.samples.is_empty() {
            return "No publisher or subscribers. Nothing to report.\n".into();
        }
        if self.samples.len() == 1 {
            return format!(
                "NATS {} stats: {}\n",
                self.label,
                Results::line(&self.samples[0])
            );
        }
        let mut out = String::new();
        for (k, s) in self.samples.iter().enumerate() {
            out += &format!(
                " [{}] {} ({} msgs)\n",
                k + 1,
                Results::line(s),
                group(s.msgs)
            );
        }
        let agg = self.aggregate();
        let rates: Vec<u64> = self.samples.iter().map(Sample::rate).collect();
        let mean = rates.iter().sum::<u64>() / rates.len() as u64;
        let sd = (rates
            .iter()
            .map(|&r| (r as f64 - mean as f64).powi(2))
            .sum::<f64>()
            / rates.len() as f64)
            .sqrt();
        out += &format!(
            "\n NATS {} aggregated stats: {} msgs/sec ~ {}/sec\n",
            self.label,
            group(agg.rate()),
            ibytes_f(agg.throughput())
        );
        out += &format!(
            " message rates min {} | avg {} | max {} | stddev {} msgs\n",
            group(rates.iter().copied().min().unwrap_or(0)),
            group(mean),
            group(rates.iter().copied().max().unwrap_or(0)),
            group(sd as u64)
        );
        if !agg.latencies.is_empty() {
            let l = &agg.latencies;
            out += &format!(
                " latencies per operation min {}us | avg {}us | max {}us | stddev {}us | P50 {}us | P90 {}us | P99 {}us | P99.9: {}us\n",
                us(pct(l, 0.0)),
                us(avg(l)),
                us(pct(l, 100.0)),
                us(stddev(l)),
                us(pct(l, 50.0)),
                us(pct(l, 90.0)),
                us(pct(l, 99.0)),
                us(pct(l, 99.9))
            );
        }
        out
    }

    /// The nats bench CSV: a header, then one row per client.
    pub(crate) fn csv(&self) -> String {
        let run_id = crate::output::now_ns().to_string();
        let lat = self.samples.iter().any(|s| !s.latencies.is_empty());
        let mut out =
            String::from("#RunID,ClientID,MsgCount,MsgBytes,MsgsPerSec,BytesPerSec,DurationSecs");
        if lat {
            out += ",MinLatencyMicroSecs,AvgLatencyMicroSecs,MaxLatencyMicroSecs,P50LatencyMicroSecs,P90LatencyMicroSecs,P99LatencyMicroSecs,P99.9LatencyMicroSecs,StdDevLatencyMicroSecs";
        }
        out.push('\n');
        for (k, s) in self.samples.iter().enumerate() {
            out += &format!(
                "{run_id},{}{k},{},{},{},{:.6},{:.6}",
                self.prefix,
                s.msgs,
                s.bytes,
                s.rate(),
                s.throughput(),
                s.secs()
            );
            if lat {
                let l = &s.latencies;
                out += &format!(
                    ",{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6}",
                    pct(l, 0.0),
                    avg(l),
                    pct(l, 100.0),
                    pct(l, 50.0),
                    pct(l, 90.0),
                    pct(l, 99.0),
                    pct(l, 99.9),
                    stddev(l)
                );
            }
            out.push('\n');
        }
        out
    }

    /// The report in both forms, plus the CSV file when asked for.
    pub(crate) fn finish(
        &self,
        mode: &str,
        ctx: &Ctx,
        c: &CommonFlags,
        banner: String,
    ) -> Res<Report> {
        let mut text = format!("{banner}\n{}", self.report());
        if let Some(path) = &c.csv {
            std::fs::write(path, self.csv()).map_err(|e| format!("writing file {path}: {e}"))?;
            text += &format!("Saved metric data in csv file {path}\n");
        }
        let agg = self.aggregate();
        let per: Vec<_> = self
            .samples
            .iter()
            .map(|s| json!({ "msgs": s.msgs, "bytes": s.bytes, "elapsed_s": s.secs(), "msgs_per_s": s.rate() }))
            .collect();
        let mut json = json!({
            "mode": mode,
            "server": redact(&ctx.conn.server),
            "clients": c.clients,
            "msgs": agg.msgs,
            "size": c.size,
            "msgs_per_s": agg.rate(),
            "bytes_per_s": agg.throughput().round(),
            "elapsed_s": agg.secs(),
            "per_client": per,
        });
        if !agg.latencies.is_empty() {
            let l = &agg.latencies;
            json["latency_us"] = json!({
                "min": pct(l, 0.0), "avg": avg(l), "max": pct(l, 100.0),
                "p50": pct(l, 50.0), "p90": pct(l, 90.0), "p99": pct(l, 99.0), "p99_9": pct(l, 99.9),
            });
        }
        Ok(Report { text, json })
    }
}

fn banner(what: &str, c: &CommonFlags, subject: &str, extra: &str) -> String {
    format!(
        "Starting {what} benchmark [subject={subject}, multisubject=false, multisubjectmax=0, msgs={}, msgsize={}, clients={}{extra}]",
        group(c.msgs),
        crate::output::ibytes(c.size as u64),
        c.clients
    )
}

/// `bench sub`: every client subscribes and waits for --msgs messages from
/// another process; its clock runs from its first message to its last.
pub async fn sub(ctx: &Ctx, a: &SubBench, progress: bool) -> Res<Report> {
    check_counts("clients", a.c.clients)?;
    let clients = ctx.connect_many(a.c.clients, subscriber_opts).await?;
    let bar = Progress::new(
        "received",
        a.c.msgs * a.c.clients as u64,
        progress && !a.c.no_progress,
    );
    let mut set = JoinSet::new();
    for client in clients {
        let mut sub = client
            .subscribe(a.subject.clone())
            .await
            .map_err(|e| format!("cannot subscribe to {:?}: {e}", a.subject))?;
        crate::util::round_trip(&client, ctx.conn.timeout).await?;
        let (expected, size, done) = (a.c.msgs, a.c.size, bar.counter());
        set.spawn(async move {
            let _keep = client;
            let first = sub
                .next()
                .await
                .ok_or("subscription closed by the server")?;
            let start = Instant::now();
            let mut bytes = first.payload.len() as u64;
            let mut got = 1u64;
            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            while got < expected {
                let m = sub
                    .next()
                    .await
                    .ok_or("subscription closed by the server")?;
                got += 1;
                bytes += m.payload.len() as u64;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let _ = size;
            Ok(Sample {
                msgs: got,
                bytes,
                start,
                end: Instant::now(),
                latencies: Vec::new(),
            })
        });
    }
    // Tests and scripts wait for this line before they publish.
    eprintln!(
        "Waiting for {} messages on {:?} per client",
        group(a.c.msgs),
        a.subject
    );
    let samples = join_all(set).await?;
    bar.finish();
    let r = Results {
        label: "Core NATS subscriber",
        prefix: "S",
        samples,
    };
    r.finish(
        "sub",
        ctx,
        &a.c,
        banner("Core NATS subscriber", &a.c, &a.subject, ""),
    )
}

pub async fn service(ctx: &Ctx, m: &ServiceMode, progress: bool) -> Res<Report> {
    match m {
        ServiceMode::Request(a) => service_request(ctx, a, progress).await,
        ServiceMode::Serve(a) => service_serve(ctx, a).await,
    }
}

async fn service_request(ctx: &Ctx, a: &ServiceRequest, progress: bool) -> Res<Report> {
    check_counts("clients", a.c.clients)?;
    let clients = ctx.connect_many(a.c.clients, publisher_opts).await?;
    check_size(&clients[0], a.c.size)?;
    let headers = parse_headers(&a.headers)?;
    let bar = Progress::new("requests", a.c.msgs, progress && !a.c.no_progress);
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    for (client, count) in clients.into_iter().zip(split(a.c.msgs, a.c.clients)) {
        let (subject, payload, mut go) = (a.subject.clone(), payload_of(a.c.size), go_rx.clone());
        let (headers, sleep, timeout, done) =
            (headers.clone(), a.sleep, ctx.conn.timeout, bar.counter());
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let start = Instant::now();
            let mut lat = Vec::with_capacity(count as usize);
            for k in 0..count {
                if let Some(d) = sleep.filter(|_| k > 0) {
                    tokio::time::sleep(d).await;
                }
                let t0 = Instant::now();
                let mut req = async_nats::Request::new().payload(payload.clone()).timeout(Some(timeout));
                if let Some(h) = &headers {
                    req = req.headers(h.clone());
                }
                client
                    .send_request(subject.clone(), req)
                    .await
                    .map_err(|e| format!("request on {subject:?} failed: {e} (is `keel bench service serve {subject}` running?)"))?;
                lat.push(t0.elapsed().as_nanos() as u64);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            lat.sort_unstable();
            Ok(Sample { msgs: count, bytes: count * payload.len() as u64, start, end: Instant::now(), latencies: lat })
        });
    }
    let _ = go_tx.send(true);
    let samples = join_all(set).await?;
    bar.finish();
    let r = Results {
        label: "Core NATS service requester",
        prefix: "P",
        samples,
    };
    r.finish(
        "service-request",
        ctx,
        &a.c,
        banner("Core NATS service requester", &a.c, &a.subject, ""),
    )
}

async fn service_serve(ctx: &Ctx, a: &ServiceServe) -> Res<Report> {
    check_counts("clients", a.c.clients)?;
    let clients = ctx.connect_many(a.c.clients, subscriber_opts).await?;
    let mut set = JoinSet::new();
    for client in clients {
        let mut sub = client
            .queue_subscribe(a.subject.clone(), "nats-bench-service".to_string())
            .await
            .map_err(|e| format!("cannot subscribe to {:?}: {e}", a.subject))?;
        crate::util::round_trip(&client, ctx.conn.timeout).await?;
        let sleep = a.sleep;
        set.spawn(async move {
            while let Some(m) = sub.next().await {
                if let Some(d) = sleep {
                    tokio::time::sleep(d).await;
                }
                if let Some(r) = m.reply {
                    client
                        .publish(r, m.payload)
                        .await
                        .map_err(|e| format!("reply failed: {e}"))?;
                }
            }
            Ok::<(), String>(())
        });
    }
    eprintln!(
        "Serving requests on {:?} with {} clients until interrupted",
        a.subject, a.c.clients
    );
    join_all(set).await?;
    Err("connection to the server was closed".into())
}

fn js_ctx(client: &Client, ctx: &Ctx, inflight: usize) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(ctx.conn.timeout)
        .api_prefix(ctx.conn.js_api_prefix.clone())
        .max_ack_inflight(inflight.max(1))
        .build(client.clone())
}

/// `--create` makes or updates the stream; `--purge` empties it.
async fn prepare_stream(ctx: &Ctx, client: &Client, f: &JsPubFlags) -> Res<()> {
    crate::js::check_name("stream", &f.stream)?;
    let js = js_ctx(client, ctx, 1);
    if f.create {
        let max_bytes = parse_bytes(&f.maxbytes).map_err(|e| format!("--maxbytes: {e}"))?;
        let cfg = stream::Config {
            name: f.stream.clone(),
            subjects: vec![f.subject.clone()],
            storage: match f.storage {
                StorageArg::File => stream::StorageType::File,
                StorageArg::Memory => stream::StorageType::Memory,
            },
            num_replicas: f.replicas,
            max_bytes,
            ..Default::default()
        };
        js.create_or_update_stream(cfg)
            .await
            .map_err(|e| format!("creating the stream {}: {e}", f.stream))?;
    }
    let mut s = js.get_stream(&f.stream).await.map_err(|e| {
        format!(
            "stream {} not found ({e}): create it with --create, e.g. `keel bench js pub sync {} --create`",
            f.stream, f.subject
        )
    })?;
    if f.purge {
        s.purge()
            .await
            .map_err(|e| format!("purging stream {}: {e}", f.stream))?;
    }
    let _ = s.info().await;
    Ok(())
}

pub async fn js_pub(ctx: &Ctx, m: &JsPubMode, progress: bool) -> Res<Report> {
    let (f, batch, sync) = match m {
        JsPubMode::Sync(a) => (&a.f, 1, true),
        JsPubMode::Async(a) => (&a.f, a.batch, false),
    };
    check_counts("clients", f.c.clients)?;
    check_counts("batch", batch)?;
    let clients = ctx.connect_many(f.c.clients, publisher_opts).await?;
    check_size(&clients[0], f.c.size)?;
    prepare_stream(ctx, &clients[0], f).await?;
    let bar = Progress::new("publish", f.c.msgs, progress && !f.c.no_progress);
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    for (client, count) in clients.iter().zip(split(f.c.msgs, f.c.clients)) {
        let js = js_ctx(client, ctx, batch);
        let (subject, payload, mut go, done, sleep) = (
            f.subject.clone(),
            payload_of(f.c.size),
            go_rx.clone(),
            bar.counter(),
            f.sleep,
        );
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let start = Instant::now();
            let mut lat = Vec::new();
            let mut acks = VecDeque::with_capacity(batch);
            let ack_err = |e: jetstream::context::PublishError| format!("publish ack failed: {e}");
            for k in 0..count {
                if let Some(d) = sleep.filter(|_| k > 0) {
                    tokio::time::sleep(d).await;
                }
                let t0 = Instant::now();
                let fut = js
                    .publish(subject.clone(), payload.clone())
                    .await
                    .map_err(|e| format!("publish failed: {e}"))?;
                if sync {
                    fut.await.map_err(ack_err)?;
                    lat.push(t0.elapsed().as_nanos() as u64);
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    continue;
                }
                acks.push_back(fut);
                if acks.len() >= batch {
                    let fut: jetstream::context::PublishAckFuture = acks.pop_front().unwrap();
                    fut.await.map_err(ack_err)?;
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            for fut in acks {
                fut.await.map_err(ack_err)?;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            lat.sort_unstable();
            Ok(Sample {
                msgs: count,
                bytes: count * payload.len() as u64,
                start,
                end: Instant::now(),
                latencies: lat,
            })
        });
    }
    let _ = go_tx.send(true);
    let samples = join_all(set).await?;
    bar.finish();
    let label = if sync {
        "JetStream synchronous publisher"
    } else {
        "JetStream asynchronous publisher"
    };
    let r = Results {
        label,
        prefix: "P",
        samples,
    };
    let extra = format!(", stream={}, batch={batch}", f.stream);
    r.finish(
        if sync { "js-pub-sync" } else { "js-pub-async" },
        ctx,
        &f.c,
        banner(label, &f.c, &f.subject, &extra),
    )
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ConsumeKind {
    Consume,
    Fetch,
}

async fn stream_messages(ctx: &Ctx, client: &Client, stream: &str) -> Res<u64> {
    let js = js_ctx(client, ctx, 1);
    let mut s = js.get_stream(stream).await.map_err(|e| {
        format!("stream {stream} not found ({e}): fill it first, e.g. `keel bench js pub sync SUBJECT --create`")
    })?;
    let info = s
        .info()
        .await
        .map_err(|e| format!("stream {stream}: {e}"))?;
    Ok(info.state.messages)
}

/// `bench js consume|fetch`: the clients share one durable pull consumer.
pub async fn js_consume(
    ctx: &Ctx,
    a: &JsConsumeFlags,
    kind: ConsumeKind,
    progress: bool,
) -> Res<Report> {
    check_counts("clients", a.c.clients)?;
    check_counts("batch", a.batch)?;
    let clients = ctx.connect_many(a.c.clients, subscriber_opts).await?;
    let stored = stream_messages(ctx, &clients[0], &a.stream).await?;
    if stored < a.c.msgs {
        return Err(format!(
            "stream {} holds {} messages, fewer than --msgs {}: publish more first",
            a.stream,
            group(stored),
            group(a.c.msgs)
        ));
    }
    let js = js_ctx(&clients[0], ctx, 1);
    js.create_consumer_on_stream(
        pull::Config {
            durable_name: Some(a.consumer.clone()),
            ack_policy: match a.acks {
                AckMode::Explicit => jetstream::consumer::AckPolicy::Explicit,
                AckMode::All => jetstream::consumer::AckPolicy::All,
                AckMode::None => jetstream::consumer::AckPolicy::None,
            },
            max_ack_pending: (a.batch * a.c.clients) as i64,
            inactive_threshold: Duration::from_secs(10),
            filter_subjects: a.filter.clone(),
            ..Default::default()
        },
        a.stream.as_str(),
    )
    .await
    .map_err(|e| format!("creating the durable consumer '{}': {e}", a.consumer))?;
    let bar = Progress::new("receive", a.c.msgs, progress && !a.c.no_progress);
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    for (client, count) in clients.iter().zip(split(a.c.msgs, a.c.clients)) {
        let js = js_ctx(client, ctx, 1);
        let consumer: jetstream::consumer::Consumer<pull::Config> = js
            .get_consumer_from_stream(&a.consumer, &a.stream)
            .await
            .map_err(|e| format!("cannot load consumer {}: {e}", a.consumer))?;
        let (batch, acks, double, idle, done, mut go) = (
            a.batch,
            a.acks,
            a.doubleack,
            ctx.conn.timeout,
            bar.counter(),
            go_rx.clone(),
        );
        let client = client.clone();
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let start = Instant::now();
            let (mut got, mut bytes) = (0u64, 0u64);
            let mut handle = |m: jetstream::Message, got: u64| async move {
                let last_of_batch = got.is_multiple_of(batch as u64) || got == count;
                match acks {
                    AckMode::None => Ok(()),
                    AckMode::All if !last_of_batch => Ok(()),
                    _ if double => m.double_ack().await.map_err(|e| format!("ack failed: {e}")),
                    _ => m.ack().await.map_err(|e| format!("ack failed: {e}")),
                }
            };
            let timeout_err = |got: u64| {
                format!(
                    "received {} of {} messages, then nothing for {idle:?}",
                    group(got),
                    group(count)
                )
            };
            match kind {
                ConsumeKind::Consume => {
                    let mut msgs = consumer
                        .stream()
                        .max_messages_per_batch(batch)
                        .messages()
                        .await
                        .map_err(|e| format!("cannot consume: {e}"))?;
                    while got < count {
                        let m = tokio::time::timeout(idle, msgs.next())
                            .await
                            .map_err(|_| timeout_err(got))?
                            .ok_or("the consumer's message stream ended")?
                            .map_err(|e| format!("receiving failed: {e}"))?;
                        got += 1;
                        bytes += m.payload.len() as u64;
                        handle(m, got).await?;
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                ConsumeKind::Fetch => {
                    while got < count {
                        let want = batch.min((count - got) as usize);
                        let mut b = consumer
                            .fetch()
                            .max_messages(want)
                            .expires(idle)
                            .messages()
                            .await
                            .map_err(|e| format!("fetch failed: {e}"))?;
                        let before = got;
                        while let Some(m) = b.next().await {
                            let m = m.map_err(|e| format!("fetch failed: {e}"))?;
                            got += 1;
                            bytes += m.payload.len() as u64;
                            handle(m, got).await?;
                            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        if got == before {
                            return Err(timeout_err(got));
                        }
                    }
                }
            }
            let _ = &mut handle;
            client
                .flush()
                .await
                .map_err(|e| format!("flush failed: {e}"))?;
            Ok(Sample {
                msgs: got,
                bytes,
                start,
                end: Instant::now(),
                latencies: Vec::new(),
            })
        });
    }
    let _ = go_tx.send(true);
    let samples = join_all(set).await?;
    bar.finish();
    let (label, mode) = match kind {
        ConsumeKind::Consume => ("JetStream durable consumer (callback)", "js-consume"),
        ConsumeKind::Fetch => ("JetStream durable consumer (fetch)", "js-fetch"),
    };
    let r = Results {
        label,
        prefix: "S",
        samples,
    };
    let extra = format!(
        ", stream={}, consumer={}, batch={}, acks={:?}",
        a.stream, a.consumer, a.batch, a.acks
    )
    .to_lowercase();
    r.finish(mode, ctx, &a.c, banner(label, &a.c, &a.stream, &extra))
}

/// `bench js ordered`: every client reads its share through its own ordered consumer.
pub async fn js_ordered(ctx: &Ctx, a: &JsOrdered, progress: bool) -> Res<Report> {
    check_counts("clients", a.c.clients)?;
    let clients = ctx.connect_many(a.c.clients, subscriber_opts).await?;
    let stored = stream_messages(ctx, &clients[0], &a.stream).await?;
    if stored < a.c.msgs.div_ceil(a.c.clients as u64) {
        return Err(format!(
            "stream {} holds {} messages, fewer than each client must read: publish more first",
            a.stream,
            group(stored)
        ));
    }
    let bar = Progress::new("receive", a.c.msgs, progress && !a.c.no_progress);
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    for (client, count) in clients.iter().zip(split(a.c.msgs, a.c.clients)) {
        let js = js_ctx(client, ctx, 1);
        let s = js
            .get_stream(&a.stream)
            .await
            .map_err(|e| format!("stream {}: {e}", a.stream))?;
        let consumer = s
            .create_consumer(pull::OrderedConfig {
                filter_subject: a.filter.clone().unwrap_or_default(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("cannot create an ordered consumer: {e}"))?;
        let (idle, done, mut go) = (ctx.conn.timeout, bar.counter(), go_rx.clone());
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let start = Instant::now();
            let mut msgs = consumer
                .messages()
                .await
                .map_err(|e| format!("cannot consume: {e}"))?;
            let (mut got, mut bytes) = (0u64, 0u64);
            while got < count {
                let m = tokio::time::timeout(idle, msgs.next())
                    .await
                    .map_err(|_| {
                        format!(
                            "received {} of {} messages, then nothing for {idle:?}",
                            group(got),
                            group(count)
                        )
                    })?
                    .ok_or("the consumer's message stream ended")?
                    .map_err(|e| format!("receiving failed: {e}"))?;
                got += 1;
                bytes += m.payload.len() as u64;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(Sample {
                msgs: got,
                bytes,
                start,
                end: Instant::now(),
                latencies: Vec::new(),
            })
        });
    }
    let _ = go_tx.send(true);
    let samples = join_all(set).await?;
    bar.finish();
    let label = "JetStream ordered ephemeral consumer";
    let r = Results {
        label,
        prefix: "S",
        samples,
    };
    r.finish(
        "js-ordered",
        ctx,
        &a.c,
        banner(label, &a.c, &a.stream, &format!(", stream={}", a.stream)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_and_csv_as_nats_bench() {
        let t0 = Instant::now();
        let s = |msgs: u64, ms: u64, lat: Vec<u64>| Sample {
            msgs,
            bytes: msgs * 128,
            start: t0,
            end: t0 + Duration::from_millis(ms),
            latencies: lat,
        };
        let one = Results {
            label: "Core NATS publisher",
            prefix: "P",
            samples: vec![s(1000, 1000, vec![])],
        };
        assert_eq!(
            one.report(),
            "NATS Core NATS publisher stats: 1,000 msgs/sec ~ 125 KiB/sec\n"
        );
        let csv = one.csv();
        let mut lines = csv.lines();
        assert_eq!(
            lines.next(),
            Some("#RunID,ClientID,MsgCount,MsgBytes,MsgsPerSec,BytesPerSec,DurationSecs")
        );
        let row: Vec<&str> = lines.next().unwrap().split(',').collect();
        assert_eq!(&row[1..5], &["P0", "1000", "128000", "1000"]);
        let two = Results {
            label: "JetStream synchronous publisher",
            prefix: "P",
            samples: vec![
                s(500, 1000, vec![1000, 2000]),
                s(500, 500, vec![3000, 4000]),
            ],
        };
        let r = two.report();
        assert!(r.contains(" [1] 500 msgs/sec"), "{r}");
        assert!(r.contains(" [2] 1,000 msgs/sec"), "{r}");
        assert!(r.contains("aggregated stats: 1,000 msgs/sec"), "{r}");
        assert!(
            r.contains("message rates min 500 | avg 750 | max 1,000"),
            "{r}"
        );
        assert!(r.contains("P50 2us"), "{r}");
        assert!(two.csv().starts_with("#RunID,ClientID,MsgCount,MsgBytes,MsgsPerSec,BytesPerSec,DurationSecs,MinLatencyMicroSecs"));
    }
}

pub const DEFAULT_BUCKET: &str = "benchbucket";

#[derive(Subcommand, Debug)]
pub enum KvMode {
    /// Put values into the bucket (keys 0, 1, 2, ... split between the clients)
    Put(KvPut),
    /// Get values from the bucket
    Get(KvGet),
}

#[derive(Args, Debug)]
pub struct KvFlags {
    #[command(flatten)]
    pub c: CommonFlags,
    /// The bucket to use (benchbucket is created when missing)
    #[arg(long, default_value = DEFAULT_BUCKET)]
    pub bucket: String,
    /// Use random keys between 0 and this number (0: sequential keys)
    #[arg(long, default_value_t = 0)]
    pub randomize: u64,
    /// Pause after each operation
    #[arg(long, value_name = "DURATION", value_parser = crate::util::parse_duration)]
    pub sleep: Option<Duration>,
}

#[derive(Args, Debug)]
pub struct KvPut {
    #[command(flatten)]
    pub f: KvFlags,
    /// Storage of the bucket when created
    #[arg(long, value_enum, default_value = "file")]
    pub storage: StorageArg,
    /// Replicas of the bucket when created
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Largest size of the bucket when created
    #[arg(long, default_value = "1GB")]
    pub maxbytes: String,
    /// History kept per key when created
    #[arg(long, default_value_t = 1)]
    pub history: i64,
    /// Delete the bucket first (there is no purge of a whole bucket)
    #[arg(long)]
    pub purge: bool,
}

#[derive(Args, Debug)]
pub struct KvGet {
    #[command(flatten)]
    pub f: KvFlags,
}

/// A tiny xorshift for `--randomize`: benchmark keys need spread, not quality.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

pub async fn kv(ctx: &Ctx, m: &KvMode, progress: bool) -> Res<Report> {
    let (f, put) = match m {
        KvMode::Put(a) => (&a.f, Some(a)),
        KvMode::Get(a) => (&a.f, None),
    };
    check_counts("clients", f.c.clients)?;
    crate::js::check_name("bucket", &f.bucket)?;
    let clients = ctx.connect_many(f.c.clients, publisher_opts).await?;
    check_size(&clients[0], f.c.size)?;
    let js = js_ctx(&clients[0], ctx, 1);
    if let Some(p) = put {
        if p.purge {
            let _ = js.delete_key_value(&f.bucket).await;
        }
        if f.bucket == DEFAULT_BUCKET && js.get_key_value(&f.bucket).await.is_err() {
            js.create_key_value(jetstream::kv::Config {
                bucket: f.bucket.clone(),
                description: "nats bench bucket".into(),
                history: p.history,
                storage: match p.storage {
                    StorageArg::File => stream::StorageType::File,
                    StorageArg::Memory => stream::StorageType::Memory,
                },
                num_replicas: p.replicas,
                max_bytes: parse_bytes(&p.maxbytes).map_err(|e| format!("--maxbytes: {e}"))?,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating the bucket {}: {e}", f.bucket))?;
        }
    }
    let bar = Progress::new(
        if put.is_some() { "put" } else { "get" },
        f.c.msgs,
        progress && !f.c.no_progress,
    );
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    let mut offset = 0u64;
    for (k, (client, count)) in clients.iter().zip(split(f.c.msgs, f.c.clients)).enumerate() {
        let store = js_ctx(client, ctx, 1)
            .get_key_value(&f.bucket)
            .await
            .map_err(|e| {
                format!(
                    "finding kv bucket '{}': {e} (create it with `keel bench kv put`)",
                    f.bucket
                )
            })?;
        let (payload, mut go, done, sleep, randomize) = (
            payload_of(f.c.size),
            go_rx.clone(),
            bar.counter(),
            f.sleep,
            f.randomize,
        );
        let is_put = put.is_some();
        let first = offset;
        offset += count;
        let mut seed = (crate::output::now_ns() as u64)
            ^ (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            | 1;
        set.spawn(async move {
            wait_for_start(&mut go).await?;
            let start = Instant::now();
            let mut lat = Vec::with_capacity(count as usize);
            let mut bytes = 0u64;
            for i in 0..count {
                let key = if randomize > 0 {
                    next_random(&mut seed) % randomize
                } else {
                    first + i
                }
                .to_string();
                let t0 = Instant::now();
                if is_put {
                    store
                        .put(&key, payload.clone())
                        .await
                        .map_err(|e| format!("putting: {e}"))?;
                    bytes += payload.len() as u64;
                } else {
                    let v = store
                        .get(&key)
                        .await
                        .map_err(|e| format!("getting: {e}"))?
                        .ok_or_else(|| {
                            format!("key {key} not found (put it first with `keel bench kv put`)")
                        })?;
                    bytes += v.len() as u64;
                }
                lat.push(t0.elapsed().as_nanos() as u64);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Some(d) = sleep {
                    tokio::time::sleep(d).await;
                }
            }
            lat.sort_unstable();
            Ok(Sample {
                msgs: count,
                bytes,
                start,
                end: Instant::now(),
                latencies: lat,
            })
        });
    }
    let _ = go_tx.send(true);
    let samples = join_all(set).await?;
    bar.finish();
    let (label, prefix, mode) = if put.is_some() {
        ("KV putter", "P", "kv-put")
    } else {
        ("KV getter", "S", "kv-get")
    };
    let r = Results {
        label,
        prefix,
        samples,
    };
    r.finish(
        mode,
        ctx,
        &f.c,
        banner(label, &f.c, &f.bucket, &format!(", bucket={}", f.bucket)),
    )
}
