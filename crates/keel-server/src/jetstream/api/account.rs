//! `$JS.API.INFO`: the account's JetStream usage, limits and API counters.

use super::types::{AccountInfo, AccountLimits, ApiStats};
use crate::jetstream::stream::{StorageType, API_LEVEL};
use crate::jetstream::JetStream;

/// What this server holds of the account: memory and file bytes of its replicas, and the
/// consumers of the streams it leads (a stream's consumers run where it leads).
pub fn local_usage(js: &JetStream) -> (u64, u64, usize) {
    let (memory, storage) = js.usage();
    let consumers = js
        .streams()
        .iter()
        .filter(|s| s.leads())
        .map(|s| s.consumers.len())
        .sum();
    (memory, storage, consumers)
}

pub fn info(js: &JetStream, server: &crate::server::Server) -> AccountInfo {
    let (memory, storage) = js.usage();
    let streams = js.streams();
    let (total, errors) = js.api_stats();
    AccountInfo {
        memory,
        storage,
        reserved_memory: js.reserved(StorageType::Memory, None),
        reserved_storage: js.reserved(StorageType::File, None),
        // In a cluster, every stream of the account (the meta group's assignments); the
        // usage and consumers are this server's.
        streams: server
            .jetstream
            .get()
            .and_then(|j| j.meta.get())
            .and_then(|m| {
                m.machine
                    .state()
                    .streams
                    .get(&js.account.name)
                    .map(|s| s.len())
            })
            .unwrap_or(streams.len()),
        consumers: streams.iter().map(|s| s.consumers.len()).sum(),
        limits: AccountLimits::of(&js.account.jetstream_limits()),
        domain: js.domain.clone(),
        api: ApiStats {
            level: API_LEVEL,
            total,
            errors,
        },
    }
}
