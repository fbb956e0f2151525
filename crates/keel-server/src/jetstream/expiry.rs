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
//! The stream's actor decides, as leader, at its own clock: which messages expire and which
//! become markers. The decisions are entries (`ExpireUpTo` with the leader's time, `Remove`,
//! a marker's `Msg`), so a replica applying them never reads its own clock; markers are
//! committed before consumers see them or anything is republished.

use bytes::Bytes;
use keel_protocol::headers;
use keel_store::Store;

use super::stream::actor::Core;
use super::stream::entry::StreamEntry;
use super::stream::parse_ttl;
use super::stream::replicator::Replicator;
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

/// Decides what has expired at the leader's time `now` and proposes it: max_age as one
/// `ExpireUpTo { ts: now }` (the store skips `Nats-TTL: never`), due TTLs as `Remove`; with
/// delete markers, per expiring message whether a marker replaces it (only the last of its
/// subject gets one). Returns whether markers were stored (they are committed before anyone
/// sees them).
pub(crate) fn expire<R: Replicator>(core: &mut Core<R>, store: &mut dyn Store, now: i64) -> bool {
    let sdm = core.cfg.subject_delete_marker_ttl;
    let max_age = core.cfg.max_age;
    if sdm <= 0 {
        if max_age > 0 {
            core.propose_own(store, StreamEntry::ExpireUpTo { ts: now });
        }
        if core.leader.has_ttls() {
            let due = core.leader.take_expired_ttls(now);
            if !due.is_empty() {
                core.propose_own(
                    store,
                    StreamEntry::Remove {
                        seqs: due,
                        erase: false,
                    },
                );
            }
        }
        return false;
    }
    // Markers: collect what is due, in sequence order, then decide one by one so that of
    // several expiring messages of a subject only the last leaves a marker.
    let mut due = core.leader.take_expired_ttls(now);
    if max_age > 0 {
        let cutoff = now - max_age;
        let mut seq = store.state().first_seq.max(1);
        while let Ok(m) = store.load_next(seq, ">") {
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
        let Ok(m) = store.load(seq) else {
            continue;
        };
        let subject = String::from_utf8_lossy(&m.subject).into_owned();
        let last = store.subjects(&subject).get(&subject).copied() == Some(1);
        let remove = StreamEntry::Remove {
            seqs: vec![seq],
            erase: false,
        };
        // The marker's rollup removes the expired message.
        if last
            && !is_marker(&m.hdr)
            && core.publish_marker(
                store,
                Bytes::copy_from_slice(&m.subject),
                marker_headers(sdm),
            )
        {
            marked = true;
            if store.load(seq).is_ok() {
                core.propose_own(store, remove);
            }
            continue;
        }
        core.propose_own(store, remove);
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
