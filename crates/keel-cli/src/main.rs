//! `keel` is the command line client for Keel and any other NATS server. It
//! publishes, subscribes, sends and answers requests, and benchmarks core NATS
//! (throughput, request latency, idle-connection memory). Subcommands and flags
//! follow the official `nats` CLI where it has an equivalent, so habits and
//! scripts carry over. All network work goes through the `async-nats` client,
//! which makes the CLI an independent check on the server's protocol handling.

mod bench;
mod commands;
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
    /// Benchmark a server: pub, pubsub, request, idle
    #[command(long_about = bench::LONG_ABOUT)]
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let conn = ConnSettings {
        server: cli.server,
        timeout: cli.timeout,
        user: cli.user,
        password: cli.password,
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
            Command::Pub(a) => commands::publish(&conn, a).await,
            Command::Sub(a) => commands::subscribe(&conn, a).await,
            Command::Req(a) => commands::request(&conn, a).await,
            Command::Reply(a) => commands::reply(&conn, a).await,
            Command::Bench(a) => bench::run(&conn, a).await,
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
