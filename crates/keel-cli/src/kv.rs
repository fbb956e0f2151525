//! `keel kv ...`: key-value buckets on the async-nats typed KV API.
//! As in the `nats` CLI, `del`/`rm` with a key deletes the key and without
//! one deletes the whole bucket (after confirmation, or with -f).

use std::io::Read;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use clap::{Args, Subcommand};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::js::{check_name, Js};
use crate::output::{fmt_time_ns, ibytes, n, print_json, s, u, Table};
use crate::stream::Storage;
use crate::util::{confirm, parse_bytes, parse_duration, ConnSettings, Res};

#[derive(Subcommand, Debug)]
pub enum KvCmd {
    /// Create a bucket
    #[command(visible_alias = "new")]
    Add(AddArgs),
    /// Put a value into a key (the value is read from stdin when not given)
    Put(PutArgs),
    /// Get the value of a key
    Get(GetArgs),
    /// Delete a key, or the whole bucket when no key is given
    Del(DelArgs),
    /// Delete the whole bucket, or one key when a key is given (as `del`)
    Rm(DelArgs),
    /// Show every stored revision of a key
    History(KeyArgs),
    /// Print changes to a bucket (or to keys matching KEY) as they happen
    Watch(WatchArgs),
    /// List buckets, or the keys in a bucket
    #[command(visible_alias = "list")]
    Ls(LsArgs),
    /// Show a bucket's configuration and state
    #[command(visible_aliases = ["status", "view"])]
    Info(BucketArgs),
    /// Change a bucket's settings (history, ttl, sizes, description)
    Edit(EditArgs),
    /// Put a value only if the key is new or its last operation was a delete
    Create(CreateArgs),
    /// Put a value only if the key's latest revision is REVISION
    Update(UpdateArgs),
    /// Delete a key and all its history, leaving a purge marker
    Purge(PurgeArgs),
    /// Put the value of an earlier revision as the newest value
    Revert(RevertArgs),
    /// Reclaim the space of deleted keys (their history and old markers)
    Compact(CompactArgs),
}

#[derive(Args, Debug)]
pub struct EditArgs {
    bucket: String,
    /// Values kept per key
    #[arg(long)]
    history: Option<i64>,
    /// How long to keep values, e.g. 1h (0 = forever)
    #[arg(long, value_name = "DURATION")]
    ttl: Option<String>,
    /// Largest value, e.g. 1MB (-1 = unlimited)
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    max_value_size: Option<String>,
    /// Largest bucket, e.g. 1GB (-1 = unlimited)
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    max_bucket_size: Option<String>,
    /// Description
    #[arg(long)]
    description: Option<String>,
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    bucket: String,
    key: String,
    /// The value; read from stdin when omitted
    value: Option<String>,
}

#[derive(Args, Debug)]
pub struct UpdateArgs {
    bucket: String,
    key: String,
    /// The new value
    value: String,
    /// The revision the key must be at
    revision: u64,
}

#[derive(Args, Debug)]
pub struct PurgeArgs {
    bucket: String,
    key: String,
    /// Purge without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct RevertArgs {
    bucket: String,
    key: String,
    /// The revision to go back to
    revision: u64,
    /// Revert without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct CompactArgs {
    bucket: String,
    /// Compact without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// Bucket name
    bucket: String,
    /// Values kept per key
    #[arg(long, default_value_t = 1)]
    history: i64,
    /// How long to keep values, e.g. 1h (default: forever)
    #[arg(long, value_name = "DURATION")]
    ttl: Option<String>,
    /// Storage backend
    #[arg(long, value_enum, default_value = "file")]
    storage: Storage,
    /// Replicas
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Largest value, e.g. 1MB (-1 = unlimited)
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    max_value_size: Option<String>,
    /// Largest bucket, e.g. 1GB (-1 = unlimited)
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    max_bucket_size: Option<String>,
    /// Description
    #[arg(long)]
    description: Option<String>,
}

#[derive(Args, Debug)]
pub struct PutArgs {
    bucket: String,
    key: String,
    /// The value; read from stdin when omitted
    value: Option<String>,
}

#[derive(Args, Debug)]
pub struct GetArgs {
    bucket: String,
    key: String,
    /// A specific revision
    #[arg(long)]
    revision: Option<u64>,
    /// Print only the value
    #[arg(long)]
    raw: bool,
}

#[derive(Args, Debug)]
pub struct DelArgs {
    bucket: String,
    key: Option<String>,
    /// Act without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct KeyArgs {
    bucket: String,
    key: String,
}

#[derive(Args, Debug)]
pub struct WatchArgs {
    bucket: String,
    /// Key or wildcard to watch
    #[arg(default_value = ">")]
    key: String,
    /// Start with the current values (all history with --history)
    #[arg(long)]
    history: bool,
    /// Exit after this many updates (0 = run until interrupted)
    #[arg(long, default_value_t = 0)]
    count: u64,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// List the keys of this bucket instead of the buckets
    bucket: Option<String>,
}

#[derive(Args, Debug)]
pub struct BucketArgs {
    bucket: String,
}

pub async fn run(conn: &ConnSettings, cmd: &KvCmd, json_out: bool) -> Res<()> {
    let js = Js::connect(conn).await?;
    match cmd {
        KvCmd::Add(a) => add(&js, a, json_out).await,
        KvCmd::Put(a) => put(&js, a, json_out).await,
        KvCmd::Get(a) => get(&js, a, json_out).await,
        KvCmd::Del(a) | KvCmd::Rm(a) => del(&js, a).await,
        KvCmd::History(a) => history(&js, a, json_out).await,
        KvCmd::Watch(a) => watch(&js, a, json_out).await,
        KvCmd::Ls(a) => ls(&js, a, json_out).await,
        KvCmd::Info(a) => info(&js, &a.bucket, json_out).await,
        KvCmd::Edit(a) => edit(&js, a, json_out).await,
        KvCmd::Create(a) => {
            let store = bucket(&js, &a.bucket).await?;
            let value = value_or_stdin(&a.value)?;
            let rev = store
                .create(&a.key, Bytes::from(value.clone()))
                .await
                .map_err(|e| match e.kind() {
                    kv::CreateErrorKind::AlreadyExists => {
                        format!("key {} already exists in bucket {}", a.key, a.bucket)
                    }
                    _ => format!("cannot create {} > {}: {e}", a.bucket, a.key),
                })?;
            print_put(&a.bucket, &a.key, rev, &value, json_out);
            Ok(())
        }
        KvCmd::Update(a) => {
            let store = bucket(&js, &a.bucket).await?;
            let rev = store
                .update(&a.key, Bytes::from(a.value.clone()), a.revision)
                .await
                .map_err(|e| match e.kind() {
                    kv::UpdateErrorKind::WrongLastRevision => format!(
                        "key {} > {} is not at revision {}: not updated (see `keel kv get {} {}`)",
                        a.bucket, a.key, a.revision, a.bucket, a.key
                    ),
                    _ => format!("cannot update {} > {}: {e}", a.bucket, a.key),
                })?;
            print_put(&a.bucket, &a.key, rev, a.value.as_bytes(), json_out);
            Ok(())
        }
        KvCmd::Purge(a) => {
            let store = bucket(&js, &a.bucket).await?;
            if !confirm(
                &format!("Purge key {} > {} and all its history", a.bucket, a.key),
                a.force,
            )? {
                return Ok(());
            }
            store
                .purge(&a.key)
                .await
                .map_err(|e| format!("cannot purge {} > {}: {e}", a.bucket, a.key))?;
            println!("Purged key {} > {}", a.bucket, a.key);
            Ok(())
        }
        KvCmd::Revert(a) => revert(&js, a, json_out).await,
        KvCmd::Compact(a) => compact(&js, a).await,
    }
}

fn value_or_stdin(v: &Option<String>) -> Res<Vec<u8>> {
    match v {
        Some(v) => Ok(v.clone().into_bytes()),
        None => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .map_err(|e| format!("cannot read the value from stdin: {e}"))?;
            Ok(buf)
        }
    }
}

fn print_put(bucket: &str, key: &str, rev: u64, value: &[u8], json_out: bool) {
    if json_out {
        print_json(&json!({ "bucket": bucket, "key": key, "revision": rev }));
    } else {
        println!("{}", String::from_utf8_lossy(value));
    }
}

async fn edit(js: &Js, a: &EditArgs, json_out: bool) -> Res<()> {
    check_name("bucket", &a.bucket)?;
    let stream = format!("KV_{}", a.bucket);
    let current = js
        .bucket_stream_info(&stream, || not_found(&a.bucket))
        .await?;
    let mut cfg = current["config"].as_object().cloned().unwrap_or_default();
    let old = cfg.clone();
    if let Some(h) = a.history {
        if !(1..=64).contains(&h) {
            return Err(format!("--history must be between 1 and 64, not {h}"));
        }
        cfg.insert("max_msgs_per_subject".into(), json!(h));
    }
    if let Some(t) = &a.ttl {
        let d = if t.trim() == "0" {
            Duration::ZERO
        } else {
            parse_duration(t).map_err(|e| format!("--ttl: {e}"))?
        };
        cfg.insert("max_age".into(), json!(d.as_nanos() as u64));
        // As nats.go: the duplicate window never exceeds the TTL.
        let window = if d.is_zero() {
            Duration::from_secs(120)
        } else {
            d.min(Duration::from_secs(120))
        };
        cfg.insert("duplicate_window".into(), json!(window.as_nanos() as u64));
    }
    if let Some(v) = &a.max_value_size {
        let size = parse_bytes(v).map_err(|e| format!("--max-value-size: {e}"))?;
        cfg.insert(
            "max_msg_size".into(),
            json!(i32::try_from(size)
                .map_err(|_| "--max-value-size is too big (at most 2GiB)".to_string())?),
        );
    }
    if let Some(v) = &a.max_bucket_size {
        cfg.insert(
            "max_bytes".into(),
            json!(parse_bytes(v).map_err(|e| format!("--max-bucket-size: {e}"))?),
        );
    }
    if let Some(d) = &a.description {
        cfg.insert("description".into(), json!(d));
    }
    if cfg == old {
        return Err(format!(
            "no changes to bucket {}: give the settings to change, e.g. --history 5",
            a.bucket
        ));
    }
    js.api(
        &format!("STREAM.UPDATE.{stream}"),
        Some(&Value::Object(cfg)),
    )
    .await
    .map_err(|e| format!("cannot update bucket {}: {}", a.bucket, String::from(e)))?;
    if !json_out {
        println!("Bucket {} was updated\n", a.bucket);
    }
    info(js, &a.bucket, json_out).await
}

async fn revert(js: &Js, a: &RevertArgs, json_out: bool) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let entry = store
        .entry_for_revision(&a.key, a.revision)
        .await
        .map_err(|e| {
            format!(
                "cannot get {} > {} revision {}: {e}",
                a.bucket, a.key, a.revision
            )
        })?
        .ok_or_else(|| {
            format!(
                "revision {} of {} > {} not found (see `keel kv history {} {}`)",
                a.revision, a.bucket, a.key, a.bucket, a.key
            )
        })?;
    if !matches!(entry.operation, kv::Operation::Put) {
        return Err(format!(
            "revision {} of {} > {} is a {}, not a value",
            a.revision,
            a.bucket,
            a.key,
            op_name(&entry.operation)
        ));
    }
    if !confirm(
        &format!(
            "Really revert {} > {} to revision {}",
            a.bucket, a.key, a.revision
        ),
        a.force,
    )? {
        return Ok(());
    }
    let rev = store
        .put(&a.key, entry.value.clone())
        .await
        .map_err(|e| format!("cannot put {} > {}: {e}", a.bucket, a.key))?;
    if json_out {
        print_json(
            &json!({ "bucket": a.bucket, "key": a.key, "revision": rev, "reverted_to": a.revision }),
        );
    } else {
        println!(
            "{} > {} revision: {rev} (the value of revision {})\n",
            a.bucket, a.key, a.revision
        );
        println!("{}", String::from_utf8_lossy(&entry.value));
    }
    Ok(())
}

/// As nats.go's PurgeDeletes: every key whose latest operation is a delete or
/// purge loses its history; markers younger than 30 minutes are kept so
/// watchers still see the delete.
async fn compact(js: &Js, a: &CompactArgs) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    if !confirm(
        &format!(
            "Purge all historic values and audit trails for deleted keys in bucket {}",
            a.bucket
        ),
        a.force,
    )? {
        return Ok(());
    }
    let stream = format!("KV_{}", a.bucket);
    let info = js.stream_info(&stream).await?;
    let mut deleted = Vec::new();
    if u(&info["state"], "messages") > 0 {
        let mut w = store
            .watch_with_history(">")
            .await
            .map_err(|e| format!("cannot read bucket {}: {e}", a.bucket))?;
        while let Some(e) = tokio::time::timeout(js.timeout, w.next())
            .await
            .map_err(|_| format!("bucket {} stopped answering", a.bucket))?
        {
            let e = e.map_err(|e| format!("reading bucket {} failed: {e}", a.bucket))?;
            if !matches!(e.operation, kv::Operation::Put) {
                deleted.push((e.key.clone(), e.created.unix_timestamp_nanos()));
            }
            if e.delta == 0 {
                break;
            }
        }
    }
    let threshold = crate::output::now_ns() - 30 * 60 * 1_000_000_000i128;
    let mut purged = 0u64;
    for (key, when) in &deleted {
        let keep = if *when < threshold { 0 } else { 1 };
        let resp = js
            .api(
                &format!("STREAM.PURGE.{stream}"),
                Some(&json!({ "filter": format!("$KV.{}.{key}", a.bucket), "keep": keep })),
            )
            .await
            .map_err(|e| format!("cannot purge {} > {key}: {}", a.bucket, String::from(e)))?;
        purged += u(&resp, "purged");
    }
    println!(
        "Compacted bucket {}: {} deleted keys, {} messages removed",
        a.bucket,
        deleted.len(),
        n(purged)
    );
    Ok(())
}

/// The error for a bucket that does not exist.
fn not_found(name: &str) -> String {
    format!("bucket {name} not found (list buckets with `keel kv ls`)")
}

async fn bucket(js: &Js, name: &str) -> Res<kv::Store> {
    check_name("bucket", name)?;
    js.ctx.get_key_value(name).await.map_err(|e| {
        if e.kind() == jetstream::context::KeyValueErrorKind::GetBucket {
            not_found(name)
        } else {
            format!("cannot open bucket {name}: {e}")
        }
    })
}

async fn add(js: &Js, a: &AddArgs, json_out: bool) -> Res<()> {
    check_name("bucket", &a.bucket)?;
    if !(1..=64).contains(&a.history) {
        return Err(format!(
            "--history must be between 1 and 64, not {}",
            a.history
        ));
    }
    let max_age = match &a.ttl {
        Some(t) => parse_duration(t).map_err(|e| format!("--ttl: {e}"))?,
        None => Duration::ZERO,
    };
    let size = |flag: &str, v: &Option<String>| -> Res<i64> {
        match v {
            Some(v) => parse_bytes(v).map_err(|e| format!("--{flag}: {e}")),
            None => Ok(-1),
        }
    };
    let max_value_size = size("max-value-size", &a.max_value_size)?;
    let cfg = kv::Config {
        bucket: a.bucket.clone(),
        description: a.description.clone().unwrap_or_default(),
        history: a.history,
        max_age,
        max_bytes: size("max-bucket-size", &a.max_bucket_size)?,
        max_value_size: i32::try_from(max_value_size)
            .map_err(|_| "--max-value-size is too big (at most 2GiB)".to_string())?,
        storage: match a.storage {
            Storage::File => jetstream::stream::StorageType::File,
            Storage::Memory => jetstream::stream::StorageType::Memory,
        },
        num_replicas: a.replicas,
        ..Default::default()
    };
    js.ctx
        .create_key_value(cfg)
        .await
        .map_err(|e| format!("cannot create bucket {}: {e}", a.bucket))?;
    if !json_out {
        println!("Bucket {} was created\n", a.bucket);
    }
    info(js, &a.bucket, json_out).await
}

async fn put(js: &Js, a: &PutArgs, json_out: bool) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let value = match &a.value {
        Some(v) => v.clone().into_bytes(),
        None => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .map_err(|e| format!("cannot read the value from stdin: {e}"))?;
            buf
        }
    };
    let rev = store
        .put(&a.key, Bytes::from(value.clone()))
        .await
        .map_err(|e| format!("cannot put {} > {}: {e}", a.bucket, a.key))?;
    if json_out {
        print_json(&json!({ "bucket": a.bucket, "key": a.key, "revision": rev }));
    } else {
        // nats prints the value it stored.
        println!("{}", String::from_utf8_lossy(&value));
    }
    Ok(())
}

fn entry_json(e: &kv::Entry) -> Value {
    json!({
        "bucket": e.bucket,
        "key": e.key,
        "value": String::from_utf8_lossy(&e.value),
        "revision": e.revision,
        "created": crate::output::rfc3339_ns(e.created.unix_timestamp_nanos()),
        "operation": op_name(&e.operation),
    })
}

fn op_name(op: &kv::Operation) -> &'static str {
    match op {
        kv::Operation::Put => "PUT",
        kv::Operation::Delete => "DEL",
        kv::Operation::Purge => "PURGE",
    }
}

async fn get(js: &Js, a: &GetArgs, json_out: bool) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let entry = match a.revision {
        Some(r) => store.entry_for_revision(&a.key, r).await,
        None => store.entry(&a.key).await,
    }
    .map_err(|e| format!("cannot get {} > {}: {e}", a.bucket, a.key))?;
    let entry = entry.ok_or_else(|| format!("key {} not found in bucket {}", a.key, a.bucket))?;
    if !matches!(entry.operation, kv::Operation::Put) {
        return Err(format!(
            "key {} not found in bucket {} (deleted at revision {})",
            a.key, a.bucket, entry.revision
        ));
    }
    if json_out {
        print_json(&entry_json(&entry));
    } else if a.raw {
        println!("{}", String::from_utf8_lossy(&entry.value));
    } else {
        println!(
            "{} > {} revision: {} created @ {} UTC\n",
            a.bucket,
            a.key,
            entry.revision,
            fmt_time_ns(entry.created.unix_timestamp_nanos())
        );
        println!("{}", String::from_utf8_lossy(&entry.value));
    }
    Ok(())
}

async fn del(js: &Js, a: &DelArgs) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    match &a.key {
        Some(key) => {
            if !confirm(&format!("Really delete key {} > {key}", a.bucket), a.force)? {
                return Ok(());
            }
            store
                .delete(key)
                .await
                .map_err(|e| format!("cannot delete {} > {key}: {e}", a.bucket))?;
            println!("Deleted key {} > {key}", a.bucket);
        }
        None => {
            if !confirm(
                &format!("Really delete bucket {} and all its keys", a.bucket),
                a.force,
            )? {
                return Ok(());
            }
            js.ctx
                .delete_key_value(&a.bucket)
                .await
                .map_err(|e| format!("cannot delete bucket {}: {e}", a.bucket))?;
            println!("Deleted bucket {}", a.bucket);
        }
    }
    Ok(())
}

async fn history(js: &Js, a: &KeyArgs, json_out: bool) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let mut hist = store
        .history(&a.key)
        .await
        .map_err(|e| format!("cannot read the history of {} > {}: {e}", a.bucket, a.key))?;
    let mut entries = Vec::new();
    while let Some(e) = hist.next().await {
        entries.push(e.map_err(|e| format!("history failed: {e}"))?);
    }
    if entries.is_empty() {
        return Err(format!("key {} not found in bucket {}", a.key, a.bucket));
    }
    if json_out {
        print_json(&Value::Array(entries.iter().map(entry_json).collect()));
        return Ok(());
    }
    let mut t = Table::new(
        format!("History for {} > {}", a.bucket, a.key),
        &["Key", "Revision", "Op", "Created", "Length", "Value"],
    );
    for e in &entries {
        t.add(vec![
            e.key.clone(),
            e.revision.to_string(),
            op_name(&e.operation).to_string(),
            fmt_time_ns(e.created.unix_timestamp_nanos()),
            e.value.len().to_string(),
            String::from_utf8_lossy(&e.value).chars().take(40).collect(),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

async fn watch(js: &Js, a: &WatchArgs, json_out: bool) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let mut w = if a.history {
        store.watch_with_history(&a.key).await
    } else {
        store.watch(&a.key).await
    }
    .map_err(|e| format!("cannot watch {} > {}: {e}", a.bucket, a.key))?;
    eprintln!("Watching {} > {}", a.bucket, a.key);
    let mut seen = 0u64;
    while let Some(e) = w.next().await {
        let e = e.map_err(|e| format!("watch failed: {e}"))?;
        if json_out {
            println!("{}", entry_json(&e));
        } else {
            let value = match e.operation {
                kv::Operation::Put => String::from_utf8_lossy(&e.value).into_owned(),
                _ => String::new(),
            };
            println!(
                "[{}] {} {} > {}: {value}",
                fmt_time_ns(e.created.unix_timestamp_nanos()),
                op_name(&e.operation),
                e.bucket,
                e.key
            );
        }
        seen += 1;
        if a.count > 0 && seen >= a.count {
            return Ok(());
        }
    }
    Err("the watch ended: connection to the server was closed".into())
}

async fn ls(js: &Js, a: &LsArgs, json_out: bool) -> Res<()> {
    if let Some(b) = &a.bucket {
        let store = bucket(js, b).await?;
        let mut keys = store
            .keys()
            .await
            .map_err(|e| format!("cannot list keys of {b}: {e}"))?;
        let mut out = Vec::new();
        while let Some(k) = keys.next().await {
            out.push(k.map_err(|e| format!("listing keys failed: {e}"))?);
        }
        out.sort();
        if json_out {
            println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        } else if out.is_empty() {
            println!("No keys found in bucket {b}");
        } else {
            for k in out {
                println!("{k}");
            }
        }
        return Ok(());
    }
    let infos = js
        .paged("STREAM.LIST", "streams", json!({}))
        .await
        .map_err(String::from)?;
    let mut buckets: Vec<&Value> = infos
        .iter()
        .filter(|i| s(&i["config"], "name").starts_with("KV_"))
        .collect();
    buckets.sort_by(|x, y| s(&x["config"], "name").cmp(s(&y["config"], "name")));
    if json_out {
        let names: Vec<&str> = buckets
            .iter()
            .map(|i| &s(&i["config"], "name")[3..])
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&names).unwrap_or_default()
        );
        return Ok(());
    }
    if buckets.is_empty() {
        println!("No Key-Value buckets found");
        return Ok(());
    }
    let mut t = Table::new(
        "Key-Value Buckets",
        &["Bucket", "Description", "Created", "Size", "Values"],
    );
    for i in buckets {
        t.add(vec![
            s(&i["config"], "name")[3..].to_string(),
            s(&i["config"], "description").to_string(),
            crate::output::fmt_time(s(i, "created")),
            ibytes(u(&i["state"], "bytes")),
            n(u(&i["state"], "messages")),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

async fn info(js: &Js, name: &str, json_out: bool) -> Res<()> {
    check_name("bucket", name)?;
    let info = js
        .bucket_stream_info(&format!("KV_{name}"), || not_found(name))
        .await?;
    if json_out {
        print_json(&info);
        return Ok(());
    }
    let cfg = &info["config"];
    let st = &info["state"];
    let mut c = crate::output::Cols::new(format!(
        "Information for Key-Value Store Bucket {name} created {}",
        crate::output::fmt_time(s(&info, "created"))
    ));
    c.section("Configuration");
    c.row("Bucket Name", name);
    c.row_if(
        !s(cfg, "description").is_empty(),
        "Description",
        s(cfg, "description"),
    );
    c.row(
        "History Kept",
        crate::output::i(cfg, "max_msgs_per_subject"),
    );
    let age = crate::output::i(cfg, "max_age");
    c.row("Values Stored", n(u(st, "messages")));
    c.row(
        "Maximum Age",
        if age > 0 {
            crate::output::dur_ns(age)
        } else {
            "unlimited".into()
        },
    );
    c.row("Backing Store Kind", "JetStream");
    c.row("JetStream Stream", format!("KV_{name}"));
    c.row("Storage", s(cfg, "storage"));
    c.section("State");
    c.row("Bytes Stored", ibytes(u(st, "bytes")));
    print!("{}", c.render());
    println!();
    Ok(())
}
