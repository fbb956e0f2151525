//! Expiry on the maintenance timer: `max_age`, per-message `Nats-TTL`, and subject delete
//! markers (`subject_delete_marker_ttl`).
//!
//! With delete markers, a message that max_age or its TTL removes and that is the last one
//! of its subject is not simply removed: a marker takes its place, an empty message on that
//! subject with `Nats-Marker-Reason: MaxAge`, `Nats-TTL: <marker ttl>` and
//! `Nats-Rollup: sub` (which removes the expired message), stored and delivered like any
//! other, and expiring in turn without a marker of its own. This is the reference's
//! behaviour, headers and reason included (it says `MaxAge` for TTL expiry too).
//!
//! The decision (which messages expire, which become markers) and the writes happen under
//! the stream lock in one pass; markers are synced before consumers see them or anything is
//! republished.

use std::sync::Arc;

use bytes::Bytes;
use keel_protocol::headers;

use super::stream::{parse_ttl, Intake, StorageType, Stream, StreamInner};
use crate::router::Router;
use crate::server::Server;
use crate::time::go_duration;

/// `hdr` with every `Nats-TTL` replaced by one `Nats-TTL: <secs>` at the end (the
/// reference's rewrite when it raises a TTL to the marker TTL).
pub fn with_ttl_header(hdr: &[u8], secs: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(hdr.len() + 24);
    let body = if hdr.len() >= 4 {
        &hdr[..hdr.len() - 2]
    } else {
        b"NATS/1.0\r\n"
    };
    let mut lines = body.split_inclusive(|b| *b == b'\n');
    if let Some(first) = lines.next() {
        out.extend_from_slice(first);
    }
    for line in lines {
        if line.starts_with(b"Nats-TTL:") {
            continue;
        }
        out.extend_from_slice(line);
    }
    out.extend_from_slice(format!("Nats-TTL: {secs}\r\n\r\n").as_bytes());
    out
}

/// Is this message a delete marker (a marker reason, or a KV purge)?
pub fn is_marker(hdr: &[u8]) -> bool {
    headers::get(hdr, "Nats-Marker-Reason").is_some_and(|v| !v.is_empty())
        || headers::get(hdr, "KV-Operation") == Some(b"PURGE")
}

fn marker_headers(ttl_ns: i64) -> Vec<u8> {
    format!(
        "NATS/1.0\r\nNats-Marker-Reason: MaxAge\r\nNats-TTL: {}\r\nNats-Rollup: sub\r\n\r\n",
        go_duration(ttl_ns / 1_000_000_000 * 1_000_000_000)
    )
    .into_bytes()
}

/// True when the message is `Nats-TTL: never` (exempt from max_age).
fn never_expires(hdr: &[u8]) -> bool {
    headers::get_str(hdr, "Nats-TTL")
        .and_then(parse_ttl)
        .is_some_and(|t| t < 0)
}

impl Stream {
    /// One maintenance pass at `now` (ns).
    pub fn run_expiry(&self, server: &Arc<Server>, router: &mut Router, now: i64) {
        let marked = {
            let mut inner = self.lock();
            let marked = expire(&server.log, &mut inner, now);
            if marked && self.storage == StorageType::File {
                if let Err(e) = inner.store.sync() {
                    crate::error!(server.log, "Stream {}: storage sync failed: {e}", self.name);
                }
            }
            self.refresh_bytes(&inner);
            marked
        };
        if marked {
            self.after_commit(server, router);
        }
    }
}

/// Expires what is due; returns whether delete markers were written.
fn expire(log: &crate::log::Log, inner: &mut StreamInner, now: i64) -> bool {
    let sdm = inner.config.subject_delete_marker_ttl;
    let max_age = inner.config.max_age;
    if sdm <= 0 {
        if max_age > 0 {
            if let Err(e) = inner.store.expire(now) {
                crate::error!(log, "Stream {}: expiry failed: {e}", inner.config.name);
            }
        }
        if inner.has_ttls() {
            inner.expire_ttls(now);
        }
        return false;
    }
    // Markers: collect what is due, in sequence order, then decide one by one so that of
    // several expiring messages of a subject only the last leaves a marker.
    let mut due = inner.take_expired_ttls(now);
    if max_age > 0 {
        let cutoff = now - max_age;
        let mut seq = inner.store.state().first_seq.max(1);
        while let Ok(m) = inner.store.load_next(seq, ">") {
            if m.ts > cutoff {
                break;
            }
            seq = m.seq + 1;
            if !never_expires(&m.hdr) {
                due.push(m.seq);
            }
        }
    }
    due.sort_unstable();
    due.dedup();
    let mut marked = false;
    for seq in due {
        let Ok(m) = inner.store.load(seq) else {
            continue;
        };
        let subject = String::from_utf8_lossy(&m.subject).into_owned();
        let last = inner.store.subjects(&subject).get(&subject).copied() == Some(1);
        if last && !is_marker(&m.hdr) {
            let hdr = marker_headers(sdm);
            let subj = Bytes::copy_from_slice(&m.subject);
            // The marker's rollup removes the expired message.
            if inner
                .process_parts(&subj, &hdr, b"", Intake::Publish)
                .stored()
            {
                marked = true;
                if inner.store.load(seq).is_ok() {
                    let _ = inner.store.remove(seq, false);
                }
                continue;
            }
        }
        let _ = inner.store.remove(seq, false);
    }
    marked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers() {
        assert_eq!(
            with_ttl_header(b"NATS/1.0\r\nNats-TTL: 1s\r\nNats-Rollup: sub\r\n\r\n", 60),
            b"NATS/1.0\r\nNats-Rollup: sub\r\nNats-TTL: 60\r\n\r\n"
        );
        assert_eq!(
            marker_headers(60_000_000_000),
            b"NATS/1.0\r\nNats-Marker-Reason: MaxAge\r\nNats-TTL: 1m0s\r\nNats-Rollup: sub\r\n\r\n"
        );
        assert!(is_marker(&marker_headers(1_000_000_000)));
        assert!(is_marker(b"NATS/1.0\r\nKV-Operation: PURGE\r\n\r\n"));
        assert!(!is_marker(b"NATS/1.0\r\nKV-Operation: DEL\r\n\r\n"));
        assert!(never_expires(b"NATS/1.0\r\nNats-TTL: never\r\n\r\n"));
    }
}
