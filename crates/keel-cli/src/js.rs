//! JetStream plumbing shared by `stream`, `consumer`, `kv`, `account` and the
//! JetStream benchmarks: one connection, the typed async-nats context, and
//! raw `$JS.API` requests for the commands that print the server's own JSON.

use std::time::Duration;

use async_nats::{client::RequestErrorKind, jetstream, Client};

use bytes::Bytes;
use serde_json::Value;

use crate::util::{redact, ConnSettings, Res};

/// A JetStream API error as the server reports it.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: u64,
    pub err_code: u64,
    pub description: String,
}

/// Well-known `err_code` values of the reference server.
pub const ERR_STREAM_NOT_FOUND: u64 = 10059;
pub const ERR_CONSUMER_NOT_FOUND: u64 = 10014;
pub const ERR_NO_MESSAGE_FOUND: u64 = 10037;

#[derive(Debug)]
pub enum JsError {
    /// The server answered with an `error` object.
    Api(ApiError),
    /// Anything else, already worded for a person.
    Other(String),
}

impl JsError {
    pub fn err_code(&self) -> Option<u64> {
        match self {
            JsError::Api(e) => Some(e.err_code),
            JsError::Other(_) => None,
        }
    }
}

impl From<JsError> for String {
    fn from(e: JsError) -> String {
        match e {
            JsError::Api(e) => format!("{} (error {}, code {})", e.description, e.err_code, e.code),
            JsError::Other(s) => s,
        }
    }
}

/// Turns a stream-level error into a sentence naming the stream.
pub fn stream_error(stream: &str) -> impl Fn(JsError) -> String + '_ {
    move |e| match e.err_code() {
        Some(ERR_STREAM_NOT_FOUND) => {
            format!("stream {stream} not found (list the streams with `keel stream ls`)")
        }
        _ => String::from(e),
    }
}

/// Turns a consumer-level error into a sentence naming the consumer.
pub fn consumer_error<'a>(stream: &'a str, consumer: &'a str) -> impl Fn(JsError) -> String + 'a {
    move |e| match e.err_code() {
        Some(ERR_STREAM_NOT_FOUND) => {
            format!("stream {stream} not found (list the streams with `keel stream ls`)")
        }
        Some(ERR_CONSUMER_NOT_FOUND) => format!(
            "consumer {stream} > {consumer} not found (list them with `keel consumer ls {stream}`)"
        ),
        _ => String::from(e),
    }
}

pub struct Js {
    pub client: Client,
    pub ctx: jetstream::Context,
    pub server: String,
    pub timeout: Duration,
    /// `$JS.API`, or the domain's / `--js-api-prefix`'s prefix.
    pub prefix: String,
}

impl Js {
    /// Connects and checks that JetStream answers, so every command fails the
    /// same actionable way when it is not enabled.
    pub async fn connect(conn: &ConnSettings) -> Res<Js> {
        let client = conn.connect().await?;
        let js = Js::from_client(client, conn);
        js.api("INFO", None).await.map_err(String::from)?;
        Ok(js)
    }

    pub fn from_client(client: Client, conn: &ConnSettings) -> Js {
        let ctx = conn.jetstream(client.clone());
        Js {
            client,
            ctx,
            server: redact(&conn.server),
            timeout: conn.timeout,
            prefix: conn.js_api_prefix.clone(),
        }
    }

    pub fn not_enabled(&self) -> String {
        format!(
            "JetStream is not enabled on the server at {} (start it with -js, e.g. `keel-server -js`)",
            self.server
        )
    }

    /// Sends `$JS.API.<api>` with an optional JSON body; returns the response
    /// JSON, or the server's error.
    pub async fn api(&self, api: &str, body: Option<&Value>) -> Result<Value, JsError> {
        let payload = match body {
            Some(b) => Bytes::from(b.to_string()),
            None => Bytes::new(),
        };
        let subject = format!("{}.{api}", self.prefix);
        let reply =
            match tokio::time::timeout(self.timeout, self.client.request(subject.clone(), payload))
                .await
            {
                Err(_) => return Err(self.timed_out(&subject)),
                Ok(Err(e)) => {
                    return Err(JsError::Other(match e.kind() {
                        RequestErrorKind::NoResponders => self.not_enabled(),
                        RequestErrorKind::TimedOut => String::from(self.timed_out(&subject)),
                        _ => format!("request on {subject} failed: {e}"),
                    }))
                }
                Ok(Ok(m)) => m,
            };
        let v: Value = serde_json::from_slice(&reply.payload).map_err(|e| {
            JsError::Other(format!(
                "the server sent an invalid JSON response to {subject}: {e}"
            ))
        })?;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return Err(JsError::Api(ApiError {
                code: err.get("code").and_then(Value::as_u64).unwrap_or(0),
                err_code: err.get("err_code").and_then(Value::as_u64).unwrap_or(0),
                description: err
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown error")
                    .to_string(),
            }));
        }
        Ok(v)
    }

    fn timed_out(&self, subject: &str) -> JsError {
        JsError::Other(format!(
            "JetStream did not answer {subject} within {:?} (is the server healthy? raise --timeout if it is slow)",
            self.timeout
        ))
    }

    /// Collects a paged list API (`STREAM.NAMES`, `CONSUMER.LIST`, ...): the
    /// items under `key` from every page.
    pub async fn paged(&self, api: &str, key: &str, extra: Value) -> Result<Vec<Value>, JsError> {
        let mut out = Vec::new();
        loop {
            let mut body = extra.clone();
            if let Value::Object(m) = &mut body {
                m.insert("offset".into(), Value::from(out.len()));
            }
            let page = self.api(api, Some(&body)).await?;
            let items = page
                .get(key)
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let total = page.get("total").and_then(Value::as_u64).unwrap_or(0) as usize;
            let got = items.len();
            out.extend(items);
            if got == 0 || out.len() >= total {
                return Ok(out);
            }
        }
    }

    /// `STREAM.INFO` for one stream, with errors naming it.
    pub async fn stream_info(&self, stream: &str) -> Res<Value> {
        check_name("stream", stream)?;
        self.api(&format!("STREAM.INFO.{stream}"), None)
            .await
            .map_err(stream_error(stream))
    }

    /// `STREAM.INFO` for the stream behind a KV or object store bucket, with
    /// `missing()` as the error when that stream does not exist.
    pub async fn bucket_stream_info(
        &self,
        stream: &str,
        missing: impl FnOnce() -> String,
    ) -> Res<Value> {
        self.api(&format!("STREAM.INFO.{stream}"), None)
            .await
            .map_err(|e| match e.err_code() {
                Some(ERR_STREAM_NOT_FOUND) => missing(),
                _ => String::from(e),
            })
    }

    /// `CONSUMER.INFO` for one consumer, with errors naming it.
    pub async fn consumer_info(&self, stream: &str, consumer: &str) -> Res<Value> {
        check_name("stream", stream)?;
        check_name("consumer", consumer)?;
        self.api(&format!("CONSUMER.INFO.{stream}.{consumer}"), None)
            .await
            .map_err(consumer_error(stream, consumer))
    }
}

/// Stream and consumer names become subject tokens, so they cannot hold
/// spaces, dots or wildcards.
pub fn check_name(what: &str, name: &str) -> Res<()> {
    if name.is_empty() {
        return Err(format!("{what} name is empty"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| matches!(c, '.' | '*' | '>' | ' ' | '\t' | '\r' | '\n' | '/' | '\\'))
    {
        return Err(format!(
            "invalid {what} name {name:?}: it may not contain {c:?} (names cannot hold spaces, '.', '*', '>', '/' or '\\')"
        ));
    }
    Ok(())
}

/// The JetStream metadata carried in a `$JS.ACK...` reply subject.
#[derive(Debug, PartialEq, Eq)]
pub struct AckMeta {
    pub stream: String,
    pub consumer: String,
    pub delivered: u64,
    pub stream_seq: u64,
    pub consumer_seq: u64,
    pub timestamp_ns: i128,
    pub pending: u64,
}

/// Parses `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`
/// and the v2 form with domain and account hash in front (ADR-15).
pub fn parse_ack_subject(reply: &str) -> Option<AckMeta> {
    let tokens: Vec<&str> = reply.split('.').collect();
    if tokens.len() < 9 || tokens[0] != "$JS" || tokens[1] != "ACK" {
        return None;
    }
    let t = if tokens.len() == 9 {
        &tokens[2..9]
    } else if tokens.len() >= 11 {
        &tokens[4..11]
    } else {
        return None;
    };
    Some(AckMeta {
        stream: t[0].to_string(),
        consumer: t[1].to_string(),
        delivered: t[2].parse().ok()?,
        stream_seq: t[3].parse().ok()?,
        consumer_seq: t[4].parse().ok()?,
        timestamp_ns: t[5].parse().ok()?,
        pending: t[6].parse().ok()?,
    })
}

/// Merges `--metadata key=value` flags into a stream or consumer config's `metadata`.
pub fn apply_metadata(
    cfg: &mut serde_json::Map<String, serde_json::Value>,
    pairs: &[String],
) -> crate::util::Res<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let mut m = cfg
        .get("metadata")
        .and_then(serde_json::Value::as_object)
        .cloned()
        .unwrap_or_default();
    for kv in pairs {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("invalid --metadata {kv:?}: expected key=value"))?;
        m.insert(k.to_string(), serde_json::Value::from(v));
    }
    cfg.insert("metadata".into(), serde_json::Value::Object(m));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_subjects() {
        let m = parse_ack_subject("$JS.ACK.ORDERS.worker.2.7.5.1714557600000000000.3").unwrap();
        assert_eq!(m.stream, "ORDERS");
        assert_eq!(m.consumer, "worker");
        assert_eq!(
            (m.delivered, m.stream_seq, m.consumer_seq, m.pending),
            (2, 7, 5, 3)
        );
        let v2 =
            parse_ack_subject("$JS.ACK.hub.ACC.ORDERS.w.1.2.3.1714557600000000000.0.tok").unwrap();
        assert_eq!((v2.stream.as_str(), v2.stream_seq), ("ORDERS", 2));
        assert!(parse_ack_subject("_INBOX.abc").is_none());
        assert!(parse_ack_subject("$JS.ACK.a.b.c").is_none());
    }

    #[test]
    fn names() {
        assert!(check_name("stream", "ORDERS").is_ok());
        assert!(check_name("stream", "OR.DERS").is_err());
        assert!(check_name("stream", "").is_err());
    }
}
