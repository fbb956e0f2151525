//! `/raftz` (and `$SYS.REQ.SERVER.*.RAFTZ`): the Raft groups this server is in, as the
//! reference's endpoint shows them, by account then group. By default the system account's
//! (the meta group, `_meta_`); `acc=<name>` an account's streams' groups (which carry their
//! consumers: no consumer has a group of its own here); `group=<name>` one group; `{}` when
//! they match none.
//!
//! From openraft's metrics and the group's log. `committed` is the log's committed entry;
//! `ipq_*` are 0 (Keel has no such queues: openraft's are internal); `wal` counts entries
//! (not bytes or times, which the log does not keep).

use serde_json::{json, Map, Value};

use super::query::Query;
use super::Ctx;
use crate::jetstream::raft::{self, log::LogStats, NodeId, Peer, RaftHost};

/// The groups (`{}` when the filters match none, as the reference answers), or the status
/// and text of the reference's refusal: 404 when there are no groups here, or no account
/// to show (no `acc` and no system account).
pub fn raftz(ctx: &Ctx, q: &Query) -> Result<Value, (u16, &'static str)> {
    let s = &ctx.server;
    let Some(jss) = s.jetstream_enabled().filter(|j| j.meta.get().is_some()) else {
        return Err((404, "No Raft nodes registered"));
    };
    let system = s.accounts.system_name().to_string();
    let acc = match q.str("acc") {
        "" if system.is_empty() => {
            return Err((404, "No Raft nodes returned, check supplied filters"))
        }
        "" => system.clone(),
        a => a.to_string(),
    };
    let group = q.str("group");
    let wanted = |g: &str| group.is_empty() || group == g;
    let mut groups = Map::new();
    if let Some(meta) = jss.meta.get().filter(|_| acc == system && wanted("_meta_")) {
        let m = meta.raft().metrics().borrow().clone();
        let since = meta.leader_since();
        groups.insert(
            "_meta_".into(),
            describe(&m, &meta.host, Some(meta.log_stats()), since, &system),
        );
    }
    for js in jss.all().iter().filter(|js| js.account.name == acc) {
        for st in js.streams() {
            let (Some(spec), Some(r)) = (st.group.as_ref(), st.replica.get()) else {
                continue;
            };
            let (Some(raft), Some(host)) = (r.raft.get(), r.host()) else {
                continue;
            };
            if !wanted(&spec.group) {
                continue;
            }
            let m = raft.metrics().borrow().clone();
            let since = r.leader_since.load(std::sync::atomic::Ordering::Relaxed);
            groups.insert(
                spec.group.clone(),
                describe(&m, &host, r.log_stats(), since, &system),
            );
        }
    }
    let mut out = Map::new();
    if !groups.is_empty() {
        out.insert(acc, Value::Object(groups));
    }
    Ok(Value::Object(out))
}

/// One group as this server sees it.
fn describe(
    m: &openraft::RaftMetrics<NodeId, Peer>,
    host: &RaftHost,
    log: Option<LogStats>,
    leader_since: i64,
    system: &str,
) -> Value {
    use openraft::ServerState;
    let name = |id: NodeId| raft::member_name(m, id).map(|n| raft::peer_hash(&n));
    let voters = m.membership_config.membership().voter_ids().count();
    let state = match m.state {
        ServerState::Leader => "LEADER",
        ServerState::Candidate => "CANDIDATE",
        ServerState::Shutdown => "CLOSED",
        ServerState::Follower | ServerState::Learner => "FOLLOWER",
    };
    let leader = raft::leader_id(m);
    let log = log.unwrap_or_default();
    let applied = m.last_applied.map_or(0, |l| l.index);
    let mut g = Map::new();
    g.insert("id".into(), raft::peer_hash(&host.name).into());
    g.insert("state".into(), state.into());
    g.insert("size".into(), voters.into());
    g.insert("quorum_needed".into(), (voters / 2 + 1).into());
    if m.state == ServerState::Learner {
        g.insert("observer".into(), true.into());
    }
    g.insert("committed".into(), log.committed.max(applied).into());
    g.insert("applied".into(), applied.into());
    if let Some(l) = leader.and_then(name) {
        g.insert("leader".into(), l.into());
    }
    if leader == Some(m.id) && leader_since > 0 {
        g.insert(
            "leader_since".into(),
            crate::time::rfc3339(leader_since).into(),
        );
    }
    g.insert(
        "ever_had_leader".into(),
        (m.current_leader.is_some() || m.last_applied.is_some()).into(),
    );
    g.insert("term".into(), m.current_term.into());
    if let Some(v) = m.vote.leader_id().voted_for().and_then(name) {
        g.insert("voted_for".into(), v.into());
    }
    g.insert(
        "pterm".into(),
        m.last_applied.map_or(0, |l| l.leader_id.term).into(),
    );
    g.insert("pindex".into(), m.last_log_index.unwrap_or(0).into());
    g.insert("system_account".into(), true.into());
    g.insert("traffic_account".into(), system.into());
    for q in [
        "ipq_proposal_len",
        "ipq_entry_len",
        "ipq_resp_len",
        "ipq_apply_len",
    ] {
        g.insert(q.into(), 0.into());
    }
    g.insert(
        "wal".into(),
        json!({
            "messages": log.entries,
            "bytes": 0,
            "first_seq": log.first,
            "first_ts": crate::time::rfc3339(0),
            "last_seq": log.last,
            "last_ts": crate::time::rfc3339(0),
            "consumer_count": 0,
        }),
    );
    let mut peers = Map::new();
    for (id, p) in m.membership_config.nodes() {
        if *id == m.id {
            continue;
        }
        let mut peer = Map::new();
        peer.insert("name".into(), p.name.clone().into());
        peer.insert("known".into(), true.into());
        let matched = m
            .replication
            .as_ref()
            .and_then(|r| r.get(id).cloned())
            .flatten()
            .map(|l| l.index)
            .filter(|i| *i > 0);
        if let Some(i) = matched {
            peer.insert("last_replicated_index".into(), i.into());
        }
        if let Some(d) = host.since_heard(&p.name) {
            peer.insert(
                "last_seen".into(),
                crate::time::go_duration(d.as_nanos() as i64).into(),
            );
        }
        peers.insert(raft::peer_hash(&p.name), Value::Object(peer));
    }
    g.insert("peers".into(), Value::Object(peers));
    Value::Object(g)
}
