//! The monitoring listener (`-m PORT`). For now it serves `/healthz` and a core subset of
//! `/varz` with the reference's field names; the full endpoint set and `/metrics` come with
//! the monitoring work. Each request is answered and the connection closed.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::config::COMPAT_VERSION;
use crate::server::Server;

pub async fn bind(server: &Server) -> std::io::Result<TcpListener> {
    let host = server
        .opts
        .http_host
        .as_deref()
        .unwrap_or(&server.opts.host);
    let port = server.opts.http_port.unwrap_or(0);
    let port = if port <= 0 { 0 } else { port as u16 };
    TcpListener::bind((host, port)).await
}

pub async fn serve(server: Arc<Server>, listener: TcpListener) {
    let mut shutdown = server.shutdown_rx();
    loop {
        tokio::select! {
            r = listener.accept() => if let Ok((stream, _)) = r {
                tokio::spawn(handle(server.clone(), stream));
            },
            _ = crate::client::until_true(&mut shutdown) => return,
        }
    }
}

async fn handle(server: Arc<Server>, mut stream: TcpStream) {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    // Read the request head; bounded in size and time so a stuck client costs nothing.
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        true
    })
    .await;
    if !matches!(read, Ok(true)) {
        return;
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, ctype, body) = match (method, path) {
        ("GET", "/healthz") => (200, "application/json", r#"{"status":"ok"}"#.to_string()),
        ("GET", "/varz") => (200, "application/json", varz(&server)),
        ("GET", _) => (
            404,
            "text/plain; charset=utf-8",
            "404 page not found\n".into(),
        ),
        _ => (
            405,
            "text/plain; charset=utf-8",
            "method not allowed\n".into(),
        ),
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        _ => "Method Not Allowed",
    };
    let resp = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(resp.as_bytes()).await;
    let _ = stream.shutdown().await;
}

fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
}

fn varz(server: &Server) -> String {
    let o = &server.opts;
    let t = server.totals();
    let addr = *server.client_addr.lock().unwrap_or_else(|e| e.into_inner());
    let v = json!({
        "server_id": server.server_id,
        "server_name": server.server_name,
        "version": COMPAT_VERSION,
        "proto": 1,
        "host": o.host,
        "port": addr.map_or(0, |a| a.port()),
        "max_connections": o.max_connections,
        "ping_interval": o.ping_interval.as_nanos() as u64,
        "ping_max": o.ping_max,
        "max_control_line": keel_protocol::MAX_CONTROL_LINE,
        "max_payload": o.max_payload,
        "max_pending": o.max_pending,
        "write_deadline": o.write_deadline.as_nanos() as u64,
        "start_unix": rfc3339(server.start),
        "connections": server.num_clients(),
        "in_msgs": t.in_msgs,
        "in_bytes": t.in_bytes,
        "out_msgs": t.out_msgs,
        "out_bytes": t.out_bytes,
        "slow_consumers": crate::client::SLOW_CONSUMERS.load(std::sync::atomic::Ordering::Relaxed),
        "subscriptions": server.sublist.count(),
    });
    serde_json::to_string_pretty(&v).unwrap_or_default()
}
