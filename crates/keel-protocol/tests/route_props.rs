//! Property tests of the route codec: any valid op, encoded, parses back to itself however
//! the bytes are split; arbitrary bytes never panic; and whatever the parser takes out of
//! arbitrary bytes encodes and parses back to the same op.

use bytes::{Bytes, BytesMut};
use keel_protocol::route::{encode, Queues, RouteMsg, RouteOp, RouteParser, RouteSub, RouteUnsub};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Mode {
    pinned: Option<Bytes>,
    unsub_origin: bool,
}

impl Mode {
    fn parser(&self) -> RouteParser {
        let mut p = RouteParser::new();
        p.set_pinned_account(self.pinned.clone());
        p.set_unsub_origin(self.unsub_origin);
        p
    }
}

fn run(mut p: RouteParser, chunks: &[&[u8]]) -> (Vec<RouteOp>, bool) {
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

fn token() -> impl Strategy<Value = Bytes> {
    "[!-~]{1,8}".prop_map(|s| Bytes::from(s.into_bytes()))
}

fn text() -> impl Strategy<Value = Bytes> {
    "([!-~]([ -~]{0,30}[!-~])?)?".prop_map(|s| Bytes::from(s.into_bytes()))
}

fn mode() -> impl Strategy<Value = Mode> {
    (prop::option::of(token()), any::<bool>()).prop_map(|(pinned, unsub_origin)| Mode {
        pinned,
        unsub_origin,
    })
}

/// An op as a peer in `mode` can send it (accounts are the pinned one on a pinned route).
fn op(mode: &Mode) -> impl Strategy<Value = RouteOp> {
    let account = match &mode.pinned {
        Some(a) => Just(a.clone()).boxed(),
        None => token().boxed(),
    };
    let unsub_origin = mode.unsub_origin;
    let queue_names = prop::collection::vec(token(), 0..4).prop_map(|q| {
        let joined: Vec<u8> = q.join(&b" "[..]);
        Queues::new(Bytes::from(joined))
    });
    let data = prop::collection::vec(any::<u8>(), 0..40);
    prop_oneof![
        text().prop_map(RouteOp::Info),
        text().prop_map(RouteOp::Connect),
        text().prop_map(RouteOp::Err),
        Just(RouteOp::Ping),
        Just(RouteOp::Pong),
        Just(RouteOp::Ok),
        (
            prop::option::of(token()),
            account.clone(),
            token(),
            prop::option::of((token(), 0u32..=999_999_999))
        )
            .prop_map(|(origin, account, subject, queue)| RouteOp::Sub(RouteSub {
                origin,
                account,
                subject,
                queue
            })),
        (
            any::<bool>(),
            token(),
            account.clone(),
            token(),
            prop::option::of(token())
        )
            .prop_map(move |(leaf, origin, account, subject, queue)| {
                RouteOp::Unsub(RouteUnsub {
                    leaf,
                    origin: (leaf && unsub_origin).then_some(origin),
                    account,
                    subject,
                    queue,
                })
            }),
        (
            prop::option::of(token()),
            account,
            token(),
            prop::option::of(token()),
            queue_names,
            prop::option::of(any::<prop::sample::Index>()),
            data
        )
            .prop_map(|(origin, account, subject, reply, queues, hdr, data)| {
                let mut hdr_len = hdr.map(|i| i.index(data.len() + 1));
                if origin.is_some() {
                    hdr_len = Some(hdr_len.unwrap_or(0)); // LMSG always has one
                }
                RouteOp::Msg(RouteMsg {
                    origin,
                    account,
                    subject,
                    reply,
                    queues,
                    hdr_len,
                    data: Bytes::from(data),
                })
            }),
    ]
}

fn mode_and_ops() -> impl Strategy<Value = (Mode, Vec<RouteOp>)> {
    mode().prop_flat_map(|m| {
        let ops = prop::collection::vec(op(&m), 1..20);
        (Just(m), ops)
    })
}

fn split<'a>(input: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    cuts.sort();
    let mut chunks = vec![];
    let mut prev = 0;
    for c in cuts {
        chunks.push(&input[prev..c]);
        prev = c;
    }
    chunks.push(&input[prev..]);
    chunks
}

const OPS: &[&str] = &[
    "RMSG", "HMSG", "LMSG", "RS+", "RS-", "LS+", "LS-", "PUB", "HPUB", "UNSUB", "SUB", "A+",
    "INFO", "CONNECT", "-ERR", "PING", "PONG", "+OK", "rmsg", "Ls+", "FOO",
];
const ARGS: &[&str] = &[
    "$G", "foo", "+", "|", "q", "r.1", "0", "1", "2", "12", "\t", "", "x\ry",
];
const TAILS: &[&str] = &[
    "",
    "a\r\n",
    "ab\r\n",
    "NATS/1.0\r\n\r\n",
    "NATS/1.0\r\n\r\na\r\n",
];

/// A control line made of route op names and argument-like tokens, then maybe a payload.
fn noisy_line() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(OPS),
        prop::collection::vec(prop::sample::select(ARGS), 0..8),
        prop::sample::select(&["\r\n", "\n", " \r\n"][..]),
        prop::sample::select(TAILS),
    )
        .prop_map(|(op, args, end, tail)| {
            let mut v = op.as_bytes().to_vec();
            for a in args {
                v.push(b' ');
                v.extend_from_slice(a.as_bytes());
            }
            v.extend_from_slice(end.as_bytes());
            v.extend_from_slice(tail.as_bytes());
            v
        })
}

proptest! {
    #[test]
    fn encoded_ops_parse_back((mode, ops) in mode_and_ops(),
                              cuts in prop::collection::vec(any::<usize>(), 0..6)) {
        let mut buf = BytesMut::new();
        for op in &ops {
            encode::op(&mut buf, op, mode.pinned.is_some());
        }
        let (parsed, err) = run(mode.parser(), &split(&buf, &cuts));
        prop_assert!(!err);
        prop_assert_eq!(parsed, ops);
    }

    #[test]
    fn arbitrary_bytes_never_panic(input in prop::collection::vec(any::<u8>(), 0..3000),
                                   cuts in prop::collection::vec(any::<usize>(), 0..4),
                                   mode in mode(), expect_connect in any::<bool>()) {
        let mut p = mode.parser();
        if expect_connect {
            p.expect_connect();
        }
        let _ = run(p, &split(&input, &cuts));
    }

    /// Route-like noise, so the parser gets past the op name often: whatever it accepts must
    /// be a fixed point of encode and parse.
    #[test]
    fn whatever_parses_reencodes_to_itself(
        lines in prop::collection::vec(noisy_line(), 1..12),
        mode in mode(),
    ) {
        // The whole stream (which stops at its first error), and each line on its own.
        let whole: Vec<u8> = lines.concat();
        let mut ops = run(mode.parser(), &[&whole]).0;
        for line in &lines {
            ops.extend(run(mode.parser(), &[line]).0);
        }
        for op in ops {
            let mut buf = BytesMut::new();
            encode::op(&mut buf, &op, mode.pinned.is_some());
            let (again, err) = run(mode.parser(), &[&buf]);
            prop_assert!(!err, "{:?} encoded as {:?}", op, buf);
            prop_assert_eq!(again, vec![op]);
        }
    }
}
