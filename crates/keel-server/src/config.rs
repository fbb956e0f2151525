//! Server options: defaults, the nats-server command line, and the nats-server config file.
//!
//! Flags are parsed by hand rather than with clap because the reference's flags include
//! multi-letter single-dash forms (`-js`, `-sd`, `-DV`) that launchers pass verbatim. A config
//! file is applied first and flags override it, as with the reference.

use std::path::PathBuf;
use std::time::Duration;

use crate::conf::{self, Map, Value};

/// The nats-server release whose JetStream API level Keel implements (level 1, as
/// `jetstream::stream::API_LEVEL`: nats-server 2.11 introduced it; 2.12 is level 2-3, 2.14
/// level 4, 2.15 level 5). Advertised in INFO `version`, `/varz` and `_nats.ver` because
/// clients gate features on it; the two must move together.
pub const COMPAT_VERSION: &str = "2.11.0";
/// Keel's own version.
pub const KEEL_VERSION: &str = env!("CARGO_PKG_VERSION");
/// The toolchain Keel was built with, where the reference names its Go runtime (INFO and
/// /varz `go`).
pub const TOOLCHAIN: &str = concat!("rustc ", env!("KEEL_RUSTC_VERSION"));
/// The commit Keel was built from (7 characters; empty outside a git checkout).
pub const GIT_COMMIT: &str = env!("KEEL_GIT_COMMIT");

#[derive(Debug, Clone)]
pub struct Opts {
    pub host: String,
    /// 0 or -1 (RANDOM_PORT) picks a free port.
    pub port: i64,
    pub server_name: Option<String>,
    pub http_host: Option<String>,
    pub http_port: Option<i64>,
    pub max_payload: usize,
    pub max_connections: usize,
    pub max_pending: usize,
    pub ping_interval: Duration,
    pub ping_max: u32,
    pub write_deadline: Duration,
    /// Lame-duck mode (SIGUSR2): how long to spread client closes over, and how long to wait
    /// before the first close.
    pub lame_duck_duration: Duration,
    pub lame_duck_grace_period: Duration,
    pub jetstream: bool,
    pub store_dir: Option<PathBuf>,
    pub max_memory_store: Option<i64>,
    pub max_file_store: Option<i64>,
    /// `jetstream { sync_interval }`: None (the default, `always`) syncs before every ack;
    /// a duration acknowledges at once and syncs on that interval (the reference's mode).
    pub sync_interval: Option<Duration>,
    /// `jetstream { index_cache_size }`: memory for file streams' message index entries
    /// read from disk, shared by all streams (keel's own key; default 64 MiB).
    pub index_cache_size: Option<i64>,
    /// `jetstream { strict }`: refuse API requests with fields the reference does not know
    /// (the reference's default, true) or decode them ignoring those fields.
    pub jetstream_strict: bool,
    /// `jetstream { domain }`: the JetStream domain, also served on `$JS.<domain>.API.>`.
    pub jetstream_domain: Option<String>,
    pub debug: bool,
    pub trace: bool,
    pub logtime: bool,
    pub log_file: Option<PathBuf>,
    pub pid_file: Option<PathBuf>,
    pub config_file: Option<PathBuf>,
    /// `-t`: check the configuration and exit.
    pub check_config: bool,
    /// `max_closed_clients`: how many closed connections `/connz?state=closed` remembers.
    pub max_closed_clients: usize,
    /// `http_dashboard`: serve the live dashboard at `/dashboard` on the monitoring port.
    pub http_dashboard: bool,
    /// `https_port` / `-ms`: monitoring over HTTPS with the `tls` block's certificates.
    pub https_port: Option<i64>,
    /// The `tls { }` block as written (the flags may replace it: see `tls`).
    pub tls_opts: Option<crate::tls::TlsOpts>,
    /// `allow_non_tls`: with TLS configured, plain clients are served too.
    pub allow_non_tls: bool,
    /// TLS as the server runs it, loaded once the config and the flags are merged.
    pub tls: Option<std::sync::Arc<crate::tls::Tls>>,
    /// Authentication, accounts and the system account (`authorization`, `accounts`,
    /// `no_auth_user`, `system_account`, `operator`, `resolver`..., `--user --pass --auth`).
    pub auth: crate::auth::conf::AuthOpts,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            host: "0.0.0.0".into(),
            port: 4222,
            server_name: None,
            http_host: None,
            http_port: None,
            max_payload: 1024 * 1024,
            max_connections: 64 * 1024,
            max_pending: 64 * 1024 * 1024,
            ping_interval: Duration::from_secs(120),
            ping_max: 2,
            write_deadline: Duration::from_secs(10),
            lame_duck_duration: Duration::from_secs(120),
            lame_duck_grace_period: Duration::from_secs(10),
            jetstream: false,
            store_dir: None,
            max_memory_store: None,
            max_file_store: None,
            sync_interval: None,
            index_cache_size: None,
            jetstream_strict: true,
            jetstream_domain: None,
            debug: false,
            trace: false,
            logtime: true,
            log_file: None,
            pid_file: None,
            config_file: None,
            check_config: false,
            max_closed_clients: 10_000,
            http_dashboard: true,
            https_port: None,
            tls_opts: None,
            allow_non_tls: false,
            tls: None,
            auth: Default::default(),
        }
    }
}

/// What the command line asked for.
#[derive(Debug)]
pub enum Command {
    Run(Box<Opts>),
    /// `--signal <command>[=<pid or pid file>]`: signal a running server and exit.
    Signal(String),
    Help,
    Version,
}

pub const USAGE: &str = "\
Usage: keel-server [options]

Server Options:
    -a, --addr, --net <host>         Bind to host address (default: 0.0.0.0)
    -p, --port <port>                Use port for clients (default: 4222; -1 picks a free port)
    -n, --name, --server_name <name> Server name (default: the server id)
    -P, --pid <file>                 File to store PID
    -m, --http_port <port>           Use port for http monitoring
    -ms,--https_port <port>          Use port for https monitoring (with the TLS certificates)
    -c, --config <file>              Configuration file (nats-server format)
    -t                               Test configuration and exit
        --max_payload <size>         Maximum message payload (default: 1MB)
    -sl,--signal <signal>[=<pid>]    Send signal to keel-server process (ldm, stop, quit, term,
                                     reopen, reload); pid is a number or a pid file

Logging Options:
    -l, --log <file>                 File to redirect log output
    -T, --logtime[=bool]             Timestamp log entries (default: true)
    -D, --debug[=bool]               Enable debugging output
    -V, --trace[=bool]               Trace the raw protocol
    -DV                              Debug and trace

TLS Options:
        --tls[=bool]                 Enable TLS (--tls=false turns off the config's TLS)
        --tlscert <file>             Server certificate file
        --tlskey <file>              Private key for server certificate
        --tlsverify[=bool]           Enable TLS, verify client certificates
        --tlscacert <file>           Client certificate CA for verification

Authorization Options:
        --user <user>                User required for connections
        --pass <password>            Password required for connections
        --auth <token>               Authorization token required for connections

JetStream Options:
    -js, --jetstream[=bool]          Enable JetStream functionality
    -sd, --store_dir <dir>           Set the storage directory

Common Options:
    -h, --help                       Show this message
    -v, --version                    Show version

Config file keys: port, listen, host, server_name, http_port, http, max_payload,
max_connections, max_pending, ping_interval, ping_max, write_deadline, lame_duck_duration,
lame_duck_grace_period, max_closed_clients, http_dashboard, debug, trace, logtime,
log_file, pid_file, store_dir, https_port, https, allow_non_tls, tls { cert_file, key_file,
ca_file, certs, verify, verify_and_map, insecure, timeout, handshake_first, cipher_suites,
curve_preferences, allow_insecure_cipher_suites, min_version, pinned_certs,
connection_rate_limit }, jetstream { store_dir, max_memory_store, max_file_store,
sync_interval, index_cache_size, strict, domain, enabled }, authorization { user, password, token, timeout,
users, permissions }, accounts { NAME: { users, jetstream, exports, imports,
default_permissions } }, no_auth_user, system_account, no_system_account, operator, resolver:
MEMORY, resolver_preload, trusted_keys.
Other nats-server flags and keys are refused as not supported yet.
";

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Bool,
    Value,
}

/// Every flag we take: (names, kind, canonical name).
const FLAGS: &[(&[&str], Kind, &str)] = &[
    (&["a", "addr", "net"], Kind::Value, "addr"),
    (&["p", "port"], Kind::Value, "port"),
    (&["n", "name", "server_name"], Kind::Value, "name"),
    (&["P", "pid"], Kind::Value, "pid"),
    (&["m", "http_port"], Kind::Value, "http_port"),
    (&["ms", "https_port"], Kind::Value, "https_port"),
    (&["tls"], Kind::Bool, "tls"),
    (&["tlscert"], Kind::Value, "tlscert"),
    (&["tlskey"], Kind::Value, "tlskey"),
    (&["tlscacert"], Kind::Value, "tlscacert"),
    (&["tlsverify"], Kind::Bool, "tlsverify"),
    (&["c", "config"], Kind::Value, "config"),
    (&["t"], Kind::Bool, "t"),
    (&["max_payload"], Kind::Value, "max_payload"),
    (&["l", "log"], Kind::Value, "log"),
    (&["T", "logtime"], Kind::Bool, "logtime"),
    (&["D", "debug"], Kind::Bool, "debug"),
    (&["V", "trace"], Kind::Bool, "trace"),
    (&["DV"], Kind::Bool, "DV"),
    (&["VV"], Kind::Bool, "VV"),
    (&["DVV"], Kind::Bool, "DVV"),
    (&["js", "jetstream"], Kind::Bool, "js"),
    (&["sd", "store_dir"], Kind::Value, "store_dir"),
    (&["user"], Kind::Value, "user"),
    (&["pass"], Kind::Value, "pass"),
    (&["auth"], Kind::Value, "auth"),
    (&["sl", "signal"], Kind::Value, "signal"),
    (&["h", "help"], Kind::Bool, "help"),
    (&["v", "version"], Kind::Bool, "version"),
];

/// Reference flags we know but do not implement: refused by name rather than "unknown".
const UNSUPPORTED: &[&str] = &[
    "help_tls",
    "routes",
    "cluster",
    "cluster_name",
    "cluster_advertise",
    "cluster_listen",
    "no_advertise",
    "connect_retries",
    "s",
    "syslog",
    "r",
    "remote_syslog",
    "client_advertise",
    "ports_file_dir",
    "max_traced_msg_len",
    "logtime_utc",
    "log_size_limit",
    "profile",
];

/// Top-level config keys of the reference that Keel does not implement (refused as "not
/// supported yet"; anything else is an unknown key).
const UNSUPPORTED_KEYS: &[&str] = &[
    "client_advertise",
    "trace_verbose",
    "trace_headers",
    "logtime_utc",
    "mappings",
    "maps",
    "disable_sublist_cache",
    "no_sublist_cache",
    "default_sentinel",
    "http_base_path",
    "cluster",
    "gateway",
    "leaf",
    "leafnodes",
    "logfile_size_limit",
    "log_size_limit",
    "logfile_max_num",
    "log_max_num",
    "syslog",
    "remote_syslog",
    "ports_file_dir",
    "prof_port",
    "prof_block_rate",
    "max_control_line",
    "proxy_protocol",
    "max_traced_msg_len",
    "max_subscriptions",
    "max_subs",
    "max_sub_tokens",
    "max_subscription_tokens",
    "ocsp",
    "write_timeout",
    "resolver_tls",
    "resolver_pinned_accounts",
    "no_header_support",
    "connect_error_reports",
    "reconnect_error_reports",
    "websocket",
    "ws",
    "mqtt",
    "server_tags",
    "server_metadata",
    "feature_flags",
    "default_js_domain",
    "ocsp_cache",
    "no_fast_producer_stall",
    "max_closed_clients",
    "proxies",
];

/// `jetstream { ... }` keys of the reference that Keel does not implement.
const UNSUPPORTED_JETSTREAM_KEYS: &[&str] = &[
    // Encryption at rest.
    "key",
    "ek",
    "encryption_key",
    "prev_key",
    "prev_ek",
    "prev_encryption_key",
    "cipher",
    "tpm",
    // Operator-mode account limits and server-wide JetStream limits.
    "extension_hint",
    "limits",
    // Clustering.
    "unique_tag",
    "max_outstanding_catchup",
    "meta_compact",
    "meta_compact_size",
    "meta_compact_sync",
    // Ingest and API queue tuning.
    "max_buffered_size",
    "max_buffered_msgs",
    "request_queue_limit",
    "info_queue_limit",
    "max_concurrent_io",
];

fn not_supported(what: &str) -> String {
    format!("{what} is a nats-server option that keel-server does not support yet")
}

fn parse_bool(flag: &str, v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "t" | "true" => Ok(true),
        "0" | "f" | "false" => Ok(false),
        _ => Err(format!("invalid boolean value {v:?} for flag -{flag}")),
    }
}

fn parse_port(flag: &str, v: &str) -> Result<i64, String> {
    match v.parse::<i64>() {
        Ok(p) if (-1..=65535).contains(&p) => Ok(p),
        _ => Err(format!("invalid port {v:?} for flag -{flag}")),
    }
}

/// Parses the command line (without the program name) into a [`Command`].
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Command, String> {
    let mut flags: Vec<(&'static str, Option<String>)> = vec![];
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let Some(stripped) = arg.strip_prefix('-') else {
            return Err(format!("unexpected argument {arg:?} (see --help)"));
        };
        let stripped = stripped.strip_prefix('-').unwrap_or(stripped);
        let (name, inline) = match stripped.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (stripped, None),
        };
        let Some(&(_, kind, canon)) = FLAGS.iter().find(|(names, _, _)| names.contains(&name))
        else {
            if UNSUPPORTED.contains(&name) {
                return Err(not_supported(&format!("flag {arg:?}")));
            }
            return Err(format!("unknown flag {arg:?} (see --help)"));
        };
        let value = match (kind, inline) {
            (Kind::Bool, v) => Some(v.unwrap_or_else(|| "true".into())),
            (Kind::Value, Some(v)) => Some(v),
            (Kind::Value, None) => Some(
                it.next()
                    .ok_or_else(|| format!("flag {arg:?} needs a value"))?,
            ),
        };
        flags.push((canon, value));
    }

    let mut opts = Opts::default();
    // The reference's --tls* flags: any of them replaces the config's TLS setup, and
    // --tls=false turns TLS off whatever the others say.
    let mut tls_flags = TlsFlags::default();
    // The config file goes first; flags override what it says.
    if let Some((_, Some(path))) = flags.iter().rev().find(|(c, _)| *c == "config") {
        let path = PathBuf::from(path);
        let map = conf::parse_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Set first: files the config names (operator JWTs) are relative to it.
        opts.config_file = Some(path.clone());
        apply_config(&mut opts, &map).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    for (canon, value) in flags {
        let v = value.unwrap_or_default();
        match canon {
            "help" if parse_bool(canon, &v)? => return Ok(Command::Help),
            "version" if parse_bool(canon, &v)? => return Ok(Command::Version),
            "help" | "version" | "config" => {}
            "addr" => opts.host = v,
            "port" => opts.port = parse_port("p", &v)?,
            "name" => opts.server_name = Some(v),
            "pid" => opts.pid_file = Some(v.into()),
            "http_port" => opts.http_port = Some(parse_port("m", &v)?),
            "https_port" => opts.https_port = Some(parse_port("ms", &v)?),
            "tls" => {
                let on = parse_bool(canon, &v)?;
                tls_flags.disabled |= !on;
                tls_flags.set = true;
            }
            "tlscert" => (tls_flags.cert, tls_flags.set) = (Some(v.into()), true),
            "tlskey" => (tls_flags.key, tls_flags.set) = (Some(v.into()), true),
            "tlscacert" => (tls_flags.ca, tls_flags.set) = (Some(v.into()), true),
            "tlsverify" => (tls_flags.verify, tls_flags.set) = (parse_bool(canon, &v)?, true),
            "t" => opts.check_config = parse_bool(canon, &v)?,
            "max_payload" => {
                opts.max_payload = positive_size("max_payload", &Value::Str(v.clone()))?
            }
            "log" => opts.log_file = Some(v.into()),
            "logtime" => opts.logtime = parse_bool(canon, &v)?,
            "debug" => opts.debug = parse_bool(canon, &v)?,
            "trace" => opts.trace = parse_bool(canon, &v)?,
            "DV" | "VV" | "DVV" => {
                let on = parse_bool(canon, &v)?;
                opts.trace = on;
                if canon != "VV" {
                    opts.debug = on;
                }
            }
            "js" => opts.jetstream = parse_bool(canon, &v)?,
            "store_dir" => opts.store_dir = Some(v.into()),
            // Flags override the config file, as the reference's do.
            "user" => opts.auth.user = Some(v),
            "pass" => opts.auth.password = Some(v),
            "auth" => opts.auth.token = Some(v),
            "signal" => return Ok(Command::Signal(v)),
            _ => unreachable!("flag table and match agree"),
        }
    }
    if tls_flags.disabled {
        opts.tls_opts = None;
    } else if tls_flags.set {
        opts.tls_opts = Some(crate::tls::from_flags(
            opts.tls_opts.as_ref(),
            tls_flags.cert,
            tls_flags.key,
            tls_flags.ca,
            tls_flags.verify,
        )?);
    }
    finish_tls(&mut opts)?;
    Ok(Command::Run(Box::new(opts)))
}

#[derive(Default)]
struct TlsFlags {
    set: bool,
    disabled: bool,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    ca: Option<PathBuf>,
    verify: bool,
}

/// Loads the TLS certificates (a bad file is a configuration error, as with the reference)
/// and checks the options that need TLS.
pub fn finish_tls(opts: &mut Opts) -> Result<(), String> {
    opts.tls = match opts.tls_opts.clone() {
        Some(t) => Some(std::sync::Arc::new(crate::tls::Tls::build(
            t,
            opts.allow_non_tls,
        )?)),
        None => None,
    };
    if let (Some(h), Some(hs)) = (opts.http_port, opts.https_port) {
        return Err(format!(
            "can't specify both HTTP ({h}) and HTTPs ({hs}) ports"
        ));
    }
    if opts.https_port.is_some() && opts.tls.is_none() {
        return Err("TLS cert and key required for HTTPS".into());
    }
    Ok(())
}

fn positive_size(key: &str, v: &Value) -> Result<usize, String> {
    let n = v.as_size().map_err(|e| format!("{key}: {e}"))?;
    if n <= 0 {
        return Err(format!("{key}: must be greater than 0, got {n}"));
    }
    Ok(n as usize)
}

fn duration(key: &str, v: &Value) -> Result<Duration, String> {
    v.as_duration().map_err(|e| format!("{key}: {e}"))
}

fn string(key: &str, v: &Value) -> Result<String, String> {
    match v {
        Value::Str(s) => Ok(s.clone()),
        Value::Int(i) => Ok(i.to_string()),
        _ => Err(format!("{key}: expected a string")),
    }
}

fn boolean(key: &str, v: &Value) -> Result<bool, String> {
    v.as_bool()
        .ok_or_else(|| format!("{key}: expected a boolean"))
}

fn int(key: &str, v: &Value) -> Result<i64, String> {
    v.as_i64()
        .ok_or_else(|| format!("{key}: expected an integer"))
}

/// Splits `host:port` (or `[v6]:port`, or a bare port) into its parts.
fn host_port(key: &str, s: &str) -> Result<(Option<String>, i64), String> {
    if let Ok(p) = s.parse::<i64>() {
        return Ok((None, p));
    }
    let (h, p) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{key}: expected host:port, got {s:?}"))?;
    let port = p
        .parse::<i64>()
        .map_err(|_| format!("{key}: invalid port in {s:?}"))?;
    let h = h.trim_start_matches('[').trim_end_matches(']');
    Ok(((!h.is_empty()).then(|| h.to_string()), port))
}

/// Applies the keys of a parsed config file. Unknown keys are errors, not ignored.
pub fn apply_config(opts: &mut Opts, map: &Map) -> Result<(), String> {
    for (key, v) in &map.0 {
        match key.to_ascii_lowercase().as_str() {
            "port" => opts.port = int(key, v)?,
            "host" | "net" => opts.host = string(key, v)?,
            "listen" => {
                let (h, p) = host_port(key, &string(key, v)?)?;
                if let Some(h) = h {
                    opts.host = h;
                }
                opts.port = p;
            }
            "server_name" => opts.server_name = Some(string(key, v)?),
            "http_port" | "monitor_port" => opts.http_port = Some(int(key, v)?),
            "http" => {
                let (h, p) = host_port(key, &string(key, v)?)?;
                opts.http_host = h;
                opts.http_port = Some(p);
            }
            // The reference treats 0 as its default and a negative value as "keep none".
            "max_closed_clients" => {
                opts.max_closed_clients = match int(key, v)? {
                    0 => 10_000,
                    n => n.max(0) as usize,
                }
            }
            "http_dashboard" => opts.http_dashboard = boolean(key, v)?,
            "https_port" => opts.https_port = Some(int(key, v)?),
            "https" => {
                let (h, p) = host_port(key, &string(key, v)?)?;
                opts.http_host = h;
                opts.https_port = Some(p);
            }
            "tls" => opts.tls_opts = Some(crate::tls::parse_block(v)?),
            "allow_non_tls" => opts.allow_non_tls = boolean(key, v)?,
            "max_payload" => opts.max_payload = positive_size(key, v)?,
            "max_connections" | "max_conn" => opts.max_connections = positive_size(key, v)?,
            "max_pending" => opts.max_pending = positive_size(key, v)?,
            "ping_interval" => opts.ping_interval = duration(key, v)?,
            "ping_max" => opts.ping_max = int(key, v)?.max(1) as u32,
            "write_deadline" => opts.write_deadline = duration(key, v)?,
            "lame_duck_duration" => {
                let d = duration(key, v)?;
                if d < Duration::from_secs(30) {
                    return Err(format!("{key}: must be at least 30s, got {d:?}"));
                }
                opts.lame_duck_duration = d;
            }
            "lame_duck_grace_period" => opts.lame_duck_grace_period = duration(key, v)?,
            "debug" => opts.debug = boolean(key, v)?,
            "trace" => opts.trace = boolean(key, v)?,
            "logtime" => opts.logtime = boolean(key, v)?,
            "log_file" => opts.log_file = Some(string(key, v)?.into()),
            "pid_file" => opts.pid_file = Some(string(key, v)?.into()),
            "store_dir" | "storedir" => set_store_dir(opts, key, v)?,
            "jetstream" => apply_jetstream(opts, key, v)?,
            _ if {
                let dir = opts
                    .config_file
                    .as_deref()
                    .and_then(std::path::Path::parent)
                    .map(std::path::Path::to_path_buf)
                    .unwrap_or_default();
                crate::auth::conf::apply_key(&mut opts.auth, key, v, &dir)?
            } => {}
            other if UNSUPPORTED_KEYS.contains(&other) => {
                return Err(not_supported(&format!("configuration key {key:?}")))
            }
            _ => return Err(format!("unknown configuration key {key:?}")),
        }
    }
    if opts.max_payload > 64 * 1024 * 1024 {
        return Err("max_payload cannot exceed 64MB".into());
    }
    Ok(())
}

/// A JetStream domain as the reference accepts it; empty is none.
fn domain(d: &str) -> Result<Option<String>, String> {
    if d.is_empty() {
        return Ok(None);
    }
    if d.contains(['.', '*', '>']) {
        return Err("invalid domain name: may not contain ., * or >".into());
    }
    let api = format!("$JS.{d}.API.>");
    if !keel_protocol::subject::valid_subscribe(api.as_bytes()) {
        return Err(format!(
            "invalid domain name: derived {api:?} is not a valid subject"
        ));
    }
    Ok(Some(d.to_string()))
}

/// `store_dir` may be given at the top level or in the jetstream block, not both.
fn set_store_dir(opts: &mut Opts, key: &str, v: &Value) -> Result<(), String> {
    if opts.store_dir.is_some() {
        return Err("Duplicate 'store_dir' configuration".into());
    }
    opts.store_dir = Some(string(key, v)?.into());
    Ok(())
}

fn apply_jetstream(opts: &mut Opts, key: &str, v: &Value) -> Result<(), String> {
    match v {
        Value::Bool(b) => opts.jetstream = *b,
        Value::Str(s) if matches!(s.to_ascii_lowercase().as_str(), "enabled" | "enable") => {
            opts.jetstream = true
        }
        Value::Str(s) if matches!(s.to_ascii_lowercase().as_str(), "disabled" | "disable") => {
            opts.jetstream = false
        }
        Value::Map(m) => {
            opts.jetstream = true;
            for (k, v) in &m.0 {
                match k.to_ascii_lowercase().as_str() {
                    "store_dir" | "storedir" | "store" => set_store_dir(opts, k, v)?,
                    "strict" => opts.jetstream_strict = boolean(k, v)?,
                    "domain" => opts.jetstream_domain = domain(&string(k, v)?)?,
                    "max_memory_store" | "max_mem_store" | "max_mem" => {
                        opts.max_memory_store = Some(v.as_size().map_err(|e| format!("{k}: {e}"))?)
                    }
                    "max_file_store" | "max_file" => {
                        opts.max_file_store = Some(v.as_size().map_err(|e| format!("{k}: {e}"))?)
                    }
                    "enabled" => opts.jetstream = boolean(k, v)?,
                    "index_cache_size" => {
                        let n = v.as_size().map_err(|e| format!("{k}: {e}"))?;
                        if n < 0 {
                            return Err(format!("{k}: must not be negative"));
                        }
                        opts.index_cache_size = Some(n);
                    }
                    "sync_interval" | "sync" => {
                        opts.sync_interval = match v {
                            Value::Str(s) if s.eq_ignore_ascii_case("always") => None,
                            v => Some(duration(k, v)?).filter(|d| !d.is_zero()),
                        }
                    }
                    other if UNSUPPORTED_JETSTREAM_KEYS.contains(&other) => {
                        return Err(not_supported(&format!("jetstream configuration key {k:?}")))
                    }
                    _ => return Err(format!("unknown jetstream configuration key {k:?}")),
                }
            }
        }
        _ => {
            return Err(format!(
                "{key}: expected a block, a boolean, or enabled/disabled"
            ))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<Opts, String> {
        match parse_args(args.iter().map(|s| s.to_string()))? {
            Command::Run(o) => Ok(*o),
            other => Err(format!("{other:?}")),
        }
    }

    #[test]
    fn flag_forms() {
        let o = run(&[
            "-p",
            "5000",
            "-a=127.0.0.1",
            "--name",
            "n1",
            "-js",
            "-sd=/tmp/x",
        ])
        .unwrap();
        assert_eq!(o.port, 5000);
        assert_eq!(o.host, "127.0.0.1");
        assert_eq!(o.server_name.as_deref(), Some("n1"));
        assert!(o.jetstream);
        assert_eq!(o.store_dir, Some(PathBuf::from("/tmp/x")));
        let o = run(&["--port=-1", "--store_dir", "/d", "-DV", "-m", "8222"]).unwrap();
        assert_eq!(o.port, -1);
        assert!(o.debug && o.trace);
        assert_eq!(o.http_port, Some(8222));
        let o = run(&["--port", "-1", "--jetstream=false", "-T=false"]).unwrap();
        assert_eq!(o.port, -1);
        assert!(!o.jetstream && !o.logtime);
    }

    #[test]
    fn help_version_and_errors() {
        assert!(matches!(
            parse_args(["--help".to_string()]),
            Ok(Command::Help)
        ));
        assert!(matches!(
            parse_args(["-v".to_string()]),
            Ok(Command::Version)
        ));
        assert!(run(&["--bogus"]).unwrap_err().contains("unknown flag"));
        // TLS flags need the certificate and key, as with the reference.
        assert_eq!(
            run(&["--tls"]).unwrap_err(),
            "TLS Server certificate must be present and valid"
        );
        assert_eq!(
            run(&["--tlscert", "c.pem"]).unwrap_err(),
            "TLS Server private key must be present and valid"
        );
        // --tls=false turns TLS off whatever the other flags say.
        assert!(run(&["--tls=false", "--tlsverify"]).unwrap().tls.is_none());
        assert_eq!(
            run(&["-m", "8222", "-ms", "8443"]).unwrap_err(),
            "can't specify both HTTP (8222) and HTTPs (8443) ports"
        );
        assert_eq!(
            run(&["--https_port", "-1"]).unwrap_err(),
            "TLS cert and key required for HTTPS"
        );
        let o = run(&["--user", "u", "--pass", "p", "--auth", "t"]).unwrap();
        assert_eq!(o.auth.user.as_deref(), Some("u"));
        assert_eq!(o.auth.password.as_deref(), Some("p"));
        assert_eq!(o.auth.token.as_deref(), Some("t"));
        assert!(!format!("{o:?}").contains("\"p\""), "no password in Debug");
        assert!(matches!(
            parse_args(["--signal".to_string(), "reload=12".to_string()]),
            Ok(Command::Signal(s)) if s == "reload=12"
        ));
        for flag in ["--cluster_listen", "--cluster", "--routes", "--profile"] {
            let e = run(&[flag, "x"]).unwrap_err();
            assert!(e.contains("does not support yet"), "{flag}: {e}");
        }
        assert!(run(&["-p"]).unwrap_err().contains("needs a value"));
        assert!(run(&["-p", "x"]).unwrap_err().contains("invalid port"));
        assert!(run(&["stray"]).unwrap_err().contains("unexpected argument"));
    }

    #[test]
    fn config_keys() {
        let map = conf::parse(
            "listen: 127.0.0.1:4333\nmax_payload: 1KB\nping_interval: \"1s\"\nping_max: 3\n\
             write_deadline: 2s\njetstream { store_dir: /tmp/js, max_file_store: 1GiB }\n",
        )
        .unwrap();
        let mut o = Opts::default();
        apply_config(&mut o, &map).unwrap();
        assert_eq!(o.host, "127.0.0.1");
        assert_eq!(o.port, 4333);
        assert_eq!(o.max_payload, 1024); // the reference: k = 1000, kb = 1024
        assert_eq!(o.ping_interval, Duration::from_secs(1));
        assert_eq!(o.ping_max, 3);
        assert_eq!(o.write_deadline, Duration::from_secs(2));
        assert!(o.jetstream);
        assert_eq!(o.max_file_store, Some(1 << 30));
        let bad = conf::parse("cluster { port: 1 }").unwrap();
        assert!(apply_config(&mut Opts::default(), &bad)
            .unwrap_err()
            .contains("does not support yet"));
        let bogus = conf::parse("bogus_key: 1").unwrap();
        assert!(apply_config(&mut Opts::default(), &bogus)
            .unwrap_err()
            .contains("unknown configuration key"));
    }

    #[test]
    fn tls_keys() {
        let map = conf::parse(
            "https: \"127.0.0.1:8443\"\nallow_non_tls: true\n\
             tls { cert_file: c.pem, key_file: k.pem, verify: true }\n",
        )
        .unwrap();
        let mut o = Opts::default();
        apply_config(&mut o, &map).unwrap();
        assert_eq!(o.http_host.as_deref(), Some("127.0.0.1"));
        assert_eq!(o.https_port, Some(8443));
        assert!(o.allow_non_tls);
        let t = o.tls_opts.as_ref().unwrap();
        assert!(t.verify);
        assert_eq!(t.cert_file, Some(PathBuf::from("c.pem")));
        // The files are read when the options are finished: a missing one is an error.
        let e = finish_tls(&mut o).unwrap_err();
        assert!(
            e.starts_with("error parsing X509 certificate/key pair: open c.pem"),
            "{e}"
        );
    }

    #[test]
    fn jetstream_keys() {
        let apply = |text: &str| apply_config(&mut Opts::default(), &conf::parse(text).unwrap());
        let mut o = Opts::default();
        assert!(o.jetstream_strict);
        apply_config(
            &mut o,
            &conf::parse("jetstream { strict: false, store: /tmp/s }").unwrap(),
        )
        .unwrap();
        assert!(o.jetstream && !o.jetstream_strict);
        assert_eq!(o.store_dir, Some(PathBuf::from("/tmp/s")));
        assert!(apply("jetstream { strict: true }").is_ok());
        assert!(apply("store_dir: /a\njetstream { store_dir: /b }")
            .unwrap_err()
            .contains("Duplicate 'store_dir'"));
        let mut o = Opts::default();
        apply_config(&mut o, &conf::parse("jetstream { domain: hub }").unwrap()).unwrap();
        assert_eq!(o.jetstream_domain.as_deref(), Some("hub"));
        assert!(apply("jetstream { domain: \"a.b\" }")
            .unwrap_err()
            .contains("may not contain"));
        assert!(apply("jetstream { domain: \"a b\" }")
            .unwrap_err()
            .contains("is not a valid subject"));
        for key in ["cipher: aes", "max_buffered_msgs: 10", "limits { }"] {
            let e = apply(&format!("jetstream {{ {key} }}")).unwrap_err();
            assert!(e.contains("does not support yet"), "{key}: {e}");
        }
        assert!(apply("jetstream { bogus: 1 }")
            .unwrap_err()
            .contains("unknown jetstream configuration key"));
    }
}
