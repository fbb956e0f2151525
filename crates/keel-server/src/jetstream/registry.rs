//! The registry: account -> streams -> consumers, and the only place that creates,
//! recovers and deletes them. Everything else looks streams and consumers up here and gets
//! `Arc`s cloned out of the lock; nothing is locked while the registry's lock is held.
//!
//! No `Arc` cycles: a stream does not hold its consumers (the registry does); a consumer
//! holds its stream, never the registry. A consumer that must go (inactive threshold) sends
//! a [`Request`] on the registry's channel and ends; the registry's task removes it.
//! Deleting a stream stops each of its consumers and waits for their tasks before the
//! stream itself goes.
//!
//! Streams are keyed by account: one registry serves every account with JetStream (each
//! account's `JetStream` looks up only its own), so two accounts' streams of one name are
//! two streams; the usage of each account adds up to the server's (for its limits).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio::task::JoinHandle;

use super::api::{ApiError, ErrorKind};
use super::consumer::{self, Consumer};
use super::stream::{self, StorageType, Stream, StreamConfig, StreamMeta};
use super::{advisory, JetStream};
use crate::router::Router;
use crate::server::Server;
use crate::time::now_nanos;

/// Bytes an account's streams hold, per storage type, kept up to date by the streams
/// themselves (each adds the change of its own size), so the store budget and account info
/// need not visit every stream.
#[derive(Default)]
pub struct JsUsage {
    memory: AtomicU64,
    file: AtomicU64,
    /// The server's usage, which an account's is part of (None for the server's own).
    total: Option<Arc<JsUsage>>,
}

impl JsUsage {
    fn of(&self, storage: StorageType) -> &AtomicU64 {
        match storage {
            StorageType::Memory => &self.memory,
            StorageType::File => &self.file,
        }
    }

    /// A stream of `storage` went from `old` to `new` bytes.
    pub fn change(&self, storage: StorageType, old: u64, new: u64) {
        if let Some(t) = &self.total {
            t.change(storage, old, new);
        }
        let a = self.of(storage);
        if new >= old {
            a.fetch_add(new - old, Ordering::Relaxed);
        } else {
            let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(old - new))
            });
        }
    }

    pub fn bytes(&self, storage: StorageType) -> u64 {
        self.of(storage).load(Ordering::Relaxed)
    }
}

/// What a stream may know of one of its consumers: its state, read-only, for retention
/// decisions (interest and work-queue streams). Not the consumer (no cycle), and no lock of
/// the stream is held while it is read.
#[derive(Clone)]
pub struct ConsumerView {
    pub name: String,
    state: Arc<Mutex<consumer::State>>,
}

impl ConsumerView {
    pub fn new(name: String, state: Arc<Mutex<consumer::State>>) -> ConsumerView {
        ConsumerView { name, state }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, consumer::State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The consumer's subject filters (empty: all).
    pub fn filters(&self) -> Vec<String> {
        self.lock().config.filters()
    }

    /// Has the consumer finished with `seq` (acked, or past it and not pending)? True when
    /// the subject is not one it wants.
    pub fn is_done_with(&self, seq: u64, subject: &[u8]) -> bool {
        self.lock().is_done_with(seq, subject)
    }

    /// The stream sequence of its ack floor.
    pub fn ack_floor(&self) -> u64 {
        self.lock().floor_seq()
    }

    /// Does it want messages on `subject` at all?
    pub fn wants(&self, subject: &[u8]) -> bool {
        self.lock().matches(subject)
    }
}

/// The consumers of one stream as the stream sees them, maintained by the registry.
#[derive(Default)]
pub struct ConsumerSet(RwLock<Arc<Vec<ConsumerView>>>);

impl ConsumerSet {
    pub fn views(&self) -> Arc<Vec<ConsumerView>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn len(&self) -> usize {
        self.0.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn set(&self, views: Vec<ConsumerView>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(views);
    }
}

/// Asked of the registry's task.
pub enum Request {
    /// A consumer's inactive threshold passed: remove it (`created` tells it from a newer
    /// consumer of the same name).
    DeleteConsumer {
        account: String,
        stream: String,
        name: String,
        created: i64,
    },
}

/// How many requests may wait for the registry's task.
pub const REQUEST_QUEUE: usize = 256;

struct ConsumerSlot {
    consumer: Arc<Consumer>,
    task: Option<JoinHandle<()>>,
}

struct StreamSlot {
    stream: Arc<Stream>,
    consumers: BTreeMap<String, ConsumerSlot>,
}

impl StreamSlot {
    fn publish_set(&self) {
        self.stream
            .consumers
            .set(self.consumers.values().map(|c| c.consumer.view()).collect());
    }
}

struct AccountStreams {
    usage: Arc<JsUsage>,
    streams: BTreeMap<String, StreamSlot>,
}

/// A consumer taken out of the registry, to be stopped and waited for.
pub struct Removed {
    pub consumer: Arc<Consumer>,
    pub task: Option<JoinHandle<()>>,
}

impl Removed {
    /// Waits for the consumer's task to end (after [`Consumer::stop`]).
    pub async fn join(self) {
        if let Some(t) = self.task {
            let _ = t.await;
        }
    }
}

pub struct Registry {
    accounts: RwLock<BTreeMap<String, AccountStreams>>,
    /// Every account's streams' bytes (for the server-wide limits).
    total: Arc<JsUsage>,
    /// Groups of replicated memory streams this server had before it restarted: their
    /// replicas come back empty and rejoin (`raft::stream::rejoin`).
    rejoining: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new()
    }
}

impl Registry {
    pub fn new() -> Registry {
        Registry {
            accounts: RwLock::new(BTreeMap::new()),
            total: Arc::new(JsUsage::default()),
            rejoining: Default::default(),
        }
    }

    fn rejoining(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.rejoining.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `group`'s replica here is one that restarted empty (and has not rejoined).
    pub fn is_rejoining(&self, group: &str) -> bool {
        self.rejoining().contains(group)
    }

    /// The replica has rejoined its group (kept until then: a replica made again before it
    /// did rejoins too, and does not form the group anew).
    pub fn rejoined(&self, group: &str) {
        self.rejoining().remove(group);
    }

    fn account_entry<'a>(
        g: &'a mut BTreeMap<String, AccountStreams>,
        total: &Arc<JsUsage>,
        account: &str,
    ) -> &'a mut AccountStreams {
        g.entry(account.to_string())
            .or_insert_with(|| AccountStreams {
                usage: Arc::new(JsUsage {
                    total: Some(total.clone()),
                    ..JsUsage::default()
                }),
                streams: BTreeMap::new(),
            })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, AccountStreams>> {
        self.accounts.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, AccountStreams>> {
        self.accounts.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The account's usage counters (created with the account's first stream).
    pub fn usage(&self, account: &str) -> Arc<JsUsage> {
        if let Some(a) = self.read().get(account) {
            return a.usage.clone();
        }
        Self::account_entry(&mut self.write(), &self.total, account)
            .usage
            .clone()
    }

    /// The server's usage: every account's streams.
    pub fn total_usage(&self) -> Arc<JsUsage> {
        self.total.clone()
    }

    /// Every account's streams (by account, then name).
    pub fn all_streams(&self) -> Vec<Arc<Stream>> {
        self.read()
            .values()
            .flat_map(|a| a.streams.values().map(|s| s.stream.clone()))
            .collect()
    }

    pub fn stream(&self, account: &str, name: &str) -> Option<Arc<Stream>> {
        self.read()
            .get(account)?
            .streams
            .get(name)
            .map(|s| s.stream.clone())
    }

    /// The account's streams, by name.
    pub fn streams(&self, account: &str) -> Vec<Arc<Stream>> {
        self.read().get(account).map_or_else(Vec::new, |a| {
            a.streams.values().map(|s| s.stream.clone()).collect()
        })
    }

    pub fn consumer(&self, account: &str, stream: &str, name: &str) -> Option<Arc<Consumer>> {
        self.read()
            .get(account)?
            .streams
            .get(stream)?
            .consumers
            .get(name)
            .map(|c| c.consumer.clone())
    }

    /// A stream's consumers, by name.
    pub fn consumers(&self, account: &str, stream: &str) -> Vec<Arc<Consumer>> {
        let g = self.read();
        let Some(s) = g.get(account).and_then(|a| a.streams.get(stream)) else {
            return Vec::new();
        };
        s.consumers.values().map(|c| c.consumer.clone()).collect()
    }

    /// Lists a stream (created or recovered). False if the name is taken.
    pub fn insert_stream(&self, account: &str, stream: Arc<Stream>) -> bool {
        let mut g = self.write();
        let a = Self::account_entry(&mut g, &self.total, account);
        if a.streams.contains_key(&stream.name) {
            return false;
        }
        a.streams.insert(
            stream.name.clone(),
            StreamSlot {
                stream,
                consumers: BTreeMap::new(),
            },
        );
        true
    }

    /// Unlists a stream and its consumers (the caller stops and waits for them).
    pub fn remove_stream(&self, account: &str, name: &str) -> Option<(Arc<Stream>, Vec<Removed>)> {
        let slot = self.write().get_mut(account)?.streams.remove(name)?;
        slot.stream.consumers.set(Vec::new());
        let removed = slot
            .consumers
            .into_values()
            .map(|c| Removed {
                consumer: c.consumer,
                task: c.task,
            })
            .collect();
        Some((slot.stream, removed))
    }

    /// Lists a started consumer under its stream. False when the stream is gone or the
    /// name is taken.
    pub fn insert_consumer(
        &self,
        account: &str,
        stream: &str,
        consumer: Arc<Consumer>,
        task: JoinHandle<()>,
    ) -> bool {
        let mut g = self.write();
        let Some(s) = g.get_mut(account).and_then(|a| a.streams.get_mut(stream)) else {
            return false;
        };
        if s.consumers.contains_key(&consumer.name) {
            return false;
        }
        s.consumers.insert(
            consumer.name.clone(),
            ConsumerSlot {
                consumer,
                task: Some(task),
            },
        );
        s.publish_set();
        true
    }

    /// Unlists a consumer; with `created`, only that incarnation of the name.
    pub fn remove_consumer(
        &self,
        account: &str,
        stream: &str,
        name: &str,
        created: Option<i64>,
    ) -> Option<Removed> {
        let mut g = self.write();
        let s = g.get_mut(account)?.streams.get_mut(stream)?;
        let c = s.consumers.get(name)?;
        if created.is_some_and(|t| t != c.consumer.created) {
            return None;
        }
        let c = s.consumers.remove(name)?;
        s.publish_set();
        Some(Removed {
            consumer: c.consumer,
            task: c.task,
        })
    }
}

// ---- lifecycle ------------------------------------------------------------------------

/// Recovers every stream found in the JetStream's directory, and their durable consumers.
/// Damage never deletes a stream: a directory that cannot be read stays for an operator.
pub fn recover(js: &JetStream, server: &Arc<Server>) -> Result<(), String> {
    let entries = std::fs::read_dir(&js.streams_dir)
        .map_err(|e| format!("cannot read {}: {e}", js.streams_dir.display()))?;
    for entry in entries.flatten() {
        let dir = entry.path();
        if !dir.is_dir() {
            continue;
        }
        if remove_retired(&js.meta, &dir, &server.log) {
            continue;
        }
        let meta = match stream::read_meta(&js.meta, &dir, &server.log) {
            Ok(m) => m,
            Err(e) => {
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
            // Memory streams do not outlive the process, as with the reference. A
            // replicated one is made again from its assignment, and its replica here
            // rejoins its group empty.
            if let Some(spec) = &meta.cluster {
                crate::info!(
                    server.log,
                    "  Memory stream {name} (group {}) is gone with the restart: its replica rejoins the group empty",
                    spec.group
                );
                js.registry.rejoining().insert(spec.group.clone());
                // Its durables' configs stay (as the reference keeps their assignments):
                // made again, the stream's leader starts them from these, with no state.
                keep_consumer_configs(&js.meta, &dir, &server.log);
            } else {
                let _ = js.meta.remove_dir_all(&dir);
            }
            continue;
        }
        match Stream::open(server, &js.account, &dir, meta, &js.settings()) {
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
                js.registry.insert_stream(&js.account.name, s.clone());
                // A replicated stream's consumers run where it leads, from then on.
                if s.group.is_none() {
                    recover_consumers(js, server, &s);
                }
                s.start_sources();
            }
            Err(e) => crate::error!(server.log, "Could not restore stream {name}: {e}"),
        }
    }
    Ok(())
}

/// Stops a replicated stream's consumers here (this server no longer leads it), keeping
/// their files: the group's state machine keeps them current from the new leader.
pub async fn stop_consumers(js: &JetStream, server: &Server, stream: &Stream) {
    let mut router = Router::new(js.account.clone(), 0x5343);
    for c in js.registry.consumers(&js.account.name, &stream.name) {
        if let Some(r) = js
            .registry
            .remove_consumer(&js.account.name, &stream.name, &c.name, None)
        {
            r.consumer.stop_for_move(server, &mut router);
            r.join().await;
        }
    }
    router.flush();
}

/// Takes a stream off this server and keeps its files (JetStream disabled here): unlisted,
/// its sources' positions saved, its group left, its consumers' state saved and each
/// stopped, then unsubscribed, so its actor ends and closes its store.
pub async fn unload_stream(js: &JetStream, server: &Server, router: &mut Router, name: &str) {
    let Some((s, consumers)) = js.registry.remove_stream(&js.account.name, name) else {
        return;
    };
    s.save_source_positions(true);
    s.stop_sourcing();
    if let Some(r) = s.replica.get() {
        r.stop_group().await;
    }
    for r in &consumers {
        r.consumer.flush_state();
        r.consumer.stop_for_move(server, router);
    }
    for r in consumers {
        r.join().await;
    }
    s.unsubscribe();
}

/// Empties a memory stream's directory but for its consumers' config files (read back
/// through `consumer::read_meta`; a consumer without a readable one goes entirely).
fn keep_consumer_configs(
    files: &keel_store::MetaFiles,
    dir: &std::path::Path,
    log: &crate::log::Log,
) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_name() != "consumers" {
            let p = e.path();
            let _ = if p.is_dir() {
                files.remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
    let consumers = dir.join("consumers");
    for c in std::fs::read_dir(&consumers)
        .into_iter()
        .flatten()
        .flatten()
    {
        let cdir = c.path();
        if remove_retired(files, &cdir, log) {
            continue;
        }
        if consumer::read_meta(files, &cdir, log).is_err() {
            let _ = files.remove_dir_all(&cdir);
            continue;
        }
        for f in std::fs::read_dir(&cdir).into_iter().flatten().flatten() {
            if !f.file_name().to_string_lossy().starts_with("meta.json") {
                let _ = std::fs::remove_file(f.path());
            }
        }
    }
}

/// A stream's or consumer's directory whose removal did not finish (`MetaFiles::retire_dir`)
/// is removed now, never loaded: true if `dir` was one.
pub fn remove_retired(
    files: &keel_store::MetaFiles,
    dir: &std::path::Path,
    log: &crate::log::Log,
) -> bool {
    if !keel_store::MetaFiles::is_retired(dir) {
        return false;
    }
    match files.remove_dir_all(dir) {
        Ok(()) => crate::info!(log, "Removed {}, deleted before", dir.display()),
        Err(e) => crate::error!(
            log,
            "Could not remove {} (deleted before, not loaded): {e}",
            dir.display()
        ),
    }
    true
}

/// Restarts the durable consumers saved under a recovered stream's directory (and a
/// replicated stream's, where it now leads).
pub fn recover_consumers(js: &JetStream, server: &Arc<Server>, stream: &Arc<Stream>) {
    let dir = stream.dir.join("consumers");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    for e in entries.flatten() {
        let cdir = e.path();
        if remove_retired(&js.meta, &cdir, &server.log) {
            continue;
        }
        match consumer::read_meta(&js.meta, &cdir, &server.log) {
            Ok(meta) => {
                let name = e.file_name().to_string_lossy().into_owned();
                let (c, task) =
                    Consumer::start(server, stream, name, meta, Some(cdir), js.requests.clone());
                js.registry
                    .insert_consumer(&js.account.name, &stream.name, c, task);
            }
            Err(_) if stream::leftover(&cdir) => {
                // An interrupted create (an older Keel left these on a full disk).
                crate::warn!(
                    server.log,
                    "Removing {}: a consumer directory with no config in it",
                    cdir.display()
                );
                let _ = js.meta.remove_dir_all(&cdir);
            }
            Err(err) => {
                crate::error!(server.log, "Skipping consumer in {}: {err}", cdir.display())
            }
        }
    }
}

/// Creates a stream from a checked config: the config is written first (a create that
/// fails, on a full disk say, leaves nothing behind), then the store is opened and its actor
/// started, its first sequence set, and only then is it listed. Its sources start reading
/// at `start_sources` (once the caller has shown the stream as created).
pub async fn create_stream(
    js: &Arc<JetStream>,
    server: &Arc<Server>,
    cfg: StreamConfig,
) -> Result<Arc<Stream>, ApiError> {
    let name = cfg.name.clone();
    let dir = js.streams_dir.join(&name);
    // Clustered: a replicated stream's group, from its assignment.
    let assignment = server
        .jetstream
        .get()
        .and_then(|j| j.meta.get())
        .and_then(|m| m.assignment(&js.account.name, &name));
    // Every replica takes its creation time from the assignment (the meta leader's
    // clock): stream info says the same on every server, and so does the identity that
    // streams sourcing it keep in their `Nats-Stream-Source` headers (a replica with its
    // own would look like the origin made anew, and its sources would start over).
    let created = assignment
        .as_ref()
        .map(|a| a.created)
        .filter(|c| *c > 0)
        .unwrap_or_else(now_nanos);
    let regrouped = assignment.as_ref().is_some_and(|a| a.regrouped);
    let group = assignment.filter(|a| !a.group.is_empty()).map(|a| {
        crate::jetstream::raft::stream::GroupSpec {
            group: a.group,
            peers: a.peers,
        }
    });
    // (Not a replica rebuilt after damage: its group exists already, see
    // `raft::stream::rebuild`.)
    let held = |g: &str| {
        server
            .jetstream
            .get()
            .and_then(|j| j.meta.get())
            .is_some_and(|m| m.host.votes_held(g))
    };
    let bootstrap = !regrouped
        && group.as_ref().is_some_and(|g| {
            g.peers.first() == Some(&server.server_name)
                && !held(&g.group)
                && !js.registry.is_rejoining(&g.group)
        });
    let meta = StreamMeta {
        config: cfg,
        created,
        cluster: group,
        bootstrap,
    };
    if let Err(e) = stream::write_meta(&js.meta, &dir, &meta) {
        let _ = js.meta.remove_dir_all(&dir);
        return Err(ErrorKind::StreamCreate.with(format!("could not create stream: {e}")));
    }
    let first_seq = meta.config.first_seq;
    let s = Stream::open(server, &js.account, &dir, meta, &js.settings())
        .map_err(|e| ErrorKind::StreamCreate.with(e))?;
    // (A replicated stream's replicas start there themselves, in `Stream::open`.)
    if first_seq > 1 && s.group.is_none() {
        let r = s
            .ask(|reply| stream::Command::SkipTo {
                next: first_seq,
                reply,
            })
            .await
            .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()));
        if let Err(e) = r {
            s.destroy(|| ()).await;
            let _ = js.meta.remove_dir_all(&dir);
            return Err(e);
        }
    }
    if !js.registry.insert_stream(&js.account.name, s.clone()) {
        s.destroy(|| ()).await;
        return Err(ErrorKind::StreamNameInUse.err());
    }
    Ok(s)
}

/// Updates a stream with a checked config: its actor writes the config first and only then
/// makes it live (limits, subjects, sources); a failed write keeps the old one.
pub async fn update_stream(s: &Stream, cfg: StreamConfig) -> Result<(), ApiError> {
    s.ask(|reply| stream::Command::Update {
        cfg: Box::new(cfg),
        reply,
    })
    .await
    .unwrap_or_else(|| Err(ErrorKind::StreamNotFound.err()))
}

/// Deletes a stream: unlisted, its sources stopped, each consumer stopped (waiting pulls
/// told `409 Consumer Deleted`, as the reference) and its task waited for, then the actor
/// destroys the store and ends, and the directory goes.
pub async fn delete_stream(
    js: &JetStream,
    server: &Server,
    router: &mut Router,
    name: &str,
) -> Result<(), ApiError> {
    let (s, consumers) = js
        .registry
        .remove_stream(&js.account.name, name)
        .ok_or_else(|| ErrorKind::StreamNotFound.err())?;
    // The actor keeps taking commands while the stream is torn down.
    let tx = s.commands();
    s.stop_sourcing();
    s.unsubscribe();
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
    // Out of the way before the store removes a file: a removal cut short (a failing
    // disk, a crash) leaves a directory the next start removes, never a stream in part.
    let mut retired = Ok(None);
    s.destroy(|| retired = js.meta.retire(&s.dir)).await;
    drop(tx);
    let left = retired.unwrap_or_else(|e| {
        crate::error!(
            server.log,
            "Stream {name}: could not move {} aside before removing it: {e}",
            s.dir.display()
        );
        Some(s.dir.clone())
    });
    if let Err(e) = left.map_or(Ok(()), |dir| js.meta.remove_dir_all(&dir)) {
        crate::error!(server.log, "Stream {name}: could not remove its files: {e}");
    }
    Ok(())
}

/// Starts a consumer from a checked config and lists it; its config is written before it
/// starts (a create that fails leaves nothing behind and delivers nothing).
pub fn create_consumer(
    js: &JetStream,
    server: &Arc<Server>,
    router: &mut Router,
    s: &Arc<Stream>,
    name: String,
    meta: consumer::ConsumerMeta,
    dir: Option<PathBuf>,
) -> Result<Arc<Consumer>, ApiError> {
    if let Some(d) = &dir {
        if let Err(e) = consumer::write_meta(&js.meta, d, &meta.config, meta.created) {
            if let Err(e) = js.meta.remove_dir_all(d) {
                crate::error!(
                    server.log,
                    "Could not remove consumer data {}: {e}",
                    d.display()
                );
            }
            return Err(ErrorKind::ConsumerStore.with(e));
        }
    }
    let (c, task) = Consumer::start(server, s, name, meta, dir, js.requests.clone());
    if !js
        .registry
        .insert_consumer(&js.account.name, &s.name, c.clone(), task)
    {
        c.stop(server, router);
        return Err(ErrorKind::StreamNotFound.err());
    }
    Ok(c)
}

/// Removes a consumer (with `created`, only that incarnation): stops it, waits for its
/// task, deletes its saved state; on an interest stream, what no remaining consumer needs
/// goes. False when there is no such consumer.
pub async fn delete_consumer(
    js: &JetStream,
    server: &Server,
    router: &mut Router,
    stream: &Stream,
    name: &str,
    created: Option<i64>,
) -> bool {
    let Some(r) = js
        .registry
        .remove_consumer(&js.account.name, &stream.name, name, created)
    else {
        return false;
    };
    r.consumer.stop(server, router);
    advisory::consumer_action(server, router, &stream.name, name, advisory::Action::Delete);
    r.join().await;
    let dir = stream.dir.join("consumers").join(name);
    if let Err(e) = js.meta.retire_dir(&dir) {
        crate::error!(
            server.log,
            "Could not remove consumer data {}: {e}",
            dir.display()
        );
    }
    if stream.retention() == stream::Retention::Interest {
        if let Some(tx) = stream.commands() {
            let _ = tx.send(stream::Command::ReleaseInterest).await;
        }
    }
    true
}

/// The registry's task: what consumers ask of it (their removal once inactive).
pub async fn run(
    js: Arc<JetStream>,
    server: Arc<Server>,
    mut rx: tokio::sync::mpsc::Receiver<Request>,
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
            Request::DeleteConsumer {
                account,
                stream,
                name,
                created,
            } => {
                if account != js.account.name {
                    continue;
                }
                if let Some(s) = js.stream(&stream) {
                    let gone =
                        delete_consumer(&js, &server, &mut router, &s, &name, Some(created)).await;
                    if gone && s.group.is_some() {
                        // The followers' copy goes too, or a next leader would run it again.
                        let entry = crate::jetstream::raft::stream::ConsumerEntry::Delete { name };
                        let _ = s.replicate(entry, false).await;
                    }
                }
            }
        }
        router.flush();
    }
}
