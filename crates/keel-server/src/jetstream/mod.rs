//! JetStream: streams (and, next, consumers) as a subsystem that talks to the core the way a
//! client does. It subscribes to `$JS.API.>` with an in-process handle, answers requests by
//! publishing to their reply subjects through a [`Router`], and each stream subscribes to its
//! own subjects. Stream configs live in `<store_dir>/jetstream/<account>/streams/<name>/`;
//! JetStream serves the global account `$G`, and its in-process clients are bound to it.

pub mod advisory;
pub mod api;
pub mod consumer;
pub mod counter;
pub mod expiry;
pub mod files;
pub mod registry;
pub mod republish;
pub mod schema;
pub mod sourcing;
pub mod stream;
pub mod transform;

use crate::jetstream::api::ErrorKind;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use keel_protocol::encode;
use keel_store::{Purge, StoreError};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::account::Account;
use crate::client::{ClientHandle, InMsg};
use crate::log::Log;
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::sublist::Sub;
use crate::time::{now_nanos, rfc3339};
use api::{error_response, expect_empty, parse_request, response, to_bytes, ApiError};
use stream::{StorageType, Stream, StreamConfig, StreamMeta};

pub struct JetStream {
    pub streams_dir: PathBuf,
    pub store_dir: PathBuf,
    /// Account -> streams -> consumers: their lifecycle.
    pub registry: registry::Registry,
    api_total: AtomicU64,
    api_errors: AtomicU64,
    /// Server-wide limits (`jetstream { max_memory_store, max_file_store }`); -1 = none.
    pub max_memory: i64,
    pub max_store: i64,
    /// None: sync before every ack (the default). Some(d): sync every d, ack at once.
    pub sync_interval: Option<Duration>,
    /// `jetstream { strict }` (default true): API requests with fields the reference does
    /// not know are refused rather than decoded with those fields ignored.
    pub strict: bool,
    /// `jetstream { domain }`: named in INFO, acks, infos and advisories; the API is also
    /// served on `$JS.<domain>.API.>`.
    pub domain: Option<String>,
    /// Held for the life of the process: one server per store directory.
    _lock: keel_store::DirLock,
    /// The account whose streams these are (its subjects, its clients).
    pub account: Arc<Account>,
    /// The server's name (stream info's `cluster.leader`).
    pub server_name: String,
    log: Log,
    /// This instance's metadata files (no process-wide instance: each remembers which files
    /// it made durable).
    pub meta: keel_store::MetaFiles,
}

const NAMES_LIMIT: usize = 1024;
const LIST_LIMIT: usize = 256;

impl JetStream {
    /// Opens the store directory, recovers every stream found there, and starts serving
    /// the API.
    pub fn start(server: &Arc<Server>) -> Result<Arc<JetStream>, String> {
        let opts = &server.opts;
        let store_dir = opts
            .store_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("keel"));
        let account = server.accounts.global().clone();
        let streams_dir = store_dir
            .join("jetstream")
            .join(&account.name)
            .join("streams");
        // Two servers on one store would both hand out the same sequences; the second
        // refuses to start (the kernel drops the lock when the holder exits, even on kill).
        let lock = keel_store::lock_dir(&store_dir)?;
        std::fs::create_dir_all(&streams_dir)
            .map_err(|e| format!("cannot create {}: {e}", streams_dir.display()))?;
        // Unset (or negative): the reference's defaults from the machine, so `/jsz` and
        // `/varz` report a real limit, and it is enforced.
        let max_memory = opts
            .max_memory_store
            .filter(|m| *m >= 0)
            .unwrap_or_else(crate::monitor::proc::default_max_memory);
        let max_store = opts
            .max_file_store
            .filter(|m| *m >= 0)
            .unwrap_or_else(|| crate::monitor::proc::default_max_store(&store_dir));
        let (requests, requests_rx) = tokio::sync::mpsc::channel(registry::REQUEST_QUEUE);
        let js = Arc::new(JetStream {
            streams_dir,
            store_dir,
            registry: registry::Registry::new(requests),
            api_total: AtomicU64::new(0),
            api_errors: AtomicU64::new(0),
            max_memory,
            max_store,
            sync_interval: opts.sync_interval,
            strict: opts.jetstream_strict,
            domain: opts.jetstream_domain.clone(),
            _lock: lock,
            account,
            server_name: server.server_name.clone(),
            log: server.log.clone(),
            meta: keel_store::MetaFiles::new(),
        });
        js.recover(server)?;

        let (handle, rx) = ClientHandle::internal(
            server,
            &js.account,
            "JetStream API".into(),
            crate::inqueue::API_QUEUE_BYTES,
        );
        let domain_api = js.domain.as_ref().map(|d| format!("$JS.{d}.API.>"));
        for subject in std::iter::once("$JS.API.>".to_string()).chain(domain_api) {
            js.account.sublist.insert(Arc::new(Sub {
                client: handle.clone(),
                sid: Bytes::from_static(b"api"),
                subject: Bytes::from(subject),
                queue: None,
                max: AtomicU64::new(0),
                delivered: AtomicU64::new(0),
            }));
        }
        server.spawn(api_loop(js.clone(), server.clone(), rx));
        server.spawn(registry_loop(js.clone(), server.clone(), requests_rx));
        server.spawn(maintenance_loop(js.clone(), server.clone()));
        Ok(js)
    }

    fn recover(&self, server: &Arc<Server>) -> Result<(), String> {
        let entries = std::fs::read_dir(&self.streams_dir)
            .map_err(|e| format!("cannot read {}: {e}", self.streams_dir.display()))?;
        for entry in entries.flatten() {
            let dir = entry.path();
            if !dir.is_dir() {
                continue;
            }
            let meta = match stream::read_meta(&self.meta, &dir, &self.log) {
                Ok(m) => m,
                Err(e) => {
                    // Damage never deletes a stream: it stays on disk for an operator.
                    crate::error!(
                        server.log,
                        "Skipping stream directory {}: {e}",
                        dir.display()
                    );
                    continue;
                }
            };
            let name = meta.config.name.clone();
            if meta.config.storage == StorageType::Memory {
                // Memory streams do not outlive the process, as with the reference.
                let _ = std::fs::remove_dir_all(&dir);
                continue;
            }
            match Stream::open(server, &self.account, &dir, meta, &self.settings()) {
                Ok(s) => {
                    let st = s.state();
                    crate::info!(
                        server.log,
                        "  Restored stream {name}: {} messages, {} bytes, seq {}..{}",
                        st.msgs,
                        st.bytes,
                        st.first_seq,
                        st.last_seq
                    );
                    self.registry.insert_stream(&self.account.name, s.clone());
                    self.recover_consumers(server, &s);
                }
                Err(e) => crate::error!(server.log, "Could not restore stream {name}: {e}"),
            }
        }
        Ok(())
    }

    /// Restarts the durable consumers saved under a recovered stream's directory.
    fn recover_consumers(&self, server: &Arc<Server>, stream: &Arc<Stream>) {
        let dir = stream.dir.join("consumers");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let cdir = e.path();
            match consumer::read_meta(&self.meta, &cdir, &server.log) {
                Ok(meta) => {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let (c, task) = consumer::Consumer::start(
                        server,
                        stream,
                        name,
                        meta,
                        Some(cdir),
                        self.registry.requests(),
                    );
                    self.registry
                        .insert_consumer(&self.account.name, &stream.name, c, task);
                }
                Err(_) if stream::leftover(&cdir) => {
                    // An interrupted create (an older Keel left these on a full disk).
                    crate::warn!(
                        server.log,
                        "Removing {}: a consumer directory with no config in it",
                        cdir.display()
                    );
                    let _ = self.meta.remove_dir_all(&cdir);
                }
                Err(err) => {
                    crate::error!(server.log, "Skipping consumer in {}: {err}", cdir.display())
                }
            }
        }
    }

    pub fn stream(&self, name: &str) -> Option<Arc<Stream>> {
        self.registry.stream(&self.account.name, name)
    }

    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.registry.streams(&self.account.name)
    }

    /// A stream's consumers (by name).
    pub fn consumers_of(&self, stream: &str) -> Vec<Arc<consumer::Consumer>> {
        self.registry.consumers(&self.account.name, stream)
    }

    pub fn consumer(&self, stream: &str, name: &str) -> Option<Arc<consumer::Consumer>> {
        self.registry.consumer(&self.account.name, stream, name)
    }

    /// What a stream of this JetStream is opened with.
    pub fn settings(&self) -> stream::Settings {
        stream::Settings {
            sync_always: self.sync_interval.is_none(),
            sync_interval: self.sync_interval,
            max_memory: self.max_memory,
            max_store: self.max_store,
            usage: self.registry.usage(&self.account.name),
            meta: self.meta.clone(),
        }
    }

    /// The `max_bytes` that streams of this storage type reserve (all but `except`).
    pub fn reserved(&self, storage: StorageType, except: Option<&str>) -> i64 {
        self.streams()
            .iter()
            .filter(|s| s.storage == storage && Some(s.name.as_str()) != except)
            .map(|s| s.config().max_bytes)
            .filter(|b| *b > 0)
            .sum()
    }

    /// API requests answered and how many of them were errors.
    pub fn api_stats(&self) -> (u64, u64) {
        (
            self.api_total.load(Ordering::Relaxed),
            self.api_errors.load(Ordering::Relaxed),
        )
    }

    /// Bytes used by memory and by file streams.
    pub fn usage(&self) -> (u64, u64) {
        let u = self.registry.usage(&self.account.name);
        (u.bytes(StorageType::Memory), u.bytes(StorageType::File))
    }

    /// After every task ended: the consumers' state is written and synced. (Each stream's
    /// actor closed its store, and saved its sources' positions, as it ended.)
    pub fn shutdown(&self) {
        for s in self.streams() {
            s.save_source_positions(true);
            s.stop_sourcing();
            for c in self.consumers_of(&s.name) {
                c.flush_state();
            }
        }
    }
}

async fn api_loop(js: Arc<JetStream>, server: Arc<Server>, mut rx: crate::inqueue::Receiver) {
    let mut router = Router::new(js.account.clone(), 0x4a53);
    let mut batch = Vec::new();
    // Handle a batch of what is queued, then wake the writers once.
    while rx.recv_many(&mut batch, 256, 1024 * 1024).await > 0 {
        for m in batch.drain(..) {
            handle_request(&js, &server, &mut router, m).await;
        }
        router.flush();
    }
}

/// The registry's task: what consumers ask of it (their removal once inactive).
async fn registry_loop(
    js: Arc<JetStream>,
    server: Arc<Server>,
    mut rx: tokio::sync::mpsc::Receiver<registry::Request>,
) {
    let mut router = Router::new(js.account.clone(), 0x5247);
    let mut shutdown = server.shutdown_rx();
    loop {
        let req = tokio::select! {
            r = rx.recv() => match r {
                Some(r) => r,
                None => return,
            },
            _ = crate::client::until_true(&mut shutdown) => return,
        };
        match req {
            registry::Request::DeleteConsumer {
                account,
                stream,
                name,
                created,
            } => {
                if account != js.account.name {
                    continue;
                }
                if let Some(s) = js.stream(&stream) {
                    js.delete_consumer(&server, &mut router, &s, &name, Some(created))
                        .await;
                }
            }
        }
        router.flush();
    }
}

/// Ticks every stream's actor: expiry, the sync interval, saving source positions.
async fn maintenance_loop(js: Arc<JetStream>, server: Arc<Server>) {
    let mut shutdown = server.shutdown_rx();
    let tick = Duration::from_millis(100);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = crate::client::until_true(&mut shutdown) => return,
        }
        for s in js.streams() {
            s.tick();
        }
    }
}

fn reply(server: &Server, router: &mut Router, to: &Bytes, body: impl Into<Bytes>) {
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

fn reply_headers(server: &Server, router: &mut Router, to: &Bytes, hdr: Vec<u8>, payload: &[u8]) {
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

/// The server's JetStream domain, if one is configured.
pub fn domain(server: &Server) -> Option<&str> {
    server.opts.jetstream_domain.as_deref()
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
    // Direct get answers with the message itself, not JSON.
    if tokens.first() == Some(&"DIRECT") {
        if tokens.len() >= 3 && tokens[1] == "GET" {
            js.api_total.fetch_add(1, Ordering::Relaxed);
            let subj = (tokens.len() > 3).then(|| tokens[3..].join("."));
            direct_get(
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
    let (kind, result) = match tokens.as_slice() {
        ["INFO"] => ("account_info", Ok(account_info(js))),
        ["STREAM", "CREATE", name] => (
            "stream_create",
            stream_create(js, server, router, name, body).await,
        ),
        ["STREAM", "UPDATE", name] => (
            "stream_update",
            stream_update(js, server, router, name, body).await,
        ),
        ["STREAM", "INFO", name] => ("stream_info", stream_info(js, name, body)),
        ["STREAM", "NAMES"] => ("stream_names", stream_names(js, body)),
        ["STREAM", "LIST"] => ("stream_list", stream_list(js, body)),
        ["STREAM", "DELETE", name] => (
            "stream_delete",
            match expect_empty(body) {
                Ok(()) => stream_delete(js, server, router, name).await,
                Err(e) => Err(e),
            },
        ),
        ["STREAM", "PURGE", name] => ("stream_purge", stream_purge(js, name, body).await),
        ["STREAM", "MSG", "GET", name] => ("stream_msg_get", msg_get(js, name, body)),
        ["STREAM", "MSG", "DELETE", name] => {
            ("stream_msg_delete", msg_delete(js, name, body).await)
        }
        ["CONSUMER", "CREATE", stream] => (
            "consumer_create",
            consumer_create(js, server, router, stream, None, None, body),
        ),
        ["CONSUMER", "CREATE", stream, name] => (
            "consumer_create",
            consumer_create(js, server, router, stream, Some(name), None, body),
        ),
        ["CONSUMER", "CREATE", stream, name, filter @ ..] => {
            let filter = filter.join(".");
            (
                "consumer_create",
                consumer_create(js, server, router, stream, Some(name), Some(&filter), body),
            )
        }
        ["CONSUMER", "DURABLE", "CREATE", stream, name] => (
            "consumer_create",
            consumer_create_durable(js, server, router, stream, name, body),
        ),
        ["CONSUMER", "INFO", stream, name] => (
            "consumer_info",
            expect_empty(body).and_then(|_| consumer_info(js, server, stream, name)),
        ),
        ["CONSUMER", "NAMES", stream] => ("consumer_names", consumer_names(js, stream, body)),
        ["CONSUMER", "LIST", stream] => ("consumer_list", consumer_list(js, server, stream, body)),
        ["CONSUMER", "DELETE", stream, name] => (
            "consumer_delete",
            match expect_empty(body) {
                Ok(()) => consumer_delete(js, server, router, stream, name).await,
                Err(e) => Err(e),
            },
        ),
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
            let body = consumer_pause(js, stream, name, body).unwrap_or_else(|e| {
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
        ["CONSUMER", "UNPIN", stream, name] => {
            ("consumer_unpin", consumer_unpin(js, stream, name, body))
        }
        // A consumer answers its own resets (on its own subscription), as with the
        // reference: one that does not exist answers nothing.
        ["CONSUMER", "RESET", ..] => return,
        // Unknown API subjects get no reply at all, as with the reference.
        _ => return,
    };
    js.api_total.fetch_add(1, Ordering::Relaxed);
    let body = match result {
        Ok(fields) => {
            let mut m = response(kind);
            m.extend(fields);
            to_bytes(&Value::Object(m))
        }
        Err(e) => {
            js.api_errors.fetch_add(1, Ordering::Relaxed);
            // Fields the reference always writes, even next to an error.
            let paged = [
                ("total", Value::from(0)),
                ("offset", 0.into()),
                ("limit", 0.into()),
            ];
            let extra: Vec<(&str, Value)> = match kind {
                "stream_info" => paged.to_vec(),
                "stream_names" | "stream_list" => {
                    [&paged[..], &[("streams", Value::Null)]].concat()
                }
                "consumer_names" | "consumer_list" => {
                    [&paged[..], &[("consumers", Value::Array(vec![]))]].concat()
                }
                "stream_purge" => vec![("purged", 0.into())],
                _ => vec![],
            };
            error_response(kind, &e, &extra)
        }
    };
    let response = Bytes::from(body);
    reply(server, router, &reply_to, response.clone());
    advisory::api_audit(server, router, m.origin, &m.subject, m.payload(), &response);
}

type Fields = Map<String, Value>;

fn account_info(js: &JetStream) -> Fields {
    let (mem, file) = js.usage();
    let streams = js.streams();
    let reserved_mem = js.reserved(StorageType::Memory, None);
    let reserved_file = js.reserved(StorageType::File, None);
    let mut f = Fields::new();
    f.insert("memory".into(), mem.into());
    f.insert("storage".into(), file.into());
    f.insert("reserved_memory".into(), reserved_mem.into());
    f.insert("reserved_storage".into(), reserved_file.into());
    f.insert("streams".into(), streams.len().into());
    f.insert(
        "consumers".into(),
        streams
            .iter()
            .map(|s| s.consumers.len())
            .sum::<usize>()
            .into(),
    );
    f.insert(
        "limits".into(),
        serde_json::json!({
            "max_memory": -1, "max_storage": -1, "max_streams": -1,
            "max_consumers": -1, "max_ack_pending": -1, "memory_max_stream_bytes": -1,
            "storage_max_stream_bytes": -1, "max_bytes_required": false
        }),
    );
    if let Some(d) = &js.domain {
        f.insert("domain".into(), d.clone().into());
    }
    f.insert(
        "api".into(),
        serde_json::json!({
            "level": stream::API_LEVEL,
            "total": js.api_total.load(Ordering::Relaxed),
            "errors": js.api_errors.load(Ordering::Relaxed),
        }),
    );
    f
}

/// `config, created, state, [domain, cluster], ts` of one stream; `cluster` is the
/// JetStream whose server leads it (a single server: always this one).
fn stream_fields(
    s: &Stream,
    dynamic_meta: bool,
    cluster: Option<&JetStream>,
    subjects_filter: Option<&str>,
    deleted_details: bool,
) -> Fields {
    let (state, subjects, deleted) = {
        let store = s.read();
        (
            store.state(),
            subjects_filter.map(|f| store.subjects(f)),
            deleted_details.then(|| store.deleted()),
        )
    };
    let mut f = Fields::new();
    f.insert("config".into(), s.config().to_json(dynamic_meta));
    f.insert("created".into(), rfc3339(s.created).into());
    f.insert(
        "state".into(),
        Stream::state_json(
            &state,
            s.consumers.len(),
            subjects.as_ref(),
            deleted.as_deref(),
        ),
    );
    if let Some(js) = cluster {
        // Stream info names the domain before the cluster, as the reference.
        if let Some(d) = &js.domain {
            f.insert("domain".into(), d.clone().into());
        }
        f.insert(
            "cluster".into(),
            serde_json::json!({ "leader": js.server_name }),
        );
    }
    for (k, v) in s.sourcing_info() {
        f.insert(k.into(), v);
    }
    f.insert("ts".into(), rfc3339(now_nanos()).into());
    f
}

fn parse_config(js: &JetStream, name: &str, body: &[u8]) -> Result<StreamConfig, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ErrorKind::StreamMismatch.err());
    }
    let cfg: StreamConfig = parse_request(body, &schema::STREAM_CONFIG, js.strict)?;
    refuse_pedantic(body)?;
    if cfg.name != name {
        return Err(ErrorKind::StreamMismatch.err());
    }
    cfg.normalize()
}

/// `pedantic: true` asks the server to refuse rather than adjust a config; Keel adjusts, so
/// the request is refused as unsupported instead of being silently treated as non-pedantic.
fn refuse_pedantic(body: &[u8]) -> Result<(), ApiError> {
    #[derive(Deserialize)]
    struct Pedantic {
        #[serde(default)]
        pedantic: Option<bool>,
    }
    match serde_json::from_slice::<Pedantic>(body) {
        Ok(Pedantic {
            pedantic: Some(true),
        }) => Err(ApiError::not_supported("pedantic mode")),
        _ => Ok(()),
    }
}

fn check_overlap(js: &JetStream, cfg: &StreamConfig) -> Result<(), ApiError> {
    for other in js.streams() {
        if other.name == cfg.name {
            continue;
        }
        let oc = other.config();
        for a in &cfg.subjects {
            if oc.subjects.iter().any(|b| stream::subjects_overlap(a, b)) {
                return Err(ErrorKind::SubjectsOverlap.err());
            }
        }
    }
    Ok(())
}

/// Server-wide storage limits: a stream's max_bytes is a reservation against them.
fn check_resources(
    js: &JetStream,
    cfg: &StreamConfig,
    except: Option<&str>,
) -> Result<(), ApiError> {
    let (limit, err) = match cfg.storage {
        StorageType::Memory => (js.max_memory, ErrorKind::InsufficientMemory.err()),
        StorageType::File => (js.max_store, ErrorKind::InsufficientStorage.err()),
    };
    if limit < 0 {
        return Ok(());
    }
    if cfg.max_bytes > limit {
        return Err(err);
    }
    let reserved = js.reserved(cfg.storage, except);
    if cfg.max_bytes > 0 && reserved + cfg.max_bytes > limit {
        return Err(err);
    }
    Ok(())
}

async fn stream_create(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    name: &str,
    body: &[u8],
) -> Result<Fields, ApiError> {
    let mut cfg = parse_config(js, name, body)?;
    if cfg.mirror_direct && cfg.mirror.is_none() {
        return Err(
            ErrorKind::InvalidConfig.with("stream has no mirror but does have mirror direct")
        );
    }
    sourcing::check_with_streams(js, &mut cfg)?;
    if let Some(existing) = js.stream(name) {
        let mut current = (*existing.config()).clone();
        current.metadata.remove(stream::REQ_LEVEL_KEY);
        let mut wanted = cfg.clone();
        wanted.metadata.remove(stream::REQ_LEVEL_KEY);
        if current != wanted {
            return Err(ErrorKind::StreamNameInUse.err());
        }
        let mut f = stream_fields(&existing, true, None, None, false);
        f.insert("did_create".into(), true.into());
        return Ok(f);
    }
    sourcing::check_filters(&cfg)?;
    check_overlap(js, &cfg)?;
    check_resources(js, &cfg, None)?;
    let dir = js.streams_dir.join(name);
    let meta = StreamMeta {
        config: cfg,
        created: now_nanos(),
    };
    if let Err(e) = stream::write_meta(&js.meta, &dir, &meta) {
        // Nothing half-made stays behind (a full disk, say) to be found at every start.
        let _ = js.meta.remove_dir_all(&dir);
        return Err(ErrorKind::StreamCreate.with(format!("could not create stream: {e}")));
    }
    let first_seq = meta.config.first_seq;
    let s = Stream::open(server, &js.account, &dir, meta, &js.settings())
        .map_err(|e| ErrorKind::StreamCreate.with(e))?;
    if first_seq > 1 {
        let r = s
            .ask(|reply| stream::Command::SkipTo {
                next: first_seq,
                reply,
            })
            .await
            .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()));
        if let Err(e) = r {
            // Not listed: it goes again, with what it wrote.
            s.destroy().await;
            let _ = js.meta.remove_dir_all(&dir);
            return Err(e);
        }
    }
    js.registry.insert_stream(&js.account.name, s.clone());
    advisory::stream_action(server, router, name, advisory::Action::Create);
    let mut f = stream_fields(&s, true, None, None, false);
    f.insert("did_create".into(), true.into());
    Ok(f)
}

async fn stream_update(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    name: &str,
    body: &[u8],
) -> Result<Fields, ApiError> {
    let mut cfg = parse_config(js, name, body)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let old = s.config();
    old.check_update(&cfg)?;
    if cfg.mirror_direct && cfg.mirror.is_none() {
        return Err(
            ErrorKind::InvalidConfig.with("stream has no mirror but does have mirror direct")
        );
    }
    sourcing::check_with_streams(js, &mut cfg)?;
    check_consumer_limits(js, &s, &old, &cfg)?;
    check_overlap(js, &cfg)?;
    check_resources(js, &cfg, Some(name))?;
    // The actor writes the config first and only then makes it live.
    s.ask(|reply| stream::Command::Update {
        cfg: Box::new(cfg),
        reply,
    })
    .await
    .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()))?;
    advisory::stream_action(server, router, name, advisory::Action::Update);
    Ok(stream_fields(&s, true, None, None, false))
}

/// Lowering a stream's `consumer_limits` below what an existing consumer uses is refused,
/// naming the consumers (the reference's check and text).
fn check_consumer_limits(
    js: &JetStream,
    s: &Stream,
    old: &StreamConfig,
    new: &StreamConfig,
) -> Result<(), ApiError> {
    let (oi, ni) = (
        old.consumer_limits.inactive_threshold,
        new.consumer_limits.inactive_threshold,
    );
    let (om, nm) = (
        old.consumer_limits.max_ack_pending,
        new.consumer_limits.max_ack_pending,
    );
    if !((ni > 0 && ni != oi) || (nm > 0 && nm != om)) {
        return Ok(());
    }
    let violating: Vec<String> = js
        .consumers_of(&s.name)
        .iter()
        .filter(|c| {
            let cfg = c.config();
            (ni > 0 && cfg.inactive_threshold > ni) || (nm > 0 && cfg.max_ack_pending > nm)
        })
        .map(|c| c.name.clone())
        .collect();
    if violating.is_empty() {
        return Ok(());
    }
    Err(ErrorKind::UpdateFailed.with(format!(
        "change to limits violates consumers: {}",
        violating.join(", ")
    )))
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct InfoRequest {
    subjects_filter: Option<String>,
    deleted_details: bool,
    offset: usize,
}

fn stream_info(js: &JetStream, name: &str, body: &[u8]) -> Result<Fields, ApiError> {
    let req: InfoRequest = parse_request(body, &schema::STREAM_INFO, js.strict)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let mut f = Fields::new();
    let mut inner_fields = stream_fields(
        &s,
        true,
        Some(js),
        req.subjects_filter.as_deref(),
        req.deleted_details,
    );
    // Paging applies to the subjects map when one was asked for.
    let (total, limit) = match &req.subjects_filter {
        Some(_) => {
            const SUBJECTS_LIMIT: usize = 100_000;
            let state = inner_fields.get_mut("state").and_then(Value::as_object_mut);
            let total = state
                .as_ref()
                .and_then(|s| s.get("subjects"))
                .and_then(Value::as_object)
                .map_or(0, |m| m.len());
            if let Some(Value::Object(subjects)) = state.and_then(|s| s.get_mut("subjects")) {
                if req.offset > 0 || subjects.len() > SUBJECTS_LIMIT {
                    let kept: Map<String, Value> = std::mem::take(subjects)
                        .into_iter()
                        .skip(req.offset)
                        .take(SUBJECTS_LIMIT)
                        .collect();
                    *subjects = kept;
                }
            }
            (total, SUBJECTS_LIMIT)
        }
        None => (0, 0),
    };
    f.insert("total".into(), total.into());
    f.insert(
        "offset".into(),
        if req.subjects_filter.is_some() {
            req.offset
        } else {
            0
        }
        .into(),
    );
    f.insert("limit".into(), limit.into());
    f.extend(inner_fields);
    Ok(f)
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ListRequest {
    offset: usize,
    subject: Option<String>,
}

fn filtered_streams(js: &JetStream, subject: Option<&str>) -> Vec<Arc<Stream>> {
    js.streams()
        .into_iter()
        .filter(|s| match subject {
            None | Some("") => true,
            Some(f) => s
                .config()
                .subjects
                .iter()
                .any(|x| stream::subjects_overlap(x, f)),
        })
        .collect()
}

fn stream_names(js: &JetStream, body: &[u8]) -> Result<Fields, ApiError> {
    let req: ListRequest = parse_request(body, &schema::STREAM_NAMES, js.strict)?;
    let all = filtered_streams(js, req.subject.as_deref());
    // The reference sends null, not [], when no stream matches.
    Ok(page(&all, req.offset, NAMES_LIMIT, "streams", true, |s| {
        Value::from(s.name.clone())
    }))
}

fn stream_list(js: &JetStream, body: &[u8]) -> Result<Fields, ApiError> {
    let req: ListRequest = parse_request(body, &schema::STREAM_NAMES, js.strict)?;
    let all = filtered_streams(js, req.subject.as_deref());
    Ok(page(&all, req.offset, LIST_LIMIT, "streams", false, |s| {
        Value::Object(stream_fields(s, false, None, None, false))
    }))
}

async fn stream_delete(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    name: &str,
) -> Result<Fields, ApiError> {
    let (s, consumers) = js
        .registry
        .remove_stream(&js.account.name, name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    // Its actor keeps taking commands while the stream is torn down.
    let tx = s.commands();
    s.stop_sourcing();
    s.unsubscribe();
    // Its consumers go with it: subscriptions removed, tasks ended (waited for), waiting
    // pulls told `409 Consumer Deleted` (the reference). Their state is under the stream's
    // directory.
    for r in &consumers {
        r.consumer.stop(server, router);
        advisory::consumer_action(
            server,
            router,
            name,
            &r.consumer.name,
            advisory::Action::Delete,
        );
    }
    for r in consumers {
        r.join().await;
    }
    // Then the stream: its actor destroys the store and ends.
    s.destroy().await;
    drop(tx);
    if let Err(e) = js.meta.remove_dir_all(&s.dir) {
        crate::error!(
            server.log,
            "Stream {name}: could not remove {}: {e}",
            s.dir.display()
        );
    }
    advisory::stream_action(server, router, name, advisory::Action::Delete);
    let mut f = Fields::new();
    f.insert("success".into(), true.into());
    Ok(f)
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PurgeRequest {
    filter: Option<String>,
    seq: Option<u64>,
    keep: Option<u64>,
}

async fn stream_purge(js: &JetStream, name: &str, body: &[u8]) -> Result<Fields, ApiError> {
    let req: PurgeRequest = parse_request(body, &schema::STREAM_PURGE, js.strict)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let req = Purge {
        filter: req.filter,
        seq: req.seq,
        keep: req.keep,
    };
    let purged = s
        .ask(|reply| stream::Command::Purge { req, reply })
        .await
        .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()))?;
    let mut f = Fields::new();
    f.insert("success".into(), true.into());
    f.insert("purged".into(), purged.into());
    Ok(f)
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct MsgGetRequest {
    seq: Option<u64>,
    last_by_subj: Option<String>,
    next_by_subj: Option<String>,
}

fn load_for_get(
    store: &dyn keel_store::Store,
    req: &MsgGetRequest,
) -> Result<keel_store::StoredMsg, StoreError> {
    match (req.seq, &req.last_by_subj, &req.next_by_subj) {
        (Some(seq), None, None) => store.load(seq),
        (seq, None, Some(subj)) => store.load_next(seq.unwrap_or(0).max(1), subj),
        (None, Some(subj), None) => store.load_last(subj),
        _ => Err(StoreError::NotFound),
    }
}

fn msg_get(js: &JetStream, name: &str, body: &[u8]) -> Result<Fields, ApiError> {
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
    let mut m = Map::new();
    m.insert(
        "subject".into(),
        String::from_utf8_lossy(&msg.subject).into_owned().into(),
    );
    m.insert("seq".into(), msg.seq.into());
    if !msg.hdr.is_empty() {
        m.insert("hdrs".into(), b64.encode(&msg.hdr).into());
    }
    if !msg.data.is_empty() {
        m.insert("data".into(), b64.encode(&msg.data).into());
    }
    m.insert("time".into(), rfc3339(msg.ts).into());
    let mut f = Fields::new();
    f.insert("message".into(), Value::Object(m));
    Ok(f)
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct MsgDeleteRequest {
    seq: u64,
    no_erase: bool,
}

async fn msg_delete(js: &JetStream, name: &str, body: &[u8]) -> Result<Fields, ApiError> {
    let req: MsgDeleteRequest = parse_request(body, &schema::MSG_DELETE, js.strict)?;
    let s = js
        .stream(name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    s.ask(|reply| stream::Command::DeleteMsg {
        seq: req.seq,
        erase: !req.no_erase,
        reply,
    })
    .await
    .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()))?;
    let mut f = Fields::new();
    f.insert("success".into(), true.into());
    Ok(f)
}

fn status(code: &str) -> Vec<u8> {
    format!("NATS/1.0 {code}\r\n\r\n").into_bytes()
}

fn direct_get(
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
            let _ = api::normalize(&mut v, &schema::MSG_GET, false);
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

impl JetStream {
    /// Removes a consumer (with `created`, only that incarnation): stops it, waits for its
    /// task, deletes its saved state. False when there is no such consumer.
    pub async fn delete_consumer(
        &self,
        server: &Server,
        router: &mut Router,
        stream: &Stream,
        name: &str,
        created: Option<i64>,
    ) -> bool {
        let Some(r) =
            self.registry
                .remove_consumer(&self.account.name, &stream.name, name, created)
        else {
            return false;
        };
        r.consumer.stop(server, router);
        advisory::consumer_action(server, router, &stream.name, name, advisory::Action::Delete);
        r.join().await;
        let dir = stream.dir.join("consumers").join(name);
        if dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                crate::error!(
                    server.log,
                    "Could not remove consumer data {}: {e}",
                    dir.display()
                );
            }
        }
        if stream.retention() == stream::Retention::Interest {
            // What no remaining consumer needs goes (the stream's actor decides).
            if let Some(tx) = stream.commands() {
                let _ = tx.send(stream::Command::ReleaseInterest).await;
            }
        }
        true
    }
}

/// Go reports a string where a duration (nanoseconds) belongs by its field path; clients
/// show that text, so name the field the same way.
fn check_duration_fields(body: &[u8]) -> Result<(), ApiError> {
    let Ok(Value::Object(req)) = serde_json::from_slice::<Value>(body) else {
        return Ok(());
    };
    let Some(Value::Object(cfg)) = req.get("config") else {
        return Ok(());
    };
    for field in [
        "ack_wait",
        "idle_heartbeat",
        "inactive_threshold",
        "max_expires",
    ] {
        if cfg.get(field).is_some_and(Value::is_string) {
            return Err(ErrorKind::InvalidJson.with(format!("json: cannot unmarshal string into Go struct field CreateConsumerRequest.config.{field} of type time.Duration"
                )));
        }
    }
    Ok(())
}

fn consumer_not_found() -> ApiError {
    ErrorKind::ConsumerNotFound.err()
}

/// An ephemeral consumer's generated name (the reference uses 8 random characters).
fn random_name() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    (0..8)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn consumer_create_durable(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    stream: &str,
    durable: &str,
    body: &[u8],
) -> Result<Fields, ApiError> {
    check_duration_fields(body)?;
    let mut req: consumer::CreateRequest =
        parse_request(body, &schema::CONSUMER_CREATE, js.strict)?;
    refuse_pedantic(body)?;
    if req.stream_name != stream {
        return Err(ErrorKind::StreamMismatch.err());
    }
    let cfg = req.config.get_or_insert_with(Default::default);
    match cfg.durable_name.as_deref() {
        None | Some("") => return Err(ErrorKind::ConsumerDurableNotSet.err()),
        Some(d) if d != durable => return Err(ErrorKind::ConsumerDurableMismatch.err()),
        _ => {}
    }
    create_consumer(js, server, router, stream, Some(durable), req)
}

fn consumer_create(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    stream: &str,
    name: Option<&str>,
    filter: Option<&str>,
    body: &[u8],
) -> Result<Fields, ApiError> {
    check_duration_fields(body)?;
    let mut req: consumer::CreateRequest =
        parse_request(body, &schema::CONSUMER_CREATE, js.strict)?;
    refuse_pedantic(body)?;
    if req.stream_name != stream {
        return Err(ErrorKind::StreamMismatch.err());
    }
    // A request without a config gets Go's zero config (ack none), as with the reference.
    let cfg = req.config.get_or_insert_with(Default::default);
    match name {
        None => {
            if cfg.durable_name.as_deref().is_some_and(|d| !d.is_empty()) {
                return Err(ErrorKind::ConsumerEphemeralWithDurable.err());
            }
        }
        Some(n) => {
            // A durable name must match the subject; a plain name is overridden by it.
            if cfg
                .durable_name
                .as_deref()
                .is_some_and(|d| !d.is_empty() && d != n)
            {
                return Err(ErrorKind::ConsumerDurableMismatch.err());
            }
            cfg.name = Some(n.to_string());
        }
    }
    if let Some(f) = filter {
        if !cfg.filter_subjects.is_empty() {
            return Err(ErrorKind::ConsumerMultipleFilters.err());
        }
        let cf = cfg.filters();
        let matches = (cf.len() == 1 && cf[0] == f) || (cf.is_empty() && f == ">");
        if !matches {
            return Err(ErrorKind::ConsumerFilterMismatch.err());
        }
    }
    create_consumer(js, server, router, stream, name, req)
}

fn create_consumer(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    router: &mut Router,
    stream_name: &str,
    name: Option<&str>,
    req: consumer::CreateRequest,
) -> Result<Fields, ApiError> {
    if !matches!(req.action.as_str(), "" | "create" | "update") {
        return Err(
            ErrorKind::InvalidJson.with(format!("unknown consumer action: {:?}", req.action))
        );
    }
    let s = js
        .stream(stream_name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let scfg = s.config();
    let mut cfg = req.config.expect("checked by callers");
    if let Some(n) = name {
        if cfg.name.as_deref().unwrap_or("").is_empty() {
            cfg.name = Some(n.to_string());
        }
    }
    if let Some(d) = cfg.durable_name.clone().filter(|d| !d.is_empty()) {
        cfg.name = Some(d);
    }
    let cfg = cfg.normalize(scfg.retention)?;
    if let Some(ds) = &cfg.deliver_subject {
        // Delivering into the stream's own subjects would store every delivery again.
        if scfg
            .subjects
            .iter()
            .any(|s| stream::subjects_overlap(s, ds))
        {
            return Err(ErrorKind::ConsumerDeliverCycle.err());
        }
    }
    let name = cfg.name.clone().unwrap_or_else(random_name);
    let durable = cfg.durable_name.is_some();
    let mut stored_cfg = cfg.clone();
    if !durable && name.len() == 8 && cfg.name.is_none() {
        stored_cfg.name = None;
    }
    let existing = js.consumer(stream_name, &name);
    if let Some(c) = existing {
        let mut current = c.config();
        // An update never changes the pause (that is what CONSUMER.PAUSE is for).
        stored_cfg.pause_until = current.pause_until.clone();
        stored_cfg.set_req_level();
        current.metadata.remove(stream::REQ_LEVEL_KEY);
        let mut wanted = stored_cfg.clone();
        wanted.metadata.remove(stream::REQ_LEVEL_KEY);
        if current == wanted {
            return Ok(c.info(server, true));
        }
        if req.action == "create" {
            return Err(ErrorKind::ConsumerAlreadyExists.err());
        }
        current.check_update(&wanted)?;
        wanted.check_supported()?;
        c.set_config(stored_cfg);
        c.persist_meta()
            .map_err(|e| ErrorKind::ConsumerCreate.with(format!("could not save consumer: {e}")))?;
        c.notify();
        return Ok(c.info(server, true));
    }
    if req.action == "update" {
        return Err(ErrorKind::ConsumerDoesNotExist.err());
    }
    cfg.check_supported()?;
    let consumers = js.consumers_of(stream_name);
    if scfg.max_consumers > 0 && consumers.len() as i64 >= scfg.max_consumers {
        return Err(ErrorKind::MaxConsumers.err());
    }
    if scfg.retention == stream::Retention::Workqueue {
        let mine = cfg.filters();
        for o in &consumers {
            let theirs = o.config().filters();
            if mine.is_empty() && theirs.is_empty() {
                return Err(ErrorKind::WorkqueueMultipleUnfiltered.err());
            }
            let all = [">".to_string()];
            let mine = if mine.is_empty() { &all[..] } else { &mine[..] };
            let theirs = if theirs.is_empty() {
                &all[..]
            } else {
                &theirs[..]
            };
            if mine
                .iter()
                .any(|a| theirs.iter().any(|b| stream::subjects_overlap(a, b)))
            {
                return Err(ErrorKind::WorkqueueNotUnique.err());
            }
        }
    }
    // Durable consumers of file streams keep their state on disk.
    let dir = (durable && scfg.storage == StorageType::File && !cfg.mem_storage)
        .then(|| s.dir.join("consumers").join(&name));
    let meta = consumer::ConsumerMeta {
        config: stored_cfg,
        created: now_nanos(),
    };
    let cdir = dir.clone();
    let (c, task) =
        consumer::Consumer::start(server, &s, name.clone(), meta, dir, js.registry.requests());
    if let Err(e) = c.persist_meta() {
        // A create that fails (a full disk) leaves nothing behind.
        c.stop(server, router);
        drop(task);
        if let Some(d) = cdir {
            if let Err(e) = js.meta.remove_dir_all(&d) {
                crate::error!(
                    server.log,
                    "Could not remove consumer data {}: {e}",
                    d.display()
                );
            }
        }
        return Err(ErrorKind::ConsumerStore.with(e));
    }
    if !js
        .registry
        .insert_consumer(&js.account.name, stream_name, c.clone(), task)
    {
        c.stop(server, router);
        return Err(ErrorKind::StreamNotFound.err());
    }
    advisory::consumer_action(server, router, stream_name, &name, advisory::Action::Create);
    Ok(c.info(server, true))
}

fn find_consumer(
    js: &JetStream,
    stream: &str,
    name: &str,
) -> Result<Arc<consumer::Consumer>, ApiError> {
    js.stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    js.consumer(stream, name)
        .ok_or_else(|| ErrorKind::ConsumerNotFound.err())
}

fn consumer_info(
    js: &JetStream,
    server: &Server,
    stream: &str,
    name: &str,
) -> Result<Fields, ApiError> {
    Ok(find_consumer(js, stream, name)?.info(server, true))
}

fn consumer_names(js: &JetStream, stream: &str, body: &[u8]) -> Result<Fields, ApiError> {
    let req: ListRequest = parse_request(body, &schema::CONSUMER_NAMES, js.strict)?;
    js.stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let all = js.consumers_of(stream);
    Ok(page(
        &all,
        req.offset,
        NAMES_LIMIT,
        "consumers",
        false,
        |c| Value::from(c.name.clone()),
    ))
}

fn consumer_list(
    js: &JetStream,
    server: &Server,
    stream: &str,
    body: &[u8],
) -> Result<Fields, ApiError> {
    let req: ListRequest = parse_request(body, &schema::CONSUMER_NAMES, js.strict)?;
    js.stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    let all = js.consumers_of(stream);
    Ok(page(
        &all,
        req.offset,
        LIST_LIMIT,
        "consumers",
        false,
        |c| Value::Object(c.info(server, false)),
    ))
}

/// A paged NAMES/LIST response: `total, offset, limit` and one page of `key`. With
/// `null_if_empty` an empty page is `null`, as the reference writes for STREAM.NAMES.
fn page<T>(
    all: &[T],
    offset: usize,
    limit: usize,
    key: &str,
    null_if_empty: bool,
    item: impl Fn(&T) -> Value,
) -> Fields {
    let items: Vec<Value> = all.iter().skip(offset).take(limit).map(item).collect();
    let mut f = Fields::new();
    f.insert("total".into(), all.len().into());
    f.insert("offset".into(), offset.into());
    f.insert("limit".into(), limit.into());
    f.insert(
        key.into(),
        if items.is_empty() && null_if_empty {
            Value::Null
        } else {
            Value::Array(items)
        },
    );
    f
}

/// `$JS.API.CONSUMER.PAUSE.<stream>.<consumer>` `{"pause_until": <time>}`: pauses
/// deliveries until then; no time (or a past one) resumes. The response is the whole body.
fn consumer_pause(
    js: &JetStream,
    stream: &str,
    name: &str,
    body: &[u8],
) -> Result<Vec<u8>, ApiError> {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct PauseRequest {
        pause_until: Option<String>,
    }
    let trimmed = body.trim_ascii();
    // Like the reference, only a JSON object or array is parsed; anything else resumes.
    let req: PauseRequest = if trimmed.starts_with(b"{") || trimmed.starts_with(b"[") {
        serde_json::from_slice(body).map_err(|e| ApiError::invalid_json_body(body, &e))?
    } else {
        PauseRequest::default()
    };
    let until = match req.pause_until.as_deref() {
        Some(t) => consumer::parse_pause_until(t)?,
        None => None,
    };
    let c = find_consumer(js, stream, name)?;
    let mut cfg = c.config();
    cfg.pause_until = until.as_ref().map(|(_, text)| text.clone());
    cfg.set_req_level();
    c.set_config(cfg);
    c.persist_meta()
        .map_err(|e| ErrorKind::ConsumerStore.with(e))?;
    let (paused, remaining) = c.pause_state();
    let mut m = api::response("consumer_pause");
    m.insert("paused".into(), paused.into());
    m.insert(
        "pause_until".into(),
        until.map_or_else(|| rfc3339(0), |(_, text)| text).into(),
    );
    if paused {
        m.insert("pause_remaining".into(), remaining.into());
    }
    Ok(to_bytes(&Value::Object(m)))
}

/// `$JS.API.CONSUMER.UNPIN.<stream>.<consumer>` `{"group": <name>}`: drops the pin of a
/// pinned_client consumer so another client can take over.
fn consumer_unpin(
    js: &JetStream,
    stream: &str,
    name: &str,
    body: &[u8],
) -> Result<Fields, ApiError> {
    #[derive(Deserialize)]
    struct UnpinRequest {
        #[serde(default)]
        group: String,
    }
    let req: UnpinRequest = serde_json::from_slice(body)
        .map_err(|e| ErrorKind::InvalidJson.with(api::go_json_error(body, &e, false)))?;
    if req.group.is_empty() {
        return Err(ErrorKind::InvalidJson.with("consumer group not specified"));
    }
    if !consumer::valid_group_name(&req.group) {
        return Err(consumer::invalid_group_name());
    }
    let c = find_consumer(js, stream, name)?;
    if !c.config().priority_groups.contains(&req.group) {
        return Err(ErrorKind::ConsumerPriorityGroupUnknown.err());
    }
    c.unpin();
    Ok(Fields::new())
}

async fn consumer_delete(
    js: &JetStream,
    server: &Server,
    router: &mut Router,
    stream: &str,
    name: &str,
) -> Result<Fields, ApiError> {
    let s = js
        .stream(stream)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    if !js.delete_consumer(server, router, &s, name, None).await {
        return Err(consumer_not_found());
    }
    let mut f = Fields::new();
    f.insert("success".into(), true.into());
    Ok(f)
}
