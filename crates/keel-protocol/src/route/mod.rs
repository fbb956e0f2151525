//! The route (cluster) protocol nats-server 2.15 speaks between servers: a parser for what a
//! route peer sends, encoders for what Keel sends, and the route `INFO`/`CONNECT` JSON.
//!
//! Ops on a route: `INFO`, `CONNECT`, `PING`, `PONG`, `+OK`, `-ERR`, interest (`RS+`, `RS-`,
//! and `LS+`/`LS-` for interest that came from a leaf node of a known origin cluster) and
//! messages (`RMSG`, `HMSG` when there are headers, `LMSG` from a leaf; there is no `HRMSG`).
//!
//! Two things about a connection change how its lines read, and the server tells the parser
//! about both as it learns them (the reference keeps the same two flags per route):
//! * a **pinned-account** connection (the `$SYS` route, and accounts listed in
//!   `cluster { accounts }`) leaves the account token out of every line, both ways. The parser
//!   puts the pinned account back, so every op carries its account
//!   ([`RouteParser::set_pinned_account`]).
//! * `LS-` carries the origin cluster only when the peer announced `lnocu` in its INFO
//!   ([`RouteParser::set_unsub_origin`]).
//!
//! Like the client parser, byte fields are [`bytes::Bytes`] slices of the read buffer and a
//! payload split across reads is waited for, not rescanned.

pub mod encode;
mod json;
mod parser;

pub use json::{write_go_json, Error as JsonError, RouteConnect, RouteInfo, SubjectPermission};
pub use parser::{
    Queues, RouteMsg, RouteOp, RouteParseError, RouteParser, RouteSub, RouteUnsub,
    ROUTE_MAX_CONTROL_LINE, ROUTE_MAX_SIZE,
};
