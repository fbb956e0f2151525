//! Lexing shared by the client and route parsers: finding the control line at the front of
//! the read buffer, splitting it into arguments, reading decimal sizes and taking a payload
//! of known length. Everything is `#[inline]` so each parser gets code as tight as its own.

use bytes::{Buf, Bytes, BytesMut};

/// What [`find_line`] saw at the front of the buffer.
pub(crate) enum Line {
    /// A complete line: `end` is its length without CR LF, `next` where the next op starts.
    Ready {
        end: usize,
        next: usize,
    },
    NeedMore,
    /// Longer than the limit (found without waiting for its end, so memory stays bounded).
    TooLong,
}

/// Finds the LF that ends the control line at the front of `buf`. `scanned` remembers how far
/// an earlier call already looked, so a line arriving over many reads is scanned once; it is
/// reset when a line is found. A line whose content (without CR LF) is longer than `max` is
/// `TooLong`.
#[inline]
pub(crate) fn find_line(buf: &[u8], max: usize, scanned: &mut usize) -> Line {
    let limit = buf.len().min(max + 2);
    let from = (*scanned).min(limit);
    let Some(off) = memchr::memchr(b'\n', &buf[from..limit]) else {
        *scanned = limit;
        if buf.len() > max + 1 {
            return Line::TooLong;
        }
        return Line::NeedMore;
    };
    *scanned = 0;
    let nl = from + off;
    let mut end = nl;
    if end > 0 && buf[end - 1] == b'\r' {
        end -= 1;
    }
    if end > max {
        return Line::TooLong;
    }
    Line::Ready { end, next: nl + 1 }
}

/// What [`take_payload`] found.
pub(crate) enum Payload {
    Ready(Bytes),
    NeedMore,
    /// The `total` bytes are not followed by CR LF.
    BadEnd,
}

/// Takes `total` payload bytes and their CR LF off the front of `buf`, as a slice of it.
#[inline]
pub(crate) fn take_payload(buf: &mut BytesMut, total: usize) -> Payload {
    let need = total + 2;
    if buf.len() < need {
        return Payload::NeedMore;
    }
    if &buf[total..need] != b"\r\n" {
        return Payload::BadEnd;
    }
    let data = buf.split_to(total).freeze();
    buf.advance(2);
    Payload::Ready(data)
}

/// Whitespace-separated arguments of a control line, as `start..end` positions. Repeated
/// separators are one (nats-py sends `SUB subj  sid` with two spaces). With `CR`, a carriage
/// return also separates, as the reference's route argument splitter has it.
#[derive(Clone)]
pub(crate) struct Tokens<'a, const CR: bool> {
    line: &'a [u8],
    pos: usize,
}

impl<'a, const CR: bool> Tokens<'a, CR> {
    #[inline]
    pub(crate) fn new(line: &'a [u8], pos: usize) -> Self {
        Tokens { line, pos }
    }

    #[inline]
    fn is_sep(b: u8) -> bool {
        b == b' ' || b == b'\t' || (CR && b == b'\r')
    }

    #[inline]
    pub(crate) fn skip_ws(&mut self) {
        while self.pos < self.line.len() && Self::is_sep(self.line[self.pos]) {
            self.pos += 1;
        }
    }

    #[inline]
    pub(crate) fn next_range(&mut self) -> Option<(usize, usize)> {
        self.skip_ws();
        if self.pos >= self.line.len() {
            return None;
        }
        let start = self.pos;
        while self.pos < self.line.len() && !Self::is_sep(self.line[self.pos]) {
            self.pos += 1;
        }
        Some((start, self.pos))
    }

    /// Everything after the separators that follow the current position, trailing spaces and
    /// tabs trimmed (the raw JSON of CONNECT and INFO, the text of -ERR).
    #[inline]
    pub(crate) fn rest_range(&mut self) -> (usize, usize) {
        self.skip_ws();
        let mut end = self.line.len();
        while end > self.pos && matches!(self.line[end - 1], b' ' | b'\t') {
            end -= 1;
        }
        (self.pos, end)
    }
}

/// Parses a non-negative decimal of at most `DIGITS` digits; `None` for anything else.
#[inline]
pub(crate) fn parse_size<const DIGITS: usize>(b: &[u8]) -> Option<usize> {
    if b.is_empty() || b.len() > DIGITS {
        return None;
    }
    let mut n = 0usize;
    for &c in b {
        if !c.is_ascii_digit() {
            return None;
        }
        n = n * 10 + (c - b'0') as usize;
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_scan_resumes_and_bounds() {
        let mut scanned = 0;
        assert!(matches!(
            find_line(b"PIN", 10, &mut scanned),
            Line::NeedMore
        ));
        assert_eq!(scanned, 3);
        assert!(matches!(
            find_line(b"PING\r\nX", 10, &mut scanned),
            Line::Ready { end: 4, next: 6 }
        ));
        assert_eq!(scanned, 0);
        assert!(matches!(
            find_line(b"0123456789ab", 10, &mut scanned),
            Line::TooLong
        ));
        let mut scanned = 0;
        assert!(matches!(
            find_line(b"0123456789\r\n", 10, &mut scanned),
            Line::Ready { end: 10, .. }
        ));
        assert!(matches!(
            find_line(b"0123456789a\n", 10, &mut scanned),
            Line::TooLong
        ));
    }

    #[test]
    fn tokens_and_sizes() {
        let line = b"a  b\tc\rd ";
        let mut t = Tokens::<false>::new(line, 0);
        assert_eq!(t.next_range(), Some((0, 1)));
        assert_eq!(t.next_range(), Some((3, 4)));
        assert_eq!(t.next_range(), Some((5, 8)));
        assert_eq!(t.next_range(), None);
        let mut t = Tokens::<true>::new(line, 5);
        assert_eq!(t.next_range(), Some((5, 6)));
        assert_eq!(t.next_range(), Some((7, 8)));
        assert_eq!(parse_size::<9>(b"999999999"), Some(999_999_999));
        assert_eq!(parse_size::<9>(b"1000000000"), None);
        assert_eq!(parse_size::<9>(b""), None);
        assert_eq!(parse_size::<9>(b"1a"), None);
    }
}
