//! In-process servers for tests: a complete server (client listener, JetStream, optional
//! monitoring) started on the current tokio runtime, as the binary starts one
//! (`launch::start`), with its own log kept in memory and its own store directory. Several
//! can run in one test process at once and share nothing (the cluster tests need that).
//!
//! ```no_run
//! # async fn demo() {
//! let a = keel_server::harness::start(keel_server::harness::opts()).await.unwrap();
//! let b = keel_server::harness::start(keel_server::harness::opts()).await.unwrap();
//! // ... connect to a.client_url() and b.client_url() ...
//! a.shutdown().await;
//! b.shutdown().await;
//! # }
//! ```
//!
//! A cluster: each server gets a cluster port ([`cluster_opts`], or a `cluster {}` block
//! through [`opts_from_config`]) and the others' [`route_url`](TestServer::route_url)s as
//! routes; [`wait_peers`](TestServer::wait_peers) waits for the mesh.
//!
//! ```no_run
//! # async fn demo() {
//! use keel_server::harness::{cluster_opts, start};
//! let a = start(cluster_opts("c", &[])).await.unwrap();
//! let b = start(cluster_opts("c", &[a.route_url()])).await.unwrap();
//! a.wait_peers(1).await.unwrap();
//! # }
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::Opts;
use crate::launch::{self, Running};
use crate::log::{Log, LogOpts};
use crate::server::Server;

/// Options for a test server: loopback, a free client port, JetStream on (in a store
/// directory of its own unless `store_dir` is set), no monitoring (`http_port: Some(0)`
/// turns it on, on a free port). Adjust the rest as a config file would.
pub fn opts() -> Opts {
    Opts {
        host: "127.0.0.1".into(),
        port: 0,
        jetstream: true,
        ..Opts::default()
    }
}

/// [`opts`] without JetStream, in cluster `name`, with a free loopback cluster port and
/// `routes` (`nats://host:port` URLs) to dial. Routes ping every second here, so a dead
/// peer is found fast.
pub fn cluster_opts(name: &str, routes: &[String]) -> Opts {
    let mut o = opts();
    o.jetstream = false;
    o.cluster.name = Some(name.to_string());
    o.cluster.host = Some("127.0.0.1".into());
    o.cluster.port = -1;
    o.cluster.ping_interval = Some(std::time::Duration::from_secs(1));
    o.cluster.routes = routes
        .iter()
        .map(|r| crate::config::RouteUrl::parse(r).expect("route URL"))
        .collect();
    o
}

/// [`opts`] with `conf` (the nats-server config-file syntax) applied on top, as the binary
/// applies `-c`.
pub fn opts_from_config(conf: &str) -> Result<Opts, String> {
    let map = crate::conf::parse(conf).map_err(|e| e.to_string())?;
    let mut o = opts();
    crate::config::apply_config(&mut o, &map)?;
    // Loads the certificates a `tls { }` block names, as the command line does.
    crate::config::finish_tls(&mut o)?;
    Ok(o)
}

/// A running in-process server. Call [`shutdown`](Self::shutdown) to stop it; dropping it
/// only asks it to stop.
pub struct TestServer {
    running: Option<Running>,
    log: Log,
    /// The store directory this handle made (removed at shutdown).
    own_store: Option<PathBuf>,
}

/// A port nothing listens on right now, below the kernel's ephemeral range (32768-60999 by
/// default): a port picked by binding port 0 comes from that range, and an outgoing
/// connection (another server's route dialing, a client) may take it as its source port
/// before the server it was picked for binds it ("Address already in use").
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = rand::random_range(20_000..32_768);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

/// Starts a server from `opts` on the current runtime (which must be multi-threaded, as
/// `#[tokio::test(flavor = "multi_thread")]`). Errors carry the server's log.
pub async fn start(mut opts: Opts) -> Result<TestServer, String> {
    if tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::CurrentThread
    {
        return Err("an in-process server needs a multi-thread tokio runtime".into());
    }
    let mut own_store = None;
    if opts.jetstream && opts.store_dir.is_none() {
        let dir = std::env::temp_dir().join(format!(
            "keel-harness-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        opts.store_dir = Some(dir.clone());
        own_store = Some(dir);
    }
    let log = Log::capture(LogOpts {
        debug: opts.debug,
        trace: opts.trace,
        logtime: opts.logtime,
        max_traced: opts.max_traced_msg_len,
    });
    match launch::start(opts, log.clone()).await {
        Ok(running) => Ok(TestServer {
            running: Some(running),
            log,
            own_store,
        }),
        Err(()) => {
            if let Some(d) = &own_store {
                let _ = std::fs::remove_dir_all(d);
            }
            Err(format!("server did not start:\n{}", log.captured()))
        }
    }
}

impl TestServer {
    fn running(&self) -> &Running {
        self.running.as_ref().expect("running until shutdown")
    }

    pub fn server(&self) -> &Arc<Server> {
        &self.running().server
    }

    pub fn client_addr(&self) -> SocketAddr {
        self.running().client_addr
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn client_url(&self) -> String {
        format!("nats://{}", self.client_addr())
    }

    /// The monitoring listener's address, when monitoring was asked for.
    pub fn monitor_addr(&self) -> Option<SocketAddr> {
        self.running().monitor_addr
    }

    /// Where routes are accepted (in a cluster).
    pub fn cluster_addr(&self) -> Option<SocketAddr> {
        self.server().cluster.get().and_then(|c| c.listen_addr())
    }

    /// `nats://127.0.0.1:<cluster port>`, for the other servers' routes.
    pub fn route_url(&self) -> String {
        format!(
            "nats://{}",
            self.cluster_addr().expect("the server has a cluster port")
        )
    }

    /// How many other servers it has a route to.
    pub fn num_peers(&self) -> usize {
        self.server().cluster.get().map_or(0, |c| c.num_peers())
    }

    /// Waits (at most 10 s) until it has routes to exactly `n` other servers.
    pub async fn wait_peers(&self, n: usize) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let have = self.num_peers();
            if have == n {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "{} has {have} peers, not {n}; log:\n{}",
                    self.server().server_name,
                    self.log()
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Everything the server has logged so far.
    pub fn log(&self) -> String {
        self.log.captured()
    }

    pub fn store_dir(&self) -> Option<&Path> {
        self.running().server.opts.store_dir.as_deref()
    }

    /// Stops the server as SIGTERM does: the Raft groups it leads are handed to other
    /// servers first (`jetstream::cluster::hand_off_leadership`), the stop is announced
    /// (`Server::announce_stop`), then `shutdown`. Returns
    /// everything it logged.
    pub async fn terminate(self) -> String {
        if let Some(r) = &self.running {
            crate::jetstream::cluster::hand_off_leadership(&r.server, false).await;
            r.server.announce_stop(false);
        }
        let log = self.log.clone();
        self.shutdown().await;
        log.captured()
    }

    /// Stops everything the server started (connections, listeners, JetStream's tasks,
    /// stores closed, monitoring) and removes the store directory it made. Leadership is
    /// not handed over: to the rest of a cluster this is a server that went away.
    pub async fn shutdown(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
        if let Some(d) = self.own_store.take() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        // Not shut down (a test panicked): ask it to stop; the runtime ends its tasks.
        if let Some(r) = &self.running {
            if std::thread::panicking() {
                // A failed test shows what each of its servers logged, as a process's does.
                eprintln!(
                    "---- server log ({} at {}) ----\n{}---- end server log ----",
                    r.server.opts.server_name.as_deref().unwrap_or("unnamed"),
                    self.client_addr(),
                    self.log.captured()
                );
            }
            r.server.shutdown();
        }
    }
}
