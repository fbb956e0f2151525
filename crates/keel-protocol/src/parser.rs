//! Incremental parser for the ops a client sends.

use crate::lex::{self, Line, Payload, Tokens};
use bytes::{Bytes, BytesMut};

/// The longest control line (op name and arguments, without CRLF) the reference accepts.
pub const MAX_CONTROL_LINE: usize = 4096;

/// One op from a client. Byte fields are slices of the read buffer (no copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOp {
    /// `CONNECT {json}`: the raw JSON, parsed by the server.
    Connect(Bytes),
    /// `PUB`/`HPUB`. `data` holds the header block (first `hdr_len` bytes) then the payload,
    /// contiguous as on the wire, so HMSG can forward it without splitting.
    Pub {
        subject: Bytes,
        reply: Option<Bytes>,
        hdr_len: Option<usize>,
        data: Bytes,
    },
    Sub {
        subject: Bytes,
        queue: Option<Bytes>,
        sid: Bytes,
    },
    Unsub {
        sid: Bytes,
        max: Option<u64>,
    },
    Ping,
    Pong,
    /// A client may send INFO (routes do); the reference ignores it from clients.
    Info,
}

/// Why the parser gave up. The server answers each as the reference does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    /// `-ERR 'Unknown Protocol Operation'` and close.
    UnknownOp,
    /// `-ERR 'maximum control line exceeded'` and close.
    MaxControlLine,
    /// `-ERR 'Maximum Payload Violation'` and close (sent before the payload is read).
    MaxPayload,
    /// Malformed arguments (`PUB foo` without size, `SUB foo` without sid, header size larger
    /// than total size): the reference closes without a word.
    BadArgs,
}

impl ParseError {
    /// The `-ERR` text the reference sends, or `None` for a silent close.
    pub fn err_text(self) -> Option<&'static str> {
        match self {
            ParseError::UnknownOp => Some("Unknown Protocol Operation"),
            ParseError::MaxControlLine => Some("maximum control line exceeded"),
            ParseError::MaxPayload => Some("Maximum Payload Violation"),
            ParseError::BadArgs => None,
        }
    }
}

#[derive(Debug)]
struct PendingPub {
    subject: Bytes,
    reply: Option<Bytes>,
    hdr_len: Option<usize>,
    total: usize,
}

/// Incremental parser state: between calls it remembers a PUB whose payload has not fully
/// arrived, so a large payload is not re-scanned on every read.
#[derive(Debug)]
pub struct Parser {
    max_payload: usize,
    pending: Option<PendingPub>,
    /// How much of a split control line was already searched for its LF.
    scanned: usize,
}

impl Parser {
    pub fn new(max_payload: usize) -> Self {
        Parser {
            max_payload,
            pending: None,
            scanned: 0,
        }
    }

    /// Bytes the parser needs in `buf` before it can make progress on a pending payload, so
    /// the caller can size its reads. Zero when waiting for a control line.
    pub fn wanted(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.total + 2)
    }

    /// Takes the next complete op off the front of `buf`. `Ok(None)` means more bytes are
    /// needed; nothing is consumed from an incomplete op's payload. Between calls `buf` must be
    /// the same buffer, with new bytes only appended.
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Option<ClientOp>, ParseError> {
        loop {
            if let Some(p) = &self.pending {
                let data = match lex::take_payload(buf, p.total) {
                    Payload::Ready(data) => data,
                    Payload::NeedMore => return Ok(None),
                    Payload::BadEnd => return Err(ParseError::UnknownOp),
                };
                let p = self.pending.take().expect("checked above");
                return Ok(Some(ClientOp::Pub {
                    subject: p.subject,
                    reply: p.reply,
                    hdr_len: p.hdr_len,
                    data,
                }));
            }
            let (end, next) = match lex::find_line(buf, MAX_CONTROL_LINE, &mut self.scanned) {
                Line::Ready { end, next } => (end, next),
                Line::NeedMore => return Ok(None),
                Line::TooLong => return Err(ParseError::MaxControlLine),
            };
            // Truncating before freezing saves the refcount round trip of slicing after.
            let mut line = buf.split_to(next);
            line.truncate(end);
            if let Some(op) = self.control_line(line.freeze())? {
                return Ok(Some(op));
            }
            // A PUB header was read; loop to take its payload if it is already here.
        }
    }

    fn control_line(&mut self, line: Bytes) -> Result<Option<ClientOp>, ParseError> {
        let op_end = line
            .iter()
            .position(|&b| b == b' ' || b == b'\t')
            .unwrap_or(line.len());
        let name = &line[..op_end];
        let mut args = Args::new(&line, op_end);
        if name.eq_ignore_ascii_case(b"PUB") {
            let (subject, reply, size) = match args.split()? {
                (2, [s, n, ..]) => (s, None, n),
                (3, [s, r, n, _]) => (s, Some(r), n),
                _ => return Err(ParseError::BadArgs),
            };
            let total = parse_size(&size).ok_or(ParseError::BadArgs)?;
            self.start_payload(subject, reply, None, total)?;
            Ok(None)
        } else if name.eq_ignore_ascii_case(b"HPUB") {
            let (subject, reply, hsize, tsize) = match args.split()? {
                (3, [s, h, t, _]) => (s, None, h, t),
                (4, [s, r, h, t]) => (s, Some(r), h, t),
                _ => return Err(ParseError::BadArgs),
            };
            let hdr = parse_size(&hsize).ok_or(ParseError::BadArgs)?;
            let total = parse_size(&tsize).ok_or(ParseError::BadArgs)?;
            if hdr > total {
                return Err(ParseError::BadArgs);
            }
            self.start_payload(subject, reply, Some(hdr), total)?;
            Ok(None)
        } else if name.eq_ignore_ascii_case(b"SUB") {
            let (subject, queue, sid) = match args.split()? {
                (2, [s, i, ..]) => (s, None, i),
                (3, [s, q, i, _]) => (s, Some(q), i),
                _ => return Err(ParseError::BadArgs),
            };
            Ok(Some(ClientOp::Sub {
                subject,
                queue,
                sid,
            }))
        } else if name.eq_ignore_ascii_case(b"UNSUB") {
            let (sid, max) = match args.split()? {
                (1, [i, ..]) => (i, None),
                (2, [i, m, ..]) => (i, Some(parse_size(&m).ok_or(ParseError::BadArgs)? as u64)),
                _ => return Err(ParseError::BadArgs),
            };
            Ok(Some(ClientOp::Unsub { sid, max }))
        } else if name.eq_ignore_ascii_case(b"PING") {
            Ok(Some(ClientOp::Ping))
        } else if name.eq_ignore_ascii_case(b"PONG") {
            Ok(Some(ClientOp::Pong))
        } else if name.eq_ignore_ascii_case(b"CONNECT") {
            Ok(Some(ClientOp::Connect(args.rest())))
        } else if name.eq_ignore_ascii_case(b"INFO") {
            Ok(Some(ClientOp::Info))
        } else {
            Err(ParseError::UnknownOp)
        }
    }

    fn start_payload(
        &mut self,
        subject: Bytes,
        reply: Option<Bytes>,
        hdr_len: Option<usize>,
        total: usize,
    ) -> Result<(), ParseError> {
        if total > self.max_payload {
            return Err(ParseError::MaxPayload);
        }
        self.pending = Some(PendingPub {
            subject,
            reply,
            hdr_len,
            total,
        });
        Ok(())
    }
}

/// The arguments of a control line as slices of it (see [`lex::Tokens`]).
struct Args<'a> {
    line: &'a Bytes,
    tokens: Tokens<'a, false>,
}

impl<'a> Args<'a> {
    fn new(line: &'a Bytes, pos: usize) -> Self {
        Args {
            line,
            tokens: Tokens::new(line, pos),
        }
    }

    #[inline]
    fn next(&mut self) -> Option<Bytes> {
        let (start, end) = self.tokens.next_range()?;
        Some(self.line.slice(start..end))
    }

    /// Up to four arguments and how many there were; more than four is malformed.
    fn split(&mut self) -> Result<(usize, [Bytes; 4]), ParseError> {
        let mut out: [Bytes; 4] = Default::default();
        let mut n = 0;
        while let Some(a) = self.next() {
            if n == 4 {
                return Err(ParseError::BadArgs);
            }
            out[n] = a;
            n += 1;
        }
        Ok((n, out))
    }

    fn rest(&mut self) -> Bytes {
        let (start, end) = self.tokens.rest_range();
        self.line.slice(start..end)
    }
}

/// Parses a non-negative decimal size; `None` for anything else or overflow.
#[inline]
fn parse_size(b: &[u8]) -> Option<usize> {
    lex::parse_size::<18>(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(input: &[u8]) -> (Vec<ClientOp>, Option<ParseError>) {
        let mut p = Parser::new(1024);
        let mut buf = BytesMut::from(input);
        let mut ops = vec![];
        loop {
            match p.next(&mut buf) {
                Ok(Some(op)) => ops.push(op),
                Ok(None) => return (ops, None),
                Err(e) => return (ops, Some(e)),
            }
        }
    }

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn pub_sub_ping() {
        let (ops, err) = parse_all(
            b"SUB foo 1\r\nSUB foo q 2\r\nPUB foo 5\r\nhello\r\nPUB foo r 0\r\n\r\nPING\r\nPONG\r\nUNSUB 1 5\r\nUNSUB 2 \r\n",
        );
        assert_eq!(err, None);
        assert_eq!(
            ops,
            vec![
                ClientOp::Sub {
                    subject: b("foo"),
                    queue: None,
                    sid: b("1")
                },
                ClientOp::Sub {
                    subject: b("foo"),
                    queue: Some(b("q")),
                    sid: b("2")
                },
                ClientOp::Pub {
                    subject: b("foo"),
                    reply: None,
                    hdr_len: None,
                    data: b("hello")
                },
                ClientOp::Pub {
                    subject: b("foo"),
                    reply: Some(b("r")),
                    hdr_len: None,
                    data: b("")
                },
                ClientOp::Ping,
                ClientOp::Pong,
                ClientOp::Unsub {
                    sid: b("1"),
                    max: Some(5)
                },
                ClientOp::Unsub {
                    sid: b("2"),
                    max: None
                },
            ]
        );
    }

    #[test]
    fn case_tabs_and_double_spaces() {
        let (ops, err) = parse_all(b"pub\tfoo.y  3\r\ntab\r\nsub _INBOX.x.*  2\r\nping\n");
        assert_eq!(err, None);
        assert_eq!(ops.len(), 3);
        assert_eq!(
            ops[1],
            ClientOp::Sub {
                subject: b("_INBOX.x.*"),
                queue: None,
                sid: b("2")
            }
        );
    }

    #[test]
    fn hpub() {
        let (ops, err) = parse_all(b"HPUB h.b reply.x 12 14\r\nNATS/1.0\r\n\r\nhi\r\n");
        assert_eq!(err, None);
        assert_eq!(
            ops,
            vec![ClientOp::Pub {
                subject: b("h.b"),
                reply: Some(b("reply.x")),
                hdr_len: Some(12),
                data: b("NATS/1.0\r\n\r\nhi")
            }]
        );
    }

    #[test]
    fn connect_json_kept_raw() {
        let (ops, _) = parse_all(b"CONNECT {\"verbose\": false}  \r\n");
        assert_eq!(ops, vec![ClientOp::Connect(b("{\"verbose\": false}"))]);
    }

    #[test]
    fn errors_match_reference() {
        assert_eq!(parse_all(b"FOO bar\r\n").1, Some(ParseError::UnknownOp));
        assert_eq!(
            parse_all(b"PUB big 2000\r\n").1,
            Some(ParseError::MaxPayload)
        );
        assert_eq!(parse_all(b"PUB foo\r\n").1, Some(ParseError::BadArgs));
        assert_eq!(parse_all(b"SUB foo\r\n").1, Some(ParseError::BadArgs));
        assert_eq!(parse_all(b"HPUB foo 10 5\r\n").1, Some(ParseError::BadArgs));
        assert_eq!(parse_all(b"PUB foo x\r\n").1, Some(ParseError::BadArgs));
        assert_eq!(
            parse_all(b"PUB foo 3\r\nhello\r\n").1,
            Some(ParseError::UnknownOp)
        );
        let mut long = b"PUB ".to_vec();
        long.extend(std::iter::repeat_n(b'a', 5000));
        assert_eq!(parse_all(&long).1, Some(ParseError::MaxControlLine));
        long.extend(b" 1\r\nx\r\n");
        assert_eq!(parse_all(&long).1, Some(ParseError::MaxControlLine));
    }

    #[test]
    fn split_anywhere_gives_same_ops() {
        let input: &[u8] =
            b"CONNECT {}\r\nSUB a.* 1\r\nHPUB a.b r 12 17\r\nNATS/1.0\r\n\r\nhello\r\nPUB a.c 3\r\nabc\r\nPING\r\n";
        let (whole, err) = parse_all(input);
        assert_eq!(err, None);
        for cut in 0..input.len() {
            let mut p = Parser::new(1024);
            let mut buf = BytesMut::new();
            let mut ops = vec![];
            for chunk in [&input[..cut], &input[cut..]] {
                buf.extend_from_slice(chunk);
                while let Some(op) = p.next(&mut buf).unwrap() {
                    ops.push(op);
                }
            }
            assert_eq!(ops, whole, "cut at {cut}");
        }
    }

    #[test]
    fn too_many_args() {
        assert_eq!(parse_all(b"SUB a b c d\r\n").1, Some(ParseError::BadArgs));
        assert_eq!(parse_all(b"PUB a b c d e\r\n").1, Some(ParseError::BadArgs));
        assert_eq!(parse_all(b"UNSUB 1 2 3\r\n").1, Some(ParseError::BadArgs));
    }
}
