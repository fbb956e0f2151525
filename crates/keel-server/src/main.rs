//! The `keel-server` binary: parses flags, starts listeners, and shuts down on signals.

use std::process::ExitCode;
use std::sync::Arc;

use keel_server::config::{self, Command, COMPAT_VERSION, KEEL_VERSION};
use keel_server::launch;
use keel_server::log::{Log, LogOpts};
use keel_server::server::Server;
use keel_server::{error, info, warn};

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
    let log = Log::start(
        LogOpts {
            debug: opts.debug,
            trace: opts.trace,
            logtime: opts.logtime,
        },
        log_file,
    );

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
    let code = rt.block_on(async {
        let Ok(running) = launch::start(opts, log.clone()).await else {
            return ExitCode::from(1);
        };
        tokio::spawn(signals(running.server.clone()));
        running.run_to_end().await;
        ExitCode::SUCCESS
    });
    log.flush();
    code
}

async fn signals(server: Arc<Server>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup), Ok(mut usr2)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
        signal(SignalKind::user_defined2()),
    ) else {
        error!(server.log, "cannot install signal handlers");
        return;
    };
    loop {
        tokio::select! {
            _ = term.recv() => { info!(server.log, "Trapped \"terminated\" signal"); break; }
            _ = int.recv() => { info!(server.log, "Trapped \"interrupt\" signal"); break; }
            _ = hup.recv() => warn!(server.log, "Configuration reload is not supported; SIGHUP ignored"),
            _ = usr2.recv() => {
                let s = server.clone();
                tokio::spawn(async move { s.lame_duck().await });
            }
        }
    }
    server.shutdown();
}
