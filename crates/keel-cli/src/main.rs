//! `keel` is the command line client for Keel and any other NATS server. It
//! publishes, subscribes, sends and answers requests, manages JetStream
//! streams, consumers and key-value buckets, and benchmarks core NATS and
//! JetStream. Subcommands, flags and defaults follow the official `nats` CLI,
//! so a tutorial written for `nats` works with `keel` in its place; where
//! `nats` would prompt for a missing setting, `keel` uses the answer `nats`
//! offers as the default. All network work goes through the `async-nats`
//! client, which makes the CLI an independent check on the server.

mod bench;
mod bench_js;
mod bench_nats;
mod check;
mod commands;
mod consumer;
mod context;
mod events;
mod js;
mod kv;
mod object;
mod output;
mod server;
mod stream;
mod stream_ops;
mod sys;
mod util;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    about = "Command line client for Keel and other NATS servers",
    after_help = "Connection flags may be given before or after the subcommand. Without --server, \
the selected context (see `keel context`) or nats://127.0.0.1:4222 is used."
)]
struct Cli {
    #[command(flatten)]
    conn: context::GlobalFlags,

    /// Print the server's JSON instead of text, for scripts
    #[arg(short = 'j', long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Publish one or more messages
    #[command(name = "pub", visible_alias = "publish")]
    Pub(commands::PubArgs),
    /// Subscribe and print the messages received
    #[command(visible_alias = "subscribe")]
    Sub(commands::SubArgs),
    /// Send a request and print the reply
    #[command(visible_alias = "request")]
    Req(commands::ReqArgs),
    /// Answer requests with a fixed (templated) body
    Reply(commands::ReplyArgs),
    /// JetStream streams: add, edit, info, report, find, view, get, rmm, purge, seal, copy, backup, restore, rm ...
    #[command(subcommand, visible_aliases = ["str", "s"])]
    Stream(stream::StreamCmd),
    /// JetStream consumers: add, edit, info, state, report, ls, next, sub, pause, resume, reset, rm
    #[command(subcommand, visible_aliases = ["con", "c"])]
    Consumer(consumer::ConsumerCmd),
    /// Key-value buckets: add, edit, put, get, create, update, del, purge, revert, history, watch, compact, ls, rm
    #[command(subcommand)]
    Kv(kv::KvCmd),
    /// Object store buckets: add, put, get, ls, info, rm, seal, watch
    #[command(subcommand, visible_alias = "obj")]
    Object(object::ObjectCmd),
    /// The account: JetStream usage and limits
    #[command(subcommand)]
    Account(sys::AccountCmd),
    /// Servers, through the system account: ping, list, info, report, check
    #[command(subcommand, visible_aliases = ["srv", "sys", "system"])]
    Server(server::ServerCmd),
    /// Show JetStream advisories and metrics as the server publishes them
    #[command(visible_alias = "event")]
    Events(events::EventsArgs),
    /// Benchmark a server: pub, sub, service, js, kv (and keel's pubsub, request, idle)
    #[command(long_about = bench::LONG_ABOUT)]
    Bench(bench::BenchArgs),
    /// Round trip time to the server
    Rtt(sys::RttArgs),
    /// Configuration contexts, shared with the nats CLI: add, ls, select, info, edit, rm
    #[command(subcommand, visible_alias = "ctx")]
    Context(context::ContextCmd),
}

/// Subcommands that delete or lock data. A mistyped command must never be
/// answered with one of these as "a similar subcommand".
const DESTRUCTIVE: &[&str] = &[
    "rm", "del", "delete", "remove", "purge", "rmm", "seal", "compact", "unselect",
];

/// Parses the command line like `Cli::parse`, but drops clap's "a similar
/// subcommand exists" tip when the suggestion would destroy data.
fn parse_args() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            use clap::error::{ContextKind, ContextValue, ErrorKind};
            if err.kind() == ErrorKind::InvalidSubcommand {
                let suggested: Vec<String> = match err.get(ContextKind::SuggestedSubcommand) {
                    Some(ContextValue::String(s)) => vec![s.clone()],
                    Some(ContextValue::Strings(v)) => v.clone(),
                    _ => Vec::new(),
                };
                let (kept, dropped): (Vec<String>, Vec<String>) = suggested
                    .into_iter()
                    .partition(|s| !DESTRUCTIVE.contains(&s.as_str()));
                if !dropped.is_empty() {
                    let tip = match kept.as_slice() {
                        [] => None,
                        [one] => Some(format!("  tip: a similar subcommand exists: '{one}'")),
                        many => Some(format!(
                            "  tip: some similar subcommands exist: {}",
                            many.iter()
                                .map(|s| format!("'{s}'"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )),
                    };
                    let text = err.render().to_string();
                    let mut out = Vec::new();
                    for line in text.lines() {
                        if line.contains("similar subcommand") {
                            if let Some(t) = &tip {
                                out.push(t.clone());
                            } else {
                                // Drop the tip and the blank line before it.
                                if out.last().is_some_and(|l: &String| l.is_empty()) {
                                    out.pop();
                                }
                            }
                        } else {
                            out.push(line.to_string());
                        }
                    }
                    eprintln!("{}", out.join("\n"));
                    std::process::exit(2);
                }
            }
            err.exit()
        }
    }
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, which turns `keel ... | head` into a panic on the
    // next print. Restore the default so the process just ends, like `nats`.
    #[cfg(unix)]
    // SAFETY: called before any other thread exists; SIG_DFL is always valid.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = parse_args();
    let json = cli.json;
    // Context commands manage the settings themselves; they must not connect.
    if let Command::Context(c) = &cli.command {
        return finish(context::run(&cli.conn, c, json));
    }
    let conn = match context::resolve(&cli.conn) {
        Ok(c) => c,
        Err(msg) => return finish(Err(msg)),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("keel: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match &cli.command {
            Command::Pub(a) => commands::publish(&conn, a, json).await,
            Command::Sub(a) => commands::subscribe(&conn, a).await,
            Command::Req(a) => commands::request(&conn, a).await,
            Command::Reply(a) => commands::reply(&conn, a).await,
            Command::Stream(c) => stream::run(&conn, c, json).await,
            Command::Consumer(c) => consumer::run(&conn, c, json).await,
            Command::Kv(c) => kv::run(&conn, c, json).await,
            Command::Object(c) => object::run(&conn, c, json).await,
            Command::Rtt(a) => sys::rtt(&conn, a, json).await,
            Command::Context(_) => unreachable!("handled before connecting"),
            Command::Account(c) => sys::account(&conn, c, json).await,
            Command::Server(c) => server::run(&conn, c, json).await,
            Command::Events(a) => events::run(&conn, a, json).await,
            Command::Bench(a) => bench::run(&conn, a, json).await,
        }
    });
    // Don't wait for background client tasks (reconnect loops, etc.) on exit.
    runtime.shutdown_background();
    finish(result)
}

fn finish(result: Result<(), String>) -> ExitCode {
    match result {
        // A health check's Nagios status (0 OK, 1 WARNING, 2 CRITICAL).
        Ok(()) => ExitCode::from(check::EXIT_CODE.load(std::sync::atomic::Ordering::Relaxed)),
        Err(msg) => {
            eprintln!("keel: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every usage line shows optional flags and arguments in brackets: a
    /// `--flag` outside `[...]` would read as required.
    #[test]
    fn usage_lines_show_only_required_items_bare() {
        fn walk(cmd: &mut clap::Command, path: &str, bad: &mut Vec<String>) {
            let usage = cmd.render_usage().to_string();
            let mut depth = 0i32;
            let mut outside = String::new();
            for ch in usage.chars() {
                match ch {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    c if depth == 0 => outside.push(c),
                    _ => {}
                }
            }
            let required: Vec<String> = cmd
                .get_arguments()
                .filter(|a| a.is_required_set())
                .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
                .collect();
            for word in outside.split_whitespace() {
                if word.starts_with("--") && !required.iter().any(|r| word.starts_with(r.as_str()))
                {
                    bad.push(format!("{path}: {usage}"));
                }
            }
            let names: Vec<String> = cmd
                .get_subcommands()
                .map(|c| c.get_name().to_string())
                .collect();
            for name in names {
                let sub = cmd.find_subcommand_mut(&name).unwrap();
                walk(sub, &format!("{path} {name}"), bad);
            }
        }
        let mut cmd = Cli::command();
        cmd.build();
        let mut bad = Vec::new();
        walk(&mut cmd, "keel", &mut bad);
        assert!(
            bad.is_empty(),
            "usage lines with optional flags shown as required:\n{}",
            bad.join("\n")
        );
    }

    #[test]
    fn clap_definition_is_valid() {
        Cli::command().debug_assert();
    }
}
