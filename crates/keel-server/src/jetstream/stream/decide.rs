//! The leader's half: the checks a message gets before it is stored, in the reference's
//! order, turning a publish (or a sourced or mirrored copy) into a [`MsgEntry`] or an error
//! for the publisher. The only code that reads the clock or picks a sequence
//! (`seq = last + 1`, `ts = now`; a mirror keeps its origin's). What it needs to remember
//! (the duplicate window, the last `Nats-Msg-Id`, the TTL schedule, a storage outage) is
//! leader state, rebuilt from the store after a restart or a failed commit.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use keel_protocol::headers;
use keel_store::{Store, StoreError};

use super::config::StreamConfig;
use super::entry::{MsgEntry, Rollup, StreamEntry};
use crate::jetstream::api::{ApiError, ErrorKind};
use crate::jetstream::counter;
use crate::jetstream::republish::{self, Republisher};
use crate::jetstream::transform::Transform;
use crate::time::now_nanos;

/// How long publishes are refused after a storage failure before the next try.
const STORAGE_RETRY: Duration = Duration::from_secs(1);

/// Remembers `Nats-Msg-Id`s inside the duplicate window.
#[derive(Default)]
struct Dedup {
    ids: HashMap<String, u64>,
    order: VecDeque<(i64, String)>,
}

impl Dedup {
    fn prune(&mut self, now: i64, window: i64) {
        while let Some((ts, _)) = self.order.front() {
            if now - ts <= window {
                break;
            }
            let (_, id) = self.order.pop_front().expect("front exists");
            self.ids.remove(&id);
        }
    }
    fn insert(&mut self, id: String, seq: u64, ts: i64) {
        self.ids.insert(id.clone(), seq);
        self.order.push_back((ts, id));
    }
}

/// Where a message to store comes from: the decision differs (a sourced message was
/// checked by its origin; a mirrored one keeps its origin's sequence and time).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Intake {
    Publish,
    Sourced,
    Mirrored { seq: u64, ts: i64 },
}

/// The outcome of one publish.
pub enum PubResult {
    Stored(u64),
    /// Stored on a counter stream, with the subject's new total.
    Counted(u64, String),
    Duplicate(u64),
    Error(ApiError),
}

impl PubResult {
    pub fn stored(&self) -> bool {
        matches!(self, PubResult::Stored(_) | PubResult::Counted(..))
    }
}

/// What the leader records of a decided message once it is applied.
pub struct Decision {
    msg_id: Option<String>,
    /// `Nats-TTL` in seconds (0: none; negative: never).
    ttl: i64,
    /// A counter's new total.
    total: Option<String>,
    /// The subject's last sequence before this one (for republish).
    last_on_subject: u64,
}

impl Decision {
    /// What the publisher is told once the entry (stored at `seq`) is committed.
    pub fn result(&self, seq: u64) -> PubResult {
        match &self.total {
            Some(t) => PubResult::Counted(seq, t.clone()),
            None => PubResult::Stored(seq),
        }
    }
}

/// The leader's state of one stream.
#[derive(Default)]
pub struct Leader {
    dedup: Dedup,
    /// (expiry ns, seq) of messages published with a `Nats-TTL`.
    ttls: BTreeSet<(i64, u64)>,
    /// `Nats-Msg-Id` of the last stored message (for Nats-Expected-Last-Msg-Id).
    last_msg_id: String,
    /// After a storage failure (the store rolled back what was not yet durable):
    /// publishes are refused with the reason until the instant, then tried again, so a
    /// full disk recovers without a restart and is not hammered meanwhile.
    storage_down: Option<(Instant, String)>,
    /// A store write in the current batch failed: the batch must be rolled back.
    pub io_error: bool,
    /// `subject_transform`, applied to every message before anything else.
    input_tr: Option<Transform>,
    republisher: Option<Republisher>,
    /// Republishes decided for stored messages, sent once their batch is committed.
    republish_out: Vec<republish::Pending>,
}

impl Leader {
    pub fn new(cfg: &StreamConfig) -> Leader {
        let mut l = Leader::default();
        l.compile(cfg);
        l
    }

    /// Compiles what the config implies for the write path (an update recompiles).
    pub fn compile(&mut self, cfg: &StreamConfig) {
        self.input_tr = cfg
            .subject_transform
            .as_ref()
            .and_then(|t| Transform::new(&t.src, &t.dest).ok().flatten());
        self.republisher = Republisher::new(cfg);
    }

    /// Rebuilds what the leader remembers from the store (after a restart, or after a
    /// failed commit rolled the store back): the duplicate window, the last msg id, the
    /// TTL schedule; and marks `Nats-TTL: never` messages exempt again (the store keeps
    /// that in memory only).
    pub fn rebuild(&mut self, cfg: &StreamConfig, store: &mut dyn Store) {
        self.dedup = Dedup::default();
        self.ttls.clear();
        self.last_msg_id.clear();
        self.rebuild_dedup(cfg, store);
        self.rebuild_ttls(cfg, store);
    }

    /// The messages that carry a `Nats-TTL` (only streams that allow them; only messages
    /// with headers are read).
    fn rebuild_ttls(&mut self, cfg: &StreamConfig, store: &mut dyn Store) {
        // Sourced copies may carry `Nats-TTL: never` even where TTLs are off.
        let sourced = cfg.mirror.is_some() || !cfg.sources.is_empty();
        if !cfg.allow_msg_ttl && !sourced {
            return;
        }
        let mut at = store.state().first_seq.max(1);
        while let Some(seq) = store.next_with_headers(at) {
            at = seq + 1;
            if let Ok(m) = store.load(seq) {
                if let Some(secs) = headers::get_str(&m.hdr, "Nats-TTL").and_then(parse_ttl) {
                    if secs > 0 && cfg.allow_msg_ttl {
                        self.ttls.insert((m.ts + secs * 1_000_000_000, seq));
                    } else if secs < 0 {
                        store.exempt_from_max_age(seq);
                    }
                }
            }
        }
    }

    /// The duplicate-window map from the newest messages. The store skips what has no
    /// headers (no `Nats-Msg-Id`) without reading it, so a long stream published within the
    /// window costs what its messages with headers cost.
    fn rebuild_dedup(&mut self, cfg: &StreamConfig, store: &dyn Store) {
        let state = store.state();
        let window = cfg.duplicate_window;
        let min_ts = now_nanos().saturating_sub(window);
        let mut before = state.last_seq.saturating_add(1);
        let mut found = vec![];
        while let Some((seq, _)) = store.prev_with_headers(before, min_ts) {
            before = seq;
            if let Ok(m) = store.load(seq) {
                if let Some(id) = headers::get_str(&m.hdr, "Nats-Msg-Id") {
                    found.push((m.ts, id.to_string(), m.seq));
                }
                if seq == state.last_seq {
                    self.last_msg_id = headers::get_str(&m.hdr, "Nats-Msg-Id")
                        .unwrap_or_default()
                        .to_string();
                }
            }
        }
        for (ts, id, seq) in found.into_iter().rev() {
            self.dedup.insert(id, seq, ts);
        }
    }

    pub fn has_ttls(&self) -> bool {
        !self.ttls.is_empty()
    }

    /// Takes the sequences whose `Nats-TTL` has passed at `now`.
    pub fn take_expired_ttls(&mut self, now: i64) -> Vec<u64> {
        let mut out = vec![];
        while let Some(&(at, seq)) = self.ttls.first() {
            if at > now {
                break;
            }
            self.ttls.pop_first();
            out.push(seq);
        }
        out
    }

    /// The leader's clock, for what it decides besides messages (expiry).
    pub fn now(&self) -> i64 {
        now_nanos()
    }

    /// The subject a message is stored under (after `subject_transform`).
    pub fn stored_subject(&self, subject: &Bytes) -> Bytes {
        match (&self.input_tr, std::str::from_utf8(subject)) {
            (Some(t), Ok(s)) => t
                .apply(s)
                .map(Bytes::from)
                .unwrap_or_else(|| subject.clone()),
            _ => subject.clone(),
        }
    }

    /// Takes the republishes of what was stored since the last call; none after a failed
    /// commit (those messages were not acknowledged and may not exist).
    pub fn take_republish(&mut self) -> Vec<republish::Pending> {
        let out = std::mem::take(&mut self.republish_out);
        if self.storage_down.is_some() {
            return Vec::new();
        }
        out
    }

    /// Refuses new messages while storage is down (a failed commit, for a moment).
    pub fn storage_refusal(&self) -> Option<ApiError> {
        let (until, why) = self.storage_down.as_ref()?;
        (Instant::now() < *until).then(|| ErrorKind::StoreFailed.with(why))
    }

    /// What a commit's outcome means for the stream. On failure the store has rolled back
    /// to its last completed sync: `refuse` turns the batch's results into errors, and
    /// publishes are refused for a moment before the next try. True when it failed.
    pub fn storage_result(
        &mut self,
        log: &crate::log::Log,
        stream: &str,
        r: &Result<(), StoreError>,
        stored: usize,
        uncertain: bool,
        refuse: impl FnOnce(&str),
    ) -> bool {
        self.io_error = false;
        match r {
            Ok(()) => {
                // A commit of publishes that were all refused wrote nothing: it proves
                // nothing, and must not cut the refusal short (each batch would try the
                // full disk again, logging twice, instead of once a second).
                let over = self
                    .storage_down
                    .as_ref()
                    .is_some_and(|(until, _)| Instant::now() >= *until);
                if (stored > 0 || over) && self.storage_down.take().is_some() {
                    crate::info!(log, "Stream {stream}: storage writable again");
                }
                false
            }
            Err(e) => {
                let text = e.to_string();
                if uncertain {
                    crate::warn!(
                        log,
                        "Stream {stream}: a batch was not committed in time; its {stored} publishes are answered once it is known whether it was"
                    );
                } else if self.storage_down.is_none() {
                    crate::error!(
                        log,
                        "Stream {stream}: {text}; {stored} publishes of this batch were not stored and got an error; retrying every {:?}",
                        STORAGE_RETRY
                    );
                }
                refuse(&text);
                self.storage_down = Some((Instant::now() + STORAGE_RETRY, text));
                true
            }
        }
    }

    /// Decides on one message: the checks a client publish gets (a sourced or mirrored
    /// one skips those its origin made), then the sequence, time and headers it is stored
    /// with. `budget`: bytes the stream may still hold under the server-wide store limit.
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        &mut self,
        cfg: &StreamConfig,
        store: &dyn Store,
        subject: &Bytes,
        hdr: Bytes,
        data: Bytes,
        intake: Intake,
        budget: Option<u64>,
    ) -> Result<(MsgEntry, Decision), PubResult> {
        let fail = |e: ApiError| Err(PubResult::Error(e));
        if let Some(b) = budget {
            // As the reference: refused once usage has reached the limit (the message
            // that crosses it is still taken).
            if store.state().bytes >= b {
                return fail(match cfg.storage {
                    super::StorageType::Memory => ErrorKind::InsufficientMemory.err(),
                    super::StorageType::File => ErrorKind::InsufficientStorage.err(),
                });
            }
        }
        if let Some(e) = self.storage_refusal() {
            return fail(e);
        }
        let publish = intake == Intake::Publish;
        if cfg.sealed {
            return fail(ErrorKind::Sealed.err());
        }
        let subject = self.stored_subject(subject);
        let last_seq = store.last_seq();
        if let Intake::Mirrored { seq, .. } = intake {
            if seq <= last_seq {
                return Err(PubResult::Duplicate(seq));
            }
        }
        if cfg.max_msg_size >= 0 && (hdr.len() + data.len()) as i64 > cfg.max_msg_size as i64 {
            return fail(ErrorKind::MessageTooLarge.err());
        }
        if hdr.len() > 64 * 1024 {
            return fail(ErrorKind::HeaderTooLarge.err());
        }
        let now = now_nanos();
        let mut msg_id = None;
        let mut ttl = 0i64;
        let incr = match counter::increment(&hdr) {
            Ok(i) => i,
            Err(e) => return fail(e),
        };
        if incr.is_some() && publish {
            if !cfg.allow_msg_counter {
                return fail(counter::disabled());
            }
            if !data.is_empty() {
                return fail(counter::has_payload());
            }
            if counter::conflicting_headers(&hdr) {
                return fail(counter::invalid());
            }
        }
        let mut rollup = None;
        if !hdr.is_empty() {
            if publish {
                if let Some(exp) = headers::get(&hdr, "Nats-Expected-Stream") {
                    if exp != cfg.name.as_bytes() {
                        return fail(ErrorKind::ExpectedStreamMismatch.err());
                    }
                }
                // Only the sourcing path may write this header (the reference's rule).
                if headers::get(&hdr, "Nats-Stream-Source").is_some_and(|v| !v.is_empty()) {
                    return fail(ErrorKind::StreamSourceHeader.err());
                }
            }
            // A mirror keeps every message of its origin: it does not deduplicate.
            if !matches!(intake, Intake::Mirrored { .. }) {
                if let Some(id) = headers::get_str(&hdr, "Nats-Msg-Id").filter(|s| !s.is_empty()) {
                    self.dedup.prune(now, cfg.duplicate_window);
                    if let Some(&seq) = self.dedup.ids.get(id) {
                        return Err(PubResult::Duplicate(seq));
                    }
                    msg_id = Some(id.to_string());
                }
            }
            if publish {
                if let Some(exp) = headers::get(&hdr, "Nats-Expected-Last-Sequence") {
                    if parse_u64(exp) != Some(last_seq) {
                        return fail(ErrorKind::WrongLastSequence.with(last_seq));
                    }
                }
                if let Some(exp) = headers::get_str(&hdr, "Nats-Expected-Last-Msg-Id") {
                    if exp != self.last_msg_id {
                        return fail(ErrorKind::WrongLastMsgId.with(&self.last_msg_id));
                    }
                }
                if let Some(exp) = headers::get(&hdr, "Nats-Expected-Last-Subject-Sequence") {
                    let subj =
                        headers::get_str(&hdr, "Nats-Expected-Last-Subject-Sequence-Subject")
                            .map(str::to_string)
                            .unwrap_or_else(|| String::from_utf8_lossy(&subject).into_owned());
                    let last = store.last_seq_for_subject(&subj);
                    if parse_u64(exp) != Some(last) {
                        return fail(ErrorKind::WrongLastSequence.with(last));
                    }
                }
            }
            if let Some(roll) = headers::get_str(&hdr, "Nats-Rollup") {
                if publish && !cfg.allow_rollup_hdrs {
                    return fail(ErrorKind::RollupFailed.with("rollup not permitted"));
                }
                rollup = match roll {
                    "sub" => Some(Rollup::Sub),
                    "all" => Some(Rollup::All),
                    _ => {
                        return fail(
                            ErrorKind::RollupFailed.with(format!("rollup value invalid: {roll:?}")),
                        )
                    }
                };
            }
            if let Some(v) = headers::get_str(&hdr, "Nats-TTL") {
                if publish && !cfg.allow_msg_ttl {
                    return fail(ErrorKind::MsgTtlDisabled.err());
                }
                match parse_ttl(v) {
                    Some(secs) => ttl = secs,
                    None => return fail(ErrorKind::MsgTtlInvalid.err()),
                }
            }
        }
        // A counter stores the subject's new total instead of what was published.
        let (mut hdr, data, total) = match incr {
            None if cfg.allow_msg_counter => return fail(counter::missing()),
            Some(incr) if cfg.allow_msg_counter => {
                let last = std::str::from_utf8(&subject)
                    .ok()
                    .and_then(|s| store.load_last(s).ok());
                match counter::next(
                    last.as_ref().map(|m| (&m.hdr[..], &m.data[..])),
                    &hdr,
                    &data,
                    incr,
                ) {
                    Ok((h, d, t)) => {
                        if cfg.max_msg_size >= 0
                            && (h.len() + d.len()) as i64 > cfg.max_msg_size as i64
                        {
                            return fail(ErrorKind::MessageTooLarge.err());
                        }
                        (Bytes::from(h), Bytes::from(d), Some(t))
                    }
                    Err(e) => return fail(e),
                }
            }
            _ => (hdr, data, None),
        };
        // With delete markers a TTL is at least the marker TTL (so a marker left for the
        // subject cannot outlive a newer message), and the stored header says so.
        let sdm = cfg.subject_delete_marker_ttl / 1_000_000_000;
        if ttl > 0 && sdm > 0 && cfg.max_msgs_per_subject != 1 && ttl < sdm {
            ttl = sdm;
            hdr = Bytes::from(crate::jetstream::expiry::with_ttl_header(&hdr, sdm));
        }
        let last_on_subject = match &self.republisher {
            Some(_) => std::str::from_utf8(&subject)
                .map(|s| store.last_seq_for_subject(s))
                .unwrap_or(0),
            None => 0,
        };
        let (seq, ts) = match intake {
            Intake::Mirrored { seq, ts } => (seq, ts),
            _ => (last_seq + 1, now),
        };
        // The rollup takes effect only where purges are allowed.
        let rollup = rollup.filter(|_| cfg.allow_rollup_hdrs && !cfg.deny_purge);
        Ok((
            MsgEntry {
                seq,
                ts,
                subject,
                hdr,
                data,
                rollup,
                no_max_age: ttl < 0,
            },
            Decision {
                msg_id,
                ttl,
                total,
                last_on_subject,
            },
        ))
    }

    /// Records what an applied message means for the leader: its msg id in the window,
    /// its TTL in the schedule, its republish.
    pub fn record(&mut self, cfg: &StreamConfig, m: &MsgEntry, d: &Decision) {
        if d.ttl > 0 && cfg.allow_msg_ttl {
            self.ttls.insert((m.ts + d.ttl * 1_000_000_000, m.seq));
        }
        self.last_msg_id = d.msg_id.clone().unwrap_or_default();
        if let Some(id) = &d.msg_id {
            self.dedup.insert(id.clone(), m.seq, m.ts);
        }
        if let Some(rp) = &self.republisher {
            if let Some(p) = rp.prepare(
                &cfg.name,
                &m.subject,
                &m.hdr,
                &m.data,
                m.seq,
                m.ts,
                d.last_on_subject,
            ) {
                self.republish_out.push(p);
            }
        }
    }
}

/// STREAM.PURGE as the leader decides it (the reference's checks, in its order).
pub fn decide_purge(cfg: &StreamConfig, req: &keel_store::Purge) -> Result<StreamEntry, ApiError> {
    if cfg.sealed {
        return Err(ErrorKind::Sealed.err());
    }
    if cfg.deny_purge {
        return Err(ErrorKind::PurgeFailed.with("stream purge not permitted"));
    }
    if req.seq.is_some() && req.keep.is_some() {
        return Err(ErrorKind::BadRequest.err());
    }
    if let Some(f) = &req.filter {
        if !f.is_empty() && !keel_protocol::subject::valid_subscribe(f.as_bytes()) {
            return Err(ErrorKind::PurgeFailed.with("invalid subject filter"));
        }
    }
    Ok(StreamEntry::Purge {
        filter: req.filter.clone().filter(|f| !f.is_empty()),
        seq: req.seq,
        keep: req.keep,
    })
}

/// STREAM.MSG.DELETE as the leader decides it.
pub fn decide_delete(cfg: &StreamConfig, seq: u64, erase: bool) -> Result<StreamEntry, ApiError> {
    if cfg.sealed {
        return Err(ErrorKind::Sealed.err());
    }
    if cfg.deny_delete {
        return Err(ErrorKind::MsgDeleteFailed.with("message delete not permitted"));
    }
    Ok(StreamEntry::Remove {
        seqs: vec![seq],
        erase,
    })
}

/// `Nats-TTL` as the reference reads it: `never` (no expiry, -1), a Go duration of at least
/// one second, or whole seconds; None when invalid.
pub fn parse_ttl(v: &str) -> Option<i64> {
    if v.eq_ignore_ascii_case("never") {
        return Some(-1);
    }
    if let Ok(d) = crate::conf::parse_duration(v) {
        if v.chars().any(|c| c.is_ascii_alphabetic()) {
            return (d >= Duration::from_secs(1)).then_some(d.as_secs() as i64);
        }
    }
    v.parse::<i64>().ok().filter(|s| *s >= 0)
}

fn parse_u64(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b).ok()?.trim().parse().ok()
}

/// A store's refusal as the API reports it.
pub fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::MaxMsgs | StoreError::MaxMsgsPerSubject | StoreError::MaxBytes => {
            ErrorKind::StoreFailed.with(e)
        }
        StoreError::MsgTooLarge => ErrorKind::MessageTooLarge.err(),
        StoreError::NotFound => ErrorKind::NoMessageFound.err(),
        StoreError::Io(t) => ErrorKind::StoreFailed.with(t),
        e @ (StoreError::Sequence { .. } | StoreError::Unsupported(_)) => {
            ErrorKind::StoreFailed.with(e)
        }
    }
}
