//! Accounts: the unit of isolation. Each account has its own subject space (its own
//! [`Sublist`]): a message published in one account reaches only subscriptions of that
//! account. Every connection belongs to exactly one account (its [`ClientHandle`] holds it),
//! and so does every in-process client JetStream runs (bound to the account it serves).
//!
//! Without an `accounts` block every client is in the global account `$G`, as with the
//! reference. Configured accounts (`accounts { A: {...} }`, or account JWTs in operator mode)
//! are made at start; users are bound to theirs at CONNECT. The system account
//! (`system_account`, default `$SYS`) holds the server's own services (`system.rs`).
//! Exports and imports become [`Link`]s in the accounts' sublists: a stream export copies
//! messages into the importer, a service import sends requests to the exporter with a reply
//! subject (`_R_.`) that leads back through the exporter's pending-reply table.
//!
//! [`ClientHandle`]: crate::client::ClientHandle

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use crate::auth::conf::{
    AuthOpts, ExportKind, ExportOpts, ImportOpts, JsAccountOpts, ResponseType,
};
use crate::sublist::{Link, LinkKind, SubjectMap, Sublist};

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
    /// What the configuration (or the account's JWT) says about it; replaced on reload.
    pub config: RwLock<AccountConfig>,
    /// Replies owed to requesters in other accounts through service imports (`_R_.` subjects).
    responses: Mutex<HashMap<Bytes, PendingReply>>,
    next_reply: AtomicU64,
    /// A random token so this account's reply subjects are its own.
    reply_prefix: String,
    /// Client connections bound to it now.
    pub conns: AtomicUsize,
}

/// Counters kept per account (the server's totals are their sums).
#[derive(Default)]
pub struct AccountStats {
    /// Subscribers of this account closed as slow consumers.
    pub slow_consumers: AtomicU64,
    /// Client connections ever bound to it.
    pub total_conns: AtomicU64,
    /// Messages and bytes of its connections that have closed (open ones are summed live).
    pub closed_in_msgs: AtomicU64,
    pub closed_in_bytes: AtomicU64,
    pub closed_out_msgs: AtomicU64,
    pub closed_out_bytes: AtomicU64,
}

/// An account's settings: JetStream and its limits, connection limits (from an account
/// JWT), and its exports and imports as configured (for `/accountz` and `$SYS` INFO).
#[derive(Clone, Debug)]
pub struct AccountConfig {
    pub jetstream: JsAccountOpts,
    /// Most client connections at once (-1: no limit).
    pub max_connections: i64,
    /// Most subscriptions per connection (-1: no limit).
    pub max_subs: i64,
    /// Largest message payload (-1: the server's max_payload).
    pub max_payload: i64,
    pub exports: Vec<ExportOpts>,
    pub imports: Vec<ImportOpts>,
    /// The account's public key and JWT in operator mode.
    pub jwt: Option<String>,
    pub updated: SystemTime,
}

impl Default for AccountConfig {
    fn default() -> Self {
        AccountConfig {
            jetstream: JsAccountOpts::default(),
            max_connections: -1,
            max_subs: -1,
            max_payload: -1,
            exports: Vec::new(),
            imports: Vec::new(),
            jwt: None,
            updated: SystemTime::now(),
        }
    }
}

/// A request that crossed into this account through a service import: where its reply goes.
struct PendingReply {
    to: Arc<Account>,
    reply: Bytes,
    response: ResponseType,
    deadline: Instant,
}

/// Pending replies an account keeps before expired ones are swept on insert.
const RESPONSES_SWEEP: usize = 1024;
/// Most pending replies an account holds; past it new requests through imports get no
/// reply route (they time out) instead of growing memory.
const RESPONSES_MAX: usize = 256 * 1024;

impl Account {
    pub fn new(name: &str) -> Arc<Account> {
        Arc::new(Account {
            name: name.to_string(),
            sublist: Sublist::new(),
            stats: AccountStats::default(),
            config: RwLock::new(AccountConfig::default()),
            responses: Mutex::new(HashMap::new()),
            next_reply: AtomicU64::new(1),
            reply_prefix: random_token(8),
            conns: AtomicUsize::new(0),
        })
    }

    /// The configured system account is not necessarily named `$SYS`: ask [`Accounts`].
    pub fn is_system(&self) -> bool {
        self.name == SYSTEM
    }

    pub fn config(&self) -> AccountConfig {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The account's JetStream settings and limits (no allocation: read on the publish
    /// path, by the stream actor's store budget).
    pub fn jetstream_limits(&self) -> crate::auth::conf::JsAccountOpts {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .jetstream
            .clone()
    }

    pub fn jetstream_enabled(&self) -> bool {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .jetstream
            .enabled
    }

    /// A reply subject in this account for a request from `to` (reply `reply`): a response
    /// published on it here is routed back there. None when too many are pending.
    pub fn add_response(
        &self,
        to: &Arc<Account>,
        reply: &Bytes,
        response: ResponseType,
        threshold: Duration,
    ) -> Option<Bytes> {
        let n = self.next_reply.fetch_add(1, Ordering::Relaxed);
        if n == 1 {
            // The first reply subject (they start at 1). A responder on another server of the cluster must be able to answer: the
            // prefix is this server's own, so its replies route back here (as the
            // reference's response wildcard subscription does).
            self.sublist
                .announce(&Bytes::from(format!("_R_.{}.>", self.reply_prefix)));
        }
        let subject = Bytes::from(format!("_R_.{}.{n:x}", self.reply_prefix));
        let mut r = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        if r.len() >= RESPONSES_SWEEP {
            let now = Instant::now();
            r.retain(|_, p| p.deadline > now);
            if r.len() >= RESPONSES_MAX {
                return None;
            }
        }
        r.insert(
            subject.clone(),
            PendingReply {
                to: to.clone(),
                reply: reply.clone(),
                response,
                deadline: Instant::now() + threshold,
            },
        );
        Some(subject)
    }

    /// Where a response published here on `subject` goes: the requester's account and reply
    /// subject. A singleton's entry is used up by its one response.
    pub fn take_response(&self, subject: &[u8]) -> Option<(Arc<Account>, Bytes)> {
        let mut r = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        let p = r.get(subject)?;
        if p.deadline <= Instant::now() {
            r.remove(subject);
            return None;
        }
        let out = (p.to.clone(), p.reply.clone());
        if p.response == ResponseType::Singleton {
            r.remove(subject);
        }
        Some(out)
    }

    /// Whether a response route for `subject` is still pending.
    pub fn has_response(&self, subject: &[u8]) -> bool {
        self.responses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(subject)
            .is_some_and(|p| p.deadline > Instant::now())
    }
}

/// `n` random characters of the reference's nuid alphabet.
pub fn random_token(n: usize) -> String {
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    (0..n)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// What is told about an account made after start.
pub type OnNewAccount = Box<dyn Fn(&Arc<Account>) + Send + Sync>;

/// The server's accounts: `$G`, the system account, and the configured ones (by name; in
/// operator mode by public key). An account, once made, lives as long as the server: a
/// reload changes its settings and links, never its subject space.
pub struct Accounts {
    global: Arc<Account>,
    system: Option<Arc<Account>>,
    others: RwLock<BTreeMap<String, Arc<Account>>>,
    /// Told about each account made after start (the cluster watches every account's
    /// interest from its creation).
    on_new: std::sync::OnceLock<OnNewAccount>,
}

impl Default for Accounts {
    fn default() -> Self {
        let system = Account::new(SYSTEM);
        let mut others = BTreeMap::new();
        others.insert(SYSTEM.to_string(), system.clone());
        Accounts {
            global: Account::new(GLOBAL),
            system: Some(system),
            others: RwLock::new(others),
            on_new: std::sync::OnceLock::new(),
        }
    }
}

impl Accounts {
    /// The accounts `auth` names, with the system account it names (none with
    /// `no_system_account`).
    pub fn from_opts(auth: &AuthOpts) -> Accounts {
        let global = Account::new(GLOBAL);
        let mut others = BTreeMap::new();
        for a in &auth.accounts {
            if a.name != GLOBAL {
                others.insert(a.name.clone(), Account::new(&a.name));
            }
        }
        for (key, _) in &auth.resolver_preload {
            others
                .entry(key.clone())
                .or_insert_with(|| Account::new(key));
        }
        let system = (!auth.no_system_account).then(|| {
            let name = auth.system_account.as_deref().unwrap_or(SYSTEM);
            if name == GLOBAL {
                global.clone()
            } else {
                others
                    .entry(name.to_string())
                    .or_insert_with(|| Account::new(name))
                    .clone()
            }
        });
        Accounts {
            global,
            system,
            others: RwLock::new(others),
            on_new: std::sync::OnceLock::new(),
        }
    }

    /// `$G`: the account of clients of a server without accounts.
    pub fn global(&self) -> &Arc<Account> {
        &self.global
    }

    /// The system account (`system_account`, default `$SYS`); None with `no_system_account`.
    pub fn system_account(&self) -> Option<&Arc<Account>> {
        self.system.as_ref()
    }

    /// The system account's name ("" when there is none, as the reference's /varz).
    pub fn system_name(&self) -> &str {
        self.system.as_ref().map_or("", |a| a.name.as_str())
    }

    pub fn is_system(&self, a: &Account) -> bool {
        self.system.as_ref().is_some_and(|s| std::ptr::eq(&**s, a))
    }

    pub fn get(&self, name: &str) -> Option<Arc<Account>> {
        if name == GLOBAL {
            return Some(self.global.clone());
        }
        self.others
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// The account named `name`, made if new (a reload adding an account).
    pub fn get_or_add(&self, name: &str) -> Arc<Account> {
        if name == GLOBAL {
            return self.global.clone();
        }
        let (acc, new) = {
            let mut others = self.others.write().unwrap_or_else(|e| e.into_inner());
            match others.get(name) {
                Some(a) => (a.clone(), false),
                None => {
                    let a = Account::new(name);
                    others.insert(name.to_string(), a.clone());
                    (a, true)
                }
            }
        };
        if new {
            if let Some(f) = self.on_new.get() {
                f(&acc);
            }
        }
        acc
    }

    /// Sets what is told about each account made from now on (once: false if set). The
    /// accounts made before are in [`all`](Self::all).
    pub fn set_on_new(&self, f: OnNewAccount) -> bool {
        self.on_new.set(f).is_ok()
    }

    /// Every account, the global one first.
    pub fn all(&self) -> Vec<Arc<Account>> {
        let mut v = vec![self.global.clone()];
        v.extend(
            self.others
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned(),
        );
        v
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

    /// The accounts JetStream serves: those with `jetstream: enabled` when the
    /// configuration names accounts (by name), else `$G` alone.
    pub fn jetstream_accounts(&self) -> Vec<Arc<Account>> {
        let mut js: Vec<Arc<Account>> = self
            .all()
            .into_iter()
            .filter(|a| a.name != GLOBAL && a.jetstream_enabled())
            .collect();
        js.sort_by(|a, b| a.name.cmp(&b.name));
        if js.is_empty() {
            js.push(self.global.clone());
        }
        js
    }

    /// Applies the accounts' settings from `auth` (at start and on reload): JetStream,
    /// exports and imports, then the links that carry messages across accounts, including
    /// the system account's services every account can ask (as the reference imports them).
    pub fn configure(&self, auth: &AuthOpts) -> Result<(), String> {
        for a in &auth.accounts {
            let acc = self.get_or_add(&a.name);
            let mut c = acc.config.write().unwrap_or_else(|e| e.into_inner());
            c.jetstream = a.jetstream.clone();
            c.exports = a.exports.clone();
            c.imports = a.imports.clone();
            c.updated = SystemTime::now();
        }
        // Accounts no longer configured keep their subject space but lose their settings.
        for acc in self.all() {
            if acc.name != GLOBAL
                && !auth.accounts.iter().any(|a| a.name == acc.name)
                && !auth.resolver_preload.iter().any(|(k, _)| *k == acc.name)
            {
                let mut c = acc.config.write().unwrap_or_else(|e| e.into_inner());
                c.exports.clear();
                c.imports.clear();
                c.jetstream = JsAccountOpts::default();
            }
        }
        self.install_links()
    }

    /// Builds every account's links from the exports and imports (checking that each
    /// import names an export that allows it), plus the system services.
    pub fn install_links(&self) -> Result<(), String> {
        let all = self.all();
        let mut links: HashMap<String, Vec<Link>> = HashMap::new();
        for importer in &all {
            let imports = importer.config().imports;
            for imp in imports {
                let exporter = self.get(&imp.account).ok_or_else(|| {
                    format!(
                        "Account {:?} imports from unknown account {:?}",
                        importer.name, imp.account
                    )
                })?;
                let exports = exporter.config().exports;
                let export = exports
                    .iter()
                    .find(|e| {
                        e.kind == imp.kind
                            && (e.subject == imp.subject
                                || keel_protocol::subject::matches(
                                    e.subject.as_bytes(),
                                    imp.subject.as_bytes(),
                                ))
                    })
                    .ok_or_else(|| {
                        format!(
                            "Account {:?} imports {:?} from {:?}, which does not export it",
                            importer.name, imp.subject, imp.account
                        )
                    })?;
                if let Some(allowed) = &export.accounts {
                    if !allowed.iter().any(|a| *a == importer.name) {
                        return Err(format!(
                            "Account {:?} is not allowed to import {:?} from {:?}",
                            importer.name, imp.subject, imp.account
                        ));
                    }
                }
                match imp.kind {
                    ExportKind::Stream => {
                        let map = match (&imp.prefix, &imp.to) {
                            (Some(p), _) => SubjectMap::Prefix(p.clone()),
                            (None, Some(to)) if *to != imp.subject => {
                                SubjectMap::Transform(Box::new(transform(&imp.subject, to)?))
                            }
                            _ => SubjectMap::Same,
                        };
                        links.entry(exporter.name.clone()).or_default().push(Link {
                            pattern: Bytes::from(imp.subject.clone()),
                            kind: LinkKind::Stream {
                                to: importer.clone(),
                                map,
                            },
                        });
                    }
                    ExportKind::Service => {
                        let local = imp.to.clone().unwrap_or_else(|| imp.subject.clone());
                        let map = if local == imp.subject {
                            SubjectMap::Same
                        } else {
                            SubjectMap::Transform(Box::new(transform(&local, &imp.subject)?))
                        };
                        links.entry(importer.name.clone()).or_default().push(Link {
                            pattern: Bytes::from(local),
                            kind: LinkKind::Service {
                                to: exporter.clone(),
                                map,
                                response: export.response_type,
                                threshold: export.response_threshold,
                            },
                        });
                        links.entry(exporter.name.clone()).or_default();
                    }
                }
            }
        }
        // The system account's services each account may ask about itself.
        if let Some(sys) = &self.system {
            for acc in &all {
                if Arc::ptr_eq(acc, sys) {
                    continue;
                }
                let n = &acc.name;
                for (local, remote) in [
                    (
                        "$SYS.REQ.ACCOUNT.PING.CONNZ".to_string(),
                        format!("$SYS.REQ.ACCOUNT.{n}.CONNZ"),
                    ),
                    (
                        "$SYS.REQ.SERVER.PING.CONNZ".to_string(),
                        format!("$SYS.REQ.ACCOUNT.{n}.CONNZ"),
                    ),
                    (
                        "$SYS.REQ.ACCOUNT.PING.STATZ".to_string(),
                        format!("$SYS.REQ.ACCOUNT.{n}.STATZ"),
                    ),
                    (
                        "$SYS.REQ.USER.INFO".to_string(),
                        format!("$SYS.REQ.USER.{n}.INFO"),
                    ),
                ] {
                    let map = SubjectMap::Transform(Box::new(transform(&local, &remote)?));
                    links.entry(n.clone()).or_default().push(Link {
                        pattern: Bytes::from(local),
                        kind: LinkKind::Service {
                            to: sys.clone(),
                            map,
                            response: ResponseType::Singleton,
                            threshold: crate::auth::conf::DEFAULT_RESPONSE_THRESHOLD,
                        },
                    });
                }
            }
            links.entry(sys.name.clone()).or_default();
        }
        // Exporters of services answer on `_R_.` subjects that lead back to the importer.
        for acc in &all {
            let mut mine = links.remove(&acc.name).unwrap_or_default();
            let serves = self.is_system(acc)
                || acc
                    .config()
                    .exports
                    .iter()
                    .any(|e| e.kind == ExportKind::Service);
            if serves {
                mine.push(Link {
                    pattern: Bytes::from_static(b"_R_.>"),
                    kind: LinkKind::Responses,
                });
            }
            acc.sublist.set_links(mine);
        }
        Ok(())
    }
}

/// A subject mapping from `from` to `to` that carries the wildcards over by position.
fn transform(from: &str, to: &str) -> Result<crate::jetstream::transform::Transform, String> {
    let mut n = 0;
    let dest: Vec<String> = to
        .split('.')
        .map(|t| {
            if t == "*" {
                n += 1;
                format!("{{{{wildcard({n})}}}}")
            } else {
                t.to_string()
            }
        })
        .collect();
    crate::jetstream::transform::Transform::new(from, &dest.join("."))
        .map_err(|e| format!("cannot map {from:?} to {to:?}: {e:?}"))?
        .ok_or_else(|| format!("cannot map {from:?} to {to:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ClientHandle;
    use crate::sublist::Sub;

    #[test]
    fn accounts_do_not_share_subjects() {
        let accs = Accounts::default();
        let (g, sys) = (accs.global(), accs.system_account().unwrap().clone());
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
        assert!(Arc::ptr_eq(&accs.get("$SYS").unwrap(), &sys));
        assert!(accs.get("nope").is_none());
    }
}
