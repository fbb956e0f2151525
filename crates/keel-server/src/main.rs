//! The `keel-server` binary: parses flags, starts listeners, and shuts down on signals.

use std::process::ExitCode;
use std::sync::Arc;

use keel_server::config::{self, Command, COMPAT_VERSION, KEEL_VERSION};
use keel_server::launch;
use keel_server::log::{Log, LogOpts};
use keel_server::server::Server;
use keel_server::{error, info, warn};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match config::parse_args(args.clone()) {
        Ok(Command::Run(o)) => *o,
        Ok(Command::Signal(spec)) => return send_signal(&spec),
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
            max_traced: opts.max_traced_msg_len,
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
        // Installed before the server says it is ready: a SIGHUP (a reload) sent then must
        // not find the default action, which ends the process.
        let Some(handlers) = Signals::install() else {
            eprintln!("keel-server: cannot install signal handlers");
            return ExitCode::from(1);
        };
        let Ok(running) = launch::start(opts, log.clone()).await else {
            return ExitCode::from(1);
        };
        tokio::spawn(signals(running.server.clone(), args, handlers));
        running.run_to_end().await;
        ExitCode::SUCCESS
    });
    log.flush();
    code
}

/// `--signal <command>[=<pid or pid file>]`: the reference's signals to a running server.
fn send_signal(spec: &str) -> ExitCode {
    let (cmd, target) = spec.split_once('=').unwrap_or((spec, ""));
    let sig = match cmd {
        "stop" => libc::SIGKILL,
        "quit" => libc::SIGINT,
        "term" => libc::SIGTERM,
        "reopen" => libc::SIGUSR1,
        "reload" => libc::SIGHUP,
        "ldm" => libc::SIGUSR2,
        other => {
            eprintln!(
                "keel-server: unknown signal {other:?} (stop, quit, term, reopen, reload, ldm)"
            );
            return ExitCode::from(1);
        }
    };
    let pid = match target.parse::<i32>() {
        Ok(p) => p,
        Err(_) if !target.is_empty() => match std::fs::read_to_string(target) {
            Ok(text) => match text.trim().parse::<i32>() {
                Ok(p) => p,
                Err(_) => {
                    eprintln!("keel-server: no PID in {target}");
                    return ExitCode::from(1);
                }
            },
            Err(e) => {
                eprintln!("keel-server: cannot read PID file {target}: {e}");
                return ExitCode::from(1);
            }
        },
        Err(_) => {
            eprintln!("keel-server: --signal needs a PID: --signal {cmd}=<pid or pid file>");
            return ExitCode::from(1);
        }
    };
    // SAFETY: kill(2) with a plain pid and signal number touches no memory of ours.
    if unsafe { libc::kill(pid, sig) } != 0 {
        eprintln!(
            "keel-server: signal {cmd} to {pid}: {}",
            std::io::Error::last_os_error()
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// SIGHUP: the configuration file (and the same flags) again.
fn reload(server: &Arc<Server>, args: &[String]) {
    match config::parse_args(args.to_vec()) {
        Ok(Command::Run(opts)) => {
            if let Err(e) = server.reload(&opts) {
                error!(server.log, "Failed to reload server configuration: {e}");
            }
        }
        Ok(_) => {}
        Err(e) => error!(server.log, "Failed to reload server configuration: {e}"),
    }
}

/// The signals the server acts on; each is caught from its `install` on (one that arrives
/// before the server runs waits for it).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Option<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Some(Signals {
            term: signal(SignalKind::terminate()).ok()?,
            int: signal(SignalKind::interrupt()).ok()?,
            hup: signal(SignalKind::hangup()).ok()?,
            usr1: signal(SignalKind::user_defined1()).ok()?,
            usr2: signal(SignalKind::user_defined2()).ok()?,
        })
    }
}

async fn signals(server: Arc<Server>, args: Vec<String>, handlers: Signals) {
    let Signals {
        mut term,
        mut int,
        mut hup,
        mut usr1,
        mut usr2,
    } = handlers;
    loop {
        tokio::select! {
            _ = term.recv() => { info!(server.log, "Trapped \"terminated\" signal"); break; }
            _ = int.recv() => { info!(server.log, "Trapped \"interrupt\" signal"); break; }
            _ = hup.recv() => {
                info!(server.log, "Trapped \"hangup\" signal");
                reload(&server, &args);
            }
            _ = usr1.recv() => match &server.opts.log_file {
                Some(p) => match std::fs::OpenOptions::new().create(true).append(true).open(p) {
                    Ok(f) => {
                        server.log.reopen(f);
                        info!(server.log, "File log re-opened");
                    }
                    Err(e) => error!(server.log, "Could not re-open log file {}: {e}", p.display()),
                },
                None => warn!(server.log, "File log re-open ignored, not a file logger"),
            },
            _ = usr2.recv() => {
                let s = server.clone();
                tokio::spawn(async move { s.lame_duck().await });
            }
        }
    }
    // Routes still up: the groups this server leads go to other servers first; a second
    // SIGTERM or SIGINT stops at once.
    tokio::select! {
        _ = keel_server::jetstream::cluster::hand_off_leadership(&server, false) => {}
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    server.signal_pull_consumers().await;
    server.announce_stop(false);
    server.shutdown();
}
