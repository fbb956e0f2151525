//! Replays bytes nats-server 2.15.1 really sent on routes: short literal captures (below)
//! and a longer capture of a real server talking to a raw-socket peer (tests/data, made by tests/data/capture_route_peer.py). Each
//! trace must parse into the expected ops, whole and split at every byte, and Keel's encoders
//! must write the same bytes back.

use bytes::{Bytes, BytesMut};
use keel_protocol::route::{
    encode, Queues, RouteConnect, RouteInfo, RouteMsg, RouteOp, RouteParseError, RouteParser,
    RouteSub, RouteUnsub, SubjectPermission,
};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// Parses `input` fed in the given chunks; stops at the first error.
fn parse_chunks(mut p: RouteParser, chunks: &[&[u8]]) -> (Vec<RouteOp>, Option<RouteParseError>) {
    let mut buf = BytesMut::new();
    let mut ops = vec![];
    for c in chunks {
        buf.extend_from_slice(c);
        loop {
            match p.next(&mut buf) {
                Ok(Some(op)) => ops.push(op),
                Ok(None) => break,
                Err(e) => return (ops, Some(e)),
            }
        }
    }
    assert!(buf.is_empty(), "bytes left over: {:?}", &buf[..]);
    (ops, None)
}

fn parse(p: RouteParser, input: &[u8]) -> Vec<RouteOp> {
    let (ops, err) = parse_chunks(p, &[input]);
    assert_eq!(err, None);
    ops
}

/// Every split of `input` into two reads gives the ops of the whole.
fn assert_split_anywhere(make: impl Fn() -> RouteParser, input: &[u8]) -> Vec<RouteOp> {
    let whole = parse(make(), input);
    for cut in 0..=input.len() {
        let (ops, err) = parse_chunks(make(), &[&input[..cut], &input[cut..]]);
        assert_eq!(err, None, "cut at {cut}");
        assert_eq!(ops, whole, "cut at {cut}");
    }
    whole
}

fn reencode(ops: &[RouteOp], pinned: bool) -> Vec<u8> {
    let mut out = BytesMut::new();
    for op in ops {
        encode::op(&mut out, op, pinned);
    }
    out.to_vec()
}

fn sub(acc: &str, subject: &str, queue: Option<(&str, u32)>) -> RouteOp {
    RouteOp::Sub(RouteSub {
        origin: None,
        account: b(acc),
        subject: b(subject),
        queue: queue.map(|(q, w)| (b(q), w)),
    })
}

fn lsub(origin: &str, subject: &str, queue: Option<(&str, u32)>) -> RouteOp {
    RouteOp::Sub(RouteSub {
        origin: Some(b(origin)),
        account: b("$G"),
        subject: b(subject),
        queue: queue.map(|(q, w)| (b(q), w)),
    })
}

fn unsub(leaf: bool, origin: Option<&str>, subject: &str, queue: Option<&str>) -> RouteOp {
    RouteOp::Unsub(RouteUnsub {
        leaf,
        origin: origin.map(b),
        account: b("$G"),
        subject: b(subject),
        queue: queue.map(b),
    })
}

#[allow(clippy::too_many_arguments)]
fn msg(
    origin: Option<&str>,
    subject: &str,
    reply: Option<&str>,
    queues: &str,
    hdr_len: Option<usize>,
    data: &str,
) -> RouteOp {
    RouteOp::Msg(RouteMsg {
        origin: origin.map(b),
        account: b("$G"),
        subject: b(subject),
        reply: reply.map(b),
        queues: Queues::new(b(queues)),
        hdr_len,
        data: b(data),
    })
}

// §2.2: acceptor A's INFO, then the solicitor B's INFO on the same connection.
const INFO_A: &str = "INFO {\"server_id\":\"NAPMLAUTCTVWCM6QZJQFXVHTUEGCTNGHPCRIS7WK5IILYPTLDRYLLLAQ\",\"server_name\":\"A\",\"version\":\"2.15.1\",\"proto\":3,\"go\":\"go1.27.2\",\"host\":\"127.0.0.1\",\"port\":39109,\"headers\":true,\"max_payload\":1048576,\"nonce\":\"nBJKRfwCO4c69nY\",\"cluster\":\"ref\",\"connect_urls\":[\"127.0.0.1:49313\"],\"compression\":\"accept\",\"lnoc\":true,\"lnocu\":true,\"ln\":true,\"route_pool_size\":3} \r\n";
const INFO_B: &str = "INFO {\"server_id\":\"NBQOPLYR4UMZCQ5SUQBAA3UNQD7QKBIEX7UQMPHAN7G3GMMKQTKLSSGG\",\"server_name\":\"B\",\"version\":\"2.15.1\",\"proto\":3,\"go\":\"go1.27.2\",\"host\":\"127.0.0.1\",\"port\":44125,\"headers\":true,\"max_payload\":1048576,\"nonce\":\"kuXOKNBdtLjIWu0\",\"cluster\":\"ref\",\"connect_urls\":[\"127.0.0.1:45197\"],\"compression\":\"off\",\"lnoc\":true,\"lnocu\":true,\"ln\":true,\"route_pool_size\":3} \r\n";
// §3: B's CONNECT.
const CONNECT_B: &str = "CONNECT {\"echo\":true,\"verbose\":false,\"pedantic\":false,\"tls_required\":false,\"headers\":true,\"name\":\"NBQOPLYR4UMZCQ5SUQBAA3UNQD7QKBIEX7UQMPHAN7G3GMMKQTKLSSGG\",\"cluster\":\"ref\",\"lnoc\":true,\"ln\":true}\r\n";
// Captured for this work from the same binary: cluster auth and JetStream on the acceptor,
// route credentials on the solicitor, and permissions (Go escapes `>` and `&`), a dynamic
// cluster name and a leaf node listener.
const INFO_AUTH_JS: &str = "INFO {\"server_id\":\"NBOXAHD4FVTLJWCUPSHV3ZKXLATPNC7RXTZHP5URV4N3WPLFUV6H5FJK\",\"server_name\":\"A\",\"version\":\"2.15.1\",\"proto\":3,\"go\":\"go1.27.2\",\"host\":\"127.0.0.1\",\"port\":60297,\"headers\":true,\"auth_required\":true,\"max_payload\":1048576,\"jetstream\":true,\"nonce\":\"Epyw_Yt78n4Z1_w\",\"cluster\":\"ref\",\"connect_urls\":[\"127.0.0.1:50849\"],\"compression\":\"accept\",\"lnoc\":true,\"lnocu\":true,\"ln\":true,\"route_pool_size\":3} \r\n";
const CONNECT_CREDS: &str = "CONNECT {\"echo\":true,\"verbose\":false,\"pedantic\":false,\"user\":\"u\",\"pass\":\"p\",\"tls_required\":false,\"headers\":true,\"name\":\"NCUTKVBUTKDJ2XGU5ZBTF3ZXNGPLAUCASHAOWLFBHEPTESE5BT6VOEF7\",\"cluster\":\"ref\",\"lnoc\":true,\"ln\":true}\r\n";
const INFO_PERMS: &str = "INFO {\"server_id\":\"NATLGQRDLLAZNZUSQUVD37RWVZUJ4CBD6IVTAJ3L5K6Z2KAVMKDPJQ2B\",\"server_name\":\"A\\u003c\\u0026\\u003e\",\"version\":\"2.15.1\",\"proto\":3,\"go\":\"go1.27.2\",\"host\":\"127.0.0.1\",\"port\":57293,\"headers\":true,\"max_payload\":1048576,\"nonce\":\"XcLizbGu2FbgISE\",\"cluster\":\"AN0F7E5TTe1o6oDPcSr1T0\",\"cluster_dynamic\":true,\"compression\":\"accept\",\"import\":{\"allow\":[\"foo.\\u003e\",\"a\\u0026b\"]},\"export\":{\"deny\":[\"x.*\"]},\"lnoc\":true,\"lnocu\":true,\"ln\":true,\"leafnode_urls\":[\"127.0.0.1:37963\"]} \r\n";

/// The JSON of an INFO or CONNECT line.
fn json_of(line: &str) -> Bytes {
    match &parse(RouteParser::new(), line.as_bytes())[..] {
        [RouteOp::Info(j)] | [RouteOp::Connect(j)] => j.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn info_lines_round_trip_byte_for_byte() {
    for line in [INFO_A, INFO_B, INFO_AUTH_JS, INFO_PERMS] {
        let info = serde_json::from_slice::<RouteInfo>(&json_of(line)).unwrap();
        let mut out = BytesMut::new();
        encode::info(&mut out, &info);
        assert_eq!(std::str::from_utf8(&out).unwrap(), line);
    }
    let a = serde_json::from_slice::<RouteInfo>(&json_of(INFO_A)).unwrap();
    assert_eq!(
        (a.server_name.as_str(), a.proto, a.port, a.route_pool_size),
        ("A", 3, 39109, 3)
    );
    assert_eq!(
        (a.compression.as_str(), a.lnoc, a.lnocu, a.ln),
        ("accept", true, true, true)
    );
    let p = serde_json::from_slice::<RouteInfo>(&json_of(INFO_PERMS)).unwrap();
    assert_eq!(p.server_name, "A<&>");
    assert_eq!(
        p.import,
        Some(SubjectPermission {
            allow: vec!["foo.>".into(), "a&b".into()],
            deny: vec![]
        })
    );
    assert!(p.cluster_dynamic);
}

#[test]
fn connect_lines_round_trip_byte_for_byte() {
    for line in [CONNECT_B, CONNECT_CREDS] {
        let c = serde_json::from_slice::<RouteConnect>(&json_of(line)).unwrap();
        let mut out = BytesMut::new();
        encode::connect(&mut out, &c);
        assert_eq!(std::str::from_utf8(&out).unwrap(), line);
    }
    let c = serde_json::from_slice::<RouteConnect>(&json_of(CONNECT_CREDS)).unwrap();
    assert_eq!(
        (c.user.as_str(), c.pass.as_str(), c.cluster.as_str()),
        ("u", "p", "ref")
    );
    // Built field by field, as Keel will send it.
    let mine = RouteConnect {
        echo: true,
        headers: true,
        name: "NBQOPLYR4UMZCQ5SUQBAA3UNQD7QKBIEX7UQMPHAN7G3GMMKQTKLSSGG".into(),
        cluster: "ref".into(),
        lnoc: true,
        ln: true,
        ..Default::default()
    };
    let mut out = BytesMut::new();
    encode::connect(&mut out, &mine);
    assert_eq!(std::str::from_utf8(&out).unwrap(), CONNECT_B);
}

#[test]
fn unknown_fields_are_ignored() {
    let i = serde_json::from_slice::<RouteInfo>(
        br#"{"server_id":"N1","unknown_future_field":{"x":1},"port":1}"#,
    )
    .unwrap();
    assert_eq!((i.server_id.as_str(), i.port), ("N1", 1));
    assert!(
        serde_json::from_slice::<RouteConnect>(br#"{"name":"N1","lang":"go","x":[1]}"#).is_ok()
    );
}

// §4 (pool slot 2 after B's INFO and PING) and §6.2: what B sent A.
const B_TO_A: &str = "PING\r\n\
RMSG $G foo 5\r\nhello\r\n\
RMSG $G foo r.1 2\r\nhi\r\n\
HMSG $G foo 20 22\r\nNATS/1.0\r\nX-K: v\r\n\r\nhi\r\n\
HMSG $G foo r.2 20 22\r\nNATS/1.0\r\nX-K: v\r\n\r\nhi\r\n\
RMSG $G work | workers 1\r\nx\r\n\
RMSG $G work + rq.1 workers 1\r\ny\r\n\
RMSG $G mix | g1 g2 1\r\nm\r\n\
RMSG $G mix + rm.1 g1 g2 1\r\nn\r\n\
RS+ $G bar\r\nRS+ $G bq grp 1\r\nRS+ $G wc.*\r\nRS+ $G full.>\r\n\
RS+ $G _INBOX.abc.*\r\nRMSG $G svc.echo _INBOX.abc.1 4\r\nping\r\n\
RS+ $G bq grp 2\r\nRS+ $G bq grp 1\r\nRS- $G bq grp\r\n\
RMSG $G foo + rep grp 2\r\nab\r\nRMSG $G foo | grp 2\r\ncd\r\nRMSG $G foo rep2 2\r\nef\r\nHMSG $G foo 12 14\r\nNATS/1.0\r\n\r\nhi\r\n";

// §4 slot 2 and §6.2/§6.3: what A sent B.
const A_TO_B: &str = "PONG\r\n\
RS+ $G svc.>\r\nRS+ $G foo\r\nRS+ $G work workers 2\r\n\
RS+ $G mix\r\nRS+ $G mix g1 1\r\nRS+ $G mix g2 1\r\n\
RMSG $G bar 1\r\nb\r\nRMSG $G bq | grp 1\r\nq\r\nRMSG $G wc.x 1\r\nw\r\n\
RMSG $G _INBOX.abc.1 4\r\npong\r\n\
RS- $G foo\r\n\
LS+ leafc $G $SYS.REQ.ACCOUNT.PING.CONNZ\r\n\
LS+ leafc $G leafsub\r\nLS+ leafc $G leafq lg 1\r\n\
LMSG leafc $G fromleaf 0 1\r\nc\r\nLMSG leafc $G fromleafq + rr bg 0 1\r\nd\r\n\
LS- leafc $G leafsub\r\nLS- leafc $G leafq lg\r\n";

#[test]
fn b_to_a_trace() {
    let input = format!("{INFO_B}{B_TO_A}");
    let ops = assert_split_anywhere(RouteParser::new, input.as_bytes());
    let hdrs = "NATS/1.0\r\nX-K: v\r\n\r\nhi";
    let expected = vec![
        RouteOp::Info(json_of(INFO_B)),
        RouteOp::Ping,
        msg(None, "foo", None, "", None, "hello"),
        msg(None, "foo", Some("r.1"), "", None, "hi"),
        msg(None, "foo", None, "", Some(20), hdrs),
        msg(None, "foo", Some("r.2"), "", Some(20), hdrs),
        msg(None, "work", None, "workers", None, "x"),
        msg(None, "work", Some("rq.1"), "workers", None, "y"),
        msg(None, "mix", None, "g1 g2", None, "m"),
        msg(None, "mix", Some("rm.1"), "g1 g2", None, "n"),
        sub("$G", "bar", None),
        sub("$G", "bq", Some(("grp", 1))),
        sub("$G", "wc.*", None),
        sub("$G", "full.>", None),
        sub("$G", "_INBOX.abc.*", None),
        msg(None, "svc.echo", Some("_INBOX.abc.1"), "", None, "ping"),
        sub("$G", "bq", Some(("grp", 2))),
        sub("$G", "bq", Some(("grp", 1))),
        unsub(false, None, "bq", Some("grp")),
        msg(None, "foo", Some("rep"), "grp", None, "ab"),
        msg(None, "foo", None, "grp", None, "cd"),
        msg(None, "foo", Some("rep2"), "", None, "ef"),
        msg(None, "foo", None, "", Some(12), "NATS/1.0\r\n\r\nhi"),
    ];
    assert_eq!(ops, expected);
    assert_eq!(reencode(&ops, false), input.as_bytes());
}

#[test]
fn a_to_b_trace_with_leaf_origin() {
    let make = || {
        let mut p = RouteParser::new();
        p.set_unsub_origin(true); // B announced lnocu
        p
    };
    let ops = assert_split_anywhere(make, A_TO_B.as_bytes());
    assert_eq!(ops.len(), 19);
    assert_eq!(ops[0], RouteOp::Pong);
    assert_eq!(ops[11], unsub(false, None, "foo", None));
    assert_eq!(ops[12], lsub("leafc", "$SYS.REQ.ACCOUNT.PING.CONNZ", None));
    assert_eq!(ops[14], lsub("leafc", "leafq", Some(("lg", 1))));
    assert_eq!(
        ops[15],
        msg(Some("leafc"), "fromleaf", None, "", Some(0), "c")
    );
    assert_eq!(
        ops[16],
        msg(Some("leafc"), "fromleafq", Some("rr"), "bg", Some(0), "d")
    );
    assert_eq!(ops[18], unsub(true, Some("leafc"), "leafq", Some("lg")));
    assert_eq!(reencode(&ops, false), A_TO_B.as_bytes());
    // The typed encoders write the same lines.
    let mut out = BytesMut::new();
    encode::rs_sub(&mut out, Some(b"$G"), b"work", Some((b"workers", 2)));
    encode::rmsg(&mut out, Some(b"$G"), b"bq", None, &[b"grp"], b"q");
    encode::lmsg(
        &mut out,
        b"leafc",
        Some(b"$G"),
        b"fromleafq",
        Some(b"rr"),
        &[b"bg"],
        0,
        b"d",
    );
    encode::ls_unsub(&mut out, Some(b"leafc"), Some(b"$G"), b"leafq", Some(b"lg"));
    assert_eq!(
        &out[..],
        b"RS+ $G work workers 2\r\nRMSG $G bq | grp 1\r\nq\r\n\
          LMSG leafc $G fromleafq + rr bg 0 1\r\nd\r\nLS- leafc $G leafq lg\r\n"
    );
}

#[test]
fn pinned_sys_connection() {
    // §4 conn1: B's INFO names the pinned account, then its $SYS interest without an account.
    let info_b_sys = INFO_B.replace(
        "\"route_pool_size\":3}",
        "\"route_pool_size\":3,\"route_account\":\"$SYS\"}",
    );
    let lines = "RS+ $SYS.REQ.SERVER.PING.ROUTEZ\r\nRS+ $SYS.REQ.SERVER.PING.LEAFZ\r\n";
    let input = format!("{CONNECT_B}{info_b_sys}{lines}");
    // The acceptor parses the first lines unpinned and pins once it reads the INFO.
    let mut p = RouteParser::new();
    p.expect_connect();
    let mut buf = BytesMut::from(input.as_bytes());
    assert!(matches!(p.next(&mut buf), Ok(Some(RouteOp::Connect(_)))));
    let Ok(Some(RouteOp::Info(json))) = p.next(&mut buf) else {
        panic!("no INFO")
    };
    let info = serde_json::from_slice::<RouteInfo>(&json).unwrap();
    assert_eq!(info.route_account, "$SYS");
    p.set_pinned_account(Some(Bytes::from(info.route_account.clone())));
    let mut ops = vec![];
    while let Some(op) = p.next(&mut buf).unwrap() {
        ops.push(op);
    }
    assert_eq!(
        ops,
        vec![
            sub("$SYS", "$SYS.REQ.SERVER.PING.ROUTEZ", None),
            sub("$SYS", "$SYS.REQ.SERVER.PING.LEAFZ", None)
        ]
    );
    assert_eq!(reencode(&ops, true), lines.as_bytes());
    let mut out = BytesMut::new();
    encode::info(&mut out, &info);
    assert_eq!(std::str::from_utf8(&out).unwrap(), info_b_sys);
}

#[test]
fn reference_rejections() {
    // §13: an unknown op; §3: PING before CONNECT on an accepted route.
    let (_, err) = parse_chunks(RouteParser::new(), &[b"FOO bar\r\n"]);
    assert_eq!(
        err.and_then(|e| e.err_text()),
        Some("Unknown Protocol Operation")
    );
    let mut p = RouteParser::new();
    p.expect_connect();
    let (_, err) = parse_chunks(p, &[b"PING\r\n"]);
    assert_eq!(
        err.and_then(|e| e.err_text()),
        Some("Authorization Violation")
    );
}

const REF_TO_PEER: &[u8] = include_bytes!("data/ref-2.15.1-a-to-peer.bin");
const PEER_TO_REF: &[u8] = include_bytes!("data/peer-to-ref-a.bin");

#[test]
fn real_server_to_no_pool_peer() {
    // The peer announced lnoc and lnocu, so A sends LS+/LMSG/LS- with the origin.
    let make = || {
        let mut p = RouteParser::new();
        p.set_unsub_origin(true);
        p
    };
    let ops = assert_split_anywhere(make, REF_TO_PEER);
    let infos: Vec<RouteInfo> = ops
        .iter()
        .filter_map(|op| match op {
            RouteOp::Info(j) => Some(serde_json::from_slice::<RouteInfo>(j).unwrap()),
            _ => None,
        })
        .collect();
    assert_eq!(infos.len(), 2);
    assert_eq!(infos[0].server_name, "A");
    assert_eq!(infos[0].leafnode_urls.len(), 1);
    // The second is gossip of C: another server id, `ip` to dial, no nonce.
    assert_eq!(
        (
            infos[1].server_name.as_str(),
            infos[1].gossip_mode,
            infos[1].nonce.is_empty()
        ),
        ("C", 1, true)
    );
    assert!(infos[1].ip.starts_with("nats-route://127.0.0.1:"));

    let count = |f: &dyn Fn(&RouteOp) -> bool| ops.iter().filter(|op| f(op)).count();
    assert_eq!(
        count(&|op| matches!(op, RouteOp::Sub(s) if &s.account[..] == b"$SYS")),
        53
    );
    assert!(ops.contains(&sub("$G", "work", Some(("workers", 2)))));
    assert!(ops.contains(&msg(None, "bq", None, "grp", Some(12), "NATS/1.0\r\n\r\n")));
    assert!(ops.contains(&msg(None, "bq", Some("rq.1"), "grp", None, "y")));
    assert!(ops.contains(&msg(Some("leafc"), "bq", Some("rr"), "grp", Some(0), "d")));
    assert!(ops.contains(&msg(
        Some("leafc"),
        "bar",
        None,
        "",
        Some(12),
        "NATS/1.0\r\n\r\nhi"
    )));
    assert!(ops.contains(&unsub(true, Some("leafc"), "leafq", Some("lg"))));

    // Keel's encoders give back the very bytes: the connection's INFO ends in space + CRLF,
    // the gossip INFO in CRLF.
    let mut out = BytesMut::new();
    let mut seen_info = false;
    for op in &ops {
        match op {
            RouteOp::Info(j) => {
                let info = serde_json::from_slice::<RouteInfo>(j).unwrap();
                if seen_info {
                    encode::gossip_info(&mut out, &info);
                } else {
                    encode::info(&mut out, &info);
                }
                seen_info = true;
            }
            op => encode::op(&mut out, op, false),
        }
    }
    assert_eq!(&out[..], REF_TO_PEER);
}

#[test]
fn peer_side_of_the_capture_as_an_acceptor_reads_it() {
    let mut p = RouteParser::new();
    p.expect_connect();
    let ops = parse(p, PEER_TO_REF);
    assert!(
        matches!(&ops[0], RouteOp::Connect(j) if serde_json::from_slice::<RouteConnect>(j).unwrap().lnoc)
    );
    assert!(matches!(&ops[1], RouteOp::Info(_)));
    assert_eq!(ops[2], sub("$G", "bar", None));
    assert_eq!(ops.last(), Some(&RouteOp::Pong));
    assert_eq!(reencode(&ops, false), PEER_TO_REF);
}

#[test]
fn every_field_written_and_read_back() {
    let perm = |a: &str, d: &str| SubjectPermission {
        allow: vec![a.into()],
        deny: vec![d.into()],
    };
    let info = RouteInfo {
        server_id: "N1".into(),
        server_name: "n<1>".into(),
        version: "2.15.1".into(),
        proto: 3,
        go: "go1.27.2".into(),
        host: "h".into(),
        port: 4248,
        headers: true,
        auth_required: true,
        tls_required: true,
        tls_verify: true,
        max_payload: 1048576,
        jetstream: true,
        tags: vec!["az:1".into()],
        js_limits: Some([64 << 20, 1 << 30]),
        ip: "nats-route://h:4248/".into(),
        nonce: "x".into(),
        cluster: "c".into(),
        cluster_dynamic: true,
        domain: "d".into(),
        connect_urls: vec!["h:4222".into()],
        ws_connect_urls: vec!["h:8080".into()],
        ldm: true,
        compression: "off".into(),
        import: Some(perm("a.>", "b")),
        export: Some(SubjectPermission::default()),
        lnoc: true,
        lnocu: true,
        ln: true,
        route_pool_size: 3,
        route_pool_idx: 2,
        route_account: "$SYS".into(),
        route_acc_add_reqid: "r".into(),
        gossip_mode: 2,
        gateway: "g".into(),
        gateway_urls: vec!["g:7222".into()],
        gateway_url: "g:7222".into(),
        gateway_cmd: 1,
        gateway_cmd_payload: "AQI=".into(),
        leafnode_urls: vec!["h:7422".into()],
    };
    let mut out = BytesMut::new();
    encode::info(&mut out, &info);
    let json = json_of(std::str::from_utf8(&out).unwrap());
    assert_eq!(serde_json::from_slice::<RouteInfo>(&json).unwrap(), info);
    // Same text as serde_json's, apart from Go's extra escapes; an empty pointer struct is `{}`.
    let serde_text = serde_json::to_string(&info).unwrap();
    let go_text = std::str::from_utf8(&json).unwrap();
    assert_eq!(
        go_text,
        serde_text.replace('<', "\\u003c").replace('>', "\\u003e")
    );
    assert!(go_text.contains("\"export\":{}"));
    // Unset, every omitempty field is left out.
    let mut out = BytesMut::new();
    encode::info(&mut out, &RouteInfo::default());
    assert_eq!(
        &out[..],
        &b"INFO {\"server_id\":\"\",\"server_name\":\"\",\"version\":\"\",\"proto\":0,\"go\":\"\",\"host\":\"\",\"port\":0,\"headers\":false,\"max_payload\":0} \r\n"[..]
    );

    let connect = RouteConnect {
        echo: true,
        verbose: true,
        pedantic: true,
        user: "u".into(),
        pass: "p&".into(),
        tls_required: true,
        headers: true,
        name: "N1".into(),
        cluster: "c".into(),
        cluster_dynamic: true,
        lnoc: true,
        lnocu: true,
        ln: true,
        gateway: "g".into(),
        lang: "rust".into(),
    };
    let mut out = BytesMut::new();
    encode::connect(&mut out, &connect);
    let json = json_of(std::str::from_utf8(&out).unwrap());
    assert_eq!(
        serde_json::from_slice::<RouteConnect>(&json).unwrap(),
        connect
    );
    assert_eq!(
        std::str::from_utf8(&json).unwrap(),
        serde_json::to_string(&connect)
            .unwrap()
            .replace('&', "\\u0026")
    );
}
