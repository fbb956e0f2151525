//! JetStream: streams and consumers as a subsystem that talks to the core the way a client
//! does. It subscribes to `$JS.API.>` with an in-process handle and answers requests by
//! publishing to their reply subjects (`api/`); each stream subscribes to its own subjects
//! and has one writer, its actor (`stream/`); the registry (`registry.rs`) owns which streams
//! and consumers exist. Stream configs live in `<store_dir>/jetstream/<account>/streams/<name>/`;
//! JetStream serves the global account `$G`, and its in-process clients are bound to it.
//! ARCHITECTURE.md ("JetStream inside") has the whole shape.

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

pub struct JetStream {
    pub streams_dir: PathBuf,
    pub store_dir: PathBuf,
    /// Account -> streams -> consumers: their lifecycle.
    pub registry: registry::Registry,
    pub(crate) api_total: AtomicU64,
    pub(crate) api_errors: AtomicU64,
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
    /// This instance's metadata files (no process-wide instance: each remembers which files
    /// it made durable).
    pub meta: keel_store::MetaFiles,
}

impl JetStream {
    /// Opens the store directory, recovers every stream found there, and starts serving
    /// the API.
    pub fn start(server: &Arc<Server>) -> Result<Arc<JetStream>, String> {
        let opts = &server.opts;
        let store_dir = opts
            .store_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("keel"));
        // The account with `jetstream: enabled` when accounts are configured, else `$G`.
        let account = server.accounts.jetstream_account();
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
            meta: keel_store::MetaFiles::new(),
        });
        registry::recover(&js, server)?;

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
        server.spawn(api::run(js.clone(), server.clone(), rx));
        server.spawn(registry::run(js.clone(), server.clone(), requests_rx));
        server.spawn(maintenance_loop(js.clone(), server.clone()));
        Ok(js)
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
            account: self.account.clone(),
            meta: self.meta.clone(),
        }
    }

    /// The storage limit for `storage`: the server's, or the account's (`accounts { A: {
    /// jetstream: { max_mem, max_file } } }`) where that is lower; -1 = none.
    pub fn storage_limit(&self, storage: StorageType) -> i64 {
        storage_limit(self.max_memory, self.max_store, &self.account, storage)
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

/// The storage limit for `storage` of a stream in `account`: the server's
/// (`max_memory`, `max_store`), or the account's where that is lower; -1 = none. Read at
/// each use, so a reload that changes the account's limits applies at once.
pub fn storage_limit(
    max_memory: i64,
    max_store: i64,
    account: &Account,
    storage: StorageType,
) -> i64 {
    let acc = account.jetstream_limits();
    let (server, account) = match storage {
        StorageType::Memory => (max_memory, acc.max_mem),
        StorageType::File => (max_store, acc.max_file),
    };
    match (server < 0, account < 0) {
        (true, _) => account,
        (false, true) => server,
        (false, false) => server.min(account),
    }
}

/// The server's JetStream domain, if one is configured.
pub fn domain(server: &Server) -> Option<&str> {
    server.opts.jetstream_domain.as_deref()
}
