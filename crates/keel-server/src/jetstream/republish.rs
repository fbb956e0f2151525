//! Republish (`republish { src, dest, headers_only }`): every stored message whose subject
//! matches `src` is published again on the transformed subject, with the reference's headers
//! (`Nats-Stream`, `Nats-Subject`, `Nats-Sequence`, `Nats-Time-Stamp`, `Nats-Last-Sequence`,
//! and `Nats-Msg-Size` instead of the payload with `headers_only`).
//!
//! Split in two so the stream's writer stays deterministic: [`Republisher::prepare`] decides
//! (while the message is stored, under the stream lock) what goes out; [`publish`] sends it
//! through the router, only after the batch holding those messages is synced.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::api::{ApiError, ErrorKind};
use super::stream::{subjects_overlap, StreamConfig};
use super::transform::Transform;
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::time::rfc3339;

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct RePublish {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub src: String,
    #[serde(default)]
    pub dest: String,
    #[serde(default, skip_serializing_if = "is_false")]
    pub headers_only: bool,
}

/// The create/update checks of the reference, in its order; fills in the default source.
pub fn check(cfg: &mut StreamConfig) -> Result<(), ApiError> {
    let subjects = cfg.subjects.clone();
    let transform = cfg.subject_transform.clone();
    let Some(rp) = cfg.republish.as_mut() else {
        return Ok(());
    };
    if rp.src.is_empty() {
        rp.src = ">".into();
    }
    // `>` to `>` with a transform of the only subject republishes the transformed subjects.
    if rp.src == ">" && rp.dest == ">" {
        if let Some(t) = transform.filter(|t| subjects.len() == 1 && t.src == subjects[0]) {
            rp.src = t.dest.clone();
            rp.dest = t.dest;
        }
    }
    if subjects.iter().any(|s| subjects_overlap(&rp.dest, s)) {
        return Err(ErrorKind::InvalidConfig
            .with("stream configuration for republish destination forms a cycle"));
    }
    if Transform::new(&rp.src, &rp.dest).is_err() {
        return Err(ErrorKind::InvalidConfig.with(format!(
            "stream configuration for republish with transform from '{}' to '{}' not valid",
            rp.src, rp.dest
        )));
    }
    Ok(())
}

/// A compiled `republish`.
pub struct Republisher {
    tr: Transform,
    headers_only: bool,
}

/// One message to republish once its batch is committed.
pub struct Pending {
    pub subject: Bytes,
    pub hdr_len: usize,
    pub data: Bytes,
}

impl Republisher {
    /// None when the config republishes nothing (no `republish`, or an empty destination).
    pub fn new(cfg: &StreamConfig) -> Option<Republisher> {
        let rp = cfg.republish.as_ref()?;
        let tr = Transform::new(&rp.src, &rp.dest).ok()??;
        Some(Republisher {
            tr,
            headers_only: rp.headers_only,
        })
    }

    /// What to publish for a message just stored as `seq` at `ts`; `last_seq` is the
    /// previous sequence on the same subject (0 if none), for gap detection by clients.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare(
        &self,
        stream: &str,
        subject: &[u8],
        hdr: &[u8],
        data: &[u8],
        seq: u64,
        ts: i64,
        last_seq: u64,
    ) -> Option<Pending> {
        let subj = std::str::from_utf8(subject).ok()?;
        let to = self.tr.apply(subj)?;
        // A destination that is not a valid publish subject is suppressed, as the reference.
        if !keel_protocol::subject::valid_publish(to.as_bytes()) {
            return None;
        }
        let mut out =
            Vec::with_capacity(hdr.len() + 160 + if self.headers_only { 0 } else { data.len() });
        if hdr.len() >= 4 {
            out.extend_from_slice(&hdr[..hdr.len() - 2]);
        } else {
            out.extend_from_slice(b"NATS/1.0\r\n");
        }
        use std::io::Write;
        let _ = write!(
            out,
            "Nats-Stream: {stream}\r\nNats-Subject: {subj}\r\nNats-Sequence: {seq}\r\nNats-Time-Stamp: {}\r\nNats-Last-Sequence: {last_seq}\r\n",
            rfc3339(ts)
        );
        if self.headers_only {
            let _ = write!(out, "Nats-Msg-Size: {}\r\n", data.len());
        }
        out.extend_from_slice(b"\r\n");
        let hdr_len = out.len();
        if !self.headers_only {
            out.extend_from_slice(data);
        }
        Some(Pending {
            subject: Bytes::from(to),
            hdr_len,
            data: Bytes::from(out),
        })
    }
}

/// Sends committed republishes (after the sync, never before).
pub fn publish(server: &Server, router: &mut Router, pending: Vec<Pending>) {
    if pending.is_empty() {
        return;
    }
    for p in &pending {
        router.route(
            server,
            &Outgoing {
                subject: &p.subject,
                reply: None,
                hdr_len: Some(p.hdr_len),
                data: &p.data,
            },
            None,
        );
    }
    router.flush();
}
