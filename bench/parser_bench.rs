//! Parser throughput: how fast the client-op parser (and the route parser, when built with
//! it) takes a realistic stream apart. A program, not a test: it prints numbers.
//!
//! Run: `cargo run --release -p keel-protocol --example parser_bench [seconds]`
//!
//! Each case fills 64 KiB reads with one kind of traffic and parses them over and over for the
//! given time (default 2 s per case, best of 5 rounds), printing ops/s and MB/s.

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

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
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
}
