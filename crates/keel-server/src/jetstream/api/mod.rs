//! The JetStream API (`$JS.API.>`): request decoding, the one error table, and (as the
//! handlers move here) typed requests and responses per area.

pub mod decode;
pub mod errors;

pub use decode::*;
pub use errors::{ApiError, ErrorKind};
