//! The everyday commands: `pub`, `sub`, `req` and `reply`.

use std::io::{self, Write};
use std::time::Instant;

use async_nats::{client::RequestErrorKind, HeaderMap, Message, Request};
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;

use crate::util::{header_lines, parse_headers, render_template, round_trip, ConnSettings, Res};

/// The queue group `nats reply` uses, so keel and nats repliers share load.
const DEFAULT_REPLY_QUEUE: &str = "NATS-RPLY-22";

#[derive(Args, Debug)]
pub struct PubArgs {
    /// Subject to publish to ({{Count}} is replaced as in BODY)
    pub subject: String,
    /// Message body; {{Count}} becomes the 1-based message number
    pub body: Option<String>,
    /// Number of messages to publish
    #[arg(long, default_value_t = 1)]
    pub count: u64,
    /// Header as key:value (repeatable)
    #[arg(short = 'H', long = "header", value_name = "KEY:VALUE")]
    pub headers: Vec<String>,
    /// Reply subject to set on the messages
    #[arg(long, value_name = "SUBJECT")]
    pub reply: Option<String>,
    /// Publish to JetStream: wait for the stream's ack and print it
    #[arg(short = 'J', long, conflicts_with = "reply")]
    pub jetstream: bool,
    /// With --count: pause this long between messages, e.g. 100ms
    #[arg(long, value_name = "DURATION", value_parser = crate::util::parse_duration)]
    pub sleep: Option<std::time::Duration>,
}

#[derive(Args, Debug)]
pub struct SubArgs {
    /// Subjects to subscribe to (wildcards * and > allowed)
    #[arg(required = true, num_args = 1..)]
    pub subjects: Vec<String>,
    /// Join this queue group (messages are shared among its members)
    #[arg(long, value_name = "GROUP")]
    pub queue: Option<String>,
    /// Exit after receiving this many messages (0 = run until interrupted)
    #[arg(long, default_value_t = 0)]
    pub count: u64,
    /// Print only message bodies, one per line
    #[arg(short, long)]
    pub raw: bool,
    /// Acknowledge JetStream messages (those with a $JS.ACK reply subject)
    #[arg(long)]
    pub ack: bool,
    /// Print only the headers, not the bodies
    #[arg(long)]
    pub headers_only: bool,
    /// Write each message as JSON to DIR/<seq>.json (`-`: NUL-separated to stdout)
    #[arg(long, value_name = "DIRECTORY")]
    pub dump: Option<String>,
    /// JetStream: read the subjects from this stream (found by subject if not given)
    #[arg(long, value_name = "STREAM")]
    pub stream: Option<String>,
    /// JetStream: deliver every stored message, then new ones
    #[arg(long)]
    pub all: bool,
    /// JetStream: deliver only messages published from now on
    #[arg(long)]
    pub new: bool,
    /// JetStream: deliver the most recent message and all later ones
    #[arg(long)]
    pub last: bool,
    /// JetStream: deliver messages received since this long ago, e.g. 1h
    #[arg(long, value_name = "DURATION")]
    pub since: Option<String>,
    /// JetStream: start at this stream sequence
    #[arg(long, value_name = "SEQUENCE")]
    pub start_sequence: Option<u64>,
    /// JetStream: deliver the latest message of every subject, then new ones
    #[arg(long)]
    pub last_per_subject: bool,
    /// JetStream: stop once every stored message was received
    #[arg(short = 'T', long)]
    pub terminate_at_end: bool,
}

#[derive(Args, Debug)]
pub struct ReqArgs {
    /// Subject to send the request to
    pub subject: String,
    /// Request body ({{Count}} becomes 1)
    pub body: Option<String>,
    /// Header as key:value (repeatable)
    #[arg(short = 'H', long = "header", value_name = "KEY:VALUE")]
    pub headers: Vec<String>,
    /// Print only the reply body
    #[arg(short, long)]
    pub raw: bool,
    /// Wait for this many replies (0 = as many as arrive before the timeout)
    #[arg(long, default_value_t = 1)]
    pub replies: u64,
    /// With --replies: the longest wait between two replies
    #[arg(long, default_value = "300ms", value_parser = crate::util::parse_duration)]
    pub reply_timeout: std::time::Duration,
}

#[derive(Args, Debug)]
pub struct ReplyArgs {
    /// Subject to answer requests on
    pub subject: String,
    /// Reply body; {{Count}} becomes the request number, {{Request}} the request body
    pub body: Option<String>,
    /// Reply with the request's own body and headers (the default without BODY or --command)
    #[arg(long)]
    pub echo: bool,
    /// Run this command per request and reply with its output ({{0}}, {{1}}... are the subject's tokens)
    #[arg(long, conflicts_with = "echo")]
    pub command: Option<String>,
    /// Queue group to join
    #[arg(short, long, value_name = "GROUP", default_value = DEFAULT_REPLY_QUEUE)]
    pub queue: String,
    /// Sleep a random time up to this before each reply
    #[arg(long, value_name = "MAX", value_parser = crate::util::parse_duration)]
    pub sleep: Option<std::time::Duration>,
    /// Header to add to replies as key:value (repeatable)
    #[arg(short = 'H', long = "header", value_name = "KEY:VALUE")]
    pub headers: Vec<String>,
    /// Exit after answering this many requests (0 = run until interrupted)
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}

pub async fn publish(conn: &ConnSettings, args: &PubArgs, json: bool) -> Res<()> {
    let client = conn.connect().await?;
    if args.jetstream {
        return publish_jetstream(conn, &client, args, json).await;
    }
    let headers = parse_headers(&args.headers)?;
    let body = args.body.as_deref().unwrap_or("");
    let mut bytes_sent = 0usize;
    for n in 1..=args.count {
        pause(args, n).await;
        let subject = render_template(&args.subject, n);
        let payload = Bytes::from(render_template(body, n));
        bytes_sent += payload.len();
        let result = match (&args.reply, &headers) {
            (None, None) => client.publish(subject.clone(), payload).await,
            (None, Some(h)) => {
                client
                    .publish_with_headers(subject.clone(), h.clone(), payload)
                    .await
            }
            (Some(r), None) => {
                client
                    .publish_with_reply(subject.clone(), r.clone(), payload)
                    .await
            }
            (Some(r), Some(h)) => {
                client
                    .publish_with_reply_and_headers(subject.clone(), r.clone(), h.clone(), payload)
                    .await
            }
        };
        result.map_err(|e| format!("cannot publish to {subject:?}: {e}"))?;
    }
    // Only report success once the server has actually taken the messages.
    round_trip(&client, conn.timeout).await?;
    if args.count == 1 {
        eprintln!("Published {bytes_sent} bytes to {:?}", args.subject);
    } else {
        eprintln!(
            "Published {} messages ({bytes_sent} bytes) to {:?}",
            args.count, args.subject
        );
    }
    Ok(())
}

/// `--sleep` between messages (not before the first).
async fn pause(args: &PubArgs, n: u64) {
    if let Some(d) = args.sleep.filter(|_| n > 1) {
        tokio::time::sleep(d).await;
    }
}

/// `pub --jetstream`: each message is a request to the stream, and the reply
/// is its ack (`{"stream":"ORDERS","seq":1}`) or an error. A raw request is
/// used rather than the typed context so `--json` prints the ack verbatim.
async fn publish_jetstream(
    conn: &ConnSettings,
    client: &async_nats::Client,
    args: &PubArgs,
    json: bool,
) -> Res<()> {
    let headers = parse_headers(&args.headers)?;
    let body = args.body.as_deref().unwrap_or("");
    for n in 1..=args.count {
        pause(args, n).await;
        let subject = render_template(&args.subject, n);
        let payload = Bytes::from(render_template(body, n));
        let len = payload.len();
        let mut req = Request::new().payload(payload).timeout(Some(conn.timeout));
        if let Some(h) = &headers {
            req = req.headers(h.clone());
        }
        let reply = client
            .send_request(subject.clone(), req)
            .await
            .map_err(|e| match e.kind() {
                RequestErrorKind::NoResponders => format!(
                    "no stream stores subject {subject:?} (create one with `keel stream add NAME --subjects '{subject}'`; is JetStream enabled with -js?)"
                ),
                RequestErrorKind::TimedOut => format!(
                    "no ack for the message on {subject:?} within {:?} (raise --timeout?)",
                    conn.timeout
                ),
                _ => format!("cannot publish to {subject:?}: {e}"),
            })?;
        let ack: serde_json::Value = serde_json::from_slice(&reply.payload).map_err(|_| {
            format!(
                "the reply on {subject:?} is not a JetStream ack: {}",
                String::from_utf8_lossy(&reply.payload)
            )
        })?;
        if let Some(err) = ack.get("error") {
            return Err(format!(
                "the stream refused the message on {subject:?}: {}",
                err.get("description")
                    .and_then(|d| d.as_str())
                    .unwrap_or("unknown error")
            ));
        }
        if json {
            println!("{ack}");
            continue;
        }
        eprintln!("Published {len} bytes to {subject:?}");
        let mut line = format!(
            "Stored in Stream: {} Sequence: {}",
            ack.get("stream").and_then(|v| v.as_str()).unwrap_or("?"),
            crate::util::group(ack.get("seq").and_then(|v| v.as_u64()).unwrap_or(0))
        );
        if let Some(d) = ack.get("domain").and_then(|v| v.as_str()) {
            line += &format!(" Domain: {d:?}");
        }
        if ack.get("duplicate").and_then(|v| v.as_bool()) == Some(true) {
            line += " Duplicate: true";
        }
        println!("{line}");
    }
    Ok(())
}

pub async fn subscribe(conn: &ConnSettings, args: &SubArgs) -> Res<()> {
    let jetstream = args.stream.is_some()
        || args.all
        || args.new
        || args.last
        || args.since.is_some()
        || args.start_sequence.is_some()
        || args.last_per_subject;
    if args.terminate_at_end && !jetstream {
        return Err(
            "--terminate-at-end needs a JetStream subscription (--stream, --all, --since, ...)"
                .into(),
        );
    }
    if let Some(dir) = args.dump.as_deref().filter(|d| *d != "-") {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create --dump directory {dir}: {e}"))?;
    }
    let client = conn.connect().await?;
    if jetstream {
        if args.queue.is_some() {
            return Err("queue group subscriptions are not supported with JetStream".into());
        }
        return subscribe_jetstream(conn, client, args).await;
    }
    let mut subs = Vec::new();
    for subject in &args.subjects {
        let sub = match &args.queue {
            Some(q) => client.queue_subscribe(subject.clone(), q.clone()).await,
            None => client.subscribe(subject.clone()).await,
        }
        .map_err(|e| format!("cannot subscribe to {subject:?}: {e}"))?;
        subs.push(sub);
    }
    // Announce readiness only once the server knows about the subscription, so
    // scripts that wait for this line cannot lose the first messages.
    round_trip(&client, conn.timeout).await?;
    let what = args
        .subjects
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    match &args.queue {
        Some(q) => eprintln!("Subscribing on {what} in queue group {q:?}"),
        None => eprintln!("Subscribing on {what}"),
    }
    let mut all = futures::stream::select_all(subs);
    let mut n = 0u64;
    while let Some(msg) = all.next().await {
        n += 1;
        let js_reply = msg
            .reply
            .as_ref()
            .filter(|r| crate::js::parse_ack_subject(r).is_some());
        if let (true, Some(reply)) = (args.ack, js_reply) {
            client
                .publish(reply.clone(), Bytes::from_static(b"+ACK"))
                .await
                .map_err(|e| format!("cannot acknowledge: {e}"))?;
        }
        if !show_message(args, n, &msg)? || (args.count > 0 && n >= args.count) {
            if args.ack {
                round_trip(&client, conn.timeout).await?;
            }
            return Ok(());
        }
    }
    Err("connection to the server was closed".into())
}

/// Prints (or dumps) one received message; false when stdout went away.
fn show_message(args: &SubArgs, n: u64, msg: &Message) -> Res<bool> {
    if let Some(dump) = &args.dump {
        let json = dump_json(msg);
        if dump == "-" {
            return emit(&format!("{json}\0"));
        }
        let name = match msg
            .reply
            .as_ref()
            .and_then(|r| crate::js::parse_ack_subject(r))
        {
            Some(meta) => meta.stream_seq,
            None => n,
        };
        let path = std::path::Path::new(dump).join(format!("{name}.json"));
        std::fs::write(&path, json.to_string())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        return Ok(true);
    }
    let text = if args.raw {
        if args.headers_only {
            let mut t = String::new();
            for l in msg.headers.as_ref().map(header_lines).unwrap_or_default() {
                t.push_str(&l);
                t.push('\n');
            }
            t
        } else {
            format!("{}\n", String::from_utf8_lossy(&msg.payload))
        }
    } else {
        format_message(n, msg, args.headers_only)
    };
    emit(&text)
}

/// A message as the Go client's `nats.Msg` marshals to JSON (`nats sub --dump`).
fn dump_json(msg: &Message) -> serde_json::Value {
    let mut headers = serde_json::Map::new();
    if let Some(h) = &msg.headers {
        for (name, values) in h.iter() {
            let vals: Vec<String> = values.iter().map(|v| v.to_string()).collect();
            headers.insert(name.to_string(), serde_json::json!(vals));
        }
    }
    serde_json::json!({
        "Subject": msg.subject.as_str(),
        "Reply": msg.reply.as_ref().map(|r| r.as_str()).unwrap_or(""),
        "Header": if headers.is_empty() { serde_json::Value::Null } else { serde_json::Value::Object(headers) },
        "Data": crate::output::base64_encode(&msg.payload),
        "Sub": serde_json::Value::Null,
    })
}

/// `sub --stream/--all/--new/--last/--since/...`: an unacknowledged
/// consumer on the stream (as `nats sub` makes), printed like `nats sub`.
async fn subscribe_jetstream(
    conn: &ConnSettings,
    client: async_nats::Client,
    args: &SubArgs,
) -> Res<()> {
    let js = crate::js::Js::from_client(client, conn);
    let stream = match &args.stream {
        Some(s) => {
            js.stream_info(s).await?;
            s.clone()
        }
        None => {
            let names = js
                .paged(
                    "STREAM.NAMES",
                    "streams",
                    serde_json::json!({ "subject": args.subjects[0] }),
                )
                .await
                .map_err(String::from)?;
            match names.as_slice() {
                [one] => one.as_str().unwrap_or_default().to_string(),
                [] => {
                    return Err(format!(
                        "no stream stores {:?} (give one with --stream)",
                        args.subjects[0]
                    ))
                }
                _ => {
                    return Err(format!(
                        "several streams store {:?}; choose one with --stream",
                        args.subjects[0]
                    ))
                }
            }
        }
    };
    let mut cfg = serde_json::Map::new();
    let (policy, what) = if let Some(seq) = args.start_sequence {
        cfg.insert("opt_start_seq".into(), serde_json::json!(seq));
        ("by_start_sequence", format!("starting at sequence {seq}"))
    } else if args.last {
        ("last", "from last received message".to_string())
    } else if args.all {
        ("all", "from first received message".to_string())
    } else if args.new {
        ("new", "for new messages".to_string())
    } else if let Some(d) = &args.since {
        let d = crate::util::parse_duration(d).map_err(|e| format!("--since: {e}"))?;
        let start = crate::output::now_ns() - d.as_nanos() as i128;
        cfg.insert(
            "opt_start_time".into(),
            serde_json::json!(crate::output::rfc3339_ns(start)),
        );
        ("by_start_time", format!("since {}", crate::output::dur(d)))
    } else if args.last_per_subject {
        (
            "last_per_subject",
            "for last message per subject".to_string(),
        )
    } else {
        ("all", "from first received message".to_string())
    };
    cfg.insert("deliver_policy".into(), serde_json::json!(policy));
    match args.subjects.as_slice() {
        [one] => {
            cfg.insert("filter_subject".into(), serde_json::json!(one));
        }
        many => {
            cfg.insert("filter_subjects".into(), serde_json::json!(many));
        }
    }
    if args.headers_only {
        cfg.insert("headers_only".into(), serde_json::json!(true));
    }
    let (consumer, name, pending) = crate::stream_ops::reader(&js, &stream, cfg).await?;
    eprintln!(
        "Subscribing to JetStream Stream holding messages with subject {} {what}",
        args.subjects.join(", ")
    );
    if args.terminate_at_end && pending == 0 {
        crate::stream_ops::drop_reader(&js, &stream, &name).await;
        return Ok(());
    }
    let result = async {
        let mut msgs = consumer
            .messages()
            .await
            .map_err(|e| format!("cannot consume stream {stream}: {e}"))?;
        let mut n = 0u64;
        while let Some(msg) = msgs.next().await {
            let msg = msg.map_err(|e| format!("receiving from stream {stream} failed: {e}"))?;
            n += 1;
            let pending = msg.info().map(|i| i.pending).unwrap_or(1);
            if !show_message(args, n, &msg.message)? || (args.count > 0 && n >= args.count) {
                return Ok(());
            }
            if args.terminate_at_end && pending == 0 {
                return Ok(());
            }
        }
        Err("connection to the server was closed".to_string())
    }
    .await;
    crate::stream_ops::drop_reader(&js, &stream, &name).await;
    result
}

pub async fn request(conn: &ConnSettings, args: &ReqArgs) -> Res<()> {
    let client = conn.connect().await?;
    let headers = parse_headers(&args.headers)?;
    let body = render_template(args.body.as_deref().unwrap_or(""), 1);
    if args.replies != 1 {
        return request_many(conn, &client, args, headers, body).await;
    }
    let mut req = Request::new()
        .payload(Bytes::from(body))
        .timeout(Some(conn.timeout));
    if let Some(h) = headers {
        req = req.headers(h);
    }
    if !args.raw {
        eprintln!("Sending request on {:?}", args.subject);
    }
    let start = Instant::now();
    let reply = client
        .send_request(args.subject.clone(), req)
        .await
        .map_err(|e| match e.kind() {
            RequestErrorKind::NoResponders => format!(
                "no responders on {:?}: nothing is subscribed there (try `keel reply {} ...`)",
                args.subject, args.subject
            ),
            RequestErrorKind::TimedOut => format!(
                "no reply on {:?} within {:?} (raise --timeout?)",
                args.subject, conn.timeout
            ),
            _ => format!("request on {:?} failed: {e}", args.subject),
        })?;
    let rtt = start.elapsed();
    let text = if args.raw {
        format!("{}\n", String::from_utf8_lossy(&reply.payload))
    } else {
        format!(
            "Received with rtt {rtt:.3?}\n{}",
            format_body(reply.headers.as_ref(), &reply.payload)
        )
    };
    emit(&text).map(|_| ())
}

/// `req --replies N`: one request, replies collected on an inbox until N
/// arrived, no reply came for --reply-timeout after the last one, or --timeout.
async fn request_many(
    conn: &ConnSettings,
    client: &async_nats::Client,
    args: &ReqArgs,
    headers: Option<HeaderMap>,
    body: String,
) -> Res<()> {
    let inbox = client.new_inbox();
    let mut sub = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| format!("cannot subscribe to the reply inbox: {e}"))?;
    round_trip(client, conn.timeout).await?;
    if !args.raw {
        eprintln!(
            "Sending request on {:?}, waiting for {} replies",
            args.subject,
            if args.replies == 0 {
                "any number of".to_string()
            } else {
                args.replies.to_string()
            }
        );
    }
    let start = Instant::now();
    match headers {
        Some(h) => {
            client
                .publish_with_reply_and_headers(args.subject.clone(), inbox, h, Bytes::from(body))
                .await
        }
        None => {
            client
                .publish_with_reply(args.subject.clone(), inbox, Bytes::from(body))
                .await
        }
    }
    .map_err(|e| format!("request on {:?} failed: {e}", args.subject))?;
    let deadline = start + conn.timeout;
    let mut got = 0u64;
    loop {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let wait = if got == 0 {
            deadline - now
        } else {
            args.reply_timeout.min(deadline - now)
        };
        let msg = match tokio::time::timeout(wait, sub.next()).await {
            Ok(Some(m)) => m,
            Ok(None) => return Err("connection to the server was closed".into()),
            Err(_) => break,
        };
        if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(format!(
                "no responders on {:?}: nothing is subscribed there (try `keel reply {} ...`)",
                args.subject, args.subject
            ));
        }
        got += 1;
        let text = if args.raw {
            format!("{}\n", String::from_utf8_lossy(&msg.payload))
        } else {
            format!(
                "Received reply {got} with rtt {:.3?}\n{}\n",
                start.elapsed(),
                format_body(msg.headers.as_ref(), &msg.payload)
            )
        };
        if !emit(&text)? || (args.replies > 0 && got >= args.replies) {
            return Ok(());
        }
    }
    if got == 0 {
        return Err(format!(
            "no reply on {:?} within {:?} (raise --timeout?)",
            args.subject, conn.timeout
        ));
    }
    if args.replies > 0 && got < args.replies {
        return Err(format!("received {got} of {} replies", args.replies));
    }
    Ok(())
}

/// Splits a command line as a POSIX shell would split words (quotes and
/// backslashes), without running a shell.
fn shell_words(line: &str) -> Res<Vec<String>> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => return Err("unterminated ' in --command".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => cur.push(c),
                            Some(c) => {
                                cur.push('\\');
                                cur.push(c);
                            }
                            None => return Err("unterminated \" in --command".into()),
                        },
                        Some(c) => cur.push(c),
                        None => return Err("unterminated \" in --command".into()),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(c) = chars.next() {
                    cur.push(c);
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// `{{Count}}` and `{{Request}}` (also `{{.Request}}`) in reply bodies and commands.
fn render_reply(template: &str, n: u64, request: &[u8]) -> String {
    let req = String::from_utf8_lossy(request);
    let mut out = render_template(template, n);
    for t in [
        "{{Request}}",
        "{{.Request}}",
        "{{ Request }}",
        "{{ .Request }}",
    ] {
        out = out.replace(t, &req);
    }
    out
}

async fn run_command(template: &str, msg: &Message, n: u64) -> Vec<u8> {
    let mut line = template.to_string();
    for (i, token) in msg.subject.split('.').enumerate() {
        line = line.replace(&format!("{{{{{i}}}}}"), token);
    }
    let line = render_reply(&line, n, &msg.payload);
    let words = match shell_words(&line) {
        Ok(w) if !w.is_empty() => w,
        Ok(_) => {
            eprintln!("--command is empty");
            return Vec::new();
        }
        Err(e) => {
            eprintln!("could not parse command {line:?}: {e}");
            return Vec::new();
        }
    };
    let out = tokio::process::Command::new(&words[0])
        .args(&words[1..])
        .env("NATS_REQUEST_SUBJECT", msg.subject.as_str())
        .env(
            "NATS_REQUEST_BODY",
            String::from_utf8_lossy(&msg.payload).as_ref(),
        )
        .stdin(std::process::Stdio::null())
        .output()
        .await;
    match out {
        Ok(o) => {
            if !o.status.success() {
                eprintln!("Command {line:?} failed: {}", o.status);
            }
            // As `nats reply`: stdout and stderr together.
            let mut data = o.stdout;
            data.extend_from_slice(&o.stderr);
            data
        }
        Err(e) => {
            eprintln!("Command {line:?} failed to run: {e}");
            Vec::new()
        }
    }
}

pub async fn reply(conn: &ConnSettings, args: &ReplyArgs) -> Res<()> {
    let client = conn.connect().await?;
    let extra = parse_headers(&args.headers)?;
    let echo = args.echo || (args.body.is_none() && args.command.is_none());
    let mut sub = client
        .queue_subscribe(args.subject.clone(), args.queue.clone())
        .await
        .map_err(|e| format!("cannot subscribe to {:?}: {e}", args.subject))?;
    round_trip(&client, conn.timeout).await?;
    if echo && !args.echo {
        eprintln!("No body or command supplied, enabling echo mode");
    }
    eprintln!("Listening on {:?} in group {:?}", args.subject, args.queue);

    let body = args.body.as_deref().unwrap_or("");
    let mut n = 0u64;
    while let Some(msg) = sub.next().await {
        n += 1;
        // A closed stdout must not stop the replier from answering.
        let _ = emit(&format_message(n, &msg, false));
        let Some(reply_to) = msg.reply.clone() else {
            eprintln!("request #{n} has no reply subject; not answering");
            continue;
        };
        if let Some(max) = args.sleep.filter(|d| !d.is_zero()) {
            // A cheap spread of delays; no need for a random number crate.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() as u128)
                .unwrap_or(0);
            tokio::time::sleep(std::time::Duration::from_nanos(
                (nanos * 7919 % max.as_nanos().max(1)) as u64,
            ))
            .await;
        }
        let mut headers = extra.clone().unwrap_or_default();
        let payload = if echo {
            if let Some(h) = &msg.headers {
                for (name, values) in h.iter() {
                    for v in values {
                        headers.append(name.clone(), v.clone());
                    }
                }
            }
            headers.insert("NATS-Reply-Counter", (n - 1).to_string().as_str());
            msg.payload.clone()
        } else if let Some(cmd) = &args.command {
            Bytes::from(run_command(cmd, &msg, n).await)
        } else {
            Bytes::from(render_reply(body, n, &msg.payload))
        };
        let sent = if headers.is_empty() {
            client.publish(reply_to.clone(), payload).await
        } else {
            client
                .publish_with_headers(reply_to.clone(), headers, payload)
                .await
        };
        sent.map_err(|e| format!("cannot send reply to {reply_to:?}: {e}"))?;
        if args.count > 0 && n >= args.count {
            // Make sure the last reply left before the process exits.
            round_trip(&client, conn.timeout).await?;
            return Ok(());
        }
    }
    Err("connection to the server was closed".into())
}

/// Formats a message the way `nats sub` does: a title line, headers, body.
/// JetStream deliveries (reply subject `$JS.ACK...`) get their metadata
/// decoded in the title.
fn format_message(n: u64, msg: &Message, headers_only: bool) -> String {
    if let Some(meta) = msg
        .reply
        .as_ref()
        .and_then(|r| crate::js::parse_ack_subject(r))
    {
        let title = format!(
            "[#{n}] Received JetStream message: stream: {} seq: {} / consumer: {} seq: {} / delivered: {} / pending: {} / subject: {} / time: {} UTC",
            meta.stream,
            meta.stream_seq,
            meta.consumer,
            meta.consumer_seq,
            meta.delivered,
            meta.pending,
            msg.subject.as_str(),
            crate::output::fmt_time_ns(meta.timestamp_ns)
        );
        return format!("{title}\n{}\n", body_or_headers(msg, headers_only));
    }
    let title = match &msg.reply {
        Some(r) => format!(
            "[#{n}] Received on {:?} with reply {:?}",
            msg.subject.as_str(),
            r.as_str()
        ),
        None => format!("[#{n}] Received on {:?}", msg.subject.as_str()),
    };
    format!("{title}\n{}\n", body_or_headers(msg, headers_only))
}

fn body_or_headers(msg: &Message, headers_only: bool) -> String {
    if !headers_only {
        return format_body(msg.headers.as_ref(), &msg.payload);
    }
    let mut out = String::new();
    for line in msg.headers.as_ref().map(header_lines).unwrap_or_default() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

fn format_body(headers: Option<&HeaderMap>, payload: &[u8]) -> String {
    let mut out = String::new();
    if let Some(h) = headers.filter(|h| !h.is_empty()) {
        for line in header_lines(h) {
            out.push_str(&line);
            out.push('\n');
        }
        out.push('\n');
    }
    out.push_str(&String::from_utf8_lossy(payload));
    out.push('\n');
    out
}

/// Writes to stdout and flushes, so piped output appears per message.
/// Returns false when the reader has gone away (`keel sub ... | head`), which
/// is a normal way to stop, not an error.
fn emit(text: &str) -> Res<bool> {
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(format!("cannot write to stdout: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_words() {
        assert_eq!(
            shell_words("echo a 'b c' \"d \\\" e\" f\\ g").unwrap(),
            vec!["echo", "a", "b c", "d \" e", "f g"]
        );
        assert_eq!(shell_words("  ").unwrap(), Vec::<String>::new());
        assert!(shell_words("echo 'open").is_err());
        assert_eq!(render_reply("{{Count}}:{{Request}}", 2, b"hi"), "2:hi");
    }
}
