//! Accounts: the unit of isolation. Each account has its own subject space (its own
//! [`Sublist`]): a message published in one account reaches only subscriptions of that
//! account. Every connection belongs to exactly one account (its [`ClientHandle`] holds it),
//! and so does every in-process client JetStream runs (bound to the account it serves).
//!
//! Today every client is in the global account `$G`, as with a reference server that has no
//! `accounts` block; the system account `$SYS` exists (monitoring names it) but nothing
//! connects to it yet. Issue 13 adds configured accounts (users bound to them at CONNECT),
//! per-account JetStream limits and usage, and exports/imports; they hang off [`Account`].
//!
//! [`ClientHandle`]: crate::client::ClientHandle

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::sublist::Sublist;

/// The reference's name for the account of clients that name none.
pub const GLOBAL: &str = "$G";
/// The reference's name for the system account.
pub const SYSTEM: &str = "$SYS";

/// One account: its name, its subject space, and its counters.
pub struct Account {
    pub name: String,
    /// Every subscription of the account's clients (and of JetStream's clients serving it).
    pub sublist: Sublist,
    pub stats: AccountStats,
}

/// Counters kept per account (the server's totals are their sums).
#[derive(Default)]
pub struct AccountStats {
    /// Subscribers of this account closed as slow consumers.
    pub slow_consumers: AtomicU64,
}

impl Account {
    pub fn new(name: &str) -> Arc<Account> {
        Arc::new(Account {
            name: name.to_string(),
            sublist: Sublist::new(),
            stats: AccountStats::default(),
        })
    }

    pub fn is_system(&self) -> bool {
        self.name == SYSTEM
    }
}

/// The server's accounts. Built once with the server; issue 13 adds the configured ones.
pub struct Accounts {
    global: Arc<Account>,
    system: Arc<Account>,
}

impl Default for Accounts {
    fn default() -> Self {
        Accounts {
            global: Account::new(GLOBAL),
            system: Account::new(SYSTEM),
        }
    }
}

impl Accounts {
    /// `$G`: the account of every client for now.
    pub fn global(&self) -> &Arc<Account> {
        &self.global
    }

    /// `$SYS`: created, not used yet.
    pub fn system(&self) -> &Arc<Account> {
        &self.system
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Account>> {
        self.all().into_iter().find(|a| a.name == name)
    }

    /// Every account, the global one first.
    pub fn all(&self) -> [&Arc<Account>; 2] {
        [&self.global, &self.system]
    }

    /// Slow consumers seen in any account.
    pub fn slow_consumers(&self) -> u64 {
        self.all()
            .iter()
            .map(|a| a.stats.slow_consumers.load(Ordering::Relaxed))
            .sum()
    }

    /// Subscriptions in every account.
    pub fn subscriptions(&self) -> usize {
        self.all().iter().map(|a| a.sublist.count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ClientHandle;
    use crate::sublist::Sub;

    #[test]
    fn accounts_do_not_share_subjects() {
        let accs = Accounts::default();
        let (g, sys) = (accs.global(), accs.system());
        assert_eq!((g.name.as_str(), sys.name.as_str()), ("$G", "$SYS"));
        assert!(sys.is_system() && !g.is_system());
        let h = ClientHandle::detached(1);
        g.sublist.insert(Arc::new(Sub {
            client: h,
            sid: bytes::Bytes::from_static(b"1"),
            subject: bytes::Bytes::from_static(b"foo"),
            queue: None,
            max: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        }));
        assert_eq!(g.sublist.matches(b"foo").psubs.len(), 1);
        assert!(sys.sublist.matches(b"foo").is_empty());
        assert_eq!(accs.subscriptions(), 1);
        assert!(Arc::ptr_eq(accs.get("$SYS").unwrap(), sys));
        assert!(accs.get("nope").is_none());
    }
}
