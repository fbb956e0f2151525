//! This server's interest in one account, as its route peers are told it.
//!
//! A [`SubHook`] on the account's sublist counts the local subscribers of each subject and
//! queue group (clients only: a route's subscriptions are the peer's interest, and
//! JetStream's in-process ones stay on this server while JetStream is not clustered). A
//! plain subject is announced when its count goes 0 -> 1 (`RS+ <acc> <subject>`) and
//! withdrawn at 1 -> 0 (`RS-`); a queue group is announced on every change with its member
//! count as the weight (`RS+ <acc> <subject> <queue> <n>`), and withdrawn at 0 (the
//! reference's rules, so a peer picks this server in proportion to its members).
//!
//! The counts and the list of routes to tell share one lock, so a route that registers gets
//! a snapshot of the counts and every change after it, in order, none twice or missing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use keel_protocol::route::encode;

use super::Route;
use crate::sublist::{Sub, SubHook};

type Key = (Bytes, Option<Bytes>);

pub(crate) struct AccountInterest {
    account: String,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    counts: HashMap<Key, u32>,
    routes: Vec<Arc<Route>>,
}

impl AccountInterest {
    pub(crate) fn new(account: String) -> Arc<Self> {
        Arc::new(AccountInterest {
            account,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a subscription is this server's own interest, to tell peers about.
    fn local(sub: &Sub) -> bool {
        !sub.client.is_route() && sub.client.internal_queue().is_none()
    }

    /// A newly registered route: it gets everything counted so far, then every change.
    pub(crate) fn attach(&self, route: &Arc<Route>) {
        let mut st = self.lock();
        st.routes.push(route.clone());
        if st.counts.is_empty() {
            return;
        }
        let mut b = BytesMut::new();
        let acc = Some(self.account.as_bytes());
        for ((subject, queue), n) in &st.counts {
            encode::rs_sub(&mut b, acc, subject, queue.as_deref().map(|q| (q, *n)));
        }
        // Under the lock: a change right after must reach the peer after the snapshot.
        route.send(&b);
    }

    pub(crate) fn detach(&self, route: &Arc<Route>) {
        self.lock().routes.retain(|r| !Arc::ptr_eq(r, route));
    }

    fn tell(&self, st: &State, subject: &[u8], queue: Option<&[u8]>, n: u32) {
        if st.routes.is_empty() {
            return;
        }
        let mut b = BytesMut::with_capacity(subject.len() + self.account.len() + 32);
        let acc = Some(self.account.as_bytes());
        match (queue, n) {
            (q, 0) => encode::rs_unsub(&mut b, acc, subject, q),
            (q, n) => encode::rs_sub(&mut b, acc, subject, q.map(|q| (q, n))),
        }
        for r in &st.routes {
            r.send(&b);
        }
    }
}

impl SubHook for AccountInterest {
    fn added(&self, sub: &Arc<Sub>) {
        if !Self::local(sub) {
            return;
        }
        let mut st = self.lock();
        let n = st
            .counts
            .entry((sub.subject.clone(), sub.queue.clone()))
            .or_insert(0);
        *n += 1;
        let n = *n;
        if sub.queue.is_some() || n == 1 {
            self.tell(&st, &sub.subject, sub.queue.as_deref(), n);
        }
    }

    fn removed(&self, sub: &Arc<Sub>) {
        if !Self::local(sub) {
            return;
        }
        let mut st = self.lock();
        let key = (sub.subject.clone(), sub.queue.clone());
        let Some(n) = st.counts.get_mut(&key) else {
            return;
        };
        *n -= 1;
        let n = *n;
        if n == 0 {
            st.counts.remove(&key);
        }
        if sub.queue.is_some() || n == 0 {
            self.tell(&st, &sub.subject, sub.queue.as_deref(), n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ClientHandle;
    use crate::config::Opts;
    use crate::log::Log;
    use crate::route::Origin;
    use crate::server::Server;
    use std::sync::atomic::AtomicU64;

    fn sub(client: &Arc<ClientHandle>, subject: &str, queue: Option<&str>) -> Arc<Sub> {
        Arc::new(Sub {
            client: client.clone(),
            sid: Bytes::from_static(b"1"),
            subject: Bytes::copy_from_slice(subject.as_bytes()),
            queue: queue.map(|q| Bytes::copy_from_slice(q.as_bytes())),
            max: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        })
    }

    /// The reference's rules: plain interest at 0 -> 1 and 1 -> 0, a queue group's member
    /// count on every change; a route that registers later gets the counts so far; the
    /// peers' own subscriptions and JetStream's are not this server's interest to tell.
    #[test]
    fn peers_hear_what_the_reference_would_send() {
        let server = Server::new(Opts::default(), Log::capture(Default::default()));
        let acc = server.accounts.global().clone();
        let hook = AccountInterest::new(acc.name.clone());
        assert!(acc.sublist.set_hook(hook.clone()));
        let slow = Arc::new(AtomicU64::new(0));
        let peer = ClientHandle::for_route(&server, 100, 1 << 20, slow.clone());
        let route = Arc::new(Route::new(100, peer.clone(), None, &Origin::Accepted));
        hook.attach(&route);
        let client = ClientHandle::detached(1);
        let (p1, p2) = (sub(&client, "foo", None), sub(&client, "foo", None));
        let (q1, q2) = (sub(&client, "w", Some("g")), sub(&client, "w", Some("g")));
        for s in [&p1, &p2, &q1, &q2] {
            acc.sublist.insert(s.clone());
        }
        assert_eq!(
            peer.take_outbound(),
            "RS+ $G foo\r\nRS+ $G w g 1\r\nRS+ $G w g 2\r\n"
        );
        // A route's subscription (the peer's own interest) and JetStream's are not told.
        acc.sublist.insert_remote(sub(&peer, "theirs", None), 1);
        let (internal, _rx) = ClientHandle::internal(&server, &acc, "js".into(), 1024);
        acc.sublist.insert(sub(&internal, "$JS.API.>", None));
        assert_eq!(peer.take_outbound(), "");
        // A second route registers: it gets the counts so far in one go.
        let peer2 = ClientHandle::for_route(&server, 101, 1 << 20, slow);
        let route2 = Arc::new(Route::new(101, peer2.clone(), None, &Origin::Accepted));
        hook.attach(&route2);
        let mut got: Vec<String> = peer2.take_outbound().lines().map(String::from).collect();
        got.sort();
        assert_eq!(got, ["RS+ $G foo", "RS+ $G w g 2"]);
        for s in [&p1, &q1] {
            acc.sublist.remove(s);
        }
        assert_eq!(peer.take_outbound(), "RS+ $G w g 1\r\n");
        hook.detach(&route2);
        for s in [&p2, &q2] {
            acc.sublist.remove(s);
        }
        assert_eq!(peer.take_outbound(), "RS- $G foo\r\nRS- $G w g\r\n");
        assert_eq!(peer2.take_outbound(), "RS+ $G w g 1\r\n", "detached before");
    }
}
