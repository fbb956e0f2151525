//! Feeds arbitrary bytes, split at a fuzzer-chosen point, through the client-op parser.
//! Run: `cargo fuzz run parser` (from the repo root).
#![no_main]

use bytes::BytesMut;
use keel_protocol::Parser;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let cut = data[0] as usize % data.len();
    let mut p = Parser::new(4096);
    let mut buf = BytesMut::new();
    for chunk in [&data[1..cut.max(1)], &data[cut.max(1)..]] {
        buf.extend_from_slice(chunk);
        loop {
            match p.next(&mut buf) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return,
            }
        }
        // Never more buffered than a control line plus the largest allowed payload.
        assert!(buf.len() <= data.len());
    }
});
