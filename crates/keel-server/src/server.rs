//! The server: shared state (accounts, connection registry, log, tasks), the listener, and
//! orderly shutdown. Nothing here is process-global: two `Server`s in one process share
//! nothing.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::account::Accounts;
use crate::client::{self, ClientHandle};
use crate::config::{Opts, COMPAT_VERSION, GIT_COMMIT, KEEL_VERSION, TOOLCHAIN};
use crate::inqueue::InQueue;
use crate::log::Log;
use crate::sublist::Sub;

pub struct Server {
    pub opts: Opts,
    /// The client listener's TLS setup now: `opts.tls` at start, replaced by a reload
    /// (new certificates apply to the next handshakes).
    tls: RwLock<Option<Arc<crate::tls::Tls>>>,
    /// Every account; each owns its subject space (`account.sublist`).
    pub accounts: Accounts,
    /// This server's log (every log macro takes it, or a clone of it).
    pub log: Log,
    pub server_id: String,
    pub server_name: String,
    /// The address clients connect to, once bound.
    pub client_addr: Mutex<Option<SocketAddr>>,
    pub start: SystemTime,
    clients: Mutex<HashMap<u64, Arc<ClientHandle>>>,
    next_cid: AtomicU64,
    total_connections: AtomicU64,
    /// Totals of connections that have gone, so server-wide counters do not go backwards.
    closed_stats: ClosedStats,
    shutdown: watch::Sender<bool>,
    pub jetstream: std::sync::OnceLock<Arc<crate::jetstream::JetStreams>>,
    /// JetStream's memory and file limits (`storage_limits`).
    storage_limits: std::sync::OnceLock<(i64, i64)>,
    lame_duck: std::sync::atomic::AtomicBool,
    /// Set when lame-duck mode starts: the accept loop stops taking clients.
    stop_accepting: watch::Sender<bool>,
    /// Recently closed connections (`/connz?state=closed`).
    pub closed: crate::monitor::ClosedConns,
    tasks: Tasks,
    /// The queues of in-process clients (JetStream's), sealed at shutdown so their tasks
    /// finish what is queued and end.
    internal_queues: Mutex<QueueRegistry>,
    /// Routes to the other servers of its cluster, when it has a cluster port.
    pub cluster: std::sync::OnceLock<Arc<crate::route::Cluster>>,
    /// Who may connect (replaced whole on reload).
    auth: std::sync::RwLock<Arc<crate::auth::Auth>>,
    /// The auth options in force (the reload compares against them).
    pub auth_opts: std::sync::RwLock<crate::auth::conf::AuthOpts>,
    /// Failed authentications since start (monitoring).
    pub auth_failures: AtomicU64,
    /// The system account's services and events, once started.
    pub system: std::sync::OnceLock<Arc<crate::system::System>>,
    /// When the configuration was last loaded (`/varz config_load_time`).
    pub config_load_time: Mutex<SystemTime>,
}

/// The server's background tasks (spawned with [`Server::spawn`]): each holds a clone of
/// `token`; once the server drops its own, the receiver sees the channel close when the
/// last task has ended.
struct Tasks {
    token: Mutex<Option<tokio::sync::mpsc::Sender<()>>>,
    done: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<()>>,
}

#[derive(Default)]
struct QueueRegistry {
    live: Vec<std::sync::Weak<InQueue>>,
    prune_at: usize,
}

#[derive(Default)]
struct ClosedStats {
    in_msgs: AtomicU64,
    in_bytes: AtomicU64,
    out_msgs: AtomicU64,
    out_bytes: AtomicU64,
}

/// Server-wide message counters.
#[derive(Default, Debug, Clone, Copy)]
pub struct Totals {
    pub in_msgs: u64,
    pub in_bytes: u64,
    pub out_msgs: u64,
    pub out_bytes: u64,
}

/// INFO as the reference orders its fields; optional fields are left out when unset. There
/// is no `xkey`: the reference's curve key serves auth callout and encrypted system
/// requests, which Keel does not have, so advertising one would invite clients to use it.
#[derive(Serialize)]
struct Info<'a> {
    server_id: &'a str,
    server_name: &'a str,
    version: &'a str,
    proto: u8,
    #[serde(skip_serializing_if = "str::is_empty")]
    git_commit: &'a str,
    go: &'a str,
    host: &'a str,
    port: u16,
    headers: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    auth_required: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    tls_required: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    tls_verify: bool,
    /// TLS is configured but optional (`allow_non_tls`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    tls_available: bool,
    max_payload: usize,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    jetstream: bool,
    client_id: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    client_ip: Option<String>,
    /// In a cluster: its name, and the client URLs of this server and its peers (the
    /// servers a client may fail over to), unless `no_advertise`.
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    cluster_dynamic: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    connect_urls: Vec<String>,
    /// What an nkey or JWT user signs (not repeated in the connect_info INFO).
    #[serde(skip_serializing_if = "Option::is_none")]
    nonce: Option<&'a str>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    connect_info: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    remote_account: Option<&'a str>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    acc_is_sys: bool,
    /// Lame-duck mode: clients should move to another server.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    ldm: bool,
    /// The JetStream domain, when one is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    domain: Option<&'a str>,
    /// The JetStream API level Keel implements (as `_nats.level` in stream metadata).
    api_lvl: u32,
    keel_version: &'a str,
}

/// Binds a TCP listener on `host:port`. The wildcard host (`0.0.0.0`, the default, or `::`)
/// gets one socket for IPv6 and IPv4 together, as the reference's listeners do; where IPv6
/// is unavailable `0.0.0.0` falls back to IPv4 alone.
pub fn bind_tcp(host: &str, port: u16, log: &Log) -> std::io::Result<TcpListener> {
    let dual = matches!(host, "0.0.0.0" | "" | "::" | "[::]");
    if dual {
        match listen_on((std::net::Ipv6Addr::UNSPECIFIED, port).into(), true) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse || host.contains(':') => {
                return Err(e)
            }
            Err(e) => crate::debug!(log, "No IPv6 listener ({e}); listening on IPv4 only"),
        }
    }
    // As tokio's bind: the first of the host's addresses that can be bound.
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address for host");
    for addr in std::net::ToSocketAddrs::to_socket_addrs(&(host.trim_matches(['[', ']']), port))? {
        match listen_on(addr, false) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn listen_on(addr: SocketAddr, dual_stack: bool) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if dual_stack {
        socket.set_only_v6(false)?;
    }
    // As tokio's own bind: a restarted server can take its port back at once.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// `host:port` as the reference's log lines write a listen address (`[v6]:port`).
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A random id shaped like the reference's server ids: `N` and 55 base32 characters.
fn new_server_id() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut id = String::with_capacity(56);
    id.push('N');
    for _ in 0..55 {
        id.push(ALPHABET[rand::random_range(0..ALPHABET.len())] as char);
    }
    id
}

impl Server {
    pub fn new(opts: Opts, log: Log) -> Arc<Self> {
        let server_id = new_server_id();
        let server_name = opts
            .server_name
            .clone()
            .unwrap_or_else(|| server_id.clone());
        let (shutdown, _) = watch::channel(false);
        let opts_max_closed = opts.max_closed_clients;
        let (token, done) = tokio::sync::mpsc::channel(1);
        let accounts = Accounts::from_opts(&opts.auth);
        let auth_opts = opts.auth.clone();
        let tls = RwLock::new(opts.tls.clone());
        Arc::new(Server {
            tls,
            opts,
            accounts,
            log,
            server_id,
            server_name,
            client_addr: Mutex::new(None),
            start: SystemTime::now(),
            clients: Mutex::new(HashMap::new()),
            next_cid: AtomicU64::new(1),
            total_connections: AtomicU64::new(0),
            closed_stats: ClosedStats::default(),
            shutdown,
            jetstream: std::sync::OnceLock::new(),
            storage_limits: std::sync::OnceLock::new(),
            lame_duck: std::sync::atomic::AtomicBool::new(false),
            stop_accepting: watch::channel(false).0,
            closed: crate::monitor::ClosedConns::new(opts_max_closed),
            tasks: Tasks {
                token: Mutex::new(Some(token)),
                done: tokio::sync::Mutex::new(done),
            },
            internal_queues: Mutex::new(QueueRegistry::default()),
            cluster: std::sync::OnceLock::new(),
            auth: std::sync::RwLock::new(Arc::new(crate::auth::Auth::default())),
            auth_opts: std::sync::RwLock::new(auth_opts),
            auth_failures: AtomicU64::new(0),
            system: std::sync::OnceLock::new(),
            config_load_time: Mutex::new(SystemTime::now()),
        })
    }

    /// JetStream's memory and file store limits, fixed at the first use (JetStream's start,
    /// or the first route INFO, which tells the cluster's meta leader where streams fit):
    /// `max_memory_store` and `max_file_store`, or where unset (or negative) the
    /// reference's defaults from the machine, so `/jsz` and `/varz` report a real limit,
    /// and it is enforced.
    pub fn storage_limits(&self) -> (i64, i64) {
        *self.storage_limits.get_or_init(|| {
            let opts = &self.opts;
            let store_dir = opts
                .store_dir
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("keel"));
            let memory = opts
                .max_memory_store
                .filter(|m| *m >= 0)
                .unwrap_or_else(crate::monitor::proc::default_max_memory);
            let store = opts
                .max_file_store
                .filter(|m| *m >= 0)
                .unwrap_or_else(|| crate::monitor::proc::default_max_store(&store_dir));
            (memory, store)
        })
    }

    /// The log options take effect at once, each change reported as the reference does
    /// (`Reloaded: trace = true`).
    fn reload_log(&self, opts: &Opts) {
        let old = self.log.opts();
        let new = crate::log::LogOpts {
            debug: opts.debug,
            trace: opts.trace,
            logtime: opts.logtime,
            max_traced: opts.max_traced_msg_len,
        };
        self.log.set_opts(new);
        for (what, changed, value) in [
            ("trace", old.trace != new.trace, new.trace.to_string()),
            ("debug", old.debug != new.debug, new.debug.to_string()),
            (
                "logtime",
                old.logtime != new.logtime,
                new.logtime.to_string(),
            ),
            (
                "max_traced_msg_len",
                old.max_traced != new.max_traced,
                new.max_traced.to_string(),
            ),
        ] {
            if changed {
                crate::info!(self.log, "Reloaded: {what} = {value}");
            }
        }
    }

    /// Reloads users, permissions and accounts from `opts` (SIGHUP): connections whose
    /// credentials no longer authenticate, or that would land in another account, are closed
    /// with the reference's `-ERR 'Authorization Violation'`; the others get their new
    /// permissions, and lose (with `-ERR 'Permissions Violation for Subscription to ...'`) the
    /// subscriptions those no longer allow. Options that need a restart are reported.
    pub fn reload(self: &Arc<Self>, opts: &Opts) -> Result<(), String> {
        for (what, changed) in [
            ("port", opts.port != self.opts.port && opts.port > 0),
            ("host", opts.host != self.opts.host),
            ("jetstream", opts.jetstream != self.opts.jetstream),
            ("store_dir", opts.store_dir != self.opts.store_dir),
            ("http_port", opts.http_port != self.opts.http_port),
        ] {
            if changed {
                crate::warn!(
                    self.log,
                    "Reload: {what} changed; it takes effect at the next restart"
                );
            }
        }
        self.reload_log(opts);
        let old_system = self.accounts.system_name().to_string();
        let new_system = if opts.auth.no_system_account {
            String::new()
        } else {
            opts.auth
                .system_account
                .clone()
                .unwrap_or_else(|| crate::account::SYSTEM.to_string())
        };
        if old_system != new_system {
            return Err("config reload not supported for system_account".into());
        }
        self.apply_auth(&opts.auth)?;
        // An account the reload added is told, as those known at start, whether JetStream
        // is its own.
        if let Some(js) = self.jetstream.get() {
            js.serve_not_enabled(self);
        }
        match (self.tls().is_some(), &opts.tls) {
            (true, Some(t)) => {
                *self.tls.write().unwrap_or_else(|e| e.into_inner()) = Some(t.clone());
                crate::info!(self.log, "Reloaded: tls");
            }
            (false, None) => {}
            _ => crate::warn!(
                self.log,
                "Reload: tls turned on or off; it takes effect at the next restart"
            ),
        }
        let auth = self.auth();
        for h in self.clients() {
            let connected = h.meta.lock().unwrap_or_else(|e| e.into_inner()).connected;
            if !connected {
                continue;
            }
            let creds = h
                .creds
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_default();
            let authed = if auth.required {
                auth.authenticate(&creds, h.nonce())
            } else {
                Ok(crate::auth::Authed {
                    user: String::new(),
                    account: crate::account::GLOBAL.into(),
                    perms: None,
                    expires: None,
                    max_subs: -1,
                    max_payload: -1,
                })
            };
            let a = match authed {
                Ok(a) if a.account == h.account().name => a,
                Ok(_) | Err(_) => {
                    // As the reference: closed without an -ERR.
                    crate::info!(
                        self.log,
                        "{} - no longer authorized after reload - closing",
                        h.id
                    );
                    h.close(crate::client::CloseReason::AuthenticationFailure);
                    continue;
                }
            };
            let perms = a
                .perms
                .map(|p| p as Arc<dyn crate::permissions::Permissions>);
            if let Some(p) = &perms {
                let subs: Vec<Arc<Sub>> = h
                    .subs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                    .cloned()
                    .collect();
                for sub in subs {
                    if !p.can_subscribe(&sub.subject, sub.queue.as_deref()) {
                        self.remove_sub(&sub);
                        let sid = String::from_utf8_lossy(&sub.sid);
                        let text = format!(
                            "{} (sid {sid:?})",
                            crate::permissions::subscribe_violation(
                                &sub.subject,
                                sub.queue.as_deref()
                            )
                        );
                        crate::info!(
                            self.log,
                            "{} - Removed sub {:?} (sid {sid:?}) for User {:?} - not authorized",
                            h.id,
                            String::from_utf8_lossy(&sub.subject),
                            a.user
                        );
                        h.send_err(&text);
                    }
                }
            }
            h.set_permissions(perms);
        }
        crate::info!(self.log, "Reloaded server configuration");
        Ok(())
    }

    /// Who may connect now.
    pub fn auth(&self) -> Arc<crate::auth::Auth> {
        self.auth.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The client listener's TLS setup (None: plain text).
    pub fn tls(&self) -> Option<Arc<crate::tls::Tls>> {
        self.tls.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Applies `opts` (authentication and accounts): the accounts' settings and links, then
    /// the users. At start and on reload; on error nothing changes but what was applied
    /// to the accounts before the error (their settings are rebuilt by the next success).
    pub fn apply_auth(&self, opts: &crate::auth::conf::AuthOpts) -> Result<(), String> {
        self.accounts.configure(opts)?;
        let mut auth = crate::auth::Auth::build(opts, &self.accounts)?;
        // As the reference: with TLS and no `authorization { timeout }`, a client has the
        // handshake's timeout plus a second to authenticate.
        if let (None, Some(t)) = (opts.timeout, &self.opts.tls_opts) {
            auth.timeout = t.timeout() + Duration::from_secs(1);
        }
        // Account JWTs can bring exports and imports: links again with them in place.
        if opts.operator_mode() {
            self.accounts.install_links()?;
        }
        // Which accounts have JetStream is fixed at start (each has its own API and
        // streams directory); a reload that changes it says so.
        if let Some(js) = self.jetstream.get() {
            let serving: Vec<&str> = js.all().iter().map(|j| j.account.name.as_str()).collect();
            let wanted: Vec<String> = self
                .accounts
                .jetstream_accounts()
                .iter()
                .map(|a| a.name.clone())
                .collect();
            if serving != wanted {
                crate::warn!(
                    self.log,
                    "Reload: the accounts with JetStream changed (serving {}, configured {}); it takes effect at the next restart",
                    serving.join(", "),
                    wanted.join(", ")
                );
            }
        }
        if let Some(c) = self.cluster.get() {
            c.refresh_imports(self);
        }
        *self.auth.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(auth);
        *self.auth_opts.write().unwrap_or_else(|e| e.into_inner()) = opts.clone();
        *self
            .config_load_time
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = SystemTime::now();
        Ok(())
    }

    /// Spawns a background task of this server; [`wait_tasks`](Self::wait_tasks) waits for
    /// it at shutdown, so a stopped server leaves nothing running.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let token = self
            .tasks
            .token
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        tokio::spawn(async move {
            let _token = token;
            fut.await
        })
    }

    /// After shutdown: waits (at most `limit`) until every task from [`spawn`](Self::spawn)
    /// has ended. Returns whether they all did.
    pub async fn wait_tasks(&self, limit: Duration) -> bool {
        drop(
            self.tasks
                .token
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        let mut done = self.tasks.done.lock().await;
        tokio::time::timeout(limit, done.recv()).await.is_ok()
    }

    /// Remembers an in-process client's queue (for [`seal_internal`](Self::seal_internal)).
    pub(crate) fn register_internal(&self, q: &Arc<InQueue>) {
        let mut reg = self
            .internal_queues
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if reg.live.len() >= reg.prune_at {
            reg.live.retain(|w| w.strong_count() > 0);
            reg.prune_at = (reg.live.len() * 2).max(64);
        }
        reg.live.push(Arc::downgrade(q));
    }

    /// Seals every in-process client's queue: their tasks take what is queued, then end.
    pub fn seal_internal(&self) {
        let live: Vec<Arc<InQueue>> = self
            .internal_queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .live
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        for q in live {
            q.seal();
        }
    }

    /// The INFO line for one client; `connect_info` marks the second INFO sent after the
    /// first PONG (it names the client's account).
    pub fn info_line(
        &self,
        client: &ClientHandle,
        peer: Option<SocketAddr>,
        connect_info: bool,
    ) -> Vec<u8> {
        self.info_line_with(client, peer, connect_info, false)
    }

    /// [`info_line`](Self::info_line); `tls_first` is the INFO a client that did the TLS
    /// handshake first gets, which says `tls_required` even where TLS is optional.
    pub fn info_line_with(
        &self,
        client: &ClientHandle,
        peer: Option<SocketAddr>,
        connect_info: bool,
        tls_first: bool,
    ) -> Vec<u8> {
        let addr = *self.client_addr.lock().unwrap_or_else(|e| e.into_inner());
        let cluster = self.cluster.get();
        let tls = self.tls();
        let tls = tls.as_deref();
        let info = Info {
            server_id: &self.server_id,
            server_name: &self.server_name,
            version: COMPAT_VERSION,
            proto: 1,
            git_commit: GIT_COMMIT,
            go: TOOLCHAIN,
            host: &self.opts.host,
            port: addr.map_or(0, |a| a.port()),
            headers: true,
            // With a no_auth_user a client need not authenticate: the first INFO says so.
            auth_required: {
                let auth = self.auth();
                auth.required && (connect_info || !auth.has_no_auth_user())
            },
            tls_required: tls.is_some_and(|t| t.required() || tls_first),
            tls_verify: tls.is_some_and(|t| t.opts.verify),
            tls_available: tls.is_some_and(|t| !t.required()),
            max_payload: self.opts.max_payload,
            jetstream: self.jetstream_enabled().is_some(),
            client_id: client.id,
            client_ip: peer.map(|p| p.ip().to_string()),
            cluster: cluster.map(|c| c.name()),
            cluster_dynamic: cluster.is_some_and(|c| c.is_dynamic()),
            connect_urls: self.connect_urls(),
            nonce: client.nonce().filter(|_| !connect_info),
            connect_info,
            remote_account: connect_info.then_some(client.account().name.as_str()),
            acc_is_sys: connect_info && self.accounts.is_system(client.account()),
            ldm: self.lame_duck.load(std::sync::atomic::Ordering::Relaxed),
            domain: self.jetstream.get().and_then(|js| js.domain()),
            api_lvl: crate::jetstream::stream::API_LEVEL,
            keel_version: KEEL_VERSION,
        };
        let json = serde_json::to_vec(&info).expect("INFO serializes");
        let mut b = bytes::BytesMut::with_capacity(json.len() + 8);
        keel_protocol::encode::info(&mut b, &json);
        b.to_vec()
    }

    /// This server's client URLs (`host:port`), as it advertises them in a cluster: the
    /// listen address, or for the wildcard host every non-loopback interface address (the
    /// reference's rule).
    pub fn own_client_urls(&self) -> Vec<String> {
        let Some(addr) = *self.client_addr.lock().unwrap_or_else(|e| e.into_inner()) else {
            return Vec::new();
        };
        let port = addr.port();
        match self.opts.host.as_str() {
            "0.0.0.0" | "" | "::" | "[::]" => {
                let ips = crate::route::interface_ips();
                if ips.is_empty() {
                    vec![host_port(&self.opts.host, port)]
                } else {
                    ips.iter()
                        .map(|ip| host_port(&ip.to_string(), port))
                        .collect()
                }
            }
            h => vec![host_port(h, port)],
        }
    }

    /// The `connect_urls` of client INFO: in a cluster (unless `no_advertise`), this
    /// server's URLs then its peers'; in lame duck mode the peers' only.
    fn connect_urls(&self) -> Vec<String> {
        let Some(c) = self.cluster.get() else {
            return Vec::new();
        };
        if c.opts.no_advertise {
            return Vec::new();
        }
        let mut urls = if self.lame_duck.load(std::sync::atomic::Ordering::Relaxed) {
            Vec::new()
        } else {
            self.own_client_urls()
        };
        for u in c.peer_client_urls() {
            if !urls.contains(&u) {
                urls.push(u);
            }
        }
        urls
    }

    /// Sends an INFO with the current `connect_urls` to every client that takes INFO
    /// updates (the cluster gained or lost a server).
    pub fn send_async_info(&self) {
        for h in self.clients() {
            if h.async_info.load(Ordering::Relaxed) {
                let addr = h.meta.lock().unwrap_or_else(|e| e.into_inner()).addr;
                h.send_info(&self.info_line(&h, addr, false));
            }
        }
    }

    /// A fresh id for a connection or an in-process client.
    pub fn next_client_id(&self) -> u64 {
        self.next_cid.fetch_add(1, Ordering::Relaxed)
    }

    /// The server's JetStream while it serves: none if it is not configured, did not
    /// start, or was disabled since (this server removed from its JetStream cluster).
    pub fn jetstream_enabled(&self) -> Option<&Arc<crate::jetstream::JetStreams>> {
        self.jetstream.get().filter(|j| !j.is_disabled())
    }

    pub fn shutdown_rx(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    /// Adds a connection; false when max_connections is reached.
    pub fn register(&self, h: &Arc<ClientHandle>) -> bool {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if clients.len() >= self.opts.max_connections {
            return false;
        }
        clients.insert(h.id, h.clone());
        self.total_connections.fetch_add(1, Ordering::Relaxed);
        true
    }

    pub fn unregister(&self, id: u64) {
        let h = self
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(h) = h {
            let s = &h.stats;
            let c = &self.closed_stats;
            c.in_msgs
                .fetch_add(s.in_msgs.load(Ordering::Relaxed), Ordering::Relaxed);
            c.in_bytes
                .fetch_add(s.in_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
            c.out_msgs
                .fetch_add(s.out_msgs.load(Ordering::Relaxed), Ordering::Relaxed);
            c.out_bytes
                .fetch_add(s.out_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    pub fn clients(&self) -> Vec<Arc<ClientHandle>> {
        self.clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// The connection with this id, if it is still there.
    pub fn client(&self, id: u64) -> Option<Arc<ClientHandle>> {
        self.clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Client connections accepted since start.
    pub fn total_connections(&self) -> u64 {
        self.total_connections.load(Ordering::Relaxed)
    }

    pub fn num_clients(&self) -> usize {
        self.clients.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn totals(&self) -> Totals {
        let c = &self.closed_stats;
        let mut t = Totals {
            in_msgs: c.in_msgs.load(Ordering::Relaxed),
            in_bytes: c.in_bytes.load(Ordering::Relaxed),
            out_msgs: c.out_msgs.load(Ordering::Relaxed),
            out_bytes: c.out_bytes.load(Ordering::Relaxed),
        };
        for h in self.clients() {
            t.in_msgs += h.stats.in_msgs.load(Ordering::Relaxed);
            t.in_bytes += h.stats.in_bytes.load(Ordering::Relaxed);
            t.out_msgs += h.stats.out_msgs.load(Ordering::Relaxed);
            t.out_bytes += h.stats.out_bytes.load(Ordering::Relaxed);
        }
        t
    }

    /// Removes a subscription from its account's index and from its owner's sid table.
    pub fn remove_sub(&self, sub: &Arc<Sub>) {
        sub.client.account().sublist.remove(sub);
        let mut subs = sub.client.subs.lock().unwrap_or_else(|e| e.into_inner());
        if subs.get(&sub.sid).is_some_and(|s| Arc::ptr_eq(s, sub)) {
            subs.remove(&sub.sid);
            drop(subs);
            sub.client.trace_delsub(&sub.sid);
        }
    }

    /// Binds the client listener (port 0 or -1 picks a free port).
    pub async fn bind(&self) -> std::io::Result<TcpListener> {
        let port = if self.opts.port <= 0 {
            0
        } else {
            self.opts.port as u16
        };
        let listener = bind_tcp(&self.opts.host, port, &self.log)?;
        *self.client_addr.lock().unwrap_or_else(|e| e.into_inner()) = Some(listener.local_addr()?);
        Ok(listener)
    }

    /// Accepts clients until shutdown is requested.
    pub async fn accept_loop(self: &Arc<Self>, listener: TcpListener) {
        let mut shutdown = self.shutdown_rx();
        let mut stop_accepting = self.stop_accepting.subscribe();
        let mut tasks = tokio::task::JoinSet::new();
        let mut shutting_down = false;
        loop {
            tokio::select! {
                // Lame duck: close the listener (new clients are refused), keep the rest.
                _ = crate::client::until_true(&mut stop_accepting) => break,
                r = listener.accept() => match r {
                    Ok((stream, _)) => {
                        let id = self.next_client_id();
                        tasks.spawn(client::serve(self.clone(), stream, id));
                    }
                    Err(e) => {
                        crate::error!(self.log, "Error accepting client connection: {e}");
                        // Out of file descriptors and the like: back off instead of spinning.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                _ = crate::client::until_true(&mut shutdown) => {
                    shutting_down = true;
                    break;
                }
            }
        }
        drop(listener);
        while !shutting_down {
            tokio::select! {
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                _ = crate::client::until_true(&mut shutdown) => shutting_down = true,
            }
        }
        // Connections see the shutdown signal, flush what they have queued and close.
        let _ = tokio::time::timeout(Duration::from_secs(3), async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
    }

    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// Tells the cluster this server is stopping (`$SYS.SERVER.<id>.SHUTDOWN`) or entering
    /// lame-duck mode (`.LAMEDUCK`), as the reference does; a stop that is not announced
    /// looks to the others like a server that went away.
    pub fn announce_stop(&self, lame_duck: bool) {
        if let Some(sys) = self.system.get() {
            sys.stopping(self, lame_duck);
        }
    }

    /// Tells every pull waiting on a consumer here that this server stops (`409 Server
    /// Shutdown`), as the reference's shutdown does, and gives the notices a moment to
    /// leave (through the routes too) before connections close.
    pub async fn signal_pull_consumers(&self) {
        let Some(js) = self.jetstream.get() else {
            return;
        };
        if js.signal_pull_consumers(self) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Lame-duck mode (SIGUSR2), as the reference: stop accepting clients, tell connected
    /// ones with an INFO carrying `"ldm":true`, wait the grace period, close the clients
    /// spread over the rest of the lame-duck duration, then shut down.
    pub async fn lame_duck(self: &Arc<Self>) {
        if self
            .lame_duck
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let (duration, grace) = (
            self.opts.lame_duck_duration,
            self.opts.lame_duck_grace_period,
        );
        crate::info!(
            self.log,
            "Entering lame duck mode, stop accepting new clients"
        );
        self.stop_accepting.send_replace(true);
        self.announce_stop(true);
        if let Some(c) = self.cluster.get() {
            c.enter_lame_duck(self);
        }
        for h in self.clients() {
            let meta_addr = h.meta.lock().unwrap_or_else(|e| e.into_inner()).addr;
            h.send_info(&self.info_line(&h, meta_addr, false));
        }
        // As the reference: the Raft groups led here move now (after the clients are told),
        // and this server stands for no election of its own while it winds down.
        crate::jetstream::cluster::hand_off_leadership(self, true).await;
        tokio::time::sleep(grace).await;
        let clients = self.clients();
        if !clients.is_empty() {
            let spread = duration.saturating_sub(grace) / clients.len() as u32;
            crate::info!(self.log, "Closing existing clients");
            for h in clients {
                h.close(client::CloseReason::ServerShutdown);
                tokio::time::sleep(spread.min(Duration::from_secs(1))).await;
            }
        }
        // As the reference's shutdown: the pulls still waiting (those routed from clients
        // of other servers; this server's own clients are gone) are told.
        self.signal_pull_consumers().await;
        self.announce_stop(false);
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wildcard_listener_takes_ipv4_and_ipv6() {
        let log = Log::stderr();
        let l = bind_tcp("0.0.0.0", 0, &log).unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            assert!(l.local_addr().unwrap().is_ipv6(), "one dual-stack socket");
            tokio::net::TcpStream::connect(("::1", port)).await.unwrap();
        }
        let l = bind_tcp("127.0.0.1", 0, &log).unwrap();
        assert!(l.local_addr().unwrap().is_ipv4());
        assert_eq!(host_port("::1", 4222), "[::1]:4222");
        assert_eq!(host_port("0.0.0.0", 4222), "0.0.0.0:4222");
    }
}
