//! The permission hook: what a connection may publish, subscribe to and receive.
//!
//! A connection's [`ClientHandle`] holds its permissions (`None`: allow everything, which is
//! every connection today; issue 13 sets them from the user at CONNECT). They are asked in
//! exactly three places:
//!
//! - publish: `Conn::process_pub` (PUB and HPUB), before the +OK and before routing. The
//!   answer is cached per subject in the connection's own [`PublishCache`] (no lock on the
//!   publish path); a denied message is not routed, the client gets the reference's
//!   `-ERR 'Permissions Violation for Publish to "<subject>"'` and stays connected.
//! - subscribe: `Conn::process_sub`, before the subscription enters the account's sublist;
//!   denied: `-ERR 'Permissions Violation for Subscription to "<subject>"'` (with
//!   `using queue "<q>"` for a queue subscription), connection kept.
//! - delivery: `Router::deliver`, for deny rules the reference applies when a message
//!   reaches a subscription that a wider pattern let through (`SUB foo.>` with `foo.bar`
//!   denied). Asked only of subscribers whose permissions say [`Permissions::checks_delivery`];
//!   a denied delivery counts as not delivered (a queue group tries its next member).
//!
//! [`ClientHandle`]: crate::client::ClientHandle

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::auth::conf::{PermOpts, RespPerm, SubjectPerm};

/// One connection's rules. Implementations answer from their own data; callers cache.
pub trait Permissions: Send + Sync {
    /// May the connection publish on `subject`?
    fn can_publish(&self, subject: &[u8]) -> bool;
    /// May it subscribe to `subject` (in queue group `queue`)?
    fn can_subscribe(&self, subject: &[u8], queue: Option<&[u8]>) -> bool;
    /// May a message on `subject` be delivered to one of its subscriptions?
    fn can_deliver(&self, subject: &[u8]) -> bool;
    /// Whether [`can_deliver`](Self::can_deliver) can ever say no (there are deny rules); when
    /// false the router does not ask.
    fn checks_delivery(&self) -> bool;
    /// Whether a subscription to `subject` could receive a message `can_deliver` refuses
    /// (when false for all its subscriptions, a client's deliveries are not checked).
    fn delivery_check_needed(&self, _subject: &[u8]) -> bool {
        true
    }
    /// Whether the reply subjects of delivered requests are remembered (`allow_responses`).
    fn tracks_replies(&self) -> bool {
        false
    }
    /// A request with reply subject `reply` was delivered to the connection.
    fn track_reply(&self, _reply: &[u8]) {}
    /// May a publish the rules deny go out anyway, as a response to a delivered request?
    /// (Asked on every such publish: the answer changes as responses are sent.)
    fn response_allowed(&self, _subject: &[u8]) -> bool {
        false
    }
    /// The rules as configured, if they come from a configuration or a JWT.
    fn opts(&self) -> Option<&PermOpts> {
        None
    }
}

/// A connection's cache of publish answers, so a steady publisher asks its rules once per
/// subject. Owned by the connection's reader: no lock. The last answer is kept apart, so a
/// publisher on one subject pays a byte comparison, not a hash.
#[derive(Default)]
pub struct PublishCache {
    answers: HashMap<Box<[u8]>, bool>,
    /// The last subject asked about (its buffer reused: no allocation per publish) and its
    /// answer; None until the first.
    last: Vec<u8>,
    last_ok: Option<bool>,
}

/// Subjects a publish cache remembers before it starts over (as the match cache).
const PUBLISH_CACHE_MAX: usize = 1024;

impl PublishCache {
    /// May `perms` publish on `subject`? Always true without permissions.
    #[inline]
    pub fn allows(&mut self, perms: Option<&Arc<dyn Permissions>>, subject: &[u8]) -> bool {
        let Some(perms) = perms else { return true };
        if let Some(ok) = self.last_ok {
            if self.last == subject {
                return ok || (perms.tracks_replies() && perms.response_allowed(subject));
            }
        }
        let ok = match self.answers.get(subject) {
            Some(&ok) => ok,
            None => {
                let ok = perms.can_publish(subject);
                if self.answers.len() >= PUBLISH_CACHE_MAX {
                    self.answers.clear();
                }
                self.answers.insert(subject.into(), ok);
                ok
            }
        };
        self.last.clear();
        self.last.extend_from_slice(subject);
        self.last_ok = Some(ok);
        ok || (perms.tracks_replies() && perms.response_allowed(subject))
    }

    /// Forgets every answer (the rules changed).
    pub fn clear(&mut self) {
        self.answers.clear();
        self.last_ok = None;
    }
}

/// One permission subject, with the queue group it names (`"foo.> workers"`).
#[derive(Debug, Clone)]
struct Entry {
    subject: Vec<u8>,
    queue: Option<Vec<u8>>,
}

#[derive(Debug, Clone, Default)]
struct List {
    /// None: everything is allowed (no allow list given).
    allow: Option<Vec<Entry>>,
    deny: Vec<Entry>,
}

fn entries(list: &[String]) -> Vec<Entry> {
    list.iter()
        .map(|s| {
            let mut parts = s.split_whitespace();
            Entry {
                subject: parts.next().unwrap_or("").as_bytes().to_vec(),
                queue: parts.next().map(|q| q.as_bytes().to_vec()),
            }
        })
        .collect()
}

impl List {
    fn of(p: &SubjectPerm) -> List {
        List {
            allow: p.allow.as_deref().map(entries),
            deny: entries(&p.deny),
        }
    }
}

/// What a list says about `subject` (which may hold wildcards, matched as the reference's
/// sublist matches a subscription subject: token by token): whether a plain entry matches,
/// and the queue groups of matching queue entries.
fn lookup<'a>(list: &'a [Entry], subject: &[u8]) -> (bool, Vec<&'a [u8]>) {
    let mut plain = false;
    let mut queues = Vec::new();
    for e in list {
        if keel_protocol::subject::matches(&e.subject, subject) {
            match &e.queue {
                None => plain = true,
                Some(q) => queues.push(q.as_slice()),
            }
        }
    }
    (plain, queues)
}

fn queue_matches(queue: &[u8], patterns: &[&[u8]]) -> bool {
    patterns
        .iter()
        .any(|p| keel_protocol::subject::matches(p, queue))
}

/// A delivered request's reply subject: responses sent so far, and when it arrived.
type Reply = (usize, Instant);

/// Most reply subjects a connection with `allow_responses` remembers at once (older ones
/// are dropped first once expired), so a flood of requests cannot grow it without bound.
const REPLIES_MAX: usize = 4096;

/// A user's permissions from the configuration or a user JWT, as the reference applies them.
pub struct Rules {
    publish: Option<List>,
    subscribe: Option<List>,
    resp: Option<RespPerm>,
    /// Reply subjects of delivered requests: responses sent so far, and when it arrived.
    replies: Mutex<HashMap<Box<[u8]>, Reply>>,
    /// As configured (the `$SYS.REQ.USER.INFO` answer shows them).
    pub opts: PermOpts,
}

impl Rules {
    pub fn new(p: &PermOpts) -> Rules {
        let mut publish = p.publish.as_ref().map(List::of);
        // With allow_responses and no publish rules the reference allows only responses.
        if p.response.is_some() && publish.is_none() {
            publish = Some(List {
                allow: Some(Vec::new()),
                deny: Vec::new(),
            });
        }
        Rules {
            publish,
            subscribe: p.subscribe.as_ref().map(List::of),
            resp: p.response.clone(),
            replies: Mutex::new(HashMap::new()),
            opts: p.clone(),
        }
    }
}

impl Permissions for Rules {
    fn can_publish(&self, subject: &[u8]) -> bool {
        let Some(l) = &self.publish else { return true };
        if let Some(allow) = &l.allow {
            let (plain, queues) = lookup(allow, subject);
            if !plain && queues.is_empty() {
                return false;
            }
        }
        let (plain, queues) = lookup(&l.deny, subject);
        !plain && queues.is_empty()
    }

    fn can_subscribe(&self, subject: &[u8], queue: Option<&[u8]>) -> bool {
        let Some(l) = &self.subscribe else {
            return true;
        };
        let mut allowed = true;
        if let Some(allow) = &l.allow {
            let (plain, queues) = lookup(allow, subject);
            allowed = plain;
            if let Some(q) = queue {
                if !queues.is_empty() {
                    allowed = queue_matches(q, &queues);
                }
            }
        }
        if allowed {
            let (plain, queues) = lookup(&l.deny, subject);
            allowed = !plain;
            if let Some(q) = queue {
                if !queues.is_empty() {
                    allowed = !queue_matches(q, &queues);
                }
            }
        }
        allowed
    }

    fn can_deliver(&self, subject: &[u8]) -> bool {
        match &self.subscribe {
            Some(l) => !lookup(&l.deny, subject).0,
            None => true,
        }
    }

    fn checks_delivery(&self) -> bool {
        self.subscribe.as_ref().is_some_and(|l| !l.deny.is_empty())
    }

    fn delivery_check_needed(&self, subject: &[u8]) -> bool {
        // A literal subscription was checked against the deny rules when it was made; a
        // wildcard one needs checks only if a deny rule falls inside it.
        keel_protocol::subject::has_wildcard(subject)
            && self.subscribe.as_ref().is_some_and(|l| {
                l.deny.iter().any(|e| {
                    keel_protocol::subject::matches(subject, &e.subject)
                        || keel_protocol::subject::matches(&e.subject, subject)
                })
            })
    }

    fn tracks_replies(&self) -> bool {
        self.resp.is_some()
    }

    fn opts(&self) -> Option<&PermOpts> {
        Some(&self.opts)
    }

    fn track_reply(&self, reply: &[u8]) {
        let Some(resp) = &self.resp else { return };
        let mut r = self.replies.lock().unwrap_or_else(|e| e.into_inner());
        if r.len() >= REPLIES_MAX {
            let expires = resp.expires;
            r.retain(|_, (_, t)| !expires.is_zero() && t.elapsed() < expires);
            if r.len() >= REPLIES_MAX {
                return;
            }
        }
        r.insert(reply.into(), (0, Instant::now()));
    }

    fn response_allowed(&self, subject: &[u8]) -> bool {
        let Some(resp) = &self.resp else { return false };
        let mut r = self.replies.lock().unwrap_or_else(|e| e.into_inner());
        let Some((n, t)) = r.get_mut(subject) else {
            return false;
        };
        *n += 1;
        let too_many = resp.max > 0 && *n > resp.max;
        let too_late = !resp.expires.is_zero() && t.elapsed() > resp.expires;
        if too_many || too_late {
            r.remove(subject);
            return false;
        }
        if resp.max > 0 && *n == resp.max {
            // Its last allowed response: nothing more will be let through.
            r.remove(subject);
        }
        true
    }
}

/// The reference's `-ERR` text for a denied publish.
pub fn publish_violation(subject: &[u8]) -> String {
    format!("Permissions Violation for Publish to {}", quote(subject))
}

/// The reference's `-ERR` text for a denied subscription.
pub fn subscribe_violation(subject: &[u8], queue: Option<&[u8]>) -> String {
    match queue {
        None => format!(
            "Permissions Violation for Subscription to {}",
            quote(subject)
        ),
        Some(q) => format!(
            "Permissions Violation for Subscription to {} using queue {}",
            quote(subject),
            quote(q)
        ),
    }
}

/// A subject in double quotes, escaped as Go's `%q` escapes printable text.
fn quote(b: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(b))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Rules for tests: subjects starting with a denied prefix are refused, and calls are
    /// counted so caching can be seen.
    pub struct Deny {
        pub publish: &'static str,
        pub subscribe: &'static str,
        pub deliver: &'static str,
        pub publish_calls: AtomicUsize,
    }

    impl Deny {
        pub fn new(publish: &'static str, subscribe: &'static str, deliver: &'static str) -> Self {
            Deny {
                publish,
                subscribe,
                deliver,
                publish_calls: AtomicUsize::new(0),
            }
        }
    }

    fn denied(prefix: &str, subject: &[u8]) -> bool {
        !prefix.is_empty() && subject.starts_with(prefix.as_bytes())
    }

    impl Permissions for Deny {
        fn can_publish(&self, subject: &[u8]) -> bool {
            self.publish_calls.fetch_add(1, Ordering::Relaxed);
            !denied(self.publish, subject)
        }
        fn can_subscribe(&self, subject: &[u8], _queue: Option<&[u8]>) -> bool {
            !denied(self.subscribe, subject)
        }
        fn can_deliver(&self, subject: &[u8]) -> bool {
            !denied(self.deliver, subject)
        }
        fn checks_delivery(&self) -> bool {
            !self.deliver.is_empty()
        }
    }

    #[test]
    fn publish_answers_are_cached_per_subject() {
        let deny = Arc::new(Deny::new("secret.", "", ""));
        let perms: Arc<dyn Permissions> = deny.clone();
        let mut cache = PublishCache::default();
        assert!(
            cache.allows(None, b"secret.x"),
            "no permissions: all allowed"
        );
        for _ in 0..3 {
            assert!(cache.allows(Some(&perms), b"public.x"));
            assert!(!cache.allows(Some(&perms), b"secret.x"));
        }
        assert_eq!(deny.publish_calls.load(Ordering::Relaxed), 2);
    }

    fn rules(text: &str) -> Rules {
        let m = crate::conf::parse(text).unwrap();
        let (k, v) = m.iter().next().unwrap();
        Rules::new(&crate::auth::conf::permissions(k, v).unwrap())
    }

    #[test]
    fn rules_match_as_the_reference() {
        let r = rules(
            r#"p { publish: { allow: ["orders.>", "_INBOX.>"], deny: "orders.secret" },
                   subscribe: { allow: ["orders.*", "jobs workers"], deny: ["orders.hidden"] } }"#,
        );
        assert!(r.can_publish(b"orders.new"));
        assert!(!r.can_publish(b"orders.secret"));
        assert!(!r.can_publish(b"other"));
        assert!(r.can_subscribe(b"orders.new", None));
        assert!(!r.can_subscribe(b"orders.hidden", None));
        // A wildcard subscription is matched token by token, as the reference's sublist
        // matches it: `orders.*` covers `orders.*`, and its `*` also takes the `>` token.
        assert!(r.can_subscribe(b"orders.*", None));
        assert!(r.can_subscribe(b"orders.>", None));
        assert!(!r.can_subscribe(b"orders.a.>", None));
        // Queue entries: only the named group.
        assert!(r.can_subscribe(b"jobs", Some(b"workers")));
        assert!(!r.can_subscribe(b"jobs", Some(b"others")));
        assert!(!r.can_subscribe(b"jobs", None));
        assert!(r.checks_delivery());
        assert!(!r.can_deliver(b"orders.hidden"));
        assert!(r.can_deliver(b"orders.new"));
        let open = rules("p { subscribe: { deny: \"x.>\" } }");
        assert!(open.can_publish(b"anything"));
        assert!(open.can_subscribe(b"y", None) && !open.can_subscribe(b"x.y", None));
    }

    #[test]
    fn allow_responses_lets_a_reply_through_max_times() {
        let r = rules("p { allow_responses: { max: 2 } }");
        let perms: Arc<dyn Permissions> = Arc::new(r);
        let mut cache = PublishCache::default();
        assert!(!cache.allows(Some(&perms), b"_INBOX.a"), "only responses");
        perms.track_reply(b"_INBOX.a");
        assert!(cache.allows(Some(&perms), b"_INBOX.a"));
        assert!(cache.allows(Some(&perms), b"_INBOX.a"));
        assert!(!cache.allows(Some(&perms), b"_INBOX.a"), "max reached");
    }

    #[test]
    fn violation_texts_are_the_references() {
        assert_eq!(
            publish_violation(b"alice.x"),
            r#"Permissions Violation for Publish to "alice.x""#
        );
        assert_eq!(
            subscribe_violation(b"alice.>", None),
            r#"Permissions Violation for Subscription to "alice.>""#
        );
        assert_eq!(
            subscribe_violation(b"a", Some(b"q")),
            r#"Permissions Violation for Subscription to "a" using queue "q""#
        );
    }
}
