//! Starting and stopping a whole server: JetStream, monitoring, the client listener, the
//! background tasks, in that order, with the reference's startup log lines. The binary and
//! the in-process harness (`harness`) both start servers this way, so a test server is the
//! same server the binary runs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Opts, COMPAT_VERSION, GIT_COMMIT, KEEL_VERSION};
use crate::log::Log;
use crate::server::{host_port, Server};
use crate::{error, info, warn};

/// A started server: its accept loop runs until shutdown is requested.
pub struct Running {
    pub server: Arc<Server>,
    /// Where clients connect.
    pub client_addr: SocketAddr,
    /// Where monitoring answers, when it was asked for.
    pub monitor_addr: Option<SocketAddr>,
    accept: tokio::task::JoinHandle<()>,
}

/// Longest wait for the server's tasks to end at shutdown (they end at once unless stuck
/// on a store).
const TASKS_LIMIT: Duration = Duration::from_secs(10);

/// Starts everything `opts` asks for on the current tokio runtime, which must be a
/// multi-thread one (the group commit moves its fsync off the worker with
/// `block_in_place`). Err once the reason is logged (the binary then exits with 1).
pub async fn start(opts: Opts, log: Log) -> Result<Running, ()> {
    let server = Server::new(opts, log);
    let log = &server.log;
    info!(log, "Starting keel-server");
    info!(
        log,
        "  Version:  {KEEL_VERSION} (nats-server API level {COMPAT_VERSION})"
    );
    if !GIT_COMMIT.is_empty() {
        info!(log, "  Git:      [{GIT_COMMIT}]");
    }
    info!(log, "  Name:     {}", server.server_name);
    info!(log, "  ID:       {}", server.server_id);
    if let Some(cf) = &server.opts.config_file {
        info!(log, "Using configuration file: {}", cf.display());
    }
    if let Some(p) = &server.opts.pid_file {
        if let Err(e) = std::fs::write(p, std::process::id().to_string()) {
            error!(log, "Could not write pidfile: {e}");
            return Err(());
        }
    }
    let stop_early = |server: &Arc<Server>| {
        // Whatever was started before the failure stops with the server.
        server.shutdown();
        server.seal_internal();
    };
    // Before anything subscribes: the cluster counts every subscription for its peers.
    if server.opts.cluster.enabled() {
        let _ = server.cluster.set(crate::route::Cluster::install(&server));
    }
    let auth_opts = server.opts.auth.clone();
    if let Err(e) = server.apply_auth(&auth_opts) {
        error!(log, "Error configuring authorization: {e}");
        stop_early(&server);
        return Err(());
    }
    if auth_opts
        .password
        .as_deref()
        .is_some_and(|p| !p.starts_with("$2"))
        || auth_opts
            .users
            .iter()
            .chain(auth_opts.accounts.iter().flat_map(|a| a.users.iter()))
            .any(|u| u.password.as_deref().is_some_and(|p| !p.starts_with("$2")))
    {
        warn!(log, "Plaintext passwords detected, use nkeys or bcrypt");
    }
    if let Some(sys) = server.accounts.system_account().cloned() {
        let _ = server
            .system
            .set(crate::system::System::start(&server, sys));
    }
    if server.opts.jetstream {
        match crate::jetstream::JetStreams::start(&server) {
            Ok(js) => {
                log_jetstream(log, js.first());
                let _ = server.jetstream.set(js.clone());
                if let Err(e) = start_meta(&server, &js).await {
                    error!(log, "Could not start JetStream cluster: {e}");
                    stop_early(&server);
                    return Err(());
                }
            }
            Err(e) => {
                error!(log, "Can't start JetStream: {e}");
                stop_early(&server);
                return Err(());
            }
        }
    }

    let mut monitor_addr = None;
    if server.opts.http_port.is_some() || server.opts.https_port.is_some() {
        match crate::monitor::bind(&server).await {
            Ok(l) => {
                if let Ok(a) = l.local_addr() {
                    let host = server
                        .opts
                        .http_host
                        .as_deref()
                        .unwrap_or(&server.opts.host);
                    let scheme = if server.opts.https_port.is_some() {
                        "https"
                    } else {
                        "http"
                    };
                    info!(
                        log,
                        "Starting {scheme} monitor on {}",
                        host_port(host, a.port())
                    );
                    monitor_addr = Some(a);
                }
                server.spawn(crate::monitor::serve(server.clone(), l));
            }
            Err(e) => {
                error!(log, "Error listening on monitoring port: {e}");
                stop_early(&server);
                return Err(());
            }
        }
    }

    let listener = match server.bind().await {
        Ok(l) => l,
        Err(e) => {
            error!(
                log,
                "Error listening on port: {}:{}, {e}", server.opts.host, server.opts.port
            );
            stop_early(&server);
            return Err(());
        }
    };
    let client_addr = listener.local_addr().map_err(|e| {
        error!(log, "Error listening on port: {e}");
        stop_early(&server);
    })?;
    // The configured host, as the reference writes it (the wildcard listens on IPv6 too).
    info!(
        log,
        "Listening for client connections on {}",
        host_port(&server.opts.host, client_addr.port())
    );
    if let Some(tls) = &server.opts.tls {
        if tls.required() || tls.first_only() {
            info!(log, "TLS required for client connections");
        } else {
            info!(log, "TLS available for client connections");
        }
        if tls.first_only() {
            warn!(
                log,
                "Clients that are not using \"TLS Handshake First\" option will fail to connect"
            );
        }
        if tls.has_rate_limit() {
            let (tls, srv) = (tls.clone(), server.clone());
            server.spawn(async move {
                let mut shutdown = srv.shutdown_rx();
                let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
                loop {
                    tokio::select! {
                        _ = tick.tick() => {
                            let n = tls.take_rejected();
                            if n > 0 {
                                warn!(srv.log, "Rejected {n} connections due to TLS rate limiting");
                            }
                        }
                        _ = crate::client::until_true(&mut shutdown) => return,
                    }
                }
            });
        }
    }
    info!(log, "Server is ready");
    if let Some(cluster) = server.cluster.get().cloned() {
        if cluster.start(&server).await.is_err() {
            stop_early(&server);
            return Err(());
        }
    }

    crate::memtrim::spawn(server.clone());
    let accept = {
        let server = server.clone();
        tokio::spawn(async move { server.accept_loop(listener).await })
    };
    Ok(Running {
        server,
        client_addr,
        monitor_addr,
        accept,
    })
}

/// The reference's JetStream block; clients' test helpers parse the Store Directory line
/// to clean up after the server.
/// With a cluster and the system account (the Raft transport's), JetStream starts its meta
/// group.
async fn start_meta(
    server: &Arc<Server>,
    js: &Arc<crate::jetstream::JetStreams>,
) -> Result<(), String> {
    if server.cluster.get().is_none() {
        return Ok(());
    }
    let Some(sys) = server.accounts.system_account().cloned() else {
        warn!(
            server.log,
            "JetStream cluster needs the system account: JetStream stays on this server"
        );
        return Ok(());
    };
    // A server's Raft identity is its name (and the cluster's): both must be set and stay
    // the same across restarts, as the reference requires.
    if server.opts.server_name.as_deref().is_none_or(str::is_empty) {
        return Err("jetstream cluster requires `server_name` to be set".into());
    }
    if server
        .opts
        .cluster
        .name
        .as_deref()
        .is_none_or(str::is_empty)
    {
        return Err("jetstream cluster requires `cluster.name` to be set".into());
    }
    info!(server.log, "Starting JetStream cluster");
    info!(server.log, "Creating JetStream metadata controller");
    let host = crate::jetstream::raft::RaftHost::start(server, sys);
    let dir = js
        .first()
        .store_dir
        .join("jetstream")
        .join("_cluster_")
        .join("meta");
    let meta = crate::jetstream::cluster::Meta::start(server, host, dir).await?;
    let _ = js.meta.set(meta);
    Ok(())
}

fn log_jetstream(log: &Log, js: &crate::jetstream::JetStream) {
    info!(log, "Starting JetStream");
    info!(log, "---------------- JETSTREAM ----------------");
    if js.strict {
        info!(log, "  Strict:          true");
    }
    let limit = |l: i64| {
        if l < 0 {
            "unlimited".to_string()
        } else {
            friendly_bytes(l)
        }
    };
    info!(log, "  Max Memory:      {}", limit(js.max_memory));
    info!(log, "  Max Storage:     {}", limit(js.max_store));
    info!(
        log,
        "  Store Directory: \"{}\"",
        js.store_dir.join("jetstream").display()
    );
    if let Some(d) = &js.domain {
        info!(log, "  Domain:          {d}");
    }
    info!(
        log,
        "  API Level:       {}",
        crate::jetstream::stream::API_LEVEL
    );
    match js.sync_interval {
        None => info!(log, "  Sync: always (an acknowledged message is on disk)"),
        Some(d) => warn!(
            log,
            "  Sync: every {d:?}; acknowledged messages can be lost on power failure"
        ),
    }
    info!(log, "-------------------------------------------");
}

impl Running {
    /// Runs until something requests shutdown (a signal, lame duck), then stops.
    pub async fn run_to_end(mut self) {
        let _ = (&mut self.accept).await;
        self.finish().await;
    }

    /// Requests shutdown and stops everything: clients closed (after flushing), listeners
    /// closed, JetStream's tasks ended after taking what was queued for them, consumer
    /// state saved and stores closed, every background task ended.
    pub async fn shutdown(mut self) {
        self.server.signal_pull_consumers().await;
        self.server.shutdown();
        let _ = (&mut self.accept).await;
        self.finish().await;
    }

    async fn finish(self) {
        let server = self.server;
        // The accept loop has ended: no client is left. JetStream's own clients take what
        // is queued for them and end; then nothing touches the stores any more.
        server.seal_internal();
        if !server.wait_tasks(TASKS_LIMIT).await {
            warn!(server.log, "Some tasks did not end within {TASKS_LIMIT:?}");
        }
        if let Some(js) = server.jetstream.get().cloned() {
            if let Some(meta) = js.meta.get() {
                meta.shutdown().await;
                meta.host.shutdown().await;
            }
            let _ = tokio::task::spawn_blocking(move || js.shutdown()).await;
        }
        info!(server.log, "Server Exiting..");
        if let Some(p) = &server.opts.pid_file {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Bytes as the reference's startup banner writes them (`17.66 GB`, 1024-based).
pub fn friendly_bytes(n: i64) -> String {
    const UNITS: [&str; 6] = ["K", "M", "G", "T", "P", "E"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = 0;
    v /= 1024.0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}B", UNITS[unit])
}
