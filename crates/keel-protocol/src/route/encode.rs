//! Encoders for the ops a server sends on a route, byte for byte as nats-server 2.15.1 writes
//! them. They append to a `BytesMut`, so one outbound buffer collects many ops for one write.
//!
//! `account` is `None` on a pinned-account connection, whose lines leave it out. `PING`,
//! `PONG` and `-ERR` are the client protocol's ([`crate::encode`]).

use super::{write_go_json, RouteConnect, RouteInfo, RouteOp};
use crate::encode::put_uint;
use bytes::{BufMut, BytesMut};

pub use crate::encode::{err, OK, PING, PONG};

fn write_json<T: serde::Serialize>(buf: &mut BytesMut, v: &T) {
    // These types hold only strings, booleans, integers and lists of them.
    write_go_json(buf, v).expect("route INFO/CONNECT are always writable");
}

/// `INFO {json} \r\n`: the reference ends the INFO it sends on a connection in space + CRLF.
pub fn info(buf: &mut BytesMut, info: &RouteInfo) {
    buf.put_slice(b"INFO ");
    write_json(buf, info);
    buf.put_slice(b" \r\n");
}

/// `INFO {json}\r\n`: gossip of another server to a peer, which the reference writes without
/// the space.
pub fn gossip_info(buf: &mut BytesMut, info: &RouteInfo) {
    buf.put_slice(b"INFO ");
    write_json(buf, info);
    buf.put_slice(b"\r\n");
}

/// `CONNECT {json}\r\n`.
pub fn connect(buf: &mut BytesMut, connect: &RouteConnect) {
    buf.put_slice(b"CONNECT ");
    write_json(buf, connect);
    buf.put_slice(b"\r\n");
}

fn interest(
    buf: &mut BytesMut,
    op: &[u8],
    origin: Option<&[u8]>,
    account: Option<&[u8]>,
    subject: &[u8],
    queue: Option<&[u8]>,
    weight: Option<u32>,
) {
    let len = |o: Option<&[u8]>| o.map_or(0, |b| b.len() + 1);
    buf.reserve(op.len() + len(origin) + len(account) + subject.len() + len(queue) + 14);
    buf.put_slice(op);
    for t in [origin, account].into_iter().flatten() {
        buf.put_slice(t);
        buf.put_u8(b' ');
    }
    buf.put_slice(subject);
    if let Some(q) = queue {
        buf.put_u8(b' ');
        buf.put_slice(q);
        if let Some(w) = weight {
            buf.put_u8(b' ');
            put_uint(buf, w as u64);
        }
    }
    buf.put_slice(b"\r\n");
}

/// `RS+ [acc] subj [queue weight]\r\n`. For a queue group, sent with the new local member
/// count (at least 1) on every change; the peer replaces the weight it had.
pub fn rs_sub(
    buf: &mut BytesMut,
    account: Option<&[u8]>,
    subject: &[u8],
    queue: Option<(&[u8], u32)>,
) {
    let (q, w) = queue.map_or((None, None), |(q, w)| (Some(q), Some(w)));
    interest(buf, b"RS+ ", None, account, subject, q, w);
}

/// `RS- [acc] subj [queue]\r\n` (no weight).
pub fn rs_unsub(buf: &mut BytesMut, account: Option<&[u8]>, subject: &[u8], queue: Option<&[u8]>) {
    interest(buf, b"RS- ", None, account, subject, queue, None);
}

/// `LS+ origin [acc] subj [queue weight]\r\n`: interest of a leaf node from cluster `origin`,
/// only to peers that announced `lnoc` (others get `RS+`).
pub fn ls_sub(
    buf: &mut BytesMut,
    origin: &[u8],
    account: Option<&[u8]>,
    subject: &[u8],
    queue: Option<(&[u8], u32)>,
) {
    let (q, w) = queue.map_or((None, None), |(q, w)| (Some(q), Some(w)));
    interest(buf, b"LS+ ", Some(origin), account, subject, q, w);
}

/// `LS- [origin] [acc] subj [queue]\r\n`: the origin only to peers that announced `lnocu`.
pub fn ls_unsub(
    buf: &mut BytesMut,
    origin: Option<&[u8]>,
    account: Option<&[u8]>,
    subject: &[u8],
    queue: Option<&[u8]>,
) {
    interest(buf, b"LS- ", origin, account, subject, queue, None);
}

#[allow(clippy::too_many_arguments)]
fn message<'q>(
    buf: &mut BytesMut,
    op: &[u8],
    origin: Option<&[u8]>,
    account: Option<&[u8]>,
    subject: &[u8],
    reply: Option<&[u8]>,
    queues: impl Iterator<Item = &'q [u8]> + Clone,
    hdr_len: Option<usize>,
    data: &[u8],
) {
    let len = |o: Option<&[u8]>| o.map_or(0, |b| b.len() + 1);
    let qlen: usize = queues.clone().map(|q| q.len() + 1).sum();
    buf.reserve(
        op.len() + len(origin) + len(account) + subject.len() + len(reply) + qlen + data.len() + 48,
    );
    buf.put_slice(op);
    for t in [origin, account].into_iter().flatten() {
        buf.put_slice(t);
        buf.put_u8(b' ');
    }
    buf.put_slice(subject);
    buf.put_u8(b' ');
    if qlen > 0 {
        // With queue names the reply needs a marker: `+ reply q…`, or `| q…` without one.
        match reply {
            Some(r) => {
                buf.put_slice(b"+ ");
                buf.put_slice(r);
                buf.put_u8(b' ');
            }
            None => buf.put_slice(b"| "),
        }
        for q in queues {
            buf.put_slice(q);
            buf.put_u8(b' ');
        }
    } else if let Some(r) = reply {
        buf.put_slice(r);
        buf.put_u8(b' ');
    }
    if let Some(h) = hdr_len {
        put_uint(buf, h as u64);
        buf.put_u8(b' ');
    }
    put_uint(buf, data.len() as u64);
    buf.put_slice(b"\r\n");
    buf.put_slice(data);
    buf.put_slice(b"\r\n");
}

/// `RMSG [acc] subj [reply | + reply q… | | q…] size\r\n<payload>\r\n`. `queues` are the
/// groups the sender picked the peer for; the peer delivers to no queue subscriber without
/// them. To a peer with `headers: false`, send a message's payload alone this way.
pub fn rmsg<Q: AsRef<[u8]>>(
    buf: &mut BytesMut,
    account: Option<&[u8]>,
    subject: &[u8],
    reply: Option<&[u8]>,
    queues: &[Q],
    payload: &[u8],
) {
    let qs = queues.iter().map(AsRef::as_ref);
    message(
        buf, b"RMSG ", None, account, subject, reply, qs, None, payload,
    );
}

/// `HMSG [acc] subj [reply markers] hdr_len total\r\n<headers><payload>\r\n`, where `data` is
/// the header block followed by the payload. (A route has no `HRMSG`.)
pub fn hmsg<Q: AsRef<[u8]>>(
    buf: &mut BytesMut,
    account: Option<&[u8]>,
    subject: &[u8],
    reply: Option<&[u8]>,
    queues: &[Q],
    hdr_len: usize,
    data: &[u8],
) {
    let qs = queues.iter().map(AsRef::as_ref);
    message(
        buf,
        b"HMSG ",
        None,
        account,
        subject,
        reply,
        qs,
        Some(hdr_len),
        data,
    );
}

/// `LMSG origin [acc] subj [reply markers] hdr_len total\r\n…`: a message from a leaf node of
/// cluster `origin`, to a peer with `lnoc`. It always has a header length, 0 without headers.
#[allow(clippy::too_many_arguments)]
pub fn lmsg<Q: AsRef<[u8]>>(
    buf: &mut BytesMut,
    origin: &[u8],
    account: Option<&[u8]>,
    subject: &[u8],
    reply: Option<&[u8]>,
    queues: &[Q],
    hdr_len: usize,
    data: &[u8],
) {
    let qs = queues.iter().map(AsRef::as_ref);
    let origin = Some(origin);
    message(
        buf,
        b"LMSG ",
        origin,
        account,
        subject,
        reply,
        qs,
        Some(hdr_len),
        data,
    );
}

/// Writes `op` back in the wire form the parser reads it from; `pinned` leaves accounts out
/// (a pinned-account connection). The raw JSON of INFO and CONNECT and the raw -ERR text are
/// written as they are.
pub fn op(buf: &mut BytesMut, op: &RouteOp, pinned: bool) {
    fn account(pinned: bool, a: &[u8]) -> Option<&[u8]> {
        (!pinned).then_some(a)
    }
    match op {
        RouteOp::Info(json) => crate::encode::info(buf, json),
        RouteOp::Connect(json) => {
            buf.put_slice(b"CONNECT ");
            buf.put_slice(json);
            buf.put_slice(b"\r\n");
        }
        RouteOp::Ping => buf.put_slice(PING),
        RouteOp::Pong => buf.put_slice(PONG),
        RouteOp::Ok => buf.put_slice(OK),
        RouteOp::Err(text) => {
            buf.put_slice(b"-ERR ");
            buf.put_slice(text);
            buf.put_slice(b"\r\n");
        }
        RouteOp::Sub(s) => {
            let q = s.queue.as_ref().map(|(q, w)| (&q[..], *w));
            match &s.origin {
                Some(o) => ls_sub(buf, o, account(pinned, &s.account), &s.subject, q),
                None => rs_sub(buf, account(pinned, &s.account), &s.subject, q),
            }
        }
        RouteOp::Unsub(u) => {
            let q = u.queue.as_deref();
            if u.leaf {
                ls_unsub(
                    buf,
                    u.origin.as_deref(),
                    account(pinned, &u.account),
                    &u.subject,
                    q,
                );
            } else {
                rs_unsub(buf, account(pinned, &u.account), &u.subject, q);
            }
        }
        RouteOp::Msg(m) => {
            let (op, hdr): (&[u8], _) = match (&m.origin, m.hdr_len) {
                (Some(_), h) => (b"LMSG ", Some(h.unwrap_or(0))),
                (None, Some(h)) => (b"HMSG ", Some(h)),
                (None, None) => (b"RMSG ", None),
            };
            let reply = m.reply.as_deref();
            let acc = account(pinned, &m.account);
            let origin = m.origin.as_deref();
            let qs = m.queues.iter();
            message(buf, op, origin, acc, &m.subject, reply, qs, hdr, &m.data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(b: &BytesMut) -> &str {
        std::str::from_utf8(b).unwrap()
    }

    #[test]
    fn interest_lines() {
        let mut b = BytesMut::new();
        rs_sub(&mut b, Some(b"$G"), b"foo", None);
        rs_sub(&mut b, Some(b"$G"), b"work", Some((b"workers", 2)));
        rs_unsub(&mut b, Some(b"$G"), b"work", Some(b"workers"));
        rs_sub(&mut b, None, b"$SYS.REQ.SERVER.PING.ROUTEZ", None);
        ls_sub(&mut b, b"leafc", Some(b"$G"), b"leafq", Some((b"lg", 1)));
        ls_unsub(&mut b, Some(b"leafc"), Some(b"$G"), b"leafq", Some(b"lg"));
        ls_unsub(&mut b, None, Some(b"$G"), b"leafsub", None);
        assert_eq!(
            s(&b),
            "RS+ $G foo\r\nRS+ $G work workers 2\r\nRS- $G work workers\r\n\
             RS+ $SYS.REQ.SERVER.PING.ROUTEZ\r\nLS+ leafc $G leafq lg 1\r\n\
             LS- leafc $G leafq lg\r\nLS- $G leafsub\r\n"
        );
    }

    #[test]
    fn message_lines() {
        let none: &[&[u8]] = &[];
        let mut b = BytesMut::new();
        rmsg(&mut b, Some(b"$G"), b"foo", None, none, b"hello");
        rmsg(&mut b, Some(b"$G"), b"foo", Some(b"r.1"), none, b"hi");
        rmsg(
            &mut b,
            Some(b"$G"),
            b"mix",
            None,
            &[&b"g1"[..], b"g2"],
            b"m",
        );
        rmsg(
            &mut b,
            Some(b"$G"),
            b"mix",
            Some(b"rm.1"),
            &[&b"g1"[..], b"g2"],
            b"n",
        );
        hmsg(
            &mut b,
            Some(b"$G"),
            b"foo",
            Some(b"r.2"),
            none,
            12,
            b"NATS/1.0\r\n\r\nhi",
        );
        lmsg(
            &mut b,
            b"leafc",
            Some(b"$G"),
            b"fromleafq",
            Some(b"rr"),
            &[b"bg"],
            0,
            b"d",
        );
        rmsg(&mut b, None, b"$SYS.SERVER.N.STATSZ", None, none, b"{}");
        assert_eq!(
            s(&b),
            "RMSG $G foo 5\r\nhello\r\nRMSG $G foo r.1 2\r\nhi\r\nRMSG $G mix | g1 g2 1\r\nm\r\n\
             RMSG $G mix + rm.1 g1 g2 1\r\nn\r\nHMSG $G foo r.2 12 14\r\nNATS/1.0\r\n\r\nhi\r\n\
             LMSG leafc $G fromleafq + rr bg 0 1\r\nd\r\nRMSG $SYS.SERVER.N.STATSZ 2\r\n{}\r\n"
        );
    }
}
