//! keel-server: a message server that speaks the NATS client protocol.
//!
//! The library holds everything but `main`: options and the nats-server config format
//! (`config`, `conf`), authentication (`auth`), accounts and their subject indexes (`account`,
//! `sublist`), the permission rules (`permissions`), the system account's services
//! (`system`), one task pair per connection (`client`), the
//! byte-bounded queues in front of in-process subscribers (`inqueue`), the shared server
//! state and listener (`server`), starting and stopping a whole server (`launch`, also
//! used by the in-process test servers of `harness`), monitoring HTTP (`monitor`),
//! returning freed memory after bursts (`memtrim`) and logging in the reference's format
//! (`log`, a handle per server). There are no process globals: servers in one process
//! share nothing. Messages flow one way:
//! socket -> keel-protocol parser -> account's sublist match -> subscribers' outbound
//! buffers -> sockets.

pub mod account;
pub mod auth;
pub mod client;
pub mod conf;
pub mod config;
pub mod harness;
pub mod inqueue;
pub mod jetstream;
pub mod launch;
pub mod log;
pub mod memtrim;
pub mod monitor;
pub mod permissions;
pub mod router;
pub mod server;
pub mod sublist;
pub mod system;
pub mod time;
pub mod tls;
