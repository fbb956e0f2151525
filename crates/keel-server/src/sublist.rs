//! The subject index: a trie over `.`-separated tokens with `*` and `>` branches.
//!
//! Publishing looks up a literal subject; results are cached by each connection (see
//! [`MatchCache`]) and the trie's generation counter tells caches when a SUB or UNSUB
//! anywhere may have changed an answer, so the common publish takes no lock at all.

use bytes::Bytes;
/// Keyed by subjects and their tokens, which clients choose (see Cargo.toml for the hasher).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::account::Account;
use crate::auth::conf::ResponseType;
use crate::client::ClientHandle;

/// One subscription: whose, under which sid, on what subject, in which queue group.
pub struct Sub {
    pub client: Arc<ClientHandle>,
    pub sid: Bytes,
    pub subject: Bytes,
    pub queue: Option<Bytes>,
    /// Auto-unsubscribe after this many deliveries (`UNSUB <sid> <max>`); 0 means never.
    pub max: AtomicU64,
    pub delivered: AtomicU64,
}

impl Sub {
    /// A plain subscription of an in-process client (no queue, no auto-unsubscribe).
    pub fn internal(client: &Arc<ClientHandle>, sid: Bytes, subject: Bytes) -> Arc<Sub> {
        Arc::new(Sub {
            client: client.clone(),
            sid,
            subject,
            queue: None,
            max: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        })
    }
}

/// What a literal subject matches: plain subscriptions, one list per queue group (a
/// message goes to one member of each group), and where it crosses into other accounts.
#[derive(Default)]
pub struct MatchResult {
    pub psubs: Vec<Arc<Sub>>,
    pub qsubs: Vec<Vec<Arc<Sub>>>,
    /// Imports and exports the subject falls under (see [`Link`]).
    pub forwards: Vec<Forward>,
}

impl MatchResult {
    pub fn is_empty(&self) -> bool {
        self.psubs.is_empty() && self.qsubs.is_empty() && self.forwards.is_empty()
    }
}

/// A way out of an account, installed from its imports and exports (`account::install_links`):
/// a message published here on a subject matching `pattern` is also routed in `to`.
pub struct Link {
    pub pattern: Bytes,
    pub kind: LinkKind,
}

pub enum LinkKind {
    /// A stream this account exports and `to` imports: a copy goes there, on `map(subject)`.
    Stream { to: Arc<Account>, map: SubjectMap },
    /// A service this account imports from `to`: the request goes there on `map(subject)`,
    /// its reply subject replaced by one that leads back here.
    Service {
        to: Arc<Account>,
        map: SubjectMap,
        response: ResponseType,
        threshold: std::time::Duration,
    },
    /// Replies of the services this account exports (`_R_.>`): looked up in the account's
    /// table of pending responses and routed back to the requester's account.
    Responses,
}

/// How an import renames subjects.
pub enum SubjectMap {
    Same,
    /// `prefix.<subject>` (stream imports with `prefix`).
    Prefix(String),
    /// Wildcard positions carried over (`to`, or a service imported under another name).
    Transform(Box<crate::jetstream::transform::Transform>),
}

impl SubjectMap {
    pub fn apply(&self, subject: &[u8]) -> Option<Bytes> {
        match self {
            SubjectMap::Same => Some(Bytes::copy_from_slice(subject)),
            SubjectMap::Prefix(p) => {
                let mut b = Vec::with_capacity(p.len() + 1 + subject.len());
                b.extend_from_slice(p.as_bytes());
                b.push(b'.');
                b.extend_from_slice(subject);
                Some(Bytes::from(b))
            }
            SubjectMap::Transform(t) => {
                t.apply(std::str::from_utf8(subject).ok()?).map(Bytes::from)
            }
        }
    }
}

/// One link a subject matched, with the subject it has in the other account.
pub enum Forward {
    Stream {
        to: Arc<Account>,
        subject: Bytes,
    },
    Service {
        to: Arc<Account>,
        subject: Bytes,
        response: ResponseType,
        threshold: std::time::Duration,
    },
    Responses,
}

#[derive(Default)]
struct Node {
    next: Option<Box<Level>>,
    psubs: Vec<Arc<Sub>>,
    /// Each group's members with their weight: 1 for a local subscriber; a route's queue
    /// subscription stands for the peer's members and is listed that many times in match
    /// results, so a publisher picks the peer in proportion (as the reference).
    qsubs: Vec<(Bytes, Members)>,
}

/// A queue group's members in one node, each with its weight.
type Members = Vec<(Arc<Sub>, u32)>;

/// Most times one route's queue subscription is listed in a match result. A peer's
/// weight is its member count; past this the peer is picked as if it had this many (it
/// bounds what a peer's number can make a match result cost).
pub const MAX_QUEUE_WEIGHT: u32 = 1024;

/// Told about every subscription entering or leaving a sublist, after the change. Cluster
/// routes use it to keep the account's interest known to the peers (`route::interest`).
pub trait SubHook: Send + Sync {
    fn added(&self, sub: &Arc<Sub>);
    fn removed(&self, sub: &Arc<Sub>);
    /// Interest this server keeps for as long as it runs without a subscription (the
    /// replies of the service imports it routed).
    fn announce(&self, _subject: &Bytes) {}
    /// `sub` (in the index) stops counting as interest to the peers, though it still gets
    /// what reaches this server; its removal then tells them nothing more.
    fn withdraw(&self, _sub: &Arc<Sub>) {}
    /// Undoes `withdraw` for `sub` (still in the index).
    fn restore(&self, _sub: &Arc<Sub>) {}
}

impl Node {
    fn is_empty(&self) -> bool {
        self.psubs.is_empty() && self.qsubs.is_empty() && self.next.is_none()
    }
}

#[derive(Default)]
struct Level {
    literal: HashMap<Bytes, Node>,
    pwc: Option<Box<Node>>,
    fwc: Option<Box<Node>>,
}

impl Level {
    fn is_empty(&self) -> bool {
        self.literal.is_empty() && self.pwc.is_none() && self.fwc.is_none()
    }
}

#[derive(Default)]
pub struct Sublist {
    root: RwLock<Level>,
    generation: AtomicU64,
    count: AtomicUsize,
    inserts: AtomicU64,
    removes: AtomicU64,
    /// Trie lookups (match-cache misses); cache hits never reach the trie.
    matches: AtomicU64,
    /// Wakes tasks waiting for a new subscription (unbound push consumers); only touched on
    /// insert while someone waits, so SUB stays as cheap as before otherwise.
    inserted: tokio::sync::Notify,
    insert_waiters: AtomicUsize,
    /// The connections' match caches (for `/subsz`), and what the dropped ones counted.
    caches: std::sync::Mutex<CacheRegistry>,
    /// Installed once, before the first subscription, when the server is in a cluster.
    hook: std::sync::OnceLock<Arc<dyn SubHook>>,
    /// Imports and exports (read on cache misses only; replaced as a whole).
    links: RwLock<Arc<Vec<Link>>>,
}

#[derive(Default)]
struct CacheRegistry {
    live: Vec<Arc<CacheCounters>>,
    prune_at: usize,
    retired_hits: u64,
}

impl CacheRegistry {
    /// Folds the caches that were dropped (only the registry holds them) into the totals.
    fn prune(&mut self) {
        let mut hits = 0;
        self.live.retain(|c| {
            let gone = Arc::strong_count(c) == 1;
            if gone {
                hits += c.hits.load(Ordering::Relaxed);
            }
            !gone
        });
        self.retired_hits += hits;
        self.prune_at = (self.live.len() * 2).max(64);
    }
}

/// One match cache's figures. Only its owner writes them (plain load-then-store, no locked
/// instruction on the publish path); `/subsz` sums them.
#[derive(Default)]
pub struct CacheCounters {
    hits: AtomicU64,
    entries: AtomicU64,
    fanout_sum: AtomicU64,
    max_fanout: AtomicU64,
}

impl CacheCounters {
    fn bump(a: &AtomicU64, by: u64) {
        a.store(a.load(Ordering::Relaxed) + by, Ordering::Relaxed);
    }

    fn clear(&self) {
        for a in [&self.entries, &self.fanout_sum, &self.max_fanout] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// The match caches' figures, as `/subsz` reports the reference's cache.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheStats {
    /// Lookups answered from a cache.
    pub hits: u64,
    /// Results held in caches now.
    pub entries: u64,
    /// Largest fan-out (plain subscriptions plus queue groups) among them.
    pub max_fanout: u64,
    /// Mean fan-out among them.
    pub avg_fanout: f64,
}

/// Counters for `/subsz`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SublistStats {
    pub inserts: u64,
    pub removes: u64,
    pub matches: u64,
}

impl Sublist {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bumped by every change; a cache filled under an older generation is stale.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Installs the hook told about every later insert and remove; false if one is set.
    pub fn set_hook(&self, hook: Arc<dyn SubHook>) -> bool {
        self.hook.set(hook).is_ok()
    }

    /// Adds `sub`; its subject must already be valid for subscribing.
    pub fn insert(&self, sub: Arc<Sub>) {
        let hook = self.hook.get().map(|_| sub.clone());
        self.insert_weighted(sub, 1);
        if let (Some(h), Some(sub)) = (self.hook.get(), hook) {
            h.added(&sub);
        }
    }

    /// Tells the hook, if any, of lasting interest in `subject` (see [`SubHook::announce`]).
    pub fn announce(&self, subject: &Bytes) {
        if let Some(h) = self.hook.get() {
            h.announce(subject);
        }
    }

    /// Tells the hook that `sub`, which stays in the index, is no interest of the peers any
    /// more (see [`SubHook::withdraw`]). The caller keeps `sub` from being removed meanwhile.
    pub fn withdraw_from_peers(&self, sub: &Arc<Sub>) {
        if let Some(h) = self.hook.get() {
            h.withdraw(sub);
        }
    }

    /// Undoes [`Sublist::withdraw_from_peers`].
    pub fn restore_to_peers(&self, sub: &Arc<Sub>) {
        if let Some(h) = self.hook.get() {
            h.restore(sub);
        }
    }

    /// Adds a route's subscription; a queue subscription counts `weight` times (capped at
    /// [`MAX_QUEUE_WEIGHT`]). The hook is not told: it is about local interest.
    pub fn insert_remote(&self, sub: Arc<Sub>, weight: u32) {
        self.insert_weighted(sub, weight);
    }

    /// A route's queue subscription changed weight (the peer's member count changed).
    pub fn set_weight(&self, sub: &Arc<Sub>, weight: u32) {
        let Some(q) = &sub.queue else { return };
        let mut root = self.root.write().unwrap_or_else(|e| e.into_inner());
        let tokens: Vec<&[u8]> = sub.subject.split(|&b| b == b'.').collect();
        let mut level: &mut Level = &mut root;
        for (i, tok) in tokens.iter().enumerate() {
            let node = match *tok {
                b"*" => level.pwc.as_deref_mut(),
                b">" => level.fwc.as_deref_mut(),
                t => level.literal.get_mut(t),
            };
            let Some(node) = node else { return };
            if i + 1 == tokens.len() {
                let member = node
                    .qsubs
                    .iter_mut()
                    .find(|(name, _)| name == q)
                    .and_then(|(_, m)| m.iter_mut().find(|(s, _)| Arc::ptr_eq(s, sub)));
                if let Some((_, w)) = member {
                    *w = weight.clamp(1, MAX_QUEUE_WEIGHT);
                    self.generation.fetch_add(1, Ordering::Release);
                }
                return;
            }
            match node.next.as_deref_mut() {
                Some(next) => level = next,
                None => return,
            }
        }
    }

    fn insert_weighted(&self, sub: Arc<Sub>, weight: u32) {
        let weight = weight.clamp(1, MAX_QUEUE_WEIGHT);
        let mut root = self.root.write().unwrap_or_else(|e| e.into_inner());
        let mut level: &mut Level = &mut root;
        let mut tokens = sub.subject.split(|&b| b == b'.').peekable();
        let subject = sub.subject.clone();
        let mut start = 0;
        loop {
            let tok = tokens.next().expect("valid subjects have a token");
            let end = start + tok.len();
            let node: &mut Node = match tok {
                b"*" => level.pwc.get_or_insert_with(Default::default),
                b">" => level.fwc.get_or_insert_with(Default::default),
                _ => level.literal.entry(subject.slice(start..end)).or_default(),
            };
            start = end + 1;
            if tokens.peek().is_none() {
                match &sub.queue {
                    None => node.psubs.push(sub),
                    Some(q) => match node.qsubs.iter_mut().find(|(name, _)| name == q) {
                        Some((_, members)) => members.push((sub, weight)),
                        None => node.qsubs.push((q.clone(), vec![(sub, weight)])),
                    },
                }
                break;
            }
            level = node.next.get_or_insert_with(Default::default);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.inserts.fetch_add(1, Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::Release);
        drop(root);
        if self.insert_waiters.load(Ordering::Acquire) > 0 {
            self.inserted.notify_waiters();
        }
    }

    /// Completes after the next insert (never, with `since` None). `since` is the generation
    /// the caller last looked at, so a change since then returns at once instead of being
    /// missed.
    pub async fn subscribed(&self, since: Option<u64>) {
        let Some(generation) = since else {
            return std::future::pending().await;
        };
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let notified = self.inserted.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let _w = Waiting(&self.insert_waiters);
        self.insert_waiters.fetch_add(1, Ordering::AcqRel);
        if self.generation() != generation {
            return;
        }
        notified.await;
    }

    fn register(&self, c: &Arc<CacheCounters>) {
        let mut reg = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        if reg.live.len() >= reg.prune_at {
            reg.prune();
        }
        reg.live.push(c.clone());
    }

    /// The match caches' figures now.
    pub fn cache_stats(&self) -> CacheStats {
        let mut reg = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        reg.prune();
        let mut st = CacheStats {
            hits: reg.retired_hits,
            ..Default::default()
        };
        let mut fanout_sum = 0;
        for c in &reg.live {
            st.hits += c.hits.load(Ordering::Relaxed);
            st.entries += c.entries.load(Ordering::Relaxed);
            fanout_sum += c.fanout_sum.load(Ordering::Relaxed);
            st.max_fanout = st.max_fanout.max(c.max_fanout.load(Ordering::Relaxed));
        }
        if st.entries > 0 {
            st.avg_fanout = fanout_sum as f64 / st.entries as f64;
        }
        st
    }

    pub fn stats(&self) -> SublistStats {
        SublistStats {
            inserts: self.inserts.load(Ordering::Relaxed),
            removes: self.removes.load(Ordering::Relaxed),
            matches: self.matches.load(Ordering::Relaxed),
        }
    }

    /// Removes `sub` (by identity). Returns false if it was not there. Empty branches are
    /// pruned so churning subjects (inboxes) do not leave dead nodes behind.
    pub fn remove(&self, sub: &Arc<Sub>) -> bool {
        let mut root = self.root.write().unwrap_or_else(|e| e.into_inner());
        let tokens: Vec<&[u8]> = sub.subject.split(|&b| b == b'.').collect();
        let removed = remove_from(&mut root, &tokens, sub);
        if removed {
            self.count.fetch_sub(1, Ordering::Relaxed);
            self.removes.fetch_add(1, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
        }
        drop(root);
        if removed {
            if let Some(h) = self.hook.get() {
                h.removed(sub);
            }
        }
        removed
    }

    /// Every subscription, for monitoring (`/routez?subs=1` lists a route's this way).
    pub fn all(&self) -> Vec<Arc<Sub>> {
        fn walk(level: &Level, out: &mut Vec<Arc<Sub>>) {
            let nodes = level
                .literal
                .values()
                .chain(level.pwc.as_deref())
                .chain(level.fwc.as_deref());
            for node in nodes {
                out.extend(node.psubs.iter().cloned());
                for (_, members) in &node.qsubs {
                    out.extend(members.iter().map(|(s, _)| s.clone()));
                }
                if let Some(next) = &node.next {
                    walk(next, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(
            &self.root.read().unwrap_or_else(|e| e.into_inner()),
            &mut out,
        );
        out
    }

    /// Everything that `subject` (a literal) matches.
    pub fn matches(&self, subject: &[u8]) -> MatchResult {
        let tokens: Vec<&[u8]> = subject.split(|&b| b == b'.').collect();
        let mut r = MatchResult::default();
        if tokens.iter().any(|t| t.is_empty()) {
            return r;
        }
        self.matches.fetch_add(1, Ordering::Relaxed);
        {
            let root = self.root.read().unwrap_or_else(|e| e.into_inner());
            match_level(&root, &tokens, &mut r);
        }
        let links = self.links.read().unwrap_or_else(|e| e.into_inner()).clone();
        for l in links.iter() {
            if !keel_protocol::subject::matches(&l.pattern, subject) {
                continue;
            }
            let f = match &l.kind {
                LinkKind::Stream { to, map } => map.apply(subject).map(|s| Forward::Stream {
                    to: to.clone(),
                    subject: s,
                }),
                LinkKind::Service {
                    to,
                    map,
                    response,
                    threshold,
                } => map.apply(subject).map(|s| Forward::Service {
                    to: to.clone(),
                    subject: s,
                    response: *response,
                    threshold: *threshold,
                }),
                LinkKind::Responses => Some(Forward::Responses),
            };
            r.forwards.extend(f);
        }
        r
    }

    /// Replaces the account's imports and exports; every cached match is stale after it.
    pub fn set_links(&self, links: Vec<Link>) {
        *self.links.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(links);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// The links installed now.
    pub fn links(&self) -> Arc<Vec<Link>> {
        self.links.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The patterns of the links installed now, with their kind (monitoring, tests).
    pub fn link_count(&self) -> usize {
        self.links.read().unwrap_or_else(|e| e.into_inner()).len()
    }
}

fn remove_from(level: &mut Level, tokens: &[&[u8]], sub: &Arc<Sub>) -> bool {
    let (tok, rest) = tokens.split_first().expect("non-empty");
    let node = match *tok {
        b"*" => level.pwc.as_deref_mut(),
        b">" => level.fwc.as_deref_mut(),
        t => level.literal.get_mut(t),
    };
    let Some(node) = node else { return false };
    let removed = if rest.is_empty() {
        remove_sub(node, sub)
    } else {
        match node.next.as_deref_mut() {
            Some(next) => {
                let r = remove_from(next, rest, sub);
                if next.is_empty() {
                    node.next = None;
                }
                r
            }
            None => false,
        }
    };
    if removed && node.is_empty() {
        match *tok {
            b"*" => level.pwc = None,
            b">" => level.fwc = None,
            t => {
                level.literal.remove(t);
            }
        }
    }
    removed
}

fn remove_sub(node: &mut Node, sub: &Arc<Sub>) -> bool {
    match &sub.queue {
        None => match node.psubs.iter().position(|s| Arc::ptr_eq(s, sub)) {
            Some(i) => {
                node.psubs.swap_remove(i);
                true
            }
            None => false,
        },
        Some(q) => {
            let Some(gi) = node.qsubs.iter().position(|(name, _)| name == q) else {
                return false;
            };
            let members = &mut node.qsubs[gi].1;
            let Some(i) = members.iter().position(|(s, _)| Arc::ptr_eq(s, sub)) else {
                return false;
            };
            members.swap_remove(i);
            if members.is_empty() {
                node.qsubs.swap_remove(gi);
            }
            true
        }
    }
}

fn add_node(node: &Node, r: &mut MatchResult) {
    r.psubs.extend(node.psubs.iter().cloned());
    // A group subscribed through several patterns is still one group: merge by name.
    for (name, members) in &node.qsubs {
        let i = match r
            .qsubs
            .iter()
            .position(|g| g[0].queue.as_ref() == Some(name))
        {
            Some(i) => i,
            None => {
                r.qsubs.push(Vec::with_capacity(members.len()));
                r.qsubs.len() - 1
            }
        };
        for (sub, weight) in members {
            for _ in 0..*weight {
                r.qsubs[i].push(sub.clone());
            }
        }
    }
}

fn match_level(level: &Level, tokens: &[&[u8]], r: &mut MatchResult) {
    let (tok, rest) = tokens.split_first().expect("non-empty");
    if let Some(fwc) = &level.fwc {
        add_node(fwc, r);
    }
    for node in [level.pwc.as_deref(), level.literal.get(*tok)]
        .into_iter()
        .flatten()
    {
        if rest.is_empty() {
            add_node(node, r);
        } else if let Some(next) = &node.next {
            match_level(next, rest, r);
        }
    }
}

/// A connection's private cache of match results, so repeated publishes to the same
/// subjects skip the trie and its lock. Wiped whenever the sublist's generation moves.
pub struct MatchCache {
    generation: u64,
    entries: HashMap<Box<[u8]>, Arc<MatchResult>>,
    /// Registered with the sublist on first use.
    counters: Option<Arc<CacheCounters>>,
}

const MATCH_CACHE_MAX: usize = 1024;

impl Default for MatchCache {
    fn default() -> Self {
        MatchCache {
            generation: u64::MAX,
            entries: HashMap::default(),
            counters: None,
        }
    }
}

impl Drop for MatchCache {
    fn drop(&mut self) {
        // Its results are gone; its hits stay counted (the registry keeps them).
        if let Some(c) = &self.counters {
            c.clear();
        }
    }
}

impl MatchCache {
    pub fn lookup(&mut self, sublist: &Sublist, subject: &[u8]) -> Arc<MatchResult> {
        self.lookup_keeping(sublist, subject, true)
    }

    /// A subject seen once (a request's reply inbox): served from the cache when there,
    /// else matched without being kept (it would only evict subjects that come again).
    pub fn lookup_once(&mut self, sublist: &Sublist, subject: &[u8]) -> Arc<MatchResult> {
        self.lookup_keeping(sublist, subject, false)
    }

    fn lookup_keeping(
        &mut self,
        sublist: &Sublist,
        subject: &[u8],
        keep: bool,
    ) -> Arc<MatchResult> {
        let counters = self.counters.get_or_insert_with(|| {
            let c = Arc::new(CacheCounters::default());
            sublist.register(&c);
            c
        });
        let generation = sublist.generation();
        if generation != self.generation {
            self.entries.clear();
            counters.clear();
            self.generation = generation;
        } else if let Some(r) = self.entries.get(subject) {
            CacheCounters::bump(&counters.hits, 1);
            return r.clone();
        }
        let r = Arc::new(sublist.matches(subject));
        if !keep || subject.starts_with(b"$JS.ACK.") {
            // Every ack has a subject of its own: caching them only evicts the rest.
            return r;
        }
        if self.entries.len() >= MATCH_CACHE_MAX {
            self.entries.clear();
            counters.clear();
        }
        self.entries.insert(subject.into(), r.clone());
        let fanout = (r.psubs.len() + r.qsubs.len()) as u64;
        CacheCounters::bump(&counters.entries, 1);
        CacheCounters::bump(&counters.fanout_sum, fanout);
        if fanout > counters.max_fanout.load(Ordering::Relaxed) {
            counters.max_fanout.store(fanout, Ordering::Relaxed);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ClientHandle;

    #[test]
    fn cache_counters_follow_the_caches() {
        let sl = Sublist::new();
        sl.insert(sub("a.b", None));
        sl.insert(sub("a.*", None));
        sl.insert(sub("a.b", Some("q")));
        let mut c1 = MatchCache::default();
        c1.lookup(&sl, b"a.b");
        c1.lookup(&sl, b"a.b");
        c1.lookup(&sl, b"a.c");
        let st = sl.cache_stats();
        assert_eq!((st.hits, st.entries, st.max_fanout), (1, 2, 3));
        assert_eq!(st.avg_fanout, 2.0);
        let mut c2 = MatchCache::default();
        c2.lookup(&sl, b"a.c");
        c2.lookup(&sl, b"a.c");
        assert_eq!(sl.cache_stats().hits, 2);
        drop(c1);
        // A dropped cache holds no results; its hits still count.
        let st = sl.cache_stats();
        assert_eq!((st.hits, st.entries, st.max_fanout), (2, 1, 1));
        // A change to the index invalidates what the caches hold.
        sl.insert(sub("x", None));
        c2.lookup(&sl, b"a.c");
        assert_eq!(sl.cache_stats().entries, 1);
        assert_eq!(sl.caches.lock().unwrap().live.len(), 1);
    }

    #[test]
    fn a_subject_looked_up_once_is_matched_but_not_kept() {
        let sl = Sublist::new();
        sl.insert(sub("_INBOX.a.*", None));
        let mut c = MatchCache::default();
        assert_eq!(c.lookup_once(&sl, b"_INBOX.a.1").psubs.len(), 1);
        assert_eq!(c.lookup_once(&sl, b"_INBOX.a.1").psubs.len(), 1);
        assert_eq!((sl.cache_stats().hits, sl.cache_stats().entries), (0, 0));
        // One already kept is served from the cache.
        c.lookup(&sl, b"_INBOX.a.2");
        c.lookup_once(&sl, b"_INBOX.a.2");
        assert_eq!((sl.cache_stats().hits, sl.cache_stats().entries), (1, 1));
    }

    fn sub(subject: &str, queue: Option<&str>) -> Arc<Sub> {
        Arc::new(Sub {
            client: ClientHandle::detached(1),
            sid: Bytes::from_static(b"1"),
            subject: Bytes::copy_from_slice(subject.as_bytes()),
            queue: queue.map(|q| Bytes::copy_from_slice(q.as_bytes())),
            max: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        })
    }

    fn matched(sl: &Sublist, subject: &str) -> Vec<String> {
        let r = sl.matches(subject.as_bytes());
        let mut v: Vec<String> = r
            .psubs
            .iter()
            .map(|s| String::from_utf8_lossy(&s.subject).into_owned())
            .collect();
        for g in r.qsubs {
            v.push(format!(
                "q:{}x{}",
                String::from_utf8_lossy(g[0].queue.as_ref().unwrap()),
                g.len()
            ));
        }
        v.sort();
        v
    }

    #[test]
    fn wildcards() {
        let sl = Sublist::new();
        for s in ["foo", "foo.*", "foo.>", "*.bar", ">", "a.*.>", "foo.bar"] {
            sl.insert(sub(s, None));
        }
        assert_eq!(matched(&sl, "foo"), vec![">", "foo"]);
        assert_eq!(
            matched(&sl, "foo.bar"),
            vec!["*.bar", ">", "foo.*", "foo.>", "foo.bar"]
        );
        assert_eq!(matched(&sl, "foo.a.b"), vec![">", "foo.>"]);
        assert_eq!(matched(&sl, "a.b"), vec![">"]);
        assert_eq!(matched(&sl, "a.b.c"), vec![">", "a.*.>"]);
        assert!(sl.matches(b"foo..bar").is_empty());
    }

    #[test]
    fn queues_merge_by_name() {
        let sl = Sublist::new();
        sl.insert(sub("foo.*", Some("q")));
        sl.insert(sub("foo.bar", Some("q")));
        sl.insert(sub("foo.bar", Some("r")));
        assert_eq!(matched(&sl, "foo.bar"), vec!["q:qx2", "q:rx1"]);
    }

    #[test]
    fn remove_prunes_and_bumps_generation() {
        let sl = Sublist::new();
        let a = sub("a.b.c", None);
        let q = sub("a.*", Some("g"));
        let g0 = sl.generation();
        sl.insert(a.clone());
        sl.insert(q.clone());
        assert!(sl.generation() > g0);
        assert_eq!(sl.count(), 2);
        assert!(sl.remove(&a));
        assert!(!sl.remove(&a));
        assert!(sl.remove(&q));
        assert_eq!(sl.count(), 0);
        assert!(sl.root.read().unwrap().is_empty());
    }

    #[tokio::test]
    async fn subscribed_wakes_on_insert_and_never_misses_one() {
        use std::time::Duration;
        let sl = Arc::new(Sublist::new());
        // A change since the caller looked: at once.
        let seen = sl.generation();
        sl.insert(sub("a", None));
        tokio::time::timeout(Duration::from_secs(5), sl.subscribed(Some(seen)))
            .await
            .expect("stale generation returns at once");
        // Otherwise it waits for the next insert.
        let seen = sl.generation();
        let waiter = {
            let sl = sl.clone();
            tokio::spawn(async move { sl.subscribed(Some(seen)).await })
        };
        while sl.insert_waiters.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiter.is_finished());
        sl.insert(sub("b", None));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("insert wakes the waiter")
            .expect("task");
        assert_eq!(sl.insert_waiters.load(Ordering::Acquire), 0);
        // None never completes.
        let never = tokio::time::timeout(Duration::from_millis(20), sl.subscribed(None));
        assert!(never.await.is_err());
    }

    /// A route's queue subscription is listed as many times as its weight (the peer's
    /// member count), and a new weight shows in the next match (the caches see it too).
    #[test]
    fn remote_queue_members_count_their_weight() {
        let sl = Sublist::new();
        let local = sub("w", Some("g"));
        let remote = sub("w", Some("g"));
        sl.insert(local.clone());
        sl.insert_remote(remote.clone(), 3);
        let mut cache = MatchCache::default();
        let members = |c: &mut MatchCache| {
            let r = c.lookup(&sl, b"w");
            assert_eq!(r.qsubs.len(), 1);
            let n = r.qsubs[0]
                .iter()
                .filter(|s| Arc::ptr_eq(s, &remote))
                .count();
            (r.qsubs[0].len(), n)
        };
        assert_eq!(members(&mut cache), (4, 3));
        sl.set_weight(&remote, 1);
        assert_eq!(members(&mut cache), (2, 1));
        sl.set_weight(&remote, u32::MAX);
        assert_eq!(
            members(&mut cache),
            (1 + MAX_QUEUE_WEIGHT as usize, MAX_QUEUE_WEIGHT as usize)
        );
        assert!(sl.remove(&remote));
        assert_eq!(members(&mut cache), (1, 0));
        assert_eq!(sl.all().len(), 1);
    }

    /// The hook hears about every insert and remove that changed the index, once.
    #[test]
    fn the_hook_hears_each_change_once() {
        #[derive(Default)]
        struct Count(std::sync::Mutex<(usize, usize)>);
        impl SubHook for Count {
            fn added(&self, _: &Arc<Sub>) {
                self.0.lock().unwrap().0 += 1;
            }
            fn removed(&self, _: &Arc<Sub>) {
                self.0.lock().unwrap().1 += 1;
            }
        }
        let sl = Sublist::new();
        let hook = Arc::new(Count::default());
        assert!(sl.set_hook(hook.clone()));
        assert!(!sl.set_hook(hook.clone()), "one hook");
        let a = sub("a.b", None);
        sl.insert(a.clone());
        sl.insert_remote(sub("a.b", None), 1);
        assert!(sl.remove(&a));
        assert!(!sl.remove(&a));
        assert_eq!(
            *hook.0.lock().unwrap(),
            (1, 1),
            "remote inserts are not told"
        );
    }

    #[test]
    fn cache_sees_changes() {
        let sl = Sublist::new();
        let mut cache = MatchCache::default();
        assert!(cache.lookup(&sl, b"x.y").is_empty());
        let s = sub("x.*", None);
        sl.insert(s.clone());
        assert_eq!(cache.lookup(&sl, b"x.y").psubs.len(), 1);
        sl.remove(&s);
        assert!(cache.lookup(&sl, b"x.y").is_empty());
    }
}
