//! The live dashboard (`/dashboard`, on unless `http_dashboard: false`): one HTML page, its
//! script and style sheet embedded in the binary (no CDN, works offline), polling one
//! compact JSON document, `/dashboard/data`.
//!
//! # What the server keeps
//!
//! A sampler task takes a sample every [`SAMPLE_EVERY`] of the server's counters and of each
//! stream's and consumer's figures, and keeps the last [`SAMPLES`] (10 minutes) in rings for
//! the sparklines. Memory is bounded: at most [`MAX_STREAMS`] streams and [`MAX_CONSUMERS`]
//! consumers are tracked (in name order; the rest are listed without history), each sample
//! is a few integers, and objects that disappear are dropped at the next sample. A sample
//! reads each stream's and consumer's numbers under its own lock, one at a time, like a
//! scrape.
//!
//! # What a page refresh costs
//!
//! The page and its assets are static and answered `304 Not Modified` when the browser
//! already has them (ETag). `/dashboard/data` reads the current figures the same way the
//! sampler does (no configuration JSON, no pretty-printing) and sends the history only
//! since the sample the page already has (`?since=<seq>`), so a poll costs less than a
//! `/jsz?consumers=true` of the same streams and consumers; `bench/dashboard_cost.py`
//! measures both.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::endpoints::ConnRow;
use super::query::Query;
use super::{jsz, proc, Ctx};
use crate::jetstream::stream::StorageType;
use crate::server::Server;
use crate::time::now_nanos;

pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
pub const SAMPLES: usize = 120;
pub const MAX_STREAMS: usize = 256;
pub const MAX_CONSUMERS: usize = 1024;
/// Rows of the live tables: more would make the page heavy to build and to read.
const MAX_LISTED_CONSUMERS: usize = 1000;
const MAX_LISTED_CONNECTIONS: usize = 20;

pub const INDEX_HTML: &str = include_str!("dashboard/index.html");
pub const APP_JS: &str = include_str!("dashboard/app.js");
pub const APP_CSS: &str = include_str!("dashboard/app.css");

/// One object's samples: values of consecutive samples, the first taken at sample `from`.
struct Series<const N: usize> {
    from: u64,
    values: VecDeque<[u64; N]>,
}

impl<const N: usize> Series<N> {
    fn new(from: u64) -> Self {
        Series {
            from,
            values: VecDeque::new(),
        }
    }

    fn push(&mut self, seq: u64, v: [u64; N]) {
        if self.values.is_empty() {
            self.from = seq;
        }
        self.values.push_back(v);
        if self.values.len() > SAMPLES {
            self.values.pop_front();
            self.from += 1;
        }
    }

    /// `{"from": seq, "v": [[..], ..]}` with the samples after `since`.
    fn json_since(&self, since: u64) -> Value {
        let skip = since.saturating_sub(self.from.saturating_sub(1)) as usize;
        let from = self.from + skip as u64;
        let v: Vec<Value> = self
            .values
            .iter()
            .skip(skip)
            .map(|s| Value::from(s.to_vec()))
            .collect();
        json!({"from": from, "v": v})
    }
}

/// Server: in_msgs, out_msgs, in_bytes, out_bytes, connections, resident memory.
type ServerSample = [u64; 6];
/// Stream: messages, bytes, last sequence.
type StreamSample = [u64; 3];
/// Consumer: num_pending, num_ack_pending, num_redelivered, delivered stream sequence.
type ConsumerSample = [u64; 4];

/// The sparkline history.
pub struct History {
    /// Samples taken so far; the newest has this number.
    seq: u64,
    /// Unix milliseconds of the retained samples, oldest first.
    times: VecDeque<i64>,
    server: Series<6>,
    streams: BTreeMap<String, Series<3>>,
    consumers: BTreeMap<(String, String), Series<4>>,
}

impl Default for History {
    fn default() -> Self {
        History {
            seq: 0,
            times: VecDeque::new(),
            server: Series::new(1),
            streams: BTreeMap::new(),
            consumers: BTreeMap::new(),
        }
    }
}

/// One sample's figures, read before the history is locked.
pub struct Taken {
    time_ms: i64,
    server: ServerSample,
    streams: Vec<(String, StreamSample)>,
    consumers: Vec<((String, String), ConsumerSample)>,
}

/// Reads the figures of one sample (each stream's and consumer's lock in turn).
pub fn take(server: &Server) -> Taken {
    let t = server.totals();
    let mut taken = Taken {
        time_ms: now_nanos() / 1_000_000,
        server: [
            t.in_msgs,
            t.out_msgs,
            t.in_bytes,
            t.out_bytes,
            server.num_clients() as u64,
            proc::rss_bytes(),
        ],
        streams: Vec::new(),
        consumers: Vec::new(),
    };
    let Some(js) = server.jetstream_enabled() else {
        return taken;
    };
    for st in js.streams() {
        if taken.streams.len() < MAX_STREAMS {
            let state = st.state();
            taken
                .streams
                .push((st.name.clone(), [state.msgs, state.bytes, state.last_seq]));
        }
        for c in js.consumers_of(&st) {
            if taken.consumers.len() >= MAX_CONSUMERS {
                break;
            }
            let n = c.numbers();
            taken.consumers.push((
                (st.name.clone(), c.name.clone()),
                [
                    n.num_pending,
                    n.num_ack_pending,
                    n.num_redelivered,
                    n.delivered_stream_seq,
                ],
            ));
        }
    }
    taken
}

impl History {
    /// Adds one sample.
    pub fn apply(&mut self, taken: Taken) {
        self.seq += 1;
        let seq = self.seq;
        self.times.push_back(taken.time_ms);
        if self.times.len() > SAMPLES {
            self.times.pop_front();
        }
        self.server.push(seq, taken.server);
        // Gone (or no longer tracked) objects leave the history.
        let streams: std::collections::BTreeSet<&String> =
            taken.streams.iter().map(|(k, _)| k).collect();
        self.streams.retain(|k, _| streams.contains(k));
        let consumers: std::collections::BTreeSet<&(String, String)> =
            taken.consumers.iter().map(|(k, _)| k).collect();
        self.consumers.retain(|k, _| consumers.contains(k));
        for (k, v) in taken.streams {
            self.streams
                .entry(k)
                .or_insert_with(|| Series::new(seq))
                .push(seq, v);
        }
        for (k, v) in taken.consumers {
            self.consumers
                .entry(k)
                .or_insert_with(|| Series::new(seq))
                .push(seq, v);
        }
    }

    fn json_since(&self, since: u64) -> Value {
        let keep = (self.seq.saturating_sub(since) as usize).min(self.times.len());
        let times: Vec<i64> = self
            .times
            .iter()
            .skip(self.times.len() - keep)
            .copied()
            .collect();
        let streams: Map<String, Value> = self
            .streams
            .iter()
            .map(|(k, s)| (k.clone(), s.json_since(since)))
            .collect();
        let consumers: Map<String, Value> = self
            .consumers
            .iter()
            .map(|((st, c), s)| (format!("{st}/{c}"), s.json_since(since)))
            .collect();
        json!({
            "seq": self.seq,
            "every_ms": SAMPLE_EVERY.as_millis() as u64,
            "max": SAMPLES,
            "t": times,
            "server": self.server.json_since(since),
            "streams": streams,
            "consumers": consumers,
        })
    }
}

/// Samples `server` every [`SAMPLE_EVERY`] until it shuts down.
pub async fn sampler(server: Arc<Server>, history: Arc<Mutex<History>>) {
    let mut shutdown = server.shutdown_rx();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = crate::client::until_true(&mut shutdown) => return,
        }
        let (server, history) = (server.clone(), history.clone());
        // Reading many streams and consumers is blocking work, as for a scrape.
        let _ = tokio::task::spawn_blocking(move || {
            let taken = take(&server);
            history
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .apply(taken);
        })
        .await;
    }
}

fn percent(used: u64, limit: i64) -> Value {
    if limit > 0 {
        json!((used as f64 / limit as f64 * 1000.0).round() / 10.0)
    } else {
        Value::Null
    }
}

/// `/dashboard/data`: the current figures and the history after `since`.
pub fn data(ctx: &Ctx, q: &Query) -> Result<Value, String> {
    let since = q.uint("since")?;
    let s = &ctx.server;
    let t = s.totals();
    let started = std::time::Instant::now()
        .checked_sub(
            std::time::SystemTime::now()
                .duration_since(s.start)
                .unwrap_or_default(),
        )
        .unwrap_or_else(std::time::Instant::now);
    // CPU and memory as sampled at most once a second (no /proc reads per poll).
    let (cpu, mem) = {
        let mut sampler = ctx.cpu.lock().unwrap_or_else(|e| e.into_inner());
        (sampler.percent(started), sampler.rss())
    };
    let mut server = json!({
        "name": s.server_name,
        "id": s.server_id,
        "version": crate::config::COMPAT_VERSION,
        "keel_version": crate::config::KEEL_VERSION,
        "uptime": proc::uptime(std::time::SystemTime::now().duration_since(s.start).unwrap_or_default()),
        "connections": s.num_clients(),
        "total_connections": s.total_connections(),
        "subscriptions": s.accounts.subscriptions(),
        "mem": mem,
        "cpu": cpu,
        "cores": proc::cores(),
        "in_msgs": t.in_msgs,
        "out_msgs": t.out_msgs,
        "in_bytes": t.in_bytes,
        "out_bytes": t.out_bytes,
        "slow_consumers": s.accounts.slow_consumers(),
    });

    let mut streams = Vec::new();
    let mut consumers = Vec::new();
    let mut consumers_total = 0usize;
    if let Some(js) = s.jetstream_enabled() {
        let (api_total, api_errors) = js.api_stats();
        let (mut mem, mut file) = (0u64, 0u64);
        for st in js.streams() {
            let state = st.state();
            let cfg = st.config();
            let list = js.consumers_of(&st);
            match cfg.storage {
                StorageType::Memory => mem += state.bytes,
                StorageType::File => file += state.bytes,
            }
            streams.push(json!({
                "name": st.name,
                "storage": if cfg.storage == StorageType::File { "file" } else { "memory" },
                "messages": state.msgs,
                "bytes": state.bytes,
                "first_seq": state.first_seq,
                "last_seq": state.last_seq,
                "subjects": cfg.subjects,
                "consumers": list.len(),
                "max_msgs": cfg.max_msgs,
                "max_bytes": cfg.max_bytes,
                "max_age_ns": cfg.max_age,
                "msgs_used": percent(state.msgs, cfg.max_msgs),
                "bytes_used": percent(state.bytes, cfg.max_bytes),
            }));
            consumers_total += list.len();
            for c in list {
                let n = c.numbers();
                consumers.push((
                    n.num_pending,
                    json!({
                        "stream": st.name,
                        "name": c.name,
                        "pull": n.pull,
                        "num_pending": n.num_pending,
                        "num_ack_pending": n.num_ack_pending,
                        "max_ack_pending": n.max_ack_pending,
                        "num_redelivered": n.num_redelivered,
                        "num_waiting": n.num_waiting,
                        "max_waiting": n.max_waiting,
                        "delivered": n.delivered_stream_seq,
                        "ack_floor": n.ack_floor_stream_seq,
                        "last_delivery_ms": n.last_delivery / 1_000_000,
                        "last_ack_ms": n.last_ack / 1_000_000,
                    }),
                ));
            }
        }
        server["jetstream"] = json!({
            "memory": mem,
            "storage": file,
            "max_memory": js.first().max_memory,
            "max_storage": js.first().max_store,
            "memory_used": percent(mem, js.first().max_memory),
            "storage_used": percent(file, js.first().max_store),
            "api_total": api_total,
            "api_errors": api_errors,
            "api_level": jsz::api_level(),
        });
    }
    // The biggest backlogs first: those are the ones to look at.
    consumers.sort_by_key(|c| std::cmp::Reverse(c.0));
    let consumers: Vec<Value> = consumers
        .into_iter()
        .take(MAX_LISTED_CONSUMERS)
        .map(|(_, v)| v)
        .collect();

    let mut rows: Vec<ConnRow> = s.clients().iter().map(|h| ConnRow::of(h, false)).collect();
    rows.sort_by(|a, b| {
        (b.pending, b.out_msgs + b.in_msgs).cmp(&(a.pending, a.out_msgs + a.in_msgs))
    });
    let connections: Vec<Value> = rows
        .iter()
        .take(MAX_LISTED_CONNECTIONS)
        .map(|r| {
            json!({
                "cid": r.cid, "name": r.name, "lang": r.lang, "ip": r.ip,
                "subs": r.nsubs, "pending": r.pending,
                "in_msgs": r.in_msgs, "out_msgs": r.out_msgs,
                "in_bytes": r.in_bytes, "out_bytes": r.out_bytes,
            })
        })
        .collect();
    let slow: Vec<Value> = s
        .closed
        .newest_slow()
        .iter()
        .map(|c| {
            json!({
                "cid": c.row.cid, "name": c.row.name, "ip": c.row.ip,
                "reason": c.reason, "stop_ms": c.stop / 1_000_000,
                "subs": c.row.nsubs, "out_msgs": c.row.out_msgs,
            })
        })
        .collect();

    let history = ctx
        .history
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .json_since(since);
    Ok(json!({
        "now_ms": now_nanos() / 1_000_000,
        "server": server,
        "streams": streams,
        "consumers": consumers,
        "consumers_total": consumers_total,
        "connections": connections,
        "slow": slow,
        "history": history,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_is_bounded_and_sends_only_new_samples() {
        let mut s: Series<1> = Series::new(1);
        for seq in 1..=(SAMPLES as u64 + 10) {
            s.push(seq, [seq * 10]);
        }
        assert_eq!(s.values.len(), SAMPLES);
        assert_eq!(s.from, 11);
        let all = s.json_since(0);
        assert_eq!(all["from"], 11);
        assert_eq!(all["v"].as_array().unwrap().len(), SAMPLES);
        let recent = s.json_since(SAMPLES as u64 + 8);
        assert_eq!(recent["from"], SAMPLES as u64 + 9);
        assert_eq!(recent["v"], json!([[1290], [1300]]));
        assert_eq!(s.json_since(10_000)["v"], json!([]));
    }

    #[test]
    fn history_tracks_the_server() {
        let server = Server::new(crate::config::Opts::default(), crate::log::Log::stderr());
        let mut h = History::default();
        for _ in 0..3 {
            h.apply(take(&server));
        }
        let v = h.json_since(1);
        assert_eq!(v["seq"], 3);
        assert_eq!(v["t"].as_array().unwrap().len(), 2);
        assert_eq!(v["server"]["from"], 2);
        assert_eq!(v["server"]["v"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn assets_are_self_contained() {
        // No CDN, no remote fonts: everything the page loads is served by us.
        for (name, text) in [("html", INDEX_HTML), ("js", APP_JS), ("css", APP_CSS)] {
            // The SVG namespace is a name, not something fetched.
            let text = text.replace("http://www.w3.org/2000/svg", "");
            assert!(
                !text.contains("http://") && !text.contains("https://"),
                "{name}"
            );
        }
        assert!(INDEX_HTML.contains("app.js") && INDEX_HTML.contains("app.css"));
        // Names from the server are set as text, never parsed as HTML.
        assert!(!APP_JS.contains("innerHTML"));
    }
}
