//! The JSON of route `INFO` and `CONNECT`, field for field as nats-server 2.15.1 writes them,
//! and a writer that escapes strings the way Go's `encoding/json` does, so Keel's lines are
//! byte-for-byte the reference's.
//!
//! Field order is the reference's struct order. A field the reference marks `omitempty` is
//! left out when it is false, zero or empty, exactly as Go does; the others are always
//! written. Unknown fields are ignored when reading, as Go does.

use bytes::{BufMut, BytesMut};
use serde::{Deserialize, Serialize};
use std::io;

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

fn is_zero_u8(n: &u8) -> bool {
    *n == 0
}

/// Route permissions as they travel in INFO (`import`, `export`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SubjectPermission {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
}

/// The `INFO` a server sends on a route connection: first thing on an accepted connection,
/// from the solicitor after the acceptor's (carrying the pool slot and negotiated
/// compression), later for gossip of a new peer (another server's `server_id`, with `ip`
/// set) and for lame duck mode (`ldm`). Client-only fields of the reference's INFO
/// (`git_commit`, `client_id`, `client_ip`, `xkey`, `api_lvl`, …) are never sent on routes
/// and are not modelled; when read they are ignored like any unknown field.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouteInfo {
    pub server_id: String,
    pub server_name: String,
    pub version: String,
    /// 3 for 2.15 (message tracing); 2 understands accounts on routes, 1 route INFO.
    pub proto: i32,
    pub go: String,
    /// The cluster listen address, or `cluster.advertise`.
    pub host: String,
    pub port: u16,
    pub headers: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub auth_required: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub tls_required: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub tls_verify: bool,
    /// The server's `max_payload`; routes themselves have no payload limit.
    pub max_payload: i32,
    #[serde(skip_serializing_if = "is_false")]
    pub jetstream: bool,
    /// `nats-route://host:port/`: with `cluster.advertise`, and the URL to dial in gossip.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub ip: String,
    /// Only in the first INFO of a connection.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub nonce: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub cluster: String,
    /// The cluster name was generated, not configured.
    #[serde(skip_serializing_if = "is_false")]
    pub cluster_dynamic: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub domain: String,
    /// This server's client URLs (`host:port`), unless `no_advertise`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub connect_urls: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ws_connect_urls: Vec<String>,
    /// Lame duck mode: the sender is leaving.
    #[serde(skip_serializing_if = "is_false")]
    pub ldm: bool,
    /// `accept` (the default), `off`, `s2_fast`, …; left out means "not supported".
    #[serde(skip_serializing_if = "String::is_empty")]
    pub compression: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub import: Option<SubjectPermission>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub export: Option<SubjectPermission>,
    /// Understands `LS+`/`LMSG` with an origin cluster.
    #[serde(skip_serializing_if = "is_false")]
    pub lnoc: bool,
    /// Understands (and sends) `LS-` with an origin cluster.
    #[serde(skip_serializing_if = "is_false")]
    pub lnocu: bool,
    /// 2.15.1: leaf interest as `LS+ _ …` when the origin is unknown. Set it only if `LS+ _`
    /// is handled; left out, the reference falls back to `RS+`.
    #[serde(skip_serializing_if = "is_false")]
    pub ln: bool,
    /// The configured `pool_size`; left out (0) means a "no pool" peer.
    #[serde(skip_serializing_if = "is_zero_i32")]
    pub route_pool_size: i32,
    /// The pool slot the soliciting side fills (slot 0 is left out).
    #[serde(skip_serializing_if = "is_zero_i32")]
    pub route_pool_idx: i32,
    /// The account of a pinned-account connection (`$SYS`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub route_account: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub route_acc_add_reqid: String,
    /// In gossip: 1 = do not forward further, 2 = forward even though learned by gossip.
    #[serde(skip_serializing_if = "is_zero_u8")]
    pub gossip_mode: u8,
    /// Gateway fields a server relays to its route peers.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub gateway: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gateway_urls: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub gateway_url: String,
    #[serde(skip_serializing_if = "is_zero_u8")]
    pub gateway_cmd: u8,
    /// Base64, as Go writes a byte slice.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub gateway_cmd_payload: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub leafnode_urls: Vec<String>,
}

impl RouteInfo {
    pub fn from_json(json: &[u8]) -> serde_json::Result<Self> {
        serde_json::from_slice(json)
    }
}

/// The `CONNECT` a soliciting server sends first on a route. The reference's sender always
/// writes `echo`, `verbose`, `pedantic`, `tls_required`, `headers`, `name` and `cluster`.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouteConnect {
    pub echo: bool,
    pub verbose: bool,
    pub pedantic: bool,
    /// From the route URL's userinfo (`nats://user:pass@host:port`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub user: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub pass: String,
    pub tls_required: bool,
    pub headers: bool,
    /// The sender's **server id** (not its name).
    pub name: String,
    pub cluster: String,
    #[serde(skip_serializing_if = "is_false")]
    pub cluster_dynamic: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub lnoc: bool,
    /// Defined by the reference but never set by its sender (INFO carries it).
    #[serde(skip_serializing_if = "is_false")]
    pub lnocu: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub ln: bool,
    /// Set by a gateway dialing the route port, which the acceptor refuses.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub gateway: String,
    /// Set by a client dialing the route port, which the acceptor refuses
    /// (`attempted to connect to route port`). Never sent by a server.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub lang: String,
}

impl RouteConnect {
    pub fn from_json(json: &[u8]) -> serde_json::Result<Self> {
        serde_json::from_slice(json)
    }
}

/// Not derived: the password must never reach a log.
impl std::fmt::Debug for RouteConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteConnect")
            .field("echo", &self.echo)
            .field("verbose", &self.verbose)
            .field("pedantic", &self.pedantic)
            .field("user", &self.user)
            .field(
                "pass",
                &if self.pass.is_empty() {
                    ""
                } else {
                    "[REDACTED]"
                },
            )
            .field("tls_required", &self.tls_required)
            .field("headers", &self.headers)
            .field("name", &self.name)
            .field("cluster", &self.cluster)
            .field("cluster_dynamic", &self.cluster_dynamic)
            .field("lnoc", &self.lnoc)
            .field("lnocu", &self.lnocu)
            .field("ln", &self.ln)
            .field("gateway", &self.gateway)
            .field("lang", &self.lang)
            .finish()
    }
}

/// Go's `encoding/json` escaping on top of serde_json's: it also writes `<`, `>`, `&`, U+2028
/// and U+2029 as `\u003c`, `\u003e`, `\u0026`, `\u2028`, `\u2029` (the reference's INFO has
/// `"foo.\u003e"` for a `foo.>` permission). Control characters, `"` and `\` are escaped the
/// same way by both.
struct GoFormatter;

impl serde_json::ser::Formatter for GoFormatter {
    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        let b = fragment.as_bytes();
        let mut start = 0;
        let mut i = 0;
        while i < b.len() {
            let esc: &[u8] = match b[i] {
                b'<' => b"\\u003c",
                b'>' => b"\\u003e",
                b'&' => b"\\u0026",
                0xE2 if b.get(i + 1) == Some(&0x80) && b.get(i + 2) == Some(&0xA8) => b"\\u2028",
                0xE2 if b.get(i + 1) == Some(&0x80) && b.get(i + 2) == Some(&0xA9) => b"\\u2029",
                _ => {
                    i += 1;
                    continue;
                }
            };
            w.write_all(&b[start..i])?;
            w.write_all(esc)?;
            i += if b[i] == 0xE2 { 3 } else { 1 };
            start = i;
        }
        w.write_all(&b[start..])
    }
}

/// Appends `value` as JSON the way Go's `json.Marshal` writes it.
pub fn write_go_json<T: Serialize + ?Sized>(buf: &mut BytesMut, value: &T) {
    let mut ser = serde_json::Serializer::with_formatter(buf.writer(), GoFormatter);
    // Writing into memory cannot fail, and these types have no map keys that could.
    value
        .serialize(&mut ser)
        .expect("serializing route JSON into memory");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_escaping() {
        let mut b = BytesMut::new();
        write_go_json(&mut b, &["a<b>&c\u{2028}\u{2029}é\"\\\n\u{1}\u{7f}"]);
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            "[\"a\\u003cb\\u003e\\u0026c\\u2028\\u2029é\\\"\\\\\\n\\u0001\u{7f}\"]"
        );
    }

    #[test]
    fn connect_debug_hides_password() {
        let c = RouteConnect {
            user: "ruser".into(),
            pass: "rpass".into(),
            ..Default::default()
        };
        let s = format!("{c:?}");
        assert!(s.contains("ruser") && !s.contains("rpass"), "{s}");
    }
}
