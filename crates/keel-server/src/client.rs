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
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
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
    /// Where its subscriptions live and its publishes are routed. Set when the handle is
    /// made: `$G` for every connection today (issue 13 binds users to their accounts).
    account: Arc<Account>,
    /// What it may publish, subscribe to and receive; None: everything (see `permissions`).
    /// Next to `internal`, which every delivery reads too.
    perms: Option<Arc<dyn Permissions>>,
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
}

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
}

impl ClientHandle {
    fn new(id: u64, max_pending: usize, account: Arc<Account>, log: Log) -> Arc<Self> {
        let (closed, _) = watch::channel(false);
        Arc::new(ClientHandle {
            id,
            account,
            perms: None,
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
                .account
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
        h.internal = Some(q.clone());
        h.headers.store(true, Ordering::Relaxed);
        (Arc::new(h), Receiver::new(q))
    }

    /// The account the client is in.
    pub fn account(&self) -> &Arc<Account> {
        &self.account
    }

    /// Its permissions; None: it may do anything.
    pub fn permissions(&self) -> Option<&Arc<dyn Permissions>> {
        self.perms.as_ref()
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
        self.queued(o, data.len())
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
    /// The handle's permissions (a copy, read on every publish) and their answers so far.
    perms: Option<Arc<dyn Permissions>>,
    pub_perms: PublishCache,
}

/// Serves one accepted connection until it closes.
pub async fn serve(server: Arc<Server>, stream: TcpStream, id: u64) {
    let _ = stream.set_nodelay(true);
    let addr = stream.peer_addr().ok();
    let (rd, wr) = stream.into_split();
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
    handle.queue_raw(&server.info_line(&handle, addr, false));
    let writer = tokio::spawn(write_loop(handle.clone(), wr, server.opts.write_deadline));

    if !server.register(&handle) {
        let mut b = BytesMut::new();
        encode::err(&mut b, "maximum connections exceeded");
        handle.queue_raw(&b);
        handle.close(CloseReason::MaxConnections);
        server.closed.record(&handle);
        crate::warn!(server.log, "{id} - Maximum connections exceeded");
        let _ = writer.await;
        return;
    }
    crate::debug!(server.log, "{id} - Client connection created from {addr:?}");

    let mut conn = Conn::new(server.clone(), handle.clone());
    let reason = conn.read_loop(rd).await;
    crate::debug!(server.log, "{id} - Client connection closed: {reason:?}");
    handle.close(reason);
    // Before the subscriptions go: the closed-connections list keeps them.
    server.closed.record(&handle);
    conn.remove_all_subs();
    server.unregister(id);
    let _ = writer.await;
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
            perms: handle.permissions().cloned(),
            pub_perms: PublishCache::default(),
            handle,
            server,
        }
    }

    async fn read_loop(&mut self, mut rd: OwnedReadHalf) -> CloseReason {
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
            let wake_at = if buf_held && buf.is_empty() {
                next_ping.min(self.last_in + BUF_IDLE)
            } else {
                next_ping
            };
            tokio::select! {
                r = rd.readable() => {
                    if r.is_err() {
                        return CloseReason::ReadError;
                    }
                    let want = self
                        .parser
                        .wanted()
                        .saturating_sub(buf.len())
                        .max(read_size);
                    buf.reserve(want);
                    let room = buf.capacity() - buf.len();
                    // One poll of read_buf rather than try_read_buf: after a short read it
                    // knows the socket is drained and skips the extra read that would only
                    // say EAGAIN.
                    let polled = {
                        let mut read = std::pin::pin!(rd.read_buf(&mut buf));
                        std::future::poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await
                    };
                    let n = match polled {
                        Poll::Pending => continue, // stale readiness: wait again
                        Poll::Ready(Ok(0)) => return CloseReason::ClientClosed,
                        Poll::Ready(Ok(n)) => n,
                        Poll::Ready(Err(_)) => return CloseReason::ReadError,
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
            self.send_raw(encode::OK);
        }
    }

    /// Handles every complete op in `buf`.
    fn process(&mut self, buf: &mut BytesMut) -> Result<(), CloseReason> {
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

    fn process_connect(&mut self, json: &[u8]) -> Result<(), CloseReason> {
        // Invalid JSON: the reference closes without -ERR.
        let c: ConnectOpts =
            serde_json::from_slice(json).map_err(|_| CloseReason::ProtocolError)?;
        if c.no_responders && !c.headers {
            self.send_err("no responders requires headers support");
            return Err(CloseReason::ProtocolError);
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
                self.handle.account.sublist.insert(sub);
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
            self.handle.account.sublist.remove(&s);
        }
    }
}

/// Resolves once the flag is set (or its sender is gone).
pub async fn until_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

async fn drain(rd: &mut OwnedReadHalf) {
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
pub(crate) async fn write_loop(h: Arc<ClientHandle>, mut wr: OwnedWriteHalf, deadline: Duration) {
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
        let write = tokio::time::timeout(deadline, wr.write_all(&data));
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
    let _ = wr.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Opts;
    use crate::permissions::tests::Deny;

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
        let mut h = Arc::into_inner(ClientHandle::new(
            1,
            1 << 20,
            account.clone(),
            server.log.clone(),
        ))
        .unwrap();
        h.perms = Some(Arc::new(Deny::new("secret.", "private.", "hidden.")));
        let h = Arc::new(h);
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
