//! The JSON of route `INFO` and `CONNECT`, field for field as nats-server 2.15.1 writes them,
//! and a writer that escapes strings the way Go's `encoding/json` does, so Keel's lines are
//! byte-for-byte the reference's.
//!
//! Field order is the reference's struct order. A field the reference marks `omitempty` is
//! left out when it is false, zero or empty, exactly as Go does; the others are always
//! written. Read them with `serde_json::from_slice`; unknown fields are ignored, as Go does.

use bytes::{BufMut, BytesMut};
use serde::{ser, Deserialize, Serialize};

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
    /// The server's `server_tags` (Keel's peers place streams by them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Keel: the server's JetStream memory and file store limits, as `[memory, file]`
    /// (the meta leader places a stream with `max_bytes` only where it fits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub js_limits: Option<[i64; 2]>,
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

/// Appends `value` as JSON the way Go's `json.Marshal` writes it: struct fields in order, no
/// spaces, and Go's string escaping, which also writes `<`, `>`, `&`, U+2028 and U+2029 as
/// `\u003c`, `\u003e`, `\u0026`, `\u2028`, `\u2029` (the reference's INFO has `"foo.\u003e"`
/// for a `foo.>` permission). Written here rather than through serde_json so this crate does
/// not pull serde_json's trait impls into crates that only need subjects or the store codec.
///
/// Handles what the route JSON holds (booleans, integers, strings, sequences, maps with
/// string keys, structs, options, unit enum variants); anything else is an error.
pub fn write_go_json<T: Serialize + ?Sized>(buf: &mut BytesMut, value: &T) -> Result<(), Error> {
    value.serialize(&mut GoJson { buf })
}

/// A value [`write_go_json`] cannot write (floats, byte strings, non-string map keys, …).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl ser::Error for Error {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Error(msg.to_string())
    }
}

fn unsupported<T>(what: &str) -> Result<T, Error> {
    Err(Error(format!("go json: {what} not supported")))
}

struct GoJson<'a> {
    buf: &'a mut BytesMut,
}

fn put_str(buf: &mut BytesMut, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let b = s.as_bytes();
    buf.reserve(b.len() + 2);
    buf.put_u8(b'"');
    let mut start = 0;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let mut width = 1;
        let short: Option<&[u8]> = match c {
            b'"' => Some(b"\\\""),
            b'\\' => Some(b"\\\\"),
            b'\n' => Some(b"\\n"),
            b'\r' => Some(b"\\r"),
            b'\t' => Some(b"\\t"),
            0x08 => Some(b"\\b"),
            0x0c => Some(b"\\f"),
            0xE2 if b.get(i + 1) == Some(&0x80) && matches!(b.get(i + 2), Some(0xA8 | 0xA9)) => {
                width = 3;
                Some(if b[i + 2] == 0xA8 {
                    b"\\u2028"
                } else {
                    b"\\u2029"
                })
            }
            c if c < 0x20 || c == b'<' || c == b'>' || c == b'&' => None,
            _ => {
                i += 1;
                continue;
            }
        };
        buf.put_slice(&b[start..i]);
        match short {
            Some(e) => buf.put_slice(e),
            None => buf.put_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(c >> 4) as usize],
                HEX[(c & 15) as usize],
            ]),
        }
        i += width;
        start = i;
    }
    buf.put_slice(&b[start..]);
    buf.put_u8(b'"');
}

fn put_int(buf: &mut BytesMut, n: i128) {
    if n < 0 {
        buf.put_u8(b'-');
    }
    let n = n.unsigned_abs();
    match u64::try_from(n) {
        Ok(n) => crate::encode::put_uint(buf, n),
        Err(_) => buf.put_slice(n.to_string().as_bytes()),
    }
}

/// A JSON array or object being written.
struct Compound<'s, 'a> {
    ser: &'s mut GoJson<'a>,
    first: bool,
}

impl Compound<'_, '_> {
    fn comma(&mut self) {
        if !std::mem::take(&mut self.first) {
            self.ser.buf.put_u8(b',');
        }
    }

    fn key(&mut self, key: &str) {
        self.comma();
        put_str(self.ser.buf, key);
        self.ser.buf.put_u8(b':');
    }
}

impl<'s, 'a> ser::Serializer for &'s mut GoJson<'a> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'s, 'a>;
    type SerializeTuple = Compound<'s, 'a>;
    type SerializeTupleStruct = Compound<'s, 'a>;
    type SerializeTupleVariant = ser::Impossible<(), Error>;
    type SerializeMap = Compound<'s, 'a>;
    type SerializeStruct = Compound<'s, 'a>;
    type SerializeStructVariant = ser::Impossible<(), Error>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.buf.put_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        put_int(self.buf, v.into());
        Ok(())
    }
    fn serialize_i128(self, v: i128) -> Result<(), Error> {
        put_int(self.buf, v);
        Ok(())
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        self.serialize_u64(v.into())
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        self.serialize_u64(v.into())
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        self.serialize_u64(v.into())
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        crate::encode::put_uint(self.buf, v);
        Ok(())
    }
    fn serialize_f32(self, _: f32) -> Result<(), Error> {
        unsupported("floats")
    }
    fn serialize_f64(self, _: f64) -> Result<(), Error> {
        unsupported("floats")
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        put_str(self.buf, v.encode_utf8(&mut [0; 4]));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        put_str(self.buf, v);
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Error> {
        unsupported("byte strings")
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.buf.put_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        unsupported("enum variants with data")
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Compound<'s, 'a>, Error> {
        self.buf.put_u8(b'[');
        Ok(Compound {
            ser: self,
            first: true,
        })
    }
    fn serialize_tuple(self, len: usize) -> Result<Compound<'s, 'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        len: usize,
    ) -> Result<Compound<'s, 'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        unsupported("enum variants with data")
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Compound<'s, 'a>, Error> {
        self.buf.put_u8(b'{');
        Ok(Compound {
            ser: self,
            first: true,
        })
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Compound<'s, 'a>, Error> {
        self.serialize_map(None)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        unsupported("enum variants with data")
    }
}

impl ser::SerializeSeq for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        self.comma();
        v.serialize(&mut *self.ser)
    }
    fn end(self) -> Result<(), Error> {
        self.ser.buf.put_u8(b']');
        Ok(())
    }
}

impl ser::SerializeTuple for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        ser::SerializeSeq::serialize_element(self, v)
    }
    fn end(self) -> Result<(), Error> {
        ser::SerializeSeq::end(self)
    }
}

impl ser::SerializeTupleStruct for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        ser::SerializeSeq::serialize_element(self, v)
    }
    fn end(self) -> Result<(), Error> {
        ser::SerializeSeq::end(self)
    }
}

/// Map keys must be strings, as in JSON.
struct KeyOnly<'b>(&'b mut BytesMut);

impl ser::Serializer for KeyOnly<'_> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = ser::Impossible<(), Error>;
    type SerializeTuple = ser::Impossible<(), Error>;
    type SerializeTupleStruct = ser::Impossible<(), Error>;
    type SerializeTupleVariant = ser::Impossible<(), Error>;
    type SerializeMap = ser::Impossible<(), Error>;
    type SerializeStruct = ser::Impossible<(), Error>;
    type SerializeStructVariant = ser::Impossible<(), Error>;

    fn serialize_str(self, v: &str) -> Result<(), Error> {
        put_str(self.0, v);
        Ok(())
    }
    fn serialize_bool(self, _: bool) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_i8(self, _: i8) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_i16(self, _: i16) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_i32(self, _: i32) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_i64(self, _: i64) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_u8(self, _: u8) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_u16(self, _: u16) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_u32(self, _: u32) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_u64(self, _: u64) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_f32(self, _: f32) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_f64(self, _: f64) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_char(self, _: char) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_none(self) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_unit(self) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, v: &'static str) -> Result<(), Error> {
        self.serialize_str(v)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        unsupported("non-string map keys")
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        unsupported("non-string map keys")
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Error> {
        unsupported("non-string map keys")
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        unsupported("non-string map keys")
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        unsupported("non-string map keys")
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Error> {
        unsupported("non-string map keys")
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Error> {
        unsupported("non-string map keys")
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        unsupported("non-string map keys")
    }
}

impl ser::SerializeMap for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<(), Error> {
        self.comma();
        k.serialize(KeyOnly(self.ser.buf))?;
        self.ser.buf.put_u8(b':');
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        v.serialize(&mut *self.ser)
    }
    fn end(self) -> Result<(), Error> {
        self.ser.buf.put_u8(b'}');
        Ok(())
    }
}

impl ser::SerializeStruct for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        self.key(key);
        v.serialize(&mut *self.ser)
    }
    fn end(self) -> Result<(), Error> {
        ser::SerializeMap::end(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_escaping() {
        let mut b = BytesMut::new();
        let s = "a<b>&c\u{2028}\u{2029}é\"\\\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f}\u{2027}";
        write_go_json(&mut b, &[s]).unwrap();
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            "[\"a\\u003cb\\u003e\\u0026c\\u2028\\u2029é\\\"\\\\\\n\\r\\t\\b\\f\\u0001\\u001f\u{7f}\u{2027}\"]"
        );
        let mut b = BytesMut::new();
        let mut m = std::collections::BTreeMap::new();
        m.insert("k", (-5i32, u64::MAX, None::<bool>, Some(true)));
        write_go_json(&mut b, &m).unwrap();
        assert_eq!(&b[..], b"{\"k\":[-5,18446744073709551615,null,true]}");
        assert!(write_go_json(&mut BytesMut::new(), &1.5f64).is_err());
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
