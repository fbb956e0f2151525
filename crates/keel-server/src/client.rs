//! One client connection: a reader task that parses ops and routes messages, and a writer
//! task that flushes the connection's outbound buffer.
//!
//! Fan-out happens on the publisher's reader task: it encodes each MSG straight into every
//! subscriber's outbound buffer (one copy, no allocation per message) and wakes each
//! subscriber's writer once per read, not once per message, so a burst becomes one write.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use keel_protocol::{encode, subject, ClientOp, ParseError, Parser};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify};

use crate::account::Account;
use crate::inqueue::{InQueue, Receiver};
use crate::log::Log;
use crate::permissions::{self, Permissions, PublishCache};
use crate::router::{Outgoing, Router};
use crate::server::Server;
use crate::sublist::Sub;

/// The part of a connection other tasks touch: its outbound buffer and subscriptions.
pub struct ClientHandle {
    pub id: u64,
    /// Where its subscriptions live and its publishes are routed: bound once, at CONNECT
    /// (to the authenticated user's account; `$G` without accounts). Until then
    /// `default_account` (in-process clients are bound when made).
    account: std::sync::OnceLock<Arc<Account>>,
    default_account: Arc<Account>,
    /// What it may publish, subscribe to and receive; None: everything (see `permissions`).
    /// Replaced on reload, so behind a lock; `perm_flags` says whether a delivery needs to
    /// look at all, so a connection without rules costs one load per delivery.
    perms: std::sync::RwLock<Option<Arc<dyn Permissions>>>,
    perm_flags: std::sync::atomic::AtomicU8,
    /// Bumped when `perms` changes: the reader refreshes its copy and publish cache.
    perms_gen: AtomicU64,
    /// The nonce its INFO carried (nkey and JWT users sign it).
    nonce: std::sync::OnceLock<String>,
    /// The credentials it authenticated with, checked again on reload. Never logged.
    pub(crate) creds: Mutex<Option<crate::auth::Creds>>,
    out: Mutex<Outbound>,
    wake_writer: Notify,
    /// Stops a write in progress: a slow consumer's socket is not draining.
    abort_writer: Notify,
    /// Over three quarters of max_pending is queued: publishers pause briefly (as the
    /// reference stalls producers) so a subscriber that is only behind can catch up
    /// instead of being cut off. Cleared, and `drained` notified, after each write.
    pub congested: AtomicBool,
    pub drained: Notify,
    closed: watch::Sender<bool>,
    /// Whether the client takes HMSG (from its CONNECT); otherwise headers are stripped.
    headers: AtomicBool,
    max_pending: usize,
    pub subs: Mutex<HashMap<Bytes, Arc<Sub>>>,
    pub stats: ClientStats,
    pub meta: Mutex<ClientMeta>,
    /// Set for in-process subscribers (JetStream): messages go to this byte-bounded queue
    /// instead of a socket (see `inqueue` for who waits when it is full).
    internal: Option<Arc<InQueue>>,
    /// Why the connection closed: the first reason given wins (monitoring's closed list).
    close_reason: std::sync::OnceLock<CloseReason>,
    log: Log,
    /// Set for a route connection's handle (`route::conn`): its subscriptions in account
    /// sublists are the peer's interest, and messages for it are written as RMSG.
    route: Option<RouteSide>,
    /// The client may be sent INFO updates (it sent `protocol` >= 1 and got the INFO that
    /// follows its first PONG), as the reference's async INFO with new `connect_urls`.
    pub async_info: AtomicBool,
}

/// What a route connection's handle holds besides a client's.
pub struct RouteSide {
    /// The cluster's count of routes cut as slow consumers (`/varz` slow_consumer_stats).
    pub slow_consumers: Arc<AtomicU64>,
}

/// A message delivered to an in-process subscriber.
#[derive(Debug, Clone)]
pub struct InMsg {
    pub sid: Bytes,
    pub subject: Bytes,
    pub reply: Option<Bytes>,
    /// Length of the header block at the start of `data` (0 when none).
    pub hdr_len: usize,
    pub data: Bytes,
    /// The connection that published it (0: the server itself), e.g. for API audits. The
    /// account it was published in is the receiving queue's (`Receiver::account`); the
    /// publishing connection's handle (`Server::client(origin)`) names its own.
    pub origin: u64,
}

impl InMsg {
    pub fn headers(&self) -> &[u8] {
        &self.data[..self.hdr_len]
    }
    pub fn payload(&self) -> &[u8] {
        &self.data[self.hdr_len..]
    }
}

#[derive(Default)]
pub struct ClientStats {
    pub in_msgs: AtomicU64,
    pub in_bytes: AtomicU64,
    pub out_msgs: AtomicU64,
    pub out_bytes: AtomicU64,
    /// Unix nanoseconds of the last bytes read from the client (monitoring).
    pub last_activity: std::sync::atomic::AtomicI64,
    /// Round trip of the last server PING, in nanoseconds (0 until measured).
    pub rtt_nanos: AtomicU64,
}

/// Descriptive fields for monitoring.
#[derive(Default, Clone)]
pub struct ClientMeta {
    pub addr: Option<std::net::SocketAddr>,
    pub name: String,
    pub lang: String,
    pub version: String,
    pub start: Option<std::time::SystemTime>,
    /// The TLS session, once its handshake is done (`/connz` `tls_*`, `verify_and_map`).
    pub tls: Option<Arc<crate::tls::PeerTls>>,
    /// The authenticated user (a name or a public nkey; empty without auth).
    pub user: String,
    /// Whether it sent a CONNECT that was accepted (events are only sent for those).
    pub connected: bool,
}

/// `perm_flags` bits.
const CHECKS_DELIVERY: u8 = 1;
const TRACKS_REPLIES: u8 = 2;

#[derive(Default)]
struct Outbound {
    buf: BytesMut,
    /// Someone queued data and owes the writer a wake-up.
    flush_scheduled: bool,
    /// Flush what is queued, then close.
    closing: bool,
}

/// Why a connection closed, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    ClientClosed,
    ProtocolError,
    SlowConsumerPendingBytes,
    SlowConsumerWriteDeadline,
    StaleConnection,
    ServerShutdown,
    MaxConnections,
    WriteError,
    ReadError,
    TlsHandshakeError,
    AuthenticationFailure,
    AuthenticationTimeout,
    AuthenticationExpired,
    MaxAccountConnections,
    MaxPayload,
}

impl ClientHandle {
    fn new(id: u64, max_pending: usize, account: Arc<Account>, log: Log) -> Arc<Self> {
        let (closed, _) = watch::channel(false);
        Arc::new(ClientHandle {
            id,
            account: std::sync::OnceLock::new(),
            default_account: account,
            perms: std::sync::RwLock::new(None),
            perm_flags: std::sync::atomic::AtomicU8::new(0),
            perms_gen: AtomicU64::new(0),
            nonce: std::sync::OnceLock::new(),
            creds: Mutex::new(None),
            out: Mutex::new(Outbound::default()),
            wake_writer: Notify::new(),
            abort_writer: Notify::new(),
            congested: AtomicBool::new(false),
            drained: Notify::new(),
            closed,
            headers: AtomicBool::new(false),
            max_pending,
            subs: Mutex::new(HashMap::new()),
            stats: ClientStats::default(),
            meta: Mutex::new(ClientMeta::default()),
            close_reason: std::sync::OnceLock::new(),
            internal: None,
            log,
            route: None,
            async_info: AtomicBool::new(false),
        })
    }

    /// The handle of a route connection of `server` (its account is unused: every op on a
    /// route names its own).
    pub fn for_route(
        server: &Server,
        id: u64,
        max_pending: usize,
        slow_consumers: Arc<AtomicU64>,
    ) -> Arc<Self> {
        let h = Self::new(
            id,
            max_pending,
            server.accounts.global().clone(),
            server.log.clone(),
        );
        let mut h = Arc::into_inner(h).expect("fresh handle");
        h.route = Some(RouteSide { slow_consumers });
        Arc::new(h)
    }

    /// Whether this is a route connection's handle.
    #[inline]
    pub fn is_route(&self) -> bool {
        self.route.is_some()
    }

    /// Whether messages keep their headers (the client's, or the route peer's, CONNECT).
    pub fn set_headers(&self, on: bool) {
        self.headers.store(on, Ordering::Relaxed);
    }

    /// Counts this connection as cut for being slow: in its account, or for a route in the
    /// cluster's route count.
    fn count_slow(&self) {
        match &self.route {
            Some(r) => r.slow_consumers.fetch_add(1, Ordering::Relaxed),
            None => self
                .account()
                .stats
                .slow_consumers
                .fetch_add(1, Ordering::Relaxed),
        };
    }

    /// How log lines name this connection: its id, or `rid:<id>` for a route.
    fn tag(&self) -> String {
        if self.is_route() {
            format!("rid:{}", self.id)
        } else {
            self.id.to_string()
        }
    }

    /// An in-process subscriber of `server`, in `account` (the account it serves), whose
    /// messages arrive on the returned queue, which holds at most about `limit` bytes
    /// (`name` says whose it is in log lines).
    pub fn internal(
        server: &Server,
        account: &Arc<Account>,
        name: String,
        limit: usize,
    ) -> (Arc<Self>, Receiver) {
        let q = InQueue::new(name, limit, account.clone(), server.log.clone());
        server.register_internal(&q);
        let h = Self::new(
            server.next_client_id(),
            limit,
            account.clone(),
            server.log.clone(),
        );
        let mut h = Arc::into_inner(h).expect("fresh handle");
        let _ = h.account.set(account.clone());
        h.internal = Some(q.clone());
        h.headers.store(true, Ordering::Relaxed);
        (Arc::new(h), Receiver::new(q))
    }

    /// The account the client is in.
    #[inline]
    pub fn account(&self) -> &Arc<Account> {
        self.account.get().unwrap_or(&self.default_account)
    }

    /// Binds the client to `account` (once: false if it already was).
    pub fn bind_account(&self, account: Arc<Account>) -> bool {
        self.account.set(account).is_ok()
    }

    /// Its permissions; None: it may do anything.
    pub fn permissions(&self) -> Option<Arc<dyn Permissions>> {
        self.perms.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces its permissions (at CONNECT, and when a reload changes them).
    pub fn set_permissions(&self, perms: Option<Arc<dyn Permissions>>) {
        let flags = perms.as_ref().map_or(0, |p| {
            let subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
            let deliveries =
                p.checks_delivery() && subs.values().any(|s| p.delivery_check_needed(&s.subject));
            (if deliveries { CHECKS_DELIVERY } else { 0 })
                | (if p.tracks_replies() {
                    TRACKS_REPLIES
                } else {
                    0
                })
        });
        *self.perms.write().unwrap_or_else(|e| e.into_inner()) = perms;
        self.perm_flags.store(flags, Ordering::Release);
        self.perms_gen.fetch_add(1, Ordering::Release);
    }

    /// Its permissions as configured (None: no rules, or rules without a configuration).
    pub fn permissions_opts(&self) -> Option<crate::auth::conf::PermOpts> {
        self.permissions().and_then(|p| p.opts().cloned())
    }

    /// A subscription to `subject` is being added: deliveries are checked from now on if it
    /// could receive what the deny rules forbid (as the reference, only a wildcard
    /// subscription overlapping a deny rule turns the check on).
    fn note_subscription(&self, subject: &[u8]) {
        if self.perm_flags() & CHECKS_DELIVERY != 0 {
            return;
        }
        if let Some(p) = self.permissions() {
            if p.checks_delivery() && p.delivery_check_needed(subject) {
                self.perm_flags.fetch_or(CHECKS_DELIVERY, Ordering::AcqRel);
            }
        }
    }

    /// Whether deliveries to it must ask its permissions (deny rules, tracked replies).
    #[inline]
    pub fn perm_flags(&self) -> u8 {
        self.perm_flags.load(Ordering::Acquire)
    }

    /// The nonce its INFO carried, if any.
    pub fn nonce(&self) -> Option<&str> {
        self.nonce.get().map(String::as_str)
    }

    /// The log of the server it belongs to.
    pub fn log(&self) -> &Log {
        &self.log
    }

    /// The queue of an in-process subscriber.
    pub fn internal_queue(&self) -> Option<&Arc<InQueue>> {
        self.internal.as_ref()
    }

    /// A handle with no socket behind it, in an account of its own, for unit tests of
    /// routing structures.
    pub fn detached(id: u64) -> Arc<Self> {
        Self::new(
            id,
            64 * 1024 * 1024,
            Account::new(crate::account::GLOBAL),
            Log::stderr(),
        )
    }

    fn lock_out(&self) -> MutexGuard<'_, Outbound> {
        self.out.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn closed_rx(&self) -> watch::Receiver<bool> {
        self.closed.subscribe()
    }

    /// The first reason [`close`](Self::close) was called with.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.close_reason.get().copied()
    }

    pub fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    pub fn pending_bytes(&self) -> usize {
        self.lock_out().buf.len()
    }

    /// Takes what is queued for the socket (unit tests of what a connection is sent).
    #[cfg(test)]
    pub(crate) fn take_outbound(&self) -> String {
        let mut o = self.lock_out();
        let text = String::from_utf8_lossy(&o.buf).into_owned();
        o.buf.clear();
        o.flush_scheduled = false;
        text
    }

    /// Queues one message for a socket (in-process subscribers are fed by the router
    /// through [`internal_queue`](Self::internal_queue)). Returns true when the caller must
    /// [`signal`](Self::signal) this handle after its current batch (it is the first to
    /// queue since the last flush).
    pub fn queue_msg(
        &self,
        subject: &Bytes,
        sid: &Bytes,
        reply: Option<&Bytes>,
        hdr_len: Option<usize>,
        data: &Bytes,
    ) -> bool {
        let reply = reply.map(|r| &r[..]);
        if self.tracing() {
            self.trace_msg_out(subject, sid, reply, hdr_len, data);
        }
        let mut o = self.lock_out();
        if o.closing {
            return false;
        }
        match hdr_len {
            Some(h) if self.headers.load(Ordering::Relaxed) => {
                encode::hmsg(&mut o.buf, subject, sid, reply, h, data)
            }
            Some(h) => encode::msg(&mut o.buf, subject, sid, reply, &data[h.min(data.len())..]),
            None => encode::msg(&mut o.buf, subject, sid, reply, data),
        }
        self.queued(o, data.len())
    }

    /// Queues one message for a route peer: `RMSG`, or `HMSG` with headers (the payload
    /// alone to a peer that takes no headers), with the queue groups it was picked for.
    /// Returns true when the caller must [`signal`](Self::signal) this handle.
    #[allow(clippy::too_many_arguments)]
    pub fn queue_routed(
        &self,
        account: Option<&[u8]>,
        subject: &[u8],
        reply: Option<&Bytes>,
        queues: &[Bytes],
        hdr_len: Option<usize>,
        data: &Bytes,
    ) -> bool {
        use keel_protocol::route::encode as renc;
        let reply = reply.map(|r| &r[..]);
        let mut o = self.lock_out();
        if o.closing {
            return false;
        }
        let start = o.buf.len();
        match hdr_len {
            Some(h) if self.headers.load(Ordering::Relaxed) => {
                renc::hmsg(&mut o.buf, account, subject, reply, queues, h, data)
            }
            Some(h) => renc::rmsg(
                &mut o.buf,
                account,
                subject,
                reply,
                queues,
                &data[h.min(data.len())..],
            ),
            None => renc::rmsg(&mut o.buf, account, subject, reply, queues, data),
        }
        // Traced as written (after the lock: the trace takes the handle's meta lock).
        let traced = self.traces_socket().then(|| {
            let written = &o.buf[start..];
            let eol = written.iter().position(|b| *b == b'\r').unwrap_or(0);
            let line = String::from_utf8_lossy(&written[..eol]).into_owned();
            let body = written[eol + 2..written.len() - 2].to_vec();
            (line, body)
        });
        let signal = self.queued(o, data.len());
        if let Some((line, body)) = traced {
            self.trace("->>", format_args!("[{line}]"));
            self.trace_payload("->>", &body);
        }
        signal
    }

    /// Queues protocol bytes (a route's interest lines) under the max_pending limit, which
    /// cuts the connection when it does not drain. Returns true when the caller must
    /// [`signal`](Self::signal) this handle.
    pub(crate) fn queue_bounded(&self, bytes: &[u8]) -> bool {
        let mut o = self.lock_out();
        if o.closing {
            return false;
        }
        o.buf.extend_from_slice(bytes);
        self.enforce_pending(o)
    }

    /// After a message went into the outbound buffer: counts it and enforces max_pending.
    fn queued(&self, o: MutexGuard<'_, Outbound>, len: usize) -> bool {
        self.stats.out_msgs.fetch_add(1, Ordering::Relaxed);
        self.stats
            .out_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        self.enforce_pending(o)
    }

    fn enforce_pending(&self, mut o: MutexGuard<'_, Outbound>) -> bool {
        if o.buf.len() > self.max_pending {
            // The reference closes a client whose pending bytes pass the limit, without
            // flushing and without -ERR: the socket is not draining anyway. A route is cut
            // the same way (and its peer reconnects).
            o.buf = BytesMut::new();
            o.closing = true;
            drop(o);
            crate::info!(
                self.log,
                "{} - Slow Consumer Detected: MaxPending of {} Exceeded",
                self.tag(),
                self.max_pending
            );
            self.count_slow();
            self.abort_writer.notify_one();
            self.close(CloseReason::SlowConsumerPendingBytes);
            return false;
        }
        if o.buf.len() > self.max_pending / 4 * 3 {
            self.congested.store(true, Ordering::Relaxed);
        }
        schedule(&mut o)
    }

    /// Whether the protocol is traced (`-V`, `trace: true`).
    pub(crate) fn tracing(&self) -> bool {
        self.log.enabled(crate::log::Level::Trace)
    }

    /// One trace line in the reference's form: `<addr> - cid:<id> - "v<version>:<lang>
    /// [:<name>]" - "<account>/<user>" - <dir> <what>` (`<<-` from the client, `->>` to
    /// it; the client's part once its CONNECT said it, the user's once authenticated).
    pub(crate) fn trace(&self, dir: &str, what: std::fmt::Arguments) {
        let mut who = {
            let m = self.meta.lock().unwrap_or_else(|e| e.into_inner());
            // An IPv4 peer of a dual-stack listener shows as IPv4, as the reference's.
            let addr = m.addr.map_or_else(
                || "pipe".to_string(),
                |a| std::net::SocketAddr::new(a.ip().to_canonical(), a.port()).to_string(),
            );
            if self.is_route() {
                // A route's lines name only its address and rid, as the reference's.
                return self.trace_line(format!("{addr} - rid:{} - ", self.id), dir, what);
            }
            let mut who = format!("{addr} - cid:{}", self.id);
            let client = match (m.lang.is_empty() && m.version.is_empty(), m.name.is_empty()) {
                (true, true) => String::new(),
                (true, false) => m.name.clone(),
                (false, true) => format!("v{}:{}", m.version, m.lang),
                (false, false) => format!("v{}:{}:{}", m.version, m.lang, m.name),
            };
            if !client.is_empty() {
                who.push_str(&format!(" - {client:?}"));
            }
            if !m.user.is_empty() {
                let kind = if crate::auth::is_user_nkey(&m.user) {
                    "nkey"
                } else {
                    "user"
                };
                who.push_str(&format!(" - \"{}/{kind}:{}\"", self.account().name, m.user));
            }
            who
        };
        who.push_str(" - ");
        self.trace_line(who, dir, what);
    }

    fn trace_line(&self, who: String, dir: &str, what: std::fmt::Arguments) {
        crate::trace!(self.log, "{who}{dir} {what}");
    }

    /// Whether this handle's protocol is traced: a socket's (a client's or a route's), not
    /// an in-process subscriber's (the reference traces those only with `-VV`).
    pub(crate) fn traces_socket(&self) -> bool {
        self.internal.is_none() && self.tracing()
    }

    /// `<-> [DELSUB sid]`: a client's subscription went (UNSUB, its auto-unsubscribe
    /// limit, or the connection's close).
    pub(crate) fn trace_delsub(&self, sid: &[u8]) {
        if self.traces_socket() && !self.is_route() {
            self.trace(
                "<->",
                format_args!("[DELSUB {}]", String::from_utf8_lossy(sid)),
            );
        }
    }

    /// Traces protocol lines queued for a route peer (`->> [RS+ $G foo]`), but its INFO
    /// and CONNECT, which the reference does not trace either.
    pub(crate) fn trace_route_lines(&self, bytes: &[u8]) {
        for line in bytes.split(|b| *b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() || line.starts_with(b"INFO ") || line.starts_with(b"CONNECT ") {
                continue;
            }
            self.trace("->>", format_args!("[{}]", String::from_utf8_lossy(line)));
        }
    }

    /// `->> [MSG subject sid [reply] size]` (HMSG with its header size).
    fn trace_msg_out(
        &self,
        subject: &[u8],
        sid: &[u8],
        reply: Option<&[u8]>,
        hdr_len: Option<usize>,
        data: &[u8],
    ) {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let reply = reply.map_or_else(String::new, |r| format!(" {}", text(r)));
        let (subject, sid) = (text(subject), text(sid));
        // As written on the wire: HMSG to a client that takes headers, else MSG without them.
        let hmsg = hdr_len.filter(|_| self.headers.load(Ordering::Relaxed));
        let shown = match (hdr_len, hmsg) {
            (Some(h), None) => &data[h.min(data.len())..],
            _ => data,
        };
        match hmsg {
            Some(h) => self.trace(
                "->>",
                format_args!("[HMSG {subject} {sid}{reply} {h} {}]", shown.len()),
            ),
            None => self.trace(
                "->>",
                format_args!("[MSG {subject} {sid}{reply} {}]", shown.len()),
            ),
        }
        self.trace_payload("->>", shown);
    }

    /// `MSG_PAYLOAD: ["..."]`, Go-quoted; past `max_traced_msg_len` bytes, its first that
    /// many and `...` inside the quotes (as the reference: the cut counts bytes, and a
    /// character it splits shows as `\x` escapes).
    pub(crate) fn trace_payload(&self, dir: &str, data: &[u8]) {
        let max = self.log.max_traced();
        if max > 0 && data.len() > max {
            let q = crate::log::go_quote(&data[..max]);
            let inner = &q[..q.len() - 1];
            self.trace(dir, format_args!("MSG_PAYLOAD: [{inner}...\"]"));
        } else {
            self.trace(
                dir,
                format_args!("MSG_PAYLOAD: [{}]", crate::log::go_quote(data)),
            );
        }
    }

    /// Queues raw protocol bytes (PONG, +OK, INFO, -ERR; RS+ and RS- on a route).
    pub(crate) fn queue_raw(&self, bytes: &[u8]) -> bool {
        let mut o = self.lock_out();
        if o.closing {
            return false;
        }
        o.buf.extend_from_slice(bytes);
        schedule(&mut o)
    }

    /// Sends an INFO line pushed by the server (lame duck).
    pub fn send_info(&self, line: &[u8]) {
        if self.internal.is_none() && self.queue_raw(line) {
            self.signal();
        }
    }

    /// Wakes the writer.
    pub fn signal(&self) {
        self.wake_writer.notify_one();
    }

    /// Flushes what is queued, then closes the connection.
    pub fn close(&self, reason: CloseReason) {
        let _ = self.close_reason.set(reason);
        self.lock_out().closing = true;
        if let Some(q) = &self.internal {
            // Nothing more is taken, and publishers waiting for room are released.
            q.close();
        }
        self.closed.send_if_modified(|c| {
            if *c {
                false
            } else {
                // A route logs its own close, in the reference's words.
                if !self.is_route() {
                    crate::debug!(
                        self.log,
                        "{} - Client connection closed: {:?}",
                        self.id,
                        reason
                    );
                }
                *c = true;
                true
            }
        });
        self.signal();
    }
}

fn schedule(o: &mut Outbound) -> bool {
    if o.flush_scheduled {
        false
    } else {
        o.flush_scheduled = true;
        true
    }
}

/// CONNECT fields we act on; unknown fields are ignored as by the reference.
#[derive(Deserialize, Default)]
#[serde(default)]
struct ConnectOpts {
    verbose: bool,
    pedantic: bool,
    echo: Option<bool>,
    headers: bool,
    no_responders: bool,
    protocol: i64,
    name: Option<String>,
    lang: Option<String>,
    version: Option<String>,
    #[serde(flatten)]
    creds: crate::auth::Creds,
}

/// Reader-side state of one connection.
struct Conn {
    server: Arc<Server>,
    handle: Arc<ClientHandle>,
    parser: Parser,
    router: Router,
    verbose: bool,
    pedantic: bool,
    echo: bool,
    headers: bool,
    no_responders: bool,
    /// Send the second INFO (connect_info) after the PONG to the client's first PING.
    info_after_pong: bool,
    pings_out: u32,
    last_in: Instant,
    rtt_known: bool,
    /// When the outstanding server PING went out, to measure the round trip.
    ping_sent: Option<Instant>,
    /// The handle's permissions (a copy, read on every publish) and their answers so far,
    /// as of the handle's `perms_gen`.
    perms: Option<Arc<dyn Permissions>>,
    pub_perms: PublishCache,
    perms_gen: u64,
    /// Auth is required and no CONNECT was accepted yet.
    awaiting_auth: bool,
    /// Until when it may take to authenticate.
    auth_deadline: Option<Instant>,
    /// When its credentials expire (a user JWT): it is then disconnected.
    expires: Option<Instant>,
    /// A CONNECT was accepted (later ones change options, not who it is).
    connected: bool,
    /// Limits from its user and account (-1: none).
    max_subs: i64,
    max_payload: i64,
}

/// Serves one accepted connection until it closes.
pub async fn serve(server: Arc<Server>, mut stream: TcpStream, id: u64) {
    let _ = stream.set_nodelay(true);
    let addr = stream.peer_addr().ok();
    let handle = ClientHandle::new(
        id,
        server.opts.max_pending,
        server.accounts.global().clone(),
        server.log.clone(),
    );
    {
        let mut meta = handle.meta.lock().unwrap_or_else(|e| e.into_inner());
        meta.addr = addr;
        meta.start = Some(std::time::SystemTime::now());
    }
    if server.auth().nonce {
        let _ = handle.nonce.set(crate::auth::new_nonce());
    }
    let tls = server.tls();
    if !server.register(&handle) {
        // INFO (unless the client is to start with a TLS handshake), then the error.
        let mut b = BytesMut::new();
        if !tls.as_ref().is_some_and(|t| t.opts.handshake_first) {
            b.extend_from_slice(&server.info_line(&handle, addr, false));
        }
        encode::err(&mut b, "maximum connections exceeded");
        let _ = tokio::time::timeout(server.opts.write_deadline, stream.write_all(&b)).await;
        let _ = stream.shutdown().await;
        handle.close(CloseReason::MaxConnections);
        server.closed.record(&handle);
        crate::warn!(server.log, "{id} - Maximum connections exceeded");
        return;
    }
    crate::debug!(server.log, "{id} - Client connection created from {addr:?}");
    let Some(tls) = tls else {
        // The plain path: nothing TLS-related on it.
        handle.queue_raw(&server.info_line(&handle, addr, false));
        let (rd, wr) = stream.into_split();
        return run(server, handle, rd, wr).await;
    };
    let info = |tls_first: bool| server.info_line_with(&handle, addr, false, tls_first);
    let opening = crate::tls::Opening {
        tls: &tls,
        log: &server.log,
        id,
        addr,
        info: &info,
        write_deadline: server.opts.write_deadline,
    };
    match crate::tls::negotiate(&opening, stream).await {
        Ok((crate::tls::Opened::Plain(stream), _)) => {
            let (rd, wr) = stream.into_split();
            run(server, handle, rd, wr).await
        }
        Ok((crate::tls::Opened::Tls(stream), tls_first)) => {
            let peer = crate::tls::PeerTls::of(stream.get_ref().1, tls_first, tls.opts.map);
            crate::debug!(
                server.log,
                "{}TLS version {}, cipher suite {}",
                crate::tls::log_prefix(addr, id),
                peer.version,
                peer.cipher
            );
            handle.meta.lock().unwrap_or_else(|e| e.into_inner()).tls = Some(Arc::new(peer));
            if tls_first {
                handle.queue_raw(&info(true));
            }
            let (rd, wr) = tokio::io::split(*stream);
            run(server, handle, rd, wr).await
        }
        Err(failed) => {
            let reason = match failed {
                crate::tls::Failed::Throttled => CloseReason::MaxConnections,
                crate::tls::Failed::Write => CloseReason::WriteError,
                crate::tls::Failed::Handshake => CloseReason::TlsHandshakeError,
            };
            crate::debug!(
                server.log,
                "{}Client connection closed: {}",
                crate::tls::log_prefix(addr, id),
                crate::monitor::reason_text(Some(reason))
            );
            handle.close(reason);
            server.closed.record(&handle);
            server.unregister(id);
        }
    }
}

/// Runs a registered connection whose INFO is queued (or sent): the writer task, then the
/// reader until the connection ends. Generic over the stream, so the plain path is
/// monomorphized on TCP halves and pays nothing for TLS.
async fn run<R: ConnRead, W: AsyncWrite + Unpin + Send + 'static>(
    server: Arc<Server>,
    handle: Arc<ClientHandle>,
    rd: R,
    wr: W,
) {
    let id = handle.id;
    let writer = tokio::spawn(write_loop(handle.clone(), wr, server.opts.write_deadline));
    let mut conn = Conn::new(server.clone(), handle.clone());
    let reason = conn.read_loop(rd).await;
    crate::debug!(server.log, "{id} - Client connection closed: {reason:?}");
    handle.close(reason);
    // Before the subscriptions go: the closed-connections list keeps them.
    server.closed.record(&handle);
    conn.remove_all_subs();
    server.unregister(id);
    if conn.connected {
        let acc = handle.account();
        acc.conns.fetch_sub(1, Ordering::Relaxed);
        let st = &acc.stats;
        let hs = &handle.stats;
        st.closed_in_msgs
            .fetch_add(hs.in_msgs.load(Ordering::Relaxed), Ordering::Relaxed);
        st.closed_in_bytes
            .fetch_add(hs.in_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        st.closed_out_msgs
            .fetch_add(hs.out_msgs.load(Ordering::Relaxed), Ordering::Relaxed);
        st.closed_out_bytes
            .fetch_add(hs.out_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        if let Some(sys) = server.system.get() {
            sys.client_event(&server, &handle, false);
        }
    }
    let _ = writer.await;
}

/// The read side of a connection: a TCP half, or a TLS stream's.
pub(crate) trait ConnRead: AsyncRead + Unpin + Send + 'static {
    /// Waits for input, reserves `want` bytes in `buf` and reads once: `(read, room)`, or
    /// None when the readiness was stale and nothing was read.
    fn read_some(
        &mut self,
        buf: &mut BytesMut,
        want: usize,
    ) -> impl Future<Output = std::io::Result<Option<(usize, usize)>>> + Send;
}

impl ConnRead for OwnedReadHalf {
    async fn read_some(
        &mut self,
        buf: &mut BytesMut,
        want: usize,
    ) -> std::io::Result<Option<(usize, usize)>> {
        // The buffer is reserved only once the socket is readable: a connection that never
        // sends anything holds none.
        self.readable().await?;
        buf.reserve(want);
        let room = buf.capacity() - buf.len();
        // One poll of read_buf rather than try_read_buf: after a short read it knows the
        // socket is drained and skips the extra read that would only say EAGAIN.
        let polled = {
            let mut read = std::pin::pin!(self.read_buf(buf));
            std::future::poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await
        };
        match polled {
            Poll::Pending => Ok(None),
            Poll::Ready(r) => r.map(|n| Some((n, room))),
        }
    }
}

impl ConnRead for tokio::io::ReadHalf<tokio_rustls::server::TlsStream<TcpStream>> {
    async fn read_some(
        &mut self,
        buf: &mut BytesMut,
        want: usize,
    ) -> std::io::Result<Option<(usize, usize)>> {
        // Decrypted bytes may already wait inside rustls, where socket readiness cannot see
        // them: read directly.
        buf.reserve(want);
        let room = buf.capacity() - buf.len();
        self.read_buf(buf).await.map(|n| Some((n, room)))
    }
}

impl Conn {
    fn new(server: Arc<Server>, handle: Arc<ClientHandle>) -> Conn {
        Conn {
            parser: Parser::new(server.opts.max_payload),
            router: Router::for_client(&handle),
            verbose: true, // the reference treats a client that never sent CONNECT as verbose
            pedantic: false,
            echo: true,
            headers: false,
            no_responders: false,
            info_after_pong: false,
            pings_out: 0,
            last_in: Instant::now(),
            rtt_known: false,
            ping_sent: None,
            perms: handle.permissions(),
            pub_perms: PublishCache::default(),
            perms_gen: handle.perms_gen.load(Ordering::Acquire),
            awaiting_auth: false,
            auth_deadline: None,
            expires: None,
            connected: false,
            max_subs: -1,
            max_payload: -1,
            handle,
            server,
        }
        .with_auth()
    }

    fn with_auth(mut self) -> Conn {
        let auth = self.server.auth();
        if auth.required {
            self.awaiting_auth = true;
            self.auth_deadline = Some(Instant::now() + auth.timeout);
        }
        self
    }

    /// The next time something must end the connection (the auth timeout, expiry).
    fn deadline(&self) -> Option<Instant> {
        let auth = self.auth_deadline.filter(|_| self.awaiting_auth);
        match (auth, self.expires) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn check_deadlines(&mut self) -> Option<CloseReason> {
        let now = Instant::now();
        if self.awaiting_auth && self.auth_deadline.is_some_and(|d| now >= d) {
            crate::error!(
                self.server.log,
                "{} - authentication timeout",
                self.handle.id
            );
            self.server.auth_failures.fetch_add(1, Ordering::Relaxed);
            self.send_err("Authentication Timeout");
            return Some(CloseReason::AuthenticationTimeout);
        }
        if self.expires.is_some_and(|d| now >= d) {
            crate::info!(
                self.server.log,
                "{} - user authentication expired",
                self.handle.id
            );
            self.send_err("User Authentication Expired");
            return Some(CloseReason::AuthenticationExpired);
        }
        None
    }

    /// Takes the handle's permissions again if a reload changed them.
    fn refresh_perms(&mut self) {
        let gen = self.handle.perms_gen.load(Ordering::Acquire);
        if gen != self.perms_gen {
            self.perms_gen = gen;
            self.perms = self.handle.permissions();
            self.pub_perms.clear();
        }
    }

    async fn read_loop<R: ConnRead>(&mut self, mut rd: R) -> CloseReason {
        // The read size adapts like the reference's: small for idle connections (memory per
        // connection matters), doubling while reads fill it, up to 64 KiB. The buffer is
        // only reserved once the socket is readable (a connection that never sent anything
        // holds none).
        let mut read_size = 512usize;
        let mut buf = BytesMut::new();
        let mut closed = self.handle.closed.subscribe();
        let mut shutdown = self.server.shutdown_rx();
        let ping_interval = self.server.opts.ping_interval;
        // The first PING comes early (as with the reference) so dead peers are found fast.
        let mut next_ping = Instant::now() + ping_interval.min(Duration::from_secs(2));
        // A burst's buffer (over BUF_KEEP) is given back once BUF_IDLE passed without a read,
        // on the keepalive timer (which then also wakes for that). Not giving it back after
        // every read that drained the socket keeps a busy connection's buffer, and its cache
        // lines, for reuse.
        let mut buf_held = false;
        loop {
            // (A partial message keeps its buffer: no early wake-up for it.)
            let mut wake_at = if buf_held && buf.is_empty() {
                next_ping.min(self.last_in + BUF_IDLE)
            } else {
                next_ping
            };
            if let Some(d) = self.deadline() {
                wake_at = wake_at.min(d);
            }
            let want = self
                .parser
                .wanted()
                .saturating_sub(buf.len())
                .max(read_size);
            tokio::select! {
                r = rd.read_some(&mut buf, want) => {
                    let (n, room) = match r {
                        Ok(None) => continue, // stale readiness: wait again
                        Ok(Some((0, _))) => return CloseReason::ClientClosed,
                        Ok(Some(read)) => read,
                        Err(_) => return CloseReason::ReadError,
                    };
                    if n == room && read_size < 64 * 1024 {
                        read_size *= 2;
                    } else if n < read_size / 4 && read_size > 512 {
                        read_size /= 2;
                    }
                    self.last_in = Instant::now();
                    self.handle
                        .stats
                        .last_activity
                        .store(crate::time::now_nanos(), Ordering::Relaxed);
                    let res = self.process(&mut buf);
                    buf_held = buf.capacity() > BUF_KEEP;
                    self.flush_signals();
                    if res.is_ok() && self.router.has_blocked() {
                        // A JetStream queue this read filled: stop reading until it has room
                        // (backpressure: nothing is dropped, and nothing piles up).
                        tokio::select! {
                            _ = self.wait_for_queues() => {}
                            _ = until_true(&mut closed) => return CloseReason::WriteError,
                            _ = until_true(&mut shutdown) => return CloseReason::ServerShutdown,
                        }
                    }
                    self.stall_if_congested().await;
                    if let Err(reason) = res {
                        if reason == CloseReason::ProtocolError {
                            // Let the -ERR reach the client before the socket goes: read and
                            // drop what it still sends instead of resetting the connection.
                            self.handle.close(reason);
                            let _ = tokio::time::timeout(Duration::from_secs(1), drain(&mut rd)).await;
                        }
                        return reason;
                    }
                }
                _ = tokio::time::sleep_until(wake_at.into()) => {
                    if buf_held && self.last_in.elapsed() >= BUF_IDLE && buf.is_empty() {
                        // Quiet for a while: the burst is over.
                        buf = BytesMut::new();
                        read_size = 512;
                        buf_held = false;
                    }
                    if let Some(reason) = self.check_deadlines() {
                        self.flush_signals();
                        return reason;
                    }
                    if Instant::now() < next_ping {
                        continue;
                    }
                    next_ping = Instant::now() + ping_interval;
                    if let Err(reason) = self.ping_timer() {
                        self.flush_signals();
                        return reason;
                    }
                    self.flush_signals();
                }
                _ = until_true(&mut closed) => return CloseReason::WriteError,
                _ = until_true(&mut shutdown) => return CloseReason::ServerShutdown,
            }
        }
    }

    /// Waits until every in-process queue this connection filled has room again.
    async fn wait_for_queues(&mut self) {
        while let Some(q) = self.router.pop_blocked() {
            q.wait_room().await;
        }
    }

    /// Pauses this publisher for a few milliseconds when a subscriber it just fed is
    /// congested (at most 5 ms per read, like the reference's producer stall).
    async fn stall_if_congested(&mut self) {
        let Some(h) = self.router.take_congested() else {
            return;
        };
        let notified = h.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if !h.congested.load(Ordering::Relaxed) {
            return;
        }
        let wait = if h.pending_bytes() >= self.server.opts.max_pending {
            Duration::from_millis(5)
        } else {
            Duration::from_millis(2)
        };
        let _ = tokio::time::timeout(wait, notified).await;
    }

    fn ping_timer(&mut self) -> Result<(), CloseReason> {
        let interval = self.server.opts.ping_interval;
        // Recent traffic from the client proves it alive; skip the PING (as the reference).
        if self.rtt_known && self.last_in.elapsed() < interval {
            return Ok(());
        }
        if self.pings_out + 1 > self.server.opts.ping_max {
            self.send_err("Stale Connection");
            crate::debug!(
                self.server.log,
                "{} - Stale Client Connection - Closing",
                self.handle.id
            );
            return Err(CloseReason::StaleConnection);
        }
        self.pings_out += 1;
        self.ping_sent = Some(Instant::now());
        self.send_raw(encode::PING);
        Ok(())
    }

    fn flush_signals(&mut self) {
        self.router.flush();
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        if self.handle.queue_raw(bytes) {
            self.router.needs_signal(&self.handle);
        }
    }

    fn send_err(&mut self, text: &str) {
        if self.handle.tracing() {
            self.handle.trace("->>", format_args!("[-ERR {text}]"));
        }
        let mut b = BytesMut::with_capacity(text.len() + 10);
        encode::err(&mut b, text);
        self.send_raw(&b);
    }

    /// A denied publish or subscription: the reference's -ERR, logged; the connection stays.
    fn permission_violation(&mut self, text: String) {
        crate::error!(self.server.log, "{} - {text}", self.handle.id);
        self.send_err(&text);
    }

    fn ok(&mut self) {
        if self.verbose {
            if self.handle.tracing() {
                self.handle.trace("->>", format_args!("[OK]"));
            }
            self.send_raw(encode::OK);
        }
    }

    /// Handles every complete op in `buf`.
    fn process(&mut self, buf: &mut BytesMut) -> Result<(), CloseReason> {
        self.refresh_perms();
        loop {
            let op = match self.parser.next(buf) {
                Ok(Some(op)) => op,
                Ok(None) => return Ok(()),
                Err(e) => {
                    if let Some(text) = e.err_text() {
                        self.send_err(text);
                    }
                    if e == ParseError::MaxPayload {
                        crate::debug!(
                            self.server.log,
                            "{} - Maximum Payload Violation",
                            self.handle.id
                        );
                    }
                    return Err(CloseReason::ProtocolError);
                }
            };
            if self.handle.tracing() {
                trace_in(&self.handle, &op);
            }
            if self.awaiting_auth && !matches!(op, ClientOp::Connect(_)) && !self.no_auth_user() {
                // The reference: anything but CONNECT first, when auth is required.
                return Err(self.auth_violation("no CONNECT before other operations".into()));
            }
            match op {
                ClientOp::Pub {
                    subject,
                    reply,
                    hdr_len,
                    data,
                } => {
                    if hdr_len.is_some() && !self.headers {
                        // The reference drops a headers:false client that sends HPUB.
                        return Err(CloseReason::ProtocolError);
                    }
                    self.process_pub(subject, reply, hdr_len, data);
                }
                ClientOp::Sub {
                    subject,
                    queue,
                    sid,
                } => self.process_sub(&subject, queue.as_deref(), &sid),
                ClientOp::Unsub { sid, max } => self.process_unsub(&sid, max),
                ClientOp::Ping => {
                    if self.handle.tracing() {
                        self.handle.trace("->>", format_args!("[PONG]"));
                    }
                    self.send_raw(encode::PONG);
                    if self.info_after_pong {
                        self.info_after_pong = false;
                        let addr = self
                            .handle
                            .meta
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .addr;
                        let line = self.server.info_line(&self.handle, addr, true);
                        self.send_raw(&line);
                        // From now on it may get INFO updates (cluster connect_urls).
                        self.handle.async_info.store(true, Ordering::Relaxed);
                    }
                }
                ClientOp::Pong => {
                    self.pings_out = 0;
                    self.rtt_known = true;
                    if let Some(sent) = self.ping_sent.take() {
                        self.handle
                            .stats
                            .rtt_nanos
                            .store(sent.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                }
                ClientOp::Connect(json) => self.process_connect(&json)?,
                ClientOp::Info => {}
            }
        }
    }

    /// A failed authentication: the reference's -ERR, logged (never with a secret),
    /// counted; the connection closes.
    fn auth_violation(&mut self, why: String) -> CloseReason {
        crate::error!(
            self.server.log,
            "{} - authentication error - {why}",
            self.handle.id
        );
        self.server.auth_failures.fetch_add(1, Ordering::Relaxed);
        self.send_err("Authorization Violation");
        CloseReason::AuthenticationFailure
    }

    /// With a `no_auth_user`, a client may skip CONNECT (telnet demos): it becomes that
    /// user. False when there is none.
    fn no_auth_user(&mut self) -> bool {
        let auth = self.server.auth();
        match auth.authenticate(&crate::auth::Creds::default(), None) {
            Ok(a) => self.bind(a, crate::auth::Creds::default()).is_ok(),
            Err(_) => false,
        }
    }

    /// Binds the connection to who it authenticated as: its account (and a router and match
    /// cache there), permissions and limits; then the connect event.
    fn bind(
        &mut self,
        a: crate::auth::Authed,
        creds: crate::auth::Creds,
    ) -> Result<(), CloseReason> {
        let Some(account) = self.server.accounts.get(&a.account) else {
            return Err(self.auth_violation(format!("account {:?} is gone", a.account)));
        };
        let max_conns = account.config().max_connections;
        let n = account.conns.fetch_add(1, Ordering::Relaxed) + 1;
        if max_conns >= 0 && n as i64 > max_conns {
            account.conns.fetch_sub(1, Ordering::Relaxed);
            crate::error!(
                self.server.log,
                "{} - maximum account active connections exceeded",
                self.handle.id
            );
            self.send_err("maximum account active connections exceeded");
            return Err(CloseReason::MaxAccountConnections);
        }
        account.stats.total_conns.fetch_add(1, Ordering::Relaxed);
        if !Arc::ptr_eq(self.handle.account(), &account)
            && !self.handle.bind_account(account.clone())
        {
            account.conns.fetch_sub(1, Ordering::Relaxed);
            return Err(self.auth_violation("account already bound".into()));
        }
        let _ = self.handle.bind_account(account.clone());
        // The new router matches in the account; wake whoever the old one owes first.
        self.router.flush();
        self.router = Router::for_client(&self.handle);
        if self.server.auth().required {
            self.handle
                .set_permissions(a.perms.clone().map(|p| p as Arc<dyn Permissions>));
            self.refresh_perms();
        }
        self.expires = a.expires.map(|t| {
            let left = t
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default();
            Instant::now() + left
        });
        let acc_limits = account.config();
        self.max_subs = min_limit(a.max_subs, acc_limits.max_subs);
        self.max_payload = min_limit(a.max_payload, acc_limits.max_payload);
        *self.handle.creds.lock().unwrap_or_else(|e| e.into_inner()) = Some(creds);
        {
            let mut meta = self.handle.meta.lock().unwrap_or_else(|e| e.into_inner());
            meta.user = a.user;
            meta.connected = true;
        }
        self.awaiting_auth = false;
        self.connected = true;
        Ok(())
    }

    fn process_connect(&mut self, json: &[u8]) -> Result<(), CloseReason> {
        // Invalid JSON: the reference closes without -ERR.
        let c: ConnectOpts =
            serde_json::from_slice(json).map_err(|_| CloseReason::ProtocolError)?;
        if c.no_responders && !c.headers {
            self.send_err("no responders requires headers support");
            return Err(CloseReason::ProtocolError);
        }
        let first = !self.connected;
        if first {
            let auth = self.server.auth();
            let identity = self
                .handle
                .meta
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .tls
                .clone()
                .filter(|t| t.identity.is_some());
            let authed = if let (true, Some(t)) = (auth.required, identity) {
                let id = t.identity.as_ref().expect("filtered");
                match auth.authenticate_cert(id, &self.server.log) {
                    Ok(a) => a,
                    Err(why) => return Err(self.auth_violation(why)),
                }
            } else if auth.required {
                match auth.authenticate(&c.creds, self.handle.nonce()) {
                    Ok(a) => a,
                    Err(why) => return Err(self.auth_violation(why)),
                }
            } else {
                crate::auth::Authed {
                    user: String::new(),
                    account: crate::account::GLOBAL.into(),
                    perms: None,
                    expires: None,
                    max_subs: -1,
                    max_payload: -1,
                }
            };
            self.bind(authed, c.creds.clone())?;
        }
        self.verbose = c.verbose;
        self.pedantic = c.pedantic;
        self.echo = c.echo.unwrap_or(true);
        self.headers = c.headers;
        self.no_responders = c.no_responders;
        self.handle.headers.store(c.headers, Ordering::Relaxed);
        self.info_after_pong = c.protocol >= 1;
        {
            let mut meta = self.handle.meta.lock().unwrap_or_else(|e| e.into_inner());
            meta.name = c.name.unwrap_or_default();
            meta.lang = c.lang.unwrap_or_default();
            meta.version = c.version.unwrap_or_default();
        }
        self.ok();
        if first {
            if let Some(sys) = self.server.system.get() {
                sys.client_event(&self.server, &self.handle, true);
            }
        }
        Ok(())
    }

    fn process_pub(
        &mut self,
        subject: Bytes,
        reply: Option<Bytes>,
        hdr_len: Option<usize>,
        data: Bytes,
    ) {
        if self.pedantic && !subject::valid_publish(&subject) {
            self.send_err("Invalid Publish Subject");
            return;
        }
        if self.max_payload >= 0 && data.len() as i64 > self.max_payload {
            // A user's or account's limit below the server's max_payload (JWT limits).
            self.send_err("Maximum Payload Violation");
            self.handle.close(CloseReason::MaxPayload);
            return;
        }
        let stats = &self.handle.stats;
        stats.in_msgs.fetch_add(1, Ordering::Relaxed);
        stats
            .in_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        // The permission hook (counted as received first, as the reference does).
        if !self.pub_perms.allows(self.perms.as_ref(), &subject) {
            self.permission_violation(permissions::publish_violation(&subject));
            return;
        }
        self.ok();
        let msg = Outgoing {
            subject: &subject,
            reply: reply.as_ref(),
            hdr_len,
            data: &data,
        };
        let me = self.handle.id;
        let skip = (!self.echo).then_some(me);
        let delivered = self.router.route(&self.server, &msg, skip);
        if !delivered && self.no_responders {
            if let Some(reply) = &reply {
                self.router.no_responders(&self.server, me, &subject, reply);
            }
        }
    }

    fn process_sub(&mut self, subj: &[u8], queue: Option<&[u8]>, sid: &[u8]) {
        if !subject::valid_subscribe(subj) || queue.is_some_and(|q| !subject::valid_subscribe(q)) {
            self.send_err("Invalid Subject");
            return;
        }
        if let Some(p) = &self.perms {
            if !p.can_subscribe(subj, queue) {
                self.permission_violation(permissions::subscribe_violation(subj, queue));
                return;
            }
        }
        {
            let mut subs = self.handle.subs.lock().unwrap_or_else(|e| e.into_inner());
            if self.max_subs >= 0 && subs.len() as i64 >= self.max_subs && !subs.contains_key(sid) {
                drop(subs);
                crate::error!(
                    self.server.log,
                    "{} - maximum subscriptions exceeded",
                    self.handle.id
                );
                self.send_err("maximum subscriptions exceeded");
                return;
            }
            // A repeated sid is ignored, as by the reference.
            if !subs.contains_key(sid) {
                // Copies, so the subscription does not pin a whole read buffer.
                let sid = Bytes::copy_from_slice(sid);
                let sub = Arc::new(Sub {
                    client: self.handle.clone(),
                    sid: sid.clone(),
                    subject: Bytes::copy_from_slice(subj),
                    queue: queue.map(Bytes::copy_from_slice),
                    max: AtomicU64::new(0),
                    delivered: AtomicU64::new(0),
                });
                subs.insert(sid, sub.clone());
                drop(subs);
                if self.perms.is_some() {
                    self.handle.note_subscription(subj);
                }
                self.handle.account().sublist.insert(sub);
            }
        }
        self.ok();
    }

    fn process_unsub(&mut self, sid: &[u8], max: Option<u64>) {
        let sub = self
            .handle
            .subs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(sid)
            .cloned();
        if let Some(sub) = sub {
            match max {
                Some(m) if m > 0 && sub.delivered.load(Ordering::Relaxed) < m => {
                    sub.max.store(m, Ordering::Relaxed)
                }
                _ => self.server.remove_sub(&sub),
            }
        }
        self.ok();
    }

    fn remove_all_subs(&mut self) {
        let subs: Vec<Arc<Sub>> = self
            .handle
            .subs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, s)| s)
            .collect();
        for s in subs {
            self.handle.trace_delsub(&s.sid);
            self.handle.account().sublist.remove(&s);
        }
    }
}

/// The smaller of two limits where -1 (or any negative) means none.
fn min_limit(a: i64, b: i64) -> i64 {
    match (a < 0, b < 0) {
        (true, true) => -1,
        (true, false) => b,
        (false, true) => a,
        (false, false) => a.min(b),
    }
}

impl ClientHandle {
    /// Sends `-ERR '<text>'` and closes (a reload that revokes the client's access).
    pub fn send_err_and_close(&self, text: &str, reason: CloseReason) {
        let mut b = BytesMut::with_capacity(text.len() + 10);
        encode::err(&mut b, text);
        self.queue_raw(&b);
        self.close(reason);
    }

    /// Sends `-ERR '<text>'`, keeping the connection.
    pub fn send_err(&self, text: &str) {
        let mut b = BytesMut::with_capacity(text.len() + 10);
        encode::err(&mut b, text);
        if self.queue_raw(&b) {
            self.signal();
        }
    }
}

/// Resolves once the flag is set (or its sender is gone).
pub async fn until_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// Reads and drops what the peer still sends, until it closes: closing a socket with unread
/// input resets the connection, and the peer's kernel then drops what it had received but
/// not yet read (our last messages).
pub(crate) async fn drain<R: AsyncRead + Unpin>(rd: &mut R) {
    let mut scratch = [0u8; 4096];
    while let Ok(n) = rd.read(&mut scratch).await {
        if n == 0 {
            break;
        }
    }
}

/// Read buffer capacity a connection may keep indefinitely, and how long a larger one is
/// kept without reads.
const BUF_KEEP: usize = 4 * 1024;
const BUF_IDLE: Duration = Duration::from_secs(1);

/// Outbound buffer capacity a writer keeps while it has nothing to write.
const IDLE_BUF: usize = 64 * 1024;

/// Writes whatever is queued, in one write per wake-up, until the connection closes.
pub(crate) async fn write_loop<W: AsyncWrite + Unpin>(
    h: Arc<ClientHandle>,
    mut wr: W,
    deadline: Duration,
) {
    let mut spare = BytesMut::new();
    loop {
        let taken = {
            let mut o = h.lock_out();
            o.flush_scheduled = false;
            if o.buf.is_empty() {
                if o.closing {
                    break;
                }
                // Going idle: a burst's buffers are given back rather than held.
                if o.buf.capacity() > IDLE_BUF {
                    o.buf = BytesMut::new();
                }
                if spare.capacity() > IDLE_BUF {
                    spare = BytesMut::new();
                }
                None
            } else {
                Some(std::mem::replace(&mut o.buf, std::mem::take(&mut spare)))
            }
        };
        let Some(data) = taken else {
            h.wake_writer.notified().await;
            continue;
        };
        // The flush is free on TCP; TLS may hold encrypted records back until it.
        let write = tokio::time::timeout(deadline, async {
            wr.write_all(&data).await?;
            wr.flush().await
        });
        tokio::select! {
            r = write => match r {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    h.close(CloseReason::WriteError);
                    break;
                }
                Err(_) => {
                    crate::info!(
                        h.log,
                        "{} - Slow Consumer Detected: WriteDeadline of {:?} exceeded with {} total bytes",
                        h.tag(), deadline, data.len()
                    );
                    h.count_slow();
                    h.close(CloseReason::SlowConsumerWriteDeadline);
                    break;
                }
            },
            _ = h.abort_writer.notified() => break,
        }
        h.congested.store(false, Ordering::Relaxed);
        h.drained.notify_waiters();
        // Keep the buffer for reuse unless a burst made it large.
        spare = data;
        spare.clear();
        if spare.capacity() > 1024 * 1024 {
            spare = BytesMut::new();
        }
    }
    // Bounded: closing a TLS stream first sends close_notify, which a peer that stopped
    // reading (a slow consumer) would never take.
    let _ = tokio::time::timeout(Duration::from_secs(1), wr.shutdown()).await;
}

/// Traces one op from a client as the reference does: its line (`<<- [PUB subject 5]`) and,
/// for a publish, its payload Go-quoted (`<<- MSG_PAYLOAD: ["hello"]`). CONNECT's secrets
/// (password, token, nonce signature) are shown as `[REDACTED]`.
fn trace_in(h: &ClientHandle, op: &ClientOp) {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match op {
        ClientOp::Pub {
            subject,
            reply,
            hdr_len,
            data,
        } => {
            let reply = reply
                .as_ref()
                .map_or_else(String::new, |r| format!(" {}", text(r)));
            match hdr_len {
                Some(n) => h.trace(
                    "<<-",
                    format_args!("[HPUB {}{reply} {n} {}]", text(subject), data.len()),
                ),
                None => h.trace(
                    "<<-",
                    format_args!("[PUB {}{reply} {}]", text(subject), data.len()),
                ),
            }
            h.trace_payload("<<-", data);
        }
        ClientOp::Sub {
            subject,
            queue,
            sid,
        } => {
            let queue = queue
                .as_ref()
                .map_or_else(String::new, |q| format!(" {}", text(q)));
            h.trace(
                "<<-",
                format_args!("[SUB {}{queue} {}]", text(subject), text(sid)),
            );
        }
        ClientOp::Unsub { sid, max } => {
            let max = max.map_or_else(String::new, |m| format!(" {m}"));
            h.trace("<<-", format_args!("[UNSUB {}{max}]", text(sid)));
        }
        ClientOp::Ping => h.trace("<<-", format_args!("[PING]")),
        ClientOp::Pong => h.trace("<<-", format_args!("[PONG]")),
        ClientOp::Info => h.trace("<<-", format_args!("[INFO]")),
        ClientOp::Connect(json) => {
            h.trace("<<-", format_args!("[CONNECT {}]", redact_connect(json)))
        }
    }
}

/// CONNECT's JSON with its secrets replaced (unparseable JSON is not shown at all).
pub(crate) fn redact_connect(json: &[u8]) -> String {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(json) else {
        return "[REDACTED]".to_string();
    };
    if let Some(m) = v.as_object_mut() {
        for key in ["pass", "auth_token", "sig"] {
            if let Some(x) = m.get_mut(key) {
                *x = serde_json::Value::String("[REDACTED]".into());
            }
        }
    }
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Opts;
    use crate::permissions::tests::Deny;

    #[test]
    fn traced_payloads_are_go_quoted_and_connect_secrets_redacted() {
        assert_eq!(crate::log::go_quote(b"hello"), "\"hello\"");
        assert_eq!(
            crate::log::go_quote(b"a\"b\\c\r\n\t\x01\x7f\xffz"),
            "\"a\\\"b\\\\c\\r\\n\\t\\x01\\x7f\\xffz\""
        );
        assert_eq!(crate::log::go_quote("héllo".as_bytes()), "\"héllo\"");
        let c =
            redact_connect(br#"{"user":"u","pass":"p1","auth_token":"t1","sig":"s1","lang":"go"}"#);
        let v: serde_json::Value = serde_json::from_str(&c).unwrap();
        for key in ["pass", "auth_token", "sig"] {
            assert_eq!(v[key], "[REDACTED]", "{c}");
        }
        assert_eq!(v["user"], "u");
        assert!(
            !c.contains("p1") && !c.contains("t1") && !c.contains("s1"),
            "{c}"
        );
        assert_eq!(redact_connect(b"{not json pass"), "[REDACTED]");
    }

    fn outbound(h: &ClientHandle) -> String {
        let mut o = h.lock_out();
        let text = String::from_utf8_lossy(&o.buf).into_owned();
        o.buf.clear();
        text
    }

    /// The three hooks with test rules: publish to `secret.`, subscribe to `private.` and
    /// delivery of `hidden.` denied. Each denial is the reference's -ERR (or, for delivery,
    /// silence) and the connection carries on.
    #[test]
    fn permission_hooks_deny_and_keep_the_connection() {
        let server = Server::new(Opts::default(), Log::capture(Default::default()));
        let account = server.accounts.global().clone();
        let h = ClientHandle::new(1, 1 << 20, account.clone(), server.log.clone());
        h.set_permissions(Some(Arc::new(Deny::new("secret.", "private.", "hidden."))));
        let mut conn = Conn::new(server.clone(), h.clone());
        let mut input = BytesMut::from(
            &b"CONNECT {\"verbose\":true}\r\nSUB > 1\r\nSUB private.> 2\r\n\
               SUB private.x q 3\r\nPUB secret.x 2\r\nhi\r\nPUB public.x 2\r\nhi\r\n\
               PUB hidden.x 2\r\nhi\r\n"[..],
        );
        assert_eq!(conn.process(&mut input), Ok(()));
        assert_eq!(
            outbound(&h),
            "+OK\r\n+OK\r\n\
             -ERR 'Permissions Violation for Subscription to \"private.>\"'\r\n\
             -ERR 'Permissions Violation for Subscription to \"private.x\" using queue \"q\"'\r\n\
             -ERR 'Permissions Violation for Publish to \"secret.x\"'\r\n\
             +OK\r\nMSG public.x 1 2\r\nhi\r\n+OK\r\n"
        );
        assert_eq!(account.sublist.count(), 1, "only SUB > was taken");
        assert!(!h.is_closed());
        assert!(server
            .log
            .captured()
            .contains("[ERR] 1 - Permissions Violation for Publish to \"secret.x\""));

        // A denied delivery counts as not delivered: the queue group's other member gets it.
        let other = ClientHandle::new(2, 1 << 20, account.clone(), server.log.clone());
        let mut input = BytesMut::from(&b"SUB hidden.q g 4\r\n"[..]);
        assert_eq!(conn.process(&mut input), Ok(()));
        account.sublist.insert(Arc::new(Sub {
            client: other.clone(),
            sid: Bytes::from_static(b"9"),
            subject: Bytes::from_static(b"hidden.q"),
            queue: Some(Bytes::from_static(b"g")),
            max: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        }));
        outbound(&h);
        let mut input = BytesMut::from(&b"PUB hidden.q 1\r\nx\r\n"[..].repeat(10)[..]);
        assert_eq!(conn.process(&mut input), Ok(()));
        assert_eq!(outbound(&h), "+OK\r\n".repeat(10));
        assert_eq!(other.stats.out_msgs.load(Ordering::Relaxed), 10);
    }
}
