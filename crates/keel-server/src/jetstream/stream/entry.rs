//! `StreamEntry`: one change to a stream, as the leader decided it and every replica applies
//! it (`apply.rs`). Serializable: it is what issue 15's Raft log carries. An entry holds
//! everything its apply needs (the sequence and the leader's timestamp, the time up to which
//! max_age expires), so applying never reads a clock or picks a sequence.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::config::StreamConfig;

/// A message to store, at the sequence and time the leader chose.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MsgEntry {
    pub seq: u64,
    /// Nanoseconds since the Unix epoch.
    pub ts: i64,
    /// As stored (after the stream's subject transform).
    pub subject: Bytes,
    /// The header block as stored (`NATS/1.0\r\n...\r\n\r\n`), empty when none.
    pub hdr: Bytes,
    pub data: Bytes,
    /// A `Nats-Rollup` the stream honours: once stored, older messages go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollup: Option<Rollup>,
    /// `Nats-TTL: never`: kept out of max_age expiry.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_max_age: bool,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Rollup {
    /// Keep only this message of its subject.
    Sub,
    /// Keep only this message of the stream.
    All,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum StreamEntry {
    Msg(MsgEntry),
    /// STREAM.PURGE: all, or only `filter`, keeping the newest `keep`, or below `seq`.
    Purge {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        filter: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        keep: Option<u64>,
    },
    /// Message delete, TTL expiry, interest and work-queue retention: these sequences go
    /// (`erase` overwrites their bytes).
    Remove {
        seqs: Vec<u64>,
        erase: bool,
    },
    /// max_age expiry at the leader's time `ts` (followers never read their own clock).
    ExpireUpTo {
        ts: i64,
    },
    /// The next message gets `next` (the config's first_seq).
    SkipTo {
        next: u64,
    },
    /// A config update: the store takes its limits.
    Config(Box<StreamConfig>),
}
