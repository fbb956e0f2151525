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
}

#[derive(Args, Debug)]
pub struct SubArgs {
    /// Subject to subscribe to (wildcards * and > allowed)
    pub subject: String,
    /// Join this queue group (messages are shared among its members)
    #[arg(long, value_name = "GROUP")]
    pub queue: Option<String>,
    /// Exit after receiving this many messages (0 = run until interrupted)
    #[arg(long, default_value_t = 0)]
    pub count: u64,
    /// Print only message bodies, one per line
    #[arg(long)]
    pub raw: bool,
    /// Acknowledge JetStream messages (those with a $JS.ACK reply subject)
    #[arg(long)]
    pub ack: bool,
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
    #[arg(long)]
    pub raw: bool,
}

#[derive(Args, Debug)]
pub struct ReplyArgs {
    /// Subject to answer requests on
    pub subject: String,
    /// Reply body; {{Count}} becomes the 1-based request number
    pub body: Option<String>,
    /// Queue group to join
    #[arg(long, value_name = "GROUP", default_value = DEFAULT_REPLY_QUEUE)]
    pub queue: String,
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
    let client = conn.connect().await?;
    let mut sub = match &args.queue {
        Some(q) => {
            client
                .queue_subscribe(args.subject.clone(), q.clone())
                .await
        }
        None => client.subscribe(args.subject.clone()).await,
    }
    .map_err(|e| format!("cannot subscribe to {:?}: {e}", args.subject))?;
    // Announce readiness only once the server knows about the subscription, so
    // scripts that wait for this line cannot lose the first messages.
    round_trip(&client, conn.timeout).await?;
    match &args.queue {
        Some(q) => eprintln!("Subscribing on {:?} in queue group {q:?}", args.subject),
        None => eprintln!("Subscribing on {:?}", args.subject),
    }

    let mut n = 0u64;
    while let Some(msg) = sub.next().await {
        n += 1;
        let text = if args.raw {
            format!("{}\n", String::from_utf8_lossy(&msg.payload))
        } else {
            format_message(n, &msg)
        };
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
        if !emit(&text)? || (args.count > 0 && n >= args.count) {
            if args.ack {
                round_trip(&client, conn.timeout).await?;
            }
            return Ok(());
        }
    }
    Err("connection to the server was closed".into())
}

pub async fn request(conn: &ConnSettings, args: &ReqArgs) -> Res<()> {
    let client = conn.connect().await?;
    let headers = parse_headers(&args.headers)?;
    let body = render_template(args.body.as_deref().unwrap_or(""), 1);
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

pub async fn reply(conn: &ConnSettings, args: &ReplyArgs) -> Res<()> {
    let client = conn.connect().await?;
    let mut sub = client
        .queue_subscribe(args.subject.clone(), args.queue.clone())
        .await
        .map_err(|e| format!("cannot subscribe to {:?}: {e}", args.subject))?;
    round_trip(&client, conn.timeout).await?;
    eprintln!("Listening on {:?} in group {:?}", args.subject, args.queue);

    let body = args.body.as_deref().unwrap_or("");
    let mut n = 0u64;
    while let Some(msg) = sub.next().await {
        n += 1;
        // A closed stdout must not stop the replier from answering.
        let _ = emit(&format_message(n, &msg));
        match &msg.reply {
            Some(reply_to) => {
                let payload = Bytes::from(render_template(body, n));
                client
                    .publish(reply_to.clone(), payload)
                    .await
                    .map_err(|e| format!("cannot send reply to {reply_to:?}: {e}"))?;
            }
            None => eprintln!("request #{n} has no reply subject; not answering"),
        }
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
fn format_message(n: u64, msg: &Message) -> String {
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
        return format!(
            "{title}\n{}\n",
            format_body(msg.headers.as_ref(), &msg.payload)
        );
    }
    let title = match &msg.reply {
        Some(r) => format!(
            "[#{n}] Received on {:?} with reply {:?}",
            msg.subject.as_str(),
            r.as_str()
        ),
        None => format!("[#{n}] Received on {:?}", msg.subject.as_str()),
    };
    format!(
        "{title}\n{}\n",
        format_body(msg.headers.as_ref(), &msg.payload)
    )
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
