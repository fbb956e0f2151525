//! One route connection: the handshake with its checks, then the reader (the peer's
//! interest and messages, PING/PONG). The writer is a client's, over the route's handle.
//!
//! Handshake, as nats-server 2.15: the dialing side sends `CONNECT` and then its `INFO` (Keel
//! neither pools nor compresses, so it never delays its INFO); the accepting side sends its
//! `INFO` at once and expects `CONNECT` before anything else. The first INFO each side reads
//! registers the route (unless it leads to this server itself, to a peer already reached
//! through another connection, to a server of another cluster or of the same name), then
//! each side sends its whole interest. Later INFOs on the route are gossip about other
//! servers, or lame duck mode.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use keel_protocol::route::{
    encode, RouteConnect, RouteInfo, RouteMsg, RouteOp, RouteParseError, RouteParser,
};
use keel_protocol::subject;
use tokio::io::AsyncReadExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::{Cluster, Origin, RemoteSubInfo};
use crate::account::Account;
use crate::client::{self, until_true, ClientHandle, CloseReason};
use crate::config::RouteUrl;
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::sublist::Sub;
use crate::{debug, error, info};

/// The largest routed message Keel takes (headers and payload): the most any server's
/// `max_payload` may be. The reference sets no limit on routes; one bounds a route's memory.
const MAX_ROUTED: usize = 64 * 1024 * 1024;
/// How much a read asks for.
const READ_SIZE: usize = 64 * 1024;
/// The first PING after registration (the reference's, plus up to 20% jitter).
const FIRST_PING: Duration = Duration::from_secs(1);
/// How long a stopping server reads on from a route whose peer has not closed its side.
const LINGER: Duration = Duration::from_secs(1);

/// Why a route closed, in the reference's words (`Router connection closed: <reason>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RouteClose {
    ClientClosed,
    ServerShutdown,
    DuplicateRoute,
    DuplicateServerName,
    ClusterNameConflict,
    AuthenticationFailure,
    AuthenticationTimeout,
    ProtocolViolation,
    ParseError,
    StaleConnection,
    ReadError,
    WriteError,
    SlowConsumerPendingBytes,
    SlowConsumerWriteDeadline,
}

impl RouteClose {
    pub(crate) fn text(self) -> &'static str {
        match self {
            RouteClose::ClientClosed => "Client Closed",
            RouteClose::ServerShutdown => "Server Shutdown",
            RouteClose::DuplicateRoute => "Duplicate Route",
            RouteClose::DuplicateServerName => "Duplicate Server Name",
            RouteClose::ClusterNameConflict => "Cluster Name Conflict",
            RouteClose::AuthenticationFailure => "Authentication Failure",
            RouteClose::AuthenticationTimeout => "Authentication Timeout",
            RouteClose::ProtocolViolation => "Protocol Violation",
            RouteClose::ParseError => "Parse Error",
            RouteClose::StaleConnection => "Stale Connection",
            RouteClose::ReadError => "Read Error",
            RouteClose::WriteError => "Write Error",
            RouteClose::SlowConsumerPendingBytes => "Slow Consumer (Pending Bytes)",
            RouteClose::SlowConsumerWriteDeadline => "Slow Consumer (Write Deadline)",
        }
    }

    fn of_handle(r: Option<CloseReason>) -> RouteClose {
        match r {
            Some(CloseReason::SlowConsumerPendingBytes) => RouteClose::SlowConsumerPendingBytes,
            Some(CloseReason::SlowConsumerWriteDeadline) => RouteClose::SlowConsumerWriteDeadline,
            Some(CloseReason::ServerShutdown) => RouteClose::ServerShutdown,
            Some(CloseReason::ReadError) => RouteClose::ReadError,
            _ => RouteClose::WriteError,
        }
    }
}

/// One route connection, as the cluster registry and the publish path see it.
pub struct Route {
    /// The connection id (`rid` in logs and `/routez`), from the server's client ids.
    pub rid: u64,
    /// Its outbound buffer and counters; the peer's subscriptions belong to it.
    pub handle: Arc<ClientHandle>,
    /// The peer's socket address.
    pub addr: Option<SocketAddr>,
    pub start: SystemTime,
    meta: Mutex<Meta>,
    /// The peer's interest: key (`<acc> <subject>[ <queue>]`, `L`-prefixed for leaf
    /// interest) to its subscription in the account's sublist.
    subs: Mutex<HashMap<Bytes, RemoteSub>>,
    why: OnceLock<RouteClose>,
    /// The PINGs sent and not answered yet, oldest first (the peer answers each with a
    /// PONG, in order): with a waiter for those `round_trip` sent.
    pings: Mutex<std::collections::VecDeque<Option<tokio::sync::oneshot::Sender<()>>>>,
}

struct RemoteSub {
    account: Arc<Account>,
    sub: Arc<Sub>,
    weight: u32,
}

#[derive(Default)]
struct Meta {
    remote_id: String,
    remote_name: String,
    remote_tags: Vec<String>,
    /// The peer's JetStream memory and file store limits (`RouteInfo::js_limits`).
    remote_js_limits: Option<[i64; 2]>,
    /// The peer runs JetStream (its INFO says so).
    remote_jetstream: bool,
    /// This server dialed it (or took over that duty from a duplicate it replaced).
    solicited: bool,
    /// It is a configured route (or took over from one).
    explicit: bool,
    url: Option<RouteUrl>,
    /// The gossip mode of the INFO that made us dial it.
    gossip_mode: u8,
    registered: bool,
    connect_urls: Vec<String>,
    lame_duck: bool,
}

impl Route {
    pub(crate) fn new(
        rid: u64,
        handle: Arc<ClientHandle>,
        addr: Option<SocketAddr>,
        origin: &Origin,
    ) -> Self {
        let mut meta = Meta::default();
        if let Origin::Solicited {
            url,
            explicit,
            gossip_mode,
        } = origin
        {
            meta.solicited = true;
            meta.explicit = *explicit;
            meta.url = Some(url.clone());
            meta.gossip_mode = *gossip_mode;
        }
        Route {
            rid,
            handle,
            addr,
            start: SystemTime::now(),
            meta: Mutex::new(meta),
            subs: Mutex::new(HashMap::new()),
            why: OnceLock::new(),
            pings: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// Sends a PING, whose PONG wakes `waiter` if any.
    fn ping(&self, waiter: Option<tokio::sync::oneshot::Sender<()>>) {
        // Queued and sent under one lock: the queue's order is the wire's.
        let mut pings = self.pings.lock().unwrap_or_else(|e| e.into_inner());
        pings.push_back(waiter);
        self.send(encode::PING);
    }

    /// A PONG came: wakes the round trip it answers, if any. True when it answers a
    /// keepalive PING (or none: a peer's own).
    fn ponged(&self) -> bool {
        let next = self
            .pings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        match next {
            Some(Some(waiter)) => {
                let _ = waiter.send(());
                false
            }
            _ => true,
        }
    }

    /// Resolves once the peer has read everything sent to it so far and everything it sent
    /// before that has been read here (a PING's PONG: each side reads and writes a route
    /// in order). False if the route closed first.
    pub async fn round_trip(&self) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.ping(Some(tx));
        rx.await.is_ok()
    }

    fn meta(&self) -> std::sync::MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn remote_id(&self) -> String {
        self.meta().remote_id.clone()
    }

    pub fn remote_name(&self) -> String {
        self.meta().remote_name.clone()
    }

    /// The peer's `server_tags`, as its INFO said.
    pub fn remote_tags(&self) -> Vec<String> {
        self.meta().remote_tags.clone()
    }

    /// The peer's JetStream memory and file store limits, if it said them.
    pub fn remote_js_limits(&self) -> Option<[i64; 2]> {
        self.meta().remote_js_limits
    }

    /// Whether the peer runs JetStream.
    pub fn remote_jetstream(&self) -> bool {
        self.meta().remote_jetstream
    }

    /// `did_solicit` in `/routez`.
    pub fn solicited(&self) -> bool {
        self.meta().solicited
    }

    /// `is_configured` in `/routez`.
    pub fn configured(&self) -> bool {
        self.meta().explicit
    }

    pub(crate) fn origin_flags(&self) -> (bool, bool, u8) {
        let m = self.meta();
        (m.solicited, m.explicit, m.gossip_mode)
    }

    pub(crate) fn set_registered(&self) {
        self.meta().registered = true;
    }

    pub fn registered(&self) -> bool {
        self.meta().registered
    }

    pub(crate) fn connect_urls(&self) -> Vec<String> {
        self.meta().connect_urls.clone()
    }

    pub(crate) fn lame_duck(&self) -> bool {
        self.meta().lame_duck
    }

    /// This registered route replaces `dup`, a second connection to the same peer.
    pub(crate) fn adopt_duplicate(&self, dup: &Route) {
        let (solicited, explicit, url) = {
            let d = dup.meta();
            (d.solicited, d.explicit, d.url.clone())
        };
        let mut m = self.meta();
        if solicited && !m.solicited {
            m.solicited = true;
            m.url = url;
        }
        if explicit {
            m.explicit = true;
        }
    }

    /// Queues protocol bytes (interest, INFO) for the peer, under the route's max_pending.
    pub(crate) fn send(&self, bytes: &[u8]) {
        if self.handle.traces_socket() {
            self.handle.trace_route_lines(bytes);
        }
        self.send_untraced(bytes);
    }

    /// As `send`, not traced: the interest a new route is given at once (the reference
    /// does not trace that either).
    pub(crate) fn send_untraced(&self, bytes: &[u8]) {
        if self.handle.queue_bounded(bytes) {
            self.handle.signal();
        }
    }

    /// Closes the connection (its reader sees it and cleans up).
    pub(crate) fn close_with(&self, why: RouteClose) {
        let _ = self.why.set(why);
        self.handle.close(CloseReason::ServerShutdown);
    }

    /// Completes once the connection has closed.
    pub async fn closed(&self) {
        let mut rx = self.handle.closed_rx();
        until_true(&mut rx).await;
    }

    /// How many subscriptions of the peer this route holds.
    pub fn num_subs(&self) -> usize {
        self.subs.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The peer's subscriptions, for `/routez?subs=1`.
    pub fn subs_info(&self) -> Vec<RemoteSubInfo> {
        let subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<RemoteSubInfo> = subs
            .values()
            .map(|r| RemoteSubInfo {
                account: r.account.name.clone(),
                subject: r.sub.subject.clone(),
                queue: r.sub.queue.clone(),
                weight: r.weight,
                sid: r.sub.sid.clone(),
                msgs: r.sub.delivered.load(Ordering::Relaxed),
            })
            .collect();
        v.sort_by(|a, b| a.sid.cmp(&b.sid));
        v
    }

    /// The log prefix of this connection, as the reference's (`127.0.0.1:46252 - rid:8`).
    fn tag(&self) -> String {
        match self.addr {
            Some(a) => format!("{a} - rid:{}", self.rid),
            None => format!("rid:{}", self.rid),
        }
    }

    fn add_remote_sub(
        &self,
        key: Bytes,
        account: &Arc<Account>,
        subject: &[u8],
        queue: Option<(&[u8], u32)>,
    ) {
        let mut subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = subs.get_mut(&key) {
            // A queue group's new member count replaces the old (plain interest: nothing).
            if let Some((_, w)) = queue {
                if existing.weight != w {
                    existing.weight = w;
                    existing.account.sublist.set_weight(&existing.sub, w);
                }
            }
            return;
        }
        let weight = queue.map_or(1, |(_, w)| w);
        let sub = Arc::new(Sub {
            client: self.handle.clone(),
            sid: key.clone(),
            subject: Bytes::copy_from_slice(subject),
            queue: queue.map(|(q, _)| Bytes::copy_from_slice(q)),
            max: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        });
        account.sublist.insert_remote(sub.clone(), weight);
        subs.insert(
            key,
            RemoteSub {
                account: account.clone(),
                sub,
                weight,
            },
        );
    }

    fn remove_remote_sub(&self, key: &[u8]) {
        let gone = self
            .subs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        if let Some(r) = gone {
            r.account.sublist.remove(&r.sub);
        }
    }

    /// Takes every subscription of the peer out of the sublists (the route closed).
    fn remove_all_subs(&self) {
        let all: Vec<RemoteSub> = self
            .subs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, r)| r)
            .collect();
        for r in all {
            r.account.sublist.remove(&r.sub);
        }
    }
}

/// How a connection ended, for the task that dialed it.
#[derive(Default)]
pub(crate) struct Outcome {
    /// The peer is this server itself (a route URL of our own).
    pub to_self: bool,
    /// Whether a dialed route should be dialed again.
    pub reconnect: bool,
    /// The registered route that made this one a duplicate.
    pub duplicate_of: Option<Arc<Route>>,
    pub remote_id: Option<String>,
}

/// Runs one route connection until it closes: with cluster TLS, the handshake first (as
/// the reference: nothing is sent in plain text), then the route protocol.
pub(crate) async fn run(
    server: Arc<Server>,
    cluster: Arc<Cluster>,
    stream: TcpStream,
    origin: Origin,
) -> Outcome {
    let _ = stream.set_nodelay(true);
    let addr = stream.peer_addr().ok();
    let rid = server.next_client_id();
    let Some(tls) = cluster.opts.tls.clone() else {
        let (rd, wr) = stream.into_split();
        return run_on(server, cluster, rd, wr, addr, rid, origin).await;
    };
    let shake = async {
        match &origin {
            Origin::Accepted => tokio_rustls::TlsAcceptor::from(tls.server.clone())
                .accept(stream)
                .await
                .map(tokio_rustls::TlsStream::from),
            Origin::Solicited { url, .. } => {
                let name = rustls_pki_types::ServerName::try_from(url.host.clone())
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                tokio_rustls::TlsConnector::from(tls.client.clone())
                    .connect(name, stream)
                    .await
                    .map(tokio_rustls::TlsStream::from)
            }
        }
    };
    let tag = match addr {
        Some(a) => format!("{a} - rid:{rid}"),
        None => format!("rid:{rid}"),
    };
    let failed = |why: String| {
        error!(server.log, "{tag} - TLS route handshake error: {why}");
        info!(
            server.log,
            "{tag} - Router connection closed: TLS Handshake Failure"
        );
        Outcome {
            reconnect: !matches!(origin, Origin::Accepted),
            ..Outcome::default()
        }
    };
    let stream = match tokio::time::timeout(tls.timeout(), shake).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return failed("EOF".into()),
        Ok(Err(e)) => return failed(e.to_string()),
        Err(_) => return failed("timeout".into()),
    };
    debug!(server.log, "{tag} - TLS handshake complete");
    let (rd, wr) = tokio::io::split(stream);
    run_on(server, cluster, rd, wr, addr, rid, origin).await
}

/// The route protocol on a connection (plain or TLS).
async fn run_on<R, W>(
    server: Arc<Server>,
    cluster: Arc<Cluster>,
    rd: R,
    wr: W,
    addr: Option<SocketAddr>,
    rid: u64,
    origin: Origin,
) -> Outcome
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let handle = ClientHandle::for_route(
        &server,
        rid,
        server.opts.max_pending,
        cluster.slow_consumers.clone(),
    );
    {
        let mut meta = handle.meta.lock().unwrap_or_else(|e| e.into_inner());
        meta.addr = addr;
        meta.start = Some(SystemTime::now());
    }
    let route = Arc::new(Route::new(rid, handle.clone(), addr, &origin));
    cluster.track(&route);
    let deadline = cluster
        .opts
        .write_deadline
        .unwrap_or(server.opts.write_deadline);
    let writer = tokio::spawn(client::write_loop(handle.clone(), wr, deadline));

    let accepted = matches!(origin, Origin::Accepted);
    let mut parser = RouteParser::new().with_max_payload(MAX_ROUTED);
    let mut hello = BytesMut::new();
    if accepted {
        parser.expect_connect();
        encode::info(&mut hello, &cluster.info(&server, true));
    } else {
        let Origin::Solicited { url, .. } = &origin else {
            unreachable!()
        };
        let connect = RouteConnect {
            echo: true,
            headers: true,
            name: server.server_id.clone(),
            cluster: cluster.name(),
            cluster_dynamic: cluster.is_dynamic(),
            tls_required: cluster.opts.tls.is_some(),
            user: url.user.clone().unwrap_or_default(),
            pass: url.pass.clone().unwrap_or_default(),
            ..RouteConnect::default()
        };
        encode::connect(&mut hello, &connect);
        debug!(server.log, "{} - Route connect msg sent", route.tag());
        encode::info(&mut hello, &cluster.info(&server, true));
    }
    route.send(&hello);
    info!(server.log, "{} - Route connection created", route.tag());

    let mut conn = Conn {
        ping_interval: super::ping_interval(&server, &cluster),
        ping_max: cluster.opts.ping_max.unwrap_or(server.opts.ping_max),
        server,
        cluster,
        route,
        parser,
        accepted,
        connect_seen: false,
        info_seen: false,
        lnocu: false,
        routers: HashMap::new(),
        pings_out: 0,
        ping_sent: None,
        outcome: Outcome::default(),
    };
    let why = conn.read_loop(rd).await;
    conn.finish(why);
    let _ = writer.await;
    let mut outcome = conn.outcome;
    outcome.reconnect = !outcome.to_self && !accepted;
    outcome
}

struct Conn {
    server: Arc<Server>,
    cluster: Arc<Cluster>,
    route: Arc<Route>,
    parser: RouteParser,
    accepted: bool,
    connect_seen: bool,
    info_seen: bool,
    /// The peer's LS- lines name the origin cluster (its INFO's `lnocu`).
    lnocu: bool,
    /// One router per account messages arrived in (each has its own match cache).
    routers: HashMap<Bytes, Router>,
    ping_interval: Duration,
    ping_max: u32,
    pings_out: u32,
    ping_sent: Option<Instant>,
    outcome: Outcome,
}

impl Conn {
    async fn read_loop<R: AsyncRead + Unpin>(&mut self, mut rd: R) -> RouteClose {
        let mut buf = BytesMut::new();
        let handle = self.route.handle.clone();
        let mut closed = handle.closed_rx();
        let mut shutdown = self.server.shutdown_rx();
        // Until registration: the handshake's deadline (CONNECT within the authorization
        // timeout when one is required; the whole handshake within the stale-connection
        // time, as the reference's watchdog).
        let stale = self.ping_interval * (self.ping_max + 1);
        let auth = self.accepted && self.cluster.opts.user.is_some();
        let connect_by = Instant::now() + self.cluster.opts.auth_timeout;
        let handshake_by = Instant::now() + stale;
        let mut next_ping: Option<Instant> = None;
        loop {
            let wake = match next_ping {
                Some(t) => t,
                None if auth && !self.connect_seen => connect_by,
                None => handshake_by,
            };
            tokio::select! {
                r = async {
                    let want = self.parser.wanted().saturating_sub(buf.len()).max(READ_SIZE);
                    buf.reserve(want);
                    rd.read_buf(&mut buf).await
                } => {
                    match r {
                        Ok(0) => return RouteClose::ClientClosed,
                        Ok(_) => {}
                        Err(_) => return RouteClose::ReadError,
                    }
                    handle
                        .stats
                        .last_activity
                        .store(crate::time::now_nanos(), Ordering::Relaxed);
                    let res = self.process(&mut buf);
                    for r in self.routers.values_mut() {
                        r.flush();
                    }
                    if let Err(why) = res {
                        return why;
                    }
                    if next_ping.is_none() && self.route.registered() {
                        let jitter = rand::random_range(0..200);
                        next_ping = Some(Instant::now() + FIRST_PING + Duration::from_millis(jitter));
                    }
                    if buf.is_empty() && buf.capacity() > 4 * READ_SIZE {
                        buf = BytesMut::new();
                    }
                }
                _ = tokio::time::sleep_until(wake.into()) => {
                    if next_ping.is_none() {
                        if auth && !self.connect_seen {
                            self.send_err("Authentication Timeout");
                            return RouteClose::AuthenticationTimeout;
                        }
                        return RouteClose::StaleConnection;
                    }
                    // Routes ping on the interval whatever the traffic (the reference's).
                    if self.pings_out + 1 > self.ping_max {
                        self.send_err("Stale Connection");
                        self.cluster.stale.fetch_add(1, Ordering::Relaxed);
                        debug!(self.server.log, "{} - Stale Route Connection - Closing", self.route.tag());
                        return RouteClose::StaleConnection;
                    }
                    self.pings_out += 1;
                    self.ping_sent = Some(Instant::now());
                    self.route.ping(None);
                    next_ping = Some(Instant::now() + self.ping_interval);
                }
                _ = until_true(&mut closed) => {
                    return self.route.why.get().copied()
                        .unwrap_or_else(|| RouteClose::of_handle(handle.close_reason()));
                }
                _ = until_true(&mut shutdown) => {
                    // What was queued for the peer (answers to the last requests it sent
                    // here) is flushed and the write side closed; reading on until the peer
                    // closes its side keeps the socket from being reset, which would make
                    // the peer drop the part it had not read yet.
                    self.route.handle.close(CloseReason::ServerShutdown);
                    let _ = tokio::time::timeout(LINGER, client::drain(&mut rd)).await;
                    return RouteClose::ServerShutdown;
                }
            }
        }
    }

    fn finish(&mut self, why: RouteClose) {
        let route = &self.route;
        let _ = route.why.set(why);
        route.handle.close(match why {
            RouteClose::ServerShutdown => CloseReason::ServerShutdown,
            RouteClose::ClientClosed => CloseReason::ClientClosed,
            RouteClose::ReadError => CloseReason::ReadError,
            _ => CloseReason::ProtocolError,
        });
        let name = route.remote_name();
        let remote = if name.is_empty() {
            String::new()
        } else {
            format!(" - Remote: {name}")
        };
        info!(
            self.server.log,
            "{} - Router connection closed: {}{remote}",
            route.tag(),
            why.text()
        );
        route.remove_all_subs();
        self.cluster.remove_route(&self.server, route);
        let id = route.remote_id();
        if !id.is_empty() {
            self.outcome.remote_id = Some(id);
        }
    }

    fn send_err(&self, text: &str) {
        let mut b = BytesMut::with_capacity(text.len() + 10);
        encode::err(&mut b, text);
        self.route.send(&b);
    }

    /// Handles every complete op in `buf`.
    fn process(&mut self, buf: &mut BytesMut) -> Result<(), RouteClose> {
        loop {
            let op = match self.parser.next(buf) {
                Ok(Some(op)) => op,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.parse_error(e, buf)),
            };
            if self.route.handle.traces_socket() {
                trace_in(&self.route.handle, &op);
            }
            match op {
                RouteOp::Msg(m) => self.process_msg(m),
                RouteOp::Sub(s) => {
                    // Leaf interest is keyed apart only with a peer whose LS- names the
                    // origin (`lnocu`); with others the reference keys both alike.
                    let origin = s.origin.as_deref().filter(|_| self.lnocu);
                    let queue = s.queue.as_ref().map(|(q, w)| (&q[..], *w));
                    let key = sub_key(origin, &s.account, &s.subject, queue.map(|(q, _)| q));
                    self.process_sub(key, &s.account, &s.subject, queue);
                }
                RouteOp::Unsub(u) => {
                    let origin = u.origin.as_deref().filter(|_| u.leaf && self.lnocu);
                    let key = sub_key(origin, &u.account, &u.subject, u.queue.as_deref());
                    self.route.remove_remote_sub(&key);
                }
                RouteOp::Ping => self.route.send(encode::PONG),
                // A round trip's PONG says nothing of the keepalive's.
                RouteOp::Pong if !self.route.ponged() => {}
                RouteOp::Pong => {
                    self.pings_out = 0;
                    if let Some(sent) = self.ping_sent.take() {
                        // Whole microseconds, as the reference reports a route's RTT.
                        let us = (sent.elapsed().as_nanos() as u64).div_ceil(1000);
                        self.route
                            .handle
                            .stats
                            .rtt_nanos
                            .store(us * 1000, Ordering::Relaxed);
                    }
                }
                RouteOp::Ok => {}
                RouteOp::Err(text) => {
                    error!(
                        self.server.log,
                        "{} - Route Error {}",
                        self.route.tag(),
                        String::from_utf8_lossy(&text)
                    );
                    return Err(RouteClose::ParseError);
                }
                RouteOp::Connect(json) => {
                    if self.accepted {
                        self.process_connect(&json)?;
                    }
                }
                RouteOp::Info(json) => self.process_info(&json)?,
            }
        }
    }

    fn parse_error(&mut self, e: RouteParseError, buf: &BytesMut) -> RouteClose {
        if let Some(text) = e.err_text() {
            self.send_err(text);
        }
        let snip = String::from_utf8_lossy(&buf[..buf.len().min(32)]).into_owned();
        match e {
            RouteParseError::AuthViolation => {
                error!(
                    self.server.log,
                    "{} - Router connection rejected: first op was not CONNECT",
                    self.route.tag()
                );
                RouteClose::AuthenticationFailure
            }
            RouteParseError::BadArgs(why) => {
                error!(self.server.log, "{} - {why}", self.route.tag());
                RouteClose::ProtocolViolation
            }
            _ => {
                error!(
                    self.server.log,
                    "{} - Router parser ERROR: {e}: proto={snip:?}...",
                    self.route.tag()
                );
                RouteClose::ParseError
            }
        }
    }

    fn process_msg(&mut self, m: RouteMsg) {
        let stats = &self.route.handle.stats;
        stats.in_msgs.fetch_add(1, Ordering::Relaxed);
        stats
            .in_bytes
            .fetch_add(m.data.len() as u64, Ordering::Relaxed);
        if !self.routers.contains_key(&m.account) {
            let Some(account) = self
                .server
                .accounts
                .get(&String::from_utf8_lossy(&m.account))
            else {
                debug!(
                    self.server.log,
                    "{} - Unknown account {:?} for routed message on subject: {:?}",
                    self.route.tag(),
                    String::from_utf8_lossy(&m.account),
                    String::from_utf8_lossy(&m.subject)
                );
                return;
            };
            let router = Router::new(account, self.route.rid).with_origin(self.route.rid);
            self.routers
                .insert(Bytes::copy_from_slice(&m.account), router);
        }
        let router = self.routers.get_mut(&m.account).expect("inserted above");
        // An LMSG always has a header length, 0 when there are no headers.
        let hdr_len = match (&m.origin, m.hdr_len) {
            (Some(_), Some(0)) => None,
            (_, h) => h,
        };
        let msg = Outgoing {
            subject: &m.subject,
            reply: m.reply.as_ref(),
            hdr_len,
            data: &m.data,
        };
        router.route_from_peer(&self.server, &msg, &m.queues);
    }

    fn process_sub(
        &mut self,
        key: Bytes,
        account: &[u8],
        subj: &[u8],
        queue: Option<(&[u8], u32)>,
    ) {
        if !subject::valid_subscribe(subj)
            || queue.is_some_and(|(q, _)| !subject::valid_subscribe(q))
        {
            error!(
                self.server.log,
                "{} - Invalid remote subscription {:?}",
                self.route.tag(),
                String::from_utf8_lossy(subj)
            );
            return;
        }
        let name = String::from_utf8_lossy(account);
        let Some(acc) = self.server.accounts.get(&name) else {
            error!(
                self.server.log,
                "{} - Unknown account {name:?} for remote subject {:?}",
                self.route.tag(),
                String::from_utf8_lossy(subj)
            );
            return;
        };
        self.route.add_remote_sub(key, &acc, subj, queue);
    }

    /// CONNECT from a peer that dialed us: credentials, then the checks of the reference.
    fn process_connect(&mut self, json: &[u8]) -> Result<(), RouteClose> {
        let Ok(c) = serde_json::from_slice::<RouteConnect>(json) else {
            return Err(RouteClose::ParseError);
        };
        let opts = &self.cluster.opts;
        if let Some(user) = &opts.user {
            let pass = opts.password.as_deref().unwrap_or_default();
            if !same(c.user.as_bytes(), user.as_bytes())
                || !same(c.pass.as_bytes(), pass.as_bytes())
            {
                error!(
                    self.server.log,
                    "{} - authentication error - User {:?}",
                    self.route.tag(),
                    c.user
                );
                self.send_err("Authorization Violation");
                return Err(RouteClose::AuthenticationFailure);
            }
        }
        if !c.lang.is_empty() {
            self.send_err("attempted to connect to route port");
            return Err(RouteClose::ProtocolViolation);
        }
        if !c.gateway.is_empty() {
            let text = format!(
                "Rejecting connection from gateway {:?} on the Route port",
                c.gateway
            );
            error!(self.server.log, "{} - {text}", self.route.tag());
            self.send_err(&text);
            return Err(RouteClose::ProtocolViolation);
        }
        let ours = self.cluster.name();
        if c.cluster != ours {
            if self.cluster.should_adopt(&c.cluster, c.cluster_dynamic) {
                self.cluster
                    .adopt_name(&self.server, &c.cluster, c.cluster_dynamic, &c.name);
            } else {
                let text = format!(
                    "Rejecting connection, cluster name {:?} does not match {:?}",
                    c.cluster, ours
                );
                error!(self.server.log, "{} - {text}", self.route.tag());
                self.send_err(&text);
                return Err(RouteClose::ClusterNameConflict);
            }
        }
        self.route.meta().remote_id = c.name;
        self.route.handle.set_headers(c.headers);
        self.connect_seen = true;
        Ok(())
    }

    fn process_info(&mut self, json: &[u8]) -> Result<(), RouteClose> {
        let info: RouteInfo = match serde_json::from_slice(json) {
            Ok(i) => i,
            Err(e) => {
                error!(
                    self.server.log,
                    "{} - Error parsing route INFO: {e}",
                    self.route.tag()
                );
                return Err(RouteClose::ParseError);
            }
        };
        if self.info_seen {
            let remote = self.route.remote_id();
            if !remote.is_empty() && info.server_id != remote {
                // Gossip: another server the peer registered; dial it.
                self.cluster.implicit_route(&self.server, &info);
            } else if info.ldm {
                self.route.meta().lame_duck = true;
                self.cluster.peer_lame_duck(&self.server, &self.route);
            } else if !remote.is_empty() {
                // The peer's own INFO again: its JetStream may have been disabled since.
                let mut m = self.route.meta();
                m.remote_jetstream = m.remote_jetstream && info.jetstream;
            }
            return Ok(());
        }
        self.info_seen = true;
        if info.server_id == self.server.server_id {
            self.route.meta().remote_id = info.server_id;
            self.outcome.to_self = true;
            return Err(RouteClose::DuplicateRoute);
        }
        let ours = self.cluster.name();
        if !info.cluster.is_empty() && info.cluster != ours {
            if self
                .cluster
                .should_adopt(&info.cluster, info.cluster_dynamic)
            {
                self.cluster.adopt_name(
                    &self.server,
                    &info.cluster,
                    info.cluster_dynamic,
                    &info.server_id,
                );
            } else {
                return Err(RouteClose::ClusterNameConflict);
            }
        }
        if self.accepted && info.server_name == self.server.server_name {
            error!(
                self.server.log,
                "{} - Remote server has a duplicate name: {:?}",
                self.route.tag(),
                info.server_name
            );
            return Err(RouteClose::DuplicateServerName);
        }
        if !info.route_account.is_empty() {
            // A connection dedicated to one account needs pooling, which Keel does not do.
            self.send_err(&format!(
                "Not possible to have a dedicated route for account {:?} between those servers",
                info.route_account
            ));
            return Err(RouteClose::ProtocolViolation);
        }
        match info.compression.as_str() {
            // What a peer may say that leaves the route uncompressed: it does not know
            // compression, is off, or follows us (and we are off).
            "" | "not supported" | "off" | "accept" => {}
            // An acceptor's INFO names its configured mode; our INFO said off, so it
            // follows. A dialing peer's INFO is the negotiated mode, which must be off.
            "s2_auto" | "s2_uncompressed" | "s2_fast" | "s2_better" | "s2_best"
                if !self.accepted => {}
            other => {
                self.send_err(&format!("unsupported route compression mode {other:?}"));
                return Err(RouteClose::ProtocolViolation);
            }
        }
        {
            let mut m = self.route.meta();
            m.remote_id = info.server_id.clone();
            m.remote_name = info.server_name.clone();
            m.remote_tags = info.tags.iter().map(|t| t.to_ascii_lowercase()).collect();
            m.remote_js_limits = info.js_limits;
            // Only Keel peers take part in Keel's meta group (nats-server speaks its own
            // Raft): a Keel server names its Rust toolchain in `go`.
            m.remote_jetstream = info.jetstream && info.go.starts_with("rustc ");
            m.connect_urls = info.connect_urls.clone();
        }
        self.route.handle.set_headers(info.headers);
        self.lnocu = info.lnocu;
        self.parser.set_unsub_origin(info.lnocu);
        match self.cluster.add_route(&self.server, &self.route, &info) {
            Ok(()) => {
                debug!(
                    self.server.log,
                    "{} - Registering remote route {:?}",
                    self.route.tag(),
                    info.server_id
                );
                Ok(())
            }
            Err(existing) => {
                debug!(
                    self.server.log,
                    "{} - Detected duplicate remote route {:?}",
                    self.route.tag(),
                    info.server_id
                );
                self.outcome.duplicate_of = Some(existing);
                Err(RouteClose::DuplicateRoute)
            }
        }
    }
}

/// The key of a peer's subscription: `[L <origin> ]<acc> <subject>[ <queue>]` (the
/// reference keys leaf interest apart, so `LS+` and `RS+` of the same subject never meet).
fn sub_key(origin: Option<&[u8]>, account: &[u8], subject: &[u8], queue: Option<&[u8]>) -> Bytes {
    let mut k = BytesMut::with_capacity(account.len() + subject.len() + 32);
    if let Some(o) = origin {
        k.extend_from_slice(b"L ");
        k.extend_from_slice(o);
        k.extend_from_slice(b" ");
    }
    k.extend_from_slice(account);
    k.extend_from_slice(b" ");
    k.extend_from_slice(subject);
    if let Some(q) = queue {
        k.extend_from_slice(b" ");
        k.extend_from_slice(q);
    }
    k.freeze()
}

/// Compares credentials in time independent of where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Traces an op from a route peer as the reference does: `<<- [RS+ $G foo]`, `<<- [RMSG $G
/// foo 5]` then `<<- MSG_PAYLOAD: ["hello"]`, `<<- [PING]`; a CONNECT with its password shown
/// as `[REDACTED]`; INFO is not traced (nor by the reference). The line is the op written
/// back in its wire form.
fn trace_in(h: &ClientHandle, op: &RouteOp) {
    match op {
        RouteOp::Info(_) => return,
        RouteOp::Connect(json) => {
            let shown = crate::client::redact_connect(json);
            h.trace("<<-", format_args!("[CONNECT {shown}]"));
            return;
        }
        _ => {}
    }
    let mut b = BytesMut::new();
    encode::op(&mut b, op, false);
    let eol = b.iter().position(|c| *c == b'\r').unwrap_or(b.len());
    h.trace(
        "<<-",
        format_args!("[{}]", String::from_utf8_lossy(&b[..eol])),
    );
    if let RouteOp::Msg(m) = op {
        h.trace_payload("<<-", &m.data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Opts;
    use crate::log::Log;

    /// A round trip ends at the PONG that answers its own PING, not at those of the PINGs
    /// sent before it (the peer answers each, in order).
    #[tokio::test]
    async fn a_round_trip_ends_at_its_own_pong() {
        let server = Server::new(Opts::default(), Log::capture(Default::default()));
        let peer = ClientHandle::for_route(&server, 100, 1 << 20, Arc::new(AtomicU64::new(0)));
        let route = Route::new(100, peer.clone(), None, &Origin::Accepted);
        route.ping(None);
        let mut trip = std::pin::pin!(route.round_trip());
        assert!(futures::poll!(trip.as_mut()).is_pending());
        assert_eq!(peer.take_outbound(), "PING\r\nPING\r\n");
        assert!(route.ponged(), "the keepalive's PONG");
        assert!(futures::poll!(trip.as_mut()).is_pending());
        assert!(!route.ponged());
        assert_eq!(futures::poll!(trip.as_mut()), std::task::Poll::Ready(true));
        assert!(route.ponged(), "one nobody asked for changes nothing");
    }
}
