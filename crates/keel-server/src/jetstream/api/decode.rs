//! Request decoding (Go's view of a request: `null` as absent, keys matched case-insensitively,
//! unknown fields refused in strict mode, Go's error texts) and the response helpers that put
//! `type` first and `error` right after it, as the reference does.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::errors::{ApiError, ErrorKind};
use crate::jetstream::schema::{Field, Schema};

/// serde_json's error in the words of Go's encoding/json, which clients and tests match on
/// for the common syntax errors; `with_offset` appends Go's `at offset N` as the API does.
pub fn go_json_error(body: &[u8], e: &serde_json::Error, with_offset: bool) -> String {
    use serde_json::error::Category;
    let offset = if e.line() <= 1 {
        e.column()
    } else {
        // Byte offset of the error position across lines.
        let mut line = 1;
        let mut pos = 0;
        for (i, b) in body.iter().enumerate() {
            if line == e.line() {
                pos = i + e.column();
                break;
            }
            if *b == b'\n' {
                line += 1;
            }
        }
        pos
    };
    let at = body.get(offset.saturating_sub(1)).copied();
    let msg = e.to_string();
    if let Some(rest) = msg.strip_prefix("unknown variant `") {
        // Go's enum unmarshalers answer with the quoted JSON value.
        let value = rest.split('`').next().unwrap_or_default();
        return format!("can not unmarshal {:?}", format!("\"{value}\""));
    }
    if msg.starts_with("invalid type: string") && msg.contains("expected i64") {
        return "json: cannot unmarshal string into Go value of type time.Duration".into();
    }
    let text = match (e.classify(), at) {
        (Category::Eof, _) => return "unexpected end of JSON input".into(),
        (Category::Syntax, Some(c)) if msg.starts_with("key must be a string") => {
            format!(
                "invalid character '{}' looking for beginning of object key string",
                c as char
            )
        }
        (Category::Syntax, Some(c)) if msg.starts_with("expected value") => {
            format!(
                "invalid character '{}' looking for beginning of value",
                c as char
            )
        }
        _ => return msg,
    };
    if with_offset {
        format!("{text} at offset {offset}")
    } else {
        text
    }
}

/// Starts a response object with its `type`.
pub fn response(kind: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert(
        "type".into(),
        format!("io.nats.jetstream.api.v1.{kind}_response").into(),
    );
    m
}

/// A complete error response: `type`, `error`, then any extra fields.
pub fn error_response(kind: &str, e: &ApiError, extra: &[(&str, Value)]) -> Vec<u8> {
    let mut m = response(kind);
    m.insert("error".into(), e.to_json());
    for (k, v) in extra {
        m.insert((*k).into(), v.clone());
    }
    to_bytes(&Value::Object(m))
}

/// Compact JSON with `<`, `>` and `&` escaped as the reference's encoder does.
pub fn to_bytes<T: serde::Serialize + ?Sized>(v: &T) -> Vec<u8> {
    let s = serde_json::to_string(v).expect("JSON values serialize");
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            c => out.push(c),
        }
    }
    out.into_bytes()
}

/// Parses an API request the way the reference does: an empty body (or `null`, which
/// async-nats sends where other clients send nothing) is the zero request; otherwise the JSON
/// is brought into Go's view by [`normalize`] (nulls absent, keys case-insensitive, unknown
/// fields refused when `strict`) and then decoded.
pub fn parse_request<T: DeserializeOwned + Default>(
    body: &[u8],
    schema: &Schema,
    strict: bool,
) -> Result<T, ApiError> {
    let trimmed = body.trim_ascii();
    if trimmed.is_empty() || trimmed == b"null" {
        return Ok(T::default());
    }
    let mut v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::invalid_json_body(body, &e))?;
    normalize(&mut v, schema, strict).map_err(|text| ErrorKind::InvalidJson.with(text))?;
    serde_json::from_value(v).map_err(|e| ApiError::invalid_json_body(body, &e))
}

/// Like [`parse_request`] for the bodies the reference decodes leniently (pull requests,
/// direct gets): unknown fields are ignored; the error is Go's text without an offset.
pub fn parse_lenient<T: DeserializeOwned>(body: &[u8], schema: &Schema) -> Result<T, String> {
    let mut v: Value = serde_json::from_slice(body).map_err(|e| go_json_error(body, &e, false))?;
    normalize(&mut v, schema, false)?;
    serde_json::from_value(v).map_err(|e| go_json_error(body, &e, false))
}

/// Rewrites a request object into what Go's decoder would see: `null` members dropped (Go
/// leaves such a field at its zero value, which is what an absent field gets here), `null`
/// map values made empty strings, keys renamed to the field they match case-insensitively.
/// A `null` enum fails with the reference's text; with `strict`, so does an unknown field.
pub fn normalize(v: &mut Value, schema: &Schema, strict: bool) -> Result<(), String> {
    let Value::Object(m) = v else {
        return Ok(());
    };
    for (key, mut val) in std::mem::take(m) {
        let Some((name, field)) = schema.field(&key) else {
            if strict {
                return Err(format!("json: unknown field {key:?}"));
            }
            continue;
        };
        match field {
            Field::Enum(text) if val.is_null() => return Err((*text).to_string()),
            _ if val.is_null() => continue,
            Field::Map => {
                if let Value::Object(entries) = &mut val {
                    for e in entries.values_mut().filter(|e| e.is_null()) {
                        *e = Value::from("");
                    }
                }
            }
            Field::Obj(inner) => normalize(&mut val, inner, strict)?,
            Field::List(inner) => {
                if let Value::Array(items) = &mut val {
                    for item in items {
                        normalize(item, inner, strict)?;
                    }
                }
            }
            Field::Value | Field::Enum(_) => {}
        }
        m.insert((*name).to_string(), val);
    }
    Ok(())
}

/// Requests that take no body (stream delete, consumer info and delete) refuse one, as the
/// reference does; `{}` counts as empty.
pub fn expect_empty(body: &[u8]) -> Result<(), ApiError> {
    let empty = body.is_empty()
        || serde_json::from_slice::<Value>(body)
            .is_ok_and(|v| v.as_object().is_some_and(|m| m.is_empty()));
    if empty {
        Ok(())
    } else {
        Err(ErrorKind::NotEmptyRequest.err())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jetstream::schema;

    fn norm(body: &str, strict: bool) -> Result<Value, String> {
        let mut v: Value = serde_json::from_str(body).unwrap();
        normalize(&mut v, &schema::CONSUMER_CREATE, strict).map(|_| v)
    }

    #[test]
    fn nulls_are_absent_except_enums() {
        let v = norm(
            r#"{"stream_name":"S","config":{"name":null,"max_deliver":null,"metadata":{"a":null,"b":"x"},"backoff":null}}"#,
            true,
        )
        .unwrap();
        assert_eq!(
            v,
            serde_json::json!({"stream_name":"S","config":{"metadata":{"a":"","b":"x"}}})
        );
        assert_eq!(
            norm(r#"{"config":{"ack_policy":null}}"#, true).unwrap_err(),
            "can not unmarshal \"null\""
        );
        assert_eq!(
            norm(r#"{"action":null}"#, false).unwrap_err(),
            "unknown consumer action: null"
        );
    }

    #[test]
    fn unknown_fields_and_key_case() {
        assert_eq!(
            norm(r#"{"config":{"zzz":1}}"#, true).unwrap_err(),
            "json: unknown field \"zzz\""
        );
        assert_eq!(
            norm(r#"{"config":{"zzz":1}}"#, false).unwrap(),
            serde_json::json!({"config":{}})
        );
        assert_eq!(
            norm(r#"{"Stream_Name":"S"}"#, true).unwrap(),
            serde_json::json!({"stream_name":"S"})
        );
    }

    #[test]
    fn empty_requests() {
        assert!(expect_empty(b"").is_ok());
        assert!(expect_empty(b"{}").is_ok());
        assert!(expect_empty(b" { } ").is_ok());
        assert_eq!(expect_empty(b"null").unwrap_err().err_code, 10038);
        assert_eq!(expect_empty(br#"{"a":1}"#).unwrap_err().err_code, 10038);
    }
}
