//! `keel events`: shows the JetStream advisories and metrics the server publishes under
//! `$JS.EVENT.>` (stream and consumer actions, API audits, naks, terminations, exhausted
//! deliveries, sampled acks), in the shape of `nats events`: a `[time] [id] Title` line and
//! indented details per event, one line each with `--short`, the event JSON with `--json`.

use std::io::Write;

use clap::Args;
use futures::StreamExt;
use serde_json::Value;

use crate::output::{dur_ns, s, u};
use crate::util::{round_trip, ConnSettings, Res};

#[derive(Args, Debug)]
pub struct EventsArgs {
    /// Show JetStream advisories (stream, consumer and delivery events, API audits)
    #[arg(long)]
    pub js_advisory: bool,
    /// Show JetStream metrics (sampled consumer acks)
    #[arg(long)]
    pub js_metric: bool,
    /// Show only the JetStream API audit advisories
    #[arg(long)]
    pub js_api: bool,
    /// One line per event
    #[arg(long)]
    pub short: bool,
    /// Exit after this many events (0 = run until interrupted)
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}

impl EventsArgs {
    /// The subjects to listen on; with no selection, every JetStream event.
    fn subjects(&self) -> Vec<&'static str> {
        let mut v = vec![];
        if self.js_advisory {
            v.push("$JS.EVENT.ADVISORY.>");
        } else if self.js_api {
            v.push("$JS.EVENT.ADVISORY.API");
        }
        if self.js_metric {
            v.push("$JS.EVENT.METRIC.>");
        }
        if v.is_empty() {
            v.push("$JS.EVENT.>");
        }
        v
    }
}

pub async fn run(conn: &ConnSettings, args: &EventsArgs, json: bool) -> Res<()> {
    let client = conn.connect().await?;
    let subjects = args.subjects();
    let mut subs = Vec::new();
    for subject in &subjects {
        let sub = client
            .subscribe(subject.to_string())
            .await
            .map_err(|e| format!("cannot subscribe to {subject:?}: {e}"))?;
        subs.push(sub);
    }
    // Announce only once the server has the subscriptions, so nothing is missed after it.
    round_trip(&client, conn.timeout).await?;
    eprintln!("Listening for Advisories on {}", subjects.join(", "));
    let mut all = futures::stream::select_all(subs);
    let mut n = 0;
    while let Some(msg) = all.next().await {
        let text = match serde_json::from_slice::<Value>(&msg.payload) {
            Ok(v) if json => format!("{v}\n"),
            Ok(v) if args.short => format!("{}\n", short(&msg.subject, &v)),
            Ok(v) => long(&msg.subject, &v),
            Err(_) => format!(
                "{}: {}\n",
                msg.subject,
                String::from_utf8_lossy(&msg.payload)
            ),
        };
        let mut out = std::io::stdout().lock();
        if out
            .write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return Ok(()); // stdout closed (e.g. `| head`)
        }
        n += 1;
        if args.count > 0 && n >= args.count {
            return Ok(());
        }
    }
    Err("connection to the server was closed".into())
}

/// `HH:MM:SS` of an event's RFC 3339 timestamp.
fn clock(v: &Value) -> &str {
    s(v, "timestamp").get(11..19).unwrap_or("")
}

/// The title and the detail rows of one event, by its `type`.
fn describe(subject: &str, v: &Value) -> (String, Vec<(&'static str, String)>) {
    let kind = s(v, "type");
    let kind = kind.rsplit('.').next().unwrap_or(kind);
    let consumer = || format!("{} > {}", s(v, "stream"), s(v, "consumer"));
    let action = |a: &str| match a {
        "create" => "Created",
        "delete" => "Deleted",
        "modify" => "Modified",
        _ => "Changed",
    };
    match kind {
        "api_audit" => {
            let c = &v["client"];
            let mut client = format!("{} @ {}", s(c, "name"), s(c, "acc"));
            if !s(c, "host").is_empty() {
                client += &format!(" ({})", s(c, "host"));
            }
            if !s(c, "lang").is_empty() {
                client += &format!(" {} {}", s(c, "lang"), s(c, "ver"));
            }
            let response: Value = serde_json::from_str(s(v, "response")).unwrap_or(Value::Null);
            let outcome = match response.get("error") {
                Some(e) => format!(
                    "error {} ({}): {}",
                    u(e, "code"),
                    u(e, "err_code"),
                    s(e, "description")
                ),
                None => "ok".into(),
            };
            let mut rows = vec![
                ("Server", s(v, "server").to_string()),
                ("Client", client),
                ("Subject", s(v, "subject").to_string()),
            ];
            if !s(v, "request").is_empty() {
                rows.push(("Request", s(v, "request").to_string()));
            }
            rows.push(("Response", outcome));
            ("JetStream API Access".into(), rows)
        }
        "stream_action" => (
            format!("Stream {}", action(s(v, "action"))),
            vec![("Stream", s(v, "stream").to_string())],
        ),
        "consumer_action" => (
            format!("Consumer {}", action(s(v, "action"))),
            vec![("Consumer", consumer())],
        ),
        "max_deliver" => (
            "Consumer Delivery Exceeded".into(),
            vec![
                ("Consumer", consumer()),
                ("Stream Sequence", u(v, "stream_seq").to_string()),
                ("Deliveries", u(v, "deliveries").to_string()),
            ],
        ),
        "nak" | "terminated" => {
            let mut rows = vec![
                ("Consumer", consumer()),
                ("Stream Sequence", u(v, "stream_seq").to_string()),
                ("Consumer Sequence", u(v, "consumer_seq").to_string()),
                ("Deliveries", u(v, "deliveries").to_string()),
            ];
            if !s(v, "reason").is_empty() {
                rows.push(("Reason", s(v, "reason").to_string()));
            }
            let title = if kind == "nak" {
                "Consumer Message NAKed"
            } else {
                "Consumer Message Terminated"
            };
            (title.into(), rows)
        }
        "consumer_ack" => (
            "Consumer Acknowledgement Sample".into(),
            vec![
                ("Consumer", consumer()),
                ("Stream Sequence", u(v, "stream_seq").to_string()),
                ("Consumer Sequence", u(v, "consumer_seq").to_string()),
                ("Deliveries", u(v, "deliveries").to_string()),
                ("Ack Time", dur_ns(v["ack_time"].as_i64().unwrap_or(0))),
            ],
        ),
        _ => (
            if s(v, "type").is_empty() {
                subject.to_string()
            } else {
                s(v, "type").to_string()
            },
            v.as_object()
                .map(|m| {
                    m.iter()
                        .filter(|(k, _)| !matches!(k.as_str(), "type" | "id" | "timestamp"))
                        .map(|(_, x)| ("", x.to_string()))
                        .collect()
                })
                .unwrap_or_default(),
        ),
    }
}

fn long(subject: &str, v: &Value) -> String {
    let (title, rows) = describe(subject, v);
    let mut out = format!("[{}] [{}] {title}\n\n", clock(v), s(v, "id"));
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, val) in rows {
        if k.is_empty() {
            out += &format!("    {val}\n");
        } else {
            out += &format!("    {k:>width$}: {val}\n");
        }
    }
    out.push('\n');
    out
}

fn short(subject: &str, v: &Value) -> String {
    let (title, rows) = describe(subject, v);
    let details: Vec<String> = rows
        .into_iter()
        .filter(|(k, _)| *k != "Request")
        .map(|(k, val)| {
            if k.is_empty() {
                val
            } else {
                format!("{k}: {val}")
            }
        })
        .collect();
    format!("[{}] [{title}] {}", clock(v), details.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats() {
        let v = json!({"type":"io.nats.jetstream.advisory.v1.max_deliver","id":"abc",
            "timestamp":"2026-12-01T09:17:36.66Z","stream":"S","consumer":"C",
            "stream_seq":10,"deliveries":2});
        let text = long("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.C", &v);
        assert!(text.starts_with("[09:17:36] [abc] Consumer Delivery Exceeded\n"));
        assert!(text.contains("    Stream Sequence: 10\n"));
        assert!(text.contains("           Consumer: S > C\n"));
        assert_eq!(
            short("x", &v),
            "[09:17:36] [Consumer Delivery Exceeded] Consumer: S > C Stream Sequence: 10 Deliveries: 2"
        );
        let audit = json!({"type":"io.nats.jetstream.advisory.v1.api_audit","id":"i",
            "timestamp":"2026-12-01T09:17:36Z","server":"srv","client":{"acc":"$G","name":"me"},
            "subject":"$JS.API.STREAM.INFO.X",
            "response":"{\"error\":{\"code\":404,\"err_code\":10059,\"description\":\"stream not found\"}}"});
        let text = long("$JS.EVENT.ADVISORY.API", &audit);
        assert!(text.contains("JetStream API Access"));
        assert!(text.contains("Response: error 404 (10059): stream not found"));
        assert!(!text.contains("Request:"));
    }
}
