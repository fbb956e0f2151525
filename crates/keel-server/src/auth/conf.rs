//! The reference's authentication and account configuration: `authorization { ... }`,
//! `accounts { ... }`, `no_auth_user`, `system_account`, `no_system_account`, `operator`,
//! `resolver`, `resolver_preload`, `trusted_keys`, and the `--user --pass --auth` flags.
//! Parsed into plain option structs here; [`super::Auth`] is built from them (at start and
//! at every reload). Keys the reference knows and Keel does not implement are refused by
//! name; unknown keys are errors.

use std::fmt;
use std::time::Duration;

use crate::conf::{Map, Value};

/// Everything about who may connect and where they land.
#[derive(Clone, Default)]
pub struct AuthOpts {
    /// `authorization { user, password }` or `--user/--pass`: one user in `$G`.
    pub user: Option<String>,
    pub password: Option<String>,
    /// `authorization { token }` or `--auth`.
    pub token: Option<String>,
    /// `authorization { timeout }`: how long a client has to authenticate (default 2 s).
    pub timeout: Option<Duration>,
    /// `authorization { users: [...] }`: users of `$G` (or of the account they name).
    pub users: Vec<UserOpts>,
    /// `authorization { permissions }` (alias `default_permissions`): for users without
    /// permissions of their own.
    pub default_permissions: Option<PermOpts>,
    /// `accounts { NAME: { ... } }`, in file order.
    pub accounts: Vec<AccountOpts>,
    /// `no_auth_user`: the user a client without credentials becomes.
    pub no_auth_user: Option<String>,
    /// `system_account` (default `$SYS`).
    pub system_account: Option<String>,
    /// `no_system_account: true`: no system account at all.
    pub no_system_account: bool,
    /// `operator`: operator JWTs (decentralized auth), each as read from its file or inline.
    pub operators: Vec<String>,
    /// `resolver: MEMORY` was configured (the only resolver Keel has).
    pub resolver_memory: bool,
    /// `resolver_preload { <account public key>: <account JWT> }`.
    pub resolver_preload: Vec<(String, String)>,
    /// `trusted_keys` / `trusted`: operator public keys trusted without an operator JWT.
    pub trusted_keys: Vec<String>,
}

/// Never prints a secret: options may reach a log through `{:?}`.
impl fmt::Debug for AuthOpts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthOpts")
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "[REDACTED]"))
            .field("token", &self.token.as_ref().map(|_| "[REDACTED]"))
            .field("timeout", &self.timeout)
            .field("users", &self.users.len())
            .field("accounts", &self.accounts.len())
            .field("no_auth_user", &self.no_auth_user)
            .field("system_account", &self.system_account)
            .field("operators", &self.operators.len())
            .finish()
    }
}

impl AuthOpts {
    /// Whether clients must authenticate (INFO `auth_required`).
    pub fn required(&self) -> bool {
        self.user.is_some()
            || self.token.is_some()
            || !self.users.is_empty()
            || self.accounts.iter().any(|a| !a.users.is_empty())
            || self.operator_mode()
    }

    /// Decentralized auth: operator JWTs or trusted keys.
    pub fn operator_mode(&self) -> bool {
        !self.operators.is_empty() || !self.trusted_keys.is_empty()
    }
}

/// One configured user (a name and password, or an nkey).
#[derive(Clone, Default)]
pub struct UserOpts {
    pub user: Option<String>,
    pub password: Option<String>,
    pub nkey: Option<String>,
    pub permissions: Option<PermOpts>,
    /// The account the user is in (None: `$G`, or the account block it is listed in).
    pub account: Option<String>,
}

impl fmt::Debug for UserOpts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserOpts")
            .field("user", &self.user)
            .field("nkey", &self.nkey)
            .field("account", &self.account)
            .finish()
    }
}

/// `permissions { publish, subscribe, allow_responses }`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PermOpts {
    pub publish: Option<SubjectPerm>,
    pub subscribe: Option<SubjectPerm>,
    pub response: Option<RespPerm>,
}

/// An allow list (None: not given, everything allowed) and a deny list.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SubjectPerm {
    pub allow: Option<Vec<String>>,
    pub deny: Vec<String>,
}

/// `allow_responses`: a client may publish to the reply subjects of requests it received,
/// at most `max` times each, for `expires` (zero: no time limit).
#[derive(Clone, Debug, PartialEq)]
pub struct RespPerm {
    pub max: usize,
    pub expires: Duration,
}

/// The reference's defaults for `allow_responses: true`.
pub const DEFAULT_RESP_MAX: usize = 1;
pub const DEFAULT_RESP_EXPIRES: Duration = Duration::from_secs(120);

/// One block of `accounts { NAME: { ... } }`.
#[derive(Clone, Debug, Default)]
pub struct AccountOpts {
    pub name: String,
    pub users: Vec<UserOpts>,
    pub jetstream: JsAccountOpts,
    pub exports: Vec<ExportOpts>,
    pub imports: Vec<ImportOpts>,
    pub default_permissions: Option<PermOpts>,
}

/// `jetstream` of an account: on or off, and its limits (-1: none).
#[derive(Clone, Debug, PartialEq)]
pub struct JsAccountOpts {
    pub enabled: bool,
    pub max_mem: i64,
    pub max_file: i64,
    pub max_streams: i64,
    pub max_consumers: i64,
    pub max_ack_pending: i64,
    pub max_bytes_required: bool,
    pub mem_max_stream_bytes: i64,
    pub disk_max_stream_bytes: i64,
}

impl Default for JsAccountOpts {
    fn default() -> Self {
        JsAccountOpts {
            enabled: false,
            max_mem: -1,
            max_file: -1,
            max_streams: -1,
            max_consumers: -1,
            max_ack_pending: -1,
            max_bytes_required: false,
            mem_max_stream_bytes: -1,
            disk_max_stream_bytes: -1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportKind {
    Stream,
    Service,
}

/// How a service answers: one reply, or several (a stream or chunks) until the threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ResponseType {
    #[default]
    Singleton,
    Stream,
    Chunked,
}

impl ResponseType {
    pub fn name(self) -> &'static str {
        match self {
            ResponseType::Singleton => "Singleton",
            ResponseType::Stream => "Stream",
            ResponseType::Chunked => "Chunked",
        }
    }
}

/// The reference's default `response_threshold`.
pub const DEFAULT_RESPONSE_THRESHOLD: Duration = Duration::from_secs(120);

#[derive(Clone, Debug)]
pub struct ExportOpts {
    pub kind: ExportKind,
    pub subject: String,
    /// Accounts allowed to import it (None: any).
    pub accounts: Option<Vec<String>>,
    pub response_type: ResponseType,
    pub response_threshold: Duration,
}

#[derive(Clone, Debug)]
pub struct ImportOpts {
    pub kind: ExportKind,
    /// The exporting account.
    pub account: String,
    /// The subject as exported.
    pub subject: String,
    /// Stream: the subject it arrives on here. Service: the subject requests are sent to
    /// here (default the exported one).
    pub to: Option<String>,
    /// Stream only: `prefix.<subject>`.
    pub prefix: Option<String>,
    pub share: bool,
}

fn not_supported(what: &str) -> String {
    format!("{what} is a nats-server option that keel-server does not support yet")
}

fn string(key: &str, v: &Value) -> Result<String, String> {
    match v {
        Value::Str(s) => Ok(s.clone()),
        Value::Int(i) => Ok(i.to_string()),
        _ => Err(format!("{key}: expected a string")),
    }
}

fn map<'a>(key: &str, v: &'a Value) -> Result<&'a Map, String> {
    v.as_map().ok_or_else(|| format!("{key}: expected a block"))
}

fn strings(key: &str, v: &Value) -> Result<Vec<String>, String> {
    match v {
        Value::Array(a) => a.iter().map(|x| string(key, x)).collect(),
        v => Ok(vec![string(key, v)?]),
    }
}

/// Applies one top-level key if it is an auth or account key; Ok(false) when it is not one.
pub fn apply_key(
    a: &mut AuthOpts,
    key: &str,
    v: &Value,
    dir: &std::path::Path,
) -> Result<bool, String> {
    match key.to_ascii_lowercase().as_str() {
        "authorization" => authorization(a, map(key, v)?)?,
        "accounts" => accounts(a, key, v)?,
        "no_auth_user" => a.no_auth_user = Some(string(key, v)?),
        "system_account" | "system" => a.system_account = Some(string(key, v)?),
        "no_system_account" | "no_system" | "no_sys_acc" => {
            a.no_system_account = v
                .as_bool()
                .ok_or_else(|| format!("{key}: expected a boolean"))?
        }
        "operator" | "operators" | "root" | "roots" | "root_operators" | "root_operator" => {
            for item in strings(key, v)? {
                a.operators.push(read_jwt(&item, dir)?);
            }
        }
        "resolver" | "account_resolver" | "accounts_resolver" => match v {
            Value::Str(s) if s.eq_ignore_ascii_case("MEMORY") => a.resolver_memory = true,
            Value::Str(s) if s.to_ascii_uppercase().starts_with("URL(") => {
                return Err(not_supported("resolver URL(...)"))
            }
            Value::Map(_) => return Err(not_supported("a full or cache resolver")),
            _ => return Err(format!("{key}: expected MEMORY")),
        },
        "resolver_preload" => {
            for (k, v) in map(key, v)?.iter() {
                a.resolver_preload
                    .push((k.to_string(), string(k, v)?.trim().to_string()));
            }
        }
        "trusted" | "trusted_keys" => a.trusted_keys.extend(strings(key, v)?),
        _ => return Ok(false),
    }
    Ok(true)
}

/// An operator JWT given inline or as a file (relative to the config file's directory).
fn read_jwt(item: &str, dir: &std::path::Path) -> Result<String, String> {
    let item = item.trim();
    if item.starts_with("eyJ") && item.matches('.').count() == 2 {
        return Ok(item.to_string());
    }
    let path = dir.join(item);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("operator: cannot read {}: {e}", path.display()))?;
    // A JWT file may carry the decorated form (BEGIN/END lines) or just the token.
    text.lines()
        .map(str::trim)
        .find(|l| l.starts_with("eyJ"))
        .map(str::to_string)
        .ok_or_else(|| format!("operator: no JWT in {}", path.display()))
}

fn authorization(a: &mut AuthOpts, m: &Map) -> Result<(), String> {
    for (k, v) in m.iter() {
        match k.to_ascii_lowercase().as_str() {
            "user" | "username" => a.user = Some(string(k, v)?),
            "pass" | "password" => a.password = Some(string(k, v)?),
            "token" => a.token = Some(string(k, v)?),
            "timeout" => {
                a.timeout = Some(match v {
                    Value::Float(f) => Duration::try_from_secs_f64(*f)
                        .map_err(|e| format!("{k}: invalid duration: {e}"))?,
                    v => v.as_duration().map_err(|e| format!("{k}: {e}"))?,
                })
            }
            "users" => a.users.extend(users(k, v, None)?),
            "default_permission" | "default_permissions" | "permissions" => {
                a.default_permissions = Some(permissions(k, v)?)
            }
            "auth_callout" | "callout" | "proxy_required" => {
                return Err(not_supported(&format!("authorization key {k:?}")))
            }
            _ => return Err(format!("unknown authorization key {k:?}")),
        }
    }
    if a.user.is_some() && !a.users.is_empty() {
        return Err("Can not have a single user/pass and a users array".into());
    }
    if a.token.is_some() && !a.users.is_empty() {
        return Err("Can not have a token and a users array".into());
    }
    if a.token.is_some() && a.user.is_some() {
        return Err("Cannot have a user/pass and token".into());
    }
    Ok(())
}

fn users(key: &str, v: &Value, account: Option<&str>) -> Result<Vec<UserOpts>, String> {
    let Value::Array(items) = v else {
        return Err(format!("{key}: expected an array of users"));
    };
    let mut out = Vec::new();
    for item in items {
        let m = map(key, item)?;
        let mut u = UserOpts {
            account: account.map(str::to_string),
            ..Default::default()
        };
        for (k, v) in m.iter() {
            match k.to_ascii_lowercase().as_str() {
                "user" | "username" => u.user = Some(string(k, v)?),
                "pass" | "password" => u.password = Some(string(k, v)?),
                "nkey" => u.nkey = Some(string(k, v)?),
                "permission" | "permissions" => u.permissions = Some(permissions(k, v)?),
                "account" => u.account = Some(string(k, v)?),
                "allowed_connection_types" | "connection_types" | "proxy_required" => {
                    return Err(not_supported(&format!("user key {k:?}")))
                }
                _ => return Err(format!("unknown user key {k:?}")),
            }
        }
        match (&u.user, &u.nkey) {
            (None, None) => return Err("User entry requires a user or an nkey".into()),
            (Some(_), Some(_)) => return Err("Nkey users do not take a user name".into()),
            (None, Some(n)) => {
                if u.password.is_some() {
                    return Err("Nkey users do not take a password".into());
                }
                if !(n.starts_with('U') && nkeys::KeyPair::from_public_key(n).is_ok()) {
                    return Err(format!("Not a valid public nkey for a user: {n:?}"));
                }
            }
            _ => {}
        }
        out.push(u);
    }
    Ok(out)
}

pub fn permissions(key: &str, v: &Value) -> Result<PermOpts, String> {
    let m = map(key, v)?;
    let mut p = PermOpts::default();
    for (k, v) in m.iter() {
        match k.to_ascii_lowercase().as_str() {
            "pub" | "publish" | "import" => p.publish = Some(subject_perm(k, v)?),
            "sub" | "subscribe" | "export" => p.subscribe = Some(subject_perm(k, v)?),
            "publish_allow_responses" | "allow_responses" => {
                p.response = match v {
                    Value::Bool(false) => None,
                    Value::Bool(true) => Some(RespPerm {
                        max: DEFAULT_RESP_MAX,
                        expires: DEFAULT_RESP_EXPIRES,
                    }),
                    Value::Map(m) => {
                        let mut r = RespPerm {
                            max: DEFAULT_RESP_MAX,
                            expires: DEFAULT_RESP_EXPIRES,
                        };
                        for (k, v) in m.iter() {
                            match k.to_ascii_lowercase().as_str() {
                                "max" | "max_msgs" | "max_messages" | "max_responses" => {
                                    r.max = v
                                        .as_i64()
                                        .filter(|n| *n >= 0)
                                        .ok_or_else(|| format!("{k}: expected a count"))?
                                        as usize
                                }
                                "expires" | "expiration" | "ttl" => {
                                    r.expires = v.as_duration().map_err(|e| format!("{k}: {e}"))?
                                }
                                _ => return Err(format!("unknown allow_responses key {k:?}")),
                            }
                        }
                        Some(r)
                    }
                    _ => return Err(format!("{k}: expected a boolean or a block")),
                }
            }
            _ => return Err(format!("unknown permissions key {k:?}")),
        }
    }
    Ok(p)
}

fn subject_perm(key: &str, v: &Value) -> Result<SubjectPerm, String> {
    let mut p = SubjectPerm::default();
    match v {
        Value::Map(m) => {
            for (k, v) in m.iter() {
                match k.to_ascii_lowercase().as_str() {
                    "allow" => p.allow = Some(checked_subjects(k, v)?),
                    "deny" => p.deny = checked_subjects(k, v)?,
                    _ => return Err(format!("unknown {key} permission key {k:?}")),
                }
            }
        }
        v => p.allow = Some(checked_subjects(key, v)?),
    }
    Ok(p)
}

/// Permission subjects, each optionally followed by a queue group (`"foo.> workers"`).
fn checked_subjects(key: &str, v: &Value) -> Result<Vec<String>, String> {
    let list = strings(key, v)?;
    for s in &list {
        let mut parts = s.split_whitespace();
        let subject = parts.next().unwrap_or("");
        let queue = parts.next();
        if !keel_protocol::subject::valid_subscribe(subject.as_bytes())
            || parts.next().is_some()
            || queue.is_some_and(|q| !keel_protocol::subject::valid_subscribe(q.as_bytes()))
        {
            return Err(format!("{key}: invalid subject {s:?} in permissions"));
        }
    }
    Ok(list)
}

fn accounts(a: &mut AuthOpts, key: &str, v: &Value) -> Result<(), String> {
    let m = map(key, v)?;
    for (name, body) in m.iter() {
        if a.accounts.iter().any(|x| x.name == name) {
            return Err(format!("Duplicate Account Entry: {name}"));
        }
        let mut acc = AccountOpts {
            name: name.to_string(),
            ..Default::default()
        };
        let body = match body {
            Value::Map(m) => m.clone(),
            // `accounts { A {} }` and `accounts [A]`-like empty forms.
            Value::Str(_) | Value::Array(_) => Map::default(),
            _ => return Err(format!("account {name}: expected a block")),
        };
        for (k, v) in body.iter() {
            match k.to_ascii_lowercase().as_str() {
                "users" => acc.users.extend(users(k, v, Some(name))?),
                "jetstream" => acc.jetstream = js_account(k, v)?,
                "exports" => acc.exports = exports(k, v)?,
                "imports" => acc.imports = imports(k, v)?,
                "default_permissions" | "default_permission" => {
                    acc.default_permissions = Some(permissions(k, v)?)
                }
                "nkey" | "mappings" | "maps" | "limits" | "msg_trace" | "trace_dest" => {
                    return Err(not_supported(&format!("account key {k:?}")))
                }
                _ => return Err(format!("unknown account key {k:?} in account {name}")),
            }
        }
        a.accounts.push(acc);
    }
    Ok(())
}

fn js_account(key: &str, v: &Value) -> Result<JsAccountOpts, String> {
    let mut j = JsAccountOpts::default();
    match v {
        Value::Bool(b) => j.enabled = *b,
        Value::Str(s) if matches!(s.to_ascii_lowercase().as_str(), "enabled" | "enable") => {
            j.enabled = true
        }
        Value::Str(s) if matches!(s.to_ascii_lowercase().as_str(), "disabled" | "disable") => {}
        Value::Map(m) => {
            j.enabled = true;
            for (k, v) in m.iter() {
                let size = || v.as_size().map_err(|e| format!("{k}: {e}"));
                match k.to_ascii_lowercase().as_str() {
                    "max_mem" | "max_memory" | "mem" | "memory" | "max_mem_store"
                    | "max_memory_store" => j.max_mem = size()?,
                    "max_file" | "max_store" | "max_disk" | "store" | "disk" | "max_file_store" => {
                        j.max_file = size()?
                    }
                    "max_streams" | "max_stream" | "streams" => j.max_streams = int(k, v)?,
                    "max_consumers" | "max_consumer" | "consumers" => j.max_consumers = int(k, v)?,
                    "max_ack_pending" => j.max_ack_pending = int(k, v)?,
                    "max_bytes_required"
                    | "max_stream_bytes_required"
                    | "max_stream_bytes"
                    | "max_bytes" => {
                        j.max_bytes_required = v
                            .as_bool()
                            .ok_or_else(|| format!("{k}: expected a boolean"))?
                    }
                    "mem_max_stream_bytes" | "memory_max_stream_bytes" | "max_mem_stream_bytes" => {
                        j.mem_max_stream_bytes = size()?
                    }
                    "disk_max_stream_bytes"
                    | "max_disk_stream_bytes"
                    | "store_max_stream_bytes" => j.disk_max_stream_bytes = size()?,
                    "enabled" => {
                        j.enabled = v
                            .as_bool()
                            .ok_or_else(|| format!("{k}: expected a boolean"))?
                    }
                    "cluster_traffic" | "tiered_limits" | "limits" => {
                        return Err(not_supported(&format!("account jetstream key {k:?}")))
                    }
                    _ => return Err(format!("unknown account jetstream key {k:?}")),
                }
            }
        }
        _ => {
            return Err(format!(
                "{key}: expected a block, a boolean or enabled/disabled"
            ))
        }
    }
    Ok(j)
}

fn int(key: &str, v: &Value) -> Result<i64, String> {
    v.as_i64()
        .ok_or_else(|| format!("{key}: expected an integer"))
}

fn exports(key: &str, v: &Value) -> Result<Vec<ExportOpts>, String> {
    let Value::Array(items) = v else {
        return Err(format!("{key}: expected an array"));
    };
    let mut out = Vec::new();
    for item in items {
        let m = map(key, item)?;
        let mut kind = None;
        let mut subject = String::new();
        let mut accounts = None;
        let mut response_type = ResponseType::Singleton;
        let mut response_threshold = DEFAULT_RESPONSE_THRESHOLD;
        for (k, v) in m.iter() {
            match k.to_ascii_lowercase().as_str() {
                "stream" => {
                    kind = Some(ExportKind::Stream);
                    subject = string(k, v)?;
                }
                "service" => {
                    kind = Some(ExportKind::Service);
                    subject = string(k, v)?;
                }
                "accounts" => accounts = Some(strings(k, v)?),
                "response" | "response_type" => {
                    response_type = match string(k, v)?.to_ascii_lowercase().as_str() {
                        "single" | "singleton" => ResponseType::Singleton,
                        "stream" => ResponseType::Stream,
                        "chunk" | "chunked" => ResponseType::Chunked,
                        other => return Err(format!("Unknown response type: {other:?}")),
                    }
                }
                "threshold" | "response_threshold" | "response_max_time" | "response_time" => {
                    response_threshold = v.as_duration().map_err(|e| format!("{k}: {e}"))?
                }
                "latency" | "account_token_position" | "advertise" | "allow_trace" => {
                    return Err(not_supported(&format!("export key {k:?}")))
                }
                _ => return Err(format!("unknown export key {k:?}")),
            }
        }
        let kind = kind.ok_or("export needs a stream or a service subject")?;
        if !keel_protocol::subject::valid_subscribe(subject.as_bytes()) {
            return Err(format!("invalid export subject {subject:?}"));
        }
        if kind == ExportKind::Stream && m.get("response_type").is_some() {
            return Err("Detected response directive on non-service".into());
        }
        out.push(ExportOpts {
            kind,
            subject,
            accounts,
            response_type,
            response_threshold,
        });
    }
    Ok(out)
}

fn imports(key: &str, v: &Value) -> Result<Vec<ImportOpts>, String> {
    let Value::Array(items) = v else {
        return Err(format!("{key}: expected an array"));
    };
    let mut out = Vec::new();
    for item in items {
        let m = map(key, item)?;
        let mut imp = None;
        let mut to = None;
        let mut prefix = None;
        let mut share = false;
        for (k, v) in m.iter() {
            match k.to_ascii_lowercase().as_str() {
                kind @ ("stream" | "service") => {
                    let body = map(k, v)?;
                    let account = body
                        .get("account")
                        .map(|v| string("account", v))
                        .transpose()?
                        .ok_or("import needs an account")?;
                    let subject = body
                        .get("subject")
                        .map(|v| string("subject", v))
                        .transpose()?
                        .ok_or("import needs a subject")?;
                    for (bk, _) in body.iter() {
                        if !matches!(bk.to_ascii_lowercase().as_str(), "account" | "subject") {
                            return Err(format!("unknown import key {bk:?}"));
                        }
                    }
                    let kind = if kind == "stream" {
                        ExportKind::Stream
                    } else {
                        ExportKind::Service
                    };
                    imp = Some((kind, account, subject));
                }
                "to" => to = Some(string(k, v)?),
                "prefix" => prefix = Some(string(k, v)?),
                "share" => {
                    share = v
                        .as_bool()
                        .ok_or_else(|| format!("{k}: expected a boolean"))?
                }
                "allow_trace" => return Err(not_supported(&format!("import key {k:?}"))),
                _ => return Err(format!("unknown import key {k:?}")),
            }
        }
        let (kind, account, subject) = imp.ok_or("import needs a stream or a service")?;
        if !keel_protocol::subject::valid_subscribe(subject.as_bytes()) {
            return Err(format!("invalid import subject {subject:?}"));
        }
        if kind == ExportKind::Service && prefix.is_some() {
            return Err("prefix is only for stream imports (use to)".into());
        }
        if to.is_some() && prefix.is_some() {
            return Err("an import takes either to or prefix".into());
        }
        for s in to.iter().chain(prefix.iter()) {
            if !keel_protocol::subject::valid_subscribe(s.as_bytes()) {
                return Err(format!("invalid import subject {s:?}"));
            }
        }
        out.push(ImportOpts {
            kind,
            account,
            subject,
            to,
            prefix,
            share,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<AuthOpts, String> {
        let m = crate::conf::parse(text).map_err(|e| e.to_string())?;
        let mut a = AuthOpts::default();
        for (k, v) in m.iter() {
            assert!(apply_key(&mut a, k, v, std::path::Path::new("."))?, "{k}");
        }
        Ok(a)
    }

    #[test]
    fn authorization_block() {
        let a = parse(
            r#"authorization { timeout: 0.5, users: [
                 {user: alice, password: "$2a$11$abc"}
                 {user: bob, password: pw, permissions: {publish: "bob.>",
                   subscribe: {allow: ["bob.>", "_INBOX.>"], deny: "bob.secret"},
                   allow_responses: {max: 3, expires: "1s"}}}
               ] }"#,
        )
        .unwrap();
        assert!(a.required());
        assert_eq!(a.timeout, Some(Duration::from_millis(500)));
        assert_eq!(a.users.len(), 2);
        let p = a.users[1].permissions.as_ref().unwrap();
        assert_eq!(
            p.publish.as_ref().unwrap().allow,
            Some(vec!["bob.>".into()])
        );
        assert_eq!(
            p.subscribe.as_ref().unwrap().deny,
            vec!["bob.secret".to_string()]
        );
        assert_eq!(
            p.response,
            Some(RespPerm {
                max: 3,
                expires: Duration::from_secs(1)
            })
        );
        assert!(!format!("{a:?}").contains("abc"), "no secret in Debug");
        assert!(parse("authorization { user: a, users: [{user: b}] }")
            .unwrap_err()
            .contains("single user"));
        assert!(parse("authorization { bogus: 1 }")
            .unwrap_err()
            .contains("unknown authorization key"));
        assert!(
            parse("authorization { users: [{user: a, permissions: {publish: \"a..b\"}}] }")
                .unwrap_err()
                .contains("invalid subject")
        );
    }

    #[test]
    fn accounts_block() {
        let a = parse(
            r#"accounts {
                 A: { users: [{user: a, password: a}], jetstream: {max_mem: 1M, max_streams: 2},
                      exports: [{stream: "ev.>"}, {service: "help", response_type: stream, accounts: [B]}] }
                 B: { users: [{user: b, password: b}], jetstream: enabled,
                      imports: [{stream: {account: A, subject: "ev.>"}, prefix: "a"},
                                {service: {account: A, subject: "help"}, to: "a.help"}] }
               }
               no_auth_user: a
               system_account: SYS"#,
        )
        .unwrap();
        assert_eq!(a.accounts.len(), 2);
        assert_eq!(a.accounts[0].jetstream.max_mem, 1_000_000);
        assert_eq!(a.accounts[0].jetstream.max_streams, 2);
        assert!(a.accounts[1].jetstream.enabled);
        assert_eq!(a.accounts[0].exports[1].response_type, ResponseType::Stream);
        assert_eq!(a.accounts[1].imports[0].prefix.as_deref(), Some("a"));
        assert_eq!(a.accounts[1].imports[1].to.as_deref(), Some("a.help"));
        assert_eq!(a.accounts[0].users[0].account.as_deref(), Some("A"));
        assert_eq!(a.no_auth_user.as_deref(), Some("a"));
        assert_eq!(a.system_account.as_deref(), Some("SYS"));
        assert!(parse("accounts { A: { mappings: {} } }")
            .unwrap_err()
            .contains("does not support yet"));
    }

    #[test]
    fn account_jetstream_keys_take_the_reference_aliases() {
        // nats.py's js-limits.conf spells them this way.
        let a = parse(
            "accounts { A: { jetstream: { memory: 1M, disk: 2M, streams: 3, consumers: 4, \
             memory_max_stream_bytes: 2048, store_max_stream_bytes: 4096, max_stream_bytes: true } } }",
        )
        .unwrap();
        let j = &a.accounts[0].jetstream;
        assert_eq!((j.max_mem, j.max_file), (1_000_000, 2_000_000));
        assert_eq!((j.max_streams, j.max_consumers), (3, 4));
        assert_eq!(
            (j.mem_max_stream_bytes, j.disk_max_stream_bytes),
            (2048, 4096)
        );
        assert!(j.max_bytes_required);
        let a = parse("accounts { A: { jetstream: { mem: 5M, store: 6M, max_bytes: false } } }")
            .unwrap();
        let j = &a.accounts[0].jetstream;
        assert_eq!((j.max_mem, j.max_file), (5_000_000, 6_000_000));
        assert!(!j.max_bytes_required);
    }
}
