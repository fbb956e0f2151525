//! The monitoring answers behind the system account's requests (`system.rs`):
//! `$SYS.REQ.SERVER.PING.<KIND>` / `$SYS.REQ.SERVER.<id>.<KIND>` answer with the same JSON as
//! the HTTP endpoint of that name, `$SYS.REQ.ACCOUNT.<acc>.<KIND>` with it for one account.
//! A request's JSON options use the reference's option names (`subscriptions`, `account`,
//! ...); they become the endpoint's query parameters.

use serde_json::{json, Value};

use super::query::Query;
use super::{endpoints, jsz, Ctx};

/// The request options as query pairs, with the reference's JSON names mapped to the
/// endpoints' parameter names.
fn query(kind: &str, opts: &Value, account: Option<&str>) -> Query {
    let mut pairs = Vec::new();
    if let Some(m) = opts.as_object() {
        for (k, v) in m {
            let name = match (kind, k.as_str()) {
                (_, "subscriptions") => "subs",
                ("CONNZ", "subscriptions_detail") => {
                    if v.as_bool() == Some(true) {
                        pairs.push(("subs".to_string(), "detail".to_string()));
                    }
                    continue;
                }
                ("JSZ", "account") | ("SUBSZ", "account") | ("ACCOUNTZ", "account") => "acc",
                ("JSZ", "consumer") => "consumers",
                ("JSZ", "leader_only") => "leader-only",
                ("JSZ", "stream_leader_only") => "stream-leader-only",
                ("RAFTZ", "account") => "acc",
                ("ACCOUNTZ", "include_unused") => "unused",
                ("STATZ", "include_unused") => "unused",
                ("STATZ", "accounts") => continue,
                // The reference's JSON carries ConnState as a number (0 open, 1 closed,
                // 2 all); the endpoint's parameter is its name.
                ("CONNZ", "state") if v.is_number() => {
                    let name = match v.as_u64() {
                        Some(1) => "closed",
                        Some(2) => "all",
                        _ => "open",
                    };
                    pairs.push(("state".to_string(), name.to_string()));
                    continue;
                }
                (_, "server_name" | "cluster" | "host" | "tags" | "domain") => continue,
                (_, k) => k,
            };
            let text = match v {
                Value::String(s) => s.clone(),
                Value::Bool(b) => b.to_string(),
                Value::Number(n) => n.to_string(),
                Value::Null => continue,
                other => other.to_string(),
            };
            pairs.push((name.to_string(), text));
        }
    }
    if let Some(a) = account {
        pairs.retain(|(k, _)| k != "acc");
        pairs.push(("acc".to_string(), a.to_string()));
    }
    Query::from_pairs(pairs)
}

/// `$SYS.REQ.SERVER.*.<kind>`: the endpoint's JSON, or an error text.
pub(crate) fn server(ctx: &Ctx, kind: &str, opts: &Value) -> Option<Result<Value, String>> {
    let q = query(kind, opts, None);
    Some(match kind {
        "VARZ" => endpoints::varz(ctx, &q),
        "CONNZ" => endpoints::connz(ctx, &q),
        "SUBSZ" => endpoints::subsz(ctx, &q),
        "ROUTEZ" => endpoints::routez(ctx, &q),
        "GATEWAYZ" => endpoints::gatewayz(ctx, &q),
        "LEAFZ" => endpoints::leafz(ctx, &q),
        "ACCOUNTZ" => endpoints::accountz(ctx, &q),
        "JSZ" => match jsz::jsz(ctx, &q) {
            // Only the meta leader answers a `leader_only` request.
            Err(e) if e == jsz::NOT_LEADER => return None,
            r => r,
        },
        "HEALTHZ" => Ok(healthz(ctx, opts)),
        // (No account to show: no data, and no error, as the reference answers.)
        "RAFTZ" => Ok(super::raftz::raftz(ctx, &q).unwrap_or(Value::Null)),
        _ => return None,
    })
}

/// `$SYS.REQ.ACCOUNT.<acc>.<kind>` (not CONNS, which is an event; not INFO's wrapper).
pub(crate) fn account(
    ctx: &Ctx,
    acc: &str,
    kind: &str,
    opts: &Value,
) -> Option<Result<Value, String>> {
    let q = query(kind, opts, Some(acc));
    let s = &ctx.server;
    Some(match kind {
        "INFO" => endpoints::account_detail(s, acc),
        "CONNZ" => endpoints::connz(ctx, &q),
        "SUBSZ" => {
            let mut pairs = vec![("subs".to_string(), "true".to_string())];
            pairs.push(("acc".to_string(), acc.to_string()));
            endpoints::subsz(ctx, &Query::from_pairs(pairs))
        }
        "LEAFZ" => endpoints::leafz(ctx, &q),
        "STATZ" => {
            let list: Vec<Value> = s
                .accounts
                .get(acc)
                .map(|a| endpoints::account_statz(s, &a))
                .into_iter()
                .collect();
            Ok(json!({
                "server_id": s.server_id,
                "now": crate::time::rfc3339(crate::time::now_nanos()),
                "account_statz": list,
            }))
        }
        "JSZ" => account_jsz(ctx, acc),
        _ => return None,
    })
}

/// `$SYS.REQ.ACCOUNT.<acc>.JSZ`: the account's JetStream detail.
fn account_jsz(ctx: &Ctx, acc: &str) -> Result<Value, String> {
    let q = Query::from_pairs(vec![("acc".to_string(), acc.to_string())]);
    let all = jsz::jsz(ctx, &q)?;
    Ok(all
        .get("account_details")
        .and_then(|d| d.get(0))
        .cloned()
        .unwrap_or_else(|| {
            json!({
                "name": acc, "id": acc, "memory": 0, "storage": 0,
                "reserved_memory": 0, "reserved_storage": 0, "accounts": 0,
                "ha_assets": 0, "api": {"level": 0, "total": 0, "errors": 0},
            })
        }))
}

/// The health probe as a request answers it: `status` and `status_code`.
fn healthz(ctx: &Ctx, opts: &Value) -> Value {
    let flag = |k: &str| opts.get(k).and_then(Value::as_bool).unwrap_or(false);
    let text = |k: &str| opts.get(k).and_then(Value::as_str).unwrap_or("");
    let probe = endpoints::Probe {
        js_enabled_only: flag("js-enabled-only") || flag("js-enabled"),
        js_server_only: flag("js-server-only"),
        account: text("account"),
        stream: text("stream"),
        consumer: text("consumer"),
    };
    match endpoints::health(&ctx.server, &probe) {
        Ok(()) => json!({"status": "ok", "status_code": 200}),
        Err(e) => json!({"status": "error", "status_code": e.status, "error": e.text}),
    }
}

/// The `statsz` of `$SYS.REQ.SERVER.PING` (and `.STATSZ`), from `/varz`'s figures.
pub(crate) fn statsz(ctx: &Ctx) -> Value {
    let v = endpoints::varz(ctx, &Query::default()).unwrap_or_default();
    let s = &ctx.server;
    let active = s
        .accounts
        .all()
        .iter()
        .filter(|a| a.conns.load(std::sync::atomic::Ordering::Relaxed) > 0)
        .count();
    let sent = json!({"msgs": v["out_msgs"], "bytes": v["out_bytes"]});
    let received = json!({"msgs": v["in_msgs"], "bytes": v["in_bytes"]});
    let mut out = json!({
        "start": v["start"],
        "mem": v["mem"],
        "cores": v["cores"],
        "cpu": v["cpu"],
        "connections": v["connections"],
        "total_connections": v["total_connections"],
        "active_accounts": active,
        "subscriptions": v["subscriptions"],
        "sent": sent,
        "sent_to_clients": sent,
        "received": received,
        "received_from_clients": received,
        "slow_consumers": v["slow_consumers"],
    });
    // The reference's per-route numbers, from the same figures as `/routez`.
    if s.cluster.get().is_some_and(|c| c.num_peers() > 0) {
        let rz = endpoints::routez(ctx, &Query::default()).unwrap_or_default();
        let routes: Vec<Value> = rz["routes"]
            .as_array()
            .map(|rs| {
                rs.iter()
                    .map(|r| {
                        json!({
                            "rid": r["rid"],
                            "name": r["remote_name"],
                            "sent": {"msgs": r["out_msgs"], "bytes": r["out_bytes"]},
                            "received": {"msgs": r["in_msgs"], "bytes": r["in_bytes"]},
                            "pending": r["pending_size"],
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        out["routes"] = Value::Array(routes);
    }
    // After the routes, in the reference's order.
    out["active_servers"] = (1 + s.cluster.get().map_or(0, |c| c.num_peers())).into();
    if let Some(js) = v.get("jetstream").filter(|j| j.get("config").is_some()) {
        let mut js = js.clone();
        if let Some(c) = js.get_mut("config").and_then(Value::as_object_mut) {
            c.shift_remove("store_dir");
        }
        out["jetstream"] = js;
    }
    out["gomaxprocs"] = v["gomaxprocs"].clone();
    out
}
