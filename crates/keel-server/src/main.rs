//! The `keel-server` binary: parses flags, starts listeners, and shuts down on signals.

use std::process::ExitCode;
use std::sync::Arc;

use keel_server::config::{self, Command, COMPAT_VERSION, GIT_COMMIT, KEEL_VERSION};
use keel_server::server::{host_port, Server};
use keel_server::{error, info, log, monitor, warn};

fn main() -> ExitCode {
    let opts = match config::parse_args(std::env::args().skip(1)) {
        Ok(Command::Run(o)) => *o,
        Ok(Command::Help) => {
            print!("{}", config::USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("keel-server: v{KEEL_VERSION} (nats-server API level {COMPAT_VERSION})");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("keel-server: {e}");
            return ExitCode::from(1);
        }
    };
    if opts.check_config {
        println!("keel-server: configuration is valid");
        return ExitCode::SUCCESS;
    }
    let log_file = match &opts.log_file {
        Some(p) => match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("keel-server: cannot open log file {}: {e}", p.display());
                return ExitCode::from(1);
            }
        },
        None => None,
    };
    log::init(opts.debug, opts.trace, opts.logtime, log_file);

    // Two cores is the common deployment here; tokio's default of one worker per core fits.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("keel-server: cannot start runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = rt.block_on(run(opts));
    log::flush();
    code
}

async fn run(opts: config::Opts) -> ExitCode {
    let pid_file = opts.pid_file.clone();
    let server = Server::new(opts);
    info!("Starting keel-server");
    info!("  Version:  {KEEL_VERSION} (nats-server API level {COMPAT_VERSION})");
    if !GIT_COMMIT.is_empty() {
        info!("  Git:      [{GIT_COMMIT}]");
    }
    info!("  Name:     {}", server.server_name);
    info!("  ID:       {}", server.server_id);
    if let Some(cf) = &server.opts.config_file {
        info!("Using configuration file: {}", cf.display());
    }
    if let Some(p) = &pid_file {
        if let Err(e) = std::fs::write(p, std::process::id().to_string()) {
            error!("Could not write pidfile: {e}");
            return ExitCode::from(1);
        }
    }
    if server.opts.jetstream {
        let _ = keel_server::jetstream::SERVER_NAME.set(server.server_name.clone());
        match keel_server::jetstream::JetStream::start(&server) {
            Ok(js) => {
                info!("Starting JetStream");
                // The reference's block; clients' test helpers parse the Store Directory line
                // to clean up after the server.
                info!("---------------- JETSTREAM ----------------");
                if js.strict {
                    info!("  Strict:          true");
                }
                let limit = |l: i64| {
                    if l < 0 {
                        "unlimited".to_string()
                    } else {
                        friendly_bytes(l)
                    }
                };
                info!("  Max Memory:      {}", limit(js.max_memory));
                info!("  Max Storage:     {}", limit(js.max_store));
                info!(
                    "  Store Directory: \"{}\"",
                    js.store_dir.join("jetstream").display()
                );
                if let Some(d) = &js.domain {
                    info!("  Domain:          {d}");
                }
                info!(
                    "  API Level:       {}",
                    keel_server::jetstream::stream::API_LEVEL
                );
                match js.sync_interval {
                    None => info!("  Sync: always (an acknowledged message is on disk)"),
                    Some(d) => warn!(
                        "  Sync: every {d:?}; acknowledged messages can be lost on power failure"
                    ),
                }
                info!("-------------------------------------------");
                let _ = server.jetstream.set(js);
            }
            Err(e) => {
                error!("Could not start JetStream: {e}");
                return ExitCode::from(1);
            }
        }
    }

    if server.opts.http_port.is_some() || server.opts.https_port.is_some() {
        match monitor::bind(&server).await {
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
                    info!("Starting {scheme} monitor on {}", host_port(host, a.port()));
                }
                tokio::spawn(monitor::serve(server.clone(), l));
            }
            Err(e) => {
                error!("Error listening on monitoring port: {e}");
                return ExitCode::from(1);
            }
        }
    }

    let listener = match server.bind().await {
        Ok(l) => l,
        Err(e) => {
            error!(
                "Error listening on port: {}:{}, {e}",
                server.opts.host, server.opts.port
            );
            return ExitCode::from(1);
        }
    };
    // The configured host, as the reference writes it (the wildcard listens on IPv6 too).
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    info!(
        "Listening for client connections on {}",
        host_port(&server.opts.host, port)
    );
    if let Some(tls) = &server.opts.tls {
        if tls.required() || tls.first_only() {
            info!("TLS required for client connections");
        } else {
            info!("TLS available for client connections");
        }
        if tls.first_only() {
            warn!("Clients that are not using \"TLS Handshake First\" option will fail to connect");
        }
        if tls.has_rate_limit() {
            let (tls, server) = (tls.clone(), server.clone());
            tokio::spawn(async move {
                let mut shutdown = server.shutdown_rx();
                let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
                loop {
                    tokio::select! {
                        _ = tick.tick() => {
                            let n = tls.take_rejected();
                            if n > 0 {
                                warn!("Rejected {n} connections due to TLS rate limiting");
                            }
                        }
                        _ = keel_server::client::until_true(&mut shutdown) => return,
                    }
                }
            });
        }
    }
    info!("Server is ready");

    tokio::spawn(signals(server.clone()));
    keel_server::memtrim::spawn(server.clone());
    server.accept_loop(listener).await;
    if let Some(js) = server.jetstream.get() {
        tokio::task::block_in_place(|| js.shutdown());
    }
    info!("Server Exiting..");
    if let Some(p) = &pid_file {
        let _ = std::fs::remove_file(p);
    }
    ExitCode::SUCCESS
}

/// Bytes as the reference's startup banner writes them (`17.66 GB`, 1024-based).
fn friendly_bytes(n: i64) -> String {
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

async fn signals(server: Arc<Server>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup), Ok(mut usr2)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
        signal(SignalKind::user_defined2()),
    ) else {
        error!("cannot install signal handlers");
        return;
    };
    loop {
        tokio::select! {
            _ = term.recv() => { info!("Trapped \"terminated\" signal"); break; }
            _ = int.recv() => { info!("Trapped \"interrupt\" signal"); break; }
            _ = hup.recv() => warn!("Configuration reload is not supported; SIGHUP ignored"),
            _ = usr2.recv() => {
                let s = server.clone();
                tokio::spawn(async move { s.lame_duck().await });
            }
        }
    }
    server.shutdown();
}
