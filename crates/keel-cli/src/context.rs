//! Connection flags and `keel context ...`: named connection settings stored
//! exactly where and how the `nats` CLI stores them
//! (`$XDG_CONFIG_HOME/nats/context/NAME.json`, else `~/.config/nats/...`, and
//! the selected name in `nats/context.txt`), so contexts made by either tool
//! work in the other. Unknown keys in a context file are kept when keel edits it.
//!
//! Precedence, as in `nats`: a flag or its environment variable, then the
//! context (`--context NAME`, else the selected one), then the default.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::{json, Map, Value};

use crate::output::{print_json, Cols, Table};
use crate::util::{confirm, parse_duration, ConnSettings, Res};

pub const DEFAULT_URL: &str = "nats://127.0.0.1:4222";

/// The global connection flags (names and environment variables of `nats`).
#[derive(Args, Debug, Clone, Default)]
pub struct GlobalFlags {
    /// NATS server URLs [default: nats://127.0.0.1:4222, or the context's]
    #[arg(
        short = 's',
        long,
        env = "NATS_URL",
        global = true,
        value_name = "URL",
        help_heading = "Connection"
    )]
    pub server: Option<String>,
    /// Time limit for connecting, requests and waits, e.g. 5s, 500ms
    #[arg(long, env = "NATS_TIMEOUT", default_value = "5s", value_parser = parse_duration, global = true, help_heading = "Connection")]
    pub timeout: Duration,
    /// User name for authentication
    #[arg(long, env = "NATS_USER", global = true, help_heading = "Connection")]
    pub user: Option<String>,
    /// Password for authentication
    #[arg(
        long,
        env = "NATS_PASSWORD",
        global = true,
        hide_env_values = true,
        help_heading = "Connection"
    )]
    pub password: Option<String>,
    /// Token for authentication
    #[arg(
        long,
        env = "NATS_TOKEN",
        global = true,
        hide_env_values = true,
        help_heading = "Connection"
    )]
    pub token: Option<String>,
    /// User credentials file (JWT and NKey seed)
    #[arg(
        long,
        env = "NATS_CREDS",
        global = true,
        value_name = "FILE",
        help_heading = "Connection"
    )]
    pub creds: Option<String>,
    /// User NKey seed file
    #[arg(
        long,
        env = "NATS_NKEY",
        global = true,
        value_name = "FILE",
        help_heading = "Connection"
    )]
    pub nkey: Option<String>,
    /// TLS client certificate (with --tlskey)
    #[arg(
        long,
        env = "NATS_CERT",
        global = true,
        value_name = "FILE",
        help_heading = "Connection"
    )]
    pub tlscert: Option<String>,
    /// TLS client private key (with --tlscert)
    #[arg(
        long,
        env = "NATS_KEY",
        global = true,
        value_name = "FILE",
        help_heading = "Connection"
    )]
    pub tlskey: Option<String>,
    /// TLS certificate authority chain
    #[arg(
        long,
        env = "NATS_CA",
        global = true,
        value_name = "FILE",
        help_heading = "Connection"
    )]
    pub tlsca: Option<String>,
    /// Do the TLS handshake before the server's greeting
    #[arg(
        long,
        visible_alias = "tls-first",
        global = true,
        help_heading = "Connection"
    )]
    pub tlsfirst: bool,
    /// JetStream domain to use (API prefix $JS.<domain>.API)
    #[arg(
        long,
        global = true,
        value_name = "DOMAIN",
        help_heading = "Connection"
    )]
    pub js_domain: Option<String>,
    /// Subject prefix of the JetStream API (default $JS.API)
    #[arg(
        long,
        global = true,
        value_name = "PREFIX",
        help_heading = "Connection"
    )]
    pub js_api_prefix: Option<String>,
    /// Prefix of the inboxes replies come to
    #[arg(
        long,
        global = true,
        value_name = "PREFIX",
        help_heading = "Connection"
    )]
    pub inbox_prefix: Option<String>,
    /// Use this configuration context (see `keel context`)
    #[arg(
        long,
        env = "NATS_CONTEXT",
        global = true,
        value_name = "NAME",
        help_heading = "Connection"
    )]
    pub context: Option<String>,
    /// Ignore the selected context
    #[arg(long, global = true, help_heading = "Connection")]
    pub no_context: bool,
}

/// `$XDG_CONFIG_HOME/nats`, else `~/.config/nats` (as natscontext).
pub fn config_dir() -> Res<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("nats"));
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty()).ok_or(
        "cannot find the home directory for the context files (set HOME or XDG_CONFIG_HOME)",
    )?;
    Ok(PathBuf::from(home).join(".config").join("nats"))
}

fn valid_name(name: &str) -> Res<()> {
    if name.is_empty() || name.contains("..") || name.contains('/') || name.contains('\\') {
        return Err(format!("invalid context name {name:?}"));
    }
    Ok(())
}

fn context_path(name: &str) -> Res<PathBuf> {
    valid_name(name)?;
    Ok(config_dir()?.join("context").join(format!("{name}.json")))
}

/// The selected context's name, if any.
pub fn selected() -> Option<String> {
    let dir = config_dir().ok()?;
    let name = std::fs::read_to_string(dir.join("context.txt")).ok()?;
    let name = name.trim().to_string();
    (!name.is_empty()).then_some(name)
}

fn known() -> Vec<String> {
    let Ok(dir) = config_dir() else {
        return Vec::new();
    };
    let mut names: Vec<String> = std::fs::read_dir(dir.join("context"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.metadata().is_ok_and(|m| m.is_file() && m.len() > 0))
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .map(String::from)
        })
        .collect();
    names.sort();
    names
}

pub fn load(name: &str) -> Res<Map<String, Value>> {
    let path = context_path(name)?;
    let text = std::fs::read_to_string(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            format!("unknown context {name:?} (list them with `keel context ls`)")
        } else {
            format!("cannot read context {}: {e}", path.display())
        }
    })?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(format!(
            "context {}: expected a JSON object",
            path.display()
        )),
        Err(e) => Err(format!("context {}: invalid JSON: {e}", path.display())),
    }
}

/// Writes a context file the way natscontext does (0600, two-space indent).
fn save(name: &str, cfg: &Map<String, Value>) -> Res<PathBuf> {
    let path = context_path(name)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let text = serde_json::to_string_pretty(cfg).unwrap_or_default();
    write_private(&path, text.as_bytes())?;
    Ok(path)
}

fn write_private(path: &Path, data: &[u8]) -> Res<()> {
    use std::io::Write;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
        .and_then(|mut f| f.write_all(data))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn select(name: &str) -> Res<()> {
    valid_name(name)?;
    let dir = config_dir()?;
    std::fs::create_dir_all(dir.join("context"))
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    write_private(&dir.join("context.txt"), name.as_bytes())
}

/// The context for `--json`, with the password and token masked: output gets
/// pasted into tickets, and secrets must not travel with it.
fn masked(mut cfg: Map<String, Value>) -> Value {
    for key in ["password", "token"] {
        if let Some(Value::String(v)) = cfg.get_mut(key) {
            if !v.is_empty() {
                *v = "*".repeat(v.len());
            }
        }
    }
    Value::Object(cfg)
}

fn str_of<'a>(cfg: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    cfg.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// Expands `~` and `file://` in a context's file locations; other schemes
/// (`op://`, `nsc://`, `env://`) need tools keel does not run.
fn location(key: &str, v: &str) -> Res<PathBuf> {
    if let Some(rest) = v.strip_prefix("file://") {
        return location(key, rest);
    }
    if let Some((scheme, _)) = v.split_once("://") {
        return Err(format!(
            "the {key} location {v:?} uses {scheme}://, which keel cannot read: give a file path"
        ));
    }
    if let Some(rest) = v.strip_prefix("~/") {
        let home = std::env::var_os("HOME").ok_or("cannot expand ~: HOME is not set")?;
        return Ok(PathBuf::from(home).join(rest));
    }
    Ok(PathBuf::from(v))
}

/// Reads a file location, or embedded `data:;base64,` content (natscli `--embed`).
fn read_location(key: &str, v: &str) -> Res<String> {
    if let Some(b64) = v.strip_prefix("data:;base64,") {
        let raw = crate::output::base64_decode(b64).map_err(|e| format!("{key}: {e}"))?;
        return String::from_utf8(raw).map_err(|_| format!("{key}: embedded data is not text"));
    }
    let path = location(key, v)?;
    std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read the {key} file {}: {e}", path.display()))
}

/// Merges flags, environment and context into the settings every command uses.
pub fn resolve(f: &GlobalFlags) -> Res<ConnSettings> {
    let ctx = if f.no_context {
        Map::new()
    } else {
        match f.context.clone().or_else(selected) {
            Some(name) => load(&name)?,
            None => Map::new(),
        }
    };
    for unsupported in [
        "user_jwt",
        "user_seed",
        "socks_proxy",
        "nsc",
        "windows_cert_store",
    ] {
        if str_of(&ctx, unsupported).is_some() {
            return Err(format!(
                "the context sets {unsupported:?}, which keel does not support yet (use creds, nkey or user/password)"
            ));
        }
    }
    let pick = |flag: &Option<String>, key: &str| -> Option<String> {
        flag.clone()
            .filter(|s| !s.is_empty())
            .or_else(|| str_of(&ctx, key).map(String::from))
    };
    let server = pick(&f.server, "url").unwrap_or_else(|| DEFAULT_URL.to_string());
    let creds = match pick(&f.creds, "creds") {
        Some(loc) => {
            let text = read_location("--creds", &loc)?;
            async_nats::ConnectOptions::new()
                .credentials(&text)
                .map_err(|e| format!("invalid credentials in {loc}: {e}"))?;
            Some(text)
        }
        None => None,
    };
    let nkey_seed = match pick(&f.nkey, "nkey") {
        Some(loc) => {
            let text = read_location("--nkey", &loc)?;
            let seed = text
                .lines()
                .map(str::trim)
                .find(|l| l.starts_with("SU"))
                .ok_or_else(|| {
                    format!("--nkey {loc}: no user NKey seed (a line starting with SU)")
                })?;
            Some(seed.to_string())
        }
        None => None,
    };
    let path = |flag: &Option<String>, key: &str, name: &str| -> Res<Option<PathBuf>> {
        match pick(flag, key) {
            Some(v) => {
                let p = location(name, &v)?;
                if !p.is_file() {
                    return Err(format!("{name} {}: no such file", p.display()));
                }
                Ok(Some(p))
            }
            None => Ok(None),
        }
    };
    let tls_cert = path(&f.tlscert, "cert", "--tlscert")?;
    let tls_key = path(&f.tlskey, "key", "--tlskey")?;
    let tls_ca = path(&f.tlsca, "ca", "--tlsca")?;
    if tls_cert.is_some() != tls_key.is_some() {
        return Err("--tlscert and --tlskey go together: give both".into());
    }
    let domain = pick(&f.js_domain, "jetstream_domain");
    let js_api_prefix = match (pick(&f.js_api_prefix, "jetstream_api_prefix"), domain) {
        (Some(_), Some(_)) if f.js_domain.is_some() && f.js_api_prefix.is_some() => {
            return Err("--js-domain and --js-api-prefix cannot be combined".into())
        }
        (_, Some(d)) if f.js_domain.is_some() => format!("$JS.{d}.API"),
        (Some(p), _) => p.trim_end_matches('.').to_string(),
        (None, Some(d)) => format!("$JS.{d}.API"),
        (None, None) => "$JS.API".to_string(),
    };
    Ok(ConnSettings {
        server,
        timeout: f.timeout,
        user: pick(&f.user, "user"),
        password: pick(&f.password, "password"),
        token: pick(&f.token, "token"),
        creds,
        nkey_seed,
        tls_cert,
        tls_key,
        tls_ca,
        tls_first: f.tlsfirst || ctx.get("tls_first").and_then(Value::as_bool) == Some(true),
        js_api_prefix,
        inbox_prefix: pick(&f.inbox_prefix, "inbox_prefix"),
    })
}

#[derive(Subcommand, Debug)]
pub enum ContextCmd {
    /// Create or update a context from the connection flags given (--server, --user, --creds, ...)
    #[command(visible_aliases = ["create", "save"])]
    Add(AddArgs),
    /// List known contexts (the selected one is marked *)
    #[command(visible_alias = "list")]
    Ls(LsArgs),
    /// Select the default context
    #[command(visible_aliases = ["switch", "set"])]
    Select(NameArg),
    /// Ensure no context is the default
    Unselect,
    /// Show the current or a named context
    #[command(visible_aliases = ["show", "view"])]
    Info(InfoArgs),
    /// Edit a context in $EDITOR (as JSON)
    Edit(NameArg),
    /// Copy a context
    #[command(visible_alias = "cp")]
    Copy(CopyArgs),
    /// Remove a context
    #[command(visible_alias = "remove")]
    Rm(RmArgs),
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// Context name
    name: String,
    /// A friendly description
    #[arg(long)]
    description: Option<String>,
    /// Select it as the default context
    #[arg(long)]
    select: bool,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Print only the names
    #[arg(long)]
    names: bool,
}

#[derive(Args, Debug)]
pub struct NameArg {
    /// Context name
    name: String,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Context name (default: the selected one)
    name: Option<String>,
}

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Context to copy
    source: String,
    /// New context name
    name: String,
    /// Description of the new context
    #[arg(long)]
    description: Option<String>,
    /// Select the new context
    #[arg(long)]
    select: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Context name
    name: String,
    /// Remove without asking (and unselect it if selected)
    #[arg(short, long)]
    force: bool,
}

pub fn run(flags: &GlobalFlags, cmd: &ContextCmd, json_out: bool) -> Res<()> {
    match cmd {
        ContextCmd::Add(a) => {
            valid_name(&a.name)?;
            let mut cfg = if context_path(&a.name)?.is_file() {
                load(&a.name)?
            } else {
                let mut m = Map::new();
                m.insert("description".into(), json!(""));
                m.insert("url".into(), json!(DEFAULT_URL));
                m
            };
            let set = |cfg: &mut Map<String, Value>, key: &str, v: &Option<String>| {
                if let Some(v) = v {
                    cfg.insert(key.into(), json!(v));
                }
            };
            set(&mut cfg, "description", &a.description);
            set(&mut cfg, "url", &flags.server);
            set(&mut cfg, "user", &flags.user);
            set(&mut cfg, "password", &flags.password);
            set(&mut cfg, "token", &flags.token);
            set(&mut cfg, "creds", &flags.creds);
            set(&mut cfg, "nkey", &flags.nkey);
            set(&mut cfg, "cert", &flags.tlscert);
            set(&mut cfg, "key", &flags.tlskey);
            set(&mut cfg, "ca", &flags.tlsca);
            set(&mut cfg, "jetstream_domain", &flags.js_domain);
            set(&mut cfg, "jetstream_api_prefix", &flags.js_api_prefix);
            set(&mut cfg, "inbox_prefix", &flags.inbox_prefix);
            if flags.tlsfirst {
                cfg.insert("tls_first".into(), json!(true));
            }
            let path = save(&a.name, &cfg)?;
            if a.select || selected().is_none() {
                select(&a.name)?;
            }
            eprintln!("Saved context {:?} to {}", a.name, path.display());
            show(&a.name, json_out)
        }
        ContextCmd::Ls(a) => {
            let names = known();
            let current = selected();
            if json_out {
                let all: Vec<Value> = names
                    .iter()
                    .filter_map(|n| {
                        let mut m = load(n).ok()?;
                        m.insert("name".into(), json!(n));
                        Some(masked(m))
                    })
                    .collect();
                print_json(&Value::Array(all));
                return Ok(());
            }
            if a.names {
                for n in names {
                    println!("{n}");
                }
                return Ok(());
            }
            if names.is_empty() {
                println!("No known contexts");
                return Ok(());
            }
            let mut t = Table::new("Known Contexts", &["Name", "Description"]);
            for n in names {
                let desc = load(&n)
                    .ok()
                    .and_then(|m| str_of(&m, "description").map(String::from))
                    .unwrap_or_default();
                let mark = if current.as_deref() == Some(n.as_str()) {
                    "*"
                } else {
                    ""
                };
                t.add(vec![format!("{n}{mark}"), desc]);
            }
            println!("{}", t.render());
            Ok(())
        }
        ContextCmd::Select(a) => {
            load(&a.name)?;
            select(&a.name)?;
            show(&a.name, json_out)
        }
        ContextCmd::Unselect => {
            let path = config_dir()?.join("context.txt");
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("cannot remove {}: {e}", path.display())),
            }
            println!("No context is selected");
            Ok(())
        }
        ContextCmd::Info(a) => {
            let name = a
                .name
                .clone()
                .or_else(selected)
                .ok_or("no context is selected and no name was given")?;
            show(&name, json_out)
        }
        ContextCmd::Edit(a) => edit(&a.name, json_out),
        ContextCmd::Copy(a) => {
            let mut cfg = load(&a.source)?;
            if context_path(&a.name)?.is_file() {
                return Err(format!("context {:?} already exists", a.name));
            }
            if let Some(d) = &a.description {
                cfg.insert("description".into(), json!(d));
            }
            save(&a.name, &cfg)?;
            if a.select {
                select(&a.name)?;
            }
            show(&a.name, json_out)
        }
        ContextCmd::Rm(a) => {
            let path = context_path(&a.name)?;
            if !path.is_file() {
                return Err(format!("unknown context {:?}", a.name));
            }
            if selected().as_deref() == Some(a.name.as_str()) {
                if !a.force {
                    return Err(format!(
                        "cannot remove the selected context {:?}: select another one, `keel context unselect`, or pass -f",
                        a.name
                    ));
                }
                let _ = std::fs::remove_file(config_dir()?.join("context.txt"));
            }
            if !confirm(&format!("Really delete context {:?}", a.name), a.force)? {
                return Ok(());
            }
            std::fs::remove_file(&path)
                .map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
            println!("Removed context {:?}", a.name);
            Ok(())
        }
    }
}

fn show(name: &str, json_out: bool) -> Res<()> {
    let cfg = load(name)?;
    if json_out {
        print_json(&masked(cfg));
        return Ok(());
    }
    let file_state = |key: &str, v: &str| -> String {
        if v.starts_with("data:;base64,") {
            return "embedded data".into();
        }
        match location(key, v) {
            Ok(p) if p.is_file() => format!("{v} (OK)"),
            _ => format!("{v} (ERROR)"),
        }
    };
    let mut c = Cols::new(format!("NATS Configuration Context {name:?}"));
    let mut row = |label: &str, value: Option<String>| {
        if let Some(v) = value.filter(|v| !v.is_empty()) {
            c.row(label, v);
        }
    };
    let get = |k: &str| str_of(&cfg, k).map(String::from);
    row("Description", get("description"));
    row("Server URLs", get("url"));
    row("Username", get("user"));
    row("Password", get("password").map(|p| "*".repeat(p.len())));
    row("Token", get("token").map(|t| "*".repeat(t.len())));
    row("Credentials", get("creds").map(|v| file_state("creds", &v)));
    row("NKey", get("nkey").map(|v| file_state("nkey", &v)));
    row("Certificate", get("cert").map(|v| file_state("cert", &v)));
    row("Key", get("key").map(|v| file_state("key", &v)));
    row("CA", get("ca").map(|v| file_state("ca", &v)));
    if cfg.get("tls_first").and_then(Value::as_bool) == Some(true) {
        row("TLS First", Some("true".into()));
    }
    row("JS API Prefix", get("jetstream_api_prefix"));
    row("JS Event Prefix", get("jetstream_event_prefix"));
    row("JS Domain", get("jetstream_domain"));
    row("Inbox Prefix", get("inbox_prefix"));
    row(
        "Path",
        context_path(name).ok().map(|p| p.display().to_string()),
    );
    print!("{}", c.render());
    println!();
    Ok(())
}

/// Opens the context in $VISUAL/$EDITOR (default vi) as JSON and saves it
/// back only if it is still a JSON object.
fn edit(name: &str, json_out: bool) -> Res<()> {
    let cfg = load(name)?;
    let editor = std::env::var("VISUAL")
        .ok()
        .or_else(|| std::env::var("EDITOR").ok())
        .filter(|e| !e.trim().is_empty())
        .unwrap_or_else(|| "vi".to_string());
    let tmp = std::env::temp_dir().join(format!("keel-context-{name}-{}.json", std::process::id()));
    write_private(
        &tmp,
        serde_json::to_string_pretty(&cfg)
            .unwrap_or_default()
            .as_bytes(),
    )?;
    // The editor may carry arguments (`code -w`), so the shell splits it.
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(&tmp)
        .status()
        .map_err(|e| format!("cannot run the editor {editor:?}: {e}"));
    let text = std::fs::read_to_string(&tmp);
    let _ = std::fs::remove_file(&tmp);
    if !status?.success() {
        return Err(format!(
            "the editor {editor:?} failed; context {name} unchanged"
        ));
    }
    let text = text.map_err(|e| format!("cannot read the edited context: {e}"))?;
    let new = match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => m,
        Ok(_) => {
            return Err(format!(
                "the edited context is not a JSON object; {name} unchanged"
            ))
        }
        Err(e) => {
            return Err(format!(
                "the edited context is not valid JSON ({e}); {name} unchanged"
            ))
        }
    };
    save(name, &new)?;
    show(name, json_out)
}
