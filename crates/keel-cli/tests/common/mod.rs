//! Helpers for the end-to-end tests: start a server on a free loopback port
//! (with JetStream on a temporary store directory when asked), run `keel`.
//!
//! The server is the reference `nats-server` from PATH with `KEEL_TEST_REFERENCE=1`
//! (as in keel-server's tests), else `$KEEL_TEST_SERVER_BIN` if set, else a built
//! `keel-server` from this workspace's target dir. Without either, server-backed
//! tests print a note and pass.
//!
//! Every `keel` run gets an empty `XDG_CONFIG_HOME`, so a developer's own
//! `nats` contexts never change what a test connects to.

#![allow(dead_code)]

use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const KEEL: &str = env!("CARGO_BIN_EXE_keel");
pub const DEADLINE: Duration = Duration::from_secs(30);

pub struct Server {
    pub child: Child,
    pub url: String,
    bin: PathBuf,
    port: u16,
    dir: Option<PathBuf>,
    log_path: PathBuf,
    config: Option<PathBuf>,
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs the server (`kill -9`: no shutdown handling at all) and waits for it to be
    /// gone; port and store directory are kept for [`Server::restart`].
    pub fn kill_hard(&mut self) {
        // `Child::kill` sends SIGKILL on Unix.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and store directory (killing it first
    /// if it still runs).
    pub fn restart(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill_hard();
        }
        let start = Instant::now();
        loop {
            let before = listening_lines(&self.log_path);
            self.child = spawn(
                &self.bin,
                self.port,
                self.dir.as_deref(),
                self.config.as_deref(),
                &self.log_path,
            );
            if self.wait_listening(before) {
                return;
            }
            // The old process's port may linger for a moment.
            assert!(
                start.elapsed() < DEADLINE,
                "server did not restart on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until this process logged more "Listening for client connections on" lines
    /// than `before` and the port accepts; false if it exited first.
    fn wait_listening(&mut self, before: usize) -> bool {
        let start = Instant::now();
        while listening_lines(&self.log_path) <= before
            || TcpStream::connect(("127.0.0.1", self.port)).is_err()
        {
            if self.child.try_wait().expect("poll server").is_some() {
                return false;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "server did not listen on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Runs keel against this server (`-s URL` appended).
    pub fn keel(&self, args: &[&str]) -> Output {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["-s", &self.url]);
        keel(&all)
    }

    /// Like [`Server::keel`], but asserts success and returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.keel(args);
        assert!(
            out.status.success(),
            "keel {args:?} failed ({:?}):\nstdout: {}\nstderr: {}",
            out.status.code(),
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// Like [`Server::keel`], but asserts failure with exit code 1 and
    /// returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.keel(args);
        assert_eq!(
            out.status.code(),
            Some(1),
            "keel {args:?} should fail:\nstdout: {}\nstderr: {}",
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stderr)
    }

    /// Runs keel and parses stdout as JSON.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = self.ok(args);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("keel {args:?} did not print JSON ({e}):\n{out}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        if let Some(log_dir) = self.log_path.parent() {
            let _ = std::fs::remove_dir_all(log_dir);
        }
    }
}

pub fn server_binary() -> Option<PathBuf> {
    if std::env::var("KEEL_TEST_REFERENCE").as_deref() == Ok("1") {
        return Some(PathBuf::from("nats-server"));
    }
    if let Some(bin) = std::env::var_os("KEEL_TEST_SERVER_BIN") {
        return Some(PathBuf::from(bin));
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let built_here = Path::new(KEEL).parent().map(|d| d.join("keel-server"));
    built_here
        .into_iter()
        .chain(["debug", "release"].map(|p| workspace.join("target").join(p).join("keel-server")))
        .find(|p| p.is_file())
}

/// A port nothing listens on right now, below the ephemeral range.
pub use keel_server::harness::free_port;

pub fn temp_dir(tag: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("keel-cli-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// True when the server under test is the reference nats-server (`KEEL_TEST_REFERENCE=1`
/// or `KEEL_TEST_SERVER_BIN=nats-server`).
pub fn is_reference() -> bool {
    server_binary()
        .and_then(|b| {
            b.file_name()
                .map(|n| n.to_string_lossy().starts_with("nats-server"))
        })
        .unwrap_or(false)
}

fn listening_lines(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|s| s.matches("Listening for client connections on").count())
        .unwrap_or(0)
}

/// Spawns `bin` on `port` (with JetStream on `store` when given, and the config file
/// `config`), appending its stderr to `log_path`.
fn spawn(
    bin: &Path,
    port: u16,
    store: Option<&Path>,
    config: Option<&Path>,
    log_path: &Path,
) -> Child {
    let mut cmd = Command::new(bin);
    if let Some(c) = config {
        cmd.arg("-c").arg(c);
    }
    cmd.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
    if let Some(d) = store {
        cmd.args(["-js", "-sd"]).arg(d);
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .expect("open server log");
    cmd.stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()))
}

/// Starts a server with JetStream (`-js -sd <tmp>`) or without.
pub fn start(jetstream: bool) -> Option<Server> {
    start_with(jetstream, None)
}

/// Starts a server with JetStream and this configuration file text (`-c`), e.g. accounts
/// and `system_account`; flags give the port and store directory.
pub fn start_with_config(config: &str) -> Option<Server> {
    start_with(true, Some(config))
}

fn start_with(jetstream: bool, config: Option<&str>) -> Option<Server> {
    let Some(bin) = server_binary() else {
        eprintln!(
            "note: skipping, no server binary: build keel-server or set KEEL_TEST_SERVER_BIN"
        );
        return None;
    };
    let dir = jetstream.then(|| temp_dir("store"));
    // The log tells that *this* process listens: with tests in parallel, another test's
    // server could briefly own the same port.
    let log_dir = temp_dir("log");
    let log_path = log_dir.join("server.log");
    let config = config.map(|text| {
        let path = log_dir.join("server.conf");
        std::fs::write(&path, text).expect("write server config");
        path
    });
    // Another test may take the free port between the probe and the server's bind: the
    // server then exits, and is started again on another port.
    for _ in 0..STARTUP_ATTEMPTS {
        let port = free_port();
        let before = listening_lines(&log_path);
        let child = spawn(&bin, port, dir.as_deref(), config.as_deref(), &log_path);
        let mut server = Server {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            bin: bin.clone(),
            port,
            dir: dir.clone(),
            log_path: log_path.clone(),
            config: config.clone(),
        };
        if server.wait_listening(before) {
            return Some(server);
        }
        // Dropped without its directories, which the next attempt uses.
        server.dir = None;
        server.log_path = PathBuf::new();
    }
    panic!(
        "{} did not start after {STARTUP_ATTEMPTS} attempts; log:\n{}",
        bin.display(),
        std::fs::read_to_string(&log_path).unwrap_or_default()
    );
}

const STARTUP_ATTEMPTS: usize = 5;

/// An empty config directory shared by this test process's `keel` runs.
pub fn isolated_config() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| temp_dir("config")).clone()
}

/// A `keel` command without the caller's NATS environment or contexts.
pub fn keel_cmd() -> Command {
    let mut c = Command::new(KEEL);
    for var in [
        "NATS_URL",
        "NATS_CONTEXT",
        "NATS_USER",
        "NATS_PASSWORD",
        "NATS_TOKEN",
        "NATS_CREDS",
        "NATS_NKEY",
        "NATS_CERT",
        "NATS_KEY",
        "NATS_CA",
        "NATS_TIMEOUT",
    ] {
        c.env_remove(var);
    }
    c.env("XDG_CONFIG_HOME", isolated_config());
    c
}

pub fn keel(args: &[&str]) -> Output {
    keel_cmd()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run keel")
}

/// Runs keel with `input` on stdin (a pipe, so not a terminal).
pub fn keel_with_stdin(args: &[&str], input: &str) -> Output {
    let mut child = keel_cmd()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keel");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().expect("wait for keel")
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Asserts that every expected fragment occurs in `haystack`.
pub fn contains_all(haystack: &str, expected: &[&str]) {
    for e in expected {
        assert!(haystack.contains(e), "missing {e:?} in:\n{haystack}");
    }
}
