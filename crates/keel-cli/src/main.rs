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
mod commands;
mod consumer;
mod events;
mod js;
mod kv;
mod output;
mod stream;
mod sys;
mod util;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use util::{parse_duration, ConnSettings};

#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    about = "Command line client for Keel and other NATS servers",
    after_help = "Connection flags may be given before or after the subcommand."
)]
struct Cli {
    /// Server URL
    #[arg(
        short = 's',
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true,
        help_heading = "Connection"
    )]
    server: String,

    /// Time limit for connecting, requests and waits, e.g. 5s, 500ms
    #[arg(long, default_value = "5s", value_parser = parse_duration, global = true, help_heading = "Connection")]
    timeout: Duration,

    /// User name for authentication
    #[arg(long, env = "NATS_USER", global = true, help_heading = "Connection")]
    user: Option<String>,

    /// Password for authentication
    #[arg(
        long,
        env = "NATS_PASSWORD",
        global = true,
        hide_env_values = true,
        help_heading = "Connection"
    )]
    password: Option<String>,

    /// NATS credentials file (JWT and NKey seed)
    #[arg(
        long,
        env = "NATS_CREDS",
        global = true,
        value_name = "FILE",
        help_heading = "Connection"
    )]
    creds: Option<std::path::PathBuf>,

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
    /// JetStream streams: add, edit, info, ls, rm, purge, get, subjects
    #[command(subcommand, visible_aliases = ["str", "s"])]
    Stream(stream::StreamCmd),
    /// JetStream consumers: add, edit, info, ls, rm, next
    #[command(subcommand, visible_aliases = ["con", "c"])]
    Consumer(consumer::ConsumerCmd),
    /// Key-value buckets: add, put, get, del, history, watch, ls, rm
    #[command(subcommand)]
    Kv(kv::KvCmd),
    /// The account: JetStream usage and limits
    #[command(subcommand)]
    Account(sys::AccountCmd),
    /// The server: ping (round trip times), info
    #[command(subcommand)]
    Server(sys::ServerCmd),
    /// Show JetStream advisories and metrics as the server publishes them
    #[command(visible_alias = "event")]
    Events(events::EventsArgs),
    /// Benchmark a server: pub, pubsub, request, idle, js
    #[command(long_about = bench::LONG_ABOUT)]
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, which turns `keel ... | head` into a panic on the
    // next print. Restore the default so the process just ends, like `nats`.
    #[cfg(unix)]
    // SAFETY: called before any other thread exists; SIG_DFL is always valid.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let conn = ConnSettings {
        server: cli.server,
        timeout: cli.timeout,
        user: cli.user,
        password: cli.password,
        creds: cli.creds,
    };
    let json = cli.json;
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
            Command::Account(c) => sys::account(&conn, c, json).await,
            Command::Server(c) => sys::server(&conn, c, json).await,
            Command::Events(a) => events::run(&conn, a, json).await,
            Command::Bench(a) => bench::run(&conn, a, json).await,
        }
    });
    // Don't wait for background client tasks (reconnect loops, etc.) on exit.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("keel: error: {msg}");
            ExitCode::FAILURE
        }
    }
}
