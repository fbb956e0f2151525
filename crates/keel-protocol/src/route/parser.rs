//! Incremental parser for the ops a route peer sends.

use crate::lex::{self, Line, Payload, Tokens};
use crate::MAX_CONTROL_LINE;
use bytes::{Bytes, BytesMut};
use std::fmt;

/// Route control lines may be 16 times a client's (they carry origin, account, reply and
/// queue names): 64 KiB for the default `max_control_line`, as the reference. Like the
/// reference, the limit counts the arguments, not the op name.
pub const ROUTE_MAX_CONTROL_LINE: usize = 16 * MAX_CONTROL_LINE;

/// The largest size a route message can announce: the reference reads sizes of at most nine
/// digits, and sets no other limit on routes.
pub const ROUTE_MAX_SIZE: usize = 999_999_999;

/// Room for the op name and its separator on top of the argument limit, used while a line
/// has not fully arrived (the reference's check there is approximate too).
const OP_SLACK: usize = 16;

/// One op from a route peer. Byte fields are slices of the read buffer (no copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteOp {
    /// `INFO {json}`: the raw JSON (see [`super::RouteInfo`]). On an established route, an
    /// INFO about another server (its `server_id` differs) is gossip of a new peer.
    Info(Bytes),
    /// `CONNECT {json}`: the raw JSON (see [`super::RouteConnect`]).
    Connect(Bytes),
    Ping,
    Pong,
    /// `+OK` (never sent: routes are not verbose).
    Ok,
    /// `-ERR <text>`: the text as sent, quotes included. The reference logs it and closes.
    Err(Bytes),
    /// `RS+` or `LS+`.
    Sub(RouteSub),
    /// `RS-` or `LS-`.
    Unsub(RouteUnsub),
    /// `RMSG`, `HMSG` or `LMSG`.
    Msg(RouteMsg),
}

/// Interest from the peer: `RS+ [acc] subj [queue weight]`, or `LS+ origin [acc] subj [queue
/// weight]` for interest of a leaf node in the `origin` cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSub {
    /// `Some` for `LS+`. The reference keys leaf interest apart from routed interest
    /// (`L …` vs `R …`), so the two never collide.
    pub origin: Option<Bytes>,
    /// From the line, or the pinned account of the connection.
    pub account: Bytes,
    pub subject: Bytes,
    /// A queue group and the peer's member count for it (its weight). A later `RS+` for the
    /// same key replaces the weight. A weight that is not a number reads as 0, which the
    /// reference accepts and then never picks.
    pub queue: Option<(Bytes, u32)>,
}

/// Interest withdrawn: `RS- [acc] subj [queue]` or `LS- [origin] [acc] subj [queue]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteUnsub {
    /// `LS-`: withdraws what an `LS+` gave.
    pub leaf: bool,
    /// The origin cluster of an `LS-`, present only when the peer announced `lnocu`.
    pub origin: Option<Bytes>,
    pub account: Bytes,
    pub subject: Bytes,
    pub queue: Option<Bytes>,
}

/// A routed message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteMsg {
    /// `Some` for `LMSG`: the message came from a leaf node of this cluster.
    pub origin: Option<Bytes>,
    pub account: Bytes,
    pub subject: Bytes,
    pub reply: Option<Bytes>,
    /// The queue groups the sender picked this server for. The receiver delivers to every
    /// local plain subscriber and to one member of each listed group; with no list it
    /// delivers to no queue subscriber at all.
    pub queues: Queues,
    /// `None` for `RMSG`; the header length for `HMSG`, and always for `LMSG` (0 when there
    /// are no headers).
    pub hdr_len: Option<usize>,
    /// The header block then the payload, contiguous as on the wire.
    pub data: Bytes,
}

/// The queue names of a routed message: one slice of the control line, split on demand, so
/// parsing allocates nothing however many groups there are.
#[derive(Clone, Default)]
pub struct Queues(Bytes);

impl Queues {
    /// Queue names separated by spaces (or tabs), as on the wire.
    pub fn new(names: Bytes) -> Self {
        Queues(names)
    }

    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// How many names there are.
    pub fn count(&self) -> usize {
        self.iter().count()
    }

    pub fn iter(&self) -> impl Iterator<Item = &[u8]> + Clone + '_ {
        let mut t = Tokens::<true>::new(&self.0, 0);
        std::iter::from_fn(move || t.next_range()).map(|(a, b)| &self.0[a..b])
    }

    pub fn contains(&self, name: &[u8]) -> bool {
        self.iter().any(|q| q == name)
    }

    /// The names as one slice of the line, separators included.
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }
}

impl PartialEq for Queues {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for Queues {}

impl fmt::Debug for Queues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|q| String::from_utf8_lossy(q)))
            .finish()
    }
}

/// Why the parser gave up. Every error closes the route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteParseError {
    /// `-ERR 'Unknown Protocol Operation'` (also for a payload not followed by CR LF).
    UnknownOp,
    /// `-ERR 'Authorization Violation'`: an accepted route sent something before CONNECT.
    AuthViolation,
    /// `-ERR 'maximum control line exceeded'`.
    MaxControlLine,
    /// `-ERR 'Maximum Payload Violation'`: only with a limit set by
    /// [`RouteParser::with_max_payload`]; the reference has none on routes.
    MaxPayload,
    /// Malformed arguments. The reference closes without an -ERR and logs this reason (then
    /// the line), e.g. `processRoutedMsgArgs Bad or Missing Reply Indicator`.
    BadArgs(&'static str),
}

impl RouteParseError {
    /// The `-ERR` text the reference sends, or `None` for a silent close.
    pub fn err_text(self) -> Option<&'static str> {
        match self {
            RouteParseError::UnknownOp => Some("Unknown Protocol Operation"),
            RouteParseError::AuthViolation => Some("Authorization Violation"),
            RouteParseError::MaxControlLine => Some("maximum control line exceeded"),
            RouteParseError::MaxPayload => Some("Maximum Payload Violation"),
            RouteParseError::BadArgs(_) => None,
        }
    }
}

impl fmt::Display for RouteParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteParseError::BadArgs(why) => f.write_str(why),
            e => f.write_str(e.err_text().unwrap_or_default()),
        }
    }
}

impl std::error::Error for RouteParseError {}

#[derive(Debug)]
struct Pending {
    msg: RouteMsg,
    total: usize,
    /// False for a PUB on a route with no pinned account: the reference finds no account for
    /// it and drops it, so the payload is skipped.
    keep: bool,
}

/// Incremental parser state for one route connection.
#[derive(Debug)]
pub struct RouteParser {
    pinned: Option<Bytes>,
    unsub_origin: bool,
    expect_connect: bool,
    max_control_line: usize,
    max_payload: usize,
    pending: Option<Pending>,
    scanned: usize,
}

impl Default for RouteParser {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum MsgKind {
    Rmsg,
    Hmsg,
    Lmsg,
}

enum Bad {
    Parse,
    Reply,
    HdrSize,
    Size,
    HdrTooBig,
}

/// The reference's wording for each malformed message line (it logs these, sends nothing).
fn msg_err(kind: MsgKind, bad: Bad) -> RouteParseError {
    use Bad::*;
    use MsgKind::*;
    RouteParseError::BadArgs(match (kind, bad) {
        (Rmsg, Parse) => "processRoutedMsgArgs Parse Error",
        (Rmsg, Reply) => "processRoutedMsgArgs Bad or Missing Reply Indicator",
        (Rmsg, _) => "processRoutedMsgArgs Bad or Missing Size",
        (Hmsg, Parse) => "processRoutedHeaderMsgArgs Parse Error",
        (Hmsg, Reply) => "processRoutedHeaderMsgArgs Bad or Missing Reply Indicator",
        (Hmsg, HdrSize) => "processRoutedHeaderMsgArgs Bad or Missing Header Size",
        (Hmsg, Size) => "processRoutedHeaderMsgArgs Bad or Missing Size",
        (Hmsg, HdrTooBig) => "processRoutedHeaderMsgArgs Header Size larger then TotalSize",
        (Lmsg, Parse) => "processRoutedOriginClusterMsgArgs Parse Error",
        (Lmsg, Reply) => "processRoutedOriginClusterMsgArgs Bad or Missing Reply Indicator",
        (Lmsg, HdrSize) => "processRoutedOriginClusterMsgArgs Bad or Missing Header Size",
        (Lmsg, Size) => "processRoutedOriginClusterMsgArgs Bad or Missing Size",
        (Lmsg, HdrTooBig) => "processRoutedOriginClusterMsgArgs Header Size larger then TotalSize",
    })
}

/// True when `l` starts with `name`, ignoring ASCII case as the reference does.
#[inline]
fn starts(l: &[u8], name: &[u8]) -> bool {
    l.len() >= name.len() && l[..name.len()].eq_ignore_ascii_case(name)
}

/// Where the arguments of op `name` start, when the line is that op followed by a space or
/// tab; `None` otherwise (to the reference, an unknown op).
#[inline]
fn args_of(l: &[u8], name: &[u8]) -> Option<usize> {
    let n = name.len();
    (starts(l, name) && l.len() > n && matches!(l[n], b' ' | b'\t')).then_some(n + 1)
}

/// Token positions of a message line: the first six and a ring of the last four, which is
/// every position a message op looks at, however many queue names sit between.
struct MsgTokens {
    n: usize,
    head: [(usize, usize); 6],
    tail: [(usize, usize); 4],
}

/// The ranges of up to `N` arguments from `start`, and their count; a count of `N + 1`
/// says there were more.
fn arg_ranges<const N: usize>(line: &[u8], start: usize) -> ([(usize, usize); N], usize) {
    let mut t = Tokens::<true>::new(line, start);
    let mut a = [(0, 0); N];
    let mut n = 0;
    while let Some(r) = t.next_range() {
        if n == N {
            return (a, N + 1);
        }
        a[n] = r;
        n += 1;
    }
    (a, n)
}

impl MsgTokens {
    #[inline]
    fn new(line: &[u8], start: usize) -> Self {
        let mut t = Tokens::<true>::new(line, start);
        let mut s = MsgTokens {
            n: 0,
            head: [(0, 0); 6],
            tail: [(0, 0); 4],
        };
        while let Some(r) = t.next_range() {
            if s.n < 6 {
                s.head[s.n] = r;
            }
            s.tail[s.n & 3] = r;
            s.n += 1;
        }
        s
    }

    #[inline]
    fn get(&self, j: usize) -> (usize, usize) {
        debug_assert!(j < self.n && (j < 6 || j + 4 >= self.n));
        if j < 6 {
            self.head[j]
        } else {
            self.tail[j & 3]
        }
    }
}

impl RouteParser {
    /// A parser for a route whose lines carry the account (no pinned account), whose `LS-`
    /// lines carry no origin, with the reference's limits.
    pub fn new() -> Self {
        RouteParser {
            pinned: None,
            unsub_origin: false,
            expect_connect: false,
            max_control_line: ROUTE_MAX_CONTROL_LINE,
            max_payload: ROUTE_MAX_SIZE,
            pending: None,
            scanned: 0,
        }
    }

    /// The argument limit of a control line (the reference: 16 × `max_control_line`).
    pub fn with_max_control_line(mut self, n: usize) -> Self {
        self.max_control_line = n;
        self
    }

    /// Refuse messages larger than `n` bytes (header and payload) with
    /// [`RouteParseError::MaxPayload`] before reading them, to bound a route's memory. The
    /// reference sets no such limit on routes.
    pub fn with_max_payload(mut self, n: usize) -> Self {
        self.max_payload = n;
        self
    }

    /// For an accepted route: until a CONNECT arrives, any other op is an
    /// [`RouteParseError::AuthViolation`], found on its first byte as the reference does.
    pub fn expect_connect(&mut self) {
        self.expect_connect = true;
    }

    /// The account of a pinned-account connection (its INFO's `route_account`), whose lines
    /// leave the account out; `None` for lines that carry it. Takes effect from the next op.
    pub fn set_pinned_account(&mut self, account: Option<Bytes>) {
        self.pinned = account;
    }

    pub fn pinned_account(&self) -> Option<&Bytes> {
        self.pinned.as_ref()
    }

    /// Whether `LS-` lines carry the origin cluster: true when the peer announced `lnocu`.
    pub fn set_unsub_origin(&mut self, on: bool) {
        self.unsub_origin = on;
    }

    /// Bytes the parser needs in `buf` before it can make progress on a pending payload, so
    /// the caller can size its reads. Zero when waiting for a control line.
    pub fn wanted(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.total + 2)
    }

    /// Takes the next complete op off the front of `buf`. `Ok(None)` means more bytes are
    /// needed. Between calls `buf` must be the same buffer, with new bytes only appended.
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Option<RouteOp>, RouteParseError> {
        loop {
            if let Some(p) = &self.pending {
                let data = match lex::take_payload(buf, p.total) {
                    Payload::Ready(data) => data,
                    Payload::NeedMore => return Ok(None),
                    Payload::BadEnd => return Err(RouteParseError::UnknownOp),
                };
                let p = self.pending.take().expect("checked above");
                if !p.keep {
                    continue;
                }
                let mut msg = p.msg;
                msg.data = data;
                return Ok(Some(RouteOp::Msg(msg)));
            }
            if self.expect_connect {
                if let Some(&b) = buf.first() {
                    if b != b'C' && b != b'c' {
                        return Err(RouteParseError::AuthViolation);
                    }
                }
            }
            let limit = self.max_control_line.saturating_add(OP_SLACK);
            let (end, next) = match lex::find_line(buf, limit, &mut self.scanned) {
                Line::Ready { end, next } => (end, next),
                Line::NeedMore => {
                    // The reference also checks the arguments of a line still arriving.
                    if buf.len() > self.max_control_line {
                        let name = buf.iter().position(|&b| matches!(b, b' ' | b'\t'));
                        let mut t = Tokens::<false>::new(buf, name.unwrap_or(buf.len()));
                        t.skip_ws();
                        if buf.len() - t.rest_range().0 > self.max_control_line {
                            return Err(RouteParseError::MaxControlLine);
                        }
                    }
                    return Ok(None);
                }
                Line::TooLong => return Err(RouteParseError::MaxControlLine),
            };
            let mut line = buf.split_to(next);
            line.truncate(end);
            if let Some(op) = self.control_line(line.freeze())? {
                return Ok(Some(op));
            }
            // A message header was read (its payload is taken above), or an op the reference
            // ignores on routes.
        }
    }

    /// Where the arguments start after the separators at `pos`, checking their length
    /// against the limit as the reference does.
    #[inline]
    fn arg_start(&self, l: &[u8], pos: usize) -> Result<usize, RouteParseError> {
        let mut t = Tokens::<false>::new(l, pos);
        t.skip_ws();
        let (start, _) = t.rest_range();
        if l.len() - start > self.max_control_line {
            return Err(RouteParseError::MaxControlLine);
        }
        Ok(start)
    }

    fn rest(&self, line: &Bytes, pos: usize) -> Result<Bytes, RouteParseError> {
        let start = self.arg_start(line, pos)?;
        let (a, b) = Tokens::<false>::new(line, start).rest_range();
        Ok(line.slice(a..b))
    }

    fn control_line(&mut self, line: Bytes) -> Result<Option<RouteOp>, RouteParseError> {
        let l = &line[..];
        let Some(&b0) = l.first() else {
            return Err(RouteParseError::UnknownOp);
        };
        let unknown = Err(RouteParseError::UnknownOp);
        match b0.to_ascii_uppercase() {
            b'R' => {
                if let Some(p) = args_of(l, b"RMSG") {
                    self.msg(&line, p, MsgKind::Rmsg)
                } else if let Some(p) = args_of(l, b"RS+") {
                    self.sub(&line, p, false)
                } else if let Some(p) = args_of(l, b"RS-") {
                    self.unsub(&line, p, false)
                } else {
                    unknown
                }
            }
            b'H' => {
                if let Some(p) = args_of(l, b"HMSG") {
                    self.msg(&line, p, MsgKind::Hmsg)
                } else if let Some(p) = args_of(l, b"HPUB") {
                    self.publish(&line, p, true)
                } else {
                    unknown
                }
            }
            b'L' => {
                if let Some(p) = args_of(l, b"LMSG") {
                    self.msg(&line, p, MsgKind::Lmsg)
                } else if let Some(p) = args_of(l, b"LS+") {
                    self.sub(&line, p, true)
                } else if let Some(p) = args_of(l, b"LS-") {
                    self.unsub(&line, p, true)
                } else {
                    unknown
                }
            }
            // The reference reads everything after these up to the LF as noise.
            b'P' if starts(l, b"PING") => Ok(Some(RouteOp::Ping)),
            b'P' if starts(l, b"PONG") => Ok(Some(RouteOp::Pong)),
            b'+' if starts(l, b"+OK") => Ok(Some(RouteOp::Ok)),
            // The reference also parses these client ops on a route, though no server sends
            // them there: PUB/HPUB go to the pinned account (or nowhere), UNSUB acts as RS-,
            // SUB is ignored.
            b'P' => match args_of(l, b"PUB") {
                Some(p) => self.publish(&line, p, false),
                None => unknown,
            },
            b'U' => match args_of(l, b"UNSUB") {
                Some(p) => self.unsub(&line, p, false),
                None => unknown,
            },
            b'S' => match args_of(l, b"SUB") {
                Some(p) => self.arg_start(l, p).map(|_| None),
                None => unknown,
            },
            // A+ / A- (and A-'s old spelling "Au") are gateway interest: ignored on routes.
            b'A' if l.len() > 2
                && matches!(l[1], b'+' | b'-' | b'u')
                && matches!(l[2], b' ' | b'\t') =>
            {
                self.arg_start(l, 3).map(|_| None)
            }
            // CONNECT and INFO need no separator before their JSON.
            b'C' if starts(l, b"CONNECT") => {
                let json = self.rest(&line, 7)?;
                self.expect_connect = false;
                Ok(Some(RouteOp::Connect(json)))
            }
            b'I' if starts(l, b"INFO") => Ok(Some(RouteOp::Info(self.rest(&line, 4)?))),
            b'-' => match args_of(l, b"-ERR") {
                Some(p) => Ok(Some(RouteOp::Err(self.rest(&line, p)?))),
                None => unknown,
            },
            _ => unknown,
        }
    }

    /// `RS+ [acc] subj [queue weight]` / `LS+ origin [acc] subj [queue weight]`.
    fn sub(
        &self,
        line: &Bytes,
        pos: usize,
        leaf: bool,
    ) -> Result<Option<RouteOp>, RouteParseError> {
        const BAD: RouteParseError = RouteParseError::BadArgs("processRemoteSub Parse Error");
        let start = self.arg_start(line, pos)?;
        let (a, n) = arg_ranges::<5>(line, start);
        if n > a.len() {
            return Err(BAD);
        }
        let with_acc = self.pinned.is_none();
        let subj = leaf as usize + with_acc as usize;
        let slice = |(s, e): (usize, usize)| line.slice(s..e);
        let queue = if n == subj + 1 {
            None
        } else if n == subj + 3 {
            let (ws, we) = a[subj + 2];
            let weight = lex::parse_size::<9>(&line[ws..we]).unwrap_or(0) as u32;
            Some((slice(a[subj + 1]), weight))
        } else {
            return Err(BAD);
        };
        Ok(Some(RouteOp::Sub(RouteSub {
            origin: leaf.then(|| slice(a[0])),
            account: self.account(line, with_acc.then(|| a[subj - 1])),
            subject: slice(a[subj]),
            queue,
        })))
    }

    /// `RS- [acc] subj [queue]` / `LS- [origin] [acc] subj [queue]`.
    fn unsub(
        &self,
        line: &Bytes,
        pos: usize,
        leaf: bool,
    ) -> Result<Option<RouteOp>, RouteParseError> {
        const BAD: RouteParseError = RouteParseError::BadArgs("processRemoteUnsub parse error");
        let start = self.arg_start(line, pos)?;
        let (a, n) = arg_ranges::<4>(line, start);
        if n > a.len() {
            return Err(BAD);
        }
        let with_origin = leaf && self.unsub_origin;
        let with_acc = self.pinned.is_none();
        let subj = with_origin as usize + with_acc as usize;
        let slice = |(s, e): (usize, usize)| line.slice(s..e);
        let queue = if n == subj + 1 {
            None
        } else if n == subj + 2 {
            Some(slice(a[subj + 1]))
        } else {
            return Err(BAD);
        };
        Ok(Some(RouteOp::Unsub(RouteUnsub {
            leaf,
            origin: with_origin.then(|| slice(a[0])),
            account: self.account(line, with_acc.then(|| a[subj - 1])),
            subject: slice(a[subj]),
            queue,
        })))
    }

    /// The account token at `at`, or the pinned account when the line has none.
    #[inline]
    fn account(&self, line: &Bytes, at: Option<(usize, usize)>) -> Bytes {
        match at {
            Some((s, e)) => line.slice(s..e),
            None => self.pinned.clone().unwrap_or_default(),
        }
    }

    /// `RMSG [acc] subj [reply | + reply q… | | q…] size`, `HMSG` with `hdr size` at the end,
    /// `LMSG origin [acc] …` with `hdr size`. Sets up the pending payload.
    fn msg(
        &mut self,
        line: &Bytes,
        pos: usize,
        kind: MsgKind,
    ) -> Result<Option<RouteOp>, RouteParseError> {
        let start = self.arg_start(line, pos)?;
        let t = MsgTokens::new(line, start);
        let base = (kind == MsgKind::Lmsg) as usize;
        let hdr = (kind != MsgKind::Rmsg) as usize;
        // The reference inserts a pinned account as an argument (for LMSG only once there
        // are more than two), then counts.
        let shift = (self.pinned.is_some() && (kind != MsgKind::Lmsg || t.n > 2)) as usize;
        let n = t.n + shift;
        let fixed = base + 3 + hdr;
        if n < fixed {
            return Err(msg_err(kind, Bad::Parse));
        }
        // Position of argument `i`, for any argument but a pinned account.
        let arg = |i: usize| t.get(if shift == 1 && i > base { i - 1 } else { i });
        let (reply, queues) = if n == fixed {
            (None, None)
        } else if n == fixed + 1 {
            (Some(arg(base + 2)), None)
        } else {
            let (is, ie) = arg(base + 2);
            let last = n - 1 - hdr; // one past the last queue name
            match &line[is..ie] {
                b"+" => (Some(arg(base + 3)), Some((base + 4, last))),
                b"|" => (None, Some((base + 3, last))),
                _ => return Err(msg_err(kind, Bad::Reply)),
            }
        };
        let size_at = |i: usize| {
            let (s, e) = arg(i);
            lex::parse_size::<9>(&line[s..e])
        };
        let hdr_len = if hdr == 1 {
            Some(size_at(n - 2).ok_or(msg_err(kind, Bad::HdrSize))?)
        } else {
            None
        };
        let total = size_at(n - 1).ok_or(msg_err(kind, Bad::Size))?;
        if hdr_len.is_some_and(|h| h > total) {
            return Err(msg_err(kind, Bad::HdrTooBig));
        }
        if total > self.max_payload {
            return Err(RouteParseError::MaxPayload);
        }
        let slice = |(s, e): (usize, usize)| line.slice(s..e);
        let queues = match queues {
            Some((first, end)) if first < end => Queues(line.slice(arg(first).0..arg(end - 1).1)),
            _ => Queues::default(),
        };
        let msg = RouteMsg {
            origin: (base == 1).then(|| slice(arg(0))),
            account: self.account(line, (shift == 0).then(|| arg(base))),
            subject: slice(arg(base + 1)),
            reply: reply.map(slice),
            queues,
            hdr_len,
            data: Bytes::new(),
        };
        self.pending = Some(Pending {
            msg,
            total,
            keep: true,
        });
        Ok(None)
    }

    /// A client `PUB`/`HPUB` on a route. The reference handles it as a message of the
    /// connection's pinned account; with none, it finds no account and drops it. (Its
    /// splitter keeps a CR inside a token; this one splits there as on every route line, so
    /// no field of a route op ever holds a CR.)
    fn publish(
        &mut self,
        line: &Bytes,
        pos: usize,
        headers: bool,
    ) -> Result<Option<RouteOp>, RouteParseError> {
        let bad = RouteParseError::BadArgs;
        let start = self.arg_start(line, pos)?;
        // More than four arguments (n == 5) matches no form below.
        let (a, n) = arg_ranges::<4>(line, start);
        let size = |(s, e): (usize, usize)| lex::parse_size::<9>(&line[s..e]);
        let (reply, hdr_len, total) = if headers {
            let (reply, h, s) = match n {
                3 => (None, a[1], a[2]),
                4 => (Some(a[1]), a[2], a[3]),
                _ => return Err(bad("processHeaderPub Parse Error")),
            };
            let h = size(h).ok_or(bad("processHeaderPub Bad or Missing Header Size"))?;
            let s = size(s).ok_or(bad("processHeaderPub Bad or Missing Total Size"))?;
            if h > s {
                return Err(bad("processHeaderPub Header Size larger then TotalSize"));
            }
            (reply, Some(h), s)
        } else {
            let (reply, s) = match n {
                2 => (None, a[1]),
                3 => (Some(a[1]), a[2]),
                _ => return Err(bad("processPub Parse Error")),
            };
            (
                reply,
                None,
                size(s).ok_or(bad("processPub Bad or Missing Size"))?,
            )
        };
        if total > self.max_payload {
            return Err(RouteParseError::MaxPayload);
        }
        let slice = |(s, e): (usize, usize)| line.slice(s..e);
        let msg = RouteMsg {
            origin: None,
            account: self.pinned.clone().unwrap_or_default(),
            subject: slice(a[0]),
            reply: reply.map(slice),
            queues: Queues::default(),
            hdr_len,
            data: Bytes::new(),
        };
        self.pending = Some(Pending {
            msg,
            total,
            keep: self.pinned.is_some(),
        });
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn parse_with(p: &mut RouteParser, input: &[u8]) -> (Vec<RouteOp>, Option<RouteParseError>) {
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

    fn parse(input: &[u8]) -> (Vec<RouteOp>, Option<RouteParseError>) {
        parse_with(&mut RouteParser::new(), input)
    }

    fn pinned(input: &[u8]) -> (Vec<RouteOp>, Option<RouteParseError>) {
        let mut p = RouteParser::new();
        p.set_pinned_account(Some(Bytes::from_static(b"$SYS")));
        parse_with(&mut p, input)
    }

    fn msg(op: &RouteOp) -> &RouteMsg {
        match op {
            RouteOp::Msg(m) => m,
            other => panic!("not a message: {other:?}"),
        }
    }

    fn names(q: &Queues) -> Vec<&[u8]> {
        q.iter().collect()
    }

    #[test]
    fn message_forms() {
        let (ops, err) = parse(
            b"RMSG $G foo 5\r\nhello\r\nRMSG $G foo r.1 2\r\nhi\r\nRMSG $G mix | g1 g2 1\r\nm\r\n\
              RMSG $G mix + rm.1 g1 g2 1\r\nn\r\nRMSG $G foo + rep 2\r\nab\r\n\
              HMSG $G foo 12 14\r\nNATS/1.0\r\n\r\nhi\r\nHMSG $G work + rq.2 workers 12 13\r\nNATS/1.0\r\n\r\nx\r\n\
              LMSG leafc $G fromleafq + rr bg 0 1\r\nd\r\nLMSG leafc $G fromleaf 0 1\r\nc\r\n",
        );
        assert_eq!(err, None);
        assert_eq!(ops.len(), 9);
        let m = msg(&ops[0]);
        assert_eq!(
            (&m.account[..], &m.subject[..], &m.data[..]),
            (&b"$G"[..], &b"foo"[..], &b"hello"[..])
        );
        assert_eq!(
            (m.reply.clone(), m.hdr_len, m.origin.clone()),
            (None, None, None)
        );
        assert!(m.queues.is_empty());
        assert_eq!(msg(&ops[1]).reply, Some(b("r.1")));
        let m = msg(&ops[2]);
        assert_eq!(
            (m.reply.clone(), names(&m.queues)),
            (None, vec![&b"g1"[..], b"g2"])
        );
        let m = msg(&ops[3]);
        assert_eq!(
            (m.reply.clone(), names(&m.queues)),
            (Some(b("rm.1")), vec![&b"g1"[..], b"g2"])
        );
        let m = msg(&ops[4]);
        assert_eq!((m.reply.clone(), m.queues.count()), (Some(b("rep")), 0));
        let m = msg(&ops[5]);
        assert_eq!(
            (m.hdr_len, &m.data[..]),
            (Some(12), &b"NATS/1.0\r\n\r\nhi"[..])
        );
        let m = msg(&ops[6]);
        assert_eq!(
            (m.reply.clone(), names(&m.queues), m.hdr_len),
            (Some(b("rq.2")), vec![&b"workers"[..]], Some(12))
        );
        let m = msg(&ops[7]);
        assert_eq!(m.origin, Some(b("leafc")));
        assert_eq!(
            (m.reply.clone(), names(&m.queues), m.hdr_len),
            (Some(b("rr")), vec![&b"bg"[..]], Some(0))
        );
        assert_eq!(msg(&ops[8]).hdr_len, Some(0));
    }

    #[test]
    fn interest_forms() {
        let (ops, err) = parse(
            b"RS+ $G foo\r\nRS+ $G work workers 2\r\nRS- $G foo\r\nRS- $G work workers\r\n\
              LS+ leafc $G leafq lg 1\r\nLS- leafc $G leafq lg\r\n",
        );
        let sub = |origin: Option<&str>, subject: &str, queue: Option<(&str, u32)>| {
            RouteOp::Sub(RouteSub {
                origin: origin.map(b),
                account: b("$G"),
                subject: b(subject),
                queue: queue.map(|(q, w)| (b(q), w)),
            })
        };
        assert_eq!(ops[0], sub(None, "foo", None));
        assert_eq!(ops[1], sub(None, "work", Some(("workers", 2))));
        assert_eq!(
            ops[2],
            RouteOp::Unsub(RouteUnsub {
                leaf: false,
                origin: None,
                account: b("$G"),
                subject: b("foo"),
                queue: None
            })
        );
        assert_eq!(ops[4], sub(Some("leafc"), "leafq", Some(("lg", 1))));
        // Without lnocu the LS- origin is not expected: four tokens are one too many.
        assert_eq!(ops.len(), 5);
        assert_eq!(
            err,
            Some(RouteParseError::BadArgs("processRemoteUnsub parse error"))
        );
        let mut p = RouteParser::new();
        p.set_unsub_origin(true);
        let (ops, err) = parse_with(&mut p, b"LS- leafc $G leafq lg\r\n");
        assert_eq!(err, None);
        assert_eq!(
            ops,
            vec![RouteOp::Unsub(RouteUnsub {
                leaf: true,
                origin: Some(b("leafc")),
                account: b("$G"),
                subject: b("leafq"),
                queue: Some(b("lg"))
            })]
        );
    }

    #[test]
    fn pinned_account_lines() {
        let (ops, err) = pinned(
            b"RS+ $SYS.REQ.SERVER.PING.ROUTEZ\r\nRS+ q.x grp 3\r\nRS- q.x grp\r\n\
              RMSG $SYS.SERVER.N1.STATSZ 2\r\n{}\r\nHMSG a + r g 0 1\r\nx\r\nLMSG leafc s 0 1\r\ny\r\n",
        );
        assert_eq!(err, None);
        for op in &ops {
            let acc = match op {
                RouteOp::Sub(s) => &s.account,
                RouteOp::Unsub(u) => &u.account,
                RouteOp::Msg(m) => &m.account,
                _ => unreachable!(),
            };
            assert_eq!(&acc[..], b"$SYS");
        }
        assert_eq!(ops.len(), 6);
        let m = msg(&ops[5]);
        assert_eq!(
            (m.origin.clone(), &m.subject[..]),
            (Some(b("leafc")), &b"s"[..])
        );
        // An account token on a pinned route is one argument too many.
        assert_eq!(
            pinned(b"RS+ $G foo\r\n").1,
            Some(RouteParseError::BadArgs("processRemoteSub Parse Error"))
        );
    }

    #[test]
    fn control_ops() {
        let (ops, err) = parse(
            b"INFO {\"server_id\":\"N\"} \r\nINFO {}\r\nCONNECT{\"a\":1}\r\nPING\r\npong\r\n+OK\r\n\
              PINGextra\n-ERR 'Stale Connection'\r\n",
        );
        assert_eq!(err, None);
        assert_eq!(
            ops,
            vec![
                RouteOp::Info(b("{\"server_id\":\"N\"}")),
                RouteOp::Info(b("{}")),
                RouteOp::Connect(b("{\"a\":1}")),
                RouteOp::Ping,
                RouteOp::Pong,
                RouteOp::Ok,
                RouteOp::Ping,
                RouteOp::Err(b("'Stale Connection'")),
            ]
        );
    }

    #[test]
    fn errors_match_reference() {
        use RouteParseError::*;
        for bad in [
            &b"FOO bar\r\n"[..],
            b"\r\n",
            b"RS+\r\n",
            b"RS+x $G foo\r\n",
            b"MSG foo 1 1\r\n",
            b"-ERR\r\n",
            b"AU x\r\n",
            b"HRMSG $G foo 1 1\r\n",
            b"PIN\r\n",
        ] {
            assert_eq!(
                parse(bad).1,
                Some(UnknownOp),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(parse(b"RMSG $G foo 3\r\nhello\r\n").1, Some(UnknownOp));
        assert_eq!(
            parse(b"RMSG $G foo x g 1\r\n").1,
            Some(BadArgs(
                "processRoutedMsgArgs Bad or Missing Reply Indicator"
            ))
        );
        assert_eq!(
            parse(b"RMSG $G foo\r\n").1,
            Some(BadArgs("processRoutedMsgArgs Parse Error"))
        );
        assert_eq!(
            parse(b"RMSG $G foo 1234567890\r\n").1,
            Some(BadArgs("processRoutedMsgArgs Bad or Missing Size"))
        );
        assert_eq!(
            parse(b"HMSG $G foo 10 5\r\n").1,
            Some(BadArgs(
                "processRoutedHeaderMsgArgs Header Size larger then TotalSize"
            ))
        );
        assert_eq!(
            parse(b"HMSG $G foo x 5\r\n").1,
            Some(BadArgs(
                "processRoutedHeaderMsgArgs Bad or Missing Header Size"
            ))
        );
        assert_eq!(
            parse(b"LMSG leafc $G foo 1\r\n").1,
            Some(BadArgs("processRoutedOriginClusterMsgArgs Parse Error"))
        );
        assert_eq!(
            parse(b"RS+ $G foo q\r\n").1,
            Some(BadArgs("processRemoteSub Parse Error"))
        );
        assert_eq!(
            parse(b"RS+ \r\n").1,
            Some(BadArgs("processRemoteSub Parse Error"))
        );
        let mut long = b"RS+ $G ".to_vec();
        long.extend(std::iter::repeat_n(b'a', ROUTE_MAX_CONTROL_LINE));
        assert_eq!(parse(&long).1, Some(MaxControlLine));
        long.extend(b"\r\n");
        assert_eq!(parse(&long).1, Some(MaxControlLine));
        let mut p = RouteParser::new().with_max_payload(4);
        assert_eq!(parse_with(&mut p, b"RMSG $G foo 5\r\n").1, Some(MaxPayload));
        assert_eq!(UnknownOp.err_text(), Some("Unknown Protocol Operation"));
        assert_eq!(BadArgs("x").err_text(), None);
    }

    #[test]
    fn long_arguments_within_the_route_limit() {
        // 10 KiB of queue names: far over a client's 4 KiB, fine on a route.
        let mut line = b"RMSG $G foo |".to_vec();
        for i in 0..1000 {
            line.extend(format!(" q{i:05}").as_bytes());
        }
        line.extend(b" 1\r\nx\r\n");
        let (ops, err) = parse(&line);
        assert_eq!(err, None);
        let m = msg(&ops[0]);
        assert_eq!(m.queues.count(), 1000);
        assert_eq!(m.queues.iter().last(), Some(&b"q00999"[..]));
        assert!(m.queues.contains(b"q00500"));
    }

    #[test]
    fn auth_violation_before_connect() {
        let mut p = RouteParser::new();
        p.expect_connect();
        // Found on the first byte, without waiting for the line.
        assert_eq!(
            parse_with(&mut p, b"P").1,
            Some(RouteParseError::AuthViolation)
        );
        let mut p = RouteParser::new();
        p.expect_connect();
        let (ops, err) = parse_with(&mut p, b"CONNECT {}\r\nPING\r\n");
        assert_eq!((ops.len(), err), (2, None));
    }

    #[test]
    fn client_ops_on_a_route_as_the_reference() {
        // Unpinned: SUB ignored, PUB dropped (payload skipped), UNSUB is RS-.
        let (ops, err) = parse(b"SUB foo 1\r\nPUB foo 2\r\nab\r\nA+ x\r\nUNSUB $G foo\r\nPING\r\n");
        assert_eq!(err, None);
        assert_eq!(ops.len(), 2);
        assert!(matches!(&ops[0], RouteOp::Unsub(u) if &u.subject[..] == b"foo" && !u.leaf));
        // Pinned: PUB is a message of the pinned account.
        let (ops, err) = pinned(b"HPUB foo r 12 12\r\nNATS/1.0\r\n\r\n\r\n");
        assert_eq!(err, None);
        let m = msg(&ops[0]);
        assert_eq!(
            (&m.account[..], m.reply.clone(), m.hdr_len),
            (&b"$SYS"[..], Some(b("r")), Some(12))
        );
    }

    #[test]
    fn no_field_holds_a_carriage_return() {
        // Found by the fuzzer: a PUB token with a CR inside could not be written back on a
        // route line, where CR separates.
        assert_eq!(
            pinned(b"PUB a x\ry 1\r\nz\r\n").1,
            Some(RouteParseError::BadArgs("processPub Parse Error"))
        );
        let (ops, err) = parse(b"RMSG $G a\rb 1\r\nz\r\n");
        assert_eq!(err, None);
        assert_eq!(
            (&msg(&ops[0]).subject[..], msg(&ops[0]).reply.clone()),
            (&b"a"[..], Some(b("b")))
        );
    }

    #[test]
    fn payload_waits_without_rescan() {
        let mut p = RouteParser::new();
        let mut buf = BytesMut::from(&b"RMSG $G foo 10\r\n01234"[..]);
        assert_eq!(p.next(&mut buf), Ok(None));
        assert_eq!(p.wanted(), 12);
        assert_eq!(&buf[..], b"01234");
        buf.extend_from_slice(b"56789\r\n");
        let op = p.next(&mut buf).unwrap().unwrap();
        assert_eq!(&msg(&op).data[..], b"0123456789");
        assert!(buf.is_empty());
    }
}
