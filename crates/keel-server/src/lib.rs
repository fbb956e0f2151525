//! keel-server: a message server that speaks the NATS client protocol.
//!
//! The library holds everything but `main`: options and the nats-server config format
//! (`config`, `conf`), the subject index (`sublist`), one task pair per connection
//! (`client`), the byte-bounded queues in front of in-process subscribers (`inqueue`),
//! the shared server state and listener (`server`), monitoring HTTP
//! (`monitor`), returning freed memory after bursts (`memtrim`) and logging in the
//! reference's format (`log`). Messages flow one way:
//! socket -> keel-protocol parser -> sublist match -> subscribers' outbound buffers -> sockets.

pub mod client;
pub mod conf;
pub mod config;
pub mod inqueue;
pub mod jetstream;
pub mod log;
pub mod memtrim;
pub mod monitor;
pub mod router;
pub mod server;
pub mod sublist;
pub mod time;
pub mod tls;
