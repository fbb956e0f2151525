//! Shared harness for the keel-server integration tests.
//!
//! Every test starts its own server process on a free loopback port. By default
//! that is the `keel-server` binary built by cargo; with `KEEL_TEST_REFERENCE=1`
//! the reference `nats-server` from `PATH` is used instead, which is how the
//! expectations in these tests are checked against the real thing.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Read;
use std::net::{SocketAddr, TcpStream as StdTcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// Upper bound for anything that is expected to happen "promptly".
pub const STEP: Duration = Duration::from_secs(5);
/// How long a negative check ("nothing arrives") waits.
pub const QUIET: Duration = Duration::from_millis(200);

const STARTUP_DEADLINE: Duration = Duration::from_secs(10);
const STARTUP_ATTEMPTS: usize = 3;

/// True when the tests run against the reference `nats-server`.
pub fn is_reference() -> bool {
    std::env::var("KEEL_TEST_REFERENCE").as_deref() == Ok("1")
}

fn server_binary() -> PathBuf {
    if is_reference() {
        reference_binary()
    } else {
        keel_binary()
    }
}

/// The keel-server binary cargo built.
pub fn keel_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keel-server"))
}

/// The reference nats-server: from PATH, else the `.venv` that scripts/test.sh makes
/// (tests that mix the two servers in one cluster run it even without KEEL_TEST_REFERENCE).
pub fn reference_binary() -> PathBuf {
    let venv = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../.venv/bin/nats-server"
    ));
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("nats-server").is_file()))
        .unwrap_or(false);
    if !on_path && venv.is_file() {
        venv
    } else {
        PathBuf::from("nats-server")
    }
}

/// A temporary directory removed on drop (no extra crates needed).
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let name = format!(
            "{prefix}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Every file under a directory: path -> (length, modification time, inode). The inode
/// tells a rewrite by rename apart even when length and (coarse) mtime stay the same.
pub type DirFingerprint = BTreeMap<PathBuf, (u64, SystemTime, u64)>;

/// Fingerprint of every file under `dir` (missing or vanishing entries are skipped: the
/// server may be renaming files while we look).
pub fn dir_fingerprint(dir: &Path) -> DirFingerprint {
    use std::os::unix::fs::MetadataExt;
    let mut out = DirFingerprint::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                stack.push(e.path());
            } else {
                let mtime = meta.modified().unwrap_or(UNIX_EPOCH);
                out.insert(e.path(), (meta.len(), mtime, meta.ino()));
            }
        }
    }
    out
}

/// A running server process; killed (and its temp dir removed) on drop.
pub struct Server {
    child: Child,
    /// The binary it runs (keel-server or the reference), kept for `restart`.
    bin: PathBuf,
    port: u16,
    log_path: PathBuf,
    /// Command-line arguments after `-a 127.0.0.1 -p <port>` (kept for `restart`).
    args: Vec<String>,
    /// JetStream store directory (`-sd`), when started with JetStream.
    store_dir: Option<PathBuf>,
    // Declared last so the process is gone before the directory is removed.
    _dir: TempDir,
}

/// How many times the server log says it started listening for clients.
fn listening_lines(log: &Path) -> usize {
    fs::read_to_string(log)
        .map(|s| s.matches("Listening for client connections on").count())
        .unwrap_or(0)
}

/// A port nothing listens on right now, below the ephemeral range.
pub use keel_server::harness::free_port;

/// Spawns the server binary on `port` with `args`, appending its output to
/// `log_path`.
fn spawn_server(bin: &Path, port: u16, args: &[String], log_path: &Path) -> Result<Child, String> {
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .map_err(|e| format!("open log: {e}"))?;
    let log_out = log.try_clone().map_err(|e| format!("clone log: {e}"))?;
    Command::new(bin)
        .arg("-a")
        .arg("127.0.0.1")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log_out))
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))
}

fn read_log(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut text);
    }
    // Keep panic messages readable: only the tail matters.
    const MAX: usize = 8 * 1024;
    if text.len() > MAX {
        let mut cut = text.len() - MAX;
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        text = format!("...{}", &text[cut..]);
    }
    text
}

impl Server {
    /// Starts a server with default settings.
    pub fn start() -> Server {
        Server::launch(None, false, &[])
    }

    /// Starts a server with extra command-line flags after `-a 127.0.0.1 -p <port>` (a
    /// later flag overrides an earlier one, e.g. `-a 0.0.0.0`).
    pub fn start_with_args(extra: &[&str]) -> Server {
        Server::launch(None, false, extra)
    }

    /// Starts a server with the given configuration file contents
    /// (nats-server configuration syntax).
    pub fn start_with_config(conf: &str) -> Server {
        Server::launch(Some(conf), false, &[])
    }

    /// A configuration file plus command-line flags (flags override the file).
    pub fn start_with_config_and_args(conf: &str, extra: &[&str]) -> Server {
        Server::launch(Some(conf), false, extra)
    }

    /// Starts a server with JetStream enabled: `-js -sd <tempdir>/store`.
    pub fn start_jetstream() -> Server {
        Server::launch(None, true, &[])
    }

    /// JetStream (`-js -sd <tempdir>/store`) plus a configuration file.
    pub fn start_jetstream_with_config(conf: &str) -> Server {
        Server::launch(Some(conf), true, &[])
    }

    /// JetStream on a store directory the test owns plus a configuration file.
    pub fn start_jetstream_with_config_at(conf: &str, store: &Path) -> Server {
        Server::launch_at(Some(conf), true, Some(store), &[])
    }

    /// JetStream on a store directory the test owns (`-js -sd <store>`).
    pub fn start_jetstream_at(store: &Path) -> Server {
        Server::launch_at(None, true, Some(store), &[])
    }

    fn launch(conf: Option<&str>, jetstream: bool, extra: &[&str]) -> Server {
        Server::launch_at(conf, jetstream, None, extra)
    }

    /// Starts `bin` (keel-server or the reference, whatever KEEL_TEST_REFERENCE says) with a
    /// configuration file and extra flags.
    pub fn start_binary(bin: &Path, conf: &str, extra: &[&str]) -> Server {
        Server::launch_bin(bin, Some(conf), false, None, extra)
    }

    fn launch_at(
        conf: Option<&str>,
        jetstream: bool,
        store: Option<&Path>,
        extra: &[&str],
    ) -> Server {
        Server::launch_bin(&server_binary(), conf, jetstream, store, extra)
    }

    fn launch_bin(
        bin: &Path,
        conf: Option<&str>,
        jetstream: bool,
        store: Option<&Path>,
        extra: &[&str],
    ) -> Server {
        let mut last_error = String::new();
        for _ in 0..STARTUP_ATTEMPTS {
            match Server::try_launch(bin, conf, jetstream, store, extra) {
                Ok(server) => return server,
                // Most likely the free port was taken between probe and bind.
                Err(e) => last_error = e,
            }
        }
        panic!(
            "server {} did not start after {STARTUP_ATTEMPTS} attempts: {last_error}",
            bin.display()
        );
    }

    fn try_launch(
        bin: &Path,
        conf: Option<&str>,
        jetstream: bool,
        store: Option<&Path>,
        extra: &[&str],
    ) -> Result<Server, String> {
        let dir = TempDir::new("keel-server-test");
        let port = free_port();
        let log_path = dir.path().join("server.log");
        let mut args = Vec::new();
        if let Some(conf) = conf {
            let conf_path = dir.path().join("server.conf");
            fs::write(&conf_path, conf).map_err(|e| format!("write config: {e}"))?;
            args.push("-c".to_string());
            args.push(conf_path.display().to_string());
        }
        let mut store_dir = None;
        if jetstream {
            let store = store
                .map(Path::to_path_buf)
                .unwrap_or_else(|| dir.path().join("store"));
            args.push("-js".to_string());
            args.push("-sd".to_string());
            args.push(store.display().to_string());
            store_dir = Some(store);
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        let child = spawn_server(bin, port, &args, &log_path)?;
        let listening_before = 0;

        let mut server = Server {
            child,
            bin: bin.to_path_buf(),
            port,
            log_path,
            args,
            store_dir,
            _dir: dir,
        };
        server.wait_ready(listening_before)?;
        Ok(server)
    }

    /// Stops the server the way an operator does (SIGTERM: flush, close stores, exit) and
    /// waits for it to exit. The store directory and port are kept for `restart`.
    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + STARTUP_DEADLINE;
        while matches!(self.child.try_wait(), Ok(None)) {
            if Instant::now() >= deadline {
                panic!("server did not exit on SIGTERM; log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Runs the server binary with `args` (after `-a 127.0.0.1 -p <free port>`) and
    /// waits for it to exit on its own: (exit code, everything it printed).
    pub fn run_to_exit(args: &[String]) -> (Option<i32>, String) {
        let dir = TempDir::new("keel-server-run");
        let log = dir.path().join("out.log");
        let mut child =
            spawn_server(&server_binary(), free_port(), args, &log).expect("spawn server");
        let deadline = Instant::now() + STARTUP_DEADLINE;
        let status = loop {
            if let Ok(Some(st)) = child.try_wait() {
                break st;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("server kept running; log:\n{}", read_log(&log));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        (status.code(), read_log(&log))
    }

    /// Kills the server process with SIGKILL (no shutdown handling at all)
    /// and waits for it to be gone. The store directory and port are kept
    /// for `restart`.
    pub fn kill_hard(&mut self) {
        // `Child::kill` sends SIGKILL on Unix.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again with the same arguments, port and store
    /// directory (after `kill_hard`, or kills the running one first).
    pub fn restart(&mut self) {
        if self.is_running() {
            self.kill_hard();
        }
        let deadline = Instant::now() + STARTUP_DEADLINE;
        loop {
            let before = listening_lines(&self.log_path);
            let last_error = match spawn_server(&self.bin, self.port, &self.args, &self.log_path) {
                Ok(child) => {
                    self.child = child;
                    match self.wait_ready(before) {
                        Ok(()) => return,
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            // The port may linger briefly after the old process died.
            if Instant::now() >= deadline {
                panic!("server did not restart on port {}: {last_error}", self.port);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The JetStream store directory (`-sd`), if started with JetStream.
    pub fn store_dir(&self) -> Option<&Path> {
        self.store_dir.as_deref()
    }

    /// What every file under the store directory looks like now (see [`DirFingerprint`]).
    pub fn store_fingerprint(&self) -> DirFingerprint {
        dir_fingerprint(self.store_dir().expect("started with JetStream"))
    }

    /// Waits until the server has written to its store since `before` was taken and then
    /// left it alone for `quiet`: a state write that is due (Keel saves consumer state at
    /// most every 20 ms, the reference's flusher at most every 100 ms) has happened by then.
    /// Layout-agnostic, so it works for both servers. Returns false when nothing changed
    /// within `limit`.
    pub async fn wait_store_written(
        &self,
        before: &DirFingerprint,
        quiet: Duration,
        limit: Duration,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        let mut last = self.store_fingerprint();
        while last == *before {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            last = self.store_fingerprint();
        }
        let mut since = tokio::time::Instant::now();
        while since.elapsed() < quiet {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let now = self.store_fingerprint();
            if now != last {
                last = now;
                since = tokio::time::Instant::now();
            }
        }
        true
    }

    /// Ready when this process logged that it listens (both servers print
    /// "Listening for client connections on") and the port accepts. The log line matters:
    /// with tests in parallel another test's server may briefly own the same port.
    fn wait_ready(&mut self, listening_before: usize) -> Result<(), String> {
        let deadline = Instant::now() + STARTUP_DEADLINE;
        let addr = self.addr();
        loop {
            if listening_lines(&self.log_path) <= listening_before {
                if let Ok(Some(status)) = self.child.try_wait() {
                    return Err(format!(
                        "server exited early with {status}; log:\n{}",
                        read_log(&self.log_path)
                    ));
                }
                if Instant::now() >= deadline {
                    return Err(format!(
                        "server did not log that it listens after {STARTUP_DEADLINE:?}; log:\n{}",
                        read_log(&self.log_path)
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "server exited early with {status}; log:\n{}",
                    read_log(&self.log_path)
                ));
            }
            if StdTcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "port {} not accepting after {STARTUP_DEADLINE:?}; log:\n{}",
                    self.port,
                    read_log(&self.log_path)
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The configuration file the server was started with (`start_with_config`).
    pub fn config_path(&self) -> PathBuf {
        self._dir.path().join("server.conf")
    }

    /// Rewrites the configuration file and reloads it (SIGHUP), waiting until the server
    /// logs that it reloaded.
    pub fn reload_config(&self, conf: &str) {
        fs::write(self.config_path(), conf).expect("write config");
        let before = self
            .full_log()
            .matches("Reloaded server configuration")
            .count();
        let _ = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status();
        self.wait_log_count("Reloaded server configuration", before + 1);
    }

    /// Waits until `text` appears at least `n` times in the log.
    pub fn wait_log_count(&self, text: &str, n: usize) {
        let deadline = Instant::now() + STEP;
        while self.full_log().matches(text).count() < n {
            assert!(
                Instant::now() < deadline,
                "{text:?} not logged {n} times; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The server's process id (to send it signals).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Server output captured so far (tail).
    /// The monitoring port, from the "Starting http monitor on <host>:<port>" line both servers
    /// log before they accept clients.
    pub fn monitor_port(&self) -> u16 {
        let deadline = Instant::now() + STEP;
        loop {
            // The whole log: a busy server's startup lines are past the tail `log()` keeps.
            let log = self.full_log();
            if let Some(line) = log.lines().find(|l| l.contains("Starting http monitor on")) {
                return line
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.trim().parse().ok())
                    .unwrap_or_else(|| panic!("no port in {line:?}"));
            }
            assert!(
                Instant::now() < deadline,
                "no monitoring line in the log:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The route port, from the "Listening for route connections on <host>:<port>" line both
    /// servers log once they accept routes.
    pub fn route_port(&self) -> u16 {
        let deadline = Instant::now() + STEP;
        loop {
            let log = self.full_log();
            if let Some(line) = log
                .lines()
                .rev()
                .find(|l| l.contains("Listening for route connections on"))
            {
                return line
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.trim().parse().ok())
                    .unwrap_or_else(|| panic!("no port in {line:?}"));
            }
            assert!(
                Instant::now() < deadline,
                "no route listener in the log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log(&self) -> String {
        read_log(&self.log_path)
    }

    /// Everything the server printed so far (for asserting on log lines).
    pub fn full_log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// True while the server process is alive.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Connects an async-nats client with default options.
    pub async fn client(&self) -> async_nats::Client {
        self.client_with(async_nats::ConnectOptions::new()).await
    }

    /// Connects an async-nats client with the given options.
    pub async fn client_with(&self, opts: async_nats::ConnectOptions) -> async_nats::Client {
        tokio::time::timeout(STEP, opts.connect(self.url()))
            .await
            .expect("connect timed out")
            .expect("connect failed")
    }

    /// Opens a raw TCP connection and consumes the INFO line (no CONNECT sent).
    pub async fn raw(&self) -> RawClient {
        RawClient::connect(self.addr()).await
    }

    /// Opens a raw TCP connection, consumes INFO and sends a non-verbose CONNECT.
    pub async fn raw_connected(&self) -> RawClient {
        let mut raw = self.raw().await;
        raw.send(
            b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1,\"headers\":true}\r\n",
        )
        .await;
        raw
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- server log (port {}) ----\n{}\n---- end server log ----",
                self.port,
                read_log(&self.log_path)
            );
        }
    }
}

/// Result of waiting for the peer to close a raw connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Closed {
    /// Orderly EOF.
    Eof,
    /// Connection reset or similar error.
    Error(std::io::ErrorKind),
}

/// A raw protocol client for byte-level checks: line reader plus writer.
pub struct RawClient {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// The INFO line the server greeted with (without CRLF).
    pub info: String,
    /// Asynchronous INFO lines received later, in order.
    pub async_infos: Vec<String>,
}

impl RawClient {
    pub async fn connect(addr: SocketAddr) -> RawClient {
        let stream = tokio::time::timeout(STEP, TcpStream::connect(addr))
            .await
            .expect("raw connect timed out")
            .expect("raw connect failed");
        RawClient::from_stream(stream).await
    }

    /// Wraps an already connected stream and consumes the INFO line.
    pub async fn from_stream(stream: TcpStream) -> RawClient {
        stream.set_nodelay(true).expect("set_nodelay");
        let (r, w) = stream.into_split();
        let mut raw = RawClient {
            reader: BufReader::new(r),
            writer: w,
            info: String::new(),
            async_infos: Vec::new(),
        };
        let info = raw.read_line().await;
        assert!(info.starts_with("INFO "), "expected INFO, got {info:?}");
        raw.info = info;
        raw
    }

    /// The INFO JSON object.
    pub fn info_json(&self) -> serde_json::Value {
        serde_json::from_str(self.info.trim_start_matches("INFO ").trim())
            .expect("INFO is valid JSON")
    }

    /// Writes all bytes in one write call (as far as the OS allows).
    pub async fn send(&mut self, bytes: &[u8]) {
        tokio::time::timeout(STEP, self.writer.write_all(bytes))
            .await
            .expect("raw write timed out")
            .expect("raw write failed");
    }

    /// Like `send` but returns the I/O result instead of panicking.
    pub async fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match tokio::time::timeout(STEP, self.writer.write_all(bytes)).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "raw write timed out",
            )),
        }
    }

    /// Reads one line, without the trailing CRLF. Panics on timeout or EOF.
    pub async fn read_line(&mut self) -> String {
        match self.try_read_line(STEP).await {
            Some(line) => line,
            None => panic!("connection closed while waiting for a line"),
        }
    }

    /// Reads one line within `wait`; `None` on EOF. Panics on timeout.
    pub async fn try_read_line(&mut self, wait: Duration) -> Option<String> {
        let mut buf = Vec::new();
        let n = tokio::time::timeout(wait, self.reader.read_until(b'\n', &mut buf))
            .await
            .expect("timed out waiting for a line")
            .expect("raw read failed");
        if n == 0 {
            return None;
        }
        let line = String::from_utf8_lossy(&buf);
        Some(line.trim_end_matches(['\r', '\n']).to_string())
    }

    /// Reads the next protocol line, answering server PINGs and skipping
    /// asynchronous INFO updates (nats-server sends one after the first PONG).
    pub async fn read_op(&mut self) -> String {
        loop {
            let line = self.read_line().await;
            if self.absorb(&line).await {
                continue;
            }
            return line;
        }
    }

    /// Handles lines a client must accept at any time; true if consumed.
    async fn absorb(&mut self, line: &str) -> bool {
        if line == "PING" {
            self.send(b"PONG\r\n").await;
            true
        } else if line.starts_with("INFO ") {
            self.async_infos.push(line.to_string());
            true
        } else {
            false
        }
    }

    /// Reads exactly `n` bytes plus the trailing CRLF, returning the `n` bytes.
    pub async fn read_payload(&mut self, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n + 2];
        tokio::time::timeout(STEP, self.reader.read_exact(&mut buf))
            .await
            .expect("timed out reading payload")
            .expect("payload read failed");
        assert_eq!(&buf[n..], b"\r\n", "payload not followed by CRLF");
        buf.truncate(n);
        buf
    }

    /// Expects `MSG <subject> <sid> [reply] <len>` followed by the payload.
    /// Returns (MSG line fields, payload).
    pub async fn read_msg(&mut self) -> (Vec<String>, Vec<u8>) {
        let line = self.read_op().await;
        let fields: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        assert!(
            fields.first().map(String::as_str) == Some("MSG") && (4..=5).contains(&fields.len()),
            "expected MSG line, got {line:?}"
        );
        let len: usize = fields.last().unwrap().parse().expect("MSG length");
        let payload = self.read_payload(len).await;
        (fields, payload)
    }

    /// Waits (bounded) until the server closes the connection, discarding
    /// anything still arriving.
    pub async fn expect_closed(&mut self, wait: Duration) -> Closed {
        let fut = async {
            let mut sink = vec![0u8; 64 * 1024];
            loop {
                match self.reader.read(&mut sink).await {
                    Ok(0) => return Closed::Eof,
                    Ok(_) => continue,
                    Err(e) => return Closed::Error(e.kind()),
                }
            }
        };
        tokio::time::timeout(wait, fut)
            .await
            .expect("server did not close the connection in time")
    }

    /// Asserts no protocol message (other than PING / async INFO) arrives
    /// within `QUIET`.
    pub async fn expect_silence(&mut self) {
        let deadline = tokio::time::Instant::now() + QUIET;
        loop {
            let mut buf = Vec::new();
            let read = self.reader.read_until(b'\n', &mut buf);
            match tokio::time::timeout_at(deadline, read).await {
                Err(_) if buf.is_empty() => return,
                Err(_) => panic!(
                    "unexpected partial data from server: {:?}",
                    String::from_utf8_lossy(&buf)
                ),
                Ok(Ok(0)) => panic!("connection closed unexpectedly"),
                Ok(Ok(_)) => {
                    let line = String::from_utf8_lossy(&buf);
                    let line = line.trim_end_matches(['\r', '\n']).to_string();
                    if !self.absorb(&line).await {
                        panic!("unexpected data from server: {line:?}");
                    }
                }
                Ok(Err(e)) => panic!("read error: {e}"),
            }
        }
    }
}

/// Await `fut` within `STEP`, panicking with `what` on timeout.
pub async fn within<F: std::future::IntoFuture>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Next message from a subscriber within `STEP`; panics if the stream ends.
pub async fn next_msg(sub: &mut async_nats::Subscriber) -> async_nats::Message {
    use futures::StreamExt;
    within("next message", sub.next())
        .await
        .expect("subscription ended unexpectedly")
}

/// Asserts that no message arrives on `sub` within `QUIET`.
pub async fn expect_no_msg(sub: &mut async_nats::Subscriber) {
    use futures::StreamExt;
    if let Ok(Some(msg)) = tokio::time::timeout(QUIET, sub.next()).await {
        panic!(
            "unexpected message on {}: {:?}",
            msg.subject,
            String::from_utf8_lossy(&msg.payload)
        );
    }
}

/// Round-trip barrier: returns once the server has processed every operation
/// this client sent before the call (e.g. a SUB). `Client::flush` only
/// flushes the client's socket buffer, so it cannot serve as a barrier.
///
/// Works by publishing to a fresh inbox subject the client itself subscribes
/// to, so it needs echo (the default).
pub async fn sync(client: &async_nats::Client) {
    let subject = client.new_inbox();
    let mut sub = client.subscribe(subject.clone()).await.expect("sync sub");
    client
        .publish(subject, bytes::Bytes::new())
        .await
        .expect("sync pub");
    next_msg(&mut sub).await;
    sub.unsubscribe().await.expect("sync unsub");
}

/// Sends a core request (e.g. to a `$JS.API.*` subject) and returns the raw
/// reply payload as text together with its parsed JSON. Panics on timeout,
/// no responders, or a reply that is not JSON.
pub async fn json_request(
    client: &async_nats::Client,
    subject: &str,
    body: impl Into<bytes::Bytes>,
) -> (String, serde_json::Value) {
    json_request_within(client, subject, body, STEP).await
}

/// [`json_request`] with its own time limit (for a test whose subject is not the request's
/// latency, on a loaded machine).
pub async fn json_request_within(
    client: &async_nats::Client,
    subject: &str,
    body: impl Into<bytes::Bytes>,
    limit: Duration,
) -> (String, serde_json::Value) {
    let request = async_nats::Request::new()
        .payload(body.into())
        .timeout(Some(limit));
    let reply = tokio::time::timeout(limit, client.send_request(subject.to_string(), request))
        .await
        .unwrap_or_else(|_| panic!("timed out: request {subject}"))
        .unwrap_or_else(|e| panic!("request {subject} failed: {e}"));
    let text = String::from_utf8_lossy(&reply.payload).into_owned();
    let json = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("reply to {subject} is not JSON ({e}): {text:?}"));
    (text, json)
}

/// `(code, err_code, description)` of a JetStream API error response
/// (`{"error":{"code":..,"err_code":..,"description":..}}`); panics when the
/// response carries no error.
pub fn api_error(resp: &serde_json::Value) -> (u64, u64, String) {
    let err = resp
        .get("error")
        .unwrap_or_else(|| panic!("expected an error response, got {resp}"));
    (
        err["code"].as_u64().expect("error.code"),
        err["err_code"].as_u64().expect("error.err_code"),
        err["description"]
            .as_str()
            .expect("error.description")
            .to_string(),
    )
}

// ---------------------------------------------------------------------------
// JetStream helpers (raw API requests, so every test sees the wire JSON)
// ---------------------------------------------------------------------------

/// A `$JS.API.*` request with a JSON body (`Null` sends an empty body) that must succeed;
/// returns the response.
pub async fn api_ok(
    client: &async_nats::Client,
    subject: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let (text, resp) = json_request(client, subject, body).await;
    assert!(resp.get("error").is_none(), "{subject} failed: {text}");
    resp
}

/// Answers every request `sub` gets with its own payload, through `client`, until aborted.
pub fn serve_echo(
    client: &async_nats::Client,
    mut sub: async_nats::Subscriber,
) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let client = client.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Some(reply) = m.reply {
                client.publish(reply, m.payload).await.unwrap();
            }
        }
    })
}

/// Requests on `subject` until one is answered: the responder's interest reached the
/// requester's server.
pub async fn until_answered(client: &async_nats::Client, subject: &str) {
    within("the responder's interest crosses the route", async {
        while !matches!(
            tokio::time::timeout(
                Duration::from_millis(200),
                client.request(subject.to_string(), "p".into())
            )
            .await,
            Ok(Ok(_))
        ) {}
    })
    .await
}

/// A JetStream-enabled server plus a core client and a JetStream context.
pub async fn js_setup() -> (Server, async_nats::Client, async_nats::jetstream::Context) {
    let server = Server::start_jetstream();
    let client = server.client().await;
    let js = async_nats::jetstream::new(client.clone());
    (server, client, js)
}

/// A `$JS.API.*` request with a JSON body (`Null` sends an empty body); returns the
/// response, error or not.
pub async fn api(
    client: &async_nats::Client,
    subject: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    json_request(client, subject, body).await.1
}

/// A `$JS.API.*` request (raw body bytes) that must fail: `(code, err_code, description)`.
pub async fn api_err(
    client: &async_nats::Client,
    subject: &str,
    body: impl Into<bytes::Bytes>,
) -> (u64, u64, String) {
    let (_, resp) = json_request(client, subject, body).await;
    api_error(&resp)
}

/// Sets `extra`'s keys on `base` (a config plus the keys a test adds or overrides).
pub fn merge(base: &mut serde_json::Value, extra: serde_json::Value) {
    if let serde_json::Value::Object(map) = extra {
        for (k, v) in map {
            base[k] = v;
        }
    }
}

/// `$JS.API.CONSUMER.INFO.<stream>.<consumer>`, which must succeed.
pub async fn consumer_info(
    client: &async_nats::Client,
    stream: &str,
    consumer: &str,
) -> serde_json::Value {
    api_ok(
        client,
        &format!("$JS.API.CONSUMER.INFO.{stream}.{consumer}"),
        serde_json::Value::Null,
    )
    .await
}

/// Publishes `payload` to a stream subject as a core request with `headers` and returns
/// the PubAck (or error) JSON.
pub async fn js_publish(
    client: &async_nats::Client,
    subject: &str,
    headers: &[(&str, &str)],
    payload: &str,
) -> serde_json::Value {
    let mut map = async_nats::HeaderMap::new();
    for (k, v) in headers {
        map.insert(*k, *v);
    }
    let reply = within(
        &format!("publish to {subject}"),
        client.request_with_headers(
            subject.to_string(),
            map,
            bytes::Bytes::from(payload.to_string()),
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("publish to {subject}: {e}"));
    serde_json::from_slice(&reply.payload).unwrap_or_else(|e| {
        panic!(
            "PubAck from {subject} is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&reply.payload)
        )
    })
}

/// Sends a pull request (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` with `body`)
/// whose deliveries and status messages arrive on the returned subscription.
pub async fn pull(
    client: &async_nats::Client,
    stream: &str,
    consumer: &str,
    body: &str,
) -> async_nats::Subscriber {
    let inbox = client.new_inbox();
    let sub = client
        .subscribe(inbox.clone())
        .await
        .expect("subscribe inbox");
    client
        .publish_with_reply(
            format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            inbox,
            bytes::Bytes::from(body.to_string()),
        )
        .await
        .expect("publish pull request");
    within("flush pull request", client.flush())
        .await
        .expect("flush");
    sub
}

/// The next message on a pull subscription, which must be a delivery (a message with a
/// `$JS.ACK.` reply, not a status).
pub async fn delivery(sub: &mut async_nats::Subscriber) -> async_nats::Message {
    let m = next_msg(sub).await;
    assert!(
        m.status.is_none()
            && m.reply
                .as_ref()
                .is_some_and(|r| r.as_str().starts_with("$JS.ACK.")),
        "expected a delivery, got subject {} reply {:?} status {:?} {:?}",
        m.subject,
        m.reply,
        m.status,
        m.description
    );
    m
}

/// A monitoring response.
pub struct Http {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Http {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16)
            .expect("chunk size");
        b = &b[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// `GET path` on the monitoring port: one request per connection, body read to EOF.
pub async fn http_get(port: u16, path: &str) -> Http {
    within(&format!("GET {path}"), async {
        let mut s = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect to the monitoring port");
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: keel-test\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.expect("write request");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.expect("read response");
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("response head");
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        let body = &raw[split + 4..];
        let chunked = headers.iter().any(|(k, v)| {
            k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
        });
        let body = if chunked { dechunk(body) } else { body.to_vec() };
        Http {
            status,
            headers,
            body: String::from_utf8(body).expect("UTF-8 body"),
        }
    })
    .await
}

/// One of several servers a test runs at once: in this process (`keel_server::harness`), or,
/// with `KEEL_TEST_REFERENCE=1`, a reference process (the same expectations hold for
/// separate processes, which is what in-process servers must match).
pub enum Node {
    InProcess(keel_server::harness::TestServer),
    Process(Server),
}

impl Node {
    /// A JetStream server with monitoring on a free port and `conf` (config-file syntax).
    pub async fn start_jetstream(conf: &str) -> Node {
        let conf = format!("http_port: -1\n{conf}");
        if is_reference() {
            return Node::Process(Server::start_jetstream_with_config(&conf));
        }
        Node::in_process(&conf, |_| {}).await
    }

    /// A server in this process from `conf` (config-file syntax, monitoring included),
    /// with `adjust` applied to its options.
    async fn in_process(conf: &str, adjust: impl FnOnce(&mut keel_server::config::Opts)) -> Node {
        let mut opts = keel_server::harness::opts_from_config(conf).expect("test config");
        adjust(&mut opts);
        Node::InProcess(
            keel_server::harness::start(opts)
                .await
                .expect("in-process server"),
        )
    }

    /// Like [`start_jetstream`](Self::start_jetstream), as a separate process (keel's
    /// binary too): what a signal does to a whole server process is seen as it is.
    pub async fn start_jetstream_process(conf: &str) -> Node {
        let conf = format!("http_port: -1\n{conf}");
        Node::Process(Server::launch_bin(
            &server_binary(),
            Some(&conf),
            true,
            None,
            &[],
        ))
    }

    /// Like [`start_jetstream`](Self::start_jetstream) with its store in `store` (kept
    /// when the server stops, so it can start there again).
    pub async fn start_jetstream_at(conf: &str, store: &Path) -> Node {
        let conf = format!("http_port: -1\n{conf}");
        if is_reference() {
            return Node::Process(Server::start_jetstream_with_config_at(&conf, store));
        }
        Node::in_process(&conf, |o| o.store_dir = Some(store.to_path_buf())).await
    }

    /// [`start_jetstream_at`](Self::start_jetstream_at) in this process, its options then
    /// adjusted (settings no config key has).
    pub async fn start_jetstream_at_with(
        conf: &str,
        store: &Path,
        adjust: impl FnOnce(&mut keel_server::config::Opts),
    ) -> Node {
        let conf = format!("http_port: -1\n{conf}");
        Node::in_process(&conf, |o| {
            o.store_dir = Some(store.to_path_buf());
            adjust(o)
        })
        .await
    }

    /// Like [`start_jetstream`](Self::start_jetstream), always in this process, with its
    /// JetStream files on `disk` (a `keel_store::Disk::fillable` lets the test fill it).
    pub async fn start_jetstream_on(conf: &str, disk: keel_store::Disk) -> Node {
        let conf = format!("http_port: -1\n{conf}");
        Node::in_process(&conf, |o| o.disk = disk).await
    }

    /// Its store directory, when it is in this process.
    pub fn store_dir(&self) -> Option<std::path::PathBuf> {
        match self {
            Node::InProcess(s) => s.store_dir().map(|d| d.to_path_buf()),
            Node::Process(s) => s.store_dir().map(|d| d.to_path_buf()),
        }
    }

    /// A cluster member (no JetStream) with monitoring on a free port; `conf` holds its
    /// `cluster {}` block.
    pub async fn start_cluster(conf: &str) -> Node {
        let conf = format!("http_port: -1\n{conf}");
        if is_reference() {
            return Node::Process(Server::start_with_config(&conf));
        }
        Node::in_process(&conf, |o| o.jetstream = false).await
    }

    /// `nats://127.0.0.1:<route port>`.
    pub fn route_url(&self) -> String {
        match self {
            Node::InProcess(s) => s.route_url(),
            Node::Process(s) => format!("nats://127.0.0.1:{}", s.route_port()),
        }
    }

    /// `/varz`, parsed.
    pub async fn varz(&self) -> serde_json::Value {
        let r = http_get(self.monitor_port(), "/varz").await;
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body).expect("varz JSON")
    }

    /// `/routez` with `query`, parsed.
    pub async fn routez(&self, query: &str) -> serde_json::Value {
        let r = http_get(self.monitor_port(), &format!("/routez?{query}")).await;
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body).expect("routez JSON")
    }

    /// Waits until the server has routes to exactly `n` other servers (`/varz` `remotes`,
    /// which counts servers whatever the reference's pool of connections per server).
    pub async fn wait_remotes(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let v = self.varz().await;
            if v["remotes"].as_u64() == Some(n) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} has remotes {} (want {n}); log:\n{}",
                v["server_name"],
                v["remotes"],
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until a route of this server carries the peers' interest in `subject` (or,
    /// with `present` false, no longer does).
    pub async fn wait_route_interest(&self, subject: &str, present: bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.route_subjects().await.iter().any(|s| s == subject) == present {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "route interest in {subject} never became {present}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `count` routes carry interest in `subject` (one per peer with interest).
    pub async fn wait_route_interest_count(&self, subject: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let v = self.routez("subs=1").await;
            let n = v["routes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| {
                    r["subscriptions_list"]
                        .as_array()
                        .is_some_and(|l| l.iter().any(|s| s == subject))
                })
                .count();
            if n == count {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} routes with interest in {subject}, not {count}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Every subject the peers' routes have interest in.
    pub async fn route_subjects(&self) -> Vec<String> {
        let v = self.routez("subs=1").await;
        v["routes"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|r| {
                r["subscriptions_list"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect()
    }

    /// Messages received over the routes from the server named `peer` (over all of its
    /// connections, as the reference pools them).
    pub async fn route_in_msgs(&self, peer: &str) -> u64 {
        let v = self.routez("").await;
        v["routes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["remote_name"] == peer)
            .map(|r| r["in_msgs"].as_u64().unwrap_or(0))
            .sum()
    }

    pub fn addr(&self) -> SocketAddr {
        match self {
            Node::InProcess(s) => s.client_addr(),
            Node::Process(s) => s.addr(),
        }
    }

    pub fn url(&self) -> String {
        format!("nats://{}", self.addr())
    }

    pub fn monitor_port(&self) -> u16 {
        match self {
            Node::InProcess(s) => s.monitor_addr().expect("monitoring on").port(),
            Node::Process(s) => s.monitor_port(),
        }
    }

    pub fn log(&self) -> String {
        match self {
            Node::InProcess(s) => s.log(),
            Node::Process(s) => s.log(),
        }
    }

    /// Waits (at most `STEP`) until the log holds `text`.
    pub async fn wait_logged(&self, text: &str) {
        within(&format!("{text:?} in the log"), async {
            while !self.log().contains(text) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }

    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.url())
            .await
            .expect("connect to the server")
    }

    /// Puts the server in lame duck mode (SIGUSR2 to a process), in the background.
    pub fn lame_duck(&self) {
        match self {
            Node::InProcess(s) => {
                let server = s.server().clone();
                tokio::spawn(async move { server.lame_duck().await });
            }
            Node::Process(p) => {
                let ok = std::process::Command::new("kill")
                    .args(["-USR2", &p.pid().to_string()])
                    .status()
                    .expect("kill -USR2")
                    .success();
                assert!(ok, "kill -USR2 failed");
            }
        }
    }

    /// Stops the server as SIGTERM does (the reference's processes get SIGTERM): the Raft
    /// groups it leads go to other servers first. Returns everything it logged.
    pub async fn terminate(self) -> String {
        match self {
            Node::InProcess(s) => s.terminate().await,
            Node::Process(mut s) => {
                s.stop();
                s.log()
            }
        }
    }

    /// Stops the server (an in-process one: everything it started, awaited; it hands no
    /// leadership over, so to the others it is a server that went away).
    pub async fn shutdown(self) {
        match self {
            Node::InProcess(s) => s.shutdown().await,
            Node::Process(mut s) => s.stop(),
        }
    }
}

/// A TCP proxy the test controls, to make a route's partition real: `cut` closes its
/// connections and refuses new ones, `stall` stops moving bytes while the sockets stay open
/// (a silent partition), `restore` lets traffic through again.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: std::sync::Arc<tokio::sync::watch::Sender<ProxyMode>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ProxyMode {
    Open,
    Cut,
    Stall,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let mode = std::sync::Arc::new(tokio::sync::watch::channel(ProxyMode::Open).0);
        let m = mode.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                if *m.borrow() == ProxyMode::Cut {
                    drop(inbound);
                    continue;
                }
                let rx = m.subscribe();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::select! {
                        _ = pipe(ri, wo, rx.clone()) => {}
                        _ = pipe(ro, wi, rx) => {}
                    }
                });
            }
        });
        Proxy { addr, mode, task }
    }

    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    pub fn set(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.set(ProxyMode::Cut);
        self.task.abort();
    }
}

/// Copies `from` to `to` while the proxy is open; holds the bytes while it stalls; ends
/// (dropping both sockets) once it is cut.
async fn pipe(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: tokio::sync::watch::Receiver<ProxyMode>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let now = *mode.borrow();
        match now {
            ProxyMode::Cut => return,
            ProxyMode::Stall => {
                if mode.changed().await.is_err() {
                    return;
                }
                continue;
            }
            ProxyMode::Open => {}
        }
        tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            },
            r = mode.changed() => if r.is_err() { return },
        }
    }
}
// ---------------------------------------------------------------------------
// TLS: certificates made by each test (rcgen), a raw TLS client, HTTPS GET
// ---------------------------------------------------------------------------

/// A CA, a server certificate for `localhost`/`127.0.0.1`, a client certificate from the same
/// CA, and a second CA with a client certificate of its own (the "wrong CA" cases). All are
/// generated at run time into a temp dir: no private key is ever committed.
pub struct TestCerts {
    dir: TempDir,
    /// Hex SHA-256 of the client certificate's SubjectPublicKeyInfo (`pinned_certs`).
    pub client_spki_sha256: String,
}

/// The client certificate's subject and names (verify_and_map, /connz tls_peer_certs).
pub const CLIENT_CN: &str = "alice";
pub const CLIENT_EMAIL: &str = "alice@example.org";
pub const CLIENT_DNS: &str = "alice.example.org";
pub const CLIENT_URI: &str = "spiffe://example.org/alice";

impl TestCerts {
    pub fn new() -> TestCerts {
        use rcgen::{
            BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
            KeyUsagePurpose, SanType,
        };
        let dir = TempDir::new("keel-tls-certs");
        let write = |name: &str, text: &str| fs::write(dir.path().join(name), text).unwrap();
        let make_ca = |cn: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name = DistinguishedName::new();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            let key = KeyPair::generate().unwrap();
            let cert = p.self_signed(&key).unwrap();
            (cert, Issuer::new(p, key))
        };
        let (ca_cert, ca) = make_ca("Keel Test CA");
        let (other_ca_cert, other_ca) = make_ca("Other Test CA");
        write("ca.pem", &ca_cert.pem());
        write("other-ca.pem", &other_ca_cert.pem());

        let mut sp = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        sp.distinguished_name = DistinguishedName::new();
        sp.distinguished_name.push(DnType::CommonName, "localhost");
        let skey = KeyPair::generate().unwrap();
        write("server-cert.pem", &sp.signed_by(&skey, &ca).unwrap().pem());
        write("server-key.pem", &skey.serialize_pem());

        let client = |issuer: &Issuer<'_, KeyPair>, prefix: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name = DistinguishedName::new();
            // DC (0.9.2342.19200300.100.1.25), then O, OU, CN: Go prints the DC last.
            p.distinguished_name.push(
                DnType::CustomDnType(vec![0, 9, 2342, 19200300, 100, 1, 25]),
                "example",
            );
            p.distinguished_name
                .push(DnType::OrganizationName, "Acme, Inc.");
            p.distinguished_name
                .push(DnType::OrganizationalUnitName, "dev");
            p.distinguished_name.push(DnType::CommonName, CLIENT_CN);
            p.subject_alt_names = vec![
                SanType::Rfc822Name(CLIENT_EMAIL.try_into().unwrap()),
                SanType::DnsName(CLIENT_DNS.try_into().unwrap()),
                SanType::URI(CLIENT_URI.try_into().unwrap()),
            ];
            let key = KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, issuer).unwrap();
            write(&format!("{prefix}client-cert.pem"), &cert.pem());
            write(&format!("{prefix}client-key.pem"), &key.serialize_pem());
            key
        };
        let ckey = client(&ca, "");
        client(&other_ca, "other-");
        let spki = rcgen::PublicKeyData::subject_public_key_info(&ckey);
        let digest = <sha2::Sha256 as sha2::Digest>::digest(&spki);
        let client_spki_sha256 = digest.iter().map(|b| format!("{b:02x}")).collect();
        TestCerts {
            dir,
            client_spki_sha256,
        }
    }

    /// Path of one of the files (`ca.pem`, `server-cert.pem`, `server-key.pem`,
    /// `client-cert.pem`, `client-key.pem`, `other-ca.pem`, `other-client-*.pem`).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `cert_file` and `key_file` of the server, for a `tls { }` block.
    pub fn server_keys(&self) -> String {
        format!(
            "cert_file: {:?}, key_file: {:?}",
            self.path("server-cert.pem").display().to_string(),
            self.path("server-key.pem").display().to_string()
        )
    }

    /// `ca_file` (the test CA) for a `tls { }` block.
    pub fn ca_key(&self) -> String {
        format!("ca_file: {:?}", self.path("ca.pem").display().to_string())
    }

    /// async-nats options trusting the test CA, with the client certificate when `cert`.
    pub fn client_options(&self, cert: bool) -> async_nats::ConnectOptions {
        let mut o = async_nats::ConnectOptions::new()
            .require_tls(true)
            .add_root_certificates(self.path("ca.pem"));
        if cert {
            o = o.add_client_certificate(self.path("client-cert.pem"), self.path("client-key.pem"));
        }
        o
    }

    /// A rustls client config trusting the test CA (`ca` file name), presenting the client
    /// certificate of `client` (`""`, `"other-"`) when given.
    pub fn rustls_client(&self, ca: &str, client: Option<&str>) -> rustls::ClientConfig {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(self.path(ca)).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let b = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        match client {
            None => b.with_no_client_auth(),
            Some(prefix) => {
                let chain =
                    CertificateDer::pem_file_iter(self.path(&format!("{prefix}client-cert.pem")))
                        .unwrap()
                        .collect::<Result<Vec<_>, _>>()
                        .unwrap();
                let key =
                    PrivateKeyDer::from_pem_file(self.path(&format!("{prefix}client-key.pem")))
                        .unwrap();
                b.with_client_auth_cert(chain, key).unwrap()
            }
        }
    }
}

/// Runs a TLS client handshake on `tcp` (server name `localhost`).
pub async fn tls_handshake(
    tcp: TcpStream,
    config: rustls::ClientConfig,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(STEP, connector.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out"))?
}

/// Reads one CRLF-terminated line from any stream (TLS included), byte by byte.
pub async fn read_line_from<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        let n = tokio::time::timeout(STEP, s.read(&mut b))
            .await
            .expect("timed out reading a line")
            .expect("read failed");
        assert!(
            n == 1,
            "connection closed after {:?}",
            String::from_utf8_lossy(&line)
        );
        line.push(b[0]);
        if line.ends_with(b"\r\n") {
            line.truncate(line.len() - 2);
            return String::from_utf8_lossy(&line).into_owned();
        }
    }
}

/// The JSON of an `INFO {...} ` line.
pub fn info_json(line: &str) -> serde_json::Value {
    let json = line
        .strip_prefix("INFO ")
        .unwrap_or_else(|| panic!("expected INFO, got {line:?}"));
    serde_json::from_str(json.trim()).expect("INFO JSON")
}

/// GET `path` over HTTPS (trusting the test CA); returns (status, body).
pub async fn https_get(certs: &TestCerts, port: u16, path: &str) -> (u16, String) {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let mut s = tls_handshake(tcp, certs.rustls_client("ca.pem", None))
        .await
        .expect("HTTPS handshake");
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    // Go may end the TLS session without close_notify; what was read counts.
    let _ = tokio::time::timeout(STEP, s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    if !chunked {
        return (status, body.to_string());
    }
    let mut rest = body;
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    (status, out)
}
