//! `STREAM.MSG.GET`, `STREAM.MSG.DELETE` and `DIRECT.GET`. Gets read through the stream's
//! read handle (they never wait behind its actor's fsync); a delete is the actor's, answered
//! once committed.

use base64::Engine;
use bytes::Bytes;
use keel_protocol::encode;
use keel_store::{Store, StoreError, StoredMsg};
use serde_json::Value;

use super::types::{
    MsgDeleteRequest, MsgGetRequest, MsgGetResponse, StoredMessage, SuccessResponse,
};
use super::{normalize, parse_request, reply_headers, ApiError, ErrorKind};
use crate::jetstream::{schema, stream, JetStream};
use crate::router::Router;
use crate::server::Server;
use crate::time::rfc3339;

fn load_for_get(store: &dyn Store, req: &MsgGetRequest) -> Result<StoredMsg, StoreError> {
    match (req.seq, &req.last_by_subj, &req.next_by_subj) {
        (Some(seq), None, None) => store.load(seq),
        (seq, None, Some(subj)) => store.load_next(seq.unwrap_or(0).max(1), subj),
        (None, Some(subj), None) => store.load_last(subj),
        _ => Err(StoreError::NotFound),
    }
}

pub fn get(js: &JetStream, name: &str, body: &[u8]) -> Result<MsgGetResponse, ApiError> {
    let req: MsgGetRequest = parse_request(body, &schema::MSG_GET, js.strict)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let valid = matches!(
        (
            req.seq.is_some(),
            req.last_by_subj.is_some(),
            req.next_by_subj.is_some()
        ),
        (true, false, false) | (false, true, false) | (_, false, true)
    );
    if !valid {
        return Err(ErrorKind::BadRequest.err());
    }
    let msg = load_for_get(&*s.read(), &req).map_err(|_| ErrorKind::NoMessageFound.err())?;
    let b64 = base64::engine::general_purpose::STANDARD;
    Ok(MsgGetResponse {
        message: StoredMessage {
            subject: String::from_utf8_lossy(&msg.subject).into_owned(),
            seq: msg.seq,
            hdrs: (!msg.hdr.is_empty()).then(|| b64.encode(&msg.hdr)),
            data: (!msg.data.is_empty()).then(|| b64.encode(&msg.data)),
            time: rfc3339(msg.ts),
        },
    })
}

pub async fn delete(js: &JetStream, name: &str, body: &[u8]) -> Result<SuccessResponse, ApiError> {
    let req: MsgDeleteRequest = parse_request(body, &schema::MSG_DELETE, js.strict)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    // The actor decides (sealed, deny_delete, whether it is there) and answers once the
    // removal is committed.
    s.ask(|reply| stream::Command::DeleteMsg {
        seq: req.seq,
        erase: !req.no_erase,
        reply,
    })
    .await
    .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()))?;
    Ok(SuccessResponse { success: true })
}

fn status(code: &str) -> Vec<u8> {
    format!("NATS/1.0 {code}\r\n\r\n").into_bytes()
}

/// `$JS.API.DIRECT.GET.<stream>[.<subject>]`: the message itself with the stream's headers,
/// or a status (404, 408, 400; 503 when nobody serves direct gets for the stream).
pub fn direct_get(
    js: &JetStream,
    server: &Server,
    router: &mut Router,
    reply_to: &Bytes,
    name: &str,
    subject: Option<&str>,
    body: &[u8],
) {
    // A caught-up mirror with mirror_direct answers for its origin when the origin cannot.
    let s = js
        .stream(name)
        .filter(|s| s.config().allow_direct)
        .or_else(|| {
            js.streams()
                .into_iter()
                .find(|m| m.serves_mirror_direct(name))
        });
    let Some(s) = s else {
        // Nobody serves direct gets for this stream: the no-responders status.
        let hdr = encode::status_headers("503", &[]);
        reply_headers(server, router, reply_to, hdr.to_vec(), b"");
        return;
    };
    let req = match subject {
        Some(subj) => MsgGetRequest {
            last_by_subj: Some(subj.to_string()),
            ..Default::default()
        },
        None if body.iter().all(|b| b.is_ascii_whitespace()) => {
            reply_headers(server, router, reply_to, status("408 Empty Request"), b"");
            return;
        }
        None => match serde_json::from_slice::<Value>(body).map(|mut v| {
            // Parsed leniently, as the reference does; `null` is absent.
            let _ = normalize(&mut v, &schema::MSG_GET, false);
            v
        }) {
            Ok(v) if v.get("batch").is_some() || v.get("multi_last").is_some() => {
                reply_headers(server, router, reply_to, status("400 Bad Request"), b"");
                return;
            }
            Ok(v) => match serde_json::from_value::<MsgGetRequest>(v) {
                Ok(r) => r,
                Err(_) => {
                    reply_headers(server, router, reply_to, status("400 Bad Request"), b"");
                    return;
                }
            },
            Err(_) => {
                reply_headers(server, router, reply_to, status("400 Bad Request"), b"");
                return;
            }
        },
    };
    let msg = load_for_get(&*s.read(), &req);
    let Ok(msg) = msg else {
        reply_headers(
            server,
            router,
            reply_to,
            status("404 Message Not Found"),
            b"",
        );
        return;
    };
    // Original headers first (without their blank line), then the stream's.
    let mut hdr: Vec<u8> = if msg.hdr.is_empty() {
        b"NATS/1.0\r\n".to_vec()
    } else {
        msg.hdr[..msg.hdr.len().saturating_sub(2)].to_vec()
    };
    hdr.extend_from_slice(
        format!(
            "Nats-Stream: {}\r\nNats-Subject: {}\r\nNats-Sequence: {}\r\nNats-Time-Stamp: {}\r\n\r\n",
            s.name,
            String::from_utf8_lossy(&msg.subject),
            msg.seq,
            rfc3339(msg.ts)
        )
        .as_bytes(),
    );
    reply_headers(server, router, reply_to, hdr, &msg.data);
}
