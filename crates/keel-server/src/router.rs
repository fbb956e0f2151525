//! Routing one published message to its subscribers. Each publisher (a client connection,
//! or an in-process service such as JetStream) owns a [`Router`]: the account it publishes
//! in (subjects are matched in that account's sublist only), its own match cache, the list
//! of subscribers whose writers must be woken when its batch ends, and the random state
//! used to pick queue-group members.
//!
//! A router belongs either to a client connection ([`Router::for_client`]), which waits
//! for room when it filled an in-process subscriber's queue, or to one of JetStream's own
//! tasks ([`Router::new`]), which never waits (see `inqueue` for why and what it does
//! instead).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use keel_protocol::encode;

use crate::account::Account;
use crate::client::ClientHandle;
use crate::inqueue::{InQueue, Pushed};
use crate::server::Server;
use crate::sublist::{Forward, MatchCache, MatchResult, Sub};

pub struct Router {
    /// The publisher's account: where subjects are looked up.
    account: Arc<Account>,
    cache: MatchCache,
    to_signal: Vec<Arc<ClientHandle>>,
    rng: u64,
    /// A subscriber found congested during this batch (the publisher may pause).
    congested: Option<Arc<ClientHandle>>,
    /// The publishing connection's id, handed to in-process subscribers (0: the server).
    origin: u64,
    /// Routes for a client connection, which waits for full in-process queues.
    client: bool,
    /// In-process queues this batch left full; the client waits for each before reading on.
    blocked: Vec<Arc<InQueue>>,
    /// In-process queues whose readers are woken when this batch ends (`Pushed::WakeLater`).
    to_wake: Vec<Arc<InQueue>>,
    /// The routes the current message goes to (the first `nroutes`; the entries are kept
    /// for reuse so a routed message allocates nothing).
    routes: Vec<RouteTarget>,
    nroutes: usize,
    /// Match caches for the accounts this router's messages cross into (imports/exports).
    others: Vec<(Arc<Account>, MatchCache)>,
}

/// A route connection a message goes to, once, with the queue groups it was picked for
/// there (the peer delivers to one member of each, and to its plain subscribers).
struct RouteTarget {
    handle: Arc<ClientHandle>,
    queues: Vec<Bytes>,
}

/// Whom a match result's message may reach.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Local subscribers and route peers (a message published here).
    Everyone,
    /// Local subscribers only (past a stream import: peers follow it themselves).
    Local,
    /// Local clients only, not JetStream's in-process subscribers, whose interest stays on
    /// this server (a message a peer sent).
    LocalClients,
}

/// How many accounts deep a message may travel through imports and exports.
const MAX_HOPS: usize = 4;
/// Accounts whose match caches a router keeps for forwarded messages.
const OTHERS_MAX: usize = 16;

/// One message to route. `data` holds the header block (first `hdr_len` bytes) then the
/// payload, as on the wire.
pub struct Outgoing<'a> {
    pub subject: &'a Bytes,
    pub reply: Option<&'a Bytes>,
    pub hdr_len: Option<usize>,
    pub data: &'a Bytes,
}

impl Router {
    /// A router for an in-process publisher (JetStream's tasks) in `account`: it never
    /// waits for a full queue, so its messages past a queue's hard limit are dropped.
    pub fn new(account: Arc<Account>, seed: u64) -> Self {
        Router {
            account,
            cache: MatchCache::default(),
            to_signal: Vec::new(),
            congested: None,
            origin: 0,
            rng: 0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407) | 1,
            client: false,
            blocked: Vec::new(),
            to_wake: Vec::new(),
            routes: Vec::new(),
            nroutes: 0,
            others: Vec::new(),
        }
    }

    /// A router for a client connection, in its account, marking what it routes as the
    /// connection's: full in-process queues are reported by
    /// [`pop_blocked`](Self::pop_blocked) and the connection waits for them.
    pub fn for_client(client: &ClientHandle) -> Self {
        Router {
            client: true,
            ..Router::new(client.account().clone(), client.id).with_origin(client.id)
        }
    }

    /// The account this router publishes in.
    pub fn account(&self) -> &Arc<Account> {
        &self.account
    }

    /// Marks what this router routes as published by connection `id`.
    pub fn with_origin(mut self, id: u64) -> Self {
        self.origin = id;
        self
    }

    /// Delivers `msg` to every plain subscription in the router's account and one member
    /// of each queue group. `skip` names a connection whose own subscriptions must not get
    /// it (echo off). Returns whether anyone received it. (`server` is for what crosses
    /// the account: the auto-unsubscribe bookkeeping today, imports with issue 13.)
    pub fn route(&mut self, server: &Server, msg: &Outgoing, skip: Option<u64>) -> bool {
        self.route_to(server, msg.subject, msg, skip)
    }

    /// Like [`route`](Self::route) but matches subscribers on `target` while the message
    /// keeps its own subject: JetStream deliveries go to an inbox yet carry the stored
    /// message's subject.
    pub fn route_to(
        &mut self,
        server: &Server,
        target: &[u8],
        msg: &Outgoing,
        skip: Option<u64>,
    ) -> bool {
        let result = self.cache.lookup(&self.account.sublist, target);
        self.route_result(server, &result, target, msg, skip)
    }

    /// Like [`route`](Self::route) for a reply to a request (a PubAck): its subject is
    /// seen once, so it is not kept in the match cache.
    pub fn route_reply(&mut self, server: &Server, msg: &Outgoing) -> bool {
        let result = self.cache.lookup_once(&self.account.sublist, msg.subject);
        self.route_result(server, &result, msg.subject, msg, None)
    }

    fn route_result(
        &mut self,
        server: &Server,
        result: &MatchResult,
        target: &[u8],
        msg: &Outgoing,
        skip: Option<u64>,
    ) -> bool {
        let mut delivered =
            self.deliver_all(server, None, Reach::Everyone, result, target, msg, skip);
        if !result.forwards.is_empty() {
            let from = self.account.clone();
            delivered |= self.forward(server, &from, Reach::Everyone, result, target, msg, 1);
        }
        delivered
    }

    /// Delivers to the subscriptions of one match result (one member per queue group), and
    /// once to each route peer with interest if `reach` says so. `other` is the account the
    /// result is in, when an import led out of the router's own; `target` is what it matched
    /// there.
    #[allow(clippy::too_many_arguments)]
    fn deliver_all(
        &mut self,
        server: &Server,
        other: Option<&Arc<Account>>,
        reach: Reach,
        result: &MatchResult,
        target: &[u8],
        msg: &Outgoing,
        skip: Option<u64>,
    ) -> bool {
        let mut delivered = false;
        for sub in &result.psubs {
            if sub.client.is_route() {
                // A peer with interest gets the message once, however many of its
                // subscriptions match.
                if reach == Reach::Everyone {
                    self.add_route_target(sub, None);
                }
                continue;
            }
            if reach == Reach::LocalClients && sub.client.internal_queue().is_some() {
                continue;
            }
            if skip == Some(sub.client.id) {
                continue;
            }
            delivered |= self.deliver(server, sub, msg);
        }
        for group in &result.qsubs {
            // Start at a random member; fall through to the next if one cannot take it.
            // A route's member stands for the peer's members (listed by their number), so
            // a peer is picked in proportion, as the reference does for a client's publish.
            let start = self.next_rand() as usize % group.len();
            for i in 0..group.len() {
                let sub = &group[(start + i) % group.len()];
                if sub.client.is_route() {
                    if reach != Reach::Everyone || sub.client.is_closed() {
                        continue;
                    }
                    self.add_route_target(sub, sub.queue.as_ref());
                    delivered = true;
                    break;
                }
                if skip == Some(sub.client.id) {
                    continue;
                }
                if self.deliver(server, sub, msg) {
                    delivered = true;
                    break;
                }
            }
        }
        if self.nroutes > 0 {
            delivered |= self.send_to_routes(other, target, msg);
        }
        delivered
    }

    /// Routes `msg` (matched on `target` in `from`) through the imports and exports its
    /// match fell under. A message whose subject is its target is renamed with it; a
    /// delivery to an inbox (JetStream's) keeps its stored subject.
    ///
    /// A stream import is followed to this server's subscribers only (`Reach::Local` from
    /// there on): a peer with subscribers of the importer announced interest in the
    /// exporter's subject and follows the import itself, as the reference's shadow
    /// subscriptions do, so the message crosses the route once, in the exporter's account.
    /// Service imports and their responses are followed to route peers too.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        server: &Server,
        from: &Arc<Account>,
        reach: Reach,
        result: &MatchResult,
        target: &[u8],
        msg: &Outgoing,
        hops: usize,
    ) -> bool {
        if hops > MAX_HOPS {
            return false;
        }
        let renamed = msg.subject.as_ref() == target;
        let mut delivered = false;
        for f in &result.forwards {
            let reach = match f {
                Forward::Stream { .. } if reach == Reach::Everyone => Reach::Local,
                _ => reach,
            };
            let (to, new_target, reply) = match f {
                Forward::Stream { to, subject } => {
                    (to.clone(), subject.clone(), msg.reply.cloned())
                }
                Forward::Service {
                    to,
                    subject,
                    response,
                    threshold,
                } => {
                    let reply = match msg.reply {
                        Some(r) => match to.add_response(from, r, *response, *threshold) {
                            Some(r) => Some(r),
                            None => continue,
                        },
                        None => None,
                    };
                    (to.clone(), subject.clone(), reply)
                }
                Forward::Responses => match from.take_response(target) {
                    Some((to, reply)) => (to, reply, msg.reply.cloned()),
                    None => continue,
                },
            };
            let subject = if renamed {
                new_target.clone()
            } else {
                msg.subject.clone()
            };
            let out = Outgoing {
                subject: &subject,
                reply: reply.as_ref(),
                hdr_len: msg.hdr_len,
                data: msg.data,
            };
            let result = self.other_cache(&to).lookup(&to.sublist, &new_target);
            delivered |=
                self.deliver_all(server, Some(&to), reach, &result, &new_target, &out, None);
            if !result.forwards.is_empty() {
                delivered |= self.forward(server, &to, reach, &result, &new_target, &out, hops + 1);
            }
        }
        delivered
    }

    /// Delivers a message that came from a route peer: to the local plain subscribers, and
    /// to one local member of each queue group in `queues` (the groups the sender picked
    /// this server for; none without them). Never to another route (every server has a
    /// route to every other), and never to JetStream's in-process subscribers, whose
    /// interest is this server's own (JetStream is not clustered yet); the system services'
    /// server and account requests do serve peers.
    pub fn route_from_peer(
        &mut self,
        server: &Server,
        msg: &Outgoing,
        queues: &keel_protocol::route::Queues,
    ) -> bool {
        let result = self.cache.lookup(&self.account.sublist, msg.subject);
        if result.is_empty() {
            return false;
        }
        // A JetStream push delivery crosses a route on its deliver subject, with the stored
        // subject after an `@` in its `$JS.ACK` reply (the reference's encoding).
        let remapped = msg.reply.and_then(|r| js_ack_deliver(r).map(|at| (r, at)));
        let (subject, reply);
        let local = match remapped {
            Some((r, at)) => {
                subject = r.slice(at + 1..);
                reply = r.slice(..at);
                Outgoing {
                    subject: &subject,
                    reply: Some(&reply),
                    hdr_len: msg.hdr_len,
                    data: msg.data,
                }
            }
            None => Outgoing { ..*msg },
        };
        let mut delivered = false;
        for sub in &result.psubs {
            if !crate::route::serves_peers(sub) {
                continue;
            }
            delivered |= self.deliver(server, sub, &local);
        }
        if result
            .forwards
            .iter()
            .any(|f| !matches!(f, Forward::Service { .. }))
        {
            // Stream imports, to this server's subscribers of the importers (the peer sent
            // the message in the exporter's account because of the interest they made, see
            // `forward`); and a service's response from a responder on the peer, whose
            // pending reply route is on this server. Service imports were followed where
            // the request was published, so they are not followed twice.
            let from = self.account.clone();
            let only = MatchResult {
                forwards: result
                    .forwards
                    .iter()
                    .filter_map(|f| match f {
                        Forward::Stream { to, subject } => Some(Forward::Stream {
                            to: to.clone(),
                            subject: subject.clone(),
                        }),
                        Forward::Responses => Some(Forward::Responses),
                        Forward::Service { .. } => None,
                    })
                    .collect(),
                ..MatchResult::default()
            };
            delivered |= self.forward(
                server,
                &from,
                Reach::LocalClients,
                &only,
                msg.subject,
                &local,
                1,
            );
        }
        if queues.is_empty() {
            return delivered;
        }
        for group in &result.qsubs {
            if !group[0].queue.as_ref().is_some_and(|q| queues.contains(q)) {
                continue;
            }
            let start = self.next_rand() as usize % group.len();
            for i in 0..group.len() {
                let sub = &group[(start + i) % group.len()];
                if !crate::route::serves_peers(sub) {
                    continue;
                }
                if self.deliver(server, sub, &local) {
                    delivered = true;
                    break;
                }
            }
        }
        delivered
    }

    fn add_route_target(&mut self, sub: &Arc<Sub>, queue: Option<&Bytes>) {
        for t in &mut self.routes[..self.nroutes] {
            if Arc::ptr_eq(&t.handle, &sub.client) {
                if let Some(q) = queue {
                    t.queues.push(q.clone());
                }
                return;
            }
        }
        if self.nroutes == self.routes.len() {
            self.routes.push(RouteTarget {
                handle: sub.client.clone(),
                queues: Vec::new(),
            });
        } else {
            let t = &mut self.routes[self.nroutes];
            t.handle = sub.client.clone();
            t.queues.clear();
        }
        if let Some(q) = queue {
            self.routes[self.nroutes].queues.push(q.clone());
        }
        self.nroutes += 1;
    }

    /// Writes the current message once into each target route's buffer. `target` is the
    /// subject it was matched on, which is what the peer matches too.
    fn send_to_routes(
        &mut self,
        other: Option<&Arc<Account>>,
        target: &[u8],
        msg: &Outgoing,
    ) -> bool {
        let account = other.unwrap_or(&self.account).name.as_bytes();
        // A JetStream delivery (matched on its deliver subject) keeps the stored subject
        // after an `@` in its `$JS.ACK` reply, as the reference sends it.
        let joined;
        let reply = match msg.reply {
            Some(r)
                if target != &msg.subject[..] && is_js_ack(r) && js_ack_deliver(r).is_none() =>
            {
                let mut b = bytes::BytesMut::with_capacity(r.len() + 1 + msg.subject.len());
                b.extend_from_slice(r);
                b.extend_from_slice(b"@");
                b.extend_from_slice(msg.subject);
                joined = b.freeze();
                Some(&joined)
            }
            r => r,
        };
        let mut sent = false;
        for i in 0..self.nroutes {
            let t = &self.routes[i];
            let h = &t.handle;
            if h.queue_routed(
                Some(account),
                target,
                reply,
                &t.queues,
                msg.hdr_len,
                msg.data,
            ) {
                self.to_signal.push(h.clone());
            }
            sent = true;
            if h.congested.load(Ordering::Relaxed) && self.congested.is_none() {
                self.congested = Some(h.clone());
            }
        }
        self.nroutes = 0;
        sent
    }

    fn other_cache(&mut self, account: &Arc<Account>) -> &mut MatchCache {
        let i = match self
            .others
            .iter()
            .position(|(a, _)| Arc::ptr_eq(a, account))
        {
            Some(i) => i,
            None => {
                if self.others.len() >= OTHERS_MAX {
                    self.others.clear();
                }
                self.others.push((account.clone(), MatchCache::default()));
                self.others.len() - 1
            }
        };
        &mut self.others[i].1
    }

    /// A 503 no-responders status on `reply`, delivered only to `client`'s own
    /// subscriptions (the requester's inbox).
    pub fn no_responders(&mut self, server: &Server, client: u64, subject: &[u8], reply: &Bytes) {
        let hdr = Bytes::from(encode::status_headers("503", &[("Nats-Subject", subject)]));
        let result = self.cache.lookup(&self.account.sublist, reply);
        let own: Vec<Arc<Sub>> = result
            .psubs
            .iter()
            .chain(result.qsubs.iter().flatten())
            .filter(|s| s.client.id == client)
            .cloned()
            .collect();
        let msg = Outgoing {
            subject: reply,
            reply: None,
            hdr_len: Some(hdr.len()),
            data: &hdr,
        };
        for sub in own {
            self.deliver(server, &sub, &msg);
        }
    }

    /// Delivers to one subscription, honouring its auto-unsubscribe limit and the
    /// subscriber's delivery permissions.
    pub fn deliver(&mut self, server: &Server, sub: &Arc<Sub>, msg: &Outgoing) -> bool {
        let flags = sub.client.perm_flags();
        if flags != 0 {
            if let Some(p) = sub.client.permissions() {
                if p.checks_delivery() && !p.can_deliver(msg.subject) {
                    return false;
                }
                if let Some(r) = msg.reply {
                    if p.tracks_replies() {
                        p.track_reply(r);
                    }
                }
            }
        }
        let n = sub.delivered.fetch_add(1, Ordering::Relaxed) + 1;
        let max = sub.max.load(Ordering::Relaxed);
        if max > 0 {
            if n > max {
                return false;
            }
            if n == max {
                server.remove_sub(sub);
            }
        }
        if let Some(q) = sub.client.internal_queue() {
            sub.client.stats.out_msgs.fetch_add(1, Ordering::Relaxed);
            let reply = msg.reply.map(|r| &r[..]);
            let hdr_len = msg.hdr_len.unwrap_or(0);
            let pushed = q.push(
                msg.subject,
                &sub.sid,
                reply,
                hdr_len,
                msg.data,
                crate::inqueue::Publisher {
                    origin: self.origin,
                    client: self.client,
                },
            );
            if pushed == Pushed::Full
                && self.client
                && !self.blocked.iter().any(|b| Arc::ptr_eq(b, q))
            {
                self.blocked.push(q.clone());
            }
            if pushed == Pushed::WakeLater {
                self.to_wake.push(q.clone());
            }
            return true;
        }
        if sub
            .client
            .queue_msg(msg.subject, &sub.sid, msg.reply, msg.hdr_len, msg.data)
        {
            self.to_signal.push(sub.client.clone());
        }
        if sub.client.congested.load(Ordering::Relaxed) && self.congested.is_none() {
            self.congested = Some(sub.client.clone());
        }
        true
    }

    pub fn has_blocked(&self) -> bool {
        !self.blocked.is_empty()
    }

    /// An in-process queue this client's routing left full, if any: the connection must
    /// not read more until it has room.
    pub fn pop_blocked(&mut self) -> Option<Arc<InQueue>> {
        self.blocked.pop()
    }

    /// The congested subscriber seen since the last call, if any.
    pub fn take_congested(&mut self) -> Option<Arc<ClientHandle>> {
        self.congested.take()
    }

    /// Does anyone in the router's account subscribe to `subject`, or does it leave the
    /// account through an import or export (a pending reply route, for `_R_.` subjects)?
    pub fn has_interest(&mut self, _server: &Server, subject: &[u8]) -> bool {
        let r = self.cache.lookup(&self.account.sublist, subject);
        !r.psubs.is_empty()
            || !r.qsubs.is_empty()
            || r.forwards.iter().any(|f| match f {
                Forward::Responses => self.account.has_response(subject),
                _ => true,
            })
    }

    /// Remembers that `h` has data queued and its writer must be woken at the batch end.
    pub fn needs_signal(&mut self, h: &Arc<ClientHandle>) {
        self.to_signal.push(h.clone());
    }

    /// Wakes the writers of everyone who received something since the last call.
    pub fn flush(&mut self) {
        for h in self.to_signal.drain(..) {
            h.signal();
        }
        for q in self.to_wake.drain(..) {
            q.wake();
        }
    }

    fn next_rand(&mut self) -> u64 {
        // xorshift64*: queue member choice needs to be cheap and fair, not secure.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

const JS_ACK: &[u8] = b"$JS.ACK.";

fn is_js_ack(reply: &[u8]) -> bool {
    reply.starts_with(JS_ACK)
}

/// Where the `@` of a `$JS.ACK.<8 tokens>@<subject>` reply is (the reference's encoding of
/// a JetStream delivery's subject across a route): the first `@` after the eighth dot.
fn js_ack_deliver(reply: &[u8]) -> Option<usize> {
    if !is_js_ack(reply) {
        return None;
    }
    let mut dots = 0;
    for (i, &b) in reply.iter().enumerate() {
        match b {
            b'.' => dots += 1,
            b'@' if dots >= 8 => return (i + 1 < reply.len()).then_some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn js_ack_subjects_across_routes() {
        let r = b"$JS.ACK.S.C.1.2.3.1700000000.0@orders.eu";
        let at = js_ack_deliver(r).unwrap();
        assert_eq!(&r[at + 1..], b"orders.eu");
        assert_eq!(js_ack_deliver(b"$JS.ACK.S.C.1.2.3.4.0"), None);
        assert_eq!(
            js_ack_deliver(b"$JS.ACK.S@x.C.1.2.3.4.0"),
            None,
            "@ in a token"
        );
        assert_eq!(js_ack_deliver(b"_INBOX.a@b"), None);
    }
}
