//! Sources and mirrors between streams of this server, or of its cluster (an origin with
//! no replica here is read from a server that has one: `remote_origin`).
//!
//! Each source (and a mirror) is an internal reader of its origin stream, one task each: it
//! takes the origin's lock only to read the next messages past its position (filtered),
//! releases it, decides what the target stores (the subject transformed, the reference's
//! `Nats-Stream-Source` header for a source; the origin's sequence and time for a mirror) and
//! hands the batch to the target's actor (its only writer) through a bounded queue, then waits for the
//! commit. No stream lock is ever taken inside another stream's lock; the origin wakes its
//! readers with a watch of its last committed sequence.
//!
//! Crash safety: the position is never kept anywhere the commit does not reach first. A
//! mirror's position is its own last sequence (it stores at the origin's sequences, skipping
//! gaps). A source's position is found after a restart from the `Nats-Stream-Source` header
//! of the newest message it stored (as the reference), and also from `sources.json`, which
//! the target rewrites after committed batches (at most every 100 ms, fsynced at shutdown),
//! so a source whose messages were purged or aged out of the target does not start over.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::api::{ApiError, ErrorKind};
use super::stream::{null_default, subjects_overlap, valid_name, Stream, StreamConfig};
use super::transform::{validate_mapping, Transform};
use super::JetStream;
use crate::server::Server;
use crate::time::{now_nanos, parse_rfc3339, rfc3339};

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// `{src, dest}`: both always written, as the reference.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct SubjectTransformConfig {
    #[serde(default)]
    pub src: String,
    #[serde(default)]
    pub dest: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct ExternalStream {
    #[serde(default)]
    pub api: String,
    #[serde(default)]
    pub deliver: String,
}

/// One entry of `sources` (or the `mirror`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct StreamSource {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub opt_start_seq: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opt_start_time: Option<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub filter_subject: String,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_default"
    )]
    pub subject_transforms: Vec<SubjectTransformConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalStream>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<Value>,
}

impl StreamSource {
    /// The reference's index name: `<name> <filters> <destinations>`, `>` for none, several
    /// joined by a form feed. It tells sources of the same stream apart in the header.
    pub fn iname(&self) -> String {
        let (src, dest) = if self.subject_transforms.is_empty() {
            let f = if self.filter_subject.is_empty() {
                ">"
            } else {
                &self.filter_subject
            };
            (f.to_string(), ">".to_string())
        } else {
            let or_all = |s: &str| {
                if s.is_empty() {
                    ">".to_string()
                } else {
                    s.to_string()
                }
            };
            (
                self.subject_transforms
                    .iter()
                    .map(|t| or_all(&t.src))
                    .collect::<Vec<_>>()
                    .join("\x0c"),
                self.subject_transforms
                    .iter()
                    .map(|t| or_all(&t.dest))
                    .collect::<Vec<_>>()
                    .join("\x0c"),
            )
        };
        format!("{} {src} {dest}", self.name)
    }

    /// The subjects read from the origin (empty: all).
    fn filters(&self) -> Vec<String> {
        if !self.subject_transforms.is_empty() {
            return self
                .subject_transforms
                .iter()
                .map(|t| {
                    if t.src.is_empty() {
                        ">".into()
                    } else {
                        t.src.clone()
                    }
                })
                .collect();
        }
        if self.filter_subject.is_empty() {
            vec![]
        } else {
            vec![self.filter_subject.clone()]
        }
    }

    fn transforms(&self) -> Vec<Transform> {
        self.subject_transforms
            .iter()
            .filter_map(|t| Transform::new(&t.src, &t.dest).ok().flatten())
            .collect()
    }

    fn start_time(&self) -> Option<i64> {
        self.opt_start_time.as_deref().and_then(parse_rfc3339)
    }
}

fn bad_time(s: &str) -> ApiError {
    ErrorKind::InvalidJson.with(format!(
        "parsing time {s:?} as \"2006-01-02T15:04:05Z07:00\": cannot parse {s:?} as \"2006\""
    ))
}

/// The checks of the reference's stream config validation that need no other stream, in
/// its order (run by [`StreamConfig::normalize`] before the subjects are defaulted).
pub fn check_config(cfg: &StreamConfig) -> Result<(), ApiError> {
    for s in cfg.mirror.iter().chain(cfg.sources.iter()) {
        if let Some(t) = &s.opt_start_time {
            if parse_rfc3339(t).is_none() {
                return Err(bad_time(t));
            }
        }
    }
    if let Some(m) = &cfg.mirror {
        if cfg.first_seq > 0 {
            return Err(ErrorKind::MirrorWithFirstSeq.err());
        }
        if !cfg.subjects.is_empty() {
            return Err(mirror_with_subjects());
        }
        if !cfg.sources.is_empty() {
            return Err(ErrorKind::MirrorWithSources.err());
        }
        if cfg.allow_msg_counter {
            return Err(ErrorKind::MirrorWithCounters.err());
        }
        if m.consumer.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(ApiError::not_supported("durable mirror consumers"));
        }
        if !m.filter_subject.is_empty() && !m.subject_transforms.is_empty() {
            return Err(ErrorKind::MirrorTransformsAndFilter.err());
        }
        if cfg.subject_delete_marker_ttl > 0 {
            return Err(
                ErrorKind::InvalidConfig.with("subject delete markers forbidden on mirrors")
            );
        }
        for (i, t) in m.subject_transforms.iter().enumerate() {
            if !t.src.is_empty() && !valid_subject(&t.src) {
                return Err(ErrorKind::MirrorTransformSource.with(&t.src));
            }
            validate_mapping(&t.src, &t.dest).map_err(|e| ErrorKind::MirrorTransform.with(e))?;
            for (j, u) in m.subject_transforms.iter().enumerate() {
                if i != j && subjects_overlap(&t.src, &u.src) {
                    return Err(ErrorKind::MirrorFiltersOverlap.err());
                }
            }
        }
        if m.external.is_some() {
            return Err(external_not_supported());
        }
        if !valid_name(&m.name) {
            return Err(ErrorKind::MirrorNameInvalid.err());
        }
    }
    let mut inames = std::collections::HashSet::new();
    for s in &cfg.sources {
        if !valid_name(&s.name) {
            return Err(ErrorKind::SourceNameInvalid.err());
        }
        if !inames.insert(s.iname()) {
            return Err(ErrorKind::DuplicateSource.err());
        }
        if !s.filter_subject.is_empty() && !s.subject_transforms.is_empty() {
            return Err(ErrorKind::SourceTransformsAndFilter.err());
        }
        for t in &s.subject_transforms {
            if !t.src.is_empty() && !valid_subject(&t.src) {
                return Err(ErrorKind::SourceTransformSource.with(&t.src));
            }
            validate_mapping(&t.src, &t.dest).map_err(|e| ErrorKind::SourceTransform.with(e))?;
        }
        for (i, t) in s.subject_transforms.iter().enumerate() {
            for (j, u) in s.subject_transforms.iter().enumerate() {
                if i != j && subset_match(&t.src, &u.src) {
                    return Err(ErrorKind::SourceFiltersOverlap.err());
                }
            }
        }
        if s.consumer.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(ApiError::not_supported("durable source consumers"));
        }
        if s.external.is_some() {
            return Err(external_not_supported());
        }
    }
    Ok(())
}

fn external_not_supported() -> ApiError {
    ApiError::not_supported("sourcing from another domain or account (external)")
}

pub fn mirror_with_subjects() -> ApiError {
    ErrorKind::MirrorWithSubjects.err()
}

fn valid_subject(s: &str) -> bool {
    keel_protocol::subject::valid_subscribe(s.as_bytes())
}

/// Is every subject `a` matches also matched by `b` (the reference's subjectIsSubsetMatch)?
fn subset_match(a: &str, b: &str) -> bool {
    let a = if a.is_empty() { ">" } else { a };
    let b = if b.is_empty() { ">" } else { b };
    let at: Vec<&str> = a.split('.').collect();
    let bt: Vec<&str> = b.split('.').collect();
    for (i, t) in bt.iter().enumerate() {
        if *t == ">" {
            return at.len() > i;
        }
        match at.get(i) {
            None => return false,
            Some(x) if *t == "*" => {
                if *x == ">" {
                    return false;
                }
            }
            Some(x) => {
                if x != t {
                    return false;
                }
            }
        }
    }
    at.len() == bt.len()
}

/// The checks that look at other streams: origin message sizes, `mirror_direct` following
/// the origin's `allow_direct`, and source cycles. In a cluster the other streams are known
/// from the meta group's assignments too (`known_config`), so every server (and the meta
/// leader, before it assigns a create) decides alike, and a cycle through streams on
/// different servers is found.
pub fn check_with_streams(
    js: &JetStream,
    server: &Server,
    cfg: &mut StreamConfig,
) -> Result<(), ApiError> {
    if let Some(m) = &cfg.mirror {
        if let Some(oc) = known_config(js, server, &m.name) {
            if cfg.max_msg_size > 0 && oc.max_msg_size > 0 && cfg.max_msg_size < oc.max_msg_size {
                return Err(ErrorKind::MirrorMaxMessageSize.err());
            }
            cfg.mirror_direct = oc.allow_direct;
        }
    }
    for s in &cfg.sources {
        if let Some(oc) = known_config(js, server, &s.name) {
            if cfg.max_msg_size > 0 && oc.max_msg_size > 0 && cfg.max_msg_size < oc.max_msg_size {
                return Err(ErrorKind::SourceMaxMessageSize.err());
            }
        }
    }
    // Cycles: walk what this stream sources (and mirrors) through the existing streams.
    let cycle = || ErrorKind::InvalidConfig.with("detected cycle");
    let mut visited = std::collections::HashSet::new();
    let mut queue = vec![cfg.clone()];
    while let Some(c) = (!queue.is_empty()).then(|| queue.remove(0)) {
        visited.insert(c.name.clone());
        for s in &c.sources {
            if visited.contains(&s.name) {
                let overlaps = s.filter_subject.is_empty()
                    || c.subjects
                        .iter()
                        .any(|x| subjects_overlap(x, &s.filter_subject));
                if overlaps {
                    return Err(cycle());
                }
            } else if let Some(o) = lookup(js, server, cfg, &s.name) {
                queue.push(o);
            }
        }
        if let Some(m) = &c.mirror {
            if visited.contains(&m.name) {
                return Err(cycle());
            }
            if let Some(o) = lookup(js, server, cfg, &m.name) {
                queue.push(o);
            }
        }
    }
    Ok(())
}

/// A stream's config, the one being checked standing in for its stored version.
fn lookup(js: &JetStream, server: &Server, cfg: &StreamConfig, name: &str) -> Option<StreamConfig> {
    if name == cfg.name {
        return Some(cfg.clone());
    }
    known_config(js, server, name)
}

/// A stream's config as this server knows it: its replica's here, else (clustered JetStream)
/// the one its meta assignment was made with.
pub fn known_config(js: &JetStream, server: &Server, name: &str) -> Option<StreamConfig> {
    if let Some(s) = js.stream(name) {
        return Some((*s.config()).clone());
    }
    let meta = server.jetstream.get()?.meta.get()?;
    let a = meta.assignment(&js.account.name, name)?;
    let body = serde_json::to_vec(&a.config).ok()?;
    super::api::streams::parse_config(js, name, &body).ok()
}

/// Creation-time filter checks (the reference makes them when it adds the stream, with its
/// stream-create error 10049).
pub fn check_filters(cfg: &StreamConfig) -> Result<(), ApiError> {
    let create_err = |t: String| ErrorKind::StreamCreate.with(t);
    if let Some(m) = &cfg.mirror {
        if m.subject_transforms.is_empty()
            && !m.filter_subject.is_empty()
            && !valid_subject(&m.filter_subject)
        {
            return Err(create_err(format!(
                "subject filter '{}' for the mirror invalid subject",
                m.filter_subject
            )));
        }
    }
    for s in &cfg.sources {
        if s.subject_transforms.is_empty()
            && !s.filter_subject.is_empty()
            && !valid_subject(&s.filter_subject)
        {
            return Err(create_err(format!(
                "subject filter '{}' for the source: invalid subject",
                s.filter_subject
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Runtime
// ---------------------------------------------------------------------------------------

/// What a source reports in stream info, updated by its task.
pub struct SourceState {
    pub cfg: StreamSource,
    pub iname: String,
    /// Last origin sequence handed to the target and committed.
    pub seq: AtomicU64,
    pub lag: AtomicU64,
    /// Last contact with the origin (ns), 0 before the first.
    pub last: AtomicI64,
    pub error: Mutex<Option<ApiError>>,
}

impl SourceState {
    fn new(cfg: StreamSource) -> SourceState {
        SourceState {
            iname: cfg.iname(),
            cfg,
            seq: AtomicU64::new(0),
            lag: AtomicU64::new(0),
            last: AtomicI64::new(0),
            error: Mutex::new(None),
        }
    }

    fn set_error(&self, e: Option<ApiError>) {
        *self.error.lock().unwrap_or_else(|p| p.into_inner()) = e;
    }

    /// The reference's StreamSourceInfo JSON.
    fn info(&self, mirror: bool) -> Value {
        let mut m = Map::new();
        m.insert("name".into(), self.cfg.name.clone().into());
        m.insert("lag".into(), self.lag.load(Ordering::Relaxed).into());
        let seq = self.seq.load(Ordering::Relaxed);
        if !mirror && seq > 0 {
            m.insert("seq".into(), seq.into());
        }
        let last = self.last.load(Ordering::Relaxed);
        let active = if last == 0 {
            -1
        } else {
            (now_nanos() - last).max(0)
        };
        m.insert("active".into(), active.into());
        if let Some(e) = &*self.error.lock().unwrap_or_else(|p| p.into_inner()) {
            m.insert("error".into(), e.to_json());
        }
        if !self.cfg.filter_subject.is_empty() {
            m.insert(
                "filter_subject".into(),
                self.cfg.filter_subject.clone().into(),
            );
        }
        if !self.cfg.subject_transforms.is_empty() {
            m.insert(
                "subject_transforms".into(),
                serde_json::to_value(&self.cfg.subject_transforms).expect("serializes"),
            );
        }
        Value::Object(m)
    }
}

/// The running sources (or mirror) of one stream.
pub struct Sourcing {
    mirror: Option<Arc<SourceState>>,
    sources: Vec<Arc<SourceState>>,
    stop: tokio::sync::watch::Sender<bool>,
    /// The tasks wait for this before their first read (a new stream's create response
    /// shows its sources before they first contact their origin, as the reference's).
    go: tokio::sync::watch::Sender<bool>,
}

impl Sourcing {
    /// `mirror` / `sources` for stream info, in the reference's shape.
    pub fn info(&self) -> Vec<(&'static str, Value)> {
        let mut out = vec![];
        if let Some(m) = &self.mirror {
            out.push(("mirror", m.info(true)));
        }
        if !self.sources.is_empty() {
            out.push((
                "sources",
                Value::Array(self.sources.iter().map(|s| s.info(false)).collect()),
            ));
        }
        out
    }

    /// Whether a mirror is caught up enough to answer its origin's direct gets.
    pub fn mirror_current(&self) -> bool {
        self.mirror.as_ref().is_some_and(|m| {
            m.last.load(Ordering::Relaxed) > 0 && m.lag.load(Ordering::Relaxed) < 10
        })
    }

    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }

    /// Lets the tasks start reading their origins.
    pub fn go(&self) {
        let _ = self.go.send(true);
    }
}

impl Drop for Sourcing {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One message for the target to store.
pub struct SourcedMsg {
    pub subject: Bytes,
    pub hdr: Bytes,
    pub data: Bytes,
    /// For a mirror: the origin's sequence and time, which the mirror keeps.
    pub mirror: Option<(u64, i64)>,
}

/// How the target took one message.
#[derive(Debug, Clone, PartialEq)]
pub enum Taken {
    Stored,
    /// Already there (a mirror's older sequence, a duplicate `Nats-Msg-Id`).
    Skipped,
    /// Not stored (discard new, limits, a failed write): retry from this message later.
    Refused(ApiError),
}

/// A batch on its way to the target's writer, answered when committed.
pub struct SourcedBatch {
    pub msgs: Vec<SourcedMsg>,
    pub done: tokio::sync::oneshot::Sender<Vec<Taken>>,
    /// The sourcing generation that read it: a batch still queued when the sources were
    /// restarted (a config update) is refused, since the new tasks start after what is stored.
    pub gen: u64,
}

/// Where each source of a previous generation stood: index name -> (seq, origin identity).
pub type Positions = HashMap<String, (u64, String)>;

impl Sourcing {
    /// Where the sources stand now (handed to the next generation on an update).
    pub fn positions(&self, idents: &HashMap<String, String>) -> Positions {
        self.sources
            .iter()
            .map(|s| {
                (
                    s.iname.clone(),
                    (
                        s.seq.load(Ordering::Relaxed),
                        idents.get(&s.iname).cloned().unwrap_or_default(),
                    ),
                )
            })
            .collect()
    }
}

/// Starts the tasks for a stream's sources or mirror; None when it has neither. Returns the
/// origin identities known for the sources too.
pub fn start(
    server: &Arc<Server>,
    target: &Arc<Stream>,
    cfg: &StreamConfig,
    gen: u64,
    previous: &Positions,
    tx: &tokio::sync::mpsc::Sender<SourcedBatch>,
) -> Option<(Sourcing, HashMap<String, String>)> {
    if cfg.mirror.is_none() && cfg.sources.is_empty() {
        return None;
    }
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let (go, go_rx) = tokio::sync::watch::channel(false);
    let mirror = cfg.mirror.clone().map(|m| Arc::new(SourceState::new(m)));
    let sources: Vec<Arc<SourceState>> = cfg
        .sources
        .iter()
        .cloned()
        .map(|s| Arc::new(SourceState::new(s)))
        .collect();
    // Where each source stopped: the newest `Nats-Stream-Source` header per source (a scan
    // back from the end of the target), the saved position, the previous generation's; the
    // furthest of those that name the same origin identity.
    let found = scan_positions(target, &sources);
    let saved: Positions = load_positions(&target.meta, &target.dir, target.handle_log())
        .into_iter()
        .map(|(k, p)| (k, (p.seq, p.ident)))
        .collect();
    let mut idents = HashMap::new();
    for s in &sources {
        let mut best: Option<(u64, String)> = found.get(&s.iname).cloned();
        for other in [saved.get(&s.iname), previous.get(&s.iname)]
            .into_iter()
            .flatten()
        {
            best = Some(match best {
                None => other.clone(),
                Some((seq, id)) if id.is_empty() || other.1.is_empty() || id == other.1 => {
                    let id = if id.is_empty() { other.1.clone() } else { id };
                    (seq.max(other.0), id)
                }
                // Another identity: the origin was created anew since; the newer wins.
                Some(b) => b,
            });
        }
        let (seq, ident) = best.unwrap_or_default();
        s.seq.store(seq, Ordering::Relaxed);
        if !ident.is_empty() {
            idents.insert(s.iname.clone(), ident);
        }
    }
    if let Some(m) = &mirror {
        spawn_until_shutdown(
            server,
            run(
                server.clone(),
                Arc::downgrade(target),
                m.clone(),
                true,
                None,
                gen,
                (stop_rx.clone(), go_rx.clone()),
                tx.clone(),
            ),
        );
    }
    for s in &sources {
        spawn_until_shutdown(
            server,
            run(
                server.clone(),
                Arc::downgrade(target),
                s.clone(),
                false,
                idents.get(&s.iname).cloned(),
                gen,
                (stop_rx.clone(), go_rx.clone()),
                tx.clone(),
            ),
        );
    }
    Some((
        Sourcing {
            mirror,
            sources,
            stop,
            go,
        },
        idents,
    ))
}

/// `Nats-Stream-Source` parsed: (index name, origin sequence, origin identity).
fn parse_source_header(v: &str) -> Option<(String, u64, String)> {
    let f: Vec<&str> = v.split(' ').collect();
    if f.len() < 4 {
        return None;
    }
    let seq = f[1].parse().ok()?;
    Some((
        format!("{} {} {}", f[0], f[2], f[3]),
        seq,
        f.get(5).map(|s| s.to_string()).unwrap_or_default(),
    ))
}

/// Scans the target back from its last message for each source's newest header.
fn scan_positions(target: &Stream, sources: &[Arc<SourceState>]) -> HashMap<String, (u64, String)> {
    let mut found = HashMap::new();
    if sources.is_empty() {
        return found;
    }
    let store = target.read();
    let st = store.state();
    let mut seq = st.last_seq;
    while seq >= st.first_seq.max(1) && found.len() < sources.len() {
        if let Some((_, true)) = store.peek(seq) {
            if let Ok(m) = store.load(seq) {
                if let Some(v) = keel_protocol::headers::get_str(&m.hdr, "Nats-Stream-Source") {
                    if let Some((iname, s, ident)) = parse_source_header(v) {
                        found.entry(iname).or_insert((s, ident));
                    }
                }
            }
        }
        seq -= 1;
    }
    found
}

#[derive(Serialize, Deserialize, Default, Clone)]
struct SavedPosition {
    seq: u64,
    #[serde(default)]
    ident: String,
}

const POSITIONS_FILE: &str = "sources.json";

/// The saved positions (checksummed like every metadata file; a damaged file counts as
/// none: the scan of the target's own `Nats-Stream-Source` headers still finds where each
/// source stopped).
fn load_positions(
    meta: &keel_store::MetaFiles,
    dir: &Path,
    log: &crate::log::Log,
) -> HashMap<String, SavedPosition> {
    super::files::read(meta, &dir.join(POSITIONS_FILE), "Source positions", log)
        .ok()
        .flatten()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Rewrites the saved positions (write, rename; `durable` also fsyncs).
pub fn save_positions(
    meta: &keel_store::MetaFiles,
    log: &crate::log::Log,
    dir: &Path,
    sourcing: &Sourcing,
    idents: &HashMap<String, String>,
    durable: bool,
) {
    let map: HashMap<&str, SavedPosition> = sourcing
        .sources
        .iter()
        .map(|s| {
            (
                s.iname.as_str(),
                SavedPosition {
                    seq: s.seq.load(Ordering::Relaxed),
                    ident: idents.get(&s.iname).cloned().unwrap_or_default(),
                },
            )
        })
        .collect();
    let body = serde_json::to_vec(&map).expect("positions serialize");
    // Through keel-store's MetaFiles (the Fs seam): checksummed, a slot written in place
    // (saved as sourced messages are stored, so no rename per save).
    if let Err(e) = meta.overwrite(&dir.join(POSITIONS_FILE), &body, durable) {
        crate::warn!(
            log,
            "Could not save source positions in {}: {e}",
            dir.display()
        );
    }
}

/// The reference's stream identity: a hash of its creation time, so that a source notices
/// when its origin was deleted and created again.
pub fn identity(created: i64) -> String {
    use sha2::{Digest, Sha256};
    const DIGITS: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let h = Sha256::digest(rfc3339(created).as_bytes());
    h[..8]
        .iter()
        .map(|b| DIGITS[(*b % 62) as usize] as char)
        .collect()
}

const BATCH_MSGS: usize = 256;
const BATCH_BYTES: usize = 1 << 20;
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// One source's (or the mirror's) task.
/// A source task ends with the server (which waits for it), or when its stream stops it.
fn spawn_until_shutdown(
    server: &Arc<Server>,
    task: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let mut shutdown = server.shutdown_rx();
    server.spawn(async move {
        tokio::select! {
            _ = task => {}
            _ = crate::client::until_true(&mut shutdown) => {}
        }
    });
}

#[allow(clippy::too_many_arguments)]
async fn run(
    server: Arc<Server>,
    target: std::sync::Weak<Stream>,
    state: Arc<SourceState>,
    mirror: bool,
    mut ident: Option<String>,
    gen: u64,
    (mut stop, mut go): (
        tokio::sync::watch::Receiver<bool>,
        tokio::sync::watch::Receiver<bool>,
    ),
    tx: tokio::sync::mpsc::Sender<SourcedBatch>,
) {
    while !*go.borrow_and_update() {
        tokio::select! {
            r = go.changed() => if r.is_err() {
                return;
            },
            _ = stop.changed() => return,
        }
    }
    let filters = state.cfg.filters();
    let transforms = state.cfg.transforms();
    let mut origin: Option<Arc<Stream>> = None;
    let mut committed: Option<tokio::sync::watch::Receiver<u64>> = None;
    let mut backoff = Duration::from_millis(100);
    // The identity of the origin found last (here or on another server), and which of a
    // remote origin's replicas to read from.
    let mut ident_seen: Option<String> = None;
    let mut turn = 0usize;
    loop {
        if *stop.borrow() {
            return;
        }
        let Some(t) = target.upgrade() else { return };
        // Streams recovered at startup start their sources before JetStream is published.
        // The origin is in the stream's own account.
        let js = server
            .jetstream
            .get()
            .and_then(|j| j.account(&t.account().name).cloned());
        let Some(js) = js else {
            drop(t);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                _ = stop.changed() => {}
            }
            continue;
        };
        // (Re)find the origin; one created anew resets a source to its start. In a cluster
        // it may have no replica on this server: it is read from one that has.
        let found = js.stream(&state.cfg.name);
        let remote = match &found {
            None => remote_origin(&server, &js, &state.cfg.name),
            Some(_) => None,
        };
        let found_ident = match (&found, &remote) {
            (Some(o), _) => Some((identity(o.created), Some(o))),
            (None, Some(r)) => Some((identity(r.created), None)),
            (None, None) => None,
        };
        match found_ident {
            None => {
                state.set_error(Some(ErrorKind::StreamNotFound.err()));
                origin = None;
                committed = None;
                ident_seen = None;
            }
            Some((id, local)) => {
                let same = match local {
                    Some(o) => origin.as_ref().is_some_and(|x| Arc::ptr_eq(x, o)),
                    None => origin.is_none() && ident_seen.as_deref() == Some(id.as_str()),
                };
                if !same {
                    if !mirror {
                        if let Some(old) = &ident {
                            if *old != id {
                                crate::warn!(
                                    server.log,
                                    "JetStream source stream {:?} for stream '{} > {}' was recreated, resetting source state",
                                    state.cfg.name,
                                    t.account().name,
                                    t.name
                                );
                                state.seq.store(0, Ordering::Relaxed);
                            }
                        }
                    }
                    ident = Some(id.clone());
                    ident_seen = Some(id);
                    committed = local.map(|o| o.committed_watch());
                    origin = local.cloned();
                }
                state.set_error(None);
            }
        }
        let mut wait = committed.clone();
        if let Some(w) = wait.as_mut() {
            w.borrow_and_update();
        }
        let start = if mirror {
            t.state().last_seq
        } else {
            state.seq.load(Ordering::Relaxed)
        };
        let ask = state.ask(start, &filters);
        let read = if let Some(o) = &origin {
            Some(read_origin(o, &ask))
        } else if let Some(r) = remote {
            drop(t);
            // (The origin's server waits for more while there is nothing new.)
            let peer = &r.peers[turn % r.peers.len()];
            let got = tokio::select! {
                got = r.host.read_origin(peer, &r.group, &ask, REMOTE_WAIT) => got,
                _ = stop.changed() => return,
            };
            match got {
                Ok(read) => {
                    backoff = Duration::from_millis(100);
                    if read.msgs.is_empty() {
                        state.last.store(now_nanos(), Ordering::Relaxed);
                        state.lag.store(read.lag, Ordering::Relaxed);
                        continue;
                    }
                    Some(read)
                }
                Err(_) => {
                    // Not there (yet), or not answering: the next replica, a little later.
                    turn += 1;
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.changed() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
        } else {
            drop(t);
            None
        };
        let mut progressed = false;
        if let Some(read) = read {
            let msgs = to_sourced(
                read.msgs,
                &state,
                mirror,
                &transforms,
                ident.as_deref().unwrap_or(""),
            );
            state.last.store(now_nanos(), Ordering::Relaxed);
            state.lag.store(read.lag, Ordering::Relaxed);
            if !msgs.is_empty() {
                let last_seqs: Vec<u64> = msgs.iter().map(|(s, _)| *s).collect();
                let (done, rx) = tokio::sync::oneshot::channel();
                let batch = SourcedBatch {
                    msgs: msgs.into_iter().map(|(_, m)| m).collect(),
                    done,
                    gen,
                };
                if tx.send(batch).await.is_err() {
                    return;
                }
                let Ok(taken) = rx.await else { return };
                let mut refused = false;
                for (seq, r) in last_seqs.iter().zip(taken.iter()) {
                    match r {
                        Taken::Stored | Taken::Skipped => {
                            state.seq.store(*seq, Ordering::Relaxed);
                            progressed = true;
                        }
                        Taken::Refused(_) => {
                            refused = true;
                            break;
                        }
                    }
                }
                if let Some(t) = target.upgrade() {
                    t.sources_progressed(
                        ident
                            .as_deref()
                            .map(|i| (state.iname.clone(), i.to_string())),
                    );
                }
                if refused {
                    // The target is full (discard new) or failing: try again later.
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.changed() => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
                backoff = Duration::from_millis(100);
            }
        }
        if progressed || (origin.is_none() && ident_seen.is_some()) {
            continue;
        }
        // Caught up: wait for the origin to commit more, or look again shortly (the origin
        // may be created or deleted meanwhile).
        match wait.as_mut() {
            Some(w) => {
                tokio::select! {
                    _ = w.changed() => {}
                    _ = tokio::time::sleep(IDLE_CHECK) => {}
                    _ = stop.changed() => {}
                }
            }
            None => {
                tokio::select! {
                    _ = tokio::time::sleep(IDLE_CHECK) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    }
}

/// An origin in this server's cluster with no replica here: its group and where its
/// replicas are (other servers).
struct RemoteOrigin {
    host: Arc<super::raft::RaftHost>,
    group: String,
    peers: Vec<String>,
    created: i64,
}

fn remote_origin(server: &Server, js: &JetStream, name: &str) -> Option<RemoteOrigin> {
    let meta = server.jetstream.get()?.meta.get()?;
    let a = meta.assignment(&js.account.name, name)?;
    let peers: Vec<String> = a
        .peers
        .iter()
        .filter(|p| **p != meta.host.name)
        .cloned()
        .collect();
    if peers.is_empty() || a.group.is_empty() {
        return None;
    }
    Some(RemoteOrigin {
        host: meta.host.clone(),
        group: a.group,
        peers,
        created: a.created,
    })
}

/// How long an origin on another server holds a read while it has nothing new.
const REMOTE_WAIT: Duration = Duration::from_secs(2);

/// What a source asks of its origin's store: the messages past `start` (a fresh source's
/// first read starts at `opt_start_seq` or `opt_start_time`), through `filters`, up to the
/// origin's committed sequence. (Sent to another server when the origin has no replica
/// here: `RaftHost::read_origin`.)
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct OriginAsk {
    pub start: u64,
    pub opt_start_seq: u64,
    pub opt_start_time: Option<i64>,
    pub filters: Vec<String>,
}

/// What an origin's store gave: the messages read and what the filters match past them.
#[derive(Serialize, Deserialize, Default)]
pub struct OriginRead {
    pub msgs: Vec<OriginMsg>,
    pub lag: u64,
}

/// A message as the origin stores it.
#[derive(Serialize, Deserialize)]
pub struct OriginMsg {
    pub seq: u64,
    pub ts: i64,
    pub subject: Bytes,
    pub hdr: Bytes,
    pub data: Bytes,
}

impl SourceState {
    fn ask(&self, start: u64, filters: &[String]) -> OriginAsk {
        OriginAsk {
            start,
            opt_start_seq: self.cfg.opt_start_seq,
            opt_start_time: self.cfg.start_time(),
            filters: filters.to_vec(),
        }
    }
}

/// Reads the next messages `ask` wants from `origin`'s store (under its lock only): never
/// past its committed sequence (a leader's store holds the batch in flight too).
pub fn read_origin(origin: &Stream, ask: &OriginAsk) -> OriginRead {
    let committed = origin.committed_seq();
    let store = origin.read();
    let st = store.state();
    let last = st.last_seq.min(committed);
    let mut next = ask.start + 1;
    if ask.start == 0 {
        if ask.opt_start_seq > 0 {
            next = ask.opt_start_seq;
        } else if let Some(t) = ask.opt_start_time {
            next = first_at_or_after(&*store, st.first_seq.max(1), last, t);
        }
    }
    let mut msgs = vec![];
    let mut bytes = 0;
    while msgs.len() < BATCH_MSGS && bytes < BATCH_BYTES && next <= last {
        let m = if ask.filters.is_empty() {
            store.load_next(next, ">")
        } else {
            ask.filters
                .iter()
                .filter_map(|f| store.load_next(next, f).ok())
                .min_by_key(|m| m.seq)
                .ok_or(keel_store::StoreError::NotFound)
        };
        let Ok(m) = m.and_then(|m| {
            if m.seq <= last {
                Ok(m)
            } else {
                Err(keel_store::StoreError::NotFound)
            }
        }) else {
            break;
        };
        next = m.seq + 1;
        bytes += m.subject.len() + m.hdr.len() + m.data.len();
        msgs.push(OriginMsg {
            seq: m.seq,
            ts: m.ts,
            subject: m.subject,
            hdr: m.hdr,
            data: m.data,
        });
    }
    let pending_from = next.max(ask.start + 1);
    let lag = if ask.filters.is_empty() {
        store.num_pending(pending_from, ">", false)
    } else {
        ask.filters
            .iter()
            .map(|f| store.num_pending(pending_from, f, false))
            .sum()
    };
    OriginRead { msgs, lag }
}

/// `read_origin` for another server's source (`Rpc::ReadOrigin`): when nothing is there
/// to read yet, waits up to `wait` for the origin to commit more.
pub async fn read_origin_waiting(origin: &Stream, ask: &OriginAsk, wait: Duration) -> OriginRead {
    let deadline = tokio::time::Instant::now() + wait;
    let mut committed = origin.committed_watch();
    loop {
        committed.borrow_and_update();
        let r = read_origin(origin, ask);
        if !r.msgs.is_empty() {
            return r;
        }
        match tokio::time::timeout_at(deadline, committed.changed()).await {
            Ok(Ok(())) => {}
            _ => return r,
        }
    }
}

/// What the target stores for the messages read from its origin: (origin seq, message).
fn to_sourced(
    msgs: Vec<OriginMsg>,
    state: &SourceState,
    mirror: bool,
    transforms: &[Transform],
    ident: &str,
) -> Vec<(u64, SourcedMsg)> {
    msgs.into_iter()
        .map(|m| {
            let subject = transformed(transforms, &m.subject);
            let msg = if mirror {
                SourcedMsg {
                    subject,
                    hdr: m.hdr,
                    data: m.data,
                    mirror: Some((m.seq, m.ts)),
                }
            } else {
                SourcedMsg {
                    subject,
                    hdr: source_headers(&m.hdr, &state.iname, m.seq, &m.subject, ident),
                    data: m.data,
                    mirror: None,
                }
            };
            (m.seq, msg)
        })
        .collect()
}

/// The first sequence stored at or after time `t` (a binary search over the index).
fn first_at_or_after(store: &dyn keel_store::Store, first: u64, last: u64, t: i64) -> u64 {
    let (mut lo, mut hi) = (first, last + 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        // Deleted sequences: look at the next live one.
        let ts = (mid..hi).find_map(|s| store.peek(s).map(|(ts, _)| ts));
        match ts {
            Some(ts) if ts < t => lo = mid + 1,
            _ => hi = mid,
        }
    }
    lo
}

fn transformed(transforms: &[Transform], subject: &Bytes) -> Bytes {
    if transforms.is_empty() {
        return subject.clone();
    }
    let Ok(s) = std::str::from_utf8(subject) else {
        return subject.clone();
    };
    transforms
        .iter()
        .find_map(|t| t.apply(s))
        .map(Bytes::from)
        .unwrap_or_else(|| subject.clone())
}

/// The origin's headers without the ones a sourced copy must not keep (an older
/// `Nats-Stream-Source`, `Nats-Expected-*`, `Nats-Batch-*`), plus this source's header.
fn source_headers(hdr: &[u8], iname: &str, seq: u64, subject: &[u8], ident: &str) -> Bytes {
    let mut out = Vec::with_capacity(hdr.len() + iname.len() + subject.len() + 64);
    if hdr.len() > 4 {
        let mut lines = hdr[..hdr.len() - 2].split_inclusive(|b| *b == b'\n');
        if let Some(first) = lines.next() {
            out.extend_from_slice(first);
        }
        for line in lines {
            let name = line.split(|b| *b == b':').next().unwrap_or_default();
            if name == b"Nats-Stream-Source"
                || name.starts_with(b"Nats-Expected-")
                || name.starts_with(b"Nats-Batch-")
            {
                continue;
            }
            out.extend_from_slice(line);
        }
    } else {
        out.extend_from_slice(b"NATS/1.0\r\n");
    }
    let mut parts = iname.splitn(3, ' ');
    let (name, filter, dest) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or(">"),
        parts.next().unwrap_or(">"),
    );
    out.extend_from_slice(format!("Nats-Stream-Source: {name} {seq} {filter} {dest} ").as_bytes());
    out.extend_from_slice(subject);
    if !ident.is_empty() {
        out.push(b' ');
        out.extend_from_slice(ident.as_bytes());
    }
    out.extend_from_slice(b"\r\n\r\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_names_and_headers() {
        let s = StreamSource {
            name: "O".into(),
            filter_subject: "o.a".into(),
            ..Default::default()
        };
        assert_eq!(s.iname(), "O o.a >");
        let t = StreamSource {
            name: "O".into(),
            subject_transforms: vec![
                SubjectTransformConfig {
                    src: "o.b".into(),
                    dest: "s.b".into(),
                },
                SubjectTransformConfig {
                    src: "".into(),
                    dest: "".into(),
                },
            ],
            ..Default::default()
        };
        assert_eq!(t.iname(), "O o.b\x0c> s.b\x0c>");
        let h = source_headers(
            b"NATS/1.0\r\nNats-Msg-Id: x1\r\nNats-Expected-Last-Sequence: 3\r\nX-A: b\r\n\r\n",
            "O o.a >",
            1,
            b"o.a",
            "EilhbToU",
        );
        assert_eq!(
            &h[..],
            b"NATS/1.0\r\nNats-Msg-Id: x1\r\nX-A: b\r\nNats-Stream-Source: O 1 o.a > o.a EilhbToU\r\n\r\n"
        );
        assert_eq!(
            parse_source_header("O 4 o.b s.b o.b EilhbToU"),
            Some(("O o.b s.b".into(), 4, "EilhbToU".into()))
        );
        assert_eq!(
            &source_headers(b"", "O > >", 7, b"x", "")[..],
            b"NATS/1.0\r\nNats-Stream-Source: O 7 > > x\r\n\r\n"
        );
    }

    #[test]
    fn subset_matches() {
        assert!(subset_match("o.a", "o.a"));
        assert!(subset_match("o.a", "o.*"));
        assert!(subset_match("o.a.b", "o.>"));
        assert!(!subset_match("o.*", "o.a"));
        assert!(!subset_match("o.>", "o.*"));
        assert!(subset_match("", ">"));
    }
}
