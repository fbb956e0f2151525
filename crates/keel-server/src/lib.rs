//! keel-server: a message server that speaks the NATS client protocol.
//!
//! The library holds everything but `main`: options and the nats-server config format
//! (`config`, `conf`), the subject index (`sublist`), one task pair per connection
//! (`client`), the shared server state and listener (`server`), monitoring HTTP
//! (`monitor`) and logging in the reference's format (`log`). Messages flow one way:
//! socket -> keel-protocol parser -> sublist match -> subscribers' outbound buffers -> sockets.

pub mod client;
pub mod conf;
pub mod config;
pub mod jetstream;
pub mod log;
pub mod monitor;
pub mod router;
pub mod server;
pub mod sublist;
pub mod time;
