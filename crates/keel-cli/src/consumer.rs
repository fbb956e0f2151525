//! `keel consumer ...`: add, edit, info, state, report, ls, rm, next, sub, pause, resume and
//! reset, with the `nats` CLI's
//! flags and, where `nats` would prompt, its defaults (pull, deliver all, ack
//! explicit). `--durable` works both with a name (`--durable worker`) and as
//! a plain flag next to a positional name (`consumer add S worker --durable`).

use async_nats::jetstream::{self, consumer::pull, AckKind};
use clap::{Args, Subcommand, ValueEnum};
use futures::StreamExt;
use serde_json::{json, Map, Value};

use crate::js::{check_name, consumer_error, stream_error, Js, JsError};
use crate::output::{ago, b, dur, dur_ns, fmt_time, i, n, now_ns, print_json, s, u, Cols, Table};
use crate::util::{confirm, header_lines, parse_duration, ConnSettings, Res};

#[derive(Subcommand, Debug)]
pub enum ConsumerCmd {
    /// Create a consumer on a stream
    #[command(visible_aliases = ["create", "new"])]
    Add(AddArgs),
    /// Change a consumer's configuration
    #[command(visible_alias = "update")]
    Edit(EditArgs),
    /// Show a consumer's configuration and state
    #[command(visible_alias = "nfo")]
    Info(InfoArgs),
    /// List the consumers of a stream
    #[command(visible_alias = "list")]
    Ls(LsArgs),
    /// Delete a consumer
    #[command(visible_aliases = ["delete", "del"])]
    Rm(RmArgs),
    /// Fetch messages from a pull consumer, print and (by default) ack them
    Next(NextArgs),
    /// Show only a consumer's state
    State(StateArgs),
    /// Statistics of every consumer of a stream
    Report(ReportArgs),
    /// Receive messages from a push or pull consumer until interrupted
    Sub(SubArgs),
    /// Pause a consumer until a later time
    Pause(PauseArgs),
    /// Resume a paused consumer
    Resume(ResumeArgs),
    /// Resets the consumer to a previous state
    Reset(ResetArgs),
    /// Manage a consumer's leadership in a cluster
    #[command(subcommand)]
    Cluster(ClusterCmd),
}

#[derive(clap::Subcommand, Debug)]
pub enum ClusterCmd {
    /// Make another replica the consumer's leader
    #[command(name = "step-down")]
    StepDown(StepDownArgs),
}

#[derive(Args, Debug)]
pub struct StepDownArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
}

#[derive(Args, Debug)]
pub struct PauseArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
    /// Pause until a time (`2006-01-02 15:04:05`, UTC, or RFC 3339) or for a duration
    /// (`1h30m`); default an hour from now, the answer nats offers when it prompts
    #[arg(value_name = "TIME")]
    until: Option<String>,
    /// Force pause without prompting
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct ResumeArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
    /// Force resume without prompting
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct ResetArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
    /// Sequence to reset to (default: one past the ack floor)
    #[arg(long)]
    sequence: Option<u64>,
    /// Force reset without prompting
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct StateArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Stream name
    stream: String,
    /// Show raw numbers
    #[arg(short, long)]
    raw: bool,
}

#[derive(Args, Debug)]
pub struct SubArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
    /// Do not acknowledge the messages
    #[arg(long)]
    no_ack: bool,
    /// Print only the message bodies
    #[arg(short, long)]
    raw: bool,
    /// Push consumers: join this deliver group (default: the consumer's)
    #[arg(long, value_name = "GROUP")]
    deliver_group: Option<String>,
    /// Exit after this many messages (0 = run until interrupted)
    #[arg(long, default_value_t = 0)]
    count: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AckMode {
    /// Each message is acknowledged on its own
    Explicit,
    /// Acknowledging a message acknowledges all before it
    All,
    /// No acknowledgements: a message counts as handled once delivered
    None,
    /// Same as none on the wire (the server acknowledges on delivery)
    Auto,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Replay {
    Instant,
    Original,
}

/// Flags shared by `add` and `edit`.
#[derive(Args, Debug, Default)]
pub struct ConsumerFlags {
    /// Description of the consumer
    #[arg(long)]
    description: Option<String>,
    /// Only deliver messages on these subjects (repeatable, or comma separated)
    #[arg(long, value_name = "SUBJECTS")]
    filter: Vec<String>,
    /// How long the server waits for an ack before redelivering, e.g. 30s
    #[arg(long, visible_alias = "wait", value_name = "DURATION")]
    ack_wait: Option<String>,
    /// Deliver a message at most this many times (-1 = unlimited)
    #[arg(long, allow_hyphen_values = true, value_name = "TRIES")]
    max_deliver: Option<i64>,
    /// Most unacknowledged messages before delivery pauses (0 = server default)
    #[arg(long, visible_alias = "max-outstanding", allow_hyphen_values = true)]
    max_pending: Option<i64>,
    /// Deliver only headers, no bodies
    #[arg(long)]
    headers_only: bool,
    /// Remove the consumer after this long without activity, e.g. 1h
    #[arg(long, value_name = "DURATION")]
    inactive_threshold: Option<String>,
    /// Largest batch a pull request may ask for
    #[arg(long, value_name = "BATCH_SIZE")]
    max_pull_batch: Option<i64>,
    /// Longest expiry a pull request may ask for
    #[arg(long, value_name = "EXPIRES")]
    max_pull_expire: Option<String>,
    /// Backoff between redeliveries: comma separated durations, e.g. 1s,5s,30s
    #[arg(long, value_name = "DURATIONS")]
    backoff: Option<String>,
    /// Metadata as key=value (repeatable)
    #[arg(long, value_name = "KEY=VALUE")]
    metadata: Vec<String>,
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// Stream name
    stream: Option<String>,
    /// Consumer name
    consumer: Option<String>,
    /// Durable name; also usable as a plain flag with the name given as CONSUMER
    #[arg(long, num_args = 0..=1, default_missing_value = "", value_name = "NAME")]
    durable: Option<String>,
    /// Create an ephemeral consumer (removed when unused)
    #[arg(long)]
    ephemeral: bool,
    /// Acknowledgement policy [default: explicit for pull, none for push]
    #[arg(long, value_enum)]
    ack: Option<AckMode>,
    /// Where to start: all, new, last, subject (last per subject), a sequence, or a duration like 1h
    #[arg(long, value_name = "POLICY", default_value = "all")]
    deliver: String,
    /// Pull mode (the default unless --target is given)
    #[arg(long)]
    pull: bool,
    /// Push mode: deliver messages to this subject
    #[arg(long, value_name = "SUBJECT")]
    target: Option<String>,
    /// Push mode: deliver only to subscribers in this queue group
    #[arg(long, value_name = "GROUP")]
    deliver_group: Option<String>,
    /// Push mode: flow control
    #[arg(long)]
    flow_control: bool,
    /// Push mode: idle heartbeat interval
    #[arg(long, value_name = "DURATION")]
    heartbeat: Option<String>,
    /// Replay policy
    #[arg(long, value_enum, default_value = "instant")]
    replay: Replay,
    /// Most pull requests waiting at once
    #[arg(long, value_name = "PULLS")]
    max_waiting: Option<i64>,
    /// Replicas (default: as the stream)
    #[arg(long)]
    replicas: Option<i64>,
    /// Keep consumer state in memory
    #[arg(long)]
    memory: bool,
    /// Read the consumer configuration from a JSON file
    #[arg(long, value_name = "FILE")]
    config: Option<String>,
    /// Accept defaults for anything not given (always on: keel never prompts)
    #[arg(long)]
    defaults: bool,
    #[command(flatten)]
    flags: ConsumerFlags,
}

#[derive(Args, Debug)]
pub struct EditArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
    #[command(flatten)]
    flags: ConsumerFlags,
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
    /// Consumer name
    consumer: String,
    /// Show only the state
    #[arg(long)]
    state: bool,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Stream name
    stream: String,
    /// Print only the names
    #[arg(short, long)]
    names: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Stream name
    stream: String,
    /// Consumer name
    consumer: String,
    /// Delete without asking
    #[arg(short, long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct NextArgs {
    /// Stream name
    stream: String,
    /// Consumer name (a pull consumer)
    consumer: String,
    /// Number of messages to fetch
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// Acknowledge each message after printing it (the default)
    #[arg(long, overrides_with = "no_ack")]
    ack: bool,
    /// Do not acknowledge: the messages are redelivered after the ack wait
    #[arg(long)]
    no_ack: bool,
    /// Negatively acknowledge (ask for redelivery now)
    #[arg(long, conflicts_with_all = ["term", "no_ack"])]
    nak: bool,
    /// Terminate the messages (never redeliver)
    #[arg(long, conflicts_with = "no_ack")]
    term: bool,
    /// Print only the message bodies
    #[arg(short, long)]
    raw: bool,
}

pub async fn run(conn: &ConnSettings, cmd: &ConsumerCmd, json: bool) -> Res<()> {
    let js = Js::connect(conn).await?;
    match cmd {
        ConsumerCmd::Add(a) => add(&js, a, json).await,
        ConsumerCmd::Edit(a) => edit(&js, a, json).await,
        ConsumerCmd::Info(a) => {
            let info = js.consumer_info(&a.stream, &a.consumer).await?;
            show(&info, json, a.state);
            Ok(())
        }
        ConsumerCmd::Ls(a) => ls(&js, a, json).await,
        ConsumerCmd::Rm(a) => rm(&js, a).await,
        ConsumerCmd::Next(a) => next(&js, a).await,
        ConsumerCmd::State(a) => {
            let info = js.consumer_info(&a.stream, &a.consumer).await?;
            show(&info, json, true);
            Ok(())
        }
        ConsumerCmd::Report(a) => report(&js, a, json).await,
        ConsumerCmd::Sub(a) => sub(&js, a).await,
        ConsumerCmd::Pause(a) => pause(&js, a, json).await,
        ConsumerCmd::Resume(a) => resume(&js, a, json).await,
        ConsumerCmd::Reset(a) => reset(&js, a, json).await,
        ConsumerCmd::Cluster(ClusterCmd::StepDown(a)) => {
            crate::stream::leader_step_down(
                &js,
                &format!("CONSUMER.INFO.{}.{}", a.stream, a.consumer),
                &format!("CONSUMER.LEADER.STEPDOWN.{}.{}", a.stream, a.consumer),
                None,
            )
            .await
        }
    }
}

/// The `nats consumer pause` time: `2006-01-02 15:04:05` (UTC, as Go's time.Parse reads
/// it), an RFC 3339 time, or a duration from now. Nanoseconds since the epoch.
fn parse_pause_until(until: &str) -> Res<i128> {
    let t = until.trim();
    if t.len() == 19 && t.as_bytes()[10] == b' ' {
        if let Some(ns) = crate::output::parse_time(&format!("{}T{}Z", &t[..10], &t[11..])) {
            return Ok(ns);
        }
    }
    if let Some(ns) = crate::output::parse_time(t) {
        return Ok(ns);
    }
    match parse_duration(t) {
        Ok(d) => Ok(crate::output::now_ns() + d.as_nanos() as i128),
        Err(_) => Err(format!(
            "could not parse the pause time {until:?} as either timestamp (2006-01-02 15:04:05) or duration (1h30m)"
        )),
    }
}

async fn pause(js: &Js, a: &PauseArgs, json_out: bool) -> Res<()> {
    let until = parse_pause_until(a.until.as_deref().unwrap_or("1h"))?;
    js.consumer_info(&a.stream, &a.consumer).await?;
    let local = crate::output::fmt_time_ns(until);
    if !confirm(
        &format!(
            "Really pause Consumer {} > {} until {local}",
            a.stream, a.consumer
        ),
        a.force,
    )? {
        return Ok(());
    }
    let resp = js
        .api(
            &format!("CONSUMER.PAUSE.{}.{}", a.stream, a.consumer),
            Some(&json!({ "pause_until": crate::output::rfc3339_ns(until) })),
        )
        .await
        .map_err(consumer_error(&a.stream, &a.consumer))?;
    if json_out {
        print_json(&resp);
        return Ok(());
    }
    if !b(&resp, "paused") {
        return Err("consumer failed to pause, perhaps a time in the past was given".into());
    }
    let remaining = std::time::Duration::from_nanos(u(&resp, "pause_remaining"));
    let shown = crate::output::parse_time(s(&resp, "pause_until")).unwrap_or(until);
    println!(
        "Paused {} > {} until {} ({})",
        a.stream,
        a.consumer,
        crate::output::fmt_time_ns(shown),
        dur(round_secs(remaining))
    );
    Ok(())
}

/// Rounds to whole seconds, as Go's `Duration.Round(time.Second)`.
fn round_secs(d: std::time::Duration) -> std::time::Duration {
    std::time::Duration::from_secs((d.as_millis() as u64 + 500) / 1000)
}

async fn resume(js: &Js, a: &ResumeArgs, json_out: bool) -> Res<()> {
    let info = js.consumer_info(&a.stream, &a.consumer).await?;
    if !b(&info, "paused") {
        return Err("consumer is not paused".into());
    }
    // When the pause would have ended, as the server saw it.
    let ends = crate::output::parse_time(s(&info, "ts"))
        .map(|ts| ts + u(&info, "pause_remaining") as i128)
        .or_else(|| crate::output::parse_time(s(&info["config"], "pause_until")))
        .unwrap_or(0);
    if !confirm(
        &format!("Really resume Consumer {} > {}", a.stream, a.consumer),
        a.force,
    )? {
        return Ok(());
    }
    let resp = js
        .api(&format!("CONSUMER.PAUSE.{}.{}", a.stream, a.consumer), None)
        .await
        .map_err(consumer_error(&a.stream, &a.consumer))?;
    if b(&resp, "paused") {
        return Err(format!(
            "consumer {} > {} is still paused after the resume request",
            a.stream, a.consumer
        ));
    }
    if json_out {
        print_json(&resp);
        return Ok(());
    }
    println!(
        "Consumer {} > {} was resumed while previously paused until {}",
        a.stream,
        a.consumer,
        crate::output::fmt_time_ns(ends)
    );
    Ok(())
}

async fn reset(js: &Js, a: &ResetArgs, json_out: bool) -> Res<()> {
    js.consumer_info(&a.stream, &a.consumer).await?;
    if !confirm("Really reset the consumer", a.force)? {
        return Ok(());
    }
    let body = a.sequence.map(|seq| json!({ "seq": seq }));
    let resp = js
        .api(
            &format!("CONSUMER.RESET.{}.{}", a.stream, a.consumer),
            body.as_ref(),
        )
        .await
        .map_err(|e| match e {
            // A consumer answers its own resets; nobody answering means it is gone.
            JsError::Other(m) if m.starts_with("JetStream is not enabled") => format!(
                "consumer {} > {} not found (list them with `keel consumer ls {}`)",
                a.stream, a.consumer, a.stream
            ),
            e => consumer_error(&a.stream, &a.consumer)(e),
        })?;
    if json_out {
        print_json(&resp);
        return Ok(());
    }
    // The answer is the consumer's info as the reset left it.
    show(&resp, false, true);
    Ok(())
}

fn split_list(items: &[String]) -> Vec<String> {
    items
        .iter()
        .flat_map(|s| s.split([',', ' ']))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

fn nanos(flag: &str, v: &str) -> Res<i64> {
    parse_duration(v)
        .map(|d| d.as_nanos() as i64)
        .map_err(|e| format!("--{flag}: {e}"))
}

/// Applies the add/edit flags that were given onto a consumer config.
fn apply_flags(cfg: &mut Map<String, Value>, f: &ConsumerFlags) -> Res<()> {
    if let Some(d) = &f.description {
        cfg.insert("description".into(), json!(d));
    }
    let filters = split_list(&f.filter);
    match filters.len() {
        0 => {}
        1 => {
            cfg.insert("filter_subject".into(), json!(filters[0]));
            cfg.remove("filter_subjects");
        }
        _ => {
            cfg.insert("filter_subjects".into(), json!(filters));
            cfg.remove("filter_subject");
        }
    }
    if let Some(w) = &f.ack_wait {
        let ns = nanos("ack-wait", w)?;
        if ns <= 0 {
            return Err(format!("--ack-wait must be positive, not {w:?}"));
        }
        cfg.insert("ack_wait".into(), json!(ns));
    }
    if let Some(m) = f.max_deliver {
        cfg.insert(
            "max_deliver".into(),
            json!(if m == 0 { -1 } else { m.max(-1) }),
        );
    }
    if let Some(m) = f.max_pending {
        cfg.insert("max_ack_pending".into(), json!(m.max(0)));
    }
    if f.headers_only {
        cfg.insert("headers_only".into(), json!(true));
    }
    if let Some(t) = &f.inactive_threshold {
        cfg.insert(
            "inactive_threshold".into(),
            json!(nanos("inactive-threshold", t)?),
        );
    }
    if let Some(b) = f.max_pull_batch {
        cfg.insert("max_batch".into(), json!(b));
    }
    if let Some(e) = &f.max_pull_expire {
        cfg.insert("max_expires".into(), json!(nanos("max-pull-expire", e)?));
    }
    if let Some(list) = &f.backoff {
        let steps = list
            .split(',')
            .map(|d| nanos("backoff", d.trim()))
            .collect::<Res<Vec<i64>>>()?;
        cfg.insert("backoff".into(), json!(steps));
    }
    crate::js::apply_metadata(cfg, &f.metadata)?;
    Ok(())
}

/// `--deliver` as nats reads it.
fn apply_deliver(cfg: &mut Map<String, Value>, policy: &str) -> Res<()> {
    let p = policy.trim();
    match p.to_ascii_lowercase().as_str() {
        "all" | "" => {
            cfg.insert("deliver_policy".into(), json!("all"));
        }
        "new" | "next" => {
            cfg.insert("deliver_policy".into(), json!("new"));
        }
        "last" => {
            cfg.insert("deliver_policy".into(), json!("last"));
        }
        "subject" | "last_per_subject" | "last-per-subject" => {
            cfg.insert("deliver_policy".into(), json!("last_per_subject"));
        }
        _ => {
            if let Ok(seq) = p.parse::<u64>() {
                cfg.insert("deliver_policy".into(), json!("by_start_sequence"));
                cfg.insert("opt_start_seq".into(), json!(seq));
            } else if let Ok(d) = parse_duration(p) {
                let start = now_ns() - d.as_nanos() as i128;
                cfg.insert("deliver_policy".into(), json!("by_start_time"));
                cfg.insert(
                    "opt_start_time".into(),
                    json!(crate::output::rfc3339_ns(start)),
                );
            } else {
                return Err(format!(
                    "invalid --deliver {policy:?}: use all, new, last, subject, a sequence number or a duration like 1h"
                ));
            }
        }
    }
    Ok(())
}

async fn add(js: &Js, a: &AddArgs, json_out: bool) -> Res<()> {
    let stream = a
        .stream
        .clone()
        .ok_or("a stream name is required: keel consumer add STREAM NAME ...")?;
    check_name("stream", &stream)?;
    // `--durable NAME`, or `--durable` as a flag with the name as CONSUMER.
    let name = match (a.durable.as_deref(), a.consumer.as_deref()) {
        (Some(d), Some(c)) if !d.is_empty() && d != c => {
            return Err(format!(
                "two consumer names given: {c:?} and --durable {d:?}; give one"
            ))
        }
        (Some(d), _) if !d.is_empty() => Some(d.to_string()),
        (_, Some(c)) => Some(c.to_string()),
        _ => None,
    };
    let mut cfg = match &a.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read --config {path}: {e}"))?;
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(m)) => m,
                _ => return Err(format!("--config {path}: expected a JSON object")),
            }
        }
        None => Map::new(),
    };
    let name = name.or_else(|| {
        cfg.get("durable_name")
            .or_else(|| cfg.get("name"))
            .and_then(Value::as_str)
            .map(String::from)
    });
    if a.ephemeral && a.durable.is_some() {
        return Err("--ephemeral and --durable cannot be combined".into());
    }
    let name = match name {
        Some(n) => {
            check_name("consumer", &n)?;
            Some(n)
        }
        None if a.ephemeral => None,
        None => {
            return Err(
                "a consumer name is required: keel consumer add STREAM NAME (or --durable NAME, or --ephemeral)"
                    .into(),
            )
        }
    };
    if a.config.is_none() {
        let push = a.target.is_some();
        if a.pull && push {
            return Err(
                "--pull and --target cannot be combined (--target makes a push consumer)".into(),
            );
        }
        apply_deliver(&mut cfg, &a.deliver)?;
        let ack = a.ack.unwrap_or(if push {
            AckMode::None
        } else {
            AckMode::Explicit
        });
        let wire = match ack {
            AckMode::Explicit => "explicit",
            AckMode::All => "all",
            AckMode::None | AckMode::Auto => "none",
        };
        cfg.insert("ack_policy".into(), json!(wire));
        if wire == "none" {
            cfg.insert("max_deliver".into(), json!(-1));
        }
        cfg.insert(
            "replay_policy".into(),
            json!(match a.replay {
                Replay::Instant => "instant",
                Replay::Original => "original",
            }),
        );
        if let Some(t) = &a.target {
            cfg.insert("deliver_subject".into(), json!(t));
            if let Some(g) = &a.deliver_group {
                cfg.insert("deliver_group".into(), json!(g));
            }
            if a.flow_control {
                cfg.insert("flow_control".into(), json!(true));
            }
            if let Some(h) = &a.heartbeat {
                cfg.insert("idle_heartbeat".into(), json!(nanos("heartbeat", h)?));
            }
        } else if a.heartbeat.is_some() || a.flow_control || a.deliver_group.is_some() {
            return Err(
                "--heartbeat, --flow-control and --deliver-group are for push consumers (add --target SUBJECT)"
                    .into(),
            );
        } else if let Some(w) = a.max_waiting {
            cfg.insert("max_waiting".into(), json!(w));
        }
        if let Some(r) = a.replicas {
            cfg.insert("num_replicas".into(), json!(r));
        }
        if a.memory {
            cfg.insert("mem_storage".into(), json!(true));
        }
        if ack == AckMode::Auto && !json_out {
            eprintln!(
                "note: --ack auto is ack policy \"none\" on the wire: the server counts each message as acknowledged when it delivers it"
            );
        }
    }
    apply_flags(&mut cfg, &a.flags)?;
    if cfg.get("ack_policy").and_then(Value::as_str) == Some("none")
        && (a.flags.max_deliver.is_some() || a.flags.ack_wait.is_some())
        && !json_out
    {
        eprintln!("note: --ack-wait and --max-deliver have no effect with ack policy none");
    }
    let api = match &name {
        Some(n) => {
            if a.ephemeral {
                cfg.insert("name".into(), json!(n));
                cfg.remove("durable_name");
            } else {
                cfg.insert("durable_name".into(), json!(n));
                cfg.remove("name");
            }
            format!("CONSUMER.CREATE.{stream}.{n}")
        }
        None => format!("CONSUMER.CREATE.{stream}"),
    };
    let req = json!({ "stream_name": stream, "config": cfg, "action": "create" });
    let info = js
        .api(&api, Some(&req))
        .await
        .map_err(|e| match e.err_code() {
            Some(10148) | Some(10105) => format!(
                "consumer {stream} > {} already exists with a different configuration (change it with `keel consumer edit`)",
                name.clone().unwrap_or_default()
            ),
            _ => {
                let msg = stream_error(&stream)(e);
                format!("cannot create the consumer: {msg}")
            }
        })?;
    if !json_out {
        println!("Consumer {stream} > {} was created\n", s(&info, "name"));
    }
    show(&info, json_out, false);
    Ok(())
}

async fn edit(js: &Js, a: &EditArgs, json_out: bool) -> Res<()> {
    let info = js.consumer_info(&a.stream, &a.consumer).await?;
    let old = info["config"].as_object().cloned().unwrap_or_default();
    let mut cfg = old.clone();
    apply_flags(&mut cfg, &a.flags)?;
    let changes: Vec<String> = cfg
        .iter()
        .filter(|(k, v)| old.get(*k) != Some(v))
        .flat_map(|(k, v)| {
            let mut lines = Vec::new();
            if let Some(o) = old.get(k) {
                lines.push(format!("-  {k}: {o}"));
            }
            lines.push(format!("+  {k}: {v}"));
            lines
        })
        .collect();
    if changes.is_empty() {
        return Err(format!(
            "no changes to consumer {} > {}: give the settings to change, e.g. --ack-wait 1m",
            a.stream, a.consumer
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
    let req = json!({ "stream_name": a.stream, "config": cfg, "action": "update" });
    let info = js
        .api(
            &format!("CONSUMER.CREATE.{}.{}", a.stream, a.consumer),
            Some(&req),
        )
        .await
        .map_err(|e| {
            format!(
                "cannot update consumer {} > {}: {}",
                a.stream,
                a.consumer,
                consumer_error(&a.stream, &a.consumer)(e)
            )
        })?;
    if !json_out {
        println!("Consumer {} > {} was updated\n", a.stream, a.consumer);
    }
    show(&info, json_out, false);
    Ok(())
}

fn ack_policy_label(p: &str) -> String {
    match p {
        "explicit" => "Explicit".into(),
        "all" => "All".into(),
        "none" => "None (auto: the server counts messages as acknowledged on delivery)".into(),
        other => other.to_string(),
    }
}

fn deliver_label(cfg: &Value) -> String {
    match s(cfg, "deliver_policy") {
        "all" => "All".into(),
        "last" => "Last".into(),
        "new" => "New".into(),
        "last_per_subject" => "Last Per Subject".into(),
        "by_start_time" => format!("Since {}", fmt_time(s(cfg, "opt_start_time"))),
        "by_start_sequence" => format!("From Sequence {}", u(cfg, "opt_start_seq")),
        other => other.to_string(),
    }
}

fn seq_pair(v: &Value) -> String {
    format!(
        "Consumer sequence: {} Stream sequence: {}",
        n(u(v, "consumer_seq")),
        n(u(v, "stream_seq"))
    )
}

/// Prints consumer info as `nats consumer info` does (or its JSON).
pub fn show(info: &Value, json_out: bool, state_only: bool) {
    if json_out {
        print_json(info);
        return;
    }
    let cfg = &info["config"];
    let ts = s(info, "ts");
    let mut c = Cols::new(format!(
        "{} for Consumer {} > {} created {}",
        if state_only { "State" } else { "Information" },
        s(info, "stream_name"),
        s(info, "name"),
        fmt_time(s(info, "created"))
    ));
    let ack_none = s(cfg, "ack_policy") == "none";
    let push = !s(cfg, "deliver_subject").is_empty();
    if !state_only {
        c.section("Configuration");
        c.row("Name", s(info, "name"));
        let durable = s(cfg, "durable_name");
        c.row_if(
            !durable.is_empty() && durable != s(info, "name"),
            "Durable Name",
            durable,
        );
        c.row_if(
            !s(cfg, "description").is_empty(),
            "Description",
            s(cfg, "description"),
        );
        if push {
            c.row("Delivery Subject", s(cfg, "deliver_subject"));
        } else {
            c.row("Pull Mode", true);
        }
        if !s(cfg, "filter_subject").is_empty() {
            c.row("Filter Subject", s(cfg, "filter_subject"));
        } else if let Some(f) = cfg["filter_subjects"].as_array().filter(|f| !f.is_empty()) {
            let list: Vec<&str> = f.iter().filter_map(Value::as_str).collect();
            c.row("Filter Subjects", list.join(", "));
        }
        c.row("Deliver Policy", deliver_label(cfg));
        c.row_if(
            push && !s(cfg, "deliver_group").is_empty(),
            "Deliver Queue Group",
            s(cfg, "deliver_group"),
        );
        c.row("Ack Policy", ack_policy_label(s(cfg, "ack_policy")));
        c.row_if(!ack_none, "Ack Wait", dur_ns(i(cfg, "ack_wait")));
        c.row(
            "Replay Policy",
            match s(cfg, "replay_policy") {
                "original" => "Original",
                _ => "Instant",
            },
        );
        c.row_if(
            i(cfg, "max_deliver") > 0,
            "Maximum Deliveries",
            i(cfg, "max_deliver"),
        );
        c.row_if(
            i(cfg, "max_ack_pending") > 0,
            "Max Ack Pending",
            n(i(cfg, "max_ack_pending") as u64),
        );
        c.row_if(
            !push && i(cfg, "max_waiting") > 0,
            "Max Waiting Pulls",
            n(i(cfg, "max_waiting") as u64),
        );
        c.row_if(
            i(cfg, "idle_heartbeat") > 0,
            "Idle Heartbeat",
            dur_ns(i(cfg, "idle_heartbeat")),
        );
        c.row_if(push, "Flow Control", b(cfg, "flow_control"));
        c.row_if(b(cfg, "headers_only"), "Headers Only", true);
        c.row_if(
            i(cfg, "inactive_threshold") > 0,
            "Inactive Threshold",
            dur_ns(i(cfg, "inactive_threshold")),
        );
        c.row_if(
            i(cfg, "max_expires") > 0,
            "Max Pull Expire",
            dur_ns(i(cfg, "max_expires")),
        );
        c.row_if(
            i(cfg, "max_batch") > 0,
            "Max Pull Batch",
            i(cfg, "max_batch"),
        );
        if let Some(bo) = cfg["backoff"].as_array().filter(|a| !a.is_empty()) {
            let steps: Vec<String> = bo.iter().map(|v| dur_ns(v.as_i64().unwrap_or(0))).collect();
            c.row("Backoff", steps.join(", "));
        }
        c.row_if(
            i(cfg, "num_replicas") > 0,
            "Replicas",
            i(cfg, "num_replicas"),
        );
        c.row_if(b(cfg, "mem_storage"), "Memory Storage", true);
        if let Some(deadline) = crate::output::parse_time(s(cfg, "pause_until")) {
            if b(info, "paused") {
                c.row(
                    "Paused Until Deadline",
                    format!(
                        "{} ({} remaining)",
                        crate::output::fmt_time_ns(deadline),
                        dur(round_secs(std::time::Duration::from_nanos(u(
                            info,
                            "pause_remaining"
                        ))))
                    ),
                );
            } else {
                c.row(
                    "Paused Until Deadline",
                    format!("{} (passed)", crate::output::fmt_time_ns(deadline)),
                );
            }
        }
    }

    crate::stream::cluster_section(&mut c, &info["cluster"]);

    c.section("State");
    let delivered = &info["delivered"];
    let mut last = seq_pair(delivered);
    if let Some(a) = delivered
        .get("last_active")
        .and_then(Value::as_str)
        .and_then(|t| ago(t, ts))
    {
        last += &format!(" Last delivery: {a} ago");
    }
    c.row("Last Delivered Message", last);
    if !ack_none {
        let floor = &info["ack_floor"];
        let mut line = seq_pair(floor);
        if let Some(a) = floor
            .get("last_active")
            .and_then(Value::as_str)
            .and_then(|t| ago(t, ts))
        {
            line += &format!(" Last Ack: {a} ago");
        }
        c.row("Acknowledgment Floor", line);
        let max_pending = i(cfg, "max_ack_pending");
        if max_pending > 0 {
            c.row(
                "Outstanding Acks",
                format!(
                    "{} out of maximum {}",
                    n(u(info, "num_ack_pending")),
                    n(max_pending as u64)
                ),
            );
        } else {
            c.row("Outstanding Acks", n(u(info, "num_ack_pending")));
        }
        c.row("Redelivered Messages", n(u(info, "num_redelivered")));
    }
    c.row("Unprocessed Messages", n(u(info, "num_pending")));
    if push {
        c.row(
            "Active Interest",
            if b(info, "push_bound") {
                "Active"
            } else {
                "No interest"
            },
        );
    } else {
        let max_waiting = i(cfg, "max_waiting");
        c.row(
            "Waiting Pulls",
            if max_waiting > 0 {
                format!(
                    "{} of maximum {}",
                    n(u(info, "num_waiting")),
                    n(max_waiting as u64)
                )
            } else {
                format!("{} of unlimited", n(u(info, "num_waiting")))
            },
        );
    }
    if b(info, "paused") {
        let remaining = std::time::Duration::from_nanos(u(info, "pause_remaining"));
        let ends = crate::output::parse_time(ts).map(|t| t + remaining.as_nanos() as i128);
        c.row(
            "Paused Until",
            format!(
                "{} ({} remaining)",
                ends.map(crate::output::fmt_time_ns).unwrap_or_default(),
                dur(round_secs(remaining))
            ),
        );
    }
    print!("{}", c.render());
    println!();
}

async fn ls(js: &Js, a: &LsArgs, json_out: bool) -> Res<()> {
    check_name("stream", &a.stream)?;
    js.stream_info(&a.stream).await?;
    let infos = js
        .paged(
            &format!("CONSUMER.LIST.{}", a.stream),
            "consumers",
            json!({}),
        )
        .await
        .map_err(stream_error(&a.stream))?;
    let mut names: Vec<String> = infos.iter().map(|i| s(i, "name").to_string()).collect();
    names.sort();
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&names).unwrap_or_default()
        );
        return Ok(());
    }
    if a.names {
        for n in names {
            println!("{n}");
        }
        return Ok(());
    }
    if infos.is_empty() {
        println!("No Consumers defined");
        return Ok(());
    }
    let mut t = Table::new(
        "Consumers",
        &[
            "Name",
            "Description",
            "Created",
            "Ack Pending",
            "Unprocessed",
            "Last Delivery",
        ],
    );
    let mut infos = infos;
    infos.sort_by(|x, y| s(x, "name").cmp(s(y, "name")));
    for info in &infos {
        let last = info["delivered"]
            .get("last_active")
            .and_then(Value::as_str)
            .and_then(|t| ago(t, s(info, "ts")))
            .unwrap_or_else(|| "never".into());
        t.add(vec![
            s(info, "name").to_string(),
            s(&info["config"], "description").to_string(),
            fmt_time(s(info, "created")),
            n(u(info, "num_ack_pending")),
            n(u(info, "num_pending")),
            last,
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

async fn rm(js: &Js, a: &RmArgs) -> Res<()> {
    js.consumer_info(&a.stream, &a.consumer).await?;
    if !confirm(
        &format!("Really delete Consumer {} > {}", a.stream, a.consumer),
        a.force,
    )? {
        println!("Consumer {} > {} was not deleted", a.stream, a.consumer);
        return Ok(());
    }
    js.api(
        &format!("CONSUMER.DELETE.{}.{}", a.stream, a.consumer),
        None,
    )
    .await
    .map_err(consumer_error(&a.stream, &a.consumer))?;
    println!("Consumer {} > {} was deleted", a.stream, a.consumer);
    Ok(())
}

async fn report(js: &Js, a: &ReportArgs, json_out: bool) -> Res<()> {
    let sinfo = js.stream_info(&a.stream).await?;
    let mut infos = js
        .paged(
            &format!("CONSUMER.LIST.{}", a.stream),
            "consumers",
            json!({}),
        )
        .await
        .map_err(stream_error(&a.stream))?;
    infos.sort_by(|x, y| s(x, "name").cmp(s(y, "name")));
    if json_out {
        print_json(&Value::Array(infos));
        return Ok(());
    }
    let msgs = u(&sinfo["state"], "messages");
    let mut t = Table::new(
        format!(
            "Consumer report for {} with {} consumers",
            a.stream,
            n(infos.len() as u64)
        ),
        &[
            "Consumer",
            "Mode",
            "Ack Policy",
            "Ack Wait",
            "Ack Pending",
            "Redelivered",
            "Unprocessed",
            "Ack Floor",
            "API Level",
            "Cluster",
        ],
    );
    for info in &infos {
        let cfg = &info["config"];
        let mode = if s(cfg, "deliver_subject").is_empty() {
            "Pull"
        } else {
            "Push"
        };
        let ack = match s(cfg, "ack_policy") {
            "explicit" => "Explicit",
            "all" => "All",
            _ => "None",
        };
        let f = |x: u64| if a.raw { x.to_string() } else { n(x) };
        let pending = u(info, "num_pending");
        let unprocessed = if a.raw || pending == 0 {
            pending.to_string()
        } else {
            let pct = (pending as f64 / msgs.max(1) as f64 * 100.0)
                .floor()
                .min(100.0);
            format!("{} / {pct:.0}%", n(pending))
        };
        let cluster = &info["cluster"];
        t.add(vec![
            s(info, "name").to_string(),
            mode.to_string(),
            ack.to_string(),
            if a.raw {
                i(cfg, "ack_wait").to_string()
            } else {
                dur_ns(i(cfg, "ack_wait"))
            },
            f(u(info, "num_ack_pending")),
            f(u(info, "num_redelivered")),
            unprocessed,
            f(u(&info["ack_floor"], "stream_seq")),
            cfg["metadata"]["_nats.req.level"]
                .as_str()
                .unwrap_or("0")
                .to_string(),
            match s(cluster, "leader") {
                "" => String::new(),
                l => format!("{l}*"),
            },
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

/// `consumer sub`: a push consumer's deliveries (on its deliver subject, in
/// its deliver group), or a pull consumer's, printed as `next` does and
/// acknowledged unless --no-ack or the consumer does not take acks.
async fn sub(js: &Js, a: &SubArgs) -> Res<()> {
    let info = js.consumer_info(&a.stream, &a.consumer).await?;
    let cfg = &info["config"];
    let ack = !a.no_ack && s(cfg, "ack_policy") != "none";
    let deliver = s(cfg, "deliver_subject").to_string();
    let mut seen = 0u64;
    let done = |seen: u64| a.count > 0 && seen >= a.count;
    if deliver.is_empty() {
        let consumer: jetstream::consumer::Consumer<pull::Config> = js
            .ctx
            .get_consumer_from_stream(&a.consumer, &a.stream)
            .await
            .map_err(|e| format!("cannot load consumer {} > {}: {e}", a.stream, a.consumer))?;
        let mut msgs = consumer
            .messages()
            .await
            .map_err(|e| format!("cannot consume from {} > {}: {e}", a.stream, a.consumer))?;
        eprintln!(
            "Consuming from pull consumer {} > {} (acknowledgment: {ack})",
            a.stream, a.consumer
        );
        while let Some(msg) = msgs.next().await {
            let msg = msg.map_err(|e| format!("receiving from the consumer failed: {e}"))?;
            print_next(&msg, a.raw);
            if ack {
                msg.double_ack()
                    .await
                    .map_err(|e| format!("cannot acknowledge the message: {e}"))?;
            }
            seen += 1;
            if done(seen) {
                return Ok(());
            }
        }
        return Err("connection to the server was closed".into());
    }
    let group = a
        .deliver_group
        .clone()
        .or_else(|| Some(s(cfg, "deliver_group").to_string()).filter(|g| !g.is_empty()));
    let mut subscription = match &group {
        Some(g) => js.client.queue_subscribe(deliver.clone(), g.clone()).await,
        None => js.client.subscribe(deliver.clone()).await,
    }
    .map_err(|e| format!("cannot subscribe to {deliver}: {e}"))?;
    crate::util::round_trip(&js.client, js.timeout).await?;
    eprintln!("Subscribing to topic {deliver} auto acknowledgment: {ack}");
    while let Some(m) = subscription.next().await {
        // Flow control requests and idle heartbeats are status messages.
        if m.status.map(u16::from) == Some(100) {
            if let Some(reply) = &m.reply {
                let _ = js.client.publish(reply.clone(), bytes::Bytes::new()).await;
            }
            continue;
        }
        let msg = jetstream::Message {
            message: m,
            context: js.ctx.clone(),
        };
        print_next(&msg, a.raw);
        if ack {
            msg.ack()
                .await
                .map_err(|e| format!("cannot acknowledge the message: {e}"))?;
        }
        seen += 1;
        if done(seen) {
            crate::util::round_trip(&js.client, js.timeout).await?;
            return Ok(());
        }
    }
    Err("connection to the server was closed".into())
}

fn clock() -> String {
    let t = crate::output::fmt_time_ns(now_ns());
    t[11..].to_string()
}

async fn next(js: &Js, a: &NextArgs) -> Res<()> {
    let info = js.consumer_info(&a.stream, &a.consumer).await?;
    if !s(&info["config"], "deliver_subject").is_empty() {
        return Err(format!(
            "consumer {} > {} is a push consumer; `next` needs a pull consumer (use `keel sub {}`)",
            a.stream,
            a.consumer,
            s(&info["config"], "deliver_subject")
        ));
    }
    if a.count == 0 {
        return Err("--count must be at least 1".into());
    }
    let ack_none = s(&info["config"], "ack_policy") == "none";
    let consumer: jetstream::consumer::Consumer<pull::Config> = js
        .ctx
        .get_consumer_from_stream(&a.consumer, &a.stream)
        .await
        .map_err(|e| format!("cannot load consumer {} > {}: {e}", a.stream, a.consumer))?;
    let mut received = 0usize;
    while received < a.count {
        let mut batch = consumer
            .fetch()
            .max_messages(a.count - received)
            .expires(js.timeout)
            .messages()
            .await
            .map_err(|e| format!("pull request failed: {e}"))?;
        let mut got_any = false;
        while let Some(msg) = batch.next().await {
            let msg = msg.map_err(|e| format!("receiving from the consumer failed: {e}"))?;
            got_any = true;
            received += 1;
            print_next(&msg, a.raw);
            if a.term {
                msg.ack_with(AckKind::Term)
                    .await
                    .map_err(|e| format!("cannot terminate the message: {e}"))?;
                if !a.raw {
                    println!("\nTerminated message");
                }
            } else if a.nak {
                msg.ack_with(AckKind::Nak(None))
                    .await
                    .map_err(|e| format!("cannot nak the message: {e}"))?;
                if !a.raw {
                    println!("\nNegatively acknowledged message");
                }
            } else if !a.no_ack && !ack_none {
                // Wait for the server to confirm, so `consumer info` right
                // after this command already shows the new ack floor.
                msg.double_ack()
                    .await
                    .map_err(|e| format!("cannot acknowledge the message: {e}"))?;
                if !a.raw {
                    println!("\nAcknowledged message");
                }
            }
            if !a.raw {
                println!();
            }
        }
        if !got_any {
            break;
        }
    }
    // Make sure acks and naks left the client before exiting.
    let _ = js.client.flush().await;
    if received < a.count {
        let what = if received == 0 {
            "no message received".to_string()
        } else {
            format!("received {received} of {} messages", a.count)
        };
        return Err(format!(
            "{what}: nothing more was pending on {} > {} within {:?}",
            a.stream, a.consumer, js.timeout
        ));
    }
    Ok(())
}

fn print_next(msg: &jetstream::Message, raw: bool) {
    if raw {
        println!("{}", String::from_utf8_lossy(&msg.payload));
        return;
    }
    match msg.info() {
        Ok(i) => println!(
            "[{}] subj: {} / tries: {} / cons seq: {} / str seq: {} / pending: {}",
            clock(),
            msg.subject,
            i.delivered,
            i.consumer_sequence,
            i.stream_sequence,
            n(i.pending)
        ),
        Err(_) => println!("--- subject: {}", msg.subject),
    }
    if let Some(h) = msg.headers.as_ref().filter(|h| !h.is_empty()) {
        println!("\nHeaders:\n");
        for l in header_lines(h) {
            println!("  {l}");
        }
        println!("\nData:\n");
    }
    println!();
    println!("{}", String::from_utf8_lossy(&msg.payload));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliver_policies() {
        let mut m = Map::new();
        apply_deliver(&mut m, "all").unwrap();
        assert_eq!(m["deliver_policy"], "all");
        apply_deliver(&mut m, "42").unwrap();
        assert_eq!(m["deliver_policy"], "by_start_sequence");
        assert_eq!(m["opt_start_seq"], 42);
        apply_deliver(&mut m, "1h").unwrap();
        assert_eq!(m["deliver_policy"], "by_start_time");
        assert!(apply_deliver(&mut m, "sometimes").is_err());
    }
}
