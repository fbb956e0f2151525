//! NATS JWTs (operator, account and user claims), as nats-io/jwt writes them: three base64url
//! parts, a header `{"typ":"JWT","alg":"ed25519-nkey"}`, the claims JSON, and the ed25519
//! signature of `header.claims` by the issuer's nkey. Decoding is JSON; the signature is
//! checked by the `nkeys` crate (no cryptography here).
//!
//! Version 1 JWTs (`{"typ":"jwt","alg":"ed25519"}`, which the reference still takes) differ
//! in two ways: the signature covers the claims part alone, and the claim type is a
//! top-level `type`; it is moved into `nats` so the rest reads both alike.

use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
use base64::Engine;
use serde::Deserialize;
use serde_json::Value;

/// A decoded, signature-checked JWT.
#[derive(Debug, Clone)]
pub struct Jwt {
    /// `iss`: the public nkey that signed it.
    pub issuer: String,
    /// `sub`: whose claims these are (an operator, account or user public key).
    pub subject: String,
    pub name: String,
    /// `exp` and `nbf`, Unix seconds (0: none).
    pub expires: i64,
    pub not_before: i64,
    pub issued_at: i64,
    /// The `nats` object: type-specific claims.
    pub nats: Value,
}

#[derive(Deserialize)]
struct Header {
    #[serde(default)]
    typ: String,
    #[serde(default)]
    alg: String,
}

#[derive(Deserialize)]
struct Claims {
    #[serde(default)]
    iss: String,
    #[serde(default)]
    sub: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    exp: i64,
    #[serde(default)]
    nbf: i64,
    #[serde(default)]
    iat: i64,
    #[serde(default)]
    nats: Value,
    /// Version 1's claim type.
    #[serde(default, rename = "type")]
    v1_type: String,
}

fn b64(part: &str) -> Result<Vec<u8>, String> {
    URL_SAFE_NO_PAD
        .decode(part.trim_end_matches('='))
        .or_else(|_| STANDARD_NO_PAD.decode(part.trim_end_matches('=')))
        .map_err(|_| "invalid base64 in JWT".to_string())
}

/// Decodes `token` and checks that its issuer signed it. The claim type (`nats.type`) must
/// be `kind` ("operator", "account" or "user").
pub fn decode(token: &str, kind: &str) -> Result<Jwt, String> {
    let token = token.trim();
    let mut parts = token.split('.');
    let (Some(h), Some(c), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("not a JWT (expected three parts)".into());
    };
    let header: Header =
        serde_json::from_slice(&b64(h)?).map_err(|e| format!("invalid JWT header: {e}"))?;
    let v1 = header.alg.eq_ignore_ascii_case("ed25519");
    if !header.typ.eq_ignore_ascii_case("JWT")
        || !(v1 || header.alg.eq_ignore_ascii_case("ed25519-nkey"))
    {
        return Err(format!(
            "unsupported JWT (typ {:?}, alg {:?})",
            header.typ, header.alg
        ));
    }
    let mut claims: Claims =
        serde_json::from_slice(&b64(c)?).map_err(|e| format!("invalid JWT claims: {e}"))?;
    let sig = b64(s)?;
    let issuer = nkeys::KeyPair::from_public_key(&claims.iss)
        .map_err(|_| format!("JWT issuer {:?} is not a public nkey", claims.iss))?;
    let signed = if v1 {
        c
    } else {
        &token[..h.len() + 1 + c.len()]
    };
    issuer
        .verify(signed.as_bytes(), &sig)
        .map_err(|_| "JWT signature does not verify".to_string())?;
    if v1 {
        if !claims.nats.is_object() {
            claims.nats = Value::Object(Default::default());
        }
        if let Value::Object(o) = &mut claims.nats {
            // The top-level type is version 1's (it wins, as in the jwt library).
            if !claims.v1_type.is_empty() || !o.contains_key("type") {
                o.insert("type".into(), Value::String(claims.v1_type.clone()));
            }
            o.entry("version").or_insert(Value::from(1));
        }
    }
    let typ = claims
        .nats
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if typ != kind {
        return Err(format!("expected a {kind} JWT, got {typ:?}"));
    }
    Ok(Jwt {
        issuer: claims.iss,
        subject: claims.sub,
        name: claims.name,
        expires: claims.exp,
        not_before: claims.nbf,
        issued_at: claims.iat,
        nats: claims.nats,
    })
}

impl Jwt {
    /// Whether it is valid at `now` (Unix seconds): not expired, not before its time.
    pub fn valid_at(&self, now: i64) -> bool {
        (self.expires == 0 || now < self.expires)
            && (self.not_before == 0 || now >= self.not_before)
    }

    /// The signing keys listed in the claims (strings, or scoped `{ "key": ... }` objects).
    pub fn signing_keys(&self) -> Vec<String> {
        let Some(keys) = self.nats.get("signing_keys").and_then(Value::as_array) else {
            return Vec::new();
        };
        keys.iter()
            .filter_map(|k| match k {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("key").and_then(Value::as_str).map(str::to_string),
                _ => None,
            })
            .collect()
    }

    /// A number in `nats.<section>.<key>` (-1 when absent, the JWT's "no limit").
    pub fn limit(&self, section: &str, key: &str) -> i64 {
        self.nats
            .get(section)
            .and_then(|s| s.get(key))
            .and_then(Value::as_i64)
            .unwrap_or(-1)
    }
}

/// Whether `key` signed an account-scoped user: a scoped signing key of the account (with
/// its template permissions) or a plain one.
pub fn scoped_template(account: &Jwt, key: &str) -> Option<Value> {
    let keys = account.nats.get("signing_keys")?.as_array()?;
    keys.iter().find_map(|k| match k {
        Value::Object(o) if o.get("key").and_then(Value::as_str) == Some(key) => {
            o.get("template").cloned()
        }
        _ => None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Encodes and signs claims as nats-io/jwt does (for tests).
    pub fn encode(signer: &nkeys::KeyPair, claims: &Value) -> String {
        sign(signer, claims, false)
    }

    /// Version 2 signs `header.claims`; version 1 (`alg` ed25519) the claims part alone.
    fn sign(signer: &nkeys::KeyPair, claims: &Value, v1: bool) -> String {
        let header: &[u8] = if v1 {
            br#"{"typ":"jwt","alg":"ed25519"}"#
        } else {
            br#"{"typ":"JWT","alg":"ed25519-nkey"}"#
        };
        let h = URL_SAFE_NO_PAD.encode(header);
        let c = URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).unwrap());
        let signed = if v1 { c.clone() } else { format!("{h}.{c}") };
        let sig = signer.sign(signed.as_bytes()).unwrap();
        format!("{h}.{c}.{}", URL_SAFE_NO_PAD.encode(sig))
    }

    #[test]
    fn decode_checks_signature_and_type() {
        let op = nkeys::KeyPair::new_operator();
        let acc = nkeys::KeyPair::new_account();
        let claims = serde_json::json!({
            "iss": op.public_key(), "sub": acc.public_key(), "name": "A", "iat": 1,
            "nats": {"type": "account", "version": 2, "limits": {"conn": 5}}
        });
        let token = encode(&op, &claims);
        let j = decode(&token, "account").unwrap();
        assert_eq!(j.subject, acc.public_key());
        assert_eq!(j.limit("limits", "conn"), 5);
        assert_eq!(j.limit("limits", "subs"), -1);
        assert!(decode(&token, "user")
            .unwrap_err()
            .contains("expected a user"));
        // Signed by someone else than the issuer it names.
        let forged = encode(&acc, &claims);
        assert!(decode(&forged, "account")
            .unwrap_err()
            .contains("signature"));
        assert!(decode("a.b", "account").is_err());
        let j2 = Jwt { expires: 10, ..j };
        assert!(j2.valid_at(9) && !j2.valid_at(10));
    }

    /// A version 1 JWT, as nats.py's test fixtures still carry.
    fn encode_v1(signer: &nkeys::KeyPair, claims: &Value) -> String {
        sign(signer, claims, true)
    }

    #[test]
    fn version_1_jwts_decode() {
        let op = nkeys::KeyPair::new_operator();
        let acc = nkeys::KeyPair::new_account();
        let claims = serde_json::json!({
            "iss": op.public_key(), "sub": acc.public_key(), "name": "foo", "iat": 1,
            "type": "account", "nats": {"limits": {"conn": 3, "wildcards": true}}
        });
        let j = decode(&encode_v1(&op, &claims), "account").unwrap();
        assert_eq!((j.name.as_str(), j.limit("limits", "conn")), ("foo", 3));
        assert!(decode(&encode_v1(&op, &claims), "user").is_err());
        // No `nats` at all (an operator).
        let op_claims = serde_json::json!({
            "iss": op.public_key(), "sub": op.public_key(), "type": "operator"
        });
        assert!(decode(&encode_v1(&op, &op_claims), "operator").is_ok());
        // Version 1's signature is over the claims alone: one over header.claims fails.
        let v2_signed = encode(&op, &claims);
        let (_, rest) = v2_signed.split_once('.').unwrap();
        let relabelled = format!(
            "{}.{rest}",
            URL_SAFE_NO_PAD.encode(br#"{"typ":"jwt","alg":"ed25519"}"#)
        );
        assert!(decode(&relabelled, "account")
            .unwrap_err()
            .contains("signature"));
        // A forged one.
        assert!(decode(&encode_v1(&acc, &claims), "account").is_err());
        // The top-level type is the one that counts.
        let mixed = serde_json::json!({
            "iss": op.public_key(), "sub": acc.public_key(), "type": "account",
            "nats": {"type": "user"}
        });
        assert!(decode(&encode_v1(&op, &mixed), "account").is_ok());
        assert!(decode(&encode_v1(&op, &mixed), "user").is_err());
    }
}
