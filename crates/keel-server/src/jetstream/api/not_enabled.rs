//! The API of an account without JetStream on a server with it: the reference answers its
//! requests with 10039 ("JetStream not enabled for account") rather than leaving the
//! client to time out or read "no responders" as a JetStream that is not there.
//! - An account's: each request the API knows gets the error in that request's response
//!   type; a pull or a direct get gets the "no responders" status, as there is no stream to
//!   answer it; any other subject gets nothing.
//! - The system account's: every request, as `system_response` (`account_info_response`
//!   for `INFO`), but for the meta, server and account requests it serves itself.

use std::sync::Arc;

use bytes::Bytes;
use keel_protocol::encode;

use super::errors::ErrorKind;
use crate::account::Account;
use crate::client::{ClientHandle, InMsg};
use crate::router::Router;
use crate::server::Server;

/// Subscribes `account`'s `$JS.API.>` on this server only (each server answers its own
/// clients, once) and answers from a task of its own.
pub fn serve(server: &Arc<Server>, account: &Arc<Account>) {
    let (handle, mut rx) = ClientHandle::internal(
        server,
        account,
        "JetStream API (not enabled)".into(),
        64 * 1024,
    );
    account.sublist.insert(crate::sublist::Sub::internal(
        &handle,
        Bytes::from_static(b"api"),
        Bytes::from_static(b"$JS.API.>"),
    ));
    let system = server
        .accounts
        .system_account()
        .is_some_and(|s| Arc::ptr_eq(s, account));
    let account = account.clone();
    let weak = Arc::downgrade(server);
    server.spawn(async move {
        let mut router = Router::new(account, 0x4e45);
        let mut batch = Vec::new();
        while rx.recv_many(&mut batch, 256, 1024 * 1024).await > 0 {
            let Some(server) = weak.upgrade() else {
                return;
            };
            for m in batch.drain(..) {
                answer(&server, &mut router, &m, system);
            }
            router.flush();
        }
    });
}

fn answer(server: &Server, router: &mut Router, m: &InMsg, system: bool) {
    let (Some(reply), Ok(subject)) = (m.reply.as_ref(), std::str::from_utf8(&m.subject)) else {
        return;
    };
    let Some(rest) = subject.strip_prefix("$JS.API.") else {
        return;
    };
    let tokens: Vec<&str> = rest.split('.').collect();
    let e = ErrorKind::NotEnabledForAccount.err();
    if system {
        if matches!(tokens[0], "META" | "SERVER" | "ACCOUNT") {
            return;
        }
        let kind = if tokens == ["INFO"] {
            "account_info"
        } else {
            "system"
        };
        super::reply(server, router, reply, super::error_body_for(kind, &e));
        return;
    }
    match kind_of(&tokens) {
        Some(kind) => super::reply(server, router, reply, super::error_body_for(kind, &e)),
        None if matches!(tokens.as_slice(), ["CONSUMER", "MSG", "NEXT", _, _])
            || matches!(tokens.as_slice(), ["DIRECT", "GET", _, ..]) =>
        {
            let hdr = encode::status_headers("503", &[("Nats-Subject", subject.as_bytes())]);
            super::reply_headers(server, router, reply, hdr.to_vec(), b"");
        }
        None => {}
    }
}

/// The kind (`<kind>_response`) of an API request the reference knows, by the subject's
/// tokens after `$JS.API.`.
fn kind_of(tokens: &[&str]) -> Option<&'static str> {
    Some(match tokens {
        ["INFO"] => "account_info",
        ["STREAM", "CREATE", _] => "stream_create",
        ["STREAM", "UPDATE", _] => "stream_update",
        ["STREAM", "INFO", _] => "stream_info",
        ["STREAM", "NAMES"] => "stream_names",
        ["STREAM", "LIST"] => "stream_list",
        ["STREAM", "DELETE", _] => "stream_delete",
        ["STREAM", "PURGE", _] => "stream_purge",
        ["STREAM", "SNAPSHOT", _] => "stream_snapshot",
        ["STREAM", "RESTORE", _] => "stream_restore",
        ["STREAM", "MSG", "GET", _] => "stream_msg_get",
        ["STREAM", "MSG", "DELETE", _] => "stream_msg_delete",
        ["STREAM", "PEER", "REMOVE", _] => "stream_remove_peer",
        ["STREAM", "LEADER", "STEPDOWN", _] => "stream_leader_stepdown",
        ["CONSUMER", "CREATE", _] | ["CONSUMER", "CREATE", _, _, ..] => "consumer_create",
        ["CONSUMER", "DURABLE", "CREATE", _, _] => "consumer_create",
        ["CONSUMER", "INFO", _, _] => "consumer_info",
        ["CONSUMER", "NAMES", _] => "consumer_names",
        ["CONSUMER", "LIST", _] => "consumer_list",
        ["CONSUMER", "DELETE", _, _] => "consumer_delete",
        ["CONSUMER", "PAUSE", _, _] => "consumer_pause",
        ["CONSUMER", "UNPIN", _, _] => "consumer_unpin",
        ["CONSUMER", "LEADER", "STEPDOWN", _, _] => "consumer_leader_stepdown",
        _ => return None,
    })
}
