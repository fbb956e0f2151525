//! `keel stream report|find|view|rmm|seal|copy|backup|restore`.
//!
//! Backups use Keel's own directory format, because the `nats` CLI's
//! (`stream.tar.s2`) is nats-server's internal file store, made by a server
//! snapshot API that Keel does not have. A backup directory holds:
//!
//! - `backup.json`: `{"format": "keel-stream-backup", "version": 1, "config": ...,
//!   "state": ..., "consumers": [consumer configs], "messages": N,
//!   "messages_sha256": hex}`; `config` and `state` are the stream info's own.
//! - `messages.jsonl`: one stored message per line, with the JetStream API's
//!   field names: `{"seq", "subject", "time", "hdrs" (base64), "data" (base64)}`.
//!
//! A restore checks the count and the SHA-256 before it creates anything, keeps
//! every sequence number (gaps are re-created and the next sequence continues
//! where the original stream's did), then applies the original limits and seal.
//! Message times become the restore time; consumers are re-created from their
//! configuration, without their delivery and ack state.

use std::io::{BufRead, Write};
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use async_nats::HeaderMap;
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::js::{check_name, stream_error, Js};
use crate::output::{
    base64_decode, base64_encode, fmt_time, fmt_time_ns, i, ibytes, n, now_ns, parse_time,
    print_json, s, u, Table,
};
use crate::stream::{apply_flags, load_config_file, show, StreamFlags};
use crate::util::{confirm, header_lines, parse_duration, Progress, Res};

const FORMAT: &str = "keel-stream-backup";
/// The shortest duplicate window servers accept; a restore waits this long
/// before replaying a repeated `Nats-Msg-Id`, so no message is deduplicated.
const DEDUP_WINDOW: Duration = Duration::from_millis(100);

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Only streams that store this subject
    #[arg(long)]
    subject: Option<String>,
    /// Sort by number of consumers
    #[arg(short = 'o', long)]
    consumers: bool,
    /// Sort by number of messages
    #[arg(short = 'm', long)]
    messages: bool,
    /// Sort by name
    #[arg(short = 'n', long)]
    name: bool,
    /// Sort by storage type
    #[arg(short = 't', long)]
    storage: bool,
    /// Show raw numbers
    #[arg(short, long)]
    raw: bool,
    /// Include system streams (KV_, OBJ_)
    #[arg(short, long)]
    all: bool,
}

#[derive(Args, Debug)]
pub struct FindArgs {
    /// Streams with no messages
    #[arg(long)]
    empty: bool,
    /// Streams with no new messages or consumer deliveries for this long
    #[arg(long, value_name = "DURATION")]
    idle: Option<String>,
    /// Streams created longer ago than this
    #[arg(long, value_name = "DURATION")]
    created: Option<String>,
    /// Streams with fewer consumers than this
    #[arg(long, value_name = "THRESHOLD")]
    consumers: Option<u64>,
    /// Streams that store subjects matching this subject or wildcard
    #[arg(long)]
    subject: Option<String>,
    /// Streams with at most this many replicas
    #[arg(long, value_name = "REPLICAS")]
    replicas: Option<i64>,
    /// Print only the names
    #[arg(short, long)]
    names: bool,
    /// Invert the checks (before becomes after, with becomes without)
    #[arg(long)]
    invert: bool,
    /// Include system streams (KV_, OBJ_)
    #[arg(short, long)]
    all: bool,
}

#[derive(Args, Debug)]
pub struct ViewArgs {
    /// Stream name
    stream: String,
    /// Page size (at most 25)
    #[arg(default_value_t = 10)]
    size: usize,
    /// Start at this message sequence
    #[arg(long)]
    id: Option<u64>,
    /// Start with messages received this long ago, e.g. 1h
    #[arg(long, value_name = "DURATION")]
    since: Option<String>,
    /// Only messages on this subject
    #[arg(long)]
    subject: Option<String>,
    /// Print only the message bodies
    #[arg(long)]
    raw: bool,
}

#[derive(Args, Debug)]
pub struct RmmArgs {
    /// Stream name
    stream: String,
    /// Sequence of the message to remove
    id: u64,
    /// Remove without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct SealArgs {
    /// Stream name
    stream: String,
    /// Seal without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Stream to copy the configuration of
    source: String,
    /// Name of the new stream
    destination: String,
    #[command(flatten)]
    flags: StreamFlags,
}

#[derive(Args, Debug)]
pub struct BackupArgs {
    /// Stream to back up
    stream: String,
    /// Directory to create the backup in (must not exist or be empty)
    target: String,
    /// Do not draw a progress bar
    #[arg(long)]
    no_progress: bool,
    /// Do not include the consumers' configurations
    #[arg(long)]
    no_consumers: bool,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// The backup directory
    file: String,
    /// Use this stream configuration (JSON file) instead of the backed-up one
    #[arg(long, value_name = "FILE")]
    config: Option<String>,
    /// Number of replicas of the restored stream
    #[arg(long)]
    replicas: Option<i64>,
    /// Do not draw a progress bar
    #[arg(long)]
    no_progress: bool,
}

fn system(name: &str) -> bool {
    name.starts_with("KV_") || name.starts_with("OBJ_")
}

pub async fn report(js: &Js, a: &ReportArgs, json_out: bool) -> Res<()> {
    let filter = match &a.subject {
        Some(sub) => json!({ "subject": sub }),
        None => json!({}),
    };
    let mut infos = js
        .paged("STREAM.LIST", "streams", filter)
        .await
        .map_err(String::from)?;
    infos.retain(|i| a.all || !system(s(&i["config"], "name")));
    if !json_out {
        print!("Obtaining Stream stats\n\n");
    }
    let key = |i: &Value| -> (u64, String) {
        let st = &i["state"];
        let name = s(&i["config"], "name").to_string();
        if a.consumers {
            (u(st, "consumer_count"), name)
        } else if a.messages {
            (u(st, "messages"), name)
        } else if a.name {
            (0, name)
        } else if a.storage {
            (u64::from(s(&i["config"], "storage") == "memory"), name)
        } else {
            (u(st, "bytes"), name)
        }
    };
    infos.sort_by_key(key);
    if json_out {
        let rows: Vec<Value> = infos
            .iter()
            .map(|info| {
                let (cfg, st) = (&info["config"], &info["state"]);
                json!({
                    "name": s(cfg, "name"),
                    "storage": s(cfg, "storage"),
                    "consumers": u(st, "consumer_count"),
                    "msgs": u(st, "messages"),
                    "bytes": u(st, "bytes"),
                    "deleted": u(st, "num_deleted"),
                    "replicas": i(cfg, "num_replicas").max(1),
                })
            })
            .collect();
        print_json(&Value::Array(rows));
        return Ok(());
    }
    if infos.is_empty() {
        println!("No Streams defined");
        return Ok(());
    }
    let mut t = Table::new(
        "Stream Report",
        &[
            "Stream",
            "Storage",
            "Placement",
            "Consumers",
            "Messages",
            "Bytes",
            "Lost",
            "Deleted",
            "API Level",
            "Replicas",
        ],
    );
    for info in &infos {
        let (cfg, st) = (&info["config"], &info["state"]);
        let fmt = |x: u64| if a.raw { x.to_string() } else { n(x) };
        let lost = &st["lost"];
        let lost = match lost["msgs"].as_array().map(Vec::len).unwrap_or(0) {
            0 => "0".to_string(),
            k if a.raw => format!("{k} ({})", u(lost, "bytes")),
            k => format!("{} ({})", n(k as u64), ibytes(u(lost, "bytes"))),
        };
        t.add(vec![
            s(cfg, "name").to_string(),
            if s(cfg, "storage") == "memory" {
                "Memory"
            } else {
                "File"
            }
            .to_string(),
            s(&cfg["placement"], "cluster").to_string(),
            fmt(u(st, "consumer_count")),
            fmt(u(st, "messages")),
            if a.raw {
                u(st, "bytes").to_string()
            } else {
                ibytes(u(st, "bytes"))
            },
            lost,
            fmt(u(st, "num_deleted")),
            cfg["metadata"]["_nats.req.level"]
                .as_str()
                .unwrap_or("0")
                .to_string(),
            i(cfg, "num_replicas").max(1).to_string(),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

fn ns_ago(d: &str, flag: &str) -> Res<i128> {
    let d = parse_duration(d).map_err(|e| format!("--{flag}: {e}"))?;
    Ok(now_ns() - d.as_nanos() as i128)
}

pub async fn find(js: &Js, a: &FindArgs, json_out: bool) -> Res<()> {
    let filter = match &a.subject {
        Some(sub) => json!({ "subject": sub }),
        None => json!({}),
    };
    let mut infos = js
        .paged("STREAM.LIST", "streams", filter)
        .await
        .map_err(String::from)?;
    infos.retain(|i| a.all || !system(s(&i["config"], "name")));
    let idle_before = a.idle.as_deref().map(|d| ns_ago(d, "idle")).transpose()?;
    let created_before = a
        .created
        .as_deref()
        .map(|d| ns_ago(d, "created"))
        .transpose()?;
    let mut found = Vec::new();
    for info in infos {
        let (cfg, st) = (&info["config"], &info["state"]);
        let name = s(cfg, "name").to_string();
        let mut ok = true;
        let mut check = |cond: bool| ok &= cond != a.invert;
        if a.empty {
            check(u(st, "messages") == 0);
        }
        if let Some(limit) = a.consumers {
            check(u(st, "consumer_count") < limit);
        }
        if let Some(r) = a.replicas {
            check(i(cfg, "num_replicas").max(1) <= r);
        }
        if let Some(before) = created_before {
            check(parse_time(s(&info, "created")).is_some_and(|t| t < before));
        }
        if let Some(before) = idle_before {
            // Idle: neither a message stored nor a delivery by any consumer since then.
            let mut last = parse_time(s(st, "last_ts")).unwrap_or(0);
            if u(st, "consumer_count") > 0 {
                let consumers = js
                    .paged(&format!("CONSUMER.LIST.{name}"), "consumers", json!({}))
                    .await
                    .map_err(stream_error(&name))?;
                for c in consumers {
                    if let Some(t) = c["delivered"]["last_active"].as_str().and_then(parse_time) {
                        last = last.max(t);
                    }
                }
            }
            check(last < before);
        }
        if ok {
            found.push(info);
        }
    }
    found.sort_by(|x, y| s(&x["config"], "name").cmp(s(&y["config"], "name")));
    let names: Vec<&str> = found.iter().map(|i| s(&i["config"], "name")).collect();
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&names).unwrap_or_default()
        );
    } else if a.names {
        for name in names {
            println!("{name}");
        }
    } else if found.is_empty() {
        println!("No matching streams");
    } else {
        println!("{}", crate::stream::streams_table("Streams".into(), &found));
    }
    Ok(())
}

/// A short-lived, unacknowledged pull consumer for reading a stream in order.
pub(crate) async fn reader(
    js: &Js,
    stream: &str,
    mut cfg: Map<String, Value>,
) -> Res<(jetstream::consumer::Consumer<pull::Config>, String, u64)> {
    cfg.insert("ack_policy".into(), json!("none"));
    cfg.insert("inactive_threshold".into(), json!(30_000_000_000u64));
    cfg.insert("mem_storage".into(), json!(true));
    cfg.insert("num_replicas".into(), json!(1));
    let resp = js
        .api(
            &format!("CONSUMER.CREATE.{stream}"),
            Some(&json!({ "stream_name": stream, "config": cfg })),
        )
        .await
        .map_err(stream_error(stream))?;
    let name = s(&resp, "name").to_string();
    let pending = u(&resp, "num_pending");
    let consumer = js
        .ctx
        .get_consumer_from_stream(&name, stream)
        .await
        .map_err(|e| format!("cannot read stream {stream}: {e}"))?;
    Ok((consumer, name, pending))
}

pub(crate) async fn drop_reader(js: &Js, stream: &str, name: &str) {
    let _ = js
        .api(&format!("CONSUMER.DELETE.{stream}.{name}"), None)
        .await;
}

/// The NATS header block for a header map, as the server stores it.
fn header_block(h: &HeaderMap) -> Vec<u8> {
    let mut out = b"NATS/1.0\r\n".to_vec();
    for (name, values) in h.iter() {
        for v in values {
            out.extend_from_slice(format!("{name}: {v}\r\n").as_bytes());
        }
    }
    out.extend_from_slice(b"\r\n");
    out
}

pub async fn view(js: &Js, a: &ViewArgs) -> Res<()> {
    let info = js.stream_info(&a.stream).await?;
    let size = if a.size > 25 {
        eprintln!("Page size is limited to 25, setting to 25...");
        25
    } else {
        a.size.max(1)
    };
    let mut cfg = Map::new();
    match (a.id, &a.since) {
        (Some(_), Some(_)) => return Err("--id and --since cannot be combined".into()),
        (Some(id), None) => {
            cfg.insert("deliver_policy".into(), json!("by_start_sequence"));
            cfg.insert("opt_start_seq".into(), json!(id));
        }
        (None, Some(d)) => {
            cfg.insert("deliver_policy".into(), json!("by_start_time"));
            cfg.insert(
                "opt_start_time".into(),
                json!(crate::output::rfc3339_ns(ns_ago(d, "since")?)),
            );
        }
        (None, None) => {
            cfg.insert("deliver_policy".into(), json!("all"));
        }
    }
    if let Some(sub) = &a.subject {
        cfg.insert("filter_subject".into(), json!(sub));
    }
    if u(&info["state"], "messages") == 0 {
        eprintln!("Reached apparent end of data");
        return Ok(());
    }
    let (consumer, name, pending) = reader(js, &a.stream, cfg).await?;
    if pending == 0 {
        drop_reader(js, &a.stream, &name).await;
        eprintln!("Reached apparent end of data");
        return Ok(());
    }
    let result = async {
        let mut msgs = consumer
            .stream()
            .max_messages_per_batch(size)
            .messages()
            .await
            .map_err(|e| format!("cannot read stream {}: {e}", a.stream))?;
        let mut shown = 0usize;
        loop {
            let msg = tokio::time::timeout(js.timeout, msgs.next())
                .await
                .map_err(|_| {
                    format!(
                        "no message from stream {} within {:?}",
                        a.stream, js.timeout
                    )
                })?
                .ok_or("the stream of messages ended")?
                .map_err(|e| format!("reading stream {} failed: {e}", a.stream))?;
            let meta = msg
                .info()
                .map_err(|e| format!("bad message metadata: {e}"))?;
            let last = meta.pending == 0;
            if a.raw {
                println!("{}", String::from_utf8_lossy(&msg.payload));
            } else {
                println!(
                    "[{}] Subject: {} Received: {}",
                    meta.stream_sequence,
                    msg.subject,
                    fmt_time_ns(meta.published.unix_timestamp_nanos())
                );
                if let Some(h) = msg.headers.as_ref().filter(|h| !h.is_empty()) {
                    println!();
                    for l in header_lines(h) {
                        println!("  {l}");
                    }
                }
                println!();
                println!("{}", String::from_utf8_lossy(&msg.payload));
                println!();
            }
            shown += 1;
            if last {
                eprintln!("Reached apparent end of data");
                return Ok(());
            }
            if shown.is_multiple_of(size) {
                // Like nats: ask for the next page; without a terminal, one page.
                if !crate::util::stdin_is_terminal() {
                    return Ok(());
                }
                eprint!("? Next Page? (Y/n) ");
                let mut answer = String::new();
                std::io::stdin()
                    .read_line(&mut answer)
                    .map_err(|e| format!("cannot read the answer: {e}"))?;
                if matches!(answer.trim().to_ascii_lowercase().as_str(), "n" | "no") {
                    return Ok(());
                }
            }
        }
    }
    .await;
    drop_reader(js, &a.stream, &name).await;
    result
}

pub async fn rmm(js: &Js, a: &RmmArgs) -> Res<()> {
    js.stream_info(&a.stream).await?;
    if a.id == 0 {
        return Err("the message sequence must be at least 1".into());
    }
    if !confirm(
        &format!("Really remove message {} from Stream {}", a.id, a.stream),
        a.force,
    )? {
        return Ok(());
    }
    // Without no_erase the server overwrites the message: a secure removal.
    js.api(
        &format!("STREAM.MSG.DELETE.{}", a.stream),
        Some(&json!({ "seq": a.id })),
    )
    .await
    .map_err(|e| match e.err_code() {
        Some(10057) | Some(crate::js::ERR_NO_MESSAGE_FOUND) => {
            format!("no message with sequence {} in stream {}", a.id, a.stream)
        }
        _ => stream_error(&a.stream)(e),
    })?;
    println!("Removed message {} from Stream {}", a.id, a.stream);
    Ok(())
}

pub async fn seal(js: &Js, a: &SealArgs, json_out: bool) -> Res<()> {
    let info = js.stream_info(&a.stream).await?;
    if !confirm(
        &format!(
            "Really seal Stream {}, sealed streams can not be unsealed or modified",
            a.stream
        ),
        a.force,
    )? {
        return Ok(());
    }
    let mut cfg = info["config"].as_object().cloned().unwrap_or_default();
    cfg.insert("sealed".into(), json!(true));
    let info = js
        .api(
            &format!("STREAM.UPDATE.{}", a.stream),
            Some(&Value::Object(cfg)),
        )
        .await
        .map_err(|e| format!("cannot seal stream {}: {}", a.stream, String::from(e)))?;
    show(&info, json_out, false);
    Ok(())
}

pub async fn copy(js: &Js, a: &CopyArgs, json_out: bool) -> Res<()> {
    check_name("stream", &a.destination)?;
    let info = js.stream_info(&a.source).await?;
    let mut cfg = info["config"].as_object().cloned().unwrap_or_default();
    cfg.insert("name".into(), json!(a.destination));
    // The copy starts empty and open even if the source was sealed.
    cfg.remove("sealed");
    cfg.remove("first_seq");
    apply_flags(&mut cfg, &a.flags, true)?;
    let info = js
        .api(
            &format!("STREAM.CREATE.{}", a.destination),
            Some(&Value::Object(cfg)),
        )
        .await
        .map_err(|e| match e.err_code() {
            Some(10065) => format!(
                "cannot create stream {}: its subjects overlap with {}'s; give new ones with --subjects",
                a.destination, a.source
            ),
            _ => format!("cannot create stream {}: {}", a.destination, String::from(e)),
        })?;
    if !json_out {
        println!("Stream {} was created\n", a.destination);
    }
    show(&info, json_out, false);
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub async fn backup(js: &Js, a: &BackupArgs) -> Res<()> {
    let info = js.stream_info(&a.stream).await?;
    let dir = Path::new(&a.target);
    if dir.exists()
        && std::fs::read_dir(dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(format!(
            "backup target {} already exists and is not empty",
            dir.display()
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let consumers = if a.no_consumers {
        Vec::new()
    } else {
        js.paged(
            &format!("CONSUMER.LIST.{}", a.stream),
            "consumers",
            json!({}),
        )
        .await
        .map_err(stream_error(&a.stream))?
        .into_iter()
        .map(|c| c["config"].clone())
        .collect()
    };
    let st = &info["state"];
    let total = u(st, "messages");
    let msgs_path = dir.join("messages.jsonl");
    let file = std::fs::File::create(&msgs_path)
        .map_err(|e| format!("cannot create {}: {e}", msgs_path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let mut sha = Sha256::new();
    let mut count = 0u64;
    let mut bytes = 0u64;
    let bar = Progress::new("backup", total, !a.no_progress);
    if total > 0 {
        let (consumer, name, _) = reader(
            js,
            &a.stream,
            Map::from_iter([("deliver_policy".into(), json!("all"))]),
        )
        .await?;
        let res = async {
            let mut msgs = consumer
                .stream()
                .max_messages_per_batch(500)
                .messages()
                .await
                .map_err(|e| format!("cannot read stream {}: {e}", a.stream))?;
            loop {
                let msg = tokio::time::timeout(js.timeout.max(Duration::from_secs(5)), msgs.next())
                    .await
                    .map_err(|_| format!("stream {} stopped sending messages", a.stream))?
                    .ok_or("the stream of messages ended")?
                    .map_err(|e| format!("reading stream {} failed: {e}", a.stream))?;
                let meta = msg
                    .info()
                    .map_err(|e| format!("bad message metadata: {e}"))?;
                let mut line = Map::new();
                line.insert("seq".into(), json!(meta.stream_sequence));
                line.insert("subject".into(), json!(msg.subject.as_str()));
                line.insert(
                    "time".into(),
                    json!(crate::output::rfc3339_ns(
                        meta.published.unix_timestamp_nanos()
                    )),
                );
                if let Some(h) = msg.headers.as_ref().filter(|h| !h.is_empty()) {
                    line.insert("hdrs".into(), json!(base64_encode(&header_block(h))));
                }
                line.insert("data".into(), json!(base64_encode(&msg.payload)));
                let mut text = Value::Object(line).to_string();
                text.push('\n');
                sha.update(text.as_bytes());
                out.write_all(text.as_bytes())
                    .map_err(|e| format!("cannot write {}: {e}", msgs_path.display()))?;
                count += 1;
                bytes += msg.payload.len() as u64;
                bar.add(1);
                if meta.pending == 0 {
                    return Ok::<(), String>(());
                }
            }
        }
        .await;
        drop_reader(js, &a.stream, &name).await;
        res?;
    }
    bar.finish();
    out.into_inner()
        .map_err(|e| format!("cannot write {}: {e}", msgs_path.display()))?
        .sync_all()
        .map_err(|e| format!("cannot write {}: {e}", msgs_path.display()))?;
    let meta = json!({
        "format": FORMAT,
        "version": 1,
        "created": crate::output::rfc3339_ns(now_ns()),
        "config": info["config"],
        "state": info["state"],
        "consumers": consumers,
        "messages": count,
        "messages_sha256": hex(&sha.finalize()),
    });
    let meta_path = dir.join("backup.json");
    std::fs::write(
        &meta_path,
        serde_json::to_string_pretty(&meta).unwrap_or_default(),
    )
    .and_then(|()| std::fs::File::open(&meta_path)?.sync_all())
    .map_err(|e| format!("cannot write {}: {e}", meta_path.display()))?;
    println!(
        "Backed up {} messages ({}) and {} consumers of stream {} to {}",
        n(count),
        ibytes(bytes),
        consumers.len(),
        a.stream,
        dir.display()
    );
    Ok(())
}

struct BackedUpMsg {
    seq: u64,
    subject: String,
    hdrs: Option<Vec<u8>>,
    data: Vec<u8>,
}

/// What a first pass over `messages.jsonl` found.
struct Scan {
    count: u64,
    first: Option<u64>,
    last: Option<(u64, String)>,
}

fn parse_line(line: &[u8], k: usize, path: &Path, last: u64) -> Res<BackedUpMsg> {
    let bad = |what: &str| format!("{} line {}: {what}", path.display(), k + 1);
    let v: Value = serde_json::from_slice(line).map_err(|e| bad(&format!("invalid JSON: {e}")))?;
    let seq = u(&v, "seq");
    if seq <= last {
        return Err(bad("sequences must increase"));
    }
    let hdrs = match v.get("hdrs").and_then(Value::as_str) {
        Some(h) => Some(base64_decode(h).map_err(|e| bad(&e))?),
        None => None,
    };
    Ok(BackedUpMsg {
        seq,
        subject: s(&v, "subject").to_string(),
        hdrs,
        data: base64_decode(s(&v, "data")).map_err(|e| bad(&e))?,
    })
}

/// Reads the message file line by line (memory stays bounded by one
/// message), calling `each` for every message; returns the file's SHA-256.
fn each_message(path: &Path, mut each: impl FnMut(BackedUpMsg) -> Res<()>) -> Res<String> {
    let file =
        std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut sha = Sha256::new();
    let mut last = 0u64;
    for (k, line) in std::io::BufReader::new(file).split(b'\n').enumerate() {
        let line = line.map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        sha.update(&line);
        sha.update(b"\n");
        let m = parse_line(&line, k, path, last)?;
        last = m.seq;
        each(m)?;
    }
    Ok(hex(&sha.finalize()))
}

/// Checks a backup (format, count, SHA-256) before anything is created on the server.
fn scan_backup(dir: &Path) -> Res<(Value, Scan)> {
    if dir.join("stream.tar.s2").exists() {
        return Err(format!(
            "{} is a nats-server snapshot (stream.tar.s2, nats-server's internal file store); \
             keel restores only `keel stream backup` directories",
            dir.display()
        ));
    }
    let meta_path = dir.join("backup.json");
    let meta: Value = std::fs::read_to_string(&meta_path)
        .map_err(|e| format!("cannot read {}: {e}", meta_path.display()))
        .and_then(|t| {
            serde_json::from_str(&t)
                .map_err(|e| format!("{}: invalid JSON: {e}", meta_path.display()))
        })?;
    if s(&meta, "format") != FORMAT || u(&meta, "version") != 1 {
        return Err(format!(
            "{} is not a keel stream backup (format {FORMAT:?} version 1)",
            meta_path.display()
        ));
    }
    let msgs_path = dir.join("messages.jsonl");
    let mut scan = Scan {
        count: 0,
        first: None,
        last: None,
    };
    let sha = each_message(&msgs_path, |m| {
        scan.count += 1;
        scan.first.get_or_insert(m.seq);
        scan.last = Some((m.seq, m.subject));
        Ok(())
    })?;
    if scan.count != u(&meta, "messages") {
        return Err(format!(
            "{} holds {} messages, but backup.json says {}: the backup is incomplete",
            msgs_path.display(),
            scan.count,
            u(&meta, "messages")
        ));
    }
    if sha != s(&meta, "messages_sha256") {
        return Err(format!(
            "{} does not match the SHA-256 in backup.json: the backup is damaged",
            msgs_path.display()
        ));
    }
    Ok((meta, scan))
}

/// Rebuilds a header map from a stored header block, without the
/// `Nats-Expected-*` preconditions (the original publish already passed them).
fn headers_of(block: &[u8]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for line in String::from_utf8_lossy(block).split("\r\n").skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            let k = k.trim();
            if !k.is_empty() && !k.to_ascii_lowercase().starts_with("nats-expected-") {
                h.append(k, v.trim());
            }
        }
    }
    h
}

/// Publishes in order with up to `WINDOW` acks outstanding, checking that each
/// message got exactly the sequence it had.
struct Replayer<'a> {
    js: &'a Js,
    stream: &'a str,
    pending: std::collections::VecDeque<(u64, jetstream::context::PublishAckFuture)>,
    gaps: Vec<u64>,
}

const WINDOW: usize = 256;

impl Replayer<'_> {
    async fn send(
        &mut self,
        seq: u64,
        subject: String,
        headers: HeaderMap,
        data: Bytes,
    ) -> Res<()> {
        if self.pending.len() >= WINDOW {
            self.settle_one().await?;
        }
        let fut = self
            .js
            .ctx
            .publish_with_headers(subject, headers, data)
            .await
            .map_err(|e| format!("restore publish failed: {e}"))?;
        self.pending.push_back((seq, fut));
        Ok(())
    }

    /// A gap (a deleted message): a placeholder, removed once everything is in.
    async fn gap(&mut self, seq: u64, subject: String) -> Res<()> {
        let mut h = HeaderMap::new();
        h.insert("Keel-Restore-Gap", "1");
        self.gaps.push(seq);
        self.send(seq, subject, h, Bytes::new()).await
    }

    async fn settle_one(&mut self) -> Res<()> {
        if let Some((seq, fut)) = self.pending.pop_front() {
            let ack = fut
                .await
                .map_err(|e| format!("restore publish failed: {e}"))?;
            if ack.duplicate || ack.sequence != seq {
                return Err(format!(
                    "message {seq} was stored as {} (duplicate: {}): stream {} is incomplete; remove it and check the backup",
                    ack.sequence, ack.duplicate, self.stream
                ));
            }
        }
        Ok(())
    }

    async fn finish(mut self) -> Res<()> {
        while !self.pending.is_empty() {
            self.settle_one().await?;
        }
        for seq in std::mem::take(&mut self.gaps) {
            self.js
                .api(
                    &format!("STREAM.MSG.DELETE.{}", self.stream),
                    Some(&json!({ "seq": seq, "no_erase": true })),
                )
                .await
                .map_err(|e| {
                    format!(
                        "cannot remove restore placeholder {seq}: {}",
                        String::from(e)
                    )
                })?;
        }
        Ok(())
    }
}

pub async fn restore(js: &Js, a: &RestoreArgs, json_out: bool) -> Res<()> {
    let dir = Path::new(&a.file);
    let (meta, scan) = scan_backup(dir)?;
    let mut cfg = match &a.config {
        Some(path) => {
            let mut m = load_config_file(path)?;
            // `stream info --json` output works too.
            if let Some(Value::Object(c)) = m.remove("config") {
                m = c;
            }
            m
        }
        None => meta["config"].as_object().cloned().unwrap_or_default(),
    };
    if let Some(r) = a.replicas {
        cfg.insert("num_replicas".into(), json!(r));
    }
    let name = s(&Value::Object(cfg.clone()), "name").to_string();
    check_name("stream", &name)?;
    if js.api(&format!("STREAM.INFO.{name}"), None).await.is_ok() {
        return Err(format!(
            "stream {name} already exists: remove it first, or restore with --config naming another stream"
        ));
    }
    let state = &meta["state"];
    let first = scan.first.unwrap_or_else(|| u(state, "first_seq").max(1));
    let last_seq = u(state, "last_seq").max(scan.last.as_ref().map(|l| l.0).unwrap_or(0));
    // Restore into a stream without limits, seals or delete bans, so every
    // message lands at its old sequence; the real configuration comes last.
    let mut open = cfg.clone();
    for (k, v) in [
        ("max_msgs", json!(-1)),
        ("max_bytes", json!(-1)),
        ("max_age", json!(0)),
        ("max_msgs_per_subject", json!(-1)),
        ("discard", json!("old")),
        ("sealed", json!(false)),
        ("deny_delete", json!(false)),
        ("deny_purge", json!(false)),
        ("duplicate_window", json!(DEDUP_WINDOW.as_nanos() as u64)),
        ("first_seq", json!(first)),
    ] {
        open.insert(k.into(), v);
    }
    open.remove("discard_new_per_subject");
    js.api(&format!("STREAM.CREATE.{name}"), Some(&Value::Object(open)))
        .await
        .map_err(|e| format!("cannot create stream {name}: {}", String::from(e)))?;
    let bar = Progress::new("restore", scan.count, !a.no_progress);
    let mut replay = Replayer {
        js,
        stream: &name,
        pending: Default::default(),
        gaps: Vec::new(),
    };
    let mut next = first;
    let mut recent_ids: std::collections::HashMap<String, std::time::Instant> = Default::default();
    // Parsing is synchronous, publishing is not: read in slices of messages.
    let msgs_path = dir.join("messages.jsonl");
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Res<BackedUpMsg>>(WINDOW);
    let reader_path = msgs_path.clone();
    let reader = tokio::task::spawn_blocking(move || {
        each_message(&reader_path, |m| {
            tx.blocking_send(Ok(m))
                .map_err(|_| "restore stopped".to_string())
        })
    });
    while let Some(m) = rx.recv().await {
        let m = m?;
        while next < m.seq {
            replay.gap(next, m.subject.clone()).await?;
            next += 1;
        }
        let headers = m.hdrs.as_deref().map(headers_of).unwrap_or_default();
        if let Some(id) = headers.get("Nats-Msg-Id").map(|v| v.to_string()) {
            if recent_ids.contains_key(&id) {
                // A repeated id inside the window would be deduplicated: once the
                // earlier one is stored, wait the window out.
                while !replay.pending.is_empty() {
                    replay.settle_one().await?;
                }
                tokio::time::sleep(DEDUP_WINDOW + Duration::from_millis(20)).await;
            }
            recent_ids.insert(id, std::time::Instant::now());
            recent_ids.retain(|_, t| t.elapsed() < DEDUP_WINDOW * 2);
        }
        replay
            .send(m.seq, m.subject, headers, Bytes::from(m.data))
            .await?;
        next += 1;
        bar.add(1);
    }
    let sha = reader
        .await
        .map_err(|e| format!("reading the backup failed: {e}"))??;
    if sha != s(&meta, "messages_sha256") {
        return Err(format!(
            "{} changed during the restore: stream {name} is incomplete; remove it",
            msgs_path.display()
        ));
    }
    if next <= last_seq {
        // Deleted messages at the end: re-created so the next sequence continues.
        let subject = match &scan.last {
            Some((_, subj)) => subj.clone(),
            None => cfg
                .get("subjects")
                .and_then(Value::as_array)
                .and_then(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .find(|s| !s.contains('*') && !s.contains('>'))
                })
                .map(String::from)
                .ok_or_else(|| {
                    "cannot re-create the deleted messages at the end of the stream: it has no literal subject".to_string()
                })?,
        };
        while next <= last_seq {
            replay.gap(next, subject.clone()).await?;
            next += 1;
        }
    }
    replay.finish().await?;
    bar.finish();
    let count = scan.count;
    // The real limits, then the seal, as the original stream had them.
    let mut real = cfg.clone();
    real.remove("first_seq");
    let sealed = real.remove("sealed").and_then(|v| v.as_bool()) == Some(true);
    js.api(
        &format!("STREAM.UPDATE.{name}"),
        Some(&Value::Object(real.clone())),
    )
    .await
    .map_err(|e| {
        format!(
            "cannot apply the configuration of {name}: {}",
            String::from(e)
        )
    })?;
    let mut restored_consumers = 0;
    for c in meta["consumers"].as_array().into_iter().flatten() {
        let cname = s(c, "durable_name");
        let cname = if cname.is_empty() {
            s(c, "name")
        } else {
            cname
        };
        if cname.is_empty() {
            continue; // ephemeral consumers belong to clients that are gone
        }
        js.api(
            &format!("CONSUMER.CREATE.{name}.{cname}"),
            Some(&json!({ "stream_name": name, "config": c })),
        )
        .await
        .map_err(|e| {
            format!(
                "cannot re-create consumer {name} > {cname}: {}",
                String::from(e)
            )
        })?;
        restored_consumers += 1;
    }
    if sealed {
        real.insert("sealed".into(), json!(true));
        js.api(&format!("STREAM.UPDATE.{name}"), Some(&Value::Object(real)))
            .await
            .map_err(|e| format!("cannot seal {name}: {}", String::from(e)))?;
    }
    let info = js.stream_info(&name).await?;
    if !json_out {
        println!(
            "Restored stream {name} from {}: {} messages, {} consumers (backed up {})\n",
            dir.display(),
            n(count),
            restored_consumers,
            fmt_time(s(&meta, "created"))
        );
    }
    show(&info, json_out, false);
    Ok(())
}
