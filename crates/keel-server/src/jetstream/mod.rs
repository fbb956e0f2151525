//! JetStream: streams and consumers as a subsystem that talks to the core the way a client
//! does. It subscribes to `$JS.API.>` with an in-process handle and answers requests by
//! publishing to their reply subjects (`api/`); each stream subscribes to its own subjects
//! and has one writer, its actor (`stream/`); the registry (`registry.rs`) owns which streams
//! and consumers exist. Stream configs live in `<store_dir>/jetstream/<account>/streams/<name>/`;
//! JetStream serves each account with `jetstream: enabled` (else `$G`), one [`JetStream`]
//! each, and its in-process clients are bound to that account.
//! ARCHITECTURE.md ("JetStream inside") has the whole shape.

pub mod advisory;
pub mod api;
pub mod cluster;
pub mod consumer;
pub mod consumer_state;
pub mod counter;
pub mod expiry;
pub mod files;
pub mod raft;
pub mod registry;
pub mod republish;
pub mod schema;
pub mod sourcing;
pub mod stream;
pub mod transform;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::account::Account;
use crate::client::ClientHandle;
use crate::server::Server;
use crate::sublist::Sub;
use stream::{StorageType, Stream};

/// The server's JetStream: one [`JetStream`] per account that has it (the accounts with
/// `jetstream: enabled`, else `$G`), sharing the store directory (and its lock), the
/// registry and the metadata files. Which accounts have JetStream is fixed at start.
pub struct JetStreams {
    list: Vec<Arc<JetStream>>,
    /// Every account's streams and consumers.
    pub registry: Arc<registry::Registry>,
    /// Held until shutdown: one server per store directory (released then, so a server
    /// restarted in the same process, as tests do, can take it).
    lock: std::sync::Mutex<Option<keel_store::DirLock>>,
    /// In a cluster: the meta group (`cluster.rs`).
    pub meta: std::sync::OnceLock<Arc<cluster::Meta>>,
    /// Set once this server was removed from the JetStream cluster (`cluster::disable`):
    /// its streams are unloaded, and its API requests go to the rest of the cluster.
    disabled: std::sync::atomic::AtomicBool,
    /// The accounts whose API requests are answered with 10039 (`api::not_enabled`).
    not_enabled: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl JetStreams {
    /// Opens the store directory, recovers every account's streams found there, and starts
    /// serving each account's API.
    pub fn start(server: &Arc<Server>) -> Result<Arc<JetStreams>, String> {
        let opts = &server.opts;
        let store_dir = opts
            .store_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("keel"));
        // Two servers on one store would both hand out the same sequences; the second
        // refuses to start (the kernel drops the lock when the holder exits, even on kill).
        let lock = keel_store::lock_dir(&store_dir)?;
        let (max_memory, max_store) = server.storage_limits();
        let registry = Arc::new(registry::Registry::new());
        let meta = keel_store::MetaFiles::on_disk(&opts.disk);
        // One budget for every file stream's index entries read from disk.
        let cache = opts
            .index_cache_size
            .map_or(keel_store::DEFAULT_INDEX_CACHE, |n| n as usize);
        let index_cache = keel_store::SharedCache(keel_store::IndexCache::new(cache));
        let syncing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // Clustered: a cluster and the system account (the Raft transport's) are there;
        // streams and consumers then serve the whole cluster (`launch::start_meta`).
        let clustered = opts.cluster.enabled() && server.accounts.system_account().is_some();
        let mut list = Vec::new();
        for account in server.accounts.jetstream_accounts() {
            let streams_dir = store_dir
                .join("jetstream")
                .join(&account.name)
                .join("streams");
            std::fs::create_dir_all(&streams_dir)
                .map_err(|e| format!("cannot create {}: {e}", streams_dir.display()))?;
            let (requests, requests_rx) = tokio::sync::mpsc::channel(registry::REQUEST_QUEUE);
            let js = Arc::new(JetStream {
                streams_dir,
                store_dir: store_dir.clone(),
                registry: registry.clone(),
                requests,
                api_total: AtomicU64::new(0),
                api_errors: AtomicU64::new(0),
                max_memory,
                max_store,
                sync_interval: opts.sync_interval,
                limits: opts.js_limits,
                strict: opts.jetstream_strict,
                domain: opts.jetstream_domain.clone(),
                account,
                server_name: server.server_name.clone(),
                meta: meta.clone(),
                index_cache: index_cache.clone(),
                syncing: syncing.clone(),
                api_queue: std::sync::OnceLock::new(),
                cluster: server.cluster.get().filter(|_| clustered).cloned(),
                system_account: server.accounts.system_account().map(|a| a.name.clone()),
            });
            registry::recover(&js, server)?;
            js.serve(server, requests_rx);
            list.push(js);
        }
        let jss = Arc::new(JetStreams {
            list,
            registry,
            lock: std::sync::Mutex::new(Some(lock)),
            meta: std::sync::OnceLock::new(),
            disabled: std::sync::atomic::AtomicBool::new(false),
            not_enabled: Default::default(),
        });
        jss.serve_not_enabled(server);
        Ok(jss)
    }

    /// Tells the accounts without JetStream that it is not theirs (at start, and after a
    /// reload that added accounts), but for those that import another account's API (a
    /// shared JetStream account).
    pub fn serve_not_enabled(&self, server: &Arc<Server>) {
        let mut served = self.not_enabled.lock().unwrap_or_else(|e| e.into_inner());
        for account in server.accounts.all() {
            if served.contains(&account.name)
                || self
                    .list
                    .iter()
                    .any(|js| Arc::ptr_eq(&js.account, &account))
            {
                continue;
            }
            let imports_api = account.config().imports.iter().any(|i| {
                let here = i.to.as_deref().unwrap_or(&i.subject);
                stream::subjects_overlap(here, "$JS.API.>")
            });
            if !imports_api {
                api::not_enabled::serve(server, &account);
                served.insert(account.name.clone());
            }
        }
    }

    /// Whether JetStream was disabled here at run time (see `disabled`).
    pub fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Acquire)
    }

    /// Disables JetStream here; true the first time.
    pub(crate) fn set_disabled(&self) -> bool {
        !self.disabled.swap(true, Ordering::AcqRel)
    }

    /// Every account's JetStream (at least one).
    pub fn all(&self) -> &[Arc<JetStream>] {
        &self.list
    }

    /// The JetStream of `account`, if it has JetStream.
    pub fn account(&self, account: &str) -> Option<&Arc<JetStream>> {
        self.list.iter().find(|js| js.account.name == account)
    }

    /// The first account's: for what every account shares (limits, domain, store).
    pub fn first(&self) -> &Arc<JetStream> {
        &self.list[0]
    }

    /// Every account's streams.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.registry.all_streams()
    }

    /// A stream's consumers (of any account's stream).
    pub fn consumers_of(&self, stream: &Stream) -> Vec<Arc<consumer::Consumer>> {
        self.registry
            .consumers(&stream.account().name, &stream.name)
    }

    pub fn domain(&self) -> Option<&str> {
        self.first().domain.as_deref()
    }

    /// API requests answered, and errors, over every account.
    pub fn api_stats(&self) -> (u64, u64) {
        self.list.iter().fold((0, 0), |(t, e), js| {
            let (t2, e2) = js.api_stats();
            (t + t2, e + e2)
        })
    }

    /// Before a stop: every pull waiting on a consumer here is told `409 Server Shutdown`
    /// (`Consumer::signal_shutdown`). True if any was.
    pub fn signal_pull_consumers(&self, server: &Server) -> bool {
        let mut sent = false;
        for js in &self.list {
            let mut router = crate::router::Router::new(js.account.clone(), 0x5343);
            for s in self.registry.streams(&js.account.name) {
                for c in self.registry.consumers(&js.account.name, &s.name) {
                    sent |= c.signal_shutdown(server, &mut router);
                }
            }
            router.flush();
        }
        sent
    }

    /// After every task ended: each account's consumers' state is written and synced.
    pub fn shutdown(&self) {
        for js in &self.list {
            js.shutdown();
        }
        self.lock.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// One account's JetStream: its streams (in the shared registry, under its name), its API
/// on its own subject space, and its usage and API counters.
pub struct JetStream {
    pub streams_dir: PathBuf,
    pub store_dir: PathBuf,
    /// Account -> streams -> consumers: their lifecycle (shared by every account).
    pub registry: Arc<registry::Registry>,
    /// Where this account's consumers ask the registry's task (their removal).
    pub(crate) requests: tokio::sync::mpsc::Sender<registry::Request>,
    pub(crate) api_total: AtomicU64,
    pub(crate) api_errors: AtomicU64,
    /// Server-wide limits (`jetstream { max_memory_store, max_file_store }`); -1 = none.
    pub max_memory: i64,
    pub max_store: i64,
    /// None: sync before every ack (the default). Some(d): sync every d, ack at once.
    pub sync_interval: Option<Duration>,
    /// `jetstream { limits }`.
    pub limits: crate::config::JsLimits,
    /// `jetstream { strict }` (default true): API requests with fields the reference does
    /// not know are refused rather than decoded with those fields ignored.
    pub strict: bool,
    /// `jetstream { domain }`: named in INFO, acks, infos and advisories; the API is also
    /// served on `$JS.<domain>.API.>`.
    pub domain: Option<String>,
    /// The account whose streams these are (its subjects, its clients).
    pub account: Arc<Account>,
    /// The server's name (stream info's `cluster.leader`).
    pub server_name: String,
    /// The server's metadata files (no process-wide instance: each server remembers which
    /// files it made durable).
    pub meta: keel_store::MetaFiles,
    /// The server's one budget (`jetstream { index_cache_size }`) for the index entries its
    /// file streams read from disk.
    pub index_cache: keel_store::SharedCache,
    /// Server-wide: streams' syncs whose fsync is running on a tokio worker right now
    /// (see `stream::read::WriteHandle::sync`).
    pub syncing: Arc<std::sync::atomic::AtomicUsize>,
    /// The API's queue: requests forwarded from other servers of a cluster go in here.
    pub(crate) api_queue: std::sync::OnceLock<Arc<crate::inqueue::InQueue>>,
    /// The cluster, when JetStream is clustered (`cluster.rs`): streams' and consumers'
    /// subscriptions are then announced to the routes, so their clients may be on any server.
    pub cluster: Option<Arc<crate::route::Cluster>>,
    system_account: Option<String>,
}

impl JetStream {
    /// Puts a request of this server's own (a forwarded one, one sent on or asked again)
    /// into the account's API queue, as if a client here sent it. False: not queued (no
    /// queue yet, or it is full or closed).
    pub(crate) fn queue_request(
        &self,
        subject: &[u8],
        sid: &bytes::Bytes,
        reply: Option<&[u8]>,
        hdr_len: usize,
        data: &[u8],
    ) -> bool {
        self.api_queue.get().is_some_and(|q| {
            let from = crate::inqueue::Publisher {
                origin: 0,
                client: false,
            };
            q.push(subject, sid, reply, hdr_len, data, from) != crate::inqueue::Pushed::Dropped
        })
    }

    /// Subscribes the account's API and starts its tasks (API, registry requests, ticks).
    fn serve(
        self: &Arc<Self>,
        server: &Arc<Server>,
        requests_rx: tokio::sync::mpsc::Receiver<registry::Request>,
    ) {
        let js = self;
        let (handle, rx) = ClientHandle::internal(
            server,
            &js.account,
            "JetStream API".into(),
            crate::inqueue::API_QUEUE_BYTES,
        );
        if let Some(q) = handle.internal_queue() {
            let _ = js.api_queue.set(q.clone());
        }
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
        server.spawn(api::run(js.clone(), server.clone(), rx));
        server.spawn(registry::run(js.clone(), server.clone(), requests_rx));
        server.spawn(maintenance_loop(js.clone(), server.clone()));
    }

    /// The system account's name (Raft traffic's account, `traffic_account`).
    pub fn system_account_name(&self) -> Option<String> {
        self.system_account.clone()
    }

    /// Whether JetStream is clustered here.
    pub fn clustered(&self) -> bool {
        self.cluster.is_some()
    }

    /// The cluster's name, for clustered JetStream's `cluster` objects.
    pub fn cluster_name(&self) -> Option<String> {
        self.cluster.as_ref().map(|c| c.name())
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
            server_usage: self.registry.total_usage(),
            account: self.account.clone(),
            meta: self.meta.clone(),
            index_cache: self.index_cache.clone(),
            syncing: self.syncing.clone(),
            cluster_wide: self.clustered(),
        }
    }

    /// The server's storage limit for `storage` (-1: none).
    pub fn server_limit(&self, storage: StorageType) -> i64 {
        match storage {
            StorageType::Memory => self.max_memory,
            StorageType::File => self.max_store,
        }
    }

    /// The account's own storage limit for `storage` (`accounts { A: { jetstream: {
    /// max_mem, max_file } } }`); -1 = none.
    pub fn account_limit(&self, storage: StorageType) -> i64 {
        account_limit(&self.account, storage)
    }

    /// The `max_bytes` that this account's streams of this storage type reserve (all but
    /// `except`).
    pub fn reserved(&self, storage: StorageType, except: Option<&str>) -> i64 {
        reserved(&self.streams(), storage, except)
    }

    /// The same over every account's streams (against the server's limits).
    pub fn reserved_by_all(&self, storage: StorageType, except: Option<&str>) -> i64 {
        let all = self.registry.all_streams();
        let mine = |s: &&Arc<Stream>| {
            !(Some(s.name.as_str()) == except && Arc::ptr_eq(s.account(), &self.account))
        };
        let others: Vec<Arc<Stream>> = all.iter().filter(mine).cloned().collect();
        reserved(&others, storage, None)
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

/// An account's own storage limit for `storage` (-1: none). Read at each use, so a reload
/// that changes the account's limits applies at once.
pub fn account_limit(account: &Account, storage: StorageType) -> i64 {
    let acc = account.jetstream_limits();
    match storage {
        StorageType::Memory => acc.max_mem,
        StorageType::File => acc.max_file,
    }
}

fn reserved(streams: &[Arc<Stream>], storage: StorageType, except: Option<&str>) -> i64 {
    streams
        .iter()
        .filter(|s| s.storage == storage && Some(s.name.as_str()) != except)
        .map(|s| s.config().max_bytes)
        .filter(|b| *b > 0)
        .sum()
}

/// The server's JetStream domain, if one is configured.
pub fn domain(server: &Server) -> Option<&str> {
    server.opts.jetstream_domain.as_deref()
}
