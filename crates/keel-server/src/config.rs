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
    /// `server_tags`: this server's placement tags (lowercased, as the reference keeps
    /// them), matched by a stream's `placement.tags`.
    pub server_tags: Vec<String>,
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
    /// The filesystem JetStream's files are written through: the real one, except in tests
    /// that fill one in-process server's disk (`keel_store::Disk::fillable`). No config key.
    pub disk: keel_store::Disk,
    /// The cluster's meta group snapshots its state every this many log entries and keeps
    /// `meta_log_kept` entries before it (small in tests, to see its log compacted). No
    /// config key.
    pub meta_snapshot_every: u64,
    pub meta_log_kept: u64,
    /// `jetstream { strict }`: refuse API requests with fields the reference does not know
    /// (the reference's default, true) or decode them ignoring those fields.
    pub jetstream_strict: bool,
    /// `jetstream { domain }`: the JetStream domain, also served on `$JS.<domain>.API.>`.
    pub jetstream_domain: Option<String>,
    /// `jetstream { limits { ... } }`: the server-wide JetStream limits.
    pub js_limits: JsLimits,
    pub debug: bool,
    pub trace: bool,
    /// `max_traced_msg_len`: a traced payload longer than this shows its first this many
    /// bytes and `...` (0, the default: whole).
    pub max_traced_msg_len: usize,
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
    /// `cluster { ... }` and the cluster flags: routes to other servers (see `route`).
    pub cluster: ClusterOpts,
}

/// The route (cluster) options, as the reference's `cluster {}` block and flags.
#[derive(Debug, Clone)]
pub struct ClusterOpts {
    /// `name` / `--cluster_name`; None: generated at start (a dynamic name, which a peer
    /// with a configured name replaces).
    pub name: Option<String>,
    /// Where routes are accepted; None: `0.0.0.0`.
    pub host: Option<String>,
    /// 0: no cluster; -1: a free port.
    pub port: i64,
    /// `advertise` / `--cluster_advertise`: the `host:port` peers are told to dial.
    pub advertise: Option<String>,
    /// `no_advertise` / `--no_advertise`: clients are not told about the other servers.
    pub no_advertise: bool,
    /// `routes` / `--routes`: the servers to dial (explicit routes, retried forever).
    pub routes: Vec<RouteUrl>,
    /// How often a route learned by gossip (implicit) is retried; 0: one attempt.
    pub connect_retries: u32,
    /// `connect_backoff`: explicit routes retry with a doubling delay (up to 30 s) instead
    /// of every second.
    pub connect_backoff: bool,
    /// `authorization { user, password }`: what a peer must send in its CONNECT (and what
    /// this server sends to peers that require it, for routes learned by gossip).
    pub user: Option<String>,
    pub password: Option<String>,
    /// `authorization { timeout }`: how long an accepted route may take to send CONNECT
    /// (default 2 s; with TLS the handshake's timeout plus 1 s, as the reference).
    pub auth_timeout: Duration,
    pub auth_timeout_set: bool,
    /// `ping_interval` (at most 30 s for routes) and `ping_max`; None: the server's.
    pub ping_interval: Option<Duration>,
    pub ping_max: Option<u32>,
    /// `write_deadline`; None: the server's.
    pub write_deadline: Option<Duration>,
    /// `tls { }` as written, and as loaded once the options are finished (see
    /// [`crate::tls::RouteTls`]).
    pub tls_opts: Option<crate::tls::TlsOpts>,
    pub tls: Option<std::sync::Arc<crate::tls::RouteTls>>,
}

impl Default for ClusterOpts {
    fn default() -> Self {
        ClusterOpts {
            name: None,
            host: None,
            port: 0,
            advertise: None,
            no_advertise: false,
            routes: Vec::new(),
            connect_retries: 0,
            connect_backoff: false,
            user: None,
            password: None,
            auth_timeout: Duration::from_secs(2),
            auth_timeout_set: false,
            ping_interval: None,
            ping_max: None,
            write_deadline: None,
            tls_opts: None,
            tls: None,
        }
    }
}

impl ClusterOpts {
    /// Whether this server takes part in a cluster (a cluster port is set).
    pub fn enabled(&self) -> bool {
        self.port != 0
    }

    /// The listen host (the reference's default: every interface).
    pub fn listen_host(&self) -> &str {
        self.host.as_deref().unwrap_or("0.0.0.0")
    }
}

/// A route URL: `nats://[user:pass@]host:port` (also `nats-route://` and `route://`). Its
/// `Display` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct RouteUrl {
    pub host: String,
    pub port: u16,
    pub user: Option<String>,
    pub pass: Option<String>,
}

impl RouteUrl {
    /// Parses a route URL the way the reference's flags and config take one.
    pub fn parse(s: &str) -> Result<RouteUrl, String> {
        let bad = |why: &str| format!("invalid route URL {:?}: {why}", redact(s));
        let rest = match s.split_once("://") {
            Some((scheme, rest)) => {
                if !matches!(
                    scheme.to_ascii_lowercase().as_str(),
                    "nats" | "nats-route" | "route" | "tls"
                ) {
                    return Err(bad("unknown scheme"));
                }
                rest
            }
            None => s,
        };
        let rest = rest.trim_end_matches('/');
        let (userinfo, hostport) = match rest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, rest),
        };
        let (host, port) = hostport
            .rsplit_once(':')
            .ok_or_else(|| bad("expected host:port"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        let port: u16 = port.parse().map_err(|_| bad("invalid port"))?;
        let (user, pass) = match userinfo {
            Some(u) => match u.split_once(':') {
                Some((user, pass)) => (Some(user.to_string()), Some(pass.to_string())),
                None => (Some(u.to_string()), None),
            },
            None => (None, None),
        };
        Ok(RouteUrl {
            host: host.to_string(),
            port,
            user,
            pass,
        })
    }

    /// `host:port` (IPv6 in brackets), as the reference compares and lists route URLs.
    pub fn host_port(&self) -> String {
        crate::server::host_port(&self.host, self.port)
    }
}

/// A URL with its password replaced, for error messages.
fn redact(s: &str) -> String {
    match (s.find("://"), s.rfind('@')) {
        (Some(a), Some(at)) if at > a => match s[a + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:[REDACTED]{}", &s[..a + 3], &s[at..]),
            None => s.to_string(),
        },
        _ => s.to_string(),
    }
}

impl std::fmt::Display for RouteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.user {
            Some(u) => write!(f, "nats://{u}:[REDACTED]@{}", self.host_port()),
            None => write!(f, "nats://{}", self.host_port()),
        }
    }
}

impl std::fmt::Debug for RouteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            host: "0.0.0.0".into(),
            port: 4222,
            server_name: None,
            server_tags: Vec::new(),
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
            meta_snapshot_every: crate::jetstream::raft::META_SNAPSHOT_EVERY,
            meta_log_kept: crate::jetstream::raft::META_LOG_KEPT,
            max_memory_store: None,
            max_file_store: None,
            sync_interval: None,
            index_cache_size: None,
            disk: keel_store::Disk::real(),
            jetstream_strict: true,
            jetstream_domain: None,
            js_limits: JsLimits::default(),
            debug: false,
            trace: false,
            max_traced_msg_len: 0,
            logtime: true,
            log_file: None,
            pid_file: None,
            config_file: None,
            check_config: false,
            max_closed_clients: 10_000,
            http_dashboard: true,
            cluster: ClusterOpts::default(),
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
        --max_traced_msg_len <len>   Maximum printable length for traced messages (default: unlimited)

Cluster Options:
        --routes <rurl-1, rurl-2>    Routes to solicit and connect
        --cluster <cluster-url>      Cluster URL for solicited routes (nats://[user:pass@]host:port;
                                     also --cluster_listen)
        --cluster_name <string>      Cluster name (default: generated)
        --cluster_advertise <string> Cluster URL to advertise to other servers
        --no_advertise <bool>        Do not advertise known cluster information to clients
        --connect_retries <number>   For implicit routes, number of connect retries
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
lame_duck_grace_period, max_closed_clients, http_dashboard, debug, trace, max_traced_msg_len, logtime,
log_file, pid_file, store_dir, https_port, https, allow_non_tls, tls { cert_file, key_file,
ca_file, certs, verify, verify_and_map, insecure, timeout, handshake_first, cipher_suites,
curve_preferences, allow_insecure_cipher_suites, min_version, pinned_certs,
connection_rate_limit }, jetstream { store_dir, max_memory_store, max_file_store,
sync_interval, index_cache_size, strict, domain, enabled }, authorization { user, password, token, timeout,
users, permissions }, accounts { NAME: { users, jetstream, exports, imports,
default_permissions } }, no_auth_user, system_account, no_system_account, operator, resolver:
MEMORY, resolver_preload, trusted_keys, cluster { name, listen, host, port, routes,
advertise, no_advertise, connect_retries, connect_backoff, pool_size (-1), compression (off),
authorization { user, password, timeout }, tls { cert_file, key_file, ca_file, insecure,
timeout, cipher_suites, curve_preferences, min_version }, ping_interval, ping_max,
write_deadline }.
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
    (&["max_traced_msg_len"], Kind::Value, "max_traced_msg_len"),
    (&["DV"], Kind::Bool, "DV"),
    (&["VV"], Kind::Bool, "VV"),
    (&["DVV"], Kind::Bool, "DVV"),
    (&["js", "jetstream"], Kind::Bool, "js"),
    (&["sd", "store_dir"], Kind::Value, "store_dir"),
    (&["cluster", "cluster_listen"], Kind::Value, "cluster"),
    (&["routes"], Kind::Value, "routes"),
    (&["cluster_name"], Kind::Value, "cluster_name"),
    (&["cluster_advertise"], Kind::Value, "cluster_advertise"),
    (&["no_advertise"], Kind::Bool, "no_advertise"),
    (&["connect_retries"], Kind::Value, "connect_retries"),
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
    "s",
    "syslog",
    "r",
    "remote_syslog",
    "client_advertise",
    "ports_file_dir",
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
    "server_metadata",
    "feature_flags",
    "default_js_domain",
    "ocsp_cache",
    "no_fast_producer_stall",
    "max_closed_clients",
    "proxies",
];

/// `jetstream { limits { ... } }`, as the reference: 0 where a key is not set (no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsLimits {
    /// The ceiling (and the default when lower than 1,000) of consumers' `max_ack_pending`.
    pub max_ack_pending: i64,
    /// The ceiling (and the default) of pull consumers' `max_request_batch`.
    pub max_request_batch: i64,
    /// The ceiling (and the default when lower than 2 minutes) of streams'
    /// `duplicate_window`, in nanoseconds.
    pub duplicate_window: i64,
    /// The consumers a stream may have when its own `max_consumers` is not set: 1,000
    /// unless set (nats-server 2.15's default, also for 0); below 0, no limit.
    pub default_max_consumers: i64,
}

/// nats-server 2.15's `default_max_consumers`.
pub const DEFAULT_MAX_CONSUMERS: i64 = 1000;

impl Default for JsLimits {
    fn default() -> Self {
        JsLimits {
            max_ack_pending: 0,
            max_request_batch: 0,
            duplicate_window: 0,
            default_max_consumers: DEFAULT_MAX_CONSUMERS,
        }
    }
}

fn js_limits(key: &str, v: &Value) -> Result<JsLimits, String> {
    let Value::Map(m) = v else {
        return Err(format!("{key}: expected a block"));
    };
    let mut l = JsLimits::default();
    for (k, v) in &m.0 {
        let int = || {
            v.as_i64()
                .ok_or_else(|| format!("{k}: expected an integer"))
        };
        match k.to_ascii_lowercase().as_str() {
            "max_ack_pending" => l.max_ack_pending = int()?,
            "max_request_batch" => l.max_request_batch = int()?,
            // 0 is the default, as unset (the reference's); below 0, no limit.
            "default_max_consumers" => {
                l.default_max_consumers = Some(int()?)
                    .filter(|n| *n != 0)
                    .unwrap_or(DEFAULT_MAX_CONSUMERS)
            }
            "duplicate_window" => {
                l.duplicate_window = i64::try_from(duration(k, v)?.as_nanos())
                    .map_err(|_| format!("{k}: too long"))?
            }
            "max_ha_assets" | "batch" => {
                return Err(not_supported(&format!("jetstream limits key {k:?}")))
            }
            _ => return Err(format!("unknown jetstream limits key {k:?}")),
        }
    }
    Ok(l)
}

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
    // Operator-mode account limits.
    "extension_hint",
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
    let mut routes_flag = false;
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
            "max_traced_msg_len" => {
                opts.max_traced_msg_len =
                    traced_len(&v.parse::<i64>().map_err(|_| {
                        format!("invalid value {v:?} for flag --max_traced_msg_len")
                    })?)
            }
            "DV" | "VV" | "DVV" => {
                let on = parse_bool(canon, &v)?;
                opts.trace = on;
                if canon != "VV" {
                    opts.debug = on;
                }
            }
            "js" => opts.jetstream = parse_bool(canon, &v)?,
            "store_dir" => opts.store_dir = Some(v.into()),
            "cluster" => cluster_listen_flag(&mut opts.cluster, &v)?,
            "routes" => {
                opts.cluster.routes = v
                    .split(',')
                    .map(str::trim)
                    .filter(|r| !r.is_empty())
                    .map(RouteUrl::parse)
                    .collect::<Result<_, _>>()?;
                routes_flag = true;
            }
            "cluster_name" => opts.cluster.name = Some(cluster_name(&v)?),
            "cluster_advertise" => opts.cluster.advertise = Some(v),
            "no_advertise" => opts.cluster.no_advertise = parse_bool(canon, &v)?,
            "connect_retries" => {
                opts.cluster.connect_retries = v
                    .parse()
                    .map_err(|_| format!("invalid value {v:?} for flag --connect_retries"))?
            }
            // Flags override the config file, as the reference's do.
            "user" => opts.auth.user = Some(v),
            "pass" => opts.auth.password = Some(v),
            "auth" => opts.auth.token = Some(v),
            "signal" => return Ok(Command::Signal(v)),
            _ => unreachable!("flag table and match agree"),
        }
    }
    if routes_flag && !opts.cluster.enabled() {
        return Err("solicited routes require cluster capabilities, e.g. --cluster".into());
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
    opts.cluster.tls = match opts.cluster.tls_opts.clone() {
        Some(t) => Some(std::sync::Arc::new(
            crate::tls::RouteTls::build(t).map_err(|e| format!("cluster tls: {e}"))?,
        )),
        None => None,
    };
    if let (Some(t), false) = (&opts.cluster.tls, opts.cluster.auth_timeout_set) {
        opts.cluster.auth_timeout = t.timeout() + Duration::from_secs(1);
    }
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

/// As the reference: a length of 0 or less traces whole payloads.
fn traced_len(n: &i64) -> usize {
    usize::try_from(*n).unwrap_or(0)
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

/// `--cluster nats://[user:pass@]host:port` (`:-1` picks a free port): the listen address,
/// and the credentials peers must present.
fn cluster_listen_flag(c: &mut ClusterOpts, v: &str) -> Result<(), String> {
    if v.is_empty() {
        c.port = 0;
        return Ok(());
    }
    let (text, random) = match v.strip_suffix(":-1") {
        Some(t) => (format!("{t}:0"), true),
        None => (v.to_string(), false),
    };
    let u = RouteUrl::parse(&text).map_err(|e| format!("--cluster: {e}"))?;
    c.host = Some(u.host);
    c.port = if random { -1 } else { i64::from(u.port) };
    match u.user {
        Some(user) => {
            let pass = u.pass.ok_or("expected cluster password to be set")?;
            c.user = Some(user);
            c.password = Some(pass);
        }
        None => {
            c.user = None;
            c.password = None;
        }
    }
    Ok(())
}

fn cluster_name(n: &str) -> Result<String, String> {
    if n.contains(' ') {
        return Err("cluster name cannot contain spaces".into());
    }
    Ok(n.to_string())
}

/// The `cluster {}` block.
fn apply_cluster(opts: &mut Opts, key: &str, v: &Value) -> Result<(), String> {
    let Value::Map(m) = v else {
        return Err(format!("{key}: expected a block"));
    };
    let c = &mut opts.cluster;
    for (k, v) in &m.0 {
        match k.to_ascii_lowercase().as_str() {
            "name" => c.name = Some(cluster_name(&string(k, v)?)?),
            "listen" => {
                let (h, p) = host_port(k, &string(k, v)?)?;
                if h.is_some() {
                    c.host = h;
                }
                c.port = p;
            }
            "port" => c.port = int(k, v)?,
            "host" | "net" => c.host = Some(string(k, v)?),
            "advertise" | "cluster_advertise" => c.advertise = Some(string(k, v)?),
            "no_advertise" => c.no_advertise = boolean(k, v)?,
            "routes" => {
                let Value::Array(list) = v else {
                    return Err(format!("{k}: expected an array of route URLs"));
                };
                let mut routes: Vec<RouteUrl> = Vec::new();
                for r in list {
                    let u = RouteUrl::parse(&string(k, r)?)?;
                    // The reference warns about a duplicate and keeps one.
                    if !routes.contains(&u) {
                        routes.push(u);
                    }
                }
                c.routes = routes;
            }
            "connect_retries" => {
                c.connect_retries = u32::try_from(int(k, v)?.max(0)).unwrap_or(u32::MAX)
            }
            "connect_backoff" => c.connect_backoff = boolean(k, v)?,
            "authorization" => {
                let Value::Map(a) = v else {
                    return Err(format!("{k}: expected a block"));
                };
                for (ak, av) in &a.0 {
                    match ak.to_ascii_lowercase().as_str() {
                        "user" | "username" => c.user = Some(string(ak, av)?),
                        "pass" | "password" => c.password = Some(string(ak, av)?),
                        "timeout" => {
                            c.auth_timeout_set = true;
                            c.auth_timeout = match av {
                                Value::Int(n) => Duration::from_secs((*n).max(0) as u64),
                                Value::Float(f) if *f >= 0.0 => Duration::from_secs_f64(*f),
                                other => duration(ak, other)?,
                            }
                        }
                        "users" => {
                            return Err("Cluster authorization does not allow multiple users".into())
                        }
                        "token" => {
                            return Err("Cluster authorization does not support tokens".into())
                        }
                        "auth_callout" | "callout" => {
                            return Err("Cluster authorization does not support callouts".into())
                        }
                        "permissions" => {
                            return Err(not_supported(
                                "cluster authorization key \"permissions\" (route permissions)",
                            ))
                        }
                        _ => return Err(format!("unknown cluster authorization key {ak:?}")),
                    }
                }
            }
            // Keel's routes are one connection per peer, which is what the reference's
            // `pool_size: -1` means (a nats-server peer then treats the route as "no pool").
            "pool_size" => match int(k, v)? {
                -1 | 0 => {}
                n => {
                    return Err(format!(
                        "cluster pool_size {n}: keel-server does not pool routes (one connection \
                         per peer, as pool_size: -1); remove the key or set it to -1"
                    ))
                }
            },
            // Keel cannot compress routes (S2), so it declines what a peer proposes; the only
            // mode it can honour is off.
            "compression" => {
                let mode = match v {
                    Value::Bool(false) => "off".to_string(),
                    Value::Bool(true) => "s2_fast".to_string(),
                    Value::Str(s) => s.to_ascii_lowercase(),
                    Value::Map(cm) => match cm.get("mode") {
                        Some(m) => string("mode", m)?.to_ascii_lowercase(),
                        None => return Err(format!("{k}: expected a mode")),
                    },
                    _ => return Err(format!("{k}: expected a boolean, a mode or a block")),
                };
                if !matches!(
                    mode.as_str(),
                    "off" | "disabled" | "false" | "not_supported" | "not supported"
                ) {
                    return Err(format!(
                        "cluster compression {mode:?}: keel-server routes are not compressed \
                         (it declines compression with peers); use compression: off"
                    ));
                }
            }
            "ping_interval" => {
                let d = duration(k, v)?;
                // As the reference: routes ping at least every 30 s.
                c.ping_interval = Some(d.min(Duration::from_secs(30)));
            }
            "ping_max" => c.ping_max = Some(int(k, v)?.max(1) as u32),
            "write_deadline" => c.write_deadline = Some(duration(k, v)?),
            "tls" => {
                let t = crate::tls::parse_block(v)?;
                // What the client listener's block has that routes do not use here.
                for (set, key) in [
                    (t.map, "verify_and_map (route users from certificates)"),
                    (!t.pinned.is_empty(), "pinned_certs"),
                    (
                        t.handshake_first,
                        "handshake_first (routes always start with TLS)",
                    ),
                    (t.rate_limit > 0, "connection_rate_limit"),
                    (!t.certs.is_empty(), "certs (one certificate serves routes)"),
                ] {
                    if set {
                        return Err(not_supported(&format!("cluster tls key {key}")));
                    }
                }
                c.tls_opts = Some(t);
            }
            "permissions" => {
                return Err(not_supported(
                    "cluster configuration key \"permissions\" (route permissions)",
                ))
            }
            "accounts" => {
                return Err(not_supported(
                    "cluster configuration key \"accounts\" (pinned-account routes)",
                ))
            }
            "write_timeout" | "compression_rtt" => {
                return Err(not_supported(&format!("cluster configuration key {k:?}")))
            }
            _ => return Err(format!("unknown cluster configuration key {k:?}")),
        }
    }
    Ok(())
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
            "server_tags" => {
                // A list, or one string of comma-separated tags.
                let tags: Vec<String> = match v {
                    Value::Array(list) => list
                        .iter()
                        .map(|t| string(key, t))
                        .collect::<Result<_, _>>()?,
                    other => string(key, other)?.split(',').map(str::to_string).collect(),
                };
                opts.server_tags = tags
                    .iter()
                    .map(|t| t.trim().to_ascii_lowercase())
                    .filter(|t| !t.is_empty())
                    .collect();
            }
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
            "max_traced_msg_len" => opts.max_traced_msg_len = traced_len(&int(key, v)?),
            "logtime" => opts.logtime = boolean(key, v)?,
            "log_file" => opts.log_file = Some(string(key, v)?.into()),
            "pid_file" => opts.pid_file = Some(string(key, v)?.into()),
            "store_dir" | "storedir" => set_store_dir(opts, key, v)?,
            "jetstream" => apply_jetstream(opts, key, v)?,
            "cluster" => apply_cluster(opts, key, v)?,
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
    if !opts.cluster.routes.is_empty() && !opts.cluster.enabled() {
        return Err("cluster routes require a cluster port (cluster { listen } or port)".into());
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
                    "limits" => opts.js_limits = js_limits(k, v)?,
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
        let o = run(&["-V", "--max_traced_msg_len", "64"]).unwrap();
        assert_eq!(o.max_traced_msg_len, 64);
        // As the reference: 0 or less means whole payloads.
        let o = run(&["--max_traced_msg_len=-1"]).unwrap();
        assert_eq!(o.max_traced_msg_len, 0);
        assert!(run(&["--max_traced_msg_len", "many"]).is_err());
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
        let e = run(&["--profile", "x"]).unwrap_err();
        assert!(e.contains("does not support yet"), "{e}");
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
        let bad = conf::parse("gateway { port: 1 }").unwrap();
        assert!(apply_config(&mut Opts::default(), &bad)
            .unwrap_err()
            .contains("does not support yet"));
        let bogus = conf::parse("bogus_key: 1").unwrap();
        assert!(apply_config(&mut Opts::default(), &bogus)
            .unwrap_err()
            .contains("unknown configuration key"));
    }

    #[test]
    fn cluster_flags() {
        let o = run(&[
            "--cluster",
            "nats://ruser:rpass@127.0.0.1:6222",
            "--routes",
            "nats://a:1,nats-route://u:p@b:2",
            "--cluster_name",
            "c1",
            "--no_advertise",
            "--connect_retries",
            "3",
            "--cluster_advertise",
            "10.0.0.1:6222",
        ])
        .unwrap();
        let c = &o.cluster;
        assert!(c.enabled());
        assert_eq!((c.listen_host(), c.port), ("127.0.0.1", 6222));
        assert_eq!(c.user.as_deref(), Some("ruser"));
        assert_eq!(c.password.as_deref(), Some("rpass"));
        assert_eq!(c.name.as_deref(), Some("c1"));
        assert!(c.no_advertise);
        assert_eq!(c.connect_retries, 3);
        assert_eq!(c.advertise.as_deref(), Some("10.0.0.1:6222"));
        assert_eq!(c.routes.len(), 2);
        assert_eq!(c.routes[0].host_port(), "a:1");
        assert_eq!(c.routes[1].user.as_deref(), Some("u"));
        // The password never shows.
        assert_eq!(c.routes[1].to_string(), "nats://u:[REDACTED]@b:2");
        assert_eq!(
            run(&["--cluster_listen", "nats://0.0.0.0:-1"])
                .unwrap()
                .cluster
                .port,
            -1
        );
        assert_eq!(
            run(&["--routes", "nats://a:1"]).unwrap_err(),
            "solicited routes require cluster capabilities, e.g. --cluster"
        );
        assert!(run(&["--cluster", "nats://u@h:1"])
            .unwrap_err()
            .contains("password"));
        assert!(run(&["--cluster_name", "a b"])
            .unwrap_err()
            .contains("spaces"));
        let e = run(&["--cluster", "nats://h:1", "--routes", "nats://x:y:z"]).unwrap_err();
        assert!(e.contains("invalid route URL"), "{e}");
    }

    #[test]
    fn cluster_keys() {
        let apply = |text: &str| {
            let mut o = Opts::default();
            apply_config(&mut o, &conf::parse(text).unwrap()).map(|_| o.cluster)
        };
        let c = apply(
            "cluster { name: ref, listen: 127.0.0.1:4248, routes: [nats://a:1, nats://a:1, \
             nats://b:2], no_advertise: true, connect_retries: 2, connect_backoff: true, \
             pool_size: -1, compression: off, authorization { user: r, password: p, \
             timeout: 0.5 }, ping_interval: 2m, ping_max: 3, write_deadline: 3s, \
             advertise: \"10.1.1.1:4248\" }",
        )
        .unwrap();
        assert_eq!(c.name.as_deref(), Some("ref"));
        assert_eq!((c.listen_host(), c.port), ("127.0.0.1", 4248));
        assert_eq!(c.routes.len(), 2, "a duplicate route is kept once");
        assert!(c.no_advertise && c.connect_backoff);
        assert_eq!(c.connect_retries, 2);
        assert_eq!(c.user.as_deref(), Some("r"));
        assert_eq!(c.auth_timeout, Duration::from_millis(500));
        assert_eq!(c.ping_interval, Some(Duration::from_secs(30)), "capped");
        assert_eq!(c.ping_max, Some(3));
        assert_eq!(c.write_deadline, Some(Duration::from_secs(3)));
        assert_eq!(c.advertise.as_deref(), Some("10.1.1.1:4248"));
        let c = apply("cluster { port: 1, tls { cert_file: c.pem, key_file: k.pem, timeout: 3 } }")
            .unwrap();
        let t = c.tls_opts.expect("route TLS");
        assert_eq!(t.cert_file, Some(PathBuf::from("c.pem")));
        assert_eq!(t.timeout, Some(Duration::from_secs(3)));
        let c = apply("cluster { port: -1, host: 0.0.0.0, compression: false }").unwrap();
        assert_eq!((c.listen_host(), c.port), ("0.0.0.0", -1));
        for (text, want) in [
            ("cluster { port: 1, pool_size: 3 }", "does not pool routes"),
            (
                "cluster { port: 1, compression: s2_fast }",
                "not compressed",
            ),
            ("cluster { port: 1, compression: accept }", "not compressed"),
            ("cluster { port: 1, accounts: [A] }", "does not support yet"),
            (
                "cluster { port: 1, tls { cert_file: c, key_file: k, verify_and_map: true } }",
                "verify_and_map",
            ),
            (
                "cluster { port: 1, tls { cert_file: c, key_file: k, handshake_first: true } }",
                "handshake_first",
            ),
            (
                "cluster { port: 1, permissions { } }",
                "does not support yet",
            ),
            (
                "cluster { port: 1, bogus: 1 }",
                "unknown cluster configuration key",
            ),
            ("cluster { port: 1, authorization { token: x } }", "tokens"),
            (
                "cluster { port: 1, authorization { users: [] } }",
                "multiple users",
            ),
            ("cluster { name: \"a b\", port: 1 }", "spaces"),
            ("cluster { routes: [nats://a:1] }", "require a cluster port"),
        ] {
            let e = apply(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
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
        for key in [
            "cipher: aes",
            "max_buffered_msgs: 10",
            "limits { max_ha_assets: 5 }",
        ] {
            let e = apply(&format!("jetstream {{ {key} }}")).unwrap_err();
            assert!(e.contains("does not support yet"), "{key}: {e}");
        }
        assert!(apply("jetstream { bogus: 1 }")
            .unwrap_err()
            .contains("unknown jetstream configuration key"));
        let mut o = Opts::default();
        assert_eq!(o.js_limits.default_max_consumers, DEFAULT_MAX_CONSUMERS);
        let limits = "jetstream { limits { max_ack_pending: 5, duplicate_window: 30s, \
                      default_max_consumers: -1 } }";
        apply_config(&mut o, &conf::parse(limits).unwrap()).unwrap();
        assert_eq!(o.js_limits.max_ack_pending, 5);
        assert_eq!(o.js_limits.duplicate_window, 30_000_000_000);
        assert_eq!(o.js_limits.default_max_consumers, -1);
        let zero = "jetstream { limits { default_max_consumers: 0 } }";
        apply_config(&mut o, &conf::parse(zero).unwrap()).unwrap();
        assert_eq!(o.js_limits.default_max_consumers, DEFAULT_MAX_CONSUMERS);
        assert!(apply("jetstream { limits { bogus: 1 } }")
            .unwrap_err()
            .contains("unknown jetstream limits key"));
    }
}
