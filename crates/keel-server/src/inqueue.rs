//! The byte-bounded queue in front of every in-process subscriber (a stream's ingest, a
//! consumer's acks and pull requests, the JetStream API).
//!
//! Who waits on whom (the rule that keeps it free of deadlocks):
//! - A client connection that routes into a queue at or over its limit stops reading its
//!   socket until the queue is below the limit again (it never drops: a plain PUB into a
//!   stream is backpressured, not lost). It may overshoot by what one read held.
//! - JetStream's own tasks never wait on a queue: they run under their own locks and a wait
//!   could close a cycle (a stream acking into a consumer's queue while that consumer
//!   delivers into the stream). They may fill a queue to twice its limit; past that their
//!   message is dropped, counted and logged. What they send is what the protocol already
//!   treats as lossy and retries: PubAcks and API replies (the requester times out),
//!   deliveries (redelivered after ack_wait) and status messages.
//! - The task draining a queue never waits on a client, so a waiting client always wakes.
//!
//! Messages are copied into chunks owned by the queue (one copy, as into a socket
//! subscriber's outbound buffer; no allocation per message), so a queued message never pins
//! the publisher's whole read buffer and the byte count is what the queue really holds.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;

use crate::account::Account;
use crate::client::InMsg;
use crate::log::Log;

/// Stream ingest: enough for several group-commit batches, so the store always finds a
/// full batch while publishers are held back.
pub const STREAM_QUEUE_BYTES: usize = 16 * 1024 * 1024;
/// A consumer's acks, pull requests and flow-control replies: small messages.
pub const CONSUMER_QUEUE_BYTES: usize = 1024 * 1024;
/// `$JS.API.>` requests.
pub const API_QUEUE_BYTES: usize = 4 * 1024 * 1024;

/// Who pushes into a queue: the publishing connection's id (0: the server) and whether it is
/// a client connection that waits for room.
#[derive(Clone, Copy, Debug)]
pub struct Publisher {
    pub origin: u64,
    pub client: bool,
}

/// Bookkeeping cost of one queued message besides its bytes.
const MSG_OVERHEAD: usize = std::mem::size_of::<InMsg>();
/// Largest chunk allocated for small messages while the queue is busy.
const MAX_CHUNK: usize = 64 * 1024;

/// What happened to a pushed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Queued; the queue is below its limit.
    Queued,
    /// Queued; the queue is at or over its limit: a client publisher must wait for room.
    Full,
    /// Not queued: an internal publisher hit the hard limit, or the queue is closed.
    Dropped,
    /// Queued into an empty queue that wakes its reader only when the client publisher's
    /// batch ends (`set_wake_after_batch`): the router calls `wake` then.
    WakeLater,
}

struct State {
    msgs: VecDeque<InMsg>,
    bytes: usize,
    /// Where message bytes are copied; split off per message.
    arena: BytesMut,
    closed: bool,
    /// Internal messages dropped since the last report.
    dropped: u64,
}

pub struct InQueue {
    name: String,
    limit: usize,
    /// The account of the subscriber it feeds, which is the account its messages were
    /// published in (an account's messages reach only its own subscribers).
    account: Arc<Account>,
    log: Log,
    state: Mutex<State>,
    /// Mirrors `state.bytes` for lock-free checks and monitoring.
    bytes: AtomicUsize,
    /// Set when a push found the queue full; the receiver then wakes `room` waiters.
    full: AtomicBool,
    ready: Notify,
    room: Notify,
    /// The subscriber serves the whole cluster (clustered JetStream's streams, consumers
    /// and the Raft transport): routes announce its subscriptions and bring it peers'
    /// messages (`route::serves_peers`).
    cluster_wide: AtomicBool,
    /// `set_wake_after_batch`.
    wake_after_batch: AtomicBool,
}

impl InQueue {
    pub fn new(name: String, limit: usize, account: Arc<Account>, log: Log) -> Arc<InQueue> {
        Arc::new(InQueue {
            name,
            limit,
            account,
            log,
            state: Mutex::new(State {
                msgs: VecDeque::new(),
                bytes: 0,
                arena: BytesMut::new(),
                closed: false,
                dropped: 0,
            }),
            bytes: AtomicUsize::new(0),
            full: AtomicBool::new(false),
            ready: Notify::new(),
            room: Notify::new(),
            cluster_wide: AtomicBool::new(false),
            wake_after_batch: AtomicBool::new(false),
        })
    }

    /// Makes the subscriber's subscriptions cluster-wide (set before it subscribes).
    pub fn set_cluster_wide(&self) {
        self.cluster_wide.store(true, Ordering::Relaxed);
    }

    pub fn is_cluster_wide(&self) -> bool {
        self.cluster_wide.load(Ordering::Relaxed)
    }

    /// With `on`, what a client connection routes here wakes the reader once the
    /// connection's read batch is routed, not at its first message, so that the reader
    /// sees everything that arrived together (a prioritized consumer ranks the pull
    /// requests of one write together).
    pub fn set_wake_after_batch(&self, on: bool) {
        self.wake_after_batch.store(on, Ordering::Relaxed);
    }

    /// Wakes the reader (after a `WakeLater` push).
    pub fn wake(&self) {
        self.ready.notify_one();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The account this queue's messages were published in.
    pub fn account(&self) -> &Arc<Account> {
        &self.account
    }

    /// Bytes queued (message bytes plus bookkeeping).
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// At or over the limit: a client publisher must wait before routing more here.
    pub fn is_full(&self) -> bool {
        self.bytes() >= self.limit
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Queues a copy of one message. `from.client`: the publisher is a client connection
    /// (it will wait for room, so nothing is dropped); otherwise the hard limit applies.
    pub fn push(
        &self,
        subject: &[u8],
        sid: &Bytes,
        reply: Option<&[u8]>,
        hdr_len: usize,
        data: &[u8],
        from: Publisher,
    ) -> Pushed {
        let Publisher { origin, client } = from;
        let need = subject.len() + reply.map_or(0, <[u8]>::len) + data.len();
        let cost = need + MSG_OVERHEAD;
        let mut st = self.lock();
        if st.closed {
            return Pushed::Dropped;
        }
        if !client && st.bytes >= 2 * self.limit {
            st.dropped += 1;
            let first = st.dropped == 1;
            drop(st);
            if first {
                crate::warn!(
                    self.log,
                    "Internal queue of {} is full ({} bytes): dropping JetStream's own messages to it until it drains",
                    self.name,
                    2 * self.limit
                );
            }
            return Pushed::Dropped;
        }
        if st.arena.capacity() - st.arena.len() < need {
            // Chunks grow with the backlog: an idle queue allocates little, a busy one
            // amortizes one allocation over many messages.
            let chunk = (2 * st.bytes).clamp(need, MAX_CHUNK.max(need));
            st.arena = BytesMut::with_capacity(chunk);
        }
        st.arena.extend_from_slice(subject);
        if let Some(r) = reply {
            st.arena.extend_from_slice(r);
        }
        st.arena.extend_from_slice(data);
        let mut all = st.arena.split().freeze();
        let subject = all.split_to(subject.len());
        let reply = reply.map(|r| all.split_to(r.len()));
        let was_empty = st.msgs.is_empty();
        st.msgs.push_back(InMsg {
            sid: sid.clone(),
            subject,
            reply,
            hdr_len,
            data: all,
            origin,
        });
        st.bytes += cost;
        self.bytes.store(st.bytes, Ordering::Relaxed);
        let full = st.bytes >= self.limit;
        if full {
            self.full.store(true, Ordering::Relaxed);
        }
        drop(st);
        if was_empty {
            // (A full queue's reader is woken at once: its publisher waits for room.)
            if client && !full && self.wake_after_batch.load(Ordering::Relaxed) {
                return Pushed::WakeLater;
            }
            self.ready.notify_one();
        }
        if full {
            Pushed::Full
        } else {
            Pushed::Queued
        }
    }

    /// Takes up to `max_msgs` messages and about `max_bytes` (at least one message) into
    /// `out`. Returns how many.
    pub fn take(&self, out: &mut Vec<InMsg>, max_msgs: usize, max_bytes: usize) -> usize {
        let mut st = self.lock();
        let mut n = 0;
        let mut taken = 0;
        while n < max_msgs && (n == 0 || taken < max_bytes) {
            let Some(m) = st.msgs.pop_front() else { break };
            taken += cost_of(&m);
            out.push(m);
            n += 1;
        }
        if n == 0 {
            return 0;
        }
        st.bytes -= taken.min(st.bytes);
        self.bytes.store(st.bytes, Ordering::Relaxed);
        if st.msgs.is_empty() {
            // Give the chunk back once nothing queued uses it: an idle queue holds nothing.
            st.arena = BytesMut::new();
            if st.msgs.capacity() > 1024 {
                st.msgs = VecDeque::new();
            }
        }
        let report = if st.bytes < self.limit {
            std::mem::take(&mut st.dropped)
        } else {
            0
        };
        let wake = st.bytes < self.limit && self.full.swap(false, Ordering::Relaxed);
        drop(st);
        if report > 0 {
            crate::warn!(
                self.log,
                "Internal queue of {} drained; {report} JetStream messages to it were dropped",
                self.name
            );
        }
        if wake {
            self.room.notify_waiters();
        }
        n
    }

    /// Resolves when the queue is below its limit or closed.
    pub async fn wait_room(&self) {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if !self.is_full() || self.is_closed() {
                return;
            }
            // Re-arm the receiver's wake-up: a take may have cleared it just before us.
            self.full.store(true, Ordering::Relaxed);
            if !self.is_full() {
                return;
            }
            room.await;
        }
    }

    /// Resolves when something is queued (or the queue is closed).
    pub async fn ready(&self) {
        loop {
            let ready = self.ready.notified();
            {
                let st = self.lock();
                if !st.msgs.is_empty() || st.closed {
                    return;
                }
            }
            ready.await;
        }
    }

    /// No more messages, but what is queued is still taken: the task serving the queue
    /// drains it and then sees it closed (an orderly stop; `close` drops what is queued).
    pub fn seal(&self) {
        self.lock().closed = true;
        self.room.notify_waiters();
        self.ready.notify_one();
    }

    /// No more messages: what is queued is dropped and every waiting publisher released.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.msgs = VecDeque::new();
        st.arena = BytesMut::new();
        st.bytes = 0;
        self.bytes.store(0, Ordering::Relaxed);
        drop(st);
        self.room.notify_waiters();
        self.ready.notify_one();
    }
}

fn cost_of(m: &InMsg) -> usize {
    m.subject.len() + m.reply.as_ref().map_or(0, Bytes::len) + m.data.len() + MSG_OVERHEAD
}

/// The receiving end, owned by the task that serves the queue. Dropping it closes the
/// queue, so nothing accumulates for a task that is gone.
pub struct Receiver {
    q: Arc<InQueue>,
}

impl Receiver {
    pub fn new(q: Arc<InQueue>) -> Receiver {
        Receiver { q }
    }

    /// The account the received messages were published in.
    pub fn account(&self) -> &Arc<Account> {
        self.q.account()
    }

    /// The next message; None once the queue is closed.
    pub async fn recv(&mut self) -> Option<InMsg> {
        let mut one = Vec::with_capacity(1);
        self.recv_many(&mut one, 1, usize::MAX).await;
        one.pop()
    }

    pub fn try_recv(&mut self) -> Option<InMsg> {
        let mut one = Vec::with_capacity(1);
        self.q.take(&mut one, 1, usize::MAX);
        one.pop()
    }

    /// Waits for at least one message, then takes up to `max_msgs` / about `max_bytes`
    /// into `out`. Returns 0 once the queue is closed.
    pub async fn recv_many(
        &mut self,
        out: &mut Vec<InMsg>,
        max_msgs: usize,
        max_bytes: usize,
    ) -> usize {
        loop {
            let n = self.q.take(out, max_msgs, max_bytes);
            if n > 0 {
                return n;
            }
            if self.q.is_closed() {
                return 0;
            }
            self.q.ready().await;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.q.lock().msgs.is_empty()
    }

    /// Takes what is queued now, within the same bounds, without waiting.
    pub fn try_recv_many(
        &mut self,
        out: &mut Vec<InMsg>,
        max_msgs: usize,
        max_bytes: usize,
    ) -> usize {
        self.q.take(out, max_msgs, max_bytes)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.q.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn q(limit: usize) -> (Arc<InQueue>, Receiver) {
        let q = InQueue::new(
            "test".into(),
            limit,
            Account::new(crate::account::GLOBAL),
            Log::stderr(),
        );
        (q.clone(), Receiver::new(q))
    }

    fn push(q: &InQueue, data: &[u8], client: bool) -> Pushed {
        q.push(
            b"s",
            &Bytes::from_static(b"1"),
            Some(b"r"),
            0,
            data,
            Publisher { origin: 0, client },
        )
    }

    #[test]
    fn copies_and_counts_bytes() {
        let (q, mut rx) = q(1 << 20);
        let data = Bytes::from(vec![7u8; 100]);
        assert_eq!(push(&q, &data, true), Pushed::Queued);
        assert_eq!(q.bytes(), 102 + MSG_OVERHEAD);
        let m = rx.try_recv().unwrap();
        assert_eq!(&m.subject[..], b"s");
        assert_eq!(m.reply.as_deref(), Some(&b"r"[..]));
        assert_eq!(&m.data[..], &data[..]);
        assert_eq!(q.bytes(), 0);
    }

    #[test]
    fn client_publishers_are_never_dropped_internal_ones_past_twice_the_limit() {
        let (q, mut rx) = q(10_000);
        let data = vec![0u8; 1000];
        let mut full_at = None;
        for i in 0..100 {
            if push(&q, &data, true) == Pushed::Full && full_at.is_none() {
                full_at = Some(i);
            }
        }
        assert!(full_at.is_some_and(|i| i < 10), "{full_at:?}");
        // Internal publishers: refused once twice the limit is queued.
        let (q2, _rx2) = self::q(10_000);
        let mut dropped = 0;
        for _ in 0..100 {
            if push(&q2, &data, false) == Pushed::Dropped {
                dropped += 1;
            }
        }
        assert!(q2.bytes() < 2 * 10_000 + 1200, "{}", q2.bytes());
        assert!(dropped > 70, "{dropped}");
        let mut out = vec![];
        assert_eq!(rx.try_recv_many(&mut out, 1000, usize::MAX), 100);
    }

    #[test]
    fn take_respects_message_and_byte_bounds() {
        let (q, mut rx) = q(1 << 30);
        for _ in 0..50 {
            push(&q, &[0u8; 1000], true);
        }
        let mut out = vec![];
        assert_eq!(rx.try_recv_many(&mut out, 10, usize::MAX), 10);
        out.clear();
        // Byte bound: stops once about 3000 bytes are taken.
        let n = rx.try_recv_many(&mut out, 1000, 3000);
        assert!((2..=3).contains(&n), "{n}");
        out.clear();
        // A single message bigger than the bound is still taken.
        assert_eq!(rx.try_recv_many(&mut out, 1000, 1), 1);
    }

    #[tokio::test]
    async fn waiting_publisher_wakes_when_room_appears() {
        let (q, mut rx) = q(5000);
        for _ in 0..10 {
            push(&q, &[0u8; 1000], true);
        }
        assert!(q.is_full());
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.wait_room().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        let mut out = vec![];
        rx.try_recv_many(&mut out, 8, usize::MAX);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .unwrap();
    }

    #[tokio::test]
    async fn dropping_the_receiver_releases_waiters_and_refuses_pushes() {
        let (q, rx) = q(100);
        push(&q, &[0u8; 1000], true);
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.wait_room().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(rx);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("released")
            .unwrap();
        assert_eq!(push(&q, b"x", true), Pushed::Dropped);
        assert_eq!(q.bytes(), 0);
    }

    #[tokio::test]
    async fn a_sealed_queue_is_drained_then_ends() {
        let (q, mut rx) = q(1 << 20);
        push(&q, b"a", true);
        push(&q, b"b", true);
        q.seal();
        assert_eq!(push(&q, b"late", true), Pushed::Dropped);
        let mut out = vec![];
        assert_eq!(rx.recv_many(&mut out, 10, usize::MAX).await, 2);
        assert_eq!(rx.recv_many(&mut out, 10, usize::MAX).await, 0);
    }

    #[tokio::test]
    async fn recv_wakes_on_push() {
        let (q, mut rx) = q(1000);
        let got = tokio::spawn(async move { rx.recv().await.map(|m| m.data) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        push(&q, b"hello", true);
        let d = tokio::time::timeout(Duration::from_secs(5), got)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(d.as_deref(), Some(&b"hello"[..]));
    }
}
