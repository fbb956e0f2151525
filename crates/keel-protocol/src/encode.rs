//! Encoders for the ops the server sends. They append to a `BytesMut` so a connection's
//! outbound buffer collects many ops for one write.

use bytes::{BufMut, BytesMut};

pub const PING: &[u8] = b"PING\r\n";
pub const PONG: &[u8] = b"PONG\r\n";
pub const OK: &[u8] = b"+OK\r\n";

/// Appends the decimal form of `n` without allocating.
pub fn put_uint(buf: &mut BytesMut, mut n: u64) {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.put_slice(&tmp[i..]);
}

/// `MSG <subject> <sid> [reply] <len>\r\n<payload>\r\n`
pub fn msg(buf: &mut BytesMut, subject: &[u8], sid: &[u8], reply: Option<&[u8]>, payload: &[u8]) {
    buf.reserve(subject.len() + sid.len() + reply.map_or(0, |r| r.len() + 1) + payload.len() + 32);
    buf.put_slice(b"MSG ");
    buf.put_slice(subject);
    buf.put_u8(b' ');
    buf.put_slice(sid);
    buf.put_u8(b' ');
    if let Some(r) = reply {
        buf.put_slice(r);
        buf.put_u8(b' ');
    }
    put_uint(buf, payload.len() as u64);
    buf.put_slice(b"\r\n");
    buf.put_slice(payload);
    buf.put_slice(b"\r\n");
}

/// `HMSG <subject> <sid> [reply] <hdr len> <total len>\r\n<headers><payload>\r\n`, where
/// `data` is the header block followed by the payload.
pub fn hmsg(
    buf: &mut BytesMut,
    subject: &[u8],
    sid: &[u8],
    reply: Option<&[u8]>,
    hdr_len: usize,
    data: &[u8],
) {
    buf.reserve(subject.len() + sid.len() + reply.map_or(0, |r| r.len() + 1) + data.len() + 48);
    buf.put_slice(b"HMSG ");
    buf.put_slice(subject);
    buf.put_u8(b' ');
    buf.put_slice(sid);
    buf.put_u8(b' ');
    if let Some(r) = reply {
        buf.put_slice(r);
        buf.put_u8(b' ');
    }
    put_uint(buf, hdr_len as u64);
    buf.put_u8(b' ');
    put_uint(buf, data.len() as u64);
    buf.put_slice(b"\r\n");
    buf.put_slice(data);
    buf.put_slice(b"\r\n");
}

/// `-ERR '<text>'\r\n`
pub fn err(buf: &mut BytesMut, text: &str) {
    buf.put_slice(b"-ERR '");
    buf.put_slice(text.as_bytes());
    buf.put_slice(b"'\r\n");
}

/// `INFO <json> \r\n` (the reference puts a space before CRLF).
pub fn info(buf: &mut BytesMut, json: &[u8]) {
    buf.put_slice(b"INFO ");
    buf.put_slice(json);
    buf.put_slice(b" \r\n");
}

/// A header block holding only a status line and the given headers, as the server
/// makes for status messages (`NATS/1.0 503\r\nNats-Subject: x\r\n\r\n`).
pub fn status_headers(status: &str, headers: &[(&str, &[u8])]) -> BytesMut {
    let mut b = BytesMut::with_capacity(64);
    b.put_slice(b"NATS/1.0 ");
    b.put_slice(status.as_bytes());
    b.put_slice(b"\r\n");
    for (k, v) in headers {
        b.put_slice(k.as_bytes());
        b.put_slice(b": ");
        b.put_slice(v);
        b.put_slice(b"\r\n");
    }
    b.put_slice(b"\r\n");
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msg_forms() {
        let mut b = BytesMut::new();
        msg(&mut b, b"foo.bar", b"3", Some(b"reply.to"), b"world");
        msg(&mut b, b"foo", b"1", None, b"");
        assert_eq!(
            &b[..],
            b"MSG foo.bar 3 reply.to 5\r\nworld\r\nMSG foo 1 0\r\n\r\n"
        );
    }

    #[test]
    fn hmsg_and_status() {
        let hdr = status_headers("503", &[("Nats-Subject", b"nobody.home")]);
        let mut b = BytesMut::new();
        hmsg(&mut b, b"_INBOX.req", b"1", None, hdr.len(), &hdr);
        assert_eq!(
            &b[..],
            b"HMSG _INBOX.req 1 43 43\r\nNATS/1.0 503\r\nNats-Subject: nobody.home\r\n\r\n\r\n"
        );
    }

    #[test]
    fn uints() {
        for n in [0u64, 7, 10, 12345, u64::MAX] {
            let mut b = BytesMut::new();
            put_uint(&mut b, n);
            assert_eq!(std::str::from_utf8(&b).unwrap(), n.to_string());
        }
    }
}
