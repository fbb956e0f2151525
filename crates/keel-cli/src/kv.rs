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
    }
}

async fn bucket(js: &Js, name: &str) -> Res<kv::Store> {
    check_name("bucket", name)?;
    js.ctx.get_key_value(name).await.map_err(|e| {
        if e.kind() == jetstream::context::KeyValueErrorKind::GetBucket {
            format!("bucket {name} not found (list buckets with `keel kv ls`)")
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
        .api(&format!("STREAM.INFO.KV_{name}"), None)
        .await
        .map_err(|e| match e.err_code() {
            Some(crate::js::ERR_STREAM_NOT_FOUND) => {
                format!("bucket {name} not found (list buckets with `keel kv ls`)")
            }
            _ => String::from(e),
        })?;
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
