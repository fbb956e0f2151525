//! Parser throughput: how fast the client-op parser and the route parser take a realistic
//! stream apart. A program, not a test: it prints numbers.
//!
//! Run: `cargo run --release -p keel-protocol --example parser_bench [seconds | passes=N]`
//!
//! Each case feeds a 1 MiB stream of one kind of traffic in 64 KiB reads and parses it over
//! and over for the given time (default 2 s per case, best of 5 rounds), printing ops/s and
//! MB/s. `passes=N [client|route]` parses each stream (or one) exactly N times instead, for
//! instruction counts under `valgrind --tool=cachegrind` where hardware counters are not
//! available.

use bytes::BytesMut;
use std::time::{Duration, Instant};

fn client_stream() -> Vec<u8> {
    let mut v = Vec::new();
    let mut i = 0u32;
    while v.len() < 1 << 20 {
        match i % 8 {
            0 => v.extend_from_slice(b"HPUB orders.eu.new _INBOX.abcdefgh.1 20 36\r\nNATS/1.0\r\nX-K: v\r\n\r\n0123456789abcdef\r\n"),
            1 => v.extend_from_slice(b"SUB orders.eu.* q1 17\r\n"),
            _ => v.extend_from_slice(b"PUB orders.eu.new 16\r\n0123456789abcdef\r\n"),
        }
        i += 1;
    }
    v
}

fn route_stream() -> Vec<u8> {
    let mut v = Vec::new();
    let mut i = 0u32;
    while v.len() < 1 << 20 {
        match i % 8 {
            0 => v.extend_from_slice(b"HMSG $G orders.eu.new + _INBOX.abcdefgh.1 workers 20 36\r\nNATS/1.0\r\nX-K: v\r\n\r\n0123456789abcdef\r\n"),
            1 => v.extend_from_slice(b"RS+ $G orders.eu.* q1 3\r\n"),
            2 => v.extend_from_slice(b"RMSG $G orders.eu.new | g1 g2 16\r\n0123456789abcdef\r\n"),
            _ => v.extend_from_slice(b"RMSG $G orders.eu.new 16\r\n0123456789abcdef\r\n"),
        }
        i += 1;
    }
    v
}

/// Feeds `data` in 64 KiB reads to `parse` (which drains the buffer and returns the op count)
/// until `dur` has passed; returns (ops, bytes, elapsed).
fn run(
    data: &[u8],
    dur: Duration,
    mut parse: impl FnMut(&mut BytesMut) -> u64,
) -> (u64, u64, Duration) {
    let start = Instant::now();
    let (mut ops, mut bytes) = (0u64, 0u64);
    let mut buf = BytesMut::with_capacity(128 * 1024);
    while start.elapsed() < dur {
        for chunk in data.chunks(64 * 1024) {
            buf.extend_from_slice(chunk);
            ops += parse(&mut buf);
            bytes += chunk.len() as u64;
        }
    }
    (ops, bytes, start.elapsed())
}

fn report(name: &str, data: &[u8], dur: Duration, mut parse: impl FnMut(&mut BytesMut) -> u64) {
    let mut best = 0f64;
    let mut best_mb = 0f64;
    for _ in 0..5 {
        let (ops, bytes, el) = run(data, dur / 5, &mut parse);
        let s = el.as_secs_f64();
        if ops as f64 / s > best {
            best = ops as f64 / s;
            best_mb = bytes as f64 / s / 1e6;
        }
    }
    println!("{name:<8} {:>8.2} Mops/s {:>8.1} MB/s", best / 1e6, best_mb);
}

/// Parses `data` `passes` times and prints the op count.
fn fixed(name: &str, data: &[u8], passes: usize, mut parse: impl FnMut(&mut BytesMut) -> u64) {
    let mut buf = BytesMut::with_capacity(128 * 1024);
    let mut ops = 0;
    for _ in 0..passes {
        for chunk in data.chunks(64 * 1024) {
            buf.extend_from_slice(chunk);
            ops += parse(&mut buf);
        }
    }
    println!("{name:<8} {ops} ops");
}

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_default();
    if let Some(n) = arg.strip_prefix("passes=") {
        let passes: usize = n.parse().expect("passes=N");
        let only = std::env::args().nth(2).unwrap_or_default();
        let mut p = keel_protocol::Parser::new(1 << 20);
        let client_passes = if only == "route" { 0 } else { passes };
        let route_passes = if only == "client" { 0 } else { passes };
        fixed("client", &client_stream(), client_passes, |buf| {
            let mut n = 0;
            while let Some(op) = p.next(buf).expect("valid stream") {
                std::hint::black_box(op);
                n += 1;
            }
            n
        });
        let mut rp = keel_protocol::route::RouteParser::new();
        fixed("route", &route_stream(), route_passes, |buf| {
            let mut n = 0;
            while let Some(op) = rp.next(buf).expect("valid stream") {
                std::hint::black_box(op);
                n += 1;
            }
            n
        });
        return;
    }
    let secs: f64 = arg.parse().unwrap_or(2.0);
    let dur = Duration::from_secs_f64(secs);
    let client = client_stream();
    let mut p = keel_protocol::Parser::new(1 << 20);
    report("client", &client, dur, |buf| {
        let mut n = 0;
        while let Some(op) = p.next(buf).expect("valid stream") {
            std::hint::black_box(op);
            n += 1;
        }
        n
    });
    let route = route_stream();
    let mut rp = keel_protocol::route::RouteParser::new();
    report("route", &route, dur, |buf| {
        let mut n = 0;
        while let Some(op) = rp.next(buf).expect("valid stream") {
            std::hint::black_box(op);
            n += 1;
        }
        n
    });
}
