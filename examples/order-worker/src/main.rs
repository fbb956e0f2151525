//! order-worker: the worker from the Keel walkthrough.
//!
//! A durable pull consumer (`order-worker` on stream `ORDERS`, subjects
//! `orders.>`) that records each order in SQLite and acknowledges the message
//! only after the write has committed. Processing is idempotent: the write is
//! an upsert keyed by the order id, and a redelivered message (same stream
//! sequence, e.g. after a crash between the commit and the ack) changes
//! nothing but the `deliveries` counter. So the at-least-once delivery of
//! JetStream becomes effectively-once processing.
//!
//! On SIGTERM or Ctrl-C it stops pulling, finishes and acks the messages it
//! already has, and exits 0. Because the consumer is durable, a restarted
//! worker resumes right after the last acknowledged message.
//!
//! ```text
//! keel-server -js -sd /tmp/keel &
//! order-worker --db orders.db &
//! keel pub orders.new '{"id":1,"item":"book"}'
//! sqlite3 orders.db 'select * from orders'
//! ```
//!
//! Test hook: `ORDER_WORKER_CRASH_AFTER_WRITE=N` makes the worker SIGKILL
//! itself right after the Nth committed write, before acking it.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use clap::Parser;
use futures::StreamExt;
use rusqlite::{params, Connection, OptionalExtension};

#[derive(Parser, Debug)]
#[command(
    name = "order-worker",
    version,
    about = "Idempotent JetStream order worker (SQLite)"
)]
struct Args {
    /// NATS server URL
    #[arg(
        short = 's',
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    server: String,
    /// Database: a SQLite file path (created if missing)
    #[arg(long, env = "ORDER_WORKER_DB", default_value = "orders.db")]
    db: String,
    /// Stream to consume (created with --subjects if it does not exist)
    #[arg(long, default_value = "ORDERS")]
    stream: String,
    /// Subjects of the stream, when the worker has to create it
    #[arg(long, default_value = "orders.>")]
    subjects: String,
    /// Durable consumer name (created if it does not exist)
    #[arg(long, default_value = "order-worker")]
    consumer: String,
    /// Messages per pull request
    #[arg(long, default_value_t = 10)]
    batch: usize,
    /// Ack wait of the consumer, when the worker has to create it
    #[arg(long, default_value = "30s", value_parser = parse_secs)]
    ack_wait: Duration,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let (num, scale) = match s.strip_suffix("ms") {
        Some(n) => (n, 1e-3),
        None => match s.strip_suffix('s') {
            Some(n) => (n, 1.0),
            None => match s.strip_suffix('m') {
                Some(n) => (n, 60.0),
                None => (s, 1.0),
            },
        },
    };
    num.parse::<f64>()
        .ok()
        .and_then(|v| Duration::try_from_secs_f64(v * scale).ok())
        .ok_or_else(|| format!("invalid duration {s:?} (e.g. 30s, 500ms, 2m)"))
}

type Res<T> = Result<T, String>;

/// What one write did.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// First time this order was seen.
    Inserted,
    /// A newer message for a known order (a later stream sequence).
    Updated,
    /// A redelivery of a message already applied: nothing changed.
    Duplicate,
}

/// The orders table. `processed_count` counts distinct messages applied per
/// order (1 for an order published once, however often it was delivered);
/// `deliveries` counts every write attempt, so redeliveries show up there.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    order_id        TEXT PRIMARY KEY,
    subject         TEXT NOT NULL,
    body            TEXT NOT NULL,
    stream_seq      INTEGER NOT NULL,
    processed_count INTEGER NOT NULL,
    deliveries      INTEGER NOT NULL,
    max_delivery    INTEGER NOT NULL,
    updated_at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);";

/// Insert, or on conflict apply only what is new. A redelivery carries the
/// same stream sequence, so it neither bumps `processed_count` nor changes
/// the stored order.
const UPSERT: &str = "
INSERT INTO orders (order_id, subject, body, stream_seq, processed_count, deliveries, max_delivery)
VALUES (?1, ?2, ?3, ?4, 1, 1, ?5)
ON CONFLICT (order_id) DO UPDATE SET
    processed_count = orders.processed_count + (excluded.stream_seq > orders.stream_seq),
    body = CASE WHEN excluded.stream_seq > orders.stream_seq THEN excluded.body ELSE orders.body END,
    subject = CASE WHEN excluded.stream_seq > orders.stream_seq THEN excluded.subject ELSE orders.subject END,
    stream_seq = MAX(orders.stream_seq, excluded.stream_seq),
    deliveries = orders.deliveries + 1,
    max_delivery = MAX(orders.max_delivery, excluded.max_delivery),
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

struct Db {
    conn: Connection,
}

impl Db {
    fn open(spec: &str) -> Res<Db> {
        if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
            return Err(
                "Postgres is not supported by this example: give a SQLite file path with --db (e.g. --db orders.db)"
                    .into(),
            );
        }
        let path = PathBuf::from(spec.strip_prefix("sqlite://").unwrap_or(spec));
        let conn = Connection::open(&path)
            .map_err(|e| format!("cannot open SQLite database {}: {e}", path.display()))?;
        // WAL keeps readers (e.g. `sqlite3 orders.db`) from blocking the worker;
        // synchronous=FULL makes a commit durable before we ack.
        conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;")
            .and_then(|()| conn.execute_batch(SCHEMA))
            .map_err(|e| format!("cannot set up {}: {e}", path.display()))?;
        Ok(Db { conn })
    }

    /// Applies one order in its own transaction; returns once committed.
    fn upsert(&mut self, order: &Order, stream_seq: u64, delivered: i64) -> Res<Outcome> {
        let tx = self
            .conn
            .transaction()
            .map_err(|e| format!("cannot begin a transaction: {e}"))?;
        let previous: Option<i64> = tx
            .query_row(
                "SELECT stream_seq FROM orders WHERE order_id = ?1",
                [&order.id],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| format!("lookup of order {} failed: {e}", order.id))?;
        tx.execute(
            UPSERT,
            params![
                order.id,
                order.subject,
                order.body,
                stream_seq as i64,
                delivered
            ],
        )
        .map_err(|e| format!("upsert of order {} failed: {e}", order.id))?;
        tx.commit()
            .map_err(|e| format!("commit of order {} failed: {e}", order.id))?;
        Ok(match previous {
            None => Outcome::Inserted,
            Some(old) if (stream_seq as i64) > old => Outcome::Updated,
            Some(_) => Outcome::Duplicate,
        })
    }
}

struct Order {
    id: String,
    subject: String,
    body: String,
}

/// Reads `{"id": ...}` from a message body.
fn parse_order(subject: &str, payload: &[u8]) -> Res<Order> {
    let body = std::str::from_utf8(payload).map_err(|_| "body is not UTF-8".to_string())?;
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("body is not JSON ({e})"))?;
    let id = match v.get("id") {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        _ => return Err("body has no \"id\" field".into()),
    };
    Ok(Order {
        id,
        subject: subject.to_string(),
        body: body.to_string(),
    })
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(e) = run(args).await {
        eprintln!("order-worker: error: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Res<()> {
    if args.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    let crash_after: Option<u64> = match std::env::var("ORDER_WORKER_CRASH_AFTER_WRITE") {
        Ok(v) => Some(
            v.parse()
                .map_err(|_| format!("ORDER_WORKER_CRASH_AFTER_WRITE={v:?} is not a number"))?,
        ),
        Err(_) => None,
    };
    let mut db = Db::open(&args.db)?;

    let client = async_nats::ConnectOptions::new()
        .name("order-worker")
        .connect(args.server.as_str())
        .await
        .map_err(|e| {
            format!(
                "cannot connect to {}: {e} (is `keel-server -js` running?)",
                args.server
            )
        })?;
    let js = jetstream::new(client.clone());
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: args.stream.clone(),
            subjects: vec![args.subjects.clone()],
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| {
            format!(
                "cannot open stream {}: {e} (is JetStream enabled with -js?)",
                args.stream
            )
        })?;
    let consumer: jetstream::consumer::Consumer<pull::Config> = stream
        .get_or_create_consumer(
            &args.consumer,
            pull::Config {
                durable_name: Some(args.consumer.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                deliver_policy: jetstream::consumer::DeliverPolicy::All,
                ack_wait: args.ack_wait,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            format!(
                "cannot open consumer {} > {}: {e}",
                args.stream, args.consumer
            )
        })?;

    // SIGTERM and Ctrl-C flip this; the loop stops pulling and drains.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = term.recv() => eprintln!("order-worker: SIGTERM received, draining"),
            _ = tokio::signal::ctrl_c() => eprintln!("order-worker: interrupt received, draining"),
        }
        let _ = stop_tx.send(true);
    });

    eprintln!(
        "order-worker: ready: consuming {} > {} into {}",
        args.stream, args.consumer, args.db
    );
    let mut writes = 0u64;
    let mut processed = 0u64;
    while !*stop_rx.borrow() {
        // A short expiry bounds how long a stop request waits for the pull.
        let mut batch = consumer
            .fetch()
            .max_messages(args.batch)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .map_err(|e| format!("pull request failed: {e}"))?;
        // Every message already fetched is processed and acked, even after a
        // stop request: that is the drain.
        while let Some(msg) = batch.next().await {
            let msg = msg.map_err(|e| format!("receiving failed: {e}"))?;
            let (stream_seq, delivered) = match msg.info() {
                Ok(i) => (i.stream_sequence, i.delivered),
                Err(e) => return Err(format!("message without JetStream metadata: {e}")),
            };
            let order = match parse_order(&msg.subject, &msg.payload) {
                Ok(o) => o,
                Err(why) => {
                    // Redelivering a malformed order cannot help: drop it.
                    eprintln!("order-worker: skipping stream seq {stream_seq}: {why}");
                    msg.ack_with(AckKind::Term)
                        .await
                        .map_err(|e| format!("cannot terminate message {stream_seq}: {e}"))?;
                    continue;
                }
            };
            let outcome = db.upsert(&order, stream_seq, delivered)?;
            writes += 1;
            if crash_after == Some(writes) {
                eprintln!(
                    "order-worker: test hook: killing myself after write {writes} (order {}, stream seq {stream_seq}) before the ack",
                    order.id
                );
                // SAFETY: getpid and kill have no memory-safety preconditions.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            // Ack only now that the write has committed, and wait for the
            // server to confirm it, so an acked order is never redelivered.
            msg.double_ack()
                .await
                .map_err(|e| format!("ack of stream seq {stream_seq} failed: {e}"))?;
            processed += 1;
            let what = match outcome {
                Outcome::Inserted => "inserted",
                Outcome::Updated => "updated",
                Outcome::Duplicate => "redelivery, already applied: no change",
            };
            println!(
                "order {} (stream seq {stream_seq}, delivery {delivered}): {what}",
                order.id
            );
        }
    }
    client
        .flush()
        .await
        .map_err(|e| format!("flush failed: {e}"))?;
    eprintln!("order-worker: stopped cleanly after {processed} messages");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(id: &str, body: &str) -> Order {
        Order {
            id: id.into(),
            subject: "orders.new".into(),
            body: body.into(),
        }
    }

    #[test]
    fn upsert_is_idempotent() {
        let mut db = Db::open(":memory:").unwrap();
        let o = order("1", r#"{"id":1}"#);
        assert_eq!(db.upsert(&o, 1, 1).unwrap(), Outcome::Inserted);
        // The same message again (a redelivery): nothing but deliveries moves.
        assert_eq!(db.upsert(&o, 1, 2).unwrap(), Outcome::Duplicate);
        let (p, d, m): (i64, i64, i64) = db
            .conn
            .query_row(
                "SELECT processed_count, deliveries, max_delivery FROM orders WHERE order_id = '1'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!((p, d, m), (1, 2, 2));
        // A newer message for the same order is applied.
        let newer = order("1", r#"{"id":1,"status":"paid"}"#);
        assert_eq!(db.upsert(&newer, 5, 1).unwrap(), Outcome::Updated);
        // An older message arriving late changes nothing.
        assert_eq!(db.upsert(&o, 1, 3).unwrap(), Outcome::Duplicate);
        let body: String = db
            .conn
            .query_row("SELECT body FROM orders WHERE order_id = '1'", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert!(body.contains("paid"));
    }

    #[test]
    fn orders_parse() {
        assert_eq!(parse_order("s", br#"{"id":1}"#).unwrap().id, "1");
        assert_eq!(parse_order("s", br#"{"id":"A-7"}"#).unwrap().id, "A-7");
        assert!(parse_order("s", b"not json").is_err());
        assert!(parse_order("s", br#"{"no":"id"}"#).is_err());
    }

    #[test]
    fn postgres_is_refused_clearly() {
        let err = Db::open("postgres://localhost/orders").err().unwrap();
        assert!(err.contains("Postgres is not supported"), "{err}");
    }
}
