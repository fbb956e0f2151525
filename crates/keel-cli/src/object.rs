//! `keel object ...`: JetStream object stores through async-nats's object
//! store API, the same protocol (OBJ_<bucket> streams, `$O.<bucket>.C/M`
//! subjects, SHA-256 digests) as nats.go, nats.py and the `nats` CLI, so
//! objects written by any of them read back here and the other way round.
//! async-nats checks each object's digest while reading, so a damaged object
//! fails `get` instead of being written out.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, object_store};
use clap::{Args, Subcommand};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};

use crate::js::{check_name, Js};
use crate::output::{dur, fmt_time, fmt_time_ns, ibytes, n, print_json, s, u, Cols, Table};
use crate::stream::Storage;
use crate::util::{
    confirm, parse_bytes, parse_duration, parse_headers, ConnSettings, Progress, Res,
};

#[derive(Subcommand, Debug)]
pub enum ObjectCmd {
    /// Create an object store bucket
    #[command(visible_alias = "new")]
    Add(AddArgs),
    /// Put a file (or stdin, with --name) into a bucket
    Put(PutArgs),
    /// Get an object into a file
    Get(GetArgs),
    /// List buckets, or the objects in a bucket
    #[command(visible_alias = "list")]
    Ls(LsArgs),
    /// Show a bucket's or an object's information
    #[command(visible_aliases = ["show", "i"])]
    Info(InfoArgs),
    /// Delete an object, or the whole bucket when no object is given
    #[command(visible_alias = "rm")]
    Del(DelArgs),
    /// Seal a bucket: no more changes, ever
    Seal(SealArgs),
    /// Print changes to a bucket as they happen (current objects first)
    Watch(WatchArgs),
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// Bucket name
    bucket: String,
    /// How long to keep objects, e.g. 30d (default: forever)
    #[arg(long, value_name = "DURATION")]
    ttl: Option<String>,
    /// Replicas
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Largest bucket, e.g. 1GB (-1 = unlimited)
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    max_bucket_size: Option<String>,
    /// Description
    #[arg(long)]
    description: Option<String>,
    /// Storage backend
    #[arg(long, value_enum, default_value = "file")]
    storage: Storage,
    /// Compress the bucket's data (s2)
    #[arg(long)]
    compress: bool,
}

#[derive(Args, Debug)]
pub struct PutArgs {
    /// Bucket name
    bucket: String,
    /// File to put (stdin when omitted; then --name is required)
    file: Option<String>,
    /// Object name (default: the file's path)
    #[arg(long)]
    name: Option<String>,
    /// Object description
    #[arg(long)]
    description: Option<String>,
    /// Header as key:value (repeatable)
    #[arg(short = 'H', long = "header", value_name = "KEY:VALUE")]
    headers: Vec<String>,
    /// Chunk size in bytes, e.g. 128KiB (default 128KiB)
    #[arg(long, value_name = "BYTES")]
    chunk_size: Option<String>,
    /// Do not draw a progress bar
    #[arg(long)]
    no_progress: bool,
    /// Replace an existing object without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct GetArgs {
    /// Bucket name
    bucket: String,
    /// Object name
    file: String,
    /// Output file (default: the object name's last path part)
    #[arg(short = 'O', long, value_name = "FILE")]
    output: Option<String>,
    /// Do not draw a progress bar
    #[arg(long)]
    no_progress: bool,
    /// Replace an existing output file without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// List the objects of this bucket instead of the buckets
    bucket: Option<String>,
    /// Print only the names
    #[arg(short, long)]
    names: bool,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Bucket name
    bucket: String,
    /// Object name (without it: the bucket)
    file: Option<String>,
}

#[derive(Args, Debug)]
pub struct DelArgs {
    /// Bucket name
    bucket: String,
    /// Object name (without it: the whole bucket)
    file: Option<String>,
    /// Act without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct SealArgs {
    /// Bucket name
    bucket: String,
    /// Seal without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct WatchArgs {
    /// Bucket name
    bucket: String,
    /// Exit after this many updates (0 = run until interrupted)
    #[arg(long, default_value_t = 0)]
    count: u64,
}

pub async fn run(conn: &ConnSettings, cmd: &ObjectCmd, json_out: bool) -> Res<()> {
    let js = Js::connect(conn).await?;
    match cmd {
        ObjectCmd::Add(a) => add(&js, a, json_out).await,
        ObjectCmd::Put(a) => put(&js, a, json_out).await,
        ObjectCmd::Get(a) => get(&js, a).await,
        ObjectCmd::Ls(a) => ls(&js, a, json_out).await,
        ObjectCmd::Info(a) => match &a.file {
            Some(f) => {
                let store = bucket(&js, &a.bucket).await?;
                let info = store
                    .info(f)
                    .await
                    .map_err(|e| format!("cannot get {} > {f}: {e}", a.bucket))?;
                show_object(&info, json_out);
                Ok(())
            }
            None => bucket_info(&js, &a.bucket, json_out).await,
        },
        ObjectCmd::Del(a) => del(&js, a).await,
        ObjectCmd::Seal(a) => seal(&js, a).await,
        ObjectCmd::Watch(a) => watch(&js, a, json_out).await,
    }
}

/// The error for an object store bucket that does not exist.
fn not_found(name: &str) -> String {
    format!("object store bucket {name} not found (list them with `keel object ls`)")
}

async fn bucket(js: &Js, name: &str) -> Res<object_store::ObjectStore> {
    check_name("bucket", name)?;
    js.ctx.get_object_store(name).await.map_err(|e| {
        if e.kind() == jetstream::context::ObjectStoreErrorKind::GetStore {
            not_found(name)
        } else {
            format!("cannot open object store bucket {name}: {e}")
        }
    })
}

async fn add(js: &Js, a: &AddArgs, json_out: bool) -> Res<()> {
    check_name("bucket", &a.bucket)?;
    let max_age = match &a.ttl {
        Some(t) => parse_duration(t).map_err(|e| format!("--ttl: {e}"))?,
        None => Duration::ZERO,
    };
    let max_bytes = match &a.max_bucket_size {
        Some(v) => parse_bytes(v).map_err(|e| format!("--max-bucket-size: {e}"))?,
        None => -1,
    };
    js.ctx
        .create_object_store(object_store::Config {
            bucket: a.bucket.clone(),
            description: a.description.clone(),
            max_age,
            max_bytes,
            storage: match a.storage {
                Storage::File => jetstream::stream::StorageType::File,
                Storage::Memory => jetstream::stream::StorageType::Memory,
            },
            num_replicas: a.replicas,
            compression: a.compress,
            placement: None,
        })
        .await
        .map_err(|e| format!("cannot create object store bucket {}: {e}", a.bucket))?;
    bucket_info(js, &a.bucket, json_out).await
}

/// Counts the bytes read through it, for the progress bar.
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Counting<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let res = Pin::new(&mut self.inner).poll_read(cx, buf);
        let got = buf.filled().len() - before;
        self.count.fetch_add(got as u64, Ordering::Relaxed);
        res
    }
}

async fn put(js: &Js, a: &PutArgs, json_out: bool) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let name = match (&a.name, &a.file) {
        (Some(n), _) => n.clone(),
        (None, Some(f)) => f.clone(),
        (None, None) => return Err("--name is required when reading from stdin".into()),
    };
    if let Ok(existing) = store.info(&name).await {
        if !existing.deleted
            && !confirm(
                &format!("Replace existing file {} > {name}", a.bucket),
                a.force,
            )?
        {
            return Ok(());
        }
    }
    let chunk_size = match &a.chunk_size {
        Some(c) => {
            let v = parse_bytes(c).map_err(|e| format!("--chunk-size: {e}"))?;
            if v <= 0 {
                return Err("--chunk-size must be positive".into());
            }
            Some(v as usize)
        }
        None => None,
    };
    let meta = object_store::ObjectMetadata {
        name: name.clone(),
        description: a.description.clone(),
        chunk_size,
        metadata: HashMap::new(),
        headers: parse_headers(&a.headers)?,
    };
    let (reader, size): (Box<dyn AsyncRead + Unpin + Send>, u64) = match &a.file {
        Some(f) => {
            let file = tokio::fs::File::open(f)
                .await
                .map_err(|e| format!("cannot open {f}: {e}"))?;
            let size = file.metadata().await.map(|m| m.len()).unwrap_or(0);
            (Box::new(file), size)
        }
        None => (Box::new(tokio::io::stdin()), 0),
    };
    let bar = Progress::bytes("put", size, !a.no_progress && size > 20480);
    let mut reader = Counting {
        inner: reader,
        count: bar.counter(),
    };
    let info = store
        .put(meta, &mut reader)
        .await
        .map_err(|e| format!("cannot put {} > {name}: {e}", a.bucket))?;
    bar.finish();
    show_object(&info, json_out);
    Ok(())
}

async fn get(js: &Js, a: &GetArgs) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let mut obj = store.get(&a.file).await.map_err(|e| {
        if e.kind() == object_store::GetErrorKind::NotFound {
            format!("object {} not found in bucket {}", a.file, a.bucket)
        } else {
            format!("cannot get {} > {}: {e}", a.bucket, a.file)
        }
    })?;
    let info = obj.info().clone();
    let out = a.output.clone().unwrap_or_else(|| {
        std::path::Path::new(&info.name)
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_else(|| info.name.clone())
    });
    let out = std::path::absolute(&out).map_err(|e| format!("invalid output path {out}: {e}"))?;
    if out.exists()
        && !confirm(
            &format!("Replace existing target file {}", out.display()),
            a.force,
        )?
    {
        return Ok(());
    }
    // Written next to the target and renamed only once complete and verified,
    // so a failed or damaged transfer never leaves a plausible-looking file.
    let partial = out.with_extension(format!("keel-partial-{}", std::process::id()));
    let start = Instant::now();
    let bar = Progress::bytes("get", info.size as u64, !a.no_progress && info.size > 20480);
    let copied = async {
        let mut file = tokio::fs::File::create(&partial)
            .await
            .map_err(|e| format!("cannot create {}: {e}", partial.display()))?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0u64;
        loop {
            let n = tokio::io::AsyncReadExt::read(&mut obj, &mut buf)
                .await
                .map_err(|e| format!("reading {} > {} failed: {e}", a.bucket, a.file))?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n])
                .await
                .map_err(|e| format!("cannot write {}: {e}", partial.display()))?;
            total += n as u64;
            bar.add(n as u64);
        }
        file.sync_all()
            .await
            .map_err(|e| format!("cannot write {}: {e}", partial.display()))?;
        Ok::<u64, String>(total)
    }
    .await;
    bar.finish();
    let total = match copied {
        Ok(t) if t == info.size as u64 => t,
        Ok(t) => {
            let _ = std::fs::remove_file(&partial);
            return Err(format!(
                "wrote {}, expected {}: the object is incomplete",
                ibytes(t),
                ibytes(info.size as u64)
            ));
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    std::fs::rename(&partial, &out)
        .map_err(|e| format!("cannot rename to {}: {e}", out.display()))?;
    let elapsed = start.elapsed();
    if elapsed > Duration::from_secs(2) {
        println!(
            "Wrote: {} to {} in {} average {}/s",
            ibytes(total),
            out.display(),
            dur(elapsed),
            ibytes((total as f64 / elapsed.as_secs_f64()) as u64)
        );
    } else {
        println!(
            "Wrote: {} to {} in {}",
            ibytes(total),
            out.display(),
            dur(elapsed)
        );
    }
    Ok(())
}

fn digest_hex(d: &str) -> String {
    let (alg, b64) = d.split_once('=').unwrap_or(("SHA-256", d));
    match crate::output::base64_decode(b64) {
        Ok(bytes) => format!(
            "{alg} {}",
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
        Err(_) => d.to_string(),
    }
}

fn object_json(i: &object_store::ObjectInfo) -> Value {
    serde_json::to_value(i).unwrap_or(Value::Null)
}

fn mtime(i: &object_store::ObjectInfo) -> String {
    i.modified
        .map(|t| format!("{} UTC", fmt_time_ns(t.unix_timestamp_nanos())))
        .unwrap_or_default()
}

fn show_object(i: &object_store::ObjectInfo, json_out: bool) {
    if json_out {
        print_json(&object_json(i));
        return;
    }
    let mut c = Cols::new(format!("Object information for {} > {}", i.bucket, i.name));
    if let Some(d) = i.description.as_ref().filter(|d| !d.is_empty()) {
        c.row("Description", d);
    }
    c.row("Size", ibytes(i.size as u64));
    c.row("Modification Time", mtime(i));
    c.row("Chunks", n(i.chunks as u64));
    if let Some(d) = &i.digest {
        c.row("Digest", digest_hex(d));
    }
    c.row_if(i.deleted, "Deleted", true);
    if let Some(h) = i.headers.as_ref().filter(|h| !h.is_empty()) {
        c.section("Headers");
        for l in crate::util::header_lines(h) {
            if let Some((k, v)) = l.split_once(": ") {
                c.row(k, v);
            }
        }
    }
    print!("{}", c.render());
    println!();
}

async fn bucket_info(js: &Js, name: &str, json_out: bool) -> Res<()> {
    check_name("bucket", name)?;
    let info = js
        .bucket_stream_info(&format!("OBJ_{name}"), || not_found(name))
        .await?;
    if json_out {
        print_json(&info);
        return Ok(());
    }
    let cfg = &info["config"];
    let st = &info["state"];
    let mut c = Cols::new(format!(
        "Information for Object Store Bucket {name} created {}",
        fmt_time(s(&info, "created"))
    ));
    c.section("Configuration");
    c.row("Bucket Name", name);
    c.row_if(
        !s(cfg, "description").is_empty(),
        "Description",
        s(cfg, "description"),
    );
    c.row("Replicas", crate::output::i(cfg, "num_replicas").max(1));
    let age = crate::output::i(cfg, "max_age");
    c.row(
        "TTL",
        if age > 0 {
            crate::output::dur_ns(age)
        } else {
            "unlimited".into()
        },
    );
    c.row("Sealed", crate::output::b(cfg, "sealed"));
    c.row("Size", ibytes(u(st, "bytes")));
    let max = crate::output::i(cfg, "max_bytes");
    c.row(
        "Maximum Bucket Size",
        if max > 0 {
            ibytes(max as u64)
        } else {
            "unlimited".into()
        },
    );
    c.row(
        "Storage",
        if s(cfg, "storage") == "memory" {
            "Memory"
        } else {
            "File"
        },
    );
    c.row("Backing Store Kind", "JetStream");
    c.row("JetStream Stream", s(cfg, "name"));
    print!("{}", c.render());
    println!();
    Ok(())
}

async fn ls(js: &Js, a: &LsArgs, json_out: bool) -> Res<()> {
    if let Some(b) = &a.bucket {
        let store = bucket(js, b).await?;
        let mut list = store
            .list()
            .await
            .map_err(|e| format!("cannot list bucket {b}: {e}"))?;
        let mut objects = Vec::new();
        while let Some(o) = list.next().await {
            objects.push(o.map_err(|e| format!("listing bucket {b} failed: {e}"))?);
        }
        objects.sort_by(|x, y| x.name.cmp(&y.name));
        if json_out {
            print_json(&Value::Array(objects.iter().map(object_json).collect()));
        } else if a.names {
            for o in &objects {
                println!("{}", o.name);
            }
        } else if objects.is_empty() {
            println!("No entries found");
        } else {
            let mut t = Table::new("Bucket Contents", &["Name", "Size", "Time"]);
            for o in &objects {
                t.add(vec![o.name.clone(), ibytes(o.size as u64), mtime(o)]);
            }
            println!("{}", t.render());
        }
        return Ok(());
    }
    let infos = js
        .paged("STREAM.LIST", "streams", json!({ "subject": "$O.*.M.>" }))
        .await
        .map_err(String::from)?;
    let mut buckets: Vec<&Value> = infos
        .iter()
        .filter(|i| s(&i["config"], "name").starts_with("OBJ_"))
        .collect();
    buckets.sort_by(|x, y| s(&x["config"], "name").cmp(s(&y["config"], "name")));
    let name_of = |i: &Value| s(&i["config"], "name")[4..].to_string();
    if json_out {
        let names: Vec<String> = buckets.iter().map(|i| name_of(i)).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&names).unwrap_or_default()
        );
        return Ok(());
    }
    if buckets.is_empty() {
        println!("No Object Store buckets found");
        return Ok(());
    }
    if a.names {
        for b in buckets {
            println!("{}", name_of(b));
        }
        return Ok(());
    }
    let mut t = Table::new(
        "Object Store Buckets",
        &["Bucket", "Description", "Created", "Size", "Last Update"],
    );
    for i in buckets {
        let last = crate::output::ago(s(&i["state"], "last_ts"), s(i, "ts"))
            .unwrap_or_else(|| "never".into());
        t.add(vec![
            name_of(i),
            s(&i["config"], "description").to_string(),
            fmt_time(s(i, "created")),
            ibytes(u(&i["state"], "bytes")),
            last,
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

async fn del(js: &Js, a: &DelArgs) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    match &a.file {
        Some(f) => {
            store
                .info(f)
                .await
                .map_err(|_| format!("object {f} not found in bucket {}", a.bucket))?;
            if !confirm(&format!("Delete {} > {f}", a.bucket), a.force)? {
                println!("Skipping delete");
                return Ok(());
            }
            store
                .delete(f)
                .await
                .map_err(|e| format!("cannot delete {} > {f}: {e}", a.bucket))?;
            println!("Removed {} > {f}", a.bucket);
        }
        None => {
            if !confirm(
                &format!("Delete bucket {} and all its objects", a.bucket),
                a.force,
            )? {
                println!("Skipping delete");
                return Ok(());
            }
            js.ctx
                .delete_object_store(&a.bucket)
                .await
                .map_err(|e| format!("cannot delete bucket {}: {e}", a.bucket))?;
            println!("Removed bucket {}", a.bucket);
        }
    }
    Ok(())
}

async fn seal(js: &Js, a: &SealArgs) -> Res<()> {
    let mut store = bucket(js, &a.bucket).await?;
    if !confirm(
        &format!(
            "Really seal Bucket {}, sealed buckets can not be unsealed or modified",
            a.bucket
        ),
        a.force,
    )? {
        return Ok(());
    }
    store
        .seal()
        .await
        .map_err(|e| format!("cannot seal bucket {}: {e}", a.bucket))?;
    println!("{} has been sealed", a.bucket);
    Ok(())
}

async fn watch(js: &Js, a: &WatchArgs, json_out: bool) -> Res<()> {
    let store = bucket(js, &a.bucket).await?;
    let mut w = store
        .watch_with_history()
        .await
        .map_err(|e| format!("cannot watch bucket {}: {e}", a.bucket))?;
    eprintln!("Watching bucket {}", a.bucket);
    let mut seen = 0u64;
    while let Some(i) = w.next().await {
        let i = i.map_err(|e| format!("watch failed: {e}"))?;
        if json_out {
            println!("{}", object_json(&i));
        } else if i.deleted {
            println!("[{}] DEL {} > {}", mtime(&i), i.bucket, i.name);
        } else {
            println!(
                "[{}] PUT {} > {}: {} bytes in {} chunks",
                mtime(&i),
                i.bucket,
                i.name,
                ibytes(i.size as u64),
                n(i.chunks as u64)
            );
        }
        seen += 1;
        if a.count > 0 && seen >= a.count {
            return Ok(());
        }
    }
    Err("the watch ended: connection to the server was closed".into())
}
