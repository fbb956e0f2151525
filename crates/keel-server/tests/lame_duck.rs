//! Lame-duck mode (SIGUSR2): connected clients get an INFO with `"ldm":true`, new clients
//! are refused, existing ones are closed after the grace period, and the server exits.

mod common;

use std::time::{Duration, Instant};

use common::Server;

#[tokio::test]
async fn sigusr2_enters_lame_duck_mode() {
    let mut server =
        Server::start_with_config("lame_duck_duration: \"30s\"\nlame_duck_grace_period: \"1s\"\n");
    let mut raw = server.raw_connected().await;
    // Complete the handshake: servers push INFO updates only after the first PONG.
    raw.send(b"PING\r\n").await;
    while raw.read_line().await != "PONG" {}
    let status = std::process::Command::new("kill")
        .args(["-USR2", &server.pid().to_string()])
        .status()
        .expect("kill -USR2");
    assert!(status.success());

    // The connected client hears about it.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let line = raw
            .try_read_line(Duration::from_secs(5))
            .await
            .expect("connection open while entering lame duck");
        if line.starts_with("INFO ") && line.contains("\"ldm\":true") {
            break;
        }
        assert!(Instant::now() < deadline, "no lame-duck INFO");
    }

    // New clients are refused once the listener is closed.
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect_timeout(&server.addr(), Duration::from_millis(200)).is_ok() {
        assert!(Instant::now() < deadline, "still accepting new clients");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // After the grace period the client is closed.
    raw.expect_closed(Duration::from_secs(5)).await;
    if !common::is_reference() {
        // Keel exits once its clients are gone; the reference waits out the whole duration.
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.is_running() {
            assert!(
                Instant::now() < deadline,
                "server did not exit after lame duck"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
