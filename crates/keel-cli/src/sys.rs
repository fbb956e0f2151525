//! `keel account info` and `keel rtt` (the `server` commands are in server.rs).

use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use serde_json::json;

use crate::js::Js;
use crate::output::{b, i, ibytes, n, print_json, u, Cols};
use crate::util::{redact, ConnSettings, Pinger, Res};

#[derive(Subcommand, Debug)]
pub enum AccountCmd {
    /// Show the connection and the account's JetStream usage and limits
    Info,
}

pub async fn account(conn: &ConnSettings, _cmd: &AccountCmd, json_out: bool) -> Res<()> {
    let client = conn.connect().await?;
    let js = Js::from_client(client.clone(), conn);
    let started = Instant::now();
    let result = js.api("INFO", None).await;
    let rtt = started.elapsed();
    let info = client.server_info();
    let acct = match result {
        Ok(v) => Some(v),
        // Without JetStream the account still has a connection to show.
        Err(e) => {
            let msg = String::from(e);
            if msg.starts_with("JetStream is not enabled") {
                if json_out {
                    return Err(msg);
                }
                None
            } else {
                return Err(msg);
            }
        }
    };
    if json_out {
        if let Some(a) = &acct {
            print_json(a);
        }
        return Ok(());
    }
    let mut c = Cols::new("Account Information");
    c.row("User", conn.user.clone().unwrap_or_else(|| "(none)".into()));
    c.row("Client ID", info.client_id);
    c.row("Client IP", &info.client_ip);
    c.row("RTT", crate::output::dur(rtt));
    c.row("Headers Supported", info.headers);
    c.row("Maximum Payload", ibytes(info.max_payload as u64));
    c.row("Connected URL", redact(&conn.server));
    c.row("Connected Server ID", &info.server_id);
    c.row_if(
        !info.server_name.is_empty(),
        "Connected Server Name",
        &info.server_name,
    );
    match &acct {
        None => {
            c.section("JetStream Account Information");
            c.row("JetStream", "not enabled on the server (start it with -js)");
        }
        Some(a) => {
            c.section("JetStream Account Information");
            c.row("Account Usage", "");
            c.row("Storage", ibytes(u(a, "storage")));
            c.row("Memory", ibytes(u(a, "memory")));
            c.row("Streams", n(u(a, "streams")));
            c.row("Consumers", n(u(a, "consumers")));
            let l = &a["limits"];
            let lim = |v: i64, f: fn(u64) -> String| {
                if v < 0 {
                    "unlimited".to_string()
                } else {
                    f(v as u64)
                }
            };
            c.section("Account Limits");
            c.row("Max Message Payload", ibytes(info.max_payload as u64));
            c.row("Max Memory", lim(i(l, "max_memory"), ibytes));
            c.row("Max Storage", lim(i(l, "max_storage"), ibytes));
            c.row("Max Streams", lim(i(l, "max_streams"), n));
            c.row("Max Consumers", lim(i(l, "max_consumers"), n));
            c.row("Max Ack Pending", lim(i(l, "max_ack_pending"), n));
            c.row("Max Bytes Required", b(l, "max_bytes_required"));
            if let Some(api) = a.get("api") {
                c.section("API");
                c.row_if(api.get("level").is_some(), "API Level", i(api, "level"));
                c.row("Requests", n(u(api, "total")));
                c.row("Errors", n(u(api, "errors")));
            }
        }
    }
    print!("{}", c.render());
    println!();
    Ok(())
}

fn fmt_rtt(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{:.0}µs", d.as_nanos() as f64 / 1e3)
    } else {
        format!("{:.2}ms", d.as_nanos() as f64 / 1e6)
    }
}

#[derive(Args, Debug)]
pub struct RttArgs {
    /// Round trips to average over, per address
    #[arg(default_value_t = 5)]
    iterations: u32,
}

/// `keel rtt` as `nats rtt`: for every server URL (comma separated), each
/// address it resolves to gets its own connection and the average of
/// ITERATIONS round trips (PING/PONG through the server).
pub async fn rtt(conn: &ConnSettings, a: &RttArgs, json_out: bool) -> Res<()> {
    if a.iterations == 0 {
        return Err("ITERATIONS must be at least 1".into());
    }
    let mut targets = Vec::new();
    for url in conn
        .server
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let full = if url.contains("://") {
            url.to_string()
        } else {
            format!("nats://{url}")
        };
        let (scheme, rest) = full.split_once("://").unwrap_or(("nats", &full));
        let hostport = rest
            .rsplit('@')
            .next()
            .unwrap_or(rest)
            .trim_end_matches('/');
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || hostport.starts_with('[') => {
                (h.to_string(), p.to_string())
            }
            _ => (hostport.to_string(), "4222".to_string()),
        };
        let addrs: Vec<String> = match tokio::net::lookup_host(format!("{host}:{port}")).await {
            Ok(it) => {
                let mut v: Vec<String> = it.map(|sa| format!("{scheme}://{sa}")).collect();
                v.dedup();
                v
            }
            Err(_) => vec![format!("{scheme}://{host}:{port}")],
        };
        let mut results = Vec::new();
        for addr in addrs {
            let mut one = conn.clone();
            // Keep the URL's credentials, swap only the address.
            one.server = match rest.rsplit_once('@') {
                Some((cred, _)) => addr.replacen("://", &format!("://{cred}@"), 1),
                None => addr.clone(),
            };
            let rtt = match one.connect().await {
                Ok(client) => {
                    let mut total = Duration::ZERO;
                    let mut pinger = Pinger::new(&client).await?;
                    for _ in 0..a.iterations {
                        let t0 = Instant::now();
                        pinger.ping(conn.timeout).await?;
                        total += t0.elapsed();
                    }
                    Some(total / a.iterations)
                }
                Err(e) => {
                    eprintln!("Failed to compute rtt for {addr}: {e}");
                    None
                }
            };
            results.push((addr, rtt));
        }
        targets.push((redact(&full), results));
    }
    if json_out {
        let v: Vec<_> = targets
            .iter()
            .map(|(url, results)| {
                json!({
                    "url": url,
                    "results": results.iter().map(|(addr, rtt)| json!({
                        "time": crate::output::rfc3339_ns(crate::output::now_ns()),
                        "address": addr,
                        "rtt": rtt.map(|d| d.as_nanos() as u64).unwrap_or(0),
                        "url": if rtt.is_some() { addr.as_str() } else { "" },
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        print_json(&serde_json::Value::Array(v));
        return Ok(());
    }
    let width = targets
        .iter()
        .flat_map(|(_, r)| r.iter().map(|(a, _)| a.len() + 3))
        .max()
        .unwrap_or(3);
    let mut failed = 0;
    for (url, results) in &targets {
        println!("{url}:\n");
        for (addr, rtt) in results {
            match rtt {
                Some(d) => println!("{addr:>width$}: {}", fmt_rtt(*d)),
                None => {
                    failed += 1;
                    println!("{addr:>width$}: failed")
                }
            }
        }
        println!();
    }
    let total: usize = targets.iter().map(|(_, r)| r.len()).sum();
    if failed == total {
        return Err("no server answered".into());
    }
    Ok(())
}
