//! TLS on the client listener and on the monitoring port: the INFO fields, the order of the
//! opening (INFO then the handshake, `handshake_first`, its fallback, `allow_non_tls`), client
//! certificates (`verify`, a wrong CA, `pinned_certs`), what a plain client or a silent one
//! gets, the TLS fields of `/connz` and `/varz`, HTTPS monitoring, the flags, and the config
//! errors. Each test makes its own certificates (rcgen) and runs against keel and, with
//! `KEEL_TEST_REFERENCE=1`, against nats-server.

mod common;

use std::time::{Duration, Instant};

use common::{
    https_get, info_json, read_line_from, tls_handshake, within, Server, TestCerts, CLIENT_EMAIL,
    QUIET, STEP,
};
use futures::StreamExt;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn tls_conf(certs: &TestCerts, extra: &str) -> String {
    format!("tls {{ {}, {extra} }}\n", certs.server_keys())
}

/// Opens a TCP connection and reads the plain INFO line.
async fn plain_info(server: &Server) -> (TcpStream, Value) {
    let mut tcp = TcpStream::connect(server.addr()).await.unwrap();
    let line = read_line_from(&mut tcp).await;
    (tcp, info_json(&line))
}

/// Everything the server still sends until it closes the connection.
async fn rest_until_closed(tcp: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    within("server closes the connection", tcp.read_to_end(&mut out))
        .await
        .expect("read");
    out
}

/// A publish and its delivery through one client: the connection really works.
async fn round_trip(client: &async_nats::Client) {
    let subject = client.new_inbox();
    let mut sub = client.subscribe(subject.clone()).await.unwrap();
    client.publish(subject, "over tls".into()).await.unwrap();
    let msg = within("delivery", sub.next()).await.expect("message");
    assert_eq!(&msg.payload[..], b"over tls");
}

async fn connect(
    server: &Server,
    opts: async_nats::ConnectOptions,
) -> Result<async_nats::Client, String> {
    match tokio::time::timeout(STEP, opts.connect(server.url())).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("connect timed out".into()),
    }
}

/// The port of the "Starting http(s) monitor on host:port" log line.
fn monitor_port(server: &Server, scheme: &str) -> u16 {
    let needle = format!("Starting {scheme} monitor on");
    let deadline = Instant::now() + STEP;
    loop {
        if let Some(l) = server.log().lines().find(|l| l.contains(&needle)) {
            return l.rsplit(':').next().unwrap().trim().parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "no {needle:?} line:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

async fn http_json(port: u16, path: &str) -> Value {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    tcp.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    within("http response", tcp.read_to_end(&mut out))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut rest = body;
        let mut b = String::new();
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            b.push_str(&tail[..n]);
            rest = tail[n..].trim_start_matches("\r\n");
        }
        b
    } else {
        body.to_string()
    };
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

#[tokio::test]
async fn info_requires_tls_and_clients_upgrade_after_it() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(&certs, ""));
    let (_tcp, info) = plain_info(&server).await;
    assert_eq!(info["tls_required"], true, "{info}");
    assert!(info.get("tls_verify").is_none(), "{info}");
    assert!(info.get("tls_available").is_none(), "{info}");
    // Field order: the TLS fields sit between headers and max_payload.
    let keys: Vec<&String> = info.as_object().unwrap().keys().collect();
    let pos = |k: &str| keys.iter().position(|x| *x == k).unwrap();
    assert!(pos("headers") < pos("tls_required") && pos("tls_required") < pos("max_payload"));

    // No client certificate needed without `verify`.
    let client = connect(&server, certs.client_options(false)).await.unwrap();
    round_trip(&client).await;
}

#[tokio::test]
async fn verify_requires_a_certificate_from_the_ca() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(
        &certs,
        &format!("{}, verify: true", certs.ca_key()),
    ));
    let (_tcp, info) = plain_info(&server).await;
    assert_eq!(info["tls_required"], true, "{info}");
    assert_eq!(info["tls_verify"], true, "{info}");

    let client = connect(&server, certs.client_options(true)).await.unwrap();
    round_trip(&client).await;

    // Without a client certificate: refused.
    assert!(connect(&server, certs.client_options(false)).await.is_err());
    // With a certificate of another CA: refused.
    let other = async_nats::ConnectOptions::new()
        .require_tls(true)
        .add_root_certificates(certs.path("ca.pem"))
        .add_client_certificate(
            certs.path("other-client-cert.pem"),
            certs.path("other-client-key.pem"),
        );
    assert!(connect(&server, other).await.is_err());
    // A raw TLS client gets the same answer: the handshake (or the first read) fails.
    let tcp = TcpStream::connect(server.addr()).await.unwrap();
    let mut tcp = tcp;
    read_line_from(&mut tcp).await;
    match tls_handshake(tcp, certs.rustls_client("ca.pem", None)).await {
        Err(_) => {}
        Ok(mut s) => {
            let mut b = [0u8; 64];
            let r = tokio::time::timeout(STEP, s.read(&mut b))
                .await
                .expect("no answer");
            assert!(!matches!(r, Ok(n) if n > 0), "read {r:?}");
        }
    }
}

#[tokio::test]
async fn client_that_does_not_trust_the_server_fails() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(&certs, ""));
    let wrong = async_nats::ConnectOptions::new()
        .require_tls(true)
        .add_root_certificates(certs.path("other-ca.pem"));
    let err = connect(&server, wrong).await.unwrap_err();
    assert!(!err.is_empty());
    // The server keeps serving others.
    let client = connect(&server, certs.client_options(false)).await.unwrap();
    round_trip(&client).await;
}

#[tokio::test]
async fn plain_client_is_closed_without_an_answer() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(&certs, ""));
    let (mut tcp, _) = plain_info(&server).await;
    tcp.write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
        .await
        .unwrap();
    // Not a TLS record: the connection closes, and no byte (no PONG, no TLS alert) comes.
    assert_eq!(rest_until_closed(&mut tcp).await, b"");
}

#[tokio::test]
async fn handshake_timeout_closes_a_silent_client() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(&certs, "timeout: 0.5"));
    let (mut tcp, _) = plain_info(&server).await;
    // The client never starts its handshake: closed after the TLS timeout, silently.
    assert_eq!(rest_until_closed(&mut tcp).await, b"");
}

#[tokio::test]
async fn handshake_first_sends_info_over_tls() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(&certs, "handshake_first: true"));
    // Nothing in plain text: the server waits for the client's handshake.
    let mut tcp = TcpStream::connect(server.addr()).await.unwrap();
    let mut b = [0u8; 1];
    assert!(
        tokio::time::timeout(QUIET, tcp.read(&mut b)).await.is_err(),
        "the server spoke before the handshake"
    );
    let mut s = tls_handshake(tcp, certs.rustls_client("ca.pem", None))
        .await
        .expect("handshake");
    let info = info_json(&read_line_from(&mut s).await);
    assert_eq!(info["tls_required"], true, "{info}");

    let client = connect(&server, certs.client_options(false).tls_first())
        .await
        .unwrap();
    round_trip(&client).await;
}

#[tokio::test]
async fn handshake_first_with_a_delay_falls_back_to_plain_info() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(&certs, "handshake_first: \"200ms\""));
    // A client that waits for INFO gets it once the delay passed, then upgrades as usual.
    let (_tcp, info) = plain_info(&server).await;
    assert_eq!(info["tls_required"], true, "{info}");
    let client = connect(&server, certs.client_options(false)).await.unwrap();
    round_trip(&client).await;
    // A TLS-first client still gets in.
    let first = connect(&server, certs.client_options(false).tls_first())
        .await
        .unwrap();
    round_trip(&first).await;
}

#[tokio::test]
async fn allow_non_tls_serves_plain_and_tls_clients() {
    let certs = TestCerts::new();
    let server =
        Server::start_with_config(&format!("{}allow_non_tls: true\n", tls_conf(&certs, "")));
    let (mut tcp, info) = plain_info(&server).await;
    assert_eq!(info["tls_available"], true, "{info}");
    assert!(info.get("tls_required").is_none(), "{info}");
    tcp.write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
        .await
        .unwrap();
    assert_eq!(read_line_from(&mut tcp).await, "PONG");

    let client = connect(&server, certs.client_options(false)).await.unwrap();
    round_trip(&client).await;
}

#[tokio::test]
async fn pinned_certs_admit_only_the_pinned_key() {
    let certs = TestCerts::new();
    let pinned = Server::start_with_config(&tls_conf(
        &certs,
        &format!(
            "{}, verify: true, pinned_certs: [\"{}\"]",
            certs.ca_key(),
            certs.client_spki_sha256.to_uppercase()
        ),
    ));
    let client = connect(&pinned, certs.client_options(true)).await.unwrap();
    round_trip(&client).await;

    let other = Server::start_with_config(&tls_conf(
        &certs,
        &format!(
            "{}, verify: true, pinned_certs: [\"{}\"]",
            certs.ca_key(),
            "ab".repeat(32)
        ),
    ));
    assert!(connect(&other, certs.client_options(true)).await.is_err());
}

#[tokio::test]
async fn verify_and_map_without_users_verifies_the_certificate() {
    // The mapping to users needs authorization; the certificate check itself applies now.
    let certs = TestCerts::new();
    let server = Server::start_with_config(&tls_conf(
        &certs,
        &format!("{}, verify_and_map: true", certs.ca_key()),
    ));
    let (_tcp, info) = plain_info(&server).await;
    assert_eq!(info["tls_verify"], true, "{info}");
    let client = connect(&server, certs.client_options(true)).await.unwrap();
    round_trip(&client).await;
    assert!(connect(&server, certs.client_options(false)).await.is_err());
}

#[tokio::test]
async fn verify_and_map_logs_in_as_the_user_the_certificate_names() {
    // The email SAN names a configured user (no password: the certificate is the
    // credential); its permissions apply, and a CONNECT's user/pass is not consulted.
    let certs = TestCerts::new();
    let conf = format!(
        "{}\nauthorization {{ users = [ {{ user: \"{CLIENT_EMAIL}\", permissions: {{ publish: \"ok.>\", subscribe: [\"ok.>\", \"_INBOX.>\"] }} }} ] }}",
        tls_conf(&certs, &format!("{}, verify_and_map: true", certs.ca_key()))
    );
    let server = Server::start_with_config(&conf);
    let client = connect(&server, certs.client_options(true)).await.unwrap();
    let mut sub = client.subscribe("ok.x").await.unwrap();
    client.publish("ok.x", "hi".into()).await.unwrap();
    client.flush().await.unwrap();
    let m = within("delivery", sub.next()).await.unwrap();
    assert_eq!(&m.payload[..], b"hi");

    // A server whose users the certificate does not name refuses it.
    let conf = format!(
        "{}\nauthorization {{ users = [ {{ user: bob }} ] }}",
        tls_conf(&certs, &format!("{}, verify_and_map: true", certs.ca_key()))
    );
    let server = Server::start_with_config(&conf);
    assert!(connect(&server, certs.client_options(true)).await.is_err());
}

#[tokio::test]
async fn monitoring_shows_the_tls_state() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&format!(
        "http_port: -1\n{}",
        tls_conf(&certs, &format!("{}, verify: true", certs.ca_key()))
    ));
    let port = monitor_port(&server, "http");
    let client = connect(&server, certs.client_options(true).name("tls-client"))
        .await
        .unwrap();
    round_trip(&client).await;

    let connz = http_json(port, "/connz?auth=true").await;
    let c = &connz["connections"][0];
    assert_eq!(c["name"], "tls-client", "{connz}");
    assert_eq!(c["tls_version"], "1.3", "{c}");
    let suite = c["tls_cipher_suite"].as_str().unwrap();
    assert!(
        [
            "TLS_AES_128_GCM_SHA256",
            "TLS_AES_256_GCM_SHA384",
            "TLS_CHACHA20_POLY1305_SHA256"
        ]
        .contains(&suite),
        "{c}"
    );
    assert!(c.get("tls_first").is_none(), "{c}");
    let peer = &c["tls_peer_certs"][0];
    assert_eq!(
        peer["subject"], "CN=alice,OU=dev,O=Acme\\, Inc.,0.9.2342.19200300.100.1.25=example",
        "{c}"
    );
    assert_eq!(
        peer["spki_sha256"],
        certs.client_spki_sha256.as_str(),
        "{c}"
    );
    assert_eq!(peer["cert_sha256"].as_str().unwrap().len(), 64, "{c}");
    // The certificates only with auth=true.
    let connz = http_json(port, "/connz").await;
    assert!(
        connz["connections"][0].get("tls_peer_certs").is_none(),
        "{connz}"
    );
    assert_eq!(connz["connections"][0]["tls_version"], "1.3");

    let varz = http_json(port, "/varz").await;
    assert_eq!(varz["tls_required"], true);
    assert_eq!(varz["tls_verify"], true);
    assert_eq!(varz["tls_timeout"], 2);
    assert_eq!(varz["auth_timeout"], 3);
    assert!(
        varz["tls_cert_not_after"].as_str().unwrap().ends_with('Z'),
        "{varz}"
    );

    // A client without a certificate is listed as closed by its handshake.
    assert!(connect(&server, certs.client_options(false)).await.is_err());
    let deadline = Instant::now() + STEP;
    loop {
        let closed = http_json(port, "/connz?state=closed").await;
        let reasons: Vec<&str> = closed["connections"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c["reason"].as_str())
            .collect();
        if reasons.contains(&"TLS Handshake Failure") {
            break;
        }
        assert!(Instant::now() < deadline, "{closed}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn tls_first_client_is_marked_in_connz() {
    let certs = TestCerts::new();
    let server = Server::start_with_config(&format!(
        "http_port: -1\n{}",
        tls_conf(&certs, "handshake_first: true")
    ));
    let port = monitor_port(&server, "http");
    let client = connect(&server, certs.client_options(false).tls_first())
        .await
        .unwrap();
    round_trip(&client).await;
    let connz = http_json(port, "/connz").await;
    assert_eq!(connz["connections"][0]["tls_first"], true, "{connz}");
}

#[tokio::test]
async fn https_monitoring_uses_the_tls_certificates() {
    let certs = TestCerts::new();
    // `verify` applies to clients, not to the monitoring port.
    let server = Server::start_with_config(&format!(
        "https_port: -1\n{}",
        tls_conf(&certs, &format!("{}, verify: true", certs.ca_key()))
    ));
    let port = monitor_port(&server, "https");
    let (status, body) = https_get(&certs, port, "/varz").await;
    assert_eq!(status, 200, "{body}");
    let varz: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(varz["https_port"], -1, "{varz}");
    let (status, body) = https_get(&certs, port, "/healthz").await;
    assert_eq!(status, 200, "{body}");
    // Plain HTTP on the HTTPS port gets no JSON.
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    tcp.write_all(b"GET /varz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(STEP, tcp.read_to_end(&mut out)).await;
    assert!(!String::from_utf8_lossy(&out).contains("server_id"));
}

#[tokio::test]
async fn tls_flags_enable_tls() {
    let certs = TestCerts::new();
    let cert = certs.path("server-cert.pem").display().to_string();
    let key = certs.path("server-key.pem").display().to_string();
    let ca = certs.path("ca.pem").display().to_string();
    let server = Server::start_with_args(&["--tls", "--tlscert", &cert, "--tlskey", &key]);
    let (_tcp, info) = plain_info(&server).await;
    assert_eq!(info["tls_required"], true, "{info}");
    assert!(info.get("tls_verify").is_none(), "{info}");
    drop(server);

    let server = Server::start_with_args(&[
        "--tlsverify",
        "--tlscert",
        &cert,
        "--tlskey",
        &key,
        "--tlscacert",
        &ca,
    ]);
    let (_tcp, info) = plain_info(&server).await;
    assert_eq!(info["tls_verify"], true, "{info}");
    let client = connect(&server, certs.client_options(true)).await.unwrap();
    round_trip(&client).await;
    drop(server);

    // --tls=false turns off the config's TLS.
    let server = Server::start_with_config_and_args(&tls_conf(&certs, ""), &["--tls=false"]);
    let (_tcp, info) = plain_info(&server).await;
    assert!(info.get("tls_required").is_none(), "{info}");
}

#[tokio::test]
async fn bad_tls_setups_are_refused_at_startup() {
    let certs = TestCerts::new();
    let dir = common::TempDir::new("keel-tls-conf");
    let conf = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let missing = conf(
        "missing.conf",
        "tls { cert_file: \"/nonexistent/cert.pem\", key_file: \"/nonexistent/key.pem\" }\n",
    );
    let (code, out) = Server::run_to_exit(&["-c".into(), missing]);
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("error parsing X509 certificate/key pair"),
        "{out}"
    );

    let no_key = conf(
        "nokey.conf",
        &format!(
            "tls {{ cert_file: {:?} }}\n",
            certs.path("server-cert.pem").display().to_string()
        ),
    );
    let (code, out) = Server::run_to_exit(&["-c".into(), no_key]);
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("missing 'key_file' in TLS configuration"),
        "{out}"
    );

    let (code, out) = Server::run_to_exit(&["--tlsverify".into()]);
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("TLS Server certificate must be present and valid"),
        "{out}"
    );

    let unknown = conf(
        "unknown.conf",
        &tls_conf(&certs, "cipher_suites: [\"TLS_BOGUS\"]"),
    );
    let (code, out) = Server::run_to_exit(&["-c".into(), unknown]);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("unrecognized cipher TLS_BOGUS"), "{out}");

    let field = conf("field.conf", &tls_conf(&certs, "bogus: 1"));
    let (code, out) = Server::run_to_exit(&["-c".into(), field]);
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("error parsing tls config, unknown field \"bogus\""),
        "{out}"
    );
}

#[tokio::test]
async fn https_port_needs_tls() {
    let (code, out) = Server::run_to_exit(&["--https_port".into(), "-1".into()]);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("TLS cert and key required for HTTPS"), "{out}");
}
