//! The NATS wire codec, with no I/O and no async.
//!
//! [`Parser`] turns the bytes a client sends into [`ClientOp`]s incrementally: a read may end
//! anywhere (mid control line, mid payload) and may hold many ops. Subjects, reply subjects,
//! sids and payloads come out as [`bytes::Bytes`] slices of the read buffer, so routing a
//! message copies nothing until it is written into a subscriber's outbound buffer. The
//! `encode` module writes server ops (MSG, HMSG, INFO, -ERR, ...) into a `BytesMut`, and
//! `subject` validates subjects the way the reference server does. The `route` module is the
//! same for the cluster protocol between servers: [`route::RouteParser`] for what a route peer
//! sends, `route::encode` for what a server sends it, and the route INFO/CONNECT JSON.

pub mod encode;
mod lex;
mod parser;
pub mod route;
pub mod subject;

pub use parser::{ClientOp, ParseError, Parser, MAX_CONTROL_LINE};

/// Reads header values out of a `NATS/1.0` header block.
pub mod headers {
    /// The value of the first header named exactly `name`, trimmed of spaces.
    pub fn get<'a>(block: &'a [u8], name: &str) -> Option<&'a [u8]> {
        let mut lines = block.split(|&b| b == b'\n');
        lines.next(); // the NATS/1.0 status line
        for line in lines {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(colon) = line.iter().position(|&b| b == b':') else {
                continue;
            };
            if &line[..colon] == name.as_bytes() {
                return Some(line[colon + 1..].trim_ascii());
            }
        }
        None
    }

    /// `get` as UTF-8 text.
    pub fn get_str<'a>(block: &'a [u8], name: &str) -> Option<&'a str> {
        get(block, name).and_then(|v| std::str::from_utf8(v).ok())
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn lookup() {
            let b = b"NATS/1.0\r\nNats-Msg-Id: A1\r\nX-Multi: a\r\nX-Multi: b\r\n\r\n";
            assert_eq!(super::get(b, "Nats-Msg-Id"), Some(&b"A1"[..]));
            assert_eq!(super::get(b, "X-Multi"), Some(&b"a"[..]));
            assert_eq!(super::get(b, "nats-msg-id"), None);
            assert_eq!(super::get(b"", "X"), None);
        }
    }
}
