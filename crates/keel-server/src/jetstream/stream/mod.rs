//! One stream. [`Stream`] is the shared handle everyone holds: its name, a read handle on its
//! store, a view of its config, its committed watermark, its subscriptions and its sources'
//! state, and a way to send its actor commands. The actor (`actor.rs`) is the stream's only
//! writer: it decides (`decide.rs`) and applies (`apply.rs`) every change through its
//! replicator (`replicator.rs`), and answers each command once the change is committed.

pub mod actor;
pub mod apply;
pub mod config;
pub mod decide;
pub mod entry;
pub mod meta;
pub mod read;
pub mod replicator;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use bytes::Bytes;
use keel_store::{MetaFiles, State, Store};
use serde_json::{Map, Value};
use tokio::sync::{mpsc, oneshot, watch};

pub use actor::Command;
pub use config::{
    config_json, null_default, subjects_overlap, valid_name, ConsumerLimits, DiscardPolicy,
    Retention, StorageType, StreamConfig, API_LEVEL, REQ_LEVEL_KEY,
};
pub use decide::{parse_ttl, store_error};
pub use meta::{leftover, read_meta, write_meta, StreamMeta};

use super::registry::{ConsumerSet, JsUsage};
use super::sourcing::{self, SourcedBatch};
use crate::account::Account;
use crate::client::ClientHandle;
use crate::server::Server;
use crate::sublist::Sub;
use crate::time::rfc3339;
use read::ReadHandle;

/// How a stream is opened: the JetStream's settings it runs under.
#[derive(Clone)]
pub struct Settings {
    /// Sync before acknowledging (the default); otherwise the sync interval syncs.
    pub sync_always: bool,
    /// `jetstream { sync_interval }`, when set.
    pub sync_interval: Option<std::time::Duration>,
    /// Server-wide limits (`max_memory_store`, `max_file_store`); -1: none.
    pub max_memory: i64,
    pub max_store: i64,
    /// The account's usage, which this stream's bytes are part of.
    pub usage: Arc<JsUsage>,
    /// One budget (`jetstream { index_cache_size }`) for the index entries every file
    /// stream of the server reads from disk.
    pub index_cache: keel_store::SharedCache,
    /// The server's count of fsyncs running on tokio workers (see `WriteHandle::sync`).
    pub syncing: Arc<std::sync::atomic::AtomicUsize>,
    /// Every account's usage (against the server-wide limits).
    pub server_usage: Arc<JsUsage>,
    /// The account whose stream this is (its JetStream limits lower the server's).
    pub account: Arc<crate::account::Account>,
    pub meta: MetaFiles,
    /// Clustered JetStream: the stream's (and its consumers') subscriptions serve the
    /// whole cluster.
    pub cluster_wide: bool,
}

pub struct Stream {
    pub name: String,
    pub created: i64,
    pub dir: PathBuf,
    /// Fixed at creation (an update may not change it).
    pub storage: StorageType,
    /// The JetStream instance's metadata files (configs, consumer state, source positions).
    pub meta: MetaFiles,
    /// The server's count of fsyncs running on tokio workers (see `read::fsync`).
    pub syncing: Arc<std::sync::atomic::AtomicUsize>,
    store: ReadHandle,
    /// The live config, swapped by the actor when an update is applied.
    config: RwLock<Arc<StreamConfig>>,
    handle: Arc<ClientHandle>,
    subs: Mutex<Vec<Arc<Sub>>>,
    /// Bytes stored, for account usage without taking the store's lock.
    pub bytes: AtomicU64,
    usage: Arc<JsUsage>,
    /// Its consumers as the registry lists them (read-only views of their state).
    pub consumers: ConsumerSet,
    /// The last committed sequence: consumers and streams sourcing this one wake on it.
    committed: watch::Sender<u64>,
    /// The actor's command queue. Weak: the actor ends once its ingest queue has ended and
    /// every task that may still send (consumers, the API mid-request) has let go.
    commands: mpsc::WeakSender<Command>,
    /// The running sources or mirror (None when it has neither).
    sourcing: Mutex<Option<sourcing::Sourcing>>,
    /// Origin identities per source index name, and whether positions await saving.
    source_idents: Mutex<(HashMap<String, String>, bool)>,
    /// Bumped (by the actor) each time the sources restart; see [`SourcedBatch`].
    sourcing_gen: AtomicU64,
    /// A replicated stream's Raft group (clustered, num_replicas > 1), and what its
    /// replicator, state machine and watcher share.
    pub group: Option<crate::jetstream::raft::stream::GroupSpec>,
    pub replica: OnceLock<Arc<crate::jetstream::raft::stream::Shared>>,
    /// Set once the actor has ended and closed its store (`closed`).
    ended: watch::Sender<bool>,
}

async fn ask<T>(
    tx: &mpsc::Sender<Command>,
    make: impl FnOnce(oneshot::Sender<T>) -> Command,
) -> Option<T> {
    let (reply, answer) = oneshot::channel();
    tx.send(make(reply)).await.ok()?;
    answer.await.ok()
}

impl Stream {
    /// Opens (or creates) a stream's store, subscribes to its subjects and starts its actor.
    pub fn open(
        server: &Arc<Server>,
        account: &Arc<Account>,
        dir: &Path,
        meta: StreamMeta,
        settings: &Settings,
    ) -> Result<Arc<Stream>, String> {
        let config = meta.config;
        let group = meta.cluster.clone();
        let bootstrap = meta.bootstrap;
        let store: Box<dyn Store> = match config.storage {
            StorageType::Memory => Box::new(keel_store::mem::MemStore::new(config.limits())),
            StorageType::File => {
                let msgs = dir.join("msgs");
                let (mut fs, report) = keel_store::file::FileStore::open_with(
                    &msgs,
                    config.limits(),
                    keel_store::file::FileStoreConfig {
                        index_cache: Some(settings.index_cache.clone()),
                        disk: server.opts.disk.clone(),
                        ..Default::default()
                    },
                )
                .map_err(|e| e.to_string())?;
                super::files::log_recovery(
                    &server.log,
                    &config.name,
                    &msgs,
                    &report,
                    Some(&fs.state()),
                );
                crate::debug!(server.log, "Stream {} recovery: {report:?}", config.name);
                fs.set_observer(super::files::observer(
                    server.log.clone(),
                    config.name.clone(),
                    msgs,
                ));
                Box::new(fs)
            }
        };
        let (handle, rx) = ClientHandle::internal(
            server,
            account,
            format!("stream {}", config.name),
            crate::inqueue::STREAM_QUEUE_BYTES,
        );
        if settings.cluster_wide {
            if let Some(q) = handle.internal_queue() {
                q.set_cluster_wide();
            }
        }
        let mut store = store;
        if group.is_some() && config.first_seq > 1 && store.last_seq() == 0 {
            // A new replicated stream's `first_seq`: every replica starts its empty store
            // there itself (the config decides it alike everywhere), before its group
            // applies anything; a leader does not exist yet to put it in the log.
            store
                .skip_to(config.first_seq)
                .and_then(|_| store.sync())
                .map_err(|e| format!("cannot start at first_seq {}: {e}", config.first_seq))?;
        }
        let (write, read) = read::WriteHandle::new(store, settings.syncing.clone());
        let mut leader = decide::Leader::new(&config);
        let (bytes, last) = {
            let mut s = write.lock();
            leader.rebuild(&config, &mut **s);
            (s.state().bytes, s.last_seq())
        };
        let (committed, _) = watch::channel(last);
        let (cmd_tx, cmd_rx) = mpsc::channel(actor::COMMAND_QUEUE);
        // Each source has at most one batch in flight, so a few slots are enough.
        let (sourced_tx, sourced_rx) = mpsc::channel(8);
        settings.usage.change(config.storage, 0, bytes);
        let config = Arc::new(config);
        let stream = Arc::new(Stream {
            name: config.name.clone(),
            created: meta.created,
            dir: dir.to_path_buf(),
            storage: config.storage,
            meta: settings.meta.clone(),
            syncing: settings.syncing.clone(),
            store: read,
            config: RwLock::new(config.clone()),
            handle,
            subs: Mutex::new(Vec::new()),
            bytes: AtomicU64::new(bytes),
            usage: settings.usage.clone(),
            consumers: ConsumerSet::default(),
            committed,
            commands: cmd_tx.downgrade(),
            sourcing: Mutex::new(None),
            source_idents: Mutex::new((HashMap::new(), false)),
            sourcing_gen: AtomicU64::new(0),
            group: group.clone(),
            replica: OnceLock::new(),
            ended: watch::Sender::new(false),
        });
        // A replicated stream subscribes once it leads (`raft::stream::run_group`).
        if group.is_none() {
            stream.subscribe();
        }
        // Before the actor runs, so the first batches are of this generation; they read
        // once the stream is listed (`start_sources`).
        stream.restart_sourcing(server, &sourced_tx, false);
        match group {
            None => {
                let a = actor::Actor::new(
                    stream.clone(),
                    server.clone(),
                    write,
                    config,
                    leader,
                    replicator::LocalReplicator::new(settings.sync_always),
                    settings,
                );
                contain(
                    server,
                    &stream,
                    actor::run(a, rx, cmd_rx, cmd_tx, sourced_rx, sourced_tx),
                );
            }
            Some(spec) => {
                use crate::jetstream::raft::stream as rs;
                let raft_dir = dir.join("raft");
                settings
                    .meta
                    .create_dir_all(&raft_dir)
                    .map_err(|e| format!("cannot create {}: {e}", raft_dir.display()))?;
                let shared = rs::Shared::new(
                    crate::jetstream::raft::node_id(&server.server_name),
                    write.follower(),
                    &raft_dir,
                    settings.meta.clone(),
                );
                let _ = shared.stream.set(Arc::downgrade(&stream));
                let _ = stream.replica.set(shared.clone());
                let a = actor::Actor::new(
                    stream.clone(),
                    server.clone(),
                    write,
                    config,
                    leader,
                    rs::RaftReplicator::new(shared.clone()),
                    settings,
                );
                contain(
                    server,
                    &stream,
                    actor::run(a, rx, cmd_rx, cmd_tx, sourced_rx, sourced_tx),
                );
                server.spawn(rs::run_group(
                    server.clone(),
                    Arc::downgrade(&stream),
                    shared,
                    spec,
                    bootstrap,
                    raft_dir,
                ));
            }
        }
        Ok(stream)
    }

    /// Read access to the store (held for one read).
    pub fn read(&self) -> read::ReadGuard<'_> {
        self.store.read()
    }

    /// The live config.
    pub fn config(&self) -> Arc<StreamConfig> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_config(&self, cfg: Arc<StreamConfig>) {
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = cfg;
    }

    pub fn retention(&self) -> Retention {
        self.config().retention
    }

    pub fn state(&self) -> State {
        self.read().state()
    }

    /// The server's log (the stream's handle carries it).
    pub fn handle_log(&self) -> &crate::log::Log {
        self.handle.log()
    }

    /// A replicated stream's follower applied the leader's entries: its size and
    /// committed watermark follow.
    pub fn follow_applied(&self) {
        let (bytes, last) = {
            let s = self.read();
            (s.state().bytes, s.last_seq())
        };
        self.set_bytes(bytes);
        self.set_committed(last);
    }

    /// Moves the committed watermark to `last` (consumers and sourcing streams wake).
    fn set_committed(&self, last: u64) {
        self.committed.send_if_modified(|v| {
            let changed = *v != last;
            *v = last;
            changed
        });
    }

    /// A replicated stream's follower applied a config entry: its meta file and live
    /// config follow (so a new leader starts from it).
    pub fn follow_config(&self, cfg: StreamConfig) {
        let meta = StreamMeta {
            config: cfg,
            created: self.created,
            cluster: self.group.clone(),
            bootstrap: false,
        };
        let _ = write_meta(&self.meta, &self.dir, &meta);
        self.set_config(Arc::new(meta.config));
    }

    /// Whether this server is where the stream decides: always for an unreplicated
    /// stream, the ready leader for a replicated one.
    pub fn leads(&self) -> bool {
        self.replica.get().is_none_or(|r| !r.is_fenced())
    }

    /// How many consumers the stream has as this server knows them: those running here,
    /// or on a follower of a replicated stream (where they do not run) the ones whose files
    /// its group has written here, so monitoring counts them on every replica as the
    /// reference does.
    pub fn consumer_count(&self) -> usize {
        if self.leads() {
            return self.consumers.len();
        }
        self.replica_consumer_dirs().len()
    }

    /// A follower's consumer directories (those its group wrote, by name).
    pub fn replica_consumer_dirs(&self) -> Vec<std::path::PathBuf> {
        let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir(self.dir.join("consumers"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| !keel_store::MetaFiles::is_retired(p) && p.join("meta.json").exists())
            .collect();
        dirs.sort();
        dirs
    }

    /// Whether direct gets may be answered from this server's store (`Shared::serves_reads`
    /// for a replica; always for an unreplicated stream).
    pub fn serves_reads(&self) -> bool {
        self.replica.get().is_none_or(|r| r.serves_reads())
    }

    /// The replicated stream's leader (server name), as this server knows it.
    pub fn leader_name(&self) -> Option<String> {
        let r = self.replica.get()?.raft.get()?.clone();
        let m = r.metrics().borrow().clone();
        let id = crate::jetstream::raft::leader_id(&m)?;
        crate::jetstream::raft::member_name(&m, id)
    }

    /// Replicates a durable consumer's change through the stream's group (nothing for an
    /// unreplicated stream); with `wait`, resolves once a quorum has it.
    pub async fn replicate(
        &self,
        entry: crate::jetstream::raft::stream::ConsumerEntry,
        wait: bool,
    ) -> Result<(), crate::jetstream::api::ApiError> {
        match self.replicate_queued(entry, wait).await? {
            Some(answer) => answer.await,
            None => Ok(()),
        }
    }

    /// [`replicate`](Self::replicate) in two steps: queues the entry (entries reach the
    /// group's log in the order they are queued), and with `wait` returns the answer to
    /// await, once a quorum has it.
    pub async fn replicate_queued(
        &self,
        entry: crate::jetstream::raft::stream::ConsumerEntry,
        wait: bool,
    ) -> Result<
        Option<impl std::future::Future<Output = Result<(), crate::jetstream::api::ApiError>>>,
        crate::jetstream::api::ApiError,
    > {
        use crate::jetstream::api::ErrorKind;
        if self.group.is_none() {
            return Ok(None);
        }
        let Some(tx) = self.commands() else {
            return Err(ErrorKind::ClusterUnavailable.err());
        };
        if !wait {
            // A full queue is an error too: the caller keeps the change to send again.
            return tx
                .try_send(Command::Replicate { entry, reply: None })
                .map(|_| None)
                .map_err(|_| ErrorKind::ClusterUnavailable.err());
        }
        let (reply, answer) = oneshot::channel();
        tx.send(Command::Replicate {
            entry,
            reply: Some(reply),
        })
        .await
        .map_err(|_| ErrorKind::ClusterUnavailable.err())?;
        Ok(Some(async move {
            answer
                .await
                .unwrap_or_else(|_| Err(ErrorKind::ClusterUnavailable.err()))
        }))
    }

    /// Stops subscribing to the subjects (a replicated stream's leader stepped down); the
    /// actor keeps running as a follower's store keeper.
    pub fn unsubscribe_subjects(&self) {
        let mut subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        for s in subs.drain(..) {
            self.account().sublist.remove(&s);
        }
    }

    /// Its subjects stop being interest the routes are told of, while this server still
    /// takes what reaches it on them (a leader about to hand over: see
    /// `cluster::hand_off_leadership`). Undone by `restore_to_peers` or a new `subscribe`.
    pub fn withdraw_from_peers(&self) {
        let subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        for s in subs.iter() {
            self.account().sublist.withdraw_from_peers(s);
        }
    }

    pub fn restore_to_peers(&self) {
        let subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        for s in subs.iter() {
            self.account().sublist.restore_to_peers(s);
        }
    }

    /// Whether the stream (and so its consumers) serves the whole cluster.
    pub fn cluster_wide(&self) -> bool {
        self.handle
            .internal_queue()
            .is_some_and(|q| q.is_cluster_wide())
    }

    /// The account the stream serves.
    pub fn account(&self) -> &Arc<Account> {
        self.handle.account()
    }

    /// Records the stream's size (and its account's usage).
    fn set_bytes(&self, bytes: u64) {
        let old = self.bytes.swap(bytes, Ordering::Relaxed);
        self.usage.change(self.storage, old, bytes);
    }

    /// The last committed sequence: consumers and streams sourcing this one wake on it,
    /// and consumers deliver nothing past it.
    pub fn committed_watch(&self) -> watch::Receiver<u64> {
        self.committed.subscribe()
    }

    pub fn committed_seq(&self) -> u64 {
        *self.committed.borrow()
    }

    /// Resolves once the actor has ended and closed the store (its files may then be
    /// opened again).
    pub async fn closed(&self) {
        let _ = self.ended.subscribe().wait_for(|e| *e).await;
    }

    /// The actor has closed the store.
    pub(crate) fn set_ended(&self) {
        self.ended.send_replace(true);
    }

    /// A sender for the actor's commands (None once it has ended). Hold it only in a task
    /// that ends with the server; the actor waits for every holder to let go at shutdown.
    pub fn commands(&self) -> Option<mpsc::Sender<Command>> {
        self.commands.upgrade()
    }

    /// Sends the actor a command and waits for its answer; None once the actor has ended.
    pub async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
        ask(&self.commands()?, make).await
    }

    /// Deletes the stream's data and ends its actor. Unsubscribes it too, holding on to
    /// the actor's queue meanwhile (its ingest ending would otherwise let it end first).
    /// `before_delete` runs once the stream takes no more messages and before its store
    /// removes its files (a stream delete moves the directory aside then).
    pub async fn destroy(&self, before_delete: impl FnOnce()) {
        if let Some(r) = self.replica.get() {
            r.stop_group().await;
        }
        let tx = self.commands();
        self.stop_sourcing();
        self.unsubscribe();
        before_delete();
        if let Some(tx) = tx {
            ask(&tx, |reply| Command::Delete { reply }).await;
        }
    }

    /// The maintenance tick (expiry, the sync interval), skipped while the actor is busy.
    pub fn tick(&self) {
        if let Some(tx) = self.commands() {
            let _ = tx.try_send(Command::Tick);
        }
    }

    /// (Re)subscribes to the config's subjects, in the stream's account.
    pub fn subscribe(&self) {
        let subjects = self.config().subjects.clone();
        let mut subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        for s in subs.drain(..) {
            self.account().sublist.remove(&s);
        }
        for (i, subj) in subjects.iter().enumerate() {
            let sub = Arc::new(Sub {
                client: self.handle.clone(),
                sid: Bytes::from(i.to_string()),
                subject: Bytes::copy_from_slice(subj.as_bytes()),
                queue: None,
                max: AtomicU64::new(0),
                delivered: AtomicU64::new(0),
            });
            self.account().sublist.insert(sub.clone());
            subs.push(sub);
        }
    }

    pub fn unsubscribe(&self) {
        let mut subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        for s in subs.drain(..) {
            self.account().sublist.remove(&s);
        }
        // Closing the handle ends the actor's ingest queue.
        self.handle
            .close(crate::client::CloseReason::ServerShutdown);
    }

    /// (Re)starts the sources or mirror for the current config: at open (before the actor
    /// runs) and, by the actor, after an update, so a restart is ordered with the batches
    /// it stores.
    fn restart_sourcing(
        self: &Arc<Self>,
        server: &Arc<Server>,
        tx: &mpsc::Sender<SourcedBatch>,
        go: bool,
    ) {
        let cfg = self.config();
        let mut slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        let mut previous = sourcing::Positions::new();
        if let Some(old) = slot.take() {
            old.stop();
            let idents = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
            previous = old.positions(&idents.0);
        }
        // From here on batches the old tasks still have queued are refused.
        let gen = self.sourcing_gen.fetch_add(1, Ordering::AcqRel) + 1;
        *slot = sourcing::start(server, self, &cfg, gen, &previous, tx).map(|(s, idents)| {
            let mut g = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
            g.0 = idents;
            if go {
                s.go();
            }
            s
        });
    }

    /// Lets the sources (or mirror) of a newly opened stream start reading.
    pub fn start_sources(&self) {
        if let Some(s) = self
            .sourcing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            s.go();
        }
    }

    fn sourcing_gen(&self) -> u64 {
        self.sourcing_gen.load(Ordering::Acquire)
    }

    pub fn stop_sourcing(&self) {
        let mut slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = slot.take() {
            old.stop();
        }
    }

    /// `mirror` / `sources` for stream info.
    pub fn sourcing_info(&self) -> Vec<(&'static str, Value)> {
        let slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        slot.as_ref().map(|s| s.info()).unwrap_or_default()
    }

    /// A mirror with `mirror_direct` that is caught up answers its origin's direct gets.
    pub fn serves_mirror_direct(&self, origin: &str) -> bool {
        let current = self
            .sourcing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|s| s.mirror_current());
        if !current {
            return false;
        }
        let cfg = self.config();
        cfg.mirror_direct && cfg.mirror.as_ref().is_some_and(|m| m.name == origin)
    }

    /// A source committed progress; its position is saved by [`Self::save_source_positions`].
    pub(super) fn sources_progressed(&self, ident: Option<(String, String)>) {
        let mut g = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((iname, id)) = ident {
            g.0.insert(iname, id);
        }
        g.1 = true;
    }

    /// Writes the sources' positions when they changed (`durable`: fsynced, at shutdown).
    pub fn save_source_positions(&self, durable: bool) {
        if self.storage != StorageType::File {
            return;
        }
        let idents = {
            let mut g = self.source_idents.lock().unwrap_or_else(|e| e.into_inner());
            if !g.1 && !durable {
                return;
            }
            g.1 = false;
            g.0.clone()
        };
        let slot = self.sourcing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slot.as_ref() {
            sourcing::save_positions(
                &self.meta,
                self.handle.log(),
                &self.dir,
                s,
                &idents,
                durable,
            );
        }
    }

    /// Info `state` JSON.
    pub fn state_json(
        state: &State,
        consumers: usize,
        subjects: Option<&BTreeMap<String, u64>>,
        deleted: Option<&[u64]>,
    ) -> Value {
        let mut m = Map::new();
        m.insert("messages".into(), state.msgs.into());
        m.insert("bytes".into(), state.bytes.into());
        m.insert("first_seq".into(), state.first_seq.into());
        m.insert("first_ts".into(), rfc3339(state.first_ts).into());
        m.insert("last_seq".into(), state.last_seq.into());
        m.insert("last_ts".into(), rfc3339(state.last_ts).into());
        if state.num_subjects > 0 {
            m.insert("num_subjects".into(), state.num_subjects.into());
        }
        if let Some(s) = subjects {
            if !s.is_empty() {
                m.insert(
                    "subjects".into(),
                    serde_json::to_value(s).expect("map serializes"),
                );
            }
        }
        if state.num_deleted > 0 {
            m.insert("num_deleted".into(), state.num_deleted.into());
        }
        if let Some(d) = deleted {
            if !d.is_empty() {
                m.insert(
                    "deleted".into(),
                    serde_json::to_value(d).expect("vec serializes"),
                );
            }
        }
        if let Some(lost) = &state.lost {
            let mut l = Map::new();
            l.insert(
                "msgs".into(),
                serde_json::to_value(&lost.msgs).expect("vec serializes"),
            );
            l.insert("bytes".into(), lost.bytes.into());
            m.insert("lost".into(), Value::Object(l));
        }
        m.insert("consumer_count".into(), consumers.into());
        Value::Object(m)
    }
}

/// Runs a stream's actor on a task of its own, so that a panic in it (a bug) is contained
/// to the stream: it stops taking messages here, and a replica leaves its group (its store
/// may hold a batch that never committed, which a dead actor no longer rolls back) and so
/// stops answering reads, rather than serving on from a store nobody writes any more.
fn contain(
    server: &Arc<Server>,
    stream: &Arc<Stream>,
    actor: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let task = tokio::spawn(actor);
    let (srv, weak) = (server.clone(), Arc::downgrade(stream));
    server.spawn(async move {
        let Err(e) = task.await else {
            return;
        };
        let Some(s) = weak.upgrade().filter(|_| e.is_panic()) else {
            return;
        };
        crate::error!(
            srv.log,
            "Stream {} > {}: internal error (its actor panicked); the stream stops on this server until it restarts",
            s.account().name,
            s.name
        );
        s.unsubscribe();
        if let Some(r) = s.replica.get() {
            r.stop_group().await;
        }
    });
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// A stream whose actor panics (a bug) stops on this server: the error is logged, its
    /// subjects are no longer taken (a publish finds no responders rather than waiting
    /// on a dead actor), and the server and its other streams go on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_actor_stops_its_stream_and_nothing_else() {
        let opts = crate::harness::opts_from_config("jetstream: enabled").unwrap();
        let server = crate::harness::start(opts).await.unwrap();
        let client = async_nats::connect(server.client_url()).await.unwrap();
        let js = async_nats::jetstream::new(client.clone());
        for (name, subject) in [("BROKEN", "broken.>"), ("FINE", "fine.>")] {
            js.create_stream(async_nats::jetstream::stream::Config {
                name: name.into(),
                subjects: vec![subject.into()],
                ..Default::default()
            })
            .await
            .unwrap();
        }
        js.publish("broken.1", "before".into())
            .await
            .unwrap()
            .await
            .unwrap();
        let stream = server
            .server()
            .jetstream
            .get()
            .and_then(|j| j.account("$G").cloned())
            .and_then(|a| a.stream("BROKEN"))
            .unwrap();
        stream
            .commands()
            .unwrap()
            .send(super::actor::Command::Panic)
            .await
            .unwrap();
        let wait = async {
            while !server
                .log()
                .contains("Stream $G > BROKEN: internal error (its actor panicked)")
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("the panic is reported");
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            client.request("broken.2", "after".into()),
        )
        .await
        .expect("a publish to the stopped stream is answered at once");
        assert!(
            matches!(&r, Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders),
            "{r:?}"
        );
        let ack = js
            .publish("fine.1", "still".into())
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!((ack.stream.as_str(), ack.sequence), ("FINE", 1));
        server.shutdown().await;
    }
}
