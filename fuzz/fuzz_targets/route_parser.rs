//! Feeds arbitrary bytes through the route parser, in a fuzzer-chosen mode (pinned account,
//! LS- origin, expecting CONNECT) and split at a fuzzer-chosen point. Every op it returns must
//! encode and parse back to itself.
//! Run: `cargo fuzz run route_parser` (from the repo root).
#![no_main]

use bytes::{Bytes, BytesMut};
use keel_protocol::route::{encode, RouteParser};
use libfuzzer_sys::fuzz_target;

fn parser(flags: u8) -> RouteParser {
    let mut p = RouteParser::new();
    if flags & 1 != 0 {
        p.set_pinned_account(Some(Bytes::from_static(b"$SYS")));
    }
    p.set_unsub_origin(flags & 2 != 0);
    p
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let (flags, cut, input) = (data[0], data[1] as usize, &data[2..]);
    let cut = cut % (input.len() + 1);
    let mut p = parser(flags);
    if flags & 4 != 0 {
        p.expect_connect();
    }
    let mut buf = BytesMut::new();
    for chunk in [&input[..cut], &input[cut..]] {
        buf.extend_from_slice(chunk);
        loop {
            match p.next(&mut buf) {
                Ok(Some(op)) => {
                    let mut out = BytesMut::new();
                    encode::op(&mut out, &op, flags & 1 != 0);
                    let mut again = parser(flags);
                    let back = again.next(&mut out).expect("re-encoded op parses");
                    assert_eq!(back.as_ref(), Some(&op));
                    assert!(out.is_empty());
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(buf.len() <= input.len());
    }
});
