//! Authentication: who a client is and which account it lands in, decided once at CONNECT.
//!
//! [`Auth`] is built from [`conf::AuthOpts`] (at start and at every reload) and answers
//! [`Auth::authenticate`] for a CONNECT's credentials:
//! - a user and password (the password as configured, or its bcrypt hash `$2a$...`);
//! - a token (`authorization { token }` / `--auth`, also possibly bcrypt-hashed);
//! - an nkey user: the client signs the INFO `nonce` with its seed (`sig`), checked with the
//!   public key it names (`nkey`);
//! - decentralized auth (`operator` + `resolver: MEMORY` + `resolver_preload`): a user JWT
//!   signed by an account (or one of its signing keys) whose JWT is signed by a trusted
//!   operator, and the nonce signed by the user's key; its permissions and limits come from
//!   the JWTs, and it is disconnected when the user JWT expires;
//! - no credentials at all: the `no_auth_user`, if configured.
//!
//! Passwords and tokens are compared in constant time (`subtle`), never logged, never shown
//! by monitoring (only user names are).

pub mod conf;
pub mod jwt;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use serde::Deserialize;
use serde_json::Value;
use subtle::ConstantTimeEq;

use crate::account::{Accounts, GLOBAL};
use crate::permissions::Rules;
use conf::{
    AuthOpts, ExportKind, ExportOpts, ImportOpts, JsAccountOpts, PermOpts, RespPerm, ResponseType,
    SubjectPerm,
};

/// The reference's default time a client has to send its CONNECT when auth is required.
pub const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(2);

/// The credential fields of a CONNECT. Kept by the connection (reloads check them again);
/// `Debug` never shows a secret.
#[derive(Deserialize, Default, Clone)]
#[serde(default)]
pub struct Creds {
    pub user: Option<String>,
    pub pass: Option<String>,
    pub auth_token: Option<String>,
    pub nkey: Option<String>,
    pub sig: Option<String>,
    pub jwt: Option<String>,
}

impl fmt::Debug for Creds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Creds")
            .field("user", &self.user)
            .field("nkey", &self.nkey)
            .field("jwt", &self.jwt.is_some())
            .finish_non_exhaustive()
    }
}

/// A successful authentication.
#[derive(Clone)]
pub struct Authed {
    /// The user name (or the user's public nkey), for monitoring and events.
    pub user: String,
    /// The account's name (its public key in operator mode).
    pub account: String,
    pub perms: Option<Arc<Rules>>,
    /// When the credentials stop being valid (a user JWT's `exp`).
    pub expires: Option<SystemTime>,
    /// Per-connection limits from the JWTs (-1: none).
    pub max_subs: i64,
    pub max_payload: i64,
}

impl fmt::Debug for Authed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authed")
            .field("user", &self.user)
            .field("account", &self.account)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Auth")
            .field("required", &self.required)
            .field("users", &self.users.len())
            .field("nkeys", &self.nkeys.len())
            .finish_non_exhaustive()
    }
}

/// One configured user.
struct User {
    /// As configured: plain text, or a bcrypt hash.
    password: Option<String>,
    perms: Option<Arc<Rules>>,
    account: String,
}

/// Operator mode: the keys that may sign accounts and the preloaded account JWTs.
struct Trust {
    /// Account public key -> its JWT.
    accounts: HashMap<String, jwt::Jwt>,
}

/// Who may connect. Swapped whole on reload.
pub struct Auth {
    pub required: bool,
    pub timeout: Duration,
    /// Whether INFO carries a nonce (nkey users or operator mode).
    pub nonce: bool,
    single: Option<(String, String)>,
    token: Option<String>,
    users: HashMap<String, User>,
    nkeys: HashMap<String, User>,
    no_auth_user: Option<String>,
    trust: Option<Trust>,
}

impl Default for Auth {
    fn default() -> Self {
        Auth {
            required: false,
            timeout: DEFAULT_AUTH_TIMEOUT,
            nonce: false,
            single: None,
            token: None,
            users: HashMap::new(),
            nkeys: HashMap::new(),
            no_auth_user: None,
            trust: None,
        }
    }
}

fn is_bcrypt(s: &str) -> bool {
    s.starts_with("$2")
}

/// Does `given` match `configured` (plain text compared in constant time, or a bcrypt hash)?
fn secret_matches(configured: &str, given: &str) -> bool {
    if is_bcrypt(configured) {
        bcrypt::verify(given, configured).unwrap_or(false)
    } else {
        configured.as_bytes().ct_eq(given.as_bytes()).into()
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl Auth {
    /// Builds the rules from `opts`, checking them as the reference does (unique users, a
    /// `no_auth_user` that exists, JWTs that verify). `accounts` gets the settings that come
    /// from account JWTs.
    pub fn build(opts: &AuthOpts, accounts: &Accounts) -> Result<Auth, String> {
        let mut a = Auth {
            required: opts.required(),
            timeout: opts.timeout.unwrap_or(DEFAULT_AUTH_TIMEOUT),
            single: opts
                .user
                .clone()
                .map(|u| (u, opts.password.clone().unwrap_or_default())),
            token: opts.token.clone(),
            no_auth_user: opts.no_auth_user.clone(),
            ..Default::default()
        };
        if opts.password.is_some() && opts.user.is_none() {
            return Err("a password needs a user".into());
        }
        let rules = |p: &Option<PermOpts>, account_default: Option<&PermOpts>| {
            p.as_ref()
                .or(account_default)
                .or(opts.default_permissions.as_ref())
                .map(|p| Arc::new(Rules::new(p)))
        };
        let mut add = |u: &conf::UserOpts, default: Option<&PermOpts>| -> Result<(), String> {
            let account = u.account.clone().unwrap_or_else(|| GLOBAL.to_string());
            if accounts.get(&account).is_none() {
                return Err(format!(
                    "User {:?} names unknown account {account:?}",
                    u.user
                ));
            }
            let entry = User {
                password: u.password.clone(),
                perms: rules(&u.permissions, default),
                account,
            };
            if let Some(n) = &u.nkey {
                if a.nkeys.insert(n.clone(), entry).is_some() {
                    return Err(format!("Duplicate nkey {n:?} detected"));
                }
            } else if let Some(name) = &u.user {
                if a.users.insert(name.clone(), entry).is_some() {
                    return Err(format!("Duplicate user {name:?} detected"));
                }
            }
            Ok(())
        };
        for u in &opts.users {
            add(u, None)?;
        }
        for acc in &opts.accounts {
            for u in &acc.users {
                let mut u = u.clone();
                u.account = Some(acc.name.clone());
                add(&u, acc.default_permissions.as_ref())?;
            }
        }
        if let Some(n) = &opts.no_auth_user {
            if !a.users.contains_key(n) && !a.nkeys.contains_key(n) {
                return Err(format!(
                    "no_auth_user: {n:?} not present as user or nkey in authorization block or account configuration"
                ));
            }
        }
        if opts.operator_mode() {
            a.trust = Some(trust(opts, accounts)?);
            if !opts.users.is_empty() || opts.user.is_some() || opts.token.is_some() {
                return Err(
                    "operator mode takes users from JWTs: authorization users, user or token cannot be configured with it"
                        .into(),
                );
            }
        }
        a.nonce = !a.nkeys.is_empty() || a.trust.is_some();
        Ok(a)
    }

    /// Whether clients without credentials become a configured user.
    pub fn has_no_auth_user(&self) -> bool {
        self.no_auth_user.is_some()
    }

    /// Checks a CONNECT's credentials. `nonce` is what the INFO sent. Err carries what the
    /// log says (a user name or key, never a secret).
    pub fn authenticate(&self, c: &Creds, nonce: Option<&str>) -> Result<Authed, String> {
        if let Some(t) = &self.trust {
            return self.authenticate_jwt(t, c, nonce);
        }
        // As the reference: a credential of a kind the server has none of configured is
        // ignored (a client may send several kinds at once), not refused.
        if !self.nkeys.is_empty() {
            if let Some(key) = given(&c.nkey) {
                let Some(u) = self.nkeys.get(key) else {
                    return Err(format!("Nkey {key:?}"));
                };
                verify_nonce(key, c.sig.as_deref(), nonce).map_err(|_| format!("Nkey {key:?}"))?;
                return Ok(self.authed(key, u));
            }
        }
        if !self.users.is_empty() {
            if let Some(name) = given(&c.user) {
                let Some(u) = self.users.get(name) else {
                    return Err(format!("User {name:?}"));
                };
                let pass = c.pass.as_deref().unwrap_or_default();
                let ok = u
                    .password
                    .as_deref()
                    .is_some_and(|p| secret_matches(p, pass));
                return if ok {
                    Ok(self.authed(name, u))
                } else {
                    Err(format!("User {name:?}"))
                };
            }
        }
        let simple = |user: String| Authed {
            user,
            account: GLOBAL.into(),
            perms: None,
            expires: None,
            max_subs: -1,
            max_payload: -1,
        };
        if let Some(token) = &self.token {
            let t = c.auth_token.as_deref().unwrap_or_default();
            return if !t.is_empty() && secret_matches(token, t) {
                Ok(simple(String::new()))
            } else {
                Err("Token".into())
            };
        }
        if let Some((user, pass)) = &self.single {
            let name = c.user.as_deref().unwrap_or_default();
            let p = c.pass.as_deref().unwrap_or_default();
            let user_ok: bool = user.as_bytes().ct_eq(name.as_bytes()).into();
            return if user_ok && secret_matches(pass, p) {
                Ok(simple(user.clone()))
            } else {
                Err(format!("User {name:?}"))
            };
        }
        let none_given = given(&c.user).is_none()
            && given(&c.pass).is_none()
            && given(&c.auth_token).is_none()
            && (self.nkeys.is_empty() || given(&c.nkey).is_none());
        if none_given {
            if let Some(n) = &self.no_auth_user {
                if let Some(u) = self.users.get(n).or_else(|| self.nkeys.get(n)) {
                    return Ok(self.authed(n, u));
                }
            }
        }
        Err("no credentials".into())
    }

    /// `verify_and_map`: the user named by the client certificate (the reference's order of
    /// its names; see `CertIdentity::map_user`). Such users have no password: the
    /// verified certificate is the credential.
    pub fn authenticate_cert(
        &self,
        id: &crate::tls::CertIdentity,
        log: &crate::log::Log,
    ) -> Result<Authed, String> {
        let name = id
            .map_user(self.users.keys().map(String::as_str), log)
            .ok_or_else(|| "no user for the client certificate".to_string())?;
        let u = &self.users[name];
        Ok(self.authed(name, u))
    }

    fn authed(&self, name: &str, u: &User) -> Authed {
        Authed {
            user: name.to_string(),
            account: u.account.clone(),
            perms: u.perms.clone(),
            expires: None,
            max_subs: -1,
            max_payload: -1,
        }
    }

    fn authenticate_jwt(
        &self,
        t: &Trust,
        c: &Creds,
        nonce: Option<&str>,
    ) -> Result<Authed, String> {
        let token = c.jwt.as_deref().ok_or("no user JWT")?;
        let user = jwt::decode(token, "user").map_err(|e| format!("user JWT: {e}"))?;
        let now = now_secs();
        if !user.valid_at(now) {
            return Err(format!("User JWT of {:?} has expired", user.subject));
        }
        let issuer_account = user
            .nats
            .get("issuer_account")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or(&user.issuer)
            .to_string();
        let account = t.accounts.get(&issuer_account).ok_or_else(|| {
            format!(
                "account {issuer_account:?} of user {:?} is not known",
                user.subject
            )
        })?;
        if !account.valid_at(now) {
            return Err(format!("account {issuer_account:?} JWT has expired"));
        }
        let template = if user.issuer == account.subject {
            None
        } else if account.signing_keys().contains(&user.issuer) {
            jwt::scoped_template(account, &user.issuer)
        } else {
            return Err(format!(
                "user {:?} JWT is not signed by its account or one of its signing keys",
                user.subject
            ));
        };
        if let Some(at) = account
            .nats
            .get("revocations")
            .and_then(|r| r.get(&user.subject).or_else(|| r.get("*")))
            .and_then(Value::as_i64)
        {
            if user.issued_at <= at {
                return Err(format!("user {:?} JWT has been revoked", user.subject));
            }
        }
        let claims = template.as_ref().unwrap_or(&user.nats);
        for key in ["src", "times", "locale", "allowed_connection_types"] {
            let set = match claims.get(key) {
                Some(Value::Array(a)) => !a.is_empty(),
                Some(Value::String(s)) => !s.is_empty(),
                _ => false,
            };
            if set {
                return Err(format!(
                    "user {:?} JWT restricts {key}, which keel-server does not support yet",
                    user.subject
                ));
            }
        }
        let bearer = claims
            .get("bearer_token")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if !bearer {
            verify_nonce(&user.subject, c.sig.as_deref(), nonce)
                .map_err(|_| format!("user {:?}: nonce signature", user.subject))?;
        }
        let perms = jwt_perms(claims);
        let limit = |k: &str| claims.get(k).and_then(Value::as_i64).unwrap_or(-1);
        Ok(Authed {
            user: user.subject.clone(),
            account: account.subject.clone(),
            perms: perms.map(|p| Arc::new(Rules::new(&p))),
            expires: (user.expires > 0)
                .then(|| UNIX_EPOCH + Duration::from_secs(user.expires as u64)),
            max_subs: limit("subs"),
            max_payload: limit("payload"),
        })
    }
}

/// A credential field the client filled in (an empty string counts as none, as the reference's).
fn given(f: &Option<String>) -> Option<&str> {
    f.as_deref().filter(|v| !v.is_empty())
}

/// Checks `sig` (base64url or standard base64) of the nonce with the public nkey `key`.
fn verify_nonce(key: &str, sig: Option<&str>, nonce: Option<&str>) -> Result<(), ()> {
    let (Some(sig), Some(nonce)) = (sig, nonce) else {
        return Err(());
    };
    let sig = sig.trim_end_matches('=');
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(sig)
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(sig))
        .map_err(|_| ())?;
    let kp = nkeys::KeyPair::from_public_key(key).map_err(|_| ())?;
    kp.verify(nonce.as_bytes(), &raw).map_err(|_| ())
}

/// A fresh nonce as the reference sends it (11 random bytes, base64url: 15 characters).
pub fn new_nonce() -> String {
    let bytes: [u8; 11] = rand::random();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Permissions from a user JWT's `pub`, `sub` and `resp` claims (None: no rules at all).
fn jwt_perms(claims: &Value) -> Option<PermOpts> {
    let list = |v: Option<&Value>| -> Vec<String> {
        v.and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let subject = |k: &str| -> Option<SubjectPerm> {
        let p = claims.get(k)?;
        let allow = list(p.get("allow"));
        let deny = list(p.get("deny"));
        if allow.is_empty() && deny.is_empty() {
            return None;
        }
        Some(SubjectPerm {
            allow: (!allow.is_empty()).then_some(allow),
            deny,
        })
    };
    let response = claims
        .get("resp")
        .filter(|r| r.is_object())
        .map(|r| RespPerm {
            max: r.get("max").and_then(Value::as_i64).unwrap_or(1).max(0) as usize,
            expires: Duration::from_nanos(
                r.get("ttl").and_then(Value::as_i64).unwrap_or(0).max(0) as u64
            ),
        });
    let p = PermOpts {
        publish: subject("pub"),
        subscribe: subject("sub"),
        response,
    };
    (p != PermOpts::default()).then_some(p)
}

/// Operator mode: trusted keys from the operator JWTs (and `trusted_keys`), and every
/// preloaded account JWT checked against them; their limits, exports and imports go into
/// the accounts' settings.
fn trust(opts: &AuthOpts, accounts: &Accounts) -> Result<Trust, String> {
    let mut keys = opts.trusted_keys.clone();
    for token in &opts.operators {
        let op = jwt::decode(token, "operator").map_err(|e| format!("operator JWT: {e}"))?;
        if op.issuer != op.subject {
            return Err("operator JWT must be self-signed".into());
        }
        keys.push(op.subject.clone());
        keys.extend(op.signing_keys());
    }
    if !opts.resolver_memory && !opts.resolver_preload.is_empty() {
        return Err("resolver_preload needs resolver: MEMORY".into());
    }
    let mut out = HashMap::new();
    for (key, token) in &opts.resolver_preload {
        let acc = jwt::decode(token, "account").map_err(|e| format!("account {key}: {e}"))?;
        if acc.subject != *key {
            return Err(format!(
                "account JWT preloaded as {key} is for {}",
                acc.subject
            ));
        }
        if !keys.contains(&acc.issuer) {
            return Err(format!(
                "account {key} JWT is not signed by a trusted operator"
            ));
        }
        let a = accounts.get_or_add(key);
        let mut c = a.config.write().unwrap_or_else(|e| e.into_inner());
        let l = |k: &str| acc.limit("limits", k);
        c.max_connections = l("conn");
        c.max_subs = l("subs");
        c.max_payload = l("payload");
        // JetStream is on when the JWT gives it storage (-1 is unlimited, absent or 0 none).
        let given = |k: &str| {
            acc.nats
                .get("limits")
                .and_then(|x| x.get(k))
                .and_then(Value::as_i64)
                .is_some_and(|n| n != 0)
        };
        c.jetstream = JsAccountOpts {
            enabled: given("mem_storage") || given("disk_storage"),
            max_mem: l("mem_storage"),
            max_file: l("disk_storage"),
            max_streams: l("streams"),
            max_consumers: l("consumer"),
            max_ack_pending: l("max_ack_pending"),
            max_bytes_required: acc
                .nats
                .get("limits")
                .and_then(|x| x.get("max_bytes_required"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            mem_max_stream_bytes: l("mem_max_stream_bytes"),
            disk_max_stream_bytes: l("disk_max_stream_bytes"),
        };
        c.exports = jwt_exports(&acc)?;
        c.imports = jwt_imports(&acc)?;
        c.jwt = Some(token.clone());
        c.updated = SystemTime::now();
        drop(c);
        out.insert(key.clone(), acc);
    }
    Ok(Trust { accounts: out })
}

fn kind_of(v: &Value) -> Result<ExportKind, String> {
    match v.get("type").and_then(Value::as_str).unwrap_or("stream") {
        "stream" => Ok(ExportKind::Stream),
        "service" => Ok(ExportKind::Service),
        other => Err(format!("unknown export type {other:?}")),
    }
}

fn jwt_exports(acc: &jwt::Jwt) -> Result<Vec<ExportOpts>, String> {
    let mut out = Vec::new();
    for e in acc
        .nats
        .get("exports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if e.get("token_req").and_then(Value::as_bool).unwrap_or(false) {
            return Err(format!(
                "account {}: exports that require an activation token are not supported yet",
                acc.subject
            ));
        }
        let response_type = match e.get("response_type").and_then(Value::as_str).unwrap_or("") {
            "Stream" => ResponseType::Stream,
            "Chunked" => ResponseType::Chunked,
            _ => ResponseType::Singleton,
        };
        let threshold = e
            .get("response_threshold")
            .and_then(Value::as_i64)
            .filter(|n| *n > 0)
            .map_or(conf::DEFAULT_RESPONSE_THRESHOLD, |n| {
                Duration::from_nanos(n as u64)
            });
        out.push(ExportOpts {
            kind: kind_of(e)?,
            subject: e
                .get("subject")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            accounts: None,
            response_type,
            response_threshold: threshold,
        });
    }
    Ok(out)
}

fn jwt_imports(acc: &jwt::Jwt) -> Result<Vec<ImportOpts>, String> {
    let mut out = Vec::new();
    for i in acc
        .nats
        .get("imports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let s = |k: &str| {
            i.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        let kind = kind_of(i)?;
        let subject = s("subject").unwrap_or_default();
        let (to, prefix) = match kind {
            // Older JWTs put a stream import's prefix in `to`.
            ExportKind::Stream => match s("local_subject") {
                Some(l) => (Some(l), None),
                None => (None, s("to")),
            },
            ExportKind::Service => (s("local_subject").or_else(|| s("to")), None),
        };
        out.push(ImportOpts {
            kind,
            account: s("account").unwrap_or_default(),
            subject,
            to,
            prefix,
            share: i.get("share").and_then(Value::as_bool).unwrap_or(false),
        });
    }
    Ok(out)
}

/// Whether an authenticated identity is a user's public nkey (`U` and 55 more base32
/// characters) rather than a user name.
pub fn is_user_nkey(id: &str) -> bool {
    id.len() == 56
        && id.starts_with('U')
        && id
            .bytes()
            .all(|b| b.is_ascii_uppercase() || (b'2'..=b'7').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(text: &str) -> Result<Auth, String> {
        let m = crate::conf::parse(text).map_err(|e| e.to_string())?;
        let mut o = AuthOpts::default();
        for (k, v) in m.iter() {
            conf::apply_key(&mut o, k, v, std::path::Path::new("."))?;
        }
        let accounts = Accounts::from_opts(&o);
        Auth::build(&o, &accounts)
    }

    fn creds(user: &str, pass: &str) -> Creds {
        Creds {
            user: Some(user.into()),
            pass: Some(pass.into()),
            ..Default::default()
        }
    }

    #[test]
    fn passwords_plain_and_bcrypt() {
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let a = build(&format!(
            "authorization {{ users: [{{user: alice, password: \"{hash}\"}}, {{user: bob, password: pw}}] }}"
        ))
        .unwrap();
        assert!(a.required && !a.nonce);
        assert_eq!(
            a.authenticate(&creds("alice", "s3cret"), None)
                .unwrap()
                .user,
            "alice"
        );
        assert!(a.authenticate(&creds("alice", "nope"), None).is_err());
        assert!(a.authenticate(&creds("bob", "pw"), None).is_ok());
        let e = a.authenticate(&creds("bob", "px"), None).unwrap_err();
        assert!(!e.contains("px"), "no secret in the reason: {e}");
        assert!(a.authenticate(&Creds::default(), None).is_err());
    }

    #[test]
    fn token_single_user_and_no_auth_user() {
        let a = build("authorization { token: t0k }").unwrap();
        let tok = |t: &str| Creds {
            auth_token: Some(t.into()),
            ..Default::default()
        };
        assert!(a.authenticate(&tok("t0k"), None).is_ok());
        assert!(a.authenticate(&tok("bad"), None).is_err());
        let a = build("authorization { user: u, password: p }").unwrap();
        assert!(a.authenticate(&creds("u", "p"), None).is_ok());
        assert!(a.authenticate(&creds("u", "q"), None).is_err());
        let a =
            build("accounts { A: { users: [{user: a, password: a}] } }\nno_auth_user: a").unwrap();
        let got = a.authenticate(&Creds::default(), None).unwrap();
        assert_eq!((got.user.as_str(), got.account.as_str()), ("a", "A"));
        assert!(
            build("authorization { users: [{user: a, password: a}] }\nno_auth_user: b")
                .unwrap_err()
                .contains("not present")
        );
        assert!(build("authorization { users: [{user: a}, {user: a}] }")
            .unwrap_err()
            .contains("Duplicate user"));
    }

    #[test]
    fn credentials_of_a_kind_not_configured_are_ignored() {
        // A client may send every credential it has (async-nats does with a user, a token
        // and a creds file); the reference looks only at the kind it has configured.
        let all = |token: &str| Creds {
            user: Some("js".into()),
            pass: Some("js".into()),
            auth_token: Some(token.into()),
            nkey: Some(nkeys::KeyPair::new_user().public_key()),
            sig: Some("c2ln".into()),
            jwt: Some("a.b.c".into()),
        };
        let a = build("authorization { token: s3cr3t }").unwrap();
        assert!(a.authenticate(&all("s3cr3t"), Some("n")).is_ok());
        assert!(a.authenticate(&all("wrong"), Some("n")).is_err());
        let a = build("authorization { users: [{user: js, password: js}] }").unwrap();
        assert_eq!(a.authenticate(&all("x"), Some("n")).unwrap().user, "js");
        let a = build("authorization { user: js, password: js }").unwrap();
        assert!(a.authenticate(&all("x"), Some("n")).is_ok());
        // The no_auth_user is for a client that sent no credential at all.
        let a =
            build("authorization { users: [{user: a, password: a}] }\nno_auth_user: a").unwrap();
        let named = Creds {
            user: Some("b".into()),
            ..Default::default()
        };
        assert!(a.authenticate(&named, None).is_err());
        let token_only = Creds {
            auth_token: Some("t".into()),
            ..Default::default()
        };
        assert!(a.authenticate(&token_only, None).is_err());
    }

    #[test]
    fn nkey_users_sign_the_nonce() {
        let kp = nkeys::KeyPair::new_user();
        let a = build(&format!(
            "authorization {{ users: [{{nkey: {}}}] }}",
            kp.public_key()
        ))
        .unwrap();
        assert!(a.nonce);
        let nonce = new_nonce();
        assert_eq!(nonce.len(), 15);
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(kp.sign(nonce.as_bytes()).unwrap());
        let c = Creds {
            nkey: Some(kp.public_key()),
            sig: Some(sig.clone()),
            ..Default::default()
        };
        assert!(a.authenticate(&c, Some(&nonce)).is_ok());
        assert!(a.authenticate(&c, Some("other")).is_err());
    }

    #[test]
    fn operator_mode_user_jwts() {
        use jwt::tests::encode;
        let op = nkeys::KeyPair::new_operator();
        let acc = nkeys::KeyPair::new_account();
        let user = nkeys::KeyPair::new_user();
        let ojwt = encode(
            &op,
            &serde_json::json!({"iss": op.public_key(), "sub": op.public_key(),
            "nats": {"type": "operator", "version": 2}}),
        );
        let ajwt = encode(
            &op,
            &serde_json::json!({"iss": op.public_key(), "sub": acc.public_key(),
            "nats": {"type": "account", "version": 2, "limits": {"conn": 3}}}),
        );
        let text = format!(
            "operator: {ojwt}\nresolver: MEMORY\nresolver_preload {{ {}: {ajwt} }}",
            acc.public_key()
        );
        let a = build(&text).unwrap();
        assert!(a.required && a.nonce);
        let mk = |exp: i64| {
            encode(
                &acc,
                &serde_json::json!({"iss": acc.public_key(), "sub": user.public_key(),
                "exp": exp, "nats": {"type": "user", "version": 2, "pub": {"allow": ["a.>"]}}}),
            )
        };
        let nonce = new_nonce();
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(user.sign(nonce.as_bytes()).unwrap());
        let c = |j: String| Creds {
            jwt: Some(j),
            sig: Some(sig.clone()),
            ..Default::default()
        };
        let ok = a
            .authenticate(&c(mk(now_secs() + 60)), Some(&nonce))
            .unwrap();
        assert_eq!(ok.account, acc.public_key());
        assert!(ok.expires.is_some());
        use crate::permissions::Permissions;
        assert!(!ok.perms.unwrap().can_publish(b"b"));
        let e = a
            .authenticate(&c(mk(now_secs() - 1)), Some(&nonce))
            .unwrap_err();
        assert!(e.contains("expired"), "{e}");
        // Signed by a stranger.
        let stranger = nkeys::KeyPair::new_account();
        let forged = encode(
            &stranger,
            &serde_json::json!({"iss": stranger.public_key(),
            "sub": user.public_key(), "nats": {"type": "user", "version": 2}}),
        );
        assert!(a.authenticate(&c(forged), Some(&nonce)).is_err());
    }
}
