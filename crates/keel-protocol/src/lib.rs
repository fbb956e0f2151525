//! The NATS wire codec, with no I/O and no async.
//!
//! [`Parser`] turns the bytes a client sends into [`ClientOp`]s incrementally: a read may end
//! anywhere (mid control line, mid payload) and may hold many ops. Subjects, reply subjects,
//! sids and payloads come out as [`bytes::Bytes`] slices of the read buffer, so routing a
//! message copies nothing until it is written into a subscriber's outbound buffer. The
//! `encode` module writes server ops (MSG, HMSG, INFO, -ERR, ...) into a `BytesMut`, and
//! `subject` validates subjects the way the reference server does.

pub mod encode;
mod parser;
pub mod subject;

pub use parser::{ClientOp, ParseError, Parser, MAX_CONTROL_LINE};
