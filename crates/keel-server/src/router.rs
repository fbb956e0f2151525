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
    /// Match caches for the accounts this router's messages cross into (imports/exports).
    others: Vec<(Arc<Account>, MatchCache)>,
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
        let mut delivered = self.deliver_all(server, &result, msg, skip);
        if !result.forwards.is_empty() {
            let from = self.account.clone();
            delivered |= self.forward(server, &from, &result, target, msg, 1);
        }
        delivered
    }

    /// Delivers to the subscriptions of one match result (one member per queue group).
    fn deliver_all(
        &mut self,
        server: &Server,
        result: &MatchResult,
        msg: &Outgoing,
        skip: Option<u64>,
    ) -> bool {
        let mut delivered = false;
        for sub in &result.psubs {
            if skip == Some(sub.client.id) {
                continue;
            }
            delivered |= self.deliver(server, sub, msg);
        }
        for group in &result.qsubs {
            // Start at a random member; fall through to the next if one cannot take it.
            let start = self.next_rand() as usize % group.len();
            for i in 0..group.len() {
                let sub = &group[(start + i) % group.len()];
                if skip == Some(sub.client.id) {
                    continue;
                }
                if self.deliver(server, sub, msg) {
                    delivered = true;
                    break;
                }
            }
        }
        delivered
    }

    /// Routes `msg` (matched on `target` in `from`) through the imports and exports its
    /// match fell under. A message whose subject is its target is renamed with it; a
    /// delivery to an inbox (JetStream's) keeps its stored subject.
    fn forward(
        &mut self,
        server: &Server,
        from: &Arc<Account>,
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
            delivered |= self.deliver_all(server, &result, &out, None);
            if !result.forwards.is_empty() {
                delivered |= self.forward(server, &to, &result, &new_target, &out, hops + 1);
            }
        }
        delivered
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
