//! Clustering, part 1: core routes between servers, wire-compatible with nats-server 2.15.
//!
//! A server with a cluster port listens for routes and dials the routes it is given; every
//! server ends up with one route to every other (a full mesh: a message that came in on a
//! route is never passed on to another route). What each piece does:
//!
//! * [`Cluster`] (here): the server's cluster state: its name (configured, or generated and
//!   then replaced by a configured one a peer has), the registry of route connections and of
//!   the peers they lead to, the peers' client URLs (for the clients' `connect_urls`), the
//!   route listener, the tasks that dial routes (configured ones forever, with backoff; those
//!   learned by gossip a bounded number of times), gossip of newly registered peers, lame duck.
//! * `conn`: one route connection: the handshake (CONNECT and INFO both ways, the
//!   reference's checks), then the reader (interest and messages from the peer, PING/PONG);
//!   its writer is a client's (`client::write_loop`) over the route's [`ClientHandle`].
//! * `interest`: this server's own interest per account (local subscribers counted per
//!   subject and queue group), kept up to date by a [`SubHook`] on each account's sublist and
//!   sent to every route as `RS+`/`RS-` (queue groups with their member count as weight).
//!
//! The peer's interest lives in the account's sublist as subscriptions of the route's
//! handle, so a publisher's router finds routes in the same cached match result as local
//! subscribers (no lock on publish) and writes `RMSG` into the route's outbound buffer, which
//! is bounded by `max_pending` like a client's: a route that does not drain is cut.
//!
//! What is negotiated with a peer: Keel is a "no pool" peer (one connection, every account
//! on it, the account named in every line; the reference's `pool_size: -1`), declines
//! compression (`"compression":"off"`), announces neither `lnoc` nor `ln` (so leaf interest
//! arrives as plain `RS+`), and refuses a pinned-account connection with the reference's
//! error. JetStream is not clustered: its in-process subscriptions stay on their server.
//!
//! Accounts: every `RS+`/`RS-`/`RMSG` names its account, and a peer's interest lives in that
//! account's sublist, so a message reaches the other servers' subscribers of its own account
//! only. Imports follow the reference's split: a service import is followed on the server
//! where the request is published (the request crosses in the exporter's account, and the
//! exporter's `_R_.<prefix>.>` reply subjects are announced so the response comes back); a
//! stream import is followed on the subscriber's server (its subscribers make interest in the
//! exporter's account, the reference's shadow subscriptions, see `interest`).
//!
//! TLS (`cluster { tls }`): the handshake comes first on the connection, both ends present the
//! one route certificate and verify the other's, as the reference does (`conn::run`).

pub(crate) mod conn;
pub(crate) mod interest;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use keel_protocol::route::{encode, RouteInfo};
use tokio::net::{TcpListener, TcpStream};

use crate::account::Account;
use crate::config::{ClusterOpts, RouteUrl, COMPAT_VERSION, TOOLCHAIN};
use crate::server::Server;
use crate::{debug, error, info, warn};

pub use conn::Route;

/// The first delay before re-dialing a route, and the most that `connect_backoff` lets it
/// grow to (the reference's).
const CONNECT_DELAY: Duration = Duration::from_secs(1);
const CONNECT_MAX_DELAY: Duration = Duration::from_secs(30);
/// How long one dial may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(1);
/// A failed dial is logged as an error on the first attempt and then every this many.
const REPORT_EVERY: u64 = 3600;
/// Routes ping at least this often (the reference's cap).
const MAX_PING_INTERVAL: Duration = Duration::from_secs(30);

/// Gossip modes of a forwarded INFO (the reference's `gossip_mode`).
pub(crate) const GOSSIP_DEFAULT: u8 = 0;
pub(crate) const GOSSIP_DISABLED: u8 = 1;
pub(crate) const GOSSIP_OVERRIDE: u8 = 2;

/// How a route connection came to be.
#[derive(Clone, Debug)]
pub(crate) enum Origin {
    /// A peer dialed us.
    Accepted,
    /// We dialed `url`: a configured route (`explicit`) or one learned by gossip, created
    /// with the gossip mode of the INFO that told us about it.
    Solicited {
        url: RouteUrl,
        explicit: bool,
        gossip_mode: u8,
    },
}

/// The server's cluster state.
pub struct Cluster {
    pub opts: ClusterOpts,
    name: RwLock<String>,
    /// The name was generated; a peer's configured name replaces it.
    dynamic: AtomicBool,
    listen: Mutex<Option<SocketAddr>>,
    state: Mutex<State>,
    /// This server's interest, per account (the hooks on their sublists).
    interest: RwLock<Vec<Arc<interest::AccountInterest>>>,
    /// Routes cut as slow consumers, and found stale (`/varz`).
    pub slow_consumers: Arc<AtomicU64>,
    pub stale: AtomicU64,
    /// Message counters of route connections that have closed, so `/varz` totals do not
    /// go backwards.
    closed: [AtomicU64; 4],
    lame_duck: AtomicBool,
}

#[derive(Default)]
struct State {
    /// The registered route of each peer, by its server id.
    peers: HashMap<String, Arc<Route>>,
    /// Every route connection alive (registered or still in its handshake), by rid.
    conns: HashMap<u64, Arc<Route>>,
    /// The peers' client URLs, each counted once per peer advertising it.
    urls: Vec<(String, usize)>,
    /// Routes learned by gossip that are being dialed (`host:port`).
    dialing: HashSet<String>,
}

/// Route totals for `/varz`.
#[derive(Default, Clone, Copy)]
pub struct RouteTotals {
    pub in_msgs: u64,
    pub in_bytes: u64,
    pub out_msgs: u64,
    pub out_bytes: u64,
}

impl Cluster {
    /// Creates the cluster state of `server` and puts the interest hook on every account's
    /// sublist. Call before anything subscribes (JetStream, clients).
    pub fn install(server: &Arc<Server>) -> Arc<Cluster> {
        let opts = server.opts.cluster.clone();
        let (name, dynamic) = match &opts.name {
            Some(n) => (n.clone(), false),
            None => (random_name(22), true),
        };
        let c = Arc::new(Cluster {
            opts,
            name: RwLock::new(name),
            dynamic: AtomicBool::new(dynamic),
            listen: Mutex::new(None),
            state: Mutex::new(State::default()),
            interest: RwLock::new(Vec::new()),
            slow_consumers: Arc::new(AtomicU64::new(0)),
            stale: AtomicU64::new(0),
            closed: Default::default(),
            lame_duck: AtomicBool::new(false),
        });
        // Accounts made later (a reload, an operator's account resolved at connect) are
        // watched as they are made, before anyone can subscribe in them.
        let weak = Arc::downgrade(&c);
        server.accounts.set_on_new(Box::new(move |a| {
            if let Some(c) = weak.upgrade() {
                c.watch_account(a);
            }
        }));
        for account in server.accounts.all() {
            c.watch_account(&account);
        }
        c
    }

    /// Keeps the peers told about `account`'s interest (every account the server has must
    /// be watched from its creation, before it has subscribers).
    pub fn watch_account(self: &Arc<Self>, account: &Arc<Account>) {
        let hook = interest::AccountInterest::new(account.name.clone());
        if account.sublist.set_hook(hook.clone()) {
            self.interest
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .push(hook);
        }
    }

    /// Tells each account's interest which streams it imports (from the links that the
    /// accounts' exports and imports made). Call whenever the links change: subscriptions
    /// made from then on make interest in the exporters' accounts.
    pub fn refresh_imports(&self, server: &Server) {
        use crate::sublist::{LinkKind, SubjectMap};
        use interest::{Rename, StreamImport};
        let interest = self
            .interest
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut per: HashMap<String, Vec<StreamImport>> = HashMap::new();
        for exporter in server.accounts.all() {
            let Some(ei) = interest.iter().find(|i| i.account == exporter.name) else {
                continue;
            };
            for l in exporter.sublist.links().iter() {
                if let LinkKind::Stream { to, map } = &l.kind {
                    let rename = match map {
                        SubjectMap::Same => Rename::Same,
                        SubjectMap::Prefix(p) => Rename::Prefix(Bytes::from(p.clone())),
                        SubjectMap::Transform(_) => Rename::Other,
                    };
                    per.entry(to.name.clone()).or_default().push(StreamImport {
                        exporter: ei.clone(),
                        pattern: l.pattern.clone(),
                        rename,
                    });
                }
            }
        }
        for i in interest.iter() {
            i.set_imports(per.remove(&i.account).unwrap_or_default());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn name(&self) -> String {
        self.name.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn is_dynamic(&self) -> bool {
        self.dynamic.load(Ordering::Relaxed)
    }

    /// Where routes are accepted, once listening.
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        *self.listen.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The route connections, registered ones only, as `/routez` lists them.
    pub fn routes(&self) -> Vec<Arc<Route>> {
        let mut v: Vec<Arc<Route>> = self.lock().peers.values().cloned().collect();
        v.sort_by_key(|r| r.rid);
        v
    }

    /// Resolves once every registered route has made a round trip (`Route::round_trip`):
    /// what this server told them is read, and what they sent before is read here.
    pub async fn round_trip_all(&self) {
        let mut trips = tokio::task::JoinSet::new();
        for r in self.routes() {
            trips.spawn(async move { r.round_trip().await });
        }
        trips.join_all().await;
    }

    /// Whether the peer named `name` said it is in lame duck mode (it must not be made a
    /// leader: it stands for no election and stops soon).
    pub fn peer_in_lame_duck(&self, name: &str) -> bool {
        self.lock()
            .peers
            .values()
            .any(|r| r.lame_duck() && r.remote_name() == name)
    }

    /// How many other servers this one has a route to.
    pub fn num_peers(&self) -> usize {
        self.lock().peers.len()
    }

    /// The server ids of the peers.
    pub fn peer_ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.lock().peers.keys().cloned().collect();
        v.sort();
        v
    }

    /// The peers' client URLs (without this server's own).
    pub fn peer_client_urls(&self) -> Vec<String> {
        self.lock().urls.iter().map(|(u, _)| u.clone()).collect()
    }

    /// Message totals over every route, open and closed.
    pub fn totals(&self) -> RouteTotals {
        let c = &self.closed;
        let mut t = RouteTotals {
            in_msgs: c[0].load(Ordering::Relaxed),
            in_bytes: c[1].load(Ordering::Relaxed),
            out_msgs: c[2].load(Ordering::Relaxed),
            out_bytes: c[3].load(Ordering::Relaxed),
        };
        for r in self.lock().conns.values() {
            let s = &r.handle.stats;
            t.in_msgs += s.in_msgs.load(Ordering::Relaxed);
            t.in_bytes += s.in_bytes.load(Ordering::Relaxed);
            t.out_msgs += s.out_msgs.load(Ordering::Relaxed);
            t.out_bytes += s.out_bytes.load(Ordering::Relaxed);
        }
        t
    }

    /// The host and port in this server's route INFO: `advertise`, else the listen address.
    fn info_host_port(&self) -> (String, u16) {
        if let Some(a) = &self.opts.advertise {
            if let Ok(u) = RouteUrl::parse(a) {
                return (u.host, u.port);
            }
        }
        let port = self.listen_addr().map_or(0, |a| a.port());
        (self.opts.listen_host().to_string(), port)
    }

    /// This server's route INFO (`nonce` for the first INFO of a connection).
    pub(crate) fn info(&self, server: &Server, nonce: bool) -> RouteInfo {
        let (host, port) = self.info_host_port();
        let ip = match &self.opts.advertise {
            Some(_) => format!("nats-route://{}/", crate::server::host_port(&host, port)),
            None => String::new(),
        };
        RouteInfo {
            server_id: server.server_id.clone(),
            server_name: server.server_name.clone(),
            version: COMPAT_VERSION.into(),
            // 2: accounts on routes. Not 3 (message tracing), which Keel does not do.
            proto: 2,
            go: TOOLCHAIN.into(),
            host,
            port,
            headers: true,
            auth_required: self.opts.user.is_some(),
            tls_required: self.opts.tls.is_some(),
            tls_verify: self.opts.tls.is_some(),
            max_payload: i32::try_from(server.opts.max_payload).unwrap_or(i32::MAX),
            ip,
            nonce: if nonce {
                random_name(15)
            } else {
                String::new()
            },
            cluster: self.name(),
            cluster_dynamic: self.is_dynamic(),
            connect_urls: if self.opts.no_advertise {
                Vec::new()
            } else {
                server.own_client_urls()
            },
            ldm: self.lame_duck.load(Ordering::Relaxed),
            compression: "off".into(),
            // Peers with JetStream form the meta group (`jetstream::cluster`). From the
            // config, not `jetstream_enabled()`: routes start before JetStream does.
            jetstream: server.opts.jetstream
                && !server.jetstream.get().is_some_and(|j| j.is_disabled()),
            tags: server.opts.server_tags.clone(),
            js_limits: server.opts.jetstream.then(|| {
                let (memory, store) = server.storage_limits();
                [memory, store]
            }),
            ..RouteInfo::default()
        }
    }

    /// Binds the route listener, logs it, starts accepting and dials the configured
    /// routes. Err once the reason is logged.
    pub(crate) async fn start(self: &Arc<Self>, server: &Arc<Server>) -> Result<(), ()> {
        let log = &server.log;
        let port = if self.opts.port < 0 {
            0
        } else {
            self.opts.port as u16
        };
        let host = self.opts.listen_host().to_string();
        let listener = match crate::server::bind_tcp(&host, port, log) {
            Ok(l) => l,
            Err(e) => {
                error!(log, "Error listening on router port: {host}:{port}, {e}");
                return Err(());
            }
        };
        let addr = listener.local_addr().map_err(|e| {
            error!(log, "Error listening on router port: {e}");
        })?;
        *self.listen.lock().unwrap_or_else(|e| e.into_inner()) = Some(addr);
        info!(log, "Cluster name is {}", self.name());
        if self.is_dynamic() {
            warn!(
                log,
                "Cluster name was dynamically generated, consider setting one"
            );
        }
        info!(
            log,
            "Listening for route connections on {}",
            crate::server::host_port(&host, addr.port())
        );
        server.spawn(accept_loop(server.clone(), self.clone(), listener));
        for url in &self.opts.routes {
            server.spawn(solicit(
                server.clone(),
                self.clone(),
                url.clone(),
                true,
                GOSSIP_DEFAULT,
            ));
        }
        Ok(())
    }

    /// Counts a closing connection's traffic into the totals and forgets it.
    fn forget(&self, route: &Arc<Route>) {
        let s = &route.handle.stats;
        let c = &self.closed;
        c[0].fetch_add(s.in_msgs.load(Ordering::Relaxed), Ordering::Relaxed);
        c[1].fetch_add(s.in_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        c[2].fetch_add(s.out_msgs.load(Ordering::Relaxed), Ordering::Relaxed);
        c[3].fetch_add(s.out_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Registers `route` as the route to the server it leads to (its first INFO was
    /// checked). Err(the existing route) when there already is one: `route` is the
    /// duplicate and must close. On success: gossip of the new peer to the others, the
    /// peer's client URLs to this server's clients, and this server's interest to the peer.
    pub(crate) fn add_route(
        self: &Arc<Self>,
        server: &Arc<Server>,
        route: &Arc<Route>,
        info: &RouteInfo,
    ) -> Result<(), Arc<Route>> {
        let id = info.server_id.clone();
        let (gossip, urls_changed) = {
            let mut st = self.lock();
            if let Some(existing) = st.peers.get(&id) {
                let existing = existing.clone();
                drop(st);
                // Whichever connection survives takes over this one's duty to reconnect
                // (it was dialed to a configured URL, say), and re-dials if it drops, in
                // case the peer keeps the other connection and closes it.
                existing.adopt_duplicate(route);
                return Err(existing);
            }
            st.peers.insert(id.clone(), route.clone());
            route.set_registered();
            let mut changed = false;
            if !self.opts.no_advertise {
                for u in &info.connect_urls {
                    match st.urls.iter_mut().find(|(x, _)| x == u) {
                        Some((_, n)) => *n += 1,
                        None => {
                            st.urls.push((u.clone(), 1));
                            changed = true;
                        }
                    }
                }
            }
            let others: Vec<Arc<Route>> = st
                .peers
                .iter()
                .filter(|(k, _)| **k != id)
                .map(|(_, r)| r.clone())
                .collect();
            (others, changed)
        };
        self.forward_gossip(route, info, &gossip);
        if urls_changed {
            server.send_async_info();
        }
        for hook in self
            .interest
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            hook.attach(route);
        }
        Ok(())
    }

    /// The reference's rules for telling the other peers about a new one, so they dial it
    /// (that is how a mesh forms from any seed).
    fn forward_gossip(&self, route: &Arc<Route>, info: &RouteInfo, others: &[Arc<Route>]) {
        if others.is_empty() {
            return;
        }
        let (solicited, explicit, local_mode) = route.origin_flags();
        let from_gossip = solicited && !explicit;
        if (from_gossip && local_mode != GOSSIP_OVERRIDE) || info.gossip_mode == GOSSIP_DISABLED {
            return;
        }
        let mut g = info.clone();
        g.nonce.clear();
        if g.ip.is_empty() {
            let host = route
                .addr
                .map(|a| a.ip().to_string())
                .unwrap_or_else(|| g.host.clone());
            g.ip = format!("nats-route://{}/", crate::server::host_port(&host, g.port));
        }
        for r in others {
            let (_, r_explicit, _) = r.origin_flags();
            g.gossip_mode = if (!solicited && r_explicit) || (solicited && explicit) {
                GOSSIP_OVERRIDE
            } else if !solicited {
                GOSSIP_DISABLED
            } else {
                GOSSIP_DEFAULT
            };
            let mut b = BytesMut::new();
            encode::gossip_info(&mut b, &g);
            r.send(&b);
        }
    }

    /// A route connection ends: forgotten, its peer's client URLs withdrawn if it was the
    /// peer's registered route, and detached from this server's interest.
    pub(crate) fn remove_route(self: &Arc<Self>, server: &Arc<Server>, route: &Arc<Route>) {
        let urls_changed = {
            let mut st = self.lock();
            st.conns.remove(&route.rid);
            let id = route.remote_id();
            let was_registered = st.peers.get(&id).is_some_and(|r| Arc::ptr_eq(r, route));
            let mut changed = false;
            if was_registered {
                st.peers.remove(&id);
                if !self.opts.no_advertise && !route.lame_duck() {
                    changed = remove_urls(&mut st.urls, &route.connect_urls());
                }
            }
            changed
        };
        self.forget(route);
        for hook in self
            .interest
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            hook.detach(route);
        }
        if urls_changed {
            server.send_async_info();
        }
    }

    /// A peer said it is in lame duck mode: clients must no longer be sent to it.
    pub(crate) fn peer_lame_duck(&self, server: &Server, route: &Arc<Route>) {
        if self.opts.no_advertise {
            return;
        }
        let changed = {
            let mut st = self.lock();
            let registered = st
                .peers
                .get(&route.remote_id())
                .is_some_and(|r| Arc::ptr_eq(r, route));
            registered && remove_urls(&mut st.urls, &route.connect_urls())
        };
        if changed {
            server.send_async_info();
        }
    }

    fn track(&self, route: &Arc<Route>) {
        self.lock().conns.insert(route.rid, route.clone());
    }

    /// Closes every route but the one to `keep` (the cluster name changed).
    fn close_all_except(&self, keep: &str) {
        let conns: Vec<Arc<Route>> = self.lock().conns.values().cloned().collect();
        for r in conns {
            if r.remote_id() != keep {
                r.close_with(conn::RouteClose::ClusterNameConflict);
            }
        }
    }

    /// Takes a peer's configured cluster name in place of a generated one.
    fn adopt_name(&self, server: &Server, name: &str, remote_dynamic: bool, keep: &str) {
        *self.name.write().unwrap_or_else(|e| e.into_inner()) = name.to_string();
        if !remote_dynamic {
            self.dynamic.store(false, Ordering::Relaxed);
        }
        info!(server.log, "Cluster name updated to {name}");
        self.close_all_except(keep);
    }

    /// Whether `name` (a peer's) should replace ours, which is generated.
    fn should_adopt(&self, name: &str, remote_dynamic: bool) -> bool {
        self.is_dynamic() && (!remote_dynamic || self.name().as_str() < name)
    }

    /// A gossip INFO about another server: dial it unless it is known or configured.
    pub(crate) fn implicit_route(self: &Arc<Self>, server: &Arc<Server>, info: &RouteInfo) {
        if info.server_id == server.server_id || !info.route_account.is_empty() {
            return;
        }
        let Ok(mut url) = RouteUrl::parse(&info.ip) else {
            debug!(server.log, "Ignoring gossip without a route URL");
            return;
        };
        let configured = self.opts.routes.iter().any(|r| {
            let hp = r.host_port().to_ascii_lowercase();
            hp == crate::server::host_port(&info.host, info.port).to_ascii_lowercase()
                || hp == url.host_port().to_ascii_lowercase()
        });
        if configured {
            return;
        }
        {
            let mut st = self.lock();
            if st.peers.contains_key(&info.server_id) || !st.dialing.insert(url.host_port()) {
                return;
            }
        }
        if info.auth_required {
            url.user = self.opts.user.clone();
            url.pass = self.opts.password.clone();
        }
        let me = self.clone();
        let srv = server.clone();
        let mode = info.gossip_mode;
        server.spawn(async move {
            let key = url.host_port();
            solicit(srv, me.clone(), url, false, mode).await;
            me.lock().dialing.remove(&key);
        });
    }

    /// Lame duck mode: tells every peer, which then stops advertising this server's client
    /// URLs to its clients.
    pub fn enter_lame_duck(&self, server: &Server) {
        self.lame_duck.store(true, Ordering::Relaxed);
        let mut info = self.info(server, false);
        info.ldm = true;
        let mut b = BytesMut::new();
        encode::info(&mut b, &info);
        for r in self.routes() {
            r.send(&b);
        }
    }

    /// Tells every peer this server's INFO again (JetStream disabled here: its peers then
    /// leave it out of the meta group).
    pub fn announce_info(&self, server: &Server) {
        let mut b = BytesMut::new();
        encode::info(&mut b, &self.info(server, false));
        for r in self.routes() {
            r.send(&b);
        }
    }

    pub fn in_lame_duck(&self) -> bool {
        self.lame_duck.load(Ordering::Relaxed)
    }

    /// The route with this rid, registered or not (tests, monitoring).
    pub fn conn(&self, rid: u64) -> Option<Arc<Route>> {
        self.lock().conns.get(&rid).cloned()
    }
}

fn remove_urls(urls: &mut Vec<(String, usize)>, gone: &[String]) -> bool {
    let mut changed = false;
    for u in gone {
        if let Some(i) = urls.iter().position(|(x, _)| x == u) {
            urls[i].1 -= 1;
            if urls[i].1 == 0 {
                urls.remove(i);
                changed = true;
            }
        }
    }
    changed
}

/// Random letters and digits (cluster names, nonces), as the reference's look.
fn random_name(n: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    (0..n)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

async fn accept_loop(server: Arc<Server>, cluster: Arc<Cluster>, listener: TcpListener) {
    let mut shutdown = server.shutdown_rx();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let (s, c) = (server.clone(), cluster.clone());
                    server.spawn(async move {
                        conn::run(s, c, stream, Origin::Accepted).await;
                    });
                }
                Err(e) => {
                    error!(server.log, "Error accepting route connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = crate::client::until_true(&mut shutdown) => return,
        }
    }
}

/// Sleeps `d`; false if the server shut down meanwhile.
async fn pause(server: &Server, d: Duration) -> bool {
    let mut shutdown = server.shutdown_rx();
    tokio::select! {
        _ = tokio::time::sleep(d) => !*shutdown.borrow(),
        _ = crate::client::until_true(&mut shutdown) => false,
    }
}

async fn dial(url: &RouteUrl) -> std::io::Result<TcpStream> {
    let host = url.host.clone();
    let target = (host.as_str(), url.port);
    match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(target)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "i/o timeout",
        )),
    }
}

/// Dials `url` and keeps a route to it: a configured route (`explicit`) forever, retrying
/// every second (doubling up to 30 s with `connect_backoff`); one learned by gossip with
/// `connect_retries` retries per outage. When the server at the URL is reached through
/// another connection (it dialed us first), that connection is watched instead and the URL
/// dialed again when it drops.
async fn solicit(
    server: Arc<Server>,
    cluster: Arc<Cluster>,
    url: RouteUrl,
    explicit: bool,
    gossip_mode: u8,
) {
    let opts = &cluster.opts;
    let mut attempts: u64 = 0;
    let mut delay = CONNECT_DELAY;
    let mut first_connect = true;
    loop {
        if *server.shutdown_rx().borrow() {
            return;
        }
        debug!(
            server.log,
            "Trying to connect to route on {}",
            url.host_port()
        );
        let stream = match dial(&url).await {
            Ok(s) => s,
            Err(e) => {
                attempts += 1;
                let why = match e.kind() {
                    std::io::ErrorKind::ConnectionRefused => "connect: connection refused".into(),
                    std::io::ErrorKind::TimedOut => "i/o timeout".into(),
                    _ => e.to_string(),
                };
                let msg = format!(
                    "Error trying to connect to route (attempt {attempts}): dial tcp {}: {why}",
                    url.host_port()
                );
                // As the reference: the first failure, then every hour's worth of attempts
                // while the route never connected; every failure once it had.
                let every = if first_connect { REPORT_EVERY } else { 1 };
                if attempts == 1 || attempts.is_multiple_of(every) {
                    error!(server.log, "{msg}");
                } else {
                    debug!(server.log, "{msg}");
                }
                if !explicit && attempts > u64::from(opts.connect_retries) {
                    return;
                }
                if !pause(&server, delay).await {
                    return;
                }
                if opts.connect_backoff {
                    delay = (delay * 2).min(CONNECT_MAX_DELAY);
                }
                continue;
            }
        };
        attempts = 0;
        delay = CONNECT_DELAY;
        first_connect = false;
        let origin = Origin::Solicited {
            url: url.clone(),
            explicit,
            gossip_mode,
        };
        let outcome = conn::run(server.clone(), cluster.clone(), stream, origin).await;
        if *server.shutdown_rx().borrow() {
            return;
        }
        if outcome.to_self {
            debug!(
                server.log,
                "Detected route to self, ignoring {}",
                url.host_port()
            );
            return;
        }
        if !outcome.reconnect {
            return;
        }
        // The peer is reached through another connection: watch it instead.
        let mut watched = outcome.duplicate_of;
        loop {
            if let Some(other) = watched.take() {
                other.closed().await;
                if *server.shutdown_rx().borrow() {
                    return;
                }
            }
            // Meanwhile the peer may have dialed us again.
            let again = outcome
                .remote_id
                .as_ref()
                .and_then(|id| cluster.lock().peers.get(id).cloned());
            match again {
                Some(r) => watched = Some(r),
                None => break,
            }
        }
        debug!(
            server.log,
            "Attempting reconnect for solicited route \"{url}\""
        );
        // Both sides may have kept the other's connection and closed their own; a random
        // pause keeps them from doing it again.
        let mut wait = Duration::from_millis(rand::random_range(0..100));
        if explicit {
            wait += CONNECT_DELAY;
        }
        if !pause(&server, wait).await {
            return;
        }
    }
}

/// The ping interval of routes: the cluster's or the server's, at most 30 s.
pub(crate) fn ping_interval(server: &Server, cluster: &Cluster) -> Duration {
    cluster
        .opts
        .ping_interval
        .unwrap_or(server.opts.ping_interval)
        .min(MAX_PING_INTERVAL)
}

/// A route's subscription (the peer's interest), as `/routez?subs=detail` lists it.
pub struct RemoteSubInfo {
    pub account: String,
    pub subject: Bytes,
    pub queue: Option<Bytes>,
    pub weight: u32,
    pub sid: Bytes,
    pub msgs: u64,
}

/// The machine's non-loopback, non-link-local interface addresses (what a wildcard listen
/// address advertises).
pub(crate) fn interface_ips() -> Vec<std::net::IpAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we only read and then free once.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut p = head;
        while !p.is_null() {
            let ifa = &*p;
            p = ifa.ifa_next;
            if ifa.ifa_addr.is_null() {
                continue;
            }
            let ip = match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr))
                }
                _ => continue,
            };
            let link_local = match ip {
                IpAddr::V4(v4) => v4.is_link_local(),
                IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
            };
            if !ip.is_loopback() && !link_local && !out.contains(&ip) {
                out.push(ip);
            }
        }
        libc::freeifaddrs(head);
    }
    out
}

/// Whether `sub` is this server's own interest, which peers are told about and whose
/// messages from peers it gets: a client's, not another route's; in-process clients stay
/// local (JetStream is per server) but for the system services that serve the cluster
/// (`system::serves_peers`).
pub(crate) fn serves_peers(sub: &crate::sublist::Sub) -> bool {
    !sub.client.is_route()
        && (sub.client.internal_queue().is_none()
            || crate::system::serves_peers(sub)
            || crate::jetstream::raft::serves_peers(sub))
}
