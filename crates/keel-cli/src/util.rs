//! Shared helpers: connecting with actionable errors, duration and header
//! parsing, body templates, and a server round trip.

use std::error::Error as _;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::{Client, ConnectErrorKind, ConnectOptions, HeaderMap, Subject, Subscriber};
use bytes::Bytes;
use futures::StreamExt;

/// Errors are plain sentences: everything the CLI reports is meant for a person.
pub type Res<T> = Result<T, String>;

/// Connection settings shared by every subcommand, after flags, environment
/// and the selected `nats` context were merged (see `context::resolve`).
#[derive(Clone, Debug, Default)]
pub struct ConnSettings {
    pub server: String,
    pub timeout: Duration,
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// Contents of a NATS credentials file (JWT and NKey seed), as `nats --creds`.
    pub creds: Option<String>,
    /// An NKey seed (`SU...`), read from the `--nkey` file.
    pub nkey_seed: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub tls_first: bool,
    /// `$JS.API` by default; `$JS.<domain>.API` with `--js-domain`, or `--js-api-prefix`.
    pub js_api_prefix: String,
    pub inbox_prefix: Option<String>,
}

impl ConnSettings {
    /// Client options for these settings; benchmarks add buffer sizes on top.
    pub fn options(&self) -> ConnectOptions {
        let mut opts = ConnectOptions::new()
            .name("keel-cli")
            .connection_timeout(self.timeout)
            .request_timeout(Some(self.timeout));
        if let Some(creds) = &self.creds {
            // Checked when the settings were resolved, so this cannot fail here.
            if let Ok(o) = opts.clone().credentials(creds) {
                opts = o;
            }
        }
        if let Some(seed) = &self.nkey_seed {
            opts = opts.nkey(seed.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            opts = opts
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        if self.tls_first {
            opts = opts.tls_first();
        }
        if let Some(p) = &self.inbox_prefix {
            opts = opts.custom_inbox_prefix(p);
        }
        if let Some(t) = &self.token {
            opts = opts.token(t.clone());
        }
        // Flags win over credentials in the URL, as in the `nats` CLI.
        // (async-nats itself ignores URL credentials.)
        match (&self.user, url_credentials(&self.server)) {
            (Some(user), _) => {
                opts.user_and_password(user.clone(), self.password.clone().unwrap_or_default())
            }
            (None, Some((user, Some(pass)))) => opts.user_and_password(user, pass),
            (None, Some((token, None))) => opts.token(token),
            (None, None) => opts,
        }
    }

    /// A JetStream context on `client` with the API prefix (domain) of these settings.
    pub fn jetstream(&self, client: Client) -> async_nats::jetstream::Context {
        async_nats::jetstream::ContextBuilder::new()
            .timeout(self.timeout)
            .api_prefix(self.js_api_prefix.clone())
            .build(client)
    }

    pub async fn connect(&self) -> Res<Client> {
        self.connect_with(self.options()).await
    }

    pub async fn connect_with(&self, opts: ConnectOptions) -> Res<Client> {
        let tls = self.tls_ca.is_some() || self.tls_cert.is_some() || self.tls_first;
        opts.connect(self.server.as_str()).await.map_err(|e| {
            let msg = connect_error_message(&redact(&self.server), &e);
            if tls {
                format!("{msg}; TLS was asked for (--tlsca/--tlscert/--tlsfirst): does the server have TLS enabled?")
            } else {
                msg
            }
        })
    }
}

/// The `user[:password]@` part of a server URL, if any.
fn url_credentials(url: &str) -> Option<(String, Option<String>)> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let (userinfo, _) = authority.rsplit_once('@')?;
    match userinfo.split_once(':') {
        Some((u, p)) => Some((u.to_string(), Some(p.to_string()))),
        None => Some((userinfo.to_string(), None)),
    }
}

/// The URL with any password or token masked, for error messages.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = match userinfo.split_once(':') {
                Some((u, _)) => format!("{u}:***"),
                None => "***".to_string(),
            };
            format!("{scheme}://{user}@{host}{path}")
        }
        None => url.to_string(),
    }
}

/// Turns a connect error into one line that tells the person what to do next.
fn connect_error_message(server: &str, err: &async_nats::ConnectError) -> String {
    let (what, hint) = match err.kind() {
        ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => (
            "authorization violation".to_string(),
            "check --user/--password or the credentials in the URL",
        ),
        ConnectErrorKind::ServerParse => (
            "invalid server URL".to_string(),
            "expected e.g. nats://127.0.0.1:4222",
        ),
        ConnectErrorKind::Dns => (
            "cannot resolve host name".to_string(),
            "check the host part of --server",
        ),
        ConnectErrorKind::TimedOut => (
            "timed out".to_string(),
            "is the server reachable? raise --timeout if it is slow",
        ),
        ConnectErrorKind::Tls => (format!("{err}"), "check the TLS settings of the server"),
        _ => match io_error_kind(err) {
            Some(io::ErrorKind::ConnectionRefused) => (
                "connection refused".to_string(),
                "is `keel-server -js` running?",
            ),
            Some(io::ErrorKind::ConnectionReset) | Some(io::ErrorKind::UnexpectedEof) => (
                "connection closed by the server during the handshake".to_string(),
                "is it a NATS server?",
            ),
            _ => (format!("{err}"), "is `keel-server -js` running?"),
        },
    };
    format!("cannot connect to {server}: {what} ({hint})")
}

/// Finds the underlying `io::Error`, if any, in the error's source chain.
fn io_error_kind(err: &async_nats::ConnectError) -> Option<io::ErrorKind> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = err.source();
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return Some(io.kind());
        }
        cur = e.source();
    }
    None
}

/// Parses durations the way Go (and so the `nats` CLI) writes them: `5s`,
/// `500ms`, `1m30s`, `250us`; a bare number means seconds. Like the `nats`
/// CLI it also takes days `d`, weeks `w`, months `M` (30 days) and years `y`
/// (365 days), e.g. `1d12h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    if let Ok(secs) = s.parse::<f64>() {
        return secs_to_duration(secs, s);
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("invalid duration {s:?}: missing unit"))?;
        if num_len == 0 {
            return Err(format!("invalid duration {s:?}: expected a number"));
        }
        let value: f64 = rest[..num_len]
            .parse()
            .map_err(|_| format!("invalid duration {s:?}"))?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "y" => 365.0 * 86400.0,
            "M" => 30.0 * 86400.0,
            "w" => 7.0 * 86400.0,
            "d" => 86400.0,
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            u => {
                return Err(format!(
                "invalid duration {s:?}: unknown unit {u:?} (use y, M, w, d, h, m, s, ms, us, ns)"
            ))
            }
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    secs_to_duration(total, s)
}

fn secs_to_duration(secs: f64, orig: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(secs).map_err(|_| format!("invalid duration {orig:?}"))
}

/// Parses repeatable `-H key:value` flags into a header map.
pub fn parse_headers(items: &[String]) -> Res<Option<HeaderMap>> {
    if items.is_empty() {
        return Ok(None);
    }
    let mut map = HeaderMap::new();
    for item in items {
        let (k, v) = item
            .split_once(':')
            .ok_or_else(|| format!("invalid header {item:?}: expected key:value"))?;
        let (k, v) = (k.trim(), v.trim());
        if k.is_empty() {
            return Err(format!("invalid header {item:?}: empty key"));
        }
        map.append(k, v);
    }
    Ok(Some(map))
}

/// Replaces `{{Count}}` (also `{{ Count }}` and the Go-template `{{.Count}}`)
/// with `count`; other `{{...}}` text is left untouched.
pub fn render_template(template: &str, count: u64) -> String {
    if !template.contains("{{") {
        return template.to_string();
    }
    let mut out = String::with_capacity(template.len() + 8);
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}") {
            Some(end) if matches!(after[..end].trim(), "Count" | ".Count") => {
                out.push_str(&count.to_string());
                rest = &after[end + 2..];
            }
            _ => {
                out.push_str("{{");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Header lines sorted by name, so output is stable across runs.
pub fn header_lines(headers: &HeaderMap) -> Vec<String> {
    let mut lines: Vec<String> = headers
        .iter()
        .flat_map(|(name, values)| values.iter().map(move |v| format!("{name}: {v}")))
        .collect();
    lines.sort();
    lines
}

/// Confirms that the server has processed everything a client sent so far.
///
/// `Client::flush` only empties the local write buffer. A message sent to the
/// client's own inbox comes back only after the server has handled every
/// earlier command on the connection, which is the guarantee benchmarks (and
/// subscribers announcing readiness) need.
pub struct Pinger {
    client: Client,
    inbox: Subject,
    sub: Subscriber,
}

impl Pinger {
    pub async fn new(client: &Client) -> Res<Pinger> {
        let inbox = Subject::from(client.new_inbox());
        let sub = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| format!("subscribe failed: {e}"))?;
        Ok(Pinger {
            client: client.clone(),
            inbox,
            sub,
        })
    }

    pub async fn ping(&mut self, timeout: Duration) -> Res<()> {
        self.client
            .publish(self.inbox.clone(), Bytes::new())
            .await
            .map_err(|e| format!("publish failed: {e}"))?;
        self.client
            .flush()
            .await
            .map_err(|e| format!("flush failed: {e}"))?;
        match tokio::time::timeout(timeout, self.sub.next()).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err("connection closed while waiting for the server".into()),
            Err(_) => Err(format!(
                "the server did not answer a round trip within {timeout:?}"
            )),
        }
    }
}

/// One-off [`Pinger`] round trip.
pub async fn round_trip(client: &Client, timeout: Duration) -> Res<()> {
    Pinger::new(client).await?.ping(timeout).await
}

/// Formats an integer with thousands separators, for human-readable counts.
pub fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Parses a byte size the way the `nats` CLI does: a plain number of bytes,
/// or a number with a 1024-based unit: `K`/`KB`/`KiB`, `M`/`MB`/`MiB`,
/// `G`/`GB`/`GiB`, `T`/`TB`/`TiB` (case-insensitive), e.g. `1GB`, `512MiB`.
/// A negative number means "unlimited" and yields -1.
pub fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    if let Some(rest) = t.strip_prefix('-') {
        return match rest.parse::<i64>() {
            Ok(_) => Ok(-1),
            Err(_) => Err(format!(
                "invalid size {s:?}: expected e.g. 1024, 1GB, 512MiB"
            )),
        };
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: i64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 1024, 1GB, 512MiB"))?;
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        u => {
            return Err(format!(
            "invalid size {s:?}: unknown unit {u:?} (use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB)"
        ))
        }
    };
    n.checked_mul(1i64 << shift)
        .ok_or_else(|| format!("invalid size {s:?}: too large"))
}

/// True when standard input is an interactive terminal.
pub fn stdin_is_terminal() -> bool {
    use std::io::IsTerminal;
    io::stdin().is_terminal()
}

/// True when standard error is an interactive terminal (progress bars go there).
pub fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal;
    io::stderr().is_terminal()
}

/// Asks a yes/no question for a destructive action, as `nats` does.
///
/// `force` (`-f`) skips the question. Without a terminal on stdin there is
/// nobody to answer, so the action is refused with a message naming `-f`
/// rather than silently going ahead or hanging.
pub fn confirm(question: &str, force: bool) -> Res<bool> {
    if force {
        return Ok(true);
    }
    if !stdin_is_terminal() {
        return Err(format!(
            "{question}? needs a confirmation, but stdin is not a terminal: pass -f (--force) to go ahead without asking"
        ));
    }
    eprint!("? {question}? (y/N) ");
    let _ = io::Write::flush(&mut io::stderr());
    let mut answer = String::new();
    io::stdin()
        .read_line(&mut answer)
        .map_err(|e| format!("cannot read the answer: {e}"))?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

/// A progress bar on stderr (indicatif), redrawn a few times a second while a
/// long benchmark or transfer runs. Nothing is drawn unless stderr is a
/// terminal, so logs and `--json` pipelines stay clean. Tasks bump a shared
/// counter (cheap on the hot path); a ticker moves the bar from it.
pub struct Progress {
    done: std::sync::Arc<std::sync::atomic::AtomicU64>,
    bar: Option<indicatif::ProgressBar>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    /// Counts messages (or other items): `label [####----] 1,234/10,000 5,678/s`.
    pub fn new(label: &str, total: u64, enabled: bool) -> Progress {
        Progress::styled(
            label,
            total,
            enabled,
            "{prefix} [{bar:30}] {human_pos}/{human_len} {per_sec} eta {eta}",
        )
    }

    /// Counts bytes: `label [####----] 1.2 MiB/4.0 MiB 3.1 MiB/s`.
    pub fn bytes(label: &str, total: u64, enabled: bool) -> Progress {
        Progress::styled(
            label,
            total,
            enabled,
            "{prefix} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
    }

    /// For one long request with no count to show (a purge): a spinner and the time.
    pub fn spinner(label: &str, enabled: bool) -> Progress {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        if !(enabled && stderr_is_terminal()) {
            return Progress {
                done,
                bar: None,
                task: None,
            };
        }
        let bar = indicatif::ProgressBar::new_spinner();
        if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {prefix} {elapsed}") {
            bar.set_style(style);
        }
        bar.set_prefix(label.to_string());
        bar.enable_steady_tick(Duration::from_millis(100));
        Progress {
            done,
            bar: Some(bar),
            task: None,
        }
    }

    fn styled(label: &str, total: u64, enabled: bool, template: &str) -> Progress {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        if !(enabled && total > 0 && stderr_is_terminal()) {
            return Progress {
                done,
                bar: None,
                task: None,
            };
        }
        let bar = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("#>-"));
        }
        bar.set_prefix(label.to_string());
        let task = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let (done, bar) = (done.clone(), bar.clone());
            rt.spawn(async move {
                loop {
                    bar.set_position(done.load(Ordering::Relaxed).min(total));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        });
        Progress {
            done,
            bar: Some(bar),
            task,
        }
    }

    /// A counter to bump from any task (clones share it).
    pub fn counter(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.done.clone()
    }

    pub fn add(&self, n: u64) {
        self.done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stops drawing and clears the line.
    pub fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop();
    }
}

/// After a stepdown: asks `look` every 100 ms, for at most `limit`, until it names a leader
/// other than `old` (the stream, consumer and meta stepdowns wait the same way).
pub async fn new_leader<F, Fut>(old: &str, limit: Duration, mut look: F) -> Option<String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Some(new) = look().await.filter(|n| !n.is_empty() && n != old) {
            return Some(new);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("24h").unwrap(), Duration::from_secs(86400));
        assert_eq!(parse_duration("1d").unwrap(), Duration::from_secs(86400));
        assert_eq!(
            parse_duration("1w1d").unwrap(),
            Duration::from_secs(8 * 86400)
        );
        assert_eq!(
            parse_duration("1y").unwrap(),
            Duration::from_secs(365 * 86400)
        );
        assert_eq!(
            parse_duration("1M").unwrap(),
            Duration::from_secs(30 * 86400)
        );
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn templates() {
        assert_eq!(render_template("msg {{Count}}", 3), "msg 3");
        assert_eq!(render_template("{{ Count }}-{{.Count}}", 7), "7-7");
        assert_eq!(render_template("{{Other}} {{Count}}", 1), "{{Other}} 1");
        assert_eq!(render_template("open {{ only", 1), "open {{ only");
        assert_eq!(render_template("plain", 1), "plain");
    }

    #[test]
    fn headers() {
        let h = parse_headers(&["a:1".into(), "b: two:2".into(), "a:3".into()])
            .unwrap()
            .unwrap();
        assert_eq!(header_lines(&h), vec!["a: 1", "a: 3", "b: two:2"]);
        assert!(parse_headers(&["novalue".into()]).is_err());
        assert!(parse_headers(&[]).unwrap().is_none());
    }

    #[test]
    fn url_auth() {
        assert_eq!(url_credentials("nats://127.0.0.1:4222"), None);
        assert_eq!(
            url_credentials("nats://al:pw@h:4222"),
            Some(("al".into(), Some("pw".into())))
        );
        assert_eq!(url_credentials("nats://tok@h"), Some(("tok".into(), None)));
        assert_eq!(redact("nats://al:pw@h:4222"), "nats://al:***@h:4222");
        assert_eq!(redact("nats://tok@h"), "nats://***@h");
        assert_eq!(redact("nats://h:4222"), "nats://h:4222");
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("1GB").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1k").unwrap(), 1024);
        assert_eq!(parse_bytes("-1").unwrap(), -1);
        assert!(parse_bytes("1XB").is_err());
        assert!(parse_bytes("GB").is_err());
    }

    #[test]
    fn grouping() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(1234567), "1,234,567");
    }
}
