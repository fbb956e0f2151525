//! The JetStream API (`$JS.API.>`): one task takes the requests, dispatches them by subject
//! to the handlers (`streams.rs`, `messages.rs`, `account.rs`, `consumers.rs`), and answers
//! each with its typed response (`types.rs`) or an error from the one table (`errors.rs`),
//! then publishes the API audit. Requests are decoded as the reference decodes them
//! (`decode.rs`). A handler that changes a stream awaits its actor's reply.

pub mod account;
pub mod consumers;
pub mod decode;
pub mod errors;
pub mod messages;
pub mod not_enabled;
pub mod streams;
pub mod types;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use keel_protocol::encode;
use serde::Serialize;
use serde_json::Value;

pub use decode::*;
pub use errors::{ApiError, ErrorKind};

use super::{advisory, JetStream};
use crate::client::InMsg;
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::time::rfc3339;
use types::{ErrorResponse, Paged, Response};

/// The API's task: a batch of what is queued, then the writers are woken once.
pub async fn run(js: Arc<JetStream>, server: Arc<Server>, mut rx: crate::inqueue::Receiver) {
    let mut router = Router::new(js.account.clone(), 0x4a53);
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, 256, 1024 * 1024).await > 0 {
        for m in batch.drain(..) {
            handle_request(&js, &server, &mut router, m).await;
        }
        router.flush();
    }
}

pub(crate) fn reply(server: &Server, router: &mut Router, to: &Bytes, body: impl Into<Bytes>) {
    let body: Bytes = body.into();
    router.route(
        server,
        &Outgoing {
            subject: to,
            reply: None,
            hdr_len: None,
            data: &body,
        },
        None,
    );
}

pub(crate) fn reply_headers(
    server: &Server,
    router: &mut Router,
    to: &Bytes,
    hdr: Vec<u8>,
    payload: &[u8],
) {
    let hdr_len = hdr.len();
    let mut data = hdr;
    data.extend_from_slice(payload);
    let data = Bytes::from(data);
    router.route(
        server,
        &Outgoing {
            subject: to,
            reply: None,
            hdr_len: Some(hdr_len),
            data: &data,
        },
        None,
    );
}

/// `$JS.<domain>.API.X` is `$JS.API.X` (the reference maps the prefix): the request is
/// published again on the plain subject, with its reply and its publisher, so the API and
/// the consumers' pull subscriptions take it as if it had been sent there.
fn relay_domain_request(js: &JetStream, server: &Server, m: &InMsg) {
    let Some(d) = &js.domain else { return };
    let Some(rest) = m.subject.strip_prefix(format!("$JS.{d}.API.").as_bytes()) else {
        return;
    };
    let mut subject = b"$JS.API.".to_vec();
    subject.extend_from_slice(rest);
    let subject = Bytes::from(subject);
    let mut router = Router::new(js.account.clone(), m.origin).with_origin(m.origin);
    router.route(
        server,
        &Outgoing {
            subject: &subject,
            reply: m.reply.as_ref(),
            hdr_len: (m.hdr_len > 0).then_some(m.hdr_len),
            data: &m.data,
        },
        None,
    );
    router.flush();
}

/// A handler's typed outcome, encoded with its `type`.
fn encoded<T: Serialize>(kind: &str, r: Result<T, ApiError>) -> Result<Vec<u8>, ApiError> {
    r.map(|body| {
        to_bytes(&Response {
            kind: types::type_name(kind),
            body: &body,
        })
    })
}

/// An error response, with the fields the reference writes even next to an error.
/// A response body: the value, or the error in `kind`'s error response.
pub(crate) fn encoded_for<T: Serialize>(kind: &str, r: Result<T, ApiError>) -> Vec<u8> {
    encoded(kind, r).unwrap_or_else(|e| error_body(kind, &e))
}

/// `kind`'s error response carrying `e`.
pub(crate) fn error_body_for(kind: &str, e: &ApiError) -> Vec<u8> {
    error_body(kind, e)
}

fn error_body(kind: &str, e: &ApiError) -> Vec<u8> {
    #[derive(Serialize)]
    struct Streams {
        #[serde(flatten)]
        paged: Paged,
        streams: Option<()>,
    }
    #[derive(Serialize)]
    struct Consumers {
        #[serde(flatten)]
        paged: Paged,
        consumers: [(); 0],
    }
    #[derive(Serialize)]
    struct Purged {
        purged: u64,
    }
    #[derive(Serialize)]
    struct Nothing {}
    fn body<T: Serialize>(kind: &str, e: &ApiError, extra: T) -> Vec<u8> {
        to_bytes(&ErrorResponse {
            kind: types::type_name(kind),
            error: e,
            extra,
        })
    }
    let paged = Paged::default();
    match kind {
        "stream_info" => body(kind, e, paged),
        "stream_names" | "stream_list" => body(
            kind,
            e,
            Streams {
                paged,
                streams: None,
            },
        ),
        "consumer_names" | "consumer_list" => body(
            kind,
            e,
            Consumers {
                paged,
                consumers: [],
            },
        ),
        "stream_purge" => body(kind, e, Purged { purged: 0 }),
        _ => body(kind, e, Nothing {}),
    }
}

async fn handle_request(js: &Arc<JetStream>, server: &Arc<Server>, router: &mut Router, m: InMsg) {
    let Ok(subject) = std::str::from_utf8(&m.subject) else {
        return;
    };
    let Some(rest) = subject.strip_prefix("$JS.API.") else {
        relay_domain_request(js, server, &m);
        return;
    };
    let Some(reply_to) = m.reply.clone() else {
        return; // Requests without a reply subject cannot be answered.
    };
    let body = m.payload();
    let tokens: Vec<&str> = rest.split('.').collect();
    // In a cluster, a request may belong to another server (forwarded there) or to the
    // meta group.
    if super::cluster::api(js, server, router, &m, &tokens).await {
        return;
    }
    // Direct get answers with the message itself, not JSON.
    if tokens.first() == Some(&"DIRECT") {
        if tokens.len() >= 3 && tokens[1] == "GET" {
            js.api_total.fetch_add(1, Ordering::Relaxed);
            let subj = (tokens.len() > 3).then(|| tokens[3..].join("."));
            messages::direct_get(
                js,
                server,
                router,
                &reply_to,
                tokens[2],
                subj.as_deref(),
                body,
            );
        }
        return;
    }
    use consumers as c;
    let (kind, result) = match tokens.as_slice() {
        ["INFO"] => (
            "account_info",
            encoded("account_info", Ok(account::info(js, server))),
        ),
        ["STREAM", "CREATE", name] => (
            "stream_create",
            encoded(
                "stream_create",
                streams::create(js, server, router, name, body).await,
            ),
        ),
        ["STREAM", "UPDATE", name] => (
            "stream_update",
            encoded(
                "stream_update",
                streams::update(js, server, router, name, body).await,
            ),
        ),
        ["STREAM", "INFO", name] => (
            "stream_info",
            encoded("stream_info", streams::stream_info(js, name, body)),
        ),
        ["STREAM", "NAMES"] => (
            "stream_names",
            encoded("stream_names", streams::names(js, body)),
        ),
        ["STREAM", "LIST"] => (
            "stream_list",
            encoded("stream_list", streams::list(js, body)),
        ),
        ["STREAM", "DELETE", name] => {
            let r = match expect_empty(body) {
                Ok(()) => streams::delete(js, server, router, name).await,
                Err(e) => Err(e),
            };
            ("stream_delete", encoded("stream_delete", r))
        }
        ["STREAM", "PURGE", name] => (
            "stream_purge",
            encoded("stream_purge", streams::purge(js, name, body).await),
        ),
        ["STREAM", "MSG", "GET", name] => (
            "stream_msg_get",
            encoded("stream_msg_get", messages::get(js, name, body)),
        ),
        ["STREAM", "MSG", "DELETE", name] => (
            "stream_msg_delete",
            encoded("stream_msg_delete", messages::delete(js, name, body).await),
        ),
        ["CONSUMER", "CREATE", stream] => (
            "consumer_create",
            encoded(
                "consumer_create",
                c::consumer_create(js, server, router, stream, None, None, body),
            ),
        ),
        ["CONSUMER", "CREATE", stream, name] => (
            "consumer_create",
            encoded(
                "consumer_create",
                c::consumer_create(js, server, router, stream, Some(name), None, body),
            ),
        ),
        ["CONSUMER", "CREATE", stream, name, filter @ ..] => {
            let filter = filter.join(".");
            (
                "consumer_create",
                encoded(
                    "consumer_create",
                    c::consumer_create(js, server, router, stream, Some(name), Some(&filter), body),
                ),
            )
        }
        ["CONSUMER", "DURABLE", "CREATE", stream, name] => (
            "consumer_create",
            encoded(
                "consumer_create",
                c::consumer_create_durable(js, server, router, stream, name, body),
            ),
        ),
        ["CONSUMER", "INFO", stream, name] => (
            "consumer_info",
            encoded(
                "consumer_info",
                expect_empty(body).and_then(|_| c::consumer_info(js, server, stream, name)),
            ),
        ),
        ["CONSUMER", "NAMES", stream] => (
            "consumer_names",
            encoded("consumer_names", c::consumer_names(js, stream, body)),
        ),
        ["CONSUMER", "LIST", stream] => (
            "consumer_list",
            encoded("consumer_list", c::consumer_list(js, server, stream, body)),
        ),
        ["CONSUMER", "DELETE", stream, name] => {
            let r = match expect_empty(body) {
                Ok(()) => c::consumer_delete(js, server, router, stream, name).await,
                Err(e) => Err(e),
            };
            ("consumer_delete", encoded("consumer_delete", r))
        }
        ["CONSUMER", "MSG", "NEXT", stream, name] => {
            // A live consumer takes its pull requests on its own subscription; one that
            // does not exist answers like nobody is there, as the reference does.
            if js.consumer(stream, name).is_none() {
                let hdr = encode::status_headers("503", &[("Nats-Subject", m.subject.as_ref())]);
                reply_headers(server, router, &reply_to, hdr.to_vec(), b"");
            }
            return;
        }
        ["CONSUMER", "PAUSE", stream, name] => {
            js.api_total.fetch_add(1, Ordering::Relaxed);
            let r = match c::consumer_pause(js, stream, name, body) {
                // A replicated stream's followers have the new config before the answer.
                Ok(b) => super::cluster::replicate_consumer_change(
                    js,
                    stream,
                    "consumer_pause",
                    &tokens,
                    &b,
                )
                .await
                .map(|_| b),
                Err(e) => Err(e),
            };
            let body = r.unwrap_or_else(|e| {
                js.api_errors.fetch_add(1, Ordering::Relaxed);
                let zero = Value::from(rfc3339(0));
                error_response(
                    "consumer_pause",
                    &e,
                    &[("paused", false.into()), ("pause_until", zero)],
                )
            });
            reply(server, router, &reply_to, body);
            return;
        }
        ["CONSUMER", "UNPIN", stream, name] => (
            "consumer_unpin",
            encoded("consumer_unpin", c::consumer_unpin(js, stream, name, body)),
        ),
        // A clustered account's is the meta leader's (`cluster::api`).
        ["STREAM", "PEER", "REMOVE", _] => (
            "stream_remove_peer",
            Err(ErrorKind::ClusteringRequired.err()),
        ),
        ["STREAM", "LEADER", "STEPDOWN", name] => (
            "stream_leader_stepdown",
            super::cluster::leader_stepdown(js, server, name, None, body).map(|v| to_bytes(&v)),
        ),
        ["CONSUMER", "LEADER", "STEPDOWN", stream, name] => (
            "consumer_leader_stepdown",
            super::cluster::leader_stepdown(js, server, stream, Some(name), body)
                .map(|v| to_bytes(&v)),
        ),
        // A consumer answers its own resets (on its own subscription), as with the
        // reference: one that does not exist answers nothing.
        ["CONSUMER", "RESET", ..] => return,
        // Unknown API subjects get no reply at all, as with the reference.
        _ => return,
    };
    // A replicated stream's durable consumer exists on its followers (in the stream's
    // group) before its create or delete is confirmed.
    let result = match (kind, result) {
        ("consumer_create" | "consumer_delete", Ok(b)) => {
            let stream = tokens
                .get(if tokens.get(1) == Some(&"DURABLE") {
                    3
                } else {
                    2
                })
                .copied()
                .unwrap_or_default();
            super::cluster::replicate_consumer_change(js, stream, kind, &tokens, &b)
                .await
                .map(|_| b)
        }
        (_, r) => r,
    };
    // A request this server took as its stream's leader, failed while the group moved on
    // (a stepdown just answered, a failover): an idempotent one goes on to the new leader,
    // which answers it, instead of a 503.
    if let Err(e) = &result {
        if matches!(kind, "consumer_create" | "stream_update")
            && super::cluster::send_to_new_leader(js, server, &m, &tokens, kind, e)
        {
            return;
        }
    }
    js.api_total.fetch_add(1, Ordering::Relaxed);
    let body = result.unwrap_or_else(|e| {
        js.api_errors.fetch_add(1, Ordering::Relaxed);
        error_body(kind, &e)
    });
    let response = Bytes::from(body);
    reply(server, router, &reply_to, response.clone());
    advisory::api_audit(server, router, m.origin, &m.subject, m.payload(), &response);
}
