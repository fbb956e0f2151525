//! `keel stream ...`: add, edit, info, ls, rm, purge, get, subjects, with the
//! `nats` CLI's flag names and, where `nats` would prompt, its defaults.

use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use serde_json::{json, Map, Value};

use crate::js::{check_name, stream_error, Js, ERR_NO_MESSAGE_FOUND};
use crate::output::{
    ago, b, base64_decode, dur, dur_ns, fmt_time, header_block_lines, i, ibytes, n, print_json, s,
    u, Cols, Table,
};
use crate::util::{confirm, parse_bytes, parse_duration, ConnSettings, Res};

#[derive(Subcommand, Debug)]
pub enum StreamCmd {
    /// Create a new stream
    #[command(visible_aliases = ["create", "new"])]
    Add(AddArgs),
    /// Change an existing stream's configuration
    #[command(visible_alias = "update")]
    Edit(EditArgs),
    /// Show a stream's configuration and state
    #[command(visible_alias = "nfo")]
    Info(InfoArgs),
    /// List streams
    #[command(visible_alias = "list")]
    Ls(LsArgs),
    /// Delete a stream and all its messages
    #[command(visible_aliases = ["delete", "del"])]
    Rm(RmArgs),
    /// Remove messages from a stream (all, or by subject / sequence / keep)
    Purge(PurgeArgs),
    /// Fetch one message by sequence, or the last one on a subject
    Get(GetArgs),
    /// List the subjects stored in a stream with message counts
    #[command(visible_alias = "subj")]
    Subjects(SubjectsArgs),
    /// Show only a stream's state
    State(StateArgs),
    /// Statistics of every stream: storage, consumers, messages, bytes, deleted
    Report(crate::stream_ops::ReportArgs),
    /// Find streams matching criteria (empty, idle, created before, few consumers, ...)
    #[command(visible_alias = "query")]
    Find(crate::stream_ops::FindArgs),
    /// Page through the messages in a stream
    View(crate::stream_ops::ViewArgs),
    /// Securely remove one message (by sequence) from a stream
    Rmm(crate::stream_ops::RmmArgs),
    /// Seal a stream: no more messages, deletes or purges, ever
    Seal(crate::stream_ops::SealArgs),
    /// Create a new stream with another's configuration (no data is copied)
    #[command(visible_alias = "cp")]
    Copy(crate::stream_ops::CopyArgs),
    /// Back a stream's configuration, messages and consumers up into a directory
    #[command(visible_alias = "snapshot")]
    Backup(crate::stream_ops::BackupArgs),
    /// Restore a stream from a `keel stream backup` directory
    Restore(crate::stream_ops::RestoreArgs),
    /// Manage a stream's Raft group in a cluster
    #[command(subcommand)]
    Cluster(ClusterCmd),
}

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// Make another replica the stream's leader
    #[command(name = "step-down")]
    StepDown(StepDownArgs),
    /// Take a server out of the stream's group (a free server takes its place)
    #[command(name = "peer-remove")]
    PeerRemove(PeerRemoveArgs),
}

#[derive(Args, Debug)]
pub struct StepDownArgs {
    /// Stream name
    stream: String,
    /// The server to hand leadership to (a replica of the stream)
    #[arg(long)]
    preferred: Option<String>,
}

#[derive(Args, Debug)]
pub struct PeerRemoveArgs {
    /// Stream name
    stream: String,
    /// The server to remove (its name)
    peer: String,
}

#[derive(Args, Debug)]
pub struct StateArgs {
    /// Stream name
    stream: String,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Storage {
    #[value(alias = "f")]
    File,
    #[value(alias = "m")]
    Memory,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Retention {
    Limits,
    Interest,
    #[value(name = "work", aliases = ["workq", "workqueue", "work-queue"])]
    Work,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Discard {
    Old,
    New,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Compression {
    None,
    S2,
}

/// Flags shared by `add` and `edit`; each is None unless given.
#[derive(Args, Debug, Default)]
pub struct StreamFlags {
    /// Subjects the stream stores (repeatable, or comma/space separated)
    #[arg(long, value_name = "SUBJECTS", num_args = 1)]
    subjects: Vec<String>,
    /// Description of the stream
    #[arg(long)]
    description: Option<String>,
    /// Storage backend [default for add: file]
    #[arg(long, value_enum)]
    storage: Option<Storage>,
    /// Number of replicas in a cluster [default for add: 1]
    #[arg(long)]
    replicas: Option<i64>,
    /// Place the stream in this cluster
    #[arg(long)]
    cluster: Option<String>,
    /// Place the stream on servers with this tag (repeatable; a new set moves the stream)
    #[arg(long = "tag", value_name = "TAG")]
    tags: Vec<String>,
    /// Retention policy [default for add: limits]
    #[arg(long, value_enum)]
    retention: Option<Retention>,
    /// What to drop when a limit is hit [default for add: old]
    #[arg(long, value_enum)]
    discard: Option<Discard>,
    /// Apply discard new per subject (with --max-msgs-per-subject)
    #[arg(long)]
    discard_per_subject: bool,
    /// Maximum age of messages, e.g. 24h, 7d, 1y (-1 = unlimited)
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    max_age: Option<String>,
    /// Maximum total size, e.g. 1GB, 512MiB (-1 = unlimited)
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    max_bytes: Option<String>,
    /// Maximum number of messages (-1 = unlimited)
    #[arg(long, allow_hyphen_values = true)]
    max_msgs: Option<i64>,
    /// Maximum number of messages per subject (-1 = unlimited)
    #[arg(long, allow_hyphen_values = true)]
    max_msgs_per_subject: Option<i64>,
    /// Maximum size of one message, e.g. 1MB (-1 = unlimited)
    #[arg(long, value_name = "BYTES", allow_hyphen_values = true)]
    max_msg_size: Option<String>,
    /// Maximum number of consumers (-1 = unlimited)
    #[arg(long, allow_hyphen_values = true)]
    max_consumers: Option<i64>,
    /// Duplicate tracking window [default: 2m, or --max-age if shorter]
    #[arg(long, value_name = "DURATION")]
    dupe_window: Option<String>,
    /// Allow roll-ups with the Nats-Rollup header
    #[arg(long)]
    allow_rollup: bool,
    /// Refuse deleting messages through the API
    #[arg(long)]
    deny_delete: bool,
    /// Refuse purging through the API
    #[arg(long)]
    deny_purge: bool,
    /// Do not allow direct get (allowed by default, as in nats)
    #[arg(long)]
    no_allow_direct: bool,
    /// Do not acknowledge publishes
    #[arg(long)]
    no_ack: bool,
    /// Compression for file storage [default: none]
    #[arg(long, value_enum)]
    compression: Option<Compression>,
    /// Sequence of the first message (add only)
    #[arg(long)]
    first_sequence: Option<u64>,
    /// Metadata as key=value (repeatable)
    #[arg(long, value_name = "KEY=VALUE")]
    metadata: Vec<String>,
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// Stream name
    stream: Option<String>,
    #[command(flatten)]
    flags: StreamFlags,
    /// Read the stream configuration from a JSON file (flags override it)
    #[arg(long, value_name = "FILE")]
    config: Option<String>,
    /// Accept the defaults for anything not given (always on: keel never prompts)
    #[arg(long)]
    defaults: bool,
}

#[derive(Args, Debug)]
pub struct EditArgs {
    /// Stream name
    stream: String,
    #[command(flatten)]
    flags: StreamFlags,
    /// Read the new configuration from a JSON file (flags override it)
    #[arg(long, value_name = "FILE")]
    config: Option<String>,
    /// Edit without asking (keel applies edits without asking anyway)
    #[arg(short, long)]
    force: bool,
    /// Only show what would change
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Stream name
    stream: String,
    /// Show only the state
    #[arg(long)]
    state: bool,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only streams that store this subject (wildcards allowed)
    #[arg(long)]
    subject: Option<String>,
    /// Print only the names
    #[arg(short, long)]
    names: bool,
    /// Include system streams (KV buckets and others starting with "KV_", "OBJ_")
    #[arg(short, long)]
    all: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Stream name
    stream: String,
    /// Delete without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct PurgeArgs {
    /// Stream name
    stream: String,
    /// Purge without asking
    #[arg(short, long)]
    force: bool,
    /// Only messages on this subject
    #[arg(long)]
    subject: Option<String>,
    /// Purge up to, not including, this sequence
    #[arg(long)]
    seq: Option<u64>,
    /// Keep this many of the newest messages
    #[arg(long)]
    keep: Option<u64>,
}

#[derive(Args, Debug)]
pub struct GetArgs {
    /// Stream name
    stream: String,
    /// Message sequence
    id: Option<u64>,
    /// Get the last message on this subject instead
    #[arg(short = 'S', long, value_name = "SUBJECT")]
    last_for: Option<String>,
}

#[derive(Args, Debug)]
pub struct SubjectsArgs {
    /// Stream name
    stream: String,
    /// Only subjects matching this filter
    #[arg(default_value = ">")]
    filter: String,
    /// Sort by name or messages
    #[arg(long, default_value = "messages", value_parser = ["name", "subjects", "messages", "count"])]
    sort: String,
    /// Print only subject names
    #[arg(long)]
    names: bool,
}

pub async fn run(conn: &ConnSettings, cmd: &StreamCmd, json: bool) -> Res<()> {
    let js = Js::connect(conn).await?;
    match cmd {
        StreamCmd::Add(a) => add(&js, a, json).await,
        StreamCmd::Edit(a) => edit(&js, a, json).await,
        StreamCmd::Info(a) => {
            let info = js.stream_info(&a.stream).await?;
            show(&info, json, a.state);
            Ok(())
        }
        StreamCmd::Ls(a) => ls(&js, a, json).await,
        StreamCmd::Rm(a) => rm(&js, a).await,
        StreamCmd::Cluster(ClusterCmd::StepDown(a)) => {
            step_down(&js, &a.stream, a.preferred.as_deref()).await
        }
        StreamCmd::Cluster(ClusterCmd::PeerRemove(a)) => {
            // natscli's lines.
            let stamp = crate::output::now_stamp;
            println!("{} Removing peer \"{}\"", stamp(), a.peer);
            js.api(
                &format!("STREAM.PEER.REMOVE.{}", a.stream),
                Some(&json!({ "peer": a.peer })),
            )
            .await
            .map_err(|e| format!("cannot remove peer {}: {}", a.peer, String::from(e)))?;
            println!("{} Requested removal of peer \"{}\"", stamp(), a.peer);
            Ok(())
        }
        StreamCmd::Purge(a) => purge(&js, a, json).await,
        StreamCmd::Get(a) => get(&js, a, json).await,
        StreamCmd::Subjects(a) => subjects(&js, a, json).await,
        StreamCmd::State(a) => {
            let info = js.stream_info(&a.stream).await?;
            if json {
                print_json(&info["state"]);
            } else {
                show(&info, false, true);
            }
            Ok(())
        }
        StreamCmd::Report(a) => crate::stream_ops::report(&js, a, json).await,
        StreamCmd::Find(a) => crate::stream_ops::find(&js, a, json).await,
        StreamCmd::View(a) => crate::stream_ops::view(&js, a).await,
        StreamCmd::Rmm(a) => crate::stream_ops::rmm(&js, a).await,
        StreamCmd::Seal(a) => crate::stream_ops::seal(&js, a, json).await,
        StreamCmd::Copy(a) => crate::stream_ops::copy(&js, a, json).await,
        StreamCmd::Backup(a) => crate::stream_ops::backup(&js, a).await,
        StreamCmd::Restore(a) => crate::stream_ops::restore(&js, a, json).await,
    }
}

/// Splits `--subjects 'a, b c'` the way `nats` does.
fn split_subjects(items: &[String]) -> Vec<String> {
    items
        .iter()
        .flat_map(|s| s.split([',', ' ']))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// `-1`, `0`, empty and `unlimited` mean no limit (0 on the wire).
fn limit_duration(flag: &str, v: &str) -> Res<i64> {
    let t = v.trim();
    if t.is_empty() || t == "unlimited" || t.parse::<i64>().is_ok_and(|x| x <= 0) {
        return Ok(0);
    }
    parse_duration(t)
        .map(|d| d.as_nanos() as i64)
        .map_err(|e| format!("--{flag}: {e}"))
}

fn limit_bytes(flag: &str, v: &str) -> Res<i64> {
    let t = v.trim();
    if t == "unlimited" {
        return Ok(-1);
    }
    match parse_bytes(t).map_err(|e| format!("--{flag}: {e}"))? {
        0 => Ok(-1),
        x => Ok(x),
    }
}

pub(crate) fn load_config_file(path: &str) -> Res<Map<String, Value>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read --config {path}: {e}"))?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(format!("--config {path}: expected a JSON object")),
        Err(e) => Err(format!("--config {path}: invalid JSON: {e}")),
    }
}

/// Applies the flags that were given onto `cfg` (a stream config object).
pub(crate) fn apply_flags(cfg: &mut Map<String, Value>, f: &StreamFlags, adding: bool) -> Res<()> {
    let subjects = split_subjects(&f.subjects);
    if !subjects.is_empty() {
        cfg.insert("subjects".into(), json!(subjects));
    }
    if let Some(d) = &f.description {
        cfg.insert("description".into(), json!(d));
    }
    if let Some(st) = f.storage {
        if !adding {
            return Err("the storage type of an existing stream cannot be changed".into());
        }
        let v = match st {
            Storage::File => "file",
            Storage::Memory => "memory",
        };
        cfg.insert("storage".into(), json!(v));
    }
    if let Some(r) = f.replicas {
        if r < 1 {
            return Err(format!("--replicas must be at least 1, not {r}"));
        }
        cfg.insert("num_replicas".into(), json!(r));
    }
    if f.cluster.is_some() || !f.tags.is_empty() {
        let mut p = cfg
            .get("placement")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        if let Some(c) = &f.cluster {
            p.insert("cluster".into(), json!(c));
        }
        if !f.tags.is_empty() {
            p.insert("tags".into(), json!(f.tags));
        }
        cfg.insert("placement".into(), Value::Object(p));
    }
    if let Some(r) = f.retention {
        let v = match r {
            Retention::Limits => "limits",
            Retention::Interest => "interest",
            Retention::Work => "workqueue",
        };
        cfg.insert("retention".into(), json!(v));
    }
    if let Some(d) = f.discard {
        let v = match d {
            Discard::Old => "old",
            Discard::New => "new",
        };
        cfg.insert("discard".into(), json!(v));
    }
    if f.discard_per_subject {
        cfg.insert("discard".into(), json!("new"));
        cfg.insert("discard_new_per_subject".into(), json!(true));
    }
    if let Some(v) = &f.max_age {
        cfg.insert("max_age".into(), json!(limit_duration("max-age", v)?));
    }
    if let Some(v) = &f.max_bytes {
        cfg.insert("max_bytes".into(), json!(limit_bytes("max-bytes", v)?));
    }
    if let Some(v) = f.max_msgs {
        cfg.insert("max_msgs".into(), json!(if v <= 0 { -1 } else { v }));
    }
    if let Some(v) = f.max_msgs_per_subject {
        cfg.insert(
            "max_msgs_per_subject".into(),
            json!(if v <= 0 { -1 } else { v }),
        );
    }
    if let Some(v) = &f.max_msg_size {
        let size = limit_bytes("max-msg-size", v)?;
        if size > i32::MAX as i64 {
            return Err(format!("--max-msg-size {v} is too big (at most 2GiB)"));
        }
        cfg.insert("max_msg_size".into(), json!(size));
    }
    if let Some(v) = f.max_consumers {
        cfg.insert("max_consumers".into(), json!(if v <= 0 { -1 } else { v }));
    }
    if let Some(v) = &f.dupe_window {
        let d = parse_duration(v).map_err(|e| format!("--dupe-window: {e}"))?;
        cfg.insert("duplicate_window".into(), json!(d.as_nanos() as i64));
    }
    if f.allow_rollup {
        cfg.insert("allow_rollup_hdrs".into(), json!(true));
    }
    if f.deny_delete {
        cfg.insert("deny_delete".into(), json!(true));
    }
    if f.deny_purge {
        cfg.insert("deny_purge".into(), json!(true));
    }
    if f.no_allow_direct {
        cfg.insert("allow_direct".into(), json!(false));
    }
    if f.no_ack {
        cfg.insert("no_ack".into(), json!(true));
    }
    if let Some(c) = f.compression {
        let v = match c {
            Compression::None => "none",
            Compression::S2 => "s2",
        };
        cfg.insert("compression".into(), json!(v));
    }
    if let Some(seq) = f.first_sequence {
        if !adding {
            return Err("--first-sequence can only be set when adding a stream".into());
        }
        cfg.insert("first_seq".into(), json!(seq));
    }
    crate::js::apply_metadata(cfg, &f.metadata)?;
    Ok(())
}

/// The configuration `nats stream add` sends when every prompt is answered
/// with its default.
fn default_config(name: &str) -> Map<String, Value> {
    let v = json!({
        "name": name,
        "subjects": [],
        "retention": "limits",
        "max_consumers": -1,
        "max_msgs": -1,
        "max_bytes": -1,
        "max_age": 0,
        "max_msgs_per_subject": -1,
        "max_msg_size": -1,
        "discard": "old",
        "storage": "file",
        "num_replicas": 1,
        "duplicate_window": 120_000_000_000i64,
        "compression": "none",
        "allow_direct": true,
        "mirror_direct": false,
        "sealed": false,
        "deny_delete": false,
        "deny_purge": false,
        "allow_rollup_hdrs": false,
    });
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

async fn add(js: &Js, a: &AddArgs, json_out: bool) -> Res<()> {
    let mut cfg = match &a.config {
        Some(path) => load_config_file(path)?,
        None => Map::new(),
    };
    let name = match (&a.stream, cfg.get("name").and_then(Value::as_str)) {
        (Some(n), _) => n.clone(),
        (None, Some(n)) => n.to_string(),
        (None, None) => {
            return Err("a stream name is required: keel stream add NAME --subjects ...".into())
        }
    };
    check_name("stream", &name)?;
    if a.config.is_none() {
        cfg = default_config(&name);
    }
    cfg.insert("name".into(), json!(name));
    apply_flags(&mut cfg, &a.flags, true)?;
    let has_subjects = cfg
        .get("subjects")
        .and_then(Value::as_array)
        .is_some_and(|s| !s.is_empty());
    if !has_subjects && cfg.get("mirror").is_none() && cfg.get("sources").is_none() {
        // nats would prompt; without subjects a stream stores its own name.
        cfg.insert("subjects".into(), json!([name]));
    }
    // Like nats: the duplicate window defaults to 2m, or max_age when shorter.
    if a.flags.dupe_window.is_none() && a.config.is_none() {
        let max_age = cfg.get("max_age").and_then(Value::as_i64).unwrap_or(0);
        if max_age > 0 && max_age < 120_000_000_000 {
            cfg.insert("duplicate_window".into(), json!(max_age));
        }
    }
    let info = js
        .api(&format!("STREAM.CREATE.{name}"), Some(&Value::Object(cfg)))
        .await
        .map_err(|e| match e.err_code() {
            Some(10058) => format!(
                "stream {name} already exists with a different configuration (change it with `keel stream edit {name} ...`)"
            ),
            Some(10065) => format!(
                "cannot create stream {name}: its subjects overlap with another stream's (see `keel stream ls`)"
            ),
            _ => format!("cannot create stream {name}: {}", String::from(e)),
        })?;
    if !json_out {
        println!("Stream {name} was created\n");
    }
    show(&info, json_out, false);
    Ok(())
}

async fn edit(js: &Js, a: &EditArgs, json_out: bool) -> Res<()> {
    let current = js.stream_info(&a.stream).await?;
    let old = current
        .get("config")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut cfg = match &a.config {
        Some(path) => {
            let mut m = load_config_file(path)?;
            m.insert("name".into(), json!(a.stream));
            m
        }
        None => old.clone(),
    };
    apply_flags(&mut cfg, &a.flags, false)?;
    let changes = diff(&old, &cfg);
    if changes.is_empty() {
        return Err(format!(
            "no changes to stream {}: give the settings to change, e.g. --max-age 48h",
            a.stream
        ));
    }
    if !json_out {
        println!("Differences (-old +new):");
        for c in &changes {
            println!("{c}");
        }
        println!();
    }
    if a.dry_run {
        return Ok(());
    }
    let info = js
        .api(
            &format!("STREAM.UPDATE.{}", a.stream),
            Some(&Value::Object(cfg)),
        )
        .await
        .map_err(|e| format!("cannot update stream {}: {}", a.stream, String::from(e)))?;
    if !json_out {
        println!("Stream {} was updated\n", a.stream);
    }
    show(&info, json_out, false);
    Ok(())
}

fn diff(old: &Map<String, Value>, new: &Map<String, Value>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in new {
        match old.get(k) {
            Some(o) if o == v => {}
            Some(o) => {
                out.push(format!("-  {k}: {o}"));
                out.push(format!("+  {k}: {v}"));
            }
            None => out.push(format!("+  {k}: {v}")),
        }
    }
    out
}

fn title_case(v: &str) -> String {
    match v {
        "workqueue" => "WorkQueue".into(),
        _ => {
            let mut c = v.chars();
            match c.next() {
                Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
                None => String::new(),
            }
        }
    }
}

fn unlimited_or(v: i64, f: impl Fn(i64) -> String) -> String {
    if v <= 0 {
        "unlimited".into()
    } else {
        f(v)
    }
}

/// Prints stream info as `nats stream info` does (or its JSON).
pub fn show(info: &Value, json_out: bool, state_only: bool) {
    if json_out {
        print_json(info);
        return;
    }
    let cfg = &info["config"];
    let st = &info["state"];
    let name = s(cfg, "name");
    let mut c = Cols::new(if state_only {
        format!(
            "State for Stream {name} created {}",
            fmt_time(s(info, "created"))
        )
    } else {
        format!(
            "Information for Stream {name} created {}",
            fmt_time(s(info, "created"))
        )
    });
    if !state_only {
        c.row_if(
            !s(cfg, "description").is_empty(),
            "Description",
            s(cfg, "description"),
        );
        let subjects: Vec<&str> = cfg["subjects"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        c.row_if(!subjects.is_empty(), "Subjects", subjects.join(", "));
        c.row("Replicas", i(cfg, "num_replicas").max(1));
        c.row_if(b(cfg, "sealed"), "Sealed", true);
        c.row("Storage", title_case(s(cfg, "storage")));
        let placement = &cfg["placement"];
        c.row_if(
            !s(placement, "cluster").is_empty(),
            "Placement Cluster",
            s(placement, "cluster"),
        );
        let tags: Vec<&str> = placement["tags"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        c.row_if(!tags.is_empty(), "Placement Tags", tags.join(", "));
        let comp = s(cfg, "compression");
        c.row_if(!comp.is_empty() && comp != "none", "Compression", comp);
        c.row_if(
            u(cfg, "first_seq") > 0,
            "First Sequence",
            n(u(cfg, "first_seq")),
        );

        c.section("Options");
        c.row("Retention", title_case(s(cfg, "retention")));
        c.row("Acknowledgments", !b(cfg, "no_ack"));
        c.row(
            "Discard Policy",
            if b(cfg, "discard_new_per_subject") {
                "New Per Subject".to_string()
            } else {
                title_case(s(cfg, "discard"))
            },
        );
        c.row("Duplicate Window", dur_ns(i(cfg, "duplicate_window")));
        c.row_if(b(cfg, "allow_direct"), "Direct Get", true);
        c.row("Allows Msg Delete", !b(cfg, "deny_delete"));
        c.row("Allows Purge", !b(cfg, "deny_purge"));
        c.row("Allows Rollups", b(cfg, "allow_rollup_hdrs"));

        c.section("Limits");
        c.row(
            "Maximum Messages",
            unlimited_or(i(cfg, "max_msgs"), |v| n(v as u64)),
        );
        c.row(
            "Maximum Per Subject",
            unlimited_or(i(cfg, "max_msgs_per_subject"), |v| n(v as u64)),
        );
        c.row(
            "Maximum Bytes",
            unlimited_or(i(cfg, "max_bytes"), |v| ibytes(v as u64)),
        );
        c.row(
            "Maximum Age",
            unlimited_or(i(cfg, "max_age"), |v| dur(Duration::from_nanos(v as u64))),
        );
        c.row(
            "Maximum Message Size",
            unlimited_or(i(cfg, "max_msg_size"), |v| ibytes(v as u64)),
        );
        c.row(
            "Maximum Consumers",
            unlimited_or(i(cfg, "max_consumers"), |v| n(v as u64)),
        );
        if let Some(meta) = cfg["metadata"].as_object() {
            let user: Vec<_> = meta
                .iter()
                .filter(|(k, _)| !k.starts_with("_nats"))
                .collect();
            if !user.is_empty() {
                c.section("Metadata");
                for (k, v) in user {
                    c.row(k, v.as_str().unwrap_or_default());
                }
            }
        }
    }

    cluster_section(&mut c, &info["cluster"]);

    c.section("State");
    c.row("Messages", n(u(st, "messages")));
    c.row("Bytes", ibytes(u(st, "bytes")));
    let seq_line = |seq: u64, t: &str| match crate::output::parse_time(t) {
        Some(_) => format!("{} @ {}", n(seq), fmt_time(t)),
        None => n(seq),
    };
    c.row(
        "First Sequence",
        seq_line(u(st, "first_seq"), s(st, "first_ts")),
    );
    c.row(
        "Last Sequence",
        seq_line(u(st, "last_seq"), s(st, "last_ts")),
    );
    if u(st, "num_deleted") > 0 {
        c.row("Deleted Messages", n(u(st, "num_deleted")));
    }
    c.row("Active Consumers", n(u(st, "consumer_count")));
    c.row_if(
        u(st, "num_subjects") > 0,
        "Number of Subjects",
        n(u(st, "num_subjects")),
    );
    print!("{}", c.render());
    println!();
}

/// `stream cluster step-down`: the leader hands over, then the new one is shown (natscli's
/// lines).
async fn step_down(js: &Js, stream: &str, preferred: Option<&str>) -> Res<()> {
    let req = preferred.map(|p| json!({"placement": {"preferred": p}}));
    leader_step_down(
        js,
        &format!("STREAM.INFO.{stream}"),
        &format!("STREAM.LEADER.STEPDOWN.{stream}"),
        req.as_ref(),
    )
    .await
}

/// A stream's or consumer's leader stepdown: `info` names the leader and its peers before,
/// then the new leader once `stepdown` has moved it.
pub(crate) async fn leader_step_down(
    js: &Js,
    info: &str,
    stepdown: &str,
    req: Option<&serde_json::Value>,
) -> Res<()> {
    let before = js.api(info, None).await.map_err(String::from)?;
    let old = s(&before["cluster"], "leader").to_string();
    if old.is_empty() {
        return Err("no leader to step down (is the cluster electing one?)".into());
    }
    println!(
        "{} Requesting leader step down of \"{old}\" in a {} peer RAFT group",
        crate::output::now_stamp(),
        before["cluster"]["replicas"]
            .as_array()
            .map_or(1, |r| r.len() + 1)
    );
    js.api(stepdown, req).await.map_err(String::from)?;
    let look = || async {
        let v = js.api(info, None).await.ok()?;
        Some(s(&v["cluster"], "leader").to_string())
    };
    match crate::util::new_leader(&old, std::time::Duration::from_secs(10), look).await {
        Some(new) => {
            println!(
                "{} New leader elected \"{new}\"",
                crate::output::now_stamp()
            );
            Ok(())
        }
        None => Err(format!("leader did not change from {old}")),
    }
}

async fn ls(js: &Js, a: &LsArgs, json_out: bool) -> Res<()> {
    let mut filter = json!({});
    if let Some(sub) = &a.subject {
        filter = json!({ "subject": sub });
    }
    let hidden = |name: &str| !a.all && (name.starts_with("KV_") || name.starts_with("OBJ_"));
    if a.names || json_out {
        let names = js
            .paged("STREAM.NAMES", "streams", filter)
            .await
            .map_err(String::from)?;
        let mut names: Vec<String> = names
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .filter(|n| !hidden(n))
            .collect();
        names.sort();
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&names).unwrap_or_default()
            );
        } else {
            for name in names {
                println!("{name}");
            }
        }
        return Ok(());
    }
    let mut infos = js
        .paged("STREAM.LIST", "streams", filter)
        .await
        .map_err(String::from)?;
    infos.retain(|i| !hidden(s(&i["config"], "name")));
    if infos.is_empty() {
        println!("No Streams defined");
        return Ok(());
    }
    infos.sort_by_key(|i| u(&i["state"], "bytes"));
    let title = match &a.subject {
        Some(sub) => format!("Streams matching {sub}"),
        None => "Streams".to_string(),
    };
    println!("{}", streams_table(title, &infos));
    Ok(())
}

/// natscli's "Cluster Information" of a stream or consumer info: the cluster, the leader
/// and each replica with whether it is current and when it was last seen.
pub(crate) fn cluster_section(c: &mut crate::output::Cols, cl: &Value) {
    let Some(name) = cl["name"].as_str() else {
        return;
    };
    c.section("Cluster Information");
    c.row("Name", name);
    if let Some(g) = cl["raft_group"].as_str() {
        c.row("Cluster Group", g);
    }
    c.row("Leader", s(cl, "leader"));
    for r in cl["replicas"].as_array().into_iter().flatten() {
        let state = if r["offline"].as_bool() == Some(true) {
            "offline"
        } else if r["current"].as_bool() == Some(true) {
            "current"
        } else {
            "outdated"
        };
        let seen = r["active"].as_u64().unwrap_or(0) as f64 / 1e9;
        let lag = r["lag"].as_u64().unwrap_or(0);
        let mut line = format!("{}, {state}, seen {seen:.2}s ago", s(r, "name"));
        if lag > 0 {
            line.push_str(&format!(", {} operations behind", n(lag)));
        }
        c.row("Replica", line);
    }
}

/// The `stream ls` table (also used by `stream find`).
pub(crate) fn streams_table(title: String, infos: &[Value]) -> String {
    let mut t = Table::new(
        title,
        &[
            "Name",
            "Description",
            "Created",
            "Messages",
            "Size",
            "Last Message",
        ],
    );
    for info in infos {
        let st = &info["state"];
        let last = if u(st, "messages") == 0 {
            "never".to_string()
        } else {
            ago(s(st, "last_ts"), s(info, "ts")).unwrap_or_default()
        };
        t.add(vec![
            s(&info["config"], "name").to_string(),
            s(&info["config"], "description").to_string(),
            fmt_time(s(info, "created")),
            n(u(st, "messages")),
            ibytes(u(st, "bytes")),
            last,
        ]);
    }
    t.render()
}

async fn rm(js: &Js, a: &RmArgs) -> Res<()> {
    check_name("stream", &a.stream)?;
    // Check it exists first, so a typo is "not found", not a confirmation.
    js.stream_info(&a.stream).await?;
    if !confirm(&format!("Really delete Stream {}", a.stream), a.force)? {
        println!("Stream {} was not deleted", a.stream);
        return Ok(());
    }
    js.api(&format!("STREAM.DELETE.{}", a.stream), None)
        .await
        .map_err(stream_error(&a.stream))?;
    println!("Stream {} was deleted", a.stream);
    Ok(())
}

async fn purge(js: &Js, a: &PurgeArgs, json_out: bool) -> Res<()> {
    js.stream_info(&a.stream).await?;
    if a.seq.is_some() && a.keep.is_some() {
        return Err("--seq and --keep cannot be combined when purging".into());
    }
    if !confirm(&format!("Really purge Stream {}", a.stream), a.force)? {
        println!("Stream {} was not purged", a.stream);
        return Ok(());
    }
    let mut req = Map::new();
    if let Some(sub) = &a.subject {
        req.insert("filter".into(), json!(sub));
    }
    if let Some(seq) = a.seq {
        req.insert("seq".into(), json!(seq));
    }
    if let Some(keep) = a.keep {
        req.insert("keep".into(), json!(keep));
    }
    let spinner = crate::util::Progress::spinner(&format!("purging {}", a.stream), !json_out);
    let resp = js
        .api(
            &format!("STREAM.PURGE.{}", a.stream),
            (!req.is_empty()).then_some(&Value::Object(req)),
        )
        .await
        .map_err(stream_error(&a.stream));
    spinner.finish();
    let resp = resp?;
    if !json_out {
        println!("Purged {} messages from {}\n", u(&resp, "purged"), a.stream);
    }
    let info = js.stream_info(&a.stream).await?;
    show(&info, json_out, true);
    Ok(())
}

async fn get(js: &Js, a: &GetArgs, json_out: bool) -> Res<()> {
    let req = match (a.id, &a.last_for) {
        (Some(seq), _) => json!({ "seq": seq }),
        (None, Some(sub)) => json!({ "last_by_subj": sub }),
        (None, None) => {
            return Err(
                "give a message sequence (keel stream get STREAM 1) or --last-for SUBJECT".into(),
            )
        }
    };
    check_name("stream", &a.stream)?;
    let resp = js
        .api(&format!("STREAM.MSG.GET.{}", a.stream), Some(&req))
        .await
        .map_err(|e| match e.err_code() {
            Some(ERR_NO_MESSAGE_FOUND) => match (a.id, &a.last_for) {
                (Some(seq), _) => format!("no message with sequence {seq} in stream {}", a.stream),
                (_, Some(sub)) => format!("no message on {sub:?} in stream {}", a.stream),
                _ => "no message found".into(),
            },
            _ => stream_error(&a.stream)(e),
        })?;
    let msg = &resp["message"];
    if json_out {
        print_json(msg);
        return Ok(());
    }
    let when = ago(s(msg, "time"), "").unwrap_or_default();
    println!(
        "Item: {}#{} received {} ({when} ago) on Subject {}\n",
        a.stream,
        u(msg, "seq"),
        fmt_time(s(msg, "time")),
        s(msg, "subject")
    );
    if let Some(h) = msg.get("hdrs").and_then(Value::as_str) {
        let lines = header_block_lines(&base64_decode(h)?);
        if !lines.is_empty() {
            println!("Headers:");
            for l in lines {
                println!("  {l}");
            }
            println!();
        }
    }
    let data = base64_decode(s(msg, "data"))?;
    println!("{}", String::from_utf8_lossy(&data));
    Ok(())
}

async fn subjects(js: &Js, a: &SubjectsArgs, json_out: bool) -> Res<()> {
    check_name("stream", &a.stream)?;
    let mut all = Map::new();
    loop {
        let req = json!({ "subjects_filter": a.filter, "offset": all.len() });
        let info = js
            .api(&format!("STREAM.INFO.{}", a.stream), Some(&req))
            .await
            .map_err(stream_error(&a.stream))?;
        let page = info["state"]["subjects"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        let total = info.get("total").and_then(Value::as_u64).unwrap_or(0) as usize;
        let got = page.len();
        all.extend(page);
        if got == 0 || all.len() >= total {
            break;
        }
    }
    if json_out {
        print_json(&Value::Object(all));
        return Ok(());
    }
    if all.is_empty() {
        println!("No subjects found matching {}", a.filter);
        return Ok(());
    }
    let mut rows: Vec<(String, u64)> = all
        .into_iter()
        .map(|(k, v)| (k, v.as_u64().unwrap_or(0)))
        .collect();
    if a.sort == "name" || a.sort == "subjects" {
        rows.sort();
    } else {
        rows.sort_by(|x, y| x.1.cmp(&y.1).then_with(|| x.0.cmp(&y.0)));
    }
    if a.names {
        for (name, _) in rows {
            println!("{name}");
        }
        return Ok(());
    }
    let mut t = Table::new(
        format!("{} Subjects in stream {}", rows.len(), a.stream),
        &["Subject", "Count"],
    );
    for (name, count) in rows {
        t.add(vec![name, n(count)]);
    }
    println!("{}", t.render());
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn cluster_information_as_natscli_shows_it() {
        let cl = json!({"name":"jsc","raft_group":"S-R3F-abcdefgh","leader":"n1",
            "replicas":[{"name":"n2","current":true,"active":190000000,"peer":"x"},
                        {"name":"n3","current":false,"offline":true,"active":0,"lag":5,"peer":"y"}]});
        let mut c = crate::output::Cols::new("t");
        cluster_section(&mut c, &cl);
        let out = c.render();
        assert!(out.contains("Cluster Information"), "{out}");
        assert!(out.contains("Leader: n1"), "{out}");
        assert!(
            out.contains("Replica: n2, current, seen 0.19s ago"),
            "{out}"
        );
        assert!(
            out.contains("Replica: n3, offline, seen 0.00s ago, 5 operations behind"),
            "{out}"
        );
        // A single server's info has no cluster name: no section.
        let mut c = crate::output::Cols::new("t");
        cluster_section(&mut c, &json!({"leader":"n1"}));
        assert!(!c.render().contains("Cluster"));
    }

    use super::*;

    #[test]
    fn subjects_split_like_nats() {
        assert_eq!(
            split_subjects(&["a.>, b.*".into(), "c".into()]),
            vec!["a.>", "b.*", "c"]
        );
    }

    #[test]
    fn limits() {
        assert_eq!(limit_duration("max-age", "-1").unwrap(), 0);
        assert_eq!(
            limit_duration("max-age", "24h").unwrap(),
            86_400_000_000_000
        );
        assert!(limit_duration("max-age", "24x").is_err());
        assert_eq!(limit_bytes("max-bytes", "1GB").unwrap(), 1 << 30);
        assert_eq!(limit_bytes("max-bytes", "-1").unwrap(), -1);
    }
}
