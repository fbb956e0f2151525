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
//!
//! A subscriber in an account that imports a stream also makes interest in the exporter's
//! account (the reference's shadow subscription): a peer then sends the exporter's messages
//! in the exporter's account, and this server follows the import to its own subscribers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use bytes::{Bytes, BytesMut};
use keel_protocol::route::encode;

use super::Route;
use crate::sublist::{Sub, SubHook};

type Key = (Bytes, Option<Bytes>);

pub(crate) struct AccountInterest {
    pub(crate) account: String,
    state: Mutex<State>,
    /// The streams this account imports (replaced whole when the links are).
    imports: RwLock<Arc<Vec<StreamImport>>>,
}

/// A stream this account imports: the exporter's interest, the exporter's subject pattern,
/// and how the import renames it here.
pub(crate) struct StreamImport {
    pub(crate) exporter: Arc<AccountInterest>,
    pub(crate) pattern: Bytes,
    pub(crate) rename: Rename,
}

pub(crate) enum Rename {
    Same,
    Prefix(Bytes),
    /// A mapping with wildcards: the whole exported pattern is asked for.
    Other,
}

#[derive(Default)]
struct State {
    counts: HashMap<Key, u32>,
    routes: Vec<Arc<Route>>,
    /// The interest each local subscription made in exporters' accounts (by the
    /// subscription's address), to take back when it goes.
    shadows: HashMap<usize, Vec<(Arc<AccountInterest>, Key)>>,
    /// Local subscriptions not counted (withdrawn) though still in the index, by address,
    /// with how many withdrawals hold them out (hand-overs may overlap: a stepdown during
    /// lame duck): their removal is not counted down again.
    withdrawn: HashMap<usize, u32>,
}

impl AccountInterest {
    pub(crate) fn new(account: String) -> Arc<Self> {
        Arc::new(AccountInterest {
            account,
            state: Mutex::new(State::default()),
            imports: RwLock::new(Arc::new(Vec::new())),
        })
    }

    /// Replaces the streams this account imports (for subscriptions made from now on).
    pub(crate) fn set_imports(&self, imports: Vec<StreamImport>) {
        *self.imports.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(imports);
    }

    /// What a subscription on `subject` here asks of each exporter it imports from.
    fn shadows_of(
        &self,
        subject: &[u8],
        queue: &Option<Bytes>,
    ) -> Vec<(Arc<AccountInterest>, Key)> {
        let imports = self
            .imports
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut out = Vec::new();
        for imp in imports.iter() {
            let there = match &imp.rename {
                Rename::Same => shadow(subject, &imp.pattern),
                Rename::Prefix(p) => match subject
                    .strip_prefix(&p[..])
                    .and_then(|r| r.strip_prefix(b"."))
                {
                    Some(rest) => shadow(rest, &imp.pattern),
                    // `>` or `*.…` above the prefix: all of the export, if it overlaps.
                    None => overlap(subject, &[&p[..], b".", &imp.pattern[..]].concat())
                        .then(|| imp.pattern.clone()),
                },
                Rename::Other => Some(imp.pattern.clone()),
            };
            if let Some(t) = there {
                out.push((imp.exporter.clone(), (t, queue.clone())));
            }
        }
        out
    }

    fn count_up(&self, key: &Key) {
        self.count_up_locked(&mut self.lock(), key);
    }

    fn count_up_locked(&self, st: &mut State, key: &Key) {
        let n = st.counts.entry(key.clone()).or_insert(0);
        *n += 1;
        let n = *n;
        if key.1.is_some() || n == 1 {
            self.tell(st, &key.0, key.1.as_deref(), n);
        }
    }

    fn count_down(&self, key: &Key) {
        self.count_down_locked(&mut self.lock(), key);
    }

    fn count_down_locked(&self, st: &mut State, key: &Key) {
        let Some(n) = st.counts.get_mut(key) else {
            return;
        };
        *n -= 1;
        let n = *n;
        if n == 0 {
            st.counts.remove(key);
        }
        if key.1.is_some() || n == 0 {
            self.tell(st, &key.0, key.1.as_deref(), n);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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
        route.send_untraced(&b);
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
        if !super::serves_peers(sub) {
            return;
        }
        let shadows = self.shadows_of(&sub.subject, &sub.queue);
        {
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
            if !shadows.is_empty() {
                st.shadows
                    .insert(Arc::as_ptr(sub) as usize, shadows.clone());
            }
        }
        // Outside this account's lock: two accounts may import from each other.
        for (exporter, key) in &shadows {
            exporter.count_up(key);
        }
    }

    fn announce(&self, subject: &Bytes) {
        let mut st = self.lock();
        let n = st.counts.entry((subject.clone(), None)).or_insert(0);
        *n += 1;
        if *n == 1 {
            self.tell(&st, subject, None, 1);
        }
    }

    fn removed(&self, sub: &Arc<Sub>) {
        if !super::serves_peers(sub) {
            return;
        }
        let at = Arc::as_ptr(sub) as usize;
        let shadows = {
            let mut st = self.lock();
            let shadows = st.shadows.remove(&at);
            if st.withdrawn.remove(&at).is_some() {
                return; // Counted down when withdrawn, its shadows too.
            }
            self.count_down_locked(&mut st, &(sub.subject.clone(), sub.queue.clone()));
            shadows
        };
        for (exporter, key) in shadows.iter().flatten() {
            exporter.count_down(key);
        }
    }

    fn withdraw(&self, sub: &Arc<Sub>) {
        if !super::serves_peers(sub) {
            return;
        }
        let shadows = {
            let mut st = self.lock();
            let at = Arc::as_ptr(sub) as usize;
            let n = st.withdrawn.entry(at).or_insert(0);
            *n += 1;
            if *n > 1 {
                return;
            }
            self.count_down_locked(&mut st, &(sub.subject.clone(), sub.queue.clone()));
            st.shadows.get(&at).cloned()
        };
        // The interest it made in exporters' accounts goes too (outside this account's
        // lock, as in `added`): their messages would be routed here as well.
        for (exporter, key) in shadows.iter().flatten() {
            exporter.count_down(key);
        }
    }

    fn restore(&self, sub: &Arc<Sub>) {
        if !super::serves_peers(sub) {
            return;
        }
        let shadows = {
            let mut st = self.lock();
            let at = Arc::as_ptr(sub) as usize;
            let Some(n) = st.withdrawn.get_mut(&at) else {
                return;
            };
            *n -= 1;
            if *n > 0 {
                return;
            }
            st.withdrawn.remove(&at);
            self.count_up_locked(&mut st, &(sub.subject.clone(), sub.queue.clone()));
            st.shadows.get(&at).cloned()
        };
        for (exporter, key) in shadows.iter().flatten() {
            exporter.count_up(key);
        }
    }
}

/// The interest in the exporter's account that a subscription on `sub` makes through an
/// import of `pattern`: the subscription's own subject where it lies within the pattern, the
/// pattern where it is wider, nothing where they do not meet.
fn shadow(sub: &[u8], pattern: &[u8]) -> Option<Bytes> {
    if subset(sub, pattern) {
        Some(Bytes::copy_from_slice(sub))
    } else if overlap(sub, pattern) {
        Some(Bytes::copy_from_slice(pattern))
    } else {
        None
    }
}

/// Whether every subject `a` matches is matched by `b`.
fn subset(a: &[u8], b: &[u8]) -> bool {
    let (mut ta, mut tb) = (a.split(|c| *c == b'.'), b.split(|c| *c == b'.'));
    loop {
        match (ta.next(), tb.next()) {
            (None, None) => return true,
            // `>` stands for one token or more.
            (Some(_), Some(b">")) => return true,
            (Some(b">"), _) | (None, _) | (_, None) => return false,
            (Some(x), Some(b"*")) if x != b">" => {}
            (Some(x), Some(y)) if x == y && x != b"*" => {}
            _ => return false,
        }
    }
}

/// Whether some subject is matched by both `a` and `b`.
fn overlap(a: &[u8], b: &[u8]) -> bool {
    let (mut ta, mut tb) = (a.split(|c| *c == b'.'), b.split(|c| *c == b'.'));
    loop {
        match (ta.next(), tb.next()) {
            (None, None) => return true,
            (Some(b">"), Some(_)) | (Some(_), Some(b">")) => return true,
            (None, _) | (_, None) => return false,
            (Some(x), Some(y)) if x == y || x == b"*" || y == b"*" => {}
            _ => return false,
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

    /// A withdrawn subscription is no interest of the peers while it stays in the index:
    /// its removal then tells them nothing; restored as often as withdrawn, it counts
    /// again; another local subscriber on the subject keeps the interest up.
    #[test]
    fn a_withdrawn_subscription_is_not_told_twice() {
        let server = Server::new(Opts::default(), Log::capture(Default::default()));
        let acc = server.accounts.global().clone();
        let hook = AccountInterest::new(acc.name.clone());
        assert!(acc.sublist.set_hook(hook.clone()));
        let peer = ClientHandle::for_route(&server, 100, 1 << 20, Arc::new(AtomicU64::new(0)));
        let route = Arc::new(Route::new(100, peer.clone(), None, &Origin::Accepted));
        hook.attach(&route);
        let client = ClientHandle::detached(1);
        let (a, b) = (
            sub(&client, "orders.>", None),
            sub(&client, "orders.>", None),
        );
        acc.sublist.insert(a.clone());
        assert_eq!(peer.take_outbound(), "RS+ $G orders.>\r\n");
        acc.sublist.withdraw_from_peers(&a);
        acc.sublist.withdraw_from_peers(&a);
        assert_eq!(peer.take_outbound(), "RS- $G orders.>\r\n", "once");
        assert_eq!(
            acc.sublist.matches(b"orders.1").psubs.len(),
            1,
            "still local"
        );
        // Two withdrawals (overlapping hand-overs): back only once both are undone.
        acc.sublist.restore_to_peers(&a);
        assert_eq!(peer.take_outbound(), "", "the other withdrawal holds");
        acc.sublist.restore_to_peers(&a);
        acc.sublist.restore_to_peers(&a);
        assert_eq!(peer.take_outbound(), "RS+ $G orders.>\r\n", "once");
        acc.sublist.withdraw_from_peers(&a);
        assert_eq!(peer.take_outbound(), "RS- $G orders.>\r\n");
        acc.sublist.remove(&a);
        assert_eq!(peer.take_outbound(), "", "told already");
        // Withdrawn beside another subscriber: the interest stays, and goes with the other.
        acc.sublist.insert(a.clone());
        acc.sublist.insert(b.clone());
        assert_eq!(peer.take_outbound(), "RS+ $G orders.>\r\n");
        acc.sublist.withdraw_from_peers(&a);
        assert_eq!(peer.take_outbound(), "");
        acc.sublist.remove(&b);
        assert_eq!(peer.take_outbound(), "RS- $G orders.>\r\n");
        acc.sublist.remove(&a);
        assert_eq!(peer.take_outbound(), "");
    }

    /// What a subscription in an importer asks of the exporter (the reference's shadow
    /// subscription subjects).
    #[test]
    fn shadow_subjects_of_an_import() {
        let b = |s: &str| Some(Bytes::from(s.to_string()));
        assert_eq!(shadow(b"feed.1", b"feed.>"), b("feed.1"));
        assert_eq!(shadow(b"feed.*", b"feed.>"), b("feed.*"));
        assert_eq!(shadow(b">", b"feed.>"), b("feed.>"));
        assert_eq!(shadow(b"*.1", b"feed.>"), b("feed.>"));
        assert_eq!(shadow(b"feed", b"feed.>"), None);
        assert_eq!(shadow(b"other.1", b"feed.>"), None);
        assert_eq!(shadow(b"a.b", b"a.*"), b("a.b"));
        assert_eq!(shadow(b"a.>", b"a.*"), b("a.*"));
        assert_eq!(shadow(b"a.b.c", b"a.*"), None);
        assert!(subset(b"a.*.c", b"a.>") && !subset(b"a.>", b"a.*.c"));
        assert!(overlap(b"a.*.c", b"*.b.>") && !overlap(b"a.b", b"a.b.c"));
    }

    /// A subscriber of an importer makes interest in the exporter's account, and takes it
    /// back when it goes.
    #[test]
    fn an_import_makes_interest_in_the_exporter() {
        let server = Server::new(Opts::default(), Log::capture(Default::default()));
        let (a, b) = (
            AccountInterest::new("A".into()),
            AccountInterest::new("B".into()),
        );
        b.set_imports(vec![
            StreamImport {
                exporter: a.clone(),
                pattern: Bytes::from_static(b"feed.>"),
                rename: Rename::Same,
            },
            StreamImport {
                exporter: a.clone(),
                pattern: Bytes::from_static(b"news.>"),
                rename: Rename::Prefix(Bytes::from_static(b"in")),
            },
        ]);
        let peer = ClientHandle::for_route(&server, 100, 1 << 20, Arc::new(AtomicU64::new(0)));
        let route = Arc::new(Route::new(100, peer.clone(), None, &Origin::Accepted));
        a.attach(&route);
        b.attach(&route);
        let client = ClientHandle::detached(1);
        let s1 = sub(&client, "feed.1", None);
        let s2 = sub(&client, "in.news.x", None);
        b.added(&s1);
        b.added(&s2);
        assert_eq!(
            peer.take_outbound(),
            "RS+ B feed.1\r\nRS+ A feed.1\r\nRS+ B in.news.x\r\nRS+ A news.x\r\n"
        );
        b.removed(&s1);
        assert_eq!(peer.take_outbound(), "RS- B feed.1\r\nRS- A feed.1\r\n");
        // Withdrawn (a stream's leader handing over), its interest in the exporter goes
        // too, and comes back with it; removed while withdrawn, nothing more is told.
        b.withdraw(&s2);
        assert_eq!(peer.take_outbound(), "RS- B in.news.x\r\nRS- A news.x\r\n");
        b.restore(&s2);
        assert_eq!(peer.take_outbound(), "RS+ B in.news.x\r\nRS+ A news.x\r\n");
        b.withdraw(&s2);
        assert_eq!(peer.take_outbound(), "RS- B in.news.x\r\nRS- A news.x\r\n");
        b.removed(&s2);
        assert_eq!(peer.take_outbound(), "");
    }
}
