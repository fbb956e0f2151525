//! JetStream advisories and metrics, published in the account as the reference publishes
//! them: `$JS.EVENT.ADVISORY.API` (every API request and its response),
//! `$JS.EVENT.ADVISORY.STREAM.CREATED|UPDATED|DELETED.<stream>`,
//! `$JS.EVENT.ADVISORY.CONSUMER.CREATED|DELETED.<stream>.<consumer>`,
//! `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES|MSG_NAKED|MSG_TERMINATED.<stream>.<consumer>`
//! and `$JS.EVENT.METRIC.CONSUMER.ACK.<stream>.<consumer>` (acks sampled by `sample_freq`).
//!
//! Each is a JSON object starting with `type`, `id` and `timestamp`, in the reference's field
//! order. Nothing is built unless someone subscribes to the subject, so with no listener the
//! hooks cost one interest lookup. Consumers record their events under their lock (as
//! [`ConsumerEvent`]s) and publish them after it, from their task.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::api::{to_bytes, ApiError, ErrorKind};
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::time::{now_nanos, rfc3339};

const ADVISORY: &str = "io.nats.jetstream.advisory.v1.";

/// What happened to a stream or consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Create,
    Update,
    Delete,
}

impl Action {
    fn subject_word(self) -> &'static str {
        match self {
            Action::Create => "CREATED",
            Action::Update => "UPDATED",
            Action::Delete => "DELETED",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Action::Create => "create",
            Action::Update => "modify",
            Action::Delete => "delete",
        }
    }
}

/// An event id: 22 base-62 characters, the shape of the reference's nuids.
pub fn new_id() -> String {
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    (0..22)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// `type`, `id`, `timestamp`: the head of every event.
fn event(kind: &str, ts: i64) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("type".into(), kind.into());
    m.insert("id".into(), new_id().into());
    m.insert("timestamp".into(), rfc3339(ts).into());
    m
}

/// Publishes the event `build` makes on `subject`, if anyone listens there.
fn send(
    server: &Server,
    router: &mut Router,
    subject: String,
    build: impl FnOnce() -> Map<String, Value>,
) {
    let subject = Bytes::from(subject);
    if !router.has_interest(server, &subject) {
        return;
    }
    let mut event = build();
    // Last, and only with a domain configured (the reference's `omitempty`).
    if let Some(d) = super::domain(server) {
        event.insert("domain".into(), d.into());
    }
    let data = Bytes::from(to_bytes(&Value::Object(event)));
    router.route(
        server,
        &Outgoing {
            subject: &subject,
            reply: None,
            hdr_len: None,
            data: &data,
        },
        None,
    );
}

/// `$JS.EVENT.ADVISORY.STREAM.<CREATED|UPDATED|DELETED>.<stream>`.
pub fn stream_action(server: &Server, router: &mut Router, stream: &str, action: Action) {
    let subject = format!(
        "$JS.EVENT.ADVISORY.STREAM.{}.{stream}",
        action.subject_word()
    );
    send(server, router, subject, || {
        let mut m = event(
            &format!("{ADVISORY}stream_action"),
            crate::time::now_nanos(),
        );
        m.insert("stream".into(), stream.into());
        m.insert("action".into(), action.name().into());
        m
    });
}

/// `$JS.EVENT.ADVISORY.SERVER.REMOVED` (in the system account): this server was removed
/// from its JetStream cluster and turned JetStream off.
pub fn server_removed(server: &Server, router: &mut Router) {
    send(
        server,
        router,
        "$JS.EVENT.ADVISORY.SERVER.REMOVED".into(),
        || {
            let mut m = event(&format!("{ADVISORY}server_removed"), now_nanos());
            m.insert("server".into(), server.server_name.clone().into());
            m.insert("server_id".into(), server.server_id.clone().into());
            let cluster = server.cluster.get().map(|c| c.name()).unwrap_or_default();
            m.insert("cluster".into(), cluster.into());
            m
        },
    );
}

/// `$JS.EVENT.ADVISORY.CONSUMER.<CREATED|DELETED>.<stream>.<consumer>`.
pub fn consumer_action(
    server: &Server,
    router: &mut Router,
    stream: &str,
    consumer: &str,
    action: Action,
) {
    let subject = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.{}.{stream}.{consumer}",
        action.subject_word()
    );
    send(server, router, subject, || {
        let mut m = event(&format!("{ADVISORY}consumer_action"), now_nanos());
        m.insert("stream".into(), stream.into());
        m.insert("consumer".into(), consumer.into());
        m.insert("action".into(), action.name().into());
        m
    });
}

/// `$JS.EVENT.ADVISORY.API`: one API request (`subject`, `request` body) and the JSON
/// response, with the requesting connection as `client`.
pub fn api_audit(
    server: &Server,
    router: &mut Router,
    origin: u64,
    subject: &[u8],
    request: &[u8],
    response: &[u8],
) {
    send(server, router, "$JS.EVENT.ADVISORY.API".into(), || {
        let mut m = event(&format!("{ADVISORY}api_audit"), now_nanos());
        m.insert("server".into(), server.server_name.clone().into());
        m.insert("client".into(), client_info(server, origin));
        m.insert(
            "subject".into(),
            String::from_utf8_lossy(subject).into_owned().into(),
        );
        if !request.is_empty() {
            m.insert(
                "request".into(),
                String::from_utf8_lossy(request).into_owned().into(),
            );
        }
        m.insert(
            "response".into(),
            String::from_utf8_lossy(response).into_owned().into(),
        );
        m
    });
}

/// The reference's client info for an advisory (empty fields left out); null when the
/// connection is gone or the request came from the server itself.
fn client_info(server: &Server, id: u64) -> Value {
    let Some(h) = (id != 0).then(|| server.client(id)).flatten() else {
        return Value::Null;
    };
    let meta = h.meta.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Map::new();
    if let Some(start) = meta.start {
        let nanos = start
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        c.insert("start".into(), rfc3339(nanos).into());
    }
    if let Some(addr) = meta.addr {
        c.insert("host".into(), addr.ip().to_string().into());
    }
    c.insert("id".into(), id.into());
    c.insert("acc".into(), h.account().name.clone().into());
    for (k, v) in [
        ("name", &meta.name),
        ("lang", &meta.lang),
        ("ver", &meta.version),
    ] {
        if !v.is_empty() {
            c.insert(k.into(), v.clone().into());
        }
    }
    let rtt = h.stats.rtt_nanos.load(std::sync::atomic::Ordering::Relaxed);
    if rtt > 0 {
        c.insert("rtt".into(), rtt.into());
    }
    c.insert("server".into(), server.server_name.clone().into());
    c.insert("kind".into(), "Client".into());
    c.insert("client_type".into(), "nats".into());
    Value::Object(c)
}

/// Something a consumer saw, recorded under its lock and published after it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerEvent {
    pub ts: i64,
    pub kind: ConsumerEventKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ConsumerEventKind {
    /// A delivery was negatively acknowledged (`-NAK`).
    Nak {
        stream_seq: u64,
        consumer_seq: u64,
        deliveries: u64,
    },
    /// A delivery was terminated (`+TERM [reason]`): it will not be redelivered.
    Terminated {
        stream_seq: u64,
        consumer_seq: u64,
        deliveries: u64,
        reason: String,
    },
    /// A message used up `max_deliver` without an ack: a dead-letter candidate.
    MaxDeliveries { stream_seq: u64, deliveries: u64 },
    /// A sampled ack (`sample_freq`): `ack_time` is nanoseconds since the delivery.
    Ack {
        stream_seq: u64,
        consumer_seq: u64,
        deliveries: u64,
        ack_time: i64,
    },
}

impl ConsumerEvent {
    pub fn new(kind: ConsumerEventKind) -> Self {
        ConsumerEvent {
            ts: now_nanos(),
            kind,
        }
    }
}

/// Publishes what a consumer recorded.
pub fn consumer_events(
    server: &Server,
    router: &mut Router,
    stream: &str,
    consumer: &str,
    events: Vec<ConsumerEvent>,
) {
    for e in events {
        let (subject, kind) = match &e.kind {
            ConsumerEventKind::Nak { .. } => ("ADVISORY.CONSUMER.MSG_NAKED", "advisory.v1.nak"),
            ConsumerEventKind::Terminated { .. } => {
                ("ADVISORY.CONSUMER.MSG_TERMINATED", "advisory.v1.terminated")
            }
            ConsumerEventKind::MaxDeliveries { .. } => (
                "ADVISORY.CONSUMER.MAX_DELIVERIES",
                "advisory.v1.max_deliver",
            ),
            ConsumerEventKind::Ack { .. } => ("METRIC.CONSUMER.ACK", "metric.v1.consumer_ack"),
        };
        send(
            server,
            router,
            format!("$JS.EVENT.{subject}.{stream}.{consumer}"),
            || {
                let mut m = event(&format!("io.nats.jetstream.{kind}"), e.ts);
                m.insert("stream".into(), stream.into());
                m.insert("consumer".into(), consumer.into());
                match e.kind {
                    ConsumerEventKind::Nak {
                        stream_seq,
                        consumer_seq,
                        deliveries,
                    } => {
                        m.insert("consumer_seq".into(), consumer_seq.into());
                        m.insert("stream_seq".into(), stream_seq.into());
                        m.insert("deliveries".into(), deliveries.into());
                    }
                    ConsumerEventKind::Terminated {
                        stream_seq,
                        consumer_seq,
                        deliveries,
                        reason,
                    } => {
                        m.insert("consumer_seq".into(), consumer_seq.into());
                        m.insert("stream_seq".into(), stream_seq.into());
                        m.insert("deliveries".into(), deliveries.into());
                        if !reason.is_empty() {
                            m.insert("reason".into(), reason.into());
                        }
                    }
                    ConsumerEventKind::MaxDeliveries {
                        stream_seq,
                        deliveries,
                    } => {
                        m.insert("stream_seq".into(), stream_seq.into());
                        m.insert("deliveries".into(), deliveries.into());
                    }
                    ConsumerEventKind::Ack {
                        stream_seq,
                        consumer_seq,
                        deliveries,
                        ack_time,
                    } => {
                        m.insert("consumer_seq".into(), consumer_seq.into());
                        m.insert("stream_seq".into(), stream_seq.into());
                        m.insert("ack_time".into(), ack_time.into());
                        m.insert("deliveries".into(), deliveries.into());
                    }
                }
                m
            },
        );
    }
}

/// A consumer's `sample_freq` (`"50"`, `"50%"`) as the reference reads it: a percentage,
/// 100 or more samples every ack. Bad values get the reference's error.
pub fn parse_sample_freq(s: &str) -> Result<i64, ApiError> {
    let bad = |why: String| ErrorKind::ConsumerSampleFrequency.with(why);
    let n = s.strip_suffix('%').unwrap_or(s);
    match n.parse::<i64>() {
        Ok(v) if v >= 0 => Ok(v),
        // Go's Atoi succeeded, the check on its result failed: the error it reports is nil.
        Ok(_) => Err(bad("<nil>".into())),
        Err(e) => {
            let why = if matches!(
                e.kind(),
                std::num::IntErrorKind::PosOverflow | std::num::IntErrorKind::NegOverflow
            ) {
                "value out of range"
            } else {
                "invalid syntax"
            };
            Err(bad(format!("strconv.Atoi: parsing {n:?}: {why}")))
        }
    }
}

/// Should this ack be sampled? As the reference: every ack at 100 or more, otherwise a
/// random draw in 0..100 at or below the frequency.
pub fn should_sample(sample_freq: &str) -> bool {
    if sample_freq.is_empty() {
        return false;
    }
    match parse_sample_freq(sample_freq) {
        Ok(f) if f >= 100 => true,
        Ok(f) if f > 0 => rand::random_range(0..100) <= f,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_freq_parsing() {
        assert_eq!(parse_sample_freq("100%").unwrap(), 100);
        assert_eq!(parse_sample_freq("30").unwrap(), 30);
        assert_eq!(
            parse_sample_freq("abc").unwrap_err().description,
            "failed to parse consumer sampling configuration: strconv.Atoi: parsing \"abc\": invalid syntax"
        );
        assert_eq!(
            parse_sample_freq("-5").unwrap_err().description,
            "failed to parse consumer sampling configuration: <nil>"
        );
        assert!(should_sample("150%"));
        assert!(!should_sample(""));
        assert!(!should_sample("0"));
    }

    #[test]
    fn ids_look_like_nuids() {
        let a = new_id();
        assert_eq!(a.len(), 22);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, new_id());
    }
}
