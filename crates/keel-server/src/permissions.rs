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
use std::sync::Arc;

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
}

/// A connection's cache of publish answers, so a steady publisher asks its rules once per
/// subject. Owned by the connection's reader: no lock.
#[derive(Default)]
pub struct PublishCache {
    answers: HashMap<Box<[u8]>, bool>,
}

/// Subjects a publish cache remembers before it starts over (as the match cache).
const PUBLISH_CACHE_MAX: usize = 1024;

impl PublishCache {
    /// May `perms` publish on `subject`? Always true without permissions.
    #[inline]
    pub fn allows(&mut self, perms: Option<&Arc<dyn Permissions>>, subject: &[u8]) -> bool {
        let Some(perms) = perms else { return true };
        if let Some(&ok) = self.answers.get(subject) {
            return ok;
        }
        let ok = perms.can_publish(subject);
        if self.answers.len() >= PUBLISH_CACHE_MAX {
            self.answers.clear();
        }
        self.answers.insert(subject.into(), ok);
        ok
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
