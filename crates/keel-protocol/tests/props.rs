//! Property tests: the parser never panics, never takes more than it was given, and the
//! ops it returns do not depend on how the input was split across reads.

use bytes::BytesMut;
use keel_protocol::{ClientOp, Parser};
use proptest::prelude::*;

fn run(chunks: &[&[u8]]) -> (Vec<ClientOp>, bool) {
    let mut p = Parser::new(1024);
    let mut buf = BytesMut::new();
    let mut ops = vec![];
    for c in chunks {
        buf.extend_from_slice(c);
        loop {
            match p.next(&mut buf) {
                Ok(Some(op)) => ops.push(op),
                Ok(None) => break,
                Err(_) => return (ops, true),
            }
        }
    }
    (ops, false)
}

fn op_strategy() -> impl Strategy<Value = Vec<u8>> {
    let token = "[a-zA-Z0-9_*>]{1,6}";
    let subject = prop::collection::vec(token, 1..4).prop_map(|t| t.join("."));
    prop_oneof![
        (subject.clone(), prop::collection::vec(any::<u8>(), 0..40)).prop_map(|(s, p)| {
            let mut v = format!("PUB {s} {}\r\n", p.len()).into_bytes();
            v.extend(p);
            v.extend(b"\r\n");
            v
        }),
        (
            subject.clone(),
            "[a-z]{1,5}",
            prop::collection::vec(any::<u8>(), 0..20)
        )
            .prop_map(|(s, r, p)| {
                let hdr = b"NATS/1.0\r\nA: b\r\n\r\n";
                let mut v =
                    format!("HPUB {s} {r} {} {}\r\n", hdr.len(), hdr.len() + p.len()).into_bytes();
                v.extend(hdr);
                v.extend(p);
                v.extend(b"\r\n");
                v
            }),
        (subject, 1u32..100).prop_map(|(s, sid)| format!("SUB {s} {sid}\r\n").into_bytes()),
        (1u32..100, 0u32..5).prop_map(|(sid, m)| format!("UNSUB {sid} {m}\r\n").into_bytes()),
        Just(b"PING\r\n".to_vec()),
        Just(b"PONG\r\n".to_vec()),
        Just(b"CONNECT {\"verbose\":false}\r\n".to_vec()),
    ]
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(input in prop::collection::vec(any::<u8>(), 0..3000),
                                   cut in 0usize..3000) {
        let cut = cut.min(input.len());
        let _ = run(&[&input[..cut], &input[cut..]]);
    }

    #[test]
    fn valid_streams_parse_the_same_however_split(ops in prop::collection::vec(op_strategy(), 1..20),
                                                  cuts in prop::collection::vec(0usize..2000, 0..6)) {
        let input: Vec<u8> = ops.concat();
        let (whole, err) = run(&[&input]);
        prop_assert!(!err);
        prop_assert_eq!(whole.len(), ops.len());
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(input.len())).collect();
        cuts.sort();
        let mut chunks = vec![];
        let mut prev = 0;
        for c in cuts {
            chunks.push(&input[prev..c]);
            prev = c;
        }
        chunks.push(&input[prev..]);
        let (split, err) = run(&chunks);
        prop_assert!(!err);
        prop_assert_eq!(split, whole);
    }
}
