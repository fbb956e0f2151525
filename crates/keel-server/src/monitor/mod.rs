//! The monitoring listener (`-m PORT` / `http_port`): the reference's HTTP endpoints with its
//! JSON field names, plus `/metrics` in the Prometheus text format.
//!
//! | path | module | what |
//! |---|---|---|
//! | `/` | here | an HTML index of the endpoints |
//! | `/varz`, `/connz`, `/subsz`, `/routez`, `/leafz`, `/gatewayz`, `/accountz`, `/accstatz`, `/healthz` | `endpoints.rs` | server, connections, subscriptions, (empty) cluster links, accounts, health |
//! | `/jsz` | `jsz.rs` | JetStream usage, accounts, streams and consumers |
//! | `/metrics` | `metrics.rs` | Prometheus exposition, names as prometheus-nats-exporter's |
//!
//! HTTP is hyper 1 (HTTP/1.1, keep-alive). Each request's work runs on tokio's blocking pool,
//! so a large `/jsz` or `/metrics` never occupies a worker that client connections use; the
//! handlers read server state through short, per-object locks and never hold one across the
//! whole response. A query parameter that does not parse is answered with `400` and the
//! reference's error text, unknown paths with the reference's `404 page not found`.

mod closed;
mod dashboard;
mod endpoints;
mod jsz;
mod metrics;
pub(crate) mod proc;
mod query;
mod raftz;
pub(crate) mod sysreq;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::Value;
use tokio::net::TcpListener;

use crate::server::Server;
use query::Query;

pub use closed::{reason_text, ClosedConns};
pub(crate) use endpoints::{account_statz, nanos};
use metrics::encode_metrics;

/// Binds the monitoring listener on `http_host` (else `host`) and `http_port` or
/// `https_port` (0 or -1: any free port).
pub async fn bind(server: &Server) -> std::io::Result<TcpListener> {
    let host = server
        .opts
        .http_host
        .as_deref()
        .unwrap_or(&server.opts.host);
    let port = server
        .opts
        .http_port
        .or(server.opts.https_port)
        .unwrap_or(0);
    let port = if port <= 0 { 0 } else { port as u16 };
    crate::server::bind_tcp(host, port, &server.log)
}

/// Serves monitoring requests until the server shuts down; over TLS with `https_port`.
pub async fn serve(server: Arc<Server>, listener: TcpListener) {
    let https = server.opts.https_port.is_some();
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    let ctx = Arc::new(Ctx::new(server.clone(), port));
    if server.opts.http_dashboard {
        server.spawn(dashboard::sampler(server.clone(), ctx.history.clone()));
    }
    let mut shutdown = server.shutdown_rx();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                // The server's TLS setup now, so a reload's certificates apply here too.
                Ok((stream, _)) => match https.then(|| server.tls()).flatten() {
                    None => {
                        let _ = stream.set_nodelay(true);
                        server.spawn(connection(ctx.clone(), stream));
                    }
                    Some(t) => {
                        let acceptor = tokio_rustls::TlsAcceptor::from(t.monitor.clone());
                        let (ctx, timeout) = (ctx.clone(), t.opts.timeout());
                        server.spawn(async move {
                            let _ = stream.set_nodelay(true);
                            // A client that never finishes its handshake holds a task no longer.
                            if let Ok(Ok(s)) = tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                                connection(ctx, s).await;
                            }
                        });
                    }
                },
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
            _ = crate::client::until_true(&mut shutdown) => return,
        }
    }
}

/// What the handlers share: the server, the monitoring port and per-path request counts
/// (`/varz` `http_req_stats`), and the CPU sample `/varz` computes its percentage from.
pub(crate) struct Ctx {
    pub server: Arc<Server>,
    pub http_port: u16,
    req_stats: Mutex<BTreeMap<&'static str, u64>>,
    pub cpu: Mutex<proc::CpuSampler>,
    /// Requests being worked on at once; more wait their turn instead of taking more of the
    /// blocking pool (and more CPU from message traffic).
    busy: tokio::sync::Semaphore,
    /// The dashboard's sparkline samples.
    pub history: Arc<Mutex<dashboard::History>>,
}

/// How many monitoring requests are worked on at the same time.
const CONCURRENT_REQUESTS: usize = 4;

impl Ctx {
    pub(crate) fn new(server: Arc<Server>, http_port: u16) -> Ctx {
        Ctx {
            server,
            http_port,
            req_stats: Mutex::new(BTreeMap::new()),
            cpu: Mutex::new(proc::CpuSampler::default()),
            busy: tokio::sync::Semaphore::new(CONCURRENT_REQUESTS),
            history: Arc::new(Mutex::new(dashboard::History::default())),
        }
    }

    fn count(&self, path: &'static str) {
        *self
            .req_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(path)
            .or_insert(0) += 1;
    }

    pub fn req_stats(&self) -> BTreeMap<&'static str, u64> {
        self.req_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

async fn connection<S>(ctx: Arc<Ctx>, stream: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut shutdown = ctx.server.shutdown_rx();
    let svc_ctx = ctx.clone();
    let svc = service_fn(move |req: Request<Incoming>| {
        let ctx = svc_ctx.clone();
        async move { Ok::<_, Infallible>(respond(ctx, req).await) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        // A client that never finishes its request head costs a task for this long at most.
        .header_read_timeout(Duration::from_secs(5))
        .max_buf_size(64 * 1024)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::select! {
        _ = conn => {}
        _ = crate::client::until_true(&mut shutdown) => {}
    }
}

/// One response, before it becomes a hyper `Response`.
pub(crate) struct Reply {
    status: u16,
    content_type: &'static str,
    body: Vec<u8>,
    /// JSON responses allow any origin, as the reference's do.
    cors: bool,
    /// Extra headers (the dashboard's caching and content policy).
    headers: Vec<(&'static str, String)>,
}

const TEXT: &str = "text/plain; charset=utf-8";

impl Reply {
    pub fn text(status: u16, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: TEXT,
            body: body.into().into_bytes(),
            cors: false,
            headers: Vec::new(),
        }
    }

    fn not_found() -> Reply {
        Reply::text(404, "404 page not found\n")
    }

    /// Pretty JSON (2-space indent, as the reference writes it), or JSONP with `callback`.
    pub fn json(status: u16, v: &Value, q: &Query) -> Reply {
        Reply::json_body(status, go_escape(&pretty(v)), q)
    }

    fn json_body(status: u16, body: String, q: &Query) -> Reply {
        match q.get("callback") {
            Some(cb) if !cb.is_empty() => {
                // The reference echoes any callback; only identifier-like ones are accepted
                // here so the endpoint cannot be used to reflect script.
                if !cb
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'$' | b'.'))
                {
                    return Reply::text(400, format!("invalid callback: {cb}"));
                }
                Reply {
                    status,
                    content_type: "application/javascript",
                    body: format!("{cb}({body})").into_bytes(),
                    cors: false,
                    headers: Vec::new(),
                }
            }
            _ => Reply {
                status,
                content_type: "application/json",
                body: body.into_bytes(),
                cors: true,
                headers: Vec::new(),
            },
        }
    }
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| "{}".into())
}

/// Escapes what Go's encoding/json escapes inside strings (`<`, `>`, `&`, U+2028, U+2029).
/// None of these can appear in JSON outside a string, so a plain pass is exact.
fn go_escape(s: &str) -> String {
    if !s
        .chars()
        .any(|c| matches!(c, '<' | '>' | '&' | '\u{2028}' | '\u{2029}'))
    {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

async fn respond(ctx: Arc<Ctx>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let if_none_match = req
        .headers()
        .get(hyper::header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let asset = (ctx.server.opts.http_dashboard
        && matches!(*req.method(), Method::GET | Method::HEAD))
    .then(|| dashboard_asset(&ctx, req.uri().path(), if_none_match.as_deref()))
    .flatten();
    let reply = if let Some(r) = asset {
        // Static and in memory: no need for the blocking pool.
        r
    } else if matches!(*req.method(), Method::GET | Method::HEAD | Method::POST) {
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or("").to_string();
        let ctx2 = ctx.clone();
        // The semaphore is never closed, so acquiring cannot fail.
        let _permit = ctx.busy.acquire().await;
        // Off the async workers: a scrape of many consumers is CPU work and takes locks.
        tokio::task::spawn_blocking(move || route(&ctx2, &path, &query))
            .await
            .unwrap_or_else(|_| Reply::text(500, "internal error\n"))
    } else {
        Reply::text(405, "method not allowed\n")
    };
    let mut resp = Response::new(Full::new(Bytes::from(reply.body)));
    *resp.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    if reply.cors {
        h.insert("access-control-allow-origin", HeaderValue::from_static("*"));
    }
    if reply.status == 404 {
        h.insert(
            "x-content-type-options",
            HeaderValue::from_static("nosniff"),
        );
    }
    for (k, v) in reply.headers {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(k, v);
        }
    }
    resp
}

/// The dashboard's page, script and style sheet. The page names its assets with their
/// content hash (`app.js?v=<hash>`), so those are cached for good and a reload does not ask
/// for them again; the page itself carries an ETag, so a reload gets `304 Not Modified`. A
/// refresh therefore costs the server one 304 and the data request.
fn dashboard_asset(ctx: &Ctx, path: &str, if_none_match: Option<&str>) -> Option<Reply> {
    static PAGE: std::sync::OnceLock<(String, String)> = std::sync::OnceLock::new();
    let (page, version) = PAGE.get_or_init(|| {
        let version = format!(
            "{:016x}",
            fnv1a(format!("{}{}", dashboard::APP_JS, dashboard::APP_CSS).as_bytes())
        );
        (
            dashboard::INDEX_HTML.replace("__VERSION__", &version),
            version,
        )
    });
    let (text, content_type, immutable) = match path {
        "/dashboard" | "/dashboard/" => (page.as_str(), "text/html; charset=utf-8", false),
        "/dashboard/app.js" => (dashboard::APP_JS, "text/javascript; charset=utf-8", true),
        "/dashboard/app.css" => (dashboard::APP_CSS, "text/css; charset=utf-8", true),
        _ => return None,
    };
    ctx.count("/dashboard");
    let etag = format!("\"{:016x}-{version}\"", fnv1a(text.as_bytes()));
    let cache = if immutable {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    };
    let headers = vec![
        ("etag", etag.clone()),
        ("cache-control", cache.to_string()),
        ("x-content-type-options", "nosniff".to_string()),
        // Only our own script, style and data: a stream name can never run as script.
        (
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
                .to_string(),
        ),
    ];
    if if_none_match.is_some_and(|v| v.split(',').any(|t| t.trim() == etag)) {
        return Some(Reply {
            status: 304,
            content_type,
            body: Vec::new(),
            cors: false,
            headers,
        });
    }
    Some(Reply {
        status: 200,
        content_type,
        body: text.as_bytes().to_vec(),
        cors: false,
        headers,
    })
}

/// FNV-1a: a stable content hash for the ETag (not security-relevant).
fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

type Handler = fn(&Ctx, &Query) -> Result<Value, String>;

/// Dispatches one request; runs on the blocking pool.
pub(crate) fn route(ctx: &Ctx, path: &str, raw_query: &str) -> Reply {
    let q = Query::parse(raw_query);
    let (name, handler): (&'static str, Handler) = match path {
        "/" => {
            ctx.count("/");
            return Reply {
                status: 200,
                content_type: "text/html; charset=utf-8",
                body: endpoints::root_html(ctx.server.opts.http_dashboard).into_bytes(),
                cors: false,
                headers: Vec::new(),
            };
        }
        "/healthz" => {
            ctx.count("/healthz");
            return endpoints::healthz(ctx, &q);
        }
        "/metrics" => {
            ctx.count("/metrics");
            let mut out = String::new();
            return match encode_metrics(ctx, &mut out) {
                Ok(()) => Reply {
                    status: 200,
                    content_type: prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                    body: out.into_bytes(),
                    cors: false,
                    headers: Vec::new(),
                },
                Err(_) => Reply::text(500, "error encoding metrics\n"),
            };
        }
        "/raftz" => {
            ctx.count("/raftz");
            return match raftz::raftz(ctx, &q) {
                Ok(v) => Reply::json(200, &v, &q),
                Err((status, text)) => Reply::text(status, text),
            };
        }
        "/varz" => ("/varz", endpoints::varz),
        "/connz" => ("/connz", endpoints::connz),
        "/subsz" | "/subscriptionsz" => ("/subsz", endpoints::subsz),
        "/routez" => ("/routez", endpoints::routez),
        "/leafz" => ("/leafz", endpoints::leafz),
        "/gatewayz" => ("/gatewayz", endpoints::gatewayz),
        "/accountz" => ("/accountz", endpoints::accountz),
        "/accstatz" => ("/accstatz", endpoints::accstatz),
        "/jsz" => ("/jsz", jsz::jsz),
        "/dashboard/data" if ctx.server.opts.http_dashboard => {
            ctx.count("/dashboard/data");
            return match dashboard::data(ctx, &q) {
                // Compact: the page parses it, nobody reads it.
                Ok(v) => Reply {
                    status: 200,
                    content_type: "application/json",
                    body: serde_json::to_vec(&v).unwrap_or_default(),
                    cors: false,
                    headers: vec![("cache-control", "no-store".to_string())],
                },
                Err(text) => Reply::text(400, text),
            };
        }
        _ => return Reply::not_found(),
    };
    ctx.count(name);
    match handler(ctx, &q) {
        Ok(v) => Reply::json(200, &v, &q),
        Err(text) => Reply::text(400, text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_escaping() {
        assert_eq!(go_escape(r#"{"a":"x.>"}"#), r#"{"a":"x.\u003e"}"#);
        assert_eq!(go_escape("<&>"), "\\u003c\\u0026\\u003e");
        assert_eq!(go_escape("plain"), "plain");
    }

    fn ctx() -> Ctx {
        let opts = crate::config::Opts::default();
        Ctx::new(Server::new(opts, crate::log::Log::stderr()), 8222)
    }

    #[test]
    fn unknown_path_is_reference_404() {
        let r = route(&ctx(), "/nope", "");
        assert_eq!(r.status, 404);
        assert_eq!(r.body, b"404 page not found\n");
        assert_eq!(r.content_type, TEXT);
    }

    #[test]
    fn malformed_queries_are_400() {
        let c = ctx();
        for (path, q, text) in [
            (
                "/connz",
                "limit=abc",
                "Error decoding int for 'limit': strconv.Atoi: parsing \"abc\": invalid syntax",
            ),
            ("/connz", "sort=bogus", "invalid sorting option: bogus"),
            (
                "/connz",
                "sort=stop",
                "sort by stop only valid on closed connections",
            ),
            ("/connz", "state=bogus", "Error decoding state for bogus"),
            (
                "/connz",
                "cid=abc",
                "Error decoding uint64 for 'cid': strconv.ParseUint: parsing \"abc\": invalid syntax",
            ),
            (
                "/jsz",
                "streams=abc",
                "Error decoding boolean for 'streams': strconv.ParseBool: parsing \"abc\": invalid syntax",
            ),
            (
                "/healthz",
                "js-enabled-only=x",
                "Error decoding boolean for 'js-enabled-only': strconv.ParseBool: parsing \"x\": invalid syntax",
            ),
            (
                "/subsz",
                "test=foo.*",
                "invalid test subject, must be valid publish subject: foo.*",
            ),
            ("/accountz", "acc=x", "Account x does not exist"),
        ] {
            let r = route(&c, path, q);
            assert_eq!(r.status, 400, "{path}?{q}");
            assert_eq!(String::from_utf8_lossy(&r.body), text, "{path}?{q}");
        }
    }

    #[test]
    fn every_endpoint_answers_json() {
        let c = ctx();
        for path in [
            "/varz",
            "/connz",
            "/subsz",
            "/routez",
            "/leafz",
            "/gatewayz",
            "/accountz",
            "/accstatz",
            "/jsz",
            "/healthz",
        ] {
            let r = route(&c, path, "");
            assert_eq!(r.status, 200, "{path}");
            let v: Value = serde_json::from_slice(&r.body).expect(path);
            assert!(v.is_object(), "{path}");
        }
        let stats = c.req_stats();
        assert_eq!(stats.get("/varz"), Some(&1));
    }

    #[test]
    fn healthz_when_jetstream_failed_to_start() {
        let opts = crate::config::Opts {
            jetstream: true,
            ..Default::default()
        };
        let c = Ctx::new(Server::new(opts, crate::log::Log::stderr()), 8222);
        let r = route(&c, "/healthz", "");
        assert_eq!(r.status, 503);
        assert_eq!(
            String::from_utf8_lossy(&r.body),
            r#"{"status":"unavailable","error":"JetStream not enabled (10076)"}"#
        );
        let r = route(&c, "/healthz", "js-enabled-only=true");
        assert_eq!(r.status, 503);
        // Without JetStream configured there is nothing to be unhealthy about.
        assert_eq!(
            route(&ctx(), "/healthz", "js-enabled-only=true").status,
            200
        );
    }

    #[test]
    fn jsonp_callback() {
        let r = route(&ctx(), "/routez", "callback=cb");
        assert_eq!(r.content_type, "application/javascript");
        assert!(r.body.starts_with(b"cb({"));
        assert_eq!(route(&ctx(), "/routez", "callback=%3Cx%3E").status, 400);
    }
}
